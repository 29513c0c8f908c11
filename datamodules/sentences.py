"""An offline, rule-based sentence splitter.

NLTK's punkt model has to be downloaded, which this library cannot count on, so summaries and answers are cut
into sentences with a handful of rules that are good enough for news highlights (CNN/DM), scientific abstracts
(PubMed) and WikiHow answers:

1. A newline always ends a sentence.
2. Inside a line, a sentence can end after a run of `.`, `!` or `?`, optionally followed by closing quotes or
   brackets, when whitespace follows and the next text starts with an uppercase letter, a digit, or an opening
   quote or bracket ("It rained. We left." -> two sentences; "It rained. then" stays one).
3. Pre-tokenized text, where the mark is a token of its own ("it was sunny . he left ."), is detected per mark,
   with no parameter: a mark with whitespace on both sides also ends a sentence before a lowercase word, which is
   how the lowercased CNN/DM (See et al.) and PubMed (Cohan et al.) releases write sentence ends.
4. A single `.` does not end a sentence when it closes an abbreviation: a known one (Mr., Dr., etc., e.g.,
   Fig., Jan., et al. ...; see _ABBREVIATIONS), a single capital initial ("J. K. Rowling"), or a dotted acronym
   ("U.S.", "i.e.", "a.m."). This holds for tokenized text too ("et al . (2010)", "fig . 2").
   Decimals such as 3.5 never split, since no whitespace follows the point.

Known limits: lowercased text that is not tokenized ("it rained. we left.") is not split, and a sentence that
really ends with an abbreviation ("... and so on, etc. Then ...") is joined to the next one.
"""
from __future__ import annotations

import re

# A candidate sentence end: the marks, closing quotes/brackets that belong to the sentence, then whitespace and
# the first character of what follows (captured, not consumed).
_CANDIDATE = re.compile(r"(?P<marks>[.!?]+)[\"'”’)\]}]*(?=\s+(?P<next>\S))")
_OPENERS = "\"'“‘([{"
_LAST_WORD = re.compile(r"(\S+)\s*$")
_DOTTED_ACRONYM = re.compile(r"[A-Za-z](?:\.[A-Za-z])+")

# Abbreviations that end in a period but rarely end a sentence, compared in lowercase. "May" is left out on
# purpose: the month is not abbreviated and often ends a sentence.
_ABBREVIATIONS = frozenset("""
    mr mrs ms dr prof rev gen sen rep gov st mt jr sr
    fig figs eq eqs vol vols pp p approx cf vs etc al
    inc ltd co corp dept univ
    jan feb mar apr jun jul aug sep sept oct nov dec
""".split())
# Compared as written: "No. 5" is an abbreviation, but "no." often ends a sentence in lowercased text.
_CASED_ABBREVIATIONS = frozenset({"No", "Nos"})


def split_sentences(text: str) -> list[str]:
    """Split `text` into sentences (rules in the module docstring), each whitespace-collapsed; no empty ones."""
    sentences = []
    for line in text.splitlines():
        start = 0
        for candidate in _CANDIDATE.finditer(line):
            if _ends_sentence(line, candidate):
                sentences.append(line[start:candidate.end()])
                start = candidate.end()
        sentences.append(line[start:])
    return [sentence for sentence in (" ".join(s.split()) for s in sentences) if sentence]


def _ends_sentence(line: str, candidate: re.Match) -> bool:
    next_char = candidate.group("next")
    standalone = candidate.start() > 0 and line[candidate.start() - 1].isspace()
    starts_sentence = (next_char.isupper() or next_char.isdigit() or next_char in _OPENERS
                       or (standalone and next_char.islower()))
    if not starts_sentence:
        return False
    if candidate.group("marks") != ".":
        return True
    # The word the period closes: the token it is attached to, or the previous token when it stands alone.
    last_word = _LAST_WORD.search(line, max(0, candidate.start() - 40), candidate.start())
    return last_word is None or not _is_abbreviation(last_word.group(1).lstrip(_OPENERS))


def _is_abbreviation(word: str) -> bool:
    return (word.lower() in _ABBREVIATIONS or word in _CASED_ABBREVIATIONS
            or (len(word) == 1 and word.isupper())          # an initial: "J. K. Rowling"
            or _DOTTED_ACRONYM.fullmatch(word) is not None)  # "U.S", "e.g", "a.m" (the last period is the mark)
