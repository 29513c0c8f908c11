"""The MLflow UI and a tracking server: the links the commands print, and a comparison logged to a
real `mlflow server` over HTTP, read back through its REST API."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import parse_qs, unquote, urlencode

import pytest
from omegaconf import OmegaConf

from tasks import compare
from tasks.comparison.report import summary_metrics
from tasks.runs.tracking import compare_runs_link, run_link
from tests.test_end_to_end import TINY

# ---- links to the UI ------------------------------------------------------------------------------


def tracked(uri: str):
    return OmegaConf.create({"tracking": {"uri": uri}})


def run(run_id: str, experiment_id: str = "3") -> SimpleNamespace:
    """What the links read of an MLFlowLogger."""
    return SimpleNamespace(run_id=run_id, experiment_id=experiment_id)


def test_a_run_link_opens_the_runs_machine_learning_view_on_the_tracking_server():
    assert run_link(tracked("http://mlflow.example:5000/"), run("a1b2")) == \
        "http://mlflow.example:5000/#/experiments/3/runs/a1b2?workflowType=machine_learning"
    assert run_link(tracked("https://example.org/mlflow"), run("a1b2")) == \
        "https://example.org/mlflow/#/experiments/3/runs/a1b2?workflowType=machine_learning"


def test_a_run_link_to_a_local_store_says_how_to_serve_the_ui():
    assert run_link(tracked("sqlite:///mlruns/mlflow.db"), run("a1b2")) == (
        "http://127.0.0.1:5000/#/experiments/3/runs/a1b2?workflowType=machine_learning "
        "(serve the UI with `mlflow ui --backend-store-uri sqlite:///mlruns/mlflow.db`)")
    assert "--backend-store-uri 'sqlite:///my runs/mlflow.db'" in run_link(
        tracked("sqlite:///my runs/mlflow.db"), run("a1b2"))


def test_the_compare_runs_link_lists_runs_and_experiments_as_the_ui_writes_them():
    link = compare_runs_link(tracked("http://127.0.0.1:5000"),
                             [run("a1", "3"), run("b2", "12"), run("c3", "3")])
    assert link == ("http://127.0.0.1:5000/#/compare-runs?runs=[%22a1%22,%22b2%22,%22c3%22]"
                    "&experiments=[%2212%22,%223%22]")
    # as the compare page reads it: the query decoded, then each value as JSON
    query = parse_qs(unquote(link.split("?", 1)[1]))
    assert json.loads(query["runs"][0]) == ["a1", "b2", "c3"]
    assert json.loads(query["experiments"][0]) == ["12", "3"]


# ---- a comparison on a tracking server ------------------------------------------------------------

SERVER_START_SECONDS = 60


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def healthy(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"{address}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture
def mlflow_server(tmp_path):
    """`mlflow server` on a free port with a sqlite store, serving artifacts (uploads and downloads
    through the server, into tmp_path/server-artifacts); its address. Stopped at the end, with the
    workers it started (its own process group)."""
    address = f"http://127.0.0.1:{free_port()}"
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("mlflow")), "server",
         "--backend-store-uri", f"sqlite:///{tmp_path}/server.sqlite",
         "--serve-artifacts", "--artifacts-destination", str(tmp_path / "server-artifacts"),
         "--host", "127.0.0.1", "--port", address.rsplit(":", 1)[1], "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + SERVER_START_SECONDS
        while not healthy(address):
            if server.poll() is not None or time.monotonic() > deadline:
                output = (tmp_path / "server.log").read_text()[-3000:]
                pytest.fail(f"mlflow server did not start within {SERVER_START_SECONDS}s: {output}")
            time.sleep(0.5)
        yield address
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


def rest(address: str, endpoint: str, body: dict | None = None, **query) -> dict:
    """A call to the server's REST API: GET with `query`, or POST of `body`."""
    url = f"{address}/api/2.0/mlflow/{endpoint}" + (f"?{urlencode(query)}" if query else "")
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def as_dict(entries: list[dict]) -> dict:
    return {entry["key"]: entry["value"] for entry in entries}


@pytest.mark.slow
def test_a_comparison_on_a_tracking_server_nests_its_rows_under_its_run(mlflow_server, tmp_path,
                                                                        capsys):
    result = compare.main(["--decoders", "sequential,pipelined", "--out", str(tmp_path / "cmp.json"),
                           "--repeats", "1", "--speed-examples", "2", *TINY,
                           f"tracking.uri={mlflow_server}",
                           f"tracking.artifact_location={tmp_path}/checkpoints",
                           f"data.tokenizer_cache={tmp_path}/tok"])
    printed = capsys.readouterr().out

    experiment = rest(mlflow_server, "experiments/get-by-name", experiment_name="keyphrase")["experiment"]
    row_ids = [row["mlflow_run_id"] for row in result["rows"]]
    comparison = rest(mlflow_server, "runs/get", run_id=row_ids[0])["run"]["data"]["tags"]
    found = rest(mlflow_server, "runs/search", {
        "experiment_ids": [experiment["experiment_id"]],
        "filter": f"tags.comparison_id = '{as_dict(comparison)['comparison_id']}'"})["runs"]
    [parent] = [r for r in found if as_dict(r["data"]["tags"])["role"] == "comparison"]
    parent_id = parent["info"]["run_id"]
    assert parent["info"]["status"] == "FINISHED"
    assert sorted(r["info"]["run_id"] for r in found if r is not parent) == sorted(row_ids)

    for run_id in row_ids:  # every row a child of the comparison's run, its artifacts on the server
        row = rest(mlflow_server, "runs/get", run_id=run_id)["run"]
        tags = as_dict(row["data"]["tags"])
        assert tags["mlflow.parentRunId"] == parent_id and tags["role"] == "row"
        assert row["info"]["artifact_uri"].startswith("mlflow-artifacts:")
        listed = rest(mlflow_server, "artifacts/list", run_id=run_id)["files"]
        assert {"config.yaml", "predictions.jsonl"} <= {f["path"] for f in listed}
    # checkpoints stay on this machine, in tracking.artifact_location
    for run_id in row_ids:
        assert list((tmp_path / "checkpoints" / run_id / "checkpoints").glob("*.ckpt"))

    artifacts = {f["path"] for f in rest(mlflow_server, "artifacts/list", run_id=parent_id)["files"]}
    assert {"cmp.json", "cmp.md", "cmp_quality_vs_speed.png"} <= artifacts
    metrics = as_dict(rest(mlflow_server, "runs/get", run_id=parent_id)["run"]["data"]["metrics"])
    assert metrics == pytest.approx(summary_metrics(result))
    assert {"sequential/present_f1_at_M", "pipelined/present_f1_at_M",
            "sequential/decoder_calls_per_example", "pipelined/decoder_calls_per_example"} <= set(metrics)
    params = as_dict(parent["data"]["params"])
    assert params["device"] == result["device"] and params["threads"] == str(result["threads"])

    ui = f"{mlflow_server}/#/"
    assert (f"{ui}experiments/{experiment['experiment_id']}/runs/{parent_id}"
            f"?workflowType=machine_learning") in printed
    assert f"{ui}compare-runs?runs=[%22{row_ids[0]}%22,%22{row_ids[1]}%22]" in printed
