"""Several comparisons in one figure: each row's quality against its speedup over sequential, one
panel per comparison file (one per task, or per model of a task: a model other than t5-tiny is
named in its panel's title), each baseline a dashed line labelled by name; and the
same figures as one compact markdown table (decoder by file: quality, speedup at batch size 1 and
at the comparison's batch size), printed.

    python -m tasks.comparison.headline results/builtin_keyphrase.json results/builtin_qa.json \
        results/builtin_summarization.json --out docs/images/headline.png

It reads of each file only the rows' and baselines' `label` and `quality` (the primary metric, the
file's `primary_metric` or else its task's), the rows' `speedup_bs1` and `speedup_batch`, and
`task`. A row without a speedup (its model did not learn, `report.judge`) is left out of its panel
and shows "–" in the table.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tasks.cli import main_guard
from tasks.config import DEFAULT_CHOICES
from tasks.comparison.report import primary_metric, pyplot, shown_label

# how the figure and the table name a task and its primary metric (the key itself otherwise)
TASK_NAMES = {"keyphrase": "keyphrase", "qa": "multi-span QA", "summarization": "summarization"}
METRIC_NAMES = {"present_f1_at_M": "present F1@M", "em_f1": "EM F1", "rougeL": "ROUGE-L"}
MARKERS = "osD^vP*Xh<>p"


def panel(result: dict) -> dict:
    """What one comparison's panel and table column show: its title, its metric's name, per row
    (label, quality, speedup at batch size 1, speedup at the comparison's batch size) and per
    baseline (label, quality)."""
    primary = result.get("primary_metric") or primary_metric(result["task"])
    title = TASK_NAMES.get(result["task"], result["task"])
    if result.get("model", DEFAULT_CHOICES["model"]) != DEFAULT_CHOICES["model"]:   # another model: named
        title = f"{title}, {result['model']}"
    return {"title": title,
            "metric": METRIC_NAMES.get(primary, primary),
            "rows": [(shown_label(r), r["quality"][primary], r["speedup_bs1"], r["speedup_batch"])
                     for r in result["rows"]],
            "baselines": [(b["label"], b["quality"][primary]) for b in result.get("baselines", [])]}


def row_labels(panels: list[dict]) -> list[str]:
    """The rows' labels over all panels, each once, in the order they first come."""
    return list(dict.fromkeys(label for p in panels for label, *_ in p["rows"]))


def plot_headline(panels: list[dict], path: Path) -> None:
    """`headline_figure` written to `path`."""
    plt = pyplot()
    fig = headline_figure(panels)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def headline_figure(panels: list[dict]):
    """One panel per comparison side by side: each row's quality against its speedup at batch size
    1, a decoder in the same colour and marker in every panel (one legend below them all), a grey
    line at sequential's speed, and each baseline a dashed line labelled with its name."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.9), squeeze=False)
    labels = row_labels(panels)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    style = {label: (colors[i % len(colors)], MARKERS[i % len(MARKERS)])
             for i, label in enumerate(labels)}
    for ax, p in zip(axes[0], panels):
        drawn = [(label, quality, speedup) for label, quality, speedup, _ in p["rows"]
                 if speedup is not None]
        for label, quality, speedup in drawn:
            color, marker = style[label]
            ax.scatter(speedup, quality, s=60, color=color, marker=marker, label=label, zorder=3,
                       edgecolors="black", linewidths=0.4)
        right = max([speedup for *_, speedup in drawn] + [1.0]) * 1.15
        ax.set_xlim(0, right)
        ax.set_ylim(0, 1.02)
        ax.axvline(1.0, color="grey", lw=0.8, zorder=1)
        # no speed: a level to be above, labelled over its line, at the right and the left end in
        # turn from the highest down (baselines often score alike)
        for i, (label, quality) in enumerate(sorted(p["baselines"], key=lambda b: -b[1])):
            ax.axhline(quality, ls="--", lw=0.9, color="grey", zorder=1)
            ax.text(right * (0.98 if i % 2 == 0 else 0.02), quality, label, va="bottom",
                    ha="right" if i % 2 == 0 else "left", fontsize=8, color="dimgrey",
                    bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 0.5})
        ax.set_title(p["title"], fontsize=11)
        ax.set_xlabel("speedup (× sequential, batch size 1)")
        ax.set_ylabel(p["metric"])
        ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], ls="", marker=style[label][1], color=style[label][0],
                          markeredgecolor="black", markeredgewidth=0.4, markersize=8, label=label)
               for label in labels]
    fig.legend(handles=handles, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def headline_table(panels: list[dict]) -> str:
    """Decoder by comparison, each cell the quality and the speedups at batch size 1 and at the
    comparison's batch size ("–" where a row has none); the baselines' rows have quality only."""
    def cell(quality, *speedups) -> str:
        if quality is None:
            return ""
        shown = " / ".join("–" if s is None else f"{s:.2f}×" for s in speedups)
        return f"{quality:.3f}" + (f" · {shown}" if speedups else "")

    labels = row_labels(panels)
    baselines = list(dict.fromkeys(label for p in panels for label, _ in p["baselines"]))
    lines = ["| decoder | " + " | ".join(f"{p['title']}: {p['metric']}" for p in panels) + " |",
             "|---" * (len(panels) + 1) + "|"]
    for label in labels:
        rows = [{r[0]: r[1:] for r in p["rows"]}.get(label, (None,)) for p in panels]
        lines.append(f"| {label} | " + " | ".join(cell(*row) for row in rows) + " |")
    for label in baselines:
        values = [dict(p["baselines"]).get(label) for p in panels]
        lines.append(f"| {label} | " + " | ".join(cell(v) for v in values) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="several comparisons' quality against speedup "
                                                 "in one figure, and one compact table (printed)")
    parser.add_argument("results", nargs="+", metavar="FILE.json", help="written by tasks.compare")
    parser.add_argument("--out", required=True, metavar="F.png", help="where to write the figure")
    args = parser.parse_args(argv)
    panels = [panel(json.loads(Path(path).read_text())) for path in args.results]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot_headline(panels, out)
    print(headline_table(panels), end="")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main_guard(main)
