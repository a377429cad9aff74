"""The benchmark harness: workloads, interleaved timing of groups, each member's own peak RSS,
and the printed table."""

import os

import numpy as np
import pytest

from embengine.bench import runner
from embengine.bench.workloads import Workload, make_batches

TINY = Workload(
    "tiny", "2 tables x 500 rows, dims 2 and 4", ((500, 2), (500, 4)), 16, 3, packing=(False, True)
)


def test_batches_are_fresh_zipf_ids_within_each_table():
    w = Workload("z", "", ((50, 2), (7, 2)), batch_size=20, bag_size=5)
    batches = make_batches(w, 3, seed=1)
    assert len(batches) == 3
    for b in batches:
        np.testing.assert_array_equal(b.offsets, np.arange(0, 101, 5))
        for (rows, _), ids in zip(w.tables, b.ids, strict=True):
            assert ids.dtype == np.int64 and len(ids) == 100
            assert 0 <= ids.min() and ids.max() < rows
    assert not np.array_equal(batches[0].ids[0], batches[1].ids[0])  # a new batch per step


class _Recorder:
    """A runner that records which input it stepped on, and when."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def prepare(self, batch):
        return id(batch)

    def step(self, x):
        self.log.append((self.name, x))

    def close(self):
        self.log.append((self.name, "closed"))


def test_groups_take_turns_in_blocks_in_alternating_order():
    log = []
    batches = make_batches(TINY, runner.batches_needed(warmup=2, steps=4))  # 1 + 2 + 2 blocks of 3
    members = [(lambda n=n: _Recorder(n, log), batches, TINY) for n in "ab"]
    results = runner._time_configs(members, warmup=2, steps=4, log=lambda s: None)
    assert [r.name for r in results] == ["a", "b"]
    assert all(len(r.ms_all) == 4 and r.first_step_ms >= 0 for r in results)
    order = [name for name, x in log if x != "closed"]
    # First step and warm-up each, then blocks of 3 (first untimed), neither always first.
    assert order == list("aaabbb" + "aaabbb" + "bbbaaa")
    for name in "ab":  # each runner steps on every batch once, in order
        steps = [x for n, x in log if n == name and x != "closed"]
        assert steps == [id(b) for b in batches]
    with pytest.raises(ValueError, match="block must be >= 2"):
        runner._time_configs(members, warmup=0, steps=1, log=print, block=1)
    with pytest.raises(ValueError, match="block=3, untimed=3"):
        runner._time_configs(members, warmup=0, steps=1, log=print, block=3, untimed=3)


class _Clocked(_Recorder):
    """A runner whose step k (k-th batch) takes k + 1 seconds of a fake clock."""

    def __init__(self, name, log, clock, index):
        super().__init__(name, log)
        self.clock, self.index = clock, index

    def step(self, x):
        super().step(x)
        self.clock[0] += self.index[x] + 1


def test_longer_blocks_time_only_their_last_steps(monkeypatch):
    log, clock = [], [0.0]
    n = runner.batches_needed(warmup=0, steps=4, block=5, untimed=3)  # 1 + 2 blocks of 5
    assert n == 11
    batches = make_batches(TINY, n)
    index = {id(b): k for k, b in enumerate(batches)}
    members = [(lambda n=n: _Clocked(n, log, clock, index), batches, TINY) for n in "ab"]
    monkeypatch.setattr(runner, "time", type("FakeTime", (), {"perf_counter": lambda: clock[0]}))
    results = runner._time_configs(
        members, warmup=0, steps=4, log=lambda s: None, block=5, untimed=3
    )
    order = [name for name, x in log if x != "closed"]
    assert order == list("a" + "b" + "aaaaabbbbb" + "bbbbbaaaaa")
    # Batch 0 is the first step; blocks hold batches 1-5 and 6-10, of which 4, 5, 9, 10 are
    # timed (their durations, k + 1 s, name them).
    for r in results:
        assert r.ms_all == [5000.0, 6000.0, 10000.0, 11000.0]
        assert r.first_step_ms == 1000.0


def test_the_vocabulary_group_runs_long_blocks(monkeypatch):
    rows = {"W1": 400, "W3": 4000, "W3-small": 400}
    tiny = {
        name: Workload(name, "", ((rows[name], 4),), 8, 2, optimizers=("SGD",), peers=())
        for name in runner.VOCABULARY
    }
    for name, w in tiny.items():
        monkeypatch.setitem(runner.WORKLOADS, name, w)
    seen = []
    timed = runner._time_configs

    def spy(members, warmup, steps, log, *args):
        seen.append(args)
        return timed(members, warmup, steps, log, *args)

    monkeypatch.setattr(runner, "_time_configs", spy)
    results = runner.run_vocabulary(steps=2, warmup=0, engine_optimizers=("SGD",), peers=())
    assert seen == [(runner.VOCABULARY_BLOCK, runner.VOCABULARY_UNTIMED)]
    assert runner.VOCABULARY_UNTIMED >= 2
    assert sorted(r.workload for r in results) == sorted(runner.VOCABULARY)
    assert all(len(r.ms_all) == 2 for r in results)


class _Holder(_Recorder):
    """Holds ``mb`` MiB from its build on, and briefly ``spike`` MiB more in each step."""

    def __init__(self, name, log, mb, spike):
        super().__init__(name, log)
        self.held = np.ones(mb * 2**18, dtype=np.float32)  # touched: resident
        self.spike = spike

    def step(self, x):
        super().step(x)
        np.ones(self.spike * 2**18, dtype=np.float32).sum()


@pytest.mark.skipif(runner._status_gb("VmRSS") is None, reason="needs /proc/self/status")
def test_each_member_of_a_group_gets_its_own_peak_rss():
    log = []
    batches = make_batches(TINY, runner.batches_needed(warmup=1, steps=2))
    members = [
        (lambda: _Holder("big", log, 400, 0), batches, TINY),
        (lambda: _Holder("small", log, 50, 100), batches, TINY),
    ]
    big, small = runner._time_configs(members, 1, 2, lambda s: None)
    # big: base + 400 MiB; small: base + 50 MiB + its 100 MiB spikes. Not the pair's total.
    assert abs((big.peak_rss_gb - small.peak_rss_gb) * 1024 - 250) < 40
    assert small.peak_rss_gb * 1024 < runner.peak_rss_gb() * 1024 - 300


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(runner.WORKLOADS, "tiny", TINY)
    return "tiny"


def test_each_configuration_is_timed_with_its_peers_and_compared_in_the_table(tiny):
    results = runner.run_workload(
        tiny,
        steps=3,
        warmup=1,
        engine_optimizers=("SGD", "Adam"),
        peers=("torch",),
        log=lambda s: None,
    )
    assert [(r.group, r.name) for r in results] == [
        (0, "embengine SGD"),
        (0, "embengine SGD (packed)"),
        (0, "torch SGD"),
        (1, "embengine Adam"),
        (1, "embengine Adam (packed)"),
        (1, "torch SparseAdam"),
    ]
    by_name = {r.name: r for r in results}
    assert by_name["embengine SGD (packed)"].peers == ("embengine SGD",)
    assert by_name["embengine SGD"].peers == ("torch SGD", "fbgemm EXACT_SGD")
    assert all(r.ms_per_step > 0 and r.ids_per_step == 2 * 16 * 3 for r in results)
    # Each configuration's own peak is within the process's (the slack: other threads of a
    # test process, e.g. pytest-xdist's, allocate and free while the group runs).
    assert all(0 < r.peak_rss_gb <= runner.peak_rss_gb() + 64 / 1024 for r in results)
    lines = runner.format_results(tiny, results).splitlines()
    packed = next(line for line in lines if line.startswith("embengine SGD (packed)"))
    ratio = by_name["embengine SGD"].ms_per_step / by_name["embengine SGD (packed)"].ms_per_step
    assert packed.endswith(f"embengine SGD: {ratio:.2f}x")
    unpacked = next(line for line in lines if line.startswith("embengine SGD  "))
    ratio = by_name["torch SGD"].ms_per_step / by_name["embengine SGD"].ms_per_step
    assert unpacked.endswith(f"torch SGD: {ratio:.2f}x")  # no FBGEMM run, no ratio to it
    assert "" in lines  # a blank line between the two groups


def test_16_bit_tables_are_timed_beside_float32_against_the_same_peers(tiny):
    results = runner.run_workload(
        tiny,
        steps=2,
        warmup=1,
        engine_optimizers=("Adam",),
        peers=("torch",),
        dtypes=("float32", "bfloat16"),
        log=lambda s: None,
    )
    by_name = {r.name: r for r in results}
    assert set(by_name) == {
        "embengine Adam",
        "embengine Adam (packed)",
        "embengine Adam [bfloat16]",
        "embengine Adam (packed) [bfloat16]",
        "torch SparseAdam",
    }
    assert by_name["embengine Adam [bfloat16]"].peers == by_name["embengine Adam"].peers
    assert by_name["embengine Adam (packed) [bfloat16]"].peers == ("embengine Adam [bfloat16]",)
    line = next(
        x
        for x in runner.format_results(tiny, results).splitlines()
        if x.startswith("embengine Adam [bfloat16]")
    )
    ratio = (
        by_name["torch SparseAdam"].ms_per_step / by_name["embengine Adam [bfloat16]"].ms_per_step
    )
    assert line.endswith(f"torch SparseAdam: {ratio:.2f}x")


def test_a_lookup_only_workload_times_each_table_dtype(monkeypatch):
    lookup = Workload("tiny-lookup", "", ((500, 8),) * 2, 16, 3, lookup_only=True)
    monkeypatch.setitem(runner.WORKLOADS, "tiny-lookup", lookup)
    results = runner.run_workload(
        "tiny-lookup",
        steps=2,
        warmup=1,
        peers=("torch",),
        dtypes=("float32", "bfloat16", "float16"),
        log=lambda s: None,
    )
    by_name = {r.name: r for r in results}
    assert set(by_name) == {
        "embengine SGD",
        "embengine SGD [bfloat16]",
        "embengine SGD [float16]",
        "torch F.embedding_bag",
    }
    for name in ("embengine SGD [bfloat16]", "embengine SGD [float16]"):
        assert by_name[name].peers == ("torch F.embedding_bag",)


def test_w3_is_timed_beside_w1_and_w3_small_and_compared_per_id(monkeypatch):
    # Stand-ins for W1, W3 and W3-small: the same shape of comparison on tiny tables.
    small = {
        "W1": Workload("W1", "", ((300, 4),) * 2, 8, 3),
        "W3": Workload("W3", "", ((3000, 4),), 8, 3, optimizers=("SGD",)),
        "W3-small": Workload("W3-small", "", ((300, 4),), 8, 3),
    }
    for name, w in small.items():
        monkeypatch.setitem(runner.WORKLOADS, name, w)
    results = runner.run_vocabulary(
        steps=3, warmup=1, engine_optimizers=("SGD", "Adam"), peers=(), log=lambda s: None
    )
    # One group (W3 runs SGD only), the same system on the three workloads.
    assert [(r.group, r.name, r.workload) for r in results] == [
        (0, "embengine SGD", "W1"),
        (0, "embengine SGD", "W3"),
        (0, "embengine SGD", "W3-small"),
    ]
    assert [r.ids_per_step for r in results] == [48, 24, 24]
    ms = {r.workload: r.ms_per_step for r in results}
    line = runner.format_vocabulary(results).splitlines()[-1]
    w3_w1 = (ms["W3"] / 24) / (ms["W1"] / 48)
    w3_small = ms["W3"] / ms["W3-small"]
    assert line.split() == [
        "embengine",
        "SGD",
        f"{ms['W1']:.1f}",
        f"{ms['W3']:.1f}",
        f"{ms['W3-small']:.1f}",
        f"{w3_w1:.2f}",
        f"{w3_small:.2f}",
    ]


@pytest.mark.skipif(runner._status_gb("VmRSS") is None, reason="needs /proc/self/status")
def test_a_finished_group_hands_its_freed_memory_back():
    # Many small arrays come from the heap; freed, glibc keeps them resident (the next group's
    # RSS would count them) until the runner trims the heap after each group.
    rss_mb = lambda: runner._status_gb("VmRSS") * 1024  # noqa: E731
    before = rss_mb()
    arrays = [np.ones(16_000, dtype=np.float32) for _ in range(4000)]  # 64 KB each, ~250 MB
    last = arrays[-1]  # keeps the top of the heap in use
    del arrays
    runner._release_memory()
    assert rss_mb() - before < 60
    assert last.sum() == 16_000


def test_every_table_starts_with_the_host(tiny):
    """Figures mean nothing without their host (FBGEMM's speed differs 3-4x between hosts)."""
    from embengine.bench.host import host
    from embengine.kernels import VECTORS

    line = host().describe()
    assert line.startswith("host: ") and " cores, " in line and "AVX-512" in line
    assert line.endswith(f"; kernels: {VECTORS}")
    results = runner.run_workload(
        tiny, steps=1, warmup=0, engine_optimizers=("SGD",), peers=(), log=lambda s: None
    )
    assert runner.format_results(tiny, results).splitlines()[0] == line


def test_host_reads_model_avx512_and_memory_from_proc_texts():
    from embengine.bench import host as h

    cpuinfo = (
        "processor\t: 0\nmodel name\t: AMD EPYC 9B14\nflags\t\t: fpu avx2 avx512f\n\n"
        "processor\t: 1\nmodel name\t: AMD EPYC 9B14\nflags\t\t: fpu\n"
    )
    assert h._cpuinfo(cpuinfo) == ("AMD EPYC 9B14", True)
    assert h._cpuinfo("model name : Intel Xeon\nflags : sse2 avx2 avx512_vnni\n") == (
        "Intel Xeon",
        False,
    )
    assert h._memory_gib("MemTotal:       25165824 kB\n") == 24.0
    assert h._memory_gib("") is None
    assert h.Host("X", 2, False, None).describe() == "host: X, 2 cores, no AVX-512"
    assert (
        h.Host("X", 2, True, 24.0, "512-bit").describe()
        == "host: X, 2 cores, AVX-512, 24 GiB; kernels: 512-bit"
    )


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("W1-dist", "float32"), ("W1-keyed-dist", "float32"), ("W1-dist", "bfloat16")],
)
def test_the_distributed_bench_times_its_configurations_and_counts_the_model(tmp_path, name, dtype):
    """W1-dist's machinery on a small workload: 1 process and 2 gloo ranks (batch split by row
    and by "auto", batch per rank), one round; rank 0's counted bytes are the cost model's
    (under "auto" with the engine's plan's owners), and its sockets carried at least as much.
    W1-keyed-dist: the same with keyed tables (owners by mix64; no "auto" configuration);
    bfloat16: 16-bit tables, their pulled rows at 2 bytes a value."""
    from embengine.bench.distributed import binds, format_distributed, run_distributed
    from embengine.bench.workloads import Workload
    from embengine.distributed.cores import core_share

    # Five tables, none more than about a quarter of the bytes or the expected traffic:
    # "auto" puts some whole, so its bytes differ from row sharding's (the model then takes
    # the engine's plan: without it, 12,232 modelled bytes against 12,224 counted).
    small = Workload(
        "small",
        "5 tables, dims 8 and 4, batch 64, 4 ids/bag",
        ((500, 8), (300, 4), (400, 8), (200, 4), (100, 4)),
        64,
        4,
    )
    results = run_distributed(
        name,
        steps=2,
        warmup=1,
        rounds=1,
        timeout=300,
        workload=small,
        log=lambda _: None,
        dtypes=(dtype,),
    )
    label = "SGD" if dtype == "float32" else f"SGD [{dtype}]"
    assert {r.optimizer for r in results} == {label}
    keyed = name == "W1-keyed-dist"
    assert [r.config for r in results] == [
        "1 process",
        "2 ranks, batch split",
        *([] if keyed else ["2 ranks, batch split, auto"]),
        "1 process, 1 thread",
        "2 ranks, batch per rank",
    ]
    for r in results:
        assert len(r.ms) == 1 and r.ms[0] > 0, r
        if r.world == 2:
            assert r.counted[0] == r.modelled[0] > 0, r
            assert r.written[0] >= r.counted[0], r
            if binds(2):  # each rank on its own cores, as embengine train's ranks
                assert r.cores == core_share(0, 2, sorted(os.sched_getaffinity(0))), r
    table = format_distributed(name, results, small)
    assert ("each bound to its own cores" in table) == binds(2)
    assert table.splitlines()[0].startswith("host: ")
    assert "2 ranks / 1 process (batch split): " in table and "weak-scaling efficiency" in table
    assert ("2 ranks / 1 process (batch split, sharding auto): " in table) == (not keyed)


def test_the_floor_kernel_writes_each_touched_row_once_and_changes_nothing():
    """The floor (kernels/floor.py) reads and writes every column of the touched rows and no
    other row; finite rows keep their bits. A NaN gradient shows which weights it wrote (x + 0 *
    NaN), an infinite slot which slot columns (inf + 0 * inf)."""
    from embengine.kernels import tasks
    from embengine.kernels.floor import fixed_touch_rows

    rng = np.random.default_rng(3)
    dim, width, rows = 4, 12, 10
    data = rng.standard_normal((rows, width)).astype(np.float32)
    # Unique rows 7, -1 (no row), 2, 5; occurrences 0-1 -> 7, 2 -> -1, 3-5 -> 2, 6 -> 5.
    unique = np.array([7, -1, 2, 5], np.int64)
    offsets = np.array([0, 2, 3, 6, 7], np.int64)
    gains = np.ones(7, np.float32)
    segments = np.array([0, 1, 1, 2, 0, 2, 3], np.int64)
    grad = rng.standard_normal((4, dim)).astype(np.float32)
    bounds = np.array([0, 2, 4], np.int64)  # two tasks: on two threads where numba has two
    kernel = fixed_touch_rows(dim, width)

    def touch(*args):
        tasks.run(kernel, 2, bounds, *args)

    before = data.copy()
    touch(data, unique, offsets, gains, segments, grad, 0.0, 4)
    np.testing.assert_array_equal(data.view(np.int32), before.view(np.int32))
    grad[3] = np.nan  # only row 5's gradient
    data[:, dim:] = np.inf  # every row's slots
    touch(data, unique, offsets, gains, segments, grad, 0.0, 4)
    assert np.isnan(data[5, :dim]).all() and not np.isnan(np.delete(data, 5, 0)[:, :dim]).any()
    touched = np.isnan(data[:, dim:]).all(axis=1)
    assert touched.tolist() == [r in (7, 2, 5) for r in range(rows)]
    with pytest.raises(ValueError, match="DIM=5, WIDTH=4"):
        fixed_touch_rows(5, 4)


def test_the_floor_bench_times_each_update_against_its_floor():
    from embengine.bench.floor import format_floor, run_floor

    w = Workload("tiny-floor", "1 table x 3000 rows, dim 8", ((3000, 8),), 64, 5)
    results = run_floor(
        steps=2, warmup=0, engine_optimizers=("SGD", "Adam"), workload=w, log=lambda _: None
    )
    assert [(r.optimizer, r.width) for r in results] == [("SGD", 8), ("Adam", 24)]
    assert all(r.update_ms > 0 and r.floor_ms > 0 for r in results)
    table = format_floor(results)
    assert table.startswith("host: ") and f"{results[1].ratio:.2f}" in table
