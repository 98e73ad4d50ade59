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
from spikingjelly.activation_based import functional, layer
from spikingjelly.activation_based import neuron as sj_neuron
from torch import nn

from szo.export.nir_common import DEFAULT_DT, RESETS, Delay, Scale, SumPool2d, Threshold, meta_str, nir_modules, why
from szo.export.nir_graph import GraphRunner, inline_subgraphs, plan_graph
from szo.hw.fixed import DECAY_SHIFT, STATE_SHIFT, int_range, threshold_to_int
from szo.models.base import SpikingModel
from szo.models.cuba import CUBA_FIELDS, CubaLIFNode
from szo.models.foreign import OUTPUTS
from szo.models.neurons import make_neuron
from szo.models.nir_dynamics import CUBA_LI_FIELDS, LI_FIELDS, CubaLINode, INode, LINode

__all__ = ["MAX_ELEMENTS", "MAX_NESTING", "MAX_T", "STABILITY_RULE", "TIME_CONSTANTS", "NIRNetwork",
           "check_time_constants", "from_nir", "read_nir"]


def read_nir(path: str | os.PathLike) -> Any:
    """Read a ``.nir`` file; a missing file raises ``FileNotFoundError``, anything else that is
    not a NIR graph raises one ``ValueError`` naming the file and the bad field."""
    nir, _ = nir_modules()
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no NIR file {str(p)!r}")
    depth = _nesting_depth(p)
    if depth is not None and depth[1]:
        raise ValueError(f"{p} links one subgraph (NIRGraph node) group in twice, an HDF5 hard link that nir.write "
                         f"never writes (a link back to an enclosing graph nests it without end); szo reads trees "
                         f"of subgraphs at most {MAX_NESTING} levels deep")
    if depth is not None and depth[0] > MAX_NESTING:
        raise ValueError(f"{p} nests subgraphs (NIRGraph nodes) {depth[0]} levels deep; szo reads at most "
                         f"{MAX_NESTING} levels (nir.read recurses once per level)")
    try:
        return nir.read(p)
    except RecursionError:  # a nesting our count missed (e.g. an unusual layout): still one line
        raise ValueError(f"{p}: nir.read ran out of Python recursion depth (subgraphs nested too deep); szo reads at "
                         f"most {MAX_NESTING} levels") from None
    except Exception as exc:  # h5py / nir raise many types for a bad file: one ValueError naming the culprit
        raise ValueError(f"{p} is not a valid NIR file: {_locate_bad_node(p) or why(exc)}") from None


MAX_NESTING = 32
"""The deepest nesting of subgraphs (``NIRGraph`` nodes) :func:`read_nir` reads: ``nir.read``
recurses a few Python frames per level and fails with a RecursionError past ~330 levels (real
graphs nest 1 to 3: snnTorch writes a recurrent layer as one subgraph)."""


def _nesting_depth(path: Path) -> tuple[int, bool] | None:
    """``(depth, linked)``: how many levels of ``NIRGraph`` nodes the file nests (0: none), walked
    iteratively (no recursion); ``linked`` when an HDF5 hard link brings a subgraph group in a
    second time (``nir.write`` never does; a link to an enclosing group makes the nesting endless),
    where the walk stops. None when
    the file is not laid out as ``nir.write`` writes (``nir.read`` then says why)."""
    import h5py

    def kind(g) -> str:
        t = g.get("type") if isinstance(g, h5py.Group) else None
        v = t[()] if isinstance(t, h5py.Dataset) else b""
        return v.decode(errors="replace") if isinstance(v, bytes) else str(v)

    try:
        with h5py.File(path, "r") as f:
            root = f["node"]
            todo, deepest, seen = [(root, 0)], 0, {root.id}
            while todo:
                g, depth = todo.pop()
                deepest = max(deepest, depth)
                nodes = g.get("nodes")
                if not isinstance(nodes, h5py.Group):
                    continue
                for c in nodes.values():
                    if kind(c) != "NIRGraph":
                        continue
                    if c.id in seen:  # a hard link back to a group already walked
                        return max(deepest, depth + 1) + 1, True
                    seen.add(c.id)
                    todo.append((c, depth + 1))
            return deepest, False
    except Exception:  # not an HDF5 file, no 'node' group, ...: nir.read's error says what is wrong
        return None


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


TIME_CONSTANTS: dict[str, tuple[str, ...]] = {"LIF": ("tau",), "CubaLIF": ("tau_syn", "tau_mem"), "LI": ("tau",),
                                              "CubaLI": ("tau_syn", "tau_mem"), "IF": (), "I": ()}
"""The time constants (seconds) of each neuron kind szo imports; ``IF`` and ``I`` have none."""
STABILITY_RULE = ("every time constant must be longer than one step, tau / dt > 1 (forward Euler multiplies the "
                  "state by 1 - dt / tau each step: at tau <= dt it is forgotten or flips sign, and grows without "
                  "bound below dt / 2)")
"""szo's one stability rule for every neuron kind on import (:func:`check_time_constants`)."""
_DT_HINT = "give the step the graph was made for: szo import --dt SECONDS (from_nir(..., dt=SECONDS))"


def check_time_constants(name: str, node: Any, dt: float) -> None:
    """:data:`STABILITY_RULE` for NIR node ``name``: each of its :data:`TIME_CONSTANTS` against
    ``dt``, at every neuron; one ValueError naming the node, the field, how many steps the
    shortest is and how to give another dt."""
    kind = type(node).__name__
    for field in TIME_CONSTANTS.get(kind, ()):
        with np.errstate(all="ignore"):
            steps = np.asarray(getattr(node, field), dtype=np.float64) / dt
        bad = ~(steps > 1)  # NaN is bad too
        if bad.any():
            shortest = float(np.min(np.where(np.isnan(steps), -np.inf, steps)))
            raise ValueError(f"NIR node {name!r} ({kind}): {STABILITY_RULE}; field {field!r} is {shortest:g} "
                             f"step(s) of dt = {dt:g} s at {int(bad.sum())} of {bad.size} neuron(s); {_DT_HINT}")


def _uniform(node_name: str, field: str, value: Any) -> float:
    arr = np.asarray(value, dtype=np.float64)
    u = np.unique(arr)
    if u.size != 1:
        raise ValueError(f"NIR node {node_name!r}: field {field!r} must be the same for every neuron "
                         f"(szo's LIF has scalar parameters), got {u.size} distinct values")
    return float(u[0])


def _one(node_name: str, field: str, v: Any) -> int:
    a = np.atleast_1d(np.asarray(v)).reshape(-1)
    if a.size != 1 or a.dtype.kind not in "iuf" or a[0] != int(a[0]):
        raise ValueError(f"NIR node {node_name!r}: field {field!r} must be one int, got {v!r}")
    return int(a[0])


def _pair(node_name: str, field: str, v: Any) -> tuple[int, int]:
    a = np.atleast_1d(np.asarray(v)).astype(np.int64).tolist()
    if len(a) == 1:
        a = a * 2
    if len(a) != 2:
        raise ValueError(f"NIR node {node_name!r}: field {field!r} must hold 1 or 2 ints, got {v!r}")
    return int(a[0]), int(a[1])


class _NodeMap:
    """NIR node type -> the multi-step module that runs it (SpikingJelly layers, szo's neurons)."""

    def __init__(self, dt: float) -> None:
        self.dt = dt
        self.name: dict[int, str] = {}

    def __call__(self, nir):  # the node map
        return {nir.Input: None, nir.Output: None, nir.Conv2d: self.conv2d, nir.Affine: self.affine, nir.Linear: self.linear,
                nir.AvgPool2d: self.avgpool, nir.SumPool2d: self.sumpool, nir.Threshold: self.threshold,
                nir.Flatten: self.flatten, nir.LIF: self.lif, nir.IF: self.if_node, nir.CubaLIF: self.cuba_lif,
                nir.LI: self.li, nir.CubaLI: self.cuba_li, nir.I: self.integrator, nir.Delay: self.delay,
                nir.Scale: self.scale, nir.Conv1d: self.conv1d}

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

    def conv1d(self, n: Any) -> nn.Module:
        name = self._n(n)
        w = np.asarray(n.weight, dtype=np.float32)
        if w.ndim != 3:
            raise ValueError(f"NIR node {name!r}: Conv1d field 'weight' must be 3-D (C_out, C_in / groups, K), got "
                             f"shape {w.shape}")
        groups = _one(name, "groups", n.groups)
        if groups < 1 or w.shape[0] % groups:
            raise ValueError(f"NIR node {name!r}: Conv1d field 'groups' must divide C_out = {w.shape[0]}, got {groups}")
        padding = n.padding.decode() if isinstance(n.padding, bytes) else n.padding
        if isinstance(padding, np.ndarray) and padding.dtype.kind in "SUO":
            padding = str(padding.reshape(-1)[0].decode() if isinstance(padding.reshape(-1)[0], bytes)
                          else padding.reshape(-1)[0])
        if not isinstance(padding, str):
            padding = _one(name, "padding", padding)
        elif padding not in ("same", "valid"):
            raise ValueError(f"NIR node {name!r}: Conv1d field 'padding' must be an int, 'same' or 'valid', got "
                             f"{padding!r}")
        m = layer.Conv1d(w.shape[1] * groups, w.shape[0], w.shape[2], stride=_one(name, "stride", n.stride),
                         padding=padding, dilation=_one(name, "dilation", n.dilation), groups=groups, bias=True,
                         step_mode="m")
        m.weight.data.copy_(torch.from_numpy(w))
        m.bias.data.copy_(torch.from_numpy(np.asarray(n.bias, dtype=np.float32).reshape(-1)))
        return m

    def scale(self, n: Any) -> nn.Module:
        return Scale(n.scale)

    def delay(self, n: Any) -> nn.Module:
        name = self._n(n)
        steps = np.asarray(n.delay, dtype=np.float64) / self.dt
        whole = np.rint(steps)
        if not (np.allclose(steps, whole, rtol=1e-6, atol=1e-6) and whole.min(initial=0) >= 0
                and whole.max(initial=0) <= MAX_T):
            worst = float(steps.reshape(-1)[np.argmax(np.abs(steps - whole).reshape(-1))]) if steps.size else 0.0
            raise ValueError(f"NIR node {name!r}: Delay field 'delay' must be a whole number of steps of dt = "
                             f"{self.dt:g} s, from 0 to {MAX_T}, got {worst:g} steps; {_DT_HINT}")
        return Delay(whole.astype(np.int64), self.dt)

    def li(self, n: Any) -> nn.Module:
        return LINode({k: getattr(n, k) for k in LI_FIELDS}, self.dt)

    def cuba_li(self, n: Any) -> nn.Module:
        return CubaLINode({k: getattr(n, k) for k in CUBA_LI_FIELDS}, self.dt)

    def integrator(self, n: Any) -> nn.Module:
        gain = np.asarray(n.r, dtype=np.float64) * self.dt
        with np.errstate(over="ignore"):
            finite = np.isfinite(gain.astype(np.float32)).all()
        if not finite:
            raise ValueError(f"NIR node {self._n(n)!r}: I field 'r' times dt = {self.dt:g} s overflows float32 "
                             f"(the step v += dt r x); {_DT_HINT}")
        return INode({"r": n.r}, self.dt)

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
        return Threshold(n.threshold)

    def flatten(self, n: Any) -> nn.Module:
        start, end = int(n.start_dim), int(n.end_dim)  # NIR dims exclude the batch; add it (and time, below)
        return layer.Flatten(start + 1 if start >= 0 else start, end + 1 if end >= 0 else end, step_mode="m")

    def lif(self, n: Any) -> nn.Module:
        name = self._n(n)
        meta = getattr(n, "metadata", None) or {}
        tau = _uniform(name, "tau", n.tau) / self.dt  # > 1: check_time_constants
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
            steps = float(np.asarray(meta["tau_steps"]))
            if not np.isclose(steps, tau, rtol=1e-6):
                raise ValueError(f"NIR node {name!r}: metadata tau_steps = {steps:g} is not field 'tau' / dt = {tau:g} "
                                 f"(dt = {self.dt:g} s); {_DT_HINT}")
            tau = steps
        return make_neuron("lif", tau=tau, decay_input=decay_input, v_threshold=_uniform(name, "v_threshold",
                                                                                          n.v_threshold),
                           v_reset=None if reset == "subtract" else v_reset)


    def cuba_lif(self, n: Any) -> nn.Module:
        """``nir.CubaLIF`` -> :class:`szo.models.cuba.CubaLIFNode` (norse's discretisation, per-neuron
        arrays as they are); a subtractive reset (szo's LIF metadata) is not its reading."""
        name = self._n(n)
        meta = getattr(n, "metadata", None) or {}
        if meta_str(meta, "reset", "value") != "value":
            raise ValueError(f"NIR node {name!r}: CubaLIF resets to v_reset; metadata 'reset' must be 'value', got "
                             f"{meta_str(meta, 'reset', 'value')!r}")
        fields = {k: np.asarray(getattr(n, k), dtype=np.float64) for k in CUBA_FIELDS}  # taus: check_time_constants
        shape = fields["v_threshold"].shape
        bad = [k for k, a in fields.items() if a.shape != shape]
        if bad:
            raise ValueError(f"NIR node {name!r}: CubaLIF fields {bad} must have v_threshold's shape {list(shape)}")
        return CubaLIFNode(fields, self.dt)

    def if_node(self, n: Any) -> nn.Module:
        name = self._n(n)
        meta = getattr(n, "metadata", None) or {}
        r = _uniform(name, "r", n.r)
        if not np.isclose(r * self.dt, 1.0, rtol=1e-6):
            hint = (f"; a discrete-time graph (sinabs writes r = 1 and no dt) runs with dt = 1 / r = {1.0 / r:g} s: "
                    f"szo import --dt {1.0 / r:g} (from_nir(..., dt={1.0 / r:g}))" if r > 0 else "")
            raise ValueError(f"NIR node {name!r}: IF field 'r' must be 1/dt = {1.0 / self.dt:g} (v += x per step of "
                             f"dt = {self.dt:g} s, SpikingJelly's IFNode), got {r:g}{hint}")
        reset = meta_str(meta, "reset", "value")
        if reset not in RESETS:
            raise ValueError(f"NIR node {name!r}: metadata 'reset' must be one of {list(RESETS)}, got {reset!r}")
        v_reset = _uniform(name, "v_reset", n.v_reset)
        return sj_neuron.IFNode(v_threshold=_uniform(name, "v_threshold", n.v_threshold),
                                v_reset=None if reset == "subtract" else v_reset, step_mode="m")


class NIRNetwork(SpikingModel):
    """A NIR graph run by multi-step layers: ``model(x)`` -> ``[T, N, *output]``.

    ``forward`` takes one frame per sample ``[N, *input]`` (repeated over ``T``) or a sequence
    ``[T, N, *input]``, ``input`` being the shape of the graph's ``Input`` node (``[C, H, W]`` for
    szo's exports, ``[12]`` for norse's braille network); ``T`` and ``num_classes`` come from the
    graph (szo metadata or its output type). A graph without ``T`` metadata runs sequences (their
    own T); a frame needs ``T=``. A graph with metadata ``output = "rate"`` (a foreign network's
    firing-rate readout) gives the mean over T of its output, ``[1, N, num_classes]``, as
    ``ForeignModel`` does. Cycles and nested subgraphs run as :mod:`szo.export.nir_graph` says.
    The parameters are those of the graph (BN already folded; synapse weights and biases are
    trainable, neuron constants are buffers), so the flat-parameter layout is not the source
    model's: a forward-only method trains it in its own space (full-space ZO, or a subspace built
    for it), not in the source model's subspace. ``szo.export.to_nir`` writes it back.
    """

    def __init__(self, graph: Any, *, T: int | None = None, dt: float | None = None) -> None:
        nir, _ = nir_modules()
        if not isinstance(graph, nir.NIRGraph):
            raise ValueError(f"from_nir needs a nir.NIRGraph or a .nir path, got {type(graph).__name__}")
        meta = dict(graph.metadata or {})
        dt = float(meta.get("dt", DEFAULT_DT)) if dt is None else float(dt)
        if not (np.isfinite(dt) and dt > 0):
            raise ValueError(f"NIR graph: dt = {dt!r} is not a positive number of seconds")
        node_map = _NodeMap(dt)
        supported = node_map(nir)
        for name, node in graph.nodes.items():
            if type(node) not in supported and not isinstance(node, nir.NIRGraph):
                raise ValueError(f"NIR node {name!r} has type {type(node).__name__}, which szo cannot run; supported: "
                                 f"{sorted(t.__name__ for t in supported)} (and nested NIRGraph nodes)")
        nodes, edges = inline_subgraphs(nir, graph.nodes, graph.edges)
        for name, node in nodes.items():
            if type(node) not in supported:
                raise ValueError(f"NIR node {name!r} has type {type(node).__name__}, which szo cannot run; supported: "
                                 f"{sorted(t.__name__ for t in supported)}")
        for s, d in edges:
            if s not in nodes or d not in nodes:
                raise ValueError(f"NIR graph edge ({s!r}, {d!r}) names a node that is not in the graph")
        for name, node in nodes.items():
            _check_node_values(name, node)
            check_time_constants(name, node, dt)
            _check_fixed_point(name, node, meta, dt)
        inputs = [k for k, v in nodes.items() if isinstance(v, nir.Input)]
        outputs = [k for k, v in nodes.items() if isinstance(v, nir.Output)]
        if len(inputs) != 1:
            raise ValueError(f"NIR graph must have exactly one Input node, got {len(inputs)}")
        if len(outputs) != 1:
            raise ValueError(f"NIR graph must have exactly one Output node, got {len(outputs)}")
        plan = plan_graph(nodes, edges, inputs[0], outputs[0])
        out_t = _port_shape(nodes[outputs[0]].output_type)
        num_classes = int(meta.get("num_classes", int(np.prod(out_t)) if out_t else 0))
        if num_classes < 1:
            raise ValueError("NIR graph: cannot tell the number of classes (no 'num_classes' metadata and no Output "
                             "type)")
        in_t = _port_shape(nodes[inputs[0]].input_type or nodes[inputs[0]].output_type)
        if not in_t:
            raise ValueError(f"NIR graph: the Input node {inputs[0]!r} has no shape")
        T = meta.get("T") if T is None else T
        try:
            T = None if T is None else int(T)
        except (TypeError, ValueError):
            raise ValueError(f"NIR graph: T = {T!r} is not a number of time steps") from None
        if T is not None and not 1 <= T <= MAX_T:
            raise ValueError(f"NIR graph: T = {T} time steps is out of range; szo runs 1 <= T <= {MAX_T}")
        super().__init__(num_classes=num_classes, T=T or 1, model_name=meta_str(meta, "model_name", "nir"))
        output = meta_str(meta, "output", "sequence")
        if output not in OUTPUTS:
            raise ValueError(f"NIR graph: metadata 'output' must be one of {list(OUTPUTS)}, got {output!r}")
        self.dt = dt
        self.nir_metadata = meta
        self.output = output
        self.graph_T = T
        self.input_shape = in_t
        self.sample_dims = len(in_t)
        self.nir_nodes = {k: type(v).__name__ for k, v in nodes.items()}
        for name, node in nodes.items():
            node_map.name[id(node)] = name
        modules = {k: supported[type(v)](v) for k, v in nodes.items() if supported[type(v)] is not None}
        self.graph_module = GraphRunner(plan, modules)
        with torch.no_grad():  # every node takes what its edges bring: one line naming the first that does not
            self.graph_module(torch.zeros(2, 1, *in_t), name_errors=True)
        functional.reset_net(self)

    def forward(self, x: torch.Tensor, **kw: Any) -> torch.Tensor:
        if isinstance(x, torch.Tensor) and x.dim() == self.sample_dims + 1 and self.graph_T is None:
            raise ValueError("this NIR graph has no 'T' metadata: pass T= to from_nir (szo import --T) to repeat one "
                             f"{self.sample_dims}-D frame per sample over T steps, or give a sequence [T, N, ...]")
        return super().forward(x, **kw)

    def forward_seq(self, x_seq: torch.Tensor) -> torch.Tensor:
        out = self.graph_module(x_seq)
        return out.mean(0, keepdim=True) if self.output == "rate" else out


def _port_shape(port: Any) -> tuple[int, ...]:
    """The shape of a node's one port (``{"input": shape}``), or ``()``."""
    if not port:
        return ()
    dims = np.asarray(next(iter(port.values()))).reshape(-1)
    return tuple(int(v) for v in dims)


MAX_T = 10_000
"""The most time steps an imported graph may ask for (metadata ``T`` or ``T=``)."""
MAX_ELEMENTS = 1 << 30
"""The most elements one node's array or input / output shape may have."""


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
