"""W1-floor: each optimizer's update kernel against the floor of the same memory work.

One W1 table (1M rows x 64) per optimizer, W1's batches. Per step, in alternating order, the
engine's fused update (``NumbaBackend.apply``, the kernel the engine runs) and the floor
(``kernels/floor.py``: the same rows, prefetching and gradient sums, every column of each row
read and written once, no math), each on a table of its own with the same layout, so neither
finds rows the other just brought into cache. Printed: median ms of each and update / floor,
the share of the update that is the optimizer's math rather than memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .host import host
from .peers import ENGINE_OPTIMIZERS
from .workloads import WORKLOADS, Workload, make_batches

FLOOR_WORKLOADS = ("W1-floor",)


@dataclass(frozen=True)
class FloorResult:
    optimizer: str
    width: int  # float32 columns per row: weights then slots
    update_ms: float  # median over the timed steps
    floor_ms: float

    @property
    def ratio(self) -> float:
        return self.update_ms / self.floor_ms


def run_floor(
    steps: int = 10,
    warmup: int = 3,
    engine_optimizers: Sequence[str] = tuple(ENGINE_OPTIMIZERS),
    log: Callable[[str], None] = print,
    workload: Workload | None = None,
) -> list[FloorResult]:
    """Time each optimizer's update and the floor on the first table of ``workload`` (default
    W1; see the module docstring); ``warmup`` untimed steps after the first (which compiles)."""
    import embengine as ee
    from embengine.backends.numba_backend import NumbaBackend
    from embengine.inputs import Ragged
    from embengine.kernels.floor import fixed_touch_rows
    from embengine.kernels.pipeline import run_balanced
    from embengine.storage.dense import DenseTable

    if steps < 1 or warmup < 0:
        raise ValueError(f"W1-floor: need steps >= 1 and warmup >= 0, got {steps} and {warmup}")
    w = WORKLOADS["W1"] if workload is None else workload
    rows, dim = w.tables[0]
    batches = make_batches(w, 1 + warmup + steps, seed=0)
    rng = np.random.default_rng(0)
    grad = (rng.standard_normal((w.batch_size, dim)) * 1e-3).astype(np.float32)
    backend = NumbaBackend()
    results = []
    for name in engine_optimizers:
        log(f"W1-floor: {name}")
        opt = ENGINE_OPTIMIZERS[name](dim, False)
        config = ee.TableConfig(rows, dim, name="t")
        engine = ee.EmbeddingEngine({"f": ee.FeatureConfig(config)}, optimizer=opt)
        init = config.effective_initializer
        tables = [DenseTable("t", rows, dim, opt.slot_specs(dim), init, seed) for seed in (0, 1)]
        width = tables[0].data.shape[1]
        floor = fixed_touch_rows(dim, width)
        times: dict[str, list[float]] = {"update": [], "floor": []}
        for i, batch in enumerate(batches):
            prepared = engine.preprocess({"f": Ragged(batch.ids[0], offsets=batch.offsets)})
            tb = prepared.tables[0]
            if tb.unique_rows is None:
                tb = tb.resolved(tables[0], insert=True)
            for kind in ("update", "floor") if i % 2 == 0 else ("floor", "update"):
                t0 = time.perf_counter()
                if kind == "update":
                    backend.apply(tables[0], tb, grad, opt, 0.01, i + 1, False)
                else:
                    run_balanced(
                        floor,
                        tb.unique_offsets,
                        tables[1].data,
                        tb.unique_rows,
                        tb.unique_offsets,
                        tb.unique_gains,
                        tb.unique_segments,
                        grad,
                        0.0,
                        backend.update_prefetch,
                    )
                if i > warmup:
                    times[kind].append(time.perf_counter() - t0)
        results.append(
            FloorResult(
                name,
                width,
                1e3 * float(np.median(times["update"])),
                1e3 * float(np.median(times["floor"])),
            )
        )
    return results


def format_floor(results: list[FloorResult]) -> str:
    lines = [
        host().describe(),
        "W1-floor: one W1 table (1M x 64), the update kernel vs the floor (same rows, no math)",
        f"{'optimizer':20s} {'row floats':>10s} {'update ms':>10s} {'floor ms':>9s} "
        f"{'update / floor':>15s}",
    ]
    for r in results:
        lines.append(
            f"{r.optimizer:20s} {r.width:10d} {r.update_ms:10.2f} {r.floor_ms:9.2f} {r.ratio:15.2f}"
        )
    return "\n".join(lines)
