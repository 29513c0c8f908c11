"""Benchmarks, one command per module; shared here: the tiny random T5 they decode, its inputs, the
decoders' bounds, one counted decode of a batch by every decoder and by transformers' generate, and
a trained checkpoint restored under a row's decoder.

The model's outputs end at different steps, so the finish-and-drop logic of every decoder runs;
the same inputs go to every decoder.
"""
from __future__ import annotations

import sys
from typing import Callable, ContextManager

import torch
from transformers import T5Config, T5ForConditionalGeneration

from decoders import SpecialTokens, available, build_decoder, decoder_class
from decoders.aggressive import AggressiveDecoder
from tasks.comparison.plan import row_settings
from tasks.runs.restore import restore_with_decoder

SPECIAL = SpecialTokens(pad=0, eos=1, unk=2, sep=3, mask=4, start=0)
GENERATE = "transformers generate"


def tiny_random_t5(vocab: int = 64, seed: int = 0) -> T5ForConditionalGeneration:
    """A tiny random T5 (the tests' fixture): a large init scale gives varied tokens, and the end
    token's output row is pointed at the model's favourite token so outputs end after a few steps."""
    torch.manual_seed(seed)
    config = T5Config(vocab_size=vocab, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
                      num_decoder_layers=2, dropout_rate=0.0, decoder_start_token_id=0,
                      pad_token_id=0, eos_token_id=1, initializer_factor=6.0)
    model = T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        favourite = model.lm_head.weight.norm(dim=1)[5:].argmax() + 5
        model.lm_head.weight[SPECIAL.eos] = model.lm_head.weight[favourite] * 1.02
    return model


def random_inputs(batch_size: int, vocab: int, seed: int = 1):
    """Encoder inputs of different lengths (right-padded), ids drawn above the special tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 13, (batch_size,), generator=g)
    input_ids = torch.zeros(batch_size, int(lengths.max()), dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        input_ids[i, :n] = torch.randint(5, vocab, (n,), generator=g)
    return input_ids, (input_ids != 0).long()


def replace_backbone_calls(replacements: dict[str, Callable]) -> None:
    """Make every decoder module call `replacements[name]` where it calls `decoders.backbone.name`:
    each imported the backbone's functions under their own names (and importing `decoders` imported
    every decoder module, to register it), so they are replaced there."""
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("decoders.") and module_name != "decoders.backbone":
            for name, function in replacements.items():
                if hasattr(module, name):
                    setattr(module, name, function)


def bounded(name: str, steps: int) -> dict:
    """Every length/step bound of decoder `name` set to `steps` (its `max_*` options)."""
    return {key: steps for key in decoder_class(name).options if key.startswith("max_")}


def with_drafter(decoder, model):
    """`decoder`, ready to decode `model`: a decoder that drafts with a model of its own (aggressive)
    gets a random Mask-Predict drafter on a tiny random T5 of `model`'s vocabulary and dtype."""
    if isinstance(decoder, AggressiveDecoder):
        drafter_model = tiny_random_t5(model.config.vocab_size, seed=1).to(model.dtype)
        drafter = build_decoder("nar", drafter_model.config, decoder.special,
                                max_new_tokens=decoder.max_new_tokens).to(model.dtype).eval()
        decoder.attach_drafter(drafter, drafter_model)
    return decoder


def counted_decodes(model, input_ids, attention_mask, steps: int,
                    counting: Callable[[object], ContextManager]) -> dict[str, tuple[object, int]]:
    """{name: (counter, decoder calls)} for transformers' greedy `generate` and every registered
    decoder, each decoding the batch once with every bound `steps` inside `counting(decoder)` (the
    decoder; None for `generate`), whose yielded counter is returned. Each decoder decodes the batch once before it is counted, so that
    lazy initialisations are not; `generate`'s calls are its generated length."""
    results = {}
    with torch.no_grad():
        with counting(None) as counter:
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                 num_beams=1, max_new_tokens=steps)
        results[GENERATE] = (counter, out.size(1) - 1)
        for name in available():
            decoder = with_drafter(build_decoder(name, model.config, SPECIAL, **bounded(name, steps)),
                                   model).eval()
            decoder.generate(model, input_ids, attention_mask)
            with counting(decoder) as counter:
                out = decoder.generate(model, input_ids, attention_mask)
            results[name] = (counter, out.batch_decoder_calls)
    return results


def restored(name: str, path: str, drafter: str | None = None):
    """(configuration, `Built`) of the checkpoint at `path`, decoded by decoder `name` where `name`
    is a registered decoder (one of the trained layout; else by the decoder it was trained with),
    drafting with the checkpoint `drafter` where that decoder drafts with another model. `name`
    may carry decode-time settings as a comparison's row labels show them
    (`aggressive(redraft=outgrown)`, `row_settings`)."""
    decoder, settings = row_settings(name)
    return restore_with_decoder(path, decoder if decoder in available() else None, drafter, settings)
