"""Adam (lazy or not, bias correction none / global / per row), AMSGrad and Lion."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _checks as check
from ._base import LearningRate, Optimizer, SlotSpec
from ._row_math import row_math

BIAS_CORRECTIONS = (None, "global", "per_row")

f32 = np.float32

# Row math (numba kernels, optimizers/_row_math.py). Adam computes in float32 like the storage
# (float64 square roots and divisions cost more than the memory traffic); Lion, whose result
# is a sign, in float64.


def constant_step_size(lr):
    """Without bias correction the step size is the learning rate."""
    return lr


def adam_step_size(data_i, r, cols, step, lr, beta_1, beta_2, bias_correction_per_row):
    """lr * sqrt(1 - b2^t) / (1 - b1^t), t the 1-based global step, or this row's update count
    (an int32 slot, the row's last, counted here; it stops at 2^31 - 1, ``Adam``)."""
    if bias_correction_per_row:
        col = cols[cols.shape[0] - 1]
        if data_i[r, col] < 2147483647:  # saturates: never wraps to negative counts
            data_i[r, col] += 1
        t = np.float64(data_i[r, col])
    else:
        t = np.float64(step + 1)
    return lr * np.sqrt(1.0 - beta_2**t) / (1.0 - beta_1**t)


@row_math(
    "adam",
    params=("beta_1", "beta_2", "epsilon"),
    flags=("sum_inside_sqrt", "use_nesterov", "bias_correction_per_row"),
    slots=("momenta", "velocities", "vhats"),
    constants={"amsgrad": False},
    prologue=constant_step_size,
    prologue_result="step_size",
    float32_gradient=True,
)
def adam_update(
    w,
    momenta,
    velocities,
    vhats,
    g,
    step_size,
    beta_1,
    beta_2,
    epsilon,
    sum_inside_sqrt,
    use_nesterov,
    amsgrad,
):
    """``amsgrad``: divide by vhats, the running maximum of v (AMSGrad's kernels)."""
    # 1 - beta in float64 before rounding: f32(1) - f32(0.999) is off by 1e-5 relative.
    b1, b2, c1, c2 = f32(beta_1), f32(beta_2), f32(1.0 - beta_1), f32(1.0 - beta_2)
    eps = f32(epsilon)
    gf = f32(g)
    m = b1 * f32(momenta) + c1 * gf
    v = b2 * f32(velocities) + c2 * gf * gf
    vhat = max(f32(vhats), v) if amsgrad else v
    u = b1 * m + c1 * gf if use_nesterov else m
    # sqrt(v + eps^2) or sqrt(v) + eps, with one square root and no branch in the loop
    e_in, e_out = (eps, f32(0.0)) if sum_inside_sqrt else (f32(0.0), eps)
    d = np.sqrt(vhat + e_in * e_in) + e_out
    return f32(w) - f32(step_size) * u / d, m, v, vhat


ADAM_BIAS = adam_update.variant("adam_bias", prologue=adam_step_size)
AMSGRAD = adam_update.variant("amsgrad", constants={"amsgrad": True})
AMSGRAD_BIAS = ADAM_BIAS.variant("amsgrad_bias", constants={"amsgrad": True})


@row_math("lion", params=("beta_1", "beta_2"), slots=("momenta",))
def lion_update(w, momenta, g, lr, beta_1, beta_2):
    u = beta_1 * momenta + (1.0 - beta_1) * g
    return w - lr * np.sign(u), beta_2 * momenta + (1.0 - beta_2) * g


@dataclass(frozen=True)
class Adam(Optimizer):
    """Adam. By default as on TPU: lazy, no bias correction, epsilon inside the square root::

        m <- beta_1 * m + (1 - beta_1) * g            # slot "momenta"
        v <- beta_2 * v + (1 - beta_2) * g^2          # slot "velocities"
        u  = beta_1 * m + (1 - beta_1) * g  if use_nesterov  else  m
        w <- w - a * u / sqrt(v + epsilon^2)          # sum_inside_sqrt=True (TF's default)
        w <- w - a * u / (sqrt(v) + epsilon)          # sum_inside_sqrt=False

    where ``a = lr`` without bias correction (the TPU leaves it to a learning-rate schedule) and
    ``a = lr * sqrt(1 - beta_2^t) / (1 - beta_1^t)`` with it: ``t`` is the 1-based global step for
    ``bias_correction="global"``, and the row's own number of updates so far, this one included,
    for ``"per_row"`` (Monolith's per-id correction; slot "steps", int32). Without gradient
    accumulation a row counts an update per occurrence, so a hot row may reach 2^31 - 1 by
    training alone: its count stops there (it wrapped to negative counts, NaN steps), where
    ``1 - beta^t`` is 1 in float64 for every beta <= 1 - 1e-7.

    Args:
      lazy_adam: True (default) updates only the rows of the batch. False updates every row of the
        table each step (untouched rows see g = 0): time proportional to the vocabulary; needs
        gradient accumulation.
      sum_inside_sqrt: where epsilon goes, see above.
      use_nesterov: Nesterov momentum as in TF's ``ApplyAdam``.
      bias_correction: None, "global" or "per_row".
    """

    learning_rate: LearningRate = 0.001
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-07
    lazy_adam: bool = True
    sum_inside_sqrt: bool = True
    use_nesterov: bool = False
    bias_correction: str | None = None

    def _check(self):
        name = type(self).__name__
        check.unit_interval(name, "beta_1", self.beta_1)
        check.unit_interval(name, "beta_2", self.beta_2)
        check.positive(name, "epsilon", self.epsilon)
        for f in ("lazy_adam", "sum_inside_sqrt", "use_nesterov"):
            check.flag(name, f, getattr(self, f))
        check.choice(name, "bias_correction", self.bias_correction, BIAS_CORRECTIONS)

    def _needs_accumulation(self):
        return None if self.lazy_adam else "lazy_adam=False (every row is updated each step)"

    @property
    def updates_every_row(self):
        return not self.lazy_adam

    def slot_specs(self, dim):
        slots = (SlotSpec("momenta", dim, 0.0), SlotSpec("velocities", dim, 0.0))
        if self.bias_correction == "per_row":
            slots += (SlotSpec("steps", 1, 0, "int32"),)
        return slots

    def int_slot_range(self, name, step):
        """ "steps" counts the row's updates: at most one a step with gradient accumulation,
        one an occurrence without (at most int32's largest then)."""
        return (0, step if self.use_gradient_accumulation else 2**31 - 1)

    def _step_size(self, lr, slots, ctx):
        """``a`` of the docstring, a scalar or a [rows, 1] column."""
        if self.bias_correction is None:
            return lr
        if self.bias_correction == "global":
            t = float(ctx.step + 1)
        else:
            steps = slots["steps"]
            steps += steps < np.iinfo(np.int32).max  # saturates at 2^31 - 1, as the kernels
            t = steps.astype(np.float64)
        return lr * np.sqrt(1.0 - self.beta_2**t) / (1.0 - self.beta_1**t)

    def _denominator(self, v):
        if self.sum_inside_sqrt:
            return np.sqrt(v + self.epsilon**2)
        return np.sqrt(v) + self.epsilon

    @property
    def bias_correction_per_row(self) -> bool:
        """Whether the bias correction counts each row's own updates (slot "steps")."""
        return self.bias_correction == "per_row"

    def row_math(self, dim):
        return ADAM_BIAS if self.bias_correction else adam_update

    def _second_moment(self, slots, v):
        """The v that divides: v itself (AMSGrad overrides)."""
        return v

    def reference_update(self, w, slots, g, lr, ctx):
        m, v = slots["momenta"], slots["velocities"]
        m[...] = self.beta_1 * m + (1.0 - self.beta_1) * g
        v[...] = self.beta_2 * v + (1.0 - self.beta_2) * g * g
        u = self.beta_1 * m + (1.0 - self.beta_1) * g if self.use_nesterov else m
        d = self._denominator(self._second_moment(slots, v))
        w -= self._step_size(lr, slots, ctx) * u / d


@dataclass(frozen=True)
class AMSGrad(Adam):
    """Adam whose denominator uses the running maximum of v (Reddi et al. 2018; Monolith)::

        v_hat <- max(v_hat, v)                        # slot "vhats", after v is updated
        w <- w - a * u / sqrt(v_hat + epsilon^2)     (or sqrt(v_hat) + epsilon)

    Everything else, including the knobs and bias correction, is Adam's.
    """

    def slot_specs(self, dim):
        base = super().slot_specs(dim)
        return base[:2] + (SlotSpec("vhats", dim, 0.0),) + base[2:]

    def row_math(self, dim):
        return AMSGRAD_BIAS if self.bias_correction else AMSGRAD

    def _second_moment(self, slots, v):
        vhat = slots["vhats"]
        np.maximum(vhat, v, out=vhat)
        return vhat


@dataclass(frozen=True)
class Lion(Optimizer):
    """Lion (Chen et al. 2023), as in the TPU proto::

        u  = beta_1 * m + (1 - beta_1) * g
        w <- w - lr * sign(u)
        m <- beta_2 * m + (1 - beta_2) * g            # slot "momenta"

    Args:
      lazy_lion: True (default) updates only the rows of the batch; False updates every row each
        step (TF's use_non_lazy_lion), needs gradient accumulation.
    """

    learning_rate: LearningRate = 0.0001
    beta_1: float = 0.9
    beta_2: float = 0.99
    lazy_lion: bool = True

    def _check(self):
        check.unit_interval("Lion", "beta_1", self.beta_1)
        check.unit_interval("Lion", "beta_2", self.beta_2)
        check.flag("Lion", "lazy_lion", self.lazy_lion)

    def _needs_accumulation(self):
        return None if self.lazy_lion else "lazy_lion=False (every row is updated each step)"

    @property
    def updates_every_row(self):
        return not self.lazy_lion

    def slot_specs(self, dim):
        return (SlotSpec("momenta", dim, 0.0),)

    ROW_MATH = lion_update

    def reference_update(self, w, slots, g, lr, ctx):
        m = slots["momenta"]
        w -= lr * np.sign(self.beta_1 * m + (1.0 - self.beta_1) * g)
        m[...] = self.beta_2 * m + (1.0 - self.beta_2) * g
