"""tasks.experiments.qa_sentences and datamodules.builtin.qa_facts: built-in QA's context sentences
read back, and which of their values a model's output names."""
from collections import Counter

import pytest

from datamodules.builtin import QAFact, make_corpus, qa_facts, qa_question
from tasks.config import ConfigError, compose
from tasks.experiments import qa_sentences
from tasks.experiments.qa_sentences import KINDS, tally
from tasks.runs.trainer import build
from tests.conftest import save_checkpoint
from tests.test_end_to_end import TINY, tracking


def test_the_rule_applied_to_the_facts_read_back_gives_every_records_answers():
    for record in make_corpus("qa", "train", size=500):
        person, relation = qa_question(record["question"])
        facts = qa_facts(record["context"])
        assert [v for f in facts if (f.person, f.relation) == (person, relation)
                for v in f.values] == record["answers"]
        assert all(len(f.values) in (1, 2) for f in facts)


def test_facts_keep_multi_word_values_and_their_order():
    assert qa_question("what did elena buy ?") == ("elena", 1)
    assert qa_facts("on monday , elena bought a red lamp and a black kettle . "
                    "in may , ben visited new york .") == [
        QAFact("elena", 1, ("red lamp", "black kettle")), QAFact("ben", 0, ("new york",))]
    with pytest.raises(ValueError, match="not a built-in QA question"):
        qa_question("who is elena ?")


def test_values_are_counted_by_the_kind_of_their_sentence():
    record = {"question": "which cities did anna visit ?",
              "context": "anna visited rome . anna visited oslo and lima . ben visited paris . "
                         "carlos visited rome . anna met ben .",
              "answers": ["rome", "oslo", "lima"]}
    counts = {kind: Counter() for kind in (*KINDS, "output")}
    tally(record, ["rome", "paris", "paris", "ben", "kyoto"], counts)
    assert counts[KINDS[0]] == Counter(sentences=1, values=1, output=1)            # rome
    assert counts[KINDS[1]] == Counter(sentences=1, values=2, output=0)            # oslo, lima
    # carlos's rome is an answer too: not counted against the model
    assert counts[KINDS[2]] == Counter(sentences=2, values=1, output=1)            # paris
    assert counts[KINDS[3]] == Counter(sentences=1, values=1, output=1)            # ben
    assert counts["output"] == Counter(answers=5, repeated=1, **{"in no sentence": 1})


def test_a_checkpoint_decodes_its_split_and_every_sentence_is_counted(tmp_path):
    built = build(compose("qa", "sequential", None, [*TINY, *tracking(tmp_path)]))
    path = save_checkpoint(built.module, tmp_path / "sequential.ckpt")
    result = qa_sentences.main(["--ckpt", path, "--split", "test", "--out",
                                str(tmp_path / "sentences.json"), *tracking(tmp_path)])
    records = built.datamodule.records("test")
    assert result["examples"] == len(records)
    assert sum(row["sentences"] for row in result["sentences"]) == sum(
        len(qa_facts(r["context"])) for r in records)
    assert all(row["output"] <= row["values"] for row in result["sentences"])
    assert (tmp_path / "sentences.md").read_text().count("| answer sentence") == 2


def test_a_checkpoint_of_another_task_is_refused(tmp_path):
    built = build(compose("keyphrase", "sequential", None, [*TINY, *tracking(tmp_path)]))
    path = save_checkpoint(built.module, tmp_path / "keyphrase.ckpt")
    with pytest.raises(ConfigError, match="trained on keyphrase from data.source=builtin; this "
                                          "counts built-in QA's sentences only"):
        qa_sentences.main(["--ckpt", path, *tracking(tmp_path)])
