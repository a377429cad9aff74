"""Counter-based random initial values, in parallel: value = f(key, row, column, redraw round).

``key`` comes from (seed, table name); a row's values depend on nothing else, so any chunking,
order or sharding of the initialisation gives the same table. splitmix64 mixes the counter
``row * dim + col`` with the key and a stream number (one per redraw round / Box-Muller input).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from . import kernel

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_ROUND = np.uint64(0xD1B54A32D192ED03)
_TWO_POW_M53 = 1.0 / 9007199254740992.0

# Exact IEEE results matter here more than speed: no fastmath for initial values
# (fastmath=False overrides NUMBA_OPTIONS').


@kernel(inline="always", fastmath=False)
def _splitmix64(x):
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


@kernel(inline="always", fastmath=False)
def uniform01(key, row, col, dim, stream):
    """A double in [0, 1) from 53 random bits."""
    counter = np.uint64(row) * np.uint64(dim) + np.uint64(col)
    x = _splitmix64(counter ^ key) ^ (np.uint64(stream) * _ROUND)
    return np.float64(_splitmix64(x) >> np.uint64(11)) * _TWO_POW_M53


@kernel(parallel=True, fastmath=False)
def fill_uniform(out, rows, key, low, high):
    dim = out.shape[1]
    for i in nb.prange(rows.shape[0]):
        for j in range(dim):
            out[i, j] = low + (high - low) * uniform01(key, rows[i], j, dim, 0)


@kernel(inline="always", fastmath=False)
def truncated_normal01(key, row, col, dim):
    """A standard normal value redrawn beyond 2: Box-Muller on two streams per round, round r
    using streams 2r and 2r + 1."""
    stream = 0
    while True:
        u1 = 1.0 - uniform01(key, row, col, dim, stream)  # in (0, 1]
        u2 = uniform01(key, row, col, dim, stream + 1)
        z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
        if abs(z) <= 2.0:
            return z
        stream += 2


@kernel(parallel=True, fastmath=False)
def fill_truncated_normal(out, rows, key, mean, stddev):
    """Normal(mean, stddev) redrawn beyond 2 standard deviations (``truncated_normal01``)."""
    dim = out.shape[1]
    for i in nb.prange(rows.shape[0]):
        for j in range(dim):
            out[i, j] = mean + stddev * truncated_normal01(key, rows[i], j, dim)


# ``init_rows``' fills: which values its weights get (``initializers.Fill.kind``), or none.
FILL_NONE, FILL_UNIFORM, FILL_TRUNCATED_NORMAL = 0, 1, 2


@kernel(parallel=True, fastmath=False)
def init_rows(data, data_i32, at, ids, fill, key, a, b, dim, const_cols, const_f32, const_i32):
    """New rows written in place, each in one pass: row ``at[i]`` of ``data`` (float32 rows;
    ``data_i32`` the same memory as int32) gets, in columns ``:dim``, the values ``fill_uniform``
    (``fill`` FILL_UNIFORM, in ``[a, b)``) or ``fill_truncated_normal`` (FILL_TRUNCATED_NORMAL,
    mean ``a``, stddev ``b``) give id ``ids[i]`` (FILL_NONE: left as they are), then for each
    ``(start, width, is_int)`` row of ``const_cols`` those columns set to ``const_f32[k]`` (or
    ``const_i32[k]`` as int32): a keyed table's initial weights and slots, where computing
    them into an array and scattering it, then each slot, read and wrote every row once more."""
    for i in nb.prange(at.shape[0]):
        r = at[i]
        if fill == FILL_UNIFORM:
            for j in range(dim):
                data[r, j] = a + (b - a) * uniform01(key, ids[i], j, dim, 0)
        elif fill == FILL_TRUNCATED_NORMAL:
            for j in range(dim):
                data[r, j] = a + b * truncated_normal01(key, ids[i], j, dim)
        for k in range(const_cols.shape[0]):
            start, width = const_cols[k, 0], const_cols[k, 1]
            if const_cols[k, 2]:
                for c in range(start, start + width):
                    data_i32[r, c] = const_i32[k]
            else:
                for c in range(start, start + width):
                    data[r, c] = const_f32[k]
