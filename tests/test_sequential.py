"""The sequential decoder equals transformers' greedy `generate`, token for token."""
import pytest
import torch
from transformers import T5Config, T5ForConditionalGeneration

from decoders import build_decoder
from decoders.loop import split_on
from tasks.comparison.timing import TransformersGenerate
from tests.conftest import (SPECIAL, assert_alone_equals_batched, briefly_trained,
                            first_batch_where, random_batch, tiny_t5)

pytestmark = [pytest.mark.float64, pytest.mark.numerics]  # see tests/conftest.py


def reference_subsequences(model, input_ids, attention_mask, max_new_tokens):
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                         num_beams=1, max_new_tokens=max_new_tokens)
    rows = []
    for row in out[:, 1:].tolist():          # drop the decoder start token
        if SPECIAL.eos in row:
            row = row[: row.index(SPECIAL.eos) + 1]
        rows.append(row)
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_transformers_generate_batched(seed):
    model = tiny_t5(seed)

    def varied(input_ids, attention_mask):
        """outputs of at least 3 different lengths (not vacuous: rows end at different steps)"""
        return len({len(r) for r in reference_subsequences(model, input_ids, attention_mask, 15)}) >= 3
    input_ids, attention_mask = first_batch_where(varied, 6, seed=seed + 10)
    decoder = build_decoder("sequential", model.config, SPECIAL, max_new_tokens=15)
    out = decoder.generate(model, input_ids, attention_mask)
    reference = reference_subsequences(model, input_ids, attention_mask, 15)
    for i, ref in enumerate(reference):
        ended = ref[-1] == SPECIAL.eos
        assert out.subsequences[i] == split_on(ref[:-1] if ended else ref, SPECIAL.sep)
        assert out.decoder_calls[i] == len(ref)
        if ended:  # the count of an output that ended by itself is a function of the output
            assert decoder.calls_for_output(out.subsequences[i]) == len(ref)
        assert out.bound_hit[i] == (not ended)
    assert out.batch_decoder_calls == max(len(r) for r in reference)


def test_alone_equals_in_batch():
    model = tiny_t5(1)
    input_ids, attention_mask = random_batch(5, seed=3)
    decoder = build_decoder("sequential", model.config, SPECIAL, max_new_tokens=12)
    assert_alone_equals_batched(decoder, model, input_ids, attention_mask)


def test_layout_joins_with_separator_and_ends():
    decoder = build_decoder("sequential", tiny_t5(0).config, SPECIAL)
    labels = decoder.layout([[[7, 8], [9]], [[10]]])["labels"]
    assert labels.tolist() == [[7, 8, SPECIAL.sep, 9, SPECIAL.eos], [10, SPECIAL.eos, -100, -100, -100]]


def test_loss_is_t5_cross_entropy():
    model = tiny_t5(0)
    input_ids, attention_mask = random_batch(2, seed=4)
    decoder = build_decoder("sequential", model.config, SPECIAL)
    layout = decoder.layout([[[7, 8], [9]], [[10]]])
    loss = decoder.loss(model, input_ids, attention_mask, layout)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, labels=layout["labels"]).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), layout["labels"].flatten(),
                                                 ignore_index=-100)
    assert torch.allclose(loss, expected)


def test_matches_transformers_generate_after_training():
    decoder = build_decoder("sequential", tiny_t5(0).config, SPECIAL, max_new_tokens=20)
    model = briefly_trained(decoder)

    def varied(input_ids, attention_mask):
        """some output longer than one token, and outputs of at least 2 different lengths"""
        lengths = [len(r) for r in reference_subsequences(model, input_ids, attention_mask, 20)]
        return max(lengths) > 1 and len(set(lengths)) >= 2
    input_ids, attention_mask = first_batch_where(varied, 6, max_len=9, seed=77)
    out = decoder.generate(model, input_ids, attention_mask)
    reference = reference_subsequences(model, input_ids, attention_mask, 20)
    for i, ref in enumerate(reference):
        ended = ref[-1] == SPECIAL.eos
        assert out.subsequences[i] == split_on(ref[:-1] if ended else ref, SPECIAL.sep)


def test_generate_reference_decodes_a_decoder_deeper_than_its_encoder():
    """transformers' `generate` makes its cache one layer per encoder layer, which fails on a deeper
    decoder (QA's default model has 3 decoder layers on 2 encoder ones); the speed tables' reference
    row (`TransformersGenerate`) gives it a cache that grows, and equals sequential there too."""
    torch.manual_seed(0)
    config = T5Config(**(tiny_t5(0).config.to_dict() | {"num_decoder_layers": 3}))
    model = T5ForConditionalGeneration(config).eval()
    assert model.config.num_decoder_layers > model.config.num_layers
    input_ids, attention_mask = random_batch(6, seed=3)
    reference = TransformersGenerate(15, SPECIAL).generate(model, input_ids, attention_mask)
    out = build_decoder("sequential", model.config, SPECIAL, max_new_tokens=15).generate(
        model, input_ids, attention_mask)
    assert any(out.subsequences)
    assert reference.subsequences == out.subsequences
    assert reference.bound_hit == out.bound_hit
