"""The one-step (proto-token) decoder and the proto-token reconstruction experiment.

Decoder: one decoder call per batch, alone == in a batch, the loss equals T5's own forward on the
proto-token input embeddings, a position's output does not depend on the output width (causal),
the backbone gets no gradient and stays bit-identical under training, checkpoint compatibility.
Experiment (`tasks.experiments.prototokens`): optimised proto-tokens reconstruct short targets exactly, and the
accuracy it reports is the argmax agreement that T5's own forward gives; end to end (slow), JSON,
plot and MLflow run. End to end (slow): `tasks.fit --decoder onestep train.init_from=<sequential>`.
"""
import json

import pytest
import torch
import torch.nn.functional as F

from decoders import build_decoder, decoder_class
from decoders.loop import split_flat_output
from decoders.onestep import one_pass_logits
from tasks.experiments import prototokens
from tests.conftest import (SPECIAL, assert_alone_equals_batched, briefly_trained,
                            first_batch_where, random_batch, tiny_t5)

pytestmark = [pytest.mark.float64, pytest.mark.numerics]  # see tests/conftest.py

TARGETS = [[[5, 6], [7]], [[8]], [[9, 10, 11], [12, 13]], [[14]]]  # -100-padded to different widths


def onestep(model, max_new_tokens=12):
    return build_decoder("onestep", model.config, SPECIAL, max_new_tokens=max_new_tokens)


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
        return (len({str(s) for s in out.subsequences}) >= 3 and any(out.bound_hit)
                and not all(out.bound_hit))
    input_ids, attention_mask = first_batch_where(varied, 8, max_len=9, seed=40)
    assert_alone_equals_batched(decoder, model, input_ids, attention_mask)


def test_decodes_the_argmax_of_t5s_own_forward_up_to_the_end_token(trained):
    model, decoder = trained
    input_ids, attention_mask = random_batch(8, max_len=9, seed=40)
    out = decoder.generate(model, input_ids, attention_mask)
    with torch.no_grad():
        argmax = t5_forward(model, decoder, input_ids, attention_mask, 12).logits.argmax(-1).tolist()
    for row, subsequences, tokens, cut in zip(argmax, out.subsequences, out.tokens, out.bound_hit):
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
    so `max_new_tokens` only cuts the output."""
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
    assert dict(cfg.decoder) == {"name": "onestep", "max_new_tokens": cfg.data.max_target_length,
                                 "compile": False}
    assert decoder_class("onestep").decode_only_options() == ("max_new_tokens", "compile")
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=rf"decoder\.max_new_tokens must be an integer >= 1.*got {bad!r}"):
            onestep(tiny_t5(0), max_new_tokens=bad)


# ---- the reconstruction experiment --------------------------------------------------------------

def encoded(model, batch_size, seed):
    input_ids, attention_mask = random_batch(batch_size, seed=seed)
    with torch.no_grad():
        return model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state, attention_mask


def reconstruct(model, targets, states, mask, arrangement="e-m", share="none", restarts=1,
                iterations=200, lr=0.1, seed=0):
    return prototokens.reconstruct(model, SPECIAL.start, targets, states, mask, arrangement, share,
                                   restarts, iterations, lr, 0.01, torch.Generator().manual_seed(seed))


def own_argmax(model, e, m, pattern, states, mask):
    """T5's own forward on the proto-token input built from e, m (each (T, d_model)) by `pattern`
    ((W,) True = e): its argmax tokens (T, W)."""
    embeds = torch.where(pattern[None, :, None], e[:, None], m[:, None])
    with torch.no_grad():
        return model(encoder_outputs=(states,), attention_mask=mask,
                     decoder_inputs_embeds=embeds).logits.argmax(-1)


def test_optimised_proto_tokens_reconstruct_short_targets_exactly():
    model = tiny_t5(0, initializer_factor=1.0)
    states, mask = encoded(model, 3, seed=3)
    targets = [[7], [9, 12], [20, 33]]
    result = reconstruct(model, targets, states, mask)
    assert result.perfect.all() and result.correct.tolist() == [[1, 2, 2]]
    assert (result.iterations < 200).all()  # stopped early, at perfect reconstruction
    # T5's own forward on the returned proto-tokens writes the targets
    for t, target in enumerate(targets):
        pattern = prototokens.ARRANGEMENTS["e-m"](torch.arange(len(target)))
        argmax = own_argmax(model, result.e[0, t:t + 1], result.m[0, t:t + 1], pattern,
                            states[t:t + 1], mask[t:t + 1])
        assert argmax[0].tolist() == target


def test_accuracy_counts_the_positions_where_t5s_argmax_is_the_target():
    """With no optimisation step, the reported count is that of the initial proto-tokens: made
    exactly 4 of 6 by building the target from T5's own argmax with two positions changed."""
    model = tiny_t5(0, initializer_factor=1.0)
    states, mask = encoded(model, 1, seed=3)
    initial = reconstruct(model, [[5] * 6], states, mask, iterations=0)    # the seed's draws
    pattern = prototokens.ARRANGEMENTS["e-m"](torch.arange(6))
    target = own_argmax(model, initial.e[0], initial.m[0], pattern, states, mask)[0].tolist()
    for position in (1, 3):
        target[position] = 5 + (target[position] - 5 + 1) % 59            # any other token
    result = reconstruct(model, [target], states, mask, iterations=0)
    assert result.correct.tolist() == [[4]] and not result.perfect.any()
    assert result.iterations.tolist() == [[0]]                               # the budget


def test_one_proto_token_cannot_write_two_different_tokens_in_t5():
    """[e, e, ..., e]: every position attends to identical values (T5 has no absolute positions),
    so every position writes the same token; [e, m] writes the same target."""
    model = tiny_t5(0, initializer_factor=1.0)
    states, mask = encoded(model, 1, seed=3)
    assert not reconstruct(model, [[9, 12]], states, mask, arrangement="e-e", iterations=60).perfect.any()
    assert reconstruct(model, [[9, 12]], states, mask, arrangement="e-m", iterations=60).perfect.all()


@pytest.mark.parametrize("share", ["m", "e"])
def test_a_shared_proto_token_is_one_vector_per_restart(share):
    model = tiny_t5(0, initializer_factor=1.0)
    states, mask = encoded(model, 4, seed=3)
    result = reconstruct(model, [[7, 9], [20, 33], [12, 40]], states[:3], mask[:3], share=share,
                         restarts=2, iterations=5)
    shared, own = (result.m, result.e) if share == "m" else (result.e, result.m)
    for r in range(2):
        assert torch.equal(shared[r, 0], shared[r, 1]) and torch.equal(shared[r, 0], shared[r, 2])
        assert not torch.equal(own[r, 0], own[r, 1]) and not torch.equal(own[r, 1], own[r, 2])
    assert not torch.equal(shared[0, 0], shared[1, 0])  # restarts draw their own
    # a problem is a restart's texts together: the same iteration count for all of them
    assert all(len(set(row)) == 1 for row in result.iterations.tolist())


def test_bad_settings_are_named(tmp_path):
    with pytest.raises(prototokens.ConfigError, match="--arrangement: 'e-x' is not one of e-m, e-e"):
        prototokens.main(["--ckpt", "unused", "--arrangement", "e-m,e-x"])
    with pytest.raises(prototokens.ConfigError, match="--lengths: '0' is not a valid value"):
        prototokens.main(["--ckpt", "unused", "--lengths", "1,0"])
    with pytest.raises(prototokens.ConfigError, match="--iterations=-1 must be >= 0"):
        prototokens.main(["--ckpt", "unused", "--iterations", "-1"])
    path = tmp_path / "pipelined.ckpt"
    torch.save({"hyper_parameters": {"cfg": {"decoder": {"name": "pipelined"}}}, "state_dict": {}}, path)
    with pytest.raises(prototokens.ConfigError, match="trained with decoder 'pipelined'.*not of "
                                                      "the sequential layout"):
        prototokens.main(["--ckpt", str(path)])


# ---- end to end (slow) -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sequential_fit(tmp_path_factory):
    """A TINY sequential fit (the frozen backbone of both end-to-end tests) and its tracking."""
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


@pytest.mark.slow
def test_prototokens_writes_json_plot_and_mlflow_run(sequential_fit, tmp_path):
    from mlflow.tracking import MlflowClient
    from tests.test_end_to_end import tracking
    sequential, folder = sequential_fit
    out = tmp_path / "proto" / "result.json"
    torch.set_default_dtype(torch.float32)
    try:
        result = prototokens.main(["--ckpt", sequential["checkpoint"], "--texts", "2",
                                   "--lengths", "2,1", "--iterations", "100", "--restarts", "2",
                                   "--lr", "0.1", "--out", str(out), *tracking(folder)])
    finally:
        torch.set_default_dtype(torch.float64)
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(result))
    assert written["lengths"] == [1, 2] and written["texts"] == 2 and written["share"] == "none"
    assert written["optimizer"] == {"name": "AdamW", "lr": 0.1, "weight_decay": 0.01,
                                    "betas": [0.9, 0.999], "iterations": 100,
                                    "init": "standard normal", "early_stop": "perfect reconstruction"}
    cases = [(r["arrangement"], r["context"], r["length"]) for r in written["results"]]
    assert cases == [(a, c, n) for a in ("e-m", "e-e", "e-m-alternating")
                     for c in ("with", "without") for n in (1, 2)]
    for r in written["results"]:
        assert r["texts"] == 2 and len(r["per_text"]) == 2
        for text in r["per_text"]:
            assert 0 <= text["correct"] <= r["length"] and text["restart"] in (0, 1)
            assert text["accuracy"] == text["correct"] / r["length"]
            assert text["perfect"] == (text["correct"] == r["length"])
            assert text["iterations"] <= 100 and (text["perfect"] or text["iterations"] == 100)
        assert r["accuracy_mean"] == pytest.approx(sum(t["accuracy"] for t in r["per_text"]) / 2)
    # length 1 is one token from [e] (or [m]): reached in 100 steps at lr 0.1
    assert all(r["perfect"] == 2 for r in written["results"] if r["length"] == 1)
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    client = MlflowClient(f"sqlite:///{folder}/mlflow.db")
    run = client.get_run(result["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["role"] == "prototokens"
    assert run.data.params["prototokens.share"] == "none" and run.data.params["model.d_model"] == "32"
    history = client.get_metric_history(run.info.run_id, "accuracy/e-m/with")
    assert sorted(m.step for m in history) == [1, 2]
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"result.json", "result.png"}
