"""Compile the run's kernels before training starts, and say so while it happens.

numba compiles a kernel on its first call and caches it on disk; a first run spends tens of
seconds there, inside the first training step, where a progress bar would turn it into an hour
of ETA. ``compile_kernels`` calls every kernel of a training step and of an evaluation once, on
a miniature engine (the run's features, widths, optimizer and backend, at most MINI_ROWS rows a
table, the run's batch size), before the clock and the bar start. When that takes longer than
NOTICE_AFTER seconds it prints "compiling kernels, first run only" and a line with the seconds
so far; a later run loads the kernels from numba's cache and prints nothing.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from ..engine import EmbeddingEngine
from ..inputs import Ragged
from ..torch import EmbeddingLayer
from .sources import DataSource

__all__ = ["compile_kernels", "NOTICE_AFTER", "MINI_ROWS"]

# CPU seconds of this process: loading cached kernels takes less, compiling them far more. CPU
# time, not wall time: on a loaded machine loading can take seconds of wall time.
NOTICE_AFTER = 5.0
MINI_ROWS = 64
NOTICE = "compiling kernels, first run only (numba caches them for later runs)"


class _Notice:
    """A thread that, unless stopped first, prints NOTICE once the process has used ``delay``
    CPU seconds since it started, then rewrites one stderr line with the seconds elapsed (only
    on a terminal)."""

    def __init__(self, log: Callable[[str], None], delay: float, live: bool):
        self.log, self.delay, self.live = log, delay, live
        self.done = threading.Event()
        self.shown = False
        self.start = time.perf_counter()
        self.cpu_start = time.process_time()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while time.process_time() - self.cpu_start < self.delay:
            if self.done.wait(0.1):
                return
        self.shown = True
        self.log(NOTICE)
        while self.live and not self.done.wait(1.0):
            sys.stderr.write(f"\rcompiling kernels: {time.perf_counter() - self.start:.0f} s")
            sys.stderr.flush()

    def stop(self) -> float:
        self.done.set()
        self.thread.join()
        seconds = time.perf_counter() - self.start
        self.cpu_seconds = time.process_time() - self.cpu_start
        if self.shown:
            if self.live:
                sys.stderr.write("\r\033[K")
                sys.stderr.flush()
            self.log(f"kernels compiled in {seconds:.1f} s")
        return seconds


def _mini_batch(sparse: dict[str, Ragged]) -> dict[str, Ragged]:
    return {name: Ragged(np.asarray(r.ids) % MINI_ROWS, offsets=r.offsets)
            for name, r in sparse.items()}  # fmt: skip


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
    notice = _Notice(log, NOTICE_AFTER, live and sys.stderr.isatty())
    try:
        layer = EmbeddingLayer(make_engine(MINI_ROWS))
        batch = next(iter(source.train_batches(batch_size, 0)))
        features = _mini_batch(batch.sparse)
        out = layer(features)
        sum(t.sum() for t in out.values()).backward()
        layer.eval()
        with torch.no_grad():
            layer(features)
    finally:
        seconds = notice.stop()
    return seconds
