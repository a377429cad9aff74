"""The ranks of a distributed ``embengine train``: launch, data slices, gradients, evaluation.

``embengine train ... --nproc-per-node N`` starts N ranks on this machine with torchrun
(``python -m torch.distributed.run``, gloo on 127.0.0.1); ``torchrun -m embengine.cli train
...`` does the same on any launcher's terms. Each rank trains as one slice of the single-process
run, so that the run is that run, up to float rounding:

- global batch i of epoch e is the single-process run's batch i; rank r trains on its slice
  ``[r * n // W, (r + 1) * n // W)`` of its n samples;
- the tables live in a ``ShardedEngine``, which trains exactly as one ``EmbeddingEngine`` fed
  the whole batch;
- each rank's loss is its samples' summed logloss divided by the *global* batch's n, and the
  dense model's gradients are summed over ranks (DDP with a summing communication hook): both
  the tables' and the dense model's gradients are then those of the global batch's mean loss;
- evaluation: each rank scores its slice of every evaluation batch; AUC and logloss are
  computed on all ranks' scores together (both are independent of the samples' order).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import numpy as np

__all__ = ["Ranks", "launch", "in_launched_rank", "free_port", "ragged_slice"]

# embengine.distributed.cores.JOB_CORES, named here so that the launcher does not import torch.
JOB_CORES = "EMBENGINE_JOB_CORES"


def in_launched_rank() -> bool:
    """Whether this process is a rank started by torchrun (its environment names a world)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


# Where free_port draws from: below the kernel's ephemeral ports (ip_local_port_range), above
# the well-known and most registered services.
_PORTS_FROM = 20000
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_low() -> int:
    """The first port the kernel hands out to connections and port-0 listeners."""
    try:
        with open(_EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous of ranks on this machine), drawn
    at random below the ephemeral range: a port the kernel picked itself (bind to port 0)
    could be handed out again, to an outgoing connection or to gloo's own listeners, before
    the store binds it (EADDRINUSE, seen once in a fresh clone's test run with its ranks
    and connections of several tests at once). From the ephemeral range only if no port
    below it is free."""
    import random

    low, draw = _ephemeral_low(), random.SystemRandom()
    for _ in range(64) if low - _PORTS_FROM > 1000 else ():
        port = draw.randrange(_PORTS_FROM, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv: list[str], nproc_per_node: int, max_restarts: int = 0) -> int:
    """Run ``embengine <argv>`` as ``nproc_per_node`` ranks on this machine under torchrun
    (rendezvous on 127.0.0.1, a free port); if a rank fails (torchrun then stops the others),
    start them all again, up to ``max_restarts`` times, each time with a fresh torchrun.
    Returns the last exit status.

    Restarts are ours, not torchrun's ``--max-restarts``: torchrun's restarted ranks share
    the previous attempt's store, and read their peers' old addresses from it (gloo: connection
    refused; pytorch issue 167288), so each restart here gets a new port and a new store.
    torchrun's log folders go to a temporary folder of ours, removed after each attempt (by
    default torchrun leaves an empty ``torchelastic_*`` tree in the temp folder every run)."""
    status, stopped = 0, []
    for attempt in range(max_restarts + 1):
        if attempt:
            print(
                f"embengine train: a rank failed (exit status {status}); restart {attempt} of "
                f"{max_restarts}",
                file=sys.stderr,
                flush=True,
            )
        env = dict(os.environ)
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: the loopback interface
        cores = os.cpu_count() or 1
        if hasattr(os, "sched_getaffinity"):  # the ranks' shares are cut from these
            cores = len(os.sched_getaffinity(0))
            env.setdefault(JOB_CORES, ",".join(map(str, sorted(os.sched_getaffinity(0)))))
        # Each rank's share of the cores, as Ranks.join gives torch and numba: without it
        # torchrun sets 1 and prints a banner saying so on every run.
        env.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc_per_node)))
        with tempfile.TemporaryDirectory(prefix="embengine-torchrun-") as logs:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nproc-per-node={nproc_per_node}",
                "--master-addr=127.0.0.1",
                f"--master-port={free_port()}",
                f"--log-dir={logs}",
                "-m",
                "embengine.cli",
                *argv,
            ]
            status = _run_forwarding_signals(cmd, env, stopped)
        if status == 0 or stopped:  # done, or asked to stop: no restart
            return status
    return status


def _run_forwarding_signals(cmd: list[str], env: dict, stopped: list) -> int:
    """Run torchrun, passing SIGTERM / SIGINT on to it (it stops its ranks, which run in
    sessions of their own, out of reach of a signal to our process group); a signal received
    is appended to ``stopped``. Returns its exit status."""
    proc = subprocess.Popen(cmd, env=env)

    def forward(signum, frame):
        stopped.append(signum)
        proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def ragged_slice(col, lo: int, hi: int):
    """Samples ``[lo, hi)`` of a Ragged, as a Ragged (views of its ids and weights)."""
    from ..inputs import Ragged

    start, stop = int(col.offsets[lo]), int(col.offsets[hi])
    weights = None if col.weights is None else col.weights[start:stop]
    return Ragged(col.ids[start:stop], offsets=col.offsets[lo : hi + 1] - start, weights=weights)


@dataclass
class Ranks:
    """This process's place in the run: ``rank`` of ``world`` (1 and 0 for a single process)."""

    rank: int = 0
    world: int = 1
    _owns_group: bool = False

    @classmethod
    def join(cls, bind_cores: bool = True, log=print) -> Ranks:
        """Join the run torchrun started (gloo), giving each rank its share of the cores
        (``bind_cores``: bound to them, ``embengine.distributed.bind_cores``, where each rank
        can have one; ``log`` says where a rank could not be); a process not started by
        torchrun is the only rank."""
        if not in_launched_rank() or int(os.environ["WORLD_SIZE"]) == 1:
            return cls()
        import numba
        import torch
        import torch.distributed as dist

        from ..distributed.cores import bind_cores as bind

        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        threads = max(1, (cores or 1) // local)
        if bind_cores:
            # Before any thread starts: gloo's, numba's and torch's inherit the binding. From
            # LOCAL_RANK and LOCAL_WORLD_SIZE (torchrun's): a launcher that sets neither
            # leaves the ranks unbound, rather than every one on rank 0's share.
            try:
                threads = len(bind())
            except (ValueError, RuntimeError) as e:
                log(f"rank {os.environ.get('RANK')}: not bound to cores: {e}")
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        torch.set_num_threads(threads)
        owns = not dist.is_initialized()
        if owns:
            dist.init_process_group("gloo")
        return cls(dist.get_rank(), dist.get_world_size(), owns)

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def leave(self) -> None:
        """End the process group this object started."""
        if self._owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()
            self._owns_group = False

    def bounds(self, n: int) -> tuple[int, int]:
        """This rank's slice of a global batch of ``n`` samples."""
        return n * self.rank // self.world, n * (self.rank + 1) // self.world

    def slice(self, batch):
        """This rank's samples of a ClickBatch (the whole batch for a single process)."""
        if not self.distributed:
            return batch
        from ..data.dataset import ClickBatch
        from ..inputs import Ragged

        lo, hi = self.bounds(len(batch))
        sparse = {}
        for name, col in batch.sparse.items():
            if isinstance(col, Ragged):
                sparse[name] = ragged_slice(col, lo, hi)
            else:
                sparse[name] = col[lo:hi]
        return ClickBatch(sparse, batch.dense[lo:hi], batch.labels[lo:hi])

    def wrap_model(self, model):
        """The dense model, under DDP summing (not averaging) its gradients over ranks."""
        if not self.distributed:
            return model
        from torch.nn.parallel import DistributedDataParallel

        # The models' buffers are constants: nothing to sync each step (equal on every rank,
        # so syncing them once at init changes nothing). torch 2.13 deprecates the older
        # broadcast_buffers=False, with a FutureWarning every rank printed.
        ddp = DistributedDataParallel(model, forward_sync_buffers=False)
        ddp.register_comm_hook(None, _sum_hook)
        return ddp

    def total(self, value: float | None) -> float | None:
        """The sum of every rank's ``value`` (None on every rank stays None)."""
        if not self.distributed or value is None:
            return value
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item())

    def gather(self, array: np.ndarray) -> np.ndarray:
        """Every rank's 1-D ``array``, concatenated in rank order."""
        if not self.distributed:
            return array
        import torch.distributed as dist

        parts: list = [None] * self.world
        dist.all_gather_object(parts, np.asarray(array))
        return np.concatenate(parts)


def _sum_hook(state, bucket):
    """DDP communication hook: the bucket's gradients summed over ranks (DDP's default divides
    the sum by the world size)."""
    import torch.distributed as dist

    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])
