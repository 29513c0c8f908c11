"""The paper-style speed comparison on an accelerator: trained checkpoints, decode-only timing.

    python -m tasks.bench.gpu_benchmark --ckpt sequential=S.ckpt --ckpt pipelined=P.ckpt \\
        [--ckpt lookup=S.ckpt --ckpt aggressive=S.ckpt --drafter N.ckpt] \\
        [--batch-sizes 1,64] [--precision bf16|fp32] [--repeats 5] [--examples N] [--threads 1] \\
        [--out FILE.json]

Huang et al. time T5 decoders on one RTX 4090 at batch size 1 and at a large batch (the number was
lost in our text of the paper; 64 is the default here). This runs that comparison for any
checkpoints written by tasks.fit: each is decoded on its own test split (the same examples for all,
as long as they were trained on the same data), at every batch size, the decoders interleaved and
the median of `--repeats` passes taken after a warm-up. A row named after a registered decoder
decodes its checkpoint with that decoder (one of the trained layout: `lookup=S` decodes the
sequential checkpoint S with lookup drafts), with the decode-time settings its name carries, written
as a comparison's row labels write them (`lookup(draft_tokens=1)=S`); a decoder that drafts with
another model (aggressive) drafts with the nar checkpoint `--drafter`. When the first checkpoint is
decoded sequentially, transformers' own greedy `generate` on the same backbone is timed beside it,
and whether the two give the same tokens is reported.

Every row is scored on the examples it decoded (the task's metrics, as tasks.test scores) and
judged against the task's baselines on the same examples, as tasks.compare judges its rows: a row whose model did not learn (not above the best baseline, or most outputs cut by a
bound) is marked so and gets no speedup.

On a CUDA device: time from CUDA events around each decode (the GPU's own clock, no host sync
inside the timed region other than the decoders' own), peak memory from `max_memory_allocated`
over the decode, and `--precision bf16` decodes under bf16 autocast. Without CUDA it runs the same
code on the CPU (`--threads` torch threads, timing from the host clock, denormals flushed,
memory from the C heap as tasks.compare measures it) and says so in its output: CPU figures are
not GPU figures.
"""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch

from tasks.baselines import scored_baselines
from tasks.bench import restored
from tasks.comparison.measure import device_batches, flushed_denormals, scored
from tasks.comparison.plan import parse_checkpoints
from tasks.comparison.report import (bound_share, not_learned, primary_metric, shown_label,
                                     speedup_cell, steps_caption)
from tasks.comparison.timing import (PRECISIONS, TransformersGenerate, conditions_caption,
                                     time_decoders, timing_conditions)
from tasks.config import ConfigError
from tasks.cli import command_line, log, main_guard, show_report

GENERATE = "transformers generate"


def decode_time_shares(timing) -> dict[str, float]:
    """Each time counter (`*_seconds`) of the decoder's, summed over the last timed pass, as its
    share of that pass's seconds (aggressive's `drafter_seconds`: its drafter's share, the rest
    being the verifier's), as a comparison's JSON holds them."""
    totals: dict[str, float] = {}
    for out in timing.outputs:
        for name, value in out.stats.items():
            if name.endswith("_seconds"):
                totals[name] = totals.get(name, 0.0) + value
    return {name: value / timing.pass_seconds[-1] for name, value in totals.items()}


def benchmark(modules: dict, cfgs: dict, datamodule, device: torch.device, batch_sizes: list[int],
              precision: str, repeats: int, examples: int | None,
              single_examples: int | None) -> tuple[list[dict], bool | None]:
    """One row per (decoder, batch size): examples/s, speedup over the first decoder, peak MB and
    its ratio to the first decoder's, decoder calls per example, quality and bound hits (at batch
    size 1 on the first `single_examples` examples only, where given). Beside them, per batch size,
    in how many examples transformers' generate, where it was timed, gave other subsequences than
    the first decoder (None where it was not timed)."""
    first = next(iter(modules))
    rows, differing = [], ({} if GENERATE in modules else None)
    for batch_size in batch_sizes:
        limit = single_examples if batch_size == 1 and single_examples else examples
        test = datamodule.dataset("test").examples[:examples][:limit]
        records = datamodule.records("test")[:examples][:limit]
        batches = device_batches(datamodule, test, batch_size, device)
        timings = time_decoders(modules, batches, device, precision, repeats)
        if differing is not None:
            differing[batch_size] = sum(a != b for a, b in zip(timings[GENERATE].subsequences(),
                                                               timings[first].subsequences()))
        for name, timing in timings.items():
            cfg = cfgs.get(name, cfgs[first])
            compiled = getattr(modules[name].decoder, "compiled_calls", False)   # generate: never
            rows.append({"decoder": name, "options": {"compile": compiled},
                         "batch_size": batch_size, "examples": len(test),
                         "examples_per_second": len(test) / timing.seconds,
                         "speedup": timings[first].seconds / timing.seconds,
                         "speedup_passes": timing.speedups_over(timings[first]),
                         "peak_memory_mb": timing.peak_memory_mb,
                         "memory_vs_first": timing.peak_memory_mb / timings[first].peak_memory_mb
                         if timings[first].peak_memory_mb > 0 else None,
                         "decoder_calls_per_example": timing.calls_per_example,
                         "decode_time_shares": decode_time_shares(timing),
                         **scored(cfg, datamodule.tokenizer, timing, records)})
    return rows, differing


def judged(rows: list[dict], baselines: list[dict], primary: str) -> list[dict]:
    """Each row's `not_learned` reason (None when it learned), judged on its decoder's row that
    decoded the most examples (those the baselines were scored on); a row that did not learn, or
    every row when the first (the speedups' reference) did not, has no speedup."""
    for row in rows:
        widest = max((r for r in rows if r["decoder"] == row["decoder"]), key=lambda r: r["examples"])
        row["not_learned"] = not_learned(widest["quality"], bound_share(widest, widest["examples"]),
                                         primary, baselines)
    for batch_size in {row["batch_size"] for row in rows}:
        same = [row for row in rows if row["batch_size"] == batch_size]
        for row in same:
            if row["not_learned"] or same[0]["not_learned"]:
                row["speedup"] = row["speedup_passes"] = None
    return rows


def markdown(result: dict) -> str:
    primary = result["primary_metric"]
    caption = (conditions_caption(result)
               + f", precision {result['precision']}, {result['task']}, {result['examples']} test "
               f"examples (batch size 1: the first {result['single_examples']}), median of "
               f"{result['repeats']} passes, {steps_caption(result['rows'])}; baselines scored on "
               f"the {result['examples']}")
    if result["note"]:
        caption += f"; {result['note']}"
    if result["sequential_equals_generate"] is not None:
        caption += (f"; sequential's tokens {'equal' if result['sequential_equals_generate'] else 'DIFFER FROM'}"
                    f" transformers generate's")
        if not result["sequential_equals_generate"]:
            caption += " (" + ", ".join(
                f"in {count} examples at batch size {size}"
                for size, count in result["examples_differing_from_generate"].items()) + ")"
    lines = [caption, "", f"| decoder | batch | ex/s | speedup (lowest–highest pass) | peak MB "
             f"| memory vs first | calls/ex | {primary} | bound hits |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        memory = "-" if r["memory_vs_first"] is None else f"{r['memory_vs_first']:.2f}"
        label = shown_label({**r, "label": r["decoder"]})
        lines.append(f"| {label} | {r['batch_size']} | {r['examples_per_second']:.1f} | "
                     f"{speedup_cell(r, 'speedup')} | "
                     f"{r['peak_memory_mb']:.1f} | {memory} | {r['decoder_calls_per_example']:.1f} | "
                     f"{r['quality'][primary]:.3f} | {bound_share(r, r['examples']):.0%} |")
    baselines = result["baselines"]
    if baselines:
        lines += ["", "Baselines (no model): " + "; ".join(
            f"{b['baseline']} {b['quality'][primary]:.3f}" for b in baselines)]
    lines += [f"Not learned: {r['decoder']} (batch {r['batch_size']}): {r['not_learned']}"
              for r in result["rows"] if r["not_learned"]]
    lines += [f"{r['decoder']} (batch {r['batch_size']}): {name} took {share:.0%} of the decode time"
              for r in result["rows"] for name, share in r.get("decode_time_shares", {}).items()]
    lines += ["", f"Command: `{result['command']}`"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", action="append", required=True, metavar="NAME=PATH",
                        help="a checkpoint written by tasks.fit, under a row name (repeat; the "
                             "first is the speedup's reference); a registered decoder's name "
                             "decodes it with that decoder, NAME(OPTION=VALUE,...) with those "
                             "decode-time settings")
    parser.add_argument("--drafter", default=None, metavar="NAR_CKPT",
                        help="the nar checkpoint a drafting decoder's row (aggressive) drafts with")
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--precision", default="bf16", choices=PRECISIONS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--examples", type=int, default=None, help="first N test examples (all)")
    parser.add_argument("--single-examples", type=int, default=None,
                        help="time and score batch size 1 on the first N of those (all)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on a CPU")
    parser.add_argument("--out", default="results/gpu_benchmark.json")
    args = parser.parse_args(argv)
    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError as err:
        raise ConfigError(f"--batch-sizes {args.batch_sizes!r}: comma-separated integers") from err
    for flag, values in (("--batch-sizes", batch_sizes), ("--repeats", [args.repeats]),
                         ("--examples", [1 if args.examples is None else args.examples]),
                         ("--single-examples",
                          [1 if args.single_examples is None else args.single_examples]),
                         ("--threads", [args.threads])):
        if min(values) < 1:
            raise ConfigError(f"{flag}: every value must be >= 1, got {values}")
    paths = parse_checkpoints(args.ckpt)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    conditions = timing_conditions(device, args.threads)
    if conditions["note"]:
        log.warning(conditions["note"])
    modules, cfgs, datamodule = {}, {}, None
    for name, path in paths.items():
        cfgs[name], built = restored(name, path, args.drafter)
        modules[name] = built.module.to(device).eval()
        datamodule = datamodule or built.datamodule
    first = next(iter(modules.values()))
    test = datamodule.dataset("test").examples[:args.examples]
    if first.decoder.name == "sequential":  # transformers' generate beside it, same backbone
        modules[GENERATE] = SimpleNamespace(
            decoder=TransformersGenerate(first.decoder.max_new_tokens, first.decoder.special),
            backbone=first.backbone)
    with flushed_denormals(device):
        rows, differing = benchmark(modules, cfgs, datamodule, device, batch_sizes, args.precision,
                         args.repeats, args.examples, args.single_examples)
    cfg = cfgs[next(iter(paths))]
    baselines = [entry for entry, _ in scored_baselines(cfg, datamodule, args.examples)]
    primary = primary_metric(cfg.task.name)
    result = {**conditions, "task": cfg.task.name, "precision": args.precision,
              "repeats": args.repeats, "examples": len(test),
              "single_examples": len(test[:args.single_examples]),
              "sequential_equals_generate": None if differing is None else not any(differing.values()),
              "examples_differing_from_generate": differing, "primary_metric": primary,
              "baselines": baselines, "rows": judged(rows, baselines, primary),
              "command": command_line("tasks.bench.gpu_benchmark", argv)}
    show_report(args.out, result, markdown(result))
    return result


if __name__ == "__main__":
    main_guard(main)
