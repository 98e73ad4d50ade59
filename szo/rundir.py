"""The run-directory contract (docs/runs.md): one writer per run directory, and a resume that
continues exactly what the directory holds.

* :func:`run_lock` holds an exclusive ``fcntl.flock`` on ``RUN_DIR/.lock`` for the whole run
  and writes its holder (pid, host, start time, command) into it. A second run on the same
  directory gets one :class:`RunLockedError` line naming the holder. The kernel drops the lock
  when its process dies (also on SIGKILL), so a lock file that still names a holder but is
  not locked is stale: it is taken over, and a line says so. Re-entrant within a process
  (a recipe locks its run directory, then the stage running in it locks it again).
* :func:`check_resume_config` compares the config a resumed run would use with the
  directory's own ``config.yaml`` and refuses, in one line naming the key and both values,
  any difference that changes what is trained (:data:`HARMLESS_KEYS` may differ).
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any, Iterator, Mapping

import yaml

from szo.config import apply_overrides, resolve, source_config
from szo.distributed import main_decides
from szo.methods import METHOD_OPTIONS, get_method, list_methods

__all__ = ["LOCK_NAME", "HARMLESS_KEYS", "RunDirError", "RunLockedError", "ResumeMismatchError", "run_lock",
           "check_resume_config", "config_differences", "saved_config_path", "resumed_config", "run_pins",
           "check_pins", "with_added_keys", "default_run_dir"]

LOCK_NAME = ".lock"

# Keys a resumed run may change: where and how it runs and reports, never what it computes.
HARMLESS_KEYS = (
    "description", "progress", "device", "data.data_dir", "data.download", "data.num_workers",
    "data.test_batch_size", "bptt.eval_every", "train.eval_every", "bptt.checkpoint_every_steps",
    "train.checkpoint_every_steps", "subspace.root", "distributed.timeout_s", "log.tensorboard",
    "federated.eval_every", "federated.round_timeout_s", "federated.startup_timeout_s", "threads",
)
def _node_losses(flat: Mapping[str, Any]) -> str:
    """szo.node_losses of a run written before it existed: node perturbation weighed every node by the
    batch loss's difference (batch-mean) in the methods that read it; the others hold the unset value."""
    method = flat.get("method")
    reads = isinstance(method, str) and method in list_methods(trainable=None) \
        and "node_losses" in get_method(method).options
    return "batch-mean" if reads else METHOD_OPTIONS["node_losses"][0]


# Keys added to the schema after runs were written: what a saved config.yaml without the key trained
# with, which can differ from today's default (szo.scale: every run before it was in the paper's
# units; szo.node_losses: node perturbation weighed by the batch loss; tt.cge: TT-ZO's CGE phase
# was central); a callable gives it from the saved config's other keys (flattened). A resume fills them
# in before it resolves the saved config (resumed_config), so an old run continues as it was trained,
# and the comparison of configs reads them for a missing key.
ADDED_KEYS: dict[str, Any] = {
    "precision": "auto", "cuda_graphs": False, "source": None, "szo.scale": "absolute", "szo.node_losses": _node_losses,
    "tt.cge": "central", "bptt.t_max": None, "train.t_max": None, "hw.blocks": None, "hw.select_epochs": 1,
    "hw.heldout": 0.1, "federated.ema": 0.0, "federated.server_optimizer": "sgd"}


def _added(flat: Mapping[str, Any]) -> dict[str, Any]:
    """:data:`ADDED_KEYS`' values for the config ``flat`` (its keys flattened)."""
    return {k: v(flat) if callable(v) else v for k, v in ADDED_KEYS.items()}
# Sections a stage does not use (a difference there does not change what that stage trains).
_ELSEWHERE = ("tta", "federated", "setting")  # sections of the other kinds of run
_STAGE_IGNORES = {
    "bptt": ("kind", "name", "mode", "method", "train", "szo", "tt", "backend", "bn_stats", "hw", "distributed",
             *_ELSEWHERE),
    "subspace": ("bptt", "trajectory", *_ELSEWHERE),
    "federated": ("mode", "method", "train", "szo", "tt", "backend", "bn_stats", "hw", "distributed", "tta", "setting"),
}


class RunDirError(ValueError):
    """The run directory cannot be used: not a directory, not creatable, not writable."""


class RunLockedError(RunDirError):
    """Another live process holds the run directory (or its lock file cannot be used)."""


class ResumeMismatchError(ValueError):
    """A resumed run would train something other than what its run directory holds."""


RUNS_ROOT = "runs"
"""Where a run goes when no --out is given: ``runs/NAME`` (:func:`default_run_dir`)."""


def default_run_dir(name: Any, prefix: str = "") -> Path:
    """``runs/PREFIX+NAME``, the run directory of a recipe run without ``--out``. The name (a recipe's
    ``name``, also from ``--set name=...``) must be one plain path component, so the run stays in
    ``runs/``: one ValueError otherwise."""
    ok = isinstance(name, str) and name not in ("", ".", "..") and "\0" not in name \
        and not any(sep and sep in name for sep in (os.sep, os.altsep, "/"))
    if not ok:
        raise ValueError(f"name {name!r} cannot name a run directory in {RUNS_ROOT}/ (the default without --out): "
                         "a name is one path component, without '/' and not '.' or '..'; rename it "
                         "(--set name=...) or pass --out DIR")
    return Path(RUNS_ROOT) / f"{prefix}{name}"


# ----------------------------------------------------------------------------- lock
_held: dict[str, list[Any]] = {}  # resolved lock path -> [fd, depth]


def _holder_text(info: Mapping[str, Any]) -> str:
    return (f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started {info.get('started', '?')}"
            + (f": {info['command']}" if info.get("command") else ""))


def _read_holder(fd: int) -> dict[str, Any] | None:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 1 << 16)
    if not raw.strip():
        return None
    try:
        info = json.loads(raw.decode("utf-8", "replace"))
    except json.JSONDecodeError:
        return {"pid": "?", "host": "?", "started": "?", "command": "unreadable lock file"}
    return info if isinstance(info, dict) else None


def _command() -> str:
    """This process' command line, ``szo ...`` for the console script and ``python -m szo``."""
    prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
    if prog in ("__main__.py", "szo"):
        prog = "szo"
    return " ".join([prog] + sys.argv[1:])[:500]


@contextlib.contextmanager
def run_lock(run_dir: str | os.PathLike) -> Iterator[Path]:
    """Hold ``run_dir/.lock`` exclusively while the block runs (creates ``run_dir``).

    Raises :class:`RunLockedError` (one line: the holder's pid, host, start time and command)
    when another process holds it. On exit the holder record is cleared, so a lock file that
    names a holder when it is acquired was left by a process that died: it is taken over with
    a line on stderr.
    """
    run_dir = Path(run_dir)
    created = not os.path.lexists(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise RunDirError(f"run directory {run_dir} (or a parent of it) exists and is not a directory; "
                          "choose another --out") from None
    except OSError as e:
        why = (" (a name is longer than the file system allows, usually 255 bytes)"
               if e.errno == errno.ENAMETOOLONG else "")
        raise RunDirError(f"cannot create run directory {str(run_dir)[:200]}{'...' if len(str(run_dir)) > 200 else ''}: "
                          f"{e.strerror}{why}; choose another --out") from None
    path = run_dir / LOCK_NAME
    key = str(path.resolve())
    before = set(os.listdir(run_dir)) if key not in _held else set()
    if key in _held:  # this process holds it already (recipe -> stage)
        _held[key][1] += 1
        try:
            yield path
        finally:
            _held[key][1] -= 1
        return
    try:  # never through a symbolic link: it would truncate whatever file it points at
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if path.is_symlink():
            raise RunLockedError(f"run directory {run_dir}: {LOCK_NAME} is a symbolic link (to {os.readlink(path)}); "
                                 f"szo does not write through it: remove {path}") from None
        raise RunDirError(f"run directory {run_dir} is not writable: cannot open its lock file {path} ({e.strerror}); "
                          "a run (and --resume) writes its checkpoints there: copy it somewhere writable") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            info = _read_holder(fd) or {}
            raise RunLockedError(f"run directory {run_dir} is in use by another szo run ({_holder_text(info)}); "
                                 "wait for it to end or choose another --out") from None
        stale = _read_holder(fd)
        if stale is not None:
            print(f"taking over the stale lock of {run_dir}: its holder ({_holder_text(stale)}) is gone",
                  file=sys.stderr, flush=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              "command": _command()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode("utf-8"), 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    _held[key] = [fd, 1]
    try:
        yield path
    except Exception:
        _forget_refused_run(run_dir, before, created)
        raise
    finally:
        del _held[key]
        try:
            os.ftruncate(fd, 0)  # a clean exit leaves no holder behind
        finally:
            os.close(fd)  # releases the flock


#: what a run writes before its first step: a run that stopped with only these was refused before it trained
PRE_STEP_FILES = frozenset({LOCK_NAME, "config.yaml"})


def _forget_refused_run(run_dir: Path, before: set[str], created: bool) -> None:
    """A run refused before its first step (its input, its sizes, its data) leaves nothing that would
    stand in the way of the same command with a corrected input: what it wrote (config.yaml; the
    directory, if this run created it) is removed when that is all it wrote. A directory that holds
    anything more (metrics, checkpoints, a stage's folder) is a run that started, and is kept as it is."""
    try:
        new = set(os.listdir(run_dir)) - before
    except OSError:
        return
    if not new <= PRE_STEP_FILES:
        return
    with contextlib.suppress(OSError):
        for name in sorted(new - {LOCK_NAME}):
            os.unlink(run_dir / name)
        if created and set(os.listdir(run_dir)) <= {LOCK_NAME}:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(run_dir / LOCK_NAME)
            os.rmdir(run_dir)


# ----------------------------------------------------------------------------- resume check
def saved_config_path(run_dir: str | os.PathLike) -> Path | None:
    """The config.yaml a resumed run continues: ``run_dir/config.yaml``, or for a subspace
    recipe stopped during its BPTT stage ``run_dir/bptt/config.yaml``; None for a new run."""
    for p in (Path(run_dir) / "config.yaml", Path(run_dir) / "bptt" / "config.yaml"):
        if p.is_file():
            return p
    return None


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, Mapping) and (tree or not prefix):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        return float(a) == float(b)
    return a == b


def config_differences(saved: Mapping[str, Any], new: Mapping[str, Any], stage: str | None = None
                       ) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, new value)`` for every key that differs and matters for ``stage``
    (``"bptt"``, ``"subspace"``, ``"federated"`` or None: every section), harmless keys left out."""
    ignore = _STAGE_IGNORES.get(stage or "", ())
    fa, fb = _flat(saved), _flat(new)
    a, b = {**_added(fa), **fa}, {**_added(fb), **fb}
    out = []
    for key in sorted(set(a) | set(b)):
        if key in HARMLESS_KEYS or key.split(".")[0] in ignore:
            continue
        if not _same(a.get(key), b.get(key)):
            out.append((key, a.get(key), b.get(key)))
    # extending a constant-LR run is the run it would have been with more epochs; a cosine
    # schedule's length is part of what was trained (its T_max), so that stays refused
    for sec in ("bptt", "train"):
        key = f"{sec}.epochs"
        if (b.get(f"{sec}.scheduler") == "constant" and a.get(f"{sec}.scheduler") == "constant"
                and isinstance(a.get(key), int) and isinstance(b.get(key), int) and b[key] >= a[key]):
            out = [d for d in out if d[0] != key]
    return out


def check_resume_config(run_dir: str | os.PathLike, cfg: Mapping[str, Any], stage: str | None = None,
                        config_file: str | os.PathLike | None = None) -> None:
    """Refuse (:class:`ResumeMismatchError`, one line) resuming ``run_dir`` with a config that
    differs from its ``config.yaml`` in a key that changes what is trained. Nothing to check
    when the directory has no config.yaml yet (a fresh start)."""
    path = Path(config_file) if config_file is not None else Path(run_dir) / "config.yaml"
    if not path.is_file():
        return
    try:
        saved = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ResumeMismatchError(f"cannot resume {run_dir}: {path} is not valid YAML "
                                  f"({str(e).splitlines()[0]})") from None
    if not isinstance(saved, dict):
        raise ResumeMismatchError(f"cannot resume {run_dir}: {path} is not a config mapping")
    diffs = config_differences(saved, cfg, stage)
    if not diffs:
        return
    key, old, new = diffs[0]
    more = f" (and {len(diffs) - 1} more: {', '.join(d[0] for d in diffs[1:4])}{', ...' if len(diffs) > 4 else ''})" \
        if len(diffs) > 1 else ""
    hint = ("a cosine schedule's length is part of the run (only constant-LR runs can be extended); "
            if key.endswith(".epochs") else "")
    raise ResumeMismatchError(
        f"cannot resume {run_dir}: {key} is {old!r} in its config.yaml but {new!r} now{more}; {hint}resume "
        f"without changing it, or start a new run with another --out")


def run_pins(cfg: Mapping[str, Any], subspace_digest: str | None = None) -> dict[str, Any]:
    """What a run's checkpoints pin: the resolved config (plain dicts) and, for a run in a stored
    subspace, the store entry's content digest (``SubspaceStore.digest``)."""
    config = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
    return {"config": config, "subspace_digest": subspace_digest}


def check_pins(run_dir: str | os.PathLike, saved: Mapping[str, Any], cfg: Mapping[str, Any], stage: str,
               subspace_digest: str | None = None) -> None:
    """Refuse (one :class:`ResumeMismatchError` line) resuming a checkpoint whose pins differ from
    now: a config that changes what ``stage`` trains (compared with the config the checkpoint
    was written with, not with config.yaml, which anyone can edit or delete) or a store entry
    rebuilt under the same name since."""
    if isinstance(saved.get("config"), Mapping):
        diffs = config_differences(saved["config"], cfg, stage)
        if diffs:
            key, old, new = diffs[0]
            raise ResumeMismatchError(
                f"cannot resume {run_dir}: its checkpoint was trained with {key} = {old!r}, the config now says "
                f"{new!r} (config.yaml edited or removed, or --set); resume with the run's own settings, or start "
                "a new run with another --out")
    old = saved.get("subspace_digest")
    if old is not None and subspace_digest is not None and old != subspace_digest:
        name = (saved.get("config") or {}).get("subspace", {}).get("name")
        raise ResumeMismatchError(
            f"cannot resume {run_dir}: its checkpoint was trained in subspace {name!r} with digest {old[:12]}..., "
            f"the store's entry of that name is now {subspace_digest[:12]}... (rebuilt since); restore that entry, "
            "or start a new run with another --out")


def _source_stage(run_dir: str | os.PathLike, cfg: Mapping[str, Any], saved: Mapping[str, Any]) -> bool:
    """``run_dir`` holds only the BPTT stage that ``cfg``'s ``source`` recipe runs for it (a subspace
    recipe with a clean source, stopped before its own stage wrote config.yaml)."""
    if cfg.get("source") is None or (Path(run_dir) / "config.yaml").is_file():
        return False
    return saved.get("name") == source_config(cfg)["name"]


def resumed_config(run_dir: str | os.PathLike, cfg: Mapping[str, Any], overrides: list[str]) -> dict[str, Any]:
    """The config ``szo recipe NAME --out RUN_DIR --resume [--set ...]`` continues: the run
    directory's own config.yaml with the ``--set`` overrides on top (``cfg``, the recipe's
    config, when the directory holds no run yet). Under torchrun rank 0 reads the file and
    every rank gets its text. The stages then refuse overrides that change what was trained."""
    def read() -> bytes | None:
        p = saved_config_path(run_dir)
        return None if p is None else p.read_bytes()

    text = main_decides(read)
    if text is None:
        return cfg
    try:
        saved = yaml.safe_load(text.decode("utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ResumeMismatchError(f"cannot resume {run_dir}: its config.yaml is not valid YAML "
                                  f"({str(e).splitlines()[0]})") from None
    if not isinstance(saved, dict):
        raise ResumeMismatchError(f"cannot resume {run_dir}: its config.yaml is not a config mapping")
    if saved.get("name") != cfg.get("name") and _source_stage(run_dir, cfg, saved):
        return cfg  # stopped in its source's BPTT stage: that stage checks DIR/bptt/config.yaml itself
    if saved.get("name") != cfg.get("name"):
        raise ResumeMismatchError(f"cannot resume {run_dir}: it holds a run of recipe {saved.get('name')!r}, "
                                  f"not {cfg.get('name')!r}; resume it with `szo recipe {saved.get('name')} "
                                  f"--out {run_dir} --resume`")
    return resolve(apply_overrides(with_added_keys(saved), overrides))


def with_added_keys(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A saved config (plain mapping) with every :data:`ADDED_KEYS` key it lacks set to what the run
    trained with: resolving it then gives that run, not today's defaults (a run written before
    ``szo.scale`` existed trained in absolute units and resumes in them)."""
    flat = _flat(saved)
    missing = [(k, v) for k, v in _added(flat).items() if k not in flat and not any(f.startswith(k + ".") for f in flat)]
    return apply_overrides(saved, missing)
