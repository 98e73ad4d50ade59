"""TrajectoryRecorder / Trajectory: format, sampling rules, resume, crash safety, mismatch errors."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from szo.trajectory import (
    Trajectory,
    TrajectoryIntegrityError,
    TrajectoryMismatchError,
    TrajectoryRecorder,
    parse_epoch_window,
)


def tiny(out: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, out))


def flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for _, p in m.named_parameters()])


def nudge(m: nn.Module, s: float = 0.1) -> None:
    with torch.no_grad():
        for p in m.parameters():
            p.add_(s)


def test_records_initial_and_epochs_in_format(tmp_path):
    m = tiny()
    rec = TrajectoryRecorder(tmp_path / "t", m, model_name="tiny")
    rec.on_train_start()
    expected = [flat(m).clone()]
    for e in range(1, 4):
        nudge(m)
        rec.on_epoch_end(e, step=10 * e, test_acc=0.5 + e / 10)
        expected.append(flat(m).clone())
    man = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert man["format"] == "szo-trajectory" and man["version"] == 1 and man["model"] == "tiny"
    assert man["d"] == 4 * 5 + 5 + 5 * 3 + 3
    assert man["layout"][0] == {"name": "0.weight", "shape": [5, 4]}
    assert [s["epoch"] for s in man["samples"]] == [0, 1, 2, 3]
    assert man["samples"][2]["test_acc"] == pytest.approx(0.7)
    t = Trajectory(tmp_path / "t", verify=True)
    assert len(t) == 4 and t.d == man["d"] and t.model == "tiny"
    for got, exp in zip(t, expected):
        assert torch.equal(got, exp)
    # fingerprint formula = SpikingModel.fingerprint for a model without fingerprint()
    import hashlib

    lay = [[n, list(p.shape)] for n, p in m.named_parameters()]
    assert t.fingerprint == hashlib.sha256(json.dumps(["tiny", lay]).encode()).hexdigest()


def test_every_n_steps(tmp_path):
    m = tiny()
    rec = TrajectoryRecorder(tmp_path / "t", m, every=3, record_initial=False)
    for step in range(1, 11):
        nudge(m, 0.01)
        rec.on_step_end(step, epoch=step // 4)
        rec.on_epoch_end(step // 4, step)  # ignored when every is an int
    assert [s["step"] for s in Trajectory(tmp_path / "t").samples] == [3, 6, 9]


def test_epoch_window_string(tmp_path):
    m = tiny()
    rec = TrajectoryRecorder(tmp_path / "t", m, epochs="80-100")
    rec.on_train_start()  # epoch 0 is outside the window: not recorded
    for e in range(1, 111):
        rec.on_epoch_end(e, step=e)
    t = Trajectory(tmp_path / "t")
    assert t.epochs == list(range(80, 101))
    assert t.select((90, 95)).epochs == list(range(90, 96))
    assert t.select("100-200").epochs == [100]
    with pytest.raises(ValueError, match="no samples"):
        t.select("0-10")


@pytest.mark.parametrize("bad", ["80:100", (5, 1), "x", (1, 2, 3)])
def test_bad_window_rejected(bad):
    with pytest.raises(ValueError, match="window"):
        parse_epoch_window(bad)


def test_bad_every_rejected(tmp_path):
    with pytest.raises(ValueError, match="every must be 'epoch' or a positive int"):
        TrajectoryRecorder(tmp_path / "t", tiny(), every=0)


def test_resume_does_not_duplicate(tmp_path):
    m = tiny()
    rec = TrajectoryRecorder(tmp_path / "t", m)
    rec.on_train_start()
    rec.on_epoch_end(1, 5)
    rec2 = TrajectoryRecorder(tmp_path / "t", m)
    assert rec2.on_train_start() is None  # (0, 0) already there
    assert rec2.on_epoch_end(1, 5) is None
    nudge(m)
    rec2.on_epoch_end(2, 10)
    t = Trajectory(tmp_path / "t", verify=True)
    assert [(s["epoch"], s["step"]) for s in t.samples] == [(0, 0), (1, 5), (2, 10)]
    assert torch.equal(t[2], flat(m))


def test_crash_before_manifest_update_then_resume(tmp_path, monkeypatch):
    m = tiny()
    rec = TrajectoryRecorder(tmp_path / "t", m)
    rec.on_train_start()

    def boom(self):
        raise RuntimeError("killed")

    monkeypatch.setattr(TrajectoryRecorder, "_write_manifest", boom)
    nudge(m)
    with pytest.raises(RuntimeError):
        rec.on_epoch_end(1, 1)
    monkeypatch.undo()
    assert (tmp_path / "t" / "sample_000001.safetensors").exists()  # orphan: written, not listed
    assert len(Trajectory(tmp_path / "t")) == 1
    nudge(m)  # the resumed run has other weights for the same index
    rec2 = TrajectoryRecorder(tmp_path / "t", m)
    rec2.on_epoch_end(1, 1)
    t = Trajectory(tmp_path / "t", verify=True)  # the orphan was overwritten, sha matches
    assert [(s["epoch"], s["step"]) for s in t.samples] == [(0, 0), (1, 1)]
    assert torch.equal(t[1], flat(m))


def test_kill_during_sample_rename_then_resume(tmp_path):
    """A real process kill (os._exit) after the sample temp file is written, before its rename."""
    d = tmp_path / "t"
    script = textwrap.dedent(f"""
        import os, torch
        from torch import nn
        import szo.io
        from szo.trajectory import TrajectoryRecorder
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
        rec = TrajectoryRecorder({str(d)!r}, m)
        rec.on_train_start()
        real = os.replace
        def replace(src, dst):
            if str(dst).endswith("sample_000001.safetensors"):
                os._exit(9)
            real(src, dst)
        szo.io.os.replace = replace
        rec.on_epoch_end(1, 1)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 9, r.stderr
    leftovers = [p.name for p in d.iterdir() if p.name.endswith(".tmp")]
    assert leftovers, "the kill should leave the sample temp file behind"
    m = tiny()
    rec = TrajectoryRecorder(d, m)  # temp files do not make the directory 'foreign'
    rec.on_train_start()
    rec.on_epoch_end(1, 1)
    t = Trajectory(d, verify=True)
    assert [(s["epoch"], s["step"]) for s in t.samples] == [(0, 0), (1, 1)]


def test_mismatched_model_rejected(tmp_path):
    TrajectoryRecorder(tmp_path / "t", tiny(3)).on_train_start()
    with pytest.raises(TrajectoryMismatchError, match=r"parameter #2 is 2\.weight \[3, 5\] there but 2\.weight \[4, 5\] here"):
        TrajectoryRecorder(tmp_path / "t", tiny(4))
    TrajectoryRecorder(tmp_path / "u", tiny(3), model_name="tiny").on_train_start()
    with pytest.raises(TrajectoryMismatchError, match="fingerprint is"):
        TrajectoryRecorder(tmp_path / "u", tiny(3), model_name="other")


def test_foreign_directory_rejected(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "notes.txt").write_text("hi")
    with pytest.raises(TrajectoryMismatchError, match="not empty and has no manifest.json"):
        TrajectoryRecorder(tmp_path / "t", tiny())


def test_reader_detects_corruption(tmp_path):
    m = tiny()
    rec = TrajectoryRecorder(tmp_path / "t", m)
    rec.on_train_start()
    f = tmp_path / "t" / "sample_000000.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))
    t = Trajectory(tmp_path / "t")
    with pytest.raises(TrajectoryIntegrityError, match="corrupt"):
        t[0]
    (tmp_path / "t" / "manifest.json").write_text("{not json")
    with pytest.raises(TrajectoryIntegrityError, match="not valid JSON"):
        Trajectory(tmp_path / "t")
    with pytest.raises(TrajectoryIntegrityError, match="does not exist"):
        Trajectory(tmp_path / "nope")


def test_fingerprints_pinned_and_layout_helpers_shared():
    """The fingerprint formula is stored in every manifest: it must never change."""
    from subspace_store import format as subspace_format
    from szo.layout import layout_fingerprint, layout_from_json, layout_mismatch, layout_to_json, param_layout
    from szo.models import create
    from szo.trajectory import model_fingerprint, model_layout

    m = tiny()
    assert model_fingerprint(m, "mlp") == "fb4702cb2903a99e104a9069574f8051833df010f41ec4df123e600635b20676"
    conv = create("spike_convnet")
    assert conv.fingerprint() == "600c5e92b863f53a96a79533e3e8f5ffa6249da60ab519959e23fe18c36c10e2"
    assert conv.fingerprint() == layout_fingerprint("spike_convnet", param_layout(conv)) == model_fingerprint(conv, "x")
    lay = param_layout(m)
    assert model_layout(m) == lay and layout_from_json(layout_to_json(lay)) == lay
    assert layout_to_json(lay)[0] == {"name": "0.weight", "shape": [5, 4]}
    assert layout_mismatch(lay, lay) is None
    assert layout_mismatch(lay, lay[:-1]) == "4 parameters in the subspace, 3 in the model; first extra: 2.bias (only in the subspace)"
    assert subspace_format.layout_mismatch is layout_mismatch and subspace_format.layout_to_json is layout_to_json


def test_getitem_reads_each_file_once(tmp_path, monkeypatch):
    import szo.trajectory as tr

    m = tiny()
    rec = TrajectoryRecorder(tmp_path / "t", m)
    rec.on_train_start()
    t = Trajectory(tmp_path / "t")
    reads = []
    orig = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: reads.append(self.name) or orig(self))
    monkeypatch.setattr(tr, "sha256_file", lambda p: pytest.fail("second read of the file to hash it"))
    assert torch.equal(t[0], flat(m))
    assert reads == ["sample_000000.safetensors"]
    assert torch.equal(t[0], flat(m)) and len(reads) == 2  # verified once; later reads are not hashed
