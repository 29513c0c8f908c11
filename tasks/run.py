"""Wiring shared by the entry points: config -> data -> task module -> trainer -> MLflow."""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import MLFlowLogger
from omegaconf import DictConfig

from datamodules.datamodule import SubsequenceDataModule
from datamodules.schema import DataError
from datamodules.tokenizer import TokenizerError, special_tokens
from decoders import build_decoder
from tasks.config import ConfigError, flatten, to_yaml
from tasks.models import ModelError, build_backbone
from tasks.module import TASK_MODULES, GenerationTask, write_jsonl

log = logging.getLogger("tasks")

# Errors that mean "the input is wrong": printed as one clear line, without a traceback.
USER_ERRORS = (ConfigError, DataError, TokenizerError, ModelError)


@dataclass
class Built:
    datamodule: SubsequenceDataModule
    module: GenerationTask


def decoder_options(cfg: DictConfig) -> dict:
    return {k: v for k, v in cfg.decoder.items() if k != "name"}


def build(cfg: DictConfig, tokenizer=None) -> Built:
    """Data (records, tokenizer, encoded splits), then the backbone, the decoder and the task module."""
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = SubsequenceDataModule(cfg, tokenizer=tokenizer)
    datamodule.setup()
    backbone = build_backbone(cfg.model, datamodule.tokenizer)
    decoder = build_decoder(cfg.decoder.name, backbone.config, special_tokens(datamodule.tokenizer),
                            **decoder_options(cfg))
    module = TASK_MODULES[cfg.task.name](cfg, backbone, decoder, datamodule.tokenizer)
    return Built(datamodule, module)


def open_tracking(cfg: DictConfig, run_name: str, tags: dict | None = None,
                  run_id: str | None = None) -> MLFlowLogger:
    """The MLflow logger of one run; fails before any training if the store cannot be opened."""
    from mlflow.tracking import MlflowClient
    if cfg.tracking.uri.startswith("sqlite:///"):
        Path(cfg.tracking.uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    try:
        MlflowClient(cfg.tracking.uri).search_experiments(max_results=1)
    except Exception as err:  # any failure here means the store is unusable
        raise ConfigError(f"cannot open tracking.uri={cfg.tracking.uri!r}: "
                          f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from err
    artifacts = Path(cfg.tracking.artifact_location).resolve()
    artifacts.mkdir(parents=True, exist_ok=True)
    return MLFlowLogger(experiment_name=cfg.tracking.experiment or cfg.task.name, run_name=run_name,
                        tracking_uri=cfg.tracking.uri, artifact_location=artifacts.as_uri(),
                        tags=tags, run_id=run_id)


def default_run_name(cfg: DictConfig) -> str:
    return cfg.tracking.run_name or f"{cfg.decoder.name} {cfg.model.name} {cfg.data.source}"


def make_trainer(cfg: DictConfig, logger: MLFlowLogger | None, callbacks=()) -> L.Trainer:
    return L.Trainer(**cfg.trainer, logger=logger if logger is not None else False,
                     callbacks=list(callbacks), enable_autolog_hparams=False,
                     enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks))


def run_folder(cfg: DictConfig, logger: MLFlowLogger) -> Path:
    """The run's own folder in the artifact store; checkpoints live in `checkpoints/` under it."""
    return Path(cfg.tracking.artifact_location).resolve() / logger.run_id


def log_artifacts(logger: MLFlowLogger, cfg: DictConfig, rows: list[dict] | None) -> None:
    """The resolved config and, when there are any, the predictions, as artifacts of the run."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.yaml").write_text(to_yaml(cfg))
        logger.experiment.log_artifact(logger.run_id, str(Path(tmp) / "config.yaml"))
        if rows is not None:
            write_jsonl(rows, Path(tmp) / "predictions.jsonl")
            logger.experiment.log_artifact(logger.run_id, str(Path(tmp) / "predictions.jsonl"))


def log_params(logger: MLFlowLogger, cfg: DictConfig, datamodule: SubsequenceDataModule) -> None:
    params = flatten(cfg)
    for split, report in datamodule.truncation.items():
        params[f"data_report.{split}.examples"] = report.examples
        params[f"data_report.{split}.sources_truncated"] = report.sources_truncated
        params[f"data_report.{split}.subsequences_truncated"] = report.subsequences_truncated
        params[f"data_report.{split}.subsequences_dropped"] = report.subsequences_dropped
    logger.log_hyperparams(params)


@dataclass
class Trained:
    built: Built
    logger: MLFlowLogger
    checkpoint: str
    scores: dict[str, float]


def train_and_test(cfg: DictConfig, tags: dict | None = None) -> Trained:
    """Fit with validation each epoch, keep the best checkpoint by the task's primary metric, decode
    and score the test split with it, and log params, metrics, config and predictions to MLflow."""
    logger = open_tracking(cfg, default_run_name(cfg), tags=tags)  # fails here if unusable
    built = build(cfg)
    log_params(logger, cfg, built.datamodule)
    checkpoint = ModelCheckpoint(dirpath=run_folder(cfg, logger) / "checkpoints",
                                 filename="epoch{epoch}-step{step}", auto_insert_metric_name=False,
                                 monitor=built.module.primary_metric, mode="max", save_top_k=1,
                                 save_last=True)
    trainer = make_trainer(cfg, logger, callbacks=[checkpoint])
    trainer.fit(built.module, datamodule=built.datamodule)
    # The best checkpoint by the task's metric; the last one when the metric never rose above 0
    # (ties keep the earliest checkpoint, which would otherwise test a barely trained model).
    improved = checkpoint.best_model_score is not None and float(checkpoint.best_model_score) > 0
    best = checkpoint.best_model_path if improved else checkpoint.last_model_path
    trainer.test(built.module, datamodule=built.datamodule, ckpt_path=best or None, verbose=False)
    log_artifacts(logger, cfg, built.module.prediction_rows("test"))
    return Trained(built, logger, best, built.module.test_scores)


def base_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. trainer.max_epochs=3 "
                                                     "model=t5-small decoder.delay=2")
    parser.add_argument("--config", help="a YAML file merged after the config groups")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved configuration and exit")
    return parser


def main_guard(main) -> None:
    """Run an entry point; user errors become one clear line on stderr and exit code 2."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_float32_matmul_precision("high")
    try:
        main()
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
