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
feeds only the start token. `top_k` > 1 relaxes acceptance to "among the model's top-k tokens"
(Stern et al., Section 5: faster, no longer exact).

Ends and bounds (`kept_tokens`): a row keeps its tokens up to its first end token and up to
`max_new_tokens`. The one host sync of a call reads back each row's accepted count and first end,
with whatever the drafter needs on the host (`host_values`: aggressive's re-draft decision); the host
decides from them which rows are done and drops them (`LiveRows`), and only then are the rows that go
on drafted for the next call. A drafter that needs nothing on the host (lookup, blockwise) drafts
every live row before the sync instead, and the sync also reads how many tokens each draft offers:
the next call feeds only as many columns as the longest offer needs (one, the model's own token,
when no row offers anything), so a draft that offers nothing costs no wider call. A row that goes
on kept its whole accepted prefix plus one, so its new count is n_r + accepted + 1, computed on the
device. The same sync reads what the loop counts of every drafter's drafts (`LOOP_COUNTERS`: offered,
accepted, cut at a separator), which the host adds up.

Draft length (`draft_length`): `fixed` offers the drafter's whole width m on every call; `adaptive`
gives each row its own length (`next_draft_lengths`): as many tokens as its last draft got accepted,
m after one accepted whole, so that a row whose drafts fail falls back to one-token calls while
another row's drafts pass; and a call feeds no wider a draft than half its rows offer
(`call_width`), so that one row's long draft does not widen the call for all.

Cache (`RowSlotLayer`). Every row's self-attention keys and values sit at slot = position, in a buffer
that grows by doubling. A call writes its fed tokens at their own positions; a rejected draft token's
slot lies at or past the row's new count, where the next call writes its own fed tokens before
attending, and every slot past a query's position is in its future, which the causal bias hides. So
nothing is ever gathered, compacted or cropped: a call attends to slots 0 .. max_r(n_r) + m, and the
bias (T5's relative bias of query position - slot, gathered from one table) hides what a row must
not see. While every row is at one count (always at batch size 1, and at any batch size until
drafts are accepted) the call writes one slice of slots and every row reads one bias, a slice of
a table made once per decode: no per-row index, as in sequential decoding.

Host syncs: one per call, plus the final read-back of the outputs, plus what a drafter reads once
per decode (aggressive's drafter: its encoder and its first draft's lengths).
"""
from __future__ import annotations

import abc
import functools
from dataclasses import dataclass
from typing import ClassVar, Generic, NamedTuple, TypeVar

import torch
from transformers.cache_utils import EncoderDecoderCache

from decoders.backbone import (cross_attention_mask, encode, HeadTable, output_logits,
                               past_distance_bias_table)
from datamodules.vocabulary import Choice
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


def next_draft_lengths(lengths: torch.Tensor, offered: torch.Tensor, accepted: torch.Tensor,
                       width: int) -> torch.Tensor:
    """The adaptive schedule, per row (all (live,)): a row offers what its last draft achieved.
    After a call whose draft the model accepted whole, the drafter's whole width m; after one it cut
    short, as many tokens as it accepted (0 when none); a row that fed no draft keeps its length
    (its probe, `probed`, may move it).

    Why this and not transformers' assisted-decoding heuristic (2 more after a whole draft, 1 fewer
    after a cut one, floor 1): in a batch a call is as wide as its widest fed draft, so every token
    a row offers in vain widens the call for all rows, and outputs of a few words (answers, phrases)
    end before a length falling by 1 reaches the floor. Here a failed draft silences its row at
    once, and finding out whether drafts pass again is free: a row that feeds no draft still has its
    draft's first token compared with the model's next token (`Draft.probe`, `probed`), and a match
    counts as a one-token draft accepted whole, so the row offers m again, e.g. on the next span its
    output copies. Each row keeps its own length: one row's rejected drafts do not shorten
    another's."""
    tried = offered > 0
    return torch.where(tried, torch.where(accepted >= offered, width, accepted), lengths)


def probed(lengths: torch.Tensor, probe: torch.Tensor, next_tokens: torch.Tensor,
           width: int) -> torch.Tensor:
    """`lengths` (live,) moved by the probes (`Draft.probe`: the first token of a draft the call did
    not feed; NOT_PRODUCED where there is none): a probe that is the model's next token (live,) is
    a one-token draft accepted whole (the row offers m next), one that is not is a draft rejected at
    once (0)."""
    return torch.where(probe == next_tokens, width, torch.where(probe == NOT_PRODUCED, lengths, 0))


def call_width(offers: list[int]) -> int:
    """How many draft tokens an adaptive call feeds per row, given every row's offer (host ints):
    the longest offer that at least half the rows make. A call is as wide as this for every row, so
    a few rows' long offers would make the many rows that offer nothing compute filler columns;
    those rows' drafts are cut to this width (to no draft when most rows offer none), and the row
    whose draft is not fed probes it instead (`capped`, `probed`). At batch size 1 it is the row's
    own offer."""
    return sorted(offers, reverse=True)[(len(offers) - 1) // 2]


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
    (live, Q); every layer then attends to slots 0..width-1 of a buffer of `capacity` slots."""

    rows: torch.Tensor
    slots: torch.Tensor
    width: int
    capacity: int
    start: int | None = None   # where every row is at one count: the first slot all rows write


class RowSlotLayer(CacheLayer):
    """One decoder layer's self-attention keys and values, (B, heads, capacity, head_dim): row r's
    token at position p sits in slot p. Replaces the appending layer of transformers' own cache,
    through the same `update` the attention calls."""

    def __init__(self, writes: SlotWrites):
        super().__init__()
        self.writes = writes

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # zeros, not empty: an unwritten slot is hidden by the bias, but NaN garbage would survive it
        shape = (key_states.size(0), key_states.size(1), self.writes.capacity, key_states.size(-1))
        self.keys, self.values = key_states.new_zeros(shape), value_states.new_zeros(shape)
        self.device, self.is_initialized = key_states.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif self.keys.size(2) < self.writes.capacity:
            self.keys, self.values = (_grown(t, self.writes.capacity) for t in (self.keys, self.values))
        start = self.writes.start
        if start is not None:   # every row writes the same slots: a slice, no index
            self.keys[:, :, start: start + key_states.size(2)] = key_states
            self.values[:, :, start: start + key_states.size(2)] = value_states
        else:
            rows, slots = self.writes.rows, self.writes.slots
            self.keys[rows, :, slots] = key_states.transpose(1, 2)           # (live, Q, heads, head_dim)
            self.values[rows, :, slots] = value_states.transpose(1, 2)
        width = self.writes.width
        return self.keys[:, :, :width], self.values[:, :, :width]

    def get_seq_length(self) -> int:
        return self.keys.size(2) if self.is_initialized else 0


def _grown(buffer: torch.Tensor, capacity: int) -> torch.Tensor:
    grown = buffer.new_zeros(buffer.shape[:2] + (capacity,) + buffer.shape[3:])
    grown[:, :, : buffer.size(2)] = buffer
    return grown


def row_slot_cache(num_layers: int, writes: SlotWrites) -> EncoderDecoderCache:
    """A decoder cache whose self-attention part is `RowSlotLayer`s sharing `writes`."""
    return cache_with_self_attention_layers([RowSlotLayer(writes) for _ in range(num_layers)])


@functools.lru_cache(maxsize=16)
def call_index_tables(k: int, most_slots: int, device: torch.device):
    """Index tables of a decode, made once per shape (they hold no weights): for a call of Q fed
    tokens (1 at the first call, up to k after), each token's fed index (Q,), fed index - slot
    (Q, most_slots) (the distances, once a row's count is added) and Q itself (0-dim: "no end
    token among them")."""
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


@dataclass
class Draft:
    """A drafter's guesses for the next call of its rows."""

    tokens: torch.Tensor          # (live, m) draft tokens; those past a row's offer are filler
    offered: torch.Tensor | None  # (live,) how many of them the row offers; None: all m
    # (live,) under an adaptive length: the first draft token of a row whose length (0) kept it
    # from offering any, to be checked against the model's next token; NOT_PRODUCED elsewhere
    probe: torch.Tensor | None = None


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


def capped(lengths: torch.Tensor | None, draft: Draft) -> Draft:
    """`draft` with each row's offer cut to its adaptive length (`lengths`; None: the fixed length,
    nothing cut), and the probe of every row at length 0 whose drafter offered a token."""
    if lengths is None:
        return draft
    silenced = lengths == 0 if draft.offered is None else (lengths == 0) & (draft.offered > 0)
    return Draft(draft.tokens, lengths if draft.offered is None else torch.minimum(draft.offered, lengths),
                 torch.where(silenced, draft.tokens[:, 0], NOT_PRODUCED))


def narrowed(offers: list[int], draft: Draft, width: int) -> tuple[list[int], Draft]:
    """`draft` (and its rows' `offers`, host ints) cut to `width` draft tokens per row
    (`call_width`); at width 0 every row that offered a token probes its first one instead."""
    offered = draft.offered.clamp(max=width)
    probe = draft.probe if width else torch.where(draft.offered > 0, draft.tokens[:, 0], draft.probe)
    return [min(offer, width) for offer in offers], Draft(draft.tokens, offered, probe)


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

    def host_values(self, state: DraftState, verified: Verified) -> dict[str, torch.Tensor] | None:
        """What the next `draft` needs on the host, by name: (live,) longs for every row of the call,
        read back with the call's one host sync (aggressive: which rows to draft again, and their
        shapes). None (the default): the drafter needs nothing there, and drafts before the sync."""
        return None

    @abc.abstractmethod
    def draft(self, model, state: DraftState, verified: Verified,
              host: dict[str, list[int]] | None) -> Draft:
        """The next call's drafts for the rows of `verified`. `host` holds those rows' entries of
        what `host_values` named; a drafter that needs none gets None, and is asked before the call's
        sync, for every row of the call (those that end then included)."""
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
    draft: Draft | None           # what `fed` holds after its first token; None at the first call
    count: torch.Tensor           # (live, 1) tokens produced: the first fed token's position
    lengths: torch.Tensor | None  # (live,) each row's adaptive draft length; None: fixed
    examples: list[int]           # host: each row's example
    counts: list[int]             # host: the same as `count`
    # (N,) the flat indices (row * Q + fed index) of the fed positions whose next token counts, a
    # row's last token and its offered draft tokens, where the host knows the offers and some row
    # offers fewer than the widest; None: every fed position counts
    counted: torch.Tensor | None = None


class CallTables(NamedTuple):
    """What a call of Q fed tokens indexes with (`bias_tables`), made once per decode."""

    fed_offset: torch.Tensor     # (Q,) each fed token's index: its position is the row's count + it
    based_offsets: torch.Tensor  # (heads, Q, slots) fed index - slot, each head's base added: a
                                 # row's bias indices once its count is added
    no_end: torch.Tensor         # 0-dim Q: "no end token among them"
    one_count: torch.Tensor      # (1, heads, Q, bound - 1 + Q) the bias of every row at one count
                                 # c: its columns bound - 1 - c .. bound - 2 + Q, slots 0 .. c + Q - 1


def bias_tables(model, bound: int, k: int, device: torch.device) -> tuple[HeadTable, "CallTablesByWidth"]:
    """T5's bias of every distance a call can meet, made once per decode (each call only gathers
    from it, or slices it), and per number of fed tokens Q (1 .. k) the call's `CallTables`, made
    at the first call of that width. Query positions reach bound + k - 2; a slot in a query's
    future (a negative distance, down to -(bound + k)) reads a hidden entry, the dtype's lowest."""
    far = bound + k
    past = past_distance_bias_table(model, far)                     # (far + 1, heads): 0..far
    hidden_slots = past.new_full((far, past.size(1)), torch.finfo(past.dtype).min)
    table = HeadTable.of(torch.cat([hidden_slots, past]).T, origin=far)   # distance -far..far
    return table, CallTablesByWidth(table, bound, call_index_tables(k, far, device))


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
        self.state = drafter.begin_drafts(model, Source(input_ids, attention_mask, self.encoder_states))
        self.table, self.per_queries = bias_tables(model, self.bound, k, device)
        self.most_slots = self.bound + k        # a live row's count < bound, and it writes k slots
        self.live = LiveRows(batch_size, device)
        self.positions = self.live.index                             # (live,): 0..live-1
        self.origin = self.live.index[:, None]                       # (live, 1): each row's example
        self.writes = SlotWrites(self.origin, self.origin, width=1, capacity=min(self.most_slots, 16 + k))
        self.cache = row_slot_cache(len(model.decoder.block), self.writes)
        # Per example, by output index, read back once at the end. A live row has produced < bound
        # tokens and writes at most k more.
        self.produced = torch.full((batch_size, self.most_slots - 1), NOT_PRODUCED, dtype=torch.long,
                                   device=device)
        self.rows = Rows(fed=torch.full((batch_size, 1), drafter.special.start, dtype=torch.long,
                                        device=device),
                         draft=None, count=torch.zeros((batch_size, 1), dtype=torch.long, device=device),
                         lengths=torch.full((batch_size,), self.width, device=device)
                         if drafter.draft_length == ADAPTIVE else None,
                         examples=list(range(batch_size)), counts=[0] * batch_size)
        self.final_counts, self.calls, self.batch_calls = [0] * batch_size, [0] * batch_size, 0
        self.counters = dict.fromkeys(LOOP_COUNTERS, 0)

    def feed(self) -> torch.Tensor:
        """One decoder call: every live row's fed tokens written at their positions, attending to the
        slots before them. Returns (live, Q, d_model) hidden states."""
        rows, writes = self.rows, self.writes
        queries = rows.fed.size(1)
        tables = self.per_queries[queries]
        highest = max(rows.counts)
        writes.width = highest + queries
        if writes.width > writes.capacity:
            writes.capacity = min(self.most_slots, 2 * writes.width)
        writes.slots = rows.count + tables.fed_offset                             # (live, Q) positions
        if min(rows.counts) == highest:   # every row at one count (always at batch size 1)
            writes.start = highest
            bias = tables.one_count[..., self.bound - 1 - highest: self.bound - 1 + queries]  # (1, heads, Q, W)
        else:
            writes.start = None
            based = rows.count.view(-1, 1, 1, 1) + tables.based_offsets[..., : writes.width]
            bias = self.table.gather(based)                                     # (live, heads, Q, W)
        self.batch_calls += 1
        return self.run(self.model, rows.fed, bias, self.encoder_states, self.cross_mask, self.cache)

    def accept(self, hidden: torch.Tensor) -> tuple[Verified, torch.Tensor | None, torch.Tensor]:
        """On the device: each row's accepted draft tokens (live,; None when no draft token was
        fed), its tokens written to `produced`, the fed index of its first end token among them
        (live,; Q where there is none), and its count and adaptive length moved on."""
        rows, drafter = self.rows, self.drafter
        if rows.fed.size(1) == 1:   # the first call, or no row offered a draft token
            greedy = output_logits(self.model, hidden).argmax(-1)    # (live, 1): the token after it
            self.produced[self.origin, self.writes.slots] = greedy
            rows.count = rows.count + 1
            if rows.draft is not None and rows.draft.probe is not None:
                rows.lengths = probed(rows.lengths, rows.draft.probe, greedy.view(-1), self.width)
            verified = Verified(hidden[:, 0], greedy, rows.count, self.live.index, self.origin,
                                self.produced)
            return verified, None, greedy.view(-1) != drafter.special.eos   # first end: 0, or 1 = none
        draft = rows.draft
        tables = self.per_queries[rows.fed.size(1)]
        offsets, no_end = tables.fed_offset, tables.no_end
        greedy, top = self.top_tokens(hidden)                        # (live, Q): the token after each
        accepted = accepted_length(draft.tokens, greedy[:, :-1] if top is None else top[:, :-1],
                                   draft.offered)
        # exact: an accepted draft token is the argmax before it; relaxed: it may be another of
        # the top-k, and the row's tokens are its accepted draft, then the model's own
        tokens = greedy if drafter.top_k == 1 else torch.where(
            offsets < accepted[:, None], torch.cat([draft.tokens, greedy[:, -1:]], dim=1), greedy)
        # every fed index's token goes to its output index; a row's count tells where its output
        # ends, and the next call overwrites what lies past it
        self.produced[self.origin, self.writes.slots] = tokens
        first_end = torch.where(tokens == drafter.special.eos, offsets, no_end).amin(dim=1)  # (live,)
        accepted_column = accepted[:, None]                          # (live, 1)
        next_token = greedy.gather(1, accepted_column)               # (live, 1)
        rows.count = rows.count + accepted_column + 1                # right for every row that goes on
        if rows.lengths is not None:
            offered = draft.offered if draft.offered is not None else torch.full_like(accepted, self.width)
            rows.lengths = probed(next_draft_lengths(rows.lengths, offered, accepted, self.width),
                                  draft.probe, greedy[:, 0], self.width)
        verified = Verified(hidden[self.positions, accepted], next_token, rows.count, self.live.index,
                            self.origin, self.produced)
        return verified, accepted, first_end

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

    def settle(self, verified: Verified, accepted: torch.Tensor | None, first_end: torch.Tensor):
        """The call's one host sync, and what the host decides from it: the tokens each row keeps,
        which rows are done, the drafts counted. A drafter that needs nothing on the host drafts
        every row first, and the sync also reads how far those drafts reach (on keyphrases and
        answers, whose first token follows a separator the source lacks, lookup often offers
        nothing: the next call then feeds one token per row). Returns the rows that are done, the
        early draft (or None) and the host values of the drafter (or of the early draft's offers)."""
        rows, drafter = self.rows, self.drafter
        needs = drafter.host_values(self.state, verified)
        early = None if needs is not None else capped(rows.lengths, drafter.draft(
            self.model, self.state, verified, None))
        if early is not None and early.offered is not None:
            needs = {"offered": early.offered}
        drafted = accepted is not None                              # draft tokens were fed
        fed_offers = rows.draft.offered if drafted else None
        read = [first_end, *([accepted, verified.next_token.view(-1)] if drafted else []),
                *([] if fed_offers is None else [fed_offers]), *(needs or {}).values()]
        first_end_host, *rest = self.live.read(torch.stack(read))
        accepted_host = rest.pop(0) if drafted else [0] * len(first_end_host)
        if drafted:
            next_host = rest.pop(0)
            self.count_drafts(accepted_host, next_host, rest.pop(0) if fed_offers is not None
                              else [self.width] * len(accepted_host))
        done = []
        for row, example in enumerate(rows.examples):
            kept, ended = kept_tokens(accepted_host[row], first_end_host[row], self.bound - rows.counts[row])
            rows.counts[row] += kept
            done.append(ended or rows.counts[row] >= self.bound)
            if done[-1]:
                self.final_counts[example], self.calls[example] = rows.counts[row], self.batch_calls
        return done, early, dict(zip(needs or {}, rest))

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
              host: dict[str, list[int]]) -> bool:
        """Drop the rows that are done (from the batch, the cache and every row tensor) and feed the
        rest their model's token and next draft; False when no row is left."""
        rows = self.rows
        carried = {"count": rows.count, "lengths": rows.lengths, "next_token": verified.next_token,
                   "hidden": verified.hidden if early is None else None,   # for a late draft only
                   "draft": None if early is None else early.tokens,
                   "offered": None if early is None else early.offered,
                   "probe": None if early is None else early.probe}
        carried = {name: tensor for name, tensor in carried.items() if tensor is not None}
        kept_tensors = self.live.drop(done, self.cache, self.encoder_states, self.cross_mask,
                                      *carried.values())
        if kept_tensors is None:
            return False
        self.encoder_states, self.cross_mask, *values = kept_tensors
        kept, carried = self.live.kept, dict(zip(carried, values))
        rows.count, rows.lengths = carried["count"], carried.get("lengths")
        rows.examples, rows.counts = [rows.examples[r] for r in kept], [rows.counts[r] for r in kept]
        if len(kept) < len(done):
            self.positions = self.positions[: len(kept)]
            self.origin = self.live.index[:, None]
            self.writes.rows = self.positions[:, None]
        rows.counted = None
        if early is not None:
            draft = Draft(carried["draft"], carried.get("offered"), carried.get("probe"))
            if draft.offered is not None:    # no column past the longest offer
                offers = [host["offered"][r] for r in kept]
                fed_width = max(offers) if rows.lengths is None else call_width(offers)
                if fed_width < max(offers):
                    offers, draft = narrowed(offers, draft, fed_width)
                draft.tokens = draft.tokens[:, : max(offers)]
                rows.counted = counted_positions(offers, self.origin.device)
        else:   # drafted after the sync, for the rows that go on only, with the host values they need
            verified = Verified(carried["hidden"], carried["next_token"], rows.count, self.live.index,
                                self.origin, self.produced)
            draft = capped(rows.lengths, self.drafter.draft(
                self.model, self.state, verified, {name: [column[r] for r in kept]
                                                   for name, column in host.items()}))
        rows.draft = draft
        rows.fed = (torch.cat([carried["next_token"], draft.tokens], dim=1) if draft.tokens.size(1)
                    else carried["next_token"])                                    # (live, 1 .. k)
        return True

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
