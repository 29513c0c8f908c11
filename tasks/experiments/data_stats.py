"""Length statistics of datasets, tokenized as training tokenizes them, to set the data limits from.

    python -m tasks.experiments.data_stats --data DIR [--pretrained DIR] [--builtin] [--out FILE.json]

For every folder under --data that holds train/validation/test.jsonl (its task read off the first
record's fields) and, with --builtin, the built-in corpus of every task: all splits encoded by the
library's own datamodule with no limit, with the tokenizer `model=t5-tiny` trains on the train split
and, with --pretrained DIR, a pretrained T5 tokenizer (`model=t5-small model.hub_id=DIR`). Each
quantity is counted as the data limit that cuts it counts (configs/default.yaml, data.*):
    source tokens          data.max_source_length      (the end token T5 appends included)
    target tokens          data.max_target_length      (flat layout: subsequences + separators + end)
    subsequences           data.max_subsequences       (per target)
    subsequence tokens     data.max_subsequence_length (per subsequence, its end token included)
and reported as max, p99, p95 (observed values: numpy's "higher" percentile) and mean.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from datamodules.datamodule import SubsequenceDataModule
from datamodules.schema import SCHEMAS
from datamodules.sources import SPLITS
from tasks.config import compose
from tasks.cli import show_report

UNLIMITED = 10 ** 9
NO_CUT = [f"data.{key}={UNLIMITED}" for key in
          ("max_source_length", "max_target_length", "max_subsequences", "max_subsequence_length")]
QUANTITIES = ("source tokens", "target tokens", "subsequences", "subsequence tokens")


def task_of(folder: Path) -> str:
    """The task whose target field the folder's first training record has."""
    with open(folder / "train.jsonl", encoding="utf-8") as handle:
        record = json.loads(handle.readline())
    return next(task for task, schema in SCHEMAS.items() if schema.target_field in record)


def lengths(task: str, data: list[str], model: list[str]) -> dict[str, list[int]]:
    """Every example's (or subsequence's) value of each quantity, over all splits."""
    datamodule = SubsequenceDataModule(compose(task, "sequential", None, [*data, *model, *NO_CUT]))
    examples = [e for split in SPLITS for e in datamodule.dataset(split).examples]
    return {
        "source tokens": [len(e.source_ids) for e in examples],
        "target tokens": [sum(len(s) + 1 for s in e.target_ids) or 1 for e in examples],
        "subsequences": [len(e.target_ids) for e in examples],
        "subsequence tokens": [len(s) + 1 for e in examples for s in e.target_ids],
    }


def summary(values: list[int]) -> dict[str, float]:
    array = np.asarray(values)
    return {"max": int(array.max()), "p99": int(np.percentile(array, 99, method="higher")),
            "p95": int(np.percentile(array, 95, method="higher")), "mean": float(array.mean()),
            "examples": len(values)}


def markdown(rows: list[dict]) -> str:
    head = ["data", "task", "tokenizer", *(f"{q} max / p99 / p95 / mean" for q in QUANTITIES)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["data"], row["task"], row["tokenizer"]]
        cells += ["{max} / {p99} / {p95} / {mean:.1f}".format(**row[q]) for q in QUANTITIES]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="a folder of dataset folders, each with train/validation/test.jsonl")
    parser.add_argument("--pretrained", help="also count with this pretrained T5 tokenizer folder")
    parser.add_argument("--builtin", action="store_true", help="also count the built-in corpus")
    parser.add_argument("--out", help="write the rows as JSON here and the table beside it (.md)")
    args = parser.parse_args(argv)
    datasets = []
    if args.data:
        datasets += [(folder.name, task_of(folder), ["data=jsonl", f"data.path={folder}"])
                     for folder in sorted(Path(args.data).iterdir())
                     if all((folder / f"{split}.jsonl").is_file() for split in SPLITS)]
    if args.builtin:
        datasets += [("builtin", task, ["data=builtin"]) for task in SCHEMAS]
    tokenizers = [("trained (t5-tiny)", ["model=t5-tiny"])]
    if args.pretrained:
        tokenizers.append((f"pretrained ({Path(args.pretrained).name})",
                           ["model=t5-small", f"model.hub_id={args.pretrained}"]))
    rows = []
    for name, task, data in datasets:
        for tokenizer, model in tokenizers:
            counted = lengths(task, data, model)
            rows.append({"data": name, "task": task, "tokenizer": tokenizer,
                         **{q: summary(counted[q]) for q in QUANTITIES}})
    command = " ".join(["python -m tasks.experiments.data_stats", *(sys.argv[1:] if argv is None else argv)])
    show_report(args.out, rows, f"`{command}`\n\n" + markdown(rows))
    return rows


if __name__ == "__main__":
    main()
