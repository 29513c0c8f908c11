"""This library's exact decoders beside transformers' own fast paths, on the same trained model.

    python -m tasks.bench.peers --ckpt SEQUENTIAL.ckpt [--blockwise BLOCKWISE.ckpt] \\
        [--pipelined PIPELINED.ckpt] [--ctranslate2] [--compiled] [--batch-size 16] [--prompt-lookup 4,10] [--precision fp32|bf16] \\
        [--repeats 3] [--examples N] [--single-examples N] [--threads 1] [--out FILE.json]

On the checkpoint's test inputs, timed side by side (interleaved, median of `--repeats` passes
after a warm-up; on a CPU with `--threads` torch threads and denormals flushed):
- transformers' greedy `generate` (the reference of every ratio and of "identical");
- `generate(prompt_lookup_num_tokens=K)` for every K of `--prompt-lookup`: transformers' prompt
  lookup, which on an encoder-decoder model matches n-grams of the decoder's own tokens only, and
  which transformers refuses at batch size above 1;
- this library's sequential and lookup decoders on the same weights, and its blockwise decoder
  on the `--blockwise` checkpoint (heads trained on that sequential model) when given: where that
  checkpoint's backbone equals the sequential one's (trained frozen), on the same weights too;
- with `--pipelined`, the library's pipelined decoder on a pipelined checkpoint of the same task:
  a model of its own, trained on the pipelined layout, so its tokens are not greedy `generate`'s;
- with `--compiled`, each of the library's rows followed by its compiled twin
  (`decoder.compile=true`; its steps compiled for fixed shapes, in the warm-up);
- with `--ctranslate2`, the inference engine CTranslate2's greedy decoding of the same weights
  (exported as `tasks.export` exports them, then converted), float32 and int8
  (`pip install -e ".[bench]"`).
At batch size 1 every row runs; at `--batch-size` every row that can. Per row: whether its tokens
equal greedy `generate`'s on every example, its quality (the task's main test metric on the
examples it decoded), the model's decoder passes per example, its speed over greedy `generate`'s
and its peak memory (on CUDA `max_memory_allocated`, on a CPU the growth
of the C heap). Without CUDA the figures are CPU figures and the output says so.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

from tasks.bench import restored
from tasks.comparison.measure import device_batches, flushed_denormals, scored
from tasks.comparison.report import primary_metric, speedup_cell
from tasks.comparison.timing import (CTRANSLATE2_TYPES, PRECISIONS, CTranslate2Greedy,
                                     TransformersGenerate, conditions_caption, ctranslate2_package,
                                     time_decoders, timing_conditions)
from tasks.config import ConfigError
from tasks.cli import command_line, log, main_guard, show_report
from tasks.runs.restore import save_pretrained_folder

GREEDY = "transformers greedy"
PIPELINED = "pipelined"


def compiled_name(name: str) -> str:
    """The row of a library decoder compiled (`decoder.compile=true`)."""
    return f"{name}(compile=true)"


def prompt_lookup_name(tokens: int) -> str:
    return f"transformers prompt lookup {tokens}"


def ctranslate2_name(quantization: str) -> str:
    return f"CTranslate2 greedy {quantization}"


def ctranslate2_rows(checkpoint: str, sequential, device, threads: int, folder: Path) -> dict:
    """CTranslate2's rows: the checkpoint exported to `folder`, then converted once per
    quantization (`CTranslate2Greedy`)."""
    exported = str(save_pretrained_folder(checkpoint, str(folder / "exported")))
    decoder = sequential.decoder
    return {ctranslate2_name(quantization): SimpleNamespace(
        decoder=CTranslate2Greedy(exported, sequential.tokenizer, decoder.special,
                                  decoder.max_new_tokens, quantization, device, threads),
        backbone=sequential.backbone) for quantization in CTRANSLATE2_TYPES}


def same_inputs(flag: str, path: str, cfg, built, reference_cfg, reference):
    """The task module of checkpoint `path`, refused (ConfigError) unless it was trained for the
    --ckpt checkpoint's task with its tokenizer: every row decodes the same token ids."""
    if cfg.task.name != reference_cfg.task.name:
        raise ConfigError(f"{flag} {path} was trained for task {cfg.task.name!r}, --ckpt for "
                          f"{reference_cfg.task.name!r}; every row decodes the same test inputs")
    if built.datamodule.tokenizer.get_vocab() != reference.datamodule.tokenizer.get_vocab():
        raise ConfigError(f"{flag} {path} has another tokenizer than the --ckpt checkpoint; every "
                          f"row decodes the same token ids")
    return built.module


def same_weights(backbone, other) -> bool:
    """Whether two backbones hold equal weights under the same names."""
    ours, theirs = backbone.state_dict(), other.state_dict()
    return ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def positive_integers(flag: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError as err:
        raise ConfigError(f"{flag} {text!r}: comma-separated integers") from err
    if min(values) < 1:
        raise ConfigError(f"{flag} {text!r}: every value must be >= 1")
    return values


def rows_at(batch_size: int, modules: dict, cfg, datamodule, examples: int | None, device,
            precision: str, repeats: int) -> list[dict]:
    """Every module timed at `batch_size` on the same batches, the first `examples` test examples;
    ratios and "identical" against greedy `generate`, the first module; each scored."""
    test = datamodule.dataset("test").examples[:examples]
    batches = device_batches(datamodule, test, batch_size, device)
    timings = time_decoders(modules, batches, device, precision, repeats)
    reference = timings[GREEDY]
    records = datamodule.records("test")[:len(test)]
    return [{"decoder": name, "batch_size": batch_size,
             "identical_to_greedy": timing.subsequences() == reference.subsequences(),
             **scored(cfg, datamodule.tokenizer, timing, records),
             "decoder_calls_per_example": timing.calls_per_example,
             "examples_per_second": len(test) / timing.seconds,
             "speed_vs_greedy": reference.seconds / timing.seconds,
             "speed_vs_greedy_passes": timing.speedups_over(reference),
             "peak_memory_mb": timing.peak_memory_mb}
            for name, timing in timings.items()]


def markdown(result: dict) -> str:
    caption = (conditions_caption(result)
               + f", precision {result['precision']}, {result['task']}, {result['examples']} test "
               f"examples (batch size 1: the first {result['single_examples']}), median of "
               f"{result['repeats']} passes")
    if result["note"]:
        caption += f"; {result['note']}"
    primary = result["primary_metric"]
    lines = [caption, "", f"| decoder | batch | identical to greedy | {primary} | calls/ex | ex/s | "
             "vs greedy (lowest–highest pass) | peak MB |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['decoder']} | {r['batch_size']} | "
                     f"{'yes' if r['identical_to_greedy'] else 'NO'} | {r['quality'][primary]:.3f} | "
                     f"{r['decoder_calls_per_example']:.1f} | {r['examples_per_second']:.1f} | "
                     f"{speedup_cell(r, 'speed_vs_greedy')} | {r['peak_memory_mb']:.1f} |")
    if any(r["decoder"] in (PIPELINED, compiled_name(PIPELINED)) for r in result["rows"]):
        lines += ["", "pipelined decodes a pipelined checkpoint of the same task, a model of its own: "
                  "its tokens are not greedy `generate`'s, and its quality column is what to compare."]
    if result.get("sequential_weights"):
        rows = ", ".join(result["sequential_weights"])
        lines += ["", f"{rows}: its checkpoint's backbone equals the sequential checkpoint's (trained "
                  "frozen), so it decodes that one copy of the weights, with its own heads."]
    if any(r["decoder"].endswith(compiled_name("")) for r in result["rows"]):
        lines += ["", "The library's rows run their decoder steps eager, those named `(compile=true)` "
                  "compiled (`decoder.compile=true`)."]
    lines += ["", f"transformers' prompt lookup runs at batch size 1 only (\"assisted generate is "
              f"only supported for batch_size = 1\"): it has no row at batch size "
              f"{result['batch_size']}.", "", f"Command: `{result['command']}`"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="a sequential checkpoint written by tasks.fit")
    parser.add_argument("--blockwise", default=None, help="a blockwise checkpoint (heads on it)")
    parser.add_argument("--pipelined", default=None,
                        help="a pipelined checkpoint of the same task (its own row)")
    parser.add_argument("--ctranslate2", action="store_true",
                        help="add CTranslate2's greedy rows, float32 and int8 (needs ctranslate2)")
    parser.add_argument("--compiled", action="store_true",
                        help="add each library row compiled (decoder.compile=true) after it")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--prompt-lookup", default="4,10",
                        help="prompt_lookup_num_tokens settings of transformers' rows")
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--examples", type=int, default=None, help="first N test examples (all)")
    parser.add_argument("--single-examples", type=int, default=None,
                        help="time batch size 1 on the first N of those (all)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on a CPU")
    parser.add_argument("--out", default="results/peers.json")
    args = parser.parse_args(argv)
    lookups = positive_integers("--prompt-lookup", args.prompt_lookup)
    for flag, value in (("--batch-size", args.batch_size), ("--repeats", args.repeats),
                        ("--examples", 1 if args.examples is None else args.examples),
                        ("--single-examples",
                         1 if args.single_examples is None else args.single_examples),
                        ("--threads", args.threads)):
        if value < 1:
            raise ConfigError(f"{flag}: must be >= 1, got {value}")
    if args.ctranslate2:
        ctranslate2_package()   # installed: before any model is read
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    conditions = timing_conditions(device, args.threads)
    if conditions["note"]:
        log.warning(conditions["note"])
    cfg, built = restored("sequential", args.ckpt)
    sequential = built.module.to(device).eval()
    bound, special = sequential.decoder.max_new_tokens, sequential.decoder.special
    batched = {GREEDY: SimpleNamespace(decoder=TransformersGenerate(bound, special),
                                       backbone=sequential.backbone)}
    # the library's rows, each followed by its compiled twin where --compiled; the rows of the
    # sequential checkpoint decode its one copy of the weights, as transformers' rows do, and so
    # does a checkpoint whose backbone is that one: a row on a copy of its own would find its
    # weights colder in the CPU's caches than the others do
    shared = []   # rows of another checkpoint whose backbone is the sequential one's
    for name, flag, path in (("sequential", None, args.ckpt), ("lookup", None, args.ckpt),
                             ("blockwise", "--blockwise", args.blockwise),
                             (PIPELINED, "--pipelined", args.pipelined)):
        if not path:
            continue
        for row in (name, compiled_name(name)) if args.compiled else (name,):
            if row == "sequential":
                batched[row] = sequential
            elif flag is None:
                decoder = restored(row, path)[1].module.decoder.to(device).eval()
                batched[row] = SimpleNamespace(decoder=decoder, backbone=sequential.backbone)
            else:
                module = same_inputs(flag, path, *restored(row, path), cfg, built).to(device).eval()
                if same_weights(module.backbone, sequential.backbone):
                    # heads trained on the sequential model frozen: its one copy of the weights too
                    module = SimpleNamespace(decoder=module.decoder, backbone=sequential.backbone)
                    shared.append(row)
                batched[row] = module
    if args.ctranslate2:
        exported = tempfile.TemporaryDirectory(prefix="peers-")   # removed when the run ends
        batched.update(ctranslate2_rows(args.ckpt, sequential, device, args.threads,
                                        Path(exported.name)))
    single = {GREEDY: batched[GREEDY],
              **{prompt_lookup_name(k): SimpleNamespace(
                  decoder=TransformersGenerate(bound, special, prompt_lookup_num_tokens=k),
                  backbone=sequential.backbone) for k in lookups},
              **{name: module for name, module in batched.items() if name != GREEDY}}
    datamodule = built.datamodule
    test = datamodule.dataset("test").examples[:args.examples]
    single_examples = len(test[:args.single_examples])
    with flushed_denormals(device):
        rows = (rows_at(1, single, cfg, datamodule, single_examples, device, args.precision,
                        args.repeats)
                + rows_at(args.batch_size, batched, cfg, datamodule, len(test), device,
                          args.precision, args.repeats))
    result = {**conditions, "task": cfg.task.name, "precision": args.precision, "repeats": args.repeats,
              "examples": len(test), "single_examples": single_examples,
              "primary_metric": primary_metric(cfg.task.name),
              "batch_size": args.batch_size, "rows": rows, "sequential_weights": shared,
              "command": command_line("tasks.bench.peers", argv)}
    show_report(args.out, result, markdown(result))
    return result


if __name__ == "__main__":
    main_guard(main)
