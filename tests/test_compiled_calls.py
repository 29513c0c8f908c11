"""`decoder.compile`: every decoder can run its calls' model step through torch.compile; the tokens
are those of the eager decode, training never compiles, and it is decode-only (a comparison sweeps
it on one trained model)."""
import copy
import gc
import weakref

import pytest
import torch
from torch._dynamo.utils import counters

from decoders import available, build_decoder
import decoders.backbone
import decoders.base
import decoders.drafts
import decoders.pipelined
import decoders.sequential
from decoders.backbone import (FIXED_SHAPE_OPTIONS, compiled_encode, compiled_run_decoder, encode,
                               fixed_source_width, greedy_step, rounded_to_eighths, run_decoder)
from decoders.cache import ATTENDED_SLOTS_STEP, DecoderCache, Slots
from decoders.compiled_step import COMPILED_STEPS, FixedShapeStep
from decoders.draft_policy import CallCosts
from decoders.families import family_of
from decoders.loop import ShrunkRows
from decoders.sequential import shrunk_rows
from decoders.transformers_internals import set_attention_implementation
from tasks.bench import bounded, with_drafter
from tasks.comparison.plan import training_key
from tasks.config import ConfigError, compose
from tests.conftest import (ALWAYS_FEED, SPECIAL, always_feeding, assert_same_output, first_batch_where, random_batch,
                            tiny_t5)
from tests.families import FAMILY_TYPES, family_batch, family_special, tiny_family_model

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
        assert eager.model_step() is run_decoder and eager.encoder_pass() is encode
        assert compiled.model_step() is compiled_run_decoder()
        assert compiled.encoder_pass() is compiled_encode
    with torch.enable_grad():
        assert compiled.model_step() is run_decoder and compiled.encoder_pass() is encode


@pytest.mark.parametrize("name", available())
def test_a_compiled_decode_encodes_through_the_compiled_encoder_once_per_batch(name, monkeypatch):
    """Every decoder's decode takes its encoder pass from `encoder_pass` (here the compiled
    functions replaced by recording eager ones, so nothing compiles)."""
    model = tiny_t5(0)
    encoded = []

    def recording_encode(*args):
        encoded.append(args[1].shape)
        return encode(*args)
    monkeypatch.setattr(decoders.base, "compiled_encode", recording_encode)
    monkeypatch.setattr(decoders.base, "compiled_run_decoder", lambda: run_decoder)
    # their steps, and their start (`fixed_shape_start`)
    for loop in (decoders.sequential, decoders.pipelined, decoders.backbone):
        monkeypatch.setattr(loop, "fixed_shape_compiled", lambda model, function, shape: function)
    monkeypatch.setattr(decoders.drafts, "fixed_shape_greedy_step", lambda model, shape: greedy_step)
    decoder = with_drafter(build_decoder(name, model.config, SPECIAL, compile=True,
                                         **bounded(name, 8)).eval(), model)
    batch = random_batch(3, seed=0)
    with torch.no_grad():
        decoder.generate(model, *batch)
    assert encoded == [batch[0].shape]


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
        decoder = build_decoder(name, model.config, SPECIAL, compile=compile, **bounded(name, 16),
                                **always_feeding(name))
        return decoder.eval().generate(model, input_ids, attention_mask)

    def rows_end_apart(input_ids, attention_mask):
        """sequential decoding of the batch ends its rows after different numbers of calls"""
        return len(set(decoded(False, input_ids, attention_mask).tokens)) > 1

    batch = first_batch_where(rows_end_apart, 5) if name != "nar" else random_batch(5)
    eager, compiled = decoded(False, *batch), decoded(True, *batch)
    assert compiled.subsequences == eager.subsequences
    assert compiled.decoder_calls == eager.decoder_calls


@pytest.mark.parametrize("model_type, implementation",
                         [(model_type, implementation) for model_type in ("t5", *FAMILY_TYPES)
                          for implementation in ("eager", "sdpa")
                          if (model_type, implementation) != ("longt5", "sdpa")])  # LongT5: eager only
def test_an_encoder_on_the_real_tokens_gives_each_real_token_the_models_state(model_type,
                                                                              implementation):
    """Where a family runs the encoder itself (every one but LongT5's), its position-wise layers on
    the real tokens alone, every real token's state is the model's own encoder's (float64, eager),
    the padding's are zeros, and the compiled encoder takes that path; for LongT5 it runs the
    model's encoder."""
    model = (tiny_t5(0) if model_type == "t5"
             else tiny_family_model(model_type, implementation=implementation))
    if model_type == "t5":
        set_attention_implementation(model.config, implementation)
    input_ids, attention_mask = (random_batch(5, seed=3) if model_type == "t5"
                                 else family_batch(model_type, 5, seed=3))
    assert attention_mask.min() == 0   # sources of several lengths: padding to leave out
    family = family_of(model.config)
    runs_its_own = family.encodes_real_tokens(model.config)
    assert runs_its_own == (model_type != "longt5")
    real = attention_mask.flatten().nonzero().squeeze(1)
    called = []

    def recording(function):
        called.append(function.__name__)
        return function
    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        expected = encode(model, input_ids, attention_mask)
        if runs_its_own:
            states = decoders.backbone.encode_real_tokens(model, input_ids, attention_mask, real)
            padding = ~attention_mask.bool()
            torch.testing.assert_close(states[~padding], expected[~padding], rtol=0, atol=1e-12)
            assert states[padding].abs().max() == 0
        patch.setattr(decoders.backbone, "compiled_for",
                      lambda model, function, *key, **options: recording(function))
        compiled_encode(model, input_ids, attention_mask)
    assert called == ["encode_real_tokens" if runs_its_own else "encode"]


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


def decoded_recording_shapes(decoder, model, batch, monkeypatch):
    """`decoder.generate` of `batch` with its fixed-shape step run eagerly, and the shapes of each
    call: (fed ids, bias, slots written, slots attended, positions, encoder states, cross mask)."""
    shapes = []

    def recording_step(model, ids, bias, encoder_states, cross_mask, cache, slots, positions):
        shapes.append((ids.shape, bias.shape, slots.each.shape, slots.width, positions.shape,
                       encoder_states.shape, cross_mask.shape))
        return greedy_step(model, ids, bias, encoder_states, cross_mask, cache, slots, positions)

    with monkeypatch.context() as patch:
        patch.setattr(decoders.drafts, "fixed_shape_greedy_step", lambda model, shape: recording_step)
        # sequential and pipelined compile their own steps around the same one
        for loop in (decoders.sequential, decoders.pipelined):
            patch.setattr(loop, "fixed_shape_compiled", lambda model, function, shape: function)
            patch.setattr(loop, "greedy_step_as_compiled", recording_step)
        # the cache made whole before the first call, eagerly
        patch.setattr(decoders.backbone, "compiled_for", lambda model, function, *key, **options: function)
        return decoder.generate(model, *batch), shapes


def recorded_against_eager(eager, compiled, model, batch, monkeypatch):
    """The shapes of `compiled`'s calls on `batch` (`decoded_recording_shapes`), as (fed ids, bias,
    slots written, slots attended, positions, encoder states, cross mask) lists, once its output,
    calls and call count are found to be `eager`'s; and the rows of each call."""
    expected = eager.generate(model, *batch)
    out, shapes = decoded_recording_shapes(compiled, model, batch, monkeypatch)
    assert_same_output(out, expected)
    assert out.decoder_calls == expected.decoder_calls
    assert out.stats == expected.stats
    assert out.batch_decoder_calls == expected.batch_decoder_calls == len(shapes)
    ids = [shape[0] for shape in shapes]
    rows = [fed[0] for fed in ids]
    # the batch's rows: all of them, then powers of two, fewer each time, as rows finish
    assert rows[0] == len(batch[0]) and rows == sorted(rows, reverse=True)
    assert all(size & (size - 1) == 0 for size in set(rows) - {len(batch[0])})
    return out, list(zip(*shapes)), rows


def test_a_fixed_shape_source_is_padded_to_a_power_of_two_or_three_quarters_of_one():
    widths = [fixed_source_width(length) for length in (1, 16, 17, 25, 33, 49, 64, 65, 97, 129)]
    assert widths == [16, 16, 24, 32, 48, 64, 64, 96, 128, 192]
    assert all(length <= fixed_source_width(length) < 1.5 * length for length in range(17, 2049))


def test_the_encoder_runs_its_source_and_real_tokens_rounded_up_to_under_an_eighth_more():
    assert [rounded_to_eighths(count) for count in (1, 8, 9, 64, 65, 72, 73, 1000)] == \
        [8, 8, 16, 64, 72, 72, 80, 1024]
    for count in range(64, 4097):
        assert count <= rounded_to_eighths(count) < 1.125 * count
    assert len({rounded_to_eighths(count) for count in range(1025, 2049)}) == 8


@pytest.mark.slow   # compiling takes seconds per shape
def test_the_compiled_encoder_runs_fixed_shapes_and_gives_every_real_token_the_models_state():
    """`compiled_encode` pads a source to its fixed width and, for a batch of several rows with
    padding, runs its real tokens with padding ones up to `rounded_to_eighths`: every real token's
    state is the model's own encoder's, the padding's are zeros, the states keep the source's
    length, and another batch of the same widths and counts compiles nothing. (T5's layer norms
    take their variance in float32, as the model's own do, and a compiled graph sums it in another
    order: the states agree to float32's precision, while attending to the padding would change
    them by far more.)"""
    model = tiny_t5(0)
    input_ids, attention_mask = random_batch(5, seed=3)
    assert attention_mask.min() == 0 and rounded_to_eighths(input_ids.size(1)) > input_ids.size(1)
    one = input_ids[:1, :int(attention_mask[0].sum())]
    with torch.no_grad():
        for ids, mask in ((input_ids, attention_mask), (one, torch.ones_like(one))):
            states, expected = compiled_encode(model, ids, mask), encode(model, ids, mask)
            assert states.shape == expected.shape
            real = mask.bool()
            torch.testing.assert_close(states[real], expected[real], rtol=1e-4, atol=1e-4)
            assert not states[~real].any()
        compiled = len(COMPILED_STEPS)
        shuffled = input_ids[[4, 3, 2, 1, 0]], attention_mask[[4, 3, 2, 1, 0]]
        states = compiled_encode(model, *shuffled)
        expected = encode(model, *shuffled) * shuffled[1][..., None]   # zeros at the padding
    assert len(COMPILED_STEPS) == compiled
    torch.testing.assert_close(states, expected, rtol=1e-4, atol=1e-4)


def test_a_fixed_shape_batch_shrinks_only_down_to_a_power_of_two_moving_the_rows_past_it():
    assert shrunk_rows([False] * 16) == ShrunkRows(16, [], [])
    assert shrunk_rows([True] * 7 + [False] * 9) == ShrunkRows(16, [], [])   # 9 need 16 rows
    # 8 unfinished fit 8 rows: those past the first 8 take the finished rows' places among them
    assert shrunk_rows([True, False] * 8) == ShrunkRows(8, [9, 11, 13, 15], [0, 2, 4, 6])
    # 5 unfinished need 8 rows: all five past them move, the other 3 finished rows stay to fill
    assert shrunk_rows([True] * 11 + [False] * 5) == ShrunkRows(8, [11, 12, 13, 14, 15],
                                                                [0, 1, 2, 3, 4])
    assert shrunk_rows([False, True, True]) == ShrunkRows(1, [], [])          # 1 row of 3
    assert shrunk_rows([True, False, False]) == ShrunkRows(2, [2], [0])       # 2 of 3 fit 2 rows
    assert shrunk_rows([False] * 5) == ShrunkRows(5, [], [])


@pytest.mark.parametrize("model_type", ["t5", "umt5", "bart", "marian"])
def test_sequentials_compiled_loop_runs_its_calls_in_a_few_shapes_and_gives_the_eager_tokens(
        model_type, monkeypatch):
    """The loop sequential runs compiled (a cache of `max_new_tokens` slots attended in a few widths,
    the source padded, finished rows kept until the unfinished ones fit half the batch), here with
    its step run eagerly: its calls have those few shapes, and its output is the eager loop's,
    on families with relative (T5, UMT5's per-layer) and absolute (BART, Marian) positions."""
    model, special = model_of(model_type)
    bound = ATTENDED_SLOTS_STEP + 8
    batch = batch_ending_apart(model, special, bound=bound, longest_above=ATTENDED_SLOTS_STEP)
    eager = build_decoder("sequential", model.config, special, max_new_tokens=bound).eval()
    compiled = build_decoder("sequential", model.config, special, max_new_tokens=bound, compile=True).eval()
    _, shapes, rows = recorded_against_eager(eager, compiled, model, batch, monkeypatch)
    ids, bias, each, width, positions, states, cross_mask = shapes
    assert len(set(rows)) > 1
    for kind in (ids, each, states, cross_mask):   # one shape per batch size
        assert len(set(zip(rows, kind))) == len(set(rows))
    assert len(set(positions)) == 1
    assert [shape[-1] for shape in bias] == list(width)   # the slots attended, in a few widths:
    # steps of ATTENDED_SLOTS_STEP, up to the bound
    assert list(width) == [
        min(bound, -(-step // ATTENDED_SLOTS_STEP) * ATTENDED_SLOTS_STEP) for step in range(1, len(width) + 1)]
    assert len(set(width)) > 1
    assert states[0][1] == 16 > batch[0].size(1)   # the source padded to a power of two


@pytest.mark.slow   # compiling takes seconds
def test_compiled_sequential_decoding_compiles_once_and_later_decodes_reuse_it(monkeypatch):
    """After one decode of a batch size, a decode of other inputs of that size, of another source
    length and whose rows end after other numbers of calls (within the shapes the first met: the
    batch sizes its finished rows leave and the widths attended), compiles nothing and gives the
    eager tokens."""
    model = tiny_t5(0)
    compiled = build_decoder("sequential", model.config, SPECIAL, max_new_tokens=16, compile=True).eval()
    warm_up = batch_ending_apart(model, SPECIAL, max_len=12)
    _, met = decoded_recording_shapes(compiled, model, warm_up, monkeypatch)

    def within_warm_up(batch) -> bool:
        _, shapes = decoded_recording_shapes(compiled, model, batch, monkeypatch)
        return batch[0].size(1) != warm_up[0].size(1) and set(shapes) <= set(met)
    batch = next(batch for batch in (batch_ending_apart(model, SPECIAL, first_seed=seed, max_len=9)
                                     for seed in range(50, 90, 4)) if within_warm_up(batch))
    eager = build_decoder("sequential", model.config, SPECIAL, max_new_tokens=16).eval()
    expected = eager.generate(model, *batch)
    assert expected.tokens != eager.generate(model, *warm_up).tokens   # rows ending otherwise
    compiled.generate(model, *warm_up)
    graphs, steps = dict(counters["stats"]), len(COMPILED_STEPS)
    out = compiled.generate(model, *batch)
    assert dict(counters["stats"]) == graphs and len(COMPILED_STEPS) == steps
    assert_same_output(out, expected)


@pytest.mark.parametrize("model_type", ["t5", "umt5", "bart", "marian"])
def test_the_verify_loops_compiled_calls_run_in_a_few_shapes_and_give_the_eager_tokens(
        model_type, monkeypatch):
    """The verify loop compiled (blockwise here; lookup and aggressive share it): every row at its
    own slots of a cache made whole, attended in a few widths; 1 or k + 1 fed tokens; the live
    rows topped up to the batch's rows, then to powers of two; the source padded. Run with its step
    eager, on a batch whose rows end apart and accept drafts, its output and calls are the eager
    loop's, on families with relative and absolute positions."""
    model, special = model_of(model_type)
    bound = ATTENDED_SLOTS_STEP + 8
    batch = batch_ending_apart(model, special, bound=bound, longest_above=ATTENDED_SLOTS_STEP)

    def decoder(compile: bool):
        torch.manual_seed(0)   # the proposal heads: one set of weights both times
        return build_decoder("blockwise", model.config, special, max_new_tokens=bound, compile=compile,
                             **ALWAYS_FEED).to(model.dtype).eval()
    out, shapes, rows = recorded_against_eager(decoder(False), decoder(True), model, batch, monkeypatch)
    assert out.stats["draft_tokens_accepted"] > 0 and len(set(rows)) > 1
    ids, bias, each, width, positions, states, cross_mask = shapes
    k = decoder(True).draft_width
    assert {fed[1] for fed in ids} == {1, k + 1}
    for call in zip(ids, bias, each, width, positions, states, cross_mask):
        fed, bias_shape, each_shape, attended, positions_shape, states_shape, mask_shape = call
        assert each_shape == positions_shape == fed and bias_shape[::2] == (fed[0], fed[1])
        assert bias_shape[-1] == attended and states_shape[0] == mask_shape[0] == fed[0]
    most_slots = bound + k + 1
    assert all(w % ATTENDED_SLOTS_STEP == 0 or w == most_slots for w in width) and len(set(width)) > 1
    assert {shape[1] for shape in states} == {16}   # the source padded to a power of two


def test_the_verify_loops_compiled_calls_that_compile_are_not_timed(monkeypatch):
    """Measured (`min_acceptance` null, lookup's default): a compiled call whose step is made at
    that call, which compiles it (seconds), is not a call's cost the rule learns from; every other
    call is timed. (The steps run eagerly here, made where the loop asks for them.)"""
    model = tiny_t5(0)
    made, timed = set(), []

    def making(model, shape):
        made.add(shape)
        return greedy_step
    monkeypatch.setattr(decoders.base, "compiled_encode", encode)
    monkeypatch.setattr(decoders.drafts, "fixed_shape_greedy_step", making)
    monkeypatch.setattr(decoders.drafts, "has_fixed_shape_greedy_step", lambda model, shape: shape in made)
    monkeypatch.setattr(CallCosts, "add", lambda self, rows, queries, seconds: timed.append(seconds))
    decoder = build_decoder("lookup", model.config, SPECIAL, compile=True, **bounded("lookup", 16)).eval()
    assert decoder.min_acceptance is None
    for seed in range(2):   # the second decode meets fewer new shapes
        before, timed_before = len(made), len(timed)
        out = decoder.generate(model, *random_batch(4, seed=seed))
        assert len(timed) - timed_before == out.batch_decoder_calls - (len(made) - before)
    assert len(made) > 0 and len(timed) > 0


@pytest.mark.parametrize("model_type", ["t5", "umt5", "bart"])
def test_pipelineds_compiled_calls_run_in_a_few_shapes_and_give_the_eager_tokens(model_type, monkeypatch):
    """Pipelined compiled: its columns written after the cache's in a cache made whole, attended in
    a few widths; a power of two of columns; the live rows topped up to the batch's rows, then to
    powers of two; the source padded. Run with its step eager, on a batch whose rows end apart and
    run several subsequences at once, its output and calls are the eager loop's, with relative and
    absolute positions."""
    model, special = model_of(model_type)
    options = {"max_new_tokens": 24, "max_subsequences": 6, "max_subsequence_length": 6}
    eager = build_decoder("pipelined", model.config, special, **options).eval()
    compiled = build_decoder("pipelined", model.config, special, compile=True, **options).eval()

    def varied(*batch) -> bool:
        """the rows end after different numbers of calls, and some call runs three subsequences
        or more in a row (a column count that is no power of two)"""
        out = eager.generate(model, *batch)
        return len(set(out.decoder_calls)) > 1 and max(map(len, out.subsequences)) >= 3
    batch = next(batch for batch in (random_batch(5, seed=seed) if model_type == "t5"
                                     else family_batch(model_type, 5, seed=seed) for seed in range(40))
                 if varied(*batch))
    _, shapes, rows = recorded_against_eager(eager, compiled, model, batch, monkeypatch)
    ids, bias, each, width, positions, states, cross_mask = shapes
    columns = [fed[1] for fed in ids]
    assert set(columns) <= {1, 2, 4, 6} and len(set(columns)) > 1   # powers of two, up to the slots
    for fed, bias_shape, each_shape, attended, positions_shape in zip(ids, bias, each, width, positions):
        assert each_shape == positions_shape == fed and bias_shape[-1] == attended
    most_columns = options["max_new_tokens"] + 3 * options["max_subsequences"]
    assert all(w % ATTENDED_SLOTS_STEP == 0 or w == most_columns for w in width)
    assert {shape[1] for shape in states} == {16}


def test_pipelineds_compiled_loop_packs_its_cache_only_when_a_call_might_not_fit(monkeypatch):
    """Compiled, pipelined's cache has a fixed number of columns: padding columns stay in it until
    a call's columns (one per slot at most) might not fit after those written; then the fed
    columns are packed to the front. Found on a batch that meets both: a call after padding past
    the fullest example's columns, and a pack."""
    model = tiny_t5(0)
    options = {"max_new_tokens": 12, "max_subsequences": 4, "max_subsequence_length": 12}
    eager = build_decoder("pipelined", model.config, SPECIAL, **options).eval()
    compiled = build_decoder("pipelined", model.config, SPECIAL, compile=True, **options).eval()
    most_columns = options["max_new_tokens"] + 3 * options["max_subsequences"]
    # the compiled decode's columns written at each pack, and (written, most fed) before each call
    packs, calls = [], []
    pack, call = decoders.pipelined.PipelinedDecoder._pack, decoders.pipelined.PipelinedDecoder._call

    def recording_pack(self, batch, most_fed):
        if batch.most_columns is not None:
            packs.append(batch.written)
        return pack(self, batch, most_fed)

    def recording_call(self, batch, step):
        if batch.most_columns is not None:
            calls.append((batch.written, max(example.fed for example in batch.live)))
        return call(self, batch, step)
    monkeypatch.setattr(decoders.pipelined.PipelinedDecoder, "_pack", recording_pack)
    monkeypatch.setattr(decoders.pipelined.PipelinedDecoder, "_call", recording_call)

    def packs_and_keeps_padding(seed) -> bool:
        packs.clear()
        calls.clear()
        recorded_against_eager(eager, compiled, model, random_batch(5, seed=seed), monkeypatch)
        return bool(packs) and any(written > fed for written, fed in calls)
    assert any(packs_and_keeps_padding(seed) for seed in range(40))
    assert all(written + options["max_subsequences"] > most_columns for written in packs)
    assert all(written + options["max_subsequences"] <= most_columns for written, _ in calls)


@pytest.mark.slow   # compiling takes seconds
@pytest.mark.parametrize("name", ["blockwise", "lookup", "pipelined"])
def test_a_compiled_loop_of_fixed_shapes_compiles_once_and_later_decodes_reuse_it(name, monkeypatch):
    """After decodes of one batch size, a decode of other inputs whose calls take only the shapes
    those met compiles nothing and gives the eager tokens and calls."""
    model = tiny_t5(0)

    def decoder(compile: bool):
        torch.manual_seed(0)
        return build_decoder(name, model.config, SPECIAL, compile=compile, **bounded(name, 16),
                             **always_feeding(name)).eval()
    compiled, eager = decoder(True), decoder(False)
    met = set()
    for seed in range(3):   # the warm-up
        warm_up = random_batch(4, seed=seed)
        met |= set(decoded_recording_shapes(compiled, model, warm_up, monkeypatch)[1])
        compiled.generate(model, *warm_up)
    batch = next(batch for batch in (random_batch(4, seed=seed) for seed in range(3, 40))
                 if set(decoded_recording_shapes(compiled, model, batch, monkeypatch)[1]) <= met)
    graphs, steps = dict(counters["stats"]), len(COMPILED_STEPS)
    out = compiled.generate(model, *batch)
    assert dict(counters["stats"]) == graphs and len(COMPILED_STEPS) == steps
    expected = eager.generate(model, *batch)
    assert_same_output(out, expected)
    assert out.decoder_calls == expected.decoder_calls


@pytest.mark.slow   # compiling takes seconds
@pytest.mark.parametrize("name", ["sequential", "lookup", "pipelined"])
def test_decoders_of_other_bounds_on_one_model_decode_through_steps_of_their_own(name):
    """A model's compiled steps are kept with it: a decoder whose cache holds more slots (a
    greater bound) finds none of another's steps, whose cache tensors would be smaller, under the
    shapes of its calls (the rows, the fed tokens, the widths attended: the first widths of both
    bounds agree); each gives its own eager tokens, one decoding after the other."""
    model = tiny_t5(0)
    batch = random_batch(4, seed=0)
    for bound in (40, 48):
        options = {**bounded(name, 40), "max_new_tokens": bound, **always_feeding(name)}
        compiled = build_decoder(name, model.config, SPECIAL, compile=True, **options).eval()
        eager = build_decoder(name, model.config, SPECIAL, **options).eval()
        assert_same_output(compiled.generate(model, *batch), eager.generate(model, *batch))


@pytest.mark.slow   # compiling takes seconds
@pytest.mark.parametrize("name", ["sequential", "blockwise", "pipelined"])
def test_every_call_of_a_fixed_shape_loop_runs_as_a_graph_of_its_tensors(name, monkeypatch):
    """The cache is made whole before the first call (`fixed_shape_start`, itself a graph of
    tensors), so no call, the first included, puts new tensors into its arguments: every step a
    decode compiles is a graph of tensors, and Dynamo (a fallback's) compiles no graph (the encoder
    run eagerly here). The tokens and calls are the eager decode's."""
    model = tiny_t5(0)
    monkeypatch.setattr(decoders.base, "compiled_encode", encode)

    def decoder(compile: bool):
        torch.manual_seed(0)
        return build_decoder(name, model.config, SPECIAL, compile=compile, **bounded(name, 8),
                             **always_feeding(name)).eval()
    batch = random_batch(2, seed=1)
    graphs, steps = counters["stats"]["unique_graphs"], len(COMPILED_STEPS)
    out = decoder(True).generate(model, *batch)
    assert "start_parts" in COMPILED_STEPS[steps:] and len(COMPILED_STEPS) > steps + 1
    assert counters["stats"]["unique_graphs"] == graphs
    expected = decoder(False).generate(model, *batch)
    assert_same_output(out, expected)
    assert out.decoder_calls == expected.decoder_calls


@pytest.mark.slow   # compiling takes seconds
def test_compiled_sequential_steps_are_kept_per_model_and_freed_with_it():
    """Two models of one shape key but other structures (T5's feed-forward layers and gated ones) each decode
    compiled to their eager tokens in one process. A model let go is freed, with the compiled steps
    and encoder kept for it."""
    batch = random_batch(4, seed=3)
    outputs = []
    for model in (tiny_t5(0), tiny_t5(1, feed_forward_proj="gated-gelu")):
        compiled = build_decoder("sequential", model.config, SPECIAL, max_new_tokens=8, compile=True).eval()
        eager = build_decoder("sequential", model.config, SPECIAL, max_new_tokens=8).eval()
        out = compiled.generate(model, *batch)
        assert_same_output(out, eager.generate(model, *batch))
        outputs.append(out.subsequences)
        alive = weakref.ref(model)
    del model, compiled, eager
    gc.collect()
    assert alive() is None
    assert outputs[0] != outputs[1]   # not vacuous: the models decode differently


@pytest.mark.slow   # compiling takes seconds
def test_a_compiled_decode_reads_the_weights_at_every_call_and_compiles_again_for_another_dtype():
    """Dynamo does not guard the weights (`compiled_for`): a compiled decode after the weights
    changed in place gives the changed model's eager tokens, and one after the model was converted
    to another dtype compiles for it and gives that model's eager tokens."""
    model = tiny_t5(0)
    batch = random_batch(3, seed=5)
    compiled = build_decoder("sequential", model.config, SPECIAL, max_new_tokens=8, compile=True).eval()
    eager = build_decoder("sequential", model.config, SPECIAL, max_new_tokens=8).eval()
    before = compiled.generate(model, *batch)
    assert_same_output(before, eager.generate(model, *batch))
    with torch.no_grad():   # another model's decoder weights, in place
        for mine, theirs in zip(model.decoder.parameters(), tiny_t5(1).decoder.parameters()):
            mine.copy_(theirs)
    changed = compiled.generate(model, *batch)
    assert_same_output(changed, eager.generate(model, *batch))
    assert changed.subsequences != before.subsequences   # not vacuous: the weights decide
    model.to(torch.float32 if model.dtype == torch.float64 else torch.float64)
    assert_same_output(compiled.generate(model, *batch), eager.generate(model, *batch))


def written_and_read(model, x, slots, cache):
    """A toy step: `model(x)` (rows, d) written into `cache.keys[0]` (rows, d, slots) at each row's
    slot, and what the cache holds then, times a constant."""
    cache.keys[0][slots.rows[:, 0], :, slots.each[:, 0]] = model(x)
    return cache.keys[0].sum(-1) * slots.width, model(x)


def made_and_read(model, x, slots, cache):
    """A toy step that puts a new tensor into the cache, as the call that makes a decode's cache."""
    cache.keys[0] = model(x)[:, :, None].expand(-1, -1, slots.width).clone()
    return cache.keys[0].sum(-1)


def first_layer(model, x, ignored):
    return model[0](x)


@pytest.mark.slow   # compiling takes seconds
def test_a_fixed_shape_step_is_given_only_the_tensors_its_graph_reads():
    """Each input of a compiled graph costs its call a handle: the weights the step reads are the
    graph's constants, a weight it never reads (here the second layer's, as a decoder step never
    reads the encoder's) is left out of the graph, an argument tensor it ignores out of its
    inputs, and the call gives the eager result."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).double()
    x, ignored = torch.randn(3, 4, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    with torch.no_grad():
        step = FixedShapeStep(first_layer, first_layer, FIXED_SHAPE_OPTIONS)
        assert torch.equal(step(model, x, ignored), model[0](x)) and step.compiled is not None
        assert len(step.weights) == 2
        assert step.weights[0] is model[0].weight and step.weights[1] is model[0].bias
        assert len(step.tensors_of((x, ignored))) == 1 and step.tensors_of((x, ignored))[0] is x


@pytest.mark.slow   # compiling takes seconds
def test_a_fixed_shape_step_is_a_graph_of_its_tensors_that_checks_what_it_was_compiled_for():
    """`FixedShapeStep`: its first call compiles a graph of the model's weights and every tensor
    its arguments hold (a `DecoderCache`'s and a NamedTuple's too), whose later calls give the eager
    results, write the cache in place and read the weights as they are then; a call with a tensor of
    another shape or another constant fails, not reads out of bounds. A step that puts new tensors
    into its arguments runs through its fallback, and gives the eager results."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4).double()
    rows = torch.arange(3)[:, None]

    def arguments(width=5):
        cache = DecoderCache(1)
        cache.keys[0] = torch.zeros(3, 4, width, dtype=torch.float64)
        return torch.randn(3, 4, dtype=torch.float64), Slots(each=torch.tensor([[0], [2], [1]]), rows=rows,
                                                             width=width), cache

    with torch.no_grad():
        step = FixedShapeStep(written_and_read, written_and_read, FIXED_SHAPE_OPTIONS)
        for call in range(3):
            if call == 2:
                model.weight.mul_(2)   # in place: the next call reads it
            x, slots, cache = arguments()
            expected_cache = copy.deepcopy(cache)
            expected = written_and_read(model, x, slots, expected_cache)
            out = step(model, x, slots, cache)
            assert step.compiled is not None
            assert all(torch.equal(got, want) for got, want in zip(out, expected))
            assert torch.equal(cache.keys[0], expected_cache.keys[0])
        x, slots, cache = arguments()
        with pytest.raises((RuntimeError, AssertionError)):
            step(model, torch.randn(2, 4, dtype=torch.float64), slots, cache)
        with pytest.raises(RuntimeError, match="other constants"):
            step(model, x, slots._replace(width=6), cache)
        making = FixedShapeStep(made_and_read, made_and_read, FIXED_SHAPE_OPTIONS)
        x, slots, cache = arguments()
        expected = made_and_read(model, x, slots, copy.deepcopy(cache))
        assert torch.equal(making(model, x, slots, cache), expected) and making.compiled is None
