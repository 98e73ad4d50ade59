"""``szo federated RECIPE [--clients 8] [--rounds 100] ...``: BAFFLE on Flower (szo.federated.flower).

RECIPE is a shipped ``kind: subspace`` recipe or a YAML file; its ``federated`` section
(``szo.config.FederatedConfig``) holds the federation's settings, and every flag below is a
shortcut for ``--set federated.KEY=VALUE`` (a flag given wins over the recipe).
"""
from __future__ import annotations

import argparse

from szo.config import FederatedConfig, load_recipe
from szo.federated.flower import run_federated
from szo.rundir import default_run_dir, resumed_config
from szo.schema_flags import add_schema_flags, flag_values

__all__ = ["add_arguments"]

# flag -> (section, key, what it is): type, choices and default come from the schema (szo.schema_flags)
_FLAGS = {key: ("federated", key, what) for key, what in {
    "clients": "client processes (at least 3 with SecAgg+)", "rounds": "rounds",
    "K": "directions per round (2K forwards per client)", "sigma": "perturbation scale",
    "lr": "server learning rate (cosine over the rounds)", "momentum": "server heavy-ball momentum (--server-optimizer sgd)",
    "ema": "evaluate an exponential moving average of the model with this decay (BAFFLE: 0.995; 0 = off)",
    "alpha": "Dirichlet label skew (small = non-IID)", "batch_size": "local batch per client and round",
    "eval_every": "server-side test evaluation period",
    "clip_range": "SecAgg+ bound on every uploaded value (a client beyond it sits the round out)",
    "secagg_threshold": "SecAgg+ reconstruction threshold, a fraction of the clients",
    "space": "subspace: directions P z in the recipe's stored subspace; full: z in R^d",
    "server_optimizer": "sgd: heavy ball, Algorithm 1; adam: betas (0.9, 0.99), the paper's experiments"}.items()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``szo federated``'s arguments and handler, added to its parser."""
    p.description = ("BAFFLE (seed 002): each round the server sends the model and a seed; every client "
                     "returns K loss differences on its local data; Flower's SecAgg+ gives the server "
                     "only their weighted mean over the clients that answered; the server regenerates "
                     "the directions and steps. Model, data, loss, subspace and the federated "
                     "section come from RECIPE (a 'kind: subspace' recipe name or YAML file, e.g. "
                     "digits-scratch). See docs/federated.md.")
    p.add_argument("name", metavar="RECIPE")
    add_schema_flags(p, _FLAGS, {"federated": FederatedConfig}, over_recipe=True)
    p.add_argument("--no-secure", dest="secure", action="store_const", const=False, default=None,
                   help="plain Flower aggregation instead of SecAgg+: the server sees every client's upload "
                        "(federated.secure=false)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="recipe override (repeatable)")
    p.add_argument("--out", default=None, help="run directory (default runs/federated-RECIPE)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out after its last completed round (its own config.yaml, --set on top)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    given = flag_values(args, _FLAGS).get("federated", {})
    if args.secure is not None:
        given["secure"] = args.secure
    sets = (args.set or []) + [f"federated.{k}={v}" for k, v in given.items()]
    cfg = load_recipe(args.name, sets)
    out = args.out or default_run_dir(cfg["name"], prefix="federated-")
    if args.resume:  # the run's own config.yaml (+ --set); the stage refuses what changes the run
        cfg = resumed_config(out, cfg, sets)
    fc = cfg.federated
    s = run_federated(cfg, out, resume=args.resume, callbacks=args.callbacks)
    refused = (f", {s['rounds_refused']} of {s['rounds']} rounds refused (no step; see metrics.jsonl)"
               if s["rounds_refused"] else "")
    dropped = f", clients dropped: {s['clients_dropped']}" if s["clients_dropped"] else ""
    print(f"federated {cfg['name']} [BAFFLE, {fc.clients} clients, K={fc.K}, {fc.space}] done in {out}: "
          f"max test acc {100 * s['best_test_acc']:.2f}%, #FP {s['fp']}, #BP 0, "
          f"{s['bytes_down_per_round']:.0f} B down / {s['bytes_up_per_round']:.0f} B up per round, "
          f"{s['wall_time_min']:.2f} min{refused}{dropped}")
    return 0
