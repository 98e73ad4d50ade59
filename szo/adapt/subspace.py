"""The corruption-adaptation subspace of paper Sec. 6.3.

1. BP-fine-tune a copy of the source model, supervised, on one representative corruption
   (Gaussian noise; severity 1 for CIFAR-like data and digits, 5 for ImageNet) of the
   *training* data for a few epochs, recording ``samples`` weight vectors evenly over the
   run (:func:`finetune_on_corruption`: ``szo.trajectory.TrajectoryRecorder`` through
   ``szo.train.fit``);
2. pool them with the last ``n_source`` samples of the source model's BPTT trajectory;
3. centered PCA to ``k`` directions (``subspace_store.build_subspace``), with the reference
   theta_ref = the source model's parameters (adaptation starts at the source model).
   Steps 2-3 are :func:`build_adaptation_subspace`.

Step 1 needs a train split of the corrupted data set (``digits-c`` has one). For data sets
without one (``cifar10-c``, ``cifar100-c``, ``imagenet-c`` ship test sets only) record the
fine-tuning trajectory elsewhere and pass its directory to :func:`build_adaptation_subspace`.
"""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

__all__ = ["finetune_on_corruption", "build_adaptation_subspace", "source_tail"]


def source_tail(trajectory_dir: str | os.PathLike, n_source: int):
    """The samples of the last epochs of a trajectory that cover its last ``n_source`` samples.

    (Trajectories are selected by epoch; with one sample per epoch this is exactly the last
    ``n_source``; with several per epoch, whole epochs are kept.)
    """
    from szo.trajectory import Trajectory

    if isinstance(n_source, bool) or not isinstance(n_source, int) or n_source < 1:
        raise ValueError(f"n_source must be a positive int, got {n_source!r}")
    traj = Trajectory(trajectory_dir)
    epochs = sorted(int(e) for e in traj.epochs)
    if not epochs:
        raise ValueError(f"source trajectory {trajectory_dir} has no samples")
    start = epochs[max(0, len(epochs) - n_source)]
    return traj.select((start, epochs[-1]))


def finetune_on_corruption(
    source_model: nn.Module,
    dataset_name: str,
    *,
    run_dir: str | os.PathLike,
    corruption: str = "gaussian_noise",
    severity: int = 1,
    epochs: int = 10,
    samples: int = 20,
    lr: float = 0.01,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    batch_size: int = 64,
    loss: str | Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = "tet",
    data_dir: str | os.PathLike | None = None,
    dataset_kwargs: Mapping[str, Any] | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> Path:
    """Supervised BP fine-tuning of a copy of ``source_model`` on the corrupted train split.

    ``loss``: a ``szo.losses`` name (its default options) or a loss ``fn(out, y)``, e.g. a
    recipe's ``szo.pipeline._loss(cfg)`` (TET with the recipe's lamb / phi).
    Records at least ``samples`` weight vectors (every ``epochs * steps_per_epoch // samples``
    optimizer steps, initial weights excluded) into ``run_dir/trajectory`` and returns that
    directory. The source model is not modified.
    """
    from szo.data import dataset_info, get_dataset, make_loader
    from szo.losses import get_loss
    from szo.train import TrajectoryCallback, fit
    from szo.trajectory import TrajectoryRecorder

    info = dataset_info(dataset_name)
    if "train" not in info.splits:
        raise ValueError(
            f"data set {dataset_name!r} has no train split to fine-tune on (splits: {list(info.splits)}); "
            "record a fine-tuning trajectory on its corruption yourself and pass it to build_adaptation_subspace "
            "(recipes: tta.finetune.trajectory)")
    for name, v in (("epochs", epochs), ("samples", samples), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    train = get_dataset(dataset_name, "train", data_dir=data_dir, corruption=corruption, severity=severity,
                        **dict(dataset_kwargs or {}))
    gen = torch.Generator().manual_seed(int(seed))
    loader = make_loader(train, batch_size, shuffle=True, generator=gen)
    total = epochs * len(loader)
    if total < samples:
        raise ValueError(f"{epochs} epochs of {len(loader)} steps give {total} steps, fewer than samples={samples}")
    model = copy.deepcopy(source_model).to(device)
    model.requires_grad_(True)
    run_dir = Path(run_dir)
    traj_dir = run_dir / "trajectory"
    recorder = TrajectoryRecorder(traj_dir, model, every=total // samples, record_initial=False)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    loss_fn = get_loss(loss) if isinstance(loss, str) else loss
    fit(model, loader, None, opt, epochs=epochs, loss_fn=loss_fn, device=device, run_dir=run_dir,
        callbacks=[TrajectoryCallback(recorder)], generator=gen, progress=progress, plot=False,
        info={"name": f"finetune-{dataset_name}-{corruption}-{severity}"})
    return traj_dir


def build_adaptation_subspace(
    source_model: nn.Module,
    source_trajectory: str | os.PathLike,
    adapt_trajectory: str | os.PathLike,
    *,
    k: int = 20,
    n_source: int = 20,
    progress: bool = True,
    provenance: Mapping[str, Any] | None = None,
):
    """The paper's adaptation subspace: centered PCA of (the last ``n_source`` samples of
    ``source_trajectory`` + the fine-tuning samples in ``adapt_trajectory``), ``k`` directions,
    reference = the source model's parameters.

    ``adapt_trajectory``: a fine-tuning trajectory directory, e.g. the one
    :func:`finetune_on_corruption` returns. ``provenance``: extra entries for the subspace's
    provenance (e.g. the fine-tuning corruption and severity).
    Returns a ``subspace_store.Subspace``.
    """
    from subspace_store import build_subspace

    src = source_tail(source_trajectory, n_source)
    reference = source_model.flat_params().cpu()
    sub = build_subspace([src, adapt_trajectory], k, reference=reference, progress=progress)
    sub.provenance = {
        **dict(sub.provenance),
        "purpose": "test-time adaptation (paper Sec. 6.3)",
        "source_trajectory": str(Path(source_trajectory).resolve()),
        "n_source": n_source,
        "adapt_trajectory": str(Path(adapt_trajectory).resolve()),
        "reference": "source model parameters",
        **dict(provenance or {}),
    }
    return sub
