"""Named hub datasets: converters on hand-made rows in each hub layout, load_hub on a fake hub, offline errors.

Nothing here reaches the network: the loading tests replace `datasets.load_dataset`, and the offline test
runs with the offline variables set.
"""
import time
from types import SimpleNamespace

import datasets
import pytest

from datamodules.hub import HUB_DATASETS, SPLITS, bio_spans, load_hub
from datamodules.schema import DataError, validate_record

MIDAS_ROW = {  # midas/kp20k and midas/kptimes raw JSONL
    "id": "kp-1",
    "document": ["Deep", "keyphrase", "generation", ".", "We", "generate", "keyphrases", "."],
    "doc_bio_tags": ["O", "B", "I", "O", "O", "O", "B", "O"],
    "extractive_keyphrases": ["keyphrase generation", "keyphrases"],
    "abstractive_keyphrases": ["sequence to sequence"],
    "other_metadata": {"title": "Deep keyphrase generation"},
}
MSQA_ROW = {  # MultiSpanQA
    "id": "msqa-7",
    "question": ["who", "founded", "the", "band", "?"],
    "context": ["The", "band", "was", "founded", "by", "John", "Lennon", "and", "Paul", "McCartney", "."],
    "label": ["O", "O", "O", "O", "O", "B", "I", "O", "B", "I", "O"],
    "num_span": 2, "structure": "Conjunction", "type": "Person",
}
WIKIHOW_ROW = {  # Lurunchik/WikiHowNFQA
    "article_id": 1234,
    "question": "How to boil an egg?",
    "answer": "Put the egg in a pot of water. Boil it for 10 minutes. Cool it in cold water.",
    "related_document_urls_wayback_snapshots": ["http://web.archive.org/web/2020/https://example.com/eggs"],
    "split": "train",
    "cluster": 5,
}
CNNDM_ROW = {  # abisee/cnn_dailymail 3.0.0
    "article": "LONDON, England (Reuters) -- Harry Potter star Daniel Radcliffe gains access to a fortune.",
    "highlights": "Harry Potter star Daniel Radcliffe gets £20M fortune as he turns 18 Monday .\n"
                  "Young actor says he has no plans to fritter his cash away .",
    "id": "42c027e4ff9730fbb3de84c1af0d2c506e8e1f8e",
}
PUBMED_ROW = {  # ccdv/pubmed-summarization, config "document"
    "article": "a recent systematic analysis showed that in 2011 , 314 million children were stunted .",
    "abstract": "background : the aim was to assess nutrition . methods : we ran a trial . "
                "results : stunting fell .",
}
ROWS = {"kp20k": MIDAS_ROW, "kptimes": MIDAS_ROW, "msqa": MSQA_ROW, "wikihowqa": WIKIHOW_ROW,
        "cnndm": CNNDM_ROW, "pubmed": PUBMED_ROW}
EXPECTED = {
    "kp20k": {"id": "fallback", "title": "",
              "abstract": "Deep keyphrase generation . We generate keyphrases .",
              "keyphrases": ["keyphrase generation", "keyphrases", "sequence to sequence"]},
    "msqa": {"id": "msqa-7", "question": "who founded the band ?",
             "context": "The band was founded by John Lennon and Paul McCartney .",
             "answers": ["John Lennon", "Paul McCartney"]},
    "wikihowqa": {"id": "1234", "question": "How to boil an egg?", "context": "",
                  "answers": ["Put the egg in a pot of water.", "Boil it for 10 minutes.",
                              "Cool it in cold water."]},
    "cnndm": {"id": "42c027e4ff9730fbb3de84c1af0d2c506e8e1f8e", "document": CNNDM_ROW["article"],
              "summary": ["Harry Potter star Daniel Radcliffe gets £20M fortune as he turns 18 Monday .",
                          "Young actor says he has no plans to fritter his cash away ."]},
    "pubmed": {"id": "fallback", "document": PUBMED_ROW["article"],
               "summary": ["background : the aim was to assess nutrition .", "methods : we ran a trial .",
                           "results : stunting fell ."]},
}
EXPECTED["kptimes"] = EXPECTED["kp20k"]


def test_every_name_has_a_row_here():
    assert set(ROWS) == set(HUB_DATASETS) == {"kp20k", "kptimes", "msqa", "wikihowqa", "cnndm", "pubmed"}


@pytest.mark.parametrize("name", sorted(HUB_DATASETS))
def test_converter_makes_a_valid_record(name):
    spec = HUB_DATASETS[name]
    record = spec.convert(ROWS[name], "fallback")
    assert validate_record(spec.task, record, name) == EXPECTED[name]


@pytest.mark.parametrize("labels, expected", [
    (["B", "I", "O", "B", "O"], ["a b", "d"]),
    (["O", "I", "I", "O", "I"], ["b c", "e"]),        # an I after O starts a span
    (["B", "B", "I", "O", "O"], ["a", "b c"]),        # a B right after a span starts the next one
    (["O", "O", "O", "B", "I"], ["d e"]),             # a span running to the end
    (["O", "O", "O", "O", "O"], []),
])
def test_bio_spans(labels, expected):
    assert bio_spans(["a", "b", "c", "d", "e"], labels) == expected


def test_bio_spans_drops_repeats_and_keeps_order():
    tokens = ["Paris", "and", "Rome", "or", "Paris"]
    assert bio_spans(tokens, ["B", "O", "B", "O", "B"]) == ["Paris", "Rome"]


@pytest.fixture
def fake_hub(monkeypatch):
    """Replace datasets.load_dataset: calls are recorded in `.calls`, and each answers two rows in the layout of
    the dataset named by `.name`."""
    hub = SimpleNamespace(name=None, calls=[])

    def load_dataset(path, name=None, **kwargs):
        hub.calls.append({"path": path, "name": name, **kwargs})
        row = ROWS[hub.name]
        rows = [dict(row), dict(row)]
        if hub.name == "wikihowqa":  # one file for every split, told apart by the `split` column
            rows = [dict(row, split=split) for split in ("train", "valid", "valid", "test")]
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the fake needs no hub, so skip the reachability check
    return hub


@pytest.mark.parametrize("name", sorted(HUB_DATASETS))
def test_load_hub_maps_every_row(fake_hub, name):
    fake_hub.name = name
    records = load_hub(name, "validation", cache_dir="/tmp/unused")
    assert len(records) == 2
    for index, record in enumerate(records):
        validate_record(HUB_DATASETS[name].task, record, name)
        expected = dict(EXPECTED[name])
        if expected["id"] == "fallback":
            expected["id"] = f"{name}-validation-{index}"
        assert record == expected
    assert fake_hub.calls[0]["cache_dir"] == "/tmp/unused"


def test_load_hub_reads_repositories_and_raw_files(fake_hub):
    fake_hub.name = "cnndm"
    load_hub("cnndm", "validation")
    assert fake_hub.calls[-1] == {"path": "abisee/cnn_dailymail", "name": "3.0.0", "split": "validation",
                                  "cache_dir": None}
    fake_hub.name = "kp20k"
    load_hub("kp20k", "validation")
    assert fake_hub.calls[-1] == {"path": "json", "name": None, "split": "train", "field": None,
                                  "data_files": "hf://datasets/midas/kp20k/valid.jsonl", "cache_dir": None}
    fake_hub.name = "msqa"
    load_hub("msqa", "test")  # MultiSpanQA's public test file has no labels: test reads validation
    assert fake_hub.calls[-1]["data_files"] == "hf://datasets/Tugay/multispanqa/validation.json"
    assert fake_hub.calls[-1]["field"] == "data"


def test_load_hub_keeps_only_the_rows_of_the_split(fake_hub):
    fake_hub.name = "wikihowqa"
    assert len(load_hub("wikihowqa", "train")) == 1
    assert len(load_hub("wikihowqa", "validation")) == 2


@pytest.mark.parametrize("name", ["cnndm", "kp20k"])  # a repository dataset and a raw-file dataset
def test_offline_fails_fast_with_the_jsonl_alternative(monkeypatch, tmp_path, name):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(DataError) as error:
        load_hub(name, "test", cache_dir=str(tmp_path))
    assert time.monotonic() - start < 5
    message = str(error.value)
    assert name in message and HUB_DATASETS[name].hub_id in message
    assert "could not be reached" in message and "HF_HUB_OFFLINE is set" in message
    assert "data=jsonl data.path=DIR" in message and "validation.jsonl" in message


def test_offline_mode_is_only_switched_for_the_call(monkeypatch, tmp_path):
    before = datasets.config.HF_HUB_OFFLINE
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError):
        load_hub("pubmed", "train", cache_dir=str(tmp_path))
    assert datasets.config.HF_HUB_OFFLINE == before


def test_unknown_name_lists_the_names():
    with pytest.raises(DataError, match="allowed: kp20k, kptimes, msqa, wikihowqa, cnndm, pubmed"):
        load_hub("squad", "train")


def test_unknown_split_lists_the_splits():
    with pytest.raises(DataError, match="allowed: train, validation, test"):
        load_hub("cnndm", "dev")
    assert SPLITS == ("train", "validation", "test")
