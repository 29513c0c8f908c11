"""`decoders.loop`: host values reach the batch's device in one copy (`send`), which on a GPU must
not wait for the work already queued there (tests/test_cuda.py); `LiveRows` drops finished rows,
or shrinks a fixed-shape batch."""
import time

import pytest
import torch

from decoders.cache import DecoderCache
from decoders.loop import NOT_PRODUCED, CallTokens, LiveRows, ShrunkRows, Stopwatch, send


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


def test_a_shrinking_fixed_shape_batch_moves_its_rows_past_the_kept_ones_into_finished_places():
    """`LiveRows.shrink`: a batch of 6 shrunk to 4, its rows 5 and 4 (unfinished, past the first
    4) written over its finished rows 0 and 2, in the cache in place (the self-attention slots
    before `written` only: the later ones are zeros in every row) and in the row tensors, which
    the loop owns; the index of the earlier calls' tokens left as it was."""
    rows, heads, slots, dims, written = 6, 2, 5, 3, 2
    cache = DecoderCache(1, slots)
    keys = torch.zeros(rows, heads, slots, dims)
    keys[:, :, :written] = torch.arange(rows, dtype=torch.float)[:, None, None, None] + 1
    values = keys.clone()
    cache.keys, cache.values = [keys], [values]
    cross = torch.arange(rows, dtype=torch.float)[:, None, None, None].expand(rows, heads, 4, dims)
    cache.encoder_keys_values = [(cross.clone(), cross.clone())]
    live = LiveRows(rows, torch.device("cpu"))
    index_before = live.index
    tokens = torch.tensor([10, 11, 12, 13, 14, 15])
    shrunk = ShrunkRows(4, moved=[5, 4], places=[0, 2])
    kept, = live.shrink(shrunk, cache, written, tokens)
    order = [5, 1, 4, 3]                  # each kept row's row before
    assert live.kept == order and live.index.tolist() == order
    assert kept.tolist() == [15, 11, 14, 13] and kept.data_ptr() == tokens.data_ptr()
    assert index_before.tolist() == list(range(6))
    for part, before in ((cache.keys[0], keys), (cache.values[0], values)):
        assert part.shape == (4, heads, slots, dims) and part.data_ptr() == before.data_ptr()
        assert part[:, 0, :written, 0].tolist() == [[row + 1] * written for row in order]
        assert not part[:, :, written:].any()
    for part in cache.encoder_keys_values[0]:
        assert part[:, 0, 0, 0].tolist() == order
    assert live.shrink(ShrunkRows(2, [], []), cache, written, kept)[0].tolist() == [15, 11]
    assert cache.keys[0].shape[0] == 2 and live.index.tolist() == [5, 1]


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
