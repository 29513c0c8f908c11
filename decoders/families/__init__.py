"""Backbone families: one adapter per encoder–decoder family, chosen from a model's configuration.

Every decoder reaches its backbone through `decoders.backbone`, which asks `family_of(config)` for
the adapter of the model's type; decoders never name a family. An adapter says:
- the sizes a decoder's own modules are built to (`Sizes`);
- how a distance between two output positions biases attention: T5 learns a bias per bucket of
  relative distance, shared by the stack's layers (`position_bias`); families with absolute
  positions bias nothing there and read each fed token's position instead (`absolute_positions`);
- how its decoder layers run over a cache written at given slots (`run_layers`), how each layer
  projects the encoder's states to its cross-attention keys and values (`cross_keys_values`),
  and how the final states become logits (`output_logits`);
- which settings its encoder's output depends on (`encoder_settings`), and, where it runs the
  encoder itself (`encodes_real_tokens`), how its encoder layers run with the padding left out of
  the position-wise layers (`run_encoder`).
The decoder's start token is the configuration's `decoder_start_token_id` in every family.
"""
from __future__ import annotations

import abc
from typing import Callable, ClassVar, NamedTuple

import torch
from torch import nn

from decoders.cache import DecoderCache, Slots


class Sizes(NamedTuple):
    """The sizes of a backbone's decoder that a decoder's own modules are built to."""

    d_model: int      # hidden size
    d_ff: int         # feed-forward inner size
    heads: int        # self-attention heads
    layers: int       # decoder layers
    init_std: float   # the spread the family initialises its embeddings with


class Family(abc.ABC):
    """The adapter of one family of encoder–decoder models (module docstring)."""

    model_types: ClassVar[tuple[str, ...]] = ()   # `config.model_type`s it runs
    absolute_positions: ClassVar[bool] = False    # whether `run_layers` reads `positions`
    caches_positions: ClassVar[bool] = False      # whether its cache keeps each key's position
    encoder_settings: ClassVar[tuple[str, ...]] = ()
    dropout_setting: ClassVar[str] = "dropout"      # the configuration's dropout probability

    @abc.abstractmethod
    def sizes(self, config) -> Sizes:
        raise NotImplementedError

    def position_bias(self, model, distance: torch.Tensor, bidirectional: bool) -> torch.Tensor:
        """distance: (B, queries, keys) ints, how far each key lies in the past of each query
        (negative: in its future) -> (B, heads, queries, keys) self-attention bias: zeros in a
        family whose positions reach its layers otherwise (`absolute_positions`)."""
        heads = self.sizes(model.config).heads
        return self.bias_embedding(model).weight.new_zeros(distance.size(0), heads, *distance.shape[1:])

    def bias_embedding(self, model) -> nn.Embedding:
        """The embedding whose weight `position_bias` reads: tables made from the bias are kept
        while that weight keeps its values (`backbone.made_from_bias_weight`). Where no table reads
        a weight, the decoder's token embedding, which they are kept with."""
        return model.get_decoder().embed_tokens

    @abc.abstractmethod
    def run_layers(self, model, input_ids: torch.Tensor, positions: torch.Tensor | None,
                   position_embeddings: torch.Tensor | None, self_bias: torch.Tensor,
                   encoder_states: torch.Tensor, cross_mask: torch.Tensor,
                   cache: DecoderCache | None, slots: Slots | None, attend: Callable) -> torch.Tensor:
        """The decoder stack on fed tokens (B, Q) -> final hidden states (B, Q, d_model), as
        `backbone.run_decoder` describes; `attend(attention, query, key, value, added, scale)`."""
        raise NotImplementedError

    @abc.abstractmethod
    def cross_keys_values(self, model, layer: int,
                          encoder_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder layer `layer`'s cross-attention keys and values of the encoder's states
        (B, S, d_model) -> (B, heads, S, d_kv) each."""
        raise NotImplementedError

    def encodes_real_tokens(self, config) -> bool:
        """Whether `run_encoder` runs this model's encoder."""
        return False

    def run_encoder(self, model, input_ids: torch.Tensor, padding_mask: torch.Tensor,
                    real: torch.Tensor, attend: Callable) -> torch.Tensor:
        """The encoder stack on sources (B, S) -> its states (B, S, d_model), zeros at the padding,
        its position-wise layers (norms, projections, feed-forward) run on the real tokens alone:
        `real` (N,) their flat positions in (B * S), `padding_mask` (B, 1, 1, S) the additive mask
        of the padding; `attend` as in `run_layers`. Where `encodes_real_tokens`."""
        raise NotImplementedError(f"{type(self).__name__} runs no encoder of its own")

    def encoder_keys_values(self, model, layer: int, encoder_states: torch.Tensor,
                            cache: DecoderCache | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`cross_keys_values`, kept in the cache at a decode's first call and read after."""
        kept = None if cache is None else cache.encoder_part(layer)
        if kept is not None:
            return kept
        keys, values = self.cross_keys_values(model, layer, encoder_states)
        if cache is not None:
            cache.keep_encoder_part(layer, keys, values)
        return keys, values

    @abc.abstractmethod
    def output_logits(self, model, hidden: torch.Tensor) -> torch.Tensor:
        """Final decoder states (..., d_model) -> vocabulary logits, as the model's forward."""
        raise NotImplementedError


FAMILIES: dict[str, Family] = {}


def register_family(family: type[Family]) -> type[Family]:
    for model_type in family.model_types:
        FAMILIES[model_type] = family()
    return family


def running_model_types() -> tuple[str, ...]:
    """Every model type some family runs."""
    return tuple(FAMILIES)


def family_of(config) -> Family:
    """The adapter of `config`'s model type; a ValueError naming it and the types that run."""
    family = FAMILIES.get(config.model_type)
    if family is None:
        raise ValueError(f"the decoders do not run {config.model_type!r} models; they run these "
                         f"model types: {', '.join(FAMILIES)}")
    return family


def at_positions(states: torch.Tensor, real: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """States of a batch's real tokens (N, width), at their flat positions `real` (N,) of
    (batch * length), -> (batch, length, width), zeros at the padding."""
    padded = states.new_zeros(batch * length, states.size(-1)).index_copy(0, real, states)
    return padded.view(batch, length, -1)


def heads_at_positions(states: torch.Tensor, real: torch.Tensor, batch: int, length: int,
                       head_dim: int) -> torch.Tensor:
    """The projections of a batch's real tokens (N, heads * head_dim) `at_positions`, as heads:
    (batch, heads, length, head_dim), zeros at the padding."""
    return heads_of(at_positions(states, real, batch, length), head_dim)


def heads_of(projected: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(B, T, heads * head_dim) -> (B, heads, T, head_dim)."""
    return projected.view(*projected.shape[:2], -1, head_dim).transpose(1, 2)


def unchanged(hidden: torch.Tensor) -> torch.Tensor:
    """Dropout outside training: the states as they are."""
    return hidden


def _import_families() -> None:
    # each registers itself; T5's first, the order messages list the model types in
    from decoders.families import t5  # noqa: F401
    from decoders.families import bart  # noqa: F401


_import_families()
