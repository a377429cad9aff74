"""The keyed-table bench (issue 15): W1-keyed, W1-new, W4 and insertion run at a tiny scale and
print one table with the host line. Nothing here is timed against a bound: the figures come
from ``embengine bench --workloads W1-keyed W1-new W4 insert`` (docs/performance.md)."""

import numpy as np
import pytest

from embengine.bench import keyed
from embengine.bench.host import host
from embengine.bench.workloads import WORKLOADS, make_batches
from embengine.cli import main as cli_main


def test_resident_keys_are_random_64_bit_and_all_in_the_table():
    w = keyed._scaled(WORKLOADS["W1-lookup"], 0.0005)  # 8 tables x 500 keys, batch 4
    r = keyed.KeyedRunner(w, "SGD")
    assert all(len(np.unique(m)) == len(m) == 500 for m in r.maps)
    assert max(abs(int(k)) for m in r.maps for k in m) > 2**60  # not small ids
    stats = r.engine.table_stats()
    assert all(stats[f"t{t}"]["rows"] == 500 for t in range(8))
    batch = make_batches(w, 1)[0]
    feats = r.prepare(batch)
    np.testing.assert_array_equal(feats["f3"].ids, r.maps[3][batch.ids[3]])
    # The lookup-only step reads resident rows: the activations are the rows' sums, not zeros.
    acts = r.engine.lookup(feats, training=False)
    contents = r.engine.table_contents("t3")
    rows = dict(zip(contents["keys"].tolist(), contents["weights"], strict=True))
    bag = feats["f3"].ids[:20]
    want = np.sum([rows[int(k)] for k in bag], axis=0, dtype=np.float64)
    np.testing.assert_allclose(acts["f3"][0], want, rtol=1e-5)
    assert (r.engine.table_stats()["t3"]["rows"], r.engine.step) == (500, 0)


def test_every_batch_of_w1_new_brings_keys_no_batch_had():
    w = keyed._scaled(WORKLOADS["W1"], 0.0005)
    r = keyed.KeyedRunner(w, "SGD", new=True, expire_steps=2)
    seen = set()
    for batch in make_batches(w, 4):
        feats = r.prepare(batch)
        keys = set(feats["f0"].ids.tolist())
        assert not keys & seen
        assert len(keys) == len(np.unique(batch.ids[0]))  # the batch's duplicates are kept
        seen |= keys
        r.step(feats)
    st = r.engine.table_stats()["t0"]
    assert st["total"]["hits"] == 0 and st["total"]["expired"] > 0  # all new; old rows go


def test_the_keyed_bench_runs_every_workload_and_prints_one_table():
    results = keyed.run_keyed(
        list(keyed.KEYED_WORKLOADS), scale=0.0005, steps=2, warmup=0, log=lambda s: None
    )
    measures = [r.measure for r in results]
    assert measures == [
        "W1-keyed step, keyed / dense",
        "W1-keyed lookup-only, keyed / dense",
        "W1-new step, keyed / dense",
        "W3-keyed per id, W3 / W1 (keyed)",
        "W4 step time, 2nd half / 1st half",
        "W4 RSS, largest / smallest",
        "insertion, M new keys/s on 1 core",
        "bytes per key beyond the row",
    ]
    assert all(r.value > 0 and np.isfinite(r.value) for r in results)
    by = {r.measure: r for r in results}
    assert "to fill;" in by["W4 step time, 2nd half / 1st half"].detail  # the table filled
    assert "; dense W3 / W1 " in by["W3-keyed per id, W3 / W1 (keyed)"].detail
    assert by["bytes per key beyond the row"].value > 8  # an index slot at least
    lines = keyed.format_keyed(results, 0.0005).splitlines()
    assert lines[0] == host().describe()
    assert "scale 0.0005" in lines[1] and len(lines) == 3 + len(results)
    assert lines[-1].split()[:5] == ["bytes", "per", "key", "beyond", "the"]
    with pytest.raises(ValueError, match="scale must be in \\(0, 1\\]"):
        keyed.run_keyed(["insert"], scale=0)
    with pytest.raises(ValueError, match="unknown keyed workload 'W9'"):
        keyed.run_keyed(["W9"], scale=0.5)


def test_w4_fills_its_table_then_evicts_every_step():
    (drift, rss) = keyed.run_w4(0.0005, steps=4, log=lambda s: None)
    assert "to fill;" in drift.detail and "not full" not in drift.detail
    evicted = int(drift.detail.rsplit("; ", 1)[1].split()[0].replace(",", ""))
    assert evicted > 0 and rss.value >= 1.0


def test_the_cli_runs_the_keyed_table(capsys):
    assert cli_main(["bench", "--workloads", "insert", "--scale", "0.001"]) == 0
    out = capsys.readouterr().out
    assert host().describe() in out and "insertion, M new keys/s on 1 core" in out
