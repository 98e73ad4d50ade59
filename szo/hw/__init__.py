"""Fixed-point (Loihi-style) backend: number formats, CUBA-LIF neurons, converter, SZO on chip, hw-report.

``backend(model, "fixed")`` returns a network with the model's interface and parameter layout
whose forward runs in integers; see docs/hardware.md.
"""
from szo.hw.convert import BACKENDS, FixedPointNetwork, UnsupportedLayerError, backend, to_fixed
from szo.hw.fixed import Precision, SaturationCounter
from szo.hw.neuron import FixedCubaLIF, FloatCubaLIF, paper_lif
from szo.hw.xorshift import XorShift32, rademacher

__all__ = ["BACKENDS", "FixedCubaLIF", "FixedPointNetwork", "FloatCubaLIF", "Precision", "SaturationCounter",
           "UnsupportedLayerError", "XorShift32", "backend", "paper_lif", "rademacher", "to_fixed"]
