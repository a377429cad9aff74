"""A few cases of the differential fuzz of ShardedEngine against one EmbeddingEngine
(tests/dist_fuzz.py: random configurations and scripts; its campaigns run many more)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import dist_fuzz  # noqa: E402

LIMIT = 240  # seconds for one group of ranks and its cases, kernels loaded from the cache


@pytest.mark.parametrize(("world", "seed", "cases", "to"), [(2, 0, 8, 3), (3, 1, 6, 1)])
def test_random_configurations_train_on_ranks_as_on_one_engine(tmp_path, world, seed, cases, to):
    codes = dist_fuzz.spawn(world, tmp_path, seed, 0, cases, LIMIT)
    logs = "\n".join((tmp_path / f"log.rank{r}").read_text()[-3000:] for r in range(world))
    assert codes == [0] * world, logs
    lines = (tmp_path / "report.txt").read_text().splitlines()
    assert len(lines) == cases, logs
    assert [line for line in lines if not line.split(" ", 1)[1].startswith("ok")] == []
    # most cases build and train (a refusal by both engines is a case too, but not the point)
    trained = [line for line in lines if "both refuse" not in line]
    assert len(trained) >= cases // 2, lines
    # W -> W': ranks at another world size restore the checkpoints and train on
    codes = dist_fuzz.spawn(to, tmp_path, seed, 0, cases, LIMIT, reshard=True)
    logs = "\n".join((tmp_path / f"reshard{to}" / f"log.rank{r}").read_text() for r in range(to))
    assert codes == [0] * to, logs[-6000:]
    lines = (tmp_path / f"report.reshard{to}.txt").read_text().splitlines()
    assert len(lines) == cases, logs[-6000:]
    verdicts = [line.split(" ", 1)[1] for line in lines]
    assert [v for v in verdicts if not v.startswith(("ok", "skip"))] == []
    assert sum(v.startswith("ok") for v in verdicts) >= 2, lines


def test_the_cases_cover_what_the_fuzz_says_it_draws():
    drawn = [dist_fuzz.make_case(0, i) for i in range(200)]
    tables = [t for c in drawn for t in c["tables"]]
    features = [f for c in drawn for f in c["features"]]
    assert {t["vocab"] is None for t in tables} == {True, False}  # keyed and dense
    assert {t["optimizer"] for t in tables} == set(dist_fuzz.OPTIMIZERS)
    assert {t["sharding"] for t in tables} == {"row", "table"}
    assert {t["exchange"] for t in tables if t["vocab"] is None} == {"auto", "rows"}
    assert {t["exchange"] for t in tables if t["vocab"]} == {"auto", "rows", "sums"}
    assert {t["accumulate"] for t in tables} == {True, False}
    assert (
        {t["weights_dtype"] for t in tables}
        == {t["slots_dtype"] for t in tables}
        == {
            "float32",
            "bfloat16",
            "float16",
        }
    )
    assert {t["quantized"] for t in tables} == {True, False}
    assert any(f["sequence"] for f in features) and any(f["weighted"] for f in features)
    assert any(c["one_optimizer"] for c in drawn) and any(c["sharding_auto"] for c in drawn)
    keyed = [t for t in tables if t["vocab"] is None]
    assert {t["max_rows"] is None for t in keyed} == {True, False}
    assert {t["eviction"] for t in keyed if t["max_rows"]} == set(dist_fuzz.EVICTIONS)
    assert {t["expire_seconds"] is None for t in keyed} == {True, False}
    assert {t["insert_on"] for t in keyed} == {"lookup", "apply"}
    assert {t["sharding2"] for t in tables} == {"row", "table"}
    assert any(c["sharding2_auto"] for c in drawn)
    times = [c["times"] for c in drawn if c["times"] is not None]
    assert len(times) < len(drawn)  # timestamps on some cases, and every one that expires by them
    for c in drawn:
        assert c["times"] is not None or not any(t["expire_seconds"] for t in c["tables"])
    assert any(b < a for ts in times for (a, _), (b, _) in zip(ts, ts[1:], strict=False))
    assert any(u is not None for ts in times for _, u in ts)
    plans = [dist_fuzz.script(0, i, c) for i, c in enumerate(drawn)]
    assert {p["save_at"] < 0 for p in plans} == {True, False}
    assert all(p["save_at"] < c["steps"] - 1 for p, c in zip(plans, drawn, strict=True))
    assert {p["plain_save"] for p in plans} == {p["load"] for p in plans} == {True, False}
    # the same case on every rank: drawn from (seed, case) alone
    assert dist_fuzz.make_case(3, 5) == dist_fuzz.make_case(3, 5)
    feats, _, grads, spans = dist_fuzz.global_step(drawn[0], 1, 3)
    assert spans[0][0] == 0 and spans[-1][1] == len(next(iter(feats.values())))
    assert all(lo <= hi for lo, hi in spans)
