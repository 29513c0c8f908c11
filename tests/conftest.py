"""Shared fixtures: a tiny random T5 (d_model 32, 2+2 layers) and its special tokens; a task
module saved as a checkpoint without training (`save_checkpoint`).

Equivalence tests (two code paths, one answer) run in float64: the tiny random models below are
ill-conditioned on purpose (large init scale, so that outputs vary), and in float32 the rounding of
one CPU's kernels can flip an argmax that another CPU's does not. A test module opts in with
`pytestmark = pytest.mark.float64`; every module and tensor it creates is then float64.

float64 narrows the differences between CPUs, it does not remove them: a model trained for a few
dozen steps on one kernel level (`ATEN_CPU_CAPABILITY`) is not bit for bit the model trained on
another, and its greedy outputs may differ. So no test relies on a particular output of a trained
or random model: a test that needs a case (an output of several subsequences, an example that
ends by itself) finds it by property among many candidates (`first_batch_where`), or builds it by
construction (docs/testing.md). Such modules are marked `numerics`, and CI runs them at every
kernel level.

`PIPEDEC_TEST_SEED=N` shifts every seed below by N, so that the suite can be run under several
random draws: a test whose "not vacuous" guard held only by the luck of one draw fails there.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
import torch
from transformers import T5Config, T5ForConditionalGeneration

import datamodules.hub
from decoders import SpecialTokens, build_decoder
from decoders.drafts import DraftCounters
from decoders.loop import through_end
from decoders.transformers_internals import set_attention_implementation

VOCAB = 64
SPECIAL = SpecialTokens(pad=0, eos=1, unk=2, sep=3, mask=4, start=0)
# A draft-and-verify decoder that feeds every call's drafts (`min_acceptance` 0), not only where
# feeding was measured to pay: a test's calls then follow from its drafts alone.
ALWAYS_FEED = {"min_acceptance": 0.0}


def always_feeding(name: str) -> dict:
    """`ALWAYS_FEED` where decoder `name` feeds drafts, else nothing: options for a test that
    compares the calls of two decodes."""
    from decoders import decoder_class
    return ALWAYS_FEED if "min_acceptance" in decoder_class(name).options else {}
SEED_SHIFT = int(os.environ.get("PIPEDEC_TEST_SEED", "0"))


@pytest.fixture(scope="module", autouse=True)
def float64_default(request):
    """float64 as torch's default dtype for the whole of a module marked `float64` (module scope,
    so that module-scoped fixtures such as trained models are built in float64 too)."""
    if request.node.get_closest_marker("float64") is None:
        yield
        return
    with default_dtype(torch.float64):
        yield


@contextmanager
def default_dtype(dtype: torch.dtype):
    """torch's default dtype is `dtype` inside the block, and what it was after it."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def tiny_t5(seed: int = 0, initializer_factor: float = 6.0, **overrides) -> T5ForConditionalGeneration:
    """A tiny random T5 whose greedy outputs vary and end at different steps.

    At T5's default init scale a random decoder mostly repeats its input token, which would make
    equivalence tests vacuous; a larger init scale gives varied tokens, and pointing the end token's
    output row at the model's favourite token makes sequences end after a few, differing steps.
    """
    torch.manual_seed(seed + SEED_SHIFT)
    config = T5Config(vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
                      num_decoder_layers=2, dropout_rate=0.0, decoder_start_token_id=0,
                      pad_token_id=0, eos_token_id=1, initializer_factor=initializer_factor, **overrides)
    set_attention_implementation(config, "eager")
    model = T5ForConditionalGeneration(config).eval()
    input_ids, attention_mask = random_batch(6, seed=seed)
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                             num_beams=1, max_new_tokens=15)
        favourite = torch.mode(out[:, 1:].flatten()).values
        model.lm_head.weight[SPECIAL.eos] = model.lm_head.weight[favourite] * 1.02
    return model


@pytest.fixture
def no_hub(monkeypatch):
    """Offline, and loading anything through the hub (`hub_access`) fails the test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datamodules.hub, "hub_access",
                        lambda: pytest.fail("the hub was asked for a model in a local folder"))


@pytest.fixture
def model() -> T5ForConditionalGeneration:
    return tiny_t5()


@pytest.fixture
def special() -> SpecialTokens:
    return SPECIAL


def random_batch(batch_size: int = 4, max_len: int = 12, seed: int = 1):
    """Encoder inputs of different lengths (right-padded), ids drawn above the special tokens."""
    g = torch.Generator().manual_seed(seed + SEED_SHIFT)
    lengths = torch.randint(3, max_len + 1, (batch_size,), generator=g)
    input_ids = torch.zeros(batch_size, int(lengths.max()), dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        input_ids[i, :n] = torch.randint(5, VOCAB, (n,), generator=g)
    return input_ids, (input_ids != 0).long()


def first_batch_where(condition, batch_size: int, max_len: int = 12, seed: int = 0, tries: int = 30):
    """The first of the seeded random batches `seed`, `seed + 1`, ... on which
    `condition(input_ids, attention_mask)` holds. A test that needs varied outputs to be non-vacuous
    selects its inputs this way, instead of hoping that one fixed draw has them on every machine
    and seed (`PIPEDEC_TEST_SEED`)."""
    for candidate in range(seed, seed + tries):
        input_ids, attention_mask = random_batch(batch_size, max_len, seed=candidate)
        if condition(input_ids, attention_mask):
            return input_ids, attention_mask
    raise AssertionError(f"none of the random batches {seed}..{seed + tries - 1} satisfies "
                         f"{condition.__doc__ or condition}")


def briefly_trained(decoder, steps: int = 60, seed: int = 0, model=None) -> T5ForConditionalGeneration:
    """A tiny T5 trained for a few dozen steps with `decoder`'s own loss on a toy task: the targets
    are the source split into chunks of 2-3 tokens (a structure every decoder can learn a little of),
    so decoding a trained model exercises real, non-random outputs."""
    model = tiny_t5(seed) if model is None else model
    model.train()
    params = list(model.parameters()) + list(decoder.parameters())
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    for step in range(steps):
        input_ids, attention_mask = random_batch(8, max_len=9, seed=1000 + step)
        targets = []
        for row, n in zip(input_ids.tolist(), attention_mask.sum(1).tolist()):
            tokens = row[:n]
            targets.append([tokens[i:i + 3] for i in range(0, len(tokens), 3)])
        layout = decoder.layout(targets)
        loss = decoder.loss(model, input_ids, attention_mask, layout)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def assert_alone_equals_batched(decoder, model, input_ids, attention_mask):
    """Each example decoded alone (unpadded) gives what it gives inside the padded batch: the same
    subsequences, tokens and decoder calls. Returns the batched output."""
    batched = decoder.generate(model, input_ids, attention_mask)
    for i in range(input_ids.size(0)):
        n = int(attention_mask[i].sum())
        alone = decoder.generate(model, input_ids[i:i + 1, :n], attention_mask[i:i + 1, :n])
        assert alone.subsequences[0] == batched.subsequences[i]
        assert alone.decoder_calls[0] == batched.decoder_calls[i]
        assert alone.tokens[0] == batched.tokens[i]
    return batched


def save_checkpoint(module, path) -> str:
    """`module` saved as tasks.fit saves a checkpoint (configuration, weights, and what
    `on_save_checkpoint` adds: decoder name, tokenizer, architecture), without training it: for the
    readers of checkpoints (tasks.test, compare, predict), which must not rely on what it outputs."""
    checkpoint = {"hyper_parameters": dict(module.hparams), "state_dict": module.state_dict()}
    module.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, path)
    return str(path)


def sequential(model, max_new_tokens: int):
    """The sequential decoder at bound `max_new_tokens`: the reference of every exact decoder."""
    return build_decoder("sequential", model.config, SPECIAL, max_new_tokens=max_new_tokens)


def greedy_outputs(model, input_ids, attention_mask, bound: int) -> list[list[int]]:
    """Each row's greedy tokens, up to its end token (included) or the bound: transformers' own
    `generate`, the reference the sequential decoder equals."""
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                         num_beams=1, max_new_tokens=bound)[:, 1:].tolist()
    return [through_end(row, SPECIAL.eos) for row in out]


def assert_drafts_counted(out, draft_width: int, first_call_drafts: bool = False):
    """A draft-and-verify decode's counters (`stats`) agree with its outputs: what the verify loop
    counts of its drafts (`DraftCounters`): every call after a row's first (its first too, where
    the drafter drafts before it: `first_call_drafts`) offers at most `draft_width` tokens, at most
    the offered ones are accepted, and a row's tokens are its calls' accepted drafts plus one per
    call, less what an end token or the bound cut."""
    stats = out.stats
    assert max(out.decoder_calls) == out.batch_decoder_calls
    for tokens, calls in zip(out.tokens, out.decoder_calls):
        assert 1 <= calls <= tokens
    assert set(DraftCounters._fields) <= set(stats)
    drafting_calls = sum(out.decoder_calls) - (0 if first_call_drafts else len(out.tokens))
    assert stats["calls_with_draft"] <= drafting_calls
    assert stats["draft_tokens_offered"] <= draft_width * drafting_calls
    assert 0 <= stats["draft_tokens_accepted"] <= stats["draft_tokens_offered"]
    assert stats["drafts_cut_at_separator"] <= stats["calls_with_draft"]
    assert sum(out.tokens) <= stats["draft_tokens_accepted"] + sum(out.decoder_calls)


def assert_same_output(out, ref):
    """Two decodes give the same output: subsequences, tokens and bound flags."""
    assert out.subsequences == ref.subsequences
    assert out.tokens == ref.tokens
    assert out.bound_hit == ref.bound_hit
