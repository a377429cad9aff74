"""The generated kernels must match their template and row math (numba's cache relies on it)."""

from embengine import optimizers as opt
from embengine.kernels import codegen
from embengine.kernels.fused import FIXED_KERNELS, KERNELS
from embengine.optimizers._row_math import ROW_MATH


def test_generated_kernels_are_current():
    assert codegen.main(["--check"]) == 0, "run: python -m embengine.kernels.codegen"


def test_every_registered_row_math_of_embengine_has_kernels():
    builtin = codegen.builtin_row_math()
    assert {rm.name for rm in builtin} == set(KERNELS)
    for rm in builtin:
        fused, every_row = KERNELS[rm.name]
        assert (every_row is not None) == rm.every_row, rm.name
        assert (rm.name in FIXED_KERNELS) == rm.fixed_layout, rm.name
    assert not [n for n, rm in ROW_MATH.items() if rm not in builtin and n in KERNELS]


def test_each_spec_points_at_its_row_math():
    """The spec picks its registration (the kernel variant) from its own hyperparameters; the
    TPU and Monolith ports' subclasses inherit it."""
    from embengine import monolith, tpu

    assert opt.Adagrad(0.1).row_math(8).name == "adagrad"
    assert opt.Adagrad(0.1, hessian_compression_times=8).row_math(8).name == "adagrad_rowwise"
    assert opt.Adagrad(0.1, hessian_compression_times=2).row_math(8).name == "adagrad_grouped"
    assert opt.FTRL(0.1).row_math(8).name == "ftrl_sqrt"
    assert opt.FTRL(0.1, learning_rate_power=-0.3).row_math(8).name == "ftrl"
    assert opt.Adam(0.1, bias_correction="global").row_math(8).name == "adam_bias"
    assert opt.AMSGrad(0.1).row_math(8).name == "amsgrad"
    assert opt.AdagradMomentum(0.1, exponent=3.0).row_math(8).name == "adagrad_momentum"
    assert opt.AdagradMomentum(0.1).row_math(8).name == "adagrad_momentum_square"
    assert tpu.Adam(0.1).row_math(8) is opt.Adam(0.1).row_math(8)
    assert tpu.FTRL(0.1).row_math(8).name == "ftrl_sqrt"
    assert monolith.BatchSoftmaxOptimizer(0.1).row_math(1).name == "batch_softmax"
    specs = [
        opt.SGD(),
        opt.Assign(),
        opt.Lion(),
        opt.Momentum(),
        opt.RMSProp(),
        opt.Adadelta(),
        opt.ProximalAdagrad(),
        opt.FrequencyEstimator(),
        opt.BatchSoftmax(),
    ]
    for spec in specs:
        assert spec.row_math(1) is type(spec).ROW_MATH is not None


def test_kernel_parameters_are_locals_named_like_the_specs_fields():
    # The generated code reads like the formula: no h0..h5, no padding.
    text = codegen.render([ROW_MATH["adam_bias"]])
    assert "    beta_1 = hp[H_COMMON + 0]" in text
    assert "    use_nesterov = hp[H_COMMON + 4] != 0.0" in text
    assert "step_size = adam_step_size(data_i, r, cols, step, lr, beta_1, beta_2, " in text
    assert "wj, momenta, velocities, vhats = adam_update(" in text
    assert "h0" not in text and "h5" not in text


def test_a_change_in_a_callee_file_changes_the_hash_line_of_every_kernel_above_it():
    # numba's cache watches only a kernel's own file: the training lookup's kernel holds code
    # from prepare.py and lookup.py, and kept running the old code after only they changed.
    base = codegen.callee_lines()
    assert base == {name: (codegen.HERE / name).read_text() for name in codegen.CALLEES}

    def changed(name):
        text = (codegen.HERE / name).read_text() + "# changed\n"
        new = codegen.callee_lines({name: text})
        return {n for n in codegen.CALLEES if n != name and new[n] != base[n]}

    assert changed("_intrinsics.py") == {"prepare.py", "lookup.py", "train_lookup.py",
                                         "shard_route.py"}  # fmt: skip
    assert changed("prepare.py") == {"lookup.py", "train_lookup.py", "shard_route.py"}
    assert changed("lookup.py") == {"train_lookup.py"}
    assert changed("train_lookup.py") == set()
    assert changed("shard_route.py") == set()
