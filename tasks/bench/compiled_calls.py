"""What `decoder.compile` buys each decoder: its calls' model step through torch.compile.

    python -m tasks.bench.compiled_calls sequential=S.ckpt pipelined=P.ckpt [blockwise=B.ckpt ...]
        [--examples 100] [--batch-size 16] [--repeats 3]

Decodes the first test examples of each checkpoint eagerly, then with `decoder.compile` on (every
decoder call runs the backbone's decoder layers through torch.compile: sequential's for fixed
shapes, `decoders.backbone.fixed_shape_run_decoder`, the others' for symbolic ones,
`compiled_run_decoder`), at batch size 1 and at --batch-size, on one thread with denormals flushed; per mode a
warm-up pass (where compilation happens: its seconds are printed), then the median of --repeats
passes, the decoders interleaved in each.

It prints a table: per decoder and batch size, examples per second eagerly and compiled, their
ratio, whether the compiled decode gave exactly the eager tokens, and, in each mode, the speedup
over the first checkpoint. A CPU measurement: there compilation removes Python and per-op dispatch
overhead and fuses element-wise ops.
"""
import argparse
import statistics
import time

import torch

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

decoders = {}
for name, path in parse_checkpoints(args.checkpoints).items():
    built = restore_as_trained(path)
    examples = built.datamodule.dataset("test").examples[:args.examples]
    collate = built.datamodule.collate
    decoders[name] = (built.module.eval(), {
        "bs1": [collate([e]) for e in examples],
        f"bs{args.batch_size}": [collate(examples[i:i + args.batch_size])
                                 for i in range(0, len(examples), args.batch_size)]})


def decode(module, batches) -> tuple[float, list]:
    """(seconds, every example's subsequences) of decoding `batches` in order."""
    outputs, started = [], time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            out = module.decoder.generate(module.backbone, batch["input_ids"], batch["attention_mask"])
            outputs += out.subsequences
    return time.perf_counter() - started, outputs


def measure() -> dict:
    """{decoder: (warm-up seconds, {batch label: (median seconds, outputs)})} in the current mode."""
    warmup = {name: sum(decode(module, batches)[0] for batches in sizes.values())
              for name, (module, sizes) in decoders.items()}
    passes = [{(name, label): decode(module, batches) for name, (module, sizes) in decoders.items()
               for label, batches in sizes.items()} for _ in range(args.repeats)]
    return {name: (warmup[name], {label: (statistics.median(p[name, label][0] for p in passes),
                                          passes[0][name, label][1]) for label in sizes})
            for name, (_, sizes) in decoders.items()}


eager = measure()
for module, _ in decoders.values():
    module.decoder.compiled_calls = True   # what decoder.compile=true sets
compiled = measure()

reference = next(iter(decoders))
print(f"decoder.compile=true against eager; one thread, denormals flushed, "
      f"{len(decoders[reference][1]['bs1'])} test examples; speedups over {reference} in the same mode\n")
print("| decoder | batch | eager ex/s | compiled ex/s | compiled / eager | compiled tokens | "
      "speedup eager | speedup compiled | warm-up s eager / compiled |")
print("|---|---|---|---|---|---|---|---|---|")
for name, (module, sizes) in decoders.items():
    for label, batches in sizes.items():
        examples = sum(len(batch["input_ids"]) for batch in batches)
        seconds, outputs = eager[name][1][label]
        compiled_seconds, compiled_outputs = compiled[name][1][label]
        print(f"| {name} | {label[2:]} | {examples / seconds:.1f} | {examples / compiled_seconds:.1f} | "
              f"{seconds / compiled_seconds:.2f}x | {'equal' if compiled_outputs == outputs else 'DIFFER'} | "
              f"{eager[reference][1][label][0] / seconds:.2f}x | "
              f"{compiled[reference][1][label][0] / compiled_seconds:.2f}x | "
              f"{eager[name][0]:.1f} / {compiled[name][0]:.1f} |")
