"""bn_time="per-step": every time step normalised with its own statistics, as a single-step loop does."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from spikingjelly.activation_based import functional

import szo.models as M
from szo.evaluators import Batch
from szo.losses import tet_loss
from szo.optim import SZO
from szo.zo import ProbePath


def _bn_buffers(model):
    return {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}


@pytest.mark.parametrize("name", ["spike_convnet", "spike_resnet20"])
def test_per_step_equals_a_single_step_loop_over_T(name):
    torch.manual_seed(0)
    T = 3
    model = M.create(name, T=T, in_channels=1 if name == "spike_convnet" else 3, bn_time="per-step").train()
    assert model.bn_time == "per-step"
    oracle = copy.deepcopy(model)
    functional.set_step_mode(oracle, "s")  # SpikingJelly single-step layers: BN = nn.BatchNorm2d on [N, C, H, W]
    x = torch.rand(4, 1 if name == "spike_convnet" else 3, 8, 8)
    with torch.no_grad():
        out = model(x)
        ref = torch.stack([oracle.forward_seq(x) for _ in range(T)])  # the authors' loop over T
    functional.reset_net(oracle)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for k, v in _bn_buffers(model).items():
        torch.testing.assert_close(v, _bn_buffers(oracle)[k], rtol=1e-5, atol=1e-7, msg=k)
    assert int(model.state_dict()[next(k for k in _bn_buffers(model) if "num_batches" in k)]) == T
    # shared BN is a different function on the same weights (deeper layers see other statistics)
    shared = copy.deepcopy(model).set_bn_time("shared").train()
    with torch.no_grad():
        assert not torch.allclose(shared(x), out, atol=1e-4)


def test_per_step_streams_exactly_in_one_pass():
    torch.manual_seed(0)
    model = M.create("spike_convnet", T=4, bn_time="per-step").train()
    x = torch.rand(4, 1, 8, 8)
    start = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        full = model(x)
        bufs = _bn_buffers(model)
        model.load_state_dict(start)
        for policy in ("exact", "running", "chunk"):  # no policy applies: per-step BN sees all it needs
            model.load_state_dict(start)
            streamed = model(x, time_chunk=1, stream_bn=policy)
            torch.testing.assert_close(streamed, full, rtol=1e-6, atol=1e-7)
            for k, v in _bn_buffers(model).items():
                torch.testing.assert_close(v, bufs[k], rtol=1e-6, atol=1e-7, msg=k)


@pytest.mark.parametrize("bn_update", ["recompute", "probe-mean"])
def test_per_step_batched_engine_equals_loop(bn_update):
    def run(engine):
        torch.manual_seed(0)
        model = M.create("spike_convnet", T=2, bn_time="per-step").train()
        basis = torch.linalg.qr(torch.randn(model.num_params(), 2, generator=torch.Generator().manual_seed(1)))[0]
        opt = SZO(model.parameters(), SimpleNamespace(basis=basis, layout=None), mu=0.05, lr=0.5, model=model,
                  estimator="cge", probes=ProbePath(engine=engine, bn_update=bn_update), scale="absolute")
        g = torch.Generator().manual_seed(3)
        for _ in range(2):
            x, y = torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
            opt.step(batch=Batch(x, y, tet_loss))
        return model

    loop, bat = run("loop"), run("batched")
    for (k, a), b in zip(loop.state_dict().items(), bat.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=k)
    assert int(loop.bn1.num_batches_tracked) == 2 * 2  # 2 steps x T = 2 updates


def test_bad_bn_time_and_unsupported_combination():
    with pytest.raises(ValueError, match="unknown bn_time 'tdbn'; valid: shared, per-step"):
        M.create("spike_convnet", bn_time="tdbn")
    from szo.config import load_recipe

    with pytest.raises(ValueError, match="invalid model.bn_time 'tdbn'; valid: shared, per-step"):
        load_recipe("digits-scratch", ["model.bn_time=tdbn"])
    assert load_recipe("digits-scratch", ["model.bn_time=per-step"])["model"]["bn_time"] == "per-step"


def test_data_parallel_sync_bn_refuses_per_step_bn(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        model = M.create("spike_convnet", T=2, bn_time="per-step")
        sub = SimpleNamespace(basis=torch.eye(model.num_params(), 1), layout=None)
        with pytest.raises(ValueError, match="sync_bn=True with distributed='data' .* cannot be combined with bn_time='per-step'"):
            SZO(model, sub, start="current", probes=ProbePath(distributed="data"), scale="absolute")
        SZO(model, sub, start="current", probes=ProbePath(distributed="perturbation"), scale="absolute")  # every rank sees the whole batch: fine
    finally:
        dist.destroy_process_group()
