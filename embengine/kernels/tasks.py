"""Run a serial kernel over tasks on several threads: the update kernels' parallelism.

The update kernels (``codegen.py``) are serial numba functions whose first two arguments are a
task counter and a task count, ``kernel(claims, n_tasks, ...)``, compiled without the GIL
(``nogil``). ``run`` runs the kernel on several threads at once (``numba.get_num_threads()``,
at most one per task), the calling thread and embengine's worker threads, all with the same
counter ``claims`` (an int64 array of one element, from 0): each thread takes the next task
with one atomic add (``_intrinsics.fetch_add``) until ``n_tasks``, so a thread whose tasks cost
more (cold rows, read from memory) takes fewer of them. A static split (one contiguous range
per thread, as numba's ``prange`` schedules) kept the thread with a batch's cold rows about a
third longer than the other on W1's updates, whatever the tasks' estimated costs
(docs/performance.md, "Update tasks claimed as they go"). A task's rows are its own, so the
result depends neither on the thread count nor on which thread ran which task.

``run_many`` makes several such calls on the same threads, each thread making them in order
(a step's table updates: a thread with no task left in one table's update goes on to the next
instead of waiting; docs/performance.md, "One start of the update's threads a step").
``run_each`` gives Python work items (a step's keyed tables to resolve, whose kernels release
the GIL) to the same threads, each item claimed by one thread as they go.

Why not ``prange`` inside the kernel: numba's parallel compile (parfor lowering) of an update
kernel took about four times its serial compile, and embengine compiles one kernel per row math,
row layout and 16-bit dtype pair (docs/design.md, "Update kernels are serial numba functions").

The workers are daemon threads taking jobs from one queue, started when a call needs more of
them than exist (the calling thread's ``numba.get_num_threads()`` less one) and never stopped,
so a call never meets a pool being replaced or shut down (``concurrent.futures`` refuses new
work once the interpreter begins to exit, while other threads may still train). A forked child
starts its own (a fork copies no threads). ``run`` returns or raises only once every thread's
call has ended, also when interrupted (KeyboardInterrupt) while waiting: the calls write the
caller's arrays.

These threads are not OpenMP's: OpenMP's threads (numba's pooling kernels' under its "omp"
layer, torch's ops') spin after each parallel region unless ``OMP_WAIT_POLICY=PASSIVE``, and the
spinning takes the cores an update's threads need (an update then runs at about its one-thread
speed: docs/performance.md, "Update kernels on Python threads"). The embengine CLI sets the
policy; any other process is warned once (``SpinningThreadsWarning``) at its first update on
more than one thread.
"""

from __future__ import annotations

import itertools
import os
import queue
import sys
import threading
import warnings
from collections.abc import Callable, Sequence

import numba as nb
import numpy as np

__all__ = ["SpinningThreadsWarning", "run", "run_each", "run_many"]


class SpinningThreadsWarning(RuntimeWarning):
    """OpenMP threads spin beside the update's threads (``OMP_WAIT_POLICY`` is not PASSIVE)."""


class _Job:
    """One thread's share of one call: run by a worker, waited for by the caller."""

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


def run(kernel: Callable, n_tasks: int, *args) -> None:
    """``kernel(claims, n_tasks, *args)`` on up to ``numba.get_num_threads()`` threads at once
    (not more than ``n_tasks``), the first in this thread, ``claims`` a fresh counter they share
    (module docstring). Returns or raises once every thread's call has ended; raises this
    thread's error first, else a worker's, else an interruption that came while waiting."""
    run_many([(kernel, n_tasks, args)])


def run_many(calls: Sequence[tuple[Callable, int, tuple]]) -> None:
    """``run(kernel, n_tasks, *args)`` for each ``(kernel, n_tasks, args)`` of ``calls``, on
    the same threads: each thread makes the calls in order, so one that has no task left in a
    call goes on to the next while the others finish theirs (one start and one wait for all
    the calls instead of one each: an update's tables, whose rows are apart, so neither the
    results nor the order of their writes within a table depend on this). A thread whose
    call raised makes no more calls; the others make theirs, and take its tasks not yet
    claimed. Returns or raises as ``run``, once every thread has ended."""
    work = []
    for kernel, n_tasks, args in calls:
        n_tasks = int(n_tasks)
        if n_tasks < 0:
            raise ValueError(f"need n_tasks >= 0, got {n_tasks}")
        if n_tasks:
            work.append((kernel, n_tasks, args, np.zeros(1, dtype=np.int64)))
    if not work:
        return
    n_threads = min(max(n for _, n, _, _ in work), nb.get_num_threads())
    if n_threads <= 1:
        for kernel, n_tasks, args, claims in work:
            kernel(claims, n_tasks, *args)
        return
    _check_wait_policy()
    _ensure_workers(n_threads - 1)
    jobs = [_Job(_in_order, (work,)) for _ in range(n_threads - 1)]
    for job in jobs:
        _jobs.put(job)
    error: BaseException | None = None
    try:
        _in_order(work)
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


def run_each(fn: Callable[[int], None], items: Sequence[int]) -> None:
    """``fn(item)`` for each of ``items`` on ``run``'s threads, each item claimed by one
    thread as they go (``next`` of one ``itertools.count``: atomic under the GIL): for Python
    work whose heavy parts release the GIL (numba kernels, NumPy), such as a step's keyed
    tables, each its own single writer. Returns or raises as ``run``."""
    items = list(items)
    if not items:
        return
    claimed = itertools.count()

    def claim(claims, n_tasks):
        while (i := next(claimed)) < n_tasks:
            fn(items[i])

    run(claim, len(items))


def _in_order(work: list) -> None:
    """One thread's share of ``run_many``: each call, in order, on the counters all share."""
    for kernel, n_tasks, args, claims in work:
        kernel(claims, n_tasks, *args)
