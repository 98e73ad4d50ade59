"""Batched perturbation forward: the losses of m perturbed parameter sets in one pass.

One SZO step evaluates the loss of the same batch at m = 2k (CGE) or 2q (RGE) parameter
vectors. The sequential loop (``szo.evaluators.LoopEvaluator.run``) perturbs in place and calls the model
m times. This engine instead, given the step's batch (``szo.zo.Batch``), runs the model *once* on a "channel-folded" tensor that
carries all m copies side by side in the channel (feature) dimension:

* ``Conv2d``: stacked weights ``[m*C_out, C_in/g, kh, kw]`` as a grouped convolution with
  ``m*g`` groups (the first layer sees the shared input, so it is a plain convolution
  with ``m*C_out`` output channels);
* ``Linear``: one GEMM on a shared input, else a batched matmul over the copy axis;
* ``BatchNorm``: one ``batch_norm`` over ``m*C`` channels -- each channel (and hence each
  copy) is normalised with its own batch statistics, exactly as in the loop;
* neurons (SpikingJelly LIF, ReLU), pooling, flatten, residual adds: elementwise or
  per-channel, so they act on the folded tensor unchanged and keep one state per copy.

The model's own ``forward`` runs unchanged; only the ``forward`` of the parameterised
leaf modules is swapped for the duration of the call (and restored afterwards).

BN running statistics follow ``szo.optim.BNStatsFreezer``: after the evaluation the running
statistics are the mean over the m probes of what each probe would have produced from
the same starting statistics, and ``num_batches_tracked`` is incremented once (T times for
per-time-step BN); with ``update_bn=False`` (what ``SZO(probes=ProbePath(bn_update="recompute"))`` asks for)
they are left exactly as they were. Per-time-step BN (``bn_time="per-step"``, ``szo.models``)
is folded step by step: each copy normalises every time step with its own statistics.

Neuron state: the model is reset (SpikingJelly ``functional.reset_net``) before and after
every folded forward, so a foreign model whose ``forward`` does not reset gets the same
losses as the loop, and no folded-shape state is left behind for the next plain forward.

Streaming over T combines with the folding: the engine calls the model's own ``forward``,
so a model with ``time_chunk`` set (``model.set_streaming`` / ``model.streaming()``) runs the
folded copies chunk by chunk in time, and the folded BatchNorm follows the model's
``stream_bn`` policy per folded channel (``szo.models.streaming.BNStream``). Memory is then
that of ``chunk`` copies x ``time_chunk`` steps; the result equals the loop with the same
streaming setting (tests/engine/test_batched.py).

``torch.func.vmap(functional_call(...))`` over stacked parameters also works with the
SpikingJelly LIF, but the LIF's custom op (``sj_lif::forward``) has no batching rule and
falls back to a per-copy loop, so it is not faster than the sequential loop; it is not used.
"""
from __future__ import annotations

import os
from typing import Callable

import torch
import torch.nn.functional as Fn
from spikingjelly.activation_based.functional import reset_net, seq_to_ann_forward
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..functional import zo as F
from ..models.streaming import bn_momentum
from ..precision import exact_fp32
from ..zo.bn import BNStatsFreezer
from ..zo.guard import ProbeGuard, train_mode_dropout
from ..zo.path import ENGINES, ProbePath  # "loop" is szo.evaluators.LoopEvaluator, "batched" this module
from ..zo.plans import Plan
from ..zo.protocol import Batch
from ..zo.space import SubspaceSpace
from .base import Closure, EvaluatorBase

__all__ = ["BatchedEvaluator", "ENGINES", "batch_closure", "BatchedProbeEvaluator", "available_memory_bytes"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# the parameterised leaves the engine can fold; every other leaf must have no parameters and
# act elementwise / per channel (neurons, pooling, flatten, ...)
_PARAM_TYPES = (nn.Conv2d, nn.Linear, _BatchNorm)


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on ``device``: CUDA ``mem_get_info`` or ``MemAvailable`` of /proc/meminfo."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def _check_loss_fn(loss_fn, allow_none: bool = False) -> None:
    if not (callable(loss_fn) or (allow_none and loss_fn is None)):
        raise ValueError(f"loss_fn must be callable as loss_fn(out, y), got {type(loss_fn).__name__}")


def _shape_key(x: torch.Tensor) -> tuple:
    return tuple(x.shape), x.dtype, str(x.device)


def _check_chunk(chunk: int | None) -> int | None:
    if chunk is None:
        return None
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int (copies per pass) or None (auto), got {chunk!r}")
    return chunk


class _Ctx:
    """State of one folded forward: number of copies and stacked parameters per module."""

    def __init__(self, m: int):
        self.m = m
        self.params: dict[nn.Module, dict[str, torch.Tensor | None]] = {}
        self.bn_running: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}


def _conv_forward(mod: nn.Conv2d, ctx: _Ctx, x: torch.Tensor) -> torch.Tensor:
    p, m = ctx.params[mod], ctx.m
    w = p["weight"]  # [m, C_out, C_in/g, kh, kw]
    w = w.reshape(m * w.shape[1], *w.shape[2:])
    b = None if p["bias"] is None else p["bias"].reshape(-1)
    c_in, g = mod.in_channels, mod.groups
    if x.shape[1] == c_in and m > 1:
        if g == 1:  # shared input: one convolution with m*C_out output channels
            return Fn.conv2d(x, w, b, mod.stride, mod.padding, mod.dilation, 1)
        x = x.repeat(1, m, 1, 1)
    elif x.shape[1] != m * c_in:
        raise ValueError(f"batched engine: {type(mod).__name__} expects {c_in} or {m}*{c_in} input channels, "
                         f"got {x.shape[1]}")
    return Fn.conv2d(x, w, b, mod.stride, mod.padding, mod.dilation, m * g)


def _linear_forward(mod: nn.Linear, ctx: _Ctx, x: torch.Tensor) -> torch.Tensor:
    p, m = ctx.params[mod], ctx.m
    w, b = p["weight"], p["bias"]  # [m, O, F], [m, O]
    f_in, f_out = mod.in_features, mod.out_features
    lead = x.shape[:-1]
    if x.shape[-1] == f_in and m > 1:
        y = Fn.linear(x, w.reshape(m * f_out, f_in), None if b is None else b.reshape(-1))
        return y
    if x.shape[-1] != m * f_in:
        raise ValueError(f"batched engine: Linear expects {f_in} or {m}*{f_in} input features, got {x.shape[-1]}")
    xb = x.reshape(-1, m, f_in).transpose(0, 1)  # [m, B, F]
    if b is None:
        y = torch.bmm(xb, w.transpose(1, 2))
    else:
        y = torch.baddbmm(b.unsqueeze(1), xb, w.transpose(1, 2))  # [m, B, O]
    return y.transpose(0, 1).reshape(*lead, m * f_out)


def _bn_forward(mod: _BatchNorm, ctx: _Ctx, x: torch.Tensor) -> torch.Tensor:
    p, m = ctx.params[mod], ctx.m
    c = mod.num_features
    if x.shape[1] == c and m > 1:
        x = x.repeat(1, m, *([1] * (x.dim() - 2)))
    elif x.shape[1] != m * c:
        raise ValueError(f"batched engine: {type(mod).__name__} expects {c} or {m}*{c} channels, got {x.shape[1]}")
    w = None if p["weight"] is None else p["weight"].reshape(-1)
    b = None if p["bias"] is None else p["bias"].reshape(-1)
    use_batch_stats = mod.training or mod.running_mean is None
    tracked = mod.training and mod.track_running_stats
    if tracked and mod not in ctx.bn_running:
        # every copy starts from the same running statistics (frozen across probes); one
        # [m*C] copy per folded forward, updated in place, summed per copy after the forward
        ctx.bn_running[mod] = (mod.running_mean.repeat(m), mod.running_var.repeat(m))
    rm, rv = ctx.bn_running.get(mod, (None, None))
    stream = getattr(mod, "stream_policy", None)
    if stream is not None:
        # chunked (streaming) forward: the model's stream_bn policy; the update lands in rm, rv
        # after the last chunk, num_batches_tracked is counted once by the evaluator
        return stream.apply(mod, x, w, b, rm, rv, count_batches=False)
    if tracked:
        return Fn.batch_norm(x, rm, rv, w, b, True, bn_momentum(mod), mod.eps)
    if use_batch_stats:
        return Fn.batch_norm(x, None, None, w, b, True, 0.0, mod.eps)
    return Fn.batch_norm(x, mod.running_mean.repeat(m), mod.running_var.repeat(m), w, b, False, 0.0, mod.eps)


def _leaf_forward(mod: nn.Module) -> Callable[[nn.Module, _Ctx, torch.Tensor], torch.Tensor]:
    if isinstance(mod, nn.Conv2d):
        return _conv_forward
    if isinstance(mod, nn.Linear):
        return _linear_forward
    return _bn_forward


def _installed_forward(mod: nn.Module, fn, active: list) -> Callable[[torch.Tensor], torch.Tensor]:
    merge_steps = fn is not _linear_forward  # Linear acts on the last dim whatever leads it

    def forward(x: torch.Tensor) -> torch.Tensor:
        if fn is _bn_forward and getattr(mod, "bn_time", "shared") == "per-step" and mod.step_mode == "m":
            # per-time-step BN (szo.models.streaming.BatchNorm2d): one normalisation per step
            return torch.stack([fn(mod, active[0], x[t]) for t in range(x.shape[0])])
        if merge_steps and getattr(mod, "step_mode", "s") == "m":
            # SpikingJelly multi-step Conv2d / BatchNorm take [T, N, ...]: run on [T*N, ...]
            return seq_to_ann_forward(x, lambda z: fn(mod, active[0], z))
        return fn(mod, active[0], x)

    return forward


class BatchedEvaluator:
    """Losses of one batch under many parameter vectors, evaluated as one folded forward.

    ``model``: a module whose parameterised leaves are Conv2d / Linear / BatchNorm (any
    SpikingJelly ``layer.*`` subclass of these) and whose other leaves have no parameters
    (neurons, pooling, flatten, ...). ``loss_fn(out, y)`` maps the model output of one copy
    to a scalar (here, or per call in ``losses``). ``chunk``: copies per pass (``None``:
    sized from free memory once per input shape, then fixed; see ``chunk_size``).
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn | None = None, chunk: int | None = None,
                 memory_fraction: float = 0.5):
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        _check_loss_fn(loss_fn, allow_none=True)
        self.chunk = _check_chunk(chunk)
        if not 0.0 < memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
        self.memory_fraction = memory_fraction
        self.model = model
        self.loss_fn = loss_fn
        self._bn = BNStatsFreezer(model)
        owner = {}
        for mname, mod in model.named_modules():
            own = list(mod.named_parameters(recurse=False))
            if not own:
                continue
            if not isinstance(mod, _PARAM_TYPES):
                raise ValueError(f"batched engine: module {mname!r} ({type(mod).__name__}) has parameters; "
                                 "supported parameterised layers: Conv2d, Linear, BatchNorm")
            if isinstance(mod, nn.Conv2d) and mod.padding_mode != "zeros":
                raise ValueError(f"batched engine: {mname!r} uses padding_mode={mod.padding_mode!r}; only 'zeros'")
            for pname, p in own:
                owner[id(p)] = (mod, pname)
        self.params = list(model.parameters())
        self._owner = [owner[id(p)] for p in self.params]
        self.modules = list(dict.fromkeys(mod for mod, _ in self._owner))
        self.d = sum(p.numel() for p in self.params)
        # the folded forward of each parameterised leaf, installed as its ``forward`` for the
        # duration of a folded pass; it reads that pass's _Ctx from _active[0]
        self._active: list[_Ctx | None] = [None]
        self._forwards = {mod: _installed_forward(mod, _leaf_forward(mod), self._active) for mod in self.modules}
        self._per_copy_cache: dict[tuple, int] = {}  # input-shape key -> bytes per extra copy
        self._chunk_cache: dict[tuple, int] = {}  # input-shape key -> auto chunk (fixed for the run)
        self._budget: dict[str, float] = {}  # device -> memory_fraction of its free memory at first use
        self.forward_passes = 0
        self.last_chunk: int | None = None

    # ----------------------------------------------------------------- memory / chunks
    @torch.no_grad()
    def per_copy_bytes(self, x: torch.Tensor) -> int:
        """Estimated extra memory one more copy costs: its stacked weights plus activations.

        Activations: 4x the largest leaf output of one plain forward (input + output +
        neuron state + BN temporaries are live at once), measured once per input shape.
        """
        key = _shape_key(x)
        if key not in self._per_copy_cache:
            biggest = [0]

            def hook(_m, _i, out):
                if isinstance(out, torch.Tensor):
                    biggest[0] = max(biggest[0], out.numel() * out.element_size())

            hs = [mod.register_forward_hook(hook) for mod in self.model.modules() if not list(mod.children())]
            bn = [(mod, mod.training) for mod in self.modules if isinstance(mod, _BatchNorm)]
            try:
                for mod, _ in bn:  # do not touch running stats
                    mod.eval()
                self.model(x)
            finally:
                for h in hs:
                    h.remove()
                for mod, tr in bn:
                    mod.train(tr)
            elt = self.params[0].element_size() if self.params else 4
            self._per_copy_cache[key] = 4 * biggest[0] + 3 * self.d * elt
        return self._per_copy_cache[key]

    def chunk_size(self, x: torch.Tensor, m: int) -> int:
        """Copies per pass: ``chunk`` if given, else what fits in ``memory_fraction`` of free memory.

        The automatic choice is made once per input shape and then fixed for the life of
        this evaluator (i.e. the run): free memory is read once per device, at the first
        call, and the chunk cached per shape next to ``per_copy_bytes``. Re-reading it every
        step would let the chunk drift with other processes' memory (and on CUDA shrink
        after the first step, whose blocks the caching allocator keeps), and the chunk
        changes float rounding (the summation order of the BN running-statistics update).
        A resumed run measures afresh: give ``chunk`` explicitly where a resume must
        reproduce the uninterrupted run bit for bit.
        """
        if self.chunk is not None:
            return min(self.chunk, m)
        key = _shape_key(x)
        cap = self._chunk_cache.get(key)
        if cap is None:
            dev = str(x.device)
            if dev not in self._budget:
                self._budget[dev] = available_memory_bytes(x.device) * self.memory_fraction
            cap = max(1, int(self._budget[dev] // max(1, self.per_copy_bytes(x))))
            self._chunk_cache[key] = cap
        return min(m, cap)

    # ----------------------------------------------------------------- evaluation
    def _stacked(self, thetas, lo: int, hi: int) -> list[torch.Tensor]:
        """Per-parameter stacked values ``[hi-lo, *shape]`` for copies lo..hi-1."""
        if isinstance(thetas, torch.Tensor):
            block = thetas[lo:hi].to(device=self.params[0].device, dtype=self.params[0].dtype)
            return [c.view(hi - lo, *p.shape) for c, p in zip(block.split([p.numel() for p in self.params], 1),
                                                             self.params)]
        theta0_views, pt_views, U, mu, onehot = thetas
        if onehot is not None:  # CGE: each probe moves along one basis vector; gather rows instead of a GEMM
            idx, coef = onehot[0][lo:hi], onehot[1][lo:hi].unsqueeze(1)
        else:
            u = U[lo:hi]
        out = []
        with exact_fp32(self.params[0].device.type):  # the copies' values in IEEE arithmetic, in any precision scope
            for p0, pt in zip(theta0_views, pt_views):
                if onehot is not None:
                    delta = pt.index_select(0, idx) * coef
                else:
                    delta = (u @ pt) * mu
                out.append((p0.reshape(1, -1) + delta).view(hi - lo, *p0.shape))
        return out

    def _normalise(self, thetas):
        if isinstance(thetas, torch.Tensor):
            if thetas.dim() != 2 or thetas.shape[1] != self.d:
                raise ValueError(f"theta_batch must be [m, d] with d = {self.d}, got {tuple(thetas.shape)}")
            return thetas, thetas.shape[0]
        if not (isinstance(thetas, (tuple, list)) and len(thetas) == 4):
            raise ValueError("thetas must be a tensor [m, d] or a tuple (theta0 [d], P_t [k, d], U [m, k], mu)")
        theta0, Pt, U, mu = thetas
        dev, dt = self.params[0].device, self.params[0].dtype
        if not isinstance(U, torch.Tensor) or U.dim() != 2:
            raise ValueError(f"U must be a 2-D tensor [m, k], got {getattr(U, 'shape', type(U).__name__)}")
        if not (isinstance(mu, (int, float)) and mu > 0):
            raise ValueError(f"mu must be a positive number, got {mu!r}")
        sizes = [p.numel() for p in self.params]
        if isinstance(theta0, torch.Tensor):
            if theta0.shape != (self.d,):
                raise ValueError(f"theta0 must be [d] with d = {self.d}, got {tuple(theta0.shape)}")
            theta0 = [t.view(p.shape) for t, p in zip(theta0.to(device=dev, dtype=dt).split(sizes), self.params)]
        if isinstance(Pt, torch.Tensor):
            if Pt.dim() != 2 or Pt.shape[1] != self.d or Pt.shape[0] != U.shape[1]:
                raise ValueError(f"P_t must be [k, d] = [{U.shape[1]}, {self.d}], got {tuple(Pt.shape)}")
            Pt = list(Pt.to(device=dev, dtype=dt).split(sizes, 1))
        # one nonzero per row (CGE's [I; -I]): gather P_t rows instead of a GEMM. Decided on U
        # as given (the optimizer's plan is on the CPU): on the device copy, the check would
        # synchronise the device every step
        nz = U != 0
        if bool((nz.sum(1) == 1).all()):
            idx = nz.to(torch.uint8).argmax(1)
            coef = U.to(dt).gather(1, idx.unsqueeze(1)).squeeze(1) * mu
            return (theta0, Pt, None, float(mu), (idx.to(dev), coef.to(dev))), U.shape[0]
        return (theta0, Pt, U.to(device=dev, dtype=dt), float(mu), None), U.shape[0]

    @torch.no_grad()
    def losses(self, x: torch.Tensor, y: torch.Tensor, thetas, loss_fn: LossFn | None = None, *,
               update_bn: bool = True, into: BNStatsFreezer | None = None) -> torch.Tensor:
        """Loss of ``(x, y)`` at each parameter vector; float64 ``[m]``.

        ``loss_fn``: this call's loss (default: the one given to the constructor).
        ``update_bn``: False leaves the BN running statistics as they were. ``into``: a step's
        ``BNStatsFreezer`` (snapshot taken) to add the copies' statistics to, for the caller to
        commit (``update_bn`` is then ignored).

        ``thetas``: ``theta_batch [m, d]`` (flat layout order), or ``(theta0, P_t, U, mu)``
        meaning ``theta_j = theta0 + mu * P U[j]`` (``theta0 [d]`` or per-parameter tensors,
        ``P_t [k, d]`` or per-parameter ``[k, numel]`` views, ``U [m, k]``). The model's
        parameters are not modified; with ``update_bn`` BN running statistics get one update
        with the mean over copies (train mode only).
        """
        if loss_fn is None:
            loss_fn = self.loss_fn
            if loss_fn is None:
                raise ValueError("no loss_fn: give it to BatchedEvaluator(...) or to losses(..., loss_fn=...)")
        else:
            _check_loss_fn(loss_fn)
        thetas, m = self._normalise(thetas)
        if m < 1:
            raise ValueError("no parameter vectors to evaluate (m = 0)")
        chunk = self.chunk_size(x, m)
        self.last_chunk = chunk
        losses = torch.empty(m, dtype=torch.float64)
        bn_sums: dict[nn.Module, list[torch.Tensor]] = {}
        for lo in range(0, m, chunk):
            hi = min(m, lo + chunk)
            ctx = _Ctx(hi - lo)
            for (mod, pname), val in zip(self._owner, self._stacked(thetas, lo, hi)):
                ctx.params.setdefault(mod, {"weight": None, "bias": None})[pname] = val
            out = self._folded_forward(ctx, x)
            n_out = out.shape[-1]
            if n_out % ctx.m:
                raise ValueError(f"batched engine: output width {n_out} is not a multiple of {ctx.m} copies")
            out = out.view(*out.shape[:-1], ctx.m, n_out // ctx.m)
            for j in range(ctx.m):
                losses[lo + j] = F.check_loss(loss_fn(out[..., j, :], y), f"loss_fn (probe {lo + j + 1}/{m})")
            for mod, (rm, rv) in ctx.bn_running.items():  # only train-mode BN with running stats
                c = mod.num_features
                s_mean, s_var = rm.view(ctx.m, c).sum(0), rv.view(ctx.m, c).sum(0)
                acc = bn_sums.get(mod)
                if acc is None:
                    bn_sums[mod] = [s_mean, s_var]
                else:
                    acc[0] += s_mean
                    acc[1] += s_var
            self.forward_passes += ctx.m
        if into is not None or update_bn:
            # one BN update with the mean over the m copies: a BNStatsFreezer does the arithmetic
            # (snapshot + per-copy sums + commit), the same as for the sequential loop
            per_step = [mod for mod in bn_sums if getattr(mod, "bn_time", "shared") == "per-step"]
            advance = x.shape[0] if per_step and x.dim() == 5 else (self._static_T() if per_step else 1)
            if into is not None:
                into.add_probe_sums(bn_sums, m, advance)
            else:
                self._bn.snapshot()
                self._bn.add_probe_sums(bn_sums, m, advance)
                self._bn.commit()
        return losses

    def _static_T(self) -> int:
        return int(getattr(self.model, "T", 1))

    def _folded_forward(self, ctx: _Ctx, x: torch.Tensor) -> torch.Tensor:
        self._active[0] = ctx
        reset_net(self.model)  # a foreign model's forward may not reset: no state from earlier calls
        try:
            for mod, fn in self._forwards.items():
                mod.forward = fn  # instance attribute shadows the class's forward
            return self.model(x)
        finally:
            for mod in self._forwards:
                mod.__dict__.pop("forward", None)
            self._active[0] = None
            reset_net(self.model)  # no folded-shape neuron state left for the next plain forward


# ---------------------------------------------------------------------- probe evaluator
class BatchedProbeEvaluator(EvaluatorBase):
    """``SZO(probes=ProbePath(engine="batched"))``'s probe evaluator (a ``szo.zo`` probe evaluator): one folded forward
    per chunk of a plan's probes ``theta + mu P U[j]`` in a :class:`~szo.zo.SubspaceSpace`.

    It needs the batch, not an opaque closure: ``run(..., batch=Batch(x, y, loss_fn))``, which the
    optimizer passes on from ``opt.step(closure, batch=Batch(x, y, loss_fn))`` (``szo.train.fit``
    does this). BN statistics follow the step's
    ``bn_update`` through the guard's ``BNStatsFreezer``, as the loop does. The probes do not call
    the closure, so a trainer sees no train outputs from them (``sees_outputs`` False).
    """

    sees_outputs = False

    def __init__(self, guard: ProbeGuard, model: nn.Module, path: ProbePath | None = None):
        if model is None:
            raise ValueError("the batched engine needs the model")
        super().__init__(guard, path)
        self.evaluator = BatchedEvaluator(model, None, chunk=None if path is None else path.chunk)
        self._checked: SubspaceSpace | None = None  # the space whose parameters were checked

    @property
    def last_chunk(self) -> int | None:
        """Copies per folded pass of the last step."""
        return self.evaluator.last_chunk

    @torch.no_grad()
    def run(self, closure: Closure, space: SubspaceSpace, plan: Plan, *, batch: Batch | None = None,
            label: str = "probe") -> torch.Tensor:
        """The losses of ``plan``'s probes on ``batch`` (the closure is not called)."""
        if batch is None:
            raise ValueError("engine='batched' folds the probes over the batch and never calls the closure: give "
                             "the step its batch, opt.step(closure, batch=szo.evaluators.Batch(x, y, loss_fn)) "
                             "(or opt.step(batch=Batch(x, y, loss_fn)))")
        if not isinstance(batch, Batch):
            raise ValueError(f"batch must be a szo.evaluators.Batch(x, y, loss_fn), got {type(batch).__name__}")
        x, y, loss_fn = batch.check()
        ev = self.evaluator
        dropout = train_mode_dropout(ev.model)
        if dropout:
            raise ValueError(f"engine='batched' folds a step's probes into one forward, where train-mode dropout "
                             f"({', '.join(dropout)}) would draw a different mask for every probe; use engine='loop' "
                             "(every probe replays the step's random state) or put the dropout layers in eval mode")
        if self._checked is not space:  # once per space, not per step
            if not isinstance(space, SubspaceSpace):
                raise ValueError(f"the batched engine evaluates subspace plans; got a {type(space).__name__}")
            if [id(p) for p in space.params] != [id(p) for p in ev.params]:
                frozen = sum(1 for p in ev.params if not p.requires_grad)
                if frozen and [id(p) for p in space.params] == [id(p) for p in ev.params if p.requires_grad]:
                    raise ValueError(f"engine='batched' folds every parameter of the model into its probe copies; "
                                     f"{frozen} of them are frozen (requires_grad=False) and left out of the "
                                     "subspace: use engine='loop', or unfreeze them")
                raise ValueError("the optimizer's parameters are not model.parameters() (same order) of the "
                                 "engine's model")
            self._checked = space
        theta0 = [p.detach() for p in space.params]
        return ev.losses(x, y, (theta0, space.basis_views, plan.dense(), plan.mu), loss_fn,
                         update_bn=False, into=self.guard.bn if self.guard.probe_mean else None)


def batch_closure(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor,
                  reduction: str = "mean") -> Closure:
    """``closure() = loss_fn(model(x), y)``, the model's neuron state reset (SpikingJelly
    ``reset_net``) before each call: ``Batch(x, y, loss_fn).closure(model, reduction)``
    (``reduction="none"``: one loss per sample, what an optimizer with ``loss_reduction == "none"``
    needs). The batched engine needs the batch itself: ``opt.step(batch=Batch(x, y, loss_fn))``."""
    return Batch(x, y, loss_fn).closure(model, reduction)
