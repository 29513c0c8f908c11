"""Tokenizers: trained locally for `t5-tiny`, loaded with `from_pretrained` for pretrained T5.

Both follow T5's conventions (pad=0, eos=1, unk=2) and carry two extra special tokens the decoders
need: `<sep>` (joins subsequences in the flat layout) and `<mask>` (non-autoregressive decoding).
A trained tokenizer is cached on disk under a key made of the training texts and the settings, so a
second run with the same data reuses it instead of training again.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from decoders.base import SpecialTokens

log = logging.getLogger(__name__)

PAD, EOS, UNK, SEP, MASK = "<pad>", "</s>", "<unk>", "<sep>", "<mask>"
SPECIAL_TOKENS = [PAD, EOS, UNK, SEP, MASK]  # ids 0..4 in a trained tokenizer
TOKENIZER_FORMAT = "bpe-metaspace-v1"   # bump when the training recipe changes


class TokenizerError(RuntimeError):
    """A tokenizer could not be trained or loaded; the message says what to do."""


def _wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD, eos_token=EOS,
                                   unk_token=UNK, additional_special_tokens=[SEP, MASK])


def _train(texts: list[str], vocab_size: int) -> Tokenizer:
    # BPE, not T5's own Unigram: on a corpus with fewer distinct words than `vocab_size` (the
    # built-in data, small real samples) the Unigram trainer stopped at a few hundred pieces and cut
    # words into letters (3.85 tokens per keyphrase word), while BPE merges up to whole words
    # (1.00): targets, and so every decoder's work, were almost four times longer than needed.
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def train_or_load(texts: Iterable[str], vocab_size: int, cache_dir: str | os.PathLike) -> PreTrainedTokenizerFast:
    """A subword tokenizer for `texts`, trained once and then read from `cache_dir`."""
    texts = list(texts)
    key = hashlib.sha256(f"{TOKENIZER_FORMAT}|{vocab_size}|".encode())
    for text in texts:
        key.update(text.encode("utf-8", "replace"))
        key.update(b"\n")
    path = Path(cache_dir) / f"tokenizer-{key.hexdigest()[:16]}.json"
    if path.exists():
        log.info("reusing cached tokenizer %s", path)
        return _wrap(Tokenizer.from_file(str(path)))
    log.info("training a %d-piece tokenizer on %d texts", vocab_size, len(texts))
    tokenizer = _train(texts, vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    # write to a temporary name, then rename: a crash never leaves a half-written cache entry
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as tmp:
        tmp.write(tokenizer.to_str())
    os.replace(tmp.name, path)
    return _wrap(tokenizer)


def from_serialized(tokenizer_json: str) -> PreTrainedTokenizerFast:
    """Rebuild a trained tokenizer from the JSON stored in a checkpoint."""
    return _wrap(Tokenizer.from_str(tokenizer_json))


def load_pretrained(hub_id: str) -> PreTrainedTokenizerFast:
    from datamodules.hub import hub_access, load_failure  # imports `datasets`: only for hub models
    with hub_access() as unreachable:
        try:
            tokenizer = AutoTokenizer.from_pretrained(hub_id)
        except OSError as err:
            raise TokenizerError(f"cannot load the tokenizer of {hub_id!r}: "
                                 f"{load_failure(err, unreachable)}. Use model=t5-tiny to work "
                                 f"offline.") from err
    missing = [t for t in (SEP, MASK) if t not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_special_tokens({"additional_special_tokens": missing})
    return tokenizer


def special_tokens(tokenizer: PreTrainedTokenizerFast) -> SpecialTokens:
    ids = tokenizer.convert_tokens_to_ids
    return SpecialTokens(pad=tokenizer.pad_token_id, eos=tokenizer.eos_token_id,
                         unk=tokenizer.unk_token_id, sep=ids(SEP), mask=ids(MASK),
                         start=tokenizer.pad_token_id)
