"""Starting numba's thread pool without disturbing torch, and where it cannot run (after fork).

numba's "omp" layer shares torch's libgomp; its pool start-up calls
``omp_set_num_threads(NUMBA_NUM_THREADS)``, which would silently undo a user's
``torch.set_num_threads()``. Every entry point into a parallel kernel calls ``start_pool()``
first, which starts the pool once and puts torch's thread count back.

GNU OpenMP is not fork-safe: a process forked without exec (a DataLoader worker under Linux's
default start method) inherits its parent's OpenMP state but not its threads. Measured with
numba 0.68 / torch 2.13: a parallel kernel in such a child is killed by numba's omp layer
("Terminating: fork() called from a process already using GNU OpenMP, this is unsafe.",
SIGTERM) if the parent had started numba's pool, which building any engine does (the
initializers' kernels are parallel); and a parallel numba kernel hung in libgomp in a child
whose parent had run only torch's parallel ops (the pool numba's omp layer shares). So
``forked()`` tells (by pid) whether this process was forked from the one that imported the
kernels, and batch preparation runs serial code there (numba_backend.build_tables_numba);
``start_pool`` refuses the known-fatal case with an error that says why.
"""

from __future__ import annotations

import os
import sys

import numba as nb
import numpy as np

from . import kernel

# The process that imported this module. A forked child keeps the module (and the parent's
# OpenMP state) with another pid; a spawned process imports it anew.
_HOME_PID = os.getpid()
_started = False  # start_pool started numba's pool, here or in the process this was forked from
_started_pid: int | None = None  # where
_started_before_fork = False  # in a forked child: the parent had started it


def _after_fork_in_child() -> None:
    # A hook rather than a pid comparison in start_pool, which runs per table and per step
    # (os.getpid() is a system call; its cost: docs/performance.md, "Figures behind the code").
    global _started_before_fork
    _started_before_fork = _started


os.register_at_fork(after_in_child=_after_fork_in_child)


@kernel(parallel=True)
def _touch(x):
    for i in nb.prange(x.shape[0]):
        x[i] = i


def forked() -> bool:
    """True in a process forked (without exec) from the one that imported embengine's kernels:
    OpenMP parallel regions are unsafe there (see the module docstring), so batch preparation
    runs its serial kernel (numba_backend.build_tables_numba)."""
    return os.getpid() != _HOME_PID


def start_pool() -> None:
    """Start numba's thread pool once per process, keeping torch's thread count.

    Raises RuntimeError in a process forked from one in which this function had started the
    pool under the omp layer, where numba would kill the process at the first parallel kernel
    (the fork-safe "workqueue" and "tbb" layers run there)."""
    global _started, _started_pid
    if _started:
        if _started_before_fork and nb.threading_layer() == "omp":
            raise RuntimeError(
                f"this process ({os.getpid()}) was forked from process {_started_pid}, which "
                "had started numba's OpenMP thread pool: GNU OpenMP is not fork-safe, and "
                "numba kills a forked process at its first parallel kernel. In forked "
                "DataLoader workers only preprocessing runs (engine.preprocess or "
                "engine.preprocessor(), serially there); look up and train in the main "
                "process, or start the workers with the 'spawn' method"
            )
        return
    torch = sys.modules.get("torch")
    n = torch.get_num_threads() if torch is not None else None
    _touch(np.zeros(4, dtype=np.int64))
    if n is not None:
        torch.set_num_threads(n)
    _started, _started_pid = True, os.getpid()
