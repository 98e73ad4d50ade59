"""szo's SZO step vs the authors' procedure vs the floor, eager and compiled.

The authors' procedure (our own implementation of what their published code does for one
SZO-RGE step, paper App. B Algorithm 1 + App. G): the training model plus a "+" and a "-"
network; per query j the model's state_dict is copied into both, the flat parameter vector
theta +/- mu P z_j is written into them (``vector_to_parameters``), both run a forward, and
the d-dimensional gradient estimate accumulates ``(L+ - L-) / (2 mu q) P z_j``; then
``torch.optim.SGD`` (momentum) updates the model from that gradient, and one unperturbed
train-mode forward of the model updates its BN running statistics and gives the logged
loss. szo's ``SZO.step`` (loop engine) perturbs the parameters in place along k-dimensional
coordinates, restores them bit-exactly, freezes / commits BN statistics itself and updates
k coordinates.

The authors' stack: the same procedure on a twin of the model that runs SpikingJelly's own
``LIFNode`` and NCHW activations (``common.stock_twin``: same parameters, same function), i.e.
what their published code runs; szo's models use a no-grad LIF forward and, on CPU,
channels-last activations (docs/performance.md).

Ratios (one process, interleaved rounds, medians):
    reference / szo       -- the speed-up of szo's step on the same forward (target >= 1.2 on CPU)
    reference on stock / szo -- the speed-up over the authors' procedure on their stack
    szo / (2q x forward)  -- szo's overhead over the floor of its 2q probe forwards
    reference / ((2q + 1) x forward) -- the reference's overhead over its floor
    compiled szo / (2q x eager forward) -- target <= 0.5 on Spike-ResNet20 (CPU)

Before timing, one step of each procedure from the same state with the same z is checked to
give the same parameter update (so both compute the same thing).

    OMP_NUM_THREADS=1 python bench/reference.py                    # Spike-ResNet20, T=4, batch 32, q=10
    OMP_NUM_THREADS=1 python bench/reference.py --quick            # digits, smoke run
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RandomSubspace, machine_info, make_batch, make_model, set_threads, stock_twin, timed, write_result  # noqa: E402

from szo.functional.zo import sample_gaussian  # noqa: E402
from szo.losses import tet_loss  # noqa: E402
from szo.models.compiled import graph_count  # noqa: E402
from szo.optim import SZO  # noqa: E402
from szo.precision import precision_policy  # noqa: E402


class AuthorsRGE:
    """One SZO-RGE step as the authors' code does it: state_dict copies into a + and a - net."""

    def __init__(self, model, basis: torch.Tensor, *, q: int, mu: float, lr: float, momentum: float,
                 generator: torch.Generator):
        # P on the model's device (a CPU basis on a CUDA model crashed the first GPU run); the draws
        # stay on the CPU generator, as SZO's do, and move with each direction
        dev = next(model.parameters()).device
        self.model, self.P, self.q, self.mu, self.g = model, basis.to(dev), q, mu, generator
        self.plus, self.minus = copy.deepcopy(model), copy.deepcopy(model)
        self.sgd = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        self.forward_passes = 0

    @torch.no_grad()
    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        model, P, mu = self.model, self.P, self.mu
        theta = parameters_to_vector(model.parameters())
        grad = torch.zeros_like(theta)
        Z = sample_gaussian(self.q, P.shape[1], self.g, dtype=torch.float64)  # the same draws as SZO's
        for z in Z:
            v = P @ z.to(device=P.device, dtype=P.dtype)
            losses = []
            for net, sign in ((self.plus, 1.0), (self.minus, -1.0)):
                net.load_state_dict(model.state_dict())  # BN statistics as before the step, every query
                vector_to_parameters(theta + sign * mu * v, net.parameters())
                losses.append(float(tet_loss(net(x), y)))
            grad += (losses[0] - losses[1]) / (2 * mu * self.q) * v
        self.forward_passes += 2 * self.q
        off = 0
        for p in model.parameters():
            p.grad = grad[off:off + p.numel()].view_as(p).clone()
            off += p.numel()
        self.sgd.step()
        loss = float(tet_loss(model(x), y))  # the unperturbed forward: BN running statistics, logged loss
        self.forward_passes += 1
        return loss


def check_same_update(config: str, T: int, x, y, sub, q: int, device) -> float:
    """Max |d theta_ref - d theta_szo| / max |d theta| after one step from the same state and z."""
    ups = []
    for proc in ("reference", "szo"):
        model, _ = make_model(config, T, device)
        theta0 = parameters_to_vector(model.parameters()).detach().clone()
        if proc == "reference":
            AuthorsRGE(model, sub.basis, q=q, mu=1e-2, lr=1.0, momentum=0.9,
                       generator=torch.Generator().manual_seed(0)).step(x, y)
        else:
            opt = SZO(model.parameters(), sub, mu=1e-2, lr=1.0, momentum=0.9, estimator="rge", q=q, model=model,
                      generator=torch.Generator().manual_seed(0), scale="absolute")
            opt.step(lambda: tet_loss(model(x), y))
        ups.append(parameters_to_vector(model.parameters()).detach() - theta0)
    err = float((ups[0] - ups[1]).abs().max() / ups[1].abs().max())
    if not err < 1e-3:
        raise RuntimeError(f"the reference and SZO.step disagree: relative update difference {err:.2e}")
    return err


def measure(config: str, T: int, batch: int, q: int, reps: int, compiled: bool, device) -> dict:
    """Interleaved rounds of (3 eager forwards, 3 eager forwards of the stock stack, [3 compiled
    forwards], szo step, reference step[, reference step on the stock stack (eager mode only)])."""
    model, shape = make_model(config, T, device)
    x, y = make_batch(shape, batch, device)
    sub = RandomSubspace(model.num_params(), 20 if config == "resnet20" else 8)
    if compiled:
        model.set_compile(True)
    g0 = graph_count()
    t0 = time.perf_counter()
    opt = SZO(model.parameters(), sub, mu=1e-3, lr=1e-3, momentum=0.9, estimator="rge", q=q, model=model,
              generator=torch.Generator().manual_seed(0), scale="absolute")
    ref_model = copy.deepcopy(model)  # its own trajectory, same starting point
    ref = AuthorsRGE(ref_model, sub.basis.to(device), q=q, mu=1e-3, lr=1e-3, momentum=0.9,
                     generator=torch.Generator().manual_seed(0))
    # the authors' stack: SpikingJelly's LIFNode and NCHW activations, eager (their code does not compile)
    stock_model = stock_twin(model).set_compile(False)
    stock = None if compiled else AuthorsRGE(copy.deepcopy(stock_model), sub.basis.to(device), q=q, mu=1e-3,
                                              lr=1e-3, momentum=0.9, generator=torch.Generator().manual_seed(0))

    def szo_step():
        opt.step(lambda: tet_loss(model(x), y))

    def ref_step():
        ref.step(x, y)

    def fwd(m, comp):
        old = m.compile_opts
        m.set_compile(comp)

        @torch.no_grad()
        def f():
            m(x)
        try:
            return timed(f)
        finally:
            m.compile_opts = old

    def stock_step():
        stock.step(x, y)

    # warm-up: compiles every graph used (train-mode no-grad forward at this shape), loads kernels
    szo_step()
    ref_step()
    fwd(model, False)
    fwd(stock_model, False)
    if stock is not None:
        stock_step()
    warm_s = time.perf_counter() - t0
    graphs_warm = graph_count() - g0
    # (wall, process CPU) seconds; with one torch thread the CPU clock counts this process's own
    # work and is far less sensitive to other jobs on a shared machine than the wall clock
    t: dict[str, list[tuple[float, float]]] = {"szo": [], "ref": [], "stock": [], "fe": [], "fs": [], "fc": []}
    for i in range(reps):
        t["fe"] += [fwd(model, False) for _ in range(3)]
        t["fs"] += [fwd(stock_model, False) for _ in range(3)]
        if compiled:
            t["fc"] += [fwd(model, True) for _ in range(3)]
        t["szo"].append(timed(szo_step))
        t["ref"].append(timed(ref_step))
        if stock is not None:
            t["stock"].append(timed(stock_step))
        print(f"  round {i + 1}/{reps} (wall / cpu s): szo {t['szo'][-1][0]:.3f} / {t['szo'][-1][1]:.3f}  "
              f"ref {t['ref'][-1][0]:.3f} / {t['ref'][-1][1]:.3f}  "
              + (f"ref on stock {t['stock'][-1][0]:.3f} / {t['stock'][-1][1]:.3f}  " if stock is not None else "")
              + f"fwd eager {t['fe'][-1][0]:.3f} / {t['fe'][-1][1]:.3f}  stock {t['fs'][-1][0]:.3f} / {t['fs'][-1][1]:.3f}"
              + (f"  compiled {t['fc'][-1][0]:.3f} / {t['fc'][-1][1]:.3f}" if compiled else ""), flush=True)
    recompiles = graph_count() - g0 - graphs_warm
    row = dict(config=config, T=T, batch=batch, q=q, compiled=compiled, reps=reps, samples=t,
               warmup_s=warm_s, graphs_compiled=graphs_warm, recompiles_while_timing=recompiles)
    for clock, c in (("wall", 0), ("cpu", 1)):
        med = {key: statistics.median(v[c] for v in vals) for key, vals in t.items() if vals}
        r = dict(t_fwd_eager=med["fe"], t_fwd_stock=med["fs"], fwd_eager_over_stock=med["fe"] / med["fs"],
                 t_szo=med["szo"], t_ref=med["ref"], ref_over_szo=med["ref"] / med["szo"],
                 szo_over_one_forward=med["szo"] / med["fe"],  # GPU target for q = 1: <= 3.3 (with the BN forward)
                 szo_over_floor=med["szo"] / (2 * q * med["fe"]), ref_over_floor=med["ref"] / ((2 * q + 1) * med["fe"]),
                 szo_over_stock_floor=med["szo"] / (2 * q * med["fs"]))
        if "stock" in med:
            r.update(t_ref_stock=med["stock"], ref_stock_over_szo=med["stock"] / med["szo"],
                     ref_stock_over_floor=med["stock"] / ((2 * q + 1) * med["fs"]))
        if compiled:
            r.update(t_fwd_compiled=med["fc"], compiled_fwd_over_eager=med["fc"] / med["fe"],
                     szo_over_floor_compiled=med["szo"] / (2 * q * med["fc"]),
                     ref_over_floor_compiled=med["ref"] / ((2 * q + 1) * med["fc"]))
        row[clock] = r
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: digits, batch 8, T=2, q=2, 1 round")
    ap.add_argument("--config", default="resnet20", choices=["digits", "resnet20"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--T", type=int, default=4)
    ap.add_argument("--q", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3, help="interleaved timing rounds (median)")
    ap.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", default="fp32", help="arithmetic of both procedures (szo.precision; default fp32, "
                                                         "what precision: auto gives forward-only training)")
    a = ap.parse_args(argv)
    if a.quick:
        a.config, a.batch, a.T, a.q, a.reps = "digits", 8, 2, 2, 1
    set_threads(a.threads)
    device = torch.device(a.device)
    with precision_policy(a.precision, None, device).scope():  # not PyTorch's defaults (TF32 convolutions on CUDA)
        return _main(a, device)


def _main(a: argparse.Namespace, device: torch.device) -> int:
    t0 = time.perf_counter()
    x, y = make_batch(make_model(a.config, a.T, device)[1], a.batch, device)
    model, _ = make_model(a.config, a.T, device)
    err = check_same_update(a.config, a.T, x, y, RandomSubspace(model.num_params(), 8), a.q, device)
    print(f"same update check: relative difference {err:.1e}", flush=True)
    rows = []
    for mode in a.modes:
        print(f"{a.config} T={a.T} batch={a.batch} q={a.q} {mode}", flush=True)
        row = measure(a.config, a.T, a.batch, a.q, a.reps, mode == "compiled", device)
        rows.append(row)
        for clock in ("wall", "cpu"):
            r = row[clock]
            msg = (f"{mode:8s} {clock:4s} szo {r['t_szo']:.3f}s ref {r['t_ref']:.3f}s fwd {r['t_fwd_eager'] * 1e3:.1f}ms "
                   f"(stock {r['t_fwd_stock'] * 1e3:.1f}ms) | ref/szo {r['ref_over_szo']:.2f}  "
                   + (f"ref on stock/szo {r['ref_stock_over_szo']:.2f}  " if "ref_stock_over_szo" in r else "")
                   + f"szo/(2q fwd) {r['szo_over_floor']:.2f}  szo/(2q stock fwd) {r['szo_over_stock_floor']:.2f}  "
                   f"ref/((2q+1) fwd) {r['ref_over_floor']:.2f}  szo/fwd {r['szo_over_one_forward']:.2f}")
            if mode == "compiled":
                msg += f" | compiled fwd/eager {r['compiled_fwd_over_eager']:.2f}"
            print(msg, flush=True)
        if mode == "compiled":
            print(f"  warm-up incl. compile {row['warmup_s']:.0f}s, {row['graphs_compiled']} graph(s) compiled, "
                  f"{row['recompiles_while_timing']} recompiles while timing", flush=True)
    out = dict(benchmark="reference", quick=a.quick, args=vars(a), machine=machine_info(), update_check=err,
               rows=rows, wall_s=time.perf_counter() - t0)
    print("wrote", write_result("reference_quick" if a.quick else f"reference_{a.config}_q{a.q}", out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
