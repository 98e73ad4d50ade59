"""The shared body of every forward-only optimizer: counting, the step record, the BN forward, state.

:class:`ForwardOnlyBase` is a ``torch.optim.Optimizer`` (param groups, LR schedulers and
``state_dict`` work as usual) that satisfies :class:`~szo.zo.protocol.ForwardOnlyOptimizer`. A
composition sets ``self.evaluator`` (how probes run) and calls :meth:`finish_step` at the end of
``step``: it runs the unperturbed BN forward when ``bn_update="recompute"`` asks for one, counts
the step's forwards and records the :class:`~szo.zo.protocol.StepInfo`. Extra state goes through
``codecs`` (:class:`~szo.zo.update.StateCodec`), one section per key of ``state_dict()``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Mapping

import torch

from .protocol import Batch, StepInfo
from .update import StateCodec

__all__ = ["CodecOptimizer", "ForwardOnlyBase", "LayerwiseBase", "CleanForward", "refuse_complex", "refuse_meta", "refuse_sparse",
           "without_frozen"]


class CodecOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose extra state is ``codecs``: ``state_dict()[codec.key]`` each.

    The sections are also in the first parameter's entry of ``state_dict()["state"]`` (the same
    objects: a file stores them once), where torch's LBFGS keeps an optimizer's own state, and every
    parameter has an entry: tools that keep only ``state`` and ``param_groups`` and want an entry per
    parameter (``torch.distributed.checkpoint``'s ``get_optimizer_state_dict`` /
    ``set_optimizer_state_dict``) carry them, and the live ``state`` is never empty, so such a tool
    does not call ``step(None)`` to create it. ``load_state_dict`` reads either place.

    It deep-copies and pickles whole (``copy.deepcopy``, ``pickle``, ``torch.save(optimizer)``):
    torch's ``Optimizer.__getstate__`` keeps only ``defaults``, ``state`` and ``param_groups``, which
    leaves a copy of a composed optimizer without its space, evaluator and counters. As torch does,
    the step and state-dict hooks are not copied.

    A parameter on the ``meta`` device (a shape without values) is refused at construction.
    """

    codecs: tuple[StateCodec, ...] = ()
    #: what the optimizer moves, for the one-line refusal of add_param_group (None: it accepts groups)
    fixed_space: str | None = "a space fixed when it was built"

    def __init__(self, params, defaults: dict[str, Any]) -> None:
        self._built = False
        super().__init__(params, defaults)
        self._built = True
        refuse_meta([p for g in self.param_groups for p in g["params"]], type(self).__name__)
        refuse_complex([p for g in self.param_groups for p in g["params"]], type(self).__name__)
        refuse_sparse([p for g in self.param_groups for p in g["params"]], type(self).__name__)
        first = next((p for g in self.param_groups for p in g["params"]), None)
        if first is not None and self.codecs:
            self.state[first]  # the entry that holds the sections in state_dict() (defaultdict: created empty)
        self._hook_sections()

    def _hook_sections(self) -> None:
        """The sections join ``state_dict()`` as its first post hook, so that every hook a user
        registers sees the whole state dict."""
        if self.codecs and not self.__dict__.get("_sections_hooked"):
            self.register_state_dict_post_hook(_with_sections, prepend=True)
            self._sections_hooked = True

    def count_step(self) -> None:
        """After a step that moved the parameters: ``state[p]["step"]`` (a float32 tensor, as torch's own
        optimizers keep it) counts the steps for every parameter the optimizer trains, so that a torch user
        finds an entry per trained parameter in ``optimizer.state`` and none of them empty. The optimizer's
        own state stays in its sections (``codecs``); this count is what torch's per-parameter state holds."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    st = self.state[p]
                    st["step"] = st["step"] + 1 if "step" in st else torch.tensor(1.0)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, while the constructor adds its groups; afterwards one ValueError unless the
        optimizer's space can grow (``fixed_space`` None): a group it accepted and never trained
        would be a silent no-op."""
        if self._built and self.fixed_space is not None:
            raise ValueError(f"{type(self).__name__} moves {self.fixed_space}: add_param_group cannot add parameters "
                             f"to it; build a new {type(self).__name__} over all the parameters to train")
        super().add_param_group(param_group)

    def __getstate__(self) -> dict[str, Any]:
        # torch's hook tables (_optimizer_*) are left out, as torch leaves them; its __setstate__
        # re-creates them empty and re-wraps step for the hooks, and ours hooks the sections again
        return {k: v for k, v in self.__dict__.items() if not k.startswith(("_optimizer_", "_sections_hooked"))}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._hook_sections()

    def load_state_dict(self, state_dict):
        """torch's ``load_state_dict`` with the sections, all or nothing, in torch's hook order.

        The load pre hooks run first (on a shallow copy, as torch's; one may return a new dict). Then
        every section is checked (``StateCodec.stage``: shapes, dtypes, generator states, the basis
        fingerprint; :meth:`_prepare_load` for what an optimizer derives from them) before anything is
        changed, so a refused load leaves the optimizer and the parameters as they were. Then torch's
        part (param groups, per-parameter state), the sections and :meth:`_finish_load` are put in
        place, and only then the post hooks run: they see the loaded state."""
        if not isinstance(state_dict, Mapping):
            raise ValueError(f"{type(self).__name__}.load_state_dict takes a state dict (a mapping with 'state' and "
                             f"'param_groups'), got {type(state_dict).__name__}")
        state_dict = dict(state_dict)  # shallow, as torch's
        for pre_hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        missing = [k for k in ("state", "param_groups") if not isinstance(state_dict.get(k), (dict, list))]
        if missing:
            raise ValueError(f"optimizer state dict lacks {' and '.join(map(repr, missing))}; it was not written "
                             f"by state_dict() of a torch optimizer")
        first = _first_key(state_dict["param_groups"])
        entry = state_dict["state"].get(first, {})
        entry = dict(entry) if isinstance(entry, Mapping) else {}
        sections = {}
        for c in self.codecs:
            top, inner = state_dict.pop(c.key, None), entry.pop(c.key, None)
            sections[c.key] = top if top is not None else inner
        if first in state_dict["state"]:
            state_dict["state"] = {**state_dict["state"], first: entry}
        # phase 1: check everything, change nothing
        staged = [(c, c.stage(self, dict(sections[c.key]) if isinstance(sections[c.key], Mapping)
                              else sections[c.key])) for c in self.codecs if sections[c.key]]
        prepared = self._prepare_load({c.key: sections[c.key] or {} for c in self.codecs})
        # phase 2: torch's part (it checks the param groups before it changes anything), then the sections
        hooks = self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks
        self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = {}, {}
        try:
            super().load_state_dict(state_dict)
        finally:
            self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = hooks
        # torch keeps the loaded tensors themselves (Tensor.to without a change returns its input) and a
        # step updates them in place: copies, so the caller's dict stays a checkpoint (a second resume from it)
        for st in self.state.values():
            if isinstance(st, dict):  # a hook may keep its own entries (optimizer.state["ran"] = True)
                for k, v in st.items():
                    if isinstance(v, torch.Tensor):
                        st[k] = v.clone()
        for codec, values in staged:
            codec.apply(self, values)
        self._finish_load(prepared)
        for post_hook in list(self._optimizer_load_state_dict_post_hooks.values()):
            post_hook(self)

    def _prepare_load(self, sections: dict[str, Any]) -> Any:
        """What an optimizer derives from the sections it is loading (e.g. a refreshed SZO's current basis,
        redrawn from the saved generator state), computed and checked before anything changes; passed to
        :meth:`_finish_load`. ``sections``: each codec's key -> the section loaded (empty when absent)."""
        return None

    def _finish_load(self, prepared: Any) -> None:
        """After the sections are in place, before the post hooks: what follows from them (the basis,
        the parameters at the loaded point). Must not refuse: :meth:`_prepare_load` checks."""


def _with_sections(opt: CodecOptimizer, sd: dict) -> dict:
    """``state_dict()``'s first post hook: the codec sections, at the top and in the first parameter's entry."""
    sections = {codec.key: codec.encode(opt) for codec in opt.codecs}
    sd.update(sections)
    first = _first_key(sd["param_groups"])
    if sections and first is not None:
        sd["state"][first] = {**sd["state"].get(first, {}), **sections}
        for g in sd["param_groups"]:  # an entry per parameter, as a stepped torch optimizer has
            for k in g["params"]:
                sd["state"].setdefault(k, {})
    return sd


def _first_key(param_groups: list[dict]) -> Any:
    """The key of the first parameter in a state dict's ``state`` (its index, or a name under
    ``torch.distributed.checkpoint``), None without parameters."""
    return next((k for g in param_groups for k in g["params"]), None)


def without_frozen(param_group: dict) -> dict:
    """A copy of torch's ``param_group`` without its frozen parameters (``requires_grad=False``: never
    probed nor moved), plain tensors or ``(name, tensor)`` pairs (named parameters, torch >= 2.6)."""
    group = dict(param_group)
    ps = group.get("params")
    ps = [ps] if isinstance(ps, torch.Tensor) else list(ps or [])
    group["params"] = [p for p in ps if (p[1] if isinstance(p, tuple) else p).requires_grad]
    return group


def refuse_meta(params: list[torch.Tensor], who: str) -> None:
    """One ValueError when a parameter is on the ``meta`` device (a shape without values)."""
    if any(p.device.type == "meta" for p in params):
        raise ValueError(f"{who}: the parameters are on the meta device (shapes without values), and its steps run "
                         "the model (a forward-only step: its probes): materialise it first (model.to_empty(device=...), "
                         "then load its weights)")


def refuse_sparse(params: list[torch.Tensor], who: str) -> None:
    """One ValueError when a parameter has a sparse layout: a probe or an update adds a dense vector to
    it in place, which a sparse tensor does not take (sparse *gradients* of dense parameters are fine)."""
    kinds = sorted({str(p.layout).replace("torch.", "") for p in params if p.layout != torch.strided})
    if kinds:
        raise ValueError(f"{who}: parameters of {', '.join(kinds)} layout are not supported: its probes and updates "
                         "add dense vectors to the parameters in place; keep the parameters dense (p.to_dense()) -- "
                         "a sparse gradient, as nn.Embedding(sparse=True) gives, is fine")


def refuse_complex(params: list[torch.Tensor], who: str) -> None:
    """One ValueError when a parameter is complex: szo's probes, subspaces and updates are real, so its
    imaginary part would never move (torch's own optimizers view a complex parameter as real pairs)."""
    kinds = sorted({str(p.dtype).replace("torch.", "") for p in params if p.is_complex() and p.requires_grad})
    if kinds:
        raise ValueError(f"{who}: parameters of complex dtype ({', '.join(kinds)}) are not supported: its "
                         "perturbations, subspaces and updates are real, so the imaginary parts would never move; "
                         "hold them as real pairs (torch.view_as_real / a real [..., 2] parameter) or freeze them "
                         "(requires_grad=False)")


class ForwardOnlyBase(CodecOptimizer):
    """Base of the forward-only compositions (see the module docstring)."""

    forward_only = True
    loss_reduction = "mean"  # the closure returns the batch loss (LayerwiseZO's per-sample form: "none")

    def _init_forward_only(self, evaluator, generator: torch.Generator | None = None) -> None:
        self.evaluator = evaluator
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)
        self.forward_passes = 0
        self._last_step: StepInfo | None = None

    # ------------------------------------------------------------------ protocol
    @property
    def _step_supports_amp_scaling(self) -> bool:
        """``torch.amp.GradScaler.step`` reads this before it unscales any gradient; a forward-only
        optimizer has none, so the read refuses the scaler in one line (GradScaler checks its own scale
        first: with nothing scaled yet it stops on its own assertion before it reaches an optimizer)."""
        raise ValueError(f"{type(self).__name__} is forward-only: GradScaler scales the gradients of a backward pass "
                         "and this optimizer has none; call opt.step(closure) without GradScaler (mixed precision: "
                         "szo's precision setting, or torch.autocast(..., cache_enabled=False) inside the closure)")

    @property
    def guard(self):
        """The evaluator's probe guard (model, BN rule, resets)."""
        return self.evaluator.guard

    @property
    def bn(self):
        return self.evaluator.guard.bn

    @property
    def bn_update(self) -> str:
        return self.evaluator.guard.bn_update

    @property
    def distributed(self) -> str | None:
        return self.evaluator.distributed

    @property
    def bytes_communicated(self) -> int:
        return self.evaluator.bytes_communicated

    @bytes_communicated.setter
    def bytes_communicated(self, value: int) -> None:
        self.evaluator.bytes_communicated = int(value)

    @property
    def last_step(self) -> StepInfo | None:
        return self._last_step

    @property
    def train_outputs(self) -> bool:
        """The closure calls show the trainer outputs to compute train accuracy from: every probe
        calls the closure, or the step ends with the unperturbed forward."""
        return bool(self.evaluator.sees_outputs or self.evaluator.guard.recomputes)

    @property
    def recomputes(self) -> bool:
        """Steps end with the unperturbed BN forward (one more forward per step)."""
        return self.evaluator.guard.recomputes

    # kept for code written against the attributes the trainer used to read
    @property
    def last_losses(self) -> torch.Tensor | None:
        return None if self._last_step is None else self._last_step.losses

    @property
    def last_outputs_unperturbed(self) -> bool:
        return self._last_step is not None and self._last_step.unperturbed

    @torch.no_grad()
    def idle_step(self, closure: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The step of an optimizer whose parameters are all frozen (``requires_grad=False``): torch's
        rule, nothing moves; the closure runs once and its loss is returned (one forward, counted)."""
        loss = closure()
        self.forward_passes += 1
        value = float(loss.detach().float().mean()) if isinstance(loss, torch.Tensor) else float(loss)
        self._last_step = StepInfo(loss=value, losses=torch.tensor([value], dtype=torch.float64), forwards=1,
                                   unperturbed=True, bn_loss=None)
        return loss if isinstance(loss, torch.Tensor) else torch.tensor(value)

    def check_closure(self, closure: Callable[[], torch.Tensor] | None, batch: Batch | None = None
                      ) -> Callable[[], torch.Tensor]:
        """The closure a step calls: ``closure``, else one built from ``batch`` and the model
        (:meth:`Batch.closure`, with this optimizer's ``loss_reduction``). One ValueError for
        ``step()`` with neither (as after ``loss.backward()``): the step is forward-only, it evaluates
        the loss itself at its probes."""
        if batch is not None:
            if not isinstance(batch, Batch):
                raise ValueError(f"{type(self).__name__}.step(batch=...) takes a szo.evaluators.Batch(x, y, loss_fn), "
                                 f"got {type(batch).__name__}")
            batch.check()
        if closure is not None:
            return closure
        what = "per-sample losses" if self.loss_reduction == "none" else "loss"
        if batch is None:
            raise ValueError(f"{type(self).__name__}.step needs a closure that runs a forward pass and returns the "
                             f"{what}: the step is forward-only and evaluates it at every probe; call "
                             "opt.step(closure) or opt.step(batch=Batch(x, y, loss_fn)), without loss.backward()")
        model = self.evaluator.guard.model
        if model is None:
            raise ValueError(f"{type(self).__name__}.step(batch=...) without a closure builds it from the model, and "
                             "this optimizer was given parameters only: pass the closure too, "
                             "opt.step(closure, batch=batch), or build the optimizer on the model")
        return batch.closure(model, self.loss_reduction)

    # ------------------------------------------------------------------ the end of a step
    @torch.no_grad()
    def finish_step(self, closure: Callable[[], torch.Tensor], losses, fallback: float, forwards: int
                    ) -> torch.Tensor:
        """After the update: the unperturbed BN forward of theta_{t+1} under ``bn_update="recompute"``
        with BN in train mode (its loss is returned; a per-sample closure, ``loss_reduction ==
        "none"``, is averaged), else ``fallback`` (the probes' loss at theta_t); ``forwards`` (the
        probes) plus that forward are counted."""
        losses = torch.as_tensor(losses, dtype=torch.float64)
        if self.loss_reduction == "none":  # per-sample closure: the BN forward reports the batch loss
            per_sample = closure
            closure = lambda: per_sample().mean()  # noqa: E731
        unperturbed = self.evaluator.guard.recomputes
        bn_loss = None
        loss = float(fallback)
        if unperturbed:
            bn_loss = self.evaluator.unperturbed(closure)
            forwards += 1
            loss = bn_loss
        self.forward_passes += forwards
        self._last_step = StepInfo(loss=loss, losses=losses, forwards=forwards, unperturbed=unperturbed,
                                   bn_loss=bn_loss)
        self.count_step()
        return torch.tensor(loss)


@dataclass(frozen=True)
class CleanForward:
    """What a layer-wise step's clean forward gives its probes and its update: the losses (one per
    sample, or the batch's), their mean ``l0``, the forwards it took beyond one, and what the learner
    recorded per trained layer (its input, its output's shape)."""

    losses: Any
    l0: float
    extra: int
    layers: dict[str, Any]


class LayerwiseBase(ForwardOnlyBase):
    """The layer-wise step both layer-wise learners share (seed 004 Algorithm 1): one clean forward
    that records what each trained layer needs (its input, its output's shape), then each layer in
    ``layers`` probed on its own (``q`` one-sided probes of its nodes or its weights) for its
    gradient, every probe at the same clean point, then one update of every layer from those
    gradients, then :meth:`finish_step`. The float learner (``szo.optim.layerwise.LayerwiseZO``:
    Gaussian probes, heavy ball) and seed 004's integer one on the int8 weights
    (``szo.hw.optim.mcu.MCUZO``: 1-LSB Rademacher probes, eq. 8) differ only in the four parts below; the
    node / weight choice of an adaptive learner is ``szo.zo.adaptive_perturbation`` for both."""

    layers: dict[str, Any]
    q: int

    def _step_scope(self) -> ContextManager:
        """Held with the evaluator's session around the clean forward and the probes."""
        return contextlib.nullcontext()

    def _clean_forward(self, closure: Callable[[], torch.Tensor]) -> CleanForward:
        """The clean forward and what it recorded per layer."""
        raise NotImplementedError

    def _probe_layer(self, closure: Callable[[], torch.Tensor], name: str, module: Any, clean: CleanForward
                     ) -> tuple[Any, torch.Tensor]:
        """One layer's probes at the clean point: its gradient estimate and the probes' batch losses ``[q]``."""
        raise NotImplementedError

    def _update(self, grads: dict[str, Any], clean: CleanForward) -> None:
        """Every layer's update from its gradient (after the probes: no probe sees another layer's step)."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None, *,  # type: ignore[override]
             batch: Batch | None = None) -> torch.Tensor:
        closure = self.check_closure(closure, batch)
        grads: dict[str, Any] = {}
        with self.evaluator.session(), self._step_scope():
            clean = self._clean_forward(closure)
            losses = [clean.l0]
            for name, module in self.layers.items():
                grads[name], probe_losses = self._probe_layer(closure, name, module, clean)
                losses += probe_losses.tolist()
        self._update(grads, clean)
        return self.finish_step(closure, losses, clean.l0, 1 + self.q * len(self.layers) + clean.extra)
