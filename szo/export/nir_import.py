"""NIR (Neuromorphic Intermediate Representation) graphs -> szo models.

:func:`from_nir` turns a ``nir.NIRGraph`` (or a ``.nir`` file, :func:`read_nir`) into a
:class:`NIRNetwork`, a :class:`~szo.models.SpikingModel` built from SpikingJelly multi-step
layers that every szo evaluation path runs. The conventions it reads back (soft reset in node
metadata, ``tau = tau_steps * dt``, ``r``, fixed-point integers beside the floats) are those
:mod:`szo.export.nir_export` writes, described there; docs/deploy.md lists what is imported.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from spikingjelly.activation_based import layer
from spikingjelly.activation_based import neuron as sj_neuron
from torch import nn

from szo.export.nir_common import DEFAULT_DT, RESETS, SumPool2d, meta_str, nir_modules, why
from szo.hw.fixed import DECAY_SHIFT, STATE_SHIFT, int_range, threshold_to_int
from szo.models.base import SpikingModel
from szo.models.foreign import OUTPUTS
from szo.models.neurons import make_neuron

__all__ = ["MAX_ELEMENTS", "MAX_T", "NIRNetwork", "from_nir", "read_nir"]


def read_nir(path: str | os.PathLike) -> Any:
    """Read a ``.nir`` file; a missing file raises ``FileNotFoundError``, anything else that is
    not a NIR graph raises one ``ValueError`` naming the file and the bad field."""
    nir, _ = nir_modules()
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no NIR file {str(p)!r}")
    try:
        return nir.read(p)
    except Exception as exc:  # h5py / nir raise many types for a bad file: one ValueError naming the culprit
        raise ValueError(f"{p} is not a valid NIR file: {_locate_bad_node(p) or why(exc)}") from None


def _locate_bad_node(path: Path) -> str | None:
    """``node 'NAME' (TYPE): why`` for the first node of a NIR file that does not parse."""
    import h5py
    import nir
    from nir.serialization import hdf2dict

    try:
        with h5py.File(path, "r") as f:
            nodes = hdf2dict(f["node"]).get("nodes")
    except Exception as exc:
        return f"not an HDF5 NIR container ({why(exc)})"
    if not isinstance(nodes, dict):
        return "missing field 'node/nodes'"
    for name, d in nodes.items():
        try:
            kind = d.get("type", "?") if isinstance(d, dict) else "?"
            nir.dict2NIRNode(dict(d))
        except Exception as exc:
            return f"node {name!r} ({kind}): {why(exc)}"
    return None


def _uniform(node_name: str, field: str, value: Any) -> float:
    arr = np.asarray(value, dtype=np.float64)
    u = np.unique(arr)
    if u.size != 1:
        raise ValueError(f"NIR node {node_name!r}: field {field!r} must be the same for every neuron "
                         f"(szo's LIF has scalar parameters), got {u.size} distinct values")
    return float(u[0])


class _Threshold(nn.Module):
    """NIR ``Threshold``: ``H(x - threshold)`` (strictly above: ``x > threshold``)."""

    def __init__(self, threshold: np.ndarray) -> None:
        super().__init__()
        self.register_buffer("threshold", torch.as_tensor(np.asarray(threshold, dtype=np.float32)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x > self.threshold).to(x.dtype)


def _pair(node_name: str, field: str, v: Any) -> tuple[int, int]:
    a = np.atleast_1d(np.asarray(v)).astype(np.int64).tolist()
    if len(a) == 1:
        a = a * 2
    if len(a) != 2:
        raise ValueError(f"NIR node {node_name!r}: field {field!r} must hold 1 or 2 ints, got {v!r}")
    return int(a[0]), int(a[1])


class _NodeMap:
    """NIR node -> SpikingJelly multi-step module (``nirtorch.nir_to_torch`` node map)."""

    def __init__(self, dt: float) -> None:
        self.dt = dt
        self.name: dict[int, str] = {}

    def __call__(self, nir):  # the node map
        return {nir.Input: lambda n: nn.Identity(), nir.Output: lambda n: nn.Identity(),
                nir.Conv2d: self.conv2d, nir.Affine: self.affine, nir.Linear: self.linear,
                nir.AvgPool2d: self.avgpool, nir.SumPool2d: self.sumpool, nir.Threshold: self.threshold,
                nir.Flatten: self.flatten, nir.LIF: self.lif, nir.IF: self.if_node}

    def _n(self, node: Any) -> str:
        return self.name.get(id(node), type(node).__name__)

    def conv2d(self, n: Any) -> nn.Module:
        w = np.asarray(n.weight, dtype=np.float32)
        if w.ndim != 4:
            raise ValueError(f"NIR node {self._n(n)!r}: Conv2d field 'weight' must be 4-D, got shape {w.shape}")
        if int(np.asarray(n.groups)) != 1:
            raise ValueError(f"NIR node {self._n(n)!r}: Conv2d field 'groups' must be 1, got {n.groups}")
        m = layer.Conv2d(w.shape[1], w.shape[0], w.shape[2:], stride=_pair(self._n(n), "stride", n.stride),
                         padding=_pair(self._n(n), "padding", n.padding),
                         dilation=_pair(self._n(n), "dilation", n.dilation), bias=True, step_mode="m")
        m.weight.data.copy_(torch.from_numpy(w))
        m.bias.data.copy_(torch.from_numpy(np.asarray(n.bias, dtype=np.float32).reshape(-1)))
        return m

    def affine(self, n: Any) -> nn.Module:
        w = np.asarray(n.weight, dtype=np.float32)
        m = layer.Linear(w.shape[1], w.shape[0], bias=True, step_mode="m")
        m.weight.data.copy_(torch.from_numpy(w))
        m.bias.data.copy_(torch.from_numpy(np.asarray(n.bias, dtype=np.float32)))
        return m

    def linear(self, n: Any) -> nn.Module:
        w = np.asarray(n.weight, dtype=np.float32)
        m = layer.Linear(w.shape[1], w.shape[0], bias=False, step_mode="m")
        m.weight.data.copy_(torch.from_numpy(w))
        return m

    def avgpool(self, n: Any) -> nn.Module:
        return layer.AvgPool2d(_pair(self._n(n), "kernel_size", n.kernel_size), _pair(self._n(n), "stride", n.stride),
                               _pair(self._n(n), "padding", n.padding), step_mode="m")

    def sumpool(self, n: Any) -> nn.Module:
        return SumPool2d(_pair(self._n(n), "kernel_size", n.kernel_size), _pair(self._n(n), "stride", n.stride),
                          _pair(self._n(n), "padding", n.padding))

    def threshold(self, n: Any) -> nn.Module:
        return _Threshold(n.threshold)

    def flatten(self, n: Any) -> nn.Module:
        start, end = int(n.start_dim), int(n.end_dim)  # NIR dims exclude the batch; add it (and time, below)
        return layer.Flatten(start + 1 if start >= 0 else start, end + 1 if end >= 0 else end, step_mode="m")

    def lif(self, n: Any) -> nn.Module:
        name = self._n(n)
        meta = getattr(n, "metadata", None) or {}
        tau = _uniform(name, "tau", n.tau) / self.dt
        if not np.isfinite(tau) or tau <= 1.0:
            raise ValueError(f"NIR node {name!r}: LIF field 'tau' / dt must be > 1 (one step of dt = {self.dt} s), "
                             f"got {tau:g}")
        r = _uniform(name, "r", n.r)
        if np.isclose(r, tau, rtol=1e-6):
            decay_input = False
        elif np.isclose(r, 1.0, rtol=1e-6):
            decay_input = True
        else:
            raise ValueError(f"NIR node {name!r}: LIF field 'r' must be tau/dt = {tau:g} (input not decayed, the "
                             f"paper's LIF) or 1 (decayed input), got {r:g}")
        reset = meta_str(meta, "reset", "value")
        if reset not in RESETS:
            raise ValueError(f"NIR node {name!r}: metadata 'reset' must be one of {list(RESETS)}, got {reset!r}")
        v_leak, v_reset = _uniform(name, "v_leak", n.v_leak), _uniform(name, "v_reset", n.v_reset)
        if reset == "subtract" and v_leak != 0.0:
            raise ValueError(f"NIR node {name!r}: LIF field 'v_leak' must be 0 with a subtractive reset, got {v_leak:g}")
        if reset == "value" and v_leak != v_reset:
            raise ValueError(f"NIR node {name!r}: LIF field 'v_leak' must equal 'v_reset' ({v_reset:g}) for "
                             f"SpikingJelly's LIF, got {v_leak:g}")
        if "tau_steps" in meta:  # written by szo: the exact float tau (tau/dt can round in the last bit)
            tau = float(meta["tau_steps"])
        return make_neuron("lif", tau=tau, decay_input=decay_input, v_threshold=_uniform(name, "v_threshold",
                                                                                          n.v_threshold),
                           v_reset=None if reset == "subtract" else v_reset)


    def if_node(self, n: Any) -> nn.Module:
        name = self._n(n)
        meta = getattr(n, "metadata", None) or {}
        r = _uniform(name, "r", n.r)
        if not np.isclose(r * self.dt, 1.0, rtol=1e-6):
            raise ValueError(f"NIR node {name!r}: IF field 'r' must be 1/dt = {1.0 / self.dt:g} (v += x per step of "
                             f"dt = {self.dt} s, SpikingJelly's IFNode), got {r:g}")
        reset = meta_str(meta, "reset", "value")
        if reset not in RESETS:
            raise ValueError(f"NIR node {name!r}: metadata 'reset' must be one of {list(RESETS)}, got {reset!r}")
        v_reset = _uniform(name, "v_reset", n.v_reset)
        return sj_neuron.IFNode(v_threshold=_uniform(name, "v_threshold", n.v_threshold),
                                v_reset=None if reset == "subtract" else v_reset, step_mode="m")


class NIRNetwork(SpikingModel):
    """A NIR graph run by SpikingJelly multi-step layers: ``model(x)`` -> ``[T, N, num_classes]``.

    ``forward`` takes ``[N, C, H, W]`` (repeated over ``T``) or ``[T, N, C, H, W]`` like every
    zoo model; ``T`` and ``num_classes`` come from the graph (szo metadata or its output
    type). A graph with metadata ``output = "rate"`` (a foreign network's firing-rate readout)
    gives the mean over T of its output, ``[1, N, num_classes]``, as ``ForeignModel`` does.
    The parameters are those of the graph (BN already folded), so the flat-parameter
    layout is not the source model's: an imported network is for evaluation, streaming and
    deployment checks, not for resuming SZO in the source model's subspace.
    """

    def __init__(self, graph: Any, *, T: int | None = None, dt: float | None = None) -> None:
        nir, nirtorch = nir_modules()
        if not isinstance(graph, nir.NIRGraph):
            raise ValueError(f"from_nir needs a nir.NIRGraph or a .nir path, got {type(graph).__name__}")
        meta = dict(graph.metadata or {})
        dt = float(meta.get("dt", DEFAULT_DT)) if dt is None else float(dt)
        node_map = _NodeMap(dt)
        supported = node_map(nir)
        outputs = []
        for name, node in graph.nodes.items():
            if type(node) not in supported:
                raise ValueError(f"NIR node {name!r} has type {type(node).__name__}, which szo cannot run; supported: "
                                 f"{sorted(t.__name__ for t in supported)}")
            node_map.name[id(node)] = name
            if isinstance(node, nir.Output):
                outputs.append(node)
        names = set(graph.nodes)
        for s, d in graph.edges:
            if s not in names or d not in names:
                raise ValueError(f"NIR graph edge ({s!r}, {d!r}) names a node that is not in the graph")
        _check_feed_forward(graph.edges)
        for name, node in graph.nodes.items():
            _check_node_values(name, node)
            _check_fixed_point(name, node, meta, dt)
        if len(outputs) != 1:
            raise ValueError(f"NIR graph must have exactly one Output node, got {len(outputs)}")
        out_t = np.asarray(outputs[0].output_type.get("output", []) if outputs[0].output_type else []).reshape(-1)
        num_classes = int(meta.get("num_classes", int(np.prod(out_t)) if out_t.size else 0))
        if num_classes < 1:
            raise ValueError("NIR graph: cannot tell the number of classes (no 'num_classes' metadata and no Output "
                             "type)")
        T = meta.get("T", 0) if T is None else T
        try:
            T = int(T)
        except (TypeError, ValueError):
            raise ValueError(f"NIR graph: T = {T!r} is not a number of time steps") from None
        if T < 1:
            raise ValueError("NIR graph has no 'T' metadata: pass T= (time steps for static inputs)")
        if T > MAX_T:
            raise ValueError(f"NIR graph: T = {T} time steps is out of range; szo runs 1 <= T <= {MAX_T}")
        super().__init__(num_classes=num_classes, T=T, model_name=meta_str(meta, "model_name", "nir"))
        output = meta_str(meta, "output", "sequence")
        if output not in OUTPUTS:
            raise ValueError(f"NIR graph: metadata 'output' must be one of {list(OUTPUTS)}, got {output!r}")
        self.dt = dt
        self.nir_metadata = meta
        self.output = output
        self.graph_module = nirtorch.nir_to_torch(graph, supported)

    def forward_seq(self, x_seq: torch.Tensor) -> torch.Tensor:
        out = self.graph_module(x_seq)
        out = out[0] if isinstance(out, tuple) else out
        return out.mean(0, keepdim=True) if self.output == "rate" else out


MAX_T = 10_000
"""The most time steps an imported graph may ask for (metadata ``T`` or ``T=``)."""
MAX_ELEMENTS = 1 << 30
"""The most elements one node's array or input / output shape may have."""


def _check_feed_forward(edges: Any) -> None:
    """Refuse a recurrent edge or any cycle: szo's importer runs feed-forward graphs (nirtorch
    would drop a back edge silently and run the rest as if it were feed-forward)."""
    succ: dict[str, list[str]] = {}
    indeg: dict[str, int] = {}
    for s, d in edges:
        if s == d:
            raise ValueError(f"NIR graph has a recurrent edge {s!r} -> {s!r}; szo imports feed-forward graphs only "
                             "(its models have no recurrent connections)")
        succ.setdefault(s, []).append(d)
        indeg[d] = indeg.get(d, 0) + 1
        indeg.setdefault(s, 0)
    ready = [n for n, k in indeg.items() if k == 0]
    seen = 0
    while ready:
        n = ready.pop()
        seen += 1
        for m in succ.get(n, []):
            indeg[m] -= 1
            if indeg[m] == 0:
                ready.append(m)
    if seen < len(indeg):
        loop = sorted(n for n, k in indeg.items() if k > 0)
        raise ValueError(f"NIR graph has a cycle through {', '.join(map(repr, loop[:6]))}; szo imports feed-forward "
                         "graphs only (its models have no recurrent connections)")


def _check_node_values(name: str, node: Any) -> None:
    """Every array of a node finite and of a bounded size; shapes bounded."""
    for attr, v in vars(node).items():
        if attr in ("input_type", "output_type") and isinstance(v, dict):  # port name -> shape
            for k, shape in v.items():
                dims = np.asarray(shape, dtype=np.float64).reshape(-1)
                if dims.size and (dims.min() < 0 or float(np.prod(dims)) > MAX_ELEMENTS):
                    raise ValueError(f"NIR node {name!r}: {attr} {k!r} has shape {[int(x) for x in dims]}, out of "
                                     f"range (at most {MAX_ELEMENTS} elements)")
            continue
        if isinstance(v, np.ndarray) and v.dtype.kind in "fc":
            if v.size > MAX_ELEMENTS:
                raise ValueError(f"NIR node {name!r}: {attr} has {v.size} elements, more than {MAX_ELEMENTS}")
            bad = int((~np.isfinite(v)).sum())
            if bad:
                raise ValueError(f"NIR node {name!r}: {attr} holds {bad} non-finite value(s) (NaN / inf); "
                                 "szo does not run such a graph")


_REFUSE = "a chip loads the integers, a float simulator the floats: szo refuses a fixed-point graph whose two forms differ"


def _int_array(name: str, key: str, v: Any, shape: tuple[int, ...]) -> np.ndarray:
    a = np.asarray(v)
    if a.dtype.kind not in "iu" or a.shape != shape:
        raise ValueError(f"NIR node {name!r}: metadata {key!r} must be an integer array of shape {list(shape)} "
                         f"(the float field's), got {a.dtype} {list(a.shape)}")
    return a.astype(np.int64)


def _same(name: str, what: str, want: np.ndarray, have: Any) -> None:
    have = np.asarray(have, dtype=np.float32)
    bad = want != have
    if bad.any():
        diff = float(np.abs(want.astype(np.float64) - have.astype(np.float64)).max())
        raise ValueError(f"NIR node {name!r}: {what} disagree(s) with its float field at {int(bad.sum())} of "
                         f"{bad.size} entries (largest |difference| {diff:g}); {_REFUSE}")


def _check_fixed_point(name: str, node: Any, graph_meta: dict[str, Any], dt: float) -> None:
    """A fixed-point graph (``to_nir`` of a ``FixedPointNetwork``) holds every synapse twice: the
    integers a chip loads (metadata ``w_int``, ``exp``, ``bias_int``; neurons' ``threshold_int``,
    ``voltage_decay_int``) and the floats a simulator runs. Both must be the same network: the
    floats exactly ``w_int * 2**exp`` and ``bias_int / 2**state_shift`` (float32), the mantissas in
    the graph's ``precision_weight_bits``, the threshold and decay those of the integers."""
    meta = getattr(node, "metadata", None) or {}
    fixed = int(np.asarray(graph_meta.get("fixed_point", 0)))
    synapse = hasattr(node, "weight") and type(node).__name__ in ("Conv2d", "Affine", "Linear")
    if synapse and "w_int" not in meta:
        if fixed:
            raise ValueError(f"NIR node {name!r}: the graph is fixed-point (metadata fixed_point = 1) but this synapse "
                             "has no integer weights (metadata w_int / exp)")
        return
    if synapse:
        weight = np.asarray(node.weight)
        w_int = _int_array(name, "w_int", meta["w_int"], weight.shape)
        try:
            exp = int(np.asarray(meta["exp"]))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"NIR node {name!r}: metadata 'w_int' needs an integer 'exp' (weight = w_int * 2**exp)") \
                from None
        if "precision_weight_bits" in graph_meta:
            bits = int(np.asarray(graph_meta["precision_weight_bits"]))
            lo, hi = int_range(bits)
            out = int(((w_int < lo) | (w_int > hi)).sum())
            if out:
                raise ValueError(f"NIR node {name!r}: {out} integer weight(s) (metadata w_int) outside the graph's "
                                 f"{bits}-bit range [{lo}, {hi}] (precision_weight_bits); {_REFUSE}")
        _same(name, "its integer weights w_int * 2**exp", (w_int.astype(np.float64) * 2.0 ** exp).astype(np.float32),
              weight)
        if "bias_int" in meta:
            bias = np.asarray(getattr(node, "bias", np.zeros(weight.shape[0])))
            b_int = _int_array(name, "bias_int", meta["bias_int"], bias.shape)
            shift = int(np.asarray(graph_meta.get("state_shift", STATE_SHIFT)))
            _same(name, f"its integer bias bias_int / 2**{shift}",
                  (b_int.astype(np.float64) / float(1 << shift)).astype(np.float32), bias)
    if "threshold_int" in meta and hasattr(node, "v_threshold"):
        v_th = _uniform(name, "v_threshold", node.v_threshold)
        try:
            want = threshold_to_int(v_th)
        except ValueError:
            want = None
        if want is None or int(np.asarray(meta["threshold_int"])) != want:
            raise ValueError(f"NIR node {name!r}: metadata threshold_int = {int(np.asarray(meta['threshold_int']))} is "
                             f"not the float threshold {v_th:g} in state units ({want}); {_REFUSE}")
    if "voltage_decay_int" in meta and hasattr(node, "tau"):
        d = int(np.asarray(meta["voltage_decay_int"]))
        tau = float(meta["tau_steps"]) if "tau_steps" in meta else _uniform(name, "tau", node.tau) / dt
        if not 0 < d <= (1 << DECAY_SHIFT) or not np.isclose(tau, (1 << DECAY_SHIFT) / d, rtol=1e-6):
            raise ValueError(f"NIR node {name!r}: metadata voltage_decay_int = {d} is not the float tau {tau:g} steps "
                             f"(tau = {1 << DECAY_SHIFT} / voltage_decay_int); {_REFUSE}")


def from_nir(source: Any, *, T: int | None = None, dt: float | None = None) -> NIRNetwork:
    """:class:`NIRNetwork` from a ``nir.NIRGraph`` or a ``.nir`` file path."""
    if isinstance(source, (str, os.PathLike)):
        source = read_nir(source)
    return NIRNetwork(source, T=T, dt=dt)
