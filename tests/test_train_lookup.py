"""A training lookup of features runs the deduplication and the pooling in one parallel region
(kernels/train_lookup.py): it must give what preprocess() then lookup(batch) give, bit for bit."""

import numba
import numpy as np
import pytest

import embengine as ee
from embengine.kernels import train_lookup
from embengine.kernels._intrinsics import fetch_add, float32_rows_at

opt = ee.optimizers
FIELDS = (
    "unique_ids",
    "inverse",
    "gains",
    "segments",
    "output_offsets",
    "unique_offsets",
    "unique_gains",
    "unique_segments",
)


def _features(packing: bool, quantized: bool):
    q = ee.QuantizationConfig(num_buckets=7, lower=-0.5, upper=0.5) if quantized else None
    sgd = opt.SGD(0.1, low_dimensional_packing_status=packing)
    u = ee.initializers.RandomUniform(-1.0, 1.0)
    tables = [
        ee.TableConfig(60, 8, name="w8", combiner="sum", optimizer=opt.Adagrad(0.1), initializer=u),
        ee.TableConfig(
            50,
            3,
            name="w3",
            combiner="mean",
            quantization_config=q,  # any width
            initializer=u,
        ),
        ee.TableConfig(40, 2, name="p2", combiner="sqrtn", optimizer=sgd, initializer=u),
        ee.TableConfig(
            30,
            2,
            name="q2",
            combiner="sum",
            optimizer=sgd,  # packed with p2
            initializer=u,
        ),
        ee.TableConfig(20, 1, name="p1", combiner="mean", optimizer=sgd, initializer=u),
    ]
    feats = {
        "a": ee.FeatureConfig(tables[0]),
        "a_seq": ee.FeatureConfig(tables[0], max_sequence_length=3),  # shares w8
        "b": ee.FeatureConfig(tables[1]),
        "c": ee.FeatureConfig(tables[2]),
        "d": ee.FeatureConfig(tables[3]),
        "e": ee.FeatureConfig(tables[4]),
    }
    return feats


def _batch(feats, rng, samples: int):
    values = {}
    for name, fc in feats.items():
        lengths = rng.integers(0, 6, samples)  # empty bags included
        ids = rng.zipf(1.3, int(lengths.sum())) % fc.table.vocabulary_size  # duplicates
        weights = None if fc.is_sequence else rng.uniform(-1, 2, len(ids)).astype(np.float32)
        values[name] = ee.Ragged(ids, lengths=lengths, weights=weights)
    return values


def _assert_fused_equals_apart(eng, values):
    fused, fused_batch = eng.lookup_with_batch(values)
    batch = eng.preprocess(values)
    apart = eng.lookup(batch)
    for name in apart:
        assert fused[name].shape == apart[name].shape
        np.testing.assert_array_equal(fused[name], apart[name])
    for t_fused, t_apart in zip(fused_batch.tables, batch.tables, strict=True):
        assert t_fused.num_outputs == t_apart.num_outputs
        for field in FIELDS:
            np.testing.assert_array_equal(getattr(t_fused, field), getattr(t_apart, field))
    eng.apply_gradients({k: np.ones_like(a) for k, a in fused.items()}, batch=fused_batch)


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("quantized", [False, True])
def test_training_lookup_equals_preprocess_then_lookup(packing, quantized):
    feats = _features(packing, quantized)
    eng = ee.EmbeddingEngine(feats, optimizer=opt.SGD(0.1))
    assert (len(eng.storage_plan.physical_tables) < 5) == packing
    rng = np.random.default_rng(packing + 2 * quantized)
    # 150 samples: several pooling tasks (train_lookup.POOL_TASK) per feature.
    assert 150 > 2 * train_lookup.POOL_TASK
    for _ in range(2):
        _assert_fused_equals_apart(eng, _batch(feats, rng, 150))


def test_training_lookup_equals_the_reference_backend():
    feats = _features(packing=True, quantized=True)
    engines = [
        ee.EmbeddingEngine(feats, optimizer=opt.SGD(0.1), backend=b, seed=5)
        for b in ("numba", "reference")
    ]
    values = _batch(feats, np.random.default_rng(9), 140)
    fast, slow = (e.lookup(values) for e in engines)
    for name in feats:
        np.testing.assert_allclose(fast[name], slow[name], rtol=1e-5, atol=1e-6)


@numba.njit(parallel=True)
def _claim_all(n_workers, n_tasks, claims, owner):
    counter = np.zeros(1, dtype=np.int64)
    for w in numba.prange(n_workers):
        while True:
            i = fetch_add(counter, 0, 1)
            if i >= n_tasks:
                break
            claims[i] += 1
            owner[i] = w
            s = 0.0  # some work, so the workers interleave
            for k in range(200):
                s += np.sqrt(k + i)
            claims[i] += s < 0


@pytest.mark.parametrize("n_workers", [1, 2, 7])  # 7: more workers than threads
def test_every_task_is_claimed_exactly_once(n_workers):
    n_tasks = 5000
    claims = np.zeros(n_tasks, dtype=np.int64)
    owner = np.full(n_tasks, -1, dtype=np.int64)
    _claim_all(n_workers, n_tasks, claims, owner)
    np.testing.assert_array_equal(claims, 1)
    assert set(owner) <= set(range(n_workers))


def test_training_lookup_on_one_thread_and_more_workers_than_threads(monkeypatch):
    feats = _features(packing=False, quantized=False)
    eng = ee.EmbeddingEngine(feats, optimizer=opt.SGD(0.1))
    values = _batch(feats, np.random.default_rng(3), 200)
    expected = eng.lookup(eng.preprocess(values))
    for threads in (1, numba.config.NUMBA_NUM_THREADS):
        numba.set_num_threads(threads)
        try:
            got = eng.lookup(values)
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        for name in feats:
            np.testing.assert_array_equal(got[name], expected[name])
    monkeypatch.setattr(numba, "get_num_threads", lambda: 5)  # five workers claim the tasks
    got = eng.lookup(values)
    for name in feats:
        np.testing.assert_array_equal(got[name], expected[name])


@numba.njit
def _write_through_view(address, rows, cols):
    view = float32_rows_at(address, rows, cols)
    for r in range(rows):
        for c in range(cols):
            view[r, c] = r * 10 + c
    return view.shape[0], view.shape[1]


def test_float32_rows_at_views_the_given_memory():
    a = np.zeros((4, 6), dtype=np.float32)
    # A view of rows 1-2 of ``a``, three columns wide (rows of a C array of width 6 read as 3).
    shape = _write_through_view(a[1:].ctypes.data, 2, 3)
    assert shape == (2, 3)
    expected = np.zeros((4, 6), dtype=np.float32)
    expected[1, :3] = [0, 1, 2]
    expected[1, 3:] = [10, 11, 12]
    np.testing.assert_array_equal(a, expected)


def _wide_engine(**kwargs):
    tables = [
        ee.TableConfig(
            90, d, name=f"d{d}", combiner=c, initializer=ee.initializers.RandomUniform(-1.0, 1.0)
        )
        for d, c in ((64, "sum"), (16, "mean"), (5, "sqrtn"))
    ]
    feats = {t.name: ee.FeatureConfig(t) for t in tables}
    return ee.EmbeddingEngine(feats, optimizer=opt.Adagrad(0.1), **kwargs), feats


def test_a_training_lookup_reads_each_feature_s_ids_where_they_are(monkeypatch):
    """The region reads each feature's int64 ids at their own address (``prepare.F_IDS``): no
    copy of them all into one array. Ids of another dtype or layout are read from a converted
    copy, with the same results as preprocess() then lookup(batch)."""
    from embengine.kernels import prepare

    seen = []
    real = train_lookup.prepare_and_pool

    def spy(*args, **kwargs):
        seen.append(args[2][:, prepare.F_IDS].copy())  # fmeta
        return real(*args, **kwargs)

    monkeypatch.setattr(train_lookup, "prepare_and_pool", spy)
    eng, feats = _wide_engine()
    rng = np.random.default_rng(3)
    lengths = {name: rng.integers(0, 4, 100) for name in feats}
    ids = {
        name: rng.integers(0, fc.table.vocabulary_size, int(lengths[name].sum()))
        for name, fc in feats.items()
    }
    values = {name: ee.Ragged(ids[name], lengths=lengths[name]) for name in feats}
    eng.lookup(values)
    assert list(seen[0]) == [ids[name].ctypes.data for name in feats]
    monkeypatch.setattr(train_lookup, "prepare_and_pool", real)
    odd = dict(values)
    odd["d64"] = ee.Ragged(ids["d64"].astype(np.int32), lengths=lengths["d64"])
    wide = np.repeat(ids["d16"], 2)[::2]  # a strided view of the same ids
    assert not wide.flags.c_contiguous
    odd["d16"] = ee.Ragged(wide, lengths=lengths["d16"])
    _assert_fused_equals_apart(eng, odd)


@pytest.mark.parametrize("case", ["no samples", "a table without ids", "mmap", "big batch"])
def test_training_lookup_edge_cases_equal_preprocess_then_lookup(case, tmp_path):
    kwargs = dict(storage="mmap", storage_dir=tmp_path) if case == "mmap" else {}
    eng, feats = _wide_engine(**kwargs)
    rng = np.random.default_rng(1)
    samples = {"no samples": 0, "a table without ids": 100, "mmap": 150, "big batch": 4096}[case]
    bag = 60 if case == "big batch" else 4  # big: > POOLED_BATCH_BYTES of batch arrays
    values = {}
    for name, fc in feats.items():
        lengths = rng.integers(0, bag, samples)
        if case == "a table without ids" and name == "d16":
            lengths[:] = 0
        ids = rng.integers(0, fc.table.vocabulary_size, int(lengths.sum()))
        values[name] = ee.Ragged(ids, lengths=lengths)
    if case == "big batch":
        assert eng._backend.batch_memory.nbytes == 0
    for _ in range(2):  # the second big batch reuses the pooled block
        _assert_fused_equals_apart(eng, values)
    if case == "big batch":  # its arrays came from the backend's BlockPool
        assert eng._backend.batch_memory.nbytes > 0


def test_training_lookups_of_features_take_the_fused_path(monkeypatch):
    from embengine.kernels import prepare
    from embengine.torch import EmbeddingLayer

    calls = {"fused": 0, "apart": 0}
    fused_kernel, apart_kernel = train_lookup.prepare_and_pool, prepare.prepare_tables

    def fused(*args, **kwargs):
        calls["fused"] += 1
        return fused_kernel(*args, **kwargs)

    def apart(*args):
        calls["apart"] += 1
        return apart_kernel(*args)

    monkeypatch.setattr(train_lookup, "prepare_and_pool", fused)
    monkeypatch.setattr(prepare, "prepare_tables", apart)
    eng, feats = _wide_engine()
    values = {name: [[1, 2], [3]] for name in feats}
    eng.lookup(values)
    assert calls == {"fused": 1, "apart": 0}
    layer = EmbeddingLayer(eng)
    out = layer(values)  # training mode, grad enabled
    sum(o.sum() for o in out.values()).backward()
    assert calls == {"fused": 2, "apart": 0}
    eng.lookup(values, training=False)  # lookup-only: neither
    eng.lookup(eng.preprocess(values))  # a PreparedBatch: deduplicated apart
    assert calls == {"fused": 2, "apart": 1}


def test_tables_are_read_by_address_only_when_c_contiguous_float32():
    # The region reads tables by address: a strided or wrong-dtype array must be refused.
    from embengine.backends.numba_backend import build_tables_and_pool_numba

    eng, feats = _wide_engine()
    parts, _ = ee.batch.plan_tables(
        eng._resolved,
        {name: [[1, 2], [3]] for name in feats},
        storage_layout=eng.storage_plan.storage_layout(),
    )
    table = eng._physical[0]
    good = table.data
    try:  # ``data`` is a property (it checks an mmap table's file): swap the array behind it
        for bad in (np.asfortranarray(good), good.astype(np.float64)):
            table._data = bad  # DenseTable.data is a read-only property over _data
            with pytest.raises(AssertionError, match="C-contiguous float32"):
                build_tables_and_pool_numba(parts, eng._physical, [None] * len(parts))
    finally:
        table._data = good
    build_tables_and_pool_numba(parts, eng._physical, [None] * len(parts))


@pytest.mark.parametrize("threads", [1, 2])
def test_pool_tables_equals_pool_table_by_table(threads):
    """``pool_tables`` (the tables a training lookup pools after their rows are resolved, in one
    region) gives each table's ``lookup.pool`` bits: widths fixed and any, rows of -1,
    quantization, a table without outputs, tables of bfloat16 and float16 rows (uint16 units
    read and widened: the bits of pooling their widened copy)."""
    from embengine.kernels import lookup
    from embengine.precision import BF16, F16, F32

    rng = np.random.default_rng(threads)
    specs = [  # dim, outputs, quantized, kind of the rows
        (64, 70, False, F32),
        (5, 130, True, F32),
        (8, 0, False, F32),
        (8, 90, False, F32),
        (64, 50, False, BF16),
        (8, 60, True, F16),
        (5, 40, False, BF16),
    ]
    pmeta = np.zeros((len(specs), train_lookup.P_COLS), dtype=np.int64)
    rows_all, inv_all, gains_all, offs_all = [], [], [], []
    quant, datas, outs, want = [], [], [], []
    row_base = occ_base = off_base = 0
    for t, (dim, n_out, q, kind) in enumerate(specs):
        data = rng.normal(size=(40, dim + 2)).astype(np.float32)
        if kind == BF16:  # the top half of each float32: bfloat16 bits
            bits = (data.view(np.uint32) >> 16).astype(np.uint16)
            data = (bits.astype(np.uint32) << 16).view(np.float32)
        elif kind == F16:
            bits = data.astype(np.float16).view(np.uint16)
            data = bits.view(np.float16).astype(np.float32)
        lengths = rng.integers(0, 5, n_out)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        n = int(offsets[-1])
        u = max(1, n // 2)
        rows = rng.integers(-1, 40, u).astype(np.int64)  # -1: an id without a row
        inverse = rng.integers(0, u, n).astype(np.int64)
        gains = rng.normal(size=n).astype(np.float32)
        qt = np.array([9.0, -1.0, 1.0]) if q else np.zeros(3)
        expected = np.empty((n_out, dim), dtype=np.float32)
        lookup.pool(data, dim, rows, inverse, gains, offsets, expected, qt, 4)
        out = np.full((n_out, dim), np.nan, dtype=np.float32)
        if kind != F32:
            data = bits  # pooled from the 16-bit rows; expected from their widened copy
        pmeta[t] = (
            data.ctypes.data,
            40,
            dim + 2,
            dim,
            out.ctypes.data,
            n_out,
            row_base,
            occ_base,
            off_base,
            kind,
        )
        row_base, occ_base, off_base = row_base + u, occ_base + n, off_base + n_out + 1
        rows_all.append(rows), inv_all.append(inverse), gains_all.append(gains)
        offs_all.append(offsets), quant.append(qt), datas.append(data), outs.append(out)
        want.append(expected)
    numba.set_num_threads(threads)
    try:
        train_lookup.pool_tables(
            threads,
            pmeta,
            np.concatenate(rows_all),
            np.concatenate(inv_all),
            np.concatenate(gains_all),
            np.concatenate(offs_all),
            np.array(quant),
            4,
        )
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    for got, expected in zip(outs, want, strict=True):
        assert got.tobytes() == expected.tobytes()


def test_lookup_only_batches_of_every_storage_equal_their_training_lookup(monkeypatch):
    """An evaluation lookup pools the tables whose rows are ids and the keyed tables (each
    key probed in its pooling task) in one region, a 16-bit table apart: the same bits as the
    training lookup of the same batch, and one ``pool_keyed_features`` call."""
    u = ee.initializers.RandomUniform(-1.0, 1.0)
    q = ee.QuantizationConfig(num_buckets=7, lower=-0.5, upper=0.5)
    tables = [
        ee.TableConfig(60, 8, name="dense", combiner="mean", initializer=u),
        ee.TableConfig(
            None, 8, name="keyed", combiner="sqrtn", initializer=u, dynamic=ee.DynamicVocabulary()
        ),
        ee.TableConfig(
            None,
            5,
            name="keyed_q",
            quantization_config=q,
            initializer=u,
            dynamic=ee.DynamicVocabulary(),
        ),
        ee.TableConfig(50, 8, name="half", weights_dtype="bfloat16", initializer=u),
    ]
    feats = {
        "d": ee.FeatureConfig(tables[0]),
        "k": ee.FeatureConfig(tables[1]),
        "k_seq": ee.FeatureConfig(tables[1], max_sequence_length=3),
        "kq": ee.FeatureConfig(tables[2]),
        "h": ee.FeatureConfig(tables[3]),
    }
    eng = ee.EmbeddingEngine(feats, optimizer=opt.SGD(0.1))
    rng = np.random.default_rng(4)
    values = {}
    for name, fc in feats.items():
        lengths = rng.integers(0, 6, 150)  # several pooling tasks a feature, empty bags
        ids = rng.zipf(1.3, int(lengths.sum())) % 50
        if fc.table.vocabulary_size is None:
            ids = ids * np.int64(0x9E3779B97F4A7C15 % 2**61) - 7  # keys of any sign
        weights = None if fc.is_sequence else rng.uniform(-1, 2, len(ids)).astype(np.float32)
        values[name] = ee.Ragged(ids, lengths=lengths, weights=weights)
    trained = eng.lookup(values)  # inserts the keys
    eng.apply_gradients({k: np.ones_like(a) for k, a in trained.items()})
    calls = []
    kernel = train_lookup.pool_keyed_features
    monkeypatch.setattr(
        train_lookup, "pool_keyed_features", lambda *a: calls.append(1) or kernel(*a)
    )
    evaluated = eng.lookup(values, training=False)
    assert calls == [1]
    trained = eng.lookup(values)
    for name in feats:
        assert evaluated[name].tobytes() == trained[name].tobytes(), name
    absent = {name: ee.Ragged(np.array([123456789]), lengths=[1]) for name in feats}
    absent["d"] = absent["h"] = ee.Ragged(np.array([3]), lengths=[1])
    got = eng.lookup(absent, training=False)
    assert not any(got[name].any() for name in ("k", "k_seq", "kq"))  # never inserted: zeros


def _keyed_features(width: int = 64):
    """Keyed tables of each combiner (bags with weights, a sequence feature sharing one): two
    of ``width``, one of width 8, and a dense table. ``width`` 3: a width without a pooling
    kernel of its own (FIXED_DIMS)."""
    u = ee.initializers.RandomUniform(-1.0, 1.0)
    dyn = ee.DynamicVocabulary()
    keyed = ee.TableConfig(None, width, name="ka", combiner="sum", initializer=u, dynamic=dyn)
    other = ee.TableConfig(None, width, name="kb", combiner="mean", initializer=u, dynamic=dyn)
    apart = ee.TableConfig(None, 8, name="k8", combiner="sqrtn", initializer=u, dynamic=dyn)
    dense = ee.TableConfig(70, 8, name="d8", combiner="sqrtn", initializer=u)
    return {
        "a": ee.FeatureConfig(keyed),
        "a_seq": ee.FeatureConfig(keyed, max_sequence_length=3),
        "b": ee.FeatureConfig(other),
        "c": ee.FeatureConfig(apart),
        "d": ee.FeatureConfig(dense),
    }


def _keyed_batch(feats, rng, samples: int, spread: int = 60):
    values = {}
    for name, fc in feats.items():
        lengths = rng.integers(0, 6, samples)  # empty bags included
        ids = rng.zipf(1.3, int(lengths.sum())) % spread  # duplicates
        if fc.table.vocabulary_size is None:
            ids = ids * np.int64(0x9E3779B97F4A7C15 % 2**61) - 7  # keys of any sign
        weights = None if fc.is_sequence else rng.uniform(-1, 2, len(ids)).astype(np.float32)
        values[name] = ee.Ragged(ids, lengths=lengths, weights=weights)
    return values


def _out_matrices(tmeta):
    """Copies of the activation matrices a region call writes (``tmeta``'s T_OUT columns)."""
    import ctypes

    outs = []
    for t in range(tmeta.shape[0]):
        n = int(tmeta[t, train_lookup.T_N_OUT] * tmeta[t, train_lookup.T_DIM])
        if n == 0:
            outs.append(np.zeros(0, np.float32))
            continue
        buf = (ctypes.c_float * n).from_address(int(tmeta[t, train_lookup.T_OUT]))
        outs.append(np.ctypeslib.as_array(buf).copy())
    return outs


@pytest.mark.parametrize("width", [64, 3])
def test_keyed_tasks_probing_before_their_preparation_pool_what_the_found_rows_pool(
    monkeypatch, width
):
    """A keyed table's pooling task claimed before its table's preparation is done probes its
    own keys (``_probed_rows``); claimed after, it pools through the rows the preparation's
    probe found (``_found_rows``). Which one runs depends on the threads' timing, so each
    region call here runs first without preparations (every keyed task probes: nothing is
    ready), then as usual: the two must give the same bits wherever the probe found every
    key."""
    feats = _keyed_features(width)
    eng = ee.EmbeddingEngine(feats, optimizer=opt.SGD(0.1), seed=2)
    real = train_lookup.prepare_and_pool
    compared = []

    def twice(prep_order, *args, keyed=False, half=False):
        tmeta, ready = args[-5], args[-6]  # ..., found, ready, tmeta, fdata, quant, prefetch, chunk
        assert keyed
        # no table prepared: every keyed task probes
        real(prep_order[:0], *args, keyed=keyed, half=half)
        assert not ready.any()
        probed = _out_matrices(tmeta)
        real(prep_order, *args, keyed=keyed, half=half)
        found = _out_matrices(tmeta)
        for t in range(tmeta.shape[0]):
            if tmeta[t, train_lookup.T_INDEX] and ready[t] == train_lookup.PROBED_ALL_FOUND:
                assert probed[t].tobytes() == found[t].tobytes(), t
                compared.append(t)

    monkeypatch.setattr(train_lookup, "prepare_and_pool", twice)
    rng = np.random.default_rng(11)
    values = _keyed_batch(feats, rng, 150)
    for _ in range(3):  # new keys, then every key resident
        out, batch = eng.lookup_with_batch(values)
        eng.apply_gradients({k: np.ones_like(a) for k, a in out.items()}, batch=batch)
    assert sorted(set(compared)) == [0, 1, 2]  # every keyed table, pooled both ways


def _tables_pooled_after_the_region(monkeypatch) -> list[int]:
    """A list that each ``train_lookup.pool_tables`` call (the tables a training lookup pools
    after its region) appends its number of tables to; the real call runs."""
    pooled_after = []
    real = train_lookup.pool_tables

    def counting(n_workers, pmeta, *args):
        pooled_after.append(len(pmeta))
        return real(n_workers, pmeta, *args)

    monkeypatch.setattr(train_lookup, "pool_tables", counting)
    return pooled_after


@pytest.mark.parametrize("width", [64, 3])
def test_keyed_tables_whose_keys_all_have_rows_are_pooled_in_the_region(monkeypatch, width):
    """A training lookup pools a keyed table whose unique keys all had a live row in its
    parallel region: no ``pool_tables`` call for it after. A table with a new key is pooled
    after its storage inserted it. Either way the activations are those of preprocess() then
    lookup(batch), bit for bit, at one thread and at all."""
    feats = _keyed_features(width)
    eng = ee.EmbeddingEngine(feats, optimizer=opt.SGD(0.1), seed=3)
    pooled_after = _tables_pooled_after_the_region(monkeypatch)
    rng = np.random.default_rng(5)
    values = _keyed_batch(feats, rng, 150)
    _assert_fused_equals_apart(eng, values)  # every key new: the keyed tables after
    assert sum(pooled_after) == 3
    for threads in (1, numba.config.NUMBA_NUM_THREADS):
        numba.set_num_threads(threads)
        try:
            pooled_after.clear()
            _assert_fused_equals_apart(eng, values)  # every key resident
            assert pooled_after == []
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    values["b"] = ee.Ragged(np.array([10**15, 10**15 + 1]), lengths=[2] + [0] * 149)
    pooled_after.clear()
    _assert_fused_equals_apart(eng, values)  # two new keys in table kb: it alone after
    assert pooled_after == [1]


@pytest.mark.parametrize(
    ("weights_dtype", "slots_dtype"),
    [("bfloat16", "bfloat16"), ("float16", "float32"), ("float32", "bfloat16")],
)
@pytest.mark.parametrize("packing", [False, True])
def test_16_bit_tables_are_pooled_in_the_region(monkeypatch, weights_dtype, slots_dtype, packing):
    """A training lookup pools dense tables with 16-bit rows in its parallel region too, from
    their uint16 rows by id (or the float32 view of float32 weights beside 16-bit slots): no
    ``pool_tables`` call after it (there was one for them all: with one big table a thread
    idled while the other deduplicated). Every width, combiner, weights, a sequence, packed
    and quantized tables: the activations and batches are those of preprocess() then
    lookup(batch), bit for bit, at one thread and at all."""
    import dataclasses

    half = {}
    for name, fc in _features(packing, quantized=True).items():
        t = fc.table
        if t.name not in half:
            half[t.name] = dataclasses.replace(
                t, weights_dtype=weights_dtype, slots_dtype=slots_dtype
            )
        half[name] = dataclasses.replace(fc, table=half[t.name])
    feats = {name: fc for name, fc in half.items() if isinstance(fc, ee.FeatureConfig)}
    eng = ee.EmbeddingEngine(feats, optimizer=opt.SGD(0.1), seed=3)
    pooled_after = _tables_pooled_after_the_region(monkeypatch)
    rng = np.random.default_rng(11)
    for threads in (1, numba.config.NUMBA_NUM_THREADS):
        numba.set_num_threads(threads)
        try:
            for _ in range(2):
                _assert_fused_equals_apart(eng, _batch(feats, rng, 70))
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    assert pooled_after == []


def test_one_big_keyed_table_on_every_thread_count_equals_preprocess_then_lookup():
    """One keyed table, the case where one thread prepares while the others pool (probing
    keys themselves until the preparation is done): the same bits as preprocess() then
    lookup(batch) at every step, new keys and resident ones."""
    u = ee.initializers.RandomUniform(-1.0, 1.0)
    table = ee.TableConfig(None, 16, name="big", initializer=u, dynamic=ee.DynamicVocabulary())
    feats = {"f": ee.FeatureConfig(table)}
    eng = ee.EmbeddingEngine(feats, optimizer=opt.Adagrad(0.1), seed=4)
    rng = np.random.default_rng(6)
    for step in range(6):
        lengths = rng.integers(0, 30, 2000)
        ids = rng.zipf(1.2, int(lengths.sum())) % (3000 if step < 3 else 2000)
        _assert_fused_equals_apart(eng, {"f": ee.Ragged(ids * 7919 - 5, lengths=lengths)})
