"""One client of the store a process: every Comm and meeting posts through it
(embengine.distributed.comm._client), against a real TCPStore served in this process."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from embengine.distributed import comm  # noqa: E402
from embengine.training.ranks import free_port  # noqa: E402


def _serve(port: int):
    return dist.TCPStore(
        "127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False
    )


def _client_of(port: int):
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))


def test_comms_of_one_store_share_one_client_and_post_through_it():
    """A client per Comm was a connection per Comm, each looked up by name by the store's
    host: a lost reverse DNS query held the connection 5 s (every ~12th engine on the test
    host)."""
    server = _serve(free_port())
    store = _client_of(server.port)
    a = comm.Comm(None, 0, 2, store=store)
    b = comm.Comm(None, 1, 2, store=store, kind="meeting")
    assert a._store is b._store is comm._CLIENT[0][1]
    assert a._store is not store  # a clone, with the short timeout
    a.enter("lookup at step 1")
    b.enter("the meeting before x")
    assert server.get(f"{a._prefix}0") == b"1 lookup at step 1"
    assert server.get(f"{b._prefix}1") == b"1 the meeting before x"
    # Another store (a new default group): its own client, the old one dropped.
    other = _serve(free_port())
    c = comm.Comm(None, 0, 2, store=_client_of(other.port))
    assert c._store is not a._store and comm._CLIENT[0][1] is c._store


def test_a_client_that_failed_is_not_handed_to_the_next_comm():
    """After a post failed (the store's host gone), the next Comm connects anew: the old
    client's next answer could be the lost question's."""
    port = free_port()
    server = _serve(port)
    store = _client_of(port)
    first = comm.Comm(None, 0, 2, store=store)
    del server  # the host stops serving
    # The first post after it may still go into the socket's buffer; a later one finds the
    # connection reset (a broken pipe).
    for step in range(1, 101):
        first.enter(f"lookup at step {step}")
        if first._store is None:
            break
        time.sleep(0.02)
    assert f"lookup at step {step}" in first._store_failed and first._store is None
    deadline = time.monotonic() + 10
    while True:  # the port is free again once the old server's socket is closed
        try:
            server = _serve(port)
            break
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    second = comm.Comm(None, 0, 2, store=store)
    second.enter("lookup at step 200")
    assert not second._store_failed
    assert server.get(f"{second._prefix}0") == b"1 lookup at step 200"


def _bound(port: int):
    """A server on ``port`` once it is free (an old server's socket closed), 5 s at most."""
    deadline = time.monotonic() + 5
    while True:
        try:
            return _serve(port)
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_a_destroyed_default_groups_store_is_not_kept_serving():
    """destroy_process_group then init_process_group again, on the same port: rank 0's
    default store hosts the TCPStore server, and the client kept for it must not keep it
    listening. Held, two ranks' second init failed ("Gloo connectFullMesh failed": rank 1's
    rendezvous reached the old server, still listening beside the new one)."""
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=url, rank=0, world_size=1)
    try:
        first = comm.Comm(None, 0, 2, store=comm._default_store())
        first.enter("lookup at step 1")
    finally:
        dist.destroy_process_group()
    server = _bound(port)  # EADDRINUSE while the old server lives
    del server
    time.sleep(0.2)
    dist.init_process_group("gloo", init_method=url, rank=0, world_size=1)
    try:
        second = comm.Comm(None, 0, 2, store=comm._default_store())
        assert second._store is comm._CLIENT[0][1] and second._store is not first._store
    finally:
        dist.destroy_process_group()


_SERVER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 1, is_master=True,
                      timeout=timedelta(seconds=30), wait_for_workers=False)
print("serving", flush=True)
time.sleep(120)
"""


def _state(pid: int) -> str:
    """A process's state letter from /proc (``T``: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


def test_a_question_left_unanswered_by_a_stopped_store_host_blocks_no_later_post():
    """The store's host stopped (SIGSTOP; rank 0 under init_process_group): a Comm's question
    after a timeout (``behind``) waits in the process's one client, holding it, as long as the
    host is stopped. Another Comm's post then waited behind it (more than 10 s, until the host
    resumed; with a client per Comm it returned at once): now the client is abandoned, and the
    post says why instead of waiting."""
    import select
    import signal
    import subprocess
    import sys
    import threading

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER, str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        # A hard limit: a host that never says it serves fails the test, never hangs it.
        assert select.select([server.stdout], [], [], 60)[0], "the store's host did not start"
        assert server.stdout.readline().strip() == "serving"
        store = _client_of(port)
        a = comm.Comm(None, 0, 2, store=store)
        b = comm.Comm(None, 0, 2, store=store, kind="meeting")
        a.enter("lookup at step 1")
        server.send_signal(signal.SIGSTOP)
        # The signal takes effect asynchronously: a host still serving for a moment answered
        # the question below (a fresh clone's suite under load). Wait until it is stopped.
        deadline = time.monotonic() + 30
        while _state(server.pid) != "T":
            assert time.monotonic() < deadline, "the store's host did not stop"
            time.sleep(0.01)
        t0 = time.monotonic()
        said = a.behind()
        assert time.monotonic() - t0 < comm.STORE_ANSWER + 3
        assert "did not answer" in said, said
        posting = threading.Thread(target=b.enter, args=("lookup at step 2",), daemon=True)
        posting.start()
        posting.join(5)
        assert not posting.is_alive(), "a post waited for the unanswered question"
        assert "unanswered" in b._store_failed and b._store is None
        assert not comm._CLIENT  # the next Comm connects anew
    finally:
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait()
