"""The non-autoregressive (Mask-Predict) decoder: call counting, host syncs, confidences and their
memory, length predictor, re-masking schedule, batching, bidirectional attention, training."""
import math

import pytest
import torch
import torch.nn.functional as F

import decoders.nar as nar
from decoders import build_decoder
from decoders.backbone import (encode, hidden_mask, output_logits, relative_position_bias, same_encoder,
                               run_decoder)
from decoders.sequential import join_subsequences
from decoders.transformers_internals import bias_owner
from tasks.config import compose
from transformers import T5Config
from tests.conftest import (SPECIAL, VOCAB, assert_alone_equals_batched, briefly_trained,
                            first_batch_where, random_batch, tiny_t5)

pytestmark = [pytest.mark.float64, pytest.mark.numerics]  # see tests/conftest.py


def make(model, seed=0, **options):
    torch.manual_seed(seed)  # the length predictor's initial weights
    return build_decoder("nar", model.config, SPECIAL, **options)


# -- 1. decoder calls ---------------------------------------------------------------------------

def force_length(decoder, length):
    """Every example's predicted length is `length` (the length predictor's bias alone)."""
    with torch.no_grad():
        decoder.length_predictor.weight.zero_()
        decoder.length_predictor.bias.copy_(torch.eye(decoder.max_new_tokens)[length - 1] * 10)


def count_passes(decoder):
    """Wrap the decoder's pass; returns the list that receives (rows, width) of each real pass."""
    passes = []
    real_pass = decoder.decoder_hidden

    def counting_pass(model, decoder_input, *args):
        passes.append(tuple(decoder_input.shape))
        return real_pass(model, decoder_input, *args)
    decoder.decoder_hidden = counting_pass
    return passes


def test_passes_are_the_iterations_that_remask_something():
    """The closed form against the schedule itself: pass 0, then every t whose re-mask set is not
    empty (n_t only shrinks with t, so these are the first ones)."""
    for T in range(1, 9):
        for L in range(1, 21):
            remasking = [bool(nar.tokens_to_remask(torch.zeros(1, L), torch.tensor([L]), t, T).any())
                         for t in range(1, T)]
            assert remasking == sorted(remasking, reverse=True)            # a prefix of 1..T-1
            assert nar.mask_predict_passes(L, T) == 1 + sum(remasking), (L, T)
    # by hand (T = 4): L = 1 re-masks nothing after pass 0; L = 2, 3 nothing at t = 3
    assert [nar.mask_predict_passes(L, 4) for L in (1, 2, 3, 4, 5, 96)] == [1, 3, 3, 4, 4, 4]


@pytest.mark.parametrize("length,iterations,passes", [
    (1, 4, 1), (2, 4, 3), (3, 4, 3), (4, 4, 4), (9, 4, 4), (2, 6, 4), (4, 6, 5), (5, 1, 1)])
def test_iterations_that_remask_nothing_are_not_run(length, iterations, passes):
    model = tiny_t5(0)
    decoder = make(model, iterations=iterations, max_new_tokens=12)
    force_length(decoder, length)
    run = count_passes(decoder)
    out = decoder.generate(model, *random_batch(5, seed=3))
    assert out.tokens == [length] * 5
    assert run == [(5, length)] * passes                  # one batched pass of every row each time
    assert out.batch_decoder_calls == passes and out.decoder_calls == [passes] * 5


@pytest.mark.parametrize("candidates", [1, 3])
def test_example_calls_are_its_longest_candidates_passes(candidates):
    """A batch runs the passes its longest candidate needs; each example reports those of its own
    longest candidate (the top-k lengths, read here from the length predictor)."""
    model = tiny_t5(0)
    T = 6
    decoder = make(model, iterations=T, length_candidates=candidates, max_new_tokens=6)

    def own_calls(input_ids, attention_mask):
        scores = decoder.length_logits(encode(model, input_ids, attention_mask), attention_mask)
        longest = (scores.topk(candidates, dim=1).indices + 1).amax(1)       # (B,)
        return [nar.mask_predict_passes(L, T) for L in longest.tolist()]

    def varied(input_ids, attention_mask):
        """examples that need different numbers of passes"""
        return len(set(own_calls(input_ids, attention_mask))) >= 2
    input_ids, attention_mask = first_batch_where(varied, 6, seed=10)
    run = count_passes(decoder)
    out = decoder.generate(model, input_ids, attention_mask)
    assert out.decoder_calls == own_calls(input_ids, attention_mask)
    assert len(run) == out.batch_decoder_calls == max(out.decoder_calls)
    assert all(rows == 6 * candidates for rows, _ in run)  # all candidates in one batched call


REFERENCES = [[], [[10]], [[10, 11]], [[10], [12]], [[10, 11], [12]], [[10, 11], [12, 13]],
              [[10, 11, 12], [13], [14]]]                   # flat lengths 1, 2, 3, 4, 5, 6, 8


@pytest.mark.parametrize("iterations", [1, 3, 4, 6])
def test_calls_for_output_equals_decoding(iterations, monkeypatch):
    """A model that reproduces each reference exactly (its vocabulary projection scripted to the
    reference's flat target, whatever the inputs) takes `calls_for_output(reference)` passes of
    the real decoding loop."""
    model = tiny_t5(0)
    for reference in REFERENCES:
        flat = join_subsequences(reference, SPECIAL.sep, SPECIAL.eos)                 # (L,)

        def scripted(model, hidden):                                                 # (N, L, d)
            return F.one_hot(torch.tensor(flat), VOCAB).to(hidden.dtype).expand(
                hidden.size(0), -1, -1) * 5.0                                        # (N, L, V)
        monkeypatch.setattr(nar, "output_logits", scripted)
        decoder = make(model, iterations=iterations, max_new_tokens=12)
        force_length(decoder, len(flat))
        run = count_passes(decoder)
        out = decoder.generate(model, *random_batch(3, seed=1))
        assert out.subsequences == [reference] * 3 and out.bound_hit == [False] * 3
        assert out.decoder_calls == [decoder.calls_for_output(reference)] * 3 == [len(run)] * 3
        assert len(run) == nar.mask_predict_passes(len(flat), iterations)


def test_calls_for_output_with_several_candidates_is_none_where_the_model_decides():
    """With k candidates the example also takes the passes of its longest one, a model-chosen
    length >= k (k distinct lengths): known when max(L, k) >= T, else model-dependent (None)."""
    model = tiny_t5(0)
    three = make(model, iterations=4, length_candidates=3, max_new_tokens=12)
    assert three.calls_for_output([[10, 11], [12]]) == 4                     # L = 5 >= T
    assert three.calls_for_output([[10], [12]]) == 4                         # L = 4
    assert three.calls_for_output([[10, 11]]) is None                        # L = 3, k = 3 < T
    four = make(model, iterations=4, length_candidates=4, max_new_tokens=12)
    assert four.calls_for_output([]) == 4                                    # some candidate is >= 4
    # a reference longer than max_new_tokens is cut to it, as in training: 3 positions, 3 passes
    short = make(model, iterations=4, max_new_tokens=3)
    assert short.calls_for_output([[10, 11, 12, 13, 14]]) == 3


def test_host_syncs_do_not_grow_with_iterations():
    """One read-back of the candidate lengths before decoding, one of the results after, whatever T
    (the encoder's own syncs, inside transformers, counted apart)."""
    from tasks.bench.sync_points import counting_sync_points
    model = tiny_t5(0)
    input_ids, attention_mask = random_batch(4, seed=2)
    with torch.no_grad(), counting_sync_points() as encoder_only:
        encode(model, input_ids, attention_mask)
    for T in (1, 6):
        decoder = make(model, iterations=T, length_candidates=2, max_new_tokens=12)
        with counting_sync_points() as counter:
            out = decoder.generate(model, input_ids, attention_mask)
        assert out.batch_decoder_calls > 1 or T == 1
        assert counter.count - encoder_only.count == 2, T


# -- 1b. confidences without a second vocabulary-sized tensor ----------------------------------

def one_pass(model, length=8, batch=4):
    """The inputs of one decoding pass: every third position a token, the others masked."""
    input_ids, attention_mask = random_batch(batch, seed=5)
    states = encode(model, input_ids, attention_mask)
    decoder_input = torch.full((batch, length), SPECIAL.mask)
    decoder_input[:, 1::3] = torch.arange(10, 10 + batch)[:, None]
    bias = nar.self_attention_bias(model, torch.ones(batch, length, dtype=torch.bool))
    return decoder_input, bias, states, attention_mask


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("rows_per_block", [1, 5, 32])   # 32 rows: the whole pass in one block
def test_confidences_are_bit_for_bit_todays_log_softmax(dtype, rows_per_block, monkeypatch):
    """Tokens and confidences of one pass equal those of a log-softmax over all logits at once,
    bit for bit in float32 too, whatever the blocks (5 rows: a shorter last block)."""
    model = tiny_t5(0)
    decoder = make(model, max_new_tokens=12)
    args = one_pass(model)                                                          # N*W = 32
    with torch.no_grad():
        logits = output_logits(model, decoder.decoder_hidden(model, *args)).to(dtype)  # (N, W, V)
    # the mask token leading at every other position (by half a unit): there it must be skipped by
    # the argmax and still count in the normaliser
    logits[:, ::2, SPECIAL.mask] = logits[:, ::2].amax(-1) + 0.5
    monkeypatch.setattr(nar, "output_logits", lambda model, hidden: logits)
    monkeypatch.setattr(nar, "LOG_SOFTMAX_BLOCK", rows_per_block * VOCAB)
    with torch.no_grad():
        tokens, confidence = decoder._predict(model, *args)
    reference = logits.log_softmax(-1)
    reference[..., SPECIAL.mask] = float("-inf")
    expected_confidence, expected_tokens = reference.max(-1)
    assert torch.equal(tokens, expected_tokens) and torch.equal(confidence, expected_confidence)


def test_a_pass_without_confidences_gives_the_same_tokens(monkeypatch):
    """A pass whose confidences nobody reads (`confidences=False`) takes the argmax of the logits
    with the mask token excluded: the tokens of the log-softmax pass, where the mask token leads
    too, and no confidences."""
    model = tiny_t5(0).double()
    decoder = make(model, max_new_tokens=12)
    args = one_pass(model)
    with torch.no_grad():
        logits = output_logits(model, decoder.decoder_hidden(model, *args))             # (N, W, V)
    logits[:, ::2, SPECIAL.mask] = logits[:, ::2].amax(-1) + 0.5
    monkeypatch.setattr(nar, "output_logits", lambda model, hidden: logits.clone())
    with torch.no_grad():
        expected, _ = decoder._predict(model, *args)
        tokens, confidence = decoder._predict(model, *args, confidences=False)
    assert torch.equal(tokens, expected) and confidence is None
    assert (tokens != SPECIAL.mask).all()


def test_one_vocabulary_sized_tensor_and_one_block_buffer_per_pass(monkeypatch):
    """The tensors with a vocabulary axis that a pass allocates: the (N, W, V) logits and ONE
    block buffer, reused by every block (a log-softmax of all logits would be a second (N, W, V)
    tensor, as big as the logits)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    model = tiny_t5(0)
    decoder = make(model, max_new_tokens=12)
    args = one_pass(model)
    with torch.no_grad():
        hidden = decoder.decoder_hidden(model, *args)                      # (N, W, d_model)
    monkeypatch.setattr(decoder, "decoder_hidden", lambda *_: hidden)      # only the head is seen
    monkeypatch.setattr(nar, "LOG_SOFTMAX_BLOCK", 5 * VOCAB)              # 7 blocks of N*W = 32

    class NewTensorsWithAVocabularyAxis(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            inputs = {a.untyped_storage().data_ptr() for a in (*args, *kwargs.values())
                      if isinstance(a, torch.Tensor)}                      # out= buffers too
            out = func(*args, **kwargs)
            for o in out if isinstance(out, tuple) else (out,):
                if (isinstance(o, torch.Tensor) and o.dim() >= 2 and o.size(-1) == VOCAB
                        and o.untyped_storage().data_ptr() not in inputs):
                    self.sizes.append(o.numel() // VOCAB)                  # positions it holds
            return out
    with torch.no_grad(), NewTensorsWithAVocabularyAxis() as allocations:
        decoder._predict(model, *args)
    assert sorted(allocations.sizes) == [5, 32]


# -- 2. length predictor -----------------------------------------------------------------------

def test_length_predictor_loss_and_prediction():
    model = tiny_t5(0)
    max_new_tokens, known = 10, 7
    decoder = make(model, max_new_tokens=max_new_tokens, iterations=2, length_loss_weight=0.5)
    bias = torch.full((max_new_tokens,), -1.0)
    bias[known - 1] = 5.0                       # class k <-> length k + 1
    with torch.no_grad():
        decoder.length_predictor.weight.zero_()
        decoder.length_predictor.bias.copy_(bias)

    input_ids, attention_mask = random_batch(3, seed=4)
    out = decoder.generate(model, input_ids, attention_mask)
    assert out.tokens == [known] * 3

    targets = [[[7, 8], [9]], [[10]], [[11, 12, 13, 14]]]       # flat lengths 5, 2, 5
    layout = decoder.layout(targets)
    assert layout["lengths"].tolist() == [5, 2, 5]
    # hand-computed CE: every example has logits `bias`; the loss is logsumexp - logit of the truth
    logsumexp = math.log(math.exp(5.0) + (max_new_tokens - 1) * math.exp(-1.0))
    expected_length_ce = sum(logsumexp - bias[length - 1].item() for length in (5, 2, 5)) / 3
    logits = decoder.length_logits(encode(model, input_ids, attention_mask), attention_mask)
    assert F.cross_entropy(logits, layout["lengths"] - 1).item() == pytest.approx(expected_length_ce)

    # total loss = token CE + weight * length CE: the same masking (same RNG state) without the
    # length term differs by exactly weight * the hand-computed CE
    without = make(model, max_new_tokens=max_new_tokens, length_loss_weight=0.0)
    without.load_state_dict(decoder.state_dict())
    torch.manual_seed(123)
    with_length = decoder.loss(model, input_ids, attention_mask, layout)
    torch.manual_seed(123)
    token_only = without.loss(model, input_ids, attention_mask, layout)
    assert (with_length - token_only).item() == pytest.approx(0.5 * expected_length_ce, rel=1e-5)


def test_bound_hit_means_cut_by_max_length():
    model = tiny_t5(0)
    with torch.no_grad():
        model.lm_head.weight[SPECIAL.eos] = 0.0  # logit 0: below the best of the other, random logits
    decoder = make(model, max_new_tokens=6, iterations=2)
    input_ids, attention_mask = random_batch(3, seed=4)
    for length, hit in ((5, False), (6, True)):
        with torch.no_grad():
            decoder.length_predictor.weight.zero_()
            decoder.length_predictor.bias.copy_(torch.eye(6)[length - 1] * 10)
        out = decoder.generate(model, input_ids, attention_mask)
        assert out.tokens == [length] * 3 and out.bound_hit == [hit] * 3


def test_length_pooling_ignores_source_padding():
    model = tiny_t5(0)
    decoder = make(model, max_new_tokens=12)
    input_ids, attention_mask = random_batch(4, seed=6)
    batched = decoder.length_logits(encode(model, input_ids, attention_mask), attention_mask)
    for i in range(4):
        n = int(attention_mask[i].sum())
        ids, mask = input_ids[i:i + 1, :n], attention_mask[i:i + 1, :n]
        alone = decoder.length_logits(encode(model, ids, mask), mask)
        assert torch.allclose(alone[0], batched[i], atol=1e-5)


# -- 3. masking schedule -----------------------------------------------------------------------

def test_remask_schedule_counts_ties_and_padding():
    conf = torch.tensor([[0.9, 0.2, 0.5, 0.2, 0.2, 0.7, 0.1, 0.8],
                         [0.3, 0.3, 0.3, 0.0, 0.0, 0.0, 0.0, 0.0]])   # row 1: length 3, then padding
    lengths = torch.tensor([8, 3])
    T = 4

    def remasked(t):
        m = nar.tokens_to_remask(conf, lengths, t, T)
        return [torch.nonzero(row).flatten().tolist() for row in m]

    assert remasked(0) == [list(range(8)), [0, 1, 2]]          # n = L: everything real
    # t=1: n = floor(8*3/4) = 6 and floor(3*3/4) = 2 -> row 1 ties: the lower positions first
    assert remasked(1) == [[1, 2, 3, 4, 5, 6], [0, 1]]
    # t=2: n = 4 and 1; row 0: 0.1 at 6, then the three 0.2s at 1, 3, 4 (all fit)
    assert remasked(2) == [[1, 3, 4, 6], [0]]
    # t=3: n = 2 and 0; row 0: 0.1 at 6, then one of the tied 0.2s -> the lowest position, 1
    assert remasked(3) == [[1, 6], []]
    with pytest.raises(ValueError, match="iteration must be in 0..3, got 4"):
        nar.tokens_to_remask(conf, lengths, 4, T)


def test_remask_counts_follow_floor_schedule():
    torch.manual_seed(0)
    conf = torch.rand(5, 20)
    lengths = torch.tensor([1, 2, 7, 13, 20])
    for T in (1, 2, 3, 5):
        for t in range(T):
            m = nar.tokens_to_remask(conf, lengths, t, T)
            assert m.sum(1).tolist() == [L * (T - t) // T for L in lengths.tolist()]
            assert not (m & (torch.arange(20)[None] >= lengths[:, None])).any()  # padding never


def test_training_mask_is_uniform_in_count_and_stays_inside_the_target():
    torch.manual_seed(0)
    lengths = torch.tensor([1, 4, 9])
    counts = {1: set(), 4: set(), 9: set()}
    for _ in range(300):
        m = nar.sample_training_mask(lengths, 9)
        assert not (m & (torch.arange(9)[None] >= lengths[:, None])).any()
        for L, c in zip(lengths.tolist(), m.sum(1).tolist()):
            counts[L].add(c)
    assert counts == {1: {1}, 4: {1, 2, 3, 4}, 9: set(range(1, 10))}


# -- 4. batching -------------------------------------------------------------------------------

@pytest.mark.parametrize("candidates,iterations,max_new_tokens", [(1, 3, 12), (3, 3, 12), (1, 6, 6),
                                                             (3, 6, 6)])
def test_batch_equals_one_at_a_time(candidates, iterations, max_new_tokens):
    model = tiny_t5(1)
    decoder = make(model, iterations=iterations, length_candidates=candidates,
                   max_new_tokens=max_new_tokens)

    def varied(input_ids, attention_mask):
        """different source lengths, output lengths and, where lengths below T are likely,
        decoder calls"""
        out = decoder.generate(model, input_ids, attention_mask)
        return (len(set(attention_mask.sum(1).tolist())) >= 3 and len(set(out.tokens)) >= 2
                and (max_new_tokens > iterations or len(set(out.decoder_calls)) >= 2))
    input_ids, attention_mask = first_batch_where(varied, 5, seed=3)
    assert_alone_equals_batched(decoder, model, input_ids, attention_mask)


# -- 5. bidirectional attention ----------------------------------------------------------------

def test_position_zero_sees_the_last_position():
    model = tiny_t5(0)
    decoder = make(model, max_new_tokens=12)
    input_ids, attention_mask = random_batch(1, seed=2)
    states = encode(model, input_ids, attention_mask)
    width = 6
    first = torch.tensor([[SPECIAL.mask, 10, 11, 12, 13, 14]])
    second = first.clone()
    second[0, -1] = 40                                            # change only the last input token

    valid = torch.ones(1, width, dtype=torch.bool)
    bidirectional = nar.self_attention_bias(model, valid)
    distance = (torch.arange(width)[:, None] - torch.arange(width)[None, :]).clamp(min=0)[None]
    causal = relative_position_bias(model, distance) + hidden_mask(
        torch.ones(width, width, dtype=torch.bool).tril()[None], states.dtype)

    with torch.no_grad():
        def pos0(tokens, bias):
            return decoder.decoder_hidden(model, tokens, bias, states, attention_mask)[0, 0]
        assert not torch.allclose(pos0(first, bidirectional), pos0(second, bidirectional), atol=1e-4)
        assert torch.equal(pos0(first, causal), pos0(second, causal))   # control


def test_all_mask_first_pass_tells_positions_apart():
    """T5 has no absolute positions: with every input the mask token, its blocks give every position
    the same state whatever the relative bias (all value vectors are equal). The decoder's position
    embedding is what lets one-pass generation produce different tokens at different positions."""
    model = tiny_t5(0)
    decoder = make(model, max_new_tokens=12)
    input_ids, attention_mask = random_batch(1, seed=2)
    states = encode(model, input_ids, attention_mask)
    masks = torch.full((1, 8), SPECIAL.mask)
    bias = nar.self_attention_bias(model, torch.ones(1, 8, dtype=torch.bool))
    with torch.no_grad():
        plain = run_decoder(model, masks, bias, states, attention_mask)[0]           # (8, d_model)
        with_positions = decoder.decoder_hidden(model, masks, bias, states, attention_mask)[0]
    assert torch.allclose(plain, plain[:1].expand_as(plain), atol=1e-4)          # position-blind
    assert (with_positions - with_positions[:1]).abs().amax(1)[1:].min() > 1e-2   # all distinct
    assert len(set(output_logits(model, with_positions).argmax(-1).tolist())) >= 2  # tokens differ


def test_bidirectional_bias_uses_t5_bidirectional_buckets():
    model = tiny_t5(0)
    attention = bias_owner(model.decoder)
    bias = nar.bidirectional_position_bias(model, 5, torch.device("cpu"))   # (1, heads, 5, 5)
    # key 4 of query 1 lies 3 ahead: bidirectional bucket of +3 = 16 (future half) + 3
    assert torch.equal(bias[0, :, 1, 4], attention.relative_attention_bias.weight[16 + 3])
    assert torch.equal(bias[0, :, 4, 1], attention.relative_attention_bias.weight[3])   # 3 behind


# -- 6. training -------------------------------------------------------------------------------

def test_training_reduces_loss_on_a_tiny_batch():
    model = tiny_t5(0).train()
    decoder = make(model, max_new_tokens=12)
    input_ids, attention_mask = random_batch(4, max_len=8, seed=5)
    targets = [[[7, 8], [9, 10]], [[11]], [[12, 13, 14]], [[15], [16], [17]]]
    layout = decoder.layout(targets)

    def fixed_mask_loss():
        torch.manual_seed(99)  # the same masks before and after: compare like with like
        with torch.no_grad():
            return decoder.loss(model, input_ids, attention_mask, layout).item()

    before = fixed_mask_loss()
    optimizer = torch.optim.AdamW(list(model.parameters()) + list(decoder.parameters()), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(40):
        loss = decoder.loss(model, input_ids, attention_mask, layout)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = fixed_mask_loss()
    assert after < 0.5 * before, (before, after)
    assert decoder.length_predictor.weight.grad is not None   # the length predictor is trained too


def test_briefly_trained_decodes_something():
    decoder = make(tiny_t5(0), max_new_tokens=16, iterations=4, length_candidates=2)
    model = briefly_trained(decoder)

    def writes(input_ids, attention_mask):
        """some example decodes a non-empty output"""
        out = decoder.generate(model, input_ids, attention_mask)
        return any(s for subs in out.subsequences for s in subs)
    input_ids, attention_mask = first_batch_where(writes, 6, max_len=9, seed=77)
    out = decoder.generate(model, input_ids, attention_mask)
    assert all(SPECIAL.mask not in s for subs in out.subsequences for s in subs)


# -- layout, options, config -------------------------------------------------------------------

def test_layout_is_the_sequential_flat_target():
    decoder = make(tiny_t5(0))
    layout = decoder.layout([[[7, 8], [9]], [[10]], []])
    assert layout["target"].tolist() == [[7, 8, SPECIAL.sep, 9, SPECIAL.eos],
                                         [10, SPECIAL.eos, 0, 0, 0], [SPECIAL.eos, 0, 0, 0, 0]]
    assert layout["lengths"].tolist() == [5, 2, 1]
    short = make(tiny_t5(0), max_new_tokens=3).layout([[[7, 8], [9]]])   # cut to max_new_tokens
    assert short["target"].tolist() == [[7, 8, SPECIAL.sep]] and short["lengths"].tolist() == [3]


@pytest.mark.parametrize("options,needle", [
    ({"iterations": 0}, "decoder.iterations must be an integer >= 1, got 0"),
    ({"length_candidates": 0},
     "decoder.length_candidates must be an integer >= 1 and <= decoder.max_new_tokens (96), got 0"),
    ({"length_candidates": 5, "max_new_tokens": 4}, "<= decoder.max_new_tokens (4), got 5"),
    ({"length_loss_weight": -1.0}, "decoder.length_loss_weight must be a finite number >= 0, got -1.0"),
    ({"max_new_tokens": 0}, "decoder.max_new_tokens must be an integer >= 1, got 0"),
])
def test_bad_options_fail_clearly(options, needle):
    with pytest.raises(ValueError) as err:
        build_decoder("nar", T5Config(d_model=32), SPECIAL, **options)
    assert needle in str(err.value)


def test_config_options_and_family():
    cfg = compose("keyphrase", "nar", None, ["data.max_target_length=40", "decoder.iterations=2"])
    assert dict(cfg.decoder) == {"name": "nar", "iterations": 2, "length_candidates": 1,
                                 "length_loss_weight": 0.1, "freeze_encoder": False, "max_new_tokens": 40,
                                 "compile": False}
    assert nar.MaskPredictDecoder.layout_family == "nar"


def test_decode_options_change_nothing_trained():
    """iterations and length_candidates are generation-only: a decoder built with other values
    loads the trained decoder's weights (what tasks.compare does when sweeping them)."""
    assert set(nar.MaskPredictDecoder.decode_only_options()) == {"iterations", "length_candidates",
                                                                  "compile"}
    trained = make(tiny_t5(0), max_new_tokens=12)
    other = make(tiny_t5(0), seed=5, max_new_tokens=12, iterations=10, length_candidates=4)
    other.load_state_dict(trained.state_dict())
    assert torch.equal(other.position_embedding.weight, trained.position_embedding.weight)


@pytest.mark.parametrize("freeze_encoder", [True, False])
def test_a_frozen_encoder_keeps_its_weights_while_the_decoder_learns(freeze_encoder):
    """With freeze_encoder, training leaves the encoder and the token embeddings (the decoder's
    input and tied output projection too) as they started, so the model encodes as its starting
    checkpoint does (`same_encoder`); the decoder's blocks and the length predictor learn. Without
    it, the encoder learns too."""
    start = tiny_t5(0)
    model = tiny_t5(0)
    decoder = make(model, max_new_tokens=12, freeze_encoder=freeze_encoder)
    length_weight = decoder.length_predictor.weight.detach().clone()
    briefly_trained(decoder, steps=3, model=model)
    assert same_encoder(model, start) == freeze_encoder
    assert torch.equal(model.shared.weight, start.shared.weight) == freeze_encoder
    trained_block = model.decoder.block[0].layer[0].SelfAttention.q.weight
    assert not torch.equal(trained_block, start.decoder.block[0].layer[0].SelfAttention.q.weight)
    assert not torch.equal(decoder.length_predictor.weight, length_weight)
