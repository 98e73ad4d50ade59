"""Seed 004's integer learner decides the same integers on every CPU (issue 48): its losses are taken
in float64 from the integer readout, turned into fixed point before they are differenced, and every
sum after that is int64. Run here under PyTorch's generic kernels (``ATEN_CPU_CAPABILITY=default``, as
another CPU would pick), AVX2 and the best this CPU has, with 1 and 2 threads: the integers after three
steps of each perturbation mode must be the same bits."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]

CHILD = r'''
import hashlib, sys
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from szo.hw import to_fixed
from szo.hw.optim.mcu import MCUZO
from szo.models import create

X, y = load_digits(return_X_y=True)
x = torch.tensor(X[:16], dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
y = torch.tensor(y[:16])
h = hashlib.sha256()
for perturbation in ("adaptive", "node", "weight"):
    torch.manual_seed(0)
    model = create("spike_convnet", num_classes=10, T=2, width=4)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.fill_(-0.5)
            m.running_var.fill_(0.25)
    net = to_fixed(model.eval())
    net(x)
    net.freeze_weights()
    opt = MCUZO(net, q=3, lr=0.05, seed=12345, perturbation=perturbation)
    moved = 0
    for _ in range(3):
        before = [s.w_int.clone() for s in net.int_weights.values()]
        opt.step(lambda: F.cross_entropy(net(x).mean(0), y, reduction="none"))
        moved += sum(int((s.w_int != b).sum()) for s, b in zip(net.int_weights.values(), before))
    assert moved > 0, perturbation
    for name, s in net.int_weights.items():
        h.update(name.encode()); h.update(s.w_int.numpy().tobytes()); h.update(s.bias_mant.numpy().tobytes())
print(torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(), h.hexdigest())
'''


def _run(capability: str, threads: int) -> tuple[str, str]:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    cap, n, digest = out.stdout.split()[-3:]
    assert int(n) == threads
    return cap, digest


@pytest.mark.slow
def test_integers_are_the_same_under_every_capability_and_thread_count():
    native = torch.backends.cpu.get_cpu_capability().lower()  # a capability above the CPU's dies of SIGILL
    caps = ["default"] + (["avx2"] if native.startswith("avx512") else []) + ([native] if native != "default" else [])
    runs = {(c, t): _run(c, t) for c in caps for t in (1, 2)}
    caps = {cap for cap, _ in runs.values()}
    assert "DEFAULT" in caps, runs  # the generic kernels did run
    digests = {digest for _, digest in runs.values()}
    assert len(digests) == 1, runs
