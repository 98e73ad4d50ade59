"""``szo report``: only like runs share a cell, every cell says n, unlike runs are split with a warning."""
import json

import numpy as np
import pytest

from szo.cli import main
from szo.config import load_recipe, write_config
from szo.report import collect_runs, first_reaching, like_runs, render, table1, table_target, write_report


def make_run(root, name, acc, *, sets=(), label="SZO-CGE", mode="scratch", config=True, results_extra=None):
    """A run directory as `szo recipe` writes it: resolved config.yaml, metrics.jsonl, results.json."""
    d = root / name
    d.mkdir(parents=True)
    cfg = load_recipe("digits-scratch", list(sets))
    if config:
        write_config(cfg, d / "config.yaml")
    hist = [{"epoch": e, "step": 23 * e, "train_loss": 1.0, "test_loss": 1.0, "test_acc": a,
             "train_time_s": 6.0 * e, "fp": 920 * e, "bp": 0} for e, a in enumerate(acc, 1)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in hist))
    best = int(np.argmax(acc))
    (d / "results.json").write_text(json.dumps({
        "label": label, "method": cfg["method"], "mode": mode, "dataset": "digits", "model": "spike_convnet",
        "d": 5082, "seed": cfg["seed"], "epochs": len(acc), "best_test_acc": acc[best],
        "converged_epoch": best + 1, "converged_time_min": 0.1 * (best + 1), "converged_fp": 920 * (best + 1),
        "converged_bp": 0, **(results_extra or {})}))
    return d


def test_like_runs_are_averaged_and_say_n(tmp_path):
    best = [0.981, 0.985, 0.978]
    for seed, b in enumerate(best):  # seeds, progress and where the subspace lives do not split runs
        make_run(tmp_path, f"s{seed}", [0.5, b], sets=[f"seed={seed}", f"progress={seed == 0}",
                                                      f"subspace.root=/tmp/store{seed}"])
    runs = collect_runs([tmp_path])
    assert like_runs(runs)[1] == []
    header, rows = table1(runs)
    assert header[3:] == ["SZO-CGE"]
    expected = f"{100 * np.mean(best):.2f} ± {100 * np.std(best, ddof=1):.2f} (n=3)"
    assert rows[0][3] == expected
    assert expected in render(runs) and "## Notes" not in render(runs)


def test_runs_of_different_length_are_reported_apart_with_a_warning(tmp_path, capsys):
    # the case: a 60-epoch and a 3-epoch run used to be one cell, 80.42 ± 24.16
    make_run(tmp_path, "long", [0.5] * 59 + [0.9751], sets=["train.epochs=60"])
    make_run(tmp_path, "short", [0.3, 0.5, 0.6333], sets=["train.epochs=3"])
    make_run(tmp_path, "short-seed1", [0.3, 0.5, 0.6111], sets=["train.epochs=3", "seed=1"])
    runs = collect_runs([tmp_path])
    labelled, notes = like_runs(runs)
    assert sorted({r["column"] for r in labelled}) == ["SZO-CGE (train.epochs=3)", "SZO-CGE (train.epochs=60)"]
    assert len(notes) == 1 and "differ in train.epochs;" in notes[0] and "not averaged" in notes[0]
    header, rows = table1(runs)
    cells = dict(zip(header, rows[0]))
    assert cells["SZO-CGE (train.epochs=60)"] == "97.51 (n=1)"
    assert cells["SZO-CGE (train.epochs=3)"] == f"{100 * np.mean([0.6333, 0.6111]):.2f} ± " \
                                                f"{100 * np.std([0.6333, 0.6111], ddof=1):.2f} (n=2)"
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "rep")]) == 0
    out, err = capsys.readouterr()
    assert err.startswith("warning: digits / spike_convnet: the 3 SZO-CGE runs (scratch) differ in train.epochs")
    assert "## Notes" in out and "80.42" not in out
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert rep["notes"] == notes
    assert {r["column"] for r in rep["runs"]} == {"SZO-CGE (train.epochs=3)", "SZO-CGE (train.epochs=60)"}


def test_variants_are_named_by_the_fewest_keys_that_tell_them_apart(tmp_path):
    make_run(tmp_path, "a", [0.5], sets=["train.epochs=1", "train.max_steps_per_epoch=3"])
    make_run(tmp_path, "b", [0.8], sets=["train.epochs=2"])
    make_run(tmp_path, "c", [0.8], sets=["train.epochs=2", "szo.mu=0.5"])
    cols = sorted({r["column"] for r in like_runs(collect_runs([tmp_path]))[0]})
    assert cols == ["SZO-CGE (train.epochs=1, szo.mu=0.3)", "SZO-CGE (train.epochs=2, szo.mu=0.3)",
                    "SZO-CGE (train.epochs=2, szo.mu=0.5)"]


def test_bptt_runs_compare_only_what_bptt_uses(tmp_path):
    # a BPTT stage's config.yaml also holds the later SZO stage's settings: those must not split BP runs
    make_run(tmp_path, "bp0", [0.9, 0.95], label="BP", mode="bptt", sets=["train.epochs=5"])
    make_run(tmp_path, "bp1", [0.9, 0.97], label="BP", mode="bptt", sets=["train.epochs=7", "seed=1"])
    make_run(tmp_path, "bp2", [0.9, 0.96], label="BP", mode="bptt", sets=["bptt.lr=0.2"])
    labelled, notes = like_runs(collect_runs([tmp_path]))
    assert sorted(r["column"] for r in labelled if "column" in r) == ["BP (bptt.lr=0.1)"] * 2 + ["BP (bptt.lr=0.2)"]
    assert len(notes) == 1 and "differ in bptt.lr;" in notes[0]


def test_runs_without_config_compare_what_results_json_records(tmp_path):
    make_run(tmp_path, "a", [0.5, 0.6], config=False)
    make_run(tmp_path, "b", [0.5, 0.7], config=False, results_extra={"seed": 1})
    make_run(tmp_path, "c", [0.5, 0.6, 0.7], config=False)
    labelled, notes = like_runs(collect_runs([tmp_path]))
    assert sorted(r["column"] for r in labelled) == ["SZO-CGE (epochs=2)"] * 2 + ["SZO-CGE (epochs=3)"]


def test_more_processes_are_not_averaged_with_one(tmp_path):
    make_run(tmp_path, "one", [0.5, 0.8])
    make_run(tmp_path, "two", [0.5, 0.8], results_extra={"distributed": {"world_size": 2, "mode": "data"}})
    labelled, _ = like_runs(collect_runs([tmp_path]))
    assert sorted(r["column"] for r in labelled) == ["SZO-CGE (processes=1)", "SZO-CGE (processes=2)"]


def test_unreadable_config_is_one_clear_error(tmp_path):
    d = make_run(tmp_path, "a", [0.5])
    (d / "config.yaml").write_text("train: [unclosed\n")
    with pytest.raises(ValueError, match="config.yaml is not valid YAML"):
        collect_runs([tmp_path])


def test_report_plot_one_line_per_cell_legend_under_both_panels(tmp_path, figures):
    for seed in range(2):
        make_run(tmp_path, f"cge{seed}", [0.5, 0.7, 0.8], sets=[f"seed={seed}", "train.epochs=3"])
    make_run(tmp_path, "bp", [0.9, 0.95, 0.96], label="BP", mode="bptt")
    make_run(tmp_path, "short", [0.4, 0.6], sets=["train.epochs=2"])
    write_report(collect_runs([tmp_path]), tmp_path / "rep")
    (fig,) = figures
    a1, a2 = fig.axes
    assert a1.get_legend() is None and a2.get_legend() is None and len(fig.legends) == 1
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert texts == ["BP [bptt] (n=1)", "SZO-CGE (train.epochs=3) [scratch] (n=2)",
                     "SZO-CGE (train.epochs=2) [scratch] (n=1)"]
    assert len(a1.get_lines()) == 3  # the two seeds are one mean line (with a min-max band)
    assert all(float(t).is_integer() for t in a1.get_xticks())
    # the legend sits below the panels, not over them
    r = fig.canvas.get_renderer()
    leg, ax = fig.legends[0].get_window_extent(r), a1.get_window_extent(r)
    assert leg.y1 <= ax.y0


def test_diverged_runs_are_left_out_with_a_warning(tmp_path, capsys):
    make_run(tmp_path, "ok", [0.5, 0.9])
    make_run(tmp_path, "bad", [0.1], results_extra={"status": "diverged", "error": "training diverged at step 3"})
    runs = collect_runs([tmp_path])
    assert [r["dir"] for r in runs] == [str(tmp_path / "ok")]
    assert "left out 1 diverged run(s)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="diverged; nothing to report"):
        collect_runs([tmp_path / "bad"])


@pytest.mark.parametrize("content, phrase", [
    ("[1, 2]", "is a JSON list, not an object"),
    ('"text"', "is a JSON str, not an object"),
    ('{"best_test_acc": "high"}', "'best_test_acc' is 'high', not a number"),
    ("{not json", "is not valid JSON"),
])
def test_results_json_of_the_wrong_shape_is_one_line(tmp_path, capsys, content, phrase):
    from szo.cli import main

    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "results.json").write_text(content)
    assert main(["report", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and phrase in err[0]


def _report_process(run_dir):
    """``szo report RUN_DIR`` in a process with 6 GiB of address space and a time limit: a report
    that reads /dev/zero or waits on a pipe fails the test instead of taking the machine."""
    import resource
    import subprocess
    import sys

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    return subprocess.run([sys.executable, "-m", "szo", "report", str(run_dir)], capture_output=True, text=True,
                          timeout=120, preexec_fn=limit)


@pytest.mark.parametrize("name, target, phrase", [
    ("results.json", "/dev/zero", "results.json is a character device, not a regular file; it is not an szo results"),
    ("metrics.jsonl", "/dev/zero", "metrics.jsonl is a character device, not a regular file; it is not an szo metrics"),
    ("config.yaml", "/dev/zero", "config.yaml is a character device, not a regular file; it is not an szo config"),
    ("results.json", "fifo", "results.json is a named pipe, not a regular file"),
])
def test_run_files_that_are_not_regular_files_are_one_line(tmp_path, name, target, phrase):
    """results.json linked to /dev/zero made `szo report` read until memory ran out; a pipe blocked it."""
    import os

    if not os.path.exists("/dev/zero"):
        pytest.skip("needs /dev/zero")
    d = make_run(tmp_path, "r", [0.5, 0.9])
    (d / name).unlink()
    if target == "fifo":
        os.mkfifo(tmp_path / "fifo")
        target = tmp_path / "fifo"
    (d / name).symlink_to(target)
    r = _report_process(d)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and phrase in err[0], r.stderr[-2000:]


def test_oversized_results_json_is_one_line(tmp_path, monkeypatch):
    import szo.report

    d = make_run(tmp_path, "r", [0.5, 0.9])
    monkeypatch.setattr(szo.report, "MAX_RESULTS_BYTES", 100)
    with pytest.raises(ValueError, match=r"results.json is \d+ bytes, more than the 100 an szo results file may have"):
        collect_runs([d])


def test_symlinked_run_directories_are_reported_once_each(tmp_path):
    """Two runs in place and two linked in from elsewhere: n=4 (it was n=2); a link to a run already
    found and a link loop add nothing."""
    runs, elsewhere = tmp_path / "runs", tmp_path / "elsewhere"
    for i, acc in enumerate((0.91, 0.92)):
        make_run(runs, f"s{i}", [0.5, acc], sets=[f"seed={i}"])
    for i, acc in enumerate((0.93, 0.94), 2):
        make_run(elsewhere, f"s{i}", [0.5, acc], sets=[f"seed={i}"])
        (runs / f"link{i}").symlink_to(elsewhere / f"s{i}", target_is_directory=True)
    (runs / "again").symlink_to(runs / "s0", target_is_directory=True)
    (runs / "loop").symlink_to(runs, target_is_directory=True)
    found = collect_runs([runs])
    assert len(found) == 4
    header, rows = table1(found)
    assert rows[0][3].endswith("(n=4)")
    assert len(collect_runs([runs, elsewhere])) == 4  # named twice, still one run each


def test_report_on_a_federated_run(tmp_path, capsys):
    """A federated run's metrics count rounds (no 'epoch'): `szo report --out` failed with KeyError: 'epoch'."""
    d = tmp_path / "fed"
    d.mkdir()
    write_config(load_recipe("digits-scratch"), d / "config.yaml")
    rows = [{"round": r, "lr": 0.3, "clients": [0, 1, 2], "fp": 18 * r, "wall_time_s": 11.0 + r,
             "test_loss": 2.2, "test_acc": a} for r, a in ((1, 0.4), (2, 0.55))]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "results.json").write_text(json.dumps({
        "method": "baffle", "recipe": "digits-scratch", "clients": 3, "rounds": 2, "d": 5082, "best_test_acc": 0.55,
        "final_test_acc": 0.55, "fp": 36, "bp": 0, "wall_time_min": 0.22, "status": "completed"}))
    assert main(["report", str(d), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "| digits | spike_convnet | 5.1K | 55.00 (n=1) |" in out  # dataset / model from its config.yaml
    assert (tmp_path / "rep" / "accuracy.png").stat().st_size > 1000
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert rep["runs"][0]["method"] == "baffle"


def test_passes_to_a_fraction_of_bp_count_each_method_up_to_its_first_evaluation_there(tmp_path):
    """The forwards (and backwards) up to the first evaluation at 90 / 95 % of the BPTT run's accuracy:
    a mean over the like runs that got there, which say how many of them did."""
    bp = make_run(tmp_path, "bp", [0.5, 0.94, 1.0], label="BP", mode="bptt")
    hist = [json.loads(x) for x in (bp / "metrics.jsonl").read_text().splitlines()]
    for h in hist:
        h["bp"] = h["fp"]  # BPTT: one backward per forward
    (bp / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in hist))
    make_run(tmp_path, "s0", [0.5, 0.91, 0.96], sets=["seed=0"])      # 90 % at epoch 2, 95 % at epoch 3
    make_run(tmp_path, "s1", [0.92, 0.93, 0.94], sets=["seed=1"])     # 90 % at epoch 1, never 95 %
    make_run(tmp_path, "rge", [0.1, 0.2, 0.3], label="SZO-RGE")        # neither
    runs = collect_runs([tmp_path])
    header, rows = table_target(runs)
    assert header == ["Dataset / Model", "Method", "mode", "BP max acc (%)", "#FP to 90 % of BP",
                      "#BP to 90 % of BP", "#FP to 95 % of BP", "#BP to 95 % of BP"]
    by = {r[1]: r for r in rows}
    assert by["BP"][3:] == ["100.00", "1840", "1840", "2760", "2760"]
    assert by["SZO-CGE"][4:] == [f"{(1840 + 920) / 2:.0f} ± {np.std([1840, 920], ddof=1):.0f}", "0 ± 0",
                                 "2760 (1 of 2)", "0"]
    assert by["SZO-RGE"][4:] == ["not reached", "-", "not reached", "-"]
    assert first_reaching(hist, 0.99)["epoch"] == 3 and first_reaching(hist, 1.01) is None
    assert "## Passes to a fraction of BP's accuracy" in render(runs)
    out = write_report(runs, tmp_path / "report")
    assert json.loads(out["json"].read_text())["target"][0]["Method"] == "BP"


def test_without_a_bptt_run_there_is_no_target(tmp_path):
    make_run(tmp_path, "s0", [0.5, 0.9])
    assert table_target(collect_runs([tmp_path]))[1] == []
    assert "Passes to a fraction" not in render(collect_runs([tmp_path]))


def test_a_run_without_results_is_named_with_what_it_holds(tmp_path, capsys):
    """Issue 49: ``szo report`` on a directory with an unfinished run (config.yaml, metrics.jsonl, a
    checkpoint; no results.json) dropped it without a word. It names every run it leaves out and why."""
    make_run(tmp_path, "done", [0.5, 0.9])
    left = tmp_path / "stopped"
    (left / "checkpoints").mkdir(parents=True)
    write_config(load_recipe("digits-scratch"), left / "config.yaml")
    (left / "metrics.jsonl").write_text("")
    runs = collect_runs([tmp_path])
    assert [r["dir"] for r in runs] == [str(tmp_path / "done")]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: left out 1 run(s) without results.json")
    assert f"{left} (holds config.yaml, metrics.jsonl, checkpoints)" in err
    (tmp_path / "done" / "results.json").unlink()
    with pytest.raises(ValueError, match=r"^no results.json under .*left out 2 run\(s\) without results.json.*"
                                         r"done \(holds config.yaml, metrics.jsonl\); .*stopped \(holds"):
        collect_runs([tmp_path])


def test_passes_to_target_leave_out_a_figure_that_is_not_a_number(tmp_path):
    """Issue 49: a metrics row with ``"fp": "n/a"`` crashed the passes-to-target table."""
    make_run(tmp_path, "bp", [0.9, 0.95], label="BP", mode="bptt")
    d = make_run(tmp_path, "szo", [0.5, 0.96])
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    rows[1]["fp"] = "n/a"
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    header, table = table_target(collect_runs([tmp_path]))
    row = dict(zip(header, next(r for r in table if r[1] == "SZO-CGE")))
    assert row["#FP to 95 % of BP"] == "-" and row["#BP to 95 % of BP"] == "0"
