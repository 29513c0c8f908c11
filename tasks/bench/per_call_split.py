"""Where a decoder's time goes at batch size 1, and the most its fewer calls can buy there.

    python -m tasks.bench.per_call_split sequential=S.ckpt pipelined=P.ckpt [--examples 100]

Decodes the first test examples one by one (one thread, denormals flushed, after a warm-up; the
median of 3 passes, the decoders interleaved in each pass), timing the encoder (`encode`, once per
example), the decoder calls into the model (`run_decoder`, `output_logits`) and the rest of
`generate` (the loop's own bookkeeping) separately.

Against the first decoder (the reference, e.g. sequential) it prints each decoder's speedup and,
as a share of its decoder-call ratio, beside a ceiling: the speedup it would have if each of its
calls cost exactly what a reference call costs (model and loop). The encoder runs once per
example whatever the decoder, so fewer calls cannot buy their full ratio: the ceiling is below
100% by the encoder's share of the time. A CPU measurement: on a GPU the bookkeeping is queued
kernel launches.
"""
import argparse
import statistics
import time

import torch

import decoders.backbone as backbone
from tasks.bench import replace_backbone_calls
from tasks.comparison.plan import parse_checkpoints
from tasks.test import restore_as_trained

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("checkpoints", nargs="+", metavar="NAME=PATH")
parser.add_argument("--examples", type=int, default=100)
args = parser.parse_args()
torch.set_num_threads(1)
torch.set_flush_denormal(True)

seconds = {"encode": 0.0, "model": 0.0}


def timed(function, part):
    def wrapper(*a, **k):
        started = time.perf_counter()
        try:
            return function(*a, **k)
        finally:
            seconds[part] += time.perf_counter() - started
    return wrapper


replace_backbone_calls({function: timed(getattr(backbone, function), part) for function, part in
                        (("run_decoder", "model"), ("output_logits", "model"), ("encode", "encode"))})

decoders = {}
for name, path in parse_checkpoints(args.checkpoints).items():
    built = restore_as_trained(path)
    examples = built.datamodule.dataset("test").examples[:args.examples]
    decoders[name] = (built.module.eval(), [built.datamodule.collate([e]) for e in examples])


def one_pass(module, singles):
    """(total, encode, model seconds, decoder calls) of decoding every example alone."""
    seconds.update(encode=0.0, model=0.0)
    calls, started = 0, time.perf_counter()
    with torch.inference_mode():
        for batch in singles:
            out = module.decoder.generate(module.backbone, batch["input_ids"], batch["attention_mask"])
            calls += sum(out.decoder_calls)
    return time.perf_counter() - started, seconds["encode"], seconds["model"], calls


for name, (module, singles) in decoders.items():
    one_pass(module, singles)   # warm-up
passes = [{name: one_pass(*decoder) for name, decoder in decoders.items()} for _ in range(3)]
parts = {name: [statistics.median(p[name][i] for p in passes) for i in range(4)] for name in decoders}
reference = next(iter(parts))
ref_total, ref_encode, _, ref_calls = parts[reference]
ref_per_call = (ref_total - ref_encode) / ref_calls     # a reference call: model and loop
for name, (total, encode, model, calls) in parts.items():
    examples = len(decoders[name][1])
    loop = total - encode - model
    line = (f"{name}: {calls / examples:.2f} calls/example, {1e3 * total / examples:.1f} ms/example "
            f"= encoder {1e3 * encode / examples:.1f} + calls {1e3 * (total - encode) / examples:.1f}; "
            f"per call {1e3 * (total - encode) / calls:.2f} ms = model {1e3 * model / calls:.2f} "
            f"+ loop {1e3 * loop / calls:.2f}")
    if name != reference:
        ratio = ref_calls / calls
        speedup = ref_total / total
        ceiling = ref_total / (encode + calls * ref_per_call)
        line += (f"; call ratio {ratio:.2f}, speedup {speedup:.2f}x ({speedup / ratio:.0%} of it), "
                 f"ceiling at {reference}'s cost per call {ceiling:.2f}x ({ceiling / ratio:.0%})")
    print(line)
