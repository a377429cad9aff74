"""An open-addressing hash index from int64 keys to int64 values (a keyed table's rows).

One array of one power-of-two capacity, ``slots[s] = (key, value)``: a probe reads one 16-byte
slot, one cache line, where separate key and value arrays cost two misses. A slot whose value
is ``EMPTY`` (-1) is free, so every int64 is a valid key. A key's home slot is the top bits of
splitmix64(key) masked to the capacity; collisions probe linearly. Deletion shifts the later
members of the probe run back (no tombstones), so a lookup never walks more than the run it
belongs to and the layout after any sequence of inserts and deletes depends only on that
sequence.

``find`` is read-only and parallel (each key is probed by one thread, its result written to its
own place; ``find_serial`` for the usual batch); both prefetch the home slot of the key
``PROBE_AHEAD`` places ahead, so the index's cache misses overlap instead of queueing.
``insert``, ``remove`` and ``rehash`` are serial: one writer per table, so the same calls give
the same array at any thread count. The index is probed once per table per step, on the batch's
unique keys, never inside pooling. ``insert_rows`` inserts a batch's new keys and writes their
rows' metadata in one pass.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from . import kernel
from ._intrinsics import prefetch_line

# Integer code only: exact, no fastmath flags needed; Python's error model as numba's default.
_OPTIONS = dict(fastmath=False, error_model="python")

EMPTY = -1
# Columns of the slot array.
KEY, VALUE = 0, 1
# Keys ahead whose home slot a probe loop prefetches (a miss costs ~100 ns here, a probe of a
# cached slot a few; docs/performance.md, "Keyed tables").
PROBE_AHEAD = 16

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@kernel(inline="always", **_OPTIONS)
def _home(key, mask):
    """The key's first slot: splitmix64 of its bits, masked (capacity is a power of two)."""
    z = np.uint64(key) + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    z = z ^ (z >> np.uint64(31))
    return np.int64(z & np.uint64(mask))


@kernel(inline="always", **_OPTIONS)
def _probe(slots, key, mask):
    """The slot holding ``key``, or -1."""
    s = _home(key, mask)
    while True:
        if slots[s, VALUE] == EMPTY:
            return -1
        if slots[s, KEY] == key:
            return s
        s = (s + 1) & mask


@kernel(inline="always", **_OPTIONS)
def find_range(slots, keys, out, lo, hi):
    """``out[i]`` for ``i`` in ``lo:hi``, the home slot of key ``i + PROBE_AHEAD`` prefetched."""
    mask = slots.shape[0] - 1
    for i in range(lo, hi):
        if i + PROBE_AHEAD < hi:
            prefetch_line(slots, _home(keys[i + PROBE_AHEAD], mask), 0)
        s = _probe(slots, keys[i], mask)
        out[i] = EMPTY if s < 0 else slots[s, VALUE]


# Keys per task of the parallel find.
_FIND_TASK = 4096


@kernel(parallel=True, **_OPTIONS)
def find(slots, keys, out):
    """``out[i]`` = the value of ``keys[i]``, or EMPTY if absent."""
    n = keys.shape[0]
    for t in nb.prange((n + _FIND_TASK - 1) // _FIND_TASK):
        find_range(slots, keys, out, t * _FIND_TASK, min(n, (t + 1) * _FIND_TASK))


@kernel(**_OPTIONS)
def find_serial(slots, keys, out):
    """``find`` on the calling thread: a batch's unique keys take microseconds, less than
    waking the other threads for a parallel region."""
    find_range(slots, keys, out, 0, keys.shape[0])


@kernel(**_OPTIONS)
def insert(slots, keys, vals):
    """Set ``keys[i] -> vals[i]`` in order (a present key's value is replaced). The caller keeps
    the load below one (``KeyIndex`` grows it first)."""
    mask = slots.shape[0] - 1
    for i in range(keys.shape[0]):
        key = keys[i]
        s = _home(key, mask)
        while slots[s, VALUE] != EMPTY and slots[s, KEY] != key:
            s = (s + 1) & mask
        slots[s, KEY] = key
        slots[s, VALUE] = vals[i]


@kernel(**_OPTIONS)
def remove(slots, keys):
    """Delete ``keys`` (absent ones are skipped), shifting each probe run back over the hole:
    a member moves into the hole unless its home lies cyclically in (hole, its slot] (Knuth's
    algorithm R)."""
    mask = slots.shape[0] - 1
    removed = 0
    n = keys.shape[0]
    for i in range(n):
        if i + PROBE_AHEAD < n:  # a read hint: later removals may shift that run first
            prefetch_line(slots, _home(keys[i + PROBE_AHEAD], mask), 0)
        hole = _probe(slots, keys[i], mask)
        if hole < 0:
            continue
        removed += 1
        s = hole
        while True:
            s = (s + 1) & mask
            if slots[s, VALUE] == EMPTY:
                break
            home = _home(slots[s, KEY], mask)
            # Its distance from home against the hole's distance behind it, around the ring.
            if ((s - home) & mask) >= ((s - hole) & mask):
                slots[hole, KEY] = slots[s, KEY]
                slots[hole, VALUE] = slots[s, VALUE]
                hole = s
        slots[hole, VALUE] = EMPTY
    return removed


@kernel(**_OPTIONS)
def rehash(slots, new_slots):
    """Insert every entry of the old array into the new (empty) one, in slot order."""
    mask = new_slots.shape[0] - 1
    for s in range(slots.shape[0]):
        if slots[s, VALUE] == EMPTY:
            continue
        key = slots[s, KEY]
        t = _home(key, mask)
        while new_slots[t, VALUE] != EMPTY:
            t = (t + 1) & mask
        new_slots[t, KEY] = key
        new_slots[t, VALUE] = slots[s, VALUE]


@kernel(**_OPTIONS)
def insert_rows(slots, keys, counts, free, high, step, key_of, last, touches, live, rows):
    """Give each of ``keys`` (distinct, absent from the index) a row, in order: the smallest
    unused of ``free`` (sorted), then ``high``, ``high + 1``, ...; record the row's key, step
    and touch count, mark it live and index the key. One pass, so each new key costs one
    probe of the index and one write of its metadata. Returns how many free rows were used.
    The caller sized the index (load below one) and the metadata arrays."""
    mask = slots.shape[0] - 1
    used = 0
    n = keys.shape[0]
    for i in range(n):
        if i + PROBE_AHEAD < n:
            prefetch_line(slots, _home(keys[i + PROBE_AHEAD], mask), 0)
        if used < free.shape[0]:
            r = free[used]
            used += 1
        else:
            r = high
            high += 1
        rows[i] = r
        key = keys[i]
        key_of[r] = key
        last[r] = step
        touches[r] = counts[i]
        live[r] = True
        s = _home(key, mask)
        while slots[s, VALUE] != EMPTY:
            s = (s + 1) & mask
        slots[s, KEY] = key
        slots[s, VALUE] = r
    return used


@kernel(**_OPTIONS)
def touch(rows, offsets, step, last, touches):
    """``last[r, 0] = step`` and ``touches[r, 0] += offsets[i + 1] - offsets[i]`` for each
    ``r = rows[i]`` (distinct; ``offsets``: a CSR of the rows' occurrences, whose counts are
    added), the rows ``PROBE_AHEAD`` places ahead prefetched: a batch's rows lie anywhere in
    the metadata arrays (``[rows, 1]`` views of a keyed table's)."""
    n = rows.shape[0]
    for i in range(n):
        if i + PROBE_AHEAD < n:
            r = rows[i + PROBE_AHEAD]
            prefetch_line(last, r, 0)
            prefetch_line(touches, r, 0)
        r = rows[i]
        last[r, 0] = step
        touches[r, 0] += offsets[i + 1] - offsets[i]
