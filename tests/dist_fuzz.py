"""Differential fuzz of ShardedEngine against one EmbeddingEngine (issue 16's rule: W ranks
each passing their share of a batch train as one engine fed the concatenation; a checkpoint
restores at any world size, and to and from a plain engine).

    python tests/dist_fuzz.py --cases 40 --world 2             # a campaign: spawns the ranks
    python tests/dist_fuzz.py --cases 40 --world 3 --seed 7 --first 100 --to 1
    python tests/dist_fuzz.py --rank R --world W --port P --out DIR --seed S --first I --cases N

Case ``i`` of seed ``s`` draws (``make_case``) a configuration (1-3 tables, dense or keyed with
admission, expiry by steps or by data time (``expire_seconds``), ``max_rows`` with "lru" or
"lfu" eviction, dims 1-16, combiners, 16-bit weights or slots, simulated quantization, one
optimizer per table or one for all, gradient accumulation on or off, sequence features, per-id
weights, a sharding and an exchange per table or "auto", and another sharding for restoring at
another world size) and (``script``) a script of 2-5 steps (global batches with duplicates and
empty bags, split at random so that ranks go without samples; timestamps on the training calls,
mostly forward, some back, an update's sometimes newer; evaluation lookups before some updates;
``lookup_with_batch`` and ``batch=`` on some steps; ``table_contents`` after one step; a
checkpoint saved after some step and restored: the ranks' own, or the one engine's). Every rank
runs the script on a ShardedEngine; rank 0 runs it on one EmbeddingEngine too and compares its
own activations (rank 0's samples: equal up to float32 rounding of the bag sums), a
configuration both refuse (the same error type), a training lookup both refuse (a batch whose
keys need more than ``max_rows`` rows: then no update), every table's keys, weights and slots
(bit for bit), and a plain engine restoring the ranks' checkpoint (W -> 1) against the one
engine's state at that step (a keyed table's metadata too), then training on to the end as the
one engine did. It writes one line per case to OUT/report.txt: ``<case> ok ...`` or ``<case>
DIFF <what>``. A campaign then spawns ranks at each other world size W' (``--to``; default the
others of 1-3) that restore each case's checkpoint (``reshard_case``: W -> W') and run the rest
of the script against the one engine replayed from the case's seed, writing
OUT/report.reshard<W'>.txt. tests/test_distributed_fuzz.py runs a few cases; a campaign prints
the differences.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent

DIMS = (1, 2, 3, 4, 5, 8, 16)
COMBINERS = ("sum", "mean", "sqrtn")
OPTIMIZERS = (
    "sgd",
    "adagrad",
    "rowwise_adagrad",
    "adam",
    "adam_per_row",
    "ftrl",
    "momentum",
    "sgd_schedule",
)
DTYPES = ("float32", "float32", "bfloat16", "float16")  # stored; float32 math
KEY_POOL = 24  # keyed ids come from a pool this big: repeats across steps and ranks
EVICTIONS = ("lru", "lfu")


def _optimizer(name: str, dim: int, accumulate: bool):
    from embengine import optimizers as opt

    common = {"use_gradient_accumulation": accumulate}
    return {
        "sgd": lambda: opt.SGD(0.1, **common),
        "adagrad": lambda: opt.Adagrad(0.2, **common),
        "rowwise_adagrad": lambda: opt.Adagrad(0.2, hessian_compression_times=dim, **common),
        "adam": lambda: opt.Adam(0.05, **common),
        "adam_per_row": lambda: opt.Adam(0.05, bias_correction="per_row", **common),
        "ftrl": lambda: opt.FTRL(0.2, l1_regularization_strength=0.05, beta=0.5, **common),
        "momentum": lambda: opt.Momentum(0.1, momentum=0.9, **common),
        "sgd_schedule": lambda: opt.SGD(lambda step: 0.2 / (1 + step), **common),
    }[name]()


def make_case(seed: int, case_index: int) -> dict:
    """The configuration and script of one case, drawn from ``(seed, case)`` alone (every rank
    draws the same)."""
    rng = np.random.default_rng([seed, case_index])
    tables = []
    for t in range(int(rng.integers(1, 4))):
        keyed = bool(rng.random() < 0.35)
        tables.append(
            {
                "name": f"t{t}",
                "vocab": None if keyed else int(rng.integers(1, 50)),
                "dim": int(rng.choice(DIMS)),
                "combiner": str(rng.choice(COMBINERS)),
                "optimizer": str(rng.choice(OPTIMIZERS)),
                "accumulate": bool(rng.random() < 0.8),
                "threshold": int(rng.choice([0, 0, 0, 1, 2])) if keyed else 0,
                "expire": (None if rng.random() < 0.6 else int(rng.integers(1, 3)))
                if keyed
                else None,
                "sharding": str(rng.choice(["row", "table"])),
                "weights_dtype": str(rng.choice(DTYPES)),
                "slots_dtype": str(rng.choice(DTYPES)),
                "quantized": bool(rng.random() < 0.15),
                # a keyed table's owner resolves its keys first: it exchanges rows
                "exchange": str(
                    rng.choice(["auto", "rows"] if keyed else ["auto", "rows", "sums"])
                ),
            }
        )
    features = []
    for f in range(int(rng.integers(1, 5))):
        table = int(rng.integers(0, len(tables)))
        sequence = int(rng.choice([0, 0, 0, 2, 3]))
        features.append(
            {
                "name": f"f{f}",
                "table": table,
                "sequence": sequence,
                "weighted": bool(sequence == 0 and rng.random() < 0.4),
            }
        )
    case = {
        "tables": tables,
        "features": features,
        "one_optimizer": bool(rng.random() < 0.3),
        "sharding_auto": bool(rng.random() < 0.2),
        "steps": int(rng.integers(2, 6)),
        "batch_seed": int(rng.integers(0, 2**31)),
    }
    # Drawn from their own stream, so that the draws above are those of earlier campaigns.
    more = np.random.default_rng([seed, case_index, 3])
    for t in tables:
        keyed = t["vocab"] is None
        # max_rows small enough that some batches need more rows than it (both refuse)
        t["max_rows"] = int(more.integers(2, 14)) if keyed and more.random() < 0.5 else None
        t["eviction"] = str(more.choice(EVICTIONS))
        t["expire_seconds"] = int(more.integers(1, 5)) if keyed and more.random() < 0.4 else None
        # the sharding and exchange of the ranks that restore at another world size
        t["sharding2"] = str(more.choice(["row", "table"]))
        t["exchange2"] = str(more.choice(["auto", "rows"] if keyed else ["auto", "rows", "sums"]))
        t["insert_on"] = str(more.choice(["lookup", "lookup", "apply"]))
    case["sharding2_auto"] = bool(more.random() < 0.2)
    timed = any(t["expire_seconds"] for t in tables) or more.random() < 0.3
    case["times"] = _timestamps(more, case["steps"]) if timed else None
    return case


def _timestamps(rng, steps: int) -> list[tuple[int, int | None]]:
    """Each step's (lookup timestamp, apply_gradients' timestamp or None: the lookup's): data
    times (seconds) that mostly go forward by 0-3 s, sometimes back; an update's now and then
    newer than its lookup's."""
    now, out = int(rng.integers(0, 2**40)), []
    for _ in range(steps):
        now += int(rng.integers(-1, 4))
        out.append((now, now + int(rng.integers(0, 3)) if rng.random() < 0.25 else None))
    return out


def build(case: dict, second: bool = False):
    """(feature configs, the engine-wide optimizer or None, sharding, exchange) of ``case``;
    ``second``: the sharding and exchange of the ranks restoring at another world size."""
    import embengine as ee

    configs = []
    for t in case["tables"]:
        own = (
            None if case["one_optimizer"] else _optimizer(t["optimizer"], t["dim"], t["accumulate"])
        )
        dynamic = None
        if t["vocab"] is None:
            dynamic = ee.DynamicVocabulary(
                occurrence_threshold=t["threshold"],
                expire_steps=t["expire"],
                max_rows=t["max_rows"],
                eviction=t["eviction"],
                expire_seconds=t["expire_seconds"],
                insert_on=t["insert_on"],
            )
        configs.append(
            ee.TableConfig(
                t["vocab"],
                t["dim"],
                name=t["name"],
                combiner=t["combiner"],
                optimizer=own,
                initializer=ee.initializers.RandomUniform(-0.3, 0.3),
                weights_dtype=t["weights_dtype"],
                slots_dtype=t["slots_dtype"],
                quantization_config=(
                    ee.QuantizationConfig(num_buckets=64, lower=-0.25, upper=0.25)
                    if t["quantized"]
                    else None
                ),
                dynamic=dynamic,
            )
        )
    features = {
        f["name"]: ee.FeatureConfig(
            configs[f["table"]], **({"max_sequence_length": f["sequence"]} if f["sequence"] else {})
        )
        for f in case["features"]
    }
    first = case["tables"][0]
    optimizer = (
        _optimizer(first["optimizer"], first["dim"], first["accumulate"])
        if case["one_optimizer"]
        else None
    )
    used = [case["tables"][i] for i in sorted({f["table"] for f in case["features"]})]
    suffix = "2" if second else ""
    auto = case[f"sharding{suffix}_auto"]
    sharding = "auto" if auto else {t["name"]: t[f"sharding{suffix}"] for t in used}
    exchange = {t["name"]: t[f"exchange{suffix}"] for t in used}
    return features, optimizer, sharding, exchange


def global_step(case: dict, step: int, world: int, salt: int = 0):
    """(features, weights, gradients, each rank's [lo, hi) samples) of one step's global batch:
    bags of 0-4 ids with duplicates; keyed ids from a pool of KEY_POOL 62-bit keys."""
    rng = np.random.default_rng([case["batch_seed"], step, salt])
    batch = int(rng.integers(0, 9))
    pool = np.random.default_rng(case["batch_seed"]).integers(0, 2**62, KEY_POOL)
    feats, weights, grads = {}, {}, {}
    for f in case["features"]:
        t = case["tables"][f["table"]]
        bags = []
        for _ in range(batch):
            n = int(rng.integers(0, 5))
            if t["vocab"] is None:
                bags.append([int(k) for k in pool[rng.integers(0, 8 + 4 * step, n) % KEY_POOL]])
            else:
                bags.append([int(i) for i in rng.integers(0, t["vocab"], n)])
        feats[f["name"]] = bags
        if f["weighted"]:
            weights[f["name"]] = [
                [float(w) for w in rng.uniform(0.1, 2.0, len(b)).astype(np.float32)] for b in bags
            ]
        shape = (batch, f["sequence"], t["dim"]) if f["sequence"] else (batch, t["dim"])
        grads[f["name"]] = rng.normal(size=shape).astype(np.float32)
    cuts = np.sort(rng.integers(0, batch + 1, world - 1))
    bounds = [0, *map(int, cuts), batch]
    return feats, weights, grads, [(bounds[r], bounds[r + 1]) for r in range(world)]


def _cut(feats, weights, grads, lo, hi):
    return (
        {k: v[lo:hi] for k, v in feats.items()},
        {k: v[lo:hi] for k, v in weights.items()},
        {k: v[lo:hi] for k, v in grads.items()},
    )


def _contents(eng, names) -> dict:
    return {n: eng.table_contents(n) for n in names}


def _compare_contents(have: dict, want: dict, where: str) -> str | None:
    """None if every table's arrays are equal bit for bit, else what differs first."""
    for table, arrays in want.items():
        if sorted(have[table]) != sorted(arrays):
            return f"DIFF {where}: {table} holds {sorted(have[table])}, one engine {sorted(arrays)}"
        for key, a in arrays.items():
            b = have[table][key]
            if a.shape != b.shape or a.dtype != b.dtype or a.tobytes() != b.tobytes():
                return f"DIFF {where}: {table}/{key} differs ({b.shape} vs {a.shape})"
    return None


def script(seed: int, case_index: int, case: dict) -> dict:
    """What case ``case_index`` does besides training, drawn from ``(seed, case_index)``:
    ``save_at`` (the step after which the ranks save and restore; negative: none),
    ``look_at`` (``table_contents`` after that step too), ``by_batch`` (per step:
    ``lookup_with_batch``, then ``batch=``), ``plain_save`` (the ranks restore what the one
    engine saved at ``save_at`` instead of their own checkpoint) and ``load`` (the ranks at
    another world size use ``ShardedEngine.load``, else build the engine and ``restore``)."""
    rng = np.random.default_rng([seed, case_index, 1])
    save_at = int(rng.integers(-1, case["steps"] - 1))  # a step or more after it
    look_at = int(rng.integers(0, case["steps"]))
    by_batch = [bool(b) for b in rng.random(case["steps"]) < 0.3]
    more = np.random.default_rng([seed, case_index, 2])  # after the draws of earlier campaigns
    return {
        "save_at": save_at,
        "look_at": look_at,
        "by_batch": by_batch,
        "plain_save": bool(more.random() < 0.35),
        "load": bool(more.random() < 0.5),
    }


def _stamps(case: dict, step: int) -> tuple[dict, dict]:
    """The ``timestamp=`` keyword arguments of step ``step``'s training lookup and update."""
    if case["times"] is None:
        return {}, {}
    look, apply = case["times"][step]
    return {"timestamp": look}, ({} if apply is None else {"timestamp": apply})


class _Run:
    """A case's script on a ShardedEngine ``eng`` (every rank; None: the one engine alone)
    and, on rank 0, the one engine ``single`` fed the whole batches; ``verdict`` is the first
    difference (rank 0), after which the one engine is left alone. A training lookup that
    both refuse (a keyed table's ``max_rows``: a ValueError) has no update; an update both
    refuse is skipped too."""

    def __init__(self, case: dict, plan: dict, rank: int, world: int, eng, single) -> None:
        self.case, self.plan, self.rank, self.world = case, plan, rank, world
        self.eng, self.single = eng, single
        self.verdict: str | None = None
        self.refused = {"lookups": 0, "updates": 0}  # refused by both
        self.applied = 0  # updates: the engines' step
        self.halfway = False  # the last step was looked up, its update refused

    def live(self) -> bool:
        """Whether rank 0 still compares (no difference yet)."""
        return self.single is not None and self.verdict is None

    def differ(self, verdict: str | None) -> None:
        if self.verdict is None:
            self.verdict = verdict

    def _both(self, where: str, sharded, alone) -> tuple[bool, object, object]:
        """``sharded()`` on the ranks' engine and, on rank 0 while it compares, ``alone()`` on
        the one engine: (refused, what each returned). A refusal is a ValueError (the ranks
        raise it alike); one engine refusing alone is a difference. Without a ShardedEngine,
        the one engine's refusal."""
        got = want = refusal = error = None
        if self.eng is not None:
            try:
                got = sharded()
            except ValueError as e:
                refusal = e
        if self.live():
            try:
                want = alone()
            except ValueError as e:
                error = e
            if self.eng is None:
                refusal = error
            elif (refusal is None) != (error is None):
                self.differ(f"DIFF {where}: one engine {error!r}, sharded {refusal!r}"[:400])
        return refusal is not None, got, want

    def step(self, step: int) -> None:
        """Step ``step`` of the script: a training lookup, an evaluation lookup of other
        samples on odd steps, and the update, on both engines; rank 0 compares. ``halfway``:
        the step was looked up but its update refused (no checkpoint then)."""
        eng, single, case = self.eng, self.single, self.case
        feats, weights, grads, spans = global_step(case, step, self.world)
        lo, hi = spans[self.rank]
        mine = _cut(feats, weights, grads, lo, hi)
        look, apply = _stamps(case, step)
        self.halfway = False

        def lookup():
            if self.plan["by_batch"][step]:
                return eng.lookup_with_batch(mine[0], mine[1], **look)
            return eng.lookup(mine[0], mine[1], **look), None

        refused, got, want = self._both(
            f"step {step} lookup", lookup, lambda: single.lookup(feats, weights, **look)
        )
        acts, batch = (None, None) if got is None else got
        if step % 2 == 1:  # an evaluation lookup of other samples before the update
            efeats, eweights, _, espans = global_step(case, step, self.world, salt=1)
            elo, ehi = espans[self.rank]
            eacts = None
            if eng is not None:
                eacts = eng.lookup(*_cut(efeats, eweights, {}, elo, ehi)[:2], training=False)
            if self.live():
                ewant = single.lookup(efeats, eweights, training=False)
                if eng is not None:
                    self.differ(_compare_acts(eacts, ewant, elo, ehi, f"step {step} evaluation"))
        if refused:
            self.refused["lookups"] += 1
            return
        if self.live() and eng is not None:
            self.differ(_compare_acts(acts, want, lo, hi, f"step {step} lookup"))
        refused = self._both(
            f"step {step} update",
            lambda: eng.apply_gradients(mine[2], batch=batch, **apply),
            lambda: single.apply_gradients(grads, **apply),
        )[0]
        if refused:  # e.g. max_rows when keys get their rows at the update (insert_on="apply")
            self.refused["updates"] += 1
            self.halfway = True
            return
        self.applied += 1


def run_case(rank: int, world: int, seed: int, case_index: int, folder: str) -> str:
    """Run one case on this rank; rank 0's verdict ("ok ...", "ok (both refuse ...)" or
    "DIFF ...")."""
    import embengine as ee
    from embengine.distributed import ShardedEngine

    case = make_case(seed, case_index)
    features, optimizer, sharding, exchange = build(case)
    names = _names(case)
    single_error = sharded_error = None
    single = None
    if rank == 0:
        try:
            single = ee.EmbeddingEngine(features, optimizer=optimizer, seed=5)
        except (ValueError, TypeError) as e:
            single_error = e
    try:
        eng = ShardedEngine(
            features, optimizer=optimizer, seed=5, sharding=sharding, exchange=exchange, timeout=60
        )
    except (ValueError, TypeError) as e:
        sharded_error = e
    if sharded_error is not None or single_error is not None:
        if rank != 0:
            return ""
        if type(sharded_error) is type(single_error):
            return f"ok (both refuse: {single_error})".replace("\n", " ")[:300]
        return f"DIFF construction: one engine {single_error!r}, sharded {sharded_error!r}"
    plan = script(seed, case_index, case)
    run = _Run(case, plan, rank, world, eng, single)
    root = os.path.join(folder, f"case{case_index}")
    snapshot, saved_step, tags = None, None, []
    for step in range(case["steps"]):
        run.step(step)
        if step == plan["save_at"] and not run.halfway:  # a save then is refused (half a step)
            path = eng.save(root)
            if plan["plain_save"]:  # W = 1 -> W: the ranks restore the one engine's save
                if rank == 0:
                    try:
                        single.save(root + "plain")
                    except Exception as e:  # the ranks then fail to restore it: a difference
                        run.differ(f"DIFF the one engine's save: {e!r}")
                _barrier()
                eng.restore(root + "plain")
                tags.append("restored the one engine's save")
            else:
                eng.restore(path)
            saved_step = run.applied
            if rank == 0:
                snapshot = _state(single)
                if eng.step != saved_step:
                    run.differ(f"DIFF restore: step {eng.step}, saved at {saved_step}")
        if step == plan["look_at"]:
            have = _contents(eng, names)
            if run.live():
                run.differ(_compare_contents(have, _contents(single, names), f"after step {step}"))
    have = _contents(eng, names)
    if rank != 0:
        return ""
    if run.live():
        run.differ(_compare_contents(have, _contents(single, names), "end"))
    if run.live() and snapshot is not None:
        # W -> 1: a plain engine restores what the ranks saved: the one engine's state at that
        # step (rows, slots and a keyed table's metadata), then trains on as the one engine did.
        plain = ee.EmbeddingEngine(features, optimizer=optimizer, seed=5)
        plain.restore(root)
        run.differ(_compare_state(_state(plain), snapshot, "a plain engine's restore"))
        if run.live() and plain.step != saved_step:
            run.differ(f"DIFF restore: a plain engine's step {plain.step}, saved at {saved_step}")
        if run.live():
            on = _Run(case, plan, 0, 1, None, plain)
            for step in range(plan["save_at"] + 1, case["steps"]):
                on.step(step)
            end = _contents(single, names)
            run.differ(_compare_contents(_contents(plain, names), end, "a plain engine's resume"))
        tags.append("saved")
    tags += [f"{n} {what} refused" for what, n in run.refused.items() if n]
    return run.verdict or ("ok" + (f" [{', '.join(tags)}]" if tags else ""))


def reshard_case(rank: int, world: int, seed: int, case_index: int, folder: str) -> str:
    """Case ``case_index`` at another world size (``world``): if its run at its own world size
    (OUT/report.txt) was ok and saved, restore that checkpoint (``build(case, second=True)``'s
    sharding and exchange, by ``ShardedEngine.load`` or a new engine's ``restore``) and run the
    rest of the script; rank 0 compares against the one engine replayed from the case's seed up
    to the save. "skip ..." if the case has nothing to restore."""
    import embengine as ee
    from embengine.distributed import ShardedEngine

    case = make_case(seed, case_index)
    plan = script(seed, case_index, case)
    root = os.path.join(folder, f"case{case_index}")
    first = _verdicts(folder).get(case_index, "")
    if plan["save_at"] < 0 or not os.path.isdir(root):
        return "skip (no checkpoint)"
    if not first.startswith("ok"):
        return f"skip (at its own world size: {first[:60]})"
    features, optimizer, sharding, exchange = build(case, second=True)
    names = _names(case)
    schedule = any(t["optimizer"] == "sgd_schedule" for t in case["tables"])
    how = "load" if plan["load"] and not schedule else "restore"  # a callable lr: not stored
    if how == "load":
        eng = ShardedEngine.load(root, sharding=sharding, exchange=exchange, timeout=60)
    else:
        eng = ShardedEngine(
            features, optimizer=optimizer, seed=5, sharding=sharding, exchange=exchange, timeout=60
        )
        eng.restore(root)
    single = None
    if rank == 0:
        single = ee.EmbeddingEngine(features, optimizer=optimizer, seed=5)
        replay = _Run(case, plan, 0, 1, None, single)
        for step in range(plan["save_at"] + 1):
            replay.step(step)
    run = _Run(case, plan, rank, world, eng, single)
    have = _contents(eng, names)
    if rank == 0:
        run.differ(_compare_contents(have, _contents(single, names), f"{how} at world {world}"))
        if eng.step != single.step:
            run.differ(f"DIFF {how} at world {world}: step {eng.step}, one engine {single.step}")
    for step in range(plan["save_at"] + 1, case["steps"]):
        run.step(step)
    have = _contents(eng, names)
    if rank != 0:
        return ""
    if run.live():
        run.differ(_compare_contents(have, _contents(single, names), "end"))
    steps = case["steps"] - plan["save_at"] - 1
    return run.verdict or f"ok [{how}, {steps} steps on]"


def _names(case: dict) -> list[str]:
    """The tables the case's features use (the engines hold these)."""
    return sorted({case["tables"][f["table"]]["name"] for f in case["features"]})


def _verdicts(folder: str) -> dict[int, str]:
    """The verdicts in FOLDER/report.txt by case."""
    path = Path(folder) / "report.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    return {int(i): v for i, v in (line.split(" ", 1) for line in lines)}


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _state(eng) -> dict:
    """A copy of a plain engine's state (``state_dict``: keyed tables' metadata too)."""
    return copy.deepcopy(eng.state_dict())


def _compare_state(have: dict, want: dict, where: str) -> str | None:
    """None if the states' steps and every table's entries are equal bit for bit."""
    if have["step"] != want["step"]:
        return f"DIFF {where}: step {have['step']}, one engine {want['step']}"
    for table, entries in want["tables"].items():
        mine = have["tables"][table]
        if sorted(mine) != sorted(entries):
            return f"DIFF {where}: {table} holds {sorted(mine)}, one engine {sorted(entries)}"
        for key, a in entries.items():
            a, b = np.asarray(a), np.asarray(mine[key])
            if a.shape != b.shape or a.dtype != b.dtype or a.tobytes() != b.tobytes():
                return f"DIFF {where}: {table}/{key} differs ({b.tolist()[:8]} vs {a.tolist()[:8]})"
    return None


def _compare_acts(have: dict, want: dict, lo: int, hi: int, where: str) -> str | None:
    for k, w in want.items():
        mine = w[lo:hi]
        if k not in have or have[k].shape != mine.shape:
            shape = None if k not in have else have[k].shape
            return f"DIFF {where}: feature {k} shape {shape}, one engine {mine.shape}"
        if not np.allclose(have[k], mine, rtol=1e-6, atol=1e-7):
            worst = float(np.max(np.abs(have[k] - mine)))
            return f"DIFF {where}: feature {k} off by {worst:.3g}"
    return None


def rank_main(args) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(seconds=60),
    )
    out = Path(args.out)
    name = "report.txt" if not args.reshard else f"report.reshard{args.world}.txt"
    report = open(out / name, "a") if args.rank == 0 else None  # noqa: SIM115
    case = reshard_case if args.reshard else run_case
    try:
        for i in range(args.first, args.first + args.cases):
            try:
                verdict = case(args.rank, args.world, args.seed, i, str(out))
            except Exception as e:  # a crash of one case: named, and the ranks go on if they can
                verdict = f"DIFF raised {type(e).__name__}: {e}".replace("\n", " ")[:400]
                traceback.print_exc()
            if report is not None:
                report.write(f"{i} {verdict}\n")
                report.flush()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    os._exit(0)  # no destroy_process_group: a dead peer would make it wait


def spawn(
    world: int, out: Path, seed: int, first: int, cases: int, limit: float, reshard: bool = False
) -> list:
    """Run ``world`` ranks on cases ``first ..``; their exit codes (None: killed at ``limit``).
    They write OUT/report.txt and log to OUT/log.rank<r>; ``reshard``: they restore at this
    world size what an earlier spawn's ranks saved in OUT (``reshard_case``), write
    OUT/report.reshard<world>.txt and log to OUT/reshard<world>/log.rank<r>."""
    from _ranks import run_ranks

    from embengine.training.ranks import free_port

    port = free_port()
    argv = ["--world", str(world), "--port", str(port), "--out", str(out), "--seed", str(seed)]
    argv += ["--first", str(first), "--cases", str(cases)] + (["--reshard"] if reshard else [])
    logs = out / f"reshard{world}" if reshard else out
    return run_ranks(lambda r: [__file__, "--rank", str(r), *argv], world, logs, limit)


def _report(out: Path, name: str, codes: list, world: int, logs: Path, start: float) -> None:
    lines = (out / name).read_text().splitlines() if (out / name).exists() else []
    bad = [line for line in lines if " DIFF " in f" {line}"]
    done = sum(" ok" in f" {line}" for line in lines)
    print(f"{name}: {len(lines)} cases ({done} ok) in {time.monotonic() - start:.0f} s, ", end="")
    print(f"exit codes {codes}")
    print("\n".join(bad) if bad else "no difference")
    if codes != [0] * world:
        print((logs / "log.rank0").read_text()[-3000:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--port", type=int)
    parser.add_argument("--out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--cases", type=int, default=40)
    parser.add_argument("--limit", type=float, default=1800.0, help="seconds for all cases")
    parser.add_argument(
        "--to", type=int, nargs="*", help="world sizes that restore the checkpoints (default: 1-3)"
    )
    parser.add_argument("--reshard", action="store_true", help="(a rank) restore at --world")
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args)
        return
    sys.path.insert(0, str(HERE.parent))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        start = time.monotonic()
        codes = spawn(args.world, out, args.seed, args.first, args.cases, args.limit)
        _report(out, "report.txt", codes, args.world, out, start)
        others = [w for w in (1, 2, 3) if w != args.world] if args.to is None else args.to
        for w in others:  # W -> W': the ranks at W' restore what the ranks at W saved
            start = time.monotonic()
            codes = spawn(w, out, args.seed, args.first, args.cases, args.limit, reshard=True)
            _report(out, f"report.reshard{w}.txt", codes, w, out / f"reshard{w}", start)


if __name__ == "__main__":
    main()
