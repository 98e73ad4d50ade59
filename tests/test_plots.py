"""szo.plots: whole-epoch ticks, probe-loss label, log time axis when runs differ by orders of magnitude."""
import szo.plots


def test_training_curve_has_whole_epoch_ticks_and_says_what_the_train_loss_is(tmp_path, figures):
    def hist(bp):
        return [{"epoch": e, "train_loss": 1.0 / e, "test_loss": 1.2 / e, "test_acc": 0.3 * e, "train_time_s": e,
                 "fp": 40 * e, "bp": bp * e} for e in (1, 2, 3)]

    szo.plots.plot_training_curve(hist(bp=0), tmp_path / "zo.png")
    szo.plots.plot_training_curve(hist(bp=1), tmp_path / "bp.png")
    zo, bp = figures
    for ax in (zo.axes[0], zo.axes[2]):
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks)
    assert [t.get_text() for t in zo.axes[2].get_legend().get_texts()] == [
        "train loss (mean over the probes)", "test loss"]
    assert [t.get_text() for t in bp.axes[2].get_legend().get_texts()] == ["train loss", "test loss"]


def test_time_axis_goes_log_when_runs_differ_by_orders_of_magnitude(tmp_path, figures):
    fast = [{"epoch": e, "test_acc": 0.9, "train_time_s": 0.5 * e} for e in (1, 2)]
    slow = [{"epoch": e, "test_acc": 0.8, "train_time_s": 60.0 * e} for e in (1, 2)]
    szo.plots.plot_runs({"fast": [fast], "slow": [slow]}, tmp_path / "a.png")
    szo.plots.plot_runs({"fast": [fast]}, tmp_path / "b.png")
    assert figures[0].axes[1].get_xscale() == "log" and figures[1].axes[1].get_xscale() == "linear"


def test_explained_variance_plot_counts_components_in_whole_numbers(tmp_path, figures):
    from subspace_store.plot import plot_explained_variance

    plot_explained_variance([0.5, 0.2, 0.15, 0.1], tmp_path / "ev.png", title="k=4")
    (fig,) = figures
    ax = fig.axes[0]
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks == [1, 2, 3, 4]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["per component", "cumulative"]
    r = fig.canvas.get_renderer()
    assert fig.legends[0].get_window_extent(r).y1 <= ax.get_window_extent(r).y0  # under the axes
