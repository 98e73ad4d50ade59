"""Checkpoints written before the forward-only core (golden/, see golden_cases.py) load and continue
bit-exactly, and today's code reproduces the same 4-step run uninterrupted.

Part of the device subset (``SZO_TEST_DEVICE=cuda``): on another device than the CPU that wrote the
golden files, in fp32 (``szo.precision``), every method's run must land within float rounding of
the CPU's (the integer learners exactly), resumed from the CPU's checkpoint or uninterrupted."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from szo.losses import tet_loss
from szo.methods import get_method
from szo.train import fit
from tests.optim.golden_cases import CASES, GOLDEN, SEED, STEPS, build, loaders, model_and_subspace

pytestmark = pytest.mark.kernels  # run again under the generic kernels by make test


def _run(case: str, run_dir, epochs: int, resume: bool = False, device: torch.device = torch.device("cpu")):
    g = torch.Generator().manual_seed(SEED)
    train, test = loaders(g)
    model, sub = model_and_subspace()
    net, opt = build(case, model.to(device), sub, g)
    fit(net, train, test, opt, epochs=epochs, loss_fn=tet_loss, run_dir=run_dir, generator=g, progress=False,
        max_steps_per_epoch=STEPS, plot=False, info={"method": CASES[case][0]}, resume=resume, device=device,
        precision="fp32")
    return net, opt


# A forward-only step on a spiking network amplifies float rounding: a spike that rounding flips
# changes a probe's loss by O(1/N), and the loss difference is divided by mu. Measured on the CPU, 4
# steps: np-zo moved conv1.weight by 0.022 after a relative 1e-7 change of the initial weights, wp-zo
# by 0.19 after 1e-5; on an H200 np-zo's bn1.running_mean landed 0.20 away (of the 0.43 it moved); on an
# AVX2-only EPYC (issue 48) szo-cge's bn1.bias landed 0.0044 away (of the 0.0135 it moved) and qzo's
# float twin 12 ulps away, where the golden files came from an AVX-512 machine. A file written on one
# CPU cannot pin such a run on another: the golden runs of every finite-difference method are compared
# bitwise where this machine reproduces them, and elsewhere only in what rounding cannot change (the
# state's keys, shapes and dtypes, its integers, generator states and counters). The methods whose
# step is a backward pass or a JVP (no division by mu) keep the float tolerance everywhere.
CHAOTIC = {case for case, (method, _) in CASES.items()
           if not (get_method(method).backprop or get_method(method).jvp)} | {"np-zo", "wp-zo", "awp-zo"}
# the methods whose step runs a backward pass (BP, or eq. 10's VJP of the layer-wise node estimates):
# on a GPU its kernels accumulate with atomics, so a resumed run matches the uninterrupted one to rounding
BACKWARD = {"np-zo", "awp-zo"}


def _assert_state(net: torch.nn.Module, want: dict[str, torch.Tensor], what: str, init: dict[str, torch.Tensor],
                  exact: bool, floats: bool = True) -> None:
    """Bitwise (``exact``, and every integer tensor), else within 1e-3 of how far the golden run
    moved each tensor (+ 1e-6): float rounding of another CPU, torch build or device. ``floats=False``
    (a chaotic run on a machine that does not reproduce the golden bits): the float tensors' shapes
    and dtypes only, the integers still bitwise."""
    got = {k: v.cpu() for k, v in net.state_dict().items()}
    assert set(got) == set(want), what
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, f"{what}: {k} dtype / shape"
        diff = float((got[k].double() - v.double()).abs().max()) if v.numel() else 0.0
        if exact or not v.is_floating_point():
            assert torch.equal(got[k], v), f"{what}: {k} differs (max |diff| {diff})"
        elif floats:
            moved = float((v.double() - init[k].double()).abs().max()) if k in init else float(v.double().abs().max())
            assert diff <= 1e-3 * moved + 1e-6, f"{what}: {k} differs by {diff:.3g} (the run moved it {moved:.3g})"


@pytest.mark.device
@pytest.mark.parametrize("case", list(CASES))
def test_golden_checkpoint_continues_bit_exactly(case, tmp_path, device):
    """The golden 2-step checkpoint loads and continues to the golden 4-step state, and so does an
    uninterrupted run: to the bit where this machine computes as the one that wrote them, else to
    float rounding (the kernels of a torch build, CPU or device round differently: 1e-9..1e-5 here
    with torch 2.14.1, spikes amplifying the ZO cases). On this machine and device a run resumed
    from its own checkpoint is bitwise the uninterrupted one."""
    want = load_file(GOLDEN / case / "final.safetensors")
    init = load_file(GOLDEN / "init.safetensors")
    assert any(not torch.equal(want[k], init[k]) for k in init if k in want), "the golden run did not move"
    net0, _ = _run(case, tmp_path / "full", epochs=2, device=device)
    ref = {k: v.cpu() for k, v in net0.state_dict().items()}
    exact = all(torch.equal(ref[k], v) for k, v in want.items())  # this machine reproduces the golden bits
    golden = exact or case not in CHAOTIC  # else another machine's rounding sent it elsewhere
    assert all(torch.isfinite(v).all() for v in ref.values() if v.is_floating_point())
    _assert_state(net0, want, f"{case}, uninterrupted on {device}", init, exact, floats=golden)
    (tmp_path / "half" / "checkpoints").mkdir(parents=True)
    for f in ("last.pt", "last.json"):
        shutil.copy(GOLDEN / case / f, tmp_path / "half" / "checkpoints" / f)
    net, opt_half = _run(case, tmp_path / "half", epochs=2, resume=True, device=device)  # loads on any machine
    _assert_state(net, want, f"{case}, resumed from golden on {device}", init, exact, floats=golden)
    _run(case, tmp_path / "own", epochs=1, device=device)  # this machine's own 2-step checkpoint ...
    net, opt = _run(case, tmp_path / "own", epochs=2, resume=True, device=device)
    # ... bitwise; on a GPU the backward kernels of BP accumulate with atomics (run to run: 1e-8 on an H200)
    own_exact = device.type == "cpu" or not (get_method(CASES[case][0]).backprop or case in BACKWARD)
    _assert_state(net, ref, f"{case}, resumed from its own checkpoint on {device}", init, exact=own_exact)
    # the optimizer state is written under the same keys, with the same values: integers, generator
    # states and counters exactly; float coordinates to a few ulps (one momentum formula for every
    # method now: heavy_ball_ rounds fg-subspace's float64 c differently in the last bits), or to
    # float rounding where this machine does not reproduce the golden bits. Keys added since (ADDED)
    # may be there too
    final = torch.load(GOLDEN / case / "final_optimizer.pt", weights_only=True)
    for o in (opt, opt_half):  # elsewhere (floats=False): keys, shapes, generator states and counters
        _assert_same(o.state_dict(), final, case, rtol=1e-12 if exact else 1e-3, floats=golden)


# state written since the golden files (issue 40): where the parameters stand (a subspace method's
# point, the integer learners' origin and integer graph), the integer learners' chosen plans and clamp
# counts; and in "state", an entry per parameter, the first holding the codec's sections again; since
# issue 48 each trained parameter's "step" count (torch's per-parameter state) and tt-zo's per-group sign
# step (sign_lr, sign_lr_at); the basis fingerprint a subspace state is bound to (issue 49)
ADDED = {"point", "origin", "synapses", "plans", "saturations", "step", "sign_lr", "sign_lr_at", "fingerprint"}


def _assert_same(got, want, path: str, rtol: float = 1e-12, sections: frozenset = frozenset(),
                 floats: bool = True) -> None:
    """``got`` has ``want``'s structure and values (see the caller); ``floats=False``: only what the
    losses do not decide is compared by value (generator states, counters, names), tensors by shape
    and dtype (another machine's rounding moved the rest)."""
    assert type(got) is type(want) or (isinstance(got, (list, tuple)) and isinstance(want, (list, tuple))), path
    if isinstance(want, dict):
        if "/" not in path:  # the top level: its sections are repeated in the first parameter's state
            sections = frozenset(k for k in want if k not in ("state", "param_groups"))
        extra = {k for k in set(got) - set(want)
                 if not (k in ADDED or k in sections or (isinstance(got[k], dict) and set(got[k]) <= sections | ADDED))}
        assert set(want) <= set(got) and not extra, \
            f"{path}: keys {sorted(map(str, got))} != {sorted(map(str, want))} (+ any of {sorted(ADDED)})"
        for k in want:
            _assert_same(got[k], want[k], f"{path}/{k}", rtol, sections, floats)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_same(a, b, f"{path}[{i}]", rtol, floats=floats)
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        if not floats and want.dtype != torch.uint8:  # a chaotic run elsewhere: its coordinates, also
            return  # the integer learners' (losses decide them), differ; generator states (uint8) do not
        if want.is_floating_point():
            if rtol <= 1e-12:
                torch.testing.assert_close(got.cpu(), want, rtol=rtol, atol=1e-15, msg=path)
            else:  # float rounding of another machine: against the tensor's scale, not element by element
                diff = float((got.cpu().double() - want.double()).abs().max()) if want.numel() else 0.0
                assert diff <= rtol * float(want.double().abs().max()) + 1e-6, f"{path}: max |diff| {diff:.3g}"
        else:
            assert torch.equal(got.cpu(), want), path
    elif isinstance(want, float) and not floats:
        assert isinstance(got, float), path
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"
