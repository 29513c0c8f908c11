"""Checkpoints: written atomically and loaded as data only, the best one kept, checked against a
configuration, and what they carry to rebuild a model (tokenizer, architecture, backbone weights)
for a resumed fit, a fit that starts from one (`train.init_from`), or a test."""
from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import TorchCheckpointIO
from omegaconf import DictConfig

from datamodules.tokenizer import from_serialized
from tasks.config import ConfigError, compose, flatten
from tasks.runs.tracking import experiment_name, run_folder


@dataclass(frozen=True)
class StoredModel:
    """What a checkpoint carries to rebuild its model without the model's files (`stored_model`)."""
    tokenizer: object | None = None       # None: trained (t5-tiny) or loaded by name afresh
    backbone_config: dict | None = None   # None: built from the configuration or the hub


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


def trained_decoder(checkpoint: dict) -> str:
    """The name of the decoder a checkpoint was trained with."""
    return checkpoint.get("decoder_name", checkpoint["hyper_parameters"]["cfg"]["decoder"]["name"])


def stored_model(checkpoint: dict) -> StoredModel:
    """The tokenizer and backbone architecture a checkpoint carries (`BackboneTraining.
    on_save_checkpoint`). Checkpoints written before these were stored for pretrained models carry
    none of them (their model is loaded again by name), and t5-tiny's only the tokenizer's JSON."""
    serialized = checkpoint.get("tokenizer_json")
    tokenizer = None if serialized is None else from_serialized(serialized,
                                                                checkpoint.get("tokenizer_settings"))
    return StoredModel(tokenizer, checkpoint.get("backbone_config"))


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


def is_model_key(key: str) -> bool:
    """Whether a configuration key says which model a checkpoint holds: the `model.` keys, but for
    dropout and the random init's (its scale, its position heads), which neither shape nor fill
    loaded weights."""
    return (key.startswith("model.") and key not in ("model.dropout", "model.initializer_factor",
                                                      "model.init_std")
            and not key.startswith("model.position_heads."))


@dataclass
class Resume:
    """Where an unfinished fit is taken up: its MLflow run and its last checkpoint."""
    run_id: str
    checkpoint: str
    stored: StoredModel  # the run's own tokenizer and architecture, not trained or loaded again


def last_checkpoint(cfg: DictConfig, run_id: str) -> Path:
    """Where a fit's run keeps the checkpoint of its latest finished epoch, what a resume takes up."""
    return run_folder(cfg, run_id) / "checkpoints" / "last.ckpt"


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
        last = last_checkpoint(cfg, run.info.run_id)
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
