"""The formulas of the optimizers beyond SGD / Adagrad / Adam / FTRL and of their variants:
Adagrad with hessian compression, AdagradMomentum, ProximalAdagrad, Adam / AMSGrad (nesterov,
bias correction), Lion, Momentum, RMSProp, Adadelta, Assign, FrequencyEstimator and
BatchSoftmax, each with the common knobs; each step checked against the independent oracle of
tests/_formula_oracle.py (plain float64 loops from the written contract, see its docstring).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from _formula_oracle import (
    ATOL,
    CONST,
    ROWID,
    RTOL,
    RefTable,
    engine_input,
    f32,
    norm_bag,
    run_and_check,
)
from _formula_oracle import shared_case as _shared_case

import embengine as ee
from embengine import initializers as init
from embengine import optimizers as opt

# Five steps over f1, f2 sharing one table (vocab 10): duplicates in a bag, across bags and across
# the two features; weights (incl. negative, never a zero sum); empty bags; rows touched in some
# steps and not others (row 0: steps 1, 4; row 7: steps 0, 2; row 8: step 2 only).
STEPS = [
    {
        "f1": [[(1, 0.5), (2, 2.0), (1, 1.5)], [3], [], [(5, -0.5), (5, 2.0)]],
        "f2": [[1, 4], [2], [], [4, 4, 7]],
    },
    {"f1": [[0, 3], [3], [9, 1, 1], []], "f2": [[2], [6], [2], [0]]},
    {
        "f1": [[(7, 1.0), (7, 0.25)], [], [(1, 3.0), (8, -1.0), (2, 0.5)], [4]],
        "f2": [[(1, 2.0), (1, -0.5)], [8], [(3, 0.7), (4, 0.7), (1, 1.0)], []],
    },
    {"f1": [[5], [5, 6], [6], []], "f2": [[5], [], [9, 9], [6]]},
    {"f1": [[1, 2], [2], [1], [0]], "f2": [[1], [2, 2], [], [1, 3]]},
]


def shared_case(backend, kind, kwargs, init_spec, combiner, dim=8, **kw):
    """f1, f2 sharing table "a" over STEPS. Dim 8, the fixed-layout row width of the suite's
    other optimizer sweeps (tests/test_numba_matches_reference.py, test_keyed_tables.py): a
    width of its own would compile every row math's kernels once more."""
    return _shared_case(backend, kind, kwargs, init_spec, combiner, STEPS, dim=dim, **kw)


# ------------------------------------------------------------------------------------------------
# Optimizer configurations
# ------------------------------------------------------------------------------------------------

OPT_CASES = {
    # Adagrad with hessian compression
    "adagrad_k2": (
        "Adagrad",
        dict(learning_rate=0.1, initial_accumulator_value=0.2, hessian_compression_times=2),
        ROWID,
    ),
    "adagrad_k4": ("Adagrad", dict(learning_rate=0.1, hessian_compression_times=4), ROWID),
    "adagrad_k2_defaults": ("Adagrad", dict(hessian_compression_times=2), CONST),
    # AdagradMomentum
    "agm_defaults": ("AdagradMomentum", dict(), CONST),
    "agm_lr": ("AdagradMomentum", dict(learning_rate=0.1), ROWID),
    "agm_momentum": ("AdagradMomentum", dict(learning_rate=0.1, momentum=0.9), ROWID),
    "agm_nesterov": (
        "AdagradMomentum",
        dict(learning_rate=0.1, momentum=0.8, use_nesterov=True),
        ROWID,
    ),
    "agm_exp4_beta2": (
        "AdagradMomentum",
        dict(learning_rate=0.1, momentum=0.5, exponent=4, beta2=0.9, epsilon=0.01),
        ROWID,
    ),
    "agm_exp3_eps": (
        "AdagradMomentum",
        dict(learning_rate=0.2, exponent=3.0, epsilon=0.5, use_nesterov=True, momentum=0.3),
        CONST,
    ),
    # ProximalAdagrad
    "padagrad_defaults": ("ProximalAdagrad", dict(), CONST),
    "padagrad_plain": ("ProximalAdagrad", dict(learning_rate=0.5), ROWID),
    "padagrad_l1": (
        "ProximalAdagrad",
        dict(learning_rate=0.5, l1_regularization_strength=1.0),
        CONST,
    ),
    "padagrad_l2": (
        "ProximalAdagrad",
        dict(learning_rate=0.5, l2_regularization_strength=0.7, initial_accumulator_value=0.5),
        ROWID,
    ),
    "padagrad_l1l2": (
        "ProximalAdagrad",
        dict(learning_rate=0.3, l1_regularization_strength=0.2, l2_regularization_strength=0.3),
        ROWID,
    ),
    # Adam: nesterov and bias correction
    "adam_nesterov": ("Adam", dict(learning_rate=0.1, epsilon=0.1, use_nesterov=True), ROWID),
    "adam_nesterov_outside": (
        "Adam",
        dict(learning_rate=0.1, epsilon=0.1, use_nesterov=True, sum_inside_sqrt=False),
        ROWID,
    ),
    "adam_bc_global": (
        "Adam",
        dict(learning_rate=0.1, beta_1=0.8, beta_2=0.95, epsilon=0.01, bias_correction="global"),
        ROWID,
    ),
    "adam_bc_per_row": (
        "Adam",
        dict(learning_rate=0.1, beta_1=0.8, beta_2=0.95, epsilon=0.01, bias_correction="per_row"),
        ROWID,
    ),
    "adam_bc_per_row_outside_nesterov": (
        "Adam",
        dict(
            learning_rate=0.1,
            beta_1=0.7,
            beta_2=0.9,
            epsilon=0.05,
            bias_correction="per_row",
            sum_inside_sqrt=False,
            use_nesterov=True,
        ),
        CONST,
    ),
    "adam_bc_global_nonlazy": (
        "Adam",
        dict(
            learning_rate=0.1,
            beta_1=0.8,
            beta_2=0.95,
            epsilon=0.01,
            bias_correction="global",
            lazy_adam=False,
        ),
        ROWID,
    ),
    "adam_nesterov_nonlazy": (
        "Adam",
        dict(learning_rate=0.1, epsilon=0.1, use_nesterov=True, lazy_adam=False),
        ROWID,
    ),
    # AMSGrad
    "ams_defaults": ("AMSGrad", dict(), CONST),
    "ams_inside": ("AMSGrad", dict(learning_rate=0.1, epsilon=0.1), ROWID),
    "ams_outside": ("AMSGrad", dict(learning_rate=0.1, epsilon=0.1, sum_inside_sqrt=False), ROWID),
    "ams_betas": ("AMSGrad", dict(learning_rate=0.1, beta_1=0.5, beta_2=0.6, epsilon=0.01), ROWID),
    "ams_nesterov_per_row": (
        "AMSGrad",
        dict(
            learning_rate=0.1,
            beta_1=0.6,
            beta_2=0.7,
            epsilon=0.01,
            use_nesterov=True,
            bias_correction="per_row",
        ),
        ROWID,
    ),
    "ams_global_nonlazy": (
        "AMSGrad",
        dict(
            learning_rate=0.1,
            beta_1=0.6,
            beta_2=0.7,
            epsilon=0.01,
            bias_correction="global",
            lazy_adam=False,
        ),
        ROWID,
    ),
    # Lion
    "lion_defaults": ("Lion", dict(), CONST),
    "lion": ("Lion", dict(learning_rate=0.1), ROWID),
    "lion_betas": ("Lion", dict(learning_rate=0.05, beta_1=0.5, beta_2=0.7), ROWID),
    "lion_nonlazy": (
        "Lion",
        dict(learning_rate=0.1, beta_1=0.6, beta_2=0.8, lazy_lion=False),
        ROWID,
    ),
    # Momentum
    "momentum_defaults": ("Momentum", dict(), CONST),
    "momentum": ("Momentum", dict(learning_rate=0.1), ROWID),
    "momentum_nesterov": (
        "Momentum",
        dict(learning_rate=0.1, momentum=0.5, use_nesterov=True),
        ROWID,
    ),
    "momentum_zero": ("Momentum", dict(learning_rate=0.2, momentum=0.0), ROWID),
    # RMSProp
    "rmsprop_defaults": ("RMSProp", dict(), CONST),
    "rmsprop": ("RMSProp", dict(learning_rate=0.1), ROWID),
    "rmsprop_momentum": ("RMSProp", dict(learning_rate=0.05, rho=0.8, momentum=0.7), ROWID),
    "rmsprop_centered": ("RMSProp", dict(learning_rate=0.05, centered=True, momentum=0.3), ROWID),
    "rmsprop_outside": (
        "RMSProp",
        dict(learning_rate=0.1, sum_inside_sqrt=False, epsilon=0.1, initial_ms_value=0.5),
        ROWID,
    ),
    "rmsprop_centered_outside": (
        "RMSProp",
        dict(
            learning_rate=0.1,
            centered=True,
            sum_inside_sqrt=False,
            epsilon=0.2,
            initial_ms_value=0.5,
            rho=0.6,
        ),
        ROWID,
    ),
    "rmsprop_monolith": (
        "RMSProp",
        dict(
            learning_rate=0.1,
            rho=0.7,
            momentum=0.0,
            epsilon=1.0,
            sum_inside_sqrt=False,
            initial_ms_value=0.0,
        ),
        ROWID,
    ),
    # Adadelta
    "adadelta_defaults": ("Adadelta", dict(), CONST),
    "adadelta_lr": ("Adadelta", dict(learning_rate=1.0), ROWID),
    "adadelta_rho_eps": ("Adadelta", dict(learning_rate=0.5, rho=0.5, epsilon=0.1), ROWID),
    # Assign
    "assign": ("Assign", dict(), ROWID),
}
# Cases that need gradient accumulation (ValueError otherwise, see test_requires_accumulation).
NEEDS_ACC = {
    "adam_bc_global_nonlazy",
    "adam_nesterov_nonlazy",
    "ams_global_nonlazy",
    "lion_nonlazy",
    "assign",
}

COMBINERS = ["sum", "mean", "sqrtn"]
# The combiner cycles over (case, accumulation) so that every optimizer family meets every
# combiner without running the full product (runtime).
PLAIN_PARAMS = [
    pytest.param(
        case,
        acc,
        COMBINERS[(2 * i + (0 if acc else 1)) % 3],
        id=f"{case}-{'acc_on' if acc else 'acc_off'}-{COMBINERS[(2 * i + (0 if acc else 1)) % 3]}",
    )
    for i, case in enumerate(OPT_CASES)
    for acc in (True, False)
    if acc or case not in NEEDS_ACC
]


@pytest.mark.parametrize("case,accumulate,combiner", PLAIN_PARAMS)
def test_optimizer_plain(backend, case, accumulate, combiner):
    kind, kwargs, init_spec = OPT_CASES[case]
    kwargs = dict(kwargs, use_gradient_accumulation=accumulate)
    shared_case(backend, kind, kwargs, init_spec, combiner)


KNOBS = {
    "clip_g_and_w": dict(clipvalue=0.5, clip_weight_min=-1.5, clip_weight_max=2.0),
    "clip_w": dict(clip_weight_min=-1.0, clip_weight_max=1.0),
    "wd_decoupled_lr": dict(
        weight_decay_factor=0.5, multiply_weight_decay_factor_by_learning_rate=True
    ),
    "wd_l2": dict(weight_decay_factor=0.2, weight_decay_mode="l2"),
    "wd_l2_lr": dict(
        weight_decay_factor=0.5,
        multiply_weight_decay_factor_by_learning_rate=True,
        weight_decay_mode="l2",
    ),
    "all_l2": dict(
        clipvalue=(-0.3, 0.6),
        weight_decay_factor=0.1,
        weight_decay_mode="l2",
        clip_weight_min=-1.2,
        clip_weight_max=1.4,
    ),
    "all_decoupled": dict(
        clipvalue=(None, 0.4),
        weight_decay_factor=0.05,
        clip_weight_min=-2.0,
    ),
}
KNOB_OPTS = [
    "adagrad_k2",
    "agm_nesterov",
    "padagrad_l1l2",
    "adam_nesterov",
    "adam_bc_per_row",
    "ams_betas",
    "ams_nesterov_per_row",
    "lion",
    "momentum",
    "momentum_nesterov",
    "rmsprop_centered",
    "adadelta_rho_eps",
    "assign",
    # every row updated each step: only knobs without weight decay (what weight decay does to
    # rows the batch did not touch is not specified)
    "lion_nonlazy",
    "adam_bc_global_nonlazy",
    "ams_global_nonlazy",
]
COMBINER_CYCLE = ["mean", "sqrtn", "sum"]


def _knob_valid(case, knob, acc):
    knobs = KNOBS[knob]
    if not acc and (case in NEEDS_ACC or knobs.get("clipvalue") is not None):
        return False  # ValueError at construction
    if case in NEEDS_ACC and case != "assign" and "weight_decay_factor" in knobs:
        return False
    return True


KNOB_PARAMS = [
    pytest.param(case, knob, acc, id=f"{case}-{knob}-{'acc_on' if acc else 'acc_off'}")
    for case in KNOB_OPTS
    for knob in KNOBS
    for acc in (True, False)
    if _knob_valid(case, knob, acc)
]


@pytest.mark.parametrize("case,knob,accumulate", KNOB_PARAMS)
def test_optimizer_knobs(backend, case, knob, accumulate):
    kind, kwargs, init_spec = OPT_CASES[case]
    combiner = COMBINER_CYCLE[(KNOB_OPTS.index(case) + list(KNOBS).index(knob)) % 3]
    kwargs = dict(kwargs, use_gradient_accumulation=accumulate, **KNOBS[knob])
    # Larger gradients so that clipvalue really clips.
    shared_case(backend, kind, kwargs, init_spec, combiner, grad_scale=1.5)


@pytest.mark.parametrize("accumulate", [True, False], ids=["acc_on", "acc_off"])
@pytest.mark.parametrize(
    "case", ["agm_nesterov", "adam_bc_per_row", "lion", "rmsprop_centered", "padagrad_l1"]
)
def test_occurrence_order_follows_feature_dict(backend, case, accumulate):
    """Feature dict (f2, f1): with accumulation off, f2's occurrences are applied first."""
    kind, kwargs, init_spec = OPT_CASES[case]
    kwargs = dict(kwargs, use_gradient_accumulation=accumulate, clip_weight_max=1.3)
    shared_case(backend, kind, kwargs, init_spec, "sqrtn", order=("f2", "f1"))


# ------------------------------------------------------------------------------------------------
# Adagrad hessian compression
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("accumulate", [True, False], ids=["acc_on", "acc_off"])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_adagrad_compression_dim_is_rowwise_adagrad(backend, combiner, accumulate):
    """Adagrad(hessian_compression_times=dim) == row-wise Adagrad written out here: one
    accumulator per row, fed mean(g^2) over the row."""
    vocab, dim, lr, a0 = 10, 4, 0.3, 0.05
    t = ee.TableConfig(
        vocab,
        dim,
        initializer=init.RowId(offset=-3),
        optimizer=opt.Adagrad(
            learning_rate=lr,
            initial_accumulator_value=a0,
            hessian_compression_times=dim,
            use_gradient_accumulation=accumulate,
        ),
        combiner=combiner,
        name="a",
    )
    eng = ee.EmbeddingEngine(
        {"f1": ee.FeatureConfig(t), "f2": ee.FeatureConfig(t)}, backend=backend
    )
    W = [[f32(r - 3) for _ in range(dim)] for r in range(vocab)]
    A = [f32(a0) for _ in range(vocab)]
    gainer = RefTable(vocab, dim, ("const", 0.0), combiner, "Assign", {})  # only for gains()

    def rowwise(r, g):
        a = A[r] + sum(x * x for x in g) / dim
        W[r] = [f32(W[r][d] - lr * g[d] / math.sqrt(a)) for d in range(dim)]
        A[r] = f32(a)

    rng = np.random.default_rng(3)
    for i, step in enumerate(STEPS):
        bags = {f: [norm_bag(b) for b in step[f]] for f in ("f1", "f2")}
        eng.lookup({f: engine_input(bags[f], i) for f in ("f1", "f2")})
        grads = {f: rng.standard_normal((len(bags[f]), dim)).astype(np.float32) for f in bags}
        eng.apply_gradients(grads)
        occ = []
        for f in ("f1", "f2"):
            for b, bag in enumerate(bags[f]):
                if bag:
                    for (rid, _), gain in zip(bag, gainer.gains(bag), strict=True):
                        occ.append((rid, [gain * float(x) for x in grads[f][b]]))
        if accumulate:
            summed: dict[int, list[float]] = {}
            for rid, g in occ:
                summed[rid] = [x + y for x, y in zip(summed.get(rid, [0.0] * dim), g, strict=True)]
            for rid, g in summed.items():
                rowwise(rid, g)
        else:
            for rid, g in occ:
                rowwise(rid, g)
        slots = eng.slots("a")
        assert list(slots) == ["accumulators"]
        assert slots["accumulators"].shape == (vocab, 1)
        np.testing.assert_allclose(
            slots["accumulators"][:, 0], A, rtol=RTOL, atol=ATOL, err_msg=f"step {i}"
        )
        np.testing.assert_allclose(
            eng.embedding_tables["a"], W, rtol=RTOL, atol=ATOL, err_msg=f"step {i}"
        )


@pytest.mark.parametrize("k", [3, 8])
@pytest.mark.parametrize("where", ["table", "global"])
def test_adagrad_compression_must_divide_dim(backend, k, where):
    with pytest.raises(ValueError, match="hessian_compression_times"):
        adagrad = opt.Adagrad(learning_rate=0.1, hessian_compression_times=k)
        t = ee.TableConfig(10, 4, optimizer=adagrad if where == "table" else None, name="a")
        ee.EmbeddingEngine(
            {"f": ee.FeatureConfig(t)},
            optimizer=adagrad if where == "global" else None,
            backend=backend,
        )


def test_adagrad_compression_slot_shape(backend):
    for k, cols in [(1, 4), (2, 2), (4, 1)]:
        t = ee.TableConfig(
            6,
            4,
            optimizer=opt.Adagrad(0.1, initial_accumulator_value=0.3, hessian_compression_times=k),
            name="a",
        )
        eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, backend=backend)
        acc = eng.slots("a")["accumulators"]
        assert acc.shape == (6, cols), (k, acc.shape)
        np.testing.assert_allclose(acc, 0.3, rtol=RTOL)


# ------------------------------------------------------------------------------------------------
# Specific properties
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_row", [False, True])
def test_amsgrad_slot_order(backend, per_row):
    o = opt.AMSGrad(0.1, bias_correction="per_row" if per_row else None)
    t = ee.TableConfig(5, 2, optimizer=o, name="a")
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, backend=backend)
    expected = ["momenta", "velocities", "vhats"] + (["steps"] if per_row else [])
    assert list(eng.slots("a")) == expected


@pytest.mark.parametrize("accumulate", [True, False], ids=["acc_on", "acc_off"])
def test_adam_per_row_steps_counts_updates(backend, accumulate):
    """The int32 "steps" slot counts the row's updates: per step with accumulation, per
    occurrence without."""
    kind, kwargs, init_spec = OPT_CASES["adam_bc_per_row"]
    eng, refs = shared_case(
        backend, kind, dict(kwargs, use_gradient_accumulation=accumulate), init_spec, "sum"
    )
    steps = eng.slots("a")["steps"]
    assert steps.dtype == np.int32 and steps.shape == (10, 1)
    counts = [0] * 10
    for st in STEPS:
        touched = [rid for f in ("f1", "f2") for bag in st[f] for rid, _ in norm_bag(bag)]
        if accumulate:
            for r in set(touched):
                counts[r] += 1
        else:
            for r in touched:
                counts[r] += 1
    np.testing.assert_array_equal(steps[:, 0], counts)


@pytest.mark.parametrize("accumulate", [True, False], ids=["acc_on", "acc_off"])
def test_proximal_adagrad_l1_exact_zeros(backend, accumulate):
    kind, kwargs, init_spec = OPT_CASES["padagrad_l1"]
    eng, refs = shared_case(
        backend, kind, dict(kwargs, use_gradient_accumulation=accumulate), init_spec, "sum"
    )
    exp = np.array(refs["a"].w)
    assert (exp == 0.0).any() and (exp != 0.0).any()
    got = eng.embedding_tables["a"]
    np.testing.assert_array_equal(got[exp == 0.0], 0.0)


def test_lion_nonlazy_untouched_row_moves_by_momentum_sign(backend):
    """Hand-checked: lr=0.5, b1=0.5, b2=0.5. Step 1 touches row 0 with g=+1 -> w -= 0.5*sign(0.5)
    and m = 0.5. Step 2 touches only row 1: row 0 gets g=0 -> w -= 0.5*sign(0.25), m = 0.25."""
    t = ee.TableConfig(
        3,
        1,
        initializer=init.Constant(1.0),
        optimizer=opt.Lion(0.5, beta_1=0.5, beta_2=0.5, lazy_lion=False),
        combiner="sum",
        name="a",
    )
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, backend=backend)
    eng.lookup({"f": [[0]]})
    eng.apply_gradients({"f": np.array([[1.0]], dtype=np.float32)})
    np.testing.assert_allclose(eng.embedding_tables["a"][:, 0], [0.5, 1.0, 1.0])
    np.testing.assert_allclose(eng.slots("a")["momenta"][:, 0], [0.5, 0.0, 0.0])
    eng.lookup({"f": [[1]]})
    eng.apply_gradients({"f": np.array([[-2.0]], dtype=np.float32)})
    np.testing.assert_allclose(eng.embedding_tables["a"][:, 0], [0.0, 1.5, 1.0])
    np.testing.assert_allclose(eng.slots("a")["momenta"][:, 0], [0.25, -1.0, 0.0])


@pytest.mark.parametrize("accumulate", [True, False], ids=["acc_on", "acc_off"])
def test_two_tables_table_and_global_optimizers(backend, accumulate):
    """Table a (RMSProp centered on its TableConfig, shared by f1/f2) and table b (the global
    AMSGrad per_row, dim 2): each table follows its own optimizer."""
    tables = {
        "a": dict(
            vocab=10,
            dim=4,
            init=ROWID,
            combiner="mean",
            kind="RMSProp",
            kwargs=dict(
                learning_rate=0.05,
                centered=True,
                momentum=0.4,
                use_gradient_accumulation=accumulate,
                clip_weight_min=-3.0,
            ),
            on_table=True,
        ),
        "b": dict(vocab=6, dim=2, init=CONST, combiner="sum", on_table=False),
    }
    global_opt = (
        "AMSGrad",
        dict(
            learning_rate=0.1,
            beta_1=0.6,
            beta_2=0.7,
            epsilon=0.01,
            bias_correction="per_row",
            use_gradient_accumulation=accumulate,
        ),
    )
    steps = []
    for k, st in enumerate(STEPS):
        g = dict(st)
        g["h"] = [[k % 6, (k + 1) % 6], [], [3, 3], [5]]
        steps.append(g)
    run_and_check(
        backend, tables, [("f1", "a"), ("h", "b"), ("f2", "a")], steps, global_opt=global_opt
    )


def test_assign_hand_checked(backend):
    """w = the accumulated gradient of the row (sum of gain * g over all occurrences)."""
    t = ee.TableConfig(
        5, 2, initializer=init.Constant(9.0), optimizer=opt.Assign(), combiner="sum", name="a"
    )
    eng = ee.EmbeddingEngine(
        {"f1": ee.FeatureConfig(t), "f2": ee.FeatureConfig(t)}, backend=backend
    )
    eng.lookup(
        {"f1": ee.Ragged([1, 1, 2], lengths=[2, 1], weights=[1.0, 2.0, 0.5]), "f2": [[1], [3]]}
    )
    eng.apply_gradients(
        {
            "f1": np.array([[1.0, -1.0], [4.0, 2.0]], dtype=np.float32),
            "f2": np.array([[0.5, 0.25], [-3.0, 7.0]], dtype=np.float32),
        }
    )
    np.testing.assert_allclose(
        eng.embedding_tables["a"],
        [[9.0, 9.0], [3.5, -2.75], [2.0, 1.0], [-3.0, 7.0], [9.0, 9.0]],
        rtol=RTOL,
        atol=ATOL,
    )


# ------------------------------------------------------------------------------------------------
# FrequencyEstimator
# ------------------------------------------------------------------------------------------------

# Ten steps (s = 1..10) over two features sharing a dim-1 table of vocab 6.
FE_STEPS = [
    {"f1": [[1], [3]], "f2": [[0]]},  # s=1
    {"f1": [[1, 0]], "f2": [[0]]},  # s=2
    {"f1": [[3], []], "f2": [[0]]},  # s=3
    {"f1": [[3, 3], [0]], "f2": [[3]]},  # s=4: row 3 duplicated in a bag and across features
    {"f1": [[0], []], "f2": [[]]},  # s=5
    {"f1": [[1]], "f2": [[0, 0]]},  # s=6
    {"f1": [[4]], "f2": [[0]]},  # s=7
    {"f1": [[2]], "f2": [[]]},  # s=8
    {"f1": [[3], [1]], "f2": [[0]]},  # s=9
    {"f1": [[(1, 2.0), (3, 0.5)]], "f2": [[5], [0]]},  # s=10
]


def _fe_tables(kwargs, init_spec, on_table, combiner="sum"):
    tables = {
        "a": dict(
            vocab=6,
            dim=1,
            init=init_spec,
            combiner=combiner,
            kind="FrequencyEstimator",
            kwargs=kwargs,
            on_table=on_table,
        )
    }
    return tables, (None if on_table else ("FrequencyEstimator", kwargs))


FE_CASES = {
    "small": (dict(tau=0.5, max_delta=4.0, outlier_threshold=2.0), ("default", 4.0)),
    "defaults": (dict(), ("default", 1000.0)),
    "tau": (
        dict(tau=0.25, max_delta=6.0, outlier_threshold=3.0, weight_exponent=2.0),
        ("default", 6.0),
    ),
    "const_init": (dict(tau=0.3, max_delta=5.0, outlier_threshold=1.5), ("const", 2.0)),
    "clip_w": (
        dict(
            tau=0.5, max_delta=4.0, outlier_threshold=2.0, clip_weight_max=3.0, clip_weight_min=1.5
        ),
        ("default", 4.0),
    ),
}


@pytest.mark.parametrize("on_table", [True, False], ids=["table_opt", "global_opt"])
@pytest.mark.parametrize("case", list(FE_CASES))
def test_frequency_estimator(backend, case, on_table):
    kwargs, init_spec = FE_CASES[case]
    tables, global_opt = _fe_tables(
        kwargs, init_spec, on_table, combiner=["sum", "mean", "sqrtn"][len(case) % 3]
    )
    run_and_check(
        backend,
        tables,
        [("f1", "a"), ("f2", "a")],
        FE_STEPS,
        global_opt=global_opt,
        grad_scale=10.0,
    )


def _fe_run(backend, o, initializer, batches):
    t = ee.TableConfig(4, 1, initializer=initializer, optimizer=o, combiner="sum", name="a")
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, backend=backend)
    for batch in batches:
        acts = eng.lookup({"f": batch})
        eng.apply_gradients({"f": np.full_like(acts["f"], 100.0)})
    return eng.embedding_tables["a"][:, 0], eng.slots("a")["last_hit_step"][:, 0]


def test_frequency_estimator_hand_checked(backend):
    """tau=0.5, max_delta=6, outlier_threshold=2, no initializer: D starts at max_delta = 6.
    row 0 every step: D <- 0.5 D + 0.5 (delta 1 is never >= 2 D).
    row 1 at s=1: 1 >= 12? no -> 3 + 0.5 = 3.5; s=2: 1 >= 7? no -> 1.75 + 0.5 = 2.25;
          s=9: 7 >= 4.5 -> min(7, 6) = 6 (outlier, clamped); s=12: 3 >= 12? no -> 3 + 1.5 = 4.5.
    row 2 never hit: 6, last 0.  row 3 first hit at s=12: 12 >= 12 -> min(12, 6) = 6."""
    batches = []
    for s in range(1, 13):
        bag = [0] + ([1] if s in (1, 2, 9, 12) else []) + ([3, 3] if s == 12 else [])
        batches.append([bag, [0]])
    D, last = _fe_run(
        backend,
        opt.FrequencyEstimator(tau=0.5, max_delta=6.0, outlier_threshold=2.0),
        None,
        batches,
    )
    d0 = 6.0
    for _ in range(12):
        d0 = 0.5 * d0 + 0.5
    np.testing.assert_allclose(D, [d0, 4.5, 6.0, 6.0], rtol=1e-6)
    np.testing.assert_array_equal(last, [12, 12, 0, 12])


def test_frequency_estimator_outlier_tie_is_outlier(backend):
    """delta == outlier_threshold * D takes the outlier branch (>=). tau=0.5, max_delta=10,
    outlier_threshold=1.5, D0 = Constant(2.0).
    row 0 at s=1: 1 >= 3? no -> 1 + 0.5 = 1.5.
    row 1 at s=2: 2 >= 3? no -> 1 + 1 = 2; at s=5: 3 >= 3 -> D = 3 (not 0.5*2 + 0.5*3 = 2.5).
    row 2 first hit at s=3: 3 >= 3 -> 3 (not 2.5).
    row 3 at s=2: 2; at s=4: 2 >= 3? no -> 2."""
    batches = [[[0]], [[1], [3]], [[2]], [[3]], [[1]]]
    D, last = _fe_run(
        backend,
        opt.FrequencyEstimator(tau=0.5, max_delta=10.0, outlier_threshold=1.5),
        init.Constant(2.0),
        batches,
    )
    np.testing.assert_allclose(D, [1.5, 3.0, 3.0, 2.0], rtol=1e-6)
    np.testing.assert_array_equal(last, [1, 5, 3, 4])


def _build_one(backend, o, dim=1, where="table", initializer=None):
    t = ee.TableConfig(
        6, dim, initializer=initializer, optimizer=o if where == "table" else None, name="a"
    )
    return ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t)}, optimizer=o if where == "global" else None, backend=backend
    )


@pytest.mark.parametrize("where", ["table", "global"])
@pytest.mark.parametrize("kind", ["FrequencyEstimator", "BatchSoftmax"])
def test_gradient_free_tables_need_dim_1(backend, kind, where):
    with pytest.raises(ValueError):
        _build_one(backend, getattr(opt, kind)(), dim=2, where=where)


@pytest.mark.parametrize(
    "make,param",
    [
        (lambda: opt.FrequencyEstimator(weight_decay_factor=0.1), "weight_decay"),
        (
            lambda: opt.FrequencyEstimator(weight_decay_factor=0.1, weight_decay_mode="l2"),
            "weight_decay",
        ),
        (lambda: opt.FrequencyEstimator(clipvalue=1.0), "clipvalue"),
        (lambda: opt.FrequencyEstimator(clipvalue=(None, 1.0)), "clipvalue"),
    ],
    ids=["fe_wd", "fe_wd_l2", "fe_clip", "fe_clip_max"],
)
def test_frequency_estimator_rejects_gradient_knobs(backend, make, param):
    with pytest.raises(ValueError, match=param):
        _build_one(backend, make())


@pytest.mark.parametrize(
    "make",
    [
        lambda: opt.Assign(use_gradient_accumulation=False),
        lambda: opt.FrequencyEstimator(use_gradient_accumulation=False),
        lambda: opt.BatchSoftmax(use_gradient_accumulation=False),
        lambda: opt.Lion(lazy_lion=False, use_gradient_accumulation=False),
        lambda: opt.AMSGrad(lazy_adam=False, use_gradient_accumulation=False),
    ],
    ids=["assign", "frequency_estimator", "batch_softmax", "lion_nonlazy", "amsgrad_nonlazy"],
)
def test_requires_accumulation(backend, make):
    with pytest.raises(ValueError, match="accumulation"):
        _build_one(backend, make())


# ------------------------------------------------------------------------------------------------
# BatchSoftmax
# ------------------------------------------------------------------------------------------------


def _bs_steps(n):
    """id 0 every step, id 1 every 3 steps (s = 1, 4, 7, ...), id 2 every 2 steps, id 3 every 5
    steps, id 4 every 3 steps but duplicated in a bag and across both features, id 5 never."""
    steps = []
    for s in range(1, n + 1):
        f1 = [[0]]
        f2 = [[]]
        if s % 3 == 1:
            f1.append([1])
        if s % 2 == 0:
            f2.append([2])
        if s % 5 == 0:
            f1.append([3, 0])
        if s % 3 == 0:
            f1.append([4, 4])
            f2.append([4])
        steps.append({"f1": f1, "f2": f2})
    return steps


@pytest.mark.parametrize("a,n", [(0.5, 60), (0.1, 300)], ids=["a0.5_60steps", "default_a_300steps"])
def test_batch_softmax_converges_to_period(backend, a, n):
    kwargs = {} if a == 0.1 else dict(learning_rate=a)
    tables = {
        "a": dict(
            vocab=6,
            dim=1,
            init=("default", 1.0),
            combiner="mean",
            kind="BatchSoftmax",
            kwargs=kwargs,
            on_table=True,
        )
    }
    eng, refs = run_and_check(
        backend, tables, [("f1", "a"), ("f2", "a")], _bs_steps(n), grad_scale=5.0
    )
    B = eng.embedding_tables["a"][:, 0]
    for rid, k in [(0, 1), (1, 3), (2, 2), (4, 3)]:
        assert abs(B[rid] - k) < 1e-3, (rid, k, B)
    assert abs(B[3] - 5) < 1e-2, B  # seen only n / 5 times
    assert B[5] == 1.0
    last = eng.slots("a")["last_seen_step"][:, 0]
    assert last.dtype == np.int32
    assert list(last) == [n, n - ((n - 1) % 3), n - n % 2, n - n % 5, n - n % 3, 0]


def test_batch_softmax_first_steps_exact(backend):
    """Exact recursion for the first steps of an id seen every 3 steps, a = 0.25, B0 = 1."""
    t = ee.TableConfig(3, 1, optimizer=opt.BatchSoftmax(0.25), combiner="sum", name="a")
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, backend=backend)
    B, last = 1.0, 0
    for s in range(1, 13):
        ids = [[0, 1]] if s % 3 == 0 else [[0]]
        eng.lookup({"f": ids})
        eng.apply_gradients({"f": np.full((1, 1), 3.0, dtype=np.float32)})
        if s % 3 == 0:
            B = f32(0.75 * B + 0.25 * (s - last))
            last = s
        assert eng.embedding_tables["a"][1, 0] == pytest.approx(B, rel=1e-6), s
        assert eng.slots("a")["last_seen_step"][1, 0] == last
        assert eng.embedding_tables["a"][2, 0] == 1.0
    # 1 -> 0.75+0.75 = 1.5 -> 1.125+0.75 = 1.875 -> 1.40625+0.75 = 2.15625 -> 2.3671875
    assert B == pytest.approx(2.3671875)


def test_batch_softmax_duplicates_count_once(backend):
    """a = 0.5, B0 = 1. Row 2 first seen at s=3 twice in a bag and once in the other feature:
    counted once -> 0.5*1 + 0.5*3 = 2.0 (counting each occurrence would give 1.0). At s=4 twice
    in a bag only -> 0.5*2 + 0.5*1 = 1.5."""
    t = ee.TableConfig(4, 1, optimizer=opt.BatchSoftmax(0.5), combiner="sum", name="a")
    eng = ee.EmbeddingEngine(
        {"f1": ee.FeatureConfig(t), "f2": ee.FeatureConfig(t)}, backend=backend
    )
    batches = [
        {"f1": [[0]], "f2": [[0]]},
        {"f1": [[0]], "f2": [[]]},
        {"f1": [[2, 2], [0]], "f2": [[2]]},
        {"f1": [[2, 2]], "f2": [[]]},
    ]
    expected_b2 = [1.0, 1.0, 2.0, 1.5]
    for s, batch in enumerate(batches, start=1):
        acts = eng.lookup(batch)
        eng.apply_gradients({f: np.ones_like(v) for f, v in acts.items()})
        assert eng.embedding_tables["a"][2, 0] == pytest.approx(expected_b2[s - 1]), s
    np.testing.assert_array_equal(eng.slots("a")["last_seen_step"][:, 0], [3, 0, 4, 0])
    # row 0: s=1 (twice, once per feature): 0.5+0.5 = 1 ; s=2: 1 ; s=3: 1 (dt = 1 each time)
    assert eng.embedding_tables["a"][0, 0] == pytest.approx(1.0)


@pytest.mark.parametrize("on_table", [True, False], ids=["table_opt", "global_opt"])
def test_batch_softmax_weight_clipping_and_global(backend, on_table):
    kwargs = dict(learning_rate=0.4, clip_weight_max=2.5, clip_weight_min=1.2)
    tables = {
        "a": dict(
            vocab=6,
            dim=1,
            init=("default", 1.0),
            combiner="sqrtn",
            kind="BatchSoftmax",
            kwargs=kwargs,
            on_table=on_table,
        )
    }
    run_and_check(
        backend,
        tables,
        [("f1", "a"), ("f2", "a")],
        _bs_steps(20),
        global_opt=None if on_table else ("BatchSoftmax", kwargs),
    )


# ------------------------------------------------------------------------------------------------
# Out-of-domain hyperparameters
# ------------------------------------------------------------------------------------------------

BAD_HPARAMS = [
    ("AdagradMomentum", "epsilon", 0.0),
    ("AdagradMomentum", "epsilon", -1e-3),
    ("AdagradMomentum", "exponent", 0.0),
    ("AdagradMomentum", "beta2", 1.5),
    ("Adam", "beta_1", 1.0),
    ("Adam", "bias_correction", "sometimes"),
    ("AMSGrad", "beta_1", 1.0),
    ("AMSGrad", "bias_correction", "sometimes"),
    ("Lion", "beta_2", -0.1),
    ("RMSProp", "rho", 1.0),
    ("RMSProp", "epsilon", 0.0),
    ("Adadelta", "rho", -0.1),
    ("ProximalAdagrad", "l1_regularization_strength", -1.0),
    ("ProximalAdagrad", "l2_regularization_strength", -1.0),
    ("Momentum", "momentum", -0.5),
    ("Adagrad", "hessian_compression_times", 0),
    ("FrequencyEstimator", "tau", 2.0),
    ("FrequencyEstimator", "max_delta", 0.0),
    ("BatchSoftmax", "learning_rate", 1.5),
]


@pytest.mark.parametrize(
    "kind,param,value", BAD_HPARAMS, ids=[f"{k}-{p}={v}" for k, p, v in BAD_HPARAMS]
)
def test_out_of_domain_hyperparameters(kind, param, value):
    with pytest.raises(ValueError, match=param) as excinfo:
        getattr(opt, kind)(**{param: value})
    msg = str(excinfo.value)
    forms = {repr(value), str(value)}
    if isinstance(value, float):
        forms |= {f"{value:g}", repr(int(value)) if value.is_integer() else repr(value)}
    assert any(form in msg for form in forms), (msg, forms)
