"""Denoising data for pretraining (`tasks.experiments.pretrain`): the source texts of JSONL folders, corrupted by
text infilling, with the original text as the target.

Why infilling (BART's objective, Lewis et al. 2020): the tasks copy. Present keyphrases and answer
spans are spans of the source, and a summary reuses its sentences; a model trained from scratch on
~1000 abstracts never learns to copy. Here the target is the whole original text and the input is
that text with about `mask_ratio` of its tokens hidden, each hidden span replaced by ONE `<mask>`
(so the input does not tell how many tokens a span had): some 70% of the target is copied from the
input, in order, and the rest is inferred from the context around each mask. T5's span corruption
(target = the hidden spans only) or a randomly chosen target span teach no copying: nothing of such
a target is in the input, so it only teaches the language prior.

Spans are placed as in T5's `random_spans_noise_mask`: round(length * mask_ratio) tokens in
round(that / mean_span) spans (at least one), the hidden tokens and the visible ones each cut at
random points, so that spans never touch (two adjacent masks would be one span) and the text may
begin or end with one. A text too short to hide a token is left as it is.

A text is cut to its first min(data.max_source_length, data.max_target_length) - 1 tokens (the end
token takes the last place), so that the whole target is the visible input plus what the masks
hide; longer texts lose their tail (counted, and logged as `truncated`).

The corruption of example i in epoch e is drawn from (seed, e, i) alone, so a run is reproducible,
whichever process or loader worker builds the example, and each epoch hides other spans. The
validation texts are corrupted once, from their own stream, so that their loss compares across
epochs.

Folders: each one's `train.jsonl` (required) and `validation.jsonl` (used for the validation loss
when present), in any task schema of `datamodules.schema`; its source text is the task's (keyphrase:
title + abstract, qa: question + context, summarization: the document). data.max_train_examples and
data.max_eval_examples limit each folder's texts.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import lightning as L
import numpy as np
from omegaconf import DictConfig
from torch.utils.data import Dataset, DistributedSampler

from datamodules import tokenizer as tok
from datamodules.datamodule import (
    Encoded,
    EvaluationShard,
    EncodedSplit,
    collate,
    loader,
    process_group,
)
from datamodules.schema import SCHEMAS, DataError, has_source, schema_for
from datamodules.sources import read_jsonl

log = logging.getLogger(__name__)

PRETRAIN_SPLITS = ("train", "validation")
STREAMS = {"train": 0, "validation": 1}  # the random streams of the two splits' corruptions


def infill(tokens: list[int], mask: int, rng: np.random.Generator, mask_ratio: float,
           mean_span: float) -> list[int]:
    """`tokens` with round(len * mask_ratio) of them hidden, in spans of mean length about
    `mean_span`, each span replaced by one `mask` (see the module's docstring)."""
    length = len(tokens)
    hidden = round(length * mask_ratio)
    # the spans are separated by visible tokens: n spans need n - 1 of them
    spans = min(max(round(hidden / mean_span), 1), hidden, length - hidden + 1)
    if spans < 1:
        return list(tokens)
    span_lengths = _cut(hidden, spans, rng)
    # n + 1 visible runs, the first and last possibly empty: cut two more tokens, take one off each end
    gaps = _cut(length - hidden + 2, spans + 1, rng)
    gaps[0] -= 1
    gaps[-1] -= 1
    out: list[int] = []
    position = 0
    for gap, span in zip(gaps, [*span_lengths, 0]):
        out.extend(tokens[position:position + gap])
        position += gap
        if span:
            out.append(mask)
            position += span
    return out


def _cut(total: int, parts: int, rng: np.random.Generator) -> list[int]:
    """`total` cut into `parts` non-empty runs at random points (parts <= total)."""
    points = np.sort(rng.choice(np.arange(1, total), parts - 1, replace=False))
    return np.diff(np.concatenate([[0], points, [total]])).tolist()


def example_rng(seed: int, split: str, epoch: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, STREAMS[split], epoch, index])


def folder_task(folder: Path) -> str:
    """The task schema `folder`'s train.jsonl is written in, told by its first record's fields;
    a DataError naming the folder when it is not a folder, has no train.jsonl, or matches no schema
    (or several). Reads one line: called before any work."""
    path = folder / "train.jsonl"
    if not folder.is_dir():
        raise DataError(f"--data: {folder} is not a folder (each --data folder holds a train.jsonl)")
    if not path.is_file():
        raise DataError(f"--data: folder {folder} has no train.jsonl (it needs one; a "
                        f"validation.jsonl is used too when there is one)")
    with open(path, encoding="utf-8", errors="replace") as handle:
        first = next((line for line in handle if line.strip()), None)
    try:
        fields = set(json.loads(first)) if first is not None else set()
    except (json.JSONDecodeError, TypeError):
        fields = set()  # read_jsonl names the line at fault once a schema is known
    matching = [task for task, schema in SCHEMAS.items() if set(schema.fields) <= fields]
    if len(matching) != 1:
        known = "; ".join(f"{task}: {', '.join(schema.fields)}" for task, schema in SCHEMAS.items())
        raise DataError(f"--data: {path} is in no single known schema (the fields of its first "
                        f"record: {', '.join(sorted(fields)) or 'none'}; the schemas: {known})")
    return matching[0]


@dataclass
class Folder:
    """One --data folder: its task schema and, per split it has, its records, their source texts
    (records without one left out) and how many of those were cut to the window."""
    path: Path
    task: str
    records: dict[str, list[dict]] = field(default_factory=dict)
    sources: dict[str, list[str]] = field(default_factory=dict)
    truncated: dict[str, int] = field(default_factory=dict)


class _Infilled(Dataset):
    """Training texts, each corrupted anew in every epoch; indexed by (epoch, index), as the
    sampler (`EpochTagged`) yields them."""

    def __init__(self, texts: list[list[int]], example: Callable[[int, int], Encoded]):
        self.texts = texts
        self.example = example

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, key: tuple[int, int]) -> Encoded:
        epoch, index = key
        return self.example(epoch, index)


class EpochTagged(DistributedSampler):
    """Shuffled training order as `SubsequenceDataModule`'s (a function of seed and epoch, the
    epoch set by the trainer), yielding (epoch, index): a loader worker builds the example of that
    epoch without knowing the trainer's state."""

    def __iter__(self):
        return ((self.epoch, index) for index in super().__iter__())


class DenoisingDataModule(L.LightningDataModule):
    """Batches of `datamodules.datamodule`'s form: input = the infilled text, targets = [the text]."""

    def __init__(self, cfg: DictConfig, folders: list[Path], mask_ratio: float, mean_span: float):
        super().__init__()
        self.data = cfg.data
        self.vocab_size = cfg.model.vocab_size
        self.train_batch_size = cfg.train.batch_size
        self.eval_batch_size = cfg.eval.batch_size
        self.seed = cfg.seed
        self.mask_ratio, self.mean_span = mask_ratio, mean_span
        self.folders = [Folder(path, folder_task(path)) for path in folders]
        self.window = min(self.data.max_source_length, self.data.max_target_length) - 1
        self.tokenizer = None  # trained in `setup`
        self.texts: dict[str, list[list[int]]] = {split: [] for split in PRETRAIN_SPLITS}
        self.validation: list[Encoded] = []  # corrupted once (the module's docstring)

    def setup(self, stage: str | None = None) -> None:
        if self.tokenizer is not None:
            return
        tok.cache_folder(self.data.tokenizer_cache)  # checked before the data is read
        for folder in self.folders:
            source_text = schema_for(folder.task).source_text
            for split in PRETRAIN_SPLITS:
                path = folder.path / f"{split}.jsonl"
                if not path.is_file():  # only validation may be missing (`folder_task`)
                    continue
                limit = self.data.max_train_examples if split == "train" else self.data.max_eval_examples
                folder.records[split] = read_jsonl(path, folder.task)[:limit]
                folder.sources[split] = [source_text(r) for r in folder.records[split]
                                         if has_source(folder.task, r)]
        training = [text for folder in self.folders for text in folder.sources["train"]]
        if not training:
            raise DataError(f"--data: no training text in {', '.join(str(f.path) for f in self.folders)} "
                            f"(every record's source is blank)")
        # trained as tasks.fit trains t5-tiny's (the same recipe, special tokens and cache), on the
        # whole training texts
        self.tokenizer = tok.train_or_load(training, self.vocab_size, self.data.tokenizer_cache)
        for folder in self.folders:
            for split, sources in folder.sources.items():
                ids = self.tokenizer(sources, add_special_tokens=False)["input_ids"] if sources else []
                folder.truncated[split] = sum(len(text) > self.window for text in ids)
                self.texts[split] += [text[:self.window] for text in ids]
            log.info("%s (%s): %s", folder.path, folder.task, "; ".join(
                f"{split} {len(folder.sources[split])} texts ({folder.truncated[split]} cut to "
                f"{self.window} tokens, {len(records) - len(folder.sources[split])} blank left out)"
                for split, records in folder.records.items()))
        if not self.texts["validation"]:
            log.warning("no --data folder has a validation.jsonl: no validation loss is measured")
        self.validation = [self.example("validation", 0, i) for i in range(len(self.texts["validation"]))]

    def example(self, split: str, epoch: int, index: int) -> Encoded:
        text = self.texts[split][index]
        rng = example_rng(self.seed, split, epoch, index)
        source = infill(text, self.tokenizer.convert_tokens_to_ids(tok.MASK), rng, self.mask_ratio,
                        self.mean_span)
        return Encoded(index, source + [self.tokenizer.eos_token_id], [text])

    def _collate(self, examples: list[Encoded]) -> dict:
        return collate(examples, self.tokenizer.pad_token_id)

    def train_dataloader(self):
        self.setup()
        dataset = _Infilled(self.texts["train"], partial(self.example, "train"))
        world, rank = process_group()
        sampler = EpochTagged(dataset, num_replicas=world, rank=rank, shuffle=True, seed=self.seed)
        return loader(dataset, self.train_batch_size, sampler, self._collate, self.data.num_workers,
                      self.seed)

    def val_dataloader(self):
        self.setup()
        return loader(EncodedSplit(self.validation), self.eval_batch_size,
                      EvaluationShard(len(self.validation)), self._collate, self.data.num_workers,
                      self.seed)
