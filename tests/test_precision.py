"""szo.precision: the run's arithmetic as a setting, applied by the package and recorded."""
from __future__ import annotations

import json
import typing

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from szo import config as C
from szo.hw import to_fixed
from szo.losses import tet_loss
from szo.models import create
from szo.precision import AUTO, PRECISIONS, check_precision, exact_fp32, precision_policy, resolve_precision, tf32_flags
from szo.train import fit


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


@pytest.mark.parametrize("start", [(True, False), (False, True), (True, True)])
def test_scopes_set_tf32_and_put_pytorchs_flags_back(flags, start):
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = start
    with precision_policy("fp32", None, "cpu").scope():
        assert tf32_flags() == (False, False)
        with precision_policy("tf32", None, "cpu").scope():
            assert tf32_flags() == (True, True)
        assert tf32_flags() == (False, False)
    assert tf32_flags() == start
    with pytest.raises(RuntimeError, match="boom"):  # an error inside the scope restores them too
        with precision_policy("tf32", None, "cpu").scope():
            raise RuntimeError("boom")
    assert tf32_flags() == start


def test_bf16_autocasts_the_forward_and_exact_fp32_turns_it_off(flags):
    m, x = _model(), torch.rand(4, 1, 8, 8)
    pol = precision_policy("bf16", m, "cpu")
    with pol.scope():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert m(x).dtype == torch.bfloat16
        assert tf32_flags() == (False, False)  # what autocast leaves in float32 is IEEE
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
            seen.append((torch.is_autocast_enabled("cpu"), tf32_flags()))
            return super().step(closure)

    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = (True, False)  # PyTorch's CUDA defaults
    res = fit(m, train, test, Spy(m.parameters(), lr=0.1), epochs=1, loss_fn=tet_loss, run_dir=tmp_path, generator=g,
              progress=False, plot=False, precision=precision)
    assert tf32_flags() == (True, False)  # put back
    assert seen and all(s == (name == "bf16", (name == "tf32",) * 2) for s in seen)
    saved = json.loads((tmp_path / "results.json").read_text())["precision"]
    assert saved == res["precision"] and saved["requested"] == precision and saved["name"] == name
    with pytest.raises(ValueError, match="unknown precision 'fp64'"):
        fit(m, train, test, Spy(m.parameters(), lr=0.1), epochs=1, loss_fn=tet_loss, run_dir=tmp_path / "b",
            generator=g, progress=False, precision="fp64")
