"""What the verify loop decides on the host, from the values a call's one host sync reads: how
many tokens a row keeps, how many draft tokens each row feeds next (`draft_length`,
`min_acceptance`) and which rows probe their draft instead. Pure functions of host ints, and
what the measured feeding rule keeps of a decoder's decodes (`FeedingRecord`); the reasons are in
docs/decoders.md ("Draft and verify")."""
from __future__ import annotations

import statistics
from collections import deque
from typing import NamedTuple

from datamodules.vocabulary import Choice, Range
from decoders.base import Option

# How many draft tokens a row offers per call (the decoders' option `draft_length`): always the
# drafter's width m (`fixed`), or a per-row length that follows what the row's drafts achieve
# (`adaptive`, `next_draft_lengths`).
FIXED, ADAPTIVE = "fixed", "adaptive"
DRAFT_LENGTH = Option(FIXED, Choice((FIXED, ADAPTIVE)), decode_only=True)

# When a call feeds its drafts (the decoders' option `min_acceptance`, `Tally.reached`): a number,
# the first draft tokens its drafts are expected to get accepted per row of the call, below which
# it feeds none (at batch size 1: the share of the decode's drafts accepted at their first token;
# 0: every call feeds); null, while the draft tokens they are expected to get accepted per row pay
# for the extra time that feeding them is measured to take (`CallCosts`), and each decode runs the
# verify loop or sequential decoding, whichever was measured faster (`LoopChoice`). Lookup's and
# blockwise's default is null (results/builtin_*_feeding_rule.md); aggressive's is 0, as it was not
# measured under the rule.
ALLOWED_MIN_ACCEPTANCE = Range(ge=0, le=1, integer=False, optional=True,
                               note="first draft tokens expected accepted per row of a call; null: "
                                    "while the tokens they gain pay for their measured cost")
MEASURED_MIN_ACCEPTANCE = Option(None, ALLOWED_MIN_ACCEPTANCE, decode_only=True)
ALWAYS_MIN_ACCEPTANCE = Option(0.0, ALLOWED_MIN_ACCEPTANCE, decode_only=True)


class Tally(NamedTuple):
    """Of the drafts a decode's rows offered so far, fed or probed, how many had their first token
    accepted, and of the fed ones accepted so, how many tokens they got accepted in all. A probe
    checks the first token too, so an unfed draft counts as its fed one would. Before any draft it
    reaches no threshold: a decode's first drafts are probed, not fed (measured, a decode starts
    from the earlier decodes' tally, `FeedingRecord.prior`)."""

    threshold: float | None       # `min_acceptance`; None: measured (`FeedingRecord`)
    hits: float = 0
    tries: float = 0
    fed_hits: float = 0           # fed drafts accepted at their first token
    fed_hits_accepted: float = 0  # the draft tokens those got accepted

    def added(self, offers: list[int], accepted: list[int], probes: list[bool | None]) -> "Tally":
        """With a call's rows: what each fed (`offers`) and accepted, and its probe (None: none)."""
        hits, tries = self.hits, self.tries
        fed_hits, fed_hits_accepted = self.fed_hits, self.fed_hits_accepted
        for offer, taken, probe in zip(offers, accepted, probes):
            if offer or probe is not None:
                tries += 1
                hits += bool(taken) if offer else probe
            if offer and taken:
                fed_hits += 1
                fed_hits_accepted += taken
        return self._replace(hits=hits, tries=tries, fed_hits=fed_hits,
                             fed_hits_accepted=fed_hits_accepted)

    def counts(self) -> tuple[float, ...]:
        """Every count, in field order (all but `threshold`)."""
        return self[1:]

    def with_counts(self, counts) -> "Tally":
        """The same threshold, with `counts` (as `counts` gives them)."""
        return Tally(self.threshold, *counts)

    def reached(self, offering: int, rows: int, extra_cost: float = 0.0) -> bool:
        """Whether a call of `rows` rows, `offering` of which offer a draft, feeds them. Under a
        `threshold`: whether the first tokens they are expected to get accepted (the tally's share
        of `offering`) make up at least `threshold` per row of the call. Measured: whether the
        draft tokens they are expected to get accepted (those first tokens, times the tokens a fed
        draft accepted at its first got accepted on average; 1 before any) make up at least
        `extra_cost` per row, the share of a call's time that feeding them adds. Every row of a
        call computes a fed column, the rows that offer nothing too."""
        if self.threshold is not None:
            return self.tries > 0 and offering * self.hits >= self.threshold * self.tries * rows
        per_hit = self.fed_hits_accepted / self.fed_hits if self.fed_hits else 1.0
        return self.tries > 0 and offering * self.hits * per_hit >= extra_cost * self.tries * rows


# The latest calls of each shape whose median `CallCosts` keeps.
CALLS_KEPT = 15
# The calls of a shape timed before its median enters the fit: a shape's first calls after its
# step was compiled, or its memory first touched, run slower than the later ones, and a shape
# measured once too slow is fed no more, so never measured again.
CALLS_TO_FIT = 3
# At most this many drafts of the earlier decodes weigh in a decode's start (`FeedingRecord.prior`):
# enough to feed its first drafts where they pay, few enough that its own soon outweigh them.
PRIOR_TRIES = 8


class CallCosts:
    """What a verify loop's calls cost, measured over its decodes on one device: the seconds of each
    call and its one host sync, by its shape (rows, and tokens fed per row: the newest and the
    draft columns); per shape the median of its latest CALLS_KEPT calls, and through those of the
    shapes timed CALLS_TO_FIT times or more a least-squares fit of seconds = a + b·rows +
    c·rows·tokens per row (a call's own cost, a row's, a fed token's), fitted again after every
    CALLS_KEPT calls or a shape that enters it. Rows and
    fed tokens are fitted apart: a batch's calls grow cheaper as its rows end, which is not what
    feeding costs."""

    def __init__(self):
        self.seconds: dict[tuple[int, int], deque[float]] = {}
        self.fit: tuple[float, float, float, float] | None = None   # (a, b, c, cheapest median)
        self.since_fit = 0

    def add(self, rows: int, queries: int, seconds: float) -> None:
        calls = self.seconds.setdefault((rows, queries), deque(maxlen=CALLS_KEPT))
        calls.append(seconds)
        self.since_fit += 1
        if len(calls) == CALLS_TO_FIT or self.since_fit >= CALLS_KEPT:
            self.fit = None

    def extra(self, rows: int, columns: int) -> float:
        """The share of a call's time that feeding `columns` draft columns beside each of its `rows`
        rows' newest token adds, by the fit; 0 until two shapes were timed CALLS_TO_FIT times: a
        loop learns what feeding costs by feeding."""
        shapes = [shape for shape, calls in self.seconds.items() if len(calls) >= CALLS_TO_FIT]
        if len(shapes) < 2:
            return 0.0
        if self.fit is None:
            medians = [statistics.median(self.seconds[shape]) for shape in shapes]
            self.fit, self.since_fit = (*fitted_costs(shapes, medians), min(medians)), 0
        a, b, c, cheapest = self.fit
        c = max(c, 0.0)
        # a call never costs less than the cheapest shape was measured to
        return c * rows * columns / max(a + b * rows + c * rows, cheapest)


def fitted_costs(shapes: list[tuple[int, int]], seconds: list[float]) -> tuple[float, float, float]:
    """(a, b, c) of the least-squares fit seconds = a + b·rows + c·rows·queries over `shapes`
    ((rows, queries) each), in plain Python (no tensor: nothing the loop's one sync per call would
    count). One row count (batch size 1): its own line, b 0. A fed token's cost not yet seen (every
    shape feeds one token per row): c 0."""
    rows = {r for r, _ in shapes}
    if all(q == 1 for _, q in shapes):
        return min(seconds), 0.0, 0.0
    if len(rows) == 1:
        (r,) = rows
        c, a = statistics.linear_regression([r * q for _, q in shapes], seconds)
        return a, 0.0, c
    terms = [(1.0, r, r * q) for r, q in shapes]
    # normal equations (3 x 3), solved by elimination with partial pivoting
    m = [[sum(t[i] * t[j] for t in terms) for j in range(3)]
         + [sum(t[i] * y for t, y in zip(terms, seconds))] for i in range(3)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda row: abs(m[row][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if abs(m[col][col]) < 1e-12:   # rows and fed tokens not apart: no fed token's cost yet
            return min(seconds), 0.0, 0.0
        for row in range(3):
            if row != col:
                factor = m[row][col] / m[col][col]
                m[row] = [x - factor * y for x, y in zip(m[row], m[col])]
    return tuple(m[i][3] / m[i][i] for i in range(3))


# The decodes of each loop timed at a batch size before the two are compared, and the latest decodes
# of the chosen loop that a revisit of the other is compared with: a median of three that one decode
# slowed by first touching memory does not move.
DECODES_TO_COMPARE = 3
# The decodes at a batch size after which the loop not chosen runs once (a revisit), so that its
# time stays current as the tally and the machine change: REVISIT_EVERY at first; twice the last
# gap after a revisit that leaves the choice as it was, up to MOST_DECODES_BETWEEN_REVISITS, since
# a revisit costs a slower decode (compiled, perhaps a shape compiled); REVISIT_EVERY again after
# one that changes it.
REVISIT_EVERY = 32
MOST_DECODES_BETWEEN_REVISITS = 512
# The latest comparisons of the two loops at a batch size whose median decides.
COMPARISONS_KEPT = 5


class LoopChoice:
    """Which loop decodes a batch under the measured rule: the verify loop, or sequential decoding
    of the same model, whose calls feed nothing and cost less (with lookup's drafts probed on its
    output afterwards). Decided by the loops' seconds per output token after the encoder (which
    both run alike, and which would weigh most in the shortest outputs), of the decodes at the batch
    size that compiled no step (a step compiles once per shape, in seconds, and a loop's first
    decodes compile most: that says nothing of its later ones): first DECODES_TO_COMPARE decodes of
    the verify loop, then of sequential decoding, then the faster, and now and then the other
    (REVISIT_EVERY). Each comparison is a ratio of the verify loop's time to sequential
    decoding's, timed in the same stretch: the first of the two loops' medians, then each
    revisit's over the chosen loop's latest DECODES_TO_COMPARE decodes; the median of the latest
    COMPARISONS_KEPT decides. A shared machine's speed drifts by more than the loops differ; a
    loop's times from decodes long ago, against the other's of now, would choose by the drift."""

    def __init__(self):
        self.seconds: dict[tuple[int, bool], deque[float]] = {}   # (rows, verify loop) -> latest
        self.ratios: dict[int, deque[float]] = {}                 # rows -> verify / sequential
        self.decodes: dict[int, int] = {}                         # rows -> decodes timed
        self.revisits: dict[int, tuple[int, int]] = {}            # rows -> (the next's decode, gap)

    def chosen(self, rows: int) -> bool | None:
        """Whether the loop chosen at `rows` rows is the verify loop; None before both were timed."""
        ratios = self.ratios.get(rows)
        return statistics.median(ratios) <= 1 if ratios else None

    def verifies(self, rows: int) -> bool:
        """Whether the next decode of `rows` rows runs the verify loop."""
        chosen = self.chosen(rows)
        if chosen is None:
            return len(self.seconds.get((rows, True), ())) < DECODES_TO_COMPARE
        return chosen != (self.decodes[rows] == self.revisits[rows][0])

    def add(self, rows: int, verified: bool, seconds_per_token: float) -> None:
        """A decode of `rows` rows, by the verify loop or not, and its seconds per output token."""
        chosen = self.chosen(rows)
        if chosen is not None and chosen != verified:   # a revisit
            latest = statistics.median(self.seconds[rows, chosen])
            self.ratios[rows].append(seconds_per_token / latest if verified else latest / seconds_per_token)
            gap = self.revisits[rows][1]
            confirmed = self.chosen(rows) == chosen
            gap = min(2 * gap, MOST_DECODES_BETWEEN_REVISITS) if confirmed else REVISIT_EVERY
            self.revisits[rows] = (self.decodes[rows] + gap, gap)
        self.seconds.setdefault((rows, verified), deque(maxlen=DECODES_TO_COMPARE)).append(seconds_per_token)
        self.decodes[rows] = self.decodes.get(rows, 0) + 1
        if chosen is None:   # both loops' first decodes timed: the first comparison
            verify, sequential = (self.seconds.get((rows, loop), ()) for loop in (True, False))
            if len(verify) == len(sequential) == DECODES_TO_COMPARE:
                self.ratios[rows] = deque([statistics.median(verify) / statistics.median(sequential)],
                                          maxlen=COMPARISONS_KEPT)
                self.revisits[rows] = (REVISIT_EVERY - 1, REVISIT_EVERY)


class FeedingRecord:
    """What a drafter measured over its decodes on one device, eagerly or compiled, from which the
    measured rule (`min_acceptance` null) decides: its calls' costs, its drafts' tally summed over
    the decodes, and its loops' times."""

    def __init__(self):
        self.costs = CallCosts()
        self.drafts = Tally(None)
        self.loops = LoopChoice()

    def prior(self) -> Tally:
        """A decode's starting tally: the earlier decodes' shares, weighing as PRIOR_TRIES drafts
        at most."""
        scale = min(1.0, PRIOR_TRIES / self.drafts.tries) if self.drafts.tries else 1.0
        return self.drafts.with_counts(count * scale for count in self.drafts.counts())

    def may_feed(self, rows: int, columns: int) -> bool:
        """Whether a decode of `rows` rows starts where the measured rule could feed drafts: no
        draft tallied yet (its calls learn by probing, then feeding), or its starting tally
        reaching the rule (`Tally.reached`) for a call where every row offers `columns` draft
        tokens."""
        prior = self.prior()
        return not prior.tries or prior.reached(rows, rows, self.costs.extra(rows, columns))

    def add(self, decode: Tally, prior: Tally) -> None:
        """A decode's own drafts: its final tally less the prior it started from."""
        self.drafts = self.drafts.with_counts(
            total + end - start
            for total, end, start in zip(self.drafts.counts(), decode.counts(), prior.counts()))


def next_draft_lengths(lengths: list[int], offers: list[int], accepted: list[int],
                       probes: list[bool | None], width: int) -> list[int]:
    """The adaptive schedule, per row: after a draft (`offers`: the tokens it fed) accepted whole,
    the drafter's whole width m; after one cut short, as many tokens as it accepted (0 when none).
    A row that fed nothing but probed (`probes`: whether its probe was the model's next token, None
    where it did not probe) counts as a one-token draft. Any other row keeps its length."""
    return [(width if taken >= offer else taken) if offer else
            length if probe is None else width if probe else 0
            for length, offer, taken, probe in zip(lengths, offers, accepted, probes)]


def call_width(offers: list[int]) -> int:
    """How many draft tokens an adaptive call feeds per row: the longest offer that at least half
    the rows make (at batch size 1, the row's own)."""
    return sorted(offers, reverse=True)[(len(offers) - 1) // 2]


def fed_offers(offers: list[int], lengths: list[int] | None,
               feeding: bool = True) -> tuple[list[int], list[bool]]:
    """How many of its drafter's offered tokens each row feeds, and which rows probe: under the
    fixed length all of them; under the adaptive one at most its length, in a call as wide as
    `call_width`; none where the decode's drafts are accepted too rarely (`feeding` False,
    `Tally`). A row whose drafter offered a token that it does not feed probes it."""
    if not feeding:
        return [0] * len(offers), [offer > 0 for offer in offers]
    if lengths is None:
        return offers, [False] * len(offers)
    capped = [min(offer, length) for offer, length in zip(offers, lengths)]
    width = call_width(capped)
    fed = [min(offer, width) for offer in capped]
    return fed, [offer > 0 and not feeds for offer, feeds in zip(offers, fed)]


def kept_tokens(accepted: int, first_end: int, room: int) -> tuple[int, bool]:
    """How many of a call's tokens a row keeps, and whether it ended at the end token.

    The call produced the `accepted` draft tokens and then the model's own: accepted + 1 tokens,
    whose first end token is at index `first_end` (>= accepted + 1 where there is none); `room` >= 1
    tokens are left before max_new_tokens. Nothing after an end token is output.
    """
    kept = min(accepted + 1, first_end + 1, room)
    return kept, first_end < kept


def counted_positions(offers: list[int]) -> list[int] | None:
    """The flat indices (row * Q + fed index, Q = max(offers) + 1) of a call's fed positions that
    count, given each row's offer: a row's last token and its offered draft tokens. None when every
    row offers the widest (every position counts), or none does (one column)."""
    queries = max(offers) + 1
    if queries == 1 or min(offers) == queries - 1:
        return None
    return [row * queries + fed for row, offer in enumerate(offers) for fed in range(offer + 1)]
