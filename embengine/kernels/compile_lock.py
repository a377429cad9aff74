"""A cross-process lock around numba's on-disk cache of each kernel.

numba's cache is not process-safe (numba issue #4807): ``IndexDataCacheFile.save`` reads the
function's index, takes the first free data file name, writes the index, then the data. Two
processes compiling different specialisations of one function at once both take
``<function>.1.nbc``; the last index writer and the last data writer can differ, so a signature
maps to another signature's machine code (a pooling kernel of the wrong width corrupted the
heap). This module serialises each cached function's cache across processes:

- the lock is an exclusive ``fcntl.flock`` on ``<index>.lock``, beside the function's index in
  numba's cache folder, so every function whose index is that file shares it (closures of one
  factory share one index);
- a load takes it; on a hit it is released at once, on a miss it is held while this process
  compiles and saves, so another process wanting the same function waits and then loads the
  entry instead of compiling it; a save (index + data) always holds it;
- a compile that raises releases it (numba's "numba:compile" END event carries the exception);
- within a process the lock is reentrant (a count per lock file, one open file while held):
  numba compiles callees inside a caller's compile (their own locks) and may compile the same
  function again (flock is per open file description, so a second open would wait for
  itself). Threads need nothing more: numba compiles under its process-wide
  ``global_compiler_lock``, which every call here runs under.

``locked(dispatcher)`` wraps a dispatcher's ``_cache``; ``embengine.kernels.kernel`` applies
it to every kernel. numba internals this relies on are checked at import: a numba that
differs is an ImportError naming its version, never an unlocked cache.
"""

from __future__ import annotations

import fcntl
import os

import numba
from numba.core import caching, dispatcher, event
from numba.core.compiler_lock import global_compiler_lock

__all__ = ["LockedCache", "locked"]

_WHAT_WE_WRAP = (
    "Dispatcher.compile calling self._cache.load_overload / save_overload around a "
    "'numba:compile' event, numba.core.caching.Cache with an IndexDataCacheFile "
    "(_cache_file._index_path), numba.core.event listeners"
)


def _numba_differs(problem: str) -> ImportError:
    return ImportError(
        f"embengine.kernels.compile_lock: numba {numba.__version__} is not what it wraps "
        f"({problem}). It wraps {_WHAT_WE_WRAP} (numba 0.68). Install a numba version "
        "embengine supports, or update embengine/kernels/compile_lock.py for this one."
    )


def _failed(ev: event.Event) -> bool:
    """Whether an END event carries an exception. (numba's ``Event.is_failed`` says the
    opposite: it is ``exc_details is None`` in 0.68.)"""
    return ev._exc_details is not None


def _check_numba() -> None:
    """Raise ImportError unless numba's internals are those this module wraps."""
    compile_code = dispatcher.Dispatcher.compile.__code__
    for name in ("_cache", "load_overload", "save_overload", "trigger_event"):
        if name not in compile_code.co_names:
            raise _numba_differs(f"Dispatcher.compile does not use {name!r}")
    if "numba:compile" not in compile_code.co_consts:
        raise _numba_differs("Dispatcher.compile fires no 'numba:compile' event")
    for name in ("load_overload", "save_overload", "flush", "enable", "disable", "cache_path"):
        if not hasattr(caching.Cache, name):
            raise _numba_differs(f"numba.core.caching.Cache has no {name!r}")
    if not hasattr(caching.IndexDataCacheFile, "save"):
        raise _numba_differs("numba.core.caching.IndexDataCacheFile has no 'save'")
    if not all(hasattr(event, n) for n in ("register", "Listener", "Event", "EventStatus")):
        raise _numba_differs("numba.core.event has no register / Listener / Event")
    probe = event.Event("numba:compile", event.EventStatus.END, exc_details=(ValueError,) * 3)
    clean = event.Event("numba:compile", event.EventStatus.END, exc_details=(None,) * 3)
    if not (getattr(probe, "_exc_details", None) and _failed(probe) and not _failed(clean)):
        raise _numba_differs("an END event does not keep its exception in _exc_details")


_check_numba()


class _FileLock:
    """An exclusive flock on one file, reentrant within this process. The file is open only
    while the lock is held: a forked child must not share a lock its parent takes later."""

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None
        self._depth = 0

    def acquire(self) -> None:
        if self._depth == 0:
            # Read-only is enough for flock, and opens a lock file another user created.
            flags = os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC
            try:
                fd = os.open(self.path, flags, 0o666)
            except FileNotFoundError:  # numba makes its cache folder only at the first save
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                fd = os.open(self.path, flags, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
        self._depth += 1

    def release(self) -> None:
        if self._depth <= 0:
            raise RuntimeError(f"compile lock {self.path} released more often than taken")
        self._depth -= 1
        if self._depth == 0:
            fd, self._fd = self._fd, None
            os.close(fd)  # releases the flock

    def forget_after_fork(self) -> None:
        """In a forked child: drop the parent's hold (the parent releases it, not the child)."""
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._depth = None, 0


# One lock per lock file in this process (closures sharing an index share it).
_LOCKS: dict[str, _FileLock] = {}


def _lock_for(path: str) -> _FileLock:
    path = os.path.abspath(path)
    with global_compiler_lock:
        lock = _LOCKS.get(path)
        if lock is None:
            lock = _LOCKS[path] = _FileLock(path)
        return lock


def _forget_locks_after_fork() -> None:
    for lock in _LOCKS.values():
        lock.forget_after_fork()


os.register_at_fork(after_in_child=_forget_locks_after_fork)


class LockedCache:
    """A dispatcher's numba ``Cache`` with its loads and saves under the function's
    cross-process lock; everything else is delegated."""

    def __init__(self, cache: caching.Cache):
        self._cache = cache
        self._lock = _lock_for(cache._cache_file._index_path + ".lock")
        # Misses whose compile has not ended: each holds the lock until its save or failure.
        self._compiling = 0

    @property
    def lock_path(self) -> str:
        return self._lock.path

    def load_overload(self, sig, target_context):
        """The cached entry for ``sig``, or None; on None the lock stays held for the compile."""
        self._lock.acquire()
        try:
            data = self._cache.load_overload(sig, target_context)
        except BaseException:
            self._lock.release()
            raise
        if data is None:
            self._compiling += 1
        else:
            self._lock.release()
        return data

    def save_overload(self, sig, data) -> None:
        """Save index and data under the lock; then end the compile that missed."""
        self._lock.acquire()
        try:
            self._cache.save_overload(sig, data)
        finally:
            self._lock.release()
            self.compile_ended()

    def compile_ended(self) -> None:
        """Release the hold of the latest miss still compiling, if any."""
        if self._compiling:
            self._compiling -= 1
            self._lock.release()

    def flush(self) -> None:
        with global_compiler_lock:
            self._lock.acquire()
            try:
                self._cache.flush()
            finally:
                self._lock.release()

    def __getattr__(self, name: str):
        return getattr(self._cache, name)

    def __repr__(self) -> str:
        return f"<LockedCache {self._cache!r} lock={self._lock.path!r}>"


class _ReleaseOnFailedCompile(event.Listener):
    """A compile that raises never reaches ``save_overload``: release its hold here."""

    def on_start(self, ev: event.Event) -> None:
        pass

    def on_end(self, ev: event.Event) -> None:
        if _failed(ev):
            cache = getattr(ev.data.get("dispatcher"), "_cache", None)
            if isinstance(cache, LockedCache):
                cache.compile_ended()


event.register("numba:compile", _ReleaseOnFailedCompile())


def locked(disp):
    """Put ``disp``'s on-disk cache (``cache=True``) under its cross-process lock; returns
    ``disp``. A dispatcher without numba's file cache is a TypeError."""
    cache = getattr(disp, "_cache", None)
    if isinstance(cache, LockedCache):
        return disp
    if not isinstance(disp, dispatcher.Dispatcher) or not isinstance(cache, caching.Cache):
        raise TypeError(
            f"compile lock: {getattr(disp, '__name__', disp)!r} has no on-disk numba cache "
            f"({type(cache).__name__}); compile it with cache=True (numba {numba.__version__})"
        )
    if not isinstance(getattr(getattr(cache, "_cache_file", None), "_index_path", None), str):
        raise _numba_differs(f"{type(cache).__name__} has no _cache_file._index_path")
    disp._cache = LockedCache(cache)
    return disp
