"""One rank of the keyed-table tests of tests/test_distributed_keyed.py (not a test module).

    python tests/keyed_dist_worker.py RANK WORLD PORT OUTDIR SCENARIO [SCENARIO ...]

joins a gloo process group on 127.0.0.1:PORT and runs each scenario, writing what it saw to
OUTDIR/<scenario>.rank<RANK>.npz (or .txt for an error). The configuration, the global batches
and the gradients are built here (``make_features``, ``global_batch``), so the test can feed one
EmbeddingEngine the concatenation of every rank's batch.

Scenarios:
  keyed:<optimizer>:<threshold>:<expiry>  STEPS training steps on a keyed table (two features,
                              one a sequence) beside a dense one; expiry "none", "steps"
                              (expire_steps=1) or "seconds" (expire_seconds=150, timestamps
                              100 s apart); each rank's activations, and the gathered tables
                              after every step, plus an evaluation lookup at the end
  apply:<optimizer>           as keyed, threshold 1, insert_on="apply"
  between:<optimizer>:<threshold>:<expiry>[:<insert_on>]
                              as keyed, with evaluation lookups of held-out samples (keys
                              new, pending, expired) and of the step's own between each
                              training lookup and its update (step 1 through
                              lookup_with_batch and batch=); each update's error if it raised
  mmap:<optimizer>:<threshold>:<expiry>
                              as keyed, every shard memory-mapped (storage="mmap") in
                              OUTDIR/store; then a save, a step, a restore (the evaluation
                              again), the files' names, a lookup after rank 0 alone closed
                              its engine, another engine on the same folder
  evict:<optimizer>:<eviction>:<insert_on>:<threshold>:<expiry>[:<max_pending>]
                              EVICT_STEPS steps through max_rows=MAX_ROWS (keys from a pool
                              of 24, ``evict_batch``), step EVICT_REFUSED's batch needing
                              more rows than that (its error text saved); as keyed otherwise;
                              with max_pending, the keyed table's (``pending_bound``);
                              eviction "none": no max_rows
  pending_edges               max_pending lowered below the pending keys, then a step of hits
                              only; a save, and a restore with max_pending below its pending
                              keys (``drive_pending``): keys, weights, pending keys, forgotten
  ckpt_save:<folder>          two steps, save, a third step (W ranks)
  ckpt_restore:<folder>       load what another world size saved, the third step
                              ($CKPT_CHUNK: the checkpoints' chunk bytes, so that a save
                              writes in many rounds)
  ckpt_memory                 30,000 keys (dim 64, Adagrad) saved and restored with 64 KiB
                              chunks: tracemalloc's peak of each, and the table's bytes
  time_mismatch               the last rank passes another timestamp
  eval_mismatch               the last rank looks up for evaluation while the others train
  pending_mismatch            the last rank's keyed table has another max_pending
  apply_time                  insert on apply, an update later in data time than its lookup,
                              its keys on one rank (2 ranks), a step bringing it no key:
                              keys, weights and data time every step
  save_halfway                save between a training lookup and its update, then after it
  restore_cut                 a keyed file cut after a restore's checks, in one rank's rows
  restore_max_rows            a plain engine's checkpoint of 10 keys restored where max_rows
                              is 7 (each rank's share of the keys fits, the table does not):
                              each rank's error, its rows and step, in a .txt
  refused_keeps               REFUSED_KEEPS' evict: scenario (table "d" exchanging "sums"),
                              but step EVICT_REFUSED's lookup (refused: max_rows) comes between
                              the training lookup of the step before and its update; the
                              shard's state and table_stats() around it, then every step on
"""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta

import numpy as np

STEPS = 5
BATCH = 7  # global samples per step
# Keys: 64-bit values all = 0 mod 6 (so = 0 mod W for W in 2, 3: raw keys mod W would put every
# key on rank 0), some negative, the slot in the high bits as Monolith's FIDs.
POOL = (np.arange(1, 16, dtype=np.int64) * 6) | (np.int64(6) << np.int64(56))
POOL[3] = -POOL[3]
HOT = int(POOL[0])  # in every sample of feature "a", on every rank
CKPT = "ftrl"


def optimizers():
    from embengine import optimizers as opt

    return {
        "sgd": opt.SGD(0.1),
        "adagrad": opt.Adagrad(0.2),
        "adam": opt.Adam(0.05),
        "ftrl": opt.FTRL(0.2, l1_regularization_strength=0.05, beta=0.5),
    }


def make_features(
    optimizer: str,
    threshold: int,
    expiry: str,
    insert_on: str = "lookup",
    max_rows: int | None = None,
    eviction: str = "lru",
):
    """A keyed table "k" (features "a", bags with weights, and "s", a sequence) and a dense
    table "d" (feature "c")."""
    import embengine as ee

    dyn = ee.DynamicVocabulary(
        occurrence_threshold=threshold,
        expire_steps=1 if expiry == "steps" else None,
        expire_seconds=150 if expiry == "seconds" else None,
        insert_on=insert_on,
        max_rows=max_rows,
        eviction=eviction,
    )
    init = ee.initializers.RandomUniform(-0.3, 0.3)
    # $EE_TEST_DTYPES: "<weights>,<slots>" of both tables (test_distributed_precision.py)
    w, s = os.environ.get("EE_TEST_DTYPES", "float32,float32").split(",")
    dtypes = {"weights_dtype": w, "slots_dtype": s}
    keyed = ee.TableConfig(
        None, 4, name="k", combiner="mean", initializer=init, dynamic=dyn, **dtypes
    )
    dense = ee.TableConfig(5, 3, name="d", combiner="sum", initializer=init, **dtypes)
    features = {
        "a": ee.FeatureConfig(keyed),
        "s": ee.FeatureConfig(keyed, max_sequence_length=3),
        "c": ee.FeatureConfig(dense),
    }
    return features, optimizers()[optimizer]


def timestamp(step: int) -> int:
    return 1_000_000 + 100 * step


def split(step: int, world: int) -> list[tuple[int, int]]:
    """Each rank's samples [lo, hi) of the global batch: step 1 leaves the last rank empty,
    step 2 the first."""
    if world == 1:
        return [(0, BATCH)]
    sizes = [BATCH // world] * world
    sizes[0] += BATCH - sum(sizes)
    if step == 1:
        sizes[0] += sizes[-1]
        sizes[-1] = 0
    elif step == 2:
        sizes[-1] += sizes[0]
        sizes[0] = 0
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return [(int(bounds[r]), int(bounds[r + 1])) for r in range(world)]


def global_batch(step: int):
    """(features, weights, gradients) of the whole step: keys from a pool that drifts with the
    step (so rows expire), the hot key in every sample of "a", duplicates and empty bags."""
    rng = np.random.default_rng(200 + step)
    pool = POOL[(step % 3) : (step % 3) + 9]
    feats = {}
    feats["a"] = [
        [HOT] + list(map(int, rng.choice(pool, rng.integers(0, 4)))) for _ in range(BATCH)
    ]
    feats["a"][2] = feats["a"][2] + feats["a"][2]  # a key twice in a bag
    feats["s"] = [list(map(int, rng.choice(pool, rng.integers(0, 4)))) for _ in range(BATCH)]
    feats["c"] = [list(map(int, rng.integers(0, 5, rng.integers(0, 3)))) for _ in range(BATCH)]
    weights = {"a": [list(rng.uniform(0.1, 2.0, len(b)).astype(np.float32)) for b in feats["a"]]}
    grads = {
        "a": rng.normal(size=(BATCH, 4)).astype(np.float32),
        "s": rng.normal(size=(BATCH, 3, 4)).astype(np.float32),
        "c": rng.normal(size=(BATCH, 3)).astype(np.float32),
    }
    return feats, weights, grads


EVICT_STEPS = 8
EVICT_REFUSED = 5
MAX_ROWS = 12
# 24 keys, 0 mod 6 as POOL's, some negative, FID-like high bits
EVICT_POOL = (np.arange(1, 25, dtype=np.int64) * 6) | (np.int64(9) << np.int64(56))
EVICT_POOL[[2, 7, 11]] *= -1


def evict_features(name: str):
    """``make_features`` of an ``evict:`` scenario: (features, optimizer); eviction "none":
    no max_rows (the pending keys' bound alone)."""
    _, optimizer, eviction, insert_on, threshold, expiry, *_ = name.split(":")
    if eviction == "none":
        return make_features(optimizer, int(threshold), expiry, insert_on)
    return make_features(
        optimizer, int(threshold), expiry, insert_on, max_rows=MAX_ROWS, eviction=eviction
    )


def pending_bound(name: str, table) -> None:
    """An ``evict:`` scenario's max_pending (its last field, if any) on the keyed table
    ``table`` (a ShardedEngine's shard or an EmbeddingEngine's table): the pending keys of
    the whole table that wait for admission."""
    fields = name.split(":")
    if len(fields) > 6:
        table.max_pending = int(fields[6])


def evict_batch(step: int):
    """(features, weights, gradients) of an ``evict:`` scenario's step: the hot key in every
    sample of "a" and up to 8 keys drawn from EVICT_POOL (so rows are evicted every few
    steps), 14 at step EVICT_REFUSED (with the hot key, more than MAX_ROWS rows)."""
    feats, weights, grads = global_batch(step)
    rng = np.random.default_rng(500 + step)
    some = rng.choice(EVICT_POOL, 14 if step == EVICT_REFUSED else 8, replace=False)
    feats["a"] = [
        [HOT] + list(map(int, rng.choice(some, rng.integers(0, 3)))) for _ in range(BATCH)
    ]
    feats["a"][2] = feats["a"][2] + feats["a"][2]
    feats["s"] = [list(map(int, rng.choice(some, rng.integers(0, 4)))) for _ in range(BATCH)]
    if step == EVICT_REFUSED:
        feats["s"][0] = list(map(int, some[:3]))  # every key of ``some`` in the batch
        feats["s"][1] = list(map(int, some[3:6]))
        feats["s"][3] = list(map(int, some[6:9]))
        feats["s"][4] = list(map(int, some[9:12]))
        feats["s"][5] = list(map(int, some[12:]))
    weights = {"a": [list(rng.uniform(0.1, 2.0, len(b)).astype(np.float32)) for b in feats["a"]]}
    return feats, weights, grads


def local(step: int, rank: int, world: int, batches=None):
    """This rank's share of the step's global batch (``batches``: its maker, global_batch)."""
    feats, weights, grads = (batches or global_batch)(step)
    lo, hi = split(step, world)[rank]
    return (
        {k: v[lo:hi] for k, v in feats.items()},
        {k: v[lo:hi] for k, v in weights.items()},
        {k: v[lo:hi] for k, v in grads.items()},
    )


def contents(eng, prefix: str, saved: dict) -> None:
    got = eng.table_contents()
    for table, arrays in got["tables"].items():
        for key, a in arrays.items():
            saved[f"{prefix}/{table}/{key}"] = a


def run_keyed(rank: int, world: int, out: str, name: str) -> None:
    from embengine.distributed import ShardedEngine

    kind, optimizer, *rest = name.split(":")
    if kind == "apply":
        features, o = make_features(optimizer, 1, "none", insert_on="apply")
    else:
        features, o = make_features(optimizer, int(rest[0]), rest[1], *rest[2:])
    store = os.path.join(out, "store")
    kwargs = {"storage": "mmap", "storage_dir": store} if kind == "mmap" else {}
    eng = ShardedEngine(features, optimizer=o, seed=3, timeout=60, **kwargs)
    saved = {"plan": np.array(eng.plan["k"])}
    for step in range(STEPS):
        feats, weights, grads = local(step, rank, world)
        batch = None
        if kind == "between" and step == 1:
            acts, batch = eng.lookup_with_batch(feats, weights, timestamp=timestamp(step))
        else:
            acts = eng.lookup(feats, weights, timestamp=timestamp(step))
        for k, v in acts.items():
            saved[f"act{step}/{k}"] = v.copy()
        if kind == "between":  # a validation lookup in the middle of the step: read-only
            held, held_weights, _ = local(STEPS + step, rank, world)
            eng.lookup(held, held_weights, training=False)
            eng.lookup(eng.preprocess(feats, weights), training=False)
        try:
            eng.apply_gradients(grads, batch=batch)
        except Exception as e:
            if kind != "between":
                raise
            saved[f"error{step}"] = np.array(f"{type(e).__name__}: {e}")  # on every rank
        contents(eng, f"step{step}", saved)
        saved[f"rows{step}"] = np.array(eng.table_stats()["tables"]["k"]["rows"])
    feats, weights, _ = local(0, rank, world)
    for k, v in eng.lookup(feats, weights, training=False).items():
        saved[f"eval/{k}"] = v
    if kind == "mmap":
        # a checkpoint of mapped shards, restored into them after a step moved them on
        eng.save(os.path.join(out, "ckpt_mmap"))
        local_feats, local_weights, grads = local(STEPS, rank, world)
        eng.lookup(local_feats, local_weights, timestamp=timestamp(STEPS))
        eng.apply_gradients(grads)
        eng.restore(os.path.join(out, "ckpt_mmap"))
        for k, v in eng.lookup(feats, weights, training=False).items():
            saved[f"restored/{k}"] = v
        stats = eng.table_stats()["tables"]
        saved["storage"] = np.array([stats["k"]["storage"], stats["d"]["storage"]])
        saved["files"] = np.array(sorted(os.listdir(store)))
        if rank == 0:
            eng.close()
        try:  # rank 0's shards are closed: every rank raises at the header
            eng.lookup(feats, weights, training=False)
            saved["closed"] = np.array("ok")
        except Exception as e:
            saved["closed"] = np.array(f"{type(e).__name__}: {e}")
        eng.close()
        # the locks are released: another engine takes the same files
        with ShardedEngine(features, optimizer=o, seed=3, timeout=60, **kwargs) as again:
            saved["again"] = again.lookup(feats, weights, training=False)["a"]
    np.savez(os.path.join(out, f"{name.replace(':', '_')}.rank{rank}.npz"), **saved)


# refused_keeps: an evict: scenario admitting at once (so step EVICT_REFUSED is refused)
REFUSED_KEEPS = "evict:adagrad:lru:lookup:0:none"


def run_refused_keeps(rank: int, world: int, out: str, name: str) -> None:
    """``refused_keeps`` (module docstring): the tables after every step, the refusal's text,
    the keyed shard's state entries (and "table_stats") the refusal changed."""
    from embengine.distributed import ShardedEngine

    features, o = evict_features(REFUSED_KEEPS)
    eng = ShardedEngine(features, optimizer=o, seed=3, timeout=60, exchange={"d": "sums"})
    saved = {}
    for step in [s for s in range(EVICT_STEPS) if s != EVICT_REFUSED]:
        feats, weights, grads = local(step, rank, world, evict_batch)
        for k, v in eng.lookup(feats, weights, timestamp=timestamp(step)).items():
            saved[f"act{step}/{k}"] = v
        if step == EVICT_REFUSED - 1:
            # (bytes_sent counts the refused lookup's)
            state, stats = eng.shard("k").state(), eng.table_stats()["tables"]
            refused, refused_weights, _ = local(EVICT_REFUSED, rank, world, evict_batch)
            try:
                eng.lookup(refused, refused_weights, timestamp=timestamp(EVICT_REFUSED))
                saved["refused"] = np.array("no error")
            except ValueError as e:
                saved["refused"] = np.array(str(e))
            after = eng.shard("k").state()
            changed = [k for k in state if np.asarray(after[k]).tobytes() != state[k].tobytes()]
            if eng.table_stats()["tables"] != stats:
                changed.append("table_stats")
            saved["changed"] = np.array(changed, dtype=str)
        try:
            eng.apply_gradients(grads)
        except ValueError as e:
            saved[f"error{step}"] = np.array(str(e))
            continue  # nothing to compare: the test fails on it
        contents(eng, f"step{step}", saved)
    np.savez(os.path.join(out, f"{name}.rank{rank}.npz"), **saved)


def run_evict(rank: int, world: int, out: str, name: str) -> None:
    from embengine.distributed import ShardedEngine

    features, o = evict_features(name)
    eng = ShardedEngine(features, optimizer=o, seed=3, timeout=60)
    pending_bound(name, eng.shard("k"))
    saved = {}
    for step in range(EVICT_STEPS):
        feats, weights, grads = local(step, rank, world, evict_batch)
        try:
            acts = eng.lookup(feats, weights, timestamp=timestamp(step))
        except ValueError as e:  # step EVICT_REFUSED: the batch needs too many rows
            saved[f"refused{step}"] = np.array(str(e))
        else:
            for k, v in acts.items():
                saved[f"act{step}/{k}"] = v
            eng.apply_gradients(grads)
        contents(eng, f"step{step}", saved)
        stats = eng.table_stats()["tables"]["k"]
        saved[f"rows{step}"] = np.array(stats["rows"])
        saved[f"evicted{step}"] = np.array(stats["keyed"]["total"]["evicted"])
        saved[f"forgotten{step}"] = np.array(stats["keyed"]["total"]["forgotten"])
    np.savez(os.path.join(out, f"{name.replace(':', '_')}.rank{rank}.npz"), **saved)


# pending_edges: 12 keys, 0 mod 6 as POOL's, some negative; the first 6, then the last 6
PENDING_POOL = (np.arange(1, 13, dtype=np.int64) * 6) | (np.int64(7) << np.int64(56))
PENDING_POOL[[1, 8]] *= -1


def drive_pending(step, bound, save, restore, record) -> None:
    """pending_edges (threshold 1, no max_rows) on one engine: ``step(bags)`` a training step
    on the global bags (each rank its share), ``bound(n)`` sets max_pending, ``save()`` and
    ``restore(path)``, ``record(tag)`` what the table holds."""
    a = [[int(k)] for k in PENDING_POOL[:6]]
    b = [[int(k)] for k in PENDING_POOL[6:]]
    bound(10)
    step(a)  # 6 keys pending
    step(a[:1])  # one admitted, 5 pending
    bound(2)
    step(a[:1])  # hits only: nothing waits, so nothing is forgotten (5 pending, bound 2)
    record("hits")
    step(a[1:])  # the 5 pending admitted
    record("admitted")
    bound(10)
    step(b)  # 6 more pending
    path = save()
    bound(4)
    restore(path)  # 2 of them forgotten: the table's bound, not each shard's
    record("restored")
    step(b)  # 4 admitted, 2 pending again
    record("end")


def run_pending_edges(rank: int, world: int, out: str, name: str) -> None:
    from embengine import optimizers as opt
    from embengine.distributed import ShardedEngine

    eng = ShardedEngine(pending_features(), optimizer=opt.SGD(0.1), seed=3, timeout=60)
    saved = {}

    def step(bags):
        mine = bags[len(bags) * rank // world : len(bags) * (rank + 1) // world]
        eng.lookup({"a": mine})
        eng.apply_gradients({"a": np.ones((len(mine), 2), np.float32)})

    def bound(n):
        eng.shard("k").max_pending = n

    def record(tag):
        k = eng.table_contents()["tables"]["k"]
        saved[f"{tag}/keys"], saved[f"{tag}/weights"] = k["keys"], k["weights"]
        stats = eng.table_stats()["tables"]["k"]["keyed"]
        saved[f"{tag}/pending"] = np.array(stats["pending_keys"])
        saved[f"{tag}/forgotten"] = np.array(stats["total"]["forgotten"])

    drive_pending(step, bound, lambda: eng.save(os.path.join(out, name)), eng.restore, record)
    np.savez(os.path.join(out, f"{name}.rank{rank}.npz"), **saved)


def pending_features():
    import embengine as ee

    dyn = ee.DynamicVocabulary(occurrence_threshold=1)
    return {"a": ee.FeatureConfig(ee.TableConfig(None, 2, name="k", dynamic=dyn))}


def train(eng, steps, rank: int, world: int) -> None:
    for step in steps:
        feats, weights, grads = local(step, rank, world)
        eng.lookup(feats, weights, timestamp=timestamp(step))
        eng.apply_gradients(grads)


def run_checkpoint(rank: int, world: int, out: str, name: str) -> None:
    """ckpt_save:<folder>: two steps, save, the other steps; ckpt_restore:<folder>: load, the
    other steps. Folders under $CKPT_ROOT."""
    from embengine.distributed import ShardedEngine

    kind, folder = name.split(":")
    root = os.path.join(os.environ["CKPT_ROOT"], folder)
    if "CKPT_CHUNK" in os.environ:
        set_chunk_bytes(int(os.environ["CKPT_CHUNK"]))
    features, o = make_features(CKPT, 2, "seconds")
    if kind == "ckpt_save":
        eng = ShardedEngine(features, optimizer=o, seed=3, timeout=60)
        train(eng, range(2), rank, world)
        eng.save(root)
        saved = {}
    else:
        eng = ShardedEngine.load(root, timeout=60)
        assert eng.step == 2, eng.step
        # The ranks' stats add up to the saved ones: rank 0 holds the counters.
        stats = eng.table_stats()["tables"]["k"]["keyed"]["total"]
        saved = {"stats": np.array([stats[k] for k in sorted(stats)])}
    train(eng, range(2, STEPS), rank, world)
    contents(eng, "end", saved)
    np.savez(os.path.join(out, f"{kind}_{folder}.rank{rank}.npz"), **saved)


def set_chunk_bytes(n: int) -> None:
    """The chunk bytes every checkpoint writer and reader uses (bound at import by some)."""
    from embengine import safetensors_io
    from embengine.distributed import checkpoint as dc
    from embengine.distributed import keyed_checkpoint as kc

    for module in (safetensors_io, kc, dc):
        module.CHUNK_BYTES = n


def run_memory(rank: int, world: int, out: str, name: str) -> None:
    """ckpt_memory: the peak memory a save and a restore of a keyed shard allocate."""
    import tracemalloc

    import embengine as ee
    from embengine import optimizers as opt
    from embengine.distributed import ShardedEngine

    set_chunk_bytes(64 * 1024)
    table = ee.TableConfig(None, 64, name="k", optimizer=opt.Adagrad(0.1), combiner="sum")
    features = {"f": ee.FeatureConfig(table)}
    root = os.path.join(os.environ["CKPT_ROOT"], "memory")
    n = 30_000 // world  # keys a rank sends; rank r's ids are its own
    keys = np.random.default_rng(rank).integers(-(2**62), 2**62, size=(n, 1))
    eng = ShardedEngine(features, seed=3, timeout=60)
    eng.lookup({"f": keys})
    eng.apply_gradients({"f": np.full((n, 64), 0.25, np.float32)})
    peaks = {}
    # Traced from here to the process's end (os._exit): tracemalloc.stop() after the save
    # crashed the rank (SIGSEGV in a thread without a Python frame, 2 runs of 9 on
    # 2026-11-30, not since), so it is never stopped; each phase's peak from reset_peak().
    tracemalloc.start()
    for what in ("save", "restore"):
        if what == "restore":
            eng = ShardedEngine(features, seed=3, timeout=60)
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        if what == "save":
            path = eng.save(root)
        else:
            eng.restore(path)
        peaks[what] = tracemalloc.get_traced_memory()[1] - base
    rows = eng.table_stats()["tables"]["k"]["rows"]
    np.savez(
        os.path.join(out, f"ckpt_memory.rank{rank}.npz"),
        save=peaks["save"],
        restore=peaks["restore"],
        rows=rows,
    )


# apply_time: (rank 0's bags, rank 1's bags, lookup timestamp, update timestamp) per step. Key 2
# lives on rank 0 of 2, key 1 on rank 1 (mix64); the step-1 update is later than its lookup;
# step 3 brings the table no key (its much later update moves no data time), step 4 key 1.
APPLY_TIME_STEPS = (
    ([[2]], [[]], 1000, 1000),
    ([[1]], [[]], 1000, 2000),
    ([[1]], [[]], 1050, 1050),
    ([[]], [[]], 1100, 9000),
    ([[1]], [[]], 1100, 1100),
)


def apply_time_features():
    import embengine as ee

    dyn = ee.DynamicVocabulary(insert_on="apply", expire_seconds=100)
    return {"a": ee.FeatureConfig(ee.TableConfig(None, 2, name="k", dynamic=dyn))}


def run_apply_time(rank: int, world: int, out: str, name: str) -> None:
    """A keyed table inserting on apply, whose update's data time is later than its lookup's
    (2 ranks): each step's keys and data time on this rank."""
    from embengine import optimizers as opt
    from embengine.distributed import ShardedEngine

    eng = ShardedEngine(apply_time_features(), optimizer=opt.SGD(0.1), seed=1, timeout=60)
    saved = {}
    for step, (*bags, lt, at) in enumerate(APPLY_TIME_STEPS):
        mine = bags[rank]
        eng.lookup({"a": mine}, timestamp=lt)
        eng.apply_gradients({"a": np.ones((len(mine), 2), np.float32)}, timestamp=at)
        contents = eng.table_contents()["tables"]["k"]
        saved[f"keys{step}"], saved[f"weights{step}"] = contents["keys"], contents["weights"]
        saved[f"time{step}"] = np.array(eng.table_stats()["tables"]["k"]["keyed"]["data_time"])
    np.savez(os.path.join(out, f"{name}.rank{rank}.npz"), **saved)


def run_save_halfway(rank: int, world: int, out: str, name: str) -> None:
    """save between a training lookup and its update (refused on every rank, nothing
    written), then the update and a save that works."""
    from embengine.distributed import ShardedEngine

    features, o = make_features("sgd", 1, "none")
    eng = ShardedEngine(features, optimizer=o, seed=3, timeout=60)
    feats, weights, grads = local(0, rank, world)
    root = os.path.join(out, "save_halfway")
    eng.lookup(feats, weights, timestamp=timestamp(0))
    try:
        eng.save(root)
        first = "no error"
    except Exception as e:
        first = f"{type(e).__name__}: {e}"
    left = sorted(os.listdir(root)) if os.path.isdir(root) else []
    eng.apply_gradients(grads)
    saved = eng.save(root)
    with open(os.path.join(out, f"{name}.rank{rank}.txt"), "w") as f:
        f.write(f"{first} | left={left} | then {os.path.basename(saved)}\n")


def run_restore_cut(rank: int, world: int, out: str, name: str) -> None:
    """restore_cut: a keyed table's file cut (by another program) after a restore's checks,
    within the last key's row, which one rank reads: what each rank's restore raised."""
    import embengine as ee
    from embengine import optimizers as opt
    from embengine.distributed import ShardedEngine
    from embengine.distributed import keyed_checkpoint as kc

    table = ee.TableConfig(None, 4, name="k", optimizer=opt.SGD(0.1), combiner="sum")
    eng = ShardedEngine({"f": ee.FeatureConfig(table)}, seed=3, timeout=60)
    keys = np.arange(1, 41, dtype=np.int64).reshape(-1, 1) * 1000 + rank
    eng.lookup({"f": keys})
    eng.apply_gradients({"f": np.ones((len(keys), 4), np.float32)})
    path = eng.save(os.path.join(os.environ["CKPT_ROOT"], "cut"))
    read_into = kc._KeptRows.read_into

    def cut_then_read(self, target):  # the weights' last row, read by its owner alone
        if self.src.name == "k" and len(self.keep) and self.keep[-1] == self.src.shape[0] - 1:
            meta, start = self.src.header
            os.truncate(self.src.file, start + meta["k"]["data_offsets"][1] - 4)
        read_into(self, target)

    kc._KeptRows.read_into = cut_then_read
    try:
        eng.restore(path)
        result = "ok"
    except Exception as e:
        result = f"{type(e).__name__}: {e}"
    finally:
        kc._KeptRows.read_into = read_into
    with open(os.path.join(out, f"{name}.rank{rank}.txt"), "w") as f:
        f.write(result + "\n")


def run_restore_max_rows(rank: int, world: int, out: str, name: str) -> None:
    """``restore_max_rows`` (module docstring)."""
    import torch.distributed as dist

    import embengine as ee
    from embengine import optimizers as opt
    from embengine.distributed import ShardedEngine

    def features(max_rows):
        dyn = ee.DynamicVocabulary(max_rows=max_rows)
        table = ee.TableConfig(None, 2, name="k", optimizer=opt.SGD(0.1), dynamic=dyn)
        return {"f": ee.FeatureConfig(table)}

    root = os.path.join(out, name)
    if rank == 0:
        plain = ee.EmbeddingEngine(features(10), seed=3)
        plain.lookup({"f": np.arange(1, 11, dtype=np.int64).reshape(-1, 1)})
        plain.apply_gradients({"f": np.ones((10, 2), np.float32)})
        plain.save(root)
    dist.barrier()
    eng = ShardedEngine(features(7), seed=3, timeout=60)
    try:
        eng.restore(root)
        result = "restored"
    except Exception as e:
        result = f"{type(e).__name__}: {e}"
    rows = eng.table_stats()["tables"]["k"]["rows"]
    with open(os.path.join(out, f"{name}.rank{rank}.txt"), "w") as f:
        f.write(f"{result}\nrows={rows} step={eng.step}\n")


def run_error(rank: int, world: int, out: str, name: str) -> None:
    from embengine.distributed import ShardedEngine

    features, o = make_features("sgd", 1, "seconds")
    feats, weights, _ = local(0, rank, world)
    when = timestamp(0) + (1 if rank == world - 1 else 0)
    try:
        eng = ShardedEngine(features, optimizer=o, seed=3, timeout=60)
        if name == "pending_mismatch" and rank == world - 1:
            eng.shard("k").max_pending = 7
            when -= 1  # the timestamps agree here
        if name == "eval_mismatch":  # the last rank looks up for evaluation, the others train
            last = rank == world - 1
            eng.lookup(feats, weights, training=not last, timestamp=None if last else when - 1)
        eng.lookup(feats, weights, timestamp=when)
        result = "ok"
    except Exception as e:  # the scenario's point: which error, and its message
        result = f"{type(e).__name__}: {e}"
    with open(os.path.join(out, f"{name}.rank{rank}.txt"), "w") as f:
        f.write(result + "\n")


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        for name in sys.argv[5:]:
            if name.startswith(("keyed:", "apply:", "mmap:", "between:")):
                run_keyed(rank, world, out, name)
            elif name.startswith("evict:"):
                run_evict(rank, world, out, name)
            elif name == "ckpt_memory":
                run_memory(rank, world, out, name)
            elif name.startswith("ckpt_"):
                run_checkpoint(rank, world, out, name)
            elif name == "apply_time":
                run_apply_time(rank, world, out, name)
            elif name == "save_halfway":
                run_save_halfway(rank, world, out, name)
            elif name == "restore_cut":
                run_restore_cut(rank, world, out, name)
            elif name == "restore_max_rows":
                run_restore_max_rows(rank, world, out, name)
            elif name == "refused_keeps":
                run_refused_keeps(rank, world, out, name)
            elif name == "pending_edges":
                run_pending_edges(rank, world, out, name)
            else:
                run_error(rank, world, out, name)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    os._exit(0)  # no destroy_process_group: a dead peer would make it wait


if __name__ == "__main__":
    main()
