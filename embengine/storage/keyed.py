"""KeyedTable: a table keyed by any int64 id (a dynamic vocabulary), rows made as keys come.

The kernels see what they see of a DenseTable: ``data``, rows ``[weights | slot 0 | ...]`` laid
out by ``DenseTable``'s rule (``columns``), indexed by the rows ``rows_for`` gives. In front of
the rows sits an open-addressing index (``kernels/keyed_index.py``: int64 key -> row), probed
once per step on the batch's unique keys, never inside pooling. The rules of admission,
eviction and insertion are ``config.DynamicVocabulary``'s; this module implements them.

The rows live in an arena: one anonymous memory mapping reserved for ``max_rows`` rows (2^38
bytes of address space without a limit), of which the first ``capacity`` rows are the ``data``
array. Reserved pages cost no memory until written, so growing the capacity (doubling, in
chunks) moves no row and leaves earlier views valid; only a table outgrowing its reservation is
copied into a bigger one. Rows freed by eviction are reused, smallest first. A keyed table
stored as "keyed-mmap" (``storage="mmap"``) keeps its rows in the file ``{storage_dir}/{name}.f32``
instead, locked as a DenseTable's file is: growing the capacity reserves the file's new blocks
(``posix_fallocate``: a full disk is an OSError naming the file, not a SIGBUS later) and maps
the longer file again (the rows stay in the file; only the mapping's address moves). The
page cache is then the rows' cache, for tables bigger than RAM. The file holds rows only:
the index and row metadata stay in RAM, and a restart restores the table from a checkpoint.

Per row the table keeps its key, the step it was last touched and how often it was touched (for
expiry, LRU and LFU), and with ``expire_seconds`` its data time (the newest timestamp that
touched it); per key waiting for admission, its exact count of occurrences before the
current step (``_Pending``). One writer per table: every change is serial (the index's probe is
parallel but read-only), so the same batches and seed give the same rows at any thread count.

The storage protocol's optional parts this kind uses (``storage/protocol.py``):
``counts_occurrences`` (``rows_for`` gets each unique key's occurrences in the batch),
``begin_step(step)`` (the engine's step, before each lookup and update) and
``rows_for_update`` (``insert_on="apply"``: rows for the batch's new keys at the update).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import mmap
import os
import sys
from pathlib import Path

import numpy as np

from ..config import MAX_KEYED_ROWS
from ..initializers import FromFunction, Initializer
from ..inputs import frozen
from ..optimizers import SlotSpec
from ..precision import check_initial, check_initial_slots, initial_bound
from ..precision import table_key as rounding_key
from ..state import (
    KEYED_COUNTERS,
    NO_TIME,
    WEIGHTS,
    GatheredRows,
    TensorSource,
    keyed_entries,
)
from .dense import (
    MappedRows,
    StorageError,
    _advise,
    column_view,
    open_locked,
    reserve,
    row_columns,
    row_dtype,
)
from .protocol import NO_ROW

__all__ = ["IndexView", "KeyedTable", "KeyedView", "KeyIndex"]

# Rows of a new table's first capacity; capacity then doubles.
_FIRST_CAPACITY = 1024
# Address space reserved for a table without max_rows (no memory until rows are written).
_RESERVE_BYTES = 1 << 38
# Linux: do not count the reservation against the overcommit limit (mmap.MAP_NORESERVE is not
# exported by Python 3.11's mmap module).
_MAP_NORESERVE = 0x4000 if sys.platform.startswith("linux") else 0
# Transparent huge pages for a RAM arena from this many bytes of capacity on (_advise_huge_pages).
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)
_HUGE_PAGES_FROM = 4 << 20
# The index grows (doubles) before its load passes this fraction.
_MAX_LOAD = 0.75
# Probes of fewer keys run on one thread: a probe costs nanoseconds, and a parallel region
# waits for every thread to wake, which a loaded host can delay by milliseconds
# (docs/performance.md, "Keyed tables").
_PARALLEL_FIND = 1 << 18
# An entry's value bits while the values fit (the other 31 - bits are the tag: 11 below 2^20
# rows, where probes pass few entries' records), and the bits of value and tag together
# (kernels/keyed_index.py's ENTRY_BITS).
_MIN_ROW_BITS, _ENTRY_BITS = 20, 31
# A row record's int32 columns: key (two), last-touched step, touch count (the numbers of
# kernels/keyed_index.py's RECORD_COLS, LAST, TOUCHES).
_RECORD_COLS, _LAST, _TOUCHES = 4, 2, 3
# ``keyed_index.expired_rows``' times when no rule reads them.
_NO_TIMES = np.zeros(0, np.int64)
# int32 row metadata (last-touched steps, counts): a rebase leaves the step this far past _base,
# so ages up to _STEP_SPAN - _INT32.min = 3 * 2^30 stay exact (config.MAX_EXPIRE_STEPS).
_INT32 = np.iinfo(np.int32)
_STEP_SPAN = 1 << 30
# Keys waiting for admission, without max_rows (with it: 4 * max_rows).
DEFAULT_MAX_PENDING = 1 << 22
# NO_TIME (state.py): no data time, a table before its first timestamp or a row touched by no
# timestamped call.
# Timestamps are ints in [0, MAX_TIMESTAMP): differences of two never overflow int64.
MAX_TIMESTAMP = 1 << 62
# The stats counters a state holds are ints in [0, MAX_COUNT]: a load refuses more, and
# state() saturates there, so a step's count and the total (their sum, a manifest's
# ``keyed.total``) never overflow int64 and whatever is saved loads again. 2^62 - 1 is 10^9
# events a second for 146 years.
MAX_COUNT = (1 << 62) - 1


class KeyIndex:
    """int64 key -> int32 value in ``[0, MAX_KEYED_ROWS)``, an open-addressing hash table of
    numba kernels (``kernels/keyed_index.py``): ``slots[s]`` holds an entry (a value in its low
    ``row_bits`` bits, a tag of its key's hash above them; -1 a free slot, -2 a tombstone) and
    ``keys[v, 0]`` the key value ``v`` holds, so a key costs a 4-byte slot and its 8 bytes.
    ``keys`` is the index's own ``[n, 1]`` array, grown as values come (``hold``), or its
    owner's (a keyed table's row records, ``[rows, 2]``: the key is column 0), which the owner
    sizes and sets. ``find`` gives -1 for an absent key. A removed value's key is left in
    ``keys`` (its owner reuses the value); its slot becomes a tombstone (``tombs`` of them)
    until the slots are rebuilt."""

    def __init__(self, capacity: int = 1024):
        cap = 1 << max(int(capacity) - 1, 1).bit_length()
        self.slots = _empty_slots(cap)
        self.keys = np.zeros((0, 1), np.int64)
        self._own_keys = True
        self.row_bits = _MIN_ROW_BITS  # an entry's value bits (kernels/keyed_index.py)
        self.count = 0
        self.tombs = 0

    @property
    def capacity(self) -> int:
        return len(self.slots)

    @property
    def nbytes(self) -> int:
        """The slots' bytes (the keys are counted by their owner)."""
        return self.slots.nbytes

    @property
    def values(self) -> np.ndarray:
        """Every slot's value (-1: free, -2: a tombstone), a copy."""
        low = (1 << self.row_bits) - 1
        return np.where(self.slots >= 0, self.slots & low, self.slots)

    def columns(self) -> tuple[np.ndarray, np.ndarray, int]:
        """(slots, keys, row_bits) as the kernels take them: ``[capacity, 1]``, ``[n, k]``."""
        return self.slots.reshape(-1, 1), self.keys, self.row_bits

    def use_keys(self, keys: np.ndarray) -> None:
        """Take ``keys`` (int64 ``[n, k]``, C-contiguous, the key in column 0: its owner's, who
        sizes it for every value before inserting it, holding the keys of the values in use)
        as the keys by value."""
        self.keys, self._own_keys = keys, False
        self._fit_bits()

    def _fit_bits(self) -> None:
        """Enough value bits for every value ``keys`` can hold: if it needs more, two more than
        it needs, rebuilding the slots at their capacity (so every third doubling of the
        values rebuilds, not every one; a probe reads the record of an entry it passes with
        probability 2^-(31 - bits), so each bit taken from the tag doubles those reads)."""
        from ..kernels import keyed_index

        need = max(1, (len(self.keys) - 1).bit_length())
        if need > self.row_bits:
            bits = min(_ENTRY_BITS, need + 2)
            slots = _empty_slots(self.capacity)
            keyed_index.rehash(*self.columns(), slots.reshape(-1, 1), bits)
            self.slots, self.tombs, self.row_bits = slots, 0, bits

    def hold(self, values: int) -> None:
        """Room in the index's own ``keys`` for values ``0 .. values - 1`` (grown by copy,
        doubling)."""
        if values > len(self.keys):
            if not self._own_keys:
                raise AssertionError(f"{values:,} values, the owner's keys hold {len(self.keys):,}")
            if values > MAX_KEYED_ROWS:
                raise ValueError(
                    f"a keyed index holds at most {MAX_KEYED_ROWS:,} values, asked for {values:,}"
                )
            keys = np.zeros((min(max(values, 2 * len(self.keys)), MAX_KEYED_ROWS), 1), np.int64)
            keys[: len(self.keys)] = self.keys
            self.keys = keys
            self._fit_bits()

    def find(self, keys: np.ndarray) -> np.ndarray:
        from ..kernels import keyed_index
        from ..kernels.pool import start_pool

        # read-only whatever the caller's array (inputs.frozen): keys came both ways, and the
        # kernels compiled twice
        keys = frozen(np.ascontiguousarray(keys, dtype=np.int64))
        out = np.empty(len(keys), dtype=np.int64)
        if len(keys) >= _PARALLEL_FIND:
            start_pool()  # find is parallel
            keyed_index.find(*self.columns(), keys, out)
        elif len(keys):
            keyed_index.find_serial(*self.columns(), keys, out)
        return out

    def reserve(self, need: int) -> None:
        """Room for ``need`` keys: if they and the tombstones would pass the load limit,
        rebuild the slots without tombstones, doubling the capacity while ``need`` keys would
        pass the limit, or fill more than half of it (a rebuild then leaves room for as many
        keys again before the next)."""
        from ..kernels import keyed_index

        if need + self.tombs > _MAX_LOAD * self.capacity:
            cap = self.capacity
            while need > _MAX_LOAD * cap:
                cap *= 2
            if cap == self.capacity and need > cap // 2:
                cap *= 2
            slots = _empty_slots(cap)
            keyed_index.rehash(*self.columns(), slots.reshape(-1, 1), self.row_bits)
            self.slots, self.tombs = slots, 0

    def insert(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Add absent ``keys`` with distinct ``values`` not in use (``keys[values, 0] = keys``;
        the index's own keys grow to hold them)."""
        from ..kernels import keyed_index

        if not len(keys):
            return
        values = np.ascontiguousarray(values, dtype=np.int64)
        self.hold(int(values.max()) + 1)
        self.keys[values, 0] = keys
        need = self.count + len(keys)
        self.reserve(need)
        self.tombs -= int(keyed_index.insert(*self.columns(), values))
        self.count = need

    def remove(self, keys: np.ndarray) -> None:
        """Remove ``keys`` (absent ones are skipped): their values, found, removed by value."""
        values = self.find(keys)
        self.remove_values(np.unique(values[values >= 0]))

    def remove_values(self, values: np.ndarray) -> None:
        """Remove the keys of ``values`` (distinct, each in the index; ascending is fastest:
        their keys are read in order)."""
        from ..kernels import keyed_index

        if len(values):
            values = np.ascontiguousarray(values, dtype=np.int64)
            tombs, missing = keyed_index.remove_values(*self.columns(), values)
            self.tombs += int(tombs)
            self.count -= len(values) - int(missing)
            if missing:
                raise AssertionError(f"{int(missing)} of the values to remove were not indexed")


def _anonymous(nbytes: int) -> mmap.mmap | None:
    """An anonymous mapping of ``nbytes``, reserved without committing memory; None if the
    system refuses it."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
    try:
        return mmap.mmap(-1, max(nbytes, 1), flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, OverflowError, ValueError):
        return None


def _reserve(want: int, need: int, row_bytes: int, what: str) -> tuple[mmap.mmap, int]:
    """An anonymous mapping reserved for ``want`` rows of ``row_bytes``, or, if the system
    refuses it, for ``need`` rows only: (mapping, rows); the caller copies the rows into a
    bigger one when they outgrow it (capacity doubles: amortised, as any growing array). A
    refusal means the address space is limited (RLIMIT_AS, ``ulimit -v``; or strict
    overcommit): taking the largest part that fits, as this did (a quarter of ``want`` at a
    time), left nothing to the rest of the process: one table took every byte a limit left,
    and the next allocation failed, a 100 MiB array or the table's own records. A
    MemoryError naming ``what`` if not even ``need`` rows can be mapped."""
    mapping = _anonymous(want * row_bytes)
    if mapping is not None:
        return mapping, want
    mapping = _anonymous(need * row_bytes) if need < want else None
    if mapping is None:
        raise MemoryError(f"{what}: cannot map {need:,} rows")
    return mapping, need


def _release(
    index: KeyIndex, free: np.ndarray, values: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Remove ``values`` (distinct, each indexed) from ``index`` and add them to the sorted
    free list ``free``: (the values sorted, the new free list). Timsort, so values that come
    sorted (expired rows) and the two sorted runs merge in O(n)."""
    values = np.sort(values, kind="stable")
    index.remove_values(values)
    return values, np.sort(np.concatenate([free, values]), kind="stable")


def _advise_huge(mapping: mmap.mmap | None, nbytes: int) -> None:
    """Transparent huge pages over a mapping's first ``nbytes`` from 4 MiB on."""
    if mapping is None or _MADV_HUGEPAGE is None or nbytes < _HUGE_PAGES_FROM:
        return
    with contextlib.suppress(OSError, ValueError):
        mapping.madvise(_MADV_HUGEPAGE, 0, min(nbytes, len(mapping)))


def _empty_slots(capacity: int) -> np.ndarray:
    """A free index of ``capacity`` slots (-1)."""
    return np.full(capacity, -1, dtype=np.int32)


def _take_smallest(free: np.ndarray, k: int, high: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``k`` slots: the smallest free ones (``free`` is sorted), then new ones from ``high``.
    Returns (slots, the free slots left, the new high-water mark)."""
    reused = free[:k]
    fresh = np.arange(high, high + k - len(reused), dtype=np.int64)
    return np.concatenate([reused, fresh]), free[len(reused) :], high + len(fresh)


def _smallest(cols: list[np.ndarray], k: int) -> np.ndarray:
    """The positions of the ``k`` smallest entries in the lexicographic order of ``cols``
    (most significant first; the last column has no ties), in that order: what
    ``np.lexsort(cols[::-1])[:k]`` gives, by one partition per column instead of a sort of all
    (an eviction takes a few rows out of many)."""
    n = len(cols[0])
    idx, chosen = np.arange(n), []
    for col in cols:
        if k <= 0 or k >= len(idx):
            break
        v = col[idx]
        kth = np.partition(v, k - 1)[k - 1]
        below = idx[v < kth]
        chosen.append(below)
        k -= len(below)
        idx = idx[v == kth]
    if k > 0:
        chosen.append(idx[:k] if len(idx) > k else idx)
    sel = np.concatenate(chosen) if chosen else np.zeros(0, np.int64)
    return sel[np.lexsort([c[sel] for c in cols[::-1]])]


def _first_in_order(
    cols: list[np.ndarray], k: int, values: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(order, values): the first ``k`` entries in the lexicographic order of ``cols``
    (``_smallest``; all of them, sorted, if there are no more), as an int64 ``[m, columns]``
    matrix of their columns, and ``values`` at them: what a shard sends of its candidates
    (``shared_victims``)."""
    pick = _smallest(cols, k)
    return np.stack([np.asarray(c[pick], dtype=np.int64) for c in cols], axis=1), values[pick]


class _Pending:
    """Keys waiting for admission and their exact occurrence counts: ``earlier`` counts the
    steps before ``step``, ``current`` the step ``step`` (the last step the key was seen), so
    "occurrences in earlier steps" is exact however many lookups a step has. ``held`` (1 or
    0) marks the keys a training lookup admitted whose row comes at an update (``insert_on=
    "apply"``, ``hold``): the bound forgets them only after every other pending key, so a
    second lookup before that update does not drop their gradient there."""

    def __init__(self, limit: int):
        self.limit = int(limit)
        self.index = KeyIndex()
        n = 1024
        self.index.hold(n)
        self.earlier = np.zeros(n, np.int64)
        self.step = np.zeros(n, np.int64)
        self.current = np.zeros(n, np.int64)
        self.held = np.zeros(n, np.int64)
        self.free = np.zeros(0, np.int64)
        self.high = 0

    def __len__(self) -> int:
        return self.index.count

    @property
    def key(self) -> np.ndarray:
        """The key of each pending slot (the index's keys by value)."""
        return self.index.keys[:, 0]

    @property
    def nbytes(self) -> int:
        return self.index.nbytes + self.index.keys.nbytes + 4 * self.earlier.nbytes

    def counts_before(self, keys: np.ndarray, step: int) -> np.ndarray:
        """Each key's occurrences in steps before ``step`` (0 if not pending)."""
        slots = self.index.find(keys)
        out = np.zeros(len(keys), np.int64)
        at = slots >= 0
        s = slots[at]
        out[at] = self.earlier[s] + np.where(self.step[s] < step, self.current[s], 0)
        return out

    def add(
        self,
        keys: np.ndarray,
        counts: np.ndarray,
        step: int,
        given: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> int:
        """Count ``keys`` (distinct) ``counts`` times at ``step``; returns how many pending keys
        were forgotten to stay within the limit (keys not ``held`` first, then the ones seen
        longest ago, then smaller keys; ``keys`` themselves are not forgotten: past that, the
        largest of the new ones are not counted).
        ``given``: what to forget, decided over every shard of a table (``shared_pending``):
        (pending keys to forget, new keys of ``keys`` not to count), the limit then not
        checked here."""
        slots = self.index.find(keys)
        old = slots >= 0
        s = slots[old]
        roll = self.step[s] < step
        self.earlier[s[roll]] += self.current[s[roll]]
        self.current[s[roll]] = 0
        self.step[s] = step
        self.current[s] += counts[old]
        new_keys, new_counts = keys[~old], counts[~old]
        forgotten = 0
        excess = len(self) + len(new_keys) - self.limit
        if given is not None:
            drop = self.index.find(np.ascontiguousarray(given[0], dtype=np.int64))
            if (drop < 0).any() or np.isin(drop, s).any():
                raise AssertionError("a shared decision forgot a key that is not pending")
            self.remove_slots(drop)
            keep = ~np.isin(new_keys, given[1])
            forgotten += len(drop) + int((~keep).sum())
            new_keys, new_counts = new_keys[keep], new_counts[keep]
            excess = 0
        if excess > 0:
            live = self._live_slots()
            live = live[~np.isin(live, s)]  # this batch's keys are the newest
            order = np.lexsort((self.key[live], self.step[live], self.held[live]))
            drop = live[order[:excess]]
            self.remove_slots(drop)
            forgotten += len(drop)
            excess -= len(drop)
            if excess > 0:  # the batch alone brings more new keys than the limit
                keep = np.sort(np.argsort(new_keys, kind="stable")[: len(new_keys) - excess])
                forgotten += len(new_keys) - len(keep)
                new_keys, new_counts = new_keys[keep], new_counts[keep]
        slots, self.free, self.high = _take_smallest(self.free, len(new_keys), self.high)
        if self.high > len(self.earlier):
            n = max(self.high, 2 * len(self.earlier))
            for name in ("earlier", "step", "current", "held"):
                a = getattr(self, name)
                b = np.zeros(n, np.int64)
                b[: len(a)] = a
                setattr(self, name, b)
        self.earlier[slots] = 0
        self.step[slots] = step
        self.current[slots] = new_counts
        self.held[slots] = 0
        self.index.insert(new_keys, slots)
        return forgotten

    def hold(self, keys: np.ndarray) -> None:
        """Mark ``keys`` (pending) as admitted by a training lookup, their rows due at an
        update: they leave the pending counts when a row is made for them (``forget``), or are
        forgotten by the bound after every key not held."""
        slots = self.index.find(keys)
        self.held[slots[slots >= 0]] = 1

    def forget(self, keys: np.ndarray) -> None:
        """Drop ``keys`` (admitted ones); absent keys are skipped."""
        slots = self.index.find(keys)
        self.remove_slots(slots[slots >= 0])

    def remove_slots(self, slots: np.ndarray) -> None:
        if len(slots):
            _, self.free = _release(self.index, self.free, slots)

    def _live_slots(self) -> np.ndarray:
        used = np.ones(self.high, bool)
        used[self.free] = False
        return np.flatnonzero(used)


@dataclasses.dataclass(frozen=True)
class IndexView:
    """A keyed table's index as a kernel probes it (``KeyedTable.lookup_index``).

    ``slots``, ``row_bits`` and ``records``: the index (``kernels/keyed_index.py``: int32
    entries of a row and a tag; per row its record, int32 ``[rows, 4]``: the int64 key, the
    last-touched step, the touch count), so ``rows_for(logical, keys, False)`` is the probe of
    the index with the rows flagged in ``dead`` (a uint8 per row of ``data``, 1 for a row that
    has expired and looks up as absent; None when none has) taken as absent. A training lookup
    whose unique keys all had live rows may touch them in the kernel too (``touch``), as
    ``rows_for`` would: the record's step set to ``step`` (counted from the table's base, as
    the records count) and its count raised by the occurrences, saturating (``touch`` False:
    not in the kernel; ``rows_for(..., touched=False)`` does it)."""

    slots: np.ndarray
    row_bits: int
    records: np.ndarray
    dead: np.ndarray | None
    touch: bool
    step: int
    # rows_for may refuse a training batch (max_rows; or, for a batch of more keys than
    # ``rows_left``, the int32 row limit): then no table of the batch may be touched before
    # every table's rows_for has run (a refusal changes nothing after it).
    refuses: bool = False
    rows_left: int = MAX_KEYED_ROWS


class KeyedView:
    """A keyed table as ``storage.protocol.LogicalTable`` sees it: name, dim, slots, storage.
    Its rows are not ids, so it has no weights array by id: read it with
    ``engine.table_contents(name)``; its state (``state_dict``, checkpoints) is ``state()``."""

    def __init__(self, table: KeyedTable):
        self.table = table
        self.name = table.name
        self.vocabulary_size = None
        self.dim = table.dim
        self.slot_specs = table.slot_specs
        self.columns = table.columns

    def _refuse(self):
        raise TypeError(
            f"table {self.name!r} is keyed (vocabulary_size=None): its rows are not ids, so it "
            "has no weights or slot arrays by id (embedding_tables, slots); read it with "
            f"engine.table_contents({self.name!r}) or engine.state_dict()"
        )

    @property
    def weights(self) -> np.ndarray:
        self._refuse()

    def slot(self, name: str) -> np.ndarray:
        self._refuse()

    @property
    def slot_names(self) -> tuple[str, ...]:
        return self.table.slot_names

    @property
    def slots(self) -> dict[str, np.ndarray]:
        self._refuse()

    @property
    def storage(self) -> str:
        return self.table.storage

    def state(self, lazy: bool = False) -> dict[str, np.ndarray]:
        """The table's state entries (``embengine.state``, a keyed table): a snapshot
        (``KeyedTable.state``)."""
        return self.table.state(lazy)

    def state_entries(self) -> dict[str, tuple[tuple, np.dtype]]:
        """Entry name -> (shape, dtype) of ``state()``, "n" / "p" for its two lengths."""
        slots = [(s.name, s.width, s.dtype) for s in self.slot_specs]
        return keyed_entries(self.dim, slots, self.table.weights_dtype, self.table.slots_dtype)

    def prepare_state(self, entries: dict, step: int, at: str):
        """See ``KeyedTable.prepare_state``."""
        return self.table.prepare_state(entries, step, at)

    def flush(self) -> None:
        self.table.flush()

    def sequential_access(self):
        return self.table.sequential_access()


class KeyedTable(MappedRows):
    """One keyed table (a ``TableStorage`` of kind "keyed"); see the module docstring and
    ``config.DynamicVocabulary`` for the rules.

    Args:
      name: the table's name (also its initializer's: a new key ``k`` gets
        ``initializer.init(seed, name, [k], dim)``).
      dim, slot_specs: the row layout (weights, then the optimizer's slots).
      initializer, seed: a new key's weights.
      dynamic: the table's ``DynamicVocabulary``.
      path: the file of its rows (storage "keyed-mmap"); None: in RAM ("keyed").
      weights_dtype, slots_dtype: the stored dtypes (``dense.row_columns``: a 16-bit table's
        row array is uint16); a new row's values are rounded to nearest, an update's
        stochastically, the stream following the row's key (``rounding_rows``).
    """

    counts_occurrences = True

    def __init__(
        self,
        name: str,
        dim: int,
        slot_specs: tuple[SlotSpec, ...],
        initializer: Initializer,
        seed: int,
        dynamic,
        path: str | os.PathLike | None = None,
        weights_dtype: str = "float32",
        slots_dtype: str = "float32",
    ):
        self.name = name
        self.path = None if path is None else Path(path)
        self._fd: int | None = None  # the locked file's descriptor (keyed-mmap)
        self.dim = int(dim)
        self.slot_specs = tuple(slot_specs)
        self.weights_dtype, self.slots_dtype = weights_dtype, slots_dtype
        # The key of this table's stochastic-rounding stream (embengine.precision).
        self.rounding_key = rounding_key(seed, name)
        self._dtype = np.dtype(row_dtype(weights_dtype, slots_dtype))
        self.columns, self.row_width = row_columns(
            name, self.dim, self.slot_specs, weights_dtype, slots_dtype
        )
        self._row_bytes = self.row_width * self._dtype.itemsize
        self.dynamic = dynamic
        self._initializer = initializer
        # (keys, values): a FromFunction's values of the keys check_rows admitted, computed and
        # checked there, for the resolution that follows (_values_first)
        self._first_values: tuple[np.ndarray, np.ndarray] | None = None
        # 16-bit: new rows' values are rounded to nearest; past the dtype's range they would
        # be Inf (a FromFunction initializer's values are not known before they are asked)
        bound = initial_bound(initializer, self.dim)
        if bound is not None:
            check_initial(name, weights_dtype, bound, f"its initializer {initializer!r}")
        check_initial_slots(name, slots_dtype, self.slot_specs)
        self._seed = int(seed)
        self._pending = _Pending(
            min(4 * dynamic.max_rows, MAX_KEYED_ROWS) if dynamic.max_rows else DEFAULT_MAX_PENDING
        )
        self._step = 0
        self._empty_arena()
        self._base = 0  # of the records' last-touched steps (_rel_step)
        self._free = np.zeros(0, np.int64)  # freed rows below _high, sorted
        self._live_rows = None  # cached live_rows()
        # cached _expired(): ((step, data time), rows), dropped by every change of the rows'
        # metadata (a training lookup asks in lookup_index, rows_for and _victims)
        self._expired_memo = None
        self._stats_step = -1
        # Data time (``DynamicVocabulary.expire_seconds``): the newest timestamp of the training
        # calls that resolved keys here, and the timestamp of the call under way (None: none).
        self._clock = NO_TIME
        # The step whose training lookup last changed the table (its update not counted here)
        self._resolved_step = -1
        self._call_time: int | None = None
        self._this = self._zero_counts()
        self._total = self._zero_counts()
        self._grow(
            _FIRST_CAPACITY if dynamic.max_rows is None else min(_FIRST_CAPACITY, dynamic.max_rows)
        )

    @property
    def max_pending(self) -> int:
        """At most this many keys wait for admission with their counts (``DynamicVocabulary``:
        the ones seen longest ago are forgotten first, keys a lookup admitted whose rows
        come at an update last); 4 * max_rows (at most 2^31 - 1), or
        2^22 without it. The engine's rule: a restore or ``load_state_dict`` keeps it (the
        state's ``meta[1]`` is checked, not taken), forgetting the pending keys past it by
        the same rule. A ShardedEngine bounds the pending keys of a table over all its shards
        by it (``shared_pending``; set it alike on every rank)."""
        return self._pending.limit

    @max_pending.setter
    def max_pending(self, n: int) -> None:
        if (
            isinstance(n, bool)
            or not isinstance(n, int | np.integer)
            or not 0 <= n <= MAX_KEYED_ROWS
        ):
            raise ValueError(
                f"table {self.name!r}: max_pending must be an int in [0, {MAX_KEYED_ROWS:,}], "
                f"got {n!r}"
            )
        self._pending.limit = int(n)

    @property
    def pending_keys(self) -> int:
        """How many keys wait for admission now (at most ``max_pending``)."""
        return len(self._pending)

    # -- the arena ------------------------------------------------------------------------------

    def _empty_arena(self) -> None:
        """No rows: a fresh index, arena (module docstring) and row records, of no capacity
        (``_grow`` gives it; old mappings are released with their last views). Per row a record
        of 16 bytes (int32 columns, kernels/keyed_index.py): its key (the index's keys), the
        step it was last touched (from ``_base``: ``_rel_step``) and how often (saturating;
        -1: the row holds no key); with expire_seconds, its data time (``_time``)."""
        self._index = KeyIndex()
        self._mapping, self._high, self._capacity = None, 0, 0  # _high: rows handed out
        self._reserved = self._default_reservation()
        self._data = np.zeros((0, self.row_width), self._dtype)
        self._records_map = None
        self._records_full = self._records = np.zeros((0, _RECORD_COLS), np.int32)
        self._time = np.zeros(0, np.int64)

    def _default_reservation(self) -> int:
        """Rows reserved for the arena: max_rows, or 2^38 bytes' worth (at most
        MAX_KEYED_ROWS)."""
        if self.dynamic.max_rows:
            return self.dynamic.max_rows
        rows = max(_RESERVE_BYTES // self._row_bytes, _FIRST_CAPACITY)
        return min(rows, MAX_KEYED_ROWS)

    def _advise_huge_pages(self) -> None:
        """Ask for transparent huge pages over the rows' capacity once it reaches 4 MiB (as
        NumPy does for its big arrays, a dense table's): random rows on 4 KiB pages miss the
        TLB on nearly every row (docs/performance.md, "Keyed tables"); a smaller table would
        pay a 2 MiB page for a few rows. The records too (``_records_room``)."""
        if self.path is None:
            _advise_huge(self._mapping, self._capacity * self._row_bytes)
        _advise_huge(self._records_map, self._capacity * 4 * _RECORD_COLS)

    def _records_room(self, cap: int) -> None:
        """Records for ``cap`` rows: the first call reserves them for MAX_KEYED_ROWS rows in
        an anonymous mapping (32 GiB of address space, no memory until written), so they
        never move and cost what the rows written use; only if the system refuses that is a
        smaller reservation copied into a bigger one when outgrown."""
        if cap <= len(self._records_full):
            return
        what = f"table {self.name!r}'s records"
        mapping, reserve = _reserve(MAX_KEYED_ROWS, cap, 4 * _RECORD_COLS, what)
        full = np.frombuffer(mapping, np.int32, count=reserve * _RECORD_COLS)
        full = full.reshape(reserve, _RECORD_COLS)
        full[: self._high] = self._records_full[: self._high]  # only when outgrowing one
        self._records_map, self._records_full = mapping, full

    def _grow_file(self, cap: int) -> None:
        """keyed-mmap: the file (opened and locked on first use) grown to ``cap`` rows, its new
        blocks reserved, and mapped again; the rows already written stay where they are in it."""
        if self._fd is None:
            # the old contents: the index that named their rows is gone
            self._fd = open_locked(self.path, self.name)
        old, new = self._capacity * self._row_bytes, cap * self._row_bytes
        # reserve never shortens the file: a restore stages its arena here (``_stage``) while
        # the table's own mapping still reads the rows past ``new``
        reserve(self._fd, old, new, self.path, self.name)
        mapping = mmap.mmap(self._fd, new)
        _advise(mapping, "MADV_RANDOM")
        self._mapping = mapping
        self._full = np.frombuffer(mapping, self._dtype).reshape(cap, self.row_width)
        self._reserved = cap

    def check_file(self) -> None:
        """keyed-mmap: raise StorageError if the table was closed or its file is now shorter
        than its rows (truncated by another program: touching the rows past its end would
        kill the process with SIGBUS). One fstat; nothing for a table in RAM."""
        if self.path is None:
            return
        if self._mapping is None or self._mapping.closed:
            raise StorageError(f"table {self.name!r} is closed (its file {str(self.path)!r})")
        need = self._capacity * self._row_bytes
        if self._mapping.size() < need:
            raise StorageError(
                f"table {self.name!r}: its file {str(self.path)!r} is {self._mapping.size():,} "
                f"bytes, the table needs {need:,}: it was truncated while in use (not by "
                "embengine, which locks it); restore the engine from a checkpoint"
            )

    def close(self) -> None:
        """keyed-mmap: unmap the rows and release the file's lock (a no-op in RAM or when
        closed); the table is unusable afterwards (StorageError)."""
        if self._fd is None:
            return
        self._data = self._full = np.zeros((0, self.row_width), self._dtype)
        with contextlib.suppress(BufferError):  # a caller's view keeps the mapping alive
            self._mapping.close()
        os.close(self._fd)  # the mapping's own descriptor keeps the lock while it lives
        self._fd = None

    def _grow(self, rows: int) -> None:
        """Capacity for at least ``rows`` rows: double within the reservation (no row moves),
        or copy into a bigger reservation; keyed-mmap: grow the file (``_grow_file``)."""
        if rows <= self._capacity:
            return
        if rows > MAX_KEYED_ROWS:  # rows_for and prepare_state refuse first (_check_room)
            raise AssertionError(f"table {self.name!r}: {rows:,} rows, past MAX_KEYED_ROWS")
        cap = min(max(rows, 2 * self._capacity, _FIRST_CAPACITY), MAX_KEYED_ROWS)
        if self.path is not None:
            if self.dynamic.max_rows is not None:
                cap = min(cap, max(rows, self.dynamic.max_rows))
            self._grow_file(cap)
        elif self._mapping is None or cap > self._reserved:
            want = max(self._reserved, cap)
            mapping, reserve = _reserve(want, cap, self._row_bytes, f"table {self.name!r}")
            new = np.frombuffer(mapping, self._dtype, count=reserve * self.row_width)
            new = new.reshape(reserve, self.row_width)
            new[: self._high] = self._data[: self._high]  # only when outgrowing a reservation
            self._mapping, self._reserved, self._full = mapping, reserve, new
        cap = min(cap, self._reserved)
        self._data = self._full[:cap]
        self._capacity = cap
        self._records_room(cap)
        self._records = self._records_full[:cap]  # rows from _high on: zeros, never read
        self._index.use_keys(self._records.view(np.int64))
        self._advise_huge_pages()
        if self._keeps_time:
            t = np.zeros(cap, np.int64)
            t[: len(self._time)] = self._time
            self._time = t

    # -- the storage protocol --------------------------------------------------------------------

    @property
    def data(self) -> np.ndarray:
        """float32 ``[capacity, row_width]`` (uint16 for a 16-bit table: ``row_columns``):
        rows ``rows_for`` gave, and unused ones (a keyed-mmap table checks its file first:
        ``check_file``)."""
        if self._fd is not None:
            self.check_file()
        return self._data

    @property
    def row_bases(self) -> None:
        """Rows are not ids."""
        return None

    @property
    def rounding_rows(self) -> np.ndarray:
        """What a 16-bit update's rounding stream follows for each row (``rounding.hash_row``):
        its key, column 0 of the records as int64 ``[capacity, 2]``. A row's place moves
        (reused rows; a restore lays rows out in key order), its key does not: so the same
        data gives the same values whatever the rows, and a keyed table fed ids 0..V-1 the
        dense table's (whose stream follows its rows, its ids)."""
        return self._records.view(np.int64)

    @property
    def storage(self) -> str:
        return "keyed" if self.path is None else "keyed-mmap"

    @property
    def nbytes(self) -> int:
        """Bytes of the rows' capacity (the row array the kernels see)."""
        return self._capacity * self._row_bytes

    @property
    def rows(self) -> int:
        """Keys (rows) in the table."""
        return self._index.count

    @property
    def _keeps_time(self) -> bool:
        return self.dynamic.expire_seconds is not None

    @property
    def needs_timestamp(self) -> bool:
        """Whether training calls must carry a data time (``expire_seconds``)."""
        return self._keeps_time

    @property
    def data_time(self) -> int | None:
        """The newest timestamp of the training calls that resolved keys here (None: none)."""
        return None if self._clock == NO_TIME else self._clock

    def begin_step(self, step: int, timestamp: int | None = None) -> None:
        """The engine's step, before each lookup and update (expiry and recency need it), and
        the call's data time (a training call's timestamp, or its step's; None for an
        evaluation lookup). The table's data time moves when a training resolution here
        succeeds."""
        self._step = int(step)
        self._call_time = None if timestamp is None else int(timestamp)
        if not _INT32.min < self._step - self._base <= _INT32.max:
            self._rebase()

    @property
    def _rel_step(self) -> int:
        """The step as the int32 last-touched steps count it (from ``_base``)."""
        return self._step - self._base

    def _rebase(self) -> None:
        """Move ``_base`` so the step is ``_STEP_SPAN`` (2^30) past it, shifting every row's
        last-touched step; a step further back than int32 reaches (more than 3 * 2^30 steps
        before this one) is clamped to its minimum, so ``state()`` reports it newer than it
        was, expiry stays exact for ``expire_steps`` below 3 * 2^30 (``DynamicVocabulary``
        refuses longer ones: a clamped row expired later, or never), and LRU orders clamped
        rows by key."""
        delta = self._step - self._base - _STEP_SPAN
        high = self._high
        last = self._last[:high].astype(np.int64) - delta
        self._records[:high, _LAST] = np.clip(last, _INT32.min, _INT32.max)
        self._base += delta
        self._expired_memo = None

    def _now(self) -> int:
        """The data time the rules see: the table's, or the call's if newer."""
        t = self._call_time
        return self._clock if t is None else max(self._clock, t)

    def looked_up_in(self, step: int) -> bool:
        """Whether a training lookup of ``step`` changed the table (inserted or counted keys,
        touched rows): until its update moves the engine past ``step``, the table holds half
        of that step, which a checkpoint could not continue from."""
        return self._resolved_step == step

    def commit_update_time(self) -> None:
        """An update of keys of this table, inserting on apply, at the call's data time: the
        table's data time moves to it (``rows_for_update`` does this; a sharded table whose
        shard got none of the step's keys is told so, so every shard keeps the same time)."""
        if self.dynamic.insert_on == "apply":
            self._commit_time()

    def _commit_time(self) -> None:
        if self._call_time is not None:
            self._clock = max(self._clock, self._call_time)

    def view(self, logical: int) -> KeyedView:
        return KeyedView(self)

    def live_rows(self) -> np.ndarray:
        """The rows holding keys, as ``[k, 2]`` ranges (an every-row sweep goes over these)."""
        if self._live_rows is None:
            live = np.concatenate([[False], self._live(), [False]]).astype(np.int8)
            edges = np.flatnonzero(np.diff(live))
            self._live_rows = edges.reshape(-1, 2).astype(np.int64)
        return self._live_rows

    def rows_for(
        self,
        logical: int,
        ids: np.ndarray,
        insert: bool = True,
        counts: np.ndarray | None = None,
        found: np.ndarray | None = None,
        touched: bool = False,
        victims: np.ndarray | None = None,
        forget: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> np.ndarray:
        """Rows of ``ids``; -1 for a key without a row.

        ``insert=False`` (evaluation) changes nothing: a key without a row, or whose row has
        expired, is -1. ``insert=True`` (a training lookup; ``ids`` distinct, ``counts`` their
        occurrences in the batch, 1 each if None) runs the step's rules (``DynamicVocabulary``):
        expiry, admission, eviction for ``max_rows``, the new keys' rows (``insert_on=
        "lookup"``), recency and counts. A batch needing more than ``max_rows`` rows is a
        ValueError naming the table, raised before anything changes. ``found``: what the index
        gives ``ids`` now, when a kernel probed it already (``lookup_index``); ``touched``: the
        kernel found a live row for every id and touched them (``IndexView``). ``victims``:
        the rows ``max_rows`` evicts, decided by the caller for a table sharded over ranks
        (``room_needs``, ``shared_room``, ``eviction_candidates``), which refused a batch
        needing more than ``max_rows`` rows already; this table then evicts those.
        ``forget``: the pending keys to forget and the new ones not to count, decided so too
        (``shared_pending``, ``pending_candidates``), with or without keys waiting here."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        expired = self._expired()
        if victims is None and insert and touched and found is not None and not len(expired):
            # The kernel found a live row for every key and touched it (counts included), and
            # no row expires: no rule has anything to do (no key to admit, nothing to evict or
            # free). ``found`` itself is the answer (the batch copies it).
            found = np.asarray(found, dtype=np.int64)
            if (found < 0).any():
                raise AssertionError(f"table {self.name!r}: touched, but not every key was found")
            self._roll_stats()
            self._commit_time()
            self._resolved_step = self._step
            self._this["lookups"] += len(ids)
            self._this["hits"] += len(ids)
            return found
        if not insert:
            return self._rows_now(ids, found)
        counts = (
            np.ones(len(ids), np.int64) if counts is None else np.asarray(counts, dtype=np.int64)
        )
        if counts.shape != ids.shape:
            raise ValueError(
                f"table {self.name!r}: {len(ids)} keys, but counts of shape {counts.shape}"
            )
        if (
            victims is None
            and found is None
            and not touched
            and self._admits_all_at_once(len(ids), len(expired))
        ):
            return self._find_or_insert(ids, counts)
        rows, admit, new = self._plan(ids, found)
        hit = rows >= 0
        missing = ~hit
        now = self.dynamic.insert_on == "lookup"
        if victims is None:
            self._refusal(int(hit.sum()), new, len(expired))
            victims = self._victims(rows[hit], len(expired), new)
        else:
            victims = self._given_victims(victims, rows[hit], len(expired), new)
        # Everything is decided; from here on the table changes.
        self._roll_stats()
        self._commit_time()
        self._resolved_step = self._step
        self._remove_rows(expired)
        self._this["expired"] += len(expired)
        self._remove_rows(victims)
        self._this["evicted"] += len(victims)
        if touched:
            if not hit.all():
                raise AssertionError(f"table {self.name!r}: touched, but not every key was found")
        else:
            self._touch(rows[hit], counts[hit])
        self._this["lookups"] += len(ids)
        self._this["hits"] += int(hit.sum())
        waiting = missing.copy()
        if now:
            waiting[np.flatnonzero(missing)[admit]] = False
            rows[np.flatnonzero(missing)[admit]] = self._insert(
                ids[missing][admit], counts[missing][admit]
            )
        self._this["filtered"] += int(missing.sum() - admit.sum())
        if self.dynamic.occurrence_threshold > 0 and (waiting.any() or forget is not None):
            self._this["forgotten"] += self._pending.add(
                ids[waiting], counts[waiting], self._step, forget
            )
            if not now and admit.any():  # their rows come at the update: keep their counts
                self._pending.hold(ids[missing][admit])
        return rows

    def _admits_all_at_once(self, n: int, expiring: int) -> bool:
        """Whether a training resolution of ``n`` distinct keys can only find or insert: every
        key is admitted at once (T = 0, inserting on lookup), no row expires, and even ``n``
        new rows would need no eviction (``max_rows``) and stay below the int32 row limit."""
        d = self.dynamic
        return (
            d.occurrence_threshold == 0
            and d.insert_on == "lookup"
            and not expiring
            and (d.max_rows is None or self._index.count + n <= d.max_rows)
            and self._high + n <= MAX_KEYED_ROWS
        )

    def _find_or_insert(self, ids: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """``rows_for``'s training resolution when it can only find or insert
        (``_admits_all_at_once``): one probe of each key finds its row (touched) or inserts it
        (``_resolve``); the same rows, records, index and stats as a find, then ``_touch``
        and ``_insert``."""
        self._roll_stats()
        self._commit_time()
        self._resolved_step = self._step
        self._expired_memo = None
        rows, new_at = self._resolve(ids, counts, absent=False)
        m, n = len(ids), len(new_at)
        self._this["lookups"] += m
        self._this["hits"] += m - n
        if self._keeps_time:  # the found rows' data time (the new ones got the call's)
            found = np.ones(m, bool)
            found[new_at] = False
            self._touch_time(rows[found])
        return rows

    def _resolve(
        self, ids: np.ndarray, counts: np.ndarray, absent: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """(the rows of ``ids``, distinct, and the places of the new ones among them): a found
        row is touched with its count; an absent key is inserted (a row, its record, its
        entry, its initial values: ``_written``), by one pass of
        ``kernels.keyed_index.find_or_insert``. Room is made as the pass needs it, the same way
        whatever else the batch holds: where the next new key finds no row left, the rows
        grow (``_grow``: doubling); where it would pass the index's load limit, the index is
        rebuilt (``KeyIndex.reserve``: doubling, or dropping tombstones). What the pass did
        so far is complete before either (the table stays whole if growing fails).
        ``absent``: every key is known to be absent (inserting only)."""
        from ..kernels import keyed_index

        m, index = len(ids), self._index
        rows = np.empty(m, np.int64)
        new_at = np.empty(m, np.int64)
        free, high = self._free, self._high
        ids, counts = frozen(ids), frozen(np.ascontiguousarray(counts, dtype=np.int64))
        values = self._values_first(ids, absent)
        # the pass's state (kernels.keyed_index.find_or_insert)
        state = np.zeros(6, np.int64)
        while True:
            state[4] = int(_MAX_LOAD * index.capacity) - index.count - index.tombs
            n0, used0, reused0 = int(state[1]), int(state[2]), int(state[5])
            done = keyed_index.find_or_insert(
                *index.columns(),
                ids,
                counts,
                free,
                high,
                self._capacity,
                self._rel_step,
                self._records,
                rows,
                new_at,
                state,
                absent,
            )
            n, used = int(state[1]), int(state[2])
            index.count += n - n0
            index.tombs -= int(state[5]) - reused0
            self._free, self._high = free[used:], high + int(state[3])
            at = new_at[n0:n]
            self._written(
                ids[at], rows[at], used == used0, None if values is None else values[n0:n]
            )
            if done == m:
                return rows, new_at[:n]
            if not len(self._free) and self._high >= self._capacity:
                self._grow(self._high + 1)
            index.reserve(index.count + 1)

    def _values_first(self, ids: np.ndarray, absent: bool) -> np.ndarray | None:
        """The initial weights of the keys of ``ids`` a ``_resolve`` pass will insert (the
        absent ones, in order), computed and checked before the pass changes anything, for an
        initializer whose values can be refused (``FromFunction``: non-finite values, or values
        past a 16-bit range; in a 16-bit table, any without a bound known when the table is
        built (``initial_bound``: a RowId's values are the keys); None for the others, whose
        values are checked when the table is built. Asked after the pass, a refusal left the
        batch's new keys in the index with rows of zeros (slots too), never initialised
        again."""
        unbounded = self._dtype != np.float32 and initial_bound(self._initializer, self.dim) is None
        if not isinstance(self._initializer, FromFunction) and not unbounded:
            return None
        keys = ids if absent else ids[self._index.find(ids) < 0]
        first, self._first_values = self._first_values, None
        if not len(keys):
            return None
        if first is not None and np.array_equal(first[0], keys):
            return first[1]  # computed and checked by check_rows for this batch
        values = self._initializer.init(self._seed, self.name, keys, self.dim)
        check_initial(
            self.name, self.weights_dtype, values, "its initializer", ids=keys, label="key"
        )
        return values

    def lookup_index(self) -> IndexView:
        """What a kernel may probe in place of ``rows_for`` (``IndexView``): the numba backend
        probes every key of a lookup-only batch in its pooling region, and a training batch's
        unique keys right after their deduplication (then ``rows_for(found=, touched=)``)."""
        expired = self._expired()
        dead = None
        if len(expired):
            dead = np.zeros(self._capacity, dtype=np.uint8)
            dead[expired] = 1
        # Touching needs the call's data time when the table keeps one: left to rows_for.
        touch = not self._keeps_time
        return IndexView(
            self._index.slots,
            self._index.row_bits,
            self._records,
            dead,
            touch,
            self._rel_step,
            refuses=self.dynamic.max_rows is not None,
            rows_left=MAX_KEYED_ROWS - self._high,
        )

    def rows_of(self, keys: np.ndarray) -> np.ndarray:
        """The rows ``keys`` hold in the index now, -1 for none: no rule runs and nothing
        changes (a sharded update finds the rows its step's lookup resolved)."""
        return self._index.find(np.ascontiguousarray(keys, dtype=np.int64))

    def keys_at(self, rows: np.ndarray) -> np.ndarray:
        """The keys of live ``rows``."""
        return self._keys[np.asarray(rows, dtype=np.int64)]

    def check_rows(
        self,
        logical: int,
        ids: np.ndarray,
        counts: np.ndarray | None = None,
        found: np.ndarray | None = None,
        update: bool = False,
    ) -> None:
        """Raise the ValueError that ``rows_for(logical, ids, True, counts=, found=)`` would
        raise (``max_rows``, the int32 row limit), changing nothing: the engine checks every
        table of a batch before any ``rows_for`` changes one, so a batch that one table refuses
        leaves every table as it was. ``update``: the batch's update follows at once (an
        update of a batch never looked up), so a table inserting on apply counts the keys it
        admits then as new too. A table inserting on apply always counts them so: its training
        lookup refuses the batch its update would refuse, before the lookup changes any table
        (counts, recency, other tables' rows), when no other update comes between them. With
        two lookups before their updates, the second update runs at a later step: it admits
        the keys counted since (``occurrence_threshold``) and may keep rows an earlier update
        evicted, so ``check_update_rows`` may refuse it then, nothing changed
        (``DynamicVocabulary``'s max_rows rule). Nothing to check for a table that cannot
        refuse it. A 16-bit table whose initializer has no bound also refuses an admitted key's
        initial value past its range (``_checked_values``)."""
        del counts  # admission reads the earlier steps' counts only
        checked = self._checked_values()
        if (
            not checked
            and self.dynamic.max_rows is None
            and self._high + len(ids) <= MAX_KEYED_ROWS
        ):
            return
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        update = update or self.dynamic.insert_on == "apply"
        rows, admit, new = self._plan(ids, found, update)
        self._refusal(int((rows >= 0).sum()), new, len(self._expired()))
        if checked:
            self._check_values(ids[rows < 0][admit])

    def _checked_values(self) -> bool:
        """Whether ``check_rows`` checks the initial values of the keys a batch admits, so
        that a refused value changes no table of the batch (in ``_resolve`` alone, the other
        tables' new keys were in already): a FromFunction's (non-finite values, or past a
        16-bit range), or in a 16-bit table an initializer's without a bound known when the
        table is built (``initial_bound``; a RowId's values are the keys)."""
        if isinstance(self._initializer, FromFunction):
            return True
        return self._dtype != np.float32 and initial_bound(self._initializer, self.dim) is None

    def _check_values(self, keys: np.ndarray) -> None:
        """ValueError naming the table (and the key) if an initial value of ``keys`` is
        refused. A FromFunction may give other values at each call: its values are kept for
        the resolution that follows (``_values_first``), so it is called once a batch."""
        self._first_values = None
        if not len(keys):
            return
        values = self._initializer.init(self._seed, self.name, keys, self.dim)
        check_initial(
            self.name, self.weights_dtype, values, "its initializer", ids=keys, label="key"
        )
        if isinstance(self._initializer, FromFunction):
            self._first_values = (keys.copy(), values)

    def _rows_now(self, ids: np.ndarray, found: np.ndarray | None) -> np.ndarray:
        """The rows of ``ids`` (int64, contiguous) in the index now (``found``: what a kernel's
        probe gave them), -1 for none or an expired one."""
        rows = self._index.find(ids) if found is None else np.array(found, dtype=np.int64)
        expired = self._expired()
        if len(expired):
            rows[np.isin(rows, expired)] = NO_ROW
        return rows

    def _plan(
        self, ids: np.ndarray, found: np.ndarray | None, update: bool = False
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """What a training resolution of ``ids`` decides, for ``rows_for`` and ``check_rows``
        alike: (their rows now, which of those without one are admitted, how many rows it
        inserts now: the admitted ones when inserting on lookup, or with ``update`` (its
        update follows at once), else none)."""
        rows = self._rows_now(ids, found)
        admit = self._admissible(ids[rows < 0])
        now = self.dynamic.insert_on == "lookup" or update
        return rows, admit, int(admit.sum()) if now else 0

    def check_update_rows(self, logical: int, ids: np.ndarray, rows: np.ndarray) -> None:
        """Raise the ValueError that ``rows_for_update(logical, ids, rows)`` would raise,
        changing nothing (as ``check_rows``, for the update of a table inserting on apply);
        and a ValueError if a row the batch's lookup gave a key no longer holds it: a later
        training lookup (two lookups before their updates) evicted or expired it, and the
        update would write the key's gradient into another key's row."""
        self._check_rows_held(ids, rows)
        if self.dynamic.insert_on != "apply":
            return
        missing = np.flatnonzero(np.asarray(rows) < 0)
        if not len(missing):
            return
        checked = self._checked_values()
        if (
            not checked
            and self.dynamic.max_rows is None
            and self._high + len(missing) <= MAX_KEYED_ROWS
        ):
            return
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        hits, admit, _, new, gone = self._update_plan(ids, np.asarray(rows), missing)
        self._refusal(len(hits), new, len(gone))
        if checked:
            self._check_values(ids[missing][admit])

    def _update_plan(
        self,
        ids: np.ndarray,
        rows: np.ndarray,
        missing: np.ndarray,
        expire_for_room: bool | None = None,
    ):
        """What an update inserting on apply decides, for ``rows_for_update`` and
        ``check_update_rows`` alike, of ``ids`` whose lookup gave ``rows`` (``missing``: the
        places without one): (the rows it keeps, which missing keys it admits, which of them
        an earlier update of the step inserted, how many it inserts, the expired rows it
        removes first: ``_expired_for_room``'s, or with ``expire_for_room`` given (a sharded
        table's, decided over every owner) every expired row not kept if True, none if
        False)."""
        admit, present = self._admitted_on_apply(ids[missing])
        hits, new = self._kept_on_update(ids, rows), int(admit.sum())
        if expire_for_room is None:
            gone = self._expired_for_room(hits, new)
        elif expire_for_room:
            expired = self._expired()
            gone = expired[~np.isin(expired, hits)]
        else:
            gone = np.zeros(0, np.int64)
        return hits, admit, present, new, gone

    def _expired_for_room(self, hits: np.ndarray, new: int) -> np.ndarray:
        """The expired rows an update inserting ``new`` rows removes first (``hits``: the rows
        of its keys, kept): none unless the new rows would pass ``max_rows`` (expired rows are
        otherwise removed by the next training lookup), else every expired row not in
        ``hits``: an expired row no eviction may pick still counts until it is removed, and
        the table passed max_rows when new rows came in before the next lookup removed them."""
        n = self.dynamic.max_rows
        expired = self._expired()
        if n is None or self._index.count + new <= n or not len(expired):
            return np.zeros(0, np.int64)
        return expired[~np.isin(expired, hits)]

    def _check_rows_held(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """ValueError if any of ``rows`` (>= 0) has lost its key of ``ids`` (``check_update_
        rows``). Only a table that removes rows (expiry, max_rows) can lose one."""
        d = self.dynamic
        if d.expire_steps is None and d.expire_seconds is None and d.max_rows is None:
            return
        rows = np.asarray(rows, dtype=np.int64)
        held = rows >= 0
        ids = np.asarray(ids)
        if not held.all():
            rows, ids = rows[held], ids[held]
        # One gather of whole records (key, step, count): the rows' lines, read once.
        records = np.take(self._records, rows, axis=0)
        lost = (records[:, _TOUCHES] < 0) | (records.view(np.int64)[:, 0] != ids)
        if lost.any():
            raise ValueError(
                f"table {self.name!r}: {int(lost.sum()):,} of this batch's keys (e.g. "
                f"{int(ids[lost][0])}) lost their rows after its lookup: a later training "
                "lookup, or an update inserting on apply, evicted or expired them, and their "
                "rows may hold other keys now; nothing was changed. Apply a batch's gradients "
                "before the next training lookup (or raise max_rows / expire_steps)"
            )

    def _kept_on_update(self, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The rows an update inserting on apply keeps for its batch (``ids``, whose lookup
        gave ``rows``): the lookup's rows, and the rows an earlier update of the step gave
        keys the lookup found without one (two lookups before their updates). Both are the
        batch's: no eviction may pick them, and they count against ``max_rows``."""
        rows = np.asarray(rows, dtype=np.int64)
        kept = rows[rows >= 0]
        if len(kept) == len(rows):
            return kept
        found = self._index.find(np.ascontiguousarray(ids[rows < 0], dtype=np.int64))
        return np.concatenate([kept, found[found >= 0]])

    def _admitted_on_apply(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(admitted now and without a row, has a row): of keys without a row at the lookup,
        which an update inserting on apply inserts, and which an earlier update of the step
        inserted already."""
        present = self._index.find(keys) >= 0
        return self._admissible(keys) & ~present, present

    def rows_for_update(
        self,
        logical: int,
        ids: np.ndarray,
        rows: np.ndarray,
        counts: np.ndarray | None = None,
        victims: np.ndarray | None = None,
        expire_for_room: bool = False,
    ) -> np.ndarray:
        """The rows to update for ``ids`` (the batch's unique keys, ``rows`` as the lookup gave
        them): with ``insert_on="apply"`` the admitted keys without a row get one now (initial
        values, evicting for ``max_rows`` first); otherwise ``rows`` unchanged. ``victims``
        and ``expire_for_room``: what a ShardedEngine decided over every owner of the table
        (``shared_room``): the rows to evict, and whether the expired rows go first (else
        ``_expired_for_room`` decides both here); called so on every owner, with or without
        keys of the step."""
        if self.dynamic.insert_on != "apply":
            return rows
        missing = np.flatnonzero(np.asarray(rows) < 0)
        if not len(missing) and victims is None:
            self.commit_update_time()
            return rows
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        counts = (
            np.ones(len(ids), np.int64) if counts is None else np.asarray(counts, dtype=np.int64)
        )
        shared = victims is not None
        hits, admit, present, new, gone = self._update_plan(
            ids, np.asarray(rows), missing, expire_for_room if shared else None
        )
        if not shared:
            self._refusal(len(hits), new, len(gone))
            victims = self._victims(hits, len(gone), new)
        else:
            victims = self._given_victims(victims, hits, len(gone), new)
        self._roll_stats()
        self._commit_time()
        self._remove_rows(gone)
        self._this["expired"] += len(gone)
        self._remove_rows(victims)
        self._this["evicted"] += len(victims)
        out = np.array(rows, dtype=np.int64)
        out[missing[admit]] = self._insert(ids[missing][admit], counts[missing][admit])
        out[missing[present]] = self._index.find(ids[missing][present])
        return out

    # -- the rules ---------------------------------------------------------------------------

    def _expired(self) -> np.ndarray:
        """Live rows not touched for more than ``expire_steps`` steps, or whose data time is
        more than ``expire_seconds`` behind the call's (``_now``), ascending (read-only).
        Computed once per step, data time and state of the rows: a scan of every row's
        metadata costs milliseconds on millions of rows."""
        when = (self._step, self._now())
        memo = self._expired_memo
        if memo is None or memo[0] != when:
            self._expired_memo = memo = (when, frozen(self._scan_expired()))
        return memo[1]

    def _scan_expired(self) -> np.ndarray:
        """``_expired()``, computed."""
        s, d = self.dynamic.expire_steps, self.dynamic.expire_seconds
        now = self._now()
        by_time = d is not None and now != NO_TIME
        if (s is None and not by_time) or not self._index.count:
            return np.zeros(0, np.int64)
        from ..kernels import keyed_index

        out = np.empty(self._high, np.int64)
        n = keyed_index.expired_rows(
            self._records,
            self._high,
            self._rel_step,
            -1 if s is None else s,
            self._time if by_time else _NO_TIMES,
            now,  # timestamps are < 2^62: ``now - t`` does not overflow
            d if by_time else -1,
            out,
        )
        return out[:n].copy()

    def _check_room(self, new: int, freed: int) -> None:
        """ValueError (nothing changed yet) if ``new`` rows, after ``freed`` rows are freed,
        would take rows past MAX_KEYED_ROWS (the index keeps int32 rows)."""
        fresh = new - min(new, len(self._free) + freed)
        if self._high + fresh > MAX_KEYED_ROWS:
            raise ValueError(
                f"table {self.name!r}: {self._high + fresh:,} rows, more than one keyed table "
                f"holds in one engine ({MAX_KEYED_ROWS:,}, 2^31 - 1: its index keeps int32 "
                "rows); nothing was changed. Shard the table over ranks (ShardedEngine) or set "
                "max_rows"
            )

    def _admissible(self, keys: np.ndarray) -> np.ndarray:
        """Which keys without a row are admitted now (occurrences before this step >= T)."""
        t = self.dynamic.occurrence_threshold
        if t == 0:
            return np.ones(len(keys), bool)
        return self._pending.counts_before(keys, self._step) >= t

    def _refusal(self, hits: int, new: int, expiring: int) -> None:
        """ValueError (nothing changed yet) if a batch whose keys have ``hits`` rows, of which
        ``new`` more are admitted now, after ``expiring`` rows expire, needs more than
        ``max_rows`` rows, or would take rows past MAX_KEYED_ROWS (``_check_room``, after the
        evictions ``_victims`` would make)."""
        n = self.dynamic.max_rows
        victims = 0
        if n is not None:
            if hits + new > n:
                raise max_rows_refusal(self.name, hits, new, n)
            victims = max(0, self._index.count - expiring + new - n)
        self._check_room(new, expiring + victims)

    def _victims(self, batch_rows: np.ndarray, expiring: int, new: int) -> np.ndarray:
        """The rows to evict so that ``new`` rows fit within ``max_rows`` after ``expiring``
        rows expire (the caller checked that the batch fits: ``_refusal``)."""
        n = self.dynamic.max_rows
        if n is None:
            return np.zeros(0, np.int64)
        excess = self._index.count - expiring + new - n
        if excess <= 0:
            return np.zeros(0, np.int64)
        cand = self._candidates(batch_rows)
        return cand[_smallest(self._eviction_order(cand), excess)]

    def _candidates(self, batch_rows: np.ndarray) -> np.ndarray:
        """The rows an eviction may pick: live, not the batch's, not expired (ascending)."""
        cand = self._live()
        cand[batch_rows] = False
        cand[self._expired()] = False
        return np.flatnonzero(cand)

    def _eviction_order(self, rows: np.ndarray) -> list[np.ndarray]:
        """The columns ``rows`` are evicted by, most significant first, int64: the step each
        was last touched (absolute, so shards compare alike) and its key ("lru"); its touch
        count before both ("lfu"). Keys are distinct, so the order is total."""
        cols = [self._last[rows].astype(np.int64) + self._base, self._keys[rows]]
        if self.dynamic.eviction == "lfu":
            cols.insert(0, self._touches[rows].astype(np.int64))
        return cols

    # -- max_rows over the shards of a table (ShardedEngine) -------------------------------

    def room_needs(
        self, ids: np.ndarray, rows: np.ndarray | None = None, found: np.ndarray | None = None
    ) -> np.ndarray:
        """What a training resolution of ``ids`` (distinct) on this shard asks of
        ``max_rows`` and of the pending keys' bound, changing nothing: int64 ``[held, kept,
        new, admitted, expired, pending, waiting, candidates]``, the rows held now, the keys
        of ``ids`` that keep a row, the rows the resolution inserts, the keys it admits
        (inserted now, or by the update when inserting on apply) and the expired rows it may
        remove (not kept); then (a training lookup with an occurrence threshold, else 0) the
        keys pending when it counts the waiting ones (the admitted ones left), the waiting
        keys not pending yet, and the pending keys it may forget (``_Pending.add``).
        ``rows``: for the update of a table inserting on apply, ``ids``' rows as the step's
        lookup gave them (new = admitted: the keys the update inserts). ``found``: what the
        index gives ``ids`` now (``rows_of``), probed once by the caller for every call of the
        step's decision. ``shared_room`` and ``shared_pending`` sum every shard's into the
        table's decisions."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        expired = self._expired()
        pend = [0, 0, 0]
        if rows is None:
            found, admit, new = self._plan(ids, found)
            kept, admitted, gone = int((found >= 0).sum()), int(admit.sum()), len(expired)
            if self.dynamic.occurrence_threshold > 0:
                waiting, leaving = self._waiting(ids, found, admit)
                held = self._pending.index.find(waiting) >= 0
                pending = len(self._pending) - len(leaving)
                pend = [pending, int((~held).sum()), pending - int(held.sum())]
        else:
            rows = np.asarray(rows, dtype=np.int64)
            admit, _ = self._admitted_on_apply(ids[rows < 0])
            hits = self._kept_on_update(ids, rows)
            kept, new = len(hits), int(admit.sum())
            admitted, gone = new, int((~np.isin(expired, hits)).sum())
        return np.array([self._index.count, kept, new, admitted, gone, *pend], dtype=np.int64)

    def _waiting(
        self, ids: np.ndarray, rows: np.ndarray, admit: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(the keys of ``ids`` a training lookup counts as pending, the pending keys it
        admits and inserts now, which leave the pending counts first), of ``_plan``'s
        ``rows`` and ``admit``, as ``rows_for`` takes them."""
        missing = ids[rows < 0]
        if self.dynamic.insert_on != "lookup":
            return missing, np.zeros(0, np.int64)
        now = missing[admit]
        return missing[~admit], now[self._pending.index.find(now) >= 0]

    def pending_candidates(
        self, ids: np.ndarray, k: int, found: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(order, keys): the first ``k`` pending keys of this shard that a training lookup of
        ``ids`` may forget (not waiting in it, not admitted by it), keys not held first, then
        seen longest ago, then smaller keys (``_Pending.add``'s rule), and their order columns
        (int64 ``[m, 3]``: held, step last seen, key): the table forgets the first of every
        shard's together
        (``shared_victims``). ``found``: as ``room_needs``."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        rows, admit, _ = self._plan(ids, found)
        waiting, leaving = self._waiting(ids, rows, admit)
        p = self._pending
        live = p._live_slots()
        busy = p.index.find(np.concatenate([waiting, leaving]))
        live = live[~np.isin(live, busy[busy >= 0])]
        return _first_in_order([p.held[live], p.step[live], p.key[live]], k, p.key[live])

    def pending_surplus(
        self, ids: np.ndarray, k: int, found: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(order, keys): the ``k`` largest keys of ``ids`` that a training lookup would start
        counting as pending (waiting, not pending yet), largest first, and their order
        column (int64 ``[m, 1]``: ``~key``): when every shard's pending keys together are
        forgotten and the step's new ones still pass the bound, the table leaves the largest
        of every shard's new keys uncounted (``_Pending.add``'s rule, ``shared_victims``).
        ``found``: as ``room_needs``."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        rows, admit, _ = self._plan(ids, found)
        waiting, _ = self._waiting(ids, rows, admit)
        new = np.sort(waiting[self._pending.index.find(waiting) < 0])[::-1][:k]
        return (~new)[:, None], new

    def eviction_candidates(
        self,
        ids: np.ndarray,
        k: int,
        rows: np.ndarray | None = None,
        found: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(order, rows): the first ``k`` rows of this shard in eviction order (``_victims``'
        candidates for a batch of the distinct keys ``ids``, whose rows are ``rows`` for an
        update inserting on apply, else the index's now), and their order columns
        (``_eviction_order``, int64 ``[m, columns]``): the table's ``k`` victims are the
        first ``k`` of every shard's together (``shared_victims``). ``found``: as
        ``room_needs``."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if rows is None:
            kept = self._rows_now(ids, found)
            kept = kept[kept >= 0]
        else:
            kept = self._kept_on_update(ids, rows)
        cand = self._candidates(kept)
        return _first_in_order(self._eviction_order(cand), k, cand)

    def _given_victims(self, victims: np.ndarray, kept: np.ndarray, expiring: int, new: int):
        """``victims`` (rows a ShardedEngine picked over every shard) checked against this
        shard: live rows outside the batch that have not expired, as ``_victims`` picks; and
        the int32 row limit (``_check_room``) after them."""
        victims = np.asarray(victims, dtype=np.int64)
        if len(victims) and not np.isin(victims, self._candidates(kept)).all():
            raise AssertionError(f"table {self.name!r}: an eviction picked a row it may not")
        self._check_room(new, expiring + len(victims))
        return victims

    def _touch(self, rows: np.ndarray, counts: np.ndarray) -> None:
        from ..kernels import keyed_index

        self._expired_memo = None
        offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        keyed_index.touch(
            frozen(np.ascontiguousarray(rows, dtype=np.int64)),
            frozen(offsets),
            self._rel_step,
            self._records,
        )
        self._touch_time(rows)

    def _touch_time(self, rows: np.ndarray) -> None:
        """The call's data time on touched ``rows`` (a table that keeps data time): the newest
        timestamp that touched a row; an older call does not age it."""
        if self._keeps_time and self._call_time is not None:
            self._time[rows] = np.maximum(self._time[rows], self._call_time)

    def _remove_rows(self, rows: np.ndarray) -> None:
        if not len(rows):
            return
        rows, self._free = _release(self._index, self._free, rows)
        self._records[rows, _TOUCHES] = -1
        self._live_rows = self._expired_memo = None

    def _insert(self, keys: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Rows for new ``keys`` (distinct, absent): smallest free rows first, initial weights
        (the initializer at each key) and slots; the keys leave the pending counts
        (``_resolve``)."""
        if not len(keys):
            return np.zeros(0, np.int64)
        rows, new_at = self._resolve(
            np.ascontiguousarray(keys, dtype=np.int64), counts, absent=True
        )
        if len(new_at) != len(keys):
            raise AssertionError(f"table {self.name!r}: keys to insert were in the index")
        return rows

    def _written(
        self, keys: np.ndarray, rows: np.ndarray, one_run: bool, values: np.ndarray | None = None
    ) -> None:
        """The new ``rows`` of ``keys``, indexed and recorded: their initial values (``values``
        if given: ``_values_first``) and data time; the keys leave the pending counts.
        ``one_run``: the rows are consecutive (all from the high-water mark), written through
        slices, not fancy indexing."""
        if not len(keys):
            return
        where = slice(int(rows[0]), int(rows[0]) + len(rows)) if one_run else rows
        self._initialise_rows(rows, keys, where, values)
        if self._keeps_time:
            self._time[where] = NO_TIME if self._call_time is None else self._call_time
        if self.dynamic.occurrence_threshold > 0:
            self._pending.forget(keys)
        self._live_rows = self._expired_memo = None
        self._this["admitted"] += len(keys)

    def _initialise_rows(self, rows: np.ndarray, keys: np.ndarray, where, values=None) -> None:
        """New ``rows`` of ``keys``: the initializer's weights at each key, each slot's initial
        value. An initializer with a fill kernel (``Initializer.fill``) and the slots are
        written row by row in one parallel pass (``kernels.init.init_rows``); any other
        initializer's values are computed first (or given: ``values``), then copied in (at
        ``where``: ``rows``, or the slice they make when they are one run)."""
        from ..initializers import table_key
        from ..kernels import init as ki
        from ..kernels.pool import start_pool

        if self._dtype != np.float32:  # 16-bit columns: the values rounded to nearest
            self._initialise_half_rows(keys, where, values)
            return
        fill = self._initializer.fill(self.dim)
        constant = self._initializer.constant() if fill is None else None
        data = self._data
        if fill is None and constant is None:
            if values is None:
                values = self._initializer.init(self._seed, self.name, keys, self.dim)
            data[where, : self.dim] = values
            if not self.slot_specs:
                return
        cols = [
            (self.columns[s.name].start, self.columns[s.name].width, s.dtype == "int32")
            for s in self.slot_specs
        ]
        values = [s.initial_value for s in self.slot_specs]
        if constant is not None:  # the weights as one more constant column
            cols.append((0, self.dim, False))
            values.append(constant)
        consts = np.array(cols, dtype=np.int64).reshape(-1, 3)
        # the int32 columns' values (Adam's per-row steps); 0 beside a float column's
        ints = [int(v) if is_int else 0 for v, (_, _, is_int) in zip(values, cols, strict=True)]
        kinds = {None: ki.FILL_NONE, "uniform": ki.FILL_UNIFORM}
        kinds["truncated_normal"] = ki.FILL_TRUNCATED_NORMAL
        start_pool()  # init_rows is parallel
        ki.init_rows(
            data,
            data.view(np.int32),
            frozen(np.ascontiguousarray(rows, dtype=np.int64)),
            frozen(keys),
            kinds[None if fill is None else fill.kind],
            table_key(self._seed, self.name),
            0.0 if fill is None else float(fill.a),
            0.0 if fill is None else float(fill.b),
            self.dim,
            frozen(consts),
            frozen(np.array(values, dtype=np.float32)),
            frozen(np.array(ints, dtype=np.int32)),
        )

    def _initialise_half_rows(self, keys: np.ndarray, where, values=None) -> None:
        """``_initialise_rows`` of a 16-bit table: the initializer's float32 values (or
        ``values``) and each slot's initial value, rounded to nearest into their columns
        (``where``: the rows, or their slice), as a dense 16-bit table's initial values are
        (they are not updates)."""
        data = self._data
        if values is None:  # given (``_values_first``) for an initializer without a bound
            # a built-in initializer's bound was checked when the table was built
            values = self._initializer.init(self._seed, self.name, keys, self.dim)
            check_initial(
                self.name, self.weights_dtype, values, "its initializer", ids=keys, label="key"
            )
        column_view(data, self.columns[WEIGHTS])[where] = values
        for spec in self.slot_specs:
            column_view(data, self.columns[spec.name])[where] = spec.initial_value

    # -- observability ---------------------------------------------------------------------------

    @staticmethod
    def _zero_counts() -> dict[str, int]:
        return dict.fromkeys(KEYED_COUNTERS, 0)

    def _roll_stats(self) -> None:
        """Start this step's counters at the step's first training resolution (the last
        step's go into the totals)."""
        if self._stats_step != self._step:
            for k, v in self._this.items():
                self._total[k] += v
            self._stats_step = self._step
            self._this = self._zero_counts()

    def stats(self) -> dict:
        """rows, capacity, load factor (rows / capacity), bytes (index, rows, row metadata,
        pending counts), pending keys, data time (None: no timestamp yet), and the counters
        (admitted, filtered: lookups of keys not admitted; evicted: for max_rows; expired;
        forgotten: pending keys dropped at the bound; lookups and hits of unique keys in
        training lookups) of the last step that trained the table (``this_step``, with its
        ``step``) and in total; hit rate = hits / lookups in total."""
        total = {k: self._total[k] + self._this[k] for k in self._total}
        return {
            "kind": self.storage,
            "rows": self._index.count,
            "capacity": self._capacity,
            "load_factor": self._index.count / self._capacity if self._capacity else 0.0,
            "pending_keys": self.pending_keys,
            "data_time": self.data_time,
            "bytes": {
                "rows": self.nbytes,
                "index": self._index.nbytes,
                "row_metadata": self._records_bytes() + self._time.nbytes + self._free.nbytes,
                "pending": self._pending.nbytes,
            },
            "step": self._stats_step,
            "this_step": dict(self._this),
            "total": total,
            "hit_rate": total["hits"] / total["lookups"] if total["lookups"] else 0.0,
        }

    def contents(self) -> dict[str, np.ndarray]:
        """``keys`` (int64, sorted) and copies of ``weights`` and every slot, aligned with them."""
        rows = self._rows_by_key()
        takes = self._per_key(rows, (WEIGHTS, *self.slot_names))
        return {"keys": self._keys[rows], **{k: take(0, len(rows)) for k, _, _, take in takes}}

    def _per_key(self, rows: np.ndarray, names) -> list[tuple[str, tuple, np.dtype, object]]:
        """For each of ``names`` (weights, slots, the rows' metadata entries of
        ``embengine.state``): (name, shape, dtype, ``take(lo, hi)``), where ``take`` gives the
        entry of the keys ``lo:hi`` of ``rows`` (the rows in key order), a new array."""

        def column(view: np.ndarray):
            return lambda lo, hi: view[rows[lo:hi]]

        def meta(name: str):
            if name == "last_touched":
                return lambda lo, hi: self._last[rows[lo:hi]].astype(np.int64) + self._base
            if name == "touch_counts":
                return lambda lo, hi: self._touches[rows[lo:hi]].astype(np.int64)
            if self._keeps_time:  # last_time
                return lambda lo, hi: self._time[rows[lo:hi]]
            return lambda lo, hi: np.full(hi - lo, NO_TIME, np.int64)

        n, out = len(rows), []
        for name in names:
            if name in self.columns:  # weights, a slot: in its stored dtype
                view = column_view(self._data, self.columns[name])
                out.append((name, (n, view.shape[1]), view.dtype, column(view)))
            else:
                out.append((name, (n,), np.dtype(np.int64), meta(name)))
        return out

    # -- state: what checkpoints hold ----------------------------------------------------------

    def state(self, lazy: bool = False) -> dict[str, np.ndarray]:
        """The table's state (``embengine.state``: keys, rows with their slots, last-touched
        steps, touch counts, pending admissions, counters), copies taken at one moment (the
        caller holds the engine's lock): weights and slots come from the one row array, so
        they are of one step. ``lazy``: the per-key entries but ``keys`` are ``GatheredRows``,
        gathered in key order when read (a checkpoint writes them a chunk at a time), valid
        while the table does not change."""
        rows = self._rows_by_key()
        names = (WEIGHTS, *self.slot_names, "last_touched", "touch_counts", "last_time")
        out = {"keys": self._keys[rows]}
        for name, shape, dtype, take in self._per_key(rows, names):
            out[name] = GatheredRows(shape, dtype, take) if lazy else take(0, len(rows))
        out["data_time"] = np.array([self._clock], np.int64)
        p = self._pending
        live = p._live_slots()
        live = live[np.argsort(p.key[live], kind="stable")]
        out["pending_keys"] = p.key[live].copy()
        out["pending_earlier"] = p.earlier[live].copy()
        out["pending_step"] = p.step[live].copy()
        out["pending_current"] = p.current[live].copy()
        this = [min(self._this[k], MAX_COUNT) for k in KEYED_COUNTERS]
        total = [min(self._total[k], MAX_COUNT) for k in KEYED_COUNTERS]
        out["counters"] = np.array([this, total], np.int64)
        out["meta"] = np.array([self._stats_step, p.limit], np.int64)
        return out

    def _rows_by_key(self) -> np.ndarray:
        """The rows holding keys, in key order."""
        rows = np.flatnonzero(self._live())
        return rows[np.argsort(self._keys[rows], kind="stable")]

    def _records_bytes(self) -> int:
        """The memory the records take: the pages of the rows written so far (reserved
        records cost nothing until written), or the whole array if it is not a reservation."""
        if self._records_map is None:
            return self._records_full.nbytes
        page = mmap.PAGESIZE
        return -(-self._high * 4 * _RECORD_COLS // page) * page

    @property
    def _last(self) -> np.ndarray:
        """Each row's last-touched step, from ``_base`` (a view of the records)."""
        return self._records[:, _LAST]

    @property
    def _touches(self) -> np.ndarray:
        """Each row's touch count, -1 for a row without a key (a view of the records)."""
        return self._records[:, _TOUCHES]

    @property
    def _keys(self) -> np.ndarray:
        """Each row's key (a view of the records)."""
        return self._index.keys[:, 0]

    def _live(self) -> np.ndarray:
        """Whether each row below the high-water mark holds a key."""
        return self._touches[: self._high] >= 0

    def prepare_state(self, entries: dict, step: int, at: str):
        """Read and check a state (``state()``'s entries, arrays or TensorSources whose names,
        shapes and dtypes ``state.check_state`` checked) for the engine's ``step``; returns a
        function that installs it. Nothing changes until it is called: a bad state is a
        ValueError naming the entry (``at[entry]``) and the value, as is a source that cannot be
        read. The rules (``dynamic``, ``max_pending``) are the engine's: a state with more
        rows than ``max_rows`` is refused; pending keys past ``max_pending`` are forgotten,
        seen longest ago first. The keys and metadata are read whole (40 bytes a key) and
        checked here; rows (weights, slots) given as TensorSources are read by the install,
        chunk by chunk, straight into the new arena, so a table is never held twice: a read
        that fails there is its OSError / ValueError, the table part new (``load_state_dict``
        says so: ``PartialLoadError``)."""
        wanted = [WEIGHTS, *self.slot_names, *keyed_entries(self.dim, [])]
        missing = [k for k in dict.fromkeys(wanted) if k not in entries]
        if missing:
            raise ValueError(f"{at} has no {missing}: a keyed table's state is loaded whole")
        rows = {WEIGHTS, *self.slot_names}
        a = {}
        for k, v in entries.items():
            if isinstance(v, TensorSource) and k in rows:
                a[k] = v  # read by _install, into the new arena
            elif isinstance(v, TensorSource):
                out = np.empty(tuple(v.shape), np.dtype(v.dtype).newbyteorder("="))
                try:
                    v.read_into(out)
                except (OSError, ValueError) as e:
                    raise ValueError(
                        f"{at}[{k!r}] cannot be read ({e}); nothing was changed"
                    ) from e
                a[k] = out
            else:
                a[k] = np.asarray(v)
        _check_keyed_state(a, self.dynamic.max_rows, step, at)
        staged = self._stage(a, step)
        return lambda: self._install(staged, a)

    def _stage(self, a: dict[str, np.ndarray], step: int) -> KeyedTable:
        """Everything a checked state needs that can fail, made before the table changes: a
        shallow copy of the table given a fresh arena (an anonymous mapping; keyed-mmap: the
        file grown, never shrunk, and mapped again), row records, index, pending counts and
        counters. Each is a new object, so building them changes nothing here; a growth the
        system refuses is its OSError / MemoryError naming the table, the table as it was.
        ``_install`` swaps them in and copies the rows, which cannot fail."""
        staged = copy.copy(self)
        staged._resolved_step = -1
        n = len(a["keys"])
        staged._empty_arena()
        staged._grow(max(n, min(_FIRST_CAPACITY, staged._reserved)))
        staged._high, staged._free, staged._live_rows = n, np.zeros(0, np.int64), None
        staged._expired_memo = None
        # int32 metadata (_rebase): steps from a base the step is at most _STEP_SPAN past,
        # counts saturated
        staged._step = int(step)
        staged._base = max(0, staged._step - _STEP_SPAN)
        last = a["last_touched"].astype(np.int64) - staged._base
        staged._records[:n, _LAST] = np.clip(last, _INT32.min, _INT32.max)
        staged._records[:n, _TOUCHES] = np.minimum(a["touch_counts"], _INT32.max)
        if staged._keeps_time:
            staged._time[:n] = a["last_time"]
        staged._clock, staged._call_time = int(a["data_time"][0]), None
        staged._index.insert(a["keys"], np.arange(n, dtype=np.int64))
        # The engine's bound, not the state's meta[1] (the rules are the engine's): pending
        # keys past it are forgotten as the bound forgets them, seen longest ago first, then
        # smaller keys, and counted as forgotten
        pending = _Pending(self._pending.limit)
        keep = newest_pending(a["pending_keys"], a["pending_step"], pending.limit)
        p = int(keep.sum())
        pending.high = p
        if p > len(pending.earlier):
            for name in ("earlier", "step", "current", "held"):
                setattr(pending, name, np.zeros(p, np.int64))
        pending.earlier[:p] = a["pending_earlier"][keep]
        pending.step[:p] = a["pending_step"][keep]
        pending.current[:p] = a["pending_current"][keep]
        pending.index.insert(a["pending_keys"][keep], np.arange(p, dtype=np.int64))
        staged._pending = pending
        staged._this = dict(zip(KEYED_COUNTERS, map(int, a["counters"][0]), strict=True))
        staged._total = dict(zip(KEYED_COUNTERS, map(int, a["counters"][1]), strict=True))
        forgotten = staged._total["forgotten"] + len(keep) - p
        staged._total["forgotten"] = min(forgotten, MAX_COUNT)
        staged._stats_step = int(a["meta"][0])
        return staged

    def _install(self, staged: KeyedTable, a: dict) -> None:
        """Replace the table's contents by a staged state (``_stage``): its arena, records,
        index and counts swapped in (the old arena is released with its last views), then
        rows 0..n-1 copied in key order into reserved memory or file blocks, from arrays or
        read from TensorSources chunk by chunk (a failed read is its OSError / ValueError,
        the table part new)."""
        self.__dict__.update(staged.__dict__)
        n = len(a["keys"])
        data = self._data
        targets = [(k, column_view(data, self.columns[k])[:n]) for k in (WEIGHTS, *self.slot_names)]
        with self.sequential_access():
            for name, out in targets:
                if isinstance(a[name], TensorSource):
                    a[name].read_into(out)
                else:
                    out[...] = a[name]

    @property
    def slot_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.slot_specs)


def max_rows_refusal(name: str, hits: int, new: int, n: int) -> ValueError:
    """The error of a batch needing more than ``max_rows`` rows (``hits`` keys with rows,
    ``new`` admitted now), raised before anything changes."""
    return ValueError(
        f"table {name!r}: this batch needs {hits + new:,} rows ({hits:,} of its keys have "
        f"rows, {new:,} are admitted now), more than max_rows={n:,}; nothing was changed. "
        "Raise max_rows or send smaller batches"
    )


def shared_room(name: str, needs: np.ndarray, max_rows: int, update: bool) -> tuple[int, bool]:
    """A sharded table's ``max_rows`` decision from every shard's ``room_needs`` (``needs``:
    ``[shards, 5]``), the single table's rule on the sums: (how many rows to evict, whether
    the expired rows go first). A training lookup removes its expired rows anyway and
    refuses a batch needing more than ``max_rows`` rows (kept + admitted, so a table
    inserting on apply refuses at its lookup what its update would); an update inserting
    on apply removes the expired rows only when its new rows would pass ``max_rows``
    (``_expired_for_room``). Raises ``max_rows_refusal`` (the same on every rank)."""
    held, kept, new, admitted, expired = (int(x) for x in np.asarray(needs).sum(axis=0))
    if kept + admitted > max_rows:
        raise max_rows_refusal(name, kept, admitted, max_rows)
    first = not update or held + new > max_rows
    return max(0, held - (expired if first else 0) + new - max_rows), first


def shared_pending(needs: np.ndarray, limit: int) -> tuple[int, int]:
    """A sharded table's pending-key bound from every shard's ``room_needs`` pending columns
    (``needs``: ``[shards, 3]``: pending, waiting, candidates), ``_Pending.add``'s rule on
    the sums: (how many pending keys to forget, seen longest ago first; how many of the
    step's new keys, the largest, not to count) to stay within ``limit``. As one table, it
    forgets nothing when no key of the step waits (the pending keys it holds, ``pending -
    candidates``, and the new ones), even past a ``limit`` lowered since."""
    pending, waiting, candidates = (int(x) for x in np.asarray(needs).sum(axis=0))
    excess = pending + waiting - limit
    if excess <= 0 or waiting + pending - candidates == 0:
        return 0, 0
    return min(excess, candidates), max(0, excess - candidates)


def shared_victims(orders: list[np.ndarray], k: int, shard: int) -> np.ndarray:
    """Which of shard ``shard``'s candidates (``orders[shard]``, from its
    ``eviction_candidates``) are among the first ``k`` of every shard's together (positions
    into them): a table's evictions over its shards, as one table picks them (the keys make
    the order total, so every shard decides alike)."""
    if k <= 0:
        return np.zeros(0, np.int64)
    mats = [np.asarray(o, dtype=np.int64) for o in orders]  # [candidates, columns] each
    cat = np.concatenate(mats)
    owner = np.concatenate([np.full(len(m), s, np.int64) for s, m in enumerate(mats)])
    place = np.concatenate([np.arange(len(m), dtype=np.int64) for m in mats])
    first = np.lexsort(cat.T[::-1])[:k]
    return np.sort(place[first[owner[first] == shard]])


def newest_pending(keys: np.ndarray, steps: np.ndarray, limit: int) -> np.ndarray:
    """Which of the pending ``keys`` (last seen at ``steps``) stay within ``limit``: all, or the
    ``limit`` last seen, ties to larger keys (``_Pending.add``'s rule), as a mask."""
    keep = np.ones(len(keys), bool)
    if len(keys) > limit:
        keep[np.lexsort((keys, steps))[: len(keys) - limit]] = False
    return keep


def _first_bad(bad: np.ndarray) -> int | None:
    """The first index where ``bad`` holds, or None."""
    hits = np.flatnonzero(bad)
    return int(hits[0]) if len(hits) else None


def _check_keyed_state(a: dict[str, np.ndarray], max_rows: int | None, step: int, at: str) -> None:
    """The values of a keyed table's state (``embengine.state``) for an engine at ``step``:
    keys and pending keys sorted and distinct and apart, counts and steps in range, at most
    ``max_rows`` rows. A ValueError names the entry, the position and the value."""
    for name in ("keys", "pending_keys"):
        k = a[name]
        i = _first_bad(k[1:] <= k[:-1])
        if i is not None:
            what = (
                "appears twice" if k[i + 1] == k[i] else "comes after the larger key " + str(k[i])
            )
            raise ValueError(
                f"{at}[{name!r}]: key {k[i + 1]} at position {i + 1} {what}; keys must be sorted "
                "and distinct (as state_dict() writes them)"
            )
    n = len(a["keys"])
    if n > MAX_KEYED_ROWS:
        raise ValueError(
            f"{at}['keys'] holds {n:,} rows, more than one keyed table holds in one engine "
            f"({MAX_KEYED_ROWS:,}, 2^31 - 1); load it into a ShardedEngine"
        )
    if max_rows is not None and n > max_rows:
        raise ValueError(
            f"{at}['keys'] holds {n:,} rows, more than the table's max_rows={max_rows:,}; "
            "raise max_rows (DynamicVocabulary) to load it"
        )
    both = np.intersect1d(a["keys"], a["pending_keys"])
    if len(both):
        raise ValueError(
            f"{at}['pending_keys']: key {both[0]} has a row too (in {at}['keys']); "
            "a key waiting for admission has no row"
        )
    for name, lo, hi in (
        ("last_touched", 0, step),
        ("pending_step", 0, step),
        ("touch_counts", 0, None),
        ("pending_earlier", 0, None),
        ("pending_current", 0, None),
        ("counters", 0, MAX_COUNT),
    ):
        v = a[name].reshape(-1)
        i = _first_bad((v < lo) | (v > hi if hi is not None else False))
        if i is not None:
            bound = f"in [{lo}, {hi}] (the step is {step})" if hi is not None else f">= {lo}"
            where = f"[{i}]"
            if name == "counters":  # [2, 7]: this step's, then the totals
                row, col = divmod(i, len(KEYED_COUNTERS))
                where = f"[{row}][{col}] ({('this step', 'total')[row]} {KEYED_COUNTERS[col]!r})"
                bound = f"in [0, {MAX_COUNT:,}] (2^62 - 1: the stats counters saturate there)"
            raise ValueError(f"{at}[{name!r}]{where} is {v[i]}; it must be {bound}")
    clock = int(a["data_time"][0])
    if clock != NO_TIME and not 0 <= clock < MAX_TIMESTAMP:
        raise ValueError(
            f"{at}['data_time'][0] is {clock}; it must be in [0, 2^62) or "
            f"{NO_TIME} (no timestamp yet)"
        )
    t = a["last_time"]
    i = _first_bad((t != NO_TIME) & ((t < 0) | (t > clock)))
    if i is not None:
        raise ValueError(
            f"{at}['last_time'][{i}] is {t[i]}; it must be in [0, {clock}] (the table's data "
            f"time) or {NO_TIME} (not touched with a timestamp)"
        )
    stats_step, limit = (int(x) for x in a["meta"])
    if not -1 <= stats_step <= step:
        raise ValueError(
            f"{at}['meta'][0] (the step of the counters) is {stats_step}; it must "
            f"be in [-1, {step}] (the step is {step})"
        )
    if not 0 <= limit <= MAX_KEYED_ROWS:  # what the max_pending setter takes
        raise ValueError(
            f"{at}['meta'][1] (max_pending) is {limit}; it must be in [0, {MAX_KEYED_ROWS:,}] "
            "(a load keeps the engine's own max_pending)"
        )
