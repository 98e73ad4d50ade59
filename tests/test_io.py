"""szo.io: atomic writers return the sha256 of what they wrote; temp-file names."""
from __future__ import annotations

import hashlib

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
