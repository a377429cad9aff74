"""The generated kernels must match their template and row math (numba's cache relies on it)."""

from embengine.kernels import codegen
from embengine.kernels.fused import KERNELS
from embengine.kernels.row_math import OPTIMIZER_CLASSES, VARIANTS, variant


def test_generated_kernels_are_current():
    assert codegen.main(["--check"]) == 0, "run: python -m embengine.kernels.codegen"


def test_every_optimizer_has_kernels():
    assert set(KERNELS) == set(VARIANTS)
    params = {"Adagrad": (1,), "Adam": (0.9, 0.999, 1e-7, 1, 0, 0), "AMSGrad": (0, 0, 0, 0, 0, 2),
              "FTRL": (0.5,), "AdagradMomentum": (0, 0, 2)}  # fmt: skip
    for cls in OPTIMIZER_CLASSES:
        assert variant(cls, params.get(cls, ()), 8) in KERNELS
    assert variant("Adagrad", (8,), 8) == "adagrad_rowwise"
    assert variant("Adagrad", (2,), 8) == "adagrad_grouped"
    assert variant("FTRL", (0.3,), 8) == "ftrl"


def test_a_change_in_a_callee_file_changes_the_hash_line_of_every_kernel_above_it():
    # numba's cache watches only a kernel's own file: the training lookup's kernel holds code
    # from prepare.py and lookup.py, and kept running the old code after only they changed.
    base = codegen.callee_lines()
    assert base == {name: (codegen.HERE / name).read_text() for name in codegen.CALLEES}

    def changed(name):
        text = (codegen.HERE / name).read_text() + "# changed\n"
        new = codegen.callee_lines({name: text})
        return {n for n in codegen.CALLEES if n != name and new[n] != base[n]}

    assert changed("_intrinsics.py") == {"prepare.py", "lookup.py", "train_lookup.py"}
    assert changed("prepare.py") == {"lookup.py", "train_lookup.py"}
    assert changed("lookup.py") == {"train_lookup.py"}
    assert changed("train_lookup.py") == set()
