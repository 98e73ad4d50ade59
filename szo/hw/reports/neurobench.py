"""NeuroBench's own metrics (SynOps, activation sparsity, footprint, connection sparsity) of a szo model.

NeuroBench (``neurobench``, the field's shared definitions) hooks ``nn.Conv2d`` / ``nn.Linear``
layers and activation modules while a model runs. A zoo model runs multi-step (``[T, N, ...]``
through each layer at once); NeuroBench's hooks expect one time step per call (``[N, ...]``),
so :class:`StepwiseModel` runs a copy of the model in SpikingJelly's single-step mode, one
step per call of ``forward_seq``, neuron state carried between steps (the same function:
``szo.models.streaming`` tests chunked = multi-step). SpikingJelly neurons are registered as
NeuroBench activation modules.

What each metric counts (see docs/deploy.md for the comparison with ``szo hw-report``):

* ``synops`` (``SynapticOperations``): per sample, for every Conv2d / Linear call, the number
  of (non-zero input, non-zero weight) pairs; inputs that are not binary count as MACs
  (``Effective_MACs``: the first layer on analog pixels), binary ones as ACs
  (``Effective_ACs``); ``Dense`` counts every pair. Pooling, residual adds and BN are not
  synapses to NeuroBench.
* ``activation_sparsity``: zero outputs / all outputs of every neuron layer, all steps.
* ``footprint_bytes``: bytes of all parameters and buffers (float32, BN statistics and
  ``num_batches_tracked`` included).
* ``connection_sparsity``: zero weights / all weights of the connection layers.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from spikingjelly.activation_based import functional
from spikingjelly.activation_based import neuron as sj_neuron
from torch.utils.data import DataLoader, TensorDataset

from szo.models.base import SpikingModel

__all__ = ["StepwiseModel", "neurobench_metrics"]


def _neurobench_model_base():
    try:
        from neurobench.models import NeuroBenchModel
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(f"NeuroBench metrics need the 'deploy' extra: pip install 'szo[deploy]' ({exc})") \
            from None
    return NeuroBenchModel


def StepwiseModel(model: SpikingModel, T: int):  # noqa: N802 - a class built lazily (neurobench is optional)
    """A ``neurobench`` model running ``model`` one time step per layer call; batches are
    ``[N, C, H, W]`` (repeated over ``T``) or ``[N, T, C, H, W]`` (NeuroBench's batch-first)."""
    base = _neurobench_model_base()

    class _Stepwise(base):
        def __init__(self) -> None:
            super().__init__()
            self.net = copy.deepcopy(model).eval()
            functional.set_step_mode(self.net, "s")
            self.T = T
            self.add_activation_module(sj_neuron.BaseNode)

        def __net__(self) -> torch.nn.Module:
            return self.net

        @torch.no_grad()
        def __call__(self, batch: torch.Tensor) -> torch.Tensor:
            functional.reset_net(self.net)
            outs = []
            for t in range(self.T):
                x = batch if batch.dim() == 4 else batch[:, t]
                outs.append(self.net.forward_seq(x))
            functional.reset_net(self.net)
            return torch.stack(outs)  # [T, N, classes]

    return _Stepwise()


def neurobench_metrics(model: SpikingModel, x: torch.Tensor) -> dict[str, Any]:
    """NeuroBench's metrics of ``model`` (float, eval mode) on ``x`` (``[N, C, H, W]`` static or
    ``[T, N, C, H, W]`` sequence), computed by ``neurobench.benchmarks.Benchmark``."""
    _neurobench_model_base()
    from neurobench.benchmarks import Benchmark
    from neurobench.metrics.static import ConnectionSparsity, Footprint
    from neurobench.metrics.workload import ActivationSparsity, SynapticOperations

    if not isinstance(model, SpikingModel):
        raise ValueError(f"neurobench_metrics needs a szo SpikingModel, got {type(model).__name__}")
    if x.dim() == 5:
        T, data = x.shape[0], x.transpose(0, 1).contiguous()
    elif x.dim() == 4:
        T, data = model.T, x
    else:
        raise ValueError(f"x must be [N, C, H, W] or [T, N, C, H, W], got shape {tuple(x.shape)}")
    nb_model = StepwiseModel(model, T)
    loader = DataLoader(TensorDataset(data, torch.zeros(data.shape[0], dtype=torch.long)), batch_size=data.shape[0])
    bench = Benchmark(nb_model, loader, [], [], [[Footprint, ConnectionSparsity],
                                                 [ActivationSparsity, SynapticOperations]])
    try:
        res = bench.run(quiet=True)
    finally:
        nb_model.cleanup_hooks()
    syn = res["SynapticOperations"]
    return {
        "footprint_bytes": int(res["Footprint"]),
        "connection_sparsity": float(res["ConnectionSparsity"]),
        "activation_sparsity": float(res["ActivationSparsity"]),
        "synops_effective_acs": float(syn["Effective_ACs"]),
        "synops_effective_macs": float(syn["Effective_MACs"]),
        "synops_dense": float(syn["Dense"]),
        "T": int(T), "samples": int(data.shape[0]),
        "neurobench_version": _version(),
    }


def _version() -> str:
    from importlib.metadata import version

    return version("neurobench")


def szo_counterparts(rep: dict[str, Any], quantized: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    """szo's own figures for the four NeuroBench quantities, from an ``hw_report`` dict (the
    fixed-point network's measured forward) and its ``quantized_layers()`` (integer weights)."""
    rows = rep["layers"]
    neurons = [r for r in rows if r["type"] == "neuron"]
    n_steps = sum(r["neurons"] for r in neurons)
    rate = sum(r["neurons"] * r["spikes_per_neuron_per_step"] for r in neurons) / n_steps if n_steps else 0.0
    out = {
        "synops_per_sample": rep["totals"]["synops_per_forward"],
        "activation_sparsity": 1.0 - rate,
        "footprint_bytes": rep["totals"]["inference_bytes"],
        "connection_sparsity": None,
    }
    if quantized:
        zeros = sum(int((q["w_int"] == 0).sum()) for q in quantized.values())
        total = sum(int(q["w_int"].numel()) for q in quantized.values())
        out["connection_sparsity"] = zeros / total if total else 0.0
    return out


NOTES: dict[str, str] = {
    "synops": ("NeuroBench: float model, (non-zero input, non-zero weight) pairs of Conv2d/Linear calls; analog "
               "inputs (pixels, average-pooled spike counts) are MACs, binary ones ACs. szo: fixed-point model, "
               "every input event (spike, graded value, or spike entering a sum pool) times its exact fan-out, "
               "zero weights included, plus residual identity synapses; pooled spikes count once per spike."),
    "activation_sparsity": ("Both: zero neuron outputs / all neuron outputs over all steps; NeuroBench on the "
                            "float model's spikes, szo on the fixed-point model's."),
    "footprint": ("NeuroBench: float32 parameters + buffers (BN statistics included, neuron state excluded). szo: "
                  "on-chip bytes of 8-bit weights + per-layer exponents, 13-bit biases and 2 x 24-bit neuron state "
                  "(BN folded)."),
    "connection_sparsity": ("NeuroBench: zero float weights / all weights of Conv2d/Linear (BN not folded). szo: "
                            "zero integer weights after 8-bit quantisation (BN folded)."),
}
