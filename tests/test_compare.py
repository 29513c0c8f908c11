"""`tasks.compare` on a tiny run: JSON schema, speedup arithmetic, MLflow runs by tag, plots."""
import json

import pytest
from mlflow.tracking import MlflowClient

from tasks import compare
from tasks.config import ConfigError
from tests.test_end_to_end import TINY, tracking

ROW_KEYS = {"decoder", "options", "quality", "examples_per_second_bs1", "examples_per_second_batch",
            "speedup_bs1", "speedup_batch", "decoder_calls_per_example", "reference_calls_per_example",
            "tokens_per_call", "peak_memory_mb"}


@pytest.mark.slow
def test_compare_writes_table_json_plots_and_tagged_runs(tmp_path):
    out = tmp_path / "cmp.json"
    result = compare.main(["--task", "keyphrase", "--decoders", "sequential,pipelined",
                           "--out", str(out), "--repeats", "2", "--speed-examples", "4",
                           "--sweep", "decoder.max_subsequence_length=4,8",
                           *TINY, *tracking(tmp_path)])
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(result))
    assert {"task", "data", "model", "device", "threads", "rows"} <= set(written)
    assert [r["label"] for r in written["rows"]] == [
        "sequential", "pipelined(max_subsequence_length=4)", "pipelined(max_subsequence_length=8)"]
    for row in written["rows"]:
        assert ROW_KEYS <= set(row)
        assert "present_f1_at_M" in row["quality"] and "examples_per_second" not in row["quality"]
    sequential = written["rows"][0]
    assert sequential["speedup_bs1"] == pytest.approx(1.0)
    for row in written["rows"][1:]:
        assert row["speedup_bs1"] == pytest.approx(row["examples_per_second_bs1"]
                                                   / sequential["examples_per_second_bs1"])
        assert row["speedup_batch"] == pytest.approx(row["examples_per_second_batch"]
                                                     / sequential["examples_per_second_batch"])
    assert sequential["tokens_per_call"] == pytest.approx(1.0)
    # calls the test references need: fewer pipelined; a decode-time bound does not enter
    references = [row["reference_calls_per_example"] for row in written["rows"]]
    assert references[1] == references[2] < references[0]

    table = out.with_suffix(".md").read_text()
    assert "| sequential |" in table and "speedup bs1" in table
    plots = sorted(p.name for p in tmp_path.glob("cmp_*.png"))
    assert plots == ["cmp_quality_vs_speed.png", "cmp_speedup_vs_subsequences.png"]

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name("keyphrase")
    comparison = client.get_run(written["rows"][0]["mlflow_run_id"]).data.tags["comparison_id"]
    runs = client.search_runs([experiment.experiment_id],
                              filter_string=f"tags.comparison_id = '{comparison}'")
    roles = sorted(r.data.tags["role"] for r in runs)
    assert roles == ["row", "row", "row", "summary"]
    for run in runs:
        if run.data.tags["role"] == "row":
            assert "test/speedup_bs1" in run.data.metrics and "test/present_f1_at_M" in run.data.metrics
        else:
            artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
            assert {"cmp.json", "cmp.md", "cmp_quality_vs_speed.png"} <= artifacts
    # the two pipelined rows differ only in a decode-time option: one model was trained for both
    trained = [r for r in runs if r.data.tags.get("role") == "row"
               and r.data.params.get("decoder.name") == "pipelined"
               and "train/loss" in r.data.metrics]
    assert len(trained) == 1


def test_sweep_of_an_option_no_decoder_has_is_refused():
    with pytest.raises(ConfigError, match="no decoder among sequential has option 'delay'"):
        compare.plan("keyphrase", ["sequential"], None, [], {"decoder.delay": ["1", "2"]})


def test_decoder_specific_override_goes_to_its_decoder_only():
    rows = compare.plan("keyphrase", ["sequential", "pipelined"], None, ["decoder.delay=2"], {})
    assert [cfg.decoder.name for cfg, _ in rows] == ["sequential", "pipelined"]
    assert rows[1][0].decoder.delay == 2 and "delay" not in rows[0][0].decoder


@pytest.mark.slow
def test_gpu_benchmark_runs_on_the_cpu_with_a_note(tmp_path):
    """The accelerator script, exercised where there is none: the same code path on the CPU, with
    the note saying so, one row per checkpoint and batch size."""
    from tasks import fit, gpu_benchmark
    paths = {name: fit.main(["--decoder", name, *TINY, *tracking(tmp_path)])["checkpoint"]
             for name in ("sequential", "pipelined")}
    out = tmp_path / "bench.json"
    result = gpu_benchmark.main([f"--ckpt=sequential={paths['sequential']}",
                                 f"--ckpt=pipelined={paths['pipelined']}", "--batch-sizes", "1,4",
                                 "--repeats", "1", "--precision", "bf16", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["device"] == "cpu" and "not GPU figures" in result["note"]
    names = ["sequential", "pipelined", "transformers generate"]
    assert [(r["decoder"], r["batch_size"]) for r in result["rows"]] == [
        *((name, 1) for name in names), *((name, 4) for name in names)]
    assert result["sequential_equals_generate"] is True
    assert all(r["examples_per_second"] > 0 for r in result["rows"])
    assert result["rows"][0]["speedup"] == 1.0
    assert "not GPU figures" in out.with_suffix(".md").read_text()
