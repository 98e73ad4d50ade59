"""Event-camera recordings as others publish them, read in fixed-size chunks by maintained readers.

=============  ===========================================================================================
suffix         format and reader
=============  ===========================================================================================
``.npy``       a numpy structured array with fields x, y, t (microseconds), p; memory-mapped, no pickle
``.bin``       N-MNIST / N-Caltech101 (5 bytes per event; ``tonic.io.read_mnist_file`` on each chunk)
``.aedat4``    AEDAT 4 (iniVation DV; the ``aedat`` package's ``Decoder``, packet by packet, as
               ``tonic.io.read_aedat4``; the sensor size from the file's event stream)
``.aedat``     AEDAT 2.0 (jAER; DVS128 or DAVIS346 chips, from the header's ``AEChip`` line) and AEDAT 3.x
               (polarity packets): tonic's ``read_aedat_header_from_file`` / ``get_aer_events_from_file``
               and the address layouts of ``tonic.io.read_dvs_128`` / ``read_davis_346`` / ``read_dvs_red``
``.dat``       Prophesee DAT (``expelliarmus.Wizard("dat")``, chunk by chunk)
``.raw``       Prophesee EVT 2.0 / EVT 3.0 (``expelliarmus.Wizard("evt2" / "evt3")``; the encoding and the
               sensor size from the file's ``%`` header)
=============  ===========================================================================================

``open_event_file(path)`` checks the file and its header (one ``ValueError`` line naming the file, or
naming the supported formats for an unknown one) and returns an ``EventFile``: its format, the sensor
size the file states (None when it states none), and ``chunks()``: an iterator of structured arrays
(``EVENT_DTYPE``: x, y, t, p) of at most about ``chunk_events`` events each, so memory does not grow
with the file (AEDAT 3.x is the exception: tonic's reader decodes the whole file at once).
"""
from __future__ import annotations

import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

__all__ = ["require_tonic", "EVENT_DTYPE", "FORMATS", "CHUNK_EVENTS", "EventFile", "open_event_file", "read_events",
           "supported_formats"]

EVENT_DTYPE = np.dtype([("x", np.int32), ("y", np.int32), ("t", np.int64), ("p", np.int8)])
CHUNK_EVENTS = 1 << 18
FORMATS: dict[str, str] = {
    ".npy": "numpy structured array (x, y, t, p)",
    ".bin": "N-MNIST binary",
    ".aedat4": "AEDAT 4",
    ".aedat": "AEDAT 2.0 (DVS128, DAVIS346) / 3.x",
    ".dat": "Prophesee DAT",
    ".raw": "Prophesee EVT 2.0 / EVT 3.0",
}
_NMNIST_SENSOR = (34, 34, 2)
_NMNIST_DTYPE = np.dtype([("x", np.int64), ("y", np.int64), ("t", np.int64), ("p", np.int64)])
_AEDAT2_CHIPS = {"dvs128": (128, 128, 2), "davis346": (346, 260, 2)}  # AEChip name (lower case) contains ...


def require_tonic() -> Any:
    """The tonic package, or one ImportError naming the ``dvs`` extra."""
    try:
        import tonic
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "DVS event data needs the optional dependency tonic (GPL-3.0); "
            "install it with `pip install szo[dvs]`"
        ) from e
    return tonic


def supported_formats() -> str:
    """The supported formats in one phrase."""
    return ", ".join(f"{k} ({v})" for k, v in FORMATS.items())


def _as_events(x: Any, y: Any, t: Any, p: Any) -> np.ndarray:
    out = np.empty(len(t), dtype=EVENT_DTYPE)
    out["x"], out["y"], out["t"], out["p"] = x, y, t, p
    return out


@dataclass(frozen=True)
class EventFile:
    """A checked event file: ``path``, ``format`` (a key of ``FORMATS``), ``sensor_size`` (W, H, P) as the
    file states it (None when it does not) and ``chunks()``."""

    path: Path
    format: str
    sensor_size: tuple[int, int, int] | None
    _reader: Callable[[int], Iterator[np.ndarray]]

    def chunks(self, chunk_events: int = CHUNK_EVENTS) -> Iterator[np.ndarray]:
        """The events in file order, ``EVENT_DTYPE`` chunks of about ``chunk_events``; a file that its
        reader cannot decode is one ``ValueError`` naming it."""
        try:
            for chunk in self._reader(int(chunk_events)):
                if len(chunk):
                    yield chunk
        except ValueError as e:
            if str(self.path) in str(e):
                raise
            raise ValueError(f"cannot read {self.path} as {FORMATS[self.format]}: {e}") from None
        except (OSError, RuntimeError, IndexError, KeyError, TypeError, EOFError) as e:
            raise ValueError(f"cannot read {self.path} as {FORMATS[self.format]}: {e}") from None


def read_events(path: str | Path) -> tuple[np.ndarray, tuple[int, int, int] | None]:
    """The whole file as one ``EVENT_DTYPE`` array, and the sensor size it states (small files)."""
    ef = open_event_file(path)
    chunks = list(ef.chunks())
    return (np.concatenate(chunks) if chunks else np.empty(0, EVENT_DTYPE)), ef.sensor_size


# ----------------------------------------------------------------------------- one reader per format
def _npy(path: Path) -> tuple[tuple[int, int, int] | None, Callable[[int], Iterator[np.ndarray]]]:
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
        raise ValueError(f"cannot read {path} as a .npy array without pickle: {e}") from None
    names = arr.dtype.names or ()
    missing = [f for f in ("x", "y", "t", "p") if f not in names]
    if missing:
        raise ValueError(f"{path} must hold a structured array with fields x, y, t (microseconds), p; it lacks "
                         f"{missing} (dtype {arr.dtype})")
    for f in ("x", "y", "p"):
        if arr.dtype[f].kind not in "iub":
            raise ValueError(f"{path}: event field {f!r} must be integer or bool, got dtype {arr.dtype[f]}")
    if arr.dtype["t"].kind not in "iu":
        raise ValueError(f"{path}: event field 't' must be integer microseconds, got dtype {arr.dtype['t']}")
    flat = arr.reshape(-1)

    def chunks(n: int) -> Iterator[np.ndarray]:
        for i in range(0, len(flat), n):
            c = flat[i:i + n]
            yield _as_events(c["x"], c["y"], c["t"], c["p"])
    return None, chunks


def _nmnist(path: Path) -> tuple[tuple[int, int, int], Callable[[int], Iterator[np.ndarray]]]:
    size = path.stat().st_size
    if size % 5:
        raise ValueError(f"{path} is not an N-MNIST recording: {size} bytes is not a whole number of 5-byte events "
                         "(a truncated file?)")
    tonic = require_tonic()

    def chunks(n: int) -> Iterator[np.ndarray]:
        overflows = 0  # the 2**13 us timestamp overflow markers (y == 240) of earlier chunks
        with open(path, "rb") as f:
            while raw := f.read(5 * n):
                ev = tonic.io.read_mnist_file(io.BytesIO(raw), dtype=_NMNIST_DTYPE, is_stream=True)
                yield _as_events(ev["x"], ev["y"], ev["t"] + overflows * 2**13, ev["p"])
                overflows += int(np.count_nonzero(np.frombuffer(raw, np.uint8)[1::5] == 240))
    return _NMNIST_SENSOR, chunks


def _aedat4(path: Path) -> tuple[tuple[int, int, int], Callable[[int], Iterator[np.ndarray]]]:
    try:
        import aedat
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("AEDAT 4 files need the optional dependency aedat; install it with "
                          "`pip install szo[dvs]`") from None
    try:
        streams = aedat.Decoder(str(path)).id_to_stream()
    except (OSError, RuntimeError, ValueError) as e:
        raise ValueError(f"cannot read {path} as AEDAT 4: {e}") from None
    ids = sorted(i for i, s in streams.items() if s.get("type") == "events")
    if not ids:
        raise ValueError(f"{path} holds no event stream (AEDAT 4 streams: "
                         f"{sorted({s.get('type') for s in streams.values()})})")
    sid, sensor = ids[0], (int(streams[ids[0]]["width"]), int(streams[ids[0]]["height"]), 2)

    def chunks(n: int) -> Iterator[np.ndarray]:  # one packet at a time (the camera's own packet size)
        for packet in aedat.Decoder(str(path)):
            if packet["stream_id"] == sid and "events" in packet:
                ev = packet["events"]
                yield _as_events(ev["x"], ev["y"], ev["t"], ev["on"])
    return sensor, chunks


def _aedat_header_text(path: Path, data_start: int) -> str:
    with open(path, "rb") as f:
        return f.read(data_start).decode("latin-1")


def _aedat(path: Path) -> tuple[tuple[int, int, int] | None, Callable[[int], Iterator[np.ndarray]]]:
    tonic = require_tonic()
    with open(path, "rb") as f:
        if not f.read(len("#!AER-DAT")) == b"#!AER-DAT":
            raise ValueError(f"{path} is not an AEDAT file (no '#!AER-DAT' header line)")
    try:
        version, start, _ = tonic.io.read_aedat_header_from_file(str(path))
    except (ValueError, IndexError, UnboundLocalError) as e:
        raise ValueError(f"cannot read the AEDAT header of {path}: {e}") from None
    if 2 <= version < 3:
        chip = re.search(r"AEChip:\s*(\S+)", _aedat_header_text(path, start))
        name = chip.group(1).lower() if chip else ""
        kind = next((k for k in _AEDAT2_CHIPS if k in name), None)
        if kind is None:
            raise ValueError(f"{path}: AEDAT 2.0 from chip {chip.group(1) if chip else '(no AEChip line)'} is not "
                             f"supported; supported chips: {', '.join(_AEDAT2_CHIPS)}")
        sensor = _AEDAT2_CHIPS[kind]
        dtype = np.dtype([("address", ">u4"), ("timeStamp", ">u4")])  # tonic.io.get_aer_events_from_file's
        if (path.stat().st_size - start) % dtype.itemsize:
            raise ValueError(f"{path} is truncated: its AEDAT 2.0 data is not a whole number of 8-byte events")

        def chunks(n: int) -> Iterator[np.ndarray]:
            data = np.memmap(path, dtype=dtype, mode="r", offset=start)
            for i in range(0, len(data), n):
                a, t = data["address"][i:i + n].astype(np.int64), data["timeStamp"][i:i + n].astype(np.int64)
                if kind == "dvs128":  # tonic.io.read_dvs_128's layout
                    yield _as_events((a >> 8) & 0x7F, (a >> 1) & 0x7F, t, a & 0x1)
                else:  # tonic.io.read_davis_346's layout, DVS events only (bit 31 clear; APS/IMU samples set it)
                    dvs = (a >> 31) == 0
                    a, t = a[dvs], t[dvs]
                    yield _as_events(345 - ((a & 4190208) >> 12), 259 - ((a & 2143289344) >> 22), t,
                                     (a & 2048) >> 11)
        return sensor, chunks
    if version >= 3:
        def chunks3(n: int) -> Iterator[np.ndarray]:  # tonic reads AEDAT 3 whole
            ev = tonic.io.get_aer_events_from_file(str(path), version, start)
            a, t = ev["address"].astype(np.int64), ev["timeStamp"].astype(np.int64)
            for i in range(0, len(t), n):  # AEDAT 3.1 polarity events: tonic.io.read_dvs_red's layout
                ai = a[i:i + n]
                yield _as_events((ai >> 17) & 0x7FFF, (ai >> 2) & 0x7FFF, t[i:i + n], (ai >> 1) & 0x1)
        return None, chunks3
    raise ValueError(f"{path}: AEDAT version {version:g} is not supported (2.x, 3.x, or 4 as .aedat4)")


def _percent_header(path: Path) -> list[str]:
    """The ``%`` lines that open a Prophesee file."""
    lines = []
    with open(path, "rb") as f:
        while f.peek(1)[:1] == b"%":
            lines.append(f.readline(4096).decode("latin-1").strip())
            if len(lines) > 1000:
                break
    return lines


def _prophesee_sensor(header: list[str]) -> tuple[int, int, int] | None:
    text = "\n".join(header)
    w = re.search(r"(?i)width[ =](\d+)", text)
    h = re.search(r"(?i)height[ =](\d+)", text)
    if w and h:
        return int(w.group(1)), int(h.group(1)), 2
    g = re.search(r"(?i)geometry\s+(\d+)x(\d+)", text)
    return (int(g.group(1)), int(g.group(2)), 2) if g else None


def _expelliarmus(path: Path, encoding: str, sensor: tuple[int, int, int] | None
                  ) -> tuple[tuple[int, int, int] | None, Callable[[int], Iterator[np.ndarray]]]:
    try:
        from expelliarmus import Wizard
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("Prophesee files need the optional dependency expelliarmus; install it with "
                          "`pip install szo[dvs]`") from None

    def chunks(n: int) -> Iterator[np.ndarray]:
        wizard = Wizard(encoding=encoding, fpath=path, chunk_size=max(n, 16))
        for c in wizard.read_chunk():
            yield _as_events(c["x"], c["y"], c["t"], c["p"])
    return sensor, chunks


def _dat(path: Path) -> tuple[tuple[int, int, int] | None, Callable[[int], Iterator[np.ndarray]]]:
    return _expelliarmus(path, "dat", _prophesee_sensor(_percent_header(path)))


def _raw(path: Path) -> tuple[tuple[int, int, int] | None, Callable[[int], Iterator[np.ndarray]]]:
    header = _percent_header(path)
    text = "\n".join(header).lower()
    m = re.search(r"evt\s*([23])(?:\.0)?", text)
    if m is None:
        raise ValueError(f"{path}: a Prophesee .raw file must state its encoding in its '%' header ('% evt 2.0', "
                         "'% evt 3.0' or '% format EVT3;...'); supported: EVT 2.0, EVT 3.0")
    return _expelliarmus(path, "evt" + m.group(1), _prophesee_sensor(header))


_READERS = {".npy": _npy, ".bin": _nmnist, ".aedat4": _aedat4, ".aedat": _aedat, ".dat": _dat, ".raw": _raw}


def open_event_file(path: str | Path) -> EventFile:
    """The checked event file at ``path`` (module docstring); one ``ValueError`` line when it is missing,
    of a format not supported (naming the supported ones) or unreadable."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in _READERS:
        raise ValueError(f"{path}: unsupported event file format {suffix or '(no suffix)'!r}; supported: "
                         f"{supported_formats()}")
    if not path.is_file():
        raise ValueError(f"event file {path} does not exist (or is not a file)")
    sensor, reader = _READERS[suffix](path)
    return EventFile(path, suffix, sensor, reader)
