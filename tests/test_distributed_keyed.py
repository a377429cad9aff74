"""Keyed tables (dynamic vocabularies) in a ShardedEngine, on real gloo process groups: W ranks,
each with its own samples, train exactly as one EmbeddingEngine fed the concatenation of their
batches in rank order: the same admitted keys, rows, slots, expiry and activations.

The ranks are child processes (tests/keyed_dist_worker.py) on 127.0.0.1 with a free port; every
wait has a hard limit (the process group's timeout is 60 s, and the test kills any child still
alive after ``LIMIT`` seconds). Each world size runs all its scenarios in one process group.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from test_distributed import rank_logs  # noqa: E402
from test_distributed import spawn as _spawn  # noqa: E402

import embengine as ee  # noqa: E402
from embengine.distributed import plan_shards  # noqa: E402
from embengine.distributed.sharding import TableLoad, mix64  # noqa: E402
from embengine.kernels import shard_route as sr  # noqa: E402

HERE = Path(__file__).parent
WORKER = HERE / "keyed_dist_worker.py"
LIMIT = 240  # seconds for a whole group of ranks

_spec = importlib.util.spec_from_file_location("keyed_dist_worker", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

OPTIMIZERS = ["sgd", "adagrad", "adam", "ftrl"]
EXPIRY = ["none", "steps", "seconds"]
SCENARIOS = [f"keyed:{o}:{t}:{e}" for o in OPTIMIZERS for t in (1, 2) for e in EXPIRY]
SCENARIOS += ["apply:sgd", "apply:adam"]
# every shard memory-mapped (storage="mmap"), compared as the keyed scenarios
MMAP = "mmap:adam:1:steps"
# max_rows over the shards: evict:<optimizer>:<eviction>:<insert_on>:<threshold>:<expiry>
EVICT = [
    "evict:sgd:lru:lookup:0:none",
    "evict:adam:lfu:lookup:1:none",
    "evict:adagrad:lru:apply:1:none",
    "evict:ftrl:lfu:apply:0:steps",
    # the pending keys' bound (max_pending) is the whole table's too
    "evict:sgd:lru:lookup:1:none:8",
    "evict:adam:lfu:apply:1:none:8",
    # ... without max_rows too
    "evict:adagrad:none:lookup:2:none:6",
    "evict:ftrl:none:apply:1:steps:5",
]
# max_pending lowered below the pending keys, and a restore below them (drive_pending)
PENDING = "pending_edges"
# evaluation lookups between each training lookup and its update, compared as the keyed ones
BETWEEN = ["between:adam:1:seconds", "between:sgd:1:steps:apply"]


def spawn(world: int, out: Path, scenarios: list[str], env: dict | None = None) -> list[int]:
    """test_distributed's ``spawn`` of keyed_dist_worker's ranks (killed after ``LIMIT`` s)."""
    return _spawn(world, out, scenarios, limit=LIMIT, env=env, worker=WORKER)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """World size -> the folder of its ranks' results (spawned on first use)."""
    done: dict[int, Path] = {}

    def get(world: int) -> Path:
        if world not in done:
            single_run(SCENARIOS[0])  # compile (or load) the kernels here, not in W children
            out = tmp_path_factory.mktemp(f"w{world}")
            codes = spawn(world, out, [*SCENARIOS, *EVICT, MMAP, PENDING, *BETWEEN])
            assert codes == [0] * world, rank_logs(out, world)
            done[world] = out
        return done[world]

    return get


def single_run(name: str) -> dict:
    """One EmbeddingEngine on the concatenated batches: the activations of every step, the
    keyed and dense tables after every step, and the closing evaluation lookup."""
    kind, optimizer, *rest = name.split(":")
    if kind == "apply":
        features, o = worker.make_features(optimizer, 1, "none", insert_on="apply")
    else:  # "between": the same stream, without its evaluation lookups
        features, o = worker.make_features(optimizer, int(rest[0]), rest[1], *rest[2:])
    eng = ee.EmbeddingEngine(features, optimizer=o, seed=3)
    out = {}
    for step in range(worker.STEPS):
        feats, weights, grads = worker.global_batch(step)
        for k, v in eng.lookup(feats, weights, timestamp=worker.timestamp(step)).items():
            out[f"act{step}/{k}"] = v
        eng.apply_gradients(grads)
        for table in ("k", "d"):
            for key, a in eng.table_contents(table).items():
                out[f"step{step}/{table}/{key}"] = a
    feats, weights, _ = worker.global_batch(0)
    for k, v in eng.lookup(feats, weights, training=False).items():
        out[f"eval/{k}"] = v
    out["stats"] = eng.table_stats()["k"]["total"]
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", [*SCENARIOS, MMAP])
def test_keyed_sharded_training_equals_one_engine_on_the_concatenated_batch(runs, world, name):
    out = runs(world)
    want = single_run(name)
    ranks = [dict(np.load(out / f"{name.replace(':', '_')}.rank{r}.npz")) for r in range(world)]
    # Tables after every step, gathered on every rank: bit-identical (each row's gradient sums
    # in the single engine's order; admission and expiry decided per key on its owner).
    for got in ranks:
        assert str(got["plan"]).startswith("keyed"), got["plan"]
        for step in range(worker.STEPS):
            for key in (
                "keys",
                "weights",
                *[k.split("/")[-1] for k in want if k.startswith(f"step{step}/k/")],
            ):
                w, g = want[f"step{step}/k/{key}"], got[f"step{step}/k/{key}"]
                assert w.dtype == g.dtype and np.array_equal(w, g), (step, key, w, g)
            # The dense table beside it, by its state_dict layout.
            assert np.array_equal(want[f"step{step}/d/weights"], got[f"step{step}/d/weights"])
    # Activations: each rank's samples, concatenated in rank order, as the single engine's.
    for step in range(worker.STEPS):
        for k in ("a", "s", "c"):
            cat = np.concatenate([got[f"act{step}/{k}"] for got in ranks])
            assert np.array_equal(cat, want[f"act{step}/{k}"]), (step, k)
    # The closing evaluation lookup (each rank its share of step 0's samples): unknown and
    # expired keys look up as zeros, as in the single engine.
    for k in ("a", "s", "c"):
        cat = np.concatenate([got[f"eval/{k}"] for got in ranks])
        assert np.array_equal(cat, want[f"eval/{k}"]), k
    # Every rank holds some keys although every raw key is 0 mod W (the mix spreads them), and
    # the ranks' rows add up to the single table's.
    rows = np.array([[int(got[f"rows{s}"]) for s in range(worker.STEPS)] for got in ranks])
    assert (rows[:, -1] > 0).all(), rows
    assert (rows.sum(axis=0) == [len(want[f"step{s}/k/keys"]) for s in range(worker.STEPS)]).all()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", BETWEEN)
def test_an_evaluation_lookup_between_a_sharded_keyed_lookup_and_its_update_changes_nothing(
    runs, world, name
):
    """Evaluation lookups (held-out keys: new, pending admission, expired; then the step's
    own) between each training lookup and its update, inserting on lookup and on apply: every
    update runs, and every step's tables and activations are the single engine's without the
    evaluation, bit for bit. They used to forget the pending batch on every rank:
    apply_gradients raised "needs a lookup", and batch= that the keys' owners resolved them at
    a lookup whose batch was gone."""
    out = runs(world)
    for r in range(world):
        got = np.load(out / f"{name.replace(':', '_')}.rank{r}.npz")
        errors = {k: str(got[k]) for k in got.files if k.startswith("error")}
        assert not errors, (r, errors)
    test_keyed_sharded_training_equals_one_engine_on_the_concatenated_batch(runs, world, name)


@pytest.mark.parametrize("world", [2, 3])
def test_memory_mapped_shards_live_in_files_per_rank_and_close(runs, world):
    """storage="mmap": each rank's shard of each table in ``{storage_dir}/{table}.rank{r}.f32``
    (one folder for the ranks of a machine), training as in RAM (the equality test above runs
    this scenario too), restored from a checkpoint into the mapped shards; a lookup after one
    rank closed its engine fails on every rank at once (that rank's StorageError, a
    DistributedError naming it elsewhere); closed everywhere, the files' locks are free for
    another engine, which starts from the initial tables."""
    out = runs(world)
    ranks = [dict(np.load(out / f"{MMAP.replace(':', '_')}.rank{r}.npz")) for r in range(world)]
    files = sorted(f"{t}.rank{r}.f32" for t in ("d", "k") for r in range(world))
    feats, weights, _ = worker.global_batch(0)
    features, o = worker.make_features("adam", 1, "steps")
    fresh = ee.EmbeddingEngine(features, optimizer=o, seed=3)
    first = fresh.lookup(feats, weights, training=False)["a"]
    for k in ("a", "s", "c"):  # restored into the mapped shards: the evaluation as before
        for got in ranks:
            assert np.array_equal(got[f"restored/{k}"], got[f"eval/{k}"]), k
    for r, got in enumerate(ranks):
        assert list(got["storage"]) == ["keyed-mmap", "mmap"]
        assert list(got["files"]) == files
        text = str(got["closed"])
        if r == 0:
            assert text.startswith("StorageError: table 'd' is closed") or text.startswith(
                "StorageError: table 'k' is closed"
            ), text
        else:
            assert text.startswith("DistributedError") and "failed on ranks [0]" in text, text
    again = np.concatenate([got["again"] for got in ranks])
    assert np.array_equal(again, first)  # every key new again: zeros, and the dense rows


def single_evict(name: str) -> dict:
    """``single_run`` of an ``evict:`` scenario (step EVICT_REFUSED refused, its error kept)."""
    features, o = worker.evict_features(name)
    eng = ee.EmbeddingEngine(features, optimizer=o, seed=3)
    worker.pending_bound(name, next(p for p in eng._physical if getattr(p, "name", "") == "k"))
    out = {}
    for step in range(worker.EVICT_STEPS):
        feats, weights, grads = worker.evict_batch(step)
        try:
            acts = eng.lookup(feats, weights, timestamp=worker.timestamp(step))
        except ValueError as e:
            out[f"refused{step}"] = str(e)
        else:
            for k, v in acts.items():
                out[f"act{step}/{k}"] = v
            eng.apply_gradients(grads)
        for table in ("k", "d"):
            for key, a in eng.table_contents(table).items():
                out[f"step{step}/{table}/{key}"] = a
        out[f"evicted{step}"] = eng.table_stats()["k"]["total"]["evicted"]
        out[f"forgotten{step}"] = eng.table_stats()["k"]["total"]["forgotten"]
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", EVICT)
def test_max_rows_over_shards_evicts_what_one_table_evicts(runs, world, name):
    """max_rows bounds the whole table: every owner's rows count, and the rows evicted are
    the table's least recently (or often) touched, wherever they live; a step needing more
    than max_rows rows is refused on every rank with the single engine's error, nothing
    changed. So does max_pending (4 * max_rows by default): the pending keys forgotten are
    the table's seen longest ago (each owner once kept its own max_pending, W times the
    table's, and admitted keys the single engine had forgotten), with or without max_rows."""
    out = runs(world)
    want = single_evict(name)
    ranks = [dict(np.load(out / f"{name.replace(':', '_')}.rank{r}.npz")) for r in range(world)]
    steps = range(worker.EVICT_STEPS)
    refused = [s for s in steps if f"refused{s}" in want]
    # Admitting at once, step EVICT_REFUSED needs too many rows (threshold 1 admits fewer).
    assert refused == ([worker.EVICT_REFUSED] if name.split(":")[4] == "0" else []), refused
    last = worker.EVICT_STEPS - 1
    bounded = name.split(":")[2] != "none"
    if not bounded:  # max_pending alone
        assert want[f"forgotten{last}"] >= 10 and want[f"evicted{last}"] == 0, want
    elif len(name.split(":")) > 6:  # max_pending: keys forgotten, fewer admitted and evicted
        assert want[f"forgotten{last}"] >= 10 and want[f"evicted{last}"] >= 3, want
    else:
        assert want[f"evicted{last}"] >= 9, want  # the stream evicts, often
    for got in ranks:
        assert [s for s in steps if f"refused{s}" in got] == refused
        for s in refused:
            assert str(got[f"refused{s}"]) == want[f"refused{s}"]
        for step in steps:
            for key in [k.split("/")[-1] for k in want if k.startswith(f"step{step}/k/")]:
                w, g = want[f"step{step}/k/{key}"], got[f"step{step}/k/{key}"]
                assert w.dtype == g.dtype and np.array_equal(w, g), (step, key, w, g)
            assert not bounded or len(want[f"step{step}/k/keys"]) <= worker.MAX_ROWS
            assert np.array_equal(want[f"step{step}/d/weights"], got[f"step{step}/d/weights"])
    for step in steps:
        if step in refused:
            continue
        for k in ("a", "s", "c"):
            cat = np.concatenate([got[f"act{step}/{k}"] for got in ranks])
            assert np.array_equal(cat, want[f"act{step}/{k}"]), (step, k)
        rows = sum(int(got[f"rows{step}"]) for got in ranks)
        evicted = sum(int(got[f"evicted{step}"]) for got in ranks)
        forgotten = sum(int(got[f"forgotten{step}"]) for got in ranks)
        assert (rows, evicted, forgotten) == (
            len(want[f"step{step}/k/keys"]),
            want[f"evicted{step}"],
            want[f"forgotten{step}"],
        ), step


def single_pending(folder: Path) -> dict:
    """``drive_pending`` on one EmbeddingEngine (its own checkpoint under ``folder``)."""
    from embengine import optimizers as opt

    eng = ee.EmbeddingEngine(worker.pending_features(), optimizer=opt.SGD(0.1), seed=3)
    table = next(p for p in eng._physical if getattr(p, "name", "") == "k")
    out = {}

    def step(bags):
        eng.lookup({"a": bags})
        eng.apply_gradients({"a": np.ones((len(bags), 2), np.float32)})

    def bound(n):
        table.max_pending = n

    def record(tag):
        out[f"{tag}/keys"], out[f"{tag}/weights"] = (
            eng.table_contents("k")[k] for k in ("keys", "weights")
        )
        stats = eng.table_stats()["k"]
        out[f"{tag}/pending"], out[f"{tag}/forgotten"] = (
            stats["pending_keys"],
            stats["total"]["forgotten"],
        )

    worker.drive_pending(step, bound, lambda: eng.save(folder), eng.restore, record)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_max_pending_lowered_or_restored_below_the_pending_keys(runs, world, tmp_path):
    """Past a lowered max_pending, one table forgets pending keys only when a key waits (a
    step of hits forgets nothing), and a restore keeps the table's max_pending newest pending
    keys, not each shard's: the owners once forgot keys at a step of hits, and kept every
    shard's keys at a restore, and then admitted keys one engine had forgotten."""
    out = runs(world)
    want = single_pending(tmp_path / "single")
    assert (want["hits/pending"], want["hits/forgotten"]) == (5, 0), want
    assert len(want["admitted/keys"]) == 6, want
    assert (want["restored/pending"], want["restored/forgotten"]) == (4, 2), want
    assert (len(want["end/keys"]), want["end/pending"]) == (10, 2), want
    ranks = [dict(np.load(out / f"{PENDING}.rank{r}.npz")) for r in range(world)]
    for tag in ("hits", "admitted", "restored", "end"):
        for got in ranks:
            for key in ("keys", "weights"):
                w, g = want[f"{tag}/{key}"], got[f"{tag}/{key}"]
                assert w.dtype == g.dtype and np.array_equal(w, g), (tag, key, w, g)
        for what in ("pending", "forgotten"):
            assert sum(int(got[f"{tag}/{what}"]) for got in ranks) == want[f"{tag}/{what}"], (
                tag,
                what,
            )


def test_the_keyed_batches_hold_what_the_scenarios_need():
    # The hot key in every sample of every rank's "a"; an empty local batch at steps 1 and 2;
    # every raw key 0 mod 2 and mod 3; keys drifting so rows expire; admission by threshold 2
    # leaving keys out at some step.
    for step in range(worker.STEPS):
        feats, _, _ = worker.global_batch(step)
        assert all(worker.HOT in bag for bag in feats["a"])
        keys = np.concatenate([np.array(b, np.int64) for b in feats["a"] + feats["s"]])
        assert (keys % 6 == 0).all()
    assert (worker.POOL < 0).any() and (worker.POOL >> 56 == 6).any()
    for world in (2, 3):
        assert any(lo == hi for lo, hi in worker.split(1, world))
        assert any(lo == hi for lo, hi in worker.split(2, world))
    seen = {int(k) for b in worker.global_batch(0)[0]["a"] for k in b}
    later = {int(k) for b in worker.global_batch(worker.STEPS - 1)[0]["s"] for k in b}
    assert later - seen and seen - later
    one = single_run("keyed:sgd:2:steps")
    assert len(one["step0/k/keys"]) == 0 and len(one[f"step{worker.STEPS - 1}/k/keys"]) > 0
    assert one["stats"]["filtered"] > 0
    for expiry in ("steps", "seconds"):  # rows do expire, either way
        assert single_run(f"keyed:sgd:1:{expiry}")["stats"]["expired"] > 0, expiry
    assert single_run("keyed:sgd:1:none")["stats"]["expired"] == 0


def test_mix64_is_splitmix64_and_the_kernels_own_keys_by_it():
    # splitmix64's finaliser: the known outputs of the generator's first steps from seed 0
    # (state += 0x9E3779B97F4A7C15, then the finaliser) and the same owners in numba.
    golden = 0x9E3779B97F4A7C15
    states = np.array([(golden * k) % 2**64 for k in (1, 2, 3)], dtype=np.uint64).view(np.int64)
    assert mix64(states).tolist() == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    keys = np.concatenate(
        [
            np.arange(-50, 50, dtype=np.int64) * 6,
            worker.POOL,
            [np.iinfo(np.int64).min, np.iinfo(np.int64).max],
        ]
    )
    for world in (1, 2, 3, 7):
        owners = np.empty(len(keys), dtype=np.int64)
        sr.owners_of(keys, sr.KIND_KEYED, -1, world, owners)
        assert (owners == (mix64(keys) % np.uint64(world)).astype(np.int64)).all()
        plan = plan_shards("row", ["k", "d"], [0, 100], world, keyed=[True, False])
        assert (plan.owner_of(0, keys) == owners).all()
        # Keys all 0 mod W spread over every rank (raw keys mod W would all be on rank 0).
        assert set(owners.tolist()) == set(range(world)), world


def test_a_keyed_table_is_keyed_whatever_the_sharding_asks():
    for sharding in ("row", "table", "auto", {"k": "table"}):
        plan = plan_shards(
            sharding,
            ["k", "d"],
            [0, 100],
            2,
            keyed=[True, False],
            loads=[TableLoad(0, 4, 0, 1.0), TableLoad(5, 3, 100, 1.0)],
        )
        assert plan.kinds[0] == "keyed" and plan.owners[0] == -1, plan
        assert plan.describe(["k", "d"])["k"].startswith("keyed"), plan.describe(["k", "d"])


# Two-rank scenarios each test below reads, run in one process group; ckpt_memory last (it
# shrinks the checkpoint chunks for the rest of its process).
TWO_RANKS = [
    "time_mismatch",
    "eval_mismatch",
    "pending_mismatch",
    "apply_time",
    "save_halfway",
    "restore_cut",
    "restore_max_rows",
    "refused_keeps",
    "ckpt_memory",
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """The folder of two ranks that ran ``TWO_RANKS`` (checkpoints under its ckpts/)."""
    out = tmp_path_factory.mktemp("two_ranks")
    codes = spawn(2, out, TWO_RANKS, env={"CKPT_ROOT": str(out / "ckpts")})
    assert codes == [0, 0], rank_logs(out, 2)
    return out


def test_ranks_with_other_timestamps_or_training_flags_fail_on_every_rank(two_ranks):
    tmp_path = two_ranks
    for r in range(2):  # the owners run the rules on a training lookup only: ranks must agree
        text = (tmp_path / f"eval_mismatch.rank{r}.txt").read_text()
        assert text.startswith(f"DistributedError: rank {r} called ") and (
            "rank 0: lookup, rank 1: lookup(training=False)" in text
        ), text
    for r in range(2):
        text = (tmp_path / f"time_mismatch.rank{r}.txt").read_text()
        assert text.startswith("DistributedError") and "timestamps are [1000000, 1000001]" in text
    for r in range(2):  # the table's bound: every rank fails at once (they once hung)
        text = (tmp_path / f"pending_mismatch.rank{r}.txt").read_text()
        assert text.startswith("DistributedError") and (
            f"table 'k' has max_pending [{2**22}, 7] on ranks 0..1" in text
        ), text


def test_an_update_later_in_data_time_moves_every_shards_clock(two_ranks):
    """A keyed table inserting on apply takes its update's data time; a rank owning none of
    the step's keys kept its older time, so a row expired on one shard and not on another,
    against the single engine (a review's reproduction). A step bringing the table no key
    leaves its data time alone, as in the single engine (every shard once took that step's
    update's time, and key 1 expired at the next step)."""
    from embengine import optimizers as opt
    from embengine.distributed.sharding import mix64

    assert [int(mix64(np.array([k]))[0] % 2) for k in (2, 1)] == [0, 1]  # the owners it needs
    tmp_path = two_ranks
    single = ee.EmbeddingEngine(worker.apply_time_features(), optimizer=opt.SGD(0.1), seed=1)
    for step, (b0, b1, lt, at) in enumerate(worker.APPLY_TIME_STEPS):
        single.lookup({"a": b0 + b1}, timestamp=lt)
        single.apply_gradients({"a": np.ones((len(b0 + b1), 2), np.float32)}, timestamp=at)
        keys, weights = single.table_contents("k")["keys"], single.table_contents("k")["weights"]
        for r in range(2):
            got = np.load(tmp_path / f"apply_time.rank{r}.npz")
            assert int(got[f"time{step}"]) == single.table_stats()["k"]["data_time"], (step, r)
            assert np.array_equal(got[f"keys{step}"], keys), (step, r, got[f"keys{step}"], keys)
            assert np.array_equal(got[f"weights{step}"], weights), (step, r)
    # key 2 expired at step 2; key 1 did not at step 4 (step 3 brought no key: its update's
    # data time is not the table's)
    assert single.table_contents("k")["keys"].tolist() == [1]
    assert single.table_stats()["k"]["total"]["expired"] == 1


def test_a_sharded_save_halfway_through_a_keyed_step_is_refused_on_every_rank(two_ranks):
    """As EmbeddingEngine.save: the owners' keyed shards took the lookup's counts and new
    rows, so a checkpoint before the update would hold half a step. Every rank raises,
    nothing is written; after the update the save works."""
    tmp_path = two_ranks
    for r in range(2):
        text = (tmp_path / f"save_halfway.rank{r}.txt").read_text().strip()
        assert text.startswith(
            "ValueError: step 0 has been looked up for training but not applied: keyed "
            "table(s) ['k']"
        ), text
        assert "| left=[] | then ckpt-" in text, text


def test_a_keyed_row_read_failing_on_one_rank_fails_every_ranks_restore(two_ranks):
    """Each rank reads its keyed rows after every check, straight into its new arena: a file
    cut meanwhile within one rank's rows fails that rank's read, its table part new. Every
    rank raises (the others' restore returned as if whole, and they went on training)."""
    tmp_path = two_ranks
    texts = [(tmp_path / f"restore_cut.rank{r}.txt").read_text() for r in range(2)]
    cut = [r for r, t in enumerate(texts) if "ends early" in t]
    assert len(cut) == 1, texts
    other = texts[1 - cut[0]]
    assert other.startswith(
        f"CheckpointError: rank {1 - cut[0]}: restore failed on ranks {cut} while copying rows"
    ), other
    assert "restore again" in other, other


def test_a_sharded_restore_refuses_more_keys_than_the_tables_max_rows(two_ranks):
    """max_rows bounds the whole table. A checkpoint of 10 keys (7 of them owned by rank 0,
    3 by rank 1) into a table of max_rows=7: one engine refuses it; each shard's keys fit, so
    the sharded restore took it, and the next training step evicted the rows past the bound
    (a review). Every rank refuses it now with the single engine's error, nothing changed."""
    from embengine.distributed.sharding import mix64

    keys = np.arange(1, 11, dtype=np.int64)
    assert np.bincount((mix64(keys) % np.uint64(2)).astype(np.int64)).tolist() == [7, 3]
    tmp_path = two_ranks
    for r in range(2):
        said, state = (tmp_path / f"restore_max_rows.rank{r}.txt").read_text().splitlines()
        want = "table 'k'['keys'] holds 10 rows, more than the table's max_rows=7; raise"
        assert said.startswith("CheckpointError: ") and want in said, (r, said)
        assert state == "rows=0 step=0", (r, state)


def test_a_max_rows_refusal_between_a_lookup_and_its_update_keeps_the_pending_batch(two_ranks):
    """A training lookup refused by a keyed table's max_rows, which every rank raises alike
    midway (from the same sums), between the step's lookup and its update: as
    EmbeddingEngine's refused lookup, it changes no table (the keyed shard's state, its
    counters, table_stats' tables) and keeps the pending batch, whose update then runs (the
    dense table's "sums" occurrences kept by the owners too): every step's tables are the
    single engine's on the same calls. The batch was forgotten: the update raised "needs a
    lookup first" on every rank."""
    name = worker.REFUSED_KEEPS
    features, o = worker.evict_features(name)
    single = ee.EmbeddingEngine(features, optimizer=o, seed=3)
    steps = [s for s in range(worker.EVICT_STEPS) if s != worker.EVICT_REFUSED]
    ranks = [dict(np.load(two_ranks / f"refused_keeps.rank{r}.npz")) for r in range(2)]
    for step in steps:
        feats, weights, grads = worker.evict_batch(step)
        acts = single.lookup(feats, weights, timestamp=worker.timestamp(step))
        if step == worker.EVICT_REFUSED - 1:
            refused, refused_weights, _ = worker.evict_batch(worker.EVICT_REFUSED)
            with pytest.raises(ValueError) as e:
                single.lookup(refused, refused_weights, timestamp=worker.timestamp(step + 1))
            assert "max_rows" in str(e.value), e.value
            for got in ranks:
                assert str(got["refused"]) == str(e.value)
                assert got["changed"].tolist() == [], got["changed"]
        single.apply_gradients(grads)
        for k in ("a", "s", "c"):
            cat = np.concatenate([got[f"act{step}/{k}"] for got in ranks])
            assert np.array_equal(cat, acts[k]), (step, k)
        for got in ranks:
            assert f"error{step}" not in got, str(got[f"error{step}"])
            for table in ("k", "d"):
                for key, a in single.table_contents(table).items():
                    if table == "d" and key == "keys":
                        continue  # the dense table gathers by id
                    g = got[f"step{step}/{table}/{key}"]
                    assert a.dtype == g.dtype and np.array_equal(a, g), (step, table, key)


def _ckpt_single(steps) -> ee.EmbeddingEngine:
    features, o = worker.make_features(worker.CKPT, 2, "seconds")
    eng = ee.EmbeddingEngine(features, optimizer=o, seed=3)
    _train_single(eng, steps)
    return eng


def _train_single(eng, steps) -> None:
    for step in steps:
        feats, weights, grads = worker.global_batch(step)
        eng.lookup(feats, weights, timestamp=worker.timestamp(step))
        eng.apply_gradients(grads)


def _assert_end(got: dict, want: ee.EmbeddingEngine, what: str) -> None:
    for table in ("k", "d"):
        for key, a in want.table_contents(table).items():
            if table == "d" and key == "keys":
                continue  # the dense table gathers by id: its rows are 0..V-1
            g = got[f"end/{table}/{key}"]
            assert a.dtype == g.dtype and np.array_equal(a, g), (what, table, key, a, g)


def test_keyed_checkpoints_move_between_world_sizes_and_a_plain_engine(tmp_path):
    # Save at 3 ranks, at 1, and from a plain engine, after 2 steps; restore at 2 and at 1,
    # and into a plain engine; every run continues to the end equal to an uninterrupted one.
    import json

    root = tmp_path / "ckpts"
    # chunks of 64 bytes: a save writes one key a writer a round, in many rounds
    env = {"CKPT_ROOT": str(root), "CKPT_CHUNK": "64"}
    whole = _ckpt_single(range(worker.STEPS))
    plain = _ckpt_single(range(2))
    plain_path = plain.save(root / "plain")
    for world, folder in ((3, "w3"), (1, "w1")):
        out = tmp_path / f"save{world}"
        codes = spawn(world, out, [f"ckpt_save:{folder}"], env=env)
        assert codes == [0] * world, rank_logs(out, world)
        for r in range(world):
            _assert_end(dict(np.load(out / f"ckpt_save_{folder}.rank{r}.npz")), whole, folder)
    # The sharded checkpoints hold what the plain engine's holds (files by key, manifest).
    (w3_path,) = (root / "w3").iterdir()
    plain_manifest = json.loads((plain_path / "manifest.json").read_text())
    w3_manifest = json.loads((w3_path / "manifest.json").read_text())
    assert w3_manifest["tables"][0]["keyed"] == plain_manifest["tables"][0]["keyed"]
    assert w3_manifest["tables"][0]["keyed"]["rows"] > 0
    assert w3_manifest["tables"][0]["keyed"]["pending_keys"] > 0
    # ... in the same bytes: every table's file is the plain engine's, tensor for tensor (the
    # keyed file's tensors once came in another order: data time last)
    for folder in ("w3", "w1"):
        (path,) = (root / folder).iterdir()
        for t in plain_manifest["tables"]:
            got, want = (path / t["file"]).read_bytes(), (plain_path / t["file"]).read_bytes()
            assert got == want, (folder, t["name"])
    loaded = ee.EmbeddingEngine.load(w3_path)
    _, reader = ee.checkpoint.read_checkpoint(plain_path)
    _, sharded = ee.checkpoint.read_checkpoint(w3_path)
    for key in ("keys", "weights", "pending_keys", "pending_earlier", "last_time", "counters"):
        assert np.array_equal(reader.array("k", key), sharded.array("k", key)), key
    _train_single(loaded, range(2, worker.STEPS))
    _assert_end(
        {f"end/{t}/{k}": v for t in ("k", "d") for k, v in loaded.table_contents(t).items()},
        whole,
        "plain from w3",
    )
    for world, folders in ((2, ["w3", "w1", "plain"]), (1, ["w3"])):
        out = tmp_path / f"restore{world}"
        codes = spawn(world, out, [f"ckpt_restore:{f}" for f in folders], env=env)
        assert codes == [0] * world, rank_logs(out, world)
        for folder in folders:
            got = [dict(np.load(out / f"ckpt_restore_{folder}.rank{r}.npz")) for r in range(world)]
            for g in got:
                _assert_end(g, whole, f"{folder} -> {world}")
            total = sum(g["stats"] for g in got)
            want = plain_manifest["tables"][0]["keyed"]["total"]
            assert total.tolist() == [want[k] for k in sorted(want)], (folder, world)


def test_a_keyed_shard_is_saved_and_restored_a_chunk_at_a_time(two_ranks):
    """Each rank gathers the rows it sends the writers a window at a time from its arena, and
    a restore reads its rows straight into the new arena: what a rank allocates is a small
    part of its shard's rows (it used to copy the shard whole, more than once)."""
    tmp_path = two_ranks
    for r in range(2):
        got = dict(np.load(tmp_path / f"ckpt_memory.rank{r}.npz"))
        shard_bytes = int(got["rows"]) * 128 * 4  # weights and accumulators, float32
        assert int(got["rows"]) > 10_000
        # keys (every rank's: 8 bytes a key), their places and metadata are held whole
        assert got["save"] < shard_bytes / 3, (r, got, shard_bytes)
        assert got["restore"] < shard_bytes / 3, (r, got, shard_bytes)
