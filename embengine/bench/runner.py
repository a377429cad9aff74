"""Run every configuration of a workload in this process, side by side, and print one table.

For each configuration: build its tables, time the first step (numba compile or cache load
included), run warm-up steps, then time ``steps`` steps, each on a fresh batch. The table shows
the median ms/step, millions of ids per second, the first step, the peak resident memory while
the configuration ran, and for embengine the ratio peer_ms / embengine_ms against its peers
(> 1 means embengine is faster).

Each embengine configuration is timed in a group with its peers (and, on W2, with the same
optimizer packed), interleaved with all of them alive: the ratios we report (~1-3x, packing
~1.1x) would otherwise be at the mercy of this machine's drift over the seconds between two
configurations run one after the other (+-25%, and 1.3x to 2.5x for the same SGD-vs-FBGEMM
ratio in two runs). Members take turns in blocks of a few steps (the first of each block
untimed, see _time_configs), which puts every member under the same load while each timed
step follows a step of its own; the order of the members alternates too, so none always runs
first. A peer shared by several configurations (torch Adagrad) is timed once in each group.
Peak RSS is still each configuration's own: the process's RSS before the group, plus the
memory the configuration added while being built and stepped, plus the transient peak of its
own steps; after each group the freed heap goes back to the OS, so a group's RSS does not
include its predecessors'.

W3's target compares workloads (W3's cost per id against W1's), so ``run_vocabulary`` times
the same system on W1, W3 and W3-small interleaved in one group too.
"""

from __future__ import annotations

import ctypes
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from .host import host
from .peers import EngineRunner, FbgemmRunner, TorchRunner, engine_name, fbgemm_available
from .workloads import WORKLOADS, Workload, make_batches

__all__ = [
    "Result",
    "run_workload",
    "format_results",
    "run_vocabulary",
    "format_vocabulary",
    "PEERS",
]

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
    workload: str = ""

    @property
    def m_ids_per_s(self) -> float:
        return self.ids_per_step / self.ms_per_step / 1e3


def _release_memory() -> None:
    """Free a finished group's memory and hand it back to the OS: glibc keeps freed heap
    chunks (W2's hundreds of small tables left over a GiB resident), which the next group's
    peak RSS, measured from the process's RSS, would otherwise count as its own."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


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


# A member of a timed group: its runner's factory, the batches it steps on, their workload.
Member = tuple[Callable, list, Workload]


# Members take turns in blocks of this many consecutive steps; the first step of a block runs
# untimed, after another member's steps have evicted this one's rows from the caches.
BLOCK = 3
# The vocabulary group (W3 beside W1 and W3-small) runs longer blocks, their first half
# untimed: members of very different footprints evict each other's rows, and the smallest
# takes several steps to re-warm: W3 after a block of W1 steps needs about 8 to reach its
# steady step time, and blocks of 3 timed that recovery instead of W3 (docs/performance.md,
# "Figures behind the code").
VOCABULARY_BLOCK = 10
VOCABULARY_UNTIMED = 5


def batches_needed(warmup: int, steps: int, block: int = BLOCK, untimed: int = 1) -> int:
    """Batches each member steps on: the first step, the warm-up, and ``steps`` timed steps
    in blocks (each block's first ``untimed`` steps untimed)."""
    rounds = -(-steps // (block - untimed))
    return 1 + warmup + rounds * block


def _time_configs(
    members: list[Member], warmup: int, steps: int, log, block: int = BLOCK, untimed: int = 1
) -> list[Result]:
    """Time one configuration, or several interleaved. Each member runs its first step and
    its warm-up, then the members take turns in blocks of ``block`` consecutive steps, in an
    order reversed every round so that none always goes first; the first ``untimed`` steps of
    each block are untimed. Alternating cancels the machine's drift; blocks keep each member's
    steps those of steady training (its hot rows cached), not of a member that follows
    another's step (the effect grows as a step shrinks: W3 against W1 per id, see
    docs/performance.md, "Figures behind the code"; see VOCABULARY_BLOCK for members that need
    several steps to re-warm)."""
    if untimed < 1 or block <= untimed:
        raise ValueError(
            f"block must be >= 2 and exceed untimed >= 1 (untimed steps, then timed "
            f"ones), got block={block}, untimed={untimed}"
        )
    _release_memory()  # the base RSS without heap that earlier work freed but glibc kept
    memory = _Memory(len(members))
    runners = []
    for c, (make, _, _) in enumerate(members):
        memory.start()
        runners.append(make())
        memory.stop(c)
    n = batches_needed(warmup, steps, block, untimed)
    inputs = [
        [r.prepare(b) for b in batches[:n]]
        for r, (_, batches, _) in zip(runners, members, strict=True)
    ]
    order = range(len(runners))
    times: list[list[float]] = [[] for _ in order]
    firsts = []

    def run(c: int, i: int) -> float:
        memory.start()  # the bookkeeping stays outside the timed region
        t0 = time.perf_counter()
        runners[c].step(inputs[c][i])
        elapsed = (time.perf_counter() - t0) * 1e3
        memory.stop(c)
        return elapsed

    for c in order:
        firsts.append((c, run(c, 0)))  # compile or cache load included
        for i in range(1, 1 + warmup):
            run(c, i)
    i = 1 + warmup
    while i < n:
        for c in order if (i - 1 - warmup) // block % 2 == 0 else reversed(order):
            for k in range(block):
                elapsed = run(c, i + k)
                if k >= untimed and len(times[c]) < steps:
                    times[c].append(elapsed)
        i += block
    first = dict(firsts)
    results = [
        Result(
            runners[c].name,
            statistics.median(times[c]),
            times[c],
            first[c],
            memory.peak[c],
            members[c][2].ids_per_step,
            workload=members[c][2].name,
        )
        for c in range(len(members))
    ]
    for runner in runners:
        runner.close()
    runners.clear()  # the tables go before the heap is trimmed
    inputs.clear()
    _release_memory()
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
    dtypes: tuple[str, ...] = ("float32",),
    log=print,
) -> list[Result]:
    """Time embengine and its peers on workload ``name`` (see workloads.WORKLOADS), the engine
    once per table dtype of ``dtypes`` (weights and float slots stored so), each compared with
    the same peers."""
    w = WORKLOADS[name]
    log(f"{w.name}: {w.description} ({w.ids_per_step:,} ids/step); generating batches")
    batches = make_batches(w, batches_needed(warmup, steps))
    # Groups of configurations timed together (see the module docstring): (factory, peers).
    groups: list[list[tuple[Callable, tuple[str, ...]]]] = []
    if w.lookup_only:  # one engine per table dtype, each against torch's lookup
        group = [
            (lambda d=dtype: EngineRunner(w, "SGD", dtype=d), ("torch F.embedding_bag",))
            for dtype in dtypes
        ]
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
            (
                lambda o=opt, p=packing, d=dtype: EngineRunner(w, o, packing=p, dtype=d),
                (engine_name(opt, dtype=dtype),) if packing else PEERS.get(opt, ()),
            )
            for dtype in dtypes
            for packing in w.packing
        ]
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
        timed = _time_configs([(make, batches, w) for make, _ in group], warmup, steps, log)
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
        host().describe(),
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


# W3's target compares its cost per id with W1's; W3-small isolates the vocabulary's share.
VOCABULARY = ("W1", "W3", "W3-small")


def run_vocabulary(
    *,
    steps: int = 10,
    warmup: int = 3,
    engine_optimizers: tuple[str, ...] = ("SGD", "rowwise Adagrad"),
    peers: tuple[str, ...] = ("fbgemm",),
    log=print,
) -> list[Result]:
    """W3 against W1 and W3-small, per id: for each of W3's optimizers, one group holding the
    same system on the three workloads (embengine, and FBGEMM if available), interleaved.

    The ratios compare workloads, so they are timed together like any other ratio: taken from
    the workloads' own groups, a minute apart, two runs of the same code gave W3 / W1 ratios
    twice apart (docs/performance.md, "Figures behind the code"). A group holds ~7 GiB of
    tables per system."""
    ws = [WORKLOADS[name] for name in VOCABULARY]
    w3 = WORKLOADS["W3"]
    log(f"W3 vs {', '.join(VOCABULARY[::2])}: per id, interleaved; generating batches")
    batches = {
        w.name: make_batches(w, batches_needed(warmup, steps, VOCABULARY_BLOCK, VOCABULARY_UNTIMED))
        for w in ws
    }
    use_fbgemm = "fbgemm" in peers and fbgemm_available() is None
    results = []
    for g, opt in enumerate(o for o in engine_optimizers if o in (w3.optimizers or ())):
        members: list[Member] = [
            (lambda w=w, o=opt: EngineRunner(w, o), batches[w.name], w) for w in ws
        ]
        for peer in PEERS.get(opt, ()):
            kind, peer_opt = peer.split(" ", 1)
            if kind == "fbgemm" and use_fbgemm and peer in (w3.peers or (peer,)):
                members += [
                    (lambda w=w, o=peer_opt: FbgemmRunner(w, o), batches[w.name], w) for w in ws
                ]
        for r in _time_configs(
            members, warmup, steps, lambda s: None, VOCABULARY_BLOCK, VOCABULARY_UNTIMED
        ):
            r.group = g
            results.append(r)
    return results


def format_vocabulary(results: list[Result]) -> str:
    """Per system: ms/step on W1, W3, W3-small and the per-id ratios W3 / W1 (target <= 1.3)
    and W3 / W3-small."""
    per_id = {(r.group, r.name, r.workload): r.ms_per_step / r.ids_per_step for r in results}
    ms = {(r.group, r.name, r.workload): r.ms_per_step for r in results}
    lines = [
        host().describe(),
        "W3 vs W1 and W3-small, timed interleaved (time per id; W3 / W1 must stay <= 1.3, "
        "W3 / W3-small is the vocabulary's share)",
        f"{'configuration':34s} {'W1 ms':>8s} {'W3 ms':>8s} {'W3-small ms':>12s} "
        f"{'W3 / W1':>8s} {'W3 / W3-small':>14s}",
    ]
    seen = []
    for r in results:
        key = (r.group, r.name)
        if key in seen:
            continue
        seen.append(key)
        w1, w3, small = ((*key, name) for name in VOCABULARY)
        lines.append(
            f"{r.name:34s} {ms[w1]:8.1f} {ms[w3]:8.1f} {ms[small]:12.1f} "
            f"{per_id[w3] / per_id[w1]:8.2f} {per_id[w3] / per_id[small]:14.2f}"
        )
    return "\n".join(lines)
