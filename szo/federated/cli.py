"""``szo federated RECIPE [--clients 8] [--rounds 100] ...``: BAFFLE on Flower (szo.federated.flower)."""
from __future__ import annotations

import argparse

from szo.federated.flower import SPACES, FederatedConfig

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    d = FederatedConfig()
    p = subparsers.add_parser(
        "federated", help="forward-only federated training (BAFFLE on Flower, one process per client)",
        description="BAFFLE (seed 002): each round the server sends the model and a seed; every client "
                    "returns K loss differences on its local data (masked, zero-sum); the server "
                    "regenerates the directions and steps. Model, data, loss and subspace come from RECIPE "
                    "(a 'kind: subspace' recipe, e.g. digits-scratch). See docs/federated.md.")
    p.add_argument("name", metavar="RECIPE")
    p.add_argument("--clients", type=int, default=d.clients, help=f"client processes (default {d.clients})")
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--K", dest="K", type=int, default=d.K, help="directions per round (2K forwards per client)")
    p.add_argument("--sigma", type=float, default=d.sigma, help="perturbation scale")
    p.add_argument("--lr", type=float, default=d.lr, help="server learning rate (cosine over the rounds)")
    p.add_argument("--momentum", type=float, default=d.momentum)
    p.add_argument("--alpha", type=float, default=d.alpha, help="Dirichlet label skew (small = non-IID)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="local batch per client and round")
    p.add_argument("--space", choices=SPACES, default=d.space,
                   help="subspace: directions P z in the recipe's stored subspace; full: z in R^d")
    p.add_argument("--no-secure", dest="secure", action="store_false", help="upload without zero-sum masks")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="server-side test evaluation period")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="recipe override (repeatable)")
    p.add_argument("--out", default=None, help="run directory (default runs/federated-RECIPE)")
    p.set_defaults(func=_run)
    return p


def _run(args: argparse.Namespace) -> int:
    from szo.config import load_recipe
    from szo.federated.flower import run_federated

    fc = FederatedConfig(clients=args.clients, rounds=args.rounds, K=args.K, sigma=args.sigma, lr=args.lr,
                         momentum=args.momentum, alpha=args.alpha, batch_size=args.batch_size, space=args.space,
                         secure=args.secure, eval_every=args.eval_every)
    cfg = load_recipe(args.name, args.set or [])
    out = args.out or f"runs/federated-{cfg['name']}"
    s = run_federated(cfg, out, fc)
    print(f"federated {cfg['name']} [BAFFLE, {fc.clients} clients, K={fc.K}, {fc.space}] done in {out}: "
          f"max test acc {100 * s['best_test_acc']:.2f}%, #FP {s['fp']}, #BP 0, "
          f"{s['bytes_down_per_round']:.0f} B down / {s['bytes_up_per_round']:.0f} B up per round, "
          f"{s['wall_time_min']:.2f} min")
    return 0
