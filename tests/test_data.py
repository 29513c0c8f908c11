"""Data sources, limits, truncation reports and the tokenizer cache."""
import json
import random
import time
from pathlib import Path

import pytest
from torch.utils.data import DistributedSampler

from datamodules import tokenizer as tok
from datamodules.datamodule import DataReport, LengthGrouped, SubsequenceDataModule, fit_targets
from datamodules.schema import DataError
from datamodules.sources import load_split, read_jsonl
from tasks.config import compose
from tasks.models import ModelError, build_backbone
from tasks.runs.tracking import records_digest

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def write_split(folder: Path, split: str, rows: list) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{split}.jsonl", "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")


KP = {"id": "a", "title": "graph coloring", "abstract": "we study graph coloring .",
      "keyphrases": ["graph coloring", "np hardness"]}


@pytest.mark.parametrize("line,needle", [
    ('{"id": "b", "title": "t"', "line 2: malformed JSON"),
    ('{"id": "b", "title": "t", "abstract": "x"}', "line 2: missing field 'keyphrases'"),
    ('{"id": "b", "title": "t", "abstract": "x", "keyphrases": "one"}',
     "line 2: field 'keyphrases' must be a list of strings"),
    ('{"id": 7, "title": "t", "abstract": "x", "keyphrases": []}', "line 2: field 'id' must be str"),
    ('[1, 2]', "line 2: expected a JSON object"),
    ('{"id": "b", "title": "t", "abstract": "x", "keyphrases": ["a"], "aliases": {"a": "b"}}',
     "line 2: field 'aliases' must map strings to lists of strings"),
])
def test_bad_jsonl_line_names_file_line_and_field(tmp_path, line, needle):
    write_split(tmp_path, "train", [KP, line])
    with pytest.raises(DataError) as err:
        read_jsonl(tmp_path / "train.jsonl", "keyphrase")
    assert needle in str(err.value) and "train.jsonl" in str(err.value)


def test_non_utf8_line(tmp_path):
    tmp_path.joinpath("train.jsonl").write_bytes(json.dumps(KP).encode() + b"\n\xff\xfe{}\n")
    with pytest.raises(DataError, match=r"train.jsonl line 2: not valid UTF-8"):
        read_jsonl(tmp_path / "train.jsonl", "keyphrase")


def test_missing_and_empty_split(tmp_path):
    write_split(tmp_path, "train", [KP])
    cfg = compose("keyphrase", overrides=["data=jsonl", f"data.path={tmp_path}"])
    with pytest.raises(DataError, match=r"missing split file .*validation.jsonl .*found: train.jsonl"):
        load_split("keyphrase", cfg.data, "validation")
    write_split(tmp_path, "test", [])
    with pytest.raises(DataError, match="test.jsonl holds no records"):
        load_split("keyphrase", cfg.data, "test")
    bad = compose("keyphrase", overrides=["data=jsonl", f"data.path={tmp_path / 'nope'}"])
    with pytest.raises(DataError, match="is not a folder"):
        load_split("keyphrase", bad.data, "train")


@pytest.mark.parametrize("task,folder", [("keyphrase", "kp20k"), ("qa", "multispanqa"),
                                         ("summarization", "cnndm")])
def test_shared_real_data_loads_as_jsonl(task, folder):
    if not (SHARED / folder).is_dir():
        pytest.skip("../shared/data not present")
    cfg = compose(task, overrides=["data=jsonl", f"data.path={SHARED / folder}"])
    for split in ("validation", "test"):
        records = load_split(task, cfg.data, split)
        assert len(records) > 10 and len({r["id"] for r in records}) == len(records)


def test_hub_dataset_of_another_task_is_refused():
    cfg = compose("qa", overrides=["data=kp20k"])
    with pytest.raises(DataError, match="data=kp20k is a keyphrase dataset, but task=qa"):
        load_split("qa", cfg.data, "train")


def test_fit_targets_counts_what_it_cuts():
    report = DataReport()
    # budget 8: [1,2,3] (3) + sep + [4,5] (2) + end = 7; [6,7] would need 3 more
    assert fit_targets([[1, 2, 3], [4, 5], [6, 7]], 8, 16, 32, report) == [[1, 2, 3], [4, 5]]
    assert report.subsequences_dropped == 1
    report = DataReport()
    assert fit_targets([list(range(10)), [1]], 5, 16, 32, report) == [[0, 1, 2, 3]]
    assert (report.subsequences_truncated, report.subsequences_dropped) == (1, 1)
    report = DataReport()
    assert fit_targets([[1], [2], [3]], 50, 2, 32, report) == [[1], [2]]
    assert report.subsequences_dropped == 1
    # max_subsequence_length 3: two tokens and the end token per subsequence, each cut one counted
    report = DataReport()
    assert fit_targets([[1, 2, 3, 4], [5], [6, 7, 8]], 50, 16, 3, report) == [[1, 2], [5], [6, 7]]
    assert (report.subsequences_truncated, report.subsequences_dropped) == (2, 0)


def test_datamodule_limits_truncation_and_batches(tmp_path):
    cfg = compose("keyphrase", overrides=[
        "data.train_size=40", "data.validation_size=10", "data.test_size=10",
        "data.max_train_examples=30", "data.max_eval_examples=5", "data.max_source_length=12",
        f"data.tokenizer_cache={tmp_path}", "model.vocab_size=300", "train.batch_size=8"])
    dm = SubsequenceDataModule(cfg)
    dm.setup()
    assert [len(dm.records(s)) for s in ("train", "validation", "test")] == [30, 5, 5]
    assert dm.report["train"].sources_truncated == 30  # every built-in abstract is longer
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[0] == 8 and batch["input_ids"].shape[1] <= 12
    assert (batch["input_ids"][:, -1] == dm.tokenizer.eos_token_id).any()
    assert len(batch["targets"]) == 8 and all(batch["targets"])
    # the decoded targets are the record's keyphrases
    first = next(iter(dm.val_dataloader()))
    record = dm.records("validation")[first["index"][0]]
    assert [dm.tokenizer.decode(t) for t in first["targets"][0]] == record["keyphrases"]


def test_trained_tokenizer_keeps_frequent_words_whole(tmp_path):
    words = "code review of schema evolution in graph coloring".split()
    texts = [" ".join(words[i:] + words[:i]) for i in range(len(words))] * 30
    tokenizer = tok.train_or_load(texts, 4000, tmp_path)
    assert tokenizer.tokenize("graph coloring of code") == ["▁graph", "▁coloring", "▁of", "▁code"]
    assert tokenizer.decode(tokenizer("schema evolution", add_special_tokens=False)["input_ids"]) == \
        "schema evolution"
    assert [tokenizer.convert_tokens_to_ids(t) for t in tok.SPECIAL_TOKENS] == [0, 1, 2, 3, 4]


def test_tokenizer_is_cached_and_reused(tmp_path, monkeypatch):
    texts = ["graph coloring of planar graphs", "neural network pruning"] * 20
    first = tok.train_or_load(texts, 120, tmp_path)
    assert len(list(tmp_path.glob("tokenizer-*.json"))) == 1
    monkeypatch.setattr(tok, "_train", lambda *a: pytest.fail("retrained despite the cache"))
    second = tok.train_or_load(texts, 120, tmp_path)
    assert first.get_vocab() == second.get_vocab()
    special = tok.special_tokens(second, 0)
    assert (special.pad, special.eos, special.unk, special.sep, special.mask) == (0, 1, 2, 3, 4)
    # different data -> a different cache entry
    monkeypatch.undo()
    tok.train_or_load(texts + ["something else entirely"], 120, tmp_path)
    assert len(list(tmp_path.glob("tokenizer-*.json"))) == 2


def test_pretrained_tokenizer_and_weights_fail_fast_offline(monkeypatch):
    # set after import: the loaders must honour it at call time, not retry the network for minutes
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    with pytest.raises(tok.TokenizerError, match=r"cannot load the tokenizer of 'google-t5/t5-small': "
                                                 r"the hub cannot be reached \(HF_HUB_OFFLINE is set\).*"
                                                 r"Use model=t5-tiny, or a local copy of the model "
                                                 r"\(model.hub_id=DIR, or tasks.predict --pretrained "
                                                 r"DIR\), to work offline"):
        tok.load_pretrained("google-t5/t5-small")
    # the model's type is read first, from its configuration
    with pytest.raises(ModelError, match=r"cannot load the configuration of 'google-t5/t5-small': "
                                         r"the hub cannot be reached .*Use model=t5-tiny"):
        build_backbone(compose(overrides=["model=t5-small"]).model, tokenizer=None)
    assert time.perf_counter() - started < 20


def test_records_digest_follows_the_records_content_and_order():
    records = [dict(KP), {**KP, "id": "b"}]
    digest = records_digest(records)
    assert records_digest([dict(reversed(list(r.items()))) for r in records]) == digest  # key order aside
    assert records_digest(records[::-1]) != digest
    assert records_digest([records[0], {**records[1], "keyphrases": ["graph coloring"]}]) != digest
    assert records_digest(records[:1]) != digest


# ---- no text lost or confused ----------------------------------------------------------------------

# Characters an English training corpus lacks, in the scripts and forms a dataset may hold.
UNSEEN = ["unseen 🦄 ß", "東京大学の研究", "שלום עולם", "مرحبا بالعالم", "café naïve Ærø",
          "cafe\u0301 (a combining accent)", "ﬁnance and ＡＢＣ (compatibility forms)",
          " leading, two  spaces,\ttab,\nnewline, trailing ", "</s> <sep> <unk> <pad> <mask> <0x41>"]


def test_trained_tokenizer_writes_any_text_and_reads_it_back(tmp_path):
    texts = ["graph coloring of planar graphs . we study neural network pruning ."] * 20
    tokenizer = tok.train_or_load(texts, 200, tmp_path)
    for text in UNSEEN:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.unk_token_id not in ids, text
        # special-token names in a text are text: no id of a special token comes out of it
        assert not set(ids) & set(tokenizer.all_special_ids), text
        assert tokenizer.decode(ids) == text
        assert tokenizer.decode(ids, skip_special_tokens=True) == text  # the predictions' path
    # the one exception (documented): "▁" stands for a space in the pieces and reads back as one
    assert tokenizer.decode(tokenizer("a▁b", add_special_tokens=False)["input_ids"]) == "a b"
    # a checkpoint's copy behaves the same
    again = tok.from_serialized(tokenizer.backend_tokenizer.to_str())
    assert again.decode(again(UNSEEN[0], add_special_tokens=False)["input_ids"]) == UNSEEN[0]


def test_predictions_read_back_as_the_references_they_reproduce(tmp_path):
    """The library's own path from references to token ids (the datamodule) and from generated ids
    to prediction text (`GenerationTask.decode_batch`): a decoder that outputs the test targets
    exactly predicts the references, character for character, in scripts training never saw."""
    from decoders import DecodeOutput
    from tasks.runs.trainer import build
    train = [dict(KP, id=f"t{i}") for i in range(8)]
    test = [dict(KP, id=f"u{i}", keyphrases=[text.strip(), "graph coloring"])
            for i, text in enumerate(UNSEEN)]
    for split, rows in (("train", train), ("validation", train), ("test", test)):
        write_split(tmp_path / "data", split, rows)
    cfg = compose("keyphrase", overrides=["data=jsonl", f"data.path={tmp_path / 'data'}",
                                          "data.max_subsequence_length=128",  # nothing cut
                                          f"data.tokenizer_cache={tmp_path / 'tok'}", "model.d_model=16",
                                          "model.d_ff=16", "model.d_kv=8", "model.num_heads=2"])
    built = build(cfg)
    module, batch = built.module, next(iter(built.datamodule.ordered_loader("test")))
    module.decoder.generate = lambda model, input_ids, attention_mask: DecodeOutput(
        subsequences=batch["targets"], decoder_calls=[1] * len(test), tokens=[1] * len(test),
        bound_hit=[False] * len(test), batch_decoder_calls=1)
    module._eval_start()
    assert module.decode_batch(batch) == [record["keyphrases"] for record in test]


def test_builtin_keyphrases_stay_one_token_per_word(tmp_path):
    """Byte fallback adds pieces, it takes none of the merges away: on the built-in keyphrase data
    the trained tokenizer still keeps the words of the validation keyphrases whole."""
    dm = SubsequenceDataModule(compose("keyphrase", overrides=[f"data.tokenizer_cache={tmp_path}"]))
    dm.setup()
    keyphrases = [k for record in dm.records("validation") for k in record["keyphrases"]]
    tokens = sum(len(ids) for ids in dm.tokenizer(keyphrases, add_special_tokens=False)["input_ids"])
    assert tokens / sum(len(k.split()) for k in keyphrases) == pytest.approx(1.0, abs=0.02)


def test_empty_sources_are_counted_and_an_all_empty_split_is_refused(tmp_path, caplog):
    blank = dict(KP, title=" ", abstract="")
    write_split(tmp_path, "train", [dict(KP, id="a"), dict(blank, id="b"), dict(KP, id="c")])
    write_split(tmp_path, "validation", [KP])
    write_split(tmp_path, "test", [KP])
    cfg = compose("keyphrase", overrides=["data=jsonl", f"data.path={tmp_path}", "model.vocab_size=60",
                                          f"data.tokenizer_cache={tmp_path}/tok"])
    dm = SubsequenceDataModule(cfg)
    dm.setup()
    assert dm.report["train"].empty_sources == 1 and dm.report["validation"].empty_sources == 0
    assert "train split: 1 of 3 examples have an empty source (fields title, abstract)" in caplog.text

    write_split(tmp_path, "test", [dict(blank, id="x"), dict(blank, id="y")])
    with pytest.raises(DataError, match=r"test split: all 2 examples have an empty source \(fields "
                                        r"title, abstract\)"):
        SubsequenceDataModule(cfg).setup()


def test_a_qa_question_without_context_is_a_source():
    """WikiHowQA has no contexts: the question is what is answered from."""
    from datamodules.schema import has_source
    assert has_source("qa", {"question": "how to tie a knot?", "context": ""})
    assert not has_source("qa", {"question": " ", "context": ""})


def test_duplicate_ids_in_a_split_are_refused_naming_where(tmp_path, monkeypatch):
    write_split(tmp_path, "train", [dict(KP, id="a"), dict(KP, id="b"), "", dict(KP, id="a")])
    with pytest.raises(DataError, match=rf"train split: id 'a' is used twice, at {tmp_path}/train.jsonl "
                                        rf"line 1 and at {tmp_path}/train.jsonl line 4"):
        read_jsonl(tmp_path / "train.jsonl", "keyphrase")

    import datamodules.hub
    monkeypatch.setattr(datamodules.hub, "load_hub", lambda name, split, cache_dir, limit:
                        [dict(KP, id="k1"), dict(KP, id="k2"), dict(KP, id="k2")])
    cfg = compose("keyphrase", overrides=["data=kp20k"])
    with pytest.raises(DataError, match=r"validation split: id 'k2' is used twice, at record 1 "
                                        r"\(counted from 0\) of data=kp20k and at record 2"):
        load_split("keyphrase", cfg.data, "validation")


def batch_spreads(order: list[int], lengths: list[int], batch_size: int) -> tuple[int, float]:
    """Padded positions of `order` cut into batches (each padded to its longest), and the mean
    length spread (longest - shortest) within a batch."""
    batches = [[lengths[i] for i in order[s: s + batch_size]] for s in range(0, len(order), batch_size)]
    return (sum(max(b) * len(b) for b in batches),
            sum(max(b) - min(b) for b in batches) / len(batches))


def test_length_grouped_batches_see_every_example_once_with_less_padding():
    rng = random.Random(0)
    lengths = [rng.randint(5, 80) for _ in range(1003)]   # 1003: a short last batch
    grouped = LengthGrouped(lengths, 8, num_replicas=1, rank=0, seed=3)
    grouped.set_epoch(0)
    order = list(grouped)
    assert sorted(order) == list(range(len(lengths)))
    plain = DistributedSampler(lengths, num_replicas=1, rank=0, shuffle=True, seed=3)
    plain.set_epoch(0)
    (padded, spread), (plain_padded, plain_spread) = (batch_spreads(o, lengths, 8)
                                                      for o in (order, list(plain)))
    assert padded < 0.8 * plain_padded and spread < plain_spread / 4
    # an epoch's order is a function of (seed, epoch): a resumed run sees the same batches
    again = LengthGrouped(lengths, 8, num_replicas=1, rank=0, seed=3)
    again.set_epoch(0)
    assert list(again) == order
    grouped.set_epoch(1)
    assert list(grouped) != order and sorted(grouped) == list(range(len(lengths)))
    # under DDP the two processes' shares together hold every example
    shares = []
    for rank in (0, 1):
        share = LengthGrouped(lengths, 8, num_replicas=2, rank=rank, seed=3)
        share.set_epoch(0)
        shares += list(share)
    assert set(shares) == set(range(len(lengths)))


def test_train_group_by_length_groups_the_training_batches(tmp_path):
    def loader_lengths(group_by_length: bool) -> tuple[type, list[int]]:
        cfg = compose("qa", overrides=[
            "data.train_size=300", "data.validation_size=10", "data.test_size=10",
            f"data.tokenizer_cache={tmp_path}", "model.vocab_size=300", "train.batch_size=8",
            f"train.group_by_length={str(group_by_length).lower()}"])
        loader = SubsequenceDataModule(cfg).train_dataloader()
        seen = [(int(i), int(mask.sum())) for batch in loader
                for i, mask in zip(batch["index"], batch["attention_mask"])]
        assert sorted(i for i, _ in seen) == list(range(300))
        return type(loader.sampler), [length for _, length in seen]

    (grouped_sampler, grouped), (_, plain) = loader_lengths(True), loader_lengths(False)
    assert grouped_sampler is LengthGrouped
    assert batch_spreads(list(range(300)), grouped, 8)[1] < batch_spreads(list(range(300)), plain, 8)[1] / 4
