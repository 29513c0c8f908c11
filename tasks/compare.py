"""Compare decoders side by side: same data, model size, seed and training budget; one table.

    python -m tasks.compare --task keyphrase --decoders sequential,pipelined,blockwise,nar \\
        [--out FILE.json] [--ckpt NAME=PATH ...] [--sweep decoder.delay=1,2,3] \\
        [--backbone from-sequential|own] [--resume [COMPARISON_ID]] [key=value ...]

Each decoder is trained (or loaded with --ckpt) and its test split decoded and scored as its own
MLflow run. With sequential among the decoders, a decoder that can build on a trained sequential
model (blockwise, onestep: `Decoder.builds_on_sequential`) trains on the sequential row's tested
checkpoint (`train.init_from`), its backbone frozen, as Stern et al. add heads to a trained model:
its quality is the sequential row's by construction. `--backbone own` trains blockwise's base head
jointly with its heads instead; the user's own `train.init_from` or `decoder.freeze_backbone` wins;
the table's `training` column says which was used. A --ckpt checkpoint must have been trained for
its row of the plan (the same task, data, model and, for the same decoder, trained options; checked
before any work); its row is scored under the comparison's settings like every other row. Then speed
is measured for all of them in this one process, with the same thread count, after a warm-up,
interleaving the decoders and taking the median of `--repeats` passes: examples per second at batch
size 1 and at `eval.batch_size`, timing only `generate` (encoder + decoder calls) on batches
prepared beforehand. Timing runs on the device and in the precision the trainer settings give
(`trainer.accelerator`, `trainer.devices`, `trainer.precision`), as the rows' tests decoded, with
denormal floats flushed to zero on a CPU. Peak memory is taken in a
separate pass at the eval batch size (CUDA: max allocated; CPU: the C heap in use, sampled every
millisecond), over its level before the decode. The device and the flushing are recorded with the
results.

The task's trivial baselines (`tasks.baselines`: the most frequent training target; the most
frequent target strings, or the document's first sentences) are scored on the same test split, with
the same tokenizer and data limits, and shown after the rows (`baseline: constant`, ...). A row
whose primary quality is not above the best baseline's, or whose outputs mostly run to a length
bound, is marked not learned and gets no speedup (`tasks.comparison.report.judge`). Writes
FILE.json (`rows`, `baselines`), FILE.md and two plots next to them (and, per swept option, quality
and speedup against its value).

A decoder that trains nothing (lookup, aggressive: `Decoder.trains_nothing`) decodes the sequential
row's tested model as it is; without a sequential row or a --ckpt checkpoint for it, the comparison
is refused. aggressive drafts with the nar row's tested model (`Decoder.drafts_with`; its
`decoder.drafter` is set to that checkpoint), so it needs a nar row beside it (--ckpt nar=PATH reuses
one). A row whose options relax exact verification (top_k > 1) is labelled inexact in the table.

In MLflow the comparison is one run, created before any row is fitted, with every row's run nested
under it (`mlflow.parentRunId`), all tagged with one comparison id. It holds the table, its JSON and
the plots as artifacts, the conditions of the timing as parameters, and per row (`<label>/...`) the
shown quality, the speedups and the decoder calls per example as metrics, and per baseline
(`baseline_constant/...`) its shown quality. A failure or Ctrl-C
anywhere marks it FAILED or KILLED, and prints the command that goes on with it. Links to it and to
the rows side by side in the MLflow UI are printed at the end, after one line per row with its wall
time.

An interrupted comparison goes on with the same command and `--resume` (the latest unfinished
comparison of the same plan) or `--resume COMPARISON_ID`, in the same comparison run
(`tasks.comparison.resume`): a finished row is reused (its tested checkpoint decodes the test split
again, nothing is trained), an interrupted fit goes on from its `last.ckpt` in its own run, as
`tasks.fit --resume` does, and the rows not started are fitted; speed is then measured for all rows
together. A plan that differs (task, decoders, data, training options) is refused, naming the keys
that differ. Without `--resume`, an interrupted comparison of the same plan is pointed to in one
line. One line per row says where the comparison stands as the row starts.
"""
from __future__ import annotations

import argparse
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from lightning.pytorch.loggers import MLFlowLogger
from omegaconf import DictConfig, OmegaConf

from decoders import build_decoder, decoder_class
from tasks.baselines import scored_baselines
from tasks.comparison.measure import measure_speed
from tasks.comparison.plan import (BACKBONES, Row, check_checkpoint, check_drafters, on_sequential,
                                   parse_checkpoints, parse_decoders, parse_sweeps, plan, row_label,
                                   training_key, training_label, user_sets)
from tasks.comparison.resume import (PLAN_FILE, Attempt, Resumed, abandon, comparison_runs,
                                     find_comparison, plan_digest, plan_record, resumable_fit)
from tasks.comparison.report import markdown, plots, summary_metrics
from tasks.comparison.result import comparison_result
from tasks.config import ConfigError
from tasks.module import TASK_MODULES, Evaluation
from tasks.cli import (LATEST, add_resume_argument, base_parser, command_line, log, main_guard,
                       parse_with_resume, write_report)
from tasks.runs.checkpoints import last_checkpoint, load_checkpoint
from tasks.runs.tracking import (ExceptionWatcher, check_tracking, compare_runs_link, default_run_name,
                                 nested_under, open_tracking, reopen_run, run_link, run_status)
from tasks.runs.trainer import (Built, decode_target, decoder_options, evaluate_test, score_into_run,
                                train_and_test)
from tasks.runs.restore import attach_drafter, restore, tokenizer_identity

# `plan`'s rows: each one's resolved configuration and the decoder options its sweep set.
PlannedRows = list[tuple[DictConfig, list[str]]]


@dataclass(frozen=True)
class Tested:
    """A row's model and data, its run, its test pass and its training's seconds here (None when it
    trained nothing here), as `fit_rows` gets them before it makes the row."""
    built: Built
    logger: MLFlowLogger
    evaluation: Evaluation
    fit_seconds: float | None


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--task", default="keyphrase")
    parser.add_argument("--decoders", default="sequential,pipelined",
                        help="comma-separated registered decoder names")
    parser.add_argument("--out", default="comparison.json", help="where to write the JSON result")
    parser.add_argument("--ckpt", action="append", default=[], metavar="NAME=PATH",
                        help="reuse a checkpoint for decoder NAME instead of training")
    parser.add_argument("--sweep", action="append", default=[], metavar="decoder.OPTION=v1,v2",
                        help="one row per value, for the decoders that have OPTION")
    parser.add_argument("--backbone", choices=BACKBONES, default="from-sequential",
                        help="from-sequential: with sequential in --decoders, decoders that can "
                             "build on a trained sequential model (blockwise, onestep) train on its "
                             "checkpoint's backbone, frozen, as Stern et al.; own: they train their "
                             "own where they can (blockwise: base head jointly with the heads)")
    parser.add_argument("--repeats", type=int, default=3, help="timing passes (median is reported)")
    parser.add_argument("--speed-examples", type=int, default=None,
                        help="time on the first N test examples (default: all)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add_resume_argument(parser, "COMPARISON_ID",
                        "go on with the latest unfinished comparison of this plan (or with "
                        "comparison COMPARISON_ID): finished rows are reused, an interrupted fit goes "
                        "on from its last checkpoint, the rest are fitted")
    return parse_with_resume(parser, argv)  # key=value overrides may come anywhere


def plan_rows(args: argparse.Namespace) -> tuple[PlannedRows, list[bool], dict[str, str]]:
    """The rows (`plan`), whether each starts from the sequential row's checkpoint
    (`on_sequential`), and the --ckpt checkpoints by decoder; every argument checked."""
    decoders = parse_decoders(args.decoders)
    checkpoints = parse_checkpoints(args.ckpt, decoders)
    for flag, value in (("--repeats", args.repeats), ("--speed-examples", args.speed_examples),
                        ("--threads", args.threads)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    sweeps = parse_sweeps(args.sweep)
    planned = plan(args.task, decoders, args.config, args.overrides, sweeps)
    user_set = lambda key: user_sets(key, args.config, args.overrides, sweeps)  # noqa: E731
    starts = on_sequential(planned, args.backbone, checkpoints, user_set)
    check_drafters(planned, user_set)
    return planned, starts, checkpoints


def print_plan(planned: PlannedRows, starts: list[bool]) -> None:
    for (cfg, _), start in zip(planned, starts):
        kind = decoder_class(cfg.decoder.name)
        if kind.drafts_with:
            print(f"# decoder.drafter: the {kind.drafts_with} row's checkpoint, once trained or loaded")
        if start and kind.trains_nothing:
            print("# decodes the sequential row's model, once trained or loaded")
        elif start:
            print("# train.init_from: the sequential row's checkpoint, once trained or loaded")
        print(OmegaConf.to_yaml(cfg))


def load_checkpoints(planned: PlannedRows, checkpoints: dict[str, str]) -> dict[str, dict]:
    """The --ckpt checkpoints by decoder, each checked against the rows it serves; a drafter's and
    its verifier's (`Decoder.drafts_with`), where both are given, checked to share a tokenizer."""
    loaded = {name: load_checkpoint(path) for name, path in checkpoints.items()}
    for cfg, _ in planned:
        name = cfg.decoder.name
        if name in loaded:
            check_checkpoint(loaded[name], checkpoints[name], cfg)
        drafts_with = decoder_class(name).drafts_with
        verifier = name if name in loaded else "sequential"
        if drafts_with in loaded and verifier in loaded:
            check_drafter(loaded[drafts_with], checkpoints[drafts_with], loaded[verifier],
                          checkpoints[verifier])
    return loaded


def check_drafter(drafter: dict, drafter_path: str, verifier: dict, verifier_path: str) -> None:
    if tokenizer_identity(drafter) != tokenizer_identity(verifier):
        raise ConfigError(f"--ckpt checkpoints {drafter_path} (the drafter) and {verifier_path} (the "
                          f"model it drafts for) have different tokenizers; a drafter and its "
                          f"verifier must share one")


def score_row(cfg: DictConfig, built, tags: dict, callbacks: list,
              attempt: Attempt | None = None) -> Tested:
    """Decode and score the test split with an already-trained module, as a new MLflow run; a row
    that finished before the comparison was interrupted (`attempt`) keeps its run (`reused_row`)."""
    if attempt is not None and attempt.finished:
        return reused_row(cfg, built, attempt, callbacks)
    abandon(cfg, attempt, "interrupted while scoring; scored again in the resumed comparison")
    logger = open_tracking(cfg, f"{cfg.decoder.name} {cfg.model.name} {cfg.data.source}", tags=tags)
    return Tested(built, logger, score_into_run(logger, cfg, built, callbacks=callbacks), None)


def reused_row(cfg: DictConfig, built, attempt: Attempt, callbacks: list) -> Tested:
    """A row that finished before its comparison was interrupted, in its own run: its model's test
    split decoded again here (nothing trained, nothing logged), for the table and the timing."""
    logger = open_tracking(cfg, default_run_name(cfg), run_id=attempt.run_id)
    return Tested(built, logger, evaluate_test(cfg, built, None, callbacks), attempt.fit_seconds)


def with_decoder(cfg: DictConfig, trained: Built, checkpoint: str) -> Built:
    """The trained backbone and decoder modules (of `checkpoint`) under a decoder built with `cfg`'s
    options, its drafter attached where it drafts with another model."""
    module = trained.module
    decoder = build_decoder(cfg.decoder.name, module.backbone.config, module.decoder.special,
                            **decoder_options(cfg))
    decoder.load_state_dict(module.decoder.state_dict())
    new = TASK_MODULES[cfg.task.name](cfg, module.backbone, decoder, module.tokenizer)
    if decoder_class(cfg.decoder.name).drafts_with:
        attach_drafter(new, cfg, load_checkpoint(checkpoint))
    return Built(trained.datamodule, new)


def fit_rows(planned: PlannedRows, starts: list[bool], checkpoints: dict[str, str],
             loaded: dict[str, dict], tags: dict, callbacks: list,
             attempts: dict[int, Attempt]) -> list[Row]:
    """Each row trained (or its model loaded from --ckpt, or shared with an earlier row that differs
    only in decode-time options), then tested as its own MLflow run with `tags` and its place in the
    plan (`row_index`), in the plan's order; `callbacks` join every trainer's. Of a comparison taken
    up again, the rows' earlier `attempts` (by place): a finished row is reused with its tested
    checkpoint, an interrupted fit goes on from its last checkpoint in its own run."""
    trained: dict[str, tuple[Built, str]] = {}  # training key -> the model and its checkpoint
    first: dict[str, tuple[Built, str]] = {}    # decoder -> its first row's model and checkpoint
    rows: list[Row | None] = [None] * len(planned)
    # the rows that start from the sequential row's checkpoint after it, and those that draft with
    # another row's model after that row; the table keeps the plan's order
    drafts = [decoder_class(cfg.decoder.name).drafts_with is not None for cfg, _ in planned]
    order = sorted(range(len(planned)), key=lambda i: (starts[i], drafts[i]))
    for place, index in enumerate(order, start=1):
        started = time.perf_counter()
        cfg, swept = planned[index]
        name = cfg.decoder.name
        if starts[index]:
            cfg.train.init_from = first["sequential"][1]
        if drafts[index]:
            cfg.decoder.drafter = first[decoder_class(name).drafts_with][1]
        training = training_label(cfg, starts[index], name in checkpoints)
        row_tags = {**tags, "training": training, "row_index": str(index)}
        attempt = attempts.get(index)
        key = training_key(cfg)
        log.info("row %d of %d: %s (%s)%s", place, len(planned), row_label(cfg, swept), training,
                 attempt_note(cfg, attempt))
        if key in trained:
            tested = score_row(cfg, with_decoder(cfg, *trained[key]), row_tags, callbacks, attempt)
        elif name in checkpoints:
            trained[key] = restore(loaded[name], checkpoints[name], cfg), checkpoints[name]
            tested = score_row(cfg, trained[key][0], {**row_tags, "checkpoint": checkpoints[name]},
                               callbacks, attempt)
        elif decoder_class(name).trains_nothing:  # the sequential row's model, as it is
            tested = score_row(cfg, with_decoder(cfg, *first["sequential"]), row_tags, callbacks,
                               attempt)
        elif attempt is not None and attempt.finished:  # trained before: its tested checkpoint
            checkpoint = attempt.tags["tested_checkpoint"]
            trained[key] = restore(load_checkpoint(checkpoint), checkpoint, cfg), checkpoint
            tested = reused_row(cfg, trained[key][0], attempt, callbacks)
        else:
            resume = resumable_fit(cfg, attempt)
            if resume is None:
                abandon(cfg, attempt, "interrupted before its first checkpoint; fitted again in "
                                      "the resumed comparison")
            result = train_and_test(cfg, tags=row_tags, resume=resume, callbacks=callbacks)
            trained[key] = result.built, result.checkpoint
            tested = Tested(result.built, result.logger, result.tested, result.fit_seconds)
        if name not in first and key in trained:
            first[name] = trained[key]
        rows[index] = Row(cfg, tested.built.module, tested.built.datamodule, tested.logger,
                          tested.evaluation, swept, training, tested.fit_seconds,
                          time.perf_counter() - started)
    return rows


def attempt_note(cfg: DictConfig, attempt: Attempt | None) -> str:
    """What the progress line says of a row's earlier attempt, in a comparison taken up again."""
    if attempt is None:
        return ""
    if attempt.finished:
        return f": finished in run {attempt.run_id}, reused"
    if last_checkpoint(cfg, attempt.run_id).is_file():
        return f": interrupted in run {attempt.run_id}, goes on from its last checkpoint"
    return f": interrupted in run {attempt.run_id} before any checkpoint, done again"


def log_speeds(rows: list[Row], result: dict, conditions: dict) -> None:
    """Each row's speed and memory, and the conditions they were measured in, to its MLflow run."""
    for row, entry in zip(rows, result["rows"]):
        metrics = {f"test/{k}": entry[k] for k in ("examples_per_second_bs1", "examples_per_second_batch",
                                                   "speedup_bs1", "speedup_batch", "peak_memory_mb")
                   if entry[k] is not None}
        row.logger.log_metrics(metrics)
        row.logger.log_hyperparams({f"speed.{key}": value for key, value in conditions.items()})


def write_results(out: str, result: dict) -> tuple[str, list[Path]]:
    """FILE.json, FILE.md and the plots; returns the table and the files' paths."""
    table = markdown(result)
    path = write_report(out, result, table)
    return table, [path, path.with_suffix(".md"), *plots(result, path.with_suffix(""))]


def log_comparison(comparison: MLFlowLogger, result: dict, conditions: dict,
                   written: list[Path]) -> None:
    """The comparison's own run: the timing's conditions, each row's summary metrics
    (`summary_metrics`) and the written files."""
    comparison.log_hyperparams(conditions)
    comparison.log_metrics(summary_metrics(result))
    for path in written:
        comparison.experiment.log_artifact(comparison.run_id, str(path))


def main(argv: list[str] | None = None) -> dict:
    args = parse_arguments(argv)
    started = time.perf_counter()
    planned, starts, checkpoints = plan_rows(args)
    if args.print_config:
        print_plan(planned, starts)
        return {}
    loaded = load_checkpoints(planned, checkpoints)
    # the rows differ in decoder options only: one check of the other settings holds for all
    cfg = planned[0][0]
    target = decode_target(cfg)
    check_tracking(cfg)
    record = plan_record(planned, starts, checkpoints)
    resumed = None
    if args.resume is not None:
        resumed = find_comparison(cfg, record, None if args.resume is LATEST else args.resume)
    else:
        point_to_unfinished(cfg, record)
    if args.threads:
        torch.set_num_threads(args.threads)

    comparison, comparison_id = open_comparison(cfg, record, resumed)
    # Lightning turns Ctrl-C into SystemExit: the rows' trainers tell the comparison what they saw
    watcher = ExceptionWatcher()
    try:
        with run_status(comparison, watcher):
            tags = {"comparison_id": comparison_id, "role": "row", **nested_under(comparison)}
            rows = fit_rows(planned, starts, checkpoints, loaded, tags, callbacks=[watcher],
                            attempts=resumed.attempts if resumed else {})
            measured = measure_speed(rows, target, cfg.eval.batch_size, args.repeats,
                                     args.speed_examples)
            # on the rows' test split, through their tokenizer and data limits (the first row's data)
            baselines = [entry for entry, _ in scored_baselines(cfg, rows[0].datamodule)]
            result = comparison_result(rows, cfg, torch.get_num_threads(), measured,
                                       args.speed_examples, baselines)
            conditions = {key: result[key] for key in ("device", "threads", "flush_denormal")}
            log_speeds(rows, result, conditions)
            table, written = write_results(args.out, result)
            log_comparison(comparison, result, conditions, written)
    except BaseException:
        log.error("comparison %s was interrupted; its finished rows are kept, and an interrupted fit "
                  "goes on from its last checkpoint. Go on with:\n  %s", comparison_id,
                  resume_command(argv, comparison_id))
        raise
    comparison.finalize("success")
    print(table)
    for row in rows:
        print(f"{row.label}: {row.wall_seconds:.1f}s wall time ({row.training})")
    print(f"wrote {', '.join(map(str, written))}; comparison id {comparison_id}; total wall time "
          f"{time.perf_counter() - started:.1f}s")
    print(f"MLflow comparison run: {run_link(cfg, comparison)}")
    print(f"its rows side by side: {compare_runs_link(cfg, [row.logger for row in rows])}")
    return result


def open_comparison(cfg: DictConfig, record: dict,
                    resumed: Resumed | None) -> tuple[MLFlowLogger, str]:
    """The comparison's run and id: a new one, created before any row is fitted and holding its
    plan (`plan.json`, the `plan_digest` tag), or the run of the comparison taken up again."""
    if resumed is not None:
        comparison = open_tracking(cfg, f"comparison {resumed.comparison_id}", run_id=resumed.run_id)
        reopen_run(comparison, resumed="true")
        return comparison, resumed.comparison_id
    comparison_id = uuid.uuid4().hex[:12]
    comparison = open_tracking(cfg, f"comparison {comparison_id}",
                               tags={"comparison_id": comparison_id, "role": "comparison",
                                     "plan_digest": plan_digest(record)})
    comparison.experiment.log_dict(comparison.run_id, record, PLAN_FILE)
    return comparison, comparison_id


def point_to_unfinished(cfg: DictConfig, record: dict) -> None:
    """One line when an interrupted comparison of the same plan exists: `--resume` goes on with it."""
    unfinished = comparison_runs(cfg, unfinished=True, digest=plan_digest(record))
    if unfinished:
        run = unfinished[0]
        log.warning("comparison %s of this plan was interrupted (%s): add --resume to go on with it "
                    "instead of starting this new one", run.data.tags.get("comparison_id"),
                    run.info.status)


def resume_command(argv: list[str] | None, comparison_id: str) -> str:
    """The command that takes comparison `comparison_id` up again: this one, with `--resume ID`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--resume" in args:
        at = args.index("--resume")
        del args[at: at + (2 if at + 1 < len(args) and not args[at + 1].startswith("-")
                           and "=" not in args[at + 1] else 1)]
    return command_line("tasks.compare", [*args, "--resume", comparison_id])


if __name__ == "__main__":
    main_guard(main)
