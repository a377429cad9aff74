"""Constants and helpers of the update kernels that ``codegen.py`` writes (the per-row pipeline
itself is in the kernel template, so that it inlines as plain loops)."""

from __future__ import annotations

import numba as nb
import numpy as np

from ..optimizers._row_math import MAX_SLOTS as MAX_FLOAT_SLOTS
from . import kernel, tasks

# Columns of the per-table metadata array: dim, flags, then the float slots that are copied
# into scratch arrays (codegen.py): their number, and (start column, width) of each.
M_DIM, M_GCLIP, M_WCLIP, M_WD_MODE, M_ACCUMULATE, M_NF = range(6)
M_F0 = 6  # M_F0 + 2 * i: start column of float slot i; M_F0 + 2 * i + 1: its width
M_COLS = M_F0 + 2 * MAX_FLOAT_SLOTS
WD_NONE, WD_DECOUPLED, WD_L2 = 0, 1, 2
# Common hyperparameters, then the row math's params and flags (RowMath.values), which the
# kernels read into locals of their names.
H_GCLIP_LO, H_GCLIP_HI, H_WCLIP_LO, H_WCLIP_HI = range(4)
H_COMMON = 4

ROWS_PER_TASK = 64
# Work balancing of the update: a row update costs about as much as this many occurrences.
ROW_COST = 4
MAX_TASKS = 512
# Rows ahead whose memory is requested while the current row is updated (tuned on W1).
PREFETCH_DISTANCE = 4
# Occurrences ahead whose activation-gradient row is requested while summing a row's gradient.
GRAD_PREFETCH = 8


@kernel()
def balanced_tasks(unique_offsets):
    """Task boundaries over the unique rows with about equal work each.

    A row costs its occurrences (gradient sums) plus ROW_COST for its update. Hot ids have
    thousands of occurrences and come first (rows are in order of first appearance), so equal
    row counts per task would hand most of the work to the first thread of ``tasks.run``.
    """
    n = unique_offsets.shape[0] - 1
    total = (unique_offsets[n] - unique_offsets[0]) + ROW_COST * n
    n_tasks = max(1, min(n // 16, MAX_TASKS))
    bounds = np.empty(n_tasks + 1, dtype=np.int64)
    bounds[0] = 0
    t = 1
    done = 0
    for u in range(n):
        done += unique_offsets[u + 1] - unique_offsets[u] + ROW_COST
        while t < n_tasks and done * n_tasks >= total * t:
            bounds[t] = u + 1
            t += 1
    while t <= n_tasks:
        bounds[t] = n
        t += 1
    return bounds


def run_balanced(kernel, unique_offsets: np.ndarray, *args) -> None:
    """``kernel(claims, n_tasks, bounds, *args)`` over the tasks ``bounds`` of
    ``balanced_tasks(unique_offsets)``, claimed by ``tasks.run``'s threads as they go: how the
    fused updates and the update's floor (kernels/floor.py) walk the touched rows."""
    tasks.run_many([balanced_call(kernel, unique_offsets, *args)])


def balanced_call(kernel, unique_offsets: np.ndarray, *args) -> tuple:
    """``run_balanced``'s call as ``(kernel, n_tasks, args)``, for ``tasks.run_many``."""
    bounds = balanced_tasks(unique_offsets)
    bounds.setflags(write=False)  # read-only like the other inputs: one kernel type (inputs.frozen)
    return kernel, len(bounds) - 1, (bounds, *args)


def every_row_tasks(unique: np.ndarray, live: np.ndarray, n_rows: int):
    """(task_start, where) of an every-row update (``update_every_row_<name>``): tasks of
    ROWS_PER_TASK rows within each live range ``live[i]`` (``[start, stop)``), range i's tasks
    ``task_start[i]:task_start[i + 1]``; ``where[r]``, the unique row u with ``unique[u] == r``,
    or -1 for a row the batch did not touch."""
    where = np.full(n_rows, -1, dtype=np.int64)
    touched = unique >= 0
    where[unique[touched]] = np.flatnonzero(touched)
    task_start = np.zeros(live.shape[0] + 1, dtype=np.int64)
    np.cumsum((live[:, 1] - live[:, 0] + ROWS_PER_TASK - 1) // ROWS_PER_TASK, out=task_start[1:])
    return task_start, where


@kernel(parallel=True)
def nonfinite_rows(unique_offsets, unique_gains, unique_segments, grad, accumulate):
    """skip_row policy: 1 for each unique row whose update would see a non-finite gradient (its
    float64 sum with accumulation, any single contribution without), else 0.

    A separate pass: checks inside the update kernel keep LLVM from optimising its loops."""
    n = unique_offsets.shape[0] - 1
    dim = grad.shape[1]
    out = np.zeros(n, dtype=np.uint8)
    for u in nb.prange(n):
        bad = False
        if accumulate:
            for j in range(dim):
                s = 0.0
                for p in range(unique_offsets[u], unique_offsets[u + 1]):
                    s += np.float64(unique_gains[p]) * grad[unique_segments[p], j]
                bad = bad or not np.isfinite(s)
        else:
            for p in range(unique_offsets[u], unique_offsets[u + 1]):
                for j in range(dim):
                    bad = bad or not np.isfinite(
                        np.float64(unique_gains[p]) * grad[unique_segments[p], j]
                    )
        out[u] = bad
    return out


def compiled(function):
    """A registered row math function (plain Python, ``embengine.optimizers.row_math``)
    compiled for the update kernels, which inline it: one dispatcher per function."""
    found = _COMPILED.get(function)
    if found is None:
        found = _COMPILED[function] = kernel(inline="always")(function)
    return found


_COMPILED: dict = {}
