"""Write a trained model as the folder transformers' `save_pretrained` writes, with its tokenizer.

    python -m tasks.export --ckpt CKPT --out DIR

A checkpoint of the sequential layout exports its backbone: a sequential fit's, or a blockwise
fit's (its base head is that layout's; the proposal heads stay behind). transformers, CTranslate2's
converter or any tool that reads such folders then loads it, and transformers' greedy `generate`
on it, given only the inputs, writes exactly the library's sequential decoder's tokens: the
folder's generation configuration names the start, end and pad tokens and the output bound
(`decoder.max_new_tokens`). A checkpoint of another layout is refused: pipelined writes its
subsequences at their own grid positions and nar fills every position at once, which `generate`
cannot decode. DIR must not exist or be empty; it is written under a temporary name, then renamed,
so no half-written folder is ever left there.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from transformers import GenerationConfig

from datamodules.tokenizer import special_tokens
from decoders import decoder_class
from tasks.cli import log, main_guard
from tasks.config import ConfigError
from tasks.runs.checkpoints import load_checkpoint
from tasks.runs.restore import checkpoint_config, restore_module

# The decoder whose output the exported folder's `generate` reproduces, and whose layout a
# checkpoint must have been trained on.
EXPORTED_LAYOUT = "sequential"


def check_exportable(checkpoint: dict, path: str) -> None:
    """Refuse (ConfigError) a checkpoint whose model transformers' `generate` cannot decode."""
    trained = checkpoint.get("decoder_name", checkpoint["hyper_parameters"]["cfg"]["decoder"]["name"])
    if not decoder_class(EXPORTED_LAYOUT).can_decode_checkpoint_of(decoder_class(trained)):
        raise ConfigError(f"checkpoint {path} was trained with decoder {trained!r}, whose model "
                          f"transformers' generate cannot decode (it writes its output in another "
                          f"layout than one token after another); only a checkpoint of the "
                          f"sequential layout exports: sequential, blockwise")


def usable_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out}: exists and is not an empty folder; give a new one")


def export(path: str, out: str) -> Path:
    """Write checkpoint `path`'s backbone and tokenizer to the folder `out` (see the module
    docstring); returns it."""
    target = Path(out)
    usable_out(target)
    checkpoint = load_checkpoint(path)
    check_exportable(checkpoint, path)
    cfg = checkpoint_config(checkpoint, path, [f"decoder={EXPORTED_LAYOUT}"])
    module = restore_module(checkpoint, path, cfg)
    special = special_tokens(module.tokenizer)
    backbone = module.backbone
    backbone.generation_config = GenerationConfig(
        decoder_start_token_id=special.start, eos_token_id=special.eos, pad_token_id=special.pad,
        max_new_tokens=int(cfg.decoder.max_new_tokens), do_sample=False, num_beams=1)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        backbone.save_pretrained(staging)
        module.tokenizer.save_pretrained(staging)
        if target.exists():
            target.rmdir()   # empty (`usable_out`)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="a checkpoint written by tasks.fit")
    parser.add_argument("--out", required=True, help="the folder to write (new, or empty)")
    args = parser.parse_args(argv)
    written = export(args.ckpt, args.out)
    log.info("wrote %s: transformers' AutoModelForSeq2SeqLM.from_pretrained(%r) loads it", written,
             str(written))
    return written


if __name__ == "__main__":
    main_guard(main)
