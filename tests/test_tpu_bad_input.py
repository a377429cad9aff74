"""Malformed inputs to the TF port give TypeError / ValueError naming the feature's path.

A hypothesis search over wrong dtypes, shapes, ragged lists, negative ids, None, strings and
nested structures that do not match the feature config, at each feature of a nested config, for
TPUEmbedding.enqueue (features and weights), apply_gradients and TPUEmbeddingForServing. Before
the port named the feature, most of these errors came from the engine's input helpers and named
none ("ids must be integers, got dtype object")."""

import logging

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import embengine as ee
import embengine.tpu as embedding

PATHS = ["alpha", "beta/0", "beta/1/gamma", "delta"]  # names no message contains by chance


def _config():
    ta = embedding.TableConfig(20, 2, combiner="sum")
    tb = embedding.TableConfig(30, 3)
    return {
        "alpha": embedding.FeatureConfig(ta),  # dense input here
        "beta": [
            embedding.FeatureConfig(tb),  # a list of lists
            {"gamma": embedding.FeatureConfig(ta, max_sequence_length=2)},
        ],
        "delta": embedding.FeatureConfig(tb, output_shape=[2]),
    }


def _training():
    return embedding.TPUEmbedding(_config(), embedding.SGD(0.1), backend="reference")


def _serving():
    return embedding.TPUEmbeddingForServing(_config(), backend="reference")


def _features():
    return {
        "alpha": np.array([1, 2]),
        "beta": [[[1, 2], [3]], {"gamma": [[1, 2, 3], [4]]}],
        "delta": [[1], [2, 3]],
    }


def _no_weights():
    return {"alpha": None, "beta": [None, {"gamma": None}], "delta": None}


def _put(tree, path: str, value):
    """``tree`` with the leaf (or subtree) at ``path`` replaced."""
    *parents, last = path.split("/")
    node = tree
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return tree


_scalars = st.one_of(
    st.none(),
    st.text(max_size=3),
    st.binary(max_size=3),
    st.floats(),
    st.integers(-(10**20), 10**20),
    st.booleans(),
    st.complex_numbers(),
)
_dtypes = st.sampled_from(
    [
        np.int64,
        np.int32,
        np.uint64,
        np.int8,
        np.float32,
        np.float64,
        np.bool_,
        np.complex64,
        object,
        "U2",
    ]
)
_shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3)
_arrays = hnp.arrays(_dtypes, _shapes)
_int_arrays = hnp.arrays(np.int64, _shapes, elements=st.integers(-3, 40))
_lists = st.recursive(
    _scalars | st.integers(-3, 40),
    lambda c: st.lists(c, max_size=3) | st.tuples(c, c),
    max_leaves=8,
)
_dicts = st.dictionaries(st.text(max_size=2), st.integers(0, 3), max_size=2)
_raggeds = st.builds(
    lambda ids: ee.Ragged(ids, lengths=[len(ids)]), st.lists(st.integers(-3, 40), max_size=4)
)
_tensors = st.builds(
    lambda a: torch.from_numpy(np.array(a)),
    _int_arrays | hnp.arrays(np.float32, hnp.array_shapes(max_dims=2)),
)
MALFORMED = st.one_of(
    _scalars, _arrays, _int_arrays, _lists, _dicts, _raggeds, _tensors, st.just(object())
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


def _clear_or_accepted(call, where: str) -> None:
    """``call()`` succeeds (the value happened to be valid) or raises a TypeError / ValueError
    whose message names ``where``."""
    try:
        call()
    except (TypeError, ValueError) as e:
        assert where in str(e), f"{type(e).__name__} names no {where!r}: {e}"


@pytest.fixture(autouse=True)
def _quiet_zero_gradient_warnings():
    logging.getLogger("embengine.tpu").setLevel(logging.ERROR)
    yield
    logging.getLogger("embengine.tpu").setLevel(logging.NOTSET)


@SETTINGS
@given(path=st.sampled_from(PATHS), value=MALFORMED)
def test_malformed_features_name_the_feature(path, value):
    emb, srv = _training(), _serving()
    _clear_or_accepted(lambda: emb.enqueue(_put(_features(), path, value)), path)
    _clear_or_accepted(lambda: srv(_put(_features(), path, value)), path)


@SETTINGS
@given(path=st.sampled_from(PATHS), value=MALFORMED)
def test_malformed_weights_name_the_feature(path, value):
    emb = _training()
    _clear_or_accepted(
        lambda: emb.enqueue(_features(), weights=_put(_no_weights(), path, value)), path
    )


@SETTINGS
@given(path=st.sampled_from(PATHS), value=MALFORMED)
def test_malformed_gradients_name_the_feature(path, value):
    emb = _training()
    emb.enqueue(_features())
    acts = emb.dequeue()
    grads = {
        "alpha": np.ones_like(acts["alpha"]),
        "beta": [np.ones_like(acts["beta"][0]), {"gamma": np.ones_like(acts["beta"][1]["gamma"])}],
        "delta": np.ones_like(acts["delta"]),
    }
    _clear_or_accepted(lambda: emb.apply_gradients(_put(grads, path, value)), path)


@SETTINGS
@given(path=st.sampled_from(["beta", "beta/1"]), value=MALFORMED)
def test_structures_that_do_not_match_the_config_name_where(path, value):
    emb = _training()
    _clear_or_accepted(lambda: emb.enqueue(_put(_features(), path, value)), path)


@pytest.mark.parametrize(
    "path, value, exc, message",
    [
        (
            "alpha",
            None,
            TypeError,
            "feature 'alpha': ids must be an integer array, a Ragged or a "
            "list of lists of ints, got NoneType None",
        ),
        (
            "beta/0",
            "abc",
            TypeError,
            "feature 'beta/0': ids must be an integer array, a Ragged "
            "or a list of lists of ints, got str 'abc'",
        ),
        ("beta/0", {"x": 1}, TypeError, "feature 'beta/0': ids must be an integer array"),
        (
            "beta/0",
            np.array([1.5, 2.0]),
            TypeError,
            "feature 'beta/0': ids must be integers, got dtype float64",
        ),
        (
            "beta/0",
            [[1, 2], 3],
            TypeError,
            "feature 'beta/0': sample 1 is int 3: a list of lists holds one list of ids per sample",
        ),
        (
            "beta/1/gamma",
            [[1], [None]],
            TypeError,
            "feature 'beta/1/gamma': ids must be integers, got None at sample 1",
        ),
        # The user's sample and position, not the engine's bag (sample 1 * 2 + position 0).
        (
            "beta/1/gamma",
            [[1], [5, -1]],
            ValueError,
            r"feature 'beta/1/gamma': id -1 at sample 1, "
            r"position 1 \(ids\[2\]\) is out of range",
        ),
        (
            "alpha",
            np.array([[[1], [2]], [[3], [20]]]),
            ValueError,
            r"feature 'alpha': id 20 at \[1, 1, 0\] is out of range \[0, 20\)",
        ),
        (
            "alpha",
            np.array([2**64 - 1], dtype=np.uint64),
            ValueError,
            "feature 'alpha': ids\\[0\\]=18446744073709551615 does not fit in int64",
        ),
        ("delta", [[1], [2], [3]], ValueError, "input data batch size 3 for input delta"),
        (
            "delta",
            torch.tensor([0.5]),
            TypeError,
            "feature 'delta': ids must be integers, got dtype float32",
        ),
    ],
)
def test_malformed_features_examples(path, value, exc, message):
    for call in (_training().enqueue, _serving()):
        with pytest.raises(exc, match=message):
            call(_put(_features(), path, value))


def test_dense_input_whose_last_dim_is_not_one_names_the_feature():
    # Training only: serving takes a dense input of any shape.
    with pytest.raises(
        ValueError,
        match=r"Instead got dense tensor as shape \[1, 2\] for input "
        r"alpha",
    ):
        _training().enqueue(_put(_features(), "alpha", np.array([[1, 2]])))


@pytest.mark.parametrize(
    "path, value, exc, message",
    [
        ("beta/0", "ab", ValueError, "feature 'beta/0': weights must be a list of 2 lists"),
        (
            "beta/0",
            np.array(1.5),
            ValueError,
            "feature 'beta/0': weights must be a list of 2 lists",
        ),
        (
            "beta/0",
            [[1.0, "x"], [1.0]],
            TypeError,
            "feature 'beta/0': weights must be numbers, got 'x' at sample 0",
        ),
        (
            "beta/0",
            [[1.0, True], [1.0]],
            TypeError,
            "feature 'beta/0': weights must be numbers, got True at sample 0",
        ),
        (
            "delta",
            [[1.0], [np.nan, 1.0]],
            ValueError,
            "feature 'delta': weight nan at sample 1, position 0",
        ),
    ],
)
def test_malformed_weights_examples(path, value, exc, message):
    with pytest.raises(exc, match=message):
        _training().enqueue(_features(), weights=_put(_no_weights(), path, value))


def test_weights_as_lists_of_arrays_still_work():
    emb = _training()
    w = _put(_no_weights(), "beta/0", [np.array([1.0, 3.0]), [np.float32(2.0)]])
    emb.enqueue(_features(), weights=w)
    plain = _training()
    plain.enqueue(_features(), weights=_put(_no_weights(), "beta/0", [[1.0, 3.0], [2.0]]))
    np.testing.assert_array_equal(emb.dequeue()["beta"][0], plain.dequeue()["beta"][0])
