"""`tasks.comparison.headline`: several comparisons' JSON in, one figure (a panel per file, a point
per row with a speedup, a dashed line per baseline) and one compact table out."""
import json

from matplotlib.collections import PathCollection

from tasks.comparison import headline


def comparison(task: str, metric: str, rows: dict, baselines: dict) -> dict:
    """A comparison's JSON as the command reads it: rows (label: quality, speedup at batch size 1,
    speedup at the batch size) and baselines (label: quality); other keys are not read."""
    return {"task": task, "primary_metric": metric,
            "rows": [{"label": label, "quality": {metric: q, "other": 0.0},
                      "speedup_bs1": s1, "speedup_batch": sb}
                     for label, (q, s1, sb) in rows.items()],
            "baselines": [{"label": label, "quality": {metric: q, "other": 0.0}}
                          for label, q in baselines.items()]}


KEYPHRASE = comparison("keyphrase", "present_f1_at_M",
                       {"sequential": (0.9, 1.0, 1.0), "pipelined": (0.91, 1.5, 1.2),
                        "nar": (0.5, 2.0, 0.8)},
                       {"baseline: constant": 0.06, "baseline: frequent": 0.03})
# a row that did not learn has no speedup (`report.judge`): in the table, not on the plot
SUMMARIZATION = comparison("summarization", "rougeL",
                           {"sequential": (0.7, 1.0, 1.0), "pipelined": (0.1, None, None)},
                           {"baseline: lead-3": 0.3})


def test_the_headline_draws_a_point_per_timed_row_and_a_line_per_baseline(tmp_path, capsys):
    paths = []
    for name, result in (("kp", KEYPHRASE), ("sum", SUMMARIZATION)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(result))
    out = tmp_path / "images" / "headline.png"
    headline.main([*map(str, paths), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    table = capsys.readouterr().out.splitlines()
    assert table[0] == "| decoder | keyphrase: present F1@M | summarization: ROUGE-L |"
    assert table[2:7] == ["| sequential | 0.900 · 1.00× / 1.00× | 0.700 · 1.00× / 1.00× |",
                          "| pipelined | 0.910 · 1.50× / 1.20× | 0.100 · – / – |",
                          "| nar | 0.500 · 2.00× / 0.80× |  |",
                          "| baseline: constant | 0.060 |  |",
                          "| baseline: frequent | 0.030 |  |"]

    panels = [headline.panel(KEYPHRASE), headline.panel(SUMMARIZATION)]
    figure = headline.headline_figure(panels)
    keyphrase, summarization = figure.axes
    points = {ax: sorted(tuple(xy) for c in ax.collections if isinstance(c, PathCollection)
                         for xy in c.get_offsets()) for ax in figure.axes}
    assert points[keyphrase] == [(1.0, 0.9), (1.5, 0.91), (2.0, 0.5)]
    assert points[summarization] == [(1.0, 0.7)]
    dashed = {ax: sorted(line.get_ydata()[0] for line in ax.lines if line.get_linestyle() == "--")
              for ax in figure.axes}
    assert dashed == {keyphrase: [0.03, 0.06], summarization: [0.3]}
    assert {t.get_text() for t in summarization.texts} == {"baseline: lead-3"}
    assert "× sequential" in keyphrase.get_xlabel() and keyphrase.get_ylabel() == "present F1@M"
    # one legend for the figure, a decoder once, in the same colour in every panel
    assert [t.get_text() for t in figure.legends[0].get_texts()] == ["sequential", "pipelined", "nar"]


def test_a_comparison_of_another_model_is_named_in_its_title():
    """Comparisons of one task on two models side by side: the default model's panel is titled by
    its task, another model's by its task and model."""
    titles = [headline.panel(result)["title"]
              for result in (KEYPHRASE, {**KEYPHRASE, "model": "t5-tiny"},
                             {**KEYPHRASE, "model": "bart-tiny"})]
    assert titles == ["keyphrase", "keyphrase", "keyphrase, bart-tiny"]
