"""A task's trivial baselines (`tasks.baselines`), scored exactly as the trained decoders' outputs are.

    python -m tasks.experiments.baselines --task keyphrase|qa|summarization [--out BASELINES.json] \\
        [key=value ...]

On the test split (its first data.max_eval_examples, if set), the outputs that need no model, built
from the training split (its first data.max_train_examples): `constant`, the most frequent training
target, for every task; `frequent`, the most frequent target strings, for keyphrase and qa; `lead-k`,
the document's first k sentences, for summarization. Each is tokenized with the run's tokenizer
(`model=...`: t5-tiny's is trained on the training split, a pretrained model's is its own), cut to
the run's data limits as training targets are, and scored by the task's own metrics; definitions
and the reasons for them are in `tasks.baselines`. Scores without the cut (as lead-k is usually
published) are this command's with data limits that cut nothing (data.max_target_length,
data.max_subsequences, data.max_subsequence_length).

`tasks.compare` scores the same baselines beside its rows. This command scores them alone: for a
task's reference points, and to judge a comparison written without them
(`python -m tasks.comparison.report FILE.json --baselines BASELINES.json`).

Writes a table (and BASELINES.json, BASELINES.md with --out) and one MLflow run per baseline in the
task's experiment, tagged role=baseline, with the metrics under the names the decoders' test runs
use (test/rougeL, ...) and the baseline's outputs as predictions.
"""
from __future__ import annotations

from dataclasses import asdict

from omegaconf import DictConfig

from datamodules.datamodule import SubsequenceDataModule
from datamodules.schema import target_texts
from tasks.baselines import described, scored_baselines
from tasks.comparison.report import data_name, primary_metric, shown_quality
from tasks.comparison.result import recorded_data
from tasks.config import compose, to_yaml
from tasks.cli import base_parser, log, main_guard, show_report
from tasks.runs.tracking import (ExceptionWatcher, check_tracking, log_artifacts, log_params,
                                 open_tracking, run_link, run_status)

SPLIT = "test"


def markdown(result: dict) -> str:
    primary = primary_metric(result["task"])
    shown = list(dict.fromkeys([primary, *shown_quality(result["baselines"][0]["quality"])]))
    title = (f"{result['task']} baselines, {result['split']} split of {data_name(result['data'])}, "
             f"scored as the decoders' outputs (tokenizer of model={result['model']})")
    lines = [title, "",
             "| baseline | " + " | ".join(shown) + " | n examples | subsequences/ex | tokens/ex |",
             "|" + "---|" * (len(shown) + 4)]
    for entry in result["baselines"]:
        lines.append(f"| {entry['baseline']} | "
                     + " | ".join(f"{entry['quality'][key]:.4f}" for key in shown)
                     + f" | {entry['examples']} | {entry['subsequences_per_example']:.2f} | "
                       f"{entry['tokens_per_example']:.1f} |")
    limits = result["data_limits"]
    lines.append("")
    lines += [f"- {entry['baseline']}: {described(entry)}" for entry in result["baselines"]]
    lines.append(f"- outputs cut as training targets are (data.max_target_length="
                 f"{limits['max_target_length']}, data.max_subsequences={limits['max_subsequences']}, "
                 f"data.max_subsequence_length={limits['max_subsequence_length']})")
    return "\n".join(lines) + "\n"


def log_baseline(cfg: DictConfig, datamodule: SubsequenceDataModule, entry: dict,
                 predictions: list[list[str]]) -> str:
    """One MLflow run for one baseline; returns its id."""
    records = datamodule.records(SPLIT)
    logger = open_tracking(cfg, f"{entry['label']} {cfg.model.name} {cfg.data.source}",
                           tags={"role": "baseline", "baseline": entry["baseline"]})
    with run_status(logger, ExceptionWatcher()):  # the run exists from the first log on
        log_params(logger, cfg, datamodule, ("train", SPLIT))  # train: what the baselines learn from
        logger.log_hyperparams({f"baseline.{key}": value
                                for key, value in entry["definition"].items()
                                if not isinstance(value, list)})
        logger.log_metrics({f"{SPLIT}/{key}": value for key, value in
                            {**entry["quality"], "subsequences_per_example": entry["subsequences_per_example"],
                             "tokens_per_example": entry["tokens_per_example"]}.items()})
        log_artifacts(logger, cfg, [{"id": record["id"], "prediction": prediction,
                                     "targets": target_texts(cfg.task.name, record)}
                                    for record, prediction in zip(records, predictions)])
    logger.finalize("success")
    log.info("%s in the MLflow UI: %s", entry["label"], run_link(cfg, logger))
    return logger.run_id


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--task", help="keyphrase, qa or summarization (default: keyphrase)")
    parser.add_argument("--out", help="also write the result as FILE.json and FILE.md")
    args = parser.parse_intermixed_args(argv)  # key=value overrides may come anywhere
    cfg = compose(args.task, None, args.config, args.overrides)
    if args.print_config:
        print(to_yaml(cfg))
        return {}
    check_tracking(cfg)  # an unusable store fails before the data is read

    datamodule = SubsequenceDataModule(cfg)
    entries = []
    for entry, predictions in scored_baselines(cfg, datamodule):
        entry["mlflow_run_id"] = log_baseline(cfg, datamodule, entry, predictions)
        entries.append(entry)
    result = {"task": cfg.task.name, "data": recorded_data(cfg), "split": SPLIT,
              "model": cfg.model.name, "test_examples": len(datamodule.records(SPLIT)),
              "data_limits": {key: cfg.data[key] for key in
                              ("max_target_length", "max_subsequences", "max_subsequence_length")},
              "data_report": {split: asdict(datamodule.report[split]) for split in ("train", SPLIT)},
              "baselines": entries}
    show_report(args.out, result, markdown(result))
    return result


if __name__ == "__main__":
    main_guard(main)
