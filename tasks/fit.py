"""Train a model with a chosen decoder, decode the test split, score it and track it in MLflow.

    python -m tasks.fit --task keyphrase --decoder pipelined [--config FILE.yaml] [key=value ...]
"""
from __future__ import annotations

import time

from lightning.pytorch.callbacks import ModelCheckpoint

from tasks.config import compose, to_yaml
from tasks.run import (base_parser, build, default_run_name, log_artifacts, log_params, main_guard,
                       make_trainer, open_tracking, run_folder, log)


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
    logger = open_tracking(cfg, default_run_name(cfg))  # fails here, before any work, if unusable
    built = build(cfg)
    log_params(logger, cfg, built.datamodule)
    checkpoint = ModelCheckpoint(dirpath=run_folder(cfg, logger) / "checkpoints",
                                 filename="epoch{epoch}-step{step}", auto_insert_metric_name=False,
                                 monitor=built.module.primary_metric, mode="max", save_top_k=1,
                                 save_last=True)
    trainer = make_trainer(cfg, logger, callbacks=[checkpoint])
    trainer.fit(built.module, datamodule=built.datamodule)
    best = checkpoint.best_model_path or checkpoint.last_model_path
    trainer.test(built.module, datamodule=built.datamodule, ckpt_path=best or None, verbose=False)
    log_artifacts(logger, cfg, built.module.prediction_rows("test"))
    scores = built.module.test_scores
    log.info("test: %s", ", ".join(f"{k}={v:.4f}" for k, v in sorted(scores.items())))
    log.info("checkpoint: %s", best)
    log.info("MLflow run %s in experiment %r (%s); wall time %.1fs", logger.run_id,
             logger._experiment_name, cfg.tracking.uri, time.perf_counter() - started)
    return {"run_id": logger.run_id, "checkpoint": best, "scores": scores}


if __name__ == "__main__":
    main_guard(main)
