"""``szo subspace build|ls|show|rm`` (also ``python -m subspace_store.cli ...``)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

__all__ = ["register", "main", "add_subcommands"]


def _store(args: argparse.Namespace):
    from .store import SubspaceStore

    return SubspaceStore(args.root)


def _cmd_build(args: argparse.Namespace) -> int:
    from .build import build_subspace

    store = _store(args)
    store.path(args.name)  # validate the name before the (long) build
    if store.exists(args.name) and not args.overwrite:
        raise ValueError(f"subspace {args.name!r} already exists in {store.root}; pass --overwrite")
    sub = build_subspace(args.trajectory, args.k, window=args.window, reference=args.reference,
                         progress=not args.quiet)
    path = store.save(args.name, sub, storage_dtype=args.dtype, overwrite=args.overwrite)
    evr = sub.explained_variance_ratio
    print(f"saved {args.name!r} to {path}: k={sub.k} N={sub.N} d={sub.d} model={sub.model} "
          f"explained variance (k components) = {100 * float(evr.sum()):.2f}%")
    return 0


def _cmd_ls(args: argparse.Namespace) -> int:
    rows = _store(args).summaries()
    if not rows:
        print(f"no subspaces in {_store(args).root}")
        return 0
    print(f"{'name':<28} {'model':<20} {'k':>4} {'N':>5} {'d':>10} {'dtype':<9} {'expl.var':>8}  created")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<28} NOT USABLE: {r['error']}")
            continue
        print(f"{r['name']:<28} {str(r['model']):<20} {r['k']:>4} {r['N']:>5} {r['d']:>10} {r['storage_dtype']:<9} "
              f"{100 * r['explained_variance']:>7.2f}%  {r['created']}")
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from .plot import plot_explained_variance

    store = _store(args)
    m = store.info(args.name)
    evr = m["explained_variance_ratio"]
    print(f"name: {args.name}\nmodel: {m['model']}\nk: {m['k']}\nN: {m['N']}\nd: {m['d']}")
    print(f"storage dtype: {m['storage_dtype']}\ncreated: {m['created']}")
    prov = m["provenance"]
    if prov.get("trajectories"):
        print(f"trajectories: {', '.join(prov['trajectories'])}")
    if prov.get("epochs"):
        print(f"sampled epochs: {min(prov['epochs'])}-{max(prov['epochs'])} ({len(prov['epochs'])} samples)")
    print(f"reference: {prov.get('reference')}")
    for n in sorted({c for c in (1, 5, 10, m["k"]) if c <= m["k"]}):
        print(f"explained variance, first {n:>3} components: {100 * sum(evr[:n]):.2f}%")
    if args.plot:  # only on request, and never into the entry (a checksummed, possibly read-only directory)
        plot = Path(args.plot)
        if plot.resolve().is_relative_to(store.path(args.name).resolve()):
            raise ValueError(f"--plot {plot} is inside the store entry; write it elsewhere")
        plot_explained_variance(evr, plot, title=f"{args.name} ({m['model']}, N={m['N']}, k={m['k']})")
        print(f"plot: {plot}")
    return 0


def _cmd_rm(args: argparse.Namespace) -> int:
    _store(args).delete(args.name)
    print(f"removed {args.name!r}")
    return 0


def add_subcommands(parser: argparse.ArgumentParser) -> None:
    """Add build / ls / show / rm to ``parser``; each sets ``func``."""
    sub = parser.add_subparsers(dest="subspace_command", metavar="{build,ls,show,rm}")
    sub.required = True

    def root(p: argparse.ArgumentParser) -> None:
        p.add_argument("--root", default=None, help="store root (default $SZO_SUBSPACE_ROOT or ./subspaces)")

    b = sub.add_parser("build", help="build a subspace from trajectory directories and store it")
    b.add_argument("--trajectory", nargs="+", required=True, metavar="DIR", help="trajectory directories (pooled)")
    b.add_argument("--k", type=int, required=True, help="subspace dimension, 1 <= k <= N-1")
    b.add_argument("--name", required=True, help="entry name in the store")
    b.add_argument("--window", default=None, metavar="A-B", help="inclusive epoch window, e.g. 80-100")
    b.add_argument("--reference", choices=["first", "last"], default="first",
                   help="theta_ref: first sample (training from scratch) or last (continual)")
    b.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32", help="basis storage dtype")
    b.add_argument("--overwrite", action="store_true", help="replace an existing entry")
    b.add_argument("--quiet", action="store_true", help="no progress bars")
    root(b)
    b.set_defaults(func=_cmd_build)

    ls = sub.add_parser("ls", help="list stored subspaces")
    root(ls)
    ls.set_defaults(func=_cmd_ls)

    s = sub.add_parser("show", help="print a subspace's summary (and, with --plot, its explained-variance plot)")
    s.add_argument("name")
    s.add_argument("--plot", default=None, metavar="PATH", help="write the explained-variance plot to this PNG")
    root(s)
    s.set_defaults(func=_cmd_show)

    r = sub.add_parser("rm", help="delete a stored subspace (also an incomplete or partially written one)")
    r.add_argument("name")
    root(r)
    r.set_defaults(func=_cmd_rm)


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``subspace`` command to an argparse subparsers object (``args.func(args)`` runs it)."""
    p = subparsers.add_parser("subspace", help="build / list / show / remove trajectory subspaces")
    add_subcommands(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry: ``python -m subspace_store.cli build|ls|show|rm ...``."""
    parser = argparse.ArgumentParser(prog="python -m subspace_store.cli", description=__doc__)
    add_subcommands(parser)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
