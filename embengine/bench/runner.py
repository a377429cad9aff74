"""Run every configuration of a workload in this process, side by side, and print one table.

For each configuration: build its tables, time the first step (numba compile or cache load
included), run warm-up steps, then time ``steps`` steps, each on a fresh batch. The table shows
the median ms/step, millions of ids per second, the first step, the peak resident memory while
the configuration ran, and for embengine the ratio peer_ms / embengine_ms against its peers
(> 1 means embengine is faster).

Each embengine configuration is timed in a group with its peers (and, on W2, with the same
optimizer packed), interleaved step by step with all of them alive: the ratios we report
(~1-3x, packing ~1.1x) would otherwise be at the mercy of this machine's drift over the seconds
between two configurations run one after the other (+-25%, and 1.3x to 2.5x for the same
SGD-vs-FBGEMM ratio in two runs). Alternating steps puts every member under the same load; the
order of the members alternates too, so none always runs first. A peer shared by several
configurations (torch Adagrad) is timed once in each group. Peak RSS is still each
configuration's own: the process's RSS before the group, plus the memory the configuration
added while being built and stepped, plus the transient peak of its own steps.
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
    group: int = 0  # the group it was timed in (see the module docstring)

    @property
    def m_ids_per_s(self) -> float:
        return self.ids_per_step / self.ms_per_step / 1e3


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (Linux >= 4.0)
    except OSError:
        pass


def _status_gb(field: str) -> float | None:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def peak_rss_gb() -> float:
    peak = _status_gb("VmHWM")
    if peak is not None:
        return peak
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class _Memory:
    """Each member's own peak RSS while several share the process: the RSS before the group
    plus what the member added (build and steps) plus its own steps' transient peak. Call
    ``start()`` before each build or step and ``stop(member)`` after it."""

    def __init__(self, n: int):
        gc.collect()
        self.base = _status_gb("VmRSS")
        self.own = [0.0] * n
        self.peak = [0.0] * n
        self._before = 0.0

    def start(self) -> None:
        if self.base is not None:
            _reset_peak_rss()
            self._before = _status_gb("VmRSS")

    def stop(self, member: int) -> None:
        if self.base is None:  # no /proc: the process's peak for everyone
            self.peak[member] = peak_rss_gb()
            return
        high, after = _status_gb("VmHWM"), _status_gb("VmRSS")
        transient = high - self._before
        self.peak[member] = max(self.peak[member], self.base + self.own[member] + transient)
        self.own[member] += after - self._before


def _time_configs(makes: list[Callable], batches, w: Workload, warmup: int, steps: int,
                  log) -> list[Result]:  # fmt: skip
    """Time one configuration, or several interleaved: step i of each in turn, the order
    reversed every other step, so that none always runs first."""
    memory = _Memory(len(makes))
    runners = []
    for c, make in enumerate(makes):
        memory.start()
        runners.append(make())
        memory.stop(c)
    inputs = [[r.prepare(b) for b in batches[: 1 + warmup + steps]] for r in runners]
    members = range(len(runners))
    times: list[list[float]] = [[] for _ in members]
    firsts = []
    for i in range(1 + warmup + steps):
        for c in members if i % 2 == 0 else reversed(members):
            memory.start()  # the bookkeeping stays outside the timed region
            t0 = time.perf_counter()
            runners[c].step(inputs[c][i])
            elapsed = (time.perf_counter() - t0) * 1e3
            memory.stop(c)
            if i == 0:
                firsts.append((c, elapsed))  # compile or cache load included
            elif i > warmup:
                times[c].append(elapsed)
    first = dict(firsts)
    results = [
        Result(runners[c].name, statistics.median(times[c]), times[c], first[c],
               memory.peak[c], w.ids_per_step)
        for c in members
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
    # Groups of configurations timed together (see the module docstring): (factory, peers).
    groups: list[list[tuple[Callable, tuple[str, ...]]]] = []
    if w.lookup_only:
        group = [(lambda: EngineRunner(w, "SGD"), ("torch F.embedding_bag",))]
        if "torch" in peers:
            group.append((lambda: TorchRunner(w, "SGD"), ()))
        groups.append(group)
        return _run_groups(groups, batches, w, warmup, steps, log)
    wanted = lambda name: w.peers is None or name in w.peers  # noqa: E731
    use_torch = "torch" in peers and len(w.tables) <= 8
    use_fbgemm = False
    if "fbgemm" in peers and all(dim % 4 == 0 for _, dim in w.tables):
        reason = fbgemm_available()
        if reason is not None:
            log(f"  (FBGEMM not measured: {reason}; `make bench` installs fbgemm-gpu-cpu)")
        use_fbgemm = reason is None
    for opt in engine_optimizers:
        if w.optimizers is not None and opt not in w.optimizers:
            continue
        # Packed tables are compared with the same optimizer unpacked.
        group = [
            (lambda o=opt, p=packing: EngineRunner(w, o, packing=p),
             (f"embengine {opt}",) if packing else PEERS.get(opt, ()))
            for packing in w.packing
        ]  # fmt: skip
        for peer in PEERS.get(opt, ()):
            kind, peer_opt = peer.split(" ", 1)
            if not wanted(peer):
                continue
            if kind == "torch" and use_torch:
                group.append((lambda o=peer_opt: TorchRunner(w, o), ()))
            elif kind == "fbgemm" and use_fbgemm:
                group.append((lambda o=peer_opt: FbgemmRunner(w, o), ()))
        groups.append(group)
    return _run_groups(groups, batches, w, warmup, steps, log)


def _run_groups(groups, batches, w: Workload, warmup: int, steps: int, log) -> list[Result]:
    results = []
    for g, group in enumerate(groups):
        timed = _time_configs([make for make, _ in group], batches, w, warmup, steps, log)
        for r, (_, cmp) in zip(timed, group, strict=True):
            r.peers, r.group = cmp, g
            results.append(r)
    return results


def format_results(workload: str, results: list[Result]) -> str:
    """A fixed-width table: one row per configuration, groups (timed together) one after the
    other, each embengine configuration's ratios against the peers of its own group."""
    w = WORKLOADS[workload]
    by_name = {(r.group, r.name): r for r in results}
    lines = [
        f"{w.name}: {w.description}; {w.ids_per_step:,} ids/step; tables "
        f"{w.table_bytes / 2**30:.2f} GiB fp32",
        f"{'configuration':34s} {'ms/step':>9s} {'M ids/s':>8s} {'first ms':>9s} "
        f"{'peak RSS GiB':>12s}  speed-up vs peers (peer ms / embengine ms)",
    ]
    for i, r in enumerate(results):
        if i and r.group != results[i - 1].group:
            lines.append("")
        ratios = ", ".join(
            f"{p}: {by_name[(r.group, p)].ms_per_step / r.ms_per_step:.2f}x"
            for p in r.peers
            if (r.group, p) in by_name
        )
        lines.append(
            f"{r.name:34s} {r.ms_per_step:9.1f} {r.m_ids_per_s:8.1f} {r.first_step_ms:9.0f} "
            f"{r.peak_rss_gb:12.2f}  {ratios}"
        )
    return "\n".join(lines)
