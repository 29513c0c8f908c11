"""`decoder.compile`: every decoder can run its calls' model step through torch.compile; the tokens
are those of the eager decode, training never compiles, and it is decode-only (a comparison sweeps
it on one trained model)."""
import pytest
import torch

from decoders import available, build_decoder
from decoders.backbone import compiled_run_decoder, run_decoder
from tasks.bench import bounded
from tasks.comparison.plan import training_key
from tasks.config import ConfigError, compose
from tests.conftest import SPECIAL, first_batch_where, random_batch, tiny_t5

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
        assert compiled.model_step() is compiled_run_decoder()
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
