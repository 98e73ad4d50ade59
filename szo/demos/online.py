"""The on-line loop of ``szo demo dvs-stream``: a network that keeps its neuron state from window to
window (``with model.persistent_state():``), classifies each window and then, with an adapting
method, takes one SZO step on it (and the ``buffer - 1`` windows before it) in the source subspace,
on the TET loss against the windows' labels (``loss: labels``) or their prediction entropy: every
probe starts each window from the neuron state saved before it (``snapshot_state``: the
memories SpikingJelly's ``named_memories()`` lists), and the stream's state is put back after the
step, so probes never disturb the stream. A window is always classified before adapting on it.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from spikingjelly.activation_based.base import MemoryModule

from szo import plots
from szo.data.dvs import EventStream
from szo.demos.settings import StreamConfig
from szo.losses import entropy_loss, tet_loss
from szo.methods import NO_ADAPTATION, method_label
from szo.optim import build_optimizer

__all__ = ["snapshot_state", "restore_state", "stack_states", "OnlineClassifier", "replay", "plot_timeline"]


# ----------------------------------------------------------------------------- neuron state
def _stateful(model: torch.nn.Module) -> list[MemoryModule]:
    return [m for m in model.modules() if isinstance(m, MemoryModule)]


def _copy(v: Any) -> Any:
    return v.clone() if isinstance(v, torch.Tensor) else v


def snapshot_state(model: torch.nn.Module) -> list[dict[str, Any]]:
    """A copy of every stateful (SpikingJelly ``MemoryModule``) layer's memories (membrane v)."""
    return [{k: _copy(v) for k, v in m.named_memories()} for m in _stateful(model)]


def restore_state(model: torch.nn.Module, snap: list[dict[str, Any]]) -> None:
    """Put back a ``snapshot_state`` copy (the snapshot itself stays untouched and reusable)."""
    mods = _stateful(model)
    if len(mods) != len(snap):
        raise ValueError(f"state snapshot has {len(snap)} stateful layers, the model has {len(mods)}")
    for m, mem in zip(mods, snap):
        for k, v in mem.items():
            setattr(m, k, _copy(v))  # MemoryModule.__setattr__ writes a registered memory


def stack_states(snaps: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Single-stream snapshots concatenated along the batch (a memory still at its initial float
    becomes a tensor of that value)."""
    def cat(vals: list[Any]) -> Any:
        ref = next((v for v in vals if isinstance(v, torch.Tensor)), None)
        return vals[0] if ref is None else torch.cat([v if isinstance(v, torch.Tensor) else torch.full_like(ref, v)
                                                      for v in vals])
    return snaps[0] if len(snaps) == 1 else [{k: cat([m[k] for m in layer]) for k in layer[0]} for layer in zip(*snaps)]


# ----------------------------------------------------------------------------- on-line loop
class OnlineClassifier:
    """Classifies windows with carried neuron state (call inside ``with model.persistent_state():``);
    with an adapting ``cfg.adapt``, one SZO step per window on the last ``cfg.buffer`` windows as one
    batch, each from the neuron state saved before it."""

    def __init__(self, model: Any, subspace: Any, cfg: StreamConfig) -> None:
        self.model, self.cfg = model, cfg
        self.buffer: list[tuple[torch.Tensor, list[dict[str, Any]], int]] = []
        self.opt = None if cfg.adapt == NO_ADAPTATION else build_optimizer(
            cfg.adapt, model, subspace=subspace, lr=cfg.lr, momentum=cfg.momentum, mu=cfg.mu, q=cfg.q,
            generator=torch.Generator().manual_seed(cfg.seed), start="current", scale="absolute")  # the flags' units

    @property
    def forward_passes(self) -> int:
        return 0 if self.opt is None else self.opt.forward_passes

    @torch.no_grad()
    def classify(self, frames: torch.Tensor) -> int:
        """The prediction for one window ``[bins, P, H, W]`` (neuron state carried)."""
        return int(self.model(frames.unsqueeze(1)).mean(0).argmax(1))

    @torch.no_grad()
    def adapt(self, frames: torch.Tensor, before: list[dict[str, Any]], label: int) -> float:
        """One SZO step on this window (state ``before`` it) and the buffered ones; leaves the neuron
        state as it found it. Returns the mean probe loss."""
        if self.opt is None:
            raise ValueError("adapt() needs an adapting method, not adapt='none'")
        if self.cfg.loss == "labels" and label < 0:
            raise ValueError("the labels loss needs a label for every adapted window")
        self.buffer = (self.buffer + [(frames, before, int(label))])[-self.cfg.buffer:]
        after = snapshot_state(self.model)
        x, start = torch.stack([b[0] for b in self.buffer], 1), stack_states([b[1] for b in self.buffer])
        y = torch.tensor([b[2] for b in self.buffer])

        def closure() -> torch.Tensor:
            restore_state(self.model, start)
            out = self.model(x)
            return tet_loss(out, y) if self.cfg.loss == "labels" else entropy_loss(out)

        try:
            return float(self.opt.step(closure))
        finally:
            restore_state(self.model, after)


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    prev = torch.get_num_threads()
    torch.set_num_threads(n or prev)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def replay(stream: EventStream, clf: OnlineClassifier, *, window_us: int, bins: int, downsample: int = 1,
           classes: Sequence[str] | None = None, print_every: int = 0, name: str = "", threads: int | None = 1,
           log: Callable[[str], None] = print) -> dict[str, Any]:
    """Feed the stream window by window: ``{"summary": ..., "windows": [one record per window]}``.
    ``threads``: torch's intra-op threads meanwhile (one window is a tiny tensor: a thread hand-off
    costs more than it saves; None: as they are)."""
    starts = stream.window_starts(window_us)
    labels = stream.labels_at(starts + window_us // 2)
    named = lambda c: classes[c] if classes and 0 <= c < len(classes) else str(c)  # noqa: E731
    recs: list[dict[str, Any]] = []
    n_ok = n_lab = 0
    compute = 0.0
    with _threads(threads), clf.model.persistent_state():
        for i, (ws, lab) in enumerate(zip(starts.tolist(), labels.tolist())):
            frames = stream.frames(ws, ws + window_us, bins, downsample)
            tic = time.perf_counter()
            before = snapshot_state(clf.model) if clf.opt is not None else None
            pred = clf.classify(frames)
            latency = time.perf_counter() - tic  # time to a prediction
            adapt = clf.opt is not None and (lab >= 0 or clf.cfg.loss != "labels")
            loss = clf.adapt(frames, before, lab) if adapt else None  # type: ignore[arg-type]
            step = time.perf_counter() - tic
            compute += step
            n_lab, n_ok = n_lab + (lab >= 0), n_ok + (lab >= 0 and pred == lab)
            recs.append({"window": i, "t_ms": round(ws / 1000, 3), "label": lab, "pred": pred,
                         "latency_ms": round(latency * 1000, 3), "step_ms": round(step * 1000, 3),
                         "running_acc": n_ok / n_lab if n_lab else None, "loss": loss})
            if print_every and (i % print_every == 0 or i == len(starts) - 1):
                log(f"[{name}] w{i:04d} t={ws / 1e6:7.2f}s true={named(lab):<13} pred={named(pred):<13} "
                    f"lat={latency * 1000:6.2f}ms step={step * 1000:6.2f}ms acc="
                    + (f"{n_ok / n_lab:.3f}" if n_lab else "  n/a"))
    pred, lat, stream_s = np.array([r["pred"] for r in recs]), np.array([r["latency_ms"] for r in recs]), \
        len(recs) * window_us / 1e6

    def acc(mask: np.ndarray) -> float | None:
        m = mask & (labels >= 0)
        return float((pred[m] == labels[m]).mean()) if m.any() else None

    shift = stream.shift_at
    summary = {"n_windows": len(recs), "window_ms": window_us / 1000, "bins_per_window": bins,
               "stream_seconds": stream_s, "compute_seconds": round(compute, 4),
               "real_time_factor": round(stream_s / compute, 3) if compute > 0 else None,
               "accuracy": acc(np.ones(len(recs), bool)),
               "accuracy_before_shift": acc(starts < shift) if shift is not None else None,
               "accuracy_after_shift": acc(starts >= shift) if shift is not None else None,
               "latency_ms_mean": round(float(lat.mean()), 3), "latency_ms_p95": round(float(np.percentile(lat, 95)), 3),
               "step_ms_mean": round(1000 * compute / len(recs), 3), "forward_passes_adapt": clf.forward_passes}
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    log(f"[{name}] accuracy {fmt(summary['accuracy'])} (before shift {fmt(summary['accuracy_before_shift'])}, after "
        f"shift {fmt(summary['accuracy_after_shift'])}); real-time factor {summary['real_time_factor']} (stream "
        f"{stream_s:.2f}s / compute {compute:.2f}s); latency {summary['latency_ms_mean']:.2f}ms mean")
    return {"summary": summary, "windows": recs}


def plot_timeline(path: str | Path, runs: dict[str, dict], *, shift_at_s: float | None, n_classes: int,
                  class_names: Sequence[str] | None = None, smooth: int = 20) -> None:
    """PNG: true label and predictions per window (top; classes by name when ``class_names`` has one
    per class), running and sliding accuracy (bottom); the legends sit right of the panels."""
    names = list(class_names) if class_names is not None and len(class_names) == n_classes else None
    fig, (ax1, ax2) = plots.pyplot().subplots(2, 1, figsize=(12, 6.5), sharex=True)
    first = next(iter(runs.values()))["windows"]
    smooth = max(1, min(smooth, len(first)))
    t, lab = np.array([r["t_ms"] for r in first]) / 1000, np.array([r["label"] for r in first])
    valid, box = lab >= 0, np.ones(smooth)
    ax1.step(t, np.where(valid, lab, np.nan), where="post", color="k", lw=2, label="true class")
    for j, (name, run) in enumerate(runs.items()):
        method, plus, rest = name.partition("+")
        label = method_label(method) + plus + rest
        pred = np.array([r["pred"] for r in run["windows"]])
        ax1.scatter(t, pred + 0.15 * (j - 0.5), s=10, marker=plots.MARKERS[j % len(plots.MARKERS)],
                    label=f"predicted ({label})")
        run_acc = [np.nan if r["running_acc"] is None else r["running_acc"] for r in run["windows"]]
        slide = np.convolve(np.where(valid, pred == lab, 0), box, "same") / np.maximum(
            np.convolve(valid.astype(float), box, "same"), 1)
        line, = ax2.plot(t, run_acc, lw=2, label=f"since the start ({label})")
        ax2.plot(t, slide, lw=1, ls="--", color=line.get_color(), label=f"last {smooth} windows ({label})")
    for ax, ylabel, title in ((ax1, "class", "per window"), (ax2, "accuracy", "accuracy")):
        if shift_at_s is not None:
            ax.axvline(shift_at_s, color="r", ls=":", lw=2, label="domain shift")
        ax.grid(alpha=0.3)
        ax.set_ylabel(ylabel)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title=title, title_fontsize=8)
    ax1.set_yticks(range(n_classes))
    if names is not None:
        ax1.set_yticklabels(names, fontsize=8)
    ax1.set_ylim(-0.6, n_classes - 0.4)
    ax2.set_ylim(-0.02, 1.02)
    ax2.set_xlabel("stream time (s)")
    plots.save_figure(fig, path, dpi=110)


