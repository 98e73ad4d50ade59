"""The run-directory contract (docs/runs.md): one writer, resume that checks what it resumes,
checksummed checkpoints, validation before compute, one line for a diverged run."""
import json
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from szo.cli import main
from szo.config import load_recipe
from szo.pipeline import run_recipe
from szo.rundir import ResumeMismatchError, RunLockedError, config_differences, run_lock
from szo.train import Callback, checkpoint_path, checksum_path

TINY = ["model.T=2", "model.kwargs={width: 4}", "progress=false", "data.batch_size=32", "data.test_batch_size=120"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A tiny BPTT run and its k=6 subspace in a store."""
    root = tmp_path_factory.mktemp("rundir")
    sets = TINY + [f"subspace.root={root / 'subspaces'}", "bptt.epochs=2", "bptt.max_steps_per_epoch=6",
                   "trajectory.every=1", "subspace.k=6", "bptt.lr=0.5"]
    run_recipe(load_recipe("digits-bp", sets), root / "bp")
    return root, sets


def _sets(store, *extra):
    _, sets = store
    out = []
    for s in list(sets) + ["train.epochs=2", "train.max_steps_per_epoch=4", "train.checkpoint_every_steps=2"] \
            + list(extra):
        out += ["--set", s]
    return out


def _one_error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


class _Interrupt(Callback):
    """A callback that stops the run (as Ctrl-C would) right after optimizer step ``at``."""

    def __init__(self, at):
        self.at = at

    def on_step_end(self, step, epoch, loss):
        if step == self.at:
            raise KeyboardInterrupt


# ----------------------------------------------------------------------------- lock
def _holder(d):
    code = ("import sys, time\nfrom szo.rundir import run_lock\n"
            f"with run_lock({str(d)!r}):\n    print('held', flush=True)\n    time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_second_writer_refused_and_stale_lock_taken_over(tmp_path, capsys):
    p = _holder(tmp_path)
    try:
        with pytest.raises(RunLockedError, match=f"in use by another szo run \\(pid {p.pid} on host") as e:
            with run_lock(tmp_path):
                pass
        assert "\n" not in str(e.value)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    capsys.readouterr()
    with run_lock(tmp_path):  # the holder died without cleaning up: its record is stale
        err = capsys.readouterr().err
        assert f"taking over the stale lock of {tmp_path}: its holder (pid {p.pid}" in err
        with run_lock(tmp_path):  # re-entrant inside one process (recipe -> stage)
            pass
    with run_lock(tmp_path):  # a clean exit leaves no holder: no takeover message
        assert capsys.readouterr().err == ""


def test_cli_second_run_on_same_out_is_one_line(store, tmp_path, capsys):
    p = _holder(tmp_path / "run")
    try:
        code = main(["recipe", "digits-scratch", "--out", str(tmp_path / "run")] + _sets(store))
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert code == 2 and f"pid {p.pid}" in _one_error_line(capsys)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ----------------------------------------------------------------------------- resume
def test_config_differences():
    a = load_recipe("digits-scratch")
    assert config_differences(a, load_recipe("digits-scratch", ["device=cpu", "progress=false",
                                                                "train.eval_every=2", "data.num_workers=1"])) == []
    assert config_differences(a, load_recipe("digits-scratch", ["method=szo-rge"]))[0][:3] == \
        ("method", "szo-cge", "szo-rge")
    # cosine: the schedule's length is part of the run; constant: extending is the longer run
    assert [d[0] for d in config_differences(a, load_recipe("digits-scratch", ["train.epochs=30"]))] == ["train.epochs"]
    c = load_recipe("digits-scratch", ["train.scheduler=constant"])
    assert config_differences(c, load_recipe("digits-scratch", ["train.scheduler=constant", "train.epochs=30"])) == []
    assert config_differences(c, load_recipe("digits-scratch", ["train.scheduler=constant", "train.epochs=3"]))
    # the BPTT stage does not look at the subspace stage's method
    assert config_differences(a, load_recipe("digits-scratch", ["method=szo-rge"]), stage="bptt") == []
    # nor at TT-ZO's settings (a BPTT run written before tt.cge existed resumes under today's schema)
    old = a.to_dict() if hasattr(a, "to_dict") else dict(a)
    old["tt"] = {k: v for k, v in old["tt"].items() if k != "cge"}
    assert config_differences(old, a, stage="bptt") == []
    assert [d[0] for d in config_differences(old, a, stage="subspace")] == ["tt.cge"]


def test_resume_takes_the_runs_own_config_and_is_exact(store, tmp_path, capsys, monkeypatch):
    """README-style: a --set method=szo-rge run, interrupted, resumed without the --set,
    continues as SZO-RGE and ends where the uninterrupted run ends."""

    rge = ["method=szo-rge", "szo.q=2"]
    assert main(["recipe", "digits-scratch", "--out", str(tmp_path / "ref")] + _sets(store, *rge)) == 0
    assert main(["recipe", "digits-scratch", "--out", str(tmp_path / "run")] + _sets(store, *rge),
                callbacks=[_Interrupt(7)]) == 130
    capsys.readouterr()
    # refused: an override that changes what was trained, named with both values
    assert main(["recipe", "digits-scratch", "--out", str(tmp_path / "run"), "--resume", "--set", "method=szo-cge"]) == 2
    line = _one_error_line(capsys)
    assert "method is 'szo-rge' in its config.yaml but 'szo-cge' now" in line
    assert main(["recipe", "digits-scratch", "--out", str(tmp_path / "run"), "--resume", "--set", "train.lr=0.5"]) == 2
    assert "train.lr is 0.03 in its config.yaml but 0.5 now" in _one_error_line(capsys)
    assert main(["recipe", "digits-bp", "--out", str(tmp_path / "run"), "--resume"]) == 2
    assert "holds a run of recipe 'digits-scratch', not 'digits-bp'" in _one_error_line(capsys)
    # accepted: the run's own config plus harmless keys
    assert main(["recipe", "digits-scratch", "--out", str(tmp_path / "run"), "--resume",
                 "--set", "progress=false", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"resuming {tmp_path / 'run'} after step 6: epoch 2 of 2, 2 of its 4 steps done (method szo-rge)" in out
    ref = json.loads((tmp_path / "ref" / "results.json").read_text())
    got = json.loads((tmp_path / "run" / "results.json").read_text())
    assert got["label"] == "SZO-RGE(q=2)" and got["status"] == "completed"
    for key in ("fp", "steps", "best_test_acc", "final_test_acc"):
        assert got[key] == ref[key], key
    a = torch.load(checkpoint_path(tmp_path / "ref"), weights_only=True)["model"]
    b = torch.load(checkpoint_path(tmp_path / "run"), weights_only=True)["model"]
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_checkpoint_of_another_method_is_refused(store, tmp_path, capsys):
    root, _ = store
    assert main(["recipe", "digits-scratch", "--out", str(tmp_path / "run")] + _sets(store)) == 0
    capsys.readouterr()
    for name in ("last.pt", "last.json"):  # a BPTT checkpoint (with its record) copied into the SZO run
        shutil.copy(root / "bp" / "checkpoints" / name, tmp_path / "run" / "checkpoints" / name)
    assert main(["recipe", "digits-scratch", "--out", str(tmp_path / "run"), "--resume"]) == 2
    assert "was written by method 'bp', this run trains with 'szo-cge'" in _one_error_line(capsys)


def test_tampered_checkpoint_is_one_line(store, tmp_path, capsys):
    assert main(["recipe", "digits-scratch", "--out", str(tmp_path / "run")] + _sets(store)) == 0
    capsys.readouterr()
    p = checkpoint_path(tmp_path / "run")
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x10
    p.write_bytes(bytes(data))
    assert main(["recipe", "digits-scratch", "--out", str(tmp_path / "run"), "--resume"]) == 2
    assert "does not match the sha256 in last.json" in _one_error_line(capsys)
    p.write_bytes(b"")
    assert main(["recipe", "digits-scratch", "--out", str(tmp_path / "run"), "--resume"]) == 2
    assert "is empty" in _one_error_line(capsys)
    checksum_path(p).unlink()
    assert main(["recipe", "digits-scratch", "--out", str(tmp_path / "run"), "--resume"]) == 2
    assert "has no sha256 record" in _one_error_line(capsys)


# ----------------------------------------------------------------------------- validation first
def test_k_checked_before_bptt(store, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["recipe", "digits-scratch", "--out", str(out)]
                + _sets(store, "subspace.name=other", "subspace.k=13")) == 2
    line = _one_error_line(capsys)
    assert "subspace.k=13 needs at least k+1 = 14 trajectory samples, but the BPTT stage will record N = 13" in line
    assert "choose subspace.k <= 12" in line
    assert not checkpoint_path(out / "bptt").exists() and not (out / "bptt" / "trajectory").exists()


def test_planned_samples_match_the_recorder(store):
    from szo.trajectory import Trajectory, planned_samples

    root, _ = store
    assert planned_samples(2, 6, every=1) == len(Trajectory(root / "bp" / "trajectory")) == 13
    assert planned_samples(10, 23, every=10) == 24  # digits-bp's comment: steps 0, 10, ..., 230
    assert planned_samples(3, 5, every="epoch", record_initial=False) == 3
    assert planned_samples(4, 5, every=2, window="2-3") == 5  # steps 11..20 -> 12, 14, 16, 18, 20


def _recorded(epochs, spe, every, record_initial, window):
    """What a TrajectoryRecorder writes, step by step (the rule planned_samples counts in closed form)."""
    inside = (lambda e: True) if window is None else (lambda e: window[0] <= e <= window[1])
    n = int(record_initial and inside(0))
    if every == "epoch":
        return n + sum(inside(e) for e in range(1, epochs + 1))
    return n + sum(inside((s - 1) // spe) for s in range(1, epochs * spe + 1) if s % every == 0)


def test_planned_samples_is_a_closed_form(store, capsys):
    """The count equals the step-by-step rule on every small case, and costs nothing for any number of
    epochs: bptt.epochs=1e9 with a subspace.k beyond it is refused in one line at once (it once spun for
    minutes in an O(epochs) count before anything was written)."""
    import itertools

    from szo.trajectory import planned_samples

    windows = [None, (0, 0), (0, 3), (1, 2), (2, 9), (5, 7)]
    for e, spe, every, ri, w in itertools.product(range(1, 6), range(1, 5), ["epoch", 1, 2, 3, 7], (True, False),
                                                  windows):
        assert planned_samples(e, spe, every=every, record_initial=ri, window=w) == _recorded(e, spe, every, ri, w)
    assert planned_samples(10 ** 18, 15, every=10) == 15 * 10 ** 17 + 1  # a loop over the epochs would never end
    assert planned_samples(10 ** 18, 15, window=(10, 10 ** 17)) == 10 ** 17 - 9
    root, sets = store
    assert main(["recipe", "digits-bp", "--out", str(root / "huge")] + [a for s in sets for a in ("--set", s)]
                + ["--set", "bptt.epochs=1000000000", "--set", "subspace.k=1000000000000", "--set", "subspace.name=huge"]) == 2
    assert "subspace.k=1000000000000 needs at least k+1 = 1000000000001 trajectory samples" in _one_error_line(capsys)


def test_resumed_bptt_checks_trajectory_hashes_first(store, tmp_path, capsys):
    root, _ = store
    run = tmp_path / "bp"
    shutil.copytree(root / "bp", run)
    f = run / "trajectory" / "sample_000003.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01
    f.write_bytes(bytes(data))
    before = (run / "metrics.jsonl").read_bytes()
    assert main(["recipe", "digits-bp", "--out", str(run), "--resume"]) == 2
    assert f"sample file {f} is corrupt" in _one_error_line(capsys)
    assert (run / "metrics.jsonl").read_bytes() == before


def test_incomplete_store_entry_visible_removable_and_named_by_recipe(store, tmp_path, capsys):
    root, _ = store
    sroot = root / "subspaces"
    (sroot / "half-written").mkdir()
    assert main(["subspace", "ls", "--root", str(sroot)]) == 0
    assert "half-written" in capsys.readouterr().out
    assert main(["recipe", "digits-scratch", "--out", str(tmp_path / "run")]
                + _sets(store, "subspace.name=half-written")) == 2
    assert f"szo subspace rm half-written --root {sroot}" in _one_error_line(capsys)
    assert not (tmp_path / "run" / "bptt" / "checkpoints").exists()
    assert main(["subspace", "rm", "half-written", "--root", str(sroot)]) == 0
    assert not (sroot / "half-written").exists()


# ----------------------------------------------------------------------------- divergence
@pytest.mark.parametrize("method", ["bp", "bp-subspace", "szo-cge", "szo-rge", "szo-1pt", "zo-cge", "zo-rge"])
def test_diverged_run_is_one_line_for_every_method(store, tmp_path, capsys, method):
    out = tmp_path / "run"
    code = main(["recipe", "digits-scratch", "--out", str(out)]
                + _sets(store, f"method={method}", "train.lr=1e12", "train.epochs=1"))
    assert code == 4
    line = _one_error_line(capsys)
    assert line.startswith("error: training diverged at step ") and "lower the learning rate" in line, line
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "diverged" and res["error"] in line and res["method"] == method


def test_demo_does_not_count_a_diverged_stage_as_done(tmp_path):
    from szo.pipeline import run_demo_digits
    from szo.train import TrainingDiverged

    (tmp_path / "bp").mkdir()
    (tmp_path / "bp" / "results.json").write_text(json.dumps({"status": "diverged", "error": "training diverged at "
                                                                                               "step 3"}))
    with pytest.raises(TrainingDiverged, match=f"demo stage bp diverged in an earlier run .*remove {tmp_path / 'bp'}"):
        run_demo_digits(tmp_path, progress=False)


def test_demo_refuses_a_finished_stage_of_other_settings(tmp_path):
    """A demo directory of the paper's units (--scale absolute) is not shown as the default scale's
    results: the stage's config.yaml is checked, one line; an unknown scale is one line too."""
    from szo.config import write_config
    from szo.pipeline import DEMO_EPOCHS, PAPER_UNITS, run_demo_digits

    base = [f"subspace.root={(tmp_path / 'subspaces').resolve()}", "progress=false", "device=cpu", "seed=0"]
    done = json.dumps({"status": "completed", "best_test_acc": 0.9, "converged_epoch": 1, "fp": 1, "bp": 1})
    for name, cfg in (("bp", load_recipe("digits-bp", base)),
                      ("bp-subspace", load_recipe("digits-scratch", base + ["method=bp-subspace", f"train.epochs={DEMO_EPOCHS}",
                                                                           *PAPER_UNITS]))):
        write_config(cfg, tmp_path / name / "config.yaml")
        (tmp_path / name / "results.json").write_text(done)
    with pytest.raises(ResumeMismatchError, match="szo.scale is 'absolute' in its config.yaml but 'trajectory' now .and 1 more: train.lr.; .* another --out"):
        run_demo_digits(tmp_path, progress=False)
    with pytest.raises(ValueError, match="szo.scale 'paper'; valid: absolute, trajectory, whitened"):
        run_demo_digits(tmp_path, progress=False, scale="paper")


def test_constant_lr_run_extended_on_resume_equals_the_longer_run(store, tmp_path, capsys):
    const = ["train.scheduler=constant", "train.lr=0.3"]
    assert main(["recipe", "digits-scratch", "--out", str(tmp_path / "long")] + _sets(store, *const)) == 0
    short = _sets(store, *const, "train.epochs=1")
    assert main(["recipe", "digits-scratch", "--out", str(tmp_path / "run")] + short) == 0
    capsys.readouterr()
    assert main(["recipe", "digits-scratch", "--out", str(tmp_path / "run"), "--resume", "--set", "train.epochs=2"]) == 0
    assert "after step 4: epoch 2 of 2 (method szo-cge)" in capsys.readouterr().out
    a = torch.load(checkpoint_path(tmp_path / "long"), weights_only=True)
    b = torch.load(checkpoint_path(tmp_path / "run"), weights_only=True)
    assert a["step"] == b["step"] == 8 and all(torch.equal(a["model"][n], b["model"][n]) for n in a["model"])
    assert main(["recipe", "digits-scratch", "--out", str(tmp_path / "run"), "--resume", "--set", "train.epochs=1"]) == 2
    assert "train.epochs is 2 in its config.yaml but 1 now" in _one_error_line(capsys)


def test_lock_never_follows_a_symlink(tmp_path):
    """RUN_DIR/.lock as a symlink to another file: refused in one line, the other file untouched."""
    from szo.rundir import RunLockedError, run_lock

    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").symlink_to(victim)
    with pytest.raises(RunLockedError, match=r"\.lock is a symbolic link .*remove"):
        with run_lock(run):
            pass
    assert victim.read_text() == "keep me"


def test_resume_is_checked_against_the_checkpoints_pins_not_the_editable_files(store, tmp_path, capsys):
    """The checkpoint pins the resolved config and the subspace's digest: config.yaml edited by
    hand (model.T 2 -> 3), config.yaml deleted then --resume --set szo.mu=0.5, or the store entry
    rebuilt under the same name are each one line; the untouched run still resumes."""
    import yaml

    from subspace_store import SubspaceStore, build_subspace

    root, _ = store
    run = tmp_path / "run"
    assert main(["recipe", "digits-scratch", "--out", str(run)] + _sets(store), callbacks=[_Interrupt(3)]) == 130
    capsys.readouterr()
    cfg_file = run / "config.yaml"
    saved = cfg_file.read_text()
    edited = yaml.safe_load(saved)
    edited["model"]["T"] = 3
    cfg_file.write_text(yaml.safe_dump(edited))
    assert main(["recipe", "digits-scratch", "--out", str(run), "--resume"]) == 2
    assert "its checkpoint was trained with model.T = 2, the config now says 3" in _one_error_line(capsys)
    cfg_file.unlink()
    assert main(["recipe", "digits-scratch", "--out", str(run), "--resume", "--set", "szo.mu=0.5"]
                + _sets(store)) == 2
    assert "trained with szo.mu = 0.3, the config now says 0.5" in _one_error_line(capsys)
    cfg_file.write_text(saved)
    # the same name, another subspace (k=6 again, through the last sample instead of the first)
    st = SubspaceStore(root / "subspaces")
    name = yaml.safe_load(saved)["subspace"]["name"]
    original = st.load(name)
    st.save(name, build_subspace(root / "bp" / "trajectory", 6, reference="last", progress=False), overwrite=True)
    try:
        assert main(["recipe", "digits-scratch", "--out", str(run), "--resume"]) == 2
        line = _one_error_line(capsys)
        assert f"trained in subspace '{name}' with digest" in line and "(rebuilt since)" in line
    finally:
        st.save(name, original, overwrite=True)
    assert main(["recipe", "digits-scratch", "--out", str(run), "--resume"]) == 0


@pytest.mark.parametrize("case, sets, phrase", [
    ("q", ["method=szo-rge", "szo.q=1000000000"], "'szo.q' must be <= 100000"),
    ("layers", ["method=np-zo", "szo.layers=[nope]"], "unknown layer name(s) ['nope']; valid: conv1, conv2, fc"),
    ("coords", ["method=zo-cge", "szo.coords_per_step=100000000"], "more coordinates than the model's d = "),
    ("lr", ["train.lr=-1"], "'train.lr' must be >= 0.0"),
    ("mu", ["szo.mu=nan"], "'szo.mu' must be a finite number"),
    ("seed", ["seed=18446744073709551616"], "'seed' must be <= 9223372036854775807"),
    ("kwargs", ["model.kwargs={wdth:2}"], "has no argument(s) 'wdth:2' (YAML reads {a:2}"),
    ("root-file", ["subspace.root=FILE"], "is a file, not a directory"),
    ("out-file", ["OUT=FILE"], "exists and is not a directory; choose another --out"),
    ("out-long", ["OUT=LONG"], "File name too long"),
])
def test_bad_settings_refused_before_any_work(tmp_path, capsys, case, sets, phrase):
    """Each bad setting of every stage is one line before the first forward: no BPTT, no store entry."""
    (tmp_path / "afile").write_text("not a directory")
    out = tmp_path / "run"
    args = ["recipe", "digits-scratch", "--set", "progress=false", "--set", f"subspace.root={tmp_path / 'store'}",
            "--set", "model.kwargs={width: 2}"]
    for s in sets:
        if s.startswith("OUT="):
            out = tmp_path / "afile" if s == "OUT=FILE" else tmp_path / ("x" * 300)
            continue
        args += ["--set", s.replace("FILE", str(tmp_path / "afile"))]
    assert main(args + ["--out", str(out)]) == 2
    assert phrase in _one_error_line(capsys)
    assert not (tmp_path / "store").exists() and not (tmp_path / "run" / "bptt" / "checkpoints").exists()


def test_read_only_run_dir_is_one_line(tmp_path, monkeypatch):
    """A run directory the process cannot write (a read-only mount, another user's files): one
    line naming it, where a resume would have died with a traceback on its first write."""
    import errno
    import os

    from szo import rundir
    from szo.rundir import RunDirError, run_lock

    (tmp_path / "run").mkdir()
    real = os.open

    def ro(path, flags, *a):
        if str(path).endswith(".lock"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, flags, *a)

    monkeypatch.setattr(rundir.os, "open", ro)
    with pytest.raises(RunDirError, match=r"is not writable: cannot open its lock file .*Read-only file system.*"
                                          r"copy it somewhere writable"):
        with run_lock(tmp_path / "run"):
            pass


def test_a_run_written_before_the_newer_schema_keys_resumes(tmp_path):
    """A config.yaml written by an earlier szo (without szo.scale, hw.blocks / select_epochs /
    heldout, source, precision) stands for those keys' defaults: resuming it is not refused."""
    import yaml

    from szo.config import load_recipe, write_config
    from szo.rundir import check_resume_config

    # an earlier szo's subspace runs were all in the paper's units (szo.scale absolute)
    for recipe, sets in (("digits-scratch", ["szo.scale=absolute"]), ("digits-fixed", [])):
        cfg = load_recipe(recipe, sets)
        run = tmp_path / recipe
        write_config(cfg, run / "config.yaml")
        old = yaml.safe_load((run / "config.yaml").read_text())
        old.pop("precision"), old.pop("source"), old["szo"].pop("scale")
        for key in ("blocks", "select_epochs", "heldout"):
            old["hw"].pop(key)
        (run / "config.yaml").write_text(yaml.safe_dump(old))
        check_resume_config(run, cfg, "subspace")  # no ResumeMismatchError
    # ... and is not taken for a run under today's default scale, which trains in other units
    with pytest.raises(ResumeMismatchError, match="szo.mu is 1.0 in its config.yaml but 0.3 now .and 2 more: szo.scale, train.lr."):
        check_resume_config(tmp_path / "digits-scratch", load_recipe("digits-scratch"), "subspace")


def _drop(tree, dotted):
    *path, last = dotted.split(".")
    for p in path:
        tree = tree.get(p, {})
    tree.pop(last, None)


def test_a_run_written_before_the_newer_keys_resumes_as_it_was_trained(store, tmp_path, capsys):
    """An earlier szo's run directory (config.yaml without precision, cuda_graphs, szo.scale, ... : every
    rundir.ADDED_KEYS key) resumes as it was trained -- in the paper's units, not today's default
    trajectory ones -- and ends bit for bit where the uninterrupted run ends; restating the new keys
    with their old values is accepted, changing one is refused in one line."""
    import yaml

    from szo.rundir import ADDED_KEYS, check_resume_config, resumed_config, with_added_keys

    # what such a run trained with: absolute units, central TT-ZO CGE (batch-mean node losses: np-zo / awp-zo)
    old = ["szo.scale=absolute", "tt.cge=central"]
    assert main(["recipe", "digits-scratch", "--out", str(tmp_path / "ref")] + _sets(store, *old)) == 0
    assert main(["recipe", "digits-scratch", "--out", str(tmp_path / "run")] + _sets(store, *old),
                callbacks=[_Interrupt(3)]) == 130
    cfg = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    for key in ADDED_KEYS:
        _drop(cfg, key)
    assert "precision" not in cfg and "scale" not in cfg["szo"] and "cuda_graphs" not in cfg
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(cfg))
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    capsys.readouterr()
    # every new key restated with the value the run had: accepted
    restated = ["precision=auto", "cuda_graphs=false", "szo.scale=absolute", "hw.select_epochs=1"]
    now = resumed_config(tmp_path / "copy", load_recipe("digits-scratch"), restated)
    assert (now.szo.scale, now.szo.mu, now.szo.node_losses, now.tt.cge) == ("absolute", 1.0, "per-sample", "central")
    check_resume_config(tmp_path / "copy", now, "subspace")
    # an old node-perturbation run weighed its nodes by the batch loss: it resumes so
    np_old = with_added_keys({**cfg, "method": "np-zo"})
    assert np_old["szo"]["node_losses"] == "batch-mean" and np_old["szo"]["scale"] == "absolute"
    # today's default units would train something else: refused, naming the key
    assert main(["recipe", "digits-scratch", "--out", str(tmp_path / "copy"), "--resume",
                 "--set", "szo.scale=trajectory"]) == 2
    assert "szo.scale is 'absolute' in its config.yaml but 'trajectory' now" in _one_error_line(capsys)
    # resumed without a --set: exact
    assert main(["recipe", "digits-scratch", "--out", str(tmp_path / "run"), "--resume", "--set", "progress=false"]) == 0
    a = torch.load(checkpoint_path(tmp_path / "ref"), weights_only=True)["model"]
    b = torch.load(checkpoint_path(tmp_path / "run"), weights_only=True)["model"]
    assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("name", ["../../x", "..", ".", "a/b"])
def test_a_run_name_never_leaves_runs(store, tmp_path, capsys, monkeypatch, name):
    """Without --out a run goes to runs/NAME: a name that is not one path component (``--set name=...`` or
    ``name:`` in a recipe file) is refused in one line before anything is written."""
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # runs/../../x would be tmp_path/x
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(f"extends: digits-scratch\nname: '{name}'\n")
    for args in (["digits-scratch", "--set", f"name={name}"], [str(recipe)]):
        assert main(["recipe", *args] + _sets(store)) == 2
        line = _one_error_line(capsys)
        assert f"name {name!r} cannot name a run directory in runs/" in line and "pass --out DIR" in line
        assert sorted(p.name for p in tmp_path.rglob("*")) == ["cwd", "mine.yaml"]


def test_a_run_refused_before_its_first_step_leaves_nothing_in_the_way(tmp_path):
    """Issue 49 "retries that work": a run directory whose input was refused before the first step is
    not left behind (or, when it existed, keeps only what it held), so the same command with a
    corrected input runs; a run that wrote more than its settings is kept as it is."""
    from szo.rundir import run_lock

    new = tmp_path / "runs" / "x"
    with pytest.raises(ValueError, match="refused"):
        with run_lock(new):
            (new / "config.yaml").write_text("name: digits-scratch\n")
            raise ValueError("refused")
    assert not new.exists() and (tmp_path / "runs").is_dir()

    old = tmp_path / "mine"
    old.mkdir()
    (old / "notes.txt").write_text("kept")
    with pytest.raises(ValueError):
        with run_lock(old):
            (old / "config.yaml").write_text("name: digits-scratch\n")
            raise ValueError("refused")
    assert sorted(p.name for p in old.iterdir()) == [".lock", "notes.txt"]

    started = tmp_path / "started"
    with pytest.raises(ValueError):
        with run_lock(started):
            (started / "config.yaml").write_text("name: digits-scratch\n")
            (started / "metrics.jsonl").write_text("{}\n")
            raise ValueError("diverged")
    assert sorted(p.name for p in started.iterdir()) == [".lock", "config.yaml", "metrics.jsonl"]


def test_the_same_command_with_a_corrected_input_runs(tmp_path, capsys):
    """The issue's cases through the command line: ``--set model.T=1000000000`` (refused before anything
    is allocated) and ``--set szo.mu=``; then the corrected command is not stopped by the first one's
    directory."""
    from szo.cli import main

    out = tmp_path / "run"
    for bad in ("model.T=1000000000", "szo.mu=", "bptt.lr=1e-50"):
        assert main(["recipe", "digits-bp", "--set", bad, "--set", f"subspace.root={tmp_path / 'store'}",
                     "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: "), err
        assert not out.exists()
    assert main(["recipe", "digits-bp", "--set", "bptt.epochs=1", "--set", "bptt.max_steps_per_epoch=1",
                 "--set", "trajectory.every=1", "--set", "subspace.k=1", "--set", f"subspace.root={tmp_path / 'store'}",
                 "--out", str(out)]) == 0
    assert (out / "results.json").is_file()
