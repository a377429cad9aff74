"""A PreparedBatch carries what it was prepared for, and an engine uses it only if that matches.

Before these checks an engine compared only feature names and the number of storage tables: a
batch from another engine (same names, bigger vocabulary) sent its ids to the kernels, which
read and wrote outside the table. The crashing calls run in a subprocess."""

import pickle
import time

import numpy as np
import pytest
from conftest import run_python

import embengine as ee
from embengine import optimizers as opt


def _engine(
    vocab=100, dim=4, backend="reference", packing=False, combiner="mean", seq=0, output_shape=None
):
    sgd = opt.SGD(0.1, low_dimensional_packing_status=packing)
    u = ee.TableConfig(vocab, dim, name="tu", combiner=combiner)
    v = ee.TableConfig(vocab, dim, name="tv")
    features = {
        "u": ee.FeatureConfig(u, max_sequence_length=seq, output_shape=output_shape),
        "v": ee.FeatureConfig(v),
    }
    return ee.EmbeddingEngine(features, optimizer=sgd, backend=backend)


FEATURES = {"u": [[1, 2], [3]], "v": [[4], [5, 6]]}

SCRIPT = """
import sys
import numpy as np
import embengine as ee
from embengine import optimizers as opt

def engine(vocab):
    t = ee.TableConfig(vocab, 8, name="t")
    return ee.EmbeddingEngine({{"u": ee.FeatureConfig(t)}}, optimizer=opt.SGD(0.1),
                              backend={backend!r})

big, small = engine(10**7), engine(100)
batch = big.preprocess({{"u": [[10**7 - 1, 5 * 10**6], [9_999_999]]}}, training={training})
{call}
print("no error", flush=True)
"""

CALLS = {
    "lookup": "small.lookup(batch, training={training})",
    "apply_gradients": "small.apply_gradients({{'u': np.ones((2, 8))}}, batch=batch)",
}


@pytest.mark.parametrize(
    "call, training",
    [("lookup", True), ("lookup", False), ("apply_gradients", True)],
)
def test_a_batch_from_an_engine_with_a_bigger_table_is_refused(backend, call, training):
    # Before: numba read (lookup) and wrote (update) rows 10**7 - 1 of a 100-row table, or
    # crashed; the reference backend raised an IndexError naming no feature.
    code = SCRIPT.format(
        backend=backend, training=training, call=CALLS[call].format(training=training)
    )
    out = run_python(code)
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr[-2000:])
    assert "no error" not in out.stdout
    assert (
        "ValueError: this PreparedBatch was prepared for another engine: feature 'u': prepared "
        "for a table of 10000000 rows, this engine's has 100"
    ) in out.stderr


@pytest.mark.parametrize(
    "other, message",
    [
        (
            dict(vocab=1000),
            r"feature 'u': prepared for a table of 100 rows, this engine's has 1000"
            r"; feature 'v': prepared for a table of 100 rows",
        ),
        (dict(dim=8), r"feature 'u': prepared for a table of dim 4, this engine's has dim 8"),
        (
            dict(combiner="sum"),
            r"feature 'u': prepared for combiner 'mean', this engine's table "
            r"has 'sum'",
        ),
        (dict(seq=3), r"feature 'u': prepared with max_sequence_length 0, this engine's is 3"),
        (
            dict(output_shape=(1, 2)),
            r"feature 'u': prepared for output_shape None, this engine's "
            r"is \[1, 2\]",
        ),
        (
            dict(packing=True),
            r"it was prepared with the tables stored as \[\[u@0\], \[v@0\]\], "
            r"this engine stores them as \[\[u@0, v@100\]\]",
        ),
    ],
)
@pytest.mark.parametrize("training", [True, False])
def test_the_error_says_what_differs(other, message, training):
    batch = _engine().preprocess(FEATURES, training=training)
    eng = _engine(**other)
    with pytest.raises(ValueError, match="prepared for another engine: " + message):
        eng.lookup(batch, training=training)
    if training:
        grads = {k: np.ones(lay.shape, np.float32) for k, lay in batch.features.items()}
        with pytest.raises(ValueError, match="prepared for another engine: " + message):
            eng.apply_gradients(grads, batch=batch)
        assert eng.step == 0


def test_other_features_are_named_without_repeating_the_same_list():
    batch = _engine().preprocess(FEATURES)
    t = ee.TableConfig(100, 4, name="t")
    other = ee.EmbeddingEngine(
        {"v": ee.FeatureConfig(t), "u": ee.FeatureConfig(t)},
        optimizer=opt.SGD(0.1),
        backend="reference",
    )
    with pytest.raises(
        ValueError,
        match=r"features in the order \['u', 'v'\], this engine in the "
        r"order \['v', 'u'\]",
    ):
        other.lookup(batch)
    third = ee.EmbeddingEngine(
        {"u": ee.FeatureConfig(t)}, optimizer=opt.SGD(0.1), backend="reference"
    )
    with pytest.raises(ValueError, match=r"it has features \['u', 'v'\], this engine has \['u'\]"):
        third.lookup(batch)


def test_identical_engines_and_pickled_batches_are_accepted(backend):
    # A DataLoader worker prepares with a pickled copy of the engine; its batches come back
    # pickled. Same configs, same fingerprint: accepted, with the same results.
    eng = _engine(backend=backend, packing=True, dim=2)
    worker = pickle.loads(pickle.dumps(eng))
    twin = _engine(backend=backend, packing=True, dim=2)
    for training in (True, False):
        mine = eng.preprocess(FEATURES, training=training)
        theirs = pickle.loads(pickle.dumps(worker.preprocess(FEATURES, training=training)))
        assert theirs.fingerprint == mine.fingerprint and theirs.fingerprint is not mine.fingerprint
        expected = eng.lookup(mine, training=training)
        for batch in (theirs, twin.preprocess(FEATURES, training=training)):
            got = eng.lookup(batch, training=training)
            assert all(np.array_equal(got[k], expected[k]) for k in expected)
    grads = {k: np.ones_like(v) for k, v in expected.items()}
    eng.apply_gradients(grads, batch=pickle.loads(pickle.dumps(worker.preprocess(FEATURES))))
    assert eng.step == 1


def test_a_batch_without_a_fingerprint_is_refused():
    eng = _engine()
    batch = eng.preprocess(FEATURES)
    bare = ee.PreparedBatch(batch.tables, batch.features)  # put together by hand
    with pytest.raises(
        ValueError,
        match=r"does not record what it was prepared for \(it was not "
        r"made by preprocess\(\)\)",
    ):
        eng.lookup(bare)
    forged = ee.PreparedBatch(batch.tables[:1], batch.features, fingerprint=batch.fingerprint)
    with pytest.raises(ValueError, match="does not agree with its own fingerprint"):
        eng.lookup(forged)
    with pytest.raises(TypeError, match="batch must be a PreparedBatch, got dict"):
        eng.apply_gradients({}, batch={})


def test_batch_arrays_are_read_only(backend):
    eng = _engine(backend=backend)
    for batch in (
        eng.preprocess(FEATURES),
        eng._lookup(FEATURES, None, True)[1],
        pickle.loads(pickle.dumps(eng.preprocess(FEATURES))),
    ):
        for tb in batch.tables:
            for name in (
                "unique_ids",
                "inverse",
                "gains",
                "segments",
                "output_offsets",
                "unique_offsets",
                "unique_gains",
                "unique_segments",
            ):
                with pytest.raises(ValueError, match="read-only"):
                    getattr(tb, name)[:1] = 0
    lookup_only = eng.preprocess(FEATURES, training=False)
    for tb in lookup_only.tables:
        for part in tb.parts:
            with pytest.raises(ValueError, match="read-only"):
                part.ragged.ids[:1] = 10**9
            with pytest.raises(ValueError, match="read-only"):
                part.ragged.offsets[1] = 10**9
        with pytest.raises(ValueError, match="read-only"):
            tb.occurrences.unique_ids[:1] = 10**9


def test_recycled_batch_memory_is_writable_again_for_the_next_batch(monkeypatch):
    # The numba backend carves batches from recycled blocks (block_pool): the read-only flag is
    # on the batch's views, so the block one batch freed serves the next one.
    from embengine.backends import numba_backend

    monkeypatch.setattr(numba_backend, "POOLED_BATCH_BYTES", 0)  # pool every batch
    eng = _engine(backend="numba")
    first = eng.preprocess(FEATURES)
    expected = [tb.unique_ids.copy() for tb in first.tables]
    addr = first.tables[0].unique_ids.ctypes.data
    del first
    second = eng.preprocess(FEATURES)
    assert second.tables[0].unique_ids.ctypes.data == addr  # the same block, reused
    for tb, e in zip(second.tables, expected, strict=True):
        np.testing.assert_array_equal(tb.unique_ids, e)
    assert not second.tables[0].unique_ids.flags.writeable


def test_ids_changed_after_a_lookup_only_preprocess_are_refused():
    # A lookup-only batch keeps views of the caller's id arrays: lookup checks them again. (The
    # reference backend: without the check numba reads outside the table; the next test runs
    # that in a subprocess.)
    eng = _engine()
    ids = np.array([1, 2, 3, 4])
    batch = eng.preprocess({"u": ee.Ragged(ids, lengths=[2, 2]), "v": [5, 6]}, training=False)
    ids[2] = 10**9
    with pytest.raises(
        ValueError,
        match=r"feature 'u': id 1000000000 at sample 1, position 0 "
        r"\(ids\[2\]\) is out of range \[0, 100\); the ids were "
        r"in range when the batch was prepared",
    ):
        eng.lookup(batch, training=False)
    ids[2] = 7  # in range again: the lookup reads the array as it is now
    np.testing.assert_array_equal(
        eng.lookup(batch, training=False)["u"],
        eng.lookup({"u": [[1, 2], [7, 4]], "v": [5, 6]}, training=False)["u"],
    )


def test_changed_lookup_only_ids_do_not_reach_the_kernels():
    # Before: the numba kernel read a row 10**12 rows past the table (SIGSEGV).
    code = """
import numpy as np
import embengine as ee
t = ee.TableConfig(100, 8, name="t")
eng = ee.EmbeddingEngine({"u": ee.FeatureConfig(t)}, optimizer=ee.optimizers.SGD(0.1))
ids = np.array([1, 2, 3])
batch = eng.preprocess({"u": ids}, training=False)
ids[0] = 10**12
print(eng.lookup(batch, training=False)["u"], flush=True)
"""
    out = run_python(code)
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
    assert "ValueError: feature 'u': id 1000000000000 at sample 0" in out.stderr


def test_the_lookup_only_recheck_is_cheap():
    # Two reductions per feature; W1-lookup's batch has 8 features of 4096 x 20 ids.
    tables = {f"t{i}": ee.TableConfig(10**6, 8, name=f"t{i}") for i in range(8)}
    eng = ee.EmbeddingEngine(
        {f"f{i}": ee.FeatureConfig(t) for i, t in enumerate(tables.values())},
        optimizer=opt.SGD(0.1),
        backend="reference",
    )
    rng = np.random.default_rng(0)
    feats = {
        f"f{i}": ee.Ragged(rng.integers(0, 10**6, 4096 * 20), lengths=np.full(4096, 20))
        for i in range(8)
    }
    batch = eng.preprocess(feats, training=False)
    eng._check_batch(batch)
    t = time.perf_counter()
    for _ in range(20):
        eng._check_batch(batch)
    per_check = (time.perf_counter() - t) / 20
    assert per_check < 0.01, f"{per_check * 1e3:.2f} ms for 655k ids"
