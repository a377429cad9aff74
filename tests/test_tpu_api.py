"""embengine.tpu: the tf.tpu.experimental.embedding API, names, shapes and checks."""

import dataclasses
import inspect
import logging

import numpy as np
import pytest

import embengine as ee
import embengine.tpu as embedding  # the only line that differs from TF code


def test_tf_docs_example_per_table_optimizer():
    # From the docs of tf.tpu.experimental.embedding.SGD: table one overrides the global SGD.
    table_one = embedding.TableConfig(
        vocabulary_size=16,
        dim=4,
        optimizer=embedding.SGD(0.2),
        initializer=embedding.RowIdInitializer(),
    )
    table_two = embedding.TableConfig(
        vocabulary_size=16, dim=4, initializer=embedding.RowIdInitializer()
    )
    feature_config = (
        embedding.FeatureConfig(table=table_one),
        embedding.FeatureConfig(table=table_two),
    )
    emb = embedding.TPUEmbedding(feature_config=feature_config, optimizer=embedding.SGD(0.1))
    before = {t: w.copy() for t, w in emb.embedding_tables.items()}
    emb.enqueue((np.array([3, 5]), np.array([3, 5])), training=True)
    activations = emb.dequeue()
    assert isinstance(activations, tuple) and [a.shape for a in activations] == [(2, 4), (2, 4)]
    emb.apply_gradients(tuple(np.ones_like(a) for a in activations))
    moved_one = before[table_one] - emb.embedding_tables[table_one]
    moved_two = before[table_two] - emb.embedding_tables[table_two]
    np.testing.assert_allclose(moved_one[[3, 5]], 0.2, rtol=1e-5)
    np.testing.assert_allclose(moved_two[[3, 5]], 0.1, rtol=1e-5)
    np.testing.assert_allclose(moved_one, 2 * moved_two, atol=1e-6)  # twice as far
    # TF fills in the global optimizer and the default names.
    assert table_two.optimizer.learning_rate == 0.1
    assert (table_one.name, table_two.name) == ("table_0", "table_1")


def test_nested_structure_is_kept_and_dicts_are_sorted():
    t_a = embedding.TableConfig(10, 2, initializer=embedding.RowIdInitializer())
    t_b = embedding.TableConfig(10, 3, initializer=embedding.RowIdInitializer())
    config = {
        "z": embedding.FeatureConfig(t_a),
        "a": [embedding.FeatureConfig(t_b), {"k": embedding.FeatureConfig(t_a)}],
    }
    emb = embedding.TPUEmbedding(config, embedding.Adagrad(0.1))
    # tf.nest order: "a" before "z", so t_b is table_0.
    assert (t_b.name, t_a.name) == ("table_0", "table_1")
    emb.enqueue({"z": np.array([1, 2]), "a": [np.array([3, 4]), {"k": [[5, 6], [7]]}]})
    out = emb.dequeue()
    assert set(out) == {"z", "a"} and isinstance(out["a"], list) and set(out["a"][1]) == {"k"}
    np.testing.assert_allclose(out["z"][:, 0], [1, 2])
    np.testing.assert_allclose(out["a"][0][:, 0], [3, 4])
    np.testing.assert_allclose(out["a"][1]["k"][:, 0], [5.5, 7])  # mean combiner
    grads = {"z": np.ones((2, 2)), "a": [None, {"k": np.ones((2, 2))}]}
    emb.apply_gradients(grads)
    with pytest.raises(ValueError, match="does not match the feature config at a/1: expected keys"):
        emb.enqueue({"z": np.array([1, 2]), "a": [np.array([3, 4]), {"j": [[5]]}]})


def test_input_shapes_follow_tf_rules():
    t = embedding.TableConfig(20, 2, initializer=embedding.RowIdInitializer(), combiner="sum")
    config = {
        "dense1": embedding.FeatureConfig(t),
        "dense2": embedding.FeatureConfig(t),
        "dense3": embedding.FeatureConfig(t),
        "bag": embedding.FeatureConfig(t),
        "seq": embedding.FeatureConfig(t, max_sequence_length=3),
        "shaped": embedding.FeatureConfig(t, output_shape=[2, 2]),
        "shaped_seq": embedding.FeatureConfig(t, output_shape=[2, 3]),
    }
    emb = embedding.TPUEmbedding(config, embedding.SGD(0.1))
    emb.enqueue(
        {
            "dense1": np.array([1, 2]),
            "dense2": np.array([[1], [2]]),
            "dense3": np.array([[[1], [2], [3]], [[4], [5], [6]]]),
            "bag": ee.Ragged([1, 2, 3], lengths=[2, 1]),
            "seq": [[1, 2, 3, 4], [5]],
            "shaped": [[1], [2, 3], [], [4]],
            "shaped_seq": [[1, 2, 3, 4], [5]],
        }
    )
    out = emb.dequeue()
    shapes = {k: v.shape for k, v in out.items()}
    assert shapes == {
        "dense1": (2, 2),
        "dense2": (2, 2),
        "dense3": (2, 3, 2),
        "bag": (2, 2),
        "seq": (2, 3, 2),
        "shaped": (2, 2, 2),
        "shaped_seq": (2, 3, 2),
    }
    np.testing.assert_array_equal(out["dense3"][..., 0], [[1, 2, 3], [4, 5, 6]])
    np.testing.assert_array_equal(out["bag"][:, 0], [3, 3])
    np.testing.assert_array_equal(out["seq"][..., 0], [[1, 2, 3], [5, 0, 0]])
    np.testing.assert_array_equal(out["shaped"][..., 0], [[1, 5], [0, 4]])
    np.testing.assert_array_equal(out["shaped_seq"][..., 0], [[1, 2, 3], [5, 0, 0]])


@pytest.mark.parametrize(
    "features, message",
    [
        ({"f": np.array([[1, 2], [3, 4]])}, "should have last dimension as 1"),
        ({"f": np.array(3)}, "Only rank 1 and above dense tensor is supported"),
        ({"g": [[1]]}, "does not match the feature config"),
    ],
)
def test_bad_inputs(features, message):
    t = embedding.TableConfig(10, 2)
    emb = embedding.TPUEmbedding({"f": embedding.FeatureConfig(t)}, embedding.SGD(0.1))
    with pytest.raises(ValueError, match=message):
        emb.enqueue(features)


def test_weights_rules():
    t = embedding.TableConfig(10, 1, initializer=embedding.RowIdInitializer(), combiner="sum")
    config = {"bag": embedding.FeatureConfig(t), "seq": embedding.FeatureConfig(t, 2)}
    emb = embedding.TPUEmbedding(config, embedding.SGD(0.1))
    emb.enqueue({"bag": [[1, 2]], "seq": [[3]]}, weights={"bag": [[2.0, 0.5]], "seq": None})
    np.testing.assert_allclose(emb.dequeue()["bag"], [[3.0]])
    with pytest.raises(ValueError, match="Weight specified for seq, but this is a sequence"):
        emb.enqueue({"bag": [[1]], "seq": [[3]]}, weights={"bag": None, "seq": [[1.0]]})
    with pytest.raises(ValueError, match="Weight specified for dense input bag"):
        emb.enqueue({"bag": np.array([1]), "seq": [[3]]}, weights={"bag": np.ones(1), "seq": None})


def test_output_shape_must_divide_the_batch():
    t = embedding.TableConfig(10, 2)
    emb = embedding.TPUEmbedding(
        {"f": embedding.FeatureConfig(t, output_shape=[5])}, embedding.SGD(0.1)
    )
    with pytest.raises(ValueError, match="should be the factor of the input data batch size"):
        emb.enqueue({"f": [[1], [2]]})


def test_inconsistent_shapes_and_build():
    t = embedding.TableConfig(10, 2)
    emb = embedding.TPUEmbedding(
        {"f": embedding.FeatureConfig(t, max_sequence_length=4)}, embedding.SGD(0.1)
    )
    emb.build(per_replica_batch_size=3)
    emb.enqueue({"f": [[1], [2], [3]]})
    assert emb.dequeue()["f"].shape == (3, 4, 2)
    with pytest.raises(ValueError, match=r"Inconsistent shape founded for input feature f"):
        emb.enqueue({"f": [[1], [2]]})


def test_none_gradient_is_zero_with_a_warning(caplog):
    t = embedding.TableConfig(10, 2)
    emb = embedding.TPUEmbedding(
        {"a": embedding.FeatureConfig(t), "b": embedding.FeatureConfig(t)}, embedding.SGD(0.5)
    )
    before = emb.embedding_tables[t].copy()
    emb.enqueue({"a": np.array([1]), "b": np.array([2])})
    with caplog.at_level(logging.WARNING, logger="embengine.tpu"):
        emb.apply_gradients({"a": np.ones((1, 2)), "b": None})
    assert "No gradient passed for feature b, sending zero gradient" in caplog.text
    after = emb.embedding_tables[t]
    np.testing.assert_allclose(after[1], before[1] - 0.5)
    np.testing.assert_array_equal(after[2], before[2])


def test_gradient_checks_and_order_of_calls():
    t = embedding.TableConfig(10, 2)
    emb = embedding.TPUEmbedding({"a": embedding.FeatureConfig(t)}, embedding.SGD(0.5))
    with pytest.raises(RuntimeError, match="dequeue called before enqueue"):
        emb.dequeue()
    emb.enqueue({"a": np.array([1, 2])})
    with pytest.raises(ValueError, match=r"Found gradient of shape \[2, 3\] at path a"):
        emb.apply_gradients({"a": np.ones((2, 3))})
    with pytest.raises(ValueError, match="found non-tensor type"):
        emb.apply_gradients({"a": "grad"})
    emb.enqueue({"a": np.array([1, 2])}, training=False)
    with pytest.raises(RuntimeError, match="training=False"):
        emb.apply_gradients({"a": np.ones((2, 2))})


def test_dynamic_learning_rate_callable():
    lr = {"value": 0.5}
    t = embedding.TableConfig(10, 1, initializer=embedding.RowIdInitializer())
    emb = embedding.TPUEmbedding(
        {"a": embedding.FeatureConfig(t)}, embedding.SGD(learning_rate=lambda: lr["value"])
    )
    for value in (0.5, 0.25):
        lr["value"] = value
        emb.enqueue({"a": np.array([4])})
        emb.apply_gradients({"a": np.ones((1, 1))})
    np.testing.assert_allclose(emb.embedding_tables[t][4], [4 - 0.75])


def test_quantization_is_forward_only():
    q = embedding.QuantizationConfig(num_buckets=5, lower=-1.0, upper=1.0)  # levels every 0.5
    t = embedding.TableConfig(
        4, 3, initializer=ee.initializers.Constant(0.3), quantization_config=q, combiner="sum"
    )
    emb = embedding.TPUEmbedding({"a": embedding.FeatureConfig(t)}, embedding.SGD(0.1))
    emb.enqueue({"a": [[1, 1, 2]]}, training=False)  # lookup-only path, quantized as well
    np.testing.assert_allclose(emb.dequeue()["a"], [[1.5, 1.5, 1.5]])
    with pytest.raises(RuntimeError, match="training=False"):
        emb.apply_gradients({"a": np.ones((1, 3))})
    emb.enqueue({"a": [[1, 1, 2]]})
    np.testing.assert_allclose(emb.dequeue()["a"], [[1.5, 1.5, 1.5]])  # 0.3 -> 0.5, three times
    emb.apply_gradients({"a": np.ones((1, 3))})
    np.testing.assert_allclose(emb.embedding_tables[t][[1, 2]], [[0.1] * 3, [0.2] * 3], rtol=1e-6)
    with pytest.raises(ValueError, match="num_buckets must be an int >= 2"):
        embedding.QuantizationConfig(1, 0.0, 1.0)


def test_optimizer_signatures_are_tfs():
    adam = embedding.Adam(0.1, 0.8, 0.9, 1e-3, False, False, True)
    assert (adam.beta_1, adam.beta_2, adam.epsilon, adam.lazy_adam, adam.sum_inside_sqrt) == (
        0.8,
        0.9,
        1e-3,
        False,
        False,
    )
    ftrl = embedding.FTRL(0.1, -0.3, 0.01, 0.02, 0.5, 0.2)
    assert (
        ftrl.learning_rate_power,
        ftrl.l1_regularization_strength,
        ftrl.l2_regularization_strength,
        ftrl.beta,
        ftrl.initial_accumulator_value,
    ) == (-0.3, 0.01, 0.02, 0.5, 0.2)
    am = embedding.AdagradMomentum(0.1, 0.9, True, 3, 0.99, 1e-5)
    assert (am.momentum, am.use_nesterov, am.exponent, am.beta2, am.epsilon) == (
        0.9,
        True,
        3,
        0.99,
        1e-5,
    )
    assert isinstance(embedding.Adagrad(), ee.optimizers.Adagrad)
    with pytest.raises(ValueError, match="slot_variable_creation_fn is not supported"):
        embedding.Adagrad(slot_variable_creation_fn=lambda *a: None)
    with pytest.raises(ValueError, match="When disabling lazy|lazy_adam=False"):
        embedding.Adam(lazy_adam=False, use_gradient_accumulation=False)


TPU_OPTIMIZERS = [
    embedding.SGD,
    embedding.Adagrad,
    embedding.AdagradMomentum,
    embedding.Adam,
    embedding.FTRL,
]

# Common knobs, each bad in one way: the error every class must raise, word for word its
# embengine base's.
BAD_COMMON_ARGUMENTS = [
    ({"use_gradient_accumulation": "yes"}, TypeError),
    ({"low_dimensional_packing_status": 1}, TypeError),
    ({"clip_weight_min": 1.0, "clip_weight_max": 0.0}, ValueError),
    ({"clip_weight_min": float("inf")}, ValueError),
    ({"weight_decay_factor": -1.0}, ValueError),
    ({"multiply_weight_decay_factor_by_learning_rate": True}, ValueError),
    ({"clipvalue": -1.0}, ValueError),
    ({"clipvalue": 1.0, "use_gradient_accumulation": False}, ValueError),
]


@pytest.mark.parametrize("cls", TPU_OPTIMIZERS, ids=lambda c: c.__name__)
def test_common_arguments_are_checked_alike_in_every_class(cls):
    """The five TPU classes pass the common knobs to their base by name: the same value is
    refused with the base's message (naming the class), and accepted values reach the same
    fields, in every class."""
    base = cls.__mro__[1]
    for kwargs, error in BAD_COMMON_ARGUMENTS:
        with pytest.raises(error) as expected:
            base(**kwargs)
        with pytest.raises(error) as got:
            cls(**kwargs)
        assert str(got.value) == str(expected.value)
        assert str(got.value).startswith(f"{cls.__name__}: ")
    good = dict(
        use_gradient_accumulation=True,
        clip_weight_min=-2.0,
        clip_weight_max=3.0,
        weight_decay_factor=0.5,
        multiply_weight_decay_factor_by_learning_rate=True,
        clipvalue=(None, 4.0),
        low_dimensional_packing_status=True,
    )
    assert cls(**good).hyperparameters() == base(**good).hyperparameters()
    # every TF argument is a field of the base (some base fields, like weight_decay_mode, are
    # not TF's and keep their defaults)
    params = set(inspect.signature(cls).parameters)
    assert params - {"slot_variable_creation_fn"} <= {f.name for f in dataclasses.fields(base)}
    if "slot_variable_creation_fn" in params:
        with pytest.raises(ValueError, match=f"^{cls.__name__}: slot_variable_creation_fn"):
            cls(slot_variable_creation_fn=lambda *a: None)


def test_table_and_feature_checks():
    with pytest.raises(ValueError, match="Argument `vocabulary_size` must be an int"):
        embedding.TableConfig(0, 2)
    with pytest.raises(ValueError, match="Argument `combiner` must be one of"):
        embedding.TableConfig(5, 2, combiner="max")
    with pytest.raises(ValueError, match="Argument `table` has invalid type"):
        embedding.FeatureConfig("t")
    t1 = embedding.TableConfig(5, 2, name="same")
    t2 = embedding.TableConfig(5, 2, name="same")
    with pytest.raises(ValueError, match="Tables must have a unique name"):
        embedding.TPUEmbedding(
            [embedding.FeatureConfig(t1), embedding.FeatureConfig(t2)], embedding.SGD()
        )
    with pytest.raises(ValueError, match="unsupported optimizer class"):
        embedding.TPUEmbedding([embedding.FeatureConfig(embedding.TableConfig(5, 2))], None)


def test_serving_lookup_shapes():
    t = embedding.TableConfig(10, 2, initializer=embedding.RowIdInitializer())
    config = {"d": embedding.FeatureConfig(t), "s": embedding.FeatureConfig(t, 2)}
    serving = embedding.TPUEmbeddingForServing(config)
    out = serving({"d": np.array([[1], [2]]), "s": [[3, 4, 5]]})
    assert out["d"].shape == (2, 1, 2)  # TF's CPU serving keeps the dense input's shape
    np.testing.assert_array_equal(out["s"][..., 0], [[3, 4]])
    with pytest.raises(ValueError, match="Feature s is a sequence feature but a dense tensor"):
        serving({"d": np.array([1]), "s": np.array([3])})
    with pytest.raises(ValueError, match="Weight specified for d, but input is dense"):
        serving({"d": np.array([1]), "s": [[3]]}, weights={"d": np.ones(1), "s": None})


def test_table_dtype_float32_is_taken_and_unknown_output_sizes_named():
    """TF 2.21's ``TableConfig(dtype=)`` takes float32 (by any name) and refuses others by
    name; an ``output_shape`` with an unknown size is a ValueError naming the argument (it was
    int()'s bare TypeError)."""
    for dtype in ("float32", np.float32, np.dtype("float32")):
        assert embedding.TableConfig(10, 2, dtype=dtype).dim == 2
    with pytest.raises(ValueError, match="Argument `dtype` must be float32"):
        embedding.TableConfig(10, 2, dtype="float16")
    with pytest.raises(ValueError, match=r"Argument `output_shape` .* Received: \[None, 3\]"):
        embedding.FeatureConfig(embedding.TableConfig(10, 2), output_shape=[None, 3])


def test_pipeline_execution_with_tensor_core_is_checked_and_its_true_is_told(caplog):
    """TF's third argument was accepted whatever it was and ignored without a word; on a TPU
    True makes every lookup see the tables one step old, which embengine never does."""
    config = {"f": embedding.FeatureConfig(embedding.TableConfig(10, 2))}
    with pytest.raises(ValueError, match="`pipeline_execution_with_tensor_core` must be a bool"):
        embedding.TPUEmbedding(config, embedding.SGD(0.1), "yes")
    with caplog.at_level(logging.WARNING, logger="embengine.tpu"):
        embedding.TPUEmbedding(config, embedding.SGD(0.1), False)
    assert "pipeline_execution_with_tensor_core" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="embengine.tpu"):
        embedding.TPUEmbedding(config, embedding.SGD(0.1), pipeline_execution_with_tensor_core=True)
    assert "pipeline_execution_with_tensor_core=True is ignored" in caplog.text
