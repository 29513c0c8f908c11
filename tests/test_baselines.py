"""`tasks.baselines` and its command `tasks.experiments.baselines`: each baseline's definition by
construction, and its outputs scored as the decoders' outputs are, by the task's own metrics."""
import json

import pytest
from mlflow.tracking import MlflowClient

from tasks import baselines
from tasks.config import ConfigError, compose
from tasks.experiments import baselines as command
from tasks.metrics import KeyphraseF1, MultiSpanMatch, Rouge
from tasks.module import task_scores
from tests.test_end_to_end import run_artifact_rows, tracking

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
# the empty summaries, more frequent, are no candidates. Sentences per summary: 0 2 0 1 2 1 0 1,
# whose median is 1.
TRAIN_SUMMARIES = [[], SUMMARY_B, [], SUMMARY_A, [" dogs bark loudly . ", "", "birds sing ."],
                   SUMMARY_A, [], ["a fish swam ."]]
# per example: 2 3 3 1 targets (median 2.5, rounded half up: 3); in how many examples each string is
# (repeats within one example count once): deep learning 3, graphs 2, neural networks 2, trees 1,
# so the three most frequent are deep learning, then neural networks before graphs (seen first)
TRAIN_KEYPHRASES = [["neural networks", "deep learning"],
                    ["deep learning", "graphs", "deep learning"],
                    ["graphs", "deep learning", "trees"], ["neural networks"]]
FREQUENT = ["deep learning", "neural networks", "graphs"]


def summarization_records(summaries):
    return [{"id": f"train-{i}", "document": "d", "summary": s} for i, s in enumerate(summaries)]


def keyphrase_records(keyphrases):
    return [{"id": f"train-{i}", "title": "t", "abstract": "a", "keyphrases": k}
            for i, k in enumerate(keyphrases)]


def test_median_count_rounds_half_up():
    assert [baselines.median_count(c) for c in ([1, 2], [2, 3], [3, 1, 2], [0, 0, 5], [4])] == \
        [2, 3, 2, 0, 4]


def test_lead_is_the_first_k_sentences():
    for document, lead in DOCUMENTS:
        record = {"id": "x", "document": document, "summary": []}
        assert baselines.lead(record, 3) == lead
        assert baselines.lead(record, 1) == lead[:1]


def test_constant_is_the_most_frequent_training_target_first_seen_among_equals():
    records = summarization_records(TRAIN_SUMMARIES)
    constant = baselines.most_frequent_target("summarization", records)
    assert {key: value for key, value in constant.items() if key != "rule"} == {
        "output": SUMMARY_B, "count": 2, "first_id": "train-1", "training_examples": 8,
        "distinct_targets": 3}
    distinct = baselines.most_frequent_target("summarization", records[3:4] + records[1:2])
    assert distinct["output"] == SUMMARY_A and distinct["count"] == 1
    # a keyphrase target is its whole list: all four are distinct, so the first wins
    assert baselines.most_frequent_target("keyphrase", keyphrase_records(TRAIN_KEYPHRASES))[
        "output"] == TRAIN_KEYPHRASES[0]


def test_frequent_is_the_median_number_of_the_most_frequent_target_strings():
    frequent = baselines.most_frequent_strings("keyphrase", keyphrase_records(TRAIN_KEYPHRASES))
    assert (frequent["output"], frequent["counts"], frequent["n"]) == (FREQUENT, [3, 2, 2], 3)
    # answers of qa the same way; an example without a target counts 0: median of 0 0 1 is 0
    answers = [{"id": str(i), "question": "q", "context": "c", "answers": a}
               for i, a in enumerate([[], ["paris"], []])]
    assert baselines.most_frequent_strings("qa", answers)["output"] == []


def test_each_task_has_a_constant_and_a_frequent_or_a_lead():
    test = [{"id": "t", "document": DOCUMENTS[0][0], "summary": []}]
    (constant, _, constant_out), (lead, definition, lead_out) = baselines.baseline_outputs(
        "summarization", summarization_records(TRAIN_SUMMARIES), test)
    assert (constant, constant_out) == ("constant", [SUMMARY_B])
    assert (lead, definition["k"], lead_out) == ("lead-1", 1, [DOCUMENTS[0][1][:1]])
    test = keyphrase_records([[]])
    made = baselines.baseline_outputs("keyphrase", keyphrase_records(TRAIN_KEYPHRASES), test)
    assert [(name, outputs) for name, _, outputs in made] == [
        ("constant", [TRAIN_KEYPHRASES[0]]), ("frequent", [FREQUENT])]


def test_task_scores_are_the_task_modules_metrics():
    records = [{"id": "0", "question": "q", "context": "c", "answers": ["the cat sat .", "dogs"]}]
    predictions = [["cat sat .", "dogs"]]
    span = MultiSpanMatch()
    span.update(preds=predictions, targets=[records[0]["answers"]])
    rouge = Rouge()
    rouge.update(preds=predictions, targets=[records[0]["answers"]])
    by_hand = {key: float(value) for key, value in {**span.compute(), **rouge.compute()}.items()}
    phrase = task_scores(compose("qa", None, None, []), None, predictions, records)
    assert phrase == pytest.approx({key: by_hand[key] for key in span.compute()})
    sentence = task_scores(compose("qa", None, None, ["task.level=sentence"]), None, predictions,
                           records)
    assert sentence == pytest.approx(by_hand) and "rougeL" in sentence


def write_split(folder, split, rows):
    (folder / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def summarization_data(folder):
    write_split(folder, "train", [{"id": f"train-{i}", "document": f"training document {i} . it has "
                                   f"words .", "summary": summary}
                                  for i, summary in enumerate(TRAIN_SUMMARIES)])
    write_split(folder, "validation", [{"id": "v", "document": "a validation document .",
                                        "summary": ["a summary ."]}])
    write_split(folder, "test", [{"id": f"test-{i}", "document": document, "summary": reference}
                                 for i, ((document, _), reference) in enumerate(zip(DOCUMENTS,
                                                                                    REFERENCES))])


TEST_KEYPHRASES = [  # the second scores only through its alias: "dl" is "deep learning"
    {"id": "test-0", "title": "graphs", "abstract": "neural networks on graphs",
     "keyphrases": ["graphs", "trees"]},
    {"id": "test-1", "title": "deep learning", "abstract": "we learn deeply",
     "keyphrases": ["dl"], "aliases": {"dl": ["deep learning"]}},
]


def keyphrase_data(folder):
    write_split(folder, "train", [{"id": f"train-{i}", "title": f"paper {i}",
                                   "abstract": f"about {' and '.join(k)}", "keyphrases": k}
                                  for i, k in enumerate(TRAIN_KEYPHRASES)])
    write_split(folder, "validation", [{"id": "v", "title": "t", "abstract": "a",
                                        "keyphrases": ["graphs"]}])
    write_split(folder, "test", TEST_KEYPHRASES)


def computed(metric) -> dict:
    return {key: float(value) for key, value in metric.compute().items()}


def rouge_by_hand(predictions, references=REFERENCES[:2]) -> dict:
    metric = Rouge()
    metric.update(preds=predictions, targets=references)
    return computed(metric)


def keyphrase_by_hand(predictions, aliases=True) -> dict:
    metric = KeyphraseF1()
    metric.update(preds=predictions, targets=[r["keyphrases"] for r in TEST_KEYPHRASES],
                  sources=[f"{r['title']} {r['abstract']}" for r in TEST_KEYPHRASES],
                  aliases=[r.get("aliases", {}) if aliases else {} for r in TEST_KEYPHRASES])
    return computed(metric)


@pytest.mark.parametrize("task,write,overrides,expected,by_hand", [
    # two of the three test examples (data.max_eval_examples); the cut keeps one sentence
    ("summarization", summarization_data, ["data.max_eval_examples=2", "data.max_subsequences=1"],
     {"constant": [SUMMARY_B[:1]] * 2, "lead-1": [lead[:1] for _, lead in DOCUMENTS[:2]]},
     rouge_by_hand),
    # the cut keeps two keyphrases of three
    ("keyphrase", keyphrase_data, ["data.max_subsequences=2"],
     {"constant": [TRAIN_KEYPHRASES[0]] * 2, "frequent": [FREQUENT[:2]] * 2}, keyphrase_by_hand),
])
def test_the_command_scores_each_baseline_with_the_task_metric(task, write, overrides, expected,
                                                               by_hand, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write(data)
    out = tmp_path / "report" / "baselines.json"
    result = command.main(["--task", task, "data=jsonl", f"data.path={data}", *overrides,
                           "--out", str(out), *tracking(tmp_path)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    examples = len(next(iter(expected.values())))
    assert result["task"] == task and result["test_examples"] == examples
    entries = {entry["baseline"]: entry for entry in result["baselines"]}
    assert list(entries) == list(expected)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    for name, predictions in expected.items():
        entry = entries[name]
        assert entry["label"] == f"baseline: {name}" and entry["examples"] == examples
        assert entry["subsequences_per_example"] == sum(map(len, predictions)) / examples
        assert entry["quality"] == pytest.approx(by_hand(predictions), abs=1e-12)
        run = client.get_run(entry["mlflow_run_id"])
        assert run.info.status == "FINISHED" and run.data.tags["role"] == "baseline"
        assert [row["prediction"] for row in run_artifact_rows(client, run.info.run_id,
                                                               tmp_path / name)] == predictions
        assert run.data.metrics == pytest.approx(
            {f"test/{key}": value for key, value in entry["quality"].items()}
            | {"test/subsequences_per_example": entry["subsequences_per_example"],
               "test/tokens_per_example": entry["tokens_per_example"]})
    table = out.with_suffix(".md").read_text()
    assert all(f"| {name} | " in table for name in expected)
    if task == "summarization":  # the constant's second sentence, cut in both examples
        assert entries["constant"]["subsequences_dropped"] == 2
    else:  # the second test example matches through its alias: the keyphrase metric was given it
        assert entries["frequent"]["quality"]["present_f1_at_M"] > \
            keyphrase_by_hand(FREQUENT[:2], aliases=False)["present_f1_at_M"]


def test_an_unknown_task_is_a_clear_error():
    with pytest.raises(ConfigError, match="unknown task 'nosuch'; allowed: keyphrase, qa, summarization"):
        command.main(["--task", "nosuch"])
