"""What `decoder.compile` buys each decoder: its encoder and calls' model step compiled.

    python -m tasks.bench.compiled_calls sequential=S.ckpt pipelined=P.ckpt [blockwise=B.ckpt ...]
        [--examples 100] [--batch-size 16] [--repeats 3]

Decodes the first test examples of each checkpoint eagerly and with `decoder.compile` on (the
encoder through `decoders.backbone.compiled_encode`; every decoder call through torch.compile:
sequential's, the verify loop's (blockwise, lookup, aggressive) and pipelined's greedy step for
fixed shapes, `decoders.backbone.fixed_shape_greedy_step`, sequential's and pipelined's with their
own bookkeeping around it, nar's layers for symbolic ones, `compiled_run_decoder`), at batch size 1
and at --batch-size, on one thread with denormals flushed: a warm-up per mode (one pass eagerly;
compiled, passes until one compiles nothing, `tasks.comparison.measure.compiled_warm_up`: where
compilation happens, its seconds printed), then --repeats passes, in each of which every
decoder and batch size decodes eagerly and then compiled, one after the other, so that the
machine's drifts touch both modes alike.

It prints a table: per decoder and batch size, the median examples per second eagerly and compiled,
the median of the passes' compiled / eager ratios with the lowest and highest, whether the compiled
decode gave exactly the eager tokens, and, in each mode, the speedup over the first checkpoint. A
CPU measurement: there compilation removes Python and per-op dispatch overhead and fuses
element-wise ops.
"""
import argparse
import copy
import statistics
import time

import torch

from tasks.comparison.measure import compiled_warm_up
from tasks.comparison.plan import parse_checkpoints
from tasks.runs.restore import restore_as_trained

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("checkpoints", nargs="+", metavar="NAME=PATH")
parser.add_argument("--examples", type=int, default=100)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--repeats", type=int, default=3)
args = parser.parse_args()
torch.set_num_threads(1)
torch.set_flush_denormal(True)

MODES = ("eager", "compiled")
decoders = {}
for name, path in parse_checkpoints(args.checkpoints).items():
    built = restore_as_trained(path)
    module, data = built.module.eval(), built.datamodule
    compiled = copy.copy(module.decoder)     # the same modules, decoding with decoder.compile=true
    compiled.compiled_calls = True
    examples = data.dataset("test").examples[:args.examples]
    decoders[name] = ({"eager": module.decoder, "compiled": compiled}, module.backbone, {
        "bs1": [data.collate([e]) for e in examples],
        f"bs{args.batch_size}": [data.collate(examples[i:i + args.batch_size])
                                 for i in range(0, len(examples), args.batch_size)]})


def decode(decoder, backbone, batches) -> tuple[float, list]:
    """(seconds, every example's subsequences) of decoding `batches` in order."""
    outputs, started = [], time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            outputs += decoder.generate(backbone, batch["input_ids"], batch["attention_mask"]).subsequences
    return time.perf_counter() - started, outputs


warmup = {}
for name, (modes, backbone, sizes) in decoders.items():
    everything = [batch for batches in sizes.values() for batch in batches]
    warmup[name, "eager"] = decode(modes["eager"], backbone, everything)[0]
    warmup[name, "compiled"] = compiled_warm_up(
        lambda batch: decode(modes["compiled"], backbone, [batch]), everything)
passes = [{(name, label, mode): decode(modes[mode], backbone, batches)
           for name, (modes, backbone, sizes) in decoders.items()
           for label, batches in sizes.items() for mode in MODES}
          for _ in range(args.repeats)]


def seconds(name: str, label: str, mode: str) -> float:
    return statistics.median(p[name, label, mode][0] for p in passes)


reference = next(iter(decoders))
print(f"decoder.compile=true against eager; one thread, denormals flushed, "
      f"{len(decoders[reference][2]['bs1'])} test examples; {args.repeats} passes, each decoding "
      f"eagerly then compiled; speedups over {reference} in the same mode\n")
print("| decoder | batch | eager ex/s | compiled ex/s | compiled / eager (lowest–highest pass) | "
      "compiled tokens | speedup eager | speedup compiled | warm-up s eager / compiled |")
print("|---|---|---|---|---|---|---|---|---|")
for name, (_, _, sizes) in decoders.items():
    for label, batches in sizes.items():
        examples = sum(len(batch["input_ids"]) for batch in batches)
        ratios = [p[name, label, "eager"][0] / p[name, label, "compiled"][0] for p in passes]
        same = all(p[name, label, "eager"][1] == p[name, label, "compiled"][1] for p in passes)
        eager, compiled = seconds(name, label, "eager"), seconds(name, label, "compiled")
        print(f"| {name} | {label[2:]} | {examples / eager:.1f} | {examples / compiled:.1f} | "
              f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}–{max(ratios):.2f}) | "
              f"{'equal' if same else 'DIFFER'} | "
              f"{seconds(reference, label, 'eager') / eager:.2f}x | "
              f"{seconds(reference, label, 'compiled') / compiled:.2f}x | "
              f"{warmup[name, 'eager']:.1f} / {warmup[name, 'compiled']:.1f} |")
