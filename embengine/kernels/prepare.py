"""Build every table's deduplication data in one parallel pass (tables dealt to the threads).

Per table: expand the features' samples into occurrences (id, gain, activation row), dedup the
ids of each logical table with an open-addressing hash table (O(n), no sort, no
vocabulary-sized scratch, so the cost does not depend on the vocabulary), and build the two CSR
views the lookup and update kernels use. Results are identical to ``batch.build_tables_numpy``:
unique ids in order of first appearance, logical table after logical table, stable occurrence
order, gains computed in float64 and rounded to float32. Ids stay ids here: which row holds an
id is the storage's business (``storage.protocol``), resolved after this pass.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from . import kernel
from ._intrinsics import prefetch_line, readonly_int64_at

COMBINER_CODES = {"sum": 0, "mean": 1, "sqrtn": 2}
SUM, MEAN, SQRTN = COMBINER_CODES["sum"], COMBINER_CODES["mean"], COMBINER_CODES["sqrtn"]

# Columns of the per-feature metadata array. F_IDS: the address of the feature's ids (int64,
# contiguous; the caller holds them for the call), read where they are: concatenated, every
# step copied every id once more (docs/performance.md). Offsets and weights are concatenated.
F_TABLE, F_IDS, F_OFF_BASE, F_SAMPLES, F_W_BASE, F_COMBINER, F_SEQ, F_OUT_START = range(8)
F_MEMBER = 8  # the feature's logical table within its physical table (its dedup region)
F_COLS = 9

_HASH_MUL = np.uint64(0x9E3779B97F4A7C15)
# Occurrences ahead whose hash slot is prefetched during dedup.
HASH_PREFETCH = 8


@kernel(inline="always")
def bag_denominator(weights, w_base, start, stop, combiner):
    """A bag's combiner denominator, in float64: 1 (SUM), sum of w (MEAN), sqrt of the sum of
    w^2 (SQRTN), with w = ``weights[w_base + k]`` for k in ``start:stop`` (1 if w_base < 0).
    Shared by the preparation and lookup-only pooling, so both give the same gains."""
    if combiner == SUM:
        return 1.0
    total = 0.0
    for k in range(start, stop):
        w = 1.0 if w_base < 0 else np.float64(weights[w_base + k])
        total += w if combiner == MEAN else w * w
    return total if combiner == MEAN else np.sqrt(total)


@kernel(inline="always")
def bag_gain(w, combiner, denom):
    """An id's gain in float64 (stored as float32, as batch.combiner_gains): its weight w for
    SUM, w / denom for MEAN and SQRTN, 0 if denom is 0."""
    if combiner == SUM:
        return w
    if denom != 0.0:
        return w / denom
    return 0.0


@kernel()
def feature_ids(f, fmeta, n_ids):
    """Feature ``f``'s ``n_ids`` ids, read-only, at their address (``fmeta[f, F_IDS]``)."""
    return readonly_int64_at(fmeta[f, F_IDS], n_ids)


@kernel()
def _fill_occurrences(fmeta, f, offsets, weights, occ_ids, gains, segments, cursor):
    """Append feature f's occurrences at ``cursor``; return the new cursor."""
    off_base = fmeta[f, F_OFF_BASE]
    w_base = fmeta[f, F_W_BASE]
    combiner = fmeta[f, F_COMBINER]
    seq = fmeta[f, F_SEQ]
    out_start = fmeta[f, F_OUT_START]
    ids = feature_ids(f, fmeta, offsets[off_base + fmeta[f, F_SAMPLES]])
    for b in range(fmeta[f, F_SAMPLES]):
        start = offsets[off_base + b]
        stop = offsets[off_base + b + 1]
        if seq > 0:
            for k in range(start, min(stop, start + seq)):
                occ_ids[cursor] = ids[k]
                gains[cursor] = 1.0
                segments[cursor] = out_start + b * seq + (k - start)
                cursor += 1
            continue
        denom = bag_denominator(weights, w_base, start, stop, combiner)
        for k in range(start, stop):
            w = 1.0 if w_base < 0 else np.float64(weights[w_base + k])
            occ_ids[cursor] = ids[k]
            gains[cursor] = bag_gain(w, combiner, denom)
            segments[cursor] = out_start + b
            cursor += 1
    return cursor


@kernel()
def _dedup(occ_ids, unique, inverse, run_bounds, run_regions, region_ends):
    """Hash dedup in order of first appearance; returns the number of unique ids.

    Occurrences come in runs (one per feature: ``run_bounds[i]:run_bounds[i + 1]``), each in
    a region (``run_regions[i]``): one logical table of a physical table (low-dimensional
    packing puts several in one). Each region gets its own hash table, sized to its
    occurrences, so equal ids of two regions stay apart, and a packed table probes tables as
    small as unpacked ones (one hash for all of them overflowed L2 and made packed
    deduplication slower: docs/performance.md, "Figures behind the code"). Numbering stays
    global; ``region_ends[r]`` is the number of unique ids after region r's last run (with
    each region's runs consecutive, its unique ids are the block up to there).

    Open addressing with linear probing; each slot holds (id, index) side by side so a probe
    reads one cache line, and the slot of the id ``HASH_PREFETCH`` ahead is prefetched. At most
    n keys in more than 1.25 n slots per region."""
    n_runs = run_regions.shape[0]
    n_regions = 0
    for i in range(n_runs):
        n_regions = max(n_regions, run_regions[i] + 1)
    counts = np.zeros(n_regions, dtype=np.int64)
    for i in range(n_runs):
        counts[run_regions[i]] += run_bounds[i + 1] - run_bounds[i]
    # When each region's runs are consecutive (one feature per table, the usual case), regions
    # take turns in one buffer sized for the largest: a fresh multi-MB array per packed table
    # cost page faults and cold cache lines.
    consecutive = True
    for i in range(1, n_runs):
        if run_regions[i] != run_regions[i - 1]:
            for j in range(i - 1):
                consecutive = consecutive and run_regions[j] != run_regions[i]
    bits = np.empty(n_regions, dtype=np.int64)
    base = np.zeros(n_regions, dtype=np.int64)  # each region's first slot
    size = 0  # slots in all
    for r in range(n_regions):
        b = 4
        while (1 << b) < counts[r] + counts[r] // 4 + 1:
            b += 1
        bits[r] = b
        if consecutive:
            size = max(size, 1 << b)
        else:
            base[r] = size
            size += 1 << b
    slots = np.full(2 * size, -1, dtype=np.int64)
    pairs = slots.reshape(size, 2)  # the same memory as rows, for the line prefetch
    n_unique = 0
    for i in range(n_runs):
        r = run_regions[i]
        first = base[r]
        mask = (1 << bits[r]) - 1
        if consecutive and i > 0 and r != run_regions[i - 1]:
            slots[: 2 << bits[r]] = -1  # the buffer's turn passes to the next region
        shift = np.uint64(64 - bits[r])
        stop = run_bounds[i + 1]
        for k in range(run_bounds[i], stop):
            if k + HASH_PREFETCH < stop:
                ahead = np.int64((np.uint64(occ_ids[k + HASH_PREFETCH]) * _HASH_MUL) >> shift)
                prefetch_line(pairs, first + ahead, 0)
            key = occ_ids[k]
            h = np.int64((np.uint64(key) * _HASH_MUL) >> shift)
            while True:
                slot = 2 * (first + h)
                slot_key = slots[slot]
                # A slot is free when its index is -1: a keyed table's key may be -1 itself.
                if slot_key == key and slots[slot + 1] != -1:
                    inverse[k] = slots[slot + 1]
                    break
                if slots[slot + 1] == -1:
                    slots[slot] = key
                    slots[slot + 1] = n_unique
                    unique[n_unique] = key
                    inverse[k] = n_unique
                    n_unique += 1
                    break
                h = (h + 1) & mask
        region_ends[r] = n_unique
    return n_unique


@kernel()
def _offsets(keys, n, offsets):
    """offsets[i] = number of keys < i, for i in 0..n (keys in [0, n))."""
    offsets[: n + 1] = 0
    for k in range(keys.shape[0]):
        offsets[keys[k] + 1] += 1
    for i in range(n):
        offsets[i + 1] += offsets[i]


@kernel()
def _csr(keys, n, offsets, order):
    """Stable counting sort of positions by key (see batch.csr)."""
    _offsets(keys, n, offsets)
    fill = offsets[:n].copy()
    for k in range(keys.shape[0]):
        order[fill[keys[k]]] = k
        fill[keys[k]] += 1


def deal_tables(sizes: np.ndarray, n_workers: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, bounds): worker ``w`` prepares tables ``order[bounds[w]:bounds[w + 1]]``.

    Largest first, each to the least loaded worker (LPT), so a few big tables (packed ones)
    do not land on one thread: prange's static split of the tables in their own order gave one
    thread several times the other's work on W2 packed (docs/performance.md, "Figures behind
    the code")."""
    loads = [0] * n_workers
    lists: list[list[int]] = [[] for _ in range(n_workers)]
    for t in np.argsort(-np.asarray(sizes), kind="stable"):
        w = loads.index(min(loads))
        lists[w].append(int(t))
        loads[w] += int(sizes[t])
    order = np.array([t for lst in lists for t in lst], dtype=np.int64)
    bounds = np.zeros(n_workers + 1, dtype=np.int64)
    bounds[1:] = np.cumsum([len(lst) for lst in lists])
    return order, bounds


@kernel(parallel=True)
def prepare_tables(
    order,
    bounds,
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
):
    """All tables at once, worker ``w`` those of ``order[bounds[w]:bounds[w + 1]]`` (see
    deal_tables). Table t owns occurrence slots ``occ_base[t]:occ_base[t + 1]``, CSR-offset
    slots ``occ_base[t] + t : ... + U_t + 1`` and ``out_base[t] + t : ...``, and its logical
    tables' unique-id bounds ``f_t + t : f_t + t + members + 1`` (``f_t``: its first feature)."""
    for worker in nb.prange(bounds.shape[0] - 1):
        for i_table in range(bounds[worker], bounds[worker + 1]):
            _prepare_table(
                order[i_table],
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


@kernel()
def prepare_tables_serial(
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
):
    """``prepare_tables`` in the calling thread, table by table: the same ``_prepare_table``
    writes the same slots, so the results are the same bit for bit. It opens no parallel
    region, so it can run where OpenMP cannot: in a process forked from one whose OpenMP pool
    was running (a DataLoader worker; see numba_backend.build_tables_numba)."""
    for t in range(occ_base.shape[0] - 1):
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


@kernel()
def _prepare_table(
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
):
    """Table t's share of prepare_tables."""
    lo = occ_base[t]
    hi = occ_base[t + 1]
    cursor = lo
    n_runs = 0
    first_feature = -1
    for f in range(fmeta.shape[0]):
        if fmeta[f, F_TABLE] == t:
            n_runs += 1
            if first_feature < 0:
                first_feature = f
    run_bounds = np.empty(n_runs + 1, dtype=np.int64)  # relative to lo
    run_regions = np.empty(n_runs, dtype=np.int64)
    run_bounds[0] = 0
    i = 0
    n_regions = 0
    for f in range(fmeta.shape[0]):
        if fmeta[f, F_TABLE] == t:
            cursor = _fill_occurrences(fmeta, f, offsets, weights, occ_ids, gains, segments, cursor)
            run_bounds[i + 1] = cursor - lo
            # A logical table's features are consecutive (batch.plan_tables): one region each.
            run_regions[i] = fmeta[f, F_MEMBER]
            n_regions = max(n_regions, run_regions[i] + 1)
            i += 1
    n_out = out_base[t + 1] - out_base[t]
    # Segments are non-decreasing, so occurrences are already grouped by activation row.
    _offsets(segments[lo:hi], n_out, output_offsets[out_base[t] + t : out_base[t + 1] + t + 1])
    region_ends = np.zeros(n_regions, dtype=np.int64)
    u = _dedup(occ_ids[lo:hi], unique[lo:hi], inverse[lo:hi], run_bounds, run_regions, region_ends)
    n_unique[t] = u
    if first_feature >= 0:
        b = first_feature + t
        unique_bounds[b] = 0
        for r in range(n_regions):
            unique_bounds[b + r + 1] = region_ends[r]
    by_unique = np.empty(hi - lo, dtype=np.int64)
    _csr(inverse[lo:hi], u, unique_offsets[lo + t : hi + t + 1], by_unique)
    for p in range(hi - lo):  # copied in row order, so the update streams through them
        unique_gains[lo + p] = gains[lo + by_unique[p]]
        unique_segments[lo + p] = segments[lo + by_unique[p]]
