"""``szo diagnose RUN_DIR``, ``szo study subspaces BP_RUN``, ``szo study q RECIPE``, ``szo study precision RECIPE``
and ``szo study shift BP_RUN``
(the commands: the table in ``szo.cli``)."""
from __future__ import annotations

import argparse
import json

from szo.study import diagnose, precision, qsweep, shift, subspaces
from szo.study.diagnose import diagnose_run, render
from szo.study.precision import render_precision, study_precision
from szo.study.qsweep import render_q, study_q
from szo.study.shift import ShiftSettings, render_shift, study_shift
from szo.study.subspaces import study_subspaces

__all__ = ["add_diagnose_arguments", "add_study_arguments"]


def _floats(s: str) -> list[float]:
    try:
        return [float(v) for v in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None


def _ints(s: str) -> list[int]:
    try:
        return [int(v) for v in s.split(",") if v != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _cmd_diagnose(args: argparse.Namespace) -> int:
    res = diagnose_run(args.run_dir, subspace=args.subspace, mus=args.mu, qs=args.q, repeats=args.repeats,
                       batch=args.batch, twin=not args.no_twin, max_full_cge=args.max_full_cge, seed=args.seed,
                       out=args.out)
    print(render(res))
    return 0


def _cmd_study_subspaces(args: argparse.Namespace) -> int:
    res = study_subspaces(args.bp_run, args.k, prefix=args.prefix, first_epochs=args.first_epochs,
                          other_runs=args.other_run or [], random_seeds=args.random_seeds,
                          bn_head=not args.no_bn_head, overwrite=args.overwrite, train=args.train,
                          train_overrides=args.set or [], out=args.out, refresh=args.refresh)
    for r in res["projection"]:
        print(f"{r['variant']:<16} k={r['k']:<6} |proj - theta_BP| = {r['distance']:.4g} "
              f"({100 * r['relative_distance']:.1f}% of |theta_BP - theta_0|), projected test acc "
              f"{100 * r['projected_test_acc']:.2f}% (BP {100 * r['bp_test_acc']:.2f}%)")
    for t in res["training"]:
        print(json.dumps(t))
    return 0


def _cmd_study_q(args: argparse.Namespace) -> int:
    res = study_q(args.recipe, args.q, overrides=args.set or [], rge_overrides=args.rge_set or [], out=args.out,
                  cge=not args.no_cge)
    print(render_q(res["rows"]))
    print(f"written: {args.out}/q.json, q.md, q.png")
    return 0


def _names(s: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in s.split(",") if v.strip())


def _lrs(values: list[str] | None) -> dict[str, float]:
    out = {}
    for v in values or []:
        method, sep, lr = v.partition("=")
        try:
            out[method] = float(lr)
        except ValueError:
            raise ValueError(f"--lr takes METHOD=VALUE, got {v!r}") from None
        if not sep:
            raise ValueError(f"--lr takes METHOD=VALUE, got {v!r}")
    return out


def _cmd_study_shift(args: argparse.Namespace) -> int:
    st = ShiftSettings(data=args.data, corruption=args.corruption, severity=args.severity, samples=tuple(args.samples),
                       methods=args.methods, batch=args.batch, eval_images=args.eval_images, k=args.k,
                       window=args.window, lr=_lrs(args.lr), mu=args.mu, q=args.q, seed=args.seed)
    res = study_shift(args.bp_run, st, out=args.out)
    print(render_shift(res))
    return 0


def _cmd_study_precision(args: argparse.Namespace) -> int:
    res = study_precision(args.recipe, precisions=args.precision, mus=args.mu, qs=args.q, repeats=args.repeats,
                          batch=args.batch, seeds=args.seeds, train_mus=args.train_mu, overrides=args.set or [],
                          device=args.device, out=args.out, train=not args.no_train)
    print(render_precision(res))
    print(f"written: {args.out}/precision.json, precision.md, precision.png")
    return 0


def add_diagnose_arguments(p: argparse.ArgumentParser) -> None:
    """``szo diagnose``'s arguments and handler, added to its parser."""
    p.description, p.formatter_class = diagnose.__doc__, argparse.RawDescriptionHelpFormatter
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--subspace", help="store name of the subspace (default: the run config's subspace.name)")
    p.add_argument("--mu", type=_floats, default=[0.01, 0.1, 1.0], help="comma-separated mu values (default 0.01,0.1,1)")
    p.add_argument("--q", type=_ints, default=[1, 10], help="comma-separated RGE q values (default 1,10)")
    p.add_argument("--repeats", type=int, default=20, help="RGE draws per configuration (default 20)")
    p.add_argument("--batch", type=int, default=64, help="images of the fixed train batch (default 64)")
    p.add_argument("--max-full-cge", type=int, default=2000, help="full-space CGE only if d <= this (2d forwards)")
    p.add_argument("--no-twin", action="store_true", help="skip the ReLU twin")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="JSON path (default RUN_DIR/diagnose.json); the plot goes next to it (.png)")
    p.set_defaults(func=_cmd_diagnose)


def add_study_arguments(st: argparse.ArgumentParser) -> None:
    """``szo study``'s studies, their arguments and handlers, added to its parser."""
    ssub = st.add_subparsers(dest="study", metavar="STUDY")
    ssub.required = True
    s = ssub.add_parser("subspaces", help="subspace-origin ablation: variants, projected BP point, optional training",
                        description=subspaces.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("bp_run", metavar="BP_RUN", help="run directory of a kind: bp recipe")
    s.add_argument("--k", type=int, required=True, help="subspace dimension of every trajectory / random variant")
    s.add_argument("--prefix", required=True, help="store names are PREFIX-VARIANT")
    s.add_argument("--first-epochs", type=_ints, default=[], help="comma-separated E: PCA of epochs 0..E only")
    s.add_argument("--other-run", action="append", metavar="BP_RUN2", help="another seed's BP run (repeatable)")
    s.add_argument("--random-seeds", type=_ints, default=[0], help="comma-separated seeds of random subspaces")
    s.add_argument("--no-bn-head", action="store_true", help="skip the BN + classifier coordinate subspace")
    s.add_argument("--overwrite", action="store_true", help="replace existing store entries of the same names")
    s.add_argument("--train", metavar="RECIPE", help="train this scratch recipe in every variant")
    s.add_argument("--refresh", type=int, metavar="T0",
                   help="with --train: also train every random variant with its basis redrawn every T0 steps "
                        "(szo.refresh; SubZero / LOZO style)")
    s.add_argument("--set", action="append", metavar="KEY=VALUE", help="override for --train runs (repeatable)")
    s.add_argument("--out", help="output directory (default BP_RUN/study-subspaces)")
    s.set_defaults(func=_cmd_study_subspaces)

    sq = ssub.add_parser("q", help="q trade-off: SZO-RGE accuracy and wall time vs q, SZO-CGE as the line",
                         description=qsweep.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sq.add_argument("recipe", metavar="RECIPE", help="a subspace recipe (scratch or continual), e.g. mnist5k-scratch")
    sq.add_argument("--q", type=_ints, default=[1, 2, 5, 10, 20], help="comma-separated q values (default 1,2,5,10,20)")
    sq.add_argument("--set", action="append", metavar="KEY=VALUE", help="override for every run (repeatable)")
    sq.add_argument("--rge-set", action="append", metavar="KEY=VALUE",
                    help="override for the SZO-RGE runs only (repeatable), e.g. szo.mu=0.3")
    sq.add_argument("--no-cge", action="store_true", help="skip the SZO-CGE reference run")
    sq.add_argument("--out", required=True, help="output directory: one run directory per q + q.json/q.md/q.png")
    sq.set_defaults(func=_cmd_study_q)

    sp = ssub.add_parser("precision", help="fp32 / tf32 / bf16 probe forwards: ZO estimate quality and accuracy reached",
                         description=precision.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("recipe", metavar="RECIPE", help="a subspace recipe (scratch or continual), e.g. digits-scratch")
    sp.add_argument("--precision", type=_names, default=None,
                    help="comma-separated precisions (default fp32,bf16; on CUDA fp32,tf32,bf16)")
    sp.add_argument("--mu", type=_floats, default=[0.01, 0.1, 1.0], help="mu values of the estimates (default 0.01,0.1,1)")
    sp.add_argument("--q", type=_ints, default=[1, 10], help="RGE q values of the estimates (default 1,10)")
    sp.add_argument("--repeats", type=int, default=10, help="RGE draws per configuration (default 10)")
    sp.add_argument("--batch", type=int, default=64, help="images of the fixed train batch (default 64)")
    sp.add_argument("--seeds", type=_ints, default=[0, 1, 2], help="training seeds (default 0,1,2)")
    sp.add_argument("--train-mu", type=_floats, default=None, help="mu values of the training runs (default: the recipe's)")
    sp.add_argument("--no-train", action="store_true", help="the estimates only")
    sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="override for every run (repeatable)")
    sp.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: the recipe's)")
    sp.add_argument("--out", required=True, help="output directory: runs + precision.json/.md/.png")
    sp.set_defaults(func=_cmd_study_precision)

    sh = ssub.add_parser("shift", help="few-shot adaptation of a deployed model to a shifted input distribution",
                         description=shift.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = shift.ShiftSettings()
    sh.add_argument("bp_run", metavar="BP_RUN", help="run directory of a kind: bp recipe (the deployed model)")
    sh.add_argument("--data", default=d.data, help=f"the shifted data set (default {d.data})")
    sh.add_argument("--corruption", default=d.corruption, help=f"default {d.corruption}")
    sh.add_argument("--severity", type=int, default=d.severity, help=f"default {d.severity}")
    sh.add_argument("--samples", type=_ints, default=list(d.samples), help="comma-separated N (default 100,200,500)")
    sh.add_argument("--methods", type=_names, default=d.methods, help=f"default {','.join(d.methods)}")
    sh.add_argument("--batch", type=int, default=d.batch, help=f"stream batch size (default {d.batch})")
    sh.add_argument("--eval-images", type=int, default=None, help="score on the first n shifted test images (default all)")
    sh.add_argument("--k", type=int, default=d.k, help=f"subspace dimension (default {d.k})")
    sh.add_argument("--window", default=None, help="trajectory epoch window START-END (default: second half)")
    sh.add_argument("--lr", action="append", metavar="METHOD=LR", help="a method's learning rate (repeatable)")
    sh.add_argument("--mu", type=float, default=d.mu, help=f"SZO perturbation scale (default {d.mu})")
    sh.add_argument("--q", type=int, default=d.q, help=f"SZO-RGE directions (default {d.q})")
    sh.add_argument("--seed", type=int, default=d.seed)
    sh.add_argument("--out", help="output directory (default BP_RUN/study-shift)")
    sh.set_defaults(func=_cmd_study_shift)
