"""A trained model, from Python: load it once, predict the targets of new records.

    from tasks.predictor import Predictor

    predictor = Predictor.from_checkpoint("mlruns/artifacts/RUN_ID/checkpoints/epoch9-step630.ckpt",
                                          decoder="pipelined", batch_size=16, device="cpu")
    predictor.predict([{"title": "...", "abstract": "..."}])
    # -> [{"title": "...", "abstract": "...", "keyphrases": ["...", ...]}]

    # any model of a type the decoders run (T5, BART, Pegasus, ...) that transformers'
    # save_pretrained wrote (or a hub id), with a decoder that needs no
    # training: exactly its greedy `generate` output, as text
    t5 = Predictor.from_pretrained("google-t5/t5-small", task="summarization", decoder="lookup")

What `python -m tasks.predict` does, which is a thin layer over this class: the model, its
tokenizer and its decoder come from the checkpoint (or the pretrained model's folder) alone, no data set is read;
each record is a record of the task's schema without its target, returned in order with its
target field (`keyphrases`, `answers`, `summary`) set to the decoded subsequences (a model trained
elsewhere writes no separator: its whole output is one), every other field kept.
"""
from __future__ import annotations

from functools import cached_property
from typing import Callable, Iterable, Sequence

from omegaconf import DictConfig
from transformers import T5Config

from datamodules.datamodule import Encoded, collate, encode_sources
from datamodules.schema import validate_record
from datamodules.tokenizer import load_pretrained
from datamodules.vocabulary import SpecialTokens
from decoders import available, build_decoder, decoder_class
from decoders.sequential import SequentialDecoder
from tasks.cli import log
from tasks.config import ConfigError, compose
from tasks.models import check_pretrained_model_type
from tasks.module import GenerationTask
from tasks.runs.checkpoints import load_checkpoint
from tasks.runs.restore import checkpoint_config, restore_module
from tasks.runs.trainer import build_module, decode_target

# device name -> trainer.accelerator
DEVICES = {"cpu": "cpu", "cuda": "gpu", "gpu": "gpu", "mps": "mps", "auto": "auto"}


def predictor_overrides(decoder: str | None = None, stop_rule: str | None = None,
                        batch_size: int | None = None, device: str | None = None,
                        precision: str | None = None) -> list[str]:
    """The configuration overrides that the Predictor's keyword arguments stand for; each value is
    checked with the rest of the configuration (`checkpoint_config`), the device here."""
    overrides = []
    if decoder is not None:
        overrides.append(f"decoder={decoder}")
    if stop_rule is not None:
        overrides.append(f"decoder.stop_rule={stop_rule}")
    if batch_size is not None:
        overrides.append(f"eval.batch_size={batch_size}")
    if device is not None:
        if device not in DEVICES:
            raise ConfigError(f"device {device!r} is not one of {', '.join(DEVICES)}")
        overrides.append(f"trainer.accelerator={DEVICES[device]}")
    if precision is not None:
        overrides.append(f"trainer.precision={precision}")
    return overrides


def decoders_without_training() -> list[str]:
    """The decoders that decode a model trained by anyone, as it is: of the sequential layout, with no
    weights of their own and no second model to draft with."""
    def weightless(name: str) -> bool:
        probe = build_decoder(name, T5Config(), SpecialTokens(pad=0, eos=1, unk=2, sep=3, mask=4,
                                                              start=0))
        return not any(True for _ in probe.parameters())
    return [name for name in available()
            if decoder_class(name).can_decode_checkpoint_of(SequentialDecoder)
            and not decoder_class(name).drafts_with and weightless(name)]


class Predictor:
    """A trained model, restored to predict: `Predictor.from_checkpoint` (a `tasks.fit`
    checkpoint) or `Predictor.from_pretrained` (a model trained elsewhere).

    Errors in the settings come when it is made, before any model is built, as
    `tasks.config.ConfigError` (a bad checkpoint, an unknown decoder, a bad value); the model is
    restored at the first `predict` (or `module`); a record without its source fields is refused
    by `predict` with `datamodules.schema.DataError`.
    """

    def __init__(self, cfg: DictConfig, restore: Callable[[], GenerationTask]):
        self.cfg = cfg
        self.target = decode_target(cfg)   # the device and precision, checked
        self._restore = restore

    @classmethod
    def from_checkpoint(cls, checkpoint: str, *, decoder: str | None = None,
                        stop_rule: str | None = None, batch_size: int | None = None,
                        device: str | None = None, precision: str | None = None,
                        overrides: Sequence[str] = (), config_file: str | None = None) -> "Predictor":
        """A checkpoint written by `tasks.fit`.

        Args:
            checkpoint: the checkpoint's path.
            decoder: another decoder of the trained layout (e.g. "lookup" for a sequential
                checkpoint; "aggressive" also needs `overrides=["decoder.drafter=NAR_CKPT"]`).
            stop_rule: the pipelined decoder's stopping rule ("first_empty" or "all_end").
            batch_size: decoding batch size (default: the checkpoint's `eval.batch_size`).
            device: "cpu", "cuda" (or "gpu"), "mps" or "auto" (default: the checkpoint's
                trainer setting).
            precision: a Lightning precision ("32-true", "64-true", "bf16-mixed", "bf16-true").
            overrides: further `key=value` configuration overrides, as on the command line.
            config_file: a YAML file merged before the overrides, as `--config`.
        """
        stored = load_checkpoint(checkpoint)
        options = predictor_overrides(decoder, stop_rule, batch_size, device, precision)
        cfg = checkpoint_config(stored, checkpoint, [*overrides, *options], config_file)
        return cls(cfg, lambda: restore_module(stored, checkpoint, cfg))

    @classmethod
    def from_pretrained(cls, model: str, *, task: str, decoder: str | None = None,
                        batch_size: int | None = None, device: str | None = None,
                        precision: str | None = None, overrides: Sequence[str] = (),
                        config_file: str | None = None) -> "Predictor":
        """A model trained elsewhere, of a type the decoders run (`decoders.families`): a folder
        that transformers' `save_pretrained` wrote (its `config.json`, weights and tokenizer
        files), or a hub id (fetched, or read from the local cache; offline, a hub id not in the
        cache fails with a message saying so). It decodes with a decoder that needs no training
        (`decoders_without_training()`: sequential, the default, and lookup), exactly as its
        greedy `generate` does with its extras switched off; `task` says which record fields are
        its source and which one receives its output.

        The other arguments are `from_checkpoint`'s; `overrides` may set e.g. the output bound
        (`decoder.max_new_tokens=128`) or `data.max_source_length`.
        """
        options = predictor_overrides(None, None, batch_size, device, precision)
        cfg = compose(task, decoder, config_file, ["model=pretrained", f"model.hub_id={model}",
                                                   *overrides, *options])
        allowed = decoders_without_training()
        if cfg.decoder.name not in allowed:
            raise ConfigError(f"decoder {cfg.decoder.name!r} cannot decode a model trained elsewhere "
                              f"(it needs weights or a drafter of its own); decoders that need no "
                              f"training: {', '.join(allowed)}")
        check_pretrained_model_type(cfg.model)   # here: a model the decoders do not run is refused,
        tokenizer = load_pretrained(model)       # and a bad folder or an unreachable hub id fails
        return cls(cfg, lambda: build_module(cfg, tokenizer))

    @property
    def task(self) -> str:
        """The task the checkpoint was trained for: "keyphrase", "qa" or "summarization"."""
        return self.cfg.task.name

    @cached_property
    def module(self) -> GenerationTask:
        """The task module: backbone with its weights, decoder, tokenizer."""
        return self._restore()

    def predict(self, records: Iterable[dict], desc: str = "predicting") -> list[dict]:
        """Each record (the task's source fields; any other field is kept) with its predicted
        target field set, in input order; sources longer than `data.max_source_length` are cut
        as in training."""
        records = [validate_record(self.task, record, f"record {number}", source_only=True)
                   for number, record in enumerate(records, start=1)]
        if not records:
            return []
        tokenizer, limit = self.module.tokenizer, self.cfg.data.max_source_length
        sources, truncated = encode_sources(tokenizer, self.task, records, limit)
        if truncated:
            log.warning("%d of %d sources truncated to data.max_source_length=%d tokens",
                        truncated, len(records), limit)
        examples = [Encoded(index, source, []) for index, source in enumerate(sources)]
        size = self.cfg.eval.batch_size
        batches = [collate(examples[start:start + size], tokenizer.pad_token_id)
                   for start in range(0, len(examples), size)]
        return self.target.predict(self.module, records, batches, desc)
