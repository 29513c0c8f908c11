"""Decode-only timing of trained models, shared by the benchmarks that time checkpoints
(`tasks.bench.gpu_benchmark`, `peers`, `pipelined_versions`): one decode timed on the GPU's own clock or the
host's, transformers' `generate` and CTranslate2's greedy decoding wrapped as decoders, and the
interleaved passes over the same prepared batches that every row is timed on.

On a CUDA device a decode is timed with CUDA events (no host sync inside the timed region other
than the decoder's own) and its memory by `max_memory_allocated`; elsewhere with the host clock and
the growth of the C heap (`tasks.comparison.measure.PeakMemory`). `precision="bf16"` decodes under
bf16 autocast.
"""
from __future__ import annotations

import inspect
import statistics
import tempfile
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from decoders.base import DecodeOutput, SpecialTokens
from decoders.loop import Stopwatch, flat_decode_output, through_end
from tasks.cli import source_commit
from tasks.comparison.measure import PeakMemory, compiled_warm_up, interleaved_passes
from tasks.config import ConfigError

PRECISIONS = ("fp32", "bf16")
CPU_NOTE = ("no CUDA device: timed on the CPU with the host clock (denormals flushed); these are "
            "not GPU figures")


def timing_conditions(device: torch.device, threads: int) -> dict:
    """What a result timed on `device` records of it: its name, the torch and CUDA versions, the
    library's commit (`source_commit`), and on a CPU the torch threads it runs with (set here to
    `threads`) and the note that the figures are not GPU figures."""
    cuda = device.type == "cuda"
    if not cuda:
        torch.set_num_threads(threads)
    return {"device": torch.cuda.get_device_name(device) if cuda else device.type,
            "note": "" if cuda else CPU_NOTE, "torch": torch.__version__,
            "cuda": torch.version.cuda if cuda else None, "threads": None if cuda else threads,
            "commit": source_commit()}


def conditions_caption(conditions: dict) -> str:
    """The start of a timed table's caption: the device, the torch version, the CUDA version or
    the CPU threads, and the library's commit where known."""
    return (f"{conditions['device']}, torch {conditions['torch']}"
            + (f", CUDA {conditions['cuda']}" if conditions["cuda"]
               else f", {conditions['threads']} thread(s)")
            + (f", commit {conditions['commit']}" if conditions.get("commit") else ""))


def timed(decoder, model, batch: dict, device: torch.device, precision: str):
    """(DecodeOutput, seconds) of one decode: CUDA events on a GPU, the host clock elsewhere."""
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16"
                else nullcontext())
    clock = Stopwatch(device)
    with torch.inference_mode(), autocast:
        with clock.timing():
            out = decoder.generate(model, batch["input_ids"], batch["attention_mask"])
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()   # the end event recorded, outside the timing
    return out, clock.total()


# `generate`'s extras beyond greedy decoding, switched off: a model's generation configuration
# (a checkpoint's generation_config.json, or defaults its model configuration implies, such as
# BART's forced end token) fills in every setting a call leaves unset, so a call sets each of them.
# The library's decoders do none of these; with them off, `generate` is the greedy decoding they
# are compared with and equal to.
PLAIN_GREEDY = {"do_sample": False, "num_beams": 1, "forced_bos_token_id": None,
                "forced_eos_token_id": None, "no_repeat_ngram_size": 0,
                "encoder_no_repeat_ngram_size": 0, "min_length": 0,
                "repetition_penalty": 1.0, "bad_words_ids": None, "suppress_tokens": None,
                "begin_suppress_tokens": None}


def cache_argument(model) -> str:
    """The name under which the model's `forward`, and so `generate`, takes a cache: `cache` in
    the later transformers 5 releases, `past_key_values` in the earlier ones (pyproject admits
    both)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class TransformersGenerate:
    """transformers' own greedy `generate` as a decoder, with the flat output of a sequential
    decoder bounded at `max_new_tokens`; with `prompt_lookup_num_tokens`, its prompt-lookup
    assisted decoding (which transformers runs at batch size 1 only)."""

    def __init__(self, max_new_tokens: int, special: SpecialTokens,
                 prompt_lookup_num_tokens: int | None = None):
        self.max_new_tokens = max_new_tokens
        self.special = special
        self.prompt_lookup_num_tokens = prompt_lookup_num_tokens

    def generate(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> DecodeOutput:
        lookup = ({} if self.prompt_lookup_num_tokens is None
                  else {"prompt_lookup_num_tokens": self.prompt_lookup_num_tokens})
        calls = []   # the model's decoder passes: the generated length for greedy, fewer when assisted
        counting = model.get_decoder().register_forward_pre_hook(lambda *_: calls.append(1))
        try:
            # an empty cache of its own: the one `generate` makes has a layer per encoder layer
            # (`num_layers`), and fails on a decoder deeper than its encoder (`num_decoder_layers`)
            cache = {cache_argument(model): EncoderDecoderCache(DynamicCache(), DynamicCache())}
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                 max_new_tokens=self.max_new_tokens, **PLAIN_GREEDY, **cache, **lookup)
        finally:
            counting.remove()
        # what follows an end token is padding
        rows = [through_end(row, self.special.eos) for row in out[:, 1:].tolist()]
        return flat_decode_output(rows, self.special, [len(calls)] * len(rows), len(calls))


# What CTranslate2 quantizes a converted model's weights to, for its rows (`CTranslate2Greedy`).
CTRANSLATE2_TYPES = ("float32", "int8")


def ctranslate2_package():
    """The `ctranslate2` module; a ConfigError saying how to install it where it is missing."""
    try:
        import ctranslate2
    except ImportError as err:
        raise ConfigError("CTranslate2's rows need the ctranslate2 package: "
                          "pip install -e \".[bench]\"") from err
    return ctranslate2


class CTranslate2Greedy:
    """CTranslate2's greedy decoding of a `save_pretrained` folder (`tasks.export`'s), as a decoder:
    an inference engine's C++ decoding loop, beside which this library's rows are timed. The
    folder is converted once (`quantization`: float32, or int8 weights); `generate` ignores its
    model argument, since the engine holds its own copy of the weights. Needs the `ctranslate2`
    package (`pip install -e ".[bench]"`)."""

    def __init__(self, folder: str, tokenizer, special: SpecialTokens, max_new_tokens: int,
                 quantization: str, device: torch.device, threads: int):
        ctranslate2 = ctranslate2_package()
        self.converted = tempfile.TemporaryDirectory(prefix="ctranslate2-")   # removed with this
        ctranslate2.converters.TransformersConverter(folder).convert(
            self.converted.name, quantization=quantization, force=True)
        self.translator = ctranslate2.Translator(
            self.converted.name, device=device.type,
            device_index=device.index or 0, intra_threads=threads if device.type == "cpu" else 0)
        self.tokenizer, self.special, self.max_new_tokens = tokenizer, special, max_new_tokens

    def generate(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> DecodeOutput:
        ids, lengths = input_ids.tolist(), attention_mask.sum(1).tolist()
        sources = [self.tokenizer.convert_ids_to_tokens(row[:n]) for row, n in zip(ids, lengths)]
        # greedy as `generate` is: the end token may come first (the engine's default minimum
        # length is 1), and no source is cut
        results = self.translator.translate_batch(
            sources, beam_size=1, max_decoding_length=self.max_new_tokens, min_decoding_length=0,
            max_input_length=max(lengths), return_end_token=True)
        rows = [self.tokenizer.convert_tokens_to_ids(result.hypotheses[0]) for result in results]
        calls = [len(row) for row in rows]   # one decoder step per token
        return flat_decode_output(rows, self.special, calls, max(calls))


@dataclass
class Timing:
    """One decoder timed over the batches: the seconds of every pass, its decoder calls per example,
    the peak memory of one more pass, and the outputs of the last timed pass, one per batch."""
    pass_seconds: list[float]
    calls_per_example: float
    peak_memory_mb: float
    outputs: list[DecodeOutput] = field(repr=False)

    @property
    def seconds(self) -> float:
        return statistics.median(self.pass_seconds)

    def speedups_over(self, reference: "Timing") -> list[float]:
        """Per timing pass, the reference's seconds over this decoder's: the ratio measured side
        by side (pass r of every decoder ran in the same stretch of time)."""
        return [theirs / ours for theirs, ours in zip(reference.pass_seconds, self.pass_seconds)]

    def subsequences(self) -> list[list[list[int]]]:
        return [subs for out in self.outputs for subs in out.subsequences]


def time_decoders(modules: dict, batches: list[dict], device: torch.device, precision: str,
                  repeats: int) -> dict[str, Timing]:
    """Every module of `modules` (name -> an object with `.decoder` and `.backbone`) timed on the
    same `batches` (already on `device`): a warm-up decode each (for a decoder that compiles its
    calls, passes over every batch until nothing new compiles: `compiled_warm_up`), then `repeats`
    passes, the modules taking turns on each batch (`interleaved_passes`) so that the machine's
    drifts touch all of them alike."""
    timers = {name: partial(timed, module.decoder, module.backbone, device=device, precision=precision)
              for name, module in modules.items()}
    for name, module in modules.items():
        if getattr(module.decoder, "compiled_calls", False):
            compiled_warm_up(timers[name], batches)
        else:
            timers[name](batches[0])
    passes = interleaved_passes(timers, batches, repeats)
    seconds = {name: [sum(s for _, s in runs) for runs in passes[name]] for name in modules}
    outputs = {name: [out for out, _ in passes[name][-1]] for name in modules}
    examples = sum(b["input_ids"].size(0) for b in batches)
    timings = {}
    for name, module in modules.items():
        with PeakMemory(device) as memory:
            for batch in batches:
                timed(module.decoder, module.backbone, batch, device, precision)
        calls = sum(sum(out.decoder_calls) for out in outputs[name])
        timings[name] = Timing(seconds[name], calls / examples, memory.peak_mb, outputs[name])
    return timings
