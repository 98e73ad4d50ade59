"""Batched perturbation engine == the optimizer's sequential loop (losses and BN statistics)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import szo.models as M
from szo.evaluators import Batch, BatchedEvaluator, BatchedProbeEvaluator, batch_closure
from szo.losses import tet_loss
from szo.optim import SZO
from szo.zo import ParamSpace, ProbePath

# (in_channels, spatial size, k): tiny inputs; the two big models get k=1 (m=2 probes)
SIZES = {"spike_convnet": (1, 8, 2), "spike_resnet20": (3, 8, 2), "spike_resnet18": (3, 8, 2), "spike_resnet8": (1, 12, 2),
         "spike_resnet50": (3, 16, 1), "spike_vgg11": (2, 32, 1),
         "snn_mlp": (7, 10, 2), "snn_rlif": (7, 10, 2)}  # 7 x 10 x 10 = the SHD networks' 700 inputs
DEFAULT_SIZE = (3, 16, 1)


def _setup(name: str, k: int | None = None, estimator: str = "cge", seed: int = 0):
    c, h, k0 = SIZES.get(name, DEFAULT_SIZE)
    k = k0 if k is None else k
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = M.create(name, T=2).train()
    d = model.num_params()
    basis = torch.linalg.qr(torch.randn(d, k, generator=g))[0]
    # probe-mean: the engines' own BN update (the mean over the probes) is what is compared here
    opt = SZO(model.parameters(), SimpleNamespace(basis=basis, layout=None), mu=0.05, model=model,
              estimator=estimator, q=2, generator=torch.Generator().manual_seed(seed), probes=ProbePath(bn_update="probe-mean"), scale="absolute")
    x = torch.randn(2, c, h, h, generator=g)
    y = torch.randint(0, model.num_classes, (2,), generator=g)
    return model, opt, x, y


def _bn_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}


def _batched(opt, model, plan, x, y, chunk=None):
    """The plan's losses from the batched engine, as SZO(engine="batched") runs it (one step's probes)."""
    ev = BatchedProbeEvaluator(opt.guard, model, ProbePath(engine="batched", chunk=chunk))
    with ev.session():
        return ev.run(batch_closure(model, tet_loss, x, y), opt.space, plan, batch=Batch(x, y, tet_loss))


def _loop_vs_batched(model, opt, x, y, plan, chunk=None):
    start = {k: v.clone() for k, v in model.state_dict().items()}
    loop = opt.evaluate(lambda: tet_loss(model(x), y), plan)  # the optimizer's loop evaluator
    bn_loop = _bn_state(model)
    model.load_state_dict(start)
    batched = _batched(opt, model, plan, x, y, chunk)
    for k, v in model.state_dict().items():  # parameters untouched
        if "running" not in k and "num_batches" not in k:
            assert torch.equal(v, start[k]), k
    return loop, batched, bn_loop, _bn_state(model)


@pytest.mark.parametrize("name", M.names())
def test_batched_equals_loop_every_model(name):
    model, opt, x, y = _setup(name)
    plan = opt.plan()
    loop, batched, bn_loop, bn_batched = _loop_vs_batched(model, opt, x, y, plan, chunk=plan.m)
    assert loop.shape == batched.shape == (plan.m,)
    assert loop.unique().numel() > 1  # the probes really differ
    torch.testing.assert_close(batched, loop, rtol=1e-5, atol=0.0)
    assert bool(bn_loop) == (name not in ("snn_mlp", "snn_rlif")), "every model but the SHD networks has BN layers"
    for k in bn_loop:
        torch.testing.assert_close(bn_batched[k], bn_loop[k], rtol=1e-5, atol=1e-6, msg=k)


def test_rge_plan_and_flat_theta_batch_match_loop():
    model, opt, x, y = _setup("spike_convnet", k=4, estimator="rge")
    plan = opt.plan()  # dense Gaussian rows: the GEMM path, not the one-hot gather
    U = plan.dense()
    loop, batched, bn_loop, bn_batched = _loop_vs_batched(model, opt, x, y, plan)
    torch.testing.assert_close(batched, loop, rtol=1e-5, atol=0.0)
    for k in bn_loop:
        torch.testing.assert_close(bn_batched[k], bn_loop[k], rtol=1e-5, atol=1e-6)
    # the same probes as explicit flat vectors theta_batch [m, d]
    theta0 = model.flat_params()
    thetas = theta0 + 0.05 * (U.float() @ opt.space.basis_t)
    model.eval()  # eval: BN uses running statistics and leaves them alone
    before = _bn_state(model)
    ev = BatchedEvaluator(model, tet_loss, chunk=3)
    flat = ev.losses(x, y, thetas)
    ref = []
    for t in thetas:
        model.load_flat_params(t)
        with torch.no_grad():
            ref.append(float(tet_loss(model(x), y)))
    model.load_flat_params(theta0)
    torch.testing.assert_close(flat, torch.tensor(ref, dtype=torch.float64), rtol=1e-5, atol=0.0)
    for k, v in _bn_state(model).items():
        assert torch.equal(v, before[k])


@pytest.mark.parametrize("chunk", [1, 2, 4, 5])
def test_chunking_matches_single_pass(chunk):
    model, opt, x, y = _setup("spike_convnet", k=3)
    U = opt.plan().dense()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    whole = BatchedEvaluator(model, tet_loss, chunk=U.shape[0])
    ref = whole.losses(x, y, ([p.detach() for p in opt.space.params], opt.space.basis_views, U, 0.05))
    bn_ref = _bn_state(model)
    model.load_state_dict(start)
    ev = BatchedEvaluator(model, tet_loss, chunk=chunk)
    got = ev.losses(x, y, ([p.detach() for p in opt.space.params], opt.space.basis_views, U, 0.05))
    assert ev.last_chunk == chunk
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0.0)
    for k, v in _bn_state(model).items():
        torch.testing.assert_close(v, bn_ref[k], rtol=1e-6, atol=1e-7)


def test_auto_chunk_is_positive_and_bounded():
    model, opt, x, y = _setup("spike_convnet")
    ev = BatchedEvaluator(model, tet_loss)
    assert ev.per_copy_bytes(x) > 0
    assert 1 <= ev.chunk_size(x, 4) <= 4
    ev_tiny = BatchedEvaluator(model, tet_loss, memory_fraction=1e-12)
    assert ev_tiny.chunk_size(x, 4) == 1


def test_auto_chunk_is_chosen_once_per_input_shape(monkeypatch):
    import szo.evaluators.batched as B

    model, opt, x, y = _setup("spike_convnet")
    ev = BatchedEvaluator(model, tet_loss)
    per_copy = ev.per_copy_bytes(x)
    reads = []

    def fake_free(device):  # free memory that shrinks after every read
        reads.append(device)
        return per_copy * (6 - 2 * len(reads)) * 2  # memory_fraction 0.5: 4 copies first, then 2

    monkeypatch.setattr(B, "available_memory_bytes", fake_free)
    U = opt.plan().dense()
    plan = ([p.detach() for p in opt.space.params], opt.space.basis_views, U, 0.05)
    for _ in range(3):
        ev.losses(x, y, plan)
        assert ev.last_chunk == 4
    assert ev.chunk_size(x[:1], 99) == max(1, 4 * per_copy // ev.per_copy_bytes(x[:1]))  # new shape: same budget
    assert len(reads) == 1


def test_loss_fn_per_call_is_not_kept():
    model, opt, x, y = _setup("spike_convnet")
    step_plan = opt.plan()
    U = step_plan.dense()
    plan = ([p.detach() for p in opt.space.params], opt.space.basis_views, U, 0.05)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    ref = BatchedEvaluator(model, tet_loss).losses(x, y, plan)
    model.load_state_dict(start)
    ev = BatchedEvaluator(model)
    torch.testing.assert_close(ev.losses(x, y, plan, loss_fn=tet_loss), ref, rtol=0.0, atol=0.0)
    with pytest.raises(ValueError, match="no loss_fn"):
        ev.losses(x, y, plan)
    with pytest.raises(ValueError, match="loss_fn must be callable"):
        ev.losses(x, y, plan, loss_fn="tet")
    model.load_state_dict(start)
    torch.testing.assert_close(_batched(opt, model, step_plan, x, y), ref, rtol=0.0, atol=0.0)
    closure = batch_closure(model, tet_loss, x, y)
    with pytest.raises(ValueError, match=r"^batch must be a szo.evaluators.Batch\(x, y, loss_fn\), got tuple"):
        BatchedProbeEvaluator(opt.guard, model).run(closure, opt.space, step_plan, batch=(x, y))
    with pytest.raises(ValueError, match=r"^Batch\(x, y, loss_fn\): loss_fn must be callable"):
        BatchedProbeEvaluator(opt.guard, model).run(closure, opt.space, step_plan, batch=Batch(x, y, "tet"))


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "4"])
def test_bad_chunk_raises(bad):
    model = M.create("spike_convnet", T=2)
    with pytest.raises(ValueError, match="chunk"):
        BatchedEvaluator(model, tet_loss, chunk=bad)
    with pytest.raises(ValueError, match="chunk"):
        BatchedProbeEvaluator(SZO(model, SimpleNamespace(basis=torch.eye(model.num_params(), 2), layout=None),
                                  start="current", scale="absolute").guard, model, ProbePath(engine="batched", chunk=bad))


def test_bad_inputs_raise():
    model, opt, x, y = _setup("spike_convnet")
    sub = SimpleNamespace(basis=torch.eye(model.num_params(), 2), layout=None)
    with pytest.raises(ValueError, match="engine"):
        SZO(model, sub, start="current", probes=ProbePath(engine="vmap"), scale="absolute")
    ev = BatchedEvaluator(model, tet_loss)
    with pytest.raises(ValueError, match=r"\[m, d\]"):
        ev.losses(x, y, torch.zeros(3, 7))
    bev = BatchedProbeEvaluator(opt.guard, model)
    with pytest.raises(ValueError, match=r"^engine='batched' folds the probes over the batch and never calls the "
                                         r"closure: give the step its batch, opt.step\(closure, batch="):
        bev.run(lambda: tet_loss(model(x), y), opt.space, opt.plan())
    b = Batch(x, y, tet_loss)
    with pytest.raises(ValueError, match="evaluates subspace plans; got a ParamSpace"):
        bev.run(b.closure(model), ParamSpace(list(model.parameters())), opt.plan(), batch=b)
    other, other_opt, _, _ = _setup("spike_convnet", seed=1)
    with pytest.raises(ValueError, match="not model.parameters"):
        bev.run(b.closure(model), other_opt.space, other_opt.plan(), batch=b)

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.s = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return x * self.s

    with pytest.raises(ValueError, match="Scale"):
        BatchedEvaluator(nn.Sequential(nn.Linear(2, 2), Scale()), tet_loss)


# ------------------------------------------------------------------ streaming forward (time_chunk)
@pytest.mark.parametrize("name", ["spike_convnet", "spike_resnet20"])
def test_streaming_exact_szo_step_equals_multistep_step(name):
    """One SZO step (loop engine) with the streaming forward, stream_bn='exact': the same probe
    losses, parameters and committed BN running statistics as with the multi-step forward."""
    model, opt, x, y = _setup(name)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = opt.state_dict()
    closure = lambda: tet_loss(model(x), y)  # noqa: E731
    opt.step(closure)
    ref_losses, ref_state = opt.last_losses.clone(), {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(start)
    opt.load_state_dict(opt_state)
    with model.streaming(time_chunk=1, stream_bn="exact"):
        opt.step(closure)
    torch.testing.assert_close(opt.last_losses, ref_losses, rtol=1e-5, atol=0.0)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, ref_state[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("name", ["spike_convnet", "spike_resnet20"])
@pytest.mark.parametrize("stream_bn", ["exact", "running", "chunk"])
def test_batched_engine_combines_with_streaming(name, stream_bn):
    """Batched engine + streaming forward == loop + streaming forward, for every BN policy."""
    model, opt, x, y = _setup(name)
    plan = opt.plan()
    with model.streaming(time_chunk=1, stream_bn=stream_bn):
        loop, batched, bn_loop, bn_batched = _loop_vs_batched(model, opt, x, y, plan, chunk=3)
    torch.testing.assert_close(batched, loop, rtol=1e-5, atol=0.0)
    for k in bn_loop:
        torch.testing.assert_close(bn_batched[k], bn_loop[k], rtol=1e-5, atol=1e-6, msg=k)


def test_szo_engine_switch_equal_steps_and_clear_errors():
    def run(engine: str):
        torch.manual_seed(0)
        model = M.create("spike_convnet", T=2).train()
        basis = torch.linalg.qr(torch.randn(model.num_params(), 3, generator=torch.Generator().manual_seed(1)))[0]
        opt = SZO(model.parameters(), SimpleNamespace(basis=basis, layout=None), mu=0.05, lr=0.5, model=model,
                  estimator="rge", q=2, generator=torch.Generator().manual_seed(2), probes=ProbePath(engine=engine, chunk=2 if engine == "batched" else None), scale="absolute")
        g = torch.Generator().manual_seed(3)
        for _ in range(2):
            x, y = torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
            opt.step(batch=Batch(x, y, tet_loss))  # the loop calls the closure built from it; the engine folds it
        return model, opt

    (m_loop, o_loop), (m_bat, o_bat) = run("loop"), run("batched")
    # losses agree to ~1e-7 relative; (L+ - L-) / (2 mu) magnifies that to ~1e-6 on c
    torch.testing.assert_close(o_bat.coordinates, o_loop.coordinates, rtol=1e-4, atol=1e-6)
    for (k, a), b in zip(m_loop.state_dict().items(), m_bat.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=k)
    assert o_bat.forward_passes == o_loop.forward_passes == 10  # 2 steps x (2q = 4 probes + 1 BN forward)
    with pytest.raises(ValueError, match="never calls the closure: give the step its batch"):
        o_bat.step(lambda: tet_loss(m_bat(torch.zeros(2, 1, 8, 8)), torch.zeros(2, dtype=torch.long)))
    with pytest.raises(ValueError, match="unknown engine 'vmap'; valid: loop, batched"):
        SZO(m_loop.parameters(), SimpleNamespace(basis=torch.eye(m_loop.num_params(), 2), layout=None),
            model=m_loop, probes=ProbePath(engine="vmap"), scale="absolute")


def test_recipe_engine_option_reaches_the_optimizer(tmp_path):
    from szo.config import load_recipe

    cfg = load_recipe("digits-scratch", ["szo.engine=batched", "szo.chunk=8"])
    assert (cfg["szo"]["engine"], cfg["szo"]["chunk"]) == ("batched", 8)
    with pytest.raises(ValueError, match="invalid szo.engine 'fast'; valid: loop, batched"):
        load_recipe("digits-scratch", ["szo.engine=fast"])
    with pytest.raises(ValueError, match="szo.engine 'batched' .* cannot be combined with backend 'fixed'"):
        load_recipe("digits-fixed", ["szo.engine=batched"])
    from szo.optim import build_optimizer

    model = M.create("spike_convnet", T=2)
    with pytest.raises(ValueError, match="evaluates SZO probe plans: it applies to methods 'szo-cge'"):
        build_optimizer("bp", model, lr=0.1, engine="batched")


# ------------------------------------------------------------------ BN momentum=None (cumulative average)
def test_bn_momentum_reads_the_counter_only_for_a_cumulative_average():
    from szo.models.streaming import bn_momentum

    bn = nn.BatchNorm2d(2)
    bn.num_batches_tracked = None  # any read of the counter would fail
    assert bn_momentum(bn) == 0.1
    bn = nn.BatchNorm2d(2, momentum=None)
    bn.num_batches_tracked.fill_(3)
    assert bn_momentum(bn) == 0.25


@pytest.mark.parametrize("time_chunk", [None, 1])
def test_batched_equals_loop_with_cumulative_average_bn(time_chunk):
    model, opt, x, y = _setup("spike_convnet")
    for mod in model.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.momentum = None
            mod.num_batches_tracked.fill_(3)
    plan = opt.plan()
    with model.streaming(time_chunk=time_chunk, stream_bn="exact"):
        loop, batched, bn_loop, bn_batched = _loop_vs_batched(model, opt, x, y, plan, chunk=3)
    torch.testing.assert_close(batched, loop, rtol=1e-5, atol=0.0)
    for k in bn_loop:
        torch.testing.assert_close(bn_batched[k], bn_loop[k], rtol=1e-5, atol=1e-6, msg=k)
    assert int(model.bn1.num_batches_tracked) == 4


def test_mixed_eval_and_train_bn_same_statistics_as_loop():
    # an eval-mode BN layer keeps its statistics (and num_batches_tracked) bit-exact in both
    # engines; the loop used to bump its counter and rewrite it as sum / count
    model, opt, x, y = _setup("spike_convnet")
    model.bn1.eval()
    plan = opt.plan()
    before = _bn_state(model)
    loop, batched, bn_loop, bn_batched = _loop_vs_batched(model, opt, x, y, plan)
    torch.testing.assert_close(batched, loop, rtol=1e-5, atol=0.0)
    for k in ("bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"):
        assert torch.equal(bn_loop[k], before[k]) and torch.equal(bn_batched[k], before[k]), k
    assert int(bn_loop["bn2.num_batches_tracked"]) == int(bn_batched["bn2.num_batches_tracked"]) == 1
    for k in ("bn2.running_mean", "bn2.running_var"):
        torch.testing.assert_close(bn_batched[k], bn_loop[k], rtol=1e-5, atol=1e-7)


def test_a_frozen_parameter_under_the_batched_engine_is_one_line_that_says_so():
    """SZO leaves a frozen parameter out of its subspace; the batched engine folds every parameter of the
    model, so it says that, and what to do, instead of a parameter-order mismatch."""
    torch.manual_seed(0)
    model = M.create("spike_convnet", num_classes=10, T=2, width=4).train()
    next(model.parameters()).requires_grad_(False)
    basis = torch.linalg.qr(torch.randn(model.num_params(), 3, generator=torch.Generator().manual_seed(1)))[0]
    sub = SimpleNamespace(basis=basis, layout=model.param_layout(), reference=model.flat_params())
    opt = SZO(model, sub, start="current", probes=ProbePath(engine="batched"), scale="absolute")
    x, y = torch.rand(8, 1, 8, 8), torch.randint(0, 10, (8,))
    with pytest.raises(ValueError, match=r"^engine='batched' folds every parameter of the model into its probe "
                                         r"copies; 1 of them are frozen \(requires_grad=False\) .*use engine='loop'"):
        opt.step(batch=Batch(x, y, tet_loss))
