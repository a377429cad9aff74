"""Keyed tables (``vocabulary_size=None``) with 16-bit storage: ``weights_dtype`` /
``slots_dtype`` as for a dense table.

The rows are stored in 16 bits, the math is float32, updates are written back with stochastic
rounding whose random stream is keyed by (the table's rounding key, the step, *the key*, the
column), where a dense table uses the row (= the id); initial values are rounded to nearest.
So a keyed table fed the ids 0..V-1 is bit for bit the dense 16-bit table of vocabulary V (every
optimizer, both backends), a restore (which lays the rows out in key order) continues bit for
bit, and the backends agree on streams of random 64-bit keys under every rule. Export and
serving read the stored bits; evaluation lookups equal training ones; a ShardedEngine still
refuses 16-bit tables.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

import embengine as ee
from embengine import optimizers as opt
from embengine import precision as pr
from embengine.checkpoint import CheckpointError
from embengine.initializers import Constant, RandomUniform, TruncatedNormal
from embengine.safetensors_io import read_header
from embengine.serving import ServingEngine, export

V = 30
BIG = 2**62 + 12345

# (weights_dtype, slots_dtype): both 16-bit, and one 16-bit member beside a float32 one.
PAIRS = [
    ("bfloat16", "bfloat16"),
    ("float16", "float16"),
    ("bfloat16", "float32"),
    ("float32", "bfloat16"),
]
PAIR_IDS = [f"{w}-{s}" for w, s in PAIRS]


def _table(vocabulary_size, dim, dtypes, **kwargs) -> ee.TableConfig:
    """A TableConfig stored in ``dtypes`` = (weights_dtype, slots_dtype); ``vocabulary_size``
    None makes it keyed (``dynamic`` defaults to ``DynamicVocabulary()``)."""
    return ee.TableConfig(
        vocabulary_size, dim, weights_dtype=dtypes[0], slots_dtype=dtypes[1], **kwargs
    )


def _same_bits(got: dict, want: dict, where) -> None:
    """Two ``table_contents`` (or state) dicts hold the same arrays: names, dtypes, bits."""
    assert set(got) == set(want), where
    for name in want:
        assert got[name].dtype == want[name].dtype, (where, name, got[name].dtype)
        assert got[name].tobytes() == want[name].tobytes(), (where, name)


def _same_acts(got: dict, want: dict, where) -> None:
    assert set(got) == set(want), where
    for name in want:
        assert got[name].dtype == np.float32, (where, name)
        assert got[name].tobytes() == want[name].tobytes(), (where, name)


# -- configuration and storage -------------------------------------------------------------------


@pytest.mark.parametrize("dtypes", PAIRS, ids=PAIR_IDS)
def test_a_keyed_table_stores_its_rows_in_its_dtypes(dtypes):
    """TableConfig takes the dtypes for a keyed table; the spec keeps them; the contents are
    in the stored dtypes (int32 steps stay int32) and the rows take the stored bytes: half of
    float32's for 16-bit weights and slots, for the same keys."""
    keys = np.random.default_rng(0).integers(-(2**63), 2**63 - 1, 200, dtype=np.int64)
    optimizer = opt.Adam(0.1, bias_correction="per_row")  # int32 steps beside the floats
    engines = {}
    for stored in (dtypes, ("float32", "float32")):
        t = _table(None, 16, stored, name="k", dynamic=ee.DynamicVocabulary())
        assert t.keyed and (t.weights_dtype, t.slots_dtype) == stored
        eng = ee.EmbeddingEngine(
            {"f": ee.FeatureConfig(t)}, optimizer=optimizer, backend="reference", seed=2
        )
        assert eng.storage_plan.physical_tables[0].storage == "keyed"
        acts = eng.lookup({"f": ee.Ragged(keys, lengths=np.full(50, 4))})["f"]
        assert acts.dtype == np.float32
        eng.apply_gradients({"f": np.full_like(acts, 0.25)})
        engines[stored] = eng
    eng, wide = engines[dtypes], engines[("float32", "float32")]
    spec = eng.spec()["tables"][0]
    assert spec["vocabulary_size"] is None
    assert (spec.get("weights_dtype", "float32"), spec.get("slots_dtype", "float32")) == dtypes
    again = ee.EmbeddingEngine.from_spec(eng.spec())
    assert (again.table_configs["k"].weights_dtype, again.table_configs["k"].slots_dtype) == dtypes
    c = eng.table_contents("k")
    assert c["keys"].tolist() == sorted(set(keys.tolist()))
    assert c["weights"].dtype == pr.numpy_dtype(dtypes[0])
    assert c["momenta"].dtype == c["velocities"].dtype == pr.numpy_dtype(dtypes[1])
    assert c["steps"].dtype == np.int32 and (c["steps"] == 1).all()
    s, s32 = eng.table_stats()["k"], wide.table_stats()["k"]
    assert s["rows"] == s32["rows"] == len(c["keys"]) and s["capacity"] == s32["capacity"]
    # Row bytes: 16 weights, 32 slot values, one int32 step (padded to whole float32 units).
    per_row = 16 * pr.numpy_dtype(dtypes[0]).itemsize + 32 * pr.numpy_dtype(dtypes[1]).itemsize
    want = (per_row + 4) / (48 * 4 + 4)
    ratio = s["bytes"]["rows"] / s32["bytes"]["rows"]
    assert abs(ratio - want) < 0.02, (ratio, want)
    if "float32" not in dtypes:
        assert ratio < 0.55


def test_the_dtypes_are_checked_for_a_keyed_table_as_for_a_dense_one():
    with pytest.raises(ValueError, match=r"TableConfig\(name='k'\): weights_dtype must be one of"):
        ee.TableConfig(None, 8, name="k", weights_dtype="fp8")
    with pytest.raises(ValueError, match=r"TableConfig\(name='k'\): slots_dtype must be one of"):
        ee.TableConfig(None, 8, name="k", slots_dtype="int8")
    for dtypes in PAIRS:  # no refusal any more
        t = _table(None, 8, dtypes, name="k", dynamic=ee.DynamicVocabulary(max_rows=10))
        assert t.dynamic.max_rows == 10


# -- a keyed table of ids 0..V-1 is the dense 16-bit table ----------------------------------------

OPTIMIZERS = [
    opt.SGD(0.1),
    opt.SGD(0.1, clip_weight_min=-0.5, clip_weight_max=0.7),
    opt.Adagrad(0.2),
    opt.Adagrad(0.2, hessian_compression_times=8, clipvalue=0.5),  # row-wise Adagrad
    opt.AdagradMomentum(0.1, momentum=0.9, use_nesterov=True, beta2=0.9, epsilon=0.1),
    opt.ProximalAdagrad(0.3, l1_regularization_strength=0.05, l2_regularization_strength=0.1),
    opt.Adam(0.05),
    opt.Adam(0.05, bias_correction="per_row"),
    opt.Adam(0.05, lazy_adam=False, weight_decay_factor=0.01, weight_decay_mode="l2"),
    opt.AMSGrad(0.05, bias_correction="per_row"),
    opt.Lion(0.01),
    opt.Lion(0.01, lazy_lion=False),
    opt.FTRL(0.2, l1_regularization_strength=0.05, beta=0.5),
    opt.Momentum(0.1, momentum=0.8, use_nesterov=True),
    opt.RMSProp(0.05, rho=0.8, momentum=0.5, centered=True, epsilon=1e-3),
    opt.Adadelta(1.0, rho=0.9, epsilon=1e-3),
    opt.Assign(weight_decay_factor=0.5),
    opt.FrequencyEstimator(tau=0.3, max_delta=50.0),
    opt.BatchSoftmax(0.25),
]
COUNTING = (opt.FrequencyEstimator, opt.BatchSoftmax)  # dim 1 tables
# Without accumulation the rounding stream's unit is the occurrence's index in its row.
NO_ACCUMULATION = [
    opt.SGD(0.1, use_gradient_accumulation=False),
    opt.Adagrad(0.2, use_gradient_accumulation=False),
    opt.Adam(0.05, bias_correction="per_row", use_gradient_accumulation=False),
]


def _cases():
    """(optimizer, dtypes): every optimizer once, the dtype pairs in turn (the numba backend
    compiles an update kernel per row math and dtype pair)."""
    out = []
    for i, o in enumerate(OPTIMIZERS + NO_ACCUMULATION):
        dtypes = PAIRS[i % len(PAIRS)]
        tail = "-no-accumulation" if i >= len(OPTIMIZERS) else ""
        out.append(
            pytest.param(o, dtypes, id=f"{type(o).__name__}{i}{tail}-{dtypes[0]}-{dtypes[1]}")
        )
    return out


def _pair(optimizer, backend, dtypes, dims, seed=3):
    """A dense engine (vocabulary V) and a keyed one, otherwise alike: a weighted bag feature
    and a sequence feature on table t0 (sum), a bag feature on table t1 (sqrtn)."""
    engines = []
    for size in (V, None):
        tables = [
            _table(
                size,
                d,
                dtypes,
                name=f"t{i}",
                combiner=("sum", "sqrtn")[i % 2],
                initializer=RandomUniform(-0.3, 0.3),
            )
            for i, d in enumerate(dims)
        ]
        feats = {"a": ee.FeatureConfig(tables[0]), "seq": ee.FeatureConfig(tables[0], 3)}
        if len(tables) > 1:
            feats["b"] = ee.FeatureConfig(tables[1])
        engines.append(ee.EmbeddingEngine(feats, optimizer=optimizer, backend=backend, seed=seed))
    return engines


def _batch(rng, names, step, every_row):
    """Bags of ids in [0, V): duplicates, empty bags, per-id weights (not on the sequence); at
    step 0 every id when the optimizer sweeps every row (a dense table sweeps ids a keyed
    table has not seen)."""
    feats, weights = {}, {}
    for name in names:
        bags = [[int(i) for i in rng.integers(0, V, rng.integers(0, 5))] for _ in range(6)]
        bags[1] = []
        bags[2] = [7, 7, 7]
        if every_row and step == 0:
            bags[3] = list(range(V))
        feats[name] = bags
        if name != "seq":
            weights[name] = [list(rng.uniform(0.1, 2.0, len(b)).astype(np.float32)) for b in bags]
    return feats, weights


def _keyed_equals_dense(dense, keyed, table) -> np.ndarray:
    """The keyed table's contents are the dense table's rows of its keys, in the same dtypes
    and bits; returns the keys."""
    got, want = keyed.table_contents(table), dense.table_contents(table)
    keys = got["keys"]
    assert set(got) == set(want), table
    for name in got:
        assert got[name].dtype == want[name].dtype, (table, name)
        assert got[name].tobytes() == want[name][keys].tobytes(), (table, name)
    return keys


@pytest.mark.parametrize(("optimizer", "dtypes"), _cases())
def test_keyed_table_of_ids_0_to_v_is_bit_identical_to_the_dense_16_bit_table(
    optimizer, dtypes, backend
):
    counting = isinstance(optimizer, COUNTING)
    dims = (1,) if counting else (8, 16)
    dense, keyed = _pair(optimizer, backend, dtypes, dims)
    assert keyed.storage_plan.physical_tables[0].storage == "keyed"
    # the stored dtypes, whatever the table kind
    assert dense.table_contents("t0")["weights"].dtype == pr.numpy_dtype(dtypes[0])
    rng = np.random.default_rng(0)
    seen = {t: set() for t in ("t0", "t1")[: len(dims)]}
    for step in range(5):
        feats, weights = _batch(rng, list(dense.feature_config), step, optimizer.updates_every_row)
        for name, bags in feats.items():
            cut = 3 if name == "seq" else None  # ids past max_sequence_length are dropped
            seen["t0" if name in ("a", "seq") else "t1"].update(i for b in bags for i in b[:cut])
        want = dense.lookup(feats, weights)
        got = keyed.lookup(feats, weights)
        _same_acts(got, want, step)
        grads = {
            k: np.sin(np.arange(v.size) * 0.7 + step).reshape(v.shape).astype(np.float32)
            for k, v in want.items()
        }
        dense.apply_gradients(grads)
        keyed.apply_gradients(grads)
        # every key of the batch has a row now: evaluation lookups agree too
        want = dense.lookup(feats, weights, training=False)
        got = keyed.lookup(feats, weights, training=False)
        _same_acts(got, want, (step, "evaluation"))
        if step % 2:
            for table in seen:
                assert _keyed_equals_dense(dense, keyed, table).tolist() == sorted(seen[table])
    for table in seen:
        _keyed_equals_dense(dense, keyed, table)
    assert keyed.table_stats()["t0"]["rows"] == len(seen["t0"])


@pytest.mark.parametrize("dtypes", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize(
    "init",
    [RandomUniform(-1, 1), TruncatedNormal(0.1, 0.2), Constant(0.1), Constant(-3.3)],
    ids=repr,
)
def test_new_keys_get_their_initial_values_rounded_to_nearest(backend, dtypes, init):
    """A new key's weights are the initializer's float32 values at the key, rounded to nearest
    (not stochastically) to the weights dtype, as a dense 16-bit table's initial rows; its slots
    the optimizer's initial values rounded to nearest (Adagrad's 0.1 is no bfloat16 value)."""
    optimizer = opt.Adagrad(0.1, initial_accumulator_value=0.1)
    t = _table(None, 8, dtypes, name="k", combiner="sum", initializer=init)
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t)}, optimizer=optimizer, backend=backend, seed=1
    )
    keys = np.array([BIG, -7, 3, 2**40, -(2**63), 2**63 - 1], np.int64)
    acts = eng.lookup({"f": keys})["f"]
    c = eng.table_contents("k")
    order = np.argsort(keys)
    assert c["keys"].tolist() == keys[order].tolist()
    wdt, sdt = pr.numpy_dtype(dtypes[0]), pr.numpy_dtype(dtypes[1])
    values = init.init(1, "k", keys, 8)  # float32
    assert c["weights"].tobytes() == values[order].astype(wdt).tobytes()
    assert acts.tobytes() == values.astype(wdt).astype(np.float32).tobytes()
    assert c["accumulators"].tobytes() == np.full((6, 8), 0.1, np.float32).astype(sdt).tobytes()


# -- the rounding stream is keyed by the key -----------------------------------------------------


def _one_sgd_step(eng, ids, table):
    """One SGD(0.5) step on ``ids`` (one id per bag, sum): each id's row moves by -g/2 with
    g = k/64 for small k, so the float32 result is exact and only the rounding decides the
    stored bits. Returns (the float32 values before the rounding, the step's number)."""
    step = eng.step
    acts = eng.lookup({"f": np.asarray(ids, np.int64)})["f"]
    g = (((np.arange(acts.size) * 5) % 17) - 8).reshape(acts.shape).astype(np.float32) / 64
    c = eng.table_contents(table)
    rows = np.searchsorted(c["keys"], ids)
    before = c["weights"][rows].astype(np.float32)
    eng.apply_gradients({"f": g})
    return before - np.float32(0.5) * g, step


@pytest.mark.parametrize("weights", ["bfloat16", "float16"])
def test_a_keyed_tables_rounding_stream_is_keyed_by_the_key(backend, weights):
    """The stored bits are ``precision.stochastic_round`` of the float32 result with the bits
    ``hash_bits(table key, step, row, 0, column)``: row = the id for a dense table (checked
    first: the oracle), row = the key for a keyed table, whatever row the key was given."""
    kind = pr.KIND[weights]
    ids = np.array([0, 5, 3, 9, 2, 7], np.int64)
    keys = np.array([BIG, -5, 7, 2**40 + 3, -(2**63), 11], np.int64)
    for size, feed in ((10, ids), (None, keys)):
        t = ee.TableConfig(
            size,
            8,
            name="t",
            combiner="sum",
            initializer=RandomUniform(-1, 1),
            weights_dtype=weights,
        )
        eng = ee.EmbeddingEngine(
            {"f": ee.FeatureConfig(t)}, optimizer=opt.SGD(0.5), backend=backend, seed=4
        )
        eng.lookup({"f": feed[::-1]})  # a keyed table's rows are 0..5, its keys far from them
        eng.apply_gradients({"f": np.zeros((len(feed), 8), np.float32)})
        x, step = _one_sgd_step(eng, feed, "t")
        physical = eng.storage_plan.physical_tables[0].name
        bits = pr.hash_bits(pr.table_key(4, physical), step, feed[:, None], 0, np.arange(8))
        want = pr.stochastic_round(x, kind, bits)
        c = eng.table_contents("t")
        got = c["weights"][np.searchsorted(c["keys"], feed)].view(np.uint16)
        assert got.tolist() == want.tolist(), (size, weights)
        # the rounding did decide: some values are not the nearest neighbour
        assert (want != pr.nearest(x, kind)).any()


def test_the_same_keys_in_other_rows_train_to_the_same_bits(backend):
    """Two engines give the same keys different rows (inserted in other orders, with
    zero-gradient steps that leave the values exact), then train them alike: the same bits."""
    keys = [BIG, -5, 7, 2**40 + 3, -(2**63), 11, 2**33]
    orders = ([[keys[6]], keys[3:6], keys[:3]], [keys[:2], [keys[4], keys[2]], keys[5:], [keys[3]]])
    results = []
    for order in orders:
        t = _table(None, 8, ("bfloat16", "bfloat16"), name="k", initializer=RandomUniform(-1, 1))
        eng = ee.EmbeddingEngine(
            {"f": ee.FeatureConfig(t)}, optimizer=opt.Adam(0.05), backend=backend, seed=9
        )
        for part in order + [[]] * (4 - len(order)):  # the same number of steps
            acts = eng.lookup({"f": [part]})["f"]
            eng.apply_gradients({"f": np.zeros_like(acts)})
        rows = eng._physical[0]._index.find(np.array(keys, np.int64))
        rng = np.random.default_rng(1)
        for _ in range(3):
            acts = eng.lookup({"f": [keys[:4], keys[2:], keys]})["f"]
            eng.apply_gradients({"f": rng.standard_normal(acts.shape).astype(np.float32)})
        results.append((rows, eng.table_contents("k")))
    (rows_a, a), (rows_b, b) = results
    assert rows_a.tolist() != rows_b.tolist()  # the test means something
    _same_bits(a, b, "contents")


@pytest.mark.parametrize("weights", ["bfloat16", "float16"])
def test_updates_below_half_a_quantum_survive_on_average_in_a_keyed_table(backend, weights):
    """w = 1 and 100 SGD steps of +2e-4 on 64 random keys: round-to-nearest would keep 1.0
    (half a quantum at 1 is 2**-9 in bfloat16, 2**-12 in float16)."""
    keys = np.random.default_rng(3).integers(-(2**63), 2**63 - 1, 64, dtype=np.int64)
    t = ee.TableConfig(
        None, 8, name="k", combiner="sum", initializer=Constant(1.0), weights_dtype=weights
    )
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t)}, optimizer=opt.SGD(2e-4), seed=1, backend=backend
    )
    bags = ee.Ragged(keys, lengths=np.ones(64, np.int64))
    for _ in range(100):
        acts = eng.lookup({"f": bags})["f"]
        eng.apply_gradients({"f": -np.ones_like(acts)})
    w = eng.table_contents("k")["weights"]
    assert w.dtype == pr.numpy_dtype(weights)
    mean = w.astype(np.float64).mean()
    assert abs(mean - 1.02) < 0.003, mean
    assert len(np.unique(w.astype(np.float32))) > 1  # the keys' streams differ


# -- numba equals the reference on streams of random keys ---------------------------------------

RULES = [
    pytest.param(dict(occurrence_threshold=2, expire_steps=3), id="admit2-expire3"),
    pytest.param(dict(max_rows=40, occurrence_threshold=1), id="lru40"),
    pytest.param(dict(insert_on="apply", expire_steps=2, max_rows=60), id="apply-expire-lru"),
]


def _key_stream(seed, steps=8):
    """Batches of random int64 keys from a pool (repeats, so admission and recency matter):
    a bag feature (2-D, -1 padding) and a sequence feature of the same table."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(-(2**63), 2**63 - 1, 90, dtype=np.int64)
    out = []
    for step in range(steps):
        hot = pool[: 20 + 8 * step]
        f = rng.choice(hot, (12, 3))
        f[0, 2] = f[3, 1] = -1
        out.append({"f": f, "s": rng.choice(hot, (5, 2))})
    return out


def _rules_engine(backend, dtypes, optimizer, rules):
    t = _table(
        None,
        8,
        dtypes,
        name="k",
        combiner="sum",
        initializer=RandomUniform(-0.5, 0.5),
        dynamic=ee.DynamicVocabulary(**rules),
    )
    feats = {"f": ee.FeatureConfig(t), "s": ee.FeatureConfig(t, 2)}
    return ee.EmbeddingEngine(feats, optimizer=optimizer, backend=backend, seed=6)


@pytest.mark.parametrize("dtypes", PAIRS[:3], ids=PAIR_IDS[:3])
@pytest.mark.parametrize("rules", RULES)
def test_numba_and_reference_keyed_16_bit_tables_are_bit_identical(dtypes, rules):
    """SGD and gradients whose sums are exact (so the float32 results are the same in both
    backends, whatever the order of summation): the same keys, rows' bits, stats
    after each step of a stream under admission, expiry, LRU eviction and insertion on apply;
    activations alike up to float32 summation order."""
    engines = [_rules_engine(b, dtypes, opt.SGD(0.25), rules) for b in ("numba", "reference")]
    for step, batch in enumerate(_key_stream(1)):
        acts = [e.lookup(batch) for e in engines]
        for k in acts[1]:
            np.testing.assert_allclose(acts[0][k], acts[1][k], rtol=1e-5, atol=1e-6)
        # multiples of 2**-6: their sums are exact in any order, so the float32 results too
        grads = {k: np.round(np.cos(3 * v + step) * 32) / 64 for k, v in acts[1].items()}
        for e in engines:
            e.apply_gradients(grads)
        _same_bits(*(e.table_contents("k") for e in engines), step)
        assert engines[0].table_stats() == engines[1].table_stats(), step
    total = engines[0].table_stats()["k"]["total"]
    assert total["admitted"] > 0
    if "max_rows" in rules or "expire_steps" in rules:
        assert total["evicted"] + total["expired"] > 0
    if rules.get("occurrence_threshold"):
        assert total["filtered"] > 0


@pytest.mark.parametrize("dtypes", PAIRS, ids=PAIR_IDS)
def test_numba_and_reference_keyed_16_bit_tables_agree_with_slots(dtypes):
    """Adam (per-row steps), two rules: the same keys, stats and int32 steps; the 16-bit values
    equal or within a quantum or two (the backends' float32 math agrees to an ulp, not bit for
    bit, so a value may round to a neighbouring 16-bit value and move on from there)."""
    rules = dict(occurrence_threshold=1, max_rows=50, expire_steps=4)
    optimizer = opt.Adam(0.05, bias_correction="per_row")
    engines = [_rules_engine(b, dtypes, optimizer, rules) for b in ("numba", "reference")]
    for step, batch in enumerate(_key_stream(2)):
        acts = [e.lookup(batch) for e in engines]
        grads = {k: (np.sin(3 * v + step) * 0.5).astype(np.float32) for k, v in acts[1].items()}
        for e in engines:
            e.apply_gradients(grads)
    a, b = (e.table_contents("k") for e in engines)
    assert engines[0].table_stats() == engines[1].table_stats()
    assert set(a) == set(b) and a["keys"].tolist() == b["keys"].tolist()
    assert a["steps"].tolist() == b["steps"].tolist()
    for name in ("weights", "momenta", "velocities"):
        assert a[name].dtype == b[name].dtype == pr.numpy_dtype(dtypes[name != "weights"])
        x, y = a[name].astype(np.float64), b[name].astype(np.float64)
        if a[name].dtype.itemsize == 2:
            # a neighbouring 16-bit value or two at most (2**-7 relative bounds either type's
            # quantum), mostly the same bits
            assert (np.abs(x - y) <= 2 * (np.abs(y) * 2.0**-7 + 2.0**-24)).all(), name
            assert (a[name].view(np.uint16) == b[name].view(np.uint16)).mean() > 0.9, name
        else:  # float32: the backends' math agrees to float32 rounding
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6, err_msg=name)


# -- checkpoints ----------------------------------------------------------------------------------


def _ckpt_engine(backend, dtypes, rules, storage=None, storage_dir=None) -> ee.EmbeddingEngine:
    """A keyed table "k" (Adam, per-row int32 steps; a bag and a sequence feature) and a dense
    table "d", both stored in ``dtypes``."""
    k = _table(
        None,
        8,
        dtypes,
        name="k",
        combiner="sum",
        initializer=RandomUniform(-0.5, 0.5),
        optimizer=opt.Adam(0.05, bias_correction="per_row"),
        dynamic=ee.DynamicVocabulary(**rules),
    )
    d = _table(9, 8, dtypes, name="d", optimizer=opt.Adagrad(0.2))
    feats = {"f": ee.FeatureConfig(k), "s": ee.FeatureConfig(k, 2), "g": ee.FeatureConfig(d)}
    kw = {} if storage is None else dict(storage=storage, storage_dir=storage_dir)
    return ee.EmbeddingEngine(feats, backend=backend, seed=5, **kw)


def _ckpt_stream(steps, seed=0):
    rng = np.random.default_rng(seed)
    pool = rng.integers(-(2**63), 2**63 - 1, 30, dtype=np.int64)
    out = []
    for _ in range(steps):
        f = rng.choice(pool, (4, 2))
        f[0, 1] = -1
        out.append({"f": f, "s": rng.choice(pool, (3, 2)), "g": rng.integers(0, 9, (3, 2))})
    return out


def _step(eng, batch) -> dict:
    acts = eng.lookup(batch)
    eng.apply_gradients({k: np.sin(3 * v) + 0.25 for k, v in acts.items()})
    return acts


def _stats(eng) -> dict:
    """Stats without what describes the arena's memory (a restore compacts it) or where it
    is (RAM or a file)."""
    st = eng.table_stats()["k"]
    return {k: v for k, v in st.items() if k not in ("capacity", "load_factor", "bytes", "kind")}


def _same_engines(a, b) -> None:
    for table in ("k", "d"):
        _same_bits(a.table_contents(table), b.table_contents(table), table)
    assert _stats(a) == _stats(b)
    assert a.step == b.step


def _rows_not_in_key_order(eng) -> bool:
    keys = eng.table_contents("k")["keys"]
    rows = eng._physical[0]._index.find(keys)  # read-only: the rows the keys have
    assert (rows >= 0).all()
    return bool((np.diff(rows) < 0).any())


CKPT_CASES = [
    pytest.param(PAIRS[0], dict(occurrence_threshold=1), "numba", id="bf16-admit1-numba"),
    pytest.param(PAIRS[1], dict(max_rows=14), "numba", id="f16-lru-numba"),
    pytest.param(
        PAIRS[2], dict(insert_on="apply", expire_steps=3), "reference", id="bf16f32-apply-ref"
    ),
    pytest.param(
        PAIRS[3], dict(eviction="lfu", max_rows=14, expire_steps=4), "numba", id="f32bf16-lfu"
    ),
]


@pytest.mark.parametrize(("dtypes", "rules", "backend"), CKPT_CASES)
def test_save_mid_stream_and_continue_bit_identically(tmp_path, dtypes, rules, backend):
    """A checkpoint of a keyed 16-bit table, loaded (EmbeddingEngine.load, restore,
    load_state_dict) into fresh engines, continues bit for bit like the engine that never
    stopped, though the load lays the rows out in key order: the rounding stream follows the
    keys, not the rows."""
    stream, probe = _ckpt_stream(12), _ckpt_stream(1, seed=9)[0]
    a = _ckpt_engine(backend, dtypes, rules)
    for batch in stream[:6]:
        _step(a, batch)
    assert a.table_stats()["k"]["rows"] > 4
    assert _rows_not_in_key_order(a)  # else the relayout would prove nothing
    path = a.save(tmp_path / "ckpt")
    header, _ = read_header(next(p for p in path.glob("*.safetensors") if "k" in read_header(p)[0]))
    names = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
    assert header["k"]["dtype"] == names[dtypes[0]]
    assert header["k/momenta"]["dtype"] == names[dtypes[1]]
    assert header["k/steps"]["dtype"] == "I32" and header["k/keys"]["dtype"] == "I64"
    loaded = ee.EmbeddingEngine.load(path)
    restored = _ckpt_engine(backend, dtypes, rules)
    _step(restored, stream[0])  # a different state first
    restored.restore(path)
    copied = _ckpt_engine(backend, dtypes, rules)
    copied.load_state_dict(copy.deepcopy(a.state_dict()))
    others = (loaded, restored, copied)
    for eng in others:
        _same_engines(a, eng)
    assert not _rows_not_in_key_order(loaded)
    for batch in stream[6:]:
        want = _step(a, batch)
        for eng in others:
            _same_acts(_step(eng, batch), want, "continued")
        evaluated = a.lookup(probe, training=False)
        for eng in others:
            _same_acts(eng.lookup(probe, training=False), evaluated, "evaluation")
    for eng in others:
        _same_engines(a, eng)


def test_a_keyed_checkpoint_of_other_dtypes_is_refused_not_cast(tmp_path):
    """As for a dense table: a CheckpointError naming the table and both dtypes, the engine
    unchanged; load_state_dict takes the stored dtypes only (the caller's astype converts)."""

    def engine(dtypes):
        t = _table(None, 8, dtypes, name="k", initializer=RandomUniform(-0.5, 0.5))
        return ee.EmbeddingEngine(
            {"f": ee.FeatureConfig(t)}, optimizer=opt.Adagrad(0.2), backend="reference", seed=5
        )

    wide, half = engine(("float32", "float32")), engine(("bfloat16", "float32"))
    for batch in _ckpt_stream(3):
        _step(wide, {"f": batch["f"]})
    _step(half, {"f": _ckpt_stream(1, seed=4)[0]["f"]})
    path = wide.save(tmp_path / "ckpt")
    before = half.table_contents("k")
    with pytest.raises(
        CheckpointError,
        match=r"table 'k': the checkpoint stores weights_dtype 'float32', the engine 'bfloat16'",
    ):
        half.restore(path)
    _same_bits(half.table_contents("k"), before, "refused")
    state = copy.deepcopy(wide.state_dict())
    with pytest.raises(ValueError, match=r"float32"):
        half.load_state_dict(state)
    _same_bits(half.table_contents("k"), before, "refused state")
    weights = state["tables"]["k"]["weights"]
    state["tables"]["k"]["weights"] = weights.astype(pr.numpy_dtype("bfloat16"))
    half.load_state_dict(state)
    got = half.table_contents("k")
    assert got["keys"].tolist() == wide.table_contents("k")["keys"].tolist()
    assert got["weights"].tobytes() == state["tables"]["k"]["weights"].tobytes()
    assert got["accumulators"].tobytes() == wide.table_contents("k")["accumulators"].tobytes()


@pytest.mark.parametrize("dtypes", [PAIRS[0], PAIRS[3]], ids=[PAIR_IDS[0], PAIR_IDS[3]])
def test_a_keyed_16_bit_table_in_a_file_trains_like_one_in_ram(tmp_path, dtypes):
    """storage="mmap": the keyed table's rows in a file ("keyed-mmap"), bit for bit like RAM,
    expiry and max_rows included; its checkpoint loads into RAM and into another file, and
    every copy continues alike."""
    rules = dict(expire_steps=3, max_rows=20)
    ram = _ckpt_engine("numba", dtypes, rules)
    mapped = _ckpt_engine("numba", dtypes, rules, storage="mmap", storage_dir=tmp_path / "rows")
    assert mapped.storage_plan.physical_tables[0].storage == "keyed-mmap"
    assert mapped.table_stats()["k"]["kind"] == "keyed-mmap"
    stream = _ckpt_stream(10, seed=3)
    for batch in stream[:6]:
        _same_acts(_step(mapped, batch), _step(ram, batch), "mmap")
    _same_engines(ram, mapped)
    assert mapped.table_contents("k")["weights"].dtype == pr.numpy_dtype(dtypes[0])
    path = mapped.save(tmp_path / "ckpt")
    in_ram = ee.EmbeddingEngine.load(path)
    assert in_ram.storage_plan.physical_tables[0].storage == "keyed"
    again = ee.EmbeddingEngine.load(path, storage="mmap", storage_dir=tmp_path / "other")
    assert again.storage_plan.physical_tables[0].storage == "keyed-mmap"
    for batch in stream[6:]:
        want = _step(ram, batch)
        for eng in (mapped, in_ram, again):
            _same_acts(_step(eng, batch), want, "continued")
    for eng in (mapped, in_ram, again):
        _same_engines(ram, eng)


# -- export and serving ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtypes", [PAIRS[0], PAIRS[1], PAIRS[2]], ids=PAIR_IDS[:3])
def test_served_keyed_16_bit_lookups_equal_the_engines_evaluation(tmp_path, dtypes):
    eng = _ckpt_engine("numba", dtypes, dict(expire_steps=4))
    for batch in _ckpt_stream(6):
        _step(eng, batch)
    path = eng.save(tmp_path / "ckpt")
    probes = _ckpt_stream(3, seed=11)
    probes[0]["f"][1] = [2**40, -(2**63)]  # never seen: zeros
    for comp in ("fp32", "fp16"):
        out = tmp_path / f"export-{comp}"
        report = export(path, out, compress=comp)
        served = ServingEngine.load(out)
        exported = [r for r in report.rows if r["table"] == "k"]
        # the report's "fp32 MiB" column: the rows as float32, whatever they are stored in,
        # and the int64 keys (counted in "export MiB" too)
        rows = len(served._tables["k"][0]["keys"])
        assert 0 < rows and [r["bytes_before"] for r in exported] == [rows * 8 * 4 + rows * 8]
        for probe in probes:
            want = eng.lookup(probe, training=False)
            got = served.lookup(probe)
            for name in want:
                assert got[name].dtype == np.float32
                if comp == "fp32":  # 16-bit weights widen exactly to float32
                    assert got[name].tobytes() == want[name].tobytes(), name
                else:
                    np.testing.assert_allclose(got[name], want[name], rtol=2e-3, atol=2e-3)
        assert not served.lookup(probes[0])["f"][1].any()


# -- ShardedEngine --------------------------------------------------------------------------------


@pytest.fixture
def one_rank_group():
    """A real gloo process group of this process alone (destroyed after the test)."""
    pytest.importorskip("torch")
    import torch.distributed as dist

    from embengine.training.ranks import free_port

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtypes", [PAIRS[0], PAIRS[3]], ids=[PAIR_IDS[0], PAIR_IDS[3]])
def test_a_sharded_engine_trains_a_keyed_16_bit_table_as_one_engine(one_rank_group, dtypes):
    # (refused until the ShardedEngine stored 16-bit tables; tests/test_distributed_precision.py
    # runs it on 2 and 3 ranks)
    from embengine.distributed import ShardedEngine

    t = _table(None, 8, dtypes, name="kh", dynamic=ee.DynamicVocabulary())
    sharded = ShardedEngine({"f": ee.FeatureConfig(t)}, optimizer=opt.Adagrad(0.1))
    single = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=opt.Adagrad(0.1))
    rng = np.random.default_rng(2)
    for _ in range(3):
        feats = {"f": ee.Ragged(rng.integers(-50, 50, 12) * 7919, lengths=[5, 0, 7])}
        grads = {"f": rng.normal(size=(3, 8)).astype(np.float32)}
        for eng in (sharded, single):
            eng.lookup(feats)
            eng.apply_gradients(grads)
    _same_bits(sharded.table_contents()["tables"]["kh"], single.table_contents("kh"), "kh")


# -- evaluation lookups ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtypes", PAIRS, ids=PAIR_IDS)
def test_an_evaluation_lookup_equals_the_training_lookup(backend, dtypes):
    """With a keyed 16-bit table beside a keyed float32 table and a dense 16-bit one (the numba
    backend pools them in different regions): after some training, a batch whose keys all have
    rows looks up the same in evaluation (raw and preprocessed) as in training, before the
    update; keys without a row look up as zeros in evaluation."""
    half = _table(None, 8, dtypes, name="kh", combiner="mean", initializer=RandomUniform(-1, 1))
    wide = ee.TableConfig(None, 8, name="kw", combiner="sqrtn", initializer=RandomUniform(-1, 1))
    dense = _table(20, 8, dtypes, name="dh", combiner="sum", initializer=RandomUniform(-1, 1))
    feats = {
        "a": ee.FeatureConfig(half),
        "seq": ee.FeatureConfig(half, 3),
        "b": ee.FeatureConfig(wide),
        "c": ee.FeatureConfig(dense),
    }
    eng = ee.EmbeddingEngine(feats, optimizer=opt.Adagrad(0.3), backend=backend, seed=8)
    rng = np.random.default_rng(2)
    pool = rng.integers(-(2**63), 2**63 - 1, 25, dtype=np.int64)

    def batch():
        lengths = rng.integers(0, 5, 8)
        lengths[1] = 0  # an empty bag
        ids = rng.choice(pool, lengths.sum())
        w = rng.uniform(0.1, 2.0, lengths.sum()).astype(np.float32)
        return {
            "a": ee.Ragged(ids, lengths=lengths, weights=w),
            "seq": rng.choice(pool, (8, 3)),
            "b": ee.Ragged(rng.choice(pool, lengths.sum()), lengths=lengths),
            "c": rng.integers(0, 20, (8, 2)),
        }

    everything = {
        "a": ee.Ragged(pool, lengths=[25]),
        "seq": pool[:24].reshape(8, 3),
        "b": ee.Ragged(pool, lengths=[25]),
        "c": np.arange(20).reshape(10, 2),
    }
    _step(eng, everything)  # every key of the pool has a row
    for _ in range(3):
        _step(eng, batch())
    for _ in range(3):
        b = batch()
        evaluated = eng.lookup(b, training=False)
        preprocessed = eng.lookup(eng.preprocess(b), training=False)
        trained = eng.lookup(b)
        _same_acts(evaluated, trained, "evaluation")
        _same_acts(preprocessed, trained, "preprocessed evaluation")
        eng.apply_gradients({k: np.cos(3 * v) for k, v in trained.items()})
    unknown = {"a": [[2**40, -3]], "seq": [[2**41, -1, -1]], "b": [[2**42]], "c": [[1]]}
    unknown = eng.lookup(unknown, training=False)
    assert not unknown["a"].any() and not unknown["seq"].any()
