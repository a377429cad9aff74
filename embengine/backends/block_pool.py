"""Memory for the arrays of prepared batches, reused once nothing uses it.

A prepared batch holds about ten arrays of one entry per id. Allocated afresh every step, each
came from glibc as new pages, which the first kernel to write them had to fault in and zero, a
large share of W2's preparation (glibc hands big freed blocks back to the OS, and NumPy asks for
huge pages, each zeroed on its first touch; figures: docs/performance.md, "Figures behind the
code"). Taking the arrays from blocks that outlive the batch keeps those
pages mapped and warm.

A block is free when no array carved from it is alive. Every NumPy view keeps a reference to
the array that owns its memory (``base`` is always the owner), so the owner's reference count
says whether anything still uses it: a batch the caller still holds, a ``torch.from_numpy`` of
one of its arrays, a slice kept for later. Nothing has to be returned by hand, and memory is
never reused while visible.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref

import numpy as np

__all__ = ["BlockPool", "Carver"]

_ALIGN = 64  # each carved array starts on a cache line

# Every live pool, so that a forked child can reset their locks (a fork while another thread
# held one would leave it locked for good in the child).
_POOLS: weakref.WeakSet[BlockPool] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for pool in list(_POOLS):
        pool._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class BlockPool:
    """Blocks of bytes handed out by ``take`` and taken back when unused.

    Liveness is read from CPython reference counts, which a free-threaded build does not keep
    exactly; embengine targets the default (GIL) build.

    Args:
      max_free: unused blocks kept for reuse; more are released to the allocator (a caller
        holding many batches at once, e.g. a prefetch queue, should not pin them all after).
      max_slack: a free block is reused for a request of ``n`` bytes only if it holds at most
        ``max_slack * n`` bytes, so one large batch does not pin a block for small ones.
    """

    def __init__(self, max_free: int = 2, max_slack: float = 4.0):
        if max_free < 0:
            raise ValueError(f"max_free must be >= 0, got {max_free}")
        if max_slack < 1:
            raise ValueError(f"max_slack must be >= 1, got {max_slack}")
        self.max_free = max_free
        self.max_slack = max_slack
        self._blocks: list[np.ndarray] = []
        self._idle_refs: list[int] = []  # each block's reference count when nothing uses it
        self._lock = threading.Lock()  # preparation releases the GIL: threads may share a pool
        _POOLS.add(self)

    # A copy or an unpickled pool (an engine sent to a DataLoader worker) starts empty: blocks
    # are a cache, and a lock cannot be pickled.
    def __getstate__(self) -> dict:
        return {"max_free": self.max_free, "max_slack": self.max_slack}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def _refs(self, i: int) -> int:
        return sys.getrefcount(self._blocks[i])

    def _free(self) -> list[int]:
        return [i for i in range(len(self._blocks)) if self._refs(i) == self._idle_refs[i]]

    def _release_surplus(self, free: list[int], keep: int | None = None) -> int | None:
        """Drop the oldest free blocks beyond ``max_free`` (``free`` minus ``keep``); returns
        ``keep``'s index after the deletions."""
        others = [i for i in free if i != keep]
        for i in sorted(others[: max(0, len(others) - self.max_free)], reverse=True):
            del self._blocks[i], self._idle_refs[i]
            if keep is not None and i < keep:
                keep -= 1
        return keep

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 block of at least ``nbytes`` bytes that nothing else uses: the smallest free
        one that fits, else a new one (with 1/8 spare, so batches that grow a little reuse it).
        The caller carves its arrays from it (see ``Carver``)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        with self._lock:
            free = self._free()
            fits = [
                i
                for i in free
                if nbytes <= len(self._blocks[i]) <= self.max_slack * max(nbytes, _ALIGN)
            ]
            chosen = min(fits, key=lambda i: len(self._blocks[i])) if fits else None
            chosen = self._release_surplus(free, keep=chosen)
            if chosen is not None:
                return self._blocks[chosen]
            self._blocks.append(np.empty(nbytes + nbytes // 8 + _ALIGN, dtype=np.uint8))
            self._idle_refs.append(self._refs(len(self._blocks) - 1))
            return self._blocks[-1]

    def trim(self) -> None:
        """Release free blocks beyond ``max_free`` now (``take`` does it too; a caller whose
        batches stopped needing the pool calls this so the last big ones do not stay pinned)."""
        with self._lock:
            if self._blocks:
                self._release_surplus(self._free())

    @property
    def nbytes(self) -> int:
        """Bytes held in all blocks, used or free."""
        with self._lock:
            return sum(len(b) for b in self._blocks)


class Carver:
    """Cuts arrays one after another out of a block, each aligned to a cache line.

    ``Carver.size`` adds up what a list of arrays needs, so the block can be taken first."""

    def __init__(self, block: np.ndarray):
        self._block = block
        self._offset = -block.ctypes.data % _ALIGN

    @staticmethod
    def size(*arrays: tuple[int, type]) -> int:
        """Bytes for arrays of (length, dtype), with alignment padding."""
        lines = sum(-(-n * np.dtype(dt).itemsize // _ALIGN) for n, dt in arrays)
        return (lines + 1) * _ALIGN  # + 1: the block's own start may be off a line

    def empty(self, n: int, dtype) -> np.ndarray:
        """An uninitialised array of ``n`` elements of ``dtype`` from the block."""
        nbytes = n * np.dtype(dtype).itemsize
        start = self._offset
        if start + nbytes > len(self._block):
            raise ValueError(
                f"block of {len(self._block)} bytes is full: {nbytes} more needed at {start}"
            )
        self._offset = start + -(-nbytes // _ALIGN) * _ALIGN
        return self._block[start : start + nbytes].view(dtype)
