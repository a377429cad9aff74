"""What the engine (and serving) asks of a backend: the declared interface, no probing.

A backend turns feature parts into table batches, pools activations, and applies updates. Every
capability the engine uses is a method here that every backend implements; a backend that has
no faster way to do one composes it from the others (the reference backend's
``build_tables_and_lookup`` is ``build_tables`` then ``lookup``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from ..batch import FeaturePart, LookupOnlyTableBatch, TableBatch
    from ..config import QuantizationConfig
    from ..optimizers import Optimizer
    from ..storage import TableStorage

__all__ = ["Backend", "out_rows"]


@runtime_checkable
class Backend(Protocol):
    """The interface of ``embengine.backends.reference.ReferenceBackend`` and
    ``embengine.backends.numba_backend.NumbaBackend``.

    Tables are ``storage.TableStorage``s (rows ``[weights | slots]`` of ``data``); a backend
    reads and writes the rows a batch resolved (``TableBatch.unique_rows``; -1: no row, pooled
    as zeros and not updated), never ids, and resolves a batch whose storage maps ids itself
    (``rows_for``) when it has no rows yet. ``quantization`` is a table's QuantizationConfig or
    None. An activation matrix is float32 ``[tb.num_outputs, dim]``: the table's features'
    outputs stacked in the batch's order."""

    name: str

    def check_optimizer(self, table_name: str, optimizer: Optimizer, dim: int) -> None:
        """Raise (naming the table) unless this backend can run ``optimizer`` on a table of
        this dim; the engine calls it for every table when it is built."""
        ...

    def build_tables(self, parts_per_table: list[list[FeaturePart]]) -> list[TableBatch]:
        """Each table's deduplicated batch (equal to ``batch.build_tables_numpy``'s)."""
        ...

    def build_tables_and_lookup(
        self,
        parts_per_table: list[list[FeaturePart]],
        tables: Sequence[TableStorage],
        quantizations: Sequence[QuantizationConfig | None],
    ) -> tuple[list[TableBatch], list[np.ndarray]]:
        """A training lookup of features: ``build_tables``, rows resolved (``rows_for`` with
        insert where the storage maps ids itself) and every table's ``lookup`` of its batch,
        with the same results (the numba backend runs the first and last in one parallel
        region)."""
        ...

    def lookup(
        self,
        table: TableStorage,
        tb: TableBatch | LookupOnlyTableBatch,
        quantization: QuantizationConfig | None = None,
    ) -> np.ndarray:
        """One table's activation matrix."""
        ...

    def lookup_tables(
        self,
        tables: list[TableStorage],
        batches: list[TableBatch | LookupOnlyTableBatch],
        quantizations: list[QuantizationConfig | None],
    ) -> list[np.ndarray]:
        """``lookup`` of every table, the same results (the numba backend pools the lookup-only
        batches of most storages in one parallel region). A backend whose class sets
        ``checks_lookup_ids = True`` range-checks every lookup-only feature's ids against its
        part's ``vocabulary_size`` here, raising ``check_values``'s error with the feature
        named, before it returns anything; the engine then prepares direct lookup-only calls
        without that check (``prepare(..., check_ids=False)``)."""
        ...

    def lookup_rows(
        self,
        rows: np.ndarray,
        dim: int,
        tb: TableBatch | LookupOnlyTableBatch,
        quantization: QuantizationConfig | None = None,
        *,
        out: np.ndarray | None = None,
        weights_dtype: str = "float32",
    ) -> np.ndarray:
        """``lookup`` from rows given as an array: float32, C-contiguous ``[n, >= dim]``, row
        ``r`` holding row ``r``'s weights in its first ``dim`` columns (a DenseTable's
        ``data``, or rows decoded from an export). The batch's rows index ``rows``: a
        deduplicated batch's ``unique_rows``, a lookup-only batch's ids from each feature's
        ``row_offset`` on (a storage whose rows are ids). ``out``: a writable float32
        C-contiguous ``[num_outputs, dim]`` array apart from ``rows`` to write the activations
        into (and return), e.g. a slice of a send buffer; else a new one. ``weights_dtype``
        "float16" / "bfloat16": ``rows`` is uint16 ``[n, >= dim]`` whose first ``dim`` units
        are the weights' bits (a 16-bit table's row array), each widened exactly as it is
        read (a deduplicated batch only)."""
        ...

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
        """One optimizer step on the rows of ``tb`` from the gradient ``grad`` of the table's
        activation matrix; ``skip_nonfinite`` leaves rows with a non-finite gradient alone.
        A row whose new weights or float slots would not all be finite (as float32) keeps its
        old values, slots included; returns the ids (rows of ``table``) of those rows and of the
        rows left alone for a non-finite gradient, each once (``nonfinite_rows_skipped``)."""
        ...

    def apply_tables(
        self,
        updates: Sequence[tuple[TableStorage, TableBatch, np.ndarray, Optimizer, float, int, bool]],
    ) -> list[np.ndarray]:
        """``apply(*update)`` for each of ``updates`` (each a different table), in any order or
        at once; the rows each left unchanged, in the order of ``updates``."""
        ...


def lookup_rows_source(rows, dim: int, weights_dtype: str = "float32", contiguous: bool = True):
    """``rows`` checked as ``Backend.lookup_rows`` takes them (a ValueError naming what they
    are otherwise): float32 ``[n, >= dim]``, or uint16 (the weights' bits) for
    ``weights_dtype`` "float16" / "bfloat16"; C-contiguous where a kernel reads them by
    address without bounds checks (``contiguous``)."""
    import numpy as np

    if weights_dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(
            f"lookup_rows: weights_dtype must be 'float32', 'float16' or 'bfloat16', got "
            f"{weights_dtype!r}"
        )
    want = np.float32 if weights_dtype == "float32" else np.uint16
    if (
        not isinstance(rows, np.ndarray)
        or rows.dtype != want
        or rows.ndim != 2
        or (contiguous and not rows.flags.c_contiguous)
        or rows.shape[1] < dim
    ):
        what = f"{rows.dtype} of shape {rows.shape}" if isinstance(rows, np.ndarray) else rows
        layout = "a C-contiguous" if contiguous else "a"
        of = "" if weights_dtype == "float32" else f" of {weights_dtype} weights"
        raise ValueError(
            f"lookup_rows{of} needs {layout} {np.dtype(want).name} [rows, >= {dim}] array, got "
            f"{what}"
        )
    return rows


def out_rows(out, rows: int, dim: int, source=None):
    """``out``, checked as ``Backend.lookup_rows`` takes it: a writable float32 C-contiguous
    ``[rows, dim]`` array apart from the ``source`` rows it is pooled from (a ValueError naming
    what it is otherwise)."""
    import numpy as np

    if source is not None and isinstance(out, np.ndarray) and np.may_share_memory(out, source):
        raise ValueError(
            "lookup_rows: out overlaps the rows it would be pooled from; pass an array of its own"
        )

    if (
        not isinstance(out, np.ndarray)
        or out.dtype != np.float32
        or out.shape != (rows, dim)
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        if isinstance(out, np.ndarray):
            what = f"{out.dtype} {out.shape}" + "".join(
                f", {flag}"
                for flag, bad in (
                    ("not C-contiguous", not out.flags.c_contiguous),
                    ("read-only", not out.flags.writeable),
                )
                if bad
            )
        else:
            what = type(out).__name__
        raise ValueError(
            f"lookup_rows: out must be a writable C-contiguous float32 [{rows}, {dim}] array, "
            f"got {what}"
        )
    return out
