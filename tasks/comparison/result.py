"""A comparison's JSON, built in one place from its rows' records: each row's test pass
(`tasks.module.Evaluation`), its timing (`tasks.comparison.measure.Speed`) and what the plan knows
of it (`tasks.comparison.plan.Row`), beside the conditions of the timing and the task's baselines.
Everything the table and the plots show is in it (`tasks.comparison.report` reads nothing else)."""
from __future__ import annotations

import statistics

from omegaconf import DictConfig

from decoders import decoder_class
from tasks.comparison.measure import (Measurement, Speed, reference_calls_per_example,
                                      target_subsequences, trained_parameters)
from tasks.comparison.plan import Row
from tasks.comparison.report import SPEEDUPS, judge
from tasks.module import Evaluation


def counter_figures(tested: Evaluation) -> tuple[dict[str, float], dict[str, float]]:
    """The decoder's own counters over a test pass (`Evaluation.counters`), as the table shows
    them: per decoder call (`counters_per_call`), and a time counter (`*_seconds`) as its share of
    the pass's decode time (`decode_time_shares`)."""
    calls = tested.telemetry["decoder_calls_per_example"] * tested.examples
    seconds = tested.telemetry["decode_seconds"]
    per_call = {name: value / calls for name, value in tested.counters.items()
                if not name.endswith("_seconds") and calls}
    shares = {name: value / seconds for name, value in tested.counters.items()
              if name.endswith("_seconds") and seconds}
    return per_call, shares


def row_entry(row: Row, speed: Speed, reference: Speed | None) -> dict:
    """A row's entry in the JSON; its speedups over sequential's timing `reference` (None without a
    sequential row)."""
    per_call, shares = counter_figures(row.tested)
    entry = {
        "decoder": row.cfg.decoder.name, "label": row.label, "options": row.options,
        "training": row.training,
        "trained_parameters": trained_parameters(row.module),
        "fit_seconds": row.fit_seconds,
        "quality": row.tested.quality,
        "examples_per_second_bs1": speed.examples_per_second("bs1"),
        "examples_per_second_batch": speed.examples_per_second("batch"),
        "speedup_bs1": None, "speedup_batch": None,
        "decoder_calls_per_example": row.tested.telemetry["decoder_calls_per_example"],
        "reference_calls_per_example": reference_calls_per_example(row),
        "tokens_per_call": row.tested.telemetry["tokens_per_call"],
        # test outputs stopped by a decoder bound (every decoder's: data.max_target_length output
        # tokens, plus pipelined's slot limits) rather than by their own end token
        "bound_hits": int(row.tested.telemetry["bound_hits"]),
        "peak_memory_mb": speed.peak_memory_mb,
        "inexact": decoder_class(row.cfg.decoder.name).inexact(row.options),
        "counters_per_call": per_call, "decode_time_shares": shares,
        "example_seconds_bs1": speed.example_seconds_bs1,
        "mlflow_run_id": row.logger.run_id,
    }
    if reference is not None:
        for key in SPEEDUPS:
            timing = key.removeprefix("speedup_")
            # pass r of the row against pass r of sequential, timed side by side: the speedup is
            # their median, and the passes stay to show its spread
            passes = [base / own for own, base in zip(getattr(speed, f"pass_seconds_{timing}"),
                                                      getattr(reference, f"pass_seconds_{timing}"))]
            entry[key] = statistics.median(passes)
            entry[f"{key}_passes"] = passes
    return entry


def comparison_result(rows: list[Row], cfg: DictConfig, threads: int, measured: Measurement,
                      speed_examples: int | None, baselines: list[dict]) -> dict:
    """The comparison's JSON: one entry per row (`row_entry`), the conditions of the timing
    (`measured`, of the first `speed_examples` test examples), the references' subsequences of the
    timed examples, and the task's `baselines` (entries of `tasks.baselines.scored_baselines`),
    judged (`judge`)."""
    reference = next((speed for row, speed in zip(rows, measured.speeds)
                      if row.cfg.decoder.name == "sequential"), None)
    device = measured.device
    return judge({"task": cfg.task.name, "data": recorded_data(cfg), "model": cfg.model.name,
                  "device": device, "threads": threads, "flush_denormal": measured.flush_denormal,
                  "eval_batch_size": cfg.eval.batch_size,
                  "memory": "CUDA max allocated" if device.startswith("cuda")
                  else "CPU heap-in-use growth during decoding (glibc mallinfo2, sampled)",
                  "test_examples": rows[0].tested.examples,
                  "target_subsequences": target_subsequences(rows[0].datamodule, speed_examples),
                  "rows": [row_entry(row, speed, reference)
                           for row, speed in zip(rows, measured.speeds)],
                  "baselines": baselines})


def recorded_data(cfg: DictConfig) -> str:
    """What a result records as its data: a JSONL folder's path, else the source's name."""
    return cfg.data.path if cfg.data.source == "jsonl" else cfg.data.source
