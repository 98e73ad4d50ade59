"""How a probe forward runs, as one record: :class:`ProbePath`.

Seven settings decide how the forwards of a step's probes run: the engine (``loop``: one closure
call per probe; ``batched``: the probes folded into copies of the model, ``szo.evaluators``), the
torchrun mode (``szo.distributed``), synchronised BN, ``compile`` (``szo.models.compiled``),
``cuda_graphs`` (``szo.models.graphed``), the streaming forward (``time_chunk``,
``szo.models.streaming``) and the backend (``float`` or the integer forward of ``szo.hw``). Some
combinations cannot work; :meth:`ProbePath.check` holds every rule about them, one message each,
spelled as a recipe spells the keys (``recipe=True``: ``szo.engine``, ``distributed.mode``) or as
the library's keywords do (``engine=``, ``model.set_cuda_graphs``), the way
``MethodSpec.check_capabilities`` spells the method's own rules. Config validation, the
distributed stage check, ``build_optimizer``, the optimizers (through ``szo.evaluators.build_evaluator``,
the one factory that turns the record into an evaluator) and the model's own forward setters all
ask this record.

A method's record (``szo.methods.MethodSpec``) says which engines and torchrun modes it runs with,
whether it takes the streaming forward or the integer backend, and whether it drives layers
through forward hooks at every forward (``hooks``): a replayed CUDA graph runs no Python, and a
compiled forward does not see hooks added after it was traced (Dynamo does not guard on a
module's hook dictionaries), so hook-driven methods are refused with both.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, runtime_checkable

from szo.methods import MethodSpec, get_method, list_methods, which_methods
from szo.vocab import ENGINES

__all__ = ["ProbePath", "ForwardSettings", "ENGINES", "MODES", "BACKENDS"]

MODES: tuple[str, ...] = ("data", "perturbation")
"""torchrun modes (``szo.distributed``): a shard of the batch per rank, or a slice of the probes per rank."""
BACKENDS: tuple[str, ...] = ("float", "fixed")
"""The model's forward: float, or the integer (fixed-point) network of ``szo.hw``."""


@runtime_checkable
class ForwardSettings(Protocol):
    """A model that says how its forward runs (``szo.models.SpikingModel.forward_settings``): a mapping
    of the :class:`ProbePath` fields ``compile``, ``cuda_graphs``, ``time_chunk``, ``bn_time``, ``backend``."""

    def forward_settings(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True)
class _Feature:
    """One setting of the path as a rule sees it: on or off, what it does, how to turn it off."""

    on: bool
    what: str
    off: str


@dataclass(frozen=True)
class ProbePath:
    """How the forwards of a step's probes run (see the module doc).

    * ``engine`` / ``chunk``: ``loop`` or ``batched`` (``chunk`` probes per folded forward);
    * ``distributed`` / ``sync_bn`` / ``process_group``: the torchrun mode (None: one process),
      synchronised BN statistics in ``data`` mode, the group (None: the default one);
    * ``freeze_bn`` / ``bn_update``: the BN running statistics across the probes (``szo.zo.bn``);
    * ``compile``, ``cuda_graphs``, ``time_chunk``, ``bn_time``, ``backend``: the model's forward
      (a recipe's keys; for a model, what it says of itself: :meth:`on`);
    * ``method``: the method's registry record (None: no method rules, e.g. ``SZO`` built directly).
    """

    engine: str = "loop"
    chunk: int | None = None
    distributed: str | None = None
    sync_bn: bool = True
    freeze_bn: bool = True
    bn_update: str = "recompute"
    compile: bool | str = False
    cuda_graphs: bool = False
    time_chunk: int | None = None
    bn_time: str = "shared"
    backend: str = "float"
    method: MethodSpec | None = None
    process_group: Any = field(default=None, compare=False, repr=False)

    # ------------------------------------------------------------------ building the record
    @classmethod
    def from_recipe(cls, cfg: Any, *, parallel: bool = False) -> "ProbePath":
        """The path of a resolved recipe config (``szo.config.RecipeConfig``): its ``szo`` keys, the
        model's forward keys, ``distributed`` when the run is a multi-process one (``parallel``), and
        the method's record for a ``kind: subspace`` recipe."""
        sz, dc = cfg.szo, cfg.distributed
        method = get_method(cfg.method) if cfg.kind == "subspace" else None
        return cls(engine=sz.engine, chunk=sz.chunk, distributed=dc.mode if parallel else None, sync_bn=dc.sync_bn,
                   bn_update=sz.bn_update, compile=cfg.compile, cuda_graphs=cfg.cuda_graphs,
                   time_chunk=sz.time_chunk, bn_time=cfg.model.bn_time, backend=cfg.backend, method=method)

    def on(self, model: Any) -> "ProbePath":
        """This path with the model's own forward settings (a model that reports them: a
        :class:`ForwardSettings`, e.g. every ``szo.models.SpikingModel``); a setting the record turns
        on stays on."""
        if not isinstance(model, ForwardSettings):
            return self
        have = model.forward_settings()
        return dataclasses.replace(
            self, compile=self.compile if self.compile is not False else have["compile"],
            cuda_graphs=self.cuda_graphs or have["cuda_graphs"],
            time_chunk=self.time_chunk if self.time_chunk is not None else have["time_chunk"],
            bn_time=have["bn_time"] if self.bn_time == "shared" else self.bn_time,
            backend=have["backend"] if self.backend == "float" else self.backend)

    def replace(self, **changes: Any) -> "ProbePath":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ the rules
    def _features(self, recipe: bool) -> dict[str, _Feature]:
        """Every setting a rule talks about, spelled as a recipe (``recipe``) or a keyword caller spells it."""
        r = recipe
        c, d, n = self.compile, self.distributed, self.time_chunk
        hooks = self.method is not None and self.method.hooks
        return {
            "batched": _Feature(self.engine == "batched",
                                ("szo.engine 'batched'" if r else "engine='batched'") + " (the probes folded into "
                                "copies of the model)", "szo.engine=loop" if r else "engine='loop'"),
            "parallel": _Feature(d is not None, (f"distributed.mode {d!r}" if r else f"distributed={d!r}")
                                 + " (several processes)", "run in one process" if r else "distributed=None"),
            "sync_bn": _Feature(d == "data" and self.sync_bn,
                                ("distributed.sync_bn with distributed.mode 'data'" if r else
                                 "sync_bn=True with distributed='data'") + " (BN synchronised by forward hooks)",
                                "distributed.sync_bn=false or distributed.mode=perturbation" if r else
                                "sync_bn=False or distributed='perturbation'"),
            "thawed": _Feature(not self.freeze_bn, "freeze_bn=False (the probes update BN statistics)",
                               "freeze_bn=True"),
            "compile": _Feature(c is not False, (f"compile={c!r}" if r else "model.set_compile(True)")
                                + " (the model's multi-step forward compiled by torch.compile)",
                                "compile=false" if r else "model.set_compile(False)"),
            "graphs": _Feature(bool(self.cuda_graphs), ("cuda_graphs=true" if r else "model.set_cuda_graphs(True)")
                               + " (the model's multi-step forward replayed as CUDA graphs, which run no Python)",
                               "cuda_graphs=false" if r else "model.set_cuda_graphs(False)"),
            "streaming": _Feature(n is not None, (f"szo.time_chunk={n}" if r else f"model.set_streaming({n})")
                                  + " (the streaming forward, run eagerly chunk by chunk)",
                                  "szo.time_chunk=null" if r else "model.set_streaming(None)"),
            "fixed": _Feature(self.backend == "fixed", "backend 'fixed' (the integer forward of szo.hw)",
                              "backend=float" if r else "the float model"),
            "per_step_bn": _Feature(self.bn_time == "per-step", ("model.bn_time 'per-step'" if r else
                                                                  "bn_time='per-step'") + " (BN per time step)",
                                    "model.bn_time=shared" if r else "bn_time='shared'"),
            "hooks": _Feature(hooks, f"method {self.method.name if hooks else None!r} (it drives layers through "
                              "forward hooks at every forward)", "another method"),
        }

    CONFLICTS = (("batched", "parallel"), ("batched", "thawed"), ("batched", "compile"), ("batched", "graphs"),
                 ("batched", "fixed"), ("compile", "streaming"), ("compile", "fixed"), ("graphs", "compile"),
                 ("graphs", "streaming"), ("graphs", "fixed"), ("fixed", "streaming"), ("parallel", "streaming"),
                 ("sync_bn", "compile"), ("sync_bn", "graphs"), ("sync_bn", "per_step_bn"), ("hooks", "graphs"),
                 ("hooks", "compile"))
    """The pairs of settings that cannot run together (one message for all: what each does, how to turn
    either off). A replayed graph and a compiled forward skip hooks (SyncBatchNorm's, a hook-driven
    method's); the batched engine folds probes itself; the streaming and integer forwards run eagerly."""

    def check(self, *, recipe: bool = False) -> "ProbePath":
        """Every rule about this path, one ValueError naming what was asked and what is valid; returns
        the path. ``recipe``: the keys spelled as a recipe spells them."""
        szo = "szo." if recipe else ""
        if self.engine not in ENGINES:
            raise ValueError(f"unknown {szo}engine {self.engine!r}; valid: {', '.join(ENGINES)}")
        if self.distributed is not None and self.distributed not in MODES:
            raise ValueError(f"unknown distributed mode {self.distributed!r}; valid: "
                             f"{'' if recipe else 'None, '}{', '.join(MODES)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; valid: {', '.join(BACKENDS)}")
        if self.chunk is not None and self.engine != "batched":
            raise ValueError(f"'{szo}chunk' (copies per folded forward) applies to {szo}engine 'batched'; set "
                             f"{szo}engine=batched or leave {szo}chunk {'null' if recipe else 'None'}")
        self._check_method(szo)
        f = self._features(recipe)
        for a, b in self.CONFLICTS:
            if f[a].on and f[b].on:
                raise ValueError(f"{f[a].what} cannot be combined with {f[b].what}: set {f[a].off}, or {f[b].off}")
        return self

    def _check_method(self, szo: str) -> None:
        """What the method's record says it runs with: its engines, torchrun modes, the streaming
        forward, the integer backend."""
        spec = self.method
        if spec is None:
            return
        if self.engine not in spec.engines:
            raise ValueError(f"{szo}engine {self.engine!r} evaluates SZO probe plans: it applies to "
                             f"{which_methods(engines=self.engine)}; method {spec.name!r} runs with {szo}engine "
                             f"{' / '.join(map(repr, spec.engines))}")
        if self.distributed is not None and self.distributed not in spec.parallel:
            raise ValueError(f"method {spec.name!r} does not run on several processes; multi-process (torchrun) "
                             f"runs support: {', '.join(list_methods(parallel=self.distributed))} (or run it in "
                             "one process)")
        if self.time_chunk is not None and not spec.streaming:
            why = ("backpropagates" if spec.backprop else "takes forward-mode derivatives" if spec.jvp
                   else "perturbs layer outputs over all T steps at once")
            raise ValueError(f"'{szo}time_chunk' (streaming forward) applies to forward-only methods; method "
                             f"{spec.name!r} {why}; valid methods with {szo}time_chunk: "
                             f"{', '.join(list_methods(streaming=True))}")
        if self.backend == "fixed" and not spec.fixed_backend:
            raise ValueError(f"backend 'fixed' runs forward-only SZO; got method {spec.name!r}; "
                             f"valid: {', '.join(list_methods(fixed_backend=True))}")

