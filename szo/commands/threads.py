"""``szo threads RECIPE [--set KEY=VALUE ...]``: which intra-op thread count is fastest for the recipe's
model and batch on this machine, now (``szo.threads.recommend``: a few no-grad forwards at 1 ... cores
threads), and how to set it in your own loop. Runs choose it themselves (``threads: auto``); this prints
the advice for code that drives ``szo.SZO`` itself, which never changes the process's thread count."""
from __future__ import annotations

import argparse

import torch

from szo.build import build_model, loaders_for
from szo.config import load_recipe
from szo.threads import recommend

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``szo threads``'s arguments and handler, added to its parser."""
    p.description, p.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    p.add_argument("recipe", help="recipe name or YAML file (its model, data set and batch size are timed)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe setting (repeatable), e.g. --set data.batch_size=32")
    p.add_argument("--rounds", type=int, default=5, help="timed forwards per thread count (default 5)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    cfg = load_recipe(args.recipe, args.sets)
    model = build_model(cfg)
    train, _ = loaders_for(cfg, torch.Generator().manual_seed(int(cfg.seed)))
    with torch.random.fork_rng():  # a random transform draws from the global RNG
        x = train.collate_fn([train.dataset[i] for i in range(min(int(train.batch_size or 1), len(train.dataset)))])[0]
    print(recommend(model, x, rounds=args.rounds))
    return 0
