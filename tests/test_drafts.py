"""Every draft-and-verify decoder (`decoders.drafts.DraftAndVerifyDecoder`: blockwise, lookup,
aggressive, and any registered later) gives exactly the greedy output: the sequential decoder's
and transformers' `generate`'s, in float64, at batch size above 1, on a random model and on a
briefly trained one whose drafts are accepted, rows accepting different numbers of tokens.

The decoder-specific behaviour (which drafts are offered, how many calls a construction takes) is
tested in test_blockwise.py, test_lookup.py and test_aggressive.py."""
import functools
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from decoders import available, build_decoder, decoder_class, drafts
from decoders.base import OUTPUT_BOUND, Decoder
from decoders.cache import DecoderCache, Slots
from decoders.compiled_step import COMPILED_STEPS
from decoders.draft_policy import (ADAPTIVE, CALLS_TO_FIT, COMPARISONS_KEPT, DECODES_TO_COMPARE, DRAFT_LENGTH, FIXED,
                                   MEASURED_MIN_ACCEPTANCE, MOST_DECODES_BETWEEN_REVISITS, PRIOR_TRIES,
                                   REVISIT_EVERY, CallCosts,
                                   FeedingRecord, LoopChoice, Tally, call_width, counted_positions,
                                   fed_offers, next_draft_lengths)
from decoders.drafts import Draft, DraftAndVerifyDecoder, HostReads
from decoders.verify_tables import bias_tables
from decoders.sequential import SequentialDecoder
from decoders.loop import send, split_flat_output
from tasks.bench import bounded, with_drafter
from tests.conftest import (ALWAYS_FEED, SPECIAL, assert_drafts_counted, assert_same_output, briefly_trained,
                            first_batch_where, greedy_outputs, sequential, tiny_t5)

pytestmark = [pytest.mark.float64, pytest.mark.numerics]  # see tests/conftest.py

REPO = Path(__file__).resolve().parents[1]
DRAFTERS = [name for name in available() if issubclass(decoder_class(name), DraftAndVerifyDecoder)]
BOUND = 20


def test_every_draft_and_verify_decoder_is_covered():
    assert {"blockwise", "lookup", "aggressive"} <= set(DRAFTERS)


def drafts_first_call(decoder) -> bool:
    """Whether the drafter drafts before the model's first token: one with a model of its own
    drafts whole outputs (aggressive)."""
    return decoder.drafts_with is not None


def accepted_per_row(out) -> list[int]:
    """Draft tokens each row accepted: every call yields the verifier's own token, and the rest of
    a row's tokens were drafts it accepted."""
    return [tokens - calls for tokens, calls in zip(out.tokens, out.decoder_calls)]


def assert_greedy(decoder, model, input_ids, attention_mask):
    """`decoder`'s output is the sequential decoder's and `generate`'s; returns it."""
    out = decoder.generate(model, input_ids, attention_mask)
    assert_same_output(out, sequential(model, BOUND).generate(model, input_ids, attention_mask))
    expected = [split_flat_output(row, SPECIAL)
                for row in greedy_outputs(model, input_ids, attention_mask, BOUND)]
    assert out.subsequences == [subsequences for subsequences, _ in expected]
    assert out.bound_hit == [not ended for _, ended in expected]
    return out


@functools.lru_cache(maxsize=None)
def trained(name: str):
    """A briefly trained model and decoder `name` ready to decode it: a decoder with a loss of its
    own (blockwise: base head and proposal heads) trains with it; one that trains nothing is given
    a model trained with the sequential loss, and one that drafts with another decoder's model
    (aggressive) a drafter of that kind trained on the same task."""
    model = tiny_t5(0, initializer_factor=1.0)  # T5's own init scale: a model that learns the task
    decoder = build_decoder(name, model.config, SPECIAL, **ALWAYS_FEED, **bounded(name, BOUND))
    learns = decoder if type(decoder).loss is not Decoder.loss else sequential(model, BOUND)
    model = briefly_trained(learns, model=model)
    kind = decoder_class(name).drafts_with
    if kind:
        drafter_model = tiny_t5(1, initializer_factor=1.0)
        drafter = build_decoder(kind, drafter_model.config, SPECIAL, **bounded(kind, BOUND))
        drafter_model = briefly_trained(drafter, model=drafter_model)
        decoder.attach_drafter(drafter.eval(), drafter_model)
    return model, decoder.eval()


@pytest.mark.parametrize("name", DRAFTERS)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("length", [FIXED, ADAPTIVE])
@pytest.mark.parametrize("min_acceptance", [0.0, 0.5])
def test_a_random_model_decodes_greedily(name, seed, length, min_acceptance):
    model = tiny_t5(seed)
    decoder = with_drafter(build_decoder(name, model.config, SPECIAL, draft_length=length,
                                         min_acceptance=min_acceptance, **bounded(name, BOUND)),
                           model).eval()

    def varied(input_ids, attention_mask):
        """outputs of 3 or more lengths, one of them ended by its end token"""
        out = decoder.generate(model, input_ids, attention_mask)
        return len(set(out.tokens)) >= 3 and not all(out.bound_hit)
    out = assert_greedy(decoder, model, *first_batch_where(varied, 6, seed=seed + 30))
    assert_drafts_counted(out, decoder.draft_width, drafts_first_call(decoder))


@pytest.mark.parametrize("name", DRAFTERS)
@pytest.mark.parametrize("length", [FIXED, ADAPTIVE])
def test_a_trained_model_accepts_drafts_and_decodes_greedily(name, length):
    model, decoder = trained(name)
    decoder.draft_length = length

    def accepting(input_ids, attention_mask):
        """drafts accepted, rows accepting different numbers of them"""
        accepted = accepted_per_row(decoder.generate(model, input_ids, attention_mask))
        return sum(accepted) > 0 and len(set(accepted)) >= 2
    input_ids, attention_mask = first_batch_where(accepting, 8, max_len=9, seed=60, tries=40)
    out = assert_greedy(decoder, model, input_ids, attention_mask)
    assert sum(accepted_per_row(out)) > 0
    assert_drafts_counted(out, decoder.draft_width, drafts_first_call(decoder))
    assert out.stats["draft_tokens_accepted"] >= sum(accepted_per_row(out)) > 0


@pytest.mark.parametrize("name", DRAFTERS)
def test_a_call_narrowed_to_half_its_rows_offers_decodes_greedily(name, monkeypatch):
    model, decoder = trained(name)
    decoder.draft_length = ADAPTIVE
    cut: list[int] = []   # draft tokens cut, per call narrowed to a width of 1 or more
    fed: list[int] = []   # draft tokens fed, per call after the first

    def counting(offers, lengths, feeding):
        feeds, probes = fed_offers(offers, lengths, feeding)
        if max(feeds):
            cut.append(sum(min(offer, length) - feed for offer, length, feed in zip(offers, lengths, feeds)))
        fed.append(sum(feeds))
        return feeds, probes
    monkeypatch.setattr(drafts, "fed_offers", counting)

    def narrowing(input_ids, attention_mask):
        """a call that fed draft tokens, fewer than some row offered"""
        cut.clear()
        decoder.generate(model, input_ids, attention_mask)
        return sum(cut) > 0
    input_ids, attention_mask = first_batch_where(narrowing, 8, max_len=9, seed=60, tries=40)
    cut.clear()
    fed.clear()
    out = assert_greedy(decoder, model, input_ids, attention_mask)
    assert sum(cut) > 0
    # what the loop counts as offered is what it fed, not what the drafter offered before the cut
    assert out.stats["draft_tokens_offered"] == sum(fed)


class KnowingDrafter(DraftAndVerifyDecoder):
    """A drafter that knows each example's greedy output: its drafts are that output's next tokens
    while a row has produced fewer than `right_until` tokens, and wrong ones after, so that a test
    decides which drafts pass. With `on_host`, its drafts stay on the host (`Draft.on_host`), as
    lookup's do."""

    layout_family = SequentialDecoder.layout_family
    trains_nothing = True
    layout, loss = SequentialDecoder.layout, SequentialDecoder.loss
    options = {"max_new_tokens": OUTPUT_BOUND, "draft_length": DRAFT_LENGTH,
               "min_acceptance": MEASURED_MIN_ACCEPTANCE}
    draft_width = 2
    host_reads = HostReads()

    def __init__(self, *args, outputs: list[list[int]], right_until: int, on_host: bool = False,
                 offering: set[int] | None = None, **options):
        super().__init__(*args, **options)
        self.outputs, self.right_until, self.on_host = outputs, right_until, on_host
        self.offering = offering   # the examples that offer drafts (None: all)

    def verifies(self, record, rows):
        return True   # the verify loop every decode: these tests are of its calls

    def draft(self, model, state, verified, host) -> Draft:
        drafts, vocab = [], model.config.vocab_size
        for example, count in zip(host.examples, host.counts):
            right = self.outputs[example][count: count + self.draft_width]
            right += [SPECIAL.pad] * (self.draft_width - len(right))
            drafts.append(right if count < self.right_until else [(token + 1) % vocab for token in right])
        offered = [self.draft_width if self.offering is None or example in self.offering else 0
                   for example in host.examples]
        if self.on_host:
            return Draft(None, offered, on_host=[tokens[:n] for tokens, n in zip(drafts, offered)])
        return Draft(send(drafts, verified.count.device), offered)


def recorded_feeds(monkeypatch) -> tuple[list[bool], list[int]]:
    """Per call, whether it could feed drafts and how many draft tokens it fed, recorded as the
    loop asks `fed_offers`."""
    feeding: list[bool] = []
    fed: list[int] = []

    def recording(offers, lengths, feeds_drafts):
        feeds, probes = fed_offers(offers, lengths, feeds_drafts)
        feeding.append(feeds_drafts)
        fed.append(sum(feeds))
        return feeds, probes
    monkeypatch.setattr(drafts, "fed_offers", recording)
    return feeding, fed


def knowing_drafter(model, shortest: int, **options):
    """A `KnowingDrafter` of `model`, and a batch of 3 whose greedy outputs are all `shortest`
    tokens or longer: (decoder, input_ids, attention_mask)."""
    def long_outputs(input_ids, attention_mask):
        """every greedy output long enough"""
        return min(map(len, greedy_outputs(model, input_ids, attention_mask, BOUND))) >= shortest
    input_ids, attention_mask = first_batch_where(long_outputs, 3, seed=120)
    outputs = greedy_outputs(model, input_ids, attention_mask, BOUND)
    decoder = KnowingDrafter(model.config, SPECIAL, max_new_tokens=BOUND, outputs=outputs, **options)
    return decoder.eval(), input_ids, attention_mask


@pytest.mark.parametrize("on_host", [False, True])
def test_drafts_accepted_too_rarely_are_probed_not_fed(monkeypatch, on_host):
    """With min_acceptance, a decode probes its first drafts, feeds them once they have passed,
    and stops feeding once too few have (its rows probe them instead); the output stays greedy.
    (Under the adaptive length too: `fed_offers` feeds nothing then.) Drafts made on the device
    are probed there, drafts kept on the host are probed on the host."""
    model = tiny_t5(0)
    feeding, fed = recorded_feeds(monkeypatch)
    decoder, input_ids, attention_mask = knowing_drafter(model, 16, right_until=6, min_acceptance=0.5,
                                                         on_host=on_host)
    gated = assert_greedy(decoder, model, input_ids, attention_mask)
    began = feeding.index(True)
    stop = feeding.index(False, began)
    # the start token alone, then probed (the call after it), fed while right, then never again
    assert began == 2 and sum(fed[began:stop]) > 0
    assert not any(feeding[stop:]) and sum(fed[stop:]) == 0
    feeding.clear()
    fed.clear()
    decoder.min_acceptance = 0.0
    always = assert_greedy(decoder, model, input_ids, attention_mask)
    assert all(feeding) and gated.stats["draft_tokens_offered"] < always.stats["draft_tokens_offered"]


def synthetic_costs(monkeypatch, seconds) -> list[tuple[int, int]]:
    """Every timed call recorded at `seconds(rows, tokens fed per row)` instead of the host clock's
    reading, so that a test decides what feeding costs; returns the shapes timed, in order."""
    timed: list[tuple[int, int]] = []
    add = CallCosts.add

    def adding(self, rows, queries, _seconds):
        timed.append((rows, queries))
        add(self, rows, queries, seconds(rows, queries))
    monkeypatch.setattr(CallCosts, "add", adding)
    return timed


@pytest.mark.parametrize("on_host", [False, True])
def test_measured_drafts_are_fed_where_they_pay_for_their_cost(monkeypatch, on_host):
    """Measured (`min_acceptance` null, the default): each call is timed by the tokens it fed, and
    a decode feeds drafts that always pass while the tokens they gain (2 per row) pay for what
    feeding was measured to add, starting from what the earlier decodes measured; where feeding
    costs more than they gain it stops once measured. The output stays greedy either way."""
    model = tiny_t5(0)
    feeding, fed = recorded_feeds(monkeypatch)
    costly = {"on": False}   # then a call that feeds drafts takes 100 s, else 1 s
    timed = synthetic_costs(monkeypatch, lambda rows, queries: 100.0 if costly["on"] and queries > 1 else 1.0)
    decoder, input_ids, attention_mask = knowing_drafter(model, 16, right_until=BOUND, on_host=on_host)
    assert decoder.min_acceptance is None
    first = assert_greedy(decoder, model, input_ids, attention_mask)
    # the start tokens (3 rows x 1), then the first drafts probed, then fed (3 rows x 3)
    assert timed[:3] == [(3, 1), (3, 1), (3, 3)] and feeding[:3] == [False, False, True]
    assert first.stats["draft_tokens_accepted"] > 0
    # free to feed: the next decode feeds its first drafts, from the earlier decode's tally
    feeding.clear(), fed.clear()
    assert_greedy(decoder, model, input_ids, attention_mask)
    assert feeding[1] and fed[1] == 6
    costly["on"] = True
    for _ in range(6):   # until the costly calls outnumber the free ones at each count
        out = assert_greedy(decoder, model, input_ids, attention_mask)
        if out.stats["draft_tokens_offered"] == 0:
            break
    assert out.stats["draft_tokens_offered"] == 0 and decoder.feeding_record(input_ids.device).costs.extra(3, 2) > 2
    feeding.clear(), fed.clear()
    assert_greedy(decoder, model, input_ids, attention_mask)
    assert sum(fed) == 0 and not any(feeding[1:])   # the first call has no draft to feed


def test_call_costs_fit_a_calls_rows_and_its_fed_tokens_apart():
    costs = CallCosts()
    costs.add(1, 1, 1.75)
    costs.add(1, 1, 90.0)                               # a slow first call: its median ignores it
    costs.add(1, 1, 1.75)
    costs.add(1, 5, 9.0)                                # a shape's slow first call
    assert costs.extra(1, 4) == 0.0                     # one shape in the fit: not known yet, feed
    for queries in (5, 5, 3, 3, 3):   # seconds = 1.5 + 0.25 x tokens at batch size 1
        costs.add(1, queries, 1.5 + 0.25 * queries)
    assert costs.extra(1, 4) == pytest.approx(1 / 1.75)   # 4 columns at 1 row add 1 to 1.75
    # seconds = 1 + 0.5 x rows + 0.25 x fed tokens: rows that end make calls cheaper, which a line
    # in fed tokens alone would have charged to feeding
    costs = CallCosts()
    for rows, queries in ((16, 1), (16, 4), (8, 1), (8, 4), (3, 1), (1, 1)) * CALLS_TO_FIT:
        costs.add(rows, queries, 1 + 0.5 * rows + 0.25 * rows * queries)
    costs.add(2, 4, 100.0)                              # timed once: not in the fit
    assert costs.extra(16, 3) == pytest.approx(0.25 * 16 * 3 / (1 + 8 + 4))


def test_a_decode_starts_from_the_earlier_decodes_tally_weighed_as_a_few_drafts():
    record = FeedingRecord()
    assert record.prior() == Tally(None)                # nothing yet: its first drafts are probed
    prior = record.prior()
    decode = prior.added([2, 0], [2, 0], [None, True]) # fed 2 (both taken), probed a right token
    record.add(decode, prior)
    assert record.drafts == Tally(None, hits=2, tries=2, fed_hits=1, fed_hits_accepted=2)
    for _ in range(9):   # 20 tries of which 20 hits, 10 fed: weighed as PRIOR_TRIES tries
        record.add(decode, Tally(None))
    start = record.prior()
    assert start.tries == pytest.approx(PRIOR_TRIES) and start.hits == pytest.approx(PRIOR_TRIES)
    assert start.fed_hits_accepted / start.fed_hits == pytest.approx(2.0)
    assert start.reached(1, 1, extra_cost=2.0) and not start.reached(1, 1, extra_cost=2.1)


def test_a_decode_may_feed_while_nothing_is_tallied_or_its_start_reaches_the_rule():
    """`FeedingRecord.may_feed`: before any draft is tallied, yes (the verify loop learns by
    probing); then the measured rule for a call whose every row offers the columns."""
    record = FeedingRecord()
    assert record.may_feed(1, 3)
    record.add(Tally(None, hits=1, tries=4), Tally(None))   # a quarter pass at their first token
    assert record.may_feed(1, 3)                             # feeding's cost not measured: free
    for queries, seconds in ((1, 1.0), (4, 1.5)):            # a fed column adds 1/6 of a call
        for _ in range(CALLS_TO_FIT):
            record.costs.add(1, queries, seconds)
    assert record.may_feed(1, 1) and not record.may_feed(1, 3)   # 1/4 against 1/6 and 1/2


def test_a_loop_choice_times_both_loops_then_runs_the_faster_and_revisits_the_other():
    """`LoopChoice`: the verify loop's first decodes at a batch size, then sequential decoding's,
    then the one of fewer seconds per output token, the other once after REVISIT_EVERY decodes,
    then after twice the last gap while revisits leave the choice as it was, up to
    MOST_DECODES_BETWEEN_REVISITS; each batch size apart."""
    choice, seconds, ran = LoopChoice(), {True: 2.0, False: 1.0}, []
    for _ in range(8 * MOST_DECODES_BETWEEN_REVISITS):
        ran.append(choice.verifies(4))
        choice.add(4, ran[-1], seconds[ran[-1]])
    compared = 2 * DECODES_TO_COMPARE
    assert ran[:compared] == [True] * DECODES_TO_COMPARE + [False] * DECODES_TO_COMPARE
    revisits = [n for n in range(compared, len(ran)) if ran[n]]
    gaps = [later - earlier for earlier, later in zip(revisits, revisits[1:])]
    assert revisits[0] == REVISIT_EVERY - 1 and gaps[0] == 2 * REVISIT_EVERY
    assert all(gap == min(2 * earlier, MOST_DECODES_BETWEEN_REVISITS)
               for earlier, gap in zip(gaps, gaps[1:]))
    assert gaps[-1] == MOST_DECODES_BETWEEN_REVISITS and gaps.count(gaps[-1]) > 2
    assert choice.verifies(2)


def test_a_loop_choice_compares_a_revisit_with_the_chosen_loops_latest_decodes():
    """Each comparison is timed in one stretch: the machine slowing 3x while sequential decoding
    runs moves no choice (the verify loop, timed before the slowing, is not compared with its
    later decodes); a revisit of the verify loop twice as fast as sequential decoding's latest
    decodes is a ratio of 1/2, and once those make the median of the latest COMPARISONS_KEPT, the
    verify loop runs, and sequential decoding is revisited after REVISIT_EVERY decodes again."""
    choice, seconds, ran = LoopChoice(), {True: 2.0, False: 1.0}, []

    def revisits(count, slowing):
        """Decodes until `count` revisits have run."""
        chosen = choice.chosen(4)
        for _ in range(count):
            while True:
                ran.append(choice.verifies(4))
                choice.add(4, ran[-1], seconds[ran[-1]] * slowing)
                if ran[-1] != chosen:
                    break

    for _ in range(2 * DECODES_TO_COMPARE):
        ran.append(choice.verifies(4))
        choice.add(4, ran[-1], seconds[ran[-1]])
    revisits(2, 3.0)
    assert list(choice.ratios[4]) == [2.0] * 3
    seconds[True] = 0.5
    revisits(COMPARISONS_KEPT // 2, 3.0)
    assert not choice.chosen(4)   # one ratio of 1/2 short of the median
    revisits(1, 3.0)
    assert statistics.median(choice.ratios[4]) == 0.5 and choice.chosen(4)
    following = []
    for _ in range(REVISIT_EVERY):
        following.append(choice.verifies(4))
        choice.add(4, following[-1], seconds[following[-1]])
    assert following == [True] * (REVISIT_EVERY - 1) + [False]


def test_a_loop_choice_times_the_loops_after_the_encoder(monkeypatch):
    """Measured, the seconds per output token that `LoopChoice` compares leave out the encoder,
    which the verify loop and sequential decoding run alike (and which would weigh most in the
    shortest outputs): an encoder that takes 1000 s on the clock shows in neither loop's time."""
    model = tiny_t5(0)
    decoder, input_ids, attention_mask = knowing_drafter(model, 12, right_until=BOUND)
    assert decoder.min_acceptance is None
    slept, clock = [0.0], time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: clock() + slept[0])
    encode = decoder.encoder_pass()

    def slow_encode(*args):
        slept[0] += 1000.0
        return encode(*args)

    monkeypatch.setattr(decoder, "encoder_pass", lambda: slow_encode)
    for loop in (True, False):
        monkeypatch.setattr(decoder, "verifies", lambda record, rows, loop=loop: loop)
        assert_greedy(decoder, model, input_ids, attention_mask)
    seconds = decoder.feeding_record(input_ids.device).loops.seconds
    assert slept[0] == 2000.0 and set(seconds) == {(3, True), (3, False)}
    assert all(0 < per_token < 1 for times in seconds.values() for per_token in times)


def test_a_loop_choice_leaves_out_a_decode_that_compiled_a_step(monkeypatch):
    """Measured, a decode during which a fixed-shape step compiled (`COMPILED_STEPS` grew) adds no
    time to `LoopChoice`: its seconds are the compiling's, not the loop's; the next decode of the
    same loop, which compiles nothing, adds its own."""
    model = tiny_t5(0)
    decoder, input_ids, attention_mask = knowing_drafter(model, 12, right_until=BOUND)
    assert decoder.min_acceptance is None
    verify = decoder.verify_generate

    def compiling(*args):
        COMPILED_STEPS.append("a step compiled during the decode")
        return verify(*args)

    loops = decoder.feeding_record(input_ids.device).loops
    try:
        monkeypatch.setattr(decoder, "verify_generate", compiling)
        assert_greedy(decoder, model, input_ids, attention_mask)
        assert loops.seconds == {} and loops.decodes == {}
    finally:
        COMPILED_STEPS.pop()
    monkeypatch.setattr(decoder, "verify_generate", verify)
    assert_greedy(decoder, model, input_ids, attention_mask)
    assert {key: len(times) for key, times in loops.seconds.items()} == {(3, True): 1}


@pytest.mark.parametrize("offering,feeds", [({0}, False), ({0, 1}, True)])
def test_a_call_feeds_drafts_only_where_enough_of_its_rows_offer_one(monkeypatch, offering, feeds):
    """Every row of a call computes a fed column: with min_acceptance 0.5 and drafts that always
    pass, a call of 3 rows feeds them where 2 rows offer one (2/3 of a first token expected per
    row) and never where only 1 does (1/3), which probes its drafts instead; the output stays
    greedy."""
    model = tiny_t5(0)
    _, fed = recorded_feeds(monkeypatch)
    decoder, input_ids, attention_mask = knowing_drafter(model, 12, right_until=BOUND,
                                                         min_acceptance=0.5, offering=offering)
    out = assert_greedy(decoder, model, input_ids, attention_mask)
    assert (sum(fed) > 0) == feeds
    assert (out.stats["draft_tokens_accepted"] > 0) == feeds


def test_a_tally_counts_fed_and_probed_drafts_at_their_first_token():
    tally = Tally(threshold=0.5)
    assert not tally.reached(1, 1)                           # no draft yet: probe first
    # fed 2 (1 accepted), fed 3 (0 accepted), offered nothing, probed a right and a wrong token
    tally = tally.added([2, 3, 0, 0, 0], [1, 0, 0, 0, 0], [None, None, None, True, False])
    assert (tally.hits, tally.tries) == (2, 4) and tally.reached(1, 1)
    # a call where 4 of 5 rows offer expects 4 * 0.5 = 2 first tokens: 0.4 per row, below 0.5
    assert tally.reached(5, 5) and not tally.reached(4, 5)
    tally = tally.added([1], [0], [None])
    assert (tally.hits, tally.tries) == (2, 5) and not tally.reached(1, 1)


class RepeatingDrafter(DraftAndVerifyDecoder):
    """A drafter in one class, as the README's example: it guesses that the model's newest token
    comes twice more (not registered here, to leave the registry as it is)."""

    layout_family = SequentialDecoder.layout_family
    trains_nothing = True
    layout, loss = SequentialDecoder.layout, SequentialDecoder.loss
    options = {"max_new_tokens": OUTPUT_BOUND, "draft_length": DRAFT_LENGTH}
    draft_width = 2

    def draft(self, model, state, verified, host) -> Draft:
        return Draft(verified.next_token.repeat(1, 2), offered=None)


@pytest.mark.parametrize("length", [FIXED, ADAPTIVE])
def test_a_drafter_of_one_class_decodes_greedily_and_is_counted(length):
    model = tiny_t5(0)
    decoder = RepeatingDrafter(model.config, SPECIAL, max_new_tokens=BOUND, draft_length=length).eval()

    def repeating(input_ids, attention_mask):
        """some draft accepted: an output repeats a token"""
        return decoder.generate(model, input_ids, attention_mask).stats["draft_tokens_accepted"] > 0
    out = assert_greedy(decoder, model, *first_batch_where(repeating, 6, seed=90))
    assert_drafts_counted(out, decoder.draft_width, drafts_first_call(decoder))


def test_the_adaptive_length_is_what_the_last_draft_achieved():
    lengths, width = [4, 4, 1, 3, 2, 2, 0, 0], 4
    offered = [2, 4, 1, 0, 2, 1, 0, 0]
    accepted = [2, 1, 0, 0, 2, 0, 0, 0]
    probes = [None] * 6 + [True, False]   # the last two rows fed nothing and probed
    # whole (back to m), cut after 1, cut at once (0), nothing offered (kept), whole, cut at once;
    # a probe that was the model's next token: a one-token draft accepted whole (m), one that was
    # not: rejected at once (0)
    assert next_draft_lengths(lengths, offered, accepted, probes, width) == [4, 1, 0, 3, 4, 0, 4, 0]


def test_a_row_feeds_at_most_its_length_and_probes_what_it_does_not_feed():
    offers = [3, 0, 2, 4, 1, 2]          # the drafter's offers
    # fixed: every offered token is fed, nothing probes
    assert fed_offers(offers, None) == (offers, [False] * 6)
    # adaptive: cut to each row's length, in a call as wide as half its rows offer (here 2); a row
    # at 0 whose drafter offered a token probes it
    assert fed_offers(offers, [4, 0, 0, 2, 3, 4]) == ([2, 0, 0, 2, 1, 2], [False, False, True] + [False] * 3)
    # ... and where half the rows offer 1
    assert fed_offers(offers, [0, 0, 0, 2, 3, 4]) == ([0, 0, 0, 1, 1, 1], [True, False, True] + [False] * 3)
    # a call that feeds no draft (most rows offer none): every row that offered probes instead
    assert fed_offers(offers, [0, 0, 0, 2, 0, 0]) == ([0] * 6, [True, False, True, True, True, True])
    # a decode whose drafts are accepted too rarely (`Tally`): no row feeds, every row
    # that offered probes, under either length
    for lengths in (None, [4] * 6):
        assert fed_offers(offers, lengths, feeding=False) == ([0] * 6, [True, False, True, True, True, True])


def test_a_call_is_as_wide_as_half_its_rows_offer():
    assert call_width([3]) == 3                      # batch size 1: the row's own offer
    assert call_width([4, 0, 0]) == 0                # one row of three offers: no draft fed
    assert call_width([4, 0]) == 4                   # half the rows
    assert call_width([4, 2, 1, 0, 0]) == 1
    # every offering row still feeds a token, none probes
    assert fed_offers([4, 2, 1, 0, 0], [4] * 5) == ([1, 1, 1, 0, 0], [False] * 5)


def test_rows_at_one_count_read_the_bias_every_row_gathers():
    model, bound, k = tiny_t5(0), 9, 4
    table, per_queries = bias_tables(model, bound, k, torch.device("cpu"))
    for queries in range(1, k + 1):
        tables = per_queries[queries]
        for count in range(bound):
            gathered = table.gather(count + tables.based_offsets[..., : count + queries])  # (heads, Q, W)
            shared = tables.one_count[..., bound - 1 - count: bound - 1 + queries]        # (1, heads, Q, W)
            assert torch.equal(shared[0], gathered), (queries, count)


def test_only_the_positions_a_row_offers_count():
    # rows offering 0, 2 and 1 draft tokens: a call of 3 columns, whose last token and offered
    # draft tokens are positions row * 3 + 0 .. row * 3 + offer
    assert counted_positions([0, 2, 1]) == [0, 3, 4, 5, 6, 7]
    assert counted_positions([2, 2]) is None   # every position counts
    assert counted_positions([0, 0]) is None   # one column


def test_the_cache_holds_each_rows_token_at_its_position_through_every_kind_of_call():
    # Rows 0 and 1 (2 heads, head_dim 3): calls at one count and at different counts, with
    # rejected draft tokens (a row's next count is at most its last one plus the tokens fed),
    # checked against a plain (rows, positions) record of what each call wrote. A slot past a row's
    # count may hold anything (the bias hides it); every slot before it must hold the key the row's
    # token there was given, and a call returns every slot below its width.
    torch.manual_seed(0)
    cache, written = DecoderCache(1, most_slots=32), {}

    def call(counts: list[int], queries: int):
        keys = torch.randn(2, 2, queries, 3, dtype=torch.float64)
        width = max(counts) + queries
        if len(set(counts)) == 1:
            slots = Slots(start=counts[0])
        else:
            slots = Slots(each=torch.tensor(counts)[:, None] + torch.arange(queries),
                          rows=torch.arange(2)[:, None], width=width)
        stored_keys, stored_values = cache.write(0, slots, keys, -keys)
        assert stored_keys.shape == (2, 2, width, 3)
        for row, count in enumerate(counts):
            for fed in range(queries):
                written[row, count + fed] = keys[row, :, fed]
            for position in range(count + queries):
                assert torch.equal(stored_keys[row, :, position], written[row, position]), (row, position)
                assert torch.equal(stored_values[row, :, position], -written[row, position])

    call([0, 0], 1)          # the first call: the start token
    call([1, 1], 4)          # a draft of 3 at one count
    call([3, 2], 4)          # row 0 kept 2, row 1 kept 1: different counts, rejected slots overwritten
    call([5, 5], 2)          # one count again, below the slots the last call wrote
    call([6, 6], 1)          # a one-token call right after
    call([7, 7], 3)          # a draft of 2 at one count
    call([9, 8], 4)          # different counts again, the buffer growing past what it held


def test_the_cache_keeps_every_position_when_a_call_attends_fewer_slots_than_the_last():
    # A family that reads its keys' positions (UMT5): a wide first call at one count (a first
    # draft of 9), then the rows at different counts in a call attending fewer slots than it held.
    cache = DecoderCache(1, most_slots=32)
    assert cache.write_positions(Slots(start=0), torch.arange(10)[None]).tolist() == [list(range(10))]
    counts = torch.tensor([[2], [2], [3]])
    attended = cache.write_positions(Slots(each=counts, rows=torch.arange(3)[:, None], width=4), counts)
    assert attended.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]]


def test_the_readmes_drafter_is_one_class_that_decodes_greedily():
    """The README's drafter, as written there, in a process of its own (it registers a decoder):
    registered by its one class, it decodes a random model as the sequential decoder does."""
    readme = (REPO / "README.md").read_text()
    example = next(block.split("```")[0] for block in readme.split("```python")[1:]
                   if "DraftAndVerifyDecoder" in block)
    check = textwrap.dedent("""
        import torch
        from decoders import build_decoder
        from tests.conftest import SPECIAL, random_batch, sequential, tiny_t5
        torch.set_default_dtype(torch.float64)
        model = tiny_t5(0)
        input_ids, attention_mask = random_batch(6, seed=90)
        out = build_decoder("repeats", model.config, SPECIAL, max_new_tokens=20).generate(
            model, input_ids, attention_mask)
        reference = sequential(model, 20).generate(model, input_ids, attention_mask)
        assert out.subsequences == reference.subsequences and out.tokens == reference.tokens
        assert out.stats["draft_tokens_offered"] > 0
        print("greedy")
        """)
    done = subprocess.run([sys.executable, "-c", example + check], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "greedy", done.stderr[-3000:]
