"""Recipe configs: one typed schema, YAML defaults + ``--set a.b=value`` overrides -> one validated,
resolved, frozen config.

The schema is the frozen dataclasses of :mod:`szo.schema` (re-exported here), one per section (``model``, ``data``, ``loss``,
``bptt`` / ``train``, ``trajectory``, ``subspace``, ``szo``, ``hw``, ``tt``, ``distributed``,
``tta``, ``federated``, ``log``): each field's type (``Literal`` for a fixed choice, ``| None``
where null is valid) and its ``metadata`` (``min``, ``choices`` read from a registry) say what
is valid. Every kind of run (``kind: bp | subspace | tta``, and ``szo federated``) reads the same
schema, so ``config.yaml`` in every run directory records every section.

A recipe is a YAML mapping (``yaml.safe_load``); it may start with ``extends: OTHER`` to take
another recipe's values as its defaults, and may hold ``method_defaults: {METHOD: {...}}``,
values that apply only when that method is chosen. Values given with ``--set`` are parsed with
``yaml.safe_load`` (``--set train.epochs=3``, ``--set data.data_dir=null``, ``--set
model.kwargs={width: 8}``). Unknown keys, wrong types and invalid choices raise ``ValueError``
with one line that names the key and what is valid; every setting of every stage is checked
when the config is resolved, before anything runs.

The resolved config (:class:`RecipeConfig`; sections read as mappings too: ``cfg["train"]["lr"]``
is ``cfg.train.lr``) is what ``write_config`` stores as ``run_dir/config.yaml``; ``szo recipe
RUN_DIR/config.yaml`` re-runs it.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Iterable

import yaml

from szo.io import atomic_write_text
from szo.methods import (
    METHODS,
    TTA_METHODS,
    check_scale,
    get_method,
    list_methods,
    method_label,
    shared_mu,
    shared_scale,
)
from szo.models.compiled import check_compile
from szo.recipes import deep_merge, read_recipe, recipe_names, recipe_path
from szo.schema import (  # the sections and their value checks: szo.schema; read them from here
    DEFAULT_Q,
    DEVICES,
    DIST_MODES,
    FEDERATED_OPTIMIZERS,
    FEDERATED_SPACES,
    HW_ARITHMETICS,
    HW_RESETS,
    KINDS,
    LEARNER_WIDTHS,
    MODES,
    SCHEDULERS,
    TENT_OPTIMIZERS,
    TTA_PREDICT,
    TTA_PROTOCOLS,
    TTA_SETTINGS,
    AdaptationConfig,
    AdapterConfig,
    FederatedConfig,
    FinetuneConfig,
    HWConfig,
    IntegerStateConfig,
    Precision,
    RecipeConfig,
    Section,
    StageConfig,
    StepConfig,
    SZOConfig,
    TTAConfig,
    TTConfig,
    build_section,
    check_key,
    config_dict,
)
from szo.zo.path import ProbePath

__all__ = [
    "DEFAULTS", "KINDS", "MODES", "METHODS", "DEVICES", "SCHEDULERS", "DIST_MODES", "RecipeConfig", "Section",
    "recipe_names", "recipe_path", "load_recipe", "load_config", "apply_overrides", "parse_override", "validate",
    "resolve", "write_config", "method_label", "config_dict", "TTA_SETTINGS", "TTA_PREDICT", "TENT_OPTIMIZERS",
    "TTA_PROTOCOLS", "FEDERATED_SPACES", "FEDERATED_OPTIMIZERS", "SOURCE_SECTIONS", "source_config",
    "StepConfig", "StageConfig", "SZOConfig", "TTConfig", "IntegerStateConfig", "HWConfig", "LEARNER_WIDTHS",
    "AdapterConfig", "AdaptationConfig", "TTAConfig", "FederatedConfig", "FinetuneConfig", "HW_ARITHMETICS", "HW_RESETS",
    "Precision", "DEFAULT_Q",
]


# ----------------------------------------------------------------------------- overrides
def parse_override(item: str) -> tuple[str, Any]:
    """``"a.b=value"`` -> ``("a.b", yaml.safe_load(value))``."""
    if "=" not in item:
        raise ValueError(f"--set expects key=value (e.g. train.epochs=3), got {item!r}")
    key, _, text = item.partition("=")
    key = key.strip()
    if not key:
        raise ValueError(f"--set expects key=value, got {item!r}")
    if not text.strip():  # an empty value is a value left out, not the default (issue 49)
        raise ValueError(f"--set {key}= has no value; give one (e.g. {key}=VALUE), or {key}=null for the default")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text
    return key, value


def apply_overrides(cfg: Mapping[str, Any], overrides: Iterable[str | tuple[str, Any]]) -> dict[str, Any]:
    """A copy of ``cfg`` (plain dicts) with ``key=value`` overrides applied (keys checked against the schema)."""
    cfg = config_dict(cfg)
    items = [parse_override(i) if isinstance(i, str) else i for i in overrides]
    for key, value in items:
        check_key(key)
        parts = key.split(".")
        node = cfg
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    return cfg


# ----------------------------------------------------------------------------- validation
def validate(cfg: Mapping[str, Any]) -> RecipeConfig:
    """Fill defaults, check every key, type and choice, then the combinations; the typed config."""
    raw = config_dict(cfg)
    if raw.get("kind") == "tta":
        raw.setdefault("method", "all")  # test-time adaptation compares every method unless told otherwise
    full = build_section(RecipeConfig, raw)
    dev = full.device
    if not (dev in DEVICES or (isinstance(dev, str) and dev.startswith("cuda:") and dev[5:].isdigit())):
        raise ValueError(f"invalid device {dev!r}; valid: cpu, cuda, cuda:N")
    ev = full.trajectory.every
    if ev != "epoch" and (isinstance(ev, str) or isinstance(ev, bool) or ev < 1):
        raise ValueError(f"invalid trajectory.every {ev!r}; valid: 'epoch' or a positive int (steps)")
    _check_required(full)
    if full.kind == "tta":
        _check_tta(full)
        return full
    if full.method not in list_methods():
        raise ValueError(f"invalid method {full.method!r}; valid: {', '.join(list_methods())}")
    if full.subspace.name is None and full.kind == "subspace":
        raise ValueError("a subspace recipe needs 'subspace.name' (the store entry to train in)")
    if full.kind == "subspace":
        _check_method_options(full)
    _check_source(full)
    _check_hw(full)
    _check_path(full)
    if full.mode == "continual" and full.subspace.reference != "last":
        raise ValueError("continual recipes start from the pretrained model: subspace.reference must be 'last'")
    if not full.hw.coord_frac < full.hw.coord_bits:
        raise ValueError(f"need 0 <= hw.coord_frac < hw.coord_bits, got {full.hw.coord_frac}, {full.hw.coord_bits}")
    return full


def _check_required(full: RecipeConfig) -> None:
    """``model.name`` and ``data.name``: every training recipe needs them; a ``kind: tta`` recipe
    only when it trains its source model here (``tta.train_source``)."""
    if full.kind == "tta" and not full.tta.train_source:
        return
    for key, value in (("model.name", full.model.name), ("data.name", full.data.name)):
        if value is None:
            raise ValueError(f"'{key}' must be set (got null)")


def _tta_names(what: str, value: str, valid: Iterable[str], everything: str) -> list[str]:
    """``everything``, one name or a comma list -> the names, checked."""
    valid = list(valid)
    names = [v.strip() for v in str(value).split(",") if v.strip()]
    if not names:
        raise ValueError(f"no {what} given; valid: {everything}, {', '.join(valid)}")
    for n in names:
        if n != everything and n not in valid:
            raise ValueError(f"unknown {what} {n!r}; valid: {everything}, {', '.join(valid)}")
    return valid if everything in names else [v for v in valid if v in names]


def _check_tta(full: RecipeConfig) -> None:
    """The ``kind: tta`` combinations: methods, settings and the adaptation-subspace protocol."""
    methods = _tta_names("method", full.method, TTA_METHODS, "all")
    settings = _tta_names("setting", full.setting, TTA_SETTINGS, "both")
    t = full.tta
    if full.szo.refresh is not None:
        raise ValueError("szo.refresh (a redrawn random basis) applies to the training stage of a kind: subspace "
                         "recipe; test-time adaptation keeps its subspace: leave szo.refresh null")
    if t.protocol == "loco" and any(get_method(m).subspace for m in methods):
        if t.finetune.trajectory is not None:
            raise ValueError("tta.protocol=loco fine-tunes one subspace per evaluated corruption; it cannot use "
                             "one given tta.finetune.trajectory (set it to null, or use protocol paper / train)")
        if full.subspace.name:
            raise ValueError("tta.protocol=loco fine-tunes one subspace per evaluated corruption; it cannot use "
                             "one subspace store entry subspace.name (set it to null, or use protocol paper / train)")
        if settings == ["continual"]:
            raise ValueError("tta.protocol=loco (leave one corruption out) is defined for the reset setting only: "
                             "the continual setting adapts across every corruption, so none is left out; "
                             "use setting=reset (setting=both runs the reset setting only)")


def _check_method_options(full: RecipeConfig) -> None:
    """Options of the subspace stage that only some methods take (their ``szo.methods`` record),
    checked before anything runs: a recipe must not fail after its BPTT stage on a combination
    known up front. What the method runs its probes with is the probe path's rule (``_check_path``)."""
    spec = get_method(full.method)
    spec.check_capabilities(weight_decay=full.train.weight_decay, momentum=full.train.momentum, recipe=True)
    spec.check_options(full.szo, prefix="szo.")


SOURCE_SECTIONS: tuple[str, ...] = ("model", "bptt", "trajectory", "subspace", "seed", "device", "progress",
                                     "precision", "compile", "cuda_graphs", "threads")
"""What a subspace recipe hands its ``source``'s BPTT stage: the same model, BPTT stage, trajectory,
store entry and run settings; the source gives its data and loss (an adaptation recipe's clean pretraining)."""


def source_config(cfg: Mapping[str, Any]) -> "RecipeConfig":
    """The config whose BPTT stage builds a ``kind: subspace`` recipe's store entry: the recipe
    named by its ``source`` with this recipe's :data:`SOURCE_SECTIONS` (one ValueError if that
    recipe does not load or is not a recipe with its own BPTT stage)."""
    name = cfg["source"]
    try:
        src = load_recipe(name, [(k, config_dict(cfg[k]) if isinstance(cfg[k], Mapping) else cfg[k])
                                 for k in SOURCE_SECTIONS])
    except ValueError as e:
        raise ValueError(f"source {name!r}: {e}") from None
    if src.kind not in ("bp", "subspace") or src.source is not None:
        raise ValueError(f"source {name!r} must be a recipe with its own BPTT stage (kind bp or subspace, no source "
                         f"of its own); it is kind: {src.kind}" + (f", source: {src.source}" if src.source else ""))
    return src


def _check_source(full: RecipeConfig) -> None:
    """``source`` is for ``kind: subspace`` recipes, names another recipe, and that one builds this
    recipe's store entry (checked here, before anything runs)."""
    if full.source is None:
        return
    if full.kind != "subspace":
        raise ValueError(f"'source' names the recipe whose BPTT stage builds a subspace recipe's store entry; this "
                         f"recipe is kind: {full.kind} (leave source null)")
    if full.source == full.name:
        raise ValueError(f"'source' names this recipe itself ({full.source!r}); leave it null to run its own BPTT stage")
    source_config(full)


def _check_path(full: RecipeConfig) -> None:
    """How the probes (and the model's forwards) run: ``compile`` names a torch.compile backend, and the
    combination of engine, compile, CUDA graphs, streaming, backend and the method is one the probe
    path can run (``szo.zo.ProbePath``: every such rule, in the recipe's spelling). A multi-process run's
    own rules: ``szo.stages.check_distributed``."""
    if full.compile is not False:
        check_compile("inductor" if full.compile is True else full.compile)
    ProbePath.from_recipe(full).check(recipe=True)


def _check_hw(full: RecipeConfig) -> None:
    """Backend / BN-statistics / fixed-point learner choices and the combinations that make sense."""
    hw = full.hw
    if full.backend != "fixed" and (hw.arithmetic != "szo" or hw.reset is not None):
        raise ValueError("hw.arithmetic / hw.reset choose the integer arithmetic of backend 'fixed'; with backend "
                         f"{full.backend!r} leave them at 'szo' / null")
    spec = get_method(full.method)
    if full.backend == "fixed":
        if full.kind != "subspace":
            raise ValueError("backend 'fixed' applies to the subspace stage (kind: subspace); "
                             "BPTT needs float gradients: run it with backend 'float'")
        if full.bn_stats != "deployed":
            raise ValueError("backend 'fixed' folds BatchNorm into the weights with fixed running statistics, "
                             "so it needs bn_stats 'deployed' (valid for fixed: deployed)")
    if hw.learner == "integer" and full.backend != "fixed":
        raise ValueError("hw.learner 'integer' (on-chip integer state, seed-004 Rademacher for szo-rge) needs "
                         f"backend 'fixed' and a method in: {', '.join(list_methods(integer_learner=True))}")
    # the learner's own rules (which methods it trains, no refresh): their one home, the method's record
    spec.check_learner(integer=hw.learner == "integer", refresh=full.szo.refresh, recipe=True)
    if full.bn_stats == "deployed" and full.kind != "subspace":
        raise ValueError("bn_stats 'deployed' applies to the subspace stage (kind: subspace); valid here: batch")
    if hw.blocks is not None:
        if not spec.block_selection or full.kind != "subspace":
            raise ValueError(f"hw.blocks (seed 004's BP-free block selection) applies to method "
                             f"{', '.join(list_methods(block_selection=True))} in a subspace recipe; method "
                             f"{full.method!r} does not select blocks: leave hw.blocks null")
        if full.szo.layers is not None:
            raise ValueError("hw.blocks selects the trained layers itself (one block); leave szo.layers null, or "
                             "hw.blocks null to train szo.layers")


def resolve(cfg: Mapping[str, Any]) -> RecipeConfig:
    """``validate`` plus defaults that depend on other values: ``szo.scale`` / ``szo.mu``
    (:func:`_resolve_scale`) and ``train.lr: null`` -> the method's default under the run's scale
    (``MethodSpec.default_lr``: its relative ``train.lr`` under a relative scale, else its record's,
    else 1.0, paper App. G), or ``bptt.lr`` for a backprop method without a subspace (full-space BP)."""
    full = _resolve_scale(validate(cfg))
    if full.szo.q is None:  # the run's default directions per step: training's 1, test-time adaptation's 10
        full = dataclasses.replace(full, szo=full.szo.replace(q=DEFAULT_Q["tta" if full.kind == "tta" else "train"]))
    if full.kind == "tta" or full.train.lr is not None:
        return full
    lr = get_method(full.method).default_lr(full.szo.scale)
    return dataclasses.replace(full, train=full.train.replace(lr=full.bptt.lr if lr is None else lr))


def _resolve_scale(full: RecipeConfig) -> RecipeConfig:
    """``szo.scale: null`` -> the default of the subspace methods the run trains (kind tta: adapts
    with): ``trajectory`` where every one has relative defaults in its record and the learner is the
    float one (``MethodSpec.default_scale``), else ``absolute``. A relative scale set explicitly where
    that does not hold is refused in one line. ``szo.mu: null`` -> the scale's default (absolute: 1.0,
    App. G; relative: the method's)."""
    sz = full.szo
    if full.kind == "tta":
        methods = [m for m in _tta_names("method", full.method, TTA_METHODS, "all") if get_method(m).subspace]
    else:
        methods = [full.method]
    integer = full.hw.learner == "integer"
    check_scale(methods, sz.scale, integer=integer, recipe=True)  # the rule build_optimizer and run_tta call too
    scale = sz.scale if sz.scale is not None else shared_scale(methods, integer=integer)
    mu = sz.mu if sz.mu is not None else shared_mu(methods, scale)  # App. G's 1.0 where the methods disagree
    return dataclasses.replace(full, szo=sz.replace(mu=mu, scale=scale))


def _apply_method_defaults(raw: dict[str, Any], items: list[tuple[str, Any]]) -> dict[str, Any]:
    """Merge ``raw['method_defaults'][method]`` (the method chosen by ``items`` or the recipe) into ``raw``.

    ``method_defaults`` maps a method to the recipe values that differ for it, e.g.
    ``{szo-rge: {szo: {mu: 0.3}, train: {lr: 0.02}}}``: hyperparameters that depend on the
    method (the RGE step is noisier than CGE's). ``--set`` values still win over them.
    """
    per = raw.pop("method_defaults", None)
    if per is None:
        return raw
    if not isinstance(per, dict):
        raise ValueError(f"'method_defaults' must map a method to a section of values, got {per!r}")
    for m, values in per.items():
        if m not in list_methods():
            raise ValueError(f"method_defaults: unknown method {m!r}; valid: {', '.join(list_methods())}")
        if not isinstance(values, dict):
            raise ValueError(f"method_defaults.{m} must be a mapping of recipe values, got {values!r}")
    method = dict(items).get("method", raw.get("method", DEFAULTS["method"]))
    return deep_merge(raw, per.get(method, {}))


def load_recipe(name_or_path: str | os.PathLike, overrides: Iterable[str | tuple[str, Any]] = ()) -> RecipeConfig:
    """Shipped recipe name or a YAML path, ``extends`` resolved, the chosen method's
    ``method_defaults`` merged, overrides applied, validated, resolved."""
    items = [parse_override(i) if isinstance(i, str) else i for i in overrides]
    raw = _apply_method_defaults(read_recipe(name_or_path), items)
    return resolve(apply_overrides(raw, items))


load_config = load_recipe


def write_config(cfg: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Write the resolved config as YAML (atomically)."""
    atomic_write_text(path, yaml.safe_dump(config_dict(cfg), sort_keys=False, default_flow_style=False))


#: every valid key with its default (a recipe only lists what differs); derived from the schema
DEFAULTS: dict[str, Any] = RecipeConfig().to_dict()
