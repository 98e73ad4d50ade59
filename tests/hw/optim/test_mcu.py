"""Seed 004's integer learner (szo.hw.optim.mcu.MCUZO) against a transcription of Algorithm 1 and eq. 8.

The transcription below is written from the paper (App. A Algorithm 1, eq. 6 / 9 / 10, eq. 8,
Sec. 3.2.2's adaptive rule) with plain loops and explicit sums; it uses the fixed-point network
only as the forward (``net.int_weights`` and ``net.acc_hooks``), never the learner's code.
"""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

from szo.hw import to_fixed
from szo.hw.optim.mcu import MCUZO, select_block, split_blocks
from szo.hw.xorshift import XorShift32
from szo.models import create

pytestmark = pytest.mark.kernels  # run again under the generic kernels by make test

Q, LR, SEED, N = 3, 0.05, 12345, 8


def _data(n=N):
    X, y = load_digits(return_X_y=True)
    return torch.tensor(X[:n], dtype=torch.float32).view(-1, 1, 8, 8) / 16.0, torch.tensor(y[:n])


def _net(seed=0):
    torch.manual_seed(seed)
    model = create("spike_convnet", num_classes=10, T=2, width=4)
    for mod in model.modules():  # deployed-like BN statistics that keep the tiny net spiking
        if isinstance(mod, torch.nn.BatchNorm2d):
            mod.running_mean.fill_(-0.5)
            mod.running_var.fill_(0.25)
    model.eval()
    return model, to_fixed(model)


def _losses(net, x, y):
    """Per-sample losses as Python ints in Q.24 fixed point (round half to even, Python's ``round``), of
    the float64 logits of the network's integers."""
    with net.readout_precision(torch.float64):
        loss = F.cross_entropy(net(x).mean(0), y, reduction="none")
    return [round(v * 2 ** 24) for v in loss.tolist()]


def _rad(seed, n):
    """Rademacher signs of XORShift32 written out: state ^= state << 13; >> 17; << 5 (mod 2**32), LSB 1 -> -1."""
    s, out = seed, []
    for _ in range(n):
        s ^= (s << 13) & 0xFFFFFFFF
        s ^= s >> 17
        s ^= (s << 5) & 0xFFFFFFFF
        out.append(-1 if s & 1 else 1)
    return torch.tensor(out, dtype=torch.int64)


def _eq8(theta, g, lr, s, n, q, d, bits):
    f = n * q / (n * q + d - 1) * lr / s ** 2
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    return torch.tensor([min(hi, max(lo, int(t) - round(f * float(gi)))) for t, gi in
                         zip(theta.reshape(-1).tolist(), g.reshape(-1).tolist())]).view_as(theta)


def _reference_step(net, x, y, modes):
    """One step of Algorithm 1 on ``net`` (already frozen), returns the new integers per layer. The loss
    differences and every sum are Python integers (exact); the scale ``1 / (Q N mu 2**24)`` (mu = 1 LSB)
    is applied once per element, as the learner does."""
    seeds = XorShift32(SEED)
    inputs = {}
    for name in net.int_weights:  # the clean forward, recording every layer's integer input
        net.acc_hooks[name] = lambda a, acc, sh, name=name: inputs.__setitem__(name, (a, acc.shape, sh)) or acc
    clean = _losses(net, x, y)
    net.acc_hooks.clear()
    scale = 1.0 / (Q * N * 1 * float(1 << 24))
    new = {}
    for name, syn in net.int_weights.items():
        a, shape, sh = inputs[name]
        seed = seeds.next()
        d_w = syn.w_int.numel() + syn.bias_mant.numel()
        T = shape[0] // N
        d_a = math.prod(shape) // N
        if modes[name] == "weight":
            xi = _rad(seed, Q * d_w).view(Q, d_w)
            w0, b0 = syn.w_int.clone(), syn.bias_mant.clone()
            g = [0] * d_w
            for q in range(Q):
                syn.w_int = (w0.reshape(-1) + xi[q, :w0.numel()]).clamp(-128, 127).view_as(w0)
                syn.bias_mant = (b0 + xi[q, w0.numel():]).clamp(-4096, 4095)
                diff = sum(lq - l0 for lq, l0 in zip(_losses(net, x, y), clean))  # batch sum, line 15
                g = [gi + int(s) * diff for gi, s in zip(g, xi[q].tolist())]
            syn.w_int, syn.bias_mant = w0, b0
            g = torch.tensor([float(gi) * scale for gi in g], dtype=torch.float64)
            gw, gb = g[:w0.numel()].view_as(w0), g[w0.numel():]
            n_eff, d = 1, d_w
        else:
            xi = _rad(seed, Q * T * N * d_a // T).view(Q, T, N, -1)
            g_z = torch.zeros(T, N, d_a // T, dtype=torch.int64)
            for q in range(Q):
                net.acc_hooks[name] = lambda a_, acc, sh_, q=q: acc + xi[q].reshape(acc.shape)
                lq = _losses(net, x, y)
                for n in range(N):
                    g_z[:, n] += xi[q, :, n] * (lq[n] - clean[n])  # line 29, before its 1 / (Q N mu)
            net.acc_hooks.clear()
            g_z = g_z.reshape(shape)
            if a.dim() == 2:  # eq. 10: g_W = sum over (t, n) of g_z a^T, in integers
                gw = torch.einsum("bo,bi->oi", g_z, a.to(torch.int64))
            else:  # a convolution: the same sum through autograd of the float64 convolution (exact: < 2**53)
                w = torch.zeros(syn.w_int.shape, dtype=torch.float64, requires_grad=True)
                m = net.get_submodule(name)
                z = F.conv2d(a.to(torch.float64), w, None, m.stride, m.padding, m.dilation, m.groups)
                (gw,) = torch.autograd.grad(z, w, g_z.to(torch.float64))
                assert float(gw.abs().max()) < 2 ** 53 and torch.equal(gw, torch.round(gw))
                gw = gw.to(torch.int64)
            gw = gw.to(torch.float64) * scale
            dims = [0] + list(range(2, g_z.dim()))
            gb = g_z.sum(dims).to(torch.float64) * (scale * 2.0 ** (syn.bias_exp - sh))  # bias at 2**bias_exp
            n_eff, d = N, d_a
        new[name] = (_eq8(syn.w_int, gw, LR, 2.0 ** syn.exp, n_eff, Q, d, 8),
                     _eq8(syn.bias_mant, gb, LR, 2.0 ** (syn.bias_exp - 12), n_eff, Q, d, 13))
    return new


@pytest.mark.parametrize("perturbation", ["adaptive", "node"])
def test_one_step_matches_algorithm_1(perturbation):
    x, y = _data()
    _, net = _net()
    net(x)
    net.freeze_weights()
    opt = MCUZO(net, q=Q, lr=LR, seed=SEED, perturbation=perturbation)
    opt.step(lambda: F.cross_entropy(net(x).mean(0), y, reduction="none"))
    if perturbation == "adaptive":  # d_w < d_a -> weight perturbation (Sec. 3.2.2)
        assert opt.mode_names == {"conv1": "weight", "conv2": "weight", "fc": "node"}
    else:
        assert set(opt.mode_names.values()) == {"node"}
    got = {n: (s.w_int.clone(), s.bias_mant.clone()) for n, s in net.int_weights.items()}
    _, ref_net = _net()
    ref_net(x)
    ref_net.freeze_weights()
    want = _reference_step(ref_net, x, y, opt.mode_names)
    moved = 0
    for name in got:
        assert torch.equal(got[name][0], want[name][0]), name
        assert torch.equal(got[name][1], want[name][1]), name
        moved += int((got[name][0] != ref_net.int_weights[name].w_int).sum())
    assert moved > 0  # the step changed some int8 weights: the comparison is not of two no-ops
    assert opt.forward_passes == 1 + Q * 3
    for s in net.int_weights.values():
        assert s.w_int.abs().max() <= 128 and s.w_int.dtype == torch.int64


def test_freeze_keeps_the_forward_and_hooks_see_the_integers():
    x, _ = _data()
    _, net = _net()
    before = net(x).clone()
    frozen = net.freeze_weights()
    assert torch.equal(net(x), before)  # the same integers as the re-quantised forward
    for name, p in net.named_parameters():  # the float parameters are no longer read
        p.data.mul_(3.0)
    assert torch.equal(net(x), before)
    frozen["fc"].w_int = frozen["fc"].w_int.clone()
    frozen["fc"].w_int[0, 0] += 50
    assert not torch.equal(net(x), before)
    seen = {}
    net.acc_hooks["fc"] = lambda a, acc, sh: seen.update(a=a, acc=acc, sh=sh) or acc
    net(x)
    assert torch.equal(seen["acc"], seen["a"] @ frozen["fc"].w_int.t())  # acc = W_int a, integers


def test_write_back_requantises_to_the_same_weights():
    x, y = _data()
    model, net = _net()
    opt = MCUZO(net, q=2, lr=0.5, seed=7)
    for _ in range(3):
        opt.step(lambda: F.cross_entropy(net(x).mean(0), y, reduction="none"))
    net.int_weights["fc"].w_int.view(-1)[:2] = torch.tensor([-128, 127])  # eq. 8 clips to [-128, 127]: both ends
    opt.write_back()
    fresh = to_fixed(model)
    fresh(x)
    for name, q in fresh.quantized_layers().items():  # the deployed model is the learned one, integer for integer
        s = net.int_weights[name]
        assert (q["exp"], q["bias_exp"]) == (s.exp, s.bias_exp), name
        assert torch.equal(q["w_int"], s.w_int) and torch.equal(q["bias_int"], s.bias_int), name


def test_checkpoint_resumes_bit_exactly():
    x, y = _data()

    def run(resume_at=None):
        _, net = _net()
        opt = MCUZO(net, q=2, lr=0.5, seed=9)
        closure = lambda: F.cross_entropy(net(x).mean(0), y, reduction="none")  # noqa: E731
        for i in range(4):
            if i == resume_at:
                sd = opt.state_dict()
                _, net = _net()  # a fresh process: float weights at the start, nothing frozen
                opt = MCUZO(net, q=2, lr=0.5, seed=9)
                opt.load_state_dict(sd)
                closure = lambda: F.cross_entropy(net(x).mean(0), y, reduction="none")  # noqa: E731
            opt.step(closure)
        return [s.w_int for s in net.int_weights.values()]

    for a, b in zip(run(), run(resume_at=2)):
        assert torch.equal(a, b)


def test_an_lr_past_int64_saturates_like_a_large_one():
    """At lr 1e30 eq. 8's step is past int64: it saturates every moved integer at the same bound as
    lr 1e15 (it used to wrap: 6 of 10 fc biases ended at the opposite bound)."""
    x, y = _data()
    ends = []
    for lr in (1e15, 1e30):
        _, net = _net()
        opt = MCUZO(net, q=2, lr=lr, seed=9)
        opt.step(lambda: F.cross_entropy(net(x).mean(0), y, reduction="none"))
        ends.append({n: (s.w_int.clone(), s.bias_mant.clone()) for n, s in net.int_weights.items()})
    for name in ends[0]:
        assert torch.equal(ends[0][name][0], ends[1][name][0]) and torch.equal(ends[0][name][1], ends[1][name][1])
    b = ends[1]["fc"][1]
    assert bool(((b == 4095) | (b == -4096)).all())  # every fc bias moved, to a bound


@pytest.mark.parametrize("frozen", [False, True])
def test_resume_checks_the_integers_not_only_their_shapes(frozen):
    """A re-signed checkpoint is still data: int8 mantissas of 1000, a missing or an extra tensor,
    float tensors are refused in one line when the state is loaded (before any step), whether the
    network's weights are frozen yet or not; nothing of it is taken."""
    import copy

    x, y = _data()
    _, net = _net()
    opt = MCUZO(net, q=2, lr=0.5, seed=9)
    opt.step(lambda: F.cross_entropy(net(x).mean(0), y, reduction="none"))
    sd = opt.state_dict()
    ints = sd["mcu"]["integers"]
    big = [t.clone() for t in ints]
    big[0].view(-1)[0] = 1000
    bias = [t.clone() for t in ints]
    bias[5][3] = -5000  # a 13-bit bias mantissa is in [-4096, 4095]
    cases = {"weights hold 1000, outside the signed 8-bit range [-128, 127]": big,
             "'fc' bias hold -5000, outside the signed 13-bit range [-4096, 4095]": bias,
             "holds 5 integer tensors where this learner's layers need 6 (conv1 weights, conv1 bias, conv2 "
             "weights, conv2 bias, fc weights, fc bias)": ints[:-1],
             "holds 7 integer tensors where": [*ints, ints[-1]],
             "'conv1' weights are torch.float32, not integer mantissas": [t.float() for t in ints],
             "'conv2' weights have shape (4, 4, 1, 3), the layer's are (4, 4, 3, 3)":
                 [t if i != 2 else t[:, :, :1] for i, t in enumerate(ints)]}
    for phrase, bad in cases.items():
        _, net2 = _net()
        if frozen:
            net2(x)  # the pooling factor before fc is known after a forward
            net2.freeze_weights()
        before = None if not frozen else [s.w_int.clone() for s in net2.int_weights.values()]
        o2 = MCUZO(net2, q=2, lr=0.5, seed=9)
        broken = copy.deepcopy(sd)
        broken["mcu"]["integers"] = bad
        with pytest.raises(ValueError, match="optimizer state") as e:
            o2.load_state_dict(broken)
        assert phrase in str(e.value) and "\n" not in str(e.value)
        assert o2.integer_state is None if not frozen else all(
            torch.equal(a, s.w_int) for a, s in zip(before, net2.int_weights.values()))
    _, net3 = _net()  # the untouched state still loads
    MCUZO(net3, q=2, lr=0.5, seed=9).load_state_dict(copy.deepcopy(sd))


def test_bad_input():
    model, net = _net()
    with pytest.raises(ValueError, match="fixed-point network"):
        MCUZO(model)
    with pytest.raises(ValueError, match=r"unknown layer name.*valid: conv1, conv2, fc"):
        MCUZO(net, layers=["nope"])
    with pytest.raises(ValueError, match="mu_w"):
        MCUZO(net, mu_w=0)
    with pytest.raises(ValueError, match="perturbation"):
        MCUZO(net, perturbation="both")


def test_split_blocks():
    assert split_blocks(["a", "b", "c", "d", "e"], 4) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert split_blocks(["a", "b", "c"], 4) == [["a"], ["b"], ["c"]]
    with pytest.raises(ValueError):
        split_blocks([], 4)


def test_select_block_restores_and_picks_the_best_gain():
    x, y = _data(32)
    _, net = _net()
    net(x)
    start = {n: s.w_int.clone() for n, s in net.freeze_weights().items()}
    scores = iter([0.5, 0.4, 0.9, 0.6])  # baseline, then after each block
    loss = lambda out, yy, reduction: F.cross_entropy(out.mean(0), yy, reduction=reduction)  # noqa: E731
    out = select_block(net, [["conv1"], ["conv2"], ["fc"]], [(x, y)], lambda: next(scores), loss,
                       lambda layers: MCUZO(net, layers=layers, q=2, lr=0.5))
    assert out["block"] == 1 and out["gains"] == pytest.approx([-0.1, 0.4, 0.1])
    assert out["forwards"] == 3 * (1 + 2)
    for n, s in net.int_weights.items():
        assert torch.equal(s.w_int, start[n])


def test_block_selection_stage_records_its_choice_and_a_resume_keeps_it(tmp_path):
    """Seed 004 Sec. 3.3.1 as a run's stage: the synapses cut into blocks, one epoch of test training
    per block on the train split less its held-out tail, from the same integers (put back after), the
    best held-out gain chosen; block_selection.json makes a resumed run keep the block."""
    from torch.utils.data import TensorDataset

    from szo.prepare import SELECTION_FILE, block_selection_stage

    x, y = _data(40)
    _, net = _net()
    loss = lambda out, yy, reduction="mean": F.cross_entropy(out.mean(0), yy, reduction=reduction)  # noqa: E731
    kw = dict(blocks=4, epochs=1, heldout=0.2, batch_size=8, q=2, lr=0.05, seed=3, loss_fn=loss)
    ds = TensorDataset(x, y)
    floats = {k: v.clone() for k, v in net.state_dict().items()}
    out = block_selection_stage(net, ds, run_dir=tmp_path, **kw)
    assert all(torch.equal(v, floats[k]) for k, v in net.state_dict().items())  # as it found them
    assert out["blocks"] == [["conv1"], ["conv2"], ["fc"]]  # three synapses: three blocks
    assert out["layers"] == out["blocks"][out["block"]] and len(out["gains"]) == 3
    assert out["gains"][out["block"]] == max(out["gains"])
    assert (out["heldout_samples"], out["steps_per_block"]) == (8, 4)  # 32 training samples, batches of 8
    assert out["forwards"] == 3 * 4 * (1 + 2)
    start = {n: s.w_int.clone() for n, s in net.int_weights.items()}  # frozen by the stage, then put back
    refrozen = to_fixed(_net()[0])
    refrozen(x[:1])
    assert all(torch.equal(s.w_int, start[n]) for n, s in refrozen.freeze_weights().items())
    again = block_selection_stage(net, ds, run_dir=tmp_path, **kw)  # read from the run directory
    assert again == json.loads((tmp_path / SELECTION_FILE).read_text()) and again["block"] == out["block"]
    assert all(torch.equal(s.w_int, start[n]) for n, s in net.int_weights.items())
    with pytest.raises(ValueError, match=r"block_selection.json records a block selection with settings .* remove"):
        block_selection_stage(net, ds, run_dir=tmp_path, **{**kw, "q": 3})
    with pytest.raises(ValueError, match=r"8 training samples after holding out 32 of 40 \(80%\) are fewer than one "
                                         r"batch of 16"):
        block_selection_stage(net, ds, **{**kw, "heldout": 0.8, "batch_size": 16})


def test_block_selection_streams_its_batches():
    """The selection's batches are drawn as they are used, the same ones on every pass (every block),
    bit-equal to the list it once built: the first step of hw.select_epochs = 1e6 needs one batch, not
    a million epochs of them in memory."""
    from torch.utils.data import TensorDataset

    from szo.data import make_loader
    from szo.prepare import SelectionBatches

    x, y = _data(40)
    ds = TensorDataset(x, y)
    g = torch.Generator().manual_seed(3)
    ref = [b for _ in range(3) for b in make_loader(ds, 8, shuffle=True, generator=g, drop_last=True)]
    stream = SelectionBatches(ds, 8, 3, 3, "cpu")
    for _ in range(2):  # one pass per block: the same batches each time
        got = list(stream)
        assert len(got) == len(stream) == len(ref) == 15
        assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(got, ref))
    huge = SelectionBatches(ds, 8, 10 ** 6, 3, "cpu")
    assert len(huge) == 5 * 10 ** 6
    first = next(iter(huge))
    assert torch.equal(first[0], ref[0][0]) and torch.equal(first[1], ref[0][1])
    # select_block on a stream and on its list: the same choice, gains and forwards
    _, net = _net()
    net(x[:1])
    net.freeze_weights()
    loss = lambda out, yy, reduction="mean": F.cross_entropy(out.mean(0), yy, reduction=reduction)  # noqa: E731
    scores = lambda: float((net(x[32:]).mean(0).argmax(1) == y[32:]).float().mean())  # noqa: E731
    make = lambda layers: MCUZO(net, layers=layers, q=2, lr=0.05, seed=4)  # noqa: E731
    a = select_block(net, [["conv1"], ["fc"]], SelectionBatches(ds, 8, 2, 3, "cpu"), scores, loss, make)
    g = torch.Generator().manual_seed(3)
    b = select_block(net, [["conv1"], ["fc"]],
                     [bb for _ in range(2) for bb in make_loader(ds, 8, shuffle=True, generator=g, drop_last=True)],
                     scores, loss, make)
    assert a == b and a["forwards"] == 2 * 10 * (1 + 2)
