"""Compiled forward (``model.set_compile``) == the eager forward, without
recompiling per probe, with BN buffers and neuron state as in eager mode.

Two tests compile with inductor (the production backend: the no-grad and the BPTT graph of a
tiny ConvNet, ~10-20 s each on 2 cores); the others use the ``aot_eager`` backend, which runs the same dynamo capture,
guards and AOT functionalisation of the in-place BN-buffer updates without generating code.
"""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from spikingjelly.activation_based import neuron

import szo.models as M
from szo.losses import tet_loss
from szo.models.compiled import graph_count
from szo.optim import SZO
from szo.zo import ProbePath

T = 2


@pytest.fixture(autouse=True, scope="module")
def _fresh_dynamo(tmp_path_factory):
    # inductor's C++ cache is keyed without ATEN_CPU_CAPABILITY: kernels another run compiled with AVX2
    # vectors fail to build against the generic kernels' headers (make test-kernels' capability), so this
    # module compiles into a cache of its own
    mp = pytest.MonkeyPatch()
    mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()  # do not leave this module's graphs (and recompile budget) to other tests
    mp.undo()


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return M.create("spike_convnet", T=T, in_channels=1, width=4).train()


def _batch(n: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, 8, 8, generator=g) * 3.0, torch.randint(0, 10, (n,), generator=g)


def _bn(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> None:
    assert got.shape == want.shape
    assert float((got - want).abs().max()) <= rtol * max(float(want.abs().max()), 1e-6)


def _assert_bn_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7, msg=k)


def _lif_states(model) -> list:
    return [m.v for m in model.modules() if isinstance(m, neuron.LIFNode)]


def _subspace(model, k: int = 3):
    d = model.num_params()
    q, _ = torch.linalg.qr(torch.randn(d, k, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    return SimpleNamespace(basis=q.float(), layout=None)


def test_inductor_forward_equals_eager_reads_in_place_params_and_updates_bn():
    eager, comp = _model(), _model().set_compile(True)
    x, _ = _batch()
    with torch.no_grad():
        _close(comp(x), eager(x))
        g0 = graph_count()
        for i in range(3):  # perturb in place, as every SZO probe does
            for pe, pc in zip(eager.parameters(), comp.parameters()):
                delta = 0.05 * torch.randn(pe.shape, generator=torch.Generator().manual_seed(i))
                pe.add_(delta)
                pc.add_(delta)
            _close(comp(x), eager(x))
    assert graph_count() == g0, "perturbing the parameters in place recompiled the forward"
    _assert_bn_equal(_bn(comp), _bn(eager))  # train-mode BN updated its running statistics 4 times
    assert int(_bn(comp)["bn1.num_batches_tracked"]) == 4
    assert all(isinstance(v, float) and v == 0.0 for v in _lif_states(comp))  # reset after the forward


def test_szo_step_compiled_equals_eager_and_does_not_recompile():
    x, y = _batch()
    models, opts = [], []
    for compiled in (False, True):
        m = _model()
        models.append(m)
        opts.append(SZO(m.parameters(), _subspace(m), mu=1e-2, lr=0.5, momentum=0.9, estimator="rge", q=2,
                        model=m, generator=torch.Generator().manual_seed(0), scale="absolute"))
    models[1].set_compile(True, backend="aot_eager")
    losses = [[], []]
    counts = []
    for _ in range(3):
        for i, (m, opt) in enumerate(zip(models, opts)):
            losses[i].append(float(opt.step(lambda m=m: tet_loss(m(x), y))))
        counts.append(graph_count())
    assert counts[1] == counts[0] == counts[2], "an SZO step recompiled the forward"
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    _close(models[1].flat_params(), models[0].flat_params())
    _assert_bn_equal(_bn(models[1]), _bn(models[0]))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])  # the recipes compile BPTT with inductor
def test_bptt_step_compiled_equals_eager(backend):
    x, y = _batch()
    grads = []
    for compiled in (False, True):
        m = _model()
        if compiled:
            m.set_compile(True, backend=backend)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        for _ in range(2):
            opt.zero_grad()
            tet_loss(m(x), y).backward()
            opt.step()
        grads.append(torch.cat([p.grad.reshape(-1) for p in m.parameters()]))
        grads.append(m.flat_params())
    _close(grads[2], grads[0], rtol=1e-4)
    _close(grads[3], grads[1])


def test_eval_mode_persistent_state_and_shapes_get_their_own_graphs():
    eager, comp = _model(), _model().set_compile(True, backend="aot_eager")
    x, _ = _batch()
    with torch.no_grad():
        for m in (eager, comp):
            m.eval()
        _close(comp(x), eager(x))
        g0 = graph_count()
        _close(comp(x[:3]), eager(x[:3]))  # another batch size: its own graph, same function
        assert graph_count() == g0 + 1
        g0 = graph_count()
        _close(comp(x[:3]), eager(x[:3]))
        assert graph_count() == g0  # cached per shape
        with eager.persistent_state(), comp.persistent_state():  # neuron state carried across calls
            for _ in range(3):
                _close(comp(x), eager(x))
            assert all(isinstance(v, torch.Tensor) for v in _lif_states(comp))
        assert all(isinstance(v, float) for v in _lif_states(comp))  # reset on leaving


def test_deep_copy_runs_its_own_parameters():
    a = _model().set_compile(True, backend="aot_eager")
    x, _ = _batch()
    b = copy.deepcopy(a)
    with torch.no_grad():
        for p in b.parameters():
            p.mul_(0.5)
        eager_b = copy.deepcopy(b).set_compile(False)
        eager_a = copy.deepcopy(a).set_compile(False)
        _close(b(x), eager_b(x))
        _close(a(x), eager_a(x))
    assert b.compile_opts == ("aot_eager", None)


def test_set_compile_off_and_bad_input():
    m = _model()
    assert m.set_compile(True).compile_opts == ("inductor", None)
    assert m.set_compile(False).compile_opts is None
    with pytest.raises(ValueError, match="True or False"):
        m.set_compile("yes")
    with pytest.raises(ValueError, match="unknown torch.compile backend 'nope'; valid: .*inductor"):
        m.set_compile(True, backend="nope")
    with pytest.raises(ValueError, match="unknown torch.compile mode"):
        m.set_compile(True, mode="fastest")
    with pytest.raises(ValueError, match="applies to backend 'inductor' only"):
        m.set_compile(True, backend="eager", mode="max-autotune")
    sub = _subspace(m.set_compile(True))  # compiled: the probe path refuses what bypasses its multi-step forward
    with pytest.raises(ValueError, match=r"engine='batched' .* cannot be combined with model.set_compile\(True\)"):
        SZO(m.parameters(), sub, model=m, probes=ProbePath(engine="batched"), scale="absolute")


def test_compiled_forward_refuses_hook_based_sync_bn(tmp_path):
    # a compiled graph does not see forward hooks added after tracing (torch's default
    # skip_nnmodule_hook_guards), and data-parallel sync_bn works through such hooks
    import torch.distributed as dist

    m = _model().set_compile(True, backend="aot_eager")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"sync_bn=True with distributed=.data. \(BN synchronised by forward hooks\) cannot be combined with model.set_compile"):
            SZO(m.parameters(), _subspace(m), model=m, probes=ProbePath(distributed="data"), scale="absolute")
        SZO(m.parameters(), _subspace(m), model=m, probes=ProbePath(distributed="data", sync_bn=False), scale="absolute")
        SZO(m.parameters(), _subspace(m), model=m, probes=ProbePath(distributed="perturbation"), scale="absolute")
    finally:
        dist.destroy_process_group()
