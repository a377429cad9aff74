"""Several processes compiling one cached kernel at once (embengine.kernels.compile_lock).

Real processes on a fresh NUMBA_CACHE_DIR, released together by a start file; a small cached
function in a module written to tmp_path, made with ``embengine.kernels.kernel`` (or, to show
the race, with plain ``nb.njit(cache=True)``). Every child has a hard timeout.
"""

from __future__ import annotations

import fcntl
import importlib
import json
import multiprocessing
import os
import pkgutil
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 120  # seconds for any one child: a child waiting on a lock never released fails

DECORATORS = {True: "@kernel()", False: "@nb.njit(cache=True)"}
DTYPES = ("int32", "int64", "float32", "float64")
# Each process compiles its array dtype with each of these weight types, one after another:
# many saves close together make the race of the unlocked cache likely in every round, where
# one save per process breaks it only now and then (docs/reliability.md has the figures).
WEIGHTS = tuple(
    ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float32", "float64"]
)

MODULE = """
import numba as nb

from embengine.kernels import kernel


{decorator}
def weighted_sum(a, w):
    s = a[0] - a[0]
    for i in range(a.shape[0]):
        s += a[i] * w * (i % 7 + 1)
    return s
"""

# Compiles weighted_sum for argv[2] once the start file argv[1] exists; prints its stats.
WORKER = """
import json, os, sys, time
import numba as nb
import numpy as np
import kern

start, dtype, weights = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
nb.njit(lambda x: x + 1)(1)  # numba's compiler set up before the start, not after it
open(start + "." + str(os.getpid()) + ".ready", "w").close()
deadline = time.monotonic() + 60
while not os.path.exists(start):
    if time.monotonic() > deadline:
        sys.exit("the start file never appeared")
    time.sleep(0.0005)
if dtype == "bad":
    try:
        kern.weighted_sum("not an array", 1)
    except nb.core.errors.TypingError:
        print(json.dumps({"failed": True}), flush=True)
    open(start + ".failed", "w").close()
    while not os.path.exists(start + ".stop"):  # the test makes it, even when it fails
        if time.monotonic() > deadline + 600:
            sys.exit("the stop file never appeared")
        time.sleep(0.01)
    dtype = "int64"  # the same process compiles the function again after its failure
a = np.arange(1, 41, dtype=dtype)
result = {float(kern.weighted_sum(a, np.dtype(w).type(1))) for w in weights}
stats = kern.weighted_sum.stats
print(json.dumps({"result": sorted(result), "hits": sum(stats.cache_hits.values()),
                  "misses": sum(stats.cache_misses.values())}))
"""

# A fresh process: loads every specialisation, reports what it got and the cache's index.
CHECKER = """
import json
import numpy as np
import kern

f = kern.weighted_sum
index = f._cache._cache_file._load_index()  # before a miss would add to it
results = {f"{dt},{w}": float(f(np.arange(1, 41, dtype=dt), np.dtype(w).type(1)))
           for dt in DTYPES for w in WEIGHTS}
print(json.dumps({"results": results, "hits": sum(f.stats.cache_hits.values()),
                  "misses": sum(f.stats.cache_misses.values()),
                  "signatures": sorted(f"{a.dtype},{w}" for a, w in f.signatures),
                  "entries": len(index), "data_files": len(set(index.values()))}))
""".replace("DTYPES", repr(DTYPES)).replace("WEIGHTS", repr(WEIGHTS))

# Rounds of the unlocked race at most (stopping at the first broken cache).
UNLOCKED_ROUNDS = 5
EXPECTED = float(sum((i + 1) * (i % 7 + 1) for i in range(40)))


def _setup(folder: Path, locked: bool) -> dict:
    """The module, worker and checker in ``folder``; the environment of their processes."""
    folder.mkdir(parents=True)
    (folder / "kern.py").write_text(MODULE.format(decorator=DECORATORS[locked]))
    (folder / "worker.py").write_text(WORKER)
    (folder / "checker.py").write_text(CHECKER)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(folder / "cache"), PYTHONPATH=str(REPO))
    env.pop("NUMBA_DISABLE_JIT", None)
    return env


def _worker(folder: Path, env: dict, dtype: str, weights=WEIGHTS) -> subprocess.Popen:
    """A worker compiling weighted_sum for ``dtype`` arrays and ``weights`` once the start file
    exists (dtype "bad": a compile that fails first, then int64 once the stop file exists)."""
    return subprocess.Popen(
        [
            sys.executable,
            str(folder / "worker.py"),
            str(folder / "start"),
            dtype,
            ",".join(weights),
        ],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(path_glob: str, folder: Path, count: int, procs: list) -> None:
    deadline = time.monotonic() + TIMEOUT
    while len(list(folder.glob(path_glob))) < count:
        assert time.monotonic() < deadline, f"no {path_glob} after {TIMEOUT} s"
        for p in procs:
            assert p.poll() is None, p.communicate()
        time.sleep(0.01)


def _finish(procs: list) -> list[list[dict]]:
    """Each worker's JSON lines (hard timeout; a worker left running is killed)."""
    try:
        outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return [[json.loads(line) for line in out.splitlines()] for out, _ in outs]


def _run_together(folder: Path, env: dict, dtypes: list[str], weights=WEIGHTS) -> list[dict]:
    """One worker per array dtype, released together; each one's stats."""
    procs = [_worker(folder, env, dtype, weights) for dtype in dtypes]
    try:
        _wait_for("start.*.ready", folder, len(procs), procs)
    except BaseException:
        for p in procs:
            p.kill()
            p.communicate()
        raise
    (folder / "start").touch()
    return [line for (line,) in _finish(procs)]


def _check(folder: Path, env: dict) -> str | None:
    """What is wrong with the cache the workers left, as seen by a fresh process; None if
    every specialisation loads from it (one data file each) and computes the right result."""
    done = subprocess.run(
        [sys.executable, str(folder / "checker.py")],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    if done.returncode != 0:
        return f"the checker died ({done.returncode}): {done.stderr[-500:]}"
    got = json.loads(done.stdout)
    n = len(DTYPES) * len(WEIGHTS)
    wrong = {sig: r for sig, r in got["results"].items() if r != EXPECTED}
    if wrong:
        return f"wrong results {wrong} (expected {EXPECTED}): another signature's code"
    if got["hits"] != n or got["misses"] or got["entries"] != n or got["data_files"] != n:
        return f"expected {n} cache hits, entries and data files; got {got}"
    expected = sorted(f"{dt},{w}" for dt in DTYPES for w in WEIGHTS)
    if got["signatures"] != expected:
        return f"specialisations loaded under other signatures: {got['signatures']}"
    return None


def race_rounds(tmp: Path, locked: bool, rounds: int, until_broken=False) -> list[str | None]:
    """Per round (fresh cache): 4 processes compile their own specialisations (int32 / int64 /
    float32 / float64 arrays, each with every weight type) at once; then what a fresh process
    finds wrong with the cache (None: nothing). ``until_broken``: stop at the first problem."""
    problems = []
    for r in range(rounds):
        folder = tmp / f"round{r}"
        env = _setup(folder, locked)
        for line in _run_together(folder, env, list(DTYPES)):
            assert line == {"result": [EXPECTED], "hits": 0, "misses": len(WEIGHTS)}, line
        problems.append(_check(folder, env))
        if until_broken and problems[-1]:
            break
    return problems


def test_processes_compiling_different_specialisations_keep_every_entry(tmp_path):
    problems = race_rounds(tmp_path, locked=True, rounds=3)
    assert problems == [None] * 3, problems


def test_plain_numba_cache_loses_or_mixes_entries_under_the_same_race(tmp_path):
    """The same race without the lock (plain ``nb.njit(cache=True)``) breaks the cache: the
    index loses entries or maps a signature to another one's data file."""
    problems = race_rounds(tmp_path, locked=False, rounds=UNLOCKED_ROUNDS, until_broken=True)
    assert any(problems), f"no round of {UNLOCKED_ROUNDS} broke the cache: the test proves nothing"


def test_processes_wanting_the_same_specialisation_compile_it_once(tmp_path):
    folder = tmp_path / "same"
    env = _setup(folder, locked=True)
    lines = _run_together(folder, env, ["float64"] * 3, weights=["float32"])
    assert [line["result"] for line in lines] == [[EXPECTED]] * 3
    assert sum(line["misses"] for line in lines) == 1, lines
    assert sum(line["hits"] for line in lines) == 2, lines


def test_a_compile_that_raises_releases_the_lock(tmp_path):
    """A process whose compile fails (a TypingError) and lives on blocks neither another
    process compiling the same function nor itself compiling it again."""
    folder = tmp_path / "fail"
    env = _setup(folder, locked=True)
    failing = _worker(folder, env, "bad", ["int8"])
    try:
        _wait_for("start.*.ready", folder, 1, [failing])
        (folder / "start").touch()
        _wait_for("start.failed", folder, 1, [failing])
        # The failing process lives on after its failed compile: another one compiles now.
        try:
            other = subprocess.run(
                [
                    sys.executable,
                    str(folder / "worker.py"),
                    str(folder / "start"),
                    "float32",
                    "int8",
                ],
                cwd=folder,
                env=env,
                capture_output=True,
                text=True,
                timeout=TIMEOUT,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"after {TIMEOUT} s another process still waits for the failed compile's lock"
            )
        assert other.returncode == 0, other.stderr[-3000:]
        assert json.loads(other.stdout) == {"result": [EXPECTED], "hits": 0, "misses": 1}
    finally:
        (folder / "start.stop").touch()
    [lines] = _finish([failing])
    assert lines == [{"failed": True}, {"result": [EXPECTED], "hits": 0, "misses": 2}], lines


def test_every_kernel_of_embengine_is_locked():
    from numba.core.dispatcher import Dispatcher

    import embengine.kernels as kernels
    from embengine.kernels import codegen, lookup, row_math
    from embengine.kernels.cache_stamp import StampedCache
    from embengine.kernels.compile_lock import LockedCache
    from embengine.optimizers._row_math import ROW_MATH

    found = [row_math.kernels(ROW_MATH["sgd"])[2](8, 0), lookup.pool_kernel(8)]
    for rm in codegen.builtin_row_math():  # the rendered update kernels, as the folder's
        found += [k for k in row_math.kernels(rm)[:2] if k is not None]
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"embengine.kernels.{info.name}")
        found += [v for v in vars(module).values() if isinstance(v, Dispatcher)]
    unlocked = [d.__qualname__ for d in found if not isinstance(d._cache, LockedCache)]
    assert len(found) > 50 and not unlocked, unlocked
    # and each is keyed on the kernels folder's digest (test_kernel_cache.py)
    unstamped = [d.__qualname__ for d in found if not isinstance(d._cache._cache, StampedCache)]
    assert not unstamped, unstamped


def test_a_numba_that_differs_is_an_import_error_naming_its_version(monkeypatch):
    import numba
    from numba.core import dispatcher

    from embengine.kernels import compile_lock

    def compile(self, sig):  # a numba whose compile never consults the cache
        return self._compiler.compile(sig, None)

    monkeypatch.setattr(dispatcher.Dispatcher, "compile", compile)
    with pytest.raises(ImportError, match=re.escape(f"numba {numba.__version__} is not")):
        compile_lock._check_numba()


def test_a_function_without_the_file_cache_is_refused():
    import numba

    from embengine.kernels.compile_lock import locked

    with pytest.raises(TypeError, match="has no on-disk numba cache.*cache=True"):
        locked(numba.njit(lambda x: x))


def _run_and_sleep(started) -> None:
    started.set()
    time.sleep(TIMEOUT)


def test_a_forked_child_does_not_keep_its_parents_lock(tmp_path):
    """A child forked while this process holds a lock drops its copy: once the parent
    releases it, other processes can take it while the child still runs."""
    from embengine.kernels.compile_lock import _lock_for

    lock = _lock_for(str(tmp_path / "k.nbi.lock"))
    lock.acquire()
    fork = multiprocessing.get_context("fork")
    started = fork.Event()
    child = fork.Process(target=_run_and_sleep, args=(started,))
    child.start()
    try:
        assert started.wait(TIMEOUT), "the forked child never ran"
        lock.release()
        fd = os.open(lock.path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError if the child held it
        finally:
            os.close(fd)
    finally:
        child.kill()
        child.join(TIMEOUT)


if __name__ == "__main__":
    # python tests/test_compile_lock.py ROUNDS locked|plain: how often the race breaks the cache
    import tempfile

    rounds, kind = int(sys.argv[1]), sys.argv[2]
    with tempfile.TemporaryDirectory() as tmp:
        found = race_rounds(Path(tmp), locked=kind == "locked", rounds=rounds)
    for problem in found:
        print(problem)
    print(f"{kind}: {sum(map(bool, found))} of {rounds} rounds broke the cache")
