"""Pipelined decoder: subsequences generated in parallel, each started `delay` steps after the last.

Reference: Huang et al., "Pipelined Decoder for Efficient Context-Aware Text Generation" (Section 3).

Layout. Subsequence i (0-based) is fed as [b, s_i] and labelled [s_i, e]; after the m real ones comes
one empty subsequence [b] -> [e] that teaches the model to stop starting new ones. Token j of
subsequence i (j = 0 is b) sits at 2-D position (i, j) and time t(i, j) = i*d + j, d = delay.
Attention. Query (i, j) sees key (i', j') iff i' <= i and t(i', j') <= t(i, j): a subsequence sees its
own past and what earlier subsequences had produced by then. Relative position for T5's bias is the
Manhattan distance |i - i'| + |j - j'|, bucketed as a past offset through the backbone's own table, so
pretrained T5 checkpoints work unchanged.
Loss. Cross-entropy on every label of every subsequence, the empty one included.
Decoding (Algorithm 1). At time t, subsequence t/d starts with b (every d steps) unless generation
was stopped or `max_subsequences` were started; every running subsequence gets one new token (argmax)
in ONE decoder call that feeds only the newest token of each; a subsequence ends at e (or at
`max_subsequence_length` tokens). When an example ends is the `stop_rule`:
- `first_empty` (the default; what the results were measured with): a subsequence whose first
  token is e is empty and stops new starts; the example is done when nothing runs and nothing can
  start.
- `all_end` (the paper's rule, Algorithm 1 lines 12-13 and Figure 2): a new subsequence is
  explored every d steps whatever came before; one whose first token is e has failed and is
  dropped, and exploring goes on. The example is done after the first step at which "all the
  subsequences generate the end token", i.e. nothing is left running after that step's tokens. In
  Figure 2 (d = 1, "A B C" and "D E") the exploration at the paper's step 3 fails while the two
  subsequences still run; at step 4 both of them and a new exploration emit e, which ends decoding.
  With d > 1 a step may start nothing: an example whose subsequences have all ended before the
  next start is then done too, so it can never write a subsequence after such a gap.
Failed explorations keep their slot (subsequence i starts at step i*d, whatever i's fate), and their
b stays in the context, as in the paper's sequence of subsequences. All examples are done at
`max_steps`. Output = the non-empty subsequences, in order.

Output bound. An example's output is at most `max_length` tokens counted as the flat layout counts
them (s_1 <sep> s_2 ... s_m </s>): each token of a non-empty subsequence, its end token included (it
stands for a separator or the final end), the empty terminator's end not. That is the bound of every
other decoder (sequential's `max_new_tokens`, NAR's `max_length`, all = data.max_target_length), so
outputs cut by it are alike across decoders. A call whose tokens would take an example past it keeps
them, in subsequence order, up to the bound, and ends the example (a bound hit). `max_steps` (decoder
calls per batch) is only a safety net: unset, it is the most steps the slots allow,
(max_subsequences - 1) * delay + max_subsequence_length, so it never cuts anything by itself.

Decoding is batched and cached: per call each example feeds its running subsequences' newest tokens,
padded to the batch's largest count (B, R); the key/value cache grows by R columns per call;
padding columns lie in no query's past (`Grid`), so no mask is kept for them. Finished examples
are dropped from the batch and the cache.

Code. `generate` is Algorithm 1 top to bottom: `_start` (lines 1-3), one `_step` per time step
(lines 4-13: `_starts_at` is the start schedule; `_columns` gathers the running subsequences, one
decoder call, `_append` writes their tokens back, `_drop_done` ends examples), `_output` (line 14).
Between steps the state is a `State`: per live example a `Live` (each slot's `SlotFields`,
may_start, output_length, the cache's key positions) and host-side counts; what the whole batch
shares is a `Batch`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from transformers import T5ForConditionalGeneration
from transformers.cache_utils import EncoderDecoderCache

from decoders import register
from datamodules.vocabulary import Choice, pad_batch, Range, SpecialTokens
from decoders.backbone import (encode, gather_self_attention_cache, new_cache, output_logits,
                               past_distance_bias_table, run_decoder)
from decoders.base import DecodeOutput, Decoder
from decoders.loop import LiveRows, NOT_PRODUCED, read_back

# slot statuses in decoding; RUNNING sorts first, so a stable argsort of the statuses lists an
# example's running slots first, in subsequence order
RUNNING, WAITING, DONE = 0, 1, 2
# the stopping rules (module docstring)
FIRST_EMPTY, ALL_END = "first_empty", "all_end"
# `produced` entries: never written, and a token that was emitted but cut by the output bound
CUT = -2


@dataclass
class Grid:
    """Positions of a batch's tokens on the (subsequence, offset) grid, flattened to (B, N).

    A position that holds no token (padding) has subsequence index `padding_index`, one past every
    real one: no query of a real subsequence sees it (it lies in no one's past), so no validity
    mask is needed. A padding query sees whatever; its output is never read."""

    subsequence: torch.Tensor  # (B, N) i, or padding_index
    offset: torch.Tensor       # (B, N) j

    @classmethod
    def of_layout(cls, layout: dict, padding_index: int) -> "Grid":
        return cls(layout["subsequence"].masked_fill(~layout["valid"], padding_index), layout["offset"])

    def packed(self) -> torch.Tensor:
        """(B, 2, N): both fields in one tensor, so that one cat appends and one gather moves
        them (`of_packed` names them again, as views)."""
        return torch.stack([self.subsequence, self.offset], 1)

    @classmethod
    def of_packed(cls, packed: torch.Tensor) -> "Grid":
        return cls(*packed.unbind(1))


def structure_table(distance_bias: torch.Tensor, delay: int, padding_index: int,
                    offsets: int) -> torch.Tensor:
    """The self-attention bias of every relative grid position, computed once per forward or
    `generate` so that each call only gathers from it (`attention_bias`).

    Returns (padding_index + 2, 2 * offsets + 1, heads): entry [di + 1, dj + offsets] is the bias of
    a key di subsequences before and dj tokens before its query (di = qi - ki in -1..padding_index
    (`Grid`), where -1 stands for every key of a later subsequence; dj = qj - kj in
    -offsets..offsets): T5's bias of the Manhattan distance di + |dj| (`distance_bias[d]`,
    `base.past_distance_bias_table`) where the key is visible (di >= 0 and its time ki*d + kj <=
    the query's, i.e. di*d + dj >= 0), and the dtype's lowest value where it is not.
    `distance_bias` must reach padding_index + offsets: a table too short for some distance fails
    here, rather than bias it as a nearer one."""
    di = torch.arange(-1, padding_index + 1, device=distance_bias.device)[:, None]   # (I, 1)
    dj = torch.arange(-offsets, offsets + 1, device=distance_bias.device)[None, :]   # (1, J)
    visible = (di >= 0) & (di * delay + dj >= 0)                                     # (I, J)
    bias = distance_bias[di.clamp(min=0) + dj.abs()]                                 # (I, J, heads)
    return bias.masked_fill(~visible[..., None], torch.finfo(bias.dtype).min)


def attention_bias(table: torch.Tensor, query: Grid, key: Grid) -> torch.Tensor:
    """Self-attention bias (B, heads, Q, K) = T5 relative bias of the Manhattan distance + visibility,
    gathered from `structure_table`'s `table` (whose offsets bound is (table.size(1) - 1) / 2)."""
    offsets = (table.size(1) - 1) // 2
    di = (query.subsequence[:, :, None] - key.subsequence[:, None, :]).clamp_(min=-1) + 1   # (B, Q, K)
    dj = query.offset[:, :, None] - key.offset[:, None, :] + offsets                       # (B, Q, K)
    return table[di, dj].permute(0, 3, 1, 2)


# ---- decoding state ----------------------------------------------------------------------------

class SlotFields(NamedTuple):
    """A slot's fields (subsequence i = slot i), each (B', n). They travel stacked in this order
    as one (B', 3, n) tensor, so that one gather reads and one scatter writes all three;
    `SlotFields(*packed.unbind(1))` names them again (views, no copy)."""

    token: torch.Tensor    # the token it feeds next: b, then the token it emitted last
    offset: torch.Tensor   # j of that token
    status: torch.Tensor   # RUNNING, WAITING or DONE


class Live(NamedTuple):
    """Per live example, one row each (B' rows, in input order): `LiveRows.drop_finished` drops a
    done example's row from every field at once. Packed fields are read through the properties."""

    slots: torch.Tensor           # (B', 3, max_subsequences) SlotFields, packed; written in place
    may_start: torch.Tensor       # (B',) bool: it may start more subsequences
    output_length: torch.Tensor   # (B',) its output's tokens as the flat layout counts them
    packed_keys: torch.Tensor     # (B', 2, N) grid positions of the cache's columns (`Grid.packed`)
    encoder_states: torch.Tensor  # (B', source_len, d_model)
    attention_mask: torch.Tensor  # (B', source_len)

    @property
    def slot_fields(self) -> SlotFields:
        return SlotFields(*self.slots.unbind(1))

    @property
    def keys(self) -> Grid:
        return Grid.of_packed(self.packed_keys)


class State(NamedTuple):
    """Decoding's state before a step; a step returns the next one (`_replace`)."""

    live: Live
    running: list[int]    # host: subsequences each live example runs at this step
    fed: list[int]        # host: columns each live example has in the cache
    originals: list[int]  # host: each live example's row in the batch


class Columns(NamedTuple):
    """A step's R columns per live example: its running slots, in subsequence order, then padding
    (other slots, whose stale fields no real query sees and which are written back unchanged)."""

    index: torch.Tensor   # (B', 3, R) each column's slot, expanded over the packed fields
    slot: SlotFields      # (B', R) each: that slot's fields
    valid: torch.Tensor   # (B', R) bool: a running slot
    query: Grid           # (B', R) its grid position; padding at subsequence `max_subsequences`


@dataclass
class Batch:
    """What one `generate` keeps beside its `State`: fixed for the batch, or written in place."""

    model: T5ForConditionalGeneration
    table: torch.Tensor          # `structure_table` of the slot and offset bounds
    cache: EncoderDecoderCache
    rows: LiveRows
    # per example (rows leave the batch; this stays), read back once at the end: each slot's
    # tokens, CUT where an emitted token did not fit the output bound. (B, slots + 1, length + 1)
    produced: torch.Tensor
    calls: list[int]             # host: decoder calls per example
    batch_calls: int = 0
    cells_by_counts: dict = field(default_factory=dict)   # running counts -> `running_cells`

    def running_cells(self, running: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(live, column) indices, (n,) each, of the running columns: the first running[b] of
        each row b. Built once per distinct counts, from the host."""
        key = tuple(running)
        if key not in self.cells_by_counts:
            device = self.produced.device
            self.cells_by_counts[key] = (
                torch.tensor([b for b, count in enumerate(running) for _ in range(count)], device=device),
                torch.tensor([c for count in running for c in range(count)], device=device))
        return self.cells_by_counts[key]


@register("pipelined")
class PipelinedDecoder(Decoder):
    decode_options = ("max_subsequences", "max_subsequence_length", "max_length", "max_steps",
                      "stop_rule")
    option_ranges = {"delay": Range(ge=1), "max_subsequences": Range(ge=1),
                     "max_subsequence_length": Range(ge=1), "max_length": Range(ge=1),
                     "max_steps": Range(ge=1, optional=True, note="null: as many as the slots allow"),
                     "stop_rule": Choice((FIRST_EMPTY, ALL_END))}
    def __init__(self, backbone_config, special: SpecialTokens, delay: int = 1,
                 max_subsequences: int = 16, max_subsequence_length: int = 32, max_length: int = 128,
                 max_steps: int | None = None, stop_rule: str = FIRST_EMPTY):
        super().__init__(backbone_config, special, delay=delay, max_subsequences=max_subsequences,
                         max_subsequence_length=max_subsequence_length, max_length=max_length,
                         max_steps=max_steps, stop_rule=stop_rule)
        self.delay = delay
        self.max_subsequences = max_subsequences
        self.max_subsequence_length = max_subsequence_length
        self.max_length = max_length
        # the last slot starts at `_last_start` and runs at most max_subsequence_length steps
        self.max_steps = (max_steps if max_steps is not None
                          else self._last_start() + max_subsequence_length)
        self.stop_rule = stop_rule

    # -- layout and loss -----------------------------------------------------------------------
    def layout(self, targets):
        """Per example: [b, s_i] -> [s_i, e] for each subsequence, then the empty [b] -> [e]."""
        b, e = self.special.start, self.special.eos
        rows = {"tokens": [], "labels": [], "subsequence": [], "offset": []}
        for subsequences in targets:
            tokens, labels, sub_index, offsets = [], [], [], []
            for i, sub in enumerate(list(subsequences) + [[]]):
                tokens += [b] + list(sub)
                labels += list(sub) + [e]
                sub_index += [i] * (len(sub) + 1)
                offsets += list(range(len(sub) + 1))
            for key, row in zip(rows, (tokens, labels, sub_index, offsets)):
                rows[key].append(row)
        tokens = pad_batch(rows["tokens"], self.special.pad)
        return {
            "tokens": tokens,                                          # (B, N)
            "labels": pad_batch(rows["labels"], -100),                 # (B, N)
            "subsequence": pad_batch(rows["subsequence"], 0),
            "offset": pad_batch(rows["offset"], 0),
            "valid": pad_batch([[1] * len(r) for r in rows["tokens"]], 0).bool(),
        }

    def calls_for_output(self, subsequences):
        """Subsequence i runs from step i*d for its tokens plus its end token, so it emits e at
        step i*d + len(s_i); a call is made at every step at which some subsequence runs.

        first_empty: the empty subsequence after the last one runs at its start step m*d alone.
        all_end: explorations from step m*d on fail at their start step, and decoding ends at the
        last real end token (the step at which nothing is left running); every step before it has
        a call. Subsequence i can only start if one before it still runs at step i*d - 1: if not,
        the output cannot be produced (None). The count is that of the output written with no
        failed exploration between its subsequences, the fewest calls that write it: where an
        exploration failed while an earlier subsequence still ran, the later ones start in later
        slots and decoding takes more calls than its output shows."""
        delay = self.delay
        if self.stop_rule == FIRST_EMPTY:
            spans = [len(sub) + 1 for sub in subsequences] + [1]
            return len({i * delay + j for i, span in enumerate(spans) for j in range(span)})
        ends = [i * delay + len(sub) for i, sub in enumerate(subsequences)]
        if any(max(ends[:i]) < i * delay for i in range(1, len(ends))):
            return None
        return max(ends, default=0) + 1   # no subsequence: the first exploration fails at step 0

    def teacher_forced_logits(self, model, input_ids, attention_mask, layout) -> torch.Tensor:
        """(B, N, vocab) logits of the whole layout in one uncached pass (training forward)."""
        # A visible pair can lie max(i) + max(j) apart: the terminator (m, 0) sees offset max(j)
        # of subsequence 0 (and padding positions lie one subsequence further)
        padding_index, offsets = int(layout["subsequence"].max()) + 1, int(layout["offset"].max())
        table = structure_table(past_distance_bias_table(model, padding_index + offsets), self.delay,
                                padding_index, offsets)
        grid = Grid.of_layout(layout, padding_index)
        bias = attention_bias(table, grid, grid)
        encoder_states = encode(model, input_ids, attention_mask)
        hidden = run_decoder(model, layout["tokens"], bias, encoder_states, attention_mask)
        return output_logits(model, hidden)

    def loss(self, model, input_ids, attention_mask, layout):
        logits = self.teacher_forced_logits(model, input_ids, attention_mask, layout)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), layout["labels"].flatten(),
                                                 ignore_index=-100)

    # -- decoding ------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, model, input_ids, attention_mask):
        """Algorithm 1, top to bottom: encode, one `_step` per time step until every example is
        done or `max_steps`, then the output.

        The cache stays lean: each call appends R columns per example (R = the batch's largest
        running count), padding where an example runs fewer. When the cache holds more columns
        than the fullest live example fed (its widest example changed or finished), every
        example's fed columns are packed to the front and the rest cropped: before every call,
        cache length = most tokens any live example fed. (Rare: usually the example running most
        subsequences stays the fullest.)

        Host syncs: one per decoder call (`LiveRows.drop_finished` reads back which examples
        finished together with each one's running count for the next call, which sets that call's
        width and which columns need vocabulary logits). All other bookkeeping is a few tensor ops
        per call on per-slot state, written back with one scatter; the tokens, and what the bound
        flags are derived from, are read back once, at the end. At batch size 1 on a CPU these ops,
        not the model, are what a call costs beyond sequential's, so there are as few as possible.
        """
        batch, state = self._start(model, input_ids, attention_mask)
        for step in range(self.max_steps):
            state = self._step(batch, state, step)
            if state is None:
                break
        # the examples still live after the last step were cut by max_steps
        return self._output(batch, set() if state is None else set(state.originals))

    def _starts_at(self, step: int) -> bool:
        """Whether subsequence step/d starts at `step` (in the examples that may start one):
        subsequence i starts at step i*d, while slots remain."""
        return step % self.delay == 0 and step <= self._last_start()

    def _last_start(self) -> int:
        """The step at which the last slot's subsequence starts."""
        return (self.max_subsequences - 1) * self.delay

    def _start(self, model, input_ids, attention_mask) -> tuple[Batch, State]:
        """Lines 1-3: encode the input once; every slot waits, nothing is fed yet."""
        device, batch_size = input_ids.device, input_ids.size(0)
        slots, length = self.max_subsequences, self.max_subsequence_length
        # padding columns have subsequence index `slots` (Grid); offsets reach `length` (a slot
        # that ran its full length, gathered as a padding column)
        table = structure_table(past_distance_bias_table(model, slots + length), self.delay, slots, length)
        encoder_states = encode(model, input_ids, attention_mask)
        cache, rows = new_cache(), LiveRows(batch_size, device)

        def full(shape, value, dtype=torch.long):
            return torch.full(shape, value, dtype=dtype, device=device)
        every_slot = (batch_size, slots)
        live = Live(slots=torch.stack(SlotFields(token=full(every_slot, self.special.start),
                                                 offset=full(every_slot, 0),
                                                 status=full(every_slot, WAITING)), 1),
                    may_start=full((batch_size,), True, torch.bool),
                    output_length=full((batch_size,), 0),
                    packed_keys=full((batch_size, 2, 0), 0),
                    encoder_states=encoder_states, attention_mask=attention_mask)
        # padding columns write into a scratch slot (index `slots`) and a scratch offset (`length`)
        produced = full((batch_size, slots + 1, length + 1), NOT_PRODUCED)
        batch = Batch(model, table, cache, rows, produced, calls=[0] * batch_size)
        # slot 0 starts at step 0 in every example
        return batch, State(live, running=[1] * batch_size, fed=[0] * batch_size,
                            originals=list(range(batch_size)))

    def _step(self, batch: Batch, state: State, step: int) -> State | None:
        """Lines 4-13 at time step `step`, for every live example: start subsequence step/d where
        it may, give every running subsequence its next token in ONE decoder call, drop the
        examples that are done. Returns the next step's state, or None when none is left."""
        live = state.live
        if self._starts_at(step):                                                       # lines 5-7
            live.slot_fields.status[:, step // self.delay].masked_fill_(live.may_start, RUNNING)
        width = max(state.running)
        if width == 0:
            # with delay > 1 every live example may wait for its next start: no call; the live
            # examples (none is stopped: those finished) start one at the next start
            return state._replace(running=[int(self._starts_at(step + 1))] * len(state.running))
        # the running columns (the first running[b] of row b) get vocabulary logits: their indices
        # come from the host-side counts, not from a `nonzero` that would wait. Made here, before
        # this call's work is queued: on a GPU, a copy from the host waits for the queue.
        cells = batch.running_cells(state.running)
        columns = self._columns(live, width)
        keys = torch.cat([live.packed_keys, columns.query.packed()], 2)                 # (B', 2, N)
        bias = attention_bias(batch.table, columns.query, Grid.of_packed(keys))        # line 8
        hidden = run_decoder(batch.model, columns.slot.token, bias, live.encoder_states,
                             live.attention_mask, batch.cache)                         # (B', R, d)
        logits = output_logits(batch.model, hidden[cells])                             # (n, vocab)
        emitted = columns.slot.token.index_put(cells, logits.argmax(-1))  # (B', R); padding: stale
        batch.batch_calls += 1
        for b, count in enumerate(state.running):
            batch.calls[state.originals[b]] += int(count > 0)
        live = self._append(batch, live._replace(packed_keys=keys), columns, emitted)  # lines 9-11
        return self._drop_done(batch, state._replace(live=live), step)                # lines 12-13

    def _columns(self, live: Live, width: int) -> Columns:
        """This step's `width` columns per live example: its running slots in subsequence order
        (RUNNING sorts first and the sort is stable), then others as padding."""
        order = torch.argsort(live.slot_fields.status, dim=1, stable=True)[:, :width]  # (B', R)
        index = order[:, None].expand(-1, len(SlotFields._fields), -1)                  # (B', 3, R)
        slot = SlotFields(*live.slots.gather(2, index).unbind(1))                       # (B', R) each
        valid = slot.status == RUNNING
        # a padding column feeds its slot's stale token: no real query sees it (Grid)
        return Columns(index, slot, valid, Grid(order.masked_fill(~valid, self.max_subsequences),
                                                slot.offset))

    def _append(self, batch: Batch, live: Live, columns: Columns, emitted: torch.Tensor) -> Live:
        """Lines 9-11: append each running subsequence's token, as far as the example's output
        bound allows, in subsequence order (the columns'); update the slots and may_start."""
        slot, valid = columns.slot, columns.valid
        ended = (emitted == self.special.eos) & valid
        empty = ended & (slot.offset == 0)
        counted = valid & ~empty                 # the empty terminator's end is no output
        fits = (live.output_length[:, None] + counted.cumsum(1) <= self.max_length) & valid
        over = (valid & ~fits).any(1)            # (B',) the output was cut here
        output_length = live.output_length + (fits & ~empty).sum(1)
        finished = ended | (slot.offset + 1 >= self.max_subsequence_length) | over[:, None]
        live.slots.scatter_(2, columns.index, torch.stack(SlotFields(
            emitted, slot.offset + valid, torch.where(finished & valid, DONE, slot.status)), 1))
        batch.produced[batch.rows.index[:, None], columns.query.subsequence, slot.offset] = \
            torch.where(fits, emitted, CUT)
        # a cut output starts nothing more (under all_end nothing of it runs: it is done);
        # under first_empty an empty subsequence stops new starts
        stops = (over | empty.any(1)) if self.stop_rule == FIRST_EMPTY else over
        return live._replace(may_start=live.may_start & ~stops, output_length=output_length)

    def _drop_done(self, batch: Batch, state: State, step: int) -> State | None:
        """Lines 12-13: drop the examples that are done (first_empty: nothing running and nothing
        left to start; all_end: nothing running, whatever could still start), reading back in the
        same transfer how many subsequences each kept example runs at the next step."""
        live = state.live
        still_running = live.slot_fields.status == RUNNING
        done = ~still_running.any(1)
        if self.stop_rule == FIRST_EMPTY and step < self._last_start():   # a start is still due
            done = done & ~live.may_start
        running_next = still_running.sum(1)
        if self._starts_at(step + 1):
            running_next = running_next + live.may_start
        kept = batch.rows.drop_finished(done, batch.cache, *live, also=running_next)
        if kept is None:
            return None
        fed = [state.fed[b] + state.running[b] for b in batch.rows.kept]
        state = State(Live(*kept), running=batch.rows.values, fed=fed,
                      originals=[state.originals[b] for b in batch.rows.kept])
        if state.live.packed_keys.size(2) > max(fed):
            state = state._replace(live=self._packed(batch, state.live, max(fed)))
        return state

    def _packed(self, batch: Batch, live: Live, most_fed: int) -> Live:
        """Pack each example's fed columns to the front of the cache and its keys (stable: their
        order is kept), and crop the padding every example has past its own."""
        padding = (live.keys.subsequence == self.max_subsequences).to(torch.int8)      # (B', N)
        order = torch.argsort(padding, dim=1, stable=True)[:, :most_fed]               # (B', N')
        gather_self_attention_cache(batch.cache, order)
        return live._replace(packed_keys=live.packed_keys.gather(2, order[:, None].expand(-1, 2, -1)))

    def _output(self, batch: Batch, cut_by_max_steps: set[int]) -> DecodeOutput:
        """Line 14: every example's non-empty subsequences, in order, and what it took. The bound
        flags come from the tokens: a slot cut at max_subsequence_length wrote a last token that
        is not e; an output cut by max_length holds a CUT."""
        slots, delay, eos = self.max_subsequences, self.delay, self.special.eos
        tokens = batch.produced[:, :slots, :self.max_subsequence_length]   # (B, slots, length)
        produced_length = (tokens >= 0).sum(-1)                             # (B, slots)
        last = tokens[:, :, -1]
        hit_bound = ((last >= 0) & (last != eos)).any(1) | (tokens == CUT).flatten(1).any(1)
        if self.stop_rule == FIRST_EMPTY:
            # An example that used all `max_subsequences` slots never emitted its empty terminator:
            # it was cut by that bound as surely as by `max_steps`.
            hit_bound = hit_bound | ~(tokens[:, :, 0] == eos).any(1)
        tokens, produced_length, hit_bound = read_back(tokens, produced_length, hit_bound)
        # Under all_end an example takes part in a call at every step until it is done, so one
        # with more calls than slots*d still ran at step slots*d, whose exploration found no slot.
        cut_by_slots = [self.stop_rule == ALL_END and n > slots * delay for n in batch.calls]
        return DecodeOutput(
            subsequences=[self._subsequences(rows, lengths)
                          for rows, lengths in zip(tokens, produced_length)],
            decoder_calls=batch.calls, tokens=[sum(lengths) for lengths in produced_length],
            hit_max_steps=[bool(hit_bound[b]) or b in cut_by_max_steps or cut_by_slots[b]
                           for b in range(len(batch.calls))],
            batch_decoder_calls=batch.batch_calls)

    def _subsequences(self, slots: list[list[int]], lengths: list[int]) -> list[list[int]]:
        """One example's non-empty subsequences, in slot order: empty slots (the terminator,
        failed explorations) and unstarted ones are left out."""
        out = []
        for tokens, length in zip(slots, lengths):
            tokens = tokens[:length]
            if tokens and tokens[-1] == self.special.eos:
                tokens = tokens[:-1]
            if tokens:
                out.append(tokens)
        return out
