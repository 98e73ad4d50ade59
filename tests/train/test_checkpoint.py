"""Checksummed checkpoints: every damaged or foreign file is one CheckpointError line."""
import io
import json
import os

import pytest
import torch

from szo.train import CheckpointError, checksum_path, load_checkpoint, save_checkpoint
from szo.train.checkpoint import checkpoint_path


def _state(step=3):
    return {"model": {"w": torch.arange(1000, dtype=torch.float32)}, "step": step, "epoch": 1,
            "method": "szo-cge", "optimizer_class": "SZO"}


@pytest.fixture()
def ckpt(tmp_path):
    p = checkpoint_path(tmp_path)
    save_checkpoint(p, _state())
    return p


def _one_line(e):
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_round_trip_and_record(ckpt):
    st = load_checkpoint(ckpt)
    assert st["step"] == 3 and torch.equal(st["model"]["w"], torch.arange(1000, dtype=torch.float32))
    rec = json.loads(checksum_path(ckpt).read_text())
    assert rec["file"] == "last.pt" and rec["bytes"] == ckpt.stat().st_size and rec["method"] == "szo-cge"
    # still a plain torch checkpoint for anyone loading it by hand
    assert torch.load(ckpt, weights_only=True)["step"] == 3


def _flip_tensor_byte(p):
    data = bytearray(p.read_bytes())
    # a byte inside the tensor storage (the float32 value 500.0 of arange(1000)), not zip metadata
    i = bytes(data).index(torch.tensor([500.0]).numpy().tobytes())
    data[i + 1] ^= 0x01
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("damage,match", [
    (_flip_tensor_byte, "does not match the sha256"),
    (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "does not match the sha256"),
    (lambda p: p.write_bytes(b""), "is empty"),
    (lambda p: p.write_bytes(os.urandom(4096)), "does not match the sha256"),
    (lambda p: checksum_path(p).unlink(), "no sha256 record"),
    (lambda p: checksum_path(p).write_text("{not json"), "not valid JSON"),
])
def test_damaged_checkpoint_is_one_line(ckpt, damage, match):
    damage(ckpt)
    with pytest.raises(CheckpointError, match=match) as e:
        load_checkpoint(ckpt)
    assert str(ckpt) in _one_line(e) or str(checksum_path(ckpt)) in _one_line(e)


def _rerecord(p):
    """Forge a matching record, so that only the content checks are left."""
    import hashlib

    rec = json.loads(checksum_path(p).read_text())
    rec["sha256"] = hashlib.sha256(p.read_bytes()).hexdigest()
    checksum_path(p).write_text(json.dumps(rec))


@pytest.mark.parametrize("content,match", [
    (lambda: os.urandom(4096), "not a readable torch checkpoint"),
    (lambda: b"PK\x03\x04" + os.urandom(100), "not a readable torch checkpoint"),
    (lambda: _torch_bytes({"some": torch.ones(2)}), "is not an szo checkpoint"),
    (lambda: _torch_bytes(torch.nn.Linear(2, 2)), "not a readable torch checkpoint"),  # needs unpickling a class
])
def test_unreadable_or_foreign_file_with_matching_record_is_one_line(ckpt, content, match):
    ckpt.write_bytes(content())
    _rerecord(ckpt)
    with pytest.raises(CheckpointError, match=match) as e:
        load_checkpoint(ckpt)
    _one_line(e)


def _torch_bytes(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_kill_between_record_and_file_keeps_the_previous_checkpoint_valid(ckpt, monkeypatch):
    """The record is written first; a kill before the new file lands leaves the old file,
    which the record still lists as 'previous'."""
    import hashlib

    import szo.train.checkpoint as C

    prev = hashlib.sha256(ckpt.read_bytes()).hexdigest()

    def killed(path, data):
        raise KeyboardInterrupt("killed before the checkpoint write")

    monkeypatch.setattr(C, "atomic_write_bytes", killed)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(ckpt, _state(step=6), previous_sha256=prev)
    monkeypatch.undo()
    assert json.loads(checksum_path(ckpt).read_text())["previous"] == {"sha256": prev}
    assert load_checkpoint(ckpt)["step"] == 3
