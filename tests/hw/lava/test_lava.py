"""Intel Lava itself as the oracle of the ``loihi`` arithmetic (szo.hw.lava: runner / bridge / check).

The exchange format, the export's mapping (checked against the numpy transcription of
tests/hw/lava_oracle.py) and its refusals run everywhere. The tests marked ``lava`` run Lava's
own runtime (lava-nc 0.10.0 in ``.venv-lava``, ``make lava``; or ``$SZO_LAVA_PYTHON``) in one
subprocess per test, many regimes per subprocess, and are skipped with the reason where it is
missing.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch
from spikingjelly.activation_based import layer

from szo.cli import main
from szo.hw import to_fixed
from szo.hw.fixed import A_IN_SHIFT, ACT_SHIFT
from szo.hw.lava.bridge import (
    CHECK_FILE,
    LAVA_PYTHON_ENV,
    LavaExportError,
    check_summary,
    export_network,
    lava_python,
    read_check,
    require_python,
    run_lava,
    write_check,
)
from szo.hw.lava.check import lava_check
from szo.hw.lava.runner import ExchangeError, network_delays, read_bundle, write_bundle
from szo.hw.neuron import LoihiCubaLIF
from szo.models import SpikingModel, create, make_neuron
from tests.hw.lava_oracle import LavaDense, LavaLIF

try:
    LAVA, _WHY = lava_python(), f"no Lava interpreter: `make lava` builds .venv-lava (lava-nc 0.10.0 on Python 3.10), " \
                                f"or set {LAVA_PYTHON_ENV}"
except ValueError as exc:  # $SZO_LAVA_PYTHON names no file
    LAVA, _WHY = None, str(exc)
needs_lava = pytest.mark.skipif(LAVA is None, reason=_WHY)
T_LONG = 1000


# ------------------------------------------------------------------------------ format
def _lif_bundle(tmp_path, **over):
    arrays = {"a_in": np.zeros((1, 3, 2), np.int32), "bias_mant": np.zeros((1, 2), np.int16),
              "bias_exp": np.zeros((1, 2), np.int16)}
    arrays.update(over)
    return write_bundle(tmp_path / "b", "lif", {"regimes": [{"du": 4095, "dv": 0, "vth": 64}]}, arrays)


def test_bundle_round_trip_and_every_check_on_load(tmp_path):
    a = np.arange(6, dtype=np.int32).reshape(1, 3, 2)
    p = _lif_bundle(tmp_path, a_in=a)
    b = read_bundle(p, "lif")
    assert b.kind == "lif" and b.meta["regimes"][0]["du"] == 4095 and np.array_equal(b.arrays["a_in"], a)
    with pytest.raises(ExchangeError, match="a 'lif' bundle, expected 'network'"):
        read_bundle(p, "network")
    manifest = json.loads((p / "exchange.json").read_text())
    (p / "exchange.json").write_text(json.dumps({**manifest, "version": 2}))
    with pytest.raises(ExchangeError, match="version 2; this reader reads version 1 only"):
        read_bundle(p)
    (p / "exchange.json").write_text(json.dumps(manifest))
    data = bytearray((p / "arrays.npz").read_bytes())
    data[-30] ^= 1
    (p / "arrays.npz").write_bytes(bytes(data))
    with pytest.raises(ExchangeError, match="does not match the sha256"):
        read_bundle(p)
    with pytest.raises(ExchangeError, match="is missing"):
        read_bundle(tmp_path / "nowhere")


@pytest.mark.parametrize("change,match", [
    ({"bias_exp": np.full((1, 2), 8, np.int16)}, "'bias_exp' holds values in \\[8, 8\\], outside \\[0, 7\\]"),
    ({"bias_mant": np.zeros((1, 2), np.int32)}, "'bias_mant' has dtype int32, expected int16"),
    ({"a_in": np.zeros((1, 3, 2), np.float32)}, "integers only"),
    ({"bias_mant": np.zeros((1, 3), np.int16)}, "shape \\[1, 3\\], expected \\[1, 2\\]"),
])
def test_bundle_refuses_what_lava_cannot_hold(tmp_path, change, match):
    with pytest.raises(ExchangeError, match=match):
        _lif_bundle(tmp_path, **change)
    with pytest.raises(ExchangeError, match="du = 4096, expected an int in \\[0, 4095\\]"):
        write_bundle(tmp_path / "c", "lif", {"regimes": [{"du": 4096, "dv": 0, "vth": 1}]},
                     {"a_in": np.zeros((1, 1, 1), np.int32), "bias_mant": np.zeros((1, 1), np.int16),
                      "bias_exp": np.zeros((1, 1), np.int16)})
    with pytest.raises(ExchangeError, match="even values"):
        write_bundle(tmp_path / "d", "dense", {"regimes": [{"weight_exp": 0, "num_message_bits": 0}]},
                     {"weights.0": np.ones((2, 2), np.int32), "s_in.0": np.zeros((3, 2), np.int32)})


def test_lava_python_env_and_missing_interpreter(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(LAVA_PYTHON_ENV, str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="is not a file; point it at a Python 3.10 interpreter"):
        lava_python()
    monkeypatch.delenv(LAVA_PYTHON_ENV)
    monkeypatch.setattr("szo.hw.lava.bridge.lava_python", lambda: None)
    with pytest.raises(ValueError, match="no Lava interpreter: run `make lava`"):
        require_python(None)
    assert main(["hw", "lava-check", "spike_convnet", "--samples", "2"]) == 2
    assert capsys.readouterr().err.startswith("error: no Lava interpreter: run `make lava`")


# ---------------------------------------------------------------------- export mapping
def _convnet(seed: int = 0, width: int = 4) -> SpikingModel:
    torch.manual_seed(seed)
    m = create("spike_convnet", T=4, width=width).eval()
    with torch.no_grad():  # large enough weights that both layers spike
        m.conv1.weight.mul_(4.0)
        m.conv2.weight.mul_(3.0)
        m.bn1.running_mean.fill_(0.1)
        m.bn2.running_var.fill_(0.5)
        m.fc.weight.mul_(4.0)
        m.fc.bias.normal_(0.0, 0.2)
    return m


def _oracle_run(meta, arrays, x_int: np.ndarray) -> dict[str, np.ndarray]:
    """A network bundle through the numpy transcription of Lava, one sample at a time (fresh state), T + L
    steps, aligned by ``network_delays``: spikes of each LIF and the readout a_out, ``[N, T, n]``."""
    delays = network_delays(meta)
    N, T = x_int.shape[:2]
    out = {k: [] for k in delays}
    for i in range(N):
        procs = []
        for ly in meta["layers"]:
            n = ly["name"]
            if ly["kind"] == "dense":
                procs.append(LavaDense(arrays[f"weights.{n}"], ly["weight_exp"], ly["num_message_bits"]))
            else:
                procs.append(LavaLIF(arrays[f"bias_mant.{n}"].size, ly["du"], ly["dv"], ly["vth"],
                                     arrays[f"bias_mant.{n}"], arrays[f"bias_exp.{n}"]))
        rec = {k: [] for k in delays}
        for t in range(T + delays["a_out"]):
            v = x_int[i, t] if t < T else np.zeros_like(x_int[i, 0])
            for ly, p in zip(meta["layers"], procs):
                v = p.run_spk(v)
                if ly["kind"] == "lif":
                    rec[ly["name"]].append(v.astype(np.int64))
            rec["a_out"].append(v.astype(np.int64))
        for k, d in delays.items():  # sample step k at t = k + d (t = 0 is Lava's step 1, the Extractor's index 0)
            out[k].append(np.stack(rec[k][d: d + T]))
    return {k: np.stack(v) for k, v in out.items()}


def test_export_maps_convnet_exactly_onto_lavas_dense_and_lif():
    """conv -> Toeplitz Dense, BN folded, 2x2 sum pool folded into the fc Dense, hard-reset LIF: the
    bundle run in the Lava transcription gives szo's spikes and readout, step for step."""
    m = _convnet()
    net = to_fixed(m, arithmetic="loihi", reset="zero", record=True)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 1, 8, 8, generator=g) * 1.5
    net(x)
    meta, arrays, names = export_network(net, (1, 8, 8))
    assert [ly["kind"] for ly in meta["layers"]] == ["dense", "lif", "dense", "lif", "dense"]
    assert names == {"conv1": "conv1", "sn1": "sn1", "conv2": "conv2", "sn2": "sn2", "fc": "fc"}
    assert arrays["weights.fc"].shape == (10, 256) and arrays["weights.conv2"].shape == (256, 256)
    q = net.quantized_layers()
    assert meta["layers"][0]["weight_exp"] == q["conv1"]["exp"] - 1 and meta["layers"][4]["weight_exp"] == q["fc"]["exp"] + 5
    x_int = net.quantize_input(x.unsqueeze(0).expand(4, *x.shape)).flatten(2).transpose(0, 1).numpy()
    ref = _oracle_run(meta, arrays, x_int)
    for name in ("sn1", "sn2"):
        ours = net.last_record[name].flatten(2).transpose(0, 1).numpy()
        assert np.array_equal(ours, ref[name]) and 0 < ours.sum() < ours.size, name
    assert np.array_equal(net.last_record["fc"].transpose(0, 1).numpy(), ref["a_out"] << A_IN_SHIFT)
    readout = ((ref["a_out"] << A_IN_SHIFT) + arrays["readout_bias"]).sum(1)
    assert np.array_equal(readout, net.last_readout_sum.numpy())


class _Branchy(SpikingModel):
    """conv -> LIF -> max pool -> fc, or a residual sum before the LIF: what the export refuses."""

    def __init__(self, kind: str) -> None:
        super().__init__(num_classes=3, T=2, model_name="branchy")
        self.kind = kind
        self.conv = layer.Conv2d(1, 2, 3, padding=1, step_mode="m")
        self.sn1 = make_neuron("lif")
        self.pool = layer.MaxPool2d(2, step_mode="m")
        self.flat = layer.Flatten(step_mode="m")
        self.fc = layer.Linear(8 if kind == "maxpool" else 32, 3, step_mode="m")
        self.sn1.v_reset = 0.0

    def forward_seq(self, x):
        h = self.conv(x)
        if self.kind == "residual":
            return self.fc(self.flat(self.sn1(h + h)))
        return self.fc(self.flat(self.pool(self.sn1(h))))


def test_export_refuses_in_one_line_naming_the_layer():
    m = _convnet()
    with pytest.raises(LavaExportError, match="'sn1' resets by subtraction .*--reset zero"):
        export_network(to_fixed(m, arithmetic="loihi"), (1, 8, 8))
    with pytest.raises(ValueError, match="needs the 'loihi' arithmetic"):
        export_network(to_fixed(m, reset="zero"), (1, 8, 8))
    with pytest.raises(LavaExportError, match="'pool' \\(MaxPool2d\\)"):
        export_network(to_fixed(_Branchy("maxpool"), arithmetic="loihi"), (1, 4, 4))
    with pytest.raises(LavaExportError, match="residual '\\+'"):
        export_network(to_fixed(_Branchy("residual"), arithmetic="loihi"), (1, 4, 4))
    with pytest.raises(LavaExportError, match="8-bit weights"):
        export_network(to_fixed(m, arithmetic="loihi", reset="zero", weight_bits=10), (1, 8, 8))


def test_export_cli_writes_a_checked_bundle(tmp_path, capsys):
    out = tmp_path / "bundle"
    assert main(["export", "spike_convnet", "--to", "lava", str(out), "--reset", "zero"]) == 0
    assert "conv2: Dense 1024x1024" in capsys.readouterr().out
    b = read_bundle(out, "network")
    assert b.meta["in_shape"] == [1, 8, 8] and "inputs" not in b.arrays
    assert main(["export", "spike_convnet", "--to", "lava", str(out)]) == 2
    assert "resets by subtraction" in capsys.readouterr().err


def test_hw_report_shows_a_lava_check_and_notices_changed_weights(tmp_path):
    from szo.hw.reports.hw_report import _lava_markdown  # noqa: PLC2701 (the section under test)

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.pt").write_bytes(b"weights v1")
    assert read_check(run) is None
    layer_ = {"elements": 8, "equal": 8, "spikes_szo": 3, "spikes_lava": 3, "first_diff": None, "delay_steps": 1}
    rep = {"target": "t", "samples": 2, "data": "test", "seed": 0, "T": 4, "lava_nc": "0.10.0", "python": "3.10.13",
           "lava_steps": 10, "layers": {"sn1": layer_}, "readout": {"fc": {**layer_, "delay_steps": 2}},
           "labels_agree": 2, "accuracy_szo": 1.0, "accuracy_lava": 1.0, "bit_exact": True,
           "weights_sha256": "0" * 64}
    write_check(rep, run)
    assert (run / CHECK_FILE).is_file()
    check = read_check(run)
    assert "stale" in check  # the digest above is not the file's
    text = "\n".join(_lava_markdown(check))
    assert "weights changed after this check" in text and "predicted labels agree on 2/2" in text
    from szo.io import sha256_file

    write_check({**rep, "weights_sha256": sha256_file(run / "checkpoints" / "last.pt")}, run)
    text = "\n".join(_lava_markdown(read_check(run)))
    assert "changed" not in text and "sn1: spikes (3 szo, 3 Lava): 8/8 equal" in text and "bit-exact: yes" in text
    assert check_summary(rep)[-1] == "  bit-exact: yes"


# ----------------------------------------------------------------- Lava's own runtime
LIF_REGIMES = [  # (du, dv, vth): the converter's paper LIF, synaptic memory, extremes of every register
    (4095, 3724, 64),  # paper LIF (tau = 1.1), the converter's default
    (4095, 0, 131071),  # no voltage leak, largest threshold: the voltage clips
    (4095, 4095, 1),  # fastest voltage leak, smallest threshold
    (0, 0, 6400),  # smallest current decay (1/4096), no voltage leak: wrapped currents persist
    (1, 410, 128),
    (1023, 410, 128),  # lava's tutorial-like decays
    (2047, 1, 640),
    (3000, 100, 20000),
    (4000, 3000, 3),
    (4094, 2, 100000),
]


def _szo_lif(du: int, dv: int, vth: int) -> LoihiCubaLIF:
    n = LoihiCubaLIF((du + 1) / 4096, dv / 4096, vth / 64, reset="zero")
    assert n.lava_params() == {"du": du, "dv": dv, "vth": vth}
    return n


@needs_lava
def test_loihi_lif_bit_identical_with_lavas_runtime(tmp_path):
    """szo's LoihiCubaLIF vs Lava's LIF (PyLifModelBitAcc) run by Lava: 10 regimes x 1000 steps x 32 neurons,
    random integer inputs (wrapping currents in half the neurons, clipping voltages), random 13-bit biases
    with exponents 0..7; u, v and spikes equal at every step."""
    R, n = len(LIF_REGIMES), 32
    g = np.random.default_rng(33)
    a_in = g.integers(-(1 << 18), 1 << 18, (R, T_LONG, n)).astype(np.int32)  # << 6 reaches 2**24: wraps
    a_in[:, :, n // 2:] //= 64  # half the neurons mostly in range: spikes and resets
    a_in[:, :, n // 4: n // 2] = np.abs(a_in[:, :, n // 4: n // 2]) // 4  # a quarter driven up: voltages clip
    mant = g.integers(-4096, 4096, (R, n)).astype(np.int16)
    bexp = g.integers(0, 8, (R, n)).astype(np.int16)
    regimes = [{"du": du, "dv": dv, "vth": vth} for du, dv, vth in LIF_REGIMES]
    write_bundle(tmp_path / "req", "lif", {"regimes": regimes}, {"a_in": a_in, "bias_mant": mant, "bias_exp": bexp})
    res = run_lava(tmp_path / "req", tmp_path / "res", python=LAVA)
    assert res.meta["lava_nc"] == "0.10.0"
    wraps = clips = 0
    for r, (du, dv, vth) in enumerate(LIF_REGIMES):
        ours = _szo_lif(du, dv, vth)
        bias = torch.from_numpy(mant[r].astype(np.int64) << bexp[r].astype(np.int64))
        x = torch.from_numpy(a_in[r].astype(np.int64)) << A_IN_SHIFT
        s, _, rec = ours.run(x, record=True, bias=bias)
        for name, a, b in (("s", s, res.arrays["s"][r]), ("u", rec.current, res.arrays["u"][r]),
                           ("v", rec.voltage, res.arrays["v"][r])):
            diff = np.argwhere(a.numpy() != b)
            assert diff.size == 0, f"regime {r} {(du, dv, vth)}: {name} differs first at [step, neuron] {diff[0]}"
        assert 0 < int(s.sum()) < s.numel(), r
        counts = ours.counter.as_dict()["neuron"]
        wraps += int(counts.get("current_wrap", 0))
        clips += int(counts.get("voltage", 0))
    assert wraps > 1000 and clips > 1000  # the overflow paths were exercised, identically
    other = _szo_lif(LIF_REGIMES[0][0], LIF_REGIMES[0][1] + 1, LIF_REGIMES[0][2])  # the comparison can fail
    _, _, rec = other.run(torch.from_numpy(a_in[0].astype(np.int64)) << A_IN_SHIFT, record=True,
                          bias=torch.from_numpy(mant[0].astype(np.int64) << bexp[0].astype(np.int64)))
    assert not np.array_equal(rec.voltage.numpy(), res.arrays["v"][0])


class _Synapses(SpikingModel):
    """Linear (graded input) -> LIF -> Linear (spikes): the two Dense kinds the converter writes."""

    def __init__(self, T: int) -> None:
        super().__init__(num_classes=12, T=T, model_name="synapses")
        self.flat = layer.Flatten(step_mode="m")
        self.fc1 = layer.Linear(16, 24, step_mode="m")
        self.sn1 = make_neuron("lif")
        self.fc2 = layer.Linear(24, 12, step_mode="m")
        self.sn1.v_reset = 0.0

    def forward_seq(self, x):
        return self.fc2(self.sn1(self.fc1(self.flat(x))))


DENSE_SCALES = [  # (weight scale fc1, fc2, sign): converter exponents from e = -12 to e = 1
    (1e-3, 5e-4, 0), (0.02, 0.01, 0), (0.3, 0.1, 0), (1.5, 0.05, 0), (40.0, 2.0, 0), (1e3, 1e3, 0),
    (0.5, 0.5, -1),  # every weight <= 0 with one at -128: Lava's inhibitory mode would clip it, mixed does not
]


@needs_lava
def test_loihi_dense_bit_identical_with_lavas_runtime(tmp_path):
    """szo's synapse (``loihi``: floor shift by the weight exponent) vs Lava's Dense (PyDenseModelBitAcc) run by
    Lava, with the weights (2 w_int, 8-bit mixed sign) and exponents the export writes: graded 16-bit input
    and binary spikes, 7 weight scales (14 regimes) x 1000 steps."""
    g = torch.Generator().manual_seed(8)
    regimes, arrays, expected, exps = [], {}, [], []
    for s1, s2, sign in DENSE_SCALES:
        m = _Synapses(T_LONG).eval()
        with torch.no_grad():
            for fc, s in ((m.fc1, s1), (m.fc2, s2)):
                fc.weight.normal_(0.0, s, generator=g)
                if sign < 0:
                    fc.weight.abs_().neg_()
        net = to_fixed(m, arithmetic="loihi", record=True)
        if sign < 0:  # the integer learner (mcu-zo) clips its weights to [-128, 127]: -128 occurs
            net.freeze_weights()
            net.int_weights["fc1"].w_int.view(-1)[0] = -128
        x = torch.randint(-32768, 32768, (T_LONG, 1, 1, 4, 4), generator=g)
        x[torch.rand(x.shape, generator=g) < 0.3] = 0
        x[:100] = torch.randint(-2, 3, (100, 1, 1, 4, 4), generator=g)  # small sums too: floor of negatives
        net(x.to(torch.float64) / (1 << ACT_SHIFT))
        meta, bundle, _ = export_network(net, (1, 4, 4))
        spikes = net.last_record["sn1"][:, 0].numpy()
        for i, (ly, s_in) in enumerate(((meta["layers"][0], x[:, 0].flatten(1).numpy()), (meta["layers"][2], spikes))):
            r = len(regimes)
            regimes.append({"weight_exp": ly["weight_exp"], "num_message_bits": ly["num_message_bits"]})
            arrays[f"weights.{r}"] = bundle[f"weights.{ly['name']}"]
            arrays[f"s_in.{r}"] = s_in.astype(np.int32)
            expected.append(net.last_record["fc1" if i == 0 else "fc2"][:, 0].numpy() >> A_IN_SHIFT)  # szo's a_out
            exps.append(ly["weight_exp"])
        if sign < 0:
            assert int(bundle["weights.fc1"].min()) == -256 and int(bundle["weights.fc1"].max()) <= 0
    write_bundle(tmp_path / "req", "dense", {"regimes": regimes}, arrays)
    res = run_lava(tmp_path / "req", tmp_path / "res", python=LAVA)
    for r, exp_out in enumerate(expected):
        lava = res.arrays[f"a_out.{r}"]
        assert not lava[0].any()  # step 1 sends the empty buffer: the output is one step late
        diff = np.argwhere(lava[1:] != exp_out)
        assert diff.size == 0, f"regime {r} (weight_exp {exps[r]}): a_out differs first at [step, neuron] {diff[0]}"
        assert (exp_out != 0).any(), r
    assert min(exps) <= -12 and max(exps) >= 5 and any(e < 0 for e in exps[1::2])  # both shift directions


@needs_lava
def test_trained_like_convnet_in_lava_agrees_with_szo_sample_for_sample(tmp_path):
    """A spike_convnet streamed through Lava (samples back to back, LIFReset offsets = pipeline delays) and
    through szo: every spike, readout value and label equal; the bundles are kept and checked."""
    m = _convnet(seed=1, width=4)
    rep = lava_check(m, 12, data="random", reset="zero", python=LAVA, keep=tmp_path)
    assert rep["bit_exact"] and rep["labels_agree"] == 12, "\n".join(check_summary(rep))
    assert rep["lava_steps"] == 12 * 4 + 3
    for v in rep["layers"].values():
        assert 0 < v["spikes_szo"] < v["elements"] and v["equal"] == v["elements"]
    assert read_bundle(tmp_path / "request", "network").arrays["inputs"].shape == (12, 4, 64)
    assert read_bundle(tmp_path / "result", "result").meta["request_kind"] == "network"


@needs_lava
def test_cli_lava_check_of_a_run_directory_shows_in_hw_report(tmp_path, capsys):
    import yaml
    from safetensors.torch import save_file

    from szo.config import load_recipe
    from szo.hw.reports.hw_report import hw_report, to_markdown
    from szo.io import atomic_write_text
    from szo.pipeline import build_model

    cfg = load_recipe("digits-bp")
    run = tmp_path / "run"
    run.mkdir()
    atomic_write_text(run / "config.yaml", yaml.safe_dump(cfg.to_dict()))
    model = build_model(cfg)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, run / "model.safetensors")
    assert main(["hw", "lava-check", str(run), "--samples", "6"]) == 2  # the model's own soft reset
    assert "resets by subtraction" in capsys.readouterr().err
    assert main(["hw", "lava-check", str(run), "--samples", "6", "--reset", "zero"]) == 0
    out = capsys.readouterr().out
    assert "predicted labels agree on 6/6" in out and "bit-exact: yes" in out and (run / CHECK_FILE).is_file()
    md = to_markdown(hw_report(str(run), data="test", batch=4, k=4, neurobench=False))
    assert "## Intel Lava agreement (szo hw lava-check)" in md and "bit-exact: yes" in md and "changed" not in md


def test_runner_refuses_a_bad_bundle_in_one_line(tmp_path, capsys):
    from szo.hw.lava import runner as lava_runner

    p = _lif_bundle(tmp_path)
    (p / "exchange.json").write_text((p / "exchange.json").read_text().replace('"version": 1', '"version": 7'))
    assert lava_runner.main([str(p), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().endswith("this reader reads version 1 only (export the bundle again with "
                                                    "this szo)")
    assert lava_runner.main([]) == 2 and not (tmp_path / "out").exists()


@needs_lava
def test_a_runner_past_its_time_is_killed(tmp_path):
    regimes = [{"du": 0, "dv": 0, "vth": 1}]
    arrays = {"a_in": np.ones((1, 5000, 4), np.int32), "bias_mant": np.zeros((1, 4), np.int16),
              "bias_exp": np.zeros((1, 4), np.int16)}
    write_bundle(tmp_path / "req", "lif", {"regimes": regimes}, arrays)
    with pytest.raises(RuntimeError, match="did not finish within 0.5 s; killed"):
        run_lava(tmp_path / "req", tmp_path / "res", python=LAVA, timeout_s=0.5)


# ------------------------------------------------------- failures of the runner and the exchange (issue 41)
def _script(path, text):
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(0o755)
    return path


def _lava_cli(*extra):
    return main(["hw", "lava-check", "spike_convnet", "--data", "random", "--samples", "2", "--reset", "zero", *extra])


def test_a_bundle_with_an_object_array_is_one_exchange_error(tmp_path, capsys):
    """arrays.npz holding an object array (its sha256 re-signed in the manifest): refused without unpickling,
    one ExchangeError line in szo and from the runner (exit 2), not numpy's traceback."""
    import hashlib
    import io

    from szo.hw.lava import runner as lava_runner

    p = _lif_bundle(tmp_path)
    buf = io.BytesIO()
    arrays = dict(np.load(p / "arrays.npz"))
    arrays["a_in"] = np.array([object()] * 6, dtype=object).reshape(1, 3, 2)
    np.savez(buf, **arrays)
    (p / "arrays.npz").write_bytes(buf.getvalue())
    manifest = json.loads((p / "exchange.json").read_text())
    manifest["sha256"] = hashlib.sha256(buf.getvalue()).hexdigest()
    (p / "exchange.json").write_text(json.dumps(manifest))
    with pytest.raises(ExchangeError, match=r"arrays.npz does not hold plain integer arrays \(Object arrays cannot be "
                                            r"loaded when allow_pickle=False\); the exchange never unpickles"):
        read_bundle(p)
    (p / "arrays.npz").write_bytes(b"not a zip file at all")
    manifest["sha256"] = hashlib.sha256(b"not a zip file at all").hexdigest()
    (p / "exchange.json").write_text(json.dumps(manifest))
    assert lava_runner.main([str(p), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not hold plain integer arrays" in err[0] and not (tmp_path / "out").exists()


def test_a_result_is_checked_against_its_request(tmp_path, capsys):
    """A runner that writes a valid, signed result bundle of something else (no spike arrays, another
    number of steps, non-binary spikes, another kind) is one ExchangeError line, never a KeyError."""
    import sys

    from szo.hw.lava.runner import check_result

    req = read_bundle(_lif_bundle(tmp_path), "lif")
    s = np.zeros((1, 3, 2), np.int32)

    def result(name, **arrays):
        write_bundle(tmp_path / name, "result", {"request_kind": "lif"}, arrays)
        return read_bundle(tmp_path / name, "result")

    check_result(req, result("ok", s=s, u=s, v=s))
    with pytest.raises(ExchangeError, match=r"the Lava result holds \['u', 'v'\]; the request asks for "
                                            r"\['s', 'u', 'v'\] \(missing: s\)"):
        check_result(req, result("no-s", u=s, v=s))
    with pytest.raises(ExchangeError, match=r"the Lava result's array 'u' has shape \[1, 2, 2\], expected \[1, 3, 2\]"):
        check_result(req, result("short", s=s, u=s[:, :2], v=s))
    with pytest.raises(ExchangeError, match=r"the Lava result's array 's' holds values in \[0, 2\], outside \[0, 1\]$"):
        check_result(req, result("two", s=(s + 2 * (np.arange(6).reshape(1, 3, 2) == 5)).astype(np.int32), u=s, v=s))
    write_bundle(tmp_path / "dense", "result", {"request_kind": "dense"}, {"s": s, "u": s, "v": s})
    with pytest.raises(ExchangeError, match="answers a 'dense' request, not this 'lif' one"):
        check_result(req, read_bundle(tmp_path / "dense"))
    # end to end: an "interpreter" whose runner answers every request with a result without spikes
    fake = tmp_path / "fake_runner.py"
    fake.write_text("import sys, numpy as np\nfrom szo.hw.lava.runner import read_bundle, write_bundle\n"
                    "req = read_bundle(sys.argv[1])\n"
                    "write_bundle(sys.argv[2], 'result', {'request_kind': req.kind}, "
                    "{'a_out': np.zeros((11, 10), np.int32)})\n")
    exe = _script(tmp_path / "python", f'exec "{sys.executable}" "{fake}" "$3" "$4"\n')
    assert _lava_cli("--lava-python", str(exe)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the Lava result holds ['a_out']; the request asks for "), err
    assert "(missing: spikes.sn1, spikes.sn2)" in err[0]


@pytest.mark.parametrize("case", ["no lava-nc", "not executable", "killed", "timeout"])
def test_every_failure_of_the_runner_is_one_line_with_status_5(tmp_path, capsys, case):
    """The interpreter without lava-nc, a file that is not executable, a runner killed by SIGKILL, one past
    --timeout-s: one line, exit status 5 (an external process failed), no traceback."""
    import sys

    exe, extra, phrase = {
        "no lava-nc": (sys.executable, (), "Lava runner failed"),
        "not executable": (tmp_path / "python", (), "cannot start the Lava interpreter"),
        "killed": (tmp_path / "python", (), "was killed by signal SIGKILL"),
        "timeout": (tmp_path / "python", ("--timeout-s", "0.5"),
                    "did not finish within 0.5 s; killed (raise the limit with --timeout-s)"),
    }[case]
    if case != "no lava-nc":
        _script(exe, {"not executable": "", "killed": "kill -KILL $$\n", "timeout": "exec sleep 30\n"}[case])
    if case == "not executable":
        exe.chmod(0o644)
    assert _lava_cli("--lava-python", str(exe), *extra) == 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and phrase in err[0], err
    if case == "no lava-nc":
        assert "has no lava-nc" in err[0] and "make lava" in err[0]


def test_ctrl_c_during_lava_check_leaves_no_runner_behind(tmp_path):
    """Ctrl-C while the runner works (it leads its own session, so the terminal's SIGINT never reaches it):
    szo kills the runner's process group and says 'interrupted', without the --resume lava-check lacks."""
    import signal
    import subprocess
    import sys
    import time

    pidfile = tmp_path / "runner.pid"
    exe = _script(tmp_path / "python", f'echo $$ > "{pidfile}"\nsleep 60 &\nexec sleep 60\n')
    p = subprocess.Popen([sys.executable, "-m", "szo", "hw", "lava-check", "spike_convnet", "--data", "random",
                          "--samples", "2", "--reset", "zero", "--lava-python", str(exe)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         # SIGINT as in a terminal: a test run in a shell's background inherits it ignored
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for _ in range(600):
        if pidfile.is_file() and pidfile.read_text().strip():
            break
        time.sleep(0.1)
    runner = int(pidfile.read_text())
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
    assert _group_ends(runner)  # the runner and the process it started, its whole group


def test_more_samples_than_the_test_set_is_refused_before_lava_runs(tmp_path, capsys):
    import yaml

    from szo.config import load_recipe
    from szo.io import atomic_write_text, save_weights
    from szo.pipeline import build_model

    cfg = load_recipe("digits-bp")
    run = tmp_path / "run"
    run.mkdir()
    atomic_write_text(run / "config.yaml", yaml.safe_dump(cfg.to_dict()))
    save_weights(run / "model.safetensors", build_model(cfg).state_dict())
    never = _script(tmp_path / "python", f'touch "{tmp_path / "ran"}"\n')
    assert main(["hw", "lava-check", str(run), "--samples", "400", "--reset", "zero", "--lava-python", str(never)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --samples 400: the test set of spike_convnet ({run / 'model.safetensors'}) holds 360 "
                   "samples; valid: 1 to 360"]
    assert not (tmp_path / "ran").exists() and not (run / CHECK_FILE).exists()


def test_export_to_lava_applies_or_refuses_every_flag(tmp_path, capsys):
    """--weight-bits is applied to the Lava bundle (4-bit mantissas: |2 w_int| <= 14); --dt (a NIR step
    length), --weight-bits beyond Lava's 8, --reset for NIR and --weight-bits without --fixed are refused."""
    out = tmp_path / "b4"
    assert main(["export", "spike_convnet", "--to", "lava", str(out), "--reset", "zero", "--weight-bits", "4"]) == 0
    assert "4-bit weights" in capsys.readouterr().out
    b = read_bundle(out, "network")
    assert b.meta["source"]["weight_bits"] == 4
    assert max(int(np.abs(v).max()) for k, v in b.arrays.items() if k.startswith("weights.")) <= 14
    assert main(["export", "spike_convnet", "--to", "lava", str(tmp_path / "b8"), "--reset", "zero", "--fixed"]) == 0
    assert read_bundle(tmp_path / "b8", "network").meta["source"]["weight_bits"] == 8
    capsys.readouterr()
    for args, phrase in ((["--to", "lava", str(tmp_path / "x"), "--reset", "zero", "--dt", "0.001"], "--dt sets NIR's"),
                         (["--to", "lava", str(tmp_path / "x"), "--reset", "zero", "--weight-bits", "9"],
                          "weight_bits 9: Lava's Dense holds 2- to 8-bit weights"),
                         (["--to", "nir", str(tmp_path / "x.nir"), "--reset", "zero"], "--reset deploys the LIFs"),
                         (["--to", "nir", str(tmp_path / "x.nir"), "--weight-bits", "4"], "add --fixed")):
        assert main(["export", "spike_convnet", *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and phrase in err[0], err
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.nir").exists()


@pytest.mark.parametrize("content", ["[1, 2]", '{"target": "t", "samples": 2, "lay', '{"bit_exact": true}', "\xff\xfe"])
def test_an_unreadable_lava_check_file_costs_one_warning(tmp_path, capsys, content):
    """A lava_check.json that is not a check report (a list, truncated, missing fields, not UTF-8) is left
    out of szo hw-report with one warning line naming the file; the rest of the report stands."""
    import yaml

    from szo.config import load_recipe
    from szo.io import atomic_write_text, save_weights
    from szo.pipeline import build_model

    cfg = load_recipe("digits-bp", ["model.kwargs={width: 4}", "model.T=2"])
    run = tmp_path / "run"
    run.mkdir()
    atomic_write_text(run / "config.yaml", yaml.safe_dump(cfg.to_dict()))
    save_weights(run / "model.safetensors", build_model(cfg).state_dict())
    (run / CHECK_FILE).write_bytes(content.encode("latin-1"))
    assert main(["hw-report", str(run), "--no-neurobench", "--batch", "2", "--k", "2"]) == 0
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"warning: {run / CHECK_FILE} is not a readable szo hw lava-check "
                                                   "report ("), lines
    assert "Intel Lava agreement" not in out and "| layer |" in out


@needs_lava
def test_lavas_own_runner_killed_mid_run_is_one_line_and_leaves_nothing(tmp_path):
    """Lava's runtime SIGKILLed while it runs (its runner process; Lava's workers are in its group): one
    ExternalError line, and no process of that group is left."""
    import os
    import signal
    import threading
    import time

    from szo.exits import ExternalError

    pidfile = tmp_path / "runner.pid"
    exe = _script(tmp_path / "python", f'echo $$ > "{pidfile}"\nexec "{LAVA}" "$@"\n')
    arrays = {"a_in": np.ones((1, 20000, 4), np.int32), "bias_mant": np.zeros((1, 4), np.int16),
              "bias_exp": np.zeros((1, 4), np.int16)}
    write_bundle(tmp_path / "req", "lif", {"regimes": [{"du": 0, "dv": 0, "vth": 1}]}, arrays)

    def kill_when_running():
        for _ in range(600):
            if pidfile.is_file() and pidfile.read_text().strip():
                break
            time.sleep(0.05)
        time.sleep(3.0)  # Lava has started its runtime
        os.kill(int(pidfile.read_text()), signal.SIGKILL)

    t = threading.Thread(target=kill_when_running)
    t.start()
    with pytest.raises(ExternalError, match=r"^Lava runner \(.*\) was killed by signal SIGKILL before it wrote a result"):
        run_lava(tmp_path / "req", tmp_path / "res", python=exe, timeout_s=120)
    t.join()
    assert _group_ends(int(pidfile.read_text()))
    assert not (tmp_path / "res" / "exchange.json").exists()


def _group_ends(pgid, seconds=20.0):
    """Whether every process of group ``pgid`` is gone within ``seconds`` (SIGKILLed processes leave
    asynchronously, their orphans once init has reaped them)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False
