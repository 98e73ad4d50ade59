"""What a resolved recipe config builds, for every stage and tool: the model, its data loaders,
its loss, the subspace store, and the model a finished run directory holds.

The pipeline (``szo.pipeline``), the studies, the adaptation and federated commands and the
hardware report all build these the same way from a config; none of them needs the pipeline
for it. No training happens here.
"""
from __future__ import annotations

import os
import resource
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

__all__ = ["build_model", "check_sizes", "memory_budget", "load_run_model", "loss_for", "loaders_for",
           "subspace_store_for", "tt_prepare"]


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


def memory_budget(device: str = "cpu") -> int:
    """The bytes a run on ``device`` can hold at most: the GPU's memory on CUDA, else the machine's
    physical memory (or the process's address-space limit, when lower)."""
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    return int(total if limit in (resource.RLIM_INFINITY, -1) else min(total, limit))


def _gb(n: float) -> str:
    return f"{n / 2**30:.3g} GiB" if n < 2**40 else f"{n / 2**40:.3g} TiB"


@torch.no_grad()
def check_sizes(cfg: Mapping[str, Any], device: str | None = None) -> None:
    """Before anything is allocated: what the settings that multiply into tensor sizes (model.T,
    data.batch_size / test_batch_size, model.kwargs such as width, subspace.k, szo.chunk, szo.time_chunk)
    must hold at least, against :func:`memory_budget`. The model is built on the ``meta`` device (shapes,
    no memory) and run once at T = 1 on one sample for its largest activation; a forward of a batch holds
    at least that activation for every sample and time step (``szo.time_chunk``: for a chunk of them), the
    subspace stage at least the basis ``[d, k]``. A setting whose sizes exceed the budget is refused in one
    line naming it, instead of an allocation of terabytes. A lower bound: what passes may still not fit."""
    budget = memory_budget(device or cfg.get("device") or "cpu")
    info = dataset_info(cfg["data"]["name"])
    m = cfg["model"]
    T = int(m["T"] or info.default_T)
    with torch.device("meta"):
        model = build_model(cfg)
    d = sum(p.numel() for p in model.parameters())
    if 4 * d > budget:
        raise ValueError(f"model {m['name']} with model.kwargs {dict(m['kwargs'])} has {d} parameters ({_gb(4 * d)} "
                         f"in float32), more than this machine's {_gb(budget)}; lower its width / sizes")
    largest = [0]

    def seen(mod: torch.nn.Module, inp: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            largest[0] = max(largest[0], out.numel())

    hooks = [mod.register_forward_hook(seen) for mod in model.modules() if not list(mod.children())]
    shape = (1, 1, info.in_channels, *info.image_size) if info.is_sequence else (1, info.in_channels, *info.image_size)
    try:
        model.T = 1
        model(torch.empty(shape, device="meta"))
    except Exception:  # noqa: BLE001 - a model whose forward does not run on meta: only its parameters are checked
        largest[0] = 0
    finally:
        for h in hooks:
            h.remove()
    per_step = 4 * largest[0]  # bytes of the largest activation, one sample, one time step
    sz = cfg.get("szo") or {}
    steps = T if cfg.get("kind") != "subspace" or not sz.get("time_chunk") else min(T, int(sz["time_chunk"]))
    copies = int(sz.get("chunk") or 1) if cfg.get("kind") == "subspace" and sz.get("engine") == "batched" else 1
    for key, n in (("data.batch_size", cfg["data"]["batch_size"]), ("data.test_batch_size", cfg["data"]["test_batch_size"])):
        need = per_step * steps * int(n) * (copies if key == "data.batch_size" else 1)
        if need > budget:
            parts = [f"model.T = {T}" + (f" (szo.time_chunk = {steps})" if steps != T else ""), f"{key} = {n}"]
            if copies > 1 and key == "data.batch_size":
                parts.append(f"szo.chunk = {copies} probe copies")
            raise ValueError(f"{' x '.join(parts)} x {per_step} bytes (the model's largest activation per sample and "
                             f"time step) needs at least {_gb(need)} in one forward, more than this machine's "
                             f"{_gb(budget)}; lower {' or '.join(p.split(' = ')[0] for p in parts)}")
    if cfg.get("kind") == "subspace":
        k = int(cfg["subspace"]["k"])
        if 4 * d * k > budget:
            raise ValueError(f"subspace.k = {k} directions of the model's d = {d} parameters is a basis of "
                             f"{_gb(4 * d * k)} in float32, more than this machine's {_gb(budget)}; lower subspace.k")


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
