"""Where records come from: the built-in corpus, a local JSONL folder, or a named hub dataset.

Every source returns records in the schema of `datamodules.schema`, already validated.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import BinaryIO, Iterator, TextIO

from omegaconf import DictConfig

from datamodules.schema import DataError, check_unique_ids, validate_record

SPLITS = ("train", "validation", "test")
LOCAL_SOURCES = ("builtin", "jsonl")


def usable_folder(path, key: str, error: type[Exception]) -> Path:
    """The folder configuration key `key` names, made if missing; `error` naming the key and the
    reason if it cannot be one (a file in the way, no permission), before any work relies on it."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise error(f"{key}={str(path)!r} cannot be used as a folder: {err}") from err
    return folder


def jsonl_values(handle: BinaryIO, name: str) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON value) of each non-blank line of a binary stream; a line that is
    not UTF-8 or not JSON is a DataError naming `name` (the file) and the line."""
    for number, raw in enumerate(handle, start=1):
        where = f"{name} line {number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DataError(f"{where}: not valid UTF-8 ({err.reason} at byte {err.start})") from err
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{where}: malformed JSON ({err.msg} at column {err.colno})") from err
        yield number, value


def read_jsonl(path: Path, task: str) -> list[dict]:
    """Read and validate one JSONL split (`<split>.jsonl`); errors name the file and line."""
    if not path.is_file():
        present = sorted(p.name for p in path.parent.glob("*.jsonl")) if path.parent.is_dir() else []
        raise DataError(f"missing split file {path} (a jsonl folder needs "
                        f"{', '.join(s + '.jsonl' for s in SPLITS)}; found: "
                        f"{', '.join(present) or 'none'})")
    records, lines = [], []
    with open(path, "rb") as handle:
        for number, record in jsonl_values(handle, str(path)):
            records.append(validate_record(task, record, f"{path} line {number}"))
            lines.append(number)
    if not records:
        raise DataError(f"split file {path} holds no records")
    check_unique_ids(records, path.stem, lambda i: f"{path} line {lines[i]}")
    return records


def load_split(task: str, data: DictConfig, split: str) -> list[dict]:
    """The records of one split, from the source that `data.source` names: the first
    data.max_train_examples (train) or data.max_eval_examples (validation, test) of them, if set."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; allowed: {', '.join(SPLITS)}")
    limit = data.get("max_train_examples" if split == "train" else "max_eval_examples")
    if data.source in LOCAL_SOURCES:  # read_jsonl checks the ids; the built-in ones are unique
        return _local_split(task, data, split)[:limit]
    from datamodules.hub import HUB_DATASETS, load_hub
    if data.source not in HUB_DATASETS:
        raise DataError(f"unknown data source {data.source!r}; allowed: "
                        f"{', '.join(LOCAL_SOURCES + tuple(HUB_DATASETS))}")
    hub_task = HUB_DATASETS[data.source].task
    if hub_task != task:
        raise DataError(f"data={data.source} is a {hub_task} dataset, but task={task}")
    # The hub loader applies the limit before downloading, not after.
    records = load_hub(data.source, split, cache_dir=data.get("cache_dir"), limit=limit)
    check_unique_ids(records, split, lambda i: f"record {i} (counted from 0) of data={data.source}")
    return records


def _local_split(task: str, data: DictConfig, split: str) -> list[dict]:
    if data.source == "builtin":
        from datamodules.builtin import make_corpus
        return make_corpus(task=task, split=split, size=int(data[f"{split}_size"]),
                           seed=int(data.corpus_seed))
    folder = Path(data.path)
    if not folder.is_dir():
        raise DataError(f"data.path={data.path!r} is not a folder (it must hold "
                        f"{', '.join(s + '.jsonl' for s in SPLITS)})")
    return read_jsonl(folder / f"{split}.jsonl", task)


def write_jsonl(rows: list[dict], path) -> None:
    """Write rows to `path` through a temporary file, so no half-written file is left behind."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            dump_jsonl(rows, handle)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def dump_jsonl(rows: list[dict], handle: TextIO) -> None:
    """Rows as JSON lines into an open text stream, non-ASCII characters as they are."""
    for row in rows:
        handle.write(json.dumps(row, ensure_ascii=False) + "\n")
