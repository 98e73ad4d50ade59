"""``szo hw-report``: on-chip memory, synaptic operations and energy of SZO on a Loihi-class chip.

Synaptic operations are *measured*: the fixed-point network is run on a batch and every layer
counts its input events (spikes, graded non-zero inputs, or pooled spike counts) times their
exact fan-out. One SZO-CGE step costs ``2k`` forwards (paper Sec. 4.2), so its synaptic
operations are ``2k`` times the per-forward count (the float trainer's BN-update forward of
``bn_update="recompute"`` does not exist on a chip that folds BN with deployed statistics). Hardware figures are data
(:class:`ChipModel`), each with its source; see docs/hardware.md.

The report also runs the batch in both integer arithmetics (``"szo"`` saturating, ``"loihi"``
bit-exact with Lava's bit-accurate Dense/LIF; with labelled data, their accuracy and how many
synaptic currents and spikes differ) and lists the model's features that a standard Loihi 2
LIF process (Lava ``LIF`` + ``Dense``) cannot run as they are (:func:`loihi2_features`).
"""
from __future__ import annotations

import math
import operator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from szo.build import load_run_model
from szo.data import collate_time_major, dataset_info, get_dataset
from szo.hw.convert import FixedPointNetwork, to_fixed
from szo.hw.fixed import ARITHMETICS, BitWidths, check_arithmetic
from szo.hw.lava.bridge import check_summary, read_check
from szo.hw.optim.onchip import check_learner_widths, learner_state_bits
from szo.hw.reports.neurobench import NOTES, neurobench_metrics, szo_counterparts
from szo.io import atomic_write_json, atomic_write_text
from szo.models import SpikingModel, create, names
from szo.options import IntegerLearnerOptions

__all__ = ["ChipModel", "LOIHI2", "compare_arithmetics", "hw_report", "load_target", "loihi2_features",
           "to_markdown", "write_report"]

DATA_CHOICES: tuple[str, ...] = ("random", "digits", "test")
"""Measurement batch: uniform [0, 1) images; the digits test set; the run directory's own test set."""


@dataclass(frozen=True)
class ChipModel:
    """Energy and memory figures of the target chip, with where each comes from."""

    name: str = "Loihi 2 (energy per synaptic op from Loihi 1)"
    energy_per_synop_pj: float = 23.6
    energy_source: str = ("Davies et al., 'Loihi: A Neuromorphic Manycore Processor with On-Chip Learning', "
                          "IEEE Micro 38(1), 2018, Table 1: energy per synaptic spike op (min) 23.6 pJ (Loihi 1, "
                          "14 nm). Recalled, not re-checked in this session: treat as an assumption; Loihi 2 "
                          "per-op energy is not published in the same form.")
    energy_per_neuron_update_pj: float = 81.0
    neuron_energy_source: str = ("Davies et al. 2018, Table 1: neuron update (active) 81 pJ (Loihi 1). Recalled, "
                                 "not re-checked: assumption.")
    cores: int = 128
    core_memory_kb: float = 128.0
    memory_source: str = ("Loihi 2: 128 neuro cores per chip (Intel Loihi 2 technology brief, 2021); 128 KB of "
                          "flexibly partitioned SRAM per core as reported by secondary sources (e.g. "
                          "open-neuromorphic.org, press coverage of the brief); Intel's own brief may quote a "
                          "different figure (~192 KB): ASSUMPTION, override with --core-kb.")

    def __post_init__(self) -> None:  # chip limits are checked before anything is measured
        if isinstance(self.cores, bool) or not isinstance(self.cores, int) or self.cores < 1:
            raise ValueError(f"cores must be an int >= 1 (Loihi 2: 128), got {self.cores!r}")
        for name, what in (("core_memory_kb", "memory per core (KB; Loihi 2: 128)"),
                           ("energy_per_synop_pj", "energy per synaptic op (pJ; Loihi: 23.6)"),
                           ("energy_per_neuron_update_pj", "energy per neuron update (pJ; Loihi: 81)")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise ValueError(f"{what} must be a finite number > 0, got {v!r}")

    @property
    def chip_memory_bytes(self) -> int:
        return int(self.cores * self.core_memory_kb * 1024)


LOIHI2 = ChipModel()


def load_target(target: str | SpikingModel) -> tuple[SpikingModel, str, dict[str, Any] | None]:
    """``(model, label, run config or None)`` of a model object, a run directory
    (``szo.build.load_run_model``: config.yaml + model.safetensors or checkpoints/last.pt)
    or a registered model name (random init)."""
    if isinstance(target, SpikingModel):
        return target, target.model_name, None
    p = Path(str(target))
    if p.is_dir():

        try:
            model, cfg = load_run_model(p)
        except FileNotFoundError as exc:  # no config.yaml / no weights: a usage error, one line
            raise ValueError(str(exc)) from None
        weights = p / "model.safetensors" if (p / "model.safetensors").is_file() else p / "checkpoints" / "last.pt"
        return model, f"{cfg['model']['name']} ({weights})", cfg
    if str(target) in names():
        return create(str(target)), str(target), None
    raise ValueError(f"{target!r} is neither a registered model ({names()}) nor a run directory")


def input_batch(model: SpikingModel, data: str, batch: int, input_size: int | None, seed: int,
                 cfg: dict[str, Any] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(x, labels)``: ``x`` is ``[N, C, H, W]`` (static) or ``[T, N, C, H, W]`` (event frames);
    labels are None for random input."""
    if data not in DATA_CHOICES:
        raise ValueError(f"unknown data {data!r}; valid: {list(DATA_CHOICES)}")
    g = torch.Generator().manual_seed(seed)
    dcfg = cfg["data"] if cfg is not None else None
    if data == "random":
        first = next((m for m in model.modules() if isinstance(m, torch.nn.Conv2d)), None)
        c = first.in_channels if first is not None else 1
        if input_size is None and dcfg is not None:

            size = dataset_info(dcfg["name"]).image_size  # the run's data set (default loader options)
        else:
            size = (input_size or (8 if model.model_name == "spike_convnet" else 32),) * 2
        return torch.rand(batch, c, *size, generator=g), None
    if data == "test" and dcfg is None:
        raise ValueError("--data test measures on the run's own test set: give a run directory, not a model name")
    if data == "digits" and dcfg is not None and dcfg["name"] != "digits":
        raise ValueError(f"the run was trained on {dcfg['name']!r}, not digits; use --data test (its test set) or random")

    if dcfg is None:
        ds = get_dataset("digits", "test")  # standardised as in training
    else:  # the run's data set and loader options
        ds = get_dataset(dcfg["name"], "test", data_dir=dcfg["data_dir"], download=dcfg["download"], **dcfg["kwargs"])
    idx = torch.randperm(len(ds), generator=g)[:batch]
    x, y = collate_time_major([ds[int(i)] for i in idx])
    return x, y


def loihi2_features(net: FixedPointNetwork) -> list[dict[str, Any]]:
    """The converted network's features, each with whether a standard Loihi 2 LIF process
    (Lava ``LIF`` with ``PyLifModelBitAcc`` fed by ``Dense``) runs it as it is, and what it needs otherwise."""
    mods = dict(net.named_modules())
    calls = [n for n in net.graph.nodes if n.op == "call_module"]
    of_type = lambda *types: [n.target for n in calls if isinstance(mods[n.target], types)]  # noqa: E731
    out: list[dict[str, Any]] = []

    def add(feature: str, layers: list[str], runs: bool, note: str) -> None:
        if layers:
            out.append({"feature": feature, "layers": layers, "standard_loihi2_lif": runs, "note": note})

    neurons = net.neurons
    add("soft reset (v -= threshold)", [p for p, n in neurons.items() if n.reset == "subtract"], False,
        "a standard Lava/Loihi 2 LIF resets v to 0 on a spike (PyLifModelBitAcc.reset_voltage); reset by "
        "subtraction needs a custom neuron program. Convert with reset='zero' (--reset zero, hw.reset=zero) "
        "to run the standard process.")
    bad = []
    for p, n in neurons.items():
        try:
            n.lava_params()
        except ValueError as exc:
            bad.append(f"{p}: {exc}")
    add("neuron parameters outside Lava's registers", bad, False, "12-bit du/dv with ds_offset 1 / dm_offset 0, "
        "17-bit vth: change tau / threshold")
    adds = [n.name for n in net.graph.nodes if n.op in ("call_function", "call_method")
            and (n.target in (operator.add, torch.add) or n.target == "add")]
    add("residual add", adds, False,
        "the summed currents must arrive in the same time step, but every Lava Dense/Conv delivers one step "
        "later: the shorter (shortcut) path needs a synaptic delay equal to the depth difference (e.g. Lava "
        "DelayDense); a spike shortcut is an extra one-to-one synapse (weight 1.0 = 64 << 6 state units)")
    add("sum pooling into a synapse", of_type(nn.AvgPool2d, nn.AdaptiveAvgPool2d), False,
        "pooled spike counts are graded values, not LIF spikes: fold the pool into the next synapse (a larger "
        "strided kernel, weights / k^2) or relay the counts through graded-spike neurons")
    add("BatchNorm", sorted(net.fused.values()), True,
        "folded into the weights and bias with the running statistics, shared by all time steps; per-time-step "
        "(or batch) statistics would need time-varying weights/bias, which a static synapse and LIF bias cannot "
        "hold (the converter folds shared statistics only)")
    add("max pooling of spikes", of_type(nn.MaxPool2d), True,
        "an OR: sum-pool synapse into LIF neurons with threshold 0 and hard reset")
    synapses = of_type(nn.Conv2d, nn.Linear)
    add("graded input", synapses[:1], True,
        f"the input arrives as {net.widths.input_bits}-bit graded spikes (Loihi 2 graded spikes; Lava Dense "
        "num_message_bits > 0) from an input encoder")
    out_node = next(n for n in net.graph.nodes if n.op == "output")
    if out_node.args and getattr(out_node.args[0], "op", None) == "call_module" and out_node.args[0].target in synapses:
        add("non-spiking readout", [out_node.args[0].target], True,
            "the last synapse's output (plus bias) summed over T on the host: read the Dense a_out (a sink/"
            "monitor), not a LIF")
    add("synaptic pipeline delay", synapses, True,
        f"each Lava Dense delivers its output one step later: {len(synapses)} synapse stages need T + "
        f"{len(synapses)} steps and the readout appears {len(synapses)} steps late (szo runs without the delay; "
        "tests/hw/test_loihi.py aligns the two)")
    return out


@torch.no_grad()
def compare_arithmetics(model: SpikingModel, x: torch.Tensor, labels: torch.Tensor | None = None, *,
                        widths: BitWidths | None = None) -> dict[str, Any]:
    """The batch through the ``"szo"`` and ``"loihi"`` arithmetics (each LIF's own reset), and ``"loihi"``
    with the standard LIF's hard reset: accuracy (with labels), overflow counts, and per layer the
    fraction of synaptic currents (without bias) and of spikes that differ between szo and loihi.

    Only the first synapse sees identical inputs in both; deeper layers also differ because their
    input spikes do. ``rounding_only_*``: Lava's floor shift applied to szo's own synaptic sums
    (the rounding alone, same inputs). ``reset_layers``: spikes that differ between each LIF's own
    (soft) reset and the hard reset, both in the loihi arithmetic.
    """
    runs: dict[str, FixedPointNetwork] = {}
    out: dict[str, Any] = {"runs": {}, "layers": [], "reset_layers": []}
    for name, arithmetic, reset in (*((a, a, None) for a in ARITHMETICS), ("loihi, reset=zero", "loihi", "zero")):
        try:
            net = to_fixed(model, widths=widths, arithmetic=arithmetic, reset=reset, record=True)
        except ValueError as exc:  # e.g. a LIF Lava's registers cannot hold: say so, report the rest
            out["runs"][name] = {"arithmetic": arithmetic, "reset": reset, "error": str(exc)}
            continue
        net(x)
        r: dict[str, Any] = {"arithmetic": arithmetic, "reset": reset, "overflows": net.saturation_counts()}
        if labels is not None and net.last_readout_sum is not None:
            r["accuracy"] = float((net.last_readout_sum.argmax(1).cpu() == labels.cpu()).double().mean())
        out["runs"][name] = r
        runs[name] = net
    if "loihi" not in runs:
        return out
    a, b = runs["szo"], runs["loihi"]
    for path, ra in a.last_record.items():
        rb = b.last_record[path]
        spikes = path in a.neurons
        row = {"layer": path, "quantity": "spikes" if spikes else "synaptic current",
               "differ_fraction": float((ra != rb).double().mean()), "elements": int(ra.numel())}
        if not spikes:
            row["max_abs_diff"] = float((ra - rb).abs().max()) / (1 << 12) if ra.numel() else 0.0  # in units of 1.0
            same = a.last_record_lava_rounding[path]  # Lava's floor shift of szo's own sums: rounding alone
            row["rounding_only_differ_fraction"] = float((ra != same).double().mean())
            row["rounding_only_max_abs_diff"] = float((ra - same).abs().max()) / (1 << 12) if ra.numel() else 0.0
        out["layers"].append(row)
    hard = runs["loihi, reset=zero"]  # what the standard LIF's hard reset changes (same arithmetic)
    for p, n in b.neurons.items():
        if n.reset != "zero":
            own, zero = b.last_record[p], hard.last_record[p]
            out["reset_layers"].append({"layer": p, "differ_fraction": float((own != zero).double().mean()),
                                        "spikes_own_reset": int(own.sum()), "spikes_hard_reset": int(zero.sum())})
    return out


@torch.no_grad()
def hw_report(target: str | SpikingModel, *, data: str = "random", batch: int = 16, k: int = 40,
              learner: IntegerLearnerOptions = IntegerLearnerOptions(), input_size: int | None = None,
              widths: BitWidths | None = None, chip: ChipModel = LOIHI2, seed: int = 0,
              arithmetic: str = "szo", reset: str | None = None, neurobench: bool = True) -> dict[str, Any]:
    """Measure one batch through the fixed-point network (``arithmetic``, ``reset``: see
    :func:`szo.hw.to_fixed`) and tabulate memory, synops and energy; compare the arithmetics
    (:func:`compare_arithmetics`) and list what a standard Loihi 2 LIF cannot run (:func:`loihi2_features`).

    ``neurobench``: also compute NeuroBench's metrics (``szo.hw.reports.neurobench``) of the float model
    on the same batch, next to szo's counterparts (skipped, with the reason, if ``neurobench``
    is not installed or the target is already a fixed-point network). ``learner``: the widths of
    the on-chip SZO learner's state (basis, coordinates, theta_ref) whose memory is tabulated."""
    for n, v in (("batch", batch), ("k", k), ("input_size", 1 if input_size is None else input_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{n} must be a positive int, got {v!r}")
    check_arithmetic(arithmetic)
    if not isinstance(chip, ChipModel):
        raise ValueError(f"chip must be a szo.hw.reports.hw_report.ChipModel, got {type(chip).__name__}")
    check_learner_widths(basis_bits=learner.basis_bits, coord_bits=learner.coord_bits, ref_bits=learner.ref_bits)
    model, label, cfg = load_target(target)  # the limits above are checked before any of this
    model.eval()
    if isinstance(model, FixedPointNetwork):
        if (arithmetic, reset) != (model.arithmetic, model.reset_override):
            raise ValueError(f"the network was converted with arithmetic={model.arithmetic!r}, "
                             f"reset={model.reset_override!r}; pass the float model to report another arithmetic")
        net = model
    else:
        net = to_fixed(model, widths=widths, arithmetic=arithmetic, reset=reset)
    P = net.widths
    x, labels = input_batch(model, data, batch, input_size, seed, cfg)
    T, N = (x.shape[0], x.shape[1]) if x.dim() == 5 else (model.T, x.shape[0])
    net.reset_counters()
    collecting, net.collect_stats = net.collect_stats, True  # events / synops / spikes of this forward
    try:
        net(x)
    finally:
        net.collect_stats = collecting
    rows = _layer_rows(net.last_stats, P, chip, N)
    d = net.num_params()
    bits = learner_state_bits(d, k, basis_bits=learner.basis_bits, coord_bits=learner.coord_bits,
                              ref_bits=learner.ref_bits)
    learner_bytes = {f"{item}_bytes": math.ceil(b / 8) for item, b in bits.items()}
    synops_fwd = sum(r["synops_per_sample"] for r in rows)
    neuron_updates_fwd = sum(r["neurons"] for r in rows) * T
    forwards_per_step = 2 * k
    totals = {
        "weight_bytes": sum(r["weight_bytes"] for r in rows),
        "bias_bytes": sum(r["bias_bytes"] for r in rows),
        "neuron_state_bytes": sum(r["neuron_state_bytes"] for r in rows),
        "inference_bytes": sum(r["bytes"] for r in rows),
        "learner_bytes": sum(learner_bytes.values()),
        "synops_per_forward": synops_fwd,
        "neuron_updates_per_forward": neuron_updates_fwd,
        "forwards_per_szo_step": forwards_per_step,
        "synops_per_szo_step": forwards_per_step * synops_fwd,
        "energy_per_forward_uj": (synops_fwd * chip.energy_per_synop_pj
                                  + neuron_updates_fwd * chip.energy_per_neuron_update_pj) * 1e-6,
    }
    totals["total_bytes"] = totals["inference_bytes"] + totals["learner_bytes"]
    totals["energy_per_szo_step_uj"] = forwards_per_step * totals["energy_per_forward_uj"]
    learner_cores = math.ceil(totals["learner_bytes"] / (chip.core_memory_kb * 1024))
    cores_needed = sum(r["cores"] for r in rows) + learner_cores
    fit = {
        "cores_needed": cores_needed, "cores_available": chip.cores,
        "chip_memory_bytes": chip.chip_memory_bytes,
        "fits_chip": cores_needed <= chip.cores and totals["total_bytes"] <= chip.chip_memory_bytes,
        "largest_layer_bytes": max((r["bytes"] for r in rows), default=0),
        "core_memory_bytes": int(chip.core_memory_kb * 1024),
    }
    compare = None if isinstance(model, FixedPointNetwork) else compare_arithmetics(model, x, labels, widths=P)
    rep = {
        "target": label, "model": model.model_name, "d": d, "k": k, "T": T, "batch": N, "data": data,
        "arithmetic": net.arithmetic, "reset": net.reset_override,
        "input_shape": list(x.shape[-3:]), "widths": P.as_dict(),
        "learner_precision": {"basis_bits": learner.basis_bits, "coord_bits": learner.coord_bits,
                              "ref_bits": learner.ref_bits},
        "chip": asdict(chip), "layers": rows, "learner": learner_bytes, "totals": totals, "fit": fit,
        "saturations": net.saturation_counts(),
        "arithmetics": compare, "loihi2_features": loihi2_features(net),
    }
    if neurobench:
        rep["neurobench"] = _neurobench_section(model, net, x, rep)
    if isinstance(target, (str, Path)) and Path(str(target)).is_dir():
        rep["lava_check"] = read_check(target)  # written by szo hw lava-check; None before one has run
    return rep


def _layer_rows(stats: dict[str, dict[str, Any]], P: BitWidths, chip: ChipModel, N: int) -> list[dict[str, Any]]:
    """Per layer of a measured forward (``FixedPointNetwork.last_stats``): memory at the
    network's widths, events / synops per sample, spike rate and the cores it needs."""
    rows = []
    for name, s in stats.items():
        w = int(s.get("weights", 0))
        row = {
            "layer": name, "type": s["type"],
            "weights": w,
            "weight_bytes": math.ceil(w * P.weight_bits / 8) + (1 if w else 0),  # + per-layer exponent byte
            "bias_bytes": math.ceil(s.get("out_channels", 0) * (P.bias_mant_bits + 3) / 8) if s.get("has_bias") else 0,
            "neurons": int(s.get("neurons", 0)),
            "neuron_state_bytes": math.ceil(int(s.get("neurons", 0)) * 2 * P.state_bits / 8),  # current + voltage
            "events_per_sample": s.get("events", 0) / N,
            "synops_per_sample": s.get("synops", 0) / N,
            "spikes_per_neuron_per_step": (s["spikes"] / (s["neurons"] * s["T"] * s["N"])) if s["type"] == "neuron" else None,
        }
        row["bytes"] = row["weight_bytes"] + row["bias_bytes"] + row["neuron_state_bytes"]
        row["cores"] = math.ceil(row["bytes"] / (chip.core_memory_kb * 1024)) if row["bytes"] else 0
        rows.append(row)
    return rows


def _neurobench_section(model: SpikingModel, net: FixedPointNetwork, x: torch.Tensor,
                        rep: dict[str, Any]) -> dict[str, Any]:
    """NeuroBench's own metrics of the float model on the measurement batch, and szo's counterparts."""
    if isinstance(model, FixedPointNetwork):
        return {"skipped": "the target is a fixed-point network; NeuroBench hooks need the float model's layers"}
    try:
        nb = neurobench_metrics(model, x)
    except ModuleNotFoundError as exc:
        return {"skipped": str(exc)}
    return {"neurobench": nb, "szo": szo_counterparts(rep, net.quantized_layers())}


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def to_markdown(rep: dict[str, Any]) -> str:
    t, f, c = rep["totals"], rep["fit"], rep["chip"]
    cols = ["layer", "type", "weights", "weight_bytes", "bias_bytes", "neurons", "neuron_state_bytes",
            "events_per_sample", "synops_per_sample", "spikes_per_neuron_per_step", "cores"]
    lines = [f"# hw-report: {rep['target']}", "",
             f"d = {rep['d']}, k = {rep['k']}, T = {rep['T']}, measured on {rep['batch']} samples ({rep['data']}), "
             f"input {rep['input_shape']}; weights {rep['widths']['weight_bits']}-bit, "
             f"state {rep['widths']['state_bits']}-bit.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rep["layers"]:
        lines.append("| " + " | ".join(_fmt(r[k]) for k in cols) + " |")
    lines += ["", "## SZO learner state", "", "| item | bytes |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rep["learner"].items()]
    lines += ["", "## Totals", "", "| quantity | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in t.items()]
    lines += ["", "## Fit", "", f"- cores needed {f['cores_needed']} of {f['cores_available']}; total "
              f"{t['total_bytes']} B of {f['chip_memory_bytes']} B; fits: **{f['fits_chip']}**",
              "", "## Assumptions and sources", "",
              f"- energy per synaptic op {c['energy_per_synop_pj']} pJ: {c['energy_source']}",
              f"- energy per neuron update {c['energy_per_neuron_update_pj']} pJ: {c['neuron_energy_source']}",
              f"- memory: {c['cores']} cores x {c['core_memory_kb']} KB: {c['memory_source']}",
              "- one layer per core (no packing of layers into shared cores); conv weights stored once per layer "
              "(weight sharing); synops = measured input events x exact fan-out.",
              f"- saturations during the measured forward: {rep['saturations'] or 'none'}", ""]
    lines += _arithmetics_markdown(rep)
    if rep.get("lava_check"):
        lines += _lava_markdown(rep["lava_check"])
    if "neurobench" in rep:
        lines += _neurobench_markdown(rep["neurobench"])
    return "\n".join(lines)


def _arithmetics_markdown(rep: dict[str, Any]) -> list[str]:
    lines = []
    cmp = rep.get("arithmetics")
    if cmp:
        lines += ["## Arithmetics: szo (saturating) vs loihi (bit-exact with Lava's bit-accurate Dense/LIF)", "",
                  "| run | accuracy on the batch | overflow events |", "|---|---|---|"]
        for name, r in cmp["runs"].items():
            if "error" in r:
                lines.append(f"| {name} | not convertible: {r['error']} | |")
                continue
            n_over = sum(sum(d.values()) for d in r["overflows"].values())
            acc = f"{100 * r['accuracy']:.2f} %" if "accuracy" in r else "- (no labels)"
            lines.append(f"| {name} | {acc} | {n_over} {r['overflows'] or ''} |")
        lines += ["", "Elements that differ between szo and loihi (each LIF's own reset; layers after the first "
                  "also differ through their input spikes):", "",
                  "| layer | quantity | differ | max abs diff (units of 1.0) | differ, same input (rounding only) "
                  "| max abs diff, same input |", "|---|---|---|---|---|---|"]
        for r in cmp["layers"]:
            same = r.get("rounding_only_differ_fraction")
            lines.append(f"| {r['layer']} | {r['quantity']} | {100 * r['differ_fraction']:.2f} % | "
                         f"{_fmt(r.get('max_abs_diff'))} | {'-' if same is None else f'{100 * same:.2f} %'} | "
                         f"{_fmt(r.get('rounding_only_max_abs_diff'))} |")
        if cmp.get("reset_layers"):
            lines += ["", "Spikes that differ between each LIF's own (soft) reset and the standard hard reset "
                      "(loihi arithmetic):", "", "| layer | differ | spikes, own reset | spikes, hard reset |",
                      "|---|---|---|---|"]
            lines += [f"| {r['layer']} | {100 * r['differ_fraction']:.2f} % | {r['spikes_own_reset']} | "
                      f"{r['spikes_hard_reset']} |" for r in cmp["reset_layers"]]
        lines.append("")
    feats = rep.get("loihi2_features") or []
    lines += ["## What a standard Loihi 2 LIF process runs as is", "",
              f"Converted with arithmetic {rep.get('arithmetic', 'szo')!r}, reset "
              f"{rep.get('reset') or 'of each LIF'}.", "",
              "| feature | layers | standard LIF + Dense | note |", "|---|---|---|---|"]
    for f in feats:
        lines.append(f"| {f['feature']} | {', '.join(f['layers'])} | {'yes' if f['standard_loihi2_lif'] else '**no**'} "
                     f"| {f['note']} |")
    lines.append("")
    return lines


def _neurobench_markdown(sec: dict[str, Any]) -> list[str]:
    if "skipped" in sec:
        return ["## NeuroBench", "", f"- skipped: {sec['skipped']}", ""]

    nb, own = sec["neurobench"], sec["szo"]
    lines = ["## NeuroBench metrics", "",
             f"Computed by NeuroBench {nb['neurobench_version']} itself on the float model and the same "
             f"{nb['samples']} samples (T = {nb['T']}), next to szo's figures for the fixed-point network above.", "",
             "| metric | NeuroBench | szo | definitions |", "|---|---|---|---|",
             f"| synaptic ops / sample | {_fmt(nb['synops_effective_acs'])} ACs + {_fmt(nb['synops_effective_macs'])} "
             f"MACs (dense {_fmt(nb['synops_dense'])}) | {_fmt(own['synops_per_sample'])} | {NOTES['synops']} |",
             f"| activation sparsity | {_fmt(nb['activation_sparsity'])} | {_fmt(own['activation_sparsity'])} | "
             f"{NOTES['activation_sparsity']} |",
             f"| footprint (bytes) | {nb['footprint_bytes']} | {own['footprint_bytes']} | {NOTES['footprint']} |",
             f"| connection sparsity | {_fmt(nb['connection_sparsity'])} | {_fmt(own['connection_sparsity'])} | "
             f"{NOTES['connection_sparsity']} |", ""]
    return lines


def _lava_markdown(check: dict[str, Any]) -> list[str]:
    """``szo hw lava-check``'s agreement of Lava's own runtime with szo's simulator (its lava_check.json)."""
    lines = ["## Intel Lava agreement (szo hw lava-check)", ""]
    if check.get("stale"):
        lines += [f"- the run's weights changed after this check ({check['stale']}): run szo hw lava-check again", ""]
    return lines + [f"    {ln.strip()}" for ln in check_summary(check)] + [""]


def write_report(rep: dict[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``hw_report.md`` and ``hw_report.json`` atomically."""
    out = Path(out_dir)
    md, js = out / "hw_report.md", out / "hw_report.json"
    atomic_write_text(md, to_markdown(rep))
    atomic_write_json(js, rep)
    return md, js
