"""Lookup semantics: combiners with weights and empty bags, sequences, output_shape, sharing."""

import math

import numpy as np
import pytest

import embengine as ee
from embengine import initializers as init
from embengine import optimizers as opt


def _engine(features, backend="reference", **kw):
    return ee.EmbeddingEngine(features, optimizer=opt.SGD(0.1), backend=backend, **kw)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_combiners_with_weights_and_empty_bags(backend, combiner):
    # Row r of a RowId table is [r, r]: the expected activation is the weighted sum of ids.
    t = ee.TableConfig(10, 2, initializer=init.RowId(), combiner=combiner)
    eng = _engine({"f": ee.FeatureConfig(t)}, backend)
    ids = [[1, 3], [], [2, 2, 5], [4]]
    w = [[0.5, 2.0], [], [1.0, 3.0, -2.0], [0.0]]
    out = eng.lookup({"f": ids}, weights={"f": w})["f"]
    sums = [0.5 * 1 + 2.0 * 3, 0.0, 1.0 * 2 + 3.0 * 2 - 2.0 * 5, 0.0]
    if combiner == "sum":
        expected = sums
    elif combiner == "mean":
        expected = [sums[0] / 2.5, 0.0, sums[2] / 2.0, 0.0]  # zero total weight -> zeros
    else:
        expected = [sums[0] / math.sqrt(0.25 + 4), 0.0, sums[2] / math.sqrt(1 + 9 + 4), 0.0]
    assert out.dtype == np.float32 and out.shape == (4, 2)
    np.testing.assert_allclose(out, np.repeat(np.array(expected)[:, None], 2, 1), rtol=1e-6)


def test_unweighted_mean_and_sqrtn(backend):
    t_mean = ee.TableConfig(10, 1, initializer=init.RowId(), combiner="mean", name="m")
    t_sqrtn = ee.TableConfig(10, 1, initializer=init.RowId(), combiner="sqrtn", name="s")
    eng = _engine({"a": ee.FeatureConfig(t_mean), "b": ee.FeatureConfig(t_sqrtn)}, backend)
    out = eng.lookup({"a": [[1, 2, 6]], "b": [[1, 2, 6]]})
    np.testing.assert_allclose(out["a"], [[3.0]], rtol=1e-6)
    np.testing.assert_allclose(out["b"], [[9.0 / math.sqrt(3)]], rtol=1e-6)


def test_sequence_feature_truncates_and_pads(backend):
    t = ee.TableConfig(10, 2, initializer=init.RowId(offset=1))
    eng = _engine({"s": ee.FeatureConfig(t, max_sequence_length=3)}, backend)
    out = eng.lookup({"s": ee.Ragged([1, 2, 3, 4, 5, 6], lengths=[4, 0, 2])})["s"]
    assert out.shape == (3, 3, 2)
    expected = np.array([[2, 3, 4], [0, 0, 0], [6, 7, 0]], dtype=np.float32)  # id + 1; 0 = pad
    np.testing.assert_array_equal(out[..., 0], expected)
    np.testing.assert_array_equal(out[..., 1], expected)


def test_truncated_ids_are_not_updated(backend):
    t = ee.TableConfig(10, 1, initializer=init.Zeros())
    eng = _engine({"s": ee.FeatureConfig(t, max_sequence_length=2)}, backend)
    acts = eng.lookup({"s": [[1, 2, 3]]})
    eng.apply_gradients({"s": np.ones_like(acts["s"])})
    np.testing.assert_allclose(eng.embedding_tables["table_0"][:4, 0], [0, -0.1, -0.1, 0])


def test_output_shape_reshapes_the_batch(backend):
    t = ee.TableConfig(10, 2, initializer=init.RowId(), combiner="sum")
    fc = {
        "bag": ee.FeatureConfig(t, output_shape=[2, 3]),
        "seq": ee.FeatureConfig(t, max_sequence_length=2, output_shape=(3, 4)),
    }
    eng = _engine(fc, backend)
    out = eng.lookup({"bag": np.arange(6), "seq": [[1, 2], [3], [], [4, 5, 6], [7], [8, 9]]})
    assert out["bag"].shape == (2, 3, 2)
    np.testing.assert_array_equal(out["bag"][..., 0], np.arange(6).reshape(2, 3))
    assert out["seq"].shape == (3, 4, 2)
    np.testing.assert_array_equal(
        out["seq"][..., 0].reshape(-1), [1, 2, 3, 0, 0, 0, 4, 5, 7, 0, 8, 9]
    )
    grads = {k: np.ones_like(v) for k, v in out.items()}
    eng.apply_gradients(grads)  # gradients take the output_shape too


def test_output_shape_must_hold_the_batch():
    t = ee.TableConfig(10, 2)
    eng = _engine({"f": ee.FeatureConfig(t, output_shape=[4])})
    with pytest.raises(
        ValueError, match=r"output_shape \[4\] holds 4 vectors but the batch gives 3"
    ):
        eng.lookup({"f": [1, 2, 3]})


def test_tables_ordered_by_first_appearance_and_named():
    a = ee.TableConfig(5, 2)
    b = ee.TableConfig(5, 2, name="bee")
    c = ee.TableConfig(5, 2)
    eng = _engine(
        {
            "x": ee.FeatureConfig(b),
            "y": ee.FeatureConfig(a),
            "z": ee.FeatureConfig(b),
            "w": ee.FeatureConfig(c),
        }
    )
    assert eng.table_names == ("bee", "table_1", "table_2")


def test_equal_but_distinct_tables_are_not_shared():
    a = ee.TableConfig(5, 2)
    b = ee.TableConfig(5, 2)
    eng = _engine({"x": ee.FeatureConfig(a), "y": ee.FeatureConfig(b)})
    assert len(eng.table_names) == 2


def test_duplicate_table_names_rejected():
    a = ee.TableConfig(5, 2, name="t")
    b = ee.TableConfig(5, 2, name="t")
    with pytest.raises(ValueError, match="table name 't' is used by two different TableConfig"):
        _engine({"x": ee.FeatureConfig(a), "y": ee.FeatureConfig(b)})


def test_initial_values_depend_only_on_seed_table_and_row():
    t = ee.TableConfig(50, 4, name="t")
    small = _engine({"f": ee.FeatureConfig(t)}, seed=3).embedding_tables["t"]
    big_t = ee.TableConfig(80, 4, name="t")
    big = _engine({"f": ee.FeatureConfig(big_t)}, seed=3).embedding_tables["t"]
    np.testing.assert_array_equal(small, big[:50])
    other_seed = _engine({"f": ee.FeatureConfig(t)}, seed=4).embedding_tables["t"]
    assert not np.array_equal(small, other_seed)
    # Default initializer: truncated normal with stddev 1/sqrt(dim), within 2 stddev.
    assert np.abs(big).max() <= 2 * 0.5 + 1e-6
    assert 0.3 < big.std() < 0.55


def test_lookup_of_prepared_batch_equals_lookup_of_features():
    t = ee.TableConfig(10, 3, combiner="sqrtn")
    eng = _engine({"f": ee.FeatureConfig(t), "g": ee.FeatureConfig(t)})
    feats = {"f": [[1, 2], [3]], "g": [[3, 3, 1]]}
    batch = eng.preprocess(feats)
    a = eng.lookup(batch)
    b = eng.lookup(feats)
    for k in feats:
        np.testing.assert_array_equal(a[k], b[k])


def test_prepared_batch_is_deduplicated_in_order_of_first_appearance():
    t = ee.TableConfig(10, 3, combiner="sum")
    eng = _engine({"f": ee.FeatureConfig(t), "g": ee.FeatureConfig(t)})
    batch = eng.preprocess({"f": [[7, 2], [7]], "g": [[2, 9, 7]]})
    tb = batch.tables[0]
    np.testing.assert_array_equal(tb.unique_ids, [7, 2, 9])
    np.testing.assert_array_equal(tb.inverse, [0, 1, 0, 1, 2, 0])
    np.testing.assert_array_equal(tb.segments, [0, 0, 1, 2, 2, 2])
    assert tb.num_outputs == 3


@pytest.mark.parametrize("dim", [8, 16])
@pytest.mark.parametrize("quantized", [False, True])
def test_fixed_dim_pooling_kernels_equal_the_generic_one(dim, quantized):
    from embengine.kernels.lookup import pool, pool_kernel

    assert pool_kernel(dim) is not pool and pool_kernel(dim + 1) is pool
    rng = np.random.default_rng(dim)
    data = rng.normal(size=(50, dim + 3)).astype(np.float32)  # rows wider than dim (slots)
    lengths = rng.integers(0, 5, 70)  # more than one parallel task, empty bags included
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n = int(offsets[-1])
    unique = rng.integers(0, 50, n).astype(np.int64)
    inverse = rng.permutation(n).astype(np.int64)
    gains = rng.normal(size=n).astype(np.float32)
    quant = np.array([9.0, -1.0, 1.0]) if quantized else np.zeros(3)
    outs = []
    for kernel in (pool, pool_kernel(dim)):
        out = np.full((70, dim), np.nan, dtype=np.float32)
        kernel(data, dim, unique, inverse, gains, offsets, out, quant, 4)
        outs.append(out)
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-6, atol=1e-6)
    expected = np.zeros((70, dim))
    for o in range(70):
        for k in range(offsets[o], offsets[o + 1]):
            row = data[unique[inverse[k]], :dim].astype(np.float64)
            if quantized:
                row = np.floor((np.clip(row, -1, 1) + 1) / 0.25 + 0.5) * 0.25 - 1
            expected[o] += gains[k] * row
    np.testing.assert_allclose(outs[0], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim", [3, 8])  # the generic kernel and a fixed-dim one
@pytest.mark.parametrize("quantized", [False, True])
def test_lookup_only_batches_pool_straight_from_the_ids(dim, quantized):
    # A lookup-only batch keeps each feature's own arrays (no occurrence arrays): its lookup must
    # give the bits of the training lookup on the deduplicated batch, and the reference's values.
    q = ee.QuantizationConfig(num_buckets=9, lower=-0.5, upper=0.5) if quantized else None
    tables = {
        c: ee.TableConfig(
            40,
            dim,
            combiner=c,
            name=c,
            quantization_config=q,
            initializer=init.RandomUniform(-1.0, 1.0),
        )
        for c in ("sum", "mean", "sqrtn")
    }
    feats = {f"f_{c}": ee.FeatureConfig(t) for c, t in tables.items()}
    feats["g_mean"] = ee.FeatureConfig(tables["mean"])  # two features share a table
    feats["seq"] = ee.FeatureConfig(tables["sum"], max_sequence_length=3)
    rng = np.random.default_rng(dim)
    lengths = {f: rng.integers(0, 5, 150) for f in feats}  # empty bags; > 1 parallel task
    values = {
        f: ee.Ragged(
            rng.integers(0, 40, int(n.sum())),
            lengths=n,
            weights=None if f == "seq" else rng.normal(size=int(n.sum())),
        )
        for f, n in lengths.items()
    }
    engines = [_engine(feats, b, seed=3) for b in ("numba", "reference")]
    batch = engines[0].preprocess(values, training=False)
    assert all(isinstance(tb, ee.batch.LookupOnlyTableBatch) for tb in batch.tables)
    only = engines[0].lookup(batch, training=False)
    trained = engines[0].lookup(values)
    reference = engines[1].lookup(values, training=False)
    for f in feats:
        np.testing.assert_array_equal(only[f], trained[f])
        np.testing.assert_allclose(only[f], reference[f], rtol=1e-5, atol=1e-6)
