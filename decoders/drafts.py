"""Draft and verify: guessed next tokens checked by the model's own greedy tokens in one decoder call.

One verify loop with drafters composed into it: blockwise (its proposal heads draft), lookup (spans
of the source) and aggressive (a non-autoregressive model). A drafter is one subclass of
`DraftAndVerifyDecoder`: it starts a decode (`begin_drafts`) and proposes drafts (`draft`), and
declares what it reads on the host (`host_reads`); each is exactly greedy decoding of its model.

A call feeds each live row's newest token and the draft tokens it offers, at their positions (the
start token at 0), accepts the longest prefix of the draft that the model's argmax agrees with, and
then the model's own token: 1 .. m + 1 tokens a call, one host sync a call. The loop's state is one
`LoopState`, a device part and a host part, moved from phase to phase: `call` (the model and the
acceptance, on the device), `settle` (the sync and what the host decides from it), `go_on` (the
finished rows dropped, the next drafts fed). Compiled (`decoder.compile`), its calls take a few
fixed shapes (`VerifyLoop.fixed_shape_call`). Host-side policy: `draft_policy`; bias tables:
`verify_tables`; the cache: `cache` (slot = position). Why it works this way: docs/decoders.md,
"Draft and verify".
"""
from __future__ import annotations

import abc
import dataclasses
import time
from typing import Any, Generic, NamedTuple, TypeVar

import torch

from decoders.backbone import (cross_attention_mask, fixed_shape_greedy_step, fixed_shape_start,
                               has_fixed_shape_greedy_step, output_logits, sizes)
from decoders.base import DecodeOutput, Decoder
from decoders.cache import DecoderCache, Slots, attended_width
from decoders.compiled_step import COMPILED_STEPS
from decoders.draft_policy import (ADAPTIVE, FIXED, FeedingRecord, Tally, counted_positions,
                                   fed_offers, kept_tokens, next_draft_lengths)
from decoders.loop import (NOT_PRODUCED, LiveRows, Stopwatch, fixed_shape_rows, flat_decode_output,
                           read_back, send, topped_up)
from decoders.sequential import greedy_outputs
from decoders.verify_tables import bias_tables


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


# ---- what a drafter and the loop hand each other -------------------------------------------------

class Source(NamedTuple):
    """What a drafter may draft from, given once per decode (`begin_drafts`)."""

    input_ids: torch.Tensor       # (B, S) the encoder inputs
    attention_mask: torch.Tensor  # (B, S) 1 on real source tokens
    encoder_states: torch.Tensor  # (B, S, d_model) the verifying model's encoder output
    cross_mask: torch.Tensor      # (B, 1, 1, S) its `cross_attention_mask`


class Draft(NamedTuple):
    """A drafter's guesses for the next call of its rows."""

    tokens: torch.Tensor | None   # (live, m) draft tokens, those past a row's offer filler (m + 1
                                  # where the drafter reads `disagreement`: then the last is the
                                  # token after the m it may offer); None where no row offers any,
                                  # or where they are `on_host`
    offered: list[int] | None     # host: how many of them each row offers; None: all m
    # host: each row's offered tokens, where the drafter made them there (lookup) and not `tokens`:
    # the loop sends only the columns a call feeds, and checks a probe on the host
    on_host: list[list[int]] | None = None

    @classmethod
    def nothing(cls, rows: int) -> "Draft":
        """No row offers a draft token."""
        return cls(None, [0] * rows)


class HostReads(NamedTuple):
    """What a drafter's next draft needs read back with a call's one host sync, beside each row's
    example, count and newest token, which the loop reads anyway."""

    earlier_tokens: int = 0      # the output tokens before the newest one (lookup: `match` - 1)
    disagreement: bool = False   # whether the newest token differs from the row's draft at its
                                 # index (aggressive, under the paper's rule)


class HostRows(NamedTuple):
    """The host values a drafter drafts from, per row that goes on (`HostReads`)."""

    examples: list[int]          # each row's example (its row in the batch)
    newest: list[int]            # the model's newest token, the last of its output
    counts: list[int]            # tokens produced, the newest included
    earlier: list[list[int]]     # the `earlier_tokens` before it, oldest first (NOT_PRODUCED
                                 # before the first); empty lists where none are read
    disagrees: list[bool]        # where read; else every row False


class Verified(NamedTuple):
    """What a call settled on the device, per row of the call (or per row that goes on, where a
    drafter drafts after the sync)."""

    hidden: torch.Tensor      # (live, d_model) decoder state at the last accepted fed position
    next_token: torch.Tensor  # (live, 1) the model's own token after the accepted ones, fed first next
    count: torch.Tensor       # (live, 1) tokens produced, next_token included (its output index + 1)
    example: torch.Tensor     # (live,) each row's example (its row in the batch)
    origin: torch.Tensor      # (live, 1) the same, as a column
    produced: torch.Tensor    # (batch, columns) every example's tokens so far, by output index


class Drafting(NamedTuple):
    """What a drafter starts a decode with (`begin_drafts`)."""

    state: Any                # its own state over the decode, passed to every `draft`
    first: Draft              # the first call's drafts (output indices 0 .. m - 1)
    # its own counters over the decode, a dataclass it updates as it drafts, reported in `stats`
    # beside the loop's (`DraftCounters`); a `Stopwatch` field reads as its seconds
    counters: Any = None


class DraftCounters(NamedTuple):
    """What the loop counts of every drafter's drafts, summed over a decode (`stats` keys)."""

    draft_tokens_offered: int = 0      # draft tokens offered (a row's filler past them excluded)
    draft_tokens_accepted: int = 0     # of those, accepted by the model (past an end token too)
    calls_with_draft: int = 0          # decoder calls of an example that offered a draft token
    drafts_cut_at_separator: int = 0   # drafts not wholly accepted where the model wrote the separator

    def added(self, offered: list[int], accepted: list[int], newest: list[int], sep: int) -> "DraftCounters":
        """With a call's rows (host values): the tokens each fed, accepted, and its newest token."""
        return DraftCounters(
            self.draft_tokens_offered + sum(offered), self.draft_tokens_accepted + sum(accepted),
            self.calls_with_draft + sum(offer > 0 for offer in offered),
            # the model's own token sits at the first rejected place of a draft not wholly accepted
            self.drafts_cut_at_separator + sum(taken < offer and token == sep
                                               for taken, offer, token in zip(accepted, offered, newest)))


def counter_values(counters) -> dict[str, float]:
    """A counters record's fields by name (a `Stopwatch` as its seconds)."""
    return {field.name: float(value.total() if isinstance(value, Stopwatch) else value)
            for field, value in ((f, getattr(counters, f.name)) for f in dataclasses.fields(counters))}


DraftState = TypeVar("DraftState")


class DraftAndVerifyDecoder(Decoder, Generic[DraftState]):
    """A decoder whose generation is draft and verify: a drafter, which says where drafts come
    from, around the one verify loop. A drafter is one subclass: `draft_width` and `draft`, and
    where it needs them `begin_drafts` and `host_reads`. Its options include `max_new_tokens`, and
    `top_k` (1 = exact) where it relaxes acceptance."""

    max_new_tokens: int
    top_k: int = 1
    draft_length: str = FIXED
    min_acceptance: float | None = 0.0   # a drafter without the option feeds every call
    # What `draft` reads on the host: None, it drafts on the device from the call's `Verified`
    # alone, before the call's sync, for every row of the call (blockwise); else it drafts after the
    # sync, for the rows that go on, from these and the loop's host values (`HostRows`).
    host_reads: HostReads | None = None

    @property
    @abc.abstractmethod
    def draft_width(self) -> int:
        """m: the draft tokens fed per call after the last accepted token (>= 1)."""
        raise NotImplementedError

    @classmethod
    def inexact(cls, options) -> bool:
        return int(options.get("top_k", 1)) > 1

    def begin_drafts(self, model, source: Source) -> Drafting:
        """The drafter's start of a decode: no state, no draft before the model's first token, no
        counters of its own (the default)."""
        return Drafting(None, Draft.nothing(source.input_ids.size(0)))

    @abc.abstractmethod
    def draft(self, model, state: DraftState, verified: Verified, host: HostRows | None) -> Draft:
        """The next call's drafts for the rows of `verified`: with `host_reads` None, every row of
        the call (`host` None); else the rows that go on, with their `host` values."""
        raise NotImplementedError

    def feeding_record(self, device: torch.device) -> FeedingRecord:
        """What this drafter's decodes on `device` (eager, or compiled) measured of feeding drafts:
        kept with it, so that each decode starts from what the earlier ones measured."""
        kept = self.__dict__.setdefault("feeding_records", {})
        return kept.setdefault((device.type, self.compiles()), FeedingRecord())

    @torch.no_grad()
    def generate(self, model, input_ids, attention_mask):
        encoder_states = self.encoder_pass()(model, input_ids, attention_mask)   # (B, S, d_model)
        if self.min_acceptance is not None:
            return self.verify_generate(model, input_ids, attention_mask, encoder_states)
        # measured: the verify loop, or sequential decoding where it was measured faster
        # (`LoopChoice`, which says why it is timed after the encoder), as it is where the drafts
        # cost more than the tokens they gain
        record, rows = self.feeding_record(input_ids.device), input_ids.size(0)
        compiled, started = len(COMPILED_STEPS), time.perf_counter()
        verifies = self.verifies(record, rows)
        out = (self.verify_generate(model, input_ids, attention_mask, encoder_states) if verifies
               else self.sequential_generate(model, input_ids, attention_mask, encoder_states, record))
        if len(COMPILED_STEPS) == compiled:   # a decode that compiled a step times its compiling
            record.loops.add(rows, verifies, (time.perf_counter() - started) / sum(out.tokens))
        return out

    def verify_generate(self, model, input_ids, attention_mask, encoder_states) -> DecodeOutput:
        """The decode by the verify loop, from the encoder's output."""
        loop = VerifyLoop(self, model, input_ids.device)
        state = loop.start(input_ids, attention_mask, encoder_states)
        while state.host.examples:
            state = loop.settle(state, loop.call(state))
        return loop.output(state)

    def verifies(self, record: FeedingRecord, rows: int) -> bool:
        """Under the measured rule, whether a decode of `rows` rows runs the verify loop, not
        sequential decoding: as its record's `LoopChoice` chooses."""
        return record.loops.verifies(rows)

    def sequential_generate(self, model, input_ids, attention_mask, encoder_states,
                            record: FeedingRecord) -> DecodeOutput:
        """The decode by sequential decoding of the same model: the same tokens, no draft, in
        calls whose host work is less than the verify loop's; the drafts the verify loop would
        have probed tallied in `record` where the drafter can tell them from the output
        (`probe_output`)."""
        outputs, calls = greedy_outputs(self, model, encoder_states, attention_mask)
        self.probe_output(record, input_ids, attention_mask, outputs)
        return flat_decode_output(outputs, self.special, [len(tokens) for tokens in outputs], calls,
                                  stats={name: 0.0 for name in DraftCounters._fields})

    def probe_output(self, record: FeedingRecord, input_ids: torch.Tensor,
                     attention_mask: torch.Tensor, outputs: list[list[int]]) -> None:
        """Tally in `record` the drafts a verify loop that fed none would have probed, from a
        sequential decode's `outputs` (each row's tokens): where the drafts are a function of the
        source and the output so far (lookup). By default nothing: drafts drawn from the decoder's
        states (blockwise's heads) are tallied only by the verify loop's decodes, which
        `LoopChoice` revisits."""


# ---- the verify loop -----------------------------------------------------------------------------

class OnDevice(NamedTuple):
    """The device part of a verify loop's state: its live rows, in the order of the call."""

    fed: torch.Tensor             # (live, Q) each row's newest token, then the draft tokens it feeds
    live: LiveRows                # each row's example (`index`), and the one sync per call
    origin: torch.Tensor          # (live, 1) the same as a column, made once per change of rows
    rows: torch.Tensor            # (live,) 0 .. live - 1
    encoder_states: torch.Tensor  # (live, S, d_model); compiled: (P, S', d_model), below
    cross_mask: torch.Tensor      # (live, 1, 1, S); compiled: (P, 1, 1, S')
    cache: DecoderCache           # every row's keys and values at slot = position; compiled: P
                                  # rows, the live ones first, then copies of the first (a power
                                  # of two of rows, or the batch's), the source padded to S'
    produced: torch.Tensor        # (batch, columns) every example's tokens by output index


class OnHost(NamedTuple):
    """The host part: the live rows' facts the host decides from, and the decode's tallies."""

    examples: list[int]           # each live row's example
    counts: list[int]             # tokens each has produced: its first fed token's position
    draft: Draft                  # the drafts of the rows' next (after `settle`: last) call
    offers: list[int]             # the draft tokens each row feeds of it
    probes: list[bool]            # the rows that probe its first token instead (`fed_offers`)
    lengths: list[int] | None     # each row's adaptive draft length; None: fixed
    tally: Tally | None           # where `min_acceptance` is not 0
    counters: DraftCounters
    drafting: Drafting            # the drafter's state and counters
    batch_calls: int              # calls so far
    finished: dict[int, tuple[int, int]]   # example -> (tokens output, calls), once it ends
    ended: list[bool]             # after `settle`: which rows ended at the last call


class LoopState(NamedTuple):
    device: OnDevice
    host: OnHost


class Called(NamedTuple):
    """What one call produced on the device, before the host reads it."""

    verified: Verified
    accepted: torch.Tensor | None    # (live,) draft tokens accepted; None where none were fed
    first_end: torch.Tensor | None   # (live,) fed index of the first end token (Q: none); the same
    early: Draft | None              # the next drafts where the drafter drafts on the device
    started: float | None = 0.0      # when the call began, on the host clock; None: not timed


class CallRead(NamedTuple):
    """What a call's one host sync read, per row of the call."""

    newest: list[int]
    accepted: list[int]
    first_end: list[int]
    probes: list[bool | None]        # whether a probing row's draft was the model's token
    earlier: list[list[int]]
    disagrees: list[bool]


class VerifyLoop:
    """One decode of a batch by draft and verify: what stays fixed over it (the model, the drafter,
    the tables), and the phases that move its `LoopState`."""

    def __init__(self, drafter: DraftAndVerifyDecoder, model, device: torch.device):
        self.drafter, self.model, self.run = drafter, model, drafter.model_step()
        self.fixed_shapes = drafter.compiles()
        self.call_rows: dict[int, torch.Tensor] = {}   # P -> (P, 1) 0 .. P - 1, for fixed shapes
        self.steps: dict[tuple, Any] = {}               # shape -> its compiled step, for fixed shapes
        self.bound, self.width = drafter.max_new_tokens, drafter.draft_width
        self.reads = drafter.host_reads
        # where the loop decides from what feeding costs (`min_acceptance` null): what the
        # drafter's decodes measured, and the tally this decode starts from
        self.record = drafter.feeding_record(device) if drafter.min_acceptance is None else None
        self.prior = None if self.record is None else self.record.prior()
        self.most_slots = self.bound + self.width + 1   # a live row's count < bound, and it writes k slots
        self.table, self.per_queries = bias_tables(model, self.bound, self.width + 1, device)
        # a fed token's position is its slot: the count of the row's tokens before it
        self.positions = torch.arange(self.most_slots, device=device)[None]        # (1, most_slots)
        earlier = 0 if self.reads is None else self.reads.earlier_tokens
        # output indices of the tokens before a row's newest, from its count
        self.earlier_offsets = torch.arange(-earlier - 1, -1, device=device) if earlier else None

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              encoder_states: torch.Tensor) -> LoopState:
        """From the encoder's output (B, S, d_model): every row's first call feeds the start
        token, and the first drafts."""
        batch_size, device = input_ids.size(0), input_ids.device
        cross_mask = cross_attention_mask(attention_mask, encoder_states.dtype)  # (B, 1, 1, S)
        drafting = self.drafter.begin_drafts(
            self.model, Source(input_ids, attention_mask, encoder_states, cross_mask))
        if self.fixed_shapes:   # a cache made whole; the loop's own source padded to a few widths
            cache, encoder_states, cross_mask = fixed_shape_start(self.model, encoder_states,
                                                                  attention_mask, self.most_slots)
        else:
            cache = DecoderCache(sizes(self.model.config).layers, self.most_slots)
        live = LiveRows(batch_size, device)
        produced = torch.full((batch_size, self.most_slots - 1), NOT_PRODUCED, dtype=torch.long,
                              device=device)
        starts = torch.full((batch_size, 1), self.drafter.special.start, dtype=torch.long, device=device)
        lengths = [self.width] * batch_size if self.drafter.draft_length == ADAPTIVE else None
        threshold = self.drafter.min_acceptance
        tally = self.prior if self.prior is not None else Tally(threshold) if threshold else None
        host = OnHost(list(range(batch_size)), [0] * batch_size, drafting.first, [], [], lengths,
                      tally, DraftCounters(), drafting, 0, {}, [False] * batch_size)
        device_part = OnDevice(starts, live, live.index[:, None], live.index, encoder_states, cross_mask,
                               cache, produced)
        return self.fed_next(LoopState(device_part, host), starts, drafting.first)

    def call(self, state: LoopState) -> Called:
        """One decoder call, every live row's fed tokens at their positions, and on the device what
        each row keeps: its tokens written to `produced` at their output indices, its accepted
        draft tokens and its first end token among them."""
        device, host, started = state.device, state.host, time.perf_counter()
        if self.fixed_shapes:
            return self.fixed_shape_call(state, started)
        queries, tables = device.fed.size(1), self.per_queries[device.fed.size(1)]
        highest = max(host.counts)
        if min(host.counts) == highest:   # every row at one count (always at batch size 1)
            count = highest
            slots = Slots(start=highest)
            positions = self.positions[:, highest: highest + queries]                # (1, Q)
            bias = tables.one_count[..., self.bound - 1 - highest: self.bound - 1 + queries]  # (1, heads, Q, W)
        else:   # each row's tokens at their positions, count .. count + Q - 1
            count = send([[count] for count in host.counts], device.rows.device)      # (live, 1)
            slots = Slots(each=count + tables.fed_offset, rows=device.rows[:, None],
                          width=highest + queries)
            positions = slots.each                                                   # (live, Q)
            based = count.view(-1, 1, 1, 1) + tables.based_offsets[..., : slots.width]
            bias = self.table.gather(based)                                          # (live, heads, Q, W)
        hidden = self.run(self.model, device.fed, bias, device.encoder_states, device.cross_mask,
                          device.cache, slots, positions)                            # (live, Q, d_model)
        if queries == 1:   # no row feeds a draft token
            tokens = output_logits(self.model, hidden).argmax(-1)                    # (live, 1)
            return self.called(state, hidden, tokens, count, slots)._replace(started=started)
        return self.checked(state, device.fed, hidden, count, slots)._replace(started=started)

    def fixed_shape_call(self, state: LoopState, started: float) -> Called:
        """`call` in a few fixed shapes, each compiled once (`backbone.fixed_shape_greedy_step`):
        every row at its own slots of a cache made whole before the first call (`most_slots`),
        attended in widths of `cache.ATTENDED_SLOTS_STEP`; 1 or k + 1 fed tokens, a row's tokens
        past its offer filler; the live rows topped up to the cache's P rows with copies of the
        first, whose tokens the call discards. The tokens and counts are `call`'s; a call that
        compiles its step is not `started` on the clock: its time is the compiling's, not what the
        call costs."""
        device, host = state.device, state.host
        live, rows = len(host.examples), device.encoder_states.size(0)
        fed = device.fed                                                             # (live, Q)
        queries = 1 if fed.size(1) == 1 else self.width + 1
        if fed.size(1) < queries:
            fed = torch.nn.functional.pad(fed, (0, queries - fed.size(1)), value=self.drafter.special.pad)
        every_row = topped_up(fed, rows)                                            # (P, Q)
        counts = host.counts + host.counts[:1] * (rows - live)
        count = send([[count] for count in counts], fed.device)                      # (P, 1)
        tables = self.per_queries[queries]
        if rows not in self.call_rows:
            self.call_rows[rows] = torch.arange(rows, device=fed.device)[:, None]
        slots = Slots(each=count + tables.fed_offset, rows=self.call_rows[rows],
                      width=attended_width(max(counts) + queries, self.most_slots))
        bias = self.table.gather(count.view(-1, 1, 1, 1) + tables.based_offsets[..., : slots.width])
        # one compiled step per shape: the rows, fed tokens, source's and attended slots' widths,
        # the cache's slots
        shape = (rows, queries, device.encoder_states.size(1), slots.width, self.most_slots)
        step = self.steps.get(shape)
        if step is None:   # looked up once per decode: the lookup costs a share of a call
            timed = started if has_fixed_shape_greedy_step(self.model, shape) else None
            step = self.steps[shape] = fixed_shape_greedy_step(self.model, shape)
        else:
            timed = started
        hidden, greedy = step(
            self.model, every_row, bias, device.encoder_states, device.cross_mask, device.cache,
            slots, slots.each)
        hidden, greedy, count = hidden[:live], greedy[:live], count[:live]           # the live rows'
        slots = slots._replace(each=slots.each[:live])
        if queries == 1:
            return self.called(state, hidden, greedy, count, slots)._replace(started=timed)
        return self.checked(state, fed, hidden, count, slots, greedy)._replace(started=timed)

    def checked(self, state: LoopState, fed: torch.Tensor, hidden: torch.Tensor,
                count: int | torch.Tensor, slots: Slots, greedy: torch.Tensor | None = None) -> Called:
        """A call that fed draft tokens `fed` (live, Q): the accepted prefix of each row's draft,
        then the model's own token; exact, or among its top-k (relaxed: the row's tokens are its
        accepted draft). `greedy`: the model's argmax tokens, where the call made them already."""
        host, drafter = state.host, self.drafter
        draft = fed[:, 1:]                                                           # (live, Q - 1)
        tables = self.per_queries[fed.size(1)]
        if greedy is None:
            counted = counted_positions(host.offers)
            counted = None if counted is None else send(counted, draft.device)
            greedy, top = self.top_tokens(hidden, counted)                           # (live, Q)
            offered = None if counted is None else send(host.offers, draft.device)
        else:
            top = None if drafter.top_k == 1 else self.top_tokens(hidden, None)[1]
            offered = None if min(host.offers) == draft.size(1) else send(host.offers, draft.device)
        accepted = accepted_length(draft, greedy[:, :-1] if top is None else top[:, :-1], offered)
        tokens = greedy if drafter.top_k == 1 else torch.where(
            tables.fed_offset < accepted[:, None], torch.cat([draft, greedy[:, -1:]], dim=1), greedy)
        first_end = torch.where(tokens == drafter.special.eos, tables.fed_offset, tables.no_end).amin(dim=1)
        return self.called(state, hidden, tokens, count, slots, accepted, first_end)

    def called(self, state: LoopState, hidden: torch.Tensor, tokens: torch.Tensor,
               count: int | torch.Tensor, slots: Slots, accepted: torch.Tensor | None = None,
               first_end: torch.Tensor | None = None) -> Called:
        """The call's tokens (live, Q) written to `produced`, at the fed tokens' positions (from
        `count`, each row's first: one int, or (live, 1)), and what the drafter learns of it; where
        the drafter drafts on the device, its next drafts."""
        device = state.device
        if slots.start is not None:   # every row at one count: one slice of columns
            device.produced[device.live.index, slots.start: slots.start + tokens.size(1)] = tokens
        else:
            device.produced[device.origin, slots.each] = tokens
        if accepted is None:   # each row's one token is its newest
            count = torch.full_like(tokens, count + 1) if slots.start is not None else count + 1
            verified = Verified(hidden[:, 0], tokens, count, device.live.index, device.origin,
                                device.produced)
        else:
            column = accepted[:, None]                                               # (live, 1)
            count = column + (count + 1) if slots.start is not None else count + column + 1
            verified = Verified(hidden[device.rows, accepted], tokens.gather(1, column), count,
                                device.live.index, device.origin, device.produced)
        early = None if self.reads is not None else self.drafter.draft(
            self.model, state.host.drafting.state, verified, None)
        return Called(verified, accepted, first_end, early)

    def top_tokens(self, hidden: torch.Tensor,
                   counted: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's tokens after each fed position that counts (`counted`: a row's last token and
        the draft tokens it offers; None: all): its argmax (live, Q), and where top_k > 1 its top-k
        tokens, best first (live, Q, top_k; else None). A position past a row's offer gets no output
        head, the largest projection of a call, and reads NOT_PRODUCED."""
        k = self.drafter.top_k
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

    def settle(self, state: LoopState, called: Called) -> LoopState:
        """After a call: its one host sync, the host's decisions, and the next call's rows."""
        read = self.read(state, called)
        if self.record is not None and called.started is not None:
            # the call and its sync, by its rows and fed tokens per row
            self.record.costs.add(*state.device.fed.shape, time.perf_counter() - called.started)
        return self.go_on(self.decide(state, called, read), called, read)

    def decide(self, state: LoopState, called: Called, read: CallRead) -> LoopState:
        """What the host decides from a call's read values: the tokens each row keeps, which rows
        ended, the drafts counted, the adaptive lengths moved on."""
        host, drafter = state.host, self.drafter
        tally = None if host.tally is None else host.tally.added(host.offers, read.accepted, read.probes)
        lengths = host.lengths if host.lengths is None else next_draft_lengths(
            host.lengths, host.offers, read.accepted, read.probes, self.width)
        counters = host.counters
        if called.accepted is not None:
            counters = counters.added(host.offers, read.accepted, read.newest, drafter.special.sep)
        counts, ended, finished = [], [], dict(host.finished)
        for row, example in enumerate(host.examples):
            kept, at_end = kept_tokens(read.accepted[row], read.first_end[row], self.bound - host.counts[row])
            counts.append(host.counts[row] + kept)
            ended.append(at_end or counts[-1] >= self.bound)
            if ended[-1]:
                finished[example] = counts[-1], host.batch_calls + 1
        return state._replace(host=host._replace(
            counts=counts, lengths=lengths, tally=tally, counters=counters, finished=finished,
            ended=ended, batch_calls=host.batch_calls + 1))

    def read(self, state: LoopState, called: Called) -> CallRead:
        """The one device -> host transfer of a call: each row's newest token; where draft tokens
        were fed, its accepted count and first end; the drafts' first tokens where rows probe
        drafts made on the device; what the drafter reads on the host."""
        host, verified, draft = state.host, called.verified, state.host.draft
        earlier = self.earlier_tokens(verified)                      # (live,) each, oldest first
        disagrees = self.disagreement(draft, verified, called.accepted)
        on_device = {"newest": verified.next_token.view(-1)}
        if called.accepted is not None:
            on_device.update(accepted=called.accepted, first_end=called.first_end)
        if any(host.probes) and draft.on_host is None:
            on_device["firsts"] = draft.tokens[:, 0]
        on_device.update({f"earlier {i}": tokens for i, tokens in enumerate(earlier)})
        if disagrees is not None:
            on_device["disagrees"] = disagrees
        values = dict(zip(on_device, state.device.live.read_each(list(on_device.values()))))
        newest = values["newest"]
        if "accepted" not in values:   # no draft token fed: a row's one token is its newest
            values.update(accepted=[0] * len(newest),
                          first_end=[int(token != self.drafter.special.eos) for token in newest])
        if any(host.probes) and draft.on_host is not None:
            values["firsts"] = [tokens[0] if tokens else NOT_PRODUCED for tokens in draft.on_host]
        probes = [first == token if probe else None for first, token, probe
                  in zip(values.get("firsts", newest), newest, host.probes)]
        return CallRead(newest, values["accepted"], values["first_end"], probes,
                        [[values[f"earlier {i}"][row] for i in range(len(earlier))] for row in range(len(newest))],
                        [bool(d) for d in values.get("disagrees", [False] * len(newest))])

    def earlier_tokens(self, verified: Verified) -> list[torch.Tensor]:
        """(live,) each: the output tokens before each row's newest one that the drafter reads,
        oldest first (NOT_PRODUCED before a row's first)."""
        if self.earlier_offsets is None:
            return []
        indices = verified.count + self.earlier_offsets                  # (live, earlier)
        earlier = torch.where(indices >= 0, verified.produced[verified.origin, indices.clamp(min=0)],
                              NOT_PRODUCED)
        return list(earlier.unbind(1))

    def disagreement(self, draft: Draft, verified: Verified,
                     accepted: torch.Tensor | None) -> torch.Tensor | None:
        """(live,) whether each row's newest token differs from its draft's token at the same
        output index (the draft's column `accepted`), where the drafter reads it; else None."""
        if self.reads is None or not self.reads.disagreement:
            return None
        column = (torch.zeros_like(verified.next_token) if accepted is None else accepted[:, None])
        return (draft.tokens.gather(1, column) != verified.next_token).view(-1)

    def go_on(self, state: LoopState, called: Called, read: CallRead) -> LoopState:
        """Drop the rows that ended (from the batch, the cache and every row tensor) and feed the
        rest their model's token and next draft; no row left: a state without examples."""
        device, host, verified, early = state.device, state.host, called.verified, called.early
        late = early is None   # drafted after the sync, for the rows that go on only
        carried = [verified.next_token, *([verified.hidden, verified.count] if late else
                                          [early.tokens] if early.tokens is not None else [])]
        call_rows = (device.encoder_states, device.cross_mask)
        if self.fixed_shapes:   # the cache's rows are laid out below, once the kept rows are known
            kept_tensors = device.live.drop(host.ended, None, *carried)
        else:
            kept_tensors = device.live.drop(host.ended, device.cache, *call_rows, *carried)
        if kept_tensors is None:
            return state._replace(host=host._replace(examples=[]))
        if not self.fixed_shapes:
            call_rows, kept_tensors = kept_tensors[:2], kept_tensors[2:]
        next_token, *rest = kept_tensors
        kept = device.live.kept
        if len(kept) < len(host.ended):
            device = device._replace(origin=device.live.index[:, None], rows=device.rows[: len(kept)])
            if self.fixed_shapes:
                call_rows = fixed_shape_rows(kept, device.cache, *call_rows)
        device = device._replace(encoder_states=call_rows[0], cross_mask=call_rows[1])
        host = host._replace(examples=[host.examples[r] for r in kept], counts=[host.counts[r] for r in kept],
                             lengths=None if host.lengths is None else [host.lengths[r] for r in kept])
        if not late:
            draft = Draft(rest[0] if rest else None,
                          None if early.offered is None else [early.offered[r] for r in kept])
        else:
            hidden, count = rest
            verified = Verified(hidden, next_token, count, device.live.index, device.origin,
                                device.produced)
            rows_read = HostRows(host.examples, [read.newest[r] for r in kept], host.counts,
                                 [read.earlier[r] for r in kept], [read.disagrees[r] for r in kept])
            draft = self.drafter.draft(self.model, host.drafting.state, verified, rows_read)
        return self.fed_next(LoopState(device, host), next_token, draft)

    def fed_next(self, state: LoopState, next_token: torch.Tensor, draft: Draft) -> LoopState:
        """What the next call feeds: each row's newest token (live, 1), then as many of its draft
        tokens as it feeds (`fed_offers`), no column past the longest; and what the host keeps of
        it (the draft, the offers, the probes)."""
        host, live = state.host, len(state.host.examples)
        offers = draft.offered if draft.offered is not None else [self.width] * live
        # measured: what feeding every offered token adds (the adaptive length feeds fewer)
        extra_cost = self.record.costs.extra(live, max(offers)) if self.record and max(offers) else 0.0
        feeding = host.tally is None or host.tally.reached(sum(offer > 0 for offer in offers), live,
                                                           extra_cost)
        fed_counts, probes = fed_offers(offers, host.lengths, feeding)
        widest = max(fed_counts)
        if widest == 0:
            fed = next_token
        elif draft.on_host is not None:   # only the fed columns, past a row's offer filler
            filler = self.drafter.special.pad
            columns = send([tokens[:widest] + [filler] * (widest - min(len(tokens), widest))
                            for tokens in draft.on_host], next_token.device)
            fed = torch.cat([next_token, columns], dim=1)                        # (live, 1 + widest)
        else:
            columns = draft.tokens if draft.tokens.size(1) == widest else draft.tokens[:, :widest]
            fed = torch.cat([next_token, columns], dim=1)
        return LoopState(state.device._replace(fed=fed),
                         host._replace(draft=draft, offers=fed_counts, probes=probes))

    def output(self, state: LoopState):
        """The decode's `DecodeOutput`, from the one read-back of every example's tokens."""
        host = state.host
        if self.record is not None:
            self.record.add(host.tally, self.prior)
        read, = read_back(state.device.produced)
        counts, calls = zip(*(host.finished[example] for example in range(len(read))))
        drafter_counters = host.drafting.counters
        stats = {**{name: float(value) for name, value in host.counters._asdict().items()},
                 **(counter_values(drafter_counters) if drafter_counters is not None else {})}
        return flat_decode_output([row[:n] for row, n in zip(read, counts)], self.drafter.special,
                                  list(calls), host.batch_calls, stats=stats)
