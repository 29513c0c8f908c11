"""tasks.experiments.distill: the teacher's decoded outputs become the training targets of a jsonl dataset."""
import json
from pathlib import Path

import pytest

from datamodules.sources import load_split
from tasks import fit
from tasks.experiments import distill
from tasks.config import ConfigError, compose
from tasks.runs.checkpoints import load_checkpoint
from tasks.runs.trainer import build
from tasks.runs.restore import checkpoint_config, restore
from tests.test_end_to_end import TINY, tracking


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_distilled_targets_are_the_teachers_outputs(tmp_path):
    teacher = fit.main(["--task", "keyphrase", *TINY, "model.initializer_factor=6", *tracking(tmp_path)])
    out = tmp_path / "distilled"
    result = distill.main(["--ckpt", teacher["checkpoint"], "--out", str(out), *tracking(tmp_path)])

    # the same checkpoint decoding the training split on its own, example by example
    checkpoint = load_checkpoint(teacher["checkpoint"])
    built = restore(checkpoint, teacher["checkpoint"], checkpoint_config(checkpoint, teacher["checkpoint"], []))
    built.module.eval()  # no dropout, as in any decoding
    originals = built.datamodule.records("train")
    expected = []
    for example in built.datamodule.dataset("train"):
        batch = built.datamodule.collate([example])
        expected.append(built.module.decode_batch(batch)[0])
    train = read(out / "train.jsonl")
    assert [r["keyphrases"] for r in train] == expected
    assert len({tuple(k) for k in expected}) > 1  # a teacher with varied outputs: the check means something
    assert [{k: v for k, v in r.items() if k != "keyphrases"} for r in train] == \
        [{k: v for k, v in r.items() if k != "keyphrases"} for r in originals]
    assert read(out / "test.jsonl") == built.datamodule.records("test")  # scored against the references
    assert result["train_examples"] == 32

    # a valid jsonl dataset for another decoder
    model_and_budget = [o for o in TINY if not o.startswith("data.") or "_size=" not in o]
    cfg = compose("keyphrase", "nar", None, [*model_and_budget, "data=jsonl", f"data.path={out}",
                                             *tracking(tmp_path)])
    assert len(load_split("keyphrase", cfg.data, "train")) == 32
    build(cfg)

    with pytest.raises(ConfigError, match="is not empty; choose a new folder"):
        distill.main(["--ckpt", teacher["checkpoint"], "--out", str(out)])
