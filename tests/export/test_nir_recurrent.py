"""Recurrent NIR graphs in szo: the execution plan (back edges, cycles as one step-by-step stage),
CubaLIF's discretisation, the one-step delay of a back edge, nested subgraphs, streaming, re-export.
norse's own execution of its braille network is the oracle in test_braille.py."""
import numpy as np
import pytest
import torch
from spikingjelly.activation_based import functional, neuron

pytest.importorskip("nir")

import nir  # noqa: E402

from szo.export import from_nir, read_nir, to_nir, write_nir  # noqa: E402
from szo.export.nir_graph import plan_graph  # noqa: E402

F32 = np.float32


def _plan(edges, inp="in", out="out"):
    names = {n for e in edges for n in e}
    return plan_graph({n: None for n in sorted(names)}, edges, inp, out)


def test_back_edge_and_stages_of_a_recurrent_layer():
    p = _plan([("in", "fc1"), ("w_rec", "lif"), ("fc1", "lif"), ("lif", "w_rec"), ("lif", "fc2"), ("fc2", "out")])
    assert p.back_edges == (("w_rec", "lif"),)
    assert [(s.nodes, s.recurrent) for s in p.stages] == [(("fc1",), False), (("lif", "w_rec"), True),
                                                          (("fc2",), False)]
    rec = p.stages[1]
    assert rec.inputs["lif"] == (("w_rec", "prev"), ("fc1", "seq")) and rec.inputs["w_rec"] == (("lif", "now"),)


def test_a_cycle_closed_by_a_cross_edge_is_one_stage():
    """in -> r -> x -> r (back) and r -> m -> x: m reaches x only after x is finished (a cross edge),
    yet r, m and x are one cycle and run step by step together."""
    p = _plan([("in", "r"), ("r", "x"), ("x", "r"), ("r", "m"), ("m", "x"), ("x", "out")])
    assert p.back_edges == (("x", "r"),)
    (stage,) = p.stages
    assert stage.recurrent and stage.nodes == ("r", "m", "x")
    assert stage.inputs["x"] == (("r", "now"), ("m", "now")) and stage.inputs["r"] == (("in", "seq"), ("x", "prev"))


def _cuba(n, rng, **kw):
    f = dict(tau_syn=np.full(n, 2e-4), tau_mem=np.full(n, 1e-3), r=np.full(n, 10.0), v_leak=np.zeros(n),
             v_threshold=np.ones(n), v_reset=np.zeros(n), w_in=np.full(n, 2.0))
    f.update(kw)
    return nir.CubaLIF(**f)


def _recurrent_graph(seed=0, n_in=3, n=5, n_out=2, nested=False):
    rng = np.random.default_rng(seed)
    w_in, b_in = rng.normal(0, 1.5, (n, n_in)).astype(F32), rng.normal(0.2, 0.2, n).astype(F32)
    w_rec, b_rec = rng.normal(0, 0.8, (n, n)).astype(F32), rng.normal(0, 0.3, n).astype(F32)
    w_out = rng.normal(0, 1.5, (n_out, n)).astype(F32)
    nodes = {"input": nir.Input(input_type=np.array([n_in])), "fc1": nir.Affine(w_in, b_in),
             "fc2": nir.Linear(w_out), "lif2": _cuba(n_out, rng), "output": nir.Output(output_type=np.array([n_out]))}
    edges = [("input", "fc1"), ("fc2", "lif2"), ("lif2", "output")]
    if nested:  # snnTorch's way of writing a recurrent layer: one NIRGraph node
        sub = nir.NIRGraph(nodes={"input": nir.Input(input_type=np.array([n])), "lif": _cuba(n, rng),
                                  "w_rec": nir.Affine(w_rec, b_rec), "output": nir.Output(output_type=np.array([n]))},
                           edges=[("input", "lif"), ("lif", "w_rec"), ("w_rec", "lif"), ("lif", "output")],
                           type_check=False)
        nodes["lif1"] = sub
        edges += [("fc1", "lif1"), ("lif1", "fc2")]
    else:
        nodes.update({"lif1.lif": _cuba(n, rng), "lif1.w_rec": nir.Affine(w_rec, b_rec)})
        edges += [("lif1.w_rec", "lif1.lif"), ("fc1", "lif1.lif"), ("lif1.lif", "lif1.w_rec"), ("lif1.lif", "fc2")]
    return nir.NIRGraph(nodes=nodes, edges=edges, type_check=False), (w_in, b_in, w_rec, b_rec, w_out)


def _by_hand(x, weights, dt=1e-4):
    """The documented reading (szo.models.cuba, szo.export.nir_graph) written out in float64:
    forward Euler, the membrane integrating this step's current, the recurrent Affine's output of
    the previous step (nothing at step 0)."""
    w_in, b_in, w_rec, b_rec, w_out = (torch.from_numpy(w).double() for w in weights)

    def step(i, v, inp, n):
        i = i + dt / 2e-4 * (-i + 2.0 * inp)
        h = v + dt / 1e-3 * (10.0 * i - v)
        z = (h > 1.0).double()
        return i, (1 - z) * h, z

    n, n_out = w_rec.shape[0], w_out.shape[0]
    i1 = v1 = torch.zeros(x.shape[1], n, dtype=torch.float64)
    i2 = v2 = torch.zeros(x.shape[1], n_out, dtype=torch.float64)
    rec, outs, hidden = None, [], []
    for xt in x.double():
        a = xt @ w_in.T + b_in + (0 if rec is None else rec)
        i1, v1, z1 = step(i1, v1, a, n)
        rec = z1 @ w_rec.T + b_rec
        i2, v2, z2 = step(i2, v2, z1 @ w_out.T, n_out)
        outs.append(z2)
        hidden.append(z1)
    return torch.stack(outs), torch.stack(hidden)


def _spikes(T=60, N=6, n_in=3, rate=0.4, seed=1):
    return (torch.rand(T, N, n_in, generator=torch.Generator().manual_seed(seed)) < rate).float()


def test_recurrent_cuba_lif_runs_the_documented_reading():
    g, weights = _recurrent_graph()
    net = from_nir(g).double().eval()
    x = _spikes()
    hidden = []
    h = net.graph_module.module_of("lif1.lif").register_forward_hook(lambda m, i, o: hidden.append(o))
    with torch.no_grad():
        out = net(x.double())
    h.remove()
    want, want_hidden = _by_hand(x, weights)
    assert 0.05 < float(want_hidden.mean()) < 0.95 and float(want.mean()) > 0.02  # the recurrence is exercised
    assert torch.equal(torch.cat(hidden), want_hidden) and torch.equal(out, want)


def test_a_nested_subgraph_runs_as_the_flat_graph():
    flat, _ = _recurrent_graph(seed=3)
    nested, _ = _recurrent_graph(seed=3, nested=True)
    a, b = from_nir(flat).eval(), from_nir(nested).eval()
    assert sorted(b.nir_nodes) == sorted(a.nir_nodes) and b.graph_module.plan.back_edges == (("lif1.w_rec",
                                                                                                "lif1.lif"),)
    x = _spikes(seed=4)
    with torch.no_grad():
        assert torch.equal(a(x), b(x))


def test_a_self_edge_feeds_a_neuron_its_own_last_spikes():
    """IF neurons whose spikes come back to themselves: v += W x[t] + z[t-1]."""
    w = np.array([[0.6, -0.2], [0.3, 0.4], [-0.5, 0.9]], dtype=F32)
    g = nir.NIRGraph(nodes={"input": nir.Input(input_type=np.array([2])), "fc": nir.Linear(w),
                            "sn": nir.IF(r=np.full(3, 1e4), v_threshold=np.ones(3), v_reset=np.zeros(3)),
                            "output": nir.Output(output_type=np.array([3]))},
                     edges=[("input", "fc"), ("fc", "sn"), ("sn", "sn"), ("sn", "output")], type_check=False)
    net = from_nir(g).eval()
    assert net.graph_module.plan.back_edges == (("sn", "sn"),)
    x = _spikes(T=30, N=4, n_in=2, rate=0.5)
    ref = neuron.IFNode(v_threshold=1.0, v_reset=0.0, step_mode="s")
    z, want = None, []
    for xt in x:
        a = xt @ torch.from_numpy(w).T + (0 if z is None else z)
        z = ref(a)
        want.append(z)
    with torch.no_grad():
        out = net(x)
    assert torch.equal(out, torch.stack(want)) and 0.05 < float(out.mean()) < 0.95


def test_recurrent_state_streams_across_chunks_and_calls():
    net = from_nir(_recurrent_graph(seed=5)[0]).eval()
    x = _spikes(T=40, seed=6)
    with torch.no_grad():
        whole = net(x)
        assert torch.equal(net(x, time_chunk=1), whole) and torch.equal(net(x, time_chunk=7), whole)
        with net.persistent_state():
            parts = torch.cat([net(x[:13]), net(x[13:])])
    assert torch.equal(parts, whole)
    functional.reset_net(net)


def test_re_export_writes_the_cycle_back(tmp_path):
    g, _ = _recurrent_graph(seed=7, nested=True)
    net = from_nir(g).eval()
    write_nir(to_nir(net), tmp_path / "r.nir")
    back_graph = read_nir(tmp_path / "r.nir")
    assert ("lif1.w_rec", "lif1.lif") in back_graph.edges and isinstance(back_graph.nodes["lif1.lif"], nir.CubaLIF)
    assert float(back_graph.metadata["dt"]) == 1e-4 and "T" not in back_graph.metadata
    x = _spikes(seed=8)
    with torch.no_grad():
        assert torch.equal(from_nir(tmp_path / "r.nir")(x), net(x))
        # written for a step twice as long, every time constant doubles: the same network, bit for bit
        assert torch.equal(from_nir(to_nir(net, dt=2e-4))(x), net(x))


def test_bad_recurrent_graphs_are_one_line():
    g, _ = _recurrent_graph()
    g.nodes["lif1.w_rec"] = nir.Affine(np.ones((4, 5), dtype=F32), np.zeros(4, dtype=F32))  # 5 -> 4 into 5 neurons
    with pytest.raises(ValueError, match=r"^NIR node 'lif1.lif': its inputs have different shapes \[\[4\], \[5\]\]"):
        from_nir(g)
    g, _ = _recurrent_graph()
    g.nodes["lif1.lif"].metadata["reset"] = "subtract"
    with pytest.raises(ValueError, match=r"^NIR node 'lif1.lif': CubaLIF resets to v_reset"):
        from_nir(g)
    g, _ = _recurrent_graph()
    g.nodes["lif2"].tau_syn[0] = 0.0
    with pytest.raises(ValueError, match=r"^NIR node 'lif2' \(CubaLIF\): every time constant must be longer than one "
                                         r"step, tau / dt > 1 .*field 'tau_syn' is 0 step\(s\) .* at 1 of 2 neuron"):
        from_nir(g)
    net = from_nir(_recurrent_graph()[0])
    with pytest.raises(ValueError, match=r"no 'T' metadata: pass T= .* 1-D frame per sample"):
        net(torch.ones(2, 3))
    assert from_nir(_recurrent_graph()[0], T=5)(torch.ones(2, 3)).shape == (5, 2, 2)
