"""Report plots show every method (issue 13 item 2).

The figures are inspected through matplotlib's artists (``plt.close`` is intercepted, so the test
sees exactly what ``plot_task`` saves): no two methods' data lines may share all coordinates,
every point has a standard-error bar, the chance level is drawn, and accuracies sit on a 0-1 axis.
"""

from __future__ import annotations

import itertools

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.container import ErrorbarContainer

from kvhive.evaluation.report import plot_task
from kvhive.evaluation.results import ResultsSummary


def _record(method, budget, item, value, chance=0.25):
    return {
        "task": "quiz",
        "item_id": item,
        "method": method,
        "budget": budget,
        "metrics": {"acc": value},
        "kind": "choice",
        "main_metric": "acc",
        "higher_is_better": True,
        "chance": chance,
    }


def _summary(budgets, scores, n=4):
    """``scores[method][budget]`` = number of the ``n`` items answered right."""
    records = [_record("full", 1.0, f"i{i}", float(i < 3)) for i in range(n)]
    for method, per_budget in scores.items():
        for budget in budgets:
            records += [_record(method, budget, f"i{i}", float(i < per_budget[budget])) for i in range(n)]
    return ResultsSummary(records)


def _saved_figures(summary, tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(plt, "close", lambda figure=None: figures.append(figure))
    paths = plot_task(summary, "quiz", tmp_path)
    assert len(paths) == len(figures) >= 1
    return figures


def _data_lines(axis):
    """The plotted series: lines with data markers (error-bar caps use '_', reference lines none)."""
    return [line for line in axis.get_lines() if line.get_marker() not in (None, "None", "", " ", "_")]


@pytest.mark.parametrize("budgets", [(0.1, 0.5), (16, 64, 256), (0.1,)], ids=["ratios", "log-tokens", "one-budget"])
def test_methods_with_equal_scores_are_all_visible(budgets, tmp_path, monkeypatch):
    same = {b: 2 for b in budgets}
    summary = _summary(budgets, {"h2o": same, "streamingllm": dict(same), "snapkv": {b: 1 for b in budgets}})
    (figure,) = _saved_figures(summary, tmp_path, monkeypatch)
    axis = figure.axes[0]
    lines = _data_lines(axis)
    assert len(lines) == 3
    coordinates = [tuple(zip(line.get_xdata(), line.get_ydata(), strict=True)) for line in lines]
    for first, second in itertools.combinations(coordinates, 2):
        assert first != second, "two methods drawn on exactly the same points: one hides the other"
    low, high = axis.get_xlim()
    assert all(low < x < high for line in lines for x in line.get_xdata())


def test_error_bars_chance_line_zero_to_one_axis_and_n(tmp_path, monkeypatch):
    summary = _summary((0.2, 0.6), {"h2o": {0.2: 1, 0.6: 3}, "snapkv": {0.2: 2, 0.6: 2}})
    (figure,) = _saved_figures(summary, tmp_path, monkeypatch)
    axis = figure.axes[0]
    containers = [c for c in axis.containers if isinstance(c, ErrorbarContainer)]
    assert len(containers) == 2 and all(c.has_yerr for c in containers)
    # h2o at 0.2: 1 of 4 right -> standard error sqrt(0.25 * 0.75 / 3) = 0.25
    h2o = next(c for c in containers if c.get_label().startswith("h2o"))
    segment = h2o.lines[2][0].get_segments()[0]
    assert segment[1][1] - segment[0][1] == pytest.approx(2 * 0.25)
    labels = [text.get_text() for text in axis.get_legend().get_texts()]
    assert "h2o (n=4)" in labels and "full cache (n=4)" in labels and any(t.startswith("chance") for t in labels)
    chance = [line for line in axis.get_lines() if line.get_label().startswith("chance")]
    assert len(chance) == 1 and set(chance[0].get_ydata()) == {0.25}
    low, high = axis.get_ylim()
    assert low <= 0 and 1 <= high <= 1.1  # accuracies on an honest 0-1 axis
