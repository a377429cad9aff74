"""The ranks of a multi-process test as child processes on 127.0.0.1, under a hard time limit
(tests/test_distributed.py's ``spawn``, tests/dist_fuzz.py's campaigns)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_ranks(
    argv: Callable[[int], list[str]],
    world: int,
    out: Path,
    limit: float,
    env: dict | None = None,
) -> list[int | None]:
    """Run ``world`` children, rank r as ``python *argv(r)`` (one numba and one OpenMP thread
    each, gloo on the loopback, this checkout's embengine), each logging to OUT/log.rank<r>;
    their exit codes, None for each child still running after ``limit`` seconds (killed)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "GLOO_SOCKET_IFNAME": "lo",
        "NUMBA_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(HERE.parent),
        **(env or {}),
    }
    logs = [open(out / f"log.rank{r}", "w") for r in range(world)]  # noqa: SIM115
    procs = [
        subprocess.Popen(
            [sys.executable, *argv(r)], stdout=logs[r], stderr=subprocess.STDOUT, env=env
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + limit
    codes: list[int | None] = []
    try:
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    return codes
