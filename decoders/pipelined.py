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
`max_subsequence_length` tokens); one whose first token is e is empty and stops new starts. An
example is done when nothing runs and nothing can start; all are done at `max_steps`.
Output = the non-empty subsequences, in order.

Decoding is batched and cached: per call each example feeds its running subsequences' newest tokens,
padded to the batch's largest count (B, R); the key/value cache grows by R columns per call, and the
mask hides padding columns. Finished examples are dropped from the batch and the cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from decoders import register
from decoders.base import (DecodeOutput, Decoder, SpecialTokens, drop_finished_rows, encode,
                           hidden_mask, new_cache, output_logits, pad_batch, relative_position_bias,
                           run_decoder)

# slot states in decoding
WAITING, RUNNING, DONE = 0, 1, 2


@dataclass
class Grid:
    """Tokens of a batch laid out on the (subsequence, offset) grid, flattened to (B, N)."""

    tokens: torch.Tensor      # (B, N) decoder input ids (pad where invalid)
    subsequence: torch.Tensor  # (B, N) i
    offset: torch.Tensor      # (B, N) j
    valid: torch.Tensor       # (B, N) bool


def attention_bias(bias_table: torch.Tensor, delay: int, query: Grid, key: Grid) -> torch.Tensor:
    """Self-attention bias (B, heads, Q, K) = T5 relative bias of the Manhattan distance + visibility.

    `bias_table[d]` is the (heads,) bias of past-distance d (see `distance_bias_table`).
    """
    qi, qj = query.subsequence[:, :, None], query.offset[:, :, None]   # (B, Q, 1)
    ki, kj = key.subsequence[:, None, :], key.offset[:, None, :]       # (B, 1, K)
    visible = key.valid[:, None, :] & (ki <= qi) & (ki * delay + kj <= qi * delay + qj)
    # no clamp: a table too short for some distance must fail, not bias it as a nearer one
    distance = (qi - ki).abs() + (qj - kj).abs()
    bias = bias_table[distance].permute(0, 3, 1, 2)                    # (B, heads, Q, K)
    return bias + hidden_mask(visible, bias.dtype)


def distance_bias_table(model, longest: int) -> torch.Tensor:
    """(longest + 1, heads) T5 decoder bias for past distances 0..longest, computed once per call of
    `generate`/`loss` so that each decoding step only gathers from it."""
    distance = torch.arange(longest + 1, device=model.device)[None, :, None]   # (1, D, 1)
    return relative_position_bias(model, distance)[0, :, :, 0].T                # (D, heads)


@register("pipelined")
class PipelinedDecoder(Decoder):
    decode_options = ("max_subsequences", "max_subsequence_length", "max_steps")
    def __init__(self, backbone_config, special: SpecialTokens, delay: int = 1,
                 max_subsequences: int = 16, max_subsequence_length: int = 32, max_steps: int = 128):
        super().__init__(backbone_config, special)
        for key, value in (("delay", delay), ("max_subsequences", max_subsequences),
                           ("max_subsequence_length", max_subsequence_length), ("max_steps", max_steps)):
            if value < 1:
                raise ValueError(f"decoder.{key} must be >= 1, got {value}")
        self.delay = delay
        self.max_subsequences = max_subsequences
        self.max_subsequence_length = max_subsequence_length
        self.max_steps = max_steps

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
        """Subsequence i (and the empty one after the last) runs from step i*d for its tokens plus
        its end token; a call is made at every step at which some subsequence runs."""
        spans = [len(sub) + 1 for sub in subsequences] + [1]
        return len({i * self.delay + j for i, span in enumerate(spans) for j in range(span)})

    def teacher_forced_logits(self, model, input_ids, attention_mask, layout) -> torch.Tensor:
        """(B, N, vocab) logits of the whole layout in one uncached pass (training forward)."""
        grid = Grid(layout["tokens"], layout["subsequence"], layout["offset"], layout["valid"])
        # A visible pair can lie max(i) + max(j) apart: the terminator (m, 0) sees offset max(j)
        # of subsequence 0. The table must reach that far, as decoding's does.
        longest = int(grid.subsequence.max() + grid.offset.max())
        bias = attention_bias(distance_bias_table(model, longest), self.delay, grid, grid)
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
               record_logits: bool = False):
        """Algorithm 1. Returns (DecodeOutput, logits) where logits, if recorded, maps
        (example, subsequence, offset) -> the (vocab,) logits computed for that position.

        `use_cache=False` recomputes every step from all tokens fed so far; it exists so tests can
        check the cached path against a plain recomputation.
        """
        device = input_ids.device
        batch_size = input_ids.size(0)
        slots = self.max_subsequences
        length = self.max_subsequence_length
        table = distance_bias_table(model, (slots - 1) + length)   # max(i) + max(j), as in training
        encoder_states = encode(model, input_ids, attention_mask)
        cache = new_cache() if use_cache else None

        rows = torch.arange(batch_size, device=device)       # original index of each live example
        state = torch.full((batch_size, slots), WAITING, dtype=torch.long, device=device)
        offset = torch.zeros((batch_size, slots), dtype=torch.long, device=device)
        next_token = torch.full((batch_size, slots), self.special.start, dtype=torch.long, device=device)
        stopped = torch.zeros(batch_size, dtype=torch.bool, device=device)   # no new starts
        # generated tokens and their count per slot, indexed by original example (rows are dropped)
        produced = torch.zeros((batch_size, slots, length), dtype=torch.long, device=device)
        produced_length = torch.zeros((batch_size, slots), dtype=torch.long, device=device)
        hit_bound = torch.zeros(batch_size, dtype=torch.bool, device=device)
        terminated = torch.zeros(batch_size, dtype=torch.bool, device=device)  # emitted the empty one
        calls = torch.zeros(batch_size, dtype=torch.long, device=device)
        tokens_out = torch.zeros(batch_size, dtype=torch.long, device=device)
        slot_index = torch.arange(slots, device=device)
        keys = Grid(*(torch.zeros((batch_size, 0), dtype=torch.long, device=device) for _ in range(3)),
                    torch.zeros((batch_size, 0), dtype=torch.bool, device=device))
        logits_seen: dict = {}
        batch_calls = 0

        for step in range(self.max_steps):
            # 1. start subsequence step/d in every example that may still start one
            if step % self.delay == 0 and step // self.delay < slots:
                state[~stopped, step // self.delay] = RUNNING

            running = state == RUNNING                                       # (B', slots)
            # 2. gather each example's running slots, in subsequence order, into R columns
            count = running.sum(1)
            width = int(count.max())
            if width == 0:   # with delay > 1 every live example may be waiting for its next start
                continue
            order = torch.argsort((~running).to(torch.int8), dim=1, stable=True)[:, :width]  # (B', R)
            valid = torch.gather(running, 1, order)
            query = Grid(torch.gather(next_token, 1, order).masked_fill(~valid, self.special.pad),
                         order, torch.gather(offset, 1, order), valid)
            keys = Grid(*(torch.cat([k, q], 1) for k, q in zip(
                (keys.tokens, keys.subsequence, keys.offset, keys.valid),
                (query.tokens, query.subsequence, query.offset, query.valid))))

            # 3. one decoder call for all running subsequences of all live examples
            if use_cache:
                bias = attention_bias(table, self.delay, query, keys)
                hidden = run_decoder(model, query.tokens, bias, encoder_states, attention_mask, cache)
            else:
                bias = attention_bias(table, self.delay, keys, keys)
                hidden = run_decoder(model, keys.tokens, bias, encoder_states, attention_mask)[:, -width:]
            # logits only at the running subsequences' columns: padding columns cost no vocab row
            live, column = valid.nonzero(as_tuple=True)                      # (n,) each
            logits = output_logits(model, hidden[live, column])              # (n, vocab)
            token = logits.argmax(-1)                                        # (n,)
            slot = order[live, column]
            j = offset[live, slot]
            batch_calls += 1
            calls[rows[count > 0]] += 1
            if record_logits:
                for key, position_logits in zip(zip(rows[live].tolist(), slot.tolist(), j.tolist()), logits):
                    logits_seen[key] = position_logits.clone()

            # 4. write the new tokens back to their slots and update the slots' states
            produced[rows[live], slot, j] = token
            produced_length[rows[live], slot] = j + 1
            tokens_out.index_add_(0, rows[live], torch.ones_like(live))
            ended = token == self.special.eos
            too_long = ~ended & (j + 1 >= length)
            state[live[ended | too_long], slot[ended | too_long]] = DONE
            hit_bound[rows[live[too_long]]] = True
            empty = ended & (j == 0)
            stopped[live[empty]] = True
            terminated[rows[live[empty]]] = True
            next_token[live, slot] = token
            offset[live, slot] = j + 1

            # 5. drop examples with nothing running and nothing left to start
            can_start = ~stopped & (slot_index[None, :] * self.delay > step).any(1)
            finished = ~((state == RUNNING).any(1) | can_start)
            if finished.all():
                break
            if finished.any():
                keep = (~finished).nonzero().squeeze(1)
                (encoder_states, attention_mask, rows, state, offset, next_token, stopped,
                 *key_fields) = drop_finished_rows(
                    cache, keep, encoder_states, attention_mask, rows, state, offset, next_token,
                    stopped, keys.tokens, keys.subsequence, keys.offset, keys.valid)
                keys = Grid(*key_fields)
        else:
            hit_bound[rows] = True   # max_steps reached with work left
        # An example that used all `max_subsequences` slots never emitted its empty terminator: it
        # was cut by that bound as surely as by `max_steps`.
        hit_bound |= ~terminated

        output = DecodeOutput(
            subsequences=[self._subsequences(tokens, lengths)
                          for tokens, lengths in zip(produced.tolist(), produced_length.tolist())],
            decoder_calls=calls.tolist(), tokens=tokens_out.tolist(), hit_max_steps=hit_bound.tolist(),
            batch_decoder_calls=batch_calls)
        return output, logits_seen

    def _subsequences(self, slots: list[list[int]], lengths: list[int]) -> list[list[int]]:
        """One example's non-empty subsequences before the first empty or unstarted slot."""
        out = []
        for tokens, length in zip(slots, lengths):
            tokens = tokens[:length]
            if tokens and tokens[-1] == self.special.eos:
                tokens = tokens[:-1]
            if not tokens:
                break
            out.append(tokens)
        return out
