"""Table initializers: each value is a pure function of (seed, table name, row id, column).

The same row therefore gets the same initial value whatever the sharding, the storage, the chunk
it is initialised in, or the order in which rows are first touched. Randomness comes from a
counter-based generator (``kernels/init.py``): splitmix64 applied to a 64-bit key (derived from
seed and table name with blake2b, so it is stable across processes) mixed with the row id,
column and a redraw round.

This module imports no numba: a built-in random initializer names its values as a ``Fill`` (which
fill kernel, with which parameters), and the kernels are imported where values are first computed
(``fill_values``, called by ``init`` when storage initialises a table), so that configuring an
engine does not load numba.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = [
    "Initializer",
    "Zeros",
    "Constant",
    "RandomUniform",
    "TruncatedNormal",
    "RowId",
    "FromFunction",
    "Fill",
    "fill_values",
    "table_key",
]

FILL_KINDS = ("uniform", "truncated_normal")
# Tables are float32: an initial value beyond this would be stored as Inf.
FLOAT32_MAX = float(np.finfo(np.float32).max)


def _fits_float32(owner: str, what: str, value) -> None:
    if not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
        raise ValueError(
            f"{owner}: {what} must be finite and within float32 range "
            f"(|x| <= {FLOAT32_MAX:.7g}), got {value!r}"
        )


def table_key(seed: int, table_name: str) -> np.uint64:
    """A 64-bit key for one table's random stream, stable across processes and platforms."""
    digest = hashlib.blake2b(f"{int(seed)}\x00{table_name}".encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


@dataclass(frozen=True)
class Fill:
    """A random initializer's values as data: which fill kernel of ``kernels/init.py`` computes
    them, with its two parameters. ``kind`` "uniform": uniform in ``[a, b)``;
    "truncated_normal": Normal(mean ``a``, stddev ``b``) redrawn beyond 2 stddev."""

    kind: Literal["uniform", "truncated_normal"]
    a: float
    b: float

    def __post_init__(self):
        if self.kind not in FILL_KINDS:
            raise ValueError(f"Fill: kind must be one of {FILL_KINDS}, got {self.kind!r}")


def fill_values(fill: Fill, seed: int, table_name: str, rows, dim: int) -> np.ndarray:
    """float32 ``[len(rows), dim]``: the values of ``fill`` at ``rows`` of table ``table_name``.

    The fill kernels (numba, parallel) are imported here, on the first values computed, not when
    this module is imported."""
    from .kernels.init import fill_truncated_normal, fill_uniform
    from .kernels.pool import start_pool

    start_pool()  # the fill kernels are parallel
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    out = np.empty((len(rows), dim), dtype=np.float32)
    kernel = fill_uniform if fill.kind == "uniform" else fill_truncated_normal
    # float(): one compiled kernel whether a spec's bounds are ints or floats.
    kernel(out, rows, table_key(seed, table_name), float(fill.a), float(fill.b))
    return out


@dataclass(frozen=True)
class Initializer:
    """Base class. ``init(seed, table_name, rows, dim)`` returns float32 ``[len(rows), dim]``."""

    def init(self, seed: int, table_name: str, rows: np.ndarray, dim: int) -> np.ndarray:
        raise NotImplementedError

    def fill(self, dim: int) -> Fill | None:
        """The fill kernel computing this initializer's values for tables of width ``dim``, or
        None when ``init`` computes them in NumPy (or user code)."""
        return None

    # Whether a dense table's rows must come from one call for the whole table (``init`` with
    # rows 0..V-1): values that depend on the call's shape (FromFunction).
    whole_table = False

    def constant(self) -> float | None:
        """The one value ``init`` gives every entry, or None (also for a subclass that
        overrides ``init``): a keyed table writes it into its new rows in place, as it writes
        their slots, instead of copying in ``init``'s array (``fill`` comes first)."""
        return None


@dataclass(frozen=True)
class Zeros(Initializer):
    """Every value 0."""

    def init(self, seed, table_name, rows, dim):
        return np.zeros((len(rows), dim), dtype=np.float32)

    def constant(self):
        return 0.0 if type(self).init is Zeros.init else None


@dataclass(frozen=True)
class Constant(Initializer):
    """Every value ``value``."""

    value: float = 0.0

    def __post_init__(self):
        _fits_float32("Constant", "value", float(self.value))

    def init(self, seed, table_name, rows, dim):
        return np.full((len(rows), dim), self.value, dtype=np.float32)

    def constant(self):
        return float(self.value) if type(self).init is Constant.init else None


@dataclass(frozen=True)
class RandomUniform(Initializer):
    """Uniform in ``[minval, maxval)`` (TF's defaults: -0.05, 0.05)."""

    minval: float = -0.05
    maxval: float = 0.05

    def __post_init__(self):
        if not (math.isfinite(self.minval) and math.isfinite(self.maxval)):
            raise ValueError(
                f"RandomUniform: bounds must be finite, got minval={self.minval!r}, "
                f"maxval={self.maxval!r}"
            )
        _fits_float32("RandomUniform", "minval", self.minval)
        _fits_float32("RandomUniform", "maxval", self.maxval)
        if self.minval > self.maxval:
            raise ValueError(
                f"RandomUniform: minval={self.minval!r} must not exceed maxval={self.maxval!r}"
            )

    def fill(self, dim):
        return Fill("uniform", self.minval, self.maxval)

    def init(self, seed, table_name, rows, dim):
        return fill_values(self.fill(dim), seed, table_name, rows, dim)


@dataclass(frozen=True)
class TruncatedNormal(Initializer):
    """Normal(mean, stddev) truncated at two standard deviations, like TF's: values with
    ``|z| > 2`` are redrawn (each redraw round uses its own counter stream, so a value still depends
    only on seed, table, row and column). ``stddev=None`` means ``1/sqrt(dim)``, TF's default for
    embedding tables."""

    mean: float = 0.0
    stddev: float | None = None

    def __post_init__(self):
        if not math.isfinite(self.mean):
            raise ValueError(f"TruncatedNormal: mean must be finite, got {self.mean!r}")
        if self.stddev is not None and not (math.isfinite(self.stddev) and self.stddev >= 0):
            raise ValueError(
                f"TruncatedNormal: stddev must be finite and >= 0, got {self.stddev!r}"
            )
        # Values lie within mean +- 2 stddev.
        spread = 2.0 * (self.stddev or 0.0)
        _fits_float32("TruncatedNormal", "mean +- 2 stddev", abs(self.mean) + spread)

    def fill(self, dim):
        stddev = 1.0 / math.sqrt(dim) if self.stddev is None else self.stddev
        return Fill("truncated_normal", self.mean, stddev)

    def init(self, seed, table_name, rows, dim):
        return fill_values(self.fill(dim), seed, table_name, rows, dim)


@dataclass(frozen=True)
class RowId(Initializer):
    """Every value of row ``r`` is ``r + offset`` (TF's RowIdInitializer); handy in tests."""

    offset: int = 0

    def __post_init__(self):
        _fits_float32("RowId", "offset", float(self.offset))

    def init(self, seed, table_name, rows, dim):
        values = np.asarray(rows, dtype=np.float64) + self.offset
        return np.repeat(values.astype(np.float32)[:, None], dim, axis=1)


@dataclass(frozen=True)
class FromFunction(Initializer):
    """A TF-style initializer ``fn(shape, dtype) -> array``, called once for a whole dense
    table with ``shape = (vocabulary_size, dim)``, as TF calls a table's initializer once per
    task: a seeded Keras initializer, a pretrained array (``tf.constant_initializer``) or a
    row-id initializer gives TF's table (its peak memory is one table of float32 values; a
    ShardedEngine's rank computes the whole table and keeps its rows). A keyed table calls it
    with ``(new keys, dim)`` for each batch of new keys.

    For porting code only: unlike every other initializer here its values are not a function of
    (seed, table name, row id) alone.
    """

    fn: object
    whole_table = True

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"FromFunction: fn must be callable, got {self.fn!r}")

    def init(self, seed, table_name, rows, dim):
        from .inputs import as_numpy

        values = as_numpy(self.fn((len(rows), dim), "float32"))
        if values.shape != (len(rows), dim):
            raise ValueError(
                f"initializer {self.fn!r} returned shape {values.shape}, expected "
                f"{(len(rows), dim)}"
            )
        # A value past float32's range becomes inf here, refused just below by name: the
        # cast's "overflow encountered in cast" RuntimeWarning would only precede that error.
        with np.errstate(over="ignore"):
            values = values.astype(np.float32)
        if not np.isfinite(values).all():
            raise ValueError(
                f"initializer {self.fn!r} returned non-finite values (or values beyond float32 "
                f"range) for table {table_name!r}"
            )
        return values
