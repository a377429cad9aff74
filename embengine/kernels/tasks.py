"""Run a serial kernel over a range of tasks on several threads: the update kernels' parallelism.

The update kernels (``codegen.py``) are serial numba functions whose first two arguments are a
task range, ``kernel(task_lo, task_hi, ...)``, compiled without the GIL (``nogil``). ``run``
splits ``[0, n_tasks)`` into one contiguous range per thread, as the static schedule of numba's
``prange`` does, runs the first range in the calling thread and the others on embengine's
worker threads, and returns when all are done. A task's rows are its own, so the result does
not depend on the thread count.

Why not ``prange`` inside the kernel: numba's parallel compile (parfor lowering) of an update
kernel took about four times its serial compile, and embengine compiles one kernel per row math,
row layout and 16-bit dtype pair (docs/design.md, "Update kernels are serial numba functions").

The workers are daemon threads taking jobs from one queue, started when a call needs more of
them than exist (the calling thread's ``numba.get_num_threads()`` less one) and never stopped,
so a call never meets a pool being replaced or shut down (``concurrent.futures`` refuses new
work once the interpreter begins to exit, while other threads may still train). A forked child
starts its own (a fork copies no threads). ``run`` returns or raises only once every range has
ended, also when interrupted (KeyboardInterrupt) while waiting: the ranges write the caller's
arrays.

These threads are not OpenMP's: OpenMP's threads (numba's pooling kernels' under its "omp"
layer, torch's ops') spin after each parallel region unless ``OMP_WAIT_POLICY=PASSIVE``, and the
spinning takes the cores an update's threads need (an update then runs at about its one-thread
speed: docs/performance.md, "Update kernels on Python threads"). The embengine CLI sets the
policy; any other process is warned once (``SpinningThreadsWarning``) at its first update on
more than one thread.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import warnings
from collections.abc import Callable

import numba as nb

__all__ = ["SpinningThreadsWarning", "ranges", "run"]


class SpinningThreadsWarning(RuntimeWarning):
    """OpenMP threads spin beside the update's threads (``OMP_WAIT_POLICY`` is not PASSIVE)."""


class _Job:
    """One range of one call: run by a worker, waited for by the caller."""

    __slots__ = ("args", "done", "error", "kernel")

    def __init__(self, kernel: Callable, args: tuple):
        self.kernel, self.args = kernel, args
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.kernel(*self.args)
        except BaseException as e:
            self.error = e
        finally:
            self.done.set()


_lock = threading.Lock()
_jobs: queue.SimpleQueue = queue.SimpleQueue()
_workers: list[threading.Thread] = []
_checked_wait_policy = False


def _after_fork_in_child() -> None:
    global _lock, _jobs, _workers
    _lock, _jobs, _workers = threading.Lock(), queue.SimpleQueue(), []


os.register_at_fork(after_in_child=_after_fork_in_child)


def _work(jobs: queue.SimpleQueue) -> None:
    while True:
        jobs.get().run()


def _ensure_workers(n: int) -> None:
    """At least ``n`` worker threads."""
    with _lock:
        while len(_workers) < n:
            t = threading.Thread(
                target=_work, args=(_jobs,), name=f"embengine-update-{len(_workers)}", daemon=True
            )
            t.start()
            _workers.append(t)


def _check_wait_policy() -> None:
    """Warn once if OpenMP's threads may spin beside ours (module docstring)."""
    global _checked_wait_policy
    with _lock:
        if _checked_wait_policy:
            return
        _checked_wait_policy = True
    policy = os.environ.get("OMP_WAIT_POLICY", "")
    openmp = nb.threading_layer() == "omp" or "torch" in sys.modules
    if openmp and policy.upper() != "PASSIVE":
        warnings.warn(
            f"OMP_WAIT_POLICY is {policy or 'unset'}: OpenMP's threads (numba's pooling, "
            "torch's ops) spin after each parallel region and take the cores embengine's "
            "update threads need, so updates run at about one thread's speed. Export "
            "OMP_WAIT_POLICY=PASSIVE before Python starts (the embengine CLI sets it)",
            SpinningThreadsWarning,
            stacklevel=4,
        )


def ranges(n_tasks: int, n_threads: int) -> list[tuple[int, int]]:
    """``[0, n_tasks)`` as up to ``n_threads`` contiguous, non-empty ranges of sizes differing by
    at most one (thread i gets ``[i * n // T, (i + 1) * n // T)``)."""
    if n_tasks < 0 or n_threads < 1:
        raise ValueError(f"need n_tasks >= 0 and n_threads >= 1, got {n_tasks}, {n_threads}")
    t = min(n_tasks, n_threads)
    return [(i * n_tasks // t, (i + 1) * n_tasks // t) for i in range(t)]


def run(kernel: Callable, n_tasks: int, *args) -> None:
    """``kernel(lo, hi, *args)`` for ranges ``[lo, hi)`` covering ``[0, n_tasks)``, one per
    thread (``numba.get_num_threads()``), the first in this thread. Returns or raises once every
    range has ended; raises this thread's error first, else a worker's, else an interruption
    that came while waiting."""
    parts = ranges(int(n_tasks), nb.get_num_threads())
    if len(parts) <= 1:
        if parts:
            kernel(*parts[0], *args)
        return
    _check_wait_policy()
    _ensure_workers(len(parts) - 1)
    jobs = [_Job(kernel, (lo, hi, *args)) for lo, hi in parts[1:]]
    for job in jobs:
        _jobs.put(job)
    error: BaseException | None = None
    try:
        kernel(*parts[0], *args)
    except BaseException as e:
        error = e
    interrupted: BaseException | None = None
    for job in jobs:
        while True:
            try:
                job.done.wait()
                break
            except BaseException as e:  # e.g. KeyboardInterrupt: wait on, the job writes our arrays
                interrupted = interrupted or e
        error = error or job.error
    if error is not None or interrupted is not None:
        raise error or interrupted
