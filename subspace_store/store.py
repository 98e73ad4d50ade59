"""A directory of named subspaces: ``root/NAME/{basis.safetensors, manifest.json}``.

Saving writes the whole entry into ``root/.NAME.tmp-<pid>/`` and renames the directory into
place (``os.replace``); an overwrite renames the old entry away first, renames the new one
in, then deletes the old one (and puts it back if the second rename fails). A crash leaves
the old entry or none, never a mix. Loading checks every tensor's sha256, dtype and shape
against the manifest, and (with ``model=``) the parameter layout against the model.

One writer per entry: ``save`` and ``delete`` hold ``root/.NAME.lock`` (``flock``); a second
writer of the same name gets one line (:class:`StoreBusyError`). A process killed inside a
write leaves hidden ``.NAME.tmp-<pid>`` / ``.NAME.old-<pid>`` / ``.NAME.del-<pid>`` directories:
:meth:`SubspaceStore.partial` lists them (``szo subspace ls`` shows them), the next writer of
the name cleans them up (and puts a renamed-away old entry back if the new one never arrived),
``szo subspace rm NAME`` removes them. Every tensor is checked when saving and loading: a
non-finite value anywhere (basis, mean, reference, eigenvalues, explained-variance ratios) and a
basis whose columns are not orthonormal (``max |P^T P - I|`` above :data:`ORTHONORMAL_TOL` of its
storage dtype: an all-zero basis, one scaled or unnormalised) are refused; a save that would write
an entry every later load refuses fails instead.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import hashlib
import json
import os
import re
import shutil
import struct
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from szo.io import atomic_write_json, fsync_dir
from szo.layout import layout_from_json, layout_mismatch, layout_to_json, param_layout

from .format import (
    FORMAT,
    FORMAT_VERSION,
    STORAGE_DTYPES,
    TENSOR_NAMES,
    Subspace,
    SubspaceIntegrityError,
    validate_manifest,
)

__all__ = ["SubspaceStore", "SubspaceNotFoundError", "LayoutMismatchError", "StoreBusyError", "default_root",
           "ORTHONORMAL_TOL", "orthonormality_error"]

BASIS_FILE = "basis.safetensors"
MANIFEST_FILE = "manifest.json"
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}")
_ST_DTYPE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}
_ST_DTYPE_INV = {v: k for k, v in _ST_DTYPE.items()}
_WRITE_CHUNK = 64 << 20
_PARTIAL_RE = re.compile(r"^\.(?P<name>[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199})\.(?P<kind>tmp|old|del)-(?P<pid>\d+)$")


class SubspaceNotFoundError(ValueError):
    """No entry of that name in the store."""


class LayoutMismatchError(ValueError):
    """The subspace was built for a model with another parameter layout."""


class StoreBusyError(ValueError):
    """Another process is writing (saving or deleting) the same entry."""


ORTHONORMAL_TOL: dict[torch.dtype, float] = {torch.float64: 1e-2, torch.float32: 1e-2, torch.float16: 1e-2,
                                             torch.bfloat16: 2e-2}
"""Largest ``|P^T P - I|`` entry a stored basis may have, by the dtype it is stored in. Rounding
alone moves an entry of ``P^T P`` by up to ~2 * 2**-9 = 3.9e-3 in bfloat16 (8-bit mantissa) and
~4.9e-4 in float16; a built float32 basis is orthonormal to ~1e-6, to ~5e-4 when a direction's
explained variance is ~1e-13 (its column is then mostly rounding). A broken basis is far off (an
all-zero one: 1), so the tolerance leaves rounding a margin."""
_GRAM_ROWS = 1 << 16


def orthonormality_error(basis: torch.Tensor, dtype: torch.dtype | None = None) -> float:
    """``max |P^T P - I|`` of ``basis`` ``[d, k]`` (as rounded to ``dtype`` if given), summed over row
    blocks (float32 products, float64 sums): no full copy of a large basis."""
    k = basis.shape[1]
    gram = torch.zeros(k, k, dtype=torch.float64)
    for a in range(0, basis.shape[0], _GRAM_ROWS):
        block = basis[a:a + _GRAM_ROWS].detach().cpu()
        block = (block.to(dtype) if dtype is not None else block).to(torch.float32)
        gram += (block.T @ block).to(torch.float64)
    gram -= torch.eye(k, dtype=torch.float64)
    return float(gram.abs().max()) if k else 0.0


def _check_tensors(tensors: dict[str, torch.Tensor], what: str, exc: type[Exception],
                   storage: torch.dtype | None = None) -> None:
    """Every tensor finite, the basis orthonormal within :data:`ORTHONORMAL_TOL` of its storage dtype."""
    for n, t in tensors.items():
        if t.is_floating_point():
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                raise exc(f"{what}: tensor {n!r} holds {bad} non-finite value(s) (NaN / inf); a subspace must be finite")
    basis = tensors["basis"]
    sdt = storage or basis.dtype
    err = orthonormality_error(basis, storage)
    tol = ORTHONORMAL_TOL[sdt]
    if not err <= tol:
        raise exc(f"{what}: the basis is not orthonormal (max |P^T P - I| = {err:.3g} > {tol:g}, the tolerance of "
                  f"{str(sdt).replace('torch.', '')} storage); a subspace basis must have orthonormal columns "
                  "(build_subspace and random_subspace make such bases; a built one is this far off only in directions of "
                  "~zero variance: choose a smaller k)")


def default_root() -> Path:
    """``$SZO_SUBSPACE_ROOT`` or ``./subspaces``."""
    return Path(os.environ.get("SZO_SUBSPACE_ROOT") or "subspaces")


def _raw_bytes(t: torch.Tensor):
    """A flat uint8 numpy view of a contiguous CPU tensor's bytes (no copy)."""
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, str]:
    """Stream tensors into a safetensors file without a full in-memory copy; return sha256 per tensor."""
    header: dict[str, Any] = {"__metadata__": metadata}
    off = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPE[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    hashes = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for name, t in tensors.items():
            hashes[name] = _sha256_tensor(t, f.write)
        f.flush()
        os.fsync(f.fileno())
    return hashes


def _sha256_tensor(t: torch.Tensor, sink: Callable[[Any], Any] | None = None) -> str:
    """sha256 of a tensor's raw bytes, in chunks (no full copy); each chunk also goes to ``sink``."""
    raw = _raw_bytes(t)
    h = hashlib.sha256()
    for a in range(0, raw.size, _WRITE_CHUNK):
        piece = raw[a : a + _WRITE_CHUNK]
        h.update(piece)
        if sink is not None:
            sink(piece)
    return h.hexdigest()


def _dtype_arg(dtype: Any, what: str) -> torch.dtype:
    if isinstance(dtype, str) and dtype in STORAGE_DTYPES:
        return STORAGE_DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in STORAGE_DTYPES.values():
        return dtype
    raise ValueError(f"{what} must be one of {list(STORAGE_DTYPES)}, got {dtype!r}")


class SubspaceStore:
    """Named subspaces under one root directory (default ``$SZO_SUBSPACE_ROOT`` or ``./subspaces``)."""

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()

    # ---- names and paths
    @staticmethod
    def _check_name(name: Any) -> str:
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or ".." in name:
            raise ValueError(
                f"invalid subspace name {name!r}: use 1-200 characters from letters, digits, '_', '-', '.', "
                "not starting with '.' or '-', without '..' or path separators"
            )
        return name

    def path(self, name: str) -> Path:
        """Directory of entry ``name``."""
        return self.root / self._check_name(name)

    def exists(self, name: str) -> bool:
        return (self.path(name) / MANIFEST_FILE).is_file()

    def list(self) -> list[str]:
        """Names of the stored entries, sorted."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir()
                      if p.is_dir() and not p.name.startswith(".") and (p / MANIFEST_FILE).is_file())

    def incomplete(self) -> list[str]:
        """Entry directories without a manifest (a foreign or interrupted write; ``save`` never
        leaves one): they block their name until removed (``delete`` / ``szo subspace rm``)."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")
                      and _NAME_RE.fullmatch(p.name) and not (p / MANIFEST_FILE).is_file())

    def partial(self) -> list[dict[str, Any]]:
        """Hidden directories a killed write left behind: ``{"name", "kind", "pid", "path"}`` (kind
        ``tmp``: a new entry being written; ``old``: an entry renamed away during an overwrite;
        ``del``: an entry being deleted)."""
        if not self.root.is_dir():
            return []
        out = []
        for p in sorted(self.root.iterdir()):
            m = _PARTIAL_RE.match(p.name)
            if m and p.is_dir() and not _alive(int(m["pid"])):
                out.append({"name": m["name"], "kind": m["kind"], "pid": int(m["pid"]), "path": str(p)})
        return out

    @contextlib.contextmanager
    def _writer(self, name: str) -> Iterator[None]:
        """Hold entry ``name``'s writer lock, after cleaning up what killed writers left of it."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f".{name}.lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise StoreBusyError(f"cannot lock subspace {name!r} in {self.root}: {path} ({e.strerror})") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StoreBusyError(f"subspace {name!r} in {self.root} is being written by another process; "
                                     "wait for it to finish, then try again") from None
            self._recover(name)
            yield
        finally:
            os.close(fd)

    def _recover(self, name: str) -> None:
        """Under the writer lock: put back an entry an interrupted overwrite renamed away (its
        replacement never arrived), then remove every partial directory of ``name``."""
        final = self.path(name)
        mine = [p for p in self.partial() if p["name"] == name]
        if not final.exists():
            for p in mine:
                if p["kind"] == "old" and (Path(p["path"]) / MANIFEST_FILE).is_file():
                    os.replace(p["path"], final)
                    break
        for p in mine:
            shutil.rmtree(p["path"], ignore_errors=True)

    def digest(self, name: str) -> str:
        """sha256 identifying the content of entry ``name`` (from its manifest's tensor records):
        what a run pins to refuse a store entry rebuilt under the same name."""
        tensors = self.info(name)["tensors"]
        record = {n: tensors[n]["sha256"] for n in sorted(tensors)}
        return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()

    def summaries(self) -> list[dict]:
        """One dict per entry: name, model, k, N, d, storage_dtype, explained variance (sum), created;
        an unreadable or incomplete entry gives ``{"name", "error"}``."""
        out = []
        for p in self.partial():
            if not self.path(p["name"]).exists():
                out.append({"name": p["name"], "error": f"partial write left by process {p['pid']} (killed while "
                                                        f"writing; {p['path']}): szo subspace rm {p['name']} removes it"})
        for name in sorted(self.list() + self.incomplete()):
            if not self.exists(name):
                out.append({"name": name, "error": f"incomplete entry: no {MANIFEST_FILE} (remove it with "
                                                   f"szo subspace rm {name})"})
                continue
            try:
                m = self.info(name)
            except SubspaceIntegrityError as e:
                out.append({"name": name, "error": str(e)})
                continue
            out.append({"name": name, "model": m["model"], "k": m["k"], "N": m["N"], "d": m["d"],
                        "storage_dtype": m["storage_dtype"], "explained_variance": float(sum(m["explained_variance_ratio"])),
                        "created": m["created"]})
        return out

    def _require(self, name: str) -> Path:
        p = self.path(name)
        if not (p / MANIFEST_FILE).is_file():
            avail = self.list()
            raise SubspaceNotFoundError(
                f"no subspace named {name!r} in {self.root}; available: {', '.join(avail) if avail else '(none)'}"
            )
        return p

    def info(self, name: str) -> dict:
        """The validated manifest of entry ``name`` (no tensors are read)."""
        p = self._require(name) / MANIFEST_FILE
        try:
            man = json.loads(p.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SubspaceIntegrityError(f"{p} is not valid JSON ({e}); the entry is corrupt") from None
        return validate_manifest(man, str(p))

    # ---- save
    def save(self, name: str, subspace: Subspace, *, storage_dtype: Any = torch.float32, overwrite: bool = False) -> Path:
        """Write ``subspace`` as entry ``name`` (basis stored in ``storage_dtype``); returns its directory."""
        final = self.path(name)
        sdt = _dtype_arg(storage_dtype, "storage_dtype")
        if not isinstance(subspace, Subspace):
            raise ValueError(f"subspace must be a subspace_store.Subspace, got {type(subspace).__name__}")
        _check_tensors({n: getattr(subspace, n) for n in TENSOR_NAMES}, f"subspace {name!r}", ValueError, sdt)
        with self._writer(name):
            if final.exists() and not overwrite:
                what = "already exists" if self.exists(name) else f"is taken by an incomplete entry (no {MANIFEST_FILE})"
                raise ValueError(f"subspace {name!r} {what} in {self.root}; pass overwrite=True (CLI: --overwrite) "
                                 f"or remove it (szo subspace rm {name})")
            return self._write(name, final, subspace, sdt)

    def _write(self, name: str, final: Path, subspace: Subspace, sdt: torch.dtype) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{name}.tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        try:
            tensors = {
                "basis": subspace.basis.detach().cpu().to(sdt),
                "mean": subspace.mean.detach().cpu().to(torch.float32),
                "reference": subspace.reference.detach().cpu().to(torch.float32),
                "eigenvalues": subspace.eigenvalues.detach().cpu().to(torch.float64),
                "explained_variance_ratio": subspace.explained_variance_ratio.detach().cpu().to(torch.float64),
            }
            hashes = _write_safetensors(tmp / BASIS_FILE, tensors, {"format": FORMAT, "version": str(FORMAT_VERSION)})
            prov = dict(subspace.provenance)
            manifest = {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "k": subspace.k,
                "N": int(prov.get("N") or 0),
                "d": subspace.d,
                "model": subspace.model,
                "fingerprint": subspace.fingerprint,
                "layout": layout_to_json(subspace.layout),
                "storage_dtype": str(sdt).replace("torch.", ""),
                "eigenvalues": [float(x) for x in tensors["eigenvalues"]],
                "explained_variance_ratio": [float(x) for x in tensors["explained_variance_ratio"]],
                "provenance": prov,
                "tensors": {n: {"dtype": _ST_DTYPE[t.dtype], "shape": list(t.shape), "sha256": hashes[n]}
                            for n, t in tensors.items()},
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            }
            del tensors
            atomic_write_json(tmp / MANIFEST_FILE, manifest)
            fsync_dir(tmp)
            self._swap_in(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_dir(self.root)
        return final

    def _swap_in(self, tmp: Path, final: Path) -> None:
        if not final.exists():
            os.replace(tmp, final)
            return
        old = self.root / f".{final.name}.old-{os.getpid()}"
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        try:
            os.replace(tmp, final)
        except BaseException:
            os.replace(old, final)  # roll back: the old entry stays
            raise
        shutil.rmtree(old, ignore_errors=True)

    # ---- load
    def load(self, name: str, model: nn.Module | None = None, *, dtype: Any = torch.float32, verify: bool = True) -> Subspace:
        """Read entry ``name``; basis converted to ``dtype``. With ``model``, check its parameter layout."""
        want = _dtype_arg(dtype, "dtype")
        man = self.info(name)
        where = self.path(name) / BASIS_FILE
        if model is not None:
            check_model_layout(man, model, name)
        from safetensors import safe_open

        tensors: dict[str, torch.Tensor] = {}
        try:
            with safe_open(str(where), framework="pt") as f:
                keys = set(f.keys())
                missing = [n for n in TENSOR_NAMES if n not in keys]
                if missing:
                    raise SubspaceIntegrityError(f"{where} lacks tensors {missing}; the entry is corrupt")
                for n in TENSOR_NAMES:
                    tensors[n] = f.get_tensor(n)
        except SubspaceIntegrityError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors raises on truncated / malformed files
            raise SubspaceIntegrityError(f"cannot read {where} (truncated or corrupt file): {e}") from None
        for n, t in tensors.items():
            spec = man["tensors"][n]
            if _ST_DTYPE.get(t.dtype) != spec["dtype"] or list(t.shape) != list(spec["shape"]):
                raise SubspaceIntegrityError(
                    f"{where}: tensor {n!r} is {_ST_DTYPE.get(t.dtype)} {list(t.shape)}, "
                    f"the manifest says {spec['dtype']} {spec['shape']}"
                )
            if verify and _sha256_tensor(t) != spec["sha256"]:
                raise SubspaceIntegrityError(f"{where}: tensor {n!r} does not match its sha256 (file tampered or corrupt)")
        if list(tensors["basis"].shape) != [man["d"], man["k"]]:
            raise SubspaceIntegrityError(f"{where}: basis shape {list(tensors['basis'].shape)} != [d, k] = [{man['d']}, {man['k']}]")
        _check_tensors(tensors, str(where), SubspaceIntegrityError)
        basis = tensors.pop("basis")
        if basis.dtype != want:
            basis = basis.to(want)
        return Subspace(
            basis=basis,
            mean=tensors["mean"],
            reference=tensors["reference"],
            eigenvalues=tensors["eigenvalues"],
            explained_variance_ratio=tensors["explained_variance_ratio"],
            layout=layout_from_json(man["layout"]),
            fingerprint=man["fingerprint"],
            model=man["model"],
            provenance=dict(man["provenance"]),
        )

    # ---- delete
    def delete(self, name: str) -> None:
        """Remove entry ``name``, also an incomplete one (renamed away first, so it disappears
        atomically), and whatever killed writes left of it."""
        had_partial = any(p["name"] == name for p in self.partial())
        with self._writer(name):  # cleans the partial directories
            p = self.path(name)
            if not p.is_dir():
                if had_partial:
                    return
                p = self._require(name)
            self._remove(name, p)

    def _remove(self, name: str, p: Path) -> None:
        gone = self.root / f".{name}.del-{os.getpid()}"
        if gone.exists():
            shutil.rmtree(gone)
        os.replace(p, gone)
        shutil.rmtree(gone, ignore_errors=True)

    def __contains__(self, name: str) -> bool:
        return self.exists(name)

    def __repr__(self) -> str:
        return f"SubspaceStore({str(self.root)!r})"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (on this host): a partial directory of a live writer is not stale."""
    if pid == os.getpid():
        return False  # this process holds the writer lock while it looks: its own leftovers are stale
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_model_layout(manifest_or_subspace: Any, model: nn.Module, name: str = "subspace") -> None:
    """Raise LayoutMismatchError naming the first parameter whose name/shape differs from the model's."""
    if isinstance(manifest_or_subspace, Subspace):
        layout, d = manifest_or_subspace.layout, manifest_or_subspace.d
    else:
        layout, d = layout_from_json(manifest_or_subspace["layout"]), int(manifest_or_subspace["d"])
    found = param_layout(model)
    if layout is None:
        got = sum(torch.Size(s).numel() for _, s in found)
        if got != d:
            raise LayoutMismatchError(f"subspace {name!r} has d = {d}, the model has d = {got} parameters")
        return
    msg = layout_mismatch(layout, found)
    if msg is not None:
        raise LayoutMismatchError(f"subspace {name!r} does not fit this model: {msg}")