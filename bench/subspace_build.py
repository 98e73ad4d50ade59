"""Benchmark of subspace_store.build_subspace (streaming Gram PCA).

(a) a synthetic on-disk trajectory of N samples of d_large parameters (default N=150,
    d=11.2M = Spike-ResNet18) -> build k=60: wall time and peak RSS (target: peak RSS below
    size(P) + 1 GB);
(b) N samples of d_compare (default 2M): our builder vs scikit-learn PCA (svd_solver 'full'
    and 'randomized', input float32 as loaded), each in a fresh subprocess, with the accuracy of
    each against ours (largest principal angle, explained-variance difference).

Writes bench/results/subspace_build.json and prints a table. The synthetic trajectories are
written under --workdir and deleted afterwards.

    nice -n 10 .venv/bin/python bench/subspace_build.py            # full run (~6.7 GB temp disk)
    .venv/bin/python bench/subspace_build.py --d-large 1000000 --d-compare 200000   # quick
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
# common also puts this checkout first on sys.path (the workers import its szo, subspace_store)
from common import machine_info, proc_status_kb, run_json_worker  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def peak_rss_mb() -> dict:
    """Peak resident set size of this process: VmHWM from /proc and ru_maxrss."""
    return {"vmhwm_mb": proc_status_kb("VmHWM") / 1024,
            "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


class _Flat(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.theta = nn.Parameter(torch.zeros(d))


def write_synthetic(path: Path, n: int, d: int, seed: int = 0) -> None:
    """A random-walk trajectory (theta_i = theta_{i-1} + noise), written with TrajectoryRecorder.

    A random walk has the decaying PCA spectrum of real training trajectories (lambda_j ~ 1/j^2:
    the first 10 components explain > 90 %), so the top-k subspace is well determined.
    """
    from tqdm import tqdm

    from szo.trajectory import TrajectoryRecorder

    g = torch.Generator().manual_seed(seed)
    m = _Flat(d)
    with torch.no_grad():
        m.theta.normal_(0.0, 0.05, generator=g)
    step = torch.empty(d)
    rec = TrajectoryRecorder(path, m, model_name=f"synthetic-{d}")
    for i in tqdm(range(n), desc=f"write N={n} d={d}", leave=False, mininterval=5):
        if i:
            with torch.no_grad():
                m.theta.add_(step.normal_(0.0, 1e-3, generator=g))
        rec.record(i, i)


# ----------------------------------------------------------------------------- workers
# CPU seconds: time.process_time() (user + system of this process; fairer than wall time on a
# shared machine)
def worker_ours(traj: str, k: int, out: str | None) -> dict:
    from subspace_store import build_subspace

    t0, c0 = time.perf_counter(), time.process_time()
    sub = build_subspace(traj, k, progress=False)
    wall = time.perf_counter() - t0
    res = {"wall_s": wall, "cpu_s": time.process_time() - c0, **peak_rss_mb(),
           "basis_mb": sub.basis.numel() * 4 / 2**20, "evr": sub.explained_variance_ratio.tolist()}
    if out:
        from safetensors.torch import save_file

        save_file({"basis": sub.basis}, out)
    return res


def worker_sklearn(traj: str, k: int, solver: str, out: str | None) -> dict:
    import numpy as np
    from sklearn.decomposition import PCA

    from szo.trajectory import Trajectory

    t0, c0 = time.perf_counter(), time.process_time()
    tr = Trajectory(traj)
    X = np.empty((len(tr), tr.d), dtype=np.float32)
    for i in range(len(tr)):
        X[i] = tr[i].numpy()
    t_load = time.perf_counter() - t0
    pca = PCA(n_components=k, svd_solver=solver, random_state=0).fit(X)
    wall = time.perf_counter() - t0
    res = {"wall_s": wall, "cpu_s": time.process_time() - c0, "load_s": t_load, **peak_rss_mb(),
           "evr": pca.explained_variance_ratio_.tolist()}
    if out:
        np.save(out, pca.components_.astype(np.float32))
    return res


def run_worker(args: list[str]) -> dict:
    return run_json_worker([sys.executable, __file__, "--worker", *args])


def max_angle(p_path: str, c_path: str) -> float:
    import numpy as np
    import scipy.linalg
    from safetensors.torch import load_file

    P = load_file(p_path)["basis"].double().numpy()
    C = np.load(c_path).astype(np.float64).T
    return float(scipy.linalg.subspace_angles(P, C).max())


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=150, help="samples N")
    ap.add_argument("--k", type=int, default=60, help="subspace dimension k")
    ap.add_argument("--d-large", type=int, default=11_200_000, help="d for part (a); 0 skips it")
    ap.add_argument("--d-compare", type=int, default=2_000_000, help="d for part (b); 0 skips it")
    ap.add_argument("--solvers", default="full,randomized", help="sklearn svd_solvers to compare in (b)")
    ap.add_argument("--workdir", default=tempfile.gettempdir(), help="where the temporary trajectories go")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "subspace_build.json"))
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a.worker:
        kind, traj, k, *rest = a.worker
        out = rest[1] if kind == "sklearn" and len(rest) > 1 else (rest[0] if kind == "ours" and rest else None)
        res = worker_ours(traj, int(k), out) if kind == "ours" else worker_sklearn(traj, int(k), rest[0], out)
        print(json.dumps(res))
        return 0

    results: dict = {"host": {**machine_info(), "loadavg_start": os.getloadavg()}, "N": a.n, "k": a.k}
    work = Path(tempfile.mkdtemp(prefix="szo-bench-", dir=a.workdir))
    try:
        if a.d_large:
            traj = work / "large"
            t0 = time.perf_counter()
            write_synthetic(traj, a.n, a.d_large)
            t_write = time.perf_counter() - t0
            r = run_worker(["ours", str(traj), str(a.k)])
            p_mb = a.d_large * a.k * 4 / 2**20
            results["large"] = {"d": a.d_large, "write_s": t_write, "trajectory_gb": a.n * a.d_large * 4 / 2**30,
                                "build": {x: r[x] for x in ("wall_s", "cpu_s", "vmhwm_mb", "ru_maxrss_mb")},
                                "basis_mb": p_mb, "target_peak_mb": p_mb + 1024,
                                "meets_target": r["vmhwm_mb"] < p_mb + 1024,
                                "evr_first10": sum(r["evr"][:10])}
            shutil.rmtree(traj)
        if a.d_compare:
            traj = work / "compare"
            write_synthetic(traj, a.n, a.d_compare, seed=1)
            p_ours = str(work / "ours.safetensors")
            ours = run_worker(["ours", str(traj), str(a.k), p_ours])
            comp = {"d": a.d_compare, "ours": {x: ours[x] for x in ("wall_s", "cpu_s", "vmhwm_mb", "ru_maxrss_mb")}}
            for solver in [s for s in a.solvers.split(",") if s]:
                c_path = str(work / f"sk_{solver}.npy")
                sk = run_worker(["sklearn", str(traj), str(a.k), solver, c_path])
                comp[f"sklearn_{solver}"] = {
                    **{x: sk[x] for x in ("wall_s", "cpu_s", "load_s", "vmhwm_mb", "ru_maxrss_mb")},
                    "speedup_ours": sk["wall_s"] / ours["wall_s"],
                    "cpu_speedup_ours": sk["cpu_s"] / ours["cpu_s"],
                    "memory_ratio_ours": sk["vmhwm_mb"] / ours["vmhwm_mb"],
                    "max_principal_angle_vs_ours_rad": max_angle(p_ours, c_path),
                    "max_abs_evr_diff_vs_ours": max(abs(x - y) for x, y in zip(sk["evr"], ours["evr"])),
                }
                os.unlink(c_path)
            results["compare"] = comp
    finally:
        shutil.rmtree(work, ignore_errors=True)

    results["host"]["loadavg_end"] = os.getloadavg()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from szo.io import atomic_write_json

    atomic_write_json(out, results)
    print(f"\nsubspace build benchmark (N={a.n}, k={a.k}, {os.cpu_count()} CPUs) -> {out}")
    print(f"load average start/end: {results['host']['loadavg_start'][0]:.1f} / {results['host']['loadavg_end'][0]:.1f}")
    print(f"{'case':<28} {'d':>10} {'wall s':>8} {'CPU s':>8} {'peak RSS MB':>12} {'notes'}")
    if "large" in results:
        L = results["large"]
        print(f"{'ours (streaming Gram)':<28} {L['d']:>10} {L['build']['wall_s']:>8.1f} {L['build']['cpu_s']:>8.1f} {L['build']['vmhwm_mb']:>12.0f} "
              f"P={L['basis_mb']:.0f} MB, target < {L['target_peak_mb']:.0f} MB: {'met' if L['meets_target'] else 'MISSED'}")
    if "compare" in results:
        C = results["compare"]
        print(f"{'ours (streaming Gram)':<28} {C['d']:>10} {C['ours']['wall_s']:>8.1f} {C['ours']['cpu_s']:>8.1f} {C['ours']['vmhwm_mb']:>12.0f}")
        for key, v in C.items():
            if key.startswith("sklearn_"):
                print(f"{key:<28} {C['d']:>10} {v['wall_s']:>8.1f} {v['cpu_s']:>8.1f} {v['vmhwm_mb']:>12.0f} "
                      f"ours {v['speedup_ours']:.2f}x faster (CPU {v['cpu_speedup_ours']:.2f}x), {v['memory_ratio_ours']:.2f}x less memory; "
                      f"angle {v['max_principal_angle_vs_ours_rad']:.1e} rad")
    return 0


if __name__ == "__main__":
    sys.exit(main())
