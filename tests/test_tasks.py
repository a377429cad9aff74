"""kernels/tasks.py: the update kernels' task ranges, run on threads."""

import threading

import numba
import numpy as np
import pytest

from embengine.kernels import kernel, tasks


@pytest.mark.parametrize("n_tasks", [0, 1, 2, 3, 7, 512])
@pytest.mark.parametrize("n_threads", [1, 2, 3, 8])
def test_ranges_cover_the_tasks_once_in_order_and_evenly(n_tasks, n_threads):
    parts = tasks.ranges(n_tasks, n_threads)
    assert len(parts) == min(n_tasks, n_threads)
    assert [t for lo, hi in parts for t in range(lo, hi)] == list(range(n_tasks))
    sizes = [hi - lo for lo, hi in parts]
    assert all(s > 0 for s in sizes) and (not sizes or max(sizes) - min(sizes) <= 1)


def test_ranges_name_bad_counts():
    with pytest.raises(ValueError, match="n_threads >= 1, got 4, 0"):
        tasks.ranges(4, 0)
    with pytest.raises(ValueError, match="n_tasks >= 0"):
        tasks.ranges(-1, 2)


@kernel()
def _mark(task_lo, task_hi, seen, thread_of, marker):
    for t in range(task_lo, task_hi):
        seen[t] += 1
        thread_of[t] = marker[0]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_numba_kernel_runs_every_task_once_on_numba_s_thread_count(threads):
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip(f"numba has {numba.config.NUMBA_NUM_THREADS} thread(s)")
    numba.set_num_threads(threads)
    try:
        ranges_run: list[tuple[int, int, int]] = []

        def spy(lo, hi, seen, thread_of):
            ranges_run.append((lo, hi, threading.get_ident()))
            _mark(lo, hi, seen, thread_of, np.array([threading.get_ident() % 1000], np.int64))

        seen, thread_of = np.zeros(100, np.int64), np.zeros(100, np.int64)
        tasks.run(spy, 100, seen, thread_of)
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    np.testing.assert_array_equal(seen, 1)
    assert sorted((lo, hi) for lo, hi, _ in ranges_run) == tasks.ranges(100, threads)
    # the first range in the calling thread, the others on the pool's threads
    first = next(ident for lo, _, ident in ranges_run if lo == 0)
    assert first == threading.get_ident()
    assert len({ident for *_, ident in ranges_run}) == threads


def test_an_error_in_any_range_is_raised_after_every_range_ended():
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs two numba threads")
    ended = []

    def work(lo, hi):
        if lo > 0:
            raise KeyError(f"range {lo}")
        threading.Event().wait(0.2)  # the failing range ends first
        ended.append(lo)

    with pytest.raises(KeyError, match="range 5"):
        tasks.run(work, 10)
    assert ended == [0]


_ONE_UPDATE = """
import warnings
import numba
import numpy as np
import embengine as ee
numba.set_num_threads(2)
t = ee.TableConfig(1000, 8, name="t")
eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=ee.optimizers.SGD(0.1))
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    for _ in range(2):
        acts = eng.lookup({"f": np.arange(600)})  # 600 rows: 37 tasks, on two threads
        eng.apply_gradients({"f": np.ones_like(acts["f"])})
print(numba.threading_layer(), [w.category.__name__ for w in seen])
"""


@pytest.mark.parametrize("policy", [None, "ACTIVE", "PASSIVE"])
def test_spinning_openmp_threads_are_named_once(policy):
    """Under numba's omp layer an update on two threads warns once unless OMP_WAIT_POLICY is
    PASSIVE (kernels/tasks.py: spinning OpenMP threads take the update threads' cores)."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs two numba threads")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run(
        [sys.executable, "-c", _ONE_UPDATE],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    layer, seen = out.stdout.splitlines()[-1].split(" ", 1)
    want = ["SpinningThreadsWarning"] if layer == "omp" and policy != "PASSIVE" else []
    assert seen == str(want), out.stdout
