"""An open-addressing hash index from int64 keys to int32 values (a keyed table's rows).

Two arrays: ``slots[s, 0]``, the entry in slot ``s`` of one power-of-two capacity (``EMPTY``,
-1, for a free slot), and ``keys[v, 0]``, the key value ``v`` holds. An entry is a value's
``bits`` low bits and, above them, the top ``31 - bits`` bits of its key's hash (a tag), so a
probe reads a record only where the tag matches: the one it looks for, and 2^-(31 - bits) of
the others. ``bits`` is the owner's (enough for its values, ``KeyIndex.row_bits``), passed to
every kernel. A keyed table's ``keys`` are its row records, 16 bytes a row: the key, then (as
int32 columns ``LAST`` and ``TOUCHES`` of the same memory) the step the row was last touched
and its touch count, so the line a probe reads to compare the key is the line the training
lookup's touch writes. A slot is 4 bytes: at the usual load of one half a key costs 8 bytes of
slots and 16 of record (docs/design.md, "A keyed table's key costs 24 bytes"; it was 57 with
16-byte ``(key, row)`` slots and int64 row metadata in four arrays). Every int64 is a valid
key. A key's home slot is splitmix64(key) masked to the capacity; collisions probe linearly,
each probe comparing the key its slot's value holds.

Deletion leaves a tombstone (``TOMB``), or frees the slot if the next one is free (and the
tombstones just before it with it): a backward shift would read the record of every later
member of the run to find its home, a random line each, where a tombstone costs the one slot
(docs/performance.md, "Keyed tables"). Probes pass tombstones without reading a record;
inserts reuse them; ``KeyIndex`` rebuilds the slots when keys and tombstones together pass its
load limit. The layout after any sequence of calls depends only on that sequence.

A probe that finds its key reads two lines, the slot and then the key of its value: the probe
loops prefetch the home slot of the key ``PROBE_AHEAD`` places ahead and, ``KEY_AHEAD`` places
ahead, the record of the first entry from the (by then cached) home slot whose tag matches, so
both misses overlap with earlier probes' instead of queueing behind them.

``find`` is read-only and parallel (each key is probed by one thread, its result written to its
own place; ``find_serial`` for the usual batch). ``insert``, ``remove_values`` and ``rehash``
are serial: one writer per table, so the same calls give the same arrays at any thread count.
A training lookup probes a table's unique keys once, after their deduplication; an evaluation
lookup probes each pooling task's keys before pooling them (``train_lookup``).
``find_or_insert`` finds or inserts a batch's keys and writes the new rows' records in one
pass.

Arrays are 2-D: slots ``[capacity, 1]``, keys ``[n, 1]`` or a table's records viewed as
``[rows, 2]`` int64, the shapes a kernel reaching them by address sees
(``_intrinsics.int32_rows_at``, ``int64_rows_at``), so each kernel compiles once.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from . import kernel
from ._intrinsics import prefetch_line

# Integer code only: exact, no fastmath flags needed; Python's error model as numba's default.
_OPTIONS = dict(fastmath=False, error_model="python")

EMPTY = -1
# A deleted slot: probes go on past it, inserts may take it.
TOMB = -2
# Keys ahead whose home slot a probe loop prefetches (a miss costs ~100 ns here, a probe of a
# cached slot a few; docs/performance.md, "Keyed tables"), and keys ahead whose home slot's
# record it prefetches (half-way: the slot has arrived by then).
PROBE_AHEAD = 16
KEY_AHEAD = 8
# Slots from home the record prefetch looks through for a matching tag.
KEY_SCAN = 8
# Values are int32: a keyed table holds at most this many rows (config.MAX_KEYED_ROWS).
MAX_VALUE = np.iinfo(np.int32).max
# An entry's bits below the sign: value bits plus tag bits.
ENTRY_BITS = 31
# Touch counts saturate here (int32 row metadata).
MAX_TOUCHES = np.iinfo(np.int32).max
# A row record as int32 columns: the key (two columns), last-touched step, touch count
# (storage/keyed.py keeps the same numbers).
RECORD_COLS, LAST, TOUCHES = 4, 2, 3

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@kernel(inline="always", **_OPTIONS)
def _hash(key):
    """splitmix64's finalizer of the key's bits (a bijection of uint64)."""
    z = np.uint64(key) + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


@kernel(inline="always", **_OPTIONS)
def _where(key, mask, bits):
    """(home slot, tag): the hash's low bits masked to the capacity (a power of two), and its
    top ``ENTRY_BITS - bits`` bits shifted above the value's ``bits``, as an entry holds them."""
    z = _hash(key)
    home = np.int64(z & np.uint64(mask))
    tag_bits = ENTRY_BITS - bits
    if tag_bits <= 0:
        return home, np.int64(0)
    return home, np.int64(z >> np.uint64(64 - tag_bits)) << bits


@kernel(inline="always", **_OPTIONS)
def _probe(slots, keys, key, mask, bits):
    """The slot holding ``key``, or -1."""
    s, tag = _where(key, mask, bits)
    low = (np.int64(1) << bits) - 1
    while True:
        e = np.int64(slots[s, 0])
        if e == EMPTY:
            return -1
        if e >= 0 and (e & ~low) == tag and keys[e & low, 0] == key:
            return s
        s = (s + 1) & mask


@kernel(inline="always", **_OPTIONS)
def find_range(slots, keys, bits, queries, out, lo, hi):
    """``out[i]`` for ``i`` in ``lo:hi``: the value holding ``queries[i]``, or EMPTY. The
    prefetches (module docstring) are written out in the loop: through an inlined function of
    their own a probe cost 6-9 ns more (34.8 against 25.9 ns a resident key)."""
    mask = slots.shape[0] - 1
    low = (np.int64(1) << bits) - 1
    for i in range(lo, hi):
        if i + PROBE_AHEAD < hi:
            prefetch_line(slots, _where(queries[i + PROBE_AHEAD], mask, bits)[0], 0)
        if i + KEY_AHEAD < hi:
            s, tag = _where(queries[i + KEY_AHEAD], mask, bits)
            for _ in range(KEY_SCAN):
                e = np.int64(slots[s, 0])
                if e == EMPTY:
                    break
                if e >= 0 and (e & ~low) == tag:
                    prefetch_line(keys, e & low, 0)
                    break
                s = (s + 1) & mask
        s = _probe(slots, keys, queries[i], mask, bits)
        out[i] = EMPTY if s < 0 else slots[s, 0] & low


# Keys per task of the parallel find.
_FIND_TASK = 4096


@kernel(parallel=True, **_OPTIONS)
def find(slots, keys, bits, queries, out):
    """``out[i]`` = the value of ``queries[i]``, or EMPTY if absent."""
    n = queries.shape[0]
    for t in nb.prange((n + _FIND_TASK - 1) // _FIND_TASK):
        find_range(slots, keys, bits, queries, out, t * _FIND_TASK, min(n, (t + 1) * _FIND_TASK))


@kernel(**_OPTIONS)
def find_serial(slots, keys, bits, queries, out):
    """``find`` on the calling thread: a batch's unique keys take microseconds, less than
    waking the other threads for a parallel region."""
    find_range(slots, keys, bits, queries, out, 0, queries.shape[0])


@kernel(inline="always", **_OPTIONS)
def _place(slots, entry, home, mask):
    """Put ``entry`` in the first free or deleted slot from ``home`` on (its key is absent);
    returns 1 if that slot was a tombstone, else 0."""
    s = home
    while slots[s, 0] >= 0:
        s = (s + 1) & mask
    reused = 1 if slots[s, 0] == TOMB else 0
    slots[s, 0] = entry
    return reused


@kernel(inline="always", **_OPTIONS)
def _place_value(slots, keys, v, mask, bits):
    """``_place`` value ``v`` (its key is ``keys[v, 0]``)."""
    home, tag = _where(keys[v, 0], mask, bits)
    return _place(slots, tag | v, home, mask)


@kernel(inline="always", **_OPTIONS)
def _unplace(slots, s, mask):
    """Delete slot ``s``'s entry: a tombstone, or, if the next slot is free, a free slot and
    the tombstones just before it freed too (no probe run passes them any more). Returns the
    change in the number of tombstones."""
    if slots[(s + 1) & mask, 0] != EMPTY:
        slots[s, 0] = TOMB
        return 1
    slots[s, 0] = EMPTY
    freed = 0
    t = (s - 1) & mask
    while slots[t, 0] == TOMB:
        slots[t, 0] = EMPTY
        freed += 1
        t = (t - 1) & mask
    return -freed


@kernel(**_OPTIONS)
def insert(slots, keys, bits, values):
    """Index ``values`` (whose keys, ``keys[v]``, the caller wrote and are absent), in order;
    returns how many tombstones they took. The caller keeps the load below one (``KeyIndex``
    grows it first)."""
    mask = slots.shape[0] - 1
    n = values.shape[0]
    reused = 0
    for i in range(n):
        if i + PROBE_AHEAD < n:
            prefetch_line(slots, _where(keys[values[i + PROBE_AHEAD], 0], mask, bits)[0], 0)
        reused += _place_value(slots, keys, values[i], mask, bits)
    return reused


@kernel(**_OPTIONS)
def remove_values(slots, keys, bits, values):
    """Unindex ``values`` (each indexed, distinct): the slot holding each is found by its
    entry from its key's home, so no other record is read (ascending values read their keys
    in order). Returns (the change in the number of tombstones, how many values were not
    indexed: a caller's error, skipped)."""
    mask = slots.shape[0] - 1
    tombs = 0
    missing = 0
    n = values.shape[0]
    for i in range(n):
        if i + PROBE_AHEAD < n:
            prefetch_line(slots, _where(keys[values[i + PROBE_AHEAD], 0], mask, bits)[0], 0)
        v = values[i]
        s, tag = _where(keys[v, 0], mask, bits)
        entry = tag | v
        while slots[s, 0] != entry and slots[s, 0] != EMPTY:
            s = (s + 1) & mask
        if slots[s, 0] == EMPTY:
            missing += 1
        else:
            tombs += _unplace(slots, s, mask)
    return tombs, missing


@kernel(**_OPTIONS)
def rehash(slots, keys, bits, new_slots, new_bits):
    """Index every value of the old slots in the new (free) ones, whose entries keep
    ``new_bits`` value bits, in ascending order of value: the values are marked in a byte
    array first, so their keys are read in order, not at random; the new home slot of the
    value ``PROBE_AHEAD`` places on is prefetched."""
    mask = new_slots.shape[0] - 1
    low = (np.int64(1) << bits) - 1
    n = keys.shape[0]
    present = np.zeros(n, dtype=np.uint8)
    for s in range(slots.shape[0]):
        e = np.int64(slots[s, 0])
        if e >= 0:
            present[e & low] = 1
    for v in range(n):
        ahead = v + PROBE_AHEAD
        if ahead < n and present[ahead]:
            prefetch_line(new_slots, _where(keys[ahead, 0], mask, new_bits)[0], 0)
        if present[v]:
            _place_value(new_slots, keys, v, mask, new_bits)


# find_or_insert's ring of the hashes of the keys ahead (a power of two > PROBE_AHEAD).
_RING = 32
_RING_MASK = _RING - 1


@kernel(**_OPTIONS)
def find_or_insert(
    slots, keys, bits, queries, counts, free, high, cap, step, records, rows, new_at, state, absent
):
    """``rows[i]`` = the row of ``queries[i]`` (distinct), from ``i = state[0]`` on, with one
    probe of the index each: a found row is touched (``records[r, LAST] = step``, its touch
    count plus ``counts[i]``, saturating); an absent key gets a row (the smallest unused of
    ``free``, then ``high``, ``high + 1``, ...), its record (key, step, count), and its entry
    in the first deleted or free slot its probe passed, and its place ``i`` goes to
    ``new_at``. ``state``: [next query, new keys, free rows used, rows taken from ``high``,
    free slots the load limit leaves, tombstones taken], carried from call to call. The pass
    stops before a new key that needs a row at ``cap`` or a free slot past the load limit,
    and returns the next query (``queries.shape[0]``: done); the caller makes room and calls
    again. One probe a key, where a find, then inserting the new keys, probed each twice.
    ``absent``: the caller knows every query is absent (its own find said so), so a probe
    stops at the first deleted slot instead of looking on to a free one."""
    mask = slots.shape[0] - 1
    low = (np.int64(1) << bits) - 1
    i, n, used, fresh, room, reused = state[0], state[1], state[2], state[3], state[4], state[5]
    start, new0 = i, n
    m = queries.shape[0]
    # Each key's (home, tag), computed once PROBE_AHEAD keys ahead, for the two prefetches and
    # the probe.
    homes = np.empty(_RING, np.int64)
    tags = np.empty(_RING, np.int64)
    for j in range(i, min(m, i + PROBE_AHEAD)):
        homes[j & _RING_MASK], tags[j & _RING_MASK] = _where(queries[j], mask, bits)
    while i < m:
        j = i + PROBE_AHEAD
        if j < m:
            h, t = _where(queries[j], mask, bits)
            homes[j & _RING_MASK], tags[j & _RING_MASK] = h, t
            prefetch_line(slots, h, 0)
        j = i + KEY_AHEAD
        # The record prefetch pays for found keys only: skipped while most keys are new.
        if j < m and 4 * (i - start - (n - new0)) >= i - start:
            s, tag = homes[j & _RING_MASK], tags[j & _RING_MASK]
            for _ in range(KEY_SCAN):
                e = np.int64(slots[s, 0])
                if e == EMPTY:
                    break
                if e >= 0 and (e & ~low) == tag:
                    prefetch_line(keys, e & low, 0)
                    break
                s = (s + 1) & mask
        key = queries[i]
        s, tag = homes[i & _RING_MASK], tags[i & _RING_MASK]
        tomb = -1
        while True:
            e = np.int64(slots[s, 0])
            if e == EMPTY:
                break
            if e == TOMB:
                if tomb < 0:
                    tomb = s
                if absent:
                    break
            elif (e & ~low) == tag and keys[e & low, 0] == key:
                break
            s = (s + 1) & mask
        if e >= 0:
            r = e & low
            rows[i] = r
            records[r, LAST] = step
            records[r, TOUCHES] = min(np.int64(records[r, TOUCHES]) + counts[i], MAX_TOUCHES)
            i += 1
            continue
        if used >= free.shape[0] and high + fresh >= cap:
            break  # no row left
        if tomb < 0 and room <= 0:
            break  # the load limit
        if used < free.shape[0]:
            r = free[used]
            used += 1
        else:
            r = high + fresh
            fresh += 1
        rows[i] = r
        keys[r, 0] = key
        records[r, LAST] = step
        records[r, TOUCHES] = min(counts[i], MAX_TOUCHES)
        if tomb >= 0:
            s = tomb
            reused += 1
        else:
            room -= 1
        slots[s, 0] = tag | r
        new_at[n] = i
        n += 1
        i += 1
    state[0], state[1], state[2], state[3], state[4], state[5] = i, n, used, fresh, room, reused
    return i


@kernel(**_OPTIONS)
def touch(rows, offsets, step, records):
    """``records[r, LAST] = step`` and ``records[r, TOUCHES] += offsets[i + 1] - offsets[i]``
    (saturating at MAX_TOUCHES) for each ``r = rows[i]`` (distinct; ``offsets``: a CSR of the
    rows' occurrences, whose counts are added), the records ``PROBE_AHEAD`` places ahead
    prefetched (a probe that found the rows read them already; one that did not, did not)."""
    n = rows.shape[0]
    for i in range(n):
        if i + PROBE_AHEAD < n:
            prefetch_line(records, rows[i + PROBE_AHEAD], 0)
        r = rows[i]
        records[r, LAST] = step
        t = np.int64(records[r, TOUCHES]) + (offsets[i + 1] - offsets[i])
        records[r, TOUCHES] = min(t, MAX_TOUCHES)


# A row's data time when it has none (state.NO_TIME): it never expires by time.
NO_TIME = np.iinfo(np.int64).min


@kernel(**_OPTIONS)
def expired_rows(records, high, step, steps, times, now, seconds, out):
    """The rows below ``high`` holding a key (touch count >= 0) whose last-touched step is
    more than ``steps`` behind ``step`` (``steps`` < 0: no such rule), or whose data time
    (``times``, NO_TIME: none) is more than ``seconds`` behind ``now`` (``seconds`` < 0: no
    such rule), ascending into ``out``; returns their number. One pass over the records, where
    NumPy made one per condition over their strided columns."""
    n = 0
    for r in range(high):
        if records[r, TOUCHES] < 0:
            continue
        old = steps >= 0 and step - np.int64(records[r, LAST]) > steps
        if not old and seconds >= 0:
            t = times[r]
            old = t != NO_TIME and now - t > seconds
        if old:
            out[n] = r
            n += 1
    return n
