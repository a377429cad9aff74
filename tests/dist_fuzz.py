"""Differential fuzz of ShardedEngine against one EmbeddingEngine (issue 16's rule: W ranks
each passing their share of a batch train as one engine fed the concatenation).

    python tests/dist_fuzz.py --cases 40 --world 2             # a campaign: spawns the ranks
    python tests/dist_fuzz.py --cases 40 --world 3 --seed 7 --first 100
    python tests/dist_fuzz.py --rank R --world W --port P --out DIR --seed S --first I --cases N

Case ``i`` of seed ``s`` draws (``make_case``) a configuration (1-3 tables, dense or keyed with
admission and expiry, dims 1-16, combiners, 16-bit weights or slots, simulated quantization, one
optimizer per table or one for all, gradient accumulation on or off, sequence features, per-id
weights, a sharding and an exchange per table or "auto") and a script of 2-5 steps (global
batches with duplicates and empty bags, split at random so that ranks go without samples;
evaluation lookups before some updates; ``lookup_with_batch`` and ``batch=`` on some steps;
``table_contents`` after one step; a checkpoint saved and restored after some step). Every rank
runs the script on a ShardedEngine; rank 0 runs it on one EmbeddingEngine too and compares its
own activations (rank 0's samples: equal up to float32 rounding of the bag sums), a
configuration both refuse (the same error type), every table's keys, weights and slots (bit for
bit), and a plain engine restoring the ranks' checkpoint against the one engine's tables at
that step. It writes one line per case to OUT/report.txt: ``<case> ok ...`` or ``<case> DIFF
<what>``. tests/test_distributed_fuzz.py runs a few cases; a campaign prints the differences.
"""

from __future__ import annotations

import argparse
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


def make_case(seed: int, case: int) -> dict:
    """The configuration and script of one case, drawn from ``(seed, case)`` alone (every rank
    draws the same)."""
    rng = np.random.default_rng([seed, case])
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
    return {
        "tables": tables,
        "features": features,
        "one_optimizer": bool(rng.random() < 0.3),
        "sharding_auto": bool(rng.random() < 0.2),
        "steps": int(rng.integers(2, 6)),
        "batch_seed": int(rng.integers(0, 2**31)),
    }


def build(case: dict):
    """(feature configs, the engine-wide optimizer or None, sharding, exchange) of ``case``."""
    import embengine as ee

    configs = []
    for t in case["tables"]:
        own = (
            None if case["one_optimizer"] else _optimizer(t["optimizer"], t["dim"], t["accumulate"])
        )
        dynamic = None
        if t["vocab"] is None:
            dynamic = ee.DynamicVocabulary(
                occurrence_threshold=t["threshold"], expire_steps=t["expire"]
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
    sharding = "auto" if case["sharding_auto"] else {t["name"]: t["sharding"] for t in used}
    exchange = {t["name"]: t["exchange"] for t in used}
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


def run_case(rank: int, world: int, seed: int, case_index: int, folder: str) -> str:
    """Run one case on this rank; rank 0's verdict ("ok", "both refuse ..." or "DIFF ...")."""
    import embengine as ee
    from embengine.distributed import ShardedEngine

    case = make_case(seed, case_index)
    features, optimizer, sharding, exchange = build(case)
    names = sorted({case["tables"][f["table"]]["name"] for f in case["features"]})
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
    verdict, snapshot = None, None
    script = np.random.default_rng([seed, case_index, 1])
    save_at = int(script.integers(-2, case["steps"]))  # negative: no checkpoint
    look_at = int(script.integers(0, case["steps"]))  # table_contents after this step too
    by_batch = script.random(case["steps"]) < 0.3  # lookup_with_batch, then batch=
    for step in range(case["steps"]):
        feats, weights, grads, spans = global_step(case, step, world)
        lo, hi = spans[rank]
        mine = _cut(feats, weights, grads, lo, hi)
        batch = None
        if by_batch[step]:
            acts, batch = eng.lookup_with_batch(mine[0], mine[1])
        else:
            acts = eng.lookup(mine[0], mine[1])
        want = single.lookup(feats, weights) if rank == 0 else None
        if step % 2 == 1:  # an evaluation lookup of other samples before the update
            efeats, eweights, _, espans = global_step(case, step, world, salt=1)
            elo, ehi = espans[rank]
            eacts = eng.lookup(*_cut(efeats, eweights, {}, elo, ehi)[:2], training=False)
            if rank == 0 and verdict is None:
                ewant = single.lookup(efeats, eweights, training=False)
                verdict = _compare_acts(eacts, ewant, elo, ehi, f"step {step} evaluation")
        if rank == 0 and verdict is None:
            verdict = _compare_acts(acts, want, lo, hi, f"step {step} lookup")
        eng.apply_gradients(mine[2], batch=batch)
        if rank == 0:
            single.apply_gradients(grads)
        if step == save_at:
            path = eng.save(os.path.join(folder, f"case{case_index}"))
            eng.restore(path)
            if rank == 0:
                snapshot = _contents(single, names)
        if step == look_at:
            have = _contents(eng, names)
            if rank == 0 and verdict is None:
                verdict = _compare_contents(have, _contents(single, names), f"after step {step}")
    have = _contents(eng, names)
    if rank != 0:
        return ""
    if verdict is None:
        verdict = _compare_contents(have, _contents(single, names), "end")
    if verdict is None and snapshot is not None:
        # A plain engine restores what the ranks saved: the one engine's tables at that step.
        plain = ee.EmbeddingEngine(features, optimizer=optimizer, seed=5)
        plain.restore(os.path.join(folder, f"case{case_index}"))
        verdict = _compare_contents(_contents(plain, names), snapshot, "a plain engine's restore")
        if verdict is None and plain.step != save_at + 1:
            verdict = f"DIFF restore: a plain engine's step {plain.step}, saved at {save_at + 1}"
    return verdict or "ok"


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
    report = open(out / "report.txt", "a") if args.rank == 0 else None  # noqa: SIM115
    try:
        for i in range(args.first, args.first + args.cases):
            try:
                verdict = run_case(args.rank, args.world, args.seed, i, str(out))
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


def spawn(world: int, out: Path, seed: int, first: int, cases: int, limit: float) -> list:
    """Run ``world`` ranks on cases ``first ..``; their exit codes (None: killed at ``limit``)."""
    from _ranks import run_ranks

    from embengine.training.ranks import free_port

    port = free_port()
    argv = ["--world", str(world), "--port", str(port), "--out", str(out), "--seed", str(seed)]
    argv += ["--first", str(first), "--cases", str(cases)]
    codes = run_ranks(lambda r: [__file__, "--rank", str(r), *argv], world, out, limit)
    return codes


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
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args)
        return
    sys.path.insert(0, str(HERE.parent))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        start = time.monotonic()
        codes = spawn(args.world, out, args.seed, args.first, args.cases, args.limit)
        lines = (
            (out / "report.txt").read_text().splitlines() if (out / "report.txt").exists() else []
        )
        bad = [line for line in lines if " DIFF " in f" {line}"]
        print(f"{len(lines)} cases in {time.monotonic() - start:.0f} s, exit codes {codes}")
        print("\n".join(bad) if bad else "no difference")
        if codes != [0] * args.world:
            print((out / "log.rank0").read_text()[-3000:])


if __name__ == "__main__":
    main()
