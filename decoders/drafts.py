"""Draft and verify: guessed next tokens checked by the model's own greedy tokens in one decoder call.

The loop the blockwise (its proposal heads draft), lookup (spans of the source draft) and aggressive
(a non-autoregressive model drafts) decoders share: they differ only in where a draft comes from
(`DraftAndVerifyDecoder.draft`), and each is exactly greedy decoding of its verifying model.

One call. Row r has produced n_r tokens; its last one sits at position n_r (the start token at 0).
The call feeds [y, d_1, .., d_m] (y its last token, d its draft) at positions n_r .. n_r + m. The
model's argmax at fed position j is the greedy token after it, so the row accepts the longest prefix
of its draft on which the argmax agrees (`accepted_length`; only the first `offered` draft tokens
count), and then takes the model's own next token: a call yields 1 .. m + 1 tokens. The first call
feeds only the start token. `top_k` > 1 relaxes acceptance to "among the model's top-k tokens"
(Stern et al., Section 5: faster, no longer exact).

Ends and bounds (`kept_tokens`): a row keeps its tokens up to its first end token and up to
`max_new_tokens`. The one host sync of a call reads back each row's accepted count and first end,
with whatever the drafter needs on the host (`after_call`: aggressive's re-draft decision); the host
decides from them which rows are done and drops them (`LiveRows`), and only then are the rows that go
on drafted for the next call. A drafter that needs nothing on the host (lookup, blockwise) drafts
every live row before the sync instead, and the sync also reads how many tokens each draft offers:
the next call feeds only as many columns as the longest offer needs (one, the model's own token,
when no row offers anything), so a draft that offers nothing costs no wider call. A row that goes
on kept its whole accepted prefix plus one, so its new count is n_r + accepted + 1, computed on the
device.

Cache (`RowSlots`). Every row's self-attention keys and values sit at slot = position, in a buffer
that grows by doubling. A call writes its fed tokens at their own positions; a rejected draft token's
slot lies at or past the row's new count, where the next call writes its own fed tokens before
attending, and every slot past a query's position is in its future, which the causal bias hides. So
nothing is ever gathered, compacted or cropped: a call attends to slots 0 .. max_r(n_r) + m, and the
bias (T5's relative bias of query position - slot, gathered from one table) hides what a row must
not see.

Host syncs: one per call, plus the final read-back of the outputs (and of a drafter's counters), plus
what a drafter reads once per decode (aggressive's drafter: its encoder and its first draft's lengths).
"""
from __future__ import annotations

import abc
import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers.cache_utils import EncoderDecoderCache

from decoders.backbone import (cross_attention_mask, encode, HeadTable, output_logits,
                               past_distance_bias_table)
from datamodules.vocabulary import Choice
from decoders.base import Decoder, Option
from decoders.loop import NOT_PRODUCED, LiveRows, flat_decode_output, read_back
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
    """The adaptive schedule, per row (all (live,)): after a call whose draft the model accepted
    whole, a row may offer 2 tokens more (up to the drafter's width m); after one it cut short,
    1 fewer (down to 1); a row that offered nothing keeps its length.

    It is transformers' assisted-decoding heuristic, kept per row: in a batch, one row's rejected
    drafts must not shorten another's, and a call is as wide as its longest offer, so it narrows
    only when every row's drafts keep failing. The floor is 1, not 0: a row keeps probing with one
    token (one column more than a sequential call), so it can grow again where drafts start to
    pass, e.g. on the next span its output copies."""
    tried = offered > 0
    grown = torch.where(accepted >= offered, (lengths + 2).clamp(max=width), (lengths - 1).clamp(min=1))
    return torch.where(tried, grown, lengths)


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


def capped(lengths: torch.Tensor | None, drafts: torch.Tensor,
           offered: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A draft `DraftAndVerifyDecoder.draft` made, (live, m) tokens and their offer, with each
    row's offer cut to its adaptive length (`lengths`; None: the fixed length, nothing cut)."""
    if lengths is None:
        return drafts, offered
    return drafts, lengths if offered is None else torch.minimum(offered, lengths)


@dataclass
class Verified:
    """What a call settled, per row, for the drafter: every row of the call in `after_call`, the
    rows that go on in `draft`."""

    hidden: torch.Tensor      # (live, d_model) decoder state at the last accepted fed position
    next_token: torch.Tensor  # (live, 1) the model's own token after the accepted ones, fed first next
    count: torch.Tensor       # (live,) tokens produced, next_token included (its output index + 1)
    accepted: torch.Tensor    # (live,) draft tokens of this call accepted
    offered: torch.Tensor | None  # (live,) of them offered; None: all m, or no draft fed (the first call)
    origin: torch.Tensor      # (live, 1) each row's example
    produced: torch.Tensor    # (batch, columns) every example's tokens so far, by output index


class DraftAndVerifyDecoder(Decoder):
    """A decoder whose generation is draft and verify (module docstring); subclasses say where drafts
    come from. They set `max_new_tokens` and `top_k` (1 = exact) in their constructors."""

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

    def begin_drafts(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     encoder_states: torch.Tensor) -> Any:
        """Per-decode state of the drafter (None by default), passed to every `draft` call."""
        return None

    def after_call(self, state: Any, verified: Verified) -> torch.Tensor | None:
        """What the drafter does with a call's outcome, for every row of the call, before the call's
        host sync: count what it verified, and return (j, live) longs that the next `draft` needs on
        the host (its shapes, which rows to draft again), read back with that one sync; None (the
        default) when it needs none."""
        return None

    @abc.abstractmethod
    def draft(self, model, state: Any, verified: Verified,
              host: list[list[int]] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next call's drafts for the rows of `verified`: (live, m) tokens, and (live,) how many
        of them are offered (the rest are filler that is never accepted), or None when all m are.
        `host` holds those rows' columns of what `after_call` returned, as j lists; a drafter whose
        `after_call` returns None gets None, and is asked before the call's sync, for every row of
        the call (those that end then included)."""
        raise NotImplementedError

    def draft_counters(self, state: Any) -> dict[str, torch.Tensor]:
        """Device counters of the drafter (0-dim tensors), read back with the outputs into `stats`."""
        return {}

    @torch.no_grad()
    def generate(self, model, input_ids, attention_mask):
        m, end, bound = self.draft_width, self.special.eos, self.max_new_tokens
        k = m + 1                                                    # tokens fed per call
        batch_size, device = input_ids.size(0), input_ids.device
        encoder_states = encode(model, input_ids, attention_mask)   # (B, S, d_model), once
        cross_mask = cross_attention_mask(attention_mask, encoder_states.dtype)   # (B, 1, 1, S), once
        drafts_state = self.begin_drafts(model, input_ids, attention_mask, encoder_states)
        # T5's bias of every distance a call can meet, made once; each call only gathers from it.
        # Query positions reach bound + k - 2; a slot in a query's future (a negative distance, down
        # to -(bound + k)) reads a hidden entry, the dtype's lowest value.
        far = bound + k
        past = past_distance_bias_table(model, far)                 # (far + 1, heads): 0..far
        hidden_slots = past.new_full((far, past.size(1)), torch.finfo(past.dtype).min)
        table = HeadTable.of(torch.cat([hidden_slots, past]).T, origin=far)   # distance -far..far
        most_slots = bound + k                  # a live row's count < bound, and it writes k slots
        # the distances with each head's base added: a call adds its rows' counts and reads
        per_queries = {queries: (fed_offset, table.base + query_minus_slot, no_end)  # (heads, Q, slots)
                       for queries, (fed_offset, query_minus_slot, no_end)
                       in call_index_tables(k, most_slots, device).items()}
        rows = LiveRows(batch_size, device)
        row_index = rows.index                                       # (live,): 0..live-1
        origin = row_index[:, None]                                  # (live, 1): each live row's example
        writes = SlotWrites(origin, origin, width=1, capacity=min(most_slots, 16 + k))
        cache = row_slot_cache(len(model.decoder.block), writes)
        # Per example, by output index, read back once at the end. A live row has produced < bound
        # tokens and writes at most k more.
        produced = torch.full((batch_size, bound + k - 1), NOT_PRODUCED, dtype=torch.long, device=device)
        count = torch.zeros(batch_size, dtype=torch.long, device=device)            # (live,) device
        counts = [0] * batch_size                                                   # the same, host
        final_counts, calls = [0] * batch_size, [0] * batch_size    # host, per example
        originals = list(range(batch_size))                          # host: each live row's example
        fed = torch.full((batch_size, 1), self.special.start, dtype=torch.long, device=device)
        drafts = offered = None                                      # what fed holds after its first token
        # per row, the draft tokens it may offer (the adaptive schedule); None: always m
        lengths = torch.full_like(count, m) if self.draft_length == ADAPTIVE else None
        batch_calls = 0
        run = self.model_step()
        while True:
            queries = fed.size(1)
            offsets, based_offsets, no_end = per_queries[queries]
            writes.width = max(counts) + queries
            if writes.width > writes.capacity:
                writes.capacity = min(most_slots, 2 * writes.width)
            writes.slots = count.view(-1, 1) + offsets                               # (live, Q) positions
            based = count.view(-1, 1, 1, 1) + based_offsets[..., : writes.width]     # (live, heads, Q, W)
            bias = table.gather(based)                                              # (live, heads, Q, W)
            hidden = run(model, fed, bias, encoder_states, cross_mask, cache)  # (live, Q, d)
            batch_calls += 1

            logits = output_logits(model, hidden)                    # (live, Q, V)
            greedy = logits.argmax(-1)                               # (live, Q): the token after each
            if drafts is None or drafts.size(1) == 0:   # the first call, or nothing offered
                accepted = torch.zeros_like(count)
                tokens = greedy
            elif self.top_k == 1:
                accepted = accepted_length(drafts, greedy[:, :-1], offered)
                tokens = greedy  # an accepted draft token is the argmax before it
            else:
                candidates = logits[:, :-1].topk(min(self.top_k, logits.size(-1)), dim=-1).indices
                accepted = accepted_length(drafts, candidates, offered)
                tokens = torch.where(offsets < accepted[:, None],
                                     torch.cat([drafts, greedy[:, -1:]], dim=1), greedy)
            # every fed index's token goes to its output index; a row's count tells where its output
            # ends, and the next call overwrites what lies past it
            produced[origin, writes.slots] = tokens
            first_end = torch.where(tokens == end, offsets, no_end).amin(dim=1)     # (live,)
            next_token = greedy.gather(1, accepted[:, None])         # (live, 1)
            count = count + accepted + 1                             # right for every row that goes on
            if lengths is not None and drafts is not None:
                lengths = next_draft_lengths(lengths, offered if offered is not None
                                             else torch.full_like(lengths, m), accepted, m)
            last_hidden = hidden[row_index, accepted]                # (live, d_model)
            verified = Verified(last_hidden, next_token, count, accepted, offered, origin, produced)
            needs = self.after_call(drafts_state, verified)
            # A drafter that needs nothing from the host drafts every live row before the sync, which
            # then also reads how far the drafts reach: the next call feeds no column that no row
            # offers a token in (on keyphrases and answers, whose first token follows a separator the
            # source lacks, lookup often offers nothing, and a call then feeds one token per row).
            early = None if needs is not None else capped(lengths, *self.draft(
                model, drafts_state, verified, None))
            settled = [accepted, first_end]
            if needs is not None:
                settled += list(needs)
            elif early[1] is not None:
                settled.append(early[1])
            # the one host sync of the call, the drafter's needs (or its drafts' reach) included
            accepted_host, first_end_host, *more_host = rows.read(torch.stack(settled))
            done = []
            for b, example in enumerate(originals):
                kept, ended = kept_tokens(accepted_host[b], first_end_host[b], bound - counts[b])
                counts[b] += kept
                done.append(ended or counts[b] >= bound)
                if done[-1]:
                    final_counts[example], calls[example] = counts[b], batch_calls
            carried = [] if early is None else [early[0], *([] if early[1] is None else [early[1]])]
            kept_rows = rows.drop(done, cache, encoder_states, cross_mask, count, origin, next_token,
                                  last_hidden, accepted, *([] if lengths is None else [lengths]),
                                  *carried, *([] if offered is None else [offered]))
            if kept_rows is None:
                break
            encoder_states, cross_mask, count, origin, next_token, last_hidden, accepted, *rest = kept_rows
            if lengths is not None:
                lengths, *rest = rest
            originals = [originals[b] for b in rows.kept]
            counts = [counts[b] for b in rows.kept]
            if len(rows.kept) < len(done):
                row_index = row_index[: len(rows.kept)]
                writes.rows = row_index[:, None]
            if early is not None:
                drafts, *rest = rest
                if early[1] is None:   # every draft token offered
                    offered = None
                else:
                    offered, *rest = rest
                    drafts = drafts[:, : max(more_host[0][b] for b in rows.kept)]
            else:
                # drafted after the sync, for the rows that go on only, with the host values they need
                verified = Verified(last_hidden, next_token, count, accepted, rest[0] if rest else None,
                                    origin, produced)
                drafts, offered = capped(lengths, *self.draft(
                    model, drafts_state, verified, [[column[b] for b in rows.kept] for column in more_host]))
            fed = torch.cat([next_token, drafts], dim=1)             # (live, 1 .. k)

        counters = self.draft_counters(drafts_state)
        read, *counter_values = read_back(produced, *counters.values())   # the one read-back of results
        outputs = [row[:n] for row, n in zip(read, final_counts)]
        return flat_decode_output(
            outputs, self.special, calls, batch_calls,
            stats={"accepted_tokens": float(sum(final_counts)), self.calls_stat: float(sum(calls)),
                   **{name: float(value[0] if isinstance(value, list) else value)
                      for name, value in zip(counters, counter_values)}})
