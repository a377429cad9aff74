"""Adagrad, its compressed-accumulator (row-wise) form, AdagradMomentum and ProximalAdagrad."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _checks as check
from ._base import LearningRate, Optimizer, SlotSpec
from ._row_math import row_math

f32 = np.float32

# Row math (numba kernels, optimizers/_row_math.py). Adagrad computes in float32 like the
# storage (float64 square roots and divisions cost more than the memory traffic); the others,
# whose results hinge on powers of tiny values or thresholds, in float64.


@row_math("adagrad", slots=("accumulators",), float32_gradient=True)
def adagrad_update(w, accumulators, g, lr):
    gf = f32(g)
    acc = f32(accumulators) + gf * gf
    return f32(w) - f32(lr) * gf / np.sqrt(acc), acc


@row_math("adagrad_rowwise", form="scaled", slots=("accumulators",))
def adagrad_rowwise(accumulators, sum_g2, lr, dim):
    """One accumulator per row (k = dim): acc += mean(g^2); step = lr / sqrt(acc)."""
    acc = accumulators + sum_g2 / dim
    return acc, lr / np.sqrt(acc)


@row_math(
    "adagrad_grouped", form="row", params=("hessian_compression_times",), slots=("accumulators",)
)
def adagrad_groups(w, accumulators, g, lr, hessian_compression_times, dim):
    """One accumulator per k dims, fed the mean of g^2 over its group."""
    k = np.int64(hessian_compression_times)
    for grp in range(dim // k):
        s = 0.0
        for j in range(grp * k, grp * k + k):
            s += g[j] * g[j]
        acc = np.float64(accumulators[grp]) + s / k
        accumulators[grp] = acc
        scale = lr / np.sqrt(acc)
        for j in range(grp * k, grp * k + k):
            w[j] = w[j] - scale * g[j]


@row_math(
    "adagrad_momentum",
    params=("momentum", "exponent", "beta2", "epsilon"),
    flags=("use_nesterov",),
    slots=("accumulators", "momenta"),
    constants={"square": False},
)
def adagrad_momentum_update(
    w, accumulators, momenta, g, lr, momentum, use_nesterov, exponent, beta2, epsilon, square
):
    """``square``: exponent = 2, a square root instead of a power (a kernel of its own: a branch
    between the two inside the loop would be if-converted into computing both)."""
    acc = accumulators + g * g if beta2 == 1.0 else beta2 * accumulators + (1.0 - beta2) * g * g
    s = g / np.sqrt(acc + epsilon) if square else (acc + epsilon) ** (-1.0 / exponent) * g
    m = momentum * momenta + s
    return w - lr * (momentum * m + s if use_nesterov else m), acc, m


ADAGRAD_MOMENTUM_SQUARE = adagrad_momentum_update.variant(
    "adagrad_momentum_square", constants={"square": True}
)


@row_math(
    "proximal_adagrad",
    params=("l1_regularization_strength", "l2_regularization_strength"),
    slots=("accumulators",),
)
def proximal_adagrad_update(
    w, accumulators, g, lr, l1_regularization_strength, l2_regularization_strength
):
    acc = accumulators + g * g
    rate = lr / np.sqrt(acc)
    v = w - rate * g
    shrunk = max(abs(v) - rate * l1_regularization_strength, 0.0)
    return np.sign(v) * shrunk / (1.0 + rate * l2_regularization_strength), acc


def _group_mean(x: np.ndarray, k: int) -> np.ndarray:
    """Mean over consecutive groups of k columns: [n, dim] -> [n, dim // k]."""
    return x.reshape(x.shape[0], -1, k).mean(axis=2)


@dataclass(frozen=True)
class Adagrad(Optimizer):
    """Adagrad as on TPU (no epsilon), with Monolith's optional accumulator compression::

        a <- a + g^2                     # slot "accumulators", starts at initial_accumulator_value
        w <- w - lr * g / sqrt(a)

    With ``hessian_compression_times = k`` one accumulator serves k consecutive dims and is fed
    the mean of g^2 over its group (``k = dim`` is row-wise Adagrad, FBGEMM's
    EXACT_ROWWISE_ADAGRAD)::

        a_j <- a_j + mean(g[j*k:(j+1)*k]^2)
        w[j*k:(j+1)*k] <- w[j*k:(j+1)*k] - lr * g[j*k:(j+1)*k] / sqrt(a_j)

    Args:
      initial_accumulator_value: the accumulators' start value; must be > 0 (it alone keeps
        ``g / sqrt(a)`` finite for a zero gradient).
      hessian_compression_times: k, which must divide the table's dim.
    """

    learning_rate: LearningRate = 0.001
    initial_accumulator_value: float = 0.1
    hessian_compression_times: int = 1

    def _check(self):
        check.positive("Adagrad", "initial_accumulator_value", self.initial_accumulator_value)
        check.integer(
            "Adagrad", "hessian_compression_times", self.hessian_compression_times, minimum=1
        )

    def check_dim(self, dim):
        k = self.hessian_compression_times
        if dim % k:
            raise ValueError(
                f"Adagrad: hessian_compression_times={k} must divide the table's dim={dim}"
            )

    def slot_specs(self, dim):
        width = dim // self.hessian_compression_times
        return (SlotSpec("accumulators", width, float(self.initial_accumulator_value)),)

    def row_math(self, dim):
        k = self.hessian_compression_times
        return adagrad_update if k == 1 else adagrad_rowwise if k == dim else adagrad_groups

    def reference_update(self, w, slots, g, lr, ctx):
        k = self.hessian_compression_times
        a = slots["accumulators"]
        a += _group_mean(g * g, k)
        w -= lr * g / np.repeat(np.sqrt(a), k, axis=1)


@dataclass(frozen=True)
class AdagradMomentum(Optimizer):
    """Adagrad with momentum, in the form the TPU (SparseCore) runs; both slots start at 0::

        a <- a + g^2                         if beta2 == 1     # slot "accumulators"
        a <- beta2 * a + (1 - beta2) * g^2   otherwise
        s  = (a + epsilon)^(-1 / exponent) * g
        m <- momentum * m + s                                  # slot "momenta"
        w <- w - lr * (momentum * m + s)     if use_nesterov
        w <- w - lr * m                      otherwise

    (The TPU proto's comment puts g outside the momentum; TF's TPU tests, TF SparseCore and JAX
    SparseCore all put it inside, as here.)
    """

    learning_rate: LearningRate = 0.001
    momentum: float = 0.0
    use_nesterov: bool = False
    exponent: float = 2
    beta2: float = 1
    epsilon: float = 1e-10

    def _check(self):
        check.non_negative("AdagradMomentum", "momentum", self.momentum)
        check.flag("AdagradMomentum", "use_nesterov", self.use_nesterov)
        check.positive("AdagradMomentum", "exponent", self.exponent)
        check.unit_interval("AdagradMomentum", "beta2", self.beta2, include_one=True)
        check.positive("AdagradMomentum", "epsilon", self.epsilon)

    def slot_specs(self, dim):
        return (SlotSpec("accumulators", dim, 0.0), SlotSpec("momenta", dim, 0.0))

    def row_math(self, dim):
        return ADAGRAD_MOMENTUM_SQUARE if self.exponent == 2 else adagrad_momentum_update

    def reference_update(self, w, slots, g, lr, ctx):
        a, m = slots["accumulators"], slots["momenta"]
        if self.beta2 == 1:
            a += g * g
        else:
            a[...] = self.beta2 * a + (1.0 - self.beta2) * g * g
        s = np.power(a + self.epsilon, -1.0 / self.exponent) * g
        m[...] = self.momentum * m + s
        w -= lr * (self.momentum * m + s if self.use_nesterov else m)


@dataclass(frozen=True)
class ProximalAdagrad(Optimizer):
    """Adagrad followed by the proximal step of l1 / l2 (TF's ``ApplyProximalAdagrad``)::

    a <- a + g^2                                  # slot "accumulators"
    r  = lr / sqrt(a)
    v  = w - r * g
    w <- sign(v) * max(|v| - r * l1, 0) / (1 + r * l2)
    """

    learning_rate: LearningRate = 0.001
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    initial_accumulator_value: float = 0.1

    def _check(self):
        owner = "ProximalAdagrad"
        check.non_negative(owner, "l1_regularization_strength", self.l1_regularization_strength)
        check.non_negative(owner, "l2_regularization_strength", self.l2_regularization_strength)
        check.positive(owner, "initial_accumulator_value", self.initial_accumulator_value)

    def slot_specs(self, dim):
        return (SlotSpec("accumulators", dim, float(self.initial_accumulator_value)),)

    ROW_MATH = proximal_adagrad_update

    def reference_update(self, w, slots, g, lr, ctx):
        a = slots["accumulators"]
        a += g * g
        r = lr / np.sqrt(a)
        v = w - r * g
        shrunk = np.maximum(np.abs(v) - r * self.l1_regularization_strength, 0.0)
        w[...] = np.sign(v) * shrunk / (1.0 + r * self.l2_regularization_strength)
