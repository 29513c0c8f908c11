"""Task metrics for multi-span QA, keyphrase generation and summarisation.

Each metric is a ``torchmetrics.Metric`` whose state is a handful of *sufficient statistics*:
0-d float64 tensors (counts, and sums of per-example scores) registered with
``dist_reduce_fx="sum"``. Every score is computed on the process that holds the example, in
``update``, and only these sums cross process boundaries. Under DDP, torchmetrics sums the
states of all processes before ``compute``, and because every final number is a ratio of such
sums (micro averages divide summed credits by summed counts, macro averages divide summed
per-document scores by the summed document count), the result is the same as scoring the whole
dataset on one process. No strings are gathered, so synchronisation costs a few scalars
whatever the dataset size. float64 keeps the sums exact enough to reproduce the reference
scripts to the printed digit.

``compute`` returns a dict of metric name -> 0-d float64 tensor with values in [0, 1]. Names use
``_at_`` instead of ``@`` because MLflow rejects ``@`` in metric names.
"""
from __future__ import annotations

import difflib
import functools
import re
import string
from typing import Mapping, Sequence

import torch
from nltk.stem import PorterStemmer
from rouge_score import rouge_scorer
from torch import Tensor
from torchmetrics import Metric

_STEMMER = PorterStemmer()
_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def _check_same_length(**arguments: Sequence) -> None:
    """Raise a ValueError unless every argument holds one item per example."""
    lengths = {name: len(value) for name, value in arguments.items()}
    if len(set(lengths.values())) > 1:
        detail = ", ".join(f"{name} has {length}" for name, length in lengths.items())
        raise ValueError(f"Expected one item per example in each argument, but {detail}.")


def _add_sum_states(metric: Metric, *names: str) -> None:
    """Register 0-d float64 states that are summed across processes."""
    for name in names:
        metric.add_state(name, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")


def _ratio(numerator, denominator):
    """numerator / denominator, or 0 when the denominator is 0 (for numbers and 0-d tensors)."""
    return numerator / denominator if denominator > 0 else numerator * 0.0


def _harmonic_mean(precision: Tensor, recall: Tensor) -> Tensor:
    """F1 from precision and recall, 0 when both are 0."""
    return _ratio(2 * precision * recall, precision + recall)


# ----------------------------------------------------------------------------------------------
# MultiSpanQA
# ----------------------------------------------------------------------------------------------


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, drop punctuation and articles (a/an/the), collapse spaces."""
    text = "".join(char for char in text.lower() if char not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _longest_common_substring(gold: str, pred: str) -> int:
    """Length of the longest common substring as difflib finds it (autojunk left at its default:
    in a prediction of 200+ characters, characters making up over 1% of it cannot start a match)."""
    matcher = difflib.SequenceMatcher(None, gold, pred)
    return matcher.find_longest_match(0, len(gold), 0, len(pred)).size


def _partial_match_credit(gold: set[str], pred: set[str]) -> tuple[float, float]:
    """(precision credit, recall credit) of one example for the partial-match scores.

    Every pred earns its best overlap with a gold, as a fraction of the pred's length; every gold
    earns its best overlap with a pred, as a fraction of the gold's length. An empty string
    overlaps nothing, so it earns 0 (and its length is never divided by).
    """
    # The script's no-answer rule, which reads "" as "no answer" here (and only here): with no gold
    # span, predicting nothing or only "" is right; with gold spans, it is wrong.
    if not gold:
        return (1.0, 1.0) if pred <= {""} else (0.0, 0.0)
    if pred <= {""}:
        return 0.0, 0.0
    overlap = {(g, p): _longest_common_substring(g, p) for g in gold for p in pred}
    precision = sum(max(_ratio(overlap[g, p], len(p)) for g in gold) for p in pred)
    recall = sum(max(_ratio(overlap[g, p], len(g)) for p in pred) for g in gold)
    return precision, recall


class MultiSpanMatch(Metric):
    """Exact- and partial-match precision, recall and F1 over sets of answer spans.

    Reproduces the official MultiSpanQA evaluation (Li et al., 2022, "MultiSpanQA: A Dataset for
    Multi-Span Question Answering", ``src/eval_script.py`` of haonan-li/MultiSpanQA as published,
    commit 6d48f8c), empty cases included. Answers are normalised SQuAD-style and compared as sets
    per example. A span that normalises to "" (e.g. "", "?", "the") stays in its set as an
    element of its own: it counts as a prediction (or gold span) and matches only another "".
    Scores are micro-averaged: an example contributes max(|gold|, 1) to the gold count and
    max(|pred|, 1) to the prediction count.

    * Exact match (``em_*``): credit is |gold ∩ pred|. An example with neither gold nor predicted
      spans therefore earns nothing; the upstream script's later revisions (from commit 9262ee2)
      give it 1, the version followed here does not.
    * Partial match (``pm_*``): each pair is scored by the longest common character substring
      (``difflib.SequenceMatcher.find_longest_match``) divided by the prediction's length
      (precision) or the gold's length (recall); each prediction earns its best precision score
      over golds and each gold its best recall score over predictions. An example with no gold
      span earns 1 of each when the prediction set is empty or exactly {""}, else 0; an example
      with gold spans and a prediction set that is empty or exactly {""} earns 0.

    ``update(preds, targets)`` takes, per example, a list of predicted spans and a list of gold
    spans.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        _add_sum_states(self, "n_gold", "n_pred", "em_credit",
                        "pm_precision_credit", "pm_recall_credit")

    def update(self, preds: Sequence[Sequence[str]], targets: Sequence[Sequence[str]]) -> None:
        _check_same_length(preds=preds, targets=targets)
        for pred_spans, gold_spans in zip(preds, targets):
            pred = {normalize_answer(span) for span in pred_spans}
            gold = {normalize_answer(span) for span in gold_spans}
            self.n_gold += max(len(gold), 1)
            self.n_pred += max(len(pred), 1)
            self.em_credit += len(gold & pred)
            precision_credit, recall_credit = _partial_match_credit(gold, pred)
            self.pm_precision_credit += precision_credit
            self.pm_recall_credit += recall_credit

    def compute(self) -> dict[str, Tensor]:
        scores = {}
        for prefix, precision_credit, recall_credit in (
            ("em", self.em_credit, self.em_credit),
            ("pm", self.pm_precision_credit, self.pm_recall_credit),
        ):
            precision = _ratio(precision_credit, self.n_pred)
            recall = _ratio(recall_credit, self.n_gold)
            scores[f"{prefix}_precision"] = precision
            scores[f"{prefix}_recall"] = recall
            scores[f"{prefix}_f1"] = _harmonic_mean(precision, recall)
        return scores


# ----------------------------------------------------------------------------------------------
# Keyphrase generation
# ----------------------------------------------------------------------------------------------

Phrase = tuple[str, ...]


@functools.cache
def _stem(word: str) -> str:
    return _STEMMER.stem(word.lower())


def _stem_phrase(text: str) -> Phrase:
    """Whitespace tokens of ``text``, lowercased and Porter-stemmed."""
    return tuple(_stem(word) for word in text.split())


def _unique(phrases: Sequence[Phrase]) -> list[Phrase]:
    """``phrases`` without repeats, first occurrences kept in order."""
    return list(dict.fromkeys(phrases))


def _is_present(phrase: Phrase, padded_source: str) -> bool:
    """Whether ``phrase`` occurs as contiguous tokens of the source.

    ``padded_source`` is the stemmed source tokens joined by single spaces, with a space on either
    side. Tokens contain no whitespace, so a substring search on the space-padded phrase is a
    token-boundary match. An empty phrase is never present (as in the reference scorer).
    """
    return bool(phrase) and f" {' '.join(phrase)} " in padded_source


def _target_forms(targets: set[Phrase],
                  aliases: Mapping[str, Sequence[str]]) -> dict[Phrase, set[Phrase]]:
    """Each stemmed target with its stemmed aliases; aliases of a text that is not a target are
    unused."""
    forms = {target: {target} for target in targets}
    for text, others in aliases.items():
        target = _stem_phrase(text)
        if target in forms:
            forms[target].update(_stem_phrase(other) for other in others)
    return forms


class KeyphraseF1(Metric):
    """Macro-averaged F1@5 and F1@M for present and absent keyphrases.

    Reproduces the scorer of Chan et al. (2019, "Neural Keyphrase Generation via Reinforcement
    Learning with Adaptive Rewards", ``evaluate_prediction.py`` of
    kenchan0226/keyphrase-generation-rl) in the setting used by Chen et al. (2020, ExHiRD) and
    Ye et al. (2021, One2Set, jiacheng-ye/kg_one2set): ``-invalidate_unk``,
    ``-disable_extra_one_word_filter``, padded F1@5 (precision always divided by 5).

    Tokens are whitespace-split, lowercased and Porter-stemmed. Predictions that are empty or
    contain ``","``, ``"."`` or ``unk_token`` are dropped, then repeated predictions and targets
    (same stemmed tokens) are dropped keeping the first. A phrase is *present* when its stemmed
    tokens occur contiguously in the stemmed source (title + abstract), else *absent*; predictions
    and targets are split that way. Per document and kind, a prediction matches when it equals a
    target; precision@5 = matches among the first 5 / 5, precision@M = matches / predictions,
    recall = matches / targets (0 when the denominator is 0). Precisions and recalls are averaged
    over all documents and F1 is the harmonic mean of the two averages.

    ``update(preds, targets, sources)`` takes, per document, the ranked predicted keyphrases, the
    gold keyphrases and the source text (title and abstract joined by a space).

    Aliases (KPTimes, whose gold keyphrases may have several forms, "republican national
    convention" / "rnc"): the optional ``aliases`` gives, per document, a mapping from a target to
    its other forms. As in KPTimes' evaluation, a prediction equal (stemmed) to any form of a target
    matches that target; it then stands for the target, so a second prediction of the same target
    in another form is a repeat and dropped. A target is present when any of its forms occurs in
    the source (an extractor could copy it from there). Without aliases, scores are those of the
    reference scorer.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    KINDS = ("present", "absent")
    CUTOFFS = {"5": 5, "M": None}  # name -> number of predictions kept (None: all)

    def __init__(self, unk_token: str = "<unk>", **kwargs) -> None:
        super().__init__(**kwargs)
        # Validity is checked on stemmed tokens, as the reference does; stemming keeps "," and ".".
        self.invalid_tokens = frozenset({",", ".", _stem(unk_token)})
        sums = [f"{kind}_{stat}_sum_at_{cutoff}"
                for kind in self.KINDS for stat in ("p", "r") for cutoff in self.CUTOFFS]
        _add_sum_states(self, "n_docs", *sums)

    def update(self, preds: Sequence[Sequence[str]], targets: Sequence[Sequence[str]],
               sources: Sequence[str],
               aliases: Sequence[Mapping[str, Sequence[str]]] | None = None) -> None:
        if aliases is None:
            aliases = [{}] * len(targets)
        _check_same_length(preds=preds, targets=targets, sources=sources, aliases=aliases)
        for pred_phrases, target_phrases, source, target_aliases in zip(preds, targets, sources,
                                                                         aliases):
            padded_source = f" {' '.join(_stem_phrase(source))} "
            unique_targets = {_stem_phrase(text) for text in target_phrases}
            forms = _target_forms(unique_targets, target_aliases)
            target_of = {form: target for target in unique_targets for form in forms[target]}
            target_of.update((target, target) for target in unique_targets)  # a target is itself

            def is_present(phrase: Phrase) -> bool:
                return any(_is_present(form, padded_source)
                           for form in forms.get(phrase, (phrase,)))

            stemmed_preds = [_stem_phrase(text) for text in pred_phrases]
            valid_preds = _unique([target_of.get(p, p) for p in stemmed_preds
                                   if p and self.invalid_tokens.isdisjoint(p)])
            for kind in self.KINDS:
                wanted = kind == "present"
                kind_preds = [p for p in valid_preds if is_present(p) == wanted]
                kind_targets = {t for t in unique_targets if is_present(t) == wanted}
                is_match = [p in kind_targets for p in kind_preds]
                for cutoff, k in self.CUTOFFS.items():
                    matches = sum(is_match[:k])
                    n_predictions = len(kind_preds) if k is None else k
                    precision = _ratio(matches, n_predictions)
                    getattr(self, f"{kind}_p_sum_at_{cutoff}").add_(precision)
                    recall = _ratio(matches, len(kind_targets))
                    getattr(self, f"{kind}_r_sum_at_{cutoff}").add_(recall)
            self.n_docs += 1

    def compute(self) -> dict[str, Tensor]:
        scores = {}
        for kind in self.KINDS:
            for cutoff in self.CUTOFFS:
                precision = _ratio(getattr(self, f"{kind}_p_sum_at_{cutoff}"), self.n_docs)
                recall = _ratio(getattr(self, f"{kind}_r_sum_at_{cutoff}"), self.n_docs)
                scores[f"{kind}_p_at_{cutoff}"] = precision
                scores[f"{kind}_r_at_{cutoff}"] = recall
                scores[f"{kind}_f1_at_{cutoff}"] = _harmonic_mean(precision, recall)
        return scores


# ----------------------------------------------------------------------------------------------
# Summarisation
# ----------------------------------------------------------------------------------------------


class Rouge(Metric):
    """Mean per-example ROUGE-1/2/L/Lsum F-measure, as computed by Google's ``rouge-score`` package.

    ``rouge_scorer.RougeScorer(..., use_stemmer=True)`` scores each example; ``rougeLsum`` (Lin's
    2004 summary-level LCS, which splits the text into sentences at newlines) sees the sentences
    joined by newlines, the other types see them joined by spaces. The F-measures are averaged
    over examples, as in the Hugging Face summarisation scripts.

    ``update(preds, targets)`` takes, per example, the predicted and the reference summary as
    lists of sentences.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.text_scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"],
                                                    use_stemmer=True)
        self.summary_scorer = rouge_scorer.RougeScorer(["rougeLsum"], use_stemmer=True)
        _add_sum_states(self, "n_examples", *(f"{rouge_type}_sum" for rouge_type in self.TYPES))

    def update(self, preds: Sequence[Sequence[str]], targets: Sequence[Sequence[str]]) -> None:
        _check_same_length(preds=preds, targets=targets)
        for pred_sentences, target_sentences in zip(preds, targets):
            scores = self.text_scorer.score(" ".join(target_sentences), " ".join(pred_sentences))
            scores |= self.summary_scorer.score("\n".join(target_sentences),
                                                "\n".join(pred_sentences))
            for rouge_type in self.TYPES:
                getattr(self, f"{rouge_type}_sum").add_(scores[rouge_type].fmeasure)
            self.n_examples += 1

    def compute(self) -> dict[str, Tensor]:
        return {rouge_type: _ratio(getattr(self, f"{rouge_type}_sum"), self.n_examples)
                for rouge_type in self.TYPES}
