"""Lookup decoding: its tokens are sequential greedy decoding's, token for token (alone and in
batches whose rows accept different numbers of draft tokens), and its decoder calls are exactly
those the lookup rule gives, counted here in plain Python from the greedy output and the source
(`lookup_replay`); on models built so that the source holds the answer, calls by hand; its
counters, options, host syncs and what it decodes."""
import copy
from dataclasses import dataclass

import pytest
import torch

from decoders import build_decoder, decoder_class
import decoders.backbone
import decoders.base
import decoders.drafts
import decoders.sequential
from decoders.backbone import encode, greedy_step
from decoders.base import Decoder
from decoders.draft_policy import CALLS_TO_FIT, DECODES_TO_COMPARE, PRIOR_TRIES, Tally
from decoders.drafts import DraftCounters, HostRows, Source, Verified
from tasks.bench.pipelined_lookup import lookup_draft  # the rule, plainly
from tasks.bench.sync_points import counting_sync_points
from tasks.config import compose
from tests.conftest import (ALWAYS_FEED, SPECIAL, VOCAB, assert_drafts_counted, assert_same_output, first_batch_where,
                            greedy_outputs, random_batch, sequential, tiny_t5)
from tests.test_blockwise import CHAIN, rigged_model

pytestmark = [pytest.mark.float64, pytest.mark.numerics]  # see tests/conftest.py

EOS, SEP = SPECIAL.eos, SPECIAL.sep


def lookup(model, **options):
    return build_decoder("lookup", model.config, SPECIAL, **{**ALWAYS_FEED, **options})


def sources(input_ids, attention_mask) -> list[list[int]]:
    return [row[:n] for row, n in zip(input_ids.tolist(), attention_mask.sum(1).tolist())]


@dataclass
class Replay:
    """What lookup decoding of one row does, replayed from its greedy output."""

    calls: int = 1          # the first call feeds the start token and drafts nothing
    offered: int = 0
    accepted: int = 0       # draft tokens accepted up to the output's end
    with_draft: int = 0
    cut_at_separator: int = 0
    past_end: bool = False  # a draft ran past the output's end: the model decides more acceptance


def lookup_replay(source: list[int], output: list[int], draft_tokens: int, match: int) -> Replay:
    """The calls and counters of lookup decoding a row whose greedy output is `output` (up to its
    end token or bound): a draft token is accepted exactly where it is the greedy token."""
    replay, produced = Replay(), 1
    while produced < len(output):
        draft = lookup_draft(source, output[:produced], draft_tokens, match)
        accepted = 0
        while (accepted < len(draft) and produced + accepted < len(output)
               and draft[accepted] == output[produced + accepted]):
            accepted += 1
        replay.calls += 1
        replay.offered += len(draft)
        replay.with_draft += bool(draft)
        replay.accepted += accepted
        rejected_at = produced + accepted    # where the model's own token goes
        if accepted < len(draft):
            if rejected_at < len(output):
                replay.cut_at_separator += output[rejected_at] == SEP
            else:
                replay.past_end = True
        produced = rejected_at + 1
    return replay


def assert_replayed(out, replays: list[Replay]):
    """Per row the calls of the replay, and the counters summed over the batch."""
    assert out.decoder_calls == [r.calls for r in replays]
    assert out.stats["draft_tokens_offered"] == sum(r.offered for r in replays)
    assert out.stats["calls_with_draft"] == sum(r.with_draft for r in replays)
    if not any(r.past_end for r in replays):
        assert out.stats["draft_tokens_accepted"] == sum(r.accepted for r in replays)
        assert out.stats["drafts_cut_at_separator"] == sum(r.cut_at_separator for r in replays)


def assert_consistent_counters(out, draft_tokens: int, no_cut: bool):
    """The counters of every drafter (`assert_drafts_counted`), and where nothing was cut by an end
    token or the bound (`no_cut`), exactly the accepted draft tokens and one token per call out."""
    assert_drafts_counted(out, draft_tokens)
    if no_cut:
        assert sum(out.tokens) == sum(out.decoder_calls) + out.stats["draft_tokens_accepted"]


@pytest.mark.parametrize("seed,draft_tokens,match", [(0, 8, 1), (1, 4, 1), (2, 3, 1), (3, 1, 1)])
def test_matches_sequential_on_random_models(seed, draft_tokens, match):
    """Random models: drafts are offered (the source's tokens recur in the output) and mostly
    rejected. Batch of 8 and each row alone."""
    model, bound = tiny_t5(seed), 15
    decoder = lookup(model, draft_tokens=draft_tokens, match=match, max_new_tokens=bound)

    def offers_drafts(input_ids, attention_mask):
        """drafts offered, and outputs of several lengths (rows leave the batch at different calls)"""
        out = decoder.generate(model, input_ids, attention_mask)
        return out.stats["calls_with_draft"] > 0 and len(set(out.tokens)) >= 3
    input_ids, attention_mask = first_batch_where(offers_drafts, 8, seed=seed + 10)
    out = decoder.generate(model, input_ids, attention_mask)
    assert_same_output(out, sequential(model, bound).generate(model, input_ids, attention_mask))
    outputs = greedy_outputs(model, input_ids, attention_mask, bound)
    assert_replayed(out, [lookup_replay(s, y, draft_tokens, match)
                          for s, y in zip(sources(input_ids, attention_mask), outputs)])
    assert_consistent_counters(out, draft_tokens, no_cut=not any(out.bound_hit))
    for i in range(8):  # alone, unpadded
        n = int(attention_mask[i].sum())
        alone = input_ids[i:i + 1, :n], attention_mask[i:i + 1, :n]
        reference = sequential(model, bound).generate(model, *alone)
        assert_same_output(decoder.generate(model, *alone), reference)


def source_blind(seed: int):
    """A random T5 whose decoder ignores the source (cross-attention outputs zeroed) but not its
    own context: its greedy output is one sequence whatever the source, so sources can be built
    to hold it, in part or whole, while the cached self-attention still matters."""
    model = tiny_t5(seed)
    with torch.no_grad():
        for block in model.decoder.block:
            block.layer[1].EncDecAttention.o.weight.zero_()
    return model


def padded(rows: list[list[int]]):
    """Right-padded input_ids and attention_mask of source rows of different lengths."""
    input_ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, :len(row)] = torch.tensor(row)
    return input_ids, (torch.arange(input_ids.size(1)) < torch.tensor([[len(r)] for r in rows])).long()


def sources_holding(output: list[int]) -> list[list[int]]:
    """8 sources, each holding a different part of `output` (its end token left out, so that
    no draft runs past the end): whole, whole after noise, halves, every other token, with a wrong
    token at every third place, reversed, none of it."""
    body = [t for t in output if t != EOS]
    noise = [t for t in range(5, VOCAB) if t not in output]
    half = len(body) // 2
    return [body, noise[:3] + body, body[:half], body[half:], body[::2],
            [noise[i % len(noise)] if i % 3 == 2 else t for i, t in enumerate(body)],
            body[::-1], noise[:7]]


@pytest.fixture(scope="module")
def blind():
    """A source-blind model whose greedy output is long and has 5 or more distinct tokens (so that
    the built sources offer drafts that are accepted, partly, or not at all), with a batch of
    sources built to hold it."""
    for seed in range(20):
        model = source_blind(seed)
        output = greedy_outputs(model, *random_batch(1, seed=seed), bound=16)[0]
        if len(output) >= 10 and len(set(output) - {EOS}) >= 5:
            return model, output, padded(sources_holding(output))
    raise AssertionError("no source-blind model among seeds 0..19 writes 10 or more varied tokens")


@pytest.mark.parametrize("draft_tokens,match", [(8, 1), (4, 1), (2, 1), (4, 2), (3, 3)])
def test_drafts_from_the_source_are_accepted_and_the_output_is_greedy(blind, draft_tokens, match):
    model, output, (input_ids, attention_mask) = blind
    decoder = lookup(model, draft_tokens=draft_tokens, match=match, max_new_tokens=16)
    out = decoder.generate(model, input_ids, attention_mask)
    assert_same_output(out, sequential(model, 16).generate(model, input_ids, attention_mask))
    replays = [lookup_replay(s, output, draft_tokens, match) for s in sources(input_ids, attention_mask)]
    assert_replayed(out, replays)
    assert_consistent_counters(out, draft_tokens, no_cut=not any(out.bound_hit))
    # not vacuous: drafts accepted, and rows accepting different numbers of them
    assert out.stats["draft_tokens_accepted"] > 0
    assert len({t - c for t, c in zip(out.tokens, out.decoder_calls)}) >= 3
    for i in range(8):  # alone, unpadded
        n = int(attention_mask[i].sum())
        alone = decoder.generate(model, input_ids[i:i + 1, :n], attention_mask[i:i + 1, :n])
        assert_same_output(alone, sequential(model, 16).generate(model, input_ids[i:i + 1, :n],
                                                                  attention_mask[i:i + 1, :n]))
        assert alone.decoder_calls == [out.decoder_calls[i]]


def feeding_nothing(record, rows: int):
    """`record` as if none of the earlier drafts had passed and feeding cost as much as a call: the
    measured rule would feed a decode of `rows` rows no draft."""
    record.add(Tally(None, hits=0, tries=PRIOR_TRIES), Tally(None))
    for queries, seconds in ((1, 1.0), (5, 2.0)):
        for _ in range(CALLS_TO_FIT):
            record.costs.add(rows, queries, seconds)


@pytest.mark.parametrize("match", [1, 2])
@pytest.mark.parametrize("why", ["the rule feeds nothing", "measured faster"])
def test_a_measured_decode_may_be_sequential_and_tallies_its_probes(blind, match, why):
    """Measured (`min_acceptance` null): a decode is sequential decoding where its starting tally
    would not feed even a call whose every row offers a draft (none of the earlier drafts passed,
    and feeding was measured to cost as much as a call), or where sequential decoding was measured
    faster per output token than the verify loop (`LoopChoice`): its tokens and calls, no call
    timed, no draft fed, the decode timed as sequential. The drafts the verify loop would have
    probed are tallied from its output: per row, after each output token that another follows,
    the source's draft (`lookup_draft`), a hit where its first token is that next one."""
    model, _, (input_ids, attention_mask) = blind
    rows = len(input_ids)
    decoder = lookup(model, draft_tokens=4, match=match, max_new_tokens=16, min_acceptance=None)
    record = decoder.feeding_record(input_ids.device)
    passed = 0 if why == "the rule feeds nothing" else PRIOR_TRIES
    if why == "the rule feeds nothing":
        feeding_nothing(record, rows)
    else:
        record.add(Tally(None, hits=passed, tries=PRIOR_TRIES), Tally(None))
        for verifies, seconds in ((True, 2.0), (False, 1.0)):
            for _ in range(DECODES_TO_COMPARE):
                record.loops.add(rows, verifies, seconds)
    assert record.may_feed(rows, 4) == (why != "the rule feeds nothing")
    timed = {shape: list(calls) for shape, calls in record.costs.seconds.items()}
    decodes, verified = record.loops.decodes.get(rows, 0), copy.copy(record.loops.seconds.get((rows, True)))
    out = decoder.generate(model, input_ids, attention_mask)
    expected = sequential(model, 16).generate(model, input_ids, attention_mask)
    assert_same_output(out, expected)
    assert (out.decoder_calls, out.batch_decoder_calls) == (expected.decoder_calls, expected.batch_decoder_calls)
    assert out.stats == {name: 0.0 for name in DraftCounters._fields}
    assert {shape: list(calls) for shape, calls in record.costs.seconds.items()} == timed
    # timed as sequential decoding: one decode more, none of the verify loop
    assert record.loops.decodes[rows] == decodes + 1 and record.loops.seconds.get((rows, True)) == verified
    probes = [draft[0] == output[newest + 1]
              for source, output in zip(sources(input_ids, attention_mask),
                                        greedy_outputs(model, input_ids, attention_mask, bound=16))
              for newest in range(len(output) - 1)
              for draft in [lookup_draft(source, output[: newest + 1], 1, match)] if draft]
    assert record.drafts == Tally(None, hits=passed + sum(probes), tries=PRIOR_TRIES + len(probes))
    assert 0 < sum(probes) < len(probes)   # not vacuous: the built sources hold parts of the output


def test_a_compiled_measured_decode_may_be_the_sequential_decoders_fixed_shape_loop(blind, monkeypatch):
    """Compiled (`decoder.compile`), a measured decode the rule would feed nothing is the sequential
    decoder's fixed-shape loop (its `next_tokens` through `fixed_shape_compiled`, run eagerly here,
    each shape's step looked up once per decode), with the eager sequential decoder's tokens and
    calls; no verify-loop step is made."""
    model, _, (input_ids, attention_mask) = blind
    shapes, verify_shapes = [], []
    monkeypatch.setattr(decoders.base, "compiled_encode", encode)
    monkeypatch.setattr(decoders.sequential, "fixed_shape_compiled",
                        lambda model, function, shape: shapes.append(shape) or function)
    monkeypatch.setattr(decoders.backbone, "compiled_for",   # the cache made whole
                        lambda model, function, *key, **options: function)
    monkeypatch.setattr(decoders.drafts, "fixed_shape_greedy_step",
                        lambda model, shape: verify_shapes.append(shape) or greedy_step)
    decoder = lookup(model, draft_tokens=4, max_new_tokens=16, min_acceptance=None, compile=True).eval()
    with torch.no_grad():   # a compiled decode's record (`feeding_record` per eager or compiled)
        feeding_nothing(decoder.feeding_record(input_ids.device), len(input_ids))
        out = decoder.generate(model, input_ids, attention_mask)
    expected = sequential(model, 16).generate(model, input_ids, attention_mask)
    assert_same_output(out, expected)
    assert (out.decoder_calls, out.batch_decoder_calls) == (expected.decoder_calls, expected.batch_decoder_calls)
    assert shapes and len(set(shapes)) == len(shapes) and not verify_shapes   # each looked up once


# ---- 2. calls by construction: the rigged chain model ---------------------------------------

# CHAIN is 10, 11, .., 17, </s>: what the rigged model writes, whatever its source
NOISE = [40, 41, 42]


@pytest.mark.parametrize("match", [1, 2])
def test_the_table_drafts_what_scanning_the_source_drafts(match):
    """The per-decode table (each window of `match` source tokens -> the tokens after its latest
    occurrence that some token follows) drafts, for every ending a row's output may have, what
    scanning the source does (`lookup_draft`): repeated windows (the latest counts), the last real
    tokens (followed by nothing: no draft), padding, and tokens the source lacks."""
    model, _ = rigged_model(CHAIN)
    decoder = lookup(model, draft_tokens=3, match=match)
    rows = [[10, 11, 12, 10, 13, 14, 12], [12, 12, 40, 5], [5]]
    input_ids, attention_mask = padded(rows)
    state = decoder.begin_drafts(model, Source(input_ids, attention_mask, None, None)).state
    verified = Verified(None, None, torch.ones(3, 1, dtype=torch.long), None, None, None)
    endings = [[token] for token in range(VOCAB)]
    if match == 2:
        endings = [[earlier, token] for earlier in (10, 12, 40, SPECIAL.pad) for token in range(VOCAB)]
    offered = 0
    for ending in endings:
        host = HostRows([0, 1, 2], [ending[-1]] * 3, [1] * 3, [ending[:-1]] * 3, [False] * 3)
        draft = decoder.draft(model, state, verified, host)
        expected = [lookup_draft(row, ending, 3, match) for row in rows]
        assert draft.offered == [len(tokens) for tokens in expected], ending
        assert draft.on_host == expected
        assert draft.tokens is None   # drafts stay on the host: the loop sends what a call feeds
        offered += sum(draft.offered)
    assert offered > 0


def run_rigged(rows: list[list[int]], chain=CHAIN, **options):
    """Lookup decoding of the rigged model (its greedy output is `chain`) from sources `rows`:
    (output, model, input_ids, attention_mask)."""
    model, _ = rigged_model(chain)
    input_ids, attention_mask = padded(rows)
    out = lookup(model, **options).generate(model, input_ids, attention_mask)
    return out, model, input_ids, attention_mask


@pytest.mark.parametrize("source,draft_tokens,match,calls", [
    # the source holds the whole answer: the first call writes 10, then each call accepts the whole
    # draft and adds its own token: 1 + ceil(8 / (m + 1)) calls for the other 8 tokens
    ([30] + CHAIN, 8, 1, 2),
    ([30] + CHAIN, 4, 1, 3),
    ([30] + CHAIN, 2, 1, 4),
    ([30] + CHAIN, 1, 1, 5),
    # match 2: no draft before two tokens are out: 10, 11, then 12..15 + 16, then 17 + </s>
    ([30] + CHAIN, 4, 2, 4),
    # ... even where the source repeats the first token: 10, 11, then 12 .. </s>
    ([10] + CHAIN, 8, 2, 3),
    # a miss: after 10 the draft 11, 12, 40, 41 is accepted up to 40, then 13; 13 and 14 are not
    # in the source (one token each); after 15 the draft 16, 17, </s> ends it
    ([10, 11, 12, *NOISE, 15, 16, 17, EOS], 4, 1, 5),
    # nothing to find: one token per call, as sequential decoding
    (NOISE, 4, 1, len(CHAIN)),
    # the answer without its end token: the draft 11 .. 17 is accepted whole, then the model ends
    (CHAIN[:-1], 8, 1, 2),
    # drafts that run past the end token: 16, 17, </s>, 40, 41 accepted up to the end token (and
    # maybe further: nothing after it is output)
    (CHAIN + NOISE, 4, 1, 3),
    # the latest occurrence wins: after 10 the earlier 10, 40 is passed over for 10, 11, ..
    ([10, 40, 41, 10, 11, 12, 13, 14, 15, 16, 17, EOS], 8, 1, 2),
    # an occurrence with nothing after it is passed over for one that has: 10 at the source's end
    (CHAIN + [30, 10], 8, 1, 2),
])
def test_calls_by_construction(source, draft_tokens, match, calls):
    out, *_ = run_rigged([source], draft_tokens=draft_tokens, match=match, max_new_tokens=20)
    assert out.subsequences == [[CHAIN[:-1]]] and out.tokens == [len(CHAIN)]
    assert out.bound_hit == [False]
    assert out.decoder_calls == [calls] and out.batch_decoder_calls == calls
    assert_replayed(out, [lookup_replay(source, CHAIN, draft_tokens, match)])
    # without the end token in the source, the model's own end token ends the output: nothing is cut
    assert_consistent_counters(out, draft_tokens, no_cut=EOS not in source)


def test_rows_with_different_sources_accept_different_numbers_in_one_batch():
    rows = [[30] + CHAIN, [10, 11, 12, *NOISE, 15, 16, 17, EOS], NOISE, CHAIN + NOISE, CHAIN[:4]]
    out, model, input_ids, attention_mask = run_rigged(rows, draft_tokens=4, max_new_tokens=20)
    assert out.subsequences == [[CHAIN[:-1]]] * 5
    assert out.decoder_calls == [3, 5, len(CHAIN), 3, 6]   # fewer calls than tokens where it hits
    assert_replayed(out, [lookup_replay(row, CHAIN, 4, 1) for row in rows])
    assert_same_output(out, sequential(model, 20).generate(model, input_ids, attention_mask))


def decode_recording_widths(rows: list[list[int]], **options):
    """Lookup decoding of the rigged model (greedy output CHAIN) from sources `rows`, checked
    against sequential decoding: (output, the number of tokens each decoder call fed per row)."""
    model, _ = rigged_model(CHAIN)
    input_ids, attention_mask = padded(rows)
    decoder, widths = lookup(model, max_new_tokens=20, **options), []
    run = decoder.model_step()

    def recording(model, fed, *args, **kwargs):
        widths.append(fed.size(1))
        return run(model, fed, *args, **kwargs)
    decoder.model_step = lambda: recording
    out = decoder.generate(model, input_ids, attention_mask)
    assert_same_output(out, sequential(model, 20).generate(model, input_ids, attention_mask))
    return out, widths


def test_a_call_feeds_only_the_columns_some_row_offers_a_token_in():
    """Drafts are made before the call's sync, which reads how many tokens each offers: a call is
    as wide as the longest offer needs, and one token per row when no row offers any. The source
    [30] + CHAIN offers 4 tokens after 10 (to 15), then 3 (16, 17, end); NOISE never offers one."""
    out, widths = decode_recording_widths([NOISE, [30] + CHAIN], draft_tokens=4)
    assert out.decoder_calls == [len(CHAIN), 3]
    assert widths == [1, 5, 4] + [1] * (len(CHAIN) - 3)


@pytest.mark.parametrize("length,widths", [
    ("fixed", [1] + [5] * 8),
    # rejected every time: 4 offered once, none accepted, so none from then on (the unfed drafts'
    # first tokens, checked against the model's, never pass either)
    ("adaptive", [1, 5] + [1] * 7)])
def test_an_adaptive_length_falls_back_where_drafts_are_rejected(length, widths):
    """Every output token occurs in the source, followed by a token the model never writes after
    it: each call offers a draft whose first token is rejected."""
    source = [token for pair in zip(CHAIN[:-1], NOISE * 3) for token in pair] + NOISE
    out, fed = decode_recording_widths([source], draft_tokens=4, draft_length=length)
    assert out.decoder_calls == [len(CHAIN)] and out.stats["draft_tokens_accepted"] == 0
    assert fed == widths


def test_the_bound_cuts_inside_an_accepted_draft():
    out, *_ = run_rigged([[30] + CHAIN], draft_tokens=8, max_new_tokens=6)
    assert out.subsequences == [[CHAIN[:6]]] and out.tokens == [6] and out.bound_hit == [True]
    assert out.decoder_calls == [2]
    assert out.stats["draft_tokens_accepted"] == 8   # verified, though the bound output only 5


def test_a_draft_cut_at_a_separator():
    """Keyphrase-like: the output joins phrases with a separator the source never holds. The draft
    after 10 (11, 12, 13, 14, </s>) is rejected at 13, where the model writes the separator; after
    it nothing is found (with match 2, not before two tokens of the next phrase are out)."""
    chain = [10, 11, 12, SEP, 13, 14, EOS]
    source = [10, 11, 12, 13, 14, EOS]
    for match, calls in ((1, 4), (2, 6)):
        out, *_ = run_rigged([source], chain=chain, draft_tokens=8, match=match, max_new_tokens=20)
        assert out.subsequences == [[[10, 11, 12], [13, 14]]]
        assert out.decoder_calls == [calls]
        assert out.stats["drafts_cut_at_separator"] == 1
        assert_replayed(out, [lookup_replay(source, chain, 8, match)])


# ---- 3. host syncs ------------------------------------------------------------------------------

def test_one_host_sync_per_decoder_call(blind):
    """The loop's stop check is the only host sync per call: the lookup adds none (it reads the
    newest tokens that check reads); the encoder, the sources' read to the host and the final
    read-back (of outputs and counters together) add one each per generate."""
    model, _, (input_ids, attention_mask) = blind
    decoder = lookup(model, draft_tokens=4, max_new_tokens=16)
    decoder.generate(model, input_ids, attention_mask)   # lazy initialisations done
    with counting_sync_points() as counter:
        out = decoder.generate(model, input_ids, attention_mask)
    assert out.stats["draft_tokens_accepted"] > 0
    assert counter.count <= out.batch_decoder_calls + 3


# ---- 4. options, configuration, what it decodes ---------------------------------------------------

@pytest.mark.parametrize("option,value", [("draft_tokens", 0), ("match", 0), ("max_new_tokens", 0),
                                          ("draft_tokens", -3)])
def test_invalid_options_name_the_value(option, value):
    with pytest.raises(ValueError, match=rf"decoder\.{option} must be an integer >= 1.*got {value}"):
        lookup(tiny_t5(0), **{option: value})


def test_yaml_options_are_the_constructor_arguments():
    cfg = compose(task="keyphrase", decoder="lookup")
    options = {k: v for k, v in cfg.decoder.items() if k != "name"}
    assert options == {"draft_tokens": 4, "match": 1, "max_new_tokens": cfg.data.max_target_length,
                       "draft_length": "fixed", "min_acceptance": None, "compile": False}
    decoder = build_decoder("lookup", tiny_t5(0).config, SPECIAL, **options)
    assert (decoder.draft_width, decoder.match) == (4, 1)
    assert set(decoder_class("lookup").decode_only_options()) == set(options)


def test_it_decodes_what_sequential_trains_and_trains_nothing():
    kind, seq = decoder_class("lookup"), decoder_class("sequential")
    assert kind.can_decode_checkpoint_of(seq) and seq.can_decode_checkpoint_of(kind)
    assert kind.can_decode_checkpoint_of(decoder_class("blockwise"))
    assert not kind.can_decode_checkpoint_of(decoder_class("pipelined"))

    class OwnLayout(Decoder):
        layout_family = "own"
    assert not kind.can_decode_checkpoint_of(OwnLayout)
    decoder = lookup(tiny_t5(0))
    assert kind.trains_nothing and not decoder.trains_backbone()
    assert list(decoder.parameters()) == []
    targets = [[[7, 8], [9]], [[12]]]
    expected = sequential(tiny_t5(0), 20).layout(targets)["labels"]
    assert torch.equal(decoder.layout(targets)["labels"], expected)
