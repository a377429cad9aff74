"""EmbeddingEngine: owns the tables and their optimizer state; lookup, then one fused update.

One training step::

    acts = engine.lookup(features)            # validates, deduplicates, gathers and combines
    ...                                       # the dense model computes d loss / d acts
    engine.apply_gradients(grads)             # one fused optimizer update per touched row

Nothing is half-applied: every input, gradient and learning rate is validated before any table
changes. No non-finite value is ever written: a row whose update would give one is left as it
was (see ``EmbeddingEngine``). Calls from several threads are safe (see ``EmbeddingEngine.lock``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .backends.registry import BACKENDS
from .backends.registry import make_backend as _make_backend
from .batch import (
    BatchFingerprint,
    PreparedBatch,
    batch_fingerprint,
    check_prepared_for,
    check_trainable,
    plan_tables,
    prepare,
)
from .config import FeatureConfig, ResolvedFeatures, TableConfig, resolve_features
from .initializers import Initializer, Zeros
from .inputs import as_numpy
from .learning_rates import LearningRates
from .optimizers import Optimizer
from .spec import (
    NONFINITE_POLICIES,
    engine_options,
    feature_configs_from_spec,
    feature_entries,
    initializer_for,
    table_entries,
)
from .state import MAX_STEP, WEIGHTS, PartialLoadError, check_int_slots, check_state
from .storage import StorageError, StoragePlan, make_storage, plan_storage
from .storage.registry import storage_kind

__all__ = ["EmbeddingEngine", "BACKENDS", "NONFINITE_POLICIES", "NonFiniteUpdateError"]

# Rows named by a NonFiniteUpdateError's message (the count is always given in full).
_ROWS_NAMED = 5


class NonFiniteUpdateError(FloatingPointError):
    """An update whose result would be non-finite for some rows although its inputs were finite
    (``nonfinite_gradients="error"``). Those rows were left exactly as they were; every other
    row was updated and the step counted. ``rows``: table name -> ids of the rows left alone."""

    def __init__(self, message: str, rows: dict[str, np.ndarray]):
        super().__init__(message)
        self.rows = rows


class NonFiniteGradientError(ValueError):
    """A gradient holding NaN or Inf given to an update (``nonfinite_gradients="error"``), refused
    before any row changed. A ValueError, as before it had a class of its own: what a training
    loop catches to say that its model diverged (``embengine train``: lower ``--lr``)."""


# Timestamps are ints in [0, 2^62): a difference of two never overflows int64.
_MAX_TIMESTAMP = 1 << 62
# Engine states, numbered across the process: a new engine, a copy (a DataLoader worker's) and
# every load take the next (``PreparedBatch.resolved_in``).
_STATES = itertools.count(1)


def checked_gradient(name: str, value, lay, nonfinite_gradients: str) -> np.ndarray:
    """Feature ``name``'s gradient as float32 ``[rows, dim]`` (``lay``: its FeatureLayout),
    after the checks every engine makes: numbers (a bool, string or complex array is
    refused, not cast), the activation's shape, and finite unless ``nonfinite_gradients``
    is "skip_row"."""
    g = as_numpy(value, f"feature {name!r}: gradient")
    if g.dtype.kind not in "fiu":
        raise TypeError(f"feature {name!r}: gradient must be numbers, got {g.dtype}")
    if g.shape != lay.shape:
        raise ValueError(
            f"feature {name!r}: gradient has shape {tuple(g.shape)}, the activation has "
            f"shape {lay.shape}"
        )
    g = g.astype(np.float32, copy=False).reshape(lay.stop - lay.start, lay.shape[-1])
    if nonfinite_gradients == "error":
        bad = ~np.isfinite(g)
        if bad.any():
            idx = np.unravel_index(int(np.argmax(bad.reshape(-1))), lay.shape)
            raise NonFiniteGradientError(
                f"feature {name!r}: gradient {g.reshape(lay.shape)[idx]} at "
                f"{list(map(int, idx))} is not finite (nonfinite_gradients='error'; "
                "'skip_row' leaves such rows untouched)"
            )
    return g


def _describe_unchanged(unchanged: Mapping[str, np.ndarray]) -> str:
    """``unchanged`` (table -> ids of the rows a step left alone) as the non-finite policy's
    error and warning name them: per table the count and the first ids."""
    parts = []
    for name, rows in unchanged.items():
        ids = ", ".join(str(int(i)) for i in rows[:_ROWS_NAMED])
        more = ", ..." if len(rows) > _ROWS_NAMED else ""
        parts.append(f"table {name!r}: {len(rows)} rows (ids {ids}{more})")
    return "; ".join(parts)


class _TableWeights(dict):
    """``EmbeddingEngine.embedding_tables``: the weights of the tables with rows by id; a keyed
    table's name raises its TypeError (``__missing__``), any other name a KeyError."""

    def __init__(self, views):
        super().__init__({v.name: v.weights for v in views if v.vocabulary_size is not None})
        self._keyed = {v.name: v for v in views if v.vocabulary_size is None}

    def __missing__(self, name: str) -> np.ndarray:
        if name in self._keyed:
            return self._keyed[name].weights  # raises: its rows are not ids
        raise KeyError(name)


# The largest step an int32 slot of steps holds after an update: a FrequencyEstimator's or
# BatchSoftmax's last step seen (``step + 1``), Adam's per-row count of updates.
_INT32_STEPS = 2**31 - 1


def step_bound(resolved, optimizers) -> tuple[int, str] | None:
    """The last step a training step may begin at when a table keeps steps in an int32 slot
    (its optimizer's ``slot_specs``), and which table: None when none does."""
    for name, table, opt in zip(resolved.table_names, resolved.tables, optimizers, strict=True):
        ints = [s.name for s in opt.slot_specs(table.dim) if s.dtype == "int32"]
        if ints:
            what = (
                f"table {name!r} ({type(opt).__name__}) keeps steps in its int32 slot {ints[0]!r}"
            )
            return _INT32_STEPS - 1, what
    return None


def int_slot_ranges(resolved, optimizers, step: int) -> dict[tuple[str, str], tuple]:
    """(table, int32 slot) -> the values it can hold at ``step`` (``state.check_int_slots``)."""
    tables = zip(resolved.table_names, resolved.tables, optimizers, strict=True)
    return {
        (name, s.name): (*bounds, f"what {type(opt).__name__} holds there at step {step:,}")
        for name, table, opt in tables
        for s in opt.slot_specs(table.dim)
        if s.dtype == "int32" and (bounds := opt.int_slot_range(s.name, step)) is not None
    }


def check_step_room(step: int, bound: tuple[int, str] | None = None) -> None:
    """A training step may begin at ``step``: the step it would count to fits int64
    (``MAX_STEP``, what the kernels take, a state holds and a checkpoint stores), and a
    table's int32 slot of steps (``bound``: ``step_bound``) if it has one. A ValueError naming
    the step, before anything changes, when this step would count past either."""
    if bound is not None and step > bound[0]:
        raise ValueError(
            f"{bound[1]}: the engine's step is {step:,}, one more training step would count "
            f"past {_INT32_STEPS:,} (2**31 - 1) there, and wrap silently; nothing was changed. "
            "Train such a table in a new engine, or restore a checkpoint of a smaller step"
        )
    if step >= MAX_STEP:
        raise ValueError(
            f"the engine's step is {step:,} (2**63 - 1), the largest one it can count "
            "(steps are int64, in the kernels and in checkpoints): one more training step "
            "would overflow it; nothing was changed. Restore a checkpoint or load a state "
            "of a smaller step"
        )


def _check_timestamp(t) -> int:
    """A training call's data time: an int of seconds in [0, 2^62)."""
    if isinstance(t, bool) or not isinstance(t, int | np.integer):
        raise TypeError(
            f"timestamp must be an int (seconds of data time, e.g. Unix time), got {t!r}"
        )
    if not 0 <= t < _MAX_TIMESTAMP:
        raise ValueError(f"timestamp must be in [0, 2^62) (seconds of data time), got {t}")
    return int(t)


def close_tables(tables) -> None:
    """``close()`` every table that has one (memory-mapped storage); then the first
    StorageError any raised (a table still viewed stays open; the others close)."""
    errors = []
    for table in tables:
        close = getattr(table, "close", None)
        try:
            if close is not None:
                close()
        except StorageError as e:
            errors.append(e)
    if errors:
        raise errors[0]


def engine_arguments(
    feature_config, optimizer: Optimizer | None, seed, nonfinite_gradients: str, owner: str
) -> tuple[ResolvedFeatures, tuple[Optimizer, ...]]:
    """The arguments every engine front-end (``owner``: its class name) shares, checked: the
    resolved features, and each table's optimizer (its own, else ``optimizer``), in table
    order. Errors name the bad value."""
    resolved = resolve_features(feature_config)
    if optimizer is not None and not isinstance(optimizer, Optimizer):
        raise TypeError(f"optimizer must be an embengine.optimizers.Optimizer, got {optimizer!r}")
    if nonfinite_gradients not in NONFINITE_POLICIES:
        raise ValueError(
            f"nonfinite_gradients must be one of {NONFINITE_POLICIES}, got {nonfinite_gradients!r}"
        )
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise TypeError(f"seed must be an int, got {seed!r}")
    optimizers = []
    for table, name in zip(resolved.tables, resolved.table_names, strict=True):
        opt = table.optimizer if table.optimizer is not None else optimizer
        if opt is None:
            raise ValueError(
                f"table {name!r} has no optimizer and the engine has no global one; "
                f"pass optimizer= to {owner} or to its TableConfig"
            )
        opt.check_dim(table.dim)
        optimizers.append(opt)
    return resolved, tuple(optimizers)


class EmbeddingEngine:
    """Embedding tables with per-table optimizers, updated in place from activation gradients.

    Args:
      feature_config: dict of feature name -> FeatureConfig (or a list of named FeatureConfig).
        Tables are ordered by first appearance and named ``table_{i}`` unless named.
      optimizer: the global optimizer, for tables whose TableConfig has none.
      seed: the initializers' seed; a row's initial value depends only on (seed, table, row id).
      backend: "numba" (default: parallel compiled kernels) or "reference" (NumPy, the oracle
        every faster backend is tested against).
      nonfinite_gradients: "error" (default) raises on a NaN/Inf gradient before any change;
        "skip_row" leaves every row that would receive a non-finite gradient untouched this step
        (warned about and counted as below).
        The same policy governs non-finite *results* (an overflow from finite inputs: a huge
        learning rate, weight decay or per-id weight): a row whose new weights or slots would
        hold a NaN or Inf is left exactly as it was (weights and slots; a row is updated whole
        or not at all), so no non-finite value is ever written. The other rows of the step are
        updated and the step counts; then "error" raises a ``NonFiniteUpdateError`` (a
        FloatingPointError) naming the table, the count and the first ids of the rows left
        alone, and "skip_row" warns (RuntimeWarning) and adds them to
        ``nonfinite_rows_skipped[table]``: every row a step left untouched because of a
        non-finite value, its gradient or its result, counted once (a key without a row, whose
        gradient is dropped anyway, is not). Across rows a step is thus not atomic for results.
      storage: "ram" (default) or "mmap" for every table, or a dict of table name -> either
        (tables not named stay in RAM). "mmap" keeps a table and its slots in a file under
        ``storage_dir`` (``{table}.f32``), so tables bigger than RAM train through the page cache;
        for a keyed table (``vocabulary_size=None``) its rows (kind "keyed-mmap"; its index and
        row metadata stay in RAM). Which tables share storage (low-dimensional packing) and
        where is ``storage_plan``.
        Any kind registered with ``embengine.storage.register_storage_kind`` is accepted too.
      storage_dir: folder of the "mmap" tables' files (required if any table uses "mmap").

    Threads: one engine may be used from several threads. ``lock`` (a reentrant lock) is held
    by every update (from the validation of its gradients to the step's increment), by
    ``save`` for the whole write (a checkpoint holds one step: training threads wait), by
    ``restore`` and ``load_state_dict``, and by lookups while they read the tables (a lookup
    never sees a row mid-update). The batch ``apply_gradients()`` updates by default is the
    one the *calling thread* looked up last for training (evaluation lookups in between leave
    it pending). Hold ``lock`` to read ``state_dict()`` views or ``embedding_tables``
    consistently while other threads train.
    """

    def __init__(
        self,
        feature_config: Mapping[str, FeatureConfig] | Sequence[FeatureConfig] | FeatureConfig,
        optimizer: Optimizer | None = None,
        seed: int = 0,
        backend: str = "numba",
        nonfinite_gradients: str = "error",
        storage: str | Mapping[str, str] = "ram",
        storage_dir: str | os.PathLike | None = None,
    ):
        self._resolved, self._optimizers = engine_arguments(
            feature_config, optimizer, seed, nonfinite_gradients, "EmbeddingEngine"
        )
        self.seed = int(seed)
        self.nonfinite_gradients = nonfinite_gradients
        self._learning_rates = LearningRates(self._optimizers, self._resolved.table_names)
        self._backend = _make_backend(backend)
        for name, table, opt in zip(
            self._resolved.table_names, self._resolved.tables, self._optimizers, strict=True
        ):
            self._backend.check_optimizer(name, opt, table.dim)
        self._storage_plan = plan_storage(self._resolved, self._optimizers, storage, storage_dir)
        self._build_storage()
        self._step = 0
        self._step_bound = step_bound(self._resolved, self._optimizers)
        # The data time of the step under way: (step, timestamp) of its training calls.
        self._step_time: tuple[int, int | None] = (-1, None)
        self.nonfinite_rows_skipped = {name: 0 for name in self._resolved.table_names}
        self._init_threading()

    def _init_threading(self) -> None:
        self.lock = threading.RLock()
        # Each thread's pending training batch, valid while its generation is the engine's
        # (``_forget_pending`` forgets every thread's by starting a new generation).
        self._pending = threading.local()
        self._pending_generation = 0
        self._state_id = next(_STATES)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for key in ("lock", "_pending"):  # neither pickles; a copy starts with none pending
            del state[key]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_threading()

    def _set_pending(self, batch: PreparedBatch | None, given: PreparedBatch | None = None) -> None:
        """Make ``batch`` this thread's pending training batch (None: none); ``given``: the
        PreparedBatch a lookup was given, of which ``batch`` is the looked-up form (its keyed
        rows resolved, ``looked_up_in`` set). That form is also kept by ``given`` (weakly: as
        long as the caller holds ``given``) until an update consumes it, so that
        ``apply_gradients(batch=given)`` after other training lookups (two lookups before
        their updates) updates the rows its lookup resolved rather than resolving its keys a
        second time (counting, touching and admitting them again)."""
        p = self._pending
        if getattr(p, "generation", None) != self._pending_generation:
            p.looked = weakref.WeakKeyDictionary()  # a load forgot every earlier lookup
        elif not hasattr(p, "looked"):
            p.looked = weakref.WeakKeyDictionary()
        p.batch = batch
        p.given = given
        p.generation = self._pending_generation
        if given is not None and batch is not None:
            p.looked[given] = batch

    def _pending_batch(self, given: PreparedBatch | None = None) -> PreparedBatch | None:
        """This thread's pending training batch, unless forgotten since; with ``given``, the
        looked-up form of ``given`` by this thread's last training lookup of it, if no
        update consumed it since (else None)."""
        p = self._pending
        if getattr(p, "generation", None) != self._pending_generation:
            return None
        if given is not None:
            looked = getattr(p, "looked", None)
            return None if looked is None else looked.get(given)
        return getattr(p, "batch", None)

    def _consumed(self, batch: PreparedBatch, given: PreparedBatch | None) -> None:
        """An update consumed ``batch`` (the looked-up form of ``given``, if given): it is no
        longer pending, nor kept by ``given`` (one update per lookup)."""
        p = self._pending
        if getattr(p, "generation", None) != self._pending_generation:
            return
        if batch is getattr(p, "batch", None):
            given = getattr(p, "given", None) if given is None else given
            self._set_pending(None)
        looked = getattr(p, "looked", None)
        if given is not None and looked is not None and looked.get(given) is batch:
            del looked[given]

    def _build_storage(self) -> None:
        """One TableStorage per physical table of ``storage_plan`` (its kind's factory,
        ``storage.registry``: DenseTable for "ram" and "mmap"), its logical tables one after
        another (low-dimensional packing: see embengine.storage.plan); they are then
        deduplicated, looked up and updated by one kernel call each. Results do not change:
        rows are independent and initial values depend on the table's own row ids."""
        r = self._resolved
        index = {name: t for t, name in enumerate(r.table_names)}
        physical, views, members = [], [None] * len(r.table_names), []
        for spec in self._storage_plan.physical_tables:
            ts = tuple(index[m.name] for m in spec.tables)
            segments = [
                (
                    m.name,
                    m.row_offset,
                    m.vocabulary_size,
                    initializer_for(r.tables[t], self._optimizers[t]),
                )
                for m, t in zip(spec.tables, ts, strict=True)
            ]
            table = make_storage(
                spec, self._optimizers[ts[0]].slot_specs(spec.dim), segments, self.seed
            )
            # Batches resolve such a kind's rows from the plan: the storage must agree.
            offsets = tuple(m.row_offset for m in spec.tables)
            if storage_kind(spec.storage).row_ids and table.row_bases != offsets:
                raise ValueError(
                    f"storage kind {spec.storage!r} says its rows are ids (row_ids=True), but "
                    f"table {spec.name!r} gives row_bases {table.row_bases}, not the plan's row "
                    f"offsets {offsets}"
                )
            for i, t in enumerate(ts):
                views[t] = table.view(i)
            physical.append(table)
            members.append(ts)
        self._physical = tuple(physical)
        self._physical_members = tuple(members)  # table indices, per physical table
        # Storages with the protocol's optional step hooks (keyed tables); none for DenseTables.
        self._timed = tuple(t for t in physical if hasattr(t, "begin_step"))
        self._update_rows = any(hasattr(t, "rows_for_update") for t in physical)
        self._storage_layout = self._storage_plan.storage_layout()
        self._tables = tuple(views)
        # Members share one quantization (the plan packs only equal ones).
        self._physical_quantizations = [r.tables[ts[0]].quantization_config for ts in members]

    @property
    def storage_plan(self) -> StoragePlan:
        """Which tables share which physical table, at which row, in RAM or in which file: a
        frozen ``embengine.storage.StoragePlan`` (``to_json()`` gives it as JSON)."""
        return self._storage_plan

    # -- configuration ---------------------------------------------------------------------------

    @property
    def feature_config(self) -> dict[str, FeatureConfig]:
        return dict(self._resolved.features)

    @property
    def table_configs(self) -> dict[str, TableConfig]:
        return dict(zip(self._resolved.table_names, self._resolved.tables, strict=True))

    @property
    def table_names(self) -> tuple[str, ...]:
        return self._resolved.table_names

    def optimizer(self, table_name: str) -> Optimizer:
        return self._optimizers[self._table_index(table_name)]

    @property
    def backend(self) -> str:
        return self._backend.name

    @property
    def num_learning_rate_tags(self) -> int:
        return self._learning_rates.num_tags

    def learning_rate_tag(self, table_name: str) -> int | None:
        """The dynamic learning-rate tag of a table, or None for a constant rate."""
        return self._learning_rates.tag_of(self._table_index(table_name))

    # -- state -----------------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Number of apply_gradients calls so far (the 0-based index of the next step)."""
        return self._step

    def close(self) -> None:
        """Release the tables' files (``storage="mmap"``, keyed tables in ``storage_dir``):
        flush and unmap them, which frees their locks, so another engine or process may open
        the same ``storage_dir``. A lookup or update of such a table afterwards raises
        StorageError naming it; tables in RAM are not affected. Calling it again is a no-op;
        ``with EmbeddingEngine(...) as engine:`` closes at the end of the block.

        A table whose memory arrays still view (``embedding_tables``, ``slots()``) stays
        open: every other table is closed, then the StorageError of the first such table is
        raised (drop the arrays and call close() again)."""
        with self.lock:
            close_tables(self._physical)

    def __enter__(self) -> EmbeddingEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def storage_bytes(self) -> int:
        """Bytes of every table with its optimizer slots (what RAM or the mmap files hold)."""
        return sum(t.nbytes for t in self._physical)

    @property
    def embedding_tables(self) -> dict[str, np.ndarray]:
        """Table name -> live ``[vocabulary_size, dim]`` view of the weights, in the stored
        dtype (``TableConfig.weights_dtype``: float32 unless the table is 16-bit). A keyed
        table has no rows by id, so it is not in it: asking for its name raises TypeError
        (read it with ``table_contents``)."""
        return _TableWeights(self._tables)

    def slots(self, table_name: str) -> dict[str, np.ndarray]:
        """Slot name (TF's names) -> live view of that table's optimizer state."""
        return self._tables[self._table_index(table_name)].slots

    def sequential_access(self, table_name: str) -> contextlib.AbstractContextManager:
        """For the block, advise a memory-mapped table's file for one pass in row order (reading
        or writing the whole table, as a checkpoint does): the kernel then reads ahead, which
        training's random row accesses turn off. Nothing for a RAM table."""
        return self._tables[self._table_index(table_name)].sequential_access()

    def flush(self) -> None:
        """Write the memory-mapped tables' changes to their files (msync); nothing in RAM."""
        for table in self._physical:
            table.flush()

    # -- the state API: spec, state_dict, load_state_dict ----------------------------------------
    # Checkpoints, serving export and the adapters use these, never the engine's private fields.

    def spec(self) -> dict[str, Any]:
        """The engine's configuration as JSON (see embengine.spec for the keys): every table
        with its initializer, optimizer, quantization, storage and slots, every feature, the
        learning-rate tags, seed, backend and non-finite policy. ``from_spec`` rebuilds the
        engine from it; a checkpoint's manifest is this plus the checkpoint's own keys."""
        r = self._resolved
        tables = table_entries(
            r,
            self._optimizers,
            self._learning_rates,
            [view.storage for view in self._tables],
            [view.slot_specs for view in self._tables],
        )
        features = feature_entries(r)
        # Checkpoints store the plan too (their manifest is the spec plus their own keys), for
        # inspect; from_spec plans storage anew (where a table lives is the machine's business).
        return {
            "tables": tables,
            "features": features,
            "storage_plan": self.storage_plan.to_json(),
            "learning_rate_tags": self._learning_rate_tags(),
            "seed": self.seed,
            "backend": self.backend,
            "nonfinite_gradients": self.nonfinite_gradients,
        }

    @classmethod
    def from_spec(
        cls,
        spec: Mapping[str, Any],
        callables: Mapping[int, Callable] | None = None,
        *,
        initializers: Mapping[str, Initializer] | None = None,
        **overrides,
    ) -> EmbeddingEngine:
        """A new engine with the configuration ``spec`` describes (``engine.spec()``, or a
        checkpoint's; tables initialised anew: ``load_state_dict`` fills them).

        What a spec names but cannot hold must be passed: ``callables={tag: fn}`` for each
        learning rate that was a callable, ``initializers={table: Initializer}`` for each table
        whose initializer was ``FromFunction``. ``overrides`` (backend, storage, storage_dir,
        seed, nonfinite_gradients) replace or add EmbeddingEngine arguments; tables are in RAM
        unless ``storage=`` says otherwise (where a table was kept is the machine's business).
        A SpecError (a ValueError) names the entry of a spec that cannot be rebuilt."""
        features = feature_configs_from_spec(spec, callables, initializers)
        return cls(features, **{**engine_options(spec), **overrides})

    def state_dict(self, lazy: bool = False) -> dict[str, Any]:
        """The engine's state (see embengine.state): ``{"step": int, "learning_rates": {"tags":
        [...]}, "tables": {table name: {"weights": array, slot name: array, ...}}}``, keyed by
        logical table and row (a packed table's rows are its own, from 0).

        The arrays are live views of the tables, not copies: they change with every update and
        writing into them changes the engine (a keyed table's are copies, taken together). Read
        them while no update runs (``save`` holds the engine's lock while it writes them);
        ``copy.deepcopy(state)`` for a snapshot. ``lazy=True``: a keyed table's per-key entries
        but its keys are ``embengine.state.GatheredRows``, gathered in key order when read, so
        writing them takes a chunk of memory, not a copy of the table (what ``save`` does);
        read them under ``lock``, before the table changes."""
        # A keyed table's entry is a snapshot (its keys and metadata; see embengine.state).
        return {
            "step": self._step,
            "learning_rates": {"tags": self._learning_rate_tags()},
            "tables": {
                v.name: v.state(lazy) if hasattr(v, "state") else {WEIGHTS: v.weights, **v.slots}
                for v in self._tables
            },
        }

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Copy a state (``state_dict()``'s layout, arrays or ``TensorSource``s) into the
        engine's tables and set the step.

        Every entry is checked first (names, shapes, dtypes, and the values of int32 step
        counters: ``Optimizer.int_slot_range``, such a slot read whole; TypeError / ValueError
        naming the entry), so a state that does not fit changes nothing. Whether values are
        finite is the caller's business. ``strict`` requires every table, each of its arrays and
        the step; ``strict=False`` leaves what the state lacks as it is (unknown names are
        errors either way). The copy runs under the engine's lock and forgets the pending
        training batch (its gradients came from the tables before). A keyed table makes room for
        its state before any table changes: if the system refuses it (a full disk, no memory),
        the OSError / MemoryError names the table and nothing changed. If a TensorSource fails
        midway, a ``PartialLoadError`` says which tables hold the new values; the step is
        unchanged, the pending training batch forgotten (its rows may be other keys' now)."""
        expected = {
            v.name: v.state_entries()
            if hasattr(v, "state_entries")
            else {
                WEIGHTS: (tuple(v.weights.shape), v.weights.dtype),
                **{
                    s.name: ((v.vocabulary_size, s.width), v.slot(s.name).dtype)
                    for s in v.slot_specs
                },
            }
            for v in self._tables
        }
        tag_is_callable = [
            self._learning_rates.tag_callable(t) is not None
            for t in range(self.num_learning_rate_tags)
        ]
        step, copies = check_state(state, expected, tag_is_callable, strict)
        views = {v.name: v for v in self._tables}
        # Everything is checked; from here on tables change.
        with self._state_lock():
            # Keyed tables' keys and metadata are read and checked first (a ValueError changes
            # nothing), and make their room (a refused growth: OSError / MemoryError, nothing
            # changed); installed in their turn, their rows are read into the new arena.
            now = self._step if step is None else step
            ranges = int_slot_ranges(self._resolved, self._optimizers, now)
            copies = check_int_slots(copies, ranges)
            installs = {
                name: views[name].prepare_state(dict(pairs), now, f"state['tables'][{name!r}]")
                for name, pairs in copies
                if hasattr(views[name], "prepare_state")
            }
            done: list[str] = []
            for name, pairs in copies:
                view = views[name]
                try:
                    if name in installs:
                        installs[name]()
                    else:
                        with view.sequential_access():
                            for key, value in pairs:
                                out = view.weights if key == WEIGHTS else view.slot(key)
                                if isinstance(value, np.ndarray):
                                    np.copyto(out, value)
                                else:
                                    value.read_into(out)  # a TensorSource: chunk by chunk
                            view.flush()
                # MemoryError too (a read's buffer): an OSError or MemoryError that leaves
                # this method always means nothing changed
                except (OSError, ValueError, MemoryError) as e:
                    # the tables changed: a batch looked up before must not update them
                    self._forget_pending()
                    raise PartialLoadError(name, done, self._step, e) from e
                done.append(name)
            if step is not None:
                self._step = step
            self._step_time = (-1, None)  # a new step's calls bring their data time
            self._forget_pending()

    def _learning_rate_tags(self) -> list[dict[str, Any]]:
        """Each dynamic learning-rate tag, with the name of the callable behind it (or None)."""
        out = []
        for t in range(self.num_learning_rate_tags):
            fn = self._learning_rates.tag_callable(t)
            out.append(
                {"tag": t, "callable": None if fn is None else getattr(fn, "__qualname__", "?")}
            )
        return out

    def _state_lock(self) -> contextlib.AbstractContextManager:
        """The lock load_state_dict holds while it copies: the engine's ``lock`` (the one
        apply_gradients, save, restore and the lookups hold)."""
        return self.lock

    def _forget_pending(self) -> None:
        """Forget every thread's pending training batch: after a load its gradients would update
        rows that no longer hold what it looked up."""
        with self.lock:
            self._pending_generation += 1
            self._state_id = next(_STATES)  # keyed rows resolved before are refused

    # -- checkpoints -----------------------------------------------------------------------------

    def save(
        self,
        path,
        keep: int | None = None,
        extra_tensors: Mapping | None = None,
        extra_metadata: Mapping | None = None,
    ):
        """Write a checkpoint (tables, slots, step, every config) under the folder ``path``:
        atomically, as ``path/ckpt-<n>-step<step>/``, keeping the newest ``keep`` (all if None).
        ``extra_tensors`` (name -> array) and JSON ``extra_metadata`` are stored beside it.
        Returns the checkpoint's directory. See embengine.checkpoint. A ValueError, nothing
        written, between a training lookup and its update when a keyed table took that lookup
        (its counts and new rows are half a step no restore could finish)."""
        from . import checkpoint

        # Under the lock for the whole write: every table of the checkpoint is of one step.
        with self.lock:
            halfway = [
                t.name
                for t in self._physical
                if hasattr(t, "looked_up_in") and t.looked_up_in(self._step)
            ]
            if halfway:
                raise ValueError(
                    f"step {self._step} has been looked up for training but not applied: keyed "
                    f"table(s) {halfway} already counted its keys and gave new keys rows, so a "
                    "checkpoint now holds half a step that no restore can finish (looking the "
                    "batch up again would count it twice); nothing was written. Save after "
                    "apply_gradients"
                )
            return checkpoint.save(self, path, keep, extra_tensors, extra_metadata)

    def restore(self, path, verify: bool = True):
        """Load a checkpoint (``path``: a checkpoint directory, or a folder of them: the newest)
        into this engine, built from the same configs; a table whose shape or optimizer differs
        is an error naming it. Returns a CheckpointInfo with the step and extra data."""
        from . import checkpoint

        with self.lock:
            return checkpoint.restore(self, path, verify)

    @classmethod
    def load(
        cls,
        path,
        callables=None,
        verify: bool = True,
        *,
        initializers: Mapping[str, Initializer] | None = None,
        **kwargs,
    ) -> EmbeddingEngine:
        """A new engine from a checkpoint alone. A learning rate that was a callable is not
        stored: pass ``callables={tag: function}`` for it; nor is a ``FromFunction``
        initializer's function: a keyed table's new keys need it (``initializers={table:
        Initializer}``; without it loading such a table is a CheckpointError naming it), a
        dense table's rows all come from the checkpoint (zeros until then). ``kwargs``
        (backend, storage, ...) override the stored engine options.

        ``from_spec`` of the checkpoint's spec, then its restore. Every check of the checkpoint
        passes before the engine is built, so its tables are never larger than the files that
        fill them."""
        from . import checkpoint

        spec, reader = checkpoint.read_checkpoint(path, verify)
        with reader:  # kept (a save's keep=N does not prune it) until restored
            given = dict(initializers or {})
            from_function = [
                t for t in spec["tables"] if t["initializer"]["class"] == "FromFunction"
            ]
            for t in from_function:
                if t["name"] not in given and t.get("vocabulary_size") is None:
                    raise checkpoint.CheckpointError(
                        f"{reader.path}: table {t['name']!r} is keyed and its initializer "
                        "(FromFunction) is not stored, and its new keys need it: pass "
                        f"EmbeddingEngine.load(..., initializers={{{t['name']!r}: ...}})"
                    )
            # A dense table's values all come from the checkpoint: zeros until then.
            given = {**{t["name"]: Zeros() for t in from_function}, **given}
            try:
                engine = cls.from_spec(spec, callables, initializers=given, **kwargs)
            except (TypeError, ValueError) as e:
                with_kwargs = f" with {kwargs}" if kwargs else ""
                raise checkpoint.CheckpointError(
                    f"{reader.path}: cannot build an engine from the checkpoint's configuration"
                    f"{with_kwargs}: {e}"
                ) from e
            reader.restore(engine)
        return engine

    def _table_index(self, table_name: str) -> int:
        try:
            return self._resolved.table_names.index(table_name)
        except ValueError:
            raise KeyError(
                f"no table named {table_name!r}; tables are {list(self._resolved.table_names)}"
            ) from None

    # -- a step ----------------------------------------------------------------------------------

    def preprocess(
        self, features: Mapping, weights: Mapping | None = None, *, training: bool = True
    ) -> PreparedBatch:
        """Validate features and deduplicate ids per table. Pure: reads no table state.

        ``training=False`` skips the deduplication, which only the update needs: the batch can
        be looked up (evaluation, inference) but not passed to ``apply_gradients``."""
        return self._prepare(features, weights, training)

    def _prepare(self, features, weights, training: bool, check_ids: bool = True):
        """``preprocess``; ``check_ids=False`` leaves a lookup-only batch's ids unchecked (a
        backend that checks them while pooling: ``Backend.checks_lookup_ids``)."""
        return prepare(
            self._resolved,
            features,
            weights,
            self._backend.build_tables,
            self._storage_layout,
            deduplicate=training,
            fingerprint=self._batch_fingerprint(),
            check_ids=check_ids,
        )

    def lookup(
        self,
        features: Mapping | PreparedBatch,
        weights: Mapping | None = None,
        *,
        training: bool = True,
        timestamp: int | None = None,
    ) -> dict[str, np.ndarray]:
        """Activations per feature, float32 ``[*shape, dim]``.

        With ``training=True`` the batch is remembered (for the calling thread) so that its next
        ``apply_gradients`` updates its rows. ``training=False`` (evaluation, inference) skips
        the deduplication the update needs and is read-only: it changes no table (a keyed
        table's keys are neither inserted, admitted, counted nor refreshed) and leaves the
        thread's pending training batch as it was, so a validation lookup between a training
        lookup and its ``apply_gradients`` does not change that update (bit for bit). An
        evaluation batch itself is never pending: ``apply_gradients`` without ``batch=``
        updates the thread's last *training* lookup.

        Given features (not a PreparedBatch), a training lookup on the numba backend builds the
        deduplication data and pools the activations in one parallel region: the pooling reads
        rows straight from the ids meanwhile (the same bits as pooling the prepared batch), so
        a single big table is not deduplicated by one thread while the others wait.

        ``timestamp`` (training only): the data time of the batch's examples, an int of
        seconds (e.g. Unix time), for keyed tables that expire rows by data time
        (``DynamicVocabulary.expire_seconds``); the step's update takes it too."""
        return self._lookup(features, weights, training, timestamp)[0]

    def lookup_with_batch(
        self,
        features: Mapping | PreparedBatch,
        weights: Mapping | None = None,
        *,
        training: bool = True,
        timestamp: int | None = None,
    ) -> tuple[dict[str, np.ndarray], PreparedBatch]:
        """``lookup``, and the PreparedBatch it looked up, for adapters that apply the gradients
        later with ``apply_gradients(grads, batch=batch)`` (EmbeddingLayer's backward): reading
        the engine's pending batch after the lookup could see another thread's lookup. A
        training batch is also left pending, as ``lookup`` leaves it."""
        return self._lookup(features, weights, training, timestamp)

    def _lookup(
        self,
        features: Mapping | PreparedBatch,
        weights: Mapping | None,
        training: bool,
        timestamp: int | None = None,
    ) -> tuple[dict[str, np.ndarray], PreparedBatch]:
        """``lookup``, and the batch it looked up (EmbeddingLayer keeps it for its backward:
        reading the engine's pending batch afterwards could see another thread's)."""
        per_table = None  # each table's activation matrix
        resolve = False  # a prepared batch's rows, resolved under the lock with its pooling
        if timestamp is not None:
            if not training:
                raise ValueError(
                    "timestamp is the data time of a training batch; an evaluation lookup "
                    "(training=False) changes nothing and sees each table at its data time"
                )
            timestamp = _check_timestamp(timestamp)
        if isinstance(features, PreparedBatch):
            if weights is not None:
                raise ValueError("weights must be given to preprocess(), not with a PreparedBatch")
            batch = features
            self._check_batch(batch)
            if training and not batch.deduplicated:
                raise ValueError(
                    "this PreparedBatch was built with training=False (no deduplication): look it "
                    "up with lookup(batch, training=False), or build it with preprocess(features) "
                    "to train on it"
                )
            if training:
                check_trainable(batch)
            resolve = batch.deduplicated
        elif training:
            # Deduplication and pooling in one call (numba: one parallel region, in
            # kernels/train_lookup.py; the reference backend builds the batch, then pools it).
            parts, layouts = plan_tables(self._resolved, features, weights, self._storage_layout)
            with self.lock:  # the pooling reads the tables
                self._check_step_room()
                self._begin_step(timestamp, training=True)
                tables, per_table = self._backend.build_tables_and_lookup(
                    parts, self._physical, self._quantizations()
                )
                self._end_call()
                batch = PreparedBatch(
                    tuple(tables),
                    layouts,
                    fingerprint=self._batch_fingerprint(),
                    resolved_in=self._resolved_in(),
                    looked_up_in=self._state_id,
                )
                self._set_pending(batch)
        else:  # lookup-only; a backend that range-checks ids as it pools them checks them
            checks = getattr(self._backend, "checks_lookup_ids", False)
            batch = self._prepare(features, weights, training=False, check_ids=not checks)
        if per_table is None:
            with self.lock:  # pending set with the read: a load in between forgets it
                if training:
                    self._check_step_room()
                self._begin_step(timestamp, training=training and resolve)
                if resolve:  # a keyed table's rows change with every training resolution
                    batch = self._resolve(batch, insert=training, again=True)
                    self._end_call()
                if training:
                    batch = dataclasses.replace(batch, looked_up_in=self._state_id)
                per_table = self._backend.lookup_tables(
                    list(self._physical), list(batch.tables), self._quantizations()
                )
                if training:  # an evaluation lookup leaves the pending batch alone
                    given = features if isinstance(features, PreparedBatch) else None
                    self._set_pending(batch, given=given)
        acts = {
            name: per_table[lay.table][lay.start : lay.stop].reshape(lay.shape)
            for name, lay in batch.features.items()
        }
        return acts, batch

    def _resolve(
        self, batch: PreparedBatch, insert: bool, update: bool = False, again: bool = False
    ) -> PreparedBatch:
        """``batch`` with every table's rows resolved: a storage that maps ids to rows itself
        (no ``row_bases``; the batch left its rows to the engine) gets one ``rows_for`` per
        logical table on its unique ids. The same batch if nothing is left to resolve.
        ``update``: its update follows (``_for_update``), checked with the resolution.
        ``again``: a lookup of the batch, whose rows such a storage resolves anew even if an
        earlier lookup resolved them: a key's row may have been evicted and given to another
        key since, and a training lookup counts and touches its keys each time."""
        if batch.resolved_in is not None and batch.resolved_in != self._state_id:
            raise ValueError(
                "this batch's keyed rows were resolved in another state of the engine (before "
                "a load_state_dict or restore, or by another engine): they may hold other keys "
                "now; nothing was changed. Look its features up again"
            )
        if again:
            batch = dataclasses.replace(
                batch,
                tables=tuple(
                    tb if table.row_bases is not None else dataclasses.replace(tb, unique_rows=None)
                    for table, tb in zip(self._physical, batch.tables, strict=True)
                ),
            )
        if all(tb.unique_rows is not None for tb in batch.tables):
            return batch
        if insert:  # a batch one table refuses changes no table
            for table, tb in zip(self._physical, batch.tables, strict=True):
                tb.check_resolvable(table, update=update)
        tables = tuple(
            tb if tb.unique_rows is not None else tb.resolved(table, insert)
            for table, tb in zip(self._physical, batch.tables, strict=True)
        )
        return dataclasses.replace(batch, tables=tables, resolved_in=self._resolved_in())

    def _resolved_in(self) -> int | None:
        """``PreparedBatch.resolved_in`` of a batch resolved now: this state, if a storage maps
        ids to rows itself (keyed tables), else None (rows that are ids stay valid)."""
        return self._state_id if any(t.row_bases is None for t in self._physical) else None

    def _begin_step(self, timestamp: int | None = None, training: bool = False) -> None:
        """Tell the storages that keep time (keyed tables: expiry, recency) the step, and a
        training call its data time: its ``timestamp`` (checked), else its step's (an earlier
        call of the step carried one). A table that expires by data time and gets none is a
        ValueError naming it, before anything changes."""
        if not self._timed:
            return
        if training and timestamp is None and self._step_time[0] == self._step:
            timestamp = self._step_time[1]
        if training and timestamp is None:
            for table in self._timed:
                if getattr(table, "needs_timestamp", False):
                    raise ValueError(
                        f"table {table.name!r} expires rows by data time (DynamicVocabulary."
                        f"expire_seconds={table.dynamic.expire_seconds}): pass the batch's time "
                        f"as lookup(..., timestamp=seconds) (or apply_gradients(..., "
                        "timestamp=)); without timestamps use expire_steps. Nothing was changed"
                    )
        self._call_time = timestamp if training else None
        for table in self._timed:
            if self._call_time is None:
                table.begin_step(self._step)
            else:
                table.begin_step(self._step, timestamp=self._call_time)

    def _end_call(self) -> None:
        """A training call that carried a data time succeeded: the rest of its step (its
        update) has that time unless it brings its own."""
        t = self.__dict__.pop("_call_time", None)
        if t is not None:
            prev = self._step_time[1] if self._step_time[0] == self._step else None
            self._step_time = (self._step, t if prev is None else max(prev, t))

    def _for_update(self, batch: PreparedBatch) -> PreparedBatch:
        """``batch`` with the rows its update writes (``TableBatch.for_update``: a keyed table
        with ``insert_on="apply"`` gives its admitted new keys rows now)."""
        if not self._update_rows:
            return batch
        for table, tb in zip(self._physical, batch.tables, strict=True):
            tb.check_for_update(table)  # a batch one table refuses changes no table
        tables = tuple(
            tb.for_update(table) for table, tb in zip(self._physical, batch.tables, strict=True)
        )
        if all(a is b for a, b in zip(tables, batch.tables, strict=True)):
            return batch
        return dataclasses.replace(batch, tables=tables)

    # -- observability ---------------------------------------------------------------------------

    def table_stats(self) -> dict[str, dict[str, Any]]:
        """Per table: a keyed table's ``KeyedTable.stats()`` (rows, capacity, load factor,
        bytes of index, rows, metadata and pending counts, admitted / filtered / evicted /
        expired this step and in total, hit rate); a dense table's rows (its vocabulary),
        capacity, load factor 1 and bytes of its rows (a packed table: its share)."""
        out = {}
        with self.lock:
            for table, members in zip(self._physical, self._physical_members, strict=True):
                stats = getattr(table, "stats", None)
                for t in members:
                    name = self._resolved.table_names[t]
                    if stats is not None:
                        out[name] = stats()
                        continue
                    rows = self._tables[t].vocabulary_size
                    out[name] = {
                        "kind": table.storage,
                        "rows": rows,
                        "capacity": rows,
                        "load_factor": 1.0,
                        # row_width counts the array's units: uint16 in a 16-bit table
                        "bytes": {"rows": rows * table.row_width * table.data.itemsize},
                    }
        return out

    def table_contents(self, table_name: str) -> dict[str, np.ndarray]:
        """A table's rows by key: ``keys`` (int64, sorted), ``weights`` and one array per slot,
        aligned with ``keys`` (copies). A keyed table's keys are those with rows; a dense
        table's are ``0 .. vocabulary_size - 1``."""
        t = self._table_index(table_name)
        with self.lock:
            view = self._tables[t]
            p = next(p for p, m in enumerate(self._physical_members) if t in m)
            contents = getattr(self._physical[p], "contents", None)
            if contents is not None:
                return contents()
            out = {
                "keys": np.arange(view.vocabulary_size, dtype=np.int64),
                "weights": np.array(view.weights),
            }
            for name, a in view.slots.items():
                out[name] = np.array(a)
            return out

    def _quantizations(self) -> list:
        """Each storage table's QuantizationConfig (None: none); packed tables share one."""
        return self._physical_quantizations

    def apply_gradients(
        self,
        gradients: Mapping,
        learning_rates: Sequence[float] | None = None,
        batch: PreparedBatch | None = None,
        *,
        timestamp: int | None = None,
    ) -> None:
        """Apply one optimizer step from the gradients of the activations of ``batch`` (default:
        the calling thread's last training lookup's).

        Args:
          gradients: feature name -> gradient of the loss w.r.t. that feature's activation, same
            shape. Every feature of the batch needs one.
          learning_rates: one value per dynamic learning-rate tag (see ``learning_rates``);
            required when a table uses ``DynamicLearningRate``, else an override of callables.
          batch: the PreparedBatch whose rows to update. One that this thread looked up for
            training (``lookup(batch)``) updates the rows that lookup resolved, even after
            other training lookups (two lookups before their updates): its keyed rows are
            not resolved again; one never looked up is resolved now.
          timestamp: the data time of the batch's examples (``lookup``'s); by default the
            step's lookup's. Keyed tables with ``DynamicVocabulary.expire_seconds`` need one.

        Runs under ``lock``. Gradients and every table's learning rate (``Optimizer.
        check_learning_rate``) are validated before any table changes. A row whose result
        would be non-finite is left as it was; see the class docstring for the policy.
        """
        with self.lock:
            self._check_step_room()
            implicit = batch is None
            if implicit:
                batch = self._pending_batch()
                if batch is None:
                    raise ValueError(
                        "apply_gradients needs a lookup(..., training=True) first (or batch=): "
                        "there is no batch whose rows to update"
                    )
            else:
                self._check_batch(batch)
                # The batch lookup(batch) looked up: the form it looked up (its keyed rows,
                # resolved then), which this update consumes, even if other training lookups
                # came since.
                given = batch
                batch = self._pending_batch(given=batch) or batch
            if not batch.deduplicated:
                raise ValueError(
                    "this PreparedBatch was built with training=False (no deduplication) and can "
                    "only be looked up; build it with preprocess(features) to apply gradients"
                )
            check_trainable(batch)
            stale = batch.looked_up_in not in (None, self._state_id)
            # (A keyed batch's rows from another state: _resolve's error says more.)
            if stale and batch.resolved_in in (None, self._state_id):
                raise ValueError(
                    "this batch was looked up before a load_state_dict or restore (or by "
                    "another engine): its gradients are of the tables as they were then; "
                    "nothing was changed. Look its features up again"
                )
            grads = self._check_gradients(gradients, batch)
            lrs = self._learning_rates.resolve(self._step, learning_rates)
            self._check_learning_rates(lrs)
            if timestamp is not None:
                timestamp = _check_timestamp(timestamp)
            pending = batch
            self._begin_step(timestamp, training=True)
            batch = self._resolve(batch, insert=True, update=True)  # one never looked up
            batch = self._for_update(batch)  # keyed tables inserting on apply: their new rows
            self._end_call()
            # Everything is validated; from here on tables change.
            unchanged = self._update(batch, grads, lrs)
            self._step += 1
            self._consumed(pending, None if implicit else given)  # one update per lookup
            if unchanged:
                self._report_unchanged(unchanged)

    def _check_step_room(self) -> None:
        check_step_room(self._step, self._step_bound)

    def _check_learning_rates(self, lrs: Sequence[float]) -> None:
        """Each table's learning rate for this step, by its optimizer's rule (e.g. FTRL needs
        lr > 0): a ValueError naming the table, its tag and the step, before any change."""
        for t, (opt, lr) in enumerate(zip(self._optimizers, lrs, strict=True)):
            try:
                opt.check_learning_rate(lr)
            except ValueError as e:
                tag = self._learning_rates.tag_of(t)
                source = "constant learning rate" if tag is None else f"learning-rate tag {tag}"
                raise ValueError(
                    f"table {self.table_names[t]!r} ({source}), step {self._step}: {e}; "
                    "nothing was updated"
                ) from None

    def _update(self, batch: PreparedBatch, grads: dict, lrs: Sequence[float]) -> dict:
        """Update every physical table; logical table name -> ids of rows left unchanged
        because their result, or under "skip_row" their gradient, was not finite (tables
        without such rows are absent)."""
        skip = self.nonfinite_gradients == "skip_row"
        unchanged: dict[str, np.ndarray] = {}
        # Last table first: the rows the lookup touched last are the likeliest still in cache.
        order = list(reversed(range(len(self._physical))))
        updates = []
        with contextlib.ExitStack() as sweeps:
            for p in order:
                table, tb = self._physical[p], batch.tables[p]
                first = self._physical_members[p][0]  # members share optimizer and learning rate
                names = [f for f, _ in self._storage_layout[p]]
                if len(names) == 1:
                    g = grads[names[0]]
                elif names:
                    g = np.concatenate([grads[n] for n in names], axis=0)
                else:
                    g = np.zeros((0, table.dim), dtype=np.float32)
                opt = self._optimizers[first]
                if opt.updates_every_row:
                    # It sweeps the table in order: let a memory-mapped table read ahead for it
                    # (training's random accesses otherwise read only their pages).
                    sweeps.enter_context(table.sequential_access())
                updates.append((table, tb, g, opt, lrs[first], self._step, skip))
            # Every table's update in one call: the backend may run them on the same threads.
            left = self._backend.apply_tables(updates)
        for p, rows in zip(order, left, strict=True):
            if rows is not None and len(rows):
                self._unchanged_ids(p, batch.tables[p], rows, unchanged)
        return unchanged

    def _unchanged_ids(self, p: int, tb, rows: np.ndarray, out: dict) -> None:
        """Physical table ``p``'s ``rows`` -> each logical table's ids, added to ``out``: a row
        of the batch by its unique id; one it did not touch (an every-row sweep) through the
        storage's ``row_bases`` (a storage without them: named by row, under the physical
        table's name with a " rows" suffix)."""
        where = np.full(len(rows), -1, dtype=np.int64)  # rows' position in tb.unique_rows
        order = np.argsort(tb.unique_rows, kind="stable")
        at = np.searchsorted(tb.unique_rows, rows, sorter=order)
        at = np.minimum(at, max(len(order) - 1, 0))
        if len(order):
            hit = tb.unique_rows[order[at]] == rows
            where[hit] = order[at[hit]]
        bases = self._physical[p].row_bases
        members = self._physical_members[p]
        for k, t in enumerate(members):
            name = self._tables[t].name
            lo, hi = tb.unique_bounds[k], tb.unique_bounds[k + 1]
            in_batch = (where >= lo) & (where < hi)
            ids = [tb.unique_ids[where[in_batch]]]
            if bases is not None:
                size = self._tables[t].vocabulary_size
                rest = rows[(where < 0) & (rows >= bases[k]) & (rows < bases[k] + size)]
                ids.append(rest - bases[k])
            ids = np.concatenate(ids)
            if len(ids):
                out[name] = np.sort(ids)
        if bases is None and (where < 0).any():
            out[f"{self._physical[p].name} rows"] = np.sort(rows[where < 0])

    def _report_unchanged(self, unchanged: dict[str, np.ndarray]) -> None:
        """The non-finite-result policy, once the step is done (see the class docstring)."""
        what = _describe_unchanged(unchanged)
        step = self._step - 1
        if self.nonfinite_gradients == "error":
            raise NonFiniteUpdateError(
                f"step {step}: the update would have written non-finite values (NaN/Inf from "
                f"finite inputs: check learning rates, weight decay and per-id weights) into "
                f"{what}; those rows were left unchanged, every other row was updated and the "
                "step counted (nonfinite_gradients='error'; 'skip_row' warns instead)",
                unchanged,
            )
        for name, rows in unchanged.items():
            if name in self.nonfinite_rows_skipped:
                self.nonfinite_rows_skipped[name] += len(rows)
        warnings.warn(
            f"step {step}: rows left unchanged because their gradient or update was not "
            f"finite: {what} "
            "(nonfinite_gradients='skip_row'; counted in engine.nonfinite_rows_skipped)",
            RuntimeWarning,
            stacklevel=3,
        )

    def _batch_fingerprint(self) -> BatchFingerprint:
        """What this engine's batches are prepared for (computed once: configs and the storage
        layout do not change)."""
        fp = self.__dict__.get("_fingerprint")
        if fp is None:
            fp = self._fingerprint = batch_fingerprint(self._resolved, self._storage_layout)
        return fp

    def _check_batch(self, batch: PreparedBatch) -> None:
        """Only a batch prepared for this engine's fingerprint (the same features, tables and
        storage layout: this engine, or a copy of it in a DataLoader worker) may reach the
        kernels, which index the tables with its ids unchecked (see batch.check_prepared_for)."""
        if not isinstance(batch, PreparedBatch):
            raise TypeError(f"batch must be a PreparedBatch, got {type(batch).__name__}")
        check_prepared_for(batch, self._batch_fingerprint(), self._resolved)

    def _check_gradients(self, gradients: Mapping, batch: PreparedBatch) -> dict[str, np.ndarray]:
        """Gradient per feature as float32 ``[rows, dim]``, after every check."""
        if not isinstance(gradients, Mapping):
            raise TypeError(
                f"gradients must be a dict of feature name -> array, got {type(gradients)}"
            )
        missing = [f for f in batch.features if f not in gradients]
        extra = [f for f in gradients if f not in batch.features]
        if extra:
            raise ValueError(
                f"gradients for unknown features {extra}; features are {list(batch.features)}"
            )
        if missing:
            raise ValueError(f"no gradient for features {missing}; every feature needs one")
        out = {}
        for name, lay in batch.features.items():
            g = checked_gradient(name, gradients[name], lay, self.nonfinite_gradients)
            # A gradient in a table's memory (a slice of its weights or of state_dict()'s
            # views) would change as the update writes the rows it reads: copied first.
            if any(np.may_share_memory(g, table.data) for table in self._physical):
                g = g.copy()
            out[name] = g
        return out

    def preprocessor(self):
        """A ``Preprocessor``: ``preprocess`` without the engine, for DataLoader workers.

        It holds the feature configs, the storage layout and the backend's name, no tables,
        so it is small to pickle into spawned workers; in forked workers (Linux's default) it
        prepares with the serial build of the kernel, as ``preprocess`` does there (GNU OpenMP
        is not fork-safe). Its batches equal ``preprocess``'s bit for bit. See
        embengine.preprocessing and examples/dataloader.py."""
        from .preprocessing import Preprocessor

        return Preprocessor(self._resolved, self._storage_layout, self.backend)
