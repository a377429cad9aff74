"""Reduced-precision tables (TableConfig weights_dtype / slots_dtype): stored in 16 bits, math in
float32, updates written back with stochastic rounding from the same random stream in both
backends."""

import contextlib
import dataclasses
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from test_numba_matches_reference import (
    COUNTING,
    OPTIMIZERS,
    scenario_engine,
    scenarios,
    weighted_steps,
)
from test_training import SYN_ARGS  # the small synthetic run's CLI arguments

import embengine as ee
from embengine import initializers as init
from embengine import optimizers as opt
from embengine.backends import reference
from embengine.precision import BF16, KIND, hash_bits, rounding_streams
from embengine.storage import plan_storage
from embengine.storage.plan import StoragePlan

# (weights_dtype, slots_dtype): every pair with a 16-bit member
DTYPES = [
    ("bfloat16", "bfloat16"),
    ("float16", "float16"),
    ("bfloat16", "float32"),
    ("float32", "float16"),
    ("float16", "bfloat16"),
    ("float32", "bfloat16"),
    ("bfloat16", "float16"),
    ("float16", "float32"),
]


def _engine(scenario, optimizer, backend, dtypes, **kwargs):
    table = {"weights_dtype": dtypes[0], "slots_dtype": dtypes[1]}
    return scenario_engine(scenario, optimizer, backend, table=table, **kwargs)


def _state(engine) -> dict[str, list[tuple[str, np.ndarray]]]:
    """Table name -> [(weights or slot name, live array)], the stored dtypes."""
    return {
        name: [("weights", engine.embedding_tables[name]), *engine.slots(name).items()]
        for name in engine.table_names
    }


def _steps(engines, scenario):
    """Each step from the same state: the reference's state is copied into the numba engine
    after the step is compared (_assert_same_step), so a value that one step rounds to a
    neighbouring 16-bit value cannot steer the later steps apart."""
    fast, slow = engines
    rng = np.random.default_rng(scenario[-1])
    for step in scenario[4]:
        features = {
            f"f{k}": ee.Ragged(ids, lengths=lengths, weights=w)
            for k, (ids, lengths, w) in enumerate(step)
        }
        # a lookup-only batch pools the same widened rows as the training lookup
        inference = [e.lookup(features, training=False) for e in engines]
        acts = [e.lookup(features) for e in engines]
        for got, want in zip(inference, acts, strict=True):
            for k, a in want.items():
                np.testing.assert_array_equal(got[k], a)
        for k in acts[0]:
            np.testing.assert_allclose(acts[0][k], acts[1][k], rtol=1e-5, atol=1e-6)
        grads = {k: rng.normal(size=a.shape).astype(np.float32) for k, a in acts[0].items()}
        fast_state, slow_state = _state(fast), _state(slow)  # live views
        before = {n: [(w, a.copy()) for w, a in arrays] for n, arrays in slow_state.items()}
        fast.apply_gradients(grads)
        with _rounding_on_a_threshold() as on_threshold:
            slow.apply_gradients(grads)
        _assert_same_step(fast_state, slow_state, before, on_threshold)
        for name, arrays in slow_state.items():
            for (_, a), (_, b) in zip(fast_state[name], arrays, strict=True):
                a[...] = b


@contextlib.contextmanager
def _rounding_on_a_threshold():
    """Yields {logical table name: rows, or None for all of them} where the reference stored
    a 16-bit value whose float32 value lay within an ulp of its stochastic rounding threshold
    (``kernels.rounding.round_bf16`` / ``round_f16``: the carry out of the dropped bits plus
    the random ones), so that a float32 result one ulp away rounds to the neighbouring value.
    A row updated once per occurrence (no accumulation) rounds again in the same step from
    there: its later values move by that neighbour's difference, an ulp at the threshold's
    magnitude, many ulps at a smaller one (a float16 weight of 0.142 rounded to its neighbour,
    then moved to -0.0286 by the next occurrence, is 7 ulps away)."""
    found: dict[str, set[int] | None] = {}
    store = reference._store

    def spy(table, name, rows, values, step, unit):
        out = store(table, name, rows, values, step, unit)
        col = table.columns[name]
        if col.dtype in ("bfloat16", "float16"):
            v = np.asarray(values, dtype=np.float32).reshape(len(rows), col.width)
            row_keys = getattr(table, "rounding_rows", None)
            keys, where = rounding_streams(table.rounding_key, row_keys, rows)
            columns = col.start + np.arange(col.width)[None, :]
            bits = hash_bits(keys[:, None], step, where[:, None], unit, columns)
            mask = 0xFFFF if KIND[col.dtype] == BF16 else 0x1FFF
            u = v.view(np.uint32).astype(np.int64) & 0x7FFFFFFF
            carry = (u + (bits.astype(np.int64) & mask)) & mask
            subnormal = (col.dtype == "float16") & (np.abs(v) < 2.0**-14)
            edge = (carry <= 1) | (carry >= mask - 1) | subnormal
            hit = np.asarray(rows)[edge.any(axis=1)]
            members = table.name.split("+")
            for member in members:
                if len(members) > 1:  # stacked or packed: rows are not the member's ids
                    found[member] = None if hit.size else found.get(member, set())
                elif found.get(member, set()) is not None:
                    found.setdefault(member, set()).update(hit.tolist())
        return out

    reference._store = spy
    try:
        yield found
    finally:
        reference._store = store


def _assert_same_step(fast, slow, before, on_threshold=None):
    """One step's results from the same state. 16-bit arrays: the same bits. The float32 math
    of the two backends agrees to an ulp, not bit for bit (tests/test_numba_matches_reference.py),
    so where a float32 result lies within an ulp of a rounding threshold the two may round to
    neighbouring 16-bit values: allowed, as adjacent bit patterns, for at most 1% of the values
    (one in a small array); a zero may differ in its sign. float32 arrays: to rtol 1e-5 of the
    new value or of the step's change, whichever is larger: a step much larger than its result
    (Adam's lr * m / epsilon where a float16 velocity rounds to 0) cancels, and the ulps of the
    step remain. Rows where the reference rounded on a threshold (``on_threshold``, from
    ``_rounding_on_a_threshold``) may have carried the neighbour into later rounds of the same
    step: they agree to 2**-5 of the row's largest magnitude before or after, and are then
    left out of the exact comparison."""
    on_threshold = on_threshold or {}
    for name, arrays in slow.items():
        rows = on_threshold.get(name, set())
        for (what, a), (_, b), (_, old) in zip(fast[name], arrays, before[name], strict=True):
            if rows is None or rows:
                picked = slice(None) if rows is None else sorted(rows)
                if a.dtype.kind == "f":
                    big = np.abs(np.stack([a[picked], b[picked], old[picked]])).astype(np.float64)
                    scale = big.reshape(3, len(a[picked]), -1).max(axis=(0, 2))
                    diff = np.abs(a[picked].astype(np.float64) - b[picked])
                    diff = diff.reshape(len(scale), -1)
                    assert np.all(diff <= 2.0**-5 * scale[:, None] + 1e-6), (name, what, rows)
                a, b, old = (np.delete(x, picked, axis=0) for x in (a, b, old))
            assert a.dtype == b.dtype, (name, what)
            if a.dtype.itemsize == 2:  # float16, bfloat16
                ha, hb = a.view(np.uint16).astype(np.int64), b.view(np.uint16).astype(np.int64)
                # -0 and +0 alike: np.sign(x) * 0 keeps the sign, numba's branch may not
                differ = (ha != hb) & ~((a == 0) & (b == 0))
                assert np.all(np.abs(ha - hb)[differ] == 1), (name, what, a, b)
                assert differ.sum() <= max(1, differ.size // 100), (name, what, a, b)
            elif a.dtype.kind == "f":
                scale = np.maximum(np.abs(b), np.abs(b.astype(np.float64) - old))
                bad = np.abs(a.astype(np.float64) - b) > 1e-5 * scale + 1e-6
                assert not bad.any(), (name, what, a[bad], b[bad], old[bad])
            else:
                np.testing.assert_array_equal(a, b, err_msg=f"{name}/{what}")


SETTINGS = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _with_dtypes(optimizers):
    """Each optimizer with one (weights, slots) dtype pair, in turn over the eight: the numba
    backend compiles a kernel per row math and dtype pair (codegen's HALF_UPDATE), so every
    pair of each row math would compile eight times as much for the same template snippets;
    the rounding itself is tested per dtype on its own (tests/test_rounding.py)."""
    pairs = [(o, DTYPES[i % len(DTYPES)]) for i, o in enumerate(optimizers)]
    ids = [f"{type(o).__name__}-{w}-{s}" for o, (w, s) in pairs]
    return pytest.mark.parametrize(("optimizer", "dtypes"), pairs, ids=ids)


# Found by hypothesis: with Adagrad(0.2, use_gradient_accumulation=False, weight_decay_factor=
# 0.1, decoupled) and (float16, bfloat16), row 0 of t0 rounds 12 times in step 2; in its fourth
# round the reference's float32 weight sits on its threshold, and numba's final weight is then
# 7 float16 ulps away (_rounding_on_a_threshold).
ON_A_THRESHOLD = (
    [6, 6],
    [1, 1],
    ["mean", "sum"],
    [(0, 0), (0, 2), (0, 0)],
    [
        [([], [0, 0, 0, 0], None), ([], [0, 0, 0, 0], None), ([0] * 3, [0, 2, 1, 0], None)],
        [([], [0, 0, 0, 0], None), ([], [0, 0, 0, 0], None), ([0] * 12, [4, 2, 4, 2], None)],
        [([], [0, 0, 0, 0], None), ([], [0, 0, 0, 0], None), ([0] * 5, [1, 3, 1, 0], None)],
    ],
    63358,
)


@_with_dtypes(OPTIMIZERS)
@SETTINGS
@given(scenario=scenarios())
@example(scenario=ON_A_THRESHOLD)
def test_reduced_precision_numba_equals_reference(optimizer, dtypes, scenario):
    engines = [_engine(scenario, optimizer, b, dtypes) for b in ("numba", "reference")]
    _steps(engines, scenario)


@SETTINGS
@given(scenario=scenarios())
def test_float32_weights_in_a_16_bit_row_without_float_slots(scenario):
    # SGD keeps no float slot: its table is a uint16 row of float32 weights for the slots
    # dtype alone, served by the (float32, float32) pair's kernel
    dtypes = ("float32", "float16")
    engines = [_engine(scenario, opt.SGD(0.1), b, dtypes) for b in ("numba", "reference")]
    for name in engines[0].table_names:
        assert engines[0].embedding_tables[name].dtype == np.float32
    assert all(t.data.dtype == np.uint16 for t in engines[0]._physical)
    _steps(engines, scenario)


# Row math whose 16-bit tables of widths in HALF_FIXED_DIMS get a fused update compiled for
# their row layout (numba_backend.half_layout), each with a dtype pair of its own.
LAYOUT_CASES = [
    (opt.Adam(0.05), ("bfloat16", "bfloat16")),
    (
        opt.SGD(0.3, weight_decay_factor=0.01, weight_decay_mode="decoupled"),
        ("bfloat16", "float32"),
    ),
    (opt.Adagrad(0.2, clipvalue=0.5), ("float32", "float16")),
    (opt.FTRL(0.2, l1_regularization_strength=0.05, beta=0.5), ("bfloat16", "float32")),
]


@pytest.mark.parametrize(
    ("optimizer", "dtypes"), LAYOUT_CASES, ids=[type(o).__name__ for o, _ in LAYOUT_CASES]
)
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
def test_a_16_bit_row_layout_kernel_equals_the_reference(optimizer, dtypes, scenario):
    from embengine.backends.numba_backend import half_layout, kernels_for
    from embengine.kernels import HALF_FIXED_DIMS, row_math

    dims, *rest = scenario
    scenario = ([32] * len(dims), *rest)
    assert 32 in HALF_FIXED_DIMS
    engines = [_engine(scenario, optimizer, b, dtypes) for b in ("numba", "reference")]
    table = engines[0]._physical[0]
    rm = optimizer.row_math(32)
    any_layout = {fused for fused, _ in row_math.half_kernels(rm).values()}
    assert half_layout(rm, table)[0] == 32
    assert kernels_for(optimizer, table)[0] not in any_layout  # the row layout's own kernel
    _steps(engines, scenario)


# (optimizer, dtypes) of the row layout kernels against the any-layout one, in place but for
# float16 beside bfloat16 (codegen.in_place): int32 steps saved with the row (per-row bias, no
# accumulation: one update per occurrence), three slots, clipping and weight decay, float32
# members of a 16-bit row, and rows whose rounded result overflows float16 (left unchanged).
IN_PLACE_CASES = [
    (opt.Adam(0.05, bias_correction="per_row", use_gradient_accumulation=False), DTYPES[0]),
    (opt.AMSGrad(0.05, bias_correction="per_row", sum_inside_sqrt=False), DTYPES[7]),
    (opt.RMSProp(0.05, rho=0.8, momentum=0.5, centered=True, epsilon=1e-3), DTYPES[2]),
    (opt.Adam(0.05, weight_decay_factor=0.01, weight_decay_mode="l2", clipvalue=0.5), DTYPES[3]),
    (opt.FTRL(0.2, l1_regularization_strength=0.05, beta=0.5), DTYPES[4]),  # in passes
    (opt.AdagradMomentum(0.1, momentum=0.9, use_nesterov=True), DTYPES[5]),
    (opt.Adagrad(1e5, clip_weight_min=-1e9), DTYPES[7]),  # float16 weights overflow
    (opt.SGD(0.05, clipvalue=0.5, weight_decay_factor=0.01, weight_decay_mode="l2"), DTYPES[0]),
    (opt.SGD(3e38), DTYPES[5]),  # no slots: a uint16 row of float32 weights, which overflow
]


@pytest.mark.parametrize(
    ("optimizer", "dtypes"),
    IN_PLACE_CASES,
    ids=[f"{type(o).__name__}-{w}-{s}" for o, (w, s) in IN_PLACE_CASES],
)
def test_16_bit_row_layout_kernels_equal_the_any_layout_ones(monkeypatch, optimizer, dtypes):
    """The row layout's kernel updates a 16-bit row in place, a coordinate at a time; the
    any-layout kernel copies it out, computes and rounds in passes over scratch rows. The same
    arithmetic and random bits: the same results up to float rounding, and the same rows left
    unchanged by the guard."""
    from embengine.backends import numba_backend as nbk
    from embengine.kernels import row_math

    vocab, batch, dim = 50, 16, 32
    steps = weighted_steps(np.random.default_rng(5), vocab, batch)
    results = []
    for in_place in (True, False):
        monkeypatch.setattr(nbk, "HALF_FIXED_DIMS", (dim,) if in_place else ())
        t = ee.TableConfig(
            vocab,
            dim,
            combiner="sqrtn",
            name="t",
            initializer=init.RandomUniform(-1.0, 1.0),
            weights_dtype=dtypes[0],
            slots_dtype=dtypes[1],
        )
        eng = ee.EmbeddingEngine(
            {"f": ee.FeatureConfig(t), "g": ee.FeatureConfig(t)},
            optimizer=optimizer,
            seed=1,
            nonfinite_gradients="skip_row",
        )
        table = eng._physical[0]
        rm = optimizer.row_math(dim)
        any_layout = {fused for fused, _ in row_math.half_kernels(rm).values()}
        assert (nbk.kernels_for(optimizer, table)[0] not in any_layout) == in_place
        for step, (ids, lengths, weights) in enumerate(steps):
            acts = eng.lookup(
                {"f": ee.Ragged(ids, lengths=lengths, weights=weights), "g": ids[:batch]}
            )
            grads = {
                k: (np.cos(np.arange(a.size) * 0.7 + step) * 3.0)
                .reshape(a.shape)
                .astype(np.float32)
                for k, a in acts.items()
            }
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # the overflow case's rows
                eng.apply_gradients(grads)
        state = [eng.embedding_tables["t"].copy(), *(a.copy() for a in eng.slots("t").values())]
        results.append((state, dict(eng.nonfinite_rows_skipped)))
    (fixed, skipped_fixed), (any_, skipped_any) = results
    assert skipped_fixed == skipped_any
    for a, b in zip(fixed, any_, strict=True):
        # Not always the same bits: with the row's layout constant, the compiler may fuse
        # other multiply-adds (fastmath "contract"; the float32 kernels' test allows the same),
        # and a float32 result an ulp apart may round to the neighbouring 16-bit value.
        if a.dtype.itemsize == 2:
            ha, hb = a.view(np.uint16).astype(np.int64), b.view(np.uint16).astype(np.int64)
            differ = ha != hb
            assert np.all(np.abs(ha - hb)[differ] == 1), (a, b)
            assert differ.sum() <= max(1, differ.size // 100), (a, b)
        elif a.dtype.kind == "f":
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        else:
            np.testing.assert_array_equal(a, b)
    if optimizer.learning_rate >= 1e5:  # the overflow cases
        assert skipped_fixed["t"] > 0  # the guard did leave rows unchanged


@opt.row_math("keep_old_weight_of_the_tests", slots=("kept",))
def _keep_old_weight(w, kept, g, lr):
    return -lr * g, w


@dataclasses.dataclass(frozen=True)
class _KeepOldWeight(opt.Optimizer):
    """w <- -lr * g; slot "kept" <- the weight before the step (whatever it was)."""

    learning_rate: opt.LearningRate = 0.1
    ROW_MATH = _keep_old_weight

    def slot_specs(self, dim):
        return (opt.SlotSpec("kept", dim, 0.0),)

    def reference_update(self, w, slots, g, lr, ctx):
        slots["kept"][...] = w
        w[...] = -lr * g


@pytest.mark.parametrize("backend", ["numba", "reference"])
@pytest.mark.parametrize("slots_dtype", ["bfloat16", "float16"])
def test_a_nan_whose_rounding_carries_into_its_sign_leaves_its_row_unchanged(
    monkeypatch, backend, slots_dtype
):
    """A float32 weight NaN with every payload bit set (0x7FFFFFFF), copied into a 16-bit slot:
    its bits plus the random bits carry into the sign, so rounded without a NaN case (the
    in-place kernels' ``round_*_finite``) it would be -0.0, which the check after rounding
    passes. The kernel checks each value before rounding too: the row is left unchanged and
    reported, as by the reference; the other row is updated."""
    from embengine.backends import numba_backend as nbk
    from embengine.kernels import row_math

    dim = 32
    monkeypatch.setattr(nbk, "HALF_FIXED_DIMS", (dim,))
    t = ee.TableConfig(
        4,
        dim,
        name="t",
        combiner="sum",
        initializer=init.Constant(0.5),
        weights_dtype="float32",
        slots_dtype=slots_dtype,
    )
    optimizer = _KeepOldWeight(0.1)
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t)}, optimizer=optimizer, seed=1, backend=backend
    )
    if backend == "numba":  # the in-place row layout kernel, not the any-layout one
        any_layout = {f for f, _ in row_math.half_kernels(_keep_old_weight).values()}
        assert nbk.kernels_for(optimizer, eng._physical[0])[0] not in any_layout
    eng.embedding_tables["t"].view(np.uint32)[1, 3] = 0x7FFFFFFF
    eng.lookup({"f": ee.Ragged([0, 1], lengths=[1, 1])})
    with pytest.raises(ee.NonFiniteUpdateError, match=r"table 't': 1 rows \(ids 1\)"):
        eng.apply_gradients({"f": np.ones((2, dim), np.float32)})
    w, kept = eng.embedding_tables["t"], eng.slots("t")["kept"].astype(np.float32)
    np.testing.assert_array_equal(kept[1], np.zeros(dim, np.float32))  # not written
    assert w.view(np.uint32)[1, 3] == 0x7FFFFFFF and w[1, 0] == np.float32(0.5)
    np.testing.assert_array_equal(kept[0], np.full(dim, 0.5, np.float32))
    np.testing.assert_array_equal(w[0], np.full(dim, -0.1, np.float32))


def test_16_bit_row_layout_kernels_only_where_they_pay():
    """Short rows, SGD's float16 weights and row-wise Adagrad (a scalar slot) keep the
    any-layout 16-bit kernel: a kernel per layout measured slower for the latter two; SGD's
    bfloat16 weights get one, in place."""
    from embengine.backends.numba_backend import half_layout

    def table(dim, optimizer, weights="bfloat16"):
        t = ee.TableConfig(4, dim, name="t", weights_dtype=weights, slots_dtype="bfloat16")
        engine = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=optimizer)
        return optimizer.row_math(dim), engine._physical[0]

    assert half_layout(*table(8, opt.Adam(0.1))) is None
    assert half_layout(*table(64, opt.SGD(0.1))) == (64, 0, 0, 0, 0, 0, 0)
    assert half_layout(*table(64, opt.SGD(0.1), "float16")) is None
    assert half_layout(*table(64, opt.Adagrad(0.1, hessian_compression_times=64))) is None
    rm, t = table(64, opt.Adam(0.1))
    assert half_layout(rm, t) == (
        64,
        *[t.columns[n].start for n in ("momenta",)],
        64,
        t.columns["velocities"].start,
        64,
        0,
        0,
    )


def test_row_layout_kernels_update_in_place_but_for_float16_beside_another_16_bit_type():
    from embengine.kernels import codegen

    rendered = codegen.render([opt.Adam(0.1).row_math(64)])
    for w, s in codegen.half_pairs(opt.Adam(0.1).row_math(64)):
        factory = rendered.split(f"def fixed_fused_update_half_adam_{w}_{s}(LAYOUT):")[1]
        factory = factory.split("return fused_update_half_")[0]
        in_place = "old_h[" in factory
        assert in_place == codegen.in_place(w, s), (w, s)
        assert in_place == (w == s == "bf16" or "f32" in (w, s)), (w, s)
    rendered = codegen.render([opt.SGD(0.1).row_math(64)])  # no slots: in place but float16
    for w, s in codegen.half_pairs(opt.SGD(0.1).row_math(64)):
        factory = rendered.split(f"def fixed_fused_update_half_sgd_{w}_{s}(LAYOUT):")[1]
        factory = factory.split("return fused_update_half_")[0]
        in_place = "old_h[" in factory or "old_f[" in factory  # a 16-bit or float32 column
        assert in_place == codegen.in_place(w, s, slots=False) == (w != "f16"), (w, s)


def test_no_row_layout_kernel_for_slots_narrower_than_the_row(monkeypatch):
    """The in-place kernel updates a coordinate's weight and slot values together, so a float
    slot must hold a value per coordinate (or be absent) for it to serve the table; and a row
    math that declares no kernel for a constant layout (``fixed_layout=False``) gets none."""
    from embengine.backends import numba_backend as nbk

    t = ee.TableConfig(4, 64, name="t", weights_dtype="bfloat16", slots_dtype="bfloat16")
    table = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=opt.Adam(0.1))._physical[0]
    rm = opt.Adam(0.1).row_math(64)
    columns = nbk._float_slot_columns(table)
    assert nbk.half_layout(rm, table) == (64, *columns)
    narrow = columns.copy()
    narrow[3] = 32  # the second slot half as wide as the row
    assert nbk.half_layout(dataclasses.replace(rm, fixed_layout=False), table) is None
    monkeypatch.setattr(nbk, "_float_slot_columns", lambda _: narrow)
    assert nbk.half_layout(rm, table) is None


@pytest.mark.parametrize("weights", ["bfloat16", "float16"])
def test_a_lookup_only_batch_pools_16_bit_weights_from_the_table_rows(monkeypatch, weights):
    """A lookup-only batch of a table of 16-bit weights is pooled from its uint16 rows, each
    value widened as it is read, as a training lookup pools: the same activations, and no
    widened copy of the occurrences' rows (``rounding.widen_rows``)."""
    from embengine.kernels import rounding

    t = ee.TableConfig(
        50,
        64,
        name="t",
        combiner="sum",
        initializer=init.RandomUniform(-1.0, 1.0),
        weights_dtype=weights,
    )
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=opt.Adam(0.1), seed=2)
    rng = np.random.default_rng(4)
    lengths = rng.integers(0, 6, 40)
    ids = rng.integers(0, 50, lengths.sum())
    w = rng.choice([0.5, 2.0, -1.0], lengths.sum()).astype(np.float32)
    features = {"f": ee.Ragged(ids, lengths=lengths, weights=w)}

    def no_copy(*args):
        raise AssertionError("a lookup-only batch widened a copy of its rows")

    monkeypatch.setattr(rounding, "widen_rows", no_copy)
    got = eng.lookup(features, training=False)["f"]
    want = eng.lookup(features)["f"]  # the training lookup: pool_tables on the uint16 rows
    np.testing.assert_array_equal(got, want)
    table = eng.embedding_tables["t"].astype(np.float64)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for b in range(40):
        k = slice(starts[b], starts[b + 1])
        expect = (w[k, None] * table[ids[k]]).sum(0)
        np.testing.assert_allclose(got[b], expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["numba", "reference"])
@pytest.mark.parametrize("weights", ["bfloat16", "float16"])
def test_lookup_rows_of_16_bit_rows_takes_lookup_only_batches_too(backend, weights):
    """``lookup_rows(rows, dim, batch, weights_dtype=)`` of a 16-bit table's uint16 rows, for
    a lookup-only batch as for a deduplicated one, on both backends: the table's own lookup,
    bit for bit (numba's refused lookup-only batches where the reference took them)."""
    t = ee.TableConfig(
        40,
        6,
        name="t",
        combiner="mean",
        initializer=init.RandomUniform(-1.0, 1.0),
        weights_dtype=weights,
    )
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t), "s": ee.FeatureConfig(t, max_sequence_length=3)},
        optimizer=opt.Adagrad(0.1),
        backend=backend,
        seed=2,
    )
    rng = np.random.default_rng(6)
    feats = {
        "f": [list(rng.integers(0, 40, rng.integers(0, 5))) for _ in range(30)],
        "s": [list(rng.integers(0, 40, rng.integers(0, 4))) for _ in range(30)],
    }
    be, table = eng._backend, eng._physical[0]
    assert table.data.dtype == np.uint16
    for training in (False, True):
        tb = eng.preprocess(feats, training=training).tables[0]
        want = be.lookup(table, tb)
        got = be.lookup_rows(table.data, 6, tb, weights_dtype=weights)
        assert got.tobytes() == want.tobytes(), training
        out = np.full(want.shape, np.nan, np.float32)
        assert be.lookup_rows(table.data, 6, tb, out=out, weights_dtype=weights) is out
        assert out.tobytes() == want.tobytes()


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "float16"])
def test_numba_lookup_rows_refuses_rows_past_the_array_given(weights):
    """The numba kernels read rows by index without bounds checks: ``lookup_rows`` refuses a
    batch reading past the rows it is given, lookup-only or deduplicated, in any weights
    dtype (the 16-bit lookup-only path read them, as the float32 paths did; the reference
    backend's numpy indexing raises IndexError)."""
    t = ee.TableConfig(
        40, 6, name="t", initializer=init.RandomUniform(-1.0, 1.0), weights_dtype=weights
    )
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t)}, optimizer=opt.SGD(0.1), backend="numba", seed=2
    )
    be, table = eng._backend, eng._physical[0]
    short = np.ascontiguousarray(table.data[:10])  # a view: row 39 is still readable memory
    for training in (False, True):
        tb = eng.preprocess({"f": [[3, 39], [1]]}, training=training).tables[0]
        with pytest.raises(ValueError, match="row 39 of a batch is past the 10 rows given"):
            be.lookup_rows(short, 6, tb, weights_dtype=weights)
        out = np.zeros((2, 6), np.float32)
        with pytest.raises(ValueError, match="row 39 of a batch is past the 10 rows given"):
            be.lookup_rows(short, 6, tb, out=out, weights_dtype=weights)
        # within the rows given: pooled as from the whole table
        tb = eng.preprocess({"f": [[3, 9], [1]]}, training=training).tables[0]
        assert be.lookup_rows(short, 6, tb, weights_dtype=weights).tobytes() == (
            be.lookup(table, tb).tobytes()
        )


def test_a_training_lookup_pools_16_bit_weights_from_the_table_rows():
    """A training lookup pools a table of 16-bit weights straight from its uint16 rows, each
    value widened as it is read (the same values as a widened copy, so the same activations:
    the reference tests above); float32 weights in a 16-bit row through the row's float32
    view."""
    from embengine.backends.numba_backend import _pooled_rows
    from embengine.precision import BF16, F16, F32

    rows = np.array([3, -1, 5], dtype=np.int64)
    for weights, slots, kind in (
        ("bfloat16", "float32", BF16),
        ("float16", "bfloat16", F16),
        ("float32", "bfloat16", F32),
    ):
        t = ee.TableConfig(10, 8, name="t", weights_dtype=weights, slots_dtype=slots)
        table = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=opt.Adam(0.1))._physical[0]
        data, got, k = _pooled_rows(table, rows)
        assert k == kind
        if kind == F32:
            assert data.dtype == np.float32 and data.base is not None  # a view, no copy
        else:
            assert data is table.data and got is rows


@pytest.mark.parametrize("weights", ["bfloat16", "float16"])
@pytest.mark.parametrize("quantized", [False, True])
def test_lookup_rows_pools_16_bit_weights_as_the_widened_rows(weights, quantized):
    """``Backend.lookup_rows(..., weights_dtype=)`` of uint16 rows (a ShardedEngine's 16-bit
    shard, or 16-bit rows received): what the widened float32 rows pool, on both backends,
    into ``out`` or a new array; a row of -1 pools nothing; bad input named."""
    from embengine.backends.numba_backend import NumbaBackend
    from embengine.backends.reference import ReferenceBackend
    from embengine.batch import TableBatch
    from embengine.precision import KIND, nearest, widen

    rng = np.random.default_rng(5)
    dim, width, n = 5, 9, 12  # weights in the first dim units of wider rows
    values = rng.normal(size=(n, width)).astype(np.float32)
    rows16 = nearest(values, KIND[weights])
    wide = widen(rows16[:, :dim], KIND[weights])
    # 7 occurrences over 4 activation rows (the second empty), rows with duplicates and -1
    unique = np.array([3, -1, 11, 0, 3, 7, 3], np.int64)
    segments = np.array([0, 0, 2, 2, 2, 3, 3], np.int64)
    each = np.arange(8, dtype=np.int64)
    gains = rng.uniform(0.5, 2, 7).astype(np.float32)
    tb = TableBatch(
        unique_ids=each[:7] * 10,
        inverse=each[:7],
        gains=gains,
        segments=segments,
        num_outputs=4,
        output_offsets=np.array([0, 2, 2, 5, 7], np.int64),
        unique_offsets=each,
        unique_gains=gains,
        unique_segments=segments,
        unique_bounds=np.array([0, 7], np.int64),
        unique_rows=unique,
    )
    q = ee.QuantizationConfig(32, -1.0, 1.0) if quantized else None
    want = ReferenceBackend().lookup_rows(wide, dim, tb, q)
    assert np.abs(want[1]).max() == 0 and np.abs(want[0]).max() > 0
    for backend in (NumbaBackend(), ReferenceBackend()):
        got = backend.lookup_rows(rows16, dim, tb, q, weights_dtype=weights)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        out = np.full((4, dim), np.nan, np.float32)
        assert backend.lookup_rows(rows16, dim, tb, q, out=out, weights_dtype=weights) is out
        np.testing.assert_array_equal(out, got)
    numba = NumbaBackend()
    # the same bits as the float32 kernel pooling the widened copy
    np.testing.assert_array_equal(
        numba.lookup_rows(rows16, dim, tb, q, weights_dtype=weights),
        numba.lookup_rows(np.ascontiguousarray(wide), dim, tb, q),
    )
    with pytest.raises(ValueError, match="needs a C-contiguous uint16"):
        numba.lookup_rows(values, dim, tb, weights_dtype=weights)
    with pytest.raises(ValueError, match="weights_dtype must be"):
        numba.lookup_rows(rows16, dim, tb, weights_dtype="int8")
    with pytest.raises(ValueError, match="row 11 of a batch is past the 10 rows"):
        numba.lookup_rows(np.ascontiguousarray(rows16[:10]), dim, tb, weights_dtype=weights)
    for backend in (numba, ReferenceBackend()):  # both refuse what is not 16-bit rows
        with pytest.raises(ValueError, match="needs a (C-contiguous )?uint16"):
            backend.lookup_rows(values, dim, tb, weights_dtype=weights)  # float32 values
        with pytest.raises(ValueError, match="needs a (C-contiguous )?uint16"):
            backend.lookup_rows(np.ascontiguousarray(rows16[:, :3]), dim, tb, weights_dtype=weights)
        with pytest.raises(ValueError, match="weights_dtype must be"):
            backend.lookup_rows(rows16, dim, tb, weights_dtype="float64")


@_with_dtypes(COUNTING)
@SETTINGS
@given(scenario=scenarios())
def test_reduced_precision_counting_optimizers(optimizer, dtypes, scenario):
    dims, *rest = scenario
    scenario = ([1] * len(dims), *rest)
    engines = [_engine(scenario, optimizer, b, dtypes) for b in ("numba", "reference")]
    _steps(engines, scenario)


@pytest.mark.parametrize("backend", ["numba", "reference"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_updates_below_half_a_quantum_are_kept_on_average(backend, dtype):
    # w = 1 and 200 steps of SGD move each weight by +2e-4: round-to-nearest would keep 1.0
    # (half a quantum at 1 is 2**-9 in bfloat16, 2**-12 in float16).
    vocab, steps = 64, 200
    t = ee.TableConfig(
        vocab, 8, name="t", combiner="sum", initializer=init.Constant(1.0), weights_dtype=dtype
    )
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t)}, optimizer=opt.SGD(2e-4), seed=1, backend=backend
    )
    ids = np.arange(vocab)
    for _ in range(steps):
        acts = eng.lookup({"f": ee.Ragged(ids, lengths=np.ones(vocab, np.int64))})
        eng.apply_gradients({"f": -np.ones_like(acts["f"])})
    w = eng.embedding_tables["t"].astype(np.float64)
    assert eng.embedding_tables["t"].dtype == ee.precision.numpy_dtype(dtype)
    assert abs(w.mean() - (1.0 + steps * 2e-4)) < 0.004, w.mean()


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_a_float16_overflow_leaves_the_row_unchanged(backend):
    t = ee.TableConfig(
        4, 2, name="t", combiner="sum", initializer=init.Constant(60000.0), weights_dtype="float16"
    )
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t)}, optimizer=opt.SGD(1.0), seed=1, backend=backend
    )
    acts = eng.lookup({"f": ee.Ragged([0, 1], lengths=[1, 1])})
    grads = np.array([[-10000.0, 0.0], [1.0, 1.0]], np.float32)  # row 0 would pass 65504
    with pytest.raises(ee.NonFiniteUpdateError):
        eng.apply_gradients({"f": grads})
    w = eng.embedding_tables["t"].astype(np.float32)
    np.testing.assert_array_equal(w[0], [60000.0, 60000.0])
    assert w[1, 0] in (np.float32(59968.0), np.float32(60000.0)), w[1]
    assert acts["f"].dtype == np.float32


@pytest.mark.parametrize(
    "optimizer", [opt.SGD(0.1), opt.Adam(0.1), opt.Adagrad(0.1)], ids=lambda o: type(o).__name__
)
def test_table_bytes_halve(optimizer):
    def nbytes(dtype):
        t = ee.TableConfig(1000, 64, name="t", weights_dtype=dtype, slots_dtype=dtype)
        eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=optimizer)
        storage = eng._tables[0].table  # the DenseTable: its row array's bytes
        assert storage.nbytes == storage.data.nbytes
        return storage.nbytes

    assert nbytes("bfloat16") * 2 == nbytes("float32")
    assert nbytes("float16") * 2 == nbytes("float32")
    # table_stats counts the stored bytes (it counted a 16-bit row's units as float32)
    for dtype in ("float32", "bfloat16", "float16"):
        t = ee.TableConfig(1000, 64, name="t", weights_dtype=dtype, slots_dtype=dtype)
        eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=optimizer)
        assert eng.table_stats()["t"]["bytes"]["rows"] == eng._tables[0].table.data.nbytes


def test_dtypes_are_checked_and_named():
    with pytest.raises(
        ValueError,
        match=r"TableConfig\(name='t'\): weights_dtype must be one of "
        r"\['float32', 'float16', 'bfloat16'\], got 'fp8'",
    ):
        ee.TableConfig(10, 4, name="t", weights_dtype="fp8")
    with pytest.raises(ValueError, match=r"slots_dtype must be one of .* got 16"):
        ee.TableConfig(10, 4, name="t", slots_dtype=16)
    keyed = ee.TableConfig(None, 4, name="k", weights_dtype="bfloat16", slots_dtype="float16")
    assert (keyed.weights_dtype, keyed.slots_dtype) == ("bfloat16", "float16")


def test_tables_of_other_dtypes_are_not_packed_and_the_plan_keeps_them():
    a = ee.TableConfig(10, 2, name="a", weights_dtype="bfloat16", slots_dtype="bfloat16")
    b = ee.TableConfig(10, 2, name="b")
    c = ee.TableConfig(10, 2, name="c", weights_dtype="bfloat16", slots_dtype="bfloat16")
    eng = ee.EmbeddingEngine(
        {n: ee.FeatureConfig(t) for n, t in zip("abc", (a, b, c), strict=True)},
        optimizer=opt.Adagrad(0.1, low_dimensional_packing_status=True),
    )
    plan = eng.storage_plan
    assert [p.table_names for p in plan.physical_tables] == [("a", "c"), ("b",)]
    assert plan.physical_tables[0].weights_dtype == "bfloat16"
    assert StoragePlan.from_json(plan.to_json()) == plan
    assert "weights_dtype" not in plan.to_json()["physical_tables"][1]  # float32: as before
    packing = opt.Adagrad(0.1, low_dimensional_packing_status=True)
    assert plan == plan_storage(eng._resolved, [packing] * 3)


def test_spec_round_trip_keeps_the_dtypes():
    t = ee.TableConfig(10, 4, name="t", weights_dtype="float16", slots_dtype="bfloat16")
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=opt.Adam(0.1))
    spec = eng.spec()
    assert spec["tables"][0]["weights_dtype"] == "float16"
    assert spec["tables"][0]["slots_dtype"] == "bfloat16"
    again = ee.EmbeddingEngine.from_spec(spec)
    assert again.embedding_tables["t"].dtype == np.float16
    assert again.slots("t")["momenta"].dtype == ee.precision.numpy_dtype("bfloat16")
    plain = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(ee.TableConfig(10, 4, name="t"))}, optimizer=opt.SGD(0.1)
    )
    assert "weights_dtype" not in plain.spec()["tables"][0]


def _trained(dtypes, backend="numba", optimizer=None, seed=3):
    t = ee.TableConfig(
        20, 4, name="t", combiner="sum", weights_dtype=dtypes[0], slots_dtype=dtypes[1]
    )
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t)}, optimizer=optimizer or opt.Adam(0.1), seed=seed, backend=backend
    )
    rng = np.random.default_rng(0)
    for _ in range(3):
        acts = eng.lookup({"f": ee.Ragged(rng.integers(0, 20, 12), lengths=[4, 4, 4])})
        eng.apply_gradients({"f": rng.normal(size=acts["f"].shape).astype(np.float32)})
    return eng


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint32)


@pytest.mark.parametrize("dtypes", [("bfloat16", "bfloat16"), ("float16", "float32")])
def test_checkpoints_store_the_stored_dtype_and_restore_its_bits(tmp_path, dtypes):
    from embengine.safetensors_io import read_header

    eng = _trained(dtypes)
    ckpt = eng.save(tmp_path / "ck")
    header, _ = read_header(next(ckpt.glob("*.safetensors")))
    want = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
    assert header["t"]["dtype"] == want[dtypes[0]]
    assert header["t/momenta"]["dtype"] == want[dtypes[1]]
    assert header["t/momenta"]["shape"] == [20, 4]
    other = _trained(dtypes, seed=9)  # other values, then the checkpoint's
    other.restore(ckpt)
    for again in (ee.EmbeddingEngine.load(ckpt), other):
        np.testing.assert_array_equal(
            _bits(again.embedding_tables["t"]), _bits(eng.embedding_tables["t"])
        )
        for name, a in eng.slots("t").items():
            assert again.slots("t")[name].dtype == a.dtype
            np.testing.assert_array_equal(_bits(again.slots("t")[name]), _bits(a))
    # training continues identically after the restore (same rounding stream: same seed)
    a, b = _trained(dtypes), ee.EmbeddingEngine.load(ckpt)
    for e in (a, b):
        acts = e.lookup({"f": ee.Ragged([1, 2, 3], lengths=[3])})
        e.apply_gradients({"f": np.ones_like(acts["f"])})
    np.testing.assert_array_equal(_bits(a.embedding_tables["t"]), _bits(b.embedding_tables["t"]))


def test_a_checkpoint_of_another_dtype_is_refused_not_cast(tmp_path):
    ckpt = _trained(("float32", "float32")).save(tmp_path / "ck")
    half = _trained(("bfloat16", "float32"))
    before = np.array(half.embedding_tables["t"])
    with pytest.raises(
        ee.checkpoint.CheckpointError,
        match=r"table 't': the checkpoint stores weights_dtype 'float32', the "
        r"engine 'bfloat16'.*astype",
    ):
        half.restore(ckpt)
    np.testing.assert_array_equal(_bits(half.embedding_tables["t"]), _bits(before))
    # the explicit cast: the caller converts the state's arrays
    state = ee.EmbeddingEngine.load(ckpt).state_dict()
    weights = state["tables"]["t"]["weights"]
    state["tables"]["t"]["weights"] = weights.astype(half.embedding_tables["t"].dtype)
    half.load_state_dict(state)
    np.testing.assert_allclose(half.embedding_tables["t"].astype(np.float32), weights, rtol=2**-8)
    with pytest.raises(ValueError, match=r"float32 .*bfloat16"):
        state["tables"]["t"]["weights"] = weights
        half.load_state_dict(state)


@pytest.mark.parametrize("compress", ["fp32", "fp16", "bf16"])
def test_export_and_serving_read_16_bit_tables(tmp_path, compress):
    from embengine.serving import ServingEngine, export

    eng = _trained(("bfloat16", "bfloat16"))
    ckpt = eng.save(tmp_path / "ck")
    report = export(ckpt, tmp_path / "out", compress=compress)
    # the report's "fp32 MiB" column: the table as float32, whatever it is stored in
    assert [r["bytes_before"] for r in report.rows] == [20 * 4 * 4]
    serving = ServingEngine.load(tmp_path / "out")
    features = {"f": ee.Ragged([0, 3, 3, 7], lengths=[1, 3])}
    got = serving.lookup(features)["f"]
    want = eng.lookup(features, training=False)["f"]
    # bfloat16 values are exact in float32 and float16 keeps bfloat16's 8 bits where in range
    np.testing.assert_allclose(got, want, rtol=1e-6 if compress != "fp16" else 1e-3, atol=1e-6)


# -- embengine train --weights-dtype -----------------------------------------------------------


@pytest.mark.parametrize("vocabulary", ["fixed", "dynamic"])
def test_cli_trains_bfloat16_tables_and_checkpoints_them(capsys, tmp_path, vocabulary):
    pytest.importorskip("torch")
    from embengine import cli

    ckpt = tmp_path / "ck"
    code = cli.main(
        [
            "train",
            *SYN_ARGS,
            "--vocabulary",
            vocabulary,
            "--steps",
            "40",
            "--weights-dtype",
            "bfloat16",
            "--slots-dtype",
            "bfloat16",
            "--checkpoint-dir",
            str(ckpt),
        ]
    )
    assert code == 0, capsys.readouterr().err
    assert "test AUC" in capsys.readouterr().out
    spec = ee.EmbeddingEngine.load(ckpt).spec()
    keyed = {t["vocabulary_size"] is None for t in spec["tables"]}
    assert keyed == {vocabulary == "dynamic"}
    assert {t["weights_dtype"] for t in spec["tables"]} == {"bfloat16"}
    assert {t["slots_dtype"] for t in spec["tables"]} == {"bfloat16"}


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--slots-dtype", "float16", "--embeddings", "torch", "--optimizer", "sgd"],
            "leave --embeddings at engine",
        ),
    ],
)
def test_cli_refuses_16_bit_tables_where_they_are_not_supported(capsys, extra, message):
    from embengine import cli

    assert cli.main(["train", *SYN_ARGS, "--steps", "1", *extra]) == 2
    assert message in capsys.readouterr().err


def test_cli_unknown_dtype_exits_2_listing_the_choices(capsys):
    from embengine import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["train", *SYN_ARGS, "--weights-dtype", "fp8"])
    assert exc.value.code == 2
    assert "bfloat16" in capsys.readouterr().err


def test_torch_layer_state_dict_round_trips_16_bit_tables():
    torch = pytest.importorskip("torch")
    from embengine.torch import EmbeddingLayer

    a = EmbeddingLayer(_trained(("bfloat16", "float16")))
    state = a.state_dict()
    assert state["tables.t.weights"].dtype == torch.bfloat16
    assert state["tables.t.momenta"].dtype == torch.float16
    b = EmbeddingLayer(_trained(("bfloat16", "float16"), seed=11))
    b.load_state_dict(state)
    np.testing.assert_array_equal(
        _bits(b.engine.embedding_tables["t"]), _bits(a.engine.embedding_tables["t"])
    )
    np.testing.assert_array_equal(
        _bits(b.engine.slots("t")["velocities"]), _bits(a.engine.slots("t")["velocities"])
    )


def test_a_checkpoint_readers_arrays_come_in_the_stored_dtype(tmp_path):
    """CheckpointReader.array / rows gave a bfloat16 slot (and array the bfloat16 weights)
    as its raw bits, uint16: 0.0999 read as 15821. Every accessor gives the stored dtype."""
    from embengine.checkpoint import read_checkpoint

    eng = _trained(("bfloat16", "bfloat16"), optimizer=opt.Adagrad(0.1))
    ckpt = eng.save(tmp_path / "ck")
    bf16 = ee.precision.numpy_dtype("bfloat16")
    _, reader = read_checkpoint(ckpt)
    with reader:
        for entry, want in [("weights", eng.embedding_tables["t"])] + list(eng.slots("t").items()):
            for how, got in [
                ("array", reader.array("t", entry)),
                ("rows", np.asarray(reader.rows("t", entry))),
                ("rows[a:b]", reader.rows("t", entry)[2:5]),
            ]:
                assert got.dtype == reader.tensor("t", entry).dtype == bf16, (entry, how)
                n = len(got)
                np.testing.assert_array_equal(
                    _bits(got), _bits(want[2:5] if n == 3 else want), err_msg=f"{entry} {how}"
                )


def test_initial_values_past_a_16_bit_range_are_refused_not_stored_as_inf():
    """Initial values are rounded to nearest: a float16 table given Constant(1e5) held Inf
    rows (a NumPy warning at most; every lookup Inf, every update refused), and a float16
    Adagrad accumulator of 1e5 was Inf. Refused, naming the table, the value and the row."""

    def engine(vocabulary, initializer, optimizer=None, weights="float16", slots="float32"):
        t = ee.TableConfig(
            vocabulary,
            4,
            name="t",
            initializer=initializer,
            weights_dtype=weights,
            slots_dtype=slots,
        )
        optimizer = optimizer or opt.SGD(0.1)
        return ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=optimizer)

    with pytest.raises(ValueError, match=r"table 't': its initializer gives 100000.0 \(row 0\), "):
        engine(10, init.Constant(1e5))

    def pretrained(shape, dtype):
        values = np.zeros(shape, np.float32)
        values[3, 1] = -7e4
        return values

    with pytest.raises(ValueError, match=r"gives -70000.0 \(row 3\), beyond float16's range"):
        engine(10, init.FromFunction(pretrained))
    with pytest.raises(ValueError, match=r"table 't': its initializer RandomUniform.* float16"):
        engine(None, init.RandomUniform(-1e5, 1e5))
    for vocabulary in (10, None):
        with pytest.raises(ValueError, match=r"slot 'accumulators'.s value gives 100000.0, "):
            engine(
                vocabulary,
                None,
                opt.Adagrad(0.1, initial_accumulator_value=1e5),
                "float32",
                "float16",
            )
    # a keyed table's FromFunction values are known when its keys arrive: refused then, as
    # its non-finite values are
    keyed = engine(None, init.FromFunction(pretrained))
    with pytest.raises(ValueError, match=r"gives -70000.0 \(key 13\), beyond float16's range"):
        keyed.lookup({"f": ee.Ragged([10, 11, 12, 13], lengths=[4])}, training=True)
    # in range: stored, as bfloat16 holds 1e5
    eng = engine(10, init.Constant(65504.0))
    assert (eng.embedding_tables["t"] == np.float16(65504.0)).all()
    eng = engine(None, init.Constant(1e5), weights="bfloat16")
    acts = eng.lookup({"f": ee.Ragged([7], lengths=[1])}, training=True)
    assert np.isfinite(acts["f"]).all() and acts["f"][0, 0] == np.float32(99840.0)
