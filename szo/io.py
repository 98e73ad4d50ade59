"""Crash-safe file writes: every file szo writes goes through a temp file and ``os.replace``.

A kill at any point leaves either the old file or the new one, never a half-written one; the
new file and its directory entry are fsynced. Every writer returns the sha256 (hex) of the
bytes it wrote. A kill inside a write can leave a temp file ``.<name>.<random>.tmp`` next to
the target (:data:`TEMP_FILE_RE`, :func:`temp_file_target`).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch

__all__ = [
    "TEMP_FILE_RE",
    "read_regular_bytes",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "atomic_save_safetensors",
    "atomic_torch_save",
    "save_weights",
    "load_weights",
    "weights_record_path",
    "WeightsIntegrityError",
    "fsync_dir",
    "sha256_file",
    "temp_file_target",
]

TEMP_FILE_RE = re.compile(r"^\.(?P<target>.+)\.[^.]+\.tmp$")
"""Name of a temp file of :func:`atomic_write_bytes` (``.<target name>.<random>.tmp``)."""


def temp_file_target(name: str) -> str | None:
    """The file name a temp file ``name`` was going to become, or None if ``name`` is not one."""
    m = TEMP_FILE_RE.match(name)
    return m.group("target") if m else None


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"))


def read_regular_bytes(path: str | os.PathLike, max_bytes: int, what: str = "file") -> bytes:
    """The bytes of ``path`` (symlinks followed) if it is a regular file of at most ``max_bytes``;
    one ValueError otherwise, naming the file, what it is and the limit: a ``results.json`` that
    links to ``/dev/zero`` or a pipe is refused before it is read (it would be read until memory
    runs out, or block), and no read goes past ``max_bytes``."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"no {what} {path}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = next((k for test, k in _KINDS if test(st.st_mode)), "not a regular file")
        raise ValueError(f"{path} is {kind}, not a regular file; it is not an szo {what}")
    if st.st_size > max_bytes:
        raise ValueError(f"{path} is {st.st_size} bytes, more than the {max_bytes} an szo {what} may have")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # swapped for a pipe since the stat: no hang
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a regular file; it is not an szo {what}")
        chunks, n = [], 0
        while n <= max_bytes:
            b = os.read(fd, min(1 << 20, max_bytes + 1 - n))
            if not b:
                break
            chunks.append(b)
            n += len(b)
    finally:
        os.close(fd)
    if n > max_bytes:
        raise ValueError(f"{path} grew past the {max_bytes} bytes an szo {what} may have while it was read")
    return b"".join(chunks)


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory (makes renames / creations in it durable); best effort, never raises."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    """The process's umask (set and restored at once: there is no way to only read it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> str:
    """Write ``data`` to ``path`` atomically (temp file in the same directory, fsync, rename).

    Returns the sha256 hex digest of ``data``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise _naming(e, path, data) from None
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would survive the rename: a shared store unreadable to others
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):  # a full disk, a file-size limit: the error names the file it was writing
            raise _naming(e, path, data) from None
        raise
    fsync_dir(path.parent)
    return hashlib.sha256(data).hexdigest()


def _naming(e: OSError, path: Path, data: bytes) -> OSError:
    """``e`` (same type and errno) naming the file being written and its size: ``[Errno 27] File too
    large`` alone does not say which of a run's files could not be written."""
    if e.errno is None:
        return e
    return type(e)(e.errno, f"{e.strerror or e} (writing {len(data)} bytes; nothing was replaced)", str(path))


def atomic_write_text(path: str | os.PathLike, text: str) -> str:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> str:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def canonical_safetensors(data: bytes) -> bytes:
    """The same safetensors file with its JSON header's keys sorted (metadata too).

    safetensors keeps ``__metadata__`` in a Rust HashMap whose order changes from process to
    process, so the same tensors and metadata gave files with different bytes and sha256s. The
    format allows any key order and space padding of the header to 8 bytes; the data section
    and its offsets are untouched."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + n:]


def atomic_save_safetensors(
    path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> str:
    """Save tensors with safetensors (no pickle), atomically; returns the file's sha256. The header is
    canonical (``canonical_safetensors``): the same tensors and metadata give the same bytes."""
    from safetensors.torch import save

    data = save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata=dict(metadata or {}))
    return atomic_write_bytes(path, canonical_safetensors(data))


class WeightsIntegrityError(ValueError):
    """A weights file that does not match its sha256 record, or that is not readable safetensors."""


def weights_record_path(path: str | os.PathLike) -> Path:
    """The sha256 record of a weights file: ``model.safetensors`` -> ``model.json``."""
    return Path(path).with_suffix(".json")


def save_weights(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor],
                 metadata: Mapping[str, str] | None = None) -> str:
    """:func:`atomic_save_safetensors` plus a sha256 record (``model.json`` beside ``model.safetensors``),
    written first and keeping the replaced file's sha256 as ``previous``, so a kill between the
    two writes leaves a file its record still vouches for. Returns the sha256."""
    from safetensors.torch import save

    path = Path(path)
    data = canonical_safetensors(save({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
                                      metadata=dict(metadata or {})))
    digest = hashlib.sha256(data).hexdigest()
    prev = sha256_file(path) if path.is_file() else None
    atomic_write_json(weights_record_path(path), {"format": "szo-weights-record", "file": path.name, "sha256": digest,
                                                  "bytes": len(data), "previous": prev and {"sha256": prev}})
    atomic_write_bytes(path, data)
    return digest


def load_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a weights file written by :func:`save_weights`, after checking its sha256
    record; one :class:`WeightsIntegrityError` line for a tampered, truncated or unreadable file.
    A file without a record (older szo, or copied without it) is read with a note on stderr."""
    from safetensors.torch import load

    path = Path(path)
    data = path.read_bytes()
    rec_path = weights_record_path(path)
    if rec_path.is_file():
        try:
            rec = json.loads(rec_path.read_text(encoding="utf-8"))
            want = {rec["sha256"], *([rec["previous"]["sha256"]] if rec.get("previous") else [])}
        except (ValueError, KeyError, TypeError):
            raise WeightsIntegrityError(f"{rec_path} is not a weights record (corrupt); restore it or the run") from None
        got = hashlib.sha256(data).hexdigest()
        if got not in want:
            raise WeightsIntegrityError(
                f"{path} does not match the sha256 in {rec_path.name} ({len(data)} bytes, the record says "
                f"{rec.get('bytes')}): tampered, truncated or corrupt; restore the file, or train the run again")
    else:
        print(f"note: {path} has no sha256 record {rec_path.name} (older szo, or copied without it): "
              "its integrity is not checked", file=sys.stderr)
    try:
        return load(data)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types on malformed files
        raise WeightsIntegrityError(f"{path} is not a readable safetensors file ({str(e).splitlines()[0]})") from None


def atomic_torch_save(path: str | os.PathLike, obj: Any) -> str:
    """``torch.save`` through a temp file. Only save plain containers of tensors / numbers / strings,
    so that ``torch.load(path, weights_only=True)`` can read it back."""
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return atomic_write_bytes(path, buf.getvalue())


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()
