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
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from decoders import register
from datamodules.vocabulary import Choice, pad_batch, Range, SpecialTokens
from decoders.backbone import (encode, gather_self_attention_cache, new_cache, output_logits,
                               past_distance_bias_table, run_decoder)
from decoders.base import DecodeOutput, Decoder
from decoders.loop import LiveRows, NOT_PRODUCED, read_back

# slot states in decoding; RUNNING sorts first, so a stable argsort of the states lists an
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
        # the last slot starts at step (slots - 1) * delay and runs at most max_subsequence_length
        self.max_steps = (max_steps if max_steps is not None
                          else (max_subsequences - 1) * delay + max_subsequence_length)
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
        the output cannot be produced (None)."""
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
        return self.decode(model, input_ids, attention_mask)[0]

    def decode(self, model, input_ids, attention_mask, use_cache: bool = True,
               record_logits: bool = False, cache_trace: list | None = None):
        """Algorithm 1. Returns (DecodeOutput, logits) where logits, if recorded, maps
        (example, subsequence, offset) -> the (vocab,) logits computed for that position.

        `use_cache=False` recomputes every step from all tokens fed so far; it exists so tests can
        check the cached path against a plain recomputation. `cache_trace`, if given, receives
        (cache length, tokens each live example fed, columns appended so far) after every call
        (for tests of the bound below).

        The cache stays lean: each call appends R columns per example (R = the batch's largest
        running count), padding where an example runs fewer. When the cache holds more columns
        than the fullest live example fed (its widest example changed or finished), every
        example's fed columns are packed to the front and the rest cropped: after every call,
        cache length = most tokens any live example fed. (Rare: usually the example running most
        subsequences stays the fullest.)

        Host syncs: one per decoder call (`LiveRows.drop_finished` reads back which examples
        finished together with each one's running count for the next call, which sets that call's
        width and which columns need vocabulary logits). All other bookkeeping is a few tensor ops
        per call on per-slot state, written back with one scatter; the tokens, and what the bound
        flags are derived from, are read back once, at the end. At batch size 1 on a CPU these ops,
        not the model, are what a call costs beyond sequential's, so there are as few as possible.
        """
        device, batch_size, delay = input_ids.device, input_ids.size(0), self.delay
        slots, length, eos = self.max_subsequences, self.max_subsequence_length, self.special.eos
        # padding columns have subsequence index `slots` (Grid); offsets reach `length` (a slot
        # that ran its full length, gathered as a padding column)
        table = structure_table(past_distance_bias_table(model, slots + length), delay, slots, length)
        encoder_states = encode(model, input_ids, attention_mask)
        cache = new_cache() if use_cache else None
        rows = LiveRows(batch_size, device)

        def full(shape, value, dtype=torch.long):
            return torch.full(shape, value, dtype=dtype, device=device)
        # per live example and slot (subsequence i = slot i), (B', 3, slots): the token it feeds
        # next, its offset j, its state
        slot_fields = torch.stack([full((batch_size, slots), self.special.start),
                                   full((batch_size, slots), 0), full((batch_size, slots), WAITING)], 1)
        may_start = full((batch_size,), True, torch.bool)     # first_empty: cleared by an empty one
        output_length = full((batch_size,), 0)                 # tokens as the flat layout counts them
        # keys fed so far, (B', 3, N): token, subsequence (`slots` for padding), offset
        keys = full((batch_size, 3, 0), 0)
        # per original example (rows leave the batch; this stays), read back once at the end: each
        # slot's tokens, CUT where an emitted token did not fit the output bound; padding columns
        # write into a scratch slot (index `slots`) and a scratch offset (`length`)
        produced = full((batch_size, slots + 1, length + 1), NOT_PRODUCED)
        logits_seen: dict = {}
        batch_calls = 0
        originals = list(range(batch_size))   # host: each live example's original row
        calls = [0] * batch_size              # host: decoder calls per original example
        ran_out_of_steps = [False] * batch_size
        counts = [1] * batch_size   # host: running subsequences per live example at this step
        fed = [0] * batch_size      # host: tokens each live example has in the cache
        appended = 0                # host: cache columns appended, padding included
        columns: dict = {}          # counts -> (live, column) of the running columns, built once

        for step in range(self.max_steps):
            # 1. start subsequence step/d in every example that may still start one
            if step % delay == 0 and step // delay < slots:
                slot_fields[:, 2, step // delay].masked_fill_(may_start, RUNNING)
            width = max(counts)
            if width == 0:
                # with delay > 1 every live example may wait for its next start: no call; the
                # live examples (none is stopped: those finished) start one at the next start
                starts = (step + 1) % delay == 0 and (step + 1) // delay < slots
                counts = [int(starts)] * len(counts)
                continue
            # the running columns (the first counts[b] of row b) get vocabulary logits: their indices
            # come from the host-side counts, not from a `nonzero` that would wait. Made here, before
            # this call's work is queued: on a GPU, a copy from the host waits for the queue.
            if tuple(counts) not in columns:
                columns[tuple(counts)] = (
                    torch.tensor([b for b, c in enumerate(counts) for _ in range(c)], device=device),
                    torch.tensor([c for n in counts for c in range(n)], device=device))
            live, column = columns[tuple(counts)]
            # 2. each example's running slots, in subsequence order, then its others: R columns
            order = torch.argsort(slot_fields[:, 2], dim=1, stable=True)[:, :width]     # (B', R)
            order_fields = order[:, None].expand(-1, 3, -1)                              # (B', 3, R)
            token, offset, state = slot_fields.gather(2, order_fields).unbind(1)        # (B', R) each
            valid = state == RUNNING
            query = Grid(order.masked_fill(~valid, slots), offset)
            # a padding column feeds its slot's stale token: no real query sees it (Grid)
            keys = torch.cat([keys, torch.stack([token, query.subsequence, offset], 1)], 2)

            # 3. one decoder call for all running subsequences of all live examples
            if use_cache:
                bias = attention_bias(table, query, Grid(keys[:, 1], keys[:, 2]))
                hidden = run_decoder(model, token, bias, encoder_states, attention_mask, cache)
            else:
                key = Grid(keys[:, 1], keys[:, 2])
                bias = attention_bias(table, key, key)
                hidden = run_decoder(model, keys[:, 0], bias, encoder_states, attention_mask)[:, -width:]
            # vocabulary logits only at the running columns
            logits = output_logits(model, hidden[live, column])              # (n, vocab)
            emitted = token.index_put((live, column), logits.argmax(-1))     # (B', R); padding: stale
            batch_calls += 1
            appended += width
            for b, count in enumerate(counts):
                calls[originals[b]] += int(count > 0)
            if record_logits:   # tests only: the reads here are syncs
                cells = zip([originals[b] for b in live.tolist()], order[live, column].tolist(),
                            offset[live, column].tolist())
                for cell, position_logits in zip(cells, logits):
                    logits_seen[cell] = position_logits.clone()

            # 4. keep the tokens that fit the example's output bound (in subsequence order: the
            # columns are), write them back to their slots and update the slots' states
            ended = (emitted == eos) & valid
            empty = ended & (offset == 0)
            counted = valid & ~empty                 # the empty terminator's end is no output
            fits = (output_length[:, None] + counted.cumsum(1) <= self.max_length) & valid
            over = (valid & ~fits).any(1)            # (B',) the output was cut here
            output_length = output_length + (fits & ~empty).sum(1)
            finished = ended | (offset + 1 >= length) | over[:, None]
            slot_fields.scatter_(2, order_fields, torch.stack(
                [emitted, offset + valid, torch.where(finished & valid, DONE, state)], 1))
            produced[rows.index[:, None], query.subsequence, offset] = torch.where(fits, emitted, CUT)
            # a cut output starts nothing more (under all_end nothing of it runs: it is done);
            # under first_empty an empty subsequence stops new starts
            stops = (over | empty.any(1)) if self.stop_rule == FIRST_EMPTY else over
            may_start = may_start & ~stops

            # 5. drop the examples that are done (first_empty: nothing running and nothing left to
            # start; all_end: nothing running, whatever could still start); read back, in the same
            # transfer, how many subsequences each kept example runs at the next step
            still_running = slot_fields[:, 2] == RUNNING
            done = ~still_running.any(1)
            if self.stop_rule == FIRST_EMPTY and step < (slots - 1) * delay:
                done = done & ~may_start
            running_next = still_running.sum(1)
            if (step + 1) % delay == 0 and (step + 1) // delay < slots:
                running_next = running_next + may_start
            kept = rows.drop_finished(done, cache, encoder_states, attention_mask, slot_fields,
                                      may_start, output_length, keys, also=running_next)
            if kept is None:
                break
            encoder_states, attention_mask, slot_fields, may_start, output_length, keys = kept
            originals = [originals[b] for b in rows.kept]
            fed = [fed[b] + counts[b] for b in rows.kept]
            counts = rows.values
            if use_cache and keys.size(2) > max(fed):
                # pack each example's fed columns to the front (stable: their order is kept) and
                # crop the padding every example has past its own
                padding = (keys[:, 1] == slots).to(torch.int8)
                order = torch.argsort(padding, dim=1, stable=True)[:, :max(fed)]
                gather_self_attention_cache(cache, order)
                keys = keys.gather(2, order[:, None].expand(-1, 3, -1))
            if cache_trace is not None and use_cache:
                cache_trace.append((cache.get_seq_length(), list(fed), appended))
        else:
            for b in originals:
                ran_out_of_steps[b] = True   # max_steps reached

        # The bound flags, from the tokens: a slot cut at max_subsequence_length wrote a last
        # token that is not e; an output cut by max_length holds a CUT.
        tokens = produced[:, :slots, :length]                               # (B, slots, length)
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
        cut_by_slots = [self.stop_rule == ALL_END and n > slots * delay for n in calls]
        output = DecodeOutput(
            subsequences=[self._subsequences(rows_, lengths)
                          for rows_, lengths in zip(tokens, produced_length)],
            decoder_calls=calls, tokens=[sum(lengths) for lengths in produced_length],
            hit_max_steps=[bool(h) or steps or slots_ for h, steps, slots_
                           in zip(hit_bound, ran_out_of_steps, cut_by_slots)],
            batch_decoder_calls=batch_calls)
        return output, logits_seen

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
