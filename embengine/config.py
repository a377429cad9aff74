"""Table and feature specs (TF's names and defaults), and how an engine resolves them.

Specs are frozen and validated on construction; they hold no state. Two features share a table
when they hold the *same* TableConfig object (identity, as in TF), not an equal one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .initializers import Initializer, TruncatedNormal
from .optimizers import Optimizer
from .optimizers._checks import is_integer as _is_int
from .precision import check_dtype

__all__ = [
    "COMPRESSIONS",
    "Compressor",
    "TableConfig",
    "FeatureConfig",
    "QuantizationConfig",
    "DynamicVocabulary",
    "COMBINERS",
    "EVICTION_POLICIES",
    "INSERT_ON",
    "MAX_DIM",
    "MAX_SEQUENCE_LENGTH",
    "resolve_features",
]

COMBINERS = ("sum", "mean", "sqrtn")
# How ``embengine export`` can store a table's weights (embengine.serving has each one's rule).
COMPRESSIONS = ("fp32", "fp16", "bf16", "fixed_r8", "int8_rowwise")
EVICTION_POLICIES = ("lru", "lfu")
# Rows of one keyed table in one engine (or one shard): its index keeps int32 rows
# (kernels/keyed_index.py).
MAX_KEYED_ROWS = 2**31 - 1
# A keyed table's expiry (steps or data seconds): the kernels take int64s.
INT64_MAX = 2**63 - 1
# A keyed table's longest expire_steps: rows keep their last-touched step as int32 from a base
# the step is at most 2^30 past after a rebase (storage/keyed.py, ``_rebase``), so ages are
# exact up to 2^30 + 2^31 = 3 * 2^30 steps; an older row's step is clamped (reported newer),
# and with a longer expiry such a row never expired.
MAX_EXPIRE_STEPS = 3 * 2**30 - 1
# A table's widest row, in values: 2^16 (256 KiB of float32), four times the widest embeddings
# in use (language models' ~16k; recommendation tables use 8-512). A file cannot bound dim on
# its own (a keyed table without rows holds no bytes of any width), so loads check this.
MAX_DIM = 2**16
# A sequence feature's positions per sample: 2^24 (16,777,216), sixteen times the longest
# sequences in use (million-token contexts; user histories of ~10^5 events). Every lookup
# allocates all of them (``[B, S, dim]``, zero-padded), so a larger S can only fail, deep
# inside numpy (a MemoryError, or an OverflowError past int64); configs and every manifest
# that builds one (checkpoints, exports) refuse it instead.
MAX_SEQUENCE_LENGTH = 2**24
# The dims a NumPy array can have (64 since NumPy 2, 32 before): an activation is
# ``[*output_shape, dim]``, so an output_shape has at most one fewer.
MAX_NDIM = 64 if int(np.__version__.split(".")[0]) >= 2 else 32
INSERT_ON = ("lookup", "apply")


@dataclass(frozen=True)
class QuantizationConfig:
    """Simulated quantization of looked-up rows (TF's QuantizationConfig): before combining,
    every gathered value is clipped to ``[lower, upper]`` and rounded to the nearest of
    ``num_buckets`` evenly spaced levels::

        x = clip(x, lower, upper)
        q = (upper - lower) / (num_buckets - 1)
        x = floor((x - lower) / q + 0.5) * q + lower

    The table stays float32 and gradients pass straight through (the update is unchanged).
    """

    num_buckets: int
    lower: float
    upper: float

    def __post_init__(self):
        if not _is_int(self.num_buckets) or self.num_buckets < 2:
            raise ValueError(
                f"QuantizationConfig: num_buckets must be an int >= 2, got {self.num_buckets!r}"
            )
        if not (math.isfinite(self.lower) and math.isfinite(self.upper)):
            raise ValueError(
                f"QuantizationConfig: bounds must be finite, got lower={self.lower!r}, "
                f"upper={self.upper!r}"
            )
        if not self.lower < self.upper:
            raise ValueError(
                f"QuantizationConfig: lower={self.lower!r} must be < upper={self.upper!r}"
            )
        # The levels' step: Inf (bounds ~2e308 apart) made every value NaN, a subnormal one
        # Inf and NaN in the numba kernels.
        with np.errstate(over="ignore"):
            step = (np.float64(self.upper) - np.float64(self.lower)) / (self.num_buckets - 1)
        if not (np.isfinite(step) and step >= np.finfo(np.float64).tiny):
            raise ValueError(
                f"QuantizationConfig: the step (upper - lower) / (num_buckets - 1) = {step:.3g} "
                f"must be a normal float64 number (finite, >= {np.finfo(np.float64).tiny:.3g}); "
                f"got lower={self.lower!r}, upper={self.upper!r}, "
                f"num_buckets={self.num_buckets!r}: "
                + ("narrow the bounds" if step > 1 else "widen the bounds or use fewer buckets")
            )

    def quantize(self, x: np.ndarray) -> np.ndarray:
        q = (self.upper - self.lower) / (self.num_buckets - 1)
        x = np.clip(np.asarray(x, dtype=np.float64), self.lower, self.upper)
        return np.floor((x - self.lower) / q + 0.5) * q + self.lower


@dataclass(frozen=True)
class DynamicVocabulary:
    """A keyed table's rules (``TableConfig(vocabulary_size=None, ..., dynamic=...)``): ids are
    any int64 keys, and a key gets a row when it is admitted. Steps are the engine's (one per
    ``apply_gradients``); "touched" means looked up by a training lookup.

    - **New rows.** A new key's weights are the table's initializer evaluated at the key, a
      pure function of (seed, table, key), exactly as a dense table's row ``k`` is of (seed,
      table, k); its slots start at the optimizer's initial values. So a keyed table fed the
      keys ``0 .. V-1`` trains bit for bit like the dense table of vocabulary ``V``.
    - **insert_on** ``"lookup"`` (default): a training lookup gives admitted keys their rows,
      so the forward pass sees the row it trains. ``"apply"`` (Monolith): the lookup returns
      zeros for a key without a row; ``apply_gradients`` then creates the row (initial values)
      and applies that step's gradient to it.
    - **occurrence_threshold** ``T`` (Monolith's rule, counted exactly): a key not in the table
      is admitted at the first step at which its occurrences in training lookups of *earlier*
      steps number at least ``T`` (``T=0``: at once). Until then it looks up as zeros and its
      gradient is dropped (never added to another row). The counts of keys waiting for
      admission are bounded (``KeyedTable.max_pending``, by default ``4 * max_rows`` or 2^22
      keys): past the bound the keys seen longest ago are forgotten first (ties: smaller key
      first), and start counting from zero if seen again; a lookup never forgets its own
      keys (past that, the largest of its new keys are not counted). An admitted key's count
      is dropped when it gets its row. Inserting on apply, a key a training lookup admitted
      keeps its count until its update makes the row (two lookups before their updates: the
      second forgets every other pending key first), so its gradient is not dropped there
      while ``max_pending`` holds the admitted keys of the batches awaiting their updates and
      the lookup's own waiting keys; past that it is forgotten too (the bound holds), and
      that update drops its gradient.
      Counts are int64, so ``T`` is at most 2^63 - 1; a ``T`` no key reaches (Monolith's
      threshold above its 4-bit counts, or 2^62) admits no key, silently: every key looks up
      as zeros and its gradient is dropped.
    - **expire_steps** ``S`` (at most ``MAX_EXPIRE_STEPS``, 3 * 2^30 - 1: rows keep their
      last-touched step in int32 from a moving base): a row not touched for more than ``S``
      steps (touched last at step ``t``, now step ``s > t + S``) is removed before the
      training lookup of step ``s`` or later that first has keys of its table (a step whose
      batch has none for the table runs none of its rules, so ``table_stats`` and
      checkpoints may still count the row); an evaluation or serving lookup at step ``s``
      already sees it as absent (zeros).
    - **expire_seconds** ``D`` (data time, Monolith's ``expire_time`` in days times 86400):
      a training call may carry the time of its examples (``lookup(..., timestamp=t)``,
      ``apply_gradients(..., timestamp=t)``, an int of seconds, e.g. Unix time; an update
      without one has its step's lookup's). A table's data time is the newest timestamp of
      the training calls that resolved its keys, so it never goes back; a row's time is the
      newest timestamp of the calls that touched it (an older one does not make it older). A
      row whose time is more than ``D`` seconds behind the data time of a call (its timestamp,
      if newer) is removed before that call's lookup, as ``expire_steps`` removes; evaluation
      lookups see the table at its data time. Wall time never counts. An engine with a table
      that has ``expire_seconds`` needs a timestamp on every training call whose step has none
      yet (a ValueError naming the table, nothing changed); without timestamps, use
      ``expire_steps`` (steps count). Both may be set: a row goes when either rule says so.
    - **max_rows** ``N``: before a step would hold more than ``N`` rows, rows not in the
      current batch are removed: the least recently touched (``eviction="lru"``; ties: smaller
      key first) or the least often touched (``"lfu"``: fewest occurrences in training lookups
      since the row was created; ties: least recently touched, then smaller key). A batch
      whose own keys need more than ``N`` rows is a ValueError naming the table, and nothing
      changes. Inserting on apply, the rows are made (and evicted for) at the update, but the
      training lookup already refuses a batch whose update would need more than ``N`` rows.
      The update itself refuses only when another update came between the two (two lookups
      before their updates): it runs at a later step, admitting the keys counted since, and
      an earlier update may have evicted its rows. Nothing changes then either; that batch
      cannot be applied (look it up again), and training goes on.
    - An evicted or expired key seen again is a new key: it must be admitted again (its count
      starts from zero) and gets a fresh row (initial weights, fresh slots).
    - Evaluation lookups (``training=False``) never insert, admit, count or refresh: a key
      without a row looks up as zeros.
    """

    occurrence_threshold: int = 0
    expire_steps: int | None = None
    max_rows: int | None = None
    eviction: str = "lru"
    insert_on: str = "lookup"
    expire_seconds: int | None = None

    def __post_init__(self):
        where = "DynamicVocabulary"
        t = self.occurrence_threshold
        if not _is_int(t) or t < 0:
            raise ValueError(f"{where}: occurrence_threshold must be an int >= 0, got {t!r}")
        if t > INT64_MAX:  # the pending counts are int64: no count reaches it
            raise ValueError(
                f"{where}: occurrence_threshold must be at most {INT64_MAX:,} (2^63 - 1: "
                f"occurrences are counted in int64), got {t!r}"
            )
        for field_name in ("expire_steps", "max_rows", "expire_seconds"):
            v = getattr(self, field_name)
            if v is not None and (not _is_int(v) or v < 1):
                raise ValueError(
                    f"{where}: {field_name} must be None (no limit) or an int >= 1, got {v!r}"
                )
        s = self.expire_steps
        if s is not None and s > MAX_EXPIRE_STEPS:  # older rows' steps are clamped: kept
            raise ValueError(
                f"{where}: expire_steps must be at most {MAX_EXPIRE_STEPS:,} (3 * 2^30 - 1: rows "
                f"keep their last-touched step as int32 from a moving base, exact that far "
                f"back), got {s!r}; None means no limit"
            )
        d = self.expire_seconds
        if d is not None and d > INT64_MAX:  # past it the kernels' int64 arguments failed
            raise ValueError(
                f"{where}: expire_seconds must be at most {INT64_MAX:,} (2^63 - 1: data times "
                f"are int64), got {d!r}; None means no limit"
            )
        if self.max_rows is not None and self.max_rows > MAX_KEYED_ROWS:
            raise ValueError(
                f"{where}: max_rows must be at most {MAX_KEYED_ROWS:,} (2^31 - 1, the rows one "
                f"keyed table holds in one engine; shard a bigger one), got {self.max_rows!r}"
            )
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(
                f"{where}: eviction must be one of {EVICTION_POLICIES}, got {self.eviction!r}"
            )
        if self.insert_on not in INSERT_ON:
            raise ValueError(
                f"{where}: insert_on must be one of {INSERT_ON}, got {self.insert_on!r}"
            )
        for field_name in ("occurrence_threshold", "expire_steps", "max_rows", "expire_seconds"):
            v = getattr(self, field_name)
            if v is not None:
                object.__setattr__(self, field_name, int(v))


def fixed_range_error(r) -> str | None:
    """Why ``r`` cannot be fixed_r8's range (None if it can): a number, finite, > 0, and with a
    step ``r / 128`` that float32 holds as a normal number (the codes decode as
    ``code * float32(r / 128)``: beyond float32 every value decoded to NaN or Inf)."""
    if (
        isinstance(r, bool)
        or not isinstance(r, int | float | np.floating | np.integer)
        or not (math.isfinite(r) and r > 0)
    ):
        return f"must be a finite number > 0, got {r!r:.80}"
    with np.errstate(over="ignore"):
        step = np.float32(float(r) / 128)
    if not (np.isfinite(step) and step >= np.finfo(np.float32).tiny):
        return (
            f"must make a step r / 128 within float32's normal numbers (r in [{2.0**-119:.3g}, "
            f"{128 * float(np.finfo(np.float32).max):.4g}]), got {r!r:.80}"
        )
    return None


@dataclass(frozen=True)
class Compressor:
    """How ``embengine export`` stores a table's weights for serving (the table's own default;
    the export's per-table argument still wins over it, the export's default only applies to
    tables without one). ``compression``: one of COMPRESSIONS; ``fixed_range``: r of
    "fixed_r8", whose codes are the 256 levels ``r k / 128`` for k in [-128, 127] (ignored by the
    others). It changes nothing in training: simulated quantization of lookups is
    ``TableConfig.quantization_config`` (``embengine.monolith.FixedR8Compressor`` makes one)."""

    compression: str = "fp32"
    fixed_range: float = 1.0

    def __post_init__(self):
        if self.compression not in COMPRESSIONS:
            raise ValueError(
                f"{type(self).__name__}: compression must be one of "
                f"{COMPRESSIONS}, got {self.compression!r}"
            )
        r = self.fixed_range
        why = fixed_range_error(r)
        if why is not None:
            raise ValueError(f"{type(self).__name__}: fixed_range {why}")
        object.__setattr__(self, "fixed_range", float(r))


@dataclass(frozen=True, eq=False)
class TableConfig:
    """One embedding table.

    Args:
      vocabulary_size: number of rows (ids are ``0 .. vocabulary_size - 1``); None makes a
        keyed table (a dynamic vocabulary: ids are any int64 keys, rows are created as keys are
        admitted; see ``DynamicVocabulary``). In 2-D (padded) input -1 stays padding; in every
        other input form -1 is a key like any other.
      dim: embedding width.
      initializer: an ``embengine.initializers.Initializer``; default
        ``TruncatedNormal(mean=0, stddev=1/sqrt(dim))`` (TF's default).
      optimizer: this table's optimizer; None uses the engine's global optimizer.
      combiner: how a bag of ids becomes one vector: "sum", "mean" (default, as TF) or "sqrtn".
      name: unique table name; None means ``table_{i}`` by order of first appearance.
      quantization_config: simulated quantization of looked-up rows (QuantizationConfig).
      dynamic: a keyed table's rules (``DynamicVocabulary``); only with
        ``vocabulary_size=None``, where None means ``DynamicVocabulary()``: admit every key at
        once, never evict, insert on the training lookup.
      compressor: how ``embengine export`` stores this table (``Compressor``); None: the
        export's default.
      weights_dtype: how the weights are stored: "float32" (default), "float16" or
        "bfloat16". A 16-bit table computes in float32 and writes its updates back with
        stochastic rounding (``embengine.precision``): half the memory per value.
      slots_dtype: the same for the optimizer's float slots (integer slots, such as Adam's
        per-row step count, stay int32).
    """

    vocabulary_size: int | None
    dim: int
    initializer: Initializer | None = None
    optimizer: Optimizer | None = None
    combiner: str = "mean"
    name: str | None = None
    quantization_config: QuantizationConfig | None = None
    dynamic: DynamicVocabulary | None = None
    compressor: Compressor | None = None
    weights_dtype: str = "float32"
    slots_dtype: str = "float32"

    def __post_init__(self):
        where = f"TableConfig(name={self.name!r})"
        check_dtype(where, "weights_dtype", self.weights_dtype)
        check_dtype(where, "slots_dtype", self.slots_dtype)
        if self.vocabulary_size is None:
            if self.dynamic is None:
                object.__setattr__(self, "dynamic", DynamicVocabulary())
            elif not isinstance(self.dynamic, DynamicVocabulary):
                raise TypeError(
                    f"{where}: dynamic must be an embengine.DynamicVocabulary, got {self.dynamic!r}"
                )
        elif not _is_int(self.vocabulary_size) or self.vocabulary_size < 1:
            raise ValueError(
                f"{where}: vocabulary_size must be an int >= 1, got {self.vocabulary_size!r} "
                "(or None for a keyed table)"
            )
        elif self.dynamic is not None:
            raise ValueError(
                f"{where}: dynamic={self.dynamic!r} makes a keyed table, which has no fixed "
                f"vocabulary_size (got {self.vocabulary_size!r}); pass vocabulary_size=None"
            )
        if not _is_int(self.dim) or not 1 <= self.dim <= MAX_DIM:
            raise ValueError(f"{where}: dim must be an int in [1, {MAX_DIM:,}], got {self.dim!r}")
        if self.initializer is not None and not isinstance(self.initializer, Initializer):
            raise TypeError(
                f"{where}: initializer must be an embengine.initializers.Initializer, got "
                f"{self.initializer!r}"
            )
        if self.optimizer is not None:
            if not isinstance(self.optimizer, Optimizer):
                raise TypeError(
                    f"{where}: optimizer must be an embengine.optimizers.Optimizer, got "
                    f"{self.optimizer!r}"
                )
            self.optimizer.check_dim(int(self.dim))
        if self.combiner not in COMBINERS:
            raise ValueError(f"{where}: combiner must be one of {COMBINERS}, got {self.combiner!r}")
        if self.quantization_config is not None and not isinstance(
            self.quantization_config, QuantizationConfig
        ):
            raise TypeError(
                f"{where}: quantization_config must be a QuantizationConfig, got "
                f"{self.quantization_config!r}"
            )
        if self.compressor is not None and not isinstance(self.compressor, Compressor):
            raise TypeError(
                f"{where}: compressor must be an embengine.Compressor (or a Monolith "
                f"compressor of embengine.monolith), got {self.compressor!r}"
            )
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise ValueError(
                f"TableConfig: name must be a non-empty str or None, got {self.name!r}"
            )

    @property
    def keyed(self) -> bool:
        """A keyed table (``vocabulary_size=None``: a dynamic vocabulary)."""
        return self.vocabulary_size is None

    @property
    def effective_initializer(self) -> Initializer:
        return self.initializer if self.initializer is not None else TruncatedNormal()


@dataclass(frozen=True, eq=False)
class FeatureConfig:
    """One input feature looked up in ``table``.

    Args:
      table: the TableConfig it reads; several features may share one.
      max_sequence_length: 0 (default) combines each sample's ids into one vector ``[B, dim]``.
        S > 0 makes a sequence feature: ``[B, S, dim]``, one vector per position, ids past S
        dropped, short samples zero-padded; sequence features take no weights.
      validate_weights_and_indices: accepted for TF compatibility. embengine always checks ids
        (an out-of-range id would read outside the table); False skips only the finite-weight check.
      output_shape: the activation's leading shape, replacing the batch dimension: its product
        must equal the number of samples (times S for a sequence feature whose output_shape ends
        in S). The activation is ``[*output_shape, dim]``.
      name: the feature's name; an engine built from a dict uses the dict keys.
    """

    table: TableConfig
    max_sequence_length: int = 0
    validate_weights_and_indices: bool = True
    output_shape: tuple[int, ...] | None = field(default=None)
    name: str | None = None

    def __post_init__(self):
        where = f"FeatureConfig(name={self.name!r})"
        if not isinstance(self.table, TableConfig):
            raise TypeError(f"{where}: table must be a TableConfig, got {self.table!r}")
        if not _is_int(self.max_sequence_length) or self.max_sequence_length < 0:
            raise ValueError(
                f"{where}: max_sequence_length must be an int >= 0, "
                f"got {self.max_sequence_length!r}"
            )
        # (a feature of an engine's dict is named by its key later: name its table here)
        whose = where if self.name is not None else f"{where} of table {self.table.name!r}"
        if self.max_sequence_length > MAX_SEQUENCE_LENGTH:
            raise ValueError(
                f"{whose}: max_sequence_length={self.max_sequence_length:,} is more than "
                f"{MAX_SEQUENCE_LENGTH:,} (2^24) positions: every lookup allocates [batch, "
                "max_sequence_length, dim] activations, so set it to the longest sequence "
                "the model reads (ids past it are dropped)"
            )
        if self.output_shape is not None:
            shape = self.output_shape
            if _is_int(shape):
                shape = (shape,)
            if (
                not isinstance(shape, Sequence)
                or not all(_is_int(s) and s >= 0 for s in shape)
                or len(shape) == 0
            ):
                raise ValueError(
                    f"{where}: output_shape must be a non-empty sequence of ints >= 0, "
                    f"got {self.output_shape!r}"
                )
            if len(shape) >= MAX_NDIM:
                raise ValueError(
                    f"{whose}: output_shape has {len(shape)} dims; an activation "
                    f"[*output_shape, dim] can have at most {MAX_NDIM} (NumPy's limit), so "
                    f"output_shape at most {MAX_NDIM - 1}"
                )
            object.__setattr__(self, "output_shape", tuple(int(s) for s in shape))

    @property
    def is_sequence(self) -> bool:
        return self.max_sequence_length > 0

    def activation_shape(self, num_samples: int) -> tuple[int, ...]:
        """The activation's shape for a batch of ``num_samples`` (TPU rules), ValueError if the
        configured output_shape does not fit."""
        dim = self.table.dim
        seq = self.max_sequence_length
        natural = (num_samples, seq) if seq else (num_samples,)
        if self.output_shape is None:
            return (*natural, dim)
        if math.prod(self.output_shape) != math.prod(natural):
            raise ValueError(
                f"feature {self.name!r}: output_shape {list(self.output_shape)} holds "
                f"{math.prod(self.output_shape)} vectors but the batch gives "
                f"{math.prod(natural)} ({' x '.join(map(str, natural))})"
            )
        return (*self.output_shape, dim)


@dataclass(frozen=True)
class ResolvedFeatures:
    """Features and tables of an engine, named and ordered (tables by first appearance)."""

    features: dict[str, FeatureConfig]
    tables: tuple[TableConfig, ...]
    table_names: tuple[str, ...]
    feature_table: dict[str, int]  # feature name -> table index
    table_features: tuple[tuple[str, ...], ...]  # table index -> feature names, in order


def resolve_features(
    feature_config: Mapping[str, FeatureConfig] | Sequence[FeatureConfig] | FeatureConfig,
) -> ResolvedFeatures:
    """Name features and tables, order tables by first appearance, check names are unique."""
    if isinstance(feature_config, FeatureConfig):
        feature_config = [feature_config]
    items: list[tuple[str, FeatureConfig]] = []
    if isinstance(feature_config, Mapping):
        for key, fc in feature_config.items():
            if not isinstance(key, str):
                raise TypeError(f"feature names must be str, got {key!r}")
            if not isinstance(fc, FeatureConfig):
                raise TypeError(f"feature {key!r}: expected a FeatureConfig, got {fc!r}")
            if fc.name is not None and fc.name != key:
                raise ValueError(
                    f"feature {key!r}: its FeatureConfig is named {fc.name!r}; leave name=None "
                    "or use the same name as the dict key"
                )
            items.append((key, fc))
    elif isinstance(feature_config, Sequence) and not isinstance(feature_config, str):
        for i, fc in enumerate(feature_config):
            if not isinstance(fc, FeatureConfig):
                raise TypeError(f"feature_config[{i}]: expected a FeatureConfig, got {fc!r}")
            items.append((fc.name if fc.name is not None else f"feature_{i}", fc))
    else:
        raise TypeError(
            "feature_config must be a dict of name -> FeatureConfig or a list of FeatureConfig, "
            f"got {type(feature_config).__name__}"
        )
    if not items:
        raise ValueError("feature_config is empty: an engine needs at least one feature")

    features: dict[str, FeatureConfig] = {}
    tables: list[TableConfig] = []
    index_of: dict[int, int] = {}
    feature_table: dict[str, int] = {}
    for name, fc in items:
        if name in features:
            raise ValueError(f"feature name {name!r} appears twice")
        if fc.name != name:
            fc = FeatureConfig(
                fc.table,
                fc.max_sequence_length,
                fc.validate_weights_and_indices,
                fc.output_shape,
                name,
            )
        features[name] = fc
        key = id(fc.table)
        if key not in index_of:
            index_of[key] = len(tables)
            tables.append(fc.table)
        feature_table[name] = index_of[key]

    names: list[str] = []
    for i, t in enumerate(tables):
        names.append(t.name if t.name is not None else f"table_{i}")
    seen: dict[str, int] = {}
    for i, n in enumerate(names):
        if n in seen:
            raise ValueError(
                f"table name {n!r} is used by two different TableConfig objects "
                f"(tables {seen[n]} and {i}); names must be unique"
            )
        seen[n] = i
    table_features = tuple(
        tuple(f for f, t in feature_table.items() if t == i) for i in range(len(tables))
    )
    return ResolvedFeatures(features, tuple(tables), tuple(names), feature_table, table_features)
