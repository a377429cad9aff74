"""Run tasks (fuzz cases, crafted checkpoints) in child processes that may crash or hang.

The parent writes the tasks to a JSON file and starts a child (``python -m _fuzz.runner``,
this repository's embengine first on its path) on a list of task indices. The child warms up
(imports, numba kernels loaded or compiled: a cold cache takes minutes, so warming up has its
own, generous timeout), caps its address space (a memory bomb then raises MemoryError instead
of taking the machine's RAM), says READY, then for each task writes ``S <i>`` before running it
and ``R <i> <json result>`` after, unbuffered, to a progress file. So when the child dies, the
task it had started is known: the parent records it as ``crash`` (killed by a signal or exited
without finishing: a segfault, an abort, SIGBUS), or, when a task runs longer than
``case_timeout``, kills the child's process group and records ``hang``. A new child then
carries on with the next task.

A task can also corrupt memory quietly and an innocent later task dies. ``attribute`` decides
how hard the parent looks for the culprit: "none" blames the task that was running; "alone"
(default) reruns that task alone in a fresh child, and if it then passes, its own result is
kept and the crash is recorded against it anyway with the note "did not crash alone"; "bisect"
additionally reruns the tail of the child's earlier tasks (``tasks[j:] + [k]``, binary search
on ``j``) to find the first task whose effects kill ``k``, and records the crash against it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[1]
REPO = TESTS_DIR.parent
# The child's address space beyond what it holds after warming up.
MEMORY_HEADROOM = 4 << 30


def _child_env(workdir: Path | None = None) -> dict:
    env = dict(os.environ)
    if workdir is not None:  # the child's temporary files go there; the runner removes it
        env["EMBENGINE_FUZZ_TMP"] = str(workdir)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(TESTS_DIR), *filter(None, [env.get("PYTHONPATH")])]
    )
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a crash prints the Python stack to stderr
    return env


class _Child:
    """One child process working through ``indices``; the parent polls it."""

    def __init__(self, kind: str, tasks_file: Path, indices: list[int], workdir: Path):
        self.indices = indices
        fd, index_file = tempfile.mkstemp(prefix="idx-", suffix=".json", dir=workdir)
        with os.fdopen(fd, "w") as f:
            json.dump(indices, f)
        self.progress = Path(index_file).with_suffix(".progress")
        self.progress.touch()
        self.stderr_path = Path(index_file).with_suffix(".stderr")
        self._stderr = open(self.stderr_path, "wb")  # noqa: SIM115 - closed in finish()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "_fuzz.runner",
                kind,
                str(tasks_file),
                index_file,
                str(self.progress),
            ],
            cwd=REPO,
            env=_child_env(workdir),
            stdin=subprocess.DEVNULL,
            stdout=self._stderr,
            stderr=self._stderr,
            start_new_session=True,
        )
        self._offset = 0
        self._partial = b""
        self.ready = False
        self.running: int | None = None
        self.started_at = time.monotonic()
        # The running case's time spent compiling (see _pause_the_clock_while_numba_compiles).
        self.paused = 0.0
        self.paused_at: float | None = None
        self.results: dict[int, dict] = {}
        self.order: list[int] = []  # tasks finished, in order

    def case_seconds(self, now: float) -> float:
        """The running case's time so far, without its time compiling."""
        paused = self.paused + (now - self.paused_at if self.paused_at is not None else 0.0)
        return now - self.started_at - paused

    def poll_lines(self) -> None:
        with open(self.progress, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            text = line.decode()
            if text == "READY":
                self.ready = True
                self.started_at = time.monotonic()
            elif text.startswith("S "):
                self.running = int(text[2:])
                self.started_at = time.monotonic()
                self.paused = 0.0
                if self.paused_at is not None:
                    self.paused_at = self.started_at
            elif text == "P":
                self.paused_at = time.monotonic()
            elif text == "U" and self.paused_at is not None:
                self.paused += time.monotonic() - self.paused_at
                self.paused_at = None
            elif text.startswith("R "):
                i, _, payload = text[2:].partition(" ")
                self.results[int(i)] = json.loads(payload)
                self.order.append(int(i))
                self.running = None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def finish(self) -> str:
        self._stderr.close()
        tail = self.stderr_path.read_bytes()[-20000:].decode(errors="replace")
        for p in (self.progress, self.stderr_path, self.progress.with_suffix(".json")):
            p.unlink(missing_ok=True)
        return tail


def _death(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


def _stack(stderr_tail: str) -> str:
    """Where it died: faulthandler's first line and the innermost embengine frame (else the
    last lines of stderr)."""
    lines = [ln.strip() for ln in stderr_tail.splitlines() if ln.strip()]
    fatal = next((ln for ln in lines if ln.startswith("Fatal Python error")), "")
    frames = [ln for ln in lines if ln.startswith('File "') and "/embengine/" in ln]
    if frames:
        m = re.match(r'File "(.*/)?(embengine/[^"]+)", line (\d+) in (\S+)', frames[0])
        where = f"{m[2]}:{m[3]} in {m[4]}" if m else frames[0]
        return f"{fatal} at {where}".strip()
    return (fatal + " " + " | ".join(lines[-4:]))[-600:].strip()


class Runner:
    """Runs tasks of one kind ("case" or "ckpt") in children; see the module docstring."""

    def __init__(
        self,
        kind: str,
        tasks: list[dict],
        *,
        case_timeout: float = 30.0,
        startup_timeout: float = 900.0,
        attribute: str = "alone",
        budget: float | None = None,
        max_faults: int | None = None,
        progress: Callable[[int, int, dict], None] | None = None,
    ):
        if attribute not in ("none", "alone", "bisect"):
            raise ValueError(f"attribute must be 'none', 'alone' or 'bisect', got {attribute!r}")
        self.kind = kind
        self.tasks = tasks
        self.case_timeout = case_timeout
        self.startup_timeout = startup_timeout
        self.attribute = attribute
        self.budget = budget
        self.max_faults = max_faults
        self.progress = progress
        self.children_started = 0
        self._workdir = Path(tempfile.mkdtemp(prefix="embengine-fuzz-run-"))
        self._tasks_file = self._workdir / "tasks.json"
        self._tasks_file.write_text(json.dumps(tasks))

    def _run_child(self, indices: list[int]) -> tuple[_Child, dict | None]:
        """Run ``indices`` in one child until it finishes or faults: (child, fault) where fault
        is None or {"index", "outcome", "detail"}."""
        child = _Child(self.kind, self._tasks_file, indices, self._workdir)
        self.children_started += 1
        fault = None
        while True:
            time.sleep(0.02)
            rc = child.proc.poll()
            child.poll_lines()
            now = time.monotonic()
            if rc is not None:
                child.poll_lines()
                if len(child.results) < len(indices):
                    tail = child.finish()
                    if not child.ready:
                        raise RuntimeError(
                            f"the fuzz child died warming up ({_death(rc)}):\n{tail}"
                        )
                    running = child.running
                    if running is None:  # died between tasks: blame the next one
                        done = set(child.results)
                        running = next(i for i in indices if i not in done)
                    fault = {
                        "index": running,
                        "outcome": "crash",
                        "detail": f"{_death(rc)}: {_stack(tail)}",
                    }
                    return child, fault
                child.finish()
                return child, None
            if not child.ready and now - child.started_at > self.startup_timeout:
                child.kill()
                tail = child.finish()
                raise RuntimeError(
                    f"the fuzz child did not warm up in {self.startup_timeout} s:\n{tail}"
                )
            # A case's limit excludes numba compiling; compiling itself has the warm-up's.
            if (
                child.ready
                and child.running is not None
                and (
                    child.case_seconds(now) > self.case_timeout
                    or now - child.started_at > self.startup_timeout
                )
            ):
                running, seconds = child.running, now - child.started_at
                child.kill()
                child.poll_lines()
                tail = child.finish()
                fault = {
                    "index": running,
                    "outcome": "hang",
                    "detail": f"no result after {seconds:.0f} s (limit {self.case_timeout:.0f} s "
                    f"besides compiling): {_stack(tail)}",
                }
                return child, fault

    def _faults_alone(self, indices: list[int], k: int) -> tuple[bool, dict | None, dict | None]:
        """Run ``indices`` (ending with k): (faulted at k, fault, k's result if it finished)."""
        child, fault = self._run_child(indices)
        return (fault is not None and fault["index"] == k), fault, child.results.get(k)

    def run(self) -> list[dict]:
        """Every task's result ({"outcome", "detail", ...}), in task order."""
        try:
            return self._run()
        finally:
            shutil.rmtree(self._workdir, ignore_errors=True)

    def _run(self) -> list[dict]:
        results: dict[int, dict] = {}
        todo = list(range(len(self.tasks)))
        start = time.monotonic()
        faults = 0
        while todo:
            if self.budget is not None and time.monotonic() - start > self.budget:
                break
            if self.max_faults is not None and faults >= self.max_faults:
                break
            child, fault = self._run_child(todo)
            for i in child.order:
                results[i] = child.results[i]
                self._report(i, results[i])
            if fault is None:
                todo = []
                break
            faults += 1
            k = fault["index"]
            ran = [i for i in todo[: todo.index(k)] if i in child.results]
            results[k] = self._attribute(k, fault, ran, results)
            self._report(k, results[k])
            todo = todo[todo.index(k) + 1 :]
        for i in todo:
            results.setdefault(i, {"outcome": "not_run", "detail": "budget exhausted"})
        for i in range(len(self.tasks)):
            results.setdefault(i, {"outcome": "not_run", "detail": "budget exhausted"})
        return [results[i] for i in range(len(self.tasks))]

    def _report(self, i: int, result: dict) -> None:
        if self.progress is not None:
            self.progress(i, len(self.tasks), result)

    def _attribute(self, k: int, fault: dict, ran: list[int], results: dict) -> dict:
        """The result of task k, which was running when its child crashed or hung."""
        if self.attribute == "none":
            return {"outcome": fault["outcome"], "detail": fault["detail"]}
        again, fault2, alone = self._faults_alone([k], k)
        if again:
            return {
                "outcome": fault2["outcome"],
                "detail": fault2["detail"] + " (reproduced alone)",
            }
        note = f"{fault['outcome']} while running it after {len(ran)} other tasks, not alone"
        if self.attribute == "bisect" and ran:
            lo, hi = 0, len(ran)  # ran[lo:] + [k] faults; ran[hi:] + [k] does not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                faulted, _, _ = self._faults_alone(ran[mid:] + [k], k)
                lo, hi = (mid, hi) if faulted else (lo, mid)
            culprit = ran[lo]
            confirmed, _, _ = self._faults_alone(ran[lo:] + [k], k)
            if confirmed:
                prior = results.get(culprit, {})
                results[culprit] = {
                    "outcome": fault["outcome"],
                    "detail": f"kills the process later (task {k} died after it: "
                    f"{fault['detail']}); its own result was {prior.get('outcome')}",
                }
                self._report(culprit, results[culprit])
                base = alone or {"outcome": "harness_error", "detail": "no result alone"}
                return {
                    **base,
                    "detail": base.get("detail", "") + f" [{note}; culprit task {culprit}]",
                }
        return {
            "outcome": fault["outcome"],
            "detail": f"{fault['detail']} ({note}; alone: {(alone or {}).get('outcome')})",
        }


# -- the child ------------------------------------------------------------------------------------

_POISONED = False


def locked_selftest_kernel():
    """A kernel under the compile lock, as embengine's are (its cache beside this file)."""
    from embengine.kernels import kernel

    @kernel()
    def triple(x):
        return 3 * x

    return triple


def _selftest(task: dict) -> dict:
    """Tasks that misbehave on purpose, to test the runner itself: "ok", "segv" (a real
    segfault), "hang", "poison" (passes, but makes every later "segv_if_poisoned" crash: memory
    corruption that kills an innocent later task) and "segv_if_poisoned"; and tasks that are
    slow only in numba: "compile" (compiles new functions for ``seconds``) and "locked" (calls
    a kernel whose compile lock the test holds)."""
    global _POISONED
    action = task["action"]
    if action == "compile":
        import numba
        import numpy as np

        # New functions until the given time has passed: a count of them is too short on a
        # fast host (eight took 0.498 s on CI against a 0.5 s limit).
        start, power = time.monotonic(), 0
        while time.monotonic() - start < task["seconds"]:
            power += 1

            @numba.njit(cache=False)
            def total(x, power=power):
                s = 0.0
                for i in range(x.shape[0]):
                    s += x[i] ** power if x[i] > 0 else -x[i]
                return s

            total(np.arange(3.0))
    if action == "locked":
        locked_selftest_kernel()(task["value"])
    if action == "poison":
        _POISONED = True
    if action == "segv" or (action == "segv_if_poisoned" and _POISONED):
        import ctypes

        ctypes.string_at(0)  # reads address 0: SIGSEGV
    if action == "hang":
        time.sleep(3600)
    return {"outcome": "right_answer", "detail": action}


def _limit_memory() -> None:
    import resource

    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = vm + MEMORY_HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _pause_the_clock_while_numba_compiles(say: Callable[[str], None]) -> None:
    """Say ``P`` when numba starts compiling or waits for a kernel's compile lock, ``U`` when
    it is done: a case whose input is a new numba type compiles a specialisation, and under a
    parallel test run it may first wait for another process's compile of that kernel. Neither
    is the case's own time (the parent stops its clock between ``P`` and ``U``)."""
    from numba.core import event

    from embengine.kernels import compile_lock

    depth = [0]  # nested: a kernel's compile compiles its callees, each under its own lock

    def enter() -> None:
        depth[0] += 1
        if depth[0] == 1:
            say("P")

    def leave() -> None:
        depth[0] -= 1
        if depth[0] == 0:
            say("U")

    class _Compiling(event.Listener):
        def on_start(self, ev: event.Event) -> None:
            enter()

        def on_end(self, ev: event.Event) -> None:
            leave()

    event.register("numba:compile", _Compiling())
    for name in ("load_overload", "save_overload"):  # the lock's waits happen in these
        original = getattr(compile_lock.LockedCache, name)

        def timed(self, *args, _original=original, **kwargs):
            enter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                leave()

        setattr(compile_lock.LockedCache, name, timed)


def child_main(kind: str, tasks_file: str, index_file: str, progress_file: str) -> None:
    import faulthandler

    faulthandler.enable()
    tasks = json.loads(Path(tasks_file).read_text())
    indices = json.loads(Path(index_file).read_text())
    if kind == "case":
        from .execute import run_case as run
        from .execute import warm_up
    elif kind == "ckpt":
        from .crafted import run_task as run
        from .crafted import warm_up
    elif kind == "selftest":
        run, warm_up = _selftest, lambda: None
    else:
        raise SystemExit(f"unknown task kind {kind!r}")
    warm_up()
    _limit_memory()
    fd = os.open(progress_file, os.O_WRONLY | os.O_APPEND)

    def say(text: str) -> None:
        os.write(fd, (text + "\n").encode())

    _pause_the_clock_while_numba_compiles(say)
    say("READY")
    for i in indices:
        say(f"S {i}")
        t = time.perf_counter()
        result = run(tasks[i])
        result["seconds"] = round(time.perf_counter() - t, 4)
        say(f"R {i} {json.dumps(result)}")
    os.close(fd)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (numba's and torch's thread pools)


if __name__ == "__main__":
    child_main(*sys.argv[1:5])
