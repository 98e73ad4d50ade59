"""How szo runs the edges of an imported NIR graph: nested subgraphs inlined, cycles found, one
multi-step module that runs the whole graph on ``[T, N, ...]`` sequences.

A NIR graph is a directed graph whose nodes sum their inputs; it may hold cycles (a recurrent
``Affine`` back into a neuron: norse's braille network) and nested ``NIRGraph`` nodes (snnTorch
writes a recurrent layer as one). In discrete time a cycle needs a delay, which NIR does not
write down. szo takes the reading of norse 1.1.0 (nirtorch's ``GraphExecutor``) and of nirtorch's
``nir_to_torch``:

* The graph is walked depth first from its ``Input`` along the edges in the graph's own order;
  an edge that returns to a node on the walk's current path (a self-edge included) is a **back
  edge**. It carries its source's output of the *previous* time step, and nothing (a zero
  input) at the first step, so a recurrent ``Affine``'s bias reaches its target from step 1 on.
  snnTorch 1.0's ``RSynaptic`` / ``RLeaky`` (as read in its source) instead apply the recurrent
  layer to zero spikes at step 0 (its bias arrives at step 0): the other reading, equal when that
  bias is 0.
* Every other edge carries the output of the same step. A node's input is the sum of what its
  edges carry, added in the graph's edge order.

The nodes of each cycle (a strongly connected component) run step by step, each module called
on one-step slices ``[1, N, ...]`` (SpikingJelly multi-step modules keep their state between
calls); every other node runs all T steps at once. The back edges' last outputs are memories
of :class:`GraphRunner` (reset by ``functional.reset_net``, kept by ``persistent_state``).
"""
from __future__ import annotations

import keyword
from dataclasses import dataclass
from typing import Any

import torch
from spikingjelly.activation_based import base
from torch import nn

__all__ = ["GraphPlan", "GraphRunner", "Stage", "inline_subgraphs", "plan_graph", "torch_name"]


def torch_name(name: str) -> str:
    """The attribute name of NIR node ``name`` in the runner (nirtorch's: '.' -> '_', keywords prefixed)."""
    name = name.replace(".", "_")
    return "nir_node_" + name if keyword.iskeyword(name) else name


def inline_subgraphs(nir: Any, nodes: dict[str, Any], edges: list[tuple[str, str]]) -> tuple[dict, list]:
    """Nested ``NIRGraph`` nodes replaced by their nodes (``outer.inner`` names), edges rewired
    through the subgraph's ``Input`` / ``Output`` (recursively)."""
    nodes, edges = dict(nodes), list(edges)
    while any(isinstance(v, nir.NIRGraph) for v in nodes.values()):
        name = next(k for k, v in nodes.items() if isinstance(v, nir.NIRGraph))
        sub = nodes.pop(name)
        ins = [k for k, v in sub.nodes.items() if isinstance(v, nir.Input)]
        outs = [k for k, v in sub.nodes.items() if isinstance(v, nir.Output)]
        if len(ins) != 1 or len(outs) != 1:
            raise ValueError(f"NIR subgraph {name!r} must have one Input and one Output node, got {len(ins)} and "
                             f"{len(outs)}")
        inner = {f"{name}.{k}": v for k, v in sub.nodes.items() if k not in (ins[0], outs[0])}
        clash = sorted(set(inner) & set(nodes))
        if clash:
            raise ValueError(f"NIR subgraph {name!r}: its node {clash[0]!r} has the name of a node outside it")
        nodes.update(inner)
        firsts = [f"{name}.{d}" for s, d in sub.edges if s == ins[0]]
        lasts = [f"{name}.{s}" for s, d in sub.edges if d == outs[0]]
        new = [(f"{name}.{s}", f"{name}.{d}") for s, d in sub.edges if s != ins[0] and d != outs[0]]
        for s, d in edges:
            srcs = lasts if s == name else [s]
            dsts = firsts if d == name else [d]
            new.extend((a, b) for a in srcs for b in dsts)
        edges = new
    return nodes, edges


@dataclass(frozen=True)
class Stage:
    """Nodes run together: one node over all T steps, or (``recurrent``) a cycle's nodes step by
    step in this order. ``inputs[node]``: ``(source, kind)`` per incoming edge, in edge order;
    kind ``"seq"`` (a sequence computed by an earlier stage, or the graph input), ``"now"`` (a node
    earlier in this stage, this step) or ``"prev"`` (a back edge: the source's previous step)."""

    nodes: tuple[str, ...]
    inputs: dict[str, tuple[tuple[str, str], ...]]
    recurrent: bool


@dataclass(frozen=True)
class GraphPlan:
    """A graph's nodes and edges (graph order), its input and output node, its stages in
    execution order and its back edges."""

    nodes: tuple[str, ...]
    edges: tuple[tuple[str, str], ...]
    input: str
    output: str
    stages: tuple[Stage, ...]
    back_edges: tuple[tuple[str, str], ...]
    output_sources: tuple[str, ...]


def plan_graph(nodes: dict[str, Any], edges: list[tuple[str, str]], input_name: str, output_name: str) -> GraphPlan:
    """The execution plan of a graph (module docstring); one ValueError for a node the input
    does not reach, an edge into the Input or out of the Output."""
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    pred: dict[str, list[str]] = {n: [] for n in nodes}
    for s, d in edges:
        if d == input_name:
            raise ValueError(f"NIR graph edge ({s!r}, {d!r}) leads into the Input node")
        if s == output_name:
            raise ValueError(f"NIR graph edge ({s!r}, {d!r}) leaves the Output node")
        succ[s].append(d)
        pred[d].append(s)
    # depth-first walk from the input, edges in graph order: back edges and a reverse postorder
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    post: list[str] = []
    back: list[tuple[str, str]] = []
    stack = [(input_name, iter(succ[input_name]))]
    state[input_name] = 1
    while stack:
        node, it = stack[-1]
        nxt = next(it, None)
        if nxt is None:
            stack.pop()
            state[node] = 2
            post.append(node)
        elif state.get(nxt) == 1:
            back.append((node, nxt))
        elif nxt not in state:
            state[nxt] = 1
            stack.append((nxt, iter(succ[nxt])))
    unreached = [n for n in nodes if n not in state]
    if unreached:
        raise ValueError(f"NIR graph: node(s) {', '.join(map(repr, unreached[:6]))} cannot be reached from the Input "
                         f"node {input_name!r}")
    order = post[::-1]
    # strongly connected components (Kosaraju): walks of the reversed graph in that order
    comp: dict[str, str] = {}
    for root in order:
        if root in comp:
            continue
        comp[root], todo = root, [root]
        while todo:
            for s in pred[todo.pop()]:
                if s not in comp:
                    comp[s] = root
                    todo.append(s)
    members: dict[str, list[str]] = {}
    for n in order:
        members.setdefault(comp[n], []).append(n)
    back_set = set(back)
    cyclic = {comp[v] for _, v in back}  # a component with a cycle holds a back edge (a self-edge included)
    if comp[input_name] in cyclic or comp[output_name] in cyclic:
        raise ValueError("NIR graph: the Input and Output nodes cannot be part of a cycle")
    stages = []
    for root, group_nodes in members.items():  # in the order of their roots: a topological order of components
        if root in (input_name, output_name):
            continue
        inside = set(group_nodes)
        inputs = {}
        for n in group_nodes:  # within a component every edge but a back edge runs forward in this order
            inputs[n] = tuple((s, "prev" if (s, n) in back_set else "now" if s in inside else "seq") for s in pred[n])
        stages.append(Stage(tuple(group_nodes), inputs, root in cyclic))
    return GraphPlan(tuple(nodes), tuple((s, d) for s, d in edges), input_name, output_name, tuple(stages), tuple(back),
                     tuple(pred[output_name]))


def _sum(terms: list[torch.Tensor]) -> torch.Tensor:
    out = terms[0]
    for t in terms[1:]:
        out = out + t
    return out


class GraphRunner(base.MemoryModule):
    """Runs a planned NIR graph (module docstring) on ``[T, N, *input]`` -> ``[T, N, *output]``.

    ``modules``: one multi-step module per node that is neither the Input nor the Output, keyed by
    NIR node name; each is a submodule named :func:`torch_name` (so ``runner.fc1``)."""

    def __init__(self, plan: GraphPlan, modules: dict[str, nn.Module]) -> None:
        super().__init__()
        self.plan = plan
        self.names = {n: torch_name(n) for n in modules}
        if len(set(self.names.values())) != len(self.names):
            raise ValueError("NIR graph: two node names differ only in '.' vs '_', which torch cannot tell apart")
        for n, m in modules.items():
            self.add_module(self.names[n], m)
        self.memory_of = {s: f"prev_{i}" for i, s in enumerate(sorted({s for s, _ in plan.back_edges}))}
        for name in self.memory_of.values():
            self.register_memory(name, None)

    def module_of(self, node: str) -> nn.Module:
        """The module that runs NIR node ``node``."""
        return getattr(self, self.names[node])

    def forward(self, x_seq: torch.Tensor, *, name_errors: bool = False) -> torch.Tensor:
        """``name_errors``: an error inside a node's module becomes one ValueError naming the node
        (the shape check when a graph is imported)."""
        seqs = {self.plan.input: x_seq}
        for stage in self.plan.stages:
            if not stage.recurrent:
                n = stage.nodes[0]
                seqs[n] = self._call(n, [seqs[s] for s, _ in stage.inputs[n]], name_errors)
                continue
            steps: dict[str, list[torch.Tensor]] = {n: [] for n in stage.nodes}
            for t in range(x_seq.shape[0]):
                now: dict[str, torch.Tensor] = {}
                for n in stage.nodes:
                    terms = []
                    for s, kind in stage.inputs[n]:
                        if kind == "seq":
                            terms.append(seqs[s][t:t + 1])
                        elif kind == "now":
                            terms.append(now[s])
                        else:
                            prev = getattr(self, self.memory_of[s])
                            if prev is not None:  # the first step: a back edge carries nothing yet
                                terms.append(prev)
                    now[n] = self._call(n, terms, name_errors)
                    steps[n].append(now[n])
                for s, mem in self.memory_of.items():
                    if s in now:
                        setattr(self, mem, now[s])
            for n in stage.nodes:
                seqs[n] = torch.cat(steps[n])
        return _sum([seqs[s] for s in self.plan.output_sources])

    def _call(self, node: str, terms: list[torch.Tensor], name_errors: bool) -> torch.Tensor:
        if not name_errors:
            return self.module_of(node)(_sum(terms))
        shapes = sorted({tuple(t.shape[2:]) for t in terms})
        if len(shapes) > 1:
            raise ValueError(f"NIR node {node!r}: its inputs have different shapes {[list(s) for s in shapes]} "
                             "(per sample); a node sums its inputs")
        x = _sum(terms)
        try:
            return self.module_of(node)(x)
        except (RuntimeError, ValueError) as exc:  # shape mismatches: torch's many messages, one line naming the node
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"NIR node {node!r} cannot take its input of shape {list(x.shape[2:])} (per sample): "
                             f"{first}") from None
