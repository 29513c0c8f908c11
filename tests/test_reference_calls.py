"""`tasks.experiments.reference_calls`: decoder calls needed to produce the references, counted without a model."""
import json

import pytest

from datamodules.datamodule import SubsequenceDataModule
from tasks.experiments import reference_calls
from tasks.config import ConfigError, compose
from tests.test_end_to_end import TINY, tracking


def test_counts_on_builtin_keyphrase_references(tmp_path):
    out = tmp_path / "calls.json"
    args = ["--task", "keyphrase", "--decoders", "sequential,pipelined,blockwise,nar",
            "--sweep", "decoder.delay=1,3", "decoder.iterations=2", "--out", str(out),
            *TINY, *tracking(tmp_path)]
    result = reference_calls.main(args)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))

    # the sequential count, from the encoded references themselves: tokens + separators + end
    datamodule = SubsequenceDataModule(compose("keyphrase", "sequential", None, TINY + tracking(tmp_path)))
    targets = [e.target_ids for e in datamodule.dataset("test")]
    sequential = [sum(map(len, subs)) + len(subs) for subs in targets]  # m-1 separators + 1 end
    rows = {row["label"]: row for row in result["rows"]}
    assert list(rows) == ["sequential", "pipelined(delay=1)", "pipelined(delay=3)", "blockwise", "nar"]
    assert rows["sequential"]["calls_per_example"] == pytest.approx(sum(sequential) / len(sequential))
    assert rows["sequential"]["fewer_calls_than_first"] == pytest.approx(1.0)
    # several keyphrases per example: pipelining needs fewer calls, and fewer at a smaller delay
    assert rows["pipelined(delay=1)"]["calls_per_example"] < rows["pipelined(delay=3)"]["calls_per_example"]
    assert rows["pipelined(delay=1)"]["fewer_calls_than_first"] > 1.5
    assert rows["nar"]["calls_per_example"] == 2 and rows["nar"]["median_calls"] == 2
    assert rows["blockwise"]["calls_per_example"] is None
    assert "| blockwise | depends on the model |" in out.with_suffix(".md").read_text()
    assert result["examples"] == len(targets) == 8


def test_print_config_prints_each_decoder_and_does_nothing_else(tmp_path, capsys):
    assert reference_calls.main(["--decoders", "sequential,pipelined", "--print-config",
                                 "decoder.delay=2", *tracking(tmp_path)]) == {}
    printed = capsys.readouterr().out
    assert "name: sequential" in printed and "delay: 2" in printed
    assert not (tmp_path / "tok").exists()  # no tokenizer was trained


def test_unknown_decoder_is_a_clear_error():
    with pytest.raises(ConfigError, match="unknown decoder 'beam'; available: aggressive, blockwise, lookup, nar, onestep, pipelined"):
        reference_calls.main(["--decoders", "sequential,beam"])
