"""A pretrained T5 from a local folder (`model=t5-small model.hub_id=DIR`), without the hub: its
tokenizer keeps T5's sentinels beside `<sep>`/`<mask>`, its backbone loads from the folder, and its
checkpoints carry tokenizer and architecture, so that they are tested, resumed and compared after
the folder is gone.

The folder is made at test time: the real t5-small tokenizer files from ../shared (never copied
into the repository) and random weights of a shrunk t5-small configuration."""
import shutil
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
import safetensors.torch
from transformers import (AutoTokenizer, MT5Config, MT5ForConditionalGeneration,
                          ProphetNetConfig, ProphetNetForConditionalGeneration, T5Config,
                          T5ForConditionalGeneration)

from datamodules import tokenizer as tok
from decoders import build_decoder
from decoders.loop import split_flat_output, through_end
from decoders.transformers_internals import attention_implementation
from tasks import compare, fit, test as test_entry
from tasks.config import compose
from tasks.models import ModelError, build_backbone
from tasks.predictor import Predictor
from tasks.runs import trainer
from tests.conftest import default_dtype
from tests.test_end_to_end import TINY, run_artifact_rows, tracking, weights
from tests.test_faults import quality_and_counts

T5_FILES = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "t5-small-tokenizer"
needs_t5_files = pytest.mark.skipif(not T5_FILES.is_dir(), reason=f"{T5_FILES} not present")
SENTINELS = [f"<extra_id_{i}>" for i in range(100)]
# Punctuation, also after a space as in tokenized data (T5's tokenizer drops such spaces when
# decoding), a sentinel and the library's own special tokens.
TEXTS = ["Graph coloring, planar graphs. It's NP-hard (in general)!",
         "we study graph coloring . it 's np-hard , in general",
         "fill <extra_id_0> in", "first <sep> second <mask> third", "ünïcödé — text"]


def local_t5_small(folder: Path, **config) -> Path:
    """A folder as `save_pretrained` leaves a t5-small: the real tokenizer files, and random weights
    of t5-small's configuration shrunk to one small layer each side (`config` changes more)."""
    folder.mkdir()
    for name in ("spiece.model", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(T5_FILES / name, folder)
    shrunk = T5Config.from_pretrained(T5_FILES, num_layers=1, num_decoder_layers=1, d_model=32,
                                      d_ff=64, d_kv=8, num_heads=2, **config)
    torch.manual_seed(0)
    T5ForConditionalGeneration(shrunk).save_pretrained(folder)
    return folder


@needs_t5_files
def test_pretrained_tokenizer_keeps_t5_sentinels_beside_sep_and_mask(no_hub):
    plain = AutoTokenizer.from_pretrained(T5_FILES)
    tokenizer = tok.load_pretrained(str(T5_FILES))
    # still special tokens (kept whole, skipped when decoding), with their ids
    assert set(SENTINELS) <= set(tokenizer.all_special_tokens)
    assert tokenizer.convert_tokens_to_ids(SENTINELS) == plain.convert_tokens_to_ids(SENTINELS)
    assert len(plain) == 32100 and len(tokenizer) == 32102
    assert tokenizer.convert_tokens_to_ids([tok.SEP, tok.MASK]) == [32100, 32101]
    special = tok.special_tokens(tokenizer, 0)
    assert (special.pad, special.eos, special.unk, special.sep, special.mask) == (0, 1, 2, 32100, 32101)
    ids = tokenizer("fill <extra_id_0> in <sep> here", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_tokens_to_ids("<extra_id_0>") in ids and special.sep in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "fill in here"


@pytest.mark.parametrize("kind", ["trained", "pretrained"])
def test_tokenizer_rebuilt_from_a_checkpoint_encodes_and_decodes_alike(kind, tmp_path, no_hub):
    if kind == "pretrained":
        if not T5_FILES.is_dir():
            pytest.skip(f"{T5_FILES} not present")
        tokenizer = tok.load_pretrained(str(T5_FILES))
    else:
        tokenizer = tok.train_or_load(TEXTS * 10, 200, tmp_path / "cache")
    path = tmp_path / "stored.ckpt"
    torch.save(dict(zip(("tokenizer_json", "tokenizer_settings"), tok.serialize(tokenizer))), path)
    stored = torch.load(path, weights_only=True)  # plain data: no pickled objects
    rebuilt = tok.from_serialized(stored["tokenizer_json"], stored["tokenizer_settings"])
    assert len(rebuilt) == len(tokenizer)
    assert rebuilt.all_special_tokens == tokenizer.all_special_tokens
    assert tok.special_tokens(rebuilt, 0) == tok.special_tokens(tokenizer, 0)
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert rebuilt(text, add_special_tokens=False)["input_ids"] == ids
        for skip in (True, False):
            assert rebuilt.decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)


@needs_t5_files
def test_pretrained_backbone_loads_from_a_local_folder_and_from_a_stored_config(tmp_path, no_hub):
    # t5-small's embedding has 28 spare rows beyond its tokenizer; without them <sep> and <mask>
    # need new ones
    folder = local_t5_small(tmp_path / "t5", vocab_size=32100)
    model = compose(overrides=["model=t5-small", f"model.hub_id={folder}", "model.dropout=0.2"]).model
    tokenizer = tok.load_pretrained(model.hub_id)
    backbone = build_backbone(model, tokenizer)
    assert backbone.get_input_embeddings().num_embeddings == len(tokenizer) == 32102
    assert attention_implementation(backbone.config) == "sdpa" and backbone.config.dropout_rate == 0.2
    saved = T5ForConditionalGeneration.from_pretrained(folder).state_dict()
    loaded = backbone.state_dict()
    assert all(torch.equal(loaded[key], value) for key, value in saved.items() if "shared" not in key
               and "embed_tokens" not in key and "lm_head" not in key)
    assert torch.equal(loaded["shared.weight"][:32100], saved["shared.weight"])

    # the architecture a checkpoint stores rebuilds the backbone without the folder
    stored = backbone.config.to_dict()
    shutil.rmtree(folder)
    again = build_backbone(model, tokenizer, stored)
    again.load_state_dict(loaded)  # same shapes, strictly
    assert attention_implementation(again.config) == "sdpa" and again.config.dropout_rate == 0.2


@needs_t5_files
def test_a_missing_or_incomplete_model_folder_is_named(tmp_path, no_hub):
    with pytest.raises(tok.TokenizerError, match=r"model.hub_id='.*/gone' is not a folder"):
        tok.load_pretrained(str(tmp_path / "gone"))
    with pytest.raises(tok.TokenizerError, match=r"model.hub_id='\./gone' is not a folder"):
        tok.load_pretrained("./gone")
    # the shared folder itself has the tokenizer and config but no weights
    model = compose(overrides=["model=t5-small", f"model.hub_id={T5_FILES}"]).model
    with pytest.raises(ModelError, match=r"cannot load pretrained weights '.*t5-small-tokenizer' "
                                         r"\(model.hub_id, a local folder.*no file named model"):
        build_backbone(model, tok.load_pretrained(model.hub_id))


def tiny_prophetnet_folder(folder: Path) -> Path:
    """A folder as ProphetNet's `save_pretrained` leaves it (configuration and random weights)."""
    config = ProphetNetConfig(vocab_size=64, hidden_size=16, encoder_ffn_dim=32, decoder_ffn_dim=32,
                              num_encoder_layers=1, num_decoder_layers=1,
                              num_encoder_attention_heads=2, num_decoder_attention_heads=2,
                              max_position_embeddings=64)
    ProphetNetForConditionalGeneration(config).save_pretrained(folder)
    return folder


def test_a_model_of_a_type_the_decoders_do_not_run_is_refused_before_any_work(tmp_path, no_hub,
                                                                              monkeypatch):
    """A ProphetNet folder (its decoder predicts n-gram streams, which no family adapter runs) is
    refused, naming its model type and the types that run, before a tokenizer, data or weights are
    read."""
    folder = tiny_prophetnet_folder(tmp_path / "prophetnet")
    monkeypatch.setattr(tok, "load_pretrained", lambda *_: pytest.fail("the tokenizer was read"))
    expected = r"model.hub_id='.*prophetnet' is a 'prophetnet' model " \
               r"\(ProphetNetForConditionalGeneration\); the decoders run these model types: t5, " \
               r"mt5, longt5, umt5, bart, mbart, pegasus, marian"
    with pytest.raises(ModelError, match=expected):
        Predictor.from_pretrained(str(folder), task="summarization")
    monkeypatch.setattr(trainer, "build", lambda *_, **__: pytest.fail("data was read"))
    with pytest.raises(ModelError, match=expected):
        fit.main(["--task", "summarization", "--decoder", "sequential", "model=t5-small",
                  f"model.hub_id={folder}", *tracking(tmp_path)])
    model = compose(overrides=["model=t5-small", f"model.hub_id={folder}"]).model
    with pytest.raises(ModelError, match=expected):
        build_backbone(model, None)


@needs_t5_files
def test_weights_that_do_not_load_whole_are_refused(tmp_path, no_hub):
    """A T5 folder missing one weight would decode from that weight's random start: refused,
    naming what is missing."""
    folder = local_t5_small(tmp_path / "t5", vocab_size=32100)
    weights_file = folder / "model.safetensors"
    tensors = safetensors.torch.load_file(weights_file)
    dropped = "decoder.block.0.layer.2.DenseReluDense.wo.weight"
    del tensors[dropped]
    safetensors.torch.save_file(tensors, weights_file, metadata={"format": "pt"})
    model = compose(overrides=["model=t5-small", f"model.hub_id={folder}"]).model
    with pytest.raises(ModelError, match=rf"do not load whole into a T5ForConditionalGeneration: 1 missing .*\({dropped}\)"):
        build_backbone(model, tok.load_pretrained(model.hub_id))


@needs_t5_files
@pytest.mark.float64
def test_an_mt5_folder_decodes_as_its_own_generate(tmp_path, no_hub):
    """mT5 is T5's layout with gated feed-forward layers and untied output weights: its folder
    loads whole, and the sequential decoder gives MT5's own greedy tokens."""
    folder = tmp_path / "mt5"
    folder.mkdir()
    for name in ("spiece.model", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(T5_FILES / name, folder)
    config = MT5Config(vocab_size=32100, d_model=32, d_ff=64, d_kv=8, num_heads=2, num_layers=1,
                       num_decoder_layers=1, decoder_start_token_id=0, eos_token_id=1, pad_token_id=0,
                       initializer_factor=4.0)
    torch.manual_seed(0)
    with default_dtype(torch.float64):
        MT5ForConditionalGeneration(config).save_pretrained(folder)
        model = compose(overrides=["model=t5-small", f"model.hub_id={folder}", "model.dropout=0.0",
                                   "model.attn_implementation=eager"]).model
        tokenizer = tok.load_pretrained(model.hub_id)
        backbone = build_backbone(model, tokenizer).eval()
        reference = MT5ForConditionalGeneration.from_pretrained(folder).eval()
        input_ids = torch.randint(5, 32000, (4, 9), generator=torch.Generator().manual_seed(1))
        attention_mask = torch.ones_like(input_ids)
        attention_mask[1:, 6:] = 0
        special = tok.special_tokens(tokenizer, backbone.config.decoder_start_token_id)
        out = build_decoder("sequential", backbone.config, special, max_new_tokens=12).generate(
            backbone, input_ids, attention_mask)
        greedy = reference.generate(input_ids=input_ids, attention_mask=attention_mask,
                                    do_sample=False, num_beams=1, max_new_tokens=12)[:, 1:].tolist()
    expected = [through_end(row, special.eos) for row in greedy]
    assert out.tokens == [len(row) for row in expected]
    assert out.subsequences == [split_flat_output(row, special)[0] for row in expected]


@pytest.mark.slow
@needs_t5_files
def test_pretrained_from_a_local_folder_end_to_end_then_without_it(tmp_path, no_hub):
    """fit from the folder; then, with the folder moved away, tasks.test gives the fit's
    predictions, an interrupted fit resumes, a new fit starts from the checkpoint
    (train.init_from) and tasks.compare scores it; a fit that needs the folder fails naming it,
    before any run is made."""
    # a large initialisation scale: a random model whose outputs differ between examples
    folder = local_t5_small(tmp_path / "t5-small", initializer_factor=6.0)
    args = ["--task", "keyphrase", "model=t5-small", f"model.hub_id={folder}",
            *[o for o in TINY if not o.startswith(("model.", "data.max_target_length"))],
            "data.max_target_length=12", *tracking(tmp_path)]
    fitted = fit.main(args)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.get_run(fitted["run_id"])
    assert run.data.params["train.lr"] == "0.0003"  # t5-small's default, not t5-tiny's 1e-3
    predicted = [row["prediction"] for row in run_artifact_rows(client, fitted["run_id"], tmp_path / "fit")]
    assert len({tuple(p) for p in predicted}) > 1
    checkpoint = torch.load(fitted["checkpoint"], map_location="cpu", weights_only=True)
    assert checkpoint["backbone_config"]["d_model"] == 32
    assert set(SENTINELS) <= set(checkpoint["tokenizer_settings"]["additional_special_tokens"])

    folder.rename(tmp_path / "moved")
    tested = test_entry.main(["--ckpt", fitted["checkpoint"], *tracking(tmp_path),
                              "trainer.enable_progress_bar=false"])
    assert [row["prediction"] for row in run_artifact_rows(client, tested["run_id"], tmp_path / "test")] \
        == predicted
    assert quality_and_counts(tested["scores"]) == quality_and_counts(fitted["scores"])

    # an interrupted fit goes on from its last checkpoint (here one marked failed after its only
    # epoch: the resume restores model and optimizer, has nothing left to train, and tests)
    client.set_terminated(fitted["run_id"], "FAILED")
    resumed = fit.main([*args, "--resume", fitted["run_id"]])
    assert resumed["run_id"] == fitted["run_id"]
    assert client.get_run(fitted["run_id"]).info.status == "FINISHED"
    assert quality_and_counts(resumed["scores"]) == quality_and_counts(fitted["scores"])

    # a new fit starts from the checkpoint's backbone (blockwise heads on the frozen backbone)
    started = fit.main([*args, "--decoder", "blockwise", f"train.init_from={fitted['checkpoint']}",
                        "decoder.freeze_backbone=true"])
    start, end = weights(fitted["checkpoint"]), weights(started["checkpoint"])
    assert all(torch.equal(start[key], end[key]) for key in start if key.startswith("backbone."))

    result = compare.main(["--task", "keyphrase", "--decoders", "sequential", "--ckpt",
                           f"sequential={fitted['checkpoint']}", "--repeats", "1",
                           "--speed-examples", "2", "--out", str(tmp_path / "comparison.json"),
                           *args[2:]])
    assert result["model"] == "t5-small" and len(result["rows"]) == 1

    runs = len(client.search_runs([run.info.experiment_id]))
    # its model type is read first, from the folder's configuration
    with pytest.raises(ModelError, match=r"model.hub_id='.*/t5-small' is not a folder"):
        fit.main(args)
    assert len(client.search_runs([run.info.experiment_id])) == runs
