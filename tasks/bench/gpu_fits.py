"""The fits behind a GPU comparison, in one table: each fit's test scores and wall time.

    python -m tasks.bench.gpu_fits RUNS [--out results/gpu/fits.json]

RUNS holds one tracking store per fit, as tasks/bench/run_gpu_benchmarks.sh writes them:
RUNS/TASK/DECODER/mlflow.db, with the fit's wall-clock seconds in RUNS/TASK/DECODER/fit_seconds.
Per fit: its model's size, its epochs and training examples, the test scores its own decoder
reached on the task's whole test split (as tasks.fit logged them), its outputs cut by a bound,
its decoder calls per example, and its wall seconds (process start, data, training, validation
and test). Fits that shared the device slow each other, so the wall seconds are not speed figures.
Recorded with the device, torch and CUDA versions and the library's commit of the machine it runs
on, which is where the fits ran when it runs right after them.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from tasks.cli import command_line, main_guard, show_report
from tasks.comparison.report import primary_metric
from tasks.comparison.timing import conditions_caption, timing_conditions
from tasks.config import ConfigError

# A fit's configuration that the table shows, as tasks.fit logs it among its run's parameters.
SHOWN_PARAMETERS = ("model.d_model", "model.d_ff", "model.num_heads", "model.num_layers",
                    "model.num_decoder_layers", "trainer.max_epochs", "data.train_size")


def fit_order(decoder: str) -> tuple:
    """Where a decoder's fit goes among a task's rows: the script's order, others after by name."""
    order = ("sequential", "pipelined", "blockwise", "nar")
    return (order.index(decoder) if decoder in order else len(order), decoder)


def fit_rows(runs: Path) -> list[dict]:
    """One row per tracking store under `runs` (TASK/DECODER/mlflow.db), from its latest finished
    run: task, decoder, the shown parameters, test scores and wall seconds (a store with no
    finished run: task and decoder alone, its run id None)."""
    from mlflow.tracking import MlflowClient
    stores = list(runs.glob("*/*/mlflow.db"))
    if not stores:
        raise ConfigError(f"{runs}: no fit's tracking store (TASK/DECODER/mlflow.db) in it")
    rows = []
    for store in sorted(stores, key=lambda store: (store.parent.parent.name,
                                                   fit_order(store.parent.name))):
        task, decoder = store.parent.parent.name, store.parent.name
        client = MlflowClient(f"sqlite:///{store.resolve()}")
        experiments = [e.experiment_id for e in client.search_experiments()]
        finished = client.search_runs(experiments, filter_string="attributes.status = 'FINISHED'",
                                      order_by=["attributes.start_time DESC"], max_results=1)
        if not finished:   # a fit that failed or was stopped: named, without scores
            rows.append({"task": task, "decoder": decoder, "mlflow_run_id": None})
            continue
        run = finished[0]
        seconds = store.parent / "fit_seconds"
        rows.append({"task": task, "decoder": decoder, "mlflow_run_id": run.info.run_id,
                     "parameters": {key: run.data.params.get(key) for key in SHOWN_PARAMETERS},
                     "primary_metric": primary_metric(task),
                     "test_scores": {key.removeprefix("test/"): value
                                     for key, value in sorted(run.data.metrics.items())
                                     if key.startswith("test/")},
                     "fit_wall_seconds": int(seconds.read_text()) if seconds.is_file() else None})
    return rows


def markdown(result: dict) -> str:
    lines = [f"Test scores of the fits under {result['runs']} (each on its task's whole test split, "
             f"decoded by the fit's own decoder), {conditions_caption(result)}. Fits that shared "
             f"the device slow each other, so the wall seconds are not speed figures"
             + (f" ({result['note']})" if result["note"] else "") + ".", "",
             "| task | decoder | model (d_model, d_ff, heads, layers) | epochs | training examples "
             "| primary quality | bound hits | decoder calls/ex | fit wall s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in (row for row in result["rows"] if row["mlflow_run_id"]):
        p, scores, primary = row["parameters"], row["test_scores"], row["primary_metric"]
        model = (f"{p['model.d_model']}, {p['model.d_ff']}, {p['model.num_heads']}, "
                 f"{p['model.num_layers']}+{p['model.num_decoder_layers']}")
        quality = f"{primary} {scores[primary]:.3f}" if primary in scores else "-"
        cell = {key: "-" if scores.get(key) is None else f"{scores[key]:{form}}"
                for key, form in (("bound_hits", ".0f"), ("decoder_calls_per_example", ".1f"))}
        wall = "-" if row["fit_wall_seconds"] is None else row["fit_wall_seconds"]
        lines.append(f"| {row['task']} | {row['decoder']} | {model} | {p['trainer.max_epochs']} | "
                     f"{p['data.train_size']} | {quality} | {cell['bound_hits']} | "
                     f"{cell['decoder_calls_per_example']} | {wall} |")
    unfinished = [f"{row['task']} {row['decoder']}" for row in result["rows"]
                  if not row["mlflow_run_id"]]
    if unfinished:
        lines += ["", "Not finished (no scores): " + ", ".join(unfinished)]
    lines += ["", f"Command: `{result['command']}`"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", help="the folder of the fits' tracking stores (TASK/DECODER/mlflow.db)")
    parser.add_argument("--out", default=None, help="write FILE.json and FILE.md")
    args = parser.parse_args(argv)
    runs = Path(args.runs)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {**timing_conditions(device, torch.get_num_threads()), "runs": args.runs,
              "rows": fit_rows(runs), "command": command_line("tasks.bench.gpu_fits", argv)}
    show_report(args.out, result, markdown(result))
    return result


if __name__ == "__main__":
    main_guard(main)
