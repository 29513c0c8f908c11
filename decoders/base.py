"""The decoder plug-in interface.

A decoder owns three things and nothing else (DESIGN.md, "The decoder plug-in"):

1. the *target layout*: how the target subsequences of a batch (token-id lists: keyphrases, answer
   spans, summary sentences) become training tensors;
2. the *training loss*, given the backbone and that layout; extra trainable modules (proposal heads,
   a length predictor) are ordinary submodules of the decoder, so they are trained, checkpointed and
   moved to the device with the task module that holds it;
3. *generation*: encoder inputs in, per example the generated subsequences plus the work it took.

Tasks never look inside a decoder and decoders never look at a task. To add one, subclass `Decoder`
in a new file of this package and register it with `@register("name")` (see `decoders/__init__.py`).
"""
from __future__ import annotations

import abc
import math
import operator
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any, ClassVar, Mapping

import torch
from torch import nn
from transformers import T5Config, T5ForConditionalGeneration
from transformers.cache_utils import DynamicCache, EncoderDecoderCache


@dataclass(frozen=True)
class SpecialTokens:
    """Token ids a decoder may need. T5 conventions: pad=0 doubles as the decoder start token."""

    pad: int
    eos: int
    unk: int
    sep: int    # joins subsequences in the flat (sequential / non-autoregressive) layout
    mask: int   # the masked-position token of non-autoregressive training and decoding
    start: int  # decoder start token (`b` in DESIGN.md)


_COMPARISONS = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"), "le": (operator.le, "<="),
                "lt": (operator.lt, "<")}


@dataclass(frozen=True)
class Range:
    """The allowed values of one numeric option: `ge`/`gt` and `le`/`lt` bounds (inclusive and
    exclusive), each a number or the name of a sibling option whose value is the bound
    (`Range(ge=1, le="max_length")`). Stated once, it is read both by the code that takes the value
    and by the configuration check that refuses a bad one before any work (`tasks.config`), so the
    two cannot disagree."""

    ge: float | str | None = None
    gt: float | str | None = None
    le: float | str | None = None
    lt: float | str | None = None
    integer: bool = True     # False: any finite number
    optional: bool = False   # null is allowed too
    note: str = ""           # what a bound means, for the message

    def problem(self, key: str, value: Any, siblings: Mapping[str, Any]) -> str | None:
        """None if `value` is allowed for `key` (e.g. "decoder.delay"); otherwise a message naming
        the key, the allowed values and the value. `siblings` holds the values of the other keys
        of `key`'s group, for bounds that name one."""
        if value is None and self.optional:
            return None
        prefix = key.rpartition(".")[0]
        bounds = [(op, *self._bound(getattr(self, op), prefix, siblings))
                  for op in _COMPARISONS if getattr(self, op) is not None]
        if self.integer:
            kind_ok = isinstance(value, Integral) and not isinstance(value, bool)
        else:
            kind_ok = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
        if kind_ok and all(_COMPARISONS[op][0](value, limit) for op, limit, _ in bounds):
            return None
        limits = " and ".join(f"{_COMPARISONS[op][1]} {shown}" for op, _, shown in bounds)
        allowed = f"{'an integer' if self.integer else 'a finite number'} {limits}".rstrip()
        if self.optional:
            allowed += " or null"
        if self.note:
            allowed += f" ({self.note})"
        return f"{key} must be {allowed}, got {value!r}"

    @staticmethod
    def _bound(bound: float | str, prefix: str, siblings: Mapping[str, Any]) -> tuple[float, str]:
        """(the bound's value, how a message shows it)."""
        if isinstance(bound, str):
            return siblings[bound], f"{prefix}.{bound} ({siblings[bound]!r})"
        return bound, repr(bound)


@dataclass(frozen=True)
class Choice:
    """The allowed values of a named option (`Choice(("first_empty", "all_end"))`): the
    counterpart of `Range` for options that pick one of a few behaviours by name, with the same
    `problem` check, so `option_ranges` holds both."""

    values: tuple[str, ...]

    def problem(self, key: str, value: Any, siblings: Mapping[str, Any]) -> str | None:
        """None if `value` is one of `values`; otherwise a message naming the key, the allowed
        values and the value."""
        if value in self.values:
            return None
        return f"{key} must be one of {', '.join(map(repr, self.values))}, got {value!r}"


@dataclass
class DecodeOutput:
    """What one `generate` call returns; every list has one entry per example, in input order."""

    subsequences: list[list[list[int]]]  # [example][subsequence] -> token ids, end/separator tokens removed
    decoder_calls: list[int]             # decoder forward passes the example took part in
    tokens: list[int]                    # tokens the decoder produced for the example (end tokens included)
    hit_max_steps: list[bool]            # stopped by a length/step bound rather than by its own end token
    batch_decoder_calls: int             # decoder forward passes for the whole batch
    stats: dict[str, float] = field(default_factory=dict)  # decoder-specific counters (summed over the batch)


class Decoder(nn.Module, abc.ABC):
    """Base class of every decoding strategy. `name` is set by `@register`.

    Subclasses take their options (the keys of `configs/decoder/<name>.yaml`) as keyword arguments.
    """

    name: str = "abstract"
    # Decoders whose losses train the backbone on the same target layout share a family; by default
    # a decoder is its own family (set to the registered name).
    layout_family: str = ""
    # Options that only change generation, not training: a trained model can be decoded with any
    # value of these (tasks.compare sweeps them without retraining).
    decode_options: tuple[str, ...] = ()
    # The allowed values of the numeric (`Range`) and named (`Choice`) options, in checking order
    # (a bound naming another option comes after that option's own range): the constructor checks
    # the options it is given against them, and `tasks.config` reads them to refuse a bad value
    # before any work.
    option_ranges: ClassVar[dict[str, Range | Choice]] = {}
    # Whether the decoder can train on a trained sequential model's backbone (`train.init_from`),
    # adding only its own modules, as Stern et al. add proposal heads to a trained model: then its
    # greedy output, and so its quality, can stay the sequential model's. tasks.compare starts such
    # a decoder from its sequential row's checkpoint, with a `freeze_backbone` option set, by default.
    builds_on_sequential: ClassVar[bool] = False
    # Whether it can train only that way: it never trains a backbone of its own (onestep).
    needs_trained_backbone: ClassVar[bool] = False

    def __init__(self, backbone_config: T5Config, special: SpecialTokens, **options: Any):
        """`options`: the subclass's options, checked against `option_ranges` (ValueError)."""
        super().__init__()
        problem = self.options_problem(options)
        if problem is not None:
            raise ValueError(problem)
        self.backbone_config = backbone_config
        self.special = special

    @classmethod
    def options_problem(cls, options: Mapping[str, Any]) -> str | None:
        """The message for the first of `options` outside its `option_ranges` entry (naming
        `decoder.<option>`, the allowed values and the value), or None if all are allowed."""
        for name, allowed in cls.option_ranges.items():
            if name in options:
                problem = allowed.problem(f"decoder.{name}", options[name], options)
                if problem is not None:
                    return problem
        return None

    @abc.abstractmethod
    def layout(self, targets: list[list[list[int]]]) -> dict[str, torch.Tensor]:
        """Turn a batch of target subsequences ([example][subsequence] -> ids) into training tensors."""
        raise NotImplementedError

    @abc.abstractmethod
    def loss(self, model: T5ForConditionalGeneration, input_ids: torch.Tensor,
             attention_mask: torch.Tensor, layout: dict[str, torch.Tensor]) -> torch.Tensor:
        """Scalar training loss of a batch, given the tensors `layout` built for it."""
        raise NotImplementedError

    @abc.abstractmethod
    def generate(self, model: T5ForConditionalGeneration, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor) -> DecodeOutput:
        """Decode a batch of encoder inputs `(B, source_len)`."""
        raise NotImplementedError

    def trains_backbone(self) -> bool:
        """Whether training updates the backbone's weights; False when only the decoder's own
        modules learn (a frozen backbone), which is all a fit of it costs beyond that backbone's."""
        return True

    def calls_for_output(self, subsequences: list[list[int]]) -> int | None:
        """Decoder calls this decoder takes to produce exactly `subsequences` (ids, no end or
        separator tokens) in full, ignoring its length and step bounds; None when the count depends
        on the model as well as on the output (blockwise: how many proposals are accepted), or when
        the decoder cannot produce that output at all (pipelined under the paper's stopping rule
        with delay > 1: every subsequence it started ended before the next one's start).

        Counted on references, it is what a model that reproduces them would need: the saving the
        decoder's structure allows on a dataset, measurable without training (tasks.reference_calls).
        """
        return None

    @classmethod
    def can_decode_checkpoint_of(cls, trained: type["Decoder"]) -> bool:
        """Whether a backbone trained with decoder class `trained` can be decoded by this one: true
        when both train the backbone on the same layout (`layout_family`), e.g. sequential decoding
        of a blockwise-trained base head. Extra modules this decoder needs must be in the checkpoint."""
        return trained.layout_family == cls.layout_family


# ---- helpers shared by the decoders -------------------------------------------------------------

def encode(model: T5ForConditionalGeneration, input_ids: torch.Tensor,
           attention_mask: torch.Tensor) -> torch.Tensor:
    """Run the encoder once per batch; every decoder call reuses its output `(B, source_len, d_model)`."""
    return model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


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


def pad_batch(rows: list[list[int]], pad_value: int) -> torch.Tensor:
    """Right-pad integer rows to one `(len(rows), longest)` long tensor."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), pad_value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def split_on(tokens: list[int], sep: int) -> list[list[int]]:
    """Split a flat token list at `sep` into non-empty subsequences."""
    parts, current = [], []
    for tok in tokens:
        if tok == sep:
            if current:
                parts.append(current)
            current = []
        else:
            current.append(tok)
    if current:
        parts.append(current)
    return parts


def new_cache() -> EncoderDecoderCache:
    """An empty key/value cache for T5's decoder (self-attention and cross-attention parts)."""
    return EncoderDecoderCache(DynamicCache(), DynamicCache())


# Fill value of per-position output buffers where no token was produced (every token id is >= 0).
NOT_PRODUCED = -1


def split_flat_output(tokens: list[int], special: SpecialTokens) -> tuple[list[list[int]], bool]:
    """A flat-layout output (s_1 <sep> s_2 ... </s>) -> (its subsequences up to the first end token,
    whether it had one). Without an end token the output was cut by a bound."""
    if special.eos in tokens:
        return split_on(tokens[: tokens.index(special.eos)], special.sep), True
    return split_on(tokens, special.sep), False


def gather_self_attention_cache(cache: EncoderDecoderCache, order: torch.Tensor) -> None:
    """Keep, for each row b, the self-attention cache slots `order[b]` ((live, K') long), in that
    order, in every layer: drops slots a row does not need (padding, rejected proposals) and packs
    the rest to the front. The cross-attention part (the encoder's keys/values) is untouched."""
    for layer in cache.self_attention_cache.layers:
        index = order[:, None, :, None].expand(-1, layer.keys.size(1), -1, layer.keys.size(-1))
        layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)


def read_back(*tensors: torch.Tensor) -> list[list]:
    """Every tensor's values as (nested) lists, in ONE device -> host transfer (one sync point):
    a decode's results are read back once, at the end."""
    flat = torch.cat([t.reshape(-1).long() for t in tensors]).tolist()
    out, start = [], 0
    for t in tensors:
        out.append(_nested(flat[start:start + t.numel()], list(t.shape)))
        start += t.numel()
    return out


def _nested(flat: list, shape: list[int]) -> list:
    """A flat list in row-major order as nested lists of `shape` (on the host, no tensor)."""
    if len(shape) <= 1:
        return flat
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nested(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


class LiveRows:
    """The rows of a batch still being decoded, and the one host synchronisation per decoder call.

    On a GPU every read of a device value (`.item()`, `.tolist()`, `bool(t)`, `nonzero`, boolean
    masks) stalls the queue, so a decoding loop keeps its bookkeeping in tensors, written through
    `index` (each live row's original position: tensor indexing, no sync), and reads back once per
    call, here: which rows finished (plus, optionally, one small tensor the loop needs on the host
    for the next call's shapes). Finished rows leave the batch and the cache, so they cost nothing
    in later calls. Results are read back once, at the end.
    """

    def __init__(self, batch_size: int, device: torch.device):
        self.index = torch.arange(batch_size, device=device)   # (live,) original row of each live row
        self.values: list[int] = []                            # the `also` read back, for kept rows
        self.kept: list[int] = list(range(batch_size))         # kept rows' positions in the last call

    def drop_finished(self, finished: torch.Tensor, cache: EncoderDecoderCache | None,
                      *row_tensors: torch.Tensor, also: torch.Tensor | None = None):
        """Read back `finished` (live,) bool, with `also` (live,) ints if given, in ONE transfer;
        drop the finished rows from `index`, the cache and every tensor of `row_tensors` (each
        (live, ...)). Returns the kept tensors, or None when no row is left."""
        flags = finished.long() if also is None else torch.stack([finished.long(), also.long()])
        read = flags.tolist()                                   # the sync point of this call
        done, values = (read, None) if also is None else read
        if all(done):
            return None
        kept = [row for row, d in enumerate(done) if not d]
        self.kept = kept
        if len(kept) < len(done):
            # right after the read-back nothing is queued, so this host -> device copy waits for nothing
            keep = torch.tensor(kept, device=finished.device)
            self.index = self.index[keep]
            if cache is not None:
                cache.batch_select_indices(keep)
            row_tensors = tuple(t[keep] for t in row_tensors)
            values = None if values is None else [values[row] for row in kept]
        self.values = values or []
        return row_tensors


# ---- running T5's decoder blocks with a custom self-attention structure --------------------------
# T5 adds both `position_bias` and `attention_mask` to the attention scores of every layer, so one
# precomputed (B, heads, queries, keys) tensor = relative-position bias + visibility mask (a large
# negative value where hidden) gives a decoder any attention structure, through the backbone's own
# weights, under eager and sdpa attention alike (see `run_decoder` for why it goes in as the mask).

# Attention implementations that add an arbitrary float mask to the scores (flash kernels do not).
STRUCTURED_ATTENTION = ("eager", "sdpa")

def relative_position_bias(model: T5ForConditionalGeneration, distance: torch.Tensor,
                           bidirectional: bool = False) -> torch.Tensor:
    """T5's decoder position bias for `distance` = how far each key lies in the past of each query
    (negative: in the future, which only `bidirectional` bucketing tells apart).

    distance: (B, queries, keys) ints -> (B, heads, queries, keys). Uses T5's own bucketing and the
    first decoder layer's bias table (only layer 0 owns one).
    """
    attention = model.decoder.block[0].layer[0].SelfAttention
    buckets = attention._relative_position_bucket(
        -distance, bidirectional=bidirectional, num_buckets=attention.relative_attention_num_buckets,
        max_distance=attention.relative_attention_max_distance)
    return attention.relative_attention_bias(buckets).permute(0, 3, 1, 2)


def past_distance_bias_table(model: T5ForConditionalGeneration, longest: int) -> torch.Tensor:
    """(longest + 1, heads) T5 decoder bias of past distances 0..longest. Computed once per
    `generate` (T5's bucketing takes logarithms), so that each decoder call only gathers from it:
    `table[distance].permute(0, 3, 1, 2)` is `relative_position_bias(model, distance)`."""
    distance = torch.arange(longest + 1, device=model.device)[None, :, None]   # (1, D, 1)
    return relative_position_bias(model, distance)[0, :, :, 0].T                # (D, heads)


def hidden_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, queries, keys) bool -> (B, 1, queries, keys) additive mask: 0 where visible."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(
        ~visible, torch.finfo(dtype).min)[:, None]


def run_decoder(model: T5ForConditionalGeneration, input_ids: torch.Tensor, self_bias: torch.Tensor,
                encoder_states: torch.Tensor, encoder_mask: torch.Tensor,
                cache: EncoderDecoderCache | None = None,
                position_embeddings: torch.Tensor | None = None) -> torch.Tensor:
    """T5's decoder stack with a precomputed self-attention bias (relative bias + visibility mask).

    input_ids: (B, Q) new tokens; self_bias: (B, heads, Q, keys) where keys = cached + Q tokens;
    encoder_mask: (B, source_len) 1/0 padding mask. Returns the final hidden states (B, Q, d_model).
    With a cache, the new tokens' keys/values are appended to it, in order. `position_embeddings`
    ((B or 1, Q, d_model)), if given, are added to the token embeddings (T5 itself has none).
    """
    implementation = model.config._attn_implementation
    if implementation not in STRUCTURED_ATTENTION:
        raise ValueError(f"a custom decoder attention structure needs attn_implementation in "
                         f"{STRUCTURED_ATTENTION}; the backbone was loaded with {implementation!r}")
    decoder = model.decoder
    cross_mask = hidden_mask(encoder_mask[:, None, :].bool(), encoder_states.dtype)  # (B, 1, 1, S)
    embedded = decoder.embed_tokens(input_ids)
    if position_embeddings is not None:
        embedded = embedded + position_embeddings
    hidden = decoder.dropout(embedded)
    # The structure goes in as the self-attention *mask*, never as a None mask: under sdpa a decoder
    # self-attention without a mask is run as causal (cached keys beyond the query count are even
    # cropped), which would silently replace the structure. `position_bias` must not be None
    # either, or layer 0 adds T5's own 1-D relative bias; a broadcast zero adds nothing.
    no_extra_bias = self_bias.new_zeros((1, 1, 1, 1))
    for block in decoder.block:
        hidden = block(hidden, attention_mask=self_bias, position_bias=no_extra_bias,
                       encoder_hidden_states=encoder_states, encoder_attention_mask=cross_mask,
                       past_key_values=cache)[0]
    return decoder.dropout(decoder.final_layer_norm(hidden))
