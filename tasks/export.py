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
from pathlib import Path

from tasks.cli import log, main_guard
from tasks.runs.restore import save_pretrained_folder


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="a checkpoint written by tasks.fit")
    parser.add_argument("--out", required=True, help="the folder to write (new, or empty)")
    args = parser.parse_args(argv)
    written = save_pretrained_folder(args.ckpt, args.out)
    log.info("wrote %s: transformers' AutoModelForSeq2SeqLM.from_pretrained(%r) loads it", written,
             str(written))
    return written


if __name__ == "__main__":
    main_guard(main)
