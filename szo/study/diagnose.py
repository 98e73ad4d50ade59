"""``szo diagnose RUN_DIR``: how good are the ZO gradient estimates on this run's model?

For the run's model (``load_run_model``: parameters and BN buffers) and one fixed batch of
its train set (the first ``batch`` images, no augmentation), the reference is the BPTT
(surrogate) gradient from autograd, in train mode as during training. Every configuration
draws estimates and reports :func:`szo.functional.diagnostics.estimate_statistics`:

* space: ``subspace`` (the run's subspace from the store, or ``--subspace NAME``) and ``full``,
* estimator: ``cge`` (along the k basis vectors; in the full space only if d <= ``max_full_cge``,
  2d forwards) and ``rge`` for each q,
* each mu,
* ``activation``: the SNN and its ReLU twin (same weights, ``model.activation=relu``, T = 1;
  its reference gradient is the ReLU net's true gradient).

The model's weights and BN buffers are left exactly as loaded. Results go to
``RUN_DIR/diagnose.json`` (or ``--out``), one row per configuration, with the closed-form
mu -> 0 RGE variance next to the measured one, and a plot next to it (``.png``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, ContextManager, Sequence

import torch

from szo import plots
from szo.build import build_model, load_run_model, loss_for, subspace_store_for
from szo.data import get_dataset, make_loader
from szo.functional.diagnostics import draw_estimates, estimate_statistics, rge_variance_closed_form
from szo.io import atomic_write_json
from szo.zo import ProbeGuard, get_estimator

__all__ = ["diagnose_model", "diagnose_run", "run_batch", "plot_diagnose", "render"]


def _check_list(name: str, values: Sequence[Any], kind: type) -> list:
    vals = list(values)
    if not vals or any(isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else int) or v <= 0
                       for v in vals):
        raise ValueError(f"{name} must be a non-empty list of positive {kind.__name__}s, got {values!r}")
    return [kind(v) for v in vals]


def surrogate_gradient(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn) -> torch.Tensor:
    """The autograd (BPTT surrogate) gradient of ``loss_fn(model(x), y)`` as a flat [d] vector, in
    train mode; BN running statistics are restored afterwards."""
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    was = model.training
    model.train()
    try:
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in model.parameters()]).detach().clone()
        model.zero_grad(set_to_none=True)
    finally:
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(buffers[k])
        model.train(was)
    return grad


def diagnose_model(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn, *,
                   directions: torch.Tensor | None, mus: Sequence[float], qs: Sequence[int], repeats: int = 20,
                   seed: int = 0, max_full_cge: int = 2000, label: str = "snn", spaces: Sequence[str] = ("subspace", "full"),
                   scope: Callable[[], ContextManager] = contextlib.nullcontext,
                   keep_estimates: bool = False) -> list[dict[str, Any]]:
    """Statistics rows for every (space, estimator, mu, q) on one model and batch (see module doc).

    ``scope``: the context every probe forward runs in (e.g. a ``szo.precision`` policy's
    ``scope``); the reference gradient is computed outside it, in the caller's arithmetic.
    ``keep_estimates``: each row also carries its estimates (``"estimates"``, ``[R, d]``)."""
    mus, qs = _check_list("mus", mus, float), _check_list("qs", qs, int)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 2:
        raise ValueError(f"repeats must be an int >= 2 (a variance needs two draws), got {repeats!r}")
    theta = model.flat_params().detach().clone()
    if directions is not None and (directions.dim() != 2 or directions.shape[0] != theta.numel()):
        raise ValueError(f"directions must be [d, k] with d = {theta.numel()}, got {tuple(directions.shape)}")
    grad = surrogate_gradient(model, x, y, loss_fn)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    was = model.training
    model.train()
    # the optimizers' probe rule (szo.zo.ProbeGuard): every probe starts from the same BN running
    # statistics and reset neurons, its loss checked; the estimators are szo.functional's pure ones
    guard = ProbeGuard(model, "szo diagnose")
    guard.bn.snapshot()

    def loss_at(v: torch.Tensor) -> float:
        model.load_flat_params(v)
        with scope():
            return guard.probe(lambda: loss_fn(model(x), y), "diagnose probe")

    rows: list[dict[str, Any]] = []
    gen = torch.Generator().manual_seed(seed)
    unknown = sorted(set(spaces) - {"subspace", "full"})
    if unknown:
        raise ValueError(f"unknown space(s) {unknown}; valid: subspace, full")
    todo = ([("subspace", directions.to(theta.dtype))] if directions is not None and "subspace" in spaces else []) \
        + ([("full", None)] if "full" in spaces else [])
    try:
        for space, dirs in todo:
            for mu in mus:
                configs = [("rge", q) for q in qs]
                if dirs is not None or theta.numel() <= max_full_cge:
                    configs.insert(0, ("cge", None))
                for est, q in configs:
                    kind = get_estimator(est)  # coordinate (deterministic: drawn once) or random directions
                    e = draw_estimates(loss_at, theta, dirs, mu, estimator=est, q=q or 1,
                                       repeats=1 if kind.coordinate else repeats, generator=gen)
                    row = {"model": label, "space": space, "estimator": est, "mu": mu, "q": q,
                           "k": theta.numel() if dirs is None else dirs.shape[1], "d": theta.numel(),
                           **estimate_statistics(e, grad, dirs)}
                    if not kind.coordinate:
                        row["variance_closed_form"] = rge_variance_closed_form(grad, dirs, q)
                    row["forwards_per_estimate"] = kind.probes(row["k"], q or 1)
                    if keep_estimates:
                        row["estimates"] = e
                    rows.append(row)
    finally:
        model.load_flat_params(theta)
        with torch.no_grad():
            for k, b in model.named_buffers():
                b.copy_(buffers[k])
        model.train(was)
    return rows


def run_batch(cfg: dict[str, Any], batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``batch`` images of the run's train set (no augmentation) as one batch."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    d = cfg["data"]
    ds = get_dataset(d["name"], "train", augment=False if d["augment"] is not None else None,
                     data_dir=d["data_dir"], download=d["download"], **d["kwargs"])
    return next(iter(make_loader(torch.utils.data.Subset(ds, range(min(batch, len(ds)))), batch, shuffle=False)))


def diagnose_run(run_dir: str | os.PathLike, *, subspace: str | None = None, mus: Sequence[float] = (0.01, 0.1, 1.0),
                 qs: Sequence[int] = (1, 10), repeats: int = 20, batch: int = 64, twin: bool = True,
                 max_full_cge: int = 2000, seed: int = 0, out: str | os.PathLike | None = None) -> dict[str, Any]:
    """Diagnose a run directory's model (SNN and, with ``twin``, its ReLU twin); writes JSON."""
    model, cfg = load_run_model(run_dir)
    x, y = run_batch(cfg, batch)
    loss_fn = loss_for(cfg)
    name = subspace or cfg["subspace"]["name"]
    store = subspace_store_for(cfg)
    directions = store.load(name, model).basis if name and name in store else None
    if subspace and directions is None:
        raise ValueError(f"subspace {subspace!r} is not in the store {cfg['subspace']['root']}; valid: {store.list()}")
    rows = diagnose_model(model, x, y, loss_fn, directions=directions, mus=mus, qs=qs, repeats=repeats,
                          seed=seed, max_full_cge=max_full_cge, label="snn")
    if twin:
        tcfg = dataclasses.replace(cfg, model=cfg.model.replace(activation="relu", T=1))  # the ReLU twin, T = 1
        relu = build_model(tcfg)
        relu.load_state_dict(model.state_dict(), strict=True)
        rows += diagnose_model(relu, x, y, loss_fn, directions=directions, mus=mus, qs=qs, repeats=repeats,
                               seed=seed, max_full_cge=max_full_cge, label="relu-twin")
    result = {"run_dir": str(Path(run_dir).resolve()), "subspace": name if directions is not None else None,
              "batch": int(y.shape[0]), "repeats": repeats, "seed": seed, "rows": rows}
    path = Path(out or Path(run_dir) / "diagnose.json")
    atomic_write_json(path, result)
    plot_diagnose(result, path.with_suffix(".png"))
    return result


def plot_diagnose(result: dict[str, Any], path: str | os.PathLike) -> None:
    """Cosine to the BPTT gradient (left) and variance (right, log) against mu, one line per
    (model, space, estimator, q)."""
    series: dict[str, list[tuple[float, float, float]]] = {}
    for r in result["rows"]:
        key = f"{r['model']} {r['space']} {r['estimator'].upper()}" + (f" q={r['q']}" if r["q"] else "")
        series.setdefault(key, []).append((r["mu"], r["cosine"], r["variance"]))
    plt = plots.pyplot()
    # one legend under both panels (it covered the cosine curves inside the panel)
    fig, (ax_c, ax_v) = plt.subplots(1, 2, figsize=(11, 4 + 0.25 * -(-len(series) // 3)))
    for key, pts in series.items():
        pts.sort()
        mus = [p[0] for p in pts]
        (line,) = ax_c.plot(mus, [p[1] for p in pts], marker="o", label=key)
        if any(p[2] > 0 for p in pts):  # same colour as its cosine line
            ax_v.plot(mus, [p[2] for p in pts], marker="o", label=key, color=line.get_color())
    ax_c.set(xscale="log", xlabel="mu", ylabel="mean cos(g_hat, g_BPTT)", title="cosine to the BPTT gradient")
    ax_v.set(xscale="log", yscale="log", xlabel="mu", ylabel="trace Cov(g_hat)", title="variance (RGE)")
    handles, labels = ax_c.get_legend_handles_labels()
    plots.legend_below(fig, handles, labels, ncol=3)
    plots.save_figure(fig, path, layout=False)


def render(result: dict[str, Any]) -> str:
    """A plain-text table of the rows."""
    head = f"{'model':<10} {'space':<8} {'est':<4} {'mu':>7} {'q':>4} {'k':>7} {'cos':>7} {'cos_P':>7} {'var':>10} {'var_cf':>10}"
    lines = [head]
    for r in result["rows"]:
        cf = r.get("variance_closed_form")
        lines.append(f"{r['model']:<10} {r['space']:<8} {r['estimator']:<4} {r['mu']:>7.3g} {r['q'] or '-':>4} "
                     f"{r['k']:>7} {r['cosine']:>7.3f} {r.get('cosine_projected', float('nan')):>7.3f} "
                     f"{r['variance']:>10.3g} {cf if cf is not None else float('nan'):>10.3g}")
    return "\n".join(lines)
