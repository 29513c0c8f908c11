"""`tasks.experiments.pretrain`: the infilling corruption by hand, the denoising data, and the command end to end
into `tasks.fit ... train.init_from=` (slow)."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from mlflow.tracking import MlflowClient

from datamodules.denoising import DenoisingDataModule, example_rng, infill
from datamodules.schema import DataError
from datamodules.tokenizer import serialize
from tasks.experiments import pretrain
from tasks.config import ConfigError, compose
from tasks.runs.checkpoints import load_checkpoint
from tasks.runs.trainer import train_and_test
from tasks.runs.restore import checkpoint_config

MASK = 4
TINY_MODEL = ["model.d_model=32", "model.d_ff=64", "model.d_kv=16", "model.num_heads=2",
              "model.position_heads.encoder=[-1,1]", "model.vocab_size=300"]
TINY = [*TINY_MODEL, "data.max_target_length=40", "train.batch_size=8", "trainer.max_epochs=1",
        "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false"]
WORDS = ["graph", "network", "learning", "model", "data", "search", "query", "index", "vertex",
         "edge", "tree", "cache", "span", "answer", "keyphrase", "summary", "method", "result"]


def tracking(tmp_path: Path) -> list[str]:
    return [f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
            f"tracking.artifact_location={tmp_path}/artifacts",
            f"data.tokenizer_cache={tmp_path}/tok"]


def undo(corrupted: list[int], original: list[int]) -> list[int]:
    """The lengths of the spans each mask of `corrupted` hides, checking that the visible tokens
    are `original`'s, in order, and that every mask hides at least one token (found greedily:
    the visible token after a mask is matched at its first place after at least one hidden)."""
    spans, position = [], 0
    for i, token in enumerate(corrupted):
        if token != MASK:
            assert original[position] == token
            position += 1
            continue
        assert i == 0 or corrupted[i - 1] != MASK, "two masks in a row would be one span"
        following = corrupted[i + 1] if i + 1 < len(corrupted) else None
        end = len(original) if following is None else original.index(following, position + 1)
        spans.append(end - position)
        position = end
    assert position == len(original)
    return spans


def test_infill_hides_spans_behind_one_mask_each():
    original = list(range(10, 40))  # distinct tokens, so the spans can be read back
    corrupted = infill(original, MASK, np.random.default_rng(0), mask_ratio=0.3, mean_span=3)
    spans = undo(corrupted, original)
    assert sum(spans) == 9 and len(spans) == 3  # round(30 * 0.3) tokens, in round(9 / 3) spans
    assert len(corrupted) == 30 - 9 + 3
    # by hand: a text of 2 tokens hides 1 (round(0.6)), a text of 1 token hides none
    assert infill([7, 8], MASK, np.random.default_rng(1), 0.3, 3) in ([MASK, 8], [7, MASK])
    assert infill([7], MASK, np.random.default_rng(1), 0.3, 3) == [7]
    # the same draw gives the same corruption; other epochs, examples or seeds another one
    draws = {(seed, epoch, index): infill(original, MASK, example_rng(seed, "train", epoch, index),
                                          0.3, 3)
             for seed in (0, 1) for epoch in (0, 1) for index in (0, 1)}
    assert draws[0, 0, 0] == infill(original, MASK, example_rng(0, "train", 0, 0), 0.3, 3)
    assert len({tuple(c) for c in draws.values()}) == len(draws)
    # a large ratio and long spans stay exact: many drawn texts, every one readable back
    for index in range(50):
        corrupted = infill(original, MASK, example_rng(0, "train", 0, index), 0.8, 6)
        assert sum(undo(corrupted, original)) == 24


def write_folder(folder: Path, task: str, splits=("train", "validation", "test"), count: int = 24):
    """A JSONL folder of `count` generated records per split in `task`'s schema."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(len(task))
    for split in splits:
        rows = []
        for i in range(count):
            words = [str(w) for w in rng.choice(WORDS, 30)]
            text = " ".join(words)
            if task == "keyphrase":
                rows.append({"id": f"{split}-{i}", "title": " ".join(words[:4]), "abstract": text,
                             "keyphrases": [" ".join(words[5:7]), words[10]]})
            else:
                rows.append({"id": f"{split}-{i}", "question": "which " + words[0],
                             "context": text, "answers": [words[3], words[8]]})
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_denoising_data_targets_the_original_text(tmp_path):
    folders = [write_folder(tmp_path / "kp", "keyphrase"),
               write_folder(tmp_path / "qa", "qa", splits=("train",))]
    cfg = compose(overrides=[*TINY, f"data.tokenizer_cache={tmp_path}/tok", "data.max_train_examples=10"])
    data = DenoisingDataModule(cfg, folders, mask_ratio=0.3, mean_span=3)
    data.setup()
    assert [f.task for f in data.folders] == ["keyphrase", "qa"]
    assert len(data.texts["train"]) == 20 and len(data.validation) == 24  # qa has no validation
    assert data.window == 39 and data.folders[0].truncated["train"] == 0
    mask = data.tokenizer.convert_tokens_to_ids("<mask>")
    example = data.example("train", 0, 3)
    text = data.texts["train"][3]
    assert example.target_ids == [text] and example.source_ids[-1] == data.tokenizer.eos_token_id
    assert mask in example.source_ids and len(example.source_ids) < len(text) + 1
    assert data.tokenizer.decode(text) == data.folders[0].sources["train"][3]
    assert data.example("train", 0, 3) == example and data.example("train", 1, 3) != example
    batch = next(iter(data.train_dataloader()))
    assert batch["input_ids"].shape[0] == 8 and len(batch["targets"]) == 8


def test_bad_folders_are_refused_before_any_work(tmp_path):
    folder = write_folder(tmp_path / "kp", "keyphrase")
    without = tmp_path / "empty"
    without.mkdir()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "train.jsonl").write_text(json.dumps({"id": "1", "text": "a b"}) + "\n")
    for data, message in ((tmp_path / "missing", "missing is not a folder"),
                          (without, "folder .*empty has no train.jsonl"),
                          (foreign, (r"foreign/train.jsonl is in no single known schema \(the "
                                     r"fields of its first record: id, text"))):
        with pytest.raises(DataError, match=message):
            pretrain.main(["--data", f"{folder},{data}", *TINY, *tracking(tmp_path)])
    with pytest.raises(ConfigError, match="--mask-ratio must be a finite number > 0 and < 1, got 1.5"):
        pretrain.main(["--data", str(folder), "--mask-ratio", "1.5", *TINY, *tracking(tmp_path)])
    with pytest.raises(ConfigError, match="trains model=t5-tiny"):
        pretrain.main(["--data", str(folder), "model=t5-small", *tracking(tmp_path)])
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "tok").exists()


def test_a_pretraining_checkpoint_is_refused_where_a_task_checkpoint_is_needed():
    """tasks.test, tasks.compare --ckpt and the other readers of a fitted checkpoint go through
    `checkpoint_config`: a denoising backbone is named as such, with what to do instead."""
    checkpoint = {"pretraining": {"objective": "text infilling"},
                  "hyper_parameters": {"cfg": compose("keyphrase", "sequential")}}
    with pytest.raises(ConfigError) as err:
        checkpoint_config(checkpoint, "pre.ckpt", [])
    assert str(err.value) == (
        "checkpoint pre.ckpt is a tasks.experiments.pretrain backbone (text infilling), trained for no task: "
        "fit a decoder from it with `python -m tasks.fit --task TASK --decoder DECODER "
        "train.init_from=pre.ckpt`, then test that fit's checkpoint")
    del checkpoint["pretraining"]
    assert checkpoint_config(checkpoint, "fit.ckpt", []).decoder.name == "sequential"


class BackboneAtStart(Callback):
    """The backbone's weights as the fit starts."""

    def on_fit_start(self, trainer, pl_module):
        self.weights = {k: v.clone() for k, v in pl_module.backbone.state_dict().items()}


@pytest.mark.slow
def test_pretrain_then_fit_from_its_checkpoint(tmp_path):
    """Pretraining lowers the reconstruction loss; its checkpoint is a valid `train.init_from`: the
    fit starts from its backbone weights and uses its tokenizer (no tokenizer is trained)."""
    kp = write_folder(tmp_path / "kp", "keyphrase")
    qa = write_folder(tmp_path / "qa", "qa")
    out = tmp_path / "pre" / "denoiser.pt"
    result = pretrain.main(["--data", f"{kp},{qa}", "--out", str(out), *TINY, "trainer.max_epochs=4",
                            "train.warmup_steps=0", "seed=3", *tracking(tmp_path)])
    assert result["checkpoint"] == str(out) and out.is_file()
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.get_run(result["run_id"])
    assert client.get_experiment(run.info.experiment_id).name == "pretrain"
    assert run.info.status == "FINISHED" and run.data.params["pretrain.mask_ratio"] == "0.3"
    assert run.data.params["data_report.kp.train.texts"] == "24"
    assert {i.dataset.name for i in run.inputs.dataset_inputs} == {"kp", "qa"}
    validation = [m.value for m in client.get_metric_history(run.info.run_id, "val/loss")]
    assert len(validation) == 4 and validation[-1] < validation[0] - 0.1
    assert client.get_metric_history(run.info.run_id, "train/loss")

    checkpoint = load_checkpoint(str(out))  # weights_only, as train.init_from loads it
    assert checkpoint["pretraining"]["objective"] == "text infilling"
    fresh_cache = tmp_path / "unused_tokenizer_cache"
    cfg = compose("keyphrase", "pipelined", None,
                  [*TINY, "data=jsonl", f"data.path={kp}", f"train.init_from={out}",
                   *tracking(tmp_path), f"data.tokenizer_cache={fresh_cache}"])
    at_start = BackboneAtStart()
    fitted = train_and_test(cfg, callbacks=[at_start])
    assert not fresh_cache.exists()
    pretrained = {k[len("backbone."):]: v for k, v in checkpoint["state_dict"].items()
                  if k.startswith("backbone.")}
    assert pretrained.keys() == at_start.weights.keys()
    assert all(torch.equal(pretrained[k], at_start.weights[k]) for k in pretrained)
    assert serialize(fitted.built.datamodule.tokenizer)[0] == checkpoint["tokenizer_json"]
    assert fitted.tested.quality["present_f1_at_M"] >= 0

    with pytest.raises(ConfigError, match=r"holds another model: model.d_model: 32 in the "
                                          r"checkpoint, 64 now"):
        train_and_test(compose(overrides=[*TINY, "model.d_model=64", f"train.init_from={out}",
                                          *tracking(tmp_path)]))
