"""torch's intra-op thread count, as a setting chosen by measurement: ``threads`` = ``auto`` | N.

torch's default (one intra-op thread per physical core) is not a policy. Its OpenMP threads spin and
wait on each other; for the small tensors of a spiking network's forward the hand-off costs more than
the work, and on a machine whose cores other jobs share it costs far more (docs/performance.md,
"Threads": one forward of a 5k-parameter net took 4 ms with one thread and 21 ms with two on a loaded
2-core machine). The right count depends on the model, the batch and the machine's load, so a run
measures it:

* ``auto`` (the default of every run: recipes, ``szo demo``, ``szo.train.fit``): at the start of the run,
  a few forwards of the run's own model on one batch at each candidate count (1, 2, 4, ... up to the
  physical cores), timed in alternating rounds, and the fastest count wins (a larger count only when it is
  more than :data:`MARGIN` faster). Only counts that fit in the cores other processes leave free are
  candidates (:func:`busy_threads`): beside busy processes a short timing can see two threads win (39 vs
  28 ms on Spike-ResNet8 beside two busy loops) and the run then pay 28x (1,097 ms per forward), because
  OpenMP's threads wait at every barrier for a core a busy process holds; how often that happens varies
  from second to second, so a timing cannot be trusted to see it, and the count of running threads can.
  The choice and its timings go into results.json (``"threads"``) and
  into ``run_dir/threads.json``, which a resumed run reads back: it continues with the same count (a
  thread count changes the float summation order of CPU kernels, so the same count is what makes a
  resumed run continue as the uninterrupted one would have).
* An explicit choice is respected and not measured: ``threads: N``, the ``OMP_NUM_THREADS`` environment
  variable, or a process whose ``torch.set_num_threads`` was set to something other than torch's default
  (:func:`default_threads`).
* CUDA runs and multi-process runs are not measured (every rank must compute the same update: they keep
  the process's count; ``torchrun`` sets ``OMP_NUM_THREADS=1`` itself).

:meth:`ThreadChoice.scope` sets the count for a block and puts the process's count back afterwards, so
``fit`` leaves the caller's process as it found it. The library's optimizers (``szo.SZO`` in someone
else's loop) never touch the thread count; :func:`recommend` prints the advice for a model and a batch
(``szo threads RECIPE``).
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from szo.io import atomic_write_json
from szo.schema import check_threads  # the setting's value rule, next to the setting

__all__ = ["MARGIN", "ThreadChoice", "check_threads", "default_threads", "physical_cores", "explicit_threads",
           "candidate_threads", "busy_threads", "free_cores", "time_threads", "DROP", "choose_threads", "recommend",
           "THREADS_FILE"]

MARGIN = 0.05
"""A larger thread count is chosen only when its median time is more than this fraction below the best
smaller count's (ties go to fewer threads: the cores left idle serve other jobs)."""

DROP = 3.0
"""A candidate count whose warm-up forward took more than this many times the fastest one is not timed
again (:func:`time_threads`)."""

THREADS_FILE = "threads.json"
"""Where a run directory records its thread choice (a resumed run reads it back)."""


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (sysfs topology; ``os.cpu_count()``
    where that is not readable)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)
    cores = set()
    for c in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            cores.add((topo.joinpath("physical_package_id").read_text().strip(),
                       topo.joinpath("core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(c)))
    return max(1, len(cores))


def default_threads() -> int:
    """The intra-op thread count torch starts a process with: ``OMP_NUM_THREADS`` (else
    ``MKL_NUM_THREADS``) when set, else the physical cores this process may run on."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        text = os.environ.get(var, "").strip()
        if text.isdigit() and int(text) >= 1:
            return int(text)
    return physical_cores()


def explicit_threads() -> tuple[int, str] | None:
    """(count, who set it) when the user chose the process's thread count: ``OMP_NUM_THREADS`` in the
    environment, or ``torch.set_num_threads`` to other than torch's default; else None."""
    now = torch.get_num_threads()
    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return now, "OMP_NUM_THREADS"
    if now != default_threads():
        return now, "torch.set_num_threads"
    return None


def candidate_threads(cores: int | None = None) -> list[int]:
    """1, 2, 4, ... and the core count itself (``cores``: :func:`physical_cores`)."""
    cores = physical_cores() if cores is None else max(1, int(cores))
    out, n = [], 1
    while n < cores:
        out.append(n)
        n *= 2
    return out + [cores]


def _own_running() -> int:
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        n += stat.rsplit(")", 1)[1].split()[0] == "R"
    return n


def busy_threads(samples: int = 9, interval_s: float = 0.005) -> int | None:
    """Threads of other processes running or ready to run now: ``/proc/loadavg``'s count of runnable
    threads minus this process's own (its OpenMP workers may still be spinning), the median of
    ``samples`` readings ``interval_s`` apart. None where ``/proc`` is not readable (not Linux)."""
    counts = []
    try:
        for i in range(samples):
            if i:
                time.sleep(interval_s)
            running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
            counts.append(max(0, running - _own_running()))
    except (OSError, ValueError, IndexError):
        return None
    return int(statistics.median(counts))


def free_cores(busy: int | None = None) -> int:
    """The physical cores a run may use without waiting on other processes: :func:`physical_cores`, less
    what the CPUs other processes keep busy take from them (``busy``: :func:`busy_threads`, measured
    when None; the machine's CPUs are ``os.cpu_count()``, so in a container that sees the whole host's
    load the host's CPUs count too); at least 1."""
    busy = busy_threads() if busy is None else busy
    cores = physical_cores()
    if busy is None:
        return cores
    return max(1, min(cores, (os.cpu_count() or cores) - busy))


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def time_threads(work: Callable[[], Any], candidates: list[int], *, rounds: int = 5,
                 budget_s: float = 10.0) -> dict[int, float]:
    """Median seconds of one ``work()`` call at each thread count (the median: one slow call of a quiet
    machine, 40 ms among 6 ms ones, made the mean choose one thread where two were 1.16x faster; what
    busy processes do to more threads is :func:`free_cores`' business, not the timing's): one untimed
    call first (a first forward's one-time costs, lazy initialisation and the allocator's first blocks,
    made the first candidate look 50x slower and dropped it), one warm-up call per count, then
    ``rounds`` rounds that visit every count once (alternating, so each count sees the same machine
    load), fewer rounds (at least 2) when the warm-up says ``budget_s`` would be exceeded. A count whose
    warm-up took more than :data:`DROP` times the fastest warm-up is not timed again (its warm-up is
    its time: on a loaded machine one 2-thread forward can take 20x a 1-thread one). The process's
    thread count is put back afterwards."""
    with _threads(candidates[0]):
        work()
    warm: dict[int, float] = {}
    for n in candidates:
        with _threads(n):
            t = time.perf_counter()
            work()
            warm[n] = time.perf_counter() - t
    fastest = min(warm.values())
    timed = [n for n in candidates if warm[n] <= DROP * fastest]
    times: dict[int, list[float]] = {n: [] for n in timed}
    rounds = max(2, min(rounds, int(budget_s / max(sum(warm[n] for n in timed), 1e-9))))
    for _ in range(rounds):
        for n in timed:
            with _threads(n):
                t = time.perf_counter()
                work()
                times[n].append(time.perf_counter() - t)
    return {n: statistics.median(times[n]) if n in times else warm[n] for n in candidates}


def _pick(timings: Mapping[int, float]) -> int:
    best = min(timings)
    for n in sorted(timings):
        if timings[n] < timings[best] * (1.0 - MARGIN):
            best = n
    return best


@dataclass
class ThreadChoice:
    """The intra-op thread count of a run and why (``source``): ``setting`` (``threads: N``),
    ``OMP_NUM_THREADS`` / ``torch.set_num_threads`` (the user's), ``measured`` (``auto``: ``timings_s``
    holds the median seconds of one forward per count), ``resumed`` (the run directory's earlier
    choice), ``not measured: ...`` (CUDA, multi-process: the process's count)."""

    threads: int
    source: str
    setting: Any = "auto"
    timings_s: dict[int, float] = field(default_factory=dict)
    busy: int | None = None
    """Threads of other processes that were running when ``auto`` chose (:func:`busy_threads`)."""

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """The block runs with :attr:`threads`; the process's count is put back afterwards."""
        with _threads(self.threads):
            yield

    def record(self) -> dict[str, Any]:
        """What results.json and ``threads.json`` hold."""
        out: dict[str, Any] = {"threads": self.threads, "source": self.source, "setting": self.setting,
                               "cores": physical_cores()}
        if self.timings_s:
            out["timings_ms"] = {str(n): round(1e3 * t, 4) for n, t in sorted(self.timings_s.items())}
        if self.busy is not None:
            out["busy_threads"] = self.busy
        return out

    def save(self, run_dir: str | os.PathLike) -> None:
        """Write :meth:`record` to ``run_dir/threads.json`` (atomically), for a resumed run to read."""
        atomic_write_json(Path(run_dir) / THREADS_FILE, self.record())


def _recorded(run_dir: str | os.PathLike | None) -> ThreadChoice | None:
    if run_dir is None:
        return None
    path = Path(run_dir) / THREADS_FILE
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
        n = int(rec["threads"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if n < 1:
        return None
    timings = {int(k): float(v) / 1e3 for k, v in (rec.get("timings_ms") or {}).items()}
    busy = rec.get("busy_threads")
    return ThreadChoice(n, "resumed", rec.get("setting", "auto"), timings,
                        busy=busy if isinstance(busy, int) and not isinstance(busy, bool) else None)


def choose_threads(setting: Any, work: Callable[[], Any] | None, *, run_dir: str | os.PathLike | None = None,
                   resume: bool = False, not_measured: str | None = None, rounds: int = 5,
                   candidates: list[int] | None = None) -> ThreadChoice:
    """The run's thread count. ``setting``: ``auto`` or N. ``work``: one forward (or forward and
    backward) of the run's model on one batch, timed at each candidate count when ``auto`` must
    measure. ``resume``: reuse ``run_dir/threads.json`` when the run directory has one. ``not_measured``:
    why ``auto`` keeps the process's count (a CUDA run, a multi-process run). ``candidates``: the counts to
    time (default: 1, 2, 4, ... up to the cores other processes leave free, :func:`free_cores`)."""
    check_threads(setting)
    if setting != "auto":
        return ThreadChoice(int(setting), "setting", setting)
    user = explicit_threads()
    if user is not None:
        return ThreadChoice(user[0], user[1], setting)
    if resume:
        rec = _recorded(run_dir)
        if rec is not None:
            return rec
    if not_measured is not None or work is None:
        return ThreadChoice(torch.get_num_threads(), f"not measured: {not_measured or 'nothing to time'}", setting)
    busy, cands = None, candidates
    if cands is None:
        busy = busy_threads()
        cands = candidate_threads(free_cores(busy))
    if len(cands) == 1:  # nothing to time: one core, or one left free by other processes
        why = "measured: 1 core free" if busy is not None and cands[0] < physical_cores() else "measured"
        return ThreadChoice(cands[0], why, setting, busy=busy)
    timings = time_threads(work, cands, rounds=rounds)
    return ThreadChoice(_pick(timings), "measured", setting, timings, busy=busy)


def recommend(model: torch.nn.Module, x: torch.Tensor, *, rounds: int = 5) -> str:
    """One paragraph of advice: the measured best intra-op thread count for ``model`` on batch ``x``
    (no-grad forwards, eval mode; the model's state is left as it was) and how to set it."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng():
            timings = time_threads(lambda: model(x), candidate_threads(), rounds=rounds)
    finally:
        model.train(was)
    busy = busy_threads()
    free = free_cores(busy)
    best = _pick({n: t for n, t in timings.items() if n <= free})
    cells = ", ".join(f"{n}: {1e3 * t:.2f} ms" for n, t in sorted(timings.items()))
    crowd = "" if free == physical_cores() else (f"; other processes keep {busy} threads running now, so only "
                                                f"counts up to {free} are advised (more wait on their cores)")
    return (f"one forward at each intra-op thread count (median of {rounds}): {cells}{crowd}; best: {best} "
            f"(torch's default here: {default_threads()}; now: {torch.get_num_threads()}). In your own loop call "
            f"torch.set_num_threads({best}) once (szo never changes it); szo runs choose it themselves "
            f"(threads: auto, recorded in results.json).")


def fit_workload(model: torch.nn.Module, loader: Any, device: str | torch.device, *,
                 backward: bool) -> Callable[[], None] | None:
    """What ``auto`` times for a training run: one forward (``backward``: and its backward, by
    ``torch.autograd.grad``, which leaves ``.grad`` alone) of ``model`` in eval mode on the first
    ``batch_size`` samples of ``loader``'s dataset. Nothing of the run moves: the samples are read by
    index (not through the shuffling sampler, whose generator is the run's), under
    ``torch.random.fork_rng`` (a random transform draws from the global RNG), and eval mode leaves
    BatchNorm's running statistics alone. None when the loader has nothing to read."""
    data = getattr(loader, "dataset", None)
    size = getattr(loader, "batch_size", None) or getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    if data is None or not size:
        return None
    try:
        n = min(int(size), len(data))
    except TypeError:  # an iterable dataset: no length, no indexing
        return None
    if n < 1:
        return None
    with torch.random.fork_rng():
        batch = loader.collate_fn([data[i] for i in range(n)])
    x = (batch[0] if isinstance(batch, (tuple, list)) else batch).to(device)
    params = [p for p in model.parameters() if p.requires_grad]

    def work() -> None:
        was = model.training
        model.eval()
        try:
            with torch.random.fork_rng():
                if backward and params:
                    with torch.enable_grad():
                        out = model(x)
                        torch.autograd.grad(out.float().sum(), params, allow_unused=True)
                else:
                    with torch.no_grad():
                        model(x)
        finally:
            model.train(was)

    return work
