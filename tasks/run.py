"""Wiring shared by the entry points: config -> data -> task module -> trainer -> MLflow."""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import fcntl
import os
import pickle
import sqlite3
import sys
import tempfile
import time
from contextlib import closing, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import lightning as L
import torch
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.plugins import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig

from datamodules.datamodule import SubsequenceDataModule
from datamodules.schema import DataError
from datamodules.sources import SPLITS, usable_folder
from datamodules.tokenizer import TokenizerError, from_serialized, special_tokens
from decoders import build_decoder, decoder_class
from tasks.config import ConfigError, compose, flatten, to_yaml
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


@dataclass(frozen=True)
class StoredModel:
    """What a checkpoint carries to rebuild its model without the model's files (`stored_model`)."""
    tokenizer: object | None = None       # None: trained (t5-tiny) or loaded by name afresh
    backbone_config: dict | None = None   # None: built from the configuration or the hub


def build(cfg: DictConfig, stored: StoredModel = StoredModel(), datamodule=None,
          module_class=None) -> Built:
    """Data (records, tokenizer, encoded splits), then the backbone, the decoder and the task module;
    the tokenizer and the backbone's architecture come from `stored` where it has them.
    `datamodule` and `module_class` stand in for the task's (`tasks.experiments.pretrain`'s denoising ones)."""
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    if datamodule is None:
        datamodule = SubsequenceDataModule(cfg, tokenizer=stored.tokenizer)
    datamodule.setup()
    backbone = build_backbone(cfg.model, datamodule.tokenizer, stored.backbone_config)
    decoder = build_decoder(cfg.decoder.name, backbone.config, special_tokens(datamodule.tokenizer),
                            **decoder_options(cfg))
    module = (module_class or TASK_MODULES[cfg.task.name])(cfg, backbone, decoder, datamodule.tokenizer)
    return Built(datamodule, module)


def open_tracking(cfg: DictConfig, run_name: str, tags: dict | None = None,
                  run_id: str | None = None) -> MLFlowLogger:
    """The MLflow logger of one run; fails before any training if the store cannot be opened."""
    artifacts = check_tracking(cfg)
    return MLFlowLogger(experiment_name=experiment_name(cfg), run_name=run_name,
                        tracking_uri=cfg.tracking.uri, artifact_location=artifacts.as_uri(),
                        tags=tags, run_id=run_id)


def check_tracking(cfg: DictConfig) -> Path:
    """Opens the tracking store and makes the artifact folder, which it returns; a ConfigError
    naming `tracking.uri` or `tracking.artifact_location` if either cannot be."""
    from mlflow.tracking import MlflowClient
    try:
        with store_creation_lock(cfg.tracking.uri):
            MlflowClient(cfg.tracking.uri).search_experiments(max_results=1)
    except ConfigError:
        raise
    except Exception as err:  # any failure here means the store is unusable
        first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
        if any(sign in str(err) for sign in HALF_MIGRATED):
            raise ConfigError(f"the tracking store tracking.uri={cfg.tracking.uri!r} was left "
                              f"half-created or half-migrated ({first_line[:200]}). Move that "
                              f"database aside (its runs are in it) and start again to create a "
                              f"new one, or upgrade it with `mlflow db upgrade "
                              f"{cfg.tracking.uri}`") from err
        raise ConfigError(f"cannot open tracking.uri={cfg.tracking.uri!r}: {first_line}") from err
    return usable_folder(Path(cfg.tracking.artifact_location).resolve(),
                         "tracking.artifact_location", ConfigError)


# What MLflow says about a store whose creation or migration was interrupted or raced.
HALF_MIGRATED = ("Online migration expected to match one row", "_alembic_tmp",
                 "out-of-date database schema", "alembic_version")


@contextmanager
def store_creation_lock(uri: str):
    """Serializes the first connection to a sqlite tracking store across processes.

    MLflow creates and migrates a new sqlite store on its first connection; two processes doing so
    at once (two fits started together) both fail and leave the store broken for every later run.
    An exclusive lock on `<database>.lock` around the first connection makes one create it and the
    others find it ready. The database is opened directly first: MLflow retries a database it
    cannot open for ~100 s. Other stores (a tracking server, a database server) serialize
    themselves."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    database = Path(uri[len("sqlite:///"):])
    try:
        database.parent.mkdir(parents=True, exist_ok=True)
        with closing(sqlite3.connect(database)) as connection:
            connection.execute("PRAGMA schema_version")
        lock = open(database.with_name(database.name + ".lock"), "a")
    except (OSError, sqlite3.Error) as err:
        raise ConfigError(f"cannot open tracking.uri={uri!r}: {err}") from err
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        yield


def write_report(out: str | Path, result: dict, table: str) -> Path:
    """A command's result as FILE.json and its markdown table beside it as FILE.md."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(table)
    return out


def show_report(out: str | Path | None, result, table: str) -> None:
    """A small command's ending: its table printed, and with `--out FILE.json` the result written
    as FILE.json + FILE.md (`write_report`)."""
    print(table)
    if out:
        out = write_report(out, result, table)
        print(f"wrote {out} and {out.with_suffix('.md')}")


def experiment_name(cfg: DictConfig) -> str:
    return cfg.tracking.experiment or cfg.task.name


def default_run_name(cfg: DictConfig) -> str:
    return cfg.tracking.run_name or f"{cfg.decoder.name} {cfg.model.name} {cfg.data.source}"


class SafeCheckpointIO(TorchCheckpointIO):
    """Writes a checkpoint under a temporary name and renames it into place, so that a crash or a
    full disk mid-write leaves the previous file (or none), never a truncated one under the final
    name that a later resume or test would take for complete. Reads (Lightning's resume and
    best-checkpoint test) load data only, as `load_checkpoint` does."""

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        return super().load_checkpoint(path, map_location=map_location, weights_only=True)

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        try:
            torch.save(checkpoint, partial)
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)


def make_trainer(cfg: DictConfig, logger: MLFlowLogger | None, callbacks=()) -> L.Trainer:
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


def decode_device(cfg: DictConfig) -> torch.device:
    """The device the configured trainer (`trainer.accelerator`, `trainer.devices`) runs on, its
    first process's under DDP: where entry points that decode outside a trainer (tasks.compare's
    timing, tasks.experiments.distill) decode. Lightning's test teardown moves the module back to the CPU, so
    they move it there themselves. Asking Lightning keeps its choice (auto, gpu, device ids) and
    its checks (`check_trainer`)."""
    return check_trainer(cfg).strategy.root_device


def run_folder(cfg: DictConfig, run_id: str) -> Path:
    """A run's own folder in the artifact store; checkpoints live in `checkpoints/` under it."""
    return Path(cfg.tracking.artifact_location).resolve() / run_id


@rank_zero_only
def log_artifacts(logger: MLFlowLogger, cfg: DictConfig, rows: list[dict] | None) -> None:
    """The resolved config and, when there are any, the predictions, as artifacts of the run."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.yaml").write_text(to_yaml(cfg))
        logger.experiment.log_artifact(logger.run_id, str(Path(tmp) / "config.yaml"))
        if rows is not None:
            write_jsonl(rows, Path(tmp) / "predictions.jsonl")
            logger.experiment.log_artifact(logger.run_id, str(Path(tmp) / "predictions.jsonl"))


def log_params(logger: MLFlowLogger, cfg: DictConfig, datamodule: SubsequenceDataModule,
               splits: tuple[str, ...]) -> None:
    """The flattened configuration and the data report as parameters, and the `splits` the run
    uses as its dataset inputs."""
    params = flatten(cfg)
    for split, report in datamodule.report.items():
        params.update({f"data_report.{split}.{key}": value for key, value in asdict(report).items()})
    logger.log_hyperparams(params)
    log_datasets(logger, cfg, datamodule, splits)


def records_digest(records: list[dict]) -> str:
    """A fingerprint of a split's records: their content in order (the order of a record's keys
    aside), so equal data gives an equal digest and any changed record another one."""
    digest = hashlib.sha256()
    for record in records:
        digest.update(json.dumps(record, sort_keys=True, ensure_ascii=False).encode("utf-8"))
        digest.update(b"\n")
    return digest.hexdigest()[:12]


def split_dataset(cfg: DictConfig, split: str, records: list[dict]):
    """One split as an MLflow dataset: named after the data source, with where it comes from (in
    the JSON layout of MLflow's own source types, which its UI shows) and its records' digest."""
    data = cfg.data
    if data.source == "builtin":  # generated by the library's code from these settings
        name, source_type = f"builtin-{cfg.task.name}", "code"
        source = {"tags": {"generator": "datamodules.builtin.make_corpus", "task": cfg.task.name,
                           "split": split, "size": int(data[f"{split}_size"]),
                           "corpus_seed": int(data.corpus_seed)}}
    elif data.source == "jsonl":
        folder = Path(data.path).resolve()
        name, source_type, source = folder.name, "local", {"uri": str(folder / f"{split}.jsonl")}
    else:
        from datamodules.hub import HUB_DATASETS
        spec = HUB_DATASETS[data.source]
        name, source_type = data.source, "hugging_face"
        source = {"path": spec.hub_id, "config_name": spec.config_name, "split": spec.splits[split]}
    return mlflow_dataset(name, records, source_type, source)


def mlflow_dataset(name: str, records: list[dict], source_type: str, source: dict):
    """Records as an MLflow dataset: `name`, where they come from and their digest."""
    from mlflow.entities import Dataset
    return Dataset(name=name, digest=records_digest(records), source_type=source_type,
                   source=json.dumps(source), profile=json.dumps({"num_rows": len(records)}))


@rank_zero_only
def log_datasets(logger: MLFlowLogger, cfg: DictConfig, datamodule: SubsequenceDataModule,
                 splits: tuple[str, ...]) -> None:
    """One MLflow dataset input per split, with the split as its context (`mlflow.data.context`):
    the run table's Dataset column and its filters then tell runs on other data apart."""
    log_dataset_inputs(logger, [(split_dataset(cfg, split, datamodule.records(split)), split)
                                for split in splits])


@rank_zero_only
def log_dataset_inputs(logger: MLFlowLogger, datasets: list[tuple[object, str]]) -> None:
    """MLflow datasets as inputs of the run, each with its context (the split it serves as)."""
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT
    inputs = [DatasetInput(dataset, tags=[InputTag(MLFLOW_DATASET_CONTEXT, context)])
              for dataset, context in datasets]
    logger.experiment.log_inputs(logger.run_id, datasets=inputs)


def score_into_run(logger: MLFlowLogger, cfg: DictConfig, built: Built) -> None:
    """Decode and score the test split with an already-trained module; params, the test split as
    dataset input, metrics, config and predictions go to `logger`'s run."""
    with run_status(logger, ExceptionWatcher()):  # the run exists from the first log on
        log_params(logger, cfg, built.datamodule, ("test",))
        make_trainer(cfg, logger).test(built.module, datamodule=built.datamodule, verbose=False)
        log_artifacts(logger, cfg, built.module.prediction_rows("test"))


@dataclass
class Trained:
    built: Built
    logger: MLFlowLogger
    checkpoint: str
    scores: dict[str, float]
    fit_seconds: float   # this process's trainer.fit, validation included (a resume: the rest only)


class BestCheckpoint(ModelCheckpoint):
    """The checkpoint of best validation score and, among equal scores, the latest one.

    Lightning keeps the earliest of equal scores, which tests a less trained model for nothing: a
    score still at 0 early in training, or blockwise heads trained on a frozen backbone, whose exact
    decoding scores the same every epoch while the heads (and the speed) improve."""

    def check_monitor_top_k(self, trainer, current=None) -> bool:
        if super().check_monitor_top_k(trainer, current):
            return True
        tie = current is not None and bool(current == self.best_k_models[self.kth_best_model_path])
        return trainer.strategy.reduce_boolean_decision(tie)


class ExceptionWatcher(Callback):
    """Remembers the exception the trainer saw: Lightning turns Ctrl-C into `SystemExit`."""

    exception: BaseException | None = None

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.exception = exception


@contextmanager
def run_status(logger: MLFlowLogger, watcher: ExceptionWatcher):
    """Marks the MLflow run KILLED on Ctrl-C and FAILED on any other error, with the error message
    as the run's `error` tag, then lets the error go on. (A run killed by a signal that cannot be
    caught stays RUNNING; `tasks.fit --resume` takes it up like a failed one.)"""
    try:
        yield
    except BaseException as err:
        cause = watcher.exception or err
        if rank_zero_only.rank == 0:
            status = "KILLED" if isinstance(cause, KeyboardInterrupt) else "FAILED"
            message = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
            logger.experiment.set_tag(logger.run_id, "error", message[:5000])
            logger.experiment.set_terminated(logger.run_id, status)
        raise


@dataclass
class Resume:
    """Where an unfinished fit is taken up: its MLflow run and its last checkpoint."""
    run_id: str
    checkpoint: str
    stored: StoredModel  # the run's own tokenizer and architecture, not trained or loaded again


def find_resumable(cfg: DictConfig, run_id: str | None) -> Resume:
    """The run `run_id`, or the latest unfinished run of the experiment, with its last checkpoint;
    refused when that checkpoint was trained with another configuration than `cfg`."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient
    client = MlflowClient(cfg.tracking.uri)
    if run_id is not None:
        try:
            run = client.get_run(run_id)
        except MlflowException as err:
            raise ConfigError(f"--resume {run_id}: no such run in tracking.uri={cfg.tracking.uri!r}") from err
        if run.info.status == "FINISHED":
            raise ConfigError(f"--resume {run_id}: that run finished; there is nothing to resume")
        candidates = [run]
    else:
        experiment = client.get_experiment_by_name(experiment_name(cfg))
        candidates = [] if experiment is None else client.search_runs(
            [experiment.experiment_id], filter_string="attributes.status != 'FINISHED'",
            order_by=["attributes.start_time DESC"])
    for run in candidates:
        last = run_folder(cfg, run.info.run_id) / "checkpoints" / "last.ckpt"
        if last.is_file():
            break
    else:
        where = f"run {run_id}" if run_id else f"experiment {experiment_name(cfg)!r}"
        raise ConfigError(f"--resume: no unfinished run with a checkpoint in {where} "
                          f"(looked for checkpoints/last.ckpt under {cfg.tracking.artifact_location})")
    stored_checkpoint = load_checkpoint(str(last))
    differences = config_differences(stored_checkpoint, cfg, "in the run")
    if differences:
        raise ConfigError(f"--resume: run {run.info.run_id} was trained with another configuration "
                          f"(resume with the same command): {'; '.join(differences[:8])}")
    return Resume(run.info.run_id, str(last), stored_model(stored_checkpoint))


def config_differences(checkpoint: dict, cfg: DictConfig, there: str,
                       compared: Callable[[str], bool] = lambda key: True,
                       here: str = "now") -> list[str]:
    """`key: value <there>, value <here>` for each `compared` key whose value in the checkpoint's
    configuration differs from `cfg`'s."""
    # through `compose`, so that keys the library gained since the checkpoint compare as defaults
    stored = flatten(compose(base=checkpoint["hyper_parameters"]["cfg"]))
    current = flatten(cfg)
    return [f"{key}: {stored.get(key)!r} {there}, {current.get(key)!r} {here}"
            for key in sorted(set(stored) | set(current))
            if compared(key) and stored.get(key) != current.get(key)]


def load_checkpoint(path: str) -> dict:
    """A checkpoint written by this library, loaded as data: `torch.load(weights_only=True)`, which
    unpickles only tensors and plain containers and numbers, so a file crafted to call a function
    when unpickled is refused before anything in it runs. The library's checkpoints need nothing
    more (their configuration, tokenizer and architecture are stored as plain dicts and strings)."""
    if not Path(path).is_file():
        raise ConfigError(f"{path}: no such checkpoint file")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        # torch's message names the offending global (e.g. "GLOBAL posix.system")
        reason = str(err).split("Please file an issue")[0].strip().splitlines()
        raise ConfigError(f"{path} was refused: it holds objects other than tensors and plain data, "
                          f"which could run code when loaded, and tasks.fit never writes such a "
                          f"file ({' '.join(line.strip() for line in reason[:3])[:300]})") from err
    except Exception as err:  # a truncated or foreign file: say which, do not dump a pickle trace
        raise ConfigError(f"{path} is not a readable checkpoint: {err}") from err
    hyper_parameters = checkpoint.get("hyper_parameters") if isinstance(checkpoint, dict) else None
    has = {"hyper_parameters.cfg": isinstance(hyper_parameters, dict) and "cfg" in hyper_parameters,
           "state_dict": isinstance(checkpoint, dict) and "state_dict" in checkpoint}
    lacking = [key for key, present in has.items() if not present]
    if lacking:  # another program's file, or a bare state dict
        raise ConfigError(f"{path} is not a checkpoint written by tasks.fit: it has no "
                          f"{' and no '.join(lacking)}")
    return checkpoint


def is_model_key(key: str) -> bool:
    """Whether a configuration key says which model a checkpoint holds: the `model.` keys, but for
    dropout and the random-init scale, which neither shape nor fill loaded weights."""
    return key.startswith("model.") and key not in ("model.dropout", "model.initializer_factor")


@dataclass
class InitialWeights:
    """What `train.init_from` gives a new fit: the backbone weights, and the tokenizer and
    architecture they go with."""
    backbone: dict[str, torch.Tensor]
    stored: StoredModel


def initial_weights(cfg: DictConfig) -> InitialWeights | None:
    """The backbone of the checkpoint `train.init_from` names, checked against `cfg.model` before
    any data is read; the decoder's own modules (heads, length predictor) start afresh."""
    path = cfg.train.init_from
    if path is None:
        return None
    checkpoint = load_checkpoint(path)
    differences = config_differences(checkpoint, cfg, "in the checkpoint", compared=is_model_key)
    if differences:
        raise ConfigError(f"train.init_from={path} holds another model: {'; '.join(differences)}")
    prefix = "backbone."
    backbone = {key[len(prefix):]: value for key, value in checkpoint["state_dict"].items()
                if key.startswith(prefix)}
    return InitialWeights(backbone, stored_model(checkpoint))


def stored_model(checkpoint: dict) -> StoredModel:
    """The tokenizer and backbone architecture a checkpoint carries (`BackboneTraining.
    on_save_checkpoint`). Checkpoints written before these were stored for pretrained models carry
    none of them (their model is loaded again by name), and t5-tiny's only the tokenizer's JSON."""
    serialized = checkpoint.get("tokenizer_json")
    tokenizer = None if serialized is None else from_serialized(serialized,
                                                                checkpoint.get("tokenizer_settings"))
    return StoredModel(tokenizer, checkpoint.get("backbone_config"))


def train_and_test(cfg: DictConfig, tags: dict | None = None, resume: Resume | None = None,
                   callbacks=()) -> Trained:
    """Fit with validation each epoch, keep the best checkpoint by the task's primary metric, decode
    and score the test split with it, and log params, metrics, config and predictions to MLflow.

    With `resume`, training goes on from that run's last checkpoint and logs into the same run;
    otherwise `train.init_from`, if set, gives the starting backbone weights and tokenizer.
    A crash marks the run FAILED (Ctrl-C: KILLED) with the error as a tag; checkpoints stay."""
    if resume is None and cfg.train.init_from is None and decoder_class(cfg.decoder.name).needs_trained_backbone:
        # it would train on a random frozen backbone: a result with no meaning, hours later
        raise ConfigError(f"decoder {cfg.decoder.name} trains only on a trained sequential model's "
                          f"backbone: set train.init_from=<a sequential tasks.fit checkpoint>")
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
        if resume is not None and rank_zero_only.rank == 0:
            client = logger.experiment
            client.update_run(run_id, status="RUNNING")
            client.set_tag(run_id, "resumed_from", resume.checkpoint)
            error = client.get_run(run_id).data.tags.get("error")
            if error is not None:  # kept, under a name that does not say the run is failing now
                client.set_tag(run_id, "error_before_resume", error)
                client.delete_tag(run_id, "error")
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
        if rank_zero_only.rank == 0:
            logger.experiment.set_tag(run_id, "tested_checkpoint", best)
        log_artifacts(logger, cfg, built.module.prediction_rows("test"))
    return Trained(built, logger, best, built.module.test_scores, fit_seconds)


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
    if rank_zero_only.rank != 0:  # other DDP processes would repeat rank 0's (whole-split) lines
        logging.getLogger().setLevel(logging.ERROR)
    torch.set_float32_matmul_precision("high")
    try:
        main()
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
