"""What a comparison measures of its rows besides their test scores: speed (interleaved, warmed-up
timing of `generate` on the configured device, denormals flushed on a CPU), peak memory, the
decoder calls the references need, and the weights each fit trains."""
from __future__ import annotations

import ctypes
import random
import statistics
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
from lightning.pytorch.utilities import move_data_to_device
from tqdm.auto import tqdm

from decoders.compiled_step import COMPILED_STEPS
from tasks.comparison.plan import Row
from tasks.module import GenerationTask, subsequence_texts, task_scores, timed_generate
from tasks.runs.trainer import DecodeTarget


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]


def _heap_in_use() -> int | None:
    """Bytes of C heap in use (glibc mallinfo2: small blocks + mmapped blocks), None off glibc.

    Torch's CPU tensors live on this heap, and unlike the resident set it falls when they are
    freed, so its peak during a decode is the decode's own working memory."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


class PeakMemory:
    """Peak memory of a block over its level before: CUDA max allocated, or on CPU the C heap in
    use (sampled every millisecond in a thread)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_mb = 0.0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._base = _heap_in_use() or 0
            self._peak = self._base
            self._running = True
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while self._running:
            self._peak = max(self._peak, _heap_in_use() or 0)
            time.sleep(0.001)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._running = False
            self._thread.join()
            peak = self._peak
        self.peak_mb = (peak - self._base) / 2 ** 20


def flushing_denormals() -> bool:
    """Whether this thread flushes denormal floats to zero (torch sets the mode but cannot report
    it): a denormal float32 times one stays denormal unless flushed."""
    return float(torch.tensor([1e-39]) * 1.0) == 0.0


@contextmanager
def flushed_denormals(device: torch.device):
    """On a CPU, denormal floats flushed to zero for the block, then the previous mode restored;
    yields whether they are flushed. A random model with a large init scale spends most of a CPU
    decode in denormal arithmetic, which GPUs do at full speed: unflushed, CPU timings would
    measure how many denormals a decoder meets rather than its work. (torch sets the mode of the
    calling thread only: work it splits over its other intra-op threads is not flushed.)"""
    if device.type != "cpu":
        yield False
        return
    before = flushing_denormals()
    flushed = torch.set_flush_denormal(True)  # False where the CPU cannot
    try:
        yield flushed
    finally:
        torch.set_flush_denormal(before)


def device_batches(datamodule, examples: list, batch_size: int, device) -> list[dict]:
    """`examples` collated in batches of `batch_size`, moved to `device` beforehand (so that the
    copies are not timed)."""
    return [move_data_to_device(datamodule.collate(examples[i:i + batch_size]), device)
            for i in range(0, len(examples), batch_size)]


# The most warm-up passes over the batches of a decoder that compiles its calls (`compiled_warm_up`).
WARM_UP_PASSES = 3


def compiled_warm_up(decode: Callable[[dict], object], batches: list[dict]) -> float:
    """Seconds of warming up a decoder that compiles its calls (`decoder.compile`) on the `batches`
    it will be timed on: passes of `decode` over every batch until one compiles no new fixed-shape
    step (`decoders.compiled_step.COMPILED_STEPS`), at most `WARM_UP_PASSES`. Each new shape
    compiles once, and a decoder whose default chooses its loop from the call costs it measured
    (blockwise, lookup) may take another loop, of other shapes, after its first decodes: one pass
    would leave those to compile inside the timed passes."""
    seconds = 0.0
    for _ in range(WARM_UP_PASSES):
        compiled, started = len(COMPILED_STEPS), time.perf_counter()
        for batch in batches:
            decode(batch)
        seconds += time.perf_counter() - started
        if len(COMPILED_STEPS) == compiled:
            break
    return seconds


def interleaved_passes(timers: dict, batches: list[dict], repeats: int,
                       on_pass: Callable[[], None] = lambda: None) -> dict[object, list[list]]:
    """`repeats` passes over `batches`, each batch decoded by every timer (key -> a function of a
    batch, returning what it measured) in turn before the next batch, in an order shuffled from
    batch to batch (seeded: the same every run). Returns, per key, each pass's results, batch by
    batch.

    Why batch by batch: a shared CPU's speed drifts and jumps over seconds, as long as a whole pass
    of one decoder takes, so rows timed one whole pass after another see different machines (on a
    2-core machine the ratios of one pass spread 0.6x to 1.6x); rows taking turns on each batch see
    the same one, and their ratios agree within a few percent. Why shuffled: a row that decodes
    right after another on the same weights may find them in the CPU's caches, so no row may keep
    a place, nor the row before it (an order rotated from batch to batch keeps every row's
    predecessor)."""
    keys = list(timers)
    order = random.Random(0)
    results: dict[object, list[list]] = {key: [] for key in keys}
    for _ in range(repeats):
        current: dict[object, list] = {key: [] for key in keys}
        for batch in batches:
            for key in order.sample(keys, len(keys)):
                current[key].append(timers[key](batch))
        for key in keys:
            results[key].append(current[key])
        on_pass()
    return results


def time_row(row: Row, batch: dict) -> float:
    module = row.module
    return timed_generate(module.decoder, module.backbone, batch["input_ids"], batch["attention_mask"])[1]


@dataclass(frozen=True)
class Speed:
    """One row's timing: the seconds of each timing pass over the timed examples at batch size 1
    and at the eval batch size (pass r of every row ran in the same stretch of time, so ratios of
    pass r to pass r are speedups measured side by side), each timed example's seconds at batch
    size 1 (the median over the passes), and the peak memory of one more pass at the eval batch
    size."""
    pass_seconds_bs1: list[float]
    pass_seconds_batch: list[float]
    example_seconds_bs1: list[float]
    peak_memory_mb: float

    def examples_per_second(self, key: str) -> float:
        """Timed examples per second of the median pass, `key` "bs1" or "batch"."""
        return len(self.example_seconds_bs1) / statistics.median(getattr(self, f"pass_seconds_{key}"))


@dataclass(frozen=True)
class Measurement:
    """What `measure_speed` measured: each row's `Speed` (in the rows' order), the device the
    modules' parameters were on while timed, and whether denormals were flushed."""
    speeds: list[Speed]
    device: str
    flush_denormal: bool


def measure_speed(rows: list[Row], target: DecodeTarget, batch_size: int, repeats: int,
                  limit: int | None) -> Measurement:
    """Interleaved, warmed-up timing of every row on the `target` device and in its precision, on
    the same prepared batches of the first `limit` test examples (all without it)."""
    device = target.device
    datamodule = rows[0].datamodule
    examples = datamodule.dataset("test").examples[:limit]
    singles = device_batches(datamodule, examples, 1, device)
    batches = device_batches(datamodule, examples, batch_size, device)
    for row in rows:
        target.place(row.module)
    with flushed_denormals(device) as flushed, torch.inference_mode(), target.context():
        for row in rows:
            if row.module.decoder.compiled_calls:
                compiled_warm_up(partial(time_row, row), singles + batches)
            else:
                for batch in singles[:3] + batches[:1]:
                    time_row(row, batch)
        timed_on = str(next(rows[0].module.parameters()).device)
        timers = {id(row): partial(time_row, row) for row in rows}
        with tqdm(total=2 * repeats, desc="timing decoders (passes)") as bar:
            single_runs = interleaved_passes(timers, singles, repeats, bar.update)
            batch_runs = interleaved_passes(timers, batches, repeats, bar.update)
        speeds = []
        for row in rows:
            runs = single_runs[id(row)]
            with PeakMemory(device) as memory:
                for batch in batches:
                    time_row(row, batch)
            speeds.append(Speed([sum(run) for run in runs], [sum(run) for run in batch_runs[id(row)]],
                                [statistics.median(times) for times in zip(*runs)], memory.peak_mb))
    return Measurement(speeds, timed_on, flushed)


def reference_calls(decoder, datamodule, split: str = "test") -> list[int] | None:
    """Per example of `split`, the decoder calls that producing its references would take with
    `decoder` (`Decoder.calls_for_output`); None where that depends on the model."""
    calls = [decoder.calls_for_output(example.target_ids) for example in datamodule.dataset(split)]
    return None if None in calls or not calls else calls


def reference_calls_per_example(row: Row) -> float | None:
    """Mean calls the test references need with this row's decoder: next to the calls the trained
    model took, it tells a cheaper decoder from a model that writes less."""
    calls = reference_calls(row.module.decoder, row.datamodule)
    return None if calls is None else statistics.mean(calls)


def target_subsequences(datamodule, limit: int | None) -> list[int]:
    """Per example of the first `limit` test examples (those `measure_speed` times), its reference's
    number of subsequences."""
    return [len(example.target_ids) for example in datamodule.dataset("test").examples[:limit]]


def trained_parameters(module: GenerationTask) -> int:
    """Weights a fit of this decoder trains: its own modules, plus the backbone unless frozen. A
    decoder on a frozen sequential backbone costs this on top of the sequential model's training."""
    count = sum(p.numel() for p in module.decoder.parameters())
    if module.decoder.trains_backbone():
        count += sum(p.numel() for p in module.backbone.parameters())
    return count


def scored(cfg, tokenizer, timing, records: list[dict]) -> dict:
    """A timed row's quality (the task's test scores, as tasks.test scores) and count of outputs
    cut by a bound, from the outputs of its last timed pass (`timing.Timing`)."""
    predictions = subsequence_texts(tokenizer, timing.subsequences())
    return {"quality": task_scores(cfg, tokenizer, predictions, records),
            "bound_hits": sum(hit for out in timing.outputs for hit in out.bound_hit)}
