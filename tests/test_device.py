"""Decoding outside a trainer (tasks.predict, tasks.compare's timing, tasks.experiments.distill) runs on
the configured device, which the results record, and in the configured precision; CPU timing flushes
denormal floats.

No GPU is needed: `meta`, a device other than the CPU, stands in for the resolved accelerator, and a
recording `timed_generate` notes where each decode's model and inputs are."""
import json

import pytest
import torch
from lightning.pytorch.plugins.precision import Precision
from mlflow.tracking import MlflowClient

import tasks.module
from tasks import compare
from tasks.comparison import measure
from tasks.experiments import distill
from tasks import predict
from tasks.config import ConfigError, compose
from tasks.runs.tracking import open_tracking
from tasks.runs.trainer import DecodeTarget, Trained, build, decode_target, make_trainer, score_into_run
from tests.test_end_to_end import TINY, tracking

META = torch.device("meta")
GPU_LIKE_AVAILABLE = torch.cuda.is_available() or torch.backends.mps.is_available()


def flushing() -> bool:
    """Whether a result in the denormal range is flushed to zero now (on this thread)."""
    return bool((torch.tensor([1.0e-30]) * 1.0e-10 == 0).item())


class RecordedDecodes:
    """A `timed_generate` that records where the model's parameters and the inputs are and whether
    denormals are flushed; it decodes for real on the CPU, and nothing on `meta` (no data there)."""

    def __init__(self):
        self.real = tasks.module.timed_generate
        self.seen: list[tuple] = []

    def __call__(self, decoder, model, input_ids, attention_mask):
        self.seen.append((next(model.parameters()).device, input_ids.device, attention_mask.device,
                          flushing()))
        if input_ids.device == META:
            return None, 0.001
        return self.real(decoder, model, input_ids, attention_mask)


def untrained_comparison(tmp_path, monkeypatch) -> tuple[dict, RecordedDecodes]:
    """`tasks.compare.main` for one sequential row whose random-init model is tested by a Lightning
    trainer, as a trained one would be, instead of trained: the timing starts after the test's
    teardown, which leaves the module on the CPU."""
    def tested_untrained(cfg, tags=None, resume=None, callbacks=()):
        built = build(cfg)
        logger = open_tracking(cfg, "untrained", tags=tags)
        tested = score_into_run(logger, cfg, built, callbacks)
        return Trained(built, logger, "", tested, fit_seconds=0.0)

    decodes = RecordedDecodes()
    monkeypatch.setattr(compare, "train_and_test", tested_untrained)
    monkeypatch.setattr(measure, "timed_generate", decodes)
    result = compare.main(["--decoders", "sequential", "--out", str(tmp_path / "cmp.json"),
                           "--repeats", "1", "--speed-examples", "2", *TINY, *tracking(tmp_path)])
    return result, decodes


def comparison_and_row_params(tmp_path, result) -> tuple[dict, dict]:
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    row = client.get_run(result["rows"][0]["mlflow_run_id"])
    comparison = client.get_run(row.data.tags["mlflow.parentRunId"])
    return comparison.data.params, row.data.params


def test_compare_times_on_the_resolved_device_and_reports_it(tmp_path, monkeypatch):
    # raising=False: code that never resolves a device must fail on the assertions, not here
    monkeypatch.setattr(compare, "decode_target", lambda cfg: DecodeTarget(META, Precision()), raising=False)
    result, decodes = untrained_comparison(tmp_path, monkeypatch)

    assert decodes.seen and all(seen[:3] == (META, META, META) for seen in decodes.seen)
    assert result["device"] == "meta"
    assert result["flush_denormal"] is False  # not a CPU: nothing to flush
    assert json.loads((tmp_path / "cmp.json").read_text())["device"] == "meta"
    assert ", meta, " in (tmp_path / "cmp.md").read_text().splitlines()[0]
    comparison, row = comparison_and_row_params(tmp_path, result)
    assert comparison["device"] == "meta" and comparison["flush_denormal"] == "False"
    assert row["speed.device"] == "meta"


def test_compare_flushes_denormals_while_timing_on_a_cpu(tmp_path, monkeypatch):
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU cannot flush denormals")
    result, decodes = untrained_comparison(tmp_path, monkeypatch)

    cpu = torch.device("cpu")
    assert decodes.seen and all(seen == (cpu, cpu, cpu, True) for seen in decodes.seen)
    assert not flushing()  # the previous mode is back
    assert result["device"] == "cpu" and result["flush_denormal"] is True
    assert "denormals flushed to zero" in (tmp_path / "cmp.md").read_text().splitlines()[0]
    comparison, row = comparison_and_row_params(tmp_path, result)
    assert comparison["flush_denormal"] == "True" and row["speed.flush_denormal"] == "True"
    assert comparison["device"] == "cpu"


class FirstDecode(Exception):
    """Stops tasks.experiments.distill at its first decode: where that runs is all the test needs."""


def saved_untrained(tmp_path) -> str:
    """A checkpoint of an untrained tiny keyphrase model, as tasks.fit writes one."""
    cfg = compose("keyphrase", "sequential", None, [*TINY, *tracking(tmp_path)])
    built = build(cfg)
    trainer = make_trainer(cfg, None)
    trainer.test(built.module, datamodule=built.datamodule, verbose=False)
    path = tmp_path / "teacher.ckpt"
    trainer.save_checkpoint(path)
    return str(path)


def test_distill_decodes_on_the_resolved_device(tmp_path, monkeypatch):
    teacher = saved_untrained(tmp_path)
    seen = []

    def recording(decoder, model, input_ids, attention_mask):
        seen.append((next(model.parameters()).device, input_ids.device, attention_mask.device))
        raise FirstDecode

    monkeypatch.setattr(tasks.module, "timed_generate", recording)
    monkeypatch.setattr(distill, "decode_target", lambda cfg: DecodeTarget(META, Precision()), raising=False)
    with pytest.raises(FirstDecode):
        distill.main(["--ckpt", teacher, "--out", str(tmp_path / "distilled"), *tracking(tmp_path)])
    assert seen == [(META, META, META)]


@pytest.mark.parametrize("precision, weights, autocast", [
    ("32-true", torch.float32, False), ("64-true", torch.float64, False),
    ("bf16-mixed", torch.float32, True), ("bf16-true", torch.bfloat16, False)])
def test_predict_decodes_in_the_configured_precision(precision, weights, autocast, tmp_path,
                                                     monkeypatch):
    checkpoint = saved_untrained(tmp_path)
    records = tmp_path / "new.jsonl"
    records.write_text(json.dumps({"title": "a title", "abstract": "an abstract"}) + "\n")
    seen = []

    def recording(decoder, model, input_ids, attention_mask):
        seen.append((next(model.parameters()).dtype, torch.is_autocast_enabled("cpu")))
        raise FirstDecode

    monkeypatch.setattr(tasks.module, "timed_generate", recording)
    with pytest.raises(FirstDecode):
        predict.main(["--ckpt", checkpoint, "--input", str(records), "trainer.accelerator=cpu",
                      f"trainer.precision={precision}"])
    assert seen == [(weights, autocast)]


def test_decode_target_follows_the_trainer_settings():
    default = compose("keyphrase", "sequential", None, [])  # trainer.accelerator=auto
    expected = "cuda:0" if torch.cuda.is_available() else "mps:0" if torch.backends.mps.is_available() \
        else "cpu"
    assert str(decode_target(default).device) == expected
    assert decode_target(compose("keyphrase", "sequential", None, ["trainer.accelerator=cpu"])).device \
        == torch.device("cpu")


@pytest.mark.skipif(GPU_LIKE_AVAILABLE, reason="needs a machine without CUDA and MPS")
def test_an_unavailable_accelerator_is_refused_before_any_work(monkeypatch):
    cfg = compose("keyphrase", "sequential", None, ["trainer.accelerator=gpu"])
    with pytest.raises(ConfigError, match=r"trainer.accelerator='gpu' with trainer.devices=1 cannot "
                                          r"run here: .*accelerators available here: auto, cpu\)"):
        decode_target(cfg)

    def no_training(*args, **kwargs):
        raise AssertionError("trained although the accelerator is unavailable")

    monkeypatch.setattr(compare, "train_and_test", no_training)
    with pytest.raises(ConfigError, match="trainer.accelerator='cuda'"):
        compare.main(["--decoders", "sequential", "trainer.accelerator=cuda"])
