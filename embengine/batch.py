"""The prepared batch: per table, the deduplicated ids, their rows, and how occurrences map to
outputs.

This is what the TPU's deduplication data is: computed once from the features, it serves the
lookup (gather unique rows, combine into activations) and the update (sum each occurrence's
gradient into its unique row) of the same step. Building it is pure: no table state is read, so
it can run in a DataLoader worker.

Per physical table, the occurrences of all its features are concatenated in feature order
(then sample order, then position); the features of one logical table (a member of the
physical table: low-dimensional packing puts several in one) are consecutive. Occurrence ``k``
is id ``unique_ids[inverse[k]]`` of its logical table, is scaled by ``gains[k]`` and lands in
row ``segments[k]`` of the table's activation matrix, whose rows are the features' outputs
stacked in the same order. Ids are deduplicated per logical table, in order of first
appearance, member after member (``unique_bounds``). The kernels read and write
``unique_rows[inverse[k]]``: the storage's row of each unique id (``storage.protocol``), never
an id. For a storage whose rows are ids at fixed bases (DenseTable: ``row_bases``) the rows are
resolved here from the storage plan (``FeaturePart.row_offset``), still without reading a
table; the engine resolves any other storage's rows with its ``rows_for`` (``resolved``).

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

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from functools import cached_property
from typing import NamedTuple

import numpy as np

from .config import ResolvedFeatures
from .inputs import Ragged, check_values, to_ragged

__all__ = [
    "TableBatch",
    "LookupOnlyTableBatch",
    "FeatureLayout",
    "PreparedBatch",
    "FeatureSignature",
    "BatchFingerprint",
    "batch_fingerprint",
    "check_prepared_for",
    "check_lookup_only_ids",
    "check_for_training",
    "check_trainable",
    "prepare",
    "plan_tables",
    "dedup",
    "identity_rows",
]


@dataclass(frozen=True, eq=False)
class TableBatch:
    unique_ids: np.ndarray  # int64 [U], ids of the logical tables, in order of first appearance
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
    # Logical table (member) i's unique ids are unique_ids[unique_bounds[i]:unique_bounds[i + 1]].
    unique_bounds: np.ndarray  # int64 [members + 1]
    # The storage's row of each unique id (NO_ROW, -1: none; it pools zeros and is not updated),
    # what the kernels index; None until resolved (a storage without row_bases: ``resolved``).
    unique_rows: np.ndarray | None

    def __post_init__(self):
        # The kernels index tables and outputs with these arrays without checking them (that
        # is the point of preparing once): nobody may write to them after preparation. The
        # numba backend carves them from recycled blocks; the flag is on these views only, so
        # a block's next batch gets writable arrays again (block_pool).
        for f in _TABLE_BATCH_ARRAYS:
            a = getattr(self, f)
            if a is not None and a.flags.writeable:
                a.flags.writeable = False

    def resolved(
        self, storage, insert: bool, found: np.ndarray | None = None, touched: bool = False
    ) -> TableBatch:
        """This batch with ``unique_rows`` from ``storage.rows_for`` (a ``TableStorage``), one
        call per logical table on its unique ids: how the engine resolves a storage without
        ``row_bases``. ``insert``: training (ids may get new rows) or lookup only. A storage
        with ``counts_occurrences`` (a keyed table's admission) also gets, in training, each
        unique id's occurrences in the batch (``counts=``); one with ``lookup_index`` gets the
        rows its index gave the unique ids, when a kernel probed them already (``found=``),
        and whether the kernel touched them too (``touched=``)."""
        rows = np.empty(len(self.unique_ids), dtype=np.int64)
        counted = insert and getattr(storage, "counts_occurrences", False)
        for m, lo, hi in self._members():
            ids = self.unique_ids[lo:hi]
            kw = {} if found is None else {"found": found[lo:hi], "touched": touched}
            if counted and not (found is not None and touched):  # touched: counted too
                kw["counts"] = self._counts(lo, hi)
            rows[lo:hi] = storage.rows_for(m, ids, insert, **kw)
        return dataclasses.replace(self, unique_rows=rows)

    def check_resolvable(
        self, storage, found: np.ndarray | None = None, update: bool = False
    ) -> None:
        """Raise what ``resolved(storage, insert=True, found=)`` would raise for this batch (a
        keyed table's ``max_rows`` or row limit: ``check_rows``), and with ``update`` what its
        ``for_update`` would raise next, changing nothing. A batch whose rows are resolved, or
        a storage that refuses nothing, has nothing to check."""
        check = getattr(storage, "check_rows", None)
        if check is None or self.unique_rows is not None:
            return
        for m, lo, hi in self._members():
            part = None if found is None else found[lo:hi]
            check(m, self.unique_ids[lo:hi], found=part, update=update)

    def _members(self) -> Iterator[tuple[int, int, int]]:
        """``(logical table, lo, hi)`` of each logical table with unique ids in the batch: its
        unique ids are ``unique_ids[lo:hi]`` (``unique_bounds``)."""
        b = self.unique_bounds
        for m in range(len(b) - 1):
            lo, hi = int(b[m]), int(b[m + 1])
            if hi > lo:
                yield m, lo, hi

    def _counts(self, lo: int, hi: int) -> np.ndarray:
        """Occurrences of unique ids ``lo:hi`` in the batch."""
        return np.diff(self.unique_offsets[lo : hi + 1])

    def for_update(self, storage) -> TableBatch:
        """This (resolved) batch with the rows its update writes: a storage with
        ``rows_for_update`` (a keyed table inserting on apply) may give ids without a row one
        now; any other storage's rows are the lookup's (the same batch)."""
        hook = getattr(storage, "rows_for_update", None)
        if hook is None or self.unique_rows is None:
            return self
        rows = self.unique_rows.copy()
        for m, lo, hi in self._members():
            rows[lo:hi] = hook(
                m, self.unique_ids[lo:hi], self.unique_rows[lo:hi], counts=self._counts(lo, hi)
            )
        return dataclasses.replace(self, unique_rows=rows)

    def check_for_update(self, storage) -> None:
        """Raise what ``for_update(storage)`` would raise (``check_update_rows``), changing
        nothing."""
        check = getattr(storage, "check_update_rows", None)
        if check is None or self.unique_rows is None:
            return
        for m, lo, hi in self._members():
            check(m, self.unique_ids[lo:hi], self.unique_rows[lo:hi])

    # Rebuilt through __init__ when copied or unpickled (a DataLoader worker's batch): unpickled
    # arrays are writable.
    def __reduce__(self):
        return (TableBatch, tuple(getattr(self, f.name) for f in fields(self)))

    @property
    def num_occurrences(self) -> int:
        return len(self.inverse)

    @property
    def lists_occurrences(self) -> bool:
        """Whether this batch lists every occurrence as its own "unique" id, without update
        views (``LookupOnlyTableBatch.occurrences``: ``unique_offsets`` not of
        ``len(unique_ids) + 1``)."""
        return len(self.unique_offsets) != len(self.unique_ids) + 1

    def occurrence_ids(self, lo: int, hi: int) -> np.ndarray:
        """The ids of occurrences ``lo:hi``, in occurrence order (a batch that lists its
        occurrences gives a view, with no gather through ``inverse``)."""
        if self.lists_occurrences:
            return self.unique_ids[lo:hi]
        return self.unique_ids[self.inverse[lo:hi]]


_TABLE_BATCH_ARRAYS = (
    "unique_ids",
    "inverse",
    "gains",
    "segments",
    "output_offsets",
    "unique_offsets",
    "unique_gains",
    "unique_segments",
    "unique_bounds",
    "unique_rows",
)


def identity_rows(
    unique_ids: np.ndarray, unique_bounds: np.ndarray, row_offsets: list[int]
) -> np.ndarray | None:
    """The rows of a storage whose rows are ids at fixed bases (``TableStorage.row_bases``,
    DenseTable): member i's ids plus ``row_offsets[i]``, its first row in the storage plan.
    An unpacked table's rows are its ids (the same array, no copy). None if an offset is
    negative: the storage maps ids to rows itself (the engine resolves them, ``resolved``)."""
    if any(o < 0 for o in row_offsets):
        return None
    if not any(row_offsets):
        return unique_ids
    rows = np.empty_like(unique_ids)
    for m, base in enumerate(row_offsets):
        lo, hi = int(unique_bounds[m]), int(unique_bounds[m + 1])
        np.add(unique_ids[lo:hi], base, out=rows[lo:hi])
    return rows


@dataclass(frozen=True, eq=False)
class FeatureLayout:
    table: int  # index of the feature's table
    start: int  # the feature's first row in its table's activation matrix
    stop: int
    shape: tuple[int, ...]  # the activation's shape, [..., dim]


class FeatureSignature(NamedTuple):
    """What a feature's share of a prepared batch depends on."""

    vocabulary_size: int  # its table's rows: the ids were checked against it
    dim: int  # the activation's and the gradient's width
    max_sequence_length: int  # output rows per sample (0: one, a bag)
    combiner: str  # the gains
    output_shape: tuple[int, ...] | None  # the activation's shape


@dataclass(frozen=True)
class BatchFingerprint:
    """What a PreparedBatch was prepared for: per feature (in order) its FeatureSignature, and
    the storage layout (per storage table, its features with the first row of their table in
    it: low-dimensional packing puts several tables in one). A batch is safe to look up or
    train on in any engine with an equal fingerprint (e.g. one built from the same configs, or
    the engine pickled into a DataLoader worker): its ids and output rows fit that engine's
    tables. Compact (a few ints per feature) and compared in O(features)."""

    features: tuple[tuple[str, FeatureSignature], ...]
    storage: tuple[tuple[tuple[str, int], ...], ...]

    def difference(self, engine: BatchFingerprint) -> str | None:
        """None if equal, else what differs, said from this (the batch's) side; ``engine`` is
        the fingerprint of the engine the batch was given to."""
        if self == engine:
            return None
        mine, theirs = dict(self.features), dict(engine.features)
        if list(mine) != list(theirs):
            if set(mine) == set(theirs):
                return (
                    f"it has the features in the order {list(mine)}, this engine in the order "
                    f"{list(theirs)}"
                )
            return f"it has features {list(mine)}, this engine has {list(theirs)}"
        problems = []
        for name, sig in mine.items():
            other = theirs[name]
            if sig.vocabulary_size != other.vocabulary_size:
                problems.append(
                    f"feature {name!r}: prepared for a table of {sig.vocabulary_size} rows, "
                    f"this engine's has {other.vocabulary_size}"
                )
            if sig.dim != other.dim:
                problems.append(
                    f"feature {name!r}: prepared for a table of dim {sig.dim}, this engine's "
                    f"has dim {other.dim}"
                )
            if sig.max_sequence_length != other.max_sequence_length:
                problems.append(
                    f"feature {name!r}: prepared with max_sequence_length "
                    f"{sig.max_sequence_length}, this engine's is {other.max_sequence_length}"
                )
            if sig.combiner != other.combiner:
                problems.append(
                    f"feature {name!r}: prepared for combiner {sig.combiner!r}, this engine's "
                    f"table has {other.combiner!r}"
                )
            if sig.output_shape != other.output_shape:
                problems.append(
                    f"feature {name!r}: prepared for output_shape {_shape(sig.output_shape)}, "
                    f"this engine's is {_shape(other.output_shape)}"
                )
        if problems:
            return "; ".join(problems)
        if self.storage == engine.storage:  # not reached: features and storage are all there is
            return f"its fingerprint is {self}, this engine's is {engine}"
        return (
            f"it was prepared with the tables stored as {_storage(self.storage)}, this engine "
            f"stores them as {_storage(engine.storage)} (storage tables as [feature@first "
            "row, ...]; low-dimensional packing puts several tables in one)"
        )


def _shape(shape: tuple[int, ...] | None) -> str:
    return "None" if shape is None else str(list(shape))


def _storage(storage: tuple[tuple[tuple[str, int], ...], ...]) -> str:
    return (
        "["
        + ", ".join(
            "[" + ", ".join(f"{name}@{row}" for name, row in members) + "]" for members in storage
        )
        + "]"
    )


def batch_fingerprint(
    resolved: ResolvedFeatures, storage_layout: list[list[tuple[str, int]]] | None = None
) -> BatchFingerprint:
    """The fingerprint of batches prepared from ``resolved`` with ``storage_layout`` (see
    ``plan_tables``)."""
    if storage_layout is None:
        storage_layout = _default_layout(resolved)
    signatures = []
    for name, fc in resolved.features.items():
        t = fc.table
        shape = fc.output_shape
        signatures.append(
            (
                name,
                FeatureSignature(
                    t.vocabulary_size, t.dim, fc.max_sequence_length, t.combiner, shape
                ),
            )
        )
    return BatchFingerprint(
        tuple(signatures),
        tuple(tuple((name, int(row)) for name, row in members) for members in storage_layout),
    )


def _default_layout(resolved: ResolvedFeatures) -> list[list[tuple[str, int]]]:
    return [[(n, 0) for n in names] for names in resolved.table_features]


@dataclass(frozen=True, eq=False)
class PreparedBatch:
    """Per storage table the deduplication data, per feature its place in the activations, and
    the fingerprint of what it was prepared for (an engine refuses a batch whose fingerprint
    differs from its own, naming what differs). Made by ``prepare`` (``engine.preprocess``);
    its arrays are read-only. Building one by hand is not supported: nothing but the
    fingerprint and the ids of lookup-only batches is checked again when it is used."""

    tables: tuple[TableBatch, ...] | tuple[LookupOnlyTableBatch, ...]
    features: dict[str, FeatureLayout]
    # False for a lookup-only batch (``preprocess(..., training=False)``): its tables are
    # LookupOnlyTableBatch, which can be looked up but not used to update tables.
    deduplicated: bool = True
    fingerprint: BatchFingerprint | None = None
    # The engine state its rows were resolved in, where a storage maps ids to rows itself (a
    # keyed table): an engine refuses such rows after a load, or from another engine, since
    # they may hold other keys there. None: its rows are ids, or not resolved yet.
    resolved_in: int | None = None
    # The engine state a training lookup looked it up in: its gradients are of the tables as
    # they were then, so an engine refuses to apply them after a load. None: not looked up
    # for training (a batch from ``preprocess`` may be applied without a lookup).
    looked_up_in: int | None = None
    # False: built for evaluation (``preprocess(..., training=False)``, or the batch an
    # evaluation lookup of features gives back): it may be looked up, never trained on. An
    # EmbeddingEngine's is lookup-only (``deduplicated=False``); a ShardedEngine's is
    # deduplicated (its lookup asks each owner for a unique id once) and refused all the same,
    # so that code runs alike on either engine (``check_for_training``).
    training: bool = True


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
    if r.weights is None and combiner == "sum":
        return np.ones(n, dtype=np.float32)
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


def normalise_features(
    resolved: ResolvedFeatures, features, weights, check_ids: bool = True
) -> dict[str, Ragged]:
    """Validate the feature dict and every feature's values; name the culprit on error.
    ``check_ids=False`` leaves the ids' range to the caller (a backend that checks a
    lookup-only batch's ids while it pools them: ``Backend.checks_lookup_ids``)."""
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
            r = to_ragged(features[name], weights.get(name), keyed=fc.table.vocabulary_size is None)
            if fc.is_sequence and r.weights is not None:
                raise ValueError("a sequence feature (max_sequence_length > 0) takes no weights")
            vocabulary = fc.table.vocabulary_size if check_ids else None
            check_values(r, vocabulary, fc.validate_weights_and_indices)
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
    # Its logical table's first row in the physical table (the storage plan's row_offset): the
    # row of id 0 in a storage with row_bases; -1 for a storage that maps ids to rows itself.
    row_offset: int = 0
    name: str = ""  # the feature's name (error messages, the ids' check at lookup)
    member: int = 0  # its logical table's index in the physical table (rows_for's ``logical``)
    # Its table's vocabulary, the range of its ids (None: a keyed table's keys, any int64):
    # what a backend that checks a lookup-only batch's ids itself checks them against.
    vocabulary_size: int | None = None


def csr(keys: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(offsets [n + 1], order [len(keys)]): order lists the positions of key 0, then key 1, ...
    each group in ascending position (a stable counting sort)."""
    order = np.argsort(keys, kind="stable").astype(np.int64)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(keys, minlength=n), out=offsets[1:])
    return offsets, order


def _table_occurrences(parts):
    """(ids, gains, segments, output_offsets, num_outputs, occurrences per part) of one table's
    features, NumPy; ids are their logical tables' own."""
    ids, gains, segs = [], [], []
    # The output rows' occurrence counts, part by part (their rows are consecutive): csr's
    # offsets without its stable sort of the positions, which nothing here needs.
    per_row = []
    for part in parts:
        f_ids, f_gains, f_segs, n_out = _feature_occurrences(
            part.ragged, part.seq_len, part.combiner
        )
        per_row.append(
            np.bincount(f_segs, minlength=n_out) if part.seq_len else part.ragged.lengths
        )
        f_segs += part.out_start  # a new array of _feature_occurrences'
        ids.append(f_ids)
        gains.append(f_gains)
        segs.append(f_segs)
    num_outputs = sum(p.num_outputs for p in parts)
    all_ids = np.concatenate(ids).astype(np.int64, copy=False) if ids else np.zeros(0, np.int64)
    segments = np.concatenate(segs).astype(np.int64, copy=False) if segs else all_ids
    gains_all = (
        np.concatenate(gains).astype(np.float32, copy=False) if gains else np.zeros(0, np.float32)
    )
    output_offsets = np.zeros(num_outputs + 1, dtype=np.int64)
    if per_row:
        np.cumsum(np.concatenate(per_row), out=output_offsets[1:])
    return all_ids, gains_all, segments, output_offsets, num_outputs, [len(i) for i in ids]


def _member_spans(parts, counts) -> list[tuple[int, int, int]]:
    """(row_offset, first occurrence, stop) of each member of a table, in member order (its
    parts are consecutive, members numbered from 0: ``plan_tables``)."""
    spans: list[list[int]] = []
    pos = 0
    for part, n in zip(parts, counts, strict=True):
        if part.member == len(spans):
            spans.append([part.row_offset, pos, pos])
        spans[part.member][2] = pos + n
        pos += n
    return [tuple(x) for x in spans]


def build_tables_numpy(parts_per_table: list[list[FeaturePart]]) -> list[TableBatch]:
    """The reference construction of every table's batch (NumPy): ids deduplicated per logical
    table, rows resolved for storages whose rows are ids (``identity_rows``)."""
    tables = []
    for parts in parts_per_table:
        all_ids, gains_all, segments, output_offsets, num_outputs, counts = _table_occurrences(
            parts
        )
        spans = _member_spans(parts, counts)
        inverse = np.empty(len(all_ids), dtype=np.int64)
        uniques, bounds = [], [0]
        for _, lo, hi in spans:
            u, inv = dedup(all_ids[lo:hi])
            inverse[lo:hi] = inv + bounds[-1]
            uniques.append(u)
            bounds.append(bounds[-1] + len(u))
        unique = np.concatenate(uniques) if uniques else np.zeros(0, np.int64)
        unique_bounds = np.array(bounds, dtype=np.int64)
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
                unique_bounds=unique_bounds,
                unique_rows=identity_rows(unique, unique_bounds, [sp[0] for sp in spans]),
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
        ids, gains, segments, output_offsets, num_outputs, counts = _table_occurrences(self.parts)
        spans = _member_spans(self.parts, counts)
        bounds = np.array([0] + [hi for _, _, hi in spans], dtype=np.int64)
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
            unique_bounds=bounds,
            unique_rows=identity_rows(ids, bounds, [sp[0] for sp in spans]),
        )


def check_prepared_for(
    batch: PreparedBatch, fingerprint: BatchFingerprint, resolved: ResolvedFeatures
) -> None:
    """ValueError unless ``batch`` was prepared for an engine with this ``fingerprint`` (of
    ``resolved`` and its storage layout), saying what differs. O(features and tables), plus
    the ids' range of a lookup-only batch (``check_lookup_only_ids``)."""
    mine = batch.fingerprint
    if not isinstance(mine, BatchFingerprint):
        raise ValueError(
            "this PreparedBatch does not record what it was prepared for (it was not made by "
            "preprocess()); build batches with engine.preprocess(features)"
        )
    problem = None if mine is fingerprint else mine.difference(fingerprint)
    if problem is not None:
        raise ValueError(f"this PreparedBatch was prepared for another engine: {problem}")
    # A batch agrees with its own fingerprint unless it was put together by hand.
    kind = TableBatch if batch.deduplicated else LookupOnlyTableBatch
    names = [n for n, _ in fingerprint.features]
    if (
        list(batch.features) != names
        or len(batch.tables) != len(fingerprint.storage)
        or not all(type(tb) is kind for tb in batch.tables)
    ):
        raise ValueError(
            f"this PreparedBatch does not agree with its own fingerprint: it has features "
            f"{list(batch.features)} and {len(batch.tables)} storage tables "
            f"({sorted({type(tb).__name__ for tb in batch.tables})}, deduplicated="
            f"{batch.deduplicated}); its fingerprint has {names} and "
            f"{len(fingerprint.storage)} (was it built by hand?)"
        )
    if not batch.deduplicated:
        check_lookup_only_ids(batch, resolved)


def check_for_training(batch: PreparedBatch) -> None:
    """ValueError if ``batch`` was built for evaluation (``PreparedBatch.training``): a
    training lookup or an update of it, on either engine."""
    if not batch.training:
        raise ValueError(
            "this PreparedBatch was built for evaluation (training=False): look it up with "
            "lookup(batch, training=False), or build it with preprocess(features) (or look "
            "the features up with training=True) to train on it"
        )


def check_trainable(batch: PreparedBatch) -> None:
    """ValueError unless ``batch`` was built for training (``check_for_training``) and every
    table of it has its update views (``unique_offsets`` of ``len(unique_ids) + 1``): a
    ShardedEngine's lookup batch lists the occurrences of a table that exchanges "sums"
    whatever the step as they came (``LookupOnlyTableBatch.occurrences``: ids repeated, no
    update views), which an EmbeddingEngine's update would read as unique rows. O(tables); a
    lookup may pool such a batch."""
    check_for_training(batch)
    for t, tb in enumerate(batch.tables):
        if isinstance(tb, TableBatch) and tb.lists_occurrences:
            names = [name for name, lay in batch.features.items() if lay.table == t]
            raise ValueError(
                f"this PreparedBatch lists the occurrences of feature {names[0]!r} "
                "undeduplicated (a ShardedEngine's lookup batch of a table that exchanges "
                '"sums"): only that ShardedEngine updates from it; look it up with '
                "training=False, or build a batch with preprocess(features) to train on it"
            )


def check_lookup_only_ids(batch: PreparedBatch, resolved: ResolvedFeatures) -> None:
    """Range-check the ids of a lookup-only batch again, just before its lookup.

    A lookup-only batch keeps read-only views of the caller's id arrays, not copies (the copy
    would cost more than the lookup's preparation), and the kernels read table rows at those
    ids: an array the caller changed after ``preprocess(..., training=False)`` must give an
    error, not a read outside the table. Two reductions (min, max) per feature, cheap beside
    the lookup (W1-lookup: docs/performance.md, "Figures behind the code")."""
    for tb in batch.tables:
        for part in tb.parts:
            fc = resolved.features[part.name]
            try:
                check_values(part.ragged, fc.table.vocabulary_size, check_weights=False)
            except ValueError as e:
                raise ValueError(
                    f"feature {part.name!r}: {e}; the ids were in range when the batch was "
                    "prepared: the array passed to preprocess(..., training=False) was changed "
                    "before this lookup"
                ) from None


def plan_tables(
    resolved: ResolvedFeatures,
    features,
    weights=None,
    storage_layout: list[list[tuple[str, int]]] | None = None,
    check_ids: bool = True,
) -> tuple[list[list[FeaturePart]], dict[str, FeatureLayout]]:
    """Validate features and split them by storage table: (each table's feature parts, each
    feature's place in its table's activation matrix). ``storage_layout`` lists, per storage
    table, its features with the row offset of their table in it (low-dimensional packing puts
    several tables in one; -1: the storage maps ids to rows itself, so the batch leaves its
    rows to the engine), each table's features together; by default each table is its own
    storage. ``check_ids``: as ``normalise_features``'s."""
    ragged = normalise_features(resolved, features, weights, check_ids)
    if storage_layout is None:
        storage_layout = _default_layout(resolved)
    layouts: dict[str, FeatureLayout] = {}
    parts_per_table: list[list[FeaturePart]] = []
    for t, members in enumerate(storage_layout):
        parts = []
        rows = 0
        seen: list[int] = []  # the logical tables met so far, in order: the members
        for name, offset in members:
            fc = resolved.features[name]
            r = ragged[name]
            n_out = r.num_samples * fc.max_sequence_length if fc.is_sequence else r.num_samples
            layouts[name] = FeatureLayout(t, rows, rows + n_out, fc.activation_shape(r.num_samples))
            table = resolved.feature_table[name]
            if not seen or seen[-1] != table:
                if table in seen:  # members are deduplicated one after another
                    raise ValueError(
                        f"storage_layout[{t}]: feature {name!r} is not next to the other "
                        f"features of table {resolved.table_names[table]!r}; list each table's "
                        "features together (StoragePlan.storage_layout does)"
                    )
                seen.append(table)
            parts.append(
                FeaturePart(
                    r,
                    fc.max_sequence_length,
                    fc.table.combiner,
                    rows,
                    n_out,
                    offset,
                    name,
                    len(seen) - 1,
                    fc.table.vocabulary_size,
                )
            )
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
    fingerprint: BatchFingerprint | None = None,
    check_ids: bool = True,
    training: bool | None = None,
) -> PreparedBatch:
    """Validate features and build the per-table deduplication data (pure).

    ``training``: whether the batch may be trained on (``PreparedBatch.training``); default
    ``deduplicate``. False with ``deduplicate=True`` is a ShardedEngine's evaluation batch,
    deduplicated because its lookup asks each owner for a unique id once.

    ``deduplicate=False`` builds a lookup-only batch (``LookupOnlyTableBatch`` per table: the
    validated features, no deduplication, no update views): cheaper when nothing will be
    updated (evaluation, inference).

    ``build_tables(parts_per_table)`` turns each table's feature parts into its
    TableBatch; backends pass a faster construction with identical results. ``storage_layout``:
    see ``plan_tables``. ``fingerprint``: ``batch_fingerprint(resolved, storage_layout)``,
    computed here if not given (an engine passes its own, computed once). ``check_ids=False``
    (a lookup-only batch only) leaves the ids' range to the backend that looks it up.
    """
    if not check_ids and deduplicate:
        raise ValueError("a deduplicated batch's ids are checked when it is prepared")
    parts_per_table, layouts = plan_tables(resolved, features, weights, storage_layout, check_ids)
    if deduplicate:
        tables = build_tables(parts_per_table)
    else:
        tables = [
            LookupOnlyTableBatch(tuple(parts), sum(p.num_outputs for p in parts))
            for parts in parts_per_table
        ]
    if fingerprint is None:
        fingerprint = batch_fingerprint(resolved, storage_layout)
    return PreparedBatch(
        tuple(tables),
        layouts,
        deduplicated=deduplicate,
        fingerprint=fingerprint,
        training=deduplicate if training is None else training and deduplicate,
    )
