"""ShardedEngine: tables sharded over the ranks of a torch.distributed group, trained exactly as
one EmbeddingEngine trains on the concatenation of every rank's batch, in rank order.

Each rank passes its own samples. One training step::

    acts = engine.lookup(features)        # this rank's samples, from the rows' owners
    engine.apply_gradients(grads)         # contributions to the owners, one update per row

What crosses the wire is chosen per table (``exchange=``; "auto" per step, by the cost model):

"rows": each rank deduplicates its ids per table, sends each owner the unique ids it owns
(``all_to_all_single``), gets their rows back (another), and pools its bags locally with the
backend's ``lookup_rows``: a bag is pooled by one rank from the same rows in the same order as
the single engine pools it, so activations are bit-identical to the single engine's. The
update pushes, for every occurrence of an id, the id, its gain and the activation-gradient row
it multiplies to the owner (each gradient row once per owner, the occurrences pointing at it).

"sums": each rank sends every occurrence to the owner of its id; the owner pools its rows'
part of every bag and sends these partial sums back, which the rank adds in rank order (a bag
whose ids all live on one rank is bit-identical; any other equal up to float32 rounding). The
owner keeps the occurrences, so an update from that lookup's batch on every rank sends only
the gradient rows (any other batch is pushed as under "rows"). A whole table (on one rank)
goes leaner: each rank sends its owner the table's bags as they are (offsets and ids), the
owner prepares and pools the step's batch of the table in one kernel, exactly as the single
engine does (bit-identical activations), answers each bag's row, and updates from that batch.

Either way the owner puts the occurrences of its rows in the single engine's occurrence order
(a table's features in order, then ranks in order, then each rank's samples and positions),
builds the TableBatch the single engine would have built for its rows, and runs the ordinary
fused update on its shard: one update per touched row per global step, its gradient summed in
the single-process order, so tables and slots are bit-identical.

The bookkeeping (owner split, rows answered, occurrences packed and pushed, the owner's batch)
runs in numba, one pass per table or feature (``kernels/shard_route.py``); pulled and pushed
rows are read where they arrived when they lie on one grid of their width (``_RowsLayout``).

Every call begins with a header all-to-all (a fixed-size int64 row per rank: which call, the
step, whether the rank's input was valid, its counts, its learning rates), so a rank whose input
fails validation makes every rank raise instead of leaving them waiting, and a step counter or a
learning rate that differs between ranks is an error, not a silent divergence. Every rank issues
the same collectives each step, empty local batches included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import threading
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch.distributed as dist

from ..backends.block_pool import BlockPool, Carver
from ..backends.registry import make_backend
from ..batch import (
    FeaturePart,
    LookupOnlyTableBatch,
    PreparedBatch,
    TableBatch,
    batch_fingerprint,
    check_for_training,
    check_prepared_for,
    plan_tables,
)
from ..batch import prepare as prepare_batch
from ..config import FeatureConfig, TableConfig
from ..engine import (
    _STATES,
    NonFiniteUpdateError,
    _check_timestamp,
    _describe_unchanged,
    check_step_room,
    checked_gradient,
    close_tables,
    engine_arguments,
    int_slot_ranges,
    step_bound,
)
from ..inputs import Ragged, check_values, frozen
from ..kernels import shard_route as sr
from ..learning_rates import LearningRates
from ..optimizers import Optimizer
from ..precision import numpy_dtype
from ..spec import (
    feature_entries,
    initializer_for,
    initializer_to_json,
    optimizer_to_json,
    table_entries,
)
from ..state import NO_TIME, WEIGHTS
from ..storage import StorageError, plan_storage
from ..storage.dense import column_view, row_columns, row_dtype
from ..storage.keyed import KeyedTable, shared_pending, shared_room, shared_victims
from ..storage.plan import table_files
from .comm import MEET_EVERY, Comm, group_timeout, meet_in_the_default_group
from .sharding import (
    KEYED,
    ShardPlan,
    ShardTable,
    TableLoad,
    UpdateMessage,
    expected_traffic,
    message_grid,
    plan_exchange,
    plan_shards,
    sums_saving,
    update_message,
)

__all__ = ["ShardedEngine", "DistributedError", "DEFAULT_TIMEOUT"]

# Seconds a collective waits for a peer before the process group gives up: short, so that a hung
# rank is an error soon (torch's default is 30 minutes).
DEFAULT_TIMEOUT = 60.0

# The header's call codes. A training lookup and an evaluation one (``_EVAL``) are calls of
# their own: owners keep a training lookup's occurrences for the update ("sums" exchange) and
# run a keyed table's rules on it, so the ranks must agree on which it is.
_LOOKUP, _APPLY, _CONTENTS, _SAVE, _RESTORE, _EVAL = 1, 2, 3, 4, 5, 6
_CALLS = {
    _LOOKUP: "lookup",
    _EVAL: "lookup(training=False)",
    _APPLY: "apply_gradients",
    _CONTENTS: "table_contents",
    _SAVE: "save",
    _RESTORE: "restore",
}
# Header columns: call, step, valid, the call's data time (NO_TIME: none); then ``_Columns``.
_FIXED = 4
# The header's "valid" column: 1 when the rank's call may go on, else why it may not
# (``_failure_code``), so that the others say what kind of failure it was: its input failed
# its checks (0: a ValueError, TypeError or LookupError), its tables' storage could not be
# used (a StorageError), any other error before the header (a bug's RuntimeError, a
# MemoryError: not its input), or a speculating update's message failed to pack after every
# check (``_PACKING``: the rank sends its header in a message of zeros, so the others raise
# at once, naming it, instead of waiting for its message until the timeout), or the rank was
# interrupted before its header (``_INTERRUPTED``: a KeyboardInterrupt, or another
# BaseException that is not an Exception, during a lookup's or an update's checks: the rank
# still sends its header, then raises its interruption, so that the others raise at once
# instead of waiting at the header until the timeout).
_VALID, _INVALID, _OTHER, _PACKING, _STORAGE, _INTERRUPTED = 1, 0, 2, 3, 4, 5
_FAILURES = {
    _INVALID: "their input was invalid",
    _OTHER: "an error of theirs that is not about their input, not a ValueError, TypeError or "
    "LookupError",
    _PACKING: "packing their update's message failed, after every check of their input",
    _STORAGE: "their tables' storage could not be used: a StorageError",
    _INTERRUPTED: "they were interrupted before their header: a KeyboardInterrupt or another "
    "BaseException that is not an Exception",
}


def _failure_code(error: BaseException) -> int:
    """The header's code (``_FAILURES``) for ``error``, this rank's before its header."""
    if not isinstance(error, Exception):  # a KeyboardInterrupt, a SystemExit
        return _INTERRUPTED
    if isinstance(error, StorageError):  # a ValueError, but of the rank's files, not its input
        return _STORAGE
    if isinstance(error, ValueError | TypeError | LookupError):
        return _INVALID
    return _OTHER


# Groups of "sums" tables whose partial sums travel apart, each while the next is pooled.
_SUMS_GROUPS = 2


@dataclasses.dataclass(frozen=True)
class _Columns:
    """Where a header's counts lie (int64 columns after the ``_FIXED`` ones), per destination.

    lookup: ``n`` / ``m``, per feature, its occurrences and distinct activation rows among them
    owned by the destination (the "sums" exchange's counts; the update's push reuses them;
    a whole table's, ``_pool_whole``: every activation row of the feature); ``a``, per
    table, the unique ids owned by the destination ("rows" exchange; a whole table's "sums":
    1 when its gains follow its ids, else 0); ``b``, per
    table, this rank's ``sums_saving`` (the same to every destination, so that every rank
    sums the same figures and picks the same exchange); ``k`` (engines with keyed tables),
    per table, this rank's unique ids of it (whether any rank brought keys); ``p`` (keyed
    too), per table, the keys pending admission on this rank's shard (with ``k``, whether
    the table's pending keys may pass its ``max_pending``: ``_crowded``), and ``q``, its
    ``max_pending`` (the table's: the ranks must agree, ``_check_header``).
    apply_gradients: ``n`` / ``m`` as the lookup's (the occurrences pushed, the gradient rows);
    ``a``, each table's learning rate (float64 bits); ``b``, per table, 0, or 1 when this rank
    updates from its last training lookup's batch, 2 when that lookup exchanged "sums" for
    the table (its owners kept the occurrences)."""

    n: int
    m: int
    a: int
    b: int
    k: int
    p: int
    q: int
    width: int

    @classmethod
    def of(cls, features: int, tables: int, keyed: bool) -> _Columns:
        n = _FIXED
        m, a = n + features, n + 2 * features
        b, k = a + tables, a + 2 * tables
        p, q = k + tables, k + 2 * tables
        return cls(n, m, a, b, k, p, q, k + (3 * tables if keyed else 0))


@dataclasses.dataclass
class _Push:
    """A batch's occurrences cut by owner (``_push_counts``): per table the owner of each
    unique id; per feature its occurrences (``n``) and distinct activation rows among them
    (``m``) per owner, and its span ``(table batch, owners, first occurrence, end, first
    activation row)``."""

    owners: dict[int, np.ndarray]
    n: np.ndarray  # int64 [feature, owner]
    m: np.ndarray  # int64 [feature, owner]
    spans: list[tuple[TableBatch, np.ndarray, int, int, int]]

    @classmethod
    def empty(cls, features: int, world: int) -> _Push:
        zeros = np.zeros((features, world), dtype=np.int64)
        return cls({}, zeros, zeros.copy(), [])


@dataclasses.dataclass
class _Lookup:
    """What a training lookup leaves its update: the batch, its ``_Push``, which tables
    exchanged "sums" and, for those, the activation row of each partial sum received
    (``targets``, owner d's block of feature f from ``target_at[d, f]``) and the occurrences
    of this rank's rows it kept (table -> ``_Kept``)."""

    batch: PreparedBatch
    push: _Push
    exchanged_sums: np.ndarray  # bool per table
    targets: np.ndarray | None
    target_at: np.ndarray | None
    kept: dict[int, _Kept]
    got: np.ndarray  # the lookup's headers (``_header``)
    # Per whole table this rank owns (``_pool_whole``): the step's batch it prepared and the
    # activation rows of each of its blocks (the table's features, then ranks).
    whole: dict[int, tuple[TableBatch, np.ndarray]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Kept:
    """The occurrences of a table's rows an owner got in a "sums" lookup (``decode_pull``),
    blocks in the single engine's order: per occurrence its id, local row, gain and
    activation row within its block (``segments``, non-decreasing in a block, with the CSR
    ``output_offsets`` of all blocks' rows, by place); per block its occurrences (``counts``)
    and rows (``block_rows``), from place ``first_occ[b]`` and row ``first_row[b]``."""

    ids: np.ndarray
    rows: np.ndarray
    gains: np.ndarray
    segments: np.ndarray
    output_offsets: np.ndarray
    counts: np.ndarray
    block_rows: np.ndarray
    first_occ: np.ndarray
    first_row: np.ndarray
    each: np.ndarray  # 0..occurrences: each occurrence its own entry (``block_batch``)

    @classmethod
    def empty(cls, counts: np.ndarray, block_rows: np.ndarray) -> _Kept:
        total, outputs = int(counts.sum()), int(block_rows.sum())
        return cls(
            ids=np.empty(total, dtype=np.int64),
            rows=np.empty(total, dtype=np.int64),
            gains=np.empty(total, dtype=np.float32),
            segments=np.empty(total, dtype=np.int64),
            output_offsets=np.empty(outputs + 1, dtype=np.int64),
            counts=counts,
            block_rows=block_rows,
            first_occ=_starts(counts[None])[0],
            first_row=_starts(block_rows[None])[0],
            each=np.arange(total + 1, dtype=np.int64),
        )

    def block_batch(self, b: int) -> TableBatch:
        """Block ``b``'s rows as a TableBatch with each occurrence its own entry (no
        deduplication: pooling needs none), its rows resolved: what ``Backend.lookup_rows``
        pools them from. Its arrays are the block's slices (views; its CSR rebased to them),
        so a backend that reads every entry (the reference) reads only this block's."""
        lo, n = int(self.first_occ[b]), int(self.counts[b])
        first, rows = int(self.first_row[b]), int(self.block_rows[b])
        each = self.each[: n + 1]  # segments count within the block already
        # Views: a TableBatch makes its arrays read-only, and the later blocks still arrive.
        gains, segments = self.gains[lo : lo + n].view(), self.segments[lo : lo + n].view()
        return TableBatch(
            unique_ids=self.ids[lo : lo + n].view(),
            inverse=each[:n],
            gains=gains,
            segments=segments,
            num_outputs=rows,
            output_offsets=self.output_offsets[first : first + rows + 1] - lo,
            unique_offsets=each,
            unique_gains=gains,
            unique_segments=segments,
            unique_bounds=np.array([0, n], dtype=np.int64),
            unique_rows=self.rows[lo : lo + n].view(),
        )


class DistributedError(RuntimeError):
    """Ranks disagree (another call, step or learning rate), or another rank's call failed
    before it began (its input was invalid, another error, or it was interrupted: the message
    says which kind): raised on every rank, naming the ranks; nothing was updated."""


class ShardedEngine:
    """Embedding tables sharded over a process group; the ``EmbeddingEngine`` step API.

    Args:
      feature_config, optimizer, seed: as ``EmbeddingEngine``; equal on every rank (checked).
      sharding: "row" (id r on rank r mod W), "table" (each table whole on one rank, largest
        first to the least loaded rank), "auto" (per table by its size and expected traffic:
        ``sharding.plan_auto``), or a dict table name -> one of them (others "row").
        ``plan`` says where each table went (and, under "auto", why).
      exchange: what crosses the wire for a table's lookup and update: "rows" (each rank
        pulls the rows of its unique ids from their owners and pools its bags itself:
        activations bit-identical to the single engine's), "sums" (each rank sends every
        occurrence to the owner of its id; each owner pools its rows' part of every bag and
        sends the partial sums back, which the rank adds in rank order, so a bag whose ids
        all live on one rank is bit-identical and any other equal up to float32 rounding;
        the owners keep the occurrences, so an update from that lookup's batch on every rank
        sends only gradient rows; any other batch is pushed as under "rows"), "auto"
        (per step and table, whichever sends fewer bytes by the cost model of
        docs/design.md, from every rank's counts: ``sharding.sums_saving``; a whole table:
        "sums", whose ranks then send their occurrences without deduplicating them), or a
        dict table name -> one of them (others "auto"). Tables and slots are bit-identical
        either way. Keyed tables exchange rows. ``exchange`` says what each table got;
        ``table_stats()`` what each table's last training lookup used.
      group: the process group to shard over; None makes a new gloo group of every rank of the
        default group (``torch.distributed.init_process_group`` must have run), so the engine's
        collectives never interleave with DDP's.
      timeout: seconds a collective of the new group waits for a peer before raising (unused
        when ``group`` is given). A dead peer is detected at once (its connection resets).
        Long work between collectives (initialising shards, hashing a checkpoint) meets the
        other ranks every quarter of the group's timeout (``comm.Pacer``), so it may last
        longer than the timeout.
      backend, nonfinite_gradients: as ``EmbeddingEngine``.
      storage, storage_dir: as ``EmbeddingEngine`` ("ram", "mmap" or a dict of table name ->
        either), for this rank's shards: a memory-mapped shard lives in
        ``{storage_dir}/{table}.rank{rank}.f32``, so ranks of one machine may share the folder,
        and a shard bigger than the rank's RAM trains through the page cache. Each rank may
        choose its own (where a shard lives is the machine's business); ``close()`` releases
        the files.
      refused: an error the caller found on this rank (``load``: a checkpoint it cannot
        read, or a KeyboardInterrupt while reading it), raised here and as a DistributedError
        on every other rank.

    A rank whose arguments are invalid raises its error, and every other rank a
    DistributedError naming it, at once (they meet at the configuration's exchange); so
    does a rank interrupted (a KeyboardInterrupt) while it builds its shards.

    Every rank must make the same calls in the same order (lookup, apply_gradients,
    table_contents), each with its own samples (an empty batch is fine). ``bytes_sent`` is what
    this rank sent in its last call of each kind; ``bytes_sent_total`` since construction.
    One thread per rank drives the engine (calls hold ``lock``).
    """

    def __init__(
        self,
        feature_config: Mapping[str, FeatureConfig] | Sequence[FeatureConfig] | FeatureConfig,
        optimizer: Optimizer | None = None,
        seed: int = 0,
        sharding: str | Mapping[str, str] = "row",
        group=None,
        timeout: float = DEFAULT_TIMEOUT,
        backend: str = "numba",
        nonfinite_gradients: str = "error",
        exchange: str | Mapping[str, str] = "auto",
        refused: BaseException | None = None,
        storage: str | Mapping[str, str] = "ram",
        storage_dir: str | os.PathLike | None = None,
    ):
        good_timeout = not (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not (math.isfinite(timeout) and timeout > 0)
        )
        bad_timeout = ValueError(
            f"timeout must be a number of seconds > 0 (a collective's wait for a peer), got "
            f"{timeout!r}"
        )
        if not dist.is_available() or not dist.is_initialized():
            if not good_timeout:  # the caller's own mistake first: no group to meet in anyway
                raise bad_timeout
            raise RuntimeError(
                "ShardedEngine needs torch.distributed: call torch.distributed."
                "init_process_group('gloo', ...) on every rank first (torchrun sets the rank, "
                "world size and address)"
            )
        # The group first, then every check: a rank whose arguments fail them still meets the
        # others at the configuration's exchange, so every rank raises at once (before, the
        # others waited for it in new_group or the exchange until the timeout).
        if group is None:
            seconds = float(timeout) if good_timeout else DEFAULT_TIMEOUT
            meet_in_the_default_group("the ShardedEngine's process group is made", seconds)
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=seconds))
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # Long work between collectives (initialising shards, hashing a checkpoint) meets the
        # ranks four times a timeout at least (Comm.pacer): the group's own timeout (a user's
        # group keeps its own: meeting every 1 s in a group of 0.5 s, the ranks waiting for a
        # rank's work timed out, as unpaced), else the one asked for.
        seconds = group_timeout(group)
        if seconds is None:
            seconds = float(timeout) if good_timeout else DEFAULT_TIMEOUT
        meet_every = min(MEET_EVERY, seconds / 4)
        self._comm = Comm(group, self.rank, self.world_size, meet_every=meet_every)
        error = None
        # Each rank initialises its own shards (table sharding: a huge table on one rank, a
        # few small ones on another): the ranks done first wait in meetings.
        with self._comm.pacer("initialising its shards"):
            try:
                if refused is not None:
                    raise refused
                if not good_timeout:
                    raise bad_timeout
                self._build(
                    feature_config,
                    optimizer,
                    seed,
                    sharding,
                    backend,
                    nonfinite_gradients,
                    exchange,
                    (storage, storage_dir),
                )
            except BaseException as e:  # any, a KeyboardInterrupt too: every rank raises at
                error = e  # the exchange (an interrupted rank still meets the others there)
        self._check_same_configuration(error)

    def _build(
        self,
        feature_config,
        optimizer,
        seed,
        sharding,
        backend,
        nonfinite_gradients,
        exchange,
        storage,
    ) -> None:
        """The constructor's checks and tables (its arguments; ``storage``: storage and
        storage_dir)."""
        r, optimizers = engine_arguments(
            feature_config, optimizer, seed, nonfinite_gradients, "ShardedEngine"
        )
        # Each rank's shard of a table in its own file (ranks of one machine share the folder).
        files = table_files(r, *storage, suffix=f".rank{self.rank}")
        keyed = [t.keyed for t in r.tables]
        self._resolved, self._optimizers = r, optimizers
        self._step_bound = step_bound(r, optimizers)
        self._learning_rates = LearningRates(optimizers, r.table_names)
        self.seed = int(seed)
        self.nonfinite_gradients = nonfinite_gradients
        self._backend = make_backend(backend)
        for name, table, opt in zip(r.table_names, r.tables, optimizers, strict=True):
            self._backend.check_optimizer(name, opt, table.dim)
        # The update's per-table batch arrays, one block a step, reused once unused: fresh
        # arrays faulted their pages in every step (docs/performance.md, "Distributed W1:
        # pages faulted in every step").
        self._memory = BlockPool(max_free=2)
        slot_specs = [opt.slot_specs(t.dim) for opt, t in zip(optimizers, r.tables, strict=True)]
        # Bytes a row in its stored dtypes (16-bit rows: row_columns' packed layout).
        row_bytes = [
            row_columns(name, t.dim, specs, t.weights_dtype, t.slots_dtype)[1]
            * np.dtype(row_dtype(t.weights_dtype, t.slots_dtype)).itemsize
            for name, t, specs in zip(r.table_names, r.tables, slot_specs, strict=True)
        ]
        # A pulled row's weight on the wire: its stored bytes (4, or 2: a 16-bit table's rows
        # travel as their bits), for the planner and the exchange's cost model.
        self._value_bytes = np.array(
            [numpy_dtype(t.weights_dtype).itemsize for t in r.tables], dtype=np.int64
        )
        # A keyed table's size is not known in advance; it is sharded by key anyway.
        table_bytes = [
            0 if t.keyed else t.vocabulary_size * b
            for t, b in zip(r.tables, row_bytes, strict=True)
        ]
        loads = [
            TableLoad(
                t.vocabulary_size or 0,
                t.dim,
                nbytes,
                expected_traffic(
                    t.dim,
                    [r.features[f].max_sequence_length or 1 for f in names],
                    int(value_bytes),
                ),
                opt.updates_every_row,
            )
            for t, nbytes, names, opt, value_bytes in zip(
                r.tables,
                table_bytes,
                r.table_features,
                optimizers,
                self._value_bytes,
                strict=True,
            )
        ]
        self._plan = plan_shards(
            sharding, r.table_names, table_bytes, self.world_size, loads, keyed
        )
        self._exchange = plan_exchange(
            exchange, r.table_names, keyed, whole=[k == "table" for k in self._plan.kinds]
        )
        # Tables that exchange sums whatever the step: a lookup sends their occurrences as
        # they come, not deduplicated (``_lookup_batch``).
        self._sums_only = np.array([x == "sums" for x in self._exchange], dtype=bool)
        # A keyed table's share is a KeyedTable of the keys this rank owns (its own rows,
        # admission counts and data time); any other table's a ShardTable of its ids.
        self._shards = tuple(
            KeyedTable(
                name,
                t.dim,
                specs,
                initializer_for(t, opt),
                self.seed,
                t.dynamic,
                path=files[name][1],
                weights_dtype=t.weights_dtype,
                slots_dtype=t.slots_dtype,
            )
            if t.keyed
            else ShardTable(
                name,
                t.vocabulary_size,
                t.dim,
                specs,
                initializer_for(t, opt),
                self.seed,
                self._plan.owned_ids(i, t.vocabulary_size, self.rank),
                self.world_size,
                self.rank,
                self._plan.kinds[i],
                weights_dtype=t.weights_dtype,
                slots_dtype=t.slots_dtype,
                path=files[name][1],
            )
            for i, (name, t, opt, specs) in enumerate(
                zip(r.table_names, r.tables, optimizers, slot_specs, strict=True)
            )
        )
        self._keyed = tuple(i for i, t in enumerate(r.tables) if t.keyed)
        self._needs_time = [
            r.table_names[i] for i in self._keyed if r.tables[i].dynamic.expire_seconds is not None
        ]
        # The step's data time so far (step, timestamp), as EmbeddingEngine keeps it.
        self._step_time: tuple[int, int | None] = (-1, None)
        # Batches are prepared as for a single engine with one storage table per table.
        self._layout = [[(f, 0) for f in names] for names in r.table_features]
        self._fingerprint = batch_fingerprint(r, self._layout)
        self._features = tuple(r.features)
        # Per table (row sharded?, owner of a whole table) and width; per feature its width
        # and, per table, its features' indices (the single engine's occurrence order).
        kinds = {"row": sr.KIND_ROW, "table": sr.KIND_TABLE, KEYED: sr.KIND_KEYED}
        self._route = tuple(
            (kinds[kind], owner)
            for kind, owner in zip(self._plan.kinds, self._plan.owners, strict=True)
        )
        self._dims = np.array([t.dim for t in r.tables], dtype=np.int64)
        # Tables whose weights are stored in 16 bits: their pulled rows travel as 16 bits.
        self._half_tables = self._value_bytes == 2
        self._feature_dims = np.array(
            [r.features[f].table.dim for f in self._features], dtype=np.int64
        )
        self._table_feature_index = tuple(
            tuple(self._features.index(f) for f in names) for names in r.table_features
        )
        # Per table, its blocks of a step in the single engine's occurrence order (its features
        # in order, then ranks): (feature, sender) index arrays.
        self._table_blocks = tuple(
            (
                np.repeat(np.asarray(fs, dtype=np.int64), self.world_size),
                np.tile(np.arange(self.world_size, dtype=np.int64), len(fs)),
            )
            for fs in self._table_feature_index
        )
        # Whole tables (each on one rank) that exchange "sums": a rank sends their owners its
        # bags as they are, and each owner prepares and pools its table's batch of the step
        # as the single engine does (``_pool_whole``); per feature its table and that owner.
        self._whole = self._sums_only & np.array([k == "table" for k in self._plan.kinds])
        self._whole_features = self._features_of(self._whole)
        self._feature_tables = np.array(
            [r.feature_table[f] for f in self._features], dtype=np.int64
        )
        self._feature_owners = np.array(
            [self._plan.owners[t] for t in self._feature_tables], dtype=np.int64
        )
        self._cols = _Columns.of(len(self._features), len(r.tables), bool(self._keyed))
        self._step = 0
        # The tables' state, renumbered by every restore: a batch looked up for training
        # carries it (``PreparedBatch.looked_up_in``), and an update refuses another state's.
        self._state_id = next(_STATES)
        self._pending: PreparedBatch | None = None
        # The PreparedBatch the pending lookup was given, whose looked-up form is ``_pending``.
        self._given: PreparedBatch | None = None
        # The last training lookup's bookkeeping (its batch, owners, counts, the "sums"
        # tables' targets and the occurrences this rank owns): its update reuses it.
        self._last: _Lookup | None = None
        # The training lookup that was every rank's last call (each arms itself alike), so
        # that the next call may be its update, sending its header with its blocks
        # (``_apply_speculating``); any call disarms.
        self._armed: _Lookup | None = None
        # A speculating update's blocks start on multiples of this many floats.
        self._grid = message_grid(self._dims)
        # Per table, what its last training lookup exchanged ("rows" or "sums"; None before
        # any): what the update of that lookup's batch reuses (``table_stats``).
        self._exchanged: list[str | None] = [None] * len(r.tables)
        # Why this engine makes no more collectives ("" while it does): a call failed on this
        # rank after every rank had begun it, so its ranks may be at different collectives
        # (``_past_header``).
        self._out_of_step = ""
        self.lock = threading.RLock()
        self.bytes_sent: dict[str, Counter[str]] = {}
        self.bytes_sent_total: Counter[str] = Counter()
        self.nonfinite_rows_skipped = {name: 0 for name in r.table_names}

    # -- configuration ---------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Number of apply_gradients calls so far (equal on every rank)."""
        return self._step

    @property
    def table_names(self) -> tuple[str, ...]:
        return self._resolved.table_names

    @property
    def feature_config(self) -> dict[str, FeatureConfig]:
        return dict(self._resolved.features)

    @property
    def shard_plan(self) -> ShardPlan:
        return self._plan

    @property
    def plan(self) -> dict[str, str]:
        """Table name -> how it is sharded: "row", or "table on rank k"; under "auto" the
        kind and why, e.g. "row: 1000000 rows x 64, hot ids spread (25% of the expected
        traffic)" or "table: 100 rows x 8, on rank 1 (3% of the expected traffic)"."""
        return self._plan.describe(self.table_names)

    @property
    def exchange(self) -> dict[str, str]:
        """Table name -> its exchange setting: "rows", "sums" or "auto", with "auto" resolved
        where it does not change from step to step (a keyed table "rows", a whole table
        "sums"); what each table's last training lookup used: ``table_stats()``."""
        return dict(zip(self.table_names, self._exchange, strict=True))

    def optimizer(self, table_name: str) -> Optimizer:
        return self._optimizers[self.table_names.index(table_name)]

    @property
    def table_configs(self) -> dict[str, TableConfig]:
        return dict(zip(self._resolved.table_names, self._resolved.tables, strict=True))

    @property
    def backend(self) -> str:
        return self._backend.name

    @property
    def num_learning_rate_tags(self) -> int:
        return self._learning_rates.num_tags

    def learning_rate_tag(self, table_name: str) -> int | None:
        """The dynamic learning-rate tag of a table, or None for a constant rate."""
        return self._learning_rates.tag_of(self.table_names.index(table_name))

    def table_stats(self) -> dict[str, Any]:
        """What this rank holds and sends (local, no communication): per table its sharding,
        what its last training lookup exchanged (``"rows"`` or ``"sums"``, None before any:
        what that lookup's update reuses, so an evaluation lookup, whose exchange no update
        uses, leaves it as it was; so does a lookup refused at its header), the rows and
        bytes (weights and slots) on this rank (a keyed table: its keys here, and ``keyed``,
        this rank's ``KeyedTable.stats()``); the bytes this rank sent in its last call of
        each kind (``{call: {purpose: bytes}}``; an evaluation lookup's are "lookup"'s too)
        and since construction. The cost model behind the bytes is in docs/design.md."""
        plan = self.plan
        return {
            "tables": {
                name: {
                    "sharding": plan[name],
                    "exchange": exchanged,
                    "storage": shard.storage,
                    **(
                        {"rows": shard.rows, "bytes": int(shard.nbytes), "keyed": shard.stats()}
                        if isinstance(shard, KeyedTable)
                        else {"rows": int(shard.data.shape[0]), "bytes": int(shard.nbytes)}
                    ),
                }
                for name, shard, exchanged in zip(
                    self.table_names, self._shards, self._exchanged, strict=True
                )
            },
            "bytes_sent": {call: dict(c) for call, c in self.bytes_sent.items()},
            "bytes_sent_total": dict(self.bytes_sent_total),
        }

    def close(self) -> None:
        """Release this rank's memory-mapped shards (``storage="mmap"``): flush and unmap
        them, which frees their locks (``EmbeddingEngine.close``; local, no communication). A
        lookup or update afterwards raises StorageError naming the table on this rank; call
        it on every rank when the job ends (``with ShardedEngine(...) as engine:`` does)."""
        with self.lock:
            close_tables(self._shards)

    def _check_files(self) -> None:
        """StorageError if one of this rank's memory-mapped shards is closed or truncated
        (``check_file``: one fstat each), raised before a call's header so that every rank
        raises, not this one alone in the middle of an exchange."""
        for shard in self._shards:
            shard.check_file()

    def _files_error(self) -> Exception | None:
        """``_check_files``' error, or None."""
        try:
            self._check_files()
        except StorageError as e:
            return e
        return None

    def __enter__(self) -> ShardedEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def shard(self, table_name: str) -> ShardTable:
        """This rank's share of a table (its ``global_ids``; rows ``[weights | slots]``)."""
        return self._shards[self.table_names.index(table_name)]

    def _check_same_configuration(self, error: BaseException | None) -> None:
        """Every rank must have built the same engine: a digest of the configuration, gathered
        (different tables would pair the wrong rows; different optimizers diverge silently).
        ``error``: this rank's own (its arguments, or a KeyboardInterrupt while it built),
        raised once every rank knows of it (they raise a DistributedError naming it)."""
        if error is not None:
            self._comm.enter("ShardedEngine()")
            said = np.array([0, _failure_code(error)], dtype=np.int64)  # 0: failed; why
            self._comm.all_gather(said, "setup")
            raise error
        r = self._resolved
        config = {
            "tables": [
                [
                    name,
                    t.vocabulary_size,
                    t.dim,
                    t.combiner,
                    t.weights_dtype,
                    t.slots_dtype,
                    repr(t.dynamic),
                    initializer_to_json(initializer_for(t, opt)),
                    optimizer_to_json(opt, self._learning_rates.tag_of(i)),
                ]
                for i, (name, t, opt) in enumerate(
                    zip(r.table_names, r.tables, self._optimizers, strict=True)
                )
            ],
            "features": [
                [f, r.table_names[r.feature_table[f]], fc.max_sequence_length]
                for f, fc in r.features.items()
            ],
            "seed": self.seed,
            "plan": [list(self._plan.kinds), list(self._plan.owners)],
            "exchange": list(self._exchange),
            "nonfinite_gradients": self.nonfinite_gradients,
        }
        text = json.dumps(config, sort_keys=True, default=str).encode()
        digest = np.frombuffer(hashlib.sha256(text).digest()[:8], dtype=np.int64)[0]
        self._comm.enter("ShardedEngine()")
        got = self._comm.all_gather(np.array([1, digest], dtype=np.int64), "setup")
        bad = [rank for rank, ok in enumerate(got[:, 0]) if not ok]
        if bad:
            stopped = [rank for rank in bad if got[rank, 1] == _INTERRUPTED]
            if stopped:
                raise DistributedError(
                    f"rank {self.rank}: ranks {stopped} were interrupted while building their "
                    "ShardedEngine (a KeyboardInterrupt or another BaseException that is not "
                    "an Exception: see their error)"
                    + (f"; ranks {bad} could not build theirs" if stopped != bad else "")
                )
            raise DistributedError(
                f"rank {self.rank}: ranks {bad} could not build their ShardedEngine (see their "
                "error: invalid arguments, or a checkpoint they could not read); every rank "
                "must pass the same, valid arguments"
            )
        everyone = got[:, 1]
        other = [rank for rank, d in enumerate(everyone) if d != everyone[0]]
        if other:
            raise DistributedError(
                f"rank {self.rank}: ranks {other} built a ShardedEngine with another "
                "configuration (tables and their dtypes, features, optimizers, seed, sharding "
                "or exchange) than "
                "rank 0; every rank must pass the same arguments"
            )

    # -- the header: every call starts with it ---------------------------------------------------

    def _header(
        self,
        call: int,
        error: BaseException | None,
        blocks: Mapping[int, np.ndarray] | None = None,
        lrs: Sequence[float] | None = None,
        timestamp: int | None = None,
    ) -> np.ndarray:
        """Exchange this call's header with every rank; raise ``error`` (this rank's own
        validation error) afterwards, or a DistributedError if ranks disagree (call, step,
        learning rates, data time). ``blocks``: column (``_Columns``) -> int64 counts, ``[W,
        k]`` (row d: for rank d) or ``[k]`` (the same for every rank); ``lrs``: each table's
        learning rate, in the ``a`` columns. Returns the headers received, int64 ``[W,
        columns]`` (row s: what rank s sent this rank)."""
        w, cols = self.world_size, self._cols
        if self._out_of_step:  # no collective: it could wait out the timeout or meet another
            raise DistributedError(
                f"rank {self.rank}: {_CALLS[call]} at step {self._step} refused, nothing changed: "
                f"{self._out_of_step}. Make a new ShardedEngine (ShardedEngine.load of the last "
                "checkpoint)"
            )
        header = self._header_rows(call, error, blocks, lrs, timestamp)
        spec, self._armed = self._armed, None
        if spec is not None:
            # Right after a training lookup the other ranks may be sending its update's
            # message: this header goes in a message of that shape (zeros elsewhere), so that
            # a rank making another call fails with the others (gloo aborts the process on
            # sizes that differ).
            out, into = self._speculated(spec)[3:]
            got = self._message_exchange(call, header, "header", out, into)[0]  # no fill
        else:
            self._comm.enter(f"{_CALLS[call]} at step {self._step}")
            got = self._comm.all_to_all(
                header.reshape(-1), [cols.width] * w, [cols.width] * w, "header"
            ).reshape(w, cols.width)
        self._check_header(call, error, got, lrs)
        return got

    def _header_rows(
        self,
        call: int,
        error: BaseException | None,
        blocks: Mapping[int, np.ndarray] | None,
        lrs: Sequence[float] | None,
        timestamp: int | None,
    ) -> np.ndarray:
        """The header this rank sends each rank (``_header``'s arguments), int64 ``[W,
        columns]``: row d for rank d."""
        w, nt, cols = self.world_size, len(self.table_names), self._cols
        header = np.zeros((w, cols.width), dtype=np.int64)
        header[:, 0] = call
        header[:, 1] = self._step
        header[:, 2] = _VALID if error is None else _failure_code(error)
        header[:, 3] = NO_TIME if timestamp is None else timestamp
        # The a columns carry a lookup's counts or an update's learning rates, never both.
        assert lrs is None or cols.a not in (blocks or {}), "learning rates go in the a columns"
        if error is None:
            for at, block in (blocks or {}).items():
                block = np.asarray(block, dtype=np.int64)
                header[:, at : at + block.shape[-1]] = block
            if lrs is not None:
                header[:, cols.a : cols.a + nt] = np.asarray(lrs, dtype=np.float64).view(np.int64)
        return header

    def _check_header(
        self, call: int, error: BaseException | None, got: np.ndarray, lrs: Sequence[float] | None
    ) -> None:
        """Raise this rank's ``error``, or a DistributedError if the headers ``got`` from the
        ranks disagree with this rank's call (``_header``)."""
        w, nt, cols = self.world_size, len(self.table_names), self._cols
        if error is not None:
            raise error
        name = _CALLS[call]
        calls = got[:, 0]
        if (calls != call).any():
            theirs = ", ".join(f"rank {s}: {_CALLS.get(int(c), c)}" for s, c in enumerate(calls))
            raise DistributedError(
                f"rank {self.rank} called {name} while the ranks called: {theirs}; every rank "
                "must make the same calls in the same order"
            )
        bad = [s for s in range(w) if got[s, 2] != _VALID]
        if bad:
            kinds = {int(got[s, 2]) for s in bad}
            if len(kinds) == 1:
                why = _FAILURES.get(kinds.pop(), "an unknown failure code")
            else:
                why = "; ".join(
                    f"rank {s}: {_FAILURES.get(int(got[s, 2]), 'an unknown failure code')}"
                    for s in bad
                )
            raise DistributedError(
                f"rank {self.rank}: {name} at step {self._step} failed on ranks {bad} ({why}: "
                "see their error); nothing was changed on any rank"
            )
        steps = got[:, 1]
        if (steps != self._step).any():
            raise DistributedError(
                f"rank {self.rank}: {name}: the ranks are at steps {steps.tolist()}; they must "
                "be at the same step (did one rank restore another checkpoint?)"
            )
        if (got[:, 3] != got[self.rank, 3]).any():
            said = ["none" if v == NO_TIME else int(v) for v in got[:, 3]]
            raise DistributedError(
                f"rank {self.rank}: {name} at step {self._step}: the ranks' timestamps are "
                f"{said} (ranks 0..{w - 1}); every rank must pass the same timestamp= (the "
                "step's data time); nothing was changed"
            )
        if self._keyed:  # a lookup's max_pending per keyed table (zeros in other calls)
            limits = got[:, cols.q : cols.q + nt]
            for t in range(nt):
                if (limits[:, t] != limits[self.rank, t]).any():
                    raise DistributedError(
                        f"rank {self.rank}: {name} at step {self._step}: table "
                        f"{self.table_names[t]!r} has max_pending {limits[:, t].tolist()} on "
                        f"ranks 0..{w - 1}; the bound is the whole table's: set the same "
                        "max_pending on every rank (engine.shard(name).max_pending = n); "
                        "nothing was changed"
                    )
        if lrs is not None:
            theirs = got[:, cols.a : cols.a + nt].view(np.float64)
            for t in range(nt):
                if (theirs[:, t] != theirs[self.rank, t]).any():
                    raise DistributedError(
                        f"rank {self.rank}: step {self._step}: table {self.table_names[t]!r} "
                        f"has learning rates {theirs[:, t].tolist()} on ranks 0..{w - 1}; every "
                        "rank must use the same learning rates (callables of the step, or the "
                        "same learning_rates=[...]); nothing was updated"
                    )

    # -- a step ----------------------------------------------------------------------------------

    def preprocess(
        self, features: Mapping, weights: Mapping | None = None, *, training: bool = True
    ) -> PreparedBatch:
        """This rank's features validated and deduplicated per table, as ``EmbeddingEngine.
        preprocess`` does (pure, no communication; a DataLoader worker may call it). Always
        deduplicated, ``training`` or not: a lookup pulls each unique id's row once. A batch
        built with ``training=False`` is for evaluation, as the single engine's: looked up with
        ``training=False``, never trained on (``PreparedBatch.training``)."""
        return prepare_batch(
            self._resolved,
            features,
            weights,
            self._backend.build_tables,
            self._layout,
            fingerprint=self._fingerprint,
            training=training,
        )

    def preprocessor(self):
        """A ``Preprocessor``: this engine's ``preprocess`` without the engine, for DataLoader
        workers (``EmbeddingEngine.preprocessor``'s: the feature configs, the storage layout
        and the backend's name, no tables and no process group, so it pickles into spawned
        workers; fork-safe). Its batches equal ``preprocess``'s bit for bit, evaluation
        batches deduplicated and marked as this engine's are."""
        from ..preprocessing import Preprocessor

        return Preprocessor(self._resolved, self._layout, self.backend, deduplicate_evaluation=True)

    def _lookup_batch(
        self, features: Mapping, weights: Mapping | None, training: bool
    ) -> PreparedBatch:
        """This rank's features validated for its lookup, deduplicated per table as
        ``preprocess`` does, except each table that exchanges "sums" whatever the step
        (``_sums_only``): its batch lists the occurrences as they come, each its own "unique"
        id (``LookupOnlyTableBatch.occurrences``). Its occurrences go to their owners as they
        are anyway, who deduplicate them (a whole table's owner prepares the step's batch:
        ``_pool_whole``); the rank's own deduplication would only count them
        (docs/design.md, "A whole table exchanges sums"). ``training=False``: a batch for
        evaluation (``PreparedBatch.training``), as the single engine's lookup gives back."""
        if not self._sums_only.any():
            return self.preprocess(features, weights, training=training)
        parts, layouts = plan_tables(self._resolved, features, weights, self._layout)
        built = iter(
            self._backend.build_tables(
                [p for p, skip in zip(parts, self._sums_only, strict=True) if not skip]
            )
        )
        tables = tuple(
            LookupOnlyTableBatch(tuple(p), sum(x.num_outputs for x in p)).occurrences
            if skip
            else next(built)
            for p, skip in zip(parts, self._sums_only, strict=True)
        )
        return PreparedBatch(tables, layouts, fingerprint=self._fingerprint, training=training)

    def lookup(
        self,
        features: Mapping | PreparedBatch,
        weights: Mapping | None = None,
        *,
        training: bool = True,
        timestamp: int | None = None,
    ) -> dict[str, np.ndarray]:
        """This rank's activations per feature, float32 ``[*shape, dim]``: bit-identical to the
        single engine's for these samples. Collective: every rank calls it (with its own
        samples). ``training=True`` keeps the batch for ``apply_gradients``; ``training=False``
        is read-only and leaves that batch pending, as ``EmbeddingEngine.lookup``'s (every rank
        passes the same ``training``). A training lookup refused before it exchanged anything
        (an invalid input on any rank: every rank raises) leaves it pending too, as the single
        engine's failed lookup of the concatenation does. A lookup that fails after every rank
        began it (a peer died or timed out, or this rank failed between two of its
        collectives) forgets the pending batch and leaves this rank's engine out of step: its
        ranks may be at different collectives, so every later call on this rank (an update,
        a lookup, a save, a restore) raises a DistributedError at once naming that failure,
        without a collective (one could wait for a peer until the timeout, or meet another
        call's collective), and no update applies any batch; make a new engine from the last
        checkpoint (``ShardedEngine.load``). A keyed table's ``max_rows`` refusal, which
        every rank raises alike midway from the same sums before any table changes, leaves
        the engine in step and as it was, the pending batch too (``EmbeddingEngine``'s
        refused lookup keeps its own). ``timestamp`` (training only): the step's data time
        for keyed tables (``EmbeddingEngine.lookup``'s), the same on every rank (checked)."""
        return self.lookup_with_batch(features, weights, training=training, timestamp=timestamp)[0]

    def lookup_with_batch(
        self,
        features: Mapping | PreparedBatch,
        weights: Mapping | None = None,
        *,
        training: bool = True,
        timestamp: int | None = None,
        refused: Exception | None = None,
    ) -> tuple[dict[str, np.ndarray], PreparedBatch]:
        """``lookup``, and the PreparedBatch it looked up (``apply_gradients(batch=)``; what
        EmbeddingLayer's backward uses). Its tables that exchange "sums" whatever the step list
        their occurrences undeduplicated (``_lookup_batch``): a ShardedEngine updates from it,
        an EmbeddingEngine only looks it up (``batch.check_trainable``). Collective.
        ``refused``: an error the caller found in this rank's inputs (EmbeddingLayer's own
        checks): raised here, and a DistributedError naming this rank on every other, nothing
        looked up (raising it before the call would leave the others waiting for this rank in
        the lookup until the timeout). An evaluation lookup of features (``training=False``)
        gives back a batch for evaluation, as the single engine's lookup-only one: looked up
        again, never trained on (``PreparedBatch.training``)."""
        with self.lock:
            self._comm.reset()
            try:
                return self._lookup(features, weights, training, timestamp, refused)
            finally:
                self._count("lookup")

    def _count(self, call: str) -> None:
        sent = self._comm.reset()
        self.bytes_sent[call] = sent
        self.bytes_sent_total.update(sent)

    def _data_time(self, timestamp, training: bool) -> int | None:
        """A training call's data time: its ``timestamp`` (checked), else its step's lookup's;
        a keyed table that expires by data time and gets none is a ValueError (as
        EmbeddingEngine's). None for an evaluation lookup."""
        if timestamp is not None:
            if not training:
                raise ValueError(
                    "timestamp is the data time of a training batch; an evaluation lookup "
                    "(training=False) changes nothing and sees each table at its data time"
                )
            return _check_timestamp(timestamp)
        if not training:
            return None
        if self._step_time[0] == self._step:
            return self._step_time[1]
        if self._needs_time:
            t = self._resolved.tables[self.table_names.index(self._needs_time[0])]
            raise ValueError(
                f"table {self._needs_time[0]!r} expires rows by data time (DynamicVocabulary."
                f"expire_seconds={t.dynamic.expire_seconds}): pass the batch's time as "
                "lookup(..., timestamp=seconds) (or apply_gradients(..., timestamp=)), the same "
                "on every rank; without timestamps use expire_steps. Nothing was changed"
            )
        return None

    def _begin_keyed(self, timestamp: int | None) -> None:
        """Tell this rank's keyed tables the step and the call's data time (as
        EmbeddingEngine tells its storages)."""
        for t in self._keyed:
            if timestamp is None:
                self._shards[t].begin_step(self._step)
            else:
                self._shards[t].begin_step(self._step, timestamp=timestamp)

    def _lookup(self, features, weights, training: bool, timestamp=None, refused=None):
        nt, nf, w, cols = len(self.table_names), len(self._features), self.world_size, self._cols
        error, when, batch = None, None, None
        counts = np.zeros((nt, w), dtype=np.int64)  # [table, owner]: unique ids to ask
        saving = np.zeros(nt, dtype=np.int64)  # per table: this rank's bytes saved by "sums"
        push = _Push.empty(nf, w)
        gains = np.zeros((nt, w), dtype=np.int64)  # [table, owner]: a whole table's gains go
        sources = None
        try:
            if refused is not None:
                raise refused
            self._check_files()
            if training:  # every rank has the same step: every rank raises
                check_step_room(self._step, self._step_bound)
            when = self._data_time(timestamp, training)
            if isinstance(features, PreparedBatch):
                if weights is not None:
                    raise ValueError("weights must be given to preprocess(), not with a batch")
                check_prepared_for(features, self._fingerprint, self._resolved)
                if not features.deduplicated:
                    raise ValueError(
                        "this PreparedBatch was not deduplicated: build it with "
                        "ShardedEngine.preprocess"
                    )
                if training:
                    check_for_training(features)
                batch = features
            else:
                batch = self._lookup_batch(features, weights, training)
            # The occurrences per owner: a "sums" lookup sends them, "auto" weighs them, and a
            # training batch's update pushes them (it reuses these counts).
            if training or any(x != "rows" for x in self._exchange):
                push = self._push_counts(batch)
            if self._whole.any():
                sources, flags = self._whole_sources(batch, push)
                for t in np.flatnonzero(self._whole).tolist():
                    gains[t, self._route[t][1]] = flags[t]
            for t, tb in enumerate(batch.tables):
                if self._whole[t]:
                    continue
                row, owner = self._route[t]
                sr.count_owners(tb.unique_ids, row, owner, w, counts[t])
                if self._exchange[t] == "auto":
                    saving[t] = self._sums_saving(t, counts[t], push)
        except BaseException as e:  # any, a KeyboardInterrupt too: every rank raises at the header
            error = e
        blocks = {cols.n: push.n.T, cols.m: push.m.T, cols.a: (counts + gains).T, cols.b: saving}
        if self._keyed:
            blocks[cols.k] = counts.sum(axis=1)
            pending, limits = np.zeros(nt, dtype=np.int64), np.zeros(nt, dtype=np.int64)
            for t in self._keyed:
                pending[t] = self._shards[t].pending_keys
                limits[t] = self._shards[t].max_pending
            blocks[cols.p], blocks[cols.q] = pending, limits
        call = _LOOKUP if training else _EVAL
        got = self._header(call, error, blocks, timestamp=when)
        # What a training lookup replaces, kept for a refusal every rank raises alike midway
        # (a keyed table's max_rows: ``_shared_room``), which changed no table
        before = self._pending, self._last, self._given, list(self._exchanged)
        with self._past_header(call):
            try:
                return self._lookup_exchange(
                    batch, features, training, when, got, counts, push, sources
                )
            except BaseException as e:
                if training and e is self._comm.raised_alike:  # as EmbeddingEngine's refusal
                    self._pending, self._last, self._given, self._exchanged = before
                raise

    @contextlib.contextmanager
    def _past_header(self, call: int):
        """A call past its header, where its ranks are at collectives only they know: an error
        raised in it that every rank does not raise alike (``Comm.alike``: a peer that timed
        out or died, this rank failing between two of its collectives) leaves this engine out
        of step, so that every later call raises at once (``_header``) instead of making a
        collective that could wait for a peer until the timeout, or meet another call's (gloo
        then aborts the process)."""
        try:
            yield
        except BaseException as e:
            if e is not self._comm.raised_alike:
                half = "; its tables may be half updated" if call in (_APPLY, _RESTORE) else ""
                self._out_of_step = (
                    f"this engine's {_CALLS[call]} at step {self._step} failed on this rank after "
                    f"every rank had begun it ({type(e).__name__}: {e}), so its ranks may be at "
                    "different collectives and it makes no more (a collective now could wait "
                    f"for a peer until the timeout, or meet another call's){half}"
                )
            raise
        finally:
            self._comm.raised_alike = None

    def _lookup_exchange(
        self, batch, features, training: bool, when: int | None, got, counts, push, sources
    ) -> tuple[dict[str, np.ndarray], PreparedBatch]:
        """``_lookup`` past its header (``got``): the exchanges, the pooling, and a training
        lookup's bookkeeping for its update."""
        nt, cols = len(self.table_names), self._cols
        if training:
            # Past the header every rank looks this batch up, so the last one's update is gone,
            # even if this lookup fails (it leaves the engine out of step: ``_past_header``),
            # unless every rank refuses it alike (``_lookup`` puts it back). A lookup refused
            # at the header (on every rank alike: each raises there) left it pending, as
            # EmbeddingEngine's failed lookup leaves its own; an evaluation lookup never
            # touches it.
            self._pending = self._last = self._given = None
        # Every rank got every rank's savings, so every rank picks the same exchange.
        sums = np.array(
            [
                kind == "sums" or (kind == "auto" and int(got[:, cols.b + t].sum()) >= 0)
                for t, kind in enumerate(self._exchange)
            ],
            dtype=bool,
        )
        if training:  # what the update of this batch reuses (``table_stats``)
            self._exchanged = ["sums" if s else "rows" for s in sums]
        per_table: list[np.ndarray | None] = [None] * nt
        if not sums.all():
            self._pull_rows(batch, counts * ~sums[:, None], got, sums, training, when, per_table)
        pooled = None
        if (sums & ~self._whole).any():
            pooled = self._pool_sums(batch, push, got, sums & ~self._whole, training, per_table)
        direct: dict[str, np.ndarray] = {}  # the whole tables' features' activations
        whole = {}
        if self._whole.any():
            whole = self._pool_whole(batch, got, sources, training, direct)
        if training:
            # Its gradients will be of the tables as they are now: marked, so that an update
            # after a restore refuses it (EmbeddingLayer's backward passes it as batch=).
            batch = dataclasses.replace(batch, looked_up_in=self._state_id)
            self._pending = batch
            self._given = features if isinstance(features, PreparedBatch) else None
            self._last = _Lookup(
                batch, push, sums, *(pooled or (None, None, {})), got=got, whole=whole
            )
            self._armed = self._last  # its update may speculate (``_apply_speculating``)
            if when is not None:
                prev = self._step_time[1] if self._step_time[0] == self._step else None
                self._step_time = (self._step, when if prev is None else max(prev, when))
        acts = {
            name: (
                direct[name] if name in direct else per_table[lay.table][lay.start : lay.stop]
            ).reshape(lay.shape)
            for name, lay in batch.features.items()
        }
        return acts, batch

    def _features_of(self, tables: np.ndarray) -> np.ndarray:
        """Per feature, whether its table is one of ``tables`` (a bool per table)."""
        out = np.zeros(len(self._features), dtype=bool)
        for t in np.flatnonzero(tables):
            out[list(self._table_feature_index[t])] = True
        return out

    def _push_counts(self, batch: PreparedBatch) -> _Push:
        """``batch``'s occurrences cut by owner, feature by feature (``count_push``): what the
        "sums" lookup sends and the update pushes."""
        r, w = self._resolved, self.world_size
        push = _Push.empty(len(self._features), w)
        for f, name in enumerate(self._features):
            lay = batch.features[name]
            t = r.feature_table[name]
            tb = batch.tables[t]
            # The feature's occurrences: those of its activation rows.
            lo, hi = int(tb.output_offsets[lay.start]), int(tb.output_offsets[lay.stop])
            kind, whole = self._route[t]
            if self._whole[t]:  # every activation row goes to the owner (``_pool_whole``)
                push.n[f, whole] += hi - lo
                push.m[f, whole] += lay.stop - lay.start
                push.spans.append((tb, None, lo, hi, lay.start))
                continue
            if t not in push.owners:
                if kind == sr.KIND_TABLE:
                    push.owners[t] = np.full(len(tb.unique_ids), whole, dtype=np.int64)
                else:
                    push.owners[t] = np.empty(len(tb.unique_ids), dtype=np.int64)
                    sr.owners_of(frozen(tb.unique_ids), kind, whole, w, push.owners[t])
            owners = push.owners[t]
            if kind == sr.KIND_TABLE:  # one owner: count_push's figures without its pass
                push.n[f, whole] += hi - lo
                rows = np.diff(tb.output_offsets[lay.start : lay.stop + 1])
                push.m[f, whole] += np.count_nonzero(rows)
            else:
                sr.count_push(owners, tb.inverse, tb.segments, lo, hi, w, push.n[f], push.m[f])
            push.spans.append((tb, owners, lo, hi, lay.start))
        return push

    def _sums_saving(self, t: int, counts: np.ndarray, push: _Push) -> int:
        """This rank's bytes saved by the "sums" exchange of table ``t`` this step
        (``sharding.sums_saving``): ``counts``, its unique ids per owner."""
        fs = list(self._table_feature_index[t])
        me = self.rank
        return sums_saving(
            int(self._dims[t]),
            int(counts.sum() - counts[me]),
            int(push.m[fs].sum() - push.m[fs, me].sum()),
            int(self._value_bytes[t]),
        )

    def _whole_sources(self, batch: PreparedBatch, push: _Push) -> tuple[list, np.ndarray]:
        """What a "sums" lookup sends the owner of each whole table (``_pool_whole``), per
        feature (None for the others' features): ``(offsets, ids, gains)``, its activation
        rows' offsets into its ids (from 0), the ids in occurrence order (truncated sequences
        as the batch truncated them) and their gains (its combiner's and weights' factors),
        or None for gains where every gain of the table's features on this rank is 1 (an
        unweighted sum: what the owner assumes); and per table, 1 when its gains go, else 0."""
        flags = np.zeros(len(self.table_names), dtype=np.int64)
        sources: list = [None] * len(self._features)
        for f in np.flatnonzero(self._whole_features).tolist():
            tb, _, lo, hi, _ = push.spans[f]
            lay = batch.features[self._features[f]]
            offsets = tb.output_offsets[lay.start : lay.stop + 1] - lo
            ids = tb.occurrence_ids(lo, hi)
            gains = tb.gains[lo:hi]
            t = int(self._feature_tables[f])
            if not flags[t] and (gains != 1).any():
                flags[t] = 1
            sources[f] = (offsets, ids, gains)
        for f in np.flatnonzero(self._whole_features).tolist():
            if not flags[self._feature_tables[f]]:
                sources[f] = (*sources[f][:2], None)
        return sources, flags

    def _pool_whole(
        self, batch: PreparedBatch, got: np.ndarray, sources: list, training: bool, direct: dict
    ) -> dict[int, tuple[TableBatch, np.ndarray]]:
        """The "sums" exchange of the whole tables (``_whole``): each rank sends each table's
        owner its features' bags as they are (``_whole_sources``: per feature its rows'
        offsets, its ids and, when the header says so, their gains); the owner prepares and
        pools the table's batch of the step from every rank's blocks in the single engine's
        order (the table's features, then ranks: ``_whole_parts``) in one call of the
        backend's ``build_tables_and_lookup``, as the single engine prepares and pools that
        batch (an evaluation lookup's pools them as they came, as the single engine's
        does), and answers each rank with its bags' rows, which are its activations: the
        same bits as the single engine's. Tables go in ``_SUMS_GROUPS`` groups, each group's
        answers sent while the next is pooled. Fills ``direct`` (feature name -> its rows on
        this rank); returns, per table this rank owns (a training lookup), its batch and
        each block's activation rows, which the update reuses (``_kept_batches``)."""
        nf, nt, w, me, cols = (
            len(self._features),
            len(self.table_names),
            self.world_size,
            self.rank,
            self._cols,
        )
        dims, owners, whole_f = self._feature_dims, self._feature_owners, self._whole_features
        got_n = got[:, cols.n : cols.n + nf]  # [sender, feature]
        got_m = got[:, cols.m : cols.m + nf]
        gains_in = got[:, cols.a + self._feature_tables]  # [sender, feature]: gains follow
        mine_n = np.array([0 if s is None else len(s[1]) for s in sources], dtype=np.int64)
        mine_m = np.array([0 if s is None else len(s[0]) - 1 for s in sources], dtype=np.int64)
        mine_g = np.array([s is not None and s[2] is not None for s in sources], dtype=np.int64)
        # A block from each rank to its whole features' owners, none to itself: its rows'
        # offsets (m + 1 int64), its ids (n), its gains (float32, two a word) if they go.
        to = whole_f[None, :] & (owners[None, :] == np.arange(w)[:, None])  # [dest, feature]
        to[me] = False
        out_words = np.where(to, (mine_m + 1 + mine_n + mine_g * ((mine_n + 1) // 2))[None], 0)
        sent_by = whole_f[None, :] & (owners == me)[None, :] & (np.arange(w) != me)[:, None]
        in_words = np.where(sent_by, got_m + 1 + got_n + gains_in * ((got_n + 1) // 2), 0)
        pack_at = _starts(out_words)  # [dest, feature]
        send = np.empty(int(out_words.sum()), dtype=np.int64)
        for f in np.flatnonzero(to.any(axis=0)).tolist():
            offsets, ids, gains = sources[f]
            a = int(pack_at[owners[f], f])
            send[a : a + len(offsets)] = offsets
            a += len(offsets)
            send[a : a + len(ids)] = ids
            if gains is not None:
                a += len(ids)
                floats = send[a : a + (len(ids) + 1) // 2].view(np.float32)
                floats[: len(ids)] = gains
                floats[len(ids) :] = 0
        recv = self._comm.all_to_all(
            send, out_words.sum(axis=1), in_words.sum(axis=1), "lookup bags"
        )
        in_at = _starts(in_words)  # [sender, feature]
        groups = [g for g in np.array_split(np.flatnonzero(self._whole), _SUMS_GROUPS) if len(g)]
        kept: dict[int, tuple[TableBatch, np.ndarray]] = {}
        sent, waited = [], 0
        try:
            for group in groups:
                in_group = self._features_of(np.isin(np.arange(nt), group))
                # Each rank's bags' rows of this group's tables that this rank owns, per
                # [sender, feature]; and those this rank asks of each owner, per [owner, feature].
                answer_sizes = np.where(sent_by & in_group[None, :], got_m * dims[None, :], 0)
                asked = np.where(to & in_group[None, :], (mine_m * dims)[None, :], 0)
                answer_at = _starts(answer_sizes)
                answer = np.empty(int(answer_sizes.sum()), dtype=np.float32)
                tables = [int(t) for t in group if self._route[t][1] == me]
                if tables:
                    parts = [
                        self._whole_parts(t, got_n, got_m, gains_in, recv, in_at, sources)
                        for t in tables
                    ]
                    shards = [self._shards[t] for t in tables]
                    qs = [self._resolved.tables[t].quantization_config for t in tables]
                    if training:
                        batches, outs = self._backend.build_tables_and_lookup(parts, shards, qs)
                    else:  # nothing kept: pooled as they came, as an evaluation lookup pools
                        batches = [
                            LookupOnlyTableBatch(tuple(ps), sum(p.num_outputs for p in ps))
                            for ps in parts
                        ]
                        outs = self._backend.lookup_tables(shards, batches, qs)
                    for t, tb, out, ps in zip(tables, batches, outs, parts, strict=True):
                        fs, ss = self._table_blocks[t]
                        for f, s, part in zip(fs.tolist(), ss.tolist(), ps, strict=True):
                            rows = out[part.out_start : part.out_start + part.num_outputs]
                            if s == me:
                                direct[self._features[f]] = rows
                            elif part.num_outputs:
                                a = int(answer_at[s, f])
                                answer[a : a + rows.size] = rows.reshape(-1)
                        if training:
                            kept[t] = (tb, got_m[ss, fs].copy())
                sent.append(
                    (
                        self._comm.all_to_all_start(
                            answer, answer_sizes.sum(axis=1), asked.sum(axis=1), "lookup sums"
                        ),
                        asked,
                    )
                )
            for wait, asked in sent:
                rows = wait()
                waited += 1
                at = _starts(asked)
                for f in np.flatnonzero(asked.any(axis=0)).tolist():
                    a = int(at[owners[f], f])
                    direct[self._features[f]] = rows[a : a + int(asked[owners[f], f])]
        finally:  # on an error, the collectives started are still waited for: gloo uses
            for wait, _ in sent[waited:]:  # their buffers until they end
                with contextlib.suppress(Exception):
                    wait()
        for f in np.flatnonzero(whole_f).tolist():  # a feature without rows here
            direct.setdefault(self._features[f], np.zeros((0, int(dims[f])), dtype=np.float32))
        return kept

    def _whole_parts(
        self, t: int, got_n, got_m, gains_in, recv: np.ndarray, in_at, sources: list
    ) -> list[FeaturePart]:
        """Whole table ``t``'s batch of the step as the single engine's feature parts: a part
        per block (the table's features in order, then ranks in order), that rank's bags
        (this rank's ``sources``, another's as they arrived in ``recv`` from ``in_at[sender,
        feature]``) as a bag feature of its activation rows that sums its ids by their gains:
        the single engine's occurrences, gains and rows, so its batch and sums."""
        fs, ss = self._table_blocks[t]
        vocabulary = self._resolved.tables[t].vocabulary_size
        parts, start = [], 0
        for f, s in zip(fs.tolist(), ss.tolist(), strict=True):
            name = self._features[f]
            if s == self.rank:
                offsets, ids, gains = sources[f]
            else:
                n, m, a = int(got_n[s, f]), int(got_m[s, f]), int(in_at[s, f])
                offsets, ids = recv[a : a + m + 1], recv[a + m + 1 : a + m + 1 + n]
                gains = None
                if gains_in[s, f]:
                    a += m + 1 + n
                    gains = recv[a : a + (n + 1) // 2].view(np.float32)[:n]
            try:
                bags = Ragged(ids, offsets=offsets, weights=gains)
                if s != self.rank:  # this rank's own were checked when its batch was made
                    check_values(bags, vocabulary, check_weights=False)
            except ValueError as e:
                raise DistributedError(
                    f"rank {self.rank}: table {self.table_names[t]!r}: rank {s}'s bags of "
                    f"feature {name!r} arrived malformed ({e}; ranks disagree on the batch)"
                ) from None
            rows = bags.num_samples
            parts.append(FeaturePart(bags, 0, "sum", start, rows, 0, name, 0, vocabulary))
            start += rows
        return parts

    def _pull_rows(
        self,
        batch: PreparedBatch,
        counts: np.ndarray,
        got: np.ndarray,
        sums: np.ndarray,
        training: bool,
        when: int | None,
        per_table: list,
    ) -> None:
        """The "rows" exchange of the tables not in ``sums``: each rank sends the owners its
        unique ids (``counts``: [table, owner], zero for the other tables), they answer with
        the rows (a keyed table's after its step's rules), and the rank pools its bags from
        them into ``per_table[t]``: the single engine's arithmetic on the same rows."""
        nt, w, cols = len(self.table_names), self.world_size, self._cols
        dims = self._dims
        # Rows travel in their weights' stored dtype: float32 rows in one message, 16-bit ones
        # (their bits, widened by the rank that pools them) in another.
        half = self._half_tables & ~sums
        dims32, dims16 = np.where(half, 0, dims), np.where(half, dims, 0)
        # Unique ids to their owners, destination-major (each owner's block table by table, in
        # first-appearance order); each id learns where its row will be among the rows pulled.
        send_at = _starts(counts.T)  # [owner, table]
        value_at = np.where(half, _starts(counts.T * dims16), _starts(counts.T * dims32))
        send = np.empty(int(counts.sum()), dtype=np.int64)
        layouts, rows, sent_at = [], [], {}
        for t, tb in enumerate(batch.tables):
            if sums[t]:
                layouts.append(None)
                rows.append(None)
                continue
            row, owner = self._route[t]
            layout = _RowsLayout(value_at[:, t], counts[t], int(dims[t]))
            rows.append(np.empty(len(tb.unique_ids), dtype=np.int64))
            sr.route_ids(
                tb.unique_ids, row, owner, w, send, send_at[:, t].copy(), rows[t], layout.row_base
            )
            layouts.append(layout)
            if row == sr.KIND_KEYED:  # where each key went in ``send`` (its flag comes back)
                sent_at[t] = np.empty(len(tb.unique_ids), dtype=np.int64)
                sr.route_ids(
                    tb.unique_ids,
                    row,
                    owner,
                    w,
                    np.empty_like(send),
                    send_at[:, t].copy(),
                    sent_at[t],
                    send_at[:, t].copy(),
                )
        recv_counts = got[:, cols.a : cols.a + nt] * ~sums[None, :]  # [sender, table]
        ids = self._comm.all_to_all(send, counts.sum(axis=0), recv_counts.sum(axis=1), "lookup ids")
        recv_at = _starts(recv_counts)
        keyed_rows = {}
        if self._keyed:
            keyed_rows = self._resolve_keys(
                batch, ids, counts, recv_counts, recv_at, sent_at, training, when, got
            )
        # Answer with the rows of the ids this rank owns, in the order asked.
        answer_at = np.where(half, _starts(recv_counts * dims16), _starts(recv_counts * dims32))
        answer = np.empty(int((recv_counts * dims32).sum()), dtype=np.float32)
        answer16 = np.empty(int((recv_counts * dims16).sum()), dtype=np.uint16)
        for t in range(nt):
            if not recv_counts[:, t].any():
                continue
            shard = self._shards[t]
            into = answer16 if half[t] else answer
            if t in keyed_rows:  # rows by key; a key without a row answers zeros
                found = keyed_rows[t]
                for s in range(w):
                    a, n = int(answer_at[s, t]), int(recv_counts[s, t])
                    at = found[int(recv_at[s, t]) : int(recv_at[s, t]) + n]
                    _stored_weights_into(
                        shard, at, into[a : a + n * shard.dim].reshape(n, shard.dim)
                    )
                continue
            starts = recv_at[:, t].copy()
            if half[t]:  # the rows' 16-bit weights as stored
                self._answer_half(t, ids, starts, recv_counts[:, t], answer16, answer_at[:, t])
                continue
            bad = sr.gather_rows(
                _float_rows(shard),
                shard.dim,
                ids,
                starts,
                starts + recv_counts[:, t],
                self._route[t][0],
                w,
                self.rank,
                answer,
                answer_at[:, t].copy(),
            )
            if bad >= 0:
                raise DistributedError(
                    f"rank {self.rank}: table {self.table_names[t]!r}: a rank asked for id "
                    f"{int(ids[bad])}, which this rank does not hold (ranks disagree on the "
                    "sharding)"
                )
        # Every rank knows which tables send which rows (the dtypes, the agreed exchange), so
        # every rank makes the same collectives.
        values = values16 = None
        if (dims32 * ~sums).any():
            values = self._comm.all_to_all(
                answer,
                (recv_counts * dims32).sum(axis=1),
                (counts.T * dims32).sum(axis=1),
                "lookup rows",
            )
        if half.any():
            values16 = self._comm.all_to_all(
                answer16,
                (recv_counts * dims16).sum(axis=1),
                (counts.T * dims16).sum(axis=1),
                "lookup rows",
            )
        if self._keyed:
            # Whether each asked key has a row, in the order asked (dense ids: always).
            has = np.ones(len(ids), dtype=np.uint8)
            for t, found in keyed_rows.items():
                for s in range(w):
                    a, n = int(recv_at[s, t]), int(recv_counts[s, t])
                    has[a : a + n] = found[a : a + n] >= 0
            back = self._comm.all_to_all(
                has, recv_counts.sum(axis=1), counts.sum(axis=0), "lookup rows found"
            )
            for t, at in sent_at.items():
                rows[t][back[at] == 0] = -1  # no row: pools nothing, as the single engine
        # Pool locally from the pulled rows: each unique id reads its row where it arrived.
        for t, tb in enumerate(batch.tables):
            if sums[t]:
                continue
            local = dataclasses.replace(tb, unique_rows=rows[t])
            q = self._resolved.tables[t].quantization_config
            # 16-bit rows widened exactly as they are pooled, as the owner reads them
            matrix = layouts[t].matrix(values16 if half[t] else values)
            per_table[t] = self._backend.lookup_rows(
                matrix, int(dims[t]), local, q, weights_dtype=self._shards[t].weights_dtype
            )

    def _answer_half(
        self,
        t: int,
        ids: np.ndarray,
        starts: np.ndarray,
        counts: np.ndarray,
        answer: np.ndarray,
        answer_at: np.ndarray,
    ) -> None:
        """``sr.gather_rows`` for a shard of 16-bit weights: sender s's ids of table ``t``
        (``ids[starts[s]:][:counts[s]]``, this rank's) answered with their weights' bits
        (uint16) from ``answer[answer_at[s]]``."""
        shard, dim, w = self._shards[t], int(self._dims[t]), self.world_size
        for s in range(w):
            n = int(counts[s])
            if not n:
                continue
            asked = ids[int(starts[s]) : int(starts[s]) + n]
            rows = shard.rows_for(0, asked)
            bad = np.flatnonzero((asked < 0) | (rows < 0) | (rows >= shard.data.shape[0]))
            if len(bad):
                raise DistributedError(
                    f"rank {self.rank}: table {self.table_names[t]!r}: a rank asked for id "
                    f"{int(asked[bad[0]])}, which this rank does not hold (ranks disagree on the "
                    "sharding)"
                )
            a = int(answer_at[s])
            _stored_weights_into(shard, rows, answer[a : a + n * dim].reshape(n, dim))

    def _pool_sums(
        self,
        batch: PreparedBatch,
        push: _Push,
        got: np.ndarray,
        sums: np.ndarray,
        training: bool,
        per_table: list,
    ) -> tuple[np.ndarray, np.ndarray, dict[int, _Kept]]:
        """The "sums" exchange of the tables in ``sums`` (not whole ones: ``_pool_whole``):
        each rank sends every occurrence to the owner of its id (``fill_pull``); each owner
        unpacks its rows' occurrences in the single engine's order (the table's features,
        then ranks: ``decode_pull``), pools its rows' part of every bag from its shard and
        answers each rank with its partial sums (in ``_SUMS_GROUPS`` groups of tables, each
        sent while the next is pooled), which the rank adds into ``per_table[t]`` in rank
        order (``add_partials``). Returns what the update reuses: the activation row of each
        partial sum received (``targets``, blocks at ``target_at[owner, feature]``) and, per
        table, the occurrences this rank owns (a training lookup's)."""
        nf, w, cols = len(self._features), self.world_size, self._cols
        mine = self._features_of(sums)
        n, m = push.n * mine[:, None], push.m * mine[:, None]  # [feature, owner]
        got_n = got[:, cols.n : cols.n + nf] * mine[None, :]  # [sender, feature]
        got_m = got[:, cols.m : cols.m + nf] * mine[None, :]
        dims = self._feature_dims
        # Occurrences to their owners: destination-major, each destination's feature by feature.
        # This rank's own block last: the all-to-all sends the others' (in rank order, from
        # the buffer's start), and this rank reads its own where it packed it.
        me = self.rank
        order = np.array([d for d in range(w) if d != me] + [me], dtype=np.int64)
        pack_at = np.empty_like(n.T)
        pack_at[order] = _starts(2 * n.T[order])  # [owner, feature]
        target_at = _starts(m.T)
        packed = np.empty(int(2 * n.sum()), dtype=np.int64)
        targets = np.empty(int(m.sum()), dtype=np.int64)
        for f in np.flatnonzero(mine):
            tb, owners, lo, hi, _ = push.spans[f]
            sr.fill_pull(
                tb.unique_ids,
                owners,
                tb.inverse,
                tb.segments,
                tb.gains.view(np.int32),
                lo,
                hi,
                w,
                packed,
                pack_at[:, f].copy(),
                targets,
                target_at[:, f].copy(),
            )
        # The other ranks' occurrences travel while this rank pools the blocks it sent itself.
        others_n = got_n.copy()  # [sender, feature], this rank's own blocks left in ``packed``
        others_n[me] = 0
        to_others = 2 * n.sum(axis=0)
        to_others[me] = 0
        arrived = self._comm.all_to_all_start(
            packed[: int(to_others.sum())],
            to_others,
            2 * others_n.sum(axis=1),
            "lookup occurrences",
        )
        in_at = _starts(2 * others_n)  # [sender, feature]
        # The answers go in groups of tables, each sent while the next is pooled (every rank
        # forms the same groups from ``sums``, which the header made the same everywhere).
        groups = [g for g in np.array_split(np.flatnonzero(sums), _SUMS_GROUPS) if len(g)]
        in_group = [self._features_of(np.isin(np.arange(len(sums)), g)) for g in groups]
        # This rank's rows' part of every bag: per group, each rank's blocks to it feature by
        # feature; ``answer_at[i][sender, feature]`` in group i's buffer.
        answer_sizes = [got_m * dims * g[None, :] for g in in_group]
        answer_at = [_starts(a) for a in answer_sizes]
        answers = [np.empty(int(a.sum()), dtype=np.float32) for a in answer_sizes]
        group_of = {int(t): i for i, g in enumerate(groups) for t in g}
        kept_tables = {}
        for t in np.flatnonzero(sums):
            fs, ss = self._table_blocks[t]
            if got_m[ss, fs].any():  # some rank has ids of it here
                kept_tables[int(t)] = _Kept.empty(got_n[ss, fs], got_m[ss, fs])
        try:
            for t, kept in kept_tables.items():
                fs, ss = self._table_blocks[t]
                own = np.flatnonzero(ss == self.rank)
                at = pack_at[self.rank, fs[own]]
                i = group_of[t]
                self._pool_blocks(t, kept, own, packed, at, answers[i], answer_at[i])
        finally:
            occurrences = arrived()
        sent = []  # per group: the wait for the partial sums the owners send this rank
        waited = 0
        try:
            for i, group in enumerate(groups):
                for t in group.tolist():
                    if t not in kept_tables:
                        continue
                    fs, ss = self._table_blocks[t]
                    others = np.flatnonzero(ss != self.rank)
                    at = in_at[ss[others], fs[others]]
                    kept = kept_tables[t]
                    self._pool_blocks(t, kept, others, occurrences, at, answers[i], answer_at[i])
                asked = m.T * dims * in_group[i][None, :]  # [owner, feature]
                sent.append(
                    self._comm.all_to_all_start(
                        answers[i], answer_sizes[i].sum(axis=1), asked.sum(axis=1), "lookup sums"
                    )
                )
            # Each group's sums added while the later groups' travel.
            for i, group in enumerate(groups):
                partials = sent[i]()
                waited += 1
                part_at = _starts(m.T * dims * in_group[i][None, :])  # [owner, feature]
                for t in group.tolist():
                    tb, dim = batch.tables[t], int(self._dims[t])
                    # Every row a partial sum reaches is stored first (``seen``): only the
                    # others (empty bags) are zeroed after, not the whole matrix before.
                    out = np.empty((tb.num_outputs, dim), dtype=np.float32)
                    seen = np.zeros(tb.num_outputs, dtype=np.uint8)
                    for f in self._table_feature_index[t]:
                        sr.add_partials(
                            out,
                            partials,
                            part_at[:, f].copy(),
                            targets,
                            target_at[:, f].copy(),
                            m[f].copy(),
                            dim,
                            seen,
                        )
                    out[seen == 0] = 0  # empty bags: 0
                    per_table[t] = out
        finally:  # on an error, the collectives started are still waited for: gloo uses
            for wait in sent[waited:]:  # their buffers until they end
                with contextlib.suppress(Exception):
                    wait()
        if not training:
            kept_tables = {}
        return targets, target_at, kept_tables

    def _resolve_keys(
        self,
        batch,
        ids,
        counts,
        recv_counts,
        recv_at,
        sent_at,
        training: bool,
        when: int | None,
        got: np.ndarray,
    ) -> dict[int, np.ndarray]:
        """The rows of the keys every rank asked this rank for (keyed tables; -1: none), by
        this rank's keyed tables, after their step's rules: a training lookup sends each key's
        occurrences too, and the owner runs the rules once on its keys of the whole step with
        their summed occurrences, as the single engine runs them on the concatenated batch (in
        which the same keys occur as often); admission and expiry depend on each key's own
        counts, steps and data time only, never on another key's or on the order of keys, so
        each owner decides for its keys what the single engine decides for them. Every owner
        runs them when any rank brought keys of the table (the single engine's rules run
        then: expiry and the table's data time move on every owner alike). ``sent_at[t]``:
        where each unique key of keyed table ``t`` went in the ids sent."""
        w = self.world_size
        self._begin_keyed(when if training else None)
        keyed = np.zeros(len(self.table_names), dtype=bool)
        keyed[list(self._keyed)] = True
        occurrences = k_recv_at = None
        if training:
            # Each unique key's occurrences in this rank's batch, to its owner: blocks of the
            # keyed tables only, destination-major as the ids.
            k_counts = counts * keyed[:, None]  # [table, owner]
            k_send_at, send_at = _starts(k_counts.T), _starts(counts.T)
            mine = np.empty(int(k_counts.sum()), dtype=np.int64)
            for t in self._keyed:
                owners = np.searchsorted(send_at[:, t], sent_at[t], side="right") - 1
                at = sent_at[t] - send_at[owners, t] + k_send_at[owners, t]
                mine[at] = np.diff(batch.tables[t].unique_offsets)
            k_recv = recv_counts * keyed[None, :]  # [sender, table]
            k_recv_at = _starts(k_recv)
            occurrences = self._comm.all_to_all(
                mine, k_counts.sum(axis=0), k_recv.sum(axis=1), "lookup occurrences"
            )
        totals = got[:, self._cols.k :]
        asked_of: dict[int, tuple] = {}
        for t in self._keyed:
            spans = [(int(recv_at[s, t]), int(recv_at[s, t] + recv_counts[s, t])) for s in range(w)]
            asked = np.concatenate([ids[a:b] for a, b in spans])
            keys, inverse = np.unique(asked, return_inverse=True)
            if training and not totals[:, t].any():
                continue  # no rank brought keys: the single engine runs no rule either
            asked_of[t] = (spans, keys, inverse)
        # max_rows and max_pending are the whole table's: decided over every owner before any
        # table changes. Those tables' keys are probed once, for the decision and the rules.
        room, probed = {}, {}
        if training:
            probed = {
                t: self._shards[t].rows_of(v[1])
                for t, v in asked_of.items()
                if self._bounded(t) or self._crowded(t, got)
            }
            room = self._shared_room(
                {t: (asked_of[t][1], None, f) for t, f in probed.items()}, update=False
            )
        out = {}
        for t, (spans, keys, inverse) in asked_of.items():
            shard = self._shards[t]
            if training:
                n = np.concatenate(
                    [
                        occurrences[k_recv_at[s, t] : k_recv_at[s, t] + b - a]
                        for s, (a, b) in enumerate(spans)
                    ]
                )
                summed = np.bincount(inverse, weights=n, minlength=len(keys)).astype(np.int64)
                victims, forget = (room[t][0], room[t][2]) if t in room else (None, None)
                found = shard.rows_for(
                    0,
                    keys,
                    True,
                    counts=summed,
                    found=probed.get(t),
                    victims=victims,
                    forget=forget,
                )
            else:
                found = shard.rows_for(0, keys, False)
            rows = np.full(len(ids), -1, dtype=np.int64)
            pos = 0
            for a, b in spans:
                rows[a:b] = found[inverse[pos : pos + b - a]]
                pos += b - a
            out[t] = rows
        return out

    def _bounded(self, t: int) -> bool:
        """Whether table ``t`` is keyed with ``max_rows`` (its evictions are the table's)."""
        return t in self._keyed and self._shards[t].dynamic.max_rows is not None

    def _crowded(self, t: int, got: np.ndarray) -> bool:
        """Whether keyed table ``t`` may forget pending keys in this training lookup (its
        ``got`` header): the keys pending on every shard and every rank's distinct keys of
        the step (an upper bound of the new pending ones) pass its ``max_pending``. Every
        rank reads the same header, so all decide alike; a table that is not crowded forgets
        nothing anywhere, and each shard's own bound (the table's) is never reached."""
        shard, cols = self._shards[t], self._cols
        if t not in self._keyed or shard.dynamic.occurrence_threshold == 0:
            return False
        brought = int(got[:, cols.p + t].sum() + got[:, cols.k + t].sum())
        return brought > shard.max_pending

    def _shared_room(
        self, asks: dict[int, tuple[np.ndarray, np.ndarray | None, np.ndarray | None]], update: bool
    ) -> dict[int, tuple[np.ndarray, bool, tuple[np.ndarray, np.ndarray]]]:
        """``max_rows`` of keyed tables sharded by key (and ``max_pending`` of those, and of
        the ``_crowded`` ones without ``max_rows``), decided as one table decides it: per
        table ``t`` of ``asks`` (the same tables on every rank; ``(keys, rows, found)``: this
        rank's distinct keys of the step, for an update inserting on apply their rows, and for
        a training lookup what the index gives them now, probed once) -> (the
        rows this rank evicts, whether expired rows go first, (the pending keys it forgets,
        the new keys it does not count)). Every rank's ``KeyedTable.room_needs`` in one
        all-gather: each rank sums them, so every rank refuses a batch alike (before any
        table changes) and knows how many rows the table evicts, k, and (a training lookup
        with an occurrence threshold) how many pending keys it forgets to stay within its
        ``max_pending`` (``shared_pending``); then the tables that evict or forget send their
        first k candidates in eviction order (``eviction_candidates``: step last touched and
        key, int64), their first pending keys to forget (``pending_candidates``) and largest
        new keys (``pending_surplus``) in one more, and each rank takes its own among the
        first of all (``keyed.shared_victims``). Bytes: 64 a table and rank, then 16 (LRU)
        or 24 (LFU) a candidate row, at most k a rank, and 16 (8) a pending (new) key."""
        ts = sorted(asks)
        if not ts:
            return {}
        needs = np.stack([self._shards[t].room_needs(*asks[t]) for t in ts])
        every = self._comm.all_gather(needs, "max_rows needs")  # [rank, table, 8]
        try:
            decided = {
                t: shared_room(
                    self.table_names[t], every[:, i, :5], self._shards[t].dynamic.max_rows, update
                )
                if self._bounded(t)
                else (0, True)  # no max_rows: only the pending keys' bound is shared
                for i, t in enumerate(ts)
            }
        except ValueError as e:  # from the same sums on every rank: every rank raises it
            self._comm.alike(e)
            raise
        pending = {
            t: shared_pending(every[:, i, 5:], self._shards[t].max_pending)
            for i, t in enumerate(ts)
        }
        empty = np.zeros(0, np.int64)
        out = {t: (empty, first, (empty, empty)) for t, (_, first) in decided.items()}
        # (table, what, how many): the same list on every rank, from the sums
        wanted = []
        for t in ts:
            forget, surplus = pending[t]
            for what, n in (("evict", decided[t][0]), ("forget", forget), ("surplus", surplus)):
                if n > 0:
                    wanted.append((t, what, n))
        if not wanted:
            return out
        mine = []
        for t, what, n in wanted:
            shard, (keys, rows, found) = self._shards[t], asks[t]
            if what == "evict":
                mine.append(shard.eviction_candidates(keys, n, rows, found))
            elif what == "forget":
                mine.append(shard.pending_candidates(keys, n, found))
            else:
                mine.append(shard.pending_surplus(keys, n, found))
        sizes = np.array([len(m[1]) for m in mine], dtype=np.int64)
        block = np.concatenate([sizes, *(m[0].reshape(-1) for m in mine)])
        blocks = self._comm.all_gather_ragged(block, "max_rows candidates")
        at = np.full(len(blocks), len(wanted), dtype=np.int64)  # each rank's next matrix
        picked: dict[tuple[int, str], np.ndarray] = {}
        for i, (t, what, n) in enumerate(wanted):
            width = mine[i][0].shape[1]
            orders = []
            for r, b in enumerate(blocks):
                m = int(b[i])
                orders.append(b[at[r] : at[r] + m * width].reshape(m, width))
                at[r] += m * width
            picked[t, what] = mine[i][1][shared_victims(orders, n, self.rank)]
        for t in ts:
            victims = picked.get((t, "evict"), empty)
            forget = (picked.get((t, "forget"), empty), picked.get((t, "surplus"), empty))
            out[t] = (victims, decided[t][1], forget)
        return out

    def apply_gradients(
        self,
        gradients: Mapping,
        learning_rates: Sequence[float] | None = None,
        batch: PreparedBatch | None = None,
        *,
        timestamp: int | None = None,
    ) -> None:
        """One optimizer step from the gradients of ``batch`` (default: this rank's last
        training lookup's): collectively, every row touched by any rank is updated once, by
        its owner, from the sum of every rank's contributions in the single engine's order.
        ``timestamp``: as ``EmbeddingEngine.apply_gradients`` (default: the step's lookup's),
        the same on every rank. With keyed tables ``batch`` must be this rank's last training
        lookup's (its owners resolved the keys' rows then). Collective. An update refused at
        its header (an invalid input on any rank) changes nothing on any rank. One that fails
        after every rank began it (a peer died or timed out, or this rank failed between two
        of its collectives) may leave the tables half updated, some rows of the step written
        and others not, on this rank and the others, and leaves this rank's engine out of step
        as a lookup failing midway does (``lookup``): every later call raises a
        DistributedError at once; make a new engine from the last checkpoint
        (``ShardedEngine.load``)."""
        with self.lock:
            self._comm.reset()
            try:
                self._apply(gradients, learning_rates, batch, timestamp)
            finally:
                self._count("apply_gradients")

    def _apply(
        self, gradients, learning_rates, given: PreparedBatch | None, timestamp: int | None = None
    ) -> None:
        nf, nt, w, cols = len(self._features), len(self.table_names), self.world_size, self._cols
        error, lrs, when = None, None, None
        push = _Push.empty(nf, w)
        # Per table: 0, or this rank updates from its last training lookup's batch: 1, or 2
        # when that lookup exchanged "sums" for the table (its owners kept the occurrences).
        from_lookup = np.zeros(nt, dtype=np.int64)
        last, grads = None, None
        spec, self._armed = self._armed, None  # disarmed however this call ends
        try:
            check_step_room(self._step, self._step_bound)
            self._check_files()
            if given is not None and given is self._given:
                given = self._pending  # the looked-up form of the batch the lookup was given
            batch = self._pending if given is None else given
            if given is not None:
                check_prepared_for(given, self._fingerprint, self._resolved)
                if not given.deduplicated:
                    raise ValueError(
                        "this PreparedBatch was not deduplicated: build it with "
                        "ShardedEngine.preprocess"
                    )
                check_for_training(given)
            if batch is None:
                raise ValueError(
                    "apply_gradients needs a lookup(..., training=True) first: there is no "
                    "batch whose rows to update"
                )
            if batch.looked_up_in not in (None, self._state_id):
                raise ValueError(
                    f"rank {self.rank}: this batch was looked up before a restore (or by "
                    "another engine): its gradients are of the tables as they were then; "
                    "nothing was changed on any rank. Look its features up again"
                )
            if self._keyed and given is not None and given is not self._pending:
                raise ValueError(
                    f"tables {[self.table_names[t] for t in self._keyed]} are keyed: their "
                    "owners resolved the step's keys at its training lookup, so apply_gradients "
                    "takes that lookup's batch (batch=None, or the one lookup_with_batch gave)"
                )
            grads = self._check_gradients(gradients, batch)
            when = self._data_time(timestamp, True)
            lrs = self._learning_rates.resolve(self._step, learning_rates)
            for t, (opt, lr) in enumerate(zip(self._optimizers, lrs, strict=True)):
                try:
                    opt.check_learning_rate(lr)
                except ValueError as e:
                    raise ValueError(
                        f"table {self.table_names[t]!r}, step {self._step}: {e}; "
                        "nothing was updated"
                    ) from None
            if self._last is not None and self._last.batch is batch:
                last = self._last
                push = last.push
                from_lookup[:] = 1 + last.exchanged_sums  # 2: its owners kept them
            else:
                push = self._push_counts(batch)
        except BaseException as e:  # any, a KeyboardInterrupt too: every rank raises at the header
            error = e
        blocks = {cols.n: push.n.T, cols.m: push.m.T, cols.b: from_lookup}
        received = None
        if spec is not None:
            got, received = self._apply_speculating(spec, error, blocks, lrs, when, grads, last)
        else:
            got = self._header(_APPLY, error, blocks, lrs, timestamp=when)
        # Past the header a failure not every rank raises alike leaves the engine out of step
        # (``_past_header``): its tables may be half updated.
        with self._past_header(_APPLY):
            unchanged, everyone = self._update(got, received, push, last, grads, lrs, when, given)
            if everyone.any():
                unchanged = self._gather_unchanged(unchanged)
        if everyone.any():  # every rank alike, in step: from what every rank gathered
            self._report_unchanged(unchanged, everyone)

    def _update(
        self, got, received, push: _Push, last, grads, lrs, when, given
    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """``_apply`` past its header (``got``; ``received``: what a speculating update's
        message brought, else None): the update's exchanges and each table's update on this
        rank. Returns this rank's rows left unchanged (table -> ids or keys) and how many
        every rank left."""
        nt, cols = len(self.table_names), self._cols
        # Everything is validated on every rank; from here on tables change.
        self._begin_keyed(when)
        if received is None:  # the sizes from this call's headers
            received = self._apply_exchange(got, push, last, grads)
        kept_tables, int_recv, in_int_at, rows_recv, layouts, batches = received
        nf = len(self._features)
        pushed = ~self._features_of(kept_tables)
        got_n = got[:, cols.n : cols.n + nf] * pushed[None, :]  # [sender, feature]
        skip = self.nonfinite_gradients == "skip_row"
        unchanged: dict[str, np.ndarray] = {}
        built: dict[int, TableBatch] = {}

        def table_batch(t: int) -> TableBatch:
            if t not in built:
                layout = layouts[t]
                if kept_tables[t]:
                    built[t] = batches[t]
                else:
                    fs, ss = self._table_blocks[t]
                    built[t] = self._owner_batch(
                        t, int_recv, in_int_at[ss, fs], got_n[ss, fs], layout.row_base, layout.rows
                    )
            return built[t]

        # Tables inserting on apply with max_rows: their evictions decided over every owner
        # (this one too when it got none of the step's keys), before any table changes.
        asks = {}
        for t in self._keyed:
            shard = self._shards[t]
            if not (self._bounded(t) and shard.dynamic.insert_on == "apply"):
                continue
            if last is None or not last.got[:, self._cols.k + t].any():
                continue
            keys = table_batch(t).unique_ids if t in layouts else np.zeros(0, np.int64)
            asks[t] = (keys, shard.rows_of(keys), None)
        room = self._shared_room(asks, update=True)
        # Last table first, as EmbeddingEngine: the rows pooled last are the likeliest in cache.
        # Every table's update in one call, as EmbeddingEngine's.
        updates, updated = [], []
        for t in reversed(range(nt)):
            if t not in layouts:
                continue  # none of this table's rows lives here, so no rank sent any
            shard, layout = self._shards[t], layouts[t]
            grad = layout.matrix(rows_recv)
            tb = table_batch(t)
            if t in self._keyed and last is not None and last.got[:, cols.k + t].any():
                # The rows the step's lookup resolved (-1: not admitted, the gradient
                # dropped); inserting on apply, the admitted new keys get theirs now. Only
                # when some rank brought the table keys (the single engine's update of a
                # batch without them runs no rule and keeps the table's data time).
                keys = tb.unique_ids
                victims, first, _ = room.get(t, (None, False, None))
                found = shard.rows_for_update(
                    0,
                    keys,
                    asks[t][1] if t in asks else shard.rows_of(keys),
                    counts=np.diff(tb.unique_offsets),
                    victims=victims,
                    expire_for_room=first,
                )
                tb = dataclasses.replace(tb, unique_rows=np.asarray(found, dtype=np.int64))
            updates.append((shard, tb, grad, self._optimizers[t], lrs[t], self._step, skip))
            updated.append(t)
        for t, left in zip(updated, self._backend.apply_tables(updates), strict=True):
            if left is not None and len(left):
                shard = self._shards[t]
                ids = shard.keys_at(left) if t in self._keyed else shard.global_ids[left]
                unchanged[self.table_names[t]] = np.sort(ids)
        if last is not None:
            # A keyed table inserting on apply takes the update's data time when the step
            # brought it keys (the single engine's one table does): here too on a rank that
            # owns none of them (the lookup's headers count every rank's keys).
            for t in self._keyed:
                if t not in layouts and t in room:  # it may evict rows for the others' keys
                    victims, first, _ = room[t]
                    empty = np.zeros(0, np.int64)
                    self._shards[t].rows_for_update(
                        0, empty, empty, victims=victims, expire_for_room=first
                    )
                elif t not in layouts and last.got[:, self._cols.k + t].any():
                    self._shards[t].commit_update_time()
        # Everyone learns how many rows any rank left unchanged, so every rank reports alike.
        mine = np.array([sum(len(v) for v in unchanged.values())], dtype=np.int64)
        everyone = self._comm.all_gather(mine, "nonfinite count")[:, 0]
        self._step += 1
        if given is None or given is self._pending:  # one update per lookup
            self._pending = self._last = self._given = None
        return unchanged, everyone

    def _fill_apply(
        self,
        push: _Push,
        last: _Lookup | None,
        grads: Mapping,
        pushed: np.ndarray,
        ints: np.ndarray,
        int_at: np.ndarray,
        rows_g: np.ndarray,
        row_at: np.ndarray,
    ) -> None:
        """An update's blocks to the owners: per feature (``pushed``) its occurrences (ids and
        gradient-row indices over gains, 2 int64 each) into ``ints`` from ``int_at[owner,
        feature]``, and its gradient rows into ``rows_g`` from ``row_at[owner, feature]``; a
        feature not pushed sends the gradient rows of the activation rows its owners pooled."""
        n, m, w = push.n * pushed[:, None], push.m, self.world_size
        for f, (tb, owner, lo, hi, start) in enumerate(push.spans):
            g = grads[self._features[f]]
            if self._whole_features[f]:  # every activation row, to the table's one owner
                d = int(self._feature_owners[f])
                if pushed[f]:
                    _fill_whole_push(tb, lo, hi, start, ints, int(int_at[d, f]))
                at = int(row_at[d, f])
                rows_g[at : at + g.size] = g.reshape(-1)
                continue
            if not pushed[f]:
                _take_rows(g, last.targets, last.target_at[:, f], m[f], start, rows_g, row_at[:, f])
                continue
            sr.fill_push(
                tb.unique_ids,
                owner,
                tb.inverse,
                tb.segments,
                tb.gains.view(np.int32),
                lo,
                hi,
                start,
                g,
                w,
                n[f],
                ints,
                int_at[:, f].copy(),
                rows_g,
                row_at[:, f].copy(),
            )

    def _apply_exchange(self, got: np.ndarray, push: _Push, last: _Lookup | None, grads):
        """An update's blocks sent as the call's headers ``got`` sized them: the occurrences
        of the tables whose owners did not keep them, then the gradient rows (which travel
        while this rank builds the update's batches of the occurrences it kept). Returns
        ``(kept tables, occurrences received, where each [sender, feature] block of them
        starts, gradient rows received, per table their _RowsLayout, kept tables' batches)``."""
        nf, nt, cols = len(self._features), len(self.table_names), self._cols
        # A table's occurrences stay with their owners when every rank updates from the
        # batch of its last training lookup, which exchanged "sums" (else they are pushed).
        kept_tables = (got[:, cols.b : cols.b + nt] == 2).all(axis=0)
        pushed = ~self._features_of(kept_tables)
        n, m = push.n * pushed[:, None], push.m  # [feature, owner]
        got_n = got[:, cols.n : cols.n + nf] * pushed[None, :]  # [sender, feature]
        got_m = got[:, cols.m : cols.m + nf]
        dims = self._feature_dims
        # Destination-major blocks, each destination's feature by feature: (ids, gradient-row
        # indices over gains), gradient rows.
        int_at, row_at = _starts(2 * n.T), _starts(m.T * dims)
        ints = np.empty(int(2 * n.sum()), dtype=np.int64)
        rows_g = np.empty(int((m.T * dims).sum()), dtype=np.float32)
        self._fill_apply(push, last, grads, pushed, ints, int_at, rows_g, row_at)
        int_recv = None
        if pushed.any():
            int_recv = self._comm.all_to_all(
                ints, 2 * n.sum(axis=0), 2 * got_n.sum(axis=1), "gradient occurrences"
            )
        layouts = self._layouts(_starts(got_m * dims), got_m)
        # The gradient rows travel while this rank builds the update's batches of the
        # occurrences it kept (deduplication and grouping by row, which the lookup skipped).
        arrived = self._comm.all_to_all_start(
            rows_g, (m.T * dims).sum(axis=1), (got_m * dims).sum(axis=1), "gradients"
        )
        try:
            batches = self._kept_batches(np.flatnonzero(kept_tables), last, got_m, layouts)
        finally:
            rows_recv = arrived()
        return kept_tables, int_recv, _starts(2 * got_n), rows_recv, layouts, batches

    def _layouts(self, row_at: np.ndarray, got_m: np.ndarray) -> dict[int, _RowsLayout]:
        """Per table whose rows live here, where its gradient rows land: blocks [sender,
        feature] of ``got_m`` rows from float ``row_at``."""
        layouts = {}
        for t in range(len(self.table_names)):
            if self._shards[t].data.shape[0]:
                fs, ss = self._table_blocks[t]
                dim = int(self._shards[t].dim)
                # A whole table's batch numbers its gradient rows in its blocks' order.
                layouts[t] = _RowsLayout(row_at[ss, fs], got_m[ss, fs], dim, self._whole[t])
        return layouts

    def _speculated(self, spec: _Lookup):
        """What the update of the training lookup ``spec`` sends, as that lookup's headers
        sized it: ``(kept tables, pushed features, gradient rows each sender sends this rank
        [sender, feature], the layout of this rank's message out, of the message in)``
        (``sharding.update_message``)."""
        nf, cols = len(self._features), self._cols
        kept_tables = spec.exchanged_sums.copy()
        pushed = ~self._features_of(kept_tables)
        n, m = spec.push.n * pushed[:, None], spec.push.m
        got_n = spec.got[:, cols.n : cols.n + nf] * pushed[None, :]  # [sender, feature]
        got_m = spec.got[:, cols.m : cols.m + nf]
        dims, width, grid = self._feature_dims, cols.width, self._grid
        out = update_message(n, m, dims, width, grid)
        into = update_message(got_n.T, got_m.T, dims, width, grid)
        return kept_tables, pushed, got_m, out, into

    def _message_exchange(
        self,
        call: int,
        header: np.ndarray,
        purpose: str,
        out: UpdateMessage,
        into: UpdateMessage,
        fill=None,
        meanwhile=None,
    ):
        """The all-to-all of a speculating update, laid out as ``out`` (this rank's message)
        and ``into`` (what it receives; ``_speculated``), carrying this rank's ``header`` rows
        and what ``fill(words, floats)`` writes (else zeros). ``meanwhile()`` runs while it
        travels. Returns ``(the headers received, the buffer received, what meanwhile
        returned, the error fill raised or None)``: a fill that raises (any error, a
        KeyboardInterrupt too) still sends the message, zeros with its header marked
        ``_PACKING``, and skips ``meanwhile``, so that every rank raises at the header
        (raising at once left the others waiting for this rank's message until the timeout)."""
        w, cols = self.world_size, self._cols
        # Zeros: the padding and an unfilled message must not carry leftover memory.
        send = np.zeros(int(out.sizes.sum()), dtype=np.float32)
        words = send.view(np.int64)
        failed: BaseException | None = None
        if fill is not None:
            try:
                fill(words, send)
            except BaseException as e:  # sent as the header's failure code below
                failed, meanwhile = e, None
                send[:] = 0
                header = header.copy()
                header[:, 2] = _PACKING
        for d in range(w):
            words[out.block_at[d] // 2 : out.block_at[d] // 2 + cols.width] = header[d]
        self._comm.enter(f"{_CALLS[call]} at step {self._step}")
        arrived = self._comm.all_to_all_start(send, out.sizes, into.sizes, purpose)
        extra = None
        try:
            if meanwhile is not None:
                extra = meanwhile()
        finally:
            recv = arrived()
        taken = recv.view(np.int64)
        got = np.stack([taken[a // 2 : a // 2 + cols.width] for a in into.block_at.tolist()])
        return got, recv, extra, failed

    def _apply_speculating(self, spec: _Lookup, error, blocks, lrs, when, grads, last):
        """The update right after the training lookup ``spec``, in one all-to-all: each rank
        sends every rank its header and its blocks of the update as that lookup's headers
        sized them (``sharding.update_message``), before anyone has seen the others' headers.
        Every rank speculates alike (the lookup armed every rank); a rank whose call does not
        update that lookup's batch (``last`` not ``spec``: another batch, or an error) sends
        zeros in their place and its header says so. Returns the headers (checked as
        ``_header`` does) and, when every rank sent its blocks, what ``_apply_exchange``
        returns; else None: then the blocks go again as the headers size them (the fallback
        costs the zeros sent)."""
        nt, cols = len(self.table_names), self._cols
        header = self._header_rows(_APPLY, error, blocks, lrs, when)
        kept_tables, pushed, got_m, out, into = self._speculated(spec)
        real = error is None and last is spec

        def fill(words, floats):
            self._fill_apply(spec.push, spec, grads, pushed, words, out.int_at, floats, out.row_at)

        def meanwhile():  # the kept batches (unused if a rank falls back)
            # the others go on past the header: a failure here leaves them (``_past_header``)
            with self._past_header(_APPLY):
                layouts = self._layouts(into.row_at, got_m)
                batches = self._kept_batches(np.flatnonzero(kept_tables), spec, got_m, layouts)
                return layouts, batches

        got, recv, extra, failed = self._message_exchange(
            _APPLY,
            header,
            "gradients",
            out,
            into,
            fill if real else None,
            meanwhile if real else None,
        )
        self._check_header(_APPLY, error if failed is None else failed, got, lrs)
        if not (got[:, cols.b : cols.b + nt] > 0).all():
            return got, None
        layouts, batches = extra
        return got, (kept_tables, recv.view(np.int64), into.int_at, recv, layouts, batches)

    def _kept_batches(
        self, tables: np.ndarray, last: _Lookup, got_m: np.ndarray, layouts: dict
    ) -> dict[int, TableBatch]:
        """The update's TableBatch of each table in ``tables`` whose shard here has rows (every
        rank updates from its last training lookup, which exchanged "sums" for them), from the
        occurrences this rank kept, numbered by the gradient rows arriving (``got_m[sender,
        feature]`` of them, laid out as ``layouts[t]``), which must be as many as it pooled,
        block by block. A shard that got no occurrence gets an empty batch: its optimizer may
        update every row each step (non-lazy Adam), as the single engine's does."""
        batches, whole = {}, {}
        for t in tables.tolist():
            if t not in layouts:
                continue  # none of this table's rows lives here
            fs, ss = self._table_blocks[t]
            if self._whole[t]:  # the batch this rank prepared for the lookup (``_pool_whole``)
                tb, block_rows = last.whole[t]
                if (got_m[ss, fs] != block_rows).any():
                    raise DistributedError(
                        f"rank {self.rank}: table {self.table_names[t]!r}: gradient rows "
                        f"{got_m[ss, fs].tolist()} are coming for the {block_rows.tolist()} "
                        "activation rows this rank pooled (ranks disagree on the batch)"
                    )
                whole[t] = tb
                continue
            kept = last.kept.get(t)
            if kept is None:  # no rank had ids of it here
                none = np.zeros(len(fs), dtype=np.int64)
                kept = _Kept.empty(none, none)
            if (got_m[ss, fs] != kept.block_rows).any():
                raise DistributedError(
                    f"rank {self.rank}: table {self.table_names[t]!r}: gradient rows "
                    f"{got_m[ss, fs].tolist()} are coming for the {kept.block_rows.tolist()} "
                    "partial sums this rank pooled (ranks disagree on the batch)"
                )
            layout = layouts[t]
            batches[t] = (kept, layout)
        # Every table's arrays from one block (see __init__).
        sizes = [_batch_arrays(len(k.ids), lay.rows) for k, lay in batches.values()]
        carve = Carver(self._memory.take(Carver.size(*[a for s in sizes for a in s])))
        for (t, (kept, layout)), spec in zip(list(batches.items()), sizes, strict=True):
            arrays = [carve.empty(n, dt) for n, dt in spec]
            batches[t] = self._kept_batch(t, kept, layout.row_base, layout.rows, arrays)
        return batches | whole

    def _pool_blocks(
        self,
        t: int,
        kept: _Kept,
        blocks: np.ndarray,
        buffer: np.ndarray,
        at: np.ndarray,
        answer: np.ndarray,
        answer_at: np.ndarray,
    ) -> None:
        """Blocks ``blocks`` of table ``t``'s "sums" lookup (their occurrences from
        ``buffer[at[i]]``) unpacked into ``kept`` (``shard_route.decode_pull``) and pooled
        from this rank's shard, each block's partial sums into ``answer`` at ``answer_at[sender,
        feature]``."""
        if not len(blocks):
            return
        bad = sr.decode_pull(
            buffer,
            at,
            kept.counts[blocks],
            kept.block_rows[blocks],
            kept.first_occ[blocks],
            kept.first_row[blocks],
            self._route[t][0],
            self.world_size,
            self.rank,
            self._shards[t].data.shape[0],
            kept.ids,
            kept.rows,
            kept.gains.view(np.int32),
            kept.segments,
            kept.output_offsets,
        )
        if bad >= 0:
            b = int(np.searchsorted(kept.first_occ[blocks], bad, side="right")) - 1
            i = int(buffer[int(at[b]) + 2 * (bad - int(kept.first_occ[blocks[b]]))])
            raise DistributedError(
                f"rank {self.rank}: table {self.table_names[t]!r}: an occurrence arrived for id "
                f"{i}, which this rank does not hold, or for a row out of its bag order (ranks "
                "disagree on the sharding)"
            )
        shard, dim = self._shards[t], int(self._dims[t])
        q = self._resolved.tables[t].quantization_config
        fs, ss = self._table_blocks[t]
        # 16-bit weights are pooled from the row array, widened as read; float32 ones from
        # the rows as floats (16-bit slots beside them: the row array's float32 view)
        half = _half_weights(shard)
        data = shard.data if half else _float_rows(shard)
        for b in blocks.tolist():
            rows = int(kept.block_rows[b])
            if rows:  # pooled straight into the answer's block
                a = int(answer_at[ss[b], fs[b]])
                into = answer[a : a + rows * dim].reshape(rows, dim)
                self._backend.lookup_rows(
                    data, dim, kept.block_batch(b), q, out=into, weights_dtype=shard.weights_dtype
                )

    def _kept_batch(
        self, t: int, kept: _Kept, row_base: np.ndarray, num_outputs: int, arrays: list
    ):
        """The update's TableBatch of the occurrences kept from table ``t``'s "sums" lookup,
        its gradient rows block b's from ``row_base[b]`` of the ``num_outputs`` received
        (``shard_route.kept_batch``), in ``arrays`` (``_batch_arrays``' shapes)."""

        def build(unique, inverse, gains, *rest):
            gains[:] = kept.gains  # the kernel reads the kept ones
            return sr.kept_batch(
                kept.ids,
                kept.segments,
                kept.gains,
                kept.counts,
                kept.block_rows,
                row_base,
                self._route[t][0],
                self.world_size,
                num_outputs,
                unique,
                inverse,
                *rest,
            )

        total = len(kept.ids)
        what = "an occurrence was kept"
        return self._owner_table_batch(t, total, num_outputs, what, build, arrays)

    def _owner_batch(
        self,
        t: int,
        ints: np.ndarray,
        int_at: np.ndarray,
        counts: np.ndarray,
        row_base: np.ndarray,
        num_outputs: int,
    ) -> TableBatch:
        """The TableBatch of table ``t``'s occurrences pushed to its owner by an update,
        blocks in the single engine's order (see ``shard_route.owner_batch``): ids
        deduplicated in order of first appearance, the occurrences grouped by id stably (so
        each row's gradient sums in that order), rows of the shard; segments index the
        received gradient rows."""

        def build(unique, inverse, gains, segments, rows, out_offsets, offsets, ugains, usegs):
            return sr.owner_batch(
                ints,
                int_at,
                counts,
                row_base,
                self._route[t][0],
                self.world_size,
                self.rank,
                self._shards[t].data.shape[0],
                num_outputs,
                unique,
                inverse,
                gains.view(np.int32),  # the gains' bits arrive in the int64 words
                segments,
                rows,
                out_offsets,
                offsets,
                ugains.view(np.int32),
                usegs,
            )

        total = int(counts.sum())
        return self._owner_table_batch(t, total, num_outputs, "a gradient arrived", build)

    def _owner_table_batch(
        self, t: int, total: int, num_outputs: int, what: str, build, arrays: list | None = None
    ):
        """A TableBatch of ``total`` occurrences of table ``t`` over ``num_outputs`` rows, its
        arrays (``arrays``, shaped as ``_batch_arrays`` says, or new ones) filled by
        ``build(unique, inverse, gains, segments, unique_rows, output_offsets, unique_offsets,
        unique_gains, unique_segments)`` (a ``shard_route`` kernel returning the number of
        unique ids, or below 0 for an occurrence this rank cannot take: a DistributedError
        saying ``what``)."""
        if arrays is None:
            arrays = [np.empty(n, dtype=dt) for n, dt in _batch_arrays(total, num_outputs)]
        u = build(*arrays)
        (
            unique,
            inverse,
            gains,
            segments,
            unique_rows,
            output_offsets,
            unique_offsets,
            unique_gains,
            unique_segments,
        ) = arrays
        if u < 0:
            raise DistributedError(
                f"rank {self.rank}: table {self.table_names[t]!r}: {what} for an id this rank "
                "does not hold, or for a row that was not sent (ranks disagree on the sharding)"
            )
        return TableBatch(
            unique_ids=unique[:u],
            inverse=inverse,
            gains=gains,
            segments=segments,
            num_outputs=num_outputs,
            output_offsets=output_offsets,
            unique_offsets=unique_offsets[: u + 1],
            unique_gains=unique_gains,
            unique_segments=unique_segments,
            unique_bounds=np.array([0, u], dtype=np.int64),
            unique_rows=unique_rows[:u],
        )

    def _gather_unchanged(self, unchanged: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every rank's rows left unchanged (``unchanged``: this rank's, table -> ids or keys),
        per table sorted, as the single engine reports them. Collective (every rank calls it
        when any rank left a row)."""
        out = {}
        for name in self.table_names:
            mine = np.asarray(unchanged.get(name, np.zeros(0, np.int64)), dtype=np.int64)
            ids = np.concatenate(self._comm.all_gather_ragged(mine, "nonfinite rows"))
            if len(ids):
                out[name] = np.sort(ids)
        return out

    def _report_unchanged(self, unchanged: dict[str, np.ndarray], everyone: np.ndarray) -> None:
        """The non-finite policy (EmbeddingEngine's), on every rank alike: ``unchanged`` holds
        every rank's rows (``_gather_unchanged``: each owner's rows left alone for a result or,
        under "skip_row", a gradient contribution not finite), so the error's ``rows`` and
        ``nonfinite_rows_skipped`` are the single engine's on every rank."""
        ranks = ", ".join(f"rank {s}: {int(n)}" for s, n in enumerate(everyone) if n)
        what = f"{_describe_unchanged(unchanged)}; left alone per rank: {ranks}"
        step = self._step - 1
        if self.nonfinite_gradients == "error":
            raise NonFiniteUpdateError(
                f"step {step}: the update would have written non-finite values: {what}; every "
                "other row was updated and the step counted (nonfinite_gradients='error')",
                unchanged,
            )
        for name, ids in unchanged.items():
            self.nonfinite_rows_skipped[name] += len(ids)
        warnings.warn(
            f"step {step}: rows left unchanged because their gradient or update was not "
            f"finite: {what} "
            "(nonfinite_gradients='skip_row'; counted in engine.nonfinite_rows_skipped)",
            RuntimeWarning,
            stacklevel=3,
        )

    def _check_gradients(self, gradients: Mapping, batch: PreparedBatch) -> dict[str, np.ndarray]:
        """Gradient per feature as float32 ``[rows, dim]``, after EmbeddingEngine's checks."""
        if not isinstance(gradients, Mapping):
            raise TypeError(
                f"gradients must be a dict of feature name -> array, got {type(gradients)}"
            )
        missing = [f for f in batch.features if f not in gradients]
        extra = [f for f in gradients if f not in batch.features]
        if extra or missing:
            raise ValueError(
                f"gradients for features {sorted(gradients)}; the batch has "
                f"{list(batch.features)}, each needs one"
            )
        # The gradient rows are copied into the messages before any table changes, so one in
        # a shard's memory needs no copy of its own (EmbeddingEngine's does).
        return {
            name: checked_gradient(name, gradients[name], lay, self.nonfinite_gradients)
            for name, lay in batch.features.items()
        }

    # -- state -----------------------------------------------------------------------------------

    def table_contents(self, table_name: str | None = None) -> dict[str, Any]:
        """Every table whole, gathered on every rank: ``{"step": int, "tables": {table:
        {"weights": [vocabulary_size, dim], slot: ...}}}`` in logical row order, the layout of
        ``EmbeddingEngine.state_dict()`` (copies); a keyed table's entry is what
        ``EmbeddingEngine.table_contents(name)`` gives: ``keys`` (sorted), ``weights`` and each
        slot aligned with them. With ``table_name``, that table alone, as
        ``EmbeddingEngine.table_contents(table_name)`` gives it (a dense table's ``keys`` are
        ``0 .. vocabulary_size - 1``); every rank must ask for the same table (checked). A
        name of no table is a KeyError on that rank and a DistributedError on the others.
        Collective. A failure after every rank began it (a peer died or timed out, or this
        rank failed between two of its gathers) changes no table but leaves this rank's engine
        out of step, as a lookup failing midway does (``lookup``)."""
        with self.lock:
            self._comm.reset()
            try:
                error, which = None, -1
                try:  # any failure, a KeyboardInterrupt too: every rank raises at the header
                    error = self._files_error()
                    if table_name is not None and error is None:
                        try:
                            which = self.table_names.index(table_name)
                        except ValueError:
                            error = KeyError(
                                f"no table named {table_name!r}; tables are "
                                f"{list(self.table_names)}"
                            )
                except BaseException as e:
                    error = e
                # Which table each rank asks for (0: every table), so that none gathers
                # another table than the others.
                got = self._header(_CONTENTS, error, {self._cols.a: np.array([which + 1])})
                asked = got[:, self._cols.a]
                if (asked != asked[self.rank]).any():
                    said = ", ".join(
                        f"rank {r}: "
                        + ("every table" if a == 0 else repr(self.table_names[int(a) - 1]))
                        for r, a in enumerate(asked.tolist())
                    )
                    raise DistributedError(
                        f"rank {self.rank}: table_contents at step {self._step} asked for "
                        f"other tables on other ranks ({said}); every rank must ask for the same"
                    )
                # past the header: a failure here may leave the ranks out of step
                with self._past_header(_CONTENTS):
                    return self._contents(which, table_name)
            finally:
                self._count("table_contents")

    def _contents(self, which: int, table_name: str | None) -> dict[str, Any]:
        """``table_contents`` past its header: table ``which`` (every table: -1), gathered."""
        tables = {}
        for t, (shard, name, cfg) in enumerate(
            zip(self._shards, self.table_names, self._resolved.tables, strict=True)
        ):
            if which >= 0 and t != which:
                continue
            if cfg.keyed:
                tables[name] = self._keyed_contents(shard)
                continue
            ids = self._comm.all_gather_ragged(shard.global_ids, "contents")
            # rows as bytes: 16-bit rows keep their stored dtypes (no upcast)
            raw = shard.data.view(np.uint8)  # [rows, row bytes]
            rows = self._comm.all_gather_ragged(raw.reshape(-1), "contents")
            full = np.empty((cfg.vocabulary_size, raw.shape[1]), dtype=np.uint8)
            for i, v in zip(ids, rows, strict=True):
                full[i] = v.reshape(len(i), raw.shape[1])
            full = full.view(shard.data.dtype)
            tables[name] = {
                WEIGHTS: column_view(full, shard.columns[WEIGHTS]).copy(),
                **{
                    s.name: column_view(full, shard.columns[s.name]).copy()
                    for s in shard.slot_specs
                },
            }
        if which >= 0:
            cfg = self._resolved.tables[which]
            one = tables[table_name]
            if cfg.keyed:
                return one
            return {"keys": np.arange(cfg.vocabulary_size, dtype=np.int64), **one}
        return {"step": self._step, "tables": tables}

    def _keyed_contents(self, shard: KeyedTable) -> dict[str, np.ndarray]:
        """A keyed table's ``contents()`` of every rank, gathered: ``keys`` sorted, and
        ``weights`` and each slot aligned with them (``EmbeddingEngine.table_contents``'s)."""
        mine = shard.contents()
        keys = np.concatenate(self._comm.all_gather_ragged(mine["keys"], "contents"))
        order = np.argsort(keys, kind="stable")
        out = {"keys": keys[order]}
        for name, a in mine.items():
            if name == "keys":
                continue
            parts = self._comm.all_gather_ragged(a.reshape(-1), "contents")
            out[name] = np.concatenate(parts).reshape(-1, *a.shape[1:])[order]
        return out

    def spec(self) -> dict[str, Any]:
        """The configuration as JSON, as the single engine of the same arguments gives it
        (``EmbeddingEngine.spec``; tables in RAM): what a checkpoint's manifest holds, so a
        plain engine loads a ShardedEngine's checkpoint and back."""
        r = self._resolved
        tables = table_entries(
            r,
            self._optimizers,
            self._learning_rates,
            ["keyed" if cfg.keyed else "ram" for cfg in r.tables],
            [shard.slot_specs for shard in self._shards],
        )
        features = feature_entries(r)
        tags = []
        for tag in range(self._learning_rates.num_tags):
            fn = self._learning_rates.tag_callable(tag)
            tags.append(
                {"tag": tag, "callable": None if fn is None else getattr(fn, "__qualname__", "?")}
            )
        plan = plan_storage(r, self._optimizers, "ram", None)
        return {
            "tables": tables,
            "features": features,
            "storage_plan": plan.to_json(),
            "learning_rate_tags": tags,
            "seed": self.seed,
            "backend": self._backend.name,
            "nonfinite_gradients": self.nonfinite_gradients,
        }

    # -- checkpoints -----------------------------------------------------------------------------

    def save(
        self,
        path,
        keep: int | None = None,
        extra_tensors: Mapping | None = None,
        extra_metadata: Mapping | None = None,
    ):
        """Write a checkpoint under the folder ``path`` in embengine's format (by logical table
        and row, one global manifest), each rank writing a block of every table's rows; it
        loads at any world size and into a plain ``EmbeddingEngine``. ``extra_tensors`` /
        ``extra_metadata``: as ``EmbeddingEngine.save``; rank 0's are written (pass the same
        on every rank, e.g. a DDP model's). ``keep``: as ``EmbeddingEngine.save``, the same on
        every rank (checked: ranks that differ raise, nothing written). Collective; every rank
        must see ``path`` (one host, or a shared file system). Returns the checkpoint's
        folder. See embengine.distributed.checkpoint. Refused on every rank, nothing written,
        between a training lookup and its update when a keyed table took that lookup (as
        ``EmbeddingEngine.save``). A failure every rank learns (a write, a bad folder, any
        rank's error in its work) is raised on every rank together and leaves the engine in
        step; a peer that died or timed out leaves it out of step, as a lookup failing midway
        does (``lookup``). A failure of rank 0's after the commit (syncing the root folder,
        pruning past ``keep``) is a CheckpointError on every rank naming the checkpoint, which
        is complete and restores."""
        from .. import checkpoint as single
        from . import checkpoint

        error, kept, spec = None, 0, None
        try:  # a bad argument on any rank: every rank raises at the header, nothing written
            single.check_save_arguments(keep, extra_metadata, path, extra_tensors)
            # keep in the header (0: None; a keep past int64 keeps every checkpoint alike)
            kept = 0 if keep is None else min(keep, np.iinfo(np.int64).max)
            self._check_files()
            halfway = [self.table_names[t] for t in self._keyed if self._halfway(t)]
            if halfway:
                raise ValueError(
                    f"step {self._step} has been looked up for training but not applied: keyed "
                    f"table(s) {halfway} already counted its keys and gave new keys rows, so a "
                    "checkpoint now holds half a step that no restore can finish; nothing was "
                    "written. Save after apply_gradients"
                )
            # this rank's work before the save's collectives: its error is every rank's
            spec = self.spec()
        except BaseException as e:  # any, a KeyboardInterrupt too: every rank raises at the header
            error = e
        with self.lock:
            self._comm.reset()
            try:
                got = self._header(_SAVE, error, {self._cols.a: np.array([kept])})
                keeps = got[:, self._cols.a]
                if (keeps != keeps[self.rank]).any():
                    said = [None if k == 0 else int(k) for k in keeps.tolist()]
                    raise DistributedError(
                        f"rank {self.rank}: save at step {self._step}: the ranks pass keep "
                        f"{said} (ranks 0..{self.world_size - 1}); every rank must pass the same "
                        "keep= (the checkpoints under the root to keep); nothing was written"
                    )
                # A failure every rank learns leaves them in step (``checkpoint.save`` raises it
                # through ``Comm.alike``); any other past the header leaves them out of step.
                with self._past_header(_SAVE):
                    return checkpoint.save(
                        self._comm,
                        self._shards,
                        self._plan,
                        spec,
                        self._step,
                        path,
                        keep,
                        extra_metadata,
                        extra_tensors,
                    )
            finally:
                self._count("save")

    def _halfway(self, t: int) -> bool:
        """Whether keyed table ``t``'s shard took a training lookup of this step (as
        ``EmbeddingEngine.save`` refuses: half a step)."""
        return self._shards[t].looked_up_in(self._step)

    def restore(self, path, verify: bool = True):
        """Load a checkpoint (``path``: a checkpoint folder, or a folder of them: the newest)
        written at any world size, or by a plain engine, of the same configuration: each rank
        reads its own rows, in chunks. Collective; returns a CheckpointInfo (step, extra data),
        as ``EmbeddingEngine.restore``. A failure every rank learns is raised on every rank
        together; any other after every rank began it (a peer died or timed out, an error this
        rank did not share) leaves the tables part restored and this rank's engine out of
        step, as a lookup failing midway does (``lookup``): make a new engine
        (``ShardedEngine.load``)."""
        return self._restore(path, verify)

    def _restore(self, path, verify: bool, newest: str | None = None, verify_other: bool = True):
        """``restore``; ``newest``: the name of the checkpoint to restore in the folder of
        checkpoints ``path`` that this rank read (``load``), rank 0's winning (a rank that read
        another one reads it with ``verify_other``); else the newest rank 0 finds there."""
        from . import checkpoint

        with self.lock:
            self._comm.reset()
            try:
                try:  # a KeyboardInterrupt too: every rank raises at the header
                    error = self._files_error()
                except BaseException as e:
                    error = e
                self._header(_RESTORE, error)
                with self._past_header(_RESTORE):  # as the save's
                    info = checkpoint.restore(
                        self._comm,
                        self._shards,
                        self.spec(),
                        path,
                        verify,
                        lambda step: int_slot_ranges(self._resolved, self._optimizers, step),
                        newest,
                        verify_other,
                    )
                self._step = info.step
                self._step_time = (-1, None)
                self._state_id = next(_STATES)  # batches looked up before are refused
                self._pending = self._last = self._given = None  # its rows changed
                return info
            finally:
                self._count("restore")

    @classmethod
    def load(cls, path, callables=None, verify: bool = True, **kwargs) -> ShardedEngine:
        """A new ShardedEngine from a checkpoint alone (any world size's, or a plain
        engine's): ``kwargs`` are ShardedEngine's arguments (sharding, group, timeout, ...).
        Collective."""
        from pathlib import Path

        from ..checkpoint import read_checkpoint
        from ..spec import engine_options, feature_configs_from_spec

        features, options, refused, newest = None, {}, None, None
        try:
            spec, reader = read_checkpoint(path, verify)
            # the checkpoint the spec came from, not the newest under a root again (a save in
            # between would hand the restore another one): rank 0's, which every rank then
            # restores (each rank read its own newest, maybe another one: the ranks start at
            # different times)
            if not (Path(path) / "manifest.json").is_file():
                newest = reader.path.name
            else:
                path = reader.path
            reader.close()  # the spec is all it needs here; restore reads (and locks) again
            features = feature_configs_from_spec(spec, callables)
            options = engine_options(spec)
            options = {k: options[k] for k in ("seed", "nonfinite_gradients")}
        except BaseException as e:  # a folder this rank alone cannot read, an interruption:
            refused = e  # every rank raises at the configuration's exchange
        # the class's own instance (adapters never reach an engine's private methods)
        made = cls(features, **{**options, **kwargs}, refused=refused)
        made._restore(path, False, newest, verify)  # checked just now (rank 0's)
        return made


def _batch_arrays(total: int, num_outputs: int) -> list[tuple[int, type]]:
    """(length, dtype) of an owner's TableBatch arrays (``_owner_table_batch``'s order) for
    ``total`` occurrences over ``num_outputs`` rows."""
    i64, f32, n = np.int64, np.float32, total
    per_occurrence = [(n, i64), (n, i64), (n, f32), (n, i64), (n, i64)]
    return [*per_occurrence, (num_outputs + 1, i64), (n + 1, i64), (n, f32), (n, i64)]


def _half_weights(shard) -> bool:
    """A shard (ShardTable or KeyedTable) whose weights are stored in 16 bits."""
    return shard.weights_dtype != "float32"


def _float_rows(shard) -> np.ndarray:
    """A float32 array whose row r begins with row r's weights, of a shard with float32 weights:
    its row array, or (16-bit slots) the row array's float32 view (storage.dense.row_columns)."""
    data = shard.data
    return data.view(np.float32) if data.dtype == np.uint16 else data


def _stored_weights_into(shard, rows: np.ndarray, out: np.ndarray) -> None:
    """``out[i]`` = row ``rows[i]``'s weights as stored: float32 into a float32 ``out``, the
    bits of 16-bit ones (a row's first units) into a uint16 ``out``; zeros (0.0 in every
    dtype) for a row of -1."""
    rows = np.asarray(rows, dtype=np.int64)
    source = shard.data if out.dtype == np.uint16 else _float_rows(shard)
    out[:] = source[np.maximum(rows, 0), : shard.dim]
    out[rows < 0] = 0


def _starts(sizes: np.ndarray) -> np.ndarray:
    """Where each block starts when blocks of ``sizes`` (2-D) lie one after another in row-major
    order: the exclusive prefix sums, same shape."""
    flat = np.asarray(sizes, dtype=np.int64).reshape(-1)
    out = np.zeros(len(flat), dtype=np.int64)
    np.cumsum(flat[:-1], out=out[1:])
    return out.reshape(np.shape(sizes))


def _take_rows(
    grad: np.ndarray,
    targets: np.ndarray,
    target_at: np.ndarray,
    counts: np.ndarray,
    first: int,
    out: np.ndarray,
    out_at: np.ndarray,
) -> None:
    """One feature's gradient rows for the owners that pooled its bags: owner d's
    ``counts[d]`` activation rows (``targets[target_at[d]:]``, rows of the table's activation
    matrix, the feature's from ``first``) copied from ``grad`` to ``out[out_at[d]:]``."""
    dim = grad.shape[1]
    for d, c in enumerate(counts.tolist()):
        if c:
            rows = targets[int(target_at[d]) : int(target_at[d]) + c] - first
            at = int(out_at[d])
            np.take(grad, rows, axis=0, out=out[at : at + c * dim].reshape(c, dim))


def _fill_whole_push(
    tb: TableBatch, lo: int, hi: int, start: int, ints: np.ndarray, at: int
) -> None:
    """A whole table's feature pushed by an update (its owner did not keep the lookup's
    batch): occurrences ``lo:hi`` of ``tb`` into ``ints[at:]`` as ``fill_push`` packs them (the
    ids, then each one's gradient row in the high 32 bits over its gain's bits), every
    activation row of the feature sent (from ``start``), so a row's index is its row's."""
    n = hi - lo
    ints[at : at + n] = tb.occurrence_ids(lo, hi)
    bits = tb.gains[lo:hi].view(np.int32).astype(np.int64) & 0xFFFFFFFF
    ints[at + n : at + 2 * n] = ((tb.segments[lo:hi] - start) << 32) | bits


class _RowsLayout:
    """Blocks of rows of ``dim`` floats in a received buffer (block b: ``count[b]`` rows from
    float ``at[b]``) as one row matrix: ``row_base[b]``, block b's first row in ``matrix``
    (``in_order``: the blocks' rows one after another in block order, as a whole table's
    batch numbers them).

    When every non-empty block starts on one grid of ``dim`` floats (always, when every
    table's rows are as wide), the matrix is a view of the buffer from the first block to the
    end of the last (rows of other blocks in between are never read); otherwise the blocks are
    copied together, in block order."""

    def __init__(self, at: np.ndarray, count: np.ndarray, dim: int, in_order: bool = False):
        at, count = np.asarray(at, dtype=np.int64), np.asarray(count, dtype=np.int64)
        self.at, self.count, self.dim = at, count, dim
        live = count > 0
        self.lo = int(at[live].min()) if live.any() else 0
        self.view = bool(((at[live] - self.lo) % dim == 0).all())
        if in_order:  # row_base the blocks' starts in block order: a view only if they abut
            ends = (at + count * dim)[live]
            self.view = bool((at[live][1:] == ends[:-1]).all())
        if self.view:
            self.row_base = np.where(live, (at - self.lo) // dim, 0)
            self.hi = int((at + count * dim)[live].max()) if live.any() else 0
            self.rows = (self.hi - self.lo) // dim  # of ``matrix``
        else:
            self.row_base = _starts(count[None])[0]
            self.rows = int(count.sum())

    def matrix(self, buffer: np.ndarray) -> np.ndarray:
        """The rows, float32 ``[rows, dim]``, C-contiguous."""
        if self.view:
            return buffer[self.lo : self.hi].reshape(-1, self.dim)
        return np.concatenate(
            [buffer[a : a + c * self.dim] for a, c in zip(self.at, self.count, strict=True)]
        ).reshape(-1, self.dim)
