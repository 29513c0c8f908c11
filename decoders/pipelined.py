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
Between steps the state is a `State`: per live example a `Live` (each slot's idle flag and next
token, may_start, the cache's key positions) and host-side counts (running subsequences, columns
fed, the room left under the output bound); what the whole batch shares is a `Batch`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
from transformers import T5ForConditionalGeneration
from transformers.cache_utils import EncoderDecoderCache

from decoders import register
from datamodules.vocabulary import Choice, pad_batch, Range, SpecialTokens
from decoders.backbone import (cross_attention_mask, encode, gather_self_attention_cache,
                               new_cache, output_logits, past_distance_bias_table, run_decoder)
from decoders.base import DecodeOutput, Decoder
from decoders.loop import LiveRows, NOT_PRODUCED, read_back

# the stopping rules (module docstring)
FIRST_EMPTY, ALL_END = "first_empty", "all_end"
# `produced` entries: never written, and a token that was emitted but cut by the output bound
CUT = -2


def grid_width(offsets: int) -> int:
    """Codes per subsequence of `Grid`: two offsets 0..offsets differ by at most `offsets` either
    way, so with 2 * offsets + 1 codes per subsequence the difference of two codes tells both the
    subsequence and the offset difference apart."""
    return 2 * offsets + 1


class Grid(NamedTuple):
    """Positions of a batch's tokens on the (subsequence, offset) grid, flattened to (B, N), as
    one code each: subsequence * width + offset. The difference of two codes names their relative
    position, so `attention_bias` reads a pair's bias with one gather.

    A position that holds no token (padding) has subsequence index `padding_index`, one past every
    real one, and offset 0: no query of a real subsequence sees it (it lies in no one's past), so
    no validity mask is needed. A padding query sees whatever; its output is never read."""

    code: torch.Tensor   # (B, N)
    width: int           # `grid_width` of the largest offset

    @classmethod
    def of_layout(cls, layout: dict, padding_index: int) -> "Grid":
        subsequence = layout["subsequence"].masked_fill(~layout["valid"], padding_index)
        width = grid_width(int(layout["offset"].max()))
        return cls(subsequence * width + layout["offset"], width)

    @property
    def subsequence(self) -> torch.Tensor:
        return self.code.div(self.width, rounding_mode="floor")

    @property
    def offset(self) -> torch.Tensor:
        return self.code.remainder(self.width)


class StructureTable(NamedTuple):
    """`structure_table`'s bias of every relative grid position, indexed by head and `Grid` code
    difference, so that `attention_bias` gathers a contiguous (B, heads, Q, K) tensor: T5's
    attention would otherwise copy it in every layer."""

    bias: torch.Tensor    # (heads, 2 * reach + 1)
    head: torch.Tensor    # (heads, 1, 1) every head's index


def structure_table(distance_bias: torch.Tensor, delay: int, padding_index: int,
                    offsets: int) -> StructureTable:
    """The self-attention bias of every relative grid position, computed once per forward or
    `generate` so that each call only gathers from it (`attention_bias`).

    Its `bias` is (heads, 2 * reach + 1), reach = padding_index * width + offsets (`grid_width`):
    entry [:, c] (for c < 0, as Python and torch index, [:, 2 * reach + 1 + c]) is the bias of a
    key whose `Grid` code is c less than its query's, i.e. di subsequences and dj tokens before it
    (c = di * width + dj, di in -padding_index..padding_index, dj in -offsets..offsets): T5's bias
    of the Manhattan distance di + |dj| (`distance_bias[d]`, `base.past_distance_bias_table`)
    where the key is visible (di >= 0 and its time ki*d + kj <= the query's, i.e.
    di*d + dj >= 0), and the dtype's lowest value where it is not.
    `distance_bias` must reach padding_index + offsets: a table too short for some distance fails
    here, rather than bias it as a nearer one."""
    width = grid_width(offsets)
    reach = padding_index * width + offsets
    difference = torch.arange(-reach, reach + 1, device=distance_bias.device)          # (T,)
    di = torch.div(difference + offsets, width, rounding_mode="floor")                  # (T,)
    dj = difference - di * width                                                       # (T,)
    visible = (di >= 0) & (di * delay + dj >= 0)                                       # (T,)
    bias = distance_bias[di.clamp(min=0) + dj.abs()]                                   # (T, heads)
    bias = bias.masked_fill(~visible[:, None], torch.finfo(bias.dtype).min)
    # rolled so that a negative difference indexes from the end: a call adds no offset to its index
    bias = bias.roll(-reach, 0).T.contiguous()                                         # (heads, T)
    return StructureTable(bias, torch.arange(bias.size(0), device=bias.device)[:, None, None])


def attention_bias(table: StructureTable, query: Grid, key: Grid) -> torch.Tensor:
    """Self-attention bias (B, heads, Q, K) = T5 relative bias of the Manhattan distance + visibility,
    gathered from `structure_table`'s `table` (made for the grids' width) by code difference."""
    difference = query.code[:, :, None] - key.code[:, None, :]                         # (B, Q, K)
    return table.bias[table.head, difference[:, None]]


# ---- decoding state ----------------------------------------------------------------------------

class Live(NamedTuple):
    """Per live example, one row each (B' rows, in input order): `LiveRows.drop` drops a done
    example's row from every field at once. Slot i holds subsequence i."""

    idle: torch.Tensor            # (B', slots) bool: runs nothing (not started, or ended); in place
    token: torch.Tensor           # (B', slots) the token it feeds next: b, then its last; in place
    may_start: torch.Tensor       # (B',) bool: it may start more subsequences; written in place
    keys: torch.Tensor            # (B', N) `Grid` codes of the cache's columns
    encoder_states: torch.Tensor  # (B', source_len, d_model)
    cross_mask: torch.Tensor      # (B', 1, 1, source_len) `cross_attention_mask`
    origin: torch.Tensor          # (B', 1) its row in the batch (`LiveRows.index`), for `produced`


class State(NamedTuple):
    """Decoding's state before a step; a step returns the next one. The host-side lists hold,
    per live example, what decides on the host when it is done (`_drop_done`)."""

    live: Live
    running: list[int]     # subsequences each live example runs at this step
    fed: list[int]         # columns each live example has in the cache
    originals: list[int]   # each live example's row in the batch
    may_start: list[bool]  # `Live.may_start`, mirrored
    room: list[int]        # tokens its output may still take: max_length - its length so far


class Columns(NamedTuple):
    """A step's R columns per live example: its running slots, in subsequence order, then padding
    (other slots, whose tokens no real query sees and which are written back unchanged)."""

    slot: torch.Tensor    # (B', R) each column's slot
    token: torch.Tensor   # (B', R) the token it feeds
    query: Grid           # (B', R) its grid position; padding at subsequence `max_subsequences`


@dataclass
class Batch:
    """What one `generate` keeps beside its `State`: fixed for the batch, or written in place."""

    model: T5ForConditionalGeneration
    run: Callable[..., torch.Tensor]   # what runs the decoder blocks (`Decoder.model_step`)
    table: StructureTable        # `structure_table` of the slot and offset bounds
    width: int                   # `grid_width` of the offset bound
    cache: EncoderDecoderCache
    rows: LiveRows
    # per example (rows leave the batch; this stays), read back once at the end: slot i's token j
    # at [i * width + j] (its `Grid` code); padding columns write to slot `max_subsequences`
    produced: torch.Tensor       # (B, (slots + 1) * width)
    calls: list[int]             # host: decoder calls per example
    batch_calls: int = 0
    # host: example -> (step, room before it) where its output went past max_length
    cut_at: dict = field(default_factory=dict)
    cells_by_counts: dict = field(default_factory=dict)   # running counts -> `running_cells`

    def running_cells(self, running: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(live, column) indices, (n,) each, of the running columns: the first running[b] of
        each row b. Built once per distinct counts, from the host, in one copy."""
        key = tuple(running)
        if key not in self.cells_by_counts:
            cells = [[b for b, count in enumerate(running) for _ in range(count)],
                     [c for count in running for c in range(count)]]
            self.cells_by_counts[key] = torch.tensor(cells, device=self.produced.device).unbind(0)
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

        Host syncs: one per decoder call (`LiveRows.read`: how many slots each example has left
        running, and on a start step whether its new subsequence was empty). From these the host
        keeps each example's counts and output bound, decides which examples are done and sets
        the next call's width and which columns need vocabulary logits. A running slot's offset
        is implied by the step (slot i started at step i*d and has run at every step since), so
        per call the device only sorts the slots, gathers one bias, and writes the tokens back
        with one scatter and one index write; the tokens are read back once, at the end, where
        the tokens past the output bound are marked. On a GPU every one of these ops is a kernel
        launch, and at batch size 1 on a CPU they, not the model, are what a call costs beyond
        sequential's, so there are as few as possible (`tasks.bench.op_counts`).
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
        # real offsets stay below `length`; padding columns have subsequence index `slots` (Grid)
        table = structure_table(past_distance_bias_table(model, slots + length), self.delay, slots,
                                length - 1)
        encoder_states = encode(model, input_ids, attention_mask)
        cache, rows = new_cache(), LiveRows(batch_size, device)

        def full(shape, value, dtype=torch.long):
            return torch.full(shape, value, dtype=dtype, device=device)
        live = Live(idle=full((batch_size, slots), True, torch.bool),
                    token=full((batch_size, slots), self.special.start),
                    may_start=full((batch_size,), True, torch.bool),
                    keys=full((batch_size, 0), 0),
                    encoder_states=encoder_states,
                    cross_mask=cross_attention_mask(attention_mask, encoder_states.dtype),
                    origin=rows.index[:, None])
        width = grid_width(length - 1)
        produced = full((batch_size, (slots + 1) * width), NOT_PRODUCED)
        batch = Batch(model, self.model_step(), table, width, cache, rows, produced,
                      calls=[0] * batch_size)
        # slot 0 starts at step 0 in every example
        return batch, State(live, running=[1] * batch_size, fed=[0] * batch_size,
                            originals=list(range(batch_size)), may_start=[True] * batch_size,
                            room=[self.max_length] * batch_size)

    def _step(self, batch: Batch, state: State, step: int) -> State | None:
        """Lines 4-13 at time step `step`, for every live example: start subsequence step/d where
        it may, give every running subsequence its next token in ONE decoder call, drop the
        examples that are done. Returns the next step's state, or None when none is left."""
        live = state.live
        if self._starts_at(step):                                                       # lines 5-7
            live.idle[:, step // self.delay].masked_fill_(live.may_start, False)
        width = max(state.running)
        if width == 0:
            # with delay > 1 every live example may wait for its next start: no call; the live
            # examples (none is stopped: those finished) start one at the next start
            return state._replace(running=[int(self._starts_at(step + 1))] * len(state.running))
        # the running columns (the first running[b] of row b) get vocabulary logits: their indices
        # come from the host-side counts, not from a `nonzero` that would wait. Made here, before
        # this call's work is queued: on a GPU, a copy from the host waits for the queue.
        cells = batch.running_cells(state.running)
        columns = self._columns(batch, live, width, step)
        keys = torch.cat([live.keys, columns.query.code], 1)                            # (B', N)
        bias = attention_bias(batch.table, columns.query, Grid(keys, batch.width))     # line 8
        hidden = batch.run(batch.model, columns.token, bias, live.encoder_states, live.cross_mask,
                           batch.cache)                                                # (B', R, d)
        logits = output_logits(batch.model, hidden[cells])                             # (n, vocab)
        emitted = columns.token.index_put(cells, logits.argmax(-1))  # (B', R); padding: unchanged
        batch.batch_calls += 1
        for b, count in enumerate(state.running):
            batch.calls[state.originals[b]] += int(count > 0)
        empty = self._append(batch, live, columns, emitted, step)                       # lines 9-11
        return self._drop_done(batch, state._replace(live=live._replace(keys=keys)), step, empty)

    def _columns(self, batch: Batch, live: Live, width: int, step: int) -> Columns:
        """This step's `width` columns per live example: its running slots in subsequence order
        (they are not idle, and the sort is stable), then others as padding. Running slot i is at
        offset step - i*d: it started at step i*d and has run at every step since."""
        idle, slot = torch.sort(live.idle, dim=1, stable=True)
        slot, padding = slot[:, :width], idle[:, :width]                              # (B', R)
        code = (slot * (batch.width - self.delay) + step).masked_fill_(           # i*width + offset
            padding, self.max_subsequences * batch.width)
        # a padding column feeds its slot's token: no real query sees it (Grid)
        return Columns(slot, live.token.gather(1, slot), Grid(code, batch.width))

    def _append(self, batch: Batch, live: Live, columns: Columns, emitted: torch.Tensor,
                step: int) -> torch.Tensor | None:
        """Lines 9-11: write each running subsequence's token back to its slot and to `produced`;
        a subsequence ends at e or at its length bound; under first_empty an empty subsequence
        stops new starts. Returns, on a start step, (B',) whether the new subsequence was empty
        (the output bound, which needs it, is kept on the host, `_drop_done`)."""
        eos = self.special.eos
        live.token.scatter_(1, columns.slot, emitted)
        batch.produced.index_put_((live.origin, columns.query.code), emitted)
        live.idle.logical_or_(live.token == eos)   # an idle slot's token is b or its own e already
        # the slot that wrote its last token, at offset max_subsequence_length - 1, if any
        started = step + 1 - self.max_subsequence_length
        slot, late = divmod(started, self.delay)
        if started >= 0 and late == 0 and slot < self.max_subsequences:
            live.idle[:, slot] = True
        if not self._starts_at(step):
            return None
        # a slot that did not start still holds b
        empty = live.token[:, step // self.delay] == eos
        if self.stop_rule == FIRST_EMPTY:
            live.may_start.masked_fill_(empty, False)
        return empty

    def _drop_done(self, batch: Batch, state: State, step: int,
                   empty: torch.Tensor | None) -> State | None:
        """Lines 12-13: read back how many slots each example left running (and whether its new
        subsequence was empty), and drop the examples that are done: those whose output went past
        max_length, and those with nothing running and (first_empty) nothing left to start
        (all_end: whatever could still start)."""
        live, slots = state.live, self.max_subsequences
        idle = live.idle.sum(1)
        read = batch.rows.read(idle if empty is None else torch.stack([idle, empty]))  # the sync
        idle, empty = (read, [0] * len(read)) if empty is None else read
        start_due = self.stop_rule == FIRST_EMPTY and step < self._last_start()
        done, running, may_start, room = [], [], [], []
        for b, original in enumerate(state.originals):
            still = slots - idle[b]
            # every running column's token counts towards the output but the empty terminator's e
            room.append(state.room[b] - (state.running[b] - empty[b]))
            may_start.append(state.may_start[b] and not (self.stop_rule == FIRST_EMPTY and empty[b]))
            if room[b] < 0:
                batch.cut_at[original] = (step, state.room[b])
            done.append(room[b] < 0 or (still == 0 and not (start_due and may_start[b])))
            running.append(still + int(may_start[b] and self._starts_at(step + 1)))
        kept = batch.rows.drop(done, batch.cache, *live)
        if kept is None:
            return None
        fed = [columns + count for columns, count in zip(state.fed, state.running)]
        state = State(Live(*kept), *([values[b] for b in batch.rows.kept] for values in (
            running, fed, state.originals, may_start, room)))
        if state.live.keys.size(1) > max(state.fed):
            state = state._replace(live=self._packed(batch, state.live, max(state.fed)))
        return state

    def _packed(self, batch: Batch, live: Live, most_fed: int) -> Live:
        """Pack each example's fed columns to the front of the cache and its keys (stable: their
        order is kept), and crop the padding every example has past its own."""
        padding = live.keys == self.max_subsequences * batch.width                   # (B', N)
        order = torch.sort(padding, dim=1, stable=True).indices[:, :most_fed]         # (B', N')
        gather_self_attention_cache(batch.cache, order)
        return live._replace(keys=live.keys.gather(1, order))

    def _output(self, batch: Batch, cut_by_max_steps: set[int]) -> DecodeOutput:
        """Line 14: every example's non-empty subsequences, in order, and what it took. The tokens
        read back, the ones past the output bound are marked CUT (`_mark_cut`); the bound flags
        come from the tokens: a slot cut at max_subsequence_length wrote a last token that is not
        e; an output cut by max_length holds a CUT."""
        slots, length = self.max_subsequences, self.max_subsequence_length
        delay, eos = self.delay, self.special.eos
        tokens, = read_back(batch.produced.view(-1, slots + 1, batch.width)[:, :slots, :length])
        for example, (step, room) in batch.cut_at.items():
            self._mark_cut(tokens[example], step, room)
        produced_length = [[sum(t >= 0 for t in row) for row in rows] for rows in tokens]
        hit_bound = [any(row[-1] >= 0 and row[-1] != eos for row in rows)
                     or any(CUT in row for row in rows) for rows in tokens]
        if self.stop_rule == FIRST_EMPTY:
            # An example that used all `max_subsequences` slots never emitted its empty terminator:
            # it was cut by that bound as surely as by `max_steps`.
            hit_bound = [cut or not any(row[0] == eos for row in rows)
                         for cut, rows in zip(hit_bound, tokens)]
        # Under all_end an example takes part in a call at every step until it is done, so one
        # with more calls than slots*d still ran at step slots*d, whose exploration found no slot.
        cut_by_slots = [self.stop_rule == ALL_END and n > slots * delay for n in batch.calls]
        return DecodeOutput(
            subsequences=[self._subsequences(rows, lengths)
                          for rows, lengths in zip(tokens, produced_length)],
            decoder_calls=batch.calls, tokens=[sum(lengths) for lengths in produced_length],
            hit_max_steps=[hit_bound[b] or b in cut_by_max_steps or cut_by_slots[b]
                           for b in range(len(batch.calls))],
            batch_decoder_calls=batch.batch_calls)

    def _mark_cut(self, slots: list[list[int]], step: int, room: int) -> None:
        """Mark CUT, in one example's tokens, those of its last call (`step`) past the `room` its
        output had left: that call's tokens are kept in subsequence order while they fit (the empty
        terminator's e takes no room, but is cut after a token that did not fit)."""
        used = 0
        for i, row in enumerate(slots):
            offset = step - i * self.delay
            if 0 <= offset < len(row) and row[offset] != NOT_PRODUCED:
                used += not (offset == 0 and row[offset] == self.special.eos)
                if used > room:
                    row[offset] = CUT

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
