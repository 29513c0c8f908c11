"""`decoder.compile`: every decoder can run its calls' model step through torch.compile; the tokens
are those of the eager decode, training never compiles, and it is decode-only (a comparison sweeps
it on one trained model)."""
import pytest
import torch
from torch._dynamo.utils import counters

from decoders import available, build_decoder
import decoders.base
from decoders.backbone import compiled_run_decoder, fixed_shape_run_decoder, run_decoder
from decoders.sequential import ATTENDED_SLOTS_STEP
from tasks.bench import bounded
from tasks.comparison.plan import training_key
from tasks.config import ConfigError, compose
from tests.conftest import SPECIAL, assert_same_output, first_batch_where, random_batch, tiny_t5
from tests.families import family_batch, family_special, tiny_family_model

pytestmark = pytest.mark.float64


@pytest.fixture(scope="module", autouse=True)
def own_compile_cache(tmp_path_factory):
    """A kernel cache of this run's own: inductor's on-disk cache does not tell kernels built for
    one ATEN_CPU_CAPABILITY from another's, and a native kernel reused under `default` fails to
    build (docs/testing.md)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
        yield


@pytest.mark.parametrize("name", available())
def test_the_option_compiles_the_decoding_step_only(name):
    model = tiny_t5(0)
    eager = build_decoder(name, model.config, SPECIAL, **bounded(name, 8))
    compiled = build_decoder(name, model.config, SPECIAL, compile=True, **bounded(name, 8))
    assert not eager.compiled_calls and compiled.compiled_calls
    with torch.no_grad():
        assert eager.model_step() is run_decoder
        assert compiled.model_step() is (fixed_shape_run_decoder() if compiled.fixed_shape_calls
                                         else compiled_run_decoder())
    with torch.enable_grad():
        assert compiled.model_step() is run_decoder


def test_it_is_a_decode_option_of_every_decoder_and_a_bool():
    for name in available():
        off, on = (compose("keyphrase", name, None, [f"decoder.compile={value}"]) for value in ("false", "true"))
        assert off.decoder.compile is False and on.decoder.compile is True
        assert training_key(off) == training_key(on)   # one trained model decodes both ways
    with pytest.raises(ConfigError, match=r"decoder\.compile='maybe' has type str, but decoder\.compile "
                                          r"takes bool"):
        compose("keyphrase", "pipelined", None, ["decoder.compile=maybe"])


@pytest.mark.slow   # compiling takes seconds per decoder
@pytest.mark.parametrize("name", ["sequential", "pipelined", "blockwise", "nar"])
def test_compiled_decoding_gives_the_eager_tokens(name):
    """One of each loop: the appending cache (sequential), the pipelined grid, the per-row slots of
    draft and verify (blockwise; lookup and aggressive share its loop), no cache (nar). The rows of
    the batch end after different numbers of calls, so its shapes change between calls."""
    model = tiny_t5(0)

    def decoded(compile: bool, input_ids, attention_mask):
        torch.manual_seed(0)   # blockwise's heads and nar's own modules: the same weights both times
        decoder = build_decoder(name, model.config, SPECIAL, compile=compile, **bounded(name, 16))
        return decoder.eval().generate(model, input_ids, attention_mask)

    def rows_end_apart(input_ids, attention_mask):
        """sequential decoding of the batch ends its rows after different numbers of calls"""
        return len(set(decoded(False, input_ids, attention_mask).tokens)) > 1

    batch = first_batch_where(rows_end_apart, 5) if name != "nar" else random_batch(5)
    eager, compiled = decoded(False, *batch), decoded(True, *batch)
    assert compiled.subsequences == eager.subsequences
    assert compiled.decoder_calls == eager.decoder_calls


def model_of(model_type: str):
    """A tiny random model of `model_type` (T5 or another family) and its special tokens."""
    if model_type == "t5":
        return tiny_t5(0), SPECIAL
    return tiny_family_model(model_type), family_special(model_type)


def batch_ending_apart(model, special, batch_size: int = 5, first_seed: int = 0, max_len: int = 12,
                       bound: int = 16, longest_above: int = 0):
    """The first seeded batch (sources of up to `max_len` tokens) on which sequential decoding
    within `bound` tokens ends its rows after different numbers of calls, some by their end
    token, and one row after more than `longest_above`."""
    decoder = build_decoder("sequential", model.config, special, max_new_tokens=bound).eval()
    model_type = model.config.model_type
    for seed in range(first_seed, first_seed + 40):
        batch = (random_batch(batch_size, max_len, seed=seed) if model_type == "t5"
                 else family_batch(model_type, batch_size, max_len, seed=seed))
        out = decoder.generate(model, *batch)
        if len(set(out.tokens)) > 1 and not all(out.bound_hit) and max(out.tokens) > longest_above:
            return batch
    raise AssertionError(f"no batch of the {model_type} model ends its rows apart")


@pytest.mark.parametrize("model_type", ["t5", "umt5", "bart", "marian"])
def test_sequentials_compiled_loop_runs_its_calls_in_a_few_shapes_and_gives_the_eager_tokens(
        model_type, monkeypatch):
    """The loop sequential runs compiled (a cache of `max_new_tokens` slots attended in a few widths,
    the source padded, finished rows kept), here with its step run eagerly: its calls have those
    few shapes, and its output is the eager loop's,
    on families with relative (T5, UMT5's per-layer) and absolute (BART, Marian) positions."""
    model, special = model_of(model_type)
    shapes = []

    def recording_step(model, ids, bias, encoder_states, cross_mask, cache, slots, positions):
        shapes.append((ids.shape, bias.shape, slots.each.shape, slots.width, positions.shape,
                       encoder_states.shape, cross_mask.shape))
        return run_decoder(model, ids, bias, encoder_states, cross_mask, cache, slots, positions)

    monkeypatch.setattr(decoders.base, "fixed_shape_run_decoder", lambda: recording_step)
    batch = batch_ending_apart(model, special, bound=ATTENDED_SLOTS_STEP + 8,
                               longest_above=ATTENDED_SLOTS_STEP)
    bound = ATTENDED_SLOTS_STEP + 8
    eager = build_decoder("sequential", model.config, special, max_new_tokens=bound).eval()
    compiled = build_decoder("sequential", model.config, special, max_new_tokens=bound, compile=True).eval()
    expected, out = eager.generate(model, *batch), compiled.generate(model, *batch)
    assert_same_output(out, expected)
    assert out.decoder_calls == expected.decoder_calls
    assert out.batch_decoder_calls == expected.batch_decoder_calls == len(shapes)
    ids, bias, each, width, positions, states, cross_mask = zip(*shapes)
    assert all(len(set(kind)) == 1 for kind in (ids, each, positions, states, cross_mask))
    assert [shape[-1] for shape in bias] == list(width)   # the slots attended, in a few widths:
    # steps of ATTENDED_SLOTS_STEP, up to the bound
    assert list(width) == [
        min(bound, -(-step // ATTENDED_SLOTS_STEP) * ATTENDED_SLOTS_STEP) for step in range(1, len(shapes) + 1)]
    assert len(set(width)) > 1
    assert states[0][1] == 16 > batch[0].size(1)   # the source padded to a power of two


@pytest.mark.slow   # compiling takes seconds
def test_compiled_sequential_decoding_compiles_once_and_later_decodes_reuse_it():
    """After one decode of a batch size, a decode of other inputs of that size, of another source
    length and whose rows end after other numbers of calls, compiles nothing and gives the eager
    tokens."""
    model = tiny_t5(0)
    warm_up = batch_ending_apart(model, SPECIAL, max_len=12)
    batch = batch_ending_apart(model, SPECIAL, first_seed=50, max_len=9)
    assert batch[0].size(1) != warm_up[0].size(1)
    compiled = build_decoder("sequential", model.config, SPECIAL, max_new_tokens=16, compile=True).eval()
    compiled.generate(model, *warm_up)
    graphs = dict(counters["stats"])
    out = compiled.generate(model, *batch)
    assert dict(counters["stats"]) == graphs
    eager = build_decoder("sequential", model.config, SPECIAL, max_new_tokens=16).eval()
    assert_same_output(out, eager.generate(model, *batch))
