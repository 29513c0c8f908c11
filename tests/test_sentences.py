"""The offline sentence splitter, one group of hand-made cases per rule."""
import pytest

from datamodules.sentences import split_sentences


@pytest.mark.parametrize("text, expected", [
    # Terminal marks before an uppercase start, runs of marks included.
    ("It rained. We stayed in! Did you? Yes.", ["It rained.", "We stayed in!", "Did you?", "Yes."]),
    ("Really?! Yes.", ["Really?!", "Yes."]),
    # Closing quotes and brackets stay with their sentence.
    ('He said "Stop." Then he left.', ['He said "Stop."', "Then he left."]),
    ("(It works.) Next one.", ["(It works.)", "Next one."]),
    # A digit, an opening quote or an opening bracket also starts a sentence.
    ("The test ran in 2010. 25 people came.", ["The test ran in 2010.", "25 people came."]),
    ('He left. "Why?" she asked.', ["He left.", '"Why?" she asked.']),
    ("It held. (See below.)", ["It held.", "(See below.)"]),
])
def test_splits_after_terminal_marks(text, expected):
    assert split_sentences(text) == expected


@pytest.mark.parametrize("text", [
    "He sat down. and then he left.",   # lowercase start, mark attached to its word
    '"Why?" he asked.',                 # a question quoted inside a sentence
    "it was sunny. he left.",           # lowercased but not tokenized: a documented limit
])
def test_no_split_before_lowercase_word(text):
    assert split_sentences(text) == [text]


@pytest.mark.parametrize("text", [
    "Mr. Smith met Dr. Jones at St. Paul's on Jan. 5 with Mrs. Brown.",
    "See Fig. 3 and No. 7 here.",
    "Prices rose vs. 2019, e.g. Rents, i.e. Housing, etc. Mostly.",
    "The U.S. Army arrived at 5 p.m. Monday.",
    "J. K. Rowling wrote it.",
    "It grew 3.5 percent and 0.25 more.",
])
def test_no_split_after_abbreviations_initials_or_in_decimals(text):
    assert split_sentences(text) == [text]


def test_abbreviation_list_does_not_swallow_real_ends():
    assert split_sentences("It happened in May. Then it rained. He said no. We left.") == [
        "It happened in May.", "Then it rained.", "He said no.", "We left."]
    assert split_sentences("J. K. Rowling wrote it. She is British.") == [
        "J. K. Rowling wrote it.", "She is British."]


def test_newlines_always_split():
    highlights = ("Harry Potter star gets fortune as he turns 18 Monday .\n"
                  "Young actor says he has no plans to fritter his cash away .")
    assert split_sentences(highlights) == [
        "Harry Potter star gets fortune as he turns 18 Monday .",
        "Young actor says he has no plans to fritter his cash away ."]
    assert split_sentences("first line without a period\nsecond line") == [
        "first line without a period", "second line"]


def test_whitespace_collapsed_and_empty_sentences_dropped():
    assert split_sentences("  Lots   of \t space.   Here  ") == ["Lots of space.", "Here"]
    assert split_sentences("One.\n\n   \nTwo.") == ["One.", "Two."]
    assert split_sentences("") == []
    assert split_sentences(" \n\t\n") == []


@pytest.mark.parametrize("text, expected", [
    # Lowercased, tokenized CNN/DM (See et al.) and PubMed: the mark is its own token.
    ("it was sunny . he left .", ["it was sunny .", "he left ."]),
    ("background : the aim was x . methods : we did y . results : z .",
     ["background : the aim was x .", "methods : we did y .", "results : z ."]),
    ("-lrb- cnn -rrb- it rained ! the match stopped ? yes .",
     ["-lrb- cnn -rrb- it rained !", "the match stopped ?", "yes ."]),
    # Abbreviations hold in tokenized text too.
    ("as in fig . 2 , the rate rose . it fell later .", ["as in fig . 2 , the rate rose .", "it fell later ."]),
    ("as shown by smith et al . ( 2010 ) the rate rose .", ["as shown by smith et al . ( 2010 ) the rate rose ."]),
    # A tokenized ellipsis ends the sentence only after its last period.
    ("he waited . . . nothing happened .", ["he waited . . .", "nothing happened ."]),
])
def test_pretokenized_text_detected(text, expected):
    assert split_sentences(text) == expected
