"""Distilled training data: a trained model's outputs on the training split become its targets.

    python -m tasks.experiments.distill --ckpt TEACHER.ckpt --out DIR [key=value ...]
    python -m tasks.fit --decoder nar --task keyphrase data=jsonl data.path=DIR

Sequence-level knowledge distillation (Kim & Rush 2016, "Sequence-Level Knowledge Distillation"):
non-autoregressive models are trained on an autoregressive teacher's outputs, not on the references,
as Mask-Predict is. A teacher's greedy outputs are one deterministic answer per source, in one
order; the references of keyphrase, span and summary data admit many (which keyphrases, in which
order), and a model that predicts every position at once cannot choose among them consistently.

DIR receives train.jsonl (the teacher's checkpoint data and limits, its targets replaced by what
the teacher decodes) and validation.jsonl / test.jsonl unchanged: models are selected and scored
against the references. Overrides may change the data read and the teacher's decoder options.
"""
from __future__ import annotations

from pathlib import Path

from datamodules.schema import schema_for
from tasks.config import ConfigError, to_yaml
from datamodules.sources import write_jsonl
from tasks.cli import base_parser, log, main_guard
from tasks.runs.checkpoints import load_checkpoint
from tasks.runs.trainer import DecodeTarget, decode_target
from tasks.runs.restore import checkpoint_config, restore


def distilled_records(built, target: DecodeTarget) -> list[dict]:
    """The training records, in order, with their targets replaced by the model's outputs decoded
    on `target`."""
    return target.predict(built.module, built.datamodule.records("train"),
                          built.datamodule.ordered_loader("train"), "decoding the training split")


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="the teacher: a checkpoint written by tasks.fit")
    parser.add_argument("--out", required=True, help="a new folder for the distilled jsonl dataset")
    args = parser.parse_intermixed_args(argv)  # key=value overrides may come anywhere
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} is not empty; choose a new folder (nothing is overwritten)")
    checkpoint = load_checkpoint(args.ckpt)
    cfg = checkpoint_config(checkpoint, args.ckpt, args.overrides, args.config)
    if args.print_config:
        print(to_yaml(cfg))
        return {}

    target = decode_target(cfg)  # before any data or model work: an unavailable one fails here
    built = restore(checkpoint, args.ckpt, cfg)
    train = distilled_records(built, target)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(train, out / "train.jsonl")
    for split in ("validation", "test"):
        write_jsonl(built.datamodule.records(split), out / f"{split}.jsonl")
    empty = sum(not r[schema_for(cfg.task.name).target_field] for r in train)
    log.info("wrote %s: %d training examples with the teacher's outputs as targets (%d empty), "
             "validation and test unchanged; train on it with data=jsonl data.path=%s",
             out, len(train), empty, out)
    return {"out": str(out), "train_examples": len(train), "empty_targets": empty}


if __name__ == "__main__":
    main_guard(main)
