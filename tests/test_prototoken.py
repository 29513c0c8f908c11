"""The one-step (proto-token) decoder: one decoder call per batch, alone == in a batch, the loss
equals T5's own forward on the proto-token input embeddings, a position's output does not depend on
the output width (causal), the backbone gets no gradient and stays bit-identical under training,
checkpoint compatibility. End to end (slow): `tasks.fit --decoder onestep train.init_from=<a
sequential checkpoint>` keeps that backbone bit for bit.
"""
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from decoders import build_decoder, decoder_class
from decoders.base import split_flat_output
from decoders.prototoken import one_pass_logits
from tests.conftest import (SPECIAL, assert_alone_equals_batched, briefly_trained,
                            first_batch_where, random_batch, tiny_t5)

pytestmark = pytest.mark.float64  # equivalence tests: see tests/conftest.py

TARGETS = [[[5, 6], [7]], [[8]], [[9, 10, 11], [12, 13]], [[14]]]  # -100-padded to different widths


def onestep(model, max_length=12):
    return build_decoder("onestep", model.config, SPECIAL, max_length=max_length)


@pytest.fixture(scope="module")
def trained():
    """A briefly trained sequential model (the frozen backbone), then a briefly trained onestep
    decoder on it: outputs that differ between examples in tokens and length."""
    sequential = build_decoder("sequential", tiny_t5(0).config, SPECIAL, max_new_tokens=12)
    model = briefly_trained(sequential, steps=60, model=tiny_t5(0, initializer_factor=1.0))
    decoder = onestep(model)
    briefly_trained(decoder, steps=120, model=model)
    return model, decoder.eval()


def t5_forward(model, decoder, input_ids, attention_mask, width, labels=None):
    """T5's own forward (its own causal mask and relative bias) with the proto-tokens as the
    decoder's input embeddings: an implementation independent of `one_pass_logits`."""
    states = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    start = model.get_input_embeddings().weight[SPECIAL.start]
    embeds = start + decoder.offsets(states, attention_mask, width)           # (B, W, d_model)
    return model(input_ids=input_ids, attention_mask=attention_mask, decoder_inputs_embeds=embeds,
                 labels=labels)


# ---- the decoder ---------------------------------------------------------------------------------

def test_one_decoder_call_decodes_the_whole_batch(trained):
    model, decoder = trained
    input_ids, attention_mask = random_batch(6, seed=8)
    calls = []
    hook = model.decoder.final_layer_norm.register_forward_hook(lambda *_: calls.append(1))
    try:
        out = decoder.generate(model, input_ids, attention_mask)
    finally:
        hook.remove()
    assert len(calls) == 1
    assert out.batch_decoder_calls == 1 and out.decoder_calls == [1] * 6


def test_alone_equals_batched(trained):
    model, decoder = trained

    def varied(input_ids, attention_mask):
        """outputs that differ, some ending before the bound and some reaching it"""
        out = decoder.generate(model, input_ids, attention_mask)
        return (len({str(s) for s in out.subsequences}) >= 3 and any(out.hit_max_steps)
                and not all(out.hit_max_steps))
    input_ids, attention_mask = first_batch_where(varied, 8, max_len=9, seed=40)
    assert_alone_equals_batched(decoder, model, input_ids, attention_mask)


def test_decodes_the_argmax_of_t5s_own_forward_up_to_the_end_token(trained):
    model, decoder = trained
    input_ids, attention_mask = random_batch(8, max_len=9, seed=40)
    out = decoder.generate(model, input_ids, attention_mask)
    with torch.no_grad():
        argmax = t5_forward(model, decoder, input_ids, attention_mask, 12).logits.argmax(-1).tolist()
    for row, subsequences, tokens, cut in zip(argmax, out.subsequences, out.tokens, out.hit_max_steps):
        assert (subsequences, not cut) == split_flat_output(row, SPECIAL)
        assert tokens == (row.index(SPECIAL.eos) + 1 if SPECIAL.eos in row else 12)


def test_loss_is_cross_entropy_of_t5s_own_forward_on_the_proto_tokens():
    model = tiny_t5(0)
    decoder = onestep(model)
    torch.nn.init.normal_(decoder.proto_encoder.w2.weight)  # e depends on the source (not just b)
    input_ids, attention_mask = random_batch(4, seed=4)
    layout = decoder.layout(TARGETS)
    labels = layout["labels"]
    assert labels.tolist()[1] == [8, SPECIAL.eos] + [-100] * 5       # the flat layout, padded
    loss = decoder.loss(model, input_ids, attention_mask, layout)
    expected = t5_forward(model, decoder, input_ids, attention_mask, labels.size(1), labels).loss
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-10)
    # and by hand from the logits: mean over the 5 + 2 + 7 + 2 labelled positions
    logits = t5_forward(model, decoder, input_ids, attention_mask, labels.size(1)).logits
    by_hand = sum(F.cross_entropy(logits[i, :n], labels[i, :n], reduction="sum")
                  for i, n in enumerate([5, 2, 7, 2])) / 16
    torch.testing.assert_close(loss, by_hand, rtol=1e-10, atol=1e-10)


def test_a_position_sees_only_earlier_proto_tokens():
    """Causal: the first 5 positions' logits are the same whether the call has 5 or 12 positions,
    so `max_length` only cuts the output."""
    model = tiny_t5(1)
    decoder = onestep(model)
    input_ids, attention_mask = random_batch(3, seed=5)
    with torch.no_grad():
        states = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        offsets = decoder.offsets(states, attention_mask, 12)
        offsets = offsets + torch.randn(offsets.shape)  # every position a different input
        long = one_pass_logits(model, SPECIAL.start, offsets, states, attention_mask)
        short = one_pass_logits(model, SPECIAL.start, offsets[:, :5], states, attention_mask)
        changed_future = offsets.clone()
        changed_future[:, 5:] += 1.0
        future = one_pass_logits(model, SPECIAL.start, changed_future, states, attention_mask)
    # equal up to float64 rounding (calls of other widths sum in other orders)
    torch.testing.assert_close(short, long[:, :5], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(future[:, :5], long[:, :5], rtol=1e-9, atol=1e-9)
    assert not torch.allclose(future[:, 5:], long[:, 5:])


def test_training_leaves_the_backbone_bit_identical():
    model = tiny_t5(0).train()
    decoder = onestep(model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    proto_before = {name: p.detach().clone() for name, p in decoder.named_parameters()}
    # weight decay on: a backbone weight with a (zero) gradient would still be decayed
    optimizer = torch.optim.AdamW(list(model.parameters()) + list(decoder.parameters()), lr=1e-2,
                                  weight_decay=0.1)
    for step in range(3):
        input_ids, attention_mask = random_batch(4, seed=20 + step)
        loss = decoder.loss(model, input_ids, attention_mask, decoder.layout(TARGETS))
        optimizer.zero_grad()
        loss.backward()
        assert all(p.grad is None for p in model.parameters())
        optimizer.step()
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert all(p.requires_grad for p in model.parameters())  # the caller's flags are untouched
    changed = {name for name, p in decoder.named_parameters() if not torch.equal(p, proto_before[name])}
    assert changed == set(proto_before)  # w1, w2 (weights, biases) and m all learn


def test_calls_for_output_is_one():
    decoder = onestep(tiny_t5(0))
    for subsequences in ([], [[5]], [[5, 6, 7], [8, 9]] * 10):
        assert decoder.calls_for_output(subsequences) == 1


def test_checkpoint_compatibility():
    one, seq, bw = (decoder_class(name) for name in ("onestep", "sequential", "blockwise"))
    assert one.can_decode_checkpoint_of(one)
    # the proto-token encoder is in no other checkpoint
    assert not one.can_decode_checkpoint_of(seq) and not one.can_decode_checkpoint_of(bw)
    # its frozen backbone is a sequential model's
    assert seq.can_decode_checkpoint_of(one)


def test_options():
    from tasks.config import compose
    cfg = compose(task="keyphrase", decoder="onestep")
    assert dict(cfg.decoder) == {"name": "onestep", "max_length": cfg.data.max_target_length}
    assert decoder_class("onestep").decode_options == ("max_length",)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=rf"decoder\.max_length must be an integer >= 1.*got {bad!r}"):
            onestep(tiny_t5(0), max_length=bad)


# ---- end to end (slow) -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sequential_fit(tmp_path_factory):
    """A TINY sequential fit (the frozen backbone of the end-to-end tests) and its tracking."""
    from tasks import fit
    from tests.test_end_to_end import TINY, tracking
    folder = tmp_path_factory.mktemp("sequential")
    torch.set_default_dtype(torch.float32)  # a real fit, as the command line runs it
    try:
        result = fit.main(["--task", "keyphrase", *TINY, *tracking(folder)])
    finally:
        torch.set_default_dtype(torch.float64)
    return result, folder


@pytest.mark.slow
def test_onestep_fit_on_a_sequential_checkpoint_keeps_its_backbone(sequential_fit):
    from mlflow.tracking import MlflowClient
    from tasks import fit, test as test_entry
    from tasks.config import ConfigError
    from tests.test_end_to_end import TINY, run_artifact_rows, tracking, weights
    sequential, folder = sequential_fit
    torch.set_default_dtype(torch.float32)
    try:
        result = fit.main(["--task", "keyphrase", "--decoder", "onestep",
                           f"train.init_from={sequential['checkpoint']}", *TINY,
                           "trainer.max_epochs=2", *tracking(folder)])
        start, end = weights(sequential["checkpoint"]), weights(result["checkpoint"])
        backbone = [key for key in start if key.startswith("backbone.")]
        assert backbone and all(torch.equal(start[key], end[key]) for key in backbone)
        assert {"decoder.m_offset", "decoder.proto_encoder.w1.weight"} <= set(end)
        assert result["scores"]["decoder_calls_per_example"] == 1.0
        client = MlflowClient(f"sqlite:///{folder}/mlflow.db")
        assert client.get_run(result["run_id"]).data.params["decoder.name"] == "onestep"

        # its backbone is the sequential model: sequential decoding of it predicts the same
        again = test_entry.main(["--ckpt", result["checkpoint"], "decoder=sequential",
                                 *tracking(folder), "trainer.enable_progress_bar=false"])
        predicted = [[row["prediction"] for row in run_artifact_rows(client, run, folder / name)]
                     for name, run in (("again", again["run_id"]), ("seq", sequential["run_id"]))]
        assert predicted[0] == predicted[1]
        # a sequential checkpoint lacks the proto-token encoder
        with pytest.raises(ConfigError, match="trained with decoder 'sequential'; decoder 'onestep' "
                                              "cannot decode it"):
            test_entry.main(["--ckpt", sequential["checkpoint"], "decoder=onestep", *tracking(folder)])
    finally:
        torch.set_default_dtype(torch.float64)
