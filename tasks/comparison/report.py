"""A comparison's table and plots, rendered from its JSON alone (`tasks.comparison.result` builds
it: one entry per row, speedups over sequential, and the task's trivial baselines,
`tasks.baselines`): the markdown table, and the plots (speedup against target subsequences,
quality against speed, and per swept option quality and speedup against its value). A figure a
JSON does not record (one written before it was measured) is left out of the table and plots.

A row whose model did not learn its task (`not_learned`: its primary quality is not above the best
baseline's, or it never learned to end its outputs) is marked so in the table and gets no speedup:
its outputs are no better than a system's that needs no model, so its speed is not a decoder's.
Neither does any row when sequential's model did not learn, since a speedup is a ratio to
sequential's speed.

    python -m tasks.comparison.report FILE.json   # FILE.md and the plots again
    python -m tasks.comparison.report FILE.json --baselines BASELINES.json

With --baselines, the baseline entries of BASELINES.json (written by `tasks.experiments.baselines
--out`, for the comparison's task and test split) replace FILE.json's own before its rows are
judged again, and FILE.json is rewritten with them: the way to judge a comparison written without
baselines against them.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from tasks.baselines import described
from tasks.comparison.plan import settings_label, swept_options
from tasks.config import ConfigError
from tasks.module import TASK_MODULES
from tasks.cli import main_guard
from tasks.runs.tracking import metric_key_part

# a model whose outputs mostly run to the length bound never learned to end them
NOT_LEARNED_BOUND_SHARE = 0.5
# the speedups over sequential a row's entry holds (each beside `<key>_passes`, one per timing pass)
SPEEDUPS = ("speedup_bs1", "speedup_batch")


def primary_metric(task: str) -> str:
    """The quality that picks a task's best checkpoint, as the JSON's quality keys name it."""
    return TASK_MODULES[task].primary_metric.split("/", 1)[1]


def bound_share(entry: dict, examples: int | None) -> float | None:
    """The share of a row's `examples` outputs that a decoder bound cut (its `bound_hits`); None
    where the row or its result does not record them."""
    hits = entry.get("bound_hits")
    return None if hits is None or not examples else hits / examples


def not_learned(quality: dict, bound_cut: float | None, primary: str,
                baselines: list[dict]) -> str | None:
    """Why a row's model did not learn its task, or None when it did: its primary `quality` is not
    above the best of the `baselines`' (without baselines, as in a result written without them: is
    0), or at least NOT_LEARNED_BOUND_SHARE of its test outputs stopped at a length bound
    (`bound_cut`, the share: `bound_share`)."""
    value = quality.get(primary)
    if baselines:
        best = max(baselines, key=lambda baseline: baseline["quality"][primary])
        if value <= best["quality"][primary]:
            return (f"{primary} {value:.3f} is not above the baseline {best['baseline']}'s "
                    f"{best['quality'][primary]:.3f}")
    elif value == 0.0:
        return f"{primary} is 0"
    if bound_cut is not None and bound_cut >= NOT_LEARNED_BOUND_SHARE:
        return f"it never learned to end its outputs: {bound_cut:.0%} of them run to the length bound"
    return None


def judge(result: dict) -> dict:
    """`result` with each row's `not_learned` reason set, and the speedups of a row that did not
    learn, or of every row when sequential did not learn, taken away (None)."""
    primary = result.setdefault("primary_metric", primary_metric(result["task"]))
    rows = result["rows"]
    for entry in rows:
        entry["not_learned"] = not_learned(entry["quality"],
                                           bound_share(entry, result.get("test_examples")), primary,
                                           result.get("baselines", []))
    reference = next((e for e in rows if e["decoder"] == "sequential"), None)
    for entry in rows:
        if reference is None or entry["not_learned"] or reference["not_learned"]:
            for key in SPEEDUPS:
                entry[key] = None
                entry.pop(f"{key}_passes", None)
    return result


def with_baselines(result: dict, baselines: dict, path: Path) -> dict:
    """`result` with the baseline entries of `baselines` (read from `path`, a `tasks.experiments.
    baselines --out` file) in place of its own; refused when they are not of its task, lack a
    metric its rows have (qa scored at another task.level) or, where `result` records its test
    split's size, were scored on a test split of another size."""
    if not isinstance(baselines.get("baselines"), list):
        raise ConfigError(f"--baselines {path} holds no list of baseline entries; expected a file "
                          f"written by tasks.experiments.baselines --out")
    if baselines["task"] != result["task"]:
        raise ConfigError(f"--baselines {path} holds baselines of task {baselines['task']!r}; the "
                          f"comparison is of task {result['task']!r}")
    missing = sorted({key for entry in baselines["baselines"] for key in result["rows"][0]["quality"]
                      if key not in entry["quality"]})
    if missing:
        raise ConfigError(f"--baselines {path} has no {', '.join(missing)}, which the comparison's "
                          f"rows have; score the baselines with the comparison's task settings")
    examples = result.get("test_examples")
    if examples is not None and baselines["test_examples"] != examples:
        raise ConfigError(f"--baselines {path} was scored on {baselines['test_examples']} test "
                          f"examples; the comparison's rows on {examples}")
    return {**result, "baselines": baselines["baselines"]}


def data_name(data: str) -> str:
    """How a table names its data: a source by its name, a JSONL folder by its own name (where
    it lay on the machine that measured is no concern of the reader's)."""
    return f"the JSONL folder {Path(data).name}" if "/" in data else data


def compiled_steps(entry: dict) -> bool:
    """Whether a row decoded with its steps compiled (its decoder's shared option `compile`)."""
    return bool(entry.get("options", {}).get("compile", False))


def shown_label(entry: dict) -> str:
    """A row's label as tables and plots show it: marked when its steps were compiled (unless its
    label names `compile`), when its options relax exact verification (`Decoder.inexact`) and when
    its model did not learn (`judge`)."""
    marks = [mark for mark, on in (
        ("compiled", compiled_steps(entry) and "compile=" not in entry["label"]),
        ("inexact", entry.get("inexact")), ("not learned", entry.get("not_learned"))) if on]
    return entry["label"] + "".join(f" ({mark})" for mark in marks)


def steps_caption(rows: list[dict]) -> str:
    """How a table's caption says whether its rows' decoder steps were compiled (`compiled_steps`)."""
    compiled = [compiled_steps(r) for r in rows]
    if not any(compiled):
        return "decoder steps eager"
    return "decoder steps compiled" if all(compiled) else "decoder steps eager, compiled where marked"


def shown_quality(quality: dict) -> list[str]:
    """The metrics a table shows of `quality` (a row's or a baseline's): F-measures and ROUGE;
    precision and recall are left to the JSON."""
    return [k for k in quality if not any(part in k for part in ("_p_", "_r_", "precision", "recall"))]


# what the comparison's MLflow run logs of each row besides its quality
SUMMARY_FIGURES = ("speedup_bs1", "speedup_batch", "decoder_calls_per_example")


def summary_metrics(result: dict) -> dict[str, float]:
    """What the comparison's MLflow run logs of its rows and its baselines, keyed `<label>/<name>`
    (the label made a valid metric key): the primary and the other shown quality metrics, and of a
    row the speedups where `judge` leaves them and the decoder calls per example."""
    quality = dict.fromkeys([result["primary_metric"], *shown_quality(result["rows"][0]["quality"])])
    metrics = {}
    for entry in [*result["rows"], *result.get("baselines", [])]:
        values = {**{name: entry["quality"][name] for name in quality},
                  **{name: entry.get(name) for name in SUMMARY_FIGURES}}
        label = metric_key_part(entry["label"])
        metrics.update({f"{label}/{name}": value for name, value in values.items()
                        if value is not None})
    return metrics


def markdown(result: dict) -> str:
    """The table: the shown quality (`shown_quality`), speed, work and memory per row, then the
    baselines' quality, with "–" where they have no speed, work or memory."""
    def fmt(value, digits=3):
        return "–" if value is None else f"{value:.{digits}f}"

    examples = result.get("test_examples")
    # per column: its head, the row key it shows (a column shows where some row has it: a result
    # written before a figure was recorded has none) and its cell; the quality columns always show
    columns = [("training", "training", lambda r: r["training"]),
               *((name, None, lambda r, name=name: fmt(r["quality"][name]))
                 for name in shown_quality(result["rows"][0]["quality"])),
               ("ex/s bs1", "examples_per_second_bs1", lambda r: fmt(r["examples_per_second_bs1"], 1)),
               ("ex/s batch", "examples_per_second_batch",
                lambda r: fmt(r["examples_per_second_batch"], 1)),
               ("speedup bs1", "speedup_bs1", lambda r: speedup_cell(r, "speedup_bs1")),
               ("speedup batch", "speedup_batch", lambda r: speedup_cell(r, "speedup_batch")),
               ("calls/ex", "decoder_calls_per_example",
                lambda r: fmt(r["decoder_calls_per_example"], 1)),
               ("reference calls/ex", "reference_calls_per_example",
                lambda r: fmt(r["reference_calls_per_example"], 1)),
               ("tokens/call", "tokens_per_call", lambda r: fmt(r["tokens_per_call"], 2)),
               ("bound hits", "bound_hits",
                lambda r: f"{r['bound_hits']} ({fmt(bound_share(r, examples), 3)})"),
               ("peak MB", "peak_memory_mb", lambda r: fmt(r["peak_memory_mb"], 1)),
               ("trained params", "trained_parameters", lambda r: f"{r['trained_parameters']:,}"),
               ("fit s", "fit_seconds", lambda r: fmt(r["fit_seconds"], 0))]
    columns = [c for c in columns if c[1] is None or any(c[1] in r for r in result["rows"])]
    head = ["decoder", *(name for name, _, _ in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        lines.append("| " + " | ".join([shown_label(r), *(cell(r) for _, _, cell in columns)]) + " |")
    baselines = result.get("baselines", [])
    for b in baselines:  # quality only
        cells = [fmt(b["quality"][name]) if key is None else "baseline" if key == "training" else "–"
                 for name, key, _ in columns]
        lines.append("| " + " | ".join([b["label"], *cells]) + " |")
    flushed = ", denormals flushed to zero" if result["flush_denormal"] else ""
    caption = (f"{result['task']} on {data_name(result['data'])}, model {result['model']}, "
               f"{result['device']}, {result['threads']} threads{flushed}, "
               f"{steps_caption(result['rows'])}, eval batch {result['eval_batch_size']}; "
               f"memory = {result['memory']}")
    notes = [f"- {b['label']}: {described(b)}" for b in baselines]
    if baselines:
        notes.append("- baselines need no model; their outputs are scored as the decoders' are "
                     "(through the tokenizer, cut to the data limits); a row whose "
                     f"{result['primary_metric']} is not above the best baseline's has not learned")
    passes = max((len(r.get(f"{key}_passes") or []) for r in result["rows"] for key in SPEEDUPS),
                 default=0)
    if passes > 1:
        notes.append(f"- speedup: the median over {passes} timing passes, in each of which the rows "
                     f"take turns on every batch, of the row's speed over sequential's in the same "
                     f"pass; in brackets the lowest and the highest pass")
    notes += [f"- {r['label']} (not learned): {r['not_learned']}; its speed is not a decoder's, so "
              f"no speedup is given" for r in result["rows"] if r.get("not_learned")]
    if any(r["decoder"] == "sequential" and r.get("not_learned") for r in result["rows"]):
        notes.append("- speedups are ratios to sequential's speed, which is not a decoder's here: "
                     "none is given")
    if any(r.get("inexact") for r in result["rows"]):
        notes.append("- inexact: top-k acceptance (top_k > 1) keeps draft tokens the model would not "
                     "have chosen; its output is no longer the model's greedy output")
    table = caption + "\n\n" + "\n".join(lines) + "\n"
    return table + counters_table(result) + ("\n" + "\n".join(notes) + "\n" if notes else "")


def speedup_cell(entry: dict, key: str) -> str:
    """A speedup as the table shows it: the median over the timing passes, with the lowest and
    highest pass beside it when there were several ("–" where `judge` gives none)."""
    if entry[key] is None:
        return "–"
    passes = entry.get(f"{key}_passes") or [entry[key]]
    spread = f" ({min(passes):.2f}–{max(passes):.2f})" if len(passes) > 1 else ""
    return f"{entry[key]:.2f}{spread}"


def counters_table(result: dict) -> str:
    """The decoders' own counters over the test split, of the rows that have any, or "": each
    counter per decoder call (`counters_per_call`), a time counter as its share of the decode time
    (`decode_time_shares`), and the share of the draft tokens offered that the verify loop accepted
    where both are counted."""
    counted = [r for r in result["rows"] if r.get("counters_per_call") or r.get("decode_time_shares")]
    if not counted:
        return ""
    per_call = list(dict.fromkeys(name for r in counted for name in r.get("counters_per_call", {})))
    shares = list(dict.fromkeys(name for r in counted for name in r.get("decode_time_shares", {})))
    # (head, value of a row): the accepted share beside the accepted tokens, where both are counted
    columns = [("tokens/call", lambda r: r["tokens_per_call"])]
    for name in per_call:
        columns.append((f"{name}/call", lambda r, name=name: r["counters_per_call"].get(name)))
        if name == "draft_tokens_accepted" and "draft_tokens_offered" in per_call:
            columns.append(("accepted share", lambda r: accepted_share(r["counters_per_call"])))
    columns += [(f"{name} share of decode time", lambda r, name=name: r["decode_time_shares"].get(name))
                for name in shares]
    head = ["decoder", *(name for name, _ in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in counted:
        r = {"counters_per_call": {}, "decode_time_shares": {}, **r}
        values = [value(r) for _, value in columns]
        lines.append("| " + " | ".join([shown_label(r), *("–" if v is None else f"{v:.2f}"
                                                          for v in values)]) + " |")
    return ("\nDecoder counters over the test split, per decoder call (a time counter, *_seconds: "
            "its share of the decode time):\n\n" + "\n".join(lines) + "\n")


def accepted_share(counters: dict) -> float | None:
    """The share of the draft tokens offered that the verify loop accepted; None where a row
    counts neither or was offered none."""
    offered, taken = counters.get("draft_tokens_offered"), counters.get("draft_tokens_accepted")
    return taken / offered if offered and taken is not None else None


def pyplot():
    """matplotlib's pyplot, drawing to files only (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def sweep_series(entries: list[dict], option: str, primary: str) -> dict[str, dict[str, list]]:
    """What the plot of a swept decoder option shows: per series (a decoder, with the values of
    its other swept options) the option's values in the plan's order (`x`) and, at each, the
    `primary` quality metric and the speedups over sequential (None without a sequential row).
    `entries` are a result's rows; a row's swept options are those its label names."""
    series: dict[str, dict[str, list]] = {}
    for entry in entries:
        swept = swept_options(entry["label"])
        if option not in swept:
            continue
        others = {key: entry["options"][key] for key in swept if key != option}
        points = series.setdefault(settings_label(entry["decoder"], others),
                                   {"x": [], "quality": [], "speedup_bs1": [], "speedup_batch": []})
        value = entry["options"][option]
        # numbers on a numeric axis; anything else (a flag) as categories
        points["x"].append(value if isinstance(value, (int, float)) and not isinstance(value, bool)
                           else str(value))
        points["quality"].append(entry["quality"][primary])
        for key in SPEEDUPS:
            points[key].append(entry[key])
    return series


def plot_sweep(series: dict[str, dict[str, list]], option: str, primary: str,
               reference_quality: float | None, batch_size: int, path: Path) -> None:
    """`sweep_series` drawn: quality against the option's value, with sequential's as a grey line,
    and beside it (when there is a sequential row) the speedup over sequential at batch size 1
    (solid) and at `batch_size` (dashed)."""
    plt = pyplot()
    panels = 1 if reference_quality is None else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4), squeeze=False)
    quality = axes[0][0]
    for label, points in series.items():
        line, = quality.plot(points["x"], points["quality"], marker="o", label=label)
        if panels == 2:
            axes[0][1].plot(points["x"], points["speedup_bs1"], marker="o", color=line.get_color(),
                            label=f"{label}, batch size 1")
            axes[0][1].plot(points["x"], points["speedup_batch"], marker="s", ls="--",
                            color=line.get_color(), label=f"{label}, batch size {batch_size}")
    if panels == 2:
        quality.axhline(reference_quality, color="grey", lw=0.8, label="sequential")
        speedup = axes[0][1]
        speedup.axhline(1.0, color="grey", lw=0.8)
        speedup.set_xlabel(option)
        speedup.set_ylabel("speedup over sequential")
        speedup.legend()
    if all(isinstance(x, int) for points in series.values() for x in points["x"]):
        from matplotlib.ticker import MaxNLocator
        for ax in axes[0]:  # no ticks between integer settings (delay 1.5)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    quality.set_xlabel(option)
    quality.set_ylabel(primary)
    quality.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_quality_vs_speed(result: dict, path: Path) -> None:
    """Each row's primary quality against its examples per second at batch size 1, one marker per
    row named in the legend (labels written beside close points would overlap)."""
    plt = pyplot()
    primary = result["primary_metric"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    markers = "osD^vP*Xh<>p"
    for i, r in enumerate(result["rows"]):
        ax.scatter(r["examples_per_second_bs1"], r["quality"].get(primary, 0.0), s=50,
                   marker=markers[i % len(markers)], label=shown_label(r))
    for b in result.get("baselines", []):  # no speed: a level to be above
        ax.axhline(b["quality"][primary], ls="--", lw=0.8, color="grey", label=b["label"])
    ax.set_xlabel("examples per second (batch size 1)")
    ax.set_ylabel(primary)
    ax.set_title(f"{result['task']} on {data_name(result['data'])}, {result['model']}", fontsize=10)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plots(result: dict, stem: Path) -> list[Path]:
    """A result's plots, written beside `stem` (FILE without its suffix): speedup against the
    references' subsequences (where the result records each timed example's seconds), quality
    against speed, and per swept option quality and speedup against its value."""
    plt = pyplot()
    paths = []
    entries = result["rows"]
    reference = next((e for e in entries if e["decoder"] == "sequential"), None)
    # the rows that have speedups (`judge`): none where sequential learned nothing
    timed = [entry for entry in entries
             if entry is not reference and entry["speedup_bs1"] is not None]
    if timed and "target_subsequences" in result:
        fig, ax = plt.subplots(figsize=(6, 4))
        for entry in timed:
            by_count: dict[int, list[float]] = {}
            for n, ref_t, t in zip(result["target_subsequences"], reference["example_seconds_bs1"],
                                   entry["example_seconds_bs1"]):
                by_count.setdefault(n, []).append(ref_t / t)
            xs = sorted(by_count)
            ax.plot(xs, [statistics.mean(by_count[x]) for x in xs], marker="o", label=entry["label"])
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("target subsequences per example")
        ax.set_ylabel("speedup over sequential (batch size 1)")
        ax.legend()
        fig.tight_layout()
        paths.append(stem.with_name(stem.name + "_speedup_vs_subsequences.png"))
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)

    paths.append(stem.with_name(stem.name + "_quality_vs_speed.png"))
    plot_quality_vs_speed(result, paths[-1])

    primary = result["primary_metric"]
    reference_quality = None if reference is None else reference["quality"][primary]
    for option in dict.fromkeys(option for entry in entries for option in swept_options(entry["label"])):
        paths.append(stem.with_name(f"{stem.name}_vs_{option}.png"))
        plot_sweep(sweep_series(entries, option, primary), option, primary, reference_quality,
                   result["eval_batch_size"], paths[-1])
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="write a comparison's FILE.md and its plots "
                                                 "again from its FILE.json (with its rows judged as "
                                                 "learned or not)")
    parser.add_argument("result", help="FILE.json written by tasks.compare")
    parser.add_argument("--baselines", metavar="BASELINES.json",
                        help="judge against these baselines (written by tasks.experiments.baselines "
                             "--out), kept in FILE.json in place of its own")
    args = parser.parse_args(argv)
    path = Path(args.result)
    result = json.loads(path.read_text())
    if args.baselines:
        baselines = Path(args.baselines)
        result = with_baselines(result, json.loads(baselines.read_text()), baselines)
    result = judge(result)
    path.write_text(json.dumps(result, indent=2))
    path.with_suffix(".md").write_text(markdown(result))
    written = plots(result, path.with_suffix(""))
    print(f"wrote {path}, {path.with_suffix('.md')}, {', '.join(map(str, written))}")


if __name__ == "__main__":
    main_guard(main)
