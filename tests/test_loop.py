"""`decoders.loop`: host values reach the batch's device in one copy (`send`), which on a GPU must
not wait for the work already queued there (tests/test_cuda.py); `LiveRows` drops finished rows."""
import pytest
import torch

from decoders.loop import LiveRows, send


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
