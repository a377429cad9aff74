"""embengine.tpu with TensorFlow's own types: tf.Tensor, tf.RaggedTensor and tf.SparseTensor in,
tf.Tensor out, the GradientTape flow, checked against the NumPy reference backend and against
TF's own CPU lookup (``tf.tpu.experimental.embedding.serving_embedding_lookup``)."""

import logging
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

tf = pytest.importorskip(
    "tensorflow", reason="tensorflow-cpu is not installed (pip install 'embengine[tf]')"
)

import embengine as ee  # noqa: E402
import embengine.tpu as embedding  # noqa: E402
from embengine.tpu.tf_interop import is_tf, unpack  # noqa: E402

RNG = np.random.default_rng(7)


def _ragged_lists(batch: int, vocab: int, max_len: int) -> list[list[int]]:
    return [RNG.integers(0, vocab, RNG.integers(0, max_len + 1)).tolist() for _ in range(batch)]


def _config(optimizer_table=None):
    """Dense, ragged (weighted, mean), sparse (sqrtn) and sequence features on two tables."""
    a = embedding.TableConfig(50, 4, combiner="mean", name="a")
    b = embedding.TableConfig(40, 3, combiner="sqrtn", name="b", optimizer=optimizer_table)
    return {
        "dense": embedding.FeatureConfig(a),
        "ragged": embedding.FeatureConfig(a),
        "sparse": embedding.FeatureConfig(b),
        "seq": embedding.FeatureConfig(b, max_sequence_length=3),
    }


def _batch(batch: int):
    """One batch as TF inputs and as the equivalent NumPy / list inputs."""
    ragged = _ragged_lists(batch, 50, 4)
    ragged_w = [RNG.uniform(0.5, 2.0, len(s)).tolist() for s in ragged]
    sparse = _ragged_lists(batch, 40, 5)
    sparse_w = [RNG.uniform(0.5, 2.0, len(s)).tolist() for s in sparse]
    seq = _ragged_lists(batch, 40, 5)  # some longer than max_sequence_length: truncated
    dense = RNG.integers(0, 50, batch)

    def sparse_tensor(lists, dtype):
        idx = [[b, j] for b, s in enumerate(lists) for j in range(len(s))]
        vals = [v for s in lists for v in s]
        width = max([len(s) for s in lists] + [1])
        return tf.sparse.SparseTensor(
            tf.constant(idx, tf.int64, shape=[len(idx), 2]),
            tf.constant(vals, dtype),
            [len(lists), width],
        )

    tf_in = {
        "dense": tf.constant(dense, tf.int32),
        "ragged": tf.ragged.constant(ragged, tf.int64, row_splits_dtype=tf.int64, ragged_rank=1),
        "sparse": sparse_tensor(sparse, tf.int64),
        "seq": tf.ragged.constant(seq, tf.int32, ragged_rank=1),
    }
    tf_w = {
        "dense": None,
        "ragged": tf.ragged.constant(
            ragged_w, tf.float32, row_splits_dtype=tf.int64, ragged_rank=1
        ),
        "sparse": sparse_tensor(sparse_w, tf.float32),
        "seq": None,
    }
    np_in = {"dense": dense, "ragged": ragged, "sparse": sparse, "seq": seq}
    np_w = {"dense": None, "ragged": ragged_w, "sparse": sparse_w, "seq": None}
    return tf_in, tf_w, np_in, np_w


def _loss_np(acts):
    """loss = sum over features of sum(acts**2) / 2 + sum(acts): its gradient is acts + 1."""
    return {k: v + 1.0 for k, v in acts.items()}


def _loss_tf(acts):
    return tf.add_n([tf.reduce_sum(v * v) / 2 + tf.reduce_sum(v) for v in acts.values()])


@pytest.mark.parametrize("watch", ["auto", "tape.watch", "no accessed variables"])
def test_gradient_tape_flow_matches_the_numpy_reference(watch):
    # Adagrad globally, FTRL on table b: per-table optimizers and slots both exercised.
    def make(backend):
        return embedding.TPUEmbedding(
            _config(embedding.FTRL(0.05)), embedding.Adagrad(0.1), backend=backend
        )

    tf_emb, np_emb = make("numba"), make("reference")
    for _ in range(4):
        tf_in, tf_w, np_in, np_w = _batch(batch=5)
        tf_emb.enqueue(tf_in, weights=tf_w)
        with tf.GradientTape(watch_accessed_variables=watch != "no accessed variables") as tape:
            acts = tf_emb.dequeue()
            if watch != "auto":
                tape.watch(acts)  # TF's documented flow; harmless here
            loss = _loss_tf(acts)
        grads = tape.gradient(loss, acts)
        assert all(is_tf(a) and a.dtype == tf.float32 for a in acts.values())
        assert all(is_tf(g) for g in grads.values())
        tf_emb.apply_gradients(grads)

        np_emb.enqueue(np_in, weights=np_w)
        np_acts = np_emb.dequeue()
        assert all(type(a) is np.ndarray for a in np_acts.values())  # NumPy in, NumPy out
        np_emb.apply_gradients(_loss_np(np_acts))
        for k in np_acts:
            assert acts[k].shape == np_acts[k].shape, k
            np.testing.assert_allclose(acts[k].numpy(), np_acts[k], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(grads[k].numpy(), np_acts[k] + 1, rtol=1e-5, atol=1e-6)
    for name in ("a", "b"):
        ours, oracle = tf_emb.engine.embedding_tables[name], np_emb.engine.embedding_tables[name]
        np.testing.assert_allclose(ours, oracle, rtol=1e-5, atol=1e-6)


def test_activations_read_earlier_keep_their_values():
    t = embedding.TableConfig(10, 2, initializer=embedding.RowIdInitializer())
    emb = embedding.TPUEmbedding({"f": embedding.FeatureConfig(t)}, embedding.SGD(0.5))
    emb.enqueue({"f": tf.constant([1, 2])})
    first = emb.dequeue()["f"]
    emb.apply_gradients({"f": tf.ones((2, 2))})
    emb.enqueue({"f": tf.constant([3, 4])})
    second = emb.dequeue()["f"]
    np.testing.assert_array_equal(first.numpy()[:, 0], [1, 2])
    np.testing.assert_array_equal(second.numpy()[:, 0], [3, 4])


def test_indexed_slices_gradient_and_mixed_inputs():
    # A gather in the model gives tf.IndexedSlices; a NumPy input beside a TF one still makes
    # every activation a tf.Tensor (one rule per call).
    t = embedding.TableConfig(10, 2, initializer=embedding.RowIdInitializer())
    emb = embedding.TPUEmbedding(
        {"a": embedding.FeatureConfig(t), "b": embedding.FeatureConfig(t)}, embedding.SGD(0.5)
    )
    emb.enqueue({"a": tf.constant([1, 2, 3]), "b": np.array([4])})
    with tf.GradientTape() as tape:
        acts = emb.dequeue()
        loss = tf.reduce_sum(tf.gather(acts["a"], [2])) + tf.reduce_sum(acts["b"])
    grads = tape.gradient(loss, acts)
    assert isinstance(grads["a"], tf.IndexedSlices) and is_tf(acts["b"])
    emb.apply_gradients(grads)
    np.testing.assert_allclose(emb.embedding_tables[t][[1, 2, 3, 4], 0], [1, 2, 2.5, 3.5])


def _tf_reference(config_np, tables: dict, inputs, weights=None):
    """TF's own CPU lookup on the same table values, with TF's config classes."""
    tf_tables = {}
    tf_features = {}
    for path, f in config_np.items():
        t = f.table
        if t.name not in tf_tables:
            tf_tables[t.name] = tf.tpu.experimental.embedding.TableConfig(
                t.vocabulary_size, t.dim, combiner=t.combiner, name=t.name
            )
        tf_features[path] = tf.tpu.experimental.embedding.FeatureConfig(
            tf_tables[t.name],
            max_sequence_length=f.max_sequence_length,
            output_shape=f.output_shape,
        )
    variables = {tf_tables[name]: tf.Variable(w) for name, w in tables.items()}
    return tf.tpu.experimental.embedding.serving_embedding_lookup(
        inputs, weights, variables, tf_features
    )


def test_serving_matches_tfs_own_cpu_lookup():
    t = embedding.TableConfig(
        30, 3, combiner="sqrtn", name="t", initializer=ee.initializers.RandomUniform(-1.0, 1.0)
    )
    u = embedding.TableConfig(
        30, 2, combiner="mean", name="u", initializer=ee.initializers.RandomUniform(-1.0, 1.0)
    )
    config = {
        "dense": embedding.FeatureConfig(t),
        "dense2": embedding.FeatureConfig(u),
        "ragged": embedding.FeatureConfig(t),
        "sparse": embedding.FeatureConfig(u),
        "sparse_seq": embedding.FeatureConfig(t, max_sequence_length=3),
        "ragged_seq": embedding.FeatureConfig(u, max_sequence_length=2),
        "ragged_shaped": embedding.FeatureConfig(u, output_shape=[2, 2]),
    }
    serving = embedding.TPUEmbeddingForServing(config)
    serving.build()
    inputs = {
        "dense": tf.constant([3, 4, 5]),
        "dense2": tf.constant([[1], [2]], tf.int64),
        "ragged": tf.ragged.constant([[1, 2, 3], [], [4]]),
        # Unsorted indices, an empty row and a value past column 3.
        "sparse": tf.sparse.SparseTensor([[2, 1], [0, 0], [2, 0], [0, 3]], [7, 8, 9, 10], [4, 5]),
        # Gaps: position 1 of row 0 and position 0 of row 1 look up zeros; column 4 is cut.
        "sparse_seq": tf.sparse.SparseTensor(
            [[0, 0], [0, 2], [1, 1], [1, 4]], [11, 12, 13, 14], [2, 5]
        ),
        "ragged_seq": tf.ragged.constant([[1, 2, 3], [4]]),
        "ragged_shaped": tf.ragged.constant([[1], [2, 3], [], [4]]),
    }
    weights = {k: None for k in inputs}
    weights["ragged"] = tf.ragged.constant([[0.5, 1.0, 2.0], [], [3.0]])
    weights["sparse"] = tf.sparse.SparseTensor(
        inputs["sparse"].indices, [0.5, 1.5, 2.0, 4.0], [4, 5]
    )
    tables = {"t": serving.engine.embedding_tables["t"], "u": serving.engine.embedding_tables["u"]}
    ours = serving.embedding_lookup(inputs, weights)
    # TF's serving reads the sparse tensors' indices in canonical (row-major) order.
    ref_inputs = dict(inputs, sparse=tf.sparse.reorder(inputs["sparse"]))
    ref_weights = dict(weights, sparse=tf.sparse.reorder(weights["sparse"]))
    theirs = _tf_reference(config, tables, ref_inputs, ref_weights)
    for k in inputs:
        assert is_tf(ours[k]), k
        assert ours[k].shape == theirs[k].shape, (k, ours[k].shape, theirs[k].shape)
        np.testing.assert_allclose(
            ours[k].numpy(), theirs[k].numpy(), rtol=1e-5, atol=1e-6, err_msg=k
        )
    assert np.all(ours["sparse_seq"].numpy()[[0, 1], [1, 0]] == 0)
    # The layer call is embedding_lookup; NumPy in, NumPy out.
    np.testing.assert_array_equal(serving(inputs, weights)["dense"].numpy(), ours["dense"].numpy())
    out = serving(
        {
            **inputs,
            "dense": np.array([3, 4, 5]),
            "ragged": [[1, 2, 3], [], [4]],
            "sparse": [[8, 10], [], [9, 7], []],
            "sparse_seq": [[11], [13]],
            "ragged_seq": [[1, 2, 3], [4]],
            "ragged_shaped": [[1], [2, 3], [], [4]],
            "dense2": np.array([[1], [2]]),
        }
    )
    assert all(type(v) is np.ndarray for v in out.values())


def test_sparse_tensor_of_rank_3_gives_a_bag_per_leading_index(caplog):
    t = embedding.TableConfig(20, 2, initializer=embedding.RowIdInitializer(), combiner="sum")
    emb = embedding.TPUEmbedding(
        {"f": embedding.FeatureConfig(t, max_sequence_length=4)}, embedding.SGD(0.1)
    )
    sp = tf.sparse.SparseTensor([[0, 0, 0], [0, 0, 1], [1, 1, 0]], [1, 2, 5], [2, 2, 3])
    with caplog.at_level(logging.WARNING, logger="embengine.tpu"):
        emb.enqueue({"f": sp})
    assert "max_sequence_length setting will be ignored" in caplog.text
    out = emb.dequeue()["f"]
    assert out.shape == (2, 2, 2)
    np.testing.assert_array_equal(out.numpy()[..., 0], [[3, 0], [0, 5]])


def test_inputs_are_read_without_copies():
    ids = tf.constant([4, 5, 6, 7], tf.int64)
    rt = tf.RaggedTensor.from_row_splits(ids, tf.constant([0, 3, 4], tf.int64))
    r, _ = unpack("f", rt, None)
    assert np.shares_memory(r.ids, np.asarray(rt.values))
    sp = tf.sparse.SparseTensor([[0, 0], [0, 1], [1, 0]], ids[:3], [2, 2])
    s, _ = unpack("f", sp, None)
    assert np.shares_memory(s.values, np.asarray(sp.values))
    dense, _ = unpack("f", ids, None)
    assert np.shares_memory(dense, np.asarray(ids))


def test_build_takes_tensor_shapes():
    t = embedding.TableConfig(10, 2)
    emb = embedding.TPUEmbedding(
        {"f": embedding.FeatureConfig(t, max_sequence_length=3)}, embedding.SGD(0.1)
    )
    emb.build(per_replica_input_shapes={"f": tf.TensorShape([4, 5])})
    with pytest.raises(ValueError, match=r"Output shape is set to be \[4, 3\]"):
        emb.enqueue({"f": tf.ragged.constant([[1], [2]])})
    emb.enqueue({"f": tf.ragged.constant([[1], [2], [3], [4]])})
    assert emb.dequeue()["f"].shape == (4, 3, 2)


def _features():
    return {
        "alpha": tf.constant([1, 2]),
        "beta": tf.ragged.constant([[1, 2], [3]]),
        "gamma": tf.sparse.SparseTensor([[0, 0], [1, 1]], [1, 2], [2, 3]),
    }


def _config_for_errors():
    t = embedding.TableConfig(20, 2)
    return {
        "alpha": embedding.FeatureConfig(t),
        "beta": embedding.FeatureConfig(t),
        "gamma": embedding.FeatureConfig(t, max_sequence_length=3),
    }


@pytest.mark.parametrize(
    "path, value, exc, message",
    [
        (
            "alpha",
            tf.constant(["a", "b"]),
            TypeError,
            "feature 'alpha': ids must be integers, got tf dtype string",
        ),
        (
            "alpha",
            tf.constant([1.0, 2.0]),
            TypeError,
            "feature 'alpha': ids must be integers, got tf dtype float32",
        ),
        (
            "alpha",
            tf.constant([[1, 2], [3, 4]]),
            ValueError,
            r"Instead got dense tensor as shape \[2, 2\] for input alpha",
        ),
        (
            "alpha",
            tf.constant([1, 25]),
            ValueError,
            r"feature 'alpha': id 25 at \[1\] is out of range \[0, 20\)",
        ),
        (
            "beta",
            tf.ragged.constant([[1.5], [2.0]]),
            TypeError,
            "feature 'beta': ids must be integers, got tf dtype float32",
        ),
        (
            "beta",
            tf.ragged.constant([[[1], [2]], [[3]]]),
            ValueError,
            "Only rank 2 ragged tensor is supported, find rank 3 ragged tensor.*for input beta",
        ),
        (
            "beta",
            tf.ragged.constant([[1, 2], [30]]),
            ValueError,
            r"feature 'beta': id 30 at sample 1, position 0 \(ids\[2\]\) is out of range",
        ),
        (
            "gamma",
            tf.sparse.SparseTensor([[0]], [1], [3]),
            ValueError,
            "Only rank 2 and above sparse tensor is supported, find rank 1 sparse tensor for input "
            "gamma",
        ),
        (
            "gamma",
            tf.sparse.SparseTensor([[0, 0], [1, 2]], [1, -4], [2, 3]),
            ValueError,
            r"feature 'gamma': id -4 at \[1, 2\] \(values\[1\]\) is out of range \[0, 20\)",
        ),
        (
            "gamma",
            tf.sparse.SparseTensor([[0, 0], [0, 0]], [1, 2], [2, 3]),
            ValueError,
            r"feature 'gamma': two ids at index \[0, 0\]; a sequence holds one id per position",
        ),
        (
            "gamma",
            tf.sparse.SparseTensor([[0, 0], [2, 0]], [1, 2], [2, 3]),
            ValueError,
            r"feature 'gamma': indices\[1\] = \[2, 0\] is outside the dense_shape \[2, 3\]",
        ),
    ],
)
def test_bad_tf_inputs_name_the_feature(path, value, exc, message):
    train = embedding.TPUEmbedding(_config_for_errors(), embedding.SGD(0.1), backend="reference")
    serve = embedding.TPUEmbeddingForServing(_config_for_errors(), backend="reference")
    features = dict(_features(), **{path: value})
    with pytest.raises(exc, match=message):
        train.enqueue(features)
    if path != "alpha" or exc is not ValueError or "Instead" not in message:  # serving: any shape
        with pytest.raises(exc, match=message):
            serve.embedding_lookup(features)


@pytest.mark.parametrize(
    "path, weight, message",
    [
        ("alpha", tf.constant([1.0, 2.0]), "Weight specified for dense input alpha"),
        (
            "beta",
            [[1.0, 2.0], [3.0]],
            "Weight for beta is type .*list.* which does not match type "
            "input which is RaggedTensor",
        ),
        (
            "beta",
            tf.ragged.constant([[1.0], [2.0, 3.0]]),
            "feature 'beta': the weights' row_splits differ",
        ),
        (
            "beta",
            tf.ragged.constant([["x", "y"], ["z"]]),
            "feature 'beta': weights must be numbers, got tf dtype string",
        ),
        (
            "gamma",
            tf.sparse.SparseTensor([[0, 1], [1, 1]], [1.0, 2.0], [2, 3]),
            "feature 'gamma': the weights' indices differ",
        ),
        (
            "gamma",
            tf.sparse.SparseTensor([[0, 0], [1, 1]], [1.0, 2.0], [2, 3]),
            "Weight specified for gamma, but this is a sequence feature",
        ),
    ],
)
def test_bad_tf_weights_name_the_feature(path, weight, message):
    emb = embedding.TPUEmbedding(_config_for_errors(), embedding.SGD(0.1), backend="reference")
    weights = {"alpha": None, "beta": None, "gamma": None, path: weight}
    with pytest.raises((TypeError, ValueError), match=message):
        emb.enqueue(_features(), weights=weights)


def test_numpy_input_with_tf_weights_is_refused():
    emb = embedding.TPUEmbedding(_config_for_errors(), embedding.SGD(0.1), backend="reference")
    features = dict(_features(), beta=[[1, 2], [3]])
    weights = {"alpha": None, "beta": tf.ragged.constant([[1.0, 2.0], [3.0]]), "gamma": None}
    with pytest.raises(ValueError, match="Weight for beta is type .*RaggedTensor.* which does not"):
        emb.enqueue(features, weights=weights)


def test_symbolic_tensors_are_refused_with_a_hint():
    emb = embedding.TPUEmbedding(_config_for_errors(), embedding.SGD(0.1), backend="reference")

    @tf.function
    def step(alpha):
        emb.enqueue(dict(_features(), alpha=alpha))

    with pytest.raises(TypeError, match="feature 'alpha': got a symbolic .*outside tf.function"):
        step(tf.constant([1, 2]))


def test_bad_tf_gradients_name_the_path():
    emb = embedding.TPUEmbedding(_config_for_errors(), embedding.SGD(0.1), backend="reference")
    emb.enqueue(_features())
    acts = emb.dequeue()
    grads = {k: tf.ones_like(v) for k, v in acts.items()}
    with pytest.raises(ValueError, match=r"Found gradient of shape \[2, 3\] at path beta"):
        emb.apply_gradients(dict(grads, beta=tf.ones((2, 3))))
    with pytest.raises(TypeError, match="found gradient of tf dtype string at path gamma"):
        emb.apply_gradients(dict(grads, gamma=tf.fill((2, 3, 2), "x")))
    emb.apply_gradients(grads)


# -- malformed TF values at each feature: a TypeError / ValueError naming it, nothing else ------

_np_values = hnp.arrays(
    st.sampled_from([np.int64, np.int32, np.uint64, np.int8, np.float32, np.bool_, "U2"]),
    hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3),
)
_int_lists = st.lists(st.lists(st.integers(-3, 40), max_size=4), max_size=4)


@st.composite
def _sparse(draw):
    rank = draw(st.integers(1, 3))
    shape = draw(st.lists(st.integers(0, 4), min_size=rank, max_size=rank))
    n = draw(st.integers(0, 4))
    idx = draw(hnp.arrays(np.int64, (n, rank), elements=st.integers(-1, 4)))
    vals = draw(
        hnp.arrays(
            st.sampled_from([np.int64, np.int32, np.float32]), (n,), elements=st.integers(-3, 40)
        )
    )
    return tf.sparse.SparseTensor(idx, vals, shape)


def _ragged_from(lists):
    return tf.ragged.constant(lists, tf.int64, ragged_rank=1)


MALFORMED_TF = st.one_of(
    _np_values.map(tf.constant),
    _int_lists.map(_ragged_from),
    st.lists(st.lists(st.floats(-2, 2, width=32), max_size=3), max_size=3).map(
        lambda x: tf.ragged.constant(x, tf.float32, ragged_rank=1)
    ),
    _sparse(),
)


def _clear_or_accepted(call, where: str) -> None:
    try:
        call()
    except (TypeError, ValueError) as e:
        assert where in str(e), f"{type(e).__name__} names no {where!r}: {e}"


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    path=st.sampled_from(["alpha", "beta", "gamma"]), value=MALFORMED_TF, as_weight=st.booleans()
)
def test_malformed_tf_values_name_the_feature(path, value, as_weight):
    emb = embedding.TPUEmbedding(_config_for_errors(), embedding.SGD(0.1), backend="reference")
    srv = embedding.TPUEmbeddingForServing(_config_for_errors(), backend="reference")
    if as_weight:
        weights = {"alpha": None, "beta": None, "gamma": None, path: value}
        _clear_or_accepted(lambda: emb.enqueue(_features(), weights=weights), path)
    else:
        features = dict(_features(), **{path: value})
        _clear_or_accepted(lambda: emb.enqueue(features), path)
        _clear_or_accepted(lambda: srv.embedding_lookup(features), path)


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (np.uint64(2**63), "ids=9223372036854775808"),  # a scalar (hypothesis found it)
        (np.array([[1, 2], [3, 2**63 + 5]], np.uint64), "ids[1][1]=9223372036854775813"),
    ],
)
def test_a_uint64_id_past_int64_is_named_by_its_position(value, said):
    """A uint64 id that does not fit int64, in a scalar or an N-d tensor: a ValueError
    naming the feature, the position and the value (it was an IndexError: the flat position
    taken as the first axis's)."""
    emb = embedding.TPUEmbedding(_config_for_errors(), embedding.SGD(0.1), backend="reference")
    features = dict(_features(), alpha=tf.constant(value))
    with pytest.raises(ValueError, match=re.escape(f"feature 'alpha': {said} does not fit")):
        emb.enqueue(features)


def test_the_documented_flow_with_a_keras_model():
    # docs/tensorflow.md's loop: embeddings and a dense model trained from one tape.
    table = embedding.TableConfig(vocabulary_size=30, dim=4, combiner="mean")
    feature_config = {
        "watched": embedding.FeatureConfig(table),
        "history": embedding.FeatureConfig(table, max_sequence_length=3),
    }
    emb = embedding.TPUEmbedding(feature_config, embedding.Adagrad(learning_rate=0.1))
    dense = tf.keras.layers.Dense(1)
    model_optimizer = tf.keras.optimizers.SGD(0.1)

    def model(acts):
        pooled = tf.concat([acts["watched"], tf.reduce_sum(acts["history"], axis=1)], axis=1)
        return dense(pooled)[:, 0]

    history = tf.constant([[7, 8, 0], [9, 0, 0], [10, 11, 12]])
    features = {
        "watched": tf.ragged.constant([[1, 2], [3], [4, 5, 6]]),
        "history": tf.sparse.from_dense(history),
    }
    labels = tf.constant([1.0, 0.0, 1.0])
    before = emb.embedding_tables[table].copy()
    losses = []
    for _ in range(5):
        emb.enqueue(features, training=True)
        with tf.GradientTape() as tape:
            activations = emb.dequeue()
            loss = tf.reduce_mean(tf.square(model(activations) - labels))
        embedding_grads, model_grads = tape.gradient(loss, (activations, dense.trainable_variables))
        emb.apply_gradients(embedding_grads)
        model_optimizer.apply_gradients(zip(model_grads, dense.trainable_variables, strict=True))
        losses.append(float(loss))
    moved = np.abs(emb.embedding_tables[table] - before).max(axis=1) > 0
    # tf.sparse.from_dense drops the zeros: id 0 is never looked up.
    np.testing.assert_array_equal(np.flatnonzero(moved), np.arange(1, 13))
    assert losses[-1] < losses[0]


def test_seeded_keras_initializers_give_tfs_table_past_one_chunk():
    """A seeded Keras initializer on a table larger than 2^22 values gives TF's own table (it
    is called once for the whole table, as TF calls it); chunked calls repeated its values
    every 65,536 rows."""
    v, d = 70_000, 64
    for make in (
        lambda: tf.keras.initializers.TruncatedNormal(seed=7),
        lambda: tf.keras.initializers.RandomUniform(seed=7),
    ):
        t = embedding.TableConfig(v, d, initializer=make(), name="t")
        serving = embedding.TPUEmbeddingForServing({"f": embedding.FeatureConfig(t)}, None)
        serving.build()
        want = make()((v, d), tf.float32).numpy()
        np.testing.assert_array_equal(serving.engine.embedding_tables["t"], want)


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("combiner", ["mean", "sqrtn", "sum"])
def test_serving_drops_non_positive_sparse_weights_as_tf_does(combiner, validate):
    """TF's serving lookup of a weighted SparseTensor is safe_embedding_lookup_sparse (unless
    validate_weights_and_indices=False, for rank 2), which drops the entries of weight <= 0
    under mean and sqrtn (not sum); embengine combined them, so a bag with a weight < 0 came
    out different."""
    t = embedding.TableConfig(
        10, 2, combiner=combiner, name="t", initializer=ee.initializers.RandomUniform(-1.0, 1.0)
    )
    feature = dict(validate_weights_and_indices=validate)
    config = {
        "s": embedding.FeatureConfig(t, **feature),
        "s3": embedding.FeatureConfig(t, **feature),
    }
    serving = embedding.TPUEmbeddingForServing(config)
    serving.build()
    idx = [[0, 0], [0, 1], [1, 0], [1, 1], [2, 0], [3, 0]]
    inputs = {
        "s": tf.sparse.SparseTensor(idx, tf.constant([1, 2, 3, 4, 5, 6], tf.int64), [4, 2]),
        # rank 3: TF's serving is safe_embedding_lookup_sparse whatever the flag says
        "s3": tf.sparse.SparseTensor([[0, 0, 0], [0, 0, 1], [0, 1, 0]], [7, 8, 9], [1, 2, 2]),
    }
    weights = {
        "s": tf.sparse.SparseTensor(idx, [1.0, -0.5, 2.0, 0.0, 0.7, 1.5], [4, 2]),
        "s3": tf.sparse.SparseTensor(inputs["s3"].indices, [2.0, -1.0, 0.0], [1, 2, 2]),
    }
    tf_table = tf.tpu.experimental.embedding.TableConfig(10, 2, combiner=combiner, name="t")
    tf_config = {
        k: tf.tpu.experimental.embedding.FeatureConfig(tf_table, **feature) for k in config
    }
    theirs = tf.tpu.experimental.embedding.serving_embedding_lookup(
        inputs, weights, {tf_table: tf.Variable(serving.engine.embedding_tables["t"])}, tf_config
    )
    ours = serving.embedding_lookup(inputs, weights)
    for k in config:
        assert ours[k].shape == theirs[k].shape, k
        np.testing.assert_allclose(ours[k].numpy(), theirs[k].numpy(), rtol=1e-6, atol=1e-7)


def test_serving_quantizes_where_tfs_cpu_serving_does_not():
    """docs/tensorflow.md's difference: TF's serving lookup ignores a table's
    quantization_config; embengine serves what its training lookups saw."""
    q = embedding.QuantizationConfig(num_buckets=5, lower=-1.0, upper=1.0)  # levels every 0.5
    t = embedding.TableConfig(
        4,
        2,
        initializer=ee.initializers.Constant(0.3),
        combiner="sum",
        name="t",
        quantization_config=q,
    )
    serving = embedding.TPUEmbeddingForServing({"f": embedding.FeatureConfig(t)})
    serving.build()
    ours = serving.embedding_lookup({"f": tf.ragged.constant([[1, 2]])})["f"]
    tf_q = tf.tpu.experimental.embedding.QuantizationConfig(num_buckets=5, lower=-1.0, upper=1.0)
    tf_t = tf.tpu.experimental.embedding.TableConfig(
        4, 2, combiner="sum", name="t", quantization_config=tf_q
    )
    theirs = tf.tpu.experimental.embedding.serving_embedding_lookup(
        {"f": tf.ragged.constant([[1, 2]])},
        None,
        {tf_t: tf.Variable(serving.engine.embedding_tables["t"])},
        {"f": tf.tpu.experimental.embedding.FeatureConfig(tf_t)},
    )["f"]
    np.testing.assert_allclose(ours.numpy(), [[1.0, 1.0]])  # 0.3 -> 0.5, twice
    np.testing.assert_allclose(theirs.numpy(), [[0.6, 0.6]], rtol=1e-6)
