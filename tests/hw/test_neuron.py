"""Fixed-point CUBA-LIF vs SpikingJelly lava_exchange (oracle), hand vectors, float twin."""
from __future__ import annotations

import pytest
import torch
from spikingjelly.activation_based import lava_exchange

from szo.hw.fixed import BitWidths, SaturationCounter, right_shift_to_zero, saturate, shift
from szo.hw.neuron import FixedCubaLIF, FloatCubaLIF, paper_lif, voltage_decay_error
from szo.models.neurons import make_neuron

S = 1 << 12  # lava s_scale for scale = 1 << 6


@pytest.mark.parametrize("current_decay,voltage_decay", [(1.0, 1 / 1.1), (0.25, 0.1), (0.0, 0.03)])
def test_bit_exact_vs_lava_exchange_1000_steps(current_decay, voltage_decay):
    g = torch.Generator().manual_seed(7)
    T, n = 1000, 64
    x_int = torch.randint(-3000, 7000, (T, n), generator=g)
    ref = lava_exchange.CubaLIFNode(current_decay, voltage_decay, v_threshold=1.0, step_mode="s")
    ours = FixedCubaLIF(current_decay, voltage_decay, 1.0, reset="zero")
    state = ours.initial_state(x_int[0])
    total_spikes = 0
    for t in range(T):
        s_ref = ref(x_int[t].to(torch.float32) / S)
        s, state = ours.step(x_int[t], state)
        cur_ref = (ref.current_state * S).round().to(torch.int64)
        vol_ref = (ref.voltage_state * S).round().to(torch.int64)
        assert torch.equal((ref.current_state * S), cur_ref.float()), "lava state not on the 2^-12 grid"
        assert torch.equal(s, s_ref.to(torch.int64)), f"spike mismatch at t={t}"
        assert torch.equal(state.current, cur_ref), f"current mismatch at t={t}"
        assert torch.equal(state.voltage, vol_ref), f"voltage mismatch at t={t}"
        total_spikes += int(s.sum())
    assert 0 < total_spikes < T * n  # the comparison exercised both branches
    assert ours.counter.total() == 0


def test_right_shift_rounds_toward_zero_hand_vectors():
    x = torch.tensor([-7, 7, -8, -1, 1, 0, -4097, 4097])
    assert right_shift_to_zero(x, 1).tolist() == [-3, 3, -4, 0, 0, 0, -2048, 2048]
    assert right_shift_to_zero(x, 12).tolist() == [0, 0, 0, 0, 0, 0, -1, 1]
    assert shift(torch.tensor([-7]), -1).tolist() == [-3]
    assert shift(torch.tensor([-7]), 2).tolist() == [-28]
    with pytest.raises(ValueError, match="int32/int64"):
        right_shift_to_zero(torch.tensor([1.5]), 1)


def test_saturation_hand_vectors_24_bit():
    c = SaturationCounter()
    x = torch.tensor([2**23, 2**23 - 1, -(2**23), -(2**23) - 1, 5 * 2**23, 0])
    y = saturate(x, 24, c, "L", "current")
    assert y.tolist() == [2**23 - 1, 2**23 - 1, -(2**23), -(2**23), 2**23 - 1, 0]
    assert c.as_dict() == {"L": {"current": 3}}


def test_neuron_voltage_saturates_not_wraps():
    # dV = 0 (no leak), huge threshold: V integrates until it hits 2^23 - 1 and stays
    n = FixedCubaLIF(1.0, 0.0, v_threshold=4096.0, reset="zero")
    x = torch.full((4, 1), 3_000_000, dtype=torch.int64)
    _, _, rec = n.run(x, record=True)
    assert rec.voltage[:, 0].tolist() == [3_000_000, 6_000_000, 2**23 - 1, 2**23 - 1]
    assert n.counter.as_dict()["neuron"]["voltage"] == 2
    neg = FixedCubaLIF(1.0, 0.0, v_threshold=1.0, reset="zero")
    _, _, rec = neg.run(-x, record=True)
    assert rec.voltage[:, 0].tolist() == [-3_000_000, -6_000_000, -(2**23), -(2**23)]


def test_leak_hand_vector_rounds_toward_zero():
    # paper LIF: dV = round(4096 / 1.1) = 3724 -> retained 372/4096
    n = paper_lif("fixed", reset="subtract")
    assert n.voltage_decay_int == 3724 and n.current_decay_int == 4096
    x = torch.tensor([[-1001], [0]], dtype=torch.int64)
    _, _, rec = n.run(x, record=True)
    # -1001 * 372 = -372372; -372372 / 4096 = -90.9 -> toward zero = -90 (floor would give -91)
    assert rec.voltage[:, 0].tolist() == [-1001, -90]
    err = voltage_decay_error(1.1)
    assert err["decay_int"] == 3724 and abs(err["abs_error"] + 8.878e-5) < 1e-7


def test_subtract_reset_hand_vector():
    n = paper_lif("fixed", reset="subtract")
    x = torch.tensor([[5000], [0], [4096]], dtype=torch.int64)
    s, _, rec = n.run(x, record=True)
    # t0: V = 5000 > 4096 -> spike, V = 904; t1: V = 904*372>>12 = 82; t2: 82*372>>12 + 4096 = 4103 -> spike, 7
    assert s[:, 0].tolist() == [1, 0, 1]
    assert rec.voltage[:, 0].tolist() == [904, 82, 7]


def test_float_twin_matches_spikingjelly_lif():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(50, 200, generator=g) * 0.8 + 0.3
    sj = make_neuron("lif")
    s_ref = sj(x)
    ours = paper_lif("float")
    s, state, _ = ours.run(x)
    assert torch.equal(s, s_ref)
    torch.testing.assert_close(state.voltage, sj.v, rtol=0, atol=1e-5)


def test_same_cases_float_and_fixed_agree():
    # inputs on the fixed-point grid: the two implementations differ only by rounding of the leak
    g = torch.Generator().manual_seed(5)
    x_int = torch.randint(-2000, 6000, (40, 500), generator=g)
    fl, fx = paper_lif("float"), paper_lif("fixed")
    s_f, _, rec_f = fl.run(x_int.float() / S, record=True)
    s_x, _, rec_x = fx.run(x_int, record=True)
    assert (s_f == s_x.float()).float().mean() > 0.99
    assert ((rec_f.voltage - rec_x.voltage.float() / S).abs() < 0.01).float().mean() > 0.99


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="valid: \\['subtract', 'zero'\\]"):
        FixedCubaLIF(1.0, 0.5, reset="hard")
    with pytest.raises(ValueError, match="fraction in \\[0, 1\\]"):
        FloatCubaLIF(1.5, 0.5)
    with pytest.raises(ValueError, match="multiple of 2\\*\\*-6"):
        FixedCubaLIF(1.0, 0.5, v_threshold=1.001)
    with pytest.raises(ValueError, match="valid: \\['float', 'fixed', 'loihi'\\]"):
        paper_lif("int")
    with pytest.raises(ValueError, match="integer tensor"):
        FixedCubaLIF(1.0, 0.5).run(torch.ones(3, 2))
    with pytest.raises(ValueError, match="weight_bits"):
        BitWidths(weight_bits=1)


def test_decay_to_int_rounds_half_to_even_like_lava():
    from szo.hw.fixed import decay_to_int

    assert [decay_to_int(v / 4096) for v in (0.5, 1.5, 2.5, 3724.5)] == [0, 2, 2, 3724]
    assert decay_to_int(1 / 1.1) == 3724 and decay_to_int(0.0) == 0 and decay_to_int(1) == 4096
    assert type(decay_to_int(0.3)) is int
