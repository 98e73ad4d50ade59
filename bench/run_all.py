"""Run every benchmark (``make bench``): forward, step time, the authors' procedure, memory, convergence; JSON + PNG in bench/results/.

    python bench/run_all.py            # full
    python bench/run_all.py --quick    # smoke run of each
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = ("forward.py", "step.py", "probe.py", "reference.py", "memory.py", "converge.py")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    ap.add_argument("--only", nargs="+", choices=BENCHES, default=list(BENCHES))
    a = ap.parse_args(argv)
    failed = []
    for b in a.only:
        path = HERE / b
        if not path.exists():
            print(f"== {b}: not present, skipped", flush=True)
            failed.append(b)
            continue
        t0 = time.perf_counter()
        print(f"== {b}", flush=True)
        rc = subprocess.call([sys.executable, str(path)] + (["--quick"] if a.quick else []))
        print(f"== {b}: rc={rc} in {time.perf_counter() - t0:.0f}s", flush=True)
        if rc != 0:
            failed.append(b)
    if failed:
        print("failed or missing:", ", ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
