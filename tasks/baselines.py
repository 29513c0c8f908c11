"""Trivial baselines: what a system that needs no model scores on a task's test split, scored
exactly as the decoders' outputs are. A comparison shows them beside its rows, and a row whose
primary quality is not above the best of them has not learned its task
(`tasks.comparison.report.judge`).

Each baseline is built from the training split's records alone and applied to the test split's:

* constant (every task): the training split's most frequent whole target (its list of target
  strings, as `datamodules.schema.target_texts` gives it), output for every test example. An empty
  target is no candidate (a constant that says nothing scores 0 whatever the data); among equally
  frequent targets the first seen wins, so when all are distinct it is the first training target.
* frequent (keyphrase, qa): the n target strings that the most training examples have among their
  targets (first seen first among equals), output for every test example, n being the median
  number of targets of a training example (`median_count`).
* lead-k (summarization): the document's first k sentences, as `datamodules.sentences.
  split_sentences` cuts them, k being the median number of sentences of a training summary
  (`median_count`); its name gives k (`lead-3`).

Outputs are scored as a decoder's output would be when it wrote them token for token: tokenized
with the run's tokenizer and cut to the data limits as training targets are
(`datamodules.datamodule.encode_targets`: what a model trained under those limits could output at
best), decoded back by `tasks.module.subsequence_texts`, the decoders' own path from token ids to
text, then scored by the task module's own metrics, fed as it feeds them (`tasks.module.
task_scores`), against the untruncated references. With a trained t5-tiny tokenizer the round trip
gives the text back unchanged; a pretrained tokenizer may not (unknown characters, its clean-up of
spaces before punctuation), and then the baselines lose what a model's output would lose. Scores
without the cut (as lead-k is usually published) are those under data limits that cut nothing.
"""
from __future__ import annotations

import json
import math
import statistics
from collections import Counter

from omegaconf import DictConfig

from datamodules.datamodule import DataReport, SubsequenceDataModule, encode_targets
from datamodules.schema import schema_for, target_texts
from datamodules.sentences import split_sentences
from tasks.module import subsequence_texts, task_scores

SENTENCE_SPLITTER = "datamodules.sentences.split_sentences"


def median_count(counts: list[int]) -> int:
    """The median of `counts` as a whole number: the middle value, or, between two middle values,
    their mean rounded half up (2 and 3 give 3)."""
    return math.floor(statistics.median(counts) + 0.5)


def most_frequent_target(task: str, records: list[dict]) -> dict:
    """The constant baseline's definition: the training target that occurs most often (`output`),
    first seen among equals, with its count, the id of its first record and how many distinct
    non-empty targets there are. The training split has a target (the data module refuses one
    without)."""
    targets = [tuple(target_texts(task, record)) for record in records]
    counts = Counter(target for target in targets if target)
    target, count = counts.most_common(1)[0]  # equal counts come in first-seen order
    return {"rule": f"the most frequent whole target of the training split ({count} of its "
                    f"{len(records)} examples have it), output for every test example",
            "output": list(target), "count": count, "first_id": records[targets.index(target)]["id"],
            "training_examples": len(records), "distinct_targets": len(counts)}


def most_frequent_strings(task: str, records: list[dict]) -> dict:
    """The frequent baseline's definition: the target strings that the most training examples have
    (`output`, first seen first among equals, with those `counts`), as many as the median number
    of targets of a training example (`median_count`, examples without a target counted as 0)."""
    n = median_count([len(target_texts(task, record)) for record in records])
    counts = Counter(text for record in records for text in dict.fromkeys(target_texts(task, record)))
    frequent = counts.most_common(n)  # equal counts come in first-seen order
    return {"rule": f"the {n} target strings that the most training examples have ({n}: the median "
                    f"number of targets of a training example), output for every test example",
            "output": [text for text, _ in frequent], "counts": [count for _, count in frequent],
            "n": n, "training_examples": len(records)}


def lead(record: dict, k: int) -> list[str]:
    """A summarization record's document's first `k` sentences (fewer if it has fewer)."""
    return split_sentences(schema_for("summarization").source_text(record))[:k]


def baseline_outputs(task: str, train: list[dict],
                     test: list[dict]) -> list[tuple[str, dict, list[list[str]]]]:
    """`task`'s baselines built from the `train` records: per baseline its name, its definition
    (what it outputs and why, for the reader) and its output (text subsequences) per `test` record."""
    constant = most_frequent_target(task, train)
    made = [("constant", constant, [constant["output"]] * len(test))]
    if task == "summarization":
        k = median_count([len(target_texts(task, record)) for record in train])
        made.append((f"lead-{k}", {"rule": f"the document's first {k} sentences ({SENTENCE_SPLITTER}; "
                                           f"{k}: the median number of sentences of a training summary)",
                                   "k": k, "sentence_splitter": SENTENCE_SPLITTER,
                                   "training_examples": len(train)},
                     [lead(record, k) for record in test]))
    else:
        frequent = most_frequent_strings(task, train)
        made.append(("frequent", frequent, [frequent["output"]] * len(test)))
    return made


def described(entry: dict) -> str:
    """A baseline entry in words, for a table's notes: its rule and, when it outputs the same for
    every example, that output."""
    definition = entry["definition"]
    output = definition.get("output")
    return definition["rule"] + ("" if output is None else f": {json.dumps(output, ensure_ascii=False)}")


def scored(cfg: DictConfig, tokenizer, outputs: list[list[str]],
           records: list[dict]) -> tuple[dict, list[list[str]]]:
    """`outputs` (text subsequences per record of `records`) scored as a decoder's output: through
    `tokenizer` and `cfg`'s data limits and back to text, then by the task's metrics. Returns the
    figures (`quality` and what was scored) and the texts scored."""
    report = DataReport(examples=len(outputs))
    ids = encode_targets(tokenizer, outputs, cfg.data, report)
    predictions = subsequence_texts(tokenizer, ids)
    return {"quality": task_scores(cfg, tokenizer, predictions, records),
            "examples": len(records),
            "subsequences_per_example": statistics.mean(map(len, predictions)),
            "tokens_per_example": statistics.mean(sum(map(len, example)) for example in ids),
            "subsequences_truncated": report.subsequences_truncated,
            "subsequences_dropped": report.subsequences_dropped}, predictions


def scored_baselines(cfg: DictConfig, datamodule: SubsequenceDataModule,
                     limit: int | None = None) -> list[tuple[dict, list[list[str]]]]:
    """Every baseline of `cfg`'s task, built from `datamodule`'s training split and scored on its
    test split (its first `limit` records, if given) with its tokenizer: per baseline its entry
    (`baseline`: its name, `label`: how tables name it, `definition`, `quality` keyed as a
    decoder's test scores are, and what was scored) and its scored texts per test record."""
    datamodule.setup()  # the tokenizer the models have
    train, test = datamodule.records("train"), datamodule.records("test")[:limit]
    entries = []
    for name, definition, outputs in baseline_outputs(cfg.task.name, train, test):
        figures, predictions = scored(cfg, datamodule.tokenizer, outputs, test)
        entries.append(({"baseline": name, "label": f"baseline: {name}", "definition": definition,
                         **figures}, predictions))
    return entries
