"""A training lookup in one parallel region: deduplication and pooling, tasks claimed as they go.

A training step needs two things from its features: the activations (pooling) and the
deduplication data the update uses (``prepare``). The pooling does not need the deduplication:
it can read rows straight from the ids, as a lookup-only batch does (``lookup.pool_bags``, the
same sums in the same order, so the same bits as pooling through the prepared batch). So both
run in one region, as tasks that the threads claim from a shared counter (``fetch_add``): first
each table's preparation, largest first, then chunks of ``POOL_TASK`` samples of each feature.

The pooling reads a logical table's rows through its own base address (``fdata``): in a storage
whose rows are ids at a fixed base (``TableStorage.row_bases``, DenseTable), the rows from that
base on are indexed by id, so no id is shifted here. A keyed table's features are pooled here
too when its preparation's probe finds a live row for every key (``prepare_and_pool``); other
storages' features (address 0), and a keyed table with a key without a row, are pooled after
this kernel, through the rows their storage resolved.

Why: a single big table (W3) is prepared by one thread while the other waits, and its pooling
only starts after; here the other thread pools meanwhile, then both finish the pooling (a keyed
table's too: the pooling thread probes the keys itself until the preparation is done). With
many tables the threads move from preparing to pooling without a join in between, and every
table is pooled by one kernel call instead of one call each.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from ..precision import BF16, F16, F32
from . import FIXED_DIMS, kernel
from ._intrinsics import (
    as_readonly,
    fetch_add,
    float32_rows_at,
    int32_rows_at,
    int64_rows_at,
    stack_row,
    uint8_rows_at,
    uint16_rows_at,
)
from .keyed_index import RECORD_COLS, find_range, touch
from .lookup import ROWS_PER_TASK, _pool_rows, pool_range, pool_range_16
from .prepare import (
    F_COMBINER,
    F_OFF_BASE,
    F_OUT_START,
    F_SAMPLES,
    F_SEQ,
    F_TABLE,
    F_W_BASE,
    _prepare_table,
    feature_ids,
)

# Columns of the per-table array ``tmeta``: the table's memory (address, rows, row width in
# floats, dim) and its activation matrix (address, rows).
T_DATA, T_ROWS, T_WIDTH, T_DIM, T_OUT, T_N_OUT = range(6)
# A keyed table's (``prepare_and_pool``): the address of its index's slots (0: not keyed),
# their number and their entries' value bits, the address of its row records (``keyed_index``:
# key, last-touched step, touch count; as many as the rows, T_ROWS), the address of its rows'
# "looks up as absent" bytes (0: none) and their number, whether the kernel touches its rows
# (1) or not (0), and the step (``storage.keyed.IndexView``).
T_INDEX, T_INDEX_SLOTS, T_ROW_BITS, T_RECORDS, T_DEAD, T_DEAD_ROWS, T_TOUCH, T_STEP = range(6, 14)
T_COLS = 14
# ``ready[t]`` of a keyed table after its preparation (``prepare_and_pool``): every unique key
# had a live row (touched in the region, if the table allows), or not.
PROBED_ALL_FOUND, PROBED_SOME_MISSING = 1, 2
# Unique keys per chunk of a keyed table's probe (``_probe_chunks``): the threads claim the
# chunks, so one big table's probe is shared (~150 us of misses a chunk; docs/performance.md).
PROBE_CHUNK = 2048
# A keyed table's probe progress in the region, at ``progress[PR_COLS * t + column]``: its
# chunks + 1 once prepared (0 until then), chunks claimed, chunks done, chunks with a missing
# key.
PR_CHUNKS, PR_CLAIMED, PR_DONE, PR_MISSING = range(4)
PR_COLS = 4
# Columns of the per-feature array ``fdata``: the address of the row of its logical table's id 0
# (0: not pooled here) and the rows from there on; for a feature whose ids are keys (a keyed
# table, ``pool_features``), the address of its index's slots (0: ids are rows), their number
# and their entries' value bits, the address of its row records (as many as FD_ROWS), and the
# address of a byte per row, 1 for a row that pools as absent (0: none) and their number.
FD_DATA, FD_ROWS, FD_INDEX, FD_INDEX_SLOTS, FD_ROW_BITS, FD_RECORDS = range(6)
FD_DEAD, FD_DEAD_ROWS = 6, 7
# A lookup-only batch's feature (``pool_features``): its logical table's vocabulary size,
# against which the kernel range-checks its ids (0: no check, e.g. keys).
FD_VOCAB = 8
# A training lookup's feature of a table of 16-bit weights, pooled in the region from its
# uint16 rows (``_pool_task_half``): their kind (precision.BF16 / F16; F32, 0: float32 rows).
FD_KIND = 9
FD_COLS = 10
# Columns of the per-table array ``pmeta`` of ``pool_tables``: the rows pooled from (address,
# rows, row width in elements, dim), the activation matrix (address, rows), where the table's
# rows start in ``rows``, its occurrences start in ``inverse`` and ``gains``, its CSR in
# ``output_offsets``, and its rows' kind (precision.F32: float32; F16 / BF16: uint16 units,
# the weights 16-bit values widened as they are read).
P_DATA, P_ROWS, P_WIDTH, P_DIM, P_OUT, P_N_OUT, P_ROW_BASE, P_OCC_BASE, P_OFF_BASE = range(9)
P_KIND = 9
P_COLS = 10
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
def _ids_in_range(f, first, stop, fmeta, offsets, fdata):
    """Whether the ids of samples ``first:stop`` of feature ``f`` lie in ``[0, FD_VOCAB)``
    (the vocabulary of its logical table; 0: no check). Read just before they are pooled, so
    the pass costs no extra trip to memory."""
    vocab = fdata[f, FD_VOCAB]
    if vocab <= 0:
        return True
    n = fmeta[f, F_SAMPLES]
    f_offsets = offsets[fmeta[f, F_OFF_BASE] : fmeta[f, F_OFF_BASE] + n + 1]
    f_ids = feature_ids(f, fmeta, f_offsets[n])
    bad = False
    for k in range(f_offsets[first], f_offsets[stop]):
        bad |= np.uint64(f_ids[k]) >= np.uint64(vocab)  # a negative id is huge as uint64
    return not bad


@kernel()
def _task_args(f, first, stop, fmeta, offsets, weights, tmeta, quant, prefetch, fdata):
    """``lookup.pool_range``'s arguments after the rows and the width, for samples
    ``first:stop`` of feature ``f`` straight from its ids (as ``lookup.pool_bags`` pools)."""
    t = fmeta[f, F_TABLE]
    n = fmeta[f, F_SAMPLES]
    f_offsets = offsets[fmeta[f, F_OFF_BASE] : fmeta[f, F_OFF_BASE] + n + 1]
    n_ids = f_offsets[n]
    w_base = fmeta[f, F_W_BASE]
    return (
        feature_ids(f, fmeta, n_ids),
        f_offsets,
        weights[w_base : w_base + n_ids] if w_base >= 0 else weights[:0],
        fmeta[f, F_COMBINER],
        fmeta[f, F_SEQ],
        float32_rows_at(tmeta[t, T_OUT], tmeta[t, T_N_OUT], tmeta[t, T_DIM]),
        fmeta[f, F_OUT_START],
        quant[t],
        prefetch,
        first,
        stop,
    )


@kernel()
def _pool_task(f, first, stop, fmeta, offsets, weights, tmeta, fdata, quant, prefetch):
    """Samples ``first:stop`` of feature ``f`` into its table's activation matrix, straight from
    the ids (``lookup.pool_range``, as ``lookup.pool_bags`` does), which index the rows of its
    logical table from its base address on."""
    t = fmeta[f, F_TABLE]
    data = float32_rows_at(fdata[f, FD_DATA], fdata[f, FD_ROWS], tmeta[t, T_WIDTH])
    args = _task_args(f, first, stop, fmeta, offsets, weights, tmeta, quant, prefetch, fdata)
    pool_range(data, tmeta[t, T_DIM], *args)


@kernel()
def _pool_task_half(f, first, stop, fmeta, offsets, weights, tmeta, fdata, quant, prefetch):
    """``_pool_task`` for a feature of a table of 16-bit weights (``fdata[f, FD_KIND]``, BF16
    or F16): its uint16 rows, each value widened as it is read, as ``pool_tables`` pools them
    after the region (the same bits). A function of its own, compiled only by the region
    kernel of an engine with such tables (``_make_prepare_and_pool``'s ``half``)."""
    t = fmeta[f, F_TABLE]
    # T_WIDTH counts the row's float32 columns (its float32 view): two uint16 units each.
    data = uint16_rows_at(fdata[f, FD_DATA], fdata[f, FD_ROWS], 2 * tmeta[t, T_WIDTH])
    args = _task_args(f, first, stop, fmeta, offsets, weights, tmeta, quant, prefetch, fdata)
    pool_range_16(data, tmeta[t, T_DIM], args, fdata[f, FD_KIND])


@kernel()
def _probed_rows(f, first, stop, fmeta, offsets, fdata):
    """The rows of the keys of samples ``first:stop`` of keyed feature ``f``, one per id (-1:
    none), probed into a row array of the task's own (``keyed_index.find_range``: misses
    overlapped by prefetching), rows flagged in ``FD_DEAD`` dropped."""
    slots = int32_rows_at(fdata[f, FD_INDEX], fdata[f, FD_INDEX_SLOTS], 1)
    keys = int64_rows_at(fdata[f, FD_RECORDS], fdata[f, FD_ROWS], RECORD_COLS // 2)
    n = fmeta[f, F_SAMPLES]
    f_offsets = offsets[fmeta[f, F_OFF_BASE] : fmeta[f, F_OFF_BASE] + n + 1]
    lo = f_offsets[first]
    hi = f_offsets[stop]
    f_ids = feature_ids(f, fmeta, f_offsets[n])
    rows = np.empty(hi - lo, dtype=np.int64)
    find_range(slots, keys, fdata[f, FD_ROW_BITS], f_ids[lo:hi], rows, 0, hi - lo)
    if fdata[f, FD_DEAD] != 0:
        dead = uint8_rows_at(fdata[f, FD_DEAD], fdata[f, FD_DEAD_ROWS], 1)
        for i in range(hi - lo):
            if rows[i] >= 0 and dead[rows[i], 0] != 0:
                rows[i] = -1
    return rows


@kernel()
def _found_rows(
    f, first, stop, fmeta, offsets, occ_base, out_base, n_unique, found, inverse, output_offsets
):
    """``_probed_rows`` from what the preparation of the feature's table found instead of
    probing: the row of each id's unique key (``found[inverse[k]]``, ``k`` its occurrence,
    reached through the CSR of the table's activation rows, ``output_offsets``: a bag's
    occurrences are its ids in order, a sequence position holds its one id). Ids past a
    sequence's length (no occurrence) get -1; the pooling does not read them."""
    t = fmeta[f, F_TABLE]
    lo_t = occ_base[t]
    rows_t = found[lo_t : lo_t + n_unique[t]]
    inv = inverse[lo_t:]
    csr = output_offsets[out_base[t] + t :]
    n = fmeta[f, F_SAMPLES]
    f_offsets = offsets[fmeta[f, F_OFF_BASE] : fmeta[f, F_OFF_BASE] + n + 1]
    lo = f_offsets[first]
    rows = np.empty(f_offsets[stop] - lo, dtype=np.int64)
    seq = fmeta[f, F_SEQ]
    start = fmeta[f, F_OUT_START]
    for b in range(first, stop):
        for j in range(f_offsets[b + 1] - f_offsets[b]):
            if seq > 0:
                k = csr[start + b * seq + j] if j < seq else -1
            else:
                k = csr[start + b] + j
            rows[f_offsets[b] - lo + j] = -1 if k < 0 else rows_t[inv[k]]
    return rows


@kernel()
def _keyed_task_args(f, first, stop, rows, fmeta, offsets, weights, tmeta, fdata, quant, prefetch):
    """``lookup.pool_range``'s arguments for samples ``first:stop`` of a feature whose ids are
    keys, pooled from ``rows`` (one per id: ``_probed_rows``, ``_found_rows``), read-only as
    a feature's ids are: each width's pooling compiles once for both."""
    t = fmeta[f, F_TABLE]
    dim = tmeta[t, T_DIM]
    n = fmeta[f, F_SAMPLES]
    f_offsets = offsets[fmeta[f, F_OFF_BASE] : fmeta[f, F_OFF_BASE] + n + 1]
    lo = f_offsets[first]
    hi = f_offsets[stop]
    task_offsets = f_offsets[first : stop + 1] - lo
    w_base = fmeta[f, F_W_BASE]
    f_weights = weights[w_base + lo : w_base + hi] if w_base >= 0 else weights[:0]
    seq = fmeta[f, F_SEQ]
    return (
        float32_rows_at(fdata[f, FD_DATA], fdata[f, FD_ROWS], tmeta[t, T_WIDTH]),
        dim,
        as_readonly(rows),
        as_readonly(task_offsets),
        f_weights,
        fmeta[f, F_COMBINER],
        seq,
        float32_rows_at(tmeta[t, T_OUT], tmeta[t, T_N_OUT], dim),
        fmeta[f, F_OUT_START] + first * (seq if seq > 0 else 1),
        quant[t],
        prefetch,
        stop - stop,  # the task's first sample, 0: an int64, as a literal 0 would not be
        stop - first,
    )


@kernel()
def _pool_keyed_task(f, first, stop, fmeta, offsets, weights, tmeta, fdata, quant, prefetch):
    """``_pool_task`` for a feature whose ids are keys: the task's keys probed first
    (``_probed_rows``), then pooled from their rows. An evaluation lookup has no
    deduplication pass that could have probed them, and a task's probes keep both threads
    busy where a probe of the whole batch ran on one."""
    rows = _probed_rows(f, first, stop, fmeta, offsets, fdata)
    pool_range(
        *_keyed_task_args(
            f, first, stop, rows, fmeta, offsets, weights, tmeta, fdata, quant, prefetch
        )
    )


@kernel(parallel=True)
def pool_features(n_workers, fmeta, offsets, weights, tmeta, fdata, quant, prefetch, bad):
    """A lookup-only batch of every table with an address in ``fdata`` (their ids are rows):
    ``prepare_and_pool``'s pooling tasks alone, claimed from one counter by ``n_workers``
    workers. A task whose ids are not all in their feature's vocabulary (``FD_VOCAB``) pools
    nothing and sets ``bad[f]`` (the caller raises)."""
    tasks = pool_tasks(fmeta, fdata)
    counter = np.zeros(1, dtype=np.int64)
    for _ in nb.prange(n_workers):
        while True:
            i = fetch_add(counter, 0, 1)
            if i >= tasks.shape[0]:
                break
            f = tasks[i, 0]
            if not _ids_in_range(f, tasks[i, 1], tasks[i, 2], fmeta, offsets, fdata):
                bad[f] = 1
                continue
            _pool_task(
                tasks[i, 0],
                tasks[i, 1],
                tasks[i, 2],
                fmeta,
                offsets,
                weights,
                tmeta,
                fdata,
                quant,
                prefetch,
            )


@kernel(parallel=True)
def pool_keyed_features(n_workers, fmeta, offsets, weights, tmeta, fdata, quant, prefetch, bad):
    """``pool_features`` for a batch with keyed features too (``fdata[f, FD_INDEX]``), whose
    tasks probe their keys first (``_pool_keyed_task``). A kernel of its own, so that an engine
    without keyed tables never compiles the keyed pooling (its row arrays are writable, so
    ``lookup.pool_range`` compiles again for them)."""
    tasks = pool_tasks(fmeta, fdata)
    counter = np.zeros(1, dtype=np.int64)
    for _ in nb.prange(n_workers):
        while True:
            i = fetch_add(counter, 0, 1)
            if i >= tasks.shape[0]:
                break
            args = (fmeta, offsets, weights, tmeta, fdata, quant, prefetch)
            f = tasks[i, 0]
            if not _ids_in_range(f, tasks[i, 1], tasks[i, 2], fmeta, offsets, fdata):
                bad[f] = 1
                continue
            if fdata[tasks[i, 0], FD_INDEX] != 0:
                _pool_keyed_task(tasks[i, 0], tasks[i, 1], tasks[i, 2], *args)
            else:
                _pool_task(tasks[i, 0], tasks[i, 1], tasks[i, 2], *args)


@kernel()
def _probe_chunks(
    t, tmeta, occ_base, unique, n_unique, unique_offsets, found, ready, progress, chunk
):
    """Chunks of keyed table ``t``'s probe, claimed one at a time until none is left (nothing
    if the table is not prepared yet): each chunk's ``chunk`` unique keys' rows into ``found``
    (at the keys' places). The thread that completes the last chunk publishes ``ready[t]`` (0
    until then): PROBED_ALL_FOUND if every key has a row that does not look up as absent, else
    PROBED_SOME_MISSING. Then, if every key had one and the table lets the kernel touch
    (``T_TOUCH``), it writes each row's step and count, as the storage's ``rows_for`` would
    (one writer). The probe reads the index only, so the rows do not depend on which thread
    probed which chunk."""
    at = PR_COLS * t
    n_chunks = fetch_add(progress, at + PR_CHUNKS, 0) - 1
    if n_chunks < 0:
        return
    lo = occ_base[t]
    u = n_unique[t]
    slots = int32_rows_at(tmeta[t, T_INDEX], tmeta[t, T_INDEX_SLOTS], 1)
    keys = int64_rows_at(tmeta[t, T_RECORDS], tmeta[t, T_ROWS], RECORD_COLS // 2)
    dead = uint8_rows_at(tmeta[t, T_DEAD], tmeta[t, T_DEAD_ROWS], 1)
    rows = found[lo : lo + u]
    while True:
        c = fetch_add(progress, at + PR_CLAIMED, 1)
        if c >= n_chunks:
            return
        first = c * chunk
        stop = min(u, first + chunk)
        find_range(slots, keys, tmeta[t, T_ROW_BITS], unique[lo : lo + u], rows, first, stop)
        for i in range(first, stop):
            if rows[i] < 0 or (tmeta[t, T_DEAD] != 0 and dead[rows[i], 0] != 0):
                fetch_add(progress, at + PR_MISSING, 1)
                break
        # Atomic adds order the chunks' writes of ``found`` before the last one's reads.
        if fetch_add(progress, at + PR_DONE, 1) + 1 < n_chunks:
            continue
        missing = fetch_add(progress, at + PR_MISSING, 0) != 0
        status = PROBED_SOME_MISSING if missing else PROBED_ALL_FOUND
        # Published after ``found`` (an atomic add: a barrier for the compiler and the CPU),
        # for the pooling tasks that read it (prepare_and_pool).
        fetch_add(ready, t, status)
        if status == PROBED_ALL_FOUND and tmeta[t, T_TOUCH] != 0:
            records = int32_rows_at(tmeta[t, T_RECORDS], tmeta[t, T_ROWS], RECORD_COLS)
            touch(rows, unique_offsets[lo + t : lo + t + u + 1], tmeta[t, T_STEP], records)
        return


def _make_prepare_and_pool(keyed: bool, half: bool):
    """``prepare_and_pool`` for batches without keyed tables probed in the region, or with
    (``keyed``, a constant of the closure: numba prunes the branches on it before typing, so
    an engine without keyed tables never compiles their probing and pooling). A keyed task
    pools through ``lookup.pool_range`` with the types the dense features' tasks give it (its
    rows read-only, ``_keyed_task_args``), so it compiles no width's pooling again. ``half``
    (a constant the same way): the batch has features of 16-bit tables pooled here
    (``fdata[f, FD_KIND]``, ``_pool_task_half``), so an engine without them never compiles
    the pooling of uint16 rows."""

    @kernel(parallel=True)
    def prepare_and_pool(
        prep_order,
        n_workers,
        fmeta,
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
        found,
        ready,
        tmeta,
        fdata,
        quant,
        prefetch,
        probe_chunk,
    ):
        n_prep = prep_order.shape[0]
        tasks = pool_tasks(fmeta, fdata)
        n_tasks = n_prep + tasks.shape[0]
        counter = np.zeros(1, dtype=np.int64)
        progress = np.zeros(PR_COLS * tmeta.shape[0], dtype=np.int64)
        for _ in nb.prange(n_workers):
            while True:
                i = fetch_add(counter, 0, 1)
                if i >= n_tasks:
                    break
                if i < n_prep:
                    t = prep_order[i]
                    _prepare_table(
                        t,
                        fmeta,
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
                    if keyed and tmeta[t, T_INDEX] != 0:
                        # Its probe's chunks, published after the preparation (an atomic
                        # add), then probed until the threads have claimed them all.
                        n_chunks = max(1, (n_unique[t] + probe_chunk - 1) // probe_chunk)
                        fetch_add(progress, PR_COLS * t + PR_CHUNKS, n_chunks + 1)
                        _probe_chunks(
                            t,
                            tmeta,
                            occ_base,
                            unique,
                            n_unique,
                            unique_offsets,
                            found,
                            ready,
                            progress,
                            probe_chunk,
                        )
                    continue
                k = i - n_prep
                f, first, stop = tasks[k, 0], tasks[k, 1], tasks[k, 2]
                if keyed and fdata[f, FD_INDEX] != 0:
                    # A keyed table's samples: through the rows its probe found if it is
                    # done; if not, first the probe's unclaimed chunks (if its preparation is
                    # done), then by probing the samples' keys here if the probe is still not
                    # done (a thread with nothing else to do; right if the probe then finds
                    # every key, as it then must); left to pool_tables after the region if a
                    # key had no row.
                    t = fmeta[f, F_TABLE]
                    status = fetch_add(ready, t, 0)
                    if status == 0:
                        _probe_chunks(
                            t,
                            tmeta,
                            occ_base,
                            unique,
                            n_unique,
                            unique_offsets,
                            found,
                            ready,
                            progress,
                            probe_chunk,
                        )
                        status = fetch_add(ready, t, 0)
                    if status == PROBED_SOME_MISSING:
                        continue
                    if status == PROBED_ALL_FOUND:
                        rows = _found_rows(
                            f,
                            first,
                            stop,
                            fmeta,
                            offsets,
                            occ_base,
                            out_base,
                            n_unique,
                            found,
                            inverse,
                            output_offsets,
                        )
                    else:
                        rows = _probed_rows(f, first, stop, fmeta, offsets, fdata)
                    a = _keyed_task_args(
                        f,
                        first,
                        stop,
                        rows,
                        fmeta,
                        offsets,
                        weights,
                        tmeta,
                        fdata,
                        quant,
                        prefetch,
                    )
                    pool_range(*a)
                    continue
                if half and fdata[f, FD_KIND] != F32:
                    _pool_task_half(
                        f, first, stop, fmeta, offsets, weights, tmeta, fdata, quant, prefetch
                    )
                    continue
                _pool_task(f, first, stop, fmeta, offsets, weights, tmeta, fdata, quant, prefetch)

    return prepare_and_pool


_PREPARE_AND_POOL = {
    (keyed, half): _make_prepare_and_pool(keyed, half)
    for keyed in (False, True)
    for half in (False, True)
}


def prepare_and_pool(*args, keyed: bool = False, half: bool = False) -> None:
    """``prepare.prepare_tables`` (tables in ``prep_order``, largest first) and the pooling of
    every feature with an address in ``fdata`` into its table's activation matrix (``tmeta``;
    ``quant[t]`` as in ``lookup.pool``), by ``n_workers`` workers claiming tasks from one
    counter: first the preparations, then the pooling tasks. The outputs are those of the two
    kernels run one after the other. ``args``: the kernel's (``_make_prepare_and_pool``),
    ``prep_order, n_workers, fmeta``, the inputs and outputs of ``prepare_tables``, then
    ``found, ready, tmeta, fdata, quant, prefetch, probe_chunk``.

    ``keyed``: the batch has keyed tables probed here (``tmeta[t, T_INDEX]``, their features'
    ``fdata`` from FD_INDEX on). A keyed table's unique keys are probed right after its
    preparation, in chunks of ``probe_chunk`` keys, by the thread that prepared it and any
    thread that meets one of its pooling tasks meanwhile; its rows are touched if every key had
    one (``found``, ``ready[t]``: ``_probe_chunks``, published atomically). A task pooling its
    samples pools them through the rows the probe found if that is done (``_found_rows``); if
    it is not, the thread helps with the probe's unclaimed chunks, and if the probe is still not
    done, probes the task's keys itself (``_probed_rows``, as an evaluation lookup does),
    rather than wait: with one big keyed table, one thread prepares it while the other pools
    (docs/performance.md). Both give the sums ``pool_tables`` gives
    through the resolved rows when the probe found a live row for every key
    (PROBED_ALL_FOUND); a table for which it did not is pooled after the region, once its
    storage resolved its rows. No thread waits for another: waiting threads spun on cores an
    oversubscribed host needed (up to 3x slower at 8 threads on 2 cores, docs/design.md).

    ``half``: the batch has features of tables of 16-bit weights pooled here from their
    uint16 rows (``fdata[f, FD_KIND]``: ``_pool_task_half``); pooled after the region, one big
    such table was deduplicated by one thread while the other had nothing to pool
    (docs/performance.md, "What is still slow")."""
    _PREPARE_AND_POOL[bool(keyed), bool(half)](*args)


@kernel()
def _table_tasks(pmeta):
    """``pool_tables``' tasks: rows ``(table, first output row, stop)``, ROWS_PER_TASK each."""
    n = 0
    for t in range(pmeta.shape[0]):
        n += (pmeta[t, P_N_OUT] + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    tasks = np.empty((n, 3), dtype=np.int64)
    i = 0
    for t in range(pmeta.shape[0]):
        for first in range(0, pmeta[t, P_N_OUT], ROWS_PER_TASK):
            tasks[i, 0] = t
            tasks[i, 1] = first
            tasks[i, 2] = min(first + ROWS_PER_TASK, pmeta[t, P_N_OUT])
            i += 1
    return tasks


def _make_pool_tables(fixed_dim: int, kind: int):
    """``pool_tables`` for tables of width ``fixed_dim`` (a compile-time constant: the sum in
    registers, as ``lookup.pool_kernel`` gives one table), or of any width for 0, whose rows
    are float32 (``kind`` F32) or 16-bit weights of ``kind``, widened as they are read. One
    kernel per width and kind, compiled on first use: a kernel dispatching over every width
    compiled all nine in each process that pooled a keyed or 16-bit table (the fresh clone's
    tests: minutes). ``fixed_dim`` and ``kind`` are constants of the closure, so numba prunes
    the branches on them before typing: each kernel types one scratch row and one row array."""

    @kernel(parallel=True)
    def pool_tables(n_workers, pmeta, rows, inverse, gains, output_offsets, quant, prefetch):
        tasks = _table_tasks(pmeta)
        counter = np.zeros(1, dtype=np.int64)
        for _ in nb.prange(n_workers):
            while True:
                i = fetch_add(counter, 0, 1)
                if i >= tasks.shape[0]:
                    break
                t = tasks[i, 0]
                if fixed_dim:
                    dim = fixed_dim
                    acc = stack_row(fixed_dim)
                else:
                    dim = pmeta[t, P_DIM]
                    acc = np.empty(dim, dtype=np.float32)
                address, n_rows, width = pmeta[t, P_DATA], pmeta[t, P_ROWS], pmeta[t, P_WIDTH]
                if kind == F32:
                    data = float32_rows_at(address, n_rows, width)
                else:
                    data = uint16_rows_at(address, n_rows, width)
                # lookup._pool_rows on the table's slices of the shared arrays
                occ = pmeta[t, P_OCC_BASE]
                _pool_rows(
                    data,
                    dim,
                    rows[pmeta[t, P_ROW_BASE] :],
                    inverse[occ:],
                    gains[occ:],
                    output_offsets[pmeta[t, P_OFF_BASE] :],
                    float32_rows_at(pmeta[t, P_OUT], pmeta[t, P_N_OUT], pmeta[t, P_DIM]),
                    quant[t],
                    prefetch,
                    tasks[i, 1],
                    tasks[i, 2],
                    acc,
                    kind,
                )

    return pool_tables


_POOL_TABLES = {
    (d, kind): _make_pool_tables(d, kind) for d in (*FIXED_DIMS, 0) for kind in (F32, F16, BF16)
}


def pool_tables(n_workers, pmeta, rows, inverse, gains, output_offsets, quant, prefetch):
    """Every table of ``pmeta`` pooled through its prepared batch, by ``n_workers`` workers
    claiming tasks of ROWS_PER_TASK activation rows from one counter: for table ``t`` (a
    ``pmeta`` row), ``lookup.pool`` of its rows ``rows[P_ROW_BASE:]``, occurrences
    ``inverse[P_OCC_BASE:]`` / ``gains[P_OCC_BASE:]``, CSR ``output_offsets[P_OFF_BASE:]``
    and ``quant[t]``: one parallel region per row width among the tables (one kernel each,
    ``_make_pool_tables``), where a region per table waited for the threads each time. For
    the tables a training lookup pools after the storage resolved their rows."""
    groups = pmeta[:, [P_DIM, P_KIND]]
    for d, kind in np.unique(groups, axis=0):
        kernel = _POOL_TABLES.get((int(d), int(kind)), _POOL_TABLES[0, int(kind)])
        at = np.flatnonzero((groups[:, 0] == d) & (groups[:, 1] == kind))
        kernel(
            n_workers,
            np.ascontiguousarray(pmeta[at]),
            rows,
            inverse,
            gains,
            output_offsets,
            np.ascontiguousarray(quant[at]),
            prefetch,
        )
