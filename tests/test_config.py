"""Spec validation: TF's names, defaults and checks, with errors naming the bad value."""

import math

import numpy as np
import pytest

import embengine as ee
from embengine import initializers as init
from embengine import optimizers as opt


def test_defaults_follow_tf():
    t = ee.TableConfig(10, 16)
    assert t.combiner == "mean" and t.initializer is None and t.optimizer is None
    default = t.effective_initializer
    assert isinstance(default, init.TruncatedNormal) and default.stddev is None
    assert opt.SGD().learning_rate == 0.01
    a = opt.Adagrad()
    assert (a.learning_rate, a.initial_accumulator_value) == (0.001, 0.1)
    adam = opt.Adam()
    assert (adam.beta_1, adam.beta_2, adam.epsilon, adam.lazy_adam, adam.sum_inside_sqrt) == (
        0.9,
        0.999,
        1e-07,
        True,
        True,
    )
    f = opt.FTRL()
    assert (f.learning_rate_power, f.initial_accumulator_value, f.beta) == (-0.5, 0.1, 0.0)
    assert opt.Adagrad(0.5, 0.2).initial_accumulator_value == 0.2  # TF's positional order


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ee.TableConfig(0, 4), "vocabulary_size must be an int >= 1, got 0"),
        (lambda: ee.TableConfig(10, 2.5), "dim must be an int in \\[1, 65,536\\], got 2.5"),
        (
            lambda: ee.TableConfig(None, 2**16 + 1),
            "dim must be an int in \\[1, 65,536\\], got 65537",
        ),
        (lambda: ee.TableConfig(10, 4, combiner="max"), "combiner must be one of"),
        (
            lambda: ee.FeatureConfig(ee.TableConfig(3, 1), max_sequence_length=-1),
            "max_sequence_length must be an int >= 0, got -1",
        ),
        (  # every lookup pads to it: numpy's MemoryError (OverflowError past int64) before
            lambda: ee.FeatureConfig(ee.TableConfig(3, 1, name="t"), max_sequence_length=2**40),
            "of table 't': max_sequence_length=1,099,511,627,776 is more than 16,777,216",
        ),
        (
            lambda: ee.FeatureConfig(ee.TableConfig(3, 1), max_sequence_length=2**24 + 1, name="s"),
            r"FeatureConfig\(name='s'\): max_sequence_length=16,777,217 is more than",
        ),
        (  # numpy refused the activation's reshape at every lookup
            lambda: ee.FeatureConfig(ee.TableConfig(3, 1, name="t"), output_shape=[1] * 64),
            r"of table 't': output_shape has 64 dims; .* so output_shape at most \d+",
        ),
        (
            lambda: ee.FeatureConfig(ee.TableConfig(3, 1), output_shape=[2, -1]),
            "output_shape must be a non-empty sequence of ints >= 0",
        ),
        (lambda: opt.SGD(clipvalue=-1.0), "a scalar clipvalue must be > 0, got -1.0"),
        (lambda: opt.SGD(clipvalue=(1.0, -1.0)), "clipvalue min 1.0 must be <= max -1.0"),
        (
            lambda: opt.SGD(clipvalue=1.0, use_gradient_accumulation=False),
            "clipvalue=1.0 needs use_gradient_accumulation=True",
        ),
        (
            lambda: opt.SGD(clip_weight_min=1.0, clip_weight_max=0.0),
            "clip_weight_min=1.0 must be <= clip_weight_max=0.0",
        ),
        (lambda: opt.SGD(weight_decay_factor=-0.1), "weight_decay_factor must be a finite"),
        (
            lambda: opt.SGD(multiply_weight_decay_factor_by_learning_rate=True),
            "needs weight_decay_factor to be set",
        ),
        (lambda: opt.SGD(weight_decay_mode="l1"), "weight_decay_mode must be 'decoupled' or 'l2'"),
        (
            lambda: opt.Adagrad(initial_accumulator_value=0.0),
            "initial_accumulator_value must be a finite number > 0, got 0.0",
        ),
        (lambda: opt.Adam(beta_1=1.0), r"beta_1 must be in \[0, 1\), got 1.0"),
        (lambda: opt.Adam(beta_2=-0.1), r"beta_2 must be in \[0, 1\), got -0.1"),
        (lambda: opt.Adam(epsilon=0.0), "epsilon must be a finite number > 0, got 0.0"),
        (
            lambda: opt.Adam(lazy_adam=False, use_gradient_accumulation=False),
            "lazy_adam=False .* needs use_gradient_accumulation=True",
        ),
        (
            lambda: opt.FTRL(learning_rate_power=0.5),
            "learning_rate_power must be a finite number <= 0, got 0.5",
        ),
        (lambda: opt.FTRL(l1_regularization_strength=-1.0), "l1_regularization_strength must be"),
        (lambda: opt.FTRL(initial_accumulator_value=0.0), "initial_accumulator_value must be > 0"),
        (lambda: init.RandomUniform(1.0, 0.0), "minval=1.0 must not exceed maxval=0.0"),
        (lambda: init.Constant(math.nan), "value must be finite"),
    ],
)
def test_bad_specs(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    "buckets, lower, upper",
    [(4, -1e308, 1e308), (2, -1.7e308, 1.7e308), (3, 0.0, 1e-320), (2**62, 0.0, 1e-300)],
)
def test_quantization_steps_must_be_normal_float64_numbers(buckets, lower, upper):
    """A step (upper - lower) / (num_buckets - 1) of Inf (finite bounds 2e308 apart) made every
    quantized lookup NaN on both backends, and a subnormal one Inf and NaN on numba (zeros on
    the reference); an export's manifest carrying one was served so."""
    with pytest.raises(ValueError, match=r"QuantizationConfig: the step \(upper - lower\) / "):
        ee.QuantizationConfig(buckets, lower, upper)


def test_type_errors():
    with pytest.raises(TypeError, match="initializer must be an embengine.initializers"):
        ee.TableConfig(3, 1, initializer=lambda shape: None)
    with pytest.raises(TypeError, match="optimizer must be an embengine.optimizers.Optimizer"):
        ee.TableConfig(3, 1, optimizer="sgd")
    with pytest.raises(TypeError, match="table must be a TableConfig"):
        ee.FeatureConfig("t")
    with pytest.raises(TypeError, match="use_gradient_accumulation must be a bool"):
        opt.SGD(use_gradient_accumulation="yes")


def test_numpy_numbers_are_numbers_for_every_spec():
    """One vocabulary (optimizers/_checks.py): NumPy scalars pass and fail the same checks as
    Python's, whichever spec reads them."""
    f32 = np.float32
    assert opt.FTRL(learning_rate_power=f32(-0.5)).row_math(4).name == "ftrl_sqrt"
    assert opt.FTRL(initial_accumulator_value=f32(0.2))
    assert opt.Adam(beta_1=f32(0.8), beta_2=f32(0.99))
    assert opt.Adagrad(hessian_compression_times=np.int64(2))
    with pytest.raises(ValueError, match=r"learning_rate \(alpha\) must be in \[0, 1\], got"):
        opt.BatchSoftmax(f32(2.0))
    with pytest.raises(ValueError, match="hessian_compression_times must be an int >= 1"):
        opt.Adagrad(hessian_compression_times=np.float32(2.0))


def test_numpy_scalars_and_bools_alike_in_the_tpu_and_monolith_ports():
    """The ports' specs read ints and flags as the core does (optimizers/_checks.py): a NumPy
    int is an int, a bool is not, a NumPy bool is a flag."""
    from embengine import monolith as mono
    from embengine import tpu

    t = tpu.TableConfig(np.int64(5), np.int32(2))
    assert (t.vocabulary_size, t.dim) == (5, 2) and type(t.vocabulary_size) is int
    f = tpu.FeatureConfig(t, np.int64(3), np.bool_(False))
    assert (f.max_sequence_length, f.validate_weights_and_indices) == (3, False)
    for make in (
        lambda: tpu.TableConfig(True, 2),
        lambda: tpu.TableConfig(5, True),
        lambda: tpu.FeatureConfig(t, max_sequence_length=True),
    ):
        with pytest.raises(ValueError, match="must be an int and must be >= "):
            make()
    with pytest.raises(ValueError, match="must be a boolean. Received: 1"):
        tpu.FeatureConfig(t, validate_weights_and_indices=1)
    assert tpu.FeatureConfig(t, max_sequence_length=2**24).max_sequence_length == 2**24
    with pytest.raises(ValueError, match=r"must be at most 16777216.*Received: 1099511627776"):
        tpu.FeatureConfig(t, max_sequence_length=2**40)
    with pytest.raises(ValueError, match=r"`output_shape` must have at most \d+ sizes"):
        tpu.FeatureConfig(t, output_shape=[1] * 64)
    warm = mono.AdagradOptimizer(learning_rate=0.01, warmup_steps=np.int64(4)).learning_rate
    assert warm(2) == pytest.approx(0.01 * 2 / 4)
    with pytest.raises(ValueError, match="warmup_steps must be an int >= 0, got True"):
        mono.AdagradOptimizer(warmup_steps=True)
    with pytest.raises(TypeError, match="DynamicLearningRate: tag must be an int, got True"):
        opt.DynamicLearningRate(True)
    assert opt.DynamicLearningRate(np.int64(1)).tag == 1


def test_ftrl_allows_zero_accumulator_only_when_asked():
    assert opt.FTRL(initial_accumulator_value=0.0, allow_zero_accumulator=True)


def test_specs_are_frozen():
    t = ee.TableConfig(3, 1)
    with pytest.raises(AttributeError):
        t.dim = 4
    with pytest.raises(AttributeError):
        opt.SGD().learning_rate = 1.0


def test_feature_name_must_match_dict_key():
    t = ee.TableConfig(3, 1)
    with pytest.raises(ValueError, match="its FeatureConfig is named 'b'"):
        ee.EmbeddingEngine({"a": ee.FeatureConfig(t, name="b")}, optimizer=opt.SGD())


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_an_output_shape_of_the_most_dims_numpy_holds_looks_up(backend):
    t = ee.TableConfig(10, 2, name="t", optimizer=opt.SGD(learning_rate=0.1))
    most = ee.config.MAX_NDIM - 1  # NumPy's dims but one (the activation's dim)
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t, output_shape=[1] * most)}, backend=backend)
    assert eng.lookup({"f": [[1]]})["f"].shape == (1,) * most + (2,)
