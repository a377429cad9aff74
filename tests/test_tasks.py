"""kernels/tasks.py: the update kernels' task ranges, run on threads."""

import threading

import numba
import numpy as np
import pytest

from embengine.kernels import kernel, tasks


@pytest.fixture(autouse=True)
def hard_timeout():
    """No test here may hang CI: a run whose workers never answer would wait forever, so the
    process dumps its threads' stacks and exits after 120 s (xdist reports a crashed worker)."""
    import faulthandler

    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.mark.parametrize("n_tasks", [0, 1, 2, 3, 7, 512])
@pytest.mark.parametrize("n_threads", [1, 2, 3, 8])
def test_ranges_cover_the_tasks_once_in_order_and_evenly(n_tasks, n_threads):
    parts = tasks.ranges(n_tasks, n_threads)
    assert len(parts) == min(n_tasks, n_threads)
    assert [t for lo, hi in parts for t in range(lo, hi)] == list(range(n_tasks))
    sizes = [hi - lo for lo, hi in parts]
    assert all(s > 0 for s in sizes) and (not sizes or max(sizes) - min(sizes) <= 1)


def test_the_warning_class_is_public_without_importing_numba_eagerly():
    import embengine as ee

    assert ee.SpinningThreadsWarning is tasks.SpinningThreadsWarning
    assert issubclass(ee.SpinningThreadsWarning, RuntimeWarning)


def test_ranges_name_bad_counts():
    with pytest.raises(ValueError, match="n_threads >= 1, got 4, 0"):
        tasks.ranges(4, 0)
    with pytest.raises(ValueError, match="n_tasks >= 0"):
        tasks.ranges(-1, 2)


@kernel()
def _mark(task_lo, task_hi, seen):
    for t in range(task_lo, task_hi):
        seen[t] += 1


@pytest.mark.parametrize("threads", [1, 2])
def test_a_numba_kernel_runs_every_task_once_on_numba_s_thread_count(threads):
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip(f"numba has {numba.config.NUMBA_NUM_THREADS} thread(s)")
    numba.set_num_threads(threads)
    try:
        ranges_run: list[tuple[int, int, int]] = []

        def spy(lo, hi, seen):
            ranges_run.append((lo, hi, threading.get_ident()))
            _mark(lo, hi, seen)

        seen = np.zeros(100, np.int64)
        tasks.run(spy, 100, seen)
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    np.testing.assert_array_equal(seen, 1)
    assert sorted((lo, hi) for lo, hi, _ in ranges_run) == tasks.ranges(100, threads)
    # the first range in the calling thread, the others on the pool's threads
    first = next(ident for lo, _, ident in ranges_run if lo == 0)
    assert first == threading.get_ident()
    assert len({ident for *_, ident in ranges_run}) == threads


@pytest.fixture
def two_threads():
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs two numba threads")
    numba.set_num_threads(2)
    yield
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


def test_an_error_is_raised_after_every_range_ended(two_threads):
    ended = []

    def work(lo, hi):
        if lo == 0:
            raise KeyError("the calling thread's range")
        threading.Event().wait(0.3)  # the worker's range ends well after the error
        ended.append(lo)

    with pytest.raises(KeyError, match="calling thread"):
        tasks.run(work, 10)
    assert ended == [5]


def test_a_worker_s_error_reaches_the_caller(two_threads):
    def work(lo, hi):
        if lo > 0:
            raise KeyError(f"range {lo}")

    with pytest.raises(KeyError, match="range 5"):
        tasks.run(work, 10)


def test_an_interrupt_while_waiting_returns_only_after_the_ranges_ended(two_threads):
    """A KeyboardInterrupt in the caller's wait (Ctrl-C) is raised once the workers' ranges
    have ended, never while they still write the caller's arrays."""
    import signal

    ended = []

    def work(lo, hi):
        if lo == 0:
            signal.setitimer(signal.ITIMER_REAL, 0.05)  # SIGALRM while we wait for range 5
            return
        threading.Event().wait(0.4)
        ended.append(lo)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            tasks.run(work, 10)
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert ended == [5]


def test_a_forked_child_runs_ranges_on_its_own_workers(two_threads):
    """The parent's workers do not exist in a fork; the child starts its own (else its first
    run would wait forever on a queue nobody reads)."""
    import os

    seen = np.zeros(10, np.int64)
    tasks.run(_mark, 10, seen)  # the parent's worker exists now
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, report, exit without pytest's teardown
        try:
            numba.set_num_threads(2)
            child = np.zeros(10, np.int64)
            tasks.run(_mark, 10, child)
            os.write(w, bytes([int(child.sum())]))
        finally:
            os._exit(0)
    os.close(w)
    import select

    ready = []
    try:
        ready, _, _ = select.select([r], [], [], 60)
        assert ready, "the forked child did not finish its run in 60 s"
        assert os.read(r, 1) == bytes([10])
    finally:
        if not ready:
            os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(r)
    np.testing.assert_array_equal(seen, 1)


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
