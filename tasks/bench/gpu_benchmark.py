"""The paper-style speed comparison on an accelerator: trained checkpoints, decode-only timing.

    python -m tasks.bench.gpu_benchmark --ckpt sequential=S.ckpt --ckpt pipelined=P.ckpt \\
        [--batch-sizes 1,64] [--precision bf16|fp32] [--repeats 5] [--examples N] [--out FILE.json]

Huang et al. time T5 decoders on one RTX 4090 at batch size 1 and at a large batch (the number was
lost in our text of the paper; 64 is the default here). This runs that comparison for any
checkpoints written by tasks.fit: each is decoded on its own test split (the same examples for all,
as long as they were trained on the same data), at every batch size, the decoders interleaved and
the median of `--repeats` passes taken after a warm-up. When the first checkpoint is decoded
sequentially, transformers' own greedy `generate` on the same backbone is timed beside it, and
whether the two give the same tokens is reported.

On a CUDA device: time from CUDA events around each decode (the GPU's own clock, no host sync
inside the timed region other than the decoders' own), peak memory from `max_memory_allocated`
over the decode, and `--precision bf16` decodes under bf16 autocast. Without CUDA it runs the same
code on the CPU (timing from the host clock, denormals flushed, memory from the C heap as
tasks.compare measures it) and says so in its output: CPU figures are not GPU figures.
"""
from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext
from types import SimpleNamespace

import torch
from lightning.pytorch.utilities import move_data_to_device

from decoders.base import DecodeOutput
from decoders.loop import split_flat_output
from tasks.comparison.measure import PeakMemory, flushed_denormals
from tasks.comparison.plan import parse_checkpoints
from tasks.config import ConfigError
from tasks.run import log, main_guard, write_report
from tasks.test import restore_as_trained

CPU_NOTE = ("no CUDA device: timed on the CPU with the host clock (denormals flushed); these are "
            "not GPU figures")


def timed(decoder, model, batch: dict, device: torch.device, precision: str):
    """(DecodeOutput, seconds) of one decode: CUDA events on a GPU, the host clock elsewhere."""
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16"
                else nullcontext())
    with torch.inference_mode(), autocast:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = decoder.generate(model, batch["input_ids"], batch["attention_mask"])
            end.record()
            end.synchronize()
            return out, start.elapsed_time(end) / 1000.0
        started = time.perf_counter()
        out = decoder.generate(model, batch["input_ids"], batch["attention_mask"])
        return out, time.perf_counter() - started


class TransformersGenerate:
    """transformers' own greedy `generate` on a sequential checkpoint's backbone, as a decoder:
    the reference the sequential decoder must match token for token and at least equal in speed."""

    def __init__(self, sequential):
        self.sequential = sequential

    def generate(self, model, input_ids, attention_mask):
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                             num_beams=1, max_new_tokens=self.sequential.max_new_tokens)
        rows = [[t for t in row if t != model.config.pad_token_id] for row in out[:, 1:].tolist()]
        split = [split_flat_output(row, self.sequential.special) for row in rows]
        return DecodeOutput(subsequences=[subs for subs, _ in split], decoder_calls=[out.size(1) - 1] * len(rows),
                            tokens=[len(r) for r in rows], hit_max_steps=[not e for _, e in split],
                            batch_decoder_calls=out.size(1) - 1)


def same_outputs(first, second, batches, device, precision) -> bool:
    """Whether two decoders give the same subsequences on every batch."""
    return all(timed(first.decoder, first.backbone, b, device, precision)[0].subsequences
               == timed(second.decoder, second.backbone, b, device, precision)[0].subsequences
               for b in batches)


def benchmark(modules: dict, datamodule, device: torch.device, batch_sizes: list[int],
              precision: str, repeats: int, examples: int | None) -> list[dict]:
    """One row per (decoder, batch size): examples/s, speedup over the first decoder, peak MB,
    decoder calls per example."""
    test = datamodule.dataset("test").examples[:examples]
    rows = []
    for batch_size in batch_sizes:
        batches = [move_data_to_device(datamodule.collate(test[i:i + batch_size]), device)
                   for i in range(0, len(test), batch_size)]
        seconds: dict[str, list[float]] = {name: [] for name in modules}
        calls: dict[str, float] = {}
        for module in modules.values():  # warm-up
            timed(module.decoder, module.backbone, batches[0], device, precision)
        for _ in range(repeats):
            for name, module in modules.items():   # interleaved
                runs = [timed(module.decoder, module.backbone, b, device, precision) for b in batches]
                seconds[name].append(sum(s for _, s in runs))
                calls[name] = sum(sum(out.decoder_calls) for out, _ in runs) / len(test)
        for name, module in modules.items():
            with PeakMemory(device) as memory:
                for batch in batches:
                    timed(module.decoder, module.backbone, batch, device, precision)
            speed = len(test) / statistics.median(seconds[name])
            first = len(test) / statistics.median(seconds[next(iter(modules))])
            rows.append({"decoder": name, "batch_size": batch_size, "examples_per_second": speed,
                         "speedup": speed / first, "peak_memory_mb": memory.peak_mb,
                         "decoder_calls_per_example": calls[name]})
    return rows


def markdown(result: dict) -> str:
    lines = [f"{result['device']}, precision {result['precision']}, {result['examples']} test "
             f"examples, median of {result['repeats']}" + (f"; {result['note']}" if result["note"] else "")
             + ("" if result["sequential_equals_generate"] is None else
                f"; sequential's tokens {'equal' if result['sequential_equals_generate'] else 'DIFFER FROM'}"
                f" transformers generate's"),
             "", "| decoder | batch | ex/s | speedup | peak MB | calls/ex |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['decoder']} | {r['batch_size']} | {r['examples_per_second']:.1f} | "
                     f"{r['speedup']:.2f} | {r['peak_memory_mb']:.1f} | "
                     f"{r['decoder_calls_per_example']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", action="append", required=True, metavar="NAME=PATH",
                        help="a checkpoint written by tasks.fit, under a row name (repeat; the "
                             "first is the speedup's reference)")
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--examples", type=int, default=None, help="first N test examples (all)")
    parser.add_argument("--out", default="results/gpu_benchmark.json")
    args = parser.parse_args(argv)
    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError as err:
        raise ConfigError(f"--batch-sizes {args.batch_sizes!r}: comma-separated integers") from err
    for flag, values in (("--batch-sizes", batch_sizes), ("--repeats", [args.repeats]),
                         ("--examples", [args.examples or 1])):
        if min(values) < 1:
            raise ConfigError(f"{flag}: every value must be >= 1, got {values}")
    paths = parse_checkpoints(args.ckpt)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    note = "" if cuda else CPU_NOTE
    if note:
        log.warning(note)
    modules, datamodule = {}, None
    for name, path in paths.items():
        built = restore_as_trained(path)
        modules[name] = built.module.to(device).eval()
        datamodule = datamodule or built.datamodule
    first = next(iter(modules.values()))
    identical = None
    if first.decoder.name == "sequential":  # transformers' generate beside it, same backbone
        modules["transformers generate"] = SimpleNamespace(
            decoder=TransformersGenerate(first.decoder), backbone=first.backbone)
        test = datamodule.dataset("test").examples[:args.examples]
        batches = [move_data_to_device(datamodule.collate(test[i:i + 16]), device)
                   for i in range(0, len(test), 16)]
        identical = same_outputs(first, modules["transformers generate"], batches, device,
                                 args.precision)
    with flushed_denormals(device):
        rows = benchmark(modules, datamodule, device, batch_sizes, args.precision, args.repeats,
                         args.examples)
    examples = len(datamodule.dataset("test").examples[:args.examples])
    result = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "note": note,
              "precision": args.precision, "repeats": args.repeats, "examples": examples,
              "sequential_equals_generate": identical, "rows": rows}
    write_report(args.out, result, markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main_guard(main)
