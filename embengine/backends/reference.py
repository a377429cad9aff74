"""The reference backend: slow, obviously correct NumPy. Every faster backend must match it.

All arithmetic is float64 (inputs are float32); results are rounded to float32 when stored,
and a 16-bit column's float32 results then to its dtype, stochastically, with the random
stream of ``embengine.precision`` (the one the numba kernels draw). A row whose stored results
(weights or float slots) are not all finite is not stored: it keeps its old values, weights and
slots alike, and ``apply`` returns its id (the engine's non-finite policy reports it).
"""

from __future__ import annotations

import numpy as np

from ..batch import FeaturePart, LookupOnlyTableBatch, TableBatch, build_tables_numpy
from ..optimizers import Optimizer, RowContext
from ..precision import KIND, hash_bits, rounding_streams, stochastic_round, widen
from ..storage import TableStorage
from ..storage.dense import column_view
from .protocol import lookup_rows_source, out_rows

__all__ = ["ReferenceBackend", "update_rows"]


def _column(table: TableStorage, name: str) -> np.ndarray:
    """The weights (``name="weights"``) or a slot of every row, a view of ``table.data`` in the
    stored dtype."""
    return column_view(table.data, table.columns[name])


def _store(
    table: TableStorage, name: str, rows: np.ndarray, values: np.ndarray, step: int, unit: int
) -> tuple[np.ndarray, np.ndarray]:
    """(what ``values`` become in column ``name`` of ``rows``, as float32 / int32, and the
    same in the stored representation): float32 as is, 16-bit rounded stochastically from
    the value's hash (table key, step, row, ``unit``, its column in the row)."""
    col = table.columns[name]
    if col.dtype == "int32":
        v = values.astype(np.int32)
        return v, v
    v32 = values.astype(np.float32)
    if col.dtype == "float32":
        return v32, v32
    kind = KIND[col.dtype]
    columns = col.start + np.arange(col.width)[None, :]
    # a keyed table's stream follows its keys (its rows move), a dense one's its rows (= ids),
    # a packed one's its members' ids
    keys, where = rounding_streams(table.rounding_key, getattr(table, "rounding_rows", None), rows)
    bits = hash_bits(keys[:, None], step, where[:, None], unit, columns)
    stored = stochastic_round(v32.reshape(len(rows), col.width), kind, bits)
    return widen(stored, kind), stored


def _rows(table: TableStorage, tb: TableBatch, insert: bool) -> TableBatch:
    """``tb`` with its rows resolved (a storage that maps ids itself: ``rows_for``)."""
    return tb if tb.unique_rows is not None else tb.resolved(table, insert)


def update_rows(
    table: TableStorage,
    rows: np.ndarray,
    g: np.ndarray,
    opt: Optimizer,
    lr: float,
    step: int,
    unit: int = 0,
) -> np.ndarray:
    """One update of each row in ``rows`` (distinct) with gradient ``g`` [len(rows), dim]:
    the common per-row pipeline around the optimizer's own math (see optimizers._base).
    ``unit``: which of a row's updates this is in the step (its occurrence without gradient
    accumulation, else 0), for the rounding stream of 16-bit columns.

    Returns the mask of rows left unchanged because a new value of theirs, rounded to its
    storage type, would not be finite."""
    if len(rows) == 0:
        return np.zeros(0, dtype=bool)
    rows = np.asarray(rows, dtype=np.int64)
    with np.errstate(all="ignore"):  # overflows are found and refused below, per row
        w, slots = _updated(table, rows, g, opt, lr, step)
        new = {"weights": _store(table, "weights", rows, w, step, unit)}
        new.update(
            {
                s.name: _store(table, s.name, rows, slots[s.name], step, unit)
                for s in table.slot_specs
            }
        )
        ok = np.ones(len(rows), dtype=bool)
        for name, (value, _) in new.items():
            if table.columns[name].dtype != "int32":
                ok &= np.isfinite(value).reshape(len(rows), -1).all(axis=1)
    half = table.data.dtype == np.uint16
    for name, (_, stored) in new.items():
        col = table.columns[name]
        if half and col.stride == 1:  # 16-bit: the rounded bits
            table.data[rows[ok], col.start : col.start + col.width] = stored[ok]
        else:
            _column(table, name)[rows[ok]] = stored.reshape(len(rows), -1)[ok]
    return ~ok


def _updated(
    table: TableStorage, rows: np.ndarray, g: np.ndarray, opt: Optimizer, lr: float, step: int
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The rows' new weights and slots (float64; int64 for int slots), not stored."""
    g = np.asarray(g, dtype=np.float64)
    weights = _column(table, "weights")
    w = weights[rows].astype(np.float64)
    slots = {
        spec.name: _column(table, spec.name)[rows].astype(
            np.float64 if spec.dtype == "float32" else np.int64
        )
        for spec in table.slot_specs
    }
    clip = opt.gradient_clip_bounds
    if clip is not None:
        g = np.clip(g, clip[0], clip[1])
    decay = opt.weight_decay_rate(lr)
    if decay:
        if opt.weight_decay_mode == "l2":
            g = g + decay * w
        else:
            w = w - decay * w
    opt.reference_update(w, slots, g, lr, RowContext(step=step))
    bounds = opt.weight_clip_bounds
    if bounds is not None:
        w = np.clip(w, bounds[0], bounds[1])
    return w, slots


def occurrence_rounds(inverse: np.ndarray) -> np.ndarray:
    """For each occurrence, how many earlier occurrences hit the same unique row (0, 1, ...)."""
    order = np.argsort(inverse, kind="stable")
    sorted_inv = inverse[order]
    starts = np.flatnonzero(np.r_[True, sorted_inv[1:] != sorted_inv[:-1]])
    group_start = np.repeat(starts, np.diff(np.r_[starts, len(order)]))
    rounds = np.empty(len(order), dtype=np.int64)
    rounds[order] = np.arange(len(order)) - group_start
    return rounds


class ReferenceBackend:
    name = "reference"
    build_tables = staticmethod(build_tables_numpy)

    def build_tables_and_lookup(
        self, parts_per_table: list[list[FeaturePart]], tables: list[TableStorage], quantizations
    ) -> tuple[list[TableBatch], list[np.ndarray]]:
        """``build_tables``, rows resolved (insert), then ``lookup`` of each table's batch
        (Backend protocol)."""
        built = self.build_tables(parts_per_table)
        for table, tb in zip(tables, built, strict=True):
            tb.check_resolvable(table)  # a batch one table refuses changes no table
        batches = [_rows(table, tb, insert=True) for table, tb in zip(tables, built, strict=True)]
        acts = [
            self.lookup(table, tb, q)
            for table, tb, q in zip(tables, batches, quantizations, strict=True)
        ]
        return batches, acts

    def lookup(
        self, table: TableStorage, tb: TableBatch | LookupOnlyTableBatch, quantization=None
    ) -> np.ndarray:
        """One table's activations, read at the batch's rows (resolved without insert if they
        were not)."""
        if isinstance(tb, LookupOnlyTableBatch):
            tb = tb.occurrences
        # a 16-bit table's weights, widened exactly as they are read
        rows = table.data if table.data.dtype == np.float32 else _column(table, "weights")
        return self.lookup_rows(rows, table.dim, _rows(table, tb, insert=False), quantization)

    def lookup_tables(self, tables, batches, quantizations) -> list[np.ndarray]:
        """``lookup`` of every table, in order."""
        return [
            self.lookup(table, tb, q)
            for table, tb, q in zip(tables, batches, quantizations, strict=True)
        ]

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
        ``dim`` columns, read at the batch's rows (Backend protocol); a row of -1 pools zeros.
        ``weights_dtype`` 16-bit: ``rows`` holds the weights' bits (uint16), widened here."""
        if weights_dtype != "float32":
            # as the numba backend refuses them: widen() would cast other rows' values to
            # uint16 and read them as bits
            lookup_rows_source(rows, dim, weights_dtype, contiguous=False)
            source = rows
            rows = widen(rows[:, :dim], KIND[weights_dtype])
            if out is not None:
                out_rows(out, tb.num_outputs, dim, source)  # apart from the 16-bit rows too
        if isinstance(tb, LookupOnlyTableBatch):
            tb = tb.occurrences
        if tb.unique_rows is None:
            raise ValueError(
                "lookup_rows: this batch's rows are not resolved (its storage maps ids to rows "
                "itself); look it up with lookup(table, batch)"
            )
        present = tb.unique_rows >= 0
        gathered = np.zeros((len(tb.unique_rows), dim), dtype=np.float64)
        gathered[present] = rows[tb.unique_rows[present], :dim]
        if quantization is not None:
            gathered[present] = quantization.quantize(gathered[present])
        sums = np.zeros((tb.num_outputs, dim), dtype=np.float64)
        np.add.at(sums, tb.segments, tb.gains[:, None].astype(np.float64) * gathered[tb.inverse])
        target = out_rows(out, tb.num_outputs, dim, rows) if out is not None else None
        # A pooled sum past float32's range is an inf activation, as the numba backend's
        # (docs/reliability.md: the caller's model sees it; the update is guarded), not a
        # NumPy "overflow encountered in cast" warning the numba backend never gives.
        with np.errstate(over="ignore"):
            if target is None:
                return sums.astype(np.float32)
            target[:] = sums
        return out

    def check_optimizer(self, table_name: str, optimizer: Optimizer, dim: int) -> None:
        """Every spec runs here: its ``reference_update`` is the oracle."""

    def apply_tables(self, updates) -> list[np.ndarray]:
        """``apply`` for each update, one after the other."""
        return [self.apply(*update) for update in updates]

    def apply(
        self,
        table: TableStorage,
        tb: TableBatch,
        grad: np.ndarray,
        opt: Optimizer,
        lr: float,
        step: int,
        skip_nonfinite: bool,
    ) -> np.ndarray:
        """Update the rows of ``tb`` from the gradient of the table's activation matrix. Unique
        ids without a row (-1) get no update; an every-row optimizer sweeps ``live_rows()``.
        Returns the rows (of ``table.data``) left unchanged because their result was not
        finite or, with ``skip_nonfinite``, their gradient."""
        tb = _rows(table, tb, insert=True)
        rows = tb.unique_rows
        occ = tb.gains[:, None].astype(np.float64) * grad[tb.segments].astype(np.float64)
        n_unique = len(rows)
        has_row = rows >= 0
        if opt.use_gradient_accumulation:
            summed = np.zeros((n_unique, table.dim), dtype=np.float64)
            np.add.at(summed, tb.inverse, occ)
            keep = np.isfinite(summed).all(axis=1) if skip_nonfinite else np.ones(n_unique, bool)
            by_gradient = rows[has_row & ~keep]
            keep &= has_row
            if opt.updates_every_row:
                live = np.concatenate(
                    [np.arange(a, b, dtype=np.int64) for a, b in table.live_rows()]
                    or [np.zeros(0, np.int64)]
                )
                n_rows = table.data.shape[0]
                full = np.zeros((n_rows, table.dim), dtype=np.float64)
                full[rows[keep]] = summed[keep]
                every = np.zeros(n_rows, dtype=bool)
                every[live] = True
                every[rows[has_row & ~keep]] = False
                swept = np.flatnonzero(every)
                refused = update_rows(table, swept, full[swept], opt, lr, step)
                return np.union1d(swept[refused], by_gradient)
            kept = rows[keep]
            return np.union1d(
                kept[update_rows(table, kept, summed[keep], opt, lr, step)], by_gradient
            )
        # No accumulation: each occurrence is its own update, in order of appearance. Round r
        # applies every row's r-th occurrence (distinct rows, so one vectorised update each).
        keep_row = has_row.copy()
        if skip_nonfinite:
            bad = ~np.isfinite(occ).all(axis=1)
            keep_row[tb.inverse[bad]] = False
        by_gradient = rows[has_row & ~keep_row]
        # A refused occurrence leaves its row as it was; the row's later occurrences still apply.
        rounds = occurrence_rounds(tb.inverse)
        refused_rows = []
        for r in range(int(rounds.max()) + 1 if len(rounds) else 0):
            sel = np.flatnonzero((rounds == r) & keep_row[tb.inverse])
            at = rows[tb.inverse[sel]]
            refused_rows.append(at[update_rows(table, at, occ[sel], opt, lr, step, r)])
        return np.unique(np.concatenate([*refused_rows, by_gradient]))
