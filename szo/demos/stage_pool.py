"""Independent stages of a demo in worker processes, one torch thread each: cores spent across
runs instead of inside each small forward (issue 50; docs/performance.md, "Threads").

A digits forward is too small for two intra-op threads to share (their hand-off costs more than the
work, and far more on a machine other jobs share), but the demo's subspace runs after its BPTT stage are
independent of each other: N worker processes (``spawn``) each train one stage at a time with one
thread, so two cores finish them in about half the time. What each stage computes does not depend on
the process it runs in: a stage's result equals the same stage run alone with one thread
(tests/demos/test_stage_pool.py).

The user's explicit thread count (``OMP_NUM_THREADS``, ``torch.set_num_threads``) is each worker's count
instead of one. Each stage prints its one-line summary when it ends, in the order the stages end; the
stages' own progress bars and epoch lines (their ``progress`` setting) share the terminal, each line
prefixed with its stage's name (the demo passes ``log_prefix``).
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
from typing import Any, Callable, Sequence

import torch

from szo.threads import explicit_threads, physical_cores

__all__ = ["default_workers", "run_stages"]


def default_workers(jobs: int, device: str) -> int:
    """Worker processes for ``jobs`` independent CPU stages: one per physical core, at most one per
    job; 1 (run in this process) for another device."""
    if not str(device).startswith("cpu"):
        return 1
    return max(1, min(physical_cores(), jobs))


def _init_worker(threads: int) -> None:
    torch.set_num_threads(threads)


def run_stages(jobs: Sequence[tuple[str, Callable[..., Any], tuple, dict]], workers: int,
               done: Callable[[str, Any], None] | None = None) -> dict[str, Any]:
    """Run ``fn(*args, **kwargs)`` for every ``(name, fn, args, kwargs)`` of ``jobs`` in ``workers``
    spawned processes (``fn`` and its arguments picklable: a module-level function, configs, paths);
    ``done(name, result)`` is called in this process as each ends. Returns {name: result} in job order.
    The first failure is raised here (the other stages still running are waited for; their run
    directories resume later)."""
    user = explicit_threads()
    threads = user[0] if user is not None else 1
    ctx = mp.get_context("spawn")
    return _run(jobs, workers, done, threads, ctx)


def _run(jobs: Sequence[tuple[str, Callable[..., Any], tuple, dict]], workers: int,
         done: Callable[[str, Any], None] | None, threads: int, ctx: Any) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker,
                                initargs=(threads,)) as pool:
        futures = {pool.submit(fn, *args, **kwargs): name for name, fn, args, kwargs in jobs}
        error: BaseException | None = None
        for fut in cf.as_completed(futures):
            name = futures[fut]
            try:
                results[name] = fut.result()
            except BaseException as e:  # noqa: BLE001  (re-raised below, after the others end)
                error = error or e
                continue
            if done is not None:
                done(name, results[name])
        if error is not None:
            raise error
    return {name: results[name] for name, *_ in jobs}
