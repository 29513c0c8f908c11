"""T5 and its kin (T5 v1.1 and Flan-T5, mT5, LongT5, whose encoder differs and decoder does not): relative-position buckets of
learned biases, shared by the stack's layers, no absolute positions; norm before each sublayer;
unscaled dot-product attention; with tied embeddings the final states scaled by d_model ** -0.5."""
from __future__ import annotations

import torch

from decoders.families import (Family, Sizes, at_positions, heads_at_positions, heads_of,
                               register_family, unchanged)
from decoders.transformers_internals import bias_owner, relative_position_buckets


@register_family
class T5Family(Family):
    model_types = ("t5", "mt5", "longt5")   # LongT5: its own encoder, T5's decoder
    dropout_setting = "dropout_rate"
    encoder_settings = ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads",
                        "relative_attention_num_buckets", "relative_attention_max_distance",
                        "layer_norm_epsilon", "feed_forward_proj")

    def sizes(self, config):
        return Sizes(config.d_model, config.d_ff, config.num_heads, config.num_decoder_layers,
                     config.initializer_factor)

    def position_bias(self, model, distance, bidirectional):
        # T5's own bucketing, and the first decoder layer's table (only layer 0 owns one)
        attention = bias_owner(model.decoder)
        buckets = relative_position_buckets(attention, -distance, bidirectional)
        return attention.relative_attention_bias(buckets).permute(0, 3, 1, 2)

    def bias_embedding(self, model):
        return bias_owner(model.decoder).relative_attention_bias

    def run_layers(self, model, input_ids, positions, position_embeddings, self_bias,
                   encoder_states, cross_mask, cache, slots, attend):
        # the same operations as `T5Block.forward`, in the same order
        decoder = model.decoder
        embedded = decoder.embed_tokens(input_ids)
        if position_embeddings is not None:
            embedded = embedded + position_embeddings
        # dropout only where it drops anything: each module call costs a decoding loop more than its op
        dropout = decoder.dropout if decoder.training else unchanged
        hidden = dropout(embedded)
        buckets = self.layer_buckets(model, positions, cache, slots)
        for layer, block in enumerate(decoder.block):
            self_attention, cross_attention, feed_forward = block.layer
            attention = self_attention.SelfAttention
            width = attention.key_value_proj_dim
            normed = self_attention.layer_norm(hidden)
            keys, values = heads_of(attention.k(normed), width), heads_of(attention.v(normed), width)
            if cache is not None:
                keys, values = cache.write(layer, slots, keys, values)
            bias = self_bias if buckets is None else (
                self_bias + attention.relative_attention_bias(buckets).permute(0, 3, 1, 2))
            attended = attend(attention, heads_of(attention.q(normed), width), keys, values,
                              bias, 1.0)
            hidden = _finite(hidden + dropout(attention.o(attended)))

            attention = cross_attention.EncDecAttention
            keys, values = self.encoder_keys_values(model, layer, encoder_states, cache)
            normed = cross_attention.layer_norm(hidden)
            attended = attend(attention, heads_of(attention.q(normed), width), keys, values,
                              cross_mask, 1.0)
            hidden = _finite(hidden + dropout(attention.o(attended)))
            dense = feed_forward.DenseReluDense
            hidden = _finite(hidden + dropout(dense(feed_forward.layer_norm(hidden))))
        return dropout(decoder.final_layer_norm(hidden))

    def encodes_real_tokens(self, config):
        return config.model_type != "longt5"   # LongT5's encoder attends locally, in blocks

    def run_encoder(self, model, input_ids, padding_mask, real, attend):
        # the same operations as `T5Stack.forward` in the encoder, in the same order; the states
        # of the real tokens alone (N, d_model) between the attentions
        encoder = model.encoder
        batch, length = input_ids.shape
        dropout = encoder.dropout if encoder.training else unchanged
        hidden = dropout(encoder.embed_tokens(input_ids.flatten()[real]))
        bias = None
        for block in encoder.block:
            self_attention, feed_forward = block.layer[0], block.layer[-1]
            attention = self_attention.SelfAttention
            width = attention.key_value_proj_dim
            if bias is None or attention.has_relative_attention_bias:   # T5: layer 0's; UMT5: each
                bias = attention.compute_bias(length, length) + padding_mask   # (B, heads, S, S)
            normed = self_attention.layer_norm(hidden)
            query, keys, values = (heads_at_positions(projection(normed), real, batch, length, width)
                                   for projection in (attention.q, attention.k, attention.v))
            attended = attend(attention, query, keys, values, bias, 1.0).flatten(0, 1)[real]
            hidden = _finite(hidden + dropout(attention.o(attended)))
            dense = feed_forward.DenseReluDense
            hidden = _finite(hidden + dropout(dense(feed_forward.layer_norm(hidden))))
        return at_positions(dropout(encoder.final_layer_norm(hidden)), real, batch, length)

    def cross_keys_values(self, model, layer, encoder_states):
        attention = model.decoder.block[layer].layer[1].EncDecAttention
        width = attention.key_value_proj_dim
        return (heads_of(attention.k(encoder_states), width),
                heads_of(attention.v(encoder_states), width))

    def layer_buckets(self, model, positions, cache, slots) -> torch.Tensor | None:
        """The relative-position buckets (B, Q, keys) each layer's own bias table is read at; None
        where the stack's one bias is in the decoder's tables already (T5)."""
        return None

    def output_logits(self, model, hidden):
        # T5 with tied embeddings rescales (skipping it changes the argmax); mT5's forward never does
        if getattr(model.config, "scale_decoder_outputs", False):
            hidden = hidden * (model.config.d_model ** -0.5)
        return model.lm_head(hidden)


def _finite(hidden: torch.Tensor) -> torch.Tensor:
    """T5Block's guard after each sublayer: float16 states are clamped below infinity."""
    if hidden.dtype != torch.float16:
        return hidden
    largest = torch.finfo(torch.float16).max
    clamp = torch.where(torch.isinf(hidden).any(), largest - 1000, largest)
    return torch.clamp(hidden, min=-clamp, max=clamp)


@register_family
class UMT5Family(T5Family):
    """UMT5: T5's layers, each with a relative-position bias table of its own. The decoders' bias
    tables hold only what each query may see (as for absolute positions); each layer adds its own
    bias of the distance between a fed token's position and each key's, which the cache keeps
    (`decoders.cache.DecoderCache.write_positions`)."""

    model_types = ("umt5",)
    absolute_positions = True
    caches_positions = True

    # `Family.position_bias` and `bias_embedding`: zero tables, kept with the token embedding
    position_bias = Family.position_bias
    bias_embedding = Family.bias_embedding

    def layer_buckets(self, model, positions, cache, slots):
        keys = positions if cache is None else cache.write_positions(slots, positions)  # (B or 1, K)
        # the decoder's buckets: a key after its query (a relative position > 0) is bucket 0
        return relative_position_buckets(bias_owner(model.decoder),
                                         keys[:, None, :] - positions[:, :, None], False)
