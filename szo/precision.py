"""The arithmetic of a run, as a setting: ``precision`` = ``fp32`` | ``tf32`` | ``bf16`` | ``auto``.

PyTorch's defaults are not a policy: on CUDA its cuDNN convolutions run in TF32 (a 10-bit
mantissa) unless told otherwise, while its matmuls do not, and neither is recorded anywhere.
A zeroth-order estimate divides a loss difference by mu, and a spike is a threshold, so a
rounding that a BP-trained forward tolerates can flip spikes between the + and the - probe
(docs/evidence.md measures it). This module is the one place that sets the arithmetic:

* ``fp32``: IEEE float32 for convolutions and matmuls (TF32 off on CUDA), no autocast;
* ``tf32``: TF32 convolutions and matmuls on CUDA; on the CPU, which has no TF32, the same
  as fp32 (the record says ``effective: fp32``);
* ``bf16``: autocast to bfloat16 (SpikingJelly 2.0's precision API,
  ``spikingjelly.activation_based.precision``: its capability check and its autocast
  context), TF32 off for what autocast leaves in float32;
* ``auto``: :data:`AUTO` per kind of training, the choice docs/evidence.md justifies.

**Autocast's weight cache never spans two forwards.** Inside a ``torch.autocast`` block PyTorch
caches the bfloat16 copy of every float32 leaf parameter it casts (``cache_enabled=True``, the
default; aten's ``cached_cast``, keyed by the tensor, emptied only when the outermost autocast
block exits). A forward-only step moves the parameters in place between its probes, and a BPTT
step between two batches, so one autocast block around several forwards gives every forward the
first one's weights: probe pairs that differ by nothing, BPTT gradients at stale weights.
:func:`fresh_casts` is the rule, written once: the cache off inside the block and emptied when
it ends. The precision scope holds it (a scope spans a whole run), and so does every forward-only step
(``szo.evaluators.EvaluatorBase.session`` around the probes, ``szo.zo.ProbeGuard.unperturbed_forward``
around the BN forward), so a user's own ``with torch.autocast(...): opt.step(closure)`` is safe too,
and a CUDA-graph capture holds it (``szo.models.graphed``: a replay casts the weights it runs at).

:func:`precision_policy` prepares a model for a precision (SpikingJelly's
``prepare_model_for_precision``: call it before building the optimizer) and returns a
:class:`PrecisionPolicy`; ``with policy.scope():`` runs its block in that arithmetic and puts
PyTorch's flags back afterwards. ``szo.train.fit(..., precision=...)`` holds the scope around
the whole run (BPTT's forward and backward, every probe forward, the BN forward, evaluation)
and writes :meth:`PrecisionPolicy.record` into results.json. Code that drives an optimizer
itself does the same::

    policy = precision_policy("fp32", model, "cuda")
    with policy.scope():
        opt.step(closure)

:func:`exact_fp32` is the scope of code whose floats carry exact integers (the fixed-point
backend's kernels): IEEE float32/64, autocast off, whatever the run's precision is.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from spikingjelly.activation_based.precision import prepare_model_for_precision
from torch.nn.utils import parametrize

__all__ = ["PRECISIONS", "AUTO", "PrecisionPolicy", "precision_policy", "resolve_precision", "check_precision",
           "exact_fp32", "fresh_casts", "tf32_flags",
           "refuse_cached_parametrizations"]

PRECISIONS = ("auto", "fp32", "tf32", "bf16")
# what ``auto`` means, by what the run trains (docs/evidence.md, "Precision", 3 seeds per cell on an
# H200 and the CPU): forward-only probes in fp32 (TF32 probes took one SZO-RGE(q=10) digits run to
# 71.39 % and a continual one to 86.39 %; bf16 probes keep fp32's accuracy on the CPU since issue 40's
# weight-cache fix -- the 73-74 % measured before it was the cache -- on average (a continual seed dipped
# for an epoch), but step 1.4-2.3x slower there and are unmeasured on CUDA since the fix); BPTT in fp32 too: TF32 leaves BP's own accuracy as it is
# (98.3-98.6 %) but changes its trajectory, and the continual runs downstream of TF32 BPTT ended at
# 77.22-97.78 % against 94.72-96.39 % after fp32 BPTT; bf16 BPTT keeps it on the CPU, 1.3-1.5x slower.
# ``tf32`` is 2.8x faster for Spike-ResNet18's BPTT at batch 128: a setting to choose, not a default.
AUTO = {"backprop": "fp32", "forward-only": "fp32"}


def check_precision(name: Any) -> str:
    """``name`` if it is a precision, else one ValueError naming the valid ones."""
    if not isinstance(name, str) or name not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}; valid: {', '.join(PRECISIONS)}")
    return name


def resolve_precision(name: str, *, forward_only: bool) -> str:
    """``name`` with ``auto`` replaced by :data:`AUTO`'s choice for backprop / forward-only training."""
    check_precision(name)
    if name != "auto":
        return name
    return AUTO["forward-only" if forward_only else "backprop"]


def tf32_flags() -> tuple[bool, bool]:
    """PyTorch's process-wide TF32 switches now: (cuDNN convolutions, CUDA matmuls)."""
    return bool(torch.backends.cudnn.allow_tf32), bool(torch.backends.cuda.matmul.allow_tf32)


@contextlib.contextmanager
def _tf32(enabled: bool) -> Iterator[None]:
    """TF32 on or off for cuDNN and CUDA matmuls inside the block; the previous flags after it,
    whatever happens (they are process-wide: a scope must not leak). A flag that already has the
    value is not written at all; where PyTorch's flags are frozen (``torch.backends.disable_global_flags()``,
    as PyTorch's own test suite does) cuDNN's is changed only through its bracketed ``flags()``."""
    old = tf32_flags()
    with contextlib.ExitStack() as stack:
        if old[0] != enabled:
            cudnn = torch.backends.cudnn
            if torch.backends.flags_frozen():
                stack.enter_context(cudnn.flags(
                    enabled=cudnn.enabled, benchmark=cudnn.benchmark, benchmark_limit=cudnn.benchmark_limit,
                    deterministic=cudnn.deterministic, allow_tf32=enabled, fp32_precision=cudnn.fp32_precision))
            else:
                cudnn.allow_tf32 = enabled
                stack.callback(setattr, cudnn, "allow_tf32", old[0])
        if old[1] != enabled:
            torch.backends.cuda.matmul.allow_tf32 = enabled
            stack.callback(setattr, torch.backends.cuda.matmul, "allow_tf32", old[1])
        yield


@contextlib.contextmanager
def fresh_casts() -> Iterator[None]:
    """Autocast's weight cache off inside the block (every forward casts the parameters as they
    are now) and emptied when the block ends (the casts of an enclosing autocast block are of
    weights the block may have moved); the caller's cache switch put back afterwards. The cache
    switch is PyTorch's one thread-local flag for every device, read at each cast, so this works
    inside any autocast block, the caller's own included (module doc)."""
    cached = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(cached)
        torch.clear_autocast_cache()


def refuse_cached_parametrizations(model, who: str) -> None:
    """One ValueError for a forward-only step inside ``torch.nn.utils.parametrize.cached()`` with a
    parametrized model (or no model to look at): the cache keeps each parametrized weight as first
    computed, so every probe would run the weight of before the probe moved it -- the same stale-weight
    defect as autocast's cache (:func:`fresh_casts`), but the parametrize cache has no switch a library
    can turn off for a block. The closure may hold ``cached()`` itself: each call then computes afresh."""
    if not getattr(parametrize, "_cache_enabled", 0):
        return
    if model is not None and not any(parametrize.is_parametrized(m) for m in model.modules()):
        return
    raise ValueError(f"{who}.step was called inside torch.nn.utils.parametrize.cached(): the cache would give every "
                     "probe the parametrized weights of before the probe moved them; call opt.step(closure) outside "
                     "cached() (use `with parametrize.cached():` inside the closure instead)")


@contextlib.contextmanager
def exact_fp32(device_type: str = "cuda") -> Iterator[None]:
    """IEEE float arithmetic for kernels whose floats hold exact integers: TF32 off and autocast
    off on ``device_type`` (``"cuda"`` | ``"cpu"``), inside any precision scope. TF32 exists only on
    CUDA: on the CPU no process-wide flag is read or written."""
    tf32 = _tf32(False) if device_type == "cuda" else contextlib.nullcontext()
    with tf32, torch.autocast(device_type, enabled=False):
        yield


@dataclass(frozen=True)
class PrecisionPolicy:
    """One run's arithmetic (see the module doc): ``requested`` as set, ``name`` after ``auto``,
    ``device_type`` where it runs. ``scope()`` applies it; ``record()`` says what ran."""

    requested: str
    name: str
    device_type: str
    artifacts: Any = None  # SpikingJelly's PrecisionArtifacts (bf16: its autocast context)

    @property
    def effective(self) -> str:
        """What the arithmetic is here: ``tf32`` is fp32 on a device without TF32 (the CPU)."""
        return "fp32" if self.name == "tf32" and self.device_type != "cuda" else self.name

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.name == "bf16" else None

    @contextlib.contextmanager
    def scope(self) -> Iterator["PrecisionPolicy"]:
        """The arithmetic inside the block, PyTorch's flags put back after it; autocast's weight
        cache off (:func:`fresh_casts`: a scope spans many forwards of moving weights)."""
        with _tf32(self.name == "tf32") if self.device_type == "cuda" else contextlib.nullcontext():
            ctx = self.artifacts.autocast_context() if self.artifacts is not None else contextlib.nullcontext()
            with ctx, fresh_casts():
                yield self

    def record(self) -> dict[str, Any]:
        """What results.json says of the arithmetic."""
        return {"requested": self.requested, "name": self.name, "effective": self.effective,
                "device": self.device_type, "tf32": self.name == "tf32" and self.device_type == "cuda",
                "autocast": None if self.autocast_dtype is None else str(self.autocast_dtype).replace("torch.", "")}


def precision_policy(name: str, model: torch.nn.Module | None, device: str | torch.device, *,
                     forward_only: bool = False) -> PrecisionPolicy:
    """The policy for precision ``name`` (``auto`` resolved by ``forward_only``) on ``device``;
    bf16 goes through SpikingJelly's ``prepare_model_for_precision`` (its capability check; call
    this before building the optimizer). ``model`` may be None for fp32 / tf32."""
    resolved = resolve_precision(name, forward_only=forward_only)
    dev = torch.device(device)
    artifacts = None
    if resolved == "bf16":
        if model is None:
            raise ValueError("precision 'bf16' prepares the model (SpikingJelly's precision API): pass the model")
        artifacts = prepare_model_for_precision(model, dev, "bf16")
    return PrecisionPolicy(requested=name, name=resolved, device_type=dev.type, artifacts=artifacts)
