"""The built-in corpus: deterministic, prefix-stable, split-disjoint, in the schema, and shaped
like the real tasks (present and absent keyphrases, multi-span answers, several summary
sentences)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from datamodules.builtin import SPLITS, make_corpus
from datamodules.schema import TASKS, schema_for, validate_record

ROOT = Path(__file__).resolve().parents[1]
TOKEN = re.compile(r"[a-z]+|[.,?]")


@pytest.fixture(scope="module")
def train() -> dict[str, list[dict]]:
    return {task: make_corpus(task, "train", size=2000, seed=0) for task in TASKS}


def source(task: str, record: dict) -> str:
    return schema_for(task).source_text(record)


def contains(text: str, phrase: str) -> bool:
    """`phrase` occurs in `text` as whole words."""
    return f" {phrase} " in f" {text} "


def texts(record: dict) -> list[str]:
    return [t for k, v in record.items() if k != "id" for t in (v if isinstance(v, list) else [v])]


@pytest.mark.parametrize("task", TASKS)
def test_same_arguments_give_same_records(task):
    records = make_corpus(task, "train", size=30, seed=3)
    assert records == make_corpus(task, "train", size=30, seed=3)
    assert records != make_corpus(task, "train", size=30, seed=4)


def test_records_do_not_depend_on_python_hash_seed():
    code = ("import json; from datamodules.builtin import make_corpus; "
            "print(json.dumps([make_corpus(t, 'test', size=5, seed=1) for t in "
            "('keyphrase', 'qa', 'summarization')]))")
    runs = [subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONHASHSEED": hash_seed}).stdout
            for hash_seed in ("1", "2")]
    assert runs[0] == runs[1]
    assert json.loads(runs[0])[0] == make_corpus("keyphrase", "test", size=5, seed=1)


@pytest.mark.parametrize("task", TASKS)
def test_a_larger_size_extends_a_smaller_one(task):
    assert make_corpus(task, "validation", size=40)[:20] == make_corpus(task, "validation", size=20)


@pytest.mark.parametrize("task", TASKS)
def test_splits_share_no_ids_and_no_source_texts(task, train):
    by_split = {"train": train[task], **{s: make_corpus(task, s, size=300) for s in SPLITS[1:]}}
    for a, b in [("train", "validation"), ("train", "test"), ("validation", "test")]:
        assert not {r["id"] for r in by_split[a]} & {r["id"] for r in by_split[b]}
        assert not {source(task, r) for r in by_split[a]} & {source(task, r) for r in by_split[b]}
    assert train[task][42]["id"] == f"builtin-{task}-train-000042"


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("split", SPLITS)
def test_records_pass_the_schema(task, split):
    for i, record in enumerate(make_corpus(task, split, size=100)):
        validate_record(task, record, f"builtin {task} {split} record {i}")


@pytest.mark.parametrize("task", TASKS)
def test_text_is_lowercase_pretokenized(task, train):
    for record in train[task][:300]:
        for text in texts(record):
            assert text == " ".join(text.split()), text
            assert all(TOKEN.fullmatch(token) for token in text.split()), text


@pytest.mark.parametrize("task", TASKS)
def test_vocabulary_is_bounded(task, train):
    words = {w for record in train[task] for text in texts(record) for w in text.split()}
    assert 100 <= len(words) <= 800, len(words)


def test_vocabulary_over_all_tasks_is_modest(train):
    words = {w for task in TASKS for record in train[task] for text in texts(record)
             for w in text.split()}
    assert len(words) <= 1500, len(words)


@pytest.mark.parametrize("task", TASKS)
def test_examples_are_short(task, train):
    lengths = [len(source(task, r).split()) for r in train[task]]
    assert max(lengths) <= 140 and 40 <= sum(lengths) / len(lengths) <= 120


def test_keyphrases_are_present_terms_in_order_then_absent_labels(train):
    counts = set()
    for record in train["keyphrase"]:
        text = source("keyphrase", record)
        keyphrases = record["keyphrases"]
        present = [k for k in keyphrases if contains(text, k)]
        absent = [k for k in keyphrases if not contains(text, k)]
        assert len(keyphrases) >= 3 and len(present) >= 2 and 1 <= len(absent) <= 2, record
        assert keyphrases == present + absent, record          # present ones come first
        first = [f" {text} ".index(f" {k} ") for k in present]
        assert first == sorted(first), record                   # in order of first appearance
        assert len(set(keyphrases)) == len(keyphrases)
        assert all(1 <= len(k.split()) <= 4 for k in keyphrases)
        counts.add(len(keyphrases))
    assert len(counts) >= 3                                     # the number varies


def test_qa_answers_are_spans_of_the_context(train):
    counts = set()
    for record in train["qa"]:
        answers = record["answers"]
        assert len(answers) >= 2 and len(set(answers)) == len(answers), record
        assert all(contains(record["context"], a) for a in answers), record
        assert all(1 <= len(a.split()) <= 4 for a in answers)
        assert record["question"].endswith(" ?") and "?" not in record["context"]
        counts.add(len(answers))
    assert len(counts) >= 3


def test_summary_sentences_come_from_the_document(train):
    function_words = {"the", "a", "of", "in", "on", "to", "will", "be", "new", "."}
    summaries = set()
    for record in train["summarization"]:
        summary, document = record["summary"], record["document"]
        assert len(summary) >= 2, record
        assert len(document.split(" . ")) >= len(summary) + 2   # more sentences than key facts
        for sentence in summary:
            assert sentence.endswith(" .") and 5 <= len(sentence.split()) <= 14, sentence
            content = set(sentence.split()) - function_words
            assert len(content & set(document.split())) >= 2, (sentence, document)
        summaries.add(tuple(summary))
    assert len(summaries) > 0.9 * len(train["summarization"])  # summaries depend on the document


@pytest.mark.parametrize("kwargs, named", [
    ({"task": "translation"}, "'translation'"),
    ({"split": "dev"}, "'dev'"),
    ({"size": 0}, "0"),
    ({"size": -5}, "-5"),
])
def test_bad_arguments_raise_naming_the_value(kwargs, named):
    args = {"task": "keyphrase", "split": "train", "size": 10, **kwargs}
    with pytest.raises(ValueError, match=re.escape(named)) as error:
        make_corpus(**args)
    if "task" in kwargs:
        assert all(task in str(error.value) for task in TASKS)
    if "split" in kwargs:
        assert all(split in str(error.value) for split in SPLITS)
