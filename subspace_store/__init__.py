"""Trajectory subspaces: build (streaming centered PCA), store (named, checksummed entries), CLI."""
from .build import build_subspace
from .format import FORMAT_VERSION, Subspace, SubspaceIntegrityError
from .store import LayoutMismatchError, SubspaceNotFoundError, SubspaceStore, check_model_layout

__all__ = [
    "build_subspace",
    "Subspace",
    "SubspaceStore",
    "SubspaceIntegrityError",
    "SubspaceNotFoundError",
    "LayoutMismatchError",
    "check_model_layout",
    "FORMAT_VERSION",
]
