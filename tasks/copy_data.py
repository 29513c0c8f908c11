"""Copying pretraining data: word spans of a corpus's own training sources become their targets.

    python -m tasks.copy_data --corpus keyphrase=../shared/data/kp20k \\
        --corpus summarization=../shared/data/cnndm --out DIR [--spans 5] [--max-words 150] [--seed 0]
    python -m tasks.fit --task keyphrase data=jsonl data.path=DIR                  # pretrain
    python -m tasks.fit --task keyphrase ... train.init_from=CHECKPOINT            # then the task

Keyphrases, answer spans and many summary phrases are copied from the source, and a randomly
initialised t5-tiny does not learn to copy from a few hundred examples (on the KP20K sample it
learned next to nothing in 50 epochs). This writes a dataset in the keyphrase schema in which every
training source of the given corpora, cut to its first `--max-words` words (so that the spans survive
the model's source length limit), has as targets `--spans` non-overlapping spans of 1-3 of its words,
in order of appearance. Fitting on it teaches the copying from source to target and the subsequence
layout of any decoder, with as much supervision as there is text; which spans matter is left to the
task's own training. It stands in for a pretrained T5 where the hub cannot be reached.

Only the corpora's training splits are read. Every 20th example goes to validation or test
(alternately), the rest to train.
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

from datamodules.schema import schema_for
from datamodules.sources import load_split
from tasks.config import ConfigError, compose
from tasks.module import write_jsonl
from tasks.run import log, main_guard

HELD_OUT_EVERY = 20


def copy_spans(words: list[str], count: int, rng: random.Random) -> list[str]:
    """Up to `count` non-overlapping spans of 1-3 consecutive words (no punctuation-only word), in
    order of appearance."""
    taken = [False] * len(words)
    spans: list[tuple[int, str]] = []
    for _ in range(4 * count):  # a few draws per span; short texts give fewer spans
        if len(spans) == count:
            break
        length = rng.randint(1, 3)
        if length > len(words):
            continue
        start = rng.randrange(len(words) - length + 1)
        chosen = words[start:start + length]
        if any(taken[start:start + length]) or not all(any(c.isalnum() for c in w) for w in chosen):
            continue  # overlapping, or a lone punctuation mark in it
        taken[start:start + length] = [True] * length
        spans.append((start, " ".join(chosen)))
    return [text for _, text in sorted(spans)]


def corpus_sources(item: str) -> list[str]:
    """`TASK=DIR` -> the source texts of that jsonl folder's training split."""
    task, _, folder = item.partition("=")
    if not folder:
        raise ConfigError(f"--corpus {item!r}: expected TASK=DIR, e.g. keyphrase=../shared/data/kp20k")
    data = compose(task, None, None, ["data=jsonl", f"data.path={folder}"]).data
    schema = schema_for(task)
    return [schema.source_text(record) for record in load_split(task, data, "train")]


def copy_records(sources: list[str], spans: int, max_words: int, seed: int) -> dict[str, list[dict]]:
    """Keyphrase-schema records, split into train / validation / test."""
    rng = random.Random(seed)
    splits: dict[str, list[dict]] = {"train": [], "validation": [], "test": []}
    for index, source in enumerate(sources):
        words = source.split()[:max_words]
        record = {"id": f"copy-{index:07d}", "title": "", "abstract": " ".join(words),
                  "keyphrases": copy_spans(words, spans, rng)}
        held_out = index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1
        split = ("validation" if index // HELD_OUT_EVERY % 2 == 0 else "test") if held_out else "train"
        splits[split].append(record)
    return splits


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", action="append", required=True, metavar="TASK=DIR",
                        help="a jsonl folder of a task's schema whose training sources are used")
    parser.add_argument("--out", required=True, help="a new folder for the jsonl dataset")
    parser.add_argument("--spans", type=int, default=5, help="target spans per example")
    parser.add_argument("--max-words", type=int, default=150, help="source words kept per example")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("spans", "max_words"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} is not empty; choose a new folder (nothing is overwritten)")
    sources = [text for item in args.corpus for text in corpus_sources(item)]
    splits = copy_records(sources, args.spans, args.max_words, args.seed)
    for split, records in splits.items():
        if not records:
            raise ConfigError(f"{len(sources)} sources are too few for a {split} split "
                              f"(every {HELD_OUT_EVERY}th example is held out)")
    out.mkdir(parents=True, exist_ok=True)
    for split, records in splits.items():
        write_jsonl(records, out / f"{split}.jsonl")
    counts = {split: len(records) for split, records in splits.items()}
    log.info("wrote %s: %s examples; pretrain with tasks.fit --task keyphrase data=jsonl "
             "data.path=%s", out, counts, out)
    return counts


if __name__ == "__main__":
    main_guard(main)
