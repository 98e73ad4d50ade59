"""Explained-variance plot of a subspace (paper Figure 2): per-component bars + cumulative line."""
from __future__ import annotations

import os
from typing import Sequence

from szo import plots

__all__ = ["plot_explained_variance"]


def plot_explained_variance(ratios: Sequence[float], path: str | os.PathLike, *, title: str | None = None) -> None:
    """Write a PNG of the explained-variance ratio of each component and their cumulative sum."""
    import numpy as np


    r = np.asarray([float(x) for x in ratios], dtype=float)
    if r.ndim != 1 or r.size == 0:
        raise ValueError("ratios must be a non-empty sequence of numbers")
    idx = np.arange(1, r.size + 1)
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    try:
        ax.bar(idx, 100 * r, color="#4c72b0", label="per component")
        ax.set_xlabel("principal component")
        plots.integer_ticks(ax.xaxis)
        ax.set_ylabel("explained variance (%)")
        ax2 = ax.twinx()
        ax2.plot(idx, 100 * np.cumsum(r), color="#dd8452", marker="o", markersize=3, label="cumulative")
        ax2.set_ylabel("cumulative explained variance (%)")
        ax2.set_ylim(0, 105)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        if title:
            ax.set_title(title)
        plots.legend_below(fig, h1 + h2, l1 + l2, ncol=2)  # under the axes: the bars and the line fill them
    except BaseException:
        plt.close(fig)
        raise
    plots.save_figure(fig, path, dpi=120, layout=False)  # PNG in memory, close, atomic write
