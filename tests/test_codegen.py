"""The update kernels rendered from the template: one module per registered row math, its
kernels by the spec's names; the tool that writes them out for reading."""

from embengine import optimizers as opt
from embengine.kernels import codegen, row_math
from embengine.optimizers._row_math import ROW_MATH


def test_every_registered_row_math_of_embengine_has_kernels():
    builtin = codegen.builtin_row_math()
    assert len(builtin) >= 15 and {"sgd", "adam", "ftrl_sqrt"} <= {rm.name for rm in builtin}
    for rm in builtin:
        fused, every_row, fixed = row_math.kernels(rm)
        assert fused.py_func.__name__ == f"fused_update_{rm.name}", rm.name
        assert (every_row is not None) == rm.every_row, rm.name
        assert (fixed is not None) == rm.fixed_layout, rm.name
        assert row_math.kernels(rm)[0] is fused  # rendered and imported once per process


def test_the_tool_writes_the_kernels_out_for_reading(tmp_path, capsys):
    out = tmp_path / "kernels.py"
    assert codegen.main([str(out), "sgd", "adam"]) == 0
    assert out.read_text() == codegen.render([ROW_MATH["sgd"], ROW_MATH["adam"]])
    assert "def fused_update_adam(" in out.read_text() and "wrote" in capsys.readouterr().out
    assert codegen.main([str(out), "no_such_row_math"]) == 2
    assert "no row math registered as ['no_such_row_math']" in capsys.readouterr().err
    assert codegen.main([]) == 2


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


def test_the_16_bit_kernels_locals_are_reserved_names():
    # a row math param or slot of one of these names would shadow the 16-bit kernels' own
    reserved = codegen.reserved_names()
    assert {"words", "rbits", "key", "data_h", "hw", "hs0", "hs2", "n_words", "v"} <= reserved
    # the in-place row layout kernels' scratch and the layout's constants
    assert {"old_h", "old_f", "h", "LAYOUT", "DIM", "F0", "N0", "F2", "N2"} <= reserved
    # the task counter of every update kernel (kernels/tasks.py)
    assert {"claims", "n_tasks", "fetch_add", "task"} <= reserved
