"""The backbone calls every decoder shares, in any family (`decoders.families`): the encoder once
per batch, the output head, the decoder layers run with a custom self-attention structure over a
cache written at given slots (`decoders.cache`), and a function of the model run with its weights
detached."""
from __future__ import annotations

import functools
import types
import weakref
from typing import Any, Callable, Collection, Hashable, NamedTuple

import torch
from torch import nn
from transformers import PreTrainedModel

from decoders.cache import DecoderCache, Slots, power_of_two_holding
from decoders.compiled_step import Applied, FixedShapeStep
from decoders.families import Sizes, family_of
from decoders.transformers_internals import attention_implementation


def encode(model: PreTrainedModel, input_ids: torch.Tensor,
           attention_mask: torch.Tensor) -> torch.Tensor:
    """Run the encoder once per batch; every decoder call reuses its output `(B, source_len, d_model)`."""
    return model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def encoder_weights(model: PreTrainedModel) -> set[nn.Parameter]:
    """The parameters the encoder's output depends on: its layers and the token embeddings, which
    it may share with the decoder's input and (tied) output projection."""
    return set(model.get_encoder().parameters())


def same_encoder(model: PreTrainedModel, other: PreTrainedModel) -> bool:
    """Whether two backbones encode every source alike: the same encoder settings and attention
    implementation, and equal encoder weights (token embeddings included) of one dtype."""
    if model.config.model_type != other.config.model_type:
        return False
    settings = family_of(model.config).encoder_settings
    if any(getattr(model.config, name) != getattr(other.config, name) for name in settings):
        return False
    if attention_implementation(model.config) != attention_implementation(other.config):
        return False
    ours, theirs = model.get_encoder().state_dict(), other.get_encoder().state_dict()
    return ours.keys() == theirs.keys() and all(
        ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name].to(ours[name].device))
        for name in ours)


def output_logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """Decoder hidden states -> vocabulary logits, exactly as the model's forward computes them."""
    return family_of(model.config).output_logits(model, hidden)


def sizes(config) -> Sizes:
    """The sizes of the decoder `config` describes: hidden, feed-forward, heads, layers."""
    return family_of(config).sizes(config)


def decoder_inputs(model: PreTrainedModel, labels: torch.Tensor) -> torch.Tensor:
    """Teacher-forced decoder inputs of `labels` (B, T): the start token, then the labels but the
    last, -100 (ignored) read as padding."""
    start = labels.new_full((labels.size(0), 1), model.config.decoder_start_token_id)
    shifted = torch.cat([start, labels[:, :-1]], dim=1)
    return shifted.masked_fill(shifted == -100, model.config.pad_token_id)


def teacher_forced_states(model: PreTrainedModel, labels: torch.Tensor, encoder_states: torch.Tensor,
                          attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T, d_model) final decoder states of every position of `labels` under the causal mask, in
    one pass of the model's own decoder."""
    return model.get_decoder()(input_ids=decoder_inputs(model, labels), encoder_hidden_states=encoder_states,
                               encoder_attention_mask=attention_mask, use_cache=False).last_hidden_state


def masked_mean(states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, S, d) states, (B, S) 1/0 mask -> (B, d) mean over the real positions: padding added by
    batching does not change an example's result."""
    weights = attention_mask.to(states.dtype)[:, :, None]                        # (B, S, 1)
    return (states * weights).sum(1) / weights.sum(1).clamp(min=1.0)


def at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in float32 if it is in a narrower float type (bf16/fp16 under mixed precision), so
    that log-softmax and cross-entropy sums do not lose precision; float64 stays float64."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


# ---- running the decoder layers with a custom self-attention structure ----------------------------
# Every family adds an attention mask to the attention scores of every layer, and T5 its
# relative-position bias with it, so one precomputed (B, heads, queries, keys) tensor = position
# bias + visibility mask (a large negative value where hidden) gives a decoder any attention
# structure, through the backbone's own weights, under eager and sdpa attention alike.

# Attention implementations that add an arbitrary float mask to the scores (flash kernels do not).
STRUCTURED_ATTENTION = ("eager", "sdpa")


def relative_position_bias(model: PreTrainedModel, distance: torch.Tensor,
                           bidirectional: bool = False) -> torch.Tensor:
    """The decoder's position bias for `distance` = how far each key lies in the past of each query
    (negative: in the future, which only `bidirectional` bucketing tells apart).

    distance: (B, queries, keys) ints -> (B, heads, queries, keys): T5's bucketed bias; zeros in a
    family with absolute positions, whose positions reach the model as `run_decoder`'s `positions`.
    """
    return family_of(model.config).position_bias(model, distance, bidirectional)


def past_distance_bias_table(model: PreTrainedModel, longest: int) -> torch.Tensor:
    """(longest + 1, heads) decoder bias of past distances 0..longest, so that each decoder call
    only gathers from it: `table[distance].permute(0, 3, 1, 2)` is
    `relative_position_bias(model, distance)`. T5's bucketing takes logarithms: while decoding it
    is made once per weights (`made_from_bias_weight`), not once per decode."""
    def table() -> torch.Tensor:
        distance = torch.arange(longest + 1, device=model.device)[None, :, None]   # (1, D, 1)
        return relative_position_bias(model, distance)[0, :, :, 0].T                # (D, heads)
    return made_from_bias_weight(model, ("past distances", longest), table)


def made_from_bias_weight(model: PreTrainedModel, key: Hashable, make: Callable[[], Any]):
    """`make()`, a table made from the decoder's position bias weight and named by `key`:
    where no gradient is recorded (decoding), made once while that weight keeps its values and kept
    with it, so that a decode reads the tables of the decodes before it; read them, never write
    them. Elsewhere (training: a graph must not outlive its step) made on every call."""
    if torch.is_grad_enabled():
        return make()
    bias = family_of(model.config).bias_embedding(model)            # nn.Embedding
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


def source_at_fixed_width(encoder_states: torch.Tensor,
                          attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The encoder's states (B, S, d_model) and padding mask (B, S), padded with hidden positions
    to a fixed width (`fixed_source_width`): a step compiled for fixed shapes meets a few source
    widths, not every source length. The cross-attention hides the added positions, so every
    token's state is what it was."""
    length = encoder_states.size(1)
    width = fixed_source_width(length)
    return (nn.functional.pad(encoder_states, (0, 0, 0, width - length)),
            nn.functional.pad(attention_mask, (0, width - length)))


def fixed_source_width(length: int) -> int:
    """The width `source_at_fixed_width` pads a source of `length` positions to: the least power
    of two, or three quarters of one, that holds it (at least 16). Each call of a step reads its
    source's keys and values at that width, so its padding costs every call: these widths pad a
    source to less than 1.5 times its length (powers of two alone: 2 times), at twice the
    shapes."""
    width = max(16, power_of_two_holding(length))
    three_quarters = width * 3 // 4
    return three_quarters if width > 16 and length <= three_quarters else width


def cross_attention_mask(encoder_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, source_len) 1/0 padding mask -> the (B, 1, 1, source_len) additive mask the
    cross-attention takes; a decoding loop makes it once and passes it to every `run_decoder`."""
    return hidden_mask(encoder_mask[:, None, :].bool(), dtype)


def run_decoder(model: PreTrainedModel, input_ids: torch.Tensor, self_bias: torch.Tensor,
                encoder_states: torch.Tensor, encoder_mask: torch.Tensor,
                cache: DecoderCache | None = None, slots: Slots | None = None,
                positions: torch.Tensor | None = None,
                position_embeddings: torch.Tensor | None = None, *,
                attention: str | None = None) -> torch.Tensor:
    """The decoder stack with a precomputed self-attention bias (position bias + visibility mask).

    input_ids: (B, Q) new tokens; self_bias: (B or 1, heads, Q, keys) where keys = cached + Q tokens;
    encoder_mask: (B, source_len) 1/0 padding mask, or its `cross_attention_mask`, made once per
    decode. Returns the final hidden states (B, Q, d_model).
    With a cache, the new tokens' keys/values are written at `slots` (`DecoderCache.write`), and the
    encoder's keys/values are computed at the first call and reused after.
    `positions` ((B or 1, Q) longs): each fed token's position in its output, which a family with
    absolute positions (`families.Family.absolute_positions`) embeds; T5 reads positions from the bias.
    `position_embeddings` ((B or 1, Q, d_model)), if given, are added to the token embeddings.
    `attention`: the attention implementation the layers run, one of STRUCTURED_ATTENTION, or
    "looped" (eager's arithmetic as loops, for a compiled step on a CPU: `greedy_step_as_compiled`);
    the model's own (`attn_implementation`) by default. All give the same states.

    The layers run from the backbone's own modules and weights, as the model's own layers run them
    (the same operations, in the same order), without their per-call bookkeeping: a decoder call of
    a small model on a CPU is mostly Python, and that bookkeeping (cache lookups, kwargs, masks
    rebuilt, the attention dispatch) costs more than the arithmetic.
    """
    if attention is not None and attention not in _ATTEND:
        raise ValueError(f"attention={attention!r}; allowed: {tuple(_ATTEND)}")
    implementation = attention or attention_implementation(model.config)
    if implementation not in STRUCTURED_ATTENTION and attention is None:   # the model's own
        raise ValueError(f"a custom decoder attention structure needs attn_implementation in "
                         f"{STRUCTURED_ATTENTION}; the backbone was loaded with {implementation!r}")
    cross_mask = (encoder_mask if encoder_mask.dim() == 4                                # (B, 1, 1, S)
                  else cross_attention_mask(encoder_mask, encoder_states.dtype))
    family = family_of(model.config)
    if positions is None and family.absolute_positions:
        raise ValueError(f"a {model.config.model_type} decoder call needs each fed token's "
                         f"position (`positions`)")
    if implementation == "sdpa" and self_bias.is_cuda:
        self_bias = sdpa_aligned(self_bias)
    return family.run_layers(model, input_ids, positions, position_embeddings, self_bias,
                             encoder_states, cross_mask, cache, slots, _ATTEND[implementation])


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


def _eager_attention(attention: nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, scores_added: torch.Tensor, scale: float) -> torch.Tensor:
    """Eager attention, the dot products times `scale` (T5: 1): (B, heads, Q, d_kv) x keys ->
    (B, Q, heads * d_kv)."""
    scores = torch.matmul(query, key.transpose(2, 3))
    if scale != 1.0:
        scores = scores * scale
    weights = nn.functional.softmax(scores + scores_added, dim=-1)
    weights = nn.functional.dropout(weights, p=attention.dropout, training=attention.training)
    return torch.matmul(weights, value).transpose(1, 2).flatten(2)


def _sdpa_attention(attention: nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, scores_added: torch.Tensor, scale: float) -> torch.Tensor:
    """The same through `scaled_dot_product_attention`, as transformers' sdpa attention calls it."""
    attended = nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=scores_added, scale=scale,
        dropout_p=attention.dropout if attention.training else 0.0)
    return attended.transpose(1, 2).flatten(2)


def _looped_attention(attention: nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, scores_added: torch.Tensor, scale: float) -> torch.Tensor:
    """Eager attention's arithmetic, for a step compiled on a CPU: with several queries per row
    its two products as broadcast products and sums, which inductor runs as loops fused with the
    softmax, not as batched matrix products (at a decoder call's few queries a BLAS call costs
    more than its arithmetic; inductor already loops over one query's)."""
    if query.size(-2) == 1:
        return _eager_attention(attention, query, key, value, scores_added, scale)
    scores = (query[..., None, :] * key[..., None, :, :]).sum(-1)           # (B, heads, Q, keys)
    if scale != 1.0:
        scores = scores * scale
    weights = nn.functional.softmax(scores + scores_added, dim=-1)
    weights = nn.functional.dropout(weights, p=attention.dropout, training=attention.training)
    attended = (weights[..., None] * value[..., None, :, :]).sum(-2)        # (B, heads, Q, d_kv)
    return attended.transpose(1, 2).flatten(2)


_ATTEND = {"eager": _eager_attention, "sdpa": _sdpa_attention, "looped": _looped_attention}


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
    return torch._dynamo.config.patch(recompile_limit=COMPILED_GRAPHS_LIMIT)(
        torch.compile(run_decoder, dynamic=True))


def greedy_step(model: PreTrainedModel, *step: Any,
                attention: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of greedy decoding: `run_decoder(model, *step, attention=attention)`'s hidden
    states (B, Q, d_model), and the model's argmax token after each fed token (B, Q) from the
    output head."""
    hidden = run_decoder(model, *step, attention=attention)
    return hidden, output_logits(model, hidden).argmax(-1)


def fixed_shape_greedy_step(model: PreTrainedModel, shape: Hashable) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """`greedy_step` compiled for fixed shapes (`fixed_shape_compiled`), for loops whose calls
    take a few shapes only (the verify loop, pipelined): a cache written at slot = position and
    attended in a few widths, the source padded to a few widths (`source_at_fixed_width`), slots
    and positions given as tensors, a few batch sizes and numbers of fed tokens."""
    return fixed_shape_compiled(model, greedy_step_as_compiled, shape)


def fixed_shape_compiled(model: PreTrainedModel, function: Callable, shape: Hashable) -> Callable:
    """`function` (of `model`, then its arguments; e.g. `greedy_step_as_compiled`, or a loop's step
    built on it) compiled for one fixed shape of its arguments: one `FixedShapeStep` per model,
    `function` and `shape` (a key of every shape of the call, which the loop gives), made at the
    first call and kept while the model lives, and every later decode reuses it. It is called
    as a function of its tensors, without torch.compile's per-call work
    (`decoders.compiled_step`), except where it puts new tensors into its arguments or cannot be
    traced, where it runs through torch.compile for fixed shapes (`dynamic=False`,
    `compiled_for`: Dynamo checks the inputs' tensor guards only).

    A call costs its kernels and little else: the graph's wrapper is C++, and on a CPU a product
    of one row (one fed token of a batch of one) runs as inductor's own loop (its
    `decompose_mm_pass`), not as a BLAS call: at a decoder call's sizes a BLAS call costs more
    than its arithmetic. The wrapper allocates the graph's intermediate tensors as one block
    (`memory_planning`), not one by one: at a decoder call's sizes each allocation costs a share
    of the call. The inputs' sizes and strides are checked once per call: by the graph's C++
    wrapper for a graph of tensors (`size_asserts` on), by Dynamo's guards for the fallback
    (`size_asserts` off there)."""
    steps = _COMPILED.setdefault(model, {})
    key = _compiled_key(model, function, ("fixed shape", shape))
    if key not in steps:
        # Dynamo's guards check the fallback's inputs already
        fallback = compiled_for(model, function, shape,
                                **{**FIXED_SHAPE_OPTIONS, "size_asserts": False})
        steps[key] = FixedShapeStep(function, fallback, FIXED_SHAPE_OPTIONS)
    return steps[key]


# inductor's options for a step of fixed shapes (`fixed_shape_compiled`); `size_asserts`: the C++
# wrapper checks every input's size and stride, so a call in another shape fails, not reads out of
# bounds; `always_keep_tensor_constants`: a weight of one or a few values stays a tensor the graph
# reads (`compiled_step`), not a number compiled into it
FIXED_SHAPE_OPTIONS = {"cpp_wrapper": True, "post_grad_fusion_options": {"decompose_mm_pass": {}},
                       "memory_planning": True, "size_asserts": True,
                       "always_keep_tensor_constants": True}


def has_fixed_shape_greedy_step(model: PreTrainedModel, shape: Hashable) -> bool:
    """Whether `fixed_shape_greedy_step(model, shape)` was called already: else its call compiles
    it, which takes seconds."""
    step = _COMPILED.get(model, {}).get(_compiled_key(model, greedy_step_as_compiled, ("fixed shape", shape)))
    return step is not None and step.made


class FixedShapeStart(NamedTuple):
    """What a fixed-shape decode starts from (`fixed_shape_start`)."""

    cache: DecoderCache             # made whole before the first call
    encoder_states: torch.Tensor    # (B, W, d_model) the source padded to its fixed width W
    cross_mask: torch.Tensor        # (B, 1, 1, W) `cross_attention_mask` of the padded source


def fixed_shape_start(model: PreTrainedModel, encoder_states: torch.Tensor,
                      attention_mask: torch.Tensor, most_slots: int) -> FixedShapeStart:
    """The start of a fixed-shape decode from the encoder's states (B, S, d_model) and padding
    mask (B, S): the source padded to its fixed width (`source_at_fixed_width`), its cross mask,
    and the cache made whole before the first call: each layer's self-attention keys and values
    zeros at `most_slots` slots, its cross-attention keys and values those of the padded source
    (the positions padded are hidden by the cross mask). So every call of the loop, its first
    included, only writes into tensors it is given, and runs as a graph of them
    (`decoders.compiled_step`). The mask and the cache are one step of fixed shapes too
    (`fixed_shape_compiled`, one per rows, width and bound), so the cross-attention keys and
    values of the padded positions are projected as well: a function of the unpadded source would
    run through torch.compile with symbolic lengths, whose call costs a small model's decode on a
    CPU more than those positions do."""
    encoder_states, attention_mask = source_at_fixed_width(encoder_states, attention_mask)
    rows, width = attention_mask.shape
    parts = fixed_shape_compiled(model, start_parts, ("start", rows, width, most_slots))(
        model, encoder_states, attention_mask, most_slots)
    cache = DecoderCache(len(parts) // 4, most_slots)
    cache.keys, cache.values = list(parts[2:-1:4]), list(parts[3:-1:4])
    cache.encoder_keys_values = list(zip(parts[0:-1:4], parts[1:-1:4]))
    if family_of(model.config).caches_positions:
        cache.positions = torch.zeros(rows, most_slots, dtype=torch.long,
                                      device=encoder_states.device)
    return FixedShapeStart(cache, encoder_states, parts[-1])


def start_parts(model: PreTrainedModel, encoder_states: torch.Tensor, attention_mask: torch.Tensor,
                most_slots: int) -> tuple[torch.Tensor, ...]:
    """`fixed_shape_start`'s tensors from the padded source: four per decoder layer, its
    cross-attention keys and values, each (B, heads, W, d_kv), then its self-attention keys and
    values, each (B, heads, most_slots, d_kv), zeros (an unwritten slot is hidden by the bias, but
    NaN garbage would survive it); then the cross mask (B, 1, 1, W)."""
    family, parts = family_of(model.config), []
    for layer in range(sizes(model.config).layers):
        keys, values = family.cross_keys_values(model, layer, encoder_states)
        empty = keys.new_zeros(*keys.shape[:2], most_slots, keys.size(-1))
        parts += [keys.contiguous(), values.contiguous(), empty, empty.clone()]
    return (*parts, cross_attention_mask(attention_mask, encoder_states.dtype))


def greedy_step_as_compiled(model: PreTrainedModel, input_ids: torch.Tensor,
                            *step: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """`greedy_step` with the attention a compiled step runs: on a CPU eager's arithmetic as loops
    (`_looped_attention`), which inductor fuses with the ops around them (SDPA's CPU kernel costs
    more than its arithmetic at a decoder call's sizes); elsewhere the model's own."""
    on_cpu = input_ids.device.type == "cpu"   # Dynamo guards on the device: a graph per device
    return greedy_step(model, input_ids, *step, attention="looped" if on_cpu else None)


def compiled_encode(model: PreTrainedModel, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor) -> torch.Tensor:
    """The encoder's states (B, S, d_model) for decodes under `decoder.compile=true`, in a few
    fixed shapes, each compiled once (`fixed_shape_compiled`): the source padded with positions
    the padding mask hides to under an eighth more (`rounded_to_eighths`; the attention's work
    grows with the square of the width). Compiled for symbolic lengths instead, its call costs
    Dynamo's guards and kernels of unknown sizes, a quarter of a one-example encoder pass at the
    built-in sizes on a CPU. A batch of several rows with padding, where the family runs the
    encoder itself, runs it on its real tokens (`encode_real_tokens`), their count rounded up
    alike with padding positions; any other batch, the model's encoder (at batch size 1 that is
    about a tenth faster than the family's, which would gather and scatter every token for
    nothing). A batch of one is not checked for padding: it has its own length, and the check
    would read the device."""
    rows, length = input_ids.shape
    width = rounded_to_eighths(length)
    if width > length:
        input_ids, attention_mask = (nn.functional.pad(tensor, (0, width - length))
                                     for tensor in (input_ids, attention_mask))
    if rows > 1 and family_of(model.config).encodes_real_tokens(model.config):
        present = attention_mask.flatten().bool()
        real = present.sum().item()
        if real < rows * width:
            count = min(rows * width, rounded_to_eighths(real))
            # the real tokens' flat positions, then padding ones up to `count`
            tokens = torch.argsort(~present, stable=True)[:count]
            states = fixed_shape_compiled(model, encode_real_tokens, ("encoder", rows, width, count))(
                model, input_ids, attention_mask, tokens)
            return states[:, :length]
    states = fixed_shape_compiled(model, encode, ("encoder", rows, width))(model, input_ids, attention_mask)
    return states[:, :length]


def rounded_to_eighths(count: int) -> int:
    """`count` (a source's length, a batch's real tokens) rounded up as `compiled_encode` runs it:
    the least multiple of an eighth of the power of two at or below it (at least 8), so the
    encoder meets 8 shapes per doubling and runs under 1/8 more positions."""
    step = max(8, (1 << (count.bit_length() - 1)) // 8)
    return -(-count // step) * step


def encode_real_tokens(model: PreTrainedModel, input_ids: torch.Tensor,
                       attention_mask: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The encoder's states (B, S, d_model) as the family runs them
    (`families.Family.run_encoder`): its norms, projections and feed-forward layers on the
    positions `tokens` (N,) of (B * S), the batch's real tokens (and maybe some padding ones), the
    attention on the padded batch; zeros at the padding, whose positions are otherwise a share of
    every position-wise layer's work (about 3 in 10 at batch size 16 on the built-in tasks). On a
    CPU the attention runs through SDPA; elsewhere as the model's own implementation, where the
    library runs that one (STRUCTURED_ATTENTION)."""
    attention = attention_implementation(model.config)
    if input_ids.device.type == "cpu":   # a fixed-shape graph keeps SDPA's kernel, which is faster
        attention = "sdpa"
    elif attention not in _ATTEND:
        attention = "eager"
    padding_mask = cross_attention_mask(attention_mask, model.get_input_embeddings().weight.dtype)
    states = family_of(model.config).run_encoder(model, input_ids, padding_mask, tokens,
                                                 _ATTEND[attention])
    return states.masked_fill(~attention_mask.bool()[..., None], 0)


def compiled_for(model: PreTrainedModel, function: Callable, key: Hashable, **options: Any) -> Callable:
    """`function` (of `model` first) through torch.compile for fixed shapes, one compiled function
    per model and `key`, made at the first call and kept while the model lives; with inductor's
    C++ wrapper and its `options`: a fixed-shape step's fallback (`fixed_shape_compiled`).

    Dynamo checks only the guards on the inputs' tensors (shape, dtype, device, strides), not
    those on the model's weights or on the Python objects around them (the
    model's modules and configuration, the cache object), which at the built-in sizes on a CPU
    take a large share of a call's time otherwise. The function per model and key stands in for
    them: its key holds what else decides the graph (the attention implementation, training mode,
    the weights' dtype and device and the vocabulary's size: `_compiled_key`); the weights' values
    are read at every call. So a model whose modules, configuration or weights' shapes change in
    place, other than by `train()`/`eval()`, `to()` or a resized vocabulary, needs a new model
    object to decode compiled."""
    functions = _COMPILED.setdefault(model, {})
    key = _compiled_key(model, function, key)
    if key not in functions:
        # a code object of its own: Dynamo keeps its graphs, and checks them, with the code
        code = function.__code__.replace(co_name=f"{function.__name__}_{len(functions)}")
        own = types.FunctionType(code, function.__globals__, code.co_name, function.__defaults__)
        # its own code object keeps its graphs few (a model's dtypes and devices): Dynamo's
        # default limit of them holds, and no configuration is patched around each call
        functions[key] = torch.compile(
            own, dynamic=False,
            options={"cpp_wrapper": True, "guard_filter_fn": _input_guards, **options})
    return functions[key]


# The functions of `compiled_for`, by model, then by key.
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiled_key(model: PreTrainedModel, function: Callable, key: Hashable) -> tuple:
    """What decides a graph of `function` besides its inputs' tensors: `key`, the attention
    implementation, training mode, and the weights' dtype, device and vocabulary, read from the
    token embeddings (`to()` converts every weight alike; a resized vocabulary reshapes them)."""
    embeddings = model.get_input_embeddings().weight
    return (function.__name__, key, attention_implementation(model.config), model.training,
            embeddings.dtype, embeddings.device, embeddings.size(0))


def _input_guards(entries) -> list[bool]:
    """Which of a graph's guards Dynamo keeps: those on the inputs' tensors (not the weights':
    `_compiled_key` holds what of them decides a graph)."""
    return torch.compiler.keep_tensor_guards_unsafe(entries, keep_parameters=False)


def with_frozen_weights(model: nn.Module, function: Callable, *args, only: Collection | None = None):
    """`function(model, *args)` computed with the model's weights detached (`only` those among the
    parameters `only` holds, where given): gradients flow to `args` (and to modules outside
    `model`) but never reach those parameters, and nothing about the model is changed (its
    `requires_grad` flags stay as the caller set them)."""
    weights = {f"model.{name}": p.detach() for name, p in model.named_parameters()
               if only is None or p in only}
    # tie_weights (the default) keeps tied parameters (T5's shared embedding and lm_head) tied
    return torch.func.functional_call(Applied(model, function), weights, args)
