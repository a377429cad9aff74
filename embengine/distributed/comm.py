"""The collectives a ShardedEngine uses, on NumPy arrays, counting the bytes each rank sends.

Only what gloo runs natively: ``all_to_all_single`` with uneven splits, ``all_gather`` and
``all_reduce``, always in the engine's own process group (so its collectives never interleave
with DDP's). Arrays cross as zero-copy torch views. Bytes sent count what leaves this rank for
other ranks (an all-to-all's block for itself stays home; an all-gather sends its block to the
W - 1 others, as a ring or a tree would in total).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["Comm", "PeerError"]


class PeerError(RuntimeError):
    """A collective failed: a peer died (its connection reset) or did not answer within the
    process group's timeout (gloo's error does not say which rank)."""


class Comm:
    """Collectives in ``group`` (rank ``rank`` of ``world_size``), counting bytes sent per
    purpose in ``sent`` (a Counter: purpose -> bytes, reset by ``reset``)."""

    def __init__(self, group, rank: int, world_size: int):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.sent: Counter[str] = Counter()

    def _run(self, collective: Callable[[], object], purpose: str) -> None:
        """Run ``collective``; a failure is a PeerError naming this rank, the purpose and the
        peers (gloo's own error chained: it names an address, not a rank)."""
        try:
            collective()
        except RuntimeError as e:
            peers = [r for r in range(self.world_size) if r != self.rank]
            raise PeerError(
                f"rank {self.rank}: a collective ({purpose}) failed: one of ranks {peers} died "
                f"(connection reset) or did not answer within the process group's timeout; "
                f"gloo says: {str(e).strip()}"
            ) from e

    def reset(self) -> Counter[str]:
        """The bytes counted since the last reset, and a fresh count."""
        sent, self.sent = self.sent, Counter()
        return sent

    def all_to_all(self, send: np.ndarray, send_counts: np.ndarray, recv_counts: np.ndarray,
                   purpose: str) -> np.ndarray:  # fmt: skip
        """1-D ``send``, its blocks of ``send_counts[d]`` elements for rank d in rank order ->
        the blocks every rank sent this one, ``recv_counts[s]`` from rank s, in rank order."""
        send = np.ascontiguousarray(send)
        send_counts = [int(c) for c in send_counts]
        recv_counts = [int(c) for c in recv_counts]
        out = np.empty(sum(recv_counts), dtype=send.dtype)
        if self.world_size == 1:
            out[:] = send
            return out
        self.sent[purpose] += (sum(send_counts) - send_counts[self.rank]) * send.itemsize
        self._run(lambda: dist.all_to_all_single(torch.from_numpy(out), torch.from_numpy(send),
                                                 recv_counts, send_counts, group=self.group),
                  purpose)  # fmt: skip
        return out

    def all_gather(self, block: np.ndarray, purpose: str) -> np.ndarray:
        """Every rank's ``block`` (same shape and dtype on every rank), stacked in rank order."""
        block = np.ascontiguousarray(block)
        if self.world_size == 1:
            return block[None].copy()
        self.sent[purpose] += block.nbytes * (self.world_size - 1)
        out = np.empty((self.world_size, *block.shape), dtype=block.dtype)
        self._run(lambda: dist.all_gather([torch.from_numpy(o) for o in out],
                                          torch.from_numpy(block), group=self.group),
                  purpose)  # fmt: skip
        return out

    def all_gather_ragged(self, block: np.ndarray, purpose: str) -> list[np.ndarray]:
        """Every rank's 1-D ``block`` (lengths may differ), in rank order: the lengths first,
        then the blocks padded to the longest (gloo's all_gather wants equal sizes)."""
        block = np.ascontiguousarray(block).reshape(-1)
        lengths = self.all_gather(np.array([len(block)], dtype=np.int64), purpose)[:, 0]
        longest = int(lengths.max()) if len(lengths) else 0
        padded = np.zeros(longest, dtype=block.dtype)
        padded[: len(block)] = block
        stacked = self.all_gather(padded, purpose)
        return [stacked[r, : int(n)] for r, n in enumerate(lengths)]
