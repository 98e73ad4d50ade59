"""The corruption-adaptation subspace of paper Sec. 6.3, under three protocols.

1. BP-fine-tune a copy of the source model, supervised (labelled), on corrupted images for a
   few epochs, recording ``samples`` weight vectors evenly over the run
   (:func:`finetune_on_dataset`: ``szo.trajectory.TrajectoryRecorder`` through ``szo.train.fit``);
2. pool them with the last ``n_source`` samples of the source model's BPTT trajectory;
3. centered PCA to ``k`` directions (``subspace_store.build_subspace``), with the reference
   theta_ref = the source model's parameters (adaptation starts at the source model).
   Steps 2-3 are :func:`build_adaptation_subspace`.

Which images step 1 sees is the protocol (``PROTOCOLS``, :func:`finetune_dataset`,
:func:`protocol_subspaces`; recipes: ``tta.protocol``):

* ``paper``: the corrupted *test* split of one corruption (Gaussian noise). This is the only
  possibility on CIFAR-10-C / 100-C, which have no train split, hence what the paper must have
  done; since all corruptions are made from the same clean test images, the subspace is built
  with the labels of the very images it is then evaluated on (``LABEL_LEAK``; every output of
  this protocol says so).
* ``train``: the same on the corrupted *train* split (honest; digits-c and mnist5k-c have one).
* ``loco``: leave one corruption out: for each evaluated corruption, a subspace fine-tuned on
  the train splits of the other 14 (a seeded mix). One subspace per corruption, so the reset
  setting only (the continual setting sees every corruption).

For data sets without a train split (``cifar10-c``, ``cifar100-c``, ``imagenet-c``) only
``paper`` can be run here; a trajectory fine-tuned elsewhere goes to
:func:`build_adaptation_subspace` directly.
"""
from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.utils.data import Dataset

from subspace_store import build_subspace
from szo.config import TTA_PROTOCOLS, FinetuneConfig, TTAConfig
from szo.data import CORRUPTIONS, dataset_info, get_dataset, make_loader
from szo.data.corrupted import GENERATED, split_length
from szo.losses import get_loss
from szo.train import TrajectoryCallback, fit
from szo.trajectory import Trajectory, TrajectoryRecorder

from .methods import check_choice

__all__ = ["PROTOCOLS", "PROTOCOL_SPLITS", "LABEL_LEAK", "protocol_info", "finetune_dataset", "finetune_on_dataset",
           "build_adaptation_subspace", "protocol_subspaces", "source_tail"]

#: how the adaptation subspace's fine-tuning data are chosen (``tta.protocol``)
PROTOCOLS = TTA_PROTOCOLS
#: the split each protocol fine-tunes on
PROTOCOL_SPLITS = {"paper": "test", "train": "train", "loco": "train"}
#: the flag every output of the paper protocol carries
LABEL_LEAK = "labels of the test images used to build the subspace"


def protocol_info(protocol: str) -> dict[str, Any]:
    """What every description of ``protocol`` says (``tta_results.json`` ``"protocol"``): its
    name, the split it fine-tunes on, ``label_leak`` and, for ``paper``, the warning."""
    check_choice("protocol", protocol, PROTOCOLS)
    info: dict[str, Any] = {"name": protocol, "split": PROTOCOL_SPLITS[protocol], "label_leak": protocol == "paper"}
    if info["label_leak"]:
        info["warning"] = LABEL_LEAK
    return info


def source_tail(trajectory_dir: str | os.PathLike, n_source: int):
    """The samples of the last epochs of a trajectory that cover its last ``n_source`` samples.

    (Trajectories are selected by epoch; with one sample per epoch this is exactly the last
    ``n_source``; with several per epoch, whole epochs are kept.)
    """
    if isinstance(n_source, bool) or not isinstance(n_source, int) or n_source < 1:
        raise ValueError(f"n_source must be a positive int, got {n_source!r}")
    traj = Trajectory(trajectory_dir)
    epochs = sorted(int(e) for e in traj.epochs)
    if not epochs:
        raise ValueError(f"source trajectory {trajectory_dir} has no samples")
    start = epochs[max(0, len(epochs) - n_source)]
    return traj.select((start, epochs[-1]))


def _check_images(images: Any) -> int | None:
    if images is not None and (isinstance(images, bool) or not isinstance(images, int) or images < 1):
        raise ValueError(f"finetune images must be a positive int or None (the whole split), got {images!r}")
    return images


def _split_with_positions(dataset_name: str, split: str, corruption: str, severity: int,
                          positions: Sequence[int] | None, data_dir: Any, kw: Mapping[str, Any]) -> Dataset:
    """``split`` of ``corruption``, restricted to the split ``positions`` (None: all). Generated
    sets (digits-c, mnist5k-c) corrupt only those images (``indices``); others are subset after loading."""
    from torch.utils.data import Subset


    if dataset_name in GENERATED and positions is not None:
        return get_dataset(dataset_name, split, data_dir=data_dir, corruption=corruption, severity=severity,
                           indices=list(positions), **kw)
    ds = get_dataset(dataset_name, split, data_dir=data_dir, corruption=corruption, severity=severity, **kw)
    return ds if positions is None else Subset(ds, list(positions))


def _split_size(dataset_name: str, split: str, corruption: str, severity: int, data_dir: Any,
                kw: Mapping[str, Any]) -> int:

    if dataset_name in GENERATED:  # without corrupting the whole split
        return split_length(GENERATED[dataset_name], split, split_seed=kw.get("split_seed", 0), limit=kw.get("limit"))
    return len(_split_with_positions(dataset_name, split, corruption, severity, None, data_dir, kw))


def finetune_dataset(
    dataset_name: str,
    protocol: str,
    corruption: str,
    severity: int,
    *,
    images: int | None = None,
    data_dir: str | os.PathLike | None = None,
    dataset_kwargs: Mapping[str, Any] | None = None,
) -> tuple[Dataset, dict[str, Any]]:
    """The labelled fine-tuning data of ``protocol`` and its description.

    * ``paper``: the corrupted *test* split of ``corruption`` (the first ``images`` images; default
      all), what CIFAR-C allows (no train split). Every corruption is made from the same clean test
      images, so this uses the labels of the images later evaluated (``label_leak``).
    * ``train``: the corrupted *train* split of ``corruption`` (the first ``images``; default all).
    * ``loco``: ``corruption`` is the held-out (evaluated) one; ``images`` (default: the train split's
      size) drawn from the train splits of the 14 others, ``images // 14`` each (one more for the
      first ``images % 14`` in table order). Corruption number j (table order) takes the split
      positions ``j*m, j*m+1, ...`` (mod the split size), ``m = ceil(images / 14)``: the others
      use disjoint clean images when ``15 m`` fits in the split, and each corruption's images are
      the same whichever one is held out (one cache entry each).

    The split order of the generated sets is sklearn's seeded shuffle, so "the first n" is a
    seeded random sample. ``dataset_kwargs`` go to the loader (e.g. ``limit`` for smoke runs).
    """
    from torch.utils.data import ConcatDataset, Subset


    check_choice("protocol", protocol, PROTOCOLS)
    images = _check_images(images)
    split = PROTOCOL_SPLITS[protocol]
    info = dataset_info(dataset_name)
    if split not in info.splits:
        raise ValueError(
            f"protocol {protocol!r} fine-tunes on the {split} split, and data set {dataset_name!r} has only "
            f"{list(info.splits)}; use protocol 'paper' (its test split, labels leak) or record a fine-tuning "
            "trajectory yourself (recipes: tta.finetune.trajectory)")
    kw = dict(dataset_kwargs or {})
    n = _split_size(dataset_name, split, corruption, severity, data_dir, kw)
    desc: dict[str, Any] = {"protocol": protocol, "finetune_split": split, "finetune_severity": severity,
                            "label_leak": protocol == "paper"}
    if protocol in ("paper", "train"):
        if images is not None and images > n:
            raise ValueError(f"finetune images={images} exceeds the {n} images of the {split} split of "
                             f"{dataset_name!r}; valid: 1..{n} or null (all)")
        positions = None if images is None or images == n else range(images)
        ds = _split_with_positions(dataset_name, split, corruption, severity, positions, data_dir, kw)
        desc.update(finetune_corruptions={corruption: len(ds)}, finetune_images=len(ds))
        return ds, desc
    others = [c for c in CORRUPTIONS if c != corruption]
    total = n if images is None else images
    if total < len(others):
        raise ValueError(f"protocol 'loco' needs finetune images >= {len(others)} (one per other corruption), "
                         f"got {total}")
    m = -(-total // len(others))
    if m > n:
        raise ValueError(f"protocol 'loco' with finetune images={total} takes {m} images from each other "
                         f"corruption, more than the {n} of the train split of {dataset_name!r}; "
                         f"valid: up to {n * len(others)}")
    parts, counts = [], {}
    for rank, c in enumerate(others):
        j = CORRUPTIONS.index(c)
        block = [(j * m + i) % n for i in range(m)]
        count = total // len(others) + (1 if rank < total % len(others) else 0)
        parts.append(Subset(_split_with_positions(dataset_name, split, c, severity, block, data_dir, kw),
                            range(count)))
        counts[c] = count
    desc.update(held_out=corruption, finetune_corruptions=counts, finetune_images=total)
    return ConcatDataset(parts), desc


def finetune_on_dataset(
    source_model: nn.Module,
    dataset: Dataset,
    *,
    run_dir: str | os.PathLike,
    settings: FinetuneConfig | Mapping[str, Any] | None = None,
    loss: str | Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = "tet",
    seed: int = 0,
    device: str | torch.device = "cpu",
    progress: bool = True,
    name: str = "finetune",
) -> Path:
    """Supervised BP fine-tuning of a copy of ``source_model`` on the labelled ``dataset``.

    ``settings``: a :class:`szo.config.FinetuneConfig` (or a mapping of its fields; default
    epochs 10, samples 20, SGD lr 0.01, momentum 0.9, weight decay 0, batch size 64): the
    recipe's ``tta.finetune`` section. ``loss``: a ``szo.losses`` name (its default options) or a
    loss ``fn(out, y)``, e.g. a recipe's ``szo.build.loss_for(cfg)`` (TET with the recipe's lamb / phi).
    Records ``settings.samples`` weight vectors (every ``epochs * steps_per_epoch // samples``
    optimizer steps, initial weights excluded) into ``run_dir/trajectory`` and returns that
    directory. The source model is not modified.
    """
    ft = settings if isinstance(settings, FinetuneConfig) else FinetuneConfig(**dict(settings or {}))
    epochs, samples, batch_size = ft.epochs, ft.samples, ft.batch_size
    for key, v in (("epochs", epochs), ("samples", samples), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{key} must be a positive int, got {v!r}")
    gen = torch.Generator().manual_seed(int(seed))
    loader = make_loader(dataset, batch_size, shuffle=True, generator=gen)
    total = epochs * len(loader)
    if total < samples:
        raise ValueError(f"{epochs} epochs of {len(loader)} steps give {total} steps, fewer than samples={samples}")
    model = copy.deepcopy(source_model).to(device)
    model.requires_grad_(True)
    run_dir = Path(run_dir)
    traj_dir = run_dir / "trajectory"
    recorder = TrajectoryRecorder(traj_dir, model, every=total // samples, record_initial=False)
    opt = torch.optim.SGD(model.parameters(), lr=ft.lr, momentum=ft.momentum, weight_decay=ft.weight_decay)
    loss_fn = get_loss(loss) if isinstance(loss, str) else loss
    fit(model, loader, None, opt, epochs=epochs, loss_fn=loss_fn, device=device, run_dir=run_dir,
        callbacks=[TrajectoryCallback(recorder)], generator=gen, progress=progress, plot=False,
        info={"name": name})
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
    :func:`finetune_on_dataset` returns. ``provenance``: extra entries for the subspace's
    provenance (e.g. the fine-tuning corruption and severity).
    Returns a ``subspace_store.Subspace``.
    """
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


def protocol_subspaces(
    source_model: nn.Module,
    source_trajectory: str | os.PathLike,
    tta: TTAConfig,
    *,
    run_dir: str | os.PathLike,
    k: int = 20,
    loss: str | Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = "tet",
    seed: int = 0,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> tuple[Any, dict[str, Any]]:
    """The adaptation subspace(s) of the recipe section ``tta`` (a :class:`szo.config.TTAConfig`:
    ``tta.protocol``, ``tta.data`` with its ``data_dir`` / ``kwargs``, ``tta.corruptions`` (null:
    all 15), ``tta.n_source`` and ``tta.finetune``) and the protocol's description.

    ``paper`` / ``train``: one fine-tuning on ``tta.finetune.corruption`` (:func:`finetune_dataset`)
    into ``run_dir/finetune``, one subspace. ``loco``: for every evaluated corruption ``c`` a
    fine-tuning on the mix of the other 14 into ``run_dir/finetune/loco-<c>`` and a ``{c: subspace}``
    mapping (for ``run_tta``'s reset setting). The fine-tuning itself is :func:`finetune_on_dataset`
    with ``tta.finetune``. The description (``tta_results.json`` ``"protocol"``) names the split, the
    corruptions and image counts, and carries ``label_leak`` / ``warning`` for ``paper``.
    """
    protocol, dataset_name, ft = tta.protocol, tta.data, tta.finetune
    severity, corruptions = ft.severity, list(tta.corruptions or CORRUPTIONS)
    check_choice("protocol", protocol, PROTOCOLS)
    if not corruptions:
        raise ValueError("no evaluated corruption given")
    run_dir = Path(run_dir)

    seconds: dict[str, float] = {}

    def one(held: str, where: Path) -> tuple[Any, dict[str, Any]]:
        t0 = time.perf_counter()
        ds, desc = finetune_dataset(dataset_name, protocol, held, severity, images=ft.images, data_dir=tta.data_dir,
                                    dataset_kwargs=tta.kwargs)
        traj = finetune_on_dataset(source_model, ds, run_dir=where, settings=ft, loss=loss, seed=seed, device=device,
                                   progress=progress, name=f"finetune-{dataset_name}-{protocol}-{held}")
        prov = {"adapt_protocol": protocol, "adapt_split": desc["finetune_split"], "adapt_severity": severity,
                "adapt_images": desc["finetune_images"], "adapt_corruptions": sorted(desc["finetune_corruptions"])}
        if protocol == "loco":
            prov["adapt_held_out"] = held
        else:
            prov["adapt_corruption"] = held
        if desc["label_leak"]:
            prov["warning"] = LABEL_LEAK
        sub = build_adaptation_subspace(source_model, source_trajectory, traj, k=k, n_source=tta.n_source,
                                        progress=progress, provenance=prov)
        seconds[held] = time.perf_counter() - t0
        return sub, desc

    info = {**protocol_info(protocol), "severity": severity}
    if protocol == "loco":
        subs: dict[str, Any] = {}
        per: dict[str, Any] = {}
        for c in corruptions:
            subs[c], desc = one(c, run_dir / "finetune" / f"loco-{c}")
            per[c] = desc["finetune_corruptions"]
        info.update(images=sum(next(iter(per.values())).values()), finetune_corruptions=per,
                    description=f"per evaluated corruption, BP fine-tuning (labelled) on the train split of the "
                                f"other {len(CORRUPTIONS) - 1} corruptions (severity {severity}); reset setting only",
                    subspace_s=seconds)
        return subs, info
    corruption = ft.corruption
    sub, desc = one(corruption, run_dir / "finetune")
    info.update(images=desc["finetune_images"], corruption=corruption,
                description=f"BP fine-tuning (labelled) on the corrupted {desc['finetune_split']} split of "
                            f"{corruption} (severity {severity}, {desc['finetune_images']} images)",
                subspace_s=seconds[corruption])
    return sub, info
