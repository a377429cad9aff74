"""Where tables and their optimizer slots live: the storage plan, the storage protocol (ids to
rows), the storage kinds by name, and the DenseTable built from them."""

from .dense import Column, DenseTable, StorageError, TableView
from .plan import PhysicalTableSpec, StoragePlan, TableInStack, plan_storage
from .protocol import NO_ROW, LogicalTable, TableStorage
from .registry import StorageKind, make_storage, register_storage_kind, storage_kinds

__all__ = [
    "NO_ROW",
    "Column",
    "DenseTable",
    "LogicalTable",
    "PhysicalTableSpec",
    "StorageError",
    "StorageKind",
    "StoragePlan",
    "TableInStack",
    "TableStorage",
    "TableView",
    "make_storage",
    "plan_storage",
    "register_storage_kind",
    "storage_kinds",
]
