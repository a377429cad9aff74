"""The backends by name: what ``EmbeddingEngine(backend=...)`` and a ``Preprocessor`` build.

Its own module so that the engine and the Preprocessor (which the engine creates) both import
it without importing each other. Importing it loads no numba: a backend's module is imported
when it is built.
"""

from __future__ import annotations

__all__ = ["BACKENDS", "make_backend"]

BACKENDS = ("numba", "reference")


def make_backend(name: str):
    """A new backend object for ``name``, one of ``BACKENDS``; ValueError for another name."""
    if name == "numba":
        from .numba_backend import NumbaBackend

        return NumbaBackend()
    if name == "reference":
        from .reference import ReferenceBackend

        return ReferenceBackend()
    raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")
