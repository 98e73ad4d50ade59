"""Intel Lava as the oracle of the ``loihi`` arithmetic: export a fixed-point network to Lava and
check a trained one against Lava's own runtime.

Lava (lava-nc 0.10.0, Python 3.10) is a second interpreter, ``.venv-lava`` (``make lava``), that
szo drives through the exchange bundles of :mod:`szo.hw.lava.runner` and a subprocess:

* :func:`lava_python` finds it (``$SZO_LAVA_PYTHON``, else ``.venv-lava`` in the working
  directory or beside the szo source tree); :func:`run_lava` runs one request bundle in it;
* :func:`export_network` maps a ``loihi`` :class:`~szo.hw.convert.FixedPointNetwork` onto Lava
  processes: every synapse becomes one ``Dense`` (8-bit mixed-sign weights ``2 * w_int``, weight
  exponent ``e - frac + 5``), a convolution as the Dense of its Toeplitz matrix and a sum pool
  folded into the synapse after it (both exact: the Dense computes the same integer sums), every
  LIF one ``LIF`` (``lava_params()``, bias as mantissa / exponent); what Lava's bit-accurate
  processes cannot express is refused in one line naming the layer;
* :func:`lava_check` runs N test samples through Lava and through szo's simulator and compares
  every spike of every neuron layer, every readout value and every predicted label.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from spikingjelly.activation_based import neuron as sj_neuron
from torch import nn

import szo
from szo.exits import ExternalError
from szo.hw.convert import FixedPointNetwork, pool_window
from szo.hw.fixed import A_IN_SHIFT, ACT_SHIFT, STATE_SHIFT
from szo.hw.lava import runner as lava_runner
from szo.hw.lava.runner import Bundle, ExchangeError, check_result, read_bundle
from szo.io import atomic_write_json, sha256_file

__all__ = ["CHECK_FILE", "LAVA_PYTHON_ENV", "LAVA_VENV", "MAX_DENSE_WEIGHTS", "RUNNER_TIMEOUT_S", "ExchangeError",
           "LavaExportError",
           "check_int32_bound", "check_summary", "export_network", "lava_python", "read_check", "require_python",
           "run_lava", "weights_file", "write_check"]

LAVA_PYTHON_ENV = "SZO_LAVA_PYTHON"
"""Environment variable naming a Python interpreter that has lava-nc (overrides ``.venv-lava``)."""
LAVA_VENV = ".venv-lava"
CHECK_FILE = "lava_check.json"
"""Written into a run directory by ``szo hw lava-check``; ``szo hw-report`` shows it."""
MAX_DENSE_WEIGHTS = 1 << 24
"""Largest Dense (n_out x n_in) the export writes: a convolution's Toeplitz matrix grows with the
square of the feature map (digits conv2: 1024 x 1024 = 2**20)."""
RUNNER_TIMEOUT_S = 600.0
"""How long :func:`run_lava` lets the Lava runner work by default (``szo hw lava-check --timeout-s``)."""
LAVA_WEIGHT_EXP = (-8, 7)
"""Loihi's hardware ``wgtExp`` range; Lava's Python model shifts by any exponent (noted, not refused)."""


class LavaExportError(ValueError):
    """A network (layer) that Lava's bit-accurate processes cannot run as szo does (one line)."""


# ------------------------------------------------------------------------- interpreter
def lava_python() -> Path | None:
    """The interpreter that has lava-nc: ``$SZO_LAVA_PYTHON``, else ``.venv-lava/bin/python`` in the
    working directory or beside the szo source tree (an editable install); None if there is none."""
    env = os.environ.get(LAVA_PYTHON_ENV)
    if env:
        p = Path(env)
        if not p.is_file():
            raise ValueError(f"{LAVA_PYTHON_ENV}={env} is not a file; point it at a Python 3.10 interpreter that has "
                             "lava-nc (make lava builds .venv-lava/bin/python)")
        return p
    for root in (Path.cwd(), Path(szo.__file__).resolve().parents[1]):
        p = root / LAVA_VENV / "bin" / "python"
        if p.is_file():
            return p
    return None


def require_python(python: str | os.PathLike | None) -> Path:
    p = Path(python) if python is not None else lava_python()
    if p is None:
        raise ValueError(f"no Lava interpreter: run `make lava` (builds {LAVA_VENV} with lava-nc on Python 3.10) "
                         f"or set {LAVA_PYTHON_ENV}")
    return p


def run_lava(request: str | os.PathLike, out: str | os.PathLike, *, python: str | os.PathLike | None = None,
             timeout_s: float = RUNNER_TIMEOUT_S) -> Bundle:
    """Run a request bundle in the Lava interpreter (``szo/hw/lava/runner.py IN OUT``); returns the result
    bundle, checked against the request (``runner.check_result``: every array it asks for, of the shape it
    fixes). The runner leads its own process group (Lava's runtime starts worker processes); whatever
    ends the wait -- ``timeout_s`` passing, Ctrl-C, any error -- kills that group, so nothing is left
    running. A runner that cannot start, fails, is killed or times out raises
    :class:`szo.exits.ExternalError` (one line: the ``szo`` CLI's exit status 5)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise ValueError(f"the Lava runner's timeout must be a positive number of seconds, got {timeout_s!r}")
    exe = require_python(python)
    # -I: isolated mode, so the script's own directory (szo/hw/lava) is not on sys.path and PYTHON* variables are ignored
    cmd = [str(exe), "-I", str(Path(lava_runner.__file__)), str(request), str(out)]
    # the runner's output goes to files, not pipes: Lava's worker processes inherit them, and a pipe they
    # hold open would keep a wait for the runner's end going after the runner itself died
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        try:
            proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, text=True, start_new_session=True)
        except OSError as exc:  # not executable, not a program, gone
            raise ExternalError(f"cannot start the Lava interpreter {exe}: {exc.strerror or exc}; point "
                                f"{LAVA_PYTHON_ENV} (or --lava-python) at an executable Python 3.10 with lava-nc (make "
                                f"lava builds {LAVA_VENV}/bin/python)") from None
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            raise ExternalError(f"Lava runner ({exe}) did not finish within {timeout_s:g} s; killed (raise the limit "
                                "with --timeout-s)") from None
        except BaseException:  # Ctrl-C (the runner is in its own session: the terminal's SIGINT never reaches it)
            _stop(proc)
            raise
        _stop(proc)  # whatever the runner's end left of Lava's processes (none after a clean stop)
        stdout.seek(0)
        stderr.seek(0)
        output = stderr.read() or stdout.read()
    if proc.returncode < 0:
        sig = signal.Signals(-proc.returncode).name if -proc.returncode in signal.valid_signals() else -proc.returncode
        raise ExternalError(f"Lava runner ({exe}) was killed by signal {sig} before it wrote a result; run it again")
    if proc.returncode != 0:
        lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
        last = lines[-1].removeprefix("error: ") if lines else "no output"
        raise ExternalError(f"Lava runner failed ({exe}, exit {proc.returncode}): {last}")
    result = read_bundle(out, "result")
    check_result(read_bundle(request), result)
    return result


def _stop(proc: subprocess.Popen) -> None:
    """Kill the runner's process group (the runner and the processes Lava's runtime started) and reap the runner."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already
    proc.wait()


# ------------------------------------------------------------------------------- export
def _chain(net: FixedPointNetwork) -> list[tuple[str, nn.Module]]:
    """The network's layers in order, checked to be one chain (no residual, no fan-out)."""
    chain, prev = [], None
    for node in net.graph.nodes:
        if node.op == "placeholder":
            prev = node
            continue
        if node.op == "output":
            if node.args[0] is not prev:
                raise LavaExportError("the network's output is not its last layer; the export needs one chain")
            break
        if node.op != "call_module":
            raise LavaExportError(f"layer {node.name!r} (residual '+'): every Lava Dense delivers one step late, so a "
                                  "shortcut needs a matching synaptic delay; the export handles chains only")
        if node.args[0] is not prev or len(node.users) != 1:
            raise LavaExportError(f"layer {node.target!r} is not on a single chain (branching graph); the export handles "
                                  "chains only")
        chain.append((str(node.target), net.get_submodule(str(node.target))))
        prev = node
    return chain


def _dense_matrix(path: str, pending: list[tuple[str, nn.Module]], syn: nn.Module, w_int: torch.Tensor,
                  in_shape: tuple[int, ...]) -> tuple[np.ndarray, tuple[int, ...]]:
    """The integer matrix ``[n_out, n_in]`` of ``pending`` pools / flattens followed by the synapse,
    on a population of shape ``in_shape``: the layers applied to every basis vector (exact in
    float64: entries are sums of at most a window of 8-bit weights)."""
    n_in = int(np.prod(in_shape))
    y = torch.eye(n_in, dtype=torch.float64).view(n_in, *in_shape)
    for ppath, m in pending:
        if isinstance(m, nn.Flatten):
            y = y.flatten(1)
        elif isinstance(m, (nn.AvgPool2d, nn.AdaptiveAvgPool2d)):
            if y.dim() != 4:
                raise LavaExportError(f"layer {ppath!r} ({type(m).__name__}): pooling needs a [C, H, W] population")
            k, s, p = pool_window(ppath, m, tuple(y.shape[-2:]))
            y = F.avg_pool2d(y, k, s, p, divisor_override=1)  # the integer sum pool szo computes
    w = w_int.to(torch.float64)
    if isinstance(syn, nn.Conv2d):
        if y.dim() != 4:
            raise LavaExportError(f"layer {path!r} (Conv2d) needs a [C, H, W] input population")
        y = F.conv2d(y, w, None, syn.stride, syn.padding, syn.dilation, syn.groups)
    else:
        if y.dim() != 2:
            y = y.flatten(1)
        y = y @ w.t()
    out_shape = tuple(y.shape[1:])
    n_out = int(np.prod(out_shape))
    if n_out * n_in > MAX_DENSE_WEIGHTS:
        raise LavaExportError(f"layer {path!r} ({type(syn).__name__}) would be a Lava Dense of {n_out} x {n_in} weights "
                              f"(> {MAX_DENSE_WEIGHTS}): Lava's Conv model is not bit-accurate and the Toeplitz Dense "
                              "of this layer is too large")
    mat = y.reshape(n_in, n_out).t().contiguous()
    lo, hi = int(mat.min()), int(mat.max())
    if lo < -128 or hi > 127:
        raise LavaExportError(f"layer {path!r}: the pooling before it adds several weights into one synapse "
                              f"(range [{lo}, {hi}]), beyond Lava's 8-bit weights; use non-overlapping pooling windows")
    return mat.round().to(torch.int64).numpy(), out_shape


def export_network(net: FixedPointNetwork, in_shape: tuple[int, ...]) -> tuple[dict[str, Any], dict[str, np.ndarray],
                                                                             dict[str, str]]:
    """A ``loihi`` network as a Lava ``network`` bundle: ``(meta, arrays, lava_name -> szo path)``.

    ``in_shape``: one time step of one sample (``[C, H, W]``). Every LIF must reset to zero (a
    standard Lava LIF); the network must be one chain ending in a readout synapse.
    """
    if net.arithmetic != "loihi":
        raise ValueError(f"export to Lava needs the 'loihi' arithmetic (bit-exact with Lava), got {net.arithmetic!r}")
    if net.widths.weight_bits > 8:
        raise LavaExportError(f"weight_bits = {net.widths.weight_bits}: Lava's Dense holds 8-bit weights")
    if not net.scales_known:
        with torch.no_grad():
            net(torch.zeros(1, *in_shape))  # an AdaptiveAvgPool2d fixes its window at the first forward
    q = net.quantized_layers()
    layers: list[dict[str, Any]] = []
    arrays: dict[str, np.ndarray] = {}
    names: dict[str, str] = {}
    pending: list[tuple[str, nn.Module]] = []
    shape, kind, frac = tuple(in_shape), "input", ACT_SHIFT  # the population the next synapse reads
    last_bias: np.ndarray | None = None
    for path, m in _chain(net):
        tname = type(m).__name__
        if isinstance(m, (nn.BatchNorm2d, nn.Identity, nn.Dropout)):
            continue  # BN is folded into the synapse before it; the others do nothing at inference
        if isinstance(m, (nn.Flatten, nn.AvgPool2d, nn.AdaptiveAvgPool2d)):
            pending.append((path, m))
            continue
        if isinstance(m, nn.MaxPool2d):
            raise LavaExportError(f"layer {path!r} (MaxPool2d): szo runs it as an OR of spikes within the same step; "
                                  "in Lava it would need an extra neuron stage (one more step of delay): not exported")
        name = path.replace(".", "_")
        names[name] = path
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            if kind == "current":
                raise LavaExportError(f"layer {path!r} ({tname}) follows another synapse without a neuron between them")
            syn = q[path]
            mat, out_shape = _dense_matrix(path, pending, m, syn["w_int"], shape)
            pending = []
            layers.append({"name": name, "kind": "dense", "n_in": int(mat.shape[1]), "n_out": int(mat.shape[0]),
                           # szo: a_out = floor(acc 2**(e - frac + 6)); Lava shifts (2 w_int) x, hence e - frac + 5
                           "weight_exp": int(syn["exp"] - frac + STATE_SHIFT - A_IN_SHIFT - 1),
                           "num_message_bits": 16 if kind == "input" else 0})
            arrays[f"weights.{name}"] = (2 * mat).astype(np.int32)  # Lava's 8-bit mixed sign: LSB truncated
            positions = int(np.prod(out_shape[1:])) if len(out_shape) > 1 else 1
            if syn["bias_int"] is None:
                mant = np.zeros(mat.shape[0], np.int64)
                bexp = 0
            else:  # per output channel, repeated over the positions of a feature map (C-major, as torch flattens)
                mant = np.repeat((syn["bias_int"] >> syn["bias_exp"]).numpy(), positions)
                bexp = int(syn["bias_exp"])
            last_bias = np.stack([mant, np.full_like(mant, bexp)])
            shape, kind = out_shape, "current"
        elif isinstance(m, sj_neuron.LIFNode):
            if kind != "current" or last_bias is None or pending:
                raise LavaExportError(f"layer {path!r} (LIFNode) needs a synapse right before it")
            n = net.neurons[path]
            if n.reset != "zero":
                raise LavaExportError(f"layer {path!r} resets by subtraction (soft reset); Lava's LIF resets to 0: train "
                                      "with --set hw.reset=zero, or deploy it with a hard reset (--reset zero)")
            layers.append({"name": name, "kind": "lif", **n.lava_params()})
            arrays[f"bias_mant.{name}"] = last_bias[0].astype(np.int16)
            arrays[f"bias_exp.{name}"] = last_bias[1].astype(np.int16)
            last_bias, kind, frac = None, "spikes", 0
        else:
            raise LavaExportError(f"layer {path!r} ({tname}) has no Lava counterpart in this export")
    if kind != "current" or pending or last_bias is None:
        raise LavaExportError("the network does not end in a readout synapse (Conv2d/Linear after the last neuron "
                              "layer): nothing for the host to read")
    arrays["readout_bias"] = (last_bias[0] << last_bias[1]).astype(np.int64)  # state units, added by the host
    meta = {"T": int(net.T), "n_in": int(np.prod(in_shape)), "in_shape": list(map(int, in_shape)), "layers": layers,
            "source": {"model": net.model_name, "arithmetic": net.arithmetic,
                       "weight_bits": int(net.widths.weight_bits)}}
    for layer in layers:  # one more line of the contract: exponents Loihi's wgtExp register cannot hold
        if layer["kind"] == "dense" and not LAVA_WEIGHT_EXP[0] <= layer["weight_exp"] <= LAVA_WEIGHT_EXP[1]:
            layer["beyond_loihi_wgtexp"] = True
    return meta, arrays, names


def check_int32_bound(meta: dict[str, Any], arrays: dict[str, np.ndarray], max_input: int) -> None:
    """Lava's Dense accumulates in int32 (``weights.dot(s_in)``): refuse where a sum could wrap."""
    for i, layer in enumerate(meta["layers"]):
        if layer["kind"] != "dense":
            continue
        w = arrays[f"weights.{layer['name']}"].astype(np.int64)
        bound = int(np.abs(w).sum(1).max()) * (max_input if i == 0 else 1)
        if bound >= 1 << 31:
            raise LavaExportError(f"layer {layer['name']!r}: a synaptic sum can reach {bound} >= 2**31 and would wrap "
                                  "in Lava's int32 accumulator")


# ----------------------------------------------------------------------------- check file
def write_check(report: dict[str, Any], run_dir: str | os.PathLike) -> Path:
    path = Path(run_dir) / CHECK_FILE
    atomic_write_json(path, report)
    return path


def weights_file(run_dir: str | os.PathLike) -> Path | None:
    """The weights a run directory's model is loaded from (``szo.build.load_run_model``'s order)."""
    for p in (Path(run_dir) / "model.safetensors", Path(run_dir) / "checkpoints" / "last.pt"):
        if p.is_file():
            return p
    return None


def read_check(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The ``lava_check.json`` of a run directory, or None; ``"stale"`` is set (with the reason) when the
    run's weights file is no longer the one that was checked. A side file that cannot be read (not
    JSON, truncated, not a check report) is one warning line on stderr and None: whoever reads it
    (``szo hw-report``) keeps the rest of its measurement."""
    p = Path(run_dir) / CHECK_FILE
    if not p.is_file():
        return None
    try:
        check = json.loads(p.read_text(encoding="utf-8"))
        why = _not_a_check(check)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if why is not None:
        sys.stderr.write(f"warning: {p} is not a readable szo hw lava-check report ({why}); left out: run szo hw "
                         "lava-check again\n")
        sys.stderr.flush()
        return None
    w = weights_file(run_dir)
    digest = sha256_file(w) if w is not None else None
    if digest != check.get("weights_sha256"):
        check["stale"] = f"{w.name if w else 'no weights'} sha256 {str(digest)[:12]}, checked {str(check.get('weights_sha256'))[:12]}"
    return check


_COMPARED = {"elements": int, "equal": int, "delay_steps": int}
_REPORT = {"lava_nc": str, "python": str, "samples": int, "data": str, "T": int, "lava_steps": int, "layers": dict,
           "readout": dict, "labels_agree": int, "bit_exact": bool}


def _not_a_check(check: Any) -> str | None:
    """Why ``check`` is not a lava-check report :func:`check_summary` can show (None: it is one)."""
    if not isinstance(check, dict):
        return f"a JSON {type(check).__name__}, not an object"
    for key, kind in _REPORT.items():
        if not isinstance(check.get(key), kind) or (kind is int and isinstance(check.get(key), bool)):
            return f"{key!r} is {check.get(key)!r}, not a {kind.__name__}"
    for key in ("accuracy_szo", "accuracy_lava"):
        if check.get(key) is not None and not isinstance(check.get(key), (int, float)):
            return f"{key!r} is {check.get(key)!r}, not a number"
    for path, v in {**check["layers"], **check["readout"]}.items():
        fields = {**_COMPARED, **({} if path in check["readout"] else {"spikes_szo": int, "spikes_lava": int})}
        if not isinstance(v, dict) or any(not isinstance(v.get(k), t) for k, t in fields.items()):
            return f"layer {path!r} lacks {', '.join(fields)}"
        if v.get("first_diff") is not None and not isinstance(v["first_diff"], list):
            return f"layer {path!r}: first_diff is {v['first_diff']!r}"
    return None


def check_summary(rep: dict[str, Any]) -> list[str]:
    """Human-readable lines of a check report."""
    lines = [f"Lava {rep['lava_nc']} (Python {rep['python']}) vs szo 'loihi' simulator, {rep['samples']} "
             f"{rep['data']} samples x T = {rep['T']} ({rep['lava_steps']} Lava steps, back to back):"]
    for path, v in {**rep["layers"], **rep["readout"]}.items():
        what = "readout a_out" if path in rep["readout"] else f"spikes ({v['spikes_szo']} szo, {v['spikes_lava']} Lava)"
        diff = "" if v["first_diff"] is None else f"; first difference at [sample, step, neuron] {v['first_diff']}"
        lines.append(f"  {path}: {what}: {v['equal']}/{v['elements']} equal"
                     f" (Lava {v['delay_steps']} step{'' if v['delay_steps'] == 1 else 's'} late, aligned){diff}")
    acc = ""
    if rep["accuracy_szo"] is not None:
        acc = f"; test accuracy szo {100 * rep['accuracy_szo']:.2f}%, Lava {100 * rep['accuracy_lava']:.2f}%"
    lines.append(f"  predicted labels agree on {rep['labels_agree']}/{rep['samples']}{acc}")
    lines.append("  bit-exact: " + ("yes" if rep["bit_exact"] else "NO"))
    return lines
