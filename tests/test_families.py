"""Every decoder on every type beside T5 and mT5 (BART, mBART, Pegasus, Marian, LongT5, UMT5), through the
one backbone interface (`decoders.families`): the lossless decoders give transformers' greedy `generate` tokens,
batched with padding, in float64; pipelined equals its plain reference and its first subsequence
is greedy decoding; nar and onestep train and decode."""
from __future__ import annotations

import pytest
import torch
from mlflow.tracking import MlflowClient
from transformers import AutoModelForSeq2SeqLM

from decoders import available, build_decoder
from decoders.backbone import decoder_inputs, run_decoder, sizes
from decoders.families import family_of
from decoders.loop import through_end
from tasks import fit, test as test_entry
from tasks.bench import bounded
from tasks.bench.sync_points import counting_sync_points
from tasks.comparison.timing import PLAIN_GREEDY, TransformersGenerate
from tasks.config import ConfigError, compose
from tasks.predictor import Predictor
from tasks.runs.trainer import build
from tests.conftest import save_checkpoint
from tests.test_end_to_end import run_artifact_rows, tracking
from tests.families import (BART_LIKE, FAMILY_TYPES, FIRST_ORDINARY, family_batch, family_special,
                            family_tokenizer, tiny_family_model)
from tests.test_pipelined import assert_equals_reference

pytestmark = [pytest.mark.float64, pytest.mark.numerics]   # decodes random models in float64

BOUND = 16
LOSSLESS = ("sequential", "lookup", "blockwise", "aggressive")


def decoder_for(name: str, model, **options):
    special = family_special(model.config.model_type)
    decoder = build_decoder(name, model.config, special, **options).eval()
    if name == "aggressive":   # a random Mask-Predict drafter on a second model of the family
        drafter_model = tiny_family_model(model.config.model_type, seed=2)
        drafter = build_decoder("nar", drafter_model.config, special, max_new_tokens=BOUND).eval()
        decoder.attach_drafter(drafter, drafter_model)
    return decoder


def greedy(model, input_ids, attention_mask):
    special = family_special(model.config.model_type)
    return TransformersGenerate(BOUND, special).generate(model, input_ids, attention_mask)


def varied_batch(model, batch_size: int = 5):
    """The first seeded batch whose greedy outputs write at least three distinct tokens and stop
    at different steps, some by their end token: equalities on it are not vacuous."""
    model_type = model.config.model_type
    for seed in range(40):
        input_ids, attention_mask = family_batch(model_type, batch_size, seed=seed)
        out = greedy(model, input_ids, attention_mask)
        written = {token for row in out.subsequences for sub in row for token in sub}
        if len(written) >= 3 and len(set(out.tokens)) >= 2 and not all(out.bound_hit):
            return input_ids, attention_mask
    raise AssertionError(f"no varied batch for the {model_type} model")


@pytest.mark.parametrize("name", LOSSLESS)
@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_lossless_decoders_give_generates_greedy_tokens(model_type, name):
    """Batched, right-padded sources of different lengths; rows that end at different steps and
    rows cut by the bound: every row's tokens are `generate`'s, and so is where it stopped."""
    model = tiny_family_model(model_type)
    input_ids, attention_mask = varied_batch(model)
    options = {"max_new_tokens": BOUND} if name != "lookup" else {"max_new_tokens": BOUND, "match": 1}
    out = decoder_for(name, model, **options).generate(model, input_ids, attention_mask)
    expected = greedy(model, input_ids, attention_mask)
    assert out.subsequences == expected.subsequences
    assert out.tokens == expected.tokens
    assert out.bound_hit == expected.bound_hit


@pytest.mark.parametrize("model_type", (*BART_LIKE, "umt5"))   # transformers runs LongT5 eager only
def test_sdpa_gives_eagers_tokens(model_type):
    eager = tiny_family_model(model_type)
    sdpa = tiny_family_model(model_type, implementation="sdpa")
    input_ids, attention_mask = varied_batch(eager)
    outputs = [decoder_for("sequential", model, max_new_tokens=BOUND).generate(model, input_ids, attention_mask)
               for model in (eager, sdpa)]
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_generates_extras_are_switched_off(model_type):
    """A model whose generation configuration asks for extras beyond greedy decoding (as real
    checkpoints' do: no repeated n-grams, a minimum length, a forced first and last token):
    `generate` as the library calls it (`PLAIN_GREEDY`) ignores them and equals the sequential
    decoder, while `generate` left to the model's configuration honours them and writes another
    output."""
    model = tiny_family_model(model_type)
    special = family_special(model_type)
    config = model.generation_config
    config.no_repeat_ngram_size, config.min_length = 1, 4
    config.forced_bos_token_id, config.forced_eos_token_id = 7, special.eos
    input_ids, attention_mask = family_batch(model_type, 5, seed=3)
    out = decoder_for("sequential", model, max_new_tokens=BOUND).generate(model, input_ids, attention_mask)
    plain = greedy(model, input_ids, attention_mask)
    assert (out.subsequences, out.tokens) == (plain.subsequences, plain.tokens)
    honoured = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                              num_beams=1, max_new_tokens=BOUND)
    assert honoured[:, 1].eq(7).all()                       # the forced first token
    assert set(PLAIN_GREEDY) >= {"forced_bos_token_id", "forced_eos_token_id", "no_repeat_ngram_size",
                                 "min_length"}


@pytest.mark.parametrize("model_type", ("bart", "pegasus", "marian"))
def test_the_sequential_loss_is_the_models_own(model_type):
    """The decoder inputs the sequential loss feeds (`decoder_inputs`: the start token, then the
    labels shifted) are the ones the model's forward makes from labels alone. (mBART's own shift
    moves the last label to the front instead; every decoder here starts with the start token.)"""
    model = tiny_family_model(model_type)
    special = family_special(model_type)
    input_ids, attention_mask = family_batch(model_type, 4, seed=5)
    labels = torch.randint(5, 40, (4, 6))
    labels[:, -1] = special.eos
    labels[0, 4:] = -100
    ours = decoder_for("sequential", model).loss(model, input_ids, attention_mask, {"labels": labels})
    own = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    torch.testing.assert_close(ours, own, rtol=1e-12, atol=0)
    assert decoder_inputs(model, labels)[:, 0].eq(special.start).all()


@pytest.mark.parametrize("model_type", (*BART_LIKE, "umt5"))
def test_a_call_without_positions_is_refused(model_type):
    model = tiny_family_model(model_type)
    input_ids, attention_mask = family_batch(model_type, 2)
    states = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    bias = torch.zeros(1, sizes(model.config).heads, 1, 1)
    with pytest.raises(ValueError, match="position"):
        run_decoder(model, input_ids[:, :1], bias, states, attention_mask)
    assert family_of(model.config).absolute_positions


@pytest.mark.parametrize("delay", [1, 2])
@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_pipelined_equals_its_plain_reference(model_type, delay, monkeypatch):
    """Each token at its offset in its subsequence as its position: the cached, batched decode
    equals the plain one, which recomputes every logit with the training forward."""
    model = tiny_family_model(model_type)
    decoder = decoder_for("pipelined", model, delay=delay, max_subsequences=3,
                          max_subsequence_length=5, max_steps=20)
    input_ids, attention_mask = family_batch(model_type, 4, max_len=9, seed=9)
    assert_equals_reference(monkeypatch, decoder, model, input_ids, attention_mask)


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_pipelined_trained_equals_its_plain_reference(model_type, monkeypatch):
    """Briefly trained on its own layout (a toy task: the source in chunks of three), so that its
    outputs are a trained model's, pipelined still equals its plain reference."""
    model = tiny_family_model(model_type).train()
    decoder = decoder_for("pipelined", model, delay=1, max_subsequences=3,
                          max_subsequence_length=5, max_steps=20)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(30):
        input_ids, attention_mask = family_batch(model_type, 8, max_len=9, seed=100 + step)
        targets = [[row[i: i + 3] for i in range(0, n - 1, 3)]
                   for row, n in zip(input_ids.tolist(), attention_mask.sum(1).tolist())]
        loss = decoder.loss(model, input_ids, attention_mask, decoder.layout(targets))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()

    def several(seed):
        """a batch with an output of several subsequences: cached columns of earlier ones are read"""
        batch = family_batch(model_type, 4, max_len=9, seed=seed)
        return max(len(subsequences) for subsequences in decoder.generate(model, *batch).subsequences) >= 2
    seed = next((seed for seed in range(9, 60) if several(seed)), None)
    assert seed is not None, "no batch with an output of several subsequences"
    assert_equals_reference(monkeypatch, decoder, model, *family_batch(model_type, 4, max_len=9, seed=seed))


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_pipelineds_first_subsequence_is_greedy_decoding(model_type):
    """Subsequence 0 sees only itself, at positions 0, 1, ...: on an untrained model it writes the
    greedy tokens up to the first end token (or its length bound)."""
    model = tiny_family_model(model_type)
    special = family_special(model_type)
    length = 6
    decoder = decoder_for("pipelined", model, delay=1, max_subsequences=2,
                          max_subsequence_length=length, max_steps=20)
    input_ids, attention_mask = family_batch(model_type, 5, seed=3)
    out = decoder.generate(model, input_ids, attention_mask)
    raw = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=length,
                         **PLAIN_GREEDY)[:, 1:].tolist()
    for row, subsequences in zip(raw, out.subsequences):
        first = row[: row.index(special.eos)] if special.eos in row else row
        assert (subsequences[0] if subsequences else []) == first


@pytest.mark.parametrize("name", ("nar", "onestep", "pipelined", "blockwise"))
@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_every_decoder_trains_and_decodes(model_type, name):
    """A few steps of the decoder's own loss lower it, and the trained model decodes a batch."""
    model = tiny_family_model(model_type).train()
    decoder = decoder_for(name, model, max_new_tokens=BOUND).train()
    parameters = list(decoder.parameters()) + ([] if name == "onestep" else list(model.parameters()))
    optimizer = torch.optim.AdamW(parameters, lr=3e-3)
    input_ids, attention_mask = family_batch(model_type, 8, max_len=9, seed=11)
    targets = [[row[i: i + 3] for i in range(0, n - 1, 3)]
               for row, n in zip(input_ids.tolist(), attention_mask.sum(1).tolist())]
    losses = []
    for _ in range(8):
        torch.manual_seed(0)   # nar's masks alike at every step: the loss of one batch falls
        loss = decoder.loss(model, input_ids, attention_mask, decoder.layout(targets))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    out = decoder.eval().generate(model.eval(), input_ids, attention_mask)
    assert len(out.subsequences) == len(input_ids)
    vocab = model.config.vocab_size
    assert all(0 <= token < vocab for row in out.subsequences for sub in row for token in sub)


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_a_save_pretrained_folder_of_every_family_predicts_its_greedy_output(model_type, tmp_path,
                                                                            no_hub):
    """A folder as the family's `save_pretrained` writes it, with a tokenizer in the family's
    layout: `Predictor.from_pretrained` reads the sources in the tokenizer's template and writes,
    as text, what the model's own greedy `generate` writes for them."""
    folder = tmp_path / model_type
    model = tiny_family_model(model_type)
    model.save_pretrained(folder)
    tokenizer = family_tokenizer(model_type)
    tokenizer.save_pretrained(folder)
    input_ids, _ = varied_batch(model)
    pad = family_special(model_type).pad
    words = [[f"w{token}" for token in row if token >= FIRST_ORDINARY and token != pad]
             for row in input_ids.tolist()]
    records = [{"id": str(i), "document": " ".join(row)} for i, row in enumerate(words)]
    predictor = Predictor.from_pretrained(
        str(folder), task="summarization", decoder="sequential", device="cpu",
        overrides=["model.dropout=0.0", "model.attn_implementation=eager",
                   f"decoder.max_new_tokens={BOUND}", "trainer.precision=64"])
    predicted = [record["summary"] for record in predictor.predict(records)]
    encoded = tokenizer([record["document"] for record in records], padding=True, return_tensors="pt")
    reference = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    out = reference.generate(**encoded, max_new_tokens=BOUND, **PLAIN_GREEDY)[:, 1:].tolist()
    special = family_special(model_type)
    written = [through_end(row, special.eos)[:-1] if special.eos in row else row for row in out]
    expected = [[tokenizer.decode(row, skip_special_tokens=True)] if row else [] for row in written]
    assert predicted == expected


# A model built here of a few dozen built-in examples: tiny sizes, one epoch.
BUILT_TINY = ["data.train_size=32", "data.validation_size=8", "data.test_size=8", "model.d_model=32",
              "model.d_ff=64", "model.num_heads=2", "model.vocab_size=300",
              "data.max_target_length=40", "train.batch_size=8", "trainer.max_epochs=1",
              "trainer.enable_progress_bar=false"]


@pytest.mark.parametrize("model_type", BART_LIKE)
def test_a_model_built_here_has_its_familys_layout_and_restores_from_its_checkpoint(model_type,
                                                                                  tmp_path):
    """`model=<type>-tiny`: a random model of that type and a tokenizer trained in its family's
    layout (BART's <s> ... </s>, mBART's language code after the end token, Marian's pad as the
    last id, which starts its decoder); its checkpoint is decoded by `tasks.test` from the
    checkpoint alone, sequential and lookup alike."""
    cfg = compose("keyphrase", "sequential", None, [f"model={model_type}-tiny", *BUILT_TINY,
                                                     *tracking(tmp_path)])
    built = build(cfg)
    backbone, tokenizer = built.module.backbone, built.module.tokenizer
    assert backbone.config.model_type == model_type
    source = built.datamodule.dataset("train").examples[0].source_ids
    vocabulary = tokenizer.get_vocab()
    expected_ends = {"bart": (["<s>"], ["</s>"]), "mbart": ([], ["</s>", "en_XX"]),
                     "pegasus": ([], ["</s>"]), "marian": ([], ["</s>"])}[model_type]
    assert source[: len(expected_ends[0])] == [vocabulary[t] for t in expected_ends[0]]
    assert source[len(source) - len(expected_ends[1]):] == [vocabulary[t] for t in expected_ends[1]]
    start = {"bart": "</s>", "mbart": "</s>", "pegasus": "<pad>", "marian": "<pad>"}[model_type]
    assert built.module.decoder.special.start == vocabulary[start]
    if model_type == "marian":
        assert tokenizer.pad_token_id == len(tokenizer) - 1
    path = save_checkpoint(built.module, tmp_path / "sequential.ckpt")
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    predicted = []
    for name, options in (("sequential", []), ("lookup", ["decoder=lookup"])):
        run = test_entry.main(["--ckpt", path, *options, *tracking(tmp_path)])
        predicted.append([row["prediction"]
                          for row in run_artifact_rows(client, run["run_id"], tmp_path / name)])
    assert predicted[0] == predicted[1] and len(predicted[0]) == 8


@pytest.mark.parametrize("key, value, message", [
    ("model.type", "umt5", r"model.type='umt5'; models are built here of these types: t5, bart"),
    ("model.num_heads", 3, r"model.d_model=128 is not split evenly by model.num_heads=3"),
    ("model.max_positions", 64, r"model.max_positions=64 is fewer than the longest source"),
])
def test_a_bad_built_model_is_refused_before_any_work(key, value, message):
    with pytest.raises(ConfigError, match=message):
        compose("keyphrase", "sequential", None, ["model=bart-tiny", f"{key}={value}"])


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_a_pretrained_folder_of_every_family_fine_tunes_with_any_decoder(model_type, tmp_path,
                                                                        no_hub):
    """`model=pretrained model.hub_id=DIR`: a family's `save_pretrained` folder is fine-tuned with
    the pipelined decoder, and its checkpoint decodes without the folder."""
    folder = tmp_path / model_type
    tiny_family_model(model_type).save_pretrained(folder)
    family_tokenizer(model_type).save_pretrained(folder)
    overrides = ["model=pretrained", f"model.hub_id={folder}", "model.attn_implementation=eager",
                 "data.train_size=16",
                 "data.validation_size=4", "data.test_size=4", "train.batch_size=8",
                 "trainer.max_epochs=1", "trainer.enable_progress_bar=false", *tracking(tmp_path)]
    fitted = fit.main(["--task", "keyphrase", "--decoder", "pipelined", *overrides])
    checkpoint = fitted["checkpoint"]
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()
    tested = test_entry.main(["--ckpt", checkpoint, *tracking(tmp_path)])
    timed = ("examples_per_second", "decode_seconds")
    assert ({k: v for k, v in tested["scores"].items() if k not in timed}
            == {k: v for k, v in fitted["scores"].items() if k not in timed})


def test_a_pretrained_model_without_a_folder_or_hub_id_is_refused():
    with pytest.raises(ConfigError, match=r"model=pretrained needs model.hub_id"):
        compose("keyphrase", "sequential", None, ["model=pretrained"])


@pytest.mark.parametrize("choice", ["model=/data/bart-base", "model.name=facebook/bart-base"])
def test_a_model_is_chosen_by_its_folder_or_hub_id(choice):
    model = compose("summarization", "pipelined", None, [choice]).model
    assert (model.name, model.hub_id) == ("pretrained", choice.split("=")[1])


@pytest.mark.parametrize("name", available())
@pytest.mark.parametrize("model_type", ("bart", "umt5"))
def test_at_most_one_sync_point_per_decoder_call_on_other_families(model_type, name):
    """Positions as arguments (and UMT5's key positions in the cache) add no host sync: as on T5
    (tests/test_sync_points.py), at most one per decoder call beside a few per decode."""
    model = tiny_family_model(model_type)
    input_ids, attention_mask = varied_batch(model)
    decoder = decoder_for(name, model, **bounded(name, BOUND))
    decoder.generate(model, input_ids, attention_mask)   # lazy tables made before counting
    with counting_sync_points() as counter:
        out = decoder.generate(model, input_ids, attention_mask)
    per_decode = 2 + {"aggressive": 2, "lookup": 1}.get(name, 0)
    assert counter.count <= out.batch_decoder_calls + per_decode
