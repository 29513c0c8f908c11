"""`tasks.copy_data`: spans of each training source become its targets, in the keyphrase schema."""
import json
import random

import pytest

from datamodules.sources import read_jsonl
from tasks import copy_data
from tasks.config import ConfigError


def write_split(folder, split, records):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def make_corpora(tmp_path):
    kp, summ = tmp_path / "kp", tmp_path / "summ"
    for split in ("train", "validation", "test"):
        write_split(kp, split, [{"id": f"{split}{i}", "title": f"title {split} {i}",
                                 "abstract": f"{split} abstract number {i} , with words and more words .",
                                 "keyphrases": ["x"]} for i in range(30)])
        write_split(summ, split, [{"id": f"{split}{i}", "document": f"{split} news story {i} " * 40,
                                   "summary": ["s ."]} for i in range(30)])
    return [f"keyphrase={kp}", f"summarization={summ}"]


def test_spans_are_ordered_non_overlapping_words_of_the_source():
    words = "a b , c d e f g h i j".split()
    rng = random.Random(3)
    for _ in range(50):
        spans = copy_data.copy_spans(words, 3, rng)
        assert 1 <= len(spans) <= 3
        positions = []
        for span in spans:
            n = len(span.split())
            assert 1 <= n <= 3 and "," not in span.split()
            start = next(i for i in range(len(words)) if words[i:i + n] == span.split())
            positions.append((start, start + n))
        assert positions == sorted(positions)
        assert all(end <= next_start for (_, end), (next_start, _) in zip(positions, positions[1:]))


def test_writes_a_keyphrase_dataset_from_training_sources_only(tmp_path):
    corpora = make_corpora(tmp_path)
    out = tmp_path / "copy"
    counts = copy_data.main([*sum((["--corpus", c] for c in corpora), []), "--out", str(out),
                             "--max-words", "12", "--spans", "4"])
    assert counts == {"train": 57, "validation": 2, "test": 1}  # 60 sources, every 20th held out
    records = [r for split in ("train", "validation", "test")
               for r in read_jsonl(out / f"{split}.jsonl", "keyphrase")]  # validates the schema
    assert len(records) == 60
    assert not any("validation" in r["abstract"] or "test" in r["abstract"] for r in records)
    for record in records:
        text = f" {record['abstract']} "
        assert len(record["abstract"].split()) <= 12
        assert 1 <= len(record["keyphrases"]) <= 4
        assert all(f" {span} " in text for span in record["keyphrases"])
    # the same seed gives the same dataset; the output folder is never overwritten
    again = tmp_path / "again"
    copy_data.main([*sum((["--corpus", c] for c in corpora), []), "--out", str(again),
                    "--max-words", "12", "--spans", "4"])
    assert (again / "train.jsonl").read_text() == (out / "train.jsonl").read_text()
    with pytest.raises(ConfigError, match="is not empty"):
        copy_data.main(["--corpus", corpora[0], "--out", str(out)])


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="expected TASK=DIR"):
        copy_data.main(["--corpus", "keyphrase", "--out", str(tmp_path / "o")])
    with pytest.raises(ConfigError, match="--spans=0 must be >= 1"):
        copy_data.main(["--corpus", "keyphrase=x", "--out", str(tmp_path / "o"), "--spans", "0"])
