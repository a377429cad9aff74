"""ShardedEngine with 16-bit tables: float16 / bfloat16 weights and slots, trained, gathered,
saved and restored across world sizes exactly as one EmbeddingEngine of the same tables.

The ranks are the workers of test_distributed.py and test_distributed_keyed.py, their tables
made 16-bit by $EE_TEST_DTYPES ("<weights>,<slots>"); the single engine here reads the same
variable. A 16-bit update rounds stochastically with a stream keyed by the table and the row's
id (a keyed table's key), so a shard that rounded by its local row would differ from the
single engine at once: every comparison below is bit for bit (activations of a "sums"
exchange up to float32 rounding of the partial sums' order, as in float32).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("ml_dtypes")

import test_distributed as td  # noqa: E402
import test_distributed_keyed as tk  # noqa: E402
from test_distributed import one_rank_group  # noqa: E402, F401 (a fixture)

import embengine as ee  # noqa: E402

# (weights_dtype, slots_dtype): both 16-bit, each of them alone, and float16 weights.
PAIRS = [
    ("bfloat16", "bfloat16"),
    ("float16", "bfloat16"),
    ("float32", "bfloat16"),
    ("bfloat16", "float32"),
]
# Every optimizer family on the pair that stores everything in 16 bits; the others on a few.
ALL = ["sgd", "adagrad", "adam", "ftrl", "rowwise_adagrad", "adagrad_no_accumulation"]
SOME = ["sgd", "adam", "rowwise_adagrad"]
# dist_worker's "mixed" scenarios: each table its own dtypes, whatever $EE_TEST_DTYPES says
MIXED = [f"mixed:{s}:{x}" for s in ("row", "table") for x in ("rows", "sums")]


def _scenarios(pair: tuple[str, str]) -> list[str]:
    names = ALL if pair == PAIRS[0] else SOME
    return [f"equal:{o}:{s}:{x}" for o in names for s in ("row", "table") for x in ("rows", "sums")]


def _env(pair: tuple[str, str]) -> dict[str, str]:
    return {"EE_TEST_DTYPES": ",".join(pair)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(world, dtype pair) -> the folder of its ranks' results (spawned on first use)."""
    done: dict = {}

    def get(world: int, pair: tuple[str, str]):
        key = (world, pair)
        if key not in done:
            out = tmp_path_factory.mktemp(f"w{world}-{'-'.join(pair)}")
            scenarios = _scenarios(pair) if world == 2 else _scenarios(PAIRS[0])[::5]
            if pair == PAIRS[0]:  # tables of their own dtypes ($EE_TEST_DTYPES unread)
                scenarios = scenarios + MIXED
            codes = td.spawn(world, out, scenarios, env=_env(pair))
            assert codes == [0] * world, td.rank_logs(out, world)
            done[key] = out
        return done[key]

    return get


def _same(have: np.ndarray, want: np.ndarray, what) -> None:
    """Bit for bit, in the same stored dtype (np.load gives a bfloat16 array back as 2-byte
    void: the bytes and the item size say it all)."""
    assert have.shape == want.shape, (what, have.shape, want.shape)
    assert have.dtype.itemsize == want.dtype.itemsize, (what, have.dtype, want.dtype)
    assert have.tobytes() == want.tobytes(), what


CASES = [(2, p, n) for p in PAIRS for n in _scenarios(p)]
CASES += [(3, PAIRS[0], n) for n in _scenarios(PAIRS[0])[::5]]


@pytest.mark.parametrize(("world", "pair", "name"), CASES)
def test_sharded_16bit_training_equals_one_engine(runs, monkeypatch, world, pair, name):
    out = runs(world, pair)
    monkeypatch.setenv("EE_TEST_DTYPES", ",".join(pair))
    _, optimizer_name, sharding, exchange = name.split(":")
    acts, single = td.single_engine_run(optimizer_name, world)
    state = single.state_dict()
    assert state["tables"]["big"]["weights"].dtype.itemsize == (4 if pair[0] == "float32" else 2)
    for rank in range(world):
        got = np.load(out / f"{name.replace(':', '_')}.rank{rank}.npz")
        for step in range(td.worker.STEPS):
            exchanged = got[f"exchanged{step}"].tolist()
            assert set(exchanged) == {exchange}, exchanged
            for k, want in acts[step][rank].items():
                have = got[f"act{step}/{k}"]
                if exchange == "rows":  # pooled by their own rank from the same rows
                    _same(have, want, (rank, step, k))
                else:  # partial sums added in rank order
                    np.testing.assert_allclose(have, want, rtol=1e-6, atol=1e-7)
        assert int(got["step"]) == state["step"] == td.worker.STEPS
        for table, arrays in state["tables"].items():
            for key, want in arrays.items():
                _same(got[f"table/{table}/{key}"], want, (rank, table, key))


@pytest.mark.parametrize("pair", PAIRS, ids=str)
@pytest.mark.parametrize("exchange", ["rows", "sums"])
def test_16bit_rows_travel_as_stored(runs, pair, exchange):
    # A pulled row's 16-bit weights cross the wire as their bits (half the float32 bytes; the
    # rank that pools them widens them); partial sums and gradient rows stay float32.
    out = runs(2, pair)
    value_bytes = 4 if pair[0] == "float32" else 2
    for rank in range(2):
        got = np.load(out / f"equal_sgd_row_{exchange}.rank{rank}.npz")
        for step in range(td.worker.STEPS):
            exchanged = dict(zip(td.worker.TABLES, got[f"exchanged{step}"].tolist(), strict=True))
            want = td.modelled_bytes(step, rank, 2, exchanged, value_bytes)
            assert tuple(got[f"bytes{step}"]) == want, (rank, step, exchanged)


@pytest.mark.parametrize("world", [2, 3])
def test_tables_of_their_own_dtypes_odd_widths_and_quantized(runs, world):
    # Per table its own dtypes (bf16 / f16, f32 / bf16, f16 / f32: two row messages a lookup,
    # rows and float32 views of 16-bit rows), widths 5, 3 and 7, a quantized table, Adam's
    # int32 per-row step slot; evaluation and training lookups.
    scenarios = MIXED
    out = runs(world, PAIRS[0])
    features, o = td.worker.mixed_features()
    single = ee.EmbeddingEngine(features, optimizer=o, seed=3)
    want = {}
    for step in range(td.worker.MIXED_STEPS):
        feats, grads = td.worker.mixed_batch(step)
        want[f"eval{step}"] = single.lookup(feats, training=False)
        want[f"act{step}"] = single.lookup(feats)
        single.apply_gradients(grads)
    state = single.state_dict()
    assert state["tables"]["m0"]["weights"].dtype.itemsize == 2
    for name in scenarios:
        ranks = [np.load(out / f"{name.replace(':', '_')}.rank{r}.npz") for r in range(world)]
        for step in range(td.worker.MIXED_STEPS):
            for kind in ("eval", "act"):
                for k, w in want[f"{kind}{step}"].items():
                    cat = np.concatenate([got[f"{kind}{step}/{k}"] for got in ranks])
                    if name.endswith(":rows"):
                        _same(cat, w, (name, kind, step, k))
                    else:
                        np.testing.assert_allclose(cat, w, rtol=1e-6, atol=1e-7)
        for got in ranks:
            for table, arrays in state["tables"].items():
                for key, a in arrays.items():
                    _same(got[f"table/{table}/{key}"], a, (name, table, key))


def test_the_sums_saving_counts_a_pulled_weight_as_stored():
    from embengine.distributed.sharding import sums_saving

    # 10 remote ids, 3 gradient rows, dim 8: (8 + b 8) 10 - 4 8 3
    assert sums_saving(8, 10, 3) == (8 + 32) * 10 - 96
    assert sums_saving(8, 10, 3, value_bytes=2) == (8 + 16) * 10 - 96


@pytest.mark.usefixtures("one_rank_group")
def test_auto_sharding_weighs_a_16bit_tables_pulled_rows_as_stored():
    # "auto" places tables by their expected traffic, the cost model's per id: pulled id and
    # row (8 + b dim, b = 2 for 16-bit weights: the rows travel as stored), pushed occurrence
    # (20), float32 gradient row (4 dim). Two tables alike but for the weights' dtype: the
    # 16-bit one 28 + 6 * 8 = 76 bytes an id, the float32 one 28 + 8 * 8 = 92 (not 50% each).
    from embengine.distributed import ShardedEngine
    from embengine.distributed.sharding import expected_traffic

    features = {
        f"f{i}": ee.FeatureConfig(ee.TableConfig(100, 8, name=f"t{i}", weights_dtype=w))
        for i, w in enumerate(["bfloat16", "float32"])
    }
    plan = ShardedEngine(features, optimizer=ee.optimizers.SGD(0.1), sharding="auto").plan
    assert plan["t0"].endswith(f"({round(100 * 76 / 168)}% of the expected traffic)"), plan
    assert plan["t1"].endswith(f"({round(100 * 92 / 168)}% of the expected traffic)"), plan
    assert expected_traffic(8, [1, 3], value_bytes=2) == 4 * 76
    assert expected_traffic(8, [1]) == 92


def test_16bit_checkpoints_move_between_world_sizes_and_a_plain_engine(tmp_path, monkeypatch):
    # bfloat16 weights, float16 slots (FTRL: two of them). Save at 3 ranks; restore at 2 and
    # into a plain engine; a plain engine's checkpoint restores at 2. Each continues to the
    # end of the uninterrupted single engine's run, bit for bit; the files are the plain
    # engine's, byte for byte, in the stored dtypes.
    pair = ("bfloat16", "float16")
    monkeypatch.setenv("EE_TEST_DTYPES", ",".join(pair))
    _, single = td.single_engine_run(td.worker.CKPT_OPTIMIZER, 1)
    want = single.state_dict()
    features, o = td.worker.make_features(td.worker.CKPT_OPTIMIZER)
    plain = ee.EmbeddingEngine(features, optimizer=o, seed=3)
    for step in range(2):
        feats, weights, grads = td.worker.global_batch(step)
        plain.lookup(feats, weights)
        plain.apply_gradients(grads)
    plain_path = plain.save(tmp_path / "ckpt" / "w1")
    env = {"CKPT_ROOT": str(tmp_path / "ckpt"), **_env(pair)}
    out3, out2 = tmp_path / "w3", tmp_path / "w2"
    codes = td.spawn(3, out3, ["ckpt_save:w3"], env=env)
    assert codes == [0] * 3, td.rank_logs(out3, 3)
    for r in range(3):
        _assert_end(out3 / f"ckpt_save_w3.rank{r}.npz", want)
    (w3_path,) = (tmp_path / "ckpt" / "w3").iterdir()
    manifest = json.loads((w3_path / "manifest.json").read_text())
    assert {(t["weights_dtype"], t["slots_dtype"]) for t in manifest["tables"]} == {pair}
    plain_manifest = json.loads((plain_path / "manifest.json").read_text())
    for t in plain_manifest["tables"]:
        same = (w3_path / t["file"]).read_bytes() == (plain_path / t["file"]).read_bytes()
        assert same, t["name"]
    loaded = ee.EmbeddingEngine.load(w3_path)
    assert loaded.step == 2
    feats, weights, grads = td.worker.global_batch(2)
    loaded.lookup(feats, weights)
    loaded.apply_gradients(grads)
    for table, arrays in want["tables"].items():
        for key, a in arrays.items():
            _same(loaded.state_dict()["tables"][table][key], a, (table, key))
    codes = td.spawn(2, out2, ["ckpt_restore:w3", "ckpt_restore:w1"], env=env)
    assert codes == [0] * 2, td.rank_logs(out2, 2)
    for r in range(2):
        _assert_end(out2 / f"ckpt_restore_w3.rank{r}.npz", want)
        _assert_end(out2 / f"ckpt_restore_w1.rank{r}.npz", want)


def _assert_end(path, want: dict) -> None:
    got = np.load(path)
    assert int(got["step"]) == want["step"]
    for table, arrays in want["tables"].items():
        for key, a in arrays.items():
            _same(got[f"table/{table}/{key}"], a, (path.name, table, key))


@pytest.mark.usefixtures("one_rank_group")
def test_a_16bit_checkpoint_is_refused_by_a_float32_sharded_engine(tmp_path, monkeypatch):
    # No silent cast: restoring bfloat16 tables into float32 ones fails, the tables unchanged;
    # the engine of the checkpoint's own dtypes restores it.
    from embengine.checkpoint import CheckpointError
    from embengine.distributed import ShardedEngine

    monkeypatch.setenv("EE_TEST_DTYPES", "bfloat16,bfloat16")
    features16, o = td.worker.make_features(td.worker.CKPT_OPTIMIZER)
    path = ee.EmbeddingEngine(features16, optimizer=o, seed=3).save(tmp_path / "ckpt")
    monkeypatch.setenv("EE_TEST_DTYPES", "float32,float32")
    features, o = td.worker.make_features(td.worker.CKPT_OPTIMIZER)
    eng = ShardedEngine(features, optimizer=o, seed=7)
    before = eng.table_contents()["tables"]["big"]["weights"].copy()
    with pytest.raises(CheckpointError, match="stores weights_dtype 'bfloat16', the engine"):
        eng.restore(path)
    assert np.array_equal(eng.table_contents()["tables"]["big"]["weights"], before)
    eng16 = ShardedEngine(features16, optimizer=o, seed=7)
    assert eng16.restore(path).step == 0
    assert eng16.table_contents()["tables"]["big"]["weights"].dtype.itemsize == 2


def test_ranks_with_other_table_dtypes_fail_at_construction(tmp_path):
    out = tmp_path / "out"
    env = {"EE_TEST_DTYPES": "bfloat16,bfloat16", "EE_TEST_DTYPES_LAST": "float16,bfloat16"}
    codes = td.spawn(2, out, ["equal:sgd:row:rows"], env=env)
    assert codes == [1, 1], td.rank_logs(out, 2)
    log = (out / "log.rank0").read_text()
    assert "ranks [1] built a ShardedEngine with another configuration (tables and their " in log


KEYED = ["keyed:sgd:1:none", "keyed:adam:2:steps", "keyed:ftrl:1:seconds", "apply:adam"]
EVICT = "evict:adam:lfu:lookup:0:steps"  # max_rows over the shards, 16-bit rows


@pytest.mark.parametrize("pair", [("float16", "bfloat16")])
def test_keyed_16bit_sharded_training_equals_one_engine(tmp_path, monkeypatch, pair):
    monkeypatch.setenv("EE_TEST_DTYPES", ",".join(pair))
    out = tmp_path / "out"
    codes = tk.spawn(2, out, [*KEYED, EVICT], env=_env(pair))
    assert codes == [0, 0], td.rank_logs(out, 2)
    want = tk.single_evict(EVICT)
    assert want[f"evicted{tk.worker.EVICT_STEPS - 1}"] >= 9
    ranks = [dict(np.load(out / f"{EVICT.replace(':', '_')}.rank{r}.npz")) for r in range(2)]
    for got in ranks:
        for key, w in want.items():
            if key.startswith("step") and not key.endswith("/d/keys"):
                _same(got[key], w, (EVICT, key))
            elif key.startswith("refused"):
                assert str(got[key]) == w
    for name in KEYED:
        want = tk.single_run(name)
        assert want["step0/k/weights"].dtype.itemsize == (4 if pair[0] == "float32" else 2)
        ranks = [dict(np.load(out / f"{name.replace(':', '_')}.rank{r}.npz")) for r in range(2)]
        for got in ranks:
            for key, w in want.items():
                if key.startswith("step") and not key.endswith("/d/keys"):  # d: by id
                    _same(got[key], w, (name, key))
        for step in range(tk.worker.STEPS):
            for k in ("a", "s", "c"):
                cat = np.concatenate([got[f"act{step}/{k}"] for got in ranks])
                _same(cat, want[f"act{step}/{k}"], (name, step, k))


def test_keyed_16bit_checkpoints_are_the_plain_engines_files(tmp_path, monkeypatch):
    pair = ("bfloat16", "float16")
    monkeypatch.setenv("EE_TEST_DTYPES", ",".join(pair))
    root = tmp_path / "ckpts"
    env = {"CKPT_ROOT": str(root), "CKPT_CHUNK": "64", **_env(pair)}
    whole = tk._ckpt_single(range(tk.worker.STEPS))
    plain_path = tk._ckpt_single(range(2)).save(root / "plain")
    out = tmp_path / "save3"
    codes = tk.spawn(3, out, ["ckpt_save:w3"], env=env)
    assert codes == [0] * 3, td.rank_logs(out, 3)
    for r in range(3):
        _assert_keyed_end(out / f"ckpt_save_w3.rank{r}.npz", whole)
    (w3_path,) = (root / "w3").iterdir()
    plain_manifest = json.loads((plain_path / "manifest.json").read_text())
    for t in plain_manifest["tables"]:
        same = (w3_path / t["file"]).read_bytes() == (plain_path / t["file"]).read_bytes()
        assert same, t["name"]
    out = tmp_path / "restore2"
    codes = tk.spawn(2, out, ["ckpt_restore:w3", "ckpt_restore:plain"], env=env)
    assert codes == [0, 0], td.rank_logs(out, 2)
    for folder in ("w3", "plain"):
        for r in range(2):
            _assert_keyed_end(out / f"ckpt_restore_{folder}.rank{r}.npz", whole)


def _assert_keyed_end(path, want: ee.EmbeddingEngine) -> None:
    """``tk._assert_end`` for 16-bit arrays: the keyed and dense tables at the end."""
    got = np.load(path)
    for table in ("k", "d"):
        for key, a in want.table_contents(table).items():
            if not (table == "d" and key == "keys"):  # gathered by id: rows 0..V-1
                _same(got[f"end/{table}/{key}"], a, (path.name, table, key))


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("sharding", ["row", "table"])
def test_a_sharded_16_bit_table_refuses_initial_values_past_its_range(sharding):
    """As a single engine's: a shard's initial values are rounded to nearest, and a float16
    shard given 7e4 (a FromFunction array, Adagrad's accumulator value) held Inf rows."""
    from embengine.distributed import ShardedEngine

    def pretrained(shape, dtype):
        values = np.zeros(shape, np.float32)
        values[3, 1] = -7e4
        return values

    def engine(initializer, optimizer, weights, slots):
        t = ee.TableConfig(
            10, 4, name="t", initializer=initializer, weights_dtype=weights, slots_dtype=slots
        )
        features = {"f": ee.FeatureConfig(t)}
        return ShardedEngine(features, optimizer=optimizer, sharding={"t": sharding})

    with pytest.raises(ValueError, match=r"table 't': its initializer gives -70000.0 \(row 3\)"):
        engine(
            ee.initializers.FromFunction(pretrained), ee.optimizers.SGD(0.1), "float16", "float32"
        )
    adagrad = ee.optimizers.Adagrad(0.1, initial_accumulator_value=1e5)
    with pytest.raises(ValueError, match=r"slot 'accumulators'.s value gives 100000.0, beyond"):
        engine(None, adagrad, "float32", "float16")
    eng = engine(ee.initializers.FromFunction(pretrained), adagrad, "bfloat16", "bfloat16")
    assert eng.table_contents()["tables"]["t"]["weights"].astype(np.float32)[3, 1] == -70144.0
