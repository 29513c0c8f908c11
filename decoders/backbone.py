"""The T5 calls every decoder shares: the encoder once per batch, the output head, T5's decoder
blocks run with a custom self-attention structure over a cache written at given slots
(`decoders.cache`), and a function of the model run with its weights detached."""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Collection, Hashable, NamedTuple

import torch
from torch import nn
from transformers import T5ForConditionalGeneration

from decoders.cache import DecoderCache, Slots
from decoders.transformers_internals import attention_implementation, bias_owner, relative_position_buckets


def encode(model: T5ForConditionalGeneration, input_ids: torch.Tensor,
           attention_mask: torch.Tensor) -> torch.Tensor:
    """Run the encoder once per batch; every decoder call reuses its output `(B, source_len, d_model)`."""
    return model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def encoder_weights(model: T5ForConditionalGeneration) -> set[nn.Parameter]:
    """The parameters the encoder's output depends on: its blocks and the token embeddings, which T5
    shares with its decoder's input and (tied) output projection."""
    return set(model.get_encoder().parameters())


# The settings besides its weights that an encoder's output depends on (transformers T5Config).
ENCODER_SETTINGS = ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads",
                    "relative_attention_num_buckets", "relative_attention_max_distance",
                    "layer_norm_epsilon", "feed_forward_proj")


def same_encoder(model: T5ForConditionalGeneration, other: T5ForConditionalGeneration) -> bool:
    """Whether two backbones encode every source alike: the same encoder settings and attention
    implementation, and equal encoder weights (token embeddings included) of one dtype."""
    if any(getattr(model.config, name) != getattr(other.config, name) for name in ENCODER_SETTINGS):
        return False
    if attention_implementation(model.config) != attention_implementation(other.config):
        return False
    ours, theirs = model.get_encoder().state_dict(), other.get_encoder().state_dict()
    return ours.keys() == theirs.keys() and all(
        ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name].to(ours[name].device))
        for name in ours)


def output_logits(model: T5ForConditionalGeneration, hidden: torch.Tensor) -> torch.Tensor:
    """Decoder hidden states -> vocabulary logits, exactly as `T5ForConditionalGeneration.forward`.

    With tied embeddings T5 rescales the final hidden state by d_model ** -0.5 before `lm_head`;
    skipping it changes the logits (and the argmax) compared with `generate`.
    """
    if model.config.scale_decoder_outputs:
        hidden = hidden * (model.config.d_model ** -0.5)
    return model.lm_head(hidden)


def masked_mean(states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, S, d) states, (B, S) 1/0 mask -> (B, d) mean over the real positions: padding added by
    batching does not change an example's result."""
    weights = attention_mask.to(states.dtype)[:, :, None]                        # (B, S, 1)
    return (states * weights).sum(1) / weights.sum(1).clamp(min=1.0)


def at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in float32 if it is in a narrower float type (bf16/fp16 under mixed precision), so
    that log-softmax and cross-entropy sums do not lose precision; float64 stays float64."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


# ---- running T5's decoder blocks with a custom self-attention structure --------------------------
# T5 adds both a relative-position bias and an attention mask to the attention scores of every
# layer, so one precomputed (B, heads, queries, keys) tensor = relative-position bias + visibility
# mask (a large negative value where hidden) gives a decoder any attention structure, through the
# backbone's own weights, under eager and sdpa attention alike.

# Attention implementations that add an arbitrary float mask to the scores (flash kernels do not).
STRUCTURED_ATTENTION = ("eager", "sdpa")


def relative_position_bias(model: T5ForConditionalGeneration, distance: torch.Tensor,
                           bidirectional: bool = False) -> torch.Tensor:
    """T5's decoder position bias for `distance` = how far each key lies in the past of each query
    (negative: in the future, which only `bidirectional` bucketing tells apart).

    distance: (B, queries, keys) ints -> (B, heads, queries, keys). Uses T5's own bucketing and the
    first decoder layer's bias table (only layer 0 owns one).
    """
    attention = bias_owner(model.decoder)
    buckets = relative_position_buckets(attention, -distance, bidirectional)
    return attention.relative_attention_bias(buckets).permute(0, 3, 1, 2)


def past_distance_bias_table(model: T5ForConditionalGeneration, longest: int) -> torch.Tensor:
    """(longest + 1, heads) T5 decoder bias of past distances 0..longest, so that each decoder call
    only gathers from it: `table[distance].permute(0, 3, 1, 2)` is
    `relative_position_bias(model, distance)`. T5's bucketing takes logarithms: while decoding it
    is made once per weights (`made_from_bias_weight`), not once per decode."""
    def table() -> torch.Tensor:
        distance = torch.arange(longest + 1, device=model.device)[None, :, None]   # (1, D, 1)
        return relative_position_bias(model, distance)[0, :, :, 0].T                # (D, heads)
    return made_from_bias_weight(model, ("past distances", longest), table)


def made_from_bias_weight(model: T5ForConditionalGeneration, key: Hashable, make: Callable[[], Any]):
    """`make()`, a table made from the decoder's relative-position bias weight and named by `key`:
    where no gradient is recorded (decoding), made once while that weight keeps its values and kept
    with it, so that a decode reads the tables of the decodes before it; read them, never write
    them. Elsewhere (training: a graph must not outlive its step) made on every call."""
    if torch.is_grad_enabled():
        return make()
    bias = bias_owner(model.decoder).relative_attention_bias        # nn.Embedding (buckets, heads)
    made = WEIGHT_TABLES.get(bias)
    if made is None or not made.made_from(bias.weight):
        made = WEIGHT_TABLES[bias] = MadeTables(bias.weight.detach(), bias.weight._version, {})
    if key not in made.tables:
        if len(made.tables) >= MOST_TABLES:
            made.tables.clear()   # the same dict: a table `make` itself reads lands beside it
        made.tables[key] = make()
    return made.tables[key]


class MadeTables(NamedTuple):
    """Tables made from one bias weight's values."""

    weight: torch.Tensor         # that weight, detached: its storage lives while they do, so no
                                 # other weight's storage takes its place
    writes: int                  # its count of in-place writes then (`Tensor._version`)
    tables: dict[Hashable, Any]  # by key

    def made_from(self, weight: torch.Tensor) -> bool:
        """Whether `weight` holds the values they were made from: the same storage (a weight
        replaced, as by `.to()`, has another), written in place no more since (as by an optimizer
        step or `load_state_dict`)."""
        return weight.data_ptr() == self.weight.data_ptr() and weight._version == self.writes


# Per decoder bias embedding (dropped with it): the tables made from its weight's current values,
# at most MOST_TABLES of them (a decoder whose tables' sizes follow its batches makes many).
WEIGHT_TABLES: "weakref.WeakKeyDictionary[nn.Embedding, MadeTables]" = weakref.WeakKeyDictionary()
MOST_TABLES = 64


class HeadTable(NamedTuple):
    """A per-head bias table laid out for one-op reads: biases table[h, origin + i] for a tensor
    of indices i are one `take` from the flattened table at i + base[h], which costs less than
    indexing by head and position, the more so the larger the batch. The result is contiguous,
    which T5's attention would otherwise copy in every layer."""

    flat: torch.Tensor   # (heads * T,) the (heads, T) table, head after head
    base: torch.Tensor   # (heads, 1, 1) h * T + origin: where head h's index 0 lies

    @classmethod
    def of(cls, table: torch.Tensor, origin: int = 0) -> "HeadTable":
        """`table` (heads, T); index i reads its column origin + i."""
        heads, width = table.shape
        base = torch.arange(heads, device=table.device)[:, None, None] * width + origin
        return cls(table.reshape(-1), base)

    def gather(self, based: torch.Tensor) -> torch.Tensor:
        """Biases at `based` = indices + `base`, e.g. (B, heads, Q, K): a loop adds the base where
        it costs least (once per decode, or on the smaller operand)."""
        return self.flat.take(based)


def hidden_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, queries, keys) bool -> (B, 1, queries, keys) additive mask: 0 where visible."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(
        ~visible, torch.finfo(dtype).min)[:, None]


def cross_attention_mask(encoder_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, source_len) 1/0 padding mask -> the (B, 1, 1, source_len) additive mask T5's
    cross-attention takes; a decoding loop makes it once and passes it to every `run_decoder`."""
    return hidden_mask(encoder_mask[:, None, :].bool(), dtype)


def run_decoder(model: T5ForConditionalGeneration, input_ids: torch.Tensor, self_bias: torch.Tensor,
                encoder_states: torch.Tensor, encoder_mask: torch.Tensor,
                cache: DecoderCache | None = None, slots: Slots | None = None,
                position_embeddings: torch.Tensor | None = None) -> torch.Tensor:
    """T5's decoder stack with a precomputed self-attention bias (relative bias + visibility mask).

    input_ids: (B, Q) new tokens; self_bias: (B or 1, heads, Q, keys) where keys = cached + Q tokens;
    encoder_mask: (B, source_len) 1/0 padding mask, or its `cross_attention_mask`, made once per
    decode. Returns the final hidden states (B, Q, d_model).
    With a cache, the new tokens' keys/values are written at `slots` (`DecoderCache.write`), and the
    encoder's keys/values are computed at the first call and reused after.
    `position_embeddings` ((B or 1, Q, d_model)), if given, are added to the token embeddings (T5
    itself has none).

    The layers run here, from the backbone's own modules and weights, as `T5Block.forward` runs them
    (the same operations, in the same order), without its per-call bookkeeping: a decoder call of a
    small T5 on a CPU is mostly Python, and that bookkeeping (cache lookups, kwargs, masks rebuilt,
    the attention dispatch) costs more than the arithmetic.
    """
    implementation = attention_implementation(model.config)
    if implementation not in STRUCTURED_ATTENTION:
        raise ValueError(f"a custom decoder attention structure needs attn_implementation in "
                         f"{STRUCTURED_ATTENTION}; the backbone was loaded with {implementation!r}")
    decoder = model.decoder
    cross_mask = (encoder_mask if encoder_mask.dim() == 4                                # (B, 1, 1, S)
                  else cross_attention_mask(encoder_mask, encoder_states.dtype))
    if implementation == "sdpa" and self_bias.is_cuda:
        self_bias = sdpa_aligned(self_bias)
    embedded = decoder.embed_tokens(input_ids)
    if position_embeddings is not None:
        embedded = embedded + position_embeddings
    # dropout only where it drops anything: each module call costs a decoding loop more than its op
    dropout = decoder.dropout if decoder.training else _unchanged
    hidden = dropout(embedded)
    attend = _ATTEND[implementation]
    for layer, block in enumerate(decoder.block):
        self_attention, cross_attention, feed_forward = block.layer
        attention = self_attention.SelfAttention
        normed = self_attention.layer_norm(hidden)
        keys, values = _heads(attention, attention.k(normed)), _heads(attention, attention.v(normed))
        if cache is not None:
            keys, values = cache.write(layer, slots, keys, values)
        attended = attend(attention, _heads(attention, attention.q(normed)), keys, values, self_bias)
        hidden = _finite(hidden + dropout(attention.o(attended)))

        attention = cross_attention.EncDecAttention
        cached = None if cache is None else cache.encoder_part(layer)
        if cached is None:
            keys = _heads(attention, attention.k(encoder_states))                 # (B, heads, S, d_kv)
            values = _heads(attention, attention.v(encoder_states))
            if cache is not None:
                cache.keep_encoder_part(layer, keys, values)
        else:
            keys, values = cached
        normed = cross_attention.layer_norm(hidden)
        attended = attend(attention, _heads(attention, attention.q(normed)), keys, values, cross_mask)
        hidden = _finite(hidden + dropout(attention.o(attended)))
        dense = feed_forward.DenseReluDense
        hidden = _finite(hidden + dropout(dense(feed_forward.layer_norm(hidden))))
    return dropout(decoder.final_layer_norm(hidden))


def sdpa_aligned(bias: torch.Tensor) -> torch.Tensor:
    """`bias` itself where SDPA's memory-efficient CUDA kernel can read it, else an aligned copy.

    That kernel reads a bias whose columns are adjacent in 16-byte vectors, row after row. It
    checks the row stride but not where the data starts (PyTorch issue 183484), so a slice of a bias
    table at an odd column, as a drafting loop's one-count bias is, fails with "misaligned
    address". One copy per call, which every layer shares. A bias with spaced columns (sequential's
    flipped table) is left as it is: SDPA does not hand it to that kernel as it is."""
    vector = 16 // bias.element_size()
    if bias.stride(-1) != 1 or (bias.data_ptr() % 16 == 0
                                and (bias.size(-2) == 1 or bias.stride(-2) % vector == 0)):
        return bias
    return bias.clone(memory_format=torch.contiguous_format)


def _unchanged(hidden: torch.Tensor) -> torch.Tensor:
    """Dropout outside training: the states as they are."""
    return hidden


def _heads(attention: nn.Module, projected: torch.Tensor) -> torch.Tensor:
    """(B, T, heads * d_kv) -> (B, heads, T, d_kv)."""
    return projected.view(*projected.shape[:2], -1, attention.key_value_proj_dim).transpose(1, 2)


def _eager_attention(attention: nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, scores_added: torch.Tensor) -> torch.Tensor:
    """T5's eager attention (unscaled dot products): (B, heads, Q, d_kv) x keys -> (B, Q, heads * d_kv)."""
    weights = nn.functional.softmax(torch.matmul(query, key.transpose(2, 3)) + scores_added, dim=-1)
    weights = nn.functional.dropout(weights, p=attention.dropout, training=attention.training)
    return torch.matmul(weights, value).transpose(1, 2).flatten(2)


def _sdpa_attention(attention: nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, scores_added: torch.Tensor) -> torch.Tensor:
    """The same through `scaled_dot_product_attention`, as transformers' sdpa attention calls it."""
    attended = nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=scores_added, scale=1.0,
        dropout_p=attention.dropout if attention.training else 0.0)
    return attended.transpose(1, 2).flatten(2)


_ATTEND = {"eager": _eager_attention, "sdpa": _sdpa_attention}


def _finite(hidden: torch.Tensor) -> torch.Tensor:
    """T5Block's guard after each sublayer: float16 states are clamped below infinity."""
    if hidden.dtype != torch.float16:
        return hidden
    largest = torch.finfo(torch.float16).max
    clamp = torch.where(torch.isinf(hidden).any(), largest - 1000, largest)
    return torch.clamp(hidden, min=-clamp, max=clamp)


# Dynamo keeps one list of graphs for `run_decoder`: each model, cache kind (appending, per-row
# slots) and shape specialisation (one row, one fed token) adds one, well past its default limit of
# 8, beyond which it would run the function uncompiled.
COMPILED_GRAPHS_LIMIT = 64


@functools.cache
def compiled_run_decoder() -> Callable[..., torch.Tensor]:
    """`run_decoder` through torch.compile, made once per process: the same tokens, with Python
    and per-op dispatch overhead removed and element-wise ops fused. Shapes are symbolic
    (`dynamic=True`): a call's batch, fed tokens and cache length change from call to call. The
    first calls of each new model or shape compile, which takes seconds to a minute."""
    compiled = torch.compile(run_decoder, dynamic=True)
    return torch._dynamo.config.patch(recompile_limit=COMPILED_GRAPHS_LIMIT)(compiled)


class _Apply(nn.Module):
    """`function(model, *args)` as a module call, so that `torch.func.functional_call` can run it
    with the model's weights swapped for other tensors."""

    def __init__(self, model: nn.Module, function: Callable):
        super().__init__()
        self.model = model
        self.function = function

    def forward(self, *args):
        return self.function(self.model, *args)


def with_frozen_weights(model: nn.Module, function: Callable, *args, only: Collection | None = None):
    """`function(model, *args)` computed with the model's weights detached (`only` those among the
    parameters `only` holds, where given): gradients flow to `args` (and to modules outside
    `model`) but never reach those parameters, and nothing about the model is changed (its
    `requires_grad` flags stay as the caller set them)."""
    weights = {f"model.{name}": p.detach() for name, p in model.named_parameters()
               if only is None or p in only}
    # tie_weights (the default) keeps tied parameters (T5's shared embedding and lm_head) tied
    return torch.func.functional_call(_Apply(model, function), weights, args)
