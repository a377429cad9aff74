"""Low-dimensional packing: tables of dim 1, 2, 4 with equal optimizers share storage and kernel
calls, with results identical to unpacked tables."""

import numpy as np
import pytest

import embengine as ee
from embengine import optimizers as opt

DIMS = [1, 2, 4, 1, 2, 8, 4, 1]


def _engine(packing, backend, optimizer=None, dtypes=("float32", "float32"), **kw):
    o = optimizer or opt.Adagrad(0.1, low_dimensional_packing_status=packing)
    if optimizer is not None:
        o = type(o)(**{**o.hyperparameters(), "low_dimensional_packing_status": packing})
    tables = [
        ee.TableConfig(
            20 + i,
            d,
            name=f"t{i}",
            combiner=("mean", "sum", "sqrtn")[i % 3],
            weights_dtype=dtypes[0],
            slots_dtype=dtypes[1],
        )
        for i, d in enumerate(DIMS)
    ]
    feats = {f"f{i}": ee.FeatureConfig(t) for i, t in enumerate(tables)}
    feats["seq"] = ee.FeatureConfig(tables[0], max_sequence_length=3)
    return ee.EmbeddingEngine(feats, optimizer=o, backend=backend, **kw)


def _run(engines, steps=3, seed=0):
    rng = np.random.default_rng(seed)
    for step in range(steps):
        feats = {
            f"f{i}": [list(rng.integers(0, 20, rng.integers(0, 4))) for _ in range(6)]
            for i in range(len(DIMS))
        }
        feats["seq"] = [list(rng.integers(0, 20, 4)) for _ in range(6)]
        for e in engines:
            inference = e.lookup(feats, training=False)  # packed lookup-only path too
            acts = e.lookup(feats)
            for k, a in acts.items():
                np.testing.assert_array_equal(inference[k], a)
            grads = {
                k: np.sin(np.arange(v.size) + step).reshape(v.shape).astype(np.float32)
                for k, v in acts.items()
            }
            e.apply_gradients(grads)


@pytest.mark.parametrize(
    "optimizer",
    [
        opt.Adagrad(0.1),
        opt.Adam(0.05, bias_correction="per_row"),
        opt.FTRL(0.1),
        opt.SGD(0.2, use_gradient_accumulation=False),
        opt.Adam(0.05, lazy_adam=False),
    ],
    ids=lambda o: type(o).__name__,
)
def test_packed_equals_unpacked(backend, optimizer):
    plain, packed = _engine(False, backend, optimizer), _engine(True, backend, optimizer)
    assert len(plain.storage_plan.physical_tables) == len(DIMS)
    # dims 1, 2, 4 pack; 8 does not
    plan = packed.storage_plan.physical_tables
    assert sorted(p.name for p in plan) == ["t0+t3+t7", "t1+t4", "t2+t6", "t5"]
    _run([plain, packed])
    for name in plain.table_names:
        np.testing.assert_array_equal(plain.embedding_tables[name], packed.embedding_tables[name])
        for slot, arr in plain.slots(name).items():
            np.testing.assert_array_equal(arr, packed.slots(name)[slot])


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a


@pytest.mark.parametrize(
    ("optimizer", "dtypes"),
    [
        (opt.Adagrad(0.1), ("bfloat16", "bfloat16")),
        (opt.Adam(0.05), ("float16", "bfloat16")),
        (opt.SGD(0.2, use_gradient_accumulation=False), ("bfloat16", "float32")),
        (opt.FTRL(0.1), ("float32", "float16")),
    ],
    ids=lambda x: x if isinstance(x, tuple) else type(x).__name__,
)
def test_packed_16_bit_tables_round_as_unpacked(backend, optimizer, dtypes):
    """Each member of a packed 16-bit table rounds in its own stream (its key, its ids), so
    its weights and slots are bit-identical to the same table unpacked: before, the stream
    followed the packed row and the packed table's name, and the tables differed (and from
    a ShardedEngine, which never packs)."""
    plain = _engine(False, backend, optimizer, dtypes=dtypes)
    packed = _engine(True, backend, optimizer, dtypes=dtypes)
    assert sorted(p.name for p in packed.storage_plan.physical_tables)[0] == "t0+t3+t7"
    _run([plain, packed], steps=4)
    for name in plain.table_names:
        got, want = packed.embedding_tables[name], plain.embedding_tables[name]
        np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=name)
        for slot, arr in plain.slots(name).items():
            np.testing.assert_array_equal(_bits(packed.slots(name)[slot]), _bits(arr))


def test_packed_prepared_batches_are_canonical():
    # Packed deduplication hashes each packed table on its own (t0's features are not
    # consecutive: f0, then "seq" last); the batch must still equal the reference's.
    fast, slow = _engine(True, "numba"), _engine(True, "reference")
    rng = np.random.default_rng(3)
    feats = {
        f"f{i}": [list(rng.integers(0, 20, rng.integers(0, 6))) for _ in range(7)]
        for i in range(len(DIMS))
    }
    feats["seq"] = [list(rng.integers(0, 20, 4)) for _ in range(7)]
    for a, b in zip(fast.preprocess(feats).tables, slow.preprocess(feats).tables, strict=True):
        for field in (
            "unique_ids",
            "inverse",
            "gains",
            "segments",
            "output_offsets",
            "unique_offsets",
            "unique_gains",
            "unique_segments",
        ):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)


def test_packing_respects_optimizer_equality_and_initial_values():
    a = opt.SGD(0.1, low_dimensional_packing_status=True)
    b = opt.SGD(0.2, low_dimensional_packing_status=True)
    t = [
        ee.TableConfig(10, 2, name="x", optimizer=a),
        ee.TableConfig(10, 2, name="y", optimizer=b),
        ee.TableConfig(10, 2, name="z", optimizer=a),
    ]
    eng = ee.EmbeddingEngine({n.name: ee.FeatureConfig(n) for n in t})
    assert sorted(p.name for p in eng.storage_plan.physical_tables) == ["x+z", "y"]
    alone = ee.EmbeddingEngine(
        {"z": ee.FeatureConfig(ee.TableConfig(10, 2, name="z"))}, optimizer=opt.SGD(0.1)
    )
    np.testing.assert_array_equal(eng.embedding_tables["z"], alone.embedding_tables["z"])


def test_packed_checkpoint_loads_unpacked(tmp_path):
    packed = _engine(True, "numba")
    _run([packed])
    packed.save(tmp_path)
    plain = _engine(False, "numba")
    plain.restore(tmp_path)
    for name in plain.table_names:
        np.testing.assert_array_equal(plain.embedding_tables[name], packed.embedding_tables[name])
    _run([plain, packed], steps=2, seed=1)
    for name in plain.table_names:
        np.testing.assert_array_equal(plain.embedding_tables[name], packed.embedding_tables[name])


def test_tables_are_dealt_to_threads_by_size():
    # Packed tables are few and big: prepare deals tables largest first to the least loaded
    # thread, so no thread gets more than its share plus one table.
    from embengine.kernels.prepare import deal_tables

    rng = np.random.default_rng(0)
    for n_workers in (1, 2, 3):
        sizes = np.concatenate([[327_680] * 3, rng.integers(0, 20_000, 40)])
        order, bounds = deal_tables(sizes, n_workers)
        assert sorted(order) == list(range(len(sizes)))
        loads = [sizes[order[bounds[w] : bounds[w + 1]]].sum() for w in range(n_workers)]
        assert max(loads) - min(loads) <= sizes.max()
        assert max(loads) <= sizes.sum() / n_workers + sizes.max()
    # W2 packed: 3 packed tables and 40 small ones over 2 threads, within 5% of even.
    sizes = np.array([327_680] * 3 + [16_384] * 40)
    order, bounds = deal_tables(sizes, 2)
    loads = [sizes[order[bounds[w] : bounds[w + 1]]].sum() for w in range(2)]
    assert max(loads) <= 1.05 * sizes.sum() / 2


def test_results_do_not_depend_on_how_tables_are_dealt(monkeypatch):
    from embengine.kernels import prepare as kp

    rng = np.random.default_rng(5)
    feats = {
        f"f{i}": [list(rng.integers(0, 20, rng.integers(0, 6))) for _ in range(7)]
        for i in range(len(DIMS))
    }
    feats["seq"] = [list(rng.integers(0, 20, 4)) for _ in range(7)]
    expected = _engine(True, "numba").preprocess(feats)
    dealings = [
        lambda sizes, n: (np.arange(len(sizes))[::-1].copy(), np.array([0, len(sizes)])),
        lambda sizes, n: (np.arange(len(sizes))[::-1].copy(), np.arange(len(sizes) + 1)),
    ]  # all tables on one worker in reverse order; one worker per table
    for deal in dealings:
        monkeypatch.setattr(kp, "deal_tables", deal)
        got = _engine(True, "numba").preprocess(feats)
        for a, b in zip(got.tables, expected.tables, strict=True):
            for field in (
                "unique_ids",
                "inverse",
                "gains",
                "segments",
                "output_offsets",
                "unique_offsets",
                "unique_gains",
                "unique_segments",
            ):
                np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
