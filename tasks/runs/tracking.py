"""A run's MLflow tracking: opening the store, naming the experiment and the run, the run's folder
in the artifact store, what a run logs (parameters, datasets, config, predictions), its status
when it fails, and links to it in the MLflow UI."""
from __future__ import annotations

import fcntl
import hashlib
import json
import re
import shlex
import sqlite3
import tempfile
from contextlib import closing, contextmanager
from dataclasses import asdict
from pathlib import Path
from urllib.parse import quote

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

from datamodules.datamodule import SubsequenceDataModule
from datamodules.sources import usable_folder
from tasks.config import ConfigError, flatten, to_yaml
from datamodules.sources import write_jsonl


def open_tracking(cfg: DictConfig, run_name: str, tags: dict | None = None,
                  run_id: str | None = None) -> MLFlowLogger:
    """The MLflow logger of one run; fails before any training if the store cannot be opened."""
    artifacts = check_tracking(cfg)
    # A tracking server keeps the artifacts of the experiments it creates where it and its UI can
    # reach them; a folder of this machine would be out of their reach. Checkpoints stay in
    # tracking.artifact_location either way (`run_folder`).
    location = None if is_server(cfg.tracking.uri) else artifacts.as_uri()
    return MLFlowLogger(experiment_name=experiment_name(cfg), run_name=run_name,
                        tracking_uri=cfg.tracking.uri, artifact_location=location,
                        tags=tags, run_id=run_id)


def is_server(tracking_uri: str) -> bool:
    """Whether the tracking URI names a tracking server (rather than a store this process opens)."""
    return tracking_uri.startswith(("http://", "https://"))


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


def nested_under(parent: MLFlowLogger) -> dict[str, str]:
    """The tag that makes a run the child of `parent`'s run, as the MLflow UI nests them (the
    parent's run is created here if it was not yet)."""
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
    return {MLFLOW_PARENT_RUN_ID: parent.run_id}


def experiment_name(cfg: DictConfig) -> str:
    return cfg.tracking.experiment or cfg.task.name


def default_run_name(cfg: DictConfig) -> str:
    return cfg.tracking.run_name or f"{cfg.decoder.name} {cfg.model.name} {cfg.data.source}"


def run_folder(cfg: DictConfig, run_id: str) -> Path:
    """A run's own folder under tracking.artifact_location; checkpoints live in `checkpoints/` under
    it (and, with a local store, MLflow's artifacts in `artifacts/`)."""
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


@rank_zero_only
def reopen_run(logger: MLFlowLogger, **tags: str) -> None:
    """An interrupted run taken up again (a resumed fit, a resumed comparison): RUNNING once more,
    with `tags` saying from what, and its former `error` tag kept as `error_before_resume`, a name
    that does not say the run is failing now."""
    client, run_id = logger.experiment, logger.run_id
    client.update_run(run_id, status="RUNNING")
    for name, value in tags.items():
        client.set_tag(run_id, name, value)
    error = client.get_run(run_id).data.tags.get("error")
    if error is not None:
        client.set_tag(run_id, "error_before_resume", error)
        client.delete_tag(run_id, "error")


# Where `mlflow ui` serves a local store unless told otherwise.
LOCAL_UI = "http://127.0.0.1:5000"


def ui_link(tracking_uri: str, page: str) -> str:
    """A page of the MLflow UI (its route, the part after `#/`) as a line to print: on the tracking
    server itself, or on the UI that `mlflow ui` serves on a local store, with that command."""
    if is_server(tracking_uri):
        return f"{tracking_uri.rstrip('/')}/#/{page}"
    return (f"{LOCAL_UI}/#/{page} (serve the UI with `mlflow ui --backend-store-uri "
            f"{shlex.quote(tracking_uri)}`)")


# The UI shows an experiment in its GenAI views (or in those last chosen in the browser) unless the
# page asks for the machine-learning ones, where runs and their metrics are.
MACHINE_LEARNING = "workflowType=machine_learning"


def run_link(cfg: DictConfig, logger: MLFlowLogger) -> str:
    """The run's page in the MLflow UI, on its machine-learning view, as a line to print."""
    return ui_link(cfg.tracking.uri, f"experiments/{logger.experiment_id}/runs/{logger.run_id}"
                                     f"?{MACHINE_LEARNING}")


def compare_runs_link(cfg: DictConfig, loggers: list[MLFlowLogger]) -> str:
    """The MLflow UI's page that compares the runs, as a line to print. The UI writes the run and
    experiment ids as JSON arrays, and the browser percent-encodes their quotes."""
    def ids(values: list[str]) -> str:
        return quote(json.dumps(values, separators=(",", ":")), safe="[],")
    runs = [logger.run_id for logger in loggers]
    experiments = sorted({logger.experiment_id for logger in loggers})
    return ui_link(cfg.tracking.uri, f"compare-runs?runs={ids(runs)}&experiments={ids(experiments)}")


def metric_key_part(text: str) -> str:
    """`text` as a part of a metric key that MLflow and Lightning's logger keep as it is: each run
    of other characters than letters, digits, `_`, `.` and `-` becomes one `_`
    (`pipelined(delay=2)` -> `pipelined_delay_2`)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")
