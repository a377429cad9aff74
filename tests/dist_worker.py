"""One rank of the multi-process tests of tests/test_distributed.py (not a test module).

    python tests/dist_worker.py RANK WORLD PORT OUTDIR SCENARIO [SCENARIO ...]

joins a gloo process group on 127.0.0.1:PORT and runs each scenario, writing what it saw to
OUTDIR/<scenario>.rank<RANK>.npz (or .txt for errors). The configuration, the global batches
and the gradients are built here (``make_features``, ``global_batch``), so the test can feed a
single EmbeddingEngine the concatenation of every rank's batch.

Scenarios:
  equal:<optimizer>:<sharding>:<exchange>[:nan]
                                three training steps; each rank's activations and what each
                                table's lookup exchanged, and on every rank the gathered
                                tables, the bytes sent, the plan, each step's warnings
                                and nonfinite_rows_skipped; with ":nan", a NaN gradient
                                and nonfinite_gradients="skip_row"
  sweep:<optimizer>:<sharding>:<exchange>
                                an optimizer that updates every row (adam_dense, lion_dense)
                                over steps in which some owner gets no id of a table, one
                                table gets none at all, and every rank's batch is empty
                                (``sweep_batch``); the gathered tables at the end
  between:<optimizer>:<sharding>:<exchange>
                                as equal, with evaluation lookups of held-out samples and of
                                the step's own between each training lookup and its update
                                (step 1 through lookup_with_batch and batch=): each update's
                                error if it raised, whether the training activations stayed
                                as they were, the gathered tables
  failed:<optimizer>:<sharding>:<exchange>
                                as equal, with a training lookup between each training lookup
                                and its update that one rank's invalid input (``failing_batch``)
                                makes every rank refuse (step 0 right after the lookup, step 1
                                through lookup_with_batch and batch=, step 2 after an
                                evaluation lookup), then an evaluation lookup of no sample:
                                each refusal, whether the update was armed after it, what
                                table_stats said each table exchanged after the training
                                lookup and before the update, each update's error if it
                                raised, the tables
  whole:<optimizer>             whole tables under exchange "auto" (so "sums", sent
                                undeduplicated): one shared by a weighted sqrtn bag feature,
                                a sequence feature and a plain bag feature; four steps: plain;
                                two training lookups, the older updated first (batch=); the
                                last rank updating from its own equal batch (preprocess); ids
                                in arrays the caller zeroes between lookup and update. Each
                                lookup's activations and the gathered tables
  mixed:<sharding>:<exchange>   three tables of odd widths, each its own 16-bit / float32
                                dtypes, one quantized, Adam with per-row steps; evaluation
                                and training lookups each step, then the gathered tables
  lr_mismatch                   a learning-rate callable that differs by rank
  bad_input                     the last rank passes an id out of range
  ckpt_save:<folder>            two steps, save, a third step (row sharding)
  ckpt_restore:<folder>         load what another world size saved (table sharding), a step
  layer                         EmbeddingLayer on a ShardedEngine, a DDP dense layer beside it
  build_fails                   the last rank's ShardedEngine gets an invalid optimizer, then
                                ShardedEngine.load a folder it cannot read; then a step
  restore_other                 each rank restores a checkpoint of its own folder: copies of
                                one checkpoint, then different ones of the same step
  last_step                     restore a checkpoint at step 2**63 - 1: a training lookup and
                                an update refused on every rank, an evaluation lookup served
  bad_counter:<slot>:<value>    restore a plain engine's checkpoint whose int32 slot (Adam's
                                per-row "steps", a keyed table's too, or FrequencyEstimator's
                                "last_hit_step") of one row was rewritten: the error, and
                                whether the tables changed, in a .txt
  reader_released               a restore refused (another configuration), its error kept:
                                then a save with keep=1 beside it prunes that checkpoint
  load_pinned                   ShardedEngine.load(root) while a newer checkpoint lands in
                                root between its reading the spec and its restore
  layer_refused                 EmbeddingLayer's forward refuses the last rank's input before
                                its lookup (learning rates; weights with a PreparedBatch; a
                                meta timestamp); a step together after each
  save_fails                    save under a path rank 0 cannot create (OUTDIR/not-a-folder
                                must be a file)
  save_write_fails:<dense|keyed|interrupt|extra|commit|layout|spec|renamed>
                                a step (a keyed table beside the three); a save in which every
                                write of the last rank (dense) or its writes into the keyed
                                table's file (keyed) fail (ENOSPC), or the last rank's first
                                write raises KeyboardInterrupt (interrupt), or rank 0's write of
                                the extra tensors raises MemoryError (extra), or its hashing of
                                the files as it commits raises RuntimeError (commit), or the
                                last rank's reading of its keyed shard's state raises
                                MemoryError (layout), or its spec() raises RuntimeError (spec),
                                or rank 0's sync of the root after the commit's rename fails
                                (EIO: renamed); what the root then holds; a step together, then
                                a save that works
  restore_newest:<restore|load> restore(root) (ShardedEngine.load(root)) of a plain engine's
                                checkpoint of step 2, while another job saves one of step 5
                                into root after rank 0 read the newest and before the last
                                rank did: each rank's outcome
  save_roots                    a step; each rank saves under a folder of its own; what each
                                rank's root then holds; a step together; then every rank
                                saves to one folder, the last rank through a symbolic link
  pacer                         in a group of 2 s timeout, rank 0 hashes for 4 s while the
                                others wait: paced (comm.Pacer), then not
  pacer_raises                  in a group of 2 s timeout, rank 0 hashes for 4 s in a Pacer
                                while the last rank's body raises KeyboardInterrupt at once
  slow_hash                     a ShardedEngine (in a group of the test's) whose shards take
                                rank 0 longer than the group's timeout to initialise; a save
                                and a restore whose hashing
                                (a big extra tensor of rank 0's) outlasts it
  save_args:<keep|keeps|metadata|root|extra|restore|boom>
                                save with keep=0, keep=1 (the others None), a root of None or
                                an extra tensor that is a list on the last rank, or
                                extra_metadata that is not JSON on every rank; restore(None)
                                or features that raise RuntimeError on the last rank; then a
                                step together
  step_mismatch                 the last rank is at another step
  bad_gradients                 the last rank's gradient of feature "a" is bool, str, complex,
                                then NaN (a step together after each)
  stale_batch                   save, look up, restore, look up again; the last rank applies
                                the batch of before the restore, the others the new one; then
                                a step together
  call_mismatch                 the last rank calls table_contents, the others lookup
  midway                        exchange "rows", a group of 3 s timeout: the last rank's
                                training lookup fails after the header (routing its ids raises
                                RuntimeError), the others wait for its ids until the timeout;
                                then each rank's update, lookup and save: each outcome and
                                seconds in a .txt
  midway:<apply|contents|save|restore>
                                as midway, but a lookup that works, then the last rank's
                                update fails after the header (its backend's update of a table
                                raises), the others waiting in the update's last collective
                                (apply); or the last rank's table_contents() fails between
                                two tables' gathers (contents); then each rank's lookup,
                                update (contents) or table_contents (apply), and save; or the
                                last rank's save (a save together first, then its restore)
                                fails past its header, before its first collective
                                (checkpoint.save / checkpoint.restore raise), the others
                                waiting in it; then each rank's lookup, table_contents and
                                restore (save) or save (restore)
  fill_fails                    exchange "rows", a group of 10 s timeout: a step, a training
                                lookup, then the last rank's update, right after it (so it
                                speculates), fails as it packs its message (its fill_push
                                raises), after every check of its input: each rank's outcome
                                and seconds, whether the tables stayed as they were, then the
                                update again together (header first)
  interrupted                   exchange "rows", a group of 10 s timeout: a step, then the last
                                rank's checks before the header raise KeyboardInterrupt (its
                                engine's _check_files replaced) in a training lookup, then,
                                after a lookup together, in its update right after it (so it
                                speculates) and in its update again (header first): each
                                call's outcome and seconds, whether the tables stayed as they
                                were, then the update together and the step it reached; then,
                                after a save together, the checks before the header of
                                table_contents, save and restore, and before the
                                configuration's exchange of ShardedEngine() (its _build) and
                                ShardedEngine.load (its read_checkpoint), interrupted alike
  connect_first                 a ShardedEngine whose making finds no client of the store
                                yet (as in a new process), the last rank's first taking 1.5 s
                                (as a store's host answering it after a lost reverse DNS
                                query): when each rank's client was connected and when it
                                called new_group
  kill                          the last rank exits at once; the others time their error
  kill_at_build                 the last rank exits before its ShardedEngine; the others time
                                their error
  late_at_build                 the default group's timeout set to 2 s, the last rank makes
                                its ShardedEngine once the others have their error; each
                                rank's error and its time
  hang                          the last rank stops (SIGSTOP); the others time their error
                                (group timeout 3 s); rank 0 then kills it
  hang_first                    rank 0 (the store's host) stops; rank 1 then kills it
  hang_restore                  a save; the last rank stops (SIGSTOP) while it checks the
                                checkpoint in the restore of it; the others time their error
  contents_by_name              a step, then table_contents(name) of every table; the last rank
                                asking for another table, then for a table that does not exist;
                                then a step together
  nonfinite                     a step whose finite gradients (``overflow_gradients``) make
                                Adagrad's update non-finite: under "error" the error's type and
                                rows, under "skip_row" nonfinite_rows_skipped; the tables
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import numpy as np

STEPS = 3
BATCH = 7  # global samples per step
HOT = 5  # an id of table "big" in every sample of feature "a", on every rank
CKPT_OPTIMIZER = "ftrl"  # two slots
TABLES = ("big", "small", "seq")


class _Boom(dict):
    """Features whose reading raises what no check expects (a user's mapping)."""

    def items(self):
        raise RuntimeError("boom")

    def keys(self):
        raise RuntimeError("boom")

    def __iter__(self):
        raise RuntimeError("boom")


def dtypes() -> dict[str, str]:
    """Every table's ``weights_dtype`` and ``slots_dtype``: $EE_TEST_DTYPES ("<weights>,
    <slots>", set by tests/test_distributed_precision.py; the last rank's
    $EE_TEST_DTYPES_LAST if set), float32 by default."""
    w, s = os.environ.get("EE_TEST_DTYPES", "float32,float32").split(",")
    return {"weights_dtype": w, "slots_dtype": s}


def optimizers():
    from embengine import optimizers as opt

    return {
        "sgd": opt.SGD(0.1),
        "adagrad": opt.Adagrad(0.2),
        "adam": opt.Adam(0.05),
        "adam_dense": opt.Adam(0.05, lazy_adam=False),  # every row, every step
        "ftrl": opt.FTRL(0.2, l1_regularization_strength=0.05, beta=0.5),
        "rowwise_adagrad": None,  # Adagrad(hessian_compression_times=dim), per table
        "sgd_schedule": opt.SGD(lambda step: 0.2 / (1 + step)),
        # Each occurrence its own update, in the single engine's occurrence order.
        "adagrad_no_accumulation": opt.Adagrad(0.2, use_gradient_accumulation=False),
    }


def make_features(optimizer_name: str):
    """Three tables (one shared by two features, one smaller than the world, one of sequence
    features) and the engine-wide optimizer (None when each table has its own)."""
    import embengine as ee
    from embengine import optimizers as opt

    o = optimizers()[optimizer_name]

    def table(vocab, dim, name, combiner):
        own = opt.Adagrad(0.2, hessian_compression_times=dim) if o is None else None
        return ee.TableConfig(
            vocab,
            dim,
            name=name,
            combiner=combiner,
            optimizer=own,
            initializer=ee.initializers.RandomUniform(-0.3, 0.3),
            **dtypes(),
        )

    big = table(37, 8, "big", "mean")
    small = table(2, 4, "small", "sqrtn")
    seq = table(11, 6, "seq", "sum")
    features = {
        "a": ee.FeatureConfig(big),
        "b": ee.FeatureConfig(big),  # shares "big" with "a"
        "c": ee.FeatureConfig(small),
        "s": ee.FeatureConfig(seq, max_sequence_length=3),
    }
    return features, o


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


def global_batch(step: int, nan: bool = False):
    """(features, weights, gradients) of the whole step: bags with duplicates, empty bags,
    weights on "a", the hot id in every sample of "a"; ``nan``: a NaN in the gradient of
    sample 1 of "a" (and so of the hot id) at step 0."""
    rng = np.random.default_rng(100 + step)
    vocab = {"a": 37, "b": 37, "c": 2, "s": 11}
    feats = {}
    for name, n in vocab.items():
        bags = [list(map(int, rng.integers(0, n, rng.integers(0, 5)))) for _ in range(BATCH)]
        if name == "a":
            bags = [b + [HOT] for b in bags]
        if name == "b":
            bags[1] = []
            bags[2] = [3, 3, 3]
        feats[name] = bags
    weights = {"a": [list(rng.uniform(0.1, 2.0, len(b)).astype(np.float32)) for b in feats["a"]]}
    dims = {"a": 8, "b": 8, "c": 4, "s": 6}
    grads = {}
    for name, dim in dims.items():
        shape = (BATCH, 3, dim) if name == "s" else (BATCH, dim)
        grads[name] = rng.normal(size=shape).astype(np.float32)
    if nan and step == 0:
        grads["a"][1, 2] = np.nan
    return feats, weights, grads


def local(step: int, rank: int, world: int, nan: bool = False):
    """This rank's share of the step's global batch."""
    feats, weights, grads = global_batch(step, nan)
    lo, hi = split(step, world)[rank]
    return (
        {k: v[lo:hi] for k, v in feats.items()},
        {k: v[lo:hi] for k, v in weights.items()},
        {k: v[lo:hi] for k, v in grads.items()},
    )


SWEEP_STEPS = 4
SWEEP_BATCH = 6  # global samples per step, split as evenly as the ranks allow


def sweep_features(optimizer_name: str):
    """Two tables ("t": 8 rows, "u": 5 rows) under an optimizer that updates every row."""
    import embengine as ee
    from embengine import optimizers as opt

    o = {
        "adam_dense": opt.Adam(0.05, lazy_adam=False),
        "lion_dense": opt.Lion(0.05, lazy_lion=False),
    }[optimizer_name]
    init = ee.initializers.RandomUniform(-0.3, 0.3)
    t = ee.TableConfig(8, 4, name="t", combiner="sum", initializer=init, **dtypes())
    u = ee.TableConfig(5, 2, name="u", combiner="mean", initializer=init, **dtypes())
    return {"a": ee.FeatureConfig(t), "b": ee.FeatureConfig(u)}, o


def sweep_batch(step: int):
    """(features, gradients) of a whole step: step 0 touches every row; step 1 only even ids
    of "t" and nothing of "u" (an odd-id owner of "t" and every owner of "u" get no id); step
    2 every bag empty; step 3 ids 1 and 3 of "t" and 4 of "u"."""
    rng = np.random.default_rng(50 + step)
    pools = {0: ([0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4]), 1: ([0, 2, 4, 6], []), 2: ([], [])}
    ta, ub = pools.get(step, ([1, 3], [4]))
    feats = {
        "a": [list(map(int, rng.choice(ta, 2))) if ta else [] for _ in range(SWEEP_BATCH)],
        "b": [list(map(int, rng.choice(ub, 2))) if ub else [] for _ in range(SWEEP_BATCH)],
    }
    if step == 0:  # every row at least once
        feats["a"][0], feats["b"][0] = ta, ub
    grads = {
        "a": rng.normal(size=(SWEEP_BATCH, 4)).astype(np.float32),
        "b": rng.normal(size=(SWEEP_BATCH, 2)).astype(np.float32),
    }
    return feats, grads


def run_sweep(rank: int, world: int, out: str, name: str) -> None:
    from embengine.distributed import ShardedEngine

    _, optimizer_name, sharding, exchange = name.split(":")
    features, o = sweep_features(optimizer_name)
    eng = ShardedEngine(
        features, optimizer=o, seed=3, sharding=sharding, timeout=60, exchange=exchange
    )
    lo, hi = rank * SWEEP_BATCH // world, (rank + 1) * SWEEP_BATCH // world
    for step in range(SWEEP_STEPS):
        feats, grads = sweep_batch(step)
        eng.lookup({k: v[lo:hi] for k, v in feats.items()})
        eng.apply_gradients({k: v[lo:hi] for k, v in grads.items()})
    _dump(eng, os.path.join(out, f"{name.replace(':', '_')}.rank{rank}.npz"))


def run_equal(rank: int, world: int, out: str, name: str) -> None:
    from embengine.distributed import ShardedEngine

    _, optimizer_name, sharding, exchange, *nan = name.split(":")
    features, o = make_features(optimizer_name)
    eng = ShardedEngine(
        features,
        optimizer=o,
        seed=3,
        sharding=sharding,
        timeout=60,
        nonfinite_gradients="skip_row" if nan else "error",
        exchange=exchange,
    )
    saved = {}
    for step in range(STEPS):
        feats, weights, grads = local(step, rank, world, nan=bool(nan))
        acts = eng.lookup(feats, weights)
        for k, v in acts.items():
            saved[f"act{step}/{k}"] = v
        tables = eng.table_stats()["tables"]
        saved[f"exchanged{step}"] = np.array([tables[t]["exchange"] for t in TABLES])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            eng.apply_gradients(grads)
        saved[f"warned{step}"] = np.array([str(w.message) for w in caught] or [""])
        saved[f"bytes{step}"] = np.array(
            [
                sum(eng.bytes_sent["lookup"].values()),
                sum(eng.bytes_sent["apply_gradients"].values()),
            ],
            dtype=np.int64,
        )
    stats = eng.table_stats()
    saved["plan"] = np.array([eng.plan[t] for t in TABLES])
    saved["rows"] = np.array([stats["tables"][t]["rows"] for t in TABLES])
    saved["skipped"] = np.array([eng.nonfinite_rows_skipped[t] for t in TABLES])
    last = stats["bytes_sent"]
    saved["stats_bytes"] = np.array(
        [sum(last["lookup"].values()), sum(last["apply_gradients"].values())]
    )
    contents = eng.table_contents()
    saved["step"] = np.array(contents["step"])
    for table, arrays in contents["tables"].items():
        for key, a in arrays.items():
            saved[f"table/{table}/{key}"] = a
    np.savez(os.path.join(out, f"{name.replace(':', '_')}.rank{rank}.npz"), **saved)


def run_between(rank: int, world: int, out: str, name: str) -> None:
    """between:<optimizer>:<sharding>:<exchange> (module docstring): a validation lookup in
    the middle of each step must not change its update."""
    from embengine.distributed import ShardedEngine

    _, optimizer_name, sharding, exchange = name.split(":")
    features, o = make_features(optimizer_name)
    eng = ShardedEngine(
        features, optimizer=o, seed=3, sharding=sharding, timeout=60, exchange=exchange
    )
    saved = {}
    for step in range(STEPS):
        feats, weights, grads = local(step, rank, world)
        batch = None
        if step == 1:
            acts, batch = eng.lookup_with_batch(feats, weights)
        else:
            acts = eng.lookup(feats, weights)
        seen = {k: v.copy() for k, v in acts.items()}
        held, held_weights, _ = local(STEPS + step, rank, world)
        eng.lookup(held, held_weights, training=False)
        eng.lookup(eng.preprocess(feats, weights), training=False)
        saved[f"same{step}"] = np.array(all(np.array_equal(acts[k], seen[k]) for k in acts))
        try:
            eng.apply_gradients(grads, batch=batch)
        except Exception as e:  # every rank raises alike (at the header)
            saved[f"error{step}"] = np.array(f"{type(e).__name__}: {e}")
    _dump(eng, os.path.join(out, f"{name.replace(':', '_')}.rank{rank}.npz"), saved)


WHOLE_STEPS = 4
WHOLE_BATCH = 8


def whole_features(optimizer_name: str):
    """``whole:`` (module docstring): table "m" shared by a weighted sqrtn bag feature "x", a
    sequence feature "y" and a bag feature "z"; table "n" (mean) of weighted "w"."""
    import embengine as ee

    init = ee.initializers.RandomUniform(-0.3, 0.3)
    # (the widths of make_features' tables: their kernels are compiled already)
    m = ee.TableConfig(13, 8, name="m", combiner="sqrtn", initializer=init, **dtypes())
    n = ee.TableConfig(7, 4, name="n", combiner="mean", initializer=init, **dtypes())
    features = {
        "x": ee.FeatureConfig(m),
        "y": ee.FeatureConfig(m, max_sequence_length=2),
        "z": ee.FeatureConfig(m),
        "w": ee.FeatureConfig(n),
    }
    return features, optimizers()[optimizer_name]


def whole_batch(step: int):
    """(features, weights, gradients) of a whole ``whole:`` step: bags of 0-4 ids."""
    rng = np.random.default_rng(700 + step)
    vocab = {"x": 13, "y": 13, "z": 13, "w": 7}
    feats = {
        k: [list(map(int, rng.integers(0, v, rng.integers(0, 5)))) for _ in range(WHOLE_BATCH)]
        for k, v in vocab.items()
    }
    weights = {
        k: [list(rng.uniform(0.1, 2.0, len(b)).astype(np.float32)) for b in feats[k]]
        for k in ("x", "w")
    }
    shapes = {"x": (8,), "y": (2, 8), "z": (8,), "w": (4,)}
    grads = {
        k: rng.normal(size=(WHOLE_BATCH, *shape)).astype(np.float32) for k, shape in shapes.items()
    }
    return feats, weights, grads


def whole_split(step: int, world: int) -> list[tuple[int, int]]:
    """Each rank's samples [lo, hi) of ``whole_batch(step)``: at odd steps the last rank has
    none (its share goes to rank 0)."""
    sizes = [WHOLE_BATCH // world] * world
    sizes[0] += WHOLE_BATCH - sum(sizes)
    if step % 2 and world > 1:
        sizes[0] += sizes[-1]
        sizes[-1] = 0
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return [(int(bounds[r]), int(bounds[r + 1])) for r in range(world)]


def whole_local(step: int, rank: int, world: int):
    """This rank's share of ``whole_batch(step)``."""
    feats, weights, grads = whole_batch(step)
    lo, hi = whole_split(step, world)[rank]
    return (
        {k: v[lo:hi] for k, v in feats.items()},
        {k: v[lo:hi] for k, v in weights.items()},
        {k: v[lo:hi] for k, v in grads.items()},
    )


def run_whole(rank: int, world: int, out: str, name: str) -> None:
    """whole:<optimizer> (module docstring)."""
    import embengine as ee
    from embengine.distributed import ShardedEngine

    features, o = whole_features(name.split(":")[1])
    eng = ShardedEngine(features, optimizer=o, seed=3, sharding="table", timeout=60)
    saved = {"exchange": np.array([eng.exchange[t] for t in ("m", "n")])}
    for step in range(WHOLE_STEPS):
        # held-out samples, looked up for evaluation before the step's training lookup
        held, held_weights, _ = whole_local(2 * WHOLE_STEPS + step, rank, world)
        saved.update(
            {
                f"eval{step}/{k}": v
                for k, v in eng.lookup(held, held_weights, training=False).items()
            }
        )
        feats, weights, grads = whole_local(step, rank, world)
        if step == 1:  # two training lookups; the older one's update first
            acts, batch = eng.lookup_with_batch(feats, weights)
            f2, w2, g2 = whole_local(WHOLE_STEPS + step, rank, world)
            later = eng.lookup(f2, w2)
            eng.apply_gradients(grads, batch=batch)
            eng.apply_gradients(g2)
            saved.update({f"act{step}b/{k}": v for k, v in later.items()})
        elif step == 3:  # ids in the caller's arrays, zeroed before the update
            arrays = {
                k: np.array([i for b in v for i in b], dtype=np.int64) for k, v in feats.items()
            }
            ragged = {
                k: ee.Ragged(
                    arrays[k],
                    lengths=[len(b) for b in v],
                    weights=np.array([x for b in weights[k] for x in b], np.float32)
                    if k in weights
                    else None,
                )
                for k, v in feats.items()
            }
            acts = eng.lookup(ragged)
            for a in arrays.values():
                a[:] = 0
            eng.apply_gradients(grads)
        else:
            acts = eng.lookup(feats, weights)
            if step == 2 and rank == world - 1:  # its own equal batch: every rank falls back
                eng.apply_gradients(grads, batch=eng.preprocess(feats, weights))
            else:
                eng.apply_gradients(grads)
        saved.update({f"act{step}/{k}": v for k, v in acts.items()})
    _dump(eng, os.path.join(out, f"{name.replace(':', '_')}.rank{rank}.npz"), saved)


def failing_rank(step: int, world: int) -> int:
    """The rank whose training lookup of ``step`` is refused in ``failed:`` scenarios: one
    with samples (``split`` leaves the last rank empty at step 1)."""
    return 0 if step == 1 else world - 1


def failing_batch(feats: dict) -> dict:
    """``feats`` with id 2 of table "small" (2 rows: out of range) in every bag of "c"."""
    return {**feats, "c": [[2] for _ in feats["c"]]}


def run_failed(rank: int, world: int, out: str, name: str) -> None:
    """failed:<optimizer>:<sharding>:<exchange> (module docstring): a training lookup refused
    between each training lookup and its update must leave that update as it was."""
    from embengine.distributed import ShardedEngine

    _, optimizer_name, sharding, exchange = name.split(":")
    features, o = make_features(optimizer_name)
    eng = ShardedEngine(
        features, optimizer=o, seed=3, sharding=sharding, timeout=60, exchange=exchange
    )
    saved = {}

    def exchanged():
        return np.array([eng.table_stats()["tables"][t]["exchange"] for t in TABLES])

    for step in range(STEPS):
        feats, weights, grads = local(step, rank, world)
        batch = None
        if step == 1:
            batch = eng.lookup_with_batch(feats, weights)[1]
        else:
            eng.lookup(feats, weights)
        saved[f"trained{step}"] = exchanged()
        if step == 2:  # the update's speculation disarmed before the refused lookup
            eng.lookup(feats, weights, training=False)
        bad = failing_batch(feats) if rank == failing_rank(step, world) else feats
        try:
            eng.lookup(bad, weights)
            saved[f"refused{step}"] = np.array("no error")
        except Exception as e:  # every rank raises at the header
            saved[f"refused{step}"] = np.array(f"{type(e).__name__}: {e}")
        saved[f"armed{step}"] = np.array(eng._armed is not None)
        # An evaluation lookup of no sample: "auto" picks "sums" for every table (nothing
        # saved either way), the update still what the training lookup exchanged.
        eng.lookup({k: [] for k in feats}, {"a": []}, training=False)
        saved[f"reported{step}"] = exchanged()
        try:
            eng.apply_gradients(grads, batch=batch)
        except Exception as e:
            saved[f"error{step}"] = np.array(f"{type(e).__name__}: {e}")
    _dump(eng, os.path.join(out, f"{name.replace(':', '_')}.rank{rank}.npz"), saved)


MIXED_STEPS = 3


def mixed_features():
    """Three tables of odd widths, each its own stored dtypes (bf16 weights with f16 slots,
    f32 weights with bf16 slots, f16 weights with f32 slots), one quantized, under Adam with
    per-row bias correction (an int32 slot beside the 16-bit ones)."""
    import embengine as ee
    from embengine import optimizers as opt

    init = ee.initializers.RandomUniform(-0.3, 0.3)
    dtypes = [("bfloat16", "float16"), ("float32", "bfloat16"), ("float16", "float32")]
    quant = ee.QuantizationConfig(64, -0.25, 0.25)
    features = {}
    for i, ((v, d), (wd, sd)) in enumerate(zip([(29, 5), (3, 3), (13, 7)], dtypes, strict=True)):
        table = ee.TableConfig(
            v,
            d,
            name=f"m{i}",
            combiner=("mean", "sum", "sqrtn")[i],
            initializer=init,
            weights_dtype=wd,
            slots_dtype=sd,
            quantization_config=quant if i == 2 else None,
        )
        features[f"f{i}"] = ee.FeatureConfig(table)
    return features, opt.Adam(0.05, bias_correction="per_row")


def mixed_batch(step: int):
    """(features, gradients) of a whole step of ``mixed_features``: bags with duplicates,
    empty bags."""
    features, _ = mixed_features()
    rng = np.random.default_rng(70 + step)
    feats, grads = {}, {}
    for name, fc in features.items():
        v, d = fc.table.vocabulary_size, fc.table.dim
        feats[name] = [list(map(int, rng.integers(0, v, rng.integers(0, 5)))) for _ in range(BATCH)]
        grads[name] = rng.normal(size=(BATCH, d)).astype(np.float32)
    return feats, grads


def run_mixed(rank: int, world: int, out: str, name: str) -> None:
    """mixed:<sharding>:<exchange>: MIXED_STEPS steps of ``mixed_features``, each an
    evaluation lookup, a training lookup and the update; the activations, then the tables."""
    from embengine.distributed import ShardedEngine

    _, sharding, exchange = name.split(":")
    features, o = mixed_features()
    eng = ShardedEngine(
        features, optimizer=o, seed=3, sharding=sharding, timeout=60, exchange=exchange
    )
    saved = {}
    for step in range(MIXED_STEPS):
        feats, grads = mixed_batch(step)
        lo, hi = split(step, world)[rank]
        mine = {k: v[lo:hi] for k, v in feats.items()}
        for k, v in eng.lookup(mine, training=False).items():
            saved[f"eval{step}/{k}"] = v
        for k, v in eng.lookup(mine).items():
            saved[f"act{step}/{k}"] = v
        eng.apply_gradients({k: v[lo:hi] for k, v in grads.items()})
    _dump(eng, os.path.join(out, f"{name.replace(':', '_')}.rank{rank}.npz"), saved)


SPEC_STEPS = 4
SPEC_BATCH = 7
# Row widths whose grid (least common multiple with 2) is within the limit (the gradient rows
# are views of the message) and past it (grid 2: mixed-width rows copied into place).
SPEC_DIMS = {"views": (3, 5, 8), "copies": (11, 13, 17)}


def spec_features(which: str):
    """Three tables of the widths ``SPEC_DIMS[which]``, one shared by two features, under
    Adagrad."""
    import embengine as ee
    from embengine import optimizers as opt

    init = ee.initializers.RandomUniform(-0.3, 0.3)
    dp, dq, dr = SPEC_DIMS[which]
    p = ee.TableConfig(23, dp, name="p", combiner="sum", initializer=init)
    q = ee.TableConfig(9, dq, name="q", combiner="mean", initializer=init)
    r = ee.TableConfig(5, dr, name="r", combiner="sum", initializer=init)
    features = {
        "a": ee.FeatureConfig(p),
        "b": ee.FeatureConfig(q),
        "c": ee.FeatureConfig(r),
        "d": ee.FeatureConfig(p),  # shares "p" with "a"
    }
    return features, opt.Adagrad(0.2)


def spec_batch(step: int, which: str):
    """(features, gradients) of a whole step: bags of 0-4 ids with duplicates."""
    rng = np.random.default_rng(300 + step)
    dp, dq, dr = SPEC_DIMS[which]
    vocab = {"a": (23, dp), "b": (9, dq), "c": (5, dr), "d": (23, dp)}
    feats, grads = {}, {}
    for name, (n, dim) in vocab.items():
        feats[name] = [list(map(int, rng.integers(0, n, rng.integers(0, 5)))) for _ in range(7)]
        grads[name] = rng.normal(size=(SPEC_BATCH, dim)).astype(np.float32)
    return feats, grads


def run_speculate(rank: int, world: int, out: str, name: str) -> None:
    """speculate:<views|copies>:<exchange>[:<backend>]: each update right after its lookup
    goes in one message with its header. Step 1: the last rank updates from an equal batch
    of its own (not its lookup's), so every rank falls back to the header's sizes; step 2:
    the last rank's gradient has the wrong width (every rank raises, nothing changes), then
    every rank updates again (no longer right after the lookup: header first)."""
    from embengine.distributed import ShardedEngine

    _, which, exchange, *backend = name.split(":")
    features, o = spec_features(which)
    eng = ShardedEngine(
        features,
        optimizer=o,
        seed=3,
        timeout=60,
        exchange=exchange,
        backend=backend[0] if backend else "numba",
    )
    lo, hi = rank * SPEC_BATCH // world, (rank + 1) * SPEC_BATCH // world
    saved = {}
    for step in range(SPEC_STEPS):
        feats, grads = spec_batch(step, which)
        feats = {k: v[lo:hi] for k, v in feats.items()}
        grads = {k: v[lo:hi] for k, v in grads.items()}
        acts = eng.lookup(feats)
        for k, v in acts.items():
            saved[f"act{step}/{k}"] = v
        if step == 1 and rank == world - 1:
            eng.apply_gradients(grads, batch=eng.preprocess(feats))
        elif step == 2:
            before = eng.table_contents()
            bad = dict(grads)
            if rank == world - 1:
                bad["a"] = bad["a"][:, :-1]
            try:
                eng.apply_gradients(bad)
                saved["error"] = np.array("none")
            except Exception as e:
                saved["error"] = np.array(f"{type(e).__name__}: {e}")
            after = eng.table_contents()
            saved["unchanged"] = np.array(
                after["step"] == before["step"]
                and all(
                    np.array_equal(a, after["tables"][t][k])
                    for t, arrays in before["tables"].items()
                    for k, a in arrays.items()
                )
            )
            eng.apply_gradients(grads)
        else:
            eng.apply_gradients(grads)
        saved[f"purposes{step}"] = np.array(sorted(eng.bytes_sent["apply_gradients"]))
    _dump(eng, os.path.join(out, f"{name.replace(':', '_')}.rank{rank}.npz"), saved)


def _dump(eng, path: str, extra: dict | None = None) -> None:
    contents = eng.table_contents()
    saved = {"step": np.array(contents["step"]), **(extra or {})}
    for table, arrays in contents["tables"].items():
        for key, a in arrays.items():
            saved[f"table/{table}/{key}"] = a
    np.savez(path, **saved)


def _train(eng, steps, rank: int, world: int) -> None:
    for step in steps:
        feats, weights, grads = local(step, rank, world)
        eng.lookup(feats, weights)
        eng.apply_gradients(grads)


def overflow_gradients(grads: dict) -> dict:
    """Finite gradients whose squares overflow float32: Adagrad's update of every row that
    feature "a" touches is non-finite."""
    out = dict(grads)
    out["a"] = np.where(grads["a"] < 0, -3e38, 3e38).astype(np.float32)
    return out


def run_nonfinite(rank: int, world: int, out: str, name: str) -> None:
    """``nonfinite`` (module docstring): one step under each policy."""
    import warnings

    from embengine.distributed import ShardedEngine

    features, o = make_features("adagrad")
    feats, weights, grads = local(0, rank, world)
    saved = {}
    for policy in ("error", "skip_row"):
        eng = ShardedEngine(features, optimizer=o, seed=3, timeout=60, nonfinite_gradients=policy)
        eng.lookup(feats, weights)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            try:
                eng.apply_gradients(overflow_gradients(grads))
                saved[f"{policy}/error"] = np.array("none")
            except Exception as e:
                saved[f"{policy}/error"] = np.array(type(e).__name__)
                for table, ids in getattr(e, "rows", {}).items():
                    saved[f"{policy}/rows/{table}"] = ids
        for table, n in eng.nonfinite_rows_skipped.items():
            saved[f"{policy}/skipped/{table}"] = np.array(n)
    _dump(eng, os.path.join(out, f"{name}.rank{rank}.npz"), saved)


def run_contents_by_name(rank: int, world: int, out: str, name: str) -> None:
    """``contents_by_name`` (module docstring): each table by name, each error's text."""
    from embengine.distributed import ShardedEngine

    features, o = make_features("adam")
    eng = ShardedEngine(features, optimizer=o, seed=3, timeout=60)
    _train(eng, [0], rank, world)
    saved = {}
    for table in TABLES:
        for key, a in eng.table_contents(table).items():
            saved[f"{table}/{key}"] = a
    last = rank == world - 1
    cases = (("other", "small" if last else "big"), ("unknown", "nope" if last else "big"))
    for case, asked in cases:
        try:
            eng.table_contents(asked)
            saved[f"error/{case}"] = np.array("no error")
        except Exception as e:
            saved[f"error/{case}"] = np.array(f"{type(e).__name__}: {e}")
    _train(eng, [1], rank, world)
    saved["step"] = np.array(eng.step)
    np.savez(os.path.join(out, f"{name}.rank{rank}.npz"), **saved)


def run_user_optimizer(rank: int, world: int, out: str, name: str) -> None:
    """``user_optimizer``: a ShardedEngine of an optimizer defined outside embengine (Yogi, in
    tests/test_user_optimizer.py) trains two steps and saves; ``ShardedEngine.load`` of the
    checkpoint alone names the class again, and both engines' third step agrees bit for bit.
    In a .txt: the loaded optimizer and whether every table's contents are equal."""
    from test_user_optimizer import Yogi

    from embengine.distributed import ShardedEngine

    features, _ = make_features("sgd")
    yogi = Yogi(0.05, beta_1=0.8, epsilon=1e-2)
    eng = ShardedEngine(features, optimizer=yogi, seed=3, timeout=60)
    _train(eng, [0, 1], rank, world)
    path = os.path.join(out, name)
    eng.save(path)
    loaded = ShardedEngine.load(path, timeout=60)
    for e in (eng, loaded):
        _train(e, [2], rank, world)
    got = loaded.table_configs["big"].optimizer
    same = all(
        np.array_equal(a, loaded.table_contents(table)[key])
        for table in TABLES
        for key, a in eng.table_contents(table).items()
    )
    with open(os.path.join(out, f"{name}.rank{rank}.txt"), "w") as f:
        f.write(f"{type(got).__module__}.{type(got).__qualname__} {got == yogi} {same}\n")


def run_checkpoint(rank: int, world: int, out: str, name: str) -> None:
    """ckpt_save:<folder>: two steps, save (row sharding), the third step; ckpt_restore:
    <folder>: load (table sharding), the third step. Folders under $CKPT_ROOT."""
    from embengine.distributed import ShardedEngine

    kind, folder = name.split(":")
    root = os.path.join(os.environ["CKPT_ROOT"], folder)
    features, o = make_features(CKPT_OPTIMIZER)
    if kind == "ckpt_save":
        eng = ShardedEngine(features, optimizer=o, seed=3, sharding="row", timeout=60)
        _train(eng, range(2), rank, world)
        # Extra data as a DDP job passes it: rank 0's is written (here the ranks' differ).
        dense = np.arange(6, dtype=np.float32).reshape(2, 3) * (rank + 1)
        path = eng.save(root, extra_tensors={"dense": dense}, extra_metadata={"epoch": rank})
        _train(eng, [2], rank, world)
        extra = {"path": np.frombuffer(str(path).encode(), dtype=np.uint8)}
    else:
        eng = ShardedEngine.load(root, sharding="table", timeout=60)
        assert eng.step == 2, eng.step
        info = eng.restore(root)  # again: the CheckpointInfo with the extra data
        assert info.step == 2 and info.path.parent == Path(root), info
        _train(eng, [2], rank, world)
        extra = {f"extra/{k}": v for k, v in info.extra_tensors.items()}
        extra["epoch"] = np.array(info.extra_metadata.get("epoch", -1))
    _dump(eng, os.path.join(out, f"{kind}_{folder}.rank{rank}.npz"), extra)


def run_layer(rank: int, world: int, out: str, name: str) -> None:
    """EmbeddingLayer on a ShardedEngine beside a DDP dense layer: three steps whose loss
    gives each activation its worker gradient exactly (sum of activation * gradient)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from embengine.distributed import ShardedEngine
    from embengine.torch import EmbeddingLayer

    features, o = make_features("adagrad")
    layer = EmbeddingLayer(ShardedEngine(features, optimizer=o, seed=3, timeout=60))
    torch.manual_seed(0)
    dense = DistributedDataParallel(torch.nn.Linear(3, 1))
    sgd = torch.optim.SGD(dense.parameters(), lr=0.1)
    for step in range(STEPS):
        feats, weights, grads = local(step, rank, world)
        acts = layer(feats, weights)
        loss = sum((acts[k] * torch.from_numpy(grads[k])).sum() for k in acts)
        loss = loss + dense(torch.full((2, 3), float(rank + 1))).sum()
        sgd.zero_grad()
        loss.backward()
        sgd.step()
    assert "tables.big.weights" not in layer.state_dict()
    weight = dense.module.weight.detach().numpy().copy()
    everyone = [torch.zeros_like(dense.module.weight) for _ in range(world)]
    dist.all_gather(everyone, dense.module.weight.detach())
    assert all(torch.equal(w, everyone[0]) for w in everyone), "DDP replicas differ"
    _dump(layer.engine, os.path.join(out, f"layer.rank{rank}.npz"), {"dense": weight})


def run_layer_refused(rank: int, world: int, out: str, name: str) -> None:
    """Each rank's error (or "no error") and seconds per case, then the step, in a .txt."""
    import torch

    from embengine.distributed import ShardedEngine
    from embengine.torch import EmbeddingLayer

    features, o = make_features("adagrad")
    eng = ShardedEngine(features, optimizer=o, seed=3, timeout=60)
    layer = EmbeddingLayer(eng)
    feats, weights, grads = local(0, rank, world)
    last = rank == world - 1
    meta = torch.tensor(5, device="meta")
    cases = {
        "rates": lambda: layer(feats, weights, learning_rates=[0.1] if last else None),
        "weights": lambda: layer(eng.preprocess(feats, weights), weights if last else None),
        "timestamp": lambda: layer(feats, weights, timestamp=meta if last else None),
    }
    said = []
    for case, forward in cases.items():
        start = time.monotonic()
        try:
            forward()
            said.append(f"{case}: no error")
        except Exception as e:
            said.append(f"{case}: {time.monotonic() - start:.3f} {type(e).__name__}: {e}")
        acts = layer(feats, weights)
        sum((acts[k] * torch_tensor(grads[k])).sum() for k in acts).backward()
    with open(os.path.join(out, f"{name}.rank{rank}.txt"), "w") as f:
        f.write("\n".join([*said, f"step={eng.step}"]) + "\n")


def run_build_fails(rank: int, world: int, out: str, name: str) -> None:
    """Each rank's error and seconds per case, then the step of a good engine, in a .txt."""
    import embengine as ee
    from embengine.distributed import ShardedEngine

    features, o = make_features("sgd")
    last = rank == world - 1
    root = os.path.join(out, f"{name}-ckpt")
    if rank == 0:
        ee.EmbeddingEngine(make_features("sgd")[0], optimizer=o, seed=3).save(root)
    cases = {
        "optimizer": lambda: ShardedEngine(features, optimizer="sgd" if last else o, timeout=60),
        "load": lambda: ShardedEngine.load(root + ("-missing" if last else ""), timeout=60),
    }
    said = []
    for case, build in cases.items():
        start = time.monotonic()
        try:
            build()
            said.append(f"{case}: no error")
        except Exception as e:
            said.append(f"{case}: {time.monotonic() - start:.3f} {type(e).__name__}: {e}")
    eng = ShardedEngine(features, optimizer=o, seed=3, timeout=60)
    _train(eng, [0], rank, world)
    with open(os.path.join(out, f"{name}.rank{rank}.txt"), "w") as f:
        f.write("\n".join([*said, f"step={eng.step}"]) + "\n")


def run_save_write_fails(rank: int, world: int, out: str, name: str) -> None:
    """``save_write_fails`` (module docstring): the failed save's outcome and seconds, what
    the root held, then the step and the checkpoint of the save that worked, in a .txt."""
    import errno

    import torch.distributed as dist

    import embengine as ee
    import embengine.distributed.checkpoint as module
    from embengine.distributed import ShardedEngine

    features, o = make_features("sgd")
    dyn = ee.DynamicVocabulary()
    features["k"] = ee.FeatureConfig(ee.TableConfig(None, 8, name="k", dynamic=dyn))
    eng = ShardedEngine(features, optimizer=o, seed=3, timeout=60)
    keyed_file = f"table-{eng.table_names.index('k'):03d}.safetensors"

    def step(steps):
        for s in steps:
            feats, weights, grads = local(s, rank, world)
            eng.lookup({**feats, "k": feats["a"]}, weights)
            eng.apply_gradients({**grads, "k": grads["a"]})

    step([0])
    root = os.path.join(out, name.replace(":", "_"))
    case = name.split(":")[1]
    pwrite = os.pwrite
    written, hashed = module.write_safetensors, module.sha256_file

    def full_disk(fd, data, offset):
        if case == "interrupt":
            raise KeyboardInterrupt("the test's")
        if case == "dense" or os.readlink(f"/proc/self/fd/{fd}").endswith(keyed_file):
            raise OSError(errno.ENOSPC, "No space left on device")
        return pwrite(fd, data, offset)

    def out_of_memory(*args):
        raise MemoryError("the test's")

    def broken_hash(*args):
        raise RuntimeError("the test's")

    synced = module.ckpt._fsync_dir

    def broken_sync(path):
        if os.path.samefile(path, root):
            raise OSError(errno.EIO, "Input/output error")
        synced(path)

    shard = eng.shard("k")

    if rank == world - 1 and case in ("dense", "keyed", "interrupt"):
        os.pwrite = full_disk
    if rank == 0 and case == "extra":
        module.write_safetensors = out_of_memory
    if rank == 0 and case == "commit":
        module.sha256_file = broken_hash
    if rank == world - 1 and case == "layout":
        shard.state = out_of_memory
    if rank == world - 1 and case == "spec":
        eng.spec = broken_hash
    if rank == 0 and case == "renamed":
        module.ckpt._fsync_dir = broken_sync
    start = time.monotonic()
    try:
        said = f"saved {eng.save(root, extra_tensors={'dense': np.ones(3, np.float32)})}"
    except BaseException as e:  # KeyboardInterrupt too: the case's point
        said = f"{type(e).__name__}: {e}"
        if getattr(e, "path", None) is not None:  # a committed checkpoint's CheckpointError
            said += f" | path={e.path}"
    finally:
        os.pwrite = pwrite
        module.write_safetensors, module.sha256_file = written, hashed
        module.ckpt._fsync_dir = synced
        vars(shard).pop("state", None)
        vars(eng).pop("spec", None)
    seconds = time.monotonic() - start
    dist.barrier()  # rank 0 has left its save (and removed what it made)
    held = sorted(os.listdir(root)) if os.path.isdir(root) else "no root"
    step([1])
    saved = os.path.basename(eng.save(root))
    with open(os.path.join(out, f"{name.replace(':', '_')}.rank{rank}.txt"), "w") as f:
        f.write(f"{seconds:.3f} {said}\nheld={held}\nstep={eng.step} {saved}\n")


def run_restore_newest(rank: int, world: int, out: str, name: str) -> None:
    """``restore_newest`` (module docstring): the step and checkpoint each rank restored,
    or its error, in a .txt."""
    import torch.distributed as dist

    import embengine as ee
    from embengine import checkpoint as single
    from embengine.distributed import ShardedEngine

    features, o = make_features("adagrad")
    how = name.split(":")[1]
    root = os.path.join(out, name.replace(":", "_"))
    marker = root + "-rank0-read"
    plain = ee.EmbeddingEngine(make_features("adagrad")[0], optimizer=o, seed=3)
    if rank == 0:
        _train(plain, range(2), 0, 1)
        plain.save(root)
    dist.barrier()
    eng = ShardedEngine(features, optimizer=o, seed=3, timeout=60)
    read = single.read_checkpoint

    def read_then_mark(path, verify=True):  # rank 0: says when it has read
        got = read(path, verify)
        with open(marker, "w") as f:
            f.write(str(got[1].path))
        return got

    def save_then_read(path, verify=True):  # the last rank: another job saves first, once
        deadline = time.monotonic() + 20
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.01)
        if plain.step == 0:
            _train(plain, range(5), 0, 1)
            plain.save(root)
        return read(path, verify)

    if rank in (0, world - 1):
        single.read_checkpoint = read_then_mark if rank == 0 else save_then_read
    try:
        if how == "load":  # the step it restored (it gives no path)
            eng = ShardedEngine.load(root, timeout=60)
            said = f"restored step {eng.step}"
        else:
            path = eng.restore(root).path
            said = f"restored step {eng.step} from {os.path.basename(path)}"
    except Exception as e:
        said = f"{type(e).__name__}: {e}"
    finally:
        single.read_checkpoint = read
    with open(os.path.join(out, f"{name.replace(':', '_')}.rank{rank}.txt"), "w") as f:
        f.write(f"{said}\nstep={eng.step}\n")


# The paced scenarios' group timeout, meeting interval and seconds of rank 0's work: the
# timeout several intervals long, so that a loaded host (3 test workers on 2 cores) does not
# make a meeting late (at 0.5 s and 0.1 s, one was, in a fresh clone's suite).
PACE_TIMEOUT, PACE_EVERY, PACE_WORK = 2.0, 0.25, 4.0


def run_pacer(rank: int, world: int, out: str, name: str) -> None:
    """``pacer`` (module docstring): in a group of PACE_TIMEOUT, rank 0 hashes for PACE_WORK
    seconds in a Pacer while the others wait in theirs; then the same work without it, the others
    waiting in an all_gather. Each outcome and seconds, and the meetings
    counted, in a .txt."""
    import hashlib

    import torch.distributed as dist

    from embengine.distributed.comm import Comm

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=PACE_TIMEOUT))
    comm = Comm(group, rank, world, meet_every=PACE_EVERY)
    block = np.random.default_rng(rank).bytes(1 << 20)
    said = []

    def work() -> None:
        if rank == 0:
            digest = hashlib.sha256()
            while time.monotonic() - start < PACE_WORK:
                digest.update(block)

    for paced in (True, False):
        start = time.monotonic()
        try:
            if paced:
                with comm.pacer("hashing for the test"):
                    work()
            else:
                work()
                comm.all_gather(np.zeros(1, dtype=np.int64), "after the work")
            said.append(f"paced={paced}: {time.monotonic() - start:.3f} done")
        except Exception as e:
            said.append(f"paced={paced}: {time.monotonic() - start:.3f} {type(e).__name__}: {e}")
            break  # the group is broken
    said.append(f"meetings={comm.sent['hashing for the test'] // (8 * (world - 1))}")
    with open(os.path.join(out, f"{name}.rank{rank}.txt"), "w") as f:
        f.write("\n".join(said) + "\n")


def run_pacer_raises(rank: int, world: int, out: str, name: str) -> None:
    """``pacer_raises`` (module docstring): in a group of PACE_TIMEOUT (meeting every
    PACE_EVERY), rank 0 hashes for PACE_WORK seconds in a Pacer while the last rank's body
    raises KeyboardInterrupt at once (the others' bodies are empty). Each rank's outcome and
    seconds in a .txt."""
    import hashlib

    import torch.distributed as dist

    from embengine.distributed.comm import Comm

    dist.barrier()  # lined up (60 s): the group's own connections wait PACE_TIMEOUT for a peer
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=PACE_TIMEOUT))
    comm = Comm(group, rank, world, meet_every=PACE_EVERY)
    block = np.random.default_rng(rank).bytes(1 << 20)
    start = time.monotonic()
    try:
        with comm.pacer("hashing for the test"):
            if rank == 0:
                digest = hashlib.sha256()
                while time.monotonic() - start < PACE_WORK:
                    digest.update(block)
            if rank == world - 1:
                raise KeyboardInterrupt("the test's")
        said = "done"
    except BaseException as e:  # KeyboardInterrupt too: the scenario's point
        said = f"{type(e).__name__}: {e}"
    with open(os.path.join(out, f"{name}.rank{rank}.txt"), "w") as f:
        f.write(f"{time.monotonic() - start:.3f} {said}\n")


def run_slow_hash(rank: int, world: int, out: str, name: str) -> None:
    """``slow_hash`` (module docstring): a ShardedEngine in a group of the caller's of
    PACE_TIMEOUT whose table sharding puts a 256 MiB table on rank 0 (it initialises it while
    the other waits); then one of PACE_TIMEOUT (its own group) of a small table, and a save
    in which rank 0 adds an extra tensor of about twice PACE_TIMEOUT of this host's hashing
    (512 MiB at most), so rank 0 hashes longer than the timeout as it commits (on a host
    hashing under 128 MB/s); then a restore that only the last rank verifies. Each outcome
    and seconds, the timeout and the extra tensor's bytes, in a .txt."""
    import hashlib

    import torch
    import torch.distributed as dist

    import embengine as ee
    from embengine import optimizers as opt
    from embengine.distributed import ShardedEngine

    # Table sharding puts the big table whole on one rank: it initialises it while the other
    # waits (the constructor's next collective timed out too). In a group of the caller's,
    # of PACE_TIMEOUT: the engine meets as often as that group's timeout asks (in a group of
    # 0.5 s it met every 1 s, as for its default timeout of 60 s, and timed out).
    big = ee.TableConfig(1 << 20, 64, name="big", optimizer=opt.SGD(0.1))
    dist.barrier()  # lined up (60 s): the group's own connections wait PACE_TIMEOUT for a peer
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=PACE_TIMEOUT))
    start = time.monotonic()
    try:
        small = ee.TableConfig(10, 8, name="small", optimizer=opt.SGD(0.1))
        ShardedEngine(
            {"b": ee.FeatureConfig(big), "s": ee.FeatureConfig(small)},
            sharding="table",
            group=group,
        )
        built = f"build: {time.monotonic() - start:.3f} done"
    except Exception as e:
        built = f"build: {time.monotonic() - start:.3f} {type(e).__name__}: {e}"
    dist.barrier()
    probe = np.random.default_rng(0).bytes(32 << 20)
    start = time.perf_counter()
    hashlib.sha256(probe).digest()
    speed = torch.tensor([len(probe) / (time.perf_counter() - start)], dtype=torch.float64)
    dist.broadcast(speed, 0)  # rank 0's figure everywhere (and the ranks meet)
    nbytes = int(min(512 << 20, 2 * PACE_TIMEOUT * float(speed[0]))) // 4 * 4
    table = ee.TableConfig(1000, 8, name="t", optimizer=opt.SGD(0.1))
    eng = ShardedEngine({"f": ee.FeatureConfig(table)}, timeout=PACE_TIMEOUT)
    acts = eng.lookup({"f": np.array([[rank]], dtype=np.int64)})
    eng.apply_gradients({k: np.ones_like(v) for k, v in acts.items()})
    root = os.path.join(out, name)
    said = [f"timeout={PACE_TIMEOUT} extra={nbytes} speed={float(speed[0]):.0f}", built]
    for call in ("save", "restore"):
        start = time.monotonic()
        try:
            if call == "save":
                big = {"big": np.zeros(nbytes // 4, dtype=np.float32)} if rank == 0 else None
                eng.save(root, extra_tensors=big)
                del big
            else:
                eng.restore(root, verify=rank == world - 1)
            said.append(f"{call}: {time.monotonic() - start:.3f} done")
        except Exception as e:
            said.append(f"{call}: {time.monotonic() - start:.3f} {type(e).__name__}: {e}")
            break
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    with open(os.path.join(out, f"{name}.rank{rank}.txt"), "w") as f:
        f.write("\n".join(said) + "\n")


def run_save_roots(rank: int, world: int, out: str, name: str) -> None:
    """``save_roots`` (module docstring): each case's outcome and seconds, the roots'
    contents and the step, in a .txt."""
    import torch.distributed as dist

    from embengine.distributed import ShardedEngine

    features, o = make_features("sgd")
    eng = ShardedEngine(features, optimizer=o, seed=3, timeout=60)
    _train(eng, [0], rank, world)
    base = os.path.join(out, name)
    shared = os.path.join(base, "shared")
    if rank == 0:
        os.makedirs(shared)
        os.symlink(shared, os.path.join(base, "link"))
    dist.barrier()
    roots = {
        "other": os.path.join(base, f"rank{rank}"),
        "same": os.path.join(base, "link" if rank == world - 1 else "shared"),
    }
    said = []
    for case, root in roots.items():
        start = time.monotonic()
        try:
            path = eng.save(root)
            said.append(f"{case}: {time.monotonic() - start:.3f} saved {path}")
        except Exception as e:
            said.append(f"{case}: {time.monotonic() - start:.3f} {type(e).__name__}: {e}")
        dist.barrier()
        if case == "other":
            held = {r: sorted(os.listdir(os.path.join(base, r))) for r in sorted(os.listdir(base))}
            said.append(f"held: {held}")
            _train(eng, [1], rank, world)
    said.append(f"step={eng.step}")
    with open(os.path.join(out, f"{name}.rank{rank}.txt"), "w") as f:
        f.write("\n".join(said) + "\n")


def run_restore_other(rank: int, world: int, out: str, name: str) -> None:
    """Each rank's outcome of restoring its copy of rank 0's checkpoint, then a checkpoint of
    the same step whose rows differ by rank, in a .txt."""
    import shutil

    import torch.distributed as dist

    import embengine as ee
    from embengine.distributed import ShardedEngine

    features, o = make_features("adagrad")
    said = []
    for case in ("copies", "different"):
        plain = ee.EmbeddingEngine(make_features("adagrad")[0], optimizer=o, seed=3)
        if case == "different":
            state = plain.state_dict()
            state["tables"]["big"]["weights"][:] = rank  # this rank's checkpoint differs
            plain.load_state_dict(state)
        root = os.path.join(out, f"{name}-{case}")
        if rank == 0 or case == "different":
            plain.save(os.path.join(root, f"rank{rank}"))
        dist.barrier()
        if case == "copies" and rank:  # a node-local copy of rank 0's checkpoint
            shutil.copytree(os.path.join(root, "rank0"), os.path.join(root, f"rank{rank}"))
        eng = ShardedEngine(features, optimizer=o, seed=3, timeout=60)
        try:
            step = eng.restore(os.path.join(root, f"rank{rank}")).step
            said.append(f"{case}: restored step {step}")
        except Exception as e:
            said.append(f"{case}: {type(e).__name__}: {e}")
    with open(os.path.join(out, f"{name}.rank{rank}.txt"), "w") as f:
        f.write("\n".join(said) + "\n")


def run_last_step(rank: int, world: int, out: str, name: str) -> None:
    """Each rank's outcome of a training lookup, an update and an evaluation lookup at step
    2**63 - 1 (a plain engine's checkpoint), in a .txt."""
    import torch.distributed as dist

    import embengine as ee
    from embengine.distributed import ShardedEngine

    features, o = make_features("adagrad")
    root = os.path.join(out, name)
    if rank == 0:
        plain = ee.EmbeddingEngine(make_features("adagrad")[0], optimizer=o, seed=3)
        state = plain.state_dict()
        state["step"] = 2**63 - 1
        plain.load_state_dict(state)
        plain.save(root)
    dist.barrier()
    eng = ShardedEngine(features, optimizer=o, seed=3, timeout=60)
    eng.restore(root)
    feats, weights, grads = local(0, rank, world)
    said = []
    for what in ("lookup", "apply", "eval"):
        try:
            if what == "lookup":
                eng.lookup(feats, weights)
            elif what == "apply":
                eng.apply_gradients(grads)
            else:
                eng.lookup(feats, weights, training=False)
            said.append(f"{what}: ok")
        except Exception as e:
            said.append(f"{what}: {type(e).__name__}: {e}")
    said.append(f"step={eng.step}")
    with open(os.path.join(out, f"{name}.rank{rank}.txt"), "w") as f:
        f.write("\n".join(said) + "\n")


def run_bad_counter(rank: int, world: int, out: str, name: str) -> None:
    """``bad_counter`` (module docstring)."""
    import hashlib
    import json

    import torch.distributed as dist

    import embengine as ee
    from embengine import optimizers as opt
    from embengine.distributed import ShardedEngine
    from embengine.safetensors_io import read_header, read_tensor, write_safetensors

    _, slot, value = name.split(":")
    adam = opt.Adam(0.1, bias_correction="per_row")
    features = {
        "a": ee.FeatureConfig(ee.TableConfig(10, 2, name="a", optimizer=adam)),
        "c": ee.FeatureConfig(ee.TableConfig(10, 1, name="c", optimizer=opt.FrequencyEstimator())),
        "k": ee.FeatureConfig(
            ee.TableConfig(None, 2, name="k", optimizer=adam, dynamic=ee.DynamicVocabulary())
        ),
    }
    root = os.path.join(out, name.replace(":", "_"))
    if rank == 0:
        plain = ee.EmbeddingEngine(features, seed=3)
        for _ in range(2):
            acts = plain.lookup({f: np.array([[1, 2], [3, 3]]) for f in features})
            plain.apply_gradients({f: np.ones_like(v) for f, v in acts.items()})
        ckpt = Path(plain.save(root))
        table, entry = slot.split("/")
        m = json.loads((ckpt / "manifest.json").read_text())
        file = ckpt / next(t["file"] for t in m["tables"] if t["name"] == table)
        header = read_header(file)
        tensors = {
            n: np.array(read_tensor(file, n, header=header))
            for n in header[0]
            if n != "__metadata__"
        }
        tensors[slot][1, 0] = int(value)
        file.unlink()
        write_safetensors(file, tensors, header[0].get("__metadata__"))
        m["files"][file.name] = {
            "sha256": hashlib.sha256(file.read_bytes()).hexdigest(),
            "bytes": file.stat().st_size,
        }
        text = json.dumps(m, indent=1).encode()
        (ckpt / "manifest.json").write_bytes(text)
        (ckpt / "manifest.sha256").write_bytes(hashlib.sha256(text).hexdigest().encode())
    dist.barrier()
    from embengine.distributed import checkpoint as dc

    eng = ShardedEngine(features, seed=3, timeout=60)
    acts = eng.lookup({f: np.array([[rank + 4, 5]]) for f in features})
    eng.apply_gradients({f: np.ones_like(v) for f, v in acts.items()})
    before = eng.table_contents()["tables"]
    chunk, dc.CHUNK_BYTES = dc.CHUNK_BYTES, 4  # a row a chunk: the bad one in the 2nd chunk
    try:
        eng.restore(root)
        said = "restored"
    except Exception as e:
        said = f"{type(e).__name__}: {e}"
    finally:
        dc.CHUNK_BYTES = chunk  # the process's other scenarios read as usual
    after = eng.table_contents()["tables"]
    same = all(
        before[t].keys() == after[t].keys()
        and all(before[t][k].tobytes() == after[t][k].tobytes() for k in before[t])
        for t in before
    )
    with open(os.path.join(out, f"{name.replace(':', '_')}.rank{rank}.txt"), "w") as f:
        f.write(f"{said}\nunchanged={same} step={eng.step}\n")


def run_reader_released(rank: int, world: int, out: str, name: str) -> None:
    """Whether a checkpoint whose restore failed (the error still held, its traceback with
    it) is pruned by a later save with keep=1, in a .txt."""
    import embengine as ee
    from embengine.distributed import ShardedEngine

    features, o = make_features("adagrad")
    root = os.path.join(out, name)
    other = {"x": ee.FeatureConfig(ee.TableConfig(3, 2, name="x"))}
    ee.EmbeddingEngine(other, optimizer=o).save(root)
    (first,) = os.listdir(root)
    eng = ShardedEngine(features, optimizer=o, seed=3, timeout=60)
    try:
        eng.restore(root)
        held = None
    except Exception as e:  # kept, as a caller logging it later would
        held = e
    eng.save(root, keep=1)
    with open(os.path.join(out, f"{name}.rank{rank}.txt"), "w") as f:
        f.write(f"{type(held).__name__}\n{first in os.listdir(root)}\n")


def run_load_pinned(rank: int, world: int, out: str, name: str) -> None:
    """The step ShardedEngine.load(root) restored when a save of step 5 landed under root
    after it had read the spec of step 2's checkpoint (the newest then), in a .txt."""
    import embengine as ee
    from embengine.distributed import ShardedEngine

    features, o = make_features("adagrad")
    root = os.path.join(out, name)
    plain = ee.EmbeddingEngine(make_features("adagrad")[0], optimizer=o, seed=3)
    for step in range(2):
        feats, weights, grads = local(step, 0, 1)
        plain.lookup(feats, weights)
        plain.apply_gradients(grads)
    plain.save(root)
    original = ShardedEngine.restore

    def restore_after_a_save(self, path, verify=True):
        while plain.step < 5:  # another job saves a newer checkpoint meanwhile
            feats, weights, grads = local(plain.step, 0, 1)
            plain.lookup(feats, weights)
            plain.apply_gradients(grads)
        plain.save(root)
        return original(self, path, verify)

    ShardedEngine.restore = restore_after_a_save
    try:
        eng = ShardedEngine.load(root, timeout=60)
    finally:
        ShardedEngine.restore = original
    with open(os.path.join(out, f"{name}.rank{rank}.txt"), "w") as f:
        f.write(f"step={eng.step}\n")


def run_midway(rank: int, world: int, out: str, name: str) -> None:
    """``midway`` and ``midway:<apply|contents>`` (module docstring)."""
    import torch.distributed as dist

    import embengine.distributed.checkpoint as checkpoint
    import embengine.distributed.engine as module
    import embengine.kernels.shard_route as sr
    from embengine.distributed import ShardedEngine

    features, o = make_features("sgd")
    feats, weights, grads = local(0, rank, world)
    # The engine below waits 3 s for a peer: every kernel of a step loaded first (an engine
    # of the usual timeout), the ranks lined up, so a loaded host's late rank is not taken for
    # the failed one.
    warm = ShardedEngine(features, optimizer=o, seed=3, exchange="rows")
    warm.lookup(feats, weights)
    warm.apply_gradients(grads)
    dist.barrier()
    eng = ShardedEngine(features, optimizer=o, seed=3, exchange="rows", timeout=3)
    route, update, view = sr.route_ids, eng._backend.apply_tables, module.column_view
    saving, restoring = checkpoint.save, checkpoint.restore

    def fails(*args, **kwargs):
        raise RuntimeError("the test's")

    lookup = ("lookup", lambda: eng.lookup(feats, weights))
    apply = ("apply_gradients", lambda: eng.apply_gradients(grads))
    contents = ("table_contents", lambda: eng.table_contents())
    root = os.path.join(out, name.replace(":", "_"))
    save = ("save", lambda: eng.save(root))
    restore = ("restore", lambda: eng.restore(root))
    case = name.partition(":")[2] or "lookup"
    calls = {  # the first fails on the last rank
        "lookup": [lookup, apply, ("lookup again", lookup[1]), save],
        "apply": [apply, lookup, contents, save],
        "contents": [contents, lookup, apply, save],
        "save": [save, lookup, contents, restore],
        "restore": [restore, lookup, contents, save],
    }[case]
    if case == "apply":  # a lookup that works first
        calls.insert(0, ("lookup first", lookup[1]))
    if case == "restore":  # a checkpoint to restore first
        calls.insert(0, ("save first", save[1]))
    failing = {
        "lookup": "lookup",
        "apply": "apply_gradients",
        "contents": "table_contents",
        "save": "save",
        "restore": "restore",
    }
    said = []
    for call, fn in calls:
        if call == failing[case] and rank == world - 1:
            if case == "lookup":
                sr.route_ids = fails  # between the header's exchange and the ids'
            elif case == "apply":
                eng._backend.apply_tables = fails  # after the message, before the last collective
            elif case == "contents":
                module.column_view = fails  # between the first table's gathers and the next's
            elif case == "save":
                checkpoint.save = fails  # past the header, before the save's first collective
            else:
                checkpoint.restore = fails  # past the header, before the restore's first
        start = time.monotonic()
        try:
            fn()
            outcome = "no error"
        except Exception as e:
            outcome = f"{type(e).__name__}: {e}"
        finally:
            sr.route_ids, eng._backend.apply_tables, module.column_view = route, update, view
            checkpoint.save, checkpoint.restore = saving, restoring
        said.append(f"{call}: {time.monotonic() - start:.3f} {outcome}")
    dist.barrier()  # the ranks leave together (the others waited out the timeout)
    with open(os.path.join(out, f"{name.replace(':', '_')}.rank{rank}.txt"), "w") as f:
        f.write("\n".join(said) + "\n")


def _stepped_engine(rank: int, world: int):
    """(an SGD ShardedEngine on exchange "rows" with a 10 s timeout after one step together,
    this rank's features, weights, gradients, the tables after that step): every kernel
    loaded and the ranks lined up before a scenario's failing calls."""
    from embengine.distributed import ShardedEngine

    features, o = make_features("sgd")
    feats, weights, grads = local(0, rank, world)
    eng = ShardedEngine(features, optimizer=o, seed=3, exchange="rows", timeout=10)
    eng.lookup(feats, weights)
    eng.apply_gradients(grads)
    return eng, feats, weights, grads, eng.table_contents()


def run_fill_fails(rank: int, world: int, out: str, name: str) -> None:
    """``fill_fails`` (module docstring): each call's outcome and seconds, whether the
    tables stayed as they were, then a step together, in a .txt."""
    import torch.distributed as dist

    import embengine.kernels.shard_route as sr

    eng, feats, weights, grads, before = _stepped_engine(rank, world)
    eng.lookup(feats, weights)  # armed: the update right after it speculates
    dist.barrier()
    fill = sr.fill_push

    def fails(*args, **kwargs):
        raise RuntimeError("the test's")

    if rank == world - 1:
        sr.fill_push = fails  # packing the update's message, after every check of its input
    start = time.monotonic()
    try:
        eng.apply_gradients(grads)
        said = "no error"
    except Exception as e:
        said = f"{type(e).__name__}: {e}"
    finally:
        sr.fill_push = fill
    seconds = time.monotonic() - start
    dist.barrier()  # the ranks go on together (without the fix rank 0 waited out the timeout)
    after = eng.table_contents()
    unchanged = after["step"] == before["step"] and all(
        np.array_equal(a, after["tables"][t][k])
        for t, arrays in before["tables"].items()
        for k, a in arrays.items()
    )
    eng.apply_gradients(grads)  # the pending batch, header first now
    with open(os.path.join(out, f"{name}.rank{rank}.txt"), "w") as f:
        f.write(f"{seconds:.3f} {said}\nunchanged={unchanged}\nstep={eng.step}\n")


def run_connect_first(rank: int, world: int, out: str, name: str) -> None:
    """``connect_first`` (module docstring): the times, in a .npz."""
    import torch.distributed as dist

    from embengine.distributed import ShardedEngine, comm

    features, o = make_features("sgd")
    real_client, real_new_group = comm._client, dist.new_group
    times: dict[str, float] = {}

    def slow_client(store):
        if rank == world - 1 and not comm._CLIENT:
            time.sleep(1.5)
        client = real_client(store)
        times.setdefault("connected", time.time())
        return client

    def spying_new_group(*args, **kwargs):
        times.setdefault("new_group", time.time())
        return real_new_group(*args, **kwargs)

    comm._CLIENT.clear()
    comm._client, dist.new_group = slow_client, spying_new_group
    try:
        ShardedEngine(features, optimizer=o, seed=3, timeout=60)
    finally:
        comm._client, dist.new_group = real_client, real_new_group
    np.savez(Path(out) / f"{name}.rank{rank}.npz", **times)


def run_interrupted(rank: int, world: int, out: str, name: str) -> None:
    """``interrupted`` (module docstring): each call's outcome and seconds, whether the
    tables stayed as they were, then the step an update together reached, in a .txt."""
    import torch.distributed as dist

    from embengine.distributed import ShardedEngine

    features, o = make_features("sgd")
    eng, feats, weights, grads, before = _stepped_engine(rank, world)

    def interrupted() -> None:
        raise KeyboardInterrupt("the test's")

    said = []

    def timed(call, fn, where=None, what=None) -> None:
        """``fn()`` on every rank, ``where.what`` (a check before the header) interrupting it
        on the last rank; its time and outcome written down. The ranks go on together (without
        the fix rank 0 waited out the timeout)."""
        kept = None if where is None else getattr(where, what)
        if where is not None and rank == world - 1:
            setattr(where, what, lambda *a, **k: interrupted())
        dist.barrier()
        start = time.monotonic()
        try:
            fn()
            outcome = "no error"
        except BaseException as e:  # KeyboardInterrupt too: the scenario's point
            outcome = f"{type(e).__name__}: {e}"
        finally:
            if where is not None:
                setattr(where, what, kept)
        said.append(f"{call}: {time.monotonic() - start:.3f} {outcome}")
        dist.barrier()

    timed("lookup", lambda: eng.lookup(feats, weights), eng, "_check_files")
    timed("lookup together", lambda: eng.lookup(feats, weights))
    timed("apply_gradients", lambda: eng.apply_gradients(grads), eng, "_check_files")  # speculating
    timed("apply_gradients again", lambda: eng.apply_gradients(grads), eng, "_check_files")
    try:  # an error written down (without the fix the group broke): the next scenarios run
        after = eng.table_contents()
        unchanged = after["step"] == before["step"] and all(
            np.array_equal(a, after["tables"][t][k])
            for t, arrays in before["tables"].items()
            for k, a in arrays.items()
        )
        eng.apply_gradients(grads)  # the pending batch, together
        said += [f"unchanged: {unchanged}", f"step: {eng.step}"]
    except Exception as e:
        said.append(f"after: {type(e).__name__}: {e}")
    dist.barrier()
    # The other calls' checks before their header (before the configuration's exchange for
    # ShardedEngine() and load), interrupted on the last rank alike, after a save together.
    import embengine.checkpoint as single

    ckpt = eng.save(os.path.join(out, f"{name}_ckpt"))
    build = ShardedEngine._build
    again = [
        ("table_contents", lambda: eng.table_contents(), eng, "_check_files"),
        ("save", lambda: eng.save(os.path.join(out, f"{name}_other")), eng, "_check_files"),
        ("restore", lambda: eng.restore(ckpt), eng, "_check_files"),
        (
            "ShardedEngine()",
            lambda: ShardedEngine(features, optimizer=o, exchange="rows", timeout=10),
            ShardedEngine,
            "_build",
        ),
        ("load", lambda: ShardedEngine.load(ckpt, timeout=10), single, "read_checkpoint"),
    ]
    for call, fn, where, what in again:
        timed(call, fn, where, what)
    assert ShardedEngine._build is build
    with open(os.path.join(out, f"{name}.rank{rank}.txt"), "w") as f:
        f.write("\n".join(said) + "\n")


def torch_tensor(a: np.ndarray):
    import torch

    return torch.from_numpy(a)


def _build_outcome(features, lr) -> tuple[float, str]:
    """Seconds a ShardedEngine(features, optimizer=lr, seed=3) took, and "ok" or its error."""
    from embengine.distributed import ShardedEngine

    start = time.monotonic()
    try:
        ShardedEngine(features, optimizer=lr, seed=3)
        result = "ok"
    except Exception as e:
        result = f"{type(e).__name__}: {e}"
    return time.monotonic() - start, result


def run_error(rank: int, world: int, out: str, name: str) -> None:
    """Write "<ExceptionType>: <message>" (or "ok") and the seconds the failing call took."""
    from embengine import optimizers as opt
    from embengine.distributed import ShardedEngine

    features, _ = make_features("sgd")
    lr = opt.SGD((lambda step: 0.1 * (1 + rank)) if name == "lr_mismatch" else 0.1)
    feats, weights, grads = local(0, rank, world)
    if name == "kill_at_build":  # the last rank dies before the engine's group is made
        if rank == world - 1:
            os._exit(3)
        seconds, result = _build_outcome(features, lr)
        with open(os.path.join(out, f"{name}.rank{rank}.txt"), "w") as f:
            f.write(f"{seconds:.3f}\n{result}\n")
        return
    if name == "late_at_build":  # the last rank makes its engine after the others failed
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.barrier()  # lined up (60 s); from here the default group waits 2 s for a peer
        _set_pg_timeout(timedelta(seconds=2))
        if rank == world - 1:  # late: until the others wrote their error (30 s at most)
            others = [os.path.join(out, f"{name}.rank{r}.txt") for r in range(world - 1)]
            deadline = time.monotonic() + 30
            while not all(map(os.path.exists, others)) and time.monotonic() < deadline:
                time.sleep(0.05)
        seconds, result = _build_outcome(features, lr)
        with open(os.path.join(out, f"{name}.rank{rank}.txt.part"), "w") as f:
            f.write(f"{seconds:.3f}\n{result}\n")
        os.rename(  # whole, for the late rank that waits for it
            os.path.join(out, f"{name}.rank{rank}.txt.part"),
            os.path.join(out, f"{name}.rank{rank}.txt"),
        )
        return
    if name.startswith("hang"):
        # The timed engine waits 3 s for a peer: first load every kernel of a step (an engine
        # with the usual timeout) and line the ranks up, so a loaded host's late rank is not
        # taken for the hung one.
        warm = ShardedEngine(features, optimizer=lr, seed=3)
        warm.lookup(feats, weights)
        warm.apply_gradients(grads)
        import torch.distributed as dist

        dist.barrier()
    eng = ShardedEngine(
        features, optimizer=lr, seed=3, timeout=3 if name.startswith("hang") else 60
    )
    path = os.path.join(out, f"{name}.rank{rank}.txt")
    saved = eng.save(os.path.join(out, "hang-restore")) if name == "hang_restore" else None
    if name == "bad_input" and rank == world - 1:
        feats["a"] = [[37] * len(feats["a"][0])] + feats["a"][1:]  # lengths match the weights
    if name == "step_mismatch" and rank == world - 1:
        eng._step = 7  # as if this rank had restored another checkpoint
    start = time.monotonic()
    result = "ok"
    try:
        if name == "hang_restore":
            from embengine import checkpoint as single

            if rank == world - 1:
                with open(os.path.join(out, "hung.pid"), "w") as f:
                    f.write(str(os.getpid()))
                read = single.read_checkpoint

                def stop_then_read(*args, **kwargs):  # stopped while checking it
                    os.kill(os.getpid(), signal.SIGSTOP)
                    return read(*args, **kwargs)

                single.read_checkpoint = stop_then_read
            eng.restore(saved)
            raise RuntimeError("restored")
        if name == "call_mismatch" and rank == world - 1:
            eng.table_contents()
        if name == "save_fails":  # a file where the checkpoints' folder should be
            eng.save(os.path.join(out, "not-a-folder", "ckpt"))
        if name.startswith("save_args:"):
            # A bad argument: keep=0 on the last rank only, or metadata that is not JSON on
            # every rank; then every rank steps together.
            root = os.path.join(out, name.replace(":", "-"))
            last = rank == world - 1
            try:
                if name.endswith("keep"):
                    eng.save(root, keep=0 if last else None)
                elif name.endswith("keeps"):  # each valid, but they differ
                    eng.save(root, keep=1 if last else None)
                elif name.endswith("root"):  # None for a folder on the last rank
                    eng.save(None if last else root)
                elif name.endswith("extra"):  # a list for an array on the last rank
                    eng.save(root, extra_tensors={"dense": [1.0] if last else np.ones(1)})
                elif name.endswith("restore"):  # restore(None) on the last rank
                    eng.save(root)
                    eng.restore(None if last else root)
                elif name.endswith("boom"):  # features whose reading raises, on the last rank
                    eng.lookup(_Boom() if last else feats, None if last else weights)
                else:
                    eng.save(root, extra_metadata={"note": {1, 2}})
                first = "no error"
            except Exception as e:
                first = f"{type(e).__name__}: {e}"
            left = sorted(os.listdir(root)) if os.path.isdir(root) else []
            eng.lookup(feats, weights)
            eng.apply_gradients(grads)
            raise RuntimeError(f"{first} | left={left} | then step={eng.step}")
        if name == "bad_gradients":
            # Gradients that float32 would cast silently (bools, strings, complex) and a NaN,
            # on the last rank only; every rank steps together after each.
            said = []
            for kind in (bool, str, complex, "nan"):
                eng.lookup(feats, weights)
                bad = dict(grads)
                if rank == world - 1:
                    a = np.array(grads["a"], dtype=np.float32)
                    if kind == "nan":
                        a[-1, 1] = np.nan
                        bad["a"] = a
                    else:
                        bad["a"] = a.astype(kind)
                try:
                    eng.apply_gradients(bad)
                    said.append("no error")
                except Exception as e:
                    said.append(f"{type(e).__name__}: {e}")
                eng.lookup(feats, weights)
                eng.apply_gradients(grads)
            raise RuntimeError(" | ".join(said) + f" | then step={eng.step}")
        if name == "stale_batch":
            # A batch looked up, then the tables restored: its gradients are of the old tables.
            saved = eng.save(os.path.join(out, "stale-batch"))
            old = eng.lookup_with_batch(feats, weights)[1]
            eng.restore(saved)
            before = eng.table_contents()
            new = eng.lookup_with_batch(feats, weights)[1]
            try:
                eng.apply_gradients(grads, batch=old if rank == world - 1 else new)
                first = "no error"
            except Exception as e:
                first = f"{type(e).__name__}: {e}"
            after = eng.table_contents()
            same = after["step"] == before["step"] and all(
                np.array_equal(a, after["tables"][t][k])
                for t, arrays in before["tables"].items()
                for k, a in arrays.items()
            )
            eng.lookup(feats, weights)
            eng.apply_gradients(grads)
            raise RuntimeError(f"{first} | unchanged={same} | then step={eng.step}")
        eng.lookup(feats, weights)
        if name.startswith("after_lookup:"):
            # Right after a training lookup the last rank makes another call than the update
            # the others make (and speculate on); then every rank steps together.
            other = {
                "contents": eng.table_contents,
                "eval": lambda: eng.lookup(feats, weights, training=False),
                "lookup": lambda: eng.lookup(feats, weights),
            }[name.split(":")[1]]
            try:
                other() if rank == world - 1 else eng.apply_gradients(grads)
                first = "no error"
            except Exception as e:
                first = f"{type(e).__name__}: {e}"
            eng.lookup(feats, weights)
            eng.apply_gradients(grads)
            raise RuntimeError(f"{first} | then step={eng.step}")
        if name == "kill" and rank == world - 1:
            os._exit(3)
        if name.startswith("hang") and rank == (0 if name == "hang_first" else world - 1):
            with open(os.path.join(out, "hung.pid"), "w") as f:
                f.write(str(os.getpid()))

            def stop(*args, **kwargs):
                os.kill(os.getpid(), signal.SIGSTOP)  # rank 0 kills it once it has its error

            if name == "hang_inside":  # stopped inside the update, its message sent
                eng._kept_batches = stop
            else:
                stop()
        eng.apply_gradients(grads)
        result = f"ok step={eng.step}"
    except Exception as e:  # the scenario's point: record which error and its message
        result = f"{type(e).__name__}: {e}"
    elapsed = time.monotonic() - start
    with open(path, "w") as f:
        f.write(f"{elapsed:.3f}\n{result}\n")
    hung = 0 if name == "hang_first" else world - 1
    if name.startswith("hang") and rank == (1 if hung == 0 else 0):
        # The default group's store lives in rank 0: stay until the other ranks that timed out
        # have asked it which rank is behind (their error written), then end the hung one.
        others = [
            os.path.join(out, f"{name}.rank{r}.txt") for r in range(world) if r not in (rank, hung)
        ]
        deadline = time.monotonic() + 30
        while not all(map(os.path.exists, others)) and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(os.path.join(out, "hung.pid")) as f:
            os.kill(int(f.read()), signal.SIGKILL)


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    if rank == world - 1 and "EE_TEST_DTYPES_LAST" in os.environ:  # the last rank's own
        os.environ["EE_TEST_DTYPES"] = os.environ["EE_TEST_DTYPES_LAST"]
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
            if name.startswith("equal:"):
                run_equal(rank, world, out, name)
            elif name.startswith("between:"):
                run_between(rank, world, out, name)
            elif name.startswith("failed:"):
                run_failed(rank, world, out, name)
            elif name.startswith("mixed:"):
                run_mixed(rank, world, out, name)
            elif name.startswith("whole:"):
                run_whole(rank, world, out, name)
            elif name.startswith("sweep:"):
                run_sweep(rank, world, out, name)
            elif name.startswith("speculate:"):
                run_speculate(rank, world, out, name)
            elif name == "layer":
                run_layer(rank, world, out, name)
            elif name == "build_fails":
                run_build_fails(rank, world, out, name)
            elif name == "load_pinned":
                run_load_pinned(rank, world, out, name)
            elif name == "reader_released":
                run_reader_released(rank, world, out, name)
            elif name == "last_step":
                run_last_step(rank, world, out, name)
            elif name.startswith("bad_counter:"):
                run_bad_counter(rank, world, out, name)
            elif name == "restore_other":
                run_restore_other(rank, world, out, name)
            elif name == "save_roots":
                run_save_roots(rank, world, out, name)
            elif name == "pacer":
                run_pacer(rank, world, out, name)
            elif name == "pacer_raises":
                run_pacer_raises(rank, world, out, name)
            elif name == "slow_hash":
                run_slow_hash(rank, world, out, name)
            elif name.startswith("restore_newest:"):
                run_restore_newest(rank, world, out, name)
            elif name.startswith("save_write_fails:"):
                run_save_write_fails(rank, world, out, name)
            elif name == "layer_refused":
                run_layer_refused(rank, world, out, name)
            elif name.startswith("ckpt_"):
                run_checkpoint(rank, world, out, name)
            elif name == "contents_by_name":
                run_contents_by_name(rank, world, out, name)
            elif name == "user_optimizer":
                run_user_optimizer(rank, world, out, name)
            elif name == "nonfinite":
                run_nonfinite(rank, world, out, name)
            elif name == "fill_fails":
                run_fill_fails(rank, world, out, name)
            elif name == "interrupted":
                run_interrupted(rank, world, out, name)
            elif name == "connect_first":
                run_connect_first(rank, world, out, name)
            elif name.partition(":")[0] == "midway":
                run_midway(rank, world, out, name)
            else:
                run_error(rank, world, out, name)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    os._exit(0)  # no destroy_process_group: a dead peer would make it wait


if __name__ == "__main__":
    main()
