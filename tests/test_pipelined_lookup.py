"""The replay of exact pipelined + lookup decoding (tasks.bench.pipelined_lookup) on outputs built by
hand: drafts from the source shorten a subsequence, a later subsequence starts once the earlier
ones reach its start time, and an earlier subsequence's frontier caps what a later one accepts."""
import pytest

from tasks.bench.pipelined_lookup import lookup_draft, replayed_calls

E = 1                                   # the end token
A, B, C, Q, X, Y, Z = 10, 11, 12, 13, 20, 21, 22
SOURCE = [A, B, C, 30, X, Y, Z, 31]


def test_the_draft_follows_the_latest_occurrence_of_the_last_tokens():
    assert lookup_draft([A, B, A, C, 5], [A], 2, 1) == [C, 5]
    assert lookup_draft(SOURCE, [A, B], 3, 2) == [C, 30, X]
    assert lookup_draft(SOURCE, [Q], 4, 1) == [] and lookup_draft(SOURCE, [], 4, 1) == []
    assert lookup_draft(SOURCE, [Z], 4, 1) == [31] and lookup_draft(SOURCE, [31], 4, 1) == []


@pytest.mark.parametrize("subsequences,plain,drafted", [
    # one subsequence, copied after its first token; the terminator starts at time 1
    ([[A, B, C, E], [E]], 4, 2),
    # the second starts while the first's drafts run ahead, and copies once the first has ended
    ([[A, B, C, E], [X, Y, Z, E], [E]], 5, 3),
    # the first cannot copy (Q follows A nowhere): at the third call it holds real tokens up to
    # time 2 only, so the second's agreeing draft [Y, Z] is not accepted there (without the
    # frontier: 3 calls)
    ([[A, Q, E], [X, Y, Z, E], [E]], 5, 4),
])
def test_calls_by_construction(subsequences, plain, drafted):
    assert replayed_calls(subsequences, SOURCE, 1, 0, 1)[0] == plain
    assert replayed_calls(subsequences, SOURCE, 1, 4, 1)[0] == drafted


def test_without_drafts_it_is_pipelineds_schedule():
    """Subsequence i starts at call i*d + 1 and runs one token a call: calls = max_i(i*d + len_i),
    whenever no subsequence ends before the next one's slot."""
    subsequences = [[A, B, C, E], [X, Y, E], [Q, Q, Q, Q, E], [E]]
    for delay in (1, 2):
        expected = max(i * delay + len(s) for i, s in enumerate(subsequences))
        calls, fed = replayed_calls(subsequences, SOURCE, delay, 0, 1)
        assert calls == expected and fed == sum(map(len, subsequences))


def test_a_subsequence_starts_early_once_every_earlier_one_has_ended():
    """delay 3: the first ends after 2 calls, so the terminator needs nothing more to see by its
    slot and starts at the third call instead of the fourth (exact: it sees what it would have)."""
    assert replayed_calls([[A, E], [E]], SOURCE, 3, 0, 1)[0] == 3
