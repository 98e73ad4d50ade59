"""Test oracle: an independent numpy transcription of Lava's bit-accurate LIF and Dense models.

lava-nc cannot be installed next to SpikingJelly 2 (Python < 3.11 vs >= 3.11), so these
classes transcribe the equations of lava-nc/lava at commit
b6822fbc0e85730fc0da6979451f42fef038fb71 (2025-07-28), line by line, with numpy and the same
dtypes. Nothing here imports or copies szo code: it is what szo.hw's ``"loihi"`` arithmetic
is checked against.

Sources (line numbers at that commit):

* ``src/lava/proc/lif/models.py``: ``AbstractPyLifModelFixed`` (L72-216: ``__init__``
  L87-108, ``scale_bias`` L110-122, ``subthr_dynamics`` L138-186, ``reset_voltage``
  L188-192, ``run_spk`` L194-216) and ``PyLifModelBitAcc`` (L240-278: ``scale_threshold``
  L268-274, ``spiking_activation`` L276-278).
* ``src/lava/proc/dense/models.py``: ``AbstractPyDenseModelBitAcc`` (L57-107: weight clipping
  and truncation L82-91, one-step buffer L93-96, accumulation L97-102, exponent shift L103-107).
* ``src/lava/utils/weightutils.py``: ``determine_sign_mode`` L21-43, ``truncate_weights``
  L204-247, ``clip_weights`` L250-295.
"""
from __future__ import annotations

import numpy as np

__all__ = ["LavaDense", "LavaLIF", "clip_weights", "determine_sign_mode", "truncate_weights"]

MIXED, EXCITATORY, INHIBITORY = "mixed", "excitatory", "inhibitory"


def determine_sign_mode(weights: np.ndarray) -> str:
    # weightutils.py L36-43
    if np.min(weights) >= 0:
        return EXCITATORY
    if np.max(weights) <= 0:
        return INHIBITORY
    return MIXED


def clip_weights(weights: np.ndarray, sign_mode: str, num_bits: int) -> np.ndarray:
    # weightutils.py L275-295 (learning_simulation=False)
    weights = weights.copy().astype(np.int32)
    mixed = int(sign_mode == MIXED)
    inhibitory = int(sign_mode == INHIBITORY)
    if inhibitory:
        weights = -weights
    min_wgt = (-2 ** num_bits) * mixed
    max_wgt = 2 ** num_bits - 1
    weights = np.clip(weights, min_wgt, max_wgt)
    if inhibitory:
        weights = -weights
    return weights


def truncate_weights(weights: np.ndarray, sign_mode: str, num_weight_bits: int,
                     max_num_weight_bits: int = 8) -> np.ndarray:
    # weightutils.py L230-247
    weights = weights.copy().astype(np.int32)
    if sign_mode == INHIBITORY:
        weights = -weights
    mixed = int(sign_mode == MIXED)
    num_truncate_bits = max_num_weight_bits - num_weight_bits + mixed
    weights = (weights >> num_truncate_bits) << num_truncate_bits
    if sign_mode == INHIBITORY:
        weights = -weights
    return weights


class LavaDense:
    """``PyDenseModelBitAcc``: ``weights`` [n_out, n_in] (Lava's 8-bit convention: mixed sign
    in [-256, 255] with the LSB truncated), ``weight_exp``, graded input if ``num_message_bits > 0``."""

    def __init__(self, weights: np.ndarray, weight_exp: int = 0, num_message_bits: int = 0,
                 num_weight_bits: int = 8) -> None:
        self.weights = np.asarray(weights).astype(np.int32)
        self.weight_exp = int(weight_exp)
        self.num_message_bits = int(num_message_bits)
        self.num_weight_bits = num_weight_bits
        self.weights_set = False
        self.a_buff = np.zeros(self.weights.shape[0], np.int32)  # a_buff: int32 (process var, starts at 0)

    def run_spk(self, s_in: np.ndarray) -> np.ndarray:
        """One time step: returns what a_out sends (the accumulation of the previous step)."""
        if not self.weights_set:  # L82-91
            sign_mode = determine_sign_mode(self.weights)
            self.weights = clip_weights(self.weights, sign_mode, num_bits=8)
            self.weights = truncate_weights(self.weights, sign_mode, self.num_weight_bits)
            self.weights_set = True
        a_out = self.a_buff.copy()  # L96: a_out.send(a_buff) before the new accumulation
        if self.num_message_bits > 0:  # L97-102
            a_accum = self.weights.dot(np.asarray(s_in))
        else:
            a_accum = self.weights[:, np.asarray(s_in).astype(bool)].sum(axis=1)
        self.a_buff = (np.left_shift(a_accum, self.weight_exp) if self.weight_exp > 0  # L103-107
                       else np.right_shift(a_accum, -self.weight_exp))
        return a_out


class LavaLIF:
    """``PyLifModelBitAcc`` (LIF process with the bit-accurate model); hard reset to 0."""

    def __init__(self, shape: tuple[int, ...] | int, du: int, dv: int, vth: int,
                 bias_mant: np.ndarray | int = 0, bias_exp: np.ndarray | int = 0) -> None:
        # process variables, with the model's LavaPyType dtypes (L78-85, L262)
        self.u = np.zeros(shape, np.int32)
        self.v = np.zeros(shape, np.int32)
        self.du, self.dv, self.vth = int(du), int(dv), int(vth)
        self.bias_mant = np.broadcast_to(np.asarray(bias_mant, np.int16), self.u.shape).copy()
        self.bias_exp = np.broadcast_to(np.asarray(bias_exp, np.int16), self.u.shape).copy()
        # __init__ L94-108
        self.ds_offset = 1
        self.dm_offset = 0
        self.uv_bitwidth = 24
        self.max_uv_val = 2 ** (self.uv_bitwidth - 1)
        self.decay_shift = 12
        self.decay_unity = 2 ** self.decay_shift
        self.vth_shift = 6
        self.act_shift = 6
        self.effective_bias = 0
        self.effective_vth = 0

    def scale_bias(self) -> None:
        # L116-121
        bias_mant = self.bias_mant.copy().astype(np.int32)
        self.effective_bias = np.where(self.bias_exp >= 0, np.left_shift(bias_mant, self.bias_exp),
                                       np.right_shift(bias_mant, -self.bias_exp))

    def scale_threshold(self) -> None:
        # L273
        self.effective_vth = np.left_shift(self.vth, self.vth_shift)

    def subthr_dynamics(self, activation_in: np.ndarray) -> None:
        # current, L145-171
        decay_const_u = self.du + self.ds_offset
        decayed_curr = np.int64(self.u) * (self.decay_unity - decay_const_u)
        decayed_curr = np.sign(decayed_curr) * np.right_shift(np.abs(decayed_curr), self.decay_shift)
        decayed_curr = np.int32(decayed_curr)
        activation_in = np.left_shift(activation_in, self.act_shift)
        decayed_curr += activation_in
        wrapped_curr = np.where(decayed_curr > self.max_uv_val, decayed_curr - 2 * self.max_uv_val, decayed_curr)
        wrapped_curr = np.where(wrapped_curr <= -self.max_uv_val, decayed_curr + 2 * self.max_uv_val, wrapped_curr)
        self.u[:] = wrapped_curr
        # voltage, L174-186
        decay_const_v = self.dv + self.dm_offset
        neg_voltage_limit = -np.int32(self.max_uv_val) + 1
        pos_voltage_limit = np.int32(self.max_uv_val) - 1
        decayed_volt = np.int64(self.v) * (self.decay_unity - decay_const_v)
        decayed_volt = np.sign(decayed_volt) * np.right_shift(np.abs(decayed_volt), self.decay_shift)
        decayed_volt = np.int32(decayed_volt)
        updated_volt = decayed_volt + self.u + self.effective_bias
        self.v[:] = np.clip(updated_volt, neg_voltage_limit, pos_voltage_limit)

    def run_spk(self, a_in: np.ndarray) -> np.ndarray:
        """One time step (L194-216): returns the spikes (bool)."""
        # a_in arrives as PyInPortVectorDense.recv: np.zeros(shape, int16) + the int32 a_out -> int32
        a_in = np.zeros(self.u.shape, np.int16) + np.asarray(a_in, np.int32)
        self.scale_bias()
        self.scale_threshold()
        self.subthr_dynamics(activation_in=a_in)
        s_out = self.v > self.effective_vth  # L278
        self.v[s_out] = 0  # reset_voltage, L192
        return s_out
