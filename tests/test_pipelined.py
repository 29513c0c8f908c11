"""Pipelined decoder: hand-checked layout, training/decoding agreement, the cached, batched decoding
against the plain one (`tests.plain_pipelined`), cache, batching, bounds."""
import pytest
import torch
import torch.nn.functional as F

from decoders import build_decoder, decoder_class, pipelined as pipelined_module
from decoders.backbone import (encode, hidden_mask, output_logits, relative_position_bias,
                               run_decoder)
from decoders.loop import LiveRows
from decoders.pipelined import ALL_END, FIRST_EMPTY, Grid, attention_bias, structure_table
from tasks.config import ConfigError, compose
from tests.conftest import (SPECIAL, VOCAB, assert_alone_equals_batched, briefly_trained,
                            first_batch_where, random_batch, tiny_t5)
from tests.plain_pipelined import reference_decode

pytestmark = [pytest.mark.float64, pytest.mark.numerics]  # see tests/conftest.py


def pipelined(model, **options):
    return build_decoder("pipelined", model.config, SPECIAL, **options)


_TRAINED: dict = {}


def trained_model(delay: int):
    """A tiny T5 briefly trained with the pipelined loss at `delay`, shared by the tests below."""
    if delay not in _TRAINED:
        decoder = pipelined(tiny_t5(0), delay=delay, max_subsequences=6, max_subsequence_length=6,
                            max_steps=100)
        _TRAINED[delay] = briefly_trained(decoder)
    return _TRAINED[delay]


def test_layout_of_figure_2_by_hand():
    """'A B C' and 'D E' with delay 1 (the paper's Figure 2), plus the empty terminator."""
    A, B, C, D, E = 10, 11, 12, 13, 14
    b, e = SPECIAL.start, SPECIAL.eos
    layout = pipelined(tiny_t5(0), delay=1).layout([[[A, B, C], [D, E]]])
    assert layout["tokens"][0].tolist() == [b, A, B, C, b, D, E, b]
    assert layout["labels"][0].tolist() == [A, B, C, e, D, E, e, e]
    assert layout["subsequence"][0].tolist() == [0, 0, 0, 0, 1, 1, 1, 2]
    assert layout["offset"][0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    times = (layout["subsequence"] * 1 + layout["offset"])[0].tolist()
    assert times == [0, 1, 2, 3, 1, 2, 3, 2]

    grid = Grid.of_layout(layout, 3)
    table = structure_table(torch.zeros(20, 1), 1, 3, 3)  # zero bias: what remains is visibility
    visible = (attention_bias(table, grid, grid)[0, 0] == 0).int().tolist()
    #            b  A  B  C  b  D  E  b      keys; rows = queries in the same order
    expected = [[1, 0, 0, 0, 0, 0, 0, 0],   # (0,0) t0
                [1, 1, 0, 0, 0, 0, 0, 0],   # (0,1) t1
                [1, 1, 1, 0, 0, 0, 0, 0],   # (0,2) t2
                [1, 1, 1, 1, 0, 0, 0, 0],   # (0,3) t3
                [1, 1, 0, 0, 1, 0, 0, 0],   # (1,0) t1 sees subsequence 0 up to t1
                [1, 1, 1, 0, 1, 1, 0, 0],   # (1,1) t2
                [1, 1, 1, 1, 1, 1, 1, 0],   # (1,2) t3
                [1, 1, 1, 0, 1, 1, 0, 1]]   # (2,0) t2
    assert visible == expected
    # relative distances: Manhattan |i-i'| + |j-j'|, read back through a table bias[d] = d
    table = structure_table(torch.arange(20, dtype=torch.float)[:, None], 1, 3, 3)
    distance = attention_bias(table, grid, grid)[0, 0]
    assert distance[5, 1].item() == 1 + 0      # (1,1) -> (0,1)
    assert distance[6, 3].item() == 1 + 1      # (1,2) -> (0,3)
    assert distance[7, 2].item() == 2 + 2      # (2,0) -> (0,2)
    assert distance[7, 5].item() == 1 + 1      # (2,0) -> (1,1)


def test_training_biases_every_pair_by_its_own_distance_terminator_included():
    """Subsequences of 4, 1, 1 and 1 tokens at delay 1: the terminator (4, 0) sees (0, 4) at
    Manhattan distance 8, beyond max(i + j) = 4. The training forward must give every visible pair
    T5's bias of its exact distance, computed here directly, pair by pair, with no table.

    The decoder's self-attention queries are zeroed, so its attention weights are the position
    bias alone: the fixture's large init scale otherwise saturates the softmax, where a wrong bias
    would change nothing."""
    model = tiny_t5(0)
    with torch.no_grad():
        for block in model.decoder.block:
            block.layer[0].SelfAttention.q.weight.zero_()
    decoder = pipelined(model, delay=1)
    layout = decoder.layout([[[10, 11, 12, 13], [14], [15], [16]]])
    input_ids, attention_mask = random_batch(1, seed=3)
    i, j = layout["subsequence"], layout["offset"]                         # (1, N)
    qi, qj, ki, kj = i[:, :, None], j[:, :, None], i[:, None, :], j[:, None, :]
    visible = (ki <= qi) & (ki + kj <= qi + qj)                              # delay 1
    distance = (qi - ki).abs() + (qj - kj).abs()
    assert distance[visible].max() == 8 and (i == 4).any()  # the terminator is in the layout
    bias = relative_position_bias(model, distance) + hidden_mask(visible, model.dtype)
    hidden = run_decoder(model, layout["tokens"], bias, encode(model, input_ids, attention_mask),
                         attention_mask)
    forced = decoder.teacher_forced_logits(model, input_ids, attention_mask, layout)
    torch.testing.assert_close(forced, output_logits(model, hidden), rtol=0, atol=1e-10)


def test_delay_two_visibility():
    layout = pipelined(tiny_t5(0), delay=2).layout([[[10, 11, 12], [13]]])
    grid = Grid.of_layout(layout, 3)
    visible = attention_bias(structure_table(torch.zeros(20, 1), 2, 3, 3), grid, grid)[0, 0] == 0
    # (1,0) has time 2: it sees (0,0),(0,1),(0,2) but not (0,3) (time 3)
    assert visible[4, :4].tolist() == [True, True, True, False]


def observed_generate(monkeypatch, decoder, model, input_ids, attention_mask):
    """`decoder.generate`, observed through the module-level names its loop calls (the loop runs
    unchanged): `LiveRows` tells each live row's example, `attention_bias` each column's grid
    position, `run_decoder` the cache, `output_logits` the logits of the running columns, row by
    row in column order (the order of `nonzero`).

    Returns (DecodeOutput, logits, calls): logits maps (example, subsequence, offset) -> (vocab,)
    logits; calls lists, per decoder call, (cache length before it, most columns a live example
    had fed before it, columns appended before it, padding included)."""
    seen = {"logits": {}, "calls": [], "appended": 0}
    padding = decoder.max_subsequences   # a padding column's subsequence (`Grid`)

    class ObservedRows(LiveRows):
        def __init__(self, *args):
            super().__init__(*args)
            seen["rows"] = self

    def observed_bias(table, query, keys):
        seen["query"], seen["keys"] = query, keys
        return attention_bias(table, query, keys)

    def observed_run_decoder(model, input_ids, self_bias, encoder_states, encoder_mask, cache, slots,
                             positions):
        # the keys include this call's columns; the call writes right after what the cache holds
        assert slots.start == cache.held()
        fed = (seen["keys"].subsequence != padding).sum(1) - (seen["query"].subsequence != padding).sum(1)
        seen["calls"].append((cache.held(), int(fed.max()), seen["appended"]))
        seen["appended"] += input_ids.size(1)
        return run_decoder(model, input_ids, self_bias, encoder_states, encoder_mask, cache, slots,
                           positions)

    def observed_logits(model, hidden):
        logits = output_logits(model, hidden)                                       # (n, vocab)
        query = seen["query"]
        row, column = (query.subsequence != padding).nonzero(as_tuple=True)         # (n,) each
        cells = zip(seen["rows"].index[row].tolist(), query.subsequence[row, column].tolist(),
                    query.offset[row, column].tolist())
        for cell, position_logits in zip(cells, logits, strict=True):
            seen["logits"][cell] = position_logits
        return logits

    with monkeypatch.context() as patch:
        for name, observed in (("LiveRows", ObservedRows), ("attention_bias", observed_bias),
                               ("output_logits", observed_logits)):
            patch.setattr(pipelined_module, name, observed)
        patch.setattr(decoder, "model_step", lambda: observed_run_decoder)
        out = decoder.generate(model, input_ids, attention_mask)
    return out, seen["logits"], seen["calls"]


def check_decode_equals_teacher_forcing(monkeypatch, model, decoder, input_ids, attention_mask):
    """Feed each decoded example back through the training forward; every logit must agree.

    A subsequence cut at `max_subsequence_length` never had its last token fed, so its layout gets
    one token less; an example that stopped at `max_subsequences` has no terminator position."""
    out, seen, _ = observed_generate(monkeypatch, decoder, model, input_ids, attention_mask)
    cut = decoder.max_subsequence_length
    for b in range(input_ids.size(0)):
        targets = [s[:-1] if len(s) == cut else s for s in out.subsequences[b]]
        layout = decoder.layout([targets])
        logits = decoder.teacher_forced_logits(model, input_ids[b:b + 1], attention_mask[b:b + 1],
                                               layout)[0]
        cells = list(zip(layout["subsequence"][0].tolist(), layout["offset"][0].tolist()))
        for n, (i, j) in enumerate(cells):
            if (b, i, j) not in seen:
                assert i == len(targets) and j == 0  # only the terminator may be missing
                continue
            decoded, forced = seen[(b, i, j)], logits[n]
            # float64 rounding relative to the logits' scale (the fixture's logits reach ~100)
            torch.testing.assert_close(decoded, forced, atol=1e-10 * forced.abs().max().item(), rtol=0)
            assert decoded.argmax() == forced.argmax()
    return out


@pytest.mark.parametrize("delay", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_decoding_equals_teacher_forced_forward_random_model(delay, seed, monkeypatch):
    model = tiny_t5(seed)
    decoder = pipelined(model, delay=delay, max_subsequences=4, max_subsequence_length=6, max_steps=100)
    def writes(input_ids, attention_mask):
        """some non-empty subsequence to check beyond the first position"""
        return any(decoder.generate(model, input_ids, attention_mask).subsequences)
    input_ids, attention_mask = first_batch_where(writes, 6, seed=seed + 5)
    check_decode_equals_teacher_forcing(monkeypatch, model, decoder, input_ids, attention_mask)


@pytest.mark.parametrize("delay", [1, 2, 3])
def test_decoding_equals_teacher_forced_forward_trained_model(delay, monkeypatch):
    model = trained_model(delay)
    decoder = pipelined(model, delay=delay, max_subsequences=6, max_subsequence_length=6, max_steps=100)

    def several_and_ended(input_ids, attention_mask):
        """an output of several subsequences, and one that ended by itself (the terminator)"""
        out = decoder.generate(model, input_ids, attention_mask)
        return max(len(s) for s in out.subsequences) >= 2 and not all(out.bound_hit)
    input_ids, attention_mask = first_batch_where(several_and_ended, 6, max_len=9, seed=55, tries=50)
    check_decode_equals_teacher_forcing(monkeypatch, model, decoder, input_ids, attention_mask)


def assert_equals_reference(monkeypatch, decoder, model, input_ids, attention_mask):
    """The cached, batched decoding and the plain one (`tests.plain_pipelined`) give the same
    output, every field of it, and the same logits at every position, to float64 rounding."""
    out, logits, _ = observed_generate(monkeypatch, decoder, model, input_ids, attention_mask)
    plain, plain_logits = reference_decode(decoder, model, input_ids, attention_mask)
    assert out == plain
    assert logits.keys() == plain_logits.keys()
    for key in logits:
        scale = plain_logits[key].abs().max().item()
        torch.testing.assert_close(logits[key], plain_logits[key], atol=1e-10 * scale, rtol=0)
    return out


@pytest.mark.parametrize("stop_rule", [FIRST_EMPTY, ALL_END])
@pytest.mark.parametrize("delay", [1, 2, 3])
@pytest.mark.parametrize("trained", [False, True])
def test_decoding_equals_the_plain_reference(trained, delay, stop_rule, monkeypatch):
    model = trained_model(delay) if trained else tiny_t5(2)
    decoder = pipelined(model, delay=delay, max_subsequences=4, max_subsequence_length=6, max_steps=30,
                        stop_rule=stop_rule)
    def several(input_ids, attention_mask):
        """an output of several subsequences, so that cached columns of earlier ones are read"""
        return max(len(s) for s in decoder.generate(model, input_ids, attention_mask).subsequences) >= 2
    input_ids, attention_mask = first_batch_where(several, 4, max_len=9, seed=9, tries=50)
    assert_equals_reference(monkeypatch, decoder, model, input_ids, attention_mask)


# One bound each, tight enough to cut outputs of the trained models (decoding 6 slots of 6 tokens).
BOUNDS = {"max_subsequences": 2, "max_subsequence_length": 2, "max_new_tokens": 5, "max_steps": 3}


@pytest.mark.parametrize("stop_rule", [FIRST_EMPTY, ALL_END])
@pytest.mark.parametrize("delay", [1, 2])
@pytest.mark.parametrize("bound", list(BOUNDS))
def test_bounds_equal_the_plain_reference(bound, delay, stop_rule, monkeypatch):
    """Not vacuous by construction: in the batch, the bound changes an output, and an example
    ends by itself."""
    model = trained_model(delay)
    options = dict(delay=delay, stop_rule=stop_rule, max_subsequences=6, max_subsequence_length=6)
    decoder, unbounded = pipelined(model, **{**options, bound: BOUNDS[bound]}), pipelined(model, **options)

    def binds(input_ids, attention_mask):
        """the bound changes an output, and an example ends by itself"""
        out = decoder.generate(model, input_ids, attention_mask)
        return (out.subsequences != unbounded.generate(model, input_ids, attention_mask).subsequences
                and not all(out.bound_hit))
    input_ids, attention_mask = first_batch_where(binds, 6, max_len=9, seed=40, tries=50)
    assert_equals_reference(monkeypatch, decoder, model, input_ids, attention_mask)


def test_cache_holds_no_more_columns_than_the_fullest_example_fed(monkeypatch):
    """Each call appends the batch's largest running count of columns to every example; padding
    past the fullest live example's columns is packed away, so before every call the cache length
    equals the most tokens a live example fed (stated in `generate`). Not vacuous by construction:
    the batch is chosen so that the columns appended (what the cache would hold unpacked) exceed
    that at some call, which happens when the example running most subsequences changes or
    finishes first."""
    model = trained_model(1)
    decoder = pipelined(model, delay=1, max_subsequences=3, max_subsequence_length=6, max_steps=40)

    def outgrows(input_ids, attention_mask):
        """unpacked, the cache would hold padding past the fullest example's columns"""
        calls = observed_generate(monkeypatch, decoder, model, input_ids, attention_mask)[2]
        return any(appended > fed for _, fed, appended in calls)
    # batches of 12: at every CPU kernel level some of the first few dozen have such a call
    input_ids, attention_mask = first_batch_where(outgrows, 12, max_len=9, seed=12, tries=200)
    _, _, calls = observed_generate(monkeypatch, decoder, model, input_ids, attention_mask)
    assert all(length == fed for length, fed, _ in calls)
    # packing changes no output
    assert_equals_reference(monkeypatch, decoder, model, input_ids, attention_mask)


@pytest.mark.parametrize("stop_rule", [FIRST_EMPTY, ALL_END])
def test_alone_equals_in_batch(stop_rule):
    model = trained_model(1)
    decoder = pipelined(model, delay=1, max_subsequences=6, max_subsequence_length=6, max_steps=40,
                        stop_rule=stop_rule)
    def uneven(input_ids, attention_mask):
        """examples that run different numbers of calls, so that rows leave the batch early"""
        return len(set(decoder.generate(model, input_ids, attention_mask).decoder_calls)) >= 2
    input_ids, attention_mask = first_batch_where(uneven, 6, max_len=9, seed=21, tries=50)
    assert_alone_equals_batched(decoder, model, input_ids, attention_mask)


def test_fewer_calls_than_tokens_and_bounds_reported():
    model = trained_model(1)
    decoder = pipelined(model, delay=1, max_subsequences=6, max_subsequence_length=6, max_steps=40)

    def several_and_long(input_ids, attention_mask):
        """an output of several subsequences, and an example that takes more than 2 calls"""
        out = decoder.generate(model, input_ids, attention_mask)
        return (max(len(s) for s in out.subsequences) >= 2) and max(out.decoder_calls) > 2
    input_ids, attention_mask = first_batch_where(several_and_long, 6, max_len=9, seed=3, tries=50)
    out = decoder.generate(model, input_ids, attention_mask)
    for calls, tokens, subs in zip(out.decoder_calls, out.tokens, out.subsequences):
        if len(subs) >= 2:
            assert calls < tokens  # several subsequences advance in the same call
    short = pipelined(model, delay=1, max_subsequences=6, max_subsequence_length=6, max_steps=2)
    bounded = short.generate(model, input_ids, attention_mask)
    assert bounded.bound_hit == [calls > 2 for calls in out.decoder_calls]


@pytest.mark.parametrize("stop_rule,delay,calls", [
    (FIRST_EMPTY, 1, 4), (FIRST_EMPTY, 2, 5), (FIRST_EMPTY, 3, 7),
    (ALL_END, 1, 4), (ALL_END, 2, 5), (ALL_END, 3, 6)])
def test_calls_for_output_by_hand(stop_rule, delay, calls):
    """'A B C' and 'D E' emit e at steps 3 and d + 2. first_empty: they and the empty terminator
    run over steps {0-3} u {d..d+2} u {2d}. all_end: decoding ends at the later end token, step
    max(3, d + 2), and every step up to it has a call (at d = 3, 'D E' starts at step 3, while
    'A B C' still runs: no gap)."""
    decoder = pipelined(tiny_t5(0), delay=delay, stop_rule=stop_rule)
    assert decoder.calls_for_output([[10, 11, 12], [13, 14]]) == calls
    # first_empty: the empty subsequence alone; all_end: the first exploration fails at step 0
    assert decoder.calls_for_output([]) == 1


def test_calls_for_output_of_an_output_the_paper_rule_cannot_produce():
    """At d = 3, 'A' emits e at step 1: under all_end nothing runs after it and decoding ends
    before 'B' could start at step 3, so no decoding produces ['A', 'B']; first_empty waits."""
    output = [[10], [11]]
    assert pipelined(tiny_t5(0), delay=3, stop_rule=ALL_END).calls_for_output(output) is None
    assert pipelined(tiny_t5(0), delay=3, stop_rule=FIRST_EMPTY).calls_for_output(output) == 5


def scripted_pipelined(monkeypatch, script: dict, **options):
    """A pipelined decoder whose backbone's answers are scripted, whatever the inputs: the query at
    grid position (subsequence i, offset j) emits `script[(i, j)]`, or the end token where the
    script has none. The decoding loop itself runs unchanged; the stand-in replaces only the three
    functions it calls on the backbone: the attention bias carries each query's (i, j) instead,
    the decoder returns it as its hidden state, and the output head reads the script there.

    Returns the decoder and the calls it makes, each a list of (i, j, token emitted)."""
    calls: list = []

    def query_positions(table, query, keys):
        return torch.stack([query.subsequence, query.offset], -1)                   # (B, R, 2)

    def scripted_logits(model, positions):                                           # (n, 2)
        cells = [tuple(position) for position in positions.tolist()]
        tokens = [script.get(cell, SPECIAL.eos) for cell in cells]
        calls.append([(i, j, token) for (i, j), token in zip(cells, tokens)])
        return F.one_hot(torch.tensor(tokens), VOCAB).to(torch.get_default_dtype())  # (n, vocab)

    monkeypatch.setattr(pipelined_module, "attention_bias", query_positions)
    monkeypatch.setattr(pipelined_module, "output_logits", scripted_logits)
    decoder = pipelined(tiny_t5(0), **options)
    monkeypatch.setattr(decoder, "model_step", lambda: lambda model, ids, positions, *a: positions)
    return decoder, calls


A, B, C, D, E, X = 10, 11, 12, 13, 14, 15
FIGURE_2 = {(0, 0): A, (0, 1): B, (0, 2): C, (1, 0): D, (1, 1): E}   # all else: e


@pytest.mark.parametrize("stop_rule", [FIRST_EMPTY, ALL_END])
def test_figure_2_by_hand(stop_rule, monkeypatch):
    """The paper's Figure 2 (d = 1; the paper counts steps from 1, here from 0). Step 0: 'A'.
    Step 1: subsequence 2 starts: 'B', 'D'. Step 2: 'C', 'E', and the exploration of a new
    subsequence fails (e). Step 3: under the paper's rule (all_end) both subsequences AND a new
    exploration emit e, which ends decoding; under first_empty the failed exploration of step 2
    already stopped new starts, so step 3 explores nothing. Same output and calls, one token
    fewer."""
    e = SPECIAL.eos
    decoder, calls = scripted_pipelined(monkeypatch, FIGURE_2, delay=1, max_subsequences=8,
                                        max_subsequence_length=8, max_steps=20, stop_rule=stop_rule)
    out = decoder.generate(tiny_t5(0), *random_batch(1, seed=3))
    last_step = [(0, 3, e), (1, 2, e)] + ([(3, 0, e)] if stop_rule == ALL_END else [])
    assert calls == [[(0, 0, A)],
                     [(0, 1, B), (1, 0, D)],
                     [(0, 2, C), (1, 1, E), (2, 0, e)],
                     last_step]
    assert out.subsequences == [[[A, B, C], [D, E]]]
    assert out.decoder_calls == [4] and out.batch_decoder_calls == 4
    assert out.tokens == [9 if stop_rule == ALL_END else 8]
    assert out.bound_hit == [False]


@pytest.mark.parametrize("stop_rule", [FIRST_EMPTY, ALL_END])
def test_an_exploration_after_a_failed_one_is_kept_only_by_the_paper_rule(stop_rule, monkeypatch):
    """Figure 2, but the exploration of step 3 writes 'X': under all_end the failed exploration of
    step 2 is dropped and 'X' is output (it ends at step 4 with a new failed exploration);
    first_empty never starts it and ends at step 3 as in Figure 2."""
    e = SPECIAL.eos
    decoder, calls = scripted_pipelined(monkeypatch, {**FIGURE_2, (3, 0): X}, delay=1,
                                        max_subsequences=8, max_subsequence_length=8, max_steps=20,
                                        stop_rule=stop_rule)
    out = decoder.generate(tiny_t5(0), *random_batch(1, seed=3))
    if stop_rule == ALL_END:
        assert calls[3:] == [[(0, 3, e), (1, 2, e), (3, 0, X)], [(3, 1, e), (4, 0, e)]]
        assert out.subsequences == [[[A, B, C], [D, E], [X]]] and out.decoder_calls == [5]
    else:
        assert calls[3:] == [[(0, 3, e), (1, 2, e)]]
        assert out.subsequences == [[[A, B, C], [D, E]]] and out.decoder_calls == [4]
    assert out.bound_hit == [False]


@pytest.mark.parametrize("stop_rule", [FIRST_EMPTY, ALL_END])
def test_a_denied_exploration_is_a_bound_hit_under_the_paper_rule(stop_rule, monkeypatch):
    """Figure 2 with 3 slots: the failed exploration takes slot 2. first_empty has its terminator
    there and ends by itself; under all_end the exploration of step 3 finds no slot left, so the
    example was cut by `max_subsequences`."""
    decoder, _ = scripted_pipelined(monkeypatch, FIGURE_2, delay=1, max_subsequences=3,
                                    max_subsequence_length=8, max_steps=20, stop_rule=stop_rule)
    out = decoder.generate(tiny_t5(0), *random_batch(1, seed=3))
    assert out.subsequences == [[[A, B, C], [D, E]]]
    assert out.bound_hit == [stop_rule == ALL_END]


REFERENCES = [[], [[10]], [[10, 11, 12], [13, 14]], [[10], [11]], [[10, 11, 12, 13], [14], [15]],
              [[10], [11, 12, 13, 14], [15, 16]]]


@pytest.mark.parametrize("stop_rule", [FIRST_EMPTY, ALL_END])
@pytest.mark.parametrize("delay", [1, 2, 3])
def test_calls_for_output_equals_scripted_decoding(stop_rule, delay, monkeypatch):
    """A backbone scripted to write each reference takes `calls_for_output(reference)` calls of
    the real decoding loop; where that is None (all_end, a start after a gap) decoding does not
    reproduce the reference."""
    for reference in REFERENCES:
        script = {(i, j): token for i, sub in enumerate(reference) for j, token in enumerate(sub)}
        decoder, calls = scripted_pipelined(monkeypatch, script, delay=delay, max_subsequences=12,
                                            max_subsequence_length=8, max_steps=40,
                                            stop_rule=stop_rule)
        out = decoder.generate(tiny_t5(0), *random_batch(1, seed=3))
        assert out.bound_hit == [False] and out.decoder_calls == [len(calls)]
        expected = decoder.calls_for_output(reference)
        if expected is None:
            assert stop_rule == ALL_END and out.subsequences[0] != reference
        else:
            assert out.subsequences == [reference] and out.decoder_calls == [expected]


@pytest.mark.parametrize("stop_rule", [FIRST_EMPTY, ALL_END])
@pytest.mark.parametrize("delay", [1, 2, 3])
def test_calls_for_output_equals_decoding(delay, stop_rule):
    """On outputs that ended by themselves, the count from the output alone is what decoding took;
    under all_end it is the fewest calls that write the output (an exploration that failed between
    two subsequences costs calls the output does not show: `calls_for_output`), so decoding takes
    at least that many, and exactly that many where nothing failed in between.

    Not vacuous: batches are decoded until at least 4 outputs that ended by themselves, with at
    least 2 different call counts, have been checked, exactly so at least once."""
    model = trained_model(delay)
    decoder = pipelined(model, delay=delay, max_subsequences=6, max_subsequence_length=6, max_steps=100,
                        stop_rule=stop_rule)
    checked, counts, exact = 0, set(), 0
    for seed in range(77, 97):
        input_ids, attention_mask = random_batch(12, max_len=9, seed=seed)
        out = decoder.generate(model, input_ids, attention_mask)
        for subsequences, calls, bounded in zip(out.subsequences, out.decoder_calls, out.bound_hit):
            if not bounded:
                expected = decoder.calls_for_output(subsequences)
                if stop_rule == FIRST_EMPTY:
                    assert expected == calls
                else:
                    assert expected is not None and expected <= calls
                checked, counts, exact = checked + 1, counts | {calls}, exact + (expected == calls)
        if checked >= 4 and len(counts) >= 2 and exact:
            return
    pytest.fail(f"only {checked} outputs ended by themselves ({exact} with exactly the calls "
                f"counted from them), with call counts {sorted(counts)}")


def test_max_subsequences_reached_is_a_bound_hit():
    """With one slot, an example whose first subsequence is not empty never gets to emit its empty
    terminator: it was cut by `max_subsequences` and is reported as bound-hit, like `max_steps`."""
    model = trained_model(1)
    decoder = pipelined(model, delay=1, max_subsequences=1, max_subsequence_length=6, max_steps=100)

    def writes(input_ids, attention_mask):
        """an example whose first subsequence is not empty"""
        return any(decoder.generate(model, input_ids, attention_mask).subsequences)
    input_ids, attention_mask = first_batch_where(writes, 12, max_len=9, seed=31, tries=50)
    out = decoder.generate(model, input_ids, attention_mask)
    assert out.bound_hit == [bool(subsequences) for subsequences in out.subsequences]


def test_loss_is_cross_entropy_over_all_labels():
    model = tiny_t5(0)
    decoder = pipelined(model)
    input_ids, attention_mask = random_batch(2, seed=4)
    layout = decoder.layout([[[7, 8], [9]], [[10]]])
    loss = decoder.loss(model, input_ids, attention_mask, layout)
    logits = decoder.teacher_forced_logits(model, input_ids, attention_mask, layout)
    labels = layout["labels"]
    assert (labels != -100).sum() == (3 + 2 + 1) + (2 + 1)  # s_i + e for each, the empty one's e too
    expected = torch.nn.functional.cross_entropy(logits[labels != -100], labels[labels != -100])
    torch.testing.assert_close(loss, expected)


def test_bad_options():
    with pytest.raises(ValueError, match="decoder.delay must be an integer >= 1, got 0"):
        pipelined(tiny_t5(0), delay=0)


def test_bad_stop_rule_is_a_one_line_config_error_naming_the_value_and_the_allowed_ones():
    message = "decoder.stop_rule must be one of 'first_empty', 'all_end', got 'paper'"
    with pytest.raises(ConfigError) as err:
        compose("keyphrase", "pipelined", overrides=["decoder.stop_rule=paper"])
    assert str(err.value) == message
    with pytest.raises(ValueError) as err:
        pipelined(tiny_t5(0), stop_rule="paper")
    assert str(err.value) == message
    assert compose("keyphrase", "pipelined").decoder.stop_rule == FIRST_EMPTY
    assert "stop_rule" in decoder_class("pipelined").decode_only_options()  # swept without retraining
