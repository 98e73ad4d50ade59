"""``szo`` command line.

    szo recipe --list
    szo recipe NAME|FILE.yaml [--set key=value ...] [--out DIR] [--device cpu|cuda] [--resume]
    torchrun --nproc_per_node=N -m szo recipe NAME ...   (multi-process SZO, szo.distributed)
    szo demo digits [--out DIR]
    szo report RUN_DIR [RUN_DIR ...] [--out DIR]
    szo subspace build|ls|show|rm ...          (subspace_store.cli)
    szo export RUN_DIR --to nir OUT.nir / szo import IN.nir [--data NAME]   (szo.commands.export)

szo's own commands are a table here, the way pip keeps its own: :data:`COMMANDS` (and
:data:`DEMOS` for ``szo demo NAME``). A :class:`Command` is a name, the one-line help ``szo --help``
shows, and the ``"module:function"`` that adds the command's arguments and ``func(args) -> int`` to
its parser. Their parsers are :class:`CommandParser` s, built (and the command's module, ``*/cli.py``
or ``szo.commands.*``, imported) the first time the command is parsed or its help printed, so a
command whose optional extra is missing is one ``error:`` line when used and costs nothing
otherwise; ``recipe``, ``report`` and ``demo digits`` have light parsers here and run through
:class:`Run`, which imports their module when they run. The table needs no installed packaging
metadata: ``python -m szo ...`` works from a plain checkout. This module imports only the standard
library and two torch-free modules (``szo.exits``, ``szo.recipes``), so ``szo --help`` and ``szo
recipe --list`` import no torch (docs/performance.md, "Start-up of the szo command"). Command
modules import at module level and never import this module; library modules never import a
command module.

Third-party packages add commands through entry points of the ``szo.commands`` group (``szo.demos``
for ``szo demo NAME``), each naming a ``register(subparsers)`` that adds a parser whose ``func(args)
-> int`` runs it. A plugin that fails (raises on import or in ``register``, imports a missing
package, or takes a command name already registered, e.g. ``recipe``) costs one ``warning:`` line
on stderr naming it and is left out; it never breaks ``szo --help`` or another command. Its
``register`` is first tried on a scratch parser holding the names already taken, so a plugin failing
halfway adds nothing.

Bad input (unknown recipe / key / choice, missing data) prints one line ``error: ...`` and
exits with status 2, without a traceback. Under torchrun every rank that fails prints its own
line prefixed with ``[rank R/W]``; a lost peer (``szo.distributed.RankFailure``) exits with
status 3 (rerun the same command with ``--resume``). A diverged run (``szo.train.TrainingDiverged``:
non-finite or exploding loss, non-finite parameters) prints one line and exits with status 4;
its results.json says ``"status": "diverged"``. A process szo runs that fails (``szo.exits.ExternalError``:
the Lava runner) or an operating-system error other than a missing file (``OSError``: a permission, a
full disk, a file where a directory is needed) prints one line and exits with status 5. Only rank 0
prints the summary line.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable, Sequence

from szo.exits import ExternalError, RankFailure, TrainingDiverged, env_world_size
from szo.recipes import recipe_description, recipe_names

__all__ = ["main", "build_parser", "CommandParser", "Command", "Run", "load", "COMMANDS", "DEMOS", "COMMAND_GROUP",
           "DEMO_GROUP"]

COMMAND_GROUP = "szo.commands"
"""Entry-point group of third-party subcommands: ``name = "module:register"`` (``register(subparsers)``)."""
DEMO_GROUP = "szo.demos"
"""Entry-point group of third-party demos under ``szo demo NAME``: ``register(demo_subparsers)``."""


SZO_DISTRIBUTION = "szo"
"""szo's own distribution: entry points it declares (an earlier version's metadata) are not plugins."""


def load(target: str) -> Callable[..., Any]:
    """The function ``"package.module:function"`` names, its module imported now."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


class CommandParser(argparse.ArgumentParser):
    """An argument parser whose arguments may be added later: :meth:`defer` names the builder,
    which runs the first time the parser parses or formats its help or usage."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._builder: str | None = None

    def defer(self, build: str) -> None:
        """Add the arguments when first needed: ``build`` is ``"module:function"``, ``function(parser)``."""
        self._builder = build

    def _build(self) -> None:
        if self._builder is not None:
            build, self._builder = self._builder, None
            try:
                add = load(build)
            except ModuleNotFoundError as e:  # an optional dependency of this command (e.g. flwr)
                own = build.partition(":")[0].split(".")[0]
                if e.name is None or e.name.split(".")[0] in (own, "szo", "subspace_store"):
                    raise  # szo's own module is missing: a broken install, keep the traceback
                self.error(f"needs the package {e.name!r}, which is not installed (pip install {e.name.split('.')[0]})")
            add(self)

    def parse_known_args(self, args: Any = None, namespace: Any = None):
        self._build()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._build()
        return super().format_help()

    def format_usage(self) -> str:
        self._build()
        return super().format_usage()


@dataclass(frozen=True)
class Command:
    """One subcommand as data: ``name``, its one-line ``help`` and ``build``, the
    ``"module:function"`` that adds its arguments and ``func`` to the parser."""

    name: str
    help: str
    build: str

    def add_to(self, subparsers: Any) -> argparse.ArgumentParser:
        """Add the command to ``subparsers``: built when first used under ``szo`` (a
        :class:`CommandParser`), at once under any other parser."""
        parser = subparsers.add_parser(self.name, help=self.help)
        if isinstance(parser, CommandParser):
            parser.defer(self.build)
        else:
            load(self.build)(parser)
        return parser


@dataclass(frozen=True)
class Run:
    """``args.func`` of a command whose code is imported only when it runs:
    ``Run("module:function")(args)`` imports the module and calls ``function(args)``."""

    target: str

    def __call__(self, args: argparse.Namespace) -> int:
        return load(self.target)(args)


# ----------------------------------------------------------------------------- szo's own commands
COMMANDS: tuple[Command, ...] = (
    Command("adapt", "test-time adaptation on a corrupted test set (paper Sec. 6.3)", "szo.adapt.cli:add_arguments"),
    Command("export", "write a trained model as a NIR graph (snnTorch, Norse, Lava, Sinabs...)",
            "szo.commands.export:add_export_arguments"),
    Command("import", "load a NIR graph as a szo model; optionally evaluate it",
            "szo.commands.export:add_import_arguments"),
    Command("federated", "forward-only federated training (BAFFLE on Flower, one process per client)",
            "szo.federated.cli:add_arguments"),
    Command("hw", "fixed-point hardware tools (szo hw lava-check)", "szo.hw.cli:add_hw_arguments"),
    Command("hw-report", "on-chip memory / synaptic ops / energy of SZO on a Loihi-class chip",
            "szo.hw.cli:add_hw_report_arguments"),
    Command("diagnose", "ZO estimate variance / cosine to the BPTT gradient on a run's model",
            "szo.study.cli:add_diagnose_arguments"),
    Command("study", "evidence studies (szo study subspaces BP_RUN | q RECIPE | precision RECIPE | shift BP_RUN)",
            "szo.study.cli:add_study_arguments"),
    Command("subspace", "build / list / show / remove trajectory subspaces", "subspace_store.cli:add_subcommands"),
    Command("threads", "the fastest torch thread count for a recipe's model on this machine, and how to set it",
            "szo.commands.threads:add_arguments"),
)
"""szo's own subcommands besides ``recipe``, ``demo`` and ``report`` (built in :func:`build_parser`)."""
DEMOS: tuple[Command, ...] = (
    Command("dvs-stream", "classify an event stream window by window, adapting on-line with SZO",
            "szo.demos.cli:add_arguments"),
)
"""szo's own demos besides ``digits`` (``szo demo NAME``)."""


def _own(ep: metadata.EntryPoint) -> bool:
    dist = getattr(ep, "dist", None)
    return dist is not None and dist.name == SZO_DISTRIBUTION


def _plugins(group: str) -> list[metadata.EntryPoint]:
    """Third-party entry points of ``group``, by name (szo's own commands are :data:`COMMANDS`; entries an
    earlier install of szo declared are not plugins)."""
    return sorted((ep for ep in metadata.entry_points(group=group) if not _own(ep)), key=lambda ep: ep.name)


def _plugin_warning(group: str, ep: metadata.EntryPoint, e: BaseException) -> None:
    dist = getattr(ep, "dist", None)
    where = f", package {dist.name} {dist.version}" if dist is not None else ""
    msg = str(e).strip().splitlines()
    why = f"{type(e).__name__}: {msg[0]}" if msg else type(e).__name__
    if isinstance(e, argparse.ArgumentError):  # add_parser of a name already there
        why = f"{e.message} (a command of szo or of an earlier plugin)"
    sys.stderr.write(f"warning: {group} plugin {ep.name!r} ({ep.value}{where}) skipped: {why}\n")
    sys.stderr.flush()


def _register_plugin(group: str, ep: metadata.EntryPoint, target: Any) -> None:
    """A third-party registrar: loaded, tried on a scratch copy of the names taken, then run on
    ``target``; any failure is one warning line and the plugin is left out."""
    try:
        register = ep.load()
        scratch = argparse.ArgumentParser(add_help=False).add_subparsers()
        for name in target.choices:
            scratch.add_parser(name)
        register(scratch)  # a conflicting name or a register that raises halfway fails here, adding nothing
        register(target)
    except (Exception, SystemExit) as e:  # a plugin's bug, whatever it is, must not take the CLI with it
        _plugin_warning(group, ep, e)


def _cmd_recipe(args: argparse.Namespace) -> int:
    """``--list`` from the recipe files; a run in ``szo.commands.recipe``."""
    if args.list:
        for n in recipe_names():
            print(f"{n:<22} {recipe_description(n)}")
        return 0
    if not args.name:
        raise ValueError(f"give a recipe name or --list; valid recipes: {', '.join(recipe_names())}")
    return _RUN_RECIPE(args)


_RUN_RECIPE = Run("szo.commands.recipe:run")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="szo", description="Forward-only (zeroth-order) SNN training in trajectory subspaces")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)
    sub.required = True

    r = sub.add_parser("recipe", help="run a shipped recipe (szo recipe --list) or a recipe YAML file")
    r.add_argument("name", nargs="?", help="recipe name or path to a recipe .yaml")
    r.add_argument("--list", action="store_true", help="list the shipped recipes")
    r.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value (repeatable)")
    r.add_argument("--out", help="run directory (default runs/NAME)")
    r.add_argument("--device", help="cpu | cuda | cuda:N (default: the recipe's)")
    r.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its last checkpoint, with its own config.yaml (a --set that "
                        "changes what is trained is refused)")
    r.set_defaults(func=_cmd_recipe)

    d = sub.add_parser("demo", help="self-contained demos (szo demo digits)")
    dsub = d.add_subparsers(dest="demo", metavar="DEMO")
    dsub.required = True
    dd = dsub.add_parser("digits", help="digits quickstart: BPTT -> subspace -> BP-Subspace / SZO-CGE / SZO-RGE + table")
    dd.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    dd.add_argument("--device", default="cpu", help="cpu | cuda (default cpu)")
    dd.add_argument("--no-full-space", action="store_true", help="skip the full-space ZO-CGE comparison runs")
    dd.add_argument("--seed", type=int, default=0, help="seed of every stage (BPTT, subspace, SZO runs; default 0)")
    dd.add_argument("--scale", default=None,
                    help="szo.scale of the subspace runs (default: the recipes', trajectory); absolute: the paper's "
                         "units with the hand-tuned digits values (mu 1 / lr 1, SZO-RGE mu 0.3 / lr 0.02 or 0.3)")
    dd.add_argument("--workers", type=int, default=None,
                    help="processes for the subspace runs after BPTT, one torch thread each (default: one per physical "
                         "core on the CPU; 1: one process, threads chosen by measurement)")
    dd.set_defaults(func=Run("szo.commands.demo:run_digits"))

    rp = sub.add_parser("report", help="paper-style tables and plots from run directories")
    rp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (searched recursively)")
    rp.add_argument("--out", help="write report.md, report.json and accuracy.png here")
    rp.set_defaults(func=Run("szo.commands.report:run"))

    for group, target, table in ((COMMAND_GROUP, sub, COMMANDS), (DEMO_GROUP, dsub, DEMOS)):
        for command in table:
            command.add_to(target)
        for ep in _plugins(group):
            _register_plugin(group, ep, target)
    return p


def _one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return msg[0] if msg else type(e).__name__


def _os_line(e: OSError) -> str:
    """An operating-system error as one line: what was refused and on which file."""
    if e.strerror and e.filename is not None:
        other = f" -> {e.filename2}" if e.filename2 is not None else ""
        return f"{e.strerror}: {e.filename}{other} ({type(e).__name__})"
    return _one_line(e)


def _error_line(text: str) -> None:
    """One line on stderr in one write: ranks of a multi-process run share the terminal, and
    ``print`` writes the text and its newline separately when stderr is unbuffered (two ranks'
    lines then ran together in a torchrun log)."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def main(argv: Sequence[str] | None = None, *, callbacks: Sequence[Any] = ()) -> int:
    """Entry point of the ``szo`` console script; returns the exit status. ``callbacks``: extra
    ``szo.train.Callback`` objects for the training loop of ``szo recipe`` (a library user's hooks)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.callbacks = tuple(callbacks)
    try:
        world = env_world_size()
    except ValueError:
        world = 1
    who = f"[rank {os.environ.get('RANK', '?')}/{world}] " if world > 1 else ""
    try:
        return int(args.func(args) or 0)
    except RankFailure as e:
        _error_line(f"error: {_one_line(e)}")
        code = 3
    except TrainingDiverged as e:
        _error_line(f"error: {who}{_one_line(e)}")
        code = 4
    except (ValueError, FileNotFoundError) as e:  # szo.data.DataNotFoundError is a FileNotFoundError
        _error_line(f"error: {who}{_one_line(e)}")
        code = 2
    except BrokenPipeError:  # the reader went away (szo recipe --list | head): not szo's failure
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 0
    except (ExternalError, OSError) as e:  # a process szo runs, or the operating system, failed
        _error_line(f"error: {who}{_os_line(e) if isinstance(e, OSError) else _one_line(e)}")
        code = 5
    except KeyboardInterrupt:  # only a command that can continue a run (it has --resume) says how
        more = "; rerun the same command with --resume to continue" if hasattr(args, "resume") else ""
        print(f"interrupted{more}", file=sys.stderr)
        code = 130
    except BaseException:
        if world <= 1:
            raise
        traceback.print_exc()  # an unexpected error on one rank: the traceback, then out (below)
        code = 1
    if world > 1:
        # under torchrun a failing rank leaves its process group undestroyed (a peer may be
        # gone); letting the interpreter tear it down makes gloo abort ("terminate called
        # without an active exception", SIGABRT), turning the exit status into -6. Leave
        # without running destructors.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
