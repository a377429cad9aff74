"""Property tests: the numba backend equals the NumPy reference, whatever the input.

Hypothesis draws tables, features (shared tables, sequence features, weights, empty bags,
duplicate ids), an optimizer configuration and several steps of gradients; both backends run the
same steps and must hold the same weights and slots (relative 1e-5) and return the same
activations. Results must also not depend on the number of numba threads.
"""

import numba
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import embengine as ee
from embengine import initializers as init
from embengine import optimizers as opt

OPTIMIZERS = [
    opt.SGD(0.1),
    opt.SGD(0.1, use_gradient_accumulation=False, clip_weight_min=-0.5, clip_weight_max=0.7),
    opt.Adagrad(0.2),
    opt.Adagrad(0.2, hessian_compression_times=2, clipvalue=0.5, weight_decay_factor=0.1),
    opt.Adagrad(0.2, use_gradient_accumulation=False, weight_decay_factor=0.1),
    opt.AdagradMomentum(0.1, momentum=0.9, use_nesterov=True, exponent=3.0, beta2=0.9, epsilon=0.1),
    opt.AdagradMomentum(0.1, momentum=0.5),
    opt.ProximalAdagrad(0.3, l1_regularization_strength=0.05, l2_regularization_strength=0.1),
    opt.Adam(0.05),
    opt.Adam(0.05, sum_inside_sqrt=False, use_nesterov=True, bias_correction="global"),
    opt.Adam(0.05, bias_correction="per_row", use_gradient_accumulation=False),
    opt.Adam(0.05, lazy_adam=False, weight_decay_factor=0.01, weight_decay_mode="l2"),
    opt.AMSGrad(0.05, bias_correction="per_row", sum_inside_sqrt=False),
    opt.Lion(0.01),
    opt.Lion(0.01, lazy_lion=False),
    opt.FTRL(0.2, l1_regularization_strength=0.05, l2_regularization_strength=0.1, beta=0.5),
    opt.FTRL(
        0.2,
        learning_rate_power=-0.3,
        multiply_linear_by_learning_rate=True,
        use_gradient_accumulation=False,
    ),
    opt.Momentum(0.1, momentum=0.8, use_nesterov=True),
    opt.RMSProp(0.05, rho=0.8, momentum=0.5, centered=True, epsilon=1e-3),
    opt.RMSProp(0.05, momentum=0.0, epsilon=1.0, sum_inside_sqrt=False, initial_ms_value=0.0),
    opt.Adadelta(1.0, rho=0.9, epsilon=1e-3),
    opt.Assign(weight_decay_factor=0.5, multiply_weight_decay_factor_by_learning_rate=True),
    opt.SGD(
        0.1,
        weight_decay_factor=0.2,
        multiply_weight_decay_factor_by_learning_rate=True,
        clipvalue=(-0.3, None),
    ),
]
COUNTING = [
    opt.FrequencyEstimator(tau=0.3, max_delta=50.0, outlier_threshold=3.0),
    opt.BatchSoftmax(0.25),
]


@st.composite
def scenarios(draw):
    n_tables = draw(st.integers(1, 2))
    # k=2 must divide; dim 8 runs the fixed-layout update kernels (compiled for the dim-8 test
    # below too), 6 the any-layout ones
    dims = [draw(st.sampled_from([6, 8])) for _ in range(n_tables)]
    vocab = [draw(st.integers(1, 12)) for _ in range(n_tables)]
    combiners = [draw(st.sampled_from(["sum", "mean", "sqrtn"])) for _ in range(n_tables)]
    n_features = draw(st.integers(1, 3))
    feats = []
    for _ in range(n_features):
        t = draw(st.integers(0, n_tables - 1))
        seq = draw(st.sampled_from([0, 0, 2]))
        feats.append((t, seq))
    batch = draw(st.integers(0, 4))
    steps = []
    for _ in range(draw(st.integers(1, 3))):
        step = []
        for t, seq in feats:
            lengths = [draw(st.integers(0, 4)) for _ in range(batch)]
            ids = [draw(st.integers(0, vocab[t] - 1)) for _ in range(sum(lengths))]
            weights = None
            if not seq and draw(st.booleans()):
                weights = [draw(st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.5, 0.3])) for _ in ids]
            step.append((ids, lengths, weights))
        steps.append(step)
    grad_seed = draw(st.integers(0, 2**16))
    return dims, vocab, combiners, feats, steps, grad_seed


def scenario_engine(scenario, optimizer, backend, table=None, **kwargs):
    """The engine of a ``scenarios()`` draw: its tables (with ``table``'s extra TableConfig
    arguments) and features; ``kwargs`` go to the engine."""
    dims, vocab, combiners, feats, _, _ = scenario
    tables = [
        ee.TableConfig(
            vocab[i],
            dims[i],
            combiner=combiners[i],
            name=f"t{i}",
            initializer=init.RandomUniform(-1.0, 1.0),
            **(table or {}),
        )
        for i in range(len(dims))
    ]
    features = {
        f"f{k}": ee.FeatureConfig(tables[t], max_sequence_length=seq)
        for k, (t, seq) in enumerate(feats)
    }
    return ee.EmbeddingEngine(features, optimizer=optimizer, seed=5, backend=backend, **kwargs)


def _run(engine, scenario):
    """Run every step; return the activations of every step."""
    rng = np.random.default_rng(scenario[-1])
    history = []
    for step in scenario[4]:
        features = {
            f"f{k}": ee.Ragged(ids, lengths=lengths, weights=w)
            for k, (ids, lengths, w) in enumerate(step)
        }
        # A lookup-only batch (no deduplication) reads the same rows in the same order.
        inference = engine.lookup(features, training=False)
        acts = engine.lookup(features)
        for k, a in acts.items():
            np.testing.assert_array_equal(inference[k], a)
        grads = {k: rng.normal(size=a.shape).astype(np.float32) for k, a in acts.items()}
        engine.apply_gradients(grads)
        history.append(acts)
    return history


def _assert_same_state(a, b, rtol=1e-5, atol=1e-6):
    for name in a.table_names:
        np.testing.assert_allclose(
            a.embedding_tables[name], b.embedding_tables[name], rtol=rtol, atol=atol, err_msg=name
        )
        for slot, arr in a.slots(name).items():
            np.testing.assert_allclose(
                arr, b.slots(name)[slot], rtol=rtol, atol=atol, err_msg=f"{name}/{slot}"
            )


def _check(scenario, optimizer):
    fast = scenario_engine(scenario, optimizer, "numba")
    slow = scenario_engine(scenario, optimizer, "reference")
    for acts_fast, acts_slow in zip(_run(fast, scenario), _run(slow, scenario), strict=True):
        for k in acts_fast:
            np.testing.assert_allclose(acts_fast[k], acts_slow[k], rtol=1e-5, atol=1e-6)
    _assert_same_state(fast, slow)


SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: type(o).__name__)
@SETTINGS
@given(scenario=scenarios())
def test_numba_equals_reference(optimizer, scenario):
    _check(scenario, optimizer)


@pytest.mark.parametrize("optimizer", COUNTING, ids=lambda o: type(o).__name__)
@SETTINGS
@given(scenario=scenarios())
def test_counting_optimizers_numba_equals_reference(optimizer, scenario):
    dims, *rest = scenario
    _check(([1] * len(dims), *rest), optimizer)


@settings(max_examples=30, deadline=None)
@given(scenario=scenarios(), optimizer=st.sampled_from(OPTIMIZERS))
def test_skip_row_with_nonfinite_gradients(scenario, optimizer):
    """skip_row leaves the same rows untouched in both backends."""
    engines = [
        scenario_engine(scenario, optimizer, b, nonfinite_gradients="skip_row")
        for b in ("numba", "reference")
    ]
    rng = np.random.default_rng(scenario[-1])
    for step in scenario[4]:
        features = {
            f"f{k}": ee.Ragged(ids, lengths=lengths, weights=w)
            for k, (ids, lengths, w) in enumerate(step)
        }
        grads = None
        for eng in engines:
            acts = eng.lookup(features)
            if grads is None:
                grads = {k: rng.normal(size=a.shape).astype(np.float32) for k, a in acts.items()}
                for g in grads.values():
                    if g.size:
                        g.reshape(-1)[rng.integers(g.size)] = np.nan
            eng.apply_gradients(grads)
    _assert_same_state(*engines)


def test_results_do_not_depend_on_thread_count():
    """Rows are owned by one thread each and sums run in a fixed order: bit-identical."""
    rng = np.random.default_rng(0)
    vocab, batch = 500, 300
    lengths = rng.integers(0, 6, batch)
    ids = rng.zipf(1.3, lengths.sum()) % vocab
    results = []
    for threads in (1, numba.config.NUMBA_NUM_THREADS):
        numba.set_num_threads(threads)
        try:
            t = ee.TableConfig(vocab, 8, combiner="sqrtn", name="t")
            eng = ee.EmbeddingEngine(
                {"f": ee.FeatureConfig(t), "g": ee.FeatureConfig(t)},
                optimizer=opt.Adam(0.1, bias_correction="per_row"),
            )
            acts = []
            for step in range(3):
                feats = {"f": ee.Ragged(ids, lengths=lengths), "g": ids[:batch]}
                a = eng.lookup(feats)
                grads = {
                    k: np.sin(np.arange(v.size) + step).reshape(v.shape).astype(np.float32)
                    for k, v in a.items()
                }
                eng.apply_gradients(grads)
                acts.append(a)
            results.append((acts, eng.embedding_tables["t"].copy(), eng.slots("t")))
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    (acts1, w1, s1), (acts2, w2, s2) = results
    for a, b in zip(acts1, acts2, strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    np.testing.assert_array_equal(w1, w2)
    for k in s1:
        np.testing.assert_array_equal(s1[k], s2[k])


# One optimizer per fixed-layout kernel variant (row-wise Adagrad: hessian_compression_times=dim).
FIXED_LAYOUT_OPTIMIZERS = OPTIMIZERS + [
    opt.Adagrad(0.2, hessian_compression_times=8, clipvalue=0.4),
    # The fixed row-wise kernel decays the weights in its last loop, not in the prelude.
    opt.Adagrad(0.2, hessian_compression_times=8, weight_decay_factor=0.1),
    opt.Adagrad(
        0.2,
        hessian_compression_times=8,
        weight_decay_factor=0.1,
        weight_decay_mode="l2",
        clip_weight_min=-0.5,
        clip_weight_max=0.5,
    ),
    opt.AMSGrad(0.05, weight_decay_factor=0.1),
]


def weighted_steps(rng, vocab: int, batch: int, n: int = 3) -> list[tuple]:
    """``n`` steps of (ids, lengths, weights) for one feature: Zipf ids with duplicates, empty
    bags, weights of both signs."""
    steps = []
    for _ in range(n):
        lengths = rng.integers(0, 5, batch)
        ids = rng.zipf(1.5, lengths.sum()) % vocab  # duplicates, empty bags
        weights = rng.choice([0.5, 1.0, 2.0, -1.0], lengths.sum()).astype(np.float32)
        steps.append((ids, lengths, weights))
    return steps


def test_fixed_layout_kernels_equal_the_any_layout_ones(monkeypatch):
    """Each variant's fixed-layout update (rows of 8, slots at constant offsets, updated in place)
    gives the any-layout kernel's results: the same arithmetic in the same order, up to float
    rounding."""
    from embengine.backends import numba_backend as nbk
    from embengine.kernels import codegen, row_math

    vocab, batch = 40, 12
    steps = weighted_steps(np.random.default_rng(3), vocab, batch)
    covered = set()
    fixed_dims = nbk.FIXED_DIMS
    for optimizer in FIXED_LAYOUT_OPTIMIZERS:
        states = []
        for fixed in (True, False):
            monkeypatch.setattr(nbk, "FIXED_DIMS", fixed_dims if fixed else ())
            t = ee.TableConfig(
                vocab, 8, combiner="sqrtn", name="t", initializer=init.RandomUniform(-1.0, 1.0)
            )
            eng = ee.EmbeddingEngine(
                {"f": ee.FeatureConfig(t), "g": ee.FeatureConfig(t)}, optimizer=optimizer, seed=1
            )
            table = eng._physical[0]
            fused = nbk.kernels_for(optimizer, table)[0]
            rm = optimizer.row_math(8)
            variant = rm.name
            assert (fused is not row_math.kernels(rm)[0]) == (fixed and rm.fixed_layout)
            for step, (ids, lengths, weights) in enumerate(steps):
                acts = eng.lookup(
                    {"f": ee.Ragged(ids, lengths=lengths, weights=weights), "g": ids[:batch]}
                )
                eng.apply_gradients(
                    {
                        k: np.cos(np.arange(a.size) * 0.7 + step)
                        .reshape(a.shape)
                        .astype(np.float32)
                        for k, a in acts.items()
                    }
                )
            states.append((eng.embedding_tables["t"].copy(), eng.slots("t")))
        if rm.fixed_layout:
            covered.add(variant)
        (w1, s1), (w2, s2) = states
        # Not always bit-identical: with a constant width the compiler may vectorise a row sum
        # in another order, or fuse other multiply-adds (fastmath "contract").
        np.testing.assert_allclose(w1, w2, rtol=1e-6, atol=1e-7, err_msg=variant)
        for k in s1:
            np.testing.assert_allclose(s1[k], s2[k], rtol=1e-6, atol=1e-7, err_msg=f"{variant}/{k}")
    builtin = codegen.builtin_row_math()
    assert covered == {rm.name for rm in builtin if rm.fixed_layout}


def test_fixed_layout_only_where_the_rows_fit():
    from embengine.backends import numba_backend as nbk

    def layout(optimizer, dim):
        eng = ee.EmbeddingEngine(
            {"f": ee.FeatureConfig(ee.TableConfig(10, dim, name="t"))}, optimizer=optimizer
        )
        return nbk.fixed_layout(optimizer.row_math(dim), eng._physical[0])

    assert layout(opt.Adam(0.1), 16) == (16, 2)
    assert layout(opt.AMSGrad(0.1, bias_correction="per_row"), 8) == (8, 3)  # int32 steps after
    assert layout(opt.Adagrad(0.1, hessian_compression_times=32), 32) == (32, 1)  # row-wise
    assert layout(opt.SGD(0.1), 64) == (64, 0)
    assert layout(opt.Adam(0.1), 12) is None  # not a fixed dim
    assert layout(opt.Adagrad(0.1), 1) == (1, 1)  # low-dimensional (and packed) tables too
    assert layout(opt.FTRL(0.1), 4) == (4, 2)
    assert layout(opt.Adagrad(0.1, hessian_compression_times=4), 16) is None  # grouped: scratch
