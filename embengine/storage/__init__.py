"""Where tables and their optimizer slots live."""

from .dense import Column, DenseTable, StorageError, TableView

__all__ = ["Column", "DenseTable", "StorageError", "TableView"]
