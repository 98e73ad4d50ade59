"""Shared fixtures."""
import pytest


@pytest.fixture
def figures(monkeypatch):
    """The matplotlib figures ``szo.plots.save_figure`` would write, kept open for inspection
    (legend texts, ticks, positions) instead of being saved; closed after the test."""
    import szo.plots

    got = []

    def keep(fig, path, dpi=110, *, layout=True):
        if layout:
            fig.tight_layout()
        fig.canvas.draw()
        got.append(fig)

    monkeypatch.setattr(szo.plots, "save_figure", keep)
    yield got
    for f in got:
        szo.plots.pyplot().close(f)
