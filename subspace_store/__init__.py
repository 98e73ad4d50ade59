"""Trajectory subspaces: build (streaming centered PCA), store (named, checksummed entries), CLI."""
from .build import build_subspace
from .format import FORMAT_VERSION, Subspace, SubspaceIntegrityError
from .store import LayoutMismatchError, SubspaceNotFoundError, SubspaceStore, check_model_layout
from .variants import bn_and_head_names, coordinate_subspace, project_point, random_subspace

__all__ = [
    "build_subspace",
    "Subspace",
    "SubspaceStore",
    "SubspaceIntegrityError",
    "SubspaceNotFoundError",
    "LayoutMismatchError",
    "check_model_layout",
    "FORMAT_VERSION",
    "random_subspace",
    "coordinate_subspace",
    "bn_and_head_names",
    "project_point",
]
