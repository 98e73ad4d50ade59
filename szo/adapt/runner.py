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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from szo.config import DEFAULT_Q, AdaptationConfig, AdapterConfig
from szo.data import CORRUPTIONS, get_dataset, make_loader
from szo.methods import check_scale, get_method, shared_mu, shared_scale
from szo.precision import check_precision, precision_policy
from szo.zo.scale import coordinate_scales, scale_record

from .methods import (
    METHODS,
    SETTINGS,
    SUBSPACE_METHODS,
    adapter_class,
    build_adapter,
    check_choice,
)
from .tables import write_tables

__all__ = ["run_tta", "TTAOptions", "resolve_methods", "resolve_settings", "SETTING_FREE_METHODS", "APP_G_LR"]

#: methods whose predictions do not depend on the setting (no parameter change, batch-local)
SETTING_FREE_METHODS = tuple(m for m in METHODS if adapter_class(m).setting_free)
#: the subspace methods' learning rate per setting under szo.scale absolute (paper App. G)
APP_G_LR = {"reset": 1.0, "continual": 0.1}


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


@dataclass(frozen=True, eq=False)
class TTAOptions(AdaptationConfig):
    """How :func:`run_tta` adapts and evaluates (everything but the source, subspace, data set,
    methods and settings): the recipe's ``AdaptationConfig`` (the ``tta`` keys severity, batch_size,
    data_dir, download, corruptions, lr_reset / lr_continual, momentum, predict, Tent's, max_batches:
    declared and checked once, with the recipe) and what a run adds.

    ``lr_reset`` / ``lr_continual``: learning rate of the subspace methods per setting (None: the default of
    ``scale``: absolute 1.0 / 0.1, App. G; relative: each method's relative ``train.lr``, continual x 0.1 as App. G);
    ``scale``: the units of ``mu`` and the learning rates (``szo.zo.scale``; None: the subspace methods'
    default, ``szo.methods.shared_scale``: trajectory, as a ``kind: tta`` recipe and ``szo adapt`` take it);
    ``mu``: None is the scale's default (``shared_mu``: 0.3 under trajectory, 1.0 absolute); ``q``: SZO-RGE's
    directions per step, 10 (App. G; the ``*-tta`` recipes' and ``szo adapt``'s default too);
    ``corruptions``: default ``szo.data.CORRUPTIONS`` (the 15, table order); ``predict``:
    ``"before"`` | ``"after"`` (see ``szo.adapt.methods``); ``max_batches``: adapt on at most this
    many batches per corruption (quick checks); ``get_data``: ``corruption -> Dataset`` instead of
    ``szo.data.get_dataset``; ``write``: write the results (``szo.adapt.tables.write_tables``:
    ``tta_results.json``, the markdown tables and, with ``plot``, ``tta_accuracy.png`` in
    ``out_dir``), ``False`` when the caller adds to the results and writes them itself (once).
    """

    out_dir: str | os.PathLike | None = None  # required (run_tta says so)
    seed: int = 0
    mu: float | None = None
    q: int = DEFAULT_Q["tta"]
    scale: str | None = None
    device: str | torch.device = "cpu"
    dataset_kwargs: Mapping | None = None
    get_data: Callable | None = None
    progress: bool = True
    plot: bool = True
    write: bool = True
    info: Mapping | None = None
    precision: str = "auto"

    def check(self) -> None:
        check_precision(self.precision)
        if self.out_dir is None:
            raise ValueError("run_tta needs out_dir= (where tta_results.json and the tables go)")

    def resolved(self, methods: Sequence[str]) -> "TTAOptions":
        """``scale`` / ``mu`` left None filled with the defaults of the subspace methods in ``methods``
        (``shared_scale`` / ``shared_mu``), the rule a ``kind: tta`` recipe resolves by."""
        subspace = [m for m in methods if get_method(m).subspace]
        scale = self.scale if self.scale is not None else shared_scale(subspace)
        check_scale(subspace, self.scale)  # the recipe's rule (szo.config) and build_optimizer's
        return self.replace(scale=scale, mu=self.mu if self.mu is not None else shared_mu(subspace, scale))

    def lr_of(self, method: str, setting: str) -> float | None:
        """The learning rate ``method`` adapts with in ``setting`` (None: it takes none)."""
        option = adapter_class(method).lr_option
        if option == "tent_lr":
            return self.tent_lr
        if option != "lr":
            return None
        lr = self.lr_reset if setting == "reset" else self.lr_continual
        if lr is not None:
            return lr
        # the method's step under the scale (absolute: App. G's 1.0; None: the method's default scale);
        # continual: the paper's ratio to reset
        scale = self.scale if self.scale is not None else shared_scale([method])
        return get_method(method).default_lr(scale) * APP_G_LR[setting] / APP_G_LR["reset"]


class _TTARun:
    """One :func:`run_tta` call: the checked inputs, the data, one adapter per (setting, method)."""

    def __init__(self, source: nn.Module, subspace: Any, dataset_name: str, methods: list[str], settings: list[str],
                 o: TTAOptions):
        if not isinstance(source, nn.Module):
            raise ValueError(f"source_model must be a torch.nn.Module, got {type(source).__name__}")
        self.source, self.subspace, self.dataset_name, self.o = source, subspace, dataset_name, o
        self.methods, self.settings = methods, settings
        self.corruptions = list(o.corruptions if o.corruptions is not None else CORRUPTIONS)
        if not self.corruptions:
            raise ValueError("no corruption given")
        self.per_corruption = isinstance(subspace, Mapping)
        self.k = self._check_subspace()
        self.get_data = o.get_data or self._dataset
        self._datasets: dict[str, Dataset] = {}

    def _check_subspace(self) -> int | None:
        """The subspace dimension k; the subspace (or one per corruption) checked against the methods."""
        sub, needs = self.subspace, [m for m in self.methods if m in SUBSPACE_METHODS]
        if needs and sub is None:
            raise ValueError(f"methods {needs} need an adaptation subspace; build one with "
                             "szo.adapt.subspace.build_adaptation_subspace or drop them")
        if sub is None:
            return None
        if not self.per_corruption:
            return int(sub.basis.shape[1])
        missing = [c for c in self.corruptions if c not in sub]
        if missing:
            raise ValueError(f"the subspace mapping has no subspace for corruption(s) {missing}; it has {sorted(sub)}")
        if needs and "continual" in self.settings:
            raise ValueError("one subspace per corruption is for the reset setting only (the continual setting "
                             "adapts one model across all corruptions); pass setting 'reset' or a single subspace")
        ks = sorted({int(sub[c].basis.shape[1]) for c in self.corruptions})
        if len(ks) > 1:
            raise ValueError(f"the per-corruption subspaces have different k {ks}; they must share one k")
        return ks[0]

    def _dataset(self, c: str) -> Dataset:
        o = self.o
        return get_dataset(self.dataset_name, "test", data_dir=o.data_dir, download=o.download, corruption=c,
                           severity=o.severity, **dict(o.dataset_kwargs or {}))

    def data(self, c: str) -> Dataset:
        if c not in self._datasets:
            self._datasets[c] = self.get_data(c)
        return self._datasets[c]

    def subspace_for(self, c: str) -> Any:
        return self.subspace[c] if self.per_corruption else self.subspace

    # ------------------------------------------------------------------ the runs
    def run(self) -> dict[str, Any]:
        source_state = {k: v.detach().clone() for k, v in self.source.state_dict().items()}
        results: dict[str, dict[str, Any]] = {s: {} for s in self.settings}
        for setting in self.settings:
            for method in self.methods:
                if method in SETTING_FREE_METHODS and setting != self.settings[0]:
                    shared = dict(results[self.settings[0]][method])
                    shared["shared_with"] = self.settings[0]
                    results[setting][method] = shared
                    continue
                results[setting][method] = self._run_method(setting, method)
        # the source model is untouched: guard against an accidental in-place change
        for name, v in self.source.state_dict().items():
            if not torch.equal(v, source_state[name]):
                raise RuntimeError(f"the source model changed during adaptation ({name}); this is a bug")
        return self._results(results)

    def _adapter(self, method: str, model: nn.Module, setting: str, c: str, gen: torch.Generator) -> Any:
        o = self.o
        return build_adapter(method, model, subspace=self.subspace_for(c), lr=o.lr_of(method, setting) or None,
                             mu=o.mu, q=o.q, scale=o.scale, generator=gen, **o.select(AdapterConfig))

    def _run_method(self, setting: str, method: str) -> dict[str, Any]:
        o = self.o
        model = copy.deepcopy(self.source).to(o.device)  # one private copy per (setting, method) run
        policy = precision_policy(o.precision, model, o.device, forward_only=not get_method(method).backprop)
        with policy.scope():  # the run's arithmetic (szo.precision) for adaptation and prediction alike
            rec = self._adapt_all(setting, method, model)
        rec["precision"] = policy.record()
        return rec

    def _adapt_all(self, setting: str, method: str, model: nn.Module) -> dict[str, Any]:
        o = self.o
        gen = torch.Generator().manual_seed(int(o.seed) + 1)  # RGE directions
        adapter = self._adapter(method, model, setting, self.corruptions[0], gen)
        own_subspace = self.per_corruption and method in SUBSPACE_METHODS
        done = {"fp": 0, "bp": 0, "batches": 0}  # counts of the adapters of earlier corruptions
        per_c: dict[str, float] = {}
        counts: dict[str, int] = {}
        seconds: dict[str, float] = {}  # adaptation and prediction, data loading excluded
        for ci, c in enumerate(self.corruptions):
            self.data(c)  # loaded (generated, for digits-c / mnist5k-c) outside the timing
            tc = time.perf_counter()
            if setting == "reset" and ci > 0:
                adapter.reset()
                if own_subspace:  # the source model again, now adapted in c's own subspace
                    for key, v in adapter.counts().items():
                        done[key] += v
                    adapter = self._adapter(method, model, setting, c, gen)
            per_c[c], counts[c] = self._evaluate(adapter, c, f"{setting}/{method}/{c}")
            seconds[c] = time.perf_counter() - tc
        for key, v in adapter.counts().items():
            done[key] += v
        return self._record(setting, method, per_c, counts, seconds, done)

    def _evaluate(self, adapter: Any, c: str, desc: str) -> tuple[float, int]:
        """Adapt on corruption ``c``'s test set in batches, predicting as it goes: (accuracy, samples)."""
        o = self.o
        loader = make_loader(  # time-major batches for event-frame sequences
            self.data(c), o.batch_size, shuffle=True,
            generator=torch.Generator().manual_seed(int(o.seed) * 1000003 + zlib.crc32(c.encode())))
        correct = seen = 0
        total = len(loader) if o.max_batches is None else min(len(loader), o.max_batches)
        bar = tqdm(total=total, desc=desc, leave=False, disable=not o.progress, dynamic_ncols=True)
        for b, (x, y) in enumerate(loader):
            if o.max_batches is not None and b >= o.max_batches:
                break
            x, y = x.to(o.device), y.to(o.device)
            out = adapter(x)
            correct += int((out.mean(0).argmax(1) == y).sum())
            seen += int(y.shape[0])
            bar.update(1)
            bar.set_postfix(acc=f"{correct / seen:.3f}", refresh=False)
        bar.close()
        if seen == 0:
            raise ValueError(f"corruption {c!r} of {self.dataset_name!r} yielded no test samples")
        return correct / seen, seen

    def _record(self, setting: str, method: str, per_c: dict[str, float], counts: dict[str, int],
                seconds: dict[str, float], done: dict[str, int]) -> dict[str, Any]:
        o = self.o
        elapsed = sum(seconds.values())
        fpb, bpb = _per_batch(method, o.predict, self.k, o.q)
        if done["fp"] != fpb * done["batches"] or done["bp"] != bpb * done["batches"]:
            raise RuntimeError(f"{method}: counted {done['fp']} FP / {done['bp']} BP "
                               f"over {done['batches']} batches, expected {fpb} / {bpb} per batch")
        row = {"per_corruption": per_c, "average": sum(per_c.values()) / len(per_c), "samples": counts,
               "fp": done["fp"], "bp": done["bp"], "batches": done["batches"], "fp_per_batch": fpb,
               "bp_per_batch": bpb, "lr": o.lr_of(method, setting), "time_s": elapsed,
               "time_per_corruption_s": seconds}
        if o.progress:
            tqdm.write(f"[tta] {setting:9s} {method:12s} avg acc {100 * row['average']:6.2f}%"
                       f"  #FP {done['fp']} #BP {done['bp']}  ({elapsed:.1f}s)")
        return row

    def _scale_record(self) -> dict[str, Any]:
        """The units of mu / lr of the subspace methods (``szo.zo.scale``): the rule and each direction's
        unit in the adaptation subspace (one record per corruption for per-corruption subspaces)."""
        o, sub = self.o, self.subspace
        if sub is None or o.scale == "absolute":
            return scale_record(o.scale, None)
        if not self.per_corruption:
            return scale_record(o.scale, coordinate_scales(sub.eigenvalues, o.scale))
        return {"rule": o.scale, "per_corruption": {c: scale_record(o.scale, coordinate_scales(sub[c].eigenvalues, o.scale))
                                                    for c in self.corruptions}}

    def _results(self, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
        o = self.o
        return {
            "dataset": self.dataset_name, "model": _model_name(self.source), "severity": o.severity,
            "corruptions": self.corruptions, "methods": self.methods, "settings": self.settings, "results": results,
            "config": {
                "batch_size": o.batch_size, "lr_reset": o.lr_reset, "lr_continual": o.lr_continual, "mu": o.mu,
                "momentum": o.momentum, "q": o.q, "scale": self._scale_record(), "k": self.k, "predict": o.predict, "tent_optimizer": o.tent_optimizer,
                "tent_lr": o.tent_lr, "tent_momentum": o.tent_momentum, "seed": o.seed, "max_batches": o.max_batches,
                "subspace_per_corruption": self.per_corruption,
                **dict(o.info or {}),
            },
        }


def run_tta(source_model: nn.Module, subspace: Any, dataset_name: str, methods: str | Sequence[str],
            settings: str | Sequence[str], **options: Any) -> dict[str, Any]:
    """Adapt and evaluate every (method, setting) on ``dataset_name`` at ``severity``.

    ``source_model`` is never modified (every run adapts its own copy). ``subspace``: the
    adaptation subspace (``subspace_store.Subspace``) for bp-subspace / szo-*; None if no
    subspace method runs; or ``{corruption: Subspace}`` (one per evaluated corruption, all of
    the same k; e.g. leave-one-corruption-out): then every corruption is adapted in its own
    subspace, reset setting only. ``methods`` / ``settings``: names, ``"all"`` / ``"both"``,
    comma lists or lists. Keywords: the fields of :class:`TTAOptions` (``out_dir``
    required; ``batch_size`` 100 unless given, App. G's CIFAR-C batch). Returns the results dict.
    """
    o = TTAOptions(**options)
    o.check()
    methods = resolve_methods(methods)
    o = o.resolved(methods)
    out = _TTARun(source_model, subspace, dataset_name, methods, resolve_settings(settings), o).run()
    if o.write:
        write_tables(out, Path(o.out_dir), plot=o.plot)
    return out
