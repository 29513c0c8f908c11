"""Draft and verify: guessed next tokens checked by the model's own greedy tokens in one decoder call.

One verify loop (`VerifyLoop`) with drafters composed into it: blockwise (its proposal heads draft),
lookup (spans of the source) and aggressive (a non-autoregressive model). A drafter is one subclass
of `DraftAndVerifyDecoder` and says only where a draft comes from; each is exactly greedy decoding
of its verifying model.

One call. Row r has produced n_r tokens; its last one sits at position n_r (the start token at 0).
The call feeds [y, d_1, .., d_m] (y its last token, d its draft) at positions n_r .. n_r + m. The
model's argmax at fed position j is the greedy token after it, so the row accepts the longest prefix
of its draft on which the argmax agrees (`accepted_length`; only the first `offered` draft tokens
count), and then takes the model's own next token: a call yields 1 .. m + 1 tokens. The first call
feeds the start token, and the draft's first m tokens where the drafter has them before any token
(`first_draft`: aggressive's whole-output draft); else the start token alone. `top_k` > 1 relaxes
acceptance to "among the model's top-k tokens" (Stern et al., Section 5: faster, no longer exact).

Ends and bounds (`kept_tokens`): a row keeps its tokens up to its first end token and up to
`max_new_tokens`. The one host sync of a call reads back each row's newest token, and where draft
tokens were fed its accepted count and first end (else the newest token is the only one), with
whatever the drafter needs on the host (`host_values`: aggressive's re-draft decision; lookup needs
only the newest tokens); the host decides from them which rows are done and
drops them (`LiveRows`), and only then are the rows that go on drafted for the next call, from those
host values. A drafter that needs nothing on the host (blockwise: its heads read the decoder's
state) drafts every live row on the device before the sync instead. Either way the host knows how
many tokens each draft offers (a `Draft`'s `offered`), so the next call feeds only as many columns
as the longest offer needs (one, the model's own token, when no row offers anything): a draft that
offers nothing costs no wider call. A row that goes on kept its whole accepted prefix plus one, so
its new count is n_r + accepted + 1, computed on the device. The host adds up what the loop counts
of every drafter's drafts (`LOOP_COUNTERS`: offered, accepted, cut at a separator) from the same
sync.

Draft length (`draft_length`): `fixed` offers the drafter's whole width m on every call; `adaptive`
gives each row its own length (`next_draft_lengths`): as many tokens as its last draft got accepted,
m after one accepted whole, so that a row whose drafts fail falls back to one-token calls while
another row's drafts pass; and a call feeds no wider a draft than half its rows offer
(`call_width`), so that one row's long draft does not widen the call for all (`fed_offers`). The
schedule runs on the host, from the values the call's sync reads.

Whether a call feeds drafts at all (`min_acceptance`): a draft column costs every row of a call, the
rows that offer no draft too, so drafts pay only where enough of the call's rows get a token from
them. The loop tallies, over the decode so far, how many rows' drafts had their first token accepted
(`FirstTokenTally`: fed drafts and probed ones alike). A call's drafts are expected to get that
share of its offering rows' first tokens accepted; where that is below `min_acceptance` per row of
the call (at batch size 1: while the share is below it), the call feeds no draft and every row that
offers one probes it instead, so that the tally goes on at no cost and feeding resumes when drafts
pass again; a decode's first drafts are probed, not fed. At 0 (the default) every call feeds its
drafts.

Cache (`RowSlotLayer`). Every row's self-attention keys and values sit at slot = position. A call
writes its fed tokens at their own positions; a rejected draft token's slot lies at or past the
row's new count, where the next call writes its own fed tokens before attending, and every slot past
a query's position is in its future, which the causal bias hides. So nothing is ever gathered or
compacted: a call attends to slots 0 .. max_r(n_r) + m, and the bias (T5's relative bias of query
position - slot, gathered from one table) hides what a row must not see. While every row is at one
count (always at batch size 1, and at any batch size until drafts are accepted) the call appends its
tokens after that count, as sequential decoding's cache does, and every row reads one bias, a slice
of a table made once per weights (`bias_tables`): no per-row index.

Host syncs: one per call, plus the final read-back of the outputs, plus what a drafter reads once
per decode (aggressive's drafter: its own encoder unless it shares the verifier's, its predicted
lengths, and under `realign` its draft; lookup: the sources).
"""
from __future__ import annotations

import abc
import functools
from dataclasses import dataclass
from typing import ClassVar, Generic, NamedTuple, TypeVar

import torch
from transformers.cache_utils import EncoderDecoderCache

from decoders.backbone import (cross_attention_mask, encode, HeadTable, made_from_bias_weight,
                               output_logits, past_distance_bias_table)
from datamodules.vocabulary import Choice, Range
from decoders.base import Decoder, Option
from decoders.loop import NOT_PRODUCED, LiveRows, flat_decode_output, read_back, send
from decoders.transformers_internals import CacheLayer, cache_with_self_attention_layers


def accepted_length(drafts: torch.Tensor, candidates: torch.Tensor,
                    offered: torch.Tensor | None = None) -> torch.Tensor:
    """How many leading draft tokens the model accepts.

    drafts: (B, m) the fed draft tokens; candidates: the model's argmax (B, m) (exact acceptance) or
    its top-k tokens (B, m, top_k) at the fed position *before* each draft token; offered: (B,)
    how many of a row's m draft tokens are real (None: all). Returns (B,) longs in 0..m: the length
    of the longest prefix of offered tokens that are all candidates.
    """
    if candidates.dim() == 2:
        match = drafts == candidates                                     # (B, m)
    else:
        match = (drafts[..., None] == candidates).any(-1)
    if offered is not None:
        match &= torch.arange(drafts.size(1), device=drafts.device) < offered[:, None]
    return match.cummin(dim=1).values.sum(dim=1)


# How many draft tokens a row offers per call (the decoders' option `draft_length`): always the
# drafter's width m (`fixed`), or a per-row length that follows what the row's drafts achieve
# (`adaptive`, `next_draft_lengths`).
FIXED, ADAPTIVE = "fixed", "adaptive"
DRAFT_LENGTH = Option(FIXED, Choice((FIXED, ADAPTIVE)), decode_only=True)


# The first draft tokens a call's drafts are expected to get accepted, per row of the call, below
# which it feeds no draft (the decoders' option `min_acceptance`, `FirstTokenTally.reached`; at batch
# size 1: the share of the decode's drafts accepted at their first token); 0: every call feeds.
MIN_ACCEPTANCE = Option(0.0, Range(ge=0, le=1, integer=False,
                                   note="first draft tokens expected accepted per row of a call"),
                        decode_only=True)


@dataclass
class FirstTokenTally:
    """Of the drafts a decode's rows offered so far, fed or probed, how many had their first token
    accepted (host ints), and whether a call's drafts would pay (`reached`). The first token is
    what a probe checks too, so a row's unfed draft counts as its fed one would: the tally goes on
    while no draft is fed. Before any draft it reaches no threshold: a decode's first drafts are
    probed, which costs nothing, and fed only once they have shown that they pass."""

    threshold: float
    hits: int = 0
    tries: int = 0

    def add(self, offers: list[int], accepted: list[int], probes: list[bool | None]) -> None:
        """A call's rows: what each fed (`offers`) and accepted, and its probe (None: none)."""
        for offer, taken, probe in zip(offers, accepted, probes):
            if offer or probe is not None:
                self.tries += 1
                self.hits += bool(taken) if offer else probe

    def reached(self, offering: int, rows: int) -> bool:
        """Whether a call of `rows` rows, `offering` of which offer a draft, feeds them: whether the
        first tokens they are expected to get accepted (the tally's share of `offering`) make up
        at least `threshold` (`min_acceptance`) per row of the call. Every row of a call computes a
        fed column, the rows that offer nothing too, so a few offering rows do not pay for it."""
        return self.tries > 0 and offering * self.hits >= self.threshold * self.tries * rows


def next_draft_lengths(lengths: list[int], offers: list[int], accepted: list[int],
                       probes: list[bool | None], width: int) -> list[int]:
    """The adaptive schedule, per row (host ints): a row offers what its last draft achieved.
    After a call whose draft (`offers`: the tokens it fed) the model accepted whole, the drafter's
    whole width m; after one it cut short, as many tokens as it accepted (0 when none). A row that
    fed no draft but probed one (`probes`: whether its probe was the model's next token; None where
    it did not probe) counts as a one-token draft: accepted whole (m next) or rejected at once (0).
    Any other row keeps its length.

    Why this and not transformers' assisted-decoding heuristic (2 more after a whole draft, 1 fewer
    after a cut one, floor 1): in a batch a call is as wide as its widest fed draft, so every token
    a row offers in vain widens the call for all rows, and outputs of a few words (answers, phrases)
    end before a length falling by 1 reaches the floor. Here a failed draft silences its row at
    once, and finding out whether drafts pass again is free: a row that feeds no draft still has its
    draft's first token compared with the model's next token (its probe, `fed_offers`), so the row
    offers m again, e.g. on the next span its output copies. Each row keeps its own length: one
    row's rejected drafts do not shorten another's. The schedule runs on the host, on values the
    call's one sync reads anyway: it adds no operation to the device's queue."""
    return [(width if taken >= offer else taken) if offer else
            length if probe is None else width if probe else 0
            for length, offer, taken, probe in zip(lengths, offers, accepted, probes)]


def call_width(offers: list[int]) -> int:
    """How many draft tokens an adaptive call feeds per row, given every row's offer (host ints):
    the longest offer that at least half the rows make. A call is as wide as this for every row, so
    a few rows' long offers would make the many rows that offer nothing compute filler columns;
    those rows' drafts are cut to this width (to no draft when most rows offer none), and the row
    whose draft is not fed probes it instead (`fed_offers`). At batch size 1 it is the row's own
    offer."""
    return sorted(offers, reverse=True)[(len(offers) - 1) // 2]


def fed_offers(offers: list[int], lengths: list[int] | None,
               feeding: bool = True) -> tuple[list[int], list[bool]]:
    """How many of its drafter's offered tokens each row feeds (host ints), and which rows probe:
    under the fixed length all of them; under the adaptive one at most its length, in a call as
    wide as `call_width`; none where the decode's drafts are accepted too rarely (`feeding` False,
    `FirstTokenTally`). A row whose drafter offered a token that it does not feed probes it: the
    draft's first token is compared with the model's next token (`next_draft_lengths`)."""
    if not feeding:
        return [0] * len(offers), [offer > 0 for offer in offers]
    if lengths is None:
        return offers, [False] * len(offers)
    capped = [min(offer, length) for offer, length in zip(offers, lengths)]
    width = call_width(capped)
    fed = [min(offer, width) for offer in capped]
    return fed, [offer > 0 and not feeds for offer, feeds in zip(offers, fed)]


def kept_tokens(accepted: int, first_end: int, room: int) -> tuple[int, bool]:
    """How many of a call's tokens a row keeps, and whether it ended at the end token (host ints).

    The call produced the `accepted` draft tokens and then the model's own: accepted + 1 tokens,
    whose first end token is at index `first_end` (>= accepted + 1 where there is none); `room` >= 1
    tokens are left before max_new_tokens. Nothing after an end token is output.
    """
    kept = min(accepted + 1, first_end + 1, room)
    return kept, first_end < kept


@dataclass
class SlotWrites:
    """Where a call writes: row `rows[r]` (live, 1) writes its fed tokens at slots `slots[r]`
    (live, Q), or, where every row is at one count, at slots `start` onward; every layer then
    attends to slots 0..width-1. No row's slot reaches `most`."""

    rows: torch.Tensor
    slots: torch.Tensor | None   # set by a call whose rows are at different counts, read by it only
    width: int
    most: int
    start: int | None = None   # where every row is at one count: the first slot all rows write


class RowSlotLayer(CacheLayer):
    """One decoder layer's self-attention keys and values, (B, heads, slots, head_dim): row r's
    token at position p sits in slot p. Replaces the appending layer of transformers' own cache,
    through the same `update` the attention calls.

    While every row is at one count, a call appends its tokens after the slots before that count,
    as transformers' appending layer does (slots past it, a rejected draft's, are cut off first):
    the call's keys are the stored tensor itself, with no copy into a buffer and no slice of it.
    Where rows are at different counts, each row's tokens are written at its own slots of a buffer
    that grows by doubling, zero-filled (an unwritten slot is hidden by the bias, but NaN garbage
    would survive it)."""

    def __init__(self, writes: SlotWrites):
        super().__init__()
        self.writes = writes

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:   # no slot yet
            self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
            self.device, self.is_initialized = key_states.device, True
        writes, keys, values = self.writes, self.keys, self.values
        if writes.start is not None:
            if keys.size(2) > writes.start:
                keys, values = keys.narrow(2, 0, writes.start), values.narrow(2, 0, writes.start)
            self.keys = torch.cat([keys, key_states], dim=2)
            self.values = torch.cat([values, value_states], dim=2)
            return self.keys, self.values
        if keys.size(2) < writes.width:
            room = min(writes.most, 2 * writes.width)
            self.keys, self.values = keys, values = _grown(keys, room), _grown(values, room)
        keys[writes.rows, :, writes.slots] = key_states.transpose(1, 2)     # (live, Q, heads, head_dim)
        values[writes.rows, :, writes.slots] = value_states.transpose(1, 2)
        return keys.narrow(2, 0, writes.width), values.narrow(2, 0, writes.width)

    def get_seq_length(self) -> int:
        return self.keys.size(2) if self.is_initialized else 0


def _grown(buffer: torch.Tensor, slots: int) -> torch.Tensor:
    grown = buffer.new_zeros(buffer.shape[:2] + (slots,) + buffer.shape[3:])
    grown[:, :, : buffer.size(2)] = buffer
    return grown


def row_slot_cache(num_layers: int, writes: SlotWrites) -> EncoderDecoderCache:
    """A decoder cache whose self-attention part is `RowSlotLayer`s sharing `writes`."""
    return cache_with_self_attention_layers([RowSlotLayer(writes) for _ in range(num_layers)])


@functools.lru_cache(maxsize=16)
def call_index_tables(k: int, most_slots: int, device: torch.device):
    """Index tables of a decode, made once per shape (they hold no weights): for a call of Q fed
    tokens (1 up to k), each token's fed index (Q,), fed index - slot (Q, most_slots) (the
    distances, once a row's count is added) and Q itself (0-dim: "no end token among them")."""
    fed_offset = torch.arange(k, device=device)
    query_minus_slot = fed_offset[:, None] - torch.arange(most_slots, device=device)
    return {q: (fed_offset[:q], query_minus_slot[:q], torch.tensor(q, device=device))
            for q in range(1, k + 1)}


@dataclass
class Source:
    """What a drafter may draft from, given once per decode (`begin_drafts`)."""

    input_ids: torch.Tensor       # (B, S) the encoder inputs
    attention_mask: torch.Tensor  # (B, S) 1 on real source tokens
    encoder_states: torch.Tensor  # (B, S, d_model) the verifying model's encoder output
    cross_mask: torch.Tensor | None = None   # (B, 1, 1, S) its `cross_attention_mask`


@dataclass
class Draft:
    """A drafter's guesses for the next call of its rows."""

    tokens: torch.Tensor | None   # (live, m) draft tokens, those past a row's offer filler; None
                                  # where no row offers any, or where they are `on_host`
    offered: list[int] | None     # host: how many of them each row offers; None: all m
    # host: each row's offered tokens, where the drafter made them there (lookup) and not `tokens`:
    # the loop sends only the columns a call feeds, and checks a probe on the host
    on_host: list[list[int]] | None = None


@dataclass
class Verified:
    """What a call settled, per row, for the drafter: every row of the call in `host_values` and in
    an early `draft`, the rows that go on in a late one."""

    hidden: torch.Tensor      # (live, d_model) decoder state at the last accepted fed position
    next_token: torch.Tensor  # (live, 1) the model's own token after the accepted ones, fed first next
    count: torch.Tensor       # (live, 1) tokens produced, next_token included (its output index + 1)
    example: torch.Tensor     # (live,) each row's example (its row in the batch)
    origin: torch.Tensor      # (live, 1) the same, as a column
    produced: torch.Tensor    # (batch, columns) every example's tokens so far, by output index


# What the loop gives a drafter that drafts after the sync, beside what it named (`host_values`):
# each row's example (its row in the batch), the model's newest token, the last of its output, and
# its count (tokens produced, that one included).
LOOP_HOST_VALUES = ("example", "next_token", "count")

# What the loop counts of every drafter's drafts, summed over a decode (its `stats` keys).
LOOP_COUNTERS = (
    "draft_tokens_offered",      # draft tokens offered to the model (a row's filler past them excluded)
    "draft_tokens_accepted",     # of those, accepted by the model (past an end token or bound too)
    "calls_with_draft",          # decoder calls of an example that offered at least one draft token
    "drafts_cut_at_separator",   # drafts not wholly accepted where the model wrote the separator
)

DraftState = TypeVar("DraftState")


class DraftAndVerifyDecoder(Decoder, Generic[DraftState]):
    """A decoder whose generation is draft and verify (module docstring): a drafter, which says where
    drafts come from, around the one verify loop (`VerifyLoop`). Registering a drafter is one
    subclass: `draft_width` and `draft`, and where it needs them `begin_drafts`, `host_values` and
    `drafter_counters`. Its options include `max_new_tokens`, and `top_k` (1 = exact) where it
    relaxes acceptance."""

    max_new_tokens: int
    top_k: int = 1
    draft_length: str = FIXED
    min_acceptance: float = 0.0
    # the `stats` key counting the decoder calls of every example (beside "accepted_tokens", the
    # tokens they produced: their ratio is the mean tokens per call)
    calls_stat: ClassVar[str] = "draft_calls"

    @property
    @abc.abstractmethod
    def draft_width(self) -> int:
        """m: the draft tokens fed per call after the last accepted token (>= 1)."""
        raise NotImplementedError

    @classmethod
    def inexact(cls, options) -> bool:
        return int(options.get("top_k", 1)) > 1

    def begin_drafts(self, model, source: Source) -> DraftState:
        """The drafter's state over one decode, set up once and passed to every other hook (None by
        default)."""
        return None

    def first_draft(self, state: DraftState) -> Draft | None:
        """The first call's drafts of every row, output indices 0 .. m - 1, where the drafter has
        them before the model's first token (aggressive's drafter drafts whole outputs): that call
        then verifies them beside the start token. None (the default): it feeds the start token
        alone."""
        return None

    def host_values(self, state: DraftState, verified: Verified) -> dict[str, torch.Tensor] | None:
        """What the next `draft` needs on the host, by name: (live,) longs for every row of the call,
        read back with the call's one host sync (aggressive under the paper's rule: which rows'
        drafts disagree with the model's token), beside what the loop reads there anyway
        (`LOOP_HOST_VALUES`). A dict, even an empty one: the drafter drafts after the sync, from
        host values (lookup; aggressive). None (the default): it needs nothing there, and drafts
        on the device before the sync (blockwise)."""
        return None

    @abc.abstractmethod
    def draft(self, model, state: DraftState, verified: Verified,
              host: dict[str, list[int]] | None) -> Draft:
        """The next call's drafts for the rows of `verified`. `host` holds those rows' entries of
        what `host_values` named and of `LOOP_HOST_VALUES`; a drafter whose `host_values` is None
        gets None, and is asked before the call's sync, for every row of the call (those that end
        then included)."""
        raise NotImplementedError

    def drafter_counters(self, state: DraftState) -> dict[str, float]:
        """The drafter's own counters of a decode (host values), reported in `stats` beside the
        loop's (`LOOP_COUNTERS`)."""
        return {}

    @torch.no_grad()
    def generate(self, model, input_ids, attention_mask):
        loop = VerifyLoop(self, model, input_ids, attention_mask)
        while True:
            verified, accepted, first_end = loop.accept(loop.feed())
            done, early, host = loop.settle(verified, accepted, first_end)
            if not loop.go_on(done, verified, early, host):
                return loop.output()


@dataclass
class Rows:
    """The live rows of a decode, in the order of the call: device tensors and host lists."""

    fed: torch.Tensor             # (live, Q) each row's last token, then its draft
    draft: torch.Tensor | None    # (live, Q - 1) the draft tokens of `fed`; None at Q = 1
    count: torch.Tensor           # (live, 1) tokens produced: the first fed token's position
    examples: list[int]           # host: each row's example
    counts: list[int]             # host: the same as `count`
    offers: list[int]             # host: the draft tokens each row feeds
    lengths: list[int] | None     # host: each row's adaptive draft length; None: fixed
    probes: list[bool]            # host: the rows that probe (`fed_offers`)
    # (live,) each row's draft's first token, where some row probes a draft made on the device
    # (None elsewhere)
    probe_tokens: torch.Tensor | None = None
    # host: the same, where some row probes a draft made on the host (None elsewhere)
    probe_host: list[int] | None = None
    # (live,) `offers` on the device, where some row offers fewer than Q - 1 (None: none does)
    offered: torch.Tensor | None = None
    # (N,) the flat indices (row * Q + fed index) of the fed positions whose next token counts, a
    # row's last token and its offered draft tokens, where some row offers fewer than the widest;
    # None: every fed position counts
    counted: torch.Tensor | None = None


class CallTables(NamedTuple):
    """What a call of Q fed tokens indexes with, made once per weights (`bias_tables`)."""

    fed_offset: torch.Tensor     # (Q,) each fed token's index: its position is the row's count + it
    based_offsets: torch.Tensor  # (heads, Q, slots) fed index - slot, each head's base added: a
                                 # row's bias indices once its count is added
    no_end: torch.Tensor         # 0-dim Q: "no end token among them"
    one_count: torch.Tensor      # (1, heads, Q, bound - 1 + Q) the bias of every row at one count
                                 # c: its columns bound - 1 - c .. bound - 2 + Q, slots 0 .. c + Q - 1


def bias_tables(model, bound: int, k: int, device: torch.device) -> tuple[HeadTable, "CallTablesByWidth"]:
    """T5's bias of every distance a call can meet (each call only gathers from it, or slices it),
    and per number of fed tokens Q (1 .. k) the call's `CallTables`, made at the first call of that
    width; both made once per weights while decoding (`made_from_bias_weight`). Query positions
    reach bound + k - 2; a slot in a query's future (a negative distance, down to -(bound + k))
    reads a hidden entry, the dtype's lowest."""
    def make() -> tuple[HeadTable, CallTablesByWidth]:
        far = bound + k
        past = past_distance_bias_table(model, far)                     # (far + 1, heads): 0..far
        hidden_slots = past.new_full((far, past.size(1)), torch.finfo(past.dtype).min)
        table = HeadTable.of(torch.cat([hidden_slots, past]).T, origin=far)   # distance -far..far
        return table, CallTablesByWidth(table, bound, call_index_tables(k, far, device))
    return made_from_bias_weight(model, ("verify calls", bound, k, device), make)


class CallTablesByWidth(dict):
    """Q -> `CallTables`, each made when a call of Q fed tokens first needs it: a decode whose
    drafts rarely pass feeds one token per call, and pays for no wider call's tables."""

    def __init__(self, table: HeadTable, bound: int, index_tables: dict):
        super().__init__()
        self.table, self.bound, self.index_tables = table, bound, index_tables

    def __missing__(self, queries: int) -> CallTables:
        fed_offset, query_minus_slot, no_end = self.index_tables[queries]
        # fed index - (slot - c), for slot - c from -(bound - 1) (the first slot of a row at the
        # highest count) to Q - 1
        relative = fed_offset[:, None] - torch.arange(1 - self.bound, queries, device=fed_offset.device)
        tables = CallTables(fed_offset, self.table.base + query_minus_slot, no_end,
                            self.table.gather(self.table.base + relative)[None])
        self[queries] = tables
        return tables


def counted_positions(offers: list[int], device: torch.device) -> torch.Tensor | None:
    """The flat indices (row * Q + fed index, Q = max(offers) + 1) of a call's fed positions that
    count, given each row's offer (host ints): a row's last token and its offered draft tokens.
    None when every row offers the widest (every position counts), or none does (one column)."""
    queries = max(offers) + 1
    if queries == 1 or min(offers) == queries - 1:
        return None
    return send([row * queries + fed for row, offer in enumerate(offers) for fed in range(offer + 1)],
                device)


class VerifyLoop:
    """One decode of a batch by draft and verify (module docstring), in phases: `feed` (one decoder
    call), `accept` (on the device: what each row keeps), `settle` (the call's one host sync, and
    what the host decides from it), `go_on` (drop the finished rows, feed the rest their drafts)."""

    def __init__(self, drafter: DraftAndVerifyDecoder, model, input_ids, attention_mask):
        self.drafter, self.model, self.run = drafter, model, drafter.model_step()
        self.bound, self.width = drafter.max_new_tokens, drafter.draft_width
        k = self.width + 1                                           # tokens fed per call, at most
        batch_size, device = input_ids.size(0), input_ids.device
        self.encoder_states = encode(model, input_ids, attention_mask)       # (B, S, d_model), once
        self.cross_mask = cross_attention_mask(attention_mask, self.encoder_states.dtype)  # (B, 1, 1, S)
        self.state = drafter.begin_drafts(model, Source(input_ids, attention_mask, self.encoder_states,
                                                        self.cross_mask))
        self.table, self.per_queries = bias_tables(model, self.bound, k, device)
        self.most_slots = self.bound + k        # a live row's count < bound, and it writes k slots
        self.live = LiveRows(batch_size, device)
        self.positions = self.live.index                             # (live,): 0..live-1
        self.origin = self.live.index[:, None]                       # (live, 1): each row's example
        self.writes = SlotWrites(self.origin, None, width=1, most=self.most_slots)
        self.cache = row_slot_cache(len(model.decoder.block), self.writes)
        # Per example, by output index, read back once at the end. A live row has produced < bound
        # tokens and writes at most k more.
        self.produced = torch.full((batch_size, self.most_slots - 1), NOT_PRODUCED, dtype=torch.long,
                                   device=device)
        self.rows = Rows(fed=torch.full((batch_size, 1), drafter.special.start, dtype=torch.long,
                                        device=device), draft=None,
                         count=torch.zeros((batch_size, 1), dtype=torch.long, device=device),
                         examples=list(range(batch_size)), counts=[0] * batch_size,
                         offers=[0] * batch_size, probes=[False] * batch_size,
                         lengths=[self.width] * batch_size if drafter.draft_length == ADAPTIVE else None)
        self.final_counts, self.calls, self.batch_calls = [0] * batch_size, [0] * batch_size, 0
        self.counters = dict.fromkeys(LOOP_COUNTERS, 0)
        self.tally = FirstTokenTally(drafter.min_acceptance) if drafter.min_acceptance > 0 else None
        first = drafter.first_draft(self.state)
        if first is not None:
            self.feed_next(self.rows.fed, first)

    def feed(self) -> torch.Tensor:
        """One decoder call: every live row's fed tokens written at their positions, attending to the
        slots before them. Returns (live, Q, d_model) hidden states."""
        rows, writes = self.rows, self.writes
        queries = rows.fed.size(1)
        tables = self.per_queries[queries]
        highest = max(rows.counts)
        writes.width = highest + queries
        if min(rows.counts) == highest:   # every row at one count (always at batch size 1)
            writes.start = highest
            bias = tables.one_count[..., self.bound - 1 - highest: self.bound - 1 + queries]  # (1, heads, Q, W)
        else:
            writes.start = None
            writes.slots = rows.count + tables.fed_offset                         # (live, Q) positions
            based = rows.count.view(-1, 1, 1, 1) + tables.based_offsets[..., : writes.width]
            bias = self.table.gather(based)                                     # (live, heads, Q, W)
        self.batch_calls += 1
        return self.run(self.model, rows.fed, bias, self.encoder_states, self.cross_mask, self.cache)

    def accept(self, hidden: torch.Tensor) -> tuple[Verified, torch.Tensor | None, torch.Tensor | None]:
        """On the device: each row's accepted draft tokens (live,), its tokens written to
        `produced`, the fed index of its first end token among them (live,; Q where there is none),
        and its count moved on. Where no draft token was fed, both are None: the row's one token is
        its newest, which the host reads anyway."""
        rows, drafter = self.rows, self.drafter
        if rows.fed.size(1) == 1:   # no row feeds a draft token (as at a first call without one)
            greedy = output_logits(self.model, hidden).argmax(-1)    # (live, 1): the token after it
            self.keep_produced(greedy)
            rows.count = rows.count + 1
            verified = Verified(hidden[:, 0], greedy, rows.count, self.live.index, self.origin,
                                self.produced)
            return verified, None, None
        draft = rows.draft                                           # (live, Q - 1)
        tables = self.per_queries[rows.fed.size(1)]
        offsets, no_end = tables.fed_offset, tables.no_end
        greedy, top = self.top_tokens(hidden)                        # (live, Q): the token after each
        accepted = accepted_length(draft, greedy[:, :-1] if top is None else top[:, :-1], rows.offered)
        # exact: an accepted draft token is the argmax before it; relaxed: it may be another of
        # the top-k, and the row's tokens are its accepted draft, then the model's own
        tokens = greedy if drafter.top_k == 1 else torch.where(
            offsets < accepted[:, None], torch.cat([draft, greedy[:, -1:]], dim=1), greedy)
        self.keep_produced(tokens)
        first_end = torch.where(tokens == drafter.special.eos, offsets, no_end).amin(dim=1)  # (live,)
        accepted_column = accepted[:, None]                          # (live, 1)
        next_token = greedy.gather(1, accepted_column)               # (live, 1)
        rows.count = rows.count + accepted_column + 1                # right for every row that goes on
        verified = Verified(hidden[self.positions, accepted], next_token, rows.count, self.live.index,
                            self.origin, self.produced)
        return verified, accepted, first_end

    def keep_produced(self, tokens: torch.Tensor) -> None:
        """Write each fed index's token (live, Q) at its output index, the fed token's position; a
        row's count tells where its output ends, and the next call overwrites what lies past it."""
        start = self.writes.start
        if start is not None:   # every row at one count: one slice of columns
            self.produced[self.live.index, start: start + tokens.size(1)] = tokens
        else:
            self.produced[self.origin, self.writes.slots] = tokens

    def top_tokens(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's tokens after each fed position that counts: a row's last token and the draft
        tokens it offers (`Rows.counted`): its argmax (live, Q), and where top_k > 1 its top-k
        tokens, best first (live, Q, top_k; None at top_k 1). A position past a row's offer (filler,
        in a call as wide as the longest offer) gets no output head, the largest projection of a
        call, and reads NOT_PRODUCED."""
        counted, k = self.rows.counted, self.drafter.top_k
        states = hidden if counted is None else hidden.flatten(0, 1).index_select(0, counted)
        logits = output_logits(self.model, states)                   # (live, Q, V) or (N, V)
        greedy = logits.argmax(-1)
        top = None if k == 1 else logits.topk(min(k, logits.size(-1)), dim=-1).indices
        if counted is None:
            return greedy, top
        call = hidden.shape[:2]                                      # (live, Q)

        def spread(flat: torch.Tensor) -> torch.Tensor:   # (N, ...) -> (live, Q, ...)
            full = flat.new_full((call.numel(),) + flat.shape[1:], NOT_PRODUCED)
            return full.index_copy_(0, counted, flat).view(*call, *flat.shape[1:])
        return spread(greedy), None if top is None else spread(top)

    def settle(self, verified: Verified, accepted: torch.Tensor | None, first_end: torch.Tensor | None):
        """The call's one host sync, and what the host decides from it: the tokens each row keeps,
        which rows are done, the drafts counted, the adaptive lengths moved on. A drafter that needs
        nothing on the host drafts every row first, on the device, so that its work is queued before
        the sync. Returns the rows that are done, that early draft (or None) and the host values of
        a drafter that drafts after the sync (or None)."""
        rows, drafter = self.rows, self.drafter
        needs = drafter.host_values(self.state, verified)
        early = None if needs is not None else drafter.draft(self.model, self.state, verified, None)
        drafted = accepted is not None                              # draft tokens were fed
        read = [verified.next_token.view(-1), *([accepted, first_end] if drafted else []),
                *([rows.probe_tokens] if rows.probe_tokens is not None else []), *(needs or {}).values()]
        next_host, *rest = self.live.read_each(read)
        if drafted:
            accepted_host, first_end_host = rest.pop(0), rest.pop(0)
        else:   # the one token a row produced is its newest: its first end where it is the end token
            eos = drafter.special.eos
            accepted_host, first_end_host = [0] * len(next_host), [int(token != eos) for token in next_host]
        probe_host = rest.pop(0) if rows.probe_tokens is not None else rows.probe_host
        if probe_host is not None:
            probes = [token == next_token if probing else None
                      for token, next_token, probing in zip(probe_host, next_host, rows.probes)]
        else:
            probes = [None] * len(next_host)
        if drafted:
            self.count_drafts(accepted_host, next_host, rows.offers)
        if self.tally is not None:
            self.tally.add(rows.offers, accepted_host, probes)
        if rows.lengths is not None:
            rows.lengths = next_draft_lengths(rows.lengths, rows.offers, accepted_host, probes, self.width)
        done = []
        for row, example in enumerate(rows.examples):
            kept, ended = kept_tokens(accepted_host[row], first_end_host[row], self.bound - rows.counts[row])
            rows.counts[row] += kept
            done.append(ended or rows.counts[row] >= self.bound)
            if done[-1]:
                self.final_counts[example], self.calls[example] = rows.counts[row], self.batch_calls
        host = None if needs is None else {"example": rows.examples, "next_token": next_host,
                                           "count": rows.counts, **dict(zip(needs, rest))}
        return done, early, host

    def count_drafts(self, accepted: list[int], next_tokens: list[int], offered: list[int]) -> None:
        """Add a call's drafts to `counters` (host values, one per row of the call)."""
        sep = self.drafter.special.sep
        self.counters["draft_tokens_offered"] += sum(offered)
        self.counters["draft_tokens_accepted"] += sum(accepted)
        self.counters["calls_with_draft"] += sum(offer > 0 for offer in offered)
        # the model's own token sits at the first rejected place of a draft not wholly accepted
        self.counters["drafts_cut_at_separator"] += sum(
            taken < offer and token == sep for taken, offer, token in zip(accepted, offered, next_tokens))

    def go_on(self, done: list[bool], verified: Verified, early: Draft | None,
              host: dict[str, list[int]] | None) -> bool:
        """Drop the rows that are done (from the batch, the cache and every row tensor) and feed the
        rest their model's token and next draft; False when no row is left."""
        rows = self.rows
        carried = {"count": rows.count, "next_token": verified.next_token,
                   "hidden": verified.hidden if early is None else None,   # for a late draft only
                   "draft": None if early is None else early.tokens}
        carried = {name: tensor for name, tensor in carried.items() if tensor is not None}
        kept_tensors = self.live.drop(done, self.cache, self.encoder_states, self.cross_mask,
                                      *carried.values())
        if kept_tensors is None:
            return False
        self.encoder_states, self.cross_mask, *values = kept_tensors
        kept, carried = self.live.kept, dict(zip(carried, values))
        rows.count = carried["count"]
        rows.examples, rows.counts = [rows.examples[r] for r in kept], [rows.counts[r] for r in kept]
        if rows.lengths is not None:
            rows.lengths = [rows.lengths[r] for r in kept]
        if len(kept) < len(done):
            self.positions = self.positions[: len(kept)]
            self.origin = self.live.index[:, None]
            self.writes.rows = self.positions[:, None]
        if early is not None:
            draft = Draft(carried.get("draft"),
                          None if early.offered is None else [early.offered[r] for r in kept])
        else:   # drafted after the sync, for the rows that go on only, with the host values they need
            verified = Verified(carried["hidden"], carried["next_token"], rows.count, self.live.index,
                                self.origin, self.produced)
            draft = self.drafter.draft(self.model, self.state, verified,
                                       {name: [column[r] for r in kept] for name, column in host.items()})
        self.feed_next(carried["next_token"], draft)
        return True

    def feed_next(self, next_token: torch.Tensor, draft: Draft) -> None:
        """What the next call feeds: each row's newest token (live, 1), then as many of its draft
        tokens as it feeds (`fed_offers`), no column past the longest; and what the host keeps of it
        (the offers, the probes)."""
        rows, live = self.rows, len(self.rows.counts)
        offers = draft.offered if draft.offered is not None else [self.width] * live
        feeding = self.tally is None or self.tally.reached(sum(offer > 0 for offer in offers), live)
        rows.offers, rows.probes = fed_offers(offers, rows.lengths, feeding)
        probing = any(rows.probes)
        rows.probe_tokens = draft.tokens[:, 0] if probing and draft.on_host is None else None
        rows.probe_host = ([tokens[0] if tokens else NOT_PRODUCED for tokens in draft.on_host]
                           if probing and draft.on_host is not None else None)
        # where rows offer different numbers of tokens, which positions count, and the offers on the
        # device for the acceptance
        rows.counted = counted_positions(rows.offers, next_token.device)
        rows.offered = None if rows.counted is None else send(rows.offers, next_token.device)
        widest = max(rows.offers)
        if widest == 0:
            rows.fed, rows.draft = next_token, None
            return
        if draft.on_host is not None:   # only the fed columns, past a row's offer filler
            filler = self.drafter.special.pad
            rows.draft = send([tokens[:widest] + [filler] * (widest - min(len(tokens), widest))
                               for tokens in draft.on_host], next_token.device)
        else:
            rows.draft = draft.tokens if draft.tokens.size(1) == widest else draft.tokens[:, :widest]
        rows.fed = torch.cat([next_token, rows.draft], dim=1)                    # (live, 1 + widest)

    def output(self):
        """The decode's `DecodeOutput`, from the one read-back of every example's tokens."""
        read, = read_back(self.produced)
        outputs = [row[:n] for row, n in zip(read, self.final_counts)]
        return flat_decode_output(
            outputs, self.drafter.special, self.calls, self.batch_calls,
            stats={"accepted_tokens": float(sum(self.final_counts)),
                   self.drafter.calls_stat: float(sum(self.calls)),
                   **{name: float(value) for name, value in self.counters.items()},
                   **{name: float(value)
                      for name, value in self.drafter.drafter_counters(self.state).items()}})
