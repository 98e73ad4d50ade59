"""Recipe configs: YAML defaults + ``--set a.b=value`` overrides -> one validated, resolved dict.

A recipe is a YAML mapping (``yaml.safe_load``) with the sections below; a recipe may start
with ``extends: OTHER`` to take another recipe's values as its defaults, and may hold
``method_defaults: {METHOD: {...}}``, values that apply only when that method is chosen. Values given with
``--set`` are parsed with ``yaml.safe_load`` (``--set train.epochs=3``, ``--set
data.data_dir=null``, ``--set model.kwargs={width: 8}``). Unknown keys and invalid choices
raise ``ValueError`` with one line that lists what is valid.

The resolved config (defaults filled in, ``train.lr: null`` replaced by the method's
default) is what ``write_config`` stores as ``run_dir/config.yaml``; ``szo recipe
RUN_DIR/config.yaml`` re-runs it.
"""
from __future__ import annotations

import copy
import os
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from szo.io import atomic_write_text
from szo.methods import METHODS, get_method, list_methods, method_label, which_methods  # the one method table (no torch import)

__all__ = [
    "DEFAULTS", "KINDS", "MODES", "METHODS", "DEVICES", "SCHEDULERS", "DIST_MODES",
    "recipe_names", "recipe_path", "load_recipe", "load_config", "apply_overrides",
    "parse_override", "validate", "resolve", "write_config", "method_label",  # method_label: szo.methods
]

_FREE = object()  # marks a free-form mapping (model.kwargs, data.kwargs)
KINDS = ("bp", "subspace", "tta")
# Recipe kinds run by other modules: kind -> (module, resolve function, run function,
# extra top-level keys with defaults). The shared sections keep their meaning; the module's
# resolve function checks its own section and ``method`` choices.
EXTERNAL_KINDS: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "tta": ("szo.adapt.cli", "resolve_tta", "run_recipe", {"setting": "both", "tta": _FREE}),
}
MODES = ("scratch", "continual")
DEVICES = ("cpu", "cuda")
SCHEDULERS = ("cosine", "constant")
REFERENCES = ("first", "last")
BACKENDS = ("float", "fixed")  # = szo.hw.BACKENDS
BN_STATS = ("batch", "deployed")
HW_LEARNERS = ("float", "integer")  # szo.optim.SZO on float coordinates | szo.hw.train.OnChipSZO
HW_ARITHMETICS = ("szo", "loihi")  # = szo.hw.fixed.ARITHMETICS: saturating | bit-exact with Lava's LIF/Dense
HW_RESETS = ("subtract", "zero")  # = szo.hw.neuron.RESETS (null: each LIF's own)
DIST_MODES = ("data", "perturbation")  # = szo.distributed.MODES

_STAGE = {
    "epochs": 1, "lr": 0.1, "momentum": 0.9, "weight_decay": 0.0, "scheduler": "cosine",
    "eval_every": 1, "max_steps_per_epoch": None, "checkpoint_every_steps": None,
}

# Every valid key with its default. A recipe only lists what differs.
DEFAULTS: dict[str, Any] = {
    "name": None,
    "description": "",
    "kind": "bp",            # bp: BPTT (+ trajectory + subspace); subspace: train in a subspace
    "mode": "scratch",       # subspace recipes: scratch (reference = first sample) | continual
    "method": "szo-cge",     # subspace stage optimizer (szo.optim.build_optimizer)
    "seed": 0,
    "device": "cpu",
    "progress": True,
    # bn_time: BatchNorm over time, "shared" (one normalisation over all T*N samples of a forward,
    # one running-statistics update) or "per-step" (the authors' single-step convention: each
    # time step normalised with its own statistics, T updates per forward); see docs/bn.md.
    # memory_format: activations' layout, auto (channels-last on CPU for the models measured faster
    # so) | channels_last | contiguous; see SpikingModel.set_memory_format, docs/performance.md
    "model": {"name": None, "T": None, "activation": "lif", "bn_time": "shared", "memory_format": "auto",
              "kwargs": _FREE},
    "data": {"name": None, "data_dir": None, "download": False, "augment": None, "batch_size": 128,
             "test_batch_size": 256, "num_workers": 0, "kwargs": _FREE},
    "loss": {"name": "tet", "lamb": 0.05, "phi": 1.0},
    "bptt": dict(_STAGE, lr=0.1, weight_decay=1.0e-4),
    "trajectory": {"every": "epoch", "record_initial": True},
    "subspace": {"name": None, "k": 20, "window": None, "reference": "first", "root": None},
    "train": dict(_STAGE, lr=None, weight_decay=0.0),
    # time_chunk: forward-only stages run the T steps in chunks of this many (1 = streaming,
    # memory flat in T; null = all T at once); stream_bn: what train-mode BN does in a chunked
    # forward (exact | running | chunk, see szo.models.streaming)
    # engine: how the 2k (2q) probes of an SZO step are evaluated: loop (one forward each) or
    # batched (perturbed copies folded into one forward per chunk of probes, szo.engine)
    # bn_update: BN running statistics after a forward-only step: recompute (one unperturbed
    # forward of the updated model, +1 forward per step) | probe-mean (mean over the probes,
    # free, biased); szo.zo.bn and docs/bn.md
    "szo": {"mu": 1.0, "q": 1, "coords_per_step": None, "time_chunk": None, "stream_bn": "exact",
            "engine": "loop", "chunk": None, "bn_update": "recompute", "layers": None, "stages": None},
    # subspace stage only: "fixed" trains through the Loihi-style integer forward (szo.hw);
    # bn_stats "deployed" normalises with the source model's running statistics, frozen
    # (what a chip that folds BN into its weights computes); "batch" is ordinary train-mode BN.
    "backend": "float",
    "bn_stats": "batch",
    # torch.compile the model's multi-step forward in every stage (BPTT, BP-Subspace, SZO probes):
    # false | true (inductor) | a torch.compile backend name (e.g. aot_eager to debug); see
    # szo.models.compiled. Off by default (no GPU run has checked it yet); on CPU the compile
    # time is repaid after 500-2,500 Spike-ResNet20 but 20,000-60,000 digits forwards (docs/performance.md)
    "compile": False,
    # hw.arithmetic: integer arithmetic of backend fixed (szo: saturating; loihi: bit-exact with
    # Lava's PyLifModelBitAcc/PyDenseModelBitAcc); hw.reset: null keeps each LIF's reset, zero = standard Loihi LIF
    "hw": {"weight_bits": 8, "basis_bits": 8, "learner": "float", "coord_bits": 32, "coord_frac": 16,
           "ref_bits": 16, "arithmetic": "szo", "reset": None},
    # method tt-zo (szo.models.tt, szo.optim.tt): TT rank(s), cores per weight, which layers (weights
    # with >= min_params entries), the signRGE phase (seed 000: N = 10 directions, mu = 0.1) and the
    # switch to CGE (plateau over `window` steps by less than `tol`, or at switch_step); the CGE
    # phase takes szo.mu / szo.coords_per_step / train.lr / train.momentum
    "tt": {"rank": 4, "cores": 2, "min_params": 1024, "sign_lr": 1.0e-3, "sign_q": 10, "sign_mu": 0.1,
           "window": 20, "tol": 0.01, "switch_step": None},
    # multi-process runs (torchrun ... -m szo recipe NAME); ignored by one process
    "distributed": {"mode": "data", "sync_bn": True, "timeout_s": 300.0},
}

# type rules: key path -> (types, nullable)
_INT, _FLOAT, _BOOL, _STR = (int,), (float, int), (bool,), (str,)
_TYPES: dict[str, tuple[tuple[type, ...], bool]] = {
    "name": (_STR, False), "description": (_STR, False), "kind": (_STR, False), "mode": (_STR, False),
    "method": (_STR, False), "seed": (_INT, False), "device": (_STR, False), "progress": (_BOOL, False),
    "model.name": (_STR, False), "model.T": (_INT, True), "model.activation": (_STR, False),
    "model.bn_time": (_STR, False), "model.memory_format": (_STR, False), "szo.bn_update": (_STR, False),
    "data.name": (_STR, False), "data.data_dir": (_STR, True), "data.download": (_BOOL, False),
    "data.augment": (_BOOL, True), "data.batch_size": (_INT, False), "data.test_batch_size": (_INT, False),
    "data.num_workers": (_INT, False),
    "loss.name": (_STR, False), "loss.lamb": (_FLOAT, False), "loss.phi": (_FLOAT, False),
    "trajectory.every": ((str, int), False), "trajectory.record_initial": (_BOOL, False),
    "subspace.name": (_STR, True), "subspace.k": (_INT, False), "subspace.window": ((str, list), True),
    "subspace.reference": (_STR, False), "subspace.root": (_STR, True),
    "szo.mu": (_FLOAT, False), "szo.q": (_INT, False), "szo.coords_per_step": (_INT, True),
    "backend": (_STR, False), "bn_stats": (_STR, False), "compile": ((bool, str), False),
    "hw.weight_bits": (_INT, False), "hw.basis_bits": (_INT, True), "hw.learner": (_STR, False),
    "hw.coord_bits": (_INT, False), "hw.coord_frac": (_INT, False), "hw.ref_bits": (_INT, False),
    "hw.arithmetic": (_STR, False), "hw.reset": (_STR, True),
    "distributed.mode": (_STR, False), "distributed.sync_bn": (_BOOL, False), "distributed.timeout_s": (_FLOAT, False),
    "szo.time_chunk": (_INT, True), "szo.stream_bn": (_STR, False),
    "szo.engine": (_STR, False), "szo.chunk": (_INT, True),
    "tt.rank": ((int, list), False), "tt.cores": (_INT, False), "tt.min_params": (_INT, False),
    "tt.sign_lr": (_FLOAT, False), "tt.sign_q": (_INT, False), "tt.sign_mu": (_FLOAT, False),
    "tt.window": (_INT, False), "tt.tol": (_FLOAT, False), "tt.switch_step": (_INT, True),
    "szo.layers": ((list,), True),  # np-zo / wp-zo / awp-zo: layers to train (sparse), null = all
    "szo.stages": (_INT, True),  # asyncfgd: pipeline stages K, null = 2
}
for _s in ("bptt", "train"):
    _TYPES.update({
        f"{_s}.epochs": (_INT, False), f"{_s}.lr": (_FLOAT, _s == "train"), f"{_s}.momentum": (_FLOAT, False),
        f"{_s}.weight_decay": (_FLOAT, False), f"{_s}.scheduler": (_STR, False), f"{_s}.eval_every": (_INT, False),
        f"{_s}.max_steps_per_epoch": (_INT, True), f"{_s}.checkpoint_every_steps": (_INT, True),
    })
_POSITIVE = {"data.batch_size", "data.test_batch_size", "subspace.k", "szo.q", "szo.coords_per_step", "model.T",
             "szo.time_chunk", "szo.chunk", "szo.stages",
             "bptt.epochs", "train.epochs", "bptt.eval_every", "train.eval_every", "bptt.max_steps_per_epoch",
             "train.max_steps_per_epoch", "bptt.checkpoint_every_steps", "train.checkpoint_every_steps",
             "distributed.timeout_s", "tt.cores", "tt.min_params", "tt.sign_q", "tt.window"}


# ----------------------------------------------------------------------------- recipes
def _recipe_dir():
    return resources.files("szo._recipes")


def recipe_names() -> list[str]:
    """Names of the recipes shipped in the package (``szo._recipes/*.yaml``)."""
    return sorted(p.name[: -len(".yaml")] for p in _recipe_dir().iterdir() if p.name.endswith(".yaml"))


def recipe_path(name: str):
    """The shipped YAML of recipe ``name`` (an importlib.resources Traversable)."""
    if name not in recipe_names():
        raise ValueError(f"unknown recipe {name!r}; valid recipes: {', '.join(recipe_names())}")
    return _recipe_dir() / f"{name}.yaml"


def _read_yaml(text: str, where: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{where}: invalid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a recipe must be a YAML mapping, got {type(data).__name__}")
    return data


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _raw_recipe(name_or_path: str | os.PathLike, _seen: tuple[str, ...] = ()) -> dict[str, Any]:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        data, key = _read_yaml(p.read_text(encoding="utf-8"), str(p)), str(p.resolve())
    else:
        name = str(name_or_path)
        data, key = _read_yaml(recipe_path(name).read_text(encoding="utf-8"), f"recipe {name}"), name
        data.setdefault("name", name)
    if key in _seen:
        raise ValueError(f"recipe 'extends' cycle: {' -> '.join(_seen + (key,))}")
    base = data.pop("extends", None)
    if base is not None:
        parent = _raw_recipe(base, _seen + (key,))
        parent.pop("name", None)
        parent.pop("description", None)
        data = _deep_merge(parent, data)
    return data


# ----------------------------------------------------------------------------- overrides
def parse_override(item: str) -> tuple[str, Any]:
    """``"a.b=value"`` -> ``("a.b", yaml.safe_load(value))``."""
    if "=" not in item:
        raise ValueError(f"--set expects key=value (e.g. train.epochs=3), got {item!r}")
    key, _, text = item.partition("=")
    key = key.strip()
    if not key:
        raise ValueError(f"--set expects key=value, got {item!r}")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    return key, value


def _defaults(kind: Any) -> dict[str, Any]:
    if kind not in KINDS:
        raise ValueError(f"invalid kind {kind!r}; valid: {', '.join(KINDS)}")
    if kind in EXTERNAL_KINDS:
        return {**DEFAULTS, **EXTERNAL_KINDS[kind][3]}
    return DEFAULTS


def _get(tree: Mapping[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        node = node[part]
    return node


def _check_key(dotted: str, defaults: Mapping[str, Any] = DEFAULTS) -> None:
    parts = dotted.split(".")
    node: Any = defaults
    for i, part in enumerate(parts):
        if node is _FREE:
            return
        if not isinstance(node, dict) or part not in node:
            parent = ".".join(parts[:i])
            if isinstance(node, dict):
                where = f"under '{parent}'" if parent else "at the top level"
                raise ValueError(f"unknown key '{dotted}'; valid keys {where}: {', '.join(node)}")
            raise ValueError(f"unknown key '{dotted}': '{parent}' is a value, not a section")
        node = node[part]


def apply_overrides(cfg: dict[str, Any], overrides: Iterable[str | tuple[str, Any]]) -> dict[str, Any]:
    """A copy of ``cfg`` with ``key=value`` overrides applied (keys checked against DEFAULTS)."""
    cfg = copy.deepcopy(cfg)
    items = [parse_override(i) if isinstance(i, str) else i for i in overrides]
    kind = dict(items).get("kind", cfg.get("kind", DEFAULTS["kind"]))
    defaults = _defaults(kind)
    for key, value in items:
        _check_key(key, defaults)
        parts = key.split(".")
        node = cfg
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    return cfg


# ----------------------------------------------------------------------------- validation
def _fill(defaults: Mapping[str, Any], given: Mapping[str, Any], prefix: str = "",
          root: Mapping[str, Any] = DEFAULTS) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in given.items():
        _check_key(prefix + k, root)
    for k, d in defaults.items():
        if d is _FREE:
            v = given.get(k) or {}
            if not isinstance(v, dict):
                raise ValueError(f"'{prefix + k}' must be a mapping, got {v!r}")
            out[k] = copy.deepcopy(v)
        elif isinstance(d, dict):
            v = given.get(k) or {}
            if not isinstance(v, dict):
                raise ValueError(f"'{prefix + k}' must be a section (mapping) with keys {', '.join(d)}, got {v!r}")
            out[k] = _fill(d, v, prefix + k + ".", root)
        else:
            out[k] = copy.deepcopy(given.get(k, d))
    return out


def _choice(cfg: Mapping[str, Any], key: str, valid: Iterable[str]) -> None:
    valid = list(valid)
    v = _get(cfg, key)
    if v not in valid:
        raise ValueError(f"invalid {key} {v!r}; valid: {', '.join(map(str, valid))}")


def validate(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Fill defaults, check every key, type and choice; returns the full config."""
    kind = cfg.get("kind", DEFAULTS["kind"])
    root = _defaults(kind)
    full = _fill(root, cfg, root=root)
    for key, (types, nullable) in _TYPES.items():
        v = _get(full, key)
        if v is None:
            if nullable:
                continue
            raise ValueError(f"'{key}' must be set (got null)")
        if float in types and isinstance(v, str):  # YAML 1.1 reads 1e-4 as a string
            try:
                v = float(v)
            except ValueError:
                raise ValueError(f"'{key}' must be a number, got {v!r}") from None
        if isinstance(v, bool) and bool not in types:
            raise ValueError(f"'{key}' must be {'/'.join(t.__name__ for t in types)}, got {v!r}")
        if not isinstance(v, types):
            raise ValueError(f"'{key}' must be {'/'.join(t.__name__ for t in types)}, got {v!r}")
        if float in types:
            v = float(v)
        if key in _POSITIVE and v < 1:
            raise ValueError(f"'{key}' must be >= 1, got {v!r}")
        sec, _, leaf = key.rpartition(".")
        (_get(full, sec) if sec else full)[leaf] = v
    from szo import data as szo_data
    from szo import models as szo_models
    from szo.engine import ENGINES
    from szo.losses import LOSSES
    from szo.models.neurons import ACTIVATIONS

    _choice(full, "mode", MODES)
    if kind not in EXTERNAL_KINDS:
        _choice(full, "method", list_methods())
    dev = full["device"]
    if not (dev in DEVICES or (isinstance(dev, str) and dev.startswith("cuda:") and dev[5:].isdigit())):
        raise ValueError(f"invalid device {dev!r}; valid: cpu, cuda, cuda:N")
    _choice(full, "model.name", szo_models.names())
    _choice(full, "model.activation", ACTIVATIONS)
    _choice(full, "data.name", szo_data.names())
    _choice(full, "loss.name", list(LOSSES))
    _choice(full, "bptt.scheduler", SCHEDULERS)
    _choice(full, "train.scheduler", SCHEDULERS)
    _choice(full, "subspace.reference", REFERENCES)
    _choice(full, "distributed.mode", DIST_MODES)
    from szo.models.streaming import STREAM_BN_MODES

    from szo.models.base import MEMORY_FORMATS
    from szo.models.streaming import BN_TIMES
    from szo.zo.bn import BN_UPDATES

    _choice(full, "szo.stream_bn", STREAM_BN_MODES)
    _choice(full, "szo.engine", ENGINES)
    _choice(full, "szo.bn_update", BN_UPDATES)
    _choice(full, "model.bn_time", BN_TIMES)
    _choice(full, "model.memory_format", MEMORY_FORMATS)
    ev = full["trajectory"]["every"]
    if ev != "epoch" and (isinstance(ev, str) or ev < 1):
        raise ValueError(f"invalid trajectory.every {ev!r}; valid: 'epoch' or a positive int (steps)")
    for s in ("bptt", "train"):
        if not 0.0 <= full[s]["momentum"] < 1.0:
            raise ValueError(f"'{s}.momentum' must be in [0, 1), got {full[s]['momentum']}")
    if not 0.0 <= full["loss"]["lamb"] <= 1.0:
        raise ValueError(f"'loss.lamb' must be in [0, 1], got {full['loss']['lamb']}")
    if full["szo"]["mu"] <= 0:
        raise ValueError(f"'szo.mu' must be > 0, got {full['szo']['mu']}")
    if full["subspace"]["name"] is None and (full["kind"] == "subspace"):
        raise ValueError("a subspace recipe needs 'subspace.name' (the store entry to train in)")
    if kind in EXTERNAL_KINDS:
        import importlib

        mod, resolve_fn, _, _ = EXTERNAL_KINDS[kind]
        return getattr(importlib.import_module(mod), resolve_fn)(full)
    if full["kind"] == "subspace":
        _check_method_options(full)
    _check_hw(full)
    _check_compile(full)
    if full["mode"] == "continual" and full["subspace"]["reference"] != "last":
        raise ValueError("continual recipes start from the pretrained model: subspace.reference must be 'last'")
    return full


def _check_method_options(full: Mapping[str, Any]) -> None:
    """Options of the subspace stage that only some methods take (their ``szo.methods`` record),
    checked before anything runs: a recipe must not fail after its BPTT stage on a combination
    known up front."""
    method, sz = full["method"], full["szo"]
    spec = get_method(method)
    if full["train"]["weight_decay"] and not spec.weight_decay:
        raise ValueError(f"method {method!r} uses no weight decay (paper App. G / its seed paper); "
                         "set train.weight_decay=0")
    if full["train"]["momentum"] and not spec.momentum:
        raise ValueError(f"method {method!r} takes no momentum (seed 001 Algorithm 1 / seed 004 eq. 8: plain "
                         f"steps); set train.momentum=0 (got {full['train']['momentum']})")
    if sz["time_chunk"] is not None and not spec.streaming:
        why = ("backpropagates" if spec.backprop else "takes forward-mode derivatives" if spec.jvp
               else "perturbs layer outputs over all T steps at once")
        raise ValueError(f"'szo.time_chunk' (streaming forward) applies to forward-only methods; method "
                         f"{method!r} {why}; valid methods with szo.time_chunk: "
                         f"{', '.join(list_methods(streaming=True))}")
    if sz["engine"] not in spec.engines:
        raise ValueError(f"szo.engine {sz['engine']!r} evaluates SZO probe plans; method {method!r} runs with "
                         f"engine 'loop'; valid methods for it: {', '.join(list_methods(engines=sz['engine']))}")
    tt = full["tt"]
    if not (tt["sign_mu"] > 0 and tt["sign_lr"] >= 0 and tt["tol"] >= 0):
        raise ValueError(f"tt.sign_mu must be > 0 and tt.sign_lr, tt.tol >= 0; got sign_mu={tt['sign_mu']}, "
                         f"sign_lr={tt['sign_lr']}, tol={tt['tol']}")
    for key, what in (("layers", "sparse layer-wise training"), ("stages", "pipeline stages")):
        if sz[key] is not None and key not in spec.options:
            raise ValueError(f"'szo.{key}' ({what}) applies to {which_methods(options=key)}; method {method!r} takes none: "
                             f"leave szo.{key} null")
    if sz["chunk"] is not None and sz["engine"] != "batched":
        raise ValueError("'szo.chunk' (copies per folded forward) applies to szo.engine 'batched'; "
                         "set szo.engine=batched or leave szo.chunk null")


def _check_compile(full: Mapping[str, Any]) -> None:
    """``compile``: a bool or a torch.compile backend; not with the paths that bypass the model's
    own multi-step forward (batched engine, streaming forward, integer backend)."""
    c = full["compile"]
    if c is False:
        return
    from szo.models.compiled import check_compile

    check_compile("inductor" if c is True else c)
    sz = full["szo"]
    for bad, what in ((sz["engine"] != "loop", "szo.engine 'batched' (it folds the probes itself): use 'loop'"),
                      (sz["time_chunk"] is not None, "szo.time_chunk (the streaming forward runs eagerly): set it to null"),
                      (full["backend"] != "float", "backend 'fixed' (the integer forward): use backend 'float'")):
        if bad:
            raise ValueError(f"compile={c!r} compiles the model's multi-step forward and cannot be combined with {what}")


def _check_hw(full: Mapping[str, Any]) -> None:
    """Backend / BN-statistics / fixed-point learner choices and the combinations that make sense."""
    _choice(full, "backend", BACKENDS)
    _choice(full, "bn_stats", BN_STATS)
    _choice(full, "hw.learner", HW_LEARNERS)
    _choice(full, "hw.arithmetic", HW_ARITHMETICS)
    hw = full["hw"]
    if hw["reset"] is not None:
        _choice(full, "hw.reset", HW_RESETS)
    if full["backend"] != "fixed" and (hw["arithmetic"] != "szo" or hw["reset"] is not None):
        raise ValueError("hw.arithmetic / hw.reset choose the integer arithmetic of backend 'fixed'; with backend "
                         f"{full['backend']!r} leave them at 'szo' / null")
    for key in ("weight_bits", "basis_bits"):
        if hw[key] is not None and not 2 <= hw[key] <= 16:
            raise ValueError(f"'hw.{key}' must be an int in [2, 16] (e.g. 8 or 4){' or null' if key == 'basis_bits' else ''}, "
                             f"got {hw[key]!r}")
    if not 8 <= hw["coord_bits"] <= 48 or not 0 <= hw["coord_frac"] < hw["coord_bits"]:
        raise ValueError(f"need 8 <= hw.coord_bits <= 48 and 0 <= hw.coord_frac < hw.coord_bits, "
                         f"got {hw['coord_bits']}, {hw['coord_frac']}")
    if full["backend"] == "fixed":
        if full["kind"] != "subspace":
            raise ValueError("backend 'fixed' applies to the subspace stage (kind: subspace); "
                             "BPTT needs float gradients: run it with backend 'float'")
        if full["bn_stats"] != "deployed":
            raise ValueError("backend 'fixed' folds BatchNorm into the weights with fixed running statistics, "
                             "so it needs bn_stats 'deployed' (valid for fixed: deployed)")
        if not get_method(full["method"]).fixed_backend:
            raise ValueError(f"backend 'fixed' runs forward-only SZO; got method {full['method']!r}; "
                             f"valid: {', '.join(list_methods(fixed_backend=True))}")
        if full["szo"]["engine"] != "loop":
            raise ValueError("backend 'fixed' evaluates probes one integer forward at a time; "
                             "valid szo.engine for it: loop")
        if full["szo"]["time_chunk"] is not None:
            raise ValueError("backend 'fixed' runs its own integer forward over all T steps; "
                             "szo.time_chunk applies to backend 'float' (set it to null)")
    spec = get_method(full["method"]) if full["method"] in list_methods() else None
    if spec is not None and spec.integer and hw["learner"] != "integer":
        raise ValueError(f"method {full['method']!r} (seed-004 quantized ZO) is an integer learner on the "
                         "fixed-point forward: set backend=fixed, bn_stats=deployed and hw.learner=integer "
                         "(recipe digits-fixed does)")
    if hw["learner"] == "integer" and (full["backend"] != "fixed" or spec is None or not spec.integer_learner):
        raise ValueError("hw.learner 'integer' (on-chip integer state, seed-004 Rademacher for szo-rge) needs "
                         f"backend 'fixed' and a method in: {', '.join(list_methods(integer_learner=True))}")
    if full["bn_stats"] == "deployed" and full["kind"] != "subspace":
        raise ValueError("bn_stats 'deployed' applies to the subspace stage (kind: subspace); valid here: batch")


def resolve(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``validate`` plus defaults that depend on other values (``train.lr: null`` -> the method's
    default: its record's ``train.lr`` (1e-3 for fg / asyncfgd / tt-zo, their seed papers), else
    ``bptt.lr`` for a backprop method without a subspace (full-space BP), else 1.0 (paper App. G))."""
    full = validate(cfg)
    if full["kind"] in EXTERNAL_KINDS:
        return full
    if full["train"]["lr"] is None:
        spec = get_method(full["method"])
        default = full["bptt"]["lr"] if spec.backprop and not spec.subspace else 1.0
        full["train"]["lr"] = spec.defaults.get("train.lr", default)
    return full


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
    return _deep_merge(raw, per.get(method, {}))


def load_recipe(name_or_path: str | os.PathLike, overrides: Iterable[str | tuple[str, Any]] = ()) -> dict[str, Any]:
    """Shipped recipe name or a YAML path, ``extends`` resolved, the chosen method's
    ``method_defaults`` merged, overrides applied, validated, resolved."""
    items = [parse_override(i) if isinstance(i, str) else i for i in overrides]
    raw = _apply_method_defaults(_raw_recipe(name_or_path), items)
    return resolve(apply_overrides(raw, items))


load_config = load_recipe


def write_config(cfg: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Write the resolved config as YAML (atomically)."""
    atomic_write_text(path, yaml.safe_dump(dict(cfg), sort_keys=False, default_flow_style=False))
