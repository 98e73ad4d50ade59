"""The TensorBoard sink: TensorBoard's own reader sees metrics.jsonl's values (and a resume's purge),
and a sink that cannot write never stops the run."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from szo.losses import tet_loss
from szo.train import Callback, TensorBoardSink, fit, read_metrics
from tests.train.test_trainer import _digits

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def _scalars(log_dir, key):
    """(steps, values) of one scalar, as TensorBoard shows them."""
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    events = acc.Scalars(key)
    return [e.step for e in events], [e.value for e in events]


def test_sink_writes_scalars_and_a_resume_purges_later_steps(tmp_path, capsys):
    sink = TensorBoardSink(tmp_path / "tb")
    sink.on_train_start(epoch=0, step=0, resumed=False)
    for epoch in (1, 2, 3):
        sink.on_epoch_end(epoch, 10 * epoch, {"epoch": epoch, "test_acc": 0.1 * epoch, "fp": 7 * epoch, "ok": True})
    sink.on_train_end({})
    steps, values = _scalars(tmp_path / "tb", "test_acc")
    assert steps == [1, 2, 3] and values == pytest.approx([0.1, 0.2, 0.3])
    resumed = TensorBoardSink(tmp_path / "tb")  # the run resumed from its epoch-1 checkpoint
    resumed.on_train_start(epoch=1, step=10, resumed=True)
    for epoch in (2, 3):
        resumed.on_epoch_end(epoch, 10 * epoch, {"epoch": epoch, "test_acc": 0.5 * epoch})
    resumed.on_train_end({})
    steps, values = _scalars(tmp_path / "tb", "test_acc")
    assert steps == [1, 2, 3] and values == pytest.approx([0.1, 1.0, 1.5])
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"test_acc", "fp"}  # not epoch, not bools
    assert capsys.readouterr().err == "" and resumed.results() == {}


def _fit(run_dir, callbacks, epochs=4):
    torch.manual_seed(0)  # test-only: a fixed initial model
    from szo.models import create

    model = create("spike_convnet", T=2, width=4)
    g = torch.Generator().manual_seed(1)
    train, test = _digits(96, 48)
    loaders = DataLoader(train, batch_size=32, shuffle=True, generator=g), DataLoader(test, batch_size=48)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return fit(model, *loaders, opt, epochs=epochs, loss_fn=tet_loss, run_dir=run_dir, generator=g, progress=False,
               plot=False, callbacks=callbacks)


def _one_warning(capsys, why):
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("warning: TensorBoard sink disabled (") and why in err[0], err
    assert "training goes on" in err[0]


def test_tensorboard_path_that_is_a_file_warns_once_and_the_run_completes(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "tensorboard").write_text("not a directory")
    s = _fit(run, [TensorBoardSink(run / "tensorboard")], epochs=2)
    _one_warning(capsys, "exists and is not a directory")
    res = json.loads((run / "results.json").read_text())
    assert res == s and res["status"] == "completed" and res["epochs"] == 2
    assert "tensorboard: exists and is not a directory" in res["tensorboard_error"]
    assert len(read_metrics(run / "metrics.jsonl")) == 2


class _DiskFullAfter(Callback):
    """After epoch ``n``, every open descriptor of a file under ``log_dir`` writes to /dev/full
    (each write then fails with ENOSPC, as on a full disk), found through /proc/self/fd."""

    def __init__(self, log_dir, n):
        self.log_dir, self.n = str(log_dir), n

    def on_epoch_end(self, epoch, step, metrics):
        if epoch != self.n:
            return
        full = os.open("/dev/full", os.O_WRONLY)
        hit = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith(self.log_dir + os.sep):
                os.dup2(full, int(fd))
                hit += 1
        os.close(full)
        assert hit == 1, hit


@pytest.mark.skipif(not (Path("/dev/full").exists() and Path("/proc/self/fd").is_dir()), reason="Linux /dev/full")
def test_event_disk_full_mid_run_warns_once_and_the_run_completes(tmp_path, capsys):
    run = tmp_path / "run"
    sink = TensorBoardSink(run / "tensorboard")
    s = _fit(run, [sink, _DiskFullAfter(run / "tensorboard", 1)], epochs=4)  # the disk fills after epoch 1
    _one_warning(capsys, "No space left on device")
    res = json.loads((run / "results.json").read_text())
    assert res["status"] == "completed" and res["epochs"] == 4 and res == s
    assert "No space left on device" in res["tensorboard_error"]
    assert [r["epoch"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4]
    assert _scalars(run / "tensorboard", "test_acc")[0] == [1]  # what was written before the disk filled


@pytest.mark.skipif(shutil.which("unshare") is None or shutil.which("mount") is None, reason="needs unshare, mount")
def test_recipe_with_a_full_event_filesystem_completes(tmp_path):
    """A real ``szo recipe`` process whose RUN_DIR/tensorboard is a 4 KiB tmpfs (mounted in a private
    user + mount namespace): it filled at epoch 8 of 12 and the run died with two tracebacks."""
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("user namespaces are not available here")
    run, tiny = tmp_path / "run", tmp_path / "tiny"
    run.mkdir()
    tiny.mkdir()
    (run / "tensorboard").symlink_to(tiny)
    sets = ["model.T=2", "model.kwargs={width: 4}", "progress=false", "bptt.epochs=12", "bptt.max_steps_per_epoch=2",
            "log.tensorboard=true", "subspace.k=4", "trajectory.every=1", f"subspace.root={tmp_path / 'store'}"]
    cmd = [sys.executable, "-m", "szo", "recipe", "digits-bp", "--out", str(run)]
    for s in sets:
        cmd += ["--set", s]
    script = f"mount -t tmpfs -o size=4k tmpfs {tiny} && exec \"$@\""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", *cmd], capture_output=True, text=True,
                       timeout=600, env=env, cwd=root)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    warnings = [ln for ln in r.stderr.splitlines() if ln.startswith("warning: TensorBoard sink disabled")]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], r.stderr[-3000:]
    res = json.loads((run / "results.json").read_text())
    assert res["status"] == "completed" and res["epochs"] == 12 and "No space left" in res["tensorboard_error"]
