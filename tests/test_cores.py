"""Each rank of a machine on its own share of the cores (embengine.distributed.cores), and the
training ranks' use of it (Ranks.join)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

from embengine.distributed.cores import core_share  # noqa: E402
from embengine.training.ranks import free_port  # noqa: E402

HAS_AFFINITY = hasattr(os, "sched_setaffinity")
CORES = sorted(os.sched_getaffinity(0)) if HAS_AFFINITY else []
LIMIT = 120  # seconds a spawned process may take: no test may hang


@pytest.mark.parametrize(
    ("world", "allowed", "want"),
    [
        (1, [0, 1, 2], [[0, 1, 2]]),
        (2, [0, 1], [[0], [1]]),
        (2, [5, 1, 3, 7], [[1, 3], [5, 7]]),  # sorted first: rank 0 the lowest cores
        (3, [0, 1, 2, 3, 4, 5, 6, 7], [[0, 1], [2, 3], [4, 5]]),  # 6 and 7 left unused
        (2, [3, 3, 4], [[3], [4]]),  # a core named twice is one core
    ],
)
def test_each_rank_takes_an_equal_share_and_no_two_share_a_core(world, allowed, want):
    assert [core_share(r, world, allowed) for r in range(world)] == want


@pytest.mark.parametrize(
    ("rank", "world", "allowed", "message"),
    [
        (0, 3, [0, 1], r"3 ranks cannot each have a core of their own: the job may use 2"),
        (2, 2, [0, 1], r"local_rank 2 is out of range \[0, 2\)"),
        (-1, 2, [0, 1], r"local_rank -1 is out of range \[0, 2\)"),
        (0, 0, [0, 1], r"local_world must be an int >= 1, got 0"),
        (True, 2, [0, 1], r"local_rank must be an int, got True"),
        (0, 2.0, [0, 1], r"local_world must be an int >= 1, got 2.0"),
    ],
)
def test_a_share_that_cannot_be_is_refused_naming_the_values(rank, world, allowed, message):
    with pytest.raises(ValueError, match=message):
        core_share(rank, world, allowed)


def _run(code: str, env: dict | None = None) -> dict:
    """``code`` (which prints one JSON line last) in a fresh interpreter; its result."""
    base = {k: v for k, v in os.environ.items() if k != "EMBENGINE_JOB_CORES"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=dict(base, **(env or {})),
        capture_output=True,
        text=True,
        timeout=LIMIT,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores this process may use")
def test_a_bound_process_and_the_threads_it_starts_stay_on_its_share():
    got = _run(
        """
        import json, os, threading
        from embengine.distributed import bind_cores
        cores = bind_cores()  # LOCAL_RANK / LOCAL_WORLD_SIZE from the environment
        seen = []
        t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))
        t.start(); t.join()
        print(json.dumps({"cores": cores, "main": sorted(os.sched_getaffinity(0)),
                          "thread": seen[0]}))
        """,
        {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
    )
    want = core_share(1, 2, CORES)
    assert got == {"cores": want, "main": want, "thread": want}


def test_bind_cores_without_torchruns_variables_says_what_to_pass(monkeypatch):
    from embengine.distributed import bind_cores

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    before = sorted(os.sched_getaffinity(0)) if HAS_AFFINITY else None
    with pytest.raises((ValueError, RuntimeError), match="LOCAL_RANK is not set|Linux"):
        bind_cores()
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises((ValueError, RuntimeError), match="LOCAL_RANK='x' is not an int|Linux"):
        bind_cores()
    if HAS_AFFINITY:
        assert sorted(os.sched_getaffinity(0)) == before  # nothing was bound


JOIN = """
import json, os, numba
from embengine.training.ranks import Ranks
said = []
ranks = Ranks.join(bind_cores={bind}, log=said.append)
import torch.distributed as dist
dist.barrier()
out = {{"rank": ranks.rank, "world": ranks.world, "cores": sorted(os.sched_getaffinity(0)),
        "threads": numba.get_num_threads(), "said": said}}
ranks.leave()
print(json.dumps(out))
"""


def _join(world: int, bind: bool, local: bool = True) -> list[dict]:
    """``world`` real gloo ranks on 127.0.0.1 joining as torchrun's would (``local=False``: as
    a launcher that sets no LOCAL_RANK / LOCAL_WORLD_SIZE); what each saw."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME="lo",
            WORLD_SIZE=str(world),
            RANK=str(rank),
        )
        for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "EMBENGINE_JOB_CORES"):
            env.pop(name, None)
        if local:
            env.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", JOIN.format(bind=bind)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=LIMIT)
            assert p.returncode == 0, err
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores this process may use")
def test_training_ranks_join_bound_each_to_its_share_with_a_thread_per_core():
    outs = _join(2, True)
    for r, out in enumerate(outs):
        share = core_share(r, 2, CORES)
        assert out["cores"] == share and out["threads"] == len(share) and not out["said"]
    outs = _join(2, False)  # --no-bind-cores: every rank may use every core
    assert all(out["cores"] == CORES and not out["said"] for out in outs)


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores this process may use")
def test_ranks_whose_launcher_names_no_local_rank_stay_unbound_and_say_so():
    # Not every rank on rank 0's share: without LOCAL_RANK a rank cannot know its own.
    outs = _join(2, True, local=False)
    for out in outs:
        assert out["cores"] == CORES
        assert out["said"] == [
            f"rank {out['rank']}: not bound to cores: LOCAL_RANK is not set: pass it, or start "
            "the rank with torchrun"
        ]


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores this process may use")
def test_binding_twice_gives_the_same_share_and_the_job_cores_variable_is_obeyed():
    code = """
        import json, os
        from embengine.distributed import bind_cores, job_cores
        first = bind_cores(0, 2)
        second = bind_cores(0, 2)  # a second train() in one rank: not a share of the share
        print(json.dumps({"first": first, "second": second, "job": job_cores(),
                          "now": sorted(os.sched_getaffinity(0))}))
        """
    got = _run(code)
    share = core_share(0, 2, CORES)
    assert got == {"first": share, "second": share, "job": CORES, "now": share}
    # The launcher's list of the job's cores, not the process's own, is what is cut up.
    got = _run(code.replace("(0, 2)", "(0, 1)"), {"EMBENGINE_JOB_CORES": f" {CORES[-1]}"})
    want = [CORES[-1]]
    assert got == {"first": want, "second": want, "job": want, "now": want}


@pytest.mark.parametrize("value", ["", "1,x", "-1", " "])
def test_a_job_cores_variable_that_is_no_list_of_cores_is_refused(monkeypatch, value):
    from embengine.distributed import job_cores

    monkeypatch.setenv("EMBENGINE_JOB_CORES", value)
    with pytest.raises(ValueError, match="EMBENGINE_JOB_CORES=.* is not a comma-separated list"):
        job_cores()


def test_the_launcher_names_the_job_cores_variable_as_cores_reads_it():
    from embengine.distributed import cores
    from embengine.training import ranks

    assert ranks.JOB_CORES == cores.JOB_CORES == "EMBENGINE_JOB_CORES"


@pytest.mark.skipif(not HAS_AFFINITY, reason="binding is Linux's")
def test_ranks_that_cannot_each_have_a_core_join_unbound_and_say_so():
    world = len(CORES) + 1
    if world > 4:
        pytest.skip("a host with many cores: the point is made on small ones")
    outs = _join(world, True)
    for out in outs:
        assert out["cores"] == CORES
        assert out["said"] == [
            f"rank {out['rank']}: not bound to cores: {world} ranks cannot each have a core "
            f"of their own: the job may use {len(CORES)} core(s) ({CORES}); start fewer ranks "
            "or leave them unbound"
        ]


@pytest.mark.parametrize(("flag", "want"), [([], True), (["--no-bind-cores"], False)])
def test_embengine_train_binds_its_ranks_unless_told_not_to(monkeypatch, flag, want):
    from embengine import cli
    from embengine.training import loop

    got = []

    def train(cfg):  # stands in for the run: the option is what is tested
        got.append(cfg.bind_cores)
        raise SystemExit(0)

    monkeypatch.setattr(loop, "train", train)
    with pytest.raises(SystemExit):
        cli.main(["train", "--dataset", "synthetic", *flag])
    assert got == [want]
