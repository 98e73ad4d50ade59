"""Fixed-point (Loihi-style) backend: number formats, CUBA-LIF neurons, converter, SZO on chip, hw-report.

``backend(model, "fixed")`` returns a network with the model's interface and parameter layout
whose forward runs in integers, in szo's saturating arithmetic or (``arithmetic="loihi"``)
bit-exact with Lava's bit-accurate Dense/LIF; see docs/hardware.md.
"""
from szo.hw.convert import BACKENDS, FixedPointNetwork, UnsupportedLayerError, backend, to_fixed
from szo.hw.fixed import ARITHMETICS, BitWidths, SaturationCounter
from szo.hw.neuron import FixedCubaLIF, FloatCubaLIF, LoihiCubaLIF, paper_lif
from szo.hw.xorshift import XorShift32, rademacher

__all__ = ["ARITHMETICS", "BACKENDS", "FixedCubaLIF", "FixedPointNetwork", "FloatCubaLIF", "LoihiCubaLIF",
           "BitWidths", "SaturationCounter",
           "UnsupportedLayerError", "XorShift32", "backend", "paper_lif", "rademacher", "to_fixed"]
