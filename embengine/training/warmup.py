"""Compile the run's kernels before training starts, and say so while it happens.

numba compiles a kernel on its first call and caches it on disk; a first run spends tens of
seconds there, inside the first training step, where a progress bar would turn it into an hour
of ETA. ``compile_kernels`` calls every kernel of a training step and of an evaluation once, on
a miniature engine (the run's features, widths, optimizer and backend, at most MINI_ROWS rows a
table, the run's batch size), before the clock and the bar start, inside
``compile_notice``: a first run prints "compiling kernels, first run only" and the seconds so
far; a later run loads the kernels from numba's cache and prints nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..compile_notice import compile_notice
from ..engine import EmbeddingEngine
from ..inputs import Ragged
from ..torch import EmbeddingLayer
from .sources import DataSource

__all__ = ["compile_kernels", "MINI_ROWS"]

MINI_ROWS = 64


def _mini_batch(sparse: dict[str, Ragged]) -> dict[str, Ragged]:
    return {
        name: Ragged(np.asarray(r.ids) % MINI_ROWS, offsets=r.offsets) for name, r in sparse.items()
    }


def compile_kernels(
    source: DataSource,
    make_engine: Callable[[int], EmbeddingEngine],
    batch_size: int,
    log: Callable[[str], None],
    live: bool,
) -> float:
    """Run one training step and one evaluation lookup of ``make_engine(MINI_ROWS)`` (the run's
    engine with at most MINI_ROWS rows a table) on a batch of ``batch_size`` from ``source``,
    its ids taken modulo MINI_ROWS; return the seconds it took."""
    with compile_notice(log, live) as notice:
        layer = EmbeddingLayer(make_engine(MINI_ROWS))
        batch = next(iter(source.train_batches(batch_size, 0)))
        features = _mini_batch(batch.sparse)
        out = layer(features)
        # The mean's gradient, as the training loss's: a sum's (1 per element) summed over a
        # batch of one row's ids overflowed float16 slots (65504) before training started.
        sum(t.mean() for t in out.values()).backward()
        layer.eval()
        with torch.no_grad():
            layer(features)
    return notice.seconds
