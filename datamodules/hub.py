"""The library's named Hugging Face hub datasets, loaded with `datasets.load_dataset` and mapped to its schema.

Each entry of HUB_DATASETS says where the data lives on the hub and how one hub row becomes one record of
the task's schema (datamodules/schema.py); `load_hub(name, split, limit=N)` returns (the first N records of) a
split as validated records.

Several of these datasets live in repositories whose loading script `datasets` >= 4 refuses to run ("Dataset
scripts are no longer supported"). For those, the entry names the repository's raw JSON files (`raw_file`),
which are read with the generic JSON builder through `hf://datasets/...` paths; the rows then have the raw
files' columns, documented on each entry.

Mapping, per dataset:
- kp20k (midas/kp20k, raw train/valid/test.jsonl): `document` (tokens: title, then abstract) becomes the
  abstract, `extractive_keyphrases` + `abstractive_keyphrases` the keyphrases, `id` the id.
- kptimes (midas/kptimes, same files): its `document` is the title and body split on whitespace only, so
  punctuation stays on words ("plagiarism,") and a present keyphrase would be scored as absent. The title and
  abstract are therefore rebuilt from the untokenized `other_metadata` title and body, and they and every
  keyphrase are cut by one tokenizer (`word_tokens`) and joined by spaces, so that the keyphrase metric's
  whitespace split sees the same tokens in source and keyphrase. A KPTimes keyphrase may list aliases joined by
  commas ("republican national convention,rnc"); KPTimes' evaluation counts a prediction matching any alias as
  matching the keyphrase. The record keeps the first alias as the keyphrase (the training target) and the
  others in `aliases` ({keyphrase: [alias, ...]}), which only scoring reads (tasks/metrics.py, KeyphraseF1).
- msqa (Tugay/multispanqa, train/validation.json; test.json has no labels): the hub's validation file is our
  test split. Our validation split is carved out of the hub's train file: a row is held out when the CRC-32 of
  its `id` is divisible by 10 (about 1 row in 10, the same rows whatever the file order or the limits), and
  the rest is our train split. Answers are the BIO-labelled spans of the context.
- wikihowqa (Lurunchik/WikiHowNFQA, one JSONL whose `split` column says train/valid/test): the answer text is
  cut into sentences, the targets; the context is empty.
- cnndm (abisee/cnn_dailymail 3.0.0) and pubmed (ccdv/pubmed-summarization, config "document"): the article
  is the document and the highlights / abstract, cut into sentences, the summary.

Limits (data.max_train_examples / max_eval_examples) act before anything is downloaded: a limited read
streams the split (`streaming=True`, then `.take(N)`), so only the data of its first rows is fetched (a JSON
lines file is read in 10 MB chunks; a single-object JSON file such as MultiSpanQA's is read whole) instead of
the whole split (KPTimes: 4.26 GB). Without a limit, a split is downloaded whole and cached.

Without network the hub cannot be used: load_hub raises a DataError pointing to the offline alternative, a
folder of train/validation/test.jsonl files in the library's schema (`data=jsonl data.path=DIR`). It fails
fast: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are honoured as they are set at call time, and otherwise one quick
request tells whether the hub answers; when it does not, `datasets` runs in offline mode (cache only) instead of
retrying every request for half a minute. Datasets loaded through the repository itself (cnndm, pubmed) are then
still read from the `datasets` cache (whole, then cut to the limit: streaming needs the hub); the raw-file ones
cannot be, since resolving `hf://` paths needs the hub.
"""
from __future__ import annotations

import os
import re
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import datasets
import huggingface_hub
from huggingface_hub.utils import httpx  # the HTTP client module huggingface_hub itself uses

from datamodules.schema import DataError, schema_for, validate_record
from datamodules.sentences import split_sentences

SPLITS = ("train", "validation", "test")

# What "the hub could not be reached" looks like: `datasets` raises ConnectionError (OfflineModeIsEnabled is
# one too), while requests that fail below it surface as the HTTP client's transport errors.
_NETWORK_ERRORS = (ConnectionError, httpx.TransportError)
_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_TRUE_VALUES = {"1", "ON", "YES", "TRUE"}
_PROBE_TIMEOUT_S = 5.0

# One row in this many of a hub train split that also gives our validation split is held out for validation.
_HELD_OUT_EVERY = 10

# Words (dotted acronyms such as "U.S.", hyphenated words, decimals and inner apostrophes as in "O’Reilly" kept
# whole), the clitics 's 'd 'm 'll 're 've on their own ("Trump’s" -> "Trump ’s"), and every other non-space
# character on its own: close to the spaCy tokenization with hyphenated words kept whole that KPTimes' own
# preprocessing uses (taln-ls2n/kptimes), without the dependency.
_CLITIC = r"['’](?i:s|d|m|ll|re|ve)\b"
_TOKEN = re.compile(rf"(?:[^\W_]\.){{2,}}|\w+(?:(?:[-.]|(?!{_CLITIC})['’])\w+)*|{_CLITIC}|[^\w\s]")


@dataclass(frozen=True)
class HubDataset:
    """Where one named dataset lives on the hub and how its rows become records.

    convert(row, row_id) -> record; `row_id` ('<name>-<split>-<index>') is the id for layouts without one.
    splits maps our train/validation/test to the hub's split names.
    raw_file: set when the repository has a loading script: the path of its raw JSON file(s) in the repository,
        with `{split}` replaced by the hub split name.
    json_field: for a raw file holding one JSON object, the key of the list of rows.
    split_column: for a raw file holding every split, the column naming each row's split.
    validation_from_train: set when our validation split is carved out of the hub's train split (which then
        feeds both): the column whose stable hash holds a row out (see `_held_out`).
    """
    task: str
    hub_id: str
    splits: dict[str, str]
    convert: Callable[[dict, str], dict]
    config_name: str | None = None
    raw_file: str | None = None
    json_field: str | None = None
    split_column: str | None = None
    validation_from_train: str | None = None


def _held_out(value: str) -> bool:
    """Whether a row of a hub train split goes to our validation split: CRC-32 of its id, so the choice is the
    same on every machine and run, and does not depend on the rows' order or on how many are read."""
    return zlib.crc32(value.encode("utf-8")) % _HELD_OUT_EVERY == 0


def word_tokens(text: str) -> str:
    """`text` cut into words and punctuation marks (see _TOKEN), joined by single spaces."""
    return " ".join(_TOKEN.findall(text))


def bio_spans(tokens: list[str], labels: list[str]) -> list[str]:
    """The spans a BIO labelling marks: a span starts at B (or at an I that follows O) and runs over the Is
    after it. Spans are tokens joined by single spaces, in order, repeats dropped."""
    spans: list[str] = []
    current: list[str] = []
    for token, label in zip(tokens, labels, strict=True):
        if label == "I" and current:
            current.append(token)
            continue
        if current:
            spans.append(" ".join(current))
        current = [token] if label in ("B", "I") else []
    if current:
        spans.append(" ".join(current))
    return list(dict.fromkeys(spans))


def _kp20k(row: dict, row_id: str) -> dict:
    """midas/kp20k raw rows: `id`, `document` (tokens: the title, then the abstract), `extractive_keyphrases`
    (present), `abstractive_keyphrases` (absent), `doc_bio_tags`. The document already starts with the title,
    so all of it goes to `abstract`."""
    return {"id": str(row["id"]), "title": "", "abstract": " ".join(row["document"]),
            "keyphrases": row["extractive_keyphrases"] + row["abstractive_keyphrases"]}


def _kptimes(row: dict, row_id: str) -> dict:
    """midas/kptimes raw rows: the kp20k columns plus `other_metadata` with the untokenized `title` and
    `abstract` (the article body), from which the source is rebuilt; keyphrases may list comma-joined aliases
    (see the module docstring)."""
    keyphrases: list[str] = []
    aliases: dict[str, list[str]] = {}
    for entry in row["extractive_keyphrases"] + row["abstractive_keyphrases"]:
        forms = [form for form in map(word_tokens, entry.split(",")) if form]
        if not forms:  # an empty entry (or a lone comma) names no keyphrase
            continue
        keyphrases.append(forms[0])
        if len(forms) > 1:
            aliases[forms[0]] = forms[1:]
    metadata = row["other_metadata"]
    return {"id": str(row["id"]), "title": word_tokens(metadata["title"]),
            "abstract": word_tokens(metadata["abstract"]), "keyphrases": keyphrases, "aliases": aliases}


def _multispanqa(row: dict, row_id: str) -> dict:
    """MultiSpanQA rows: `id`, `question` and `context` as token lists, `label` (one B/I/O per context token),
    `num_span`, `structure`, `type`. The answers are the labelled spans of the context."""
    return {"id": row["id"], "question": " ".join(row["question"]), "context": " ".join(row["context"]),
            "answers": bio_spans(row["context"], row["label"])}


def _wikihowqa(row: dict, row_id: str) -> dict:
    """WikiHowQA rows: `article_id` (int), `question`, `answer` (one text), `split`, `cluster`. The supporting
    documents are not public (RMIT data agreement), so the context is empty: the task is answering from the
    question alone, one target per answer sentence."""
    return {"id": str(row["article_id"]), "question": row["question"], "context": "",
            "answers": split_sentences(row["answer"])}


def _summarization(document: str, summary: str, id_column: str | None = None) -> Callable[[dict, str], dict]:
    """Converter for layouts with the document and its summary as two text columns; the summary is split
    into sentences (CNN/DM highlights are one per line)."""
    def convert(row: dict, row_id: str) -> dict:
        return {"id": str(row[id_column]) if id_column else row_id, "document": row[document],
                "summary": split_sentences(row[summary])}
    return convert


_SAME_SPLITS = {split: split for split in SPLITS}
_VALID_NAMED_SPLITS = {"train": "train", "validation": "valid", "test": "test"}  # the hub says "valid"

HUB_DATASETS: dict[str, HubDataset] = {
    # Meng et al. 2017, via the MIDAS lab's copy (loading script + train/valid/test.jsonl).
    "kp20k": HubDataset(
        task="keyphrase", hub_id="midas/kp20k", convert=_kp20k, splits=_VALID_NAMED_SPLITS,
        raw_file="{split}.jsonl"),
    # Gallina et al. 2019 (NY Times + JP Times news), same layout and file names as kp20k.
    "kptimes": HubDataset(
        task="keyphrase", hub_id="midas/kptimes", convert=_kptimes, splits=_VALID_NAMED_SPLITS,
        raw_file="{split}.jsonl"),
    # Li et al. 2022, basic (multi-span only) version. There is no official hub copy; Tugay/multispanqa holds
    # the original train/validation/test.json files ({"version", "data": [rows]}). The public test file has no
    # labels (the benchmark's test set is scored by its authors), so our test split is the hub's validation
    # split, and our validation split is held out of the hub's train split: choosing checkpoints on the test
    # set would overstate the test scores. nc33/multispanQA_SE_type is a parquet copy of the expanded version.
    "msqa": HubDataset(
        task="qa", hub_id="Tugay/multispanqa", convert=_multispanqa,
        splits={"train": "train", "validation": "train", "test": "validation"},
        raw_file="{split}.json", json_field="data", validation_from_train="id"),
    # Bolotova-Baranova et al. 2023, "WikiHowQA" (hub name WikiHowNFQA): loading script + one JSONL file whose
    # `split` column says train / valid / test.
    "wikihowqa": HubDataset(
        task="qa", hub_id="Lurunchik/WikiHowNFQA", convert=_wikihowqa, splits=_VALID_NAMED_SPLITS,
        raw_file="WikiHowNFQA.jsonl", split_column="split"),
    # See et al. 2017, non-anonymized: parquet with `article`, `highlights` (newline-separated), `id`.
    "cnndm": HubDataset(
        task="summarization", hub_id="abisee/cnn_dailymail", config_name="3.0.0", splits=_SAME_SPLITS,
        convert=_summarization("article", "highlights", id_column="id")),
    # Cohan et al. 2018, parquet with `article` and `abstract` (lowercased, tokenized, joined with spaces);
    # the "document" config gives the whole article as one text ("section" separates sections by newlines).
    "pubmed": HubDataset(
        task="summarization", hub_id="ccdv/pubmed-summarization", config_name="document", splits=_SAME_SPLITS,
        convert=_summarization("article", "abstract")),
}


def load_hub(name: str, split: str, cache_dir: str | None = None, limit: int | None = None) -> list[dict]:
    """Records of one split of a named hub dataset (its first `limit` ones, if given), each checked against its
    task's schema."""
    if name not in HUB_DATASETS:
        raise DataError(f"unknown hub dataset {name!r}; allowed: {', '.join(HUB_DATASETS)}")
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r} for hub dataset {name!r}; allowed: {', '.join(SPLITS)}")
    spec = HUB_DATASETS[name]
    try:
        with hub_access() as reason:
            # Streaming needs the hub; without it a limited read takes its rows from the cached split.
            rows = _read_rows(spec, split, cache_dir, limit, stream=limit is not None and reason is None)
            # Inside the block: a streamed split is only downloaded while it is iterated.
            records = [validate_record(spec.task, spec.convert(row, f"{name}-{split}-{index}"),
                                       f"hub dataset {name!r} ({spec.hub_id}) {split} row {index}")
                       for index, row in enumerate(rows)]
    except _NETWORK_ERRORS as err:
        raise _unreachable_error(name, spec, reason or _one_line(err)) from err
    if not records:
        raise DataError(f"hub dataset {name!r} ({spec.hub_id}): no rows for our {split} split "
                        f"(hub split {spec.splits[split]!r})")
    return records


def _read_rows(spec: HubDataset, split: str, cache_dir: str | None, limit: int | None,
               stream: bool) -> Iterable[dict]:
    """The hub rows of our `split`, at most `limit` of them; with `stream`, read lazily as they are iterated."""
    hub_split = spec.splits[split]
    if spec.raw_file is None:
        rows = datasets.load_dataset(spec.hub_id, spec.config_name, split=hub_split, cache_dir=cache_dir,
                                     streaming=stream)
    else:
        path = f"hf://datasets/{spec.hub_id}/{spec.raw_file.format(split=hub_split)}"
        rows = datasets.load_dataset("json", data_files=path, split="train", field=spec.json_field,
                                     cache_dir=cache_dir, streaming=stream)
    if spec.split_column is not None:
        rows = rows.filter(lambda value: value == hub_split, input_columns=spec.split_column)
    if spec.validation_from_train is not None and split != "test":
        wanted = split == "validation"
        rows = rows.filter(lambda value: _held_out(value) == wanted,
                           input_columns=spec.validation_from_train)
    return rows if limit is None else rows.take(limit)


def _why_hub_unusable() -> str | None:
    """Why the hub cannot be used right now (an offline variable, or a quick request that failed); None if it can."""
    for variable in _OFFLINE_VARIABLES:
        if os.environ.get(variable, "").upper() in _TRUE_VALUES:
            return f"{variable} is set"
    try:
        huggingface_hub.get_session().head(huggingface_hub.constants.ENDPOINT, timeout=_PROBE_TIMEOUT_S)
    except _NETWORK_ERRORS as err:
        return _one_line(err)
    return None


@contextmanager
def hub_access() -> Iterator[str | None]:
    """Around any loading from the hub (datasets, tokenizers, weights): yields None when the hub can
    be reached, else why not, and then loads in offline mode (local cache only), so that what is not
    cached fails at once instead of after minutes of retries."""
    reason = _why_hub_unusable()
    with _offline_mode(reason is not None):
        yield reason


@contextmanager
def _offline_mode(offline: bool) -> Iterator[None]:
    """While loading, put `datasets` and `huggingface_hub` in offline mode if `offline`: both read
    HF_HUB_OFFLINE once, at import, so a variable set later (or a hub found unreachable) would otherwise
    still send every request through its retries."""
    saved = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    if offline:
        datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved


def load_failure(err: BaseException, unreachable: str | None) -> str:
    """Why loading from the hub failed, for an error message: the hub could not be reached (and
    the files were not cached), else the error itself."""
    if unreachable:
        return f"the hub cannot be reached ({unreachable}) and the files are not in the local cache"
    return _one_line(err)


def _one_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def _unreachable_error(name: str, spec: HubDataset, reason: str) -> DataError:
    fields = ", ".join(schema_for(spec.task).fields)
    return DataError(
        f"hub dataset {name!r} ({spec.hub_id}) could not be loaded: the Hugging Face hub could not be reached "
        f"({reason}). Offline alternative: put train.jsonl, validation.jsonl and test.jsonl, one {spec.task} "
        f"record per line ({fields}), in a folder DIR and run with data=jsonl data.path=DIR.")
