"""Reduced-precision storage: the dtypes a table may store, and stochastic rounding in NumPy.

A table stores its weights and its float slots as ``float32``, ``float16`` or ``bfloat16``
(``TableConfig.weights_dtype`` / ``slots_dtype``); the math is float32 and every stored value is
rounded *stochastically*: ``x`` between the neighbouring representable values ``lo < hi``
becomes ``hi`` with probability ``(x - lo) / (hi - lo)``, so ``E[round(x)] = x`` and an update
smaller than half a quantum is kept on average (round-to-nearest would drop it every step).

The random bits are a counter-based hash (splitmix64's finaliser) of (the table's key, step,
row, unit, column), 16 per value, one round for four neighbouring unit columns (``hash_bits``),
so they depend on neither thread count nor scheduling. The row is a dense table's row (its id;
a table packing several, each member's key and ids: ``rounding_streams``, so packing
changes no value); a keyed table's key (``KeyedTable.rounding_rows``):
its rows move, its keys' streams do not, and a keyed table fed ids ``0..V-1`` rounds as the
dense table of vocabulary ``V``. This module is the
NumPy side (the reference backend's, vectorised); ``kernels/rounding.py`` holds the numba
side, the same operations on scalars: the two give the same bits (tests/test_rounding.py).

- bfloat16: add the value's 16 random bits to the float32 bits and keep the upper half (a carry
  into the exponent makes Inf at the top of the range; NaN stays a quiet NaN).
- float16: in float16's normal range (``|x| >= 2**-14``) add 13 of the random bits to the
  float32 bits and keep the upper 10 mantissa bits; an exponent past float16's is Inf (the
  update's result guard then refuses the row). Below, float16's quantum is ``2**-24``: the
  value ``m = |x| * 2**24`` rounds up iff the uniform ``u`` (the 16 bits times ``2**-16``) is
  below ``m - floor(m)``: unbiased to within ``2**-16`` of a quantum.

Importing this module does not import numba.
"""

from __future__ import annotations

import zlib

import numpy as np

__all__ = [
    "DTYPES",
    "KIND",
    "F32",
    "BF16",
    "F16",
    "check_dtype",
    "numpy_dtype",
    "table_key",
    "hash_bits",
    "round_bf16",
    "round_f16",
    "stochastic_round",
    "widen",
    "nearest",
    "rounding_places",
    "rounding_streams",
    "check_initial",
    "check_initial_slots",
    "initial_bound",
]

# The stored dtypes a table may have, and their codes in the kernels.
DTYPES = ("float32", "float16", "bfloat16")
F32, F16, BF16 = 0, 1, 2
KIND = {"float32": F32, "float16": F16, "bfloat16": BF16}

_U = np.uint64
# splitmix64's constants
_GOLDEN = _U(0x9E3779B97F4A7C15)
_M1 = _U(0xBF58476D1CE4E5B9)
_M2 = _U(0x94D049BB133111EB)


def check_dtype(where: str, field: str, value) -> str:
    """``value`` if it names a stored dtype, else ValueError naming ``where`` and the value."""
    if not isinstance(value, str) or value not in DTYPES:
        raise ValueError(
            f"{where}: {field} must be one of {list(DTYPES)}, got {value!r} (16-bit tables "
            "store rows in half the memory; their updates round stochastically)"
        )
    return value


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a stored dtype's values (``ml_dtypes.bfloat16`` for bfloat16)."""
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:  # pragma: no cover - the bfloat16 and train extras install it
            raise ImportError(
                "a bfloat16 table needs the ml_dtypes package for its arrays' dtype; "
                "pip install 'embengine[bfloat16]' (or ml_dtypes)"
            ) from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def table_key(seed: int, table: str) -> int:
    """A table's key of the rounding stream: the engine seed and the physical table's name."""
    z = (int(seed) & 0xFFFFFFFFFFFFFFFF) ^ (zlib.crc32(table.encode()) << 32)
    return int(_mix(np.asarray(z, dtype=np.uint64)))


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> _U(30))) * _M1
        z = (z ^ (z >> _U(27))) * _M2
    return z ^ (z >> _U(31))


def hash_bits(key: int, step: int, row, unit, column) -> np.ndarray:
    """16 random bits per value (uint64 holding them): bits ``16 * (column % 4)`` and up of
    ``mix(mix(mix(key + step * G) + row * G + unit) + (column // 4) * G)`` (uint64, wrapping;
    G = 0x9E3779B97F4A7C15): one splitmix64 round serves four unit columns of a row.
    ``row``, ``unit``, ``column`` broadcast."""
    with np.errstate(over="ignore"):
        z = _mix(np.asarray(key, dtype=np.uint64) + np.asarray(step).astype(np.uint64) * _GOLDEN)
        z = _mix(
            z
            + np.asarray(row).astype(np.int64).astype(np.uint64) * _GOLDEN
            + np.asarray(unit).astype(np.uint64)
        )
        column = np.asarray(column).astype(np.int64)
        word = _mix(z + (column >> 2).astype(np.uint64) * _GOLDEN)
        return (word >> ((column & 3) * 16).astype(np.uint64)) & _U(0xFFFF)


def round_bf16(x: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """float32 ``x`` stochastically rounded to bfloat16, as uint16 bit patterns."""
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    r = np.asarray(bits, dtype=np.uint64) & _U(0xFFFF)
    out = ((u + r) >> _U(16)).astype(np.uint16)
    nan = np.isnan(x)
    return np.where(nan, ((u >> _U(16)) & _U(0x8000)).astype(np.uint16) | 0x7FC0, out)


def round_f16(x: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """float32 ``x`` stochastically rounded to float16, as uint16 bit patterns."""
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    bits = np.asarray(bits, dtype=np.uint64)
    sign = ((u >> _U(16)) & _U(0x8000)).astype(np.uint16)
    mag = u & _U(0x7FFFFFFF)
    # normal range: 13 random bits below float16's last mantissa bit
    b = (mag + (bits & _U(0x1FFF))) & ~_U(0x1FFF)
    e = (b >> _U(23)).astype(np.int64) - 112
    normal = ((np.clip(e, 0, 31) << 10) | ((b >> _U(13)) & _U(0x3FF)).astype(np.int64)).astype(
        np.uint16
    )
    normal = np.where(e >= 31, np.uint16(0x7C00), normal)
    # below 2**-14: quantum 2**-24, up iff a 16-bit uniform is below the remainder
    a = np.abs(x)
    small = a < np.float32(2.0**-14)
    m = np.where(small, a, np.float32(0.0)) * np.float32(16777216.0)
    fl = np.floor(m)
    uniform = (bits & _U(0xFFFF)).astype(np.float32) * np.float32(2.0**-16)
    sub = (fl.astype(np.int64) + (uniform < m - fl)).astype(np.uint16)
    out = np.where(small, sub, normal)
    out = np.where(np.isnan(x), np.uint16(0x7E00), np.where(np.isinf(x), np.uint16(0x7C00), out))
    return out | sign


def stochastic_round(x: np.ndarray, kind: int, bits: np.ndarray) -> np.ndarray:
    """``x`` rounded to kind ``BF16`` or ``F16`` (uint16 bit patterns)."""
    return round_bf16(x, bits) if kind == BF16 else round_f16(x, bits)


def rounding_places(row_keys: np.ndarray | None, rows: np.ndarray) -> np.ndarray:
    """Each of ``rows``' place in its table's rounding stream (``kernels.rounding.hash_row``'s
    rule on arrays): ``row_keys`` None or empty, the rows (a dense table's rows are its ids);
    one row of three ``[[W, rank, 0]]`` (a row-sharded ShardTable), ``rows W + rank``;
    otherwise column 0 at the rows (a keyed table's keys). A table stacking several logical
    tables (``row_keys`` of four columns): ``rounding_streams``."""
    rows = np.asarray(rows, dtype=np.int64)
    if row_keys is None or row_keys.shape[0] == 0:
        return rows
    if row_keys.shape[1] == 3:
        return rows * row_keys[0, 0] + row_keys[0, 1]
    if row_keys.shape[1] == 4:
        raise ValueError("a stacked table's rows have streams of their own: rounding_streams")
    return row_keys[rows, 0]


def rounding_streams(
    key: int, row_keys: np.ndarray | None, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(each of ``rows``' stream key, its place in that stream): ``key`` (the table's) and
    ``rounding_places``, or, for a table that stacks several logical tables (low-dimensional
    packing: ``row_keys`` of four columns, ``[first row, rows, member's key, 0]`` per member in
    row order), the member's key and the row within the member, so a packed table rounds as
    its members unpacked (``kernels.rounding.row_stream``'s rule on arrays). Keys are uint64."""
    rows = np.asarray(rows, dtype=np.int64)
    if row_keys is None or row_keys.shape[0] == 0 or row_keys.shape[1] != 4:
        keys = np.full(rows.shape, np.uint64(int(key) & 0xFFFFFFFFFFFFFFFF), dtype=np.uint64)
        return keys, rounding_places(row_keys, rows)
    ends = row_keys[:, 0] + row_keys[:, 1]
    member = np.minimum(np.searchsorted(ends, rows, side="right"), len(row_keys) - 1)
    return row_keys[member, 2].view(np.uint64), rows - row_keys[member, 0]


def widen(h: np.ndarray, kind: int) -> np.ndarray:
    """uint16 bit patterns of kind ``BF16`` or ``F16`` as float32 (exact)."""
    h = np.asarray(h, dtype=np.uint16)
    if kind == BF16:
        return (h.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return h.view(np.float16).astype(np.float32)


def nearest(x: np.ndarray, kind: int) -> np.ndarray:
    """Round-to-nearest-even to kind ``BF16`` or ``F16`` (uint16 bits): only for values that
    are not the result of an update (initial values, loaded checkpoints), never for stored
    updates (it would lose every update below half a quantum)."""
    x = np.asarray(x, dtype=np.float32)
    if kind == F16:
        with np.errstate(over="ignore"):
            return x.astype(np.float16).view(np.uint16)
    return x.astype(numpy_dtype("bfloat16")).view(np.uint16)


# The smallest magnitude that rounds to nearest to Inf: halfway past each dtype's largest
# value (float16 65504, bfloat16 0x7F7F), ties going to the even Inf.
_TO_INF = {"float16": 65520.0, "bfloat16": float(np.uint32(0x7F7F8000).view(np.float32))}


def check_initial(
    table: str, dtype: str, values, what: str, first_row: int = 0, ids=None, label: str = "row"
) -> None:
    """A ValueError naming ``table`` and ``what`` if a finite value of ``values`` (initial
    values: a scalar, or rows from ``first_row``, or of ``ids``, each named ``label``) would
    be stored as Inf in ``dtype``: initial
    values are rounded to nearest, and a float16 table given 1e5 held Inf rows, silently (a
    NumPy warning at most; every lookup of them Inf, every update refused)."""
    limit = _TO_INF.get(dtype)
    if limit is None:  # float32: the initializers keep their values within its range
        return
    values = np.asarray(values)
    # float32 rows compared as they are (the limits are float32 values): no float64 copy
    a = np.abs(values if values.dtype == np.float32 else values.astype(np.float64))
    if not (a >= limit).any():  # NaN compares False; Inf is not finite: checked below
        return
    over = np.isfinite(a) & (a >= limit)
    if not over.any():
        return
    at = np.unravel_index(int(np.argmax(over)), over.shape)
    value = float(np.asarray(values, dtype=np.float64)[at])
    if over.ndim:
        row = f" ({label} {first_row + int(at[0]) if ids is None else int(ids[at[0]])})"
    else:
        row = ""
    largest = 65504.0 if dtype == "float16" else float(widen(np.uint16(0x7F7F), BF16))
    raise ValueError(
        f"table {table!r}: {what} gives {value!r}{row}, beyond {dtype}'s range (largest "
        f"{largest:.7g}): stored in {dtype} it would be Inf. Use smaller initial values, or "
        "a wider weights_dtype / slots_dtype"
    )


def check_initial_slots(table: str, slots_dtype: str, slot_specs) -> None:
    """``check_initial`` of each float slot's initial value in ``slots_dtype`` (int32 slots,
    such as Adam's per-row steps, are not rounded)."""
    for spec in slot_specs:
        if spec.dtype == "float32":
            check_initial(table, slots_dtype, spec.initial_value, f"slot {spec.name!r}'s value")


def initial_bound(initializer, dim: int) -> float | None:
    """The largest magnitude a built-in random or constant initializer gives (None: unknown,
    e.g. ``FromFunction``, or a row id's): what ``check_initial`` checks before any row of a
    keyed table exists."""
    from .initializers import Constant, RandomUniform, TruncatedNormal, Zeros

    if type(initializer) in (Zeros,):
        return 0.0
    if type(initializer) is Constant:
        return abs(float(initializer.value))
    if type(initializer) is RandomUniform:
        return max(abs(float(initializer.minval)), abs(float(initializer.maxval)))
    if type(initializer) is TruncatedNormal:
        fill = initializer.fill(dim)
        return abs(float(fill.a)) + 2.0 * float(fill.b)
    return None
