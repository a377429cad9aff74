"""An open-addressing hash index from int64 keys to int64 values (a keyed table's rows).

Two parallel arrays of one power-of-two capacity: ``keys`` and ``values``; a slot whose value is
``EMPTY`` (-1) is free, so every int64 is a valid key. A key's home slot is the top bits of
splitmix64(key) masked to the capacity; collisions probe linearly. Deletion shifts the later
members of the probe run back (no tombstones), so a lookup never walks more than the run it
belongs to and the layout after any sequence of inserts and deletes depends only on that
sequence.

``find`` is read-only and parallel (each key is probed by one thread, its result written to its
own place; ``find_serial`` for the usual batch); ``insert``, ``remove`` and ``rehash`` are
serial: one writer per table, so the same calls give the same arrays at any thread count. The
index is probed once per table per step, on the batch's unique keys, never inside pooling.
``insert_rows`` inserts a batch's new keys and writes their rows' metadata in one pass. This
file calls nothing from another file (numba's cache watches only the file of a kernel).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from . import kernel

# Integer code only: exact, no fastmath flags needed; Python's error model as numba's default.
_OPTIONS = dict(fastmath=False, error_model="python")

EMPTY = -1

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
def _probe(tkeys, tvals, key, mask):
    """The slot holding ``key``, or -1."""
    s = _home(key, mask)
    while True:
        if tvals[s] == EMPTY:
            return -1
        if tkeys[s] == key:
            return s
        s = (s + 1) & mask


@kernel(parallel=True, **_OPTIONS)
def find(tkeys, tvals, keys, out):
    """``out[i]`` = the value of ``keys[i]``, or EMPTY if absent."""
    mask = tkeys.shape[0] - 1
    for i in nb.prange(keys.shape[0]):
        s = _probe(tkeys, tvals, keys[i], mask)
        out[i] = EMPTY if s < 0 else tvals[s]


@kernel(**_OPTIONS)
def find_serial(tkeys, tvals, keys, out):
    """``find`` on the calling thread: a batch's unique keys take microseconds, less than
    waking the other threads for a parallel region."""
    mask = tkeys.shape[0] - 1
    for i in range(keys.shape[0]):
        s = _probe(tkeys, tvals, keys[i], mask)
        out[i] = EMPTY if s < 0 else tvals[s]


@kernel(**_OPTIONS)
def insert(tkeys, tvals, keys, vals):
    """Set ``keys[i] -> vals[i]`` in order (a present key's value is replaced). The caller keeps
    the load below one (``KeyIndex`` grows it first)."""
    mask = tkeys.shape[0] - 1
    for i in range(keys.shape[0]):
        key = keys[i]
        s = _home(key, mask)
        while tvals[s] != EMPTY and tkeys[s] != key:
            s = (s + 1) & mask
        tkeys[s] = key
        tvals[s] = vals[i]


@kernel(**_OPTIONS)
def remove(tkeys, tvals, keys):
    """Delete ``keys`` (absent ones are skipped), shifting each probe run back over the hole:
    a member moves into the hole unless its home lies cyclically in (hole, its slot] (Knuth's
    algorithm R)."""
    mask = tkeys.shape[0] - 1
    removed = 0
    for i in range(keys.shape[0]):
        hole = _probe(tkeys, tvals, keys[i], mask)
        if hole < 0:
            continue
        removed += 1
        s = hole
        while True:
            s = (s + 1) & mask
            if tvals[s] == EMPTY:
                break
            home = _home(tkeys[s], mask)
            # Its distance from home against the hole's distance behind it, around the ring.
            if ((s - home) & mask) >= ((s - hole) & mask):
                tkeys[hole] = tkeys[s]
                tvals[hole] = tvals[s]
                hole = s
        tvals[hole] = EMPTY
    return removed


@kernel(**_OPTIONS)
def rehash(tkeys, tvals, new_keys, new_vals):
    """Insert every entry of the old arrays into the new (empty) ones, in slot order."""
    mask = new_keys.shape[0] - 1
    for s in range(tkeys.shape[0]):
        if tvals[s] == EMPTY:
            continue
        key = tkeys[s]
        t = _home(key, mask)
        while new_vals[t] != EMPTY:
            t = (t + 1) & mask
        new_keys[t] = key
        new_vals[t] = tvals[s]


@kernel(**_OPTIONS)
def insert_rows(tkeys, tvals, keys, counts, free, high, step, key_of, last, touches, live, rows):
    """Give each of ``keys`` (distinct, absent from the index) a row, in order: the smallest
    unused of ``free`` (sorted), then ``high``, ``high + 1``, ...; record the row's key, step
    and touch count, mark it live and index the key. One pass, so each new key costs one
    probe of the index and one write of its metadata. Returns how many free rows were used.
    The caller sized the index (load below one) and the metadata arrays."""
    mask = tkeys.shape[0] - 1
    used = 0
    for i in range(keys.shape[0]):
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
        while tvals[s] != EMPTY:
            s = (s + 1) & mask
        tkeys[s] = key
        tvals[s] = r
    return used
