"""ShardedEngine: tables sharded over the ranks of a torch.distributed group, trained exactly as
one EmbeddingEngine trains on the concatenation of every rank's batch, in rank order.

Each rank passes its own samples. One training step::

    acts = engine.lookup(features)        # this rank's samples; rows pulled from their owners
    engine.apply_gradients(grads)         # contributions pushed to the owners, one update per row

Lookup ("pull rows"): each rank deduplicates its ids per table, sends each owner the unique ids
it owns (``all_to_all_single``), gets their rows back (another), and pools its bags locally with
the backend's ``lookup_rows``. A bag is pooled by one rank from the same rows in the same order
as the single engine pools it, so activations are bit-identical to the single engine's.

Update ("push occurrences"): for every occurrence of an id, its rank sends the owner the id, its
gain and the activation-gradient row it multiplies (each gradient row once per owner, the
occurrences pointing at it). The owner concatenates what it received in the single engine's
occurrence order (a table's features in order, then ranks in order, then each rank's samples and
positions), builds the TableBatch the single engine would have built for its rows, and runs the
ordinary fused update on its shard: one update per touched row per global step, its gradient
summed in the single-process order, so tables and slots are bit-identical too.

Every call begins with a header all-to-all (a fixed-size int64 row per rank: which call, the
step, whether the rank's input was valid, its counts, its learning rates), so a rank whose input
fails validation makes every rank raise instead of leaving them waiting, and a step counter or a
learning rate that differs between ranks is an error, not a silent divergence. Every rank issues
the same collectives each step, empty local batches included.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch.distributed as dist

from ..backends.registry import make_backend
from ..batch import PreparedBatch, TableBatch, batch_fingerprint, check_prepared_for, csr, dedup
from ..batch import prepare as prepare_batch
from ..config import FeatureConfig, TableConfig
from ..engine import NonFiniteUpdateError, engine_arguments
from ..inputs import as_numpy
from ..learning_rates import LearningRates
from ..optimizers import Optimizer
from ..spec import compressor_entry, initializer_to_json, optimizer_to_json
from ..state import WEIGHTS
from ..storage import plan_storage
from .comm import Comm
from .sharding import ShardPlan, ShardTable, plan_shards

__all__ = ["ShardedEngine", "DistributedError", "DEFAULT_TIMEOUT"]

# Seconds a collective waits for a peer before the process group gives up: short, so that a hung
# rank is an error soon (torch's default is 30 minutes).
DEFAULT_TIMEOUT = 60.0

# The header's call codes.
_LOOKUP, _APPLY, _CONTENTS, _SAVE, _RESTORE = 1, 2, 3, 4, 5
_CALLS = {_LOOKUP: "lookup", _APPLY: "apply_gradients", _CONTENTS: "table_contents",
          _SAVE: "save", _RESTORE: "restore"}  # fmt: skip
# Header columns: call, step, valid, reserved, then 2 * features counts, then one learning rate
# per table (float64 bits).
_FIXED = 4


class DistributedError(RuntimeError):
    """Ranks disagree (another call, step or learning rate), or another rank's input was
    invalid: raised on every rank, naming the ranks; nothing was updated."""


def _initializer_for(table, opt: Optimizer):
    """The table's initializer, else the optimizer's, else TF's (as EmbeddingEngine does)."""
    if table.initializer is None and opt.default_initializer is not None:
        return opt.default_initializer
    return table.effective_initializer


class ShardedEngine:
    """Embedding tables sharded over a process group; the ``EmbeddingEngine`` step API.

    Args:
      feature_config, optimizer, seed: as ``EmbeddingEngine``; equal on every rank (checked).
      sharding: "row" (id r on rank r mod W), "table" (each table whole on one rank, largest
        first to the least loaded rank), or a dict table name -> either (others "row").
        ``plan`` says where each table went.
      group: the process group to shard over; None makes a new gloo group of every rank of the
        default group (``torch.distributed.init_process_group`` must have run), so the engine's
        collectives never interleave with DDP's.
      timeout: seconds a collective of the new group waits for a peer before raising (unused
        when ``group`` is given). A dead peer is detected at once (its connection resets).
      backend, nonfinite_gradients: as ``EmbeddingEngine``.

    Every rank must make the same calls in the same order (lookup, apply_gradients,
    table_contents), each with its own samples (an empty batch is fine). ``bytes_sent`` is what
    this rank sent in its last call of each kind; ``bytes_sent_total`` since construction.
    One thread per rank drives the engine (calls hold ``lock``).
    """

    def __init__(
        self,
        feature_config: Mapping[str, FeatureConfig] | Sequence[FeatureConfig] | FeatureConfig,
        optimizer: Optimizer | None = None,
        seed: int = 0,
        sharding: str | Mapping[str, str] = "row",
        group=None,
        timeout: float = DEFAULT_TIMEOUT,
        backend: str = "numba",
        nonfinite_gradients: str = "error",
    ):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ShardedEngine needs torch.distributed: call torch.distributed."
                "init_process_group('gloo', ...) on every rank first (torchrun sets the rank, "
                "world size and address)"
            )
        r, optimizers = engine_arguments(
            feature_config, optimizer, seed, nonfinite_gradients, "ShardedEngine"
        )
        keyed = [n for n, t in zip(r.table_names, r.tables, strict=True) if t.keyed]
        if keyed:
            raise ValueError(
                f"tables {keyed} are keyed (vocabulary_size=None): ShardedEngine shards tables "
                "with a vocabulary only; use an EmbeddingEngine"
            )
        self._resolved, self._optimizers = r, optimizers
        self._learning_rates = LearningRates(optimizers, r.table_names)
        self.seed = int(seed)
        self.nonfinite_gradients = nonfinite_gradients
        self._backend = make_backend(backend)
        for name, table, opt in zip(r.table_names, r.tables, optimizers, strict=True):
            self._backend.check_optimizer(name, opt, table.dim)
        if group is None:
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=float(timeout)))
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._comm = Comm(group, self.rank, self.world_size)
        slot_specs = [opt.slot_specs(t.dim) for opt, t in zip(optimizers, r.tables, strict=True)]
        row_bytes = [4 * (t.dim + sum(s.width for s in specs))
                     for t, specs in zip(r.tables, slot_specs, strict=True)]  # fmt: skip
        self._plan = plan_shards(sharding, r.table_names,
                                 [t.vocabulary_size * b for t, b in zip(r.tables, row_bytes,
                                                                        strict=True)],
                                 self.world_size)  # fmt: skip
        self._check_same_configuration()
        self._shards = tuple(
            ShardTable(name, t.vocabulary_size, t.dim, specs, _initializer_for(t, opt), self.seed,
                       self._plan.owned_ids(i, t.vocabulary_size, self.rank), self.world_size,
                       self.rank, self._plan.kinds[i])
            for i, (name, t, opt, specs) in enumerate(zip(r.table_names, r.tables, optimizers,
                                                          slot_specs, strict=True))
        )  # fmt: skip
        # Batches are prepared as for a single engine with one storage table per table.
        self._layout = [[(f, 0) for f in names] for names in r.table_features]
        self._fingerprint = batch_fingerprint(r, self._layout)
        self._features = tuple(r.features)
        self._step = 0
        self._pending: PreparedBatch | None = None
        self.lock = threading.RLock()
        self.bytes_sent: dict[str, Counter[str]] = {}
        self.bytes_sent_total: Counter[str] = Counter()
        self.nonfinite_rows_skipped = {name: 0 for name in r.table_names}

    # -- configuration ---------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Number of apply_gradients calls so far (equal on every rank)."""
        return self._step

    @property
    def table_names(self) -> tuple[str, ...]:
        return self._resolved.table_names

    @property
    def feature_config(self) -> dict[str, FeatureConfig]:
        return dict(self._resolved.features)

    @property
    def shard_plan(self) -> ShardPlan:
        return self._plan

    @property
    def plan(self) -> dict[str, str]:
        """Table name -> how it is sharded: "row", or "table on rank k"."""
        return self._plan.describe(self.table_names)

    def optimizer(self, table_name: str) -> Optimizer:
        return self._optimizers[self.table_names.index(table_name)]

    @property
    def table_configs(self) -> dict[str, TableConfig]:
        return dict(zip(self._resolved.table_names, self._resolved.tables, strict=True))

    @property
    def backend(self) -> str:
        return self._backend.name

    @property
    def num_learning_rate_tags(self) -> int:
        return self._learning_rates.num_tags

    def learning_rate_tag(self, table_name: str) -> int | None:
        """The dynamic learning-rate tag of a table, or None for a constant rate."""
        return self._learning_rates.tag_of(self.table_names.index(table_name))

    def table_stats(self) -> dict[str, Any]:
        """What this rank holds and sends (local, no communication): per table its sharding,
        the rows and bytes (weights and slots) on this rank; the bytes this rank sent in its
        last call of each kind (``{call: {purpose: bytes}}``) and since construction. The
        cost model behind the bytes is in docs/design.md."""
        plan = self.plan
        return {
            "tables": {
                name: {"sharding": plan[name], "rows": int(shard.data.shape[0]),
                       "bytes": int(shard.nbytes)}
                for name, shard in zip(self.table_names, self._shards, strict=True)
            },
            "bytes_sent": {call: dict(c) for call, c in self.bytes_sent.items()},
            "bytes_sent_total": dict(self.bytes_sent_total),
        }  # fmt: skip

    def shard(self, table_name: str) -> ShardTable:
        """This rank's share of a table (its ``global_ids``; rows ``[weights | slots]``)."""
        return self._shards[self.table_names.index(table_name)]

    def _check_same_configuration(self) -> None:
        """Every rank must have built the same engine: a digest of the configuration, gathered
        (different tables would pair the wrong rows; different optimizers diverge silently)."""
        r = self._resolved
        config = {
            "tables": [[name, t.vocabulary_size, t.dim, t.combiner,
                        initializer_to_json(_initializer_for(t, opt)),
                        optimizer_to_json(opt, self._learning_rates.tag_of(i))]
                       for i, (name, t, opt) in enumerate(zip(r.table_names, r.tables,
                                                              self._optimizers, strict=True))],
            "features": [[f, r.table_names[r.feature_table[f]], fc.max_sequence_length]
                         for f, fc in r.features.items()],
            "seed": self.seed,
            "plan": [list(self._plan.kinds), list(self._plan.owners)],
            "nonfinite_gradients": self.nonfinite_gradients,
        }  # fmt: skip
        text = json.dumps(config, sort_keys=True, default=str).encode()
        digest = np.frombuffer(hashlib.sha256(text).digest()[:8], dtype=np.int64).copy()
        self._comm.enter("ShardedEngine()")
        everyone = self._comm.all_gather(digest, "setup")[:, 0]
        other = [rank for rank, d in enumerate(everyone) if d != everyone[0]]
        if other:
            raise DistributedError(
                f"rank {self.rank}: ranks {other} built a ShardedEngine with another "
                "configuration (tables, features, optimizers, seed or sharding) than rank 0; "
                "every rank must pass the same arguments"
            )

    # -- the header: every call starts with it ---------------------------------------------------

    def _header(self, call: int, error: Exception | None, counts: np.ndarray | None = None,
                lrs: Sequence[float] | None = None) -> np.ndarray:  # fmt: skip
        """Exchange this call's header with every rank; raise ``error`` (this rank's own
        validation error) afterwards, or a DistributedError if ranks disagree. Returns the
        headers received, int64 ``[W, columns]`` (row s: what rank s sent this rank)."""
        w, nf, nt = self.world_size, len(self._features), len(self.table_names)
        header = np.zeros((w, _FIXED + 2 * nf + nt), dtype=np.int64)
        header[:, 0] = call
        header[:, 1] = self._step
        header[:, 2] = error is None
        if error is None and counts is not None:
            header[:, _FIXED : _FIXED + counts.shape[1]] = counts
        if error is None and lrs is not None:
            header[:, _FIXED + 2 * nf :] = np.asarray(lrs, dtype=np.float64).view(np.int64)
        width = header.shape[1]
        self._comm.enter(f"{_CALLS[call]} at step {self._step}")
        got = self._comm.all_to_all(header.reshape(-1), [width] * w, [width] * w, "header")
        got = got.reshape(w, width)
        if error is not None:
            raise error
        name = _CALLS[call]
        calls = got[:, 0]
        if (calls != call).any():
            theirs = ", ".join(f"rank {s}: {_CALLS.get(int(c), c)}" for s, c in enumerate(calls))
            raise DistributedError(
                f"rank {self.rank} called {name} while the ranks called: {theirs}; every rank "
                "must make the same calls in the same order"
            )
        bad = [s for s in range(w) if not got[s, 2]]
        if bad:
            raise DistributedError(
                f"rank {self.rank}: {name} at step {self._step} failed on ranks {bad} (their "
                "input was invalid: see their error); nothing was changed on any rank"
            )
        steps = got[:, 1]
        if (steps != self._step).any():
            raise DistributedError(
                f"rank {self.rank}: {name}: the ranks are at steps {steps.tolist()}; they must "
                "be at the same step (did one rank restore another checkpoint?)"
            )
        if lrs is not None:
            theirs = got[:, _FIXED + 2 * nf :].view(np.float64)
            for t in range(nt):
                if (theirs[:, t] != theirs[self.rank, t]).any():
                    raise DistributedError(
                        f"rank {self.rank}: step {self._step}: table {self.table_names[t]!r} "
                        f"has learning rates {theirs[:, t].tolist()} on ranks 0..{w - 1}; every "
                        "rank must use the same learning rates (callables of the step, or the "
                        "same learning_rates=[...]); nothing was updated"
                    )
        return got

    # -- a step ----------------------------------------------------------------------------------

    def preprocess(self, features: Mapping, weights: Mapping | None = None, *,
                   training: bool = True) -> PreparedBatch:  # fmt: skip
        """This rank's features validated and deduplicated per table, as ``EmbeddingEngine.
        preprocess`` does (pure, no communication; a DataLoader worker may call it). Always
        deduplicated, ``training`` or not: a lookup pulls each unique id's row once."""
        return prepare_batch(self._resolved, features, weights, self._backend.build_tables,
                             self._layout, fingerprint=self._fingerprint)  # fmt: skip

    def lookup(
        self,
        features: Mapping | PreparedBatch,
        weights: Mapping | None = None,
        *,
        training: bool = True,
    ) -> dict[str, np.ndarray]:
        """This rank's activations per feature, float32 ``[*shape, dim]``: bit-identical to the
        single engine's for these samples. Collective: every rank calls it (with its own
        samples). ``training=True`` keeps the batch for ``apply_gradients``."""
        return self.lookup_with_batch(features, weights, training=training)[0]

    def lookup_with_batch(
        self,
        features: Mapping | PreparedBatch,
        weights: Mapping | None = None,
        *,
        training: bool = True,
    ) -> tuple[dict[str, np.ndarray], PreparedBatch]:
        """``lookup``, and the PreparedBatch it looked up (``apply_gradients(batch=)``; what
        EmbeddingLayer's backward uses). Collective."""
        with self.lock:
            self._comm.reset()
            try:
                return self._lookup(features, weights, training)
            finally:
                self._count("lookup")

    def _count(self, call: str) -> None:
        sent = self._comm.reset()
        self.bytes_sent[call] = sent
        self.bytes_sent_total.update(sent)

    def _lookup(self, features, weights, training: bool) -> dict[str, np.ndarray]:
        nt, w = len(self.table_names), self.world_size
        error, counts, order = None, np.zeros((w, nt), dtype=np.int64), []
        try:
            if isinstance(features, PreparedBatch):
                if weights is not None:
                    raise ValueError("weights must be given to preprocess(), not with a batch")
                check_prepared_for(features, self._fingerprint, self._resolved)
                if not features.deduplicated:
                    raise ValueError("this PreparedBatch was not deduplicated: build it with "
                                     "ShardedEngine.preprocess")  # fmt: skip
                batch = features
            else:
                batch = self.preprocess(features, weights)
            for t, tb in enumerate(batch.tables):
                owners = self._plan.owner_of(t, tb.unique_ids)
                by_owner = np.argsort(owners, kind="stable")
                order.append((by_owner, np.bincount(owners, minlength=w)))
                counts[:, t] = order[-1][1]
        except (TypeError, ValueError) as e:
            error = e
        self._pending = None  # a failed or lookup-only call leaves nothing to update
        got = self._header(_LOOKUP, error, counts)
        # Unique ids to their owners: per destination, per table, in first-appearance order.
        send = np.concatenate([np.zeros(0, np.int64)] + [
            tb.unique_ids[by_owner] for tb, (by_owner, _) in zip(batch.tables, order, strict=True)
        ]) if nt else np.zeros(0, np.int64)  # fmt: skip
        # ``send`` is table-major; make it destination-major.
        send, send_counts = self._dest_major(send, counts)
        recv_counts = got[:, _FIXED : _FIXED + nt]
        ids = self._comm.all_to_all(send, send_counts, recv_counts.sum(axis=1), "lookup ids")
        # Answer with the rows of the ids this rank owns, in the order asked.
        dims = np.array([self._shards[t].dim for t in range(nt)], dtype=np.int64)
        answer = []
        pos = 0
        for s in range(w):
            for t in range(nt):
                n = int(recv_counts[s, t])
                shard = self._shards[t]
                rows = shard.rows_for(0, ids[pos : pos + n])
                answer.append(shard.data[rows, : shard.dim].reshape(-1))
                pos += n
        answer = np.concatenate(answer) if answer else np.zeros(0, np.float32)
        values = self._comm.all_to_all(answer, (recv_counts * dims).sum(axis=1),
                                       (counts * dims).sum(axis=1), "lookup rows")  # fmt: skip
        # Place them: table t's unique id u gets row u of its own array; pool locally.
        pulled = [np.empty((len(tb.unique_ids), dims[t]), dtype=np.float32)
                  for t, tb in enumerate(batch.tables)]  # fmt: skip
        pos = 0
        starts = [np.concatenate([[0], np.cumsum(c)]) for _, c in order]
        for d in range(w):
            for t in range(nt):
                n = int(counts[d, t])
                at = order[t][0][starts[t][d] : starts[t][d] + n]
                pulled[t][at] = values[pos : pos + n * dims[t]].reshape(n, dims[t])
                pos += n * int(dims[t])
        per_table = []
        for t, tb in enumerate(batch.tables):
            local = TableBatch(
                **{
                    **{f: getattr(tb, f) for f in _TB_FIELDS},
                    "unique_rows": np.arange(len(tb.unique_ids), dtype=np.int64),
                }
            )
            q = self._resolved.tables[t].quantization_config
            per_table.append(self._backend.lookup_rows(pulled[t], int(dims[t]), local, q))
        if training:
            self._pending = batch
        acts = {
            name: per_table[lay.table][lay.start : lay.stop].reshape(lay.shape)
            for name, lay in batch.features.items()
        }
        return acts, batch

    def _dest_major(self, table_major: np.ndarray, counts: np.ndarray):
        """Reorder blocks laid out table by table (each table's blocks by destination) into
        destination by destination (each destination's blocks by table); counts ``[W, T]``."""
        w, nt = counts.shape
        starts = np.zeros((nt, w + 1), dtype=np.int64)
        base = 0
        for t in range(nt):
            starts[t] = base + np.concatenate([[0], np.cumsum(counts[:, t])])
            base = starts[t, -1]
        pieces = [table_major[starts[t, d] : starts[t, d + 1]] for d in range(w)
                  for t in range(nt)]  # fmt: skip
        out = np.concatenate(pieces) if pieces else table_major[:0]
        return out, counts.sum(axis=1)

    def apply_gradients(self, gradients: Mapping, learning_rates: Sequence[float] | None = None,
                        batch: PreparedBatch | None = None) -> None:  # fmt: skip
        """One optimizer step from the gradients of ``batch`` (default: this rank's last
        training lookup's): collectively, every row touched by any rank is updated once, by
        its owner, from the sum of every rank's contributions in the single engine's order.
        Collective."""
        with self.lock:
            self._comm.reset()
            try:
                self._apply(gradients, learning_rates, batch)
            finally:
                self._count("apply_gradients")

    def _apply(self, gradients, learning_rates, given: PreparedBatch | None) -> None:
        r, w = self._resolved, self.world_size
        nf, nt = len(self._features), len(self.table_names)
        error, lrs = None, None
        counts = np.zeros((w, 2 * nf), dtype=np.int64)
        ints, floats = [[] for _ in range(w)], [[] for _ in range(w)]
        try:
            batch = self._pending if given is None else given
            if given is not None:
                check_prepared_for(given, self._fingerprint, self._resolved)
                if not given.deduplicated:
                    raise ValueError("this PreparedBatch was not deduplicated: build it with "
                                     "ShardedEngine.preprocess")  # fmt: skip
            if batch is None:
                raise ValueError(
                    "apply_gradients needs a lookup(..., training=True) first: there is no "
                    "batch whose rows to update"
                )
            grads = self._check_gradients(gradients, batch)
            lrs = self._learning_rates.resolve(self._step, learning_rates)
            for t, (opt, lr) in enumerate(zip(self._optimizers, lrs, strict=True)):
                try:
                    opt.check_learning_rate(lr)
                except ValueError as e:
                    raise ValueError(f"table {self.table_names[t]!r}, step {self._step}: {e}; "
                                     "nothing was updated") from None  # fmt: skip
            for f, name in enumerate(self._features):
                lay = batch.features[name]
                t = r.feature_table[name]
                tb = batch.tables[t]
                lo, hi = np.searchsorted(tb.segments, [lay.start, lay.stop])
                ids = tb.unique_ids[tb.inverse[lo:hi]]
                gains, segs = tb.gains[lo:hi], tb.segments[lo:hi]
                owners = self._plan.owner_of(t, ids)
                g = grads[name]
                for d in range(w):
                    sel = np.flatnonzero(owners == d)
                    useg, at = np.unique(segs[sel], return_inverse=True)
                    counts[d, f], counts[d, nf + f] = len(sel), len(useg)
                    ints[d] += [ids[sel], at.reshape(-1).astype(np.int64)]
                    floats[d] += [gains[sel], g[useg - lay.start].reshape(-1)]
        except (TypeError, ValueError) as e:
            error = e
        got = self._header(_APPLY, error, counts, lrs)
        # Everything is validated on every rank; from here on tables change.
        got_n, got_m = got[:, _FIXED : _FIXED + nf], got[:, _FIXED + nf : _FIXED + 2 * nf]
        dims = np.array([r.features[f].table.dim for f in self._features], dtype=np.int64)
        int_recv = self._comm.all_to_all(
            _cat(sum(ints, []), np.int64), 2 * counts[:, :nf].sum(axis=1),
            2 * got_n.sum(axis=1), "gradient ids")  # fmt: skip
        float_recv = self._comm.all_to_all(
            _cat(sum(floats, []), np.float32), (counts[:, :nf] + counts[:, nf:] * dims).sum(axis=1),
            (got_n + got_m * dims).sum(axis=1), "gradients")  # fmt: skip
        # Cut what each rank sent into its features' blocks.
        blocks = {}
        ip = fp = 0
        for s in range(w):
            for f in range(nf):
                n, m, dim = int(got_n[s, f]), int(got_m[s, f]), int(dims[f])
                blocks[s, f] = (int_recv[ip : ip + n], int_recv[ip + n : ip + 2 * n],
                                float_recv[fp : fp + n],
                                float_recv[fp + n : fp + n + m * dim].reshape(m, dim))  # fmt: skip
                ip += 2 * n
                fp += n + m * dim
        index = {name: f for f, name in enumerate(self._features)}
        skip = self.nonfinite_gradients == "skip_row"
        unchanged: dict[str, np.ndarray] = {}
        for t in range(nt):
            shard = self._shards[t]
            if shard.data.shape[0] == 0:
                continue  # none of this table's rows lives here, so no rank sent any
            ids, at, gains, rows_g = [], [], [], []
            base = 0
            # The single engine's occurrence order: features in order, then ranks in order.
            for name in r.table_features[t]:
                for s in range(w):
                    b_ids, b_at, b_gains, b_rows = blocks[s, index[name]]
                    ids.append(b_ids)
                    at.append(b_at + base)
                    gains.append(b_gains)
                    rows_g.append(b_rows)
                    base += len(b_rows)
            grad = np.concatenate(rows_g) if rows_g else np.zeros((0, shard.dim), np.float32)
            tb = self._owner_batch(shard, _cat(ids, np.int64), _cat(at, np.int64),
                                   _cat(gains, np.float32), base)  # fmt: skip
            left = self._backend.apply(shard, tb, grad, self._optimizers[t], lrs[t], self._step,
                                       skip)  # fmt: skip
            if left is not None and len(left):
                unchanged[self.table_names[t]] = np.sort(shard.global_ids[left])
        # Everyone learns how many rows any rank left unchanged, so every rank reports alike.
        mine = np.array([sum(len(v) for v in unchanged.values())], dtype=np.int64)
        everyone = self._comm.all_gather(mine, "nonfinite count")[:, 0]
        self._step += 1
        if given is None or given is self._pending:  # one update per lookup
            self._pending = None
        if everyone.any():
            self._report_unchanged(unchanged, everyone)

    @staticmethod
    def _owner_batch(shard: ShardTable, ids: np.ndarray, segments: np.ndarray,
                     gains: np.ndarray, num_outputs: int) -> TableBatch:  # fmt: skip
        """The TableBatch of one table's occurrences received by its owner, in the single
        engine's order: ids deduplicated in order of first appearance, the occurrences grouped
        by id stably (so each row's gradient sums in that order), rows from the shard."""
        unique, inverse = dedup(ids)
        output_offsets, _ = csr(segments, num_outputs)
        unique_offsets, by_unique = csr(inverse, len(unique))
        return TableBatch(
            unique_ids=unique,
            inverse=inverse,
            gains=gains,
            segments=segments,
            num_outputs=num_outputs,
            output_offsets=output_offsets,
            unique_offsets=unique_offsets,
            unique_gains=gains[by_unique],
            unique_segments=segments[by_unique],
            unique_bounds=np.array([0, len(unique)], dtype=np.int64),
            unique_rows=shard.rows_for(0, unique, True),
        )

    def _report_unchanged(self, unchanged: dict[str, np.ndarray], everyone: np.ndarray) -> None:
        """The non-finite-result policy (EmbeddingEngine's), on every rank alike."""
        ranks = ", ".join(f"rank {s}: {int(n)}" for s, n in enumerate(everyone) if n)
        mine = "; ".join(f"table {t!r}: ids {v[:5].tolist()}" for t, v in unchanged.items())
        what = f"rows left unchanged per rank ({ranks})" + (f"; here {mine}" if mine else "")
        step = self._step - 1
        if self.nonfinite_gradients == "error":
            raise NonFiniteUpdateError(
                f"step {step}: the update would have written non-finite values: {what}; every "
                "other row was updated and the step counted (nonfinite_gradients='error')",
                unchanged,
            )
        for name, ids in unchanged.items():
            self.nonfinite_rows_skipped[name] += len(ids)
        warnings.warn(f"step {step}: {what} (nonfinite_gradients='skip_row')", RuntimeWarning,
                      stacklevel=3)  # fmt: skip

    def _check_gradients(self, gradients: Mapping, batch: PreparedBatch) -> dict[str, np.ndarray]:
        """Gradient per feature as float32 ``[rows, dim]``, after EmbeddingEngine's checks."""
        if not isinstance(gradients, Mapping):
            raise TypeError(
                f"gradients must be a dict of feature name -> array, got {type(gradients)}"
            )
        missing = [f for f in batch.features if f not in gradients]
        extra = [f for f in gradients if f not in batch.features]
        if extra or missing:
            raise ValueError(f"gradients for features {sorted(gradients)}; the batch has "
                             f"{list(batch.features)}, each needs one")  # fmt: skip
        out = {}
        for name, lay in batch.features.items():
            g = as_numpy(gradients[name])
            if g.shape != lay.shape:
                raise ValueError(
                    f"feature {name!r}: gradient has shape {tuple(g.shape)}, the activation has "
                    f"shape {lay.shape}"
                )
            g = g.astype(np.float32, copy=False).reshape(lay.stop - lay.start, lay.shape[-1])
            if self.nonfinite_gradients == "error" and not np.isfinite(g).all():
                raise ValueError(
                    f"feature {name!r}: gradient has a non-finite value "
                    "(nonfinite_gradients='error'; 'skip_row' leaves such rows untouched)"
                )
            out[name] = g
        return out

    # -- state -----------------------------------------------------------------------------------

    def table_contents(self) -> dict[str, Any]:
        """Every table whole, gathered on every rank: ``{"step": int, "tables": {table:
        {"weights": [vocabulary_size, dim], slot: ...}}}`` in logical row order, the layout of
        ``EmbeddingEngine.state_dict()`` (copies). Collective."""
        with self.lock:
            self._comm.reset()
            try:
                self._header(_CONTENTS, None)
                tables = {}
                for shard, name, t in zip(self._shards, self.table_names, self._resolved.tables,
                                          strict=True):  # fmt: skip
                    ids = self._comm.all_gather_ragged(shard.global_ids, "contents")
                    rows = self._comm.all_gather_ragged(shard.data.reshape(-1), "contents")
                    full = np.empty((t.vocabulary_size, shard.row_width), dtype=np.float32)
                    for i, v in zip(ids, rows, strict=True):
                        full[i] = v.reshape(len(i), shard.row_width)
                    out = {WEIGHTS: full[:, : shard.dim].copy()}
                    for spec in shard.slot_specs:
                        col = shard.columns[spec.name]
                        block = full[:, col.start : col.start + col.width]
                        out[spec.name] = np.ascontiguousarray(block).view(np.dtype(col.dtype))
                    tables[name] = out
                return {"step": self._step, "tables": tables}
            finally:
                self._count("table_contents")

    def spec(self) -> dict[str, Any]:
        """The configuration as JSON, as the single engine of the same arguments gives it
        (``EmbeddingEngine.spec``; tables in RAM): what a checkpoint's manifest holds, so a
        plain engine loads a ShardedEngine's checkpoint and back."""
        r = self._resolved
        tables = []
        for t, (name, cfg) in enumerate(zip(r.table_names, r.tables, strict=True)):
            opt, shard = self._optimizers[t], self._shards[t]
            q = cfg.quantization_config
            tables.append({
                "name": name,
                "vocabulary_size": cfg.vocabulary_size,
                "dim": cfg.dim,
                "combiner": cfg.combiner,
                "initializer": initializer_to_json(_initializer_for(cfg, opt)),
                "optimizer": optimizer_to_json(opt, self._learning_rates.tag_of(t)),
                "quantization_config": None if q is None else dataclasses.asdict(q),
                **compressor_entry(cfg),
                "storage": "ram",
                "slots": [dataclasses.asdict(s) for s in shard.slot_specs],
            })  # fmt: skip
        features = [
            {"name": name, "table": r.table_names[r.feature_table[name]],
             "max_sequence_length": fc.max_sequence_length,
             "validate_weights_and_indices": fc.validate_weights_and_indices,
             "output_shape": None if fc.output_shape is None else list(fc.output_shape)}
            for name, fc in r.features.items()
        ]  # fmt: skip
        tags = []
        for tag in range(self._learning_rates.num_tags):
            fn = self._learning_rates.tag_callable(tag)
            tags.append({"tag": tag, "callable": None if fn is None else
                         getattr(fn, "__qualname__", "?")})  # fmt: skip
        plan = plan_storage(r, self._optimizers, "ram", None)
        return {"tables": tables, "features": features, "storage_plan": plan.to_json(),
                "learning_rate_tags": tags, "seed": self.seed, "backend": self._backend.name,
                "nonfinite_gradients": self.nonfinite_gradients}  # fmt: skip

    # -- checkpoints -----------------------------------------------------------------------------

    def save(self, path, keep: int | None = None, extra_tensors: Mapping | None = None,
             extra_metadata: Mapping | None = None):  # fmt: skip
        """Write a checkpoint under the folder ``path`` in embengine's format (by logical table
        and row, one global manifest), each rank writing a block of every table's rows; it
        loads at any world size and into a plain ``EmbeddingEngine``. ``extra_tensors`` /
        ``extra_metadata``: as ``EmbeddingEngine.save``; rank 0's are written (pass the same
        on every rank, e.g. a DDP model's). Collective; every rank must see ``path`` (one host,
        or a shared file system). Returns the checkpoint's folder. See
        embengine.distributed.checkpoint."""
        from . import checkpoint

        with self.lock:
            self._comm.reset()
            try:
                self._header(_SAVE, None)
                return checkpoint.save(self._comm, self._shards, self._plan, self.spec(),
                                       self._step, path, keep, extra_metadata,
                                       extra_tensors)  # fmt: skip
            finally:
                self._count("save")

    def restore(self, path, verify: bool = True):
        """Load a checkpoint (``path``: a checkpoint folder, or a folder of them: the newest)
        written at any world size, or by a plain engine, of the same configuration: each rank
        reads its own rows, in chunks. Collective; returns a CheckpointInfo (step, extra data),
        as ``EmbeddingEngine.restore``."""
        from . import checkpoint

        with self.lock:
            self._comm.reset()
            try:
                self._header(_RESTORE, None)
                info = checkpoint.restore(self._comm, self._shards, self.spec(), path, verify)
                self._step = info.step
                self._pending = None  # its rows no longer hold what it looked up
                return info
            finally:
                self._count("restore")

    @classmethod
    def load(cls, path, callables=None, verify: bool = True, **kwargs) -> ShardedEngine:
        """A new ShardedEngine from a checkpoint alone (any world size's, or a plain
        engine's): ``kwargs`` are ShardedEngine's arguments (sharding, group, timeout, ...).
        Collective."""
        from ..checkpoint import read_checkpoint
        from ..spec import engine_options, feature_configs_from_spec

        spec, _ = read_checkpoint(path, verify)
        features = feature_configs_from_spec(spec, callables)
        options = engine_options(spec)
        engine = cls(features, **{"seed": options["seed"],
                                  "nonfinite_gradients": options["nonfinite_gradients"],
                                  **kwargs})  # fmt: skip
        engine.restore(path, verify=False)  # checked just now
        return engine


_TB_FIELDS = ("unique_ids", "inverse", "gains", "segments", "num_outputs", "output_offsets",
              "unique_offsets", "unique_gains", "unique_segments", "unique_bounds")  # fmt: skip


def _cat(arrays: list[np.ndarray], dtype) -> np.ndarray:
    """Concatenate 1-D views of ``arrays`` (none: an empty array of ``dtype``)."""
    if not arrays:
        return np.zeros(0, dtype=dtype)
    return np.concatenate([np.asarray(a, dtype=dtype).reshape(-1) for a in arrays])
