"""numba's on-disk cache of every kernel, invalidated by one digest of the kernels folder.

numba keys a cached kernel on a stamp of the one file that defines it (its content hash in
numba 0.68, its timestamp in older ones), but the compiled kernel also holds the code it
inlines or calls from other files: after an edit to ``prepare.py`` alone, the cached training
lookup (``train_lookup.py``) kept the old combiner gains. So every kernel made with
``embengine.kernels.kernel`` is stamped with (numba's own stamp of its file, ``digest()``),
``digest()`` being a hash of every ``.py`` file in ``embengine/kernels`` (``__pycache__``
aside): any edit in the folder recompiles each kernel on its first use, and a new module there
needs no registration. A generated update kernel (``kernels/row_math.py``) lives outside the
folder; its own file's stamp covers what it adds (its text holds a hash of the row math's
source).

numba internals used here, checked at import (a numba that differs is an ImportError naming
its version, never a kernel cached under numba's stamp alone): ``Dispatcher.enable_caching``
(what ``cache=True`` does) setting ``Dispatcher._cache = FunctionCache(py_func)``, which
``stamped`` does with a subclass; ``FunctionCache._impl_class``, a
``CompileResultCacheImpl`` whose ``locator`` property returns its ``_locator``;
``Cache.__init__`` taking the index's stamp from ``locator.get_source_stamp()``, and the index
loader dropping entries of another stamp.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numba
from numba.core import caching, dispatcher

__all__ = ["StampedCache", "digest", "folder_digest", "stamped"]

FOLDER = Path(__file__).resolve().parent

_WHAT_WE_USE = (
    "Dispatcher.enable_caching setting _cache = FunctionCache(py_func); "
    "FunctionCache._impl_class = CompileResultCacheImpl, whose locator property returns "
    "_locator; Cache.__init__ calling locator.get_source_stamp(); "
    "IndexDataCacheFile._load_index comparing _source_stamp"
)


def _numba_differs(problem: str) -> ImportError:
    return ImportError(
        f"embengine.kernels.cache_stamp: numba {numba.__version__} is not what it extends "
        f"({problem}). It uses {_WHAT_WE_USE} (numba 0.68). Install a numba version embengine "
        "supports, or update embengine/kernels/cache_stamp.py for this one."
    )


def _check_numba() -> None:
    """Raise ImportError unless numba's internals are those this module extends."""
    names = dispatcher.Dispatcher.enable_caching.__code__.co_names
    if "FunctionCache" not in names or "_cache" not in names:
        raise _numba_differs("Dispatcher.enable_caching does not set _cache = FunctionCache")
    if getattr(caching.FunctionCache, "_impl_class", None) is not caching.CompileResultCacheImpl:
        raise _numba_differs("FunctionCache._impl_class is not CompileResultCacheImpl")
    locator = getattr(caching.CacheImpl, "locator", None)
    if not isinstance(locator, property) or "_locator" not in locator.fget.__code__.co_names:
        raise _numba_differs("CacheImpl.locator does not return _locator")
    init = caching.Cache.__init__.__code__.co_names
    if not {"_impl_class", "get_source_stamp", "IndexDataCacheFile"} <= set(init):
        raise _numba_differs("Cache.__init__ does not stamp its index with get_source_stamp()")
    if "_source_stamp" not in caching.IndexDataCacheFile._load_index.__code__.co_names:
        raise _numba_differs("IndexDataCacheFile._load_index does not compare the stamp")


_check_numba()


def folder_digest(folder: Path) -> str:
    """sha256 of every ``.py`` file under ``folder``, ``__pycache__`` (and the generated
    modules there) aside: each file's path, then its bytes, in path order."""
    h = hashlib.sha256()
    for path in sorted(folder.rglob("*.py")):
        relative = path.relative_to(folder)
        if "__pycache__" in relative.parts:
            continue
        h.update(relative.as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def digest() -> str:
    """``folder_digest`` of this kernels folder, computed once per process."""
    return folder_digest(FOLDER)


class _StampedLocator:
    """numba's locator for one function, its source stamp paired with ``digest()``."""

    def __init__(self, locator):
        self._locator = locator

    def get_source_stamp(self):
        return (self._locator.get_source_stamp(), digest())

    def __getattr__(self, name: str):
        return getattr(self._locator, name)


class _StampedImpl(caching.CompileResultCacheImpl):
    def __init__(self, py_func):
        super().__init__(py_func)
        self._locator = _StampedLocator(self._locator)


class StampedCache(caching.FunctionCache):
    """numba's FunctionCache, whose index entries hold only for this kernels folder's digest
    (an index of another stamp reads as empty, so the kernel compiles and overwrites it)."""

    _impl_class = _StampedImpl


def stamped(disp):
    """Give the dispatcher ``disp`` an on-disk cache, a StampedCache, as numba's
    ``enable_caching`` (``cache=True``) gives it a FunctionCache; returns ``disp``."""
    cache = getattr(disp, "_cache", None)
    if isinstance(cache, StampedCache):
        return disp
    if not isinstance(disp, dispatcher.Dispatcher) or type(cache) not in _REPLACEABLE:
        raise TypeError(
            f"cache stamp: {getattr(disp, '__name__', disp)!r} is not a numba function "
            f"dispatcher with no cache or numba's FunctionCache ({type(cache).__name__}, "
            f"numba {numba.__version__})"
        )
    disp._cache = StampedCache(disp.py_func)
    return disp


_REPLACEABLE = (caching.NullCache, caching.FunctionCache)
