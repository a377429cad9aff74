"""``embengine bench --workloads W1-keyed W1-new W3-keyed W4 insert``: keyed tables against issue
15's targets, printed in one table.

- **W1-keyed**: W1's batches with every id replaced by a random 64-bit key (a fixed random
  map per table), all keys resident before timing; the keyed engine and the dense engine
  step on the same batches, interleaved (``runner._time_configs``), for the training step
  (SGD) and for the lookup alone.
- **W1-new**: W1's batches with every key new at every step (the step's ids moved to an
  unused key range, scrambled); ``expire_steps=2`` hands earlier steps' rows back, so memory
  stays bounded. Training step, keyed against dense, interleaved.
- **W3-keyed**: W3 (one table of 20M rows) with random 64-bit keys, all resident, against
  W1-keyed per id: the keyed and dense engines on W1 and on W3, four members interleaved in
  one group (``runner.run_vocabulary``'s blocks); the dense W3 / W1 ratio is printed beside
  the keyed one, so that what the vocabulary and the single table cost a dense table too is
  told apart from what the keys add. The four are resident at once: ~15 GiB at scale 1.
- **W4**: one table (dim 64, SGD) of ``max_rows = 10^6`` fed Zipf(1.05) keys over 10^7
  distinct random 64-bit keys (batch 4096 x 20): once the table is full (every step evicts),
  ``3 * steps`` (at least 30) steps are timed; the step time (median of their second half
  against their first) and the resident memory (largest against smallest) must stay flat.
- **insert**: ``KeyedTable.rows_for`` inserting batches of new random keys (dim 16, SGD,
  ``Zeros``) into a fresh table, on one numba thread (keys per second per core), after an
  untimed table of the same size (so its memory is the process's, not the VM host's first
  touch), and the table's bytes per key beyond its rows (index and row metadata, from
  ``table_stats``).

``scale`` shrinks every vocabulary and batch (rows, keys, ``max_rows`` and batch size times
``scale``) for quick runs; the targets are the issue's at scale 1.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass

import numpy as np

from .host import host
from .peers import EngineRunner
from .runner import (
    VOCABULARY_BLOCK,
    VOCABULARY_UNTIMED,
    _status_gb,
    _time_configs,
    batches_needed,
)
from .workloads import WORKLOADS, Batch, Workload, make_batches

__all__ = ["KEYED_WORKLOADS", "KeyedResult", "run_keyed", "format_keyed", "W4"]

KEYED_WORKLOADS = ("W1-keyed", "W1-new", "W3-keyed", "W4", "insert")


@dataclass(frozen=True)
class W4Spec:
    distinct_keys: int = 10_000_000
    max_rows: int = 1_000_000
    dim: int = 64
    batch_size: int = 4096
    bag_size: int = 20
    zipf: float = 1.05


W4 = W4Spec()


@dataclass
class KeyedResult:
    """One line of the table: a measure, its value, the target and how it was obtained."""

    measure: str
    value: float
    target: str
    detail: str


def _scaled(w: Workload, scale: float) -> Workload:
    tables = tuple((max(int(rows * scale), 16), dim) for rows, dim in w.tables)
    return dataclasses.replace(w, tables=tables, batch_size=max(int(w.batch_size * scale), 4))


def random_keys(n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` distinct random int64 keys (any of the 2^64 values)."""
    keys = np.unique(rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64, endpoint=True))
    while len(keys) < n:  # a collision: draw the missing ones again
        more = rng.integers(-(2**63), 2**63 - 1, n - len(keys), dtype=np.int64, endpoint=True)
        keys = np.unique(np.concatenate([keys, more]))
    return rng.permutation(keys)


def _scramble(x: np.ndarray) -> np.ndarray:
    """A bijection of int64 (an odd multiplier, wrapping): distinct inputs, distinct keys."""
    with np.errstate(over="ignore"):
        return (x.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)).astype(np.int64)


class KeyedRunner(EngineRunner):
    """embengine with keyed tables (``vocabulary_size=None``) in place of the workload's.

    ``new=False``: a table's id ``i`` is key ``maps[t][i]``, a random 64-bit key, and every key
    is inserted at build (resident). ``new=True``: each batch's ids become keys no earlier batch
    had (``expire_steps`` bounds the table)."""

    def __init__(
        self,
        w: Workload,
        optimizer: str,
        new: bool = False,
        expire_steps: int | None = None,
        seed: int = 0,
    ):
        import embengine as ee

        from .peers import ENGINE_OPTIMIZERS

        kind = "every key new" if new else "resident keys"
        self.name = f"embengine {optimizer} keyed ({kind})"
        self.lookup_only = w.lookup_only
        self.new = new
        self._batches = 0
        dyn = ee.DynamicVocabulary(expire_steps=expire_steps)
        tables = [
            ee.TableConfig(
                None,
                dim,
                combiner="sum",
                name=f"t{t}",
                dynamic=dyn,
                optimizer=ENGINE_OPTIMIZERS[optimizer](dim, False),
                initializer=ee.initializers.RandomUniform(-0.01, 0.01),
            )
            for t, (_, dim) in enumerate(w.tables)
        ]
        self.engine = ee.EmbeddingEngine(
            {f"f{t}": ee.FeatureConfig(tab) for t, tab in enumerate(tables)}
        )
        self._ragged = ee.Ragged
        self.maps = []
        if not new:
            rng = np.random.default_rng(seed)
            self.maps = [random_keys(rows, rng) for rows, _ in w.tables]
            self._insert_all()

    def _insert_all(self, chunk: int = 1 << 16) -> None:
        """Every key of every table gets its row (training lookups insert; nothing trains)."""
        longest = max(len(keys) for keys in self.maps)
        for lo in range(0, longest, chunk):
            feats = {}
            for t, keys in enumerate(self.maps):
                part = keys[lo : lo + chunk]
                feats[f"f{t}"] = self._ragged(part, offsets=np.arange(len(part) + 1))
            self.engine.lookup(feats)
        empty = np.zeros(0, np.int64)
        self.engine.lookup(
            {
                f"f{t}": self._ragged(empty, offsets=np.zeros(1, np.int64))
                for t in range(len(self.maps))
            },
            training=False,
        )

    def keys(self, t: int, ids: np.ndarray) -> np.ndarray:
        if not self.new:
            return self.maps[t][ids]
        return _scramble(ids + (np.int64(self._batches + 1) << np.int64(32)))

    def prepare(self, batch: Batch):
        out = {
            f"f{t}": self._ragged(self.keys(t, ids), offsets=batch.offsets)
            for t, ids in enumerate(batch.ids)
        }
        self._batches += 1
        return out


def _ratio(results, keyed, dense, measure, target) -> KeyedResult:
    k, d = results[keyed], results[dense]
    return KeyedResult(
        measure,
        k.ms_per_step / d.ms_per_step,
        target,
        f"keyed {k.ms_per_step:.1f} ms, dense {d.ms_per_step:.1f} ms",
    )


def run_w1(scale: float, steps: int, warmup: int, new: bool, log) -> list[KeyedResult]:
    """W1-keyed (``new=False``: step and lookup-only ratios) or W1-new (step ratio)."""
    out = []
    kinds = [("W1", "step")] if new else [("W1", "step"), ("W1-lookup", "lookup-only")]
    for name, what in kinds:
        w = _scaled(WORKLOADS[name], scale)
        batches = make_batches(w, batches_needed(warmup, steps))
        members = [
            (lambda w=w: EngineRunner(w, "SGD"), batches, w),
            (
                lambda w=w: KeyedRunner(w, "SGD", new=new, expire_steps=2 if new else None),
                batches,
                w,
            ),
        ]
        dense, keyed = _time_configs(members, warmup, steps, log)
        label = "W1-new step" if new else f"W1-keyed {what}"
        target = "<= 2" if new else ("<= 1.2" if what == "step" else "<= 1.25")
        out.append(_ratio({"k": keyed, "d": dense}, "k", "d", f"{label}, keyed / dense", target))
    return out


def run_w3(scale: float, steps: int, warmup: int, log) -> list[KeyedResult]:
    """W3-keyed: the time per id of keyed W3 against keyed W1, and of dense W3 against dense
    W1, the four engines (SGD) interleaved in one group."""
    ws = [_scaled(WORKLOADS[name], scale) for name in ("W1", "W3")]
    log(f"W3-keyed: W3 ({ws[1].tables[0][0]:,} keys) against W1, per id; generating batches")
    n = batches_needed(warmup, steps, VOCABULARY_BLOCK, VOCABULARY_UNTIMED)
    batches = [make_batches(w, n) for w in ws]
    members = []
    for w, b in zip(ws, batches, strict=True):
        members += [
            (lambda w=w: EngineRunner(w, "SGD"), b, w),
            (lambda w=w: KeyedRunner(w, "SGD"), b, w),
        ]
    d1, k1, d3, k3 = _time_configs(
        members, warmup, steps, log, VOCABULARY_BLOCK, VOCABULARY_UNTIMED
    )

    def per_id(r) -> float:
        return r.ms_per_step / r.ids_per_step

    return [
        KeyedResult(
            "W3-keyed per id, W3 / W1 (keyed)",
            per_id(k3) / per_id(k1),
            "<= 1.3",
            f"keyed W3 {k3.ms_per_step:.1f} ms, W1 {k1.ms_per_step:.1f} ms; dense W3 / W1 "
            f"{per_id(d3) / per_id(d1):.2f} (W3 {d3.ms_per_step:.1f}, W1 {d1.ms_per_step:.1f} ms)",
        )
    ]


def _w4_batches(spec: W4Spec, rng: np.random.Generator, keys: np.ndarray, cdf: np.ndarray):
    n = spec.batch_size * spec.bag_size
    ranks = np.minimum(np.searchsorted(cdf, rng.random(n)), len(keys) - 1)
    return keys[ranks], np.arange(0, n + 1, spec.bag_size, dtype=np.int64)


def run_w4(scale: float, steps: int, log, max_fill_steps: int = 2000) -> list[KeyedResult]:
    """Stream Zipf keys until the table holds ``max_rows``, then time ``steps`` more steps
    and read the RSS after each."""
    import embengine as ee

    from .workloads import _zipf_cdf

    spec = W4Spec(
        distinct_keys=max(int(W4.distinct_keys * scale), 100),
        max_rows=max(int(W4.max_rows * scale), 10),
        batch_size=max(int(W4.batch_size * scale), 4),
    )
    log(f"W4: {spec.distinct_keys:,} Zipf keys through max_rows={spec.max_rows:,}")
    rng = np.random.default_rng(4)
    keys = random_keys(spec.distinct_keys, rng)
    cdf = _zipf_cdf(spec.distinct_keys, spec.zipf)
    table = ee.TableConfig(
        None,
        spec.dim,
        name="t",
        combiner="sum",
        dynamic=ee.DynamicVocabulary(max_rows=spec.max_rows),
        initializer=ee.initializers.RandomUniform(-0.01, 0.01),
    )
    engine = ee.EmbeddingEngine({"f": ee.FeatureConfig(table)}, optimizer=ee.optimizers.SGD(0.01))

    def step() -> float:
        ids, offsets = _w4_batches(spec, rng, keys, cdf)
        feats = {"f": ee.Ragged(ids, offsets=offsets)}
        t0 = time.perf_counter()
        acts = engine.lookup(feats)
        engine.apply_gradients({"f": np.ones_like(acts["f"])})
        return (time.perf_counter() - t0) * 1e3

    fill = 0
    while engine.table_stats()["t"]["rows"] < spec.max_rows and fill < max_fill_steps:
        step()
        fill += 1
    full = engine.table_stats()["t"]["rows"] >= spec.max_rows
    ms, rss = [], []
    for _ in range(max(steps, 2)):
        ms.append(step())
        rss.append(_status_gb("VmRSS") or 0.0)
    half = len(ms) // 2
    drift = statistics.median(ms[half:]) / statistics.median(ms[:half])
    evicted = engine.table_stats()["t"]["total"]["evicted"]
    note = "" if full else f" (not full after {fill} steps)"
    out = [
        KeyedResult(
            "W4 step time, 2nd half / 1st half",
            drift,
            "within 1.10",
            f"{len(ms)} steps after {fill} to fill{note}; median "
            f"{statistics.median(ms):.1f} ms; {evicted:,} evicted",
        ),
    ]
    if rss[0] > 0:
        out.append(
            KeyedResult(
                "W4 RSS, largest / smallest",
                max(rss) / min(rss),
                "within 1.05",
                f"{min(rss):.2f}-{max(rss):.2f} GiB",
            )
        )
    return out


def run_insert(scale: float, log, batches: int = 16) -> list[KeyedResult]:
    """Keys per second of ``KeyedTable.rows_for`` inserting new keys on one thread, and the
    table's bytes per key beyond its rows."""
    import numba

    import embengine as ee
    from embengine.storage.keyed import KeyedTable

    batch = max(int((1 << 16) * scale), 64)
    rng = np.random.default_rng(1)
    keys = random_keys(batch * batches, rng)

    def new_table():
        return KeyedTable("t", 16, (), ee.initializers.Zeros(), 0, ee.DynamicVocabulary())

    def insert_all(table) -> float:
        elapsed = 0.0
        for b in range(batches):
            part = keys[b * batch : (b + 1) * batch]
            counts = np.ones(len(part), np.int64)
            table.begin_step(b + 1)
            t0 = time.perf_counter()
            table.rows_for(0, part, insert=True, counts=counts)
            elapsed += time.perf_counter() - t0
        return elapsed

    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        # Untimed, a table of the same size first: the kernels compile or load, and the
        # memory the timed table takes has been touched by this process (in a VM that reports
        # free pages to its host, a page never touched, or handed back, faults in at ~0.4
        # GB/s against ~5 recycled: docs/performance.md, "Keyed insertion").
        insert_all(new_table())
        table = new_table()
        elapsed = insert_all(table)
    finally:
        numba.set_num_threads(threads)
    st = table.stats()
    per_key = (st["bytes"]["index"] + st["bytes"]["row_metadata"]) / st["rows"]
    return [
        KeyedResult(
            "insertion, M new keys/s on 1 core",
            len(keys) / elapsed / 1e6,
            ">= 25",
            f"{len(keys):,} keys in batches of {batch:,}, dim 16, after as many untimed",
        ),
        KeyedResult(
            "bytes per key beyond the row",
            per_key,
            "<= 24",
            f"index {st['bytes']['index'] / st['rows']:.1f} + row metadata "
            f"{st['bytes']['row_metadata'] / st['rows']:.1f}, {st['rows']:,} keys",
        ),
    ]


def run_keyed(
    names, *, scale: float = 1.0, steps: int = 10, warmup: int = 3, log=print
) -> list[KeyedResult]:
    """The keyed measurements ``names`` (of KEYED_WORKLOADS) asks for, in that order."""
    if not (isinstance(scale, int | float) and 0 < scale <= 1):
        raise ValueError(f"scale must be in (0, 1] (1: the issue's sizes), got {scale!r}")
    out: list[KeyedResult] = []
    for name in names:
        if name == "W1-keyed":
            out += run_w1(scale, steps, warmup, new=False, log=log)
        elif name == "W1-new":
            out += run_w1(scale, steps, warmup, new=True, log=log)
        elif name == "W3-keyed":
            out += run_w3(scale, steps, warmup, log)
        elif name == "W4":
            out += run_w4(scale, max(3 * steps, 30), log)
        elif name == "insert":
            out += run_insert(scale, log)
        else:
            raise ValueError(f"unknown keyed workload {name!r}; they are {KEYED_WORKLOADS}")
    return out


def format_keyed(results: list[KeyedResult], scale: float = 1.0) -> str:
    """The host, then one line per measure: value, target, how."""
    at = "" if scale == 1 else f" (scale {scale:g}: the targets are for scale 1)"
    lines = [
        host().describe(),
        f"keyed tables against issue 15's targets{at}; ratios timed interleaved, same batches",
        f"{'measure':40s} {'value':>8s} {'target':>12s}  how",
    ]
    for r in results:
        lines.append(f"{r.measure:40s} {r.value:8.2f} {r.target:>12s}  {r.detail}")
    return "\n".join(lines)
