"""What a change of the pipelined decoding loop bought: an earlier commit's loop against today's.

Both are timed side by side with sequential, on the same trained checkpoints.

    python -m tasks.bench.pipelined_versions REV sequential=S.ckpt pipelined=P.ckpt [--examples 100]

`decoders/pipelined.py` at git revision REV is loaded as a separate module (unregistered) and
built with the checkpoint's options; both versions must give the same outputs (subsequences, calls,
tokens and bound flags, checked at batch size 16). Timed by `tasks.comparison.timing` on the
CPU: batch sizes 1 and 16, one thread, denormals flushed, the three decoders interleaved, median of
3 passes.
"""
import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

from decoders.base import RENAMED_OPTIONS
from tasks.comparison.measure import device_batches
from tasks.comparison.plan import parse_checkpoints
from tasks.comparison.timing import time_decoders
from tasks.runs.restore import restore_as_trained

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

built = {name: restore_as_trained(ckpt) for name, ckpt in parse_checkpoints(args.checkpoints).items()}
sequential, pipelined = built["sequential"].module.eval(), built["pipelined"].module.eval()
now = pipelined.decoder
# the output bound under the name it had at REV (`decoders.base.RENAMED_OPTIONS`)
bound_name = "max_new_tokens" if "max_new_tokens" in getattr(then.PipelinedDecoder, "options", {}) \
    else next(old for old, new in RENAMED_OPTIONS.items() if new == "max_new_tokens")
old = then.PipelinedDecoder(pipelined.backbone.config, now.special, delay=now.delay,
                            max_subsequences=now.max_subsequences,
                            max_subsequence_length=now.max_subsequence_length,
                            stop_rule=now.stop_rule, **{bound_name: now.max_new_tokens})
old_name = f"pipelined at {args.rev}"
modules = {"sequential": sequential, old_name: SimpleNamespace(decoder=old, backbone=pipelined.backbone),
           "pipelined now": pipelined}

data = built["pipelined"].datamodule
test = data.dataset("test").examples[:args.examples]


def outputs(decoder) -> list:
    """Every field of the decoder's output on the test examples, in batches of 16."""
    fields = []
    with torch.inference_mode():
        for i in range(0, len(test), 16):
            batch = data.collate(test[i:i + 16])
            out = decoder.generate(pipelined.backbone, batch["input_ids"], batch["attention_mask"])
            fields.append((out.subsequences, out.decoder_calls, out.tokens, out.bound_hit))
    return fields


print(f"outputs identical: {outputs(old) == outputs(now)}")
for batch_size in (1, 16):
    batches = device_batches(data, test, batch_size, torch.device("cpu"))
    timings = time_decoders(modules, batches, torch.device("cpu"), "fp32", repeats=3)
    reference = timings["sequential"]
    ratio = reference.calls_per_example / timings["pipelined now"].calls_per_example
    print(f"batch {batch_size}: call ratio {ratio:.2f}; " + "; ".join(
        f"{name} {len(test) / timing.seconds:.1f} ex/s"
        + ("" if name == "sequential" else
           f" = {reference.seconds / timing.seconds:.2f}x "
           f"({reference.seconds / timing.seconds / ratio:.0%} of the call ratio)")
        for name, timing in timings.items()))
