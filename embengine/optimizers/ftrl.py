"""FTRL-proximal."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import _checks as check
from ._base import LearningRate, Optimizer, SlotSpec
from ._row_math import row_math


# Row math (numba kernels, optimizers/_row_math.py), in float64: the result hinges on a
# threshold and on powers of small accumulators.
@row_math(
    "ftrl",
    params=(
        "learning_rate_power",
        "l1_regularization_strength",
        "l2_regularization_strength",
        "beta",
    ),
    flags=("multiply_linear_by_learning_rate",),
    slots=("accumulators", "linears"),
    constants={"square_root": False},
)
def ftrl_update(
    w,
    accumulators,
    linears,
    g,
    lr,
    learning_rate_power,
    l1_regularization_strength,
    l2_regularization_strength,
    beta,
    multiply_linear_by_learning_rate,
    square_root,
):
    """``square_root``: learning_rate_power = -0.5 (the default), square roots instead of
    powers (a kernel of its own)."""
    p, l1, l2 = -learning_rate_power, l1_regularization_strength, l2_regularization_strength
    a = accumulators
    acc = a + g * g
    if square_root:
        root = np.sqrt(acc)
        growth = root - np.sqrt(a)
    else:
        root = acc**p
        growth = root - a**p
    if multiply_linear_by_learning_rate:
        z = linears + lr * g - growth * w
        q = root + 2.0 * l2 * lr + beta
        threshold = l1 * lr
    else:
        z = linears + g - growth / lr * w
        q = root / lr + 2.0 * l2 + beta / lr
        threshold = l1
    new_w = (np.sign(z) * threshold - z) / q if abs(z) > threshold else 0.0
    return new_w, acc, z


FTRL_SQRT = ftrl_update.variant("ftrl_sqrt", constants={"square_root": True})


@dataclass(frozen=True)
class FTRL(Optimizer):
    """FTRL-proximal as in TF's ``ApplyFtrlV2`` / the TPU proto, with ``p = -learning_rate_power``
    (0.5 by default), ``a`` = "accumulators", ``z`` = "linears"::

        a' = a + g^2
        z <- z + g - (a'^p - a^p) / lr * w
        q  = a'^p / lr + 2 * l2 + beta / lr
        w <- (sign(z) * l1 - z) / q   if |z| > l1   else 0
        a <- a'

    With ``multiply_linear_by_learning_rate=True`` the slot holds ``z * lr`` instead (identical for
    a constant rate, and finite for lr = 0)::

        z <- z + lr * g - (a'^p - a^p) * w
        q  = a'^p + 2 * l2 * lr + beta
        w <- (sign(z) * l1 * lr - z) / q   if |z| > l1 * lr   else 0

    ``beta / (2 lr)`` added to l2 gives TF's other FTRL implementations. ``allow_zero_accumulator``
    permits ``initial_accumulator_value = 0``.
    """

    learning_rate: LearningRate = 0.001
    learning_rate_power: float = -0.5
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    beta: float = 0.0
    initial_accumulator_value: float = 0.1
    multiply_linear_by_learning_rate: bool = False
    allow_zero_accumulator: bool = False

    def _check(self):
        check.non_positive("FTRL", "learning_rate_power", self.learning_rate_power)
        for name in ("l1_regularization_strength", "l2_regularization_strength", "beta"):
            check.non_negative("FTRL", name, getattr(self, name))
        for name in ("multiply_linear_by_learning_rate", "allow_zero_accumulator"):
            check.flag("FTRL", name, getattr(self, name))
        a0 = self.initial_accumulator_value
        ok = check.is_number(a0) and math.isfinite(a0)
        if not ok or a0 < 0 or (a0 == 0 and not self.allow_zero_accumulator):
            raise ValueError(
                "FTRL: initial_accumulator_value must be > 0 (or >= 0 with "
                f"allow_zero_accumulator=True), got {a0!r}"
            )

    def check_learning_rate(self, lr):
        """Also lr > 0 unless ``multiply_linear_by_learning_rate``: the update divides by lr."""
        super().check_learning_rate(lr)
        if lr == 0 and not self.multiply_linear_by_learning_rate:
            raise ValueError(
                "FTRL divides by the learning rate, which is 0: give a rate > 0 (or use "
                "multiply_linear_by_learning_rate=True, which allows 0)"
            )

    def slot_specs(self, dim):
        return (
            SlotSpec("accumulators", dim, float(self.initial_accumulator_value)),
            SlotSpec("linears", dim, 0.0),
        )

    def row_math(self, dim):
        return FTRL_SQRT if self.learning_rate_power == -0.5 else ftrl_update

    def reference_update(self, w, slots, g, lr, ctx):
        a, z = slots["accumulators"], slots["linears"]
        p = -self.learning_rate_power
        l1, l2, beta = self.l1_regularization_strength, self.l2_regularization_strength, self.beta
        a_new = a + g * g
        growth = np.power(a_new, p) - np.power(a, p)
        if self.multiply_linear_by_learning_rate:
            z += lr * g - growth * w
            q = np.power(a_new, p) + 2.0 * l2 * lr + beta
            threshold = l1 * lr
        else:
            z += g - growth / lr * w
            q = np.power(a_new, p) / lr + 2.0 * l2 + beta / lr
            threshold = l1
        w[...] = np.where(np.abs(z) > threshold, (np.sign(z) * threshold - z) / q, 0.0)
        a[...] = a_new
