"""Custom decoder attention structures hold under every attention implementation the backbone may
be loaded with: eager, and sdpa (transformers' default, which marks T5's decoder self-attention
causal and would silently override a structure it is not given as a mask)."""
import copy

import pytest
import torch

from decoders import available, build_decoder
from decoders.backbone import (MOST_TABLES, WEIGHT_TABLES, encode, hidden_mask,
                               past_distance_bias_table, relative_position_bias, run_decoder,
                               sdpa_aligned)
from decoders.cache import DecoderCache, Slots
from decoders.verify_tables import bias_tables
from decoders.transformers_internals import bias_owner, set_attention_implementation
from tasks.bench import bounded, with_drafter
from tests.conftest import SPECIAL, always_feeding, random_batch, tiny_t5

pytestmark = [pytest.mark.float64, pytest.mark.numerics]  # see tests/conftest.py


def under(model, implementation: str):
    other = copy.deepcopy(model)
    other.set_attn_implementation(implementation)
    return other


def test_run_decoder_follows_the_given_structure_under_sdpa():
    """A cached call with several queries and a structure that is not causal (each query sees every
    other key): sdpa must give eager's hidden states. By construction this structure differs from
    the causal one sdpa falls back to, and the cache holds more keys than there are queries."""
    eager = tiny_t5(0)
    sdpa = under(eager, "sdpa")
    input_ids, attention_mask = random_batch(2, seed=3)
    g = torch.Generator().manual_seed(0)
    past, new = torch.randint(5, 60, (2, 3), generator=g), torch.randint(5, 60, (2, 4), generator=g)
    visible = torch.ones(2, 4, 7, dtype=torch.bool)
    visible[:, :, 1::2] = False                                     # every other key hidden
    visible[:, :, 0] = True
    relative = torch.randn(2, 4, 4, 7, generator=g)                 # (B, heads, Q, K)
    outputs = []
    # each model under its own implementation, then under the other one given as `attention`, and
    # eager's arithmetic as loops (what a step compiled on a CPU runs)
    for model, attention in ((eager, None), (sdpa, None), (sdpa, "eager"), (eager, "sdpa"),
                             (sdpa, "looped")):
        states = encode(model, input_ids, attention_mask)
        cache = DecoderCache(len(model.decoder.block))
        run_decoder(model, past, torch.zeros(2, 4, 3, 3), states, attention_mask, cache, Slots(start=0),
                    attention=attention)
        bias = relative + hidden_mask(visible, relative.dtype)
        outputs.append(run_decoder(model, new, bias, states, attention_mask, cache, Slots(start=3),
                                   attention=attention))
    for other in outputs[1:]:
        torch.testing.assert_close(other, outputs[0], rtol=0, atol=1e-10)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("training", [False, True])
def test_run_decoder_is_t5s_decoder_stack(implementation, training):
    """With T5's own causal structure, `run_decoder` gives the hidden states of transformers'
    decoder stack, and the same gradients, in training (dropout 0, so both are deterministic) and in
    evaluation; fed in two cached calls, the same states again."""
    model = under(tiny_t5(2), implementation).train(training)   # dropout_rate 0
    input_ids, attention_mask = random_batch(2, seed=4)
    tokens = torch.randint(5, 60, (2, 6), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(6)
    distance = positions[:, None] - positions[None, :]                          # (Q, K): q - k
    causal = (relative_position_bias(model, distance[None])
              + hidden_mask((distance >= 0)[None], torch.get_default_dtype()))  # (1, heads, Q, K)
    results = []
    for run in ("transformers", "run_decoder"):
        model.zero_grad()
        states = encode(model, input_ids, attention_mask)
        if run == "transformers":
            hidden = model.decoder(input_ids=tokens, encoder_hidden_states=states,
                                   encoder_attention_mask=attention_mask).last_hidden_state
        else:
            hidden = run_decoder(model, tokens, causal, states, attention_mask)
        hidden.square().sum().backward()
        results.append((hidden.detach(), [p.grad.clone() for p in model.parameters()]))
    (expected, expected_grads), (hidden, grads) = results
    torch.testing.assert_close(hidden, expected, rtol=0, atol=1e-10)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-10)
    with torch.no_grad():
        cache = DecoderCache(len(model.decoder.block))
        states = encode(model, input_ids, attention_mask)
        first = run_decoder(model, tokens[:, :4], causal[:, :, :4, :4], states, attention_mask, cache,
                            Slots(start=0))
        rest = run_decoder(model, tokens[:, 4:], causal[:, :, 4:], states, attention_mask, cache,
                           Slots(start=4))
    torch.testing.assert_close(torch.cat([first, rest], dim=1), expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", available())
def test_every_decoder_decodes_the_same_under_eager_and_sdpa(name):
    eager = tiny_t5(1)
    # every length/step bound at 10: enough for several subsequences, quick on a random model
    bounds = bounded(name, 10)
    decoder = with_drafter(build_decoder(name, eager.config, SPECIAL, **bounds, **always_feeding(name)),
                           eager)
    input_ids, attention_mask = random_batch(6, seed=8)
    reference = decoder.generate(eager, input_ids, attention_mask)
    out = decoder.generate(under(eager, "sdpa"), input_ids, attention_mask)
    assert out.subsequences == reference.subsequences
    assert out.decoder_calls == reference.decoder_calls
    assert out.tokens == reference.tokens


def test_other_implementations_fail_clearly():
    model = tiny_t5(0)
    set_attention_implementation(model.config, "flash_attention_2")
    input_ids, attention_mask = random_batch(1, seed=3)
    with pytest.raises(ValueError, match="attn_implementation in \\('eager', 'sdpa'\\).*'flash_attention_2'"):
        run_decoder(model, input_ids, torch.zeros(1, 4, 1, 1), torch.zeros(1, 3, 32), attention_mask[:, :3])
    with pytest.raises(ValueError, match="attention='flash'; allowed: \\('eager', 'sdpa', 'looped'\\)"):
        run_decoder(model, input_ids, torch.zeros(1, 4, 1, 1), torch.zeros(1, 3, 32), attention_mask[:, :3],
                    attention="flash")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_bias_sliced_at_any_column_is_handed_to_sdpa_aligned(dtype):
    """A drafting loop slices its one-count bias out of a wider table at a column that moves with
    the count; SDPA's memory-efficient CUDA kernel needs the slice's data 16-byte aligned and its
    rows a whole number of 16-byte vectors apart. Whatever the column, what the kernel gets is
    aligned and holds the slice's values; an aligned bias is passed on without a copy."""
    table = torch.randn(1, 4, 3, 23).to(dtype)                    # (1, heads, Q, columns)
    for start in range(12):
        piece = table[..., start: start + 9]
        aligned = sdpa_aligned(piece)
        assert aligned.data_ptr() % 16 == 0 and torch.equal(aligned, piece)
        assert aligned is piece or aligned.is_contiguous()
    fresh = torch.randn(1, 4, 3, 16).to(dtype)
    assert sdpa_aligned(fresh) is fresh
    one_query = torch.randn(1, 4, 1, 40).to(dtype)[..., 8:]        # 8 columns in: 16 or 32 bytes
    assert sdpa_aligned(one_query) is one_query


def test_the_past_distance_table_is_made_once_per_weights_and_follows_their_changes():
    """While decoding, the table of past distances is made once per weights and then read (the same
    tensor); it equals a fresh computation, follows an optimizer step and a reload of the weights,
    and under recorded gradients is made anew each time, with the graph to the bias weight."""
    model = tiny_t5(0)
    distance = torch.arange(12)[None, :, None]

    def fresh() -> torch.Tensor:
        return relative_position_bias(model, distance)[0, :, :, 0].T

    with torch.no_grad():
        table = past_distance_bias_table(model, 11)
        assert past_distance_bias_table(model, 11) is table
        torch.testing.assert_close(table, fresh(), rtol=0, atol=0)
    weight = bias_owner(model.decoder).relative_attention_bias.weight
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    past_distance_bias_table(model, 11).sum().backward()   # recorded: a graph to the weight
    assert weight.grad is not None and weight.grad.abs().sum() > 0
    optimizer.step()
    with torch.no_grad():
        stepped = past_distance_bias_table(model, 11)
        assert not torch.equal(stepped, table)
        torch.testing.assert_close(stepped, fresh(), rtol=0, atol=0)
        model.load_state_dict({name: value * 2 for name, value in model.state_dict().items()})
        torch.testing.assert_close(past_distance_bias_table(model, 11), fresh(), rtol=0, atol=0)
        assert not torch.equal(past_distance_bias_table(model, 11), stepped)


def test_a_bias_weight_replaced_by_another_gets_tables_of_its_own():
    """A bias weight whose tensor is replaced (`.to()`, or assigned while loading) by another whose
    count of in-place writes is the same gets its tables made anew, not the old weight's."""
    model = tiny_t5(0)
    bias = bias_owner(model.decoder).relative_attention_bias
    with torch.no_grad():
        first = bias.weight = torch.nn.Parameter(bias.weight.detach().clone())
        table = past_distance_bias_table(model, 11)
        bias.weight = torch.nn.Parameter(first.detach() * 3)
        assert bias.weight._version == 0 == first._version   # neither written in place
        renewed = past_distance_bias_table(model, 11)
        torch.testing.assert_close(renewed, table * 3, rtol=0, atol=0)


def test_the_tables_kept_per_weight_are_bounded_and_a_nested_one_is_kept_beside_its_maker():
    """At most MOST_TABLES tables are kept per bias weight; a table whose making reads another
    (the verify loop's reads the past-distance one) is kept even where that read fills the bound."""
    model = tiny_t5(0)
    bias = bias_owner(model.decoder).relative_attention_bias
    with torch.no_grad():
        for longest in range(MOST_TABLES - 1):
            past_distance_bias_table(model, longest)
        made = bias_tables(model, 8, 2, torch.device("cpu"))   # its past table fills the bound
        assert len(WEIGHT_TABLES[bias].tables) <= MOST_TABLES
        assert bias_tables(model, 8, 2, torch.device("cpu")) is made
        fresh = relative_position_bias(model, torch.arange(6)[None, :, None])[0, :, :, 0].T
        torch.testing.assert_close(past_distance_bias_table(model, 5), fresh, rtol=0, atol=0)
