"""Scale-out and faults: DDP evaluation, resume into the same run, run status on errors, atomic
writes, determinism, and bad input that fails before any work."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from mlflow.tracking import MlflowClient

import tasks.run
from datamodules.datamodule import SubsequenceDataModule
from datamodules.schema import DataError
from tasks import fit, test as test_entry
from tasks.config import ConfigError, compose
from tasks.run import SafeCheckpointIO, build, make_trainer, train_and_test
from tests.test_end_to_end import TINY, run_artifact_rows, tracking, weights

REPO = Path(__file__).resolve().parents[1]
TIMING = {"examples_per_second", "decode_seconds"}  # the only scores allowed to differ between runs


def quality_and_counts(scores: dict) -> dict:
    return {k: v for k, v in scores.items() if k not in TIMING}


# ---- DDP ------------------------------------------------------------------------------------------

# Odd split sizes: 2 processes get unequal shares, and torch's DistributedSampler would repeat one.
# A large initialisation scale and a negligible learning rate keep the model random but with
# different outputs for every example, so a mix-up of examples between processes would show.
DDP_DATA = ["data.train_size=33", "data.validation_size=5", "data.test_size=7",
            "model.initializer_factor=6", "train.lr=1e-6"]


@pytest.mark.slow
@pytest.mark.parametrize("decoder", ["sequential", "pipelined", "blockwise", "nar"])
def test_ddp_two_processes_score_like_one(decoder, tmp_path):
    args = ["--task", "summarization", "--decoder", decoder, *TINY, *DDP_DATA, *tracking(tmp_path),
            "trainer.devices=2", "trainer.strategy=ddp", "trainer.accelerator=cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "tasks.fit", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("summarization").experiment_id])
    assert len(runs) == 1  # one run per fit, from rank 0 only
    run = runs[0]
    assert run.info.status == "FINISHED"
    ddp_rows = run_artifact_rows(client, run.info.run_id, tmp_path / "ddp")
    ddp_scores = {k[len("test/"):]: v for k, v in run.data.metrics.items() if k.startswith("test/")}

    # the same checkpoint and data in one process (the checkpoint's config says 2 DDP processes)
    one_process = ["trainer.devices=1", "trainer.strategy=auto", "trainer.enable_progress_bar=false"]
    single = test_entry.main(["--ckpt", run.data.tags["tested_checkpoint"], *tracking(tmp_path),
                              *one_process])
    single_rows = run_artifact_rows(client, single["run_id"], tmp_path / "single")

    # every test example once, in dataset order, with the same predictions as one process
    dm = SubsequenceDataModule(compose("summarization", decoder, None, [*TINY, *DDP_DATA]))
    assert [r["id"] for r in ddp_rows] == [r["id"] for r in dm.records("test")]
    assert ddp_rows == single_rows
    expected = quality_and_counts(single["scores"])
    assert quality_and_counts(ddp_scores) == pytest.approx(expected, abs=1e-6)
    assert len({tuple(r["prediction"]) for r in ddp_rows}) == 7  # every example its own output

    if decoder == "blockwise":  # sequential decoding of its base head: valid by design, same output
        again = test_entry.main(["--ckpt", run.data.tags["tested_checkpoint"], "decoder=sequential",
                                 *tracking(tmp_path), *one_process])
        assert run_artifact_rows(client, again["run_id"], tmp_path / "seq")[0]["prediction"] == \
            ddp_rows[0]["prediction"]


# ---- resume, run status, determinism --------------------------------------------------------------

class CrashAt(L.Callback):
    """Raises `error` at a given batch of a given epoch: a crash in the middle of an epoch."""

    def __init__(self, epoch: int, batch: int, error: BaseException):
        self.epoch, self.batch, self.error = epoch, batch, error

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.current_epoch == self.epoch and batch_idx == self.batch:
            raise self.error


def last_checkpoint(run_id: str, tmp_path: Path) -> str:
    return str(tmp_path / "artifacts" / run_id / "checkpoints" / "last.ckpt")


@pytest.mark.slow
def test_crash_then_resume_equals_uninterrupted_and_same_seed_repeats(tmp_path):
    # NAR draws random training masks, on top of dropout and shuffling: the strictest case
    args = ["--task", "keyphrase", "--decoder", "nar", *TINY, "trainer.max_epochs=2",
            *tracking(tmp_path)]
    cfg = compose("keyphrase", "nar", None, args[4:])
    client = MlflowClient(cfg.tracking.uri)

    first = fit.main(args)
    second = fit.main(args)  # determinism: the same seed, the same numbers and weights
    assert quality_and_counts(first["scores"]) == quality_and_counts(second["scores"])
    last = torch.load(last_checkpoint(first["run_id"], tmp_path), weights_only=False)
    assert last["epoch"] == 1  # last.ckpt is the final epoch's, whether or not the metric improved
    first_weights = last["state_dict"]
    second_weights = weights(last_checkpoint(second["run_id"], tmp_path))
    assert all(torch.equal(first_weights[k], second_weights[k]) for k in first_weights)

    # a crash in the middle of the second epoch: the run is FAILED with the error, epoch 0 is kept
    with pytest.raises(RuntimeError, match="simulated crash"):
        train_and_test(cfg, callbacks=[CrashAt(epoch=1, batch=2, error=RuntimeError("simulated crash"))])
    crashed = client.search_runs([client.get_experiment_by_name("keyphrase").experiment_id],
                                 order_by=["attributes.start_time DESC"])[0]
    assert crashed.info.status == "FAILED"
    assert crashed.data.tags["error"] == "RuntimeError: simulated crash"
    assert Path(last_checkpoint(crashed.info.run_id, tmp_path)).is_file()

    # resuming with another configuration is refused, naming what differs
    with pytest.raises(ConfigError, match=r"decoder.iterations: 4 in the run, 2 now"):
        fit.main([*args, "decoder.iterations=2", "--resume"])

    resumed = fit.main(["--resume", *args[4:], *args[:4]])  # "--resume key=value": an override
    assert resumed["run_id"] == crashed.info.run_id  # the same MLflow run goes on
    run = client.get_run(resumed["run_id"])
    assert run.info.status == "FINISHED" and "error" not in run.data.tags
    assert run.data.tags["error_before_resume"] == "RuntimeError: simulated crash"
    assert quality_and_counts(resumed["scores"]) == quality_and_counts(first["scores"])
    resumed_weights = weights(last_checkpoint(resumed["run_id"], tmp_path))
    assert all(torch.equal(first_weights[k], resumed_weights[k]) for k in first_weights)

    # nothing left to resume: every run finished
    with pytest.raises(ConfigError, match="no unfinished run with a checkpoint"):
        fit.main([*args, "--resume"])


@pytest.mark.slow
def test_ctrl_c_marks_the_run_killed(tmp_path):
    cfg = compose("keyphrase", None, None, [*TINY, *tracking(tmp_path)])
    sigint = signal.getsignal(signal.SIGINT)  # Lightning ignores further Ctrl-C while shutting down
    try:
        with pytest.raises(SystemExit):  # Lightning's graceful shutdown exits with status 1
            train_and_test(cfg, callbacks=[CrashAt(epoch=0, batch=1, error=KeyboardInterrupt())])
    finally:
        signal.signal(signal.SIGINT, sigint)
    client = MlflowClient(cfg.tracking.uri)
    run = client.search_runs([client.get_experiment_by_name("keyphrase").experiment_id])[0]
    assert run.info.status == "KILLED" and run.data.tags["error"] == "KeyboardInterrupt"


# ---- writes that cannot be mistaken for complete ones ---------------------------------------------

def test_checkpoint_write_is_all_or_nothing(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    writer = SafeCheckpointIO()
    writer.save_checkpoint({"step": 1}, path)
    assert torch.load(path)["step"] == 1

    def save_half_then_fail(obj, target):
        Path(target).write_bytes(b"half a checkpoint")
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", save_half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        writer.save_checkpoint({"step": 2}, path)
    assert torch.load(path)["step"] == 1  # the previous checkpoint is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no partial file left


def test_predictions_write_is_all_or_nothing(tmp_path):
    from tasks.module import write_jsonl
    path = tmp_path / "predictions.jsonl"
    with pytest.raises(TypeError):
        write_jsonl([{"id": "a"}, {"id": object()}], path)  # the second row cannot be serialised
    assert not path.exists()


# ---- bad input: a clear error before any expensive work -------------------------------------------

def test_unusable_tracking_uri_fails_before_the_data_is_touched(tmp_path, monkeypatch):
    monkeypatch.setattr(tasks.run, "build", lambda *a, **k: pytest.fail("data built before the check"))
    cfg = compose("keyphrase", None, None, [f"tracking.uri=sqlite:///{tmp_path}",  # a folder
                                            f"tracking.artifact_location={tmp_path}/artifacts"])
    with pytest.raises(ConfigError, match=f"cannot open tracking.uri='sqlite:///{tmp_path}'"):
        train_and_test(cfg)


@pytest.mark.parametrize("key", ["use_distributed_sampler", "plugins", "enable_checkpointing"])
def test_trainer_options_the_library_owns_are_refused(key):
    with pytest.raises(ConfigError, match=f"override: trainer.{key} is set by the library, not by "
                                          f"configuration; remove it"):
        compose("keyphrase", None, None, [f"trainer.{key}=true"])


def write_split(folder: Path, split: str, keyphrase_lists: list[list[str]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{split}.jsonl", "w") as f:
        for i, keyphrases in enumerate(keyphrase_lists):
            f.write(json.dumps({"id": f"{split}{i}", "title": "graph coloring",
                                "abstract": "we study graph coloring of planar graphs .",
                                "keyphrases": keyphrases}) + "\n")


def test_empty_targets_are_counted_and_an_all_empty_split_is_refused(tmp_path):
    write_split(tmp_path, "train", [["graph coloring"], [], [" "], ["planar graphs"]])
    write_split(tmp_path, "validation", [["graph coloring"]])
    write_split(tmp_path, "test", [[]])
    cfg = compose("keyphrase", None, None, ["data=jsonl", f"data.path={tmp_path}",
                                            "model.vocab_size=60", f"data.tokenizer_cache={tmp_path}/tok"])
    dm = SubsequenceDataModule(cfg)
    dm.setup()
    assert dm.report["train"].empty_targets == 2 and dm.report["train"].examples == 4
    assert dm.report["test"].empty_targets == 1  # an unlabelled test split is allowed

    write_split(tmp_path, "validation", [[], [" "]])
    with pytest.raises(DataError, match="validation split: all 2 examples have empty targets "
                                        r"\(field 'keyphrases'\)"):
        SubsequenceDataModule(cfg).setup()


def test_step_bound_is_reported_in_telemetry_not_silently_cut(tmp_path, caplog):
    cfg = compose("keyphrase", "pipelined", None, [*TINY, "decoder.max_steps=2",
                                                   f"data.tokenizer_cache={tmp_path}/tok"])
    built = build(cfg)  # untrained: nothing ends within 2 steps
    make_trainer(cfg, None).test(built.module, datamodule=built.datamodule, verbose=False)
    rows = built.module.prediction_rows("test")
    assert built.module.test_scores["max_steps_hit"] == len(rows) == 8
    assert all(r["hit_max_steps"] and r["decoder_calls"] == 2 for r in rows)
    assert "test: 8 of 8 examples reached one of the decoder's length or step bounds" in caplog.text
