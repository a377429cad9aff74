"""DenseTable: a fixed-vocabulary table whose weights and optimizer slots share one array.

Row ``r`` of the packed float32 array ``data`` holds ``[weights (dim) | slot 0 | slot 1 | ...]``,
so an update that touches a row's weights and slots reads and writes one contiguous run of
memory instead of one per array. ``weights`` and ``slot(name)`` are strided views into it; int32
slots (step counters) are views of the same bytes through ``data.view(np.int32)``.

The array lives in RAM, or (``path=``) in a memory-mapped file: a table plus slots bigger than
RAM then trains with the OS page cache as its cache (advised for random access, see
``_advise``). A memory-mapped table owns its file: it holds an exclusive lock on it for as long
as the mapping lives, reserves the file's blocks before writing, and checks the file's size
before each use (see ``DenseTable``).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..initializers import Initializer
from ..optimizers import SlotSpec
from ..precision import check_initial, check_initial_slots, numpy_dtype, table_key

try:  # POSIX; Windows has no flock, so no lock is taken there
    import fcntl
except ImportError:  # pragma: no cover - not on Linux
    fcntl = None

__all__ = ["DenseTable", "Column", "TableView", "StorageError", "row_columns", "column_view"]

# Rows initialised per chunk: bounds the temporary memory of initialisation (~32 MB of float64).
_INIT_VALUES_PER_CHUNK = 1 << 22
# Start of a RAM table, in bytes: a cache line, so that a row of 64 floats spans 4 lines, not 5
# (np.empty of a large array is only 16-byte aligned; W1's lookups gain: docs/performance.md,
# "Figures behind the code").
_ALIGNMENT = 64


def _aligned_empty(shape: tuple[int, int], dtype=np.float32) -> np.ndarray:
    """An uninitialised array whose first byte is ``_ALIGNMENT``-aligned."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = np.empty(nbytes + _ALIGNMENT, dtype=np.uint8)
    skip = -buf.ctypes.data % _ALIGNMENT
    return buf[skip : skip + nbytes].view(dtype).reshape(shape)


def _advise(mapping: mmap.mmap, advice: str) -> None:
    """madvise a table file's mapping. Random access matters: with the default read-ahead a
    random row read pulls in ~128 KiB, which thrashes the page cache once the file is bigger
    than memory (docs/performance.md, "Figures behind the code")."""
    flag = getattr(mmap, advice, None)
    if flag is None:  # not on every platform (Windows)
        return
    try:
        mapping.madvise(flag)
    except OSError:  # advice is optional; some file systems refuse it
        pass


@contextlib.contextmanager
def read_ahead(mapping: mmap.mmap):
    """A table file's mapping advised for sequential reads while the block runs (a whole
    table read or written in order), for random access again after it (unless the block
    closed the mapping)."""
    _advise(mapping, "MADV_SEQUENTIAL")
    try:
        yield
    finally:
        if not mapping.closed:  # close() inside the block
            _advise(mapping, "MADV_RANDOM")


class StorageError(ValueError):
    """A memory-mapped table's file cannot be used: another engine holds it, it was truncated
    under the table, or the table was closed."""


def _lock_holder(fd: int) -> int | None:
    """The pid that took the flock on ``fd``'s file, from /proc/locks (Linux), else None.

    Only for the error message: the holder may have forked since, or live in another pid
    namespace (shown as 0 there)."""
    try:
        st = os.fstat(fd)
        want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
        with open("/proc/locks") as f:
            for line in f:
                # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:5678 0 EOF" (waiters have "->" first)
                parts = line.split()
                if len(parts) < 6 or parts[1] != "FLOCK":
                    continue
                major, minor, inode = parts[5].split(":")
                if (int(major, 16), int(minor, 16), int(inode)) == want and int(parts[4]) > 0:
                    return int(parts[4])
    except (OSError, ValueError):
        pass
    return None


def _lock(fd: int, path: Path, table: str) -> None:
    """Take an exclusive, non-blocking flock on an open table file, or raise StorageError
    naming the folder, the table and the holder's pid. flock belongs to the open file
    description, so a second open of the file conflicts even within one process."""
    if fcntl is None:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _lock_holder(fd)
        who = "" if pid is None else f" (pid {pid}{', this process' if pid == os.getpid() else ''})"
        raise StorageError(
            f"storage_dir {str(path.parent)!r}: table {table!r} (file {path.name!r}) is in use by "
            f"another engine{who}; two engines on one file would overwrite each other's table. "
            "Use another storage_dir, or close the other engine first (engine.close())"
        ) from None


def open_locked(path: Path, table: str) -> int:
    """The descriptor of ``table``'s file, created if missing (with its folder), locked for
    this process (``_lock``: a StorageError naming the holder if another has it) and emptied:
    once the lock is ours, its old contents belong to no live table. Opened without O_TRUNC,
    which would empty another engine's live table before the lock is tried."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        _lock(fd, path, table)
        os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def reserve(fd: int, start: int, end: int, path: Path, table: str) -> None:
    """Extend a locked table file to ``end`` bytes, the blocks of ``start:end`` reserved with
    posix_fallocate, so that a full disk fails here, with an OSError (ENOSPC) naming the file
    and the bytes, rather than as SIGBUS on a later write into the mapping. The bytes before
    ``start`` (rows already written) are left alone, also on failure, and a longer file is
    never shortened (a keyed restore stages its rows while the table's mapping reads them).

    Where posix_fallocate does not exist (macOS, Windows) or the file system refuses it
    (EOPNOTSUPP / EINVAL; glibc otherwise emulates it by writing), the file is only extended
    to ``end``: it is then sparse, its blocks allocated as the rows are written, and a full
    disk kills the process with SIGBUS then. Copy-on-write file systems (btrfs, ZFS) may also
    need new blocks when a reserved block is rewritten."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is not None:
        try:
            fallocate(fd, start, end - start)
            return
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                try:
                    vfs = os.fstatvfs(fd)
                    free = f"; {vfs.f_bavail * vfs.f_frsize:,} bytes are free there"
                except OSError:
                    free = ""
                n = end - start
                grow = f" (growing it to {end:,} bytes)" if start else ""
                raise OSError(
                    e.errno,
                    f"table {table!r}: cannot reserve {n:,} bytes ({n / 2**20:.1f} MiB) for "
                    f"its file {str(path)!r}{grow}: {e.strerror}{free}",
                ) from e
    if end > os.fstat(fd).st_size:  # never shorter: a mapping may still read past ``end``
        os.ftruncate(fd, end)


@dataclass(frozen=True)
class Column:
    """Where one named array lives inside a packed row: from element ``start`` of the row
    array, ``width`` values of ``dtype``, each ``stride`` elements wide (2 for a 32-bit value in
    the uint16 row of a 16-bit table, else 1)."""

    name: str
    start: int
    width: int
    dtype: str
    stride: int = 1


def row_columns(
    table: str,
    dim: int,
    slot_specs: tuple[SlotSpec, ...],
    weights_dtype: str = "float32",
    slots_dtype: str = "float32",
) -> tuple[dict, int]:
    """The row layout ``[weights | slot 0 | slot 1 ...]`` every storage of rows shares: each
    column's ``Column`` by name, and the row width in elements of the row array (float32 rows:
    ``dim`` plus the slots' widths).

    A table whose weights or float slots are 16-bit (``row_dtype`` uint16) is byte-packed in
    uint16 units: a 16-bit value takes one unit, a float32 or int32 value two, starting at an
    even unit (read through a 32-bit view of the row); the row is padded to an even width."""
    half = row_dtype(weights_dtype, slots_dtype) == np.uint16
    start = 0

    def place(name: str, width: int, dtype: str) -> Column:
        nonlocal start
        stride = 2 if half and dtype in ("float32", "int32") else 1
        start += start % stride  # a 32-bit value starts at an even unit
        col = Column(name, start, width, dtype, stride)
        start += width * stride
        return col

    columns = {"weights": place("weights", dim, weights_dtype)}
    for spec in slot_specs:
        if spec.name in columns:
            raise ValueError(f"table {table!r}: slot name {spec.name!r} is used twice")
        dtype = slots_dtype if spec.dtype == "float32" else spec.dtype
        columns[spec.name] = place(spec.name, spec.width, dtype)
    return columns, start + (start % 2 if half else 0)


def row_dtype(weights_dtype: str = "float32", slots_dtype: str = "float32") -> type:
    """The row array's dtype: float32, or uint16 if the weights or float slots are 16-bit."""
    return np.float32 if weights_dtype == slots_dtype == "float32" else np.uint16


def column_view(data: np.ndarray, col: Column) -> np.ndarray:
    """A live view of one column of every row of ``data`` (a row array laid out by
    ``row_columns``), in the column's dtype: float32, int32, float16 or ``ml_dtypes.bfloat16``."""
    if data.dtype == np.float32:
        base = data if col.dtype == "float32" else data.view(np.int32)
        return base[:, col.start : col.start + col.width]
    if col.stride == 2:
        return data.view(col.dtype)[:, col.start // 2 : col.start // 2 + col.width]
    return data[:, col.start : col.start + col.width].view(numpy_dtype(col.dtype))


class MappedRows:
    """``flush`` and ``sequential_access`` of a table whose rows may live in a mapped file
    (DenseTable, KeyedTable): ``path`` (None: in RAM), ``_mapping``, and ``check_file()``,
    which raises for a closed or truncated file."""

    def flush(self) -> None:
        """Write a file-backed table's dirty pages to its file (no-op in RAM)."""
        if self.path is not None:
            self.check_file()
            self._mapping.flush()

    @contextlib.contextmanager
    def sequential_access(self):
        """While reading or writing the whole table in order (checkpoints), let the kernel read
        ahead; training's random row accesses otherwise read only the pages they touch."""
        if self.path is None:
            yield
            return
        self.check_file()
        with read_ahead(self._mapping):
            yield


class DenseTable(MappedRows):
    """Weights ``[vocabulary_size, dim]`` plus slots, stored packed (see module docstring).

    A memory-mapped table (``path=``):

    - locks its file (exclusive, non-blocking ``flock``) before truncating or writing it; a
      second table on the same file, in this process or another, raises StorageError and leaves
      the first one untouched. The lock belongs to the mapping's own file descriptor, so it is
      released when the mapping goes: by ``close()``, or when the table and every array viewing
      it are garbage-collected (a forked child that inherited the mapping holds it too);
    - reserves the file's blocks at creation (see ``_reserve``): a full disk is an OSError here;
    - checks the file's size whenever ``data`` (and so ``weights`` or ``slot()``) is read, one
      fstat (``check_file``): a file truncated under the mapping raises StorageError instead of
      killing the process with SIGBUS on the next access. Arrays taken earlier (e.g. the
      engine's ``embedding_tables``) are not checked.
    """

    def __init__(
        self,
        name: str,
        vocabulary_size: int,
        dim: int,
        slot_specs: tuple[SlotSpec, ...],
        initializer: Initializer,
        seed: int,
        path: str | Path | None = None,
        segments: list[tuple[str, int, int, Initializer]] | None = None,
        weights_dtype: str = "float32",
        slots_dtype: str = "float32",
    ):
        """``segments``: for a table that packs several logical tables (low-dimensional packing),
        (name, first row, rows, initializer) of each; row ``r`` of a segment is initialised as row
        ``r - first`` of that logical table, so values do not depend on the packing.
        ``weights_dtype`` / ``slots_dtype``: the stored dtypes (``row_columns``); initial values
        of a 16-bit column are rounded to nearest (they are not updates)."""
        self.name = name
        self.vocabulary_size = int(vocabulary_size)
        self.dim = int(dim)
        self.slot_specs = tuple(slot_specs)
        self.weights_dtype, self.slots_dtype = weights_dtype, slots_dtype
        # The key of this table's stochastic-rounding stream (embengine.precision).
        self.rounding_key = table_key(seed, name)
        self._dtype = row_dtype(weights_dtype, slots_dtype)
        self.columns, self.row_width = row_columns(
            name, self.dim, self.slot_specs, weights_dtype, slots_dtype
        )
        shape = (self.vocabulary_size, self.row_width)
        self.path = None if path is None else Path(path)
        self._nbytes = shape[0] * shape[1] * np.dtype(self._dtype).itemsize
        self._mapping: mmap.mmap | None = None
        if self.path is None:
            self._data = _aligned_empty(shape, self._dtype)
        else:
            size = max(self._nbytes, 1)  # mmap of 0 bytes is an error
            fd = open_locked(self.path, name)  # the old contents are re-initialised below
            try:
                try:
                    reserve(fd, 0, size, self.path, name)
                except OSError:
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, 0)  # give back whatever was reserved
                    raise
                # mmap keeps a dup of fd (same open file description): the lock lives as long
                # as the mapping, i.e. until close() or the last view of the table is freed.
                self._mapping = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            _advise(self._mapping, "MADV_RANDOM")
            self._data = self._view_mapping()
        if segments is None:
            segments = [(name, 0, self.vocabulary_size, initializer)]
        # Logical table i's id k is row first_i + k (TableStorage.row_bases).
        self._members = tuple((str(n), int(first), int(rows)) for n, first, rows, _ in segments)
        # Packed: each member rounds in its own stream, as it would unpacked (rounding_rows).
        self._member_streams = None
        if len(self._members) > 1:
            keys = np.array([table_key(seed, n) for n, _, _ in self._members], dtype=np.uint64)
            self._member_streams = np.zeros((len(self._members), 4), dtype=np.int64)
            self._member_streams[:, 0] = [first for _, first, _ in self._members]
            self._member_streams[:, 1] = [rows for _, _, rows in self._members]
            self._member_streams[:, 2] = keys.view(np.int64)
        with self.sequential_access():  # initialisation writes the rows in order
            for seg_name, first, rows, init in segments:
                self._initialise(init, seed, seg_name, first, rows)

    def _initialise(
        self, initializer: Initializer, seed: int, name: str, first: int, count: int
    ) -> None:
        chunk = max(1, _INIT_VALUES_PER_CHUNK // max(self.dim, 1))
        if initializer.whole_table:  # one call, as TF makes it (FromFunction)
            chunk = max(count, 1)
        if count:  # 16-bit slots: their initial values rounded to nearest, as the weights
            check_initial_slots(name, self.slots_dtype, self.slot_specs)
        for lo in range(0, count, chunk):
            hi = min(lo + chunk, count)
            rows = np.arange(lo, hi, dtype=np.int64)
            values = initializer.init(seed, name, rows, self.dim)
            # 16-bit: rounded to nearest, so a value past the dtype's range would be Inf
            check_initial(name, self.weights_dtype, values, "its initializer", lo)
            self.weights[first + lo : first + hi] = values
            for spec in self.slot_specs:
                self.slot(spec.name)[first + lo : first + hi] = spec.initial_value

    def _view_mapping(self) -> np.ndarray:
        count = self.vocabulary_size * self.row_width
        data = np.frombuffer(self._mapping, dtype=self._dtype, count=count)
        return data.reshape(self.vocabulary_size, self.row_width)

    @property
    def data(self) -> np.ndarray:
        """The packed ``[vocabulary_size, row_width]`` array: float32, or uint16 for a 16-bit
        table (``row_columns``). A memory-mapped table checks its file first (``check_file``:
        one fstat, not per row)."""
        if self._mapping is not None:
            self.check_file()
        return self._data

    def check_file(self) -> None:
        """Raise StorageError if a memory-mapped table was closed or its file is now shorter
        than the table (truncated by another program while mapped: touching the rows past its
        end would kill the process with SIGBUS). One fstat; nothing for a RAM table."""
        if self.path is None:
            return
        if self._mapping is None or self._mapping.closed:
            raise StorageError(f"table {self.name!r} is closed (its file {str(self.path)!r})")
        size = self._mapping.size()  # fstat of the mapping's own descriptor
        if size < self._nbytes:
            raise StorageError(
                f"table {self.name!r}: its file {str(self.path)!r} is {size:,} bytes, the table "
                f"needs {self._nbytes:,}: it was truncated while in use (not by embengine, which "
                "locks it). Its rows past the end are lost; restore the engine from a checkpoint"
            )

    def close(self) -> None:
        """Flush and unmap a memory-mapped table, which releases its file's lock; a no-op for a
        RAM table or a closed one. The table is unusable afterwards (StorageError).

        Raises StorageError, and leaves the table open and locked, while arrays viewing its
        memory are alive (e.g. ``embedding_tables`` or ``slots()`` results): unmapping under
        them would crash their next access. Drop them and call close() again."""
        if self._mapping is None or self._mapping.closed:
            return
        self._mapping.flush()
        self._data = None  # the table's own view of the mapping
        try:
            self._mapping.close()
        except BufferError:
            self._data = self._view_mapping()
            raise StorageError(
                f"table {self.name!r}: cannot close its file {str(self.path)!r} while arrays "
                "viewing its memory are alive (embedding_tables, slots(), weights); drop them "
                "first. The table stays open"
            ) from None

    # -- the storage protocol (storage/protocol.py) --------------------------------------------

    @property
    def row_bases(self) -> tuple[int, ...]:
        """Logical table i's id k is row ``row_bases[i] + k`` (its segment's first row)."""
        return tuple(first for _, first, _ in self._members)

    @property
    def rounding_rows(self) -> np.ndarray | None:
        """What a 16-bit update's rounding stream follows (``kernels.rounding.row_stream``,
        ``precision.rounding_streams``): None for one logical table, whose rows are its ids;
        for a table packing several, ``[first row, rows, key, 0]`` of each member (the key
        from the engine seed and the member's name), so that every member rounds its ids as
        the same table unpacked, and as a ShardedEngine (which never packs) does."""
        return self._member_streams

    def rows_for(self, logical: int, ids: np.ndarray, insert: bool = True) -> np.ndarray:
        """Rows of logical table ``logical``'s ``ids``: ``row_bases[logical] + ids`` (every id
        of ``[0, vocabulary_size)`` has its row; ``insert`` changes nothing)."""
        ids = np.asarray(ids, dtype=np.int64)
        base = self._members[logical][1]
        return ids + base if base else ids.copy()

    def live_rows(self) -> np.ndarray:
        """Every row: ``[[0, vocabulary_size]]``."""
        return np.array([[0, self.vocabulary_size]], dtype=np.int64)

    def view(self, logical: int) -> TableView:
        """Logical table ``logical``: its segment's rows."""
        name, first, rows = self._members[logical]
        return TableView(self, name, first, rows)

    @property
    def weights(self) -> np.ndarray:
        """Live ``[rows, dim]`` view in the stored dtype (``column_view``)."""
        return column_view(self.data, self.columns["weights"])

    def slot(self, name: str) -> np.ndarray:
        col = self.columns.get(name)
        if col is None or name == "weights":
            raise KeyError(
                f"table {self.name!r} has no slot {name!r}; it has {list(self.slot_names)}"
            )
        return column_view(self.data, col)

    @property
    def slot_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.slot_specs)

    @property
    def slots(self) -> dict[str, np.ndarray]:
        return {n: self.slot(n) for n in self.slot_names}

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def storage(self) -> str:
        return "ram" if self.path is None else "mmap"


class TableView:
    """One logical table inside a physical table, in logical row order (a
    ``protocol.LogicalTable``): the table's rows ``rows`` (default ``offset .. offset +
    vocabulary_size``; a storage that keeps a table's rows in another order passes the slice
    that lists them by id, e.g. a negative step).

    A table that is not packed with others is a view of all of its DenseTable."""

    def __init__(
        self, table, name: str, offset: int, vocabulary_size: int, rows: slice | None = None
    ):
        self.table = table
        self.name = name
        self.offset = offset
        self.vocabulary_size = vocabulary_size
        self.dim = table.dim
        self.slot_specs = table.slot_specs
        self.columns = table.columns
        self._row_slice = slice(offset, offset + vocabulary_size) if rows is None else rows

    @property
    def _rows(self) -> slice:
        return self._row_slice

    @property
    def weights(self) -> np.ndarray:
        return self.table.weights[self._rows]

    def slot(self, name: str) -> np.ndarray:
        return self.table.slot(name)[self._rows]

    @property
    def slot_names(self) -> tuple[str, ...]:
        return self.table.slot_names

    @property
    def slots(self) -> dict[str, np.ndarray]:
        return {n: self.slot(n) for n in self.slot_names}

    @property
    def storage(self) -> str:
        return self.table.storage

    def flush(self) -> None:
        self.table.flush()

    def sequential_access(self):
        return self.table.sequential_access()
