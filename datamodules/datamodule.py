"""One LightningDataModule for every task: records -> token ids -> batches.

A batch is a dict with
    input_ids, attention_mask   (B, source_len) encoder inputs, right-padded
    index                       (B,) position of each example in its split (dataset order)
    targets                     [example][subsequence] -> token ids, for the decoder's layout
The raw records stay available (`records(split)`) so that scoring uses the untruncated targets.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import lightning as L
import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from datamodules import tokenizer as tok
from datamodules.schema import DataError, has_source, schema_for, target_texts
from datamodules.sources import SPLITS, load_split
from datamodules.vocabulary import pad_batch

log = logging.getLogger(__name__)


@dataclass
class Encoded:
    index: int
    source_ids: list[int]
    target_ids: list[list[int]]


@dataclass
class DataReport:
    """What the length limits cut, and how many examples have no source or no target, per split;
    reported once and logged to MLflow."""

    sources_truncated: int = 0
    subsequences_truncated: int = 0
    subsequences_dropped: int = 0
    empty_targets: int = 0
    empty_sources: int = 0
    examples: int = 0

    def any(self) -> bool:
        return bool(self.sources_truncated or self.subsequences_truncated or self.subsequences_dropped)


class EncodedSplit(Dataset):
    """One split's encoded examples, as a map-style dataset for a DataLoader."""

    def __init__(self, examples: list[Encoded]):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> Encoded:
        return self.examples[i]


def fit_targets(subsequences: list[list[int]], max_length: int, max_count: int,
                max_subsequence_length: int, report: DataReport) -> list[list[int]]:
    """Cut each subsequence to `max_subsequence_length` tokens with its end token (the pipelined
    layout's [s_i, e]), then keep subsequences, in order, while the flat layout
    (s_1 <sep> ... s_m </s>) fits `max_length`.

    The same cut applies to every decoder, so all of them train on the same targets.
    """
    longest = max_subsequence_length - 1  # room for the subsequence's end token
    kept: list[list[int]] = []
    used = 1  # the end token
    for sub in subsequences[:max_count]:
        sub = sub[:longest]
        cost = len(sub) + (1 if kept else 0)
        if used + cost > max_length:
            if not kept:  # a single over-long first subsequence is cut rather than lost
                kept.append(sub[: max_length - 1])
            break
        kept.append(sub)
        used += cost
    report.subsequences_truncated += sum(len(k) < len(sub) for k, sub in zip(kept, subsequences))
    report.subsequences_dropped += len(subsequences) - len(kept)
    return kept


def encode_targets(tokenizer, texts: list[list[str]], data: DictConfig,
                   report: DataReport) -> list[list[list[int]]]:
    """Each example's target subsequences (`texts`, one list per example) as the decoders train on
    them: each tokenized without special tokens, then cut to `data`'s limits (`fit_targets`,
    counted in `report`). Outputs scored beside the decoders' (tasks.baselines) are cut this way
    too. One tokenizer call for all of them: one per example would take seconds on a large split."""
    flat = [text for example in texts for text in example]
    ids = iter(tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else [])
    return [fit_targets([next(ids) for _ in example], data.max_target_length, data.max_subsequences,
                        data.max_subsequence_length, report) for example in texts]


def source_template(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer's own template puts before and after a source's (T5's end token,
    BART's <s> and </s>, mBART's end token and language code); a tokenizer whose template adds
    none (the library's trained ones) gets T5's: the end token after."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    templated = tokenizer("a")["input_ids"]
    for start in range(len(templated) - len(plain) + 1):
        if templated[start: start + len(plain)] == plain:
            prefix, suffix = templated[:start], templated[start + len(plain):]
            if prefix or suffix:
                return prefix, suffix
    return [], [tokenizer.eos_token_id]


def encode_sources(tokenizer, task: str, records: list[dict],
                   max_source_length: int) -> tuple[list[list[int]], int]:
    """Each record's source text as the encoder reads it: its token ids in the tokenizer's
    template (`source_template`), cut to `max_source_length` with the template kept whole; and
    how many were cut."""
    sources = tokenizer([schema_for(task).source_text(r) for r in records],
                        add_special_tokens=False)["input_ids"]
    prefix, suffix = source_template(tokenizer)
    limit = max(1, max_source_length - len(prefix) - len(suffix))  # room for the template's ids
    return [prefix + source[:limit] + suffix for source in sources], sum(len(s) > limit for s in sources)


class SubsequenceDataModule(L.LightningDataModule):
    def __init__(self, cfg: DictConfig, tokenizer=None):
        super().__init__()
        self.task = cfg.task.name
        self.data = cfg.data
        self.model_cfg = cfg.model
        self.train_batch_size = cfg.train.batch_size
        self.group_by_length = cfg.train.group_by_length
        self.eval_batch_size = cfg.eval.batch_size
        self.seed = cfg.seed
        self.tokenizer = tokenizer
        self._records: dict[str, list[dict]] = {}
        self._encoded: dict[str, list[Encoded]] = {}
        self.report: dict[str, DataReport] = {}

    # -- loading ----------------------------------------------------------------------------------
    def load_records(self) -> None:
        """Read and validate all splits (cheap), before any tokenizer training or model building."""
        if self._records:
            return
        for split in SPLITS:
            self._records[split] = load_split(self.task, self.data, split)  # limits applied there

    def records(self, split: str) -> list[dict]:
        self.load_records()
        return self._records[split]

    def setup(self, stage: str | None = None) -> None:
        if self._encoded:
            return
        if self.tokenizer is None and not tok.built_here(self.model_cfg):
            # needs no data: a bad model.hub_id fails before any is read (or downloaded)
            self.tokenizer = tok.load_pretrained(self.model_cfg.hub_id)
        if self.tokenizer is None:  # the model's built here, trained below
            tok.cache_folder(self.data.tokenizer_cache)  # checked before the data is read
        self.load_records()
        if self.tokenizer is None:
            self.tokenizer = self._train_tokenizer()
        for split in SPLITS:
            self._encoded[split], self.report[split] = self._encode(self._records[split])
            report = self.report[split]
            if report.empty_sources == report.examples:  # nothing to learn, select by or score
                raise DataError(f"{split} split: all {report.examples} examples have an empty source "
                                f"(fields {', '.join(schema_for(self.task).source_fields)})")
            if report.empty_sources:
                log.warning("%s split: %d of %d examples have an empty source (fields %s): there is "
                            "nothing to generate their targets from", split,
                            report.empty_sources, report.examples,
                            ", ".join(schema_for(self.task).source_fields))
            if report.empty_targets == report.examples and split != "test":
                # nothing to learn from or to select a checkpoint by (the test split may be unlabelled)
                raise DataError(f"{split} split: all {report.examples} examples have empty targets "
                                f"(field {schema_for(self.task).target_field!r})")
            if report.empty_targets:
                log.warning("%s split: %d of %d examples have no target; the decoders learn to "
                            "output nothing for them", split, report.empty_targets, report.examples)
            if report.any():
                log.warning("%s split: %d of %d sources truncated to %d tokens; %d subsequences "
                            "truncated and %d dropped to fit data.max_target_length=%d / "
                            "data.max_subsequences=%d / data.max_subsequence_length=%d", split,
                            report.sources_truncated, report.examples, self.data.max_source_length,
                            report.subsequences_truncated, report.subsequences_dropped,
                            self.data.max_target_length, self.data.max_subsequences,
                            self.data.max_subsequence_length)

    def _train_tokenizer(self):
        schema = schema_for(self.task)
        texts = [schema.source_text(r) for r in self._records["train"]]
        texts += [t for r in self._records["train"] for t in target_texts(self.task, r)]
        return tok.train_or_load(texts, self.model_cfg.vocab_size, self.data.tokenizer_cache,
                                 tok.built_type(self.model_cfg))

    def _encode(self, records: list[dict]) -> tuple[list[Encoded], DataReport]:
        report = DataReport(examples=len(records))
        sources, report.sources_truncated = encode_sources(self.tokenizer, self.task, records,
                                                           self.data.max_source_length)
        texts = [target_texts(self.task, record) for record in records]
        report.empty_sources = sum(not has_source(self.task, record) for record in records)
        report.empty_targets = sum(not example for example in texts)
        targets = encode_targets(self.tokenizer, texts, self.data, report)
        return [Encoded(index, source, target)
                for index, (source, target) in enumerate(zip(sources, targets))], report

    # -- batches ----------------------------------------------------------------------------------
    def collate(self, examples: list[Encoded]) -> dict:
        return collate(examples, self.tokenizer.pad_token_id)

    def dataset(self, split: str) -> EncodedSplit:
        self.setup()
        return EncodedSplit(self._encoded[split])

    def _loader(self, split: str, batch_size: int, sampler: Sampler) -> DataLoader:
        return loader(self.dataset(split), batch_size, sampler, self.collate, self.data.num_workers,
                      self.seed)

    def train_dataloader(self) -> DataLoader:
        # The order of epoch e is a function of (seed, e) alone (the sampler reseeds from
        # `set_epoch`, which the trainer calls), so a resumed run sees the same batches as an
        # uninterrupted one. Under DDP every process takes its share; the sampler pads the last
        # share with repeats so that all processes step together, which training tolerates.
        world, rank = process_group()
        train = self.dataset("train")
        if self.group_by_length:
            sampler = LengthGrouped([len(e.source_ids) for e in train.examples], self.train_batch_size,
                                    num_replicas=world, rank=rank, seed=self.seed)
        else:
            sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True,
                                         seed=self.seed)
        return self._loader("train", self.train_batch_size, sampler)

    def ordered_loader(self, split: str) -> DataLoader:
        """A split in dataset order (this process's share of it under DDP), in evaluation batches."""
        return self._loader(split, self.eval_batch_size, EvaluationShard(len(self.dataset(split))))

    def val_dataloader(self) -> DataLoader:
        return self.ordered_loader("validation")

    def test_dataloader(self) -> DataLoader:
        return self.ordered_loader("test")


def collate(examples: list[Encoded], pad: int) -> dict:
    """A batch (see the module's docstring) of encoded examples, sources right-padded with `pad`."""
    input_ids = pad_batch([e.source_ids for e in examples], pad)
    return {
        "input_ids": input_ids,
        "attention_mask": (input_ids != pad).long(),
        "index": torch.tensor([e.index for e in examples], dtype=torch.long),
        "targets": [e.target_ids for e in examples],
    }


def loader(dataset: Dataset, batch_size: int, sampler: Sampler, collate_fn, num_workers: int,
           seed: int) -> DataLoader:
    # Its own generator: otherwise every new iterator draws its workers' base seed from torch's
    # global generator, and when an iterator is made (before or after an epoch's reseeding, see
    # BackboneTraining.on_train_epoch_start) would change the training's random draws.
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                      num_workers=num_workers, generator=torch.Generator().manual_seed(seed))


def process_group() -> tuple[int, int]:
    """(world size, rank) of the running torch.distributed group; (1, 0) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


class LengthGrouped(DistributedSampler):
    """DistributedSampler's shuffled share, reordered so that each training batch holds sources of
    similar length: less padding, so fewer token positions computed per example.

    The share is cut into windows of `WINDOW_BATCHES` batches; each window is sorted by source
    length and cut into batches, and the full batches of all windows are shuffled (a short last
    batch stays last, where the loader cuts it). Like the plain sampler, an epoch's order is a
    function of (seed, epoch) alone.
    """

    WINDOW_BATCHES = 64

    def __init__(self, lengths: list[int], batch_size: int, *, num_replicas: int, rank: int,
                 seed: int) -> None:
        super().__init__(lengths, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.lengths, self.batch_size = lengths, batch_size

    def __iter__(self):
        share = list(super().__iter__())
        window = self.WINDOW_BATCHES * self.batch_size
        batches = []
        for start in range(0, len(share), window):
            ordered = sorted(share[start:start + window], key=self.lengths.__getitem__)
            batches += [ordered[i:i + self.batch_size] for i in range(0, len(ordered), self.batch_size)]
        short = [batches.pop()] if batches and len(batches[-1]) < self.batch_size else []
        # seeded apart from the share's own permutation (seed + epoch)
        shuffled = torch.randperm(len(batches), generator=torch.Generator().manual_seed(
            self.seed + self.epoch + 1_000_003)).tolist()
        return iter([i for b in [batches[j] for j in shuffled] + short for i in b])


class EvaluationShard(Sampler[int]):
    """This process's share of an evaluation split, in dataset order, without padding.

    torch's DistributedSampler repeats examples so that every process gets as many; a repeated
    example would be scored twice. Here process r of w takes examples r, r + w, r + 2w, ...: the
    shares differ by at most one example, and together they hold each example exactly once.
    """

    def __init__(self, size: int) -> None:
        world, rank = process_group()
        self.indices = range(rank, size, world)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
