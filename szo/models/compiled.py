"""Compiled forward (``torch.compile``) of the zoo's models: ``model.set_compile(True)``.

What is compiled is the multi-step core, ``type(model).forward_seq`` (``[T, N, ...]`` ->
logits), called as ``fn(model, x_seq)``; input checks, static-image repetition and the
neuron reset after each forward stay eager in ``SpikingModel.forward``. Consequences:

* **Parameters perturbed in place** (every SZO probe, ``load_flat_params``, the optimizer
  update) are read by the graph at every call: with torch's default
  ``inline_inbuilt_nn_modules`` parameters and buffers are graph inputs, not constants, and
  the guards check their metadata (shape, dtype, device, requires_grad), never their values,
  so a probe does not recompile (``tests/models/test_compiled.py`` counts the graphs).
* **BatchNorm buffers**: in train mode the running statistics are updated in place by the
  graph, as in eager mode; ``szo.optim.BNStatsFreezer`` restores / commits them with
  in-place copies, which the graph reads like parameters.
* **Neuron state**: SpikingJelly's LIF state is a Python float after a reset and a tensor
  during a sequence; the reset runs eagerly after every forward, so each call starts from
  the same state and reuses one graph (inside ``persistent_state()`` the first call and the
  later ones get a graph each).
* **Cache**: one compiled function per (model class, backend, mode), shared by all instances
  (same structure = same graph, no recompile for a second model or a deep copy). It is
  compiled with ``dynamic=False``: one graph per input shape, grad mode and train/eval mode
  of the layers, each compiled once on first use (torch keeps at most
  ``torch._dynamo.config.recompile_limit`` graphs per function, 8 by default; beyond that it
  runs eagerly). A run meets a few: e.g. the full and the last (shorter) batch, eval mode for
  the test set, grad mode for BPTT.
* The chunked (streaming) forward (``time_chunk``) stays eager.
* Forward hooks registered after a graph was traced are not seen by it (torch's default
  ``torch._dynamo.config.skip_nnmodule_hook_guards``): code that drives layers through
  temporary hooks (``szo.distributed.SyncBatchNorm``) must not run on a compiled model;
  ``SZO`` refuses that combination.

On 2 CPU cores inductor compiled one graph of the digits ConvNet in 8-20 s and one of
Spike-ResNet20 in 53 s (quiet machine) to ~250 s (heavily loaded); its on-disk cache
(``/tmp/torchinductor_$USER``) let a later process compile a digits graph it had seen in 3 s.
docs/performance.md has the measurements and when compiling pays.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

__all__ = ["check_compile", "compiled_forward_seq", "graph_count"]

MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def check_compile(backend: str = "inductor", mode: str | None = None) -> tuple[str, str | None]:
    """One clear ValueError for an unknown backend or mode; returns ``(backend, mode)``."""
    if not isinstance(backend, str):
        raise ValueError(f"compile backend must be a string, got {backend!r}")
    valid = torch._dynamo.list_backends(exclude_tags=())
    if backend not in valid:
        raise ValueError(f"unknown torch.compile backend {backend!r}; valid: {', '.join(sorted(valid))}")
    if mode not in MODES:
        raise ValueError(f"unknown torch.compile mode {mode!r}; valid: {', '.join(str(m) for m in MODES)}")
    if mode is not None and backend != "inductor":
        raise ValueError(f"a compile mode ({mode!r}) applies to backend 'inductor' only, got backend {backend!r}")
    return backend, mode


@functools.lru_cache(maxsize=None)
def compiled_forward_seq(cls: type, backend: str = "inductor", mode: str | None = None) -> Callable[..., Any]:
    """``torch.compile(cls.forward_seq)``, one per (class, backend, mode); call as ``fn(model, x_seq)``."""
    return torch.compile(cls.forward_seq, backend=backend, mode=mode, dynamic=False)


def graph_count() -> int:
    """Graphs compiled by torch.compile in this process so far (``torch._dynamo`` counters):
    a difference of two readings is the number of (re)compilations in between."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
