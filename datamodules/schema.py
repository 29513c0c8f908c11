"""The one data format of the library: JSON objects, one per example, per task.

keyphrase:      {"id", "title", "abstract", "keyphrases": [str, ...]}
                optional "aliases": {keyphrase: [other form, ...]}: forms that score as that keyphrase
                (KPTimes); only the keyphrase metric reads it
qa:             {"id", "question", "context", "answers": [str, ...]}
summarization:  {"id", "document", "summary": [sentence, ...]}

Every source (built-in corpus, local JSONL, hub datasets) produces exactly these records, so the
rest of the library only ever sees one shape. A task turns a record into a source text (what the
encoder reads) and a list of target subsequences (what the decoder writes).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


class DataError(ValueError):
    """Bad or missing data: the message names the file, line, field or split at fault."""


@dataclass(frozen=True)
class TaskSchema:
    fields: dict[str, type]            # field name -> required type (list means list of str)
    target_field: str                  # the field holding the target subsequences
    source_text: Callable[[dict], str]  # record -> text the encoder reads
    source_fields: tuple[str, ...]      # the fields that text is made of: all blank = no source
    # checked only when present; dict means str -> list of str
    optional_fields: dict[str, type] = field(default_factory=dict)


SCHEMAS: dict[str, TaskSchema] = {
    "keyphrase": TaskSchema(
        fields={"id": str, "title": str, "abstract": str, "keyphrases": list},
        target_field="keyphrases",
        source_text=lambda r: f"{r['title']} {r['abstract']}".strip(),
        source_fields=("title", "abstract"),
        optional_fields={"aliases": dict},
    ),
    "qa": TaskSchema(
        fields={"id": str, "question": str, "context": str, "answers": list},
        target_field="answers",
        source_text=lambda r: f"question: {r['question']} context: {r['context']}",
        source_fields=("question", "context"),  # WikiHowQA has questions without context
    ),
    "summarization": TaskSchema(
        fields={"id": str, "document": str, "summary": list},
        target_field="summary",
        source_text=lambda r: r["document"],
        source_fields=("document",),
    ),
}

TASKS = tuple(SCHEMAS)


def schema_for(task: str) -> TaskSchema:
    if task not in SCHEMAS:
        raise DataError(f"unknown task {task!r}; allowed: {', '.join(TASKS)}")
    return SCHEMAS[task]


def validate_record(task: str, record: object, where: str, source_only: bool = False) -> dict:
    """Check one record against the task's schema; `where` (e.g. 'train.jsonl line 7') goes into errors.
    With `source_only`, only the source fields are checked (a record to predict the target of:
    tasks.predict); its other fields are not looked at."""
    schema = schema_for(task)
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    fields = ({name: schema.fields[name] for name in schema.source_fields} if source_only
              else schema.fields)
    optional = {} if source_only else schema.optional_fields
    for name, kind in fields.items():
        if name not in record:
            raise DataError(f"{where}: missing field {name!r} (a {task} record "
                            f"{'to predict from ' if source_only else ''}needs {', '.join(fields)})")
        _check_type(record[name], name, kind, where)
    for name, kind in optional.items():
        if name in record:
            _check_type(record[name], name, kind, where)
    return record


def _is_string_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _check_type(value: object, name: str, kind: type, where: str) -> None:
    if kind is list:
        if not _is_string_list(value):
            raise DataError(f"{where}: field {name!r} must be a list of strings, got {value!r:.80}")
    elif kind is dict:
        if not (isinstance(value, dict)
                and all(isinstance(k, str) and _is_string_list(v) for k, v in value.items())):
            raise DataError(f"{where}: field {name!r} must map strings to lists of strings, "
                            f"got {value!r:.80}")
    elif not isinstance(value, kind):
        raise DataError(f"{where}: field {name!r} must be {kind.__name__}, got {type(value).__name__}")


def has_source(task: str, record: dict) -> bool:
    """Whether a record has any source text (the template around it aside)."""
    return any(record[name].strip() for name in schema_for(task).source_fields)


def check_unique_ids(records: list[dict], split: str, where: Callable[[int], str]) -> None:
    """Refuse a split in which two records share an id: predictions, references and scores are
    matched by it. `where(i)` names the place of record i ("line 7", "position 7")."""
    first: dict[str, int] = {}
    for i, record in enumerate(records):
        if record["id"] in first:
            raise DataError(f"{split} split: id {record['id']!r} is used twice, at "
                            f"{where(first[record['id']])} and at {where(i)}; ids must be unique "
                            f"within a split")
        first[record["id"]] = i


def target_texts(task: str, record: dict) -> list[str]:
    """The target subsequences of a record, blank entries dropped."""
    return [t.strip() for t in record[schema_for(task).target_field] if t.strip()]
