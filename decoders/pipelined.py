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
padded to the batch's largest count (B, R); the key/value cache grows by R columns per call, and the
mask hides padding columns. Finished examples are dropped from the batch and the cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from decoders import register
from decoders.base import (Choice, DecodeOutput, Decoder, LiveRows, Range, SpecialTokens, encode,
                           gather_self_attention_cache, hidden_mask, new_cache, output_logits,
                           pad_batch, past_distance_bias_table, read_back, run_decoder)

# slot states in decoding
WAITING, RUNNING, DONE = 0, 1, 2
# the stopping rules (module docstring)
FIRST_EMPTY, ALL_END = "first_empty", "all_end"


@dataclass
class Grid:
    """Tokens of a batch laid out on the (subsequence, offset) grid, flattened to (B, N)."""

    tokens: torch.Tensor      # (B, N) decoder input ids (pad where invalid)
    subsequence: torch.Tensor  # (B, N) i
    offset: torch.Tensor      # (B, N) j
    valid: torch.Tensor       # (B, N) bool


def attention_bias(bias_table: torch.Tensor, delay: int, query: Grid, key: Grid) -> torch.Tensor:
    """Self-attention bias (B, heads, Q, K) = T5 relative bias of the Manhattan distance + visibility.

    `bias_table[d]` is the (heads,) bias of past-distance d (`base.past_distance_bias_table`).
    """
    qi, qj = query.subsequence[:, :, None], query.offset[:, :, None]   # (B, Q, 1)
    ki, kj = key.subsequence[:, None, :], key.offset[:, None, :]       # (B, 1, K)
    visible = key.valid[:, None, :] & (ki <= qi) & (ki * delay + kj <= qi * delay + qj)
    # no clamp: a table too short for some distance must fail, not bias it as a nearer one
    distance = (qi - ki).abs() + (qj - kj).abs()
    bias = bias_table[distance].permute(0, 3, 1, 2)                    # (B, heads, Q, K)
    return bias + hidden_mask(visible, bias.dtype)


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
        grid = Grid(layout["tokens"], layout["subsequence"], layout["offset"], layout["valid"])
        # A visible pair can lie max(i) + max(j) apart: the terminator (m, 0) sees offset max(j)
        # of subsequence 0. The table must reach that far, as decoding's does.
        longest = int(grid.subsequence.max() + grid.offset.max())
        bias = attention_bias(past_distance_bias_table(model, longest), self.delay, grid, grid)
        encoder_states = encode(model, input_ids, attention_mask)
        hidden = run_decoder(model, grid.tokens, bias, encoder_states, attention_mask)
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
        width and which columns need vocabulary logits); all other bookkeeping is tensor ops on
        per-slot state, and the results are read back once, at the end.
        """
        device, batch_size, delay = input_ids.device, input_ids.size(0), self.delay
        slots, length = self.max_subsequences, self.max_subsequence_length
        table = past_distance_bias_table(model, (slots - 1) + length)   # max(i) + max(j), as in training
        encoder_states = encode(model, input_ids, attention_mask)
        cache = new_cache() if use_cache else None

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=device)
        rows = LiveRows(batch_size, device)
        # per live example and slot (subsequence i = slot i)
        state = torch.full((batch_size, slots), WAITING, dtype=torch.long, device=device)
        offset = zeros(batch_size, slots)
        next_token = torch.full((batch_size, slots), self.special.start, dtype=torch.long, device=device)
        stopped = zeros(batch_size, dtype=torch.bool)           # first_empty: no new starts
        # per original example (rows leave the batch; these stay), read back once at the end
        produced = zeros(batch_size, slots, length)
        produced_length = zeros(batch_size, slots)
        bound_hits = zeros(batch_size)                          # subsequences cut, or output cut
        output_length = zeros(batch_size)                       # tokens as the flat layout counts them
        terminations = zeros(batch_size)                        # empty subsequences emitted
        calls = zeros(batch_size)
        tokens_out = zeros(batch_size)
        keys = Grid(zeros(batch_size, 0), zeros(batch_size, 0), zeros(batch_size, 0),
                    zeros(batch_size, 0, dtype=torch.bool))
        logits_seen: dict = {}
        batch_calls = 0
        counts = [1] * batch_size   # host: running subsequences per live example at this step
        fed = [0] * batch_size      # host: tokens each live example has in the cache
        appended = 0                # host: cache columns appended, padding included

        for step in range(self.max_steps):
            # 1. start subsequence step/d in every example that may still start one
            if step % delay == 0 and step // delay < slots:
                state[:, step // delay] = torch.where(stopped, state[:, step // delay], RUNNING)
            width = max(counts)
            if width == 0:
                # with delay > 1 every live example may wait for its next start: no call; the
                # live examples (none is stopped: those finished) start one at the next start
                starts = (step + 1) % delay == 0 and (step + 1) // delay < slots
                counts = [int(starts)] * len(counts)
                continue
            running = state == RUNNING                                       # (B', slots)
            # 2. gather each example's running slots, in subsequence order, into R columns
            order = torch.argsort((~running).to(torch.int8), dim=1, stable=True)[:, :width]  # (B', R)
            valid = torch.gather(running, 1, order)
            query = Grid(torch.gather(next_token, 1, order).masked_fill(~valid, self.special.pad),
                         order, torch.gather(offset, 1, order), valid)
            keys = Grid(*(torch.cat([k, q], 1) for k, q in zip(
                (keys.tokens, keys.subsequence, keys.offset, keys.valid),
                (query.tokens, query.subsequence, query.offset, query.valid))))

            # 3. one decoder call for all running subsequences of all live examples
            if use_cache:
                bias = attention_bias(table, delay, query, keys)
                hidden = run_decoder(model, query.tokens, bias, encoder_states, attention_mask, cache)
            else:
                bias = attention_bias(table, delay, keys, keys)
                hidden = run_decoder(model, keys.tokens, bias, encoder_states, attention_mask)[:, -width:]
            # vocabulary logits only at the running columns (the first counts[b] of row b): their
            # indices come from the host-side counts, not from a `nonzero` that would wait
            live = torch.tensor([b for b, c in enumerate(counts) for _ in range(c)], device=device)
            column = torch.tensor([c for n in counts for c in range(n)], device=device)
            logits = output_logits(model, hidden[live, column])              # (n, vocab)
            token = logits.argmax(-1)                                        # (n,)
            slot = order[live, column]
            j = offset[live, slot]
            example = rows.index[live]
            batch_calls += 1
            appended += width
            calls.index_add_(0, rows.index, running.any(1).long())
            if record_logits:
                for key, position_logits in zip(zip(example.tolist(), slot.tolist(), j.tolist()), logits):
                    logits_seen[key] = position_logits.clone()

            # 4. keep the tokens that fit the example's output bound (in subsequence order: the
            # columns are), write them back to their slots and update the slots' states
            ended = token == self.special.eos
            empty = ended & (j == 0)
            cost = zeros(len(counts), width)
            cost[live, column] = (~empty).long()       # the empty terminator's end is no output
            fits = output_length[example] + cost.cumsum(1)[live, column] <= self.max_length
            over = zeros(len(counts)).index_add_(0, live, (~fits).long()) > 0   # (B',) cut here
            output_length.index_add_(0, example, (fits & ~empty).long())
            produced[example, slot, j] = token
            produced_length[example, slot] = j + fits.long()
            tokens_out.index_add_(0, example, fits.long())
            too_long = ~ended & (j + 1 >= length)
            state[live, slot] = torch.where(ended | too_long | over[live], DONE, RUNNING)
            bound_hits.index_add_(0, example, (too_long & fits).long())
            bound_hits.index_add_(0, rows.index, over.long())
            terminations.index_add_(0, example, (empty & fits).long())
            stopped = stopped | over   # cut: no new starts (under all_end nothing runs: done)
            if self.stop_rule == FIRST_EMPTY:
                stopped = stopped | (zeros(len(counts)).index_add_(0, live, empty.long()) > 0)
            next_token[live, slot] = token
            offset[live, slot] = j + 1

            # 5. drop the examples that are done (first_empty: nothing running and nothing left to
            # start; all_end: nothing running, whatever could still start); read back, in the same
            # transfer, how many subsequences each kept example runs at the next step
            still_running = state == RUNNING
            done = ~still_running.any(1)
            if self.stop_rule == FIRST_EMPTY:
                done = done & (stopped | ((slots - 1) * delay <= step))
            starts_next = (step + 1) % delay == 0 and (step + 1) // delay < slots
            kept = rows.drop_finished(
                done, cache, encoder_states, attention_mask, state,
                offset, next_token, stopped, keys.tokens, keys.subsequence, keys.offset, keys.valid,
                also=still_running.sum(1) + (~stopped & starts_next))
            if kept is None:
                break
            (encoder_states, attention_mask, state, offset, next_token, stopped, *key_fields) = kept
            keys = Grid(*key_fields)
            fed = [fed[b] + counts[b] for b in rows.kept]
            counts = rows.values
            if use_cache and keys.valid.size(1) > max(fed):
                # pack each example's fed columns to the front (stable: their order is kept) and
                # crop the padding every example has past its own
                order = torch.argsort((~keys.valid).to(torch.int8), dim=1, stable=True)[:, :max(fed)]
                gather_self_attention_cache(cache, order)
                keys = Grid(*(torch.gather(k, 1, order) for k in
                              (keys.tokens, keys.subsequence, keys.offset, keys.valid)))
            if cache_trace is not None and use_cache:
                cache_trace.append((cache.get_seq_length(), list(fed), appended))
        else:
            bound_hits.index_add_(0, rows.index, torch.ones_like(rows.index))  # max_steps reached

        if self.stop_rule == FIRST_EMPTY:
            # An example that used all `max_subsequences` slots never emitted its empty terminator:
            # it was cut by that bound as surely as by `max_steps`.
            cut_by_slots = terminations == 0
        else:
            # Under all_end an example takes part in a call at every step until it is done, so
            # one with more calls than slots*d still ran at step slots*d, whose exploration found
            # no slot left.
            cut_by_slots = calls > slots * delay
        hit_bound = (bound_hits > 0) | cut_by_slots
        produced, produced_length, calls, tokens_out, hit_bound = read_back(
            produced, produced_length, calls, tokens_out, hit_bound)
        output = DecodeOutput(
            subsequences=[self._subsequences(tokens, lengths)
                          for tokens, lengths in zip(produced, produced_length)],
            decoder_calls=calls, tokens=tokens_out, hit_max_steps=[bool(h) for h in hit_bound],
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
