"""Training curves (matplotlib, Agg backend, atomic PNG writes)."""
from __future__ import annotations

import io
import os
from typing import Any, Mapping, Sequence

from szo.io import atomic_write_bytes

__all__ = ["plot_training_curve", "plot_runs", "pyplot", "save_figure"]


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | os.PathLike, dpi: int = 110) -> None:
    """``tight_layout``, render to PNG in memory, close the figure (also on failure) and write
    the file atomically (a crash never leaves a half PNG)."""
    plt = pyplot()
    try:
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi)
    finally:
        plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def _figure(ncols: int):
    plt = pyplot()
    fig, axes = plt.subplots(1, ncols, figsize=(4.2 * ncols, 3.4))
    return plt, fig, axes


def _save(plt, fig, path: str | os.PathLike) -> None:
    save_figure(fig, path)


def _series(history: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float], list[float]]:
    rows = [r for r in history if r.get(key) is not None]
    return ([r["epoch"] for r in rows], [r["train_time_s"] / 60.0 for r in rows], [r[key] for r in rows])


def plot_training_curve(history: Sequence[Mapping[str, Any]], path: str | os.PathLike, title: str = "") -> None:
    """One run: test accuracy vs epoch and vs training time (min), train/test loss vs epoch."""
    plt, fig, (a1, a2, a3) = _figure(3)
    ep, tm, acc = _series(history, "test_acc")
    a1.plot(ep, [100 * a for a in acc], marker="o", ms=3)
    a1.set(xlabel="epoch", ylabel="test accuracy (%)", title=title)
    a2.plot(tm, [100 * a for a in acc], marker="o", ms=3)
    a2.set(xlabel="training time (min)", ylabel="test accuracy (%)")
    for key in ("train_loss", "test_loss"):
        e, _, v = _series(history, key)
        a3.plot(e, v, label=key.replace("_", " "))
    a3.set(xlabel="epoch", ylabel="loss")
    a3.legend()
    _save(plt, fig, path)


def plot_runs(runs: Mapping[str, Sequence[Mapping[str, Any]]], path: str | os.PathLike, title: str = "") -> None:
    """Several runs on one figure (paper Fig. 3/4): test accuracy vs epoch and vs training time."""
    plt, fig, (a1, a2) = _figure(2)
    for label, history in runs.items():
        ep, tm, acc = _series(history, "test_acc")
        a1.plot(ep, [100 * a for a in acc], marker="o", ms=3, label=label)
        a2.plot(tm, [100 * a for a in acc], marker="o", ms=3, label=label)
    a1.set(xlabel="epoch", ylabel="test accuracy (%)", title=title)
    a2.set(xlabel="training time (min)", ylabel="test accuracy (%)")
    a1.legend(fontsize=7)
    _save(plt, fig, path)
