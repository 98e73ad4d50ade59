"""szo.io: atomic writers return the sha256 of what they wrote; temp-file names."""
from __future__ import annotations

import hashlib

import pytest
import torch

from szo.io import (
    atomic_save_safetensors,
    atomic_torch_save,
    atomic_write_bytes,
    atomic_write_json,
    sha256_file,
    temp_file_target,
)


def test_writers_return_sha256_of_the_file(tmp_path):
    data = b"abc" * 1000
    assert atomic_write_bytes(tmp_path / "a.bin", data) == hashlib.sha256(data).hexdigest()
    for path, digest in [
        (tmp_path / "b.json", atomic_write_json(tmp_path / "b.json", {"x": [1, 2]})),
        (tmp_path / "c.safetensors", atomic_save_safetensors(tmp_path / "c.safetensors", {"t": torch.arange(5.0)},
                                                             {"k": "v"})),
        (tmp_path / "d.pt", atomic_torch_save(tmp_path / "d.pt", {"t": torch.ones(3)})),
    ]:
        assert digest == sha256_file(path), path.name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "b.json", "c.safetensors", "d.pt"]  # no temp left


def test_temp_file_target():
    assert temp_file_target(".sample_000003.safetensors.k2j_x9ab.tmp") == "sample_000003.safetensors"
    assert temp_file_target(".manifest.json.abc123.tmp") == "manifest.json"
    for name in ("manifest.json", "sample_000001.safetensors", ".hidden", "x.tmp", ".a.tmp"):
        assert temp_file_target(name) is None, name


def test_safetensors_bytes_do_not_depend_on_metadata_order(tmp_path):
    """safetensors' own header order is a Rust HashMap's (per process); ours is sorted, so the same
    content has one sha256 (a trajectory sample written twice is byte-identical)."""
    import json
    import subprocess
    import sys

    from safetensors.torch import load_file

    from szo.io import atomic_save_safetensors

    meta = {f"key{i}": str(i) for i in (5, 2, 0, 4, 1, 3)}
    t = {"b": torch.arange(6.0), "a": torch.ones(2, 3, dtype=torch.float64)}
    d1 = atomic_save_safetensors(tmp_path / "1.safetensors", t, meta)
    d2 = atomic_save_safetensors(tmp_path / "2.safetensors", dict(reversed(list(t.items()))),
                                 dict(reversed(list(meta.items()))))
    code = ("import sys, torch; from szo.io import atomic_save_safetensors as s; "
            f"print(s(sys.argv[1], {{'b': torch.arange(6.0), 'a': torch.ones(2, 3, dtype=torch.float64)}}, {meta!r}))")
    d3 = subprocess.run([sys.executable, "-c", code, str(tmp_path / "3.safetensors")], capture_output=True,
                        text=True, check=True).stdout.strip()
    assert d1 == d2 == d3
    raw = (tmp_path / "1.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert (8 + n) % 8 == 0
    header = json.loads(raw[8:8 + n])
    assert list(header["__metadata__"]) == sorted(meta) and header["__metadata__"] == meta
    back = load_file(tmp_path / "1.safetensors")
    assert torch.equal(back["a"], t["a"]) and torch.equal(back["b"], t["b"])


def _run_dir(tmp_path):
    """A run directory as a BPTT stage leaves it: config.yaml and model.safetensors with its record."""
    from szo.build import build_model
    from szo.config import load_recipe, write_config
    from szo.io import save_weights

    cfg = load_recipe("digits-bp", ["model.kwargs={width: 2}", "model.T=2"])
    run = tmp_path / "run"
    run.mkdir()
    write_config(cfg, run / "config.yaml")
    model = build_model(cfg)
    save_weights(run / "model.safetensors", model.state_dict(), {"model": "spike_convnet"})
    return run, model


def test_model_weights_carry_a_sha256_record_checked_on_load(tmp_path, capsys):
    """4 flipped exponent bits or a truncated model.safetensors: one line from every reader
    (load_run_model serves export, import's --compare, hw-report, adapt and study), never a
    model that silently scores 10 %."""
    import json

    from szo.build import load_run_model
    from szo.cli import main
    from szo.io import WeightsIntegrityError, load_weights, weights_record_path

    run, model = _run_dir(tmp_path)
    f = run / "model.safetensors"
    rec = json.loads(weights_record_path(f).read_text())
    assert rec["sha256"] == hashlib.sha256(f.read_bytes()).hexdigest() and weights_record_path(f).name == "model.json"
    loaded, _ = load_run_model(run)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    good = f.read_bytes()
    b = bytearray(good)
    for i in range(4):  # exponent bits of the last float32 values
        b[-1 - 4 * i] ^= 0x40
    f.write_bytes(bytes(b))
    with pytest.raises(WeightsIntegrityError, match="does not match the sha256 in model.json"):
        load_run_model(run)
    assert main(["export", str(run), "--to", "nir", str(tmp_path / "m.nir")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tampered, truncated or corrupt" in err[0] and not (tmp_path / "m.nir").exists()
    f.write_bytes(good[: len(good) // 2])
    with pytest.raises(WeightsIntegrityError, match="tampered, truncated"):
        load_weights(f)
    weights_record_path(f).unlink()  # no record (older szo): read with a note, still refused if unreadable
    with pytest.raises(WeightsIntegrityError, match="not a readable safetensors file"):
        load_weights(f)
    f.write_bytes(good)
    assert set(load_weights(f)) == set(model.state_dict())
    assert "has no sha256 record model.json" in capsys.readouterr().err


def test_atomic_writes_keep_the_umask_mode(tmp_path):
    import os
    import stat

    from szo.io import atomic_write_text

    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.txt", "x")
        assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o644  # not mkstemp's 0600
        os.umask(0o077)
        atomic_write_text(tmp_path / "b.txt", "x")
        assert stat.S_IMODE((tmp_path / "b.txt").stat().st_mode) == 0o600
    finally:
        os.umask(old)


def test_a_write_past_the_file_size_limit_names_the_file(tmp_path):
    """Issue 49: a disk-full / file-size-limit write said ``[Errno 27] File too large`` without naming
    the file. The error keeps its type and errno, names the file and its size, and leaves the old file."""
    import subprocess
    import sys

    target = tmp_path / "checkpoints" / "last.pt"
    target.parent.mkdir()
    target.write_bytes(b"old")
    code = ("import resource, signal, sys\nfrom szo.io import atomic_write_bytes\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\nresource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))\n"
            "try:\n    atomic_write_bytes(sys.argv[1], b'x' * 5000)\n"
            "except OSError as e:\n    print(type(e).__name__, e.errno, e)\n")
    out = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == (f"OSError 27 [Errno 27] File too large (writing 5000 bytes; nothing was replaced): "
                                  f"'{target}'"), out.stderr
    assert target.read_bytes() == b"old" and sorted(p.name for p in target.parent.iterdir()) == ["last.pt"]
