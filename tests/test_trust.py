"""Hostile and careless input that must not run code, break the tracking store or orphan a run."""
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from tasks import compare, fit, test as test_entry
from tasks.experiments import distill
from tasks.config import ConfigError
from tests.test_end_to_end import TINY, tracking

ROOT = Path(__file__).resolve().parents[1]


class WritesMarker:
    """Unpickling this calls `Path.touch(marker)`: what a hostile checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def hostile_files(folder: Path) -> dict[str, Path]:
    """A plain pickle and a torch zip file, each running `touch` on its own marker when loaded
    by an unrestricted unpickler (checked below, so the test cannot pass vacuously)."""
    files = {}
    for kind in ("pickle", "torch-zip"):
        marker = folder / f"{kind}.marker"
        path = folder / f"{kind}.ckpt"
        payload = {"hyper_parameters": {"cfg": {}}, "state_dict": {}, "evil": WritesMarker(marker)}
        if kind == "pickle":
            path.write_bytes(pickle.dumps(payload))
        else:
            torch.save(payload, path)
        files[kind] = path
    return files


def test_hostile_files_would_run_code_if_loaded_unrestricted(tmp_path):
    for kind, path in hostile_files(tmp_path).items():
        try:
            torch.load(path, weights_only=False)
        except RuntimeError:  # a plain pickle is no torch file, but only found so once unpickled
            pass
        assert (tmp_path / f"{kind}.marker").exists()


def resume_store_with(tmp_path: Path, checkpoint: Path) -> list[str]:
    """An unfinished MLflow run whose last.ckpt is `checkpoint`: what `--resume` takes up."""
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    existing = client.get_experiment_by_name("keyphrase")
    experiment = existing.experiment_id if existing else client.create_experiment("keyphrase")
    run = client.create_run(experiment)
    folder = tmp_path / "artifacts" / run.info.run_id / "checkpoints"
    folder.mkdir(parents=True)
    (folder / "last.ckpt").write_bytes(checkpoint.read_bytes())
    return ["--resume", run.info.run_id]


ENTRY_POINTS = {
    "tasks.test --ckpt": lambda path, tmp: test_entry.main(["--ckpt", str(path), *tracking(tmp)]),
    "tasks.compare --ckpt": lambda path, tmp: compare.main(
        ["--decoders", "sequential", "--ckpt", f"sequential={path}", *TINY, *tracking(tmp)]),
    "tasks.experiments.distill --ckpt": lambda path, tmp: distill.main(
        ["--ckpt", str(path), "--out", str(tmp / "distilled"), *tracking(tmp)]),
    "train.init_from": lambda path, tmp: fit.main([f"train.init_from={path}", *TINY, *tracking(tmp)]),
    "--resume": lambda path, tmp: fit.main([*resume_store_with(tmp, path), *TINY, *tracking(tmp)]),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_no_entry_point_runs_code_from_a_checkpoint(entry, tmp_path):
    for kind, path in hostile_files(tmp_path).items():
        with pytest.raises(ConfigError, match="refused: it holds objects other than tensors"):
            ENTRY_POINTS[entry](path, tmp_path)
        assert not (tmp_path / f"{kind}.marker").exists(), f"{entry} ran code from a {kind} file"


def test_a_loadable_file_without_the_library_keys_is_named(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({"weight": torch.zeros(2)}, path)
    with pytest.raises(ConfigError, match="not a checkpoint written by tasks.fit"):
        test_entry.main(["--ckpt", str(path), *tracking(tmp_path)])


FIRST_USE = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from tasks.config import compose
    from tasks.runs.tracking import open_tracking
    store, go = sys.argv[1], Path(sys.argv[2])
    cfg = compose("keyphrase", "sequential", overrides=[f"tracking.uri=sqlite:///{store}",
                  f"tracking.artifact_location={Path(store).parent}/artifacts"])
    while not go.exists():      # every process reaches the store at the same moment
        time.sleep(0.005)
    logger = open_tracking(cfg, "concurrent")
    logger.log_metrics({"x": 1.0})
    logger.finalize("success")
""")


@pytest.mark.slow
def test_a_new_tracking_store_survives_concurrent_first_use(tmp_path):
    store, go = tmp_path / "store" / "mlflow.db", tmp_path / "go"
    processes = [subprocess.Popen([sys.executable, "-c", FIRST_USE, str(store), str(go)], cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for _ in range(4)]
    import time
    time.sleep(8)  # imports done in every process (mlflow takes a few seconds)
    go.touch()
    outputs = [p.communicate(timeout=300)[0] for p in processes]
    assert [p.returncode for p in processes] == [0] * 4, "\n".join(o[-1500:] for o in outputs)
    client = MlflowClient(f"sqlite:///{store}")
    experiment = client.get_experiment_by_name("keyphrase")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 4 and all(r.info.status == "FINISHED" for r in runs)


def test_a_failure_after_the_run_exists_marks_it_failed(tmp_path, monkeypatch):
    """A failure between the run's creation and training (here logging its parameters; before,
    building the trainer there) used to leave the run RUNNING for ever; now it is FAILED with the
    error as its tag. (A trainer Lightning refuses is now a ConfigError before any run exists.)"""
    def failing_log(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr("tasks.runs.trainer.log_params", failing_log)
    with pytest.raises(OSError, match="disk full"):
        fit.main([*TINY, *tracking(tmp_path)])
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("keyphrase").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FAILED"
    assert "disk full" in runs[0].data.tags["error"]
