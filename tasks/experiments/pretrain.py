"""Offline pretraining: a t5-tiny backbone and tokenizer, trained to denoise JSONL source texts.

Its checkpoint is the starting point of `tasks.fit ... train.init_from=CHECKPOINT`.

    python -m tasks.experiments.pretrain --data DIR[,DIR...] [--out CKPT] [--mask-ratio 0.3] [--mean-span 3]
        [--config FILE.yaml] [key=value ...]

The objective is BART's text infilling (`datamodules.denoising`, where the choice is argued): the
input is the text with about 30% of its tokens hidden, each hidden span behind one `<mask>`; the
target is the whole original text, so that the model learns to copy its input, which keyphrases
and answer spans are, and to fill in what the context implies. Texts are cut to their first
min(data.max_source_length, data.max_target_length) - 1 tokens. The target is one subsequence in
the sequential (flat) layout, trained with the sequential decoder's loss; every decoder later
starts from the same backbone.

Each folder's train.jsonl is trained on (its validation.jsonl, when present, gives the validation
loss), whatever task schema it holds; data.max_train_examples / data.max_eval_examples limit each
folder. The tokenizer is trained on the training texts as tasks.fit trains t5-tiny's.

The configuration is the library's (model.*, train.*, trainer.*, seed, tracking.*, the data.*
length and limit keys), checked before any work; the model is t5-tiny, from random weights. A fit
that starts from the checkpoint must use the same model.* settings (`train.init_from` checks them),
and takes the checkpoint's tokenizer with the weights.

A checkpoint is written at the end of every epoch, atomically, to --out (default:
<tracking.artifact_location>/<run id>/checkpoints/last.ckpt). The MLflow run (experiment "pretrain"
unless tracking.experiment says otherwise) has the configuration and the denoising settings as
parameters, train/loss and val/loss as metrics, each folder's splits as dataset inputs, and the
configuration as an artifact.
"""
from __future__ import annotations

import time
from functools import partial
from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint

from datamodules.denoising import DenoisingDataModule
from datamodules.sources import usable_folder
from datamodules.vocabulary import Range
from tasks.config import ConfigError, compose, flatten, to_yaml
from tasks.module import BackboneTraining
from tasks.cli import base_parser, log, main_guard
from tasks.runs.tracking import (ExceptionWatcher, experiment_name, log_artifacts,
                                 log_dataset_inputs, mlflow_dataset, open_tracking, run_folder,
                                 run_link, run_status)
from tasks.runs.trainer import build, check_trainer, make_trainer

EXPERIMENT = "pretrain"
# the denoising settings (command-line flags), with the values they take
SETTING_RANGES = {"mask_ratio": Range(gt=0, lt=1, integer=False),
                  "mean_span": Range(ge=1, integer=False)}


class DenoisingPretraining(BackboneTraining):
    """Trains as a task module does; validation is the loss on the validation texts (decoding
    whole texts would measure nothing the loss does not, at far greater cost). The checkpoint
    also records how it was pretrained."""

    def __init__(self, cfg, backbone, decoder, tokenizer, pretraining: dict):
        super().__init__(cfg, backbone, decoder, tokenizer)
        self.pretraining = pretraining

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.batch_loss(batch), prog_bar=True, sync_dist=True,
                 batch_size=batch["input_ids"].size(0))

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["pretraining"] = self.pretraining


def pretrain_config(args):
    """The checked configuration: the library's, for t5-tiny and the sequential layout, in the
    "pretrain" experiment unless one is set."""
    cfg = compose(None, None, args.config, args.overrides)
    if cfg.model.name != "t5-tiny":
        raise ConfigError(f"model={cfg.model.name}: tasks.experiments.pretrain trains model=t5-tiny from random "
                          f"weights (a pretrained model is fitted directly)")
    if cfg.decoder.name != "sequential":
        raise ConfigError(f"decoder={cfg.decoder.name}: tasks.experiments.pretrain trains the sequential layout "
                          f"(every decoder's fit can start from it)")
    if cfg.train.init_from is not None:
        raise ConfigError("train.init_from: tasks.experiments.pretrain starts from random weights; leave it unset")
    for name, allowed in SETTING_RANGES.items():
        problem = allowed.problem(f"--{name.replace('_', '-')}", getattr(args, name), {})
        if problem is not None:
            raise ConfigError(problem)
    if cfg.tracking.experiment is None:
        cfg.tracking.experiment = EXPERIMENT
    return cfg


def data_folders(text: str) -> list[Path]:
    folders = [Path(part.strip()) for part in text.split(",") if part.strip()]
    if not folders:
        raise ConfigError(f"--data {text!r} names no folder")
    return list(dict.fromkeys(folders))  # a folder named twice is read once


def checkpoint_writer(out: Path | None, default_folder: Path | None) -> ModelCheckpoint:
    """Writes the checkpoint at the end of every epoch (through SafeCheckpointIO: atomically) to
    `out`, or to last.ckpt in `default_folder`; a file already there is replaced."""
    folder, name = (out.parent, out.stem) if out is not None else (default_folder, "last")
    writer = ModelCheckpoint(dirpath=folder, filename=name, save_top_k=1, enable_version_counter=False)
    if out is not None:
        writer.FILE_EXTENSION = out.suffix  # Lightning would write NAME.ckpt
    return writer


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="comma-separated JSONL folders, each with a "
                                                      "train.jsonl (and a validation.jsonl)")
    parser.add_argument("--out", help="the checkpoint file (default: last.ckpt in the run's folder)")
    parser.add_argument("--mask-ratio", type=float, default=0.3,
                        help="the share of each text's tokens hidden (BART: 0.3)")
    parser.add_argument("--mean-span", type=float, default=3.0,
                        help="the mean length of a hidden span, in tokens (BART: 3)")
    args = parser.parse_intermixed_args(argv)  # key=value overrides may come anywhere
    cfg = pretrain_config(args)
    if args.print_config:
        print(to_yaml(cfg))
        return {}

    started = time.perf_counter()
    # everything that can be checked before the data is read and the tokenizer trained
    datamodule = DenoisingDataModule(cfg, data_folders(args.data), args.mask_ratio, args.mean_span)
    out = None if args.out is None else Path(args.out).resolve()
    if out is not None:
        usable_folder(out.parent, "--out", ConfigError)
    check_trainer(cfg)
    folders = [f"{folder.path.resolve()} ({folder.task})" for folder in datamodule.folders]
    settings = {"objective": "text infilling", "data": folders, "mask_ratio": args.mask_ratio,
                "mean_span": args.mean_span, "window": datamodule.window}
    logger = open_tracking(cfg, cfg.tracking.run_name or
                           f"pretrain {cfg.model.name} {'+'.join(f.path.name for f in datamodule.folders)}",
                           tags={"role": "pretrain"})  # fails here if unusable
    built = build(cfg, datamodule=datamodule,
                  module_class=partial(DenoisingPretraining, pretraining=settings))
    watcher = ExceptionWatcher()
    with run_status(logger, watcher):  # the MLflow run exists from here on
        params = flatten(cfg)
        params.update({f"pretrain.{key}": value for key, value in settings.items()})
        for folder in datamodule.folders:
            for split in folder.records:
                params.update({f"data_report.{folder.path.name}.{split}.texts": len(folder.sources[split]),
                               f"data_report.{folder.path.name}.{split}.truncated": folder.truncated[split]})
        logger.log_hyperparams(params)
        log_dataset_inputs(logger, [
            (mlflow_dataset(folder.path.name, records, "local",
                            {"uri": str(folder.path.resolve() / f"{split}.jsonl")}), split)
            for folder in datamodule.folders for split, records in folder.records.items()])
        writer = checkpoint_writer(out, run_folder(cfg, logger.run_id) / "checkpoints"
                                   if logger.run_id else None)
        trainer = make_trainer(cfg, logger, callbacks=[writer, watcher])
        trainer.fit(built.module, datamodule=datamodule)
        log_artifacts(logger, cfg, None)
    checkpoint = writer.best_model_path  # the one file it writes (no metric to rank by)
    losses = {key: float(trainer.callback_metrics[key]) for key in ("train/loss", "val/loss")
              if key in trainer.callback_metrics}
    log.info("losses at the end: %s", ", ".join(f"{k}={v:.4f}" for k, v in sorted(losses.items())))
    log.info("checkpoint: %s (start a fit from it with train.init_from=%s and the same model.* "
             "settings)", checkpoint, checkpoint)
    log.info("MLflow run %s in experiment %r (%s); wall time %.1fs", logger.run_id,
             experiment_name(cfg), cfg.tracking.uri, time.perf_counter() - started)
    log.info("in the MLflow UI: %s", run_link(cfg, logger))
    return {"run_id": logger.run_id, "checkpoint": checkpoint, "losses": losses}


if __name__ == "__main__":
    main_guard(main)
