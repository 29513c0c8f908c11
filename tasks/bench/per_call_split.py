"""Where a decoder's time goes, and the most its fewer calls can buy, at batch size 1 or another.

    python -m tasks.bench.per_call_split sequential=S.ckpt pipelined=P.ckpt [--examples 100]
        [--batch-size 1]

Each NAME=PATH is decoded by decoder NAME where NAME is a registered decoder of the checkpoint's
layout (lookup=S.ckpt decodes a sequential checkpoint by lookup), else by the decoder it was
trained with.

Decodes the first test examples in batches of `--batch-size` (one thread, denormals flushed,
after a warm-up; the median of 5 passes, the decoders interleaved in each pass), timing the
encoder (`encode`, once per batch), the decoder calls into the model (`run_decoder`,
`output_logits`), blockwise's proposal heads (`proposal_logits`, their vocabulary projection
included) and the rest of `generate` (the loop's own bookkeeping) separately. A call is one call
of the batch (`DecodeOutput.batch_decoder_calls`).

Against the first decoder (the reference, e.g. sequential) it prints each decoder's speedup and,
as a share of its decoder-call ratio, beside a ceiling: the speedup it would have if each of its
calls cost exactly what a reference call costs (model and loop). The encoder runs once per
batch whatever the decoder, so fewer calls cannot buy their full ratio: the ceiling is below
100% by the encoder's share of the time. A CPU measurement: on a GPU the bookkeeping is queued
kernel launches.

Last, it times one model call (`run_decoder` and `output_logits`) of the reference checkpoint's
model on the first batch, feeding 1 to 4 tokens per example after 8 cached ones: what a call
costs per token fed on this machine.
"""
import argparse
import statistics
import time

import torch

import decoders.backbone as backbone
from decoders.blockwise import BlockwiseDecoder
from decoders.cache import DecoderCache, Slots
from tasks.bench import replace_backbone_calls, restored
from tasks.comparison.plan import parse_checkpoints

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("checkpoints", nargs="+", metavar="NAME=PATH")
parser.add_argument("--examples", type=int, default=100)
parser.add_argument("--batch-size", type=int, default=1)
args = parser.parse_args()
torch.set_num_threads(1)
torch.set_flush_denormal(True)

seconds = {"encode": 0.0, "model": 0.0, "heads": 0.0}
timing: list[str] = []   # the part being timed: a timed call inside it is that part's time


def timed(function, part):
    def wrapper(*a, **k):
        if timing:
            return function(*a, **k)
        timing.append(part)
        started = time.perf_counter()
        try:
            return function(*a, **k)
        finally:
            seconds[part] += time.perf_counter() - started
            timing.pop()
    return wrapper


replace_backbone_calls({function: timed(getattr(backbone, function), part) for function, part in
                        (("run_decoder", "model"), ("output_logits", "model"), ("encode", "encode"))})
# blockwise's proposal heads, their vocabulary projection included
BlockwiseDecoder.proposal_logits = timed(BlockwiseDecoder.proposal_logits, "heads")

decoders = {}
for name, path in parse_checkpoints(args.checkpoints).items():
    _, built = restored(name, path)
    examples = built.datamodule.dataset("test").examples[:args.examples]
    decoders[name] = (built.module.eval(), [built.datamodule.collate(examples[i:i + args.batch_size])
                                            for i in range(0, len(examples), args.batch_size)])


def one_pass(module, batches):
    """(total, encode, model, heads seconds, batch decoder calls) of decoding every batch."""
    seconds.update(encode=0.0, model=0.0, heads=0.0)
    calls, started = 0, time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            out = module.decoder.generate(module.backbone, batch["input_ids"], batch["attention_mask"])
            calls += out.batch_decoder_calls
    return time.perf_counter() - started, seconds["encode"], seconds["model"], seconds["heads"], calls


print(f"batch size {args.batch_size}, {args.examples} examples at most")
for name, (module, batches) in decoders.items():
    one_pass(module, batches)   # warm-up
passes = [{name: one_pass(*decoder) for name, decoder in decoders.items()} for _ in range(5)]
parts = {name: [statistics.median(p[name][i] for p in passes) for i in range(5)] for name in decoders}
reference = next(iter(parts))
ref_total, ref_encode, _, _, ref_calls = parts[reference]
ref_per_call = (ref_total - ref_encode) / ref_calls     # a reference call: model and loop
for name, (total, encode, model, heads, calls) in parts.items():
    examples = sum(len(batch["input_ids"]) for batch in decoders[name][1])
    loop = total - encode - model - heads
    line = (f"{name}: {calls / examples:.2f} calls/example, {1e3 * total / examples:.1f} ms/example "
            f"= encoder {1e3 * encode / examples:.1f} + calls {1e3 * (total - encode) / examples:.1f}; "
            f"per call {1e3 * (total - encode) / calls:.2f} ms = model {1e3 * model / calls:.2f} "
            + (f"+ heads {1e3 * heads / calls:.2f} " if heads else "")
            + f"+ loop {1e3 * loop / calls:.2f}")
    if name != reference:
        ratio = ref_calls / calls
        speedup = ref_total / total
        ceiling = ref_total / (encode + calls * ref_per_call)
        line += (f"; call ratio {ratio:.2f}, speedup {speedup:.2f}x ({speedup / ratio:.0%} of it), "
                 f"ceiling at {reference}'s cost per call {ceiling:.2f}x ({ceiling / ratio:.0%})")
    print(line)


def model_call_seconds(module, batch, fed: int, cached: int = 8, repeats: int = 200) -> float:
    """Median seconds of one model call of `batch`, feeding `fed` tokens per example (all visible)
    after `cached` ones."""
    model = module.backbone
    encoder_states = backbone.encode(model, batch["input_ids"], batch["attention_mask"])
    mask = backbone.cross_attention_mask(batch["attention_mask"], encoder_states.dtype)
    rows, heads = len(encoder_states), model.config.num_heads
    cache = DecoderCache(len(model.decoder.block))
    backbone.run_decoder(model, torch.zeros(rows, cached, dtype=torch.long),
                         torch.zeros(rows, heads, cached, cached), encoder_states, mask, cache,
                         Slots(start=0))
    tokens = torch.zeros(rows, fed, dtype=torch.long)
    bias = torch.zeros(rows, heads, fed, cached + fed)
    times = []
    for _ in range(repeats):   # every call writes at the same slots, after the `cached` ones
        started = time.perf_counter()
        backbone.output_logits(model, backbone.run_decoder(model, tokens, bias, encoder_states, mask,
                                                           cache, Slots(start=cached))).argmax(-1)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


module, batches = decoders[reference]
with torch.inference_mode():
    by_fed = [model_call_seconds(module, batches[0], fed) for fed in (1, 2, 3, 4)]
print(f"{reference}'s model, one call of the first batch feeding 1, 2, 3, 4 tokens per example: "
      + ", ".join(f"{1e3 * seconds:.2f}" for seconds in by_fed) + " ms")
