"""The safetensors file format, written and read in chunks, with a SHA-256 of every file.

A safetensors file is an 8-byte little-endian header length, a JSON header (tensor name ->
dtype, shape, byte offsets; optional ``__metadata__`` of strings), then the raw little-endian
bytes. Files written here load with the ``safetensors`` package, and vice versa. Writing and
reading go through fixed-size chunks of rows, so a table larger than RAM (a ``np.memmap``, or a
strided view of the packed storage) never needs a second copy in memory. Nothing is pickled.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import BinaryIO

import numpy as np

__all__ = [
    "write_safetensors",
    "read_header",
    "read_tensor",
    "TensorRows",
    "sha256_file",
    "DTYPES",
]

DTYPES = {
    np.dtype(np.float64): "F64",
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(np.int32): "I32",
    np.dtype(np.int64): "I64",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint8): "U8",
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint16): "U16",
}
NUMPY = {v: k for k, v in DTYPES.items()}
# "BF16" tensors are read as their bits (numpy has no bfloat16; callers view them as
# ml_dtypes.bfloat16 where they want the values)
NUMPY["BF16"] = np.dtype(np.uint16)
try:  # bfloat16 arrays (a 16-bit table's views) are written as "BF16", and read as bits
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # ml_dtypes comes with the train and bfloat16 extras, not numpy alone
    # bfloat16 bits still need a dtype of their own to be written as "BF16" (an export's
    # bf16 tables): a record of one uint16, which is all a writer does with them
    BFLOAT16 = np.dtype([("bfloat16_bits", "<u2")])
DTYPES[BFLOAT16] = "BF16"
CHUNK_BYTES = 64 << 20
_MAX_HEADER = 100 << 20


def _chunks(array: np.ndarray) -> Iterable[np.ndarray]:
    """C-ordered slabs of rows of at most CHUNK_BYTES each."""
    if array.ndim == 0 or array.shape[0] == 0:
        yield np.ascontiguousarray(array)
        return
    row_bytes = max(1, array.nbytes // array.shape[0])
    step = max(1, CHUNK_BYTES // row_bytes)
    for lo in range(0, array.shape[0], step):
        yield np.ascontiguousarray(array[lo : lo + step])


def write_safetensors(
    path: str | Path,
    tensors: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
    on_chunk: Callable[[str, np.ndarray], None] | None = None,
) -> str:
    """Write ``tensors`` to ``path`` in chunks, fsync it, and return its SHA-256 (hex).

    ``on_chunk(name, chunk)`` sees every C-contiguous chunk of rows as it is written, so a
    caller can inspect a table (e.g. for NaN) without reading it a second time."""
    header: dict = {}
    offset = 0
    for name, array in tensors.items():
        dtype = DTYPES.get(np.dtype(array.dtype))
        if dtype is None:
            raise TypeError(f"tensor {name!r}: dtype {array.dtype} has no safetensors name")
        header[name] = {
            "dtype": dtype,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align the data to 8 bytes, as the reference writer does
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for piece in (struct.pack("<Q", len(raw)), raw):
            f.write(piece)
            digest.update(piece)
        for name, array in tensors.items():
            for chunk in _chunks(array):
                if on_chunk is not None:
                    on_chunk(name, chunk)
                if chunk.dtype == BFLOAT16:  # its bits, as a "BF16" tensor holds them
                    chunk = chunk.view(np.uint16)
                data = chunk.astype(chunk.dtype.newbyteorder("<"), copy=False).tobytes()
                f.write(data)
                digest.update(data)
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest()


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _entry_problem(info, data_bytes: int) -> str | None:
    """Why a header entry is unusable, or None. ``data_bytes``: the bytes after the header."""
    if not isinstance(info, dict):
        return f"is {type(info).__name__}, not an object"
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in NUMPY:
        return f"has dtype {dtype!r} (not one of {sorted(NUMPY)})"
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        return f"has shape {shape!r} (not a list of ints >= 0)"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))):
        return f"has data_offsets {offsets!r} (not a list of two ints)"
    lo, hi = offsets
    if not 0 <= lo <= hi <= data_bytes:
        return f"lies outside the file (data_offsets {offsets}, {data_bytes} data bytes)"
    # Python ints: a forged shape cannot overflow into a small product.
    need = math.prod(shape) * NUMPY[dtype].itemsize
    if hi - lo != need:
        return f"has {hi - lo} bytes of data, its {dtype} shape {shape} needs {need}"
    return None


def read_header(path: str | Path, file: BinaryIO | None = None) -> tuple[dict, int]:
    """(header without __metadata__ plus it under "__metadata__", data start offset).

    Every tensor entry is checked before it is returned: a known dtype, a shape of ints >= 0,
    and a data range inside the file holding exactly the bytes its shape needs, so a small file
    can never declare a tensor larger than itself (ValueError naming the file and tensor); and,
    as the ``safetensors`` package requires, the ranges follow each other without gaps or
    overlaps (no tensor reads another's bytes) and end at the file's end.

    ``file``: ``path`` already open (binary, at any position), e.g. the file a caller then maps:
    the header and the size it is checked against are then that file's (fstat), whatever
    ``path`` names by now."""
    path = Path(path)
    if file is None:
        with open(path, "rb") as f:
            return _read_header(path, f)
    return _read_header(path, file)


def _read_header(path: Path, f: BinaryIO) -> tuple[dict, int]:
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    head = f.read(8)
    if len(head) != 8:
        raise ValueError(f"{path}: not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", head)
    if n > min(_MAX_HEADER, size - 8):
        raise ValueError(f"{path}: not a safetensors file (header length {n})")
    try:
        header = json.loads(f.read(n))
    except (ValueError, RecursionError) as e:  # JSON, UTF-8, too many digits, too deep
        raise ValueError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header (not an object)")
    start = 8 + n
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict):
                raise ValueError(
                    f"{path}: corrupt safetensors header (__metadata__ is {type(info).__name__})"
                )
            continue
        problem = _entry_problem(info, size - start)
        if problem is not None:
            raise ValueError(f"{path}: tensor {name!r} {problem}")
    _check_layout(path, header, size - start)
    return header, start


def _check_layout(path: Path, header: dict, data_bytes: int) -> None:
    """What the ``safetensors`` package requires of checked entries: their data ranges, in
    the order of their offsets, follow each other without a gap or an overlap and end at the
    file's end. Two tensors on the same bytes (one read as the other) or bytes no tensor holds
    are a ValueError naming the file and the tensor."""
    ranges = sorted(
        (*info["data_offsets"], name) for name, info in header.items() if name != "__metadata__"
    )
    end = 0
    for lo, hi, name in ranges:
        if lo != end:
            how = "overlaps another tensor's" if lo < end else f"leaves bytes {end}:{lo} unused"
            raise ValueError(
                f"{path}: tensor {name!r} (data_offsets [{lo}, {hi}]) {how}; safetensors "
                "requires the tensors' data to follow each other, without gaps or overlaps"
            )
        end = hi
    if end != data_bytes:
        raise ValueError(
            f"{path}: the tensors' data ends at byte {end}, the file holds {data_bytes} data "
            "bytes (trailing bytes); safetensors requires the data to end with the file"
        )


def read_tensor(
    path: str | Path,
    name: str,
    out: np.ndarray | None = None,
    header: tuple[dict, int] | None = None,
) -> np.ndarray:
    """Tensor ``name`` of a file: copied chunk by chunk into ``out`` (any writable array or
    strided view of the right shape), or returned as a read-only memory map.

    The copy into ``out`` uses ordinary reads, not a memory map: a file truncated after its
    header was read is then a ValueError (short read), not a SIGBUS that kills the process."""
    meta, start = header if header is not None else read_header(path)
    if name not in meta or name == "__metadata__":
        raise KeyError(f"{path}: no tensor {name!r}")
    info = meta[name]
    dtype = NUMPY[info["dtype"]].newbyteorder("<")
    shape = tuple(info["shape"])
    lo, hi = info["data_offsets"]
    if hi - lo != math.prod(shape) * dtype.itemsize:  # a header not from read_header
        raise ValueError(f"{path}: tensor {name!r} has {hi - lo} bytes for shape {shape}")
    if out is None:
        if hi > lo:
            return np.memmap(path, dtype=dtype, mode="r", offset=start + lo, shape=shape)
        return np.zeros(shape, dtype=dtype)
    if out.shape != shape:
        raise ValueError(f"{path}: tensor {name!r} has shape {shape}, expected {out.shape}")
    if out.dtype == BFLOAT16 and info["dtype"] == "BF16":  # copy the bits
        out = out.view(np.uint16)
    if out.size == 0:
        return out
    target = out.reshape(1) if out.ndim == 0 else out  # a 0-d array: one row of one value
    rows = target.shape[0]
    row_bytes = (hi - lo) // rows
    step = max(1, CHUNK_BYTES // max(1, row_bytes))
    buffer = np.empty((min(step, rows), *target.shape[1:]), dtype=dtype)  # reused: no new pages
    with open(path, "rb") as f:
        f.seek(start + lo)
        for i in range(0, rows, step):
            chunk = buffer[: min(step, rows - i)]
            got = f.readinto(memoryview(chunk).cast("B"))
            if got != chunk.nbytes:
                raise ValueError(
                    f"{path}: tensor {name!r} ends early: the file is shorter than its header "
                    "says (truncated while being read?)"
                )
            target[i : i + len(chunk)] = chunk
    return out


class TensorRows:
    """Tensor ``name`` of a checked file (``header``: read_header's), read on demand with
    ordinary reads, never mapped: ``rows[lo:hi]`` is a new array of those rows (of the first
    axis), ``np.asarray(rows)`` the whole tensor. What export reads a checkpoint's tables
    through: as large as the file, never in memory at once, and a file shortened after it was
    checked is a ValueError naming it, its size and the size its header gives (``advice``
    appended: what to do), not a SIGBUS that kills the process, as a memory map's rows past the
    file's end would.

    ``dtype``: the rows' dtype if not the stored one's (``BFLOAT16`` for a "BF16" tensor's
    bits, read as uint16); of the same item size."""

    def __init__(
        self,
        path: str | Path,
        name: str,
        header: tuple[dict, int],
        dtype: np.dtype | None = None,
        advice: str = "",
    ):
        meta, start = header
        if name not in meta or name == "__metadata__":
            raise KeyError(f"{path}: no tensor {name!r}")
        info = meta[name]
        self.path, self.name, self._advice = Path(path), name, advice
        self._stored = NUMPY[info["dtype"]].newbyteorder("<")
        self.dtype = self._stored if dtype is None else np.dtype(dtype)
        if self.dtype.itemsize != self._stored.itemsize:
            raise ValueError(f"{path}: tensor {name!r} is {info['dtype']}, not {self.dtype}")
        self.shape = tuple(info["shape"])
        lo, hi = info["data_offsets"]
        if hi - lo != math.prod(self.shape) * self._stored.itemsize:  # not from read_header
            raise ValueError(f"{path}: tensor {name!r} has {hi - lo} bytes for shape {self.shape}")
        self._offset = start + lo
        # The file's size as checked: read_header's data ranges end at the file's end.
        self._file_bytes = start + max(
            (e["data_offsets"][1] for n, e in meta.items() if n != "__metadata__"), default=0
        )
        self._row_bytes = math.prod(self.shape[1:]) * self._stored.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __getitem__(self, key) -> np.ndarray:
        """Rows ``lo:hi`` (a slice of the first axis, step 1) as a new array."""
        if not self.shape or not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"{self.path}: tensor {self.name!r} is read by slices of rows")
        lo, hi, _ = key.indices(self.shape[0])
        return self._read(lo, max(lo, hi))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self._read(0, self.shape[0]) if self.shape else self._read(0, 1).reshape(())
        return whole if dtype is None else whole.astype(dtype, copy=False)

    def _read(self, lo: int, hi: int) -> np.ndarray:
        out = np.empty((hi - lo, *self.shape[1:]), dtype=self._stored)
        if out.nbytes:
            at = self._offset + lo * self._row_bytes
            with open(self.path, "rb") as f:
                f.seek(at)
                got = f.readinto(memoryview(out).cast("B"))
            if got != out.nbytes:
                size = os.stat(self.path).st_size
                raise ValueError(
                    f"{self.path} has {size:,} bytes, its header says {self._file_bytes:,}: it "
                    f"was truncated after it was checked, and tensor {self.name!r} ends early "
                    f"(bytes {at:,} to {at + out.nbytes:,} wanted){self._advice}"
                )
        return out if self.dtype == self._stored else out.view(self.dtype)


def sha256_file(path: str | Path, progress: Callable[[int], None] | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK_BYTES):
            digest.update(block)
            if progress is not None:
                progress(len(block))
    return digest.hexdigest()
