"""Decoder calls per example that producing a dataset's references would take; no training needed.

    python -m tasks.experiments.reference_calls --task summarization --decoders sequential,pipelined,nar \\
        [--split test] [--sweep decoder.delay=1,2] [--out FILE.json] [key=value ...]

Sequential decoding makes one decoder call per token, pipelined decoding one per step of its
subsequence schedule, Mask-Predict `iterations` (fewer for a target shorter than that): for these
decoders the number of calls follows from
the output alone (`Decoder.calls_for_output`). Counted on the references, it is what a model that
reproduces them would need: the saving a decoder's structure allows on a dataset, known before (or
without) training on it. A trained model's own counts (tasks.fit, tasks.compare) differ as far as
its outputs differ from the references in number and length of subsequences. Decoders whose calls
depend on the model (blockwise: accepted proposals) are listed without a count.

The references are tokenized and cut to the data limits exactly as for training
(`data.max_target_length`, `data.max_subsequences`); how many were cut is printed with the table.
The first decoder listed is the baseline of the ratio column.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict

from datamodules.datamodule import SubsequenceDataModule
from datamodules.sources import SPLITS
from datamodules.tokenizer import special_tokens
from decoders import build_decoder
from tasks.comparison.measure import reference_calls
from tasks.comparison.plan import parse_decoders, parse_sweeps, plan, row_label
from tasks.config import to_yaml
from tasks.models import build_backbone
from tasks.cli import base_parser, main_guard, show_report
from tasks.runs.trainer import decoder_options


def reference_counts(planned, datamodule: SubsequenceDataModule, split: str) -> list[dict]:
    """One row per planned decoder: its calls per reference of `split` (None where the count
    depends on the model), with the mean and the ratio to the first row's mean."""
    backbone_config = build_backbone(planned[0][0].model, datamodule.tokenizer).config
    special = special_tokens(datamodule.tokenizer, backbone_config.decoder_start_token_id)
    rows = []
    for cfg, swept in planned:
        decoder = build_decoder(cfg.decoder.name, backbone_config, special, **decoder_options(cfg))
        calls = reference_calls(decoder, datamodule, split)
        rows.append({"label": row_label(cfg, swept),
                     "calls_per_example": statistics.mean(calls) if calls else None,
                     "median_calls": statistics.median(calls) if calls else None})
    baseline = rows[0]["calls_per_example"]
    for row in rows:
        mean = row["calls_per_example"]
        row["fewer_calls_than_first"] = baseline / mean if baseline and mean else None
    return rows


def markdown(result: dict) -> str:
    def number(value, digits):
        return "depends on the model" if value is None else f"{value:.{digits}f}"

    first = result["rows"][0]["label"]
    lines = [f"{result['task']} references, {result['split']} split of {result['data']} "
             f"({result['examples']} examples; {result['subsequences_per_example']:.2f} "
             f"subsequences and {result['tokens_per_subsequence']:.2f} tokens per subsequence "
             f"on average)", "",
             f"| decoder | calls/example | median | fewer calls than {first} |", "|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['label']} | {number(row['calls_per_example'], 1)} | "
                     f"{number(row['median_calls'], 0)} | {number(row['fewer_calls_than_first'], 2)} |")
    report = result["data_report"]
    lines += ["", f"cut to the data limits: {report['subsequences_dropped']} subsequences dropped, "
                  f"{report['subsequences_truncated']} truncated (data.max_target_length, "
                  f"data.max_subsequences)"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--task", default="keyphrase")
    parser.add_argument("--decoders", default="sequential,pipelined",
                        help="comma-separated registered decoder names; the first is the baseline")
    parser.add_argument("--split", default="test", choices=SPLITS)
    parser.add_argument("--sweep", action="append", default=[], metavar="decoder.OPTION=v1,v2",
                        help="one row per value, for the decoders that have OPTION")
    parser.add_argument("--out", help="also write the result as FILE.json and FILE.md")
    args = parser.parse_intermixed_args(argv)  # key=value overrides may come anywhere
    planned = plan(args.task, parse_decoders(args.decoders), args.config, args.overrides,
                   parse_sweeps(args.sweep))
    if args.print_config:
        for cfg, _ in planned:
            print(to_yaml(cfg))
        return {}
    cfg = planned[0][0]

    datamodule = SubsequenceDataModule(cfg)
    datamodule.setup()
    targets = [example.target_ids for example in datamodule.dataset(args.split)]
    subsequences = [sub for example in targets for sub in example]
    result = {
        "task": cfg.task.name, "data": cfg.data.get("path") or cfg.data.source, "split": args.split,
        "examples": len(targets),
        "subsequences_per_example": len(subsequences) / max(len(targets), 1),
        "tokens_per_subsequence": statistics.mean(map(len, subsequences)) if subsequences else 0.0,
        "data_report": asdict(datamodule.report[args.split]),
        "rows": reference_counts(planned, datamodule, args.split),
    }
    show_report(args.out, result, markdown(result))
    return result


if __name__ == "__main__":
    main_guard(main)
