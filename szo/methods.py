"""The method registry: one record per method, the one table everything else reads.

Config validation (``szo.config``), the optimizer factory (``szo.optim.build_optimizer``), the
pipeline, the report's labels, the test-time-adaptation and DVS demos and ``szo recipe --list``
read :class:`MethodSpec` records from here (``get_method``, ``list_methods``); no other module
keeps a list of method names or branches on one. A record says what the method is (label,
family, forwards per step), what it needs (a stored subspace, backprop, forward-mode AD, the
integer backend), what it can run with (engines, torchrun modes, the streaming forward, the
fixed-point backend) and its recipe defaults. The optimizer builders live next to the
optimizers and are attached with :func:`register_builder` (``szo.optim`` imports all of them).

Adding a method = one module (its optimizer, composed from ``szo.zo``, and a builder decorated
with ``@register_builder("name")``) + one :func:`register_method` record below.

No torch import here: the registry is read by tools that never train.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

__all__ = [
    "MethodSpec", "Family", "register_method", "register_builder", "get_method", "list_methods", "method_label",
    "which_methods", "shared_scale", "shared_mu", "check_scale", "step_defaults",
    "METHODS", "SUBSPACE_METHODS", "SZO_METHODS", "BACKPROP_METHODS", "FORWARD_ONLY_METHODS", "FG_METHODS",
    "DISTRIBUTED_METHODS", "ENGINE_METHODS", "STREAMING_METHODS", "FIXED_BACKEND_METHODS",
    "INTEGER_LEARNER_METHODS", "LAYERWISE_METHODS", "QZO_METHODS", "TTA_METHODS", "TTA_SUBSPACE_METHODS",
    "NO_ADAPTATION", "RENAMED", "current_name", "METHOD_OPTIONS",
]

NO_ADAPTATION = "none"
"""The test-time "method" that does not adapt (the source model as it is)."""

Family = Literal["backprop", "subspace-zo", "full-space-zo", "forward-gradient", "tensor-train-zo", "layer-wise-zo",
                 "on-chip", "test-time"]
Engine = Literal["loop", "batched"]
ParallelMode = Literal["data", "perturbation"]


METHOD_OPTIONS: Mapping[str, tuple[Any, str]] = {
    "coords_per_step": (None, "coordinates per CGE step"),
    "layers": (None, "sparse layer-wise training"),
    "stages": (None, "pipeline stages"),
    "node_losses": ("per-sample", "node perturbation's loss differences"),
    "refresh": (None, "steps between redraws of a random subspace"),
    "rank": (None, "rank r of each layer's low-rank perturbation"),
}
"""The method-specific settings (``szo.*`` keys, ``build_optimizer`` keywords): name -> (the value
that means "not set", what it is). A method takes those its record lists in ``options``; any
other one set is refused by :meth:`MethodSpec.check_options`, never silently ignored."""


@dataclass(frozen=True)
class MethodSpec:
    """What one method is and what it can run with.

    * ``forwards``: forwards per step as a formula (k: subspace dimension, q: directions, L:
      perturbed layers, n: coordinates per step; ``+ 1``: the unperturbed BN forward under
      ``bn_update="recompute"`` when BN layers train);
    * ``subspace``: trains in a stored trajectory subspace (``build_optimizer(subspace=...)``);
      ``backprop``: runs ``backward`` (1 FP + 1 BP per step); ``jvp``: forward-mode AD passes;
      ``integer``: the integer on-chip learner (backend fixed, ``hw.learner: integer``);
    * ``engines`` / ``parallel``: probe evaluators it can use (``szo.evaluators``) and torchrun modes;
      ``streaming``: ``szo.time_chunk`` allowed; ``fixed_backend``: trains through the
      fixed-point forward; ``integer_learner``: ``hw.learner: integer`` allowed; ``block_selection``:
      ``hw.blocks`` (seed 004's BP-free choice of the one trained block) allowed;
    * ``hooks``: drives layers through forward hooks at every forward (the layer-wise methods' clean
      forward and node perturbation, the integer learner's accumulator hooks): a replayed CUDA graph or a
      compiled forward would skip them, so ``szo.zo.ProbePath`` refuses both with it;
    * ``weight_decay`` / ``momentum``: whether the method takes them; ``options``: the
      method-specific ``szo.*`` keys it reads (``layers``, ``stages``, ``coords_per_step``);
    * ``variant``: what the family's optimizer is told (the estimator of an SZO / full-space ZO
      method, the perturbation of a layer-wise one);
    * ``q_labeled``: its label carries ``(q=...)``; ``trainable``: a ``kind: subspace`` recipe
      method (False: a test-time adaptation method only); ``adapter``: the kind of test-time
      adapter that runs it (``szo.adapt``: source, batch-statistics, tent, subspace-gradient,
      subspace-zo), None if it does not adapt;
    * ``defaults``: recipe values that hold for this method unless the recipe sets them
      (dotted keys, e.g. ``{"train.lr": 1e-3}``);
    * ``relative``: its recipe defaults under ``szo.scale: trajectory`` (``szo.mu``: the probe's length,
      ``train.lr``: the first step's length, both in units of the subspace's spread; ``szo.zo.scale``),
      ``trajectory`` is then its default scale (:meth:`default_scale`); None: its mu / lr are absolute
      only (``szo.scale: absolute``).
    """

    name: str
    label: str
    family: Family
    forwards: str
    subspace: bool = False
    backprop: bool = False
    jvp: bool = False
    integer: bool = False
    engines: tuple[Engine, ...] = ("loop",)
    parallel: tuple[ParallelMode, ...] = ()
    streaming: bool = False
    fixed_backend: bool = False
    integer_learner: bool = False
    block_selection: bool = False
    hooks: bool = False
    weight_decay: bool = False
    momentum: bool = True
    options: tuple[str, ...] = ()
    variant: str | None = None
    q_labeled: bool = False
    trainable: bool = True
    adapter: str | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    relative: Mapping[str, Any] | None = None

    @property
    def forward_only(self) -> bool:
        return not self.backprop

    @property
    def adapts(self) -> bool:
        """A test-time adaptation method (``szo.adapt``)."""
        return self.adapter is not None

    def default_scale(self, *, integer: bool = False) -> str:
        """``szo.scale`` where none is set: ``trajectory`` for a method with relative defaults trained
        by the float learner (measured on digits, mnist5k and Fashion-MNIST: docs/evidence.md,
        "Scale-free mu and lr"), ``absolute`` for every other method and for the integer on-chip
        learner (``integer``), whose units are its own."""
        return "trajectory" if self.relative is not None and not integer else "absolute"

    def check_scale(self, scale: str | None, *, integer: bool = False, recipe: bool = False) -> None:
        """This method's rule on a relative ``scale`` (:func:`check_scale` for one method): the
        recipe's ``szo.scale`` and ``build_optimizer(scale=...)`` both call it."""
        check_scale([self.name], scale, integer=integer, recipe=recipe)

    def check_learner(self, *, integer: bool, refresh: int | None = None, recipe: bool = False) -> None:
        """The integer on-chip learner's rules, one home for every door (the recipe's ``hw.learner``
        checked by ``szo.config``, ``build_optimizer(integer=...)``): an integer method (seed 004's
        quantized ZO) trains only with it; it trains only the methods whose record says
        ``integer_learner``; it keeps its quantised basis, so no ``refresh``. ``recipe``: the keys as a
        recipe spells them (``hw.learner integer``, ``szo.refresh``, ``null``); otherwise as
        ``build_optimizer``'s keywords (``integer=``, ``refresh``, ``None``)."""
        learner = "hw.learner integer" if recipe else "integer="
        if self.integer and not integer:  # build_optimizer gives such a method its learner itself
            raise ValueError(f"method {self.name!r} (seed-004 quantized ZO) is an integer learner on the fixed-point "
                             "forward: set backend=fixed, bn_stats=deployed and hw.learner=integer (recipe "
                             "digits-fixed does)")
        if integer and not self.integer_learner:
            raise ValueError(f"the integer on-chip learner ({learner}) trains "
                             f"{', '.join(list_methods(integer_learner=True))}; method {self.name!r} has none")
        if integer and refresh is not None:
            key = "szo.refresh" if recipe else "refresh"
            raise ValueError(f"{key} (a redrawn random basis) is a setting of the float SZO; the integer on-chip "
                             f"learner keeps its quantised basis: leave {key} {'null' if recipe else 'None'}")

    def default_mu(self, scale: str) -> float:
        """``mu`` where none is set: under a relative ``scale`` the record's relative ``szo.mu``, else
        1.0 (the paper's App. G, absolute)."""
        if scale != "absolute" and self.relative and "szo.mu" in self.relative:
            return float(self.relative["szo.mu"])
        if "szo.mu" in self.defaults:  # the method's own paper (SubZero / LOZO: 1e-3)
            return float(self.defaults["szo.mu"])
        return 1.0

    def default_lr(self, scale: str) -> float | None:
        """``lr`` where none is set: under a relative ``scale`` the record's relative ``train.lr``, else
        the record's own ``train.lr`` (1e-3 for fg / asyncfgd / tt-zo, their seed papers), else 1.0 (App.
        G) for a method that does not backpropagate through the whole network; None for full-space
        backprop, whose step is the BPTT run's (``bptt.lr``)."""
        if scale != "absolute" and self.relative and "train.lr" in self.relative:
            return float(self.relative["train.lr"])
        if "train.lr" in self.defaults:
            return float(self.defaults["train.lr"])
        return None if self.backprop and not self.subspace else 1.0

    def check_options(self, values: Mapping[str, Any], *, prefix: str = "") -> None:
        """One rule for the method-specific settings (:data:`METHOD_OPTIONS`): each one in ``values``
        that is set (not its "not set" value) must be one this method reads (``options``); one
        ValueError naming the setting, the methods that take it and how to leave it otherwise.
        ``prefix`` is how the caller spells the key (``"szo."`` for a recipe)."""
        for key, (unset, what) in METHOD_OPTIONS.items():
            if key in values and values[key] != unset and key not in self.options:
                raise ValueError(f"'{prefix}{key}' ({what}) applies to {which_methods(options=key)}; method "
                                 f"{self.name!r} does not use it: leave {prefix}{key} "
                                 f"{'null' if unset is None else unset}")

    def check_capabilities(self, *, weight_decay: float = 0.0, momentum: float = 0.0, recipe: bool = False) -> None:
        """The registry's rules on what this method's update takes -- weight decay, momentum -- one
        message each, for config validation (``recipe``: the keys spelled as a recipe spells them,
        ``train.``) and ``build_optimizer`` alike. What it runs with (engines, torchrun modes, the
        streaming forward, the integer backend, hooks) is a rule of the probe path: ``szo.zo.ProbePath``."""
        train = "train." if recipe else ""
        if weight_decay and not self.weight_decay:
            raise ValueError(f"method {self.name!r} uses no weight decay (paper App. G / its seed paper); set "
                             f"{train}weight_decay=0 (got {weight_decay})")
        if momentum and not self.momentum:
            raise ValueError(f"method {self.name!r} takes no momentum (seed 001 Algorithm 1 / seed 004 eq. 8: plain "
                             f"steps); set {train}momentum=0 (got {momentum})")

    def builder(self, integer: bool = False) -> Callable[..., Any]:
        """The optimizer factory ``builder(spec, model, subspace, options, run)`` (``szo.optim``):
        the float one, or (``integer``, always for an ``integer`` method) the integer on-chip learner's."""
        try:
            return _BUILDERS[(self.name, integer or self.integer)]
        except KeyError:
            what = "integer on-chip learner" if integer or self.integer else "optimizer builder"
            raise ValueError(f"method {self.name!r} has no {what} registered; import szo.optim "
                             "(it registers every builder)") from None


RENAMED: Mapping[str, str] = {"qzo": "qzo-subspace"}
"""Earlier method names -> today's (a checkpoint or results file written under the old name is the
same method): ``qzo`` was seed 004's eq. 8 on SZO's subspace coordinates before ``mcu-zo`` (seed
004's own learner on the int8 weights) existed."""


def current_name(name: str) -> str:
    """Today's name of a method named ``name`` by an earlier version (itself if not renamed)."""
    return RENAMED.get(name, name)


_REGISTRY: dict[str, MethodSpec] = {}
_BUILDERS: dict[tuple[str, bool], Callable[..., Any]] = {}


def register_method(spec: MethodSpec) -> MethodSpec:
    """Add ``spec`` to the registry (one name, one record)."""
    if spec.name in _REGISTRY:
        raise ValueError(f"method {spec.name!r} is registered already")
    unknown = sorted(set(spec.options) - set(METHOD_OPTIONS))
    if unknown:
        raise ValueError(f"method {spec.name!r}: unknown option(s) {', '.join(unknown)}; "
                         f"valid: {', '.join(METHOD_OPTIONS)}")
    _REGISTRY[spec.name] = spec
    return spec


def register_builder(*names: str, integer: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: ``fn`` builds the optimizer of the registered methods ``names`` (``integer``:
    their integer on-chip learner)."""
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        for n in names:
            get_method(n)
            _BUILDERS[(n, integer)] = fn
        return fn
    return deco


def list_methods(*, trainable: bool | None = True, **capabilities: Any) -> tuple[str, ...]:
    """Registered method names (registry order) whose record has every given field value, e.g.
    ``list_methods(subspace=True)``; ``trainable=None``: test-time adaptation methods too."""
    out = []
    for spec in _REGISTRY.values():
        if trainable is not None and spec.trainable != trainable:
            continue
        if all(_matches(getattr(spec, k), v) for k, v in capabilities.items()):
            out.append(spec.name)
    return tuple(out)


def _matches(have: Any, want: Any) -> bool:
    if callable(want):
        return bool(want(have))
    if isinstance(have, tuple) and not isinstance(want, tuple):
        return want in have  # e.g. engines="batched", parallel="data"
    return have == want


def which_methods(**capabilities: Any) -> str:
    """``"method 'asyncfgd'"`` / ``"methods 'np-zo', 'wp-zo'"``: the methods with these record
    values, for an error message that says which methods take a setting."""
    names = list_methods(**capabilities)
    return f"method {names[0]!r}" if len(names) == 1 else f"methods {', '.join(map(repr, names))}"


def shared_scale(names: Any, *, integer: bool = False) -> str:
    """The default ``szo.scale`` of methods that run under one setting (a test-time adaptation run's
    subspace methods): ``trajectory`` where it is every one's default (:meth:`MethodSpec.default_scale`),
    else ``absolute``. The recipe (kind tta), ``szo adapt`` and ``run_tta`` read it."""
    specs = [get_method(n, trainable=None) for n in names]
    return "trajectory" if specs and {s.default_scale(integer=integer) for s in specs} == {"trajectory"} else "absolute"


def check_scale(names: Any, scale: str | None, *, integer: bool = False, recipe: bool = False) -> None:
    """The one rule on a relative ``scale`` (``szo.zo.scale``) for methods that run under one setting
    (one trained method, or a test-time adaptation run's subspace methods): it applies only where it
    is every one's default (:func:`shared_scale`: each has relative defaults in its record and the
    learner is the float one). One ValueError naming why and what to set; ``recipe``: the key as a
    recipe spells it (``szo.scale``, ``null``). ``None`` and ``"absolute"`` always pass. The recipe
    (``szo.config``), ``build_optimizer`` and ``run_tta`` call it."""
    if scale is None or scale == "absolute" or shared_scale(names, integer=integer) == "trajectory":
        return
    specs = [get_method(n, trainable=None) for n in names]
    key = "szo.scale" if recipe else "scale"
    bare = [s.name for s in specs if s.relative is None]
    if bare:
        why = (f"{'method' if len(bare) == 1 else 'methods'} {', '.join(map(repr, bare))} "
               f"{'has' if len(bare) == 1 else 'have'} no relative defaults; relative scales apply to ")
    elif integer and specs:
        why = (f"the integer on-chip learner ({'hw.learner integer' if recipe else 'integer='}) keeps its own "
               "units; relative scales apply to ")
    else:
        why = "relative scales apply to "
    why += which_methods(trainable=None, relative=lambda r: r is not None)
    raise ValueError(f"{key} {scale!r} (mu / lr in units of the subspace) does not apply here: {why}; use {key} "
                     f"absolute (or leave it {'null' if recipe else 'unset'}: the method's default)")


def shared_mu(names: Any, scale: str) -> float:
    """The default ``mu`` of those methods under ``scale``: the forward-only ones' common
    :meth:`MethodSpec.default_mu`, App. G's 1.0 where they disagree or none probes."""
    mus = {s.default_mu(scale) for s in (get_method(n, trainable=None) for n in names) if s.forward_only}
    return mus.pop() if len(mus) == 1 else 1.0


def step_defaults(names: Any, scale: str | None = None, mu: float | None = None, lr: float | None = None, *,
                  integer: bool = False) -> tuple[str, float, float | None]:
    """``(scale, mu, lr)`` with those left None filled by the defaults of methods ``names`` (one method:
    its record's; an optimizer that several records build, such as ``SZO`` for a custom estimator, their
    common ones): ``scale`` the methods' shared default (:func:`shared_scale`: ``trajectory`` for the
    subspace methods with relative defaults on the float learner), ``mu`` / ``lr`` the scale's
    (:meth:`MethodSpec.default_mu` / :meth:`~MethodSpec.default_lr`: the scale-free 0.3 / 0.03 of the
    subspace's spread under a relative scale, the paper's 1.0 / 1.0 under ``absolute``, App. G). The one
    place a default step is chosen: ``SZO(...)``, ``BPSubspace(...)``, ``build_optimizer`` and a
    recipe's ``resolve`` all call it; ``lr`` None is left None where the methods' steps differ or they
    have none (full-space backprop: ``bptt.lr``)."""
    if scale is None:
        scale = shared_scale(names, integer=integer)
    if mu is None:
        mu = shared_mu(names, scale)
    if lr is None:
        lrs = {get_method(n, trainable=None).default_lr(scale) for n in names}
        lr = lrs.pop() if len(lrs) == 1 else None
    return scale, mu, lr


def get_method(name: str, *, trainable: bool | None = None) -> MethodSpec:
    """The record of ``name``; one ValueError listing the valid names otherwise."""
    spec = _REGISTRY.get(name) if isinstance(name, str) else None
    if spec is None or (trainable is not None and spec.trainable != trainable):
        valid = list_methods(trainable=trainable)
        raise ValueError(f"unknown method {name!r}; valid: {', '.join(valid)}")
    return spec


def method_label(method: str, q: int | None = None, activation: str = "lif", *, q_sep: str = "") -> str:
    """The paper-style name of a method: ``SZO-RGE(q=1)``, ``BP-Subspace``; ``(ANN)`` for ReLU
    twins; ``q_sep=" "`` gives the adaptation tables' ``SZO-RGE (q=10)``. Unknown names are
    returned as they are (a results file of another version)."""
    spec = _REGISTRY.get(method)
    label = spec.label if spec is not None else str(method)
    if spec is not None and spec.q_labeled and q is not None:
        label += f"{q_sep}(q={q})"
    if activation == "relu":
        label += " (ANN)"
    return label


# ---------------------------------------------------------------------- the records
_FO = dict(streaming=True)  # forward-only, single-evaluation probes: the streaming forward applies
# szo.scale trajectory / whitened (szo.zo.scale): a probe of 0.3 sigma, a first step of 0.03 sigma (sigma: the
# subspace's spread; TTA continual a tenth), one setting for every subspace method, chosen once on digits and
# measured on digits, mnist5k and Fashion-MNIST (docs/evidence.md, "Scale-free mu and lr"); trajectory is
# then these methods' default scale (MethodSpec.default_scale)
_REL = {"szo.mu": 0.3, "train.lr": 0.03}
LOWRANK_LR = 1.0e-3
# The one-point estimators take the same setting: no smaller mu carries over (docs/evidence.md, "Scale-free
# mu and lr", the one-point paragraph)
for _spec in (
    # test-time adaptation only (szo.adapt): no recipe trains with them
    MethodSpec(NO_ADAPTATION, "No adapt.", "test-time", "1", trainable=False, adapter="source"),
    MethodSpec("bn", "BN", "test-time", "1", trainable=False, adapter="batch-statistics"),
    MethodSpec("tent", "Tent (BP)", "test-time", "1 FP + 1 BP", backprop=True, trainable=False, adapter="tent"),
    MethodSpec("bp", "BP", "backprop", "1 FP + 1 BP", backprop=True, weight_decay=True),
    MethodSpec("bp-subspace", "BP-Subspace", "backprop", "1 FP + 1 BP", subspace=True, backprop=True,
               adapter="subspace-gradient", relative={"train.lr": _REL["train.lr"]}),
    MethodSpec("szo-cge", "SZO-CGE", "subspace-zo", "2k + 1", subspace=True, engines=("loop", "batched"),
               parallel=("data", "perturbation"), fixed_backend=True, integer_learner=True, adapter="subspace-zo", variant="cge",
               options=("refresh",), relative=_REL, **_FO),
    MethodSpec("szo-rge", "SZO-RGE", "subspace-zo", "2q + 1", subspace=True, engines=("loop", "batched"),
               parallel=("data", "perturbation"), fixed_backend=True, integer_learner=True, q_labeled=True,
               adapter="subspace-zo", variant="rge", options=("refresh",), relative=_REL, **_FO),
    MethodSpec("szo-1pt", "SZO-1pt", "subspace-zo", "q + 1 + 1", subspace=True, engines=("loop", "batched"),
               parallel=("data", "perturbation"), fixed_backend=True, q_labeled=True, variant="one-point",
               options=("refresh",), relative=_REL, **_FO),
    MethodSpec("szo-cge-1pt", "SZO-CGE (one-point)", "subspace-zo", "k + 1 + 1", subspace=True,
               engines=("loop", "batched"), parallel=("data", "perturbation"), fixed_backend=True,
               variant="coord-one-point", options=("refresh",), relative=_REL, **_FO),
    MethodSpec("zo-cge", "ZO-CGE", "full-space-zo", "2n + 1", options=("coords_per_step",), variant="cge", **_FO),
    MethodSpec("zo-rge", "ZO-RGE", "full-space-zo", "2q + 1", q_labeled=True, variant="rge", **_FO),
    MethodSpec("fg", "FG", "forward-gradient", "q (JVP passes)", jvp=True, q_labeled=True,
               defaults={"train.lr": 1.0e-3}),
    MethodSpec("fg-subspace", "FG-Subspace", "forward-gradient", "q (JVP passes)", subspace=True, jvp=True,
               q_labeled=True),
    MethodSpec("tt-zo", "TT-ZO", "tensor-train-zo", "signRGE: q_s + 1 + 1; CGE: n + 1 + 1 (central: 2n + 1)",
               options=("coords_per_step",), defaults={"train.lr": 1.0e-3}, **_FO),
    MethodSpec("asyncfgd", "AsyncFGD", "forward-gradient", "1 (JVP pass)", jvp=True, momentum=False,
               options=("stages",), defaults={"train.lr": 1.0e-3}),
    MethodSpec("asyncfgd-adam", "AsyncFGD-Adam", "forward-gradient", "1 (JVP pass)", jvp=True, momentum=False,
               options=("stages",), defaults={"train.lr": 1.0e-3}, variant="adam"),
    MethodSpec("np-zo", "NP-ZO", "layer-wise-zo", "1 + qL + 1", options=("layers", "node_losses"), q_labeled=True,
               hooks=True, variant="node"),
    MethodSpec("wp-zo", "WP-ZO", "layer-wise-zo", "1 + qL + 1", options=("layers",), q_labeled=True,
               hooks=True, variant="weight"),
    MethodSpec("awp-zo", "WP/NP-ZO", "layer-wise-zo", "1 + qL + 1", options=("layers", "node_losses"), q_labeled=True,
               hooks=True, variant="adaptive"),
    MethodSpec("qzo-subspace", "QZO-Subspace", "on-chip", "1 + q", subspace=True, integer=True, fixed_backend=True,
               integer_learner=True, momentum=False, q_labeled=True, variant="eq8", **_FO),
    # SubZero (Yu et al. 2024) and LOZO / LOZO-M (Chen et al. 2024) as their code runs them: per-layer low-rank
    # perturbations of every matrix parameter (the rest in the full space), refresh = T0 / nu, one two-point
    # probe per step (szo.optim.lowrank); mu: their code's zo_eps; lr: measured on digits (docs/evidence.md)
    MethodSpec("subzero", "SubZero", "full-space-zo", "2 + 1", options=("rank", "refresh"), variant="subzero",
               defaults={"szo.mu": 1.0e-3, "train.lr": LOWRANK_LR}, **_FO),
    MethodSpec("lozo", "LOZO", "full-space-zo", "2 + 1", options=("rank", "refresh"), variant="lozo", momentum=False,
               defaults={"szo.mu": 1.0e-3, "train.lr": LOWRANK_LR}, **_FO),
    MethodSpec("lozo-m", "LOZO-M", "full-space-zo", "2 + 1", options=("rank", "refresh"), variant="lozo-m",
               defaults={"szo.mu": 1.0e-3, "train.lr": LOWRANK_LR}, **_FO),
    # seed 004's learner as published: int8 weights of the integer forward, 1-LSB XORShift32 Rademacher
    # probes, layer-wise adaptive weight / node perturbation, eq. 8 (szo.hw.optim.mcu.MCUZO)
    MethodSpec("mcu-zo", "MCU-ZO", "on-chip", "1 + qL", integer=True, fixed_backend=True, integer_learner=True, hooks=True,
               block_selection=True, momentum=False, q_labeled=True, options=("layers",)),
):
    register_method(_spec)

# derived views, kept for code written against the earlier module constants
METHODS: tuple[str, ...] = list_methods()
SUBSPACE_METHODS: tuple[str, ...] = list_methods(subspace=True, integer=False)
SZO_METHODS: tuple[str, ...] = list_methods(family="subspace-zo")
BACKPROP_METHODS: tuple[str, ...] = list_methods(backprop=True)
FORWARD_ONLY_METHODS: tuple[str, ...] = list_methods(backprop=False)
FG_METHODS: tuple[str, ...] = list_methods(jvp=True)
DISTRIBUTED_METHODS: tuple[str, ...] = list_methods(parallel="data")
ENGINE_METHODS: tuple[str, ...] = list_methods(engines="batched")
STREAMING_METHODS: tuple[str, ...] = list_methods(streaming=True)
FIXED_BACKEND_METHODS: tuple[str, ...] = list_methods(fixed_backend=True)
INTEGER_LEARNER_METHODS: tuple[str, ...] = list_methods(integer_learner=True)
LAYERWISE_METHODS: dict[str, str] = {m: get_method(m).variant for m in list_methods(family="layer-wise-zo")}
QZO_METHODS: tuple[str, ...] = list_methods(integer=True)
TTA_METHODS: tuple[str, ...] = list_methods(trainable=None, adapts=True)
TTA_SUBSPACE_METHODS: tuple[str, ...] = list_methods(trainable=None, adapts=True, subspace=True)
