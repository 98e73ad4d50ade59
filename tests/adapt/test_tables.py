"""tta_accuracy.png: methods that agree to a point stay apart, legends beside the data."""
from __future__ import annotations

import numpy as np

from szo.adapt.tables import SHORT_NAMES, plot_accuracy

CORRUPTIONS = list(SHORT_NAMES)[:6]
METHODS = ["none", "bn", "tent", "bp-subspace", "szo-cge", "szo-rge"]


def results() -> dict:
    rng = np.random.default_rng(0)
    base = rng.uniform(0.3, 0.9, len(CORRUPTIONS))
    out = {}
    for setting in ("reset", "continual"):
        out[setting] = {}
        for j, m in enumerate(METHODS):
            acc = base - 0.3 if m == "none" else np.clip(base + 0.01 * (j - 3), 0, 1)
            out[setting][m] = {"per_corruption": dict(zip(CORRUPTIONS, map(float, acc))),
                               "average": float(acc.mean()), "fp": 1, "bp": 0}
    return {"dataset": "digits-c", "model": "spike_convnet", "severity": 5, "corruptions": CORRUPTIONS,
            "methods": METHODS, "settings": ["reset", "continual"], "config": {"q": 10}, "results": out}


def test_tta_plot_keeps_close_methods_apart_and_legend_off_the_data(tmp_path, figures):
    res = results()
    plot_accuracy(res, tmp_path / "tta.png")
    (fig,) = figures
    axes = fig.axes
    assert len(axes) == 4  # per setting: accuracy, and difference to BN
    r = fig.canvas.get_renderer()
    for setting, acc_ax, diff_ax in zip(res["settings"], axes[0::2], axes[1::2]):
        leg = acc_ax.get_legend()
        assert leg.get_window_extent(r).x0 >= acc_ax.get_window_extent(r).x1  # beside the panel
        avg = {m: 100 * v["average"] for m, v in res["results"][setting].items()}
        assert [t.get_text() for t in leg.get_texts()] == [
            f"No adapt.: {avg['none']:.1f}", f"BN: {avg['bn']:.1f}", f"Tent (BP): {avg['tent']:.1f}",
            f"BP-Subspace: {avg['bp-subspace']:.1f}", f"SZO-CGE: {avg['szo-cge']:.1f}",
            f"SZO-RGE (q=10): {avg['szo-rge']:.1f}"]
        # the adapting methods sit side by side at each corruption, not on top of each other
        xs = [tuple(np.round(line.get_xdata(), 6)) for line in acc_ax.get_lines()]
        assert len(xs) == 5 and len(set(x[0] for x in xs)) == 5
        # the difference panel: Tent, BP-Subspace, SZO-CGE, SZO-RGE minus BN, in points
        diffs = [line for line in diff_ax.get_lines() if len(line.get_xdata()) == len(CORRUPTIONS)]
        got = sorted(round(float(np.mean(line.get_ydata())), 6) for line in diffs)
        assert np.allclose(got, [1.0, 2.0, 3.0, 4.0])  # methods j = 2..5 lie 0.01 * (j - 1) above BN
    assert [t.get_text() for t in axes[-1].get_xticklabels()] == [SHORT_NAMES[c] for c in CORRUPTIONS]


def test_tta_plot_of_one_method_has_no_difference_panel(tmp_path, figures):
    for only in (["szo-cge"], ["none"]):
        res = results()
        res["methods"] = only
        res["results"] = {s: {m: v[m] for m in only} for s, v in res["results"].items()}
        plot_accuracy(res, tmp_path / "one.png")
        assert len(figures[-1].axes) == 2  # one accuracy panel per setting
