"""The ``Subspace`` container and the on-disk entry format (manifest schema, version).

An entry of a ``SubspaceStore`` is a directory ``root/NAME/`` holding

* ``basis.safetensors`` — tensors ``basis`` ``[d, k]`` (storage dtype: float32, float16 or
  bfloat16), ``mean`` ``[d]`` and ``reference`` ``[d]`` (always float32: the reference is the
  starting point of subspace training and must be exact), ``eigenvalues`` and
  ``explained_variance_ratio`` ``[k]`` (float64);
* ``manifest.json`` — see ``MANIFEST_SCHEMA``; ``sha256`` holds the sha256 of each tensor's
  raw (little-endian, row-major) bytes as stored.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from szo.layout import layout_from_json, layout_mismatch, layout_to_json  # re-exported

__all__ = [
    "Subspace",
    "layout_mismatch",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_SCHEMA",
    "STORAGE_DTYPES",
    "TENSOR_NAMES",
    "SubspaceIntegrityError",
    "validate_manifest",
    "layout_to_json",
    "layout_from_json",
]

FORMAT = "szo-subspace"
FORMAT_VERSION = 1
STORAGE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TENSOR_NAMES = ("basis", "mean", "reference", "eigenvalues", "explained_variance_ratio")

# field -> (type(s), meaning). "layout" may be null for subspaces built from raw vectors.
# Entries written before this schema also carry a top-level "total_variance" (a copy of
# provenance["total_variance"]); it is no longer written and is ignored when read.
MANIFEST_SCHEMA: dict[str, tuple[tuple[type, ...], str]] = {
    "format": ((str,), "always 'szo-subspace'"),
    "version": ((int,), "FORMAT_VERSION"),
    "k": ((int,), "number of directions (columns of P)"),
    "N": ((int,), "number of trajectory samples used"),
    "d": ((int,), "parameter dimension (rows of P)"),
    "model": ((str, type(None)), "model name"),
    "fingerprint": ((str, type(None)), "sha256 of [model name, layout]"),
    "layout": ((list, type(None)), "[{name, shape}] in named_parameters() order"),
    "storage_dtype": ((str,), "dtype of 'basis' on disk: float32 | float16 | bfloat16"),
    "eigenvalues": ((list,), "top-k covariance eigenvalues (sklearn explained_variance_)"),
    "explained_variance_ratio": ((list,), "eigenvalues / total variance"),
    "provenance": ((dict,), "source trajectories, sampled epochs, N, builder settings"),
    "tensors": ((dict,), "name -> {dtype, shape, sha256 of raw bytes}"),
    "created": ((str,), "UTC ISO-8601 time of the save"),
}


class SubspaceIntegrityError(ValueError):
    """A stored entry is truncated, tampered with, or its manifest is malformed."""


@dataclass
class Subspace:
    """A k-dimensional trajectory subspace of the d-dimensional parameter space.

    Attributes:
        basis: P ``[d, k]`` with orthonormal columns, ordered by decreasing eigenvalue. Sign
            convention: the entry of largest magnitude in each column is positive.
        mean: the trajectory mean ``[d]`` (the PCA centre).
        reference: theta_ref ``[d]``, where subspace training starts (first sample for
            training from scratch, last sample for continual training).
        eigenvalues: ``[k]`` covariance eigenvalues (``lambda / (N - 1)``, as sklearn).
        explained_variance_ratio: ``[k]`` eigenvalues / total variance.
        layout: ``[(name, shape)]`` in ``named_parameters()`` order, or None if unknown.
        fingerprint, model: of the model the trajectory was recorded from (None if unknown).
        provenance: source trajectories, sampled epochs, N, builder settings.
    """

    basis: torch.Tensor
    mean: torch.Tensor
    reference: torch.Tensor
    eigenvalues: torch.Tensor
    explained_variance_ratio: torch.Tensor
    layout: list[tuple[str, tuple[int, ...]]] | None = None
    fingerprint: str | None = None
    model: str | None = None
    provenance: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.basis, torch.Tensor) or self.basis.dim() != 2:
            raise ValueError(f"basis must be a [d, k] tensor, got {getattr(self.basis, 'shape', type(self.basis))}")
        d, k = self.basis.shape
        for name in ("mean", "reference"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (d,):
                raise ValueError(f"{name} must be a tensor of shape [{d}], got {getattr(t, 'shape', type(t))}")
        for name in ("eigenvalues", "explained_variance_ratio"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (k,):
                raise ValueError(f"{name} must be a tensor of shape [{k}], got {getattr(t, 'shape', type(t))}")
        if self.layout is not None:
            self.layout = layout_from_json(self.layout)
            n = sum(int(torch.Size(s).numel()) for _, s in self.layout)
            if n != d:
                raise ValueError(f"layout describes {n} parameters but basis has d = {d} rows")

    @property
    def d(self) -> int:
        return int(self.basis.shape[0])

    @property
    def k(self) -> int:
        return int(self.basis.shape[1])

    @property
    def N(self) -> int | None:
        n = self.provenance.get("N")
        return int(n) if n is not None else None

    def __repr__(self) -> str:
        return (f"Subspace(model={self.model!r}, d={self.d}, k={self.k}, N={self.N}, "
                f"dtype={self.basis.dtype}, evr_sum={float(self.explained_variance_ratio.sum()):.4f})")


def validate_manifest(man: Any, where: str) -> dict:
    """Check a loaded entry manifest against ``MANIFEST_SCHEMA``; raise SubspaceIntegrityError."""
    if not isinstance(man, dict):
        raise SubspaceIntegrityError(f"{where}: manifest must be a JSON object")
    if man.get("format") != FORMAT:
        raise SubspaceIntegrityError(f"{where}: format is {man.get('format')!r}, expected {FORMAT!r}")
    if man.get("version") != FORMAT_VERSION:
        raise SubspaceIntegrityError(
            f"{where}: format version {man.get('version')!r} is not supported (this szo reads version {FORMAT_VERSION})"
        )
    for key, (types, meaning) in MANIFEST_SCHEMA.items():
        if key not in man or isinstance(man[key], bool) or not isinstance(man[key], types):
            raise SubspaceIntegrityError(f"{where}: field {key!r} ({meaning}) is missing or has the wrong type")
    if man["storage_dtype"] not in STORAGE_DTYPES:
        raise SubspaceIntegrityError(f"{where}: storage_dtype {man['storage_dtype']!r} not in {list(STORAGE_DTYPES)}")
    for name in TENSOR_NAMES:
        t = man["tensors"].get(name)
        if not isinstance(t, dict) or not all(x in t for x in ("dtype", "shape", "sha256")):
            raise SubspaceIntegrityError(f"{where}: tensors.{name} must give dtype, shape and sha256")
    if len(man["eigenvalues"]) != man["k"] or len(man["explained_variance_ratio"]) != man["k"]:
        raise SubspaceIntegrityError(f"{where}: eigenvalues / explained_variance_ratio must have k = {man['k']} entries")
    return man
