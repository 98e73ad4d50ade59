"""Streaming centered PCA of a weight trajectory (paper Sec. 4.1) through the N x N Gram matrix.

With samples theta_1..theta_N in R^d (N << d), Theta = [theta_i - mean] (d x N):

1. one streaming pass over chunks of the d coordinates of all N samples accumulates the
   Gram matrix G = Theta^T Theta (N x N, float64) and the mean. Inside a chunk every sample
   is first shifted by sample 1 (exact in float64; the centered Gram does not depend on the
   shift), so no large common offset cancels: G = J S^T S J with S the shifted samples and
   J = I - 11^T/N;
2. ``eigh(G) = V diag(lambda) V^T``; the top k pairs give the covariance eigenvalues
   ``lambda / (N - 1)`` and ratios ``lambda / trace(G)`` (sklearn's PCA conventions);
3. a second streaming pass writes P = Theta V_k diag(lambda_k)^(-1/2) chunk by chunk into a
   preallocated ``[d, k]`` tensor (orthonormal columns by construction).

Never materialises d x d, never holds N x d: peak memory is P + mean + two chunk buffers.
Sign convention (deterministic, like sklearn's ``svd_flip``): the entry of largest magnitude
of each column of P is positive (the first such entry on ties).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from szo.trajectory import Trajectory, TrajectoryIntegrityError, TrajectoryMismatchError, parse_epoch_window

from .format import Subspace

__all__ = ["build_subspace", "DEFAULT_CHUNK_BYTES"]

DEFAULT_CHUNK_BYTES = 64 << 20  # float64 bytes of one N x chunk block


# ----------------------------------------------------------------------------- sources
class _FileSource:
    """N safetensors files, each with tensor 'theta' float32 [d]; read by slices of d.

    ``samples[i] = (trajectory, index)`` names the manifest entry of file i, whose sha256
    ``Trajectory.verify_sample`` checks; None for spooled files (no manifest).
    """

    def __init__(self, files: list[Path], d: int, samples: list[tuple[Trajectory, int]] | None = None) -> None:
        self.files, self.d, self.samples = files, d, samples

    @property
    def n(self) -> int:
        return len(self.files)

    def describe(self, i: int) -> str:
        if self.samples is not None:
            traj, j = self.samples[i]
            s = traj.samples[j]
            return f"sample file {self.files[i]} (epoch {s['epoch']}, step {s['step']})"
        return f"sample #{i} ({self.files[i]})"

    def check(self, verify: bool, progress: bool) -> None:
        from safetensors import safe_open

        for i, f in enumerate(tqdm(self.files, desc="verify samples", disable=not progress, leave=False)):
            if verify and self.samples is not None:
                traj, j = self.samples[i]
                traj.verify_sample(j)  # missing file or sha256 mismatch
            elif not f.exists():
                raise TrajectoryIntegrityError(f"sample file {f} is missing")
            try:
                with safe_open(str(f), framework="pt") as h:
                    sl = h.get_slice("theta")
                    shape, dtype = list(sl.get_shape()), sl.get_dtype()
            except Exception as e:  # noqa: BLE001 - unreadable header = corrupt file
                raise TrajectoryIntegrityError(f"cannot read sample file {f}: {e}") from None
            if shape != [self.d] or dtype != "F32":
                raise TrajectoryIntegrityError(f"{f}: 'theta' is {dtype} {shape}, expected F32 [{self.d}]")

    def read_chunk(self, a: int, b: int, out: np.ndarray) -> None:
        from safetensors import safe_open

        for i, f in enumerate(self.files):
            # open per chunk: the mmap is released at once. numpy does the float32 -> float64
            # copy single-threaded (torch's OpenMP copy is 10x slower on an oversubscribed host).
            with safe_open(str(f), framework="np") as h:
                out[i, : b - a] = h.get_slice("theta")[a:b]

    def read_full(self, i: int) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.files[i]), framework="pt") as h:
            return h.get_tensor("theta").to(torch.float32).clone()


class _MemorySource:
    """A sequence of in-memory 1-D vectors."""

    def __init__(self, vectors: Sequence[torch.Tensor]) -> None:
        self.vectors = vectors
        self.d = int(vectors[0].numel())

    @property
    def n(self) -> int:
        return len(self.vectors)

    def check(self, verify: bool, progress: bool) -> None:
        pass

    def describe(self, i: int) -> str:
        return f"sample #{i}"

    def read_chunk(self, a: int, b: int, out: np.ndarray) -> None:
        for i, v in enumerate(self.vectors):
            t = v[a:b]
            out[i, : b - a] = (t if t.dtype in (torch.float16, torch.float32, torch.float64) else t.float()).numpy()

    def read_full(self, i: int) -> torch.Tensor:
        return self.vectors[i].detach().to("cpu", torch.float32).clone()


def _as_vector(v: Any, i: int) -> torch.Tensor:
    if isinstance(v, np.ndarray):
        v = torch.from_numpy(v)
    if not isinstance(v, torch.Tensor):
        raise ValueError(f"sample #{i} must be a 1-D torch.Tensor or numpy array, got {type(v).__name__}")
    if v.dim() != 1 or not (v.is_floating_point()):
        raise ValueError(f"sample #{i} must be a 1-D floating-point vector, got {v.dtype} shape {tuple(v.shape)}")
    return v.detach().cpu()


def _spool(vectors: Iterable[Any], directory: Path, progress: bool) -> tuple[list[Path], int]:
    """Write a one-shot iterable of vectors as sample files (O(d) memory)."""
    from safetensors.torch import save_file

    files, d = [], None
    for i, v in enumerate(tqdm(vectors, desc="spool samples", disable=not progress, leave=False)):
        v = _as_vector(v, i).to(torch.float32).contiguous()
        if d is None:
            d = v.numel()
        elif v.numel() != d:
            raise ValueError(f"all samples must have the same length; sample #0 has {d}, sample #{i} has {v.numel()}")
        f = directory / f"sample_{i:06d}.safetensors"
        save_file({"theta": v}, str(f))
        files.append(f)
    return files, int(d or 0)


def _is_path_like(x: Any) -> bool:
    return isinstance(x, (str, os.PathLike, Trajectory))


def _trajectories(items: Sequence[Any], window: Any) -> tuple[list[Trajectory], list[Trajectory]]:
    trajs = [x if isinstance(x, Trajectory) else Trajectory(x) for x in items]
    if not trajs:
        raise ValueError("no trajectory given")
    first = trajs[0]
    for t in trajs[1:]:
        for key in ("d", "layout", "fingerprint"):
            if getattr(t, key) != getattr(first, key):
                raise TrajectoryMismatchError(
                    f"trajectories {first.directory} and {t.directory} differ in {key} "
                    f"(model {first.model!r} vs {t.model!r}); a subspace can only be built from one model's trajectories"
                )
    selected = []
    for t in trajs:
        try:
            selected.append(t.select(window))
        except ValueError:
            if len(trajs) == 1:
                raise
            selected.append(None)
    selected = [s for s in selected if s is not None]
    if not selected:
        raise ValueError(f"no samples in epoch window {window!r} in any of the {len(trajs)} trajectories")
    return trajs, selected


# ----------------------------------------------------------------------------- builder
def build_subspace(
    trajectories: Any,
    k: int,
    *,
    window: Any = None,
    dtype: torch.dtype = torch.float32,
    reference: str | torch.Tensor = "first",
    chunk_size: int | None = None,
    progress: bool = True,
    verify: bool = True,
) -> Subspace:
    """Top-k centered PCA basis of one or more weight trajectories.

    Args:
        trajectories: a trajectory directory / ``Trajectory``, a list of them (their samples
            are pooled; all must share model layout and fingerprint), or an iterable of
            flat 1-D tensors / arrays (a list is read in place, a generator is spooled to a
            temporary directory first).
        k: number of directions, ``1 <= k <= N - 1``.
        window: inclusive epoch window ``(start, end)`` or ``"start-end"`` (trajectories only).
        dtype: dtype of the returned basis (computation is float64).
        reference: ``"first"`` (first selected sample of the first trajectory: scratch
            training), ``"last"`` (last sample of the last trajectory: continual training) or
            a ``[d]`` tensor.
        chunk_size: coordinates of d read per block (default: ~64 MB float64 blocks).
        progress: show tqdm bars.
        verify: check every sample file's sha256 against its manifest first.
    """
    _check_build_args(k, dtype, reference, chunk_size)
    tmp: tempfile.TemporaryDirectory | None = None
    try:
        source, meta, tmp = _open_source(trajectories, window, progress)
        n, d = source.n, source.d
        if n < 2:
            raise ValueError(f"need at least 2 samples for a centered PCA, got N = {n}")
        if not 1 <= k <= n - 1:
            raise ValueError(f"k must be in [1, N-1] = [1, {n - 1}] for N = {n} samples (centering removes one dimension), got k = {k}")
        if d < 1:
            raise ValueError("samples are empty (d = 0)")
        source.check(verify, progress)
        if isinstance(reference, torch.Tensor):
            if reference.dim() != 1 or reference.numel() != d:
                raise ValueError(f"reference tensor must have shape [{d}], got {tuple(reference.shape)}")
            ref = reference.detach().to("cpu", torch.float32).clone()
            ref_kind = "tensor"
        else:
            ref = source.read_full(0 if reference == "first" else n - 1)
            ref_kind = reference
        c = min(chunk_size or max(1024, DEFAULT_CHUNK_BYTES // (8 * n)), d)
        bounds = [(a, min(a + c, d)) for a in range(0, d, c)]
        gram, mean = _gram_pass(source, bounds, progress)
        lam, w, total = _top_k(gram, k)
        basis = _basis_pass(source, bounds, mean, w, dtype, progress)
        provenance = dict(meta["provenance"])
        provenance.update({
            "N": n,
            "k": k,
            "reference": ref_kind,
            "builder": "gram-eigh-float64",
            "total_variance": total / (n - 1),
            "sign_convention": "largest-magnitude entry of each column positive",
        })
        return Subspace(
            basis=basis,
            mean=mean.to(torch.float32),
            reference=ref,
            eigenvalues=lam / (n - 1),
            explained_variance_ratio=lam / total,
            layout=meta["layout"],
            fingerprint=meta["fingerprint"],
            model=meta["model"],
            provenance=provenance,
        )
    finally:
        if tmp is not None:
            tmp.cleanup()


def _check_build_args(k: Any, dtype: torch.dtype, reference: Any, chunk_size: Any) -> None:
    if isinstance(k, bool) or not isinstance(k, int):
        raise ValueError(f"k must be an int, got {k!r}")
    if dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be float32, float64, float16 or bfloat16, got {dtype}")
    if not (isinstance(reference, torch.Tensor) or reference in ("first", "last")):
        raise ValueError(f"reference must be 'first', 'last' or a [d] tensor, got {reference!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")


def _open_source(trajectories: Any, window: Any, progress: bool):
    """The samples as a chunk-readable source, their metadata (layout, fingerprint, model,
    provenance) and the spool directory to clean up (a generator input), or ``None``."""
    items = trajectories
    if _is_path_like(items):
        items = [items]
    if isinstance(items, (torch.Tensor, np.ndarray)):
        if items.ndim != 2:
            raise ValueError(f"a tensor input must be [N, d] (one sample per row), got shape {tuple(items.shape)}")
        items = list(items)
    if isinstance(items, (list, tuple)) and items and all(_is_path_like(x) for x in items):
        trajs, sel = _trajectories(items, window)
        samples = [(t, i) for t in sel for i in range(len(t))]
        source: Any = _FileSource([t.path(i) for t, i in samples], sel[0].d, samples)
        provenance = {
            "trajectories": [str(Path(t.directory).resolve()) for t in trajs],
            "epochs": [int(s["epoch"]) for t in sel for s in t.samples],
            "steps": [int(s["step"]) for t in sel for s in t.samples],
            "samples_per_trajectory": [len(t) for t in sel],
            "window": None if window is None else list(parse_epoch_window(window) or ()),
        }
        meta = dict(layout=sel[0].layout, fingerprint=sel[0].fingerprint, model=sel[0].model, provenance=provenance)
        return source, meta, None
    if window is not None:
        raise ValueError("window selects epochs of trajectory directories; it cannot apply to raw vectors")
    meta = dict(layout=None, fingerprint=None, model=None,
                provenance={"trajectories": [], "epochs": None, "steps": None, "window": None})
    if isinstance(items, (list, tuple)):
        if any(_is_path_like(x) for x in items):
            raise ValueError("pass either trajectory directories or vectors, not a mix of both")
        vecs = [_as_vector(v, i) for i, v in enumerate(items)]
        if not vecs:
            raise ValueError("no samples given")
        d0 = vecs[0].numel()
        for i, v in enumerate(vecs):
            if v.numel() != d0:
                raise ValueError(f"all samples must have the same length; sample #0 has {d0}, sample #{i} has {v.numel()}")
        return _MemorySource(vecs), meta, None
    if isinstance(items, Iterable):
        tmp = tempfile.TemporaryDirectory(prefix="szo-spool-")
        try:
            files, d0 = _spool(items, Path(tmp.name), progress)
        except BaseException:
            tmp.cleanup()
            raise
        return _FileSource(files, d0), meta, tmp
    raise ValueError(
        "trajectories must be a trajectory directory, a Trajectory, a list of those, "
        f"or an iterable of 1-D vectors; got {type(items).__name__}"
    )


def _gram_pass(source: Any, bounds: list[tuple[int, int]], progress: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 1: the doubly-centred N x N Gram matrix of the samples and their mean, chunk by chunk
    (each chunk shifted by its first sample first, which keeps float64 cancellation small)."""
    n, d = source.n, source.d
    buf64 = torch.empty(n, max(b - a for a, b in bounds), dtype=torch.float64)
    buf_np = buf64.numpy()
    gram = torch.zeros(n, n, dtype=torch.float64)
    mean = torch.empty(d, dtype=torch.float64)
    for a, b in tqdm(bounds, desc="subspace pass 1/2 (Gram)", disable=not progress):
        source.read_chunk(a, b, buf_np)
        x = buf64[:, : b - a]
        finite = torch.isfinite(x).all(dim=1)
        if not bool(finite.all()):
            i = int((~finite).nonzero()[0, 0])
            raise ValueError(f"{source.describe(i)} holds non-finite values (NaN / inf): a subspace cannot be built "
                             "through it; was the run diverging when it was recorded? Build from an epoch window "
                             "without it (--window / subspace.window)")
        shift = x[0].clone()
        x.sub_(shift)
        gram.addmm_(x, x.t())
        mean[a:b] = shift + x.mean(0)
    r = gram.mean(0)
    gram = gram - r[None, :] - r[:, None] + r.mean()
    return 0.5 * (gram + gram.t()), mean


def _top_k(gram: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The top-k eigenvalues of the centred Gram, the N x k sample weights ``W`` with
    ``P = (Theta - mean) W`` orthonormal, and the total variance (times N - 1)."""
    n = gram.shape[0]
    total = float(torch.diagonal(gram).sum())
    ev_np, evec_np = np.linalg.eigh(gram.numpy())  # LAPACK dsyevd, ascending
    evals = torch.from_numpy(np.ascontiguousarray(ev_np[::-1]))
    evecs = torch.from_numpy(np.ascontiguousarray(evec_np[:, ::-1]))
    tol = max(float(evals[0]), 0.0) * n * torch.finfo(torch.float64).eps * 10
    rank = int((evals > tol).sum())
    if rank < k or total <= 0:
        raise ValueError(
            f"the {n} samples span only {rank} directions of nonzero variance; choose k <= {rank} "
            "(are the samples duplicates of each other?)"
        )
    lam = evals[:k]
    return lam, evecs[:, :k] / lam.sqrt()[None, :], total


def _basis_pass(source: Any, bounds: list[tuple[int, int]], mean: torch.Tensor, w: torch.Tensor,
                dtype: torch.dtype, progress: bool) -> torch.Tensor:
    """Pass 2: ``P = (Theta - mean) W`` chunk by chunk, each column's sign fixed so that its
    largest-magnitude entry (the first, on ties) is positive."""
    n, d, k = source.n, source.d, w.shape[1]
    buf64 = torch.empty(n, max(b - a for a, b in bounds), dtype=torch.float64)
    buf_np = buf64.numpy()
    basis = torch.empty(d, k, dtype=dtype)
    best = torch.zeros(k, dtype=torch.float64)
    sign = torch.ones(k, dtype=torch.float64)
    for a, b in tqdm(bounds, desc="subspace pass 2/2 (basis)", disable=not progress):
        source.read_chunk(a, b, buf_np)
        x = buf64[:, : b - a]
        x.sub_(mean[a:b])
        pc = x.t() @ w  # (b-a) x k
        mx, idx = pc.abs().max(0)
        upd = mx > best  # strict: the first maximal entry wins ties
        best = torch.where(upd, mx, best)
        sign = torch.where(upd, torch.sign(pc.gather(0, idx[None, :])[0]), sign)
        basis[a:b] = pc.to(dtype)
    del buf64, buf_np
    sign[sign == 0] = 1.0
    if bool((sign < 0).any()):
        s_row = sign.to(dtype)
        for a, b in bounds:  # contiguous row blocks: one pass over P, no d x k temporary
            basis[a:b].mul_(s_row)
    return basis
