"""Run every configuration of a workload in this process, side by side, and print one table.

For each configuration: build its tables, time the first step (numba compile or cache load
included), run warm-up steps, then time ``steps`` steps, each on a fresh batch. The table shows
the median ms/step, millions of ids per second, the first step, the peak resident memory while
the configuration ran, and for embengine the ratio peer_ms / embengine_ms against its peers
(> 1 means embengine is faster).

Packing's pairs (the same optimizer with low-dimensional packing off and on, W2) and the
lookup-only pair (embengine and torch's ``F.embedding_bag``, W1-lookup) are timed interleaved,
step by step, with both alive: the differences within them (~10%) are smaller than this
machine's drift over the seconds between two configurations run one after the other (+-25%),
and alternating steps puts both under the same load. Their peak RSS is that of the pair
together (the training workloads, one configuration at a time, show each one's own).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from .peers import EngineRunner, FbgemmRunner, TorchRunner, fbgemm_available
from .workloads import WORKLOADS, Workload, make_batches

__all__ = ["Result", "run_workload", "format_results", "PEERS"]

# Which peers each embengine configuration is compared with (torch has no FTRL: its Adagrad
# keeps the same per-row state size).
PEERS = {
    "SGD": ("torch SGD", "fbgemm EXACT_SGD"),
    "Adagrad": ("torch Adagrad", "fbgemm EXACT_ADAGRAD"),
    "rowwise Adagrad": ("torch Adagrad", "fbgemm EXACT_ROWWISE_ADAGRAD"),
    "Adam": ("torch SparseAdam",),
    "FTRL": ("torch Adagrad",),
}


@dataclass
class Result:
    name: str
    ms_per_step: float
    ms_all: list[float]
    first_step_ms: float
    peak_rss_gb: float
    ids_per_step: int
    peers: tuple[str, ...] = ()
    interleaved: bool = False  # timed step by step with others; peak RSS is theirs together

    @property
    def m_ids_per_s(self) -> float:
        return self.ids_per_step / self.ms_per_step / 1e3


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (Linux >= 4.0)
    except OSError:
        pass


def peak_rss_gb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _time_configs(makes: list[Callable], batches, w: Workload, warmup: int, steps: int,
                  log) -> list[Result]:  # fmt: skip
    """Time one configuration, or several interleaved (step i of each in turn, the order
    alternating from step to step, so that none always runs first)."""
    gc.collect()
    _reset_peak_rss()
    runners = [make() for make in makes]
    inputs = [[r.prepare(b) for b in batches[: 1 + warmup + steps]] for r in runners]
    firsts = []
    for runner, xs in zip(runners, inputs, strict=True):
        t0 = time.perf_counter()
        runner.step(xs[0])
        firsts.append((time.perf_counter() - t0) * 1e3)
    for i in range(1, 1 + warmup):
        for runner, xs in zip(runners, inputs, strict=True):
            runner.step(xs[i])
    times: list[list[float]] = [[] for _ in runners]
    for i in range(1 + warmup, 1 + warmup + steps):
        turn = list(range(len(runners)))
        for c in turn if i % 2 == 0 else turn[::-1]:
            t0 = time.perf_counter()
            runners[c].step(inputs[c][i])
            times[c].append((time.perf_counter() - t0) * 1e3)
    peak = peak_rss_gb()
    results = [
        Result(runner.name, statistics.median(ts), ts, first, peak, w.ids_per_step,
               interleaved=len(runners) > 1)
        for runner, ts, first in zip(runners, times, firsts, strict=True)
    ]  # fmt: skip
    for runner in runners:
        runner.close()
    del runners, inputs
    gc.collect()
    for result in results:
        log(f"  {result.name:34s} {result.ms_per_step:9.1f} ms/step")
    return results


def run_workload(
    name: str,
    *,
    steps: int = 10,
    warmup: int = 3,
    engine_optimizers: tuple[str, ...] = ("SGD", "Adagrad", "rowwise Adagrad", "Adam", "FTRL"),
    peers: tuple[str, ...] = ("torch", "fbgemm"),
    log=print,
) -> list[Result]:
    """Time embengine and its peers on workload ``name`` (see workloads.WORKLOADS)."""
    w = WORKLOADS[name]
    log(f"{w.name}: {w.description} ({w.ids_per_step:,} ids/step); generating batches")
    batches = make_batches(w, 1 + warmup + steps)
    # Groups of configurations timed together (see _time_configs): (factory, peers) each.
    groups: list[list[tuple[Callable, tuple[str, ...]]]] = []
    if w.lookup_only:  # embengine and torch's lookup, interleaved (tables 2 x 1.9 GiB on W1)
        group = [(lambda: EngineRunner(w, "SGD"), ("torch F.embedding_bag",))]
        if "torch" in peers:
            group.append((lambda: TorchRunner(w, "SGD"), ()))
        groups.append(group)
    else:
        for opt in engine_optimizers:
            if w.optimizers is not None and opt not in w.optimizers:
                continue
            # Packed tables are compared with the same optimizer unpacked, interleaved.
            groups.append([
                (lambda o=opt, p=packing: EngineRunner(w, o, packing=p),
                 (f"embengine {opt}",) if packing else PEERS.get(opt, ()))
                for packing in w.packing
            ])  # fmt: skip
        wanted = lambda name: w.peers is None or name in w.peers  # noqa: E731
        if "torch" in peers and len(w.tables) <= 8:
            for opt in ("SGD", "Adagrad", "SparseAdam"):
                if wanted(f"torch {opt}"):
                    groups.append([(lambda o=opt: TorchRunner(w, o), ())])
        if "fbgemm" in peers:
            reason = fbgemm_available()
            if reason is not None:
                log(f"  (FBGEMM not measured: {reason}; `make bench` installs fbgemm-gpu-cpu)")
            elif all(dim % 4 == 0 for _, dim in w.tables):
                for opt in ("EXACT_SGD", "EXACT_ADAGRAD", "EXACT_ROWWISE_ADAGRAD"):
                    if wanted(f"fbgemm {opt}"):
                        groups.append([(lambda o=opt: FbgemmRunner(w, o), ())])
    results = []
    for group in groups:
        timed = _time_configs([make for make, _ in group], batches, w, warmup, steps, log)
        for r, (_, cmp) in zip(timed, group, strict=True):
            r.peers = cmp
            results.append(r)
    return results


def format_results(workload: str, results: list[Result]) -> str:
    """A fixed-width table: one row per configuration, ratios against its peers."""
    w = WORKLOADS[workload]
    by_name = {r.name: r for r in results}
    lines = [
        f"{w.name}: {w.description}; {w.ids_per_step:,} ids/step; tables "
        f"{w.table_bytes / 2**30:.2f} GiB fp32",
        f"{'configuration':34s} {'ms/step':>9s} {'M ids/s':>8s} {'first ms':>9s} "
        f"{'peak RSS GiB':>12s}  speed-up vs peers (peer ms / embengine ms)",
    ]
    for r in results:
        ratios = ", ".join(
            f"{p}: {by_name[p].ms_per_step / r.ms_per_step:.2f}x" for p in r.peers if p in by_name
        )
        rss = f"{r.peak_rss_gb:.2f}" + ("*" if r.interleaved else " ")
        lines.append(
            f"{r.name:34s} {r.ms_per_step:9.1f} {r.m_ids_per_s:8.1f} {r.first_step_ms:9.0f} "
            f"{rss:>13s} {ratios}"
        )
    if any(r.interleaved for r in results):
        lines.append("* timed interleaved with its pair, step by step; peak RSS of the pair")
    return "\n".join(lines)
