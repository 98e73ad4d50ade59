"""The settings of ``szo demo dvs-stream``: one typed, frozen record checked once when built (each
flag of ``szo demo dvs-stream`` is one of its fields), written to ``OUT/config.yaml`` by the demo and
read back by ``--resume``."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml

from szo.config import Section
from szo.data.dvs import check_sensor_size
from szo.data.synthetic_events import check_shift
from szo.methods import NO_ADAPTATION, TTA_METHODS, get_method

__all__ = ["ADAPT_METHODS", "DEFAULT_SHIFT", "LABELS_LR", "ENTROPY_LR", "StreamConfig", "resumed_settings"]

#: the on-line adaptation methods (forward-only SZO in the source subspace), then no adaptation
ADAPT_METHODS = tuple(m for m in TTA_METHODS if get_method(m).adapter == "subspace-zo") + (NO_ADAPTATION,)
DEFAULT_SHIFT = {"noise_rate_hz": 5.0}
LABELS_LR, ENTROPY_LR = 0.2, 0.005  # the SZO lr per loss (labels: tuned on the synthetic noise shift)
Loss = Literal["auto", "entropy", "labels"]


def _f(default: Any, **meta: Any) -> Any:
    return field(default=default, metadata=meta)


@dataclass(frozen=True, eq=False)
class StreamConfig(Section):
    """The demo's settings, each checked when built (one line naming it); ``loss: auto`` (labels for a
    labelled stream), ``lr: null`` and ``shift: null`` are resolved here, so config.yaml says what ran."""

    source: str = "synthetic"              # synthetic | an event file (szo.data.event_files.FORMATS)
    labels_file: str | None = None         # FILE source: .npy segments (start_us, end_us, label)
    sensor_size: list | tuple | None = None  # FILE source: (W, H, P); null = the file's own, else the model's input
    fit: Literal["crop", "downsample", "crop+downsample"] | None = None  # FILE source onto the model's input
    gestures: int = _f(30, min=1)          # synthetic: stream length
    shift: dict | None = _f(None, free=True)  # synthetic: from half way (SHIFT_KEYS); null = DEFAULT_SHIFT
    model: str | None = None               # a finished run directory or .nir file; null = train the recipe
    recipe: str = "synthetic-gesture"
    overrides: list | tuple = field(default_factory=list)  # --set KEY=VALUE of the recipe
    window_ms: float = _f(50.0, gt=0.0)
    adapt: str = _f("szo-cge", choices=lambda: ADAPT_METHODS)
    loss: Loss = "auto"
    lr: float | None = _f(None, min=0.0)
    mu: float = _f(0.5, gt=0.0)
    momentum: float = _f(0.0, min=0.0, below=1.0)
    q: int = _f(4, min=1)                  # RGE directions per step
    buffer: int = _f(1, min=1)             # the SZO loss over the last N windows
    seed: int = _f(0, min=0)               # stream and RGE seed
    compare: bool = True                   # also replay the stream without adaptation

    def __post_init__(self) -> None:
        super().__post_init__()
        synthetic = self.source == "synthetic"
        for bad, why in ((synthetic and self.labels_file is not None, "labels_file is only for a FILE source"),
                         (synthetic and self.sensor_size is not None, "sensor_size is only for a FILE source"),
                         (synthetic and self.fit is not None, "fit is only for a FILE source"),
                         (not synthetic and bool(self.shift), "shift is only for the synthetic source"),
                         (self.model is not None and bool(self.overrides),
                          "overrides (--set) are for the recipe trained here, not for a given model")):
            if bad:
                raise ValueError(why)
        loss = self.loss if self.loss != "auto" else "labels" if synthetic or self.labels_file else "entropy"
        if loss == "labels" and not (synthetic or self.labels_file):
            raise ValueError("loss 'labels' needs a labelled stream (the synthetic source, or labels_file for a FILE)")
        resolved = {"loss": loss, "lr": self.lr if self.lr is not None else LABELS_LR if loss == "labels" else ENTROPY_LR,
                    "shift": check_shift(DEFAULT_SHIFT if self.shift is None and synthetic else self.shift),
                    "overrides": list(self.overrides)}  # lists: what config.yaml holds
        if self.sensor_size is not None:
            resolved["sensor_size"] = list(check_sensor_size(self.sensor_size))
        for k, v in resolved.items():
            object.__setattr__(self, k, v)

    def as_written(self) -> dict[str, Any]:
        """What ``OUT/config.yaml`` holds: the settings under the demo's name."""
        return {"demo": "dvs-stream", **self.to_dict()}


def resumed_settings(out_dir: str | Path, given: Mapping[str, Any]) -> StreamConfig:
    """The settings ``--resume`` continues: ``OUT/config.yaml`` with ``given`` on top (only ``given``
    when ``OUT`` holds no run); ``run_demo`` then refuses any that differs from the file."""
    path = Path(out_dir) / "config.yaml"
    saved = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else {"demo": "dvs-stream"}
    if not isinstance(saved, dict) or saved.pop("demo", None) != "dvs-stream":
        raise ValueError(f"{path} is not a dvs-stream demo's config (another kind of run); use another --out")
    names = [f.name for f in dataclasses.fields(StreamConfig)]
    unknown = sorted(set(saved) - set(names))
    if unknown:
        raise ValueError(f"{path}: unknown dvs-stream setting(s) {unknown}; valid: {', '.join(names)}")
    return StreamConfig(**{**saved, **given})
