"""Run a serial kernel over a range of tasks on several threads: the update kernels' parallelism.

The update kernels (``codegen.py``) are serial numba functions whose first two arguments are a
task range, ``kernel(task_lo, task_hi, ...)``, compiled without the GIL (``nogil``). ``run``
splits ``[0, n_tasks)`` into one contiguous range per thread, as the static schedule of numba's
``prange`` does, runs the first range in the calling thread and the others on a pool of Python
threads, and returns when all are done. A task's rows are its own, so the result does not depend
on the thread count.

Why not ``prange`` inside the kernel: numba's parallel compile (parfor lowering) of an update
kernel took about four times its serial compile, and embengine compiles one kernel per row math,
row layout and 16-bit dtype pair (docs/design.md, "Update kernels run on Python threads"). The
pool is numba's thread count less one (``numba.get_num_threads()``, the calling thread's), made
when first needed, grown when that count grows, and made afresh in a forked child (a fork copies
no threads).

These threads are not OpenMP's: under numba's "omp" layer, OpenMP's threads (numba's pooling
kernels', torch's) spin after each parallel region unless ``OMP_WAIT_POLICY=PASSIVE``, and
the spinning takes the cores an update's threads need (an update then runs at about its
one-thread speed: docs/performance.md, "Update kernels on Python threads"). The embengine CLI
sets the policy; any other process is warned once (``SpinningThreadsWarning``) at its first
update on more than one thread.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numba as nb

__all__ = ["SpinningThreadsWarning", "ranges", "run"]


class SpinningThreadsWarning(RuntimeWarning):
    """OpenMP threads spin beside the update's threads (``OMP_WAIT_POLICY`` is not PASSIVE)."""


_lock = threading.Lock()
_checked_wait_policy = False
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _after_fork_in_child() -> None:
    global _pool, _pool_size, _lock
    _pool, _pool_size, _lock = None, 0, threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _executor(workers: int) -> ThreadPoolExecutor:
    """A pool of at least ``workers`` threads."""
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < workers:
            old = _pool
            _pool = ThreadPoolExecutor(workers, thread_name_prefix="embengine-update")
            _pool_size = workers
            if old is not None:
                old.shutdown(wait=False)  # its running tasks finish; later ones go to the new
        return _pool


def _check_wait_policy() -> None:
    """Warn once if OpenMP's threads spin beside ours (module docstring)."""
    global _checked_wait_policy
    if _checked_wait_policy:
        return
    try:
        layer = nb.threading_layer()
    except ValueError:  # no parallel kernel has run yet: no OpenMP thread of numba's exists
        return
    _checked_wait_policy = True
    policy = os.environ.get("OMP_WAIT_POLICY", "")
    if layer == "omp" and policy.upper() != "PASSIVE":
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
    thread (``numba.get_num_threads()``), the first in this thread. An exception in any range
    is raised here once every range has ended."""
    parts = ranges(int(n_tasks), nb.get_num_threads())
    if len(parts) <= 1:
        if parts:
            kernel(*parts[0], *args)
        return
    _check_wait_policy()
    pool = _executor(len(parts) - 1)
    futures = [pool.submit(kernel, lo, hi, *args) for lo, hi in parts[1:]]
    error: BaseException | None = None
    try:
        kernel(*parts[0], *args)
    except BaseException as e:  # wait for the others first: they write the same arrays
        error = e
    for f in futures:
        try:
            f.result()
        except BaseException as e:
            error = error or e
    if error is not None:
        raise error
