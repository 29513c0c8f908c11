"""`decoders.loop`: host values reach the batch's device in one copy (`send`), which on a GPU must
not wait for the work already queued there (tests/test_cuda.py); `LiveRows` drops finished rows."""
import time

import pytest
import torch

from decoders.loop import NOT_PRODUCED, CallTokens, LiveRows, Stopwatch, send


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_send_puts_host_values_on_the_device(device):
    sent = send([[3, 1, 4], [1, 5, 9]], torch.device(device))
    assert sent.device.type == device
    assert (sent.shape, sent.dtype) == (torch.Size([2, 3]), torch.long)
    if device == "cpu":
        assert sent.tolist() == [[3, 1, 4], [1, 5, 9]]


def test_dropped_rows_leave_every_row_tensor_and_the_index():
    rows = LiveRows(4, torch.device("cpu"))
    values = torch.tensor([10, 11, 12, 13])
    kept, = rows.drop([False, True, False, True], None, values)
    assert kept.tolist() == [10, 12]
    assert rows.index.tolist() == [0, 2] and rows.kept == [0, 2]
    assert rows.drop([True, True], None, kept) is None


def test_call_tokens_give_each_example_its_tokens_in_call_order():
    """`CallTokens`: each call's tokens by its rows' examples, the rows shrinking as they end and
    kept rows giving NOT_PRODUCED; read back as each example's tokens, in call order."""
    tokens = CallTokens()
    tokens.add(torch.tensor([0, 1, 2]), torch.tensor([5, 6, 7]))
    tokens.add(torch.tensor([0, 1, 2]), torch.tensor([8, NOT_PRODUCED, 9]))   # example 1 ended
    tokens.add(torch.tensor([2, 0]), torch.tensor([3, 4]))                     # rows reordered
    assert tokens.rows(4) == [[5, 8, 4], [6], [7, 9, 3], []]


def test_a_stopwatch_adds_up_the_time_of_its_blocks_only():
    clock = Stopwatch(torch.device("cpu"))
    for _ in range(2):
        with clock.timing():
            time.sleep(0.02)
        time.sleep(0.05)      # outside a block: not counted
    assert 0.04 <= clock.total() < 0.09
