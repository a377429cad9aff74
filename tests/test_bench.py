"""The benchmark harness: workloads, interleaved timing of groups, each member's own peak RSS,
and the printed table."""

import numpy as np
import pytest

from embengine.bench import runner
from embengine.bench.workloads import Workload, make_batches

TINY = Workload("tiny", "2 tables x 500 rows, dims 2 and 4", ((500, 2), (500, 4)), 16, 3,
                packing=(False, True))  # fmt: skip


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


def test_groups_are_timed_step_by_step_in_alternating_order():
    log = []
    batches = make_batches(TINY, 1 + 2 + 4)
    makes = [lambda: _Recorder("a", log), lambda: _Recorder("b", log)]
    results = runner._time_configs(makes, batches, TINY, warmup=2, steps=4, log=lambda s: None)
    assert [r.name for r in results] == ["a", "b"]
    assert all(len(r.ms_all) == 4 and r.first_step_ms >= 0 for r in results)
    timed = [name for name, _ in log[-10:-2]]  # the 4 timed steps of each, then the closes
    assert timed == ["b", "a", "a", "b", "b", "a", "a", "b"]  # neither always goes first
    for name in "ab":  # each runner steps on every batch once, in order
        steps = [x for n, x in log if n == name and x != "closed"]
        assert steps == [id(b) for b in batches]


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
    makes = [lambda: _Holder("big", log, 400, 0), lambda: _Holder("small", log, 50, 100)]
    big, small = runner._time_configs(makes, make_batches(TINY, 4), TINY, 1, 2, lambda s: None)
    # big: base + 400 MiB; small: base + 50 MiB + its 100 MiB spikes. Not the pair's total.
    assert abs((big.peak_rss_gb - small.peak_rss_gb) * 1024 - 250) < 40
    assert small.peak_rss_gb * 1024 < runner.peak_rss_gb() * 1024 - 300


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(runner.WORKLOADS, "tiny", TINY)
    return "tiny"


def test_each_configuration_is_timed_with_its_peers_and_compared_in_the_table(tiny):
    results = runner.run_workload(tiny, steps=3, warmup=1, engine_optimizers=("SGD", "Adam"),
                                  peers=("torch",), log=lambda s: None)  # fmt: skip
    assert [(r.group, r.name) for r in results] == [
        (0, "embengine SGD"), (0, "embengine SGD (packed)"), (0, "torch SGD"),
        (1, "embengine Adam"), (1, "embengine Adam (packed)"), (1, "torch SparseAdam"),
    ]  # fmt: skip
    by_name = {r.name: r for r in results}
    assert by_name["embengine SGD (packed)"].peers == ("embengine SGD",)
    assert by_name["embengine SGD"].peers == ("torch SGD", "fbgemm EXACT_SGD")
    assert all(r.ms_per_step > 0 and r.ids_per_step == 2 * 16 * 3 for r in results)
    assert all(0 < r.peak_rss_gb <= runner.peak_rss_gb() for r in results)
    lines = runner.format_results(tiny, results).splitlines()
    packed = next(line for line in lines if line.startswith("embengine SGD (packed)"))
    ratio = by_name["embengine SGD"].ms_per_step / by_name["embengine SGD (packed)"].ms_per_step
    assert packed.endswith(f"embengine SGD: {ratio:.2f}x")
    unpacked = next(line for line in lines if line.startswith("embengine SGD  "))
    ratio = by_name["torch SGD"].ms_per_step / by_name["embengine SGD"].ms_per_step
    assert unpacked.endswith(f"torch SGD: {ratio:.2f}x")  # no FBGEMM run, no ratio to it
    assert "" in lines  # a blank line between the two groups
