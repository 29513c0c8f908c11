"""ATen operations per decoder call, inside and outside the model, for every decoder and transformers' generate.

    python -m tasks.bench.op_counts [--batch-sizes 1,8] [--steps 32] [--out FILE.json]

On a GPU every ATen operation of a decoding loop is a kernel launch (or at least a trip through
the dispatcher), so the bookkeeping a loop does around the model costs time even where it waits
for nothing. This counts, while one batch is decoded, every ATen call a `TorchDispatchMode` sees,
split in two:
- model: calls made inside the forward of the T5 modules every decoder runs: the encoder, the
  decoder's token embedding, each decoder block, the decoder's final norm and the output head
  (`model_modules`), and inside a decoder's model step (`Decoder.model_step`, which runs T5's
  decoder layers itself). Forward hooks keep a depth count, so a module called inside another
  counts once.
- drafter: for a decoder that drafts with a model of its own (aggressive's Mask-Predict drafter),
  every call made while it drafts (`drafter_work`): its first draft and its re-drafts, the drafter
  model's passes and their inputs: a decoding by another model, whose loop the `nar` row counts on
  its own.
- loop: every other call: the decoding loop's bookkeeping, its attention biases and masks, and the
  glue between the model's parts (for `generate`, transformers' own loop and mask building); for a
  drafting decoder, the drafts' verification and which rows to draft again.
Divided by the decoder calls the batch took (`tasks.bench.counted_decodes`). The model is `tasks.bench`'s tiny random T5; a batch of size B is the B
examples of one random batch of the largest size that `generate` decodes longest
(`longest_decoding`), so that a small batch's count is not one decode's set-up spread over a
couple of calls.
"""
from __future__ import annotations

import argparse
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tasks.bench import counted_decodes, random_inputs, tiny_random_t5
from tasks.cli import show_report


class OpCounter(TorchDispatchMode):
    """Counts ATen calls: as `drafter` while `drafting` > 0 (the drafter's model or passes are
    running), else as `model` while `depth` > 0 (some hooked module's forward is running), and as
    `loop` otherwise."""

    def __init__(self):
        super().__init__()
        self.depth = self.drafting = 0
        self.model = self.drafter = self.loop = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.drafting > 0:
            self.drafter += 1
        elif self.depth > 0:
            self.model += 1
        else:
            self.loop += 1
        return func(*args, **(kwargs or {}))


def drafter_work(decoder) -> tuple[list[nn.Module], list[tuple[object, str]]]:
    """What a decoder that drafts with a model of its own (an `attached` drafter: aggressive) runs
    as that drafter: the drafter model's modules, and the methods that draft: the decoder's first
    draft and re-drafts, the drafter's Mask-Predict passes. Nothing for any other decoder."""
    attached = getattr(decoder, "attached", None)
    if attached is None:
        return [], []
    return model_modules(attached.model), [(decoder, "begin_drafts"), (decoder, "draft_again"),
                                           (attached.decoder, "mask_predict"),
                                           (attached.decoder, "predict_outputs")]


@contextmanager
def counting_ops(modules: Iterable[nn.Module],
                 drafter: tuple[list[nn.Module], list[tuple[object, str]]] = ([], []),
                 decoder=None) -> Iterator[OpCounter]:
    """Yields an `OpCounter` for the block, whose calls inside the forward of any of `modules`
    or inside the model step of `decoder` (if given) count as the model's, and those inside the
    forward of the drafter's modules or one of its (object, method name) pairs (`drafter_work`) as
    the drafter's."""
    counter = OpCounter()

    def entering(depth: str):
        def enter(*args):
            setattr(counter, depth, getattr(counter, depth) + 1)
        return enter

    def leaving(depth: str):
        def leave(*args):
            setattr(counter, depth, getattr(counter, depth) - 1)
        return leave

    def hook(hooked: Iterable[nn.Module], depth: str) -> list:
        return [handle for module in hooked
                for handle in (module.register_forward_pre_hook(entering(depth)),
                               module.register_forward_hook(leaving(depth)))]

    drafter_modules, drafter_methods = drafter
    handles = hook(modules, "depth") + hook(drafter_modules, "drafting")
    patched = [(owner, name, bracketed(getattr(owner, name), entering("drafting"), leaving("drafting")))
               for owner, name in drafter_methods]
    if decoder is not None:
        step = decoder.model_step
        patched.append((decoder, "model_step",
                        lambda: bracketed(step(), entering("depth"), leaving("depth"))))
    try:
        for owner, name, wrapped in patched:
            setattr(owner, name, wrapped)
        with counter:
            yield counter
    finally:
        for handle in handles:
            handle.remove()
        for owner, name, _ in patched:
            delattr(owner, name)   # the method is the class's again


def bracketed(method, enter, leave):
    """`method`, calling `enter` before and `leave` after it."""
    def wrapped(*args, **kwargs):
        enter()
        try:
            return method(*args, **kwargs)
        finally:
            leave()
    return wrapped


def model_modules(model) -> list[nn.Module]:
    """The T5 modules whose work is the model's: the encoder, the decoder's token embedding, its
    blocks and final norm, and the output head."""
    decoder = model.decoder
    return [model.get_encoder(), decoder.embed_tokens, *decoder.block, decoder.final_layer_norm,
            model.lm_head]


def ops_per_call(model, input_ids, attention_mask, steps: int) -> dict[str, dict]:
    """{name: {"loop_ops", "model_ops", "drafter_ops", "decoder_calls" and each ops count per call
    ("loop_per_call", ...)}} for `generate` and every registered decoder, decoding one batch with
    every bound `steps`."""
    modules = model_modules(model)
    results = counted_decodes(model, input_ids, attention_mask, steps,
                              lambda decoder: counting_ops(modules, drafter_work(decoder), decoder))
    return {name: {"loop_ops": counter.loop, "model_ops": counter.model,
                   "drafter_ops": counter.drafter, "decoder_calls": calls,
                   **{f"{part}_per_call": getattr(counter, part) / max(calls, 1)
                      for part in ("loop", "model", "drafter")}}
            for name, (counter, calls) in results.items()}


def longest_decoding(model, input_ids, attention_mask, count: int, steps: int):
    """The `count` examples of the batch whose greedy `generate` (at most `steps` tokens) runs
    longest, in batch order, their padding cropped to the longest of them."""
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                             num_beams=1, max_new_tokens=steps)[:, 1:]
    # tokens up to and including the first end token (all of them where there is none)
    is_end = (out == model.config.eos_token_id).long()
    ended = is_end.cumsum(1) - is_end
    length = (ended == 0).sum(1)                                              # (B,)
    chosen = torch.sort(torch.argsort(length, descending=True, stable=True)[:count]).values
    width = int(attention_mask[chosen].sum(1).max())
    return input_ids[chosen, :width], attention_mask[chosen, :width]


def markdown(results: dict[int, dict[str, dict]], steps: int) -> str:
    lines = [f"ATen ops per decoder call, outside (loop) and inside (model) the T5 modules, and in a "
             f"drafter's own model and passes (tiny random T5s, every bound {steps})", "",
             "| decoder | batch size | loop ops per call | model ops per call | drafter ops per call "
             "| decoder calls |",
             "|---|---|---|---|---|---|"]
    for batch_size, rows in results.items():
        for name, row in rows.items():
            drafter = f"{row['drafter_per_call']:.1f}" if row["drafter_ops"] else "–"
            lines.append(f"| {name} | {batch_size} | {row['loop_per_call']:.1f} | "
                         f"{row['model_per_call']:.1f} | {drafter} | {row['decoder_calls']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=32, help="every decoder's length/step bounds")
    parser.add_argument("--out", help="also write the table as JSON here (and markdown beside it)")
    args = parser.parse_args(argv)
    try:
        batch_sizes = [int(size) for size in args.batch_sizes.split(",")]
    except ValueError:
        parser.error(f"--batch-sizes={args.batch_sizes} must be comma-separated integers")
    for flag, value in [("--steps", args.steps)] + [("--batch-sizes", size) for size in batch_sizes]:
        if value < 1:
            parser.error(f"{flag}: {value} must be >= 1")
    # random weights drift into denormal floats, which a CPU handles in slow paths: flushing them
    # changes no op count, only how long counting takes
    torch.set_flush_denormal(True)
    model = tiny_random_t5()
    pool = random_inputs(max(batch_sizes), model.config.vocab_size)
    results = {}
    for batch_size in batch_sizes:
        inputs = longest_decoding(model, *pool, batch_size, args.steps)
        results[batch_size] = ops_per_call(model, *inputs, args.steps)
    show_report(args.out, {"steps": args.steps, "batch_sizes": results}, markdown(results, args.steps))
    return results


if __name__ == "__main__":
    main()
