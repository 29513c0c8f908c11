"""What every decoding loop shares: the live rows of a batch with one host synchronisation per
decoder call, reading results back once at the end, and splitting flat-layout outputs into a
`DecodeOutput`."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import NamedTuple

import torch

from datamodules.vocabulary import SpecialTokens
from decoders.base import DecodeOutput
from decoders.cache import DecoderCache, power_of_two_holding


# Fill value of per-position output buffers where no token was produced (every token id is >= 0).
NOT_PRODUCED = -1


def through_end(tokens: list[int], eos: int) -> list[int]:
    """A row's tokens up to its first end token, included (all of them where it has none): what
    a decoding that computes past a row's end produced for it."""
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def split_flat_output(tokens: list[int], special: SpecialTokens) -> tuple[list[list[int]], bool]:
    """A flat-layout output (s_1 <sep> s_2 ... </s>) -> (its subsequences up to the first end token,
    whether it had one). Without an end token the output was cut by a bound."""
    if special.eos in tokens:
        return split_on(tokens[: tokens.index(special.eos)], special.sep), True
    return split_on(tokens, special.sep), False


def split_on(tokens: list[int], sep: int) -> list[list[int]]:
    """Split a flat token list at `sep` into non-empty subsequences."""
    parts, current = [], []
    for tok in tokens:
        if tok == sep:
            if current:
                parts.append(current)
            current = []
        else:
            current.append(tok)
    if current:
        parts.append(current)
    return parts


def flat_decode_output(outputs: list[list[int]], special: SpecialTokens, decoder_calls: list[int],
                       batch_decoder_calls: int, stats: dict | None = None,
                       bound_hit: list[bool] | None = None) -> DecodeOutput:
    """The `DecodeOutput` of flat-layout outputs (each row's produced tokens, its end token included
    where it has one): subsequences split at separators up to the end token, the tokens produced
    counted, and an output without an end token marked as cut by a bound, unless `bound_hit`
    says otherwise."""
    split = [split_flat_output(tokens, special) for tokens in outputs]
    return DecodeOutput(subsequences=[subsequences for subsequences, _ in split],
                        decoder_calls=decoder_calls, tokens=[len(tokens) for tokens in outputs],
                        bound_hit=(bound_hit if bound_hit is not None
                                       else [not ended for _, ended in split]),
                        batch_decoder_calls=batch_decoder_calls, stats=stats or {})


def read_back(*tensors: torch.Tensor) -> list[list]:
    """Every tensor's values as (nested) lists, in ONE device -> host transfer (one sync point):
    a decode's results are read back once, at the end."""
    flat = torch.cat([t.reshape(-1).long() for t in tensors]).tolist()
    out, start = [], 0
    for t in tensors:
        out.append(_nested(flat[start:start + t.numel()], list(t.shape)))
        start += t.numel()
    return out


def _nested(flat: list, shape: list[int]) -> list:
    """A flat list in row-major order as nested lists of `shape` (on the host, no tensor)."""
    if len(shape) <= 1:
        return flat
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nested(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


def send(values: list, device: torch.device) -> torch.Tensor:
    """Host values (nested lists of ints) as a tensor on `device`, in one copy that waits for
    nothing: on a GPU it goes from pinned memory, asynchronously, behind the work already queued
    (a plain copy from the host would wait for that work to finish)."""
    if device.type != "cuda":
        return torch.tensor(values, device=device)
    return torch.tensor(values).pin_memory().to(device, non_blocking=True)


class CallTokens:
    """The token each call gave each of its rows, kept as the calls gave them and read back once,
    when the decode ends (`rows`): on a CPU, writing each call's tokens into a (B, bound) tensor
    by the rows' examples (an indexed write) costs a small model's call more than the call's own
    bookkeeping does."""

    def __init__(self):
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []   # (examples, tokens), (rows,)

    def add(self, examples: torch.Tensor, tokens: torch.Tensor) -> None:
        """A call's `tokens` (rows,), NOT_PRODUCED where a row keeps none, of `examples` (rows,)."""
        self.calls.append((examples, tokens))

    def rows(self, batch_size: int) -> list[list[int]]:
        """Each example's tokens in call order, NOT_PRODUCED left out: one read (`read_back`)."""
        examples, tokens = read_back(torch.cat([examples for examples, _ in self.calls]),
                                     torch.cat([tokens for _, tokens in self.calls]))
        out: list[list[int]] = [[] for _ in range(batch_size)]
        for example, token in zip(examples, tokens):
            if token != NOT_PRODUCED:
                out[example].append(token)
        return out


class ShrunkRows(NamedTuple):
    """How a batch of fixed-shape calls shrinks in place: it keeps its first `rows` rows, after
    its rows `moved` were written over its rows `places` (finished ones among those first)."""

    rows: int
    moved: list[int]
    places: list[int]


class LiveRows:
    """The rows of a batch still being decoded, and the one host synchronisation per decoder call.

    On a GPU every read of a device value (`.item()`, `.tolist()`, `bool(t)`, `nonzero`, boolean
    masks) stalls the queue, so a decoding loop keeps its bookkeeping in tensors, written through
    `index` (each live row's original position: tensor indexing, no sync), and reads back once per
    call, here (`read`): which rows finished, or what the loop decides that from on the host, with
    what it needs there for the next call's shapes. Finished rows leave the batch and the cache
    (`drop`), so they cost nothing in later calls. Results are read back once, at the end.
    """

    def __init__(self, batch_size: int, device: torch.device):
        self.index = torch.arange(batch_size, device=device)   # (live,) original row of each live row
        self.kept: list[int] = list(range(batch_size))         # kept rows' positions in the last call

    def read(self, values: torch.Tensor) -> list:
        """`values` as (nested) lists: the one device -> host transfer (sync point) of a call."""
        return values.tolist()

    def read_each(self, values: list[torch.Tensor]) -> list[list]:
        """Each of `values` (every one (live,)) as a list, in one transfer (`read`): stacked where
        there are several."""
        return self.read(torch.stack(values)) if len(values) > 1 else [self.read(values[0])]

    def drop(self, done: list, cache: DecoderCache | None, *row_tensors: torch.Tensor):
        """Drop the rows whose `done` entry (host values, one per live row) is true from `index`,
        the cache and every tensor of `row_tensors` (each (live, ...)); `kept` lists the kept
        rows' positions. Returns the kept tensors, or None when no row is left."""
        if all(done):
            return None
        kept = [row for row, d in enumerate(done) if not d]
        self.kept = kept
        if len(kept) < len(done):
            keep = send(kept, self.index.device)
            self.index = self.index[keep]
            if cache is not None:
                cache.select_rows(keep)
            row_tensors = tuple(t[keep] for t in row_tensors)
        return row_tensors

    def shrink(self, shrunk: ShrunkRows, cache: DecoderCache, written: int,
               *row_tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Shrink a fixed-shape batch (`ShrunkRows`) in place: the cache (its self-attention
        slots before `written`, `DecoderCache.shrink_rows`) and every tensor of `row_tensors`
        (each (live, ...), the loop's own); `index` as a new tensor, since earlier calls' tokens
        hold it. Returns the kept rows of each row tensor, views of the same memory. `kept` lists
        the kept rows' positions in the last call."""
        came_from = dict(zip(shrunk.places, shrunk.moved))
        self.kept = [came_from.get(row, row) for row in range(shrunk.rows)]
        moved = places = None
        if shrunk.moved:
            moved, places = (send(rows, self.index.device) for rows in (shrunk.moved, shrunk.places))
            self.index = self.index.index_copy(0, places, self.index.index_select(0, moved))
            for tensor in row_tensors:
                tensor.index_copy_(0, places, tensor.index_select(0, moved))
        cache.shrink_rows(shrunk.rows, moved, places, written)
        self.index = self.index[:shrunk.rows]
        return tuple(tensor[:shrunk.rows] for tensor in row_tensors)

    def drop_finished(self, finished: torch.Tensor, cache: DecoderCache | None,
                      *row_tensors: torch.Tensor):
        """Read back `finished` (live,) bool (`read`) and drop the finished rows (`drop`). Returns
        the kept tensors, or None when no row is left."""
        return self.drop(self.read(finished), cache, *row_tensors)


def fixed_shape_rows(kept: list[int], cache: DecoderCache,
                     *row_tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The rows of a loop's fixed-shape calls once rows have ended: the `kept` ones (their places
    in the last call) first, then copies of the first, up to the power of two that holds them, or
    the rows the call had where that is fewer; in `cache` and each of `row_tensors`. A copy's
    tokens are its own row's, which the loop discards."""
    rows = min(row_tensors[0].size(0), power_of_two_holding(len(kept)))
    keep = send(kept + kept[:1] * (rows - len(kept)), row_tensors[0].device)
    cache.select_rows(keep)
    return tuple(t[keep] for t in row_tensors)


def topped_up(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor` (live, ...) with copies of its first row after it, up to `rows` rows: a
    fixed-shape call's rows (`fixed_shape_rows`)."""
    live = tensor.size(0)
    return tensor if live == rows else torch.cat([tensor, tensor[:1].expand(rows - live, *tensor.shape[1:])])


class Stopwatch:
    """Time spent in some blocks of a decode, measured without a host sync: on a GPU each block is
    timed by a pair of CUDA events on the current stream, read only after the decode's final
    read-back has waited for them (`total`); elsewhere by the host clock, the work being done when
    the block ends."""

    def __init__(self, device: torch.device):
        self.events = device.type == "cuda"
        self.spans: list[tuple] = []      # (start, end) CUDA events
        self.seconds = 0.0                # host-clock time

    @contextmanager
    def timing(self):
        if self.events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.spans.append((start, end))
        else:
            began = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - began

    def total(self) -> float:
        """Seconds in the timed blocks; on a GPU, only after the decode's work was waited for."""
        return self.seconds + sum(start.elapsed_time(end) for start, end in self.spans) / 1000
