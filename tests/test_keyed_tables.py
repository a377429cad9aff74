"""Keyed tables (issue 15): ``TableConfig(vocabulary_size=None, dynamic=DynamicVocabulary(...))``.

A keyed table fed the keys 0..V-1 trains bit for bit like the dense table of vocabulary V (every
optimizer, both backends, accumulation on and off); scripted streams of 64-bit keys check
admission, expiry, LRU / LFU eviction, re-admission, insert on apply and evaluation lookups
with exact expected outcomes; the same stream at 1 and 2 numba threads gives the same table.
"""

import json
from pathlib import Path

import numba
import numpy as np
import pytest
from conftest import keyed_engine, keyed_keys, train_bags

import embengine as ee
from embengine import optimizers as opt
from embengine.initializers import RandomUniform, RowId
from embengine.kernels import keyed_index
from embengine.storage import StoragePlan
from embengine.storage.keyed import KeyIndex

V = 40

# Every optimizer class, as in tests/test_storage_protocol.py (non-lazy sweeps included).
OPTIMIZERS = [
    opt.SGD(0.1),
    opt.SGD(0.1, clip_weight_min=-0.5, clip_weight_max=0.7),
    opt.Adagrad(0.2),
    opt.Adagrad(0.2, hessian_compression_times=2, clipvalue=0.5),
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
QUANTIZATION = ee.QuantizationConfig(64, -0.5, 0.5)  # on table 1


def _no_accumulation(o: opt.Optimizer) -> opt.Optimizer | None:
    """``o`` without gradient accumulation; None where it needs accumulation (clipvalue,
    every-row sweeps)."""
    try:
        return type(o)(**{**o.hyperparameters(), "use_gradient_accumulation": False})
    except ValueError:
        return None


# (optimizer, accumulation): every optimizer with accumulation, and without where allowed.
CASES = [pytest.param(o, id=f"{type(o).__name__}{i}-accumulate") for i, o in enumerate(OPTIMIZERS)]
CASES += [
    pytest.param(_no_accumulation(o), id=f"{type(o).__name__}{i}-no-accumulation")
    for i, o in enumerate(OPTIMIZERS)
    if _no_accumulation(o) is not None
]


def _pair(optimizer, backend, dims=(8, 6), seed=3):
    """A dense engine (vocabulary V) and a keyed one, same tables otherwise: a bag feature
    with weights and a sequence feature on table 0, a bag feature on table 1 (quantized)."""
    engines = []
    for size in (V, None):
        tables = [
            ee.TableConfig(
                size,
                d,
                name=f"t{i}",
                combiner=("sum", "sqrtn")[i % 2],
                initializer=RandomUniform(-0.3, 0.3),
                quantization_config=None if i == 0 else QUANTIZATION,
            )
            for i, d in enumerate(dims)
        ]
        feats = {"a": ee.FeatureConfig(tables[0]), "seq": ee.FeatureConfig(tables[0], 3)}
        if len(tables) > 1:
            feats["b"] = ee.FeatureConfig(tables[1])
        engines.append(ee.EmbeddingEngine(feats, optimizer=optimizer, backend=backend, seed=seed))
    return engines


def _batch(rng, names, step, every_row):
    """Bags of ids in [0, V) (duplicates, empty bags); at step 0 every id when an optimizer
    sweeps every row (a dense table sweeps ids a keyed table has not seen yet)."""
    feats, weights = {}, {}
    for name in names:
        bags = [list(rng.integers(0, V, rng.integers(0, 5))) for _ in range(6)]
        bags[1] = []
        bags[2] = [7, 7, 7]
        if every_row and step == 0:
            bags[3] = list(range(V))
        feats[name] = bags
        if name != "seq":
            weights[name] = [list(rng.uniform(0.1, 2.0, len(b)).astype(np.float32)) for b in bags]
    return feats, weights


def _same_contents(dense, keyed, table):
    got, want = keyed.table_contents(table), dense.table_contents(table)
    keys = got["keys"]
    assert set(got) == set(want)
    for name in got:
        assert got[name].tobytes() == want[name][keys].tobytes(), (table, name)
    return keys


@pytest.mark.parametrize("o", CASES)
def test_keyed_table_of_ids_0_to_v_trains_like_the_dense_table(o, backend):
    dims = (1,) if isinstance(o, COUNTING) else (8, 6)
    dense, keyed = _pair(o, backend, dims)
    assert keyed.storage_plan.physical_tables[0].storage == "keyed"
    rng = np.random.default_rng(0)
    seen = {t: set() for t in ("t0", "t1")[: len(dims)]}
    for step in range(20):
        feats, weights = _batch(rng, list(dense.feature_config), step, o.updates_every_row)
        for name, bags in feats.items():
            cut = 3 if name == "seq" else None  # ids past max_sequence_length are dropped
            seen["t0" if name in ("a", "seq") else "t1"].update(
                int(i) for b in bags for i in b[:cut]
            )
        evaluated = keyed.lookup(feats, weights, training=False)  # inserts nothing
        want = dense.lookup(feats, weights)
        got = keyed.lookup(feats, weights)
        for k in want:
            assert got[k].tobytes() == want[k].tobytes(), (step, k)
        grads = {
            k: np.sin(np.arange(v.size) * 0.7 + step).reshape(v.shape).astype(np.float32)
            for k, v in want.items()
        }
        dense.apply_gradients(grads)
        keyed.apply_gradients(grads)
        # Every key of the batch has a row now: evaluation lookups agree too.
        want = dense.lookup(feats, weights, training=False)
        got = keyed.lookup(feats, weights, training=False)
        for k in want:
            assert got[k].tobytes() == want[k].tobytes(), (step, k, "evaluation")
        if step % 5 == 4:
            for table in seen:
                keys = _same_contents(dense, keyed, table)
                assert list(keys) == sorted(seen[table])
        if step == 0:  # nothing has a row before the first training lookup: zeros
            assert not any(a.any() for a in evaluated.values())
    for table in seen:
        _same_contents(dense, keyed, table)
    assert keyed.table_stats()["t0"]["rows"] == len(seen["t0"])


# -- spec and input ------------------------------------------------------------------------------


def test_dynamic_vocabulary_defaults_and_validation():
    d = ee.DynamicVocabulary()
    assert (d.occurrence_threshold, d.expire_steps, d.max_rows, d.eviction, d.insert_on) == (
        0,
        None,
        None,
        "lru",
        "lookup",
    )
    with pytest.raises(AttributeError):
        d.max_rows = 3  # frozen
    # vocabulary_size=None without dynamic: the documented defaults.
    assert ee.TableConfig(None, 4).dynamic == ee.DynamicVocabulary()
    assert ee.TableConfig(None, 4).keyed and not ee.TableConfig(5, 4).keyed
    bad = [
        (dict(occurrence_threshold=-1), "occurrence_threshold must be an int >= 0, got -1"),
        (dict(occurrence_threshold=1.5), "occurrence_threshold must be an int >= 0, got 1.5"),
        (dict(occurrence_threshold=True), "got True"),
        # the pending counts are int64: no count reaches 2^63
        (dict(occurrence_threshold=2**63), r"occurrence_threshold must be at most 9,223,.* got 92"),
        (dict(expire_steps=0), "expire_steps must be None .* got 0"),
        (dict(max_rows=-2), "max_rows must be None .* got -2"),
        (dict(max_rows=2**31), "max_rows must be at most 2,147,483,647 .* got 2147483648"),
        # past int64: the first training lookup died inside numba, naming nothing
        # past 3 * 2^30 - 1 the int32 last-touched steps clamp: older rows never expired
        (dict(expire_steps=3 * 2**30), r"expire_steps must be at most 3,221,225,471 .*got 3221"),
        (dict(expire_steps=2**63), r"expire_steps must be at most 3,221,225,471 "),
        (dict(expire_seconds=10**20), r"expire_seconds must be at most .* got 10{20}"),
        (dict(eviction="fifo"), "eviction must be one of \\('lru', 'lfu'\\), got 'fifo'"),
        (dict(insert_on="update"), "insert_on must be one of .* got 'update'"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            ee.DynamicVocabulary(**kwargs)
    with pytest.raises(ValueError, match="makes a keyed table.*pass vocabulary_size=None"):
        ee.TableConfig(10, 4, dynamic=ee.DynamicVocabulary())
    with pytest.raises(TypeError, match="dynamic must be an embengine.DynamicVocabulary"):
        ee.TableConfig(None, 4, dynamic={"max_rows": 3})
    with pytest.raises(ValueError, match="vocabulary_size must be .* got 0 \\(or None for a keyed"):
        ee.TableConfig(0, 4)


@pytest.mark.parametrize("rule", ["expire_steps", "expire_seconds"])
def test_the_longest_expiry_trains_and_expires_nothing(rule):
    longest = {"expire_steps": 3 * 2**30 - 1, "expire_seconds": 2**63 - 1}[rule]
    dyn = ee.DynamicVocabulary(**{rule: longest})
    t = ee.TableConfig(None, 4, name="k", dynamic=dyn, optimizer=opt.SGD(0.1))
    engine = ee.EmbeddingEngine({"a": ee.FeatureConfig(t)})
    times = [0, 2**62 - 1] if rule == "expire_seconds" else [None, None]
    for keys, when in zip(([[1], [2]], [[3]]), times, strict=True):
        engine.lookup({"a": np.array(keys)}, timestamp=when)
        engine.apply_gradients({"a": np.ones((len(keys), 4), np.float32)})
    assert engine.table_contents("k")["keys"].tolist() == [1, 2, 3]


@pytest.mark.parametrize("backend", ["numba", "reference"])
@pytest.mark.parametrize("insert_on", ["lookup", "apply"])
def test_the_largest_threshold_counts_keys_and_admits_none(backend, insert_on):
    """occurrence_threshold=2^63 - 1, the largest the int64 counts hold: keys are counted
    (pending), never admitted, look up as zeros and their gradients are dropped."""
    eng = keyed_engine(backend, insert_on=insert_on, occurrence_threshold=2**63 - 1)
    for _ in range(3):
        acts = train_bags(eng, [[A, B], [A]])
        assert not acts.any()
    assert keyed_keys(eng) == []
    pending = eng.state_dict()["tables"]["k"]
    assert pending["pending_keys"].tolist() == [B, A]
    assert eng.table_stats()["k"]["total"]["filtered"] == 6


def test_keyed_spec_and_plan_round_trip_through_json(tmp_path):
    dyn = ee.DynamicVocabulary(
        occurrence_threshold=2, expire_steps=5, max_rows=100, eviction="lfu", insert_on="apply"
    )
    t = ee.TableConfig(None, 4, name="k", dynamic=dyn)
    d = ee.TableConfig(10, 4, name="d")
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t), "g": ee.FeatureConfig(d)},
        optimizer=opt.Adagrad(0.1),
        backend="reference",
    )
    spec = json.loads(json.dumps(eng.spec()))
    tables = {x["name"]: x for x in spec["tables"]}
    assert tables["k"]["vocabulary_size"] is None and tables["k"]["storage"] == "keyed"
    assert tables["k"]["dynamic"]["eviction"] == "lfu" and "dynamic" not in tables["d"]
    again = ee.EmbeddingEngine.from_spec(spec)
    assert again.table_configs["k"].dynamic == dyn
    assert again.table_configs["d"].dynamic is None
    assert again.spec() == eng.spec()
    plan = StoragePlan.from_json(json.loads(json.dumps(eng.storage_plan.to_json())))
    assert plan == eng.storage_plan
    assert plan.physical_tables[0].tables[0].dynamic == dyn
    # A keyed table is stored as 'keyed', or 'keyed-mmap' in a file; those hold keyed tables only.
    feats = {"f": ee.FeatureConfig(t)}
    mapped = ee.EmbeddingEngine(feats, optimizer=opt.SGD(0.1), storage="mmap", storage_dir=tmp_path)
    assert mapped.storage_plan.physical_tables[0].storage == "keyed-mmap"
    with pytest.raises(ValueError, match="storage 'keyed' is for keyed tables; table 'd'"):
        ee.EmbeddingEngine({"g": ee.FeatureConfig(d)}, optimizer=opt.SGD(0.1), storage="keyed")
    # Its rows are not ids: no weights by id (its state is by key: tests/test_keyed_checkpoint.py);
    # the dense table beside it has its weights by id all the same.
    with pytest.raises(TypeError, match="table 'k' is keyed .*table_contents\\('k'\\)"):
        _ = eng.embedding_tables["k"]
    assert list(eng.embedding_tables) == ["d"] and "k" not in eng.embedding_tables
    assert eng.embedding_tables["d"].shape == (d.vocabulary_size, d.dim)


BIG = 2**62 + 12345  # keys far beyond any vocabulary, and negative ones


@pytest.mark.parametrize(
    "init",
    [
        RandomUniform(-1, 1),
        ee.initializers.TruncatedNormal(0.1, 0.2),
        ee.initializers.TruncatedNormal(),  # stddev from the dim
        ee.initializers.Constant(0.25),
        ee.initializers.Constant(-0.1),  # written in place as a constant column
        ee.initializers.Zeros(),
        RowId(3),
    ],
    ids=repr,
)
def test_new_rows_get_the_initializers_values_and_the_slots_initial_ones(backend, init):
    """A new key's row is ``init.init(seed, table, [key], dim)`` and each slot its initial value
    (float and int32 slots: Adagrad's 0.1, Adam's per-row steps), written in place by the
    numba kernel for fill and constant initializers: in fresh rows (one run) and in rows freed
    by expiry (scattered)."""
    adam = opt.Adam(0.1, bias_correction="per_row")
    for optimizer in (opt.Adagrad(0.1, initial_accumulator_value=0.1), adam):
        eng = keyed_engine(backend, optimizer=optimizer, dim=5, init=init, expire_steps=1)
        first = [BIG, -7, 3, 2**40, -(2**63)]
        again = [11, BIG + 1, 12, -3]
        for keys in (first, [], again):  # the second batch's rows are the expired first's
            acts = eng.lookup({"f": np.array(keys, np.int64)})["f"]
            want = init.init(1, "k", np.array(keys, np.int64), 5)
            assert acts.tobytes() == want.tobytes(), (type(optimizer).__name__, keys)
            c = eng.table_contents("k")
            new = np.isin(c["keys"], keys)
            for spec in optimizer.slot_specs(5):
                assert (c[spec.name][new] == spec.initial_value).all(), spec.name
            assert {s.dtype for s in optimizer.slot_specs(5)} >= {"float32"}
            eng.apply_gradients({"f": np.zeros_like(acts)})


def test_keyed_tables_take_any_int64_key(backend):
    eng = keyed_engine(backend, init=RandomUniform(-1, 1))
    keys = [BIG, -(2**63), 2**63 - 1, -5, -1, 0]
    acts = eng.lookup({"f": np.array(keys, np.int64)})["f"]  # 1-D: -1 is a key here
    assert eng.table_contents("k")["keys"].tolist() == sorted(keys)
    want = RandomUniform(-1, 1).init(1, "k", np.array(keys), 2)
    assert acts.tobytes() == want.tobytes()
    # 2-D input: -1 is padding, other negative keys are keys.
    eng2 = keyed_engine(backend)
    acts = eng2.lookup({"f": np.array([[-5, -1], [-1, -1], [BIG, 3]])})["f"]
    assert eng2.table_contents("k")["keys"].tolist() == [-5, 3, BIG]
    np.testing.assert_array_equal(acts[:, 0], [-5.0, 0.0, np.float32(BIG) + 3])
    # A dense table keeps its checks.
    dense = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(ee.TableConfig(10, 2))}, optimizer=opt.SGD(0.1), backend=backend
    )
    with pytest.raises(ValueError, match="only -1 marks padding"):
        dense.lookup({"f": np.array([[-5, -1]])})


def test_bad_keys_are_refused_and_change_nothing(backend):
    eng = keyed_engine(backend)
    eng.lookup({"f": [[1, 2]]})
    eng.apply_gradients({"f": np.ones((1, 2), np.float32)})
    before = eng.table_contents("k")
    for bad, error, match in [
        ({"f": [[1.5, 2]]}, TypeError, "ids must be integers"),
        ({"f": np.array([1.0, 2.0])}, TypeError, "ids must be integers, got dtype float64"),
        ({"f": [[2**64]]}, ValueError, "does not fit in int64"),
        ({"f": [["a"]]}, TypeError, "ids must be integers"),
    ]:
        with pytest.raises(error, match=match):
            eng.lookup(bad)
    after = eng.table_contents("k")
    assert all(after[k].tobytes() == before[k].tobytes() for k in before)
    assert eng.step == 1


# -- scripted streams ----------------------------------------------------------------------------


# Sorted: B < D < A < C < E; A, B, C, D exact in float32 (RowId values are checked).
A, B, C, D, E = 2**20 + 1, -7, 2**22 + 3, 5, BIG + 9


def test_admission_threshold_1(backend):
    eng = keyed_engine(backend, occurrence_threshold=1)
    acts = train_bags(eng, [[A, B, A]])  # step 0: nothing seen before
    assert keyed_keys(eng) == [] and not acts.any()
    s = eng.table_stats()["k"]
    assert (s["pending_keys"], s["this_step"]["filtered"], s["this_step"]["admitted"]) == (2, 2, 0)
    acts = train_bags(eng, [[A], [C]])  # A: 2 earlier occurrences; C: none
    assert keyed_keys(eng) == [A]
    np.testing.assert_array_equal(acts, [[A, A], [0, 0]])  # RowId: the row's values are its key
    acts = train_bags(eng, [[B, C], [A]])  # B, C: 1 earlier occurrence each
    assert keyed_keys(eng) == [B, A, C]
    c = eng.table_contents("k")
    # SGD lr 1, gradient 1: a row moves by -1 per step it was trained in since its admission;
    # the occurrences before it were dropped, not added to any row.
    np.testing.assert_array_equal(c["weights"][:, 0], np.float32([B - 1, A - 2, C - 1]))
    s = eng.table_stats()["k"]
    assert s["pending_keys"] == 0 and s["total"]["admitted"] == 3
    assert s["total"]["filtered"] == 3 and s["this_step"]["admitted"] == 2


def test_admission_threshold_3(backend):
    eng = keyed_engine(backend, occurrence_threshold=3)
    train_bags(eng, [[A, B, B], [B]])  # step 0: A 1, B 3
    train_bags(eng, [[A, B]])  # step 1: B admitted (3 earlier); A 2 earlier
    assert keyed_keys(eng) == [B]
    train_bags(eng, [[A, A]])  # step 2: A has 2 earlier occurrences: not yet
    assert keyed_keys(eng) == [B]
    train_bags(eng, [[A]])  # step 3: 4 earlier
    assert keyed_keys(eng) == [B, A]
    # Evaluation lookups never count: C looked up 5 times in evaluation stays at 0.
    for _ in range(5):
        assert not eng.lookup({"f": [[C]]}, training=False)["f"].any()
    train_bags(eng, [[C]])
    assert keyed_keys(eng) == [B, A] and eng.table_stats()["k"]["pending_keys"] == 1


def test_pending_counts_are_bounded_oldest_first(backend):
    bounded, free = (
        keyed_engine(backend, occurrence_threshold=2),
        keyed_engine(backend, occurrence_threshold=2),
    )
    bounded._physical[0].max_pending = 2
    for eng in (bounded, free):
        train_bags(eng, [[A, A]])  # step 0: A 2
        train_bags(eng, [[B, C]])  # step 1: the bound forgets A, seen longest ago
        train_bags(eng, [[A]])  # step 2: A's 2 earlier occurrences count only where remembered
    assert keyed_keys(free) == [A] and keyed_keys(bounded) == []
    s = bounded.table_stats()["k"]
    # Step 1 forgot A; step 2 forgot B (seen at step 1 like C; the smaller key goes first).
    assert s["total"]["forgotten"] == 2 and s["pending_keys"] == 2
    with pytest.raises(
        ValueError, match="max_pending must be an int in \\[0, 2,147,483,647\\], got -1"
    ):
        bounded._physical[0].max_pending = -1


@pytest.mark.parametrize("bound", [3, 2])
def test_pending_bound_keeps_keys_a_lookup_admitted_until_their_update(backend, bound):
    """insert_on="apply", T=1, two lookups before their updates: the first admits A (seen at
    step 0) and counts C; the second brings two new keys B and D past ``max_pending``. With
    room (bound 3) it forgets C, though A is smaller and was seen at the same step: A was
    admitted by a lookup whose update has not come, so A's row is made and trained at that
    update (the bound forgot A before, and A's gradient was dropped). With bound 2 the bound
    forgets C, then A after all (it holds; A's gradient is dropped, as documented)."""
    eng = keyed_engine(backend, occurrence_threshold=1, insert_on="apply")
    eng._physical[0].max_pending = bound
    train_bags(eng, [[A]])  # step 0: A counted
    ax, bx = eng.lookup_with_batch({"f": [[A], [C]]})  # step 1: A admitted, C counted
    assert eng.table_stats()["k"]["this_step"]["filtered"] == 1  # C only
    ay, by = eng.lookup_with_batch({"f": [[B], [D]]})  # step 1: B, D new: room is made
    s = eng.table_stats()["k"]
    assert s["this_step"]["forgotten"] == 4 - bound and s["pending_keys"] == bound
    eng.apply_gradients({"f": np.ones_like(ax["f"])}, batch=bx)  # step 1
    eng.apply_gradients({"f": np.ones_like(ay["f"])}, batch=by)  # step 2: B, D counted at 1
    c = eng.table_contents("k")
    if bound == 3:
        assert c["keys"].tolist() == [B, D, A]
        np.testing.assert_array_equal(c["weights"][:, 0], np.float32([B - 1, D - 1, A - 1]))
    else:
        assert c["keys"].tolist() == [B, D]
    assert eng.table_stats()["k"]["pending_keys"] == 0


def test_expiry_and_readmission_with_fresh_row(backend):
    eng = keyed_engine(backend, optimizer=opt.Adagrad(0.5), expire_steps=2)
    for step in range(3):  # A at step 0 only; B every step
        train_bags(eng, [[A, B]] if step == 0 else [[B]])
    assert keyed_keys(eng) == [B, A]  # A last touched at step 0; now step 3
    # Step 3: 3 - 0 > 2, so A is gone before this step's lookup; evaluation already sees zeros.
    assert not eng.lookup({"f": [[A]]}, training=False)["f"].any()
    assert keyed_keys(eng) == [B, A]  # evaluation removed nothing
    train_bags(eng, [[B]])
    assert keyed_keys(eng) == [B]
    assert eng.table_stats()["k"]["this_step"]["expired"] == 1
    # A again: a new row, its initial values and fresh slots (Adagrad's initial accumulator).
    acts = eng.lookup({"f": [[A]]})["f"]
    np.testing.assert_array_equal(acts, [[A, A]])
    c = eng.table_contents("k")
    fresh = opt.Adagrad(0.5).slot_specs(2)[0].initial_value
    np.testing.assert_array_equal(c["accumulators"][c["keys"] == A], np.float32([[fresh, fresh]]))


def test_a_step_without_keys_of_the_table_expires_nothing_until_one_has(backend):
    # The rules run with the table's keys: empty batches leave an expired row counted (stats,
    # contents), though every lookup already sees it as absent; the next batch with keys of
    # the table removes it (DynamicVocabulary's docstring).
    eng = keyed_engine(backend, expire_steps=1)
    train_bags(eng, [[A]])
    for _ in range(3):
        train_bags(eng, [[]])
    assert keyed_keys(eng) == [A] and eng.table_stats()["k"]["total"]["expired"] == 0
    assert not eng.lookup({"f": [[A]]}, training=False)["f"].any()
    train_bags(eng, [[B]])
    assert keyed_keys(eng) == [B] and eng.table_stats()["k"]["total"]["expired"] == 1


def _nan_at_second_call():
    """(the shapes it was asked for, a FromFunction function of 0.5s whose second call's
    first value is NaN)."""
    calls = []

    def fn(shape, dtype):
        calls.append(shape)
        v = np.full(shape, 0.5, np.float32)
        if len(calls) == 2:
            v[0, 0] = np.nan
        return v

    return calls, fn


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_initializer_refusing_new_keys_leaves_them_out(backend, dtype):
    # A FromFunction initializer is asked for a batch's new keys before they are inserted: one
    # that fails (a NaN here) leaves the table as it was, and the keys get its values when
    # seen again. They stayed in the index with rows of zeros, never initialised again.
    from embengine.initializers import FromFunction

    calls, fn = _nan_at_second_call()

    t = ee.TableConfig(
        None, 2, name="k", combiner="sum", initializer=FromFunction(fn), weights_dtype=dtype
    )
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t)}, optimizer=opt.SGD(0.1), backend=backend, seed=1
    )
    train_bags(eng, [[7]])
    with pytest.raises(ValueError, match="non-finite"):
        eng.lookup({"f": [[7, 10, 20, 30]]})
    assert keyed_keys(eng) == [7] and eng.table_stats()["k"]["rows"] == 1
    acts = eng.lookup({"f": [[10, 20, 30]]})["f"]
    np.testing.assert_array_equal(acts, [[1.5, 1.5]])
    assert keyed_keys(eng) == [7, 10, 20, 30] and calls == [(1, 2), (3, 2), (3, 2)]


@pytest.mark.parametrize("insert_on", ["lookup", "apply"])
def test_an_initial_value_past_a_16_bit_range_leaves_the_new_keys_out(backend, insert_on):
    # A 16-bit keyed table's initializer without a bound (RowId: the key itself) has its values
    # checked when keys arrive. The check ran as the rows were written, after the batch's new
    # keys were in the index: the ValueError named the table and key 70000, but keys 10 and
    # 70000 stayed with rows of zeros and zero slots (Adagrad's 0.1 never set), another
    # table's new keys too, and the next step trained those rows (found by probing the
    # keyed / 16-bit fuzz configs' refusal rule). Now checked before anything changes.
    def table(name, **kw):
        return ee.TableConfig(
            None,
            2,
            name=name,
            combiner="sum",
            optimizer=opt.Adagrad(0.1),
            dynamic=ee.DynamicVocabulary(insert_on=insert_on),
            **kw,
        )

    t = table("k", initializer=RowId(), weights_dtype="float16")
    u = table("u")
    eng = ee.EmbeddingEngine(
        {"g": ee.FeatureConfig(u), "f": ee.FeatureConfig(t)}, backend=backend, seed=1
    )
    ones = np.ones((1, 2), np.float32)
    eng.lookup({"f": [[7]], "g": [[1]]})
    eng.apply_gradients({"f": ones, "g": ones})
    before = eng.state_dict()
    with pytest.raises(ValueError, match=r"table 'k': .*gives 70000.0 \(key 70000\), beyond"):
        eng.lookup({"f": [[10, 70000]], "g": [[2]]})
        eng.apply_gradients({"f": ones, "g": ones})  # insert_on="apply": refused here
    if insert_on == "lookup":  # the refused call was the lookup: nothing changed
        assert eng.table_contents("u")["keys"].tolist() == [1]
        for name in ("k", "u"):
            for key, value in before["tables"][name].items():
                np.testing.assert_array_equal(eng.state_dict()["tables"][name][key], value)
    assert eng.table_contents("k")["keys"].tolist() == [7] and eng.step == 1
    # the key in range gets its row when seen again: RowId's value, Adagrad's accumulator
    eng.lookup({"f": [[10]], "g": [[2]]})
    eng.apply_gradients({"f": ones, "g": ones})
    c = eng.table_contents("k")
    assert c["keys"].tolist() == [7, 10]
    np.testing.assert_allclose(c["accumulators"][1], [1.1, 1.1], rtol=1e-6)  # 0.1 + 1
    want = 10.0 - 0.1 / np.sqrt(1.1)  # one Adagrad step from 10, to a float16 quantum
    np.testing.assert_allclose(c["weights"][1].astype(np.float32), [want, want], atol=2**-6)


def test_an_initializer_refusing_new_keys_changes_no_other_table(backend):
    # As above with two keyed tables: the refusal came from the second table's resolution,
    # after the first had inserted (and counted) its new key: u held [1, 2]. FromFunction is
    # now asked in check_rows, before any table changes, once a batch (its values kept).
    from embengine.initializers import FromFunction

    calls, fn = _nan_at_second_call()

    k = ee.TableConfig(None, 2, name="k", combiner="sum", initializer=FromFunction(fn))
    u = ee.TableConfig(None, 2, name="u", combiner="sum")
    eng = ee.EmbeddingEngine(
        {"g": ee.FeatureConfig(u), "f": ee.FeatureConfig(k)},
        optimizer=opt.SGD(0.1),
        backend=backend,
        seed=1,
    )
    ones = np.ones((1, 2), np.float32)
    eng.lookup({"f": [[7]], "g": [[1]]})
    eng.apply_gradients({"f": ones, "g": ones})
    before = eng.state_dict()
    with pytest.raises(ValueError, match="non-finite"):
        eng.lookup({"f": [[10]], "g": [[2]]})
    for name in ("k", "u"):
        for key, value in before["tables"][name].items():
            np.testing.assert_array_equal(eng.state_dict()["tables"][name][key], value)
    acts = eng.lookup({"f": [[10]], "g": [[2]]})["f"]
    np.testing.assert_array_equal(acts, [[0.5, 0.5]])
    assert eng.table_contents("u")["keys"].tolist() == [1, 2] and calls == [(1, 2)] * 3


def test_a_training_lookup_scans_for_expired_rows_once(backend):
    """The scan of every row's metadata for expired rows runs once per training lookup, not in
    each rule that asks (the numba backend's probe, expiry, eviction: 2M rows took 14.9 ms a
    lookup with two scans, 9.1 ms with one); a lookup after rows changed, or at another step,
    scans again."""
    eng = keyed_engine(backend, expire_steps=1, max_rows=2)
    table = eng._physical[0]
    scans = []
    scan = table._scan_expired
    table._scan_expired = lambda: scans.append(table._step) or scan()
    train_bags(eng, [[A, B]])
    train_bags(eng, [[C, D]])
    scans.clear()
    train_bags(eng, [[E, C]])  # step 2: A and B expired (2 - 0 > 1), E evicts D (max_rows)
    assert keyed_keys(eng) == sorted([C, E])
    assert eng.table_stats()["k"]["this_step"]["evicted"] == 1
    assert scans == [2]
    eng.lookup({"f": [[A]]}, training=False)  # step 3
    eng.lookup({"f": [[C]]}, training=False)  # nothing changed since the last scan
    assert scans == [2, 3]
    train_bags(eng, [[C]])
    assert scans == [2, 3]
    train_bags(eng, [[C]])  # the step before inserted nothing but touched C
    assert scans == [2, 3, 4]


def test_lru_eviction(backend):
    eng = keyed_engine(backend, max_rows=3)
    train_bags(eng, [[A, B, C]])
    train_bags(eng, [[A]])
    train_bags(eng, [[D]])  # B and C last touched at step 0: the smaller key, B, goes
    assert keyed_keys(eng) == [D, A, C]
    train_bags(eng, [[E, C]])  # A (step 1) is now the least recent; C is in the batch
    assert keyed_keys(eng) == [D, C, E]
    assert eng.table_stats()["k"]["total"]["evicted"] == 2
    # An evicted key seen again is a new row: its initial value, not its trained one.
    np.testing.assert_array_equal(train_bags(eng, [[B]]), [[B, B]])


def test_lfu_eviction(backend):
    eng = keyed_engine(backend, max_rows=3, eviction="lfu")
    train_bags(eng, [[A, A, B, C]])  # touches: A 2, B 1, C 1
    train_bags(eng, [[B], [B], [B]])  # B 4
    train_bags(eng, [[D]])  # C has the fewest touches (1)
    assert keyed_keys(eng) == [B, D, A]
    train_bags(eng, [[E]])  # D 1 (step 2) < A 2 < B 4: D goes (LRU would take A)
    assert keyed_keys(eng) == [B, A, E]


def test_a_batch_needing_more_than_max_rows_is_an_error_and_changes_nothing(backend):
    eng = keyed_engine(backend, optimizer=opt.Adagrad(0.1), max_rows=2, occurrence_threshold=1)
    train_bags(eng, [[A, B, C]])
    train_bags(eng, [[A, B]])
    before, stats = eng.table_contents("k"), eng.table_stats()
    with pytest.raises(ValueError, match="table 'k': this batch needs 3 rows .* max_rows=2"):
        eng.lookup({"f": [[A, B, C]]})
    after = eng.table_contents("k")
    assert all(after[k].tobytes() == before[k].tobytes() for k in before)
    assert eng.table_stats() == stats and eng.step == 2
    with pytest.raises(ValueError, match="apply_gradients needs a lookup"):
        eng.apply_gradients({"f": np.ones((1, 2), np.float32)})
    train_bags(eng, [[A, B]])  # the table trains on
    assert keyed_keys(eng) == [B, A]


def test_a_refused_batch_leaves_the_other_keyed_tables_untouched(backend):
    """Table "a" refuses the batch (max_rows) after the numba region probed table "b", whose
    keys all had rows: b's recency and counts must stay as they were (the region touches no
    table when one may refuse)."""
    dyn = [ee.DynamicVocabulary(max_rows=2), ee.DynamicVocabulary()]
    tables = [
        ee.TableConfig(None, 2, name=n, initializer=RowId(0), dynamic=d)
        for n, d in zip("ab", dyn, strict=True)
    ]
    eng = ee.EmbeddingEngine(
        {"fa": ee.FeatureConfig(tables[0]), "fb": ee.FeatureConfig(tables[1])},
        optimizer=opt.SGD(1.0),
        backend=backend,
    )
    acts = eng.lookup({"fa": [[1, 2]], "fb": [[5, 6, 6]]})
    eng.apply_gradients({k: np.ones_like(v) for k, v in acts.items()})
    before = {n: t.state() for n, t in zip("ab", eng._physical, strict=True)}
    with pytest.raises(ValueError, match="table 'a': this batch needs 3 rows"):
        eng.lookup({"fa": [[1, 2, 3]], "fb": [[5, 6]]})
    for n, t in zip("ab", eng._physical, strict=True):
        after = t.state()
        assert all(after[k].tobytes() == before[n][k].tobytes() for k in before[n]), n


@pytest.mark.parametrize("path", ["lookup", "preprocess", "apply", "apply-lookup"])
def test_a_batch_a_later_table_refuses_changes_no_earlier_table(backend, path):
    """Tables are resolved in order; table "a" (max_rows=2) comes after table "b", which takes
    a new key in the refused batch: b must not have inserted it, touched its rows or counted
    the call (every table is checked before any changes). "apply" and "apply-lookup": both
    insert on apply; a refuses the update of the batch never looked up, and the training
    lookup of it (which would count b's keys), as its update would."""
    on = "apply" if path.startswith("apply") else "lookup"
    eng = _two_tables(backend, dict(max_rows=2, insert_on=on), dict(insert_on=on))
    refused = {"fa": [[1, 2, 3]], "fb": [[5, 6, 7]]}
    grads = {"fa": np.ones((1, 2), np.float32), "fb": np.ones((1, 2), np.float32)}
    call = {
        "lookup": lambda: eng.lookup(refused),
        "preprocess": lambda: eng.lookup(eng.preprocess(refused)),
        "apply": lambda: eng.apply_gradients(grads, batch=eng.preprocess(refused)),
        "apply-lookup": lambda: eng.lookup(refused),
    }[path]
    text = _unchanged_by(eng, call)
    assert text.startswith("table 'a': this batch needs 3 rows"), text
    assert eng.table_contents("b")["keys"].tolist() == [5, 6]


def _two_tables(backend, a, b=None):
    """Keyed tables "b" then "a" (``DynamicVocabulary`` kwargs), features "fb", "fa"; after
    one step on keys 1, 2 (a) and 5, 6 (b)."""
    dyn = {"b": ee.DynamicVocabulary(**(b or {})), "a": ee.DynamicVocabulary(**a)}
    tables = {
        n: ee.TableConfig(None, 2, name=n, initializer=RowId(0), dynamic=d) for n, d in dyn.items()
    }
    eng = ee.EmbeddingEngine(
        {"fb": ee.FeatureConfig(tables["b"]), "fa": ee.FeatureConfig(tables["a"])},
        optimizer=opt.SGD(1.0),
        backend=backend,
    )
    acts = eng.lookup({"fa": [[1, 2]], "fb": [[5, 6]]})
    eng.apply_gradients({k: np.ones_like(v) for k, v in acts.items()})
    return eng


def _unchanged_by(eng, call):
    """``call()`` raises a ValueError (returned) and changes no table, stats or step."""
    before = {t.name: t.state() for t in eng._physical}
    stats, step = eng.table_stats(), eng.step
    with pytest.raises(ValueError) as e:
        call()
    for t in eng._physical:
        after = t.state()
        changed = [k for k in before[t.name] if after[k].tobytes() != before[t.name][k].tobytes()]
        assert not changed, (t.name, changed)
    assert eng.table_stats() == stats and eng.step == step
    return str(e.value)


def test_the_update_of_a_batch_never_looked_up_is_checked_before_its_resolution(backend):
    """apply_gradients(batch=preprocess(...)) resolves the batch's rows, then inserts on apply:
    table a (max_rows=2, insert on apply) refuses the update only then, after table b would
    have taken key 7 and a's rows been touched."""
    eng = _two_tables(backend, dict(max_rows=2, insert_on="apply"))
    batch = eng.preprocess({"fa": [[1, 2, 3]], "fb": [[5, 6, 7]]})
    grads = {n: np.ones(lay.shape, np.float32) for n, lay in batch.features.items()}
    text = _unchanged_by(eng, lambda: eng.apply_gradients(grads, batch=batch))
    assert text.startswith("table 'a': this batch needs 3 rows"), text


def test_a_table_near_the_row_limit_keeps_the_region_from_touching_the_others(backend, monkeypatch):
    """The numba region touches the rows of a table whose keys it all found unless another
    table may refuse the batch: max_rows, and the int32 row limit (patched to 3) that a batch
    of more keys than rows left could pass."""
    from embengine.storage import keyed as keyed_storage

    eng = _two_tables(backend, {})
    monkeypatch.setattr(keyed_storage, "MAX_KEYED_ROWS", 3)
    text = _unchanged_by(eng, lambda: eng.lookup({"fa": [[1, 2, 3, 4]], "fb": [[5, 6, 6]]}))
    assert text.startswith("table 'a': 4 rows, more than one keyed table holds"), text


def test_an_update_inserting_on_apply_removes_expired_rows_to_stay_within_max_rows(backend):
    """Rows expire by data time at the update (its timestamp): an update inserting on apply
    must count them out before it inserts, or the table passes max_rows (and its checkpoint
    no longer loads)."""
    dyn = ee.DynamicVocabulary(max_rows=2, insert_on="apply", expire_seconds=10)
    t = ee.TableConfig(None, 2, name="a", initializer=RowId(0), dynamic=dyn)
    eng = ee.EmbeddingEngine({"fa": ee.FeatureConfig(t)}, optimizer=opt.SGD(1.0), backend=backend)
    acts = eng.lookup({"fa": [[1, 2]]}, timestamp=0)
    eng.apply_gradients({k: np.ones_like(v) for k, v in acts.items()})
    acts = eng.lookup({"fa": [[3]]}, timestamp=5)
    eng.apply_gradients({k: np.ones_like(v) for k, v in acts.items()}, timestamp=100)
    assert eng.table_contents("a")["keys"].tolist() == [3]
    assert eng.table_stats()["a"]["this_step"]["expired"] == 2
    # Within max_rows, expired rows wait for the next training lookup, as before.
    eng = ee.EmbeddingEngine({"fa": ee.FeatureConfig(t)}, optimizer=opt.SGD(1.0), backend=backend)
    acts = eng.lookup({"fa": [[1]]}, timestamp=0)
    eng.apply_gradients({k: np.ones_like(v) for k, v in acts.items()})
    acts = eng.lookup({"fa": [[3]]}, timestamp=5)
    eng.apply_gradients({k: np.ones_like(v) for k, v in acts.items()}, timestamp=100)
    assert eng.table_contents("a")["keys"].tolist() == [1, 3]


def test_an_update_whose_rows_a_later_lookup_gave_to_other_keys_is_refused(backend):
    """Two lookups before their updates: the second evicts (max_rows) a key of the first and
    gives its row to a new key; the first's update would write key 2's gradient into key 3's
    row. It is refused, nothing changed; the second's update trains."""
    t = ee.TableConfig(
        None, 2, name="a", initializer=RowId(0), dynamic=ee.DynamicVocabulary(max_rows=2)
    )
    eng = ee.EmbeddingEngine({"fa": ee.FeatureConfig(t)}, optimizer=opt.SGD(1.0), backend=backend)
    for bags in ([[1, 2]], [[1]]):
        acts = eng.lookup({"fa": bags})
        eng.apply_gradients({k: np.zeros_like(v) for k, v in acts.items()})
    ax, bx = eng.lookup_with_batch({"fa": [[2]]})
    ay, by = eng.lookup_with_batch({"fa": [[1, 3]]})  # evicts key 2; key 3 takes its row
    grads = {"fa": np.full_like(ax["fa"], 100.0)}
    text = _unchanged_by(eng, lambda: eng.apply_gradients(grads, batch=bx))
    assert "1 of this batch's keys (e.g. 2) lost their rows after its lookup" in text, text
    eng.apply_gradients({"fa": np.ones_like(ay["fa"])}, batch=by)
    c = eng.table_contents("a")
    assert c["keys"].tolist() == [1, 3]
    np.testing.assert_array_equal(c["weights"][:, 0], [0.5, 2.5])  # mean of two ids


def test_a_prepared_batch_updated_after_another_lookup_keeps_its_lookup_s_rows(backend):
    """Two lookups of prepared batches before their updates: ``apply_gradients(batch=p1)``
    after ``lookup(p2)`` updates the rows ``lookup(p1)`` resolved, as with
    ``lookup_with_batch``'s batch: its keys are not counted, touched or admitted a second time
    (they were: key 2's touch count and key 5's pending count were doubled, and the update
    resolved them at the step it ran), and a key a later lookup evicted refuses the update
    (it was given a row again)."""

    def stream(prepared: bool):
        t = ee.TableConfig(
            None,
            2,
            name="a",
            initializer=RowId(0),
            dynamic=ee.DynamicVocabulary(occurrence_threshold=1, max_rows=3),
        )
        eng = ee.EmbeddingEngine(
            {"fa": ee.FeatureConfig(t)}, optimizer=opt.SGD(1.0), backend=backend
        )

        def look(bags):
            if prepared:
                p = eng.preprocess({"fa": bags})
                return eng.lookup(p)["fa"], p
            acts, b = eng.lookup_with_batch({"fa": bags})
            return acts["fa"], b

        for bags in ([[1, 2, 3]], [[1, 2, 3]]):  # 1, 2 and 3 admitted (3 rows: max_rows)
            acts, _ = look(bags)
            eng.apply_gradients({"fa": np.zeros_like(acts)})
        a1, b1 = look([[5], [2]])  # 5 counted once
        a2, _ = look([[7], [9]])
        eng.apply_gradients({"fa": np.ones_like(a1)}, batch=b1)
        eng.apply_gradients({"fa": np.ones_like(a2)})
        states = [eng.state_dict()]
        a3, b3 = look([[5, 7]])  # 5 and 7 reach the threshold: they evict 1 and 3 (LRU)
        a4, _ = look([[9], [2]])  # 9 reaches it: it evicts 5 (5 and 7: this step's)
        text = _unchanged_by(eng, lambda: eng.apply_gradients({"fa": np.ones_like(a3)}, batch=b3))
        eng.apply_gradients({"fa": np.ones_like(a4)})
        states.append(eng.state_dict())
        return states, text

    want, want_text = stream(prepared=False)
    got, got_text = stream(prepared=True)
    assert "lost their rows" in want_text and got_text == want_text, (got_text, want_text)
    for g, w in zip(got, want, strict=True):
        for name, v in w["tables"]["a"].items():
            np.testing.assert_array_equal(g["tables"]["a"][name], v, err_msg=name)


def test_insert_on_apply(backend):
    eng = keyed_engine(backend, optimizer=opt.SGD(0.5), insert_on="apply")
    acts = eng.lookup({"f": [[A], [A, B]]})["f"]
    assert not acts.any() and keyed_keys(eng) == []  # zeros before the first update
    eng.apply_gradients({"f": np.float32([[1, 2], [3, 4]])})
    # The update made the rows and applied this step's gradient to them.
    c = eng.table_contents("k")
    assert c["keys"].tolist() == [B, A]
    np.testing.assert_array_equal(c["weights"], np.float32([[B - 1.5, B - 2], [A - 2, A - 3]]))
    acts = eng.lookup({"f": [[A], [D]]})["f"]
    np.testing.assert_array_equal(acts, np.float32([[A - 2, A - 3], [0, 0]]))
    eng.apply_gradients({"f": np.zeros((2, 2), np.float32)})
    assert keyed_keys(eng) == [B, D, A]
    # With a threshold: counted at the lookup, inserted at the update once admitted.
    eng = keyed_engine(backend, insert_on="apply", occurrence_threshold=1)
    train_bags(eng, [[C]])
    assert keyed_keys(eng) == []
    assert not train_bags(eng, [[C]]).any()  # admitted at step 1: zeros, then the row
    np.testing.assert_array_equal(eng.table_contents("k")["weights"], [[C - 1, C - 1]])


def test_evaluation_lookups_never_insert_or_refresh(backend):
    eng = keyed_engine(backend, expire_steps=1, max_rows=2)
    train_bags(eng, [[A, B]])
    stats = eng.table_stats()
    acts = eng.lookup({"f": [[A, C], [D]]}, training=False)["f"]
    np.testing.assert_array_equal(acts, np.float32([[A - 1, A - 1], [0, 0]]))
    batch = eng.preprocess({"f": [[C]]})  # a deduplicated batch looked up for evaluation
    assert not eng.lookup(batch, training=False)["f"].any()
    assert keyed_keys(eng) == [B, A] and eng.table_stats() == stats
    train_bags(eng, [[B]])  # step 1
    for _ in range(3):  # evaluation does not refresh A
        eng.lookup({"f": [[A]]}, training=False)
    # Step 2: A (touched at step 0) has expired but keeps its row until the next training
    # lookup; an evaluation lookup sees it as absent (numba: the expired rows' flags).
    acts = eng.lookup({"f": [[A], [B], [A, B]]}, training=False)["f"]
    assert not acts[0].any() and acts[1].any() and acts[2].tobytes() == acts[1].tobytes()
    assert keyed_keys(eng) == [B, A]
    train_bags(eng, [[B]])  # step 2: the training lookup removes A
    assert keyed_keys(eng) == [B]


def _keyed_state(eng) -> dict:
    """Table "k"'s whole state (keys, rows, slots, recency, counts, pending admissions, data
    time, counters) as bytes, and its stats."""
    with eng.lock:
        state = {k: np.asarray(a).tobytes() for k, a in eng.state_dict()["tables"]["k"].items()}
    return {"state": state, "stats": eng.table_stats()["k"], "step": eng.step}


EVAL_BETWEEN = {
    "plain": {},
    "T1-max_rows-expire_steps": {"occurrence_threshold": 1, "max_rows": 6, "expire_steps": 2},
    "apply-T1-max_rows": {"insert_on": "apply", "occurrence_threshold": 1, "max_rows": 6},
    "seconds-lfu": {"expire_seconds": 150, "eviction": "lfu", "max_rows": 6},
}


@pytest.mark.parametrize("explicit", [False, True], ids=["pending", "batch="])
@pytest.mark.parametrize("dynamic", list(EVAL_BETWEEN.values()), ids=list(EVAL_BETWEEN))
def test_an_evaluation_lookup_between_a_keyed_lookup_and_its_update_changes_nothing(
    backend, dynamic, explicit
):
    """Training lookup, evaluation lookups of held-out bags (keys of the training batch, keys
    pending admission, keys expired or evicted, keys never seen), then the update: every step
    ends in the state, stats and data time of the same stream without the evaluation, bit for
    bit, and the evaluation inserts, admits, counts and refreshes nothing (the state right
    after it is the state before it). Evaluation lookups used to forget the pending batch:
    apply_gradients() raised "needs a lookup", and apply_gradients(batch=) resolved the batch's
    keys a second time (step 0's 5 keys counted twice: lookups 5 -> 10, and with a threshold
    filtered 5 -> 10, their pending counts doubled)."""
    timed = "expire_seconds" in dynamic
    pool = np.array([A, B, C, D, E, 11, 12, 13, 14, 15], np.int64)
    unseen = np.array([101, 102, -103], np.int64)
    rng = np.random.default_rng(4)
    engines = [
        keyed_engine(backend, opt.Adagrad(0.5), dim=3, init=RandomUniform(-1, 1), **dynamic)
        for _ in range(2)
    ]
    plain, checked = engines
    for step in range(8):
        keys = rng.choice(pool[: 5 + step % 4], 5, replace=False)
        bags = [list(keys[:2]), list(keys[1:4]), [keys[4]], []]
        grads = rng.standard_normal((len(bags), 3)).astype(np.float32)
        held_out = [list(rng.choice(np.concatenate([pool, unseen]), 3)) for _ in range(4)]
        when = {"timestamp": 1000 + 100 * step} if timed else {}
        for eng in engines:
            batch = eng.preprocess({"f": bags}) if explicit else None
            acts = eng.lookup(batch if explicit else {"f": bags}, **when)["f"].copy()
            if eng is checked:
                before = _keyed_state(eng)
                eng.lookup({"f": held_out}, training=False)
                eng.lookup({"f": bags}, training=False)
                eng.lookup(eng.preprocess({"f": held_out}), training=False)
                assert _keyed_state(eng) == before, step  # evaluation changed nothing
                np.testing.assert_array_equal(eng.lookup({"f": bags}, training=False)["f"], acts)
            eng.apply_gradients({"f": grads}, batch=batch)
        assert _keyed_state(checked) == _keyed_state(plain), step
    total = plain.table_stats()["k"]["total"]
    if dynamic.get("max_rows"):
        assert total["evicted"] + total["expired"] > 0, total  # the stream exercised the rules


def _stream(threads: int):
    numba.set_num_threads(threads)
    try:
        eng = keyed_engine(
            "numba",
            optimizer=opt.Adam(0.1),
            dim=8,
            init=RandomUniform(-1, 1),
            occurrence_threshold=1,
            max_rows=100,
            expire_steps=6,
        )
        rng = np.random.default_rng(5)
        for _ in range(12):
            keys = rng.zipf(1.3, 200) * np.int64(0x9E3779B97F4A7C15 % 2**61)  # wraps: any int64
            train_bags(eng, [list(keys[i : i + 4]) for i in range(0, 200, 4)], grad=0.1)
        return eng.table_contents("k"), eng.table_stats()
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


def test_same_stream_at_one_and_two_threads_is_bit_identical():
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs 2 numba threads")
    (c1, s1), (c2, s2) = _stream(1), _stream(2)
    total = s1["k"]["total"]
    assert s1 == s2 and min(total["evicted"], total["expired"], total["forgotten"]) > 0
    assert set(c1) == set(c2)
    for k in c1:
        assert c1[k].tobytes() == c2[k].tobytes(), k


def _four_tables_stream(threads: int, spy=None):
    """Four keyed tables with admission, capacity and expiry, 10 steps of new and known keys;
    their contents and stats. ``spy``: put in place of KeyedTable.rows_for meanwhile."""
    from embengine.storage.keyed import KeyedTable

    numba.set_num_threads(threads)
    real = KeyedTable.rows_for
    if spy is not None:
        KeyedTable.rows_for = lambda self, *a, **k: spy(real, self, *a, **k)
    try:
        dyn = ee.DynamicVocabulary(occurrence_threshold=1, max_rows=60, expire_steps=5)
        tables = [
            ee.TableConfig(
                None,
                8,
                name=f"k{t}",
                optimizer=opt.Adam(0.1),
                initializer=RandomUniform(-1, 1),
                dynamic=dyn,
            )
            for t in range(4)
        ]
        eng = ee.EmbeddingEngine({f"f{t}": ee.FeatureConfig(tab) for t, tab in enumerate(tables)})
        rng = np.random.default_rng(9)
        for _ in range(10):
            feats = {
                f"f{t}": ee.Ragged(
                    rng.zipf(1.3, 120) * np.int64(0x9E3779B97F4A7C15 % 2**61) + t,
                    offsets=np.arange(0, 121, 4),
                )
                for t in range(4)
            }
            acts = eng.lookup(feats)
            eng.apply_gradients({f: np.full_like(a, 0.1) for f, a in acts.items()})
        return {t: eng.table_contents(f"k{t}") for t in range(4)}, eng.table_stats()
    finally:
        KeyedTable.rows_for = real
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


def test_a_step_s_keyed_tables_are_resolved_on_both_threads_alike():
    """A training lookup resolves its keyed tables (rules, new rows, evictions) on the update's
    threads, tables claimed as they go: the first table's resolution waits until another
    thread resolves a table meanwhile (one thread resolving them in turn never does: the wait
    runs out), and the tables and stats equal a one-thread run's, bit for bit."""
    import threading

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs 2 numba threads")
    threads, other, waits = set(), threading.Event(), []

    def spy(real, self, *a, **k):
        me = threading.get_ident()
        if threads and me not in threads:
            other.set()
        if not threads and not k.get("touched"):  # the first resolution with rules to run
            threads.add(me)
            waits.append(other.wait(10))
        threads.add(me)
        return real(self, *a, **k)

    (c2, s2), (c1, s1) = _four_tables_stream(2, spy), _four_tables_stream(1)
    assert waits == [True] and len(threads) == 2
    totals = [s1[f"k{t}"]["total"] for t in range(4)]
    rules = ("admitted", "filtered", "evicted", "expired", "forgotten")
    assert s1 == s2 and all(sum(t[r] for t in totals) > 0 for r in rules)
    for t in range(4):
        assert set(c1[t]) == set(c2[t])
        for k in c1[t]:
            assert c1[t][k].tobytes() == c2[t][k].tobytes(), (t, k)


@pytest.mark.parametrize(
    "dynamic", [{}, {"occurrence_threshold": 1}, {"expire_steps": 3}], ids=["plain", "T1", "S3"]
)
def test_steps_whose_keys_the_kernel_found_and_touched_count_as_the_reference(dynamic, monkeypatch):
    # A training batch whose every key has a live row is probed and touched in the numba
    # kernel; the storage then only counts it (rows_for's fast path). Its stats (data time
    # included), touch counts and last-touched steps equal the reference backend's, which runs
    # every rule in rows_for, over resident steps with new keys (and expiries) between.
    from embengine.storage.keyed import KeyedTable

    fast = []
    real = KeyedTable.rows_for

    def counted(self, *a, **k):
        fast.append(bool(k.get("touched")))
        return real(self, *a, **k)

    monkeypatch.setattr(KeyedTable, "rows_for", counted)
    engines = {
        be: keyed_engine(be, optimizer=opt.SGD(0.1), dim=4, **dynamic)
        for be in ("numba", "reference")
    }
    rng = np.random.default_rng(7)
    resident = [int(k) for k in rng.integers(-(2**62), 2**62, 12)]
    for step in range(12):
        keys = list(rng.choice(resident, 24))
        if step % 4 == 1:  # a new key: this step goes through every rule
            keys[5] = int(rng.integers(2**62, 2**63 - 1))
        for eng in engines.values():
            bags = [keys[i : i + 3] for i in range(0, 24, 3)]
            train_bags(eng, bags, timestamp=1000 + 10 * step, grad=0.1)
    assert sum(fast) >= 3, fast  # the numba engine's resident steps took the fast path
    (c1, s1), (c2, s2) = ((e.table_contents("k"), e.table_stats()) for e in engines.values())
    assert s1 == s2 and s1["k"]["total"]["hits"] > 0 and s1["k"]["data_time"] == 1110
    assert set(c1) == set(c2)
    for k in c1:
        assert c1[k].tobytes() == c2[k].tobytes(), k


@pytest.mark.parametrize("chunk", [1, 5])
def test_a_probe_in_chunks_pools_and_touches_as_the_reference(chunk, monkeypatch):
    # The training region probes a keyed table's unique keys in chunks that both threads claim
    # (train_lookup._probe_chunks); the one that finishes the last chunk publishes whether
    # every key had a row and touches them. Tiny chunks make every batch many chunks: a new key
    # (no row: the storage resolves the batch after the region) in the first or the last
    # chunk, and resident batches, pool, train and count as one chunk a table does (bit for
    # bit) and as the reference backend does (its sums up to float32 rounding).
    from embengine.kernels import train_lookup

    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    chunks = {"chunks": chunk, "whole": train_lookup.PROBE_CHUNK, "reference": None}
    engines = {
        name: keyed_engine(
            "reference" if c is None else "numba",
            optimizer=opt.Adagrad(0.1),
            dim=4,
            init=RandomUniform(-1, 1),
        )
        for name, c in chunks.items()
    }
    rng = np.random.default_rng(11)
    resident = [int(k) for k in rng.integers(-(2**62), 2**62, 40)]
    acts = {name: [] for name in engines}
    for step in range(10):
        keys = [int(k) for k in rng.choice(resident, 60)]
        if step % 3 == 1:  # a new key, first among the batch's unique keys or last
            keys[0 if step % 2 else 59] = int(rng.integers(2**62, 2**63 - 1))
        bags = [keys[i : i + 4] for i in range(0, 60, 4)]
        for name, eng in engines.items():
            monkeypatch.setattr(train_lookup, "PROBE_CHUNK", chunks[name] or chunk)
            acts[name].append(train_bags(eng, bags, grad=0.1))
    for a, b, c in zip(*acts.values(), strict=True):
        assert a.tobytes() == b.tobytes()
        np.testing.assert_allclose(a, c, rtol=1e-6, atol=1e-6)
    contents = [e.table_contents("k") for e in engines.values()]
    stats = [e.table_stats() for e in engines.values()]
    assert stats[0] == stats[1] == stats[2] and stats[0]["k"]["rows"] == 43
    for k in contents[0]:
        assert contents[0][k].tobytes() == contents[1][k].tobytes(), k
        np.testing.assert_allclose(contents[0][k], contents[2][k], rtol=1e-6, atol=1e-6)


def test_dense_tables_have_contents_and_stats_too():
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(ee.TableConfig(5, 2, name="d", initializer=RowId(0)))},
        optimizer=opt.Adagrad(0.1),
        backend="reference",
    )
    c = eng.table_contents("d")
    assert c["keys"].tolist() == [0, 1, 2, 3, 4]
    np.testing.assert_array_equal(c["weights"][:, 0], [0, 1, 2, 3, 4])
    assert set(c) == {"keys", "weights", "accumulators"}
    s = eng.table_stats()["d"]
    assert (s["kind"], s["rows"], s["capacity"]) == ("ram", 5, 5)
    with pytest.raises(KeyError, match="no table named 'x'"):
        eng.table_contents("x")


# -- the index -----------------------------------------------------------------------------------


@pytest.mark.parametrize("row_bits", [12, 20, 29])
def test_key_index_against_a_dict(row_bits):
    """Random inserts and deletes (by key and by value: tombstones, their reuse and the
    rebuilds that clear them; growth) agree with a dict. ``row_bits`` 12: the values outgrow
    the entries' value bits (a rebuild with more); 29: two-bit tags, so most probes compare
    keys whose tags match in vain."""
    rng = np.random.default_rng(0)
    index, ref = KeyIndex(8), {}
    index.row_bits = row_bits  # an empty index: no entry encoded yet
    pool = rng.integers(-(2**63), 2**63 - 1, 3000, dtype=np.int64)
    pool[:50] = np.arange(50)  # clustered keys too
    by_value = {}
    for step in range(60):
        new = np.array([k for k in rng.choice(pool, 100) if k not in ref], np.int64)
        new = np.unique(new)
        values = np.arange(len(new)) + step * 500
        index.insert(new, values)
        ref.update(zip(new.tolist(), values.tolist(), strict=True))
        by_value.update(zip(values.tolist(), new.tolist(), strict=True))
        gone = rng.choice(np.array(list(ref), np.int64), min(len(ref), 40), replace=False)
        if step % 2:
            index.remove(gone)
        else:  # by value, as a keyed table removes its rows
            index.remove_values(np.sort([ref[int(k)] for k in gone]))
        for k in gone.tolist():
            del by_value[ref.pop(k)]
        probe = rng.choice(pool, 500)
        got = index.find(probe)
        assert got.tolist() == [ref.get(int(k), -1) for k in probe]
        assert index.count == len(ref) == int((index.values >= 0).sum())
        assert index.tombs == int((index.values == keyed_index.TOMB).sum())
        assert index.count + index.tombs <= 0.75 * index.capacity
    assert index.row_bits >= (60 * 500).bit_length()
    assert keyed_index.EMPTY == -1


def test_a_steady_stream_of_keys_keeps_the_index_capacity():
    """Keys coming and going at a steady count (W1-new: every key new, expiring) leave
    tombstones that rebuilds clear: the capacity stays put."""
    rng = np.random.default_rng(1)
    index = KeyIndex()
    live, next_value, caps = [], 0, set()
    for step in range(200):
        keys = np.unique(rng.integers(-(2**63), 2**63 - 1, 300, dtype=np.int64))
        if step >= 3:
            old_keys, old_values = live.pop(0)
            index.remove_values(old_values)
            np.testing.assert_array_equal(index.find(old_keys), -1)
        values = np.arange(next_value, next_value + len(keys)) % 4096
        next_value += len(keys)
        index.insert(keys, values)
        live.append((keys, values))
        np.testing.assert_array_equal(index.find(keys), values)
        if step >= 10:
            caps.add(index.capacity)
    assert caps == {2048}, caps


def test_eviction_order_by_partition_equals_a_full_sort():
    """``_smallest`` (partitions, for eviction without sorting every row) against lexsort."""
    from embengine.storage.keyed import _smallest

    rng = np.random.default_rng(0)
    for _ in range(2000):
        n = int(rng.integers(1, 60))
        k = int(rng.integers(1, n + 1))
        key = rng.permutation(n).astype(np.int64) * 7 - 100
        last, touches = rng.integers(0, 4, n), rng.integers(0, 3, n)
        for cols in ([last, key], [touches, last, key]):
            assert _smallest(cols, k).tolist() == np.lexsort(cols[::-1])[:k].tolist()


def test_touch_sets_the_step_and_adds_the_counts():
    """``keyed_index.touch`` (the rows a training lookup hit) against NumPy's fancy indexing,
    more rows than its prefetch distance; a count saturates at int32's maximum."""
    rng = np.random.default_rng(2)
    rows = rng.permutation(500)[:300].astype(np.int64)
    counts = rng.integers(1, 9, 300).astype(np.int64)
    records = rng.integers(0, 5, (500, keyed_index.RECORD_COLS)).astype(np.int32)
    records[rows[0], keyed_index.TOUCHES] = keyed_index.MAX_TOUCHES - 1
    want = records.astype(np.int64)
    want[rows, keyed_index.LAST] = 17
    want[rows, keyed_index.TOUCHES] += counts
    want[rows[0], keyed_index.TOUCHES] = keyed_index.MAX_TOUCHES
    assert len(rows) > keyed_index.PROBE_AHEAD
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    keyed_index.touch(rows, offsets, 17, records)
    assert records.tolist() == want.tolist()


def test_a_key_costs_24_bytes_beside_its_row():
    """Issue 15's memory target, as ``table_stats`` reports it: at 2^15 keys (row capacity
    2^15, index slots 2^16 at load one half) a key costs a 16-byte record and two 4-byte
    slots; past a doubling of the capacity the records still cost what their rows use."""
    eng = keyed_engine(dim=4)
    keys = np.random.default_rng(0).integers(-(2**62), 2**62, 2**15)
    assert len(np.unique(keys)) == 2**15
    train_bags(eng, ee.Ragged(keys, offsets=np.arange(2**15 + 1)))
    st = eng.table_stats()["k"]
    assert st["rows"] == st["capacity"] == 2**15
    assert st["bytes"]["row_metadata"] / st["rows"] == 16
    assert st["bytes"]["index"] / st["rows"] == 8
    # One key more doubles the row capacity: the records are reserved, not copied, and cost
    # the pages written (16 bytes a key), not the capacity.
    table = eng._physical[0]
    address = table._records_full.ctypes.data
    train_bags(eng, [[2**62 + 1]])
    st = eng.table_stats()["k"]
    assert (st["rows"], st["capacity"]) == (2**15 + 1, 2**16)
    assert 16 < st["bytes"]["row_metadata"] / st["rows"] < 16.2
    assert table._records_full.ctypes.data == address


def test_last_touched_steps_survive_a_step_past_int32():
    """Rows keep their last-touched step as int32 from a base: a step 2^31 past it moves the
    base (``_rebase``), and the steps the state reports, expiry and LRU order stay exact."""
    from embengine.storage.keyed import KeyedTable

    dyn = ee.DynamicVocabulary(expire_steps=2**31 + 10)
    t = KeyedTable("k", 2, (), ee.initializers.Zeros(), 0, dyn)
    t.begin_step(1)
    t.rows_for(0, np.array([10, 11]), insert=True)
    big = 2**31 + 5
    t.begin_step(big)
    assert t._base > 0
    t.rows_for(0, np.array([11, 12]), insert=True)
    st = t.state()
    assert st["keys"].tolist() == [10, 11, 12]
    assert st["last_touched"].tolist() == [1, big, big]
    t.begin_step(2**31 + 12)  # key 10 is 2^31 + 11 steps old now: past expire_steps
    t.rows_for(0, np.array([12]), insert=True)
    assert t.state()["keys"].tolist() == [11, 12]


@pytest.mark.parametrize("expire_steps", [2**31 + 10, 3 * 2**30 - 1])
def test_a_row_older_than_int32_steps_reach_expires_exactly(expire_steps):
    """A row untouched for more steps than the int32 last-touched steps reach from their base
    (3 * 2^30 after a rebase) has its step clamped; with expire_steps up to the longest allowed
    (3 * 2^30 - 1) it still expires at exactly ``expire_steps + 1`` steps of age (a longer
    expiry, refused now, kept it: at 3 * 2^30 and 2^40 the row stayed)."""
    from embengine.storage.keyed import KeyedTable

    dyn = ee.DynamicVocabulary(expire_steps=expire_steps)
    t = KeyedTable("k", 2, (), ee.initializers.Zeros(), 0, dyn)
    t.begin_step(1)
    t.rows_for(0, np.array([10]), insert=True)
    t.begin_step(1 + 3 * 2**30 + 5)  # a rebase: key 10's step is clamped
    t.rows_for(0, np.array([11]), insert=True)
    t.begin_step(1 + expire_steps)  # key 10 is expire_steps old: kept, if still there
    t.rows_for(0, np.array([11]), insert=True)
    kept = t.state()["keys"].tolist()
    t.begin_step(2 + expire_steps)  # now more than expire_steps
    t.rows_for(0, np.array([11]), insert=True)
    assert t.state()["keys"].tolist() == [11]
    if expire_steps < 3 * 2**30 + 5:  # the step of the rebase was already past it
        assert kept == [11]


def test_rows_past_the_int32_limit_are_refused_before_anything_changes(monkeypatch):
    """A keyed table holds at most MAX_KEYED_ROWS rows (int32 rows in its index; patched to
    1500 here): a training batch that would pass it, or a state holding more, is a ValueError
    naming the table or entry, and the table is as it was."""
    from embengine.storage import keyed as keyed_storage
    from embengine.storage.keyed import KeyedTable

    monkeypatch.setattr(keyed_storage, "MAX_KEYED_ROWS", 1500)
    t = KeyedTable("k", 2, (), ee.initializers.Zeros(), 0, ee.DynamicVocabulary(expire_steps=1))
    t.begin_step(1)
    t.rows_for(0, np.arange(1000), insert=True)
    t.begin_step(2)
    t.rows_for(0, np.arange(600), insert=True)  # 400 rows expire at step 3
    before = t.state()
    t.begin_step(3)
    with pytest.raises(ValueError, match="'k': 1,600 rows, more than one keyed table holds"):
        t.check_rows(0, np.arange(2000, 3000))  # what rows_for would raise, checked first
    t.check_rows(0, np.arange(2000, 2900))
    with pytest.raises(ValueError, match="'k': 1,600 rows, more than one keyed table holds"):
        t.rows_for(0, np.arange(2000, 3000), insert=True)  # 1000 new, 400 freed: 1600 rows
    after = t.state()
    assert before.keys() == after.keys()
    for name in before:
        np.testing.assert_array_equal(before[name], after[name], err_msg=name)
    t.rows_for(0, np.arange(2000, 2900), insert=True)  # 900 new, 400 freed: 1500 rows fit
    assert t.rows == 1500
    big = {k: v for k, v in before.items()}
    big["keys"] = np.arange(1501, dtype=np.int64)
    for name in ("last_touched", "touch_counts", "last_time"):
        big[name] = np.resize(before[name], 1501)
    big["weights"] = np.zeros((1501, 2), np.float32)
    with pytest.raises(ValueError, match=r"\['keys'\] holds 1,501 rows, more than one keyed"):
        t.prepare_state(big, 3, "state")
    assert t.rows == 1500


@pytest.mark.parametrize("seed", range(4))
def test_the_expiry_scan_kernel_equals_the_rule_in_numpy(seed):
    """``keyed_index.expired_rows`` against the rules written in NumPy over random records:
    rows without a key (count -1) never expire; by steps (last-touched step more than S
    behind), by data time (more than D seconds behind, NO_TIME never), either or both."""
    from embengine.state import NO_TIME

    rng = np.random.default_rng(seed)
    n, high = 500, 450
    records = np.zeros((n, 4), np.int32)
    records[:, 2] = rng.integers(-5, 40, n)  # last-touched step (relative)
    records[:, 3] = np.where(rng.random(n) < 0.2, -1, rng.integers(0, 9, n))
    times = np.where(rng.random(n) < 0.3, NO_TIME, rng.integers(0, 10**6, n)).astype(np.int64)
    for steps, seconds, now, step in [(3, -1, 0, 30), (-1, 5000, 500_000, 0), (7, 9000, 10**6, 37)]:
        out = np.empty(n, np.int64)
        k = keyed_index.expired_rows(records, high, step, steps, times, now, seconds, out)
        old = np.zeros(high, bool)
        if steps >= 0:
            old |= step - records[:high, 2].astype(np.int64) > steps
        if seconds >= 0:
            t = times[:high]
            old |= (t != NO_TIME) & (now - t > seconds)
        want = np.flatnonzero(old & (records[:high, 3] >= 0))
        np.testing.assert_array_equal(out[:k], want)
        assert 0 < k < high


def test_removing_a_value_the_index_does_not_hold_is_an_error_not_a_hang():
    index = KeyIndex()
    index.insert(np.array([10, 20]), np.array([0, 1]))
    index.hold(8)
    index.keys[5, 0] = 30
    with pytest.raises(AssertionError, match="1 of the values to remove were not indexed"):
        index.remove_values(np.array([5]))
    with pytest.raises(AssertionError, match="1 of the values to remove were not indexed"):
        index.remove_values(np.array([0, 0]))
    assert index.count == 1 and index.find(np.array([10, 20])).tolist() == [-1, 1]


def test_lookups_stay_right_when_the_index_entries_take_more_row_bits(monkeypatch):
    """The kernels read an index whose entries' row bits grow as the rows do (row bits start
    at 1 here, not 20: 12 for the first 1024 rows' capacity, 15 once it reaches 8192): the
    numba backend's training and evaluation lookups, which probe the index in their kernels,
    equal a dense table's before and after."""
    from embengine.storage import keyed as keyed_storage

    monkeypatch.setattr(keyed_storage, "_MIN_ROW_BITS", 1)
    n = 9000
    engines = []
    for size in (n, None):
        t = ee.TableConfig(size, 4, name="t", combiner="sum", initializer=RandomUniform(-1, 1))
        engines.append(ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=opt.SGD(0.5)))
    dense, keyed = engines
    rng = np.random.default_rng(5)
    bits = []
    for step in range(4):
        ids = rng.permutation(n)[: 3000 * (step + 1)] if step < 3 else rng.integers(0, n, 4000)
        bags = ee.Ragged(ids.astype(np.int64), offsets=np.arange(0, len(ids) + 1, 4))
        want = dense.lookup({"f": bags})["f"]
        got = keyed.lookup({"f": bags})["f"]
        assert got.tobytes() == want.tobytes(), step
        grad = {"f": rng.standard_normal(want.shape).astype(np.float32)}
        dense.apply_gradients(grad)
        keyed.apply_gradients(grad)
        bits.append(keyed._physical[0]._index.row_bits)
        evaluated = keyed.lookup({"f": bags}, training=False)["f"]
        assert evaluated.tobytes() == dense.lookup({"f": bags}, training=False)["f"].tobytes()
    assert bits == [12, 15, 15, 15], bits


def test_the_record_layout_is_the_kernels():
    """storage/keyed.py and kernels/keyed_index.py name the same record columns."""
    from embengine.storage import keyed as keyed_storage

    assert (keyed_storage._RECORD_COLS, keyed_storage._LAST, keyed_storage._TOUCHES) == (
        keyed_index.RECORD_COLS,
        keyed_index.LAST,
        keyed_index.TOUCHES,
    )
    assert ee.config.MAX_KEYED_ROWS == keyed_index.MAX_VALUE
    assert keyed_storage._ENTRY_BITS == keyed_index.ENTRY_BITS


def test_the_row_arena_asks_for_huge_pages():
    """A keyed table's rows live in an anonymous mapping that asks for transparent huge pages
    once its capacity reaches 4 MiB, as NumPy's big arrays (a dense table's) do: without them
    W1's keyed update and pooling ran 1.2-1.4x slower (TLB misses; docs/performance.md, "Keyed
    tables"); below, a small table would pay 2 MiB for a few rows."""
    mode = "/sys/kernel/mm/transparent_hugepage/enabled"
    try:
        with open(mode) as f:
            if "[never]" in f.read():
                pytest.skip("transparent huge pages are off on this host")
    except OSError:
        pytest.skip("no transparent huge pages here")
    small = keyed_engine(dim=64)
    train_bags(small, [[k] for k in range(3000)])  # 0.75 MiB of rows: 4 KiB pages
    eng = keyed_engine(dim=64)
    train_bags(eng, [[k] for k in range(20000)])  # 5 MiB of rows: huge pages
    assert "hg" not in _vm_flags(small._physical[0].data.ctypes.data)
    assert "hg" in _vm_flags(eng._physical[0].data.ctypes.data)


def _vm_flags(start: int) -> list[str]:
    """The VmFlags of the mapping holding address ``start`` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= start < hi:  # hg: madvise(MADV_HUGEPAGE)
                return next(x for x in lines[i + 1 :] if x.startswith("VmFlags")).split()[1:]
    raise AssertionError("the arena's mapping is not in /proc/self/smaps")


def test_key_index_finds_alike_on_one_thread_and_in_parallel():
    """Small probes run serially (find_serial), large ones in parallel: the same answers."""
    from embengine.storage import keyed as keyed_storage

    rng = np.random.default_rng(3)
    keys = np.unique(rng.integers(-(2**63), 2**63 - 1, keyed_storage._PARALLEL_FIND + 999))
    index = KeyIndex()
    index.insert(keys, np.arange(len(keys)))
    probe = np.concatenate([keys[::-1], rng.integers(0, 2**40, 50)])  # absent ones too
    big = index.find(probe)  # parallel
    small = np.concatenate([index.find(probe[i : i + 4096]) for i in range(0, len(probe), 4096)])
    want = np.concatenate([np.arange(len(keys))[::-1], np.full(50, -1)])
    assert big.tolist() == small.tolist() == want.tolist()


# -- keyed tables in a file (storage="mmap": kind "keyed-mmap") ----------------------------------


def _file_pair(tmp_path, backend, **dynamic):
    """The same engine twice: a keyed table "k" (Adam, dim 8) and a dense table "d", in RAM
    and with storage="mmap" (the keyed table's rows in k.f32, the dense one's in d.f32)."""
    engines = []
    for storage in ("ram", "mmap"):
        k = ee.TableConfig(
            None,
            8,
            name="k",
            initializer=RandomUniform(-0.5, 0.5),
            optimizer=opt.Adam(0.05, bias_correction="per_row"),
            dynamic=ee.DynamicVocabulary(**dynamic),
        )
        d = ee.TableConfig(20, 4, name="d", optimizer=opt.Adagrad(0.2))
        kw = dict(storage="mmap", storage_dir=tmp_path / "rows") if storage == "mmap" else {}
        feats = {"f": ee.FeatureConfig(k), "s": ee.FeatureConfig(k, 2), "g": ee.FeatureConfig(d)}
        engines.append(ee.EmbeddingEngine(feats, backend=backend, seed=4, **kw))
    return engines


def _file_batch(rng, step):
    keys = rng.integers(0, 3000, (64, 3)) * np.int64(0x9E3779B97F4A7C15 % 2**61) - step % 2
    return {"f": keys, "s": keys[:, :2] + 1, "g": rng.integers(0, 20, (64, 2))}


@pytest.mark.parametrize("dynamic", [{}, {"expire_steps": 3, "max_rows": 2500}])
def test_a_keyed_table_in_a_file_trains_like_one_in_ram(tmp_path, backend, dynamic):
    ram, mapped = _file_pair(tmp_path, backend, **dynamic)
    table = mapped.storage_plan.physical_tables[0]
    assert (table.storage, Path(table.path).name) == ("keyed-mmap", "k.f32")
    assert mapped.storage_plan.physical_tables[1].storage == "mmap"
    rng = np.random.default_rng(1)
    for step in range(12):  # past the first capacity (1024 rows): the file grows
        batch = _file_batch(rng, step)
        want, got = ram.lookup(batch), mapped.lookup(batch)
        assert all(got[k].tobytes() == want[k].tobytes() for k in want), step
        grads = {k: np.cos(v + step).astype(np.float32) for k, v in want.items()}
        ram.apply_gradients(grads)
        mapped.apply_gradients(grads)
    for name in ("k", "d"):
        a, b = ram.table_contents(name), mapped.table_contents(name)
        assert all(a[x].tobytes() == b[x].tobytes() for x in a), name
    st = mapped.table_stats()["k"]
    assert st["kind"] == "keyed-mmap" and st["capacity"] > 1024
    assert (tmp_path / "rows" / "k.f32").stat().st_size >= st["capacity"] * 4 * (8 + 8 + 1)
    assert mapped.spec()["tables"][0]["storage"] == "keyed-mmap"
    evaluated = mapped.lookup(batch, training=False)
    want = ram.lookup(batch, training=False)
    assert all(evaluated[k].tobytes() == want[k].tobytes() for k in want)


def test_a_keyed_tables_file_is_locked_and_checkpoints_restore_anywhere(tmp_path):
    from embengine.storage import StorageError

    ram, mapped = _file_pair(tmp_path, "numba")
    with pytest.raises(StorageError, match="table 'k' \\(file 'k.f32'\\) is in use"):
        _file_pair(tmp_path, "numba")
    rng = np.random.default_rng(2)
    stream = [_file_batch(rng, s) for s in range(8)]
    for batch in stream[:4]:
        for eng in (ram, mapped):
            acts = eng.lookup(batch)
            eng.apply_gradients({k: np.ones_like(v) for k, v in acts.items()})
    path = mapped.save(tmp_path / "ckpt")
    in_ram = ee.EmbeddingEngine.load(path)  # RAM unless told otherwise
    assert in_ram.storage_plan.physical_tables[0].storage == "keyed"
    again = ee.EmbeddingEngine.load(path, storage="mmap", storage_dir=tmp_path / "other")
    assert (tmp_path / "other" / "k.f32").exists()
    for batch in stream[4:]:
        want = ram.lookup(batch)
        for eng in (mapped, in_ram, again):
            got = eng.lookup(batch)
            assert all(got[k].tobytes() == want[k].tobytes() for k in want)
            eng.apply_gradients({k: np.ones_like(v) for k, v in got.items()})
        ram.apply_gradients({k: np.ones_like(v) for k, v in want.items()})


def test_keyed_mmap_is_for_keyed_tables_only(tmp_path):
    d = ee.TableConfig(9, 2, name="d", optimizer=opt.SGD(0.1))
    with pytest.raises(ValueError, match="storage 'keyed-mmap' is for keyed tables; table 'd'"):
        ee.EmbeddingEngine({"g": ee.FeatureConfig(d)}, storage="keyed-mmap", storage_dir=tmp_path)
    k = ee.TableConfig(None, 2, name="k", dynamic=ee.DynamicVocabulary(), optimizer=opt.SGD(0.1))
    with pytest.raises(ValueError, match="storage_dir"):
        ee.EmbeddingEngine({"f": ee.FeatureConfig(k)}, storage="mmap")


def _same_tables(fast, general):
    """The two tables of the one-probe tests hold the same rows, records, index and stats."""
    np.testing.assert_array_equal(fast._index.slots, general._index.slots)
    np.testing.assert_array_equal(fast._free, general._free)
    assert (fast._high, fast._index.tombs) == (general._high, general._index.tombs)
    a, b = fast.state(), general.state()
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert fast.stats() == general.stats()


def _spy_one_probe(table) -> list:
    """Calls of ``table``'s one-probe resolution, recorded (the general path inserts through
    the same kernel, so the kernel's calls would not tell them apart)."""
    calls, real = [], table._find_or_insert
    table._find_or_insert = lambda *a: calls.append(1) or real(*a)
    return calls


def _find_or_insert_streams():
    """(DynamicVocabulary, timestamps?) of the differential test below: plain, expiring (free
    rows and tombstones for the one-probe pass to reuse), bounded (it runs while there is room),
    with data time."""
    return [
        (ee.DynamicVocabulary(), False),
        (ee.DynamicVocabulary(expire_steps=2), False),
        (ee.DynamicVocabulary(max_rows=3000), False),
        (ee.DynamicVocabulary(expire_seconds=25), True),
    ]


@pytest.mark.parametrize("case", range(4))
@pytest.mark.parametrize("storage_kind", ["keyed", "keyed-mmap"])
def test_one_probe_resolution_equals_find_then_insert(case, storage_kind, tmp_path, monkeypatch):
    """A training resolution that can only find or insert (``_admits_all_at_once``: no room to
    make either) probes each key once (``keyed_index.find_or_insert``). Against the general
    path (a find, then ``_touch`` and ``_insert``) on the same stream (cohorts of keys trained
    for three steps, so rows expire every third step and the steps between reuse their rows and
    tombstones; one-off keys; counts; batches past the first index and arena, which the general
    path grows): the same rows, records, index slots, free rows, state and stats."""
    from embengine.storage import keyed as keyed_storage
    from embengine.storage.keyed import KeyedTable

    dyn, timed = _find_or_insert_streams()[case]
    init = ee.initializers.Constant(0.25) if case % 2 else RandomUniform(-1.0, 1.0)
    slots = (keyed_storage.SlotSpec("acc", 1, 0.1),) if case < 2 else ()

    def table(name):
        path = None if storage_kind == "keyed" else tmp_path / f"{name}.rows"
        return KeyedTable("k", 3, slots, init, 7, dyn, path=path)

    fast, general = table("fast"), table("general")
    general._admits_all_at_once = lambda n, expiring: False
    calls = _spy_one_probe(fast)
    rng = np.random.default_rng(case)
    universe = iter(rng.permutation(rng.integers(-(2**63), 2**63 - 1, 40_000, np.int64)))
    cohorts = [[next(universe) for _ in range(rng.choice([1, 50, 700, 1400]))] for _ in range(6)]
    for step in range(1, 17):
        ids = cohorts[step // 3] + (cohorts[step // 3 - 1] if step % 3 == 0 else [])
        ids = np.array(ids + [next(universe) for _ in range(rng.choice([0, 1, 150]))], np.int64)
        ids = rng.permutation(ids)
        counts = rng.integers(1, 4, size=len(ids)).astype(np.int64)
        for t in (fast, general):
            t.begin_step(step, 100 + 10 * step if timed else None)
        got = fast.rows_for(0, ids, insert=True, counts=counts)
        want = general.rows_for(0, ids, insert=True, counts=counts)
        np.testing.assert_array_equal(got, want, err_msg=f"step {step}")
        _same_tables(fast, general)
    assert calls, "the one-probe pass never ran"


@pytest.mark.parametrize("case", ["tombstones, then a rebuild", "free rows, then a rebuild"])
def test_one_probe_resolution_makes_room_as_the_general_path_does(case):
    """Room is made as a pass needs it, whatever else the batch holds, so the one-probe
    resolution and the general path (hits touched first, then the new keys inserted) rebuild
    the index, if at all, at the same new key. Two streams an independent review found apart
    when the general path sized the index for all its new keys first: keys returning onto
    tombstones when the index must be rebuilt, and new keys on freed rows before a rebuild
    (which places them by row, before older keys they collide with)."""
    from embengine.storage.keyed import KeyedTable

    rng = np.random.default_rng(400300 if case.startswith("tomb") else 1100)
    keys = rng.integers(-(2**63), 2**63 - 1, 1100, dtype=np.int64)
    if case.startswith("tomb"):  # 400 keys expire at step 2 and return at step 3
        a, b = keys[:400], keys[400:700]
        steps = [rng.permutation(keys[:700]), b, b, a]
    else:  # 300 keys expire at step 2; 500 new keys at step 3
        a, b, c = keys[:300], keys[300:600], keys[600:]
        steps = [rng.permutation(keys[:600]), b, b, c]
    tables, rebuilt = [], []
    for one_probe in (True, False):
        t = KeyedTable("k", 3, (), ee.initializers.Zeros(), 7, ee.DynamicVocabulary(expire_steps=1))
        calls = _spy_one_probe(t)
        if not one_probe:
            t._admits_all_at_once = lambda n, expiring: False
        for step, ids in enumerate(steps):
            t.begin_step(step)
            before = t._index.slots
            t.rows_for(0, ids)
        rebuilt.append(t._index.slots is not before)
        assert bool(calls) == one_probe
        tables.append(t)
    _same_tables(*tables)
    # returning keys take their tombstones back; 500 new keys pass the load limit
    assert rebuilt == ([False, False] if case.startswith("tomb") else [True, True])


def test_a_failed_growth_leaves_the_keys_inserted_so_far_whole():
    """When the rows cannot grow half-way through a batch (memory, disk), the keys the pass
    inserted before are complete (indexed, recorded, initial values, off the free list) and
    the rest absent; the next batch goes on from there."""
    from embengine.storage.keyed import KeyedTable

    t = KeyedTable("k", 2, (), ee.initializers.Constant(0.5), 7, ee.DynamicVocabulary())
    grow = t._grow
    t.begin_step(1)
    t.rows_for(0, np.arange(1000))  # the first 1024 rows, 24 left

    def refuse(rows):
        raise MemoryError("cannot map")

    t._grow = refuse
    t.begin_step(2)
    keys = np.arange(1000, 1100)
    with pytest.raises(MemoryError):
        t.rows_for(0, keys)
    rows = t.rows_for(0, keys, insert=False)
    assert (rows[:24] >= 0).all() and (rows[24:] < 0).all()
    assert t.rows == 1024 == t._high and not len(t._free)
    np.testing.assert_array_equal(t.data[rows[:24], :2], np.full((24, 2), 0.5, np.float32))
    t._grow = grow
    t.begin_step(3)
    got = t.rows_for(0, keys)
    np.testing.assert_array_equal(got[:24], rows[:24])
    assert t.rows == 1100 and len(np.unique(got)) == 100


def test_rows_for_refuses_counts_that_do_not_match_the_keys():
    from embengine.storage.keyed import KeyedTable

    t = KeyedTable("k", 2, (), ee.initializers.Zeros(), 0, ee.DynamicVocabulary())
    t.begin_step(1)
    with pytest.raises(ValueError, match="'k': 10 keys, but counts of shape"):
        t.rows_for(0, np.arange(10), insert=True, counts=np.ones(3, np.int64))
    assert t.rows == 0


def test_constant_initializers_write_in_place_unless_init_is_overridden(recwarn):
    """Zeros and Constant give keyed tables their value as a constant column (no array of
    the batch's values); a subclass that overrides ``init`` is called as a dense table calls
    it; a Constant beyond int32 writes no warning (only int32 slots take an int32 value)."""
    from embengine.storage.keyed import KeyedTable

    class Odd(ee.initializers.Constant):
        def init(self, seed, table_name, rows, dim):
            return np.repeat(np.asarray(rows, np.float32)[:, None], dim, axis=1)

    for init, want in [
        (ee.initializers.Constant(3e9), [[3e9, 3e9], [3e9, 3e9]]),
        (ee.initializers.Zeros(), [[0, 0], [0, 0]]),
        (Odd(1.0), [[3, 3], [5, 5]]),
    ]:
        adam = opt.Adam(0.1, bias_correction="per_row")  # an int32 slot beside the weights
        t = KeyedTable("k", 2, tuple(adam.slot_specs(2)), init, 0, ee.DynamicVocabulary())
        t.begin_step(1)
        rows = t.rows_for(0, np.array([3, 5]), insert=True)
        np.testing.assert_array_equal(t.data[rows, :2], np.array(want, np.float32))
    assert ee.initializers.Constant(2.0).constant() == 2.0
    assert Odd(1.0).constant() is None
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_a_batch_looked_up_again_resolves_its_keys_anew(backend):
    """A batch from lookup_with_batch looked up at a later step: its keys' rows then, not the
    rows they had (a key evicted since, its row given to another key, looks up as absent);
    a training lookup of it counts and touches its keys (LRU keeps them)."""
    t = ee.TableConfig(None, 8, name="k", combiner="sum", dynamic=ee.DynamicVocabulary(max_rows=2))

    def engine():
        return ee.EmbeddingEngine(
            {"f": ee.FeatureConfig(t)}, optimizer=opt.SGD(1.0), backend=backend
        )

    eng = engine()
    _, old = eng.lookup_with_batch({"f": np.array([1, 2])})
    g = np.zeros((2, 8), np.float32)
    g[0], g[1] = -1, -2
    eng.apply_gradients({"f": g})
    eng.lookup({"f": np.array([2, 3])})  # evicts key 1 (LRU); key 3 takes its row
    g = np.zeros((2, 8), np.float32)
    g[1] = -30
    eng.apply_gradients({"f": g})
    fresh = eng.lookup({"f": np.array([1, 2])}, training=False)["f"]
    again = eng.lookup(old, training=False)["f"]
    np.testing.assert_array_equal(again, fresh)
    assert not again[0].any()  # key 1 has no row: zeros, not key 3's
    kept = []
    for reuse in (False, True):
        eng = engine()
        acts, batch = eng.lookup_with_batch({"f": np.array([1])})
        eng.apply_gradients({"f": np.ones_like(acts["f"])})
        for x in (
            {"f": np.array([2])},
            batch if reuse else {"f": np.array([1])},
            {"f": np.array([4])},
        ):
            eng.apply_gradients({"f": np.ones_like(eng.lookup(x)["f"])})
        kept.append(eng.table_contents("k")["keys"].tolist())
    assert kept == [[1, 4], [1, 4]]


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_a_lookup_refuses_the_batch_its_update_inserting_on_apply_would_refuse(backend):
    """insert_on="apply" with max_rows: the training lookup refuses a batch that needs more
    rows than max_rows, as its update would, before it counts keys in another table."""
    a = ee.TableConfig(
        None, 8, name="A", dynamic=ee.DynamicVocabulary(max_rows=2, insert_on="apply")
    )
    b = ee.TableConfig(
        None, 8, name="B", dynamic=ee.DynamicVocabulary(occurrence_threshold=2, insert_on="apply")
    )
    eng = ee.EmbeddingEngine(
        {"b": ee.FeatureConfig(b), "a": ee.FeatureConfig(a)},
        optimizer=opt.SGD(0.1),
        backend=backend,
    )
    before = eng.state_dict()
    with pytest.raises(ValueError, match="table 'A': this batch needs 3 rows"):
        eng.lookup({"b": np.array([7, 8, 9]), "a": np.array([5, 6, 7])})
    after = eng.state_dict()
    assert (
        after["tables"]["B"]["pending_keys"].tolist()
        == before["tables"]["B"]["pending_keys"].tolist()
        == []
    )
    assert eng.table_stats()["B"]["this_step"]["filtered"] == 0
    with pytest.raises(ValueError, match="no batch"):
        eng.apply_gradients({"b": np.ones((3, 8)), "a": np.ones((3, 8))})
    eng.lookup({"b": np.array([7, 8]), "a": np.array([5, 6])})  # fits: looked up and applied
    eng.apply_gradients({"b": np.ones((2, 8)), "a": np.ones((2, 8))})
    assert eng.table_contents("A")["keys"].tolist() == [5, 6]


def test_an_update_inserting_on_apply_keeps_its_keys_an_earlier_update_inserted(backend):
    """Two lookups before their updates, inserting on apply: key A is new in both, so the
    first update inserts it and the second finds it there. The second update inserts B and
    needs room (max_rows=2, LFU): A is a key of its batch and must not be evicted (C must),
    and A's gradient goes to A's row, not to the row B took from it."""
    eng = keyed_engine(backend, max_rows=2, eviction="lfu", insert_on="apply")
    for _ in range(3):  # C touched 6 times: LFU would evict A (1 touch) before it
        train_bags(eng, [[C, C]], grad=0.0)
    ax, bx = eng.lookup_with_batch({"f": [[A]]})
    ay, by = eng.lookup_with_batch({"f": [[A], [B]]})
    eng.apply_gradients({"f": np.ones_like(ax["f"])}, batch=bx)
    assert keyed_keys(eng) == [A, C]
    eng.apply_gradients({"f": np.float32([[100, 100], [1000, 1000]])}, batch=by)
    c = eng.table_contents("k")
    assert c["keys"].tolist() == [B, A]
    np.testing.assert_array_equal(c["weights"][:, 0], np.float32([B - 1000, A - 101]))
    assert eng.table_stats()["k"]["this_step"]["evicted"] == 1


@pytest.mark.parametrize("threshold", [0, 1])
@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_insert_on_apply_under_max_rows_refuses_at_the_lookup(backend, eviction, threshold):
    """insert_on="apply", max_rows=2, one lookup then its update each step: a batch that fits
    is inserted by its update; one whose new keys need room evicts at the update (the lookup
    changes no row); one needing 3 rows is refused by its training lookup, nothing changed
    (no key counted, no batch pending), and the table trains on. With T=1 each key is counted
    in a step of its own first."""
    eng = keyed_engine(
        backend, max_rows=2, eviction=eviction, insert_on="apply", occurrence_threshold=threshold
    )

    def count_first(bags):
        if threshold:
            assert not train_bags(eng, bags).any()

    count_first([[1, 2], [1]])
    assert keyed_keys(eng) == []
    assert not train_bags(eng, [[1, 2], [1]]).any()  # fits: the update inserts both
    assert keyed_keys(eng) == [1, 2]  # touches: key 1 twice, key 2 once
    count_first([[3]])
    assert not eng.lookup({"f": [[3]]})["f"].any()
    assert keyed_keys(eng) == [1, 2]  # the lookup evicts nothing
    eng.apply_gradients({"f": np.ones((1, 2), np.float32)})
    # LRU: 1 and 2 were touched at the same step, the smaller key goes; LFU: 2 has fewer.
    assert keyed_keys(eng) == {"lru": [2, 3], "lfu": [1, 3]}[eviction]
    assert eng.table_stats()["k"]["this_step"]["evicted"] == 1
    count_first([[4, 5, 6]])
    text = _unchanged_by(eng, lambda: eng.lookup({"f": [[4, 5, 6]]}))
    assert text.startswith(
        "table 'k': this batch needs 3 rows (0 of its keys have rows, 3 are "
        "admitted now), more than max_rows=2; nothing was changed"
    ), text
    with pytest.raises(ValueError, match="apply_gradients needs a lookup"):
        eng.apply_gradients({"f": np.ones((1, 2), np.float32)})
    train_bags(eng, [[4]])  # LRU: 2 is the least recent; LFU: 3 (1 touch) < 1 (2 touches)
    assert keyed_keys(eng) == {"lru": [3, 4], "lfu": [1, 4]}[eviction]
    assert eng.table_stats()["k"]["total"]["evicted"] == 2


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_insert_on_apply_refuses_at_the_update_only_after_another_update(backend, eviction):
    """The two refusals an update inserting on apply can raise that its lookup could not: two
    lookups before their updates, the second update runs at the next step. With T=1 it admits
    the keys counted at the lookups' step (3 rows > max_rows=2); without, the first update
    evicted a row of its batch. Either is a ValueError naming the table, nothing changed, and
    the table trains on."""
    eng = keyed_engine(
        backend, max_rows=2, eviction=eviction, insert_on="apply", occurrence_threshold=1
    )
    ax, bx = eng.lookup_with_batch({"f": [[1]]})
    ay, by = eng.lookup_with_batch({"f": [[2, 3, 4]]})  # no key admitted at step 0: it fits
    eng.apply_gradients({"f": np.ones_like(ax["f"])}, batch=bx)  # step 0: key 1 not admitted
    grads = {"f": np.ones_like(ay["f"])}
    text = _unchanged_by(eng, lambda: eng.apply_gradients(grads, batch=by))
    assert text.startswith(
        "table 'k': this batch needs 3 rows (0 of its keys have rows, 3 are "
        "admitted now), more than max_rows=2"
    ), text
    train_bags(eng, [[1, 2]])  # both counted at step 0: admitted at step 1
    assert keyed_keys(eng) == [1, 2] and eng.step == 2

    eng = keyed_engine(backend, max_rows=2, eviction=eviction, insert_on="apply")
    train_bags(eng, [[1, 2]])
    ax, bx = eng.lookup_with_batch({"f": [[3, 4]]})  # 2 new rows: fits
    ay, by = eng.lookup_with_batch({"f": [[1]]})
    eng.apply_gradients({"f": np.ones_like(ax["f"])}, batch=bx)  # evicts 1 and 2
    assert keyed_keys(eng) == [3, 4]
    grads = {"f": np.ones_like(ay["f"])}
    text = _unchanged_by(eng, lambda: eng.apply_gradients(grads, batch=by))
    assert (
        "(e.g. 1) lost their rows after its lookup: a later training lookup, or an update "
        "inserting on apply, evicted" in text
    ), text
    train_bags(eng, [[1]])  # 3 and 4: touched once, at the same step; the smaller key goes
    assert keyed_keys(eng) == [1, 4]


# -- an address-space limit (ulimit -v) --------------------------------------------------------

RLIMIT_CHILD = """
import resource
import sys

import numpy as np

import embengine as ee
from embengine import optimizers as opt


def engine(name):
    t = ee.TableConfig(None, 4, name=name, optimizer=opt.SGD(0.1), dynamic=ee.DynamicVocabulary())
    e = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, backend="reference")
    e.lookup({"f": [[1], [2]]})
    e.apply_gradients({"f": np.ones((2, 4), np.float32)})
    return e


engine("warm")  # imports and first allocations before the limit
used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (used + (2 << 30), resource.RLIM_INFINITY))
first = engine("k1")
try:
    block = np.ones(256 << 20, np.uint8)  # 256 MiB, an eighth of the headroom
    second = engine("k2")
    trained = second.table_contents("k2")["weights"]
    second.lookup({"f": [list(range(5000))]})  # past its first capacity: copied when outgrown
    assert first.table_stats()["k1"]["rows"] == 2
    assert second.table_stats()["k2"]["rows"] == 5000
    assert (second.table_contents("k2")["weights"][1:3] == trained).all()
except MemoryError as e:
    print(f"MemoryError: {e}")
    sys.exit(1)
print("ok")
"""


def test_a_keyed_table_leaves_the_address_space_an_rlimit_allows_to_the_rest(tmp_path):
    """Under an address-space limit (RLIMIT_AS, ``ulimit -v``) the reservation of 2^38 bytes
    is refused; a keyed table then reserved the largest part of what the limit left, so any
    later allocation of the process failed (a 256 MiB array, a second keyed table: "cannot
    map 1,024 rows"; found by the fuzz campaign, whose child processes run under such a
    limit). It reserves what its rows need now, and copies them into a bigger reservation
    when they outgrow it."""
    import subprocess
    import sys

    script = tmp_path / "child.py"
    script.write_text(RLIMIT_CHILD)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr
