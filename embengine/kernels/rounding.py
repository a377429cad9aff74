"""Stochastic rounding and widening of 16-bit values in numba: the scalar twins of
``embengine.precision`` (the rule and the random stream are documented there), giving the same
bits (tests/test_rounding.py).

The update kernels of a 16-bit table call ``load`` on copy-in (widen to float32) and
``round_bits`` on write-back; ``row_hash`` is taken once per row and ``value_bits`` per value.
``widen_rows`` gathers rows widened to float32 for the lookups.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ..precision import BF16, F32
from . import kernel

__all__ = [
    "f32_from_bits",
    "bits_from_f32",
    "mix",
    "row_hash",
    "value_bits",
    "round_bits",
    "widen_bits",
    "load",
    "store",
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
def value_bits(rh, column):
    """64 random bits of one value: ``mix(row_hash + column * G)``."""
    return mix(rh + np.uint64(np.int64(column)) * _GOLDEN)


# Not inlined into numba IR (LLVM may still inline it): every load and store site of a half
# kernel would carry both dtypes' paths, and the parallel kernels compiled twice as slowly.
@kernel()
def round_bits(x, kind, bits):
    """float32 ``x`` stochastically rounded to ``kind`` (BF16 or F16): its uint16 bits."""
    x = np.float32(x)
    u = bits_from_f32(x)
    if kind == BF16:
        if x != x:
            return np.uint16(((u >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0))
        return np.uint16((np.uint64(u) + (bits & np.uint64(0xFFFF))) >> np.uint64(16))
    sign = np.uint16((u >> np.uint32(16)) & np.uint32(0x8000))
    if x != x:
        return np.uint16(0x7E00) | sign
    mag = np.uint64(u & np.uint32(0x7FFFFFFF))
    a = abs(x)
    if a < np.float32(2.0**-14):
        m = a * np.float32(16777216.0)
        fl = np.floor(m)
        uniform = np.float32((bits >> np.uint64(40)) & np.uint64(0xFFFFFF)) * np.float32(2.0**-24)
        up = 1 if uniform < m - fl else 0
        return np.uint16(np.int64(fl) + up) | sign
    b = (mag + (bits & np.uint64(0x1FFF))) & ~np.uint64(0x1FFF)
    e = np.int64(b >> np.uint64(23)) - 112
    if e >= 31:
        return np.uint16(0x7C00) | sign
    return np.uint16((e << 10) | np.int64((b >> np.uint64(13)) & np.uint64(0x3FF))) | sign


# Not inlined into numba IR, as round_bits.
@kernel()
def widen_bits(h, kind):
    """uint16 bits of kind BF16 or F16 as float32 (exact)."""
    h32 = np.uint32(h)
    if kind == BF16:
        return f32_from_bits(h32 << np.uint32(16))
    sign = (h32 & np.uint32(0x8000)) << np.uint32(16)
    e = (h32 >> np.uint32(10)) & np.uint32(0x1F)
    m = h32 & np.uint32(0x3FF)
    if e == 0:  # zero or subnormal: m * 2**-24, exact in float32
        v = np.float32(m) * np.float32(2.0**-24)
        return -v if sign else v
    if e == 31:
        return f32_from_bits(sign | np.uint32(0x7F800000) | (m << np.uint32(13)))
    return f32_from_bits(sign | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13)))


@kernel(inline="always")
def load(h, f, r, c, kind):
    """Value at unit column ``c`` of row ``r`` as float32: ``h`` the uint16 row array, ``f``
    its float32 view (a float32 column starts at an even unit: ``f[r, c // 2]``)."""
    if kind == F32:
        return f[r, c >> 1]
    return widen_bits(h[r, c], kind)


@kernel(inline="always")
def store(h, f, r, c, kind, x, bits):
    """Store float32 ``x`` at unit column ``c`` of row ``r`` (16-bit kinds rounded
    stochastically with ``bits``)."""
    if kind == F32:
        f[r, c >> 1] = x
    else:
        h[r, c] = round_bits(x, kind, bits)


@kernel(parallel=True)
def widen_rows(h, kind, dim, rows, out):
    """``out[i] = widen(h[rows[i], :dim])``; a row of -1 gives zeros."""
    for i in nb.prange(rows.shape[0]):
        r = rows[i]
        if r < 0:
            for j in range(dim):
                out[i, j] = 0.0
        else:
            for j in range(dim):
                out[i, j] = widen_bits(h[r, j], kind)


@kernel()
def round_array(x, kind, key, step, rows, unit, columns, out):
    """``out[i] = round_bits(x[i], kind, value_bits(row_hash(key, step, rows[i], unit),
    columns[i]))``: for tests against ``precision.stochastic_round``."""
    for i in range(x.shape[0]):
        rh = row_hash(key, step, rows[i], unit)
        out[i] = round_bits(x[i], kind, value_bits(rh, columns[i]))


@kernel()
def widen_array(h, kind, out):
    """``out[i] = widen_bits(h[i], kind)``: for tests against ``precision.widen``."""
    for i in range(h.shape[0]):
        out[i] = widen_bits(h[i], kind)
