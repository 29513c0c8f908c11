"""What the verify loop decides on the host, from the values a call's one host sync reads: how
many tokens a row keeps, how many draft tokens each row feeds next (`draft_length`,
`min_acceptance`) and which rows probe their draft instead. Pure functions of host ints; the
reasons are in docs/decoders.md ("Draft and verify")."""
from __future__ import annotations

from typing import NamedTuple

from datamodules.vocabulary import Choice, Range
from decoders.base import Option

# How many draft tokens a row offers per call (the decoders' option `draft_length`): always the
# drafter's width m (`fixed`), or a per-row length that follows what the row's drafts achieve
# (`adaptive`, `next_draft_lengths`).
FIXED, ADAPTIVE = "fixed", "adaptive"
DRAFT_LENGTH = Option(FIXED, Choice((FIXED, ADAPTIVE)), decode_only=True)

# The first draft tokens a call's drafts are expected to get accepted, per row of the call, below
# which it feeds no draft (the decoders' option `min_acceptance`, `Tally.reached`; at batch size 1:
# the share of the decode's drafts accepted at their first token); 0: every call feeds.
MIN_ACCEPTANCE = Option(0.0, Range(ge=0, le=1, integer=False,
                                   note="first draft tokens expected accepted per row of a call"),
                        decode_only=True)


class Tally(NamedTuple):
    """Of the drafts a decode's rows offered so far, fed or probed, how many had their first token
    accepted. A probe checks the first token too, so an unfed draft counts as its fed one would.
    Before any draft it reaches no threshold: a decode's first drafts are probed, not fed."""

    threshold: float
    hits: int = 0
    tries: int = 0

    def added(self, offers: list[int], accepted: list[int], probes: list[bool | None]) -> "Tally":
        """With a call's rows: what each fed (`offers`) and accepted, and its probe (None: none)."""
        hits, tries = self.hits, self.tries
        for offer, taken, probe in zip(offers, accepted, probes):
            if offer or probe is not None:
                tries += 1
                hits += bool(taken) if offer else probe
        return self._replace(hits=hits, tries=tries)

    def reached(self, offering: int, rows: int) -> bool:
        """Whether a call of `rows` rows, `offering` of which offer a draft, feeds them: whether the
        first tokens they are expected to get accepted (the tally's share of `offering`) make up
        at least `threshold` per row of the call. Every row of a call computes a fed column, the
        rows that offer nothing too."""
        return self.tries > 0 and offering * self.hits >= self.threshold * self.tries * rows


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
