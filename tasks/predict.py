"""Predict the targets of new records with a saved checkpoint, as JSON lines; no MLflow run.

    python -m tasks.predict --ckpt PATH --input FILE.jsonl [--out FILE.jsonl] [--batch-size N]
                            [key=value ...]
    python -m tasks.predict --pretrained FOLDER_OR_HUB_ID --task TASK --input FILE.jsonl
                            [decoder=lookup] [key=value ...]

Each input line is a record of the task's schema without its target: keyphrase `title` and
`abstract`, qa `question` and `context`, summarization `document`; `id` and any other field are
optional and kept as they are. Each record is written back, in input order, with its target field
(`keyphrases`, `answers`, `summary`) set to the decoded subsequences, as tasks.test writes them.
`--input -` reads standard input; without `--out` the records go to standard output (logs and the
progress bar to standard error); `--out` is written under a temporary name, then renamed.

The model, its tokenizer and its decoder come from the checkpoint alone: no data set is read, and a
model trained on `data=jsonl data.path=DIR` predicts after DIR is gone. Overrides change the
decoding as in tasks.test (`decoder.stop_rule=all_end`, another decoder of the trained layout with
`decoder=NAME`); sources longer than `data.max_source_length` are cut as in training;
`--batch-size` sets `eval.batch_size`. `--pretrained` decodes a model trained elsewhere (what
transformers' `save_pretrained` wrote, or a hub id) exactly as its greedy `generate` does, with
sequential or lookup (`decoder=lookup`), its records those of `--task`. From Python:
`tasks.predictor.Predictor`.
"""
from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path

from datamodules.schema import TASKS, DataError, schema_for, validate_record
from datamodules.sources import dump_jsonl, jsonl_values, usable_folder, write_jsonl
from tasks.cli import base_parser, log, main_guard
from tasks.config import ConfigError, to_yaml
from tasks.predictor import Predictor


def read_inputs(path: str, task: str) -> list[dict]:
    """The records of `path` (`-`: standard input), each checked to have the task's source fields;
    an error names the file and the line."""
    name = "standard input" if path == "-" else path
    if path != "-" and not Path(path).is_file():
        raise DataError(f"--input {path}: no such file")
    with open(path, "rb") if path != "-" else nullcontext(sys.stdin.buffer) as handle:
        records = [validate_record(task, record, f"{name} line {number}", source_only=True)
                   for number, record in jsonl_values(handle, name)]
    if not records:
        fields = ", ".join(schema_for(task).source_fields)
        raise DataError(f"{name} holds no records (one JSON object per line, with {fields})")
    return records


def batch_size_override(text: str | None) -> list[str]:
    if text is None:
        return []
    if not (text.isdigit() and int(text) >= 1):
        raise ConfigError(f"--batch-size must be an integer >= 1, got {text!r}")
    return [f"eval.batch_size={int(text)}"]


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0])
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--ckpt", help="a checkpoint written by tasks.fit")
    model.add_argument("--pretrained", metavar="MODEL",
                       help="a model that save_pretrained wrote (a folder) or a hub id, decoded as "
                            "it is (with --task)")
    parser.add_argument("--task", choices=TASKS, help="the task of --pretrained's records")
    parser.add_argument("--input", required=True, help="a JSONL file of records, or - for stdin")
    parser.add_argument("--out", help="the JSONL file to write (default: standard output)")
    parser.add_argument("--batch-size", help="decoding batch size (default: eval.batch_size)")
    args = parser.parse_intermixed_args(argv)  # key=value overrides may come anywhere
    overrides = [*args.overrides, *batch_size_override(args.batch_size)]
    if args.ckpt is not None:
        if args.task is not None:
            raise ConfigError(f"--task {args.task}: a checkpoint's task is the one it was trained "
                              f"for; --task goes with --pretrained")
        predictor = Predictor.from_checkpoint(args.ckpt, overrides=overrides,
                                              config_file=args.config)
    else:
        if args.task is None:
            raise ConfigError(f"--pretrained {args.pretrained}: say which task's records it "
                              f"predicts with --task ({', '.join(TASKS)})")
        predictor = Predictor.from_pretrained(args.pretrained, task=args.task, overrides=overrides,
                                              config_file=args.config)
    if args.print_config:
        print(to_yaml(predictor.cfg))
        return {}

    records = read_inputs(args.input, predictor.task)   # before the model is restored
    if args.out:
        usable_folder(Path(args.out).parent, "--out's folder", ConfigError)
    predicted = predictor.predict(records)
    if args.out:
        write_jsonl(predicted, args.out)
        log.info("wrote %d records to %s", len(predicted), args.out)
    else:
        dump_jsonl(predicted, sys.stdout)
    return {"predictions": predicted, "out": args.out}


if __name__ == "__main__":
    main_guard(main)
