"""The exchange format between szo and Intel Lava, and the runner that executes it inside Lava.

lava-nc 0.10.0 installs on Python 3.10 only (it declares ``< 3.11``; on 3.11 it fails at import),
while szo needs 3.11, so Lava runs as a second interpreter (``make lava``: ``.venv-lava``) that
szo drives through files and a subprocess, the way a deployment flow would. This file is both:

* imported by szo (``szo.hw.lava.runner``): :func:`write_bundle` / :func:`read_bundle` and the
  validation of every kind of bundle; it imports only numpy and the standard library;
* run as a script by the Lava interpreter: ``.venv-lava/bin/python -I szo/hw/lava/runner.py IN_DIR OUT_DIR``
  (``-I``: isolated, so that szo/hw's own modules do not shadow Lava's top-level ``lava`` package)
  reads a request bundle, builds Lava's own processes (``RingBuffer`` -> ``Dense`` ->
  ``LIF`` / ``LIFReset`` ..., read out by ``Extractor`` / ``VarWire``), runs them under
  ``Loihi2SimCfg(select_tag="fixed_pt")`` (``PyDenseModelBitAcc``, ``PyLifModelBitAcc``,
  ``PyLifResetModelBitAcc``) and writes a result bundle. The Lava imports sit in the functions
  that build processes: they only run in the Lava interpreter.

A bundle is a directory with ``exchange.json`` (format name, :data:`VERSION`, kind, scalar
settings, the name / dtype / shape of every array and the sha256 of the arrays file) and
``arrays.npz`` (integers only, loaded with ``allow_pickle=False``). Everything is checked on
load: a bundle of another version, a changed array file, a missing array, a value outside the
register Lava holds it in, each gives one :class:`ExchangeError` line. Kinds:

``lif``      regimes of one Lava ``LIF`` each: ``a_in [R, T, n]`` (the LIF's synaptic input, a
             Dense output), ``bias_mant``, ``bias_exp [R, n]``; settings ``du``, ``dv``, ``vth``
             per regime. Result: ``s``, ``u``, ``v [R, T, n]`` (every step).
``dense``    regimes of one Lava ``Dense`` each: ``weights.R [n_out, n_in]`` (Lava's 8-bit mixed
             sign convention: even values in [-256, 254]), ``s_in.R [T, n_in]``; settings
             ``weight_exp``, ``num_message_bits``. Result: ``a_out.R [T + 1, n_out]`` (what the
             Dense sends at steps 1 .. T + 1: its output is one step late).
``network``  a chain ``Dense, LIF, Dense, LIF, ..., Dense`` (the last Dense is the readout,
             its bias added by the host): per layer ``weights.NAME`` or ``bias_mant.NAME`` /
             ``bias_exp.NAME``, ``readout_bias`` (state units), optionally ``inputs [N, T,
             n_in]``. Lava runs the N samples back to back (period T); each neuron layer is a
             ``LIFReset`` that zeroes its state where its own sample begins (the offset is its
             pipeline delay). Result: ``spikes.NAME [steps, n]`` of every LIF layer and
             ``a_out [steps, n_out]`` of the readout Dense, raw per Lava step
             (:func:`network_delays` says where sample i, step k lands).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["FORMAT", "KINDS", "MANIFEST", "ARRAYS", "VERSION", "Bundle", "ExchangeError", "network_delays",
           "read_bundle", "write_bundle", "expected_result", "check_result", "NO_LAVA_EXIT"]

FORMAT = "szo-lava-exchange"
VERSION = 1
"""Bumped whenever a field changes meaning; a bundle of another version is refused on load."""
KINDS: tuple[str, ...] = ("lif", "dense", "network", "result")
MANIFEST = "exchange.json"
ARRAYS = "arrays.npz"

# Lava's registers (PyLifModelBitAcc / PyDenseModelBitAcc docstrings and LavaPyTypes)
DU_DV_MAX = (1 << 12) - 1  # du, dv: unsigned 12-bit
VTH_MAX = (1 << 17) - 1  # vth: unsigned 17-bit
BIAS_MANT = (-(1 << 12), (1 << 12) - 1)  # signed 13-bit
BIAS_EXP = (0, 7)  # unsigned 3-bit
WEIGHTS = (-256, 254)  # 8-bit mixed sign: 2 * w_int, the LSB truncated (truncate_weights)
GRADED = (-(1 << 15), (1 << 15) - 1)  # graded spikes: 16-bit signed payload
WEIGHT_EXP = (-24, 24)  # Lava shifts by any int; beyond this range every output is 0 or overflows int32
MESSAGE_BITS = (0, 24)


class ExchangeError(ValueError):
    """A bundle that is not a valid szo-lava exchange bundle of this version (one line)."""


@dataclass(frozen=True)
class Bundle:
    """A checked bundle: its kind, settings and integer arrays."""

    kind: str
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]


# ---------------------------------------------------------------------------------- files
def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename (this module also runs in the Lava
    interpreter, without szo, so it cannot use ``szo.io``)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_bundle(path: str | os.PathLike, kind: str, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> Path:
    """Validate and write a bundle directory (``exchange.json`` + ``arrays.npz``, both atomically);
    returns ``path``."""
    arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    manifest = {"format": FORMAT, "version": VERSION, "kind": kind, "meta": meta,
                "arrays": {k: {"dtype": str(v.dtype), "shape": list(v.shape)} for k, v in sorted(arrays.items())}}
    _validate(manifest, arrays)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    data = buf.getvalue()
    manifest["sha256"] = hashlib.sha256(data).hexdigest()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    _atomic_write(out / ARRAYS, data)
    _atomic_write(out / MANIFEST, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    return out


def read_bundle(path: str | os.PathLike, kind: str | None = None) -> Bundle:
    """The bundle in a directory, checked: format, version, kind (if given), the arrays
    file's sha256, every array's name / dtype / shape, and the kind's own rules."""
    p = Path(path)
    try:
        manifest = json.loads((p / MANIFEST).read_text(encoding="utf-8"))
        data = (p / ARRAYS).read_bytes()
    except FileNotFoundError as exc:
        raise ExchangeError(f"{p} is not a {FORMAT} bundle: {Path(exc.filename).name} is missing") from None
    except json.JSONDecodeError as exc:
        raise ExchangeError(f"{p / MANIFEST} is not JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ExchangeError(f"{p / MANIFEST}: format {manifest.get('format') if isinstance(manifest, dict) else None!r}"
                            f", expected {FORMAT!r}")
    if manifest.get("version") != VERSION:
        raise ExchangeError(f"{p}: {FORMAT} version {manifest.get('version')!r}; this reader reads version {VERSION} "
                            "only (export the bundle again with this szo)")
    if kind is not None and manifest.get("kind") != kind:
        raise ExchangeError(f"{p}: a {manifest.get('kind')!r} bundle, expected {kind!r}")
    if hashlib.sha256(data).hexdigest() != manifest.get("sha256"):
        raise ExchangeError(f"{p / ARRAYS} does not match the sha256 in {MANIFEST}: changed or truncated")
    try:  # never unpickled: an object array (or a file that is not an npz of plain arrays) is refused
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ExchangeError(f"{p / ARRAYS} does not hold plain integer arrays ({why}); the exchange never "
                            "unpickles") from None
    _validate(manifest, arrays)
    return Bundle(manifest["kind"], manifest["meta"], arrays)


# ----------------------------------------------------------------------------- validation
def _int(meta: dict[str, Any], key: str, lo: int, hi: int, where: str) -> int:
    v = meta.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ExchangeError(f"{where}: {key} = {v!r}, expected an int in [{lo}, {hi}]")
    return v


def _arr(arrays: dict[str, np.ndarray], name: str, shape: tuple[int, ...] | None, lo: int | None = None,
         hi: int | None = None, dtype: str = "int32") -> np.ndarray:
    if name not in arrays:
        raise ExchangeError(f"array {name!r} is missing")
    a = arrays[name]
    if str(a.dtype) != dtype:
        raise ExchangeError(f"array {name!r} has dtype {a.dtype}, expected {dtype}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ExchangeError(f"array {name!r} has shape {list(a.shape)}, expected {list(shape)}")
    if a.size and lo is not None and (int(a.min()) < lo or int(a.max()) > hi):
        raise ExchangeError(f"array {name!r} holds values in [{int(a.min())}, {int(a.max())}], outside "
                            f"[{lo}, {hi}] (the Lava register it goes to)")
    return a


def _validate(manifest: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    kind, meta = manifest.get("kind"), manifest.get("meta")
    if kind not in KINDS:
        raise ExchangeError(f"unknown bundle kind {kind!r}; valid: {list(KINDS)}")
    if not isinstance(meta, dict):
        raise ExchangeError("bundle meta must be a JSON object")
    listed = manifest.get("arrays", {})
    if set(listed) != set(arrays):
        raise ExchangeError(f"arrays file holds {sorted(arrays)}, manifest lists {sorted(listed)}")
    for name, a in arrays.items():
        if not np.issubdtype(a.dtype, np.integer):
            raise ExchangeError(f"array {name!r} has dtype {a.dtype}: the exchange holds integers only")
        if listed[name] != {"dtype": str(a.dtype), "shape": list(a.shape)}:
            raise ExchangeError(f"array {name!r}: {a.dtype} {list(a.shape)} differs from the manifest's {listed[name]}")
    if kind == "lif":
        _validate_lif(meta, arrays)
    elif kind == "dense":
        _validate_dense(meta, arrays)
    elif kind == "network":
        _validate_network(meta, arrays)


def _validate_lif_params(p: dict[str, Any], where: str) -> None:
    _int(p, "du", 0, DU_DV_MAX, where)
    _int(p, "dv", 0, DU_DV_MAX, where)
    _int(p, "vth", 0, VTH_MAX, where)


def _validate_lif(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    regimes = meta.get("regimes")
    if not isinstance(regimes, list) or not regimes:
        raise ExchangeError("lif bundle: 'regimes' must be a non-empty list")
    for i, r in enumerate(regimes):
        _validate_lif_params(r, f"lif regime {i}")
    a_in = _arr(arrays, "a_in", None, -(1 << 31), (1 << 31) - 1)
    if a_in.ndim != 3 or a_in.shape[0] != len(regimes):
        raise ExchangeError(f"array 'a_in' must be [regimes={len(regimes)}, T, n], got {list(a_in.shape)}")
    R, _, n = a_in.shape
    _arr(arrays, "bias_mant", (R, n), *BIAS_MANT, dtype="int16")
    _arr(arrays, "bias_exp", (R, n), *BIAS_EXP, dtype="int16")


def _validate_dense(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    regimes = meta.get("regimes")
    if not isinstance(regimes, list) or not regimes:
        raise ExchangeError("dense bundle: 'regimes' must be a non-empty list")
    for i, r in enumerate(regimes):
        _int(r, "weight_exp", *WEIGHT_EXP, f"dense regime {i}")
        nmb = _int(r, "num_message_bits", *MESSAGE_BITS, f"dense regime {i}")
        w = _arr(arrays, f"weights.{i}", None, *WEIGHTS)
        if w.ndim != 2 or (w % 2).any():
            raise ExchangeError(f"array 'weights.{i}' must be a 2-D matrix of even values (2 * w_int)")
        s = _arr(arrays, f"s_in.{i}", None, *((0, 1) if nmb == 0 else GRADED))
        if s.ndim != 2 or s.shape[1] != w.shape[1]:
            raise ExchangeError(f"array 's_in.{i}' must be [T, n_in={w.shape[1]}], got {list(s.shape)}")


def _validate_network(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    layers = meta.get("layers")
    T = _int(meta, "T", 1, 1 << 20, "network")
    if not isinstance(layers, list) or len(layers) < 1 or len(layers) % 2 != 1:
        raise ExchangeError("network bundle: 'layers' must alternate dense, lif, ..., dense (an odd count)")
    n_prev = _int(meta, "n_in", 1, 1 << 24, "network")
    names = set()
    for i, layer in enumerate(layers):
        want = "dense" if i % 2 == 0 else "lif"
        name = layer.get("name") if isinstance(layer, dict) else None
        if not isinstance(name, str) or not name or name in names or layer.get("kind") != want:
            raise ExchangeError(f"network layer {i}: expected a {want!r} layer with a new, non-empty name, got {layer!r}")
        names.add(name)
        if want == "dense":
            _int(layer, "weight_exp", *WEIGHT_EXP, f"layer {name!r}")
            nmb = _int(layer, "num_message_bits", *MESSAGE_BITS, f"layer {name!r}")
            if (i > 0) != (nmb == 0):
                raise ExchangeError(f"layer {name!r}: num_message_bits {nmb}; the first Dense takes graded input "
                                    "(> 0), the others binary spikes (0)")
            w = _arr(arrays, f"weights.{name}", None, *WEIGHTS)
            if w.ndim != 2 or w.shape[1] != n_prev or (w % 2).any():
                raise ExchangeError(f"array 'weights.{name}' must be [n_out, {n_prev}] of even values, "
                                    f"got {list(w.shape)}")
            n_prev = w.shape[0]
        else:
            _validate_lif_params(layer, f"layer {name!r}")
            _arr(arrays, f"bias_mant.{name}", (n_prev,), *BIAS_MANT, dtype="int16")
            _arr(arrays, f"bias_exp.{name}", (n_prev,), *BIAS_EXP, dtype="int16")
    _arr(arrays, "readout_bias", (n_prev,), -(1 << 31), (1 << 31) - 1, dtype="int64")
    if "inputs" in arrays:
        x = _arr(arrays, "inputs", None, *GRADED)
        if x.ndim != 3 or x.shape[1:] != (T, meta["n_in"]):
            raise ExchangeError(f"array 'inputs' must be [samples, T={T}, n_in={meta['n_in']}], got {list(x.shape)}")


def network_delays(meta: dict[str, Any]) -> dict[str, int]:
    """Where Lava puts sample ``i``, step ``k`` of a network bundle: at index ``i * T + k + d`` of the
    raw per-step arrays, ``d`` = this layer's value (1-based index of the Dense that feeds it).

    Lava time steps start at 1 and the RingBuffer sends input column ``t - 1`` at step ``t``. Every
    Dense sends at step ``t`` what it accumulated at step ``t - 1`` (``PyDenseModelBitAcc``:
    ``a_out.send(a_buff)`` before the new sum), and a LIF or Extractor receives what is sent in
    the same step: the j-th LIF processes sample i, step k at Lava step ``i T + k + 1 + j``, the
    readout Dense (the L-th) sends it at step ``i T + k + 1 + L``; an Extractor stores step t at
    index ``t - 1``. ``"a_out"``: the readout.
    """
    out: dict[str, int] = {}
    d = 0
    for layer in meta["layers"]:
        if layer["kind"] == "dense":
            d += 1
        else:
            out[layer["name"]] = d
    out["a_out"] = d
    return out


def expected_result(request: Bundle) -> dict[str, tuple[tuple[int, ...], bool]]:
    """What the result of ``request`` holds: array name -> (shape, binary); each int32 (the module doc's
    ``Result:`` of each kind: lif ``s`` / ``u`` / ``v [R, T, n]``; dense ``a_out.R [T + 1, n_out]``; network
    ``spikes.NAME`` and ``a_out``, ``[N T + L, n]``)."""
    a, m = request.arrays, request.meta
    if request.kind == "lif":
        shape = tuple(a["a_in"].shape)
        return {"s": (shape, True), "u": (shape, False), "v": (shape, False)}
    if request.kind == "dense":
        return {f"a_out.{r}": ((a[f"s_in.{r}"].shape[0] + 1, a[f"weights.{r}"].shape[0]), False)
                for r in range(len(m["regimes"]))}
    if request.kind == "network":
        if "inputs" not in a:
            raise ExchangeError("network bundle has no 'inputs': nothing to run (export it with samples)")
        delays = network_delays(m)
        steps = a["inputs"].shape[0] * int(m["T"]) + delays["a_out"]
        out = {f"spikes.{ly['name']}": ((steps, a[f"bias_mant.{ly['name']}"].shape[0]), True)
               for ly in m["layers"] if ly["kind"] == "lif"}
        out["a_out"] = ((steps, a["readout_bias"].shape[0]), False)
        return out
    raise ExchangeError(f"cannot run a {request.kind!r} bundle; valid: lif, dense, network")


def check_result(request: Bundle, result: Bundle) -> None:
    """The result bundle against the request it answers: its kind, every array the request asks for (no
    more), each int32 of the shape the request fixes (how many steps, how many neurons), spikes 0 or 1.
    One :class:`ExchangeError` line otherwise (a runner that wrote a valid bundle of something else)."""
    if result.kind != "result" or result.meta.get("request_kind") != request.kind:
        raise ExchangeError(f"the Lava result answers a {result.meta.get('request_kind')!r} request, not this "
                            f"{request.kind!r} one")
    want = expected_result(request)
    missing, extra = sorted(set(want) - set(result.arrays)), sorted(set(result.arrays) - set(want))
    if missing or extra:
        raise ExchangeError(f"the Lava result holds {sorted(result.arrays)}; the request asks for {sorted(want)}"
                            + (f" (missing: {', '.join(missing)})" if missing else f" (not asked for: {', '.join(extra)})"))
    for name, (shape, binary) in want.items():
        try:
            _arr(result.arrays, name, shape, *((0, 1) if binary else (None, None)))
        except ExchangeError as exc:
            raise ExchangeError(f"the Lava result's {exc}".replace(" (the Lava register it goes to)", "")) from None


# ------------------------------------------------------------------ Lava side (Python 3.10)
NO_LAVA_EXIT = 3
"""The runner's exit status when its interpreter has no lava-nc (2: a bad bundle; 1: Lava itself failed)."""

def _run_cfg():
    from lava.magma.core.run_configs import Loihi2SimCfg
    from lava.proc.io.extractor import Extractor, PyLoihiExtractorModel

    # the Extractor has a Loihi-protocol and an async model and neither is tagged: name the first
    return Loihi2SimCfg(select_tag="fixed_pt", exception_proc_model_map={Extractor: PyLoihiExtractorModel})


def _receive(tap, steps: int) -> np.ndarray:
    rows = [tap.receive() for _ in range(steps)]
    out = np.stack(rows) if rows else np.zeros((0,))
    if not np.array_equal(out, np.round(out)):  # float64 carries every 24/32-bit integer exactly
        raise RuntimeError("internal: a Lava read-out is not integral")
    return out.astype(np.int32)


def run_lif(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each regime: ``RingBuffer(a_in) -> LIF`` (``PyLifModelBitAcc``); spikes through an ``Extractor``,
    ``u`` and ``v`` through ``VarWire`` taps read after every step. One runtime per regime, one
    interpreter for all."""
    from lava.magma.core.run_conditions import RunSteps
    from lava.proc.io.extractor import Extractor, VarWire
    from lava.proc.io.source import RingBuffer
    from lava.proc.lif.process import LIF

    a_in = arrays["a_in"]
    R, T, n = a_in.shape
    out = {k: np.zeros((R, T, n), np.int32) for k in ("s", "u", "v")}
    for r, p in enumerate(meta["regimes"]):
        src = RingBuffer(data=np.ascontiguousarray(a_in[r].T))  # [n, T]: the last axis is time
        lif = LIF(shape=(n,), du=p["du"], dv=p["dv"], vth=p["vth"], bias_mant=arrays["bias_mant"][r].astype(np.int32),
                  bias_exp=arrays["bias_exp"][r].astype(np.int32))
        src.s_out.connect(lif.a_in)
        spikes = Extractor(shape=(n,), buffer_size=T)
        lif.s_out.connect(spikes.in_port)
        taps = {}
        for var in ("u", "v"):
            taps[var] = VarWire(buffer_size=T)
            taps[var].connect_var(getattr(lif, var))
        try:
            lif.run(condition=RunSteps(num_steps=T), run_cfg=_run_cfg())
            out["s"][r] = _receive(spikes, T)
            for var, tap in taps.items():
                out[var][r] = _receive(tap, T)
        finally:
            lif.stop()
    return out


def run_dense(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each regime: ``RingBuffer(s_in) -> Dense`` (``PyDenseModelBitAcc``, sign mode mixed, 8-bit
    weights) for T + 1 steps; ``a_out`` through an ``Extractor``."""
    from lava.magma.core.run_conditions import RunSteps
    from lava.proc.dense.process import Dense
    from lava.proc.io.extractor import Extractor
    from lava.proc.io.source import RingBuffer
    from lava.utils.weightutils import SignMode

    out = {}
    for r, p in enumerate(meta["regimes"]):
        w, s_in = arrays[f"weights.{r}"], arrays[f"s_in.{r}"]
        T = s_in.shape[0]
        data = np.zeros((s_in.shape[1], T + 1), np.int32)
        data[:, :T] = s_in.T
        src = RingBuffer(data=data)
        dense = Dense(weights=w, weight_exp=p["weight_exp"], num_message_bits=p["num_message_bits"],
                      num_weight_bits=8, sign_mode=SignMode.MIXED)
        src.s_out.connect(dense.s_in)
        tap = Extractor(shape=(w.shape[0],), buffer_size=T + 1)
        dense.a_out.connect(tap.in_port)
        try:
            dense.run(condition=RunSteps(num_steps=T + 1), run_cfg=_run_cfg())
            out[f"a_out.{r}"] = _receive(tap, T + 1)
        finally:
            dense.stop()
    return out


def build_network(meta: dict[str, Any], arrays: dict[str, np.ndarray], data: np.ndarray):
    """Lava processes of a network bundle fed by ``data [n_in, steps]``: ``(source, {LIF name: process},
    readout Dense)``. Each neuron layer is a ``LIFReset`` (``PyLifResetModelBitAcc``: the LIF's
    dynamics, with u and v zeroed every ``T`` steps) whose offset is its pipeline delay, so that
    samples streamed back to back start from rest, as szo runs each sample."""
    from lava.proc.dense.process import Dense
    from lava.proc.io.source import RingBuffer
    from lava.proc.lif.process import LIFReset
    from lava.utils.weightutils import SignMode

    T = meta["T"]
    delays = network_delays(meta)
    src = RingBuffer(data=data)
    port = src.s_out
    lifs, dense = {}, None
    for layer in meta["layers"]:
        name = layer["name"]
        if layer["kind"] == "dense":
            dense = Dense(weights=arrays[f"weights.{name}"], weight_exp=layer["weight_exp"],
                          num_message_bits=layer["num_message_bits"], num_weight_bits=8, sign_mode=SignMode.MIXED,
                          name=name)
            port.connect(dense.s_in)
            port = dense.a_out
        else:
            n = arrays[f"bias_mant.{name}"].shape[0]
            # first step of sample i at Lava step i T + 1 + delay: reset there (time_step % T == offset)
            lif = LIFReset(shape=(n,), du=layer["du"], dv=layer["dv"], vth=layer["vth"],
                           bias_mant=arrays[f"bias_mant.{name}"].astype(np.int32),
                           bias_exp=arrays[f"bias_exp.{name}"].astype(np.int32),
                           reset_interval=T, reset_offset=(1 + delays[name]) % T, name=name)
            port.connect(lif.a_in)
            port = lif.s_out
            lifs[name] = lif
    return src, lifs, dense


def run_network(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """All samples of ``inputs`` back to back through :func:`build_network`, every LIF layer's spikes and
    the readout Dense's ``a_out`` through ``Extractor`` s; raw per-step arrays (see :func:`network_delays`)."""
    from lava.magma.core.run_conditions import RunSteps
    from lava.proc.io.extractor import Extractor

    if "inputs" not in arrays:
        raise ExchangeError("network bundle has no 'inputs': nothing to run (export it with samples)")
    x = arrays["inputs"]
    N, T, n_in = x.shape
    delays = network_delays(meta)
    steps = N * T + delays["a_out"]  # the last sample's readout leaves the pipeline L steps late
    data = np.zeros((n_in, steps), np.int32)
    data[:, : N * T] = x.reshape(N * T, n_in).T
    src, lifs, readout = build_network(meta, arrays, data)
    taps = {}
    for name, lif in lifs.items():
        taps[f"spikes.{name}"] = Extractor(shape=lif.s_out.shape, buffer_size=steps)
        lif.s_out.connect(taps[f"spikes.{name}"].in_port)
    taps["a_out"] = Extractor(shape=readout.a_out.shape, buffer_size=steps)
    readout.a_out.connect(taps["a_out"].in_port)
    try:
        src.run(condition=RunSteps(num_steps=steps), run_cfg=_run_cfg())
        return {k: _receive(tap, steps) for k, tap in taps.items()}
    finally:
        src.stop()


RUNNERS = {"lif": run_lif, "dense": run_dense, "network": run_network}


def main(argv: list[str] | None = None) -> int:
    """``runner.py IN_DIR OUT_DIR``: run a request bundle in Lava, write the result bundle."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: runner.py IN_DIR OUT_DIR (a szo-lava-exchange request bundle; the result is written "
              "to OUT_DIR)", file=sys.stderr)
        return 2
    try:
        b = read_bundle(args[0])
        kind = b.kind
        if kind not in RUNNERS:
            raise ExchangeError(f"cannot run a {kind!r} bundle; valid: {sorted(RUNNERS)}")
        t0 = time.perf_counter()
        result = RUNNERS[kind](b.meta, b.arrays)
        seconds = time.perf_counter() - t0
    except ExchangeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "lava":
            raise
        print(f"error: this interpreter ({sys.executable}, Python {sys.version.split()[0]}) has no lava-nc "
              f"({exc}); `make lava` builds .venv-lava with it", file=sys.stderr)
        return NO_LAVA_EXIT
    write_bundle(args[1], "result", {"request_kind": kind, "seconds": round(seconds, 3),
                                     "lava_nc": metadata.version("lava-nc"),
                                     "python": ".".join(map(str, sys.version_info[:3]))}, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
