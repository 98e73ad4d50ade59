from __future__ import annotations

import pytest

from szo.hw.xorshift import XorShift32, rademacher


def test_seed_1_test_vector():
    g = XorShift32(1)
    assert [g.next(), g.next()] == [270369, 67634689]


def test_state_stays_32_bit_and_regenerates():
    g = XorShift32(0xFFFFFFFF)
    vals = g.draws(1000)
    assert int(vals.min()) >= 1 and int(vals.max()) <= 0xFFFFFFFF
    assert rademacher(12345, 64).tolist() == rademacher(12345, 64).tolist()
    z = rademacher(99, 4000)
    assert set(z.unique().tolist()) == {-1, 1}
    assert abs(float(z.float().mean())) < 0.06
    # LSB rule: 270369 is odd -> -1; 67634689 is odd -> -1
    assert rademacher(1, 2).tolist() == [-1, -1]


@pytest.mark.parametrize("bad", [0, -1, 2**32, 1.5, True])
def test_bad_seed_rejected(bad):
    with pytest.raises(ValueError, match="seed must be"):
        XorShift32(bad)


@pytest.mark.parametrize("seed, n", [(1, 255), (1, 256), (123456, 1000), (0xFFFFFFFF, 100_003)])
def test_long_draws_are_the_serial_recurrence(seed, n):
    """From 256 draws on the states are computed in lanes (GF(2) jumps); they must be the serial
    recurrence's, written out here, and leave the generator where n serial steps would."""
    s, want = seed, []
    for _ in range(n):
        s ^= (s << 13) & 0xFFFFFFFF
        s ^= s >> 17
        s ^= (s << 5) & 0xFFFFFFFF
        want.append(s)
    g = XorShift32(seed)
    assert g.draws(n).tolist() == want
    assert g.state == s
