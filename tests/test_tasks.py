"""kernels/tasks.py: the update kernels' tasks, claimed by threads as they go."""

import threading

import numba
import numpy as np
import pytest

from embengine.kernels import kernel, pipeline, tasks
from embengine.kernels._intrinsics import fetch_add


@pytest.fixture(autouse=True)
def hard_timeout():
    """No test here may hang CI: a run whose workers never answer would wait forever, so the
    process dumps its threads' stacks and exits after 120 s (xdist reports a crashed worker)."""
    import faulthandler

    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def test_the_warning_class_is_public_without_importing_numba_eagerly():
    import embengine as ee

    assert ee.SpinningThreadsWarning is tasks.SpinningThreadsWarning
    assert issubclass(ee.SpinningThreadsWarning, RuntimeWarning)


def test_a_negative_task_count_is_refused():
    with pytest.raises(ValueError, match="n_tasks >= 0, got -1"):
        tasks.run(lambda claims, n: None, -1)


@kernel()
def _mark(claims, n_tasks, seen):
    while True:
        t = fetch_add(claims, 0, 1)
        if t >= n_tasks:
            break
        seen[t] += 1


@kernel()
def _slow_first_half(claims, n_tasks, seen, who, me):
    """Tasks below n_tasks / 2 spin a while (cold rows), the others are quick."""
    while True:
        t = fetch_add(claims, 0, 1)
        if t >= n_tasks:
            break
        if t < n_tasks // 2:
            x = 0.0
            for i in range(1_000_000):
                x += np.sqrt(i + t)
            seen[t] += 1 if x > 0 else 2
        else:
            seen[t] += 1
        who[t] = me[0]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_numba_kernel_runs_every_task_once_on_numba_s_thread_count(threads):
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip(f"numba has {numba.config.NUMBA_NUM_THREADS} thread(s)")
    numba.set_num_threads(threads)
    try:
        calls: list[tuple[int, int]] = []

        def spy(claims, n_tasks, seen):
            calls.append((n_tasks, threading.get_ident()))
            _mark(claims, n_tasks, seen)

        seen = np.zeros(100, np.int64)
        tasks.run(spy, 100, seen)
        few = np.zeros(1, np.int64)
        tasks.run(spy, 1, few)  # one task: one thread
        tasks.run(spy, 0, few)  # none: no call
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    np.testing.assert_array_equal(seen, 1)
    np.testing.assert_array_equal(few, 1)
    # one call per thread, one of them in the calling thread, the others on the pool's threads;
    # a worker may begin before the caller, so the calls' order says nothing
    assert [n for n, _ in calls] == [100] * threads + [1]
    assert threading.get_ident() in {ident for _, ident in calls[:threads]}
    assert len({ident for _, ident in calls[:threads]}) == threads
    assert calls[threads][1] == threading.get_ident()  # one task: the calling thread alone


def test_threads_take_tasks_as_they_go(two_threads):
    """A thread held up by costly tasks takes fewer of them: with the first half of the tasks
    slow, a static split would give one thread all of them; claimed one at a time, the other
    thread takes its share of the slow ones too and all of the quick ones."""
    n = 64
    seen = np.zeros(n, np.int64)
    who = np.full(n, -1, np.int64)
    marks = {}

    def spy(claims, n_tasks, seen, who):
        me = marks.setdefault(threading.get_ident(), np.array([len(marks)], np.int64))
        _slow_first_half(claims, n_tasks, seen, who, me)

    tasks.run(spy, n, seen, who)
    np.testing.assert_array_equal(seen, 1)
    slow = who[: n // 2]
    assert set(slow.tolist()) == {0, 1}, slow  # both threads ran slow tasks


@pytest.fixture
def two_threads():
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs two numba threads")
    numba.set_num_threads(2)
    yield
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


def _caller(work):
    """``work(in_caller)`` as a task kernel: is this call the calling thread's?"""
    caller = threading.get_ident()
    return lambda claims, n: work(threading.get_ident() == caller)


def test_an_error_is_raised_after_every_thread_ended(two_threads):
    ended = []

    def work(in_caller):
        if in_caller:
            raise KeyError("the calling thread's call")
        threading.Event().wait(0.3)  # the worker's call ends well after the error
        ended.append("worker")

    with pytest.raises(KeyError, match="calling thread"):
        tasks.run(_caller(work), 10)
    assert ended == ["worker"]


def test_a_worker_s_error_reaches_the_caller(two_threads):
    def work(in_caller):
        if not in_caller:
            raise KeyError("the worker's call")

    with pytest.raises(KeyError, match="worker's call"):
        tasks.run(_caller(work), 10)


def test_an_interrupt_while_waiting_returns_only_after_the_ranges_ended(two_threads):
    """A KeyboardInterrupt in the caller's wait (Ctrl-C) is raised once the workers' calls
    have ended, never while they still write the caller's arrays."""
    import signal

    ended = []

    def work(in_caller):
        if in_caller:
            signal.setitimer(signal.ITIMER_REAL, 0.05)  # SIGALRM while we wait for the worker
            return
        threading.Event().wait(0.4)
        ended.append("worker")

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            tasks.run(_caller(work), 10)
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert ended == ["worker"]


def test_a_forked_child_runs_tasks_on_its_own_workers(two_threads):
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


@kernel()
def _hold_first_until(claims, n_tasks, seen, flag, waited):
    """Task 0 waits (bounded) until ``flag[0]`` is set by another call's tasks; the others are
    quick. ``waited[0]``: 1 if the wait ran out."""
    while True:
        t = fetch_add(claims, 0, 1)
        if t >= n_tasks:
            break
        if t == 0:
            spins = 0
            while fetch_add(flag, 0, 0) == 0 and spins < 2_000_000_000:
                spins += 1
            if spins >= 2_000_000_000:
                waited[0] = 1
        seen[t] += 1


@kernel()
def _mark_and_flag(claims, n_tasks, seen, flag):
    """``_mark``, and ``flag[0]`` set once every task is done."""
    while True:
        t = fetch_add(claims, 0, 1)
        if t >= n_tasks:
            break
        seen[t] += 1
        if fetch_add(flag, 1, 1) + 1 == n_tasks:
            fetch_add(flag, 0, 1)


def test_run_many_makes_each_call_s_tasks_once_on_the_same_threads(two_threads):
    """A thread with no task left in one call goes on to the next call while another still
    runs the first: call 1's first task waits until call 2's tasks are all done, which only
    the other thread can do meanwhile (one ``run`` a call would wait for call 1 to end before
    starting call 2: the wait then runs out)."""
    first, second = np.zeros(4, np.int64), np.zeros(50, np.int64)
    flag, waited = np.zeros(2, np.int64), np.zeros(1, np.int64)
    tasks.run_many(
        [
            (_hold_first_until, 4, (first, flag, waited)),
            (_mark_and_flag, 50, (second, flag)),
            (_mark, 0, (first,)),  # no task: no call
        ]
    )
    np.testing.assert_array_equal(first, 1)
    np.testing.assert_array_equal(second, 1)
    assert waited[0] == 0, "call 2 did not run while call 1 was still running"


def test_run_many_refuses_a_negative_task_count_before_any_call():
    seen = np.zeros(3, np.int64)
    with pytest.raises(ValueError, match="n_tasks >= 0, got -2"):
        tasks.run_many([(_mark, 3, (seen,)), (_mark, -2, (seen,))])
    np.testing.assert_array_equal(seen, 0)


def test_run_many_s_other_threads_take_the_tasks_of_a_thread_that_raised(two_threads):
    """The calling thread's first call raises before claiming a task: it makes no more calls,
    the worker makes every call and does every task, and the error comes after."""
    seen = [np.zeros(20, np.int64), np.zeros(30, np.int64)]
    caller = threading.get_ident()

    def first(claims, n_tasks, seen):
        if threading.get_ident() == caller:
            raise KeyError("the calling thread's first call")
        _mark(claims, n_tasks, seen)

    with pytest.raises(KeyError, match="first call"):
        tasks.run_many([(first, 20, (seen[0],)), (_mark, 30, (seen[1],))])
    np.testing.assert_array_equal(seen[0], 1)
    np.testing.assert_array_equal(seen[1], 1)


def test_an_engine_step_updates_every_table_in_one_run(monkeypatch):
    """The numba backend's update of a step's tables is one ``run_many`` (one start of the
    threads a step, not one a table), in the engine's order: last table first."""
    import embengine as ee
    from embengine import optimizers as O

    made = []
    real = tasks.run_many

    def spy(calls):
        calls = list(calls)
        made.append([n for _, n, _ in calls])
        real(calls)

    monkeypatch.setattr(tasks, "run_many", spy)
    tables = {
        f"f{t}": ee.FeatureConfig(ee.TableConfig(1000, 8, name=f"t{t}", optimizer=opt))
        for t, opt in enumerate([O.SGD(0.1), O.Adagrad(0.1), O.Adam(0.01)])
    }
    engine = ee.EmbeddingEngine(tables)
    ids = {"f0": np.arange(100), "f1": np.arange(3), "f2": np.arange(300)}
    acts = engine.lookup({f: ee.Ragged(i, offsets=np.arange(len(i) + 1)) for f, i in ids.items()})
    engine.apply_gradients({f: np.ones_like(a) for f, a in acts.items()})
    assert len(made) == 1
    tasks_of = {f: len(pipeline.balanced_tasks(np.arange(len(i) + 1))) - 1 for f, i in ids.items()}
    assert made[0] == [tasks_of["f2"], tasks_of["f1"], tasks_of["f0"]]


def test_run_each_gives_each_item_to_one_thread(two_threads):
    """Every item once, on both threads: the first item waits (bounded) until another thread
    has taken one."""
    seen, other, waits = [], threading.Event(), []
    caller = threading.get_ident()

    def fn(item):
        if threading.get_ident() != caller:
            other.set()
        elif item == 0:
            waits.append(other.wait(10))
        seen.append((item, threading.get_ident()))

    tasks.run_each(fn, range(6))
    assert sorted(i for i, _ in seen) == list(range(6))
    assert waits in ([True], []) and len({ident for _, ident in seen}) == 2


def test_every_row_updates_do_not_hold_every_table_s_row_arrays_at_once():
    """An every-row update (non-lazy Adam) sweeps its table with two arrays of one entry a
    table row (the touched row of each row, int64, and the unchanged flags, uint8: 9 bytes a
    row). Made one table after the other they take one table's worth at a time; set up
    together for one ``run_many`` they took every table's at once (4 tables: 4 times the
    memory, and for memory-mapped tables larger than RAM that is the RAM the step needs)."""
    import tracemalloc

    import embengine as ee
    from embengine import optimizers as O

    rows, n_tables = 500_000, 4
    feats = {
        f"f{t}": ee.FeatureConfig(
            ee.TableConfig(rows, 4, name=f"t{t}", optimizer=O.Adam(0.01, lazy_adam=False))
        )
        for t in range(n_tables)
    }
    engine = ee.EmbeddingEngine(feats)
    rng = np.random.default_rng(0)

    def peak_of_a_step() -> int:
        ids = {f: rng.integers(0, rows, 1000) for f in feats}
        acts = engine.lookup(
            {f: ee.Ragged(i, offsets=np.arange(0, 1001, 10)) for f, i in ids.items()}
        )
        grads = {f: np.ones_like(a) for f, a in acts.items()}
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            engine.apply_gradients(grads)
            return tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()

    peak_of_a_step()  # compiles
    one_table = 9 * rows
    assert peak_of_a_step() < 2 * one_table


@kernel()
def _mark_bounds(claims, n_tasks, bounds, seen):
    """``_mark`` of every occurrence of each task of ``bounds`` (``pipeline.balanced_tasks``)."""
    while True:
        t = fetch_add(claims, 0, 1)
        if t >= n_tasks:
            break
        for u in range(bounds[t], bounds[t + 1]):
            seen[u] += 1


def test_run_balanced_gives_the_kernel_its_bounds_then_the_arguments():
    """``pipeline.run_balanced`` (the update's floor, kernels/floor.py): ``kernel(claims,
    n_tasks, bounds, *args)``, not the arguments packed in one tuple."""
    offsets = np.arange(0, 301, 3, dtype=np.int64)  # 100 unique rows of 3 occurrences
    seen = np.zeros(100, np.int64)
    pipeline.run_balanced(_mark_bounds, offsets, seen)
    np.testing.assert_array_equal(seen, 1)
