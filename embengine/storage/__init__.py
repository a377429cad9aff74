"""Where tables and their optimizer slots live: the storage plan, and the tables built from it."""

from .dense import Column, DenseTable, StorageError, TableView
from .plan import PhysicalTableSpec, StoragePlan, TableInStack, plan_storage

__all__ = [
    "Column",
    "DenseTable",
    "PhysicalTableSpec",
    "StorageError",
    "StoragePlan",
    "TableInStack",
    "TableView",
    "plan_storage",
]
