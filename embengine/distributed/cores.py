"""Each rank of a machine on its own share of the cores.

Ranks started side by side (torchrun ``--nproc-per-node N``) each run their kernels on
``cores // N`` threads; left to the scheduler, a rank's threads, and the threads gloo starts
for its collectives, wander onto the cores of the other ranks, and a collective then waits
for a rank whose core was lent out. Bound, each rank's threads stay on its own cores
(docs/performance.md, "Ranks bound to their cores"). Linux only (``os.sched_setaffinity``).

The shares are cut from the job's cores: ``EMBENGINE_JOB_CORES`` (a comma-separated list,
which ``embengine train --nproc-per-node`` sets for its ranks and ``bind_cores`` sets on its
first call), else the cores the process may use. So binding twice gives the same share, not a
share of a share. Ranks a launcher pins already (``srun --cpu-bind``, NUMA binding) are best
left unbound: each sees only its own cores, and would take a share of those.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["JOB_CORES", "bind_cores", "core_share", "job_cores"]

# The environment variable naming the job's cores (module docstring).
JOB_CORES = "EMBENGINE_JOB_CORES"


def core_share(local_rank: int, local_world: int, allowed: Sequence[int]) -> list[int]:
    """The cores local rank ``local_rank`` of ``local_world`` ranks takes from ``allowed``
    (the cores the job may use): ``len(allowed) // local_world`` of them, rank 0 the lowest
    ones, so shares never overlap; cores left over stay unused.

    Raises ValueError for a rank outside ``[0, local_world)`` or fewer cores than ranks."""
    if isinstance(local_world, bool) or not isinstance(local_world, int) or local_world < 1:
        raise ValueError(f"local_world must be an int >= 1, got {local_world!r}")
    if isinstance(local_rank, bool) or not isinstance(local_rank, int):
        raise ValueError(f"local_rank must be an int, got {local_rank!r}")
    if not 0 <= local_rank < local_world:
        raise ValueError(f"local_rank {local_rank} is out of range [0, {local_world})")
    cores = sorted(set(allowed))
    each = len(cores) // local_world
    if each == 0:
        raise ValueError(
            f"{local_world} ranks cannot each have a core of their own: the job may use "
            f"{len(cores)} core(s) ({cores}); start fewer ranks or leave them unbound"
        )
    return cores[local_rank * each : (local_rank + 1) * each]


def job_cores() -> list[int]:
    """The job's cores: ``EMBENGINE_JOB_CORES`` if set, else the cores this process may use.

    Raises ValueError for a variable that is not a comma-separated list of core numbers."""
    value = os.environ.get(JOB_CORES)
    if value is None:
        return sorted(os.sched_getaffinity(0))
    try:
        cores = sorted({int(c) for c in value.split(",")})
    except ValueError:
        cores = []
    if not cores or cores[0] < 0:
        raise ValueError(f"{JOB_CORES}={value!r} is not a comma-separated list of core numbers")
    return cores


def bind_cores(local_rank: int | None = None, local_world: int | None = None) -> list[int]:
    """Bind this process to its share of the job's cores (``core_share`` of ``job_cores()``)
    and return them. The calling thread and every thread it starts afterwards stay there:
    call it first in a rank, before ``init_process_group`` (gloo's threads) and before any
    kernel runs (numba's and torch's thread pools); then give numba and torch ``len(cores)``
    threads. Threads started earlier keep their cores (OpenBLAS starts its own when NumPy is
    imported if ``OMP_NUM_THREADS`` > 1; torchrun sets it to 1). ``local_rank`` /
    ``local_world`` default to torchrun's ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``.

    Raises ValueError as ``core_share``, or when a default is asked for and the variable is
    not set; RuntimeError where the platform cannot bind (no ``os.sched_setaffinity``)."""
    if not hasattr(os, "sched_setaffinity"):
        raise RuntimeError("binding ranks to cores needs os.sched_setaffinity (Linux)")
    local_rank = _from_env("LOCAL_RANK") if local_rank is None else local_rank
    local_world = _from_env("LOCAL_WORLD_SIZE") if local_world is None else local_world
    job = job_cores()
    cores = core_share(local_rank, local_world, job)
    os.sched_setaffinity(0, cores)
    os.environ.setdefault(JOB_CORES, ",".join(map(str, job)))  # a second call: the same share
    return cores


def _from_env(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise ValueError(f"{name} is not set: pass it, or start the rank with torchrun")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an int") from None
