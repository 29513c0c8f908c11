"""transformers' internals the decoders rely on, behind one door: what a transformers release
renames or reshapes breaks here first, and only here.

They hold for the transformers versions `pyproject.toml` allows (the suite runs on the installed
one, and the GPU tests ran on 5.17):
- T5's relative position bucketing (`T5Attention._relative_position_bucket`), which the decoders'
  own attention structures reuse so that their biases are T5's, and where a stack keeps its bias
  table (`bias_owner`: the first block's self-attention);
- the configuration's attention implementation (`PretrainedConfig._attn_implementation`), read to
  refuse one the decoders' structured attention cannot pass its mask to, and set when a backbone
  is built from a configuration;
- each family's module layout, which its adapter (`decoders/families/`) runs layer by layer:
  T5's block `layer` (self attention, cross attention, feed-forward), their `layer_norm` and
  `dropout`, an attention's `q`, `k`, `v`, `o`, `key_value_proj_dim` and `dropout`; BART's
  `layers`, `self_attn`, `encoder_attn`, `fc1`, `fc2`, their norms, `embed_positions` (and its
  `offset`), `embed_scale`, `layernorm_embedding`, `layer_norm` and `final_logits_bias`.
"""
from __future__ import annotations

import torch
from transformers.models.t5.modeling_t5 import T5Attention


def bias_owner(stack):
    """The T5Attention of a T5 stack (encoder or decoder) that owns the stack's relative-position
    bias table: the first block's self-attention; the other layers reuse the bias it computes."""
    return stack.block[0].layer[0].SelfAttention


def relative_position_buckets(attention, relative_position: torch.Tensor,
                              bidirectional: bool) -> torch.Tensor:
    """T5's bucket of each relative position (key - query), with the bucket count and distance of
    `attention` (a T5 or UMT5 attention that owns a bias table; UMT5's own bucketing method reads
    the direction from the stack, so T5's is called)."""
    return T5Attention._relative_position_bucket(
        relative_position, bidirectional=bidirectional,
        num_buckets=attention.relative_attention_num_buckets,
        max_distance=attention.relative_attention_max_distance)


def attention_implementation(config) -> str:
    """The attention implementation a model was built with ("eager", "sdpa", ...)."""
    return config._attn_implementation


def set_attention_implementation(config, implementation: str) -> None:
    """Build models from `config` with `implementation`."""
    config._attn_implementation = implementation

