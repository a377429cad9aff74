"""Stochastic rounding and widening of 16-bit values in numba: the scalar twins of
``embengine.precision`` (the rule and the random stream are documented there), giving the same
bits (tests/test_rounding.py).

The update kernels of a 16-bit table (rendered per stored dtype pair, codegen's HALF_UPDATE)
call ``widen_bf16`` / ``widen_f16`` on copy-in and ``round_bf16`` / ``round_f16`` on
write-back. These are called, not inlined into numba's IR: LLVM inlines them where it pays, and
inlined into every site they made the kernels compile a fifth slower for no measurable speed
(docs/performance.md, "Figures behind the code"). The in-place kernels, whose guard checks
each value before it is rounded, call ``round_bf16_finite`` / ``round_f16_finite``: the same
bits without the NaN case (a compare and a select per vector). Random bits: ``row_hash`` once
per row, then ``random_words`` (one splitmix64 round per four unit columns, 16 bits each).
``widen_rows`` gathers rows widened to float32 for deduplicated evaluation lookups.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from ..precision import BF16
from . import kernel

__all__ = [
    "as_f32",
    "f32_from_bits",
    "bits_from_f32",
    "mix",
    "row_hash",
    "hash_row",
    "row_stream",
    "random_words",
    "unit_bits",
    "widen_bf16",
    "widen_f16",
    "round_bf16",
    "round_bf16_finite",
    "round_f16",
    "round_f16_finite",
    "round_bits",
    "widen_bits",
    "widen_rows",
    "round_array",
    "widen_array",
]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


@intrinsic
def f32_from_bits(typingctx, u):
    """The float32 whose bit pattern is the uint32 ``u``."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def bits_from_f32(typingctx, x):
    """The bit pattern (uint32) of the float32 ``x``."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@kernel(inline="always")
def mix(z):
    """splitmix64's finaliser on a uint64 (wrapping)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@kernel(inline="always")
def row_hash(key, step, row, unit):
    """The per-row part of the hash: ``mix(mix(key + step * G) + row * G + unit)``."""
    z = mix(np.uint64(key) + np.uint64(step) * _GOLDEN)
    return mix(z + np.uint64(np.int64(row)) * _GOLDEN + np.uint64(unit))


@kernel(inline="always")
def hash_row(row_keys, r):
    """Row ``r``'s place in its table's rounding stream (``precision.rounding_places``): its
    key for a keyed table (``row_keys``: its records as int64, the key in column 0), whose
    rows move (a restore lays them out in key order), so a key's stream does not; its id for a
    row-sharded ShardTable (``row_keys`` one row of three ``[[W, rank, 0]]``: row r holds id
    ``r W + rank``, computed, where a table of ids would cost a cache miss a row); its row
    (= its id) for a dense table (``row_keys`` empty)."""
    if row_keys.shape[1] == 3:
        return np.int64(r) * row_keys[0, 0] + row_keys[0, 1]
    if row_keys.shape[0] != 0:
        return row_keys[r, 0]
    return np.int64(r)


@kernel(inline="always")
def row_stream(key, step, row_keys, r, unit):
    """Row ``r``'s ``row_hash`` for update ``unit``: ``row_hash(key, step, hash_row(row_keys,
    r), unit)``, but for a table that stacks several logical tables (low-dimensional packing:
    ``row_keys`` of four columns, ``[first row, rows, member's key, 0]`` per member in row
    order), the member's own stream: its key and the row within it, so a packed table rounds
    as its members would unpacked (``precision.rounding_streams``)."""
    if row_keys.shape[1] == 4:
        last = row_keys.shape[0] - 1
        for s in range(last + 1):
            first = row_keys[s, 0]
            if s == last or np.int64(r) < first + row_keys[s, 1]:
                return row_hash(np.uint64(row_keys[s, 2]), step, np.int64(r) - first, unit)
    return row_hash(key, step, hash_row(row_keys, r), unit)


@kernel(inline="always")
def random_words(rh, words, first):
    """``words[q] = mix(rh + q * G)`` for q from ``first`` on: a row's random bits, 16 per
    unit column (unit ``c`` takes bits ``16 * (c % 4)`` and up of word ``c // 4``, which is
    ``words.view(np.uint16)[c]`` on a little-endian host, the only kind numba targets here;
    ``precision.hash_bits`` takes them by shifts). Words below ``first`` hold no 16-bit value."""
    for q in range(first, words.shape[0]):
        words[q] = mix(rh + np.uint64(q) * _GOLDEN)


@kernel(inline="always")
def unit_bits(rh, column):
    """The 16 random bits of unit column ``column`` of a row (``random_words``, one value)."""
    word = mix(rh + np.uint64(np.int64(column) >> 2) * _GOLDEN)
    return np.uint16((word >> np.uint64((np.int64(column) & 3) * 16)) & np.uint64(0xFFFF))


@kernel()
def widen_bf16(h):
    """bfloat16 bits ``h`` as float32 (exact: the bits shifted up)."""
    return f32_from_bits(np.uint32(h) << np.uint32(16))


@kernel()
def widen_f16(h):
    """float16 bits ``h`` as float32 (exact)."""
    h32 = np.uint32(h)
    sign = (h32 & np.uint32(0x8000)) << np.uint32(16)
    e = (h32 >> np.uint32(10)) & np.uint32(0x1F)
    m = h32 & np.uint32(0x3FF)
    if e == 0:  # zero or subnormal: m * 2**-24, exact in float32
        v = np.float32(m) * np.float32(2.0**-24)
        return -v if sign else v
    if e == 31:
        return f32_from_bits(sign | np.uint32(0x7F800000) | (m << np.uint32(13)))
    return f32_from_bits(sign | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13)))


@kernel()
def round_bf16_finite(x, bits):
    """``round_bf16`` of a float32 ``x`` that is not NaN (a NaN's bits may carry into its sign:
    garbage). For kernels whose guard puts back any row with a NaN before rounding."""
    u = bits_from_f32(np.float32(x))
    return np.uint16((u + (np.uint32(bits) & np.uint32(0xFFFF))) >> np.uint32(16))


@kernel()
def round_bf16(x, bits):
    """float32 ``x`` stochastically rounded to bfloat16 with the 16 random ``bits``: its bits.
    Only a NaN's bits could carry past 32 bits, and NaN is set apart."""
    u = bits_from_f32(np.float32(x))
    nan = np.uint16(((u >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0))
    return nan if x != x else round_bf16_finite(x, bits)


@kernel()
def round_f16(x, bits):
    """float32 ``x`` stochastically rounded to float16 with the 16 random ``bits``: its bits."""
    x = np.float32(x)
    if x != x:
        sign = np.uint16((bits_from_f32(x) >> np.uint32(16)) & np.uint32(0x8000))
        return np.uint16(0x7E00) | sign
    return round_f16_finite(x, bits)


@kernel()
def round_f16_finite(x, bits):
    """``round_f16`` of a float32 ``x`` that is not NaN (a NaN gives garbage), as
    ``round_bf16_finite``."""
    x = np.float32(x)
    u = bits_from_f32(x)
    b16 = np.uint32(bits) & np.uint32(0xFFFF)
    sign = np.uint16((u >> np.uint32(16)) & np.uint32(0x8000))
    a = abs(x)
    if a < np.float32(2.0**-14):
        m = a * np.float32(16777216.0)
        fl = np.floor(m)
        up = 1 if np.float32(b16) * np.float32(2.0**-16) < m - fl else 0
        return np.uint16(np.int64(fl) + up) | sign
    mag = u & np.uint32(0x7FFFFFFF)
    b = (mag + (b16 & np.uint32(0x1FFF))) & ~np.uint32(0x1FFF)
    e = np.int64(b >> np.uint32(23)) - 112
    if e >= 31:
        return np.uint16(0x7C00) | sign
    return np.uint16((e << 10) | np.int64((b >> np.uint32(13)) & np.uint32(0x3FF))) | sign


@kernel()
def round_bits(x, kind, bits):
    """float32 ``x`` stochastically rounded to ``kind`` (BF16 or F16): its uint16 bits."""
    if kind == BF16:
        return round_bf16(x, bits)
    return round_f16(x, bits)


@kernel()
def widen_bits(h, kind):
    """uint16 bits of kind BF16 or F16 as float32 (exact)."""
    if kind == BF16:
        return widen_bf16(h)
    return widen_f16(h)


def as_f32(x, kind):
    """A table value as float32: a float32 as it is, uint16 bits of ``kind`` (BF16 or F16)
    widened (exact). For kernels that read float32 and 16-bit rows alike (``lookup._pool_rows``):
    the float32 specialisation is the plain load, and with ``kind`` a constant the other
    compiles to one widening."""
    raise NotImplementedError("as_f32 is for numba kernels")


@overload(as_f32, inline="always")
def _as_f32(x, kind):
    if isinstance(x, types.Float):
        return lambda x, kind: x
    if x == types.uint16:

        def widen(x, kind):
            if kind == BF16:
                return widen_bf16(x)
            return widen_f16(x)

        return widen
    return None


@kernel(parallel=True)
def widen_rows(h, kind, dim, rows, out):
    """``out[i] = widen(h[rows[i], :dim])``; a row of -1 gives zeros."""
    for i in nb.prange(rows.shape[0]):
        r = rows[i]
        if r < 0:
            for j in range(dim):
                out[i, j] = 0.0
        elif kind == BF16:
            for j in range(dim):
                out[i, j] = widen_bf16(h[r, j])
        else:
            for j in range(dim):
                out[i, j] = widen_f16(h[r, j])


@kernel()
def round_array(x, kind, key, step, rows, unit, columns, out):
    """``out[i] = round_bits(x[i], kind, unit_bits(row_hash(key, step, rows[i], unit),
    columns[i]))``: for tests against ``precision.stochastic_round``."""
    for i in range(x.shape[0]):
        rh = row_hash(key, step, rows[i], unit)
        out[i] = round_bits(x[i], kind, unit_bits(rh, columns[i]))


@kernel()
def widen_array(h, kind, out):
    """``out[i] = widen_bits(h[i], kind)``: for tests against ``precision.widen``."""
    for i in range(h.shape[0]):
        out[i] = widen_bits(h[i], kind)
