"""Tokenizers: trained locally for a model built here (`t5-tiny`, `bart-tiny`, ...), loaded with
`from_pretrained` for a pretrained one (from the hub or from a local folder).

A trained one is laid out as its model family's tokenizers are (`LAYOUTS`: T5's pad=0, eos=1,
unk=2; BART's <s>, <pad>, </s>, <unk> and its `<s> ... </s>` template; mBART's language code after
the end token; Marian's pad as the last id), and every one carries two extra special tokens the
decoders need: `<sep>` (joins subsequences in the flat layout) and `<mask>` (non-autoregressive
decoding).
A trained tokenizer is cached on disk under a key made of the training texts and the settings, so a
second run with the same data reuses it instead of training again. It writes any text: a character
it did not see in training is written as its UTF-8 bytes (byte fallback), and decoding gives back
the text as it was (no normalization), U+2581 "▁" aside, which reads back as a space (it stands for
one in the pieces). Special-token names in a text ("</s>", "<sep>") are text, not special tokens.
Either kind is stored in a checkpoint (`serialize`) and rebuilt from it (`from_serialized`), so that
a checkpoint is used without the model's folder or the hub.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from typing import NamedTuple

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from datamodules.vocabulary import SpecialTokens

log = logging.getLogger(__name__)

PAD, EOS, UNK, SEP, MASK, BOS = "<pad>", "</s>", "<unk>", "<sep>", "<mask>", "<s>"
SPECIAL_TOKENS = [PAD, EOS, UNK, SEP, MASK]  # ids 0..4 in a trained tokenizer of T5's layout
TOKENIZER_FORMAT = "bpe-metaspace-bytefallback-v2"   # bump when the training recipe changes
# Pieces for single bytes: a character the training texts lacked is written as its UTF-8 bytes
# instead of <unk> (SentencePiece's byte fallback); ordinary pieces, not special tokens, so that
# decoding with skip_special_tokens keeps them.
BYTE_PIECES = [f"<0x{byte:02X}>" for byte in range(256)]


class TokenizerError(RuntimeError):
    """A tokenizer could not be trained or loaded; the message says what to do."""


# The wrapper settings of a trained tokenizer (for a loaded one, `serialize` reads them off it).
# split_special_tokens: a text that spells "</s>" or "<sep>" is encoded as those characters; read
# as the special token, it would end the source early or split a target in two, and decoding with
# skip_special_tokens would drop it.
TRAINED_SETTINGS = {"pad_token": PAD, "eos_token": EOS, "unk_token": UNK,
                    "additional_special_tokens": [SEP, MASK], "split_special_tokens": True}


class Layout(NamedTuple):
    """Where a trained tokenizer puts its special tokens, and the template it writes a text in."""

    first: list[str]            # special tokens at ids 0, 1, ...
    last: list[str]             # special tokens after every learned and byte piece
    template: str | None        # `TemplateProcessing`'s single template; None: the text alone
    settings: dict              # the wrapper's settings


# model type of the model built here -> its trained tokenizer's layout
_T5_LAYOUT = Layout(SPECIAL_TOKENS, [], None, TRAINED_SETTINGS)
_BART_LAYOUT = Layout([BOS, PAD, EOS, UNK, SEP, MASK], [], f"{BOS} $A {EOS}",
                      {**TRAINED_SETTINGS, "bos_token": BOS})
LANGUAGE_CODE = "en_XX"   # mBART's code of the language its built-in texts are in
LAYOUTS = {
    "t5": _T5_LAYOUT,
    "pegasus": _T5_LAYOUT,   # Pegasus's pad=0, eos=1, and the end token after a text, as T5's
    "bart": _BART_LAYOUT,
    "mbart": _BART_LAYOUT._replace(
        first=[BOS, PAD, EOS, UNK, SEP, MASK, LANGUAGE_CODE], template=f"$A {EOS} {LANGUAGE_CODE}",
        settings={**_BART_LAYOUT.settings,
                  "additional_special_tokens": [SEP, MASK, LANGUAGE_CODE]}),
    "marian": Layout([EOS, UNK, SEP, MASK], [PAD], None, TRAINED_SETTINGS),
}


NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                        "mask_token")


def _wrap(tokenizer: Tokenizer, settings: dict = TRAINED_SETTINGS) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **settings)


def _train(texts: list[str], vocab_size: int, layout: Layout = _T5_LAYOUT) -> Tokenizer:
    # BPE, not T5's own Unigram: on a corpus with fewer distinct words than `vocab_size` (the
    # built-in data, small real samples) the Unigram trainer stopped at a few hundred pieces and cut
    # words into letters (3.85 tokens per keyphrase word), while BPE merges up to whole words
    # (1.00): targets, and so every decoder's work, were almost four times longer than needed.
    # The byte pieces come on top of `vocab_size`, so the merges, and with them the whole words, are
    # those of a tokenizer without them.
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    # No Unicode normalization (NFKC turned "ﬁ" into "fi" and full-width letters into ASCII): a
    # prediction must read back as the reference it reproduces. Spaces become "▁" (one is put in
    # front, so that a word is the same piece at the start of a text); words are split before each
    # "▁", and decoding turns every "▁" back into a space and drops the one put in front, so that
    # leading and repeated spaces survive.
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                                 normalizers.Replace(" ", "▁")])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                           decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=layout.first,
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    # the trainer keeps no byte pieces: add them after the learned ones, and byte fallback with them
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for piece in BYTE_PIECES:
        vocab.setdefault(piece, len(vocab))
    spec["model"]["byte_fallback"] = True
    trained = Tokenizer.from_str(json.dumps(spec))
    trained.add_special_tokens(layout.last)
    if layout.template is not None:
        specials = [(token, trained.token_to_id(token)) for token in layout.template.split()
                    if token != "$A"]
        trained.post_processor = processors.TemplateProcessing(single=layout.template,
                                                               special_tokens=specials)
    return trained


def built_here(model) -> bool:
    """Whether the configuration's model group (`model`) is built here from its sizes, with a
    tokenizer trained here (`t5-tiny`, `bart-tiny`, ...), rather than loaded pretrained: it names
    no `hub_id`."""
    return "hub_id" not in model


def built_type(model) -> str:
    """The model type of a model built here (`model.type`; a configuration stored before other
    families were built here has none: T5)."""
    return model.get("type", "t5")


def cache_folder(cache_dir: str | os.PathLike) -> Path:
    """`cache_dir` (`data.tokenizer_cache`), made if missing; a TokenizerError naming the key if it
    cannot be a folder. Called before the training data is read, not after training."""
    from datamodules.sources import usable_folder
    return usable_folder(cache_dir, "data.tokenizer_cache", TokenizerError)


def train_or_load(texts: Iterable[str], vocab_size: int, cache_dir: str | os.PathLike,
                  model_type: str = "t5") -> PreTrainedTokenizerFast:
    """A subword tokenizer for `texts` in the layout of `model_type`'s family (`LAYOUTS`), trained
    once and then read from `cache_dir`."""
    texts = list(texts)
    layout = LAYOUTS[model_type]
    # T5's key is the one it always had: caches written before other layouts stay valid
    named = "" if layout is _T5_LAYOUT else f"{'/'.join(layout.first + layout.last)}|{layout.template}|"
    key = hashlib.sha256(f"{TOKENIZER_FORMAT}|{vocab_size}|{named}".encode())
    for text in texts:
        key.update(text.encode("utf-8", "replace"))
        key.update(b"\n")
    path = cache_folder(cache_dir) / f"tokenizer-{key.hexdigest()[:16]}.json"
    if path.exists():
        log.info("reusing cached tokenizer %s", path)
        return _wrap(Tokenizer.from_file(str(path)), layout.settings)
    log.info("training a %d-piece tokenizer on %d texts", vocab_size, len(texts))
    tokenizer = _train(texts, vocab_size, layout)
    # write to a temporary name, then rename: a crash never leaves a half-written cache entry
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as tmp:
        tmp.write(tokenizer.to_str())
    os.replace(tmp.name, path)
    return _wrap(tokenizer, layout.settings)


def serialize(tokenizer: PreTrainedTokenizerFast) -> tuple[str, dict]:
    """What rebuilds `tokenizer` without its files: the fast tokenizer's JSON (vocabulary, added
    tokens with their ids, normalizer, pre-tokenizer, decoder) and the settings the wrapper adds
    (which tokens are special, how decoding cleans up spaces). Plain strings, lists and bools only,
    so that a checkpoint holding them loads with `torch.load(weights_only=True)`."""
    named = {attr: str(getattr(tokenizer, attr)) for attr in NAMED_SPECIAL_TOKENS
             if getattr(tokenizer, attr) is not None}
    extra = [token for token in tokenizer.all_special_tokens if token not in named.values()]
    settings = {**named, "additional_special_tokens": extra,
                # T5's tokenizer sets it (True): without it "a, b" decodes as "a , b"
                "clean_up_tokenization_spaces": bool(tokenizer.clean_up_tokenization_spaces),
                "split_special_tokens": bool(getattr(tokenizer, "split_special_tokens", False))}
    return tokenizer.backend_tokenizer.to_str(), settings


def from_serialized(tokenizer_json: str, settings: dict | None = None) -> PreTrainedTokenizerFast:
    """Rebuild a tokenizer from what `serialize` stored in a checkpoint. Without `settings` (a
    checkpoint written before they were stored, which held only trained tokenizers) a trained
    tokenizer's are used."""
    return _wrap(Tokenizer.from_str(tokenizer_json), TRAINED_SETTINGS if settings is None else settings)


@contextmanager
def pretrained_files(hub_id: str, what: str, error: type[Exception]) -> Iterator[str]:
    """Around `from_pretrained(name)` of a pretrained model's tokenizer or weights, yielding the name
    to load: a local folder is read as it is (no hub request; an error says what the folder lacks),
    a hub id goes through `hub_access` (offline mode when the hub cannot be reached). A failure is
    raised as `error` ("cannot load WHAT HUB_ID: why")."""
    folder = Path(hub_id).expanduser()
    if folder.is_dir():
        try:
            yield str(folder)
        except (OSError, ValueError) as err:  # files missing: OSError (weights), ValueError (tokenizer)
            from datamodules.hub import load_failure  # imports `datasets`: only on this failure
            raise error(f"cannot load {what} {hub_id!r} (model.hub_id, a local folder; it needs "
                        f"config.json, the weights and tokenizer.json): "
                        f"{load_failure(err, None)}") from err
        return
    if hub_id.startswith(("/", ".", "~")):  # hub ids never start so: this was meant as a folder
        raise error(f"model.hub_id={hub_id!r} is not a folder; give a folder holding the model's "
                    f"files (config.json, weights, tokenizer.json) or a hub id such as "
                    f"google-t5/t5-small")
    from datamodules.hub import hub_access, load_failure  # imports `datasets`: only for hub models
    with hub_access() as unreachable:
        try:
            yield hub_id
        except OSError as err:
            raise error(f"cannot load {what} {hub_id!r}: {load_failure(err, unreachable)}. Use "
                        f"model=t5-tiny, or a local copy of the model (model.hub_id=DIR, or "
                        f"tasks.predict --pretrained DIR), to work offline.") from err


def load_pretrained(hub_id: str) -> PreTrainedTokenizerFast:
    with pretrained_files(hub_id, "the tokenizer of", TokenizerError) as name:
        tokenizer = AutoTokenizer.from_pretrained(name)
    missing = [t for t in (SEP, MASK) if t not in tokenizer.get_vocab()]
    if missing:
        # Added to the extra special tokens, not in place of them (the second argument, named
        # replace_extra_special_tokens in transformers 5 and replace_additional_special_tokens in
        # 4): replacing them would unmark T5's 100 sentinels <extra_id_N> as special tokens.
        tokenizer.add_special_tokens({"additional_special_tokens": missing}, False)
    return tokenizer


def special_tokens(tokenizer: PreTrainedTokenizerFast, start: int) -> SpecialTokens:
    """The tokenizer's special ids, and `start`, the decoder start token its backbone's
    configuration names (`decoder_start_token_id`: T5's and Pegasus's pad, BART's end token,
    Marian's pad, the last id)."""
    ids = tokenizer.convert_tokens_to_ids
    return SpecialTokens(pad=tokenizer.pad_token_id, eos=tokenizer.eos_token_id,
                         unk=tokenizer.unk_token_id, sep=ids(SEP), mask=ids(MASK), start=start)
