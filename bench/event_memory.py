"""Peak memory of ``szo demo dvs-stream --source BIG.bin``: the recording is read chunk by chunk
(``szo.data.dvs.FileEventStream``), so the peak does not grow with the file.

Writes an N-MNIST-format ``.bin`` of ``--mb`` megabytes (5 bytes per event, random pixels on the 34 x 34
sensor, increasing timestamps within the format's 23-bit range), a tiny 34 x 34 model as a NIR file,
then runs the demo in a child process (``--adapt none --no-compare``, 50 ms windows) and reports the
child's peak resident set size (``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss``).

    python bench/event_memory.py --mb 200                       # this checkout
    python bench/event_memory.py --mb 200 --szo /path/to/older  # another checkout (PYTHONPATH), to compare
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def write_bin(path: Path, mb: float, seed: int = 0) -> int:
    """An N-MNIST ``.bin`` of about ``mb`` MB, written in blocks (no marker events: t < 2**23 us)."""
    n = int(mb * 1e6) // 5
    rng = np.random.default_rng(seed)
    t_all = np.sort(rng.integers(0, 2**23, n, dtype=np.int64))
    with open(path, "wb") as f:
        for i in range(0, n, 1 << 22):
            t = t_all[i:i + (1 << 22)]
            m = len(t)
            raw = np.empty((m, 5), np.uint8)
            raw[:, 0], raw[:, 1] = rng.integers(0, 34, m), rng.integers(0, 34, m)
            p = rng.integers(0, 2, m)
            raw[:, 2] = (p << 7) | ((t >> 16) & 0x7F)
            raw[:, 3], raw[:, 4] = (t >> 8) & 0xFF, t & 0xFF
            f.write(raw.tobytes())
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=200.0)
    ap.add_argument("--szo", default=str(ROOT), help="checkout whose szo runs the demo (PYTHONPATH)")
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    args = ap.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="szo-event-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    work = work.resolve()
    rec, model = work / f"big_{args.mb:g}mb.bin", work / "m.nir"
    if not rec.is_file():
        write_bin(rec, args.mb)
    if not model.is_file():
        subprocess.run([sys.executable, "-c", (
            "import torch; from szo.models import create; from szo.export import to_nir, write_nir; "
            "torch.manual_seed(0); m = create('spike_convnet', in_channels=2, num_classes=10, T=5, width=4).eval(); "
            f"write_nir(to_nir(m, (2, 34, 34), metadata={{'bin_us': 10000, 'sensor_size': [34, 34, 2], "
            f"'duration_us': 300000}}), {str(model)!r})")], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    out = work.resolve() / f"out_{time.time_ns()}"
    env = {**os.environ, "PYTHONPATH": args.szo, "OMP_NUM_THREADS": "1"}
    tic = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "szo", "demo", "dvs-stream", "--source", str(rec), "--model",
                           str(model), "--adapt", "none", "--no-compare", "--window-ms", "50", "--print-every", "0",
                           "--out", str(out)], env=env, cwd=args.szo, capture_output=True, text=True)
    wall = time.perf_counter() - tic
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    result = {"file_mb": round(rec.stat().st_size / 1e6, 1), "events": rec.stat().st_size // 5, "szo": args.szo,
              "rc": proc.returncode, "peak_rss_mb": round(peak_mb), "wall_s": round(wall, 1),
              "error": proc.stderr.strip().splitlines()[-1] if proc.returncode else None}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
