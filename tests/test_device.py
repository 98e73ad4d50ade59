"""The device subset (marker ``device``): what must hold on whatever device trains.

``make test`` runs it on the CPU; on a GPU ``SZO_TEST_DEVICE=cuda python -m pytest -m device tests``
(``bash bench/gpu_suite.sh quick``) runs it there. Besides this file the subset holds every method's
step through ``build_optimizer`` against the CPU's (tests/optim/test_protocol.py) and the golden
checkpoints resumed and rerun (tests/optim/test_golden.py). Here: exact parameter restore after the
probes, a relative szo.scale against the CPU's steps, BN frozen across probes and committed once, the precision scope on the device, CUDA-graph
replays against eager forwards, the fixed-point forward against the CPU's integers, NIR export, and
scratch / continual / TTA recipes end to end.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from szo.build import subspace_store_for
from szo.config import load_recipe
from szo.evaluators import Batch, batch_closure
from szo.export import from_nir, to_nir, write_nir
from szo.hw import to_fixed
from szo.losses import tet_loss
from szo.models import create
from szo.optim import build_optimizer
from szo.pipeline import run_recipe
from szo.precision import AUTO, precision_policy, tf32_flags
from szo.stages import subspace_build_stage

pytestmark = pytest.mark.device


def _model(device, seed=0, **kw):
    torch.manual_seed(seed)  # test-only: one fixed model
    return create("spike_convnet", num_classes=10, T=2, width=4, **kw).train().to(device)


def _subspace(model, k=3):
    d = model.num_params()
    basis = torch.linalg.qr(torch.randn(d, k, generator=torch.Generator().manual_seed(1), dtype=torch.float64))[0]
    return SimpleNamespace(basis=basis.float(), layout=model.param_layout(), reference=model.flat_params())


def _batch(device, n=8, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, 8, 8, generator=g).to(device), torch.randint(0, 10, (n,), generator=g).to(device)


def _buffers(m):
    return {k: v.clone() for k, v in m.named_buffers()}


def test_probes_restore_the_parameters_and_bn_exactly_even_when_a_probe_fails(device):
    m = _model(device)
    theta, bn = m.flat_params().clone(), _buffers(m)
    opt = build_optimizer("szo-cge", m, subspace=_subspace(m), lr=0.5, mu=0.05, scale="absolute")
    x, y = _batch(device)
    inner = batch_closure(m, tet_loss, x, y)
    calls = []

    def failing():
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("probe 4 failed")
        return inner()

    with pytest.raises(RuntimeError, match="probe 4 failed"):
        opt.step(failing)
    assert torch.equal(m.flat_params(), theta)
    assert all(torch.equal(v, bn[k]) for k, v in m.named_buffers())
    # a step at lr 0 moves nothing either: every probe is undone bit for bit
    opt0 = build_optimizer("szo-cge", m, subspace=_subspace(m), lr=0.0, mu=0.05, momentum=0.0, scale="absolute")
    opt0.step(inner)
    assert torch.equal(m.flat_params(), theta)


def test_bn_is_frozen_across_probes_and_committed_once(device):
    """bn_update=recompute: the running statistics after a step are one train-mode forward at the
    new parameters from the statistics before it (the 2k probes leave no trace)."""
    m = _model(device)
    before = _buffers(m)
    opt = build_optimizer("szo-cge", m, subspace=_subspace(m), lr=0.5, mu=0.05, bn_update="recompute", scale="absolute")
    x, y = _batch(device)
    opt.step(batch=Batch(x, y, tet_loss))
    ref = _model(device)
    ref.load_state_dict(before, strict=False)
    ref.load_flat_params(m.flat_params())
    with torch.no_grad():
        ref(x)
    for k, v in m.named_buffers():
        assert torch.equal(v, dict(ref.named_buffers())[k]), k


def test_the_precision_scope_on_the_device(device):
    m = _model(device)
    x, _ = _batch(device)
    old = tf32_flags()
    for name in ("fp32", "tf32", "bf16"):
        pol = precision_policy(name, m, device)
        with pol.scope(), torch.no_grad():
            out = m(x)
            # TF32 exists on CUDA only: on the CPU the process-wide flags are not touched (issue 48)
            assert tf32_flags() == (((name == "tf32",) * 2) if device.type == "cuda" else old)
        assert out.dtype == (torch.bfloat16 if name == "bf16" else torch.float32)
        assert pol.record()["tf32"] == (name == "tf32" and device.type == "cuda")
    assert tf32_flags() == old


def test_cuda_graph_replays_equal_eager_forwards(device):
    """On CUDA the probes replay one captured graph and give the eager logits bit for bit; on the CPU
    the forward stays eager (and says why)."""
    eager, graphed = _model(device), _model(device).set_cuda_graphs(True)
    with precision_policy("fp32", None, device).scope(), torch.no_grad():
        for i in range(3):
            x, _ = _batch(device, seed=10 + i)
            for mm in (eager, graphed):
                mm.load_flat_params(mm.flat_params() + 0.01)
            assert torch.equal(graphed(x), eager(x))
    for k, v in eager.named_buffers():
        assert torch.equal(v, dict(graphed.named_buffers())[k]), k
    st = graphed.cuda_graphs.stats
    if device.type == "cuda":
        assert st.captures == 1 and st.replays == 3 and not st.eager
    else:
        assert dict(st.eager) == {"cpu tensor": 3}


@pytest.mark.parametrize("method,scale,engine", [("szo-cge", "trajectory", "loop"), ("szo-cge", "whitened", "batched"),
                                                 ("szo-rge", "trajectory", "loop")])
def test_a_relative_scale_steps_as_on_the_cpu(method, scale, engine, device):
    """szo.scale trajectory / whitened on the device: the basis P diag(s) built where the parameters
    live, the float64 calibration on the host; three steps end where the CPU's end, to float rounding."""
    ends = []
    for dev in (torch.device("cpu"), device):
        m = _model(dev)
        sub = _subspace(m)
        sub.eigenvalues = torch.tensor([4.0, 1.0, 0.25], dtype=torch.float64) * 1e-2
        opt = build_optimizer(method, m, subspace=sub, lr=0.03, mu=0.3, q=2, scale=scale, engine=engine,
                              generator=torch.Generator().manual_seed(2))
        x, y = _batch(dev)
        with precision_policy("fp32", m, dev).scope():
            for _ in range(3):
                opt.step(batch=Batch(x, y, tet_loss))
        assert opt.scale_info["rule"] == scale and opt.forward_passes == 3 * opt.forwards_per_step
        ends.append(m.flat_params().detach().cpu())
    torch.testing.assert_close(ends[1], ends[0], rtol=1e-4, atol=1e-6)
    assert not torch.equal(ends[0], _model("cpu").flat_params())  # it moved


def test_fixed_point_forward_is_the_cpus_integers(device):
    m = _model("cpu").eval()
    x, _ = _batch("cpu", n=6)
    ref = to_fixed(m, weight_bits=8, verify_exact=True)(x)
    got = to_fixed(m.to(device), weight_bits=8, verify_exact=True)(x.to(device))
    assert torch.equal(got.cpu(), ref)


def test_nir_export_of_a_model_on_the_device(tmp_path, device):
    m = _model(device).eval()
    write_nir(to_nir(m, (1, 8, 8)), tmp_path / "m.nir")
    back = from_nir(tmp_path / "m.nir").eval()
    x, _ = _batch("cpu", n=6)
    with torch.no_grad():
        assert torch.equal(back.double()(x.double()), m.cpu().double()(x.double()))


TINY = ["model.T=2", "model.kwargs={width: 4}", "progress=false", "data.batch_size=32", "data.test_batch_size=360",
        "bptt.epochs=2", "bptt.max_steps_per_epoch=4", "trajectory.every=1", "subspace.k=4",
        "train.epochs=1", "train.max_steps_per_epoch=2"]


def test_scratch_continual_and_tta_recipes_on_the_device(tmp_path, device):
    sets = TINY + [f"subspace.root={tmp_path / 'subspaces'}", f"device={device}"]
    bp = run_recipe(load_recipe("digits-bp", sets), tmp_path / "bp")
    assert bp["status"] == "completed" and bp["precision"]["name"] == AUTO["backprop"]
    s = run_recipe(load_recipe("digits-scratch", sets), tmp_path / "scratch")
    assert s["status"] == "completed" and s["fp"] == 2 * (2 * 4 + 1) and s["precision"]["name"] == AUTO["forward-only"]
    assert s["precision"]["device"] == device.type
    cont = load_recipe("digits-continual", sets + ["subspace.window=1-2", "subspace.k=3"])
    subspace_build_stage(cont, tmp_path / "bp", progress=False)
    assert subspace_store_for(cont).exists(cont["subspace"]["name"])
    c = run_recipe(cont, tmp_path / "cont")
    assert c["status"] == "completed" and c["mode"] == "continual"
    tta = load_recipe("digits-c-tta", ["model.T=2", "model.kwargs={width: 4}", "progress=false", "setting=reset",
                                       "bptt.epochs=1", "bptt.max_steps_per_epoch=2", "subspace.k=2",
                                       "tta.n_source=2", "tta.corruptions=[gaussian_noise]", "tta.max_batches=1",
                                       "tta.finetune.epochs=1", "tta.finetune.samples=2",
                                       "tta.finetune.batch_size=256", "method=bn,szo-cge",
                                       f"subspace.root={tmp_path / 'tta-store'}", f"device={device}"])
    res = run_recipe(tta, tmp_path / "tta")
    assert res["status"] == "completed"
    saved = json.loads((tmp_path / "tta" / "tta_results.json").read_text())
    rows = saved["results"]["reset"]
    assert rows["szo-cge"]["precision"]["name"] == "fp32" and rows["szo-cge"]["fp"] > 0
