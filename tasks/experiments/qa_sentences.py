"""Where a built-in QA model's answers come from: each context sentence's values, output or not.

    python -m tasks.experiments.qa_sentences --ckpt CKPT [--split validation] [--out FILE.json] \\
        [key=value ...]

Built-in QA's rule (datamodules.builtin): the answers are the values of the sentences about the
asked person and the asked relation, in order; every other sentence is a distractor about the asked
person under another relation, or about another person under the asked relation. A model that
binds each value to its sentence's person outputs the answer sentences' values and no distractor's;
one that knows the relation but not the person outputs values of every sentence of the asked
relation. This decodes a split with the checkpoint's own decoder and counts, for each kind of
sentence (read back by `datamodules.builtin.qa_facts`), the values it holds and how many of them
the output names; then the output answers that are no sentence's value, and those output twice.
A distractor's value that is also an answer is not counted.

For checkpoints of built-in QA only; any other is refused before data or model work. Overrides
such as `data.validation_size=1000` (the built-in corpus extends a split by prefix) count more.
"""
from __future__ import annotations

from collections import Counter

from datamodules.builtin import qa_facts, qa_question
from datamodules.sources import SPLITS, load_split
from tasks.cli import base_parser, main_guard, show_report
from tasks.config import ConfigError, to_yaml
from tasks.predictor import Predictor

# Each context sentence's kind, from how its person and relation compare with the question's.
KINDS = ("answer sentence, one value", "answer sentence, two values",
         "asked relation, another person", "asked person, another relation")


def sentence_kind(asked_person: str, asked_relation: int, person: str, relation: int,
                  values: int) -> str:
    if relation == asked_relation and person == asked_person:
        return KINDS[0] if values == 1 else KINDS[1]
    return KINDS[2] if relation == asked_relation else KINDS[3]


def tally(record: dict, output: list[str], counts: dict[str, Counter]) -> None:
    """Add one example: its built-in QA `record` (question, context, answers) and the model's
    `output` answers."""
    person, relation = qa_question(record["question"])
    named, answers = set(output), set(record["answers"])
    anywhere = set()
    for fact in qa_facts(record["context"]):
        kind = sentence_kind(person, relation, fact.person, fact.relation, len(fact.values))
        anywhere.update(fact.values)
        counted = [v for v in fact.values if kind in KINDS[:2] or v not in answers]
        counts[kind]["sentences"] += 1
        counts[kind]["values"] += len(counted)
        counts[kind]["output"] += sum(v in named for v in counted)
    counts["output"]["answers"] += len(output)
    counts["output"]["in no sentence"] += sum(a not in anywhere for a in output)
    counts["output"]["repeated"] += len(output) - len(named)


def markdown(result: dict) -> str:
    lines = [f"{result['task']}, {result['split']} split of {result['data']} ({result['examples']} "
             f"examples), checkpoint {result['checkpoint']} decoded by {result['decoder']}: the "
             f"values of each kind of context sentence, and how many the output names", "",
             "| sentence | sentences | values | output | share output |", "|---|---|---|---|---|"]
    for row in result["sentences"]:
        share = f"{row['output'] / row['values']:.3f}" if row["values"] else "–"
        lines.append(f"| {row['kind']} | {row['sentences']} | {row['values']} | {row['output']} | "
                     f"{share} |")
    out = result["output"]
    lines += ["", f"Output answers: {out['answers']}; in no sentence: {out['in no sentence']}; "
                  f"repeats of an answer already output: {out['repeated']}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="a built-in QA checkpoint written by tasks.fit")
    parser.add_argument("--split", default="validation", choices=SPLITS)
    parser.add_argument("--out", help="also write the result as FILE.json and FILE.md")
    args = parser.parse_intermixed_args(argv)  # key=value overrides may come anywhere
    predictor = Predictor.from_checkpoint(args.ckpt, overrides=args.overrides, config_file=args.config)
    cfg = predictor.cfg
    if cfg.task.name != "qa" or cfg.data.source != "builtin":
        raise ConfigError(f"{args.ckpt} was trained on {cfg.task.name} from data.source="
                          f"{cfg.data.source}; this counts built-in QA's sentences only (task qa, "
                          f"data.source=builtin)")
    if args.print_config:
        print(to_yaml(cfg))
        return {}

    records = load_split("qa", cfg.data, args.split)
    outputs = predictor.predict(records, desc=f"decoding the {args.split} split")
    counts: dict[str, Counter] = {kind: Counter() for kind in (*KINDS, "output")}
    for record, output in zip(records, outputs):
        tally(record, output["answers"], counts)
    result = {"task": "qa", "data": "builtin", "split": args.split, "checkpoint": args.ckpt,
              "decoder": cfg.decoder.name, "examples": len(records),
              "sentences": [{"kind": kind, **{key: counts[kind][key]
                                             for key in ("sentences", "values", "output")}}
                            for kind in KINDS],
              "output": {key: counts["output"][key] for key in ("answers", "in no sentence", "repeated")}}
    show_report(args.out, result, markdown(result))
    return result


if __name__ == "__main__":
    main_guard(main)
