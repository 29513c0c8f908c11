"""Scale-out and faults: DDP evaluation, resume into the same run, run status on errors, atomic
writes, determinism, and bad input that fails before any work."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient
from transformers import T5Config

import tasks.cli
import tasks.runs.trainer
from datamodules.datamodule import SubsequenceDataModule
from datamodules.schema import DataError
from decoders import build_decoder
from tasks import fit, test as test_entry
from tasks.config import ConfigError, compose
from tasks.module import Evaluation
from tasks.runs.checkpoints import SafeCheckpointIO
from tasks.runs.trainer import build, evaluate_test, make_trainer, train_and_test
from tests.conftest import SPECIAL, always_feeding
from tests.test_end_to_end import TINY, run_artifact_rows, tracking, weights

REPO = Path(__file__).resolve().parents[1]
TIMING = {"examples_per_second", "decode_seconds"}  # the only scores allowed to differ between runs


def quality_and_counts(scores: dict) -> dict:
    return {k: v for k, v in scores.items() if k not in TIMING}


# ---- DDP ------------------------------------------------------------------------------------------

# Odd split sizes: 2 processes get unequal shares, and torch's DistributedSampler would repeat one.
# A large initialisation scale and a negligible learning rate keep the model random but with
# different outputs for every example, so a mix-up of examples between processes would show.
DDP_DATA = ["data.train_size=33", "data.validation_size=5", "data.test_size=7",
            "model.initializer_factor=6", "train.lr=1e-6"]


@pytest.mark.slow
@pytest.mark.parametrize("decoder", ["sequential", "pipelined", "blockwise", "nar"])
def test_ddp_two_processes_score_like_one(decoder, tmp_path):
    args = ["--task", "summarization", "--decoder", decoder, *TINY, *DDP_DATA, *tracking(tmp_path),
            "trainer.devices=2", "trainer.strategy=ddp", "trainer.accelerator=cpu",
            # every call feeds its drafts: the measured rule's calls follow each process's timing
            *(f"decoder.{k}={v}" for k, v in always_feeding(decoder).items())]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "tasks.fit", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("summarization").experiment_id])
    assert len(runs) == 1  # one run per fit, from rank 0 only
    run = runs[0]
    assert run.info.status == "FINISHED"
    ddp_rows = run_artifact_rows(client, run.info.run_id, tmp_path / "ddp")
    ddp_scores = {k[len("test/"):]: v for k, v in run.data.metrics.items() if k.startswith("test/")}

    # the same checkpoint and data in one process (the checkpoint's config says 2 DDP processes)
    one_process = ["trainer.devices=1", "trainer.strategy=auto", "trainer.enable_progress_bar=false"]
    single = test_entry.main(["--ckpt", run.data.tags["tested_checkpoint"], *tracking(tmp_path),
                              *one_process])
    single_rows = run_artifact_rows(client, single["run_id"], tmp_path / "single")

    # every test example once, in dataset order, with the same predictions as one process
    dm = SubsequenceDataModule(compose("summarization", decoder, None, [*TINY, *DDP_DATA]))
    assert [r["id"] for r in ddp_rows] == [r["id"] for r in dm.records("test")]
    assert ddp_rows == single_rows
    expected = quality_and_counts(single["scores"])
    assert quality_and_counts(ddp_scores) == pytest.approx(expected, abs=1e-6)
    assert len({tuple(r["prediction"]) for r in ddp_rows}) >= 2  # outputs differ: a mix-up would show

    if decoder == "blockwise":  # sequential decoding of its base head: valid by design, same output
        again = test_entry.main(["--ckpt", run.data.tags["tested_checkpoint"], "decoder=sequential",
                                 *tracking(tmp_path), *one_process])
        assert run_artifact_rows(client, again["run_id"], tmp_path / "seq")[0]["prediction"] == \
            ddp_rows[0]["prediction"]


# ---- resume, run status, determinism --------------------------------------------------------------

class CrashAt(L.Callback):
    """Raises `error` at a given batch of a given epoch: a crash in the middle of an epoch."""

    def __init__(self, epoch: int, batch: int, error: BaseException):
        self.epoch, self.batch, self.error = epoch, batch, error

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.current_epoch == self.epoch and batch_idx == self.batch:
            raise self.error


def last_checkpoint(run_id: str, tmp_path: Path) -> str:
    return str(tmp_path / "artifacts" / run_id / "checkpoints" / "last.ckpt")


@pytest.mark.slow
def test_crash_then_resume_equals_uninterrupted_and_same_seed_repeats(tmp_path):
    # NAR draws random training masks, on top of dropout (set: t5-tiny's default is none) and
    # shuffling: the strictest case
    args = ["--task", "keyphrase", "--decoder", "nar", *TINY, "trainer.max_epochs=2", "model.dropout=0.1",
            *tracking(tmp_path)]
    cfg = compose("keyphrase", "nar", None, args[4:])
    client = MlflowClient(cfg.tracking.uri)

    first = fit.main(args)
    second = fit.main(args)  # determinism: the same seed, the same numbers and weights
    assert quality_and_counts(first["scores"]) == quality_and_counts(second["scores"])
    last = torch.load(last_checkpoint(first["run_id"], tmp_path), weights_only=False)
    assert last["epoch"] == 1  # last.ckpt is the final epoch's, whether or not the metric improved
    first_weights = last["state_dict"]
    second_weights = weights(last_checkpoint(second["run_id"], tmp_path))
    assert all(torch.equal(first_weights[k], second_weights[k]) for k in first_weights)

    # a crash in the middle of the second epoch: the run is FAILED with the error, epoch 0 is kept
    with pytest.raises(RuntimeError, match="simulated crash"):
        train_and_test(cfg, callbacks=[CrashAt(epoch=1, batch=2, error=RuntimeError("simulated crash"))])
    crashed = client.search_runs([client.get_experiment_by_name("keyphrase").experiment_id],
                                 order_by=["attributes.start_time DESC"])[0]
    assert crashed.info.status == "FAILED"
    assert crashed.data.tags["error"] == "RuntimeError: simulated crash"
    assert Path(last_checkpoint(crashed.info.run_id, tmp_path)).is_file()

    # resuming with another configuration is refused, naming what differs
    with pytest.raises(ConfigError, match=r"decoder.iterations: 4 in the run, 2 now"):
        fit.main([*args, "decoder.iterations=2", "--resume"])

    resumed = fit.main(["--resume", *args[4:], *args[:4]])  # "--resume key=value": an override
    assert resumed["run_id"] == crashed.info.run_id  # the same MLflow run goes on
    run = client.get_run(resumed["run_id"])
    assert run.info.status == "FINISHED" and "error" not in run.data.tags
    assert run.data.tags["error_before_resume"] == "RuntimeError: simulated crash"
    assert quality_and_counts(resumed["scores"]) == quality_and_counts(first["scores"])
    resumed_weights = weights(last_checkpoint(resumed["run_id"], tmp_path))
    assert all(torch.equal(first_weights[k], resumed_weights[k]) for k in first_weights)

    # nothing left to resume: every run finished
    with pytest.raises(ConfigError, match="no unfinished run with a checkpoint"):
        fit.main([*args, "--resume"])


@pytest.mark.slow
def test_ctrl_c_marks_the_run_killed(tmp_path):
    cfg = compose("keyphrase", None, None, [*TINY, *tracking(tmp_path)])
    sigint = signal.getsignal(signal.SIGINT)  # Lightning ignores further Ctrl-C while shutting down
    try:
        with pytest.raises(SystemExit):  # Lightning's graceful shutdown exits with status 1
            train_and_test(cfg, callbacks=[CrashAt(epoch=0, batch=1, error=KeyboardInterrupt())])
    finally:
        signal.signal(signal.SIGINT, sigint)
    client = MlflowClient(cfg.tracking.uri)
    run = client.search_runs([client.get_experiment_by_name("keyphrase").experiment_id])[0]
    assert run.info.status == "KILLED" and run.data.tags["error"] == "KeyboardInterrupt"


# ---- writes that cannot be mistaken for complete ones ---------------------------------------------

def test_checkpoint_write_is_all_or_nothing(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    writer = SafeCheckpointIO()
    writer.save_checkpoint({"step": 1}, path)
    assert torch.load(path)["step"] == 1

    def save_half_then_fail(obj, target):
        Path(target).write_bytes(b"half a checkpoint")
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", save_half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        writer.save_checkpoint({"step": 2}, path)
    assert torch.load(path)["step"] == 1  # the previous checkpoint is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no partial file left


def test_predictions_write_is_all_or_nothing(tmp_path):
    from datamodules.sources import write_jsonl
    path = tmp_path / "predictions.jsonl"
    with pytest.raises(TypeError):
        write_jsonl([{"id": "a"}, {"id": object()}], path)  # the second row cannot be serialised
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temporary


# ---- bad input: a clear error before any expensive work -------------------------------------------

def test_unusable_tracking_uri_fails_before_the_data_is_touched(tmp_path, monkeypatch):
    monkeypatch.setattr(tasks.runs.trainer, "build",
                        lambda *a, **k: pytest.fail("data built before the check"))
    cfg = compose("keyphrase", None, None, [f"tracking.uri=sqlite:///{tmp_path}",  # a folder
                                            f"tracking.artifact_location={tmp_path}/artifacts"])
    with pytest.raises(ConfigError, match=f"cannot open tracking.uri='sqlite:///{tmp_path}'"):
        train_and_test(cfg)


@pytest.mark.parametrize("key", ["use_distributed_sampler", "plugins", "enable_checkpointing"])
def test_trainer_options_the_library_owns_are_refused(key):
    with pytest.raises(ConfigError, match=f"override: trainer.{key} is set by the library, not by "
                                          f"configuration; remove it"):
        compose("keyphrase", None, None, [f"trainer.{key}=true"])


def write_split(folder: Path, split: str, keyphrase_lists: list[list[str]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{split}.jsonl", "w") as f:
        for i, keyphrases in enumerate(keyphrase_lists):
            f.write(json.dumps({"id": f"{split}{i}", "title": "graph coloring",
                                "abstract": "we study graph coloring of planar graphs .",
                                "keyphrases": keyphrases}) + "\n")


def test_empty_targets_are_counted_and_an_all_empty_split_is_refused(tmp_path):
    write_split(tmp_path, "train", [["graph coloring"], [], [" "], ["planar graphs"]])
    write_split(tmp_path, "validation", [["graph coloring"]])
    write_split(tmp_path, "test", [[]])
    cfg = compose("keyphrase", None, None, ["data=jsonl", f"data.path={tmp_path}",
                                            "model.vocab_size=60", f"data.tokenizer_cache={tmp_path}/tok"])
    dm = SubsequenceDataModule(cfg)
    dm.setup()
    assert dm.report["train"].empty_targets == 2 and dm.report["train"].examples == 4
    assert dm.report["test"].empty_targets == 1  # an unlabelled test split is allowed

    write_split(tmp_path, "validation", [[], [" "]])
    with pytest.raises(DataError, match="validation split: all 2 examples have empty targets "
                                        r"\(field 'keyphrases'\)"):
        SubsequenceDataModule(cfg).setup()


def test_step_bound_is_reported_in_telemetry_not_silently_cut(tmp_path, caplog):
    cfg = compose("keyphrase", "pipelined", None, [*TINY, "decoder.max_steps=2",
                                                   f"data.tokenizer_cache={tmp_path}/tok"])
    built = build(cfg)
    with torch.no_grad():  # by construction nothing ends: the end token's logit is 0, below the
        # best of the other, random logits, so every example runs to the step bound
        built.module.backbone.lm_head.weight[built.module.decoder.special.eos] = 0.0
    tested = evaluate_test(cfg, built, None)
    rows = built.module.prediction_rows("test")
    assert tested.telemetry["bound_hits"] == tested.examples == len(rows) == 8
    assert all(r["bound_hit"] and r["decoder_calls"] == 2 for r in rows)
    assert "test: 8 of 8 examples reached one of the decoder's length or step bounds" in caplog.text


def test_a_fit_warns_of_bound_hits_once_at_its_end_not_at_every_validation(tmp_path, caplog):
    cfg = compose("keyphrase", "pipelined", None, [*TINY, "decoder.max_steps=2", "trainer.max_epochs=3",
                                                   "trainer.limit_train_batches=1",
                                                   f"data.tokenizer_cache={tmp_path}/tok"])
    built = build(cfg)
    with torch.no_grad():  # every example runs to the step bound, as above; one step of training
        # at the default learning rate does not lift the end token from its place below the others
        built.module.backbone.lm_head.weight[built.module.decoder.special.eos] = -1e3
    validations = []
    built.module.on_validation_epoch_end = (lambda end=built.module.on_validation_epoch_end:
                                            validations.append(end()))
    make_trainer(cfg, None).fit(built.module, datamodule=built.datamodule)
    assert len(validations) == 3  # three validations, each with every output at the bound
    val = built.module.evaluations["val"]
    assert (val.telemetry["bound_hits"], val.examples) == (8, 8)
    assert caplog.text.count("reached one of the decoder's length or step bounds") == 1
    assert "val: 8 of 8 examples reached" in caplog.text


def test_a_small_share_of_bound_hits_is_logged_but_not_warned(tmp_path, caplog):
    cfg = compose("keyphrase", "pipelined", None, [*TINY, f"data.tokenizer_cache={tmp_path}/tok"])
    module = build(cfg).module
    for hits in (1, 5):  # 1%: below BOUND_WARNING_SHARE; then 5%
        module.evaluations["test"] = Evaluation({}, {"bound_hits": float(hits)}, {}, examples=100)
        module.warn_bound_hits("test")
    assert caplog.text.count("reached one of the decoder's length or step bounds") == 1
    assert "test: 5 of 100 examples" in caplog.text


# ---- every bad value named before any work (exit 2, no traceback, no data read) -------------------

# Every documented option and setting with a value outside its range, and the message it must give.
# Decoder options come with the decoder that has them; TINY sets data.max_target_length=40, which is
# nar's default max_new_tokens. A test below checks that every numeric decoder option is here.
DECODER_BAD_VALUES = [
    ("sequential", "decoder.max_new_tokens=0", "decoder.max_new_tokens must be an integer >= 1, got 0"),
    ("pipelined", "decoder.delay=0", "decoder.delay must be an integer >= 1, got 0"),
    ("pipelined", "decoder.delay=-1", "decoder.delay must be an integer >= 1, got -1"),
    ("pipelined", "decoder.max_subsequences=0", "decoder.max_subsequences must be an integer >= 1, got 0"),
    ("pipelined", "decoder.max_subsequence_length=0",
     "decoder.max_subsequence_length must be an integer >= 1, got 0"),
    ("pipelined", "decoder.max_steps=0", "decoder.max_steps must be an integer >= 1 or null (null: "
                                         "as many as the slots allow), got 0"),
    ("pipelined", "decoder.max_new_tokens=0", "decoder.max_new_tokens must be an integer >= 1, got 0"),
    ("pipelined", "decoder.stop_rule=paper",
     "decoder.stop_rule must be one of 'first_empty', 'all_end', got 'paper'"),
    ("blockwise", "decoder.block_size=1", "decoder.block_size must be an integer >= 2 (the base head "
                                          "plus at least one proposal head), got 1"),
    ("blockwise", "decoder.top_k=0", "decoder.top_k must be an integer >= 1 (1 = exact acceptance), got 0"),
    ("blockwise", "decoder.max_new_tokens=0", "decoder.max_new_tokens must be an integer >= 1, got 0"),
    ("aggressive", "decoder.draft_tokens=0",
     "decoder.draft_tokens must be an integer >= 1 (draft tokens verified per call), got 0"),
    ("aggressive", "decoder.top_k=0", "decoder.top_k must be an integer >= 1 (1 = exact acceptance), got 0"),
    ("aggressive", "decoder.max_new_tokens=0", "decoder.max_new_tokens must be an integer >= 1, got 0"),
    ("aggressive", "decoder.drafter_iterations=0", "decoder.drafter_iterations must be an integer >= 1 or null (null: the drafter's own "
                               "iterations), got 0"),
    ("aggressive", "decoder.redraft=always",
     "decoder.redraft must be one of 'mismatch', 'outgrown', 'never', 'realign', got 'always'"),
    ("nar", "decoder.iterations=0", "decoder.iterations must be an integer >= 1, got 0"),
    ("nar", "decoder.length_candidates=0",
     "decoder.length_candidates must be an integer >= 1 and <= decoder.max_new_tokens (40), got 0"),
    ("nar", "decoder.length_candidates=41",
     "decoder.length_candidates must be an integer >= 1 and <= decoder.max_new_tokens (40), got 41"),
    ("nar", "decoder.length_loss_weight=-0.5",
     "decoder.length_loss_weight must be a finite number >= 0, got -0.5"),
    ("nar", "decoder.max_new_tokens=0", "decoder.max_new_tokens must be an integer >= 1, got 0"),
    ("onestep", "decoder.max_new_tokens=0", "decoder.max_new_tokens must be an integer >= 1, got 0"),
    *[(name, "decoder.draft_length=sometimes",
       "decoder.draft_length must be one of 'fixed', 'adaptive', got 'sometimes'")
      for name in ("lookup", "blockwise", "aggressive")],
    *[(name, "decoder.min_acceptance=1.5",
       "decoder.min_acceptance must be a finite number >= 0 and <= 1 or null (first draft tokens "
       "expected accepted per row of a call; null: while the tokens they gain pay for their measured "
       "cost), got 1.5")
      for name in ("lookup", "blockwise", "aggressive")],
    ("lookup", "decoder.draft_tokens=0",
     "decoder.draft_tokens must be an integer >= 1 (source tokens offered per call), got 0"),
    ("lookup", "decoder.match=0",
     "decoder.match must be an integer >= 1 (output tokens looked up in the source), got 0"),
    ("lookup", "decoder.max_new_tokens=0", "decoder.max_new_tokens must be an integer >= 1, got 0"),
]
BAD_VALUES = [
    ("seed=-1", "seed must be an integer >= 0 and <= 4294967295"),
    ("train.batch_size=0", "train.batch_size must be an integer >= 1, got 0"),
    ("train.lr=0", "train.lr must be a finite number > 0, got 0"),
    ("train.lr=-0.001", "train.lr must be a finite number > 0, got -0.001"),
    ("train.weight_decay=-0.01", "train.weight_decay must be a finite number >= 0, got -0.01"),
    ("train.warmup_steps=-1", "train.warmup_steps must be an integer >= 0 (0: no warm-up), got -1"),
    ("train.position_bias_lr_scale=0", "train.position_bias_lr_scale must be a finite number > 0, got 0"),
    ("eval.batch_size=0", "eval.batch_size must be an integer >= 1, got 0"),
    ("eval.speed_batch_size=0", "eval.speed_batch_size must be an integer >= 1, got 0"),
    ("data.max_train_examples=0", "data.max_train_examples must be an integer >= 1 or null"),
    ("data.max_eval_examples=0", "data.max_eval_examples must be an integer >= 1 or null"),
    ("data.max_source_length=1", "data.max_source_length must be an integer >= 2"),
    ("data.max_target_length=1", "data.max_target_length must be an integer >= 2"),
    ("data.max_subsequences=0", "data.max_subsequences must be an integer >= 1, got 0"),
    ("data.num_workers=-1", "data.num_workers must be an integer >= 0, got -1"),
    ("data.train_size=0", "data.train_size must be an integer >= 1, got 0"),
    ("data.validation_size=0", "data.validation_size must be an integer >= 1, got 0"),
    ("data.test_size=0", "data.test_size must be an integer >= 1, got 0"),
    ("data.corpus_seed=-1", "data.corpus_seed must be an integer >= 0, got -1"),
    ("model.vocab_size=0", "model.vocab_size must be an integer >= 1, got 0"),
    ("model.d_model=0", "model.d_model must be an integer >= 1, got 0"),
    ("model.d_ff=0", "model.d_ff must be an integer >= 1, got 0"),
    ("model.d_kv=0", "model.d_kv must be an integer >= 1, got 0"),
    ("model.num_heads=0", "model.num_heads must be an integer >= 1, got 0"),
    ("model.num_layers=0", "model.num_layers must be an integer >= 1, got 0"),
    ("model.num_decoder_layers=0", "model.num_decoder_layers must be an integer >= 1, got 0"),
    ("model.dropout=1.0", "model.dropout must be a finite number >= 0 and < 1, got 1.0"),
    ("model.initializer_factor=0", "model.initializer_factor must be a finite number > 0, got 0"),
    ("trainer.devices=0", "trainer.devices must be a number of devices >= 1, -1 (all of them), "
                          "'auto', or a non-empty list of distinct device indices >= 0"),
    ("trainer.devices=-2", "trainer.devices must be a number of devices >= 1"),
    ("trainer.devices=[]", "trainer.devices must be a number of devices >= 1"),
    ("trainer.max_epochs=-5", "trainer.max_epochs must be an integer >= -1 or null (-1: no limit), got -5"),
    ("trainer.max_steps=-2", "trainer.max_steps must be an integer >= -1 (-1: no limit), got -2"),
    ("trainer.min_epochs=-1", "trainer.min_epochs must be an integer >= 0 or null, got -1"),
    ("trainer.min_steps=-1", "trainer.min_steps must be an integer >= 0 or null, got -1"),
    ("trainer.num_nodes=0", "trainer.num_nodes must be an integer >= 1, got 0"),
    ("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches must be an integer >= 1"),
    ("trainer.gradient_clip_val=-1.0", "trainer.gradient_clip_val must be a finite number >= 0 or null"),
    ("trainer.log_every_n_steps=-1", "trainer.log_every_n_steps must be an integer >= 0 or null"),
    ("trainer.check_val_every_n_epoch=0", "trainer.check_val_every_n_epoch must be an integer >= 1"),
    ("trainer.num_sanity_val_steps=-2", "trainer.num_sanity_val_steps must be an integer >= -1"),
    # what only Lightning knows (a machine's accelerators, its precisions): asked before any work
    ("trainer.precision=33", "Precision 33 is invalid"),
    ("trainer.strategy=nope", "invalid strategy name: `strategy='nope'`"),
    ("trainer.limit_train_batches=1.5", "invalid value 1.5 for limit_train_batches"),
]


def not_a_folder(tmp_path: Path) -> Path:
    """A path under a regular file: no folder can be made there, whoever runs the test."""
    (tmp_path / "a_file").write_text("")
    return tmp_path / "a_file" / "folder"


def fails_before_any_work(entry, argv: list[str], tmp_path: Path, monkeypatch, capsys) -> str:
    """Run an entry point as its command line does (`main_guard`); it must exit with code 2,
    without a traceback and without having read any data or trained a tokenizer. Returns stderr."""
    def no_data(self):
        raise AssertionError("the data was read before the bad value was refused")

    monkeypatch.setattr(SubsequenceDataModule, "load_records", no_data)
    with pytest.raises(SystemExit) as exit_:
        tasks.cli.main_guard(lambda: entry.main(argv))
    stderr = capsys.readouterr().err
    assert exit_.value.code == 2, stderr
    assert "Traceback" not in stderr
    assert not (tmp_path / "tok").exists()  # tracking(tmp_path)'s data.tokenizer_cache
    return stderr


@pytest.mark.parametrize("decoder,override,message", DECODER_BAD_VALUES)
def test_bad_decoder_option_fails_before_any_work(decoder, override, message, tmp_path,
                                                  monkeypatch, capsys):
    stderr = fails_before_any_work(fit, ["--decoder", decoder, *TINY, *tracking(tmp_path), override],
                                   tmp_path, monkeypatch, capsys)
    assert message in stderr


@pytest.mark.parametrize("override,message", BAD_VALUES)
def test_bad_value_fails_before_any_work(override, message, tmp_path, monkeypatch, capsys):
    stderr = fails_before_any_work(fit, [*TINY, *tracking(tmp_path), override], tmp_path,
                                   monkeypatch, capsys)
    assert message in stderr


@pytest.mark.parametrize("decoder,override,message", DECODER_BAD_VALUES)
def test_the_constructor_refuses_the_same_values_in_the_same_words(decoder, override, message):
    """One statement of the ranges (`Decoder.options`): the constructor, for direct API users,
    raises a ValueError with the configuration check's message."""
    options = {k: v for k, v in compose("keyphrase", decoder, None, TINY).decoder.items() if k != "name"}
    key, value = override.split("=")
    options[key[len("decoder."):]] = yaml.safe_load(value)
    with pytest.raises(ValueError) as err:
        build_decoder(decoder, T5Config(d_model=32), SPECIAL, **options)
    assert str(err.value) == message


def test_onestep_without_a_trained_backbone_fails_before_any_work(tmp_path, monkeypatch, capsys):
    """onestep only learns proto-tokens on a frozen backbone: on a random one a fit would finish and
    mean nothing."""
    stderr = fails_before_any_work(fit, ["--decoder", "onestep", *TINY, *tracking(tmp_path)],
                                   tmp_path, monkeypatch, capsys)
    assert "decoder onestep trains only on a trained sequential model's backbone" in stderr
    assert "train.init_from=" in stderr


def test_a_lookup_fit_fails_before_any_work_naming_the_ways_to_use_it(tmp_path, monkeypatch, capsys):
    """lookup trains nothing: a fit would train a sequential model under its name."""
    stderr = fails_before_any_work(fit, ["--decoder", "lookup", *TINY, *tracking(tmp_path)],
                                   tmp_path, monkeypatch, capsys)
    assert "decoder lookup trains nothing: it decodes a trained sequential model as it is" in stderr
    assert "python -m tasks.test --ckpt SEQUENTIAL_CKPT decoder=lookup" in stderr
    assert "python -m tasks.compare --decoders sequential,lookup" in stderr


def test_a_frozen_blockwise_backbone_without_a_trained_one_fails_before_any_work(tmp_path, monkeypatch,
                                                                                 capsys):
    """Blockwise heads on a frozen random backbone would learn to guess noise."""
    stderr = fails_before_any_work(fit, ["--decoder", "blockwise", "decoder.freeze_backbone=true",
                                         *TINY, *tracking(tmp_path)], tmp_path, monkeypatch, capsys)
    assert ("decoder blockwise with decoder.freeze_backbone=true trains only on a trained sequential "
            "model's backbone") in stderr


def test_a_frozen_nar_encoder_without_a_trained_one_fails_before_any_work(tmp_path, monkeypatch, capsys):
    """A nar drafter keeping a random encoder would draft from noise, and share no verifier's."""
    stderr = fails_before_any_work(fit, ["--decoder", "nar", "decoder.freeze_encoder=true",
                                         *TINY, *tracking(tmp_path)], tmp_path, monkeypatch, capsys)
    assert ("decoder nar with decoder.freeze_encoder=true trains only on a trained sequential "
            "model's backbone") in stderr


def test_every_numeric_decoder_option_is_in_the_table():
    from decoders import available, decoder_class
    tested = {(decoder, override.split("=")[0][len("decoder."):])
              for decoder, override, _ in DECODER_BAD_VALUES}
    for name in available():
        # numeric by default, or with declared allowed values (pipelined's max_steps: null by
        # default; its stop_rule: a name)
        options = decoder_class(name).options
        numeric = {option for option, declared in options.items()
                   if (isinstance(declared.default, (int, float)) and not isinstance(declared.default, bool))
                   or declared.allowed is not None}
        assert numeric == {option for decoder, option in tested if decoder == name}, name


@pytest.mark.parametrize("key", ["tracking.artifact_location", "data.tokenizer_cache"])
def test_a_folder_that_cannot_be_made_fails_before_any_work(key, tmp_path, monkeypatch, capsys):
    folder = not_a_folder(tmp_path)
    stderr = fails_before_any_work(fit, [*TINY, *tracking(tmp_path), f"{key}={folder}"], tmp_path,
                                   monkeypatch, capsys)
    assert f"{key}={str(folder)!r} cannot be used as a folder" in stderr


@pytest.mark.parametrize("content", [{"state_dict": {}}, {"weights": torch.zeros(2)}, [1, 2]])
def test_a_file_without_the_library_keys_is_not_a_checkpoint(content, tmp_path, monkeypatch, capsys):
    foreign = tmp_path / "foreign.ckpt"
    torch.save(content, foreign)
    stderr = fails_before_any_work(fit, [*TINY, *tracking(tmp_path), f"train.init_from={foreign}"],
                                   tmp_path, monkeypatch, capsys)
    assert f"{foreign} is not a checkpoint written by tasks.fit: it has no hyper_parameters.cfg" in stderr
    stderr = fails_before_any_work(test_entry, ["--ckpt", str(foreign), *tracking(tmp_path)],
                                   tmp_path, monkeypatch, capsys)
    assert "is not a checkpoint written by tasks.fit" in stderr


@pytest.mark.parametrize("entry,argv,message", [
    ("compare", ["--decoders", "pipelined", "--sweep", "decoder.delay=1,0"],
     "decoder.delay must be an integer >= 1, got 0"),
    ("compare", ["--decoders", "sequential,blockwise", "--sweep", "decoder.block_size=4,1"],
     "decoder.block_size must be an integer >= 2"),
    ("compare", ["--decoders", "pipelined", "--sweep", "decoder.max_subsequences=0"],
     "decoder.max_subsequences must be an integer >= 1, got 0"),
    ("compare", ["--decoders", "sequential", "--ckpt", "some/path.ckpt"],
     "--ckpt 'some/path.ckpt': expected NAME=PATH with NAME one of --decoders (sequential)"),
    ("compare", ["--decoders", "sequential", "--ckpt", "nar=some/path.ckpt"],
     "--ckpt 'nar=some/path.ckpt': expected NAME=PATH with NAME one of --decoders (sequential)"),
    ("compare", ["--decoders", "sequential", "--speed-examples", "0"], "--speed-examples must be >= 1"),
    ("compare", ["--decoders", "sequential", "--threads", "-1"], "--threads must be >= 1"),
    ("compare", ["--decoders", "sequential", "trainer.devices=0"], "trainer.devices must be"),
    ("reference_calls", ["--decoders", "sequential,nar", "--sweep", "decoder.iterations=0,2"],
     "decoder.iterations must be an integer >= 1, got 0"),
])
def test_bad_comparison_arguments_fail_before_any_work(entry, argv, message, tmp_path, monkeypatch,
                                                       capsys):
    from tasks import compare
    from tasks.experiments import reference_calls
    module = {"compare": compare, "reference_calls": reference_calls}[entry]
    stderr = fails_before_any_work(module, [*argv, *TINY, *tracking(tmp_path)], tmp_path,
                                   monkeypatch, capsys)
    assert message in stderr


def test_command_line_exits_2_without_a_traceback(tmp_path):
    """The same through a real command line (one case: a process costs seconds of imports)."""
    done = subprocess.run([sys.executable, "-m", "tasks.fit", "--decoder", "pipelined", "decoder.delay=0",
                           *TINY, *tracking(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 2, done.stderr[-2000:]
    assert "error: decoder.delay must be an integer >= 1, got 0" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "tok").exists()
