"""The benchmark harness: workloads, timing (interleaved pairs included) and the printed table."""

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


def test_pairs_are_timed_step_by_step_in_alternating_order():
    log = []
    batches = make_batches(TINY, 1 + 2 + 4)
    makes = [lambda: _Recorder("a", log), lambda: _Recorder("b", log)]
    results = runner._time_configs(makes, batches, TINY, warmup=2, steps=4, log=lambda s: None)
    assert [r.name for r in results] == ["a", "b"]
    assert all(r.interleaved and len(r.ms_all) == 4 for r in results)
    timed = [name for name, _ in log[-10:-2]]  # the 4 timed steps of each, then the closes
    assert timed == ["b", "a", "a", "b", "b", "a", "a", "b"]  # neither always goes first
    for name in "ab":  # each runner steps on every batch once, in order
        steps = [x for n, x in log if n == name and x != "closed"]
        assert steps == [id(b) for b in batches]
    single = runner._time_configs(makes[:1], batches, TINY, 2, 4, lambda s: None)
    assert not single[0].interleaved


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(runner.WORKLOADS, "tiny", TINY)
    return "tiny"


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")  # torch Adagrad's own warning
def test_packing_pairs_are_compared_in_the_printed_table(tiny):
    results = runner.run_workload(tiny, steps=3, warmup=1, engine_optimizers=("SGD", "Adam"),
                                  peers=("torch",), log=lambda s: None)  # fmt: skip
    names = [r.name for r in results]
    assert names == ["embengine SGD", "embengine SGD (packed)", "embengine Adam",
                     "embengine Adam (packed)", "torch SGD", "torch Adagrad",
                     "torch SparseAdam"]  # fmt: skip
    by_name = {r.name: r for r in results}
    assert by_name["embengine SGD (packed)"].peers == ("embengine SGD",)
    assert by_name["embengine SGD"].peers == ("torch SGD", "fbgemm EXACT_SGD")
    assert by_name["embengine SGD"].interleaved and not by_name["torch SGD"].interleaved
    assert all(r.ms_per_step > 0 and r.ids_per_step == 2 * 16 * 3 for r in results)
    table = runner.format_results(tiny, results)
    packed = next(line for line in table.splitlines() if line.startswith("embengine SGD (packed)"))
    ratio = by_name["embengine SGD"].ms_per_step / by_name["embengine SGD (packed)"].ms_per_step
    assert packed.endswith(f"embengine SGD: {ratio:.2f}x")
    unpacked = next(line for line in table.splitlines() if line.startswith("embengine SGD  "))
    assert "torch SGD: " in unpacked and "fbgemm" not in unpacked  # no FBGEMM run, no ratio
    assert table.splitlines()[-1].startswith("* timed interleaved")
