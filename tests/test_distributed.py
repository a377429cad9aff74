"""ShardedEngine on real gloo process groups: W ranks, each with its own samples, train exactly
as one EmbeddingEngine fed the concatenation of their batches in rank order.

The ranks are child processes (tests/dist_worker.py) on 127.0.0.1 with a free port; every wait
has a hard limit: the process group's timeout is 60 s, and the test kills any child still alive
after ``LIMIT`` seconds. Each world size runs all its scenarios in one process group (one
interpreter start per rank), shared by the tests through a module fixture.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

from _ranks import run_ranks  # noqa: E402

import embengine as ee  # noqa: E402
from embengine.distributed import ShardPlan, plan_shards  # noqa: E402
from embengine.training.ranks import free_port  # noqa: E402

HERE = Path(__file__).parent
WORKER = HERE / "dist_worker.py"
LIMIT = 240  # seconds for a whole group of ranks, kernels compiled from the cache included

_spec = importlib.util.spec_from_file_location("dist_worker", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

OPTIMIZERS = [
    "sgd",
    "adagrad",
    "adam",
    "adam_dense",
    "ftrl",
    "rowwise_adagrad",
    "sgd_schedule",
    "adagrad_no_accumulation",
]
SHARDINGS = ["row", "table", "auto"]
EXCHANGES = ["rows", "sums", "auto"]
WORLDS = [1, 2, 3]
SWEEPERS = ["adam_dense", "lion_dense"]  # optimizers that update every row each step
SCENARIOS = (
    [f"equal:{o}:{s}:{x}" for o in OPTIMIZERS for s in SHARDINGS for x in EXCHANGES]
    + ["equal:adam:row:auto:nan"]
    + [f"sweep:{o}:{s}:{x}" for o in SWEEPERS for s in ("row", "table") for x in EXCHANGES]
)
# Evaluation lookups between each training lookup and its update: "sums" (the owners keep the
# lookup's occurrences for the update) and "rows".
BETWEEN = ["between:adagrad:row:sums", "between:adam:table:rows", "between:ftrl:auto:auto"]
# A training lookup refused on every rank (one rank's invalid input) between each training
# lookup and its update: "auto" (both exchanges at 2 and 3 ranks) and "sums" of whole tables.
FAILED = ["failed:adagrad:row:auto", "failed:sgd:table:sums"]
# Whole tables under "auto" (so "sums", their occurrences sent undeduplicated) where the
# equality scenarios have none: one shared by bag and sequence features, an update of the
# older of two lookups, one rank's own batch, ids changed between lookup and update.
WHOLE = ["whole:adagrad_no_accumulation", "whole:adam_dense"]
# Per feature: its table, the table's width, the positions a sample keeps (sequences cut).
FEATURES = {"a": ("big", 8), "b": ("big", 8), "c": ("small", 4), "s": ("seq", 6)}
SEQUENCE = {"s": 3}


def spawn(
    world: int,
    out: Path,
    scenarios: list[str],
    limit: float = LIMIT,
    env: dict | None = None,
    worker: Path = WORKER,
) -> list[int]:
    """Run ``world`` ranks of ``worker`` (dist_worker; keyed_dist_worker for
    test_distributed_keyed.py) on ``scenarios``; their exit codes. Children alive after
    ``limit`` seconds are killed (and the test fails)."""
    port = free_port()
    codes = run_ranks(
        lambda r: [str(worker), str(r), str(world), str(port), str(out), *scenarios],
        world,
        out,
        limit,
        env,
    )
    if None in codes:
        pytest.fail(
            f"ranks still running after {limit} s were killed: {codes}\n{rank_logs(out, world)}"
        )
    return codes


def rank_logs(out: Path, world: int) -> str:
    """The tail of each rank's log, for a failure's message."""
    return "\n".join(
        f"--- rank {r}\n" + (out / f"log.rank{r}").read_text()[-3000:] for r in range(world)
    )


def _logs(out: Path, world: int) -> str:
    return "\n".join(
        f"--- rank {r}\n" + (out / f"log.rank{r}").read_text()[-3000:] for r in range(world)
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """World size -> the folder of its ranks' results (spawned on first use)."""
    done: dict[int, Path] = {}

    def get(world: int) -> Path:
        if not done:  # compile (or load) every kernel here once, not in W children at a time
            for o in OPTIMIZERS:
                single_engine_run(o, 1)
        if world not in done:
            out = tmp_path_factory.mktemp(f"w{world}")
            codes = spawn(world, out, [*SCENARIOS, *BETWEEN, *FAILED, *WHOLE])
            assert codes == [0] * world, _logs(out, world)
            done[world] = out
        return done[world]

    return get


def single_engine_run(optimizer_name: str, world: int, nan: bool = False):
    """The single engine on the concatenated batches: its activations per step, cut per rank
    as the ranks saw them, and its final state."""
    features, o = worker.make_features(optimizer_name)
    eng = ee.EmbeddingEngine(
        features, optimizer=o, seed=3, nonfinite_gradients="skip_row" if nan else "error"
    )
    acts = []
    for step in range(worker.STEPS):
        feats, weights, grads = worker.global_batch(step, nan)
        a = eng.lookup(feats, weights)
        acts.append(
            {
                r: {k: v[lo:hi] for k, v in a.items()}
                for r, (lo, hi) in enumerate(worker.split(step, world))
            }
        )
        eng.apply_gradients(grads)
    return acts, eng


def owner_function(plan: str, world: int):
    """The owner of an id of a table whose ``engine.plan`` entry is ``plan`` ("row", "table on
    rank k", or an "auto" reason: "row: ..." / "table: ..., on rank k (...)"); a whole table's
    has ``whole`` set."""
    if plan.startswith("row"):
        return lambda i: i % world
    rank = int(plan.split("on rank ")[1].split()[0])

    def owner(i):
        return rank

    owner.whole = True
    return owner


def occurrences(step: int, rank: int, world: int):
    """(feature, activation row, id) of each occurrence in rank ``rank``'s batch of ``step``,
    in order (sequences cut to their length; an activation row is a sample, or a (sample,
    position) of a sequence feature)."""
    feats, _, _ = worker.local(step, rank, world)
    for f, bags in feats.items():
        for b, bag in enumerate(bags):
            for p, i in enumerate(bag[: SEQUENCE.get(f, len(bag))]):
                yield f, (b, p) if f in SEQUENCE else b, i


def exchange_counts(step: int, rank: int, world: int, owners: dict) -> dict:
    """Per table, what rank ``rank`` sends other ranks in ``step`` by the cost model of
    docs/design.md: its unique ids they own (R), its occurrences of them (N), and its
    (activation row, owner) pairs among those (G)."""
    occ = [(f, o, i) for f, o, i in occurrences(step, rank, world)]
    counts = {}
    for table in {t for t, _ in FEATURES.values()}:
        remote = [
            (f, o, i) for f, o, i in occ if FEATURES[f][0] == table and owners[table](i) != rank
        ]
        counts[table] = (
            len({i for _, _, i in remote}),
            len(remote),
            len({(f, o, owners[table](i)) for f, o, i in remote}),
        )
    return counts


def chosen_exchange(step: int, world: int, owners: dict) -> dict:
    """Per table, what "auto" must pick in ``step``: "sums" for a whole table, else "sums"
    when the ranks' savings (``sharding.sums_saving``, from ``exchange_counts``) add up to zero
    or more."""
    dims = {t: d for t, d in FEATURES.values()}
    saving = {t: 0 for t in dims}
    for r in range(world):
        for t, (remote_ids, remote_occ, rows) in exchange_counts(step, r, world, owners).items():
            rows_bytes = (8 + 4 * dims[t]) * remote_ids + 16 * remote_occ + 4 * dims[t] * rows
            saving[t] += rows_bytes - (16 * remote_occ + 8 * dims[t] * rows)
    return {
        t: "sums" if v >= 0 or getattr(owners[t], "whole", False) else "rows"
        for t, v in saving.items()
    }


def one_owner_rows(step: int, rank: int, world: int, feature: str, owners: dict) -> np.ndarray:
    """Per activation row of ``feature`` in rank ``rank``'s batch: whether all its ids live on
    one rank (a "sums" lookup then equals the single engine's bit for bit)."""
    feats, _, _ = worker.local(step, rank, world)
    table = FEATURES[feature][0]
    bags = feats[feature]
    if feature in SEQUENCE:
        return np.ones((len(bags), SEQUENCE[feature]), dtype=bool)
    return np.array([len({owners[table](i) for i in bag}) <= 1 for bag in bags], dtype=bool)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("sharding", SHARDINGS)
@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
def test_sharded_training_equals_one_engine_on_the_concatenated_batch(
    runs, world, sharding, exchange, optimizer_name
):
    out = runs(world)
    acts, single = single_engine_run(optimizer_name, world)
    state = single.state_dict()
    name = f"equal_{optimizer_name}_{sharding}_{exchange}"
    plans = np.load(out / f"{name}.rank0.npz")["plan"].tolist()
    owners = {t: owner_function(p, world) for t, p in zip(worker.TABLES, plans, strict=True)}
    for rank in range(world):
        got = np.load(out / f"{name}.rank{rank}.npz")
        for step in range(worker.STEPS):
            exchanged = dict(zip(worker.TABLES, got[f"exchanged{step}"].tolist(), strict=True))
            if exchange == "auto":  # by the cost model, from every rank's batch
                assert exchanged == chosen_exchange(step, world, owners), (rank, step)
            else:
                assert set(exchanged.values()) == {exchange}, exchanged
            for k, want in acts[step][rank].items():
                have = got[f"act{step}/{k}"]
                if exchanged[FEATURES[k][0]] == "rows":
                    # Bit-identical: the bags are pooled by their own rank from the same rows.
                    assert have.tobytes() == want.tobytes(), (rank, step, k)
                    continue
                # Partial sums added in rank order: a bag on one rank is its owner's sum, bit
                # for bit; any other equals up to float32 rounding.
                one = one_owner_rows(step, rank, world, k, owners)
                assert have[one].tobytes() == want[one].tobytes(), (rank, step, k)
                np.testing.assert_allclose(have, want, rtol=1e-6, atol=1e-7)
        # Tables and slots after 3 steps, gathered on every rank: bit-identical.
        assert int(got["step"]) == state["step"] == worker.STEPS
        for table, arrays in state["tables"].items():
            for key, want in arrays.items():
                have = got[f"table/{table}/{key}"]
                assert have.dtype == want.dtype, (table, key)
                np.testing.assert_array_equal(have, want, err_msg=f"{table}/{key} rank {rank}")
        # table_stats: this rank's rows of each table (vocabularies 37, 2, 11).
        rows = got["rows"].tolist()
        if sharding == "row":
            assert rows == [len(range(rank, v, world)) for v in (37, 2, 11)]
        if sharding == "auto" and world > 1:
            # "big" holds most bytes, "seq" (3 positions a sample) much of the traffic, and
            # non-lazy Adam sweeps every row: row sharded; "small" whole on rank 0.
            plan = got["plan"].tolist()
            if optimizer_name == "adam_dense":
                assert all("its optimizer updates every row" in p for p in plan), plan
            else:
                assert plan[0].startswith("row: 37 rows x 8") and "% of the bytes" in plan[0]
                assert plan[1].startswith("table: 2 rows x 4, on rank 0"), plan
                assert plan[2].startswith("row: 11 rows x 6"), plan
                assert rows[1] == (2 if rank == 0 else 0)
        assert got["stats_bytes"].tolist() == got[f"bytes{worker.STEPS - 1}"].tolist()
        if world == 1:
            assert got["bytes0"].tolist() == [0, 0]  # nothing leaves a lone rank
        else:
            assert (got["bytes0"] > 0).all()


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", BETWEEN)
def test_an_evaluation_lookup_between_a_sharded_lookup_and_its_update_changes_nothing(
    runs, world, name
):
    """A validation lookup in the middle of every step (held-out samples, then the step's
    own as a PreparedBatch; step 1 applies with batch=): every update runs, the training
    activations stay as they were, and the tables end bit for bit as the single engine's
    without evaluation. An evaluation lookup used to forget the pending batch on every rank:
    apply_gradients raised "needs a lookup" (batch=: nothing to update either)."""
    optimizer_name = name.split(":")[1]
    state = single_engine_run(optimizer_name, world)[1].state_dict()
    for rank in range(world):
        path = runs(world) / f"{name.replace(':', '_')}.rank{rank}.npz"
        got = np.load(path)
        errors = {k: str(got[k]) for k in got.files if k.startswith("error")}
        assert not errors, (rank, errors)
        assert all(bool(got[f"same{s}"]) for s in range(worker.STEPS)), rank
        _assert_state(path, state)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", WHOLE)
def test_whole_tables_sent_undeduplicated_train_as_one_engine(runs, world, name):
    """Whole tables under "auto" exchange sums, their ranks' lookup batches listing each
    occurrence as its own id (``ShardedEngine._lookup_batch``): a table shared by a weighted
    sqrtn bag feature, a sequence feature and another bag feature; an update of the older of
    two training lookups (its batch pushed, not kept), then of the newer; one rank updating
    from its own equal batch; the caller's id arrays zeroed between a lookup and its update;
    an evaluation lookup of held-out samples each step (its owners pool the bags as they
    came). Every lookup is the single engine's bit for bit (each bag's ids on one rank), and
    the tables end as the single engine's making the same calls."""
    features, o = worker.whole_features(name.split(":")[1])
    single = ee.EmbeddingEngine(features, optimizer=o, seed=3)
    acts, evals = [], []
    for step in range(worker.WHOLE_STEPS):
        held, held_weights, _ = worker.whole_batch(2 * worker.WHOLE_STEPS + step)
        evals.append(single.lookup(held, held_weights, training=False))
        feats, weights, grads = worker.whole_batch(step)
        if step == 1:
            a, batch = single.lookup_with_batch(feats, weights)
            f2, w2, g2 = worker.whole_batch(worker.WHOLE_STEPS + step)
            later = single.lookup(f2, w2)
            single.apply_gradients(grads, batch=batch)
            single.apply_gradients(g2)
            acts.append((a, later))
            continue
        acts.append((single.lookup(feats, weights), None))
        single.apply_gradients(grads)
    state = single.state_dict()
    for rank in range(world):
        path = runs(world) / f"{name.replace(':', '_')}.rank{rank}.npz"
        got = np.load(path)
        assert got["exchange"].tolist() == ["sums", "sums"]
        for step, (a, later) in enumerate(acts):
            lo, hi = worker.whole_split(step, world)[rank]
            for suffix, want in (("", a), ("b", later)):
                for k, v in (want or {}).items():
                    have = got[f"act{step}{suffix}/{k}"]
                    assert have.tobytes() == v[lo:hi].tobytes(), (rank, step, suffix, k)
            lo, hi = worker.whole_split(2 * worker.WHOLE_STEPS + step, world)[rank]
            for k, v in evals[step].items():
                have = got[f"eval{step}/{k}"]
                assert have.tobytes() == v[lo:hi].tobytes(), (rank, step, "eval", k)
        _assert_state(path, state)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", FAILED)
def test_a_training_lookup_refused_on_every_rank_leaves_the_pending_batch(runs, world, name):
    """A training lookup that one rank's id out of range makes every rank refuse, between a
    training lookup and its update (right after it, when the update would speculate; through
    lookup_with_batch and batch=; after an evaluation lookup): as the single engine's failed
    lookup of the concatenation, it leaves the earlier lookup pending, so the update updates
    from it, on every rank alike, and the tables end bit for bit as the single engine's
    making the same calls. The sharded lookup used to forget the pending batch before its
    header: every update raised "needs a lookup" on every rank."""
    optimizer_name = name.split(":")[1]
    features, o = worker.make_features(optimizer_name)
    single = ee.EmbeddingEngine(features, optimizer=o, seed=3)
    for step in range(worker.STEPS):
        feats, weights, grads = worker.global_batch(step)
        batch = single.lookup_with_batch(feats, weights)[1] if step == 1 else None
        if step != 1:
            single.lookup(feats, weights)
        if step == 2:
            single.lookup(feats, weights, training=False)
        lo, hi = worker.split(step, world)[worker.failing_rank(step, world)]
        bad = worker.failing_batch({k: v[lo:hi] for k, v in feats.items()})["c"]
        with pytest.raises(ValueError, match=r"feature 'c': id 2 .* is out of range \[0, 2\)"):
            single.lookup({**feats, "c": feats["c"][:lo] + bad + feats["c"][hi:]}, weights)
        single.apply_gradients(grads, batch=batch)
    state = single.state_dict()
    for rank in range(world):
        path = runs(world) / f"{name.replace(':', '_')}.rank{rank}.npz"
        got = np.load(path)
        errors = {k: str(got[k]) for k in got.files if k.startswith("error")}
        assert not errors, (rank, errors)
        for step in range(worker.STEPS):
            refused, bad = str(got[f"refused{step}"]), worker.failing_rank(step, world)
            want = (
                "ValueError: feature 'c': id 2 at sample 0"
                if rank == bad
                else f"DistributedError: rank {rank}: lookup at step {step} failed on ranks [{bad}]"
            )
            assert refused.startswith(want), (rank, step, refused)
            assert not got[f"armed{step}"], (rank, step)  # no rank speculates afterwards
        _assert_state(path, state)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", FAILED)
def test_table_stats_reports_the_exchange_of_the_last_training_lookup(runs, world, name):
    """table_stats()'s "exchange" is what the last training lookup exchanged, which its update
    reuses: a refused lookup and an evaluation lookup afterwards (of no sample, for which
    "auto" picks "sums" everywhere) leave it. It used to report the evaluation's, so a step
    whose training lookup pulled rows was reported as "sums"."""
    from embengine.distributed.sharding import sums_saving

    assert sums_saving(8, 0, 0, 4) == 0  # no sample: "auto" picks "sums" (savings >= 0)
    picked = set()
    for rank in range(world):
        got = np.load(runs(world) / f"{name.replace(':', '_')}.rank{rank}.npz")
        for step in range(worker.STEPS):
            trained = got[f"trained{step}"].tolist()
            assert got[f"reported{step}"].tolist() == trained, (rank, step)
            picked.update(trained)
    if name.endswith(":auto") and world > 1:
        assert "rows" in picked, picked  # the premise: the evaluation's would differ


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("sharding", ["row", "table"])
@pytest.mark.parametrize("optimizer_name", SWEEPERS)
def test_every_owner_sweeps_its_rows_when_no_id_of_them_came(
    runs, world, sharding, exchange, optimizer_name
):
    # Steps in which an owner gets no id of a table, a table gets none, every batch is empty:
    # each owner still updates its rows from their slots, as the single engine updates all.
    features, o = worker.sweep_features(optimizer_name)
    single = ee.EmbeddingEngine(features, optimizer=o, seed=3)
    for step in range(worker.SWEEP_STEPS):
        feats, grads = worker.sweep_batch(step)
        single.lookup(feats)
        single.apply_gradients(grads)
    state = single.state_dict()
    for rank in range(world):
        _assert_state(
            runs(world) / f"sweep_{optimizer_name}_{sharding}_{exchange}.rank{rank}.npz", state
        )


def test_the_sweep_batches_leave_owners_without_ids():
    # The premise above: at step 1 no odd id of "t" and no id of "u"; at step 2 nothing at all.
    feats, _ = worker.sweep_batch(1)
    assert all(i % 2 == 0 for bag in feats["a"] for i in bag) and not any(feats["b"])
    feats, _ = worker.sweep_batch(2)
    assert not any(feats["a"]) and not any(feats["b"])
    feats, _ = worker.sweep_batch(0)
    assert set(feats["a"][0]) == set(range(8)) and set(feats["b"][0]) == set(range(5))


def test_the_exchanges_differ_where_the_test_says_they_do(runs):
    # The premise of the lookup checks above: at 2 and 3 ranks some bags span ranks (so "sums"
    # rounds them differently), "auto" picks each exchange somewhere, and a "sums" lookup of
    # such a bag is not bit-identical to the single engine's.
    picked = set()
    for world in (2, 3):
        owners = {t: (lambda i, w=world: i % w) for t in worker.TABLES}
        assert not all(
            one_owner_rows(step, r, world, "a", owners).all()
            for step in range(worker.STEPS)
            for r in range(world)
        )
        for step in range(worker.STEPS):
            got = np.load(runs(world) / "equal_sgd_row_auto.rank0.npz")
            picked.update(got[f"exchanged{step}"].tolist())
    assert picked == {"rows", "sums"}, picked
    acts, _ = single_engine_run("sgd", 2)
    differ = [
        np.load(runs(2) / f"equal_sgd_row_sums.rank{r}.npz")[f"act{step}/a"].tobytes()
        != acts[step][r]["a"].tobytes()
        for step in range(worker.STEPS)
        for r in range(2)
    ]
    assert any(differ)


@pytest.mark.parametrize("world", [2, 3])
def test_a_nan_gradient_skips_the_same_rows_as_one_engine(runs, world):
    # skip_row: every row that a NaN gradient reaches, from any rank, is left alone that step.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        _, single = single_engine_run("adam", world, nan=True)
    _, clean = single_engine_run("adam", world)
    want = single.state_dict()
    hot = worker.HOT
    assert (want["tables"]["big"]["weights"][hot] != clean.embedding_tables["big"][hot]).any()
    # Counted and warned about alike: the rows left alone for the NaN gradient (each owner's
    # of its shard, gathered), in the single engine's words and count.
    skipped = [single.nonfinite_rows_skipped[t] for t in worker.TABLES]
    assert sum(skipped) > 0 and len(caught) == 1
    said = str(caught[0].message).split(" (nonfinite_gradients=")[0]
    for rank in range(world):
        path = runs(world) / f"equal_adam_row_auto_nan.rank{rank}.npz"
        _assert_state(path, want)
        got = np.load(path)
        assert got["skipped"].tolist() == skipped, rank
        warned = [str(got[f"warned{s}"][0]) for s in range(worker.STEPS)]
        assert warned[0].split("; left alone per rank: rank ")[0] == said, (rank, warned)
        assert warned[1:] == [""] * (worker.STEPS - 1), rank


def test_table_stats_rows_add_up_to_every_table(runs):
    for world in (2, 3):
        for sharding in SHARDINGS:
            rows = sum(
                np.load(runs(world) / f"equal_sgd_{sharding}_auto.rank{r}.npz")["rows"]
                for r in range(world)
            )
            assert rows.tolist() == [37, 2, 11]


def test_the_batches_hold_a_hot_id_everywhere_and_empty_local_batches():
    # The premise of the equality tests above: the hot id is in every sample of every rank
    # (one update per global step, summed from every rank), and some ranks have no samples.
    for step in range(worker.STEPS):
        feats, _, _ = worker.global_batch(step)
        assert all(worker.HOT in bag for bag in feats["a"])
        sizes = [hi - lo for lo, hi in worker.split(step, 2)]
        assert sum(sizes) == worker.BATCH
    assert [hi - lo for lo, hi in worker.split(1, 2)][1] == 0  # an empty local batch
    assert [hi - lo for lo, hi in worker.split(2, 3)][0] == 0


@settings(max_examples=200, deadline=None)
@given(
    dims=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    peers=st.integers(1, 4),
    width=st.integers(4, 30),
    data=st.data(),
)
def test_the_update_message_puts_each_tables_rows_on_its_grid(dims, peers, width, data):
    from embengine.distributed.engine import _RowsLayout
    from embengine.distributed.sharding import message_grid, update_message

    counts = st.lists(st.integers(0, 9), min_size=peers, max_size=peers)
    m = np.array([data.draw(counts) for _ in dims], dtype=np.int64)  # [feature, peer]
    n = np.array([data.draw(counts) for _ in dims], dtype=np.int64)
    grid = message_grid(dims)
    msg = update_message(n, m, dims, width, grid)
    assert (msg.sizes % grid == 0).all() and (msg.block_at % grid == 0).all()
    assert msg.block_at.tolist() == np.concatenate([[0], np.cumsum(msg.sizes)[:-1]]).tolist()
    for p in range(peers):
        # Header, each feature's rows, the occurrences: in order, apart, inside the block.
        parts = [(2 * msg.block_at[p], 2 * (msg.block_at[p] + 2 * width))]  # in half floats
        parts += [
            (2 * msg.row_at[p, f], 2 * (msg.row_at[p, f] + m[f, p] * d)) for f, d in enumerate(dims)
        ]
        parts += [
            (4 * msg.int_at[p, f], 4 * (msg.int_at[p, f] + 2 * n[f, p])) for f in range(len(dims))
        ]
        for (_, end), (start, _) in zip(parts[:-1], parts[1:], strict=True):
            assert end <= start, parts
        assert parts[-1][1] <= 2 * (msg.block_at[p] + msg.sizes[p])
        for f, d in enumerate(dims):  # a multiple of the width from the block's start
            assert (msg.row_at[p, f] - msg.block_at[p]) % d == 0
    # Where the grid is a multiple of every width, each feature's blocks from every peer are
    # one row matrix: a view, with each block's rows where they lie.
    buffer = np.arange(int(msg.sizes.sum()), dtype=np.float32)
    for f, d in enumerate(dims):
        layout = _RowsLayout(msg.row_at[:, f], m[f], d)
        assert layout.view or grid % d != 0, (grid, d)
        matrix = layout.matrix(buffer)
        for p in range(peers):
            want = buffer[msg.row_at[p, f] : msg.row_at[p, f] + m[f, p] * d].reshape(-1, d)
            have = matrix[layout.row_base[p] : layout.row_base[p] + m[f, p]]
            np.testing.assert_array_equal(have, want)


def test_sums_saving_is_the_cost_models_difference():
    from embengine.distributed.sharding import sums_saving

    # rows: (8 + 4 dim) R + 16 N + 4 dim G; sums: 16 N + 8 dim G.
    dim, r, n, g = 64, 100, 300, 120
    rows, sums = (8 + 4 * dim) * r + 16 * n + 4 * dim * g, 16 * n + 8 * dim * g
    assert sums_saving(dim, r, g) == rows - sums  # N cancels: 16 bytes either way
    assert sums_saving(8, 0, 0) == 0  # nothing remote: a tie, which "auto" gives to sums
    # One-id bags whose ids repeat: pulling each row once is cheaper than a sum per bag.
    assert sums_saving(16, remote_ids=10, gradient_rows=100) < 0
    # Long bags: one partial sum per bag beats pulling every id's row.
    assert sums_saving(16, remote_ids=100, gradient_rows=5) > 0


def test_shard_plan_rows_and_tables():
    plan = plan_shards("row", ["t0", "t1"], [100, 10], 3)
    np.testing.assert_array_equal(plan.owner_of(0, np.array([0, 1, 2, 3, 7])), [0, 1, 2, 0, 1])
    np.testing.assert_array_equal(plan.owned_ids(0, 8, 1), [1, 4, 7])
    plan = plan_shards("table", ["t0", "t1", "t2"], [10, 100, 50], 2)
    # Largest first to the least loaded rank: t1 -> 0, t2 -> 1, t0 -> 1.
    assert plan == ShardPlan(2, ("table",) * 3, (1, 0, 1))
    assert plan.describe(["t0", "t1", "t2"])["t1"] == "table on rank 0"
    plan = plan_shards({"t1": "table"}, ["t0", "t1"], [1, 1], 2)
    assert plan.kinds == ("row", "table")
    with pytest.raises(ValueError, match="unknown tables"):
        plan_shards({"nope": "row"}, ["t0"], [1], 2)
    with pytest.raises(ValueError, match="sharding must be one of"):
        plan_shards("diagonal", ["t0"], [1], 2)


def _error_text(out: Path, name: str, rank: int) -> tuple[float, str]:
    seconds, text = (out / f"{name}.rank{rank}.txt").read_text().split("\n", 1)
    return float(seconds), text


def test_auto_sharding_plans_a_mixed_configuration_and_says_why():
    from embengine.distributed.sharding import TableLoad, expected_traffic

    mb = 1 << 20
    loads = {
        "huge": TableLoad(10_000_000, 64, 2560 * mb, expected_traffic(64, [1])),  # most bytes
        "dense_adam": TableLoad(1000, 16, mb, expected_traffic(16, [1]), every_row=True),
        "hot": TableLoad(50_000, 32, 6 * mb, expected_traffic(32, [20, 20])),  # 2 sequences
        "user": TableLoad(200_000, 32, 25 * mb, expected_traffic(32, [1])),
        "country": TableLoad(100, 8, 3200, expected_traffic(8, [1])),
        "device": TableLoad(10, 4, 160, expected_traffic(4, [1])),
    }
    names, table_bytes = list(loads), [t.nbytes for t in loads.values()]
    plan = plan_shards("auto", names, table_bytes, 2, list(loads.values()))
    why = plan.describe(names)
    assert plan.kinds == ("row", "row", "row", "table", "table", "table")
    assert why["huge"] == (
        "row: 10000000 rows x 64, 99% of the bytes: more than 0.5 of a rank's share whole"
    )
    assert why["dense_adam"].startswith("row: 1000 rows x 16, its optimizer updates every row")
    assert why["hot"] == "row: 50000 rows x 32, hot ids spread (91% of the expected traffic)"
    # The whole tables, busiest first, each to the rank with the least traffic so far.
    assert why["user"] == "table: 200000 rows x 32, on rank 0 (2% of the expected traffic)"
    assert why["country"] == "table: 100 rows x 8, on rank 1 (1% of the expected traffic)"
    assert why["device"] == "table: 10 rows x 4, on rank 1 (0% of the expected traffic)"
    # Equal tables spread whole while they balance; at 64 ranks each is too big a share.
    w1 = [TableLoad(1_000_000, 64, 256 * mb, expected_traffic(64, [1]))] * 8
    assert plan_shards("auto", list("abcdefgh"), [256 * mb] * 8, 2, w1).owners == (0, 1) * 4
    assert set(plan_shards("auto", list("abcdefgh"), [256 * mb] * 8, 64, w1).kinds) == {"row"}
    # "auto" for some tables of a dict; explicit kinds keep their old description.
    mixed = plan_shards(
        {"huge": "auto", "device": "table"}, names, table_bytes, 3, list(loads.values())
    )
    assert mixed.describe(names)["huge"].startswith("row: 10000000 rows x 64")
    assert mixed.describe(names)["device"] == "table on rank 0"
    assert mixed.describe(names)["user"] == "row"
    with pytest.raises(ValueError, match="needs each table's load"):
        plan_shards("auto", names, table_bytes, 2)


# int32 step counters a checkpoint's rows hold, rewritten: the error each restore must give
BAD_COUNTERS = {
    "bad_counter:a/steps:-1": r"table 'a': slot 'steps' of id 1 is -1 ",
    "bad_counter:c/last_hit_step:3": r"table 'c': slot 'last_hit_step' of id 1 is 3 ",
    "bad_counter:k/steps:2147483647": r"table 'k': slot 'steps' of key 2 is 2147483647 ",
}
# What one rank's bad call or argument must make every rank raise (each scenario then steps
# the ranks together, so the next one starts from ranks that agree).
REFUSALS = [
    "lr_mismatch",
    "bad_input",
    "step_mismatch",
    "call_mismatch",
    "midway",
    "midway:apply",
    "midway:contents",
    "midway:save",
    "midway:restore",
    "fill_fails",
    "interrupted",
    "connect_first",
    "save_fails",
    "save_roots",
    "save_write_fails:dense",
    "save_write_fails:keyed",
    "save_write_fails:interrupt",
    "save_write_fails:extra",
    "save_write_fails:commit",
    "save_write_fails:layout",
    "save_write_fails:spec",
    "save_write_fails:renamed",
    "save_args:keep",
    "save_args:keeps",
    "save_args:metadata",
    "save_args:root",
    "save_args:extra",
    "save_args:restore",
    "save_args:boom",
    "bad_gradients",
    "stale_batch",
    "build_fails",
    "layer_refused",
    "restore_other",
    "restore_newest:restore",
    "restore_newest:load",
    "last_step",
    *BAD_COUNTERS,
    "nonfinite",
    "contents_by_name",
    "user_optimizer",
    # and long work between collectives, which must not fail
    "pacer",
    "pacer_raises",
    "slow_hash",
]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory, worker_id) -> Path:
    """The folder of two ranks that ran every scenario of ``REFUSALS``: one process group
    (two interpreters and their kernels loaded once) for the tests that read it, once per
    test run. pytest-xdist's workers share it through the run's base folder: the first to
    come spawns the ranks under a lock, the others wait for it and read the same files
    (each spawned its own before: 48-61 s of two ranks' work, twice, in a fresh clone's
    suite)."""
    import fcntl

    root = tmp_path_factory.getbasetemp()
    if worker_id != "master":  # the run's folder, above each worker's own
        root = root.parent
    out = root / "refusals-shared"
    with open(root / "refusals.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (out / "codes").exists():
            out.mkdir(exist_ok=True)
            (out / "not-a-folder").write_text("a file")  # save_fails: where its folder goes
            codes = spawn(2, out, REFUSALS, limit=300)
            (out / "codes").write_text(" ".join(map(str, codes)))
    codes = [int(c) for c in (out / "codes").read_text().split()]
    assert codes == [0, 0], _logs(out, 2)
    return out


def test_disagreeing_ranks_and_a_bad_input_fail_on_every_rank(refusals):
    tmp_path = refusals
    for rank in range(2):
        _, text = _error_text(tmp_path, "lr_mismatch", rank)
        assert text.startswith("DistributedError"), text
        assert "table 'big' has learning rates [0.1, 0.2]" in text
    # The rank whose id is out of range says which; the other names it.
    _, text = _error_text(tmp_path, "bad_input", 1)
    assert text.startswith("ValueError") and "feature 'a'" in text and "37" in text, text
    _, text = _error_text(tmp_path, "bad_input", 0)
    assert text.startswith("DistributedError") and "failed on ranks [1]" in text, text
    for rank in range(2):
        _, text = _error_text(tmp_path, "step_mismatch", rank)
        assert text.startswith("DistributedError") and "at steps [0, 7]" in text, text
        _, text = _error_text(tmp_path, "call_mismatch", rank)
        assert text.startswith("DistributedError"), text
        assert "rank 0: lookup, rank 1: table_contents" in text, text
    # A save rank 0 cannot start fails on every rank, and the ranks go on together.
    _, text = _error_text(tmp_path, "save_fails", 0)
    assert text.startswith(("NotADirectoryError", "FileExistsError")), text
    _, text = _error_text(tmp_path, "save_fails", 1)
    assert text.startswith(
        "CheckpointError: rank 1: rank 0 could not make the checkpoint's folder"
    ), text


def test_rows_left_unchanged_by_a_nonfinite_update_are_reported_alike_on_every_rank(refusals):
    # A finite gradient whose update overflows: every rank's NonFiniteUpdateError names the
    # rows left alone on every rank (the single engine's ``rows``), and under "skip_row"
    # every rank counts them all, as the single engine does; the tables equal its own.
    import warnings

    feats, weights, grads = worker.global_batch(0)
    features, o = worker.make_features("adagrad")
    want = {}
    for policy in ("error", "skip_row"):
        single = ee.EmbeddingEngine(features, optimizer=o, seed=3, nonfinite_gradients=policy)
        single.lookup(feats, weights)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            try:
                single.apply_gradients(worker.overflow_gradients(grads))
                want[policy] = ("none", {})
            except ee.NonFiniteUpdateError as e:
                want[policy] = (type(e).__name__, e.rows)
        want[policy] += (dict(single.nonfinite_rows_skipped),)
    assert want["error"][0] == "NonFiniteUpdateError" and len(want["error"][1]["big"]) > 1
    assert want["skip_row"][2]["big"] == len(want["error"][1]["big"])
    for rank in range(2):
        got = np.load(refusals / f"nonfinite.rank{rank}.npz")
        for policy, (error, rows, skipped) in want.items():
            assert str(got[f"{policy}/error"]) == error, (rank, policy)
            have = {k.split("/")[2]: got[k] for k in got.files if k.startswith(f"{policy}/rows/")}
            assert have.keys() == rows.keys(), (rank, policy, have, rows)
            for table, ids in rows.items():
                np.testing.assert_array_equal(have[table], ids, err_msg=f"{rank} {table}")
            for table, n in skipped.items():
                assert int(got[f"{policy}/skipped/{table}"]) == n, (rank, policy, table)
        _assert_state(refusals / f"nonfinite.rank{rank}.npz", single.state_dict())


def test_table_contents_of_one_table_is_the_single_engines_and_the_same_one_everywhere(
    refusals,
):
    # table_contents(name), EmbeddingEngine's call, on a ShardedEngine: that table's keys,
    # weights and slots as the single engine gives them; ranks asking for different tables,
    # or one for a table that does not exist, fail on every rank; then they step together.
    features, o = worker.make_features("adam")
    single = ee.EmbeddingEngine(features, optimizer=o, seed=3)
    feats, weights, grads = worker.global_batch(0)
    single.lookup(feats, weights)
    single.apply_gradients(grads)
    for rank in range(2):
        got = np.load(refusals / f"contents_by_name.rank{rank}.npz")
        for table in worker.TABLES:
            want = single.table_contents(table)
            have = {k.split("/", 1)[1] for k in got.files if k.startswith(f"{table}/")}
            assert have == set(want), (table, have, set(want))
            for key, a in want.items():
                np.testing.assert_array_equal(got[f"{table}/{key}"], a, err_msg=f"{table}/{key}")
        other, unknown = str(got["error/other"]), str(got["error/unknown"])
        assert other.startswith("DistributedError") and "rank 0: 'big', rank 1: 'small'" in other
        if rank == 1:
            assert unknown.startswith("KeyError") and "no table named 'nope'" in unknown
        else:
            assert unknown.startswith("DistributedError") and "failed on ranks [1]" in unknown
        assert int(got["step"]) == 2


def test_a_user_optimizer_of_a_sharded_engine_loads_from_its_checkpoint(refusals):
    # A ShardedEngine's spec names an optimizer defined outside embengine (Yogi, in
    # test_user_optimizer.py) by module and qualified name, as the single engine's does:
    # ShardedEngine.load finds the class again, and the loaded engine steps as the original.
    for rank in range(2):
        text = (refusals / f"user_optimizer.rank{rank}.txt").read_text().strip()
        assert text == "test_user_optimizer.Yogi True True", text


def test_a_bad_save_argument_on_any_rank_fails_every_rank_at_once(refusals):
    # keep=0 on one rank made the others wait the process group's timeout, then broke the
    # group; metadata that is not JSON left a temporary folder and the other rank waiting;
    # keeps that differ saved with rank 0's. Each fails every rank at the save's header,
    # nothing written; the ranks then step together.
    tmp_path = refusals
    for rank in range(2):
        seconds, text = _error_text(tmp_path, "save_args:keep", rank)
        first = (
            "ValueError: keep must be an int >= 1 or None, got 0"
            if rank == 1
            else "DistributedError"
        )
        assert text.startswith(f"RuntimeError: {first}"), text
        assert text.strip().endswith("| left=[] | then step=1"), text
        assert seconds < 30, (seconds, text)  # the group's timeout is 60 s
        seconds, text = _error_text(tmp_path, "save_args:metadata", rank)
        assert text.startswith(
            "RuntimeError: TypeError: extra_metadata holds set, which is not JSON"
        ), text
        assert text.strip().endswith("| left=[] | then step=1"), text
        assert seconds < 30, (seconds, text)
        # Valid keeps that differ: only rank 0 prunes, so its keep won silently; now they are
        # compared in the save's header, an error on every rank naming them.
        seconds, text = _error_text(tmp_path, "save_args:keeps", rank)
        assert text.startswith(
            f"RuntimeError: DistributedError: rank {rank}: save at step 0: the ranks pass keep "
            "[None, 1] (ranks 0..1); every rank must pass the same keep="
        ), text
        assert text.strip().endswith("nothing was written | left=[] | then step=1"), text
        assert seconds < 30, (seconds, text)


def test_any_error_on_one_rank_before_a_collective_fails_every_rank_at_once(refusals):
    """A save's root of None or an extra tensor that is not an array, restore(None), and
    features whose reading raises RuntimeError, each on the last rank only: that rank raises
    its error, the other at once (not after the group's 60 s timeout), nothing written; then
    the ranks step together. An independent review found each waiting out the timeout."""
    cases = {
        "save_args:root": "TypeError: the checkpoint root must be a path",
        "save_args:extra": "TypeError: extra_tensors['dense'] must be a NumPy array",
        "save_args:restore": "TypeError: the checkpoint path must be a path",
        "save_args:boom": "RuntimeError: boom",
    }
    tmp_path = refusals
    for name, error in cases.items():
        for rank in range(2):
            seconds, text = _error_text(tmp_path, name, rank)
            first = error if rank == 1 else ("CheckpointError" if "restore" in name else "Distr")
            assert text.startswith(f"RuntimeError: {first}"), (name, text)
            assert "then step=1" in text, (name, text)
            assert seconds < 30, (name, seconds, text)


def test_a_gradient_of_bools_strings_complex_or_nan_on_one_rank_fails_every_rank(refusals):
    """What float32 would cast silently (True as 1.0, "0.5" parsed, the imaginary part dropped)
    is refused as the single engine refuses it (a review found all three trained), and a NaN
    is named with its place; the other rank raises at once; then they step together."""
    tmp_path = refusals
    seconds, text = _error_text(tmp_path, "bad_gradients", 1)
    said = text.removeprefix("RuntimeError: ").strip().split(" | ")
    assert said[:3] == [
        f"TypeError: feature 'a': gradient must be numbers, got {dtype}"
        for dtype in ("bool", "<U32", "complex128")
    ], said
    assert said[3].startswith(
        "NonFiniteGradientError: feature 'a': gradient nan at [2, 1] is not finite"
    ), said
    assert said[4] == "then step=4", said
    seconds, text = _error_text(tmp_path, "bad_gradients", 0)
    said = text.removeprefix("RuntimeError: ").strip().split(" | ")
    for step, error in enumerate(said[:4]):
        assert error.startswith(
            f"DistributedError: rank 0: apply_gradients at step {step} failed on ranks [1]"
        ), said
    assert said[4] == "then step=4", said
    assert seconds < 60, (seconds, text)  # four failures and four steps; the timeout is 60 s


def test_a_batch_looked_up_before_a_restore_is_refused_on_every_rank(refusals):
    """Its gradients are of the tables before the restore (EmbeddingLayer's backward passes
    the batch as batch=): refused as the single engine refuses it, on every rank, nothing
    changed; a review found it applied. The ranks then step together."""
    tmp_path = refusals
    for rank in range(2):
        seconds, text = _error_text(tmp_path, "stale_batch", rank)
        first = (
            "ValueError: rank 1: this batch was looked up before a restore"
            if rank == 1
            else "DistributedError: rank 0: apply_gradients at step 0 failed on ranks [1]"
        )
        assert text.startswith(f"RuntimeError: {first}"), text
        assert text.strip().endswith("| unchanged=True | then step=1"), text
        assert seconds < 30, (seconds, text)


def test_another_call_than_the_update_after_a_training_lookup_fails_on_every_rank(tmp_path):
    # The update right after a training lookup sends its header with its data; a rank making
    # another call then sends its header in a message of the same shape, so every rank raises
    # the disagreement (no process aborts on sizes that differ) and they go on together.
    calls = {"contents": "table_contents", "eval": "lookup(training=False)", "lookup": "lookup"}
    scenarios = [f"after_lookup:{x}" for x in calls]
    codes = spawn(3, tmp_path, scenarios, limit=180)
    assert codes == [0, 0, 0], _logs(tmp_path, 3)
    for x, call in calls.items():
        for rank in range(3):
            _, text = _error_text(tmp_path, f"after_lookup:{x}", rank)
            said = (
                f"RuntimeError: DistributedError: rank {rank} called "
                f"{call if rank == 2 else 'apply_gradients'} while the ranks called: rank 0: "
                f"apply_gradients, rank 1: apply_gradients, rank 2: {call}; every rank must "
                "make the same calls in the same order | then step=1"
            )
            assert text.strip() == said, text


def test_after_a_lookup_failed_midway_every_call_is_refused_at_once_naming_it(refusals):
    """The last rank's training lookup failed between two of its collectives (routing its ids
    raised), so rank 0 waited for its ids until the timeout (3 s). The pending batch was
    forgotten, and the failed rank's update then sent its header (its own error, "needs a
    lookup first") while rank 0 was still in the lookup's exchange: collectives of two calls
    met, and rank 0's update waited for a peer again. Now a lookup that fails past its header
    leaves the engine out of step: every later call raises at once on every rank, naming the
    failure, with no collective and no update of any batch."""

    def outcome(line: str) -> tuple[float, str]:  # "<call>: <seconds> <outcome>"
        seconds, text = line.split(": ", 1)[1].split(" ", 1)
        return float(seconds), text

    said = {r: (refusals / f"midway.rank{r}.txt").read_text().splitlines() for r in range(2)}
    for rank in range(2):
        (seconds, text), *later = map(outcome, said[rank])
        if rank == 1:
            assert text == "RuntimeError: the test's", said
            failed = "RuntimeError: the test's"
        else:
            assert text.startswith("PeerError: rank 0: a collective (lookup ids)"), said
            assert 2.5 < seconds < 15, said  # the 3 s timeout, and the store's 2 s
            failed = "PeerError: rank 0: a collective (lookup ids)"
        for (seconds, text), call in zip(later, ("apply_gradients", "lookup", "save"), strict=True):
            assert seconds < 1.0, said  # no collective
            want = (
                f"DistributedError: rank {rank}: {call} at step 0 refused, nothing changed: this "
                f"engine's lookup at step 0 failed on this rank after every rank had begun it "
                f"({failed}"
            )
            assert text.startswith(want), (want, said)
            assert "Make a new ShardedEngine (ShardedEngine.load of the last checkpoint)" in text


def test_after_an_update_or_contents_call_failed_midway_every_call_is_refused_at_once(refusals):
    """The last rank's update failed after its message (its backend's update of a table
    raised), or its table_contents() between two tables' gathers, while rank 0 waited in the
    call's next collective until the timeout (3 s). The failed rank's next call then sent its
    header into rank 0's pending collective (the update: gloo aborted both processes; the
    contents: rank 0's lookup waited for a peer again). As after a lookup failed midway, the
    call leaves the engine out of step: every later call raises at once on every rank,
    naming the failure, with no collective; an update says its tables may be half
    updated. A save or a restore failing on the last rank past its header (before its first
    collective: the others wait in it until the timeout) shares the mechanism and leaves the
    engine out of step alike (a restore's tables may be half restored: half updated)."""
    cases = {  # case: (the failed call, rank 0's collective, the calls after it)
        "apply": ("apply_gradients", "nonfinite count", ("lookup", "table_contents", "save")),
        "contents": ("table_contents", "contents", ("lookup", "apply_gradients", "save")),
        "save": (
            "save",
            "making the checkpoint's folder (writing its extra tensors)",
            ("lookup", "table_contents", "restore"),
        ),
        "restore": (
            "restore",
            "find the newest checkpoint",
            ("lookup", "table_contents", "save"),
        ),
    }
    for case, (failed_call, collective, later_calls) in cases.items():
        for rank in range(2):
            lines = (refusals / f"midway_{case}.rank{rank}.txt").read_text().splitlines()
            said = dict(line.split(": ", 1) for line in lines)
            seconds, text = said[failed_call].split(" ", 1)
            if rank == 1:
                assert text == "RuntimeError: the test's", (case, lines)
                failed = text
            else:
                failed = f"PeerError: rank 0: a collective ({collective}) with ranks [1] failed"
                assert text.startswith(failed), (case, lines)
                assert 2.5 < float(seconds) < 15, (case, lines)  # the 3 s timeout
            half = "; its tables may be half updated. " if case in ("apply", "restore") else ". "
            for call in later_calls:
                seconds, text = said[call].split(" ", 1)
                assert float(seconds) < 1.0, (case, lines)  # no collective
                want = (
                    f"DistributedError: rank {rank}: {call} at step 0 refused, nothing changed: "
                    f"this engine's {failed_call} at step 0 failed on this rank after every rank "
                    f"had begun it ({failed}"
                )
                assert text.startswith(want), (case, want, lines)
                assert text.endswith(
                    f"{half}Make a new ShardedEngine (ShardedEngine.load of the last checkpoint)"
                ), (case, lines)


def test_an_update_whose_message_fails_to_pack_on_one_rank_fails_every_rank_at_once(refusals):
    """The last rank's update right after its lookup (so it speculates: its header travels
    in its message) failed as it packed the message (its fill_push raised), after every check
    of its input. It raised at once without sending anything, and rank 0 waited for its
    message until the timeout (10 s). Now it sends its header, marked as failed, in a message
    of zeros: rank 0 raises at once naming it and what failed, nothing changed on either
    rank, and the ranks update the pending batch together afterwards."""
    for rank in range(2):
        first, unchanged, step = (refusals / f"fill_fails.rank{rank}.txt").read_text().splitlines()
        seconds, said = first.split(" ", 1)
        if rank == 1:
            assert said == "RuntimeError: the test's", said
        else:
            assert said == (
                "DistributedError: rank 0: apply_gradients at step 1 failed on ranks [1] "
                "(packing their update's message failed, after every check of their input: "
                "see their error); nothing was changed on any rank"
            ), said
            assert float(seconds) < 5.0, said  # the group's timeout is 10 s
        assert unchanged == "unchanged=True", (rank, unchanged)
        assert step == "step=2", (rank, step)


def test_a_new_engines_group_is_made_once_every_rank_is_connected_to_the_store(refusals):
    """A rank's first post connects its client of the store, and the store's host serves
    nothing else while it looks the connection's peer up by name (5 s where the resolver
    loses the query): a new_group made meanwhile at a 3 s timeout failed on both ranks. Rank
    1's first connection took 1.5 s here; rank 0 called new_group only after it (before:
    at once after the meeting)."""
    got = [np.load(refusals / f"connect_first.rank{r}.npz") for r in range(2)]
    assert float(got[0]["new_group"]) >= float(got[1]["connected"])
    assert float(got[1]["new_group"]) >= float(got[1]["connected"])


def test_a_rank_interrupted_before_its_header_fails_every_rank_at_once(refusals):
    """The last rank's checks before the header of a training lookup, then of its update
    right after a lookup (speculating: its header travels in its message), then of that
    update again (header first), raised KeyboardInterrupt. The checks caught Exception only:
    the rank left without sending its header, and rank 0 waited at the header until the
    timeout (10 s). Now it sends its header marked as interrupted and raises its
    KeyboardInterrupt: rank 0 raises at once naming it, nothing changed on either rank, and
    the ranks update the pending batch together afterwards. Then the same in table_contents,
    save and restore, and while building a ShardedEngine (its shards, or load's reading of
    the checkpoint): before, rank 0 waited for the timeout there too."""
    interrupted = (
        "they were interrupted before their header: a KeyboardInterrupt or another "
        "BaseException that is not an Exception: see their error"
    )
    for rank in range(2):
        lines = (refusals / f"interrupted.rank{rank}.txt").read_text().splitlines()
        said = dict(line.split(": ", 1) for line in lines)
        for call in ("lookup", "apply_gradients", "apply_gradients again"):
            seconds, text = said[call].split(" ", 1)
            if rank == 1:
                assert text == "KeyboardInterrupt: the test's", (call, lines)
            else:
                name = call.split()[0]
                assert text == (
                    f"DistributedError: rank 0: {name} at step 1 failed on ranks [1] "
                    f"({interrupted}); nothing was changed on any rank"
                ), (call, lines)
            assert float(seconds) < 5.0, (call, lines)  # the group's timeout is 10 s
        assert said["lookup together"].endswith(" no error"), lines
        assert said["unchanged"] == "True", lines
        assert said["step"] == "2", lines
        # table_contents, save and restore (at their header), ShardedEngine() and load (at
        # the configuration's exchange) alike: they caught Exception only before.
        building = (
            "DistributedError: rank 0: ranks [1] were interrupted while building their "
            "ShardedEngine (a KeyboardInterrupt or another BaseException that is not an "
            "Exception: see their error)"
        )
        for call in ("table_contents", "save", "restore", "ShardedEngine()", "load"):
            seconds, text = said[call].split(" ", 1)
            if rank == 1:
                assert text == "KeyboardInterrupt: the test's", (call, lines)
            elif call in ("ShardedEngine()", "load"):
                assert text == building, (call, lines)
            else:
                assert text == (
                    f"DistributedError: rank 0: {call} at step 2 failed on ranks [1] "
                    f"({interrupted}); nothing was changed on any rank"
                ), (call, lines)
            assert float(seconds) < 5.0, (call, lines)  # the group's timeout is 10 s


@pytest.mark.parametrize(
    ("scenario", "said"),
    [
        # rank 1 killed in an update's exchange
        (
            "kill",
            "PeerError: rank 0: a collective (gradients) with ranks [1] failed: one of them died",
        ),
        # rank 1 dead before the engine is made: new_group meets the ranks through the store
        # and waited for the store's timeout (60 s here); the ranks now meet first in the
        # default group, whose connections report the dead peer at once
        (
            "kill_at_build",
            "PeerError: rank 0: the ranks of the default process group met before the "
            "ShardedEngine's process group is made and one of them failed",
        ),
    ],
    ids=["in_a_step", "before_the_engine"],
)
def test_a_killed_peer_makes_the_other_rank_raise_at_once(tmp_path, scenario, said):
    # The group's timeout is 60 s: an error well before it is the dead connection, not a wait.
    codes = spawn(2, tmp_path, [scenario], limit=120)
    assert codes[1] == 3
    assert codes[0] == 0, _logs(tmp_path, 2)
    seconds, text = _error_text(tmp_path, scenario, 0)
    assert text.startswith(said), text
    # gloo words a dead socket by timing ("Connection reset by peer", "Connection closed by
    # peer", ...): what holds is that it is not the group's timeout and that it came at once.
    assert "gloo says:" in text and "timed out" not in text.lower(), text
    assert seconds < 20, (seconds, text)


def test_a_rank_late_for_the_engine_is_named_by_the_others_at_the_timeout(tmp_path):
    # The default group waits 2 s for a peer here, and the last rank makes its ShardedEngine
    # only once rank 0 has its error. Rank 0's PeerError named no rank ("it died ... or did
    # not answer"); each rank now posts its arrival at the meeting in the store, so rank 0
    # names the late one, within the timeout and the store's 2 s.
    codes = spawn(2, tmp_path, ["late_at_build"], limit=120)
    assert codes == [0, 0], _logs(tmp_path, 2)
    seconds, text = _error_text(tmp_path, "late_at_build", 0)
    assert text.startswith(
        "PeerError: rank 0: the ranks of the default process group met before the "
        "ShardedEngine's process group is made and one of them failed: no answer within the "
        "group's timeout: rank 1 (it has made no call of this engine yet) had not entered it; "
        "gloo says:"
    ), text
    assert "Timed out" in text, text
    assert 1.5 < seconds < 15, (seconds, text)  # 2 s, and at most 2 s more; a loaded host
    _, text = _error_text(tmp_path, "late_at_build", 1)  # rank 0 has gone by then
    assert text.startswith("PeerError: rank 1: the ranks of the default process group"), text


def modelled_bytes(
    step: int, rank: int, world: int, exchanged: dict, value_bytes: int = 4
) -> tuple[int, int]:
    """Bytes rank ``rank`` sends in the lookup and in the update of ``step`` under row
    sharding, each table exchanging what ``exchanged`` says, by the cost model of
    docs/design.md, counted from the global batch (``value_bytes``: a stored weight's bytes,
    which a pulled row's values take). The update follows its lookup, so it speculates: one
    message to each owner, its header and blocks padded to the grid."""
    width = 4 + 2 * len(FEATURES) + 2 * len(worker.TABLES)
    header = 8 * (world - 1) * width
    dims = {t: d for t, d in FEATURES.values()}
    grid = int(np.lcm.reduce([2, *dims.values()]))
    occ = [list(occurrences(step, r, world)) for r in range(world)]
    lookup = header
    rows = {f: np.zeros(world, dtype=np.int64) for f in FEATURES}  # gradient rows per owner
    pushed_to = np.zeros(world, dtype=np.int64)  # occurrences pushed to each owner
    for f, (table, dim) in FEATURES.items():
        remote = [(o, i) for g, o, i in occ[rank] if g == f and i % world != rank]
        for _, d in {(o, i % world) for o, i in remote}:  # (activation row, owner)
            rows[f][d] += 1
        if exchanged[table] == "sums":
            # Occurrences to their owners; partial sums of the rows this rank owns to the
            # other ranks; then only the gradient rows.
            answered = {
                (s, o)
                for s in range(world)
                if s != rank
                for g, o, i in occ[s]
                if g == f and i % world == rank
            }
            lookup += 16 * len(remote) + 4 * dim * len(answered)
        else:
            for _, i in remote:
                pushed_to[i % world] += 1
    for table, dim in dims.items():
        if exchanged[table] == "rows":  # unique ids asked, rows answered
            unique = [{i for f, _, i in occ[r] if FEATURES[f][0] == table} for r in range(world)]
            lookup += 8 * sum(1 for i in unique[rank] if i % world != rank)
            lookup += (
                value_bytes
                * dim
                * sum(1 for s in range(world) if s != rank for i in unique[s] if i % world == rank)
            )
    apply = 0
    for d in range(world):
        if d != rank:
            at = -(-2 * width // grid) * grid  # the header, on the grid
            for f, (_, dim) in FEATURES.items():  # each feature's rows on its own width
                at = -(-at // dim) * dim + rows[f][d] * dim
            at += at % 2 + 4 * pushed_to[d]
            apply += 4 * int(-(-at // grid) * grid)
    return lookup, apply + 8 * (world - 1)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("exchange", EXCHANGES)
def test_bytes_sent_are_the_cost_model(runs, world, exchange):
    out = runs(world)
    for rank in range(world):
        got = np.load(out / f"equal_sgd_row_{exchange}.rank{rank}.npz")
        for step in range(worker.STEPS):
            exchanged = dict(zip(worker.TABLES, got[f"exchanged{step}"].tolist(), strict=True))
            want = modelled_bytes(step, rank, world, exchanged)
            assert tuple(got[f"bytes{step}"]) == want, (rank, step, exchanged)


@pytest.mark.parametrize("world", [2, 3])
def test_an_update_right_after_its_lookup_sends_one_message_and_falls_back_alike(tmp_path, world):
    # Each update right after its training lookup sends its header with its blocks (one
    # all-to-all); a rank updating from another batch makes every rank send again by the
    # headers' sizes; an invalid gradient on one rank fails every rank with nothing changed.
    # Row widths whose grid the gradient rows are views on, and widths past the grid limit.
    # The reference backend pools each "sums" block from that block's arrays alone.
    scenarios = [f"speculate:{w}:{x}" for w in worker.SPEC_DIMS for x in ("rows", "sums")]
    scenarios.append("speculate:views:sums:reference")
    codes = spawn(world, tmp_path, scenarios, limit=240)
    assert codes == [0] * world, _logs(tmp_path, world)
    for name in scenarios:
        which, exchange, *backend = name.split(":")[1:]
        features, o = worker.spec_features(which)
        single = ee.EmbeddingEngine(
            features, optimizer=o, seed=3, backend=backend[0] if backend else "numba"
        )
        acts = []
        for step in range(worker.SPEC_STEPS):
            feats, grads = worker.spec_batch(step, which)
            acts.append(single.lookup(feats))
            single.apply_gradients(grads)
        state = single.state_dict()
        pushed = ["gradient occurrences"] if exchange == "rows" else []
        for rank in range(world):
            got = np.load(tmp_path / f"{name.replace(':', '_')}.rank{rank}.npz")
            lo, hi = rank * worker.SPEC_BATCH // world, (rank + 1) * worker.SPEC_BATCH // world
            for step in range(worker.SPEC_STEPS):
                for k, want in acts[step].items():
                    np.testing.assert_allclose(
                        got[f"act{step}/{k}"], want[lo:hi], rtol=1e-6, atol=1e-7
                    )
            one = ["gradients", "nonfinite count"]
            assert got["purposes0"].tolist() == one, (name, rank)
            assert got["purposes3"].tolist() == one, (name, rank)
            # The fallback: the message, then the headers' sizes (everything pushed).
            assert got["purposes1"].tolist() == [
                "gradient occurrences",
                "gradients",
                "nonfinite count",
            ], (name, rank)
            # The update after a failed one: header first.
            assert got["purposes2"].tolist() == sorted(
                ["header", *pushed, "gradients", "nonfinite count"]
            ), (name, rank)
            error = str(got["error"])
            if rank == world - 1:
                assert error.startswith("ValueError: "), error
            else:
                assert error.startswith(
                    f"DistributedError: rank {rank}: apply_gradients at step 2 failed on "
                    f"ranks [{world - 1}]"
                ), error
            assert bool(got["unchanged"]), (name, rank)
            assert int(got["step"]) == worker.SPEC_STEPS
            for table, arrays in state["tables"].items():
                for key, want in arrays.items():
                    np.testing.assert_array_equal(
                        got[f"table/{table}/{key}"], want, err_msg=f"{name} {table}/{key} {rank}"
                    )


def _assert_state(path: Path, want: dict) -> None:
    got = np.load(path)
    assert int(got["step"]) == want["step"]
    for table, arrays in want["tables"].items():
        for key, a in arrays.items():
            np.testing.assert_array_equal(got[f"table/{table}/{key}"], a, err_msg=f"{table}/{key}")


def test_checkpoints_move_between_world_sizes(tmp_path):
    # Save at 3 ranks (row sharding); restore at 2 (table sharding) and into a plain engine;
    # a plain engine's checkpoint restores at 2. Every run then takes the third step and must
    # end where the uninterrupted single engine ends, bit for bit.
    _, single = single_engine_run(worker.CKPT_OPTIMIZER, 1)
    want = single.state_dict()
    features, o = worker.make_features(worker.CKPT_OPTIMIZER)
    plain = ee.EmbeddingEngine(features, optimizer=o, seed=3)
    for step in range(2):
        feats, weights, grads = worker.global_batch(step)
        plain.lookup(feats, weights)
        plain.apply_gradients(grads)
    plain.save(tmp_path / "ckpt" / "w1")
    env = {"CKPT_ROOT": str(tmp_path / "ckpt")}
    out3, out2 = tmp_path / "w3", tmp_path / "w2"
    codes = spawn(3, out3, ["ckpt_save:w3"], env=env)
    assert codes == [0] * 3, _logs(out3, 3)
    paths = {np.load(out3 / f"ckpt_save_w3.rank{r}.npz")["path"].tobytes() for r in range(3)}
    assert len(paths) == 1  # every rank returns the same checkpoint
    for r in range(3):
        _assert_state(out3 / f"ckpt_save_w3.rank{r}.npz", want)
    # A plain engine loads the 3-rank checkpoint: the same format, by logical row.
    loaded = ee.EmbeddingEngine.load(tmp_path / "ckpt" / "w3")
    assert loaded.step == 2
    feats, weights, grads = worker.global_batch(2)
    loaded.lookup(feats, weights)
    loaded.apply_gradients(grads)
    for table, arrays in want["tables"].items():
        for key, a in arrays.items():
            np.testing.assert_array_equal(loaded.state_dict()["tables"][table][key], a)
    codes = spawn(2, out2, ["ckpt_restore:w3", "ckpt_restore:w1"], env=env)
    assert codes == [0] * 2, _logs(out2, 2)
    for r in range(2):
        _assert_state(out2 / f"ckpt_restore_w3.rank{r}.npz", want)
        _assert_state(out2 / f"ckpt_restore_w1.rank{r}.npz", want)
        # The 3-rank save wrote rank 0's extra data; every restoring rank gets it back.
        got = np.load(out2 / f"ckpt_restore_w3.rank{r}.npz")
        np.testing.assert_array_equal(got["extra/dense"], np.arange(6).reshape(2, 3))
        assert int(got["epoch"]) == 0
        plain_run = np.load(out2 / f"ckpt_restore_w1.rank{r}.npz")
        assert "extra/dense" not in plain_run and int(plain_run["epoch"]) == -1


def test_embedding_layer_on_a_sharded_engine_beside_ddp(tmp_path):
    # The layer's backward is the collective update; DDP's all-reduce runs in the default
    # group meanwhile. The loss hands each activation its worker gradient exactly.
    _, single = single_engine_run("adagrad", 2)
    codes = spawn(2, tmp_path, ["layer"])
    assert codes == [0, 0], _logs(tmp_path, 2)
    for r in range(2):
        _assert_state(tmp_path / f"layer.rank{r}.npz", single.state_dict())


def test_a_rank_that_cannot_build_its_engine_fails_every_rank_at_once(refusals):
    """An invalid argument (checked before the group existed) or a checkpoint that ShardedEngine
    .load cannot read, on the last rank only: the others waited for it in new_group until the
    timeout, then a DistStoreError naming nothing (a review). Now every rank raises at once,
    the failing one its own error; then the ranks build an engine and step together."""
    tmp_path = refusals
    errors = {
        "optimizer": "TypeError: optimizer must be an embengine.optimizers.Optimizer, got 'sgd'",
        "load": "CheckpointError: no complete checkpoint at",
    }
    for rank in range(2):
        *said, step = (tmp_path / f"build_fails.rank{rank}.txt").read_text().splitlines()
        assert step == "step=1", (rank, said, step)
        for line, (case, error) in zip(said, errors.items(), strict=True):
            name, seconds, text = line.split(" ", 2)
            assert name == f"{case}:", line
            want = error if rank == 1 else "DistributedError: rank 0: ranks [1] could not build"
            assert text.startswith(want), line
            assert float(seconds) < 30, line  # the group's timeout is 60 s


def test_ranks_restoring_different_checkpoints_of_one_step_fail_on_every_rank(refusals):
    """Each rank may read its own copy of a checkpoint (equal manifests); checkpoints of the
    same step that differ were restored silently, each rank reading its rows from its own (a
    review): refused on every rank."""
    tmp_path = refusals
    for rank in range(2):
        copies, different = (tmp_path / f"restore_other.rank{rank}.txt").read_text().splitlines()
        assert copies == "copies: restored step 0", copies
        assert different.startswith(
            f"different: CheckpointError: rank {rank}: ranks [1] restored another checkpoint "
            "(of the same step 0) than rank 0"
        ), different


def test_ranks_saving_to_different_folders_fail_on_every_rank(refusals):
    """Every rank wrote its rows into the folder rank 0 made under rank 0's root, whatever
    root it was given, and was told its checkpoint was there (a review: the last rank's own
    folder stayed empty). Now each rank writes under its own root: a rank that does not see
    rank 0's new folder there fails, and so every rank, at once, nothing left behind; the
    ranks then step together. One folder under two spellings (a symbolic link) still saves,
    each rank told the path in its own spelling."""
    tmp_path = refusals
    for rank in range(2):
        other, held, same, step = (tmp_path / f"save_roots.rank{rank}.txt").read_text().splitlines()
        name, seconds, text = other.split(" ", 2)
        assert name == "other:" and float(seconds) < 30, other
        if rank == 1:
            assert text.startswith(
                "CheckpointError: rank 1: the folder rank 0 made for the checkpoint (.tmp-ckpt-"
            ), text
            assert f"is not in this rank's {tmp_path / 'save_roots' / 'rank1'}:" in text, text
        else:
            assert text.startswith(
                "CheckpointError: rank 0: save (its folder) failed on ranks [1] (see their "
                "error); nothing was saved"
            ), text
        assert held == "held: {'link': [], 'rank0': [], 'shared': []}", held
        spelling = "link" if rank == 1 else "shared"
        want = f"saved {tmp_path / 'save_roots' / spelling / 'ckpt-000001-step000000000002'}"
        assert same.split(" ", 2)[2] == want, same
        assert step == "step=2", step


def _save_outcome(out: Path, case: str, rank: int) -> tuple[str, str, str]:
    """What rank ``rank`` recorded of the ``save_write_fails:<case>`` scenario: the save's
    error, what the root then held, the step and save after it; the save must have raised
    well within the group's timeout (60 s)."""
    said, held, then = (out / f"save_write_fails_{case}.rank{rank}.txt").read_text().splitlines()
    seconds, text = said.split(" ", 1)
    assert float(seconds) < 30, (case, rank, said)
    return text, held, then


def test_a_write_failing_on_one_rank_fails_every_ranks_save_at_once(refusals):
    """A write into a checkpoint's file failing on one rank (a full disk) made that rank
    raise its OSError and leave the save, while the others waited for it in the next exchange
    until the timeout: a PeerError naming nobody ("every rank had entered it"), and the group
    broken for every later call (a review). That rank now stops writing but goes on with the
    exchanges, and every rank raises at the end, at once, naming it; nothing is left in the
    root, and the ranks then step and save together. Rows of a dense table, then of a keyed
    one (keyed_checkpoint.write)."""
    tmp_path = refusals
    for case in ("dense", "keyed"):
        for rank in range(2):
            text, held, then = _save_outcome(tmp_path, case, rank)
            if rank == 1:
                want = "OSError: [Errno 28] rank 1: writing the checkpoint's "
                assert text.startswith(want), (case, text)
                want = "(No space left on device); nothing was saved (every rank raises)"
                assert want in text, (case, text)
            else:
                assert text == (
                    "CheckpointError: rank 0: writing the checkpoint failed on ranks [1] (see "
                    "their error); nothing was saved"
                ), (case, text)
            assert held == "held=[]", (case, held)
            assert then == "step=2 ckpt-000001-step000000000002", (case, then)


def test_an_unexpected_error_in_one_ranks_save_fails_every_ranks_save_at_once(refusals):
    """An error a save does not catch on one rank (a KeyboardInterrupt as the last rank writes
    its rows, a MemoryError as rank 0 writes the extra tensors, a RuntimeError as it hashes the
    files to commit them) left that rank's save at once and the others in their next
    collective until the group's timeout (60 s here): a PeerError naming nobody or only a
    late rank, and the group broken. Every rank now learns it where the save's own errors are
    shared (the failed rank's status at the end of the writing, rank 0's name of the
    folder): that rank raises its own error, the others a PeerError naming it and what it
    was doing, at once; nothing is left in the root and the ranks then step and save
    together."""
    tmp_path = refusals
    cases = {  # case: (the failed rank, its error, what the others say it was doing)
        "interrupt": (1, "KeyboardInterrupt", "writing its block of table 'big' of the checkpoint"),
        "extra": (0, "MemoryError", "making the checkpoint's folder (writing its extra tensors)"),
        "commit": (0, "RuntimeError", "committing the checkpoint (hashing its files)"),
    }
    for case, (failed, error, doing) in cases.items():
        for rank in range(2):
            text, held, then = _save_outcome(tmp_path, case, rank)
            if rank == failed:
                assert text == f"{error}: the test's", (case, text)
            else:
                assert text == (
                    f"PeerError: rank {rank}: rank {failed} failed while {doing}, with an error a "
                    "save does not expect (see its own); nothing was saved, and every rank left "
                    "the save together (the engine can go on)"
                ), (case, text)
            assert held == "held=[]", (case, held)
            assert then == "step=2 ckpt-000001-step000000000002", (case, then)


def test_an_error_before_the_saves_folder_is_made_fails_every_ranks_save_at_once(refusals):
    """The last rank's work in a save before its first collectives, after the header: its
    spec (the manifest's configuration), or reading its keyed shard's state to gather every
    rank's keys (``keyed_checkpoint.layout``). Its error left its save at once, rank 0 waited
    in the save's next collective until the group's timeout (60 s), and the ranks' next
    collectives met nothing: both processes failed. Now the spec is made before the header
    (every rank raises there: a DistributedError naming the rank, and saying its error was not
    about its input: it read "their input was invalid" before) and the keys' gathering
    goes on without this rank's keys, every rank learning the error right after it (a
    PeerError naming the rank and the table); nothing is made and the ranks go on."""
    tmp_path = refusals
    cases = {  # case: (the failed rank's error, what the other rank says)
        "spec": (
            "RuntimeError: the test's",
            "DistributedError: rank 0: save at step 1 failed on ranks [1] (an error of theirs "
            "that is not about their input, not a ValueError, TypeError or LookupError: see "
            "their error); nothing was changed on any rank",
        ),
        "layout": (
            "MemoryError: the test's",
            "PeerError: rank 0: rank 1 failed while gathering its keys of table 'k' for the "
            "checkpoint, with an error a save does not expect (see its own); nothing was "
            "saved, and every rank left the save together (the engine can go on)",
        ),
    }
    for case, (own, other) in cases.items():
        for rank in range(2):
            text, held, then = _save_outcome(tmp_path, case, rank)
            assert text == (own if rank == 1 else other), (case, rank, text)
            assert held == "held=no root", (case, held)  # rank 0 made nothing
            assert then == "step=2 ckpt-000001-step000000000002", (case, then)


def test_a_failure_after_the_commit_tells_every_rank_the_checkpoint_is_there(refusals):
    """Rank 0's sync of the root folder after the commit's rename fails (EIO): the checkpoint
    is complete under its name. Rank 0 raised the bare OSError and the other rank was told
    "rank 0 could not commit the checkpoint", as if nothing had been saved. Every rank now
    raises a CheckpointError naming the checkpoint, saying it was committed and what failed
    then, and its ``path`` is that checkpoint (the message alone named it); the ranks go on
    together."""
    tmp_path = refusals
    name = "ckpt-000001-step000000000001"
    for rank in range(2):
        text, held, then = _save_outcome(tmp_path, "renamed", rank)
        root = tmp_path / "save_write_fails_renamed"
        assert text == (
            f"CheckpointError: rank {rank}: the checkpoint {root / name} was committed "
            "(complete: it restores), but rank 0 then failed while syncing the root folder "
            "after the rename (a crash may still lose the name) (OSError: [Errno 5] "
            "Input/output error); every rank left the save together (the engine can go on) "
            f"| path={root / name}"
        ), text
        assert held == f"held=[{name!r}]", held
        assert then == "step=2 ckpt-000002-step000000000002", then


@pytest.mark.parametrize("how", ["restore", "load"])
def test_ranks_restoring_a_folder_of_checkpoints_restore_the_one_rank_0_found(refusals, how):
    """restore(root) or ShardedEngine.load(root) while another job saves into root: each
    rank took the newest it found itself, so a save landing between two ranks' reads (here
    the last rank's, after rank 0 read step 2's) gave them checkpoints of steps 2 and 5,
    refused on every rank (a review; the ranks of a job start at different times, so load's
    reads lie seconds apart). Every rank now restores the newest that rank 0 found."""
    tmp_path = refusals
    for rank in range(2):
        said, step = (tmp_path / f"restore_newest_{how}.rank{rank}.txt").read_text().splitlines()
        want = "restored step 2" + (
            " from ckpt-000001-step000000000002" if how == "restore" else ""
        )
        assert said == want and step == "step=2", (rank, said, step)
    # the other job's checkpoint landed meanwhile
    assert (tmp_path / f"restore_newest_{how}" / "ckpt-000002-step000000000005").is_dir()


def test_a_layer_input_refused_on_one_rank_fails_every_ranks_lookup_at_once(refusals):
    """EmbeddingLayer's forward refuses some inputs before its lookup (learning rates, weights
    beside a PreparedBatch, a meta timestamp); on a ShardedEngine the other ranks were left in
    the lookup's collective until the timeout, then a PeerError (a review). Now every rank
    raises at once, the refusing one its own error; then the ranks step together."""
    tmp_path = refusals
    errors = {
        "rates": "ValueError: learning_rates has 1 values but the engine has 0 dynamic",
        "weights": "ValueError: weights must be given to preprocess(), not with a PreparedBatch",
        "timestamp": "TypeError: timestamp is a meta tensor (device 'meta', shape [], dtype",
    }
    for rank in range(2):
        *said, step = (tmp_path / f"layer_refused.rank{rank}.txt").read_text().splitlines()
        assert step == "step=3", (rank, said, step)
        for at, (line, (case, error)) in enumerate(zip(said, errors.items(), strict=True)):
            name, seconds, text = line.split(" ", 2)
            assert name == f"{case}:", line
            want = error if rank == 1 else f"DistributedError: rank 0: lookup at step {at} failed"
            assert text.startswith(want), line
            assert float(seconds) < 30, line  # the group's timeout is 60 s


def test_ranks_waiting_for_one_ranks_long_work_meet_it_instead_of_timing_out(refusals):
    """Rank 0 hashed for 4 s in a group of 2 s timeout. Paced (``comm.Pacer``: a thread
    meets the others every 0.25 s of its work, they wait in meetings), every rank ends the
    work together; not paced, the waiting rank's next collective timed out, as a ShardedEngine's
    did after rank 0 hashed a checkpoint longer than the timeout (next test)."""
    said = {r: (refusals / f"pacer.rank{r}.txt").read_text().splitlines() for r in range(2)}
    for rank in range(2):
        paced, unpaced, meetings = said[rank]
        name, seconds, outcome = paced.split(" ", 2)
        assert name == "paced=True:" and outcome == "done", said
        assert 3.9 < float(seconds) < 15, said  # everyone waited for the work, nobody longer
        assert int(meetings.split("=")[1]) >= 8, said  # every 0.25 s of 4 s (and the last)
    _, seconds, outcome = said[1][1].split(" ", 2)
    assert outcome.startswith("PeerError: rank 1: a collective (after the work)"), said
    assert float(seconds) < 3.5, said  # the 2 s timeout, not the 4 s of work


def test_a_rank_whose_paced_work_raises_raises_at_once_and_the_others_at_theirs(refusals):
    """Rank 0 hashed for 4 s in a Pacer (a group of 2 s timeout) while rank 1's body raised
    KeyboardInterrupt at once. Rank 1 raises it at once: it met the others until every rank
    was done before, 4 s (the others' work, minutes of hashing in a save), though it does not
    go on with them. Rank 0's meetings fail; it raises at the end of its work, which nothing
    interrupts."""
    seconds, said = (refusals / "pacer_raises.rank1.txt").read_text().split(" ", 1)
    assert said == "KeyboardInterrupt: the test's\n", said
    assert float(seconds) < 2.0, seconds  # not the 4 s of rank 0's work
    seconds, said = (refusals / "pacer_raises.rank0.txt").read_text().split(" ", 1)
    assert said.startswith("PeerError: rank 0: a collective (hashing for the test)"), said
    assert 3.9 < float(seconds) < 15, seconds
    # Each meeting is posted as a call: rank 1 never came to the one that timed out (a post of
    # "done" alone said "every rank had entered it", naming no one).
    late = re.search(
        r"timeout in hashing for the test, meeting (\d+): rank 1 \((it has made no call of "
        r"this engine yet|its last call: hashing for the test, meeting (\d+))\) had not "
        r"entered it",
        said,
    )
    assert late is not None, said
    assert late[3] is None or int(late[3]) == int(late[1]) - 1, said


def test_a_sharded_save_and_restore_outlast_the_timeout_while_they_hash(refusals):
    """A ShardedEngine in a group of 2 s timeout (the test's own: the engine meets as often
    as that group's timeout asks; in a group of 0.5 s it met every 1 s and timed out) whose
    table sharding puts a 256 MiB table on rank 0 (the other rank's next collective of the
    constructor timed out while rank 0 initialised a 512 MiB one, at 0.5 s); a save whose
    files take rank 0 about twice the engine's timeout (2 s) to hash as it commits (an extra
    tensor of 512 MiB at most), then a restore that only the last rank verifies (hashes): every call
    succeeds on every rank. Before, the ranks waiting for rank 0's name of the checkpoint, or
    for the last rank's checks, raised a PeerError (512 MB at a 2 s timeout; at the default
    60 s, a checkpoint of about 9 GB on a host hashing 154 MB/s). Where the host hashes over
    about 256 MB/s or initialises the table within the timeout, the calls end within it and
    this is a test of the calls' pacing, not of its need: the Pacer's own test above is."""
    for rank in range(2):
        head, *calls = (refusals / f"slow_hash.rank{rank}.txt").read_text().splitlines()
        assert [c.split(" ", 2)[0] for c in calls] == ["build:", "save:", "restore:"], calls
        for call in calls:
            assert call.endswith(" done"), (head, calls)


# Where the last rank stops, and what the others say: in the update's collective (the rank
# stopped after its lookup); in a restore, while it checks (hashes) the checkpoint (said as
# "every rank had entered it", naming nobody, until each rank posted its checks' end; the
# others now wait in meetings, comm.Pacer, each posted as a call, the first of which the
# stopped rank never came to).
STOPPED = {
    "hang": (
        "gradients",
        "in apply_gradients at step 0: rank 2 (its last call: lookup at step 0) had not entered it",
    ),
    "hang_restore": (
        "checking the checkpoint (hashing its files)",
        "in checking the checkpoint (hashing its files), meeting 1: rank 2 (its last call: "
        "restore at step 0) had not entered it",
    ),
}


@pytest.mark.parametrize("scenario", list(STOPPED))
def test_a_stopped_peer_makes_the_others_raise_at_the_timeout_naming_it(tmp_path, scenario):
    # The engine's group times out after 3 s here; the stopped rank is killed by rank 0. Each
    # rank posts the call it enters in the default group's store: the others name the late one.
    codes = spawn(3, tmp_path, [scenario], limit=120)
    assert codes == [0, 0, -9], _logs(tmp_path, 3)
    purpose, said = STOPPED[scenario]
    for rank, peers in ((0, "[1, 2]"), (1, "[0, 2]")):
        seconds, text = _error_text(tmp_path, scenario, rank)
        assert text.startswith(
            f"PeerError: rank {rank}: a collective ({purpose}) with ranks "
            f"{peers} failed: no answer within the process group's timeout {said}"
        ), text
        assert "Timed out" in text, text
        assert 2.5 < seconds < 30, (seconds, text)


def test_a_rank_stopped_inside_a_call_makes_the_others_say_every_rank_entered_it(tmp_path):
    # Rank 2 stops inside its update, its message sent: every rank entered the call,
    # so the store cannot name a late one; the others say a rank is stuck or failed inside it.
    codes = spawn(3, tmp_path, ["hang_inside"], limit=120)
    assert codes == [0, 0, -9], _logs(tmp_path, 3)
    for rank in (0, 1):
        seconds, text = _error_text(tmp_path, "hang_inside", rank)
        assert text.startswith(f"PeerError: rank {rank}: a collective ("), text
        assert (
            "no answer within the process group's timeout in apply_gradients at step 0: every "
            "rank had entered it, so one is stuck or failed inside it (see the other ranks' "
            "errors)"
        ) in text, text
        assert 2.5 < seconds < 30, (seconds, text)


def test_a_stopped_rank_0_makes_the_others_raise_saying_its_store_did_not_answer(tmp_path):
    # Rank 0 serves the store the ranks post their calls in: stopped, it cannot say who is
    # behind, and the others say so within the timeout plus the store's 2 s.
    codes = spawn(3, tmp_path, ["hang_first"], limit=120)
    assert codes == [-9, 0, 0], _logs(tmp_path, 3)
    for rank in (1, 2):
        seconds, text = _error_text(tmp_path, "hang_first", rank)
        assert text.startswith(f"PeerError: rank {rank}: a collective (gradients) with ranks"), text
        said = (
            "in apply_gradients at step 0: the store did not answer which rank it is (rank 0 "
            "of the default group serves it"
        )
        assert said in text, text
        assert 2.5 < seconds < 30, (seconds, text)


def test_the_distributed_quickstart_runs_under_torchrun(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("no torchrun beside this interpreter")
    env = {
        **os.environ,
        "PYTHONPATH": str(HERE.parent),
        "NUMBA_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    cmd = [
        str(torchrun),
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(HERE.parent / "examples" / "distributed_quickstart.py"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "2 ranks: every table and slot equals the single engine's" in out.stdout


def test_free_ports_come_from_below_the_ephemeral_range(tmp_path, monkeypatch):
    """A rendezvous port outside the kernel's ephemeral ports: one it picked itself was once
    taken by another connection before the store bound it (EADDRINUSE). Where the ephemeral
    range leaves no room below it, the kernel's pick."""
    import socket

    from embengine.training import ranks

    real_low = ranks._ephemeral_low()

    def ports(ephemeral: str) -> set[int]:
        (tmp_path / "range").write_text(ephemeral)
        monkeypatch.setattr(ranks, "_EPHEMERAL_RANGE", str(tmp_path / "range"))
        got = {free_port() for _ in range(20)}
        for p in got:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", p))
        return got

    assert all(ranks._PORTS_FROM <= p < 32768 for p in ports("32768\t60999\n"))
    assert all(p >= real_low for p in ports("1024\t65535\n"))  # no room: the kernel's pick


@pytest.fixture
def one_rank_group():
    """A real gloo process group of this process alone (destroyed after the test)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_sharded_function_initializer_makes_the_whole_table_in_one_call(one_rank_group):
    """A rank's shard of a table with a TF-style function initializer holds its rows of the
    whole table's values, made in one call, as a single engine's (past the 2^22 values of one
    chunk: 70,000 x 64, a row-id function)."""
    from embengine.distributed import ShardedEngine
    from embengine.initializers import FromFunction

    shapes = []

    def row_ids(shape, dtype):
        shapes.append(tuple(shape))
        return np.repeat(np.arange(shape[0], dtype=np.float32)[:, None], shape[1], axis=1)

    table = ee.TableConfig(70_000, 64, name="t", initializer=FromFunction(row_ids))
    eng = ShardedEngine({"f": ee.FeatureConfig(table)}, optimizer=ee.optimizers.SGD(0.1))
    assert shapes == [(70_000, 64)]
    weights = eng.table_contents()["tables"]["t"]["weights"]
    np.testing.assert_array_equal(weights[:, 0], np.arange(70_000))


def test_sharded_engine_checks_its_arguments_as_the_engine_does(one_rank_group):
    from embengine.distributed import ShardedEngine

    table = ee.TableConfig(10, 4, name="t")
    features = {"f": ee.FeatureConfig(table)}
    with pytest.raises(TypeError, match="optimizer must be an embengine.optimizers.Optimizer"):
        ShardedEngine(features, optimizer="sgd")
    with pytest.raises(
        ValueError, match="table 't' has no optimizer.*pass optimizer= to ShardedEngine"
    ):
        ShardedEngine(features)
    with pytest.raises(ValueError, match="nonfinite_gradients must be one of"):
        ShardedEngine(features, optimizer=ee.optimizers.SGD(0.1), nonfinite_gradients="ignore")
    with pytest.raises(TypeError, match="seed must be an int, got 1.5"):
        ShardedEngine(features, optimizer=ee.optimizers.SGD(0.1), seed=1.5)
    sgd = ee.optimizers.SGD(0.1)
    with pytest.raises(ValueError, match=r"exchange must be one of \('rows', 'sums', 'auto'\)"):
        ShardedEngine(features, optimizer=sgd, exchange="partial")
    with pytest.raises(ValueError, match=r"exchange names unknown tables \['u'\]"):
        ShardedEngine(features, optimizer=sgd, exchange={"u": "rows"})
    with pytest.raises(ValueError, match=r"exchange\['t'\] must be one of"):
        ShardedEngine(features, optimizer=sgd, exchange={"t": "pull"})
    with pytest.raises(TypeError, match="exchange must be a str or a dict"):
        ShardedEngine(features, optimizer=sgd, exchange=["rows"])
    keyed = {
        "k": ee.FeatureConfig(ee.TableConfig(None, 4, name="k", dynamic=ee.DynamicVocabulary()))
    }
    with pytest.raises(ValueError, match="table 'k' is keyed, and a keyed table exchanges rows"):
        ShardedEngine(keyed, optimizer=sgd, exchange={"k": "sums"})
    assert ShardedEngine(keyed, optimizer=sgd, exchange="sums").exchange == {"k": "rows"}
    engine = ShardedEngine(features, optimizer=sgd)
    assert engine.world_size == 1 and engine.plan == {"t": "row"}
    assert engine.exchange == {"t": "auto"}
    # A whole table exchanges sums under "auto" (its ranks send occurrences undeduplicated);
    # asked for by name, "rows" stays.
    assert ShardedEngine(features, optimizer=sgd, sharding="table").exchange == {"t": "sums"}
    whole_rows = ShardedEngine(features, optimizer=sgd, sharding="table", exchange="rows")
    assert whole_rows.exchange == {"t": "rows"}
    assert engine.table_stats()["tables"]["t"]["exchange"] is None  # no lookup yet
    single = ee.EmbeddingEngine(features, optimizer=ee.optimizers.SGD(0.1)).spec()
    assert {k: engine.spec()[k] for k in ("tables", "features")} == {
        k: single[k] for k in ("tables", "features")
    }


def test_an_engine_refuses_to_train_on_a_whole_tables_lookup_batch(one_rank_group):
    """The batch a ShardedEngine's lookup gives back (``lookup_with_batch``) lists a whole
    table's occurrences as they came, each its own "unique" id without update views: its ranks
    send them undeduplicated. An EmbeddingEngine of the same features took it as a
    deduplicated batch (the fingerprints agree) and trained on it: its update read those
    views, and the table's rows the batch had (Adagrad, lazy) stayed as they were; the
    kernels index them unchecked. It may look the batch up for evaluation, not train on it; a
    batch from ``preprocess`` is deduplicated, and the ShardedEngine updates from its own."""
    from embengine.distributed import ShardedEngine

    def features():
        init = ee.initializers.RandomUniform(-0.3, 0.3)
        t = ee.TableConfig(10, 4, name="t", combiner="sum", initializer=init)
        u = ee.TableConfig(6, 2, name="u", combiner="mean", initializer=init)
        return {"a": ee.FeatureConfig(t), "b": ee.FeatureConfig(u)}

    def adagrad():
        return ee.optimizers.Adagrad(0.2)

    ids = {"a": [[1, 1, 2], [1, 3]], "b": [[4], [4, 5]]}
    grads = {"a": np.ones((2, 4), np.float32), "b": np.ones((2, 2), np.float32)}
    sharded = ShardedEngine(
        features(), optimizer=adagrad(), seed=3, sharding="table", exchange={"u": "rows"}
    )
    assert sharded.exchange == {"t": "sums", "u": "rows"}
    acts, batch = sharded.lookup_with_batch(ids)
    single = ee.EmbeddingEngine(features(), optimizer=adagrad(), seed=3)
    looked = single.lookup(batch, training=False)  # evaluation: served
    assert all(looked[k].tobytes() == acts[k].tobytes() for k in ids)
    said = r"feature 'a' undeduplicated \(a ShardedEngine's lookup batch"
    with pytest.raises(ValueError, match=said):
        single.lookup(batch)
    with pytest.raises(ValueError, match=said):
        single.apply_gradients(grads, batch=batch)
    # Nothing changed; its own batch trains it as the ShardedEngine trains from its own.
    single.lookup(sharded.preprocess(ids))
    single.apply_gradients(grads)
    sharded.apply_gradients(grads, batch=batch)
    tables = sharded.table_contents()["tables"]
    for name in ("t", "u"):
        have = tables[name]["weights"]
        assert have.tobytes() == single.embedding_tables[name].tobytes(), name


@pytest.mark.parametrize("sharding", ["row", "table"])
def test_an_evaluation_batch_is_looked_up_and_never_trained_on(one_rank_group, sharding):
    """The batch of an evaluation lookup of features (``lookup_with_batch(..., training=False)``)
    and ``preprocess(..., training=False)``'s: an EmbeddingEngine's is lookup-only, and neither
    its training lookup nor its update takes it. A ShardedEngine's is deduplicated (its lookup
    asks each owner for a unique id once), and its update trained on it (it was a table's
    rows of an evaluation); now both engines look it up, with the same bits, and refuse to
    train on it, nothing changed, so code runs alike on either."""
    from embengine.distributed import ShardedEngine

    def make(cls):
        init = ee.initializers.RandomUniform(-0.3, 0.3)
        t = ee.TableConfig(10, 4, name="t", combiner="sum", initializer=init)
        u = ee.TableConfig(6, 2, name="u", combiner="mean", initializer=init)
        features = {"a": ee.FeatureConfig(t), "b": ee.FeatureConfig(u)}
        extra = {"sharding": sharding} if cls is ShardedEngine else {}
        return cls(features, optimizer=ee.optimizers.Adagrad(0.2), seed=3, **extra)

    ids = {"a": [[1, 1, 2], [1, 3]], "b": [[4], [4, 5]]}
    grads = {"a": np.ones((2, 4), np.float32), "b": np.ones((2, 2), np.float32)}
    sharded, single = make(ShardedEngine), make(ee.EmbeddingEngine)
    before = single.embedding_tables["t"].copy(), single.embedding_tables["u"].copy()
    acts, looked = sharded.lookup_with_batch(ids, training=False)
    batches = {
        "sharded lookup": looked,
        "sharded preprocess": sharded.preprocess(ids, training=False),
        "single lookup": single.lookup_with_batch(ids, training=False)[1],
        "single preprocess": single.preprocess(ids, training=False),
    }
    said = r"built for evaluation \(training=False\)|built with training=False"
    for name, batch in batches.items():
        assert not batch.training, name
        engines = (single,) if name.startswith("single") else (sharded, single)
        for engine in engines:
            got = engine.lookup(batch, training=False)
            assert all(got[k].tobytes() == acts[k].tobytes() for k in ids), (name, engine)
            with pytest.raises(ValueError, match=said):
                engine.lookup(batch)
            with pytest.raises(ValueError, match=said):
                engine.apply_gradients(grads, batch=batch)
    # A batch built for training still trains both, and they stay equal.
    assert sharded.preprocess(ids).training and single.preprocess(ids).training
    tables = sharded.table_contents()["tables"]
    for name, was in zip(("t", "u"), before, strict=True):
        assert tables[name]["weights"].tobytes() == was.tobytes(), name
    sharded.apply_gradients(grads, batch=sharded.lookup_with_batch(ids)[1])
    single.apply_gradients(grads, batch=single.lookup_with_batch(ids)[1])
    tables = sharded.table_contents()["tables"]
    for name in ("t", "u"):
        assert tables[name]["weights"].tobytes() == single.embedding_tables[name].tobytes()
        assert tables[name]["weights"].tobytes() != before[name == "u"].tobytes()


@pytest.mark.parametrize("sharding", ["row", "table"])
def test_a_sharded_engines_preprocessor_builds_its_batches_without_it(one_rank_group, sharding):
    """``ShardedEngine.preprocessor()`` (and an EmbeddingLayer's of a ShardedEngine, which
    raised AttributeError): a Preprocessor that pickles without tables or process group, as
    for a spawned DataLoader worker, and builds the engine's own batches: a training batch
    equal to ``preprocess``'s array for array, looked up to the same bits as the features;
    an evaluation batch deduplicated and marked, looked up, not trained on."""
    import pickle

    import torch  # noqa: F401 (EmbeddingLayer)

    from embengine.distributed import ShardedEngine
    from embengine.preprocessing import Preprocessor
    from embengine.torch import EmbeddingLayer

    init = ee.initializers.RandomUniform(-0.3, 0.3)
    t = ee.TableConfig(10, 4, name="t", combiner="sum", initializer=init)
    u = ee.TableConfig(6, 2, name="u", combiner="mean", initializer=init)
    features = {"a": ee.FeatureConfig(t), "b": ee.FeatureConfig(u, max_sequence_length=2)}
    sharded = ShardedEngine(
        features, optimizer=ee.optimizers.Adagrad(0.2), seed=3, sharding=sharding
    )
    ids = {"a": [[1, 1, 2], [1, 3]], "b": [[4], [4, 5, 5]]}
    sent = pickle.dumps(sharded.preprocessor())
    assert len(sent) < 4096  # configs only
    pre = pickle.loads(sent)
    assert isinstance(EmbeddingLayer(sharded).preprocessor(), Preprocessor)
    mine, theirs = pre(ids), sharded.preprocess(ids)
    assert mine.training and mine.fingerprint == theirs.fingerprint
    for a, b in zip(mine.tables, theirs.tables, strict=True):
        for name in ("unique_ids", "unique_offsets", "unique_segments", "unique_gains"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name
    want = sharded.lookup(ids, training=False)
    got = sharded.lookup(mine)
    assert all(got[k].tobytes() == want[k].tobytes() for k in ids)
    sharded.apply_gradients({k: np.ones_like(v) for k, v in got.items()})
    evaluation = pre(ids, training=False)
    assert evaluation.deduplicated and not evaluation.training
    want = sharded.lookup(ids, training=False)
    got = sharded.lookup(evaluation, training=False)
    assert all(got[k].tobytes() == want[k].tobytes() for k in ids)
    with pytest.raises(ValueError, match=r"built for evaluation \(training=False\)"):
        sharded.lookup(evaluation)


def test_the_updates_batch_arrays_are_reused_from_step_to_step(one_rank_group):
    """A "sums" update builds each table's batch from the occurrences its owner kept, in
    arrays from the engine's block pool: the same blocks every step (fresh arrays faulted their
    pages in every step), and the tables stay the single engine's."""
    from embengine.distributed import ShardedEngine

    def features():
        return {
            f"f{t}": ee.FeatureConfig(ee.TableConfig(500, 8, name=f"t{t}", combiner="sum"))
            for t in range(3)
        }

    sgd = ee.optimizers.SGD(0.1)
    sharded = ShardedEngine(features(), optimizer=sgd, exchange="sums")
    single = ee.EmbeddingEngine(features(), optimizer=sgd)
    rng = np.random.default_rng(0)
    held = []
    for _ in range(5):
        batch = {f"f{t}": rng.integers(0, 500, size=(64, 5)) for t in range(3)}
        for eng in (sharded, single):
            acts = eng.lookup(batch)
            eng.apply_gradients({k: np.ones_like(a) for k, a in acts.items()})
        held.append(sharded._memory.nbytes)
    assert held[1] > 0 and held[1:] == [held[1]] * 4, held  # no new block after the first steps
    tables = sharded.table_contents()["tables"]
    for name in single.table_names:
        want = single.table_contents(name)["weights"]
        assert tables[name]["weights"].tobytes() == want.tobytes()


def test_a_sharded_engine_at_the_last_step_refuses_to_count_past_it(refusals):
    """A checkpoint may hold step 2**63 - 1; one more training step would overflow the
    kernels' int64 step (the single engine refuses it): every rank refuses the training
    lookup and the update, nothing changed, and still serves evaluation lookups."""
    tmp_path = refusals
    for rank in range(2):
        lookup, apply, evaluation, step = (
            (tmp_path / f"last_step.rank{rank}.txt").read_text().splitlines()
        )
        assert lookup.startswith("lookup: ValueError: ") and "2**63 - 1" in lookup, lookup
        assert apply.startswith("apply: ValueError: ") and "2**63 - 1" in apply, apply
        assert evaluation == "eval: ok" and step == f"step={2**63 - 1}", (evaluation, step)


def test_a_sharded_restore_refuses_a_step_counter_out_of_its_range(refusals):
    """A checkpoint whose int32 slot of steps holds a value no training gives (negative, or
    past the checkpoint's step 2) is refused on every rank before any table changes, as a
    single engine's restore refuses it; the sharded restore used to copy it in (the next
    update then NaN, or a wrapped step)."""
    tmp_path = refusals
    for name, match in BAD_COUNTERS.items():
        for rank in range(2):
            said, state = (
                (tmp_path / f"{name.replace(':', '_')}.rank{rank}.txt").read_text().splitlines()
            )
            assert said.startswith("CheckpointError: ") and match in said, (name, rank, said)
            assert "out of range [0, 2] (what " in said, said
            assert state == "unchanged=True step=1", (name, rank, state)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> Path:
    """The folder of one rank that ran the checkpoint scenarios below, in one process."""
    out = tmp_path_factory.mktemp("one_rank")
    codes = spawn(1, out, ["reader_released", "load_pinned"], limit=180)
    assert codes == [0], _logs(out, 1)
    return out


def test_a_failed_sharded_restore_lets_a_save_prune_its_checkpoint(one_rank):
    """A restore holds the checkpoint's read lock (keep=N skips it) until it returns or
    raises: a refused restore whose error the caller keeps no longer keeps it locked."""
    error, kept = (one_rank / "reader_released.rank0.txt").read_text().splitlines()
    assert error == "CheckpointError" and kept == "False", (error, kept)


def test_sharded_load_restores_the_checkpoint_it_read_the_spec_of(one_rank):
    """ShardedEngine.load(root) reads the newest checkpoint's configuration, then restores:
    it restored the newest under root again, another one if a save landed in between."""
    assert (one_rank / "load_pinned.rank0.txt").read_text().split() == ["step=2"]


def test_list_checkpoints_takes_a_str_root(tmp_path):
    from embengine.checkpoint import latest_checkpoint, list_checkpoints

    t = ee.TableConfig(4, 2, name="t", optimizer=ee.optimizers.SGD(0.1))
    eng = ee.EmbeddingEngine({"a": ee.FeatureConfig(t)})
    first = eng.save(tmp_path)
    assert list_checkpoints(str(tmp_path)) == [first] == list_checkpoints(tmp_path)
    assert latest_checkpoint(str(tmp_path)) == first
    assert list_checkpoints(str(tmp_path / "none")) == []
