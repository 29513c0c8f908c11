"""A trained checkpoint, from Python: load it once, predict the targets of new records.

    from tasks.predictor import Predictor

    predictor = Predictor("mlruns/artifacts/RUN_ID/checkpoints/epoch9-step630.ckpt",
                          decoder="pipelined", batch_size=16, device="cpu")
    predictor.predict([{"title": "...", "abstract": "..."}])
    # -> [{"title": "...", "abstract": "...", "keyphrases": ["...", ...]}]

What `python -m tasks.predict` does, which is a thin layer over this class: the model, its
tokenizer and its decoder come from the checkpoint alone (no data set is read); each record is a
record of the task's schema without its target, returned in order with its target field
(`keyphrases`, `answers`, `summary`) set to the decoded subsequences, every other field kept.
"""
from __future__ import annotations

from functools import cached_property
from typing import Iterable, Sequence

from datamodules.datamodule import Encoded, collate, encode_sources
from datamodules.schema import validate_record
from tasks.cli import log
from tasks.config import ConfigError
from tasks.module import GenerationTask
from tasks.runs.checkpoints import load_checkpoint
from tasks.runs.restore import checkpoint_config, restore_module
from tasks.runs.trainer import decode_target

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


class Predictor:
    """A checkpoint written by `tasks.fit`, restored to predict.

    Args:
        checkpoint: the checkpoint's path.
        decoder: another decoder of the trained layout (e.g. "lookup" for a sequential checkpoint;
            "aggressive" also needs `overrides=["decoder.drafter=NAR_CKPT"]`).
        stop_rule: the pipelined decoder's stopping rule ("first_empty" or "all_end").
        batch_size: decoding batch size (default: the checkpoint's `eval.batch_size`).
        device: "cpu", "cuda" (or "gpu"), "mps" or "auto" (default: the checkpoint's trainer
            setting).
        precision: a Lightning precision ("32-true", "64-true", "bf16-mixed", "bf16-true").
        overrides: further `key=value` configuration overrides, as on the command line.
        config_file: a YAML file merged before the overrides, as `--config`.

    Errors in the settings come at construction, before any model is built, as
    `tasks.config.ConfigError` (a bad checkpoint, an unknown decoder, a bad value); the model is
    restored at the first `predict` (or `module`); a record without its source fields is refused
    by `predict` with `datamodules.schema.DataError`.
    """

    def __init__(self, checkpoint: str, *, decoder: str | None = None,
                 stop_rule: str | None = None, batch_size: int | None = None,
                 device: str | None = None, precision: str | None = None,
                 overrides: Sequence[str] = (), config_file: str | None = None):
        self.checkpoint = checkpoint
        self.stored = load_checkpoint(checkpoint)
        options = predictor_overrides(decoder, stop_rule, batch_size, device, precision)
        self.cfg = checkpoint_config(self.stored, checkpoint, [*overrides, *options], config_file)
        self.target = decode_target(self.cfg)   # the device and precision, checked

    @property
    def task(self) -> str:
        """The task the checkpoint was trained for: "keyphrase", "qa" or "summarization"."""
        return self.cfg.task.name

    @cached_property
    def module(self) -> GenerationTask:
        """The task module (backbone, decoder, tokenizer) with the checkpoint's weights."""
        return restore_module(self.stored, self.checkpoint, self.cfg)

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
