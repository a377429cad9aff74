"""Benchmark workloads: tables and a stream of fresh Zipf-distributed batches.

Each step draws a new batch (microbenchmarks that reuse one batch measure the cache, not the
memory). Ids follow a bounded Zipf(s) law over ranks, scattered over the table by a fixed random
permutation per table, so hot ids are not neighbours in memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["Workload", "WORKLOADS", "Batch", "make_batches"]


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    tables: tuple[tuple[int, int], ...]  # (rows, dim) per table
    batch_size: int
    bag_size: int
    zipf: float = 1.05
    lookup_only: bool = False
    packing: tuple[bool, ...] = field(default=(False,))
    # Restrict the configurations run (None: all requested); peers by name, e.g. "torch SGD".
    optimizers: tuple[str, ...] | None = None
    peers: tuple[str, ...] | None = None

    @property
    def ids_per_step(self) -> int:
        return len(self.tables) * self.batch_size * self.bag_size

    @property
    def table_bytes(self) -> int:
        return sum(rows * dim * 4 for rows, dim in self.tables)


def _w2_tables() -> tuple[tuple[int, int], ...]:
    dims = (1, 2, 4, 8, 16)
    return tuple((100_000, dims[i % len(dims)]) for i in range(100))


WORKLOADS = {
    "W1": Workload(
        "W1",
        "8 tables x 1M rows x dim 64, batch 4096, 20 ids/bag, Zipf 1.05",
        ((1_000_000, 64),) * 8,
        4096,
        20,
    ),
    "W1-lookup": Workload(
        "W1-lookup", "W1, forward only", ((1_000_000, 64),) * 8, 4096, 20, lookup_only=True
    ),
    "W2": Workload(
        "W2",
        "100 tables x 100K rows, dims 1/2/4/8/16, batch 4096, 4 ids/bag",
        _w2_tables(),
        4096,
        4,
        packing=(False, True),
    ),
    # W3 checks that the cost per id does not grow with the vocabulary; the optimizers with the
    # smallest state keep it within RAM (20M x 64 fp32 is 5 GiB before slots).
    "W3": Workload(
        "W3",
        "1 table x 20M rows x dim 64, batch 4096, 20 ids/bag, Zipf 1.05",
        ((20_000_000, 64),),
        4096,
        20,
        optimizers=("SGD", "rowwise Adagrad"),
        peers=("fbgemm EXACT_SGD", "fbgemm EXACT_ROWWISE_ADAGRAD"),
    ),
    # W3's control: the same batches' shape on a 1M-row table. W1 has 8 tables to spread over
    # the threads and 8x the ids per step, so W3 / W3-small isolates the vocabulary's share.
    "W3-small": Workload(
        "W3-small",
        "W3 with 1M rows",
        ((1_000_000, 64),),
        4096,
        20,
        optimizers=("SGD", "rowwise Adagrad"),
        peers=("fbgemm EXACT_SGD", "fbgemm EXACT_ROWWISE_ADAGRAD"),
    ),
}


@dataclass(frozen=True)
class Batch:
    ids: tuple[np.ndarray, ...]  # per table, int64 [batch_size * bag_size], table-local row ids
    offsets: np.ndarray  # int64 [batch_size + 1], the same for every table (fixed bag size)


def _zipf_cdf(n: int, s: float) -> np.ndarray:
    cdf = np.cumsum(np.arange(1, n + 1, dtype=np.float64) ** -s)
    return cdf / cdf[-1]


def make_batches(w: Workload, count: int, seed: int = 0) -> list[Batch]:
    """``count`` independent batches of the workload (bounded Zipf over ranks, by inverse CDF)."""
    rng = np.random.default_rng(seed)
    cdfs = {rows: _zipf_cdf(rows, w.zipf) for rows in {rows for rows, _ in w.tables}}
    perms = [rng.permutation(rows).astype(np.int64) for rows, _ in w.tables]
    n = w.batch_size * w.bag_size
    offsets = np.arange(0, n + 1, w.bag_size, dtype=np.int64)
    batches = []
    for _ in range(count):
        ids = []
        for (rows, _), perm in zip(w.tables, perms, strict=True):
            ranks = np.searchsorted(cdfs[rows], rng.random(n))
            np.minimum(ranks, rows - 1, out=ranks)
            ids.append(perm[ranks])
        batches.append(Batch(tuple(ids), offsets))
    return batches
