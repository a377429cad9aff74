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


@pytest.mark.parametrize(("world", "seed", "cases"), [(2, 0, 8), (3, 1, 6)])
def test_random_configurations_train_on_ranks_as_on_one_engine(tmp_path, world, seed, cases):
    codes = dist_fuzz.spawn(world, tmp_path, seed, 0, cases, LIMIT)
    logs = "\n".join((tmp_path / f"log.rank{r}").read_text()[-3000:] for r in range(world))
    assert codes == [0] * world, logs
    lines = (tmp_path / "report.txt").read_text().splitlines()
    assert len(lines) == cases, logs
    assert [line for line in lines if not line.split(" ", 1)[1].startswith("ok")] == []
    # most cases build and train (a refusal by both engines is a case too, but not the point)
    assert sum(line.endswith(" ok") for line in lines) >= cases // 2, lines


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
    # the same case on every rank: drawn from (seed, case) alone
    assert dist_fuzz.make_case(3, 5) == dist_fuzz.make_case(3, 5)
    feats, _, grads, spans = dist_fuzz.global_step(drawn[0], 1, 3)
    assert spans[0][0] == 0 and spans[-1][1] == len(next(iter(feats.values())))
    assert all(lo <= hi for lo, hi in spans)
