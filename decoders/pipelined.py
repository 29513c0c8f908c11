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
the step bound. Output = the non-empty subsequences, in order.

Output bound. An example's output is at most `max_new_tokens` tokens counted as the flat layout
counts them (s_1 <sep> s_2 ... s_m </s>): each token of a non-empty subsequence, its end token
included (it stands for a separator or the final end), the empty terminator's end not. That is the
bound of every other decoder (`decoders.base.OUTPUT_BOUND`), so outputs cut by it are alike across
decoders. A call whose tokens would take an example past it keeps
them, in subsequence order, up to the bound, and ends the example (a bound hit). `max_steps` (decoder
calls per batch) is only a safety net: unset, it is the most steps the slots allow,
(max_subsequences - 1) * delay + max_subsequence_length, so it never cuts anything by itself.

Decoding is batched and cached: per call each example feeds its running subsequences' newest tokens,
padded to the batch's largest count (B, R); the key/value cache grows by R columns per call;
padding columns lie in no query's past (`Grid`), so no mask is kept for them. Finished examples
are dropped from the batch and the cache. Compiled (`decoder.compile`), its calls take a few fixed
shapes (`_fixed_shape_call`), each call's model part and bias one compiled function
(`greedy_columns`).

Code. `generate` is Algorithm 1 top to bottom: `_start` (lines 1-3), then per time step
`_start_subsequences` (lines 5-7), `_call` (line 8: one decoder call, its tokens read back),
`_append` (lines 9-11: the tokens written to their slots) and `_drop_done` (lines 12-13), and
`_output` (line 14). The state is the host's: per example an `Example` (each slot's tokens, which
slots run, may_start, the room left under the output bound); on the device only what the model
needs, per live example a row of a `Batch` (the cache, the `Grid` codes of its columns, the
encoder states).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
from transformers import PreTrainedModel

from decoders import register
from datamodules.vocabulary import Choice, pad_batch, Range, SpecialTokens
from decoders.backbone import (cross_attention_mask, encode, fixed_shape_compiled, fixed_shape_start,
                               greedy_step_as_compiled, HeadTable, made_from_bias_weight,
                               output_logits, past_distance_bias_table, run_decoder, sizes)
from decoders.cache import DecoderCache, Slots, attended_width, power_of_two_holding
from decoders.base import OUTPUT_BOUND, DecodeOutput, Decoder, Option
from decoders.loop import LiveRows, fixed_shape_rows, send, topped_up

# the stopping rules (module docstring)
FIRST_EMPTY, ALL_END = "first_empty", "all_end"


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


def structure_table(distance_bias: torch.Tensor, delay: int, padding_index: int,
                    offsets: int) -> HeadTable:
    """The self-attention bias of every relative grid position, computed once per forward, and once
    per weights for `generate` (`made_from_bias_weight`), so that each call only gathers from it
    (`attention_bias`).

    Index c (c in -reach..reach, reach = padding_index * width + offsets, `grid_width`) holds the
    bias of a key whose `Grid` code is c less than its query's, i.e. di subsequences and dj tokens
    before it (c = di * width + dj, di in -padding_index..padding_index, dj in -offsets..offsets):
    T5's bias of the Manhattan distance di + |dj| (`distance_bias[d]`,
    `backbone.past_distance_bias_table`) where the key is visible (di >= 0 and its time
    ki*d + kj <= the query's, i.e. di*d + dj >= 0), and the dtype's lowest value where it is not.
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
    return HeadTable.of(bias.T, origin=reach)


def attention_bias(table: HeadTable, query: Grid, key: Grid) -> torch.Tensor:
    """Self-attention bias (B, heads, Q, K) = T5 relative bias of the Manhattan distance + visibility,
    gathered from `structure_table`'s `table` (made for the grids' width) by code difference."""
    batch = query.code.size(0)
    based = query.code.view(batch, 1, -1, 1) + table.base                              # (B, heads, Q, 1)
    return table.gather(based - key.code.view(batch, 1, 1, -1))


def greedy_columns(model: PreTrainedModel, token: torch.Tensor, query: torch.Tensor,
                   keys: torch.Tensor, written: torch.Tensor, table: HeadTable, width: int,
                   attended: int, encoder_states: torch.Tensor, cross_mask: torch.Tensor,
                   cache: DecoderCache) -> torch.Tensor:
    """One call of a fixed-shape pipelined decode, its bookkeeping included: the call's `Grid`
    codes `query` (B', R) written to `keys` (B', N) at the columns `written` (R,), the bias of its
    queries over the first `attended` columns, and the greedy step of `token` (B', R) at those
    columns of every row of `cache` (`greedy_step_as_compiled`). Returns the argmax after every
    column (B', R)."""
    rows = token.size(0)
    keys[:, written] = query
    query = Grid(query, width)
    bias = attention_bias(table, query, Grid(keys[:, :attended], width))
    appended = Slots(each=written.expand(rows, -1),
                     rows=torch.arange(rows, device=token.device)[:, None], width=attended)
    _, greedy = greedy_step_as_compiled(model, token, bias, encoder_states, cross_mask, cache,
                                        appended, query.offset)
    return greedy


# ---- decoding state ----------------------------------------------------------------------------

@dataclass
class Example:
    """One example's decoding, kept on the host: each call's tokens are read back (the call's one
    sync) and written here. Slot i holds subsequence i."""

    room: int                      # tokens its output may still take: max_new_tokens - its length so far
    slots: list[list[int]] = field(default_factory=list)   # each started slot's tokens (e included)
    running: list[int] = field(default_factory=list)       # the slots fed at this step, in order
    may_start: bool = True         # it may start more subsequences
    fed: int = 0                   # its real columns in the cache (a call's padding columns not)
    calls: int = 0                 # decoder calls it took part in with a running subsequence
    cut: bool = False              # a token did not fit max_new_tokens
    denied_start: bool = False     # a subsequence was due to start and no slot was left
    done: bool = False             # it left the batch before the step bound


@dataclass
class Batch:
    """What one `generate` keeps beside its examples: fixed for the batch, or, one row per live
    example (in `live`'s order), on the device; `LiveRows.drop` drops a done example's row."""

    model: PreTrainedModel
    run: Callable[..., torch.Tensor]   # what runs the decoder blocks (`Decoder.model_step`)
    table: HeadTable             # `structure_table` of the slot and offset bounds
    width: int                   # `grid_width` of the offset bound
    padding_code: int            # the `Grid` code of a padding column
    cache: DecoderCache
    rows: LiveRows
    keys: torch.Tensor           # (B', N) `Grid` codes of the cache's columns
    encoder_states: torch.Tensor  # (B', source_len, d_model)
    cross_mask: torch.Tensor     # (B', 1, 1, source_len) `cross_attention_mask`
    live: list[Example]          # the examples still decoding, one per row
    # compiled for fixed shapes: the cache's columns, made whole (N = this, the keys of those not
    # written yet the padding code; the rows B' are the live ones topped up, `fixed_shape_rows`);
    # None: eager, the cache grows by each call's columns
    most_columns: int | None = None
    written: int = 0             # the columns calls have written (all N where the cache grows)
    batch_calls: int = 0
    cells_by_counts: dict = field(default_factory=dict)   # running counts -> `running_cells`
    steps: dict = field(default_factory=dict)             # shape -> its compiled step, fixed shapes

    def running_cells(self, running: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(live, column) indices, (n,) each, of the running columns: the first running[b] of
        each row b. Built once per distinct counts, from the host, in one copy."""
        key = tuple(running)
        if key not in self.cells_by_counts:
            cells = [[b for b, count in enumerate(running) for _ in range(count)],
                     [c for count in running for c in range(count)]]
            self.cells_by_counts[key] = send(cells, self.keys.device).unbind(0)
        return self.cells_by_counts[key]


@register("pipelined")
class PipelinedDecoder(Decoder):
    # The defaults of max_subsequences and max_subsequence_length are the data limits' defaults
    # (configs/default.yaml), which the decoder group sets them to, as OUTPUT_BOUND's.
    options = {"delay": Option(1, Range(ge=1)),
               "max_subsequences": Option(16, Range(ge=1), decode_only=True),
               "max_subsequence_length": Option(32, Range(ge=1), decode_only=True),
               "max_new_tokens": OUTPUT_BOUND,
               "max_steps": Option(None, Range(ge=1, optional=True,
                                               note="null: as many as the slots allow"),
                                   decode_only=True),
               "stop_rule": Option(FIRST_EMPTY, Choice((FIRST_EMPTY, ALL_END)), decode_only=True)}

    def __init__(self, backbone_config, special: SpecialTokens, **options):
        super().__init__(backbone_config, special, **options)
        # decoder calls per batch; unset, the last slot's start (`_last_start`) plus the steps of
        # one subsequence, the most the slots allow
        self.step_bound = (self.max_steps if self.max_steps is not None
                           else self._last_start() + self.max_subsequence_length)

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
        hidden = run_decoder(model, layout["tokens"], bias, encoder_states, attention_mask,
                             positions=layout["offset"])
        return output_logits(model, hidden)

    def loss(self, model, input_ids, attention_mask, layout):
        logits = self.teacher_forced_logits(model, input_ids, attention_mask, layout)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), layout["labels"].flatten(),
                                                 ignore_index=-100)

    # -- decoding ------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, model, input_ids, attention_mask):
        """Algorithm 1, top to bottom: encode; at every time step start subsequence step/d, make
        ONE decoder call for every running subsequence, write its tokens, drop the examples that
        are done; until none is left or the step bound; then the output.

        The cache stays lean: each call appends R columns per example (R = the batch's largest
        running count), padding where an example runs fewer. When the cache holds more columns
        than the fullest live example fed (its widest example changed or finished), every
        example's fed columns are packed to the front and the rest cropped: before every call,
        cache length = most tokens any live example fed. (Rare: usually the example running most
        subsequences stays the fullest.) Compiled, the cache has a fixed number of columns, and
        is packed only when a call's columns might not fit in them (`_room_for_a_call`).

        Host syncs: one per decoder call, the read-back of its tokens (`LiveRows.read`). The
        decode's state is then the host's (`Example`): which slots run, their tokens, the output
        bound, which examples are done. From it the host builds the next call's tokens and grid
        positions and sends them in one copy that waits for nothing (`loop.send`). On the
        device a call is then only the keys' append, one bias gather, the model and the argmax: on
        a GPU every op is a kernel launch, and at batch size 1 on a CPU the ops around the model
        are what a call costs beyond sequential's, so there are as few as possible
        (`tasks.bench.op_counts`).
        """
        examples = [Example(room=self.max_new_tokens) for _ in range(input_ids.size(0))]
        batch = self._start(model, input_ids, attention_mask, examples)
        for step in range(self.step_bound):
            self._start_subsequences(batch.live, step)                                 # lines 5-7
            if not any(example.running for example in batch.live):
                # with delay > 1 every live example may wait for its next start: no call
                continue
            tokens = self._call(batch, step)                                            # line 8
            self._append(batch.live, tokens)                                            # lines 9-11
            if not self._drop_done(batch, step):                                        # lines 12-13
                break
        return self._output(examples, batch.batch_calls)                                # line 14

    def _last_start(self) -> int:
        """The step at which the last slot's subsequence starts."""
        return (self.max_subsequences - 1) * self.delay

    def _start(self, model, input_ids, attention_mask, examples: list[Example]) -> Batch:
        """Lines 1-3: encode the input once; nothing is fed yet."""
        device, batch_size = input_ids.device, input_ids.size(0)
        slots, length = self.max_subsequences, self.max_subsequence_length
        # real offsets stay below `length`; padding columns have subsequence index `slots` (Grid);
        # the table depends on the options only, so the decodes after this one read it
        table = made_from_bias_weight(
            model, ("pipelined grid", self.delay, slots, length),
            lambda: structure_table(past_distance_bias_table(model, slots + length), self.delay, slots,
                                    length - 1))
        width = grid_width(length - 1)
        encoder_states = self.encoder_pass()(model, input_ids, attention_mask)
        if self.compiles():   # fixed shapes: a cache of every column a call meets; the source padded
            # before a call the cache holds the most columns an example fed (`_pack`): at most its
            # output, its empty subsequences' end tokens and a last call's tokens cut by the bound;
            # a call adds at most one per slot
            most_columns = self.max_new_tokens + 3 * slots
            cache, encoder_states, cross_mask = fixed_shape_start(model, encoder_states,
                                                                  attention_mask, most_columns)
        else:
            most_columns, cache = None, DecoderCache(sizes(model.config).layers)
            cross_mask = cross_attention_mask(attention_mask, encoder_states.dtype)
        padding_code = slots * width
        return Batch(model, self.model_step(), table, width, padding_code,
                     cache=cache,
                     rows=LiveRows(batch_size, device),
                     keys=torch.full((batch_size, most_columns or 0), padding_code, device=device),
                     encoder_states=encoder_states, cross_mask=cross_mask,
                     live=list(examples), most_columns=most_columns)

    def _start_subsequences(self, live: list[Example], step: int) -> None:
        """Lines 5-7: every d steps, subsequence step/d starts (with b) in every example that may
        start one; one due when no slot is left is a bound hit (`denied_start`)."""
        if step % self.delay:
            return
        slot = step // self.delay
        for example in live:
            if not example.may_start:
                continue
            if slot < self.max_subsequences:
                example.slots.append([])
                example.running.append(slot)
            else:
                example.denied_start = True

    def _call(self, batch: Batch, step: int) -> list[int]:
        """Line 8: ONE decoder call feeds every running subsequence's newest token (b when it has
        none yet) at its grid position; returns their argmax tokens, row after row in slot order,
        read back (the call's one sync)."""
        start, width = self.special.start, batch.width
        running = [len(example.running) for example in batch.live]
        columns = max(running)
        if batch.most_columns is not None:   # fixed shapes: a power of two of columns
            columns = min(self.max_subsequences, power_of_two_holding(columns))
        tokens, codes = [], []
        for example in batch.live:
            padding = columns - len(example.running)
            # running slot i has written j tokens and feeds its last (b for none) at offset j; a
            # padding column feeds b at the padding code: no real query sees it (Grid)
            tokens.append([example.slots[i][-1] if example.slots[i] else start
                           for i in example.running] + [start] * padding)
            codes.append([i * width + len(example.slots[i]) for i in example.running]
                         + [batch.padding_code] * padding)
            example.calls += bool(example.running)
            example.fed += len(example.running)
        # only the running columns get vocabulary logits: all of them, or those `running_cells` names
        cells = None if sum(running) == columns * len(running) else batch.running_cells(running)
        token, query = send([tokens, codes], batch.keys.device).unbind(0)               # (B', R) each
        if batch.most_columns is not None:
            greedy = self._fixed_shape_call(batch, token, query)[: len(running)]       # (live, R)
            greedy = greedy.flatten() if cells is None else greedy[cells]              # (n,)
        else:
            appended = Slots(start=batch.written)     # the call's columns follow the cache's
            batch.keys = torch.cat([batch.keys, query], 1)                             # (B', N)
            query = Grid(query, width)
            bias = attention_bias(batch.table, query, Grid(batch.keys, width))
            # a token's position in its subsequence (`Grid.offset`), for families with absolute ones
            hidden = batch.run(batch.model, token, bias, batch.encoder_states, batch.cross_mask,
                               batch.cache, appended, query.offset)                    # (B', R, d)
            hidden = hidden.flatten(0, 1) if cells is None else hidden[cells]          # (n, d)
            greedy = output_logits(batch.model, hidden).argmax(-1)
        batch.written += columns
        batch.batch_calls += 1
        return batch.rows.read(greedy)

    def _fixed_shape_call(self, batch: Batch, token: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        """`_call`'s model part in a few fixed shapes, each compiled once (`greedy_columns` through
        `backbone.fixed_shape_compiled`): the call's R columns written after the `written` ones, in
        every row of a cache of `most_columns`, attended in widths of `cache.ATTENDED_SLOTS_STEP`;
        the live rows topped up to the batch's rows with copies of the first. Returns the argmax
        after every column (B', R)."""
        rows, columns = batch.encoder_states.size(0), token.size(1)
        attended = attended_width(batch.written + columns, batch.most_columns)
        written = torch.arange(batch.written, batch.written + columns, device=token.device)
        # one compiled function per shape: the rows, columns, source's and attended columns'
        # widths, the grid's width and the cache's columns
        shape = (rows, columns, batch.encoder_states.size(1), attended, batch.width, batch.most_columns)
        if shape not in batch.steps:   # looked up once per decode: the lookup costs a share of a call
            batch.steps[shape] = fixed_shape_compiled(batch.model, greedy_columns, shape)
        return batch.steps[shape](
            batch.model, topped_up(token, rows), topped_up(query, rows), batch.keys, written,
            batch.table, batch.width, attended, batch.encoder_states, batch.cross_mask, batch.cache)

    def _append(self, live: list[Example], tokens: list[int]) -> None:
        """Lines 9-11: each running subsequence's token is written to its slot, in subsequence
        order while the output fits max_new_tokens (the empty terminator's e takes no room; a token
        that does not fit cuts the example, and the call's later tokens are dropped); a
        subsequence ends at e or at max_subsequence_length tokens; under first_empty an empty
        subsequence stops new starts."""
        eos, tokens = self.special.eos, iter(tokens)
        for example in live:
            still = []
            for slot in example.running:
                token, written = next(tokens), example.slots[slot]
                empty = token == eos and not written
                example.room -= not empty
                if example.room < 0:
                    example.cut = True
                    continue
                written.append(token)
                if empty and self.stop_rule == FIRST_EMPTY:
                    example.may_start = False
                if token != eos and len(written) < self.max_subsequence_length:
                    still.append(slot)
            example.running = still

    def _drop_done(self, batch: Batch, step: int) -> bool:
        """Lines 12-13: the examples that are done leave the batch and the cache: those cut by
        max_new_tokens, and those with nothing running and (first_empty) nothing left to start
        (all_end: whatever could still start). Returns whether any example is left."""
        start_due = self.stop_rule == FIRST_EMPTY and step < self._last_start()
        for example in batch.live:
            example.done = example.cut or not (example.running or (start_due and example.may_start))
        done = [example.done for example in batch.live]
        row_tensors = (batch.keys, batch.encoder_states, batch.cross_mask)
        if batch.most_columns is None:
            kept = batch.rows.drop(done, batch.cache, *row_tensors)
        elif batch.rows.drop(done, None) is None:
            kept = None
        else:   # fixed shapes: the cache's rows laid out once the kept rows are known
            kept = (fixed_shape_rows(batch.rows.kept, batch.cache, *row_tensors)
                    if len(batch.rows.kept) < len(done) else row_tensors)
        if kept is None:
            return False
        batch.keys, batch.encoder_states, batch.cross_mask = kept
        batch.live = [batch.live[row] for row in batch.rows.kept]
        most_fed = max(example.fed for example in batch.live)
        if batch.written > most_fed and not self._room_for_a_call(batch):
            self._pack(batch, most_fed)
        return True

    def _room_for_a_call(self, batch: Batch) -> bool:
        """Whether the next call's columns fit the cache as it is: under fixed shapes while the
        columns written and a call's most (one per slot) fit its `most_columns` (a pack sorts and
        gathers every layer's keys and values, which costs more than the padding columns it
        saves the attention); a cache that grows never (it is packed whenever it holds padding
        past the fullest example's columns)."""
        return (batch.most_columns is not None
                and batch.written + self.max_subsequences <= batch.most_columns)

    def _pack(self, batch: Batch, most_fed: int) -> None:
        """Pack each example's fed columns to the front of the cache and its keys (stable: their
        order is kept), and crop the padding every example has past its own (under fixed shapes,
        keep it, after them)."""
        padding = batch.keys == batch.padding_code                                     # (B', N)
        order = torch.sort(padding, dim=1, stable=True).indices                        # (B', N)
        if batch.most_columns is None:
            order = order[:, :most_fed]                                                # (B', N')
        batch.cache.gather_slots(order)
        batch.keys = batch.keys.gather(1, order)
        batch.written = most_fed

    def _output(self, examples: list[Example], batch_calls: int) -> DecodeOutput:
        """Line 14: every example's non-empty subsequences, in order (their e dropped), and what
        it took. An example was cut by a bound if it was still decoding after the step bound, if
        a token did not fit max_new_tokens, if a slot wrote max_subsequence_length tokens none of them
        e, if a start was due with no slot left, or (first_empty) if it never wrote its empty
        terminator."""
        eos, length = self.special.eos, self.max_subsequence_length

        def hit_bound(example: Example) -> bool:
            return (not example.done or example.cut or example.denied_start
                    or any(len(tokens) == length and tokens[-1] != eos for tokens in example.slots)
                    or (self.stop_rule == FIRST_EMPTY
                        and all(tokens[:1] != [eos] for tokens in example.slots)))

        def without_end(tokens: list[int]) -> list[int]:
            return tokens[:-1] if tokens[-1:] == [eos] else tokens
        return DecodeOutput(
            subsequences=[[without_end(tokens) for tokens in example.slots if without_end(tokens)]
                          for example in examples],
            decoder_calls=[example.calls for example in examples],
            tokens=[sum(len(tokens) for tokens in example.slots) for example in examples],
            bound_hit=[hit_bound(example) for example in examples],
            batch_decoder_calls=batch_calls)
