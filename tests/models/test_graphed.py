"""szo.models.graphed: the bookkeeping of CUDA-graph probe forwards, driven on the CPU by a backend
that "replays" by calling the captured function again (the CUDA backend itself runs in the device
subset, tests/test_device.py). What must hold whatever replays: the same logits and the same BN
state as eager forwards, one graph per signature, eager forwards where a graph cannot serve, and a
failed capture costs one warning, not the run."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from szo.evaluators import Batch, batch_closure
from szo.losses import tet_loss
from szo.models import create
from szo.models.graphed import CudaGraphBackend, ForwardGraphs
from szo.optim import build_optimizer

from .graph_replay import RecordedOps


class CallAgain:
    """A graph backend for the CPU: 'capture' runs the warm-up and one forward (whose side effects
    the caller undoes, as after a real capture), 'replay' recomputes into the captured output."""

    def __init__(self, fail: bool = False):
        self.fail, self.captured = fail, 0

    def supports(self, x):
        return True

    def capture(self, fn, warmup, between):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        for _ in range(warmup):
            fn()
            between()
        out = fn()
        between()
        self.captured += 1

        def replay():
            out.copy_(fn())

        return replay, out


def _model(**kw):
    torch.manual_seed(0)  # test-only: one fixed model
    return create("spike_convnet", num_classes=10, T=2, width=4, **kw).train()


def _x(n=8, seed=1):
    return torch.rand(n, 1, 8, 8, generator=torch.Generator().manual_seed(seed))


def _bn_state(m):
    return {k: v.clone() for k, v in m.named_buffers()}


def test_replays_equal_eager_forwards_with_in_place_changes_and_bn_updates():
    eager, graphed = _model(), _model()
    graphed.set_cuda_graphs(True, backend=CallAgain())
    with torch.no_grad():
        for i in range(4):
            x = _x(seed=i)
            for m in (eager, graphed):  # a probe: move the parameters in place, as the optimizers do
                m.load_flat_params(m.flat_params() + 0.01 * (i + 1))
            assert torch.equal(graphed(x), eager(x))
            for k, v in _bn_state(eager).items():  # the warm-up forwards left no trace in the running statistics
                assert torch.equal(v, dict(graphed.named_buffers())[k]), k
    st = graphed.cuda_graphs.stats
    assert st.captures == 1 and st.replays == 4 and not st.eager and len(graphed.cuda_graphs) == 1


def test_one_graph_per_signature_and_eager_where_a_graph_cannot_serve():
    m = _model().set_cuda_graphs(True, max_graphs=2, backend=CallAgain())
    with torch.no_grad():
        m(_x())
        m(_x(seed=2))                 # same signature: replay
        m.eval()
        m(_x())                       # eval mode: a second graph
        m.train()
        m(_x(n=4))                    # a third signature: the table (2) is full
        with m.persistent_state():
            m(_x())                   # the state carries over: eager
    m(_x())                           # grad enabled (BPTT): eager
    st = m.cuda_graphs.stats
    assert st.captures == 2 and st.replays == 3
    assert dict(st.eager) == {"graph table full": 1, "persistent state": 1, "grad enabled": 1}


def test_a_failed_capture_warns_once_and_that_signature_stays_eager():
    eager, m = _model(), _model().set_cuda_graphs(True, backend=CallAgain(fail=True))
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="CUDA graph capture of SpikeConvNet's forward failed"):
            out = m(_x())
        assert torch.equal(out, eager(_x()))
        assert torch.equal(m(_x()), eager(_x()))  # no second try, no second warning
    st = m.cuda_graphs.stats
    assert st.captures == 0 and st.eager["capture failed"] == 2 and len(st.failures) == 1
    assert m.cuda_graphs.backend.captured == 0


def test_the_cuda_backend_leaves_cpu_forwards_eager():
    m = _model().set_cuda_graphs(True)
    assert isinstance(m.cuda_graphs.backend, CudaGraphBackend)
    with torch.no_grad():
        assert torch.equal(m(_x()), _model()(_x()))
    assert dict(m.cuda_graphs.stats.eager) == {"cpu tensor": 1} and m.cuda_graphs.stats.captures == 0


def test_szo_steps_through_graphs_equal_eager_steps():
    """Every probe of SZO-CGE (k = 3: 6 probes + the BN forward) replays one graph; the parameters
    and BN statistics after two steps are bitwise those of the eager steps."""
    outs = []
    for graphs in (False, True):
        m = _model()
        if graphs:
            m.set_cuda_graphs(True, backend=CallAgain())
        d = m.num_params()
        basis = torch.linalg.qr(torch.randn(d, 3, generator=torch.Generator().manual_seed(1)))[0]
        sub = SimpleNamespace(basis=basis, layout=m.param_layout(), reference=m.flat_params())
        opt = build_optimizer("szo-cge", m, subspace=sub, lr=0.5, mu=0.05, scale="absolute")
        for i in range(2):
            x, y = _x(seed=10 + i), torch.arange(8) % 10
            opt.step(batch=Batch(x, y, tet_loss))
        outs.append((m.flat_params(), _bn_state(m)))
        if graphs:
            assert m.cuda_graphs.stats.captures == 1 and m.cuda_graphs.stats.replays == 2 * 7
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(outs[0][1][k], outs[1][1][k]) for k in outs[0][1])


def test_settings_validated_copies_fresh_and_compile_exclusive():
    m = _model().set_cuda_graphs(True, backend=CallAgain())
    with torch.no_grad():
        m(_x())
    c = copy.deepcopy(m)
    assert isinstance(c.cuda_graphs, ForwardGraphs) and len(c.cuda_graphs) == 0 and len(m.cuda_graphs) == 1
    with pytest.raises(ValueError, match="set_cuda_graphs\\(True\\) .* cannot be combined with model.set_compile"):
        m.set_compile(True)
    with pytest.raises(ValueError, match="set_cuda_graphs\\(enabled\\) must be True or False"):
        m.set_cuda_graphs("yes")
    with pytest.raises(ValueError, match="max_graphs must be an int >= 1"):
        m.set_cuda_graphs(True, max_graphs=0)
    m.set_cuda_graphs(False)
    assert m.cuda_graphs is None
    m.set_compile(True)
    with pytest.raises(ValueError, match="set_cuda_graphs\\(True\\) .* cannot be combined with model.set_compile"):
        m.set_cuda_graphs(True)


def test_recipe_setting_validated_against_the_paths_that_bypass_the_forward():
    from szo.config import load_recipe

    assert load_recipe("digits-scratch", ["cuda_graphs=true"]).cuda_graphs is True
    for sets, what in ((["compile=true"], "compile"), (["szo.engine=batched"], "szo.engine 'batched'"),
                       (["szo.time_chunk=1"], "szo.time_chunk"), (["backend=fixed", "bn_stats=deployed"], "backend 'fixed'")):
        with pytest.raises(ValueError, match=f"(cuda_graphs=true .*cannot be combined with {what}|{what} .*cannot be "
                                             f"combined with cuda_graphs=true)"):
            load_recipe("digits-scratch", ["cuda_graphs=true", *sets])


# ---------------------------------------------------------------------- what a replay does not run
def test_a_replay_runs_no_python_so_a_hook_driven_probe_would_see_no_perturbation():
    """With a backend that replays recorded operations (tests/models/graph_replay.py), as a CUDA graph
    does: in-place parameter changes and BN updates are seen, exactly as eagerly, but a forward hook --
    how node perturbation moves a layer (szo.zo.NodeSpace) -- does not run in a replay: a hook-driven
    method's probes would all return the clean loss, a zero estimate. Hence the probe path's rule."""
    graphed, eager = _model(), _model()
    graphed.set_cuda_graphs(True, backend=RecordedOps())
    x = _x()
    with torch.no_grad():
        for _ in range(3):  # the first forward captures, the next ones replay
            torch.testing.assert_close(graphed(x), eager(x), rtol=0, atol=0)
            for a, b in zip(graphed.parameters(), eager.parameters()):
                a.add_(0.01)
                b.add_(0.01)
        assert graphed.cuda_graphs.backend.replays == 3  # every call a replay (the first right after its capture)
        clean = graphed(x).clone()
        for net in (graphed, eager):  # a node perturbation's probe: +5 on the fc layer's outputs, through a hook
            net.fc.register_forward_hook(lambda mod, args, out: out + 5.0)
        assert not torch.equal(eager(x), clean)  # eagerly the hook moves the logits
        torch.testing.assert_close(graphed(x), clean, rtol=0, atol=0)  # the replay did not run it


def test_hook_driven_methods_are_refused_with_graphs_and_compile_at_every_door():
    from szo.config import load_recipe
    from szo.methods import list_methods
    from szo.optim import LayerwiseZO

    hooked = list_methods(hooks=True, integer=False)
    assert set(hooked) == {"np-zo", "wp-zo", "awp-zo"}
    m = _model().set_cuda_graphs(True, backend=RecordedOps())
    for method in hooked:
        with pytest.raises(ValueError, match=f"method '{method}' \\(it drives layers through forward hooks at every "
                                             "forward\\) cannot be combined with model.set_cuda_graphs\\(True\\)"):
            build_optimizer(method, m, lr=0.1, mu=0.1)
        for key in ("cuda_graphs=true", "compile=true"):
            with pytest.raises(ValueError, match=f"method '{method}' .* cannot be combined with {key.split('=')[0]}"):
                load_recipe("digits-scratch", [f"method={method}", key])
    with pytest.raises(ValueError, match="method 'np-zo' .* cannot be combined with model.set_cuda_graphs"):
        LayerwiseZO(m, perturbation="node")  # built directly: its record says it drives hooks
    m.set_cuda_graphs(False).set_compile(True)
    with pytest.raises(ValueError, match="method 'wp-zo' .* cannot be combined with model.set_compile\\(True\\)"):
        LayerwiseZO(m, perturbation="weight")
    LayerwiseZO(m.set_compile(False), perturbation="adaptive")  # an eager forward runs its hooks


@pytest.mark.parametrize("method", ["np-zo", "wp-zo", "awp-zo"])
def test_graphs_switched_on_after_the_optimizer_was_built_are_refused_at_the_next_step(method):
    """The path is checked again at every step against the model's forward as it is then: a hook-driven
    method built on an eager model, whose forward is then replayed as graphs (or compiled), stops with
    the same line before its probes run, instead of returning zero estimates from hookless replays."""
    m = _model()
    opt = build_optimizer(method, m, lr=0.1, mu=0.1)
    y = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(2))
    closure = batch_closure(m, tet_loss, _x(), y, reduction=opt.loss_reduction)
    opt.step(closure)  # eager: runs
    m.set_cuda_graphs(True, backend=RecordedOps())
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(ValueError, match=f"method '{method}' .* cannot be combined with model.set_cuda_graphs\\(True\\)"):
        opt.step(closure)
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))  # nothing moved
    m.set_cuda_graphs(False).set_compile(True)
    with pytest.raises(ValueError, match=f"method '{method}' .* cannot be combined with model.set_compile\\(True\\)"):
        opt.step(closure)
    m.set_compile(False)
    opt.step(closure)  # eager again: runs


def test_data_parallel_sync_bn_is_refused_on_a_graphed_model(tmp_path):
    """SyncBatchNorm synchronises through forward hooks, which a replay skips: refused when SZO is built
    directly on a graphed model, not only on the recipe path."""
    import torch.distributed as dist

    from szo.optim import SZO
    from szo.zo import ProbePath

    m = _model().set_cuda_graphs(True, backend=RecordedOps())
    sub = SimpleNamespace(basis=torch.eye(m.num_params(), 2), layout=None)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="sync_bn=True with distributed='data' .* cannot be combined with "
                                             "model.set_cuda_graphs\\(True\\)"):
            SZO(m, sub, start="current", probes=ProbePath(distributed="data"), scale="absolute")
        SZO(m, sub, start="current", probes=ProbePath(distributed="data", sync_bn=False), scale="absolute")
        SZO(m, sub, start="current", probes=ProbePath(distributed="perturbation"), scale="absolute")
    finally:
        dist.destroy_process_group()


def test_the_capture_holds_the_weight_casts_not_autocasts_cached_ones():
    """Under autocast a graph must contain the casts of the parameters (a replay then casts them
    where the probe moved them); a cast taken from autocast's weight cache would be a tensor the
    graph reads at the capture's weights. The capture runs with the cache off, inside any block."""
    seen = []

    class Watch(CallAgain):
        def capture(self, fn, warmup, between):
            seen.append(torch.is_autocast_cache_enabled())
            return super().capture(fn, warmup, between)

    m = _model().set_cuda_graphs(True, backend=Watch())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        m(_x())
        assert torch.is_autocast_cache_enabled()  # the caller's switch back
    assert seen == [False]
