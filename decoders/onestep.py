"""One-step decoder: a frozen sequential T5 writes the whole target in ONE decoder call, from two
proto-token embeddings that a small learned encoder predicts.

Reference: Mezentsev & Oseledets, "Exploring the Hidden Capacity of LLMs for One-Step Text
Generation" (shared/papers/001_5664f3ae68b6ae6c.txt), Sections 3-4: a frozen causal language model
reconstructs a text in one forward pass when its input embeddings are `[e, m, m, ..., m]` (as long
as the text), under its ordinary causal mask, output position i trained to be token i; two
proto-tokens are essential, `m` can be shared by all texts while `e` carries the content.

Here the model is an encoder-decoder: the proto-tokens replace the *decoder's* input embeddings and
the decoder still cross-attends to the encoded context.

Backbone. A trained sequential (flat layout) T5 (`train.init_from=<sequential checkpoint>`), always
    frozen: it gets no gradient and its weights stay bit-identical (the encoder runs under no_grad,
    the decoder and output head with detached weights, so gradients reach only the proto-tokens;
    as blockwise's `freeze_backbone`). There is no switch: unfrozen, this would be another model.
Proto-tokens. e = embed(b) + MLP(masked mean of the encoder states) (d_model -> d_ff -> d_model;
    the MLP's last layer starts at zero, so training starts from e = b, i.e. from the sequential
    model's own first step at position 0); m = embed(b) + a learned offset, shared by all examples.
Layout. The sequential one: labels = s_1 <sep> ... s_m </s> (`join_subsequences`).
Loss. Cross-entropy of position i's logits against label i, positions past the target ignored.
Decode. One decoder call on [e, m x (max_new_tokens - 1)] under T5's causal relative bias
    (`past_distance_bias_table`); the argmax at every position; the output is the tokens up to the
    first end token, split at separators (`split_flat_output`), read back to the host once.
    Under the causal mask position i sees inputs 0..i only, so a position's output does not depend
    on `max_new_tokens`: it only cuts the output, and is a decode-time option.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from decoders import register
from datamodules.vocabulary import SpecialTokens
from decoders.backbone import (at_least_float32, encode, hidden_mask, masked_mean, output_logits,
                               past_distance_bias_table, run_decoder, sizes,
                               with_frozen_weights)
from decoders.base import OUTPUT_BOUND, Decoder
from decoders.loop import flat_decode_output, read_back, through_end
from decoders.sequential import SequentialDecoder


def causal_bias(model, width: int) -> torch.Tensor:
    """T5's own decoder self-attention structure for `width` positions: relative bias of the past
    distance q - k plus a mask hiding the future. -> (1, heads, width, width)."""
    table = past_distance_bias_table(model, width - 1)                        # (width, heads)
    positions = torch.arange(width, device=table.device)
    distance = positions[:, None] - positions[None, :]                        # (queries, keys)
    bias = table[distance.clamp(min=0)].permute(2, 0, 1)[None]                # (1, heads, W, W)
    return bias + hidden_mask((distance >= 0)[None], bias.dtype)


def one_pass_logits(model, start: int, offsets: torch.Tensor, encoder_states: torch.Tensor,
                    encoder_mask: torch.Tensor, run: Callable = run_decoder) -> torch.Tensor:
    """The decoder's vocabulary logits (B, W, V) in ONE call whose input embeddings are
    embed(start) + offsets[:, i] at position i, under the causal structure.

    offsets: (B, W, d_model); encoder_states: (B, S, d_model); encoder_mask: (B, S) 1/0.
    `run_decoder` embeds token ids and adds `position_embeddings` to them, so feeding the start
    token everywhere with the offsets as position embeddings gives arbitrary input embeddings
    through its exact code path (the same sdpa-safe mask handling as every other decoder). `run`
    runs the blocks: `run_decoder`, or a decoder's `model_step`.
    """
    batch, width = offsets.shape[:2]
    ids = torch.full((batch, width), start, dtype=torch.long, device=offsets.device)
    positions = torch.arange(width, device=offsets.device)[None]      # (1, W)
    hidden = run(model, ids, causal_bias(model, width), encoder_states, encoder_mask,
                 positions=positions, position_embeddings=offsets)     # (B, W, d_model)
    return output_logits(model, hidden)


class ProtoTokenEncoder(nn.Module):
    """Encoder states -> the offset of the content proto-token e from the start token's embedding:
    masked mean pooling, then d_model -> d_ff -> d_model (ReLU)."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff)
        self.w2 = nn.Linear(d_ff, d_model)
        # Zero output layer: e starts as the start token's embedding, so position 0 begins by
        # predicting what the sequential model's first step predicts instead of noise; w1 learns
        # from the first step on through w2 (as a residual adapter).
        nn.init.zeros_(self.w2.weight)
        nn.init.zeros_(self.w2.bias)

    def forward(self, encoder_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, S, d_model), (B, S) 1/0 -> (B, d_model). The mean ignores padding, so an example's
        e does not depend on the batch it is decoded in."""
        pooled = masked_mean(encoder_states, attention_mask)                        # (B, d_model)
        return self.w2(torch.relu(self.w1(pooled)))


@register("onestep")
class OneStepDecoder(Decoder):
    # Its backbone is a sequential model's, untouched, so the sequential decoder (and blockwise,
    # given heads) can decode an onestep checkpoint; the converse is `can_decode_checkpoint_of`.
    layout_family = "flat-causal"
    # The backbone is a trained sequential model's, always frozen: only the proto-tokens learn.
    builds_on_sequential = True
    needs_trained_backbone = True

    # The sequential layout, shared rather than copied: labels = s_1 <sep> ... s_m </s>.
    layout = SequentialDecoder.layout

    # Position i's output depends on inputs 0..i only (causal), so the output bound (the positions
    # of the one decoder call, end token included) only cuts the output: a decode-only option.
    options = {"max_new_tokens": OUTPUT_BOUND}

    def __init__(self, backbone_config, special: SpecialTokens, **options):
        super().__init__(backbone_config, special, **options)
        size = sizes(backbone_config)
        self.proto_encoder = ProtoTokenEncoder(size.d_model, size.d_ff)
        # m - embed(b): random, at the scale of the backbone's embedding init, so that m differs from e
        # from the start (with m = e every input is the same vector and every position, attending
        # to identical values, would get the same state and the same token)
        self.m_offset = nn.Parameter(torch.randn(size.d_model) * size.init_std)

    @classmethod
    def can_decode_checkpoint_of(cls, trained: type[Decoder]) -> bool:
        # The proto-token encoder and m are trained only by this decoder: a sequential checkpoint
        # has the right backbone but not them (train one with train.init_from=<it> instead).
        return issubclass(trained, cls)

    def calls_for_output(self, subsequences):
        return 1  # whatever the output, as long as it fits max_new_tokens

    def offsets(self, encoder_states: torch.Tensor, attention_mask: torch.Tensor,
                width: int) -> torch.Tensor:
        """The proto-token input [e, m, ..., m] of `width` positions, as offsets from the start
        token's embedding: (B, S, d_model), (B, S) -> (B, width, d_model)."""
        e = self.proto_encoder(encoder_states, attention_mask)                   # (B, d_model)
        m = self.m_offset.to(e.dtype).expand(e.size(0), width - 1, -1)           # (B, W-1, d_model)
        return torch.cat([e[:, None], m], dim=1)

    def trains_backbone(self) -> bool:
        return False

    def loss(self, model, input_ids, attention_mask, layout):
        labels = layout["labels"]                                                # (B, T); -100 ignored
        with torch.no_grad():  # frozen encoder: only the proto-token encoder after it learns
            encoder_states = encode(model, input_ids, attention_mask)           # (B, S, d_model)
        offsets = self.offsets(encoder_states, attention_mask, labels.size(1))  # (B, T, d_model)
        logits = with_frozen_weights(model, one_pass_logits, self.special.start, offsets,
                                     encoder_states, attention_mask)            # (B, T, V)
        return F.cross_entropy(at_least_float32(logits).flatten(0, 1), labels.flatten(),
                               ignore_index=-100)

    @torch.no_grad()
    def generate(self, model, input_ids, attention_mask):
        batch_size = input_ids.size(0)
        encoder_states = self.encoder_pass()(model, input_ids, attention_mask)  # (B, S, d_model)
        offsets = self.offsets(encoder_states, attention_mask, self.max_new_tokens)  # (B, W, d_model)
        tokens = one_pass_logits(model, self.special.start, offsets, encoder_states, attention_mask,
                                 self.model_step()).argmax(-1)                   # (B, W)
        rows, = read_back(tokens)                                                # the one sync point
        # tokens produced: up to and including the end token (what follows it is discarded)
        produced = [through_end(row, self.special.eos) for row in rows]
        return flat_decode_output(produced, self.special, [1] * batch_size, 1)
