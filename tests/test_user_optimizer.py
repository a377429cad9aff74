"""An optimizer defined outside embengine (here, in this file) is a spec plus its registered row
math, and gets a numba kernel equal to its reference; limits show when the engine is built."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

import embengine as ee
from embengine import initializers as init
from embengine.optimizers import LearningRate, Optimizer, SlotSpec, row_math


@row_math(
    "yogi_of_the_tests", params=("beta_1", "beta_2", "epsilon"), slots=("momenta", "velocities")
)
def yogi_update(w, momenta, velocities, g, lr, beta_1, beta_2, epsilon):
    m = beta_1 * momenta + (1.0 - beta_1) * g
    g2 = g * g
    v = velocities - (1.0 - beta_2) * np.sign(velocities - g2) * g2
    return w - lr * m / (np.sqrt(v) + epsilon), m, v


@dataclass(frozen=True)
class Yogi(Optimizer):
    """Yogi (Zaheer et al. 2018)::

    m <- beta_1 * m + (1 - beta_1) * g                 # slot "momenta"
    v <- v - (1 - beta_2) * sign(v - g^2) * g^2        # slot "velocities", starts at 1e-6
    w <- w - lr * m / (sqrt(v) + epsilon)
    """

    learning_rate: LearningRate = 0.01
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-3

    ROW_MATH = yogi_update

    def slot_specs(self, dim):
        return (SlotSpec("momenta", dim, 0.0), SlotSpec("velocities", dim, 1e-6))

    def reference_update(self, w, slots, g, lr, ctx):
        m, v = slots["momenta"], slots["velocities"]
        m[...] = self.beta_1 * m + (1.0 - self.beta_1) * g
        v[...] = v - (1.0 - self.beta_2) * np.sign(v - g * g) * g * g
        w -= lr * m / (np.sqrt(v) + self.epsilon)


def _train(optimizer, backend, dim, steps=4, dtype="float32"):
    t = ee.TableConfig(
        30,
        dim,
        name="t",
        combiner="sqrtn",
        initializer=init.RandomUniform(-1.0, 1.0),
        weights_dtype=dtype,
        slots_dtype=dtype,
    )
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t), "g": ee.FeatureConfig(t)},
        optimizer=optimizer,
        backend=backend,
        seed=2,
    )
    rng = np.random.default_rng(7)
    for step in range(steps):
        lengths = rng.integers(0, 4, 10)
        ids = rng.zipf(1.5, lengths.sum()) % 30  # duplicates and empty bags
        acts = eng.lookup({"f": ee.Ragged(ids, lengths=lengths), "g": ids[:10]})
        eng.apply_gradients(
            {
                k: np.sin(np.arange(a.size) * 0.3 + step).reshape(a.shape).astype(np.float32)
                for k, a in acts.items()
            }
        )
    return eng.embedding_tables["t"].copy(), eng.slots("t")


@pytest.mark.parametrize("dim", [8, 6])  # 8: the fixed-layout kernel; 6: the any-layout one
@pytest.mark.parametrize(
    "optimizer",
    [
        Yogi(0.05),
        Yogi(0.05, use_gradient_accumulation=False, clip_weight_min=-0.8, clip_weight_max=0.9),
        Yogi(0.05, beta_1=0.5, weight_decay_factor=0.1, weight_decay_mode="l2", clipvalue=0.5),
    ],
)
def test_an_optimizer_defined_here_runs_on_numba_as_its_reference(optimizer, dim):
    w_ref, s_ref = _train(optimizer, "reference", dim)
    w_nb, s_nb = _train(optimizer, "numba", dim)
    assert not np.allclose(w_ref, _train(optimizer, "reference", dim, steps=0)[0])  # it trained
    np.testing.assert_allclose(w_nb, w_ref, rtol=1e-5, atol=1e-6)
    for k in s_ref:
        np.testing.assert_allclose(s_nb[k], s_ref[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_its_kernels_are_rendered_into_a_file_named_by_their_hash():
    from embengine.backends import numba_backend as nbk
    from embengine.kernels import codegen
    from embengine.kernels import row_math as kernels

    fused, every_row, fixed = kernels.kernels(yogi_update)
    path = fused.py_func.__code__.co_filename
    assert "yogi_of_the_tests" in path and path.endswith(".py")
    text = open(path).read()
    assert text == codegen.render([yogi_update])
    assert codegen.row_math_digest([yogi_update]) in text  # the template's and the source's hash
    assert "wj, momenta, velocities = yogi_update(" in text and "    beta_2 = hp[" in text
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(ee.TableConfig(10, 16, name="t"))}, optimizer=Yogi(0.1)
    )
    assert nbk.fixed_layout(yogi_update, eng._physical[0]) == (16, 2)


def _engine(optimizer, backend="numba", dim=4):
    t = ee.TableConfig(10, dim, name="items")
    return ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=optimizer, backend=backend)


def test_a_spec_without_row_math_is_refused_by_numba_when_the_engine_is_built():
    @dataclass(frozen=True)
    class NoKernel(Optimizer):
        def reference_update(self, w, slots, g, lr, ctx):
            w -= lr * g

    _engine(NoKernel(0.1), "reference")  # the reference backend runs any spec
    with pytest.raises(
        TypeError,
        match="table 'items': the numba backend has no row math for NoKernel; register one",
    ):
        _engine(NoKernel(0.1))


def test_capability_limits_are_checked_when_the_engine_is_built():
    @dataclass(frozen=True)
    class WrongSlots(Yogi):
        def slot_specs(self, dim):
            return (SlotSpec("velocities", dim, 1e-6), SlotSpec("momenta", dim, 0.0))

    with pytest.raises(
        ValueError,
        match=r"table 'items': WrongSlots keeps the float slots "
        r"\('velocities', 'momenta'\), but its row math",
    ):
        _engine(WrongSlots(0.1))

    @row_math("counting_of_the_tests", needs_accumulation=True, every_row=False)
    def count(w, lr):
        return w + lr

    @dataclass(frozen=True)
    class Count(Optimizer):
        lazy: bool = True
        ROW_MATH = count

        @property
        def updates_every_row(self):
            return not self.lazy

    with pytest.raises(
        ValueError,
        match="table 'items': the row math 'counting_of_the_tests' "
        "of Count needs use_gradient_accumulation=True",
    ):
        _engine(Count(0.1, use_gradient_accumulation=False))
    with pytest.raises(ValueError, match="table 'items': Count updates every row each step"):
        _engine(Count(0.1, lazy=False))


def test_registration_checks_names():
    def f(w, g, lr, rho):
        return w

    with pytest.raises(ValueError, match=r"f takes \['rho'\], which are none of the names"):
        row_math("bad_of_the_tests")(f)
    with pytest.raises(ValueError, match="'yogi_of_the_tests' is registered already"):
        row_math("yogi_of_the_tests", params=("rho",))(f)
    with pytest.raises(ValueError, match="slot 'momenta' is not an argument"):
        row_math("bad_of_the_tests", params=("rho",), slots=("momenta",))(f)
    with pytest.raises(ValueError, match="at most 3 float slots"):
        row_math("bad_of_the_tests", slots=("a", "b", "c", "d"))(f)

    @row_math("shadowing_of_the_tests", params=("data",))
    def shadow(w, data):
        return w + data

    @dataclass(frozen=True)
    class Shadow(Optimizer):
        data: float = 1.0
        ROW_MATH = shadow

    # "data" is the kernel's table argument: the generated code could not use it as a param.
    with pytest.raises(
        ValueError,
        match=r"table 'items': row math 'shadowing_of_the_tests': "
        r"\['data'\] are names the update kernels use",
    ):
        _engine(Shadow(0.1))


def test_a_checkpoint_of_it_loads_as_it_and_trains_on_bit_for_bit(tmp_path):
    from embengine.spec import SpecError, optimizer_from_json

    def steps(eng, first, n):
        for step in range(first, first + n):
            ids = (np.arange(12) * (step + 3)) % 30
            acts = eng.lookup({"f": ee.Ragged(ids, lengths=[3, 0, 5, 4])})
            eng.apply_gradients({"f": np.cos(acts["f"] * 3.0 + step).astype(np.float32)})

    t = ee.TableConfig(30, 8, name="t", combiner="sum")
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=Yogi(0.05, beta_1=0.5))
    steps(eng, 0, 2)
    entry = eng.spec()["tables"][0]["optimizer"]  # its own class and fields, not the base's
    assert (entry["class"], entry["params"]["beta_1"]) == ("Yogi", 0.5)
    loaded = ee.EmbeddingEngine.load(eng.save(tmp_path))
    assert loaded.spec()["tables"] == eng.spec()["tables"]
    steps(eng, 2, 2)
    steps(loaded, 2, 2)
    np.testing.assert_array_equal(loaded.embedding_tables["t"], eng.embedding_tables["t"])
    for k, v in eng.slots("t").items():
        np.testing.assert_array_equal(loaded.slots("t")[k], v, err_msg=k)
    with pytest.raises(SpecError, match="'Yogi' of module 'elsewhere' is not defined"):
        optimizer_from_json({**entry, "module": "elsewhere"}, {})


def test_registration_refuses_names_the_generated_kernel_cannot_hold():
    def f(w, g, lr):
        return w - lr * g

    # Each was accepted and rendered into a kernel that failed to compile (a SyntaxError).
    for bad in ("lambda", "a-b", "None"):
        with pytest.raises(ValueError, match=f"{bad!r} cannot name a value of the kernel"):
            row_math("badname_of_the_tests", params=(bad,))(f)
    with pytest.raises(ValueError, match="'class' cannot name a value"):
        row_math("badname_of_the_tests", constants={"class": 1.0})(f)
    # A string is not a tuple of names (it became ('r', 'h', 'o')).
    with pytest.raises(TypeError, match=r"params must be a tuple of names, .* \('rho',\)"):
        row_math("badname_of_the_tests", params="rho")(f)


def test_registration_refuses_a_result_of_the_wrong_arity():
    # Each was registered, and the kernel failed to compile: numba's "failed to unpack float64"
    # in the generated file.
    def forgets_its_slot(w, acc, g, lr):
        return w - lr * g

    with pytest.raises(
        ValueError,
        match=r"forgets_its_slot returned one float64; an? element function returns a tuple "
        r"of 2: \(w, acc\)",
    ):
        row_math("arity_of_the_tests", slots=("acc",))(forgets_its_slot)

    def a_tuple_without_slots(w, g, lr):
        return (w - lr * g,)

    with pytest.raises(ValueError, match=r"returned a tuple of 1; .* the new weight alone"):
        row_math("arity_of_the_tests", params=())(a_tuple_without_slots)

    def scaled_without_step(acc, sum_g2, lr, dim):
        return acc + sum_g2 / dim

    with pytest.raises(ValueError, match=r"returns a tuple of 2: \(acc, step\)"):
        row_math("arity_of_the_tests", form="scaled", slots=("acc",))(scaled_without_step)

    # With a prologue: its result (here the steps since the row's last update, which it also
    # records in the row's int32 slot) is passed on; the function is checked alike.
    def steps_since(data_i, r, cols, step):
        delta = np.float64(step + 1 - data_i[r, cols[0]])
        data_i[r, cols[0]] = step + 1
        return delta

    def forgets_its_slot_too(w, acc, g, lr, delta):
        return w - lr * g * delta

    with pytest.raises(ValueError, match=r"forgets_its_slot_too returned one float64; .* of 2"):
        row_math(
            "arity_of_the_tests", slots=("acc",), prologue=steps_since, prologue_result="delta"
        )(forgets_its_slot_too)

    def keeps_its_slot(w, acc, g, lr, delta):
        return w - lr * g * delta, acc + g * g

    row_math("arity_of_the_tests", slots=("acc",), prologue=steps_since, prologue_result="delta")(
        keeps_its_slot
    )


def _yogi32(w, momenta, velocities, g, lr, beta_1, beta_2, epsilon):
    """Yogi in float32 lanes: the gradient is read only as float32."""
    gf = np.float32(g)
    m = np.float32(beta_1) * np.float32(momenta) + np.float32(1.0 - beta_1) * gf
    g2 = gf * gf
    v0 = np.float32(velocities)
    v = v0 - np.float32(1.0 - beta_2) * np.sign(v0 - g2) * g2
    return np.float32(w) - np.float32(lr) * m / (np.sqrt(v) + np.float32(epsilon)), m, v


YOGI32 = {
    declared: row_math(
        f"yogi32_{declared}_of_the_tests",
        params=("beta_1", "beta_2", "epsilon"),
        slots=("momenta", "velocities"),
        float32_gradient=declared,
    )(_yogi32)
    for declared in (False, True)
}


@dataclass(frozen=True)
class Yogi32(Yogi):
    """Yogi with float32 math, its row math declared float32_gradient or not."""

    declared: bool = True

    def row_math(self, dim):
        return YOGI32[self.declared]


@pytest.mark.parametrize("dim", [8, 6])  # the fixed-layout kernel, the any-layout one
def test_a_float32_gradient_row_math_trains_as_undeclared(dim):
    """Declared, the kernel hands the function its gradient rounded to float32 once per row
    (its loop then runs in float32 lanes); a function that rounds g first gets the same values.
    Equal up to a few ulps, not bit for bit: LLVM may contract other multiply-adds of the loop
    it vectorises otherwise (bit-identical here for this one; Adam with bias correction at dims
    4 and 8 moved 2-16 ulps on the Intel host)."""
    declared, undeclared = (_train(Yogi32(0.05, declared=d), "numba", dim) for d in (True, False))
    assert not np.array_equal(declared[0], _train(Yogi32(0.05), "numba", dim, steps=0)[0])
    np.testing.assert_array_max_ulp(declared[0], undeclared[0], maxulp=32)
    for k in undeclared[1]:
        np.testing.assert_array_max_ulp(declared[1][k], undeclared[1][k], maxulp=32)


def test_16_bit_fixed_layout_kernels_take_the_float32_gradient_loop():
    """The 16-bit fixed-layout kernels (in place) have the loop without clipping or weight
    decay too: a row math declaring float32_gradient runs it over the gradient rounded once
    (``gf``), 8 coordinates a vector (Adam's bfloat16 update on W1: 13% less CPU time); the
    any-layout 16-bit kernels keep the general loop alone (compile time). A declared row math
    trains a bfloat16 table as the undeclared one does, through the kernel of each."""
    from embengine.kernels import codegen
    from embengine.optimizers._row_math import ROW_MATH

    src = codegen.render([ROW_MATH["adam"]])

    def function(name):
        start = src.index(f"def {name}(")
        return src[start : src.find("\ndef ", start + 1)]

    rounded = "gf[j] = np.float32(g[j])"
    assert rounded in function("fixed_fused_update_half_adam_bf16_bf16")
    assert rounded not in function("fused_update_half_adam_bf16_bf16")
    declared, undeclared = (
        _train(Yogi32(0.05, declared=d), "numba", 8, dtype="bfloat16") for d in (True, False)
    )
    start = _train(Yogi32(0.05), "numba", 8, steps=0, dtype="bfloat16")[0]
    assert not np.array_equal(declared[0], start)
    np.testing.assert_array_equal(declared[0], undeclared[0])
    for k in undeclared[1]:
        np.testing.assert_array_equal(declared[1][k], undeclared[1][k])


def test_float32_gradient_is_checked_against_the_function_when_registered():
    from embengine.kernels import codegen
    from embengine.optimizers._row_math import ROW_MATH

    # SGD reads g in float64: handed the rounded gradient, it would move rows differently.
    def sgd(w, g, lr):
        return w - lr * g

    with pytest.raises(ValueError, match=r"declares float32_gradient, but sgd returns other "):
        row_math("f32_of_the_tests", float32_gradient=True)(sgd)
    with pytest.raises(ValueError, match="float32_gradient is for element functions"):
        row_math("f32_of_the_tests", form="scaled", slots=("acc",), float32_gradient=True)(
            lambda acc, sum_g2, lr, dim: (acc + sum_g2, lr)
        )
    # embengine's own: Adam and Adagrad round g first; their kernels' loop without clipping or
    # weight decay reads the rounded copy, the loop with them the float64 sum as before.
    for name, call in (("adam", "adam_update("), ("adagrad", "adagrad_update(")):
        assert ROW_MATH[name].float32_gradient, name
        text = codegen.render([ROW_MATH[name]])
        assert "gf[j] = np.float32(g[j])" in text and f"{call}" in text
        calls = [line for line in text.splitlines() if call in line and "def " not in line]
        assert any(", gf[j], " in c for c in calls) and any(", gj, " in c for c in calls), name
    assert not ROW_MATH["sgd"].float32_gradient
    assert "gf[j]" not in codegen.render([ROW_MATH["sgd"]])


def _step_rounded(w, g, lr):
    """float32 weights, the step computed in float64 and then rounded: it reads g in float64."""
    return np.float32(w) - np.float32(lr * g)


def _exact_if_asked(w, g, lr, exact):
    """Reads g as float32 unless its flag ``exact`` is set."""
    return w - lr * g if exact else np.float32(w) - np.float32(lr) * np.float32(g)


def _raises_at_one_half(w, g, lr):
    """Reads g in float64, and raises on the learning rate 0.5."""
    if lr == 0.5:
        raise ZeroDivisionError("lr 0.5")
    return w - lr * g


@pytest.mark.parametrize(
    "fn, flags, shown",
    [
        # 0.5 * g rounds alike for g and for its rounding: the product hid the float64 read
        (_step_rounded, (), r"other values 0\.3, flags all False"),
        (_exact_if_asked, ("exact",), "flags set: exact"),
        (_raises_at_one_half, (), r"other values 0\.3"),
    ],
)
def test_float32_gradient_check_sees_float64_reads_on_other_values_and_flags(fn, flags, shown):
    """Each reads g in float64 where the kernel would hand it the rounded gradient; the check
    tried only 0.5 for every value, flags False, and stopped at a function that raised."""
    name = f"f32_{fn.__name__.strip('_')}_of_the_tests"
    with pytest.raises(
        ValueError, match=rf"declares float32_gradient, but {fn.__name__} .*{shown}"
    ):
        row_math(name, flags=flags, float32_gradient=True)(fn)
    assert row_math(name, flags=flags)(fn).float32_gradient is False  # undeclared: registered


def test_float32_gradient_check_accepts_a_function_rounding_g_first_under_every_flag():
    def nesterov32(w, momenta, g, lr, momentum, use_nesterov):
        gf = np.float32(g)
        m = np.float32(momentum) * np.float32(momenta) + gf
        u = np.float32(momentum) * m + gf if use_nesterov else m
        return np.float32(w) - np.float32(lr) * u, m

    rm = row_math(
        "nesterov32_of_the_tests",
        params=("momentum",),
        flags=("use_nesterov",),
        slots=("momenta",),
        float32_gradient=True,
    )(nesterov32)
    assert rm.float32_gradient
