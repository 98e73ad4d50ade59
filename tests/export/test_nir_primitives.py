"""The six NIR primitives szo refused until issue 51 (LI, CubaLI, I, Delay, Scale, Conv1d): each
against an outside run where norse or nirtorch runs it (bit for bit), else against NIR's own
equation; each written back and read again; the one stability rule of every neuron kind; the
nesting limit of nir.read; sinabs' discrete-time CNN read with ``--dt``."""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from spikingjelly.activation_based import functional

pytest.importorskip("nir")

import nir  # noqa: E402

from szo.cli import main  # noqa: E402
from szo.export import from_nir, read_nir, to_nir, write_nir  # noqa: E402
from szo.export.nir_import import MAX_NESTING, STABILITY_RULE  # noqa: E402

F32 = np.float32
SINABS_CNN = Path(__file__).with_name("data") / "sinabs_cnn.nir"


def _graph(*chain: tuple[str, object], shape) -> nir.NIRGraph:
    """Input -> chain... -> Output, the shapes given per sample."""
    nodes = {"input": nir.Input(input_type=np.array(shape))}
    nodes.update(chain)
    last = nodes[chain[-1][0]]
    out = next(iter(last.output_type.values())) if last.output_type else None
    nodes["output"] = nir.Output(output_type=np.array(out if out is not None else [1]))
    names = list(nodes)
    return nir.NIRGraph(nodes=nodes, edges=list(zip(names, names[1:])), type_check=False)


def _run(g, x, dt=None) -> torch.Tensor:
    with torch.no_grad():
        return from_nir(g, dt=dt).eval()(x)


def _rand(*shape, seed=0, lo=-1.0, hi=1.0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(lo, hi, size=shape).astype(F32)


def _norse_cell(cls_name, params_name, dt, **p):
    norse = pytest.importorskip("norse.torch")
    params = getattr(norse, params_name)(**{k: torch.as_tensor(v) for k, v in p.items()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit's deprecation notice
        return getattr(norse, cls_name)(params, dt=dt)


def _step_through(cells, x):
    states = [None] * len(cells)
    out = []
    for xt in x:
        y = xt
        for k, (cell, pre) in enumerate(cells):
            y, states[k] = cell(pre(y), states[k])
        out.append(y)
    return torch.stack(out).detach()


# ----------------------------------------------------------------------------- against norse

def test_li_is_norses_box_leaky_integrator_bit_for_bit():
    """``nir.LI`` (per-neuron tau, r, v_leak) = norse 1.1's ``LIBoxCell`` fed ``r x``."""
    n, dt = 6, 1e-4
    tau, r, v_leak = _rand(n, lo=2e-4, hi=2e-3), _rand(n, seed=1, lo=0.5, hi=3), _rand(n, seed=2, lo=-0.3, hi=0.3)
    g = _graph(("li", nir.LI(tau=tau, r=r, v_leak=v_leak)), shape=[n])
    x = torch.from_numpy(_rand(50, 4, n, seed=3, lo=-2, hi=2))
    got = _run(g, x)
    cell = _norse_cell("LIBoxCell", "LIBoxParameters", dt, tau_mem_inv=1 / torch.from_numpy(tau),
                       v_leak=torch.from_numpy(v_leak))
    want = _step_through([(cell, lambda y: torch.from_numpy(r) * y)], x)
    assert float(want.abs().max()) > 0.5  # the membranes move
    assert torch.equal(got, want)


def test_cuba_li_is_norses_cuba_synapse_and_box_membrane_bit_for_bit():
    """``nir.CubaLI`` = what norse 1.1's importer builds for a ``CubaLIF`` (``w_in`` x, an
    ``LIBoxCell`` synapse, ``r`` x, a box membrane) without the threshold: ``LIBoxCell`` twice, the
    synapse leaking to 0 (NIR's equation; szo's CubaLIF reading)."""
    n, dt = 5, 1e-4
    f = dict(tau_syn=_rand(n, lo=2e-4, hi=8e-4), tau_mem=_rand(n, seed=1, lo=5e-4, hi=3e-3),
             r=_rand(n, seed=2, lo=1, hi=10), v_leak=_rand(n, seed=3, lo=-0.2, hi=0.2), w_in=_rand(n, seed=4, lo=1, hi=3))
    g = _graph(("cuba", nir.CubaLI(**f)), shape=[n])
    x = torch.from_numpy((_rand(60, 3, n, seed=5, lo=0, hi=1) < 0.3).astype(F32))
    got = _run(g, x)
    t = {k: torch.from_numpy(v) for k, v in f.items()}
    syn = _norse_cell("LIBoxCell", "LIBoxParameters", dt, tau_mem_inv=1 / t["tau_syn"], v_leak=torch.zeros(n))
    mem = _norse_cell("LIBoxCell", "LIBoxParameters", dt, tau_mem_inv=1 / t["tau_mem"], v_leak=t["v_leak"])
    want = _step_through([(syn, lambda y: t["w_in"] * y), (mem, lambda y: t["r"] * y)], x)
    assert float(want.abs().max()) > 0.5
    assert torch.equal(got, want)


def test_conv1d_is_nirtorchs_conv1d_bit_for_bit():
    """``nir.Conv1d`` (stride, int and 'same' padding, dilation, groups) = nirtorch 2.6's own map of
    it (the executor norse and snnTorch import through), applied at every step."""
    nirtorch = pytest.importorskip("nirtorch")
    from nirtorch.nir_interpreter import DEFAULT_MAP

    cases = [dict(stride=2, padding=1, dilation=1, groups=1), dict(stride=1, padding="same", dilation=2, groups=1),
             dict(stride=1, padding=0, dilation=1, groups=2)]
    for k, c in enumerate(cases):
        w = _rand(4, 4 // c["groups"], 3, seed=k)
        node = nir.Conv1d(input_shape=12, weight=w, bias=_rand(4, seed=10 + k), **c)
        x = torch.from_numpy(_rand(5, 3, 4, 12, seed=20 + k))
        ref = DEFAULT_MAP[nir.Conv1d](node)
        with torch.no_grad():
            want = torch.stack([ref(xt) for xt in x])
        assert torch.equal(_run(_graph(("conv", node), shape=[4, 12]), x), want), c
        assert nirtorch is not None


# ----------------------------------------------------------------------------- against NIR's equations

def test_integrator_is_nirs_equation():
    """``nir.I``: dv/dt = r x, forward Euler v[t] = v[t-1] + dt r x[t] from v = 0 (float64)."""
    n, dt = 4, 1e-4
    r = _rand(n, lo=100, hi=5000)
    x = _rand(30, 2, n, seed=1)
    with torch.no_grad():
        got = from_nir(_graph(("i", nir.I(r=r)), shape=[n]), dt=dt).double().eval()(torch.from_numpy(x).double())
    want = np.cumsum((dt * r.astype(np.float64)) * x.astype(np.float64), axis=0)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-15)


def test_delay_is_nirs_equation_per_element():
    """``nir.Delay``: y(t) = x(t - delay), delay a whole number of steps per element (0 before)."""
    dt = 1e-3
    steps = np.array([[0, 1, 3], [2, 5, 1]])
    g = _graph(("d", nir.Delay(delay=(steps * dt).astype(F32))), shape=[2, 3])
    x = torch.from_numpy(_rand(9, 2, 2, 3, seed=4))
    got = _run(g, x, dt=dt)
    want = torch.zeros_like(x)
    for i in range(2):
        for j in range(3):
            d = int(steps[i, j])
            want[d:, :, i, j] = x[:9 - d, :, i, j]
    assert torch.equal(got, want)
    net = from_nir(g, dt=dt).eval()
    with torch.no_grad(), net.persistent_state():  # streaming: the last inputs carry over between calls
        parts = torch.cat([net(x[:4]), net(x[4:6]), net(x[6:])])
    functional.reset_net(net)
    assert torch.equal(parts, want)
    with torch.no_grad():
        assert torch.equal(net(x, time_chunk=2), want)
    with pytest.raises(ValueError, match=r"NIR node 'd': Delay field 'delay' must be a whole number of steps of dt = "
                                         r"0.001 s, from 0 to 10000, got 0.5 steps"):
        from_nir(_graph(("d", nir.Delay(delay=np.array([5e-4, 1e-3], dtype=F32))), shape=[2]), dt=dt)


def test_a_delay_in_a_cycle_feeds_back_d_steps_later():
    """IF -> Delay(2 steps) -> back into the IF: v[t] = v[t-1] + x[t] + z[t-1-2] (the back edge
    adds its one step): the delay's memory runs inside the step-by-step cycle."""
    dt = 1e-4
    nodes = {"input": nir.Input(input_type=np.array([1])),
             "sn": nir.IF(r=np.full(1, 1 / dt, F32), v_threshold=np.ones(1, F32), v_reset=np.zeros(1, F32)),
             "d": nir.Delay(delay=np.full(1, 2 * dt, F32)), "output": nir.Output(output_type=np.array([1]))}
    g = nir.NIRGraph(nodes=nodes, edges=[("input", "sn"), ("sn", "d"), ("d", "sn"), ("sn", "output")],
                     type_check=False)
    x = torch.zeros(12, 1, 1)
    x[0] = 1.5  # one spike at step 0, then only its echo
    got = _run(g, x)[:, 0, 0]
    v, hist, want = 0.0, [], []
    for t in range(12):
        v += float(x[t]) + (hist[t - 3] if t >= 3 else 0.0)
        z = float(v >= 1.0)
        v = 0.0 if z else v
        hist.append(z)
        want.append(z)
    assert want.count(1.0) >= 3 and got.tolist() == want  # it echoes every 3 steps


def test_scale_is_nirs_equation():
    s = _rand(2, 3, lo=-2, hi=2)
    x = torch.from_numpy(_rand(4, 5, 2, 3, seed=1))
    assert torch.equal(_run(_graph(("s", nir.Scale(scale=s)), shape=[2, 3]), x), x * torch.from_numpy(s))


# ----------------------------------------------------------------------------- written back

def _every_primitive() -> nir.NIRGraph:
    n = 4
    return _graph(
        ("conv", nir.Conv1d(input_shape=10, weight=_rand(3, 2, 3), stride=1, padding=1, dilation=1, groups=1,
                            bias=_rand(3, seed=1))),
        ("flat", nir.Flatten(input_type={"input": np.array([3, 10])}, start_dim=0, end_dim=-1)),
        ("fc", nir.Linear(_rand(n, 30, seed=2))),
        ("scale", nir.Scale(_rand(n, seed=3, lo=1, hi=2))),
        ("delay", nir.Delay(np.array([0, 1e-4, 2e-4, 3e-4], F32))),
        ("li", nir.LI(tau=np.full(n, 5e-4, F32), r=np.ones(n, F32), v_leak=np.zeros(n, F32))),
        ("cuba", nir.CubaLI(tau_syn=np.full(n, 3e-4, F32), tau_mem=np.full(n, 5e-4, F32), r=np.full(n, 2, F32),
                            v_leak=np.zeros(n, F32), w_in=np.full(n, 1.5, F32))),
        ("i", nir.I(r=np.full(n, 1e3, F32))),
        shape=[2, 10])


def test_every_new_primitive_round_trips_through_files(tmp_path):
    write_nir(_every_primitive(), tmp_path / "a.nir")
    net = from_nir(tmp_path / "a.nir").eval()
    x = torch.from_numpy(_rand(8, 3, 2, 10, seed=9))
    with torch.no_grad():
        y = net(x)
        write_nir(to_nir(net), tmp_path / "b.nir")
        back = read_nir(tmp_path / "b.nir")
        assert {k: type(v).__name__ for k, v in back.nodes.items()} == net.nir_nodes
        assert torch.equal(from_nir(tmp_path / "b.nir")(x), y)
        # written for a step twice as long, time constants and delays double and I's rate halves: same steps
        twice = to_nir(net, dt=2e-4)
        np.testing.assert_allclose(twice.nodes["delay"].delay, [0, 2e-4, 4e-4, 6e-4], rtol=1e-6)
        np.testing.assert_allclose(twice.nodes["i"].r, 500.0, rtol=1e-6)
        assert torch.equal(from_nir(twice)(x), y)
    assert float(y.abs().max()) > 0.01
    original = read_nir(tmp_path / "a.nir")
    for name in ("conv", "scale", "li", "cuba", "i"):
        for field, v in vars(original.nodes[name]).items():
            if isinstance(v, np.ndarray):
                np.testing.assert_array_equal(getattr(back.nodes[name], field), v, err_msg=f"{name}.{field}")


def test_a_trained_scale_is_written_back():
    net = from_nir(_every_primitive()).eval()
    with torch.no_grad():
        net.graph_module.module_of("scale").scale.mul_(3)
    assert "graph_module.scale.scale" in dict(net.named_parameters())
    np.testing.assert_allclose(to_nir(net).nodes["scale"].scale, _every_primitive().nodes["scale"].scale * 3,
                               rtol=1e-6)


# ----------------------------------------------------------------------------- one stability rule

RULE = r"every time constant must be longer than one step, tau / dt > 1"


def _neuron(kind, tau):
    n = 3
    one, zero = np.ones(n, F32), np.zeros(n, F32)
    t = np.full(n, tau, F32)
    return {"LIF": lambda: nir.LIF(tau=t, r=t / F32(1e-4), v_leak=zero, v_threshold=one, v_reset=zero),
            "CubaLIF": lambda: nir.CubaLIF(tau_syn=np.full(n, 5e-4, F32), tau_mem=t, r=one, v_leak=zero,
                                           v_threshold=one, v_reset=zero),
            "LI": lambda: nir.LI(tau=t, r=one, v_leak=zero),
            "CubaLI": lambda: nir.CubaLI(tau_syn=t, tau_mem=np.full(n, 5e-4, F32), r=one, v_leak=zero)}[kind]()


@pytest.mark.parametrize("kind", ["LIF", "CubaLIF", "LI", "CubaLI"])
def test_one_stability_rule_for_every_neuron_kind(kind):
    field = {"LIF": "tau", "CubaLIF": "tau_mem", "LI": "tau", "CubaLI": "tau_syn"}[kind]
    assert from_nir(_graph(("n", _neuron(kind, 3e-4)), shape=[3])) is not None  # 3 steps of 1e-4 s
    for tau in (1e-4, 5e-5, 0.0, -1e-4):  # one step, half a step, none, negative
        with pytest.raises(ValueError, match=rf"^NIR node 'n' \({kind}\): {RULE} .*field '{field}' is "
                                             rf"\S+ step\(s\) of dt = 0.0001 s at 3 of 3 neuron\(s\); give the step "
                                             rf"the graph was made for: szo import --dt SECONDS"):
            from_nir(_graph(("n", _neuron(kind, tau)), shape=[3]))
    assert STABILITY_RULE.startswith("every time constant must be longer than one step")


def test_a_cuba_lif_graph_at_dt_1e30_is_refused_not_run():
    """Issue 49.3: a CubaLIF graph at dt = 1e30 s imported and ran (8 output spikes against 94)."""
    g = _graph(("n", _neuron("CubaLIF", 3e-4)), shape=[3])
    with pytest.raises(ValueError, match=rf"\(CubaLIF\): {RULE} .*field 'tau_syn' is 5e-34 step\(s\) of dt = 1e\+30 s"):
        from_nir(g, dt=1e30)


def test_if_and_i_have_no_time_constant_to_check():
    """IF and I integrate without a leak: the rule has nothing to check (IF's gain r dt must be 1)."""
    for dt in (1e-6, 1.0, 1e3):
        from_nir(_graph(("sn", nir.IF(r=np.full(2, 1 / dt), v_threshold=np.ones(2), v_reset=np.zeros(2))),
                        shape=[2]), dt=dt)
        from_nir(_graph(("i", nir.I(r=np.full(2, 5.0))), shape=[2]), dt=dt)
    with pytest.raises(ValueError, match=r"I field 'r' times dt = 1e\+300 s overflows float32"):
        from_nir(_graph(("i", nir.I(r=np.full(2, 5.0))), shape=[2]), dt=1e300)


# ----------------------------------------------------------------------------- nesting

def _nested(depth: int) -> nir.NIRGraph:
    g = _graph(("fc", nir.Linear(np.eye(3, dtype=F32))), shape=[3])
    for _ in range(depth):
        g = nir.NIRGraph(nodes={"input": nir.Input(input_type=np.array([3])), "sub": g,
                                "output": nir.Output(output_type=np.array([3]))},
                         edges=[("input", "sub"), ("sub", "output")], type_check=False)
    return g


def test_deep_nesting_is_refused_in_one_line_naming_depth_and_limit(tmp_path, monkeypatch):
    """Issue 49.8: a valid 400-level nested graph was "not a valid NIR file" (nir.read's RecursionError)."""
    deep = MAX_NESTING + 9  # writing 400 levels takes nir.write 45 s; the walk that counts them does not recurse
    nir.write(tmp_path / "deep.nir", _nested(deep))
    with pytest.raises(ValueError, match=rf"deep.nir nests subgraphs \(NIRGraph nodes\) {deep} levels deep; szo reads "
                                         rf"at most {MAX_NESTING} levels"):
        read_nir(tmp_path / "deep.nir")
    assert main(["import", str(tmp_path / "deep.nir")]) == 2
    import h5py

    with h5py.File(tmp_path / "deep.nir", "r+") as f:  # a hostile file: the graph linked into itself
        f["node/nodes/loop"] = f["node"]
    with pytest.raises(ValueError, match=r"deep.nir links one subgraph \(NIRGraph node\) group in twice, an HDF5 hard "
                                         r"link that nir.write never writes"):
        read_nir(tmp_path / "deep.nir")
    nir.write(tmp_path / "ok.nir", _nested(MAX_NESTING))
    net = from_nir(tmp_path / "ok.nir", T=2)
    x = torch.rand(2, 3)
    assert torch.equal(net(x)[0], x)


# ----------------------------------------------------------------------------- sinabs' discrete-time CNN

def test_sinabs_cnn_needs_dt_and_the_refusal_says_so(capsys):
    """sinabs 3.1.3's own export of a Speck-style N-MNIST CNN (tests/export/data/make_sinabs_cnn.py):
    IF with r = 1 and no dt. The refusal names --dt; with it the graph imports, runs and writes back."""
    g = read_nir(SINABS_CNN)
    assert "dt" not in (g.metadata or {}) and all(np.all(v.r == 1) for v in g.nodes.values() if isinstance(v, nir.IF))
    assert main(["import", str(SINABS_CNN)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "IF field 'r' must be 1/dt = 10000" in err[0] and "szo import --dt 1 " in err[0], err
    spikes = (torch.rand(6, 2, 2, 34, 34, generator=torch.Generator().manual_seed(0)) < 0.3).float()
    net = from_nir(SINABS_CNN, dt=1.0).eval()
    with torch.no_grad():
        out = net(spikes)
        assert float(out.sum()) > 0 and out.shape == (6, 2, 10)
        back = to_nir(net)
        assert float(back.metadata["dt"]) == 1.0 and np.all(back.nodes["1"].r == 1.0)
        assert torch.equal(from_nir(back)(spikes), out)


def test_szo_import_dt_flag(tmp_path, capsys):
    arr = (np.random.default_rng(0).uniform(size=(5, 2, 2, 34, 34)) < 0.3).astype(F32)
    np.save(tmp_path / "in.npy", arr)
    assert main(["import", str(SINABS_CNN), "--dt", "1", "--spikes", str(tmp_path / "in.npy")]) == 0
    text = capsys.readouterr().out
    assert "dt=1 s" in text and "IF x3" in text and "ran 5 steps x 2 samples" in text
