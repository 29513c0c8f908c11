"""Host-device synchronisation points (`tasks.bench.sync_points`): at most one per decoder call for every
registered decoder, plus two per decode (transformers' encoder reads its mask back once; the results
are read back once at the end). On a GPU each is a stall of the whole queue."""
import json

import pytest
import torch

from decoders import available, build_decoder
from tasks.bench import GENERATE, SPECIAL, bounded, random_inputs, sync_points, tiny_random_t5
from tests.conftest import first_batch_where

pytestmark = pytest.mark.numerics  # decodes random models: see docs/testing.md


@pytest.fixture(scope="module")
def counted():
    model = tiny_random_t5()
    input_ids, attention_mask = random_inputs(8, model.config.vocab_size)
    return sync_points.sync_points_per_call(model, input_ids, attention_mask, steps=16)


@pytest.mark.parametrize("name", available())
def test_at_most_one_sync_point_per_decoder_call(name, counted):
    row = counted[name]
    assert row["decoder_calls"] >= 1
    # beside the encoder and the final read-back, aggressive's drafter reads back twice per decode
    # (its own encoder, and its predicted lengths: its first pass's shapes and the first call's
    # offers), lookup once (the sources it drafts from)
    per_decode = 2 + {"aggressive": 2, "lookup": 1}.get(name, 0)
    assert row["sync_points"] <= row["decoder_calls"] + per_decode, row


def test_pipelined_under_the_paper_stop_rule_too():
    """`counted` decodes with every decoder's defaults; the pipelined `stop_rule=all_end` ends
    examples differently and must keep to the same bound."""
    model = tiny_random_t5()
    decoder = build_decoder("pipelined", model.config, SPECIAL, stop_rule="all_end",
                            **bounded("pipelined", 16))
    with torch.no_grad():
        def several_calls(input_ids, attention_mask):
            """a batch that takes 2 or more decoder calls, so the loop runs (this decode is also
            the warm-up, as in `counted`)"""
            return decoder.generate(model, input_ids, attention_mask).batch_decoder_calls >= 2
        input_ids, attention_mask = first_batch_where(several_calls, 8, seed=1)
        with sync_points.counting_sync_points() as counter:
            out = decoder.generate(model, input_ids, attention_mask)
    assert counter.count <= out.batch_decoder_calls + 2


def test_the_counter_sees_every_kind_of_sync_point():
    """Not vacuous: each way of waiting for the device is counted once."""
    x = torch.arange(6.0)
    mask = x > 2
    with sync_points.counting_sync_points() as counter:
        x.sum().item()
        x.tolist()
        bool(x.any())
        x.nonzero()
        x[mask]
        x.masked_select(mask)
        int(x[0])
    assert counter.count == 7
    with sync_points.counting_sync_points() as counter:
        torch.where(mask, x, 0.0).gather(0, torch.tensor([1, 2])).argmax()
    assert counter.count == 0  # tensor ops alone never wait


def test_command_writes_the_table(tmp_path, capsys):
    out = tmp_path / "sync.json"
    result = sync_points.main(["--batch-size", "4", "--steps", "8", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert set(result) == {GENERATE, *available()}
    assert "sync points per decoder call" in capsys.readouterr().out
