"""A training lookup in one parallel region: deduplication and pooling, tasks claimed as they go.

A training step needs two things from its features: the activations (pooling) and the
deduplication data the update uses (``prepare``). The pooling does not need the deduplication:
it can read rows straight from the ids, as a lookup-only batch does (``lookup.pool_bags``, the
same sums in the same order, so the same bits as pooling through the prepared batch). So both
run in one region, as tasks that the threads claim from a shared counter (``fetch_add``): first
each table's preparation, largest first, then chunks of ``POOL_TASK`` samples of each feature.

The pooling reads a logical table's rows through its own base address (``fdata``): in a storage
whose rows are ids at a fixed base (``TableStorage.row_bases``, DenseTable), the rows from that
base on are indexed by id, so no id is shifted here. Features of other storages (address 0) are
not pooled here: their rows are resolved by the storage after this kernel, and pooled through
them.

Why: a single big table (W3) is prepared by one thread while the other waits, and its pooling
only starts after; here the other thread pools meanwhile, then both finish the pooling. With
many tables the threads move from preparing to pooling without a join in between, and every
table is pooled by one kernel call instead of one call each.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from . import kernel
from ._intrinsics import fetch_add, float32_rows_at
from .lookup import pool_range
from .prepare import (
    F_COMBINER,
    F_ID_BASE,
    F_OFF_BASE,
    F_OUT_START,
    F_SAMPLES,
    F_SEQ,
    F_TABLE,
    F_W_BASE,
    _prepare_table,
)

# Columns of the per-table array ``tmeta``: the table's memory (address, rows, row width in
# floats, dim) and its activation matrix (address, rows).
T_DATA, T_ROWS, T_WIDTH, T_DIM, T_OUT, T_N_OUT = range(6)
T_COLS = 6
# Columns of the per-feature array ``fdata``: the address of the row of its logical table's id 0
# (0: not pooled here) and the rows from there on.
FD_DATA, FD_ROWS = range(2)
FD_COLS = 2
# Samples per pooling task: small enough to balance two threads' tails, large enough that the
# claim (one atomic add) is noise.
POOL_TASK = 64


@kernel()
def pool_tasks(fmeta, fdata):
    """The pooling tasks: rows ``(feature, first sample, stop sample)``, each feature's samples
    in chunks of POOL_TASK; none for a feature without an address (``fdata``)."""
    n = 0
    for f in range(fmeta.shape[0]):
        if fdata[f, FD_DATA] != 0:
            n += (fmeta[f, F_SAMPLES] + POOL_TASK - 1) // POOL_TASK
    tasks = np.empty((n, 3), dtype=np.int64)
    i = 0
    for f in range(fmeta.shape[0]):
        if fdata[f, FD_DATA] == 0:
            continue
        for first in range(0, fmeta[f, F_SAMPLES], POOL_TASK):
            tasks[i, 0] = f
            tasks[i, 1] = first
            tasks[i, 2] = min(first + POOL_TASK, fmeta[f, F_SAMPLES])
            i += 1
    return tasks


@kernel()
def _pool_task(f, first, stop, fmeta, ids, offsets, weights, tmeta, fdata, quant, prefetch):
    """Samples ``first:stop`` of feature ``f`` into its table's activation matrix, straight from
    the ids (``lookup.pool_range``, as ``lookup.pool_bags`` does), which index the rows of its
    logical table from its base address on."""
    t = fmeta[f, F_TABLE]
    dim = tmeta[t, T_DIM]
    data = float32_rows_at(fdata[f, FD_DATA], fdata[f, FD_ROWS], tmeta[t, T_WIDTH])
    out = float32_rows_at(tmeta[t, T_OUT], tmeta[t, T_N_OUT], dim)
    n = fmeta[f, F_SAMPLES]
    f_offsets = offsets[fmeta[f, F_OFF_BASE] : fmeta[f, F_OFF_BASE] + n + 1]
    n_ids = f_offsets[n]
    f_ids = ids[fmeta[f, F_ID_BASE] : fmeta[f, F_ID_BASE] + n_ids]
    w_base = fmeta[f, F_W_BASE]
    f_weights = weights[w_base : w_base + n_ids] if w_base >= 0 else weights[:0]
    pool_range(
        data,
        dim,
        f_ids,
        f_offsets,
        f_weights,
        fmeta[f, F_COMBINER],
        fmeta[f, F_SEQ],
        out,
        fmeta[f, F_OUT_START],
        quant[t],
        prefetch,
        first,
        stop,
    )


@kernel(parallel=True)
def prepare_and_pool(
    prep_order,
    n_workers,
    fmeta,
    ids,
    offsets,
    weights,
    occ_base,
    out_base,
    occ_ids,
    gains,
    segments,
    unique,
    inverse,
    n_unique,
    unique_offsets,
    unique_gains,
    unique_segments,
    output_offsets,
    unique_bounds,
    tmeta,
    fdata,
    quant,
    prefetch,
):
    """``prepare.prepare_tables`` (tables in ``prep_order``, largest first) and the pooling of
    every feature with an address in ``fdata`` into its table's activation matrix (``tmeta``;
    ``quant[t]`` as in ``lookup.pool``), by ``n_workers`` workers claiming tasks from one
    counter. The outputs are those of the two kernels run one after the other."""
    n_prep = prep_order.shape[0]
    tasks = pool_tasks(fmeta, fdata)
    n_tasks = n_prep + tasks.shape[0]
    counter = np.zeros(1, dtype=np.int64)
    for _ in nb.prange(n_workers):
        while True:
            i = fetch_add(counter, 0, 1)
            if i >= n_tasks:
                break
            if i < n_prep:
                _prepare_table(
                    prep_order[i],
                    fmeta,
                    ids,
                    offsets,
                    weights,
                    occ_base,
                    out_base,
                    occ_ids,
                    gains,
                    segments,
                    unique,
                    inverse,
                    n_unique,
                    unique_offsets,
                    unique_gains,
                    unique_segments,
                    output_offsets,
                    unique_bounds,
                )
            else:
                k = i - n_prep
                _pool_task(
                    tasks[k, 0],
                    tasks[k, 1],
                    tasks[k, 2],
                    fmeta,
                    ids,
                    offsets,
                    weights,
                    tmeta,
                    fdata,
                    quant,
                    prefetch,
                )
