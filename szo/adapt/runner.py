"""Run test-time adaptation over the 15 corruptions for several methods and settings.

For every (setting, method) pair a private copy of the source model is wrapped in its
:class:`~szo.adapt.methods.Adapter` and fed the corruptions in table order, each corruption's
test set once in batches (the same batch order for every method and setting: each corruption's
loader is shuffled by its own generator seeded from ``seed`` and the corruption's name).

* ``reset``: ``adapter.reset()`` before every corruption (source parameters, BN statistics and
  optimizer state again);
* ``continual``: one pass over the 15 corruptions in order, never reset.

``none`` and ``bn`` change no parameter and predict from the current batch alone, so their
predictions cannot depend on the setting; they are run once and their numbers reported
under every setting (``"shared_with"`` in the JSON names the setting they were run in).
"""
from __future__ import annotations

import copy
import os
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from .methods import (METHODS, PREDICT, SETTINGS, SUBSPACE_METHODS, TENT_OPTIMIZERS, adapter_class, build_adapter,
                      check_choice)
from .tables import write_tables

__all__ = ["run_tta", "resolve_methods", "resolve_settings", "SETTING_FREE_METHODS"]

#: methods whose predictions do not depend on the setting (no parameter change, batch-local)
SETTING_FREE_METHODS = tuple(m for m in METHODS if adapter_class(m).setting_free)


def _resolve_names(what: str, value: str | Sequence[str], valid: Sequence[str], everything: str) -> list[str]:
    """``everything``, one name, a comma list or a list -> names in ``valid`` order."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    value = list(value)
    if not value:
        raise ValueError(f"no {what} given; valid: {everything}, {', '.join(valid)}")
    if everything in value:
        return list(valid)
    for v in value:
        check_choice(what, v, (everything, *valid))
    return [v for v in valid if v in value]


def resolve_methods(methods: str | Sequence[str]) -> list[str]:
    """``"all"``, one name, a comma list or a list -> method names in ``METHODS`` order."""
    return _resolve_names("method", methods, METHODS, "all")


def resolve_settings(settings: str | Sequence[str]) -> list[str]:
    """``"both"``, one name, a comma list or a list -> setting names (reset first)."""
    return _resolve_names("setting", settings, SETTINGS, "both")


def _model_name(model: nn.Module) -> str:
    return str(getattr(model, "model_name", type(model).__name__))


def _per_batch(method: str, predict: str, k: int | None, q: int) -> tuple[int, int]:
    """(#FP, #BP) per batch of one method (network calls on the whole batch)."""
    return adapter_class(method).per_batch(predict, k, q, method)


def run_tta(
    source_model: nn.Module,
    subspace: Any,
    dataset_name: str,
    methods: str | Sequence[str],
    settings: str | Sequence[str],
    *,
    severity: int = 5,
    batch_size: int,
    lr_reset: float = 1.0,
    lr_continual: float = 0.1,
    data_dir: str | os.PathLike | None = None,
    seed: int = 0,
    out_dir: str | os.PathLike,
    corruptions: Sequence[str] | None = None,
    mu: float = 1.0,
    momentum: float = 0.9,
    q: int = 10,
    predict: str = "before",
    tent_optimizer: str = "adam",
    tent_lr: float = 1e-3,
    tent_momentum: float = 0.9,
    device: str | torch.device = "cpu",
    max_batches: int | None = None,
    dataset_kwargs: Mapping[str, Any] | None = None,
    get_data: Callable[[str], Dataset] | None = None,
    download: bool = False,
    progress: bool = True,
    plot: bool = True,
    write: bool = True,
    info: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Adapt and evaluate every (method, setting) on ``dataset_name`` severity ``severity``.

    Args:
        source_model: the source model; never modified (every run adapts its own copy).
        subspace: the adaptation subspace (``subspace_store.Subspace``) for bp-subspace / szo-*;
            may be None if no subspace method is run. Or a mapping ``{corruption: Subspace}``
            (one per evaluated corruption, all of the same k; e.g. leave-one-corruption-out):
            then every corruption is adapted in its own subspace, reset setting only.
        methods / settings: names, ``"all"`` / ``"both"``, comma lists or lists.
        lr_reset / lr_continual: learning rate of the subspace methods per setting (App. G).
        corruptions: default ``szo.data.CORRUPTIONS`` (the 15, table order).
        predict: ``"before"`` | ``"after"`` (see ``szo.adapt.methods``).
        max_batches: adapt on at most this many batches per corruption (quick checks).
        get_data: ``corruption -> Dataset`` to use instead of ``szo.data.get_dataset``.
        write: write the results (``szo.adapt.tables.write_tables``: ``tta_results.json``, the
            markdown tables and, with ``plot``, ``tta_accuracy.png`` in ``out_dir``); ``False``
            when the caller adds to the results and writes them itself (once).

    Returns the results dict.
    """
    methods = resolve_methods(methods)
    settings = resolve_settings(settings)
    check_choice("predict", predict, PREDICT)
    check_choice("Tent optimizer", tent_optimizer, TENT_OPTIMIZERS)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if max_batches is not None and (isinstance(max_batches, bool) or not isinstance(max_batches, int)
                                    or max_batches < 1):
        raise ValueError(f"max_batches must be a positive int or None, got {max_batches!r}")
    needs_subspace = [m for m in methods if m in SUBSPACE_METHODS]
    if needs_subspace and subspace is None:
        raise ValueError(f"methods {needs_subspace} need an adaptation subspace; build one with "
                         "szo.adapt.subspace.build_adaptation_subspace or drop them")
    if corruptions is None:
        from szo.data import CORRUPTIONS

        corruptions = list(CORRUPTIONS)
    corruptions = list(corruptions)
    if not corruptions:
        raise ValueError("no corruption given")
    per_corruption = isinstance(subspace, Mapping)
    if per_corruption:
        missing = [c for c in corruptions if c not in subspace]
        if missing:
            raise ValueError(f"the subspace mapping has no subspace for corruption(s) {missing}; "
                             f"it has {sorted(subspace)}")
        if needs_subspace and "continual" in settings:
            raise ValueError("one subspace per corruption is for the reset setting only (the continual setting "
                             "adapts one model across all corruptions); pass setting 'reset' or a single subspace")
        ks = sorted({int(subspace[c].basis.shape[1]) for c in corruptions})
        if len(ks) > 1:
            raise ValueError(f"the per-corruption subspaces have different k {ks}; they must share one k")
    if get_data is None:
        from szo.data import get_dataset

        kw = dict(dataset_kwargs or {})

        def get_data(c: str) -> Dataset:
            return get_dataset(dataset_name, "test", data_dir=data_dir, download=download, corruption=c,
                               severity=severity, **kw)

    from szo.data import make_loader

    if not isinstance(source_model, nn.Module):
        raise ValueError(f"source_model must be a torch.nn.Module, got {type(source_model).__name__}")
    source = source_model
    source_state = {k: v.detach().clone() for k, v in source.state_dict().items()}
    if subspace is None:
        k = None
    elif per_corruption:
        k = int(subspace[corruptions[0]].basis.shape[1])
    else:
        k = int(subspace.basis.shape[1])

    def subspace_for(c: str) -> Any:
        return subspace[c] if per_corruption else subspace

    datasets: dict[str, Dataset] = {}

    def data(c: str) -> Dataset:
        if c not in datasets:
            datasets[c] = get_data(c)
        return datasets[c]

    results: dict[str, dict[str, Any]] = {s: {} for s in settings}
    for setting in settings:
        lr = lr_reset if setting == "reset" else lr_continual
        for method in methods:
            if method in SETTING_FREE_METHODS and setting != settings[0]:
                shared = dict(results[settings[0]][method])
                shared["shared_with"] = settings[0]
                results[setting][method] = shared
                continue
            model = copy.deepcopy(source).to(device)  # one private copy per (setting, method) run
            gen = torch.Generator().manual_seed(int(seed) + 1)  # RGE directions

            def make_adapter(c: str) -> Any:
                return build_adapter(method, model, subspace=subspace_for(c), lr=lr, momentum=momentum, mu=mu,
                                     q=q, predict=predict, tent_optimizer=tent_optimizer, tent_lr=tent_lr,
                                     tent_momentum=tent_momentum, generator=gen)

            adapter = make_adapter(corruptions[0])
            own_subspace = per_corruption and method in SUBSPACE_METHODS
            done = {"fp": 0, "bp": 0, "batches": 0}  # counts of the adapters of earlier corruptions
            per_c: dict[str, float] = {}
            counts: dict[str, int] = {}
            seconds: dict[str, float] = {}  # adaptation and prediction, data loading excluded
            for ci, c in enumerate(corruptions):
                data(c)  # loaded (generated, for digits-c / mnist5k-c) outside the timing
                tc = time.perf_counter()
                if setting == "reset" and ci > 0:
                    adapter.reset()
                    if own_subspace:  # the source model again, now adapted in c's own subspace
                        for key, v in adapter.counts().items():
                            done[key] += v
                        adapter = make_adapter(c)
                loader = make_loader(  # time-major batches for event-frame sequences
                    data(c), batch_size, shuffle=True,
                    generator=torch.Generator().manual_seed(int(seed) * 1000003 + zlib.crc32(c.encode())))
                correct = seen = 0
                total = len(loader) if max_batches is None else min(len(loader), max_batches)
                bar = tqdm(total=total, desc=f"{setting}/{method}/{c}", leave=False, disable=not progress,
                           dynamic_ncols=True)
                for b, (x, y) in enumerate(loader):
                    if max_batches is not None and b >= max_batches:
                        break
                    x, y = x.to(device), y.to(device)
                    out = adapter(x)
                    correct += int((out.mean(0).argmax(1) == y).sum())
                    seen += int(y.shape[0])
                    bar.update(1)
                    bar.set_postfix(acc=f"{correct / seen:.3f}", refresh=False)
                bar.close()
                if seen == 0:
                    raise ValueError(f"corruption {c!r} of {dataset_name!r} yielded no test samples")
                per_c[c] = correct / seen
                counts[c] = seen
                seconds[c] = time.perf_counter() - tc
            elapsed = sum(seconds.values())
            fpb, bpb = _per_batch(method, predict, k, q)
            for key, v in adapter.counts().items():
                done[key] += v
            results[setting][method] = {
                "per_corruption": per_c,
                "average": sum(per_c.values()) / len(per_c),
                "samples": counts,
                "fp": done["fp"],
                "bp": done["bp"],
                "batches": done["batches"],
                "fp_per_batch": fpb,
                "bp_per_batch": bpb,
                "lr": {"tent_lr": tent_lr, "lr": lr, None: None}[adapter_class(method).lr_option],
                "time_s": elapsed,
                "time_per_corruption_s": seconds,
            }
            if done["fp"] != fpb * done["batches"] or done["bp"] != bpb * done["batches"]:
                raise RuntimeError(f"{method}: counted {done['fp']} FP / {done['bp']} BP "
                                   f"over {done['batches']} batches, expected {fpb} / {bpb} per batch")
            if progress:
                tqdm.write(f"[tta] {setting:9s} {method:12s} avg acc {100 * results[setting][method]['average']:6.2f}%"
                           f"  #FP {done['fp']} #BP {done['bp']}  ({elapsed:.1f}s)")
            del adapter, model
    # the source model is untouched: guard against an accidental in-place change
    for name, v in source.state_dict().items():
        if not torch.equal(v, source_state[name]):
            raise RuntimeError(f"the source model changed during adaptation ({name}); this is a bug")

    out = {
        "dataset": dataset_name,
        "model": _model_name(source),
        "severity": severity,
        "corruptions": corruptions,
        "methods": methods,
        "settings": settings,
        "results": results,
        "config": {
            "batch_size": batch_size, "lr_reset": lr_reset, "lr_continual": lr_continual, "mu": mu,
            "momentum": momentum, "q": q, "k": k, "predict": predict, "tent_optimizer": tent_optimizer,
            "tent_lr": tent_lr, "tent_momentum": tent_momentum, "seed": seed, "max_batches": max_batches,
            "subspace_per_corruption": per_corruption,
            **dict(info or {}),
        },
    }
    if write:
        write_tables(out, Path(out_dir), plot=plot)
    return out
