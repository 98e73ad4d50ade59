"""AsyncFGD pipeline (szo.asyncfgd) on gloo processes equals the staleness rule of seed 001, Algorithm 1."""
import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from spikingjelly.activation_based import layer
from torch import nn

from szo.asyncfgd import reference_async_fgd, run_stage, split_stages, stage_versions
from szo.distributed import shutdown
from szo.losses import tet_loss
from szo.models.neurons import make_neuron

T = 3


def make_layers(spiking: bool) -> list[nn.Module]:
    torch.manual_seed(0)
    if spiking:
        return [layer.Linear(6, 8, step_mode="m"), make_neuron("lif"), layer.Linear(8, 6, step_mode="m"),
                make_neuron("lif"), layer.Linear(6, 3, step_mode="m")]
    return [nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)]


def setup(spiking: bool):
    layers = [m.double() for m in make_layers(spiking)]
    g = torch.Generator().manual_seed(1)
    batches = [(2 * torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g))
               for _ in range(6)]
    if spiking:
        return layers, batches, tet_loss, (lambda x: x.unsqueeze(0).repeat(T, 1, 1))
    return layers, batches, nn.functional.cross_entropy, None


def _worker(rank, K, init_file, out_dir, spiking):
    # forked from a process whose OpenMP thread pool may be running (GNU libgomp is not fork-safe:
    # a child's first multi-thread parallel region waits forever); one thread never enters one
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=K)
    try:
        layers, batches, loss_fn, encode = setup(spiking)
        stage = split_stages(layers, K)[rank]
        res = run_stage(stage, rank, K, batches, loss_fn, lr=0.05, seed=4, encode=encode)
        out = {n: p.detach().contiguous() for n, p in stage.named_parameters()}
        out["_losses"] = torch.tensor(res["losses"], dtype=torch.float64)
        out["_jvps"] = torch.tensor(res["jvps"], dtype=torch.float64)
        save_file(out, os.path.join(out_dir, f"stage{rank}.safetensors"))
    finally:
        shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("K,spiking", [(3, False), (2, True)])  # each spawns K fresh interpreters (slow)
def test_pipeline_on_processes_equals_the_staleness_rule(tmp_path, K, spiking):
    layers, batches, loss_fn, encode = setup(spiking)
    stages = split_stages(layers, K)
    # the oracle first: it also warms up SpikingJelly's lazily scripted functions for the children
    ref = reference_async_fgd(stages, batches, loss_fn, lr=0.05, seed=4, encode=encode)
    # fork: the children inherit the imported modules (a spawned interpreter re-imports torch + SpikingJelly)
    mp.start_processes(_worker, args=(K, str(tmp_path / "init"), str(tmp_path), spiking), nprocs=K, join=True,
                       start_method="fork")
    for k, s in enumerate(stages):
        got = load_file(str(tmp_path / f"stage{k}.safetensors"))
        assert torch.allclose(got["_losses"], torch.tensor(ref["losses"], dtype=torch.float64), atol=1e-10)
        assert torch.allclose(got["_jvps"], torch.tensor(ref["jvps"], dtype=torch.float64), atol=1e-10)
        for n, p in s.named_parameters():
            assert torch.allclose(got[n], p.detach(), atol=1e-10), (k, n)
    # staleness matters: the synchronous (K = 1) iterates differ from the pipeline's
    sync = copy.deepcopy(split_stages(setup(spiking)[0], 1))
    ref_sync = reference_async_fgd(sync, batches, loss_fn, lr=0.05, seed=4, encode=encode)
    assert ref_sync["losses"][0] == pytest.approx(ref["losses"][0])
    assert abs(ref_sync["losses"][-1] - ref["losses"][-1]) > 1e-9


def test_one_stage_run_is_vanilla_fgd_and_versions_follow_the_paper():
    layers, batches, loss_fn, _ = setup(False)
    a, b = split_stages(copy.deepcopy(layers), 1), split_stages(copy.deepcopy(layers), 1)
    res = run_stage(a[0], 0, 1, batches, loss_fn, lr=0.05, seed=4)
    ref = reference_async_fgd(b, batches, loss_fn, lr=0.05, seed=4)
    assert res["jvps"] == pytest.approx(ref["jvps"], abs=1e-12)
    # stage k of micro-batch i sees the updates of micro-batches 0 .. i + k - K: staleness K - 1 - k
    assert stage_versions(5, 3) == [3, 4, 5] and stage_versions(0, 3) == [0, 0, 0]


def test_split_stages_and_bad_input():
    layers = make_layers(False)
    st = split_stages(layers, 2)
    assert len(st) == 2 and sum(len(s) for s in st) == len(layers)
    with pytest.raises(ValueError, match=r"K \(stages\) must be an integer in \[1, 5\]"):
        split_stages(layers, 6)
    with pytest.raises(ValueError, match="needs an initialised torch.distributed"):
        run_stage(st[0], 0, 2, [], nn.functional.cross_entropy, lr=0.1)


# ---------------------------------------------------------------- method=asyncfgd: the optimizer
def _optimizer_run(layers, batches, loss_fn, encode, K, steps=None, opt_state=None, lr=0.05):
    from szo.optim import AsyncFGD

    model = nn.Sequential(*layers)
    opt = AsyncFGD(model, stages=K, lr=lr, seed=4)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    losses = []
    for x, y in batches[:steps]:
        xin = encode(x) if encode is not None else x
        opt.step(lambda: loss_fn(model(xin), y))  # noqa: B023
        losses.append(float(opt.last_losses[0]))  # float64 (step returns a float32 tensor)
    return model, opt, losses


@pytest.mark.parametrize("K,spiking", [(1, False), (2, False), (3, False), (2, True), (3, True)])
def test_optimizer_follows_the_staleness_rule(K, spiking):
    """AsyncFGD (method=asyncfgd) in one process gives the pipeline's iterates: the oracle of the
    K-process run above (losses, directional derivatives through the surrogate, final weights)."""
    layers, batches, loss_fn, encode = setup(spiking)
    ref_stages = split_stages(copy.deepcopy(layers), K)
    ref = reference_async_fgd(ref_stages, batches, loss_fn, lr=0.05, seed=4, encode=encode)
    model, opt, losses = _optimizer_run(layers, batches, loss_fn, encode, K)
    assert losses == pytest.approx(ref["losses"], abs=1e-10)
    assert opt.forward_passes == len(batches) == opt.steps
    for got, want in zip(model.parameters(), nn.Sequential(*ref_stages).parameters()):
        assert torch.allclose(got, want, atol=1e-10)
    assert [len(h) for h in opt.history] == [K - 1 - k for k in range(K)]  # versions kept per stage


def test_optimizer_resumes_exactly_from_its_state_dict():
    layers, batches, loss_fn, encode = setup(True)
    full, _, full_losses = _optimizer_run(copy.deepcopy(layers), batches, loss_fn, encode, 3)
    part, opt, first = _optimizer_run(copy.deepcopy(layers), batches, loss_fn, encode, 3, steps=2)
    state = copy.deepcopy(opt.state_dict())
    model = nn.Sequential(*[copy.deepcopy(m) for m in part])
    from szo.optim import AsyncFGD

    opt2 = AsyncFGD(model, stages=3, lr=0.05, seed=99)  # seed and stale versions come from the state
    opt2.load_state_dict(state)
    rest = []
    for x, y in batches[2:]:
        xin = encode(x)
        opt2.step(lambda: loss_fn(model(xin), y))  # noqa: B023
        rest.append(float(opt2.last_losses[0]))
    assert first + rest == full_losses
    for a, b in zip(model.parameters(), full.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="optimizer state is for 3 AsyncFGD stages, this optimizer has 2"):
        AsyncFGD(nn.Sequential(*copy.deepcopy(layers)), stages=2).load_state_dict(state)


def test_optimizer_bad_input_and_build_optimizer():
    from szo.optim import AsyncFGD, build_optimizer

    model = nn.Sequential(*make_layers(False))
    with pytest.raises(ValueError, match=r"stages must be an integer in \[1, 5\] .* got 6"):
        AsyncFGD(model, stages=6)
    with pytest.raises(ValueError, match=r"takes no momentum \(Algorithm 1: plain SGD.* got momentum=0.9"):
        AsyncFGD(model, momentum=0.9)
    with pytest.raises(ValueError, match="lr must be >= 0"):
        AsyncFGD(model, lr=-1.0)
    with pytest.raises(ValueError, match="'stages' .* applies to methods 'asyncfgd', 'asyncfgd-adam'"):
        build_optimizer("fg", model, lr=0.1, stages=2)
    opt = build_optimizer("asyncfgd", model, lr=0.1, momentum=0.0, generator=torch.Generator().manual_seed(7))
    assert isinstance(opt, AsyncFGD) and opt.K == 2 and opt.seed == 7
