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
    Draft and verify (`decoders/drafts.py`), the heads drafting: feed the block [y_t, q_{t+1}, ..,
    q_{t+k-1}] (last accepted token, k-1 proposals); accept the longest prefix of proposals on which
    the base head's argmax agrees, then append the base head's own token after the last accepted
    position; the heads at that same position give the next block's proposals (all k-1 heads as one
    matmul and one batched matmul, `proposal_logits`). Every iteration yields 1..k tokens and the
    output is exactly sequential greedy decoding of the base head. `top_k` > 1 is the paper's
    approximate acceptance (Section 5): a proposal passes if it is among the base head's top-k
    tokens there (faster, no longer exact). Generation stops at the end token (later tokens of the
    block are discarded) or at `max_new_tokens`. Batching, the cache and host syncs: drafts.py.
Measured (`min_acceptance` null, the default). A call feeds the proposals while the tokens they
    are expected to get accepted pay for their measured cost, and a decode is sequential decoding
    of the base head where that was measured faster per output token (`draft_policy.LoopChoice`):
    the heads cost every call, and a wide call costs more per row at larger batch sizes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from decoders import register
from datamodules.vocabulary import Range, SpecialTokens
from decoders.base import OUTPUT_BOUND, Option
from decoders.backbone import (at_least_float32, encode, output_logits, sizes, teacher_forced_states,
                               with_frozen_weights)
from decoders.draft_policy import DRAFT_LENGTH, MEASURED_MIN_ACCEPTANCE
from decoders.drafts import Draft, DraftAndVerifyDecoder, Verified
from decoders.sequential import SequentialDecoder


class ProposalHeads(nn.Module):
    """The k-1 proposal heads, head i being h + W2_i relu(W1_i h): one residual feed-forward layer
    on the decoder's final hidden state. Their weights are kept stacked, each in nn.Linear's layout:
    W1 as ((k-1) d_ff, d_model) and W2 as (k-1, d_model, d_ff), so that decoding runs every head at
    once (one matmul and one batched matmul) on the weights themselves: stacking copies per decode
    would cost a decode 2 (k-1) d_model d_ff numbers of memory and their copying (25 MB at
    t5-small's size)."""

    def __init__(self, count: int, d_model: int, d_ff: int):
        super().__init__()
        # Each head's two layers are drawn as nn.Linear draws them, head after head, so that a
        # seed gives the heads it gave when they were separate layers. Zero W2: every head starts
        # as an exact copy of the base head's input, so training begins from the base head's
        # predictions instead of noise. W1 still gets gradients after the first step (through
        # W2), as in a residual adapter.
        drawn = [(nn.Linear(d_model, d_ff, bias=False).weight, nn.Linear(d_ff, d_model, bias=False))
                 for _ in range(count)]
        self.w1 = nn.Parameter(torch.cat([w1.detach() for w1, _ in drawn]))      # ((k-1) d_ff, d_model)
        self.w2 = nn.Parameter(torch.zeros(count, d_model, d_ff))                # (k-1, d_model, d_ff)
        self.register_load_state_dict_pre_hook(_stack_separate_heads)

    def __len__(self) -> int:
        return self.w2.size(0)

    def head(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        """Head i (0-based) on (..., d_model) states."""
        d_ff = self.w2.size(-1)
        inner = torch.relu(F.linear(hidden, self.w1[i * d_ff: (i + 1) * d_ff]))
        return hidden + F.linear(inner, self.w2[i])


def _stack_separate_heads(module, state_dict, prefix, *args) -> None:
    """Reads a checkpoint that stored one pair of layers per head (`heads.{i}.w1.weight`,
    `heads.{i}.w2.weight`) as the stacked weights."""
    separate = [f"{prefix}{i}.w1.weight" for i in range(len(module))]
    if f"{prefix}w1" in state_dict or not all(key in state_dict for key in separate):
        return
    state_dict[f"{prefix}w1"] = torch.cat([state_dict.pop(key) for key in separate])
    state_dict[f"{prefix}w2"] = torch.stack([state_dict.pop(f"{prefix}{i}.w2.weight")
                                             for i in range(len(module))])


@register("blockwise")
class BlockwiseDecoder(DraftAndVerifyDecoder[None]):
    layout_family = "flat-causal"  # the base head trains on the sequential layout
    # Stern et al. add the heads to a trained model; with the backbone frozen the output is its own.
    builds_on_sequential = True

    # The sequential layout, shared rather than copied: labels = s_1 <sep> ... s_m </s>.
    layout = SequentialDecoder.layout

    # block_size fixes the number of trained heads and freeze_backbone only affects training; a
    # trained model decodes with any value of the others.
    options = {"block_size": Option(4, Range(ge=2, note="the base head plus at least one proposal "
                                                        "head")),
               "freeze_backbone": Option(False),
               "top_k": Option(1, Range(ge=1, note="1 = exact acceptance"), decode_only=True),
               "max_new_tokens": OUTPUT_BOUND,
               "draft_length": DRAFT_LENGTH,
               "min_acceptance": MEASURED_MIN_ACCEPTANCE}

    def __init__(self, backbone_config, special: SpecialTokens, **options):
        super().__init__(backbone_config, special, **options)
        # head i (0-based) predicts token t + 2 + i from the decoder state at t
        size = sizes(backbone_config)
        self.heads = ProposalHeads(self.block_size - 1, size.d_model, size.d_ff)

    # ---- heads -------------------------------------------------------------------------------
    def proposal_logits(self, model, hidden: torch.Tensor) -> torch.Tensor:
        """(live, d_model) decoder states -> (live, k-1, vocab) logits of tokens t+2..t+k: every
        head at once, on the stacked weights (`ProposalHeads`)."""
        heads = self.heads
        inner = torch.relu_(hidden @ heads.w1.T).view(len(hidden), len(heads), -1)  # (live, k-1, d_ff)
        states = torch.bmm(inner.transpose(0, 1), heads.w2.transpose(1, 2)) + hidden  # (k-1, live, d_model)
        return output_logits(model, states).transpose(0, 1)

    # ---- training ----------------------------------------------------------------------------
    def trains_backbone(self) -> bool:
        return not self.freeze_backbone

    def loss(self, model, input_ids, attention_mask, layout):
        labels = layout["labels"]                                    # (B, T); -100 = ignored
        train_backbone = torch.is_grad_enabled() and not self.freeze_backbone
        with torch.set_grad_enabled(train_backbone):
            encoder_states = encode(model, input_ids, attention_mask)  # (B, S, d_model)
            hidden = teacher_forced_states(model, labels, encoder_states, attention_mask)  # (B, T, d)
            total = _cross_entropy(output_logits(model, hidden), labels)
        for i in range(1, len(self.heads) + 1):
            # head i at position t predicts labels[t + i] (base head: labels[t])
            shifted = labels[:, i:]                                  # (B, T - i)
            valid = shifted != -100
            states = self.heads.head(i - 1, hidden[:, : shifted.size(1)][valid])  # (N, d_model): only scored positions
            # With a frozen backbone the shared output projection must not learn through the heads
            # either: project with the model's weights detached.
            logits = (with_frozen_weights(model, output_logits, states) if self.freeze_backbone
                      else output_logits(model, states))
            total = total + _cross_entropy(logits, shifted[valid])
        return total

    # ---- generation: draft and verify, the heads draft ------------------------------------------
    @property
    def draft_width(self) -> int:
        return self.block_size - 1

    def draft(self, model, state: None, verified: Verified, host) -> Draft:
        return Draft(self.proposal_logits(model, verified.hidden).argmax(-1), offered=None)


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy ignoring -100; 0 (still connected to the graph) when nothing is
    scored, e.g. a head shifted past every target of a batch of short targets."""
    flat = labels.reshape(-1)
    summed = F.cross_entropy(at_least_float32(logits.reshape(flat.numel(), -1)), flat, ignore_index=-100,
                             reduction="sum")
    return summed / (flat != -100).sum().clamp(min=1)
