"""Blockwise parallel decoding: k-1 proposal heads guess ahead, the base head verifies in one pass.

Reference: Stern, Shazeer & Uszkoreit 2018, "Blockwise Parallel Decoding for Deep Autoregressive
Models" (NeurIPS). Notation: k = `block_size`; the base head p_1 is T5's own output head; proposal
head p_i (i = 2..k) predicts token t+i from the decoder state at t.

Layout. The sequential layout (`SequentialDecoder.layout`: s_1 <sep> ... s_m </s>), so the base head
    trains exactly as the sequential decoder's and `sequential` can decode a blockwise checkpoint.
Heads. p_i = output_logits(h + W2 relu(W1 h)) (d_model -> d_ff -> d_model, the backbone's shared
    output projection). W2 starts at zero, so every head starts as a copy of the base head (it
    proposes the base head's next token again) and learns only the difference.
Loss. Sum of the k cross-entropies: base head on the labels, head i on the labels shifted left by
    i-1 more (ignoring -100). `freeze_backbone`: the backbone (output projection included) runs under
    no_grad / with detached weights and only the heads learn (the paper's frozen-backbone setting).
Decode (Section 3, with the paper's combined scoring and proposal: one decoder call per iteration).
    Feed the block [y_t, q_{t+1}, .., q_{t+k-1}] (last accepted token, k-1 proposals). The base head's
    argmax at fed position j is the greedy token after it, so accept the longest prefix of proposals
    on which it agrees (`accepted_length`), then append the base head's own token after the last
    accepted position; the heads at that same position give the next block's proposals. Every
    iteration yields 1..k tokens and the output is exactly sequential greedy decoding of the base
    head. `top_k` > 1 is the paper's approximate acceptance (Section 5): a proposal passes if it is
    among the base head's top-k tokens there (faster, no longer exact).
    Generation stops at the end token (later tokens of the block are discarded) or at
    `max_new_tokens`.

Batching. Rows accept different lengths, so the key/value cache cannot be cropped per row. Every
row appends its k fed tokens to the cache each call; per row we keep the true position of each cache
slot and whether it is alive (accepted). Rejected slots stay in the cache but are hidden by the
self-attention bias (relative bias of query_pos - key_pos + a mask: visible iff alive and not in the
future), which `run_decoder` adds in every layer. The rejected tail that all live rows share is
cropped off the cache (a single example thus keeps no dead slots at all), and finished rows are
dropped from the batch and the cache.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from decoders import register
from decoders.base import (DecodeOutput, Decoder, SpecialTokens, at_least_float32,
                           drop_finished_rows, encode, hidden_mask, new_cache, output_logits, relative_position_bias,
                           run_decoder, split_on)
from decoders.sequential import SequentialDecoder


class ProposalHead(nn.Module):
    """h + W2 relu(W1 h): one residual feed-forward layer on the decoder's final hidden state."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)
        # Zero W2: the head starts as an exact copy of the base head's input, so training begins
        # from the base head's predictions instead of noise. W1 still gets gradients after the
        # first step (through W2), as in a residual adapter.
        nn.init.zeros_(self.w2.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.w2(torch.relu(self.w1(hidden)))


def accepted_length(proposals: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """How many leading proposals the base head accepts.

    proposals: (B, m) the fed proposal tokens; candidates: (B, m, top_k) the base head's top-k tokens
    at the fed position *before* each proposal (top_k = 1: its argmax, exact acceptance).
    Returns (B,) longs in 0..m: the length of the longest prefix whose every token is a candidate.
    """
    match = (proposals[..., None] == candidates).any(-1)          # (B, m)
    return match.long().cumprod(dim=1).sum(dim=1)


def block_tokens(proposals: list[int], accepted: int, base_next: int, end: int,
                 room: int) -> tuple[list[int], bool]:
    """The tokens one iteration produces for one example, and whether it ended at `end`.

    The `accepted` leading proposals, then the base head's own next token; cut just after the first
    end token (what follows an end token is never output) and to `room` tokens (max_new_tokens).
    """
    tokens = proposals[:accepted] + [base_next]
    if end in tokens:
        tokens = tokens[: tokens.index(end) + 1]
    tokens = tokens[:room]
    return tokens, bool(tokens) and tokens[-1] == end


@register("blockwise")
class BlockwiseDecoder(Decoder):
    layout_family = "flat-causal"  # the base head trains on the sequential layout
    # Generation-only options: a trained model decodes with any value of these. (block_size fixes
    # the number of trained heads and freeze_backbone only affects training, so neither is here.)
    decode_options = ("top_k", "max_new_tokens")

    # The sequential layout, shared rather than copied: labels = s_1 <sep> ... s_m </s>.
    layout = SequentialDecoder.layout

    def __init__(self, backbone_config, special: SpecialTokens, block_size: int = 4,
                 freeze_backbone: bool = False, top_k: int = 1, max_new_tokens: int = 128):
        super().__init__(backbone_config, special)
        if block_size < 2:
            raise ValueError(f"decoder.block_size must be >= 2 (the base head plus at least one "
                             f"proposal head), got {block_size}")
        if top_k < 1:
            raise ValueError(f"decoder.top_k must be >= 1 (1 = exact acceptance), got {top_k}")
        if max_new_tokens < 1:
            raise ValueError(f"decoder.max_new_tokens must be >= 1, got {max_new_tokens}")
        self.block_size = int(block_size)
        self.freeze_backbone = bool(freeze_backbone)
        self.top_k = int(top_k)
        self.max_new_tokens = int(max_new_tokens)
        # heads[i] predicts token t + 2 + i from the decoder state at t
        self.heads = nn.ModuleList(ProposalHead(backbone_config.d_model, backbone_config.d_ff)
                                   for _ in range(self.block_size - 1))

    # ---- heads -------------------------------------------------------------------------------
    def proposal_logits(self, model, hidden: torch.Tensor) -> torch.Tensor:
        """(..., d_model) decoder states -> (..., k-1, vocab) logits of tokens t+2..t+k."""
        return torch.stack([output_logits(model, head(hidden)) for head in self.heads], dim=-2)

    # ---- training ----------------------------------------------------------------------------
    def loss(self, model, input_ids, attention_mask, layout):
        labels = layout["labels"]                                    # (B, T); -100 = ignored
        train_backbone = torch.is_grad_enabled() and not self.freeze_backbone
        with torch.set_grad_enabled(train_backbone):
            encoder_states = encode(model, input_ids, attention_mask)  # (B, S, d_model)
            hidden = model.decoder(input_ids=model._shift_right(labels),
                                   encoder_hidden_states=encoder_states,
                                   encoder_attention_mask=attention_mask).last_hidden_state  # (B, T, d)
            total = _cross_entropy(output_logits(model, hidden), labels)
        # With a frozen backbone the shared output projection must not learn through the heads
        # either: project with its weights detached (same computation as `output_logits`).
        projection = model if not self.freeze_backbone else _detached_projection(model)
        for i, head in enumerate(self.heads, start=1):
            # head i at position t predicts labels[t + i] (base head: labels[t])
            shifted = labels[:, i:]                                  # (B, T - i)
            valid = shifted != -100
            states = hidden[:, : shifted.size(1)][valid]             # (N, d_model): only scored positions
            total = total + _cross_entropy(output_logits(projection, head(states)), shifted[valid])
        return total

    # ---- generation --------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, model, input_ids, attention_mask):
        k, end, device = self.block_size, self.special.eos, input_ids.device
        batch_size = input_ids.size(0)
        encoder_states = encode(model, input_ids, attention_mask)   # (B, S, d_model), once
        cache = new_cache()
        rows = torch.arange(batch_size, device=device)              # original index of each live row
        # Per live row, every self-attention cache slot: its true position and whether it is alive
        # (rejected proposals stay in the cache, hidden, unless all rows can crop them).
        slot_pos = torch.zeros(batch_size, 0, dtype=torch.long, device=device)    # (live, K)
        slot_alive = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)  # (live, K)
        # The first call feeds only the start token b at position 0 (no proposals yet); every later
        # call feeds a block of k: [last accepted token, k-1 proposals].
        fed = torch.full((batch_size, 1), self.special.start, dtype=torch.long, device=device)  # (live, Q)
        fed_pos = torch.zeros(batch_size, 1, dtype=torch.long, device=device)                   # (live, Q)
        produced: list[list[int]] = [[] for _ in range(batch_size)]
        calls = [0] * batch_size
        ended = [False] * batch_size
        batch_calls = 0
        while True:
            key_pos = torch.cat([slot_pos, fed_pos], dim=1)          # (live, K + Q)
            key_alive = torch.cat([slot_alive, torch.ones_like(fed, dtype=torch.bool)], dim=1)
            distance = fed_pos[:, :, None] - key_pos[:, None, :]     # (live, Q, K + Q)
            visible = key_alive[:, None, :] & (distance >= 0)
            bias = relative_position_bias(model, distance.clamp(min=0))  # (live, heads, Q, K + Q)
            bias = bias + hidden_mask(visible, bias.dtype)
            hidden = run_decoder(model, fed, bias, encoder_states, attention_mask, cache)  # (live, Q, d)
            batch_calls += 1

            base_logits = output_logits(model, hidden)               # (live, Q, V)
            base_pred = base_logits.argmax(-1)                       # (live, Q) greedy token after each
            if fed.size(1) > 1:
                # the base head at fed position j judges the proposal fed at j + 1
                if self.top_k == 1:
                    candidates = base_pred[:, :-1, None]             # (live, k-1, 1): exact
                else:
                    candidates = base_logits[:, :-1].topk(
                        min(self.top_k, base_logits.size(-1)), dim=-1).indices  # (live, k-1, top_k)
                accepted = accepted_length(fed[:, 1:], candidates)   # (live,)
            else:
                accepted = torch.zeros(fed.size(0), dtype=torch.long, device=device)
            last = accepted[:, None]                                 # (live, 1): last accepted fed index
            base_next = base_pred.gather(1, last).squeeze(1)         # (live,) the base head's own token
            last_state = hidden.gather(1, last[:, :, None].expand(-1, -1, hidden.size(-1)))  # (live, 1, d)
            proposals = self.proposal_logits(model, last_state.squeeze(1)).argmax(-1)       # (live, k-1)

            finished = []
            for row, fed_row, n, nxt in zip(rows.tolist(), fed.tolist(), accepted.tolist(),
                                            base_next.tolist()):
                tokens, ended[row] = block_tokens(fed_row[1:], n, nxt, end,
                                                  self.max_new_tokens - len(produced[row]))
                produced[row].extend(tokens)
                calls[row] += 1
                finished.append(ended[row] or len(produced[row]) >= self.max_new_tokens)
            finished = torch.tensor(finished, device=device)

            # The fed slots join the cache: alive up to the last accepted one, rejected after it.
            slot_pos = torch.cat([slot_pos, fed_pos], dim=1)
            slot_alive = torch.cat(
                [slot_alive, torch.arange(fed.size(1), device=device)[None, :] <= last], dim=1)
            rejected = fed.size(1) - 1 - accepted                    # (live,) dead tail of this block
            # Next block: the base head's token right after the last accepted one, then proposals.
            fed = torch.cat([base_next[:, None], proposals], dim=1)  # (live, k)
            fed_pos = fed_pos.gather(1, last) + 1 + torch.arange(k, device=device)[None, :]
            if finished.all():
                break
            if finished.any():
                keep = (~finished).nonzero().squeeze(1)
                (encoder_states, attention_mask, rows, slot_pos, slot_alive, fed, fed_pos,
                 rejected) = drop_finished_rows(cache, keep, encoder_states, attention_mask, rows,
                                                slot_pos, slot_alive, fed, fed_pos, rejected)
            # The rejected tail every live row shares can leave the cache for good.
            crop = int(rejected.min())
            if crop:
                cache.crop(-crop)
                slot_pos, slot_alive = slot_pos[:, :-crop], slot_alive[:, :-crop]

        return DecodeOutput(
            subsequences=[split_on(p[:-1] if e else p, self.special.sep)
                          for p, e in zip(produced, ended)],
            decoder_calls=calls,
            tokens=[len(p) for p in produced],
            hit_max_steps=[not e for e in ended],
            batch_decoder_calls=batch_calls,
            # mean accepted tokens per call = accepted_tokens / blockwise_iterations
            #                                 (= sum(tokens) / sum(decoder_calls))
            stats={"accepted_tokens": float(sum(len(p) for p in produced)),
                   "blockwise_iterations": float(sum(calls))},
        )


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy ignoring -100; 0 (still connected to the graph) when nothing is
    scored, e.g. a head shifted past every target of a batch of short targets."""
    flat = labels.reshape(-1)
    summed = F.cross_entropy(at_least_float32(logits.reshape(flat.numel(), -1)), flat, ignore_index=-100,
                             reduction="sum")
    return summed / (flat != -100).sum().clamp(min=1)


def _detached_projection(model) -> SimpleNamespace:
    """A stand-in for `model` in `output_logits` whose `lm_head` uses detached weights, so gradients
    reach the heads but not the (frozen) shared output projection."""
    weights = {name: p.detach() for name, p in model.lm_head.named_parameters()}
    return SimpleNamespace(
        config=model.config,
        lm_head=lambda hidden: torch.func.functional_call(model.lm_head, weights, (hidden,)))
