"""Decode and score a saved checkpoint, as a new MLflow run in the task's experiment.

    python -m tasks.test --ckpt PATH [key=value ...]

Overrides may change the data (e.g. `data=jsonl data.path=DIR`), the evaluation settings and the
decoder's options; the task and the model are those the checkpoint was trained with. Another decoder
may be chosen only where its layout agrees with the trained one (e.g. sequential decoding of a
blockwise-trained base head). The aggressive decoder verifies with the checkpoint and drafts with
the nar checkpoint `decoder.drafter` names (the same tokenizer; checked before any work):

    python -m tasks.test --ckpt SEQUENTIAL_CKPT decoder=aggressive decoder.drafter=NAR_CKPT
"""
from __future__ import annotations

import time

from tasks.config import to_yaml
from tasks.cli import base_parser, log, main_guard
from tasks.runs.checkpoints import load_checkpoint
from tasks.runs.restore import checkpoint_config, restore
from tasks.runs.tracking import default_run_name, open_tracking, run_link
from tasks.runs.trainer import check_trainer, score_into_run


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="a checkpoint written by tasks.fit")
    args = parser.parse_intermixed_args(argv)  # key=value overrides may come anywhere
    checkpoint = load_checkpoint(args.ckpt)
    cfg = checkpoint_config(checkpoint, args.ckpt, args.overrides, args.config)
    if args.print_config:
        print(to_yaml(cfg))
        return {}

    started = time.perf_counter()
    check_trainer(cfg)
    logger = open_tracking(cfg, f"test {default_run_name(cfg)}", tags={"checkpoint": args.ckpt})
    built = restore(checkpoint, args.ckpt, cfg)
    scores = score_into_run(logger, cfg, built).scores
    log.info("test: %s", ", ".join(f"{k}={v:.4f}" for k, v in sorted(scores.items())))
    log.info("MLflow run %s; wall time %.1fs", logger.run_id, time.perf_counter() - started)
    log.info("in the MLflow UI: %s", run_link(cfg, logger))
    return {"run_id": logger.run_id, "scores": scores}


if __name__ == "__main__":
    main_guard(main)
