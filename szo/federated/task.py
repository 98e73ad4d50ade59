"""What a federation's server and clients both build from the recipe (:class:`FederatedTask`: model,
loss, subspace) and the recipe's data split they read (:func:`task_dataset`).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from szo.build import build_model, loss_for, subspace_store_for
from szo.data import get_dataset
from szo.zo import bn_layers

__all__ = ["FederatedTask", "task_dataset", "dataset_targets"]


class FederatedTask:
    """What server and clients both build from the recipe: model, loss, subspace (basis, reference)."""

    def __init__(self, cfg: Mapping[str, Any], space: str) -> None:
        self.model = build_model(cfg)
        store = subspace_store_for(cfg)
        sub = store.load(cfg["subspace"]["name"], model=self.model)
        self.digest = store.digest(cfg["subspace"]["name"])
        self.reference = sub.reference.detach().to(torch.float64)
        self.basis = sub.basis.detach().to(torch.float64) if space == "subspace" else None
        self.dim = int(self.basis.shape[1]) if self.basis is not None else int(self.reference.numel())
        self.loss_fn = loss_for(cfg)
        self.bn = bn_layers(self.model)
        self.model.load_flat_params(self.reference.float())

    def theta(self, params: np.ndarray | torch.Tensor) -> torch.Tensor:
        """The parameters (float64 ``[d]``) at the server's coordinates (the subspace's, or the full space's)."""
        p = params.to(torch.float64) if isinstance(params, torch.Tensor) \
            else torch.from_numpy(np.asarray(params, dtype=np.float64))
        return self.reference + self.basis @ p if self.basis is not None else p

    def bn_stats(self) -> np.ndarray:
        """``[mean_1, var_1, mean_2, var_2, ...]`` of the BN layers' running statistics (float32)."""
        if not self.bn:
            return np.zeros(0, dtype=np.float32)
        return torch.cat([torch.cat([m.running_mean, m.running_var]) for m in self.bn]).numpy().astype(np.float32)

    def bn_var_index(self) -> np.ndarray:
        """Where the running variances are in a flat :meth:`bn_stats` vector."""
        out, off = [], 0
        for m in self.bn:
            n = m.running_mean.numel()
            out.append(np.arange(off + n, off + 2 * n))
            off += 2 * n
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def set_bn_stats(self, flat: np.ndarray) -> None:
        off = 0
        for m in self.bn:
            n = m.running_mean.numel()
            m.running_mean.copy_(torch.from_numpy(flat[off:off + n]))
            m.running_var.copy_(torch.from_numpy(flat[off + n:off + 2 * n]))
            off += 2 * n


def task_dataset(cfg: Mapping[str, Any], split: str):
    d = cfg["data"]
    return get_dataset(d["name"], split, augment=False if d["augment"] is not None else None,
                       data_dir=d["data_dir"], download=d["download"], **d["kwargs"])


def dataset_targets(ds) -> np.ndarray:
    t = getattr(ds, "targets", None)
    if t is None:
        t = [int(ds[i][1]) for i in range(len(ds))]
    return np.asarray(t.numpy() if isinstance(t, torch.Tensor) else t, dtype=np.int64)
