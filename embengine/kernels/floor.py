"""The update's floor: the memory work any fused update of a row must do, without its math.

``fixed_touch_rows(DIM, WIDTH)`` walks the touched rows as the fixed-layout fused update does (the
same balanced tasks on the same threads, ``tasks.run``; the same prefetching of table rows and of
activation-gradient rows), sums each row's gradient from its occurrences in float64, and reads and
writes every column of the row once (weights and slots: ``WIDTH``), leaving the values as they were
(a finite ``x`` stays ``x + 0 * g``; ``zero`` is an argument so that LLVM cannot drop the stores).
Its time is what an update cannot avoid; ``embengine bench --workloads W1-floor`` prints each
optimizer's update as a multiple of it (issue 17: "close to the limit" measured, not argued).
"""

from __future__ import annotations

import functools

import numpy as np

from . import kernel
from ._intrinsics import fetch_add, prefetch_row, prefetch_row_for_write
from .pipeline import GRAD_PREFETCH


@functools.cache
def fixed_touch_rows(DIM: int, WIDTH: int):
    """The floor kernel for rows of WIDTH float32 columns whose first DIM are the weights:
    ``touch_rows(claims, n_tasks, bounds, data, unique, unique_offsets, unique_gains,
    unique_segments, grad, zero, prefetch)``, the arguments of the fused update's of the same
    names: run it with ``pipeline.run_balanced(touch_rows, unique_offsets, data, ...)``."""
    if not 1 <= DIM <= WIDTH:
        raise ValueError(f"fixed_touch_rows: need 1 <= DIM <= WIDTH, got DIM={DIM}, WIDTH={WIDTH}")

    @kernel()
    def touch_rows(
        claims,
        n_tasks,
        bounds,
        data,
        unique,
        unique_offsets,
        unique_gains,
        unique_segments,
        grad,
        zero,
        prefetch,
    ):
        n_occurrences = unique_segments.shape[0]
        zero32 = np.float32(zero)
        while True:
            task = fetch_add(claims, 0, 1)
            if task >= n_tasks:
                break
            g = np.zeros(DIM, dtype=np.float64)
            stop = bounds[task + 1]
            for u in range(bounds[task], stop):
                if u + prefetch < stop:
                    prefetch_row_for_write(data, unique[u + prefetch], WIDTH)
                r = unique[u]
                if r < 0:
                    continue
                for j in range(DIM):
                    g[j] = 0.0
                for p in range(unique_offsets[u], unique_offsets[u + 1]):
                    if p + GRAD_PREFETCH < n_occurrences:
                        prefetch_row(grad, unique_segments[p + GRAD_PREFETCH], DIM)
                    gk = np.float64(unique_gains[p])
                    seg = unique_segments[p]
                    for j in range(DIM):
                        g[j] += gk * grad[seg, j]
                for j in range(DIM):
                    data[r, j] = np.float32(np.float64(data[r, j]) + zero * g[j])
                for c in range(DIM, WIDTH):
                    data[r, c] = data[r, c] + zero32 * data[r, c]

    return touch_rows
