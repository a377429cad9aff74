"""The collectives a ShardedEngine uses, on NumPy arrays, counting the bytes each rank sends.

Only what gloo runs natively: ``all_to_all_single`` with uneven splits, ``all_gather`` and
``all_reduce``, always in the engine's own process group (so its collectives never interleave
with DDP's). Arrays cross as zero-copy torch views. Bytes sent count what leaves this rank for
other ranks (an all-to-all's block for itself stays home; an all-gather sends its block to the
W - 1 others, as a ring or a tree would in total).
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections import Counter
from collections.abc import Callable
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["Comm", "Pacer", "PeerError", "group_timeout", "meet_in_the_default_group"]


class PeerError(RuntimeError):
    """A collective failed: a peer died (its connection reset) or did not answer within the
    process group's timeout. gloo's error names neither; on a timeout the message names the
    ranks that had not reached this rank's call (see ``Comm.enter``)."""


def meet_in_the_default_group(purpose: str, connect_within: float = 60.0) -> None:
    """Every rank of the default process group meets in a one-integer ``all_reduce`` on it,
    before ``purpose``: its gloo connections are open since ``init_process_group``, so a rank
    that died is a PeerError at once. ``new_group``, which meets the ranks through the store
    instead, waited for a dead one until the store's timeout (60 s and more). A rank that is
    only late is waited for, as ``new_group`` would, until the default group's timeout; then
    the PeerError names the ranks that had not come (each rank posts its arrival in the
    default group's store, as ``Comm.enter`` posts a call, and the ranks that timed out ask
    it with a 2 s limit: ``Comm.behind``). Nothing on a default group of another backend.

    Then each rank waits for its post, at most ``connect_within`` seconds, and the ranks meet
    again: a rank's first post connects its client of the store (``_client``), and the
    store's host serves nothing else while it looks the new connection's peer up by name, 5 s
    where the resolver loses the query; a ``new_group`` with a shorter timeout made meanwhile
    failed ("wait timeout after 3000ms")."""
    if dist.get_backend() != "gloo":
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    # Numbered here, in the order of the meetings (as every rank meets); posted meanwhile by a
    # thread: its client of the store connects first, which waits for a dead store's host
    # until the store's timeout, where the meeting itself finds a dead peer at once.
    meeting = Comm(None, rank, world, kind="meeting", connect=False)
    call = f"the meeting before {purpose}"

    def arrive() -> None:
        try:
            meeting.connect()
        except RuntimeError as e:  # the question after a timeout says so
            meeting._store_failed = f"{call}: {e}"
            return
        meeting.enter(call)

    posting = threading.Thread(target=arrive, daemon=True)
    if world > 1:
        posting.start()
    _meet(rank, purpose, posting, meeting)
    if world > 1:
        posting.join(connect_within)
        _meet(rank, purpose, posting, meeting)


def _meet(rank: int, purpose: str, posting: threading.Thread, meeting: Comm) -> None:
    """One meeting of ``meet_in_the_default_group``: a PeerError if a rank failed it."""
    try:
        dist.all_reduce(torch.zeros(1, dtype=torch.int32))
    except RuntimeError as e:
        said = str(e).strip()
        if "timed out" in said.lower():
            posting.join(STORE_ANSWER)
            late = _silent_store() if posting.is_alive() else meeting.behind()
            why = f"no answer within the group's timeout: {late}"
        else:
            why = "it died (connection reset) or did not answer within the group's timeout"
        raise PeerError(
            f"rank {rank}: the ranks of the default process group met before {purpose} and one "
            f"of them failed: {why}; gloo says: {said}"
        ) from e


# Seconds a rank waits for the store when it asks which peers are behind (after a timeout).
STORE_ANSWER = 2.0
# Seconds of one rank's long work (hashing a checkpoint) between two meetings with the ranks
# that wait for it (``Pacer``), at most: a quarter of the group's timeout when that is shorter.
MEET_EVERY = 1.0
# Said of a peer behind that has posted no call of this Comm (``Comm.behind``): "its last call:
# none" read as a call named "none".
_NO_CALL = "it has made no call of this engine yet"
# The client of a store this process posts and asks through (``_client``): one for every Comm
# and meeting on that store, made on first use. A new client is a new connection, and the
# store's host (TCPStore) looks each connection's peer up by name (a reverse DNS query); where
# the resolver loses a query, the connection waits out its 5 s retry. With a client per Comm,
# that was about one ShardedEngine in twelve on the test host (docs/design.md, "One store
# client a process").
# The store itself is held weakly: on rank 0 the default group's store hosts the TCPStore
# server, which must go with destroy_process_group (held, it kept listening on its port beside
# the next init_process_group's, and the other ranks' rendezvous reached the old one).
_CLIENT_LOCK = threading.Lock()  # held only to read or change _CLIENT and _STUCK, never to wait
_CLIENT: list = []  # [(a weak reference to the store, its client)] for the last store, or empty
# Clients a question went unanswered on (``Comm.behind``: a stopped store host). The thread that
# asked may still wait in it, holding it (TCPStore's client takes one request at a time), so no
# Comm posts through it again: a post would wait for that thread as long as the host is stopped.
_STUCK: list = []
# Each Comm's keys in the store: per group (its global ranks) and kind, a count of the Comms
# made on it; the members of a group make their engines on it in the same order (as every
# collective), and meet before each in the default group alike.
_COMMS: dict[str, itertools.count] = {}
# The dtypes a collective sends as they are; any other (a 16-bit table's bfloat16 values)
# travels as its bytes.
_WIRE_DTYPES = frozenset(
    np.dtype(t) for t in (np.float64, np.float32, np.float16, np.int64, np.int32, np.int16, np.int8)
) | {np.dtype(np.uint8), np.dtype(np.bool_)}


def _client(store):
    """This process's client of ``store`` with a short timeout (``STORE_ANSWER``): a hung rank
    0, the store's host under torchrun, must not hold a post or a question for the store's 30
    minutes. Made once for the store (``store.clone()`` connects, waiting for a store whose
    host is gone until the store's timeout); a client of an earlier store is dropped. The
    store is not kept alive by it (a weak reference: see ``_CLIENT``)."""
    with _CLIENT_LOCK:
        if _CLIENT and _CLIENT[0][0]() is store:
            return _CLIENT[0][1]
    # Outside the lock: a post of another thread must not wait for this connection.
    client = store.clone()
    client.set_timeout(timedelta(seconds=STORE_ANSWER))
    with _CLIENT_LOCK:
        if _CLIENT and _CLIENT[0][0]() is store:  # another thread connected meanwhile
            return _CLIENT[0][1]
        _CLIENT[:] = [(weakref.ref(store), client)]
        return client


def _forget_client(client) -> None:
    """Make the next ``_client`` connect anew: ``client`` failed (a timed-out answer may
    still be on its way, and would be read as the next question's)."""
    with _CLIENT_LOCK:
        if _CLIENT and _CLIENT[0][1] is client:
            _CLIENT.clear()


def _abandon_client(client) -> None:
    """``client`` left a question unanswered: no Comm posts or asks through it again
    (``_STUCK``), and the next ``_client`` connects anew."""
    _forget_client(client)
    with _CLIENT_LOCK:
        if not any(c is client for c in _STUCK):
            _STUCK.append(client)


def _is_stuck(client) -> bool:
    with _CLIENT_LOCK:
        return any(c is client for c in _STUCK)


def _global_ranks(group, world_size: int) -> list[int]:
    """The default group's ranks of ``group``'s members (0..W-1 without a group)."""
    if group is None:
        return list(range(world_size))
    import torch.distributed as dist

    return list(dist.get_process_group_ranks(group))


def group_timeout(group) -> float | None:
    """Seconds a collective of ``group`` waits for a peer (its gloo backend's timeout, which
    ``torch.distributed``'s ``_set_pg_timeout`` changes too), or None where torch does not
    say (another backend, another torch)."""
    try:
        seconds = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None
    return float(seconds) if seconds > 0 else None


def _silent_store() -> str:
    """What a rank says when the store did not answer which peer is behind (its host)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        host = "torchrun's agent serves it: is the agent alive?"
    else:
        host = "rank 0 of the default group serves it: it may be the one that hangs"
    return f"the store did not answer which rank it is ({host})"


def _default_store():
    """The store of torch.distributed's default group (torchrun's or init_process_group's), or
    None when torch keeps it elsewhere (then a timeout cannot name the hung rank)."""
    from torch.distributed import distributed_c10d

    get = getattr(distributed_c10d, "_get_default_store", None)
    try:
        return get() if get is not None else None
    except (RuntimeError, ValueError):
        return None


class Comm:
    """Collectives in ``group`` (rank ``rank`` of ``world_size``), counting bytes sent per
    purpose in ``sent`` (a Counter: purpose -> bytes, reset by ``reset``).

    ``store`` (default: the default group's store): where each rank posts the call it enters
    (``enter``), one key per rank, so that after a timeout the ranks that answered can name the
    ones that never reached the call. Posting is one small store write per call. ``kind``
    names the Comm's keys apart from other kinds' on the same group (``"meeting"``:
    ``meet_in_the_default_group``'s)."""

    def __init__(
        self,
        group,
        rank: int,
        world_size: int,
        store=None,
        kind: str = "comm",
        connect: bool = True,
        meet_every: float = MEET_EVERY,
    ):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.meet_every = meet_every
        self.sent: Counter[str] = Counter()
        self._store = None
        self._store_failed = ""
        # The store to connect to (``connect``), None once connected or without one.
        self._unconnected = store if store is not None or world_size == 1 else _default_store()
        members = "-".join(map(str, _global_ranks(group, world_size)))
        number = next(_COMMS.setdefault(f"{members}/{kind}", itertools.count()))
        self._prefix = f"embengine/group{members}/{kind}{number}/rank"
        self._calls = 0
        self._call = ""
        # The error this rank raises alike with every other rank, from what the call's
        # collectives told them all (``alike``): the ranks are still in step after it.
        self.raised_alike: BaseException | None = None
        if connect:
            self.connect()

    def alike(self, error: BaseException) -> BaseException:
        """``error``, kept as ``raised_alike``: ``raise comm.alike(e)`` where every rank raises
        at the same point of a call from what its collectives told them all (a keyed table's
        ``max_rows`` refusal from the same sums; a save whose failure every rank learned), so
        that no collective of the call is left for any rank. ``ShardedEngine`` leaves its
        engine out of step after any other error past a call's header."""
        self.raised_alike = error
        return error

    def connect(self) -> None:
        """Take this process's client of the store (``_client``; ``__init__`` does, unless
        told not to: the first client of a store connects, which waits for a store whose host
        is gone until the store's timeout)."""
        store, self._unconnected = self._unconnected, None
        if store is not None:
            self._store = _client(store)

    def enter(self, call: str) -> None:
        """Post that this rank enters its next call (``call`` says which, e.g. "lookup at step
        4"): the n-th call of every rank must be the same one."""
        self._calls += 1
        self._call = call
        if self._store is not None and _is_stuck(self._store):
            self._store = None
            self._store_failed = f"{call}: the store left a question of this process unanswered"
        if self._store is not None:
            try:
                self._store.set(f"{self._prefix}{self.rank}", f"{self._calls} {call}")
            except RuntimeError as e:  # the collective that follows fails and says so
                _forget_client(self._store)
                self._store, self._store_failed = None, f"{call}: {e}"

    def behind(self) -> str:
        """Which peers had not entered this rank's current call, from the store (asked with a
        short timeout: if it does not answer, that is said instead)."""
        if self._store_failed:
            return (
                f"the store could not be told which call this rank entered ({self._store_failed})"
            )
        if self._store is None:
            return "torch.distributed keeps no store to ask which rank it is"
        if _is_stuck(self._store):
            return _silent_store()
        answers: dict[int, str | None] = {}
        store = self._store

        def ask() -> None:
            try:
                for r in range(self.world_size):
                    key = f"{self._prefix}{r}"
                    if r != self.rank:
                        answers[r] = store.get(key).decode() if store.check([key]) else None
            except RuntimeError:  # unanswered: said below
                _forget_client(store)

        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        asking.join(STORE_ANSWER + 1.0)
        if asking.is_alive():
            _abandon_client(store)
        if asking.is_alive() or len(answers) < self.world_size - 1:
            return _silent_store()
        late = []
        for r, posted in sorted(answers.items()):
            calls, _, call = (posted or "0 ").partition(" ")
            if int(calls) < self._calls:
                said = f"its last call: {call}" if int(calls) else _NO_CALL
                late.append(f"rank {r} ({said})")
        if not late:
            return (
                "every rank had entered it, so one is stuck or failed inside it (see the other "
                "ranks' errors)"
            )
        return f"{' and '.join(late)} had not entered it"

    def _run(self, collective: Callable[[], object], purpose: str) -> None:
        """Run ``collective``; a failure is a PeerError naming this rank, the purpose and the
        peers (gloo's own error chained: it names an address, not a rank); after a timeout,
        the peers that had not reached this call."""
        try:
            collective()
        except RuntimeError as e:
            peers = [r for r in range(self.world_size) if r != self.rank]
            said = str(e).strip()
            if "timed out" in said.lower():
                why = (
                    f"no answer within the process group's timeout in "
                    f"{self._call or 'a call'}: {self.behind()}"
                )
            else:
                why = (
                    "one of them died (connection reset) or did not answer within the "
                    "process group's timeout"
                )
            raise PeerError(
                f"rank {self.rank}: a collective ({purpose}) with ranks {peers} failed: {why}; "
                f"gloo says: {said}"
            ) from e

    def reset(self) -> Counter[str]:
        """The bytes counted since the last reset, and a fresh count."""
        sent, self.sent = self.sent, Counter()
        return sent

    def all_to_all(
        self, send: np.ndarray, send_counts: np.ndarray, recv_counts: np.ndarray, purpose: str
    ) -> np.ndarray:
        """1-D ``send``, its blocks of ``send_counts[d]`` elements for rank d in rank order ->
        the blocks every rank sent this one, ``recv_counts[s]`` from rank s, in rank order."""
        return self.all_to_all_start(send, send_counts, recv_counts, purpose)()

    def all_to_all_start(
        self, send: np.ndarray, send_counts: np.ndarray, recv_counts: np.ndarray, purpose: str
    ) -> Callable[[], np.ndarray]:
        """``all_to_all`` started: returns the function that waits for it and gives what it
        received, so that this rank can work while the blocks travel (``send`` must stay
        unchanged until then; a failure is raised by the wait)."""
        send = np.ascontiguousarray(send)
        send_counts = [int(c) for c in send_counts]
        recv_counts = [int(c) for c in recv_counts]
        if send.dtype not in _WIRE_DTYPES:  # as bytes (ml_dtypes.bfloat16: torch has none)
            size, dtype = send.dtype.itemsize, send.dtype
            wait = self.all_to_all_start(
                send.view(np.uint8),
                [c * size for c in send_counts],
                [c * size for c in recv_counts],
                purpose,
            )
            return lambda: wait().view(dtype)
        out = np.empty(sum(recv_counts), dtype=send.dtype)
        if self.world_size == 1:
            out[:] = send
            return lambda: out
        self.sent[purpose] += (sum(send_counts) - send_counts[self.rank]) * send.itemsize
        # The buffers stay referenced until the wait: gloo writes and reads them meanwhile.
        pending = [torch.from_numpy(out), torch.from_numpy(send)]
        self._run(
            lambda: pending.append(
                dist.all_to_all_single(
                    *pending[:2], recv_counts, send_counts, group=self.group, async_op=True
                )
            ),
            purpose,
        )

        def wait() -> np.ndarray:
            self._run(pending[2].wait, purpose)
            pending.clear()
            return out

        return wait

    def all_gather(self, block: np.ndarray, purpose: str) -> np.ndarray:
        """Every rank's ``block`` (same shape and dtype on every rank), stacked in rank order."""
        block = np.ascontiguousarray(block)
        if self.world_size == 1:
            return block[None].copy()
        if block.dtype not in _WIRE_DTYPES:  # as bytes (ml_dtypes.bfloat16: torch has none)
            raw = self.all_gather(block.reshape(-1).view(np.uint8), purpose)
            return raw.view(block.dtype).reshape(self.world_size, *block.shape)
        self.sent[purpose] += block.nbytes * (self.world_size - 1)
        out = np.empty((self.world_size, *block.shape), dtype=block.dtype)
        self._run(
            lambda: dist.all_gather(
                [torch.from_numpy(o) for o in out], torch.from_numpy(block), group=self.group
            ),
            purpose,
        )
        return out

    def pacer(self, work: str) -> Pacer:
        """A Pacer (a context manager) for ``work`` (e.g. "hashing the checkpoint's files")
        that some ranks do while the others wait: see ``Pacer``."""
        return Pacer(self, work)

    def all_gather_ragged(self, block: np.ndarray, purpose: str) -> list[np.ndarray]:
        """Every rank's 1-D ``block`` (lengths may differ), in rank order: the lengths first,
        then the blocks padded to the longest (gloo's all_gather wants equal sizes)."""
        block = np.ascontiguousarray(block).reshape(-1)
        lengths = self.all_gather(np.array([len(block)], dtype=np.int64), purpose)[:, 0]
        longest = int(lengths.max()) if len(lengths) else 0
        padded = np.zeros(longest, dtype=block.dtype)
        padded[: len(block)] = block
        stacked = self.all_gather(padded, purpose)
        return [stacked[r, : int(n)] for r, n in enumerate(lengths)]


class Pacer:
    """Long work on some ranks (rank 0 writing an extra tensor or hashing the checkpoint it
    commits, every rank hashing one it restores), the others waiting, without a collective
    that outlasts the group's timeout. A collective right after such work made the ranks
    that finished first wait in it for the others, and past the timeout they raised,
    naming no one (a 512 MB checkpoint at a 2 s timeout; at the default 60 s, one of about
    9 GB on a host hashing 154 MB/s).

    ``with comm.pacer(work):`` on every rank, around its share of the work (none for a rank
    that only waits): while the body runs, a thread meets the other ranks in an
    ``all_gather`` of one integer every ``comm.meet_every`` seconds, saying 1 (still
    working); when it ends, this rank meets them saying 0 until every rank says 0 (when it
    raises, this rank raises at once, meeting no one: the others' meetings fail). Every
    rank thus makes the same meetings and reads the same answers, and no rank waits in one
    longer than a meeting interval. The body may not use the group itself. A rank that hangs
    or dies stops meeting: the others raise as in any collective, naming the ranks that were
    still working at the last meeting, and (each meeting is posted in the store as a call:
    ``enter``) the ranks that had not come to it. The work needs no hook (a hash, a write,
    an fsync, a kernel: anything that lets the thread take the GIL now and then)."""

    def __init__(self, comm: Comm, work: str):
        self._comm = comm
        self._work = work
        self._working: list[int] = []  # the ranks working at the last meeting
        self._meetings = 0  # so far
        self._stop = threading.Event()
        self._failed: BaseException | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Pacer:
        if self._comm.world_size > 1:
            self._thread = threading.Thread(target=self._meet_while_working, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, kind, error, trace) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()  # its meeting in progress ends: the others meet until all say 0
        if error is not None:
            # The body failed (a KeyboardInterrupt too): this rank leaves here, raising its
            # error at once; the others' next meeting fails without it, naming it (Comm.behind),
            # as their next collective would. Meeting them until every rank was done held it
            # for their work (minutes of hashing), and it did not go on with them after.
            return
        if self._failed is not None:
            raise self._failed
        while self._meet(0):
            pass

    def _meet_while_working(self) -> None:
        try:
            while not self._stop.wait(self._comm.meet_every):
                self._meet(1)
        except BaseException as e:  # raised by __exit__ in the body's thread
            self._failed = e

    def _meet(self, working: int) -> bool:
        """One meeting; whether any rank was still working."""
        # Each meeting posted as a call (Comm.enter; every rank makes the same meetings): after
        # a timeout the ranks name one that never came to it (stopped, or gone). A post of
        # "done" alone named the ranks still working instead, stuck or not, and no rank that
        # was done and then stopped or left.
        self._meetings += 1
        self._comm.enter(f"{self._work}, meeting {self._meetings}")
        try:
            flags = self._comm.all_gather(np.array([working], dtype=np.int64), self._work)[:, 0]
        except PeerError as e:
            if not self._working:
                raise
            ranks = " and ".join(f"rank {r}" for r in self._working)
            was = "was" if len(self._working) == 1 else "were"
            raise PeerError(f"{e} (at the last meeting, {ranks} {was} still {self._work})") from e
        self._working = [r for r, f in enumerate(flags.tolist()) if f]
        return bool(self._working)
