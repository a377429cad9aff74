"""The reference backend: slow, obviously correct NumPy. Every faster backend must match it.

All arithmetic is float64 (inputs are float32); results are rounded to float32 when stored.
A row whose rounded results (weights or float slots) are not all finite is not stored: it keeps
its old values, weights and slots alike, and ``apply`` returns its id (the engine's non-finite
policy reports it).
"""

from __future__ import annotations

import numpy as np

from ..batch import FeaturePart, LookupOnlyTableBatch, TableBatch, build_tables_numpy
from ..optimizers import Optimizer, RowContext
from ..storage import DenseTable

__all__ = ["ReferenceBackend", "update_rows"]


def update_rows(
    table: DenseTable,
    rows: np.ndarray,
    g: np.ndarray,
    opt: Optimizer,
    lr: float,
    step: int,
) -> np.ndarray:
    """One update of each row in ``rows`` (distinct) with gradient ``g`` [len(rows), dim]:
    the common per-row pipeline around the optimizer's own math (see optimizers._base).

    Returns the mask of rows left unchanged because a new value of theirs, rounded to its
    storage type, would not be finite."""
    if len(rows) == 0:
        return np.zeros(0, dtype=bool)
    with np.errstate(all="ignore"):  # overflows are found and refused below, per row
        w, slots = _updated(table, rows, g, opt, lr, step)
        w32 = w.astype(np.float32)
        ok = np.isfinite(w32).all(axis=1)
        new_slots = {}
        for spec in table.slot_specs:
            v = slots[spec.name].astype(table.slot(spec.name).dtype)
            if spec.dtype == "float32":
                ok &= np.isfinite(v).reshape(len(rows), -1).all(axis=1)
            new_slots[spec.name] = v
    table.weights[rows[ok]] = w32[ok]
    for spec in table.slot_specs:
        table.slot(spec.name)[rows[ok]] = new_slots[spec.name][ok]
    return ~ok


def _updated(table: DenseTable, rows: np.ndarray, g: np.ndarray, opt: Optimizer, lr: float,
             step: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:  # fmt: skip
    """The rows' new weights and slots (float64; int64 for int slots), not stored."""
    g = np.asarray(g, dtype=np.float64)
    w = table.weights[rows].astype(np.float64)
    slots = {
        spec.name: table.slot(spec.name)[rows].astype(
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
        self, parts_per_table: list[list[FeaturePart]], tables: list[DenseTable], quantizations
    ) -> tuple[list[TableBatch], list[np.ndarray]]:
        """``build_tables``, then ``lookup`` of each table's batch (Backend protocol)."""
        batches = self.build_tables(parts_per_table)
        acts = [self.lookup(table, tb, q)
                for table, tb, q in zip(tables, batches, quantizations, strict=True)]  # fmt: skip
        return batches, acts

    def lookup(
        self, table: DenseTable, tb: TableBatch | LookupOnlyTableBatch, quantization=None
    ) -> np.ndarray:
        return self.lookup_rows(table.weights, table.dim, tb, quantization)

    def lookup_rows(
        self, rows: np.ndarray, dim: int, tb: TableBatch | LookupOnlyTableBatch, quantization=None
    ) -> np.ndarray:
        """``lookup`` from an array whose row ``i`` holds id ``i``'s weights in its first
        ``dim`` columns (Backend protocol)."""
        if isinstance(tb, LookupOnlyTableBatch):
            tb = tb.occurrences
        gathered = rows[tb.unique_ids, :dim].astype(np.float64)
        if quantization is not None:
            gathered = quantization.quantize(gathered)
        out = np.zeros((tb.num_outputs, dim), dtype=np.float64)
        np.add.at(out, tb.segments, tb.gains[:, None].astype(np.float64) * gathered[tb.inverse])
        return out.astype(np.float32)

    def apply(
        self,
        table: DenseTable,
        tb: TableBatch,
        grad: np.ndarray,
        opt: Optimizer,
        lr: float,
        step: int,
        skip_nonfinite: bool,
    ) -> np.ndarray:
        """Update the rows of ``tb`` from the gradient of the table's activation matrix.
        Returns the ids of rows left unchanged because their result was not finite."""
        occ = tb.gains[:, None].astype(np.float64) * grad[tb.segments].astype(np.float64)
        n_unique = len(tb.unique_ids)
        if opt.use_gradient_accumulation:
            summed = np.zeros((n_unique, table.dim), dtype=np.float64)
            np.add.at(summed, tb.inverse, occ)
            keep = np.isfinite(summed).all(axis=1) if skip_nonfinite else np.ones(n_unique, bool)
            if opt.updates_every_row:
                full = np.zeros((table.vocabulary_size, table.dim), dtype=np.float64)
                full[tb.unique_ids[keep]] = summed[keep]
                every = np.ones(table.vocabulary_size, dtype=bool)
                every[tb.unique_ids[~keep]] = False
                rows = np.flatnonzero(every)
            else:
                rows = tb.unique_ids[keep]
                full = None
            refused = update_rows(table, rows, summed[keep] if full is None else full[rows], opt,
                                  lr, step)  # fmt: skip
            return rows[refused]
        # No accumulation: each occurrence is its own update, in order of appearance. Round r
        # applies every row's r-th occurrence (distinct rows, so one vectorised update each).
        keep_row = np.ones(n_unique, dtype=bool)
        if skip_nonfinite:
            bad = ~np.isfinite(occ).all(axis=1)
            keep_row[tb.inverse[bad]] = False
        # A refused occurrence leaves its row as it was; the row's later occurrences still apply.
        rounds = occurrence_rounds(tb.inverse)
        refused_rows = []
        for r in range(int(rounds.max()) + 1 if len(rounds) else 0):
            sel = np.flatnonzero((rounds == r) & keep_row[tb.inverse])
            rows = tb.unique_ids[tb.inverse[sel]]
            refused_rows.append(rows[update_rows(table, rows, occ[sel], opt, lr, step)])
        return np.unique(np.concatenate(refused_rows)) if refused_rows else np.zeros(0, np.int64)
