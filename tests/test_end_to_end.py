"""`tasks.fit` and `tasks.test` end to end on a few dozen built-in examples, checked through MLflow."""
import json
import math
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from datamodules.datamodule import SubsequenceDataModule
from tasks import fit, test as test_entry
from tasks.config import ConfigError, compose
from tasks.runs.tracking import records_digest
from tasks.runs.trainer import build
from tests.conftest import save_checkpoint

TINY = ["data.train_size=32", "data.validation_size=8", "data.test_size=8",
        "model.d_model=32", "model.d_ff=64", "model.d_kv=16", "model.num_heads=2",
        "model.position_heads.encoder=[-1,1]",  # QA's default names 6 encoder heads
        "model.vocab_size=300", "data.max_target_length=40", "train.batch_size=8",
        "trainer.max_epochs=1", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false"]

QUALITY = {"keyphrase": "present_f1_at_M", "qa": "em_f1", "summarization": "rougeL"}


def tracking(tmp_path: Path) -> list[str]:
    return [f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
            f"tracking.artifact_location={tmp_path}/artifacts",
            f"data.tokenizer_cache={tmp_path}/tok"]


@pytest.mark.slow
@pytest.mark.parametrize("task", ["keyphrase", "qa", "summarization"])
def test_fit_tracks_run_and_test_rescoring(task, tmp_path):
    result = fit.main(["--task", task, *TINY, *tracking(tmp_path)])
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.get_run(result["run_id"])
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.name == task
    assert run.info.run_name == "sequential t5-tiny builtin"
    params = run.data.params
    assert params["task.name"] == task and params["decoder.name"] == "sequential"
    assert params["trainer.max_epochs"] == "1" and params["model.d_model"] == "32"
    assert "data_report.train.sources_truncated" in params
    metrics = run.data.metrics
    for name in ("train/loss", f"val/{QUALITY[task]}", f"test/{QUALITY[task]}",
                 "test/examples_per_second", "test/decoder_calls_per_example", "test/tokens_per_call"):
        assert name in metrics, name
    assert metrics["test/examples_per_second"] > 0
    assert metrics["test/tokens_per_call"] == 1.0  # sequential: one token per decoder call
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "predictions.jsonl"} <= artifacts
    local = Path(client.download_artifacts(run.info.run_id, "predictions.jsonl", str(tmp_path)))
    rows = [json.loads(line) for line in local.read_text().splitlines()]
    assert len(rows) == 8 and all({"id", "prediction", "targets", "decoder_calls"} <= set(r) for r in rows)

    # the checkpoint lies in the run's folder, and tasks.test re-scores it as a new run
    assert Path(result["checkpoint"]).is_file() and run.info.run_id in result["checkpoint"]
    again = test_entry.main(["--ckpt", result["checkpoint"], *tracking(tmp_path),
                             "trainer.enable_progress_bar=false"])
    assert again["run_id"] != result["run_id"]
    assert again["scores"][QUALITY[task]] == pytest.approx(result["scores"][QUALITY[task]], abs=1e-9)

    # each split the run used is a dataset input, named after the data source, with a digest of
    # the split's records; tasks.test uses the test split only; other data, another digest
    datamodule = SubsequenceDataModule(compose(task, None, None, TINY))
    expected = {split: (f"builtin-{task}", records_digest(datamodule.records(split)))
                for split in ("train", "validation", "test")}
    assert dataset_inputs(run) == expected and len({d for _, d in expected.values()}) == 3
    assert dataset_inputs(client.get_run(again["run_id"])) == {"test": expected["test"]}
    fewer = test_entry.main(["--ckpt", result["checkpoint"], *tracking(tmp_path),
                             "data.max_eval_examples=4", "trainer.enable_progress_bar=false"])
    name, digest = dataset_inputs(client.get_run(fewer["run_id"]))["test"]
    assert name == f"builtin-{task}" and digest != expected["test"][1]

    # a checkpoint refuses a decoder of another layout, naming both
    with pytest.raises(ConfigError, match="trained with decoder 'sequential'; decoder 'pipelined' "
                                          "cannot decode it"):
        test_entry.main(["--ckpt", result["checkpoint"], "decoder=pipelined", *tracking(tmp_path)])


def test_lookup_decodes_a_sequential_checkpoint_as_sequential_does(tmp_path):
    """`tasks.test --ckpt S decoder=lookup`: a sequential checkpoint (here an untrained model saved
    as tasks.fit saves one) decoded with lookup's options predicts what sequential predicts."""
    built = build(compose("keyphrase", "sequential", None, [*TINY, *tracking(tmp_path)]))
    path = save_checkpoint(built.module, tmp_path / "sequential.ckpt")
    sequential = test_entry.main(["--ckpt", path, *tracking(tmp_path)])
    lookup = test_entry.main(["--ckpt", path, "decoder=lookup", "decoder.draft_tokens=4",
                              "decoder.match=2", *tracking(tmp_path)])
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    params = client.get_run(lookup["run_id"]).data.params
    assert [params[f"decoder.{key}"] for key in ("name", "draft_tokens", "match")] == ["lookup", "4", "2"]
    predicted = [[r["prediction"] for r in run_artifact_rows(client, run["run_id"], tmp_path / name)]
                 for name, run in (("sequential", sequential), ("lookup", lookup))]
    assert predicted[0] == predicted[1]


@pytest.mark.slow
@pytest.mark.parametrize("task", ["keyphrase", "qa", "summarization"])
@pytest.mark.parametrize("decoder", ["pipelined", "blockwise", "nar"])
def test_every_decoder_fits_and_decodes_every_task(task, decoder, tmp_path):
    result = fit.main(["--task", task, "--decoder", decoder, *TINY, *tracking(tmp_path)])
    run = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(result["run_id"])
    assert run.info.status == "FINISHED" and run.data.params["decoder.name"] == decoder
    assert QUALITY[task] in result["scores"] and result["scores"]["examples_per_second"] > 0
    if decoder == "nar":  # one call per Mask-Predict iteration, fewer for outputs shorter than 4
        assert 1.0 <= result["scores"]["decoder_calls_per_example"] <= 4.0


@pytest.mark.slow
@pytest.mark.parametrize("decoder", ["sequential", "pipelined", "blockwise", "nar"])
def test_bf16_mixed_precision_trains_and_decodes_every_decoder(decoder, tmp_path):
    """`trainer.precision=bf16-mixed` on a CPU (autocast to bfloat16): every logged training loss
    and every score is finite, and the test split is decoded."""
    result = fit.main(["--task", "keyphrase", "--decoder", decoder, "trainer.precision=bf16-mixed",
                       *TINY, *tracking(tmp_path)])
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    losses = [m.value for m in client.get_metric_history(result["run_id"], "train/loss")]
    assert losses and all(math.isfinite(v) for v in losses)
    assert all(math.isfinite(v) for v in result["scores"].values())
    assert client.get_run(result["run_id"]).data.params["trainer.precision"] == "bf16-mixed"


def dataset_inputs(run) -> dict[str, tuple[str, str]]:
    """A run's dataset inputs: context (the split) -> (dataset name, digest)."""
    return {next(tag.value for tag in item.tags if tag.key == "mlflow.data.context"):
            (item.dataset.name, item.dataset.digest) for item in run.inputs.dataset_inputs}


def run_artifact_rows(client: MlflowClient, run_id: str, folder: Path) -> list[dict]:
    """The rows of a run's predictions.jsonl artifact, downloaded into `folder`."""
    local = client.download_artifacts(run_id, "predictions.jsonl", str(folder))
    return [json.loads(line) for line in Path(local).read_text().splitlines()]


def weights(checkpoint_path: str) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint_path, map_location="cpu", weights_only=False)["state_dict"]


@pytest.mark.slow
def test_init_from_a_checkpoint_starts_from_its_backbone_and_tokenizer(tmp_path):
    """Blockwise heads trained on a frozen, trained sequential backbone (Stern et al.'s frozen
    setting): the backbone stays the sequential model's, so exact blockwise decoding gives its
    predictions. The tokenizer comes from the checkpoint, not from training a new one. Its
    validation score is the same every epoch, and the latest of equal scores is tested."""
    sequential = fit.main(["--task", "keyphrase", *TINY, *tracking(tmp_path)])
    fresh_cache = tmp_path / "unused_tokenizer_cache"
    blockwise = fit.main(["--task", "keyphrase", "--decoder", "blockwise",
                          f"train.init_from={sequential['checkpoint']}", "decoder.freeze_backbone=true",
                          *TINY, "trainer.max_epochs=3", "model.dropout=0.2", *tracking(tmp_path),
                          f"data.tokenizer_cache={fresh_cache}"])
    assert not fresh_cache.exists()
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    scores = [m.value for m in client.get_metric_history(blockwise["run_id"], "val/present_f1_at_M")]
    assert len(scores) == 3 and len(set(scores)) == 1
    assert Path(blockwise["checkpoint"]).name == "epoch2-step12.ckpt"
    start, end = weights(sequential["checkpoint"]), weights(blockwise["checkpoint"])
    backbone = [key for key in start if key.startswith("backbone.")]
    assert backbone and all(torch.equal(start[key], end[key]) for key in backbone)
    assert any(key.startswith("decoder.heads") for key in end)
    predicted = {name: [row["prediction"] for row in
                        run_artifact_rows(client, result["run_id"], tmp_path / name)]
                 for name, result in (("blockwise", blockwise), ("sequential", sequential))}
    assert predicted["blockwise"] == predicted["sequential"]

    with pytest.raises(ConfigError, match=r"holds another model: model.d_model: 32 in the "
                                          r"checkpoint, 64 now"):
        fit.main(["--decoder", "pipelined", f"train.init_from={sequential['checkpoint']}",
                  *TINY, "model.d_model=64", *tracking(tmp_path)])
    with pytest.raises(ConfigError, match="no such checkpoint file"):
        fit.main([f"train.init_from={tmp_path}/missing.ckpt", *TINY, *tracking(tmp_path)])
