"""Every bad input raises a clear error naming feature, position and value, and changes nothing."""

import numpy as np
import pytest

import embengine as ee
from embengine import initializers as init
from embengine import optimizers as opt


def _engine(backend, **kw):
    user = ee.TableConfig(10, 2, name="user", optimizer=opt.Adagrad(0.1), combiner="sum")
    item = ee.TableConfig(8, 2, name="item", initializer=init.RowId(), optimizer=opt.FTRL(0.1))
    features = {
        "u": ee.FeatureConfig(user),
        "hist": ee.FeatureConfig(item, max_sequence_length=2),
        "i": ee.FeatureConfig(item),
    }
    return ee.EmbeddingEngine(features, optimizer=opt.SGD(0.1), backend=backend, **kw)


GOOD = {"u": [[1, 2], [3]], "hist": [[1, 2, 3], [4]], "i": np.array([[5, -1], [6, 7]])}


def _snapshot(eng):
    out = {}
    for name in eng.table_names:
        out[name] = eng.embedding_tables[name].tobytes()
        for slot, arr in eng.slots(name).items():
            out[f"{name}/{slot}"] = arr.tobytes()
    return out


def _good_grads(eng):
    acts = eng.lookup(GOOD)
    return {k: np.full_like(v, 0.5) for k, v in acts.items()}


def _with(**changes):
    feats = dict(GOOD)
    feats.update(changes)
    return feats


LOOKUP_CASES = [
    (
        _with(u=[[1, 10], [3]]),
        ValueError,
        r"feature 'u': id 10 at sample 0, position 1 \(ids\[1\]\) is out of range \[0, 10\)",
    ),
    (_with(u=[[1, 2], [-3]]), ValueError, r"feature 'u': id -3 at sample 1, position 0"),
    (
        _with(i=np.array([[5, -2], [6, 7]])),
        ValueError,
        r"feature 'i': id -2 at \[0, 1\] is negative; only -1 marks padding",
    ),
    (_with(u=np.array([1, -1])), ValueError, r"feature 'u': id -1 at sample 1, position 0"),
    # The extremes of int64 (the range check reads ids as uint64: a negative one is huge).
    (
        _with(u=np.array([1, np.iinfo(np.int64).min])),
        ValueError,
        r"feature 'u': id -9223372036854775808 at sample 1, position 0 .* out of range",
    ),
    (
        _with(u=np.array([np.iinfo(np.int64).max, 1])),
        ValueError,
        r"feature 'u': id 9223372036854775807 at sample 0, position 0 .* out of range",
    ),
    (_with(u=np.array([1.0, 2.0])), TypeError, r"feature 'u': ids must be integers, got dtype"),
    (
        _with(u=ee.Ragged([1, 2, 3], offsets=[0, 2, 3], weights=[1.0, np.nan, 1.0])),
        ValueError,
        r"feature 'u': weight nan at sample 0, position 1 \(weights\[1\]\) is not finite",
    ),
    (
        _with(u=ee.Ragged([1, 2, 3], offsets=[0, 2, 3], weights=[1.0, 1.0, np.inf])),
        ValueError,
        r"feature 'u': weight inf at sample 1, position 0",
    ),
    (
        _with(hist=ee.Ragged([1, 2], offsets=[0, 1, 2], weights=[1.0, 1.0])),
        ValueError,
        r"feature 'hist': a sequence feature \(max_sequence_length > 0\) takes no weights",
    ),
    ({"u": [[1]], "hist": [[1]]}, ValueError, r"missing \['i'\]"),
    (_with(x=[[1]]), ValueError, r"unknown \['x'\]"),
]


@pytest.mark.parametrize("features, exc, message", LOOKUP_CASES)
def test_bad_lookup_input_changes_nothing(backend, features, exc, message):
    eng = _engine(backend)
    grads = _good_grads(eng)
    before = _snapshot(eng)
    with pytest.raises(exc, match=message):
        eng.lookup(features)
    assert _snapshot(eng) == before
    # The failed lookup did not replace the pending batch: its gradients still apply.
    eng.apply_gradients(grads)
    assert eng.step == 1


@pytest.mark.parametrize("storage", ["ram", "mmap", "bfloat16", "packed"])
def test_lookup_only_ids_are_range_checked_in_every_storage(backend, storage, tmp_path):
    # The numba backend checks a lookup-only batch's ids as it pools them, in its one region
    # (ram, mmap, packed tables) or before pooling a table there is none for (16-bit rows);
    # keys of a keyed table beside them are any int64.
    if storage == "bfloat16":
        pytest.importorskip("ml_dtypes")
    kw = {"weights_dtype": "bfloat16"} if storage == "bfloat16" else {}
    dim = 4 if storage == "packed" else 8
    a = ee.TableConfig(10, dim, name="a", combiner="sum", **kw)
    b = ee.TableConfig(6, dim, name="b", combiner="sum", **kw)
    keyed = ee.TableConfig(None, 4, name="k", dynamic=ee.DynamicVocabulary())
    features = {"x": ee.FeatureConfig(a), "y": ee.FeatureConfig(b), "z": ee.FeatureConfig(keyed)}
    extra = {}
    if storage == "mmap":
        extra = {"storage": {"a": "mmap", "b": "mmap"}, "storage_dir": tmp_path}
    sgd = opt.SGD(0.1, low_dimensional_packing_status=storage == "packed")
    eng = ee.EmbeddingEngine(features, optimizer=sgd, backend=backend, **extra)
    packed = len(eng.storage_plan.physical_tables) < 3
    assert packed == (storage == "packed"), eng.storage_plan
    good = {"x": [[1, 9], [0]], "y": [[5], [0, 1]], "z": [[-7, 2**62], [3]]}
    eng.lookup(good, training=False)
    for bad, message in (
        ({"y": [[5], [0, 6]]}, r"feature 'y': id 6 at sample 1, position 1 .* \[0, 6\)"),
        ({"x": [[-1, 1], [0]]}, r"feature 'x': id -1 at sample 0, position 0"),
        ({"x": [[1], [0, 2**63 - 1]]}, r"feature 'x': id 9223372036854775807 at sample 1"),
    ):
        with pytest.raises(ValueError, match=message):
            eng.lookup({**good, **bad}, training=False)


@pytest.mark.parametrize("features, exc, message", LOOKUP_CASES)
def test_bad_input_is_refused_by_lookup_only_batches_too(backend, features, exc, message):
    # A lookup-only batch pools straight from the given ids: they must be checked first.
    eng = _engine(backend)
    with pytest.raises(exc, match=message):
        eng.preprocess(features, training=False)
    with pytest.raises(exc, match=message):
        eng.lookup(features, training=False)


def test_ragged_structure_errors_name_the_feature():
    eng = _engine("reference")
    with pytest.raises(ValueError, match=r"feature 'u': weights of sample 0 has 1 entries"):
        eng.lookup(GOOD, weights={"u": [[1.0], [1.0]]})
    with pytest.raises(ValueError, match=r"weights given for unknown features \['zz'\]"):
        eng.lookup(GOOD, weights={"zz": [[1.0]]})


def _grad_cases():
    return [
        (
            lambda g: {**g, "u": np.zeros((2, 3))},
            ValueError,
            r"feature 'u': gradient has shape \(2, 3\), the activation has shape \(2, 2\)",
        ),
        (
            lambda g: {k: v for k, v in g.items() if k != "hist"},
            ValueError,
            r"no gradient for features \['hist'\]",
        ),
        (lambda g: {**g, "nope": g["u"]}, ValueError, r"gradients for unknown features \['nope'\]"),
        (
            lambda g: {**g, "i": np.where(np.arange(4).reshape(2, 2) == 3, np.nan, g["i"])},
            ValueError,
            r"feature 'i': gradient nan at \[1, 1\] is not finite",
        ),
        (
            lambda g: {**g, "hist": np.full((2, 2, 2), np.inf)},
            ValueError,
            r"feature 'hist': gradient inf at \[0, 0, 0\] is not finite",
        ),
        (
            lambda g: {**g, "u": np.array([["a", "b"], ["c", "d"]])},
            TypeError,
            r"feature 'u': gradient must be numbers",
        ),
    ]


@pytest.mark.parametrize("mutate, exc, message", _grad_cases())
def test_bad_gradients_change_nothing(backend, mutate, exc, message):
    eng = _engine(backend)
    grads = _good_grads(eng)
    before = _snapshot(eng)
    with pytest.raises(exc, match=message):
        eng.apply_gradients(mutate(grads))
    assert _snapshot(eng) == before
    assert eng.step == 0
    eng.apply_gradients(grads)  # the batch is still pending and applies cleanly
    assert _snapshot(eng) != before


def test_apply_gradients_without_lookup():
    eng = _engine("reference")
    with pytest.raises(ValueError, match="apply_gradients needs a lookup"):
        eng.apply_gradients({})
    grads = _good_grads(eng)
    eng.apply_gradients(grads)
    with pytest.raises(ValueError, match="apply_gradients needs a lookup"):
        eng.apply_gradients(grads)  # one update per lookup


def test_lookup_only_batches_cannot_update(backend):
    eng = _engine(backend)
    grads = _good_grads(eng)  # a training batch pending
    before = _snapshot(eng)
    eng.lookup(GOOD, training=False)  # read-only: never pending itself
    batch = eng.preprocess(GOOD, training=False)
    assert not batch.deduplicated
    with pytest.raises(ValueError, match="built with training=False"):
        eng.apply_gradients(grads, batch=batch)
    with pytest.raises(ValueError, match="lookup\\(batch, training=False\\)"):
        eng.lookup(batch)  # a training lookup of a batch that cannot be trained on
    out = eng.lookup(batch, training=False)
    assert all(np.array_equal(out[k], v) for k, v in eng.lookup(GOOD, training=False).items())
    assert _snapshot(eng) == before and eng.step == 0
    eng.apply_gradients(grads)  # the training lookup's, still pending after all of the above
    assert eng.step == 1
    eng.lookup(GOOD, training=False)
    with pytest.raises(ValueError, match="apply_gradients needs a lookup"):
        eng.apply_gradients(grads)  # an evaluation lookup leaves nothing to update


def test_explicit_batch_update_consumes_the_pending_lookup(backend):
    # EmbeddingLayer looks up, then applies with batch=: the same batch must not update twice.
    eng = _engine(backend)
    batch = eng.preprocess(GOOD)
    acts = eng.lookup(batch)
    grads = {k: np.full_like(v, 0.5) for k, v in acts.items()}
    eng.apply_gradients(grads, batch=batch)
    with pytest.raises(ValueError, match="apply_gradients needs a lookup"):
        eng.apply_gradients(grads)
    assert eng.step == 1


def test_skip_row_leaves_rows_with_nonfinite_gradients_untouched(backend):
    eng = _engine(backend, nonfinite_gradients="skip_row")
    acts = eng.lookup({"u": [[1, 2], [3]], "hist": [[1], [2]], "i": [4, 5]})
    before_user = eng.embedding_tables["user"].copy()
    before_acc = eng.slots("user")["accumulators"].copy()
    grads = {k: np.ones_like(v) for k, v in acts.items()}
    grads["u"][0, 1] = np.nan  # sample 0 holds rows 1 and 2
    with pytest.warns(RuntimeWarning, match="table 'user': 2 rows \\(ids 1, 2\\)"):
        eng.apply_gradients(grads)
    assert eng.nonfinite_rows_skipped["user"] == 2
    after = eng.embedding_tables["user"]
    np.testing.assert_array_equal(after[[1, 2]], before_user[[1, 2]])
    np.testing.assert_array_equal(eng.slots("user")["accumulators"][[1, 2]], before_acc[[1, 2]])
    assert not np.array_equal(after[3], before_user[3])  # sample 1 is updated
    assert np.isfinite(after).all()


def test_unknown_policy_and_backend():
    with pytest.raises(ValueError, match="nonfinite_gradients must be one of"):
        _engine("reference", nonfinite_gradients="ignore")
    with pytest.raises(ValueError, match="unknown backend 'gpu'"):
        _engine("gpu")


def test_table_without_any_optimizer():
    t = ee.TableConfig(5, 2, name="lonely")
    with pytest.raises(ValueError, match="table 'lonely' has no optimizer"):
        ee.EmbeddingEngine({"f": ee.FeatureConfig(t)})


def test_uint64_ids_past_int64_are_named_in_lists_and_arrays():
    """NumPy uint64 ids beyond int64, in a list of per-sample arrays or a 2-D array: an error
    naming the feature and the id (a bare OverflowError, or int()'s TypeError, before)."""
    t = ee.TableConfig(10, 2, name="t")
    eng = ee.EmbeddingEngine({"a": ee.FeatureConfig(t)}, optimizer=opt.SGD(0.1))
    big = 2**63 + 5
    with pytest.raises(ValueError, match=f"feature 'a': id {big} at sample 1 does not fit"):
        eng.lookup({"a": [np.array([1], np.uint64), np.array([big], np.uint64)]})
    with pytest.raises(TypeError, match=rf"feature 'a'.*\[\(1, 0\)\]={big} does not fit in int64"):
        eng.lookup({"a": np.array([[1], [big]], np.uint64)})


def test_sharded_engine_timeout_must_be_positive_seconds():
    from embengine.distributed import ShardedEngine

    t = ee.TableConfig(10, 2, name="t")
    for bad in (-1, 0, float("nan"), True, "5"):
        with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
            ShardedEngine({"a": ee.FeatureConfig(t)}, optimizer=opt.SGD(0.1), timeout=bad)


@pytest.mark.parametrize("backend", ["numba", "reference"])
@pytest.mark.parametrize("bad", [[True], ["0.5"], "5", [np.bool_(True)]])
def test_learning_rates_refuse_bools_and_strings(backend, bad):
    """``float`` reads True as 1.0 and parses "0.5"; a bare string would be read per
    character: all refused by name, as per-id weights refuse them, nothing changed."""
    t = ee.TableConfig(10, 2, name="t", optimizer=opt.SGD(opt.DynamicLearningRate(0)))
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, backend=backend)
    acts = eng.lookup({"f": [1, 2]})
    before = _snapshot(eng)
    with pytest.raises(TypeError, match="learning_rates"):
        eng.apply_gradients({"f": np.ones_like(acts["f"])}, learning_rates=bad)
    assert _snapshot(eng) == before and eng.step == 0


@pytest.mark.parametrize("backend", ["numba", "reference"])
@pytest.mark.parametrize("value", [True, "0.5"])
def test_a_learning_rate_callable_returning_a_bool_or_a_string_is_refused(backend, value):
    t = ee.TableConfig(10, 2, name="t", optimizer=opt.SGD(lambda: value))
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, backend=backend)
    acts = eng.lookup({"f": [1, 2]})
    before = _snapshot(eng)
    with pytest.raises(TypeError, match="must be a number"):
        eng.apply_gradients({"f": np.ones_like(acts["f"])})
    assert _snapshot(eng) == before and eng.step == 0


@pytest.mark.parametrize("step", [2**63, 10**30, -1, 3.0, True, np.bool_(True)])
def test_a_state_step_outside_int64_or_not_an_int_is_refused(step):
    """A step past int64 reached the update kernels (numba: a TypeError at every update)."""
    eng = _engine("numba")
    state = eng.state_dict()
    before = _snapshot(eng)
    with pytest.raises(ValueError, match=r"state\['step'\] must be an int in \[0, 2\*\*63\)"):
        eng.load_state_dict({**state, "step": step})
    assert _snapshot(eng) == before and eng.step == 0


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_a_gradient_in_the_tables_memory_updates_as_a_copy_of_it(backend):
    """A gradient that is a view of a table's weights (a slice of ``embedding_tables``) is
    read before the update writes the rows: the same result as a copy of it. Rows 1999..0
    are updated in that order (in tasks, over threads); sample s's gradient is row s, so
    most gradients are rows some task writes first, unless they are copied."""
    results = []
    for aliased in (False, True):
        t = ee.TableConfig(4000, 8, name="t", combiner="sum")
        eng = ee.EmbeddingEngine(
            {"f": ee.FeatureConfig(t)}, optimizer=opt.SGD(1.0), backend=backend
        )
        eng.lookup({"f": np.arange(2000)[::-1].copy()})
        view = eng.embedding_tables["t"][:2000]
        eng.apply_gradients({"f": view if aliased else view.copy()})
        results.append(eng.embedding_tables["t"].copy())
    np.testing.assert_array_equal(results[0], results[1])


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_a_batch_looked_up_before_a_load_is_not_applied_after_it(backend):
    """Its gradients are of the tables before the load: refused, nothing changed. A batch
    from preprocess() never looked up may still be applied (its update needs no lookup)."""
    eng = _engine(backend)
    state = eng.state_dict()
    acts, batch = eng.lookup_with_batch(GOOD)
    grads = {k: np.full_like(v, 0.5) for k, v in acts.items()}
    eng.load_state_dict(state)
    before = _snapshot(eng)
    with pytest.raises(ValueError, match="looked up before a load_state_dict or restore"):
        eng.apply_gradients(grads, batch=batch)
    assert _snapshot(eng) == before and eng.step == 0
    prepared = eng.preprocess(GOOD)
    eng.load_state_dict(state)
    eng.apply_gradients(grads, batch=prepared)
    assert eng.step == 1


@pytest.mark.parametrize("training", [True, False])
def test_masked_arrays_are_refused_not_read_under_their_mask(backend, training):
    """A numpy.ma array hid its masked entries from the checks (its max() and any() skip
    them) while the kernels read the values under the mask: a masked id 10 of a 10-row table
    pooled (and trained) a row outside the table, 10**11 a segfault; a masked NaN weight was a
    NumbaTypeError, a masked NaN gradient a NonFiniteUpdateError blaming "finite inputs"."""
    eng = _engine(backend)
    before = _snapshot(eng)
    ids = np.ma.array([1, 10], mask=[False, True])
    with pytest.raises(TypeError, match=r"feature 'u': ids is a masked array .*\.filled"):
        eng.lookup(_with(u=ids), training=training)
    nan = np.ma.array([1.0, np.nan], mask=[False, True])
    with pytest.raises(TypeError, match=r"feature 'u': weights is a masked array"):
        eng.lookup(_with(u=np.array([1, 2])), weights={"u": nan}, training=training)
    assert _snapshot(eng) == before
    if training:
        acts = eng.lookup(GOOD)
        grads = {k: np.ones_like(v) for k, v in acts.items()}
        grads["u"][0, 0] = np.nan
        grads["u"] = np.ma.array(grads["u"], mask=np.isnan(grads["u"]))
        with pytest.raises(TypeError, match=r"feature 'u': gradient is a masked array"):
            eng.apply_gradients(grads)
        assert _snapshot(eng) == before
