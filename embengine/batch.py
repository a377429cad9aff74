"""The prepared batch: per table, the deduplicated rows and how occurrences map to outputs.

This is what the TPU's deduplication data is: computed once from the features, it serves the
lookup (gather unique rows, combine into activations) and the update (sum each occurrence's
gradient into its unique row) of the same step. Building it is pure: no table state is read, so
it can run in a DataLoader worker.

Per table, the occurrences of all its features are concatenated in feature order (then sample
order, then position): occurrence ``k`` reads row ``unique_ids[inverse[k]]``, is scaled by
``gains[k]`` and lands in row ``segments[k]`` of the table's activation matrix, whose rows are
the features' outputs stacked in the same order. Unique rows are in order of first appearance.

A lookup-only batch (``deduplicated=False``, from ``prepare(..., deduplicate=False)``) skips
the deduplication and the occurrence arrays: per table it keeps the validated features' own
arrays (``LookupOnlyTableBatch``, no copy), which the numba backend pools straight from; its
``occurrences`` (a TableBatch whose every occurrence is its own "unique" row) are built only
when asked for (the reference backend).

Combiner gains for sample ids ``i_k`` with weights ``w_k`` (1 when not given):
sum ``w_k``; mean ``w_k / sum(w)``; sqrtn ``w_k / sqrt(sum(w^2))``; 0 when the denominator is 0.
A sequence feature has gain 1 and one output row per (sample, position < max_sequence_length).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .config import ResolvedFeatures
from .inputs import Ragged, check_values, to_ragged

__all__ = [
    "TableBatch",
    "LookupOnlyTableBatch",
    "FeatureLayout",
    "PreparedBatch",
    "prepare",
    "plan_tables",
    "dedup",
]


@dataclass(frozen=True, eq=False)
class TableBatch:
    unique_ids: np.ndarray  # int64 [U], global row ids in order of first appearance
    inverse: np.ndarray  # int64 [N], occurrence -> index into unique_ids
    gains: np.ndarray  # float32 [N]
    segments: np.ndarray  # int64 [N], non-decreasing: occurrence -> activation row
    num_outputs: int  # rows of the table's activation matrix
    # CSR views of the same occurrences, for kernels that parallelise without atomics:
    output_offsets: np.ndarray  # int64 [num_outputs + 1]: occurrences of activation row o
    # The occurrences again, grouped by unique row (stable): row u's are the positions
    # unique_offsets[u]:unique_offsets[u + 1] of unique_gains / unique_segments.
    unique_offsets: np.ndarray  # int64 [U + 1]
    unique_gains: np.ndarray  # float32 [N]
    unique_segments: np.ndarray  # int64 [N]

    @property
    def num_occurrences(self) -> int:
        return len(self.inverse)


@dataclass(frozen=True, eq=False)
class FeatureLayout:
    table: int  # index of the feature's table
    start: int  # the feature's first row in its table's activation matrix
    stop: int
    shape: tuple[int, ...]  # the activation's shape, [..., dim]


@dataclass(frozen=True, eq=False)
class PreparedBatch:
    tables: tuple[TableBatch, ...] | tuple[LookupOnlyTableBatch, ...]
    features: dict[str, FeatureLayout]
    # False for a lookup-only batch (``preprocess(..., training=False)``): its tables are
    # LookupOnlyTableBatch, which can be looked up but not used to update tables.
    deduplicated: bool = True


def dedup(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unique ids in order of first appearance, and each id's index into them."""
    uniq, first, inv = np.unique(ids, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order), dtype=np.int64)
    return uniq[order].astype(np.int64), rank[inv.reshape(-1)]


def combiner_gains(r: Ragged, combiner: str) -> np.ndarray:
    """Each id's factor in its sample's combined vector (see module docstring), float32."""
    n = len(r.ids)
    w = np.ones(n, dtype=np.float64) if r.weights is None else r.weights.astype(np.float64)
    if combiner == "sum":
        return w.astype(np.float32)
    bag = np.repeat(np.arange(r.num_samples), r.lengths)
    if combiner == "mean":
        denom = np.bincount(bag, weights=w, minlength=r.num_samples)
    elif combiner == "sqrtn":
        denom = np.sqrt(np.bincount(bag, weights=w * w, minlength=r.num_samples))
    else:
        raise ValueError(f"unknown combiner {combiner!r}")
    d = denom[bag]
    with np.errstate(divide="ignore", invalid="ignore"):
        gains = np.where(d != 0, w / np.where(d != 0, d, 1.0), 0.0)
    return gains.astype(np.float32)


def _feature_occurrences(r: Ragged, seq_len: int, combiner: str):
    """(ids, gains, local output rows, number of output rows) of one feature."""
    bag = np.repeat(np.arange(r.num_samples, dtype=np.int64), r.lengths)
    if seq_len:
        pos = np.arange(len(r.ids), dtype=np.int64) - r.offsets[bag]
        keep = pos < seq_len
        ids = r.ids[keep]
        return (
            ids,
            np.ones(len(ids), dtype=np.float32),
            bag[keep] * seq_len + pos[keep],
            r.num_samples * seq_len,
        )
    return r.ids, combiner_gains(r, combiner), bag, r.num_samples


def normalise_features(resolved: ResolvedFeatures, features, weights) -> dict[str, Ragged]:
    """Validate the feature dict and every feature's values; name the culprit on error."""
    if not isinstance(features, Mapping):
        raise TypeError(f"features must be a dict of feature name -> ids, got {type(features)}")
    missing = [f for f in resolved.features if f not in features]
    extra = [f for f in features if f not in resolved.features]
    if missing or extra:
        raise ValueError(
            "features do not match the engine's: "
            + (f"missing {missing}" if missing else "")
            + ("; " if missing and extra else "")
            + (f"unknown {extra}" if extra else "")
            + f" (expected {list(resolved.features)})"
        )
    weights = {} if weights is None else weights
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a dict of feature name -> weights, got {type(weights)}")
    unknown_w = [f for f in weights if f not in resolved.features]
    if unknown_w:
        raise ValueError(f"weights given for unknown features {unknown_w}")
    out: dict[str, Ragged] = {}
    for name, fc in resolved.features.items():
        try:
            r = to_ragged(features[name], weights.get(name))
            if fc.is_sequence and r.weights is not None:
                raise ValueError("a sequence feature (max_sequence_length > 0) takes no weights")
            check_values(r, fc.table.vocabulary_size, fc.validate_weights_and_indices)
        except (TypeError, ValueError) as e:
            raise type(e)(f"feature {name!r}: {e}") from None
        out[name] = r
    return out


@dataclass(frozen=True, eq=False)
class FeaturePart:
    """One feature's share of its table's batch."""

    ragged: Ragged
    seq_len: int  # max_sequence_length (0: bag feature)
    combiner: str
    out_start: int  # the feature's first row in the table's activation matrix
    num_outputs: int
    id_offset: int = 0  # added to the feature's ids: its table's first row in packed storage


def csr(keys: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(offsets [n + 1], order [len(keys)]): order lists the positions of key 0, then key 1, ...
    each group in ascending position (a stable counting sort)."""
    order = np.argsort(keys, kind="stable").astype(np.int64)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(keys, minlength=n), out=offsets[1:])
    return offsets, order


def _table_occurrences(parts):
    """(ids, gains, segments, output_offsets, num_outputs) of one table's features, NumPy."""
    ids, gains, segs = [], [], []
    for part in parts:
        f_ids, f_gains, f_segs, _ = _feature_occurrences(part.ragged, part.seq_len, part.combiner)
        ids.append(f_ids + part.id_offset if part.id_offset else f_ids)
        gains.append(f_gains)
        segs.append(f_segs + part.out_start)
    num_outputs = sum(p.num_outputs for p in parts)
    all_ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    segments = np.concatenate(segs).astype(np.int64, copy=False) if segs else all_ids
    gains_all = (
        np.concatenate(gains).astype(np.float32, copy=False) if gains else np.zeros(0, np.float32)
    )
    output_offsets, _ = csr(segments, num_outputs)
    return all_ids, gains_all, segments, output_offsets, num_outputs


def build_tables_numpy(parts_per_table: list[list[FeaturePart]]) -> list[TableBatch]:
    """The reference construction of every table's batch (NumPy)."""
    tables = []
    for parts in parts_per_table:
        all_ids, gains_all, segments, output_offsets, num_outputs = _table_occurrences(parts)
        unique, inverse = dedup(all_ids)
        unique_offsets, by_unique = csr(inverse, len(unique))
        tables.append(
            TableBatch(
                unique_ids=unique,
                inverse=inverse,
                gains=gains_all,
                segments=segments,
                num_outputs=num_outputs,
                output_offsets=output_offsets,
                unique_offsets=unique_offsets,
                unique_gains=gains_all[by_unique],
                unique_segments=segments[by_unique],
            )
        )
    return tables


@dataclass(frozen=True, eq=False)
class LookupOnlyTableBatch:
    """One table's share of a lookup-only batch: its features' validated arrays, as given.

    Nothing is copied or deduplicated: a forward-only lookup pools straight from each feature's
    ids and offsets (the numba backend). ``occurrences`` is the same batch as a TableBatch in
    which every occurrence is its own "unique" row (``inverse`` the identity, no update views),
    built on first use."""

    parts: tuple[FeaturePart, ...]
    num_outputs: int

    @cached_property
    def occurrences(self) -> TableBatch:
        ids, gains, segments, output_offsets, num_outputs = _table_occurrences(self.parts)
        return TableBatch(
            unique_ids=ids,
            inverse=np.arange(len(ids), dtype=np.int64),
            gains=gains,
            segments=segments,
            num_outputs=num_outputs,
            output_offsets=output_offsets,
            unique_offsets=np.zeros(1, np.int64),
            unique_gains=np.zeros(0, np.float32),
            unique_segments=np.zeros(0, np.int64),
        )


def plan_tables(
    resolved: ResolvedFeatures,
    features,
    weights=None,
    storage_layout: list[list[tuple[str, int]]] | None = None,
) -> tuple[list[list[FeaturePart]], dict[str, FeatureLayout]]:
    """Validate features and split them by storage table: (each table's feature parts, each
    feature's place in its table's activation matrix). ``storage_layout`` lists, per storage
    table, its features with the row offset of their table in it (low-dimensional packing puts
    several tables in one); by default each table is its own storage."""
    ragged = normalise_features(resolved, features, weights)
    if storage_layout is None:
        storage_layout = [[(n, 0) for n in names] for names in resolved.table_features]
    layouts: dict[str, FeatureLayout] = {}
    parts_per_table: list[list[FeaturePart]] = []
    for t, members in enumerate(storage_layout):
        parts = []
        rows = 0
        for name, offset in members:
            fc = resolved.features[name]
            r = ragged[name]
            n_out = r.num_samples * fc.max_sequence_length if fc.is_sequence else r.num_samples
            layouts[name] = FeatureLayout(t, rows, rows + n_out, fc.activation_shape(r.num_samples))
            parts.append(FeaturePart(r, fc.max_sequence_length, fc.table.combiner, rows, n_out,
                                     offset))  # fmt: skip
            rows += n_out
        parts_per_table.append(parts)
    return parts_per_table, {name: layouts[name] for name in resolved.features}


def prepare(
    resolved: ResolvedFeatures,
    features,
    weights=None,
    build_tables=build_tables_numpy,
    storage_layout: list[list[tuple[str, int]]] | None = None,
    deduplicate: bool = True,
) -> PreparedBatch:
    """Validate features and build the per-table deduplication data (pure).

    ``deduplicate=False`` builds a lookup-only batch (``LookupOnlyTableBatch`` per table: the
    validated features, no deduplication, no update views): cheaper when nothing will be
    updated (evaluation, inference).

    ``build_tables(parts_per_table)`` turns each table's feature parts into its
    TableBatch; backends pass a faster construction with identical results. ``storage_layout``:
    see ``plan_tables``.
    """
    parts_per_table, layouts = plan_tables(resolved, features, weights, storage_layout)
    if deduplicate:
        tables = build_tables(parts_per_table)
    else:
        tables = [
            LookupOnlyTableBatch(tuple(parts), sum(p.num_outputs for p in parts))
            for parts in parts_per_table
        ]
    return PreparedBatch(tuple(tables), layouts, deduplicated=deduplicate)
