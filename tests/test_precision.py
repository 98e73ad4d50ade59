"""szo.precision: the run's arithmetic as a setting, applied by the package and recorded."""
from __future__ import annotations

import contextlib
import json
import typing

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from subspace_store import Subspace
from subspace_store.variants import random_subspace
from szo import config as C
from szo.hw import to_fixed
from szo.losses import tet_loss
from szo.models import create
from szo.optim import SZO, FullSpaceZO, build_optimizer
from szo.precision import (
    AUTO,
    PRECISIONS,
    PrecisionPolicy,
    check_precision,
    exact_fp32,
    fresh_casts,
    precision_policy,
    resolve_precision,
    tf32_flags,
)
from szo.train import fit
from szo.zo import SubspaceSpace


@pytest.fixture
def flags():
    """PyTorch's TF32 switches put back after the test, whatever it did."""
    old = tf32_flags()
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


def _model():
    torch.manual_seed(0)  # test-only: one fixed model
    return create("spike_convnet", num_classes=10, T=2, width=4)


def test_the_schema_offers_exactly_the_precisions_of_the_module():
    assert typing.get_args(C.Precision) == PRECISIONS
    assert C.resolve({"name": "t", "kind": "bp", "model": {"name": "spike_convnet"},
                      "data": {"name": "digits"}}).precision == "auto"
    with pytest.raises(ValueError, match="^invalid precision 'fp16'; valid: auto, fp32, tf32, bf16$"):
        C.resolve({"name": "t", "kind": "bp", "model": {"name": "spike_convnet"}, "data": {"name": "digits"},
                   "precision": "fp16"})


def test_check_and_resolve():
    with pytest.raises(ValueError, match="unknown precision 'half'; valid: auto, fp32, tf32, bf16"):
        check_precision("half")
    assert resolve_precision("auto", forward_only=True) == AUTO["forward-only"]
    assert resolve_precision("auto", forward_only=False) == AUTO["backprop"]
    for p in ("fp32", "tf32", "bf16"):
        assert resolve_precision(p, forward_only=True) == resolve_precision(p, forward_only=False) == p


def _cuda(name: str) -> PrecisionPolicy:
    """A CUDA run's policy (its TF32 logic runs on a CPU-only build too: the flags are process-wide)."""
    return PrecisionPolicy(requested=name, name=name, device_type="cuda")


@pytest.mark.parametrize("start", [(True, False), (False, True), (True, True)])
def test_scopes_set_tf32_and_put_pytorchs_flags_back(flags, start):
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = start
    with _cuda("fp32").scope():
        assert tf32_flags() == (False, False)
        with _cuda("tf32").scope():
            assert tf32_flags() == (True, True)
        assert tf32_flags() == (False, False)
    assert tf32_flags() == start
    with pytest.raises(RuntimeError, match="boom"):  # an error inside the scope restores them too
        with _cuda("tf32").scope():
            raise RuntimeError("boom")
    assert tf32_flags() == start
    with precision_policy("tf32", None, "cpu").scope(), exact_fp32("cpu"):  # the CPU has no TF32: untouched
        assert tf32_flags() == start


def test_no_flag_is_written_on_the_cpu_or_where_it_already_holds(flags, monkeypatch):
    """Issue 48: every subspace step wrote the TF32 flags, on the CPU too, which crashes under
    ``torch.backends.disable_global_flags()`` (PyTorch's own test suite calls it)."""
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = True, False
    frozen = {"on": True}
    monkeypatch.setattr(torch.backends, "flags_frozen", lambda: frozen["on"])
    writes = []
    real = torch.backends.cudnn.__class__.__setattr__

    def spy(self, name, value):
        writes.append(name)
        if frozen["on"] and name == "allow_tf32":
            raise RuntimeError("not allowed to set torch.backends.cudnn flags after disable_global_flags")
        return real(self, name, value)
    monkeypatch.setattr(torch.backends.cudnn.__class__, "__setattr__", spy)
    with precision_policy("fp32", None, "cpu").scope(), exact_fp32("cpu"):
        pass
    assert writes == []
    with _cuda("tf32").scope():  # cuDNN's is on already: not written; the matmul flag is not guarded
        assert tf32_flags() == (True, True)
    assert writes == [] and tf32_flags() == (True, False)
    with exact_fp32("cuda"):  # frozen: through cuDNN's bracketed flags() only
        assert tf32_flags() == (False, False)
    assert tf32_flags() == (True, False) and "allow_tf32" not in writes


@pytest.mark.parametrize("method", ["szo-cge", "szo-rge"])
def test_a_subspace_step_runs_with_pytorchs_flags_frozen(monkeypatch, method):
    """PyTorch's test suite freezes its flags (``torch.backends.disable_global_flags()``): a step on the
    CPU writes none."""
    monkeypatch.setitem(torch.backends.flags_frozen.__globals__, "__allow_nonbracketed_mutation_flag", True)
    torch.backends.disable_global_flags()  # undone by monkeypatch after the test
    assert torch.backends.flags_frozen()
    m = _model()
    sub = random_subspace(m.flat_params(), 3, seed=1, layout=m.param_layout(), fingerprint=m.fingerprint())
    opt = build_optimizer(method, m, subspace=sub, q=2, scale="absolute", mu=0.05, lr=0.5)
    x, y = torch.rand(4, 1, 8, 8), torch.tensor([0, 1, 2, 3])
    before = m.flat_params()
    opt.step(lambda: tet_loss(m(x), y))
    assert not torch.equal(m.flat_params(), before)


def test_bf16_autocasts_the_forward_and_exact_fp32_turns_it_off(flags):
    m, x = _model(), torch.rand(4, 1, 8, 8)
    before = tf32_flags()
    pol = precision_policy("bf16", m, "cpu")
    with pol.scope():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert m(x).dtype == torch.bfloat16
        assert tf32_flags() == before  # the CPU has no TF32: its flags are left alone
        with exact_fp32("cpu"):
            assert not torch.is_autocast_enabled("cpu") and m(x).dtype == torch.float32
    assert not torch.is_autocast_enabled("cpu") and m(x).dtype == torch.float32
    assert pol.record() == {"requested": "bf16", "name": "bf16", "effective": "bf16", "device": "cpu",
                            "tf32": False, "autocast": "bfloat16"}
    with pytest.raises(ValueError, match="pass the model"):
        precision_policy("bf16", None, "cpu")


def test_tf32_is_fp32_on_the_cpu_and_says_so():
    rec = precision_policy("tf32", None, "cpu").record()
    assert rec["name"] == "tf32" and rec["effective"] == "fp32" and rec["tf32"] is False
    assert precision_policy("auto", None, "cpu", forward_only=True).record()["requested"] == "auto"


def test_the_fixed_point_network_stays_exact_under_bf16():
    """Its kernels carry exact integers: exact_fp32 keeps autocast away from them, so the integer
    forward is bit-identical whatever the run's precision (each kernel checked against int64)."""
    m = _model().eval()
    x = torch.rand(6, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    f = to_fixed(m, weight_bits=8, verify_exact=True)
    ref = f(x)
    with precision_policy("bf16", f, "cpu").scope():
        got = f(x)
    assert got.dtype == torch.float32 and torch.equal(got, ref)


def _loaders():
    g = torch.Generator().manual_seed(3)
    x, y = torch.rand(64, 1, 8, 8, generator=g), torch.randint(0, 10, (64,), generator=g)
    ds = TensorDataset(x, y)
    run_g = torch.Generator().manual_seed(4)
    return DataLoader(ds, batch_size=32, shuffle=True, generator=run_g), DataLoader(ds, batch_size=64), run_g


@pytest.mark.parametrize("precision,forward_only,name", [("auto", False, AUTO["backprop"]), ("bf16", False, "bf16"),
                                                         ("tf32", False, "tf32"), ("fp32", False, "fp32")])
def test_fit_runs_in_the_precision_and_records_it(tmp_path, flags, precision, forward_only, name):
    m = _model()
    train, test, g = _loaders()
    seen = []

    class Spy(torch.optim.SGD):
        def step(self, closure=None):
            seen.append((torch.is_autocast_enabled("cpu"), tf32_flags(), torch.is_autocast_cache_enabled()))
            return super().step(closure)

    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = (True, False)  # PyTorch's CUDA defaults
    res = fit(m, train, test, Spy(m.parameters(), lr=0.1), epochs=1, loss_fn=tet_loss, run_dir=tmp_path, generator=g,
              progress=False, plot=False, precision=precision)
    assert tf32_flags() == (True, False)  # put back
    # autocast's weight cache off for the whole run: every batch's forward casts the weights as they are
    # on the CPU no TF32 flag is touched (the CUDA scope's flags: test_scopes_set_tf32_and_put_pytorchs_flags_back)
    assert seen and all(s == (name == "bf16", (True, False), False) for s in seen)
    saved = json.loads((tmp_path / "results.json").read_text())["precision"]
    assert saved == res["precision"] and saved["requested"] == precision and saved["name"] == name
    with pytest.raises(ValueError, match="unknown precision 'fp64'"):
        fit(m, train, test, Spy(m.parameters(), lr=0.1), epochs=1, loss_fn=tet_loss, run_dir=tmp_path / "b",
            generator=g, progress=False, precision="fp64")


# ----------------------------------------------------------------------------- autocast's weight cache
def test_fresh_casts_turns_the_cache_off_inside_any_block_and_puts_the_switch_back():
    w = nn.Parameter(torch.ones(2, 2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.is_autocast_cache_enabled()
        stale = torch.mm(w, w)  # cached: w's bfloat16 copy at 1
        with torch.no_grad():
            w.add_(1.0)
        assert torch.equal(torch.mm(w, w), stale)  # PyTorch's cache: the old weights (what fresh_casts is for)
        with fresh_casts():
            assert not torch.is_autocast_cache_enabled()
            assert torch.equal(torch.mm(w, w).float(), torch.full((2, 2), 8.0))
        assert torch.is_autocast_cache_enabled()  # the caller's switch back, its cache emptied
        assert torch.equal(torch.mm(w, w).float(), torch.full((2, 2), 8.0))
    with precision_policy("bf16", nn.Linear(2, 2), "cpu").scope():
        assert torch.is_autocast_enabled("cpu") and not torch.is_autocast_cache_enabled()
    assert torch.is_autocast_cache_enabled()  # PyTorch's default, put back


def _net():
    """Every weight goes through an autocast lower-precision op (Linear), BN in train mode: without
    the rule autocast's cache would hold each Linear's first cast for the whole block."""
    torch.manual_seed(0)  # test-only: one fixed model
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


def _xy():
    g = torch.Generator().manual_seed(2)
    return torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _optimizer(method, model):
    if method == "szo-cge":
        d, k = _flat(model).numel(), 4
        P = torch.linalg.qr(torch.randn(d, k, generator=torch.Generator().manual_seed(1), dtype=torch.float64))[0]
        theta = _flat(model)
        sub = Subspace(basis=P.float(), mean=theta.clone(), reference=theta.clone(), eigenvalues=torch.ones(k),
                       explained_variance_ratio=torch.full((k,), 1.0 / k), layout=None, fingerprint=None, model=None,
                       provenance={})
        return SZO(model, sub, mu=0.5, lr=0.5, estimator="cge", scale="absolute")
    return FullSpaceZO(model, estimator="rge", q=3, mu=0.05, lr=0.05, generator=torch.Generator().manual_seed(0))


def _bf16(cache: bool = True):
    return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache)


def _zo_run(method, around, steps=3):
    """``steps`` forward-only steps in one bf16 block: ``around`` = "policy" (szo's scope, as fit
    holds it), "user" (a plain ``with torch.autocast(...)``, PyTorch's cache on, as a user writes
    it) or "no-cache" (``cache_enabled=False``: the reference, every forward casts the weights it
    runs at). The optimizer's own arithmetic runs in the block in all three alike."""
    model, (x, y) = _net(), _xy()
    pol = precision_policy("bf16", model, "cpu", forward_only=True)
    opt = _optimizer(method, model)
    outer = pol.scope() if around == "policy" else _bf16(cache=around == "user")
    losses = []
    with outer:
        for _ in range(steps):
            opt.step(lambda: F.cross_entropy(model(x).float(), y))
            losses.append(opt.last_step.losses.clone())
            losses.append(torch.tensor([opt.last_step.loss], dtype=torch.float64))  # the BN forward's
    return torch.cat(losses), _flat(model), {k: v.clone() for k, v in model.named_buffers()}


@pytest.mark.parametrize("method", ["szo-cge", "full-rge"])
@pytest.mark.parametrize("around", ["policy", "user"])
def test_forward_only_steps_in_one_bf16_block_see_the_weights_they_probe(method, around):
    """Issue 40: a long autocast block used to give every probe the first probe's bfloat16 weights
    (zero loss differences: bf16 trained nothing). Each probe and the BN forward now cast the
    weights they run at: bit for bit the run without autocast's cache, and the loss goes down."""
    losses, theta, buffers = _zo_run(method, around)
    ref_losses, ref_theta, ref_buffers = _zo_run(method, "no-cache")
    probes = losses.view(3, -1)[:, :-1]
    assert (probes.max(1).values > probes.min(1).values).all()  # the probes differ
    assert torch.equal(losses, ref_losses) and torch.equal(theta, ref_theta)
    assert all(torch.equal(buffers[k], ref_buffers[k]) for k in buffers)
    assert probes[-1].mean() < probes[0].mean()


def test_a_step_leaves_nothing_in_the_users_autocast_cache():
    """After ``opt.step`` in the user's own autocast block the cache is empty: a forward after the
    user changes the weights (a clamp, an EMA swap) casts them as they are, not as the step's
    last forward (the BN forward) saw them."""
    model, (x, y) = _net(), _xy()
    opt = _optimizer("szo-cge", model)
    with _bf16():
        opt.step(lambda: F.cross_entropy(model(x).float(), y))
        assert opt.last_step.unperturbed  # the step ended with the BN forward
        with torch.no_grad():
            model[0].weight.mul_(0.5)
        got = model(x)
    with _bf16():
        assert torch.equal(got, model(x))


def _bptt_run(per_forward: bool, steps=3):
    """BPTT steps in bf16, an evaluation forward before each: all in one precision scope (as fit
    runs them), or each forward in its own autocast block (the reference)."""
    model, (x, y) = _net(), _xy()
    pol = precision_policy("bf16", model, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ctx = _bf16 if per_forward else contextlib.nullcontext
    with contextlib.nullcontext() if per_forward else pol.scope():
        for _ in range(steps):
            with torch.no_grad(), ctx():  # an evaluation forward between steps
                model(x)
            opt.zero_grad()
            with ctx():
                loss = F.cross_entropy(model(x).float(), y)
            loss.backward()
            opt.step()
    return _flat(model), [p.grad for p in model.parameters()]


def test_bptt_in_one_bf16_scope_takes_its_gradients_at_the_current_weights():
    """fit holds the precision scope around the whole run: every batch's forward must cast the
    weights the last optimizer step left, not those of the run's first forward."""
    theta, grads = _bptt_run(per_forward=False)
    ref_theta, ref_grads = _bptt_run(per_forward=True)
    assert all(g is not None for g in grads)
    assert torch.equal(theta, ref_theta) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


@pytest.mark.parametrize("scope", ["user", "policy"])
def test_the_subspace_arithmetic_stays_ieee_in_a_bf16_scope(scope):
    """A step's own products with P -- an RGE probe's move ``u @ P^T``, the update ``P delta``, the
    projection ``P^T g`` -- are the space's arithmetic, not the forward's: inside a bf16 autocast
    block (the user's or szo's scope) they equal the same products outside it, bit for bit
    (autocast would run them in bfloat16: ~0.4 % relative rounding on every update)."""
    def products():
        model = _net()
        params = list(model.parameters())
        d, k = _flat(model).numel(), 4
        P = torch.linalg.qr(torch.randn(d, k, generator=torch.Generator().manual_seed(1), dtype=torch.float64))[0]
        space = SubspaceSpace(params, P.float())
        u = torch.randn(k, generator=torch.Generator().manual_seed(3))
        moved = [t.clone() for t in space.direction(u)]
        space.add_coords(torch.tensor([0.3, -0.2, 0.1, 0.05], dtype=torch.float64))
        proj = space.project([torch.ones_like(p) for p in params])
        return moved, _flat(model), proj

    ref = products()
    outer = precision_policy("bf16", _net(), "cpu").scope() if scope == "policy" else _bf16()
    with outer:
        got = products()
    assert all(torch.equal(a, b) for a, b in zip(got[0], ref[0]))
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])
