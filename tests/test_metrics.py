"""Tests of tasks.metrics: hand-computed cases for every scoring rule, DDP-style state merging,
and agreement with independent reimplementations of the reference scorers on real data."""
from __future__ import annotations

import difflib
import json
import random
import re
import string
from pathlib import Path

import numpy as np
import pytest
import torch
from nltk.stem import PorterStemmer
from rouge_score import rouge_scorer

from tasks.metrics import KeyphraseF1, MultiSpanMatch, Rouge, normalize_answer

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def values(metric) -> dict[str, float]:
    return {name: value.item() for name, value in metric.compute().items()}


def score(metric, **inputs) -> dict[str, float]:
    metric.update(**inputs)
    return values(metric)


def read_jsonl(name: str) -> list[dict]:
    path = DATA / name / "test.jsonl"
    if not path.exists():
        pytest.skip(f"{path} not available")
    with path.open() as f:
        return [json.loads(line) for line in f]


# ----------------------------------------------------------------------------------------------
# Shared behaviour
# ----------------------------------------------------------------------------------------------

MSM_KEYS = {f"{kind}_{stat}" for kind in ("em", "pm") for stat in ("precision", "recall", "f1")}
KP_KEYS = {f"{kind}_{stat}_at_{k}" for kind in ("present", "absent")
           for stat in ("p", "r", "f1") for k in ("5", "M")}


@pytest.mark.parametrize("make_metric, inputs, names", [
    (MultiSpanMatch, {"preds": [["a b"]], "targets": [["a b"]]}, MSM_KEYS),
    (KeyphraseF1, {"preds": [["x"]], "targets": [["x"]], "sources": ["x"]}, KP_KEYS),
    (Rouge, {"preds": [["x"]], "targets": [["x"]]}, {"rouge1", "rouge2", "rougeL", "rougeLsum"}),
], ids=["MultiSpanMatch", "KeyphraseF1", "Rouge"])
def test_output_names_and_types(make_metric, inputs, names):
    metric = make_metric()
    metric.update(**inputs)
    result = metric.compute()
    assert set(result) == names
    for value in result.values():
        assert isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype == torch.float64


@pytest.mark.parametrize("make_metric", [MultiSpanMatch, KeyphraseF1, Rouge],
                         ids=lambda cls: cls.__name__)
def test_states_are_float64_scalars(make_metric):
    # sufficient statistics only (no lists of strings); their summing is tested further below
    metric = make_metric()
    assert metric.metric_state
    for state in metric.metric_state.values():
        assert isinstance(state, torch.Tensor) and state.dtype == torch.float64 and state.dim() == 0


@pytest.mark.parametrize("make_metric, inputs", [
    (MultiSpanMatch, {"preds": [["a"], ["b"]], "targets": [["a"]]}),
    (KeyphraseF1, {"preds": [["a"]], "targets": [["a"]], "sources": ["a", "b", "c"]}),
    (Rouge, {"preds": [["a"]], "targets": [["a"], ["b"]]}),
])
def test_length_mismatch_raises(make_metric, inputs):
    lengths = sorted({len(v) for v in inputs.values()})
    with pytest.raises(ValueError) as error:
        make_metric().update(**inputs)
    for length in lengths:
        assert str(length) in str(error.value)
    assert "preds" in str(error.value) and "targets" in str(error.value)


# ----------------------------------------------------------------------------------------------
# MultiSpanMatch, hand-computed
# ----------------------------------------------------------------------------------------------


def test_normalize_answer():
    assert normalize_answer("  The Quick, brown-fox!  ") == "quick brownfox"
    assert normalize_answer("an Apple a day") == "apple day"
    assert normalize_answer("Anthem theory") == "anthem theory"  # articles only as whole words
    assert normalize_answer("?!.") == ""


def test_msm_exact_match_after_normalisation():
    scores = score(MultiSpanMatch(), preds=[["The Beatles!", "rolling stones"]],
                   targets=[["beatles", "Rolling  Stones", "the who"]])
    assert scores["em_precision"] == pytest.approx(1.0)
    assert scores["em_recall"] == pytest.approx(2 / 3)
    assert scores["em_f1"] == pytest.approx(0.8)


def test_msm_duplicates_count_once():
    scores = score(MultiSpanMatch(), preds=[["Paris", "paris.", "the Paris", "Rome"]],
                   targets=[["Paris", "PARIS"]])
    # pred set {paris, rome}, gold set {paris}
    assert scores["em_precision"] == pytest.approx(0.5)
    assert scores["em_recall"] == pytest.approx(1.0)


def test_msm_micro_average():
    scores = score(MultiSpanMatch(), preds=[["red"], ["blue", "cyan", "pink", "gray"]],
                   targets=[["red", "green", "yellow"], ["blue"]])
    # correct 2, predictions 1 + 4, golds 3 + 1 (a macro average would give P 0.625)
    assert scores["em_precision"] == pytest.approx(2 / 5)
    assert scores["em_recall"] == pytest.approx(2 / 4)
    assert scores["em_f1"] == pytest.approx(2 * 0.4 * 0.5 / 0.9)


@pytest.mark.parametrize("preds", [[], [""], ["", "?!", "The"]], ids=repr)
def test_msm_no_gold_and_no_answer(preds):
    # no gold span and nothing (or only "") predicted: partial match calls it right, exact match
    # gives no credit, as the official script does
    scores = score(MultiSpanMatch(), preds=[preds], targets=[[]])
    assert scores == pytest.approx({**dict.fromkeys(MSM_KEYS, 1.0),
                                    "em_precision": 0.0, "em_recall": 0.0, "em_f1": 0.0})


def test_msm_one_side_empty():
    # (gold empty, pred not) and (gold not, pred empty): each counts 1 gold and 1 prediction
    scores = score(MultiSpanMatch(), preds=[["x y"], ["..."], ["z"]], targets=[[], ["w"], ["z"]])
    for kind in ("em", "pm"):
        assert scores[f"{kind}_precision"] == pytest.approx(1 / 3)
        assert scores[f"{kind}_recall"] == pytest.approx(1 / 3)


def test_msm_empty_prediction_stays_in_the_set():
    # "" and "!" both normalise to "", one element of the pred set {"", "yes"}: 2 predictions, 1
    # of them right; "" overlaps nothing, so it earns no partial credit either
    scores = score(MultiSpanMatch(), preds=[["", "yes", "!"]], targets=[["yes"]])
    expected = {"precision": 1 / 2, "recall": 1.0, "f1": 2 / 3}
    assert scores == pytest.approx({f"{kind}_{stat}": value for kind in ("em", "pm")
                                    for stat, value in expected.items()})


def test_msm_empty_prediction_next_to_a_span_is_not_no_answer():
    # without gold spans, {"", "x"} is a wrong answer of 2 predictions (not the no-answer case):
    # 2 + 1 predictions, 1 + 1 golds, only "z" earns credit
    scores = score(MultiSpanMatch(), preds=[["", "x"], ["z"]], targets=[[], ["z"]])
    for kind in ("em", "pm"):
        assert scores[f"{kind}_precision"] == pytest.approx(1 / 3)
        assert scores[f"{kind}_recall"] == pytest.approx(1 / 2)


def test_msm_gold_that_normalises_to_empty():
    # a gold "The" is the gold set {""}, not an empty one: exact match pairs it with a predicted
    # "", while partial match scores a prediction set of exactly {""} against gold spans as 0
    scores = score(MultiSpanMatch(), preds=[["?"]], targets=[["The"]])
    assert scores == pytest.approx({**dict.fromkeys(MSM_KEYS, 1.0),
                                    "pm_precision": 0.0, "pm_recall": 0.0, "pm_f1": 0.0})
    # both sets {"", "ohio"}: 2 exact matches; in partial match "" earns 0 on either side
    scores = score(MultiSpanMatch(), preds=[["a", "Ohio"]], targets=[["The", "ohio"]])
    assert scores == pytest.approx({**dict.fromkeys(MSM_KEYS, 1.0),
                                    "pm_precision": 0.5, "pm_recall": 0.5, "pm_f1": 0.5})


def test_msm_partial_match_credit():
    scores = score(MultiSpanMatch(), preds=[["York City hall", "Bost"]],
                   targets=[["New York City", "Boston"]])
    # longest common substrings: (new york city, york city hall) 9, (new york city, bost) 1,
    # (boston, york city hall) 1, (boston, bost) 4
    precision = (9 / 14 + 4 / 4) / 2
    recall = (9 / 13 + 4 / 6) / 2
    assert scores["pm_precision"] == pytest.approx(precision)
    assert scores["pm_recall"] == pytest.approx(recall)
    assert scores["pm_f1"] == pytest.approx(2 * precision * recall / (precision + recall))
    assert scores["em_f1"] == 0.0


def test_msm_keeps_difflib_autojunk():
    # For a prediction of 200+ characters difflib treats characters occurring in more than 1% of it
    # as junk; the official script keeps that default. Here the true longest common substring is
    # "ababab", but difflib finds no match.
    scores = score(MultiSpanMatch(), preds=[["x" + "ab" * 100]], targets=[["ababab"]])
    assert scores["pm_precision"] == 0.0 and scores["pm_recall"] == 0.0


def test_msm_no_overlap_scores_zero():
    scores = score(MultiSpanMatch(), preds=[["xyz"]], targets=[["abc"]])
    assert scores == pytest.approx(dict.fromkeys(MSM_KEYS, 0.0))


# ----------------------------------------------------------------------------------------------
# KeyphraseF1, hand-computed
# ----------------------------------------------------------------------------------------------

SOURCE = "Training Neural Networks with deep learning methods . graphs <digit>"


def kp_score(preds, targets, sources=None, **kwargs) -> dict[str, float]:
    sources = sources or [SOURCE] * len(preds)
    return score(KeyphraseF1(**kwargs), preds=preds, targets=targets, sources=sources)


def test_kp_stemming_and_case():
    scores = kp_score([["neural network", "Deep Learnings", "graph"]],
                      [["neural networks", "deep learning", "graphs"]])
    assert scores["present_p_at_M"] == 1.0 and scores["present_r_at_M"] == 1.0
    assert scores["absent_p_at_M"] == 0.0 and scores["absent_r_at_M"] == 0.0


def test_kp_f1_at_5_pads_to_five():
    scores = kp_score([["neural networks", "deep learning"]],
                      [["neural networks", "deep learning"]])
    assert scores["present_p_at_5"] == pytest.approx(0.4)
    assert scores["present_r_at_5"] == pytest.approx(1.0)
    assert scores["present_f1_at_5"] == pytest.approx(2 * 0.4 / 1.4)
    assert scores["present_f1_at_M"] == pytest.approx(1.0)


def test_kp_f1_at_5_keeps_first_five():
    preds = ["training", "methods", "graphs", "learning methods", "networks with",
             "neural networks", "deep learning"]
    scores = kp_score([preds], [["neural networks", "deep learning", "training"]])
    assert scores["present_p_at_5"] == pytest.approx(1 / 5)
    assert scores["present_r_at_5"] == pytest.approx(1 / 3)
    assert scores["present_p_at_M"] == pytest.approx(3 / 7)
    assert scores["present_r_at_M"] == pytest.approx(1.0)


def test_kp_present_absent_split():
    # "neural methods" is not contiguous in the source and "work" is only part of a source token,
    # so both are absent
    scores = kp_score([["neural networks", "neural methods", "graph theory", "quantum", "work"]],
                      [["neural networks", "neural methods", "topology"]])
    assert scores["present_p_at_M"] == 1.0 and scores["present_r_at_M"] == 1.0
    assert scores["absent_p_at_M"] == pytest.approx(1 / 4)
    assert scores["absent_r_at_M"] == pytest.approx(1 / 2)
    assert scores["absent_p_at_5"] == pytest.approx(1 / 5)


def test_kp_invalid_predictions_dropped():
    preds = ["", "<unk> model", "graph , theory", "graph theory .", "graph theory"]
    scores = kp_score([preds], [["graph theory"]])
    assert scores["absent_p_at_M"] == 1.0
    # with another unknown token, "<unk> model" is an ordinary (wrong) absent prediction
    scores = kp_score([preds], [["graph theory"]], unk_token="<oov>")
    assert scores["absent_p_at_M"] == pytest.approx(1 / 2)
    scores = kp_score([["<oov> model", "graph theory"]], [["graph theory"]], unk_token="<oov>")
    assert scores["absent_p_at_M"] == 1.0


def test_kp_tokens_with_punctuation_attached_are_valid():
    # only the tokens "," and "." invalidate; "networks," is a (wrong) token of its own
    scores = kp_score([["neural networks,", "graph theory"]], [["graph theory"]])
    assert scores["absent_p_at_M"] == pytest.approx(1 / 2)


def test_kp_duplicates_dropped():
    preds = ["neural networks", "Neural Network", "neural networks", "deep learning"]
    scores = kp_score([preds], [["neural network", "neural networks"]])
    assert scores["present_p_at_M"] == pytest.approx(1 / 2)
    assert scores["present_r_at_M"] == pytest.approx(1.0)
    assert scores["present_p_at_5"] == pytest.approx(1 / 5)


def test_kp_empty_predictions_and_targets():
    scores = kp_score([[], ["neural networks"], []], [["neural networks"], [], []])
    assert scores == pytest.approx(dict.fromkeys(KP_KEYS, 0.0))


def test_kp_macro_average_over_all_documents():
    # doc 1: present P@M 1, R@M 1/2; doc 2: present P@M 1/2, R@M 1; doc 3: no present anything
    scores = kp_score(
        [["neural networks"], ["deep learning", "learning methods"], ["quantum"]],
        [["neural networks", "deep learning"], ["deep learning"], ["topology"]])
    precision, recall = (1 + 1 / 2 + 0) / 3, (1 / 2 + 1 + 0) / 3
    assert scores["present_p_at_M"] == pytest.approx(precision)
    assert scores["present_r_at_M"] == pytest.approx(recall)
    # F1 of the averages, not the average of per-document F1s (which would be 4/9)
    assert scores["present_f1_at_M"] == pytest.approx(2 * precision * recall / (precision + recall))
    assert scores["absent_p_at_M"] == 0.0 and scores["absent_r_at_M"] == 0.0


# ----------------------------------------------------------------------------------------------
# Rouge
# ----------------------------------------------------------------------------------------------


def test_rouge_identical_and_disjoint():
    assert score(Rouge(), preds=[["The cat sat .", "It purred ."]],
                 targets=[["The cat sat .", "It purred ."]]) == pytest.approx(
        dict.fromkeys(["rouge1", "rouge2", "rougeL", "rougeLsum"], 1.0))
    assert score(Rouge(), preds=[["alpha beta"]], targets=[["gamma delta"]]) == pytest.approx(
        dict.fromkeys(["rouge1", "rouge2", "rougeL", "rougeLsum"], 0.0))


def test_rouge_hand_computed():
    scores = score(Rouge(), preds=[["the cat sat"], ["cats running"]],
                   targets=[["the cat ran"], ["cat runs"]])
    # example 1: unigrams 2/3, bigrams 1/2, LCS 2/3; example 2 matches fully after stemming
    assert scores["rouge1"] == pytest.approx((2 / 3 + 1) / 2)
    assert scores["rouge2"] == pytest.approx((1 / 2 + 1) / 2)
    assert scores["rougeL"] == pytest.approx((2 / 3 + 1) / 2)


def test_rouge_lsum_uses_sentences():
    scores = score(Rouge(), preds=[["red green", "blue pink"]],
                   targets=[["blue pink", "red green"]])
    assert scores["rougeL"] == pytest.approx(0.5)  # LCS of the joined texts: 2 of 4 tokens
    assert scores["rougeLsum"] == pytest.approx(1.0)  # every target sentence is found


def test_rouge_matches_rouge_score_on_cnndm():
    rows = read_jsonl("cnndm")[:6]
    preds = [row["document"].split(" . ")[:3] for row in rows]
    targets = [row["summary"] for row in rows]
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=True)
    expected = {}
    for rouge_type in ("rouge1", "rouge2", "rougeL", "rougeLsum"):
        sep = "\n" if rouge_type == "rougeLsum" else " "
        expected[rouge_type] = np.mean([scorer.score(sep.join(t), sep.join(p))[rouge_type].fmeasure
                                        for p, t in zip(preds, targets)])
    scores = score(Rouge(), preds=preds, targets=targets)
    assert scores == pytest.approx(expected, abs=1e-12)
    assert 0.05 < scores["rouge2"] < scores["rouge1"] < 0.9


# ----------------------------------------------------------------------------------------------
# DDP-style reduction: states of shards sum to the state of the whole
# ----------------------------------------------------------------------------------------------

DDP_CASES = [
    (MultiSpanMatch, {
        "preds": [["The Beatles", "who"], [], ["York City"], ["x"], ["red", "blue"]],
        "targets": [["beatles"], [], ["New York City", "Boston"], [], ["blue", "green", "pink"]]}),
    (KeyphraseF1, {
        "preds": [["neural networks", "graph"], [], ["deep learning", "topology", "x"],
                  ["quantum", "training"], ["methods"]],
        "targets": [["neural network", "topology"], ["graph"], ["topology"], ["quantum"], []],
        "sources": [SOURCE] * 5}),
    (Rouge, {
        "preds": [["the cat sat"], ["a b c", "d e"], ["x"], ["cats running"], ["one two"]],
        "targets": [["the cat ran"], ["a b", "c d e"], ["y"], ["cat runs"], ["two one"]]}),
]


@pytest.mark.parametrize("make_metric, inputs", DDP_CASES, ids=[c[0].__name__ for c in DDP_CASES])
def test_sharded_states_merge_to_whole(make_metric, inputs):
    whole = make_metric()
    whole.update(**inputs)
    shards = [make_metric(), make_metric()]
    for rank, shard in enumerate(shards):  # DistributedSampler-style interleaving
        shard.update(**{name: value[rank::2] for name, value in inputs.items()})
    manual = {name: shards[0].metric_state[name] + shards[1].metric_state[name]
              for name in whole.metric_state}
    shards[0].merge_state(shards[1])
    assert values(shards[0]) == pytest.approx(values(whole), abs=1e-12)
    for name, state in whole.metric_state.items():
        assert manual[name].item() == pytest.approx(state.item(), abs=1e-12)
    # the test is only meaningful if the shards differ from the whole
    assert values(shards[1]) != pytest.approx(values(whole), abs=1e-6)


# ----------------------------------------------------------------------------------------------
# Real data against independent reimplementations of the reference scorers
# ----------------------------------------------------------------------------------------------


def official_normalize(s: str) -> str:
    """normalize_answer of the official script: lowercase, drop punctuation, then articles, then
    extra whitespace."""
    s = s.lower().translate(str.maketrans("", "", string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s, flags=re.UNICODE)
    return " ".join(s.split())


def reference_multispanqa(preds: list[list[str]], golds: list[list[str]]) -> dict[str, float]:
    """The official MultiSpanQA evaluation (haonan-li/MultiSpanQA, src/eval_script.py at commit
    6d48f8c: multi_span_evaluate, compute_scores, count_overlap), transcribed independently:
    normalised spans compared as sets with "" kept as an element, micro-averaged."""
    nb_gold = nb_pred = nb_correct = credit_p = credit_r = 0.0
    for pred_list, gold_list in zip(preds, golds):
        gold = {official_normalize(g) for g in gold_list}
        pred = {official_normalize(p) for p in pred_list}
        nb_gold += max(len(gold), 1)
        nb_pred += max(len(pred), 1)
        nb_correct += len(gold.intersection(pred))
        if len(gold) == 0 and (len(pred) == 0 or pred == {""}):  # correct no-answer
            credit_p += 1
            credit_r += 1
            continue
        if len(gold) == 0 or len(pred) == 0 or pred == {""}:  # incorrect no-answer
            continue
        gold_spans, pred_spans = list(gold), list(pred)
        p_scores = np.zeros((len(gold_spans), len(pred_spans)))
        r_scores = np.zeros((len(gold_spans), len(pred_spans)))
        for i, g in enumerate(gold_spans):
            for j, p in enumerate(pred_spans):
                matcher = difflib.SequenceMatcher(None, g, p)
                _, _, longest = matcher.find_longest_match(0, len(g), 0, len(p))
                p_scores[i, j] = longest / len(p) if longest > 0 else 0
                r_scores[i, j] = longest / len(g) if longest > 0 else 0
        credit_p += p_scores.max(axis=0).sum()
        credit_r += r_scores.max(axis=1).sum()

    def prf(correct_p, correct_r):
        p = correct_p / nb_pred if nb_pred > 0 else 0.0
        r = correct_r / nb_gold if nb_gold > 0 else 0.0
        return p, r, (2 * p * r / (p + r) if p + r > 0 else 0.0)

    result = {}
    for kind, (p, r, f) in (("em", prf(nb_correct, nb_correct)), ("pm", prf(credit_p, credit_r))):
        result.update({f"{kind}_precision": p, f"{kind}_recall": r, f"{kind}_f1": f})
    return result


def perturb_spans(rng: random.Random, answers: list[str], context: str) -> list[str]:
    words = context.split()

    def context_span(max_len: int) -> str:
        start = rng.randrange(len(words))
        return " ".join(words[start:start + rng.randint(1, max_len)])

    preds = [a for a in answers if rng.random() < 0.7]
    for i, answer in enumerate(preds):
        tokens = answer.split()
        choice = rng.random()
        if choice < 0.15:
            preds[i] = "The " + answer.upper() + " ."
        elif choice < 0.3 and len(tokens) > 1:
            preds[i] = " ".join(tokens[1:] if rng.random() < 0.5 else tokens[:-1])
        elif choice < 0.45:
            preds[i] = answer + " " + rng.choice(words)
    preds += [context_span(5) for _ in range(rng.randint(0, 3))]
    if rng.random() < 0.1:
        preds.append(context_span(60))  # long span: difflib's autojunk applies
    if rng.random() < 0.25:
        preds.append(rng.choice(["", "?", "the"]))  # normalises to ""
    if rng.random() < 0.1:
        preds = []
    preds += preds[:1]  # a repeated span
    rng.shuffle(preds)
    return preds


def test_multispanmatch_matches_reference_on_multispanqa():
    rows = read_jsonl("multispanqa")
    rng = random.Random(1234)
    preds, golds = [], []
    for i, row in enumerate(rows):
        preds.append(perturb_spans(rng, row["answers"], row["context"]))
        # a few unanswerable examples, and a few with a gold span that normalises to ""
        golds.append([] if i % 13 == 0 else row["answers"] + (["The"] if i % 11 == 1 else []))
    preds[0], preds[13] = [], ["", "?"]  # unanswerable and answered as such, two ways
    # the empty cases on which the official script differs from dropping "" all occur
    pred_sets = [{official_normalize(p) for p in ps} for ps in preds]
    gold_sets = [{official_normalize(g) for g in gs} for gs in golds]
    assert sum("" in pred and len(pred) > 1 for pred in pred_sets) >= 5
    assert sum(not gold and pred <= {""} for gold, pred in zip(gold_sets, pred_sets)) >= 2
    assert sum("" in gold for gold in gold_sets) >= 3
    expected = reference_multispanqa(preds, golds)
    assert 0.1 < expected["em_f1"] < expected["pm_f1"] < 0.95
    metric = MultiSpanMatch()
    for start in range(0, len(rows), 8):  # several batches
        metric.update(preds=preds[start:start + 8], targets=golds[start:start + 8])
    assert values(metric) == pytest.approx(expected, abs=1e-9, rel=0)


def reference_keyphrase(preds, targets, sources) -> dict[str, float]:
    """Per-document loops after Chan et al.'s evaluate_prediction.py (invalidate_unk, no one-word
    filter, F1@5 with precision over 5), written independently."""
    stemmer = PorterStemmer()
    stems: dict[str, str] = {}

    def stem_words(text: str) -> list[str]:
        out = []
        for w in text.split():
            if w not in stems:
                stems[w] = stemmer.stem(w.strip().lower())
            out.append(stems[w])
        return out

    def occurs(words: list[str], src: list[str]) -> bool:
        if not words:
            return False
        n = len(words)
        return any(src[s:s + n] == words for s in range(len(src) - n + 1))

    sums = {(kind, stat, k): 0.0
            for kind in ("present", "absent") for stat in "pr" for k in (5, "M")}
    for pred_list, trg_list, src_text in zip(preds, targets, sources):
        src = stem_words(src_text)
        stemmed_preds = [stem_words(p) for p in pred_list]
        seen: set[str] = set()
        kept = []
        for words in stemmed_preds:  # uniqueness over all predictions, then validity
            key = " ".join(words)
            is_unique = key not in seen
            seen.add(key)
            is_valid = len(words) > 0 and all(w not in (",", ".", "<unk>") for w in words)
            if is_unique and is_valid:
                kept.append(words)
        trgs, trg_seen = [], set()
        for words in map(stem_words, trg_list):
            if " ".join(words) not in trg_seen:
                trg_seen.add(" ".join(words))
                trgs.append(words)
        for kind in ("present", "absent"):
            want = kind == "present"
            kind_preds = [w for w in kept if occurs(w, src) == want]
            kind_trgs = [" ".join(w) for w in trgs if occurs(w, src) == want]
            is_match = np.array([" ".join(w) in kind_trgs for w in kind_preds], dtype=bool)
            for k in (5, "M"):
                if len(kind_preds) == 0:
                    p = r = 0.0
                else:
                    top = len(kind_preds) if k == "M" else k
                    cum = np.cumsum(is_match)
                    n_match = cum[top - 1] if len(kind_preds) > top else cum[-1]
                    p = n_match / top
                    r = n_match / len(kind_trgs) if kind_trgs else 0.0
                sums[kind, "p", k] += p
                sums[kind, "r", k] += r
    result = {}
    n_docs = len(preds)
    for kind in ("present", "absent"):
        for k in (5, "M"):
            p, r = sums[kind, "p", k] / n_docs, sums[kind, "r", k] / n_docs
            result[f"{kind}_p_at_{k}"] = p
            result[f"{kind}_r_at_{k}"] = r
            result[f"{kind}_f1_at_{k}"] = 2 * p * r / (p + r) if p + r > 0 else 0.0
    return result


def perturb_keyphrases(rng: random.Random, keyphrases: list[str], source: str) -> list[str]:
    words = source.split()
    preds = [kp for kp in keyphrases if rng.random() < 0.6]
    for i, kp in enumerate(preds):
        choice = rng.random()
        if choice < 0.15:
            preds[i] = kp + "s"  # plural or a wrong word
        elif choice < 0.25:
            preds[i] = kp.upper()
    for _ in range(rng.randint(0, 8)):
        start = rng.randrange(len(words))
        preds.append(" ".join(words[start:start + rng.randint(1, 3)]))  # may hold "," or "."
    for _ in range(rng.randint(0, 3)):
        preds.append(" ".join(rng.sample(words, rng.randint(1, 3))))  # mostly absent, wrong
    if rng.random() < 0.2:
        preds.append(rng.choice(["", "<unk> " + rng.choice(words), "a , b"]))
    if preds and rng.random() < 0.3:
        preds.append(rng.choice(preds))  # a duplicate
    rng.shuffle(preds)
    return [] if rng.random() < 0.05 else preds


def test_keyphrasef1_matches_reference_on_kp20k():
    rows = read_jsonl("kp20k")
    rng = random.Random(2021)
    sources = [row["title"] + " " + row["abstract"] for row in rows]
    targets = [row["keyphrases"] + (row["keyphrases"][:1] if i % 7 == 0 else [])
               for i, row in enumerate(rows)]
    preds = [perturb_keyphrases(rng, row["keyphrases"], src) for row, src in zip(rows, sources)]
    expected = reference_keyphrase(preds, targets, sources)
    for kind in ("present", "absent"):  # a mix of hits and misses, where the cutoff matters
        assert 0.1 < expected[f"{kind}_f1_at_5"] < 0.9 and 0.1 < expected[f"{kind}_f1_at_M"] < 0.9
        assert expected[f"{kind}_f1_at_5"] != pytest.approx(expected[f"{kind}_f1_at_M"])
    metric = KeyphraseF1()
    for start in range(0, len(rows), 64):
        metric.update(preds=preds[start:start + 64], targets=targets[start:start + 64],
                      sources=sources[start:start + 64])
    assert values(metric) == pytest.approx(expected, abs=1e-9, rel=0)
