"""`tasks.experiments.data_stats`: the lengths the data limits are set from, counted as the limits count them."""
import json

import pytest

from tasks.experiments import data_stats
from tests.test_data import KP, write_split


def test_counts_each_quantity_over_all_splits_as_its_limit_does(tmp_path, monkeypatch):
    # 1, 2 and 3 keyphrases per record, the same in every split: nothing is cut (no limits)
    rows = [dict(KP, id=f"r{n}", keyphrases=[f"phrase {k} of {n}" for k in range(n)]) for n in (1, 2, 3)]
    for split in ("train", "validation", "test"):
        write_split(tmp_path / "data" / "tiny", split, rows)
    monkeypatch.setattr(data_stats, "NO_CUT", [*data_stats.NO_CUT, f"data.tokenizer_cache={tmp_path}/tok"])
    out = tmp_path / "stats.json"
    [row] = data_stats.main(["--data", str(tmp_path / "data"), "--out", str(out)])
    assert (row["data"], row["task"]) == ("tiny", "keyphrase")
    subsequences = row["subsequences"]
    assert (subsequences["max"], subsequences["mean"], subsequences["examples"]) == (3, 2.0, 9)
    # a subsequence counts its end token; a target counts its subsequences' tokens with one end or
    # separator token each (s_1 <sep> s_2 </s>): over all examples the two totals are equal
    target, subsequence = row["target tokens"], row["subsequence tokens"]
    assert subsequence["examples"] == 18
    assert target["mean"] * 9 == pytest.approx(subsequence["mean"] * 18)
    assert json.loads(out.read_text()) == [row] and "| tiny | keyphrase |" in out.with_suffix(".md").read_text()
