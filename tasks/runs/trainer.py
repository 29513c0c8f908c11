"""Training and testing a configuration: the data, model and task module it builds, the Lightning
trainer it runs on (checked before any work), and a fit tested and tracked as one MLflow run."""
from __future__ import annotations

import logging
import re
import time
import warnings
from dataclasses import dataclass
from typing import ContextManager

import lightning as L
import torch
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig

from datamodules.datamodule import SubsequenceDataModule
from datamodules.sources import SPLITS
from datamodules.tokenizer import special_tokens
from decoders import build_decoder, decoder_class
from tasks.config import ConfigError
from tasks.models import build_backbone, check_pretrained_model_type
from tasks.module import TASK_MODULES, Evaluation, GenerationTask
from tasks.runs.checkpoints import (BestCheckpoint, Resume, SafeCheckpointIO, StoredModel,
                                    initial_weights)
from tasks.runs.tracking import (ExceptionWatcher, default_run_name, log_artifacts, log_params,
                                 open_tracking, reopen_run, run_folder, run_status)


@dataclass
class Built:
    datamodule: SubsequenceDataModule
    module: GenerationTask


def decoder_options(cfg: DictConfig) -> dict:
    return {k: v for k, v in cfg.decoder.items() if k != "name"}


def build(cfg: DictConfig, stored: StoredModel = StoredModel(), datamodule=None,
          module_class=None) -> Built:
    """Data (records, tokenizer, encoded splits), then the backbone, the decoder and the task module;
    the tokenizer and the backbone's architecture come from `stored` where it has them.
    `datamodule` and `module_class` stand in for the task's (`tasks.experiments.pretrain`'s denoising ones)."""
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    if datamodule is None:
        datamodule = SubsequenceDataModule(cfg, tokenizer=stored.tokenizer)
    datamodule.setup()
    return Built(datamodule, build_module(cfg, datamodule.tokenizer, stored.backbone_config,
                                          module_class))


def build_module(cfg: DictConfig, tokenizer, backbone_config: dict | None = None,
                 module_class=None) -> GenerationTask:
    """The backbone (of architecture `backbone_config` where given), the decoder and the task
    module for `tokenizer`: the part of `build` that reads no data."""
    backbone = build_backbone(cfg.model, tokenizer, backbone_config)
    decoder = build_decoder(cfg.decoder.name, backbone.config, special_tokens(tokenizer, backbone.config.decoder_start_token_id),
                            **decoder_options(cfg))
    return (module_class or TASK_MODULES[cfg.task.name])(cfg, backbone, decoder, tokenizer)


# Lightning's loggers, and the lines of each that every trainer prints again as it is built (the
# device lines) or set up for a fit or a test (CUDA's device line): an entry point builds several
# trainers (`check_trainer`'s before any work, then the one that runs; compare one per row), so
# each such line is said once per process (`quiet_lightning`).
SAID_ONCE = {"lightning.pytorch.utilities.rank_zero": ("GPU available:", "TPU available:"),
             "lightning.pytorch.accelerators.cuda": ("LOCAL_RANK:",)}
# Lightning's advertisement for its cloud logger, printed by every trainer: never said.
ADVERTISEMENT = "💡 Tip: For seamless cloud logging"
# Lightning's pytree helper builds a `LeafSpec`, which newer torch deprecates: a warning for
# Lightning's maintainers, not for users (only this message, only from that module).
LEAFSPEC_WARNING = {"message": re.escape("`isinstance(treespec, LeafSpec)` is deprecated"),
                    "category": FutureWarning, "module": r"lightning\.pytorch\.utilities\._pytree\Z"}


class LightningNotices(logging.Filter):
    """On one of Lightning's loggers: drops its advertisement, and a line that starts with one of
    `once` whose very text was already said in this process (a line naming another device or
    rank is said)."""

    def __init__(self, once: tuple[str, ...]):
        super().__init__()
        self.once = once
        self.said: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(ADVERTISEMENT):
            return False
        if message.startswith(self.once):
            if message in self.said:
                return False
            self.said.add(message)
        return True


def quiet_lightning() -> None:
    """Lightning's repeated lines said once, its advertisement and the `LeafSpec` deprecation
    warning not at all (`SAID_ONCE`, `ADVERTISEMENT`, `LEAFSPEC_WARNING`); each call after the first
    changes nothing. Called wherever the library builds a trainer."""
    for name, once in SAID_ONCE.items():
        lightning_log = logging.getLogger(name)
        if not any(isinstance(f, LightningNotices) for f in lightning_log.filters):
            lightning_log.addFilter(LightningNotices(once))
    # set on every call: a caller's `warnings.catch_warnings` (pytest's, around each test) drops
    # the filters set inside it
    warnings.filterwarnings("ignore", **LEAFSPEC_WARNING)


def make_trainer(cfg: DictConfig, logger: MLFlowLogger | None, callbacks=()) -> L.Trainer:
    quiet_lightning()
    # the arguments set here are refused in configurations (tasks.config.TRAINER_RESERVED)
    return L.Trainer(**cfg.trainer, logger=logger if logger is not None else False,
                     callbacks=list(callbacks), enable_autolog_hparams=False,
                     enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                     use_distributed_sampler=False, plugins=[SafeCheckpointIO()])


def check_trainer(cfg: DictConfig) -> L.Trainer:
    """A trainer with the configured `trainer` settings: Lightning checks them as it makes one
    (an accelerator available here, devices it has, a known strategy and precision). Entry points
    call this before any work, so that what Lightning refuses is a ConfigError then, not a
    traceback once the data is read and the tokenizer trained. (Ranges Lightning would only hit
    later are checked with the configuration, `tasks.config.VALUE_RANGES`.)"""
    try:
        return make_trainer(cfg, None)
    except (MisconfigurationException, ValueError, TypeError, ImportError) as err:
        available = sorted(name for name in AcceleratorRegistry.available_accelerators()
                           if AcceleratorRegistry[name]["accelerator"].is_available())
        raise ConfigError(f"trainer.accelerator={cfg.trainer.accelerator!r} with trainer.devices="
                          f"{cfg.trainer.devices!r} cannot run here: {err} (accelerators available "
                          f"here: auto, {', '.join(available)})") from err


@dataclass(frozen=True)
class DecodeTarget:
    """Where and how entry points that decode outside a trainer (tasks.predict, tasks.compare's
    timing, tasks.experiments.distill) decode, so that their decode is the one a trainer's test
    makes: on the device the configured trainer runs on (`trainer.accelerator`, `trainer.devices`;
    its first process's under DDP), in its precision (`trainer.precision`: bf16-mixed decodes under
    autocast, 64-true and bf16-true convert the weights). Asking Lightning keeps its choices (auto,
    gpu, device ids) and its checks (`check_trainer`)."""

    device: torch.device
    precision: Precision   # the trainer's precision plugin

    def place(self, module: torch.nn.Module) -> torch.nn.Module:
        """`module` moved to the device, converted to the precision (in place) and in eval mode.
        Lightning's test teardown moves a module back to the CPU, so a decode after it places it
        again."""
        self.precision.convert_module(module.to(self.device))
        return module.eval()

    def context(self) -> ContextManager:
        """The precision's context around every decode (autocast under the mixed precisions)."""
        return self.precision.forward_context()

    def predict(self, module: GenerationTask, records: list[dict], batches, desc: str) -> list[dict]:
        """`module.with_predictions` of `records` (`batches` their batches), decoded here."""
        self.place(module)
        with self.context():
            return module.with_predictions(records, batches, self.device, desc)


def decode_target(cfg: DictConfig) -> DecodeTarget:
    trainer = check_trainer(cfg)
    return DecodeTarget(trainer.strategy.root_device, trainer.precision_plugin)


def evaluate_test(cfg: DictConfig, built: Built, logger: MLFlowLogger | None, callbacks=(),
              ckpt_path: str | None = None) -> Evaluation:
    """The test split decoded and scored by a trainer of `cfg` (logging to `logger`'s run where
    given; with the weights of `ckpt_path` where given): its `Evaluation`."""
    make_trainer(cfg, logger, callbacks=callbacks).test(built.module, datamodule=built.datamodule,
                                                        ckpt_path=ckpt_path, verbose=False)
    return built.module.evaluations["test"]


def score_into_run(logger: MLFlowLogger, cfg: DictConfig, built: Built, callbacks=()) -> Evaluation:
    """Decode and score the test split with an already-trained module; params, the test split as
    dataset input, metrics, config and predictions go to `logger`'s run. `callbacks` join the
    trainer's."""
    watcher = ExceptionWatcher()  # the trainer's: Ctrl-C while testing marks the run KILLED
    with run_status(logger, watcher):  # the run exists from the first log on
        log_params(logger, cfg, built.datamodule, ("test",))
        tested = evaluate_test(cfg, built, logger, [watcher, *callbacks])
        log_artifacts(logger, cfg, built.module.prediction_rows("test"))
    return tested


@dataclass
class Trained:
    built: Built
    logger: MLFlowLogger
    checkpoint: str
    tested: Evaluation   # the test pass of the tested checkpoint
    fit_seconds: float   # this process's trainer.fit, validation included (a resume: the rest only)


# Decoder options that keep trained weights as training starts them (blockwise's backbone, nar's
# encoder): set, the decoder trains only on a trained backbone.
FREEZING_OPTIONS = ("freeze_backbone", "freeze_encoder")


def needs_trained_backbone(cfg: DictConfig) -> str | None:
    """The decoder of `cfg`, named with the setting that makes it so ("decoder blockwise with
    decoder.freeze_backbone=true"), when it trains only on a trained backbone, which it (partly)
    freezes: it `needs_trained_backbone`, or is set to freeze (`FREEZING_OPTIONS`). None when it
    trains its own."""
    frozen = next((name for name in FREEZING_OPTIONS if cfg.decoder.get(name, False)), None)
    if not (frozen or decoder_class(cfg.decoder.name).needs_trained_backbone):
        return None
    return f"decoder {cfg.decoder.name}" + (f" with decoder.{frozen}=true" if frozen else "")


def check_something_to_train(cfg: DictConfig) -> None:
    """Refuse (ConfigError) to fit a decoder that trains nothing (`Decoder.trains_nothing`): a fit of
    it would train a sequential model under its name. The message names the ways to use it."""
    name = cfg.decoder.name
    kind = decoder_class(name)
    if kind.trains_nothing:
        drafter, compared = "", f"sequential,{name}"
        if kind.drafts_with:
            drafter = f" decoder.drafter={kind.drafts_with.upper()}_CKPT"
            compared = f"sequential,{kind.drafts_with},{name}"
        raise ConfigError(f"decoder {name} trains nothing: it decodes a trained sequential model as it "
                          f"is. Decode a sequential checkpoint with it (python -m tasks.test --ckpt "
                          f"SEQUENTIAL_CKPT decoder={name}{drafter}), or compare it with the model "
                          f"of a sequential row (python -m tasks.compare --decoders {compared})")


def train_and_test(cfg: DictConfig, tags: dict | None = None, resume: Resume | None = None,
                   callbacks=()) -> Trained:
    """Fit with validation each epoch, keep the best checkpoint by the task's primary metric, decode
    and score the test split with it, and log params, metrics, config and predictions to MLflow.

    With `resume`, training goes on from that run's last checkpoint and logs into the same run;
    otherwise `train.init_from`, if set, gives the starting backbone weights and tokenizer.
    A crash marks the run FAILED (Ctrl-C: KILLED) with the error as a tag; checkpoints stay."""
    check_something_to_train(cfg)
    needs = needs_trained_backbone(cfg)
    if resume is None and cfg.train.init_from is None and needs:
        # it would train on a random frozen backbone: a result with no meaning, hours later
        raise ConfigError(f"{needs} trains only on a trained sequential model's backbone: set "
                          f"train.init_from=<a sequential tasks.fit checkpoint>")
    if resume is None and cfg.train.init_from is None:
        check_pretrained_model_type(cfg.model)
    check_trainer(cfg)
    initial = None if resume else initial_weights(cfg)
    logger = open_tracking(cfg, default_run_name(cfg), tags=tags,
                           run_id=resume.run_id if resume else None)  # fails here if unusable
    built = build(cfg, resume.stored if resume else initial.stored if initial else StoredModel())
    if initial is not None:
        built.module.backbone.load_state_dict(initial.backbone)
    # The MLflow run is created here, once the data and the model are known to be good; on other
    # DDP processes the logger is inert (run_id None) and ModelCheckpoint takes rank 0's folder.
    run_id = logger.run_id
    watcher = ExceptionWatcher()
    # From here on the run exists: any failure, a trainer that cannot be built included, marks it
    with run_status(logger, watcher):
        if resume is not None:
            reopen_run(logger, resumed_from=resume.checkpoint)
        log_params(logger, cfg, built.datamodule, SPLITS)
        folder = run_folder(cfg, run_id) / "checkpoints" if run_id else None
        best_checkpoint = BestCheckpoint(dirpath=folder, filename="epoch{epoch}-step{step}",
                                         auto_insert_metric_name=False,
                                         monitor=built.module.primary_metric, mode="max", save_top_k=1)
        # Written at the end of every epoch (ModelCheckpoint's own `save_last` is only refreshed
        # when the best one is): what `--resume` takes up, and what is tested when validation
        # never ran.
        last_checkpoint = ModelCheckpoint(dirpath=folder, filename="last", save_top_k=1)
        trainer = make_trainer(cfg, logger,
                               callbacks=[best_checkpoint, last_checkpoint, watcher, *callbacks])
        fit_started = time.perf_counter()
        trainer.fit(built.module, datamodule=built.datamodule,
                    ckpt_path=resume.checkpoint if resume else None)
        fit_seconds = time.perf_counter() - fit_started
        logger.log_metrics({"train/fit_seconds": fit_seconds})
        # The best checkpoint by the task's metric (the latest of equal scores); the last one when
        # validation never ran.
        best = best_checkpoint.best_model_path or last_checkpoint.best_model_path
        trainer.test(built.module, datamodule=built.datamodule, ckpt_path=best or None, verbose=False)
        tested = built.module.evaluations["test"]
        if rank_zero_only.rank == 0:
            logger.experiment.set_tag(run_id, "tested_checkpoint", best)
        log_artifacts(logger, cfg, built.module.prediction_rows("test"))
    return Trained(built, logger, best, tested, fit_seconds)
