"""BART and the families built like it (mBART, Pegasus, Marian): absolute positions, learned (BART
and mBART, stored two rows on) or sinusoidal (Pegasus, Marian), added to the scaled token
embeddings; norm after each sublayer (BART, Marian) or before it with a final norm (mBART,
Pegasus); an embedding norm (BART, mBART); scaled dot-product attention; the output projection
plus `final_logits_bias`. No relative-position bias: a position reaches the model as the fed
token's `positions`, and a decoder's bias tables hold only what each query may see."""
from __future__ import annotations

import torch
from torch import nn

from decoders.families import (Family, Sizes, at_positions, heads_at_positions, heads_of,
                               register_family, unchanged)

# The types whose layers norm before each sublayer (and the stack's output after the last).
NORM_FIRST = ("mbart", "pegasus")


@register_family
class BartFamily(Family):
    model_types = ("bart", "mbart", "pegasus", "marian")
    absolute_positions = True
    encoder_settings = ("vocab_size", "d_model", "encoder_layers", "encoder_attention_heads",
                        "encoder_ffn_dim", "activation_function", "max_position_embeddings",
                        "scale_embedding", "pad_token_id")

    def sizes(self, config):
        return Sizes(config.d_model, config.decoder_ffn_dim, config.decoder_attention_heads,
                     config.decoder_layers, config.init_std)

    def run_layers(self, model, input_ids, positions, position_embeddings, self_bias,
                   encoder_states, cross_mask, cache, slots, attend):
        decoder = model.get_decoder()
        dropout = _dropout(decoder)
        hidden = dropout(_embedded(decoder, input_ids, positions, position_embeddings))
        norm_first = model.config.model_type in NORM_FIRST
        for index, layer in enumerate(decoder.layers):
            # each sublayer: its norm before it (the residual left unnormed) or after the residual
            attention, norm = layer.self_attn, layer.self_attn_layer_norm
            normed = norm(hidden) if norm_first else hidden
            keys = heads_of(attention.k_proj(normed), attention.head_dim)
            values = heads_of(attention.v_proj(normed), attention.head_dim)
            if cache is not None:
                keys, values = cache.write(index, slots, keys, values)
            attended = attend(attention, heads_of(attention.q_proj(normed), attention.head_dim),
                              keys, values, self_bias, attention.scaling)
            hidden = hidden + dropout(attention.out_proj(attended))
            hidden = hidden if norm_first else norm(hidden)

            attention, norm = layer.encoder_attn, layer.encoder_attn_layer_norm
            keys, values = self.encoder_keys_values(model, index, encoder_states, cache)
            normed = norm(hidden) if norm_first else hidden
            attended = attend(attention, heads_of(attention.q_proj(normed), attention.head_dim),
                              keys, values, cross_mask, attention.scaling)
            hidden = hidden + dropout(attention.out_proj(attended))
            hidden = hidden if norm_first else norm(hidden)

            hidden = _feed_forward(layer, hidden, norm_first, dropout)
        return _final_normed(decoder, hidden)

    def encodes_real_tokens(self, config):
        return True

    def run_encoder(self, model, input_ids, padding_mask, real, attend):
        # the same operations as the family's encoder and its layers, in the same order; the
        # states of the real tokens alone (N, d_model) between the attentions
        encoder = model.get_encoder()
        batch, length = input_ids.shape
        dropout = _dropout(encoder)
        # each source's positions count from its row's start
        hidden = dropout(_embedded(encoder, input_ids.flatten()[real], real % length))
        norm_first = model.config.model_type in NORM_FIRST
        for layer in encoder.layers:
            attention, norm = layer.self_attn, layer.self_attn_layer_norm
            normed = norm(hidden) if norm_first else hidden
            query, keys, values = (
                heads_at_positions(projection(normed), real, batch, length, attention.head_dim)
                for projection in (attention.q_proj, attention.k_proj, attention.v_proj))
            attended = attend(attention, query, keys, values, padding_mask,
                              attention.scaling).flatten(0, 1)[real]
            hidden = hidden + dropout(attention.out_proj(attended))
            hidden = hidden if norm_first else norm(hidden)

            hidden = _clamped_in_float16(_feed_forward(layer, hidden, norm_first, dropout),
                                         always=norm_first)
        return at_positions(_final_normed(encoder, hidden), real, batch, length)

    def cross_keys_values(self, model, layer, encoder_states):
        attention = model.get_decoder().layers[layer].encoder_attn
        return (heads_of(attention.k_proj(encoder_states), attention.head_dim),
                heads_of(attention.v_proj(encoder_states), attention.head_dim))

    def output_logits(self, model, hidden):
        return model.lm_head(hidden) + model.final_logits_bias.to(hidden.dtype)


def _embedded(stack, input_ids: torch.Tensor, positions: torch.Tensor,
              added: torch.Tensor | None = None) -> torch.Tensor:
    """A stack's token embeddings, scaled, plus its position embeddings at `positions` and `added`
    where given, through its embedding norm where it has one (BART, mBART): a scaled embedding
    module (BART, mBART) or a scale kept beside it (Pegasus, Marian); learned positions stored two
    rows on (BART, mBART) or sinusoidal ones (Pegasus, Marian)."""
    table = stack.embed_positions
    embedded = (stack.embed_tokens(input_ids) * getattr(stack, "embed_scale", 1.0)
                + nn.functional.embedding(positions + getattr(table, "offset", 0), table.weight))
    if added is not None:
        embedded = embedded + added
    norm = getattr(stack, "layernorm_embedding", None)
    return embedded if norm is None else norm(embedded)


def _dropout(stack):
    """The stack's dropout on its states: none outside training."""
    if not stack.training:
        return unchanged
    return lambda hidden: nn.functional.dropout(hidden, stack.dropout, True)


def _final_normed(stack, hidden: torch.Tensor) -> torch.Tensor:
    """The stack's output: through its final norm where it has one (mBART, Pegasus)."""
    norm = getattr(stack, "layer_norm", None)
    return hidden if norm is None else norm(hidden)


def _feed_forward(layer, hidden: torch.Tensor, norm_first: bool, dropout) -> torch.Tensor:
    """A layer's feed-forward sublayer with its residual, normed before it or after the residual."""
    norm = layer.final_layer_norm
    normed = norm(hidden) if norm_first else hidden
    inner = layer.activation_fn(layer.fc1(normed))
    if layer.training:
        inner = nn.functional.dropout(inner, layer.activation_dropout, True)
    hidden = hidden + dropout(layer.fc2(inner))
    return hidden if norm_first else norm(hidden)


def _clamped_in_float16(hidden: torch.Tensor, always: bool) -> torch.Tensor:
    """An encoder layer's guard on float16 states: clamped a little below the largest float16,
    by the norm-first layers always, by the others only where some state is not finite."""
    if hidden.dtype != torch.float16:
        return hidden
    largest = torch.finfo(torch.float16).max
    if always:
        return torch.clamp(hidden, min=-(largest - 1000), max=largest - 1000)
    bound = torch.where(torch.isfinite(hidden).all(), largest, largest - 1000).to(hidden.dtype)
    return torch.clamp(hidden, min=-bound, max=bound)
