"""Checkpoints of a ShardedEngine's keyed tables, in the single engine's keyed format.

A keyed table's file holds the tensors ``EmbeddingEngine`` writes (``embengine.state``: the keys
sorted, each key's weights, slots, last-touched step, touch count and data time aligned with
them; the pending keys sorted with their counts; counters, meta, data time), so a plain engine
loads it and a ShardedEngine of any world size loads a plain engine's.

Saving (collective): every rank gathers every rank's keys (8 bytes a key; the same for the
pending keys), which fixes each key's place in the sorted file. Rank ``q`` writes the places
``[n q / W, n (q + 1) / W)``, a window of at most ``CHUNK_BYTES`` of rows at a time: in each
round every rank gathers from its arena the rows it owns in every writer's window
(``KeyedTable.state(lazy=True)``) and sends them (one ``all_to_all_single`` of rows and one of
their int64 metadata), and each writer writes its window of each tensor with ``pwrite``; so a
rank holds its keys and a few chunks, never its shard's rows twice. The counters are every
rank's summed, meta and data time rank 0's (the ranks agree on them: every owner runs a
table's rules when any runs them).

Restoring (collective): every rank reads the keys and pending keys whole, keeps those it owns
(``mix64(key) mod W``; past the table's ``max_pending``, of the pending keys the newest, as
one table keeps them, every rank reading their steps whole too) and their metadata, checked
by the table's own checks (``KeyedTable.prepare_state``), and the table's ``max_rows``
against every key (the bound is the table's, not a shard's); the install reads their rows
chunk by chunk straight into the new arena. The summed counters go to rank 0 (the ranks' stats add
up to the saved ones, and the pending keys forgotten past ``max_pending``).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .. import checkpoint as ckpt
from ..safetensors_io import BFLOAT16, CHUNK_BYTES, DTYPES
from ..state import KEYED_COUNTERS, WEIGHTS, keyed_entries
from ..storage.keyed import MAX_COUNT, KeyedTable, newest_pending
from .comm import Comm
from .sharding import mix64

__all__ = ["KeyedLayout", "layout", "manifest_entry", "prepare", "write"]

# Per-key entries besides the row (weights and slots), and per-pending-key entries.
_ROW_META = ("last_touched", "touch_counts", "last_time")
_PENDING = ("pending_earlier", "pending_step", "pending_current")


def _call(fn: Callable, *args):
    """``fn(*args)``: a ``run`` that keeps no error (``KeyedLayout``)."""
    return fn(*args)


class KeyedLayout:
    """One keyed table's checkpoint file as this rank sees it while saving: its state
    (``state()``), the sorted keys of every rank (``keys``, ``pending``), where each of this
    rank's keys and pending keys lands in them, and the tensors (name, entry, shape, dtype).
    This rank's work between the collectives runs through ``run`` (``checkpoint.Writes.run``:
    after a failure it returns None and runs nothing more, and this rank sends no keys and
    zero counters), so that a rank failing here still makes every collective."""

    def __init__(self, comm: Comm, shard: KeyedTable, run: Callable = _call):
        self.shard = shard
        # rows gathered by write, a window at a time
        self.state = run(shard.state, True) or {}
        none = np.zeros(0, np.int64)
        self.keys, self.place = _places(comm, self.state.get("keys", none), run)
        self.pending, self.pending_place = _places(comm, self.state.get("pending_keys", none), run)
        mine = self.state.get("counters")
        if mine is None:
            mine = np.zeros((2, len(KEYED_COUNTERS)), np.int64)
        counters = comm.all_gather(mine, "checkpoint")
        run(self._describe, counters)

    def _describe(self, counters: np.ndarray) -> None:
        """The summed ``counters`` of every rank and the file's tensors (``__init__``)."""
        shard = self.shard
        # summed exactly (Python ints) and saturated as one table's (storage.keyed.MAX_COUNT)
        total = np.minimum(counters.astype(object).sum(axis=0), MAX_COUNT)
        self.counters = total.astype(np.int64)
        slots = [(s.name, s.width, s.dtype) for s in shard.slot_specs]
        sizes = {"n": len(self.keys), "p": len(self.pending)}
        # The order EmbeddingEngine's state gives (the table's own ``state``: keys, weights,
        # slots, the rows' metadata, data time, ...), so the file is the plain engine's
        entries = keyed_entries(shard.dim, slots, shard.weights_dtype, shard.slots_dtype)
        order = list(self.state)
        self.tensors = [
            (
                shard.name if k == WEIGHTS else f"{shard.name}/{k}",
                k,
                tuple(sizes.get(d, d) for d in entries[k][0]),
                np.dtype(entries[k][1]),
            )
            for k in order
        ]

    def header(self) -> tuple[bytes, dict[str, int]]:
        """The file's safetensors header and each entry's first byte in the file."""
        head, offset, starts = {}, 0, {}
        for name, entry, shape, dtype in self.tensors:
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            head[name] = {
                "dtype": DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            starts[entry] = offset
            offset += nbytes
        head["__metadata__"] = {"table": self.shard.name}
        raw = json.dumps(head, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        start = 8 + len(raw)
        return struct.pack("<Q", len(raw)) + raw, {k: start + v for k, v in starts.items()}

    def size(self) -> int:
        head, _ = self.header()
        return len(head) + sum(
            int(np.prod(s, dtype=np.int64)) * d.itemsize for _, _, s, d in self.tensors
        )


def _places(comm: Comm, mine: np.ndarray, run: Callable = _call) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's sorted keys ``mine`` merged (sorted), and where each of ``mine`` is in it
    (the merge through ``run``: empty arrays once it failed)."""
    every = comm.all_gather_ragged(np.asarray(mine, dtype=np.int64), "checkpoint keys")
    got = run(_merge, every, comm.rank, len(mine))
    return got if got is not None else (np.zeros(0, np.int64), np.zeros(0, np.int64))


def _merge(every: list[np.ndarray], rank: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``_places``: every rank's keys ``every`` sorted, and where rank ``rank``'s ``n`` are."""
    allk = np.concatenate(every) if every else np.zeros(0, np.int64)
    order = np.argsort(allk, kind="stable")
    where = np.empty(len(allk), dtype=np.int64)
    where[order] = np.arange(len(allk), dtype=np.int64)
    first = sum(len(e) for e in every[:rank])
    return allk[order], where[first : first + n]


def layout(comm: Comm, shard: KeyedTable, run: Callable = _call) -> KeyedLayout:
    """Collective: the layout of ``shard``'s table in a checkpoint (see ``KeyedLayout``;
    ``run``: how this rank's work between the collectives runs)."""
    return KeyedLayout(comm, shard, run)


def manifest_entry(lay: KeyedLayout) -> dict:
    """The manifest's ``keyed`` entry of the table (as ``checkpoint.save`` writes it)."""
    c = lay.counters
    return {
        "rows": len(lay.keys),
        "pending_keys": len(lay.pending),
        "times": True,
        "total": {k: int(c[0, i] + c[1, i]) for i, k in enumerate(KEYED_COUNTERS)},
    }


def _block(n: int, world: int, rank: int) -> tuple[int, int]:
    return n * rank // world, n * (rank + 1) // world


def _send_to_writers(
    comm: Comm, place: np.ndarray, n: int, values: np.ndarray, what: str
) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``values`` (one per ``place``, ascending) to the ranks writing their places; this
    rank's block: (its places' values in place order, its [lo, hi))."""
    world = comm.world_size
    bounds = np.array([_block(n, world, r)[0] for r in range(world)] + [n])
    to = np.searchsorted(bounds, place, side="right") - 1
    send_counts = np.bincount(to, minlength=world)[:world]
    lo, hi = _block(n, world, comm.rank)
    return _send_windows(comm, place, send_counts, values, lo, hi, what), np.array([lo, hi])


def _send_windows(
    comm: Comm,
    place: np.ndarray,
    send_counts: np.ndarray,
    values: np.ndarray,
    lo: int,
    hi: int,
    what: str,
) -> np.ndarray:
    """Rows ``values`` (one per ``place``; ``send_counts[r]`` of them, in rank order, for rank
    ``r``'s window) to the ranks writing them; this rank's window ``[lo, hi)`` of places: its
    places' values in place order."""
    recv = comm.all_gather(send_counts, what)[:, comm.rank]
    width = values.shape[1] if values.ndim == 2 else 1
    got = comm.all_to_all(values.reshape(-1), send_counts * width, recv * width, what)
    places = comm.all_to_all(place, send_counts, recv, what)
    out = np.empty((hi - lo, width), dtype=values.dtype)
    out[places - lo] = got.reshape(-1, width)
    return out


def _gather(entry, ends: np.ndarray) -> np.ndarray:
    """Rows ``a:b`` of an entry (an array or GatheredRows) for each ``[a, b)`` of ``ends``,
    concatenated."""
    return np.concatenate([entry[int(a) : int(b)] for a, b in ends])


def _bytes(rows: np.ndarray) -> np.ndarray:
    """Rows of an entry as their bytes, uint8 ``[rows, row bytes]``."""
    rows = np.ascontiguousarray(rows)
    return rows.reshape(rows.shape[0], int(np.prod(rows.shape[1:]))).view(np.uint8)


def write(comm: Comm, lay: KeyedLayout, path: Path, writes) -> bool:
    """Collective: write this rank's block of the keyed table's file (made at full size with
    its header by rank 0), a window of at most ``CHUNK_BYTES`` of rows a round, through
    ``writes`` (``checkpoint.Writes``: a failed write, or any error of what this rank computes
    between the exchanges, stops this rank's writing, not its part in the exchanges: it then
    sends zeros); whether its weights and float slots were all finite."""
    shard, st = lay.shard, lay.state
    _, starts = lay.header()
    world, n, p = comm.world_size, len(lay.keys), len(lay.pending)
    lo, hi = _block(n, world, comm.rank)
    blocks = np.array([_block(n, world, r) for r in range(world)], np.int64).reshape(-1, 2)
    # A row travels as the bytes of its weights and slots in their stored dtypes (16-bit
    # tables: no upcast), each entry's from ``at[entry]`` of the row's bytes.
    row_entries = (WEIGHTS, *(s.name for s in shard.slot_specs))
    dtypes = {entry: dtype for _, entry, _, dtype in lay.tensors}
    widths = {WEIGHTS: shard.dim, **{s.name: s.width for s in shard.slot_specs}}
    at, width = {}, 0  # each entry's first byte in a row; bytes a row
    for e in row_entries:
        at[e], width = width, width + widths[e] * dtypes[e].itemsize
    step = max(1, CHUNK_BYTES // (width + 8 * len(_ROW_META)))
    rounds = -(-int((blocks[:, 1] - blocks[:, 0]).max(initial=0)) // step)
    finite = True
    fd = writes(path, os.open, path, os.O_WRONLY)
    try:

        def put(entry: str, block: np.ndarray, first: int) -> None:
            writes.run(_put, fd, block, starts[entry], first, writes, path)

        put("keys", lay.keys[lo:hi], lo)
        for i in range(rounds):  # every rank the same number: collectives
            # each writer's window this round, and the range of this rank's keys placed in
            # each (its places ascend with its sorted keys)
            first = blocks[:, :1] + np.array([i * step, (i + 1) * step])
            windows = np.minimum(first, blocks[:, 1:])
            ends = np.searchsorted(lay.place, windows)
            counts = ends[:, 1] - ends[:, 0]
            # this rank's rows and their metadata (read from its shard: a lazy state reads
            # a file-backed one), or zeros once this rank failed
            sent = writes.run(_round_rows, st, ends, row_entries, _ROW_META)
            if sent is None:
                n_sent = int(counts.sum())
                sent = np.zeros((n_sent, width), np.uint8), np.zeros((n_sent, len(_ROW_META)))
            rows, meta = sent[0], sent[1].astype(np.int64)
            place = np.concatenate([lay.place[a:b] for a, b in ends])
            wlo, whi = (int(x) for x in windows[comm.rank])
            got_rows = _send_windows(comm, place, counts, rows, wlo, whi, "checkpoint")
            got_meta = _send_windows(comm, place, counts, meta, wlo, whi, "checkpoint")
            for e in row_entries:
                dtype = dtypes[e]
                part = got_rows[:, at[e] : at[e] + widths[e] * dtype.itemsize]
                part = writes.run(lambda p, d: np.ascontiguousarray(p).view(d), part, dtype)
                if part is None:  # this rank failed: it writes nothing more
                    continue
                if dtype.kind == "f" or dtype == BFLOAT16:
                    finite &= writes.run(_finite, part) is not False
                put(e, part, wlo)
            for j, k in enumerate(_ROW_META):
                put(k, got_meta[:, j], wlo)
        pend = writes.run(lambda: np.stack([st[k] for k in _PENDING], axis=1).astype(np.int64))
        if pend is None:
            pend = np.zeros((len(lay.pending_place), len(_PENDING)), np.int64)
        got_pend, (plo, phi) = _send_to_writers(comm, lay.pending_place, p, pend, "checkpoint")
        put("pending_keys", lay.pending[plo:phi], plo)
        for i, k in enumerate(_PENDING):
            put(k, got_pend[:, i], plo)
        if comm.rank == 0:
            put("counters", lay.counters.astype(np.int64), 0)
            put("meta", st["meta"], 0)
            put("data_time", st["data_time"], 0)
        with comm.pacer("syncing the checkpoint's files"):  # a while, on a slow file system
            writes(path, os.fsync, fd)
    finally:
        if fd is not None:
            os.close(fd)
    return finite


def _round_rows(st, ends: np.ndarray, row_entries, meta_entries) -> tuple[np.ndarray, np.ndarray]:
    """A round's rows of a keyed table's state ``st`` (``ends``: the ranges of its rows for
    each writer) as bytes, ``[rows, row bytes]``, and their metadata ``[rows, len(meta)]``
    (``write``)."""
    rows = np.concatenate([_bytes(_gather(st[e], ends)) for e in row_entries], axis=1)
    return rows, np.stack([_gather(st[k], ends) for k in meta_entries], axis=1)


def _finite(part: np.ndarray) -> bool:
    """Whether a float entry's values (float32, float16 or bfloat16) are all finite."""
    return bool(np.isfinite(part.astype(np.float32)).all())


def _put(fd, block: np.ndarray, start: int, first: int, writes, path: Path) -> None:
    """Write ``block`` (rows of an entry from row ``first``; its file's entry starts at byte
    ``start``) little-endian into ``path`` (``fd``) through ``writes``."""
    block = np.ascontiguousarray(block)
    row = block.nbytes // max(len(block), 1)
    data = block.astype(block.dtype.newbyteorder("<"), copy=False).tobytes()
    writes(path, os.pwrite, fd, data, start + first * row)


def _read_all(src) -> np.ndarray:
    """A whole (small) entry: an array, or a StoredTensor read into memory."""
    if isinstance(src, np.ndarray):
        return src
    out = np.empty(src.shape, np.dtype(src.dtype).newbyteorder("="))
    src.read_into(out)
    return out


class _KeptRows:
    """A TensorSource: rows ``keep`` (ascending) of a stored entry, read into ``out`` chunk
    by chunk by ``read_into`` (``KeyedTable.prepare_state`` leaves it to the install, which
    reads straight into the new arena)."""

    def __init__(self, src, keep: np.ndarray):
        self.src, self.keep = src, keep
        self.shape = (len(keep), *tuple(src.shape)[1:])
        self.dtype = np.dtype(src.dtype).newbyteorder("=")

    def read_into(self, out: np.ndarray) -> None:
        _read_rows(self.src, self.keep, out)


def _read_rows(src, keep: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Rows ``keep`` (ascending) of an entry, read chunk by chunk (at most ``CHUNK_BYTES`` at
    a time besides the rows kept) into ``out`` (a new array if None; a strided view of a
    table's arena is fine)."""
    if isinstance(src, np.ndarray):
        if out is None:
            return src[keep]
        out[...] = src[keep]
        return out
    meta, data_start = src.header
    first = data_start + meta[src.name]["data_offsets"][0]
    shape = tuple(src.shape)
    dtype = np.dtype(src.dtype)
    width = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    row_bytes = width * dtype.itemsize
    if out is None:
        out = np.empty((len(keep), *shape[1:]), dtype.newbyteorder("="))
    chunk = max(1, CHUNK_BYTES // max(1, row_bytes))
    with open(src.file, "rb") as f:
        done = 0
        while done < len(keep):
            a = int(keep[done])
            upto = int(np.searchsorted(keep, a + chunk))
            b = int(keep[upto - 1]) + 1
            buf = np.empty((b - a, *shape[1:]), dtype)
            f.seek(first + a * row_bytes)
            # as bytes: a memoryview has no format for ml_dtypes.bfloat16
            if f.readinto(memoryview(buf.reshape(-1).view(np.uint8))) != buf.nbytes:
                raise ckpt.CheckpointError(
                    f"{src.file}: tensor {src.name!r} ends early (changed while being read?); "
                    "restore again before using the engine"
                )
            out[done:upto] = buf[keep[done:upto] - a]
            done = upto
    return out


def prepare(comm: Comm, reader, shard: KeyedTable, step: int):
    """This rank's share of a keyed table of the checkpoint ``reader``: the keys it owns with
    their rows, checked by the table (``prepare_state``); returns the function that installs
    them. A CheckpointError names a bad entry; nothing changes until the install."""
    name, world = shard.name, comm.world_size
    sources = reader.state_dict()["tables"][name]

    def entry(k):
        return sources[k]

    keys = _read_all(entry("keys"))
    # max_rows bounds the whole table, not a shard: every rank reads every key, so every
    # rank refuses alike what one table refuses (each shard alone fit, and the next step
    # evicted the rows past the bound)
    bound = shard.dynamic.max_rows
    if bound is not None and len(keys) > bound:
        raise ckpt.CheckpointError(
            f"{reader.path}: table {name!r}['keys'] holds {len(keys):,} rows, more than the "
            f"table's max_rows={bound:,}; raise max_rows (DynamicVocabulary) to load it"
        )
    pending = _read_all(entry("pending_keys"))
    mine = np.flatnonzero((mix64(keys) % np.uint64(world)).astype(np.int64) == comm.rank)
    owned = (mix64(pending) % np.uint64(world)).astype(np.int64) == comm.rank
    # max_pending is the table's (set alike on every rank): past it the table's newest
    # pending keys stay, as one table's restore keeps them (KeyedTable._stage), each rank
    # its own of them; the forgotten ones counted on rank 0, which holds the counters
    dropped = 0
    if len(pending) > shard.max_pending:
        steps = _read_all(entry("pending_step"))
        if steps.shape == pending.shape:  # else prepare_state names the bad entry
            kept = newest_pending(pending, steps, shard.max_pending)
            owned &= kept
            dropped = int((~kept).sum())
    theirs = np.flatnonzero(owned)
    state = {"keys": keys[mine], "pending_keys": pending[theirs]}
    for k in (WEIGHTS, *[s.name for s in shard.slot_specs]):
        state[k] = _KeptRows(entry(k), mine)  # read by the install, into the arena
    for k in _ROW_META:
        state[k] = _read_rows(entry(k), mine)
    for k in _PENDING:
        state[k] = _read_rows(entry(k), theirs)
    for k in ("meta", "data_time"):
        state[k] = _read_all(entry(k))
    counters = _read_all(entry("counters"))
    if comm.rank == 0 and dropped and counters.shape == (2, len(KEYED_COUNTERS)):
        counters = counters.copy()
        at = KEYED_COUNTERS.index("forgotten")
        if 0 <= counters[1, at] <= MAX_COUNT:
            counters[1, at] = min(int(counters[1, at]) + dropped, MAX_COUNT)
    state["counters"] = counters if comm.rank == 0 else np.zeros_like(counters)
    try:
        return shard.prepare_state(state, step, f"{reader.path}: table {name!r}")
    except ValueError as e:
        raise ckpt.CheckpointError(str(e)) from e
