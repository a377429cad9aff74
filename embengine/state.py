"""An engine's state as arrays: what ``EmbeddingEngine.state_dict()`` returns and
``EmbeddingEngine.load_state_dict`` takes.

A state is::

    {"step": int,                                   # apply_gradients calls so far
     "learning_rates": {"tags": [{"tag", "callable"}, ...]},
     "tables": {table name: {"weights": array, slot name: array, ...}, ...}}

keyed by logical table (a packed table's rows are its own, from 0) and, within a table's arrays,
by logical row: row ``r`` is the table's id ``r``. ``weights`` is ``[vocabulary_size, dim]`` of
the table's stored dtype (``TableConfig.weights_dtype``: float32, float16 or
``ml_dtypes.bfloat16``); each optimizer slot (TF's slot names) is ``[vocabulary_size, width]`` of
the slot's stored dtype (``slots_dtype`` for float slots, int32 for step counters).
``load_state_dict`` takes exactly those dtypes: a value of another dtype is an error, never a
silent cast (cast it yourself with ``astype``).

A keyed table (``vocabulary_size=None``) has no row per id: its entry is ``KEYED_ENTRIES`` besides
``weights`` and the slots, a snapshot (copies, taken together under the engine's lock)::

    keys             int64 [n]         the keys with rows, sorted, distinct
    weights, slots   [n, dim], [n, w]  each key's row, aligned with ``keys``
    last_touched     int64 [n]         the step each row was last touched (expiry, LRU; exact
                                       up to 3 * 2^30 steps back, older ones read as newer)
    touch_counts     int64 [n]         its occurrences in training lookups so far (LFU;
                                       saturating at 2^31 - 1)
    last_time        int64 [n]         its data time: the newest timestamp that touched it
                                       (``expire_seconds``; int64 min: none)
    pending_keys     int64 [p]         keys waiting for admission, sorted, distinct, without rows
    pending_earlier  int64 [p]         their occurrences in steps before ``pending_step``
    pending_step     int64 [p]         the last step each was seen
    pending_current  int64 [p]         their occurrences in that step
    counters         int64 [2, 7]      ``KEYED_COUNTERS`` of the last step that trained the
                                       table, then the totals before it (each saturating
                                       at 2^62 - 1; a load refuses more)
    meta             int64 [2]         that step (-1: none yet), and ``max_pending`` (for
                                       information: a load keeps the engine's, forgetting
                                       the pending keys past it, seen longest ago first)
    data_time        int64 [1]         the table's data time (int64 min: no timestamp yet)

``n`` and ``p`` are each one length shared by their entries (``Expected`` writes them as the
strings "n" and "p"). Rows are loaded in key order into a fresh arena (the free rows of the
saved one are not kept): lookups, updates, eviction (ties broken by key) and stats counters
continue exactly as in the engine that saved them; capacity and bytes describe the new arena.

Learning rates hold no state of their own: a constant, a value the caller passes per step
(``DynamicLearningRate``) or a callable of the step, so the step restores the schedule. The
``learning_rates`` entry lists the engine's dynamic tags (and each callable's name) so that
``load_state_dict`` can refuse a state whose schedule has other tags.

``state_dict(lazy=True)`` gives a keyed table's per-key entries as ``GatheredRows`` instead:
rows gathered in key order when read, a chunk at a time, so ``save`` writes a keyed table with
one chunk's memory, not a copy of it (valid only while the table does not change: ``save``
holds the engine's lock while it writes them).

``load_state_dict`` accepts, where a state has arrays, any ``TensorSource`` too: an object with
``shape``, ``dtype`` and ``read_into(out)``, which fills ``out`` (the engine's own memory) itself.
A checkpoint restores through such sources (``checkpoint.StoredTensor``), chunk by chunk, so a
memory-mapped table bigger than RAM is never read into a second copy; a keyed table's rows
(weights and slots) are read straight into its new arena too, only its keys and metadata (40
bytes a key) whole, to be checked first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = [
    "KEYED_COUNTERS",
    "KEYED_ENTRIES",
    "MAX_STEP",
    "NO_TIME",
    "GatheredRows",
    "TIME_ENTRIES",
    "WEIGHTS",
    "PartialLoadError",
    "Stateful",
    "TensorSource",
    "check_int_slots",
    "check_state",
    "keyed_entries",
]

WEIGHTS = "weights"
# The largest step an engine holds: steps are int64 in the kernels (numba refuses a larger int,
# and ``step + 1``, Adam's and the frequency optimizers' 1-based step, wraps past it). A state or
# checkpoint may hold it; the training step that would count past it is refused.
MAX_STEP = 2**63 - 1
# A keyed table's stats counters, in the order of its state's ``counters`` rows.
KEYED_COUNTERS = ("admitted", "filtered", "evicted", "expired", "forgotten", "lookups", "hits")
# A keyed table's entries besides weights and slots: name -> (shape, dtype); see above.
KEYED_ENTRIES: dict[str, tuple[tuple, str]] = {
    "keys": (("n",), "int64"),
    "last_touched": (("n",), "int64"),
    "touch_counts": (("n",), "int64"),
    "last_time": (("n",), "int64"),
    "pending_keys": (("p",), "int64"),
    "pending_earlier": (("p",), "int64"),
    "pending_step": (("p",), "int64"),
    "pending_current": (("p",), "int64"),
    "counters": ((2, len(KEYED_COUNTERS)), "int64"),
    "meta": ((2,), "int64"),
    "data_time": ((1,), "int64"),
}
# The entries of data time (``expire_seconds``), and their value for "no timestamp seen".
# Keyed checkpoints written before them lack them and load as NO_TIME (checkpoint.py).
TIME_ENTRIES = ("last_time", "data_time")
NO_TIME = int(np.iinfo(np.int64).min)


def keyed_entries(
    dim: int,
    slots: list[tuple[str, int, str]],
    weights_dtype: str = "float32",
    slots_dtype: str = "float32",
) -> dict[str, tuple[tuple, np.dtype]]:
    """A keyed table's state entries: name -> (shape, dtype), "n" / "p" standing for the
    lengths of rows / pending keys; ``slots`` are the optimizer's (name, width, dtype); weights
    and float slots in their stored dtypes (``weights_dtype``, ``slots_dtype``)."""
    from .precision import numpy_dtype

    def stored(dtype: str) -> np.dtype:
        return numpy_dtype(slots_dtype) if dtype == "float32" else np.dtype(dtype)

    out = {WEIGHTS: (("n", dim), numpy_dtype(weights_dtype))}
    out.update({name: (("n", width), stored(dtype)) for name, width, dtype in slots})
    out.update({k: (shape, np.dtype(dtype)) for k, (shape, dtype) in KEYED_ENTRIES.items()})
    return out


class GatheredRows:
    """A read-only array of ``shape`` and ``dtype`` whose rows are made when read: ``take(lo,
    hi)`` returns rows ``lo:hi`` (e.g. a keyed table's rows in key order, gathered from its
    arena). Slicing rows (``g[lo:hi]``) calls it; ``np.asarray(g)`` makes the whole array.
    ``write_safetensors`` writes it chunk by chunk like an array, so a checkpoint of a table
    needs one chunk of memory beside it. Valid only while its source does not change."""

    def __init__(self, shape: tuple[int, ...], dtype, take):
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self._take = take

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: slice) -> np.ndarray:
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError(f"GatheredRows takes a slice of rows, got {rows!r}")
        lo, hi, _ = rows.indices(self.shape[0])
        out = np.asarray(self._take(lo, max(lo, hi)), dtype=self.dtype)
        expected = (max(0, hi - lo), *self.shape[1:])
        if out.shape != expected:  # a source's bug, never a silent short write
            raise AssertionError(f"GatheredRows: rows {lo}:{hi} came as {out.shape}")
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self[:]
        return out if dtype is None else out.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"GatheredRows(shape={self.shape}, dtype={self.dtype})"


@runtime_checkable
class TensorSource(Protocol):
    """An array ``load_state_dict`` does not hold in memory: it has ``shape`` and ``dtype`` (checked
    with every other entry before anything is copied) and ``read_into(out)``, which writes exactly
    ``out.shape`` values of ``out.dtype`` into ``out`` (a view of the engine's table, possibly
    strided) or raises OSError / ValueError."""

    shape: tuple[int, ...]
    dtype: np.dtype

    def read_into(self, out: np.ndarray) -> None: ...


class Stateful(Protocol):
    """What checkpoints use of an engine (EmbeddingEngine): its public state API only."""

    @property
    def step(self) -> int: ...

    def spec(self) -> dict[str, Any]: ...

    def state_dict(self, lazy: bool = False) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None: ...

    def sequential_access(self, table_name: str) -> contextlib.AbstractContextManager: ...


class PartialLoadError(RuntimeError):
    """``load_state_dict`` failed while copying, after every check had passed (a TensorSource's
    read failed): ``done`` tables and part of ``table`` hold the new values, the step is still
    ``step``. Load a complete state again before using the engine. The cause is chained."""

    def __init__(self, table: str, done: list[str], step: int, cause: BaseException):
        self.table, self.done, self.step = table, list(done), step
        super().__init__(
            f"load_state_dict failed while copying table {table!r} ({cause}) after every check "
            f"had passed. Tables {self.done} and part of {table!r} now hold the new values, the "
            f"step is still {step}: load a complete state again before using the engine"
        )


# An entry the engine expects: name -> (shape, dtype); a str dimension is a length every entry
# of the table that names it shares (a keyed table's rows "n" and pending keys "p").
Expected = dict[str, dict[str, tuple[tuple[int | str, ...], np.dtype]]]


def _describe(value: Any) -> str:
    return f"{type(value).__name__} of shape {getattr(value, 'shape', '?')}"


Copies = list[tuple[str, list[tuple[str, Any]]]]


def check_state(
    state: Any, expected: Expected, tag_is_callable: list[bool], strict: bool
) -> tuple[int | None, Copies]:
    """Check a state against the engine's tables (``expected``) and learning-rate tags (per tag,
    whether a callable drives it). Returns (the step, or None to keep the engine's; per table
    the (entry, array or TensorSource) pairs to copy), or raises TypeError / ValueError naming
    the entry. Nothing is read from a TensorSource.

    ``strict`` requires every table and every entry of each and the step; ``strict=False``
    leaves what the state lacks as it is. Names the engine does not have are errors either way
    (a misspelt name must not be silently skipped)."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict (from state_dict()), got {type(state).__name__}")
    unknown = [k for k in state if k not in ("step", "learning_rates", "tables")]
    if unknown:
        raise ValueError(
            f"state has unknown keys {unknown}; a state has 'step', 'learning_rates' and 'tables'"
        )
    step = state.get("step")
    if step is None:
        if strict:
            raise ValueError("state has no 'step' (strict=False keeps the engine's step)")
    elif (
        isinstance(step, bool | np.bool_)
        or not isinstance(step, int | np.integer)
        or not 0 <= step <= MAX_STEP
    ):
        # A step past int64 would reach the update kernels (numba: a TypeError per call).
        raise ValueError(f"state['step'] must be an int in [0, 2**63), got {step!r}")
    _check_learning_rates(state.get("learning_rates"), tag_is_callable, strict)
    tables = state.get("tables")
    if tables is None and not strict:
        tables = {}
    if not isinstance(tables, Mapping):
        raise TypeError(
            f"state['tables'] must be a dict of table name -> dict of arrays, got "
            f"{type(tables).__name__}"
        )
    extra = [n for n in tables if n not in expected]
    if extra:
        raise ValueError(f"state has unknown tables {extra}; the engine has {list(expected)}")
    missing = [n for n in expected if n not in tables]
    if missing and strict:
        raise ValueError(
            f"state has no entry for tables {missing} (strict=False leaves them as they are)"
        )
    copies = []
    for name, entries in expected.items():
        if name not in tables:
            continue
        given = tables[name]
        at = f"state['tables'][{name!r}]"
        if not isinstance(given, Mapping):
            raise TypeError(
                f"{at} must be a dict of entry name -> array, got {type(given).__name__}"
            )
        extra = [k for k in given if k not in entries]
        if extra:
            raise ValueError(
                f"{at} has unknown entries {extra}; table {name!r} has {list(entries)}"
            )
        lacking = [k for k in entries if k not in given]
        if lacking and strict:
            raise ValueError(f"{at} has no {lacking} (strict=False leaves them as they are)")
        pairs = []
        lengths: dict[str, tuple[int, str]] = {}  # a str dimension -> (its length, first entry)
        for key, (shape, dtype) in entries.items():
            if key not in given:
                continue
            value = given[key]
            if not isinstance(value, np.ndarray | TensorSource):
                raise TypeError(
                    f"{at}[{key!r}] must be a NumPy array or a TensorSource, got "
                    f"{type(value).__name__}"
                )
            got = tuple(value.shape)
            fits = len(got) == len(shape) and np.dtype(value.dtype) == dtype
            for size, want in zip(got, shape, strict=False):
                if isinstance(want, str):
                    first = lengths.setdefault(want, (size, key))
                    if first[0] != size and fits:
                        raise ValueError(
                            f"{at}[{key!r}] has {size} rows, {at}[{first[1]!r}] has {first[0]}: "
                            f"table {name!r}'s entries of length {want!r} must agree"
                        )
                elif size != want:
                    fits = False
            if not fits:
                shown = [d if isinstance(d, int) else f"<{d}>" for d in shape]
                raise ValueError(
                    f"{at}[{key!r}] is {np.dtype(value.dtype)} {list(got)}, table "
                    f"{name!r} holds {dtype} {shown}"
                )
            pairs.append((key, value))
        copies.append((name, pairs))
    return (None if step is None else int(step)), copies


def check_int_slots(
    copies: Copies, ranges: Mapping[tuple[str, str], tuple[int, int, str]]
) -> Copies:
    """The values of the int32 slots (step counters) among ``copies`` (``check_state``'s), each
    in ``ranges[(table, slot)]``: ``(lo, hi, whose)``, ``whose`` saying what holds it (its
    optimizer and step). A TensorSource is read here, whole (4 bytes a row), and its array
    copied in its place. A ValueError naming the table, slot, row (a keyed table's key) and
    value, before anything changes: a negative count or one past the step used to load and
    make the next update NaN (or wrap at 2**31 - 1)."""
    out = []
    for name, pairs in copies:
        checked = []
        for key, value in pairs:
            if (name, key) in ranges:
                lo, hi, _ = ranges[(name, key)]  # whose: int_slot_error's
                at = f"state['tables'][{name!r}][{key!r}]"
                value = _read_whole(value, at)
                bad = (value < lo) | (value > hi)
                if bad.any():
                    r, c = (int(i[0]) for i in np.nonzero(bad))
                    keys = dict(pairs).get("keys")
                    row = f"id {r}" if keys is None else f"key {_read_whole(keys, at)[r]}"
                    raise ValueError(
                        int_slot_error(name, key, row, value[r, c], at, (r, c), ranges)
                    )
            checked.append((key, value))
        out.append((name, checked))
    return out


def int_slot_error(
    table: str,
    slot: str,
    row: str,
    value: int,
    at: str,
    place: tuple[int, int],
    ranges: Mapping[tuple[str, str], tuple[int, int, str]],
) -> str:
    """``check_int_slots``' error text: int32 slot ``slot`` of ``table`` holds ``value`` at
    ``row`` ("id 3", "key 12"), ``at[place]``, outside ``ranges[(table, slot)]``."""
    lo, hi, whose = ranges[(table, slot)]
    return (
        f"table {table!r}: slot {slot!r} of {row} is {value} ({at}[{place[0]}, {place[1]}]), "
        f"out of range [{lo:,}, {hi:,}] ({whose}); nothing was changed. Load a state its "
        "engine saved, with its step (a state without 'step' keeps the engine's)"
    )


def _read_whole(value: Any, at: str) -> np.ndarray:
    """An array or TensorSource, as an array (a source read once)."""
    if not isinstance(value, TensorSource):
        return value
    out = np.empty(tuple(value.shape), np.dtype(value.dtype).newbyteorder("="))
    try:
        value.read_into(out)
    except (OSError, ValueError) as e:
        raise ValueError(f"{at} cannot be read ({e}); nothing was changed") from e
    return out


def _check_learning_rates(lrs: Any, tag_is_callable: list[bool], strict: bool) -> None:
    """The state's learning-rate tags must be the engine's: as many, each driven by a callable
    where the engine's is (its name may differ: a new process passes its own function)."""
    if lrs is None:
        return  # optional: the tags come from the configuration, not from the state
    tags = lrs.get("tags") if isinstance(lrs, Mapping) else None
    if not isinstance(tags, list) or not all(isinstance(t, Mapping) for t in tags):
        raise TypeError(
            f"state['learning_rates'] must be {{'tags': [{{'tag', 'callable'}}, "
            f"...]}}, got {lrs!r:.80}"
        )
    if not strict:
        return
    theirs = [t.get("callable") is not None for t in tags]
    if theirs != tag_is_callable:
        raise ValueError(
            f"state['learning_rates'] has {len(theirs)} dynamic tags (callables at "
            f"{[i for i, c in enumerate(theirs) if c]}), the engine has "
            f"{len(tag_is_callable)} (callables at "
            f"{[i for i, c in enumerate(tag_is_callable) if c]}); strict=False ignores them"
        )
