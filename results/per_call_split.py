"""Where a decoder call's time goes at batch size 1: the model (encoder, decoder stack, output
projection) vs the decoding loop's own bookkeeping, per decoder call, for trained checkpoints.

    python results/per_call_split.py sequential=S.ckpt pipelined=P.ckpt [--examples 100]

Decodes the first test examples one by one (one thread, denormals flushed, after a warm-up; median
of 3 passes), timing the calls into `run_decoder`, `output_logits` and `encode` separately from the
rest of `generate`. A CPU measurement: on a GPU the bookkeeping is queued kernel launches.
"""
import argparse
import statistics
import sys
import time

import torch

import decoders.base as base
from tasks.compare import parse_checkpoints
from tasks.run import load_checkpoint
from tasks.test import checkpoint_config, restore

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("checkpoints", nargs="+", metavar="NAME=PATH")
parser.add_argument("--examples", type=int, default=100)
args = parser.parse_args()
torch.set_num_threads(1)
torch.set_flush_denormal(True)

model_seconds = [0.0]


def timed(function):
    def wrapper(*a, **k):
        started = time.perf_counter()
        try:
            return function(*a, **k)
        finally:
            model_seconds[0] += time.perf_counter() - started
    return wrapper


# every decoder module imported its own names from decoders.base: wrap them there (importing
# `decoders` imported every decoder module, to register it)
for module in [m for n, m in sys.modules.items() if n.startswith("decoders.") and n != "decoders.base"]:
    for function in ("run_decoder", "output_logits", "encode"):
        if hasattr(module, function):
            setattr(module, function, timed(getattr(base, function)))

for name, path in parse_checkpoints(args.checkpoints).items():
    checkpoint = load_checkpoint(path)
    built = restore(checkpoint, path, checkpoint_config(checkpoint, path, []))
    module = built.module.eval()
    examples = built.datamodule.dataset("test").examples[:args.examples]
    singles = [built.datamodule.collate([e]) for e in examples]

    def one_pass():
        model_seconds[0], calls, started = 0.0, 0, time.perf_counter()
        with torch.inference_mode():
            for batch in singles:
                out = module.decoder.generate(module.backbone, batch["input_ids"], batch["attention_mask"])
                calls += sum(out.decoder_calls)
        return time.perf_counter() - started, model_seconds[0], calls

    one_pass()
    runs = [one_pass() for _ in range(3)]
    total, model, calls = (statistics.median(r[i] for r in runs) for i in range(3))
    print(f"{name}: {calls / len(singles):.1f} calls/example, per call {1e3 * total / calls:.2f} ms "
          f"= model {1e3 * model / calls:.2f} ms + loop {1e3 * (total - model) / calls:.2f} ms")
