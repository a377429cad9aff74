"""``embengine bench --workloads W1-dist``: W1 on one process and on W ranks of this machine
(``W1-keyed-dist``: the same with W1's tables keyed, fed W1's ids as keys).

Five configurations per optimizer (four with keyed tables), each a fresh set of processes (the
ranks on 127.0.0.1, gloo), taking turns over ``rounds`` rounds so that the machine's drift
falls on all of them:

- ``1 process``: an EmbeddingEngine on the global batch, every core's thread;
- ``W ranks, batch split``: a ShardedEngine (row sharding), the cores shared out (cores / W
  threads a rank, each rank bound to its own cores as ``embengine train`` binds them:
  ``embengine.distributed.bind_cores``; one each on a 2-core host), each rank on its slice of
  the same global batch: the same work as ``1 process``, split (the issue's target: at most
  1.5x);
- ``W ranks, batch split, auto``: the same with ``sharding="auto"`` (W1: its tables whole,
  spread over the ranks; not run with keyed tables, which shard by key whatever is asked);
- ``1 process, 1 thread`` and ``W ranks, per-rank batch``: each rank on a whole W1 batch of its
  own (global batch W times larger), one thread each: weak scaling, efficiency = the first's
  step time / the second's (1.0: perfect).

Each rank times lookup + apply_gradients (gradient = ones, as ``EngineRunner``) after its warm-up;
the step time is rank 0's median (the collectives keep the ranks in step). Bytes: what rank 0's
``ShardedEngine`` counted (``bytes_sent``), what its process wrote to its sockets in the timed
steps (``/proc/self/io`` ``wchar``: every write syscall, and during a step only gloo and the store
write), and the cost model of docs/design.md computed from the batches (``modelled_bytes``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .host import host
from .workloads import WORKLOADS, Workload, make_batches

if TYPE_CHECKING:
    from ..distributed import ShardPlan

__all__ = [
    "DIST_WORKLOADS",
    "DistResult",
    "run_distributed",
    "format_distributed",
    "modelled_bytes",
]

# bench workload name -> (workload, ranks). W1-keyed-dist: W1's tables keyed (vocabulary_size=
# None, every key admitted at once, no expiry), fed W1's ids as keys.
DIST_WORKLOADS = {"W1-dist": ("W1", 2), "W1-keyed-dist": ("W1", 2)}
KEYED_DIST = ("W1-keyed-dist",)


@dataclass
class DistResult:
    """One configuration's figures over every round."""

    optimizer: str
    config: str
    world: int
    ms: list[float] = field(default_factory=list)  # each round's median ms/step (rank 0)
    counted: list[float] = field(default_factory=list)  # bytes rank 0 counted per step
    written: list[float] = field(default_factory=list)  # bytes rank 0 wrote per step
    modelled: list[float] = field(default_factory=list)  # the cost model's bytes for rank 0
    cores: list[int] = field(default_factory=list)  # the cores rank 0 could run on

    @property
    def ms_per_step(self) -> float:
        return statistics.median(self.ms)


def _rank_batch(batch, rank: int, world: int, split: bool) -> dict:
    """The features rank ``rank`` passes: its slice of ``batch`` (``split``, the training job's
    slice) or all of it."""
    import embengine as ee

    from ..training.ranks import Ranks, ragged_slice

    n = len(batch.offsets) - 1
    lo, hi = Ranks(rank, world).bounds(n) if split else (0, n)
    return {
        f"f{t}": ragged_slice(ee.Ragged(ids, offsets=batch.offsets), lo, hi)
        for t, ids in enumerate(batch.ids)
    }


def modelled_bytes(
    locals_: list[dict],
    dims: list[int],
    rank: int,
    keyed: bool = False,
    exchanged: list[str] | None = None,
    value_bytes: list[int] | None = None,
    plan: ShardPlan | None = None,
) -> tuple[int, int]:
    """Bytes rank ``rank`` sends in a lookup and in an update under row sharding (``keyed``:
    every table keyed, key k on rank ``mix64(k) mod W``; ``plan``: the engine's ``ShardPlan``,
    whose owners then count), by the cost model of docs/design.md,
    from every rank's features (``locals_[r]``: feature "f{t}" -> Ragged of bags, table t of
    width ``dims[t]``, one feature per table, sum pooling), each table exchanging what
    ``exchanged[t]`` says ("rows", the default, or "sums"; a whole table's "sums" sends its
    bags as they are: ``ShardedEngine._pool_whole``). Keyed, a lookup also sends each
    asked key's occurrences (8 bytes) and a "has a row" byte per id answered. ``value_bytes[t]``:
    the bytes of a weight of table t as stored (4, the default; 2 for 16 bits), which a pulled
    row's values take on the wire."""
    from ..distributed.sharding import message_grid, mix64, update_message

    world, tables = len(locals_), len(dims)
    exchanged = exchanged or ["rows"] * tables
    value_bytes = value_bytes or [4] * tables

    def owner(t, ids):
        if plan is not None:
            return plan.owner_of(t, ids)
        return (mix64(ids) % np.uint64(world)).astype(np.int64) if keyed else ids % world

    def ids_and_bags(r, t):  # rank r's ids of table t and the bag of each
        bags = locals_[r][f"f{t}"]
        ids = np.asarray(bags.ids)
        bag_of = np.repeat(np.arange(len(bags.offsets) - 1), np.diff(bags.offsets))
        return ids, bag_of

    width = 4 + 2 * tables + 2 * tables + (3 * tables if keyed else 0)
    lookup = 8 * (world - 1) * width
    m = np.zeros((tables, world), dtype=np.int64)  # gradient rows to each owner
    n = np.zeros((tables, world), dtype=np.int64)  # occurrences pushed to each owner
    for t in range(tables):
        ids, bag_of = ids_and_bags(rank, t)
        if exchanged[t] == "sums" and plan is not None and plan.kinds[t] == "table":
            # A whole table: its bags as they are to the owner (offsets and ids, 8 bytes
            # each; unit gains stay home), every bag's row back and its gradient row pushed.
            owner_t, bags = plan.owners[t], len(locals_[rank][f"f{t}"].offsets) - 1
            if owner_t != rank:
                lookup += 8 * (bags + 1 + len(ids))
                m[t, owner_t] = bags
            else:
                asked = [len(locals_[s][f"f{t}"].offsets) - 1 for s in range(world) if s != rank]
                lookup += 4 * dims[t] * sum(asked)
            continue
        owners = owner(t, ids)
        remote = owners != rank
        # (bag, owner) pairs: a gradient row to that owner
        pairs = np.unique(bag_of[remote] * world + owners[remote])
        np.add.at(m[t], pairs % world, 1)
        if exchanged[t] == "sums":
            answered = 0
            for s in range(world):
                if s != rank:
                    other, other_bag = ids_and_bags(s, t)
                    answered += len(np.unique(other_bag[owner(t, other) == rank]))
            lookup += 16 * int(np.count_nonzero(remote)) + 4 * dims[t] * answered
            continue
        np.add.at(n[t], owners[remote], 1)
        unique = [np.unique(np.asarray(loc[f"f{t}"].ids)) for loc in locals_]
        lookup += (16 if keyed else 8) * int(np.count_nonzero(owner(t, unique[rank]) != rank))
        lookup += (value_bytes[t] * dims[t] + keyed) * sum(
            int(np.count_nonzero(owner(t, unique[s]) == rank)) for s in range(world) if s != rank
        )
    # The update follows its lookup, so it speculates: one message to each owner, its header,
    # gradient rows and pushed occurrences on the grid (sharding.update_message).
    sizes = update_message(n, m, dims, width, message_grid(dims)).sizes
    return lookup, 4 * int(sizes.sum() - sizes[rank]) + 8 * (world - 1)


def _written() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def child(spec: dict) -> dict:
    """One rank of one configuration (``spec``: workload, optimizer, world, rank, threads,
    split, steps, warmup, seed; optionally sharding, default "row"; keyed: W1's tables keyed;
    bind: this rank bound to its own cores, ``bind_cores``; dtype: the tables' weights and
    float slots, default float32): its step times and bytes."""
    world, rank = spec["world"], spec["rank"]
    if world > 1 and spec.get("bind", False):
        from ..distributed.cores import bind_cores

        bind_cores(rank, world)  # first: every thread started later stays on the rank's cores

    import numba

    import embengine as ee

    from .peers import ENGINE_OPTIMIZERS

    numba.set_num_threads(spec["threads"])
    fields = dict(spec["workload"], tables=tuple(map(tuple, spec["workload"]["tables"])))
    w = Workload(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    if world > 1:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(spec["threads"])
        dist.init_process_group("gloo", rank=rank, world_size=world)
    tables = {}
    dtype = spec.get("dtype", "float32")
    for t, (rows, dim) in enumerate(w.tables):
        keyed = spec.get("keyed", False)
        table = ee.TableConfig(
            None if keyed else rows,
            dim,
            combiner="sum",
            name=f"t{t}",
            optimizer=ENGINE_OPTIMIZERS[spec["optimizer"]](dim, False),
            initializer=ee.initializers.RandomUniform(-0.01, 0.01),
            dynamic=ee.DynamicVocabulary() if keyed else None,
            weights_dtype=dtype,
            slots_dtype=dtype,
        )
        tables[f"f{t}"] = ee.FeatureConfig(table)
    if world > 1:
        from ..distributed import ShardedEngine

        engine = ShardedEngine(tables, sharding=spec.get("sharding", "row"))
    else:
        engine = ee.EmbeddingEngine(tables)
    # Every rank draws the same global batches; with split=False each rank gets batches of its
    # own (the global batch is then W whole W1 batches: the first W draws of a step).
    per_step = 1 if spec["split"] else world
    batches = make_batches(w, (1 + spec["warmup"] + spec["steps"]) * per_step, seed=spec["seed"])
    dims = [dim for _, dim in w.tables]
    times, counted, written, modelled = [], [], [], []
    for step in range(1 + spec["warmup"] + spec["steps"]):
        group = batches[step * per_step : (step + 1) * per_step]
        locals_ = [
            _rank_batch(group[0 if spec["split"] else r], r, world, spec["split"])
            for r in range(world)
        ]
        features = locals_[rank]
        before = _written()
        t0 = time.perf_counter()
        acts = engine.lookup(features)
        engine.apply_gradients({k: np.ones_like(a) for k, a in acts.items()})
        elapsed = (time.perf_counter() - t0) * 1e3
        wrote = _written() - before
        if step > spec["warmup"]:
            times.append(elapsed)
            if world > 1:
                counted.append(sum(sum(c.values()) for c in engine.bytes_sent.values()))
                written.append(wrote)
                exchanged = [s["exchange"] for s in engine.table_stats()["tables"].values()]
                value_bytes = [4 if dtype == "float32" else 2] * len(dims)
                modelled.append(
                    sum(
                        modelled_bytes(
                            locals_,
                            dims,
                            rank,
                            spec.get("keyed", False),
                            exchanged,
                            value_bytes,
                            engine.shard_plan,
                        )
                    )
                )
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return {
        "ms": statistics.median(times),
        "counted": _mean(counted),
        "written": _mean(written),
        "modelled": _mean(modelled),
        "cores": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [],
    }


def binds(world: int) -> bool:
    """Whether the ranks of a ``world``-rank configuration are bound to cores of their own:
    where this process may use at least ``world`` cores (Linux)."""
    return hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= world


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else 0.0


def _launch(spec: dict, timeout: float) -> dict:
    """Run ``spec``'s ranks as child processes; rank 0's figures."""
    world = spec["world"]
    from ..training.ranks import free_port

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="embengine-bench-dist-") as tmp:
        procs = []
        for rank in range(world):
            env = dict(
                os.environ,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                GLOO_SOCKET_IFNAME="lo",
                OMP_NUM_THREADS=str(spec["threads"]),
            )
            out = Path(tmp) / f"rank{rank}.json"
            args = json.dumps(dict(spec, rank=rank, out=str(out)))
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "embengine.bench.distributed", args], env=env
                )
            )
        # Poll every rank: one that fails (or the deadline) ends the others at once, instead of
        # leaving them to wait for it at the process group's timeout.
        deadline = time.perf_counter() + timeout
        try:
            while any(p.poll() is None for p in procs):
                codes = [p.poll() for p in procs]
                if any(c not in (None, 0) for c in codes) or time.perf_counter() > deadline:
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        codes = [p.returncode for p in procs]
        if any(codes):
            raise RuntimeError(f"bench ranks of {spec} exited with {codes} (timeout {timeout} s)")
        return json.loads((Path(tmp) / "rank0.json").read_text())


def run_distributed(
    name: str = "W1-dist",
    *,
    steps: int = 10,
    warmup: int = 3,
    engine_optimizers: tuple[str, ...] = ("SGD",),
    rounds: int = 3,
    timeout: float = 1800.0,
    workload: Workload | None = None,
    log=print,
    dtypes: tuple[str, ...] = ("float32",),
) -> list[DistResult]:
    """Time ``name``'s configurations per optimizer and table dtype (module docstring;
    ``dtypes``: the tables' weights and float slots, each a set of configurations of its own,
    "Adam [bfloat16]"), ``rounds`` times each in turn, every configuration in fresh processes
    (``workload``: another workload than ``name``'s, e.g. a small one for a test)."""
    base, world = DIST_WORKLOADS[name]
    w = workload if workload is not None else WORKLOADS[base]
    cores = host().cores
    per_rank = max(1, cores // world)
    configs = [
        ("1 process", 1, cores, True, "row"),
        (f"{world} ranks, batch split", world, per_rank, True, "row"),
        (f"{world} ranks, batch split, auto", world, per_rank, True, "auto"),
        ("1 process, 1 thread", 1, 1, True, "row"),
        (f"{world} ranks, batch per rank", world, 1, False, "row"),
    ]
    if name in KEYED_DIST:  # keyed tables shard by key whatever is asked
        del configs[2]
    results = []
    for opt, dtype in ((o, d) for o in engine_optimizers for d in dtypes):
        label_opt = opt if dtype == "float32" else f"{opt} [{dtype}]"
        mine = [DistResult(label_opt, label, n) for label, n, _, _, _ in configs]
        for r in range(rounds):
            order = configs if r % 2 == 0 else configs[::-1]
            for label, n, threads, split, sharding in order:
                spec = {
                    "workload": dataclasses.asdict(w),
                    "optimizer": opt,
                    "world": n,
                    "threads": threads,
                    "split": split,
                    "steps": steps,
                    "warmup": warmup,
                    "seed": r,
                    "keyed": name in KEYED_DIST,
                    "bind": n > 1 and binds(n),
                    "dtype": dtype,
                    "sharding": sharding,
                }
                got = _launch(spec, timeout)
                res = next(m for m in mine if m.config == label)
                res.ms.append(got["ms"])
                res.counted.append(got["counted"])
                res.written.append(got["written"])
                res.modelled.append(got["modelled"])
                res.cores = got["cores"]
                log(f"  {label_opt} {label}: {got['ms']:.1f} ms/step")
        results.extend(mine)
    return results


def format_distributed(
    name: str, results: list[DistResult], workload: Workload | None = None
) -> str:
    """The table: per optimizer, each configuration's median ms/step over the rounds, rank 0's
    bytes per step (counted, written to sockets, modelled) and the two ratios."""
    base, world = DIST_WORKLOADS[name]
    w = workload if workload is not None else WORKLOADS[base]
    lines = [
        host().describe(),
        f"{name}: {w.description} on 1 process and {world} ranks (gloo, 127.0.0.1, "
        + ("each bound to its own cores" if binds(world) else "not bound: fewer cores than ranks")
        + "); rank 0's median ms/step, median of the rounds' medians",
        f"{'optimizer':24s} {'configuration':28s} {'ms/step':>8s} {'rounds (ms)':>24s} "
        f"{'MB counted':>10s} {'MB written':>10s} {'MB model':>9s}",
    ]
    for opt in dict.fromkeys(r.optimizer for r in results):
        mine = [r for r in results if r.optimizer == opt]
        for r in mine:
            rounds = " ".join(f"{m:.0f}" for m in r.ms)
            mb = [
                f"{statistics.median(v) / 1e6:.2f}" if r.world > 1 else "-"
                for v in (r.counted, r.written, r.modelled)
            ]
            lines.append(
                f"{opt:24s} {r.config:28s} {r.ms_per_step:8.1f} {rounds:>24s} "
                f"{mb[0]:>10s} {mb[1]:>10s} {mb[2]:>9s}"
            )
        one, split, *auto, one_thread, per_rank = mine
        lines.append(
            f"{opt:24s} {world} ranks / 1 process (batch split): "
            f"{split.ms_per_step / one.ms_per_step:.2f}x (target <= 1.5x); weak-scaling "
            f"efficiency {one_thread.ms_per_step / per_rank.ms_per_step:.2f}"
        )
        for a in auto:
            lines.append(
                f"{opt:24s} {world} ranks / 1 process (batch split, sharding auto): "
                f"{a.ms_per_step / one.ms_per_step:.2f}x (target <= 1.5x)"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    result = child(spec)
    Path(spec["out"]).write_text(json.dumps(result))
