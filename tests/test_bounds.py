"""Every decoder bounds an example's output by the same quantity, taken from the data limits: at
most data.max_target_length tokens, counted as the flat layout counts them (subsequences, their
separators and the end token). An output cut there is a bound hit for every decoder alike."""
import pytest
import torch

from decoders import available, build_decoder
from decoders.sequential import join_subsequences
from tasks.bench import with_drafter
from tasks.config import compose
from tasks.runs.trainer import decoder_options
from tests.conftest import SPECIAL, first_batch_where, random_batch, tiny_t5

pytestmark = [pytest.mark.float64, pytest.mark.numerics]  # see tests/conftest.py


def decoder_at(name: str, model, bound: int, like=None):
    """Decoder `name` as the configuration builds it for data.max_target_length = `bound`, with
    pipelined's slot limits wide enough not to bind first; `like`'s weights, if given."""
    cfg = compose("keyphrase", name, None, [f"data.max_target_length={bound}",
                                            "data.max_subsequences=16", "data.max_subsequence_length=64"])
    decoder = with_drafter(build_decoder(name, model.config, SPECIAL, **decoder_options(cfg)), model)
    if like is not None:
        decoder.load_state_dict(like.state_dict())
    return decoder


@pytest.mark.parametrize("name", available())
def test_a_model_that_never_ends_is_cut_at_the_common_bound(name):
    model = tiny_t5(0)
    with torch.no_grad():
        model.lm_head.weight[SPECIAL.eos] = 0.0  # logit 0: below the best of the other, random logits
    decoder = decoder_at(name, model, 12)
    if name == "nar":  # its length comes from the length predictor: have it predict the longest
        with torch.no_grad():
            decoder.length_predictor.weight.zero_()
            decoder.length_predictor.bias.copy_(torch.eye(12)[-1] * 10)
    input_ids, attention_mask = random_batch(4, seed=5)
    out = decoder.generate(model, input_ids, attention_mask)
    assert out.tokens == [12] * 4 and out.bound_hit == [True] * 4


@pytest.mark.parametrize("name", ["sequential", "pipelined", "blockwise", "onestep"])
def test_an_output_that_fills_the_bound_exactly_is_not_cut(name):
    """An output of F flat tokens that ended by itself is decoded unchanged, and not counted as a
    bound hit, under the bound F; under F - 1 it is a bound hit. (NAR is left out: its bound is also
    the size of its length predictor, so another bound is another model.)"""
    model = tiny_t5(0)
    free = decoder_at(name, model, 40)

    def some_end_with_output(input_ids, attention_mask):
        """some examples end by themselves with a non-empty output"""
        out = free.generate(model, input_ids, attention_mask)
        return any(subs and not hit for subs, hit in zip(out.subsequences, out.bound_hit))
    input_ids, attention_mask = first_batch_where(some_end_with_output, 6)
    out = free.generate(model, input_ids, attention_mask)
    for i, (subsequences, hit) in enumerate(zip(out.subsequences, out.bound_hit)):
        if hit or not subsequences:
            continue
        n = int(attention_mask[i].sum())
        alone = input_ids[i:i + 1, :n], attention_mask[i:i + 1, :n]
        length = len(join_subsequences(subsequences, SPECIAL.sep, SPECIAL.eos))
        exact = decoder_at(name, model, length, like=free).generate(model, *alone)
        assert exact.subsequences == [subsequences] and exact.bound_hit == [False]
        if length > 2:  # data.max_target_length leaves room for a token and the end token
            assert decoder_at(name, model, length - 1, like=free).generate(model, *alone).bound_hit == [True]
