"""The non-autoregressive (Mask-Predict) decoder: call counting, length predictor, re-masking
schedule, batching, bidirectional attention, training."""
import math

import pytest
import torch
import torch.nn.functional as F

import decoders.nar as nar
from decoders import build_decoder
from decoders.base import encode, hidden_mask, output_logits, relative_position_bias, run_decoder
from tasks.config import compose
from transformers import T5Config
from tests.conftest import (SPECIAL, assert_alone_equals_batched, briefly_trained,
                            first_batch_where, random_batch, tiny_t5)

pytestmark = pytest.mark.float64  # equivalence tests: see tests/conftest.py


def make(model, seed=0, **options):
    torch.manual_seed(seed)  # the length predictor's initial weights
    return build_decoder("nar", model.config, SPECIAL, **options)


# -- 1. decoder calls ---------------------------------------------------------------------------

@pytest.mark.parametrize("iterations,candidates", [(1, 1), (3, 1), (4, 3)])
def test_decoder_calls_equal_iterations_whatever_the_length(iterations, candidates):
    model = tiny_t5(0)
    decoder = make(model, iterations=iterations, length_candidates=candidates, max_length=12)
    calls = []
    real_pass = decoder.decoder_hidden

    def counting_pass(model, decoder_input, *args):
        calls.append(decoder_input.shape)  # (rows, width) of each real decoder pass
        return real_pass(model, decoder_input, *args)

    def varied(input_ids, attention_mask):
        """different predicted output lengths (else vacuous)"""
        return len(set(decoder.generate(model, input_ids, attention_mask).tokens)) >= 2
    input_ids, attention_mask = first_batch_where(varied, 6, seed=10)
    decoder.decoder_hidden = counting_pass
    out = decoder.generate(model, input_ids, attention_mask)
    assert len(calls) == iterations == out.batch_decoder_calls
    assert all(rows == 6 * candidates for rows, _ in calls)  # all candidates in one batched call
    assert out.decoder_calls == [iterations] * 6
    assert all(1 <= t <= 12 for t in out.tokens)
    assert [decoder.calls_for_output(s) for s in out.subsequences] == out.decoder_calls


# -- 2. length predictor -----------------------------------------------------------------------

def test_length_predictor_loss_and_prediction():
    model = tiny_t5(0)
    max_length, known = 10, 7
    decoder = make(model, max_length=max_length, iterations=2, length_loss_weight=0.5)
    bias = torch.full((max_length,), -1.0)
    bias[known - 1] = 5.0                       # class k <-> length k + 1
    with torch.no_grad():
        decoder.length_predictor.weight.zero_()
        decoder.length_predictor.bias.copy_(bias)

    input_ids, attention_mask = random_batch(3, seed=4)
    out = decoder.generate(model, input_ids, attention_mask)
    assert out.tokens == [known] * 3

    targets = [[[7, 8], [9]], [[10]], [[11, 12, 13, 14]]]       # flat lengths 5, 2, 5
    layout = decoder.layout(targets)
    assert layout["lengths"].tolist() == [5, 2, 5]
    # hand-computed CE: every example has logits `bias`; the loss is logsumexp - logit of the truth
    logsumexp = math.log(math.exp(5.0) + (max_length - 1) * math.exp(-1.0))
    expected_length_ce = sum(logsumexp - bias[length - 1].item() for length in (5, 2, 5)) / 3
    logits = decoder.length_logits(encode(model, input_ids, attention_mask), attention_mask)
    assert F.cross_entropy(logits, layout["lengths"] - 1).item() == pytest.approx(expected_length_ce)

    # total loss = token CE + weight * length CE: the same masking (same RNG state) without the
    # length term differs by exactly weight * the hand-computed CE
    without = make(model, max_length=max_length, length_loss_weight=0.0)
    without.load_state_dict(decoder.state_dict())
    torch.manual_seed(123)
    with_length = decoder.loss(model, input_ids, attention_mask, layout)
    torch.manual_seed(123)
    token_only = without.loss(model, input_ids, attention_mask, layout)
    assert (with_length - token_only).item() == pytest.approx(0.5 * expected_length_ce, rel=1e-5)


def test_hit_max_steps_means_cut_by_max_length():
    model = tiny_t5(0)
    with torch.no_grad():
        model.lm_head.weight[SPECIAL.eos] = 0.0  # logit 0: below the best of the other, random logits
    decoder = make(model, max_length=6, iterations=2)
    input_ids, attention_mask = random_batch(3, seed=4)
    for length, hit in ((5, False), (6, True)):
        with torch.no_grad():
            decoder.length_predictor.weight.zero_()
            decoder.length_predictor.bias.copy_(torch.eye(6)[length - 1] * 10)
        out = decoder.generate(model, input_ids, attention_mask)
        assert out.tokens == [length] * 3 and out.hit_max_steps == [hit] * 3


def test_length_pooling_ignores_source_padding():
    model = tiny_t5(0)
    decoder = make(model, max_length=12)
    input_ids, attention_mask = random_batch(4, seed=6)
    batched = decoder.length_logits(encode(model, input_ids, attention_mask), attention_mask)
    for i in range(4):
        n = int(attention_mask[i].sum())
        ids, mask = input_ids[i:i + 1, :n], attention_mask[i:i + 1, :n]
        alone = decoder.length_logits(encode(model, ids, mask), mask)
        assert torch.allclose(alone[0], batched[i], atol=1e-5)


# -- 3. masking schedule -----------------------------------------------------------------------

def test_remask_schedule_counts_ties_and_padding():
    conf = torch.tensor([[0.9, 0.2, 0.5, 0.2, 0.2, 0.7, 0.1, 0.8],
                         [0.3, 0.3, 0.3, 0.0, 0.0, 0.0, 0.0, 0.0]])   # row 1: length 3, then padding
    lengths = torch.tensor([8, 3])
    T = 4

    def remasked(t):
        m = nar.tokens_to_remask(conf, lengths, t, T)
        return [torch.nonzero(row).flatten().tolist() for row in m]

    assert remasked(0) == [list(range(8)), [0, 1, 2]]          # n = L: everything real
    # t=1: n = floor(8*3/4) = 6 and floor(3*3/4) = 2 -> row 1 ties: the lower positions first
    assert remasked(1) == [[1, 2, 3, 4, 5, 6], [0, 1]]
    # t=2: n = 4 and 1; row 0: 0.1 at 6, then the three 0.2s at 1, 3, 4 (all fit)
    assert remasked(2) == [[1, 3, 4, 6], [0]]
    # t=3: n = 2 and 0; row 0: 0.1 at 6, then one of the tied 0.2s -> the lowest position, 1
    assert remasked(3) == [[1, 6], []]
    with pytest.raises(ValueError, match="iteration must be in 0..3, got 4"):
        nar.tokens_to_remask(conf, lengths, 4, T)


def test_remask_counts_follow_floor_schedule():
    torch.manual_seed(0)
    conf = torch.rand(5, 20)
    lengths = torch.tensor([1, 2, 7, 13, 20])
    for T in (1, 2, 3, 5):
        for t in range(T):
            m = nar.tokens_to_remask(conf, lengths, t, T)
            assert m.sum(1).tolist() == [L * (T - t) // T for L in lengths.tolist()]
            assert not (m & (torch.arange(20)[None] >= lengths[:, None])).any()  # padding never


def test_training_mask_is_uniform_in_count_and_stays_inside_the_target():
    torch.manual_seed(0)
    lengths = torch.tensor([1, 4, 9])
    counts = {1: set(), 4: set(), 9: set()}
    for _ in range(300):
        m = nar.sample_training_mask(lengths, 9)
        assert not (m & (torch.arange(9)[None] >= lengths[:, None])).any()
        for L, c in zip(lengths.tolist(), m.sum(1).tolist()):
            counts[L].add(c)
    assert counts == {1: {1}, 4: {1, 2, 3, 4}, 9: set(range(1, 10))}


# -- 4. batching -------------------------------------------------------------------------------

@pytest.mark.parametrize("candidates", [1, 3])
def test_batch_equals_one_at_a_time(candidates):
    model = tiny_t5(1)
    decoder = make(model, iterations=3, length_candidates=candidates, max_length=12)
    def varied(input_ids, attention_mask):
        """different source lengths and different output lengths"""
        return (len(set(attention_mask.sum(1).tolist())) >= 3
                and len(set(decoder.generate(model, input_ids, attention_mask).tokens)) >= 2)
    input_ids, attention_mask = first_batch_where(varied, 5, seed=3)
    assert_alone_equals_batched(decoder, model, input_ids, attention_mask)


# -- 5. bidirectional attention ----------------------------------------------------------------

def test_position_zero_sees_the_last_position():
    model = tiny_t5(0)
    decoder = make(model, max_length=12)
    input_ids, attention_mask = random_batch(1, seed=2)
    states = encode(model, input_ids, attention_mask)
    width = 6
    first = torch.tensor([[SPECIAL.mask, 10, 11, 12, 13, 14]])
    second = first.clone()
    second[0, -1] = 40                                            # change only the last input token

    valid = torch.ones(1, width, dtype=torch.bool)
    bidirectional = nar.self_attention_bias(model, valid)
    distance = (torch.arange(width)[:, None] - torch.arange(width)[None, :]).clamp(min=0)[None]
    causal = relative_position_bias(model, distance) + hidden_mask(
        torch.ones(width, width, dtype=torch.bool).tril()[None], states.dtype)

    with torch.no_grad():
        def pos0(tokens, bias):
            return decoder.decoder_hidden(model, tokens, bias, states, attention_mask)[0, 0]
        assert not torch.allclose(pos0(first, bidirectional), pos0(second, bidirectional), atol=1e-4)
        assert torch.equal(pos0(first, causal), pos0(second, causal))   # control


def test_all_mask_first_pass_tells_positions_apart():
    """T5 has no absolute positions: with every input the mask token, its blocks give every position
    the same state whatever the relative bias (all value vectors are equal). The decoder's position
    embedding is what lets one-pass generation produce different tokens at different positions."""
    model = tiny_t5(0)
    decoder = make(model, max_length=12)
    input_ids, attention_mask = random_batch(1, seed=2)
    states = encode(model, input_ids, attention_mask)
    masks = torch.full((1, 8), SPECIAL.mask)
    bias = nar.self_attention_bias(model, torch.ones(1, 8, dtype=torch.bool))
    with torch.no_grad():
        plain = run_decoder(model, masks, bias, states, attention_mask)[0]           # (8, d_model)
        with_positions = decoder.decoder_hidden(model, masks, bias, states, attention_mask)[0]
    assert torch.allclose(plain, plain[:1].expand_as(plain), atol=1e-4)          # position-blind
    assert (with_positions - with_positions[:1]).abs().amax(1)[1:].min() > 1e-2   # all distinct
    assert len(set(output_logits(model, with_positions).argmax(-1).tolist())) >= 2  # tokens differ


def test_bidirectional_bias_uses_t5_bidirectional_buckets():
    model = tiny_t5(0)
    attention = model.decoder.block[0].layer[0].SelfAttention
    bias = nar.bidirectional_position_bias(model, 5, torch.device("cpu"))   # (1, heads, 5, 5)
    # key 4 of query 1 lies 3 ahead: bidirectional bucket of +3 = 16 (future half) + 3
    assert torch.equal(bias[0, :, 1, 4], attention.relative_attention_bias.weight[16 + 3])
    assert torch.equal(bias[0, :, 4, 1], attention.relative_attention_bias.weight[3])   # 3 behind


# -- 6. training -------------------------------------------------------------------------------

def test_training_reduces_loss_on_a_tiny_batch():
    model = tiny_t5(0).train()
    decoder = make(model, max_length=12)
    input_ids, attention_mask = random_batch(4, max_len=8, seed=5)
    targets = [[[7, 8], [9, 10]], [[11]], [[12, 13, 14]], [[15], [16], [17]]]
    layout = decoder.layout(targets)

    def fixed_mask_loss():
        torch.manual_seed(99)  # the same masks before and after: compare like with like
        with torch.no_grad():
            return decoder.loss(model, input_ids, attention_mask, layout).item()

    before = fixed_mask_loss()
    optimizer = torch.optim.AdamW(list(model.parameters()) + list(decoder.parameters()), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(40):
        loss = decoder.loss(model, input_ids, attention_mask, layout)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = fixed_mask_loss()
    assert after < 0.5 * before, (before, after)
    assert decoder.length_predictor.weight.grad is not None   # the length predictor is trained too


def test_briefly_trained_decodes_something():
    decoder = make(tiny_t5(0), max_length=16, iterations=4, length_candidates=2)
    model = briefly_trained(decoder)
    input_ids, attention_mask = random_batch(6, max_len=9, seed=77)
    out = decoder.generate(model, input_ids, attention_mask)
    assert sum(len(s) for subs in out.subsequences for s in subs) > 0
    assert all(SPECIAL.mask not in s for subs in out.subsequences for s in subs)


# -- layout, options, config -------------------------------------------------------------------

def test_layout_is_the_sequential_flat_target():
    decoder = make(tiny_t5(0))
    layout = decoder.layout([[[7, 8], [9]], [[10]], []])
    assert layout["target"].tolist() == [[7, 8, SPECIAL.sep, 9, SPECIAL.eos],
                                         [10, SPECIAL.eos, 0, 0, 0], [SPECIAL.eos, 0, 0, 0, 0]]
    assert layout["lengths"].tolist() == [5, 2, 1]
    short = make(tiny_t5(0), max_length=3).layout([[[7, 8], [9]]])   # cut to max_length
    assert short["target"].tolist() == [[7, 8, SPECIAL.sep]] and short["lengths"].tolist() == [3]


@pytest.mark.parametrize("options,needle", [
    ({"iterations": 0}, "decoder.iterations must be an integer >= 1, got 0"),
    ({"length_candidates": 0},
     "decoder.length_candidates must be an integer >= 1 and <= decoder.max_length (96), got 0"),
    ({"length_candidates": 5, "max_length": 4}, "<= decoder.max_length (4), got 5"),
    ({"length_loss_weight": -1.0}, "decoder.length_loss_weight must be a finite number >= 0, got -1.0"),
    ({"max_length": 0}, "decoder.max_length must be an integer >= 1, got 0"),
])
def test_bad_options_fail_clearly(options, needle):
    with pytest.raises(ValueError) as err:
        build_decoder("nar", T5Config(d_model=32), SPECIAL, **options)
    assert needle in str(err.value)


def test_config_options_and_family():
    cfg = compose("keyphrase", "nar", None, ["data.max_target_length=40", "decoder.iterations=2"])
    assert dict(cfg.decoder) == {"name": "nar", "iterations": 2, "length_candidates": 1,
                                 "length_loss_weight": 0.1, "max_length": 40}
    assert nar.MaskPredictDecoder.layout_family == "nar"


def test_decode_options_change_nothing_trained():
    """iterations and length_candidates are generation-only: a decoder built with other values
    loads the trained decoder's weights (what tasks.compare does when sweeping them)."""
    assert set(nar.MaskPredictDecoder.decode_options) == {"iterations", "length_candidates"}
    trained = make(tiny_t5(0), max_length=12)
    other = make(tiny_t5(0), seed=5, max_length=12, iterations=10, length_candidates=4)
    other.load_state_dict(trained.state_dict())
    assert torch.equal(other.position_embedding.weight, trained.position_embedding.weight)
