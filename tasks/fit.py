"""Train a model with a chosen decoder, decode the test split, score it and track it in MLflow.

    python -m tasks.fit --task keyphrase --decoder pipelined [--config FILE.yaml] [key=value ...]
"""
from __future__ import annotations

import time

from tasks.config import compose, to_yaml
from tasks.run import base_parser, log, main_guard, train_and_test


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--task", help="keyphrase, qa or summarization (default: keyphrase)")
    parser.add_argument("--decoder", help="a registered decoder name (default: sequential)")
    args = parser.parse_args(argv)
    cfg = compose(args.task, args.decoder, args.config, args.overrides)
    if args.print_config:
        print(to_yaml(cfg))
        return {}

    started = time.perf_counter()
    result = train_and_test(cfg)
    log.info("test: %s", ", ".join(f"{k}={v:.4f}" for k, v in sorted(result.scores.items())))
    log.info("checkpoint: %s", result.checkpoint)
    log.info("MLflow run %s in experiment %r (%s); wall time %.1fs", result.logger.run_id,
             cfg.tracking.experiment or cfg.task.name, cfg.tracking.uri, time.perf_counter() - started)
    return {"run_id": result.logger.run_id, "checkpoint": result.checkpoint, "scores": result.scores}


if __name__ == "__main__":
    main_guard(main)
