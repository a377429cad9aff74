"""embengine.monolith: Monolith's names, defaults and per-id update semantics, written out by hand
from Monolith's C++ (with its FTRL sign defect fixed)."""

import math

import numpy as np
import pytest

import embengine as ee
from embengine import monolith as mono


def _engine(optimizer, initializer, dim=1, backend="numba"):
    t = ee.TableConfig(
        8, dim, initializer=initializer, optimizer=optimizer, combiner="sum", name="t"
    )
    return ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, backend=backend)


def _step(eng, ids, grads):
    acts = eng.lookup({"f": np.array(ids)})
    eng.apply_gradients({"f": np.asarray(grads, dtype=np.float32).reshape(acts["f"].shape)})


def test_defaults_follow_monolith_proto():
    assert mono.SgdOptimizer().learning_rate == 0.01
    a = mono.AdagradOptimizer()
    assert (a.learning_rate, a.initial_accumulator_value, a.weight_decay_factor) == (
        0.001,
        0.1,
        None,
    )
    adam = mono.AdamOptimizer()
    assert (adam.learning_rate, adam.beta_1, adam.beta_2, adam.epsilon) == (0.01, 0.9, 0.99, 0.01)
    assert adam.bias_correction == "per_row" and not adam.sum_inside_sqrt
    assert mono.BatchSoftmaxOptimizer().learning_rate == 0.1
    assert mono.FtrlOptimizer().initial_accumulator_value == 0.1
    u = mono.RandomUniformInitializer()
    assert (u.minval, u.maxval) == (-0.05, 0.05)
    with pytest.raises(ValueError, match="init_step_interval should be >= 1, while got 0.5"):
        mono.BatchSoftmaxInitializer(0.5)
    with pytest.raises(ValueError, match="warmup_steps must be an int >= 0"):
        mono.AdagradOptimizer(warmup_steps=-1)


@pytest.mark.parametrize("g", [1.0, -1.0])
def test_ftrl_intended_math(backend, g):
    lr, l1, l2, beta, w0 = 0.5, 0.2, 0.4, 1.0, 0.3
    eng = _engine(
        mono.FtrlOptimizer(learning_rate=lr, l1_regularization=l1, l2_regularization=l2, beta=beta),
        mono.ConstantsInitializer(w0),
        backend=backend,
    )
    n, z, w = 0.1, 0.0, w0
    for step in range(3):
        _step(eng, [2], [g * (step + 1)])
        gs = g * (step + 1)
        n_new = n + gs * gs
        sigma = (math.sqrt(n_new) - math.sqrt(n)) / lr
        z += gs - sigma * w
        n = n_new
        # Monolith's formula with sign(z) where its code has std::signbit(z):
        w = lr * (math.copysign(l1, z) - z) / (math.sqrt(n) + beta + l2 * lr) if abs(z) > l1 else 0
        np.testing.assert_allclose(eng.embedding_tables["t"][2, 0], w, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(eng.slots("t")["linears"][2, 0], z, rtol=1e-5)


def test_adam_bias_correction_is_per_id(backend):
    lr, b1, b2, eps, wd = 0.1, 0.9, 0.99, 0.01, 0.05
    eng = _engine(
        mono.AdamOptimizer(learning_rate=lr, weight_decay_factor=wd),
        mono.ConstantsInitializer(1.0),
        backend=backend,
    )
    state = {i: dict(w=1.0, m=0.0, v=0.0, b1p=b1, b2p=b2) for i in (1, 2)}
    for ids, grads in (([1], [0.5]), ([1, 2], [0.25, -1.0]), ([2], [2.0])):
        _step(eng, ids, grads)
        for i, gi in zip(ids, grads, strict=True):
            s = state[i]
            step_lr = lr * math.sqrt(1 - s["b2p"]) / (1 - s["b1p"])
            cur = gi + wd * s["w"]
            s["m"] += (cur - s["m"]) * (1 - b1)
            s["v"] += (cur * cur - s["v"]) * (1 - b2)
            s["w"] -= s["m"] * step_lr / (math.sqrt(s["v"]) + eps)
            s["b1p"] *= b1
            s["b2p"] *= b2
        for i in (1, 2):
            np.testing.assert_allclose(eng.embedding_tables["t"][i, 0], state[i]["w"], rtol=1e-5)
    assert eng.slots("t")["steps"][[1, 2], 0].tolist() == [2, 2]


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_velocity_with_warmup(backend, nesterov):
    lr, mu, wd, warm = 0.2, 0.9, 0.1, 2
    eng = _engine(
        mono.MomentumOptimizer(
            learning_rate=lr,
            weight_decay_factor=wd,
            use_nesterov=nesterov,
            momentum=mu,
            warmup_steps=warm,
        ),
        mono.ConstantsInitializer(1.0),
        backend=backend,
    )
    w, n = 1.0, 0.0
    for step, g in enumerate([1.0, -0.5, 2.0, 0.3]):
        _step(eng, [3], [g])
        eff = lr * min(step, warm) / warm  # 0, 0.1, 0.2, 0.2
        dx = eff * (g + wd * w)
        prev = n
        n = mu * n - dx
        w += -mu * prev + (1 + mu) * n if nesterov else n
        np.testing.assert_allclose(eng.embedding_tables["t"][3, 0], w, rtol=1e-5)
    assert eng.num_learning_rate_tags == 1  # the warm-up schedule is a learning-rate callable


def test_rmsprop_and_adagrad_and_adadelta(backend):
    cases = [
        (
            mono.RmspropOptimizer(learning_rate=0.3, weight_decay_factor=0.1, momentum=0.8),
            lambda w, s, g: _rmsprop(w, s, g, 0.3, 0.1, 0.8),
        ),
        (
            mono.AdagradOptimizer(learning_rate=0.3, weight_decay_factor=0.1),
            lambda w, s, g: _adagrad(w, s, g, 0.3, 0.1),
        ),
        (
            mono.AdadeltaOptimizer(learning_rate=0.5, weight_decay_factor=0.1),
            lambda w, s, g: _adadelta(w, s, g, 0.5, 0.1, 0.9, 0.01),
        ),
    ]
    for optimizer, update in cases:
        eng = _engine(optimizer, mono.ConstantsInitializer(0.5), backend=backend)
        w, s = 0.5, None
        for g in (1.0, -2.0, 0.5):
            _step(eng, [4], [g])
            w, s = update(w, s, g)
            np.testing.assert_allclose(
                eng.embedding_tables["t"][4, 0], w, rtol=1e-5, err_msg=repr(optimizer)
            )


def _rmsprop(w, n, g, lr, wd, mom):
    n = 0.0 if n is None else n
    dx = g + wd * w
    n = mom * n + (1 - mom) * dx * dx
    return w - lr / (math.sqrt(n) + 1) * dx, n


def _adagrad(w, norm, g, lr, wd):
    norm = 0.1 if norm is None else norm
    g = g + wd * w
    norm += g * g
    return w - lr / math.sqrt(norm) * g, norm


def _adadelta(w, s, g, lr, wd, rho, eps):
    acc, upd = (0.0, 0.0) if s is None else s
    g = g + wd * w
    acc = acc * rho + g * g * (1 - rho)
    u = math.sqrt(upd + eps) / math.sqrt(acc + eps) * g
    return w - u * lr, (acc, upd * rho + u * u * (1 - rho))


def test_batch_softmax(backend):
    eng = _engine(
        mono.BatchSoftmaxOptimizer(learning_rate=0.2),
        mono.BatchSoftmaxInitializer(5.0),
        backend=backend,
    )
    b, last = 5.0, 0
    for step in range(90):
        ids = [1, 1] if step % 3 == 0 else [2]  # id 1: every 3 steps, twice per batch
        _step(eng, ids, [7.0] * len(ids))  # the gradient is ignored
        if step % 3 == 0:
            s = step + 1
            b = 0.8 * b + 0.2 * (s - last)
            last = s
        np.testing.assert_allclose(eng.embedding_tables["t"][1, 0], b, rtol=1e-5)
    assert abs(b - 3.0) < 0.01


def test_fixed_r8_simulates_8_bit_lookups(backend):
    comp = mono.FixedR8Compressor(fixed_range=2.0)
    q = comp.quantization_config()
    t = ee.TableConfig(
        4,
        3,
        initializer=ee.initializers.Constant(0.123),
        combiner="sum",
        quantization_config=q,
        name="t",
    )
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t)}, optimizer=mono.SgdOptimizer(0.1), backend=backend
    )
    acts = eng.lookup({"f": np.array([1])})["f"]
    step = 2.0 / 128
    np.testing.assert_allclose(acts, round(0.123 / step) * step, rtol=1e-6)
    eng.apply_gradients({"f": np.ones_like(acts)})
    np.testing.assert_allclose(eng.embedding_tables["t"][1], 0.023, rtol=1e-5)  # straight through
    assert (mono.Fp16Compressor().compression, mono.Fp32Compressor().compression) == (
        "fp16",
        "fp32",
    )


# -- compressors attached to tables; hessian_compression_times as Monolith's code reads it -------


def _compressed_engine(backend: str = "numba") -> ee.EmbeddingEngine:
    r8 = mono.FixedR8Compressor(fixed_range=0.5)
    tables = [
        ee.TableConfig(20, 4, name="a", combiner="sum", compressor=mono.Fp16Compressor()),
        ee.TableConfig(
            20,
            4,
            name="b",
            combiner="sum",
            compressor=r8,
            quantization_config=r8.quantization_config(),
        ),
        ee.TableConfig(20, 4, name="c", combiner="sum"),
    ]
    eng = ee.EmbeddingEngine(
        {t.name: ee.FeatureConfig(t) for t in tables},
        optimizer=mono.AdagradOptimizer(0.1),
        backend=backend,
    )
    ids = {name: np.array([1, 2, 3]) for name in "abc"}
    acts = eng.lookup(ids)
    eng.apply_gradients({k: np.full_like(a, 0.5) for k, a in acts.items()})
    return eng


def _exported(path) -> dict:
    import json

    manifest = json.loads((path / "manifest.json").read_text())
    return {t["name"]: (t["compression"], t["params"]) for t in manifest["tables"]}


def test_export_stores_each_table_as_its_compressor_says(tmp_path):
    from embengine.serving import ServingEngine, export

    eng = _compressed_engine()
    eng.save(tmp_path / "ckpt")
    export(tmp_path / "ckpt", tmp_path / "out", compress="fp32", fixed_range=3.0)
    assert _exported(tmp_path / "out") == {
        "a": ("fp16", {}),
        "b": ("fixed_r8", {"fixed_range": 0.5}),
        "c": ("fp32", {}),
    }
    # The export's per-table choice wins over the table's compressor; its default and its
    # fixed range apply to tables without one (and to a per-table choice).
    export(
        tmp_path / "ckpt",
        tmp_path / "out2",
        compress="bf16",
        per_table={"a": "fixed_r8"},
        fixed_range=3.0,
    )
    assert _exported(tmp_path / "out2") == {
        "a": ("fixed_r8", {"fixed_range": 3.0}),
        "b": ("fixed_r8", {"fixed_range": 0.5}),
        "c": ("bf16", {}),
    }
    # Served rows of b are the training rows on b's own 8-bit grid (step 0.5 / 128, clipped to
    # [-0.5, 0.5 * 127 / 128]).
    ids = {name: np.arange(20) for name in "abc"}
    served = ServingEngine.load(tmp_path / "out").lookup(ids)["b"]
    want = np.clip(eng.embedding_tables["b"], -0.5, 0.5 * 127 / 128)
    assert np.abs(served - want).max() <= 0.5 / 256 + 1e-7


def test_a_table_s_compressor_survives_the_checkpoint_and_the_spec(tmp_path):
    eng = _compressed_engine()
    eng.save(tmp_path / "ckpt")
    loaded = ee.EmbeddingEngine.load(tmp_path / "ckpt")
    got = {t.name: t.compressor for t in loaded.table_configs.values()}
    assert got == {"a": ee.Compressor("fp16"), "b": ee.Compressor("fixed_r8", 0.5), "c": None}
    assert "compressor" not in eng.spec()["tables"][2]  # a table without one: as before


def test_a_bad_compressor_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="compression must be one of .* got 'fp8'"):
        ee.Compressor("fp8")
    for bad in (0, -1.0, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="fixed_range must be a finite number > 0"):
            mono.FixedR8Compressor(fixed_range=bad)
    with pytest.raises(TypeError, match="compressor must be an embengine.Compressor"):
        ee.TableConfig(10, 4, name="t", compressor="fp16")
    # A crafted manifest naming an unknown compression is refused before anything is built.
    import hashlib
    import json

    from embengine.checkpoint import CheckpointError

    path = _compressed_engine().save(tmp_path / "ckpt")
    m = json.loads((path / "manifest.json").read_text())
    m["tables"][0]["compressor"]["compression"] = "zip"
    text = json.dumps(m).encode()
    (path / "manifest.json").write_bytes(text)
    (path / "manifest.sha256").write_text(hashlib.sha256(text).hexdigest())
    with pytest.raises(CheckpointError, match=r"tables\[0\]\.compressor\.compression"):
        ee.EmbeddingEngine.load(path)


def test_hessian_compression_times_as_monolith_s_code_reads_it():
    ours = mono.AdagradOptimizer(0.1, hessian_compression_times=4)
    theirs = mono.AdagradOptimizer(0.1, hessian_compression_times=4, hessian_compression="monolith")
    plain = mono.AdagradOptimizer(0.1)
    assert ours.hessian_compression_times == 4
    assert theirs == plain  # Monolith's C++ never reads it: one accumulator per dim
    with pytest.raises(ValueError, match="hessian_compression must be one of"):
        mono.AdagradOptimizer(0.1, hessian_compression="tf")
    with pytest.raises(ValueError, match="hessian_compression_times must be an int >= 1"):
        mono.AdagradOptimizer(0.1, hessian_compression_times=0, hessian_compression="monolith")


def test_none_arguments_take_monolith_defaults_and_ftrl_has_no_warmup():
    """``None`` means the default of Monolith's optimizer.proto (its Python layer skips None
    fields), for every argument of every factory; FTRL's warm-up (a rate of 0 at step 0, which
    FTRL divides by) is refused when the optimizer is made, not at every step after."""
    import inspect

    factories = [
        mono.SgdOptimizer,
        mono.AdagradOptimizer,
        mono.AdamOptimizer,
        mono.AmsgradOptimizer,
        mono.MomentumOptimizer,
        mono.RmspropOptimizer,
        mono.RmspropV2Optimizer,
        mono.AdadeltaOptimizer,
        mono.FtrlOptimizer,
        mono.BatchSoftmaxOptimizer,
    ]
    for factory in factories:
        for name in inspect.signature(factory).parameters:
            if name == "hessian_compression":  # embengine's own switch, not Monolith's
                continue
            assert factory(**{name: None}) == factory(), (factory.__name__, name)
    assert mono.FixedR8Compressor(fixed_range=None) == mono.FixedR8Compressor()
    with pytest.raises(ValueError, match="FtrlOptimizer: warmup_steps=5 makes the learning"):
        mono.FtrlOptimizer(warmup_steps=5)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        # a string l2 was divided by 2 first: "unsupported operand type(s) for /"
        (
            lambda: mono.FtrlOptimizer(l2_regularization="x"),
            ValueError,
            "FtrlOptimizer: l2_regularization must be a finite number >= 0, got 'x'",
        ),
        # named FTRL's l2_regularization_strength, with half the value given
        (
            lambda: mono.FtrlOptimizer(l2_regularization=-1.0),
            ValueError,
            "FtrlOptimizer: l2_regularization must be a finite number >= 0, got -1.0",
        ),
        (
            lambda: mono.FtrlOptimizer(l1_regularization=-1.0),
            ValueError,
            "FtrlOptimizer: l1_regularization must be a finite number >= 0, got -1.0",
        ),
        # said "makes the learning rate 0 at step 0"
        (
            lambda: mono.FtrlOptimizer(warmup_steps=-1),
            ValueError,
            "FtrlOptimizer: warmup_steps must be an int >= 0, got -1",
        ),
        # named RMSProp's rho / Adadelta's rho, which the caller never gave
        (
            lambda: mono.RmspropOptimizer(momentum=1.5),
            ValueError,
            r"RmspropOptimizer: momentum must be in \[0, 1\), got 1.5",
        ),
        (
            lambda: mono.AdadeltaOptimizer(averaging_ratio=1.5),
            ValueError,
            r"AdadeltaOptimizer: averaging_ratio must be in \[0, 1\), got 1.5",
        ),
        # "'<' not supported between instances of 'str' and 'int'"
        (
            lambda: mono.BatchSoftmaxInitializer("2"),
            ValueError,
            "BatchSoftmaxInitializer: init_step_interval must be a number >= 1, got '2'",
        ),
        (
            lambda: mono.BatchSoftmaxInitializer(None),
            ValueError,
            "BatchSoftmaxInitializer: init_step_interval must be a number >= 1, got None",
        ),
        # accepted silently (Monolith's proto field is a bool)
        (
            lambda: mono.AdamOptimizer(use_beta1_warmup="no"),
            TypeError,
            "AdamOptimizer: use_beta1_warmup must be a bool, got 'no'",
        ),
        # named FTRL's allow_zero_accumulator, which FtrlOptimizer has not
        (
            lambda: mono.FtrlOptimizer(initial_accumulator_value=-0.5),
            ValueError,
            "FtrlOptimizer: initial_accumulator_value must be a finite number >= 0, got -0.5",
        ),
        # advised multiply_linear_by_learning_rate=True, which FtrlOptimizer has not
        (
            lambda: mono.FtrlOptimizer(learning_rate=0.0),
            ValueError,
            r"FtrlOptimizer: learning_rate must be a finite number > 0 \(FTRL divides by it\), "
            "got 0.0",
        ),
        # named Adam's beta_1 / beta_2, which the caller never gave
        (
            lambda: mono.AdamOptimizer(beta1=1.5),
            ValueError,
            r"AdamOptimizer: beta1 must be in \[0, 1\), got 1.5",
        ),
        (
            lambda: mono.AmsgradOptimizer(beta2=-0.1),
            ValueError,
            r"AmsgradOptimizer: beta2 must be in \[0, 1\), got -0.1",
        ),
        # named no optimizer at all
        (
            lambda: mono.MomentumOptimizer(warmup_steps=-2),
            ValueError,
            "MomentumOptimizer: warmup_steps must be an int >= 0, got -2",
        ),
        # "could not convert string to float: 'a'", "must be real number, not str"
        (
            lambda: mono.ConstantsInitializer("a"),
            ValueError,
            "ConstantsInitializer: constant must be a finite number, got 'a'",
        ),
        (
            lambda: mono.RandomUniformInitializer("a"),
            ValueError,
            "RandomUniformInitializer: minval must be a finite number, got 'a'",
        ),
    ],
)
def test_bad_arguments_are_named_as_monolith_names_them(make, error, message):
    with pytest.raises(error, match=f"^{message}"):
        make()


@pytest.mark.parametrize(
    ("lr", "error", "message"),
    [
        ("0.5", ValueError, "AdagradOptimizer: learning_rate must be a finite number >= 0"),
        (True, ValueError, "AdagradOptimizer: learning_rate must be a finite number >= 0"),
        (-1.0, ValueError, "AdagradOptimizer: learning_rate must be a finite number >= 0"),
        (float("nan"), ValueError, "AdagradOptimizer: learning_rate must be a finite number"),
        ("x", ValueError, "AdagradOptimizer: learning_rate must be a finite number >= 0"),
        (
            ee.DynamicLearningRate(0),
            ValueError,
            r"AdagradOptimizer: warmup_steps=3 ramps a constant learning rate; "
            r"DynamicLearningRate\(tag=0\)",
        ),
    ],
)
def test_a_warmed_up_learning_rate_is_checked_when_made(lr, error, message):
    """With warmup_steps the rate went to ``float()`` unchecked: "0.5" and True trained at 0.5
    and 1.0 (refused without warmup), -1 and nan were refused only at the second step, by the
    engine, naming ``Warmup(...)``; "x" and a DynamicLearningRate raised float()'s bare errors
    ("could not convert string to float: 'x'")."""
    with pytest.raises(error, match=message):
        mono.AdagradOptimizer(learning_rate=lr, warmup_steps=3)
    warm = mono.AdagradOptimizer(learning_rate=np.float32(0.25), warmup_steps=2).learning_rate
    assert [warm(s) for s in (0, 1, 2, 3)] == [0.0, 0.125, 0.25, 0.25]


def test_rmsprop_learning_rate_is_static_as_in_monolith():
    """Monolith's RMSProp steps with its configured rate (its C++ reads
    ``conf_.learning_rate()``, never the step's rate): a learning-rate function was accepted
    and applied, each step's value, against the factory's own docstring."""
    with pytest.raises(ValueError, match="RmspropOptimizer: learning_rate must be a number"):
        mono.RmspropOptimizer(learning_rate=lambda: 0.1)
    assert mono.RmspropOptimizer(learning_rate=0.3).learning_rate == 0.3


def test_ftrl_takes_a_zero_initial_accumulator_as_monolith_does(backend):
    """Monolith's FTRL starts its "norm" at any value >= 0 (GroupFtrl's default is 0); here 0
    was refused with advice to set allow_zero_accumulator, which FtrlOptimizer has not."""
    lr, w0, g = 0.5, 0.3, 0.8
    eng = _engine(
        mono.FtrlOptimizer(learning_rate=lr, initial_accumulator_value=0.0),
        mono.ConstantsInitializer(w0),
        dim=2,
        backend=backend,
    )
    _step(eng, [2], [[g, 0.0]])
    # Monolith's step from n = 0, z = 0: sigma = sqrt(g^2) / lr; z = g - sigma * w.
    z = g - math.sqrt(g * g) / lr * w0
    np.testing.assert_allclose(eng.embedding_tables["t"][2], [lr * -z / math.sqrt(g * g), 0.0])
    np.testing.assert_allclose(eng.slots("t")["accumulators"][2], [g * g, 0.0], rtol=1e-6)
    assert mono.FtrlOptimizer() == mono.FtrlOptimizer(initial_accumulator_value=0.1)
    with pytest.raises(ValueError, match="FtrlOptimizer: initial_accumulator_value must be a fin"):
        mono.FtrlOptimizer(initial_accumulator_value=-0.1)


@pytest.mark.parametrize("nesterov", [False, True])
def test_amsgrad_as_monolith_s_code_steps(backend, nesterov):
    """AmsgradOptimizer against Monolith's amsgrad_optimizer.cc, written out: per-id beta
    powers starting at beta, weight decay in the gradient, v_hat = max(v_hat, v), epsilon
    outside the square root, Nesterov's numerator; two ids updated on different steps."""
    lr, b1, b2, eps, wd = 0.1, 0.8, 0.95, 0.01, 0.05
    eng = _engine(
        mono.AmsgradOptimizer(
            learning_rate=lr,
            beta1=b1,
            beta2=b2,
            epsilon=eps,
            weight_decay_factor=wd,
            use_nesterov=nesterov,
        ),
        mono.ConstantsInitializer(1.0),
        backend=backend,
    )
    state = {i: dict(w=1.0, m=0.0, v=0.0, vhat=0.0, b1p=b1, b2p=b2) for i in (1, 2)}
    for ids, grads in (([1], [2.0]), ([1, 2], [0.1, -1.0]), ([1], [0.05]), ([2], [0.3])):
        _step(eng, ids, grads)
        for i, gi in zip(ids, grads, strict=True):
            s = state[i]
            step_lr = lr * math.sqrt(1 - s["b2p"]) / (1 - s["b1p"])
            cur = gi + wd * s["w"]
            s["m"] += (cur - s["m"]) * (1 - b1)
            s["v"] += (cur * cur - s["v"]) * (1 - b2)
            s["vhat"] = max(s["vhat"], s["v"])
            num = cur * (1 - b1) + b1 * s["m"] if nesterov else s["m"]
            s["w"] -= num * step_lr / (math.sqrt(s["vhat"]) + eps)
            s["b1p"] *= b1
            s["b2p"] *= b2
        for i in (1, 2):
            np.testing.assert_allclose(eng.embedding_tables["t"][i, 0], state[i]["w"], rtol=1e-5)
            np.testing.assert_allclose(eng.slots("t")["vhats"][i, 0], state[i]["vhat"], rtol=1e-5)


def test_compressors_take_monolith_s_arguments(tmp_path):
    """Monolith's ``FixedR8Compressor(fixed_range=1.0)`` takes its range first: ``(0.5)`` was
    read as ``compression=0.5`` and refused ("compression must be one of (...), got 0.5"), and
    ``Fp16Compressor("fp32")`` (Monolith's takes nothing) made an fp32 compressor."""
    import pickle

    r8 = mono.FixedR8Compressor(0.5)
    assert r8 == mono.FixedR8Compressor(fixed_range=0.5)
    assert (r8.compression, r8.fixed_range) == ("fixed_r8", 0.5)
    assert mono.FixedR8Compressor() == mono.FixedR8Compressor(None) == mono.FixedR8Compressor(1.0)
    assert pickle.loads(pickle.dumps(r8)) == r8
    for bad in (
        lambda: mono.FixedR8Compressor(0.5, "fp16"),
        lambda: mono.FixedR8Compressor(compression="fp16"),
        lambda: mono.Fp16Compressor("fp32"),
        lambda: mono.Fp32Compressor(compression="fp16"),
    ):
        with pytest.raises(TypeError):
            bad()
    with pytest.raises(ValueError, match="FixedR8Compressor: fixed_range must be a finite"):
        mono.FixedR8Compressor(-1.0)
    t = ee.TableConfig(4, 2, name="t", combiner="sum", compressor=r8)
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=mono.SgdOptimizer())
    loaded = ee.EmbeddingEngine.load(eng.save(tmp_path / "ckpt"))
    assert loaded.table_configs["t"].compressor == ee.Compressor("fixed_r8", 0.5)


def test_rmspropv2_as_monolith_s_code_steps(backend):
    """RmspropV2Optimizer against Monolith's ``RmspropV2Optimizer::OptimizeNormal``, written
    out: ``dx = g + f w; n = m n + dx^2`` (no ``1 - m``); ``w -= lr dx / (sqrt(n) + 1)``; two
    dims with different gradients. It had no factory (only RMSProp V1's)."""
    lr, wd, m = 0.3, 0.1, 0.8
    eng = _engine(
        mono.RmspropV2Optimizer(learning_rate=lr, weight_decay_factor=wd, momentum=m),
        mono.ConstantsInitializer(0.5),
        dim=2,
        backend=backend,
    )
    w, n = [0.5, 0.5], [0.0, 0.0]
    for g in ([1.0, 0.2], [-2.0, 0.0], [0.5, 3.0]):
        _step(eng, [4], [g])
        for i in range(2):
            dx = g[i] + wd * w[i]
            n[i] = m * n[i] + dx * dx
            w[i] -= lr / (math.sqrt(n[i]) + 1) * dx
        np.testing.assert_allclose(eng.embedding_tables["t"][4], w, rtol=1e-5)
        # the stored slot is the rescaled accumulator (1 - m) n
        np.testing.assert_allclose(eng.slots("t")["ms"][4], np.multiply(n, 1 - m), rtol=1e-5)


def test_rmspropv2_defaults_and_bad_arguments():
    v2 = mono.RmspropV2Optimizer()
    c = math.sqrt(1 - 0.9)  # proto defaults: learning_rate 0.01, momentum 0.9
    assert (v2.rho, v2.momentum, v2.sum_inside_sqrt, v2.initial_ms_value) == (0.9, 0.0, False, 0.0)
    assert math.isclose(v2.learning_rate, 0.01 * c) and math.isclose(v2.epsilon, c)
    assert v2.weight_decay_factor is None
    for bad in (1.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=r"^RmspropV2Optimizer: momentum must be in \[0, 1\)"):
            mono.RmspropV2Optimizer(momentum=bad)
    for fn in (lambda: 0.1, ee.DynamicLearningRate(0)):
        with pytest.raises(ValueError, match="^RmspropV2Optimizer: learning_rate must be a numb"):
            mono.RmspropV2Optimizer(learning_rate=fn)
    for bad in (-1.0, True, "0.1", float("nan")):
        with pytest.raises(ValueError, match="^RmspropV2Optimizer: learning_rate must be a fini"):
            mono.RmspropV2Optimizer(learning_rate=bad)


def test_a_warm_up_is_stored_and_load_rebuilds_it_one_per_tag(tmp_path):
    """A Monolith optimizer's warmup_steps is a learning-rate callable, but data: a checkpoint
    stores it and load rebuilds it (one Warmup per tag, shared as before), where it asked for
    ``callables=`` and a Monolith user had nothing to pass. The loaded engine trains on as the
    one that wrote the checkpoint."""
    shared = mono.AdagradOptimizer(learning_rate=0.3, warmup_steps=3)
    other = mono.MomentumOptimizer(learning_rate=0.2, warmup_steps=5)
    tables = {
        name: ee.TableConfig(8, 2, optimizer=opt, combiner="sum", name=name)
        for name, opt in (("a", shared), ("b", shared), ("c", other))
    }
    eng = ee.EmbeddingEngine({f"f{n}": ee.FeatureConfig(t) for n, t in tables.items()})
    assert eng.num_learning_rate_tags == 2
    rng = np.random.default_rng(0)

    def step(e, i):
        feats = {f"f{n}": rng.integers(0, 8, (4, 2)) for n in tables}
        acts = e.lookup(feats)
        e.apply_gradients({k: np.full_like(a, 0.1 * (i + 1)) for k, a in acts.items()})

    for i in range(2):
        step(eng, i)
    path = eng.save(tmp_path / "ck")
    loaded = ee.EmbeddingEngine.load(path)
    assert loaded.num_learning_rate_tags == 2
    state = rng.bit_generator.state
    for e in (eng, loaded):
        rng.bit_generator.state = state
        for i in range(2, 6):  # through the end of both ramps
            step(e, i)
    for n in tables:
        np.testing.assert_array_equal(loaded.embedding_tables[n], eng.embedding_tables[n])
    # a callable given for a tag wins over its stored warm-up (tag 0: tables a and b, whose
    # Adagrad at rate 0 leaves them as they are); tag 1 keeps its stored one
    again = ee.EmbeddingEngine.load(path, callables={0: lambda step: 0.0})
    before = {n: again.embedding_tables[n].copy() for n in tables}
    rng.bit_generator.state = state
    step(again, 2)
    for n in ("a", "b"):
        np.testing.assert_array_equal(again.embedding_tables[n], before[n])
    assert not np.array_equal(again.embedding_tables["c"], before["c"])


@pytest.mark.parametrize(
    "warmup, match",
    [
        ({"learning_rate": 0.1}, r"must be \{'learning_rate', 'warmup_steps'\}"),
        ({"learning_rate": "x", "warmup_steps": 2}, "learning_rate 'x' is not a finite number"),
        ({"learning_rate": -1.0, "warmup_steps": 2}, "learning_rate -1.0 is not a finite"),
        ({"learning_rate": 0.1, "warmup_steps": 0}, "warmup_steps 0 is not an int >= 1"),
        ({"learning_rate": 0.1, "warmup_steps": 2.5}, "warmup_steps 2.5 is not an int"),
    ],
)
def test_a_bad_stored_warm_up_is_a_spec_error_naming_it(warmup, match):
    t = ee.TableConfig(8, 2, optimizer=mono.AdagradOptimizer(warmup_steps=2), name="t")
    spec = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}).spec()
    lr = spec["tables"][0]["optimizer"]["params"]["learning_rate"]
    assert lr["warmup"] == {"learning_rate": 0.001, "warmup_steps": 2}
    assert ee.EmbeddingEngine.from_spec(spec).num_learning_rate_tags == 1
    lr["warmup"] = warmup
    with pytest.raises(ee.SpecError if hasattr(ee, "SpecError") else ValueError, match=match):
        ee.EmbeddingEngine.from_spec(spec)
