"""Gather + combine: one activation row per (sample) or (sample, position), in parallel.

Each activation row is owned by one thread, so there are no atomics: row ``o`` sums
``gains[k] * table[unique[inverse[k]]]`` over its occurrences ``k`` (the CSR ``output_offsets``).
Optional simulated quantization (TPU QuantizationConfig) rounds every gathered value to one of
``num_buckets`` levels in ``[lower, upper]`` before it is combined.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from . import NUMBA_OPTIONS
from ._intrinsics import prefetch_row

# Output rows per parallel task: enough work to amortise scheduling, small enough to balance.
ROWS_PER_TASK = 64
# Occurrences ahead whose table row is requested while the current one is added (tuned on
# W1; see docs/performance.md).
PREFETCH_DISTANCE = 16


@nb.njit(inline="always", **NUMBA_OPTIONS)
def _pool_rows(data, dim, unique, inverse, gains, output_offsets, out, quant, prefetch, first,
               stop):  # fmt: skip
    """Activation rows ``first:stop`` (one task); see ``pool``."""
    buckets = quant[0]
    lower = quant[1]
    upper = quant[2]
    quantum = (upper - lower) / (buckets - 1.0) if buckets > 0 else 1.0
    last_k = output_offsets[stop]
    # The sum builds in a scratch row, not in ``out``: LLVM cannot rule out that ``out``
    # aliases ``data``, so it would store and reload it after every occurrence (-20% on W1).
    acc = np.empty(dim, dtype=np.float32)
    # Indexed accesses, not row views: a view per occurrence costs atomic reference counts.
    for o in range(first, stop):
        for j in range(dim):
            acc[j] = 0.0
        for k in range(output_offsets[o], output_offsets[o + 1]):
            if k + prefetch < last_k:
                prefetch_row(data, unique[inverse[k + prefetch]], dim)
            r = unique[inverse[k]]
            gk = gains[k]
            if buckets > 0:
                for j in range(dim):
                    x = min(max(np.float64(data[r, j]), lower), upper)
                    x = np.floor((x - lower) / quantum + 0.5) * quantum + lower
                    acc[j] += np.float32(gk * x)
            else:
                for j in range(dim):
                    acc[j] += gk * data[r, j]
        for j in range(dim):
            out[o, j] = acc[j]


@nb.njit(parallel=True, **NUMBA_OPTIONS)
def pool(data, dim, unique, inverse, gains, output_offsets, out, quant, prefetch):
    """out[o, :] = sum over k in occurrences(o) of gains[k] * q(data[unique[inverse[k]], :dim]).

    ``quant`` is float64 [3]: (num_buckets, lower, upper); num_buckets == 0 means no quantization.
    ``pool_kernel(dim)`` gives a faster kernel for common dims.
    """
    n_out = out.shape[0]
    for task in nb.prange((n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        first = task * ROWS_PER_TASK
        _pool_rows(data, dim, unique, inverse, gains, output_offsets, out, quant, prefetch, first,
                   min(n_out, first + ROWS_PER_TASK))  # fmt: skip


def _fixed_dim_pool(fixed_dim: int):
    """``pool`` with the row width a compile-time constant: LLVM then unrolls the loops over
    the row and keeps the sum in registers (W1-lookup: pooling ~1.35x faster at dim 64).
    numba caches each closure under its own constant."""

    @nb.njit(parallel=True, **NUMBA_OPTIONS)
    def pool_fixed(data, dim, unique, inverse, gains, output_offsets, out, quant, prefetch):
        n_out = out.shape[0]
        for task in nb.prange((n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
            first = task * ROWS_PER_TASK
            _pool_rows(data, fixed_dim, unique, inverse, gains, output_offsets, out, quant,
                       prefetch, first, min(n_out, first + ROWS_PER_TASK))  # fmt: skip

    return pool_fixed


# Common dims get their own kernel, each compiled on first use; other dims use ``pool``.
_FIXED_DIMS = {d: _fixed_dim_pool(d) for d in (8, 16, 32, 64, 128)}


def pool_kernel(dim: int):
    """The pooling kernel for rows of ``dim`` floats (same arguments and results as ``pool``)."""
    return _FIXED_DIMS.get(int(dim), pool)
