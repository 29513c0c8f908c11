"""`tasks.predict`: records without their target in, the same records with the target predicted out,
as tasks.test decodes them, from the checkpoint alone; bad input and unusable checkpoints refused
before any decoding. The checkpoints are task modules saved untrained (`save_checkpoint`): nothing
here trains, and no test relies on what a random model outputs."""
import io
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

import datamodules.sources
import tasks.predictor
from datamodules.datamodule import SubsequenceDataModule, encode_sources
from datamodules.schema import TASKS, DataError, schema_for
from datamodules.sources import SPLITS, write_jsonl
from tasks import predict, test as test_entry
from tasks.config import ConfigError, compose
from tasks.predictor import Predictor, decoders_without_training
from tasks.module import GenerationTask
from tasks.cli import main_guard
from tasks.runs.checkpoints import load_checkpoint, stored_model
from tasks.runs.trainer import build
from tests.conftest import save_checkpoint
from tests.test_end_to_end import TINY, run_artifact_rows, tracking

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Saved:
    path: str             # the checkpoint
    records: list[dict]   # the test split of its data, targets included
    folder: Path          # where its configuration's tracking and tokenizer cache lie


def saved(folder: Path, task: str, decoder: str = "sequential", overrides=TINY) -> Saved:
    """A `task` module with `decoder` built on the built-in data and saved untrained (a large init
    scale, so that its outputs vary)."""
    built = build(compose(task, decoder, None, [*overrides, "model.initializer_factor=6",
                                                *tracking(folder)]))
    return Saved(save_checkpoint(built.module, folder / "model.ckpt"),
                 built.datamodule.records("test"), folder)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """`checkpoints(task, decoder)`: a `saved` checkpoint, made on first use."""
    made: dict[tuple[str, str], Saved] = {}

    def get(task: str, decoder: str = "sequential") -> Saved:
        if (task, decoder) not in made:
            made[task, decoder] = saved(tmp_path_factory.mktemp(f"{task}-{decoder}"), task, decoder)
        return made[task, decoder]
    return get


def without_target(records: list[dict], task: str) -> list[dict]:
    field = schema_for(task).target_field
    return [{key: value for key, value in record.items() if key != field} for record in records]


def written(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def refused(argv: list[str], monkeypatch, capsys) -> str:
    """stderr of `argv` run as the command line runs it: exit code 2 with one line, no traceback,
    nothing decoded and nothing on stdout."""
    monkeypatch.setattr(GenerationTask, "decode_batch", lambda *a: pytest.fail("decoded"))
    capsys.readouterr()  # what ran before
    with pytest.raises(SystemExit) as exit_:
        main_guard(lambda: predict.main(argv))
    out, err = capsys.readouterr()
    assert exit_.value.code == 2, err
    assert "Traceback" not in err and out == ""
    return err


@pytest.mark.parametrize("task", TASKS)
def test_records_come_back_in_order_with_their_fields_and_the_target_predicted(
        task, checkpoints, tmp_path, capsys):
    model = checkpoints(task)
    field = schema_for(task).target_field
    rows = without_target(model.records, task)
    for position, row in enumerate(rows):  # ids are optional; other fields are kept as they are
        row["extra"] = {"position": position, "note": "ünïcode"}
        if position % 2:
            del row["id"]
    result = predict.main(["--ckpt", model.path, "--input", written(tmp_path / "in.jsonl", rows),
                           "--batch-size", "3"])
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert out == result["predictions"] and len(out) == len(rows)
    for row, predicted in zip(rows, out):
        assert list(predicted) == [*row, field]
        assert {key: value for key, value in predicted.items() if key != field} == row
        assert isinstance(predicted[field], list)
        assert all(isinstance(text, str) for text in predicted[field])
    assert not (model.folder / "mlflow.db").exists()  # inference only: no MLflow run


@pytest.mark.parametrize("task", TASKS)
def test_predictions_are_those_tasks_test_writes(task, checkpoints, tmp_path, capsys):
    model = checkpoints(task)
    tested = test_entry.main(["--ckpt", model.path, "eval.batch_size=3", *tracking(tmp_path)])
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    rows = run_artifact_rows(client, tested["run_id"], tmp_path / "artifact")
    result = predict.main(["--ckpt", model.path, "--batch-size", "3", "--input",
                           written(tmp_path / "in.jsonl", without_target(model.records, task))])
    predicted = result["predictions"]
    assert [row["id"] for row in rows] == [record["id"] for record in predicted]
    assert [row["prediction"] for row in rows] == [r[schema_for(task).target_field] for r in predicted]
    assert any(row["prediction"] for row in rows)  # not vacuous: some outputs are not empty


def test_standard_input_to_standard_output_holds_the_records_only(checkpoints, tmp_path, capsys):
    model = checkpoints("keyphrase")
    source = written(tmp_path / "in.jsonl", without_target(model.records, "keyphrase"))
    predict.main(["--ckpt", model.path, "--input", source, "--out", str(tmp_path / "out.jsonl")])
    assert capsys.readouterr().out == ""
    done = subprocess.run([sys.executable, "-m", "tasks.predict", "--ckpt", model.path,
                           "--input", "-", "--batch-size", "3"], cwd=ROOT,
                          input=Path(source).read_bytes(), capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout == (tmp_path / "out.jsonl").read_bytes()  # logs and bar go to stderr
    assert b"predicting" in done.stderr


def test_out_is_written_whole_or_not_at_all(checkpoints, tmp_path, monkeypatch, capsys):
    model = checkpoints("keyphrase")
    source = written(tmp_path / "in.jsonl", without_target(model.records, "keyphrase"))
    out = tmp_path / "out.jsonl"
    result = predict.main(["--ckpt", model.path, "--input", source, "--out", str(out)])
    assert [json.loads(line) for line in out.read_text().splitlines()] == result["predictions"]
    before = out.read_text()

    def half_then_fail(rows, handle):
        handle.write(json.dumps(rows[0]) + "\n")
        raise OSError("No space left on device")

    monkeypatch.setattr(datamodules.sources, "dump_jsonl", half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        predict.main(["--ckpt", model.path, "--input", source, "--out", str(out)])
    assert out.read_text() == before  # the previous file, whole, and no temporary beside it
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


GOOD = {"title": "a title", "abstract": "an abstract"}


@pytest.mark.parametrize("second,message", [
    ('{"title": "a title", "abstract": ', "line 2: malformed JSON"),
    ('{"title": "a title"}', "line 2: missing field 'abstract' (a keyphrase record to predict "
                             "from needs title, abstract)"),
    ('{"title": "a title", "abstract": 3}', "line 2: field 'abstract' must be str, got int"),
    ('["a title", "an abstract"]', "line 2: expected a JSON object, got list"),
    (b'{"title": "\xff", "abstract": ""}', "line 2: not valid UTF-8"),
])
def test_a_bad_line_is_named_with_its_file_before_any_decoding(second, message, checkpoints,
                                                               tmp_path, monkeypatch, capsys):
    model = checkpoints("keyphrase")
    source = tmp_path / "in.jsonl"
    second = second if isinstance(second, bytes) else second.encode()
    source.write_bytes(json.dumps(GOOD).encode() + b"\n" + second + b"\n")
    out = tmp_path / "out.jsonl"
    stderr = refused(["--ckpt", model.path, "--input", str(source), "--out", str(out)],
                     monkeypatch, capsys)
    assert f"{source} {message}" in stderr
    assert not out.exists()
    # the same from standard input
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(source.read_bytes())))
    assert f"standard input {message}" in refused(["--ckpt", model.path, "--input", "-"],
                                                  monkeypatch, capsys)


def test_an_empty_or_missing_input_is_refused(checkpoints, tmp_path, monkeypatch, capsys):
    model = checkpoints("keyphrase")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    assert (f"{empty} holds no records (one JSON object per line, with title, abstract)"
            in refused(["--ckpt", model.path, "--input", str(empty)], monkeypatch, capsys))
    assert (f"--input {tmp_path}/missing.jsonl: no such file"
            in refused(["--ckpt", model.path, "--input", str(tmp_path / "missing.jsonl")],
                       monkeypatch, capsys))


def test_what_is_not_a_fitted_checkpoint_is_refused(checkpoints, tmp_path, monkeypatch, capsys):
    source = written(tmp_path / "in.jsonl", [GOOD])
    foreign, truncated = tmp_path / "foreign.ckpt", tmp_path / "truncated.ckpt"
    torch.save({"weights": torch.zeros(2)}, foreign)
    truncated.write_bytes(Path(checkpoints("keyphrase").path).read_bytes()[:1000])
    pretrained = tmp_path / "pretrained.ckpt"  # what tasks.experiments.pretrain writes
    torch.save({**load_checkpoint(checkpoints("keyphrase").path),
                "pretraining": {"objective": "text infilling"}}, pretrained)
    for path, message in (
            (foreign, f"{foreign} is not a checkpoint written by tasks.fit: it has no "
                      f"hyper_parameters.cfg and no state_dict"),
            (truncated, f"{truncated} is not a readable checkpoint"),
            (tmp_path / "missing.ckpt", f"{tmp_path}/missing.ckpt: no such checkpoint file"),
            (pretrained, f"checkpoint {pretrained} is a tasks.experiments.pretrain backbone "
                         f"(text infilling), trained for no task")):
        assert message in refused(["--ckpt", str(path), "--input", source], monkeypatch, capsys)


def test_the_trained_decoder_by_default_another_of_its_layout_on_request(
        checkpoints, tmp_path, monkeypatch, capsys):
    model = checkpoints("keyphrase", "blockwise")
    source = written(tmp_path / "in.jsonl", without_target(model.records, "keyphrase"))
    restored = []
    restore_module = tasks.predictor.restore_module

    def spy(*args):
        restored.append(restore_module(*args))
        return restored[-1]

    monkeypatch.setattr(tasks.predictor, "restore_module", spy)
    for overrides, name in (([], "blockwise"), (["decoder=sequential", "decoder.max_new_tokens=5"],
                                                "sequential")):
        result = predict.main(["--ckpt", model.path, "--input", source, *overrides])
        assert restored[-1].decoder.name == name
        assert all(isinstance(record["keyphrases"], list) for record in result["predictions"])
    assert restored[-1].decoder.max_new_tokens == 5  # a decoder option, as in tasks.test

    assert ("was trained with decoder 'blockwise'; decoder 'pipelined' cannot decode it (use "
            "decoder=blockwise, or another decoder of its layout: aggressive, lookup, sequential)"
            in refused(["--ckpt", model.path, "--input", source, "decoder=pipelined"],
                       monkeypatch, capsys))
    assert ("unknown decoder 'nope'; allowed: aggressive, blockwise, lookup, nar, onestep, pipelined, sequential"
            in refused(["--ckpt", model.path, "--input", source, "decoder=nope"], monkeypatch,
                       capsys))


@pytest.mark.parametrize("args,bar", [(["--batch-size", "4"], True), (["eval.batch_size=3"], True),
                                      ([], False), (["--batch-size", "8"], False)])
def test_a_progress_bar_shows_on_stderr_with_more_than_one_batch(args, bar, checkpoints, tmp_path,
                                                                capsys):
    model = checkpoints("keyphrase")
    assert len(model.records) == 8
    predict.main(["--ckpt", model.path, *args, "--input",
                  written(tmp_path / "in.jsonl", without_target(model.records, "keyphrase"))])
    assert ("predicting" in capsys.readouterr().err) == bar


@pytest.mark.parametrize("value", ["0", "-1", "x", "2.5"])
def test_batch_size_must_be_a_positive_integer(value, checkpoints, tmp_path, monkeypatch, capsys):
    model = checkpoints("keyphrase")
    stderr = refused(["--ckpt", model.path, "--input", written(tmp_path / "in.jsonl", [GOOD]),
                      f"--batch-size={value}"], monkeypatch, capsys)
    assert f"--batch-size must be an integer >= 1, got {value!r}" in stderr


def test_long_sources_are_cut_as_the_data_module_cuts_them(checkpoints, tmp_path, monkeypatch,
                                                          capsys, caplog):
    model = checkpoints("keyphrase")
    seen = []
    decode_batch = GenerationTask.decode_batch

    def spy(self, batch):
        seen.append(batch["input_ids"].cpu())
        return decode_batch(self, batch)

    monkeypatch.setattr(GenerationTask, "decode_batch", spy)
    predict.main(["--ckpt", model.path, "data.max_source_length=12", "--input",
                  written(tmp_path / "in.jsonl", without_target(model.records, "keyphrase"))])
    warned = caplog.text
    datamodule = SubsequenceDataModule(compose("keyphrase", None, None,
                                               [*TINY, "data.max_source_length=12"]),
                                       tokenizer=stored_model(load_checkpoint(model.path)).tokenizer)
    expected = next(iter(datamodule.ordered_loader("test")))["input_ids"]
    assert datamodule.report["test"].sources_truncated > 0  # not vacuous
    assert len(seen) == 1 and torch.equal(seen[0], expected)
    assert (f"{datamodule.report['test'].sources_truncated} of 8 sources truncated to "
            f"data.max_source_length=12 tokens" in warned)


def test_a_model_trained_on_a_jsonl_folder_predicts_after_the_folder_is_gone(tmp_path, monkeypatch,
                                                                            capsys):
    data = tmp_path / "data"
    data.mkdir()
    builtin = SubsequenceDataModule(compose("keyphrase", None, None, TINY))
    for split in SPLITS:
        write_jsonl(builtin.records(split), data / f"{split}.jsonl")
    model = saved(tmp_path, "keyphrase", overrides=[
        *(o for o in TINY if not o.startswith(tuple(f"data.{split}_size" for split in SPLITS))),
        "data=jsonl", f"data.path={data}"])
    shutil.rmtree(data)
    monkeypatch.setattr(SubsequenceDataModule, "load_records",
                        lambda self: pytest.fail("read the checkpoint's data"))
    result = predict.main(["--ckpt", model.path, "--input",
                           written(tmp_path / "in.jsonl", without_target(model.records, "keyphrase"))])
    assert [record["id"] for record in result["predictions"]] == [r["id"] for r in model.records]


# ---- from Python: tasks.predictor.Predictor ---------------------------------------------------

@pytest.mark.parametrize("task", TASKS)
def test_the_python_api_predicts_what_the_command_writes(task, checkpoints, tmp_path, capsys):
    model = checkpoints(task)
    records = without_target(model.records, task)
    source = written(tmp_path / "in.jsonl", records)
    from_command = predict.main(["--ckpt", model.path, "--input", source])["predictions"]
    predictor = Predictor.from_checkpoint(model.path)
    assert predictor.task == task
    assert predictor.predict(records) == from_command
    assert predictor.predict([]) == []


def test_the_python_api_takes_decoding_overrides(checkpoints):
    model = checkpoints("keyphrase", "pipelined")
    records = without_target(model.records, "keyphrase")
    plain = Predictor.from_checkpoint(model.path, device="cpu")
    assert plain.module.decoder.name == "pipelined" and plain.module.decoder.stop_rule == "first_empty"
    expected = plain.predict(records)
    # the batch size changes how, not what, is decoded
    assert Predictor.from_checkpoint(model.path, batch_size=1).predict(records) == expected
    paper = Predictor.from_checkpoint(model.path, stop_rule="all_end", precision="64-true")
    paper.predict(records[:1])
    assert paper.module.decoder.stop_rule == "all_end"
    assert next(paper.module.backbone.parameters()).dtype == torch.float64
    sequential = checkpoints("keyphrase", "sequential")
    assert Predictor.from_checkpoint(sequential.path, decoder="lookup").module.decoder.name == "lookup"


@pytest.mark.parametrize("decoder", ["pipelined", "nar"])
def test_a_checkpoint_storing_a_former_option_name_decodes_as_under_the_name_now(
        decoder, checkpoints, tmp_path, caplog):
    """Checkpoints written before the output bound was `max_new_tokens` everywhere store it as
    `decoder.max_length` (pipelined, nar, onestep): they load under the new name, with its stored
    value, and decode exactly as the same checkpoint stating the new name."""
    model = checkpoints("keyphrase", decoder)
    records = without_target(model.records, "keyphrase")[:6]
    checkpoint = load_checkpoint(model.path)
    stored = checkpoint["hyper_parameters"]["cfg"]["decoder"]
    bound = stored["max_new_tokens"] if decoder == "nar" else 5  # nar's bound shapes its weights
    paths = {}
    for name in ("max_new_tokens", "max_length"):
        options = {k: v for k, v in stored.items() if k != "max_new_tokens"}
        checkpoint["hyper_parameters"]["cfg"]["decoder"] = {**options, name: bound}
        paths[name] = str(tmp_path / f"{name}.ckpt")
        torch.save(checkpoint, paths[name])
    with caplog.at_level("WARNING", logger="tasks"):
        former = Predictor.from_checkpoint(paths["max_length"])
        predicted = former.predict(records)
    assert former.module.decoder.max_new_tokens == bound
    assert "decoder.max_length, which is now decoder.max_new_tokens" in caplog.text
    assert predicted == Predictor.from_checkpoint(paths["max_new_tokens"]).predict(records)


def test_the_python_api_refuses_bad_settings_and_records(checkpoints, tmp_path):
    model = checkpoints("keyphrase")
    with pytest.raises(ConfigError, match="no such checkpoint file"):
        Predictor.from_checkpoint(str(tmp_path / "missing.ckpt"))
    with pytest.raises(ConfigError, match="unknown decoder 'nope'; allowed: aggressive, blockwise"):
        Predictor.from_checkpoint(model.path, decoder="nope")
    with pytest.raises(ConfigError, match="device 'tpu' is not one of cpu, cuda, gpu, mps, auto"):
        Predictor.from_checkpoint(model.path, device="tpu")
    predictor = Predictor.from_checkpoint(model.path)
    with pytest.raises(DataError, match="record 2: .*abstract"):
        predictor.predict([{"title": "a", "abstract": "b"}, {"title": "no abstract"}])


# ---- any T5: a save_pretrained folder decodes as its own greedy generate --------------------------

T5_SMALL_TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "models" / "t5-small-tokenizer"


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory):
    """A small random T5 of t5-small's vocabulary, saved by transformers' save_pretrained beside
    the real t5-small tokenizer (../shared/models), as a T5 fine-tuned elsewhere would be."""
    if not T5_SMALL_TOKENIZER.is_dir():
        pytest.skip("../shared/models/t5-small-tokenizer not present")
    from transformers import AutoTokenizer, T5Config, T5ForConditionalGeneration
    torch.manual_seed(0)
    config = T5Config(vocab_size=32128, d_model=32, d_ff=64, d_kv=8, num_heads=2, num_layers=2,
                      num_decoder_layers=2, dropout_rate=0.0, decoder_start_token_id=0,
                      pad_token_id=0, eos_token_id=1, initializer_factor=3.0)
    folder = tmp_path_factory.mktemp("t5")
    T5ForConditionalGeneration(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(T5_SMALL_TOKENIZER)).save_pretrained(folder)
    return str(folder)


DOCUMENTS = [{"id": str(i), "document": text} for i, text in enumerate([
    "The council approved the new budget on Monday after a long debate.",
    "Heavy rain flooded several streets in the old town overnight.",
    "The team won its third match in a row thanks to a late goal.",
    "Scientists found a new species of frog in the northern forest.",
    "The museum will reopen next spring with a larger gallery.",
    "Prices of fresh vegetables rose sharply during the dry summer.",
    "A local bakery donated bread to the shelter every week this year.",
    "The bridge will be closed for repairs until the end of the month."])]


@pytest.mark.numerics
@pytest.mark.parametrize("decoder", ["sequential", "lookup"])
def test_a_t5_folder_decodes_exactly_as_its_greedy_generate(decoder, t5_folder):
    predictor = Predictor.from_pretrained(t5_folder, task="summarization", decoder=decoder,
                                          precision="64-true", device="cpu",
                                          overrides=["decoder.max_new_tokens=12"])
    predicted = predictor.predict(DOCUMENTS)
    module = predictor.module
    backbone, tokenizer = module.backbone, module.tokenizer
    assert next(backbone.parameters()).dtype == torch.float64
    sources, _ = encode_sources(tokenizer, "summarization", DOCUMENTS, 256)
    sep = tokenizer.convert_tokens_to_ids("<sep>")
    compared = 0
    for record, source in zip(predicted, sources):
        with torch.no_grad():
            generated = backbone.generate(input_ids=torch.tensor([source]), do_sample=False,
                                          num_beams=1, max_new_tokens=12)[0, 1:].tolist()
        if sep in generated:   # a random model may write the added separator: not a T5's text
            continue
        text = tokenizer.decode(generated, skip_special_tokens=True).strip()
        assert record["summary"] == ([text] if text else [])
        compared += 1
    assert compared >= 4   # not vacuous: most outputs hold no separator


def test_only_decoders_that_need_no_training_decode_a_t5_folder(t5_folder):
    assert decoders_without_training() == ["lookup", "sequential"]
    with pytest.raises(ConfigError, match="decoder 'blockwise' cannot decode a model trained "
                                          "elsewhere .* decoders that need no training: lookup, "
                                          "sequential"):
        Predictor.from_pretrained(t5_folder, task="summarization", decoder="blockwise")


def test_predict_decodes_a_t5_folder_from_the_command_line(t5_folder, tmp_path, capsys):
    source = written(tmp_path / "in.jsonl", DOCUMENTS[:2])
    result = predict.main(["--pretrained", t5_folder, "--task", "summarization", "--input", source,
                           "decoder=lookup", "trainer.accelerator=cpu"])
    expected = Predictor.from_pretrained(t5_folder, task="summarization", decoder="lookup",
                                         device="cpu").predict(DOCUMENTS[:2])
    assert result["predictions"] == expected
    with pytest.raises(ConfigError, match="--task"):
        predict.main(["--pretrained", t5_folder, "--input", source])
