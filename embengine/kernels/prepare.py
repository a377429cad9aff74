"""Build every table's deduplication data in one parallel pass (one thread per table).

Per table: expand the features' samples into occurrences (row id, gain, activation row), dedup the
row ids with an open-addressing hash table (O(n), no sort, no vocabulary-sized scratch, so the
cost does not depend on the vocabulary), and build the two CSR views the lookup and update
kernels use. Results are identical to ``batch.build_tables_numpy``: unique rows in order of first
appearance, stable occurrence order, gains computed in float64 and rounded to float32.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from . import NUMBA_OPTIONS
from ._intrinsics import prefetch_line

COMBINER_CODES = {"sum": 0, "mean": 1, "sqrtn": 2}

# Columns of the per-feature metadata array.
F_TABLE, F_ID_BASE, F_OFF_BASE, F_SAMPLES, F_W_BASE, F_COMBINER, F_SEQ, F_OUT_START = range(8)
F_ID_OFFSET = 8  # added to the feature's ids (its table's first row in packed storage)
F_COLS = 9

_HASH_MUL = np.uint64(0x9E3779B97F4A7C15)
# Occurrences ahead whose hash slot is prefetched during dedup.
HASH_PREFETCH = 8


@nb.njit(**NUMBA_OPTIONS)
def _fill_occurrences(fmeta, f, ids, offsets, weights, occ_ids, gains, segments, cursor):
    """Append feature f's occurrences at ``cursor``; return the new cursor."""
    id_base = fmeta[f, F_ID_BASE]
    off_base = fmeta[f, F_OFF_BASE]
    w_base = fmeta[f, F_W_BASE]
    combiner = fmeta[f, F_COMBINER]
    seq = fmeta[f, F_SEQ]
    out_start = fmeta[f, F_OUT_START]
    id_offset = fmeta[f, F_ID_OFFSET]
    for b in range(fmeta[f, F_SAMPLES]):
        start = offsets[off_base + b]
        stop = offsets[off_base + b + 1]
        if seq > 0:
            for k in range(start, min(stop, start + seq)):
                occ_ids[cursor] = ids[id_base + k] + id_offset
                gains[cursor] = 1.0
                segments[cursor] = out_start + b * seq + (k - start)
                cursor += 1
            continue
        denom = 1.0
        if combiner != 0:
            total = 0.0
            for k in range(start, stop):
                w = 1.0 if w_base < 0 else np.float64(weights[w_base + k])
                total += w if combiner == 1 else w * w
            denom = total if combiner == 1 else np.sqrt(total)
        for k in range(start, stop):
            w = 1.0 if w_base < 0 else np.float64(weights[w_base + k])
            occ_ids[cursor] = ids[id_base + k] + id_offset
            if combiner == 0:
                gains[cursor] = w
            elif denom != 0.0:
                gains[cursor] = w / denom
            else:
                gains[cursor] = 0.0
            segments[cursor] = out_start + b
            cursor += 1
    return cursor


@nb.njit(**NUMBA_OPTIONS)
def _dedup(occ_ids, unique, inverse):
    """Hash dedup in order of first appearance; returns the number of unique ids.

    Open addressing with linear probing; each slot holds (id, index) side by side so a probe
    reads one cache line, and the slot of the id ``HASH_PREFETCH`` ahead is prefetched (the
    table, a few MB, lives in L2 / L3). At most n keys in more than 1.25 n slots."""
    n = occ_ids.shape[0]
    bits = 4
    while (1 << bits) < n + n // 4 + 1:
        bits += 1
    mask = (1 << bits) - 1
    slots = np.full(2 << bits, -1, dtype=np.int64)
    pairs = slots.reshape(1 << bits, 2)  # the same memory as rows, for the line prefetch
    shift = np.uint64(64 - bits)
    n_unique = 0
    for k in range(n):
        if k + HASH_PREFETCH < n:
            ahead = np.int64((np.uint64(occ_ids[k + HASH_PREFETCH]) * _HASH_MUL) >> shift)
            prefetch_line(pairs, ahead, 0)
        key = occ_ids[k]
        h = np.int64((np.uint64(key) * _HASH_MUL) >> shift)
        while True:
            slot_key = slots[2 * h]
            if slot_key == key:
                inverse[k] = slots[2 * h + 1]
                break
            if slot_key == -1:
                slots[2 * h] = key
                slots[2 * h + 1] = n_unique
                unique[n_unique] = key
                inverse[k] = n_unique
                n_unique += 1
                break
            h = (h + 1) & mask
    return n_unique


@nb.njit(**NUMBA_OPTIONS)
def _offsets(keys, n, offsets):
    """offsets[i] = number of keys < i, for i in 0..n (keys in [0, n))."""
    offsets[: n + 1] = 0
    for k in range(keys.shape[0]):
        offsets[keys[k] + 1] += 1
    for i in range(n):
        offsets[i + 1] += offsets[i]


@nb.njit(**NUMBA_OPTIONS)
def _csr(keys, n, offsets, order):
    """Stable counting sort of positions by key (see batch.csr)."""
    _offsets(keys, n, offsets)
    fill = offsets[:n].copy()
    for k in range(keys.shape[0]):
        order[fill[keys[k]]] = k
        fill[keys[k]] += 1


@nb.njit(parallel=True, **NUMBA_OPTIONS)
def prepare_tables(
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
    deduplicate,
):
    """All tables at once. Table t owns occurrence slots ``occ_base[t]:occ_base[t + 1]``,
    CSR-offset slots ``occ_base[t] + t : ... + U_t + 1`` and ``out_base[t] + t : ...``.

    Without ``deduplicate`` (lookup-only batches) only the occurrences and ``output_offsets``
    are built, and ``inverse`` is the identity: the lookup then reads ``occ_ids`` directly."""
    n_tables = occ_base.shape[0] - 1
    for t in nb.prange(n_tables):
        lo = occ_base[t]
        hi = occ_base[t + 1]
        cursor = lo
        for f in range(fmeta.shape[0]):
            if fmeta[f, F_TABLE] == t:
                cursor = _fill_occurrences(
                    fmeta, f, ids, offsets, weights, occ_ids, gains, segments, cursor
                )
        n_out = out_base[t + 1] - out_base[t]
        # Segments are non-decreasing, so occurrences are already grouped by activation row.
        _offsets(segments[lo:hi], n_out, output_offsets[out_base[t] + t : out_base[t + 1] + t + 1])
        if not deduplicate:
            for k in range(hi - lo):
                inverse[lo + k] = k
            n_unique[t] = hi - lo
            continue
        u = _dedup(occ_ids[lo:hi], unique[lo:hi], inverse[lo:hi])
        n_unique[t] = u
        by_unique = np.empty(hi - lo, dtype=np.int64)
        _csr(inverse[lo:hi], u, unique_offsets[lo + t : hi + t + 1], by_unique)
        for p in range(hi - lo):  # copied in row order, so the update streams through them
            unique_gains[lo + p] = gains[lo + by_unique[p]]
            unique_segments[lo + p] = segments[lo + by_unique[p]]
