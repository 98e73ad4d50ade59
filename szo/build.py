"""What a resolved recipe config builds, for every stage and tool: the model, its data loaders,
its loss, the subspace store, and the model a finished run directory holds.

The pipeline (``szo.pipeline``), the studies, the adaptation and federated commands and the
hardware report all build these the same way from a config; none of them needs the pipeline
for it. No training happens here.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch.utils.data import DataLoader, Subset

from subspace_store import SubspaceStore
from szo import models
from szo.config import load_recipe
from szo.data import dataset_info, get_dataset, make_loader
from szo.io import load_weights
from szo.losses import get_loss
from szo.methods import get_method
from szo.models.tt import tt_parametrize
from szo.train import checkpoint_path, load_checkpoint

__all__ = ["build_model", "load_run_model", "loss_for", "loaders_for", "subspace_store_for", "tt_prepare"]


def build_model(cfg: Mapping[str, Any]) -> torch.nn.Module:
    """The recipe's model; init drawn under ``fork_rng`` seeded with ``cfg['seed']``."""
    info = dataset_info(cfg["data"]["name"])
    m = cfg["model"]
    kw = dict(m["kwargs"])
    kw.setdefault("in_channels", info.in_channels)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(cfg["seed"]))
        model = models.create(m["name"], num_classes=info.num_classes, T=m["T"] or info.default_T,
                              activation=m["activation"], bn_time=m["bn_time"], **kw)
    return model.set_memory_format(m.get("memory_format", "auto"))


def load_run_model(run_dir: str | os.PathLike, device: str = "cpu") -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model a run directory holds, and its resolved config.

    ``run_dir/config.yaml`` rebuilds the model (``build_model``: dataset classes / channels,
    ``model.kwargs``, T); the weights (parameters and BN buffers) come from
    ``model.safetensors`` (BPTT runs) or else ``checkpoints/last.pt`` (``weights_only``).
    """
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory: no config.yaml (written by every szo recipe run)")
    cfg = load_recipe(run_dir / "config.yaml")
    model = build_model(cfg)
    if (run_dir / "model.safetensors").is_file():
        state = load_weights(run_dir / "model.safetensors")
    else:
        state = load_checkpoint(checkpoint_path(run_dir), map_location="cpu")["model"]
    tt_prepare(model, cfg)  # a tensor-train run's directory holds trained TT cores
    model.load_state_dict(state, strict=True)
    return model.to(device), cfg


def tt_prepare(model: torch.nn.Module, cfg: Any) -> dict[str, Any] | None:
    """A tensor-train run's model (a subspace recipe whose method is of the tensor-train-zo family):
    its large weights turned into TT cores in place, from the recipe's typed ``tt`` section (rank,
    cores, min_params), TT-SVD of the weights it holds; ``tt_parametrize``'s record, None for any
    other run. The one place both the run (``szo.prepare.subspace_model``: TT-SVD of the start point)
    and a reload of its directory (:func:`load_run_model`: the shapes of the trained cores) do it."""
    if cfg.kind != "subspace" or get_method(cfg.method).family != "tensor-train-zo":
        return None
    tt = cfg.tt
    return tt_parametrize(model, tt.rank, cores=tt.cores, min_params=tt.min_params)


def loss_for(cfg: Mapping[str, Any]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The recipe's training loss ``loss(out [T, N, C], y)`` (``cfg.loss``)."""
    lc = cfg["loss"]
    return get_loss(lc["name"], **({"lamb": lc["lamb"], "phi": lc["phi"]} if lc["name"] == "tet" else {}))


def loaders_for(cfg: Mapping[str, Any], generator: torch.Generator, parallel=None) -> tuple[DataLoader, DataLoader]:
    """Train loader over the whole train set (``fit`` shards its batches), shuffled with
    ``generator``, and test loader (this rank's contiguous shard of the test set in a
    multi-process run, ``parallel``: ``szo.distributed.Parallel``)."""
    d = cfg["data"]
    common = dict(data_dir=d["data_dir"], download=d["download"], **d["kwargs"])
    train = get_dataset(d["name"], "train", augment=d["augment"], **common)
    test = get_dataset(d["name"], "test", augment=False if d["augment"] is not None else None, **common)
    if parallel is not None:
        lo, hi = parallel.shard_bounds(len(test))
        if hi == lo:
            raise ValueError(f"the test set has {len(test)} samples, fewer than the {parallel.world_size} processes")
        test = Subset(test, range(lo, hi))
    return (make_loader(train, d["batch_size"], shuffle=True, generator=generator, num_workers=d["num_workers"]),
            make_loader(test, d["test_batch_size"], shuffle=False, num_workers=d["num_workers"]))


def subspace_store_for(cfg: Mapping[str, Any]) -> SubspaceStore:
    """The subspace store the recipe names (``cfg.subspace.root``)."""
    return SubspaceStore(cfg["subspace"]["root"])
