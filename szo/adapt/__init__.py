"""Test-time adaptation (paper Sec. 6.3): none / BN / Tent / BP-Subspace / SZO-CGE / SZO-RGE.

    from szo.adapt import build_adapter
    adapter = build_adapter("szo-cge", model, subspace=sub, lr=1.0)
    for x, _ in loader:           # unlabeled test batches
        out = adapter(x)          # predict (before the batch's update) and adapt
    adapter.reset()               # source parameters and BN statistics again

``szo.adapt.runner.run_tta`` runs the 15 corruptions in the reset / continual settings and
writes the paper's tables; ``szo.adapt.subspace.build_adaptation_subspace`` builds the
corruption-adaptation subspace.
"""
from __future__ import annotations

from .methods import (
    METHOD_LABELS,
    METHODS,
    PREDICT,
    SETTINGS,
    SUBSPACE_METHODS,
    Adapter,
    BNAdapt,
    BPSubspaceAdapt,
    NoAdapt,
    SZOAdapt,
    Tent,
    build_adapter,
    check_model,
    collect_params,
    configure_bn,
    configure_model,
)
from .runner import resolve_methods, resolve_settings, run_tta

__all__ = [
    "METHODS", "SUBSPACE_METHODS", "SETTINGS", "PREDICT", "METHOD_LABELS",
    "Adapter", "NoAdapt", "BNAdapt", "Tent", "BPSubspaceAdapt", "SZOAdapt", "build_adapter",
    "configure_model", "configure_bn", "collect_params", "check_model",
    "run_tta", "resolve_methods", "resolve_settings",
]
