"""What a physical table is to the engine and the kernels: the storage seam.

Ids are what users send; rows are where a table keeps them. Everything above this seam (batch
preparation, deduplication, checkpoints) speaks ids of logical tables; everything below it (the
lookup and update kernels) speaks rows of one array. A ``TableStorage`` is the only place that
maps one to the other, once per table per step, on the batch's deduplicated ids
(``rows_for``), so a new kind of table (keyed by arbitrary int64 ids, sharded) is a new storage
class and nothing else moves.

Row ``r`` of ``data`` is ``[weights (dim) | slot 0 | slot 1 ...]`` (float32; int32 slots are
views of the same bytes), the layout the update kernels read and write in place. A storage
whose rows are its logical tables' ids at fixed bases (``row_bases``: DenseTable, packed or
not) lets the batch resolve rows from the storage plan alone, in a DataLoader worker, and lets
the training lookup pool straight from the ids while another thread deduplicates
(``kernels.train_lookup``); any other storage is resolved by the engine, through ``rows_for``.

Import this module without numba (tests/test_layering.py).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from ..optimizers import SlotSpec
    from .dense import Column

__all__ = ["NO_ROW", "LogicalTable", "TableStorage"]

# What ``rows_for`` gives an id that has no row (not admitted yet, not this shard's): it pools
# as zeros and gets no update.
NO_ROW = -1


@runtime_checkable
class LogicalTable(Protocol):
    """One logical table's state in logical row order (row ``i`` is id ``i``): what
    ``state_dict``, checkpoints and serving read and write. Arrays are live views."""

    name: str
    vocabulary_size: int
    dim: int
    slot_specs: tuple[SlotSpec, ...]

    @property
    def weights(self) -> np.ndarray:
        """float32 ``[vocabulary_size, dim]``."""
        ...

    def slot(self, name: str) -> np.ndarray:
        """``[vocabulary_size, width]`` of the slot's dtype."""
        ...

    @property
    def slots(self) -> dict[str, np.ndarray]: ...

    @property
    def storage(self) -> str:
        """The storage kind (``storage.registry``)."""
        ...

    def flush(self) -> None: ...

    def sequential_access(self) -> contextlib.AbstractContextManager: ...


@runtime_checkable
class TableStorage(Protocol):
    """A physical table: one or more logical tables (low-dimensional packing puts several in
    one; logical table ``i`` is the ``i``-th member of its ``PhysicalTableSpec``), stored as one
    row array.

    Optional parts, for kinds that need them (``storage/keyed.py``; DenseTable has none):
    ``counts_occurrences = True`` makes training resolutions pass ``rows_for(..., counts=)``,
    each unique id's occurrences in the batch; ``begin_step(step)`` is called with the engine's
    step before every lookup and update; ``rows_for_update(logical, ids, rows, counts=)`` gives
    the rows an update writes (``rows`` as the lookup resolved them), once per table per update,
    after its gradients are validated (``TableBatch.for_update``); ``lookup_index()`` gives
    the index a kernel may probe instead of calling ``rows_for(logical, ids, False)``
    (``KeyedTable.lookup_index``: the same rows), and then ``rows_for`` of a training lookup
    takes what the index gave (``found=``) instead of probing it again; ``check_rows(logical,
    ids, found=)`` and ``check_update_rows(logical, ids, rows)`` raise what ``rows_for`` /
    ``rows_for_update`` would raise for a batch, changing nothing (every table of a batch is
    checked before any resolves: a batch one table refuses changes none).

    Attributes:
      name: the physical table's name (its members' names joined by "+").
      dim: the width of the weights, the first ``dim`` columns of a row.
      slot_specs: the optimizer slots after the weights, in order.
      columns: name -> ``Column`` (start, width, dtype) of "weights" and every slot in a row.
      row_width: floats per row.
      storage: the kind's name (``storage.registry``: "ram", "mmap", ...).
      nbytes: bytes of the row array.
    """

    name: str
    dim: int
    slot_specs: tuple[SlotSpec, ...]
    columns: dict[str, Column]
    row_width: int

    @property
    def storage(self) -> str: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def data(self) -> np.ndarray:
        """The row array the kernels read and write: float32 ``[rows, row_width]``,
        C-contiguous. Rows that ``rows_for`` never gives are never read or written."""
        ...

    @property
    def row_bases(self) -> tuple[int, ...] | None:
        """The identity capability: if logical table ``i``'s id ``k`` is always row
        ``row_bases[i] + k`` (DenseTable), those bases; else None. With bases, batches resolve
        rows from the storage plan alone and the training lookup pools straight from the ids;
        ``rows_for`` must agree with them."""
        ...

    def rows_for(self, logical: int, ids: np.ndarray, insert: bool) -> np.ndarray:
        """The rows of ``ids`` (int64, distinct when called for a batch's unique ids, in
        ``[0, vocabulary_size)`` of logical table ``logical``): int64, one per id, ``NO_ROW``
        (-1) for an id without a row. ``insert=True`` (training) may give new ids rows;
        ``insert=False`` (lookup-only, serving) must not change the storage."""
        ...

    def live_rows(self) -> np.ndarray:
        """The rows in use, as int64 ``[k, 2]`` half-open ranges ``[start, stop)`` in
        ascending order: what an every-row update (non-lazy Adam, Lion) sweeps."""
        ...

    def view(self, logical: int) -> LogicalTable:
        """Logical table ``logical``'s state in logical row order (live views)."""
        ...

    def flush(self) -> None:
        """Write a file-backed storage's changes to its file; nothing in RAM."""
        ...

    def sequential_access(self) -> contextlib.AbstractContextManager:
        """A context in which the whole table is read or written in order (checkpoints)."""
        ...
