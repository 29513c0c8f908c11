"""Named hub datasets: rows in each hub layout through the real loading code, the KPTimes scoring, the
MultiSpanQA validation carve-out, limits applied before download, offline errors.

Nothing here reaches the network. The `local_hub` fixture writes each repository's files, in its real layout,
under a temporary folder and points `datasets.load_dataset` there: `hf://datasets/<repo>/<file>` becomes
<folder>/<repo>/<file>, and a repository dataset (<repo>, <config>) reads <folder>/<repo>/<config>/<split>.jsonl
(standing in for its parquet shards). Everything after that file access is the library's and `datasets`' own
code: streaming, split filtering, the carve-out, `take`, conversion and validation.
"""
import dataclasses
import hashlib
import json
import time
import zlib
from types import SimpleNamespace

import datasets
import pytest

from datamodules import hub as hub_module
from datamodules.hub import HUB_DATASETS, SPLITS, bio_spans, load_hub, word_tokens
from datamodules.schema import DataError, schema_for, target_texts, validate_record
from datamodules.sources import load_split
from tasks.config import compose
from tasks.metrics import KeyphraseF1

KP20K_ROW = {  # midas/kp20k raw JSONL
    "id": "kp-1",
    "document": ["Deep", "keyphrase", "generation", ".", "We", "generate", "keyphrases", "."],
    "doc_bio_tags": ["O", "B", "I", "O", "O", "O", "B", "O"],
    "extractive_keyphrases": ["keyphrase generation", "keyphrases"],
    "abstractive_keyphrases": ["sequence to sequence"],
}

# midas/kptimes raw JSONL: KPTimes train document 0282969 (ygorg/KPTimes train_sample.jsonl), title and the
# first paragraphs of its body with the keyphrases that mention them. As in midas' copy, `document` is the title
# and body split on whitespace only and the keyphrases are lowercased, aliases joined by commas. Its tags and
# extractive/abstractive split are those of exact matches of those whitespace tokens, where none of these
# keyphrases occurs ("plagiarism," "Trump’s"); the converter reads neither.
KPTIMES_TITLE = "For Donald Trump’s Big Speech, an Added Pressure: No Echoes"
KPTIMES_BODY = (
    "CLEVELAND — Until Monday night, Donald J. Trump’s biggest concern about his convention speech was how "
    "much to reveal about himself and his family in an address that is often the most personal one a "
    "presidential candidate delivers. But the political firestorm over his wife’s speech , which borrowed "
    "passages from Michelle Obama’s convention remarks in 2008, raised the stakes exponentially. Even so, one "
    "of the staff members downloaded plagiarism-detection software and ran a draft of the speech through the "
    "program. No red flags came up. Yet in the aftermath of Melania Trump’s speech, campaign advisers have "
    "fretted that they do not know for sure where Mr. Trump gets his ideas and language — whether they are his "
    "own, in other words, or are picked up from Twitter, television, or, say, a best seller by Bill O’Reilly "
    "of Fox News, a commentator whom Mr. Trump likes. Borrowing or adapting may not always be tantamount to "
    "plagiarism, but several Trump advisers, who also insisted on anonymity, said that after the furor over "
    "Ms. Trump’s remarks, the campaign cannot allow a similar blowup.")
KPTIMES_DOCUMENT = f"{KPTIMES_TITLE} {KPTIMES_BODY}".split()
KPTIMES_ROW = {
    "id": "0282969",
    "document": KPTIMES_DOCUMENT,
    "doc_bio_tags": ["O"] * len(KPTIMES_DOCUMENT),
    "extractive_keyphrases": [],
    "abstractive_keyphrases": ["2016 presidential election", "donald trump",
                               "republican national convention,rnc", "speeches", "plagiarism", "melania trump"],
    "other_metadata": {"title": KPTIMES_TITLE, "abstract": KPTIMES_BODY},
}
MSQA_ROW = {  # Tugay/multispanqa train.json / validation.json, one item of "data"
    "id": "a8t847ylkwgig0gh1l80",
    "type": "Person",
    "question": ["who", "founded", "the", "band", "?"],
    "context": ["The", "band", "was", "founded", "by", "John", "Lennon", "and", "Paul", "McCartney", "."],
    "label": ["O", "O", "O", "O", "O", "B", "I", "O", "B", "I", "O"],
    "num_span": 2,
    "structure": "Conjunction",
}
WIKIHOW_ROW = {  # Lurunchik/WikiHowNFQA, WikiHowNFQA.jsonl
    "article_id": 1234,
    "question": "How to boil an egg?",
    "answer": "Put the egg in a pot of water. Boil it for 10 minutes. Cool it in cold water.",
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
ROWS = {"kp20k": KP20K_ROW, "kptimes": KPTIMES_ROW, "msqa": MSQA_ROW, "wikihowqa": WIKIHOW_ROW,
        "cnndm": CNNDM_ROW, "pubmed": PUBMED_ROW}
ID_COLUMNS = {"kp20k": "id", "kptimes": "id", "msqa": "id", "wikihowqa": "article_id", "cnndm": "id"}

KPTIMES_KEYPHRASES = ["2016 presidential election", "donald trump", "republican national convention",
                      "speeches", "plagiarism", "melania trump"]
EXPECTED = {
    "kp20k": {"id": "kp-1", "title": "",
              "abstract": "Deep keyphrase generation . We generate keyphrases .",
              "keyphrases": ["keyphrase generation", "keyphrases", "sequence to sequence"]},
    "kptimes": {"id": "0282969",
                "title": "For Donald Trump ’s Big Speech , an Added Pressure : No Echoes",
                "abstract": (
                    "CLEVELAND — Until Monday night , Donald J . Trump ’s biggest concern about his "
                    "convention speech was how much to reveal about himself and his family in an address that "
                    "is often the most personal one a presidential candidate delivers . But the political "
                    "firestorm over his wife ’s speech , which borrowed passages from Michelle Obama ’s "
                    "convention remarks in 2008 , raised the stakes exponentially . Even so , one of the staff "
                    "members downloaded plagiarism-detection software and ran a draft of the speech through "
                    "the program . No red flags came up . Yet in the aftermath of Melania Trump ’s speech , "
                    "campaign advisers have fretted that they do not know for sure where Mr . Trump gets his "
                    "ideas and language — whether they are his own , in other words , or are picked up from "
                    "Twitter , television , or , say , a best seller by Bill O’Reilly of Fox News , a "
                    "commentator whom Mr . Trump likes . Borrowing or adapting may not always be tantamount to plagiarism , but several "
                    "Trump advisers , who also insisted on anonymity , said that after the furor over Ms . "
                    "Trump ’s remarks , the campaign cannot allow a similar blowup ."),
                "keyphrases": KPTIMES_KEYPHRASES,
                "aliases": {"republican national convention": ["rnc"]}},
    "msqa": {"id": "a8t847ylkwgig0gh1l80", "question": "who founded the band ?",
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
ROWS_PER_FILE = 12  # per hub split; the hub's MultiSpanQA train file holds 40 (see MSQA_TRAIN_IDS)


def msqa_id(tag: str) -> str:
    """An id shaped like MultiSpanQA's (20 lowercase letters and digits)."""
    return hashlib.sha1(tag.encode()).hexdigest()[:20]


MSQA_TRAIN_IDS = [msqa_id(f"train-{i}") for i in range(40)]
# The documented carve-out rule, computed here independently: CRC-32 of the id divisible by 10.
MSQA_HELD_OUT = [i for i in MSQA_TRAIN_IDS if zlib.crc32(i.encode()) % 10 == 0]


def numbered_rows(name: str, hub_split: str, count: int) -> list[dict]:
    """`count` copies of the dataset's row, each with an id naming the hub split and the position (pubmed has
    no id column: its ids are positions, so its article says where it comes from)."""
    row = ROWS[name]
    if name == "pubmed":
        return [dict(row, article=f"{hub_split} {index} {row['article']}") for index in range(count)]
    if name == "wikihowqa":  # article ids are ints: 1000 * split number + position
        return [dict(row, article_id=1000 * ("train", "valid", "test").index(hub_split) + index,
                     split=hub_split) for index in range(count)]
    return [dict(row, **{ID_COLUMNS[name]: f"{hub_split}-{index}"}) for index in range(count)]


def first_ids(name: str, hub_split: str, count: int) -> list[str]:
    if name == "pubmed":  # positions in our split, which has the hub's split name
        return [f"pubmed-{hub_split}-{index}" for index in range(count)]
    if name == "wikihowqa":
        return [str(row["article_id"]) for row in numbered_rows(name, hub_split, count)]
    return [f"{hub_split}-{index}" for index in range(count)]


@pytest.fixture
def local_hub(tmp_path, monkeypatch):
    """The hub's files, written in each repository's layout, served to the real `datasets.load_dataset`
    (see the module docstring). `.calls` records the arguments the library passed; the hub counts as
    reachable (`.unreachable` set to a reason makes it not), so a limited read streams."""
    root = tmp_path / "hub"
    hub = SimpleNamespace(calls=[], unreachable=None, cache=str(tmp_path / "cache"))

    def write_jsonl(path, rows):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))

    for name in ("kp20k", "kptimes"):
        for hub_split in ("train", "valid", "test"):
            write_jsonl(root / HUB_DATASETS[name].hub_id / f"{hub_split}.jsonl",
                        numbered_rows(name, hub_split, ROWS_PER_FILE))
    write_jsonl(root / "Lurunchik/WikiHowNFQA/WikiHowNFQA.jsonl",
                [row for hub_split in ("train", "valid", "test")
                 for row in numbered_rows("wikihowqa", hub_split, ROWS_PER_FILE)])
    msqa = root / "Tugay/multispanqa"
    msqa.mkdir(parents=True)
    unlabelled = {key: value for key, value in MSQA_ROW.items()
                  if key not in ("label", "num_span", "structure")}
    for file, rows in (("train", [dict(MSQA_ROW, id=i) for i in MSQA_TRAIN_IDS]),
                       ("validation", [dict(MSQA_ROW, id=msqa_id(f"validation-{i}")) for i in range(5)]),
                       ("test", [dict(unlabelled, id=msqa_id(f"test-{i}")) for i in range(5)])):
        (msqa / f"{file}.json").write_text(json.dumps({"version": "v1.0", "data": rows}))
    for name in ("cnndm", "pubmed"):
        spec = HUB_DATASETS[name]
        for hub_split in SPLITS:
            write_jsonl(root / spec.hub_id / spec.config_name / f"{hub_split}.jsonl",
                        numbered_rows(name, hub_split, ROWS_PER_FILE))

    real_load_dataset = datasets.load_dataset

    def load_dataset(path, name=None, **kwargs):
        hub.calls.append({"path": path, "name": name, **kwargs})
        if path == "json":
            assert kwargs["data_files"].startswith("hf://datasets/")
            kwargs["data_files"] = str(root / kwargs["data_files"].removeprefix("hf://datasets/"))
            return real_load_dataset("json", **kwargs)
        folder = root / path / name
        return real_load_dataset("json", data_files={s: str(folder / f"{s}.jsonl") for s in SPLITS}, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(hub_module, "_why_hub_unusable", lambda: hub.unreachable)
    return hub


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


# -- every dataset through load_hub ---------------------------------------------------------------------------

HUB_SPLIT_OF = {  # our split -> the hub file / split its rows come from
    "kp20k": {"train": "train", "validation": "valid", "test": "test"},
    "kptimes": {"train": "train", "validation": "valid", "test": "test"},
    "wikihowqa": {"train": "train", "validation": "valid", "test": "test"},
    "cnndm": {split: split for split in SPLITS},
    "pubmed": {split: split for split in SPLITS},
}


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("name", sorted(HUB_SPLIT_OF))
def test_load_hub_reads_each_split_from_its_own_rows(local_hub, name, split):
    records = load_hub(name, split, cache_dir=local_hub.cache)
    assert [r["id"] for r in records] == first_ids(name, HUB_SPLIT_OF[name][split], ROWS_PER_FILE)
    expected = {key: value for key, value in EXPECTED[name].items() if key != "id"}
    for record in records:
        record = {key: value for key, value in record.items() if key != "id"}
        if name == "pubmed":
            # drop the split and position that numbered_rows puts in front
            record["document"] = record["document"].split(" ", 2)[2]
        assert record == expected
    assert local_hub.calls[-1]["cache_dir"] == local_hub.cache
    assert local_hub.calls[-1]["streaming"] is False  # no limit: the split is downloaded whole and cached


def test_load_hub_asks_for_the_repositories_and_raw_files(local_hub):
    load_hub("cnndm", "validation", cache_dir=local_hub.cache)
    assert local_hub.calls[-1] == {"path": "abisee/cnn_dailymail", "name": "3.0.0", "split": "validation",
                                   "cache_dir": local_hub.cache, "streaming": False}
    load_hub("kptimes", "validation", cache_dir=local_hub.cache)
    assert local_hub.calls[-1] == {"path": "json", "name": None, "split": "train", "field": None,
                                   "data_files": "hf://datasets/midas/kptimes/valid.jsonl",
                                   "cache_dir": local_hub.cache, "streaming": False}
    load_hub("msqa", "test", cache_dir=local_hub.cache)
    assert local_hub.calls[-1]["data_files"] == "hf://datasets/Tugay/multispanqa/validation.json"
    assert local_hub.calls[-1]["field"] == "data"


# -- MultiSpanQA: validation carved out of train, the hub's validation file is the test split ---------------

def test_msqa_validation_is_held_out_of_train_and_test_is_the_hub_validation_file(local_hub):
    ids = {split: [r["id"] for r in load_hub("msqa", split, cache_dir=local_hub.cache)] for split in SPLITS}
    assert 0 < len(MSQA_HELD_OUT) < len(MSQA_TRAIN_IDS)  # the fixture exercises both sides
    assert ids["validation"] == MSQA_HELD_OUT  # in file order
    assert ids["train"] == [i for i in MSQA_TRAIN_IDS if i not in MSQA_HELD_OUT]
    assert ids["test"] == [msqa_id(f"validation-{i}") for i in range(5)]
    assert not set(ids["validation"]) & set(ids["test"])  # checkpoints are not chosen on the test set
    # the hub's unlabelled test file is never read
    assert all(not call["data_files"].endswith("/test.json") for call in local_hub.calls)


def test_msqa_carve_out_does_not_depend_on_limits(local_hub):
    """A row's split is a function of its id alone, so a limited run validates on a prefix of the full
    validation split and never trains on it."""
    cfg = compose("qa", overrides=["data=msqa", f"data.cache_dir={local_hub.cache}",
                                   "data.max_train_examples=5", "data.max_eval_examples=2"])
    train = [r["id"] for r in load_split("qa", cfg.data, "train")]
    validation = [r["id"] for r in load_split("qa", cfg.data, "validation")]
    assert validation == MSQA_HELD_OUT[:2]
    assert train == [i for i in MSQA_TRAIN_IDS if i not in MSQA_HELD_OUT][:5]


# -- limits act before the download ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(HUB_DATASETS))
def test_limits_stream_only_the_first_rows(local_hub, monkeypatch, name):
    spec = HUB_DATASETS[name]
    converted = []

    def counting_convert(row, row_id):
        converted.append(row_id)
        return spec.convert(row, row_id)

    monkeypatch.setitem(HUB_DATASETS, name, dataclasses.replace(spec, convert=counting_convert))
    cfg = compose(spec.task, overrides=[f"data={name}", f"data.cache_dir={local_hub.cache}",
                                        "data.max_train_examples=3", "data.max_eval_examples=2"])
    train = load_split(spec.task, cfg.data, "train")
    assert local_hub.calls[-1]["streaming"] is True  # not a download of the whole split, then a cut
    assert len(train) == 3 and len(converted) == 3   # only the rows kept are converted
    if name != "msqa":  # (msqa's train split skips the held-out rows; see the msqa tests)
        assert [r["id"] for r in train] == first_ids(name, "train", 3)
    test = load_split(spec.task, cfg.data, "test")
    assert local_hub.calls[-1]["streaming"] is True
    assert len(test) == 2 and len(converted) == 5


def test_limited_read_without_the_hub_cuts_the_cached_split(local_hub):
    """Offline, streaming is impossible; a repository dataset in the `datasets` cache is read from there
    (the fixture's files play the cache) and cut to the limit."""
    local_hub.unreachable = "no network in this test"
    records = load_hub("cnndm", "test", cache_dir=local_hub.cache, limit=4)
    assert local_hub.calls[-1]["streaming"] is False
    assert [r["id"] for r in records] == first_ids("cnndm", "test", 4)


def test_wikihowqa_keeps_only_the_rows_of_the_split(local_hub):
    cfg = compose("qa", overrides=["data=wikihowqa", f"data.cache_dir={local_hub.cache}",
                                   "data.max_eval_examples=3"])
    assert [r["id"] for r in load_split("qa", cfg.data, "validation")] == ["1000", "1001", "1002"]
    assert len(load_split("qa", cfg.data, "train")) == ROWS_PER_FILE


# -- KPTimes: source and keyphrases tokenized alike, aliases ------------------------------------------------

def kptimes_scores(record: dict, predictions: list[str]) -> dict[str, float]:
    """KeyphraseF1 of one record as the keyphrase task feeds it (tasks/module.py, KeyphraseTask)."""
    metric = KeyphraseF1()
    metric.update(preds=[predictions], targets=[target_texts("keyphrase", record)],
                  sources=[schema_for("keyphrase").source_text(record)], aliases=[record.get("aliases", {})])
    return {name: value.item() for name, value in metric.compute().items()}


@pytest.fixture
def kptimes_record(local_hub):
    return load_hub("kptimes", "train", cache_dir=local_hub.cache)[0]


def test_kptimes_present_keyphrases_are_scored_present(kptimes_record):
    scores = kptimes_scores(kptimes_record, KPTIMES_KEYPHRASES)  # the gold keyphrases, in order
    # present: donald trump ("Donald Trump ’s"), speeches, plagiarism ("plagiarism ,"), melania trump;
    # absent: 2016 presidential election, republican national convention (neither it nor "rnc" occurs)
    assert scores["present_r_at_M"] == scores["absent_r_at_M"] == 1
    assert scores["present_p_at_5"] == pytest.approx(4 / 5) and scores["absent_p_at_5"] == pytest.approx(2 / 5)
    assert kptimes_scores(kptimes_record, ["plagiarism"])["present_r_at_M"] == pytest.approx(1 / 4)


def test_kptimes_alias_matches_its_keyphrase(kptimes_record):
    with_alias = ["2016 presidential election", "rnc"]
    assert kptimes_scores(kptimes_record, with_alias)["absent_r_at_M"] == 1
    # both forms of one keyphrase: the second is a repeat, dropped like any repeated prediction
    both = kptimes_scores(kptimes_record, ["rnc", "republican national convention"])
    assert both["absent_p_at_M"] == 1 and both["absent_r_at_M"] == pytest.approx(1 / 2)


def test_keyphrase_is_present_when_an_alias_occurs():
    metric = KeyphraseF1()
    metric.update(preds=[["rnc"]], targets=[["republican national convention"]],
                  sources=["the RNC opened in Cleveland"],
                  aliases=[{"republican national convention": ["rnc"]}])
    scores = metric.compute()
    assert scores["present_r_at_M"] == 1 and scores["present_p_at_M"] == 1 and scores["absent_p_at_5"] == 0


def test_word_tokens_split_punctuation_and_keep_words_whole():
    assert word_tokens("Trump’s plagiarism-detection, the U.S. (2016): $80.5 O’Reilly 'quoted' IT'S") == \
        "Trump ’s plagiarism-detection , the U.S. ( 2016 ) : $ 80.5 O’Reilly ' quoted ' IT 'S"


# -- errors ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["cnndm", "kp20k"])  # a repository dataset and a raw-file dataset
def test_offline_fails_fast_with_the_jsonl_alternative(monkeypatch, tmp_path, name):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(DataError) as error:
        load_hub(name, "test", cache_dir=str(tmp_path), limit=5)
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
