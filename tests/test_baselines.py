"""`tasks.experiments.baselines`: lead-3 and the constant summary, scored as the decoders' outputs are."""
import json

import pytest
from mlflow.tracking import MlflowClient

from tasks.experiments import baselines
from tasks.config import ConfigError
from tasks.metrics import Rouge
from tests.test_end_to_end import tracking

DOCUMENTS = [  # tokenized and lowercased, as in the CNN/DM sample
    ("first one is here . the second one ! is there a third ? a fourth one .",
     ["first one is here .", "the second one !", "is there a third ?"]),
    ("dr . smith came home . he left again . we stayed . done .",  # "dr ." ends no sentence
     ["dr . smith came home .", "he left again .", "we stayed ."]),
    ("only one sentence here .", ["only one sentence here ."]),
]
REFERENCES = [["the first one is here .", "a fourth one came ."], ["smith came home and left ."],
              ["one sentence ."]]
SUMMARY_A = ["the cat sat on the mat ."]
SUMMARY_B = ["dogs bark loudly .", "birds sing ."]
# B and A twice each (B once with blanks, which the scorer drops): B is seen first and wins the tie;
# the empty summaries, more frequent, are no candidates.
TRAIN_SUMMARIES = [[], SUMMARY_B, [], SUMMARY_A, [" dogs bark loudly . ", "", "birds sing ."],
                   SUMMARY_A, [], ["a fish swam ."]]


def write_split(folder, split, rows):
    lines = [json.dumps({"id": f"{split}-{i}", "document": document, "summary": summary})
             for i, (document, summary) in enumerate(rows)]
    (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")


@pytest.fixture
def data(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write_split(folder, "train", [(f"training document {i} . it has words .", summary)
                                  for i, summary in enumerate(TRAIN_SUMMARIES)])
    write_split(folder, "validation", [("a validation document .", ["a summary ."])])
    write_split(folder, "test", [(document, reference)
                                 for (document, _), reference in zip(DOCUMENTS, REFERENCES)])
    return folder


def rouge_by_hand(predictions, references) -> dict:
    metric = Rouge()
    metric.update(preds=predictions, targets=references)
    return {key: float(value) for key, value in metric.compute().items()}


def test_lead_3_is_the_first_three_sentences():
    for document, lead in DOCUMENTS:
        assert baselines.lead({"id": "x", "document": document, "summary": []}) == lead


def test_constant_is_the_most_frequent_training_summary_first_seen_among_equals():
    records = [{"id": f"train-{i}", "document": "d", "summary": s} for i, s in enumerate(TRAIN_SUMMARIES)]
    constant = baselines.most_frequent_summary(records)
    assert constant == {"summary": SUMMARY_B, "count": 2, "first_id": "train-1",
                        "training_summaries": 8, "distinct_summaries": 3, "all_distinct": False}
    distinct = baselines.most_frequent_summary(records[3:4] + records[1:2])
    assert distinct["summary"] == SUMMARY_A and distinct["all_distinct"]


def test_scores_are_the_task_metric_on_the_baseline_texts(data, tmp_path):
    # two of the three test examples (data.max_eval_examples); one sentence kept by the cut
    out = tmp_path / "report" / "baselines.json"
    result = baselines.main(["--task", "summarization", "data=jsonl", f"data.path={data}",
                             "data.max_eval_examples=2", "data.max_subsequences=1",
                             "--out", str(out), *tracking(tmp_path)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    leads = [lead for _, lead in DOCUMENTS[:2]]
    expected = {"lead-3": leads, "lead-3, cut to data limits": [lead[:1] for lead in leads],
                "constant": [SUMMARY_B] * 2, "constant, cut to data limits": [SUMMARY_B[:1]] * 2}
    rows = {row["label"]: row for row in result["rows"]}
    assert list(rows) == list(expected)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    for label, predictions in expected.items():
        row = rows[label]
        assert row["examples"] == 2
        assert row["sentences_per_example"] == sum(map(len, predictions)) / 2
        by_hand = rouge_by_hand(predictions, REFERENCES[:2])
        assert {key: row[key] for key in by_hand} == pytest.approx(by_hand, abs=1e-12)
        run = client.get_run(row["mlflow_run_id"])
        assert run.info.status == "FINISHED" and run.data.tags["role"] == "baseline"
        assert run.data.metrics["test/rougeL"] == pytest.approx(by_hand["rougeL"])
    assert rows["lead-3, cut to data limits"]["sentences_dropped"] == 4  # 2 of 3 in both examples
    assert result["baselines"]["constant"]["first_id"] == "train-1"
    assert "| constant | " in out.with_suffix(".md").read_text()


def test_another_task_is_a_clear_error():
    with pytest.raises(ConfigError, match="got task 'qa' \\(allowed: summarization\\)"):
        baselines.main(["--task", "qa"])
