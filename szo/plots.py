"""Training curves (matplotlib, Agg backend, atomic PNG writes)."""
from __future__ import annotations

import io
import os
from typing import Any, Mapping, Sequence

from szo.io import atomic_write_bytes

__all__ = ["plot_training_curve", "plot_runs", "pyplot", "save_figure", "integer_ticks", "log_if_spread",
           "legend_below", "MARKERS", "LINESTYLES"]


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | os.PathLike, dpi: int = 110, *, layout: bool = True) -> None:
    """``tight_layout`` (unless ``layout=False``: the caller laid the figure out, e.g.
    :func:`legend_below`), render to PNG in memory, close the figure (also on failure) and
    write the file atomically (a crash never leaves a half PNG)."""
    plt = pyplot()
    try:
        if layout:
            fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi)
    finally:
        plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def _figure(ncols: int):
    return pyplot().subplots(1, ncols, figsize=(4.2 * ncols, 3.4))


# line styles that stay apart when curves overlap (colour, marker and dash all change)
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", "-.", ":")


def integer_ticks(axis) -> None:
    """Whole-number ticks only (epochs, indices): never 1.5 epochs."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def log_if_spread(ax, values: Sequence[float], ratio: float = 30.0) -> bool:
    """Log x scale when the positive ``values`` span more than ``ratio`` (a fast run's points
    would otherwise sit in one cluster at 0 next to a slow run's)."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    pos = [v for v in values if v > 0]
    if pos and max(pos) / min(pos) > ratio:
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 0.01, not 10^-2
        ax.xaxis.set_minor_formatter(NullFormatter())
        return True
    return False


def legend_below(fig, handles, labels, ncol: int | None = None) -> None:
    """One legend for all panels, under them (never over the data), and the figure's layout
    (save it with ``save_figure(..., layout=False)``)."""
    if not handles:
        fig.tight_layout()
        return
    ncol = ncol or min(len(labels), 3)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    rows = -(-len(labels) // ncol)
    fig.tight_layout(rect=(0, min(0.5, (0.12 + 0.22 * rows) / fig.get_figheight()), 1, 1))


def _series(history: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float], list[float]]:
    rows = [r for r in history if r.get(key) is not None]
    return ([r["epoch"] for r in rows], [r["train_time_s"] / 60.0 for r in rows], [r[key] for r in rows])


def plot_training_curve(history: Sequence[Mapping[str, Any]], path: str | os.PathLike, title: str = "") -> None:
    """One run: test accuracy vs epoch and vs training time (min), train/test loss vs epoch."""
    fig, (a1, a2, a3) = _figure(3)
    ep, tm, acc = _series(history, "test_acc")
    a1.plot(ep, [100 * a for a in acc], marker="o", ms=3)
    a1.set(xlabel="epoch", ylabel="test accuracy (%)", title=title)
    a2.plot(tm, [100 * a for a in acc], marker="o", ms=3)
    a2.set(xlabel="training time (min)", ylabel="test accuracy (%)")
    # forward-only training (no backward pass) averages its train loss over the perturbed probes
    probes = bool(history) and history[-1].get("bp") == 0 and bool(history[-1].get("fp"))
    for key, ls, label in (("train_loss", "-", "train loss" + (" (mean over the probes)" if probes else "")),
                           ("test_loss", "--", "test loss")):
        e, _, v = _series(history, key)
        a3.plot(e, v, ls=ls, marker="o", ms=3, label=label)
    a3.set(xlabel="epoch", ylabel="loss")
    a3.legend(fontsize=8)
    integer_ticks(a1.xaxis)
    integer_ticks(a3.xaxis)
    save_figure(fig, path)


def _mean_curve(histories: Sequence[Sequence[Mapping[str, Any]]]):
    """Epochs evaluated in every run; there the mean, min and max test accuracy (%) and the mean
    training time (min)."""
    per = [{r["epoch"]: (100.0 * r["test_acc"], r["train_time_s"] / 60.0) for r in h if r.get("test_acc") is not None}
           for h in histories]
    epochs = sorted(set.intersection(*(set(p) for p in per))) if per else []
    acc = [[p[e][0] for p in per] for e in epochs]
    return (epochs, [sum(a) / len(a) for a in acc], [min(a) for a in acc], [max(a) for a in acc],
            [sum(p[e][1] for p in per) / len(per) for e in epochs])


def plot_runs(runs: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]], path: str | os.PathLike,
              title: str = "") -> None:
    """Several methods on one figure (paper Fig. 3/4): test accuracy vs epoch and vs training
    time. ``runs`` maps a label to the histories of its like runs (e.g. seeds): the line is their
    mean, the band their min-max, the legend (under both panels) says n."""
    fig, (a1, a2) = pyplot().subplots(1, 2, figsize=(10, 3.8 + 0.25 * (len(runs) // 3)))
    handles, labels, all_times = [], [], []
    for j, (label, histories) in enumerate(runs.items()):
        ep, mean, lo, hi, tm = _mean_curve(histories)
        style = dict(marker=MARKERS[j % len(MARKERS)], ls=LINESTYLES[(j // len(MARKERS)) % len(LINESTYLES)], ms=4,
                     markevery=max(1, len(ep) // 15))  # a 60-epoch run: markers, not a solid bead chain
        h, = a1.plot(ep, mean, **style)
        a2.plot(tm, mean, color=h.get_color(), **style)
        if len(histories) > 1:
            a1.fill_between(ep, lo, hi, color=h.get_color(), alpha=0.15, lw=0)
            a2.fill_between(tm, lo, hi, color=h.get_color(), alpha=0.15, lw=0)
        handles.append(h)
        labels.append(f"{label} (n={len(histories)})")
        all_times += tm
    a1.set(xlabel="epoch", ylabel="test accuracy (%)")
    integer_ticks(a1.xaxis)
    log = log_if_spread(a2, all_times)
    a2.set(xlabel="training time (min" + (", log scale)" if log else ")"), ylabel="test accuracy (%)")
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    legend_below(fig, handles, labels)
    save_figure(fig, path, layout=False)
