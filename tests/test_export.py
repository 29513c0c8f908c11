"""`tasks.export`: a checkpoint of the sequential layout leaves as a `save_pretrained` folder whose
greedy `generate`, given only the inputs, writes the library's sequential tokens (float64, batched
with padding); one of another layout is refused saying why; a used folder is refused and a failed
export leaves nothing behind."""
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from decoders import build_decoder
from decoders.loop import split_flat_output, through_end
from tasks import export as export_entry
from tasks.config import ConfigError, compose
from tasks.runs.checkpoints import load_checkpoint
from tasks.runs.restore import checkpoint_config, restore_module
from tasks.runs.trainer import build
from tests.conftest import default_dtype, save_checkpoint
from tests.test_end_to_end import TINY, tracking
from tests.test_families import BUILT_TINY
from tests.test_predict import saved

pytestmark = pytest.mark.numerics


# the model built here of each family, with its overrides for a few dozen examples and a wide init
MODELS = {"t5-tiny": [*TINY, "model.initializer_factor=6"],
          **{f"{family}-tiny": [f"model={family}-tiny", *BUILT_TINY, "model.init_std=0.5"]
             for family in ("bart", "mbart", "pegasus", "marian")}}


def ending_checkpoint(folder: Path, decoder: str, texts: list[str], model: str = "t5-tiny") -> str:
    """A keyphrase module with `decoder` and `model`, saved untrained, whose sequential outputs of
    `texts` end at different lengths: the end token's output row is made a near copy of the row of
    the token its outputs repeat most (as tests.conftest.tiny_t5 does)."""
    module = build(compose("keyphrase", decoder, None, [*MODELS[model],
                                                       *tracking(folder)])).module.eval()
    special = module.decoder.special
    batch = module.tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = build_decoder("sequential", module.backbone.config, special, max_new_tokens=40).generate(
            module.backbone, batch["input_ids"], batch["attention_mask"])
        tokens = [token for example in out.subsequences for part in example for token in part]
        favourite = max(set(tokens), key=tokens.count)
        head = module.backbone.get_output_embeddings().weight
        head[special.eos] = head[favourite] * 1.02
    return save_checkpoint(module, folder / "model.ckpt")


@pytest.mark.parametrize("decoder, model", [("sequential", "t5-tiny"), ("blockwise", "t5-tiny"),
                                            *[("sequential", model) for model in list(MODELS)[1:]]])
def test_an_exported_model_generates_the_sequential_decoders_tokens(decoder, model, tmp_path):
    texts = [record["title"] for record in saved(tmp_path / "data", "keyphrase").records[:6]]
    path = ending_checkpoint(tmp_path, decoder, texts, model)
    out = export_entry.main(["--ckpt", path, "--out", str(tmp_path / "exported")])
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        path.name for path in out.iterdir()}
    stored = load_checkpoint(path)
    module = restore_module(stored, path, checkpoint_config(stored, path, ["decoder=sequential"]))
    tokenizer = AutoTokenizer.from_pretrained(out)
    batch = tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=64)
    assert batch["attention_mask"].sum(1).unique().numel() > 1, "rows of different lengths"
    with default_dtype(torch.float64), torch.no_grad():
        exported = AutoModelForSeq2SeqLM.from_pretrained(out, dtype=torch.float64).eval()
        generated = exported.generate(input_ids=batch["input_ids"],
                                      attention_mask=batch["attention_mask"])[:, 1:].tolist()
        backbone = module.backbone.double().eval()
        special = module.decoder.special
        bound = exported.generation_config.max_new_tokens
        ours = build_decoder("sequential", backbone.config, special, max_new_tokens=bound).generate(
            backbone, batch["input_ids"], batch["attention_mask"])
    cut = [through_end(row, special.eos) for row in generated]
    assert [len(row) for row in cut] == ours.tokens
    assert len(set(ours.tokens)) > 1 and not all(ours.bound_hit), "outputs ending at their end token"
    assert all(len(row) <= bound for row in generated)
    assert [split_flat_output(row, special)[0] for row in cut] == ours.subsequences


@pytest.mark.parametrize("decoder", ["pipelined", "nar"])
def test_a_layout_generate_cannot_decode_is_refused(decoder, tmp_path):
    checkpoint = saved(tmp_path, "keyphrase", decoder)
    with pytest.raises(ConfigError, match=rf"trained with decoder '{decoder}', whose model "
                                          r"transformers' generate cannot decode"):
        export_entry.main(["--ckpt", checkpoint.path, "--out", str(tmp_path / "exported")])
    assert not (tmp_path / "exported").exists()


def test_a_used_folder_is_refused_and_a_failed_export_leaves_nothing(tmp_path, monkeypatch):
    checkpoint = saved(tmp_path, "keyphrase")
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"--out .*used: exists and is not an empty folder"):
        export_entry.main(["--ckpt", checkpoint.path, "--out", str(used)])
    assert [path.name for path in used.iterdir()] == ["keep.txt"]

    def failing(self, folder, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr("transformers.PreTrainedTokenizerBase.save_pretrained", failing)
    with pytest.raises(OSError, match="disk full"):
        export_entry.main(["--ckpt", checkpoint.path, "--out", str(tmp_path / "exported")])
    assert sorted(path.name for path in tmp_path.iterdir() if "exported" in path.name) == []
