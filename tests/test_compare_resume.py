"""`tasks.compare --resume`: an interrupted comparison goes on in the same comparison run, its
finished rows reused, an interrupted fit resumed from its last checkpoint in its own run, and ends
with the table an uninterrupted comparison makes (quality and calls; the speeds are measured again).
Interrupted at a row boundary, in the middle of a row, and before a row's first checkpoint."""
import json
import logging
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import Callback
from mlflow.tracking import MlflowClient

from tasks import compare
from tasks.runs import trainer
from tasks.config import ConfigError
from tests.test_end_to_end import TINY, tracking

pytestmark = pytest.mark.slow

PLAN = ["--task", "keyphrase", "--repeats", "1", "--speed-examples", "2", *TINY,
        "trainer.max_epochs=2"]
# what a resumed comparison must reproduce: every column but the speeds
SAME = ("label", "quality", "decoder_calls_per_example", "tokens_per_call", "bound_hits")


def argv(folder: Path, *extra: str, decoders: str = "sequential,pipelined") -> list[str]:
    return ["--decoders", decoders, *PLAN, "--out", str(folder / "cmp.json"), *tracking(folder),
            *extra]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("uninterrupted")
    return compare.main(argv(folder))


class CtrlC(Callback):
    """Ctrl-C at the start of epoch `epoch` of a fit."""

    def __init__(self, epoch: int):
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            raise KeyboardInterrupt


def interrupting(monkeypatch, decoder: str, epoch: int | None) -> list[str]:
    """`compare.train_and_test` with Ctrl-C in `decoder`'s fit at the start of `epoch` (None: at
    the row boundary, before its fit begins); returns the decoders it was called for."""
    real, called = trainer.train_and_test, []

    def train_and_test(cfg, tags=None, resume=None, callbacks=()):
        called.append(cfg.decoder.name)
        if cfg.decoder.name == decoder and epoch is None:
            raise KeyboardInterrupt
        extra = [CtrlC(epoch)] if cfg.decoder.name == decoder else []
        return real(cfg, tags=tags, resume=resume, callbacks=[*callbacks, *extra])
    monkeypatch.setattr(compare, "train_and_test", train_and_test)
    return called


def counting(monkeypatch) -> list[tuple[str, bool]]:
    """`compare.train_and_test` as it is, recording (decoder, resumed) per call."""
    real, called = trainer.train_and_test, []

    def train_and_test(cfg, tags=None, resume=None, callbacks=()):
        called.append((cfg.decoder.name, resume is not None))
        return real(cfg, tags=tags, resume=resume, callbacks=callbacks)
    monkeypatch.setattr(compare, "train_and_test", train_and_test)
    return called


def comparison_runs(folder: Path) -> tuple[list, list]:
    """The store's comparison runs and row runs, deleted ones left out, as the UI shows them."""
    client = MlflowClient(f"sqlite:///{folder}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("keyphrase").experiment_id])
    return ([r for r in runs if r.data.tags["role"] == "comparison"],
            [r for r in runs if r.data.tags["role"] == "row"])


def assert_same_table(resumed: dict, uninterrupted: dict) -> None:
    assert [{k: row[k] for k in SAME} for row in resumed["rows"]] == \
        [{k: row[k] for k in SAME} for row in uninterrupted["rows"]]
    assert resumed["baselines"] == uninterrupted["baselines"]


@pytest.mark.parametrize("epoch", [None, 1, 0], ids=["row-boundary", "mid-row", "before-checkpoint"])
def test_an_interrupted_comparison_goes_on_where_it_stopped(epoch, uninterrupted, tmp_path,
                                                            monkeypatch, caplog):
    called = interrupting(monkeypatch, "pipelined", epoch)
    with caplog.at_level(logging.INFO, logger="tasks"), \
            pytest.raises((KeyboardInterrupt, SystemExit)):
        compare.main(argv(tmp_path))
    assert called == ["sequential", "pipelined"]
    [stopped], rows = comparison_runs(tmp_path)
    comparison_id = stopped.data.tags["comparison_id"]
    assert stopped.info.status == "KILLED"
    # the exact command that goes on, printed when it stopped
    assert f"--resume {comparison_id}" in caplog.text
    assert "python -m tasks.compare --decoders sequential,pipelined --task keyphrase" in caplog.text
    assert "row 1 of 2: sequential (own)" in caplog.text
    before = {r.data.tags["row_index"]: r for r in rows}
    assert before["0"].info.status == "FINISHED"
    assert ("1" in before) == (epoch is not None)

    caplog.clear()
    called = counting(monkeypatch)
    with caplog.at_level(logging.INFO, logger="tasks"):
        resumed = compare.main(argv(tmp_path, "--resume"))
    assert_same_table(resumed, uninterrupted)
    # the sequential row was not trained again; pipelined went on from its last checkpoint when it
    # had one, else was fitted again
    assert called == [("pipelined", epoch == 1)]
    assert "row 1 of 2: sequential (own): finished in run" in caplog.text
    [comparison], rows = comparison_runs(tmp_path)
    assert comparison.info.run_id == stopped.info.run_id and comparison.info.status == "FINISHED"
    assert comparison.data.tags["resumed"] == "true"
    # each row once, as the comparison's child, and in the table
    assert sorted(r.data.tags["row_index"] for r in rows) == ["0", "1"]
    assert all(r.info.status == "FINISHED" for r in rows)
    assert all(r.data.tags["mlflow.parentRunId"] == comparison.info.run_id for r in rows)
    after = {r.data.tags["row_index"]: r for r in rows}
    assert after["0"].info.run_id == before["0"].info.run_id
    assert [row["mlflow_run_id"] for row in resumed["rows"]] == [after["0"].info.run_id,
                                                                after["1"].info.run_id]
    if epoch == 1:  # the same run went on
        assert after["1"].info.run_id == before["1"].info.run_id
        assert "resumed_from" in after["1"].data.tags
    if epoch == 0:  # the attempt without a checkpoint is marked and out of the experiment's view
        client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
        abandoned = client.get_run(before["1"].info.run_id)
        assert abandoned.info.lifecycle_stage == "deleted"
        assert "fitted again" in abandoned.data.tags["abandoned"]
    written = json.loads((tmp_path / "cmp.json").read_text())
    assert written == json.loads(json.dumps(resumed))


def test_a_plan_that_differs_is_refused_and_a_fresh_start_points_to_resume(tmp_path, monkeypatch,
                                                                           caplog):
    interrupting(monkeypatch, "pipelined", None)
    with pytest.raises(KeyboardInterrupt):
        compare.main(argv(tmp_path))
    [stopped], _ = comparison_runs(tmp_path)
    comparison_id = stopped.data.tags["comparison_id"]

    monkeypatch.setattr(compare, "fit_rows", lambda *a, **k: pytest.fail("fitted a row"))
    with pytest.raises(ConfigError, match=r"rows: sequential, pipelined in the comparison, "
                                          r"sequential, nar now"):
        compare.main(argv(tmp_path, "--resume", comparison_id, decoders="sequential,nar"))
    with pytest.raises(ConfigError, match=r"row 2 \(pipelined\) train\.lr: 0\.001 in the comparison, "
                                          r"0\.002 now"):
        compare.main(argv(tmp_path, "train.lr=0.002", "--resume", comparison_id))
    with pytest.raises(ConfigError, match=r"row 1 \(sequential\) task\.name: 'keyphrase' in the "
                                          r"comparison, 'qa' now"):
        compare.main(argv(tmp_path, "--task", "qa", "--resume", comparison_id))
    with pytest.raises(ConfigError, match=rf"no unfinished comparison of this plan.*{comparison_id}, "
                                          rf"was planned otherwise \(.*train\.lr"):
        compare.main(argv(tmp_path, "train.lr=0.002", "--resume"))
    # where files go is not the plan: another tokenizer cache resumes the same comparison
    monkeypatch.setattr(compare, "fit_rows", _stop)
    with pytest.raises(KeyboardInterrupt):
        compare.main(argv(tmp_path, f"data.tokenizer_cache={tmp_path}/other", "--resume"))

    with caplog.at_level(logging.WARNING, logger="tasks"), pytest.raises(KeyboardInterrupt):
        compare.main(argv(tmp_path))
    assert f"comparison {comparison_id} of this plan was interrupted (KILLED): add --resume" \
        in caplog.text
    with pytest.raises(ConfigError, match="no comparison with that id"):
        compare.main(argv(tmp_path, "--resume", "0123456789ab"))


def _stop(*args, **kwargs):
    raise KeyboardInterrupt
