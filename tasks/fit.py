"""Train a model with a chosen decoder, decode the test split, score it and track it in MLflow.

    python -m tasks.fit --task keyphrase --decoder pipelined [--config FILE.yaml] [key=value ...]

An interrupted fit (crashed, killed, Ctrl-C) goes on from its last checkpoint, in the same MLflow
run, when the same command is given again with `--resume` (or `--resume RUN_ID`). Checkpoints are
written at the end of every epoch, so the epoch that was interrupted is redone from its start; its
batches and random draws are those of an uninterrupted run (they are seeded from seed and epoch).
"""
from __future__ import annotations

import time

from tasks.config import compose, to_yaml
from tasks.cli import LATEST, add_resume_argument, base_parser, log, main_guard, parse_with_resume
from tasks.runs.checkpoints import find_resumable
from tasks.runs.tracking import experiment_name, run_link
from tasks.runs.trainer import check_something_to_train, train_and_test


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--task", help="keyphrase, qa or summarization (default: keyphrase)")
    parser.add_argument("--decoder", help="a registered decoder name (default: sequential)")
    add_resume_argument(parser, "RUN_ID", "go on with the latest unfinished run of this "
                                          "configuration (or with run RUN_ID) from its last checkpoint")
    args = parse_with_resume(parser, argv)
    cfg = compose(args.task, args.decoder, args.config, args.overrides)
    check_something_to_train(cfg)  # before a resumable run is looked for
    if args.print_config:
        print(to_yaml(cfg))
        return {}

    started = time.perf_counter()
    resume = None
    if args.resume is not None:
        resume = find_resumable(cfg, None if args.resume is LATEST else args.resume)
        log.info("resuming MLflow run %s from %s", resume.run_id, resume.checkpoint)
    result = train_and_test(cfg, resume=resume)
    log.info("test: %s", ", ".join(f"{k}={v:.4f}" for k, v in sorted(result.tested.scores.items())))
    log.info("checkpoint: %s", result.checkpoint)
    log.info("MLflow run %s in experiment %r (%s); wall time %.1fs", result.logger.run_id,
             experiment_name(cfg), cfg.tracking.uri, time.perf_counter() - started)
    log.info("in the MLflow UI: %s", run_link(cfg, result.logger))
    return {"run_id": result.logger.run_id, "checkpoint": result.checkpoint, "scores": result.tested.scores}


if __name__ == "__main__":
    main_guard(main)
