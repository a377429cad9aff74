"""Non-finite state from finite input (issue 19, item 11): never written.

Hyperparameters and learning rates are checked where they enter (construction; every step,
before any table changes). An update whose result overflows anyway (huge gradients times huge
per-id weights, a learning rate near the float32 limit) leaves each such row exactly as it was,
weights and slots, and reports it by the engine's policy: ``NonFiniteUpdateError`` after the step
("error") or a RuntimeWarning and ``nonfinite_rows_skipped`` ("skip_row"). Both backends leave
the same rows alone.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import embengine as ee
from embengine import initializers as I
from embengine import optimizers as O

# The library handles each float32 overflow here on purpose (a refusal naming the value, an inf
# activation, a row left alone): NumPy's "overflow encountered in cast" warning from one of its
# casts (FromFunction's values, the reference backend's pooled sums) is a test failure.
pytestmark = pytest.mark.filterwarnings("error:overflow encountered in cast:RuntimeWarning")

BACKENDS = ("reference", "numba")
BIG = 3e38  # finite float32, close to its largest value


def _state(eng: ee.EmbeddingEngine) -> dict:
    """Every table's weights and slots (copies) and the step."""
    out = {"step": eng.step}
    for name, arrays in eng.state_dict()["tables"].items():
        out[name] = {k: np.array(v) for k, v in arrays.items()}
    return out


def _all_finite(eng: ee.EmbeddingEngine) -> bool:
    return all(
        np.isfinite(v).all()
        for arrays in eng.state_dict()["tables"].values()
        for v in arrays.values()
        if v.dtype.kind == "f"
    )


def _same(a: dict, b: dict, table: str, rows=None) -> bool:
    for k in a[table]:
        x, y = a[table][k], b[table][k]
        if rows is not None:
            x, y = x[rows], y[rows]
        if x.tobytes() != y.tobytes():
            return False
    return True


# -- learning rates: validated per step, before any table changes --------------------------------


def _two_tables(backend: str, ftrl_lr) -> ee.EmbeddingEngine:
    """An SGD table and an FTRL table (updated first: tables go last to first)."""
    a = ee.TableConfig(10, 4, name="a", optimizer=O.SGD(0.1))
    b = ee.TableConfig(10, 4, name="b", optimizer=O.FTRL(ftrl_lr))
    return ee.EmbeddingEngine(
        {"fa": ee.FeatureConfig(a), "fb": ee.FeatureConfig(b)}, backend=backend
    )


def _step(eng, **kw):
    acts = eng.lookup({"fa": [[1, 2], [3]], "fb": [[1], [4, 5]]})
    eng.apply_gradients({k: np.full_like(v, 0.5) for k, v in acts.items()}, **kw)


def test_ftrl_learning_rate_zero_from_a_tag_is_refused_before_any_change(backend):
    eng = ee.EmbeddingEngine(
        {
            "fa": ee.FeatureConfig(
                ee.TableConfig(10, 4, name="a", optimizer=O.SGD(ee.DynamicLearningRate(0)))
            ),
            "fb": ee.FeatureConfig(
                ee.TableConfig(10, 4, name="b", optimizer=O.FTRL(ee.DynamicLearningRate(1)))
            ),
        },
        backend=backend,
    )
    _step(eng, learning_rates=[0.1, 0.1])
    before = _state(eng)
    with pytest.raises(ValueError, match=r"table 'b' \(learning-rate tag 1\), step 1: FTRL"):
        _step(eng, learning_rates=[0.1, 0.0])
    after = _state(eng)
    assert after["step"] == 1
    assert _same(before, after, "a") and _same(before, after, "b")
    assert _all_finite(eng)


def test_ftrl_schedule_touching_zero_is_refused_at_that_step(backend):
    eng = _two_tables(backend, lambda step: 0.1 if step < 2 else 0.0)
    _step(eng)
    _step(eng)
    before = _state(eng)
    with pytest.raises(ValueError, match=r"table 'b' .*step 2: FTRL divides by the learning"):
        _step(eng)
    assert _same(before, _state(eng), "a") and _same(before, _state(eng), "b")
    assert eng.step == 2


def test_ftrl_learning_rate_zero_is_allowed_when_the_linear_is_multiplied_by_it():
    O.FTRL(0.0, multiply_linear_by_learning_rate=True).check_learning_rate(0.0)
    with pytest.raises(ValueError, match="FTRL: learning_rate: FTRL divides"):
        O.FTRL(0.0)


@pytest.mark.parametrize("lr", [1e300, 3.5e38, math.inf])
def test_dynamic_learning_rates_beyond_float32_are_refused(backend, lr):
    t = ee.TableConfig(10, 4, name="a", optimizer=O.SGD(ee.DynamicLearningRate(0)))
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, backend=backend)
    acts = eng.lookup({"f": [[1]]})
    before = _state(eng)
    with pytest.raises(ValueError, match="learning"):
        eng.apply_gradients({"f": np.ones_like(acts["f"])}, learning_rates=[lr])
    assert _same(before, _state(eng), "a") and eng.step == 0


# -- hyperparameters: finite and within float32 range at construction ----------------------------


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: O.SGD(1e300), "learning_rate"),
        (lambda: O.SGD(0.1, weight_decay_factor=1e300), "weight_decay_factor"),
        (lambda: O.Adam(0.1, epsilon=1e300), "epsilon"),
        (lambda: O.Adagrad(0.1, initial_accumulator_value=1e39), "initial_accumulator_value"),
        (lambda: O.FTRL(0.1, beta=1e300), "beta"),
        (lambda: O.FTRL(0.1, l2_regularization_strength=1e300), "l2_regularization_strength"),
        (lambda: O.RMSProp(0.1, initial_ms_value=-1e300), "initial_ms_value"),
        (lambda: O.FrequencyEstimator(max_delta=1e300), "max_delta"),
        (lambda: O.SGD(0.1, clip_weight_min=1e300), "clip_weight_min"),
        (lambda: O.SGD(0.1, clip_weight_max=-1e39), "clip_weight_max"),
        (lambda: O.SGD(0.1, clip_weight_min=math.inf), "clip_weight_min"),
        (lambda: O.SGD(0.1, clip_weight_max=-math.inf), "clip_weight_max"),
        (lambda: O.Adagrad(0.1, clipvalue=(math.inf, None)), "clipvalue min"),
        (lambda: O.Adagrad(0.1, clipvalue=(None, -math.inf)), "clipvalue max"),
        (lambda: O.Adagrad(0.1, clipvalue=1e300), "clipvalue"),
    ],
)
def test_hyperparameters_beyond_float32_are_refused_naming_optimizer_and_field(make, field):
    with pytest.raises(ValueError) as info:
        make()
    message = str(info.value)
    assert field in message, message


def test_infinite_clip_bounds_on_their_open_side_mean_no_bound():
    """As an unset bound of the TPU proto's ClippingLimits: the same as None."""
    g = {"f": np.full((2, 4), 7.0, np.float32)}
    results = []
    for kw in (
        {},
        {
            "clip_weight_min": -math.inf,
            "clip_weight_max": math.inf,
            "clipvalue": (-math.inf, math.inf),
        },
    ):
        t = ee.TableConfig(10, 4, name="a", optimizer=O.Adagrad(0.5, **kw))
        eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, backend="reference")
        eng.lookup({"f": [[1], [2]]})
        eng.apply_gradients(g)
        results.append(_state(eng))
    assert _same(results[0], results[1], "a")


@pytest.mark.parametrize(
    "make",
    [
        lambda: I.Constant(1e300),
        lambda: I.Constant(-3.5e38),
        lambda: I.RandomUniform(-1e39, 0.0),
        lambda: I.TruncatedNormal(mean=3e38, stddev=1e38),
        lambda: I.RowId(offset=10**39),
    ],
)
def test_initializer_values_must_fit_float32(make):
    with pytest.raises(ValueError, match="float32 range"):
        make()


def test_a_from_function_initializer_returning_non_finite_values_is_refused():
    t = ee.TableConfig(
        10, 2, name="a", initializer=I.FromFunction(lambda shape, dtype: np.full(shape, 1e39))
    )
    with pytest.raises(ValueError, match="non-finite values .* for table 'a'"):
        ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=O.SGD(0.1))


def test_per_id_weights_beyond_float32_are_refused_at_validation():
    t = ee.TableConfig(10, 2, name="a", combiner="sum")
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=O.SGD(0.1))
    # named as given (it was "weight inf ... is not finite", after NumPy's overflow warning)
    with pytest.raises(ValueError, match=r"1e\+39 at weights\[0\] is past float32's range"):
        eng.lookup(
            {"f": ee.Ragged(np.array([1, 2]), lengths=[1, 1], weights=np.array([1e39, 1.0]))}
        )


# -- the per-row result guard ---------------------------------------------------------------------

# Optimizers whose update of a row overflows from a gradient of 3e38 times a per-id weight
# of 3e38 (float64 sums: finite, 9e76; the new float32 values: not).
GUARDED = {
    "sgd": lambda: O.SGD(0.5),
    "adagrad": lambda: O.Adagrad(0.5),
    "rowwise_adagrad": lambda: O.Adagrad(0.5, hessian_compression_times=4),
    "grouped_adagrad": lambda: O.Adagrad(0.5, hessian_compression_times=2),
    "adam": lambda: O.Adam(0.5),
    "adam_per_row": lambda: O.Adam(0.5, bias_correction="per_row"),
    "adam_not_lazy": lambda: O.Adam(0.5, lazy_adam=False),
    "ftrl": lambda: O.FTRL(0.5),
    "momentum": lambda: O.Momentum(0.5),
    "sgd_no_accumulation": lambda: O.SGD(0.5, use_gradient_accumulation=False),
    "sgd_decay": lambda: O.SGD(0.5, weight_decay_factor=0.5, weight_decay_mode="l2"),
}


def _guard_engine(name: str, backend: str, policy: str, dim: int) -> ee.EmbeddingEngine:
    t = ee.TableConfig(
        12, dim, name="t", combiner="sum", optimizer=GUARDED[name](), initializer=I.RowId(1)
    )
    return ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t)}, backend=backend, nonfinite_gradients=policy
    )


def _guard_step(eng, sign=1.0):
    """Rows 1 and 5 get a finite but overflowing contribution (3e38 * 3e38), rows 2, 3, 7
    ordinary ones; row 3 occurs twice."""
    ids = np.array([1, 2, 3, 5, 3, 7])
    weights = np.array([BIG, 1.0, 0.5, -BIG, 2.0, 1.0], np.float32)
    acts = eng.lookup({"f": ee.Ragged(ids, lengths=[1] * 6, weights=weights)})
    g = np.full_like(acts["f"], 0.25 * sign)
    g[0] = g[3] = BIG
    return g


def _apply(eng, g, policy):
    """apply_gradients under the policy: (error or None, warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            eng.apply_gradients({"f": g})
        except ee.NonFiniteUpdateError as e:
            return e, caught
    return None, caught


@pytest.mark.parametrize("policy", ["error", "skip_row"])
@pytest.mark.parametrize("name", sorted(GUARDED))
def test_overflowing_rows_are_left_unchanged_and_reported(name, policy):
    dim = 4
    states, errors, counts = {}, {}, {}
    for backend in BACKENDS:
        eng = _guard_engine(name, backend, policy, dim)
        g = _guard_step(eng)
        before = _state(eng)
        err, caught = _apply(eng, g, policy)
        after = _state(eng)
        assert _all_finite(eng), f"{backend}: a non-finite value was written"
        assert after["step"] == 1  # the step counts
        # Rows 1 and 5 exactly as before: weights and every slot (Adam's per-row count too).
        assert _same(before, after, "t", [1, 5]), f"{backend}: an overflowing row changed"
        # The ordinary rows were updated.
        assert not _same(before, after, "t", [2]), f"{backend}: row 2 was not updated"
        if policy == "error":
            assert isinstance(err, FloatingPointError)
            message = str(err)
            assert "table 't': 2 rows (ids 1, 5)" in message, message
            assert err.rows["t"].tolist() == [1, 5]
            assert eng.nonfinite_rows_skipped["t"] == 0
        else:
            assert err is None
            assert [
                w
                for w in caught
                if issubclass(w.category, RuntimeWarning)
                and "table 't': 2 rows (ids 1, 5)" in str(w.message)
            ]
            assert eng.nonfinite_rows_skipped["t"] == 2
        states[backend] = after
        errors[backend] = err
        counts[backend] = eng.nonfinite_rows_skipped["t"]
    ref, fast = states["reference"], states["numba"]
    for key in ref["t"]:
        np.testing.assert_allclose(
            fast["t"][key],
            ref["t"][key],
            rtol=1e-5,
            atol=1e-6,
            err_msg=f"numba != reference for {key}",
        )
    assert counts["reference"] == counts["numba"]


def test_skip_row_counts_across_steps_and_training_goes_on(backend):
    eng = _guard_engine("adagrad", backend, "skip_row", 4)
    for _ in range(3):
        g = _guard_step(eng)
        with pytest.warns(RuntimeWarning, match="left unchanged"):
            eng.apply_gradients({"f": g})
    assert eng.nonfinite_rows_skipped == {"t": 6}
    assert eng.step == 3 and _all_finite(eng)


def test_ftrl_tiny_learning_rate_overflow_is_guarded(backend):
    """A learning rate of 1e-45 is finite and within range, but FTRL divides by it: every
    touched row's result overflows, and each is left as it was."""
    t = ee.TableConfig(10, 4, name="t", optimizer=O.FTRL(ee.DynamicLearningRate(0)))
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t)}, backend=backend, nonfinite_gradients="skip_row"
    )
    acts = eng.lookup({"f": [[1], [2]]})
    before = _state(eng)
    with pytest.warns(RuntimeWarning, match="2 rows"):
        eng.apply_gradients({"f": np.full_like(acts["f"], 0.5)}, learning_rates=[1e-320])
    assert _same(before, _state(eng), "t") and _all_finite(eng)


# -- property: random extreme settings never write a non-finite value ---------------------------

_EXTREME = st.sampled_from([0.0, 1e-45, 1e-30, 1e-3, 0.5, 1.0, 1e10, 1e30, 3e38, 1e300, math.inf])
_OPTIMIZERS = st.sampled_from(["SGD", "Adagrad", "Adam", "FTRL", "Momentum", "RMSProp"])


def _build_optimizer(kind: str, lr: float, decay: float, extra: float, clip: float):
    kw = {"weight_decay_factor": decay or None}
    if clip:
        kw.update(clip_weight_min=-clip, clip_weight_max=clip)
    if kind == "SGD":
        return O.SGD(lr, **kw)
    if kind == "Adagrad":
        return O.Adagrad(lr, initial_accumulator_value=extra or 0.1, **kw)
    if kind == "Adam":
        return O.Adam(lr, epsilon=extra or 1e-7, **kw)
    if kind == "FTRL":
        return O.FTRL(lr, beta=extra, **kw)
    if kind == "Momentum":
        return O.Momentum(lr, momentum=min(extra, 0.99), **kw)
    return O.RMSProp(lr, epsilon=extra or 1e-10, **kw)


@settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    kind=_OPTIMIZERS,
    lr=_EXTREME,
    decay=_EXTREME,
    extra=_EXTREME,
    clip=_EXTREME,
    weight=_EXTREME,
    grad=_EXTREME,
    backend=st.sampled_from(BACKENDS),
    policy=st.sampled_from(["error", "skip_row"]),
)
def test_random_extreme_settings_never_write_a_non_finite_value(
    kind, lr, decay, extra, clip, weight, grad, backend, policy
):
    try:
        opt = _build_optimizer(kind, lr, decay, extra, clip)
    except ValueError:
        return  # refused where it entered
    t = ee.TableConfig(8, 4, name="t", combiner="sum", optimizer=opt, initializer=I.RowId(1))
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t)}, backend=backend, nonfinite_gradients=policy
    )
    w = np.float32(weight) if math.isfinite(weight) and weight <= BIG else np.float32(1.0)
    feats = {
        "f": ee.Ragged(
            np.array([1, 2, 2, 3]), lengths=[2, 2], weights=np.array([w, 1.0, -w, 0.5], np.float32)
        )
    }
    g = np.float32(grad) if math.isfinite(grad) and grad <= BIG else np.float32(1.0)
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            acts = eng.lookup(feats)
            grads = {"f": np.full_like(acts["f"], g)}
            try:
                eng.apply_gradients(grads)
            except (ValueError, FloatingPointError):
                pass
        assert _all_finite(eng), (kind, lr, decay, extra, clip, weight, grad)


@pytest.mark.parametrize("dim", [4, 6])  # the fixed-layout kernel and the any-layout one
def test_rowwise_adagrad_near_float32_max_takes_the_guarded_path(dim):
    """The fixed row-wise kernel writes a row unguarded only when a bound proves every new weight
    finite (sum |w| + |scale| * |g| < 1e38). Rows of weights near 3.4e38 fail that bound: a
    step that stays finite must still be stored (row 2, moved down by its gradient), one that
    overflows must leave the row as it was (row 1, pushed up); as on the reference."""
    states = []
    for backend in BACKENDS:
        t = ee.TableConfig(
            4,
            dim,
            name="t",
            combiner="sum",
            initializer=I.Constant(3.3e38),
            optimizer=O.Adagrad(1e38, hessian_compression_times=dim, initial_accumulator_value=1.0),
        )
        eng = ee.EmbeddingEngine(
            {"f": ee.FeatureConfig(t)}, backend=backend, nonfinite_gradients="skip_row"
        )
        before = _state(eng)
        acts = eng.lookup({"f": ee.Ragged(np.array([1, 2]), lengths=[1, 1])})
        g = np.ones_like(acts["f"])
        g[0] = -1.0  # row 1: w - scale * g grows past float32's largest value
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            eng.apply_gradients({"f": g})
        after = _state(eng)
        assert _same(before, after, "t", [1]), backend
        assert not _same(before, after, "t", [2]), backend
        assert _all_finite(eng)
        assert eng.nonfinite_rows_skipped["t"] == 1
        assert any("left unchanged" in str(w.message) for w in caught)
        states.append(after)
    for k in states[0]["t"]:
        np.testing.assert_array_equal(states[0]["t"][k], states[1]["t"][k], err_msg=k)


@pytest.mark.parametrize("name", ["adagrad", "sgd_no_accumulation"])
def test_skip_row_counts_rows_skipped_for_a_non_finite_gradient_too(backend, name):
    """Under "skip_row", rows 1 and 5 overflow (their result is not finite), row 2's gradient
    is NaN and one of row 3's two occurrences has an Inf gradient. All four are left exactly
    as they were, and each is counted once in ``nonfinite_rows_skipped`` and named in the
    warning (rows skipped for their gradient were neither counted nor named before); row 7
    trains."""
    eng = _guard_engine(name, backend, "skip_row", 4)
    g = _guard_step(eng)
    g[1] = np.nan  # row 2
    g[4, 0] = np.inf  # row 3's second occurrence
    before = _state(eng)
    err, caught = _apply(eng, g, "skip_row")
    after = _state(eng)
    assert err is None and after["step"] == 1 and _all_finite(eng)
    assert _same(before, after, "t", [1, 2, 3, 5]) and not _same(before, after, "t", [7])
    assert eng.nonfinite_rows_skipped == {"t": 4}
    named = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(named) == 1 and "table 't': 4 rows (ids 1, 2, 3, 5)" in named[0], named
    # A step whose only non-finite values are gradients is counted and warned about too.
    eng.lookup({"f": ee.Ragged(np.array([2, 7]), lengths=[1, 1])})
    with pytest.warns(RuntimeWarning, match="table 't': 1 rows \\(ids 2\\)"):
        eng.apply_gradients({"f": np.float32([[np.nan] * 4, [0.25] * 4])})
    assert eng.nonfinite_rows_skipped == {"t": 5}
