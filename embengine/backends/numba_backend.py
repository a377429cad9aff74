"""The numba backend: parallel dedup, gather + combine, and one fused update per touched row.

Results match the reference backend within float rounding (it sums in float32 where the
reference sums in float64); the kernels live in ``embengine.kernels``.
"""

from __future__ import annotations

import functools

import numba as nb
import numpy as np

from ..batch import FeaturePart, LookupOnlyTableBatch, TableBatch, identity_rows
from ..inputs import check_values, frozen, read_only
from ..kernels import FIXED_DIMS, HALF_FIXED_DIMS, codegen, pipeline, row_math, tasks, train_lookup
from ..kernels import prepare as kp
from ..kernels.lookup import PREFETCH_DISTANCE as PREFETCH_LOOKUP
from ..kernels.lookup import pool_bags_kernel, pool_kernel
from ..kernels.pool import forked, start_pool
from ..optimizers import Optimizer, RowMath
from ..precision import F32, KIND
from ..storage import TableStorage
from .block_pool import BlockPool, Carver
from .protocol import lookup_rows_source, out_rows

__all__ = ["NumbaBackend", "build_tables_numba", "build_tables_and_pool_numba"]

_EMPTY_F32 = read_only(np.zeros(0, dtype=np.float32))
_NO_QUANT = np.zeros(3, dtype=np.float64)
_NO_SKIP = read_only(np.zeros(0, dtype=np.uint8))


def _contiguous_frozen(a: np.ndarray, dtype=None) -> np.ndarray:
    """``frozen(np.ascontiguousarray(a, dtype))``: a copy only of a strided view."""
    return frozen(np.ascontiguousarray(a, dtype=dtype))


_NO_ROWS = np.zeros(0, dtype=np.int64)


# Batches whose arrays take at least this many bytes come from the backend's BlockPool. Above
# it glibc had handed the freed memory back to the OS and every step faulted it in again (W2).
# Below it malloc did not fault, and serves chunks the last step just freed, still in cache
# (W3: a pooled block was no faster). Figures: docs/performance.md, "Figures behind the code".
POOLED_BATCH_BYTES = 16 << 20


def _feature_inputs(parts_per_table: list[list[FeaturePart]]):
    """The kernels' view of a batch's features: (fmeta [features, prepare.F_COLS], occ_base
    [tables + 1], out_base [tables + 1], the features' ids (int64, contiguous: the arrays at
    the addresses in fmeta, to hold for the call), (offsets, weights) as lists of the features'
    arrays and their total lengths)."""
    parts = [p for ps in parts_per_table for p in ps]
    n_tables = len(parts_per_table)
    fmeta = np.empty((len(parts), kp.F_COLS), dtype=np.int64)
    occ_base = np.zeros(n_tables + 1, dtype=np.int64)
    out_base = np.zeros(n_tables + 1, dtype=np.int64)
    off_base = w_base = 0
    ids, offsets, weights = [], [], []
    f = 0
    for t, ps in enumerate(parts_per_table):
        n_occ = 0
        for p in ps:
            r = p.ragged
            has_w = r.weights is not None and not p.seq_len
            ids.append(np.ascontiguousarray(r.ids, dtype=np.int64))
            fmeta[f] = (
                t,
                ids[-1].ctypes.data,
                off_base,
                r.num_samples,
                w_base if has_w else -1,
                kp.COMBINER_CODES[p.combiner],
                p.seq_len,
                p.out_start,
                p.member,
            )
            offsets.append(r.offsets)
            off_base += len(r.offsets)
            if has_w:
                weights.append(r.weights)
                w_base += len(r.weights)
            n_occ += int(np.minimum(r.lengths, p.seq_len).sum()) if p.seq_len else len(r.ids)
            f += 1
        occ_base[t + 1] = occ_base[t] + n_occ
        out_base[t + 1] = out_base[t] + sum(p.num_outputs for p in ps)
    return fmeta, occ_base, out_base, ids, (offsets, weights), (off_base, w_base)


class _BatchPlan:
    """One batch's kernel inputs (the features' arrays concatenated, per-feature metadata) and
    its output arrays, shared by ``prepare_tables`` and ``train_lookup.prepare_and_pool``."""

    def __init__(self, parts_per_table: list[list[FeaturePart]], memory: BlockPool | None):
        n_tables = len(parts_per_table)
        fmeta, occ_base, out_base, ids, (offsets, weights), (off_base, w_base) = _feature_inputs(
            parts_per_table
        )
        n_features = fmeta.shape[0]
        n = int(occ_base[-1])
        n_out = int(out_base[-1])
        i64, f32 = np.int64, np.float32
        # The inputs, concatenated, live for the kernel call; the outputs as long as the batch.
        # The ids stay where they are (fmeta's F_IDS): ``feature_ids`` holds them.
        inputs = ((off_base, i64), (w_base, f32))
        outputs = (
            (n, i64),
            (n, f32),
            (n, i64),
            (n, i64),
            (n, i64),
            (n_tables, i64),
            (n + n_tables, i64),
            (n, f32),
            (n, i64),
            (n_out + n_tables, i64),
            (n_features + n_tables, i64),
        )
        out_bytes = Carver.size(*outputs)
        if memory is None or out_bytes < POOLED_BATCH_BYTES:
            if memory is not None:
                memory.trim()  # big batches have stopped coming: do not keep their blocks
            inp = [np.empty(k, dt) for k, dt in inputs]
            out = [np.empty(k, dt) for k, dt in outputs]
        else:
            carve = Carver(memory.take(Carver.size(*inputs)))
            inp = [carve.empty(k, dt) for k, dt in inputs]
            carve = Carver(memory.take(out_bytes))
            out = [carve.empty(k, dt) for k, dt in outputs]
        for parts_list, dest in zip((offsets, weights), inp, strict=True):
            if parts_list:
                np.concatenate(parts_list, out=dest)
        self.n_tables = n_tables
        self.feature_ids = ids
        self.fmeta, self.occ_base, self.out_base = fmeta, occ_base, out_base
        # Per table: where its logical tables' unique-id bounds start (its first feature + t)
        # and each logical table's row offset in the storage plan (identity_rows).
        self.bounds_base = [0] * n_tables
        self.row_offsets: list[list[int]] = []
        f = 0
        for t, ps in enumerate(parts_per_table):
            self.bounds_base[t] = f + t
            offsets = []
            for p in ps:
                if p.member == len(offsets):
                    offsets.append(p.row_offset)
            self.row_offsets.append(offsets)
            f += len(ps)
        self.inputs = [frozen(a) for a in inp]  # read-only: see inputs.frozen
        self.outputs = out

    def prepare_order(self) -> tuple[np.ndarray, np.ndarray]:
        """Tables dealt to the threads, largest first (see prepare.deal_tables)."""
        return kp.deal_tables(np.diff(self.occ_base), nb.get_num_threads())

    def table_batches(self) -> list[TableBatch]:
        """Each table's batch, its rows resolved for a storage whose rows are ids at the plan's
        row offsets (``batch.identity_rows``); the engine resolves other storages' rows."""
        occ_ids, gains, segments, unique, inverse, n_unique = self.outputs[:6]
        unique_offsets, unique_gains, unique_segments, output_offsets = self.outputs[6:10]
        bounds = self.outputs[10]
        occ_base, out_base = self.occ_base, self.out_base
        tables = []
        for t in range(self.n_tables):
            lo, hi, u = int(occ_base[t]), int(occ_base[t + 1]), int(n_unique[t])
            o_lo, o_hi = int(out_base[t]), int(out_base[t + 1])
            offsets = self.row_offsets[t]
            b = self.bounds_base[t]
            unique_bounds = bounds[b : b + len(offsets) + 1]
            if not offsets:  # a table without features: no kernel wrote its bounds
                unique_bounds = np.zeros(1, np.int64)
            unique_ids = unique[lo : lo + u]
            tables.append(
                TableBatch(
                    unique_ids=unique_ids,
                    inverse=inverse[lo:hi],
                    gains=gains[lo:hi],
                    segments=segments[lo:hi],
                    num_outputs=o_hi - o_lo,
                    output_offsets=output_offsets[o_lo + t : o_hi + t + 1],
                    unique_offsets=unique_offsets[lo + t : lo + t + u + 1],
                    unique_gains=unique_gains[lo:hi],
                    unique_segments=unique_segments[lo:hi],
                    unique_bounds=unique_bounds,
                    unique_rows=identity_rows(unique_ids, unique_bounds, offsets),
                )
            )
        return tables


def build_tables_numba(
    parts_per_table: list[list[FeaturePart]],
    memory: BlockPool | None = None,
    parallel: bool | None = None,
) -> list[TableBatch]:
    """Same result as batch.build_tables_numpy, in one kernel call. With ``memory`` the arrays
    come from its blocks (see block_pool: fresh pages cost more than the work).

    ``parallel=None`` (default) runs the parallel kernel (``prepare.prepare_tables``), except in
    a process forked from the one that imported the kernels (``pool.forked()``: a DataLoader
    worker under Linux's default start method), which runs ``prepare.prepare_tables_serial``:
    the same code per table in one thread, the same results bit for bit. A parallel region
    there would be killed by numba's omp layer or hang in libgomp (see kernels/pool.py).
    True or False choose."""
    if parallel is None:
        parallel = not forked()
    plan = _BatchPlan(parts_per_table, memory)
    if parallel:
        start_pool()
        order, bounds = plan.prepare_order()
        kp.prepare_tables(
            order, bounds, plan.fmeta, *plan.inputs, plan.occ_base, plan.out_base, *plan.outputs
        )
    else:
        # No start_pool, no nb.get_num_threads(): either would start numba's pool here.
        kp.prepare_tables_serial(
            plan.fmeta, *plan.inputs, plan.occ_base, plan.out_base, *plan.outputs
        )
    return plan.table_batches()


def _quantization_row(quantization) -> np.ndarray:
    """(num_buckets, lower, upper) as the pooling kernels take it; zeros: none."""
    if quantization is None:
        return _NO_QUANT
    return np.array([quantization.num_buckets, quantization.lower, quantization.upper], np.float64)


def build_tables_and_pool_numba(
    parts_per_table: list[list[FeaturePart]],
    tables: list[TableStorage],
    quantizations: list,
    memory: BlockPool | None = None,
    prefetch: int = PREFETCH_LOOKUP,
) -> tuple[list[TableBatch], list[np.ndarray]]:
    """``build_tables_numba`` and every table's activation matrix (as ``NumbaBackend.lookup``
    of each table batch gives, bit for bit), in one parallel region whose threads claim the
    preparation and pooling tasks as they go (``kernels.train_lookup``).

    A storage whose rows are its ids (``row_bases``) is pooled in that region, from the ids,
    through each logical table's base address. Any other storage's batch is resolved after the
    region (``rows_for`` with insert, on its unique ids) and pooled through its rows: the same
    sums in the same order."""
    start_pool()
    plan = _BatchPlan(parts_per_table, memory)
    # Largest first; the threads claim the tables as they go, so no dealing (deal_tables).
    order = np.argsort(-np.diff(plan.occ_base), kind="stable")
    tmeta = np.zeros((plan.n_tables, train_lookup.T_COLS), dtype=np.int64)
    fdata = np.zeros((plan.fmeta.shape[0], train_lookup.FD_COLS), dtype=np.int64)
    quant = np.empty((plan.n_tables, 3), dtype=np.float64)
    outs = []
    held = []  # the keyed tables' indexes, which the kernel reaches by address
    held_keys = []  # and their batches' occurrences
    half = False  # features of 16-bit weights pooled in the region
    f = 0
    for t, (table, q, parts) in enumerate(zip(tables, quantizations, parts_per_table, strict=True)):
        data = table.data
        if data.dtype not in (np.float32, np.uint16) or not data.flags.c_contiguous:
            raise AssertionError(
                f"table {table.name!r}: storage must be C-contiguous float32 "
                "(uint16: a 16-bit table)"
            )
        if _half(table):  # its float32 view: the row's width in float32 columns (tmeta)
            data = data.view(np.float32)
        n_out = int(plan.out_base[t + 1] - plan.out_base[t])
        out = np.empty((n_out, table.dim), dtype=np.float32)
        outs.append(out)
        tmeta[t, :6] = _table_columns(data, table.dim, out)
        probe = getattr(table, "lookup_index", None)
        keyed = probe is not None and not _half(table) and data.ctypes.data
        if keyed:  # probed in there, and pooled there if every key has a row
            index = probe()
            held.append(index)
            held_keys.append(int(plan.occ_base[t + 1] - plan.occ_base[t]))  # >= its new keys
            tmeta[t, train_lookup.T_INDEX :] = _index_columns(index)
        quant[t] = _quantization_row(q)
        bases = table.row_bases
        for p in parts:
            if keyed:  # its keys' rows, from row 0 of the table, through its index
                fdata[f, :2] = _rows_from(data, 0)
                fdata[f, train_lookup.FD_INDEX : train_lookup.FD_DEAD_ROWS + 1] = tmeta[
                    t, train_lookup.T_INDEX : train_lookup.T_DEAD_ROWS + 1
                ]
            elif bases is not None and _half(table) and table.weights_dtype != "float32":
                # 16-bit weights: pooled from its uint16 rows, by id, widened as read
                fdata[f, :2] = _rows_from(table.data, bases[p.member])
                fdata[f, train_lookup.FD_KIND] = KIND[table.weights_dtype]
                half = True
            elif bases is not None:  # its logical table's float32 rows (weights), by id
                fdata[f, :2] = _rows_from(data, bases[p.member])
            f += 1
    # The kernel reaches tables and outputs by address: ``tables`` and ``outs`` hold them.
    if any(i.refuses or n > i.rows_left for i, n in zip(held, held_keys, strict=True)):
        # A table's rows_for may refuse the batch after the region: then the region touches
        # no table's rows (their rows_for do), so a refused batch leaves every table as it was.
        tmeta[:, train_lookup.T_TOUCH] = 0
    # Where the region writes a keyed table's probed rows (at its unique keys' places) and
    # whether it found them all (train_lookup.PROBED_*).
    found = np.empty(int(plan.occ_base[-1]) if held else 0, dtype=np.int64)
    ready = np.zeros(plan.n_tables, dtype=np.int64)
    train_lookup.prepare_and_pool(
        order,
        nb.get_num_threads(),
        plan.fmeta,
        *plan.inputs,
        plan.occ_base,
        plan.out_base,
        *plan.outputs,
        found,
        ready,
        tmeta,
        fdata,
        quant,
        prefetch,
        train_lookup.PROBE_CHUNK,
        keyed=bool(held),
        half=half,
    )
    del held
    batches = plan.table_batches()
    # A batch one table refuses (max_rows) changes no table: every table checked first (one
    # the region touched found a row for every key, so it cannot refuse).
    for t, table in enumerate(tables):
        if ready[t] == 0:
            batches[t].check_resolvable(table)
        elif not tmeta[t, train_lookup.T_TOUCH] or ready[t] != train_lookup.PROBED_ALL_FOUND:
            lo, u = int(plan.occ_base[t]), len(batches[t].unique_ids)
            batches[t].check_resolvable(table, found=found[lo : lo + u])

    # A keyed table's rows: its rules run on the rows the region found (rows_for(found=)),
    # which it touched if every key had one and it could. The tables on the update's threads,
    # claimed as they go: each table is its own single writer (so no row depends on which
    # thread resolved it), and its index passes, new rows and evictions release the GIL.
    def resolve(t: int) -> None:
        lo, u = int(plan.occ_base[t]), len(batches[t].unique_ids)
        touched = bool(ready[t] == train_lookup.PROBED_ALL_FOUND and tmeta[t, train_lookup.T_TOUCH])
        batches[t] = batches[t].resolved(
            tables[t], insert=True, found=found[lo : lo + u], touched=touched
        )

    tasks.run_each(resolve, np.flatnonzero(ready).tolist())
    # The other tables: rows_for once each, then all pooled through their rows in one region;
    # a keyed table whose every key had a row was pooled in the region (prepare_and_pool).
    pooled = tmeta[:, train_lookup.T_INDEX] != 0
    pooled &= ready == train_lookup.PROBED_ALL_FOUND
    later = [t for t, table in enumerate(tables) if table.row_bases is None and not pooled[t]]
    if later:
        pmeta = np.empty((len(later), train_lookup.P_COLS), dtype=np.int64)
        sources, row_lists, row_base = [], [], 0
        for i, t in enumerate(later):
            table = tables[t]
            if batches[t].unique_rows is None:
                batches[t] = batches[t].resolved(table, insert=True)
            data, rows, kind = _pooled_rows(table, batches[t].unique_rows)
            sources.append(data)
            row_lists.append(rows)
            pmeta[i] = (
                data.ctypes.data,
                data.shape[0],
                data.shape[1],
                table.dim,
                outs[t].ctypes.data,
                outs[t].shape[0],
                row_base,
                plan.occ_base[t],
                plan.out_base[t] + t,
                kind,
            )
            row_base += len(rows)
        rows = np.concatenate(row_lists) if row_lists else _NO_ROWS
        # The kernel reaches the row arrays and outputs by address: ``sources``, ``outs`` hold them.
        train_lookup.pool_tables(
            nb.get_num_threads(),
            pmeta,
            frozen(rows.astype(np.int64, copy=False)),
            frozen(plan.outputs[4]),
            frozen(plan.outputs[1]),
            frozen(plan.outputs[9]),
            quant[later],
            prefetch,
        )
        del sources
    return batches, outs


def _check_ids(part: FeaturePart) -> None:
    """A lookup-only feature's ids against its vocabulary (``check_values``), the feature named:
    what ``normalise_features`` leaves to a backend that ``checks_lookup_ids``."""
    try:
        check_values(part.ragged, part.vocabulary_size, check_weights=False)
    except ValueError as e:
        raise ValueError(f"feature {part.name!r}: {e}") from None


def _table_columns(data: np.ndarray, dim: int, out: np.ndarray) -> tuple[int, ...]:
    """A table's ``tmeta`` columns up to T_INDEX (``train_lookup``): its rows (address, rows,
    width) and dim, its activation matrix (address, rows)."""
    return (data.ctypes.data, data.shape[0], data.shape[1], dim, out.ctypes.data, out.shape[0])


def _rows_from(data: np.ndarray, base: int) -> tuple[int, int]:
    """A feature's ``fdata`` FD_DATA and FD_ROWS: the address of row ``base`` of ``data`` (its
    logical table's id 0) and the rows from there on."""
    return data.ctypes.data + base * data.strides[0], data.shape[0] - base


def _index_columns(index) -> tuple[int, ...]:
    """A keyed table's ``IndexView`` as ``train_lookup.prepare_and_pool`` reads it: its
    ``tmeta`` columns from T_INDEX on (addresses; 0: none)."""
    dead = index.dead
    return (
        index.slots.ctypes.data,
        len(index.slots),
        index.row_bits,
        index.records.ctypes.data,
        0 if dead is None else dead.ctypes.data,
        0 if dead is None else len(dead),
        int(index.touch),
        index.step,
    )


def _pooled_rows(table: TableStorage, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """(row array, rows, kind) that ``train_lookup.pool_tables`` pools ``rows`` of ``table``
    from: a table with 16-bit weights gives its uint16 rows and their kind (widened as they
    are read: no gathered copy), any other its float32 rows (``_weights_at``)."""
    if _half(table) and table.weights_dtype != "float32":
        return table.data, rows, KIND[table.weights_dtype]
    return (*_weights_at(table, rows), F32)


def _weights_at(table: TableStorage, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(an array whose row ``rows2[i]`` holds the float32 weights of table row ``rows[i]``,
    rows2): ``(table.data, rows)`` for a float32 table; a table with 16-bit weights gets them
    widened (``rounding.widen_rows``, exact), row -1 kept; float32 weights in a 16-bit row are
    read through the row array's float32 view."""
    if not _half(table):
        return table.data, rows
    data = table.data
    if table.weights_dtype == "float32":  # the weights are the view's first dim columns
        return data.view(np.float32), rows
    from ..kernels.rounding import widen_rows

    rows = np.ascontiguousarray(rows, dtype=np.int64)
    out = np.empty((len(rows), table.dim), dtype=np.float32)
    widen_rows(data, KIND[table.weights_dtype], table.dim, rows, out)
    return out, np.where(rows >= 0, np.arange(len(rows), dtype=np.int64), -1)


def _check_rows_given(last: int, rows: np.ndarray) -> None:
    """ValueError unless row ``last`` (a batch's largest) lies within ``rows``: the pooling
    kernels read rows by index without bounds checks."""
    if last >= rows.shape[0]:
        raise ValueError(
            f"lookup_rows: row {last} of a batch is past the {rows.shape[0]} rows given"
        )


def _pool_prepared(
    data, dim: int, tb: TableBatch, quant, prefetch: int, out, rows: np.ndarray | None = None
) -> None:
    """``out`` = the activations of a deduplicated batch, through its resolved rows (or
    ``rows``, one per unique id, into ``data``)."""
    pool = pool_kernel(dim)
    rows = tb.unique_rows if rows is None else rows
    f = frozen
    pool(data, dim, f(rows), f(tb.inverse), f(tb.gains), f(tb.output_offsets), out, quant, prefetch)


def check_optimizer(table_name: str, optimizer: Optimizer, dim: int) -> None:
    """Raise unless the numba backend can run ``optimizer`` on a table of this dim: it has
    registered row math (``Optimizer.row_math``) whose capabilities fit (optimizers/_row_math.py:
    the float slots a prefix of its slots, accumulation, every-row sweeps). The engine calls
    it for every table when it is built, so a limit shows before any step."""
    where = f"table {table_name!r}"
    name = type(optimizer).__name__
    rm = optimizer.row_math(dim)
    if rm is None:
        raise TypeError(
            f"{where}: the numba backend has no row math for {name}; register one "
            "(embengine.optimizers.row_math) and name it in the spec's ROW_MATH, or use "
            "backend='reference'"
        )
    try:
        codegen.check_names(rm)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    floats = [s for s in optimizer.slot_specs(dim) if s.dtype == "float32"]
    names = tuple(s.name for s in floats)
    if names != rm.slots[: len(names)]:
        raise ValueError(
            f"{where}: {name} keeps the float slots {names}, but its row math {rm.name!r} "
            f"takes {rm.slots}; a table must hold a prefix of them, in that order"
        )
    wide = [f"{s.name} ({s.width})" for s in floats if s.width > dim]
    if wide:
        raise ValueError(
            f"{where}: the numba backend holds float slots of width <= dim={dim}, "
            f"not {', '.join(wide)}"
        )
    if rm.needs_accumulation and not optimizer.use_gradient_accumulation:
        raise ValueError(
            f"{where}: the row math {rm.name!r} of {name} needs use_gradient_accumulation=True"
        )
    if optimizer.updates_every_row and not rm.every_row:
        raise ValueError(
            f"{where}: {name} updates every row each step, which its row math {rm.name!r} "
            "cannot (every_row=False)"
        )
    missing = [n for n in (*rm.params, *rm.flags) if not hasattr(optimizer, n)]
    if missing:
        raise ValueError(f"{where}: the row math {rm.name!r} reads {missing}, which {name} lacks")


def fixed_layout(rm: RowMath, table: TableStorage) -> tuple[int, int] | None:
    """(DIM, NS) if the row math has a fixed-layout kernel that fits this table's rows, else
    None.

    It fits rows of DIM (one of FIXED_DIMS) weights, then the NS float slots from column DIM on,
    each DIM wide (row-wise variants read only the first slot's first column). With the row
    width and the slots' offsets compile-time constants, LLVM knows that the weights and slots
    of a row do not overlap and vectorises the update in place, where the any-layout kernel
    copies them to scratch arrays (W1's update gains: docs/performance.md, "Figures behind
    the code")."""
    dim = table.dim
    if not rm.fixed_layout or dim not in FIXED_DIMS:
        return None
    float_slots = [s for s in table.slot_specs if s.dtype == "float32"]
    element = rm.form == "element"
    for i, spec in enumerate(float_slots):
        column = table.columns[spec.name]
        if column.start != (i + 1) * dim or (element and column.width != dim):
            return None
    return dim, len(float_slots)


@functools.cache  # one dispatcher per layout: numba compiles (or loads) it on its first call
def _fixed_kernel(rm: RowMath, dim: int, n_slots: int):
    return row_math.kernels(rm)[2](dim, n_slots)


def half_layout(rm: RowMath, table: TableStorage) -> tuple[int, ...] | None:
    """The row layout a 16-bit table's fused update is compiled for (``codegen``'s
    FIXED_HALF_KERNEL: ``(dim, f0, n0, f1, n1, f2, n2)``, the values ``_table_constants`` puts
    in ``meta``), or None: for widths in HALF_FIXED_DIMS only (each layout is a kernel of its
    own to compile, worth it where a row is long), and for element-wise row math, where it
    measured faster (Adam, Adagrad, FTRL; SGD in place, ``codegen.in_place``; SGD in passes
    and row-wise Adagrad measured slower: docs/performance.md, "16-bit update kernels for a
    row layout"), whose float slots are a value per coordinate (the kernel updates a row's
    columns in one loop over them)."""
    if table.dim not in HALF_FIXED_DIMS or rm.form != "element":
        return None
    if not rm.slots and not codegen.in_place(_SHORT[table.weights_dtype], "f32", slots=False):
        return None
    if not rm.fixed_layout:  # the row math declares no kernel for a constant layout
        return None
    columns = tuple(int(c) for c in _float_slot_columns(table))
    if any(n not in (0, table.dim) for n in columns[1::2]):  # the kernel's loop: one per coordinate
        return None
    return (table.dim, *columns)


def _float_slot_columns(table: TableStorage) -> np.ndarray:
    """``meta[M_F0:]``: the start column and width of each float32 slot of the table's rows,
    0 for slots it does not have."""
    out = np.zeros(2 * pipeline.MAX_FLOAT_SLOTS, dtype=np.int64)
    float_slots = [s for s in table.slot_specs if s.dtype == "float32"]
    for i, spec in enumerate(float_slots):
        out[2 * i : 2 * i + 2] = (table.columns[spec.name].start, spec.width)
    return out


# Stored dtype -> codegen's short name of it ("bfloat16" -> "bf16").
_SHORT = {
    dtype: short
    for short, (kind, _, _) in codegen.HALF_KINDS.items()
    for dtype, code in KIND.items()
    if code == kind
}


@functools.cache  # one dispatcher per layout and dtype pair, as _fixed_kernel
def _fixed_half_kernel(rm: RowMath, kinds: tuple[int, int], layout: tuple[int, ...]):
    return row_math.fixed_half_kernels(rm)[kinds](layout)


def kernels_for(optimizer: Optimizer, table: TableStorage):
    """The (fused_update, update_every_row) kernels serving an optimizer on this table: the
    fixed-layout fused update where it fits (fixed_layout), else the any-layout one; for a
    table with 16-bit columns the ``half`` kernels (they widen each value read and round each
    value stored, which the float32 fixed-layout kernels do not), their fused update compiled
    for the table's row layout from HALF_FIXED_DIMS on (``half_layout``)."""
    rm = optimizer.row_math(table.dim)
    if _half(table):
        kinds = (KIND[table.weights_dtype], KIND[table.slots_dtype] if rm.slots else F32)
        fused, every_row = row_math.half_kernels(rm)[kinds]
        layout = half_layout(rm, table)
        if layout is not None:
            fused = _fixed_half_kernel(rm, kinds, layout)
        return fused, every_row
    fused, every_row, _ = row_math.kernels(rm)
    layout = fixed_layout(rm, table)
    if layout is not None:
        fused = _fixed_kernel(rm, *layout)
    return fused, every_row


# A dense table's rounding rows (``_half_args``): none, its rows are its ids.
_NO_ROUNDING_ROWS = frozen(np.zeros((0, 1), dtype=np.int64))


def _half(table: TableStorage) -> bool:
    """A table whose row array is uint16 (16-bit weights or slots; storage/dense.py)."""
    return table.data.dtype == np.uint16


def _half_args(table: TableStorage) -> tuple:
    """The extra arguments of the half kernels: the table's rounding key, and the keys its
    rows' rounding streams follow (``rounding.hash_row``: a keyed table's records; empty for a
    dense table, whose rows are its ids). The stored dtypes are the kernel's own
    (``kernels_for``)."""
    rows = getattr(table, "rounding_rows", None)
    return (np.uint64(table.rounding_key), _NO_ROUNDING_ROWS if rows is None else frozen(rows))


def _table_constants(opt: Optimizer, table: TableStorage):
    """(meta int64, hyperparameters float64, slot columns int64) of one table's updates. Slot
    columns are in the units of ``data_i`` (a 16-bit table's: two uint16 units each)."""
    meta = np.zeros(pipeline.M_COLS, dtype=np.int64)
    meta[pipeline.M_DIM] = table.dim
    gclip = opt.gradient_clip_bounds
    wclip = opt.weight_clip_bounds
    meta[pipeline.M_GCLIP] = gclip is not None
    meta[pipeline.M_WCLIP] = wclip is not None
    if not opt.weight_decay_factor:
        meta[pipeline.M_WD_MODE] = pipeline.WD_NONE
    elif opt.weight_decay_mode == "l2":
        meta[pipeline.M_WD_MODE] = pipeline.WD_L2
    else:
        meta[pipeline.M_WD_MODE] = pipeline.WD_DECOUPLED
    meta[pipeline.M_ACCUMULATE] = opt.use_gradient_accumulation
    meta[pipeline.M_NF] = sum(s.dtype == "float32" for s in table.slot_specs)
    meta[pipeline.M_F0 :] = _float_slot_columns(table)
    # The row math's params and flags, in its order: the kernel's locals of those names.
    params = opt.row_math(table.dim).values(opt)
    common = [*(gclip or (0.0, 0.0)), *(wclip or (0.0, 0.0))]
    hp = np.array(common + params, dtype=np.float64)
    units = 2 if _half(table) else 1
    cols = np.array(
        [table.columns[s.name].start // units for s in table.slot_specs] or [0], np.int64
    )
    return meta, hp, cols


class NumbaBackend:
    name = "numba"
    # lookup_tables range-checks a lookup-only batch's ids itself (the pooling kernel reads
    # them anyway): the engine leaves that check to it (Backend.checks_lookup_ids).
    checks_lookup_ids = True

    def __init__(self):
        self._constants: dict[int, tuple] = {}
        # Prepared batches' arrays, reused once the caller has let go of a batch.
        self.batch_memory = BlockPool()
        # How far ahead the kernels prefetch table rows (tunable for a machine).
        self.lookup_prefetch = PREFETCH_LOOKUP
        self.update_prefetch = pipeline.PREFETCH_DISTANCE

    def check_optimizer(self, table_name: str, optimizer: Optimizer, dim: int) -> None:
        """Raise unless this backend can run ``optimizer`` on a table of this dim (Backend
        protocol; ``check_optimizer`` above)."""
        check_optimizer(table_name, optimizer, dim)

    def build_tables(self, parts_per_table: list[list[FeaturePart]]) -> list[TableBatch]:
        return build_tables_numba(parts_per_table, self.batch_memory)

    def build_tables_and_lookup(
        self, parts_per_table: list[list[FeaturePart]], tables: list[TableStorage], quantizations
    ) -> tuple[list[TableBatch], list[np.ndarray]]:
        """``build_tables`` and ``lookup`` of every table, in one parallel region (a training
        lookup of features: see kernels/train_lookup.py); batches come back with their rows
        resolved (insert)."""
        return build_tables_and_pool_numba(
            parts_per_table, tables, quantizations, self.batch_memory, self.lookup_prefetch
        )

    def lookup(
        self, table: TableStorage, tb: TableBatch | LookupOnlyTableBatch, quantization=None
    ) -> np.ndarray:
        """One table's activations. A deduplicated batch is pooled through its rows (resolved
        with ``rows_for`` without insert if they were not); a lookup-only batch straight from
        each feature's ids, through its logical table's base row (``row_bases``), or through
        ``rows_for`` without insert on a storage that maps ids itself."""
        bases = table.row_bases
        if isinstance(tb, TableBatch):
            if tb.unique_rows is None:
                tb = tb.resolved(table, insert=False)
            if _half(table):
                start_pool()
                out = np.empty((tb.num_outputs, table.dim), dtype=np.float32)
                data, rows = _weights_at(table, tb.unique_rows)
                _pool_prepared(
                    data,
                    table.dim,
                    tb,
                    _quantization_row(quantization),
                    self.lookup_prefetch,
                    out,
                    rows,
                )
                return out
            return self.lookup_rows(table.data, table.dim, tb, quantization)
        data = table.data
        if _half(table):  # rows of the part's ids, 16-bit weights widened as they are read
            return self._pool_parts(
                tb,
                table.dim,
                quantization,
                lambda p: _pooled_rows(table, table.rows_for(p.member, p.ragged.ids, False)),
            )
        return self._pool_parts(
            tb,
            table.dim,
            quantization,
            lambda p: (
                (data[bases[p.member] :], p.ragged.ids, F32)
                if bases is not None
                else (data, table.rows_for(p.member, p.ragged.ids, False), F32)
            ),
        )

    def lookup_tables(
        self,
        tables: list[TableStorage],
        batches: list[TableBatch | LookupOnlyTableBatch],
        quantizations: list,
    ) -> list[np.ndarray]:
        """Every table's activation matrix (``lookup`` of each, the same bits). The lookup-only
        batches of float32 tables whose rows are ids (``row_bases``) or keys of an index
        (``lookup_index``) are pooled in one parallel region (``train_lookup.pool_features``,
        ``pool_keyed_features`` with keyed tables);
        the others by ``lookup``, table by table."""
        outs: list[np.ndarray | None] = [None] * len(tables)
        together = []  # (table index, its float32 rows, its index or None)
        for t, (table, tb) in enumerate(zip(tables, batches, strict=True)):
            probe = getattr(table, "lookup_index", None)
            # (An address of 0 tells the kernel "not pooled here": a table without memory yet.)
            if isinstance(tb, LookupOnlyTableBatch) and not _half(table) and table.data.ctypes.data:
                if table.row_bases is not None:
                    together.append((t, None))
                    continue
                if probe is not None:
                    together.append((t, probe()))
                    continue
            if isinstance(tb, LookupOnlyTableBatch):  # its ids' range (checks_lookup_ids)
                for p in tb.parts:
                    _check_ids(p)
            outs[t] = self.lookup(table, tb, quantizations[t])
        if together:
            self._pool_together(tables, batches, quantizations, together, outs)
        return outs

    def _pool_together(self, tables, batches, quantizations, together, outs) -> None:
        """``lookup_tables``' one region: the lookup-only batches of ``together``'s tables."""
        parts_per_table = [list(batches[t].parts) for t, _ in together]
        fmeta, _, _, feature_ids, inputs, _ = _feature_inputs(parts_per_table)
        offsets, weights = (
            frozen(np.concatenate(a).astype(dt, copy=False) if a else np.zeros(0, dt))
            for a, dt in zip(inputs, (np.int64, np.float32), strict=True)
        )
        tmeta = np.zeros((len(together), train_lookup.T_COLS), dtype=np.int64)
        fdata = np.zeros((fmeta.shape[0], train_lookup.FD_COLS), dtype=np.int64)
        quant = np.empty((len(together), 3), dtype=np.float64)
        held = [feature_ids]  # what the kernel reaches by address
        f = 0
        for i, (t, index) in enumerate(together):
            table, data = tables[t], tables[t].data
            out = np.empty((batches[t].num_outputs, table.dim), dtype=np.float32)
            outs[t] = out
            tmeta[i, :6] = _table_columns(data, table.dim, out)
            quant[i] = _quantization_row(quantizations[t])
            for p in batches[t].parts:
                fdata[f, train_lookup.FD_VOCAB] = p.vocabulary_size or 0
                if index is None:  # rows are ids from the logical table's base row
                    fdata[f, :2] = _rows_from(data, table.row_bases[p.member])
                else:
                    slots, records, dead = index.slots, index.records, index.dead
                    fdata[f, :6] = (
                        data.ctypes.data,
                        data.shape[0],
                        slots.ctypes.data,
                        len(slots),
                        index.row_bits,
                        records.ctypes.data,
                    )
                    if dead is not None:
                        fdata[f, train_lookup.FD_DEAD : train_lookup.FD_DEAD_ROWS + 1] = (
                            dead.ctypes.data,
                            len(dead),
                        )
                    held.append(index)
                f += 1
        start_pool()
        keyed = any(index is not None for _, index in together)
        kernel = train_lookup.pool_keyed_features if keyed else train_lookup.pool_features
        bad = np.zeros(fmeta.shape[0], dtype=np.uint8)
        kernel(
            nb.get_num_threads(),
            fmeta,
            offsets,
            weights,
            tmeta,
            fdata,
            quant,
            self.lookup_prefetch,
            bad,
        )
        del held
        parts = [p for ps in parts_per_table for p in ps]
        for f in np.flatnonzero(bad):  # the first id out of range, named as check_values does
            _check_ids(parts[f])
            raise ValueError(
                f"feature {parts[f].name!r}: an id was out of range [0, "
                f"{parts[f].vocabulary_size}) while it was looked up (was its array changed "
                "meanwhile?)"
            )

    def lookup_rows(
        self,
        rows: np.ndarray,
        dim: int,
        tb: TableBatch | LookupOnlyTableBatch,
        quantization=None,
        *,
        out: np.ndarray | None = None,
        weights_dtype: str = "float32",
    ) -> np.ndarray:
        """``lookup`` from an array whose row ``r`` holds row ``r``'s weights in its first
        ``dim`` columns, float32 and C-contiguous (Backend protocol: a table's data, or rows
        decoded from an export), read at the batch's rows: a deduplicated batch's
        ``unique_rows``, a lookup-only batch's ids from each feature's ``row_offset``.
        ``weights_dtype`` 16-bit: uint16 rows, each value widened as it is read (no widened
        copy: ``train_lookup.pool_tables``, or a lookup-only batch's 16-bit ``pool_bags``)."""
        # The kernels read rows by index without bounds checks: refuse what they cannot read.
        lookup_rows_source(rows, dim, weights_dtype)
        if isinstance(tb, LookupOnlyTableBatch):  # no occurrence arrays: pool from the ids
            if any(p.row_offset < 0 for p in tb.parts):
                raise ValueError(
                    "lookup_rows: this batch's storage maps ids to rows itself; look it up "
                    "with lookup(table, batch)"
                )
            for p in tb.parts:
                ids = p.ragged.ids
                if len(ids):
                    _check_rows_given(p.row_offset + int(ids.max()), rows)
            kind = F32 if weights_dtype == "float32" else KIND[weights_dtype]
            pooled = self._pool_parts(
                tb, dim, quantization, lambda p: (rows[p.row_offset :], p.ragged.ids, kind)
            )
            if out is None:
                return pooled
            out_rows(out, len(pooled), dim, rows)[:] = pooled
            return out
        if weights_dtype != "float32":
            return self._lookup_half_rows(rows, dim, tb, quantization, out, weights_dtype)
        if tb.unique_rows is None:
            raise ValueError(
                "lookup_rows: this batch's rows are not resolved (its storage maps ids to rows "
                "itself); look it up with lookup(table, batch)"
            )
        if len(tb.unique_rows):
            _check_rows_given(int(np.max(tb.unique_rows)), rows)
        start_pool()
        if out is None:
            out = np.empty((tb.num_outputs, dim), dtype=np.float32)
        else:
            out_rows(out, tb.num_outputs, dim, rows)
        _pool_prepared(rows, dim, tb, _quantization_row(quantization), self.lookup_prefetch, out)
        return out

    def _lookup_half_rows(self, rows, dim, tb, quantization, out, weights_dtype) -> np.ndarray:
        """``lookup_rows`` of a deduplicated batch from uint16 rows of 16-bit weights (checked
        by ``lookup_rows_source``)."""
        if tb.unique_rows is None:
            raise ValueError(
                "lookup_rows: this batch's rows are not resolved (its storage maps ids to rows "
                "itself); look it up with lookup(table, batch)"
            )
        unique = np.ascontiguousarray(tb.unique_rows, dtype=np.int64)
        if len(unique):
            _check_rows_given(int(unique.max()), rows)
        if out is None:
            out = np.empty((tb.num_outputs, dim), dtype=np.float32)
        else:
            out_rows(out, tb.num_outputs, dim, rows)
        pmeta = np.zeros((1, train_lookup.P_COLS), dtype=np.int64)
        pmeta[0, : train_lookup.P_ROW_BASE] = _table_columns(rows, dim, out)
        pmeta[0, train_lookup.P_KIND] = KIND[weights_dtype]  # bases 0: one table's own arrays
        start_pool()
        train_lookup.pool_tables(
            nb.get_num_threads(),
            pmeta,
            frozen(unique),
            frozen(np.ascontiguousarray(tb.inverse, dtype=np.int64)),
            frozen(np.ascontiguousarray(tb.gains, dtype=np.float32)),
            frozen(np.ascontiguousarray(tb.output_offsets, dtype=np.int64)),
            _quantization_row(quantization)[None, :],
            self.lookup_prefetch,
        )
        return out

    def _pool_parts(self, tb: LookupOnlyTableBatch, dim: int, quantization, source) -> np.ndarray:
        """A lookup-only batch's activations, feature by feature: ``source(part)`` gives the
        (row array, rows of the part's occurrences, the row array's kind: ``_pooled_rows``) to
        pool from."""
        start_pool()
        out = np.empty((tb.num_outputs, dim), dtype=np.float32)
        quant = _quantization_row(quantization)
        for p in tb.parts:
            r = p.ragged
            data, rows, kind = source(p)
            weights = r.weights if r.weights is not None and not p.seq_len else _EMPTY_F32
            # Contiguous read-only arrays (copies only of strided views): one compiled kernel.
            c = _contiguous_frozen
            pool_bags_kernel(dim, kind)(
                data,
                dim,
                c(rows, dtype=np.int64),
                c(r.offsets),
                c(weights),
                kp.COMBINER_CODES[p.combiner],
                p.seq_len,
                out,
                p.out_start,
                quant,
                self.lookup_prefetch,
            )
        return out

    def apply(self, table, tb, grad, opt, lr, step, skip_nonfinite) -> np.ndarray:
        """The fused update (Backend protocol); returns the rows (of ``table.data``) left
        unchanged because their result was not finite (the kernel's flags) or, with
        ``skip_nonfinite``, their gradient (``pipeline.nonfinite_rows``' flags)."""
        return self.apply_tables([(table, tb, grad, opt, lr, step, skip_nonfinite)])[0]

    def apply_tables(self, updates) -> list[np.ndarray]:
        """``apply`` for each update (Backend protocol): every table's kernel call first set
        up, then all made by ``tasks.run_many`` on the same threads, so a thread with no task
        left in one table's update goes on to the next table's while the others finish (one
        start and one wait of the threads a step, not one a table: docs/performance.md, "One
        start of the update's threads a step"); then each table's unchanged rows. Every-row
        updates (``updates_every_row``) come after, one table at a time (below)."""
        start_pool()
        left: list = [None] * len(updates)
        calls, finishes, sweeps = [], [], []
        for i, update in enumerate(updates):
            if update[3].updates_every_row:  # its opt
                sweeps.append(i)
                continue
            call, finish = self._update_call(*update)
            calls.append(call)
            finishes.append((i, finish))
        tasks.run_many(calls)
        for i, finish in finishes:
            left[i] = finish()
        del calls, finishes
        # An every-row update (a sweep of the whole table) holds 9 bytes a table row while it
        # runs (``pipeline.every_row_tasks``' rows, the unchanged flags): set up and made one
        # table after the other, so that a step needs one table's worth, not every table's.
        # Its sweep takes far longer than a start of the threads.
        for i in sweeps:
            call, finish = self._update_call(*updates[i])
            tasks.run_many([call])
            left[i] = finish()
            del call, finish  # before the next table's are made
        return left

    def _update_call(self, table, tb, grad, opt, lr, step, skip_nonfinite):
        """``apply``'s kernel call as ``(kernel, n_tasks, args)`` (``tasks.run_many``), and a
        function giving its unchanged rows once the call has been made."""
        consts = self._constants.get(id(table))
        if consts is None or consts[0] is not opt:
            consts = (opt, kernels_for(opt, table), *_table_constants(opt, table))
            self._constants[id(table)] = consts
        _, (fused, every_row), meta, hp, cols = consts
        grad = frozen(np.ascontiguousarray(grad, dtype=np.float32))
        skipped = _NO_SKIP
        if skip_nonfinite:
            skipped = pipeline.nonfinite_rows(
                tb.unique_offsets,
                tb.unique_gains,
                tb.unique_segments,
                grad,
                opt.use_gradient_accumulation,
            )
            skipped = frozen(skipped)
        if tb.unique_rows is None:  # a storage that maps ids itself, not resolved yet
            tb = tb.resolved(table, insert=True)
        # One flag per unique row (per table row for every-row updates), set by the kernel.
        unchanged = np.zeros(
            table.data.shape[0] if opt.updates_every_row else len(tb.unique_rows), dtype=np.uint8
        )
        data = table.data
        rows = (data.view(np.float32), data) if _half(table) else (data,)
        args = (
            *rows,
            data.view(np.int32),
            meta,
            hp,
            cols,
            float(lr),
            float(opt.weight_decay_rate(lr)),
            int(step),
            frozen(tb.unique_rows),
            frozen(tb.unique_offsets),
            frozen(tb.unique_gains),
            frozen(tb.unique_segments),
            grad,
            skipped,
            unchanged,
            self.update_prefetch,
        )
        extra = _half_args(table) if _half(table) else ()
        if opt.updates_every_row:  # the storage's live rows, untouched ones with g = 0
            live = frozen(np.ascontiguousarray(table.live_rows(), dtype=np.int64))
            task_start, where = pipeline.every_row_tasks(tb.unique_rows, live, data.shape[0])
            call = (
                every_row,
                task_start[-1],
                (frozen(task_start), frozen(where), *args, live, *extra),
            )
        else:
            call = pipeline.balanced_call(fused, tb.unique_offsets, *args, *extra)

        def finish() -> np.ndarray:
            if skip_nonfinite and skipped.any():  # rows the kernel skipped: theirs too
                by_gradient = tb.unique_rows[skipped.astype(bool) & (tb.unique_rows >= 0)]
                if opt.updates_every_row:
                    unchanged[by_gradient] = 1
                else:
                    unchanged[:] |= skipped & (tb.unique_rows >= 0)
            if not unchanged.any():
                return _NO_ROWS
            at = np.flatnonzero(unchanged)
            return at if opt.updates_every_row else tb.unique_rows[at]

        return call, finish
