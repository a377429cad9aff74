"""Gather + combine: one activation row per (sample) or (sample, position), in parallel.

Each activation row is owned by one thread, so there are no atomics: row ``o`` sums
``gains[k] * data[rows[inverse[k]]]`` over its occurrences ``k`` (the CSR ``output_offsets``),
``rows`` being the batch's resolved rows (``TableBatch.unique_rows``). A row of -1 (the storage
has none for that id) adds nothing: the id pools as zeros. The kernels index rows, never ids.
Optional simulated quantization (TPU QuantizationConfig) rounds every gathered value to one of
``num_buckets`` levels in ``[lower, upper]`` before it is combined.

Lookup-only batches (no update follows) have no occurrence arrays: ``pool_bags`` pools one
feature straight from its rows (for a storage whose rows are ids at a base, the ids, with
``data`` the rows from that base on) and offsets, computing each id's combiner gain on the way, with
the same arithmetic in the same order (so the same bits) as ``pool`` on the prepared batch.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from ..precision import BF16, F16, F32
from . import FIXED_DIMS, kernel
from ._intrinsics import prefetch_row, stack_row
from .prepare import SUM, bag_denominator, bag_gain
from .rounding import as_f32

# Output rows per parallel task: enough work to amortise scheduling, small enough to balance.
ROWS_PER_TASK = 64
# Occurrences ahead whose table row is requested while the current one is added (tuned on
# W1; see docs/performance.md).
PREFETCH_DISTANCE = 16


@kernel(inline="always")
def _pool_rows(
    data, dim, rows, inverse, gains, output_offsets, out, quant, prefetch, first, stop, acc, kind
):
    """Activation rows ``first:stop`` (one task); see ``pool``. ``acc``: a scratch row.
    ``data``: float32 rows, or a 16-bit table's uint16 rows of weights of ``kind`` (BF16 or
    F16, ``rounding.as_f32``), widened as they are read (the same values as widened rows)."""
    buckets = quant[0]
    lower = quant[1]
    upper = quant[2]
    quantum = (upper - lower) / (buckets - 1.0) if buckets > 0 else 1.0
    last_k = output_offsets[stop]
    # The sum builds in a scratch row, not in ``out``: LLVM cannot rule out that ``out``
    # aliases ``data``, so it would store and reload it after every occurrence (its cost on
    # W1: docs/performance.md, "Figures behind the code").
    # For fixed dims the scratch row is on the stack and lives in registers (stack_row).
    # Indexed accesses, not row views: a view per occurrence costs atomic reference counts.
    # The quantization test sits outside the loops over occurrences: a branch inside them
    # costs registers (the sum spills to the stack) and the fused multiply-add.
    for o in range(first, stop):
        for j in range(dim):
            acc[j] = 0.0
        if buckets > 0:
            for k in range(output_offsets[o], output_offsets[o + 1]):
                if k + prefetch < last_k:
                    prefetch_row(data, rows[inverse[k + prefetch]], dim)
                r = rows[inverse[k]]
                if r < 0:  # no row: adds nothing
                    continue
                gk = gains[k]
                for j in range(dim):
                    x = min(max(np.float64(as_f32(data[r, j], kind)), lower), upper)
                    x = np.floor((x - lower) / quantum + 0.5) * quantum + lower
                    acc[j] += np.float32(gk * x)
        else:
            for k in range(output_offsets[o], output_offsets[o + 1]):
                if k + prefetch < last_k:
                    prefetch_row(data, rows[inverse[k + prefetch]], dim)
                r = rows[inverse[k]]
                if r < 0:
                    continue
                gk = gains[k]
                for j in range(dim):
                    acc[j] += gk * as_f32(data[r, j], kind)
        for j in range(dim):
            out[o, j] = acc[j]


def _make_pool(fixed_dim: int):
    """``pool`` with the row width ``fixed_dim`` a compile-time constant (0: any width, the
    ``dim`` argument): LLVM then unrolls the loops over the row and keeps the sum in
    registers, in a stack scratch row (W1-lookup's gain from each: docs/performance.md,
    "Figures behind the code"). numba caches each closure under its own constant, and prunes
    the branch on it before typing."""

    @kernel(parallel=True)
    def pool(data, dim, rows, inverse, gains, output_offsets, out, quant, prefetch):
        """out[o, :] = sum over k in occurrences(o) of gains[k] * q(data[rows[inverse[k]],
        :dim]) (terms with a row of -1 left out).

        ``quant`` is float64 [3]: (num_buckets, lower, upper); num_buckets == 0 means no
        quantization. ``pool_kernel(dim)`` gives a faster kernel for common dims.
        """
        n_out = out.shape[0]
        for task in nb.prange((n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
            first = task * ROWS_PER_TASK
            if fixed_dim:
                width = fixed_dim
                acc = stack_row(fixed_dim)
            else:
                width = dim
                acc = np.empty(dim, dtype=np.float32)
            _pool_rows(
                data,
                width,
                rows,
                inverse,
                gains,
                output_offsets,
                out,
                quant,
                prefetch,
                first,
                min(n_out, first + ROWS_PER_TASK),
                acc,
                F32,
            )

    return pool


pool = _make_pool(0)


# Common dims get their own kernel, each compiled on first use; other dims use ``pool``.
_FIXED_DIMS = {d: _make_pool(d) for d in FIXED_DIMS}


def pool_kernel(dim: int):
    """The pooling kernel for rows of ``dim`` floats (same arguments and results as ``pool``)."""
    return _FIXED_DIMS.get(int(dim), pool)


@kernel(inline="always")
def _pool_bag_range(
    data,
    dim,
    rows,
    offsets,
    weights,
    combiner,
    seq_len,
    out,
    out_start,
    quant,
    prefetch,
    first,
    stop,
    acc,
    kind,
):
    """Samples ``first:stop`` of one feature (one task); see ``pool_bags``. ``acc``: a scratch
    row (see _pool_rows); ``kind``: the rows' values, as ``_pool_rows``'s (a constant of the
    caller, so the widening compiles to one path)."""
    buckets = quant[0]
    lower = quant[1]
    upper = quant[2]
    quantum = (upper - lower) / (buckets - 1.0) if buckets > 0 else 1.0
    w_base = 0 if weights.shape[0] > 0 else -1  # no weights: all ones
    # A sequence position holds one id with gain 1 (its weight is not used): as a SUM bag.
    comb = combiner if seq_len == 0 else SUM
    last_k = offsets[stop]
    for b in range(first, stop):
        start = offsets[b]
        end = offsets[b + 1]
        n_rows = 1
        if seq_len > 0:
            n_rows = seq_len
            end = min(end, start + seq_len)
        # Gains as kernels.prepare computes them (the same helpers), so the same bits.
        denom = bag_denominator(weights, w_base, start, end, comb)
        for pos in range(n_rows):
            for j in range(dim):
                acc[j] = 0.0
            # A bag sums all its ids; a sequence feature's row ``pos`` holds only id ``pos``.
            k_lo = start if seq_len == 0 else start + pos
            k_hi = end if seq_len == 0 else min(end, start + pos + 1)
            # Quantization is tested outside the loops over ids (see _pool_rows).
            if buckets > 0:
                for k in range(k_lo, k_hi):
                    if k + prefetch < last_k:
                        prefetch_row(data, rows[k + prefetch], dim)
                    r = rows[k]
                    if r < 0:  # no row: adds nothing
                        continue
                    wk = 1.0 if w_base < 0 else np.float64(weights[k])
                    gk = np.float32(bag_gain(wk, comb, denom))
                    for j in range(dim):
                        x = min(max(np.float64(as_f32(data[r, j], kind)), lower), upper)
                        x = np.floor((x - lower) / quantum + 0.5) * quantum + lower
                        acc[j] += np.float32(gk * x)
            else:
                for k in range(k_lo, k_hi):
                    if k + prefetch < last_k:
                        prefetch_row(data, rows[k + prefetch], dim)
                    r = rows[k]
                    if r < 0:
                        continue
                    wk = 1.0 if w_base < 0 else np.float64(weights[k])
                    gk = np.float32(bag_gain(wk, comb, denom))
                    for j in range(dim):
                        acc[j] += gk * as_f32(data[r, j], kind)
            o = out_start + (b * seq_len + pos if seq_len > 0 else b)
            for j in range(dim):
                out[o, j] = acc[j]


def _make_pool_range(fixed_dim: int, kind: int = F32):
    """Samples ``first:stop`` of one feature (see ``pool_bags``), with the row width the
    constant ``fixed_dim`` (the sum then stays in registers in a stack row), or, for
    ``fixed_dim == 0``, any width. ``kind``, a constant too: the rows' values
    (``_pool_rows``'s): F32 float32 rows, BF16 / F16 a 16-bit table's uint16 rows, widened
    as they are read (``pool_range_16``)."""
    if fixed_dim:

        @kernel()
        def pool_range(
            data,
            dim,
            rows,
            offsets,
            weights,
            combiner,
            seq_len,
            out,
            out_start,
            quant,
            prefetch,
            first,
            stop,
        ):
            _pool_bag_range(
                data,
                fixed_dim,
                rows,
                offsets,
                weights,
                combiner,
                seq_len,
                out,
                out_start,
                quant,
                prefetch,
                first,
                stop,
                stack_row(fixed_dim),
                kind,
            )

    else:

        @kernel()
        def pool_range(
            data,
            dim,
            rows,
            offsets,
            weights,
            combiner,
            seq_len,
            out,
            out_start,
            quant,
            prefetch,
            first,
            stop,
        ):
            _pool_bag_range(
                data,
                dim,
                rows,
                offsets,
                weights,
                combiner,
                seq_len,
                out,
                out_start,
                quant,
                prefetch,
                first,
                stop,
                np.empty(dim, dtype=np.float32),
                kind,
            )

    return pool_range


# One per width of FIXED_DIMS, and any width. Named globals: pool_range chooses among them.
_pool_range_1 = _make_pool_range(1)
_pool_range_2 = _make_pool_range(2)
_pool_range_4 = _make_pool_range(4)
_pool_range_8 = _make_pool_range(8)
_pool_range_16 = _make_pool_range(16)
_pool_range_32 = _make_pool_range(32)
_pool_range_64 = _make_pool_range(64)
_pool_range_128 = _make_pool_range(128)
_pool_range_any = _make_pool_range(0)
assert FIXED_DIMS == (1, 2, 4, 8, 16, 32, 64, 128)  # pool_range has a branch for each

# The same for 16-bit rows, per kind: pool_range_16 chooses among them (the training
# lookup's region, train_lookup._pool_task_half); a width and kind each, constants, so their
# sums are the bits of pool_tables' and of the 16-bit lookup-only pooling (_make_pool_bags_16).
_pool_range_1_bf16 = _make_pool_range(1, BF16)
_pool_range_2_bf16 = _make_pool_range(2, BF16)
_pool_range_4_bf16 = _make_pool_range(4, BF16)
_pool_range_8_bf16 = _make_pool_range(8, BF16)
_pool_range_16_bf16 = _make_pool_range(16, BF16)
_pool_range_32_bf16 = _make_pool_range(32, BF16)
_pool_range_64_bf16 = _make_pool_range(64, BF16)
_pool_range_128_bf16 = _make_pool_range(128, BF16)
_pool_range_any_bf16 = _make_pool_range(0, BF16)
_pool_range_1_f16 = _make_pool_range(1, F16)
_pool_range_2_f16 = _make_pool_range(2, F16)
_pool_range_4_f16 = _make_pool_range(4, F16)
_pool_range_8_f16 = _make_pool_range(8, F16)
_pool_range_16_f16 = _make_pool_range(16, F16)
_pool_range_32_f16 = _make_pool_range(32, F16)
_pool_range_64_f16 = _make_pool_range(64, F16)
_pool_range_128_f16 = _make_pool_range(128, F16)
_pool_range_any_f16 = _make_pool_range(0, F16)


@kernel()
def pool_range(
    data,
    dim,
    rows,
    offsets,
    weights,
    combiner,
    seq_len,
    out,
    out_start,
    quant,
    prefetch,
    first,
    stop,
):
    """Samples ``first:stop`` of one feature (see ``pool_bags``), by the function for the row
    width: the width a compile-time constant for FIXED_DIMS (faster pooling, see
    ``_make_pool``), else any width.

    A function of its own, called once per task by ``pool_bags`` and by
    ``train_lookup.prepare_and_pool``: each width compiles once for both, and a parallel loop
    whose body inlines the pooling compiles very slowly (every width inlined: 87 s)."""
    args = (
        data,
        dim,
        rows,
        offsets,
        weights,
        combiner,
        seq_len,
        out,
        out_start,
        quant,
        prefetch,
        first,
        stop,
    )
    if dim == 64:  # the most common first
        _pool_range_64(*args)
    elif dim == 32:
        _pool_range_32(*args)
    elif dim == 128:
        _pool_range_128(*args)
    elif dim == 16:
        _pool_range_16(*args)
    elif dim == 8:
        _pool_range_8(*args)
    elif dim == 4:
        _pool_range_4(*args)
    elif dim == 2:
        _pool_range_2(*args)
    elif dim == 1:
        _pool_range_1(*args)
    else:
        _pool_range_any(*args)


@kernel()
def pool_range_16(data, dim, args, kind):
    """``pool_range(data, dim, *args)`` of uint16 rows of 16-bit weights of ``kind`` (BF16 or
    F16), each value widened as it is read, by the function for the width and kind (both
    constants there)."""
    if kind == BF16:
        if dim == 64:
            _pool_range_64_bf16(data, dim, *args)
        elif dim == 32:
            _pool_range_32_bf16(data, dim, *args)
        elif dim == 128:
            _pool_range_128_bf16(data, dim, *args)
        elif dim == 16:
            _pool_range_16_bf16(data, dim, *args)
        elif dim == 8:
            _pool_range_8_bf16(data, dim, *args)
        elif dim == 4:
            _pool_range_4_bf16(data, dim, *args)
        elif dim == 2:
            _pool_range_2_bf16(data, dim, *args)
        elif dim == 1:
            _pool_range_1_bf16(data, dim, *args)
        else:
            _pool_range_any_bf16(data, dim, *args)
    else:
        if dim == 64:
            _pool_range_64_f16(data, dim, *args)
        elif dim == 32:
            _pool_range_32_f16(data, dim, *args)
        elif dim == 128:
            _pool_range_128_f16(data, dim, *args)
        elif dim == 16:
            _pool_range_16_f16(data, dim, *args)
        elif dim == 8:
            _pool_range_8_f16(data, dim, *args)
        elif dim == 4:
            _pool_range_4_f16(data, dim, *args)
        elif dim == 2:
            _pool_range_2_f16(data, dim, *args)
        elif dim == 1:
            _pool_range_1_f16(data, dim, *args)
        else:
            _pool_range_any_f16(data, dim, *args)


@kernel(parallel=True)
def pool_bags(
    data, dim, rows, offsets, weights, combiner, seq_len, out, out_start, quant, prefetch
):
    """One feature's activations, straight from its occurrences' rows (a lookup-only batch).

    A bag feature (``seq_len == 0``): ``out[out_start + b] = sum over k in
    offsets[b]:offsets[b + 1] of gain_k * q(data[rows[k]])`` (no term for a row of -1), gains as in
    ``batch.combiner_gains`` (``weights`` float32, empty for all ones; ``combiner`` SUM, MEAN or
    SQRTN). A sequence feature: ``out[out_start + b * seq_len + p]`` is the row of the sample's
    ``p``-th id, zeros past its end."""
    n = offsets.shape[0] - 1
    for task in nb.prange((n + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        first = task * ROWS_PER_TASK
        stop = min(n, first + ROWS_PER_TASK)
        pool_range(
            data,
            dim,
            rows,
            offsets,
            weights,
            combiner,
            seq_len,
            out,
            out_start,
            quant,
            prefetch,
            first,
            stop,
        )


def _make_pool_bags_16(fixed_dim: int, kind: int):
    """``pool_bags`` for a table of 16-bit weights of ``kind`` (BF16 or F16): its uint16 rows,
    each value widened as it is read (no widened copy of the occurrences' rows). Width and kind
    are constants of the closure, as in ``train_lookup.pool_tables``, whose pooling of the same
    rows gives the same bits; one kernel per width and kind, compiled on first use, so float32
    lookups compile nothing more."""

    @kernel(parallel=True)
    def pool_bags_16(
        data, dim, rows, offsets, weights, combiner, seq_len, out, out_start, quant, prefetch
    ):
        n = offsets.shape[0] - 1
        for task in nb.prange((n + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
            first = task * ROWS_PER_TASK
            if fixed_dim:
                width = fixed_dim
                acc = stack_row(fixed_dim)
            else:
                width = dim
                acc = np.empty(dim, dtype=np.float32)
            _pool_bag_range(
                data,
                width,
                rows,
                offsets,
                weights,
                combiner,
                seq_len,
                out,
                out_start,
                quant,
                prefetch,
                first,
                min(n, first + ROWS_PER_TASK),
                acc,
                kind,
            )

    return pool_bags_16


_POOL_BAGS_16 = {
    (d, kind): _make_pool_bags_16(d, kind) for d in (*FIXED_DIMS, 0) for kind in (F16, BF16)
}


def pool_bags_kernel(dim: int, kind: int):
    """The lookup-only pooling of rows of ``kind`` (precision.F32: ``pool_bags``; F16 / BF16:
    a 16-bit table's uint16 rows of weights, ``_make_pool_bags_16``), ``pool_bags``'s
    arguments."""
    if kind == F32:
        return pool_bags
    return _POOL_BAGS_16[(int(dim) if int(dim) in FIXED_DIMS else 0, kind)]
