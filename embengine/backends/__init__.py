"""Backends: ``reference`` (NumPy, the oracle) and ``numba_backend`` (parallel kernels), both
implementing the ``Backend`` protocol. Importing this package loads no numba."""

from .protocol import Backend

__all__ = ["Backend"]
