"""The decoder plug-in interface.

A decoder owns three things and nothing else (docs/design.md, "The decoder interface"):

1. the *target layout*: how the target subsequences of a batch (token-id lists: keyphrases, answer
   spans, summary sentences) become training tensors;
2. the *training loss*, given the backbone and that layout; extra trainable modules (proposal heads,
   a length predictor) are ordinary submodules of the decoder, so they are trained, checkpointed and
   moved to the device with the task module that holds it;
3. *generation*: encoder inputs in, per example the generated subsequences plus the work it took.

Tasks never look inside a decoder and decoders never look at a task. To add one, subclass `Decoder`
in a new file of this package and register it under the file's name: `@register("name")` in
`decoders/name.py` (see `decoders/__init__.py`). What decoders share beyond this interface lives
beside it, one concern per file: `backbone.py` (the backbone calls, in any family of `families/`) and `loop.py` (decoding-loop
bookkeeping).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from datamodules.vocabulary import Choice, Range, SpecialTokens
from decoders.backbone import compiled_encode, compiled_run_decoder, encode, run_decoder


@dataclass(frozen=True)
class Option:
    """One decoder option, declared once: its default, its allowed values (a `Range` or a `Choice`;
    None: any value of the default's type) and whether it only changes generation (`decode_only`:
    a trained model can be decoded with any value of it; `tasks.compare` sweeps such options
    without retraining). `Decoder.__init__` checks and stores every option from these declarations,
    and `tasks.config` reads the same ones for a decoder's configuration group and its checks."""

    default: Any
    allowed: Range | Choice | None = None
    decode_only: bool = False


# The output bound, one name and one default for every decoder: at most this many output tokens per
# example, the end token and separators included (the flat layout's count, so that every decoder is
# bounded alike). Its default is `data.max_target_length`'s (configs/default.yaml), which the decoder
# groups set it to; tests/test_config.py holds the two equal.
OUTPUT_BOUND = Option(96, Range(ge=1), decode_only=True)
# Former names of options, in configurations and checkpoints written before the rename.
RENAMED_OPTIONS = {"max_length": "max_new_tokens"}


@dataclass
class DecodeOutput:
    """What one `generate` call returns; every list has one entry per example, in input order."""

    subsequences: list[list[list[int]]]  # [example][subsequence] -> token ids, end/separator tokens removed
    decoder_calls: list[int]             # decoder forward passes the example took part in
    tokens: list[int]                    # tokens the decoder produced for the example (end tokens included)
    bound_hit: list[bool]            # stopped by a length/step bound rather than by its own end token
    batch_decoder_calls: int             # decoder forward passes for the whole batch
    stats: dict[str, float] = field(default_factory=dict)  # decoder-specific counters (summed over the batch)


class Decoder(nn.Module, abc.ABC):
    """Base class of every decoding strategy. `name` is set by `@register`.

    Subclasses declare their options once, in `options` (the keys of `configs/decoder/<name>.yaml`);
    the constructor takes them as keyword arguments, checks them and stores each as an attribute.
    """

    name: str = "abstract"
    # Decoders whose losses train the backbone on the same target layout share a family; by default
    # a decoder is its own family (set to the registered name).
    layout_family: str = ""
    # Every option of the decoder, in checking order (a bound naming another option comes after
    # that option): its default, allowed values and whether it is decode-only (`Option`).
    options: ClassVar[dict[str, Option]] = {}
    # Whether the decoder can train on a trained sequential model's backbone (`train.init_from`),
    # adding only its own modules, as Stern et al. add proposal heads to a trained model: then its
    # greedy output, and so its quality, can stay the sequential model's. tasks.compare starts such
    # a decoder from its sequential row's checkpoint, with a `freeze_backbone` option set, by default.
    builds_on_sequential: ClassVar[bool] = False
    # Whether it can train only that way: it never trains a backbone of its own (onestep).
    needs_trained_backbone: ClassVar[bool] = False
    # Whether it has nothing to train: no modules of its own, the layout and loss of the sequential
    # decoder, whose trained model it decodes as it is (lookup). tasks.fit refuses it; tasks.compare
    # gives its row the sequential row's model.
    trains_nothing: ClassVar[bool] = False
    # The decoder whose trained checkpoint its option `drafter` names, a second model a decode of it
    # drafts with (aggressive: "nar"); None when it needs none beyond the model it decodes.
    # tasks.test and tasks.predict load `decoder.drafter`; tasks.compare gives it the checkpoint of
    # that decoder's row.
    drafts_with: ClassVar[str | None] = None
    # Options every decoder takes beside its own, all decode-only; `build_decoder` applies them:
    # `compile` sets `compiled_calls`.
    shared_decode_options: ClassVar[tuple[str, ...]] = ("compile",)
    # Whether decoding runs the encoder pass and each decoder call's model step through
    # torch.compile (`encoder_pass`, `model_step`).
    compiled_calls: bool = False

    def __init__(self, backbone_config: PretrainedConfig, special: SpecialTokens, **given: Any):
        """`given`: values of the decoder's `options` (the others take their defaults), checked
        against their allowed values (ValueError naming the option, the allowed values and the
        value) and stored as attributes of the same names."""
        super().__init__()
        unknown = sorted(set(given) - set(self.options))
        if unknown:
            raise ValueError(f"decoder {self.name!r} has no option {', '.join(unknown)}; its options: "
                             f"{', '.join(self.options) or 'none'}")
        values = {name: given.get(name, option.default) for name, option in self.options.items()}
        problem = self.options_problem(values)
        if problem is not None:
            raise ValueError(problem)
        for name, value in values.items():
            setattr(self, name, value)
        self.backbone_config = backbone_config
        self.special = special

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every option's default, by name."""
        return {name: option.default for name, option in cls.options.items()}

    @classmethod
    def decode_only_options(cls) -> tuple[str, ...]:
        """Every option a trained model can be decoded with any value of: the decoder's own
        decode-only `options` and the `shared_decode_options`."""
        own = tuple(name for name, option in cls.options.items() if option.decode_only)
        return own + cls.shared_decode_options

    @classmethod
    def options_problem(cls, values: Mapping[str, Any]) -> str | None:
        """The message for the first of `values` outside its option's allowed values (naming
        `decoder.<option>`, the allowed values and the value), or None if all are allowed."""
        for name, option in cls.options.items():
            if name in values and option.allowed is not None:
                problem = option.allowed.problem(f"decoder.{name}", values[name], values)
                if problem is not None:
                    return problem
        return None

    @abc.abstractmethod
    def layout(self, targets: list[list[list[int]]]) -> dict[str, torch.Tensor]:
        """Turn a batch of target subsequences ([example][subsequence] -> ids) into training tensors."""
        raise NotImplementedError

    @abc.abstractmethod
    def loss(self, model: PreTrainedModel, input_ids: torch.Tensor,
             attention_mask: torch.Tensor, layout: dict[str, torch.Tensor]) -> torch.Tensor:
        """Scalar training loss of a batch, given the tensors `layout` built for it."""
        raise NotImplementedError

    @abc.abstractmethod
    def generate(self, model: PreTrainedModel, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor) -> DecodeOutput:
        """Decode a batch of encoder inputs `(B, source_len)`."""
        raise NotImplementedError

    def compiles(self) -> bool:
        """Whether this decode runs its calls' model step through torch.compile: `compiled_calls` is
        set and no gradient is recorded (training never compiles)."""
        return self.compiled_calls and not torch.is_grad_enabled()

    def encoder_pass(self) -> Callable[..., torch.Tensor]:
        """What a decode runs the backbone's encoder with, once per batch: `backbone.encode`, or,
        when it `compiles`, the encoder compiled in a few fixed shapes (`backbone.compiled_encode`)."""
        return compiled_encode if self.compiles() else encode

    def model_step(self) -> Callable[..., torch.Tensor]:
        """What a decoding loop runs the backbone's decoder layers with: `backbone.run_decoder`, or,
        when it `compiles`, that function through torch.compile for symbolic shapes
        (`backbone.compiled_run_decoder`). A loop that keeps its calls in a few fixed shapes compiles
        its own step for them (the verify loop: `backbone.fixed_shape_greedy_step`; sequential
        and pipelined: their `next_tokens` and `greedy_columns` through
        `backbone.fixed_shape_compiled`)."""
        return compiled_run_decoder() if self.compiles() else run_decoder

    def trains_backbone(self) -> bool:
        """Whether training updates the backbone's weights; False when only the decoder's own
        modules learn (a frozen backbone), which is all a fit of it costs beyond that backbone's, or
        when it trains nothing (`trains_nothing`)."""
        return not self.trains_nothing

    def calls_for_output(self, subsequences: list[list[int]]) -> int | None:
        """Decoder calls this decoder takes to produce exactly `subsequences` (ids, no end or
        separator tokens) in full, ignoring its length and step bounds; None when the count depends
        on the model as well as on the output (blockwise: how many proposals are accepted), or when
        the decoder cannot produce that output at all (pipelined under the paper's stopping rule
        with delay > 1: every subsequence it started ended before the next one's start).

        Counted on references, it is what a model that reproduces them would need: the saving the
        decoder's structure allows on a dataset, measurable without training (tasks.experiments.reference_calls).
        """
        return None

    @classmethod
    def inexact(cls, options: Mapping[str, Any]) -> bool:
        """Whether `options` relax a verification that otherwise keeps the output exactly its model's
        greedy output (top-k acceptance in the draft-and-verify decoders): tables label such rows."""
        return False

    @classmethod
    def can_decode_checkpoint_of(cls, trained: type["Decoder"]) -> bool:
        """Whether a backbone trained with decoder class `trained` can be decoded by this one: true
        when both train the backbone on the same layout (`layout_family`), e.g. sequential decoding
        of a blockwise-trained base head. Extra modules this decoder needs must be in the checkpoint."""
        return trained.layout_family == cls.layout_family
