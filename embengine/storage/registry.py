"""Storage kinds by name: what ``EmbeddingEngine(storage=...)`` and the storage plan accept.

A kind is a factory of ``TableStorage`` plus three facts the plan needs before any table
exists: whether tables of the kind may be packed together (low-dimensional packing), whether a
table of the kind lives in a file of ``storage_dir`` (then it is never packed: the file is
named after its one table), and whether its rows are its ids at the plan's row offsets (then
batches resolve rows without the table, and the training lookup pools straight from the ids).
"ram" and "mmap" are DenseTables, "keyed" and "keyed-mmap" the KeyedTable of a dynamic
vocabulary, its rows in RAM or in a file (``storage/keyed.py``); ``register_storage_kind``
adds one (a sharded table, a test's own layout).

Import this module without numba (tests/test_layering.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # not .plan: the plan imports this module
    from ..initializers import Initializer
    from ..optimizers import SlotSpec
    from .protocol import TableStorage

# A ``plan.PhysicalTableSpec`` (name, dim, storage, path, tables).
PhysicalTableSpec = Any

__all__ = [
    "KEYED_KINDS",
    "Segment",
    "StorageFactory",
    "StorageKind",
    "make_storage",
    "register_storage_kind",
    "storage_kind",
    "storage_kinds",
]

# One logical table of a physical table: (name, its plan row offset, rows, initializer). A
# storage initialises logical row ``r`` of it as ``initializer.init(seed, name, [r], dim)``.
Segment = tuple[str, int, int, "Initializer"]
# factory(spec, slot_specs, segments, seed) -> the physical table's storage.
StorageFactory = Callable[
    [PhysicalTableSpec, "tuple[SlotSpec, ...]", "Sequence[Segment]", int], "TableStorage"
]


@dataclass(frozen=True)
class StorageKind:
    """A storage kind: its name, its factory, and what the plan must know of it.

    Attributes:
      name: what ``storage=`` says ("ram", "mmap", ...).
      factory: ``factory(spec, slot_specs, segments, seed)`` builds the physical table of a
        ``PhysicalTableSpec`` of this kind (``segments``: its logical tables, in row order).
      packable: tables of this kind may share a physical table (low-dimensional packing).
      file: a table of this kind lives in the file ``{storage_dir}/{table}.f32`` (``spec.path``);
        such a table is never packed.
      row_ids: logical table i's id k is always row ``row_offset_i + k`` (its plan's
        ``TableInStack.row_offset``); the storage's ``row_bases`` must then be those offsets.
        Otherwise only ``rows_for`` maps ids to rows.
    """

    name: str
    factory: StorageFactory
    packable: bool = False
    file: bool = False
    row_ids: bool = False


def _dense(spec: PhysicalTableSpec, slot_specs, segments, seed: int) -> TableStorage:
    from .dense import DenseTable

    return DenseTable(
        spec.name,
        spec.vocabulary_size,
        spec.dim,
        slot_specs,
        segments[0][3],
        seed,
        path=spec.path,
        segments=list(segments),
        weights_dtype=spec.weights_dtype,
        slots_dtype=spec.slots_dtype,
    )


def _keyed(spec: PhysicalTableSpec, slot_specs, segments, seed: int) -> TableStorage:
    from .keyed import KeyedTable

    (member,) = spec.tables
    (name, _, _, initializer) = segments[0]
    return KeyedTable(
        name,
        spec.dim,
        slot_specs,
        initializer,
        seed,
        member.dynamic,
        spec.path,
        weights_dtype=spec.weights_dtype,
        slots_dtype=spec.slots_dtype,
    )


# The kinds of keyed tables: rows in RAM, or in a file of storage_dir ("mmap" for a keyed table).
KEYED_KINDS = ("keyed", "keyed-mmap")
_BUILT_IN = ("ram", "mmap", *KEYED_KINDS)
_KINDS: dict[str, StorageKind] = {
    "ram": StorageKind("ram", _dense, packable=True, row_ids=True),
    "mmap": StorageKind("mmap", _dense, file=True, row_ids=True),
    # A keyed table (dynamic vocabulary): rows are not ids; alone in its physical table.
    "keyed": StorageKind("keyed", _keyed),
    "keyed-mmap": StorageKind("keyed-mmap", _keyed, file=True),
}


def register_storage_kind(
    name: str,
    factory: StorageFactory,
    *,
    packable: bool = False,
    file: bool = False,
    row_ids: bool = False,
) -> StorageKind:
    """Make ``storage=name`` build tables with ``factory`` (see ``StorageKind``); registering a
    name again replaces its kind, except the built-in ones (``_BUILT_IN``)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a storage kind's name must be a non-empty str, got {name!r}")
    if name in _BUILT_IN:
        raise ValueError(f"storage kind {name!r} is built in and cannot be replaced")
    if not callable(factory):
        raise TypeError(f"storage kind {name!r}: factory must be callable, got {factory!r}")
    if packable and file:
        raise ValueError(f"storage kind {name!r}: a kind stored in files cannot be packable")
    kind = StorageKind(name, factory, bool(packable), bool(file), bool(row_ids))
    _KINDS[name] = kind
    return kind


def storage_kinds() -> tuple[str, ...]:
    """Every registered kind's name, the built-in ones first."""
    return tuple(_KINDS)


def storage_kind(name: str) -> StorageKind:
    """The kind registered as ``name``; ValueError naming the known kinds otherwise."""
    kind = _KINDS.get(name) if isinstance(name, str) else None
    if kind is None:
        raise ValueError(f"unknown storage kind {name!r}; registered kinds are {storage_kinds()}")
    return kind


def make_storage(
    spec: PhysicalTableSpec,
    slot_specs: tuple[SlotSpec, ...],
    segments: Sequence[Segment],
    seed: int,
) -> TableStorage:
    """The physical table of ``spec``, built by its kind's factory. 16-bit tables
    (``spec.weights_dtype`` / ``slots_dtype``) are built-in kinds only (DenseTable, "ram" or
    "mmap"; KeyedTable, "keyed" or "keyed-mmap"): a ValueError for a registered kind, which
    would store float32 rows without saying so."""
    sixteen = [d for d in (spec.weights_dtype, spec.slots_dtype) if d != "float32"]
    if sixteen and spec.storage not in _BUILT_IN:
        raise ValueError(
            f"table {spec.name!r}: storage {spec.storage!r} stores float32 rows only; a "
            f"{sixteen[0]} table is stored in 'ram', 'mmap', 'keyed' or 'keyed-mmap'"
        )
    return storage_kind(spec.storage).factory(spec, tuple(slot_specs), list(segments), seed)
