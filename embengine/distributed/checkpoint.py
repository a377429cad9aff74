"""Checkpoints of a ShardedEngine in embengine's checkpoint format, by logical row.

The format is ``embengine.checkpoint``'s: one safetensors file per logical table (tensors
``t`` and ``t/<slot>``, row r = id r) and a global manifest (the spec plus the checkpoint's
keys), so a checkpoint written at W ranks loads at any W', and into or from a plain
``EmbeddingEngine``. Keyed tables are written and read by key (``keyed_checkpoint``): the
same file a plain engine writes, each rank writing a block of the sorted keys.

Saving (collective; every rank must see the same folder, as on one host or a shared file
system): rank 0 makes the temporary folder (under the root's lock, as ``checkpoint.save``
does) and each table file with its header, at its full size; each rank finds that folder
by its name under its own root (a rank that does not, given another folder or not seeing
rank 0's, fails, and every rank with it: nothing is left). Each rank then writes one
contiguous block of rows of every table, ``[V r / W, V (r + 1) / W)``: per chunk of rows it
receives those rows from their owners (one ``all_to_all_single``, at most ``CHUNK_BYTES`` per
rank and round) and writes each tensor's part with ``pwrite``. Rank 0 then hashes the files,
writes the manifest and renames the folder into place (numbering and pruning under the root's
lock, as a single engine's save does). A rank whose work fails, with any error (a full disk, a
MemoryError, a KeyboardInterrupt), goes on with the exchanges without writing (``Writes``;
rank 0's failure travels in the folder's name instead), and every rank raises together: that
rank its own error, the others a CheckpointError (an error a save expects) or a PeerError
naming it and what it was doing; nothing is committed.

Restoring (collective): given a folder of checkpoints, every rank restores the newest that
rank 0 found there (by its name, in the rank's own folder), so that a save landing meanwhile
cannot give the ranks different ones. Every rank checks the whole checkpoint
(``checkpoint.read_checkpoint``)
and the configuration, then reads its own rows in chunks of rows (a whole table only where it
owns a whole table; row sharding interleaves rows, so each rank reads its tables' files once,
keeping its rows), so the extra memory is about one chunk. The ranks then check that they all
restored the same step.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import struct
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .. import checkpoint as ckpt
from ..precision import numpy_dtype
from ..safetensors_io import CHUNK_BYTES, DTYPES, sha256_file, write_safetensors
from ..state import WEIGHTS, int_slot_error
from ..storage.keyed import KeyedTable
from ..version import __version__
from . import keyed_checkpoint as kc
from .comm import Comm, PeerError
from .sharding import ShardPlan, ShardTable

__all__ = ["save", "restore"]


def _tensors(shard) -> list[tuple[str, str, int, int, np.dtype]]:
    """(tensor name, entry, first byte in a row of the row array, width, stored dtype) of a
    table's file, in file order: a tensor's values are the bytes ``[first, first + width *
    itemsize)`` of each row (``row_columns``: a 16-bit row too), as the file stores them."""
    unit = shard.data.dtype.itemsize
    out = []
    for entry in (WEIGHTS, *(spec.name for spec in shard.slot_specs)):
        col = shard.columns[entry]
        name = shard.name if entry == WEIGHTS else f"{shard.name}/{entry}"
        out.append((name, entry, col.start * unit, col.width, np.dtype(numpy_dtype(col.dtype))))
    return out


def _row_bytes(shard) -> np.ndarray:
    """The shard's row array as bytes, ``[rows, row bytes]``."""
    return shard.data.view(np.uint8)  # a C-contiguous [rows, width] row array


def _finite(values: np.ndarray) -> bool:
    """Whether a float tensor's values (float32, float16 or bfloat16) are all finite."""
    return bool(np.isfinite(values.astype(np.float32)).all())


def _header(shard, vocabulary_size: int) -> tuple[bytes, dict[str, int]]:
    """The safetensors header of a table's file (as ``write_safetensors`` writes it) and each
    tensor's first byte in the file."""
    header, offset, starts = {}, 0, {}
    for name, _, _, width, dtype in _tensors(shard):
        nbytes = vocabulary_size * width * dtype.itemsize
        header[name] = {
            "dtype": DTYPES[dtype],
            "shape": [vocabulary_size, width],
            "data_offsets": [offset, offset + nbytes],
        }
        starts[name] = offset
        offset += nbytes
    header["__metadata__"] = {"table": shard.name}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    data_start = 8 + len(raw)
    return struct.pack("<Q", len(raw)) + raw, {k: data_start + v for k, v in starts.items()}


def _block(vocabulary_size: int, world: int, rank: int) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of a table that ``rank`` writes."""
    return vocabulary_size * rank // world, vocabulary_size * (rank + 1) // world


def _owned_in(plan: ShardPlan, t: int, rank: int, lo: int, hi: int) -> np.ndarray:
    """The ids in ``[lo, hi)`` of table ``t`` that ``rank`` owns, ascending."""
    if plan.kinds[t] == "row":
        first = lo + (rank - lo) % plan.world_size
        return np.arange(first, hi, plan.world_size, dtype=np.int64)
    if plan.owners[t] == rank:
        return np.arange(lo, hi, dtype=np.int64)
    return np.zeros(0, dtype=np.int64)


# The errors a save expects of its work (a full disk, a bad extra tensor): the other ranks
# raise a CheckpointError. Any other (a MemoryError, a bug's RuntimeError, a
# KeyboardInterrupt) is shared alike, and the other ranks raise a PeerError naming the rank.
_SAVE_ERRORS = (OSError, ValueError, TypeError)
# What rank 0 sends for the name when its work failed with an error not in _SAVE_ERRORS (an
# expected one: nothing); a name never holds it.
_UNEXPECTED = b"\0"


def _name_from_rank0(
    comm: Comm, name: str | None, what: str, error: BaseException | None = None, doing: str = ""
) -> str:
    """Rank 0's string on every rank. None on rank 0 means it failed (``error``, which rank 0
    raises once the others know): every rank raises, a CheckpointError if the error is one a
    save expects (``_SAVE_ERRORS``), else a PeerError saying rank 0 failed while ``doing``."""
    mine = np.zeros(0, np.uint8)
    if comm.rank == 0:
        sent = (name or "").encode() if error is None or isinstance(error, _SAVE_ERRORS) else None
        mine = np.frombuffer(_UNEXPECTED if sent is None else sent, dtype=np.uint8)
    raw = comm.all_gather_ragged(mine, what)[0].tobytes()
    if error is not None:
        raise comm.alike(error)
    if raw == _UNEXPECTED:
        raise comm.alike(_peer_failed(comm, {0: doing}))
    if not raw:
        raise comm.alike(
            ckpt.CheckpointError(f"rank {comm.rank}: rank 0 could not {what} (see its error)")
        )
    return raw.decode()


def _peer_failed(comm: Comm, failed: dict[int, str]) -> PeerError:
    """What a rank raises when other ranks' save failed with an error a save does not expect
    (``failed``: rank -> what it was doing), each raising its own: every rank left the save
    together, so the group is still in step."""
    said = " and ".join(f"rank {r} failed while {doing}" for r, doing in failed.items())
    return PeerError(
        f"rank {comm.rank}: {said}, with an error a save does not expect (see its own); "
        "nothing was saved, and every rank left the save together (the engine can go on)"
    )


def _agree(comm: Comm, ok: bool | Exception, what: str, then: str = "") -> None:
    """A barrier that also says whether every rank succeeded so far: a CheckpointError on the
    ranks that did, naming those that did not (which raise their own error: ``ok``, if it is
    one). ``then``: what the message adds (what happened, what to do). Every rank raises
    alike (``Comm.alike``)."""
    flags = comm.all_gather(np.array([int(ok is True)], dtype=np.int64), what)[:, 0]
    bad = [r for r, f in enumerate(flags) if not f]
    if bad and ok is True:
        more = f" (see their error); {then}" if then else ""
        raise comm.alike(
            ckpt.CheckpointError(f"rank {comm.rank}: {what} failed on ranks {bad}{more}")
        )
    if isinstance(ok, Exception):
        raise comm.alike(ok)


def save(
    comm: Comm,
    shards: tuple[ShardTable, ...],
    plan: ShardPlan,
    spec: dict,
    step: int,
    root: str | Path,
    keep: int | None = None,
    extra_metadata: dict | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write a checkpoint of every rank's rows (``shards``, one per table of ``spec``, sharded
    by ``plan``) at ``step`` under ``root``; see the module docstring. ``extra_tensors`` and
    ``extra_metadata``: rank 0's are written (e.g. a DDP model, the same on every rank).
    Collective; returns the checkpoint's folder on every rank."""
    ckpt.check_save_arguments(keep, extra_metadata)  # the caller checked them collectively
    rank = comm.rank
    root = Path(root)
    sizes = [t["vocabulary_size"] for t in spec["tables"]]
    names = [t["name"] for t in spec["tables"]]
    # Keyed tables: every rank's keys first (they fix each key's place in the file). This
    # rank's work between their collectives (reading its state, sorting the keys) may fail:
    # it goes on with the collectives (``Writes``) and every rank learns it next.
    keyed, writes = {}, Writes(rank)
    for t, shard in enumerate(shards):
        if isinstance(shard, KeyedTable):
            writes.table = t
            keyed[t] = kc.layout(comm, shard, writes.run)
            writes.run(_keyed_entry, spec, t, keyed[t])
    if keyed:
        status = comm.all_gather(np.array([writes.status()], np.int64), "checkpoint keys")
        _agree_flags(comm, status[:, 0], writes.error, _GATHERING, names, _GATHERING_KEYS)
    files = [f"table-{i:03d}.safetensors" for i in range(len(sizes))]
    tmp_name, tmp_fd, error, tmp, committed = None, None, None, None, False
    try:
        # Rank 0 alone works here (an extra tensor may be big): the others wait in meetings.
        with comm.pacer(_MAKING_FOLDER):
            if rank == 0:
                try:
                    root.mkdir(parents=True, exist_ok=True)
                    with ckpt._locked(root):
                        ckpt._remove_leftovers(root)
                        tmp = (
                            root / f".tmp-ckpt-step{step:012d}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                        )
                        tmp.mkdir()
                        tmp_fd = os.open(tmp, os.O_RDONLY)
                        ckpt._lock(tmp_fd, tmp, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    if extra_tensors:
                        write_safetensors(tmp / ckpt.EXTRA_FILE, dict(extra_tensors))
                    for t, (shard, v, file) in enumerate(zip(shards, sizes, files, strict=True)):
                        if t in keyed:
                            head, end = keyed[t].header()[0], keyed[t].size()
                        else:
                            head, _ = _header(shard, v)
                            end = len(head) + sum(
                                v * w * d.itemsize for *_, w, d in _tensors(shard)
                            )
                        with open(tmp / file, "wb") as f:
                            f.write(head)
                            f.truncate(end)
                    tmp_name = tmp.name
                # Any error, a bad extra tensor's or a MemoryError or KeyboardInterrupt: every
                # rank learns it from the name (raising it here left the others in the next
                # meeting until the group's timeout).
                except BaseException as e:
                    error = e
        # Each rank writes into the folder rank 0 made, under its *own* root: a rank whose
        # root is another folder (or does not see rank 0's: another host, no shared file
        # system) must not write into rank 0's, nor be told its checkpoint is there.
        name = _name_from_rank0(
            comm, tmp_name, "make the checkpoint's folder", error, _MAKING_FOLDER
        )
        tmp = root / name
        _agree(comm, _same_folder(comm, root, tmp), "save (its folder)", _SAVE_AGAIN)
        writes = Writes(rank)
        finite = _write_rows(comm, shards, plan, tmp, files, sizes, writes)
        for t, lay in keyed.items():
            writes.table = t
            finite[t] = kc.write(comm, lay, tmp / files[t], writes)
        # per table whether finite, then how this rank's writing ended (Writes.status)
        flags = comm.all_gather(np.append(finite, writes.status()).astype(np.int64), "checkpoint")
        _agree_flags(comm, flags[:, -1], writes.error, "writing the checkpoint", names)
        flags = flags[:, :-1]
        final, late = None, None
        # Rank 0 hashes every file (a while, for big tables): the others wait in meetings.
        with comm.pacer(_COMMITTING):
            if rank == 0:
                try:
                    final = _commit(
                        root, tmp, spec, files, flags.all(axis=0), step, keep, extra_metadata
                    )
                    committed = True
                except ckpt.Committed as e:  # in place, then syncing or pruning failed
                    final, late, committed = e.final, e, True
                except BaseException as e:  # every rank learns it (as above)
                    error = e
        sent = None if final is None else final.name
        if late is not None:  # after a NUL, which no name holds: what failed then
            sent += f"\0{late.doing} ({type(late.error).__name__}: {late.error})"
        said = _name_from_rank0(comm, sent, "commit the checkpoint", error, _COMMITTING)
        name, _, then = said.partition("\0")
        if then:
            _committed_then_failed(comm, root / name, then, late)
        return root / name  # in this rank's own spelling of the folder
    finally:
        if rank == 0 and tmp is not None and not committed and tmp_fd is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # nothing half written is left behind
        if tmp_fd is not None:
            ckpt._unlock(tmp_fd)


def _agree_flags(
    comm: Comm,
    status: np.ndarray,
    error: BaseException | None,
    what: str,
    tables: list[str],
    doing: str = "writing its block of table {table!r} of the checkpoint",
) -> None:
    """``_agree`` on statuses already gathered (``status[r]``: rank r's ``Writes.status``):
    this rank's ``error``; else a PeerError naming the ranks that failed with an error a save
    does not expect and what each was ``doing`` with its table (``tables``: the names), or a
    CheckpointError naming the ranks whose writes failed."""
    if error is not None:
        raise comm.alike(error)
    failed = {r: doing.format(table=tables[-1 - int(s)]) for r, s in enumerate(status) if s < 0}
    if failed:
        raise comm.alike(_peer_failed(comm, failed))
    bad = [r for r, s in enumerate(status) if s == 0]
    if bad:
        raise comm.alike(
            ckpt.CheckpointError(
                f"rank {comm.rank}: {what} failed on ranks {bad} (see their error); nothing was "
                "saved"
            )
        )


# What each rank does as it gathers every rank's keys of its keyed tables (``kc.layout``).
_GATHERING = "gathering the keyed tables' keys"
_GATHERING_KEYS = "gathering its keys of table {table!r} for the checkpoint"
# What rank 0 does in the save's two stretches of its own work (the others wait in meetings).
_MAKING_FOLDER = "making the checkpoint's folder (writing its extra tensors)"
_COMMITTING = "committing the checkpoint (hashing its files)"
# Said by the ranks whose save is refused because another rank's failed.
_SAVE_AGAIN = "nothing was saved; every rank must save to one folder that every rank sees"


def _keyed_entry(spec: dict, t: int, lay: kc.KeyedLayout) -> None:
    """The manifest's ``keyed`` entry of keyed table ``t`` in ``spec`` (``kc.manifest_entry``)."""
    spec["tables"][t]["keyed"] = kc.manifest_entry(lay)


def _committed_then_failed(comm: Comm, path: Path, then: str, late: ckpt.Committed | None) -> None:
    """Every rank: rank 0 committed the checkpoint ``path`` and then failed (``then``: what it
    was doing, and its error; ``late``: rank 0's own). A CheckpointError saying so on every
    rank, its ``path`` the checkpoint (rank 0's chained to its error; a KeyboardInterrupt of
    rank 0's is raised as it is, with that text as a note), raised alike: the ranks are in
    step."""
    text = (
        f"rank {comm.rank}: the checkpoint {path} was committed (complete: it restores), but "
        f"rank 0 then failed while {then}; every rank left the save together (the engine can "
        "go on)"
    )
    if late is not None and not isinstance(late.error, Exception):
        late.error.add_note(text)
        raise comm.alike(late.error)
    error = ckpt.CheckpointError(text, path=path)
    raise comm.alike(error) from (late.error if late is not None else None)


def _same_folder(comm: Comm, root: Path, tmp: Path) -> bool | Exception:
    """True if this rank sees the temporary folder rank 0 made (its name is unique: a pid and
    a random part) under its own ``root``; else the CheckpointError this rank raises."""
    if comm.rank == 0 or tmp.is_dir():
        return True
    return ckpt.CheckpointError(
        f"rank {comm.rank}: the folder rank 0 made for the checkpoint ({tmp.name}) is not in "
        f"this rank's {root}: the ranks were given other folders, or this rank does not see "
        f"rank 0's; {_SAVE_AGAIN} (the same path, on one host or a shared file system)"
    )


class Writes:
    """This rank's work between the exchanges of a save's writing: its writes into the
    checkpoint's files and what it computes for them (the rows it sends, the rows it
    writes). The first step that fails is kept in ``error`` and every later one is skipped,
    while the rank goes on with the save's collectives (sending zeros): the ranks learn it
    together at the end (``save``), where they once waited in the next exchange for the
    failed rank until the timeout, a PeerError naming nobody, and the group broken. Any
    error is kept so: a write's OSError (a full disk, an I/O error, a file it cannot open),
    which the others report as a CheckpointError, and any other (a MemoryError, a bug's
    RuntimeError, a KeyboardInterrupt: held until the writing ends, a while shorter than the
    writes it skips), which they report as a PeerError naming this rank and ``table``."""

    def __init__(self, rank: int):
        self.rank = rank
        self.error: BaseException | None = None
        self.table = 0  # the table whose block this rank writes (the others' error names it)
        self._expected = False  # whether ``error`` is a write's OSError
        self._failed_in = 0  # the table it wrote when it failed

    def __call__(self, file: Path, fn: Callable, *args):
        """``fn(*args)`` (os.open, os.pwrite, os.fsync on ``file``), unless a step failed
        already; its result, or None."""
        return self.run(fn, *args, file=file)

    def run(self, fn: Callable, *args, file: Path | None = None):
        """``fn(*args)`` unless a step failed already; its result, or None (``file``: the
        file it writes, named by a failed write's OSError)."""
        if self.error is not None:
            return None
        self._failed_in = self.table
        try:
            return fn(*args)
        except OSError as e:
            if file is None:  # not a write: kept as it is (below)
                self.error = e
                return None
            self.error, self._expected = (
                OSError(
                    e.errno,
                    f"rank {self.rank}: writing the checkpoint's {file} failed "
                    f"({e.strerror or e}); nothing was saved (every rank raises): save again "
                    "once it can be written",
                ),
                True,
            )
            self.error.__cause__ = e
        except BaseException as e:  # raised by this rank once the others know (``save``)
            self.error = e
        return None

    def status(self) -> int:
        """How this rank's writing ended, for the others: 1 done, 0 a write failed (an
        OSError), ``-1 - table`` another error while it wrote that table's block."""
        if self.error is None:
            return 1
        return 0 if self._expected else -1 - self._failed_in


def _write_rows(
    comm: Comm,
    shards,
    plan: ShardPlan,
    tmp: Path,
    files: list[str],
    sizes: list[int],
    writes: Writes,
) -> np.ndarray:
    """Every rank writes its block of rows of every table (through ``writes``: a failed write
    stops this rank's writing, not its part in the exchanges); per table whether its float
    columns in this rank's block were all finite."""
    rank, world = comm.rank, comm.world_size
    finite = np.ones(len(sizes), dtype=bool)
    for t, (shard, v, file) in enumerate(zip(shards, sizes, files, strict=True)):
        if v is None:
            continue  # a keyed table: keyed_checkpoint.write
        raw = _row_bytes(shard)
        width = raw.shape[1]  # bytes a row
        chunk = max(1, CHUNK_BYTES // width)
        blocks = [_block(v, world, r) for r in range(world)]
        rounds = max((hi - lo + chunk - 1) // chunk for lo, hi in blocks)
        _, starts = _header(shard, v)
        writes.table = t
        fd = writes(tmp / file, os.open, tmp / file, os.O_WRONLY)
        try:
            for k in range(rounds):
                # What each destination writes this round, and which of those rows are mine.
                spans = [
                    (min(lo + k * chunk, hi), min(lo + (k + 1) * chunk, hi)) for lo, hi in blocks
                ]
                mine = [_owned_in(plan, t, rank, a, b) for a, b in spans]
                counts = [len(i) * width for i in mine]
                send = writes.run(_rows_to_send, shard, raw, mine)
                if send is None:  # this rank failed: it sends zeros, writing nothing
                    send = np.zeros(sum(counts), dtype=np.uint8)
                theirs = [_owned_in(plan, t, s, *spans[rank]) for s in range(world)]
                got = comm.all_to_all(send, counts, [len(i) * width for i in theirs], "checkpoint")
                a, b = spans[rank]
                ok = writes.run(
                    _store_rows, shard, got, theirs, a, b, starts, fd, tmp / file, writes
                )
                finite[t] &= ok is not False
            # A rank's fsync of its block may take a while (a slow or shared file system).
            with comm.pacer("syncing the checkpoint's files"):
                writes(tmp / file, os.fsync, fd)
        finally:
            if fd is not None:
                os.close(fd)
    return finite


def _rows_to_send(shard, raw: np.ndarray, mine: list[np.ndarray]) -> np.ndarray:
    """The bytes of this rank's rows ``mine[d]`` (global ids) for each destination d, in
    rank order (``_write_rows``)."""
    return np.concatenate([raw[shard.rows_for(0, ids)].reshape(-1) for ids in mine])


def _store_rows(
    shard,
    got: np.ndarray,
    theirs: list[np.ndarray],
    a: int,
    b: int,
    starts: dict[str, int],
    fd: int | None,
    file: Path,
    writes: Writes,
) -> bool:
    """Write the rows ``[a, b)`` of ``shard``'s table received in ``got`` (from each rank s
    the ids ``theirs[s]``) into ``file`` (``fd``; each tensor from ``starts[name]``) through
    ``writes``; whether their float columns are all finite."""
    width = _row_bytes(shard).shape[1]
    rows = np.empty((b - a, width), dtype=np.uint8)
    pos = 0
    for ids in theirs:
        rows[ids - a] = got[pos : pos + len(ids) * width].reshape(len(ids), width)
        pos += len(ids) * width
    finite = True
    for name, _, c, w, dtype in _tensors(shard):
        part = np.ascontiguousarray(rows[:, c : c + w * dtype.itemsize])
        if dtype.kind == "f" or dtype == ckpt.BFLOAT16:
            finite &= _finite(part.view(dtype))
        writes(file, os.pwrite, fd, part.tobytes(), starts[name] + a * w * dtype.itemsize)
    return finite


def _commit(
    root: Path,
    tmp: Path,
    spec: dict,
    files: list[str],
    finite: np.ndarray,
    step: int,
    keep: int | None,
    extra_metadata,
) -> Path:
    """Rank 0: hash the files, write the manifest, rename the folder into place. A failure
    after the rename (syncing the root, pruning) is a ``ckpt.Committed`` naming the checkpoint."""
    listed = {}
    for entry, file, ok in zip(spec["tables"], files, finite, strict=True):
        entry["file"] = file
        entry["finite"] = bool(ok)
        listed[file] = {"sha256": sha256_file(tmp / file), "bytes": (tmp / file).stat().st_size}
    extra = {"file": None, "metadata": dict(extra_metadata or {})}
    if (tmp / ckpt.EXTRA_FILE).exists():
        extra["file"] = ckpt.EXTRA_FILE
        listed[ckpt.EXTRA_FILE] = {
            "sha256": sha256_file(tmp / ckpt.EXTRA_FILE),
            "bytes": (tmp / ckpt.EXTRA_FILE).stat().st_size,
        }
    manifest = {
        "format": ckpt.FORMAT,
        "format_version": ckpt.FORMAT_VERSION,
        "embengine_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "step": step,
        **spec,
        "finite": bool(finite.all()),
        "extra": extra,
        "files": listed,
    }
    return ckpt.commit(root, tmp, manifest, step, keep)


def restore(
    comm: Comm,
    shards: tuple[ShardTable, ...],
    spec: dict,
    path: str | Path,
    verify: bool = True,
    int_ranges: Callable[[int], dict] | None = None,
    newest: str | None = None,
    verify_other: bool = True,
) -> ckpt.CheckpointInfo:
    """Read this rank's rows of every table (``shards``, of an engine whose configuration is
    ``spec``) from a checkpoint of any world size, or a plain engine's; collective. Returns a
    CheckpointInfo: the checkpoint's step (the caller's new step) and its extra data, read by
    every rank. The checkpoint's read lock (a save's ``keep=N`` does not prune it meanwhile)
    is released when this returns or raises, not when the reader is collected.
    ``int_ranges(step)``: the ranges of the int32 slots (``engine.int_slot_ranges``), whose
    values every rank checks, a chunk at a time, before any table changes
    (``_check_int_slots``). ``path`` a folder of checkpoints: every rank reads the newest
    that rank 0 finds there (``newest``: this rank's name of it, if given: rank 0's wins; a
    rank whose own ``newest`` differs reads with ``verify_other``), by its name."""
    readers: list[ckpt.CheckpointReader] = []
    try:
        return _restore(comm, shards, spec, path, verify, readers, int_ranges, newest, verify_other)
    finally:
        for reader in readers:
            reader.close()


class _Held:
    """A read lock held until the restore ends (``readers``' ``close``)."""

    def __init__(self, lock):
        self.close = lock.release


def _newest(path, newest: str | None = None) -> tuple[str, _Held | None]:
    """Rank 0: the name of the newest complete checkpoint in the folder of checkpoints
    ``path`` (``newest`` if given: the one ``ShardedEngine.load`` read the configuration of),
    and its read lock (so that no save's ``keep=N`` prunes it while the ranks read it); ("",
    None) if ``path`` is a checkpoint's folder or holds none (the read says so)."""
    try:
        ckpt.check_path(path, "the checkpoint path")
        if (Path(path) / "manifest.json").is_file():
            return "", None
        if newest is not None:
            try:
                return newest, _Held(ckpt._ReadLock(Path(path) / newest))
            except ckpt.CheckpointError:  # gone: every rank's read says so
                return newest, None
        for _ in range(3):  # pruned before it was locked (saves meanwhile): the newest again
            newest = ckpt.latest_checkpoint(path)
            if newest is None:
                return "", None
            try:
                return newest.name, _Held(ckpt._ReadLock(newest))
            except ckpt.CheckpointError:
                continue
    except Exception:  # the rank's own read below raises what is wrong
        pass
    return "", None


def _restore(
    comm, shards, spec, path, verify, readers, int_ranges, newest, verify_other
) -> ckpt.CheckpointInfo:
    """``restore``; the reader it opens goes to ``readers``."""
    # A folder of checkpoints: every rank reads the newest that rank 0 found there, by its
    # name in its own folder. Each rank finding its own newest, a save landing in between
    # (another job's, into the same folder) made the ranks read different checkpoints.
    name, held = _newest(path, newest) if comm.rank == 0 else ("", None)
    if held is not None:
        readers.append(held)
    # ("-": none; each rank reads its own path)
    name = _name_from_rank0(comm, name or "-", "find the newest checkpoint")
    error, reader, extra = None, None, {}
    # Checking hashes every file (a while, for big tables; the ranks end it at different
    # times, or some do not hash: verify=False): those done wait in meetings.
    with comm.pacer("checking the checkpoint (hashing its files)"):
        try:
            ckpt.check_path(path, "the checkpoint path")
            if name != "-" and not (Path(path) / "manifest.json").is_file():
                path = Path(path) / name
                if newest is not None and name != newest:  # not the one this rank checked
                    verify = verify_other
            _, reader = ckpt.read_checkpoint(path, verify)
            readers.append(reader)
            ckpt._check_compatible(spec, reader.manifest, reader.path)
            extra = reader.extra_tensors()  # before any row changes, as a single restore
        except Exception as e:  # any (a path of the wrong type too): the others learn it first
            error = e
    # Posted, so that a rank stopped in its checks is named by the others (Comm.behind),
    # where they said "every rank had entered" the restore.
    comm.enter("restore, after checking the checkpoint")
    if error is not None:
        _agree(comm, False, "restore")  # the others learn it, then this rank raises its own
        raise comm.alike(error)
    _agree(comm, True, "restore")
    # The manifest lists every file's SHA-256: equal manifests, one checkpoint (copies of it
    # in node-local folders too); ranks reading different ones would mix their rows.
    text = json.dumps(reader.manifest, sort_keys=True, default=str).encode()
    digest = np.frombuffer(hashlib.sha256(text).digest()[:8], dtype=np.int64)[0]
    got = comm.all_gather(np.array([reader.step, digest], dtype=np.int64), "restore")
    steps, digests = got[:, 0], got[:, 1]
    if (steps != steps[0]).any():
        raise comm.alike(
            ckpt.CheckpointError(
                f"rank {comm.rank}: the ranks restored checkpoints of steps {steps.tolist()}; "
                "every rank must restore the same checkpoint"
            )
        )
    other = [r for r, d in enumerate(digests) if d != digests[0]]
    if other:
        raise comm.alike(
            ckpt.CheckpointError(
                f"rank {comm.rank}: ranks {other} restored another checkpoint (of the same step "
                f"{reader.step}) than rank 0 ({reader.path} here); every rank must restore the "
                "same checkpoint; nothing was changed"
            )
        )
    # Keyed tables: this rank's keys, read and checked before any table changes.
    installs, error = [], None
    try:
        _check_int_slots(reader, shards, {} if int_ranges is None else int_ranges(reader.step))
        for shard in shards:
            if isinstance(shard, KeyedTable):
                installs.append(kc.prepare(comm, reader, shard, reader.step))
    except (OSError, ValueError, MemoryError) as e:  # MemoryError: a shard's room (_stage)
        error = e
    _agree(comm, error is None, "restore")
    if error is not None:
        raise comm.alike(error)
    # A read failing on one rank (a file cut or unreadable after the checks) leaves its tables
    # part new: every rank learns it and raises, so none goes on as if restored.
    error = None
    try:
        _copy_rows(shards, installs, reader)
    except (OSError, ValueError, MemoryError) as e:
        error = e
    try:
        _agree(comm, error is None, "restore")
    except ckpt.CheckpointError as e:
        raise comm.alike(
            ckpt.CheckpointError(
                f"{e} while copying rows, after every check: the engine's tables are part new; "
                "restore again before using it"
            )
        ) from None
    if error is not None:
        raise comm.alike(error)
    return ckpt.CheckpointInfo(reader.path, reader.step, extra, reader.extra_metadata)


def _check_int_slots(reader, shards: tuple[ShardTable, ...], ranges: dict) -> None:
    """The checkpoint's int32 slots (every row, not this rank's alone, so that every rank
    refuses alike) in their ``ranges``, read a chunk at a time (a slot of a billion rows is
    4 GB); a CheckpointError naming the table, slot, id or key and value, as a single
    engine's restore says it (``state.int_slot_error``)."""
    keyed = {s.name for s in shards if isinstance(s, KeyedTable)}
    for table, slot in ranges:
        lo, hi, _ = ranges[(table, slot)]
        rows = reader.rows(table, slot)
        step = max(1, CHUNK_BYTES // max(1, rows.nbytes // max(1, len(rows))))
        for a in range(0, len(rows), step):
            chunk = np.asarray(rows[a : a + step])
            bad = (chunk < lo) | (chunk > hi)
            if not bad.any():
                continue
            r, c = (int(i[0]) for i in np.nonzero(bad))
            row = f"id {a + r}"
            if table in keyed:  # the key of that row, read alone
                row = f"key {int(np.asarray(reader.rows(table, 'keys')[a + r : a + r + 1])[0])}"
            at = f"state['tables'][{table!r}][{slot!r}]"
            text = int_slot_error(table, slot, row, chunk[r, c], at, (a + r, c), ranges)
            raise ckpt.CheckpointError(f"{reader.path}: {text}")


def _copy_rows(shards: tuple[ShardTable, ...], installs: list, reader) -> None:
    """This rank's rows of every table: a keyed shard's read by its install (``installs``),
    the others' from ``reader`` chunk by chunk."""
    for install in installs:
        install()
    for shard in shards:
        if isinstance(shard, KeyedTable):
            continue
        ids = shard.global_ids
        for _, entry, c, w, dtype in _tensors(shard):
            stored = reader.tensor(shard.name, entry)
            meta, data_start = stored.header
            first = data_start + meta[stored.name]["data_offsets"][0]
            row_bytes = w * dtype.itemsize
            chunk = max(1, CHUNK_BYTES // max(1, row_bytes))
            target = _row_bytes(shard)[:, c : c + row_bytes]
            with open(stored.file, "rb") as f:
                # Chunks of at most ``chunk`` stored rows, each holding some of this rank's ids.
                for a in range(
                    int(ids[0]) if len(ids) else 0, int(ids[-1]) + 1 if len(ids) else 0, chunk
                ):
                    lo, hi = np.searchsorted(ids, [a, a + chunk])
                    if lo == hi:
                        continue
                    b = int(ids[hi - 1]) + 1
                    buf = np.empty((b - a, row_bytes), dtype=np.uint8)
                    f.seek(first + a * row_bytes)
                    if f.readinto(memoryview(buf).cast("B")) != buf.nbytes:
                        raise ckpt.CheckpointError(
                            f"{stored.file}: tensor {stored.name!r} ends early (changed while "
                            "being read?); restore again before using the engine"
                        )
                    target[lo:hi] = buf[ids[lo:hi] - a]
