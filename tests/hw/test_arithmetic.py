"""The fixed-point backend's arithmetic is chosen once, by its tag (``szo.hw.arithmetic``), and the two
CUBA-LIF neurons (Lava's in ``szo.hw.neuron``, NIR's in ``szo.models.cuba``) are named apart where their
maths differ."""
from __future__ import annotations

import ast
import inspect

import pytest
import torch

import szo.hw.convert
from szo.hw import to_fixed
from szo.hw.arithmetic import ARITHMETIC_MODELS, LavaBitAccurate, SaturatingArithmetic, arithmetic_model
from szo.hw.fixed import ARITHMETICS
from szo.hw.neuron import CubaState, FixedCubaLIF, FloatCubaLIF, LoihiCubaLIF
from szo.models import create
from szo.models.cuba import CUBA_FIELDS, NIRCubaLIFNode


def test_one_implementation_per_tag():
    assert tuple(ARITHMETIC_MODELS) == ARITHMETICS
    assert isinstance(arithmetic_model("szo"), SaturatingArithmetic) and arithmetic_model("szo").neuron is FixedCubaLIF
    assert isinstance(arithmetic_model("loihi"), LavaBitAccurate) and arithmetic_model("loihi").neuron is LoihiCubaLIF
    with pytest.raises(ValueError, match="unknown arithmetic 'lava'; valid: "):
        arithmetic_model("lava")


@pytest.mark.parametrize("tag", ARITHMETICS)
def test_the_network_holds_the_implementation_its_tag_names(tag):
    net = to_fixed(create("spike_convnet", T=2).eval(), arithmetic=tag)
    assert net.arithmetic == tag and net.arithmetic_model is ARITHMETIC_MODELS[tag]
    assert {type(n) for n in net.neurons.values()} == {ARITHMETIC_MODELS[tag].neuron}


def test_no_method_of_the_converter_compares_the_arithmetic_tag():
    """Lava's way: the tag picks the implementation once; the converter never branches on its name."""
    tree = ast.parse(inspect.getsource(szo.hw.convert))
    compares = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Compare)
                and any(isinstance(c, ast.Constant) and c.value in ARITHMETICS for c in [n.left, *n.comparators])]
    assert compares == []


def test_lavas_float_neuron_fires_at_threshold_nirs_only_above():
    """The documented difference that keeps the two CUBA-LIF neurons apart: at V == threshold Lava's float
    reference (SpikingJelly's comparison) fires, NIR's neuron (norse's, strictly above) does not."""
    lava = FloatCubaLIF(current_decay=1.0, voltage_decay=1.0, v_threshold=1.0)  # V[t] = x[t]
    s, _ = lava.step(torch.tensor([1.0]), CubaState(torch.zeros(1), torch.zeros(1)))
    assert s.item() == 1.0
    ones = {k: [1.0] for k in CUBA_FIELDS}
    fields = dict(ones, v_leak=[0.0], v_reset=[0.0])
    nir = NIRCubaLIFNode(fields, dt=1.0)  # dt / tau = 1: I[t] = x[t], h[t] = I[t]
    assert nir(torch.ones(1, 1, 1)).item() == 0.0  # h == v_threshold: no spike
    nir.reset()
    assert nir(torch.full((1, 1, 1), 1.5)).item() == 1.0
