"""Host-device synchronisation points per decoder call, for every decoder and transformers' generate.

    python -m tasks.bench.sync_points [--batch-size 8] [--steps 32] [--out FILE.json]

On a GPU a decoder step of a small T5 is a handful of kernel launches; every point where the host
must wait for the device (`.item()`, `.tolist()`, `bool(t)`, `int(t)`, `nonzero`, boolean-mask
indexing, `masked_select`) drains the queue and can cost more than the step itself. No GPU is needed
to find them: this counts them on the CPU, where the same Python and the same aten calls run.

What is counted, while one batch is decoded:
- aten calls that read a device value back to the host or whose output shape depends on values:
  `_local_scalar_dense` (behind `.item()`, `bool(t)`, `int(t)`, `float(t)`), `nonzero`,
  `masked_select`, `equal`, `is_nonzero`, and `index` / `index_put_` with a boolean mask
  (a `TorchDispatchMode` sees them wherever they are called from, transformers included);
- `Tensor.tolist()`, `Tensor.numpy()` and `Tensor.cpu()` calls (Python-level wrappers: on a CPU they
  are not aten calls at all).
Divided by the decoder calls the batch took (`DecodeOutput.batch_decoder_calls`; for `generate`,
the generated length). The model is a tiny random T5 whose outputs end at different steps, so
the finish-and-drop logic of every decoder runs; the same inputs go to every decoder.
"""
from __future__ import annotations

import argparse
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tasks.bench import counted_decodes, random_inputs, tiny_random_t5
from tasks.cli import show_report

_SYNCING_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "equal", "is_nonzero"}
_MASK_INDEXING_OPS = {"index", "index_put", "index_put_"}
_READBACK_METHODS = ("tolist", "numpy", "cpu")


def _op_name(func) -> str:
    return func._schema.name.split("::")[-1]


class _SyncCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _op_name(func)
        if name in _SYNCING_OPS:
            self.count += 1
        elif name in _MASK_INDEXING_OPS:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
                self.count += 1
        return func(*args, **kwargs)


@contextmanager
def counting_sync_points():
    """Yields a counter whose `.count` is the sync points seen inside the block."""
    counter = _SyncCounter()
    originals = {name: getattr(torch.Tensor, name) for name in _READBACK_METHODS}

    def wrap(name):
        original = originals[name]

        def readback(self, *args, **kwargs):
            if name != "cpu" or self.device.type != "cpu":   # .cpu() of a CPU tensor moves nothing
                counter.count += 1
            return original(self, *args, **kwargs)
        return readback
    try:
        for name in _READBACK_METHODS:
            setattr(torch.Tensor, name, wrap(name))
        with counter:
            yield counter
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def sync_points_per_call(model, input_ids, attention_mask, steps: int) -> dict[str, dict]:
    """{name: {"sync_points", "decoder_calls", "per_call"}} for `generate` and every decoder."""
    results = counted_decodes(model, input_ids, attention_mask, steps,
                              lambda decoder: counting_sync_points())
    return {name: {"sync_points": counter.count, "decoder_calls": calls,
                   "per_call": counter.count / max(calls, 1)}
            for name, (counter, calls) in results.items()}


def markdown(results: dict[str, dict], batch_size: int, steps: int) -> str:
    names = list(results)
    lines = [f"sync points per decoder call (tiny random T5, batch {batch_size}, bounds {steps})", "",
             "| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names),
             "| sync points per decoder call | "
             + " | ".join(f"{results[n]['per_call']:.2f}" for n in names) + " |",
             "| sync points | " + " | ".join(str(results[n]["sync_points"]) for n in names) + " |",
             "| decoder calls | " + " | ".join(str(results[n]["decoder_calls"]) for n in names) + " |"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32, help="every decoder's length/step bounds")
    parser.add_argument("--out", help="also write the table as JSON here (and markdown beside it)")
    args = parser.parse_args(argv)
    for flag, value in (("--batch-size", args.batch_size), ("--steps", args.steps)):
        if value < 1:
            parser.error(f"{flag}={value} must be >= 1")
    model = tiny_random_t5()
    input_ids, attention_mask = random_inputs(args.batch_size, model.config.vocab_size)
    results = sync_points_per_call(model, input_ids, attention_mask, args.steps)
    show_report(args.out, results, markdown(results, args.batch_size, args.steps))
    return results


if __name__ == "__main__":
    main()
