"""The pipelined decoding loop of an earlier commit against today's, timed side by side with
sequential, on the same trained checkpoints: what a change of the loop bought.

    python results/pipelined_versions.py REV sequential=S.ckpt pipelined=P.ckpt [--examples 100]

`decoders/pipelined.py` at git revision REV is loaded as a separate module (unregistered) and
built with the checkpoint's options; both versions must give the same outputs (checked). Batch
sizes 1 and 16, one thread, denormals flushed, the three decoders interleaved, median of 3 passes
after a warm-up.
"""
import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tasks.compare import parse_checkpoints
from tasks.run import load_checkpoint
from tasks.test import checkpoint_config, restore

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("rev")
parser.add_argument("checkpoints", nargs=2, metavar="NAME=PATH")
parser.add_argument("--examples", type=int, default=100)
args = parser.parse_args()
torch.set_num_threads(1)
torch.set_flush_denormal(True)

source = subprocess.run(["git", "show", f"{args.rev}:decoders/pipelined.py"], check=True,
                        capture_output=True, text=True).stdout
source = source.replace('@register("pipelined")\n', "")   # the registry holds one "pipelined"
with tempfile.TemporaryDirectory() as folder:
    path = Path(folder) / "pipelined_then.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("pipelined_then", path)
    then = importlib.util.module_from_spec(spec)
    sys.modules["pipelined_then"] = then
    spec.loader.exec_module(then)

built = {}
for name, ckpt in parse_checkpoints(args.checkpoints).items():
    checkpoint = load_checkpoint(ckpt)
    built[name] = restore(checkpoint, ckpt, checkpoint_config(checkpoint, ckpt, []))
sequential, pipelined = built["sequential"].module.eval(), built["pipelined"].module.eval()
now = pipelined.decoder
old = then.PipelinedDecoder(pipelined.backbone.config, now.special, delay=now.delay,
                            max_subsequences=now.max_subsequences,
                            max_subsequence_length=now.max_subsequence_length,
                            max_length=now.max_length, stop_rule=now.stop_rule)

for batch_size in (1, 16):
    def batches(name):
        data = built[name].datamodule
        examples = data.dataset("test").examples[:args.examples]
        return [data.collate(examples[i:i + batch_size]) for i in range(0, len(examples), batch_size)]
    entries = {"sequential": (sequential, sequential.decoder, batches("sequential")),
               f"pipelined at {args.rev}": (pipelined, old, batches("pipelined")),
               "pipelined now": (pipelined, now, batches("pipelined"))}
    seconds = {name: [] for name in entries}
    calls, outputs = {}, {}
    for repeat in range(4):
        for name, (module, decoder, data) in entries.items():
            started, outs = time.perf_counter(), []
            with torch.inference_mode():
                for batch in data:
                    outs.append(decoder.generate(module.backbone, batch["input_ids"], batch["attention_mask"]))
            if repeat:   # the first pass warms up
                seconds[name].append(time.perf_counter() - started)
            calls[name] = sum(sum(o.decoder_calls) for o in outs)
            outputs[name] = [(o.subsequences, o.decoder_calls, o.tokens, o.hit_max_steps) for o in outs]
    pipelined_names = list(entries)[1:]
    same = outputs[pipelined_names[0]] == outputs[pipelined_names[1]]
    median = {name: statistics.median(s) for name, s in seconds.items()}
    ratio = calls["sequential"] / calls["pipelined now"]
    print(f"batch {batch_size}: call ratio {ratio:.2f}; outputs identical: {same}; " + "; ".join(
        f"{name} {args.examples / median[name]:.1f} ex/s"
        + ("" if name == "sequential" else
           f" = {median['sequential'] / median[name]:.2f}x ({median['sequential'] / median[name] / ratio:.0%} of the call ratio)")
        for name in entries))
