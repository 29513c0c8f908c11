"""ROUGE of two summarization reference points, scored exactly as the trained decoders' outputs are.

    python -m tasks.experiments.baselines --task summarization data=jsonl data.path=DIR \\
        [--out results/cnndm_baselines.json] [key=value ...]

On the test split (its first data.max_eval_examples, if set), two summaries that need no model:

* lead-3: the first three sentences of the document, as `datamodules.sentences.split_sentences`
  cuts them (the library's splitter, the one the hub loaders cut summaries with). On tokenized,
  lowercased text such as the CNN/DM sample a sentence ends at a " . ", " ! " or " ? " token before
  the next word; a closing quote that stands alone after the period (`... investigation . " he`)
  opens the next sentence instead of closing this one, which changes no score: ROUGE's tokenizer
  drops punctuation.
* constant: the most frequent summary of the training split (its first data.max_train_examples),
  the same for every test example. Summaries are compared as the scorer reads them (their
  sentences, stripped, blank ones dropped); among equally frequent ones the first in the split wins,
  so when all are distinct it is the first training summary (the report says which case it is).

Each is scored the way `SummarizationTask` scores a decoder's output: its sentences are tokenized
with the run's tokenizer (`model=...`: t5-tiny's is trained on the training split, a pretrained
model's is its own) and decoded back by `tasks.module.subsequence_texts`, the decoders' own path
from token ids to text, then `tasks.metrics.Rouge` compares them with the reference sentences
(`target_texts`: untruncated, as for the models). With a trained t5-tiny tokenizer the round trip
gives the text back unchanged; a pretrained tokenizer may not (unknown characters, its clean-up of
spaces before punctuation), and then the baselines lose what a model's output would lose.

Every baseline is scored twice: as it is (the usual lead-3, comparable with published figures),
and cut as training targets are cut (`data.max_target_length` tokens in the flat layout,
`data.max_subsequences` sentences of at most `data.max_subsequence_length` tokens;
`datamodules.datamodule.fit_targets`): what a model that learned to write that summary under the
run's data limits would output, the fairer point beside models trained with those limits.

Writes a table (and FILE.json, FILE.md with --out) and one MLflow run per row in the task's
experiment, tagged role=baseline, with the metrics under the names the decoders' test runs use
(test/rouge1, ...) and the baseline's summaries as predictions.
"""
from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import asdict

from omegaconf import DictConfig

from datamodules.datamodule import DataReport, SubsequenceDataModule, fit_targets
from datamodules.schema import schema_for, target_texts
from datamodules.sentences import split_sentences
from tasks.config import ConfigError, compose, to_yaml
from tasks.metrics import Rouge
from tasks.module import subsequence_texts
from tasks.run import base_parser, log, main_guard, show_report
from tasks.runs.tracking import (ExceptionWatcher, check_tracking, log_artifacts, log_params,
                                 open_tracking, run_link, run_status)

TASK = "summarization"
SPLIT = "test"
LEAD_SENTENCES = 3


def lead(record: dict) -> list[str]:
    """The document's first LEAD_SENTENCES sentences (fewer if it has fewer)."""
    return split_sentences(schema_for(TASK).source_text(record))[:LEAD_SENTENCES]


def most_frequent_summary(records: list[dict]) -> dict:
    """The training summary that occurs most often, first seen among equals, with its count, the
    id of its first record, and how many distinct summaries there are. An empty summary (no
    sentence) is not a candidate: a constant that says nothing scores 0 whatever the data."""
    summaries = [tuple(target_texts(TASK, record)) for record in records]
    counts = Counter(summary for summary in summaries if summary)
    summary, count = counts.most_common(1)[0]  # equal counts come in first-seen order
    return {"summary": list(summary), "count": count,
            "first_id": records[summaries.index(summary)]["id"],
            "training_summaries": len(records), "distinct_summaries": len(counts),
            "all_distinct": count == 1}


def score(summaries: list[list[str]], records: list[dict], tokenizer,
          data: DictConfig | None) -> tuple[dict, list[list[str]]]:
    """ROUGE of `summaries` (sentences per example) against `records`' references, through the
    decoders' token round trip; cut to the data limits of `data` unless it is None. Returns the
    row's figures and the texts scored."""
    ids = [tokenizer(sentences, add_special_tokens=False)["input_ids"] if sentences else []
           for sentences in summaries]
    report = DataReport(examples=len(ids))
    if data is not None:
        ids = [fit_targets(example, data.max_target_length, data.max_subsequences,
                           data.max_subsequence_length, report)
               for example in ids]
    predictions = subsequence_texts(tokenizer, ids)
    rouge = Rouge()
    rouge.update(preds=predictions, targets=[target_texts(TASK, record) for record in records])
    row = {key: float(value) for key, value in rouge.compute().items()}
    row.update(examples=len(records),
               sentences_per_example=statistics.mean(map(len, predictions)),
               tokens_per_example=statistics.mean(sum(map(len, example)) for example in ids),
               sentences_truncated=report.subsequences_truncated,
               sentences_dropped=report.subsequences_dropped)
    return row, predictions


def config(task: str, config_file: str | None, overrides: list[str]) -> DictConfig:
    """The composed configuration, for `task` only (checked first: compose would name every task
    as allowed). As in every entry point, --task wins over a `task=` override."""
    if task != TASK:
        raise ConfigError(f"tasks.experiments.baselines has baselines for one task, {TASK}; got task {task!r} "
                          f"(allowed: {TASK})")
    return compose(task, None, config_file, overrides)


def markdown(result: dict) -> str:
    constant = result["baselines"]["constant"]
    if constant["all_distinct"]:
        chosen = (f"all {constant['training_summaries']} training summaries are distinct, so it is "
                  f"the first one ({constant['first_id']})")
    else:
        chosen = (f"it occurs {constant['count']} times among {constant['training_summaries']} "
                  f"training summaries ({constant['distinct_summaries']} distinct), first as "
                  f"{constant['first_id']}")
    title = (f"{TASK} baselines, {result['split']} split of {result['data']}, scored as the "
             f"decoders' outputs (tokenizer of model={result['model']})")
    lines = [title, "",
             "| baseline | rouge1 | rouge2 | rougeL | rougeLsum | n examples | sentences/ex | tokens/ex |",
             "|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['label']} | {row['rouge1']:.4f} | {row['rouge2']:.4f} | "
                     f"{row['rougeL']:.4f} | {row['rougeLsum']:.4f} | {row['examples']} | "
                     f"{row['sentences_per_example']:.2f} | {row['tokens_per_example']:.1f} |")
    limits = result["data_limits"]
    lines += ["",
              f"- lead-3: the document's first {LEAD_SENTENCES} sentences (`datamodules.sentences.split_sentences`).",
              f"- constant: the most frequent training summary; {chosen}: \"{' '.join(constant['summary'])}\"",
              (f"- cut to data limits: cut as training targets are (data.max_target_length="
               f"{limits['max_target_length']}, data.max_subsequences={limits['max_subsequences']}).")]
    return "\n".join(lines) + "\n"


def log_row(cfg: DictConfig, datamodule: SubsequenceDataModule, row: dict, definition: dict,
            predictions: list[list[str]]) -> str:
    """One MLflow run for one row; returns its id."""
    records = datamodule.records(SPLIT)
    logger = open_tracking(cfg, f"{row['label']} {cfg.model.name} {cfg.data.source}",
                           tags={"role": "baseline", "baseline": row["baseline"],
                                 "cut_to_data_limits": str(row["cut_to_data_limits"]).lower()})
    with run_status(logger, ExceptionWatcher()):  # the run exists from the first log on
        log_params(logger, cfg, datamodule, ("train", SPLIT))  # train: the constant's source
        logger.log_hyperparams({f"baseline.{key}": value for key, value in definition.items()
                                if key != "summary"}
                               | {"baseline.cut_to_data_limits": row["cut_to_data_limits"]})
        logger.log_metrics({f"{SPLIT}/{key}": row[key]
                            for key in (*Rouge.TYPES, "sentences_per_example", "tokens_per_example")})
        log_artifacts(logger, cfg, [{"id": record["id"], "prediction": prediction,
                                     "targets": target_texts(TASK, record)}
                                    for record, prediction in zip(records, predictions)])
    logger.finalize("success")
    log.info("%s in the MLflow UI: %s", row["label"], run_link(cfg, logger))
    return logger.run_id


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--task", default=TASK, help=f"the task: {TASK} only")
    parser.add_argument("--out", help="also write the result as FILE.json and FILE.md")
    args = parser.parse_intermixed_args(argv)  # key=value overrides may come anywhere
    cfg = config(args.task, args.config, args.overrides)
    if args.print_config:
        print(to_yaml(cfg))
        return {}
    check_tracking(cfg)  # an unusable store fails before the data is read

    datamodule = SubsequenceDataModule(cfg)
    datamodule.setup()  # the records and the tokenizer the models would have
    tokenizer = datamodule.tokenizer
    records = datamodule.records(SPLIT)
    definitions = {
        "lead-3": {"sentences": LEAD_SENTENCES,
                   "sentence_splitter": "datamodules.sentences.split_sentences"},
        "constant": most_frequent_summary(datamodule.records("train")),
    }
    summaries = {"lead-3": [lead(record) for record in records],
                 "constant": [definitions["constant"]["summary"]] * len(records)}
    rows = []
    for name, definition in definitions.items():
        for cut in (False, True):
            row, predictions = score(summaries[name], records, tokenizer, cfg.data if cut else None)
            row = {"baseline": name, "cut_to_data_limits": cut,
                   "label": f"{name}, cut to data limits" if cut else name, **row}
            row["mlflow_run_id"] = log_row(cfg, datamodule, row, definition, predictions)
            rows.append(row)
    result = {"task": TASK, "data": cfg.data.get("path") or cfg.data.source, "split": SPLIT,
              "model": cfg.model.name,
              "data_limits": {"max_target_length": cfg.data.max_target_length,
                              "max_subsequences": cfg.data.max_subsequences},
              "data_report": {split: asdict(datamodule.report[split]) for split in ("train", SPLIT)},
              "baselines": definitions, "rows": rows}
    show_report(args.out, result, markdown(result))
    return result


if __name__ == "__main__":
    main_guard(main)
