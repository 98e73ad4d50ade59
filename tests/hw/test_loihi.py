"""``"loihi"`` and ``"szo"`` arithmetic against the numpy transcription of Lava's bit-accurate
LIF and Dense models (tests/hw/lava_oracle.py): 1000 steps, forced overflow, negative exponents."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from spikingjelly.activation_based import layer

from szo.hw import to_fixed
from szo.hw.fixed import A_IN_SHIFT, ARITHMETICS, check_arithmetic, floor_shift, wrap_lava
from szo.hw.neuron import FixedCubaLIF, LoihiCubaLIF, paper_lif
from szo.models import SpikingModel, make_neuron
from tests.hw.lava_oracle import LavaDense, LavaLIF

T_LONG = 1000


def _run_pair(ours, lava: LavaLIF, a_in: np.ndarray, bias_int: torch.Tensor | None):
    """Step both neurons; returns (per-step equality of spikes/u/v, first step where anything differed)."""
    state = ours.initial_state(torch.zeros(a_in.shape[1], dtype=torch.int64))
    first_diff, spikes = None, 0
    for t in range(a_in.shape[0]):
        s_ref = lava.run_spk(a_in[t])
        x = torch.from_numpy(a_in[t].astype(np.int64)) << A_IN_SHIFT  # what a Dense output is in state units
        s, state = ours.step(x, state, bias_int)
        same = (np.array_equal(s.numpy().astype(bool), s_ref) and np.array_equal(state.current.numpy(), lava.u)
                and np.array_equal(state.voltage.numpy(), lava.v))
        if not same and first_diff is None:
            first_diff = t
        spikes += int(s_ref.sum())
    return first_diff, spikes


def _bias(n: int, g: np.random.Generator) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    mant = g.integers(-4096, 4096, n).astype(np.int16)  # 13-bit signed
    exp = g.integers(0, 8, n).astype(np.int16)  # 3-bit
    return mant, exp, torch.from_numpy(mant.astype(np.int64) << exp.astype(np.int64))


@pytest.mark.parametrize("current_decay,voltage_decay,v_th", [
    (1.0, 1 / 1.1, 1.0),  # the paper's LIF (du = 4095 + ds_offset, dv = 3724)
    (0.25, 0.1, 2.0),  # synaptic memory: the wrapped current persists
    (1 / 4096, 0.0, 100.0),  # smallest current decay, no voltage leak: the voltage clips
])
def test_loihi_lif_bit_exact_with_lava_oracle_forced_overflow(current_decay, voltage_decay, v_th):
    g = np.random.default_rng(11)
    n = 64
    a_in = g.integers(-(1 << 18), 1 << 18, (T_LONG, n)).astype(np.int32)  # << 6 reaches 2**24: the current wraps
    a_in[:, : n // 2] //= 256  # half the neurons stay in range: spikes and resets happen too
    mant, exp, bias_int = _bias(n, g)
    ours = LoihiCubaLIF(current_decay, voltage_decay, v_th, reset="zero")
    lava = LavaLIF(n, bias_mant=mant, bias_exp=exp, **ours.lava_params())
    first_diff, spikes = _run_pair(ours, lava, a_in, bias_int)
    assert first_diff is None, f"differs from Lava at step {first_diff}"
    counts = ours.counter.as_dict()["neuron"]
    assert counts["current_wrap"] > 0  # the overflow path was exercised
    assert 0 < spikes < T_LONG * n
    if voltage_decay == 0.0:
        assert counts["voltage"] > 0  # and Lava's symmetric voltage clip


def test_loihi_wrap_boundaries_are_lavas():
    # Lava keeps +2**23 (one above int24) and maps -2**23 to +2**23: (-2**23, 2**23], not two's complement
    x = torch.tensor([2**23, 2**23 + 1, -(2**23), -(2**23) - 5, -(2**23) + 1, 7])
    assert wrap_lava(x, 24).tolist() == [2**23, -(2**23) + 1, 2**23, 2**23 - 5, -(2**23) + 1, 7]
    a = np.array([2**17, 2**17 + 1, -(2**17), -(2**17) - 1, 5], np.int32)  # a_in << 6 at the boundaries
    lava = LavaLIF(5, du=4095, dv=0, vth=131071)
    lava.run_spk(a)
    assert lava.u.tolist() == wrap_lava(torch.from_numpy(a).long() << 6, 24).tolist()
    assert lava.u[:2].tolist() == [2**23, -(2**23) + 64]
    assert floor_shift(torch.tensor([-7, 7, -1]), -1).tolist() == [-4, 3, -1]  # floor, not toward zero


def test_szo_arithmetic_matches_lava_without_overflow_and_counts_saturations_with_it():
    g = np.random.default_rng(5)
    n = 64
    small = g.integers(-1500, 3000, (T_LONG, n)).astype(np.int32)
    mant, exp, bias_int = _bias(n, g)
    mant, bias_int = mant // 8, torch.from_numpy((mant // 8).astype(np.int64) << exp.astype(np.int64))
    ours = FixedCubaLIF(0.25, 0.1, 2.0, reset="zero")
    lava = LavaLIF(n, du=1023, dv=410, vth=128, bias_mant=mant, bias_exp=exp)
    assert (ours.current_decay_int, ours.voltage_decay_int, ours.threshold_int) == (1024, 410, 128 << 6)
    first_diff, spikes = _run_pair(ours, lava, small, bias_int)
    assert first_diff is None and spikes > 0 and ours.counter.total() == 0
    big = small.copy()
    big[300:, :8] = 1 << 17  # from step 300 on, 8 neurons' currents overflow
    ours = FixedCubaLIF(0.25, 0.1, 2.0, reset="zero")
    lava = LavaLIF(n, du=1023, dv=410, vth=128, bias_mant=mant, bias_exp=exp)
    first_diff, _ = _run_pair(ours, lava, big, bias_int)
    assert first_diff == 300  # identical until the first overflow: szo clamps where Lava wraps
    assert ours.counter.as_dict()["neuron"]["current"] > 0


def test_loihi_rejects_parameters_lava_cannot_hold():
    with pytest.raises(ValueError, match="tau > 1"):
        LoihiCubaLIF(1.0, 1.0)  # dv = 4096 needs dm_offset 1
    with pytest.raises(ValueError, match="smallest current decay"):
        LoihiCubaLIF(0.0, 0.5)  # du + ds_offset >= 1
    with pytest.raises(ValueError, match="17-bit"):
        LoihiCubaLIF(1.0, 0.5, v_threshold=2048.0)
    assert paper_lif("loihi").lava_params() == {"du": 4095, "dv": 3724, "vth": 64}
    with pytest.raises(ValueError, match="valid: \\['szo', 'loihi'\\]"):
        check_arithmetic("lava")
    assert ARITHMETICS == ("szo", "loihi")


class _TwoLayer(SpikingModel):
    """flatten -> Linear(+bias) -> LIF -> Linear(+bias) readout: Dense -> LIF -> Dense in Lava."""

    def __init__(self, n_in: int = 16, hidden: int = 24, out: int = 5, T: int = 4) -> None:
        super().__init__(num_classes=out, T=T, model_name="two_layer")
        self.flatten = layer.Flatten(step_mode="m")
        self.fc1 = layer.Linear(n_in, hidden, step_mode="m")
        self.sn1 = make_neuron("lif")
        self.fc2 = layer.Linear(hidden, out, step_mode="m")

    def forward_seq(self, x_seq: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.sn1(self.fc1(self.flatten(x_seq))))


def _bias_parts(bias_int: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """``bias_int = mant << exp`` as Lava's (13-bit mant, 3-bit exp), the largest exp that divides all."""
    b = bias_int.numpy().astype(np.int64)
    e = 0
    while e < 7 and (np.abs(b) >= 4096 << e).any() and not (b % (2 << e)).any():
        e += 1
    assert (np.abs(b >> e) < 4096).all() and ((b >> e) << e == b).all()
    return (b >> e).astype(np.int16), np.full(b.shape, e, np.int16)


def _lava_chain(net, x_int: np.ndarray, frac: int, reset_zero: bool = True):
    """Run the converted two-layer network in the Lava transcription; returns readout [T, N, out] in state units.

    Mapping of a szo synapse (w_int, e) to Lava's Dense: weights 2 * w_int (mixed sign mode, LSB
    truncated) and weight_exp = e - frac + 6 - 1; the LIF gets du = 4095, dv, vth from the
    neuron and bias = bias_int as (mant, exp). Each Lava Dense delays by one step, so the chain
    runs T + 2 steps and the readout is read from step 2 on.
    """
    q = net.quantized_layers()
    w1, e1, b1 = q["fc1"]["w_int"].numpy(), q["fc1"]["exp"], q["fc1"]["bias_int"]
    w2, e2, b2 = q["fc2"]["w_int"].numpy(), q["fc2"]["exp"], q["fc2"]["bias_int"]
    T, N = x_int.shape[:2]
    readout = np.zeros((T, N, w2.shape[0]), np.int64)
    for i in range(N):  # Lava processes are one sample at a time
        d1 = LavaDense(2 * w1, e1 - frac + 6 - 1, num_message_bits=16)
        mant, exp = _bias_parts(b1)
        lif = LavaLIF(w1.shape[0], bias_mant=mant, bias_exp=exp, **net.neurons["sn1"].lava_params())
        d2 = LavaDense(2 * w2, e2 + 6 - 1)
        for t in range(T + 2):  # LoihiProtocol order: Dense1 -> LIF -> Dense2 within one step
            x_t = x_int[t, i].reshape(-1) if t < T else np.zeros(x_int[0, i].size, np.int64)
            s = lif.run_spk(d1.run_spk(x_t))  # d1 sends the accumulation of step t - 1
            a2 = d2.run_spk(s)  # sends the accumulation of the spikes of step t - 1, i.e. of input t - 2
            if t >= 2:
                readout[t - 2, i] = (a2.astype(np.int64) << 6) + b2.numpy()
    return readout


def _model(scale1: float, scale2: float, seed: int = 0) -> _TwoLayer:
    torch.manual_seed(seed)
    m = _TwoLayer().eval()
    with torch.no_grad():
        m.fc1.weight.normal_(0.0, scale1)
        m.fc1.bias.normal_(0.0, 0.3)
        m.fc2.weight.normal_(0.0, scale2)
        m.fc2.bias.normal_(0.0, 0.1)
    for mod in m.modules():  # a standard Loihi LIF resets hard
        if hasattr(mod, "v_reset"):
            mod.v_reset = 0.0
    return m


def test_loihi_network_bit_exact_with_lava_dense_lif_chain_1000_steps():
    T, N = T_LONG, 2
    g = torch.Generator().manual_seed(3)
    x_int = torch.randint(-9000, 24000, (T, N, 1, 4, 4), generator=g)  # graded 16-bit input, 6 fractional bits
    x_int[torch.rand(x_int.shape, generator=g) < 0.3] = 0
    m = _model(scale1=1.5, scale2=0.05)
    net = to_fixed(m, arithmetic="loihi", verify_exact=True)
    out = net(x_int.to(torch.float32) / 64)
    exps = {p: q["exp"] for p, q in net.quantized_layers().items()}
    assert exps["fc1"] - 6 + 6 - 1 < 0 and exps["fc2"] + 6 - 1 < 0  # both Lava weight exponents negative: floor shifts
    ours = (out * 4096).round().to(torch.int64).numpy()
    ref = _lava_chain(net, x_int.numpy(), frac=6)
    assert np.array_equal(ours, ref)
    counts = net.saturation_counts()
    assert counts["sn1"]["current_wrap"] > 0  # currents wrapped, identically in both


def test_szo_network_matches_lava_where_no_rounding_or_overflow_and_differs_where_lava_floors():
    T, N = 200, 2
    g = torch.Generator().manual_seed(4)
    x_int = torch.randint(0, 3, (T, N, 1, 4, 4), generator=g)  # tiny graded inputs: no overflow
    m = _model(scale1=40.0, scale2=2.0)  # e >= 0 (graded) and e >= -5 (spikes): all Lava shifts are left shifts
    for arithmetic in ARITHMETICS:
        net = to_fixed(m, arithmetic=arithmetic)
        out = net(x_int.to(torch.float32) / 64)
        exps = {p: q["exp"] for p, q in net.quantized_layers().items()}
        assert exps["fc1"] - 1 >= 0 and exps["fc2"] + 5 >= 0
        ours = (out * 4096).round().to(torch.int64).numpy()
        assert np.array_equal(ours, _lava_chain(net, x_int.numpy(), frac=6)), arithmetic
        assert net.counter.total() == 0
    # negative Lava exponents: szo shifts exactly (no rounding), Lava floors at 2**-6 of a current unit
    m = _model(scale1=1.5, scale2=0.05)
    x_int = torch.randint(-600, 1600, (50, N, 1, 4, 4), generator=g)
    net = to_fixed(m, arithmetic="szo", record=True)
    net(x_int.to(torch.float32) / 64)
    lo = to_fixed(m, arithmetic="loihi", record=True)
    lo(x_int.to(torch.float32) / 64)
    a, b = net.last_record["fc1"], lo.last_record["fc1"]
    diff = a - b
    assert (diff != 0).any() and (diff >= 0).all() and (diff < 64).all()  # floor of a_out, 6 bits below the state LSB


def test_reset_override_and_bad_arithmetic():
    m = _model(1.5, 0.05)
    with pytest.raises(ValueError, match="valid: \\['szo', 'loihi'\\]"):
        to_fixed(m, arithmetic="lava")
    with pytest.raises(ValueError, match="unknown reset 'hard'"):
        to_fixed(m, reset="hard")
    assert to_fixed(m, arithmetic="loihi", reset="subtract").neurons["sn1"].reset == "subtract"
    m.sn1.v_reset = None
    assert to_fixed(m, arithmetic="loihi").neurons["sn1"].reset == "subtract"
    assert to_fixed(m, arithmetic="loihi", reset="zero").neurons["sn1"].reset == "zero"
    m.sn1.tau = 1.0  # dv = 4096: Lava's 12-bit dv cannot hold a full leak
    with pytest.raises(ValueError, match="sn1.*loihi arithmetic.*tau > 1"):
        to_fixed(m, arithmetic="loihi")
    assert to_fixed(m, arithmetic="szo").neurons["sn1"].voltage_decay_int == 4096


def _conv_as_dense(w_int: torch.Tensor, conv: torch.nn.Conv2d, in_shape: tuple[int, int, int]) -> np.ndarray:
    """The convolution as the weight matrix of a Lava Dense (Toeplitz, channel-major flattening)."""
    n_in = int(np.prod(in_shape))
    basis = torch.eye(n_in, dtype=torch.float64).view(n_in, *in_shape)
    cols = torch.nn.functional.conv2d(basis, w_int.to(torch.float64), None, conv.stride, conv.padding)
    return cols.reshape(n_in, -1).t().round().to(torch.int64).numpy()


def test_loihi_convnet_bit_exact_with_lava_dense_chain():
    """spike_convnet (conv-BN-LIF x2, 2x2 sum pool, fc) with hard reset against Lava Dense/LIF over 300 steps.

    Each conv is the Dense of its Toeplitz matrix (Lava's bit-accurate synapse; its Conv model
    is not tagged bit-accurate); the sum pool is computed on the LIF2 spikes and sent as graded
    counts to the fc Dense. Three Dense stages: the readout is 3 steps late in Lava.
    """
    from szo.models import create

    torch.manual_seed(0)
    m = create("spike_convnet", T=4, width=4).eval()
    with torch.no_grad():
        m.conv1.weight.mul_(4.0)
        m.conv2.weight.mul_(3.0)
        m.bn1.running_mean.fill_(0.1)
        m.bn2.running_var.fill_(0.5)
        m.fc.weight.mul_(4.0)
    T = 300
    g = torch.Generator().manual_seed(1)
    x_int = torch.randint(-40, 160, (T, 1, 1, 8, 8), generator=g)
    net = to_fixed(m, arithmetic="loihi", reset="zero")
    ours = (net(x_int.to(torch.float32) / 64) * 4096).round().to(torch.int64)[:, 0].numpy()
    q = net.quantized_layers()
    assert all(q[p]["exp"] + 6 - (6 if p == "conv1" else 0) - 1 < 0 for p in q)  # every Lava exponent negative

    def lif(path: str, bias_int: torch.Tensor, hw: int) -> LavaLIF:
        mant, exp = _bias_parts(bias_int.repeat_interleave(hw))
        return LavaLIF(mant.size, bias_mant=mant, bias_exp=exp, **net.neurons[path].lava_params())

    d1 = LavaDense(2 * _conv_as_dense(q["conv1"]["w_int"], m.conv1, (1, 8, 8)), q["conv1"]["exp"] - 1,
                   num_message_bits=16)
    l1 = lif("sn1", q["conv1"]["bias_int"], 64)
    d2 = LavaDense(2 * _conv_as_dense(q["conv2"]["w_int"], m.conv2, (4, 8, 8)), q["conv2"]["exp"] + 5)
    l2 = lif("sn2", q["conv2"]["bias_int"], 64)
    d3 = LavaDense(2 * q["fc"]["w_int"].numpy(), q["fc"]["exp"] + 5, num_message_bits=16)
    ref = np.zeros_like(ours)
    n1 = n2 = 0
    for t in range(T + 3):
        x_t = x_int[t, 0].reshape(-1).numpy() if t < T else np.zeros(64, np.int64)
        s1 = l1.run_spk(d1.run_spk(x_t))
        s2 = l2.run_spk(d2.run_spk(s1))
        n1, n2 = n1 + int(s1.sum()), n2 + int(s2.sum())
        pooled = s2.reshape(4, 4, 2, 4, 2).sum(axis=(2, 4)).reshape(-1)  # 8x8 -> 4x4 sum pool of the spikes
        a3 = d3.run_spk(pooled)
        if t >= 3:
            ref[t - 3] = (a3.astype(np.int64) << 6) + q["fc"]["bias_int"].numpy()
    assert np.array_equal(ours, ref)
    assert 0 < n1 < T * 256 and 0 < n2 < T * 256  # both layers spike, neither saturates


def test_soft_reset_same_in_both_arithmetics_until_overflow_then_loihi_wraps():
    g = torch.Generator().manual_seed(9)
    x = torch.randint(-3000, 9000, (1000, 32), generator=g)
    bias = torch.randint(-500, 500, (32,), generator=g)
    a, b = paper_lif("fixed", reset="subtract"), paper_lif("loihi", reset="subtract")
    s_a, _, rec_a = a.run(x, record=True, bias=bias)
    s_b, _, rec_b = b.run(x, record=True, bias=bias)
    assert torch.equal(s_a, s_b) and torch.equal(rec_a.voltage, rec_b.voltage) and s_a.sum() > 0
    # one step past the 24-bit range: szo clamps to 2**23 - 1 and spikes, Lava wraps negative and stays silent
    big = torch.tensor([[2**23 + 4096]])
    s_a, _, rec_a = paper_lif("fixed", reset="subtract").run(big, record=True)
    s_b, _, rec_b = paper_lif("loihi", reset="subtract").run(big, record=True)
    assert (int(s_a), int(rec_a.current)) == (1, 2**23 - 1)
    assert (int(s_b), int(rec_b.current)) == (0, -(2**23) + 4096)
