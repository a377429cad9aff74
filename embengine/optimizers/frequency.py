"""Optimizers that estimate how often ids occur; the table's value is the estimate.

Both ignore the gradient: a row is updated because it was looked up. Both need gradient
accumulation, so an id seen twice in one step counts once, and a table of dim 1. The global step
``s`` they use is the 1-based number of the step being applied (``engine.step + 1``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..initializers import Constant
from . import _checks as check
from ._base import LearningRate, Optimizer, SlotSpec
from ._row_math import row_math


# Row math (numba kernels, optimizers/_row_math.py): the steps since the row was last seen come
# from a prologue that also records this step; rows of dim 1, so no fixed-layout kernel.
def steps_since_last_hit(data_i, r, cols, step):
    """Steps since this row was last seen, and record this step (1-based) as its last."""
    s = step + 1
    delta = np.float64(s - data_i[r, cols[0]])
    data_i[r, cols[0]] = s
    return delta


@row_math(
    "frequency_estimator",
    params=("tau", "max_delta", "outlier_threshold"),
    prologue=steps_since_last_hit,
    prologue_result="delta",
    fixed_layout=False,
    needs_accumulation=True,
    every_row=False,
)
def frequency_estimate(w, delta, tau, max_delta, outlier_threshold):
    clipped = min(delta, max_delta)
    return clipped if delta >= outlier_threshold * w else (1.0 - tau) * w + tau * clipped


@row_math(
    "batch_softmax",
    prologue=steps_since_last_hit,
    prologue_result="delta",
    fixed_layout=False,
    needs_accumulation=True,
    every_row=False,
)
def batch_softmax_update(w, lr, delta):
    return (1.0 - lr) * w + lr * delta


def _dim_one(owner: str, dim: int) -> None:
    if dim != 1:
        raise ValueError(f"{owner}: the table's dim must be 1, got dim={dim}")


class _CountingOptimizer(Optimizer):
    def _check_counting(self):
        name = type(self).__name__
        if self.weight_decay_factor or self.clipvalue is not None:
            raise ValueError(
                f"{name}: ignores the gradient, so weight_decay_factor and clipvalue make no "
                f"sense (got weight_decay_factor={self.weight_decay_factor!r}, "
                f"clipvalue={self.clipvalue!r})"
            )

    def _needs_accumulation(self):
        return f"{type(self).__name__} (an id seen twice in one step counts once)"

    def check_dim(self, dim):
        _dim_one(type(self).__name__, dim)

    def int_slot_range(self, name, step):
        """The 1-based step that last saw the row (0: none yet), at most ``step``."""
        return (0, step)


@dataclass(frozen=True)
class FrequencyEstimator(_CountingOptimizer):
    """TF's FrequencyEstimator: the table holds D, the estimated number of steps between two
    batches that hit the id (its sampling probability per batch is about 1 / D)::

        delta = s - last_hit_step                      # slot "last_hit_step", int32, starts at 0
        c     = min(delta, max_delta)
        D    <- c                          if delta >= outlier_threshold * D
        D    <- (1 - tau) * D + tau * c    otherwise
        last_hit_step <- s

    D starts at ``max_delta`` (the default initializer of such a table). ``weight_exponent`` is
    kept for TF compatibility; ``sample_weight(D) = (D / max_delta) ^ weight_exponent`` is the
    transform TF documents for turning D into weights. The learning rate is not used (TF feeds
    the global step through it; embengine knows the step).
    """

    learning_rate: LearningRate = 0.0
    tau: float = 0.1
    max_delta: float = 1000.0
    outlier_threshold: float = 10.0
    weight_exponent: float = 1.0

    def _check(self):
        check.unit_interval("FrequencyEstimator", "tau", self.tau, include_one=True)
        check.positive("FrequencyEstimator", "max_delta", self.max_delta)
        check.positive("FrequencyEstimator", "outlier_threshold", self.outlier_threshold)
        check.non_negative("FrequencyEstimator", "weight_exponent", self.weight_exponent)
        self._check_counting()

    @property
    def default_initializer(self):
        return Constant(float(self.max_delta))

    def slot_specs(self, dim):
        return (SlotSpec("last_hit_step", 1, 0, "int32"),)

    def sample_weight(self, estimate):
        """TF's documented transform of the estimate into a weight."""
        return (estimate / self.max_delta) ** self.weight_exponent

    ROW_MATH = frequency_estimate

    def reference_update(self, w, slots, g, lr, ctx):
        last = slots["last_hit_step"]
        s = ctx.step + 1
        delta = (s - last).astype(float)
        clipped = delta.clip(max=self.max_delta)
        outlier = delta >= self.outlier_threshold * w
        w[...] = np.where(outlier, clipped, (1.0 - self.tau) * w + self.tau * clipped)
        last[...] = s


@dataclass(frozen=True)
class BatchSoftmax(_CountingOptimizer):
    """Monolith's BatchSoftmax (streaming frequency estimation, Yi et al. 2019): the table holds
    B, the estimated number of steps between two sightings of the id, with ``a = learning_rate``::

        B <- (1 - a) * B + a * (s - last_seen)         # slot "last_seen_step", int32, starts at 0
        last_seen <- s

    An id seen every k steps converges to B = k; the sampling probability is about 1 / B. Tables
    default to ``Constant(1.0)`` (Monolith's BatchSoftmaxInitializer(init_step_interval)).
    """

    learning_rate: LearningRate = 0.1

    def _check(self):
        lr = self.learning_rate
        if check.is_number(lr) and not 0.0 <= lr <= 1.0:
            raise ValueError(f"BatchSoftmax: learning_rate (alpha) must be in [0, 1], got {lr!r}")
        self._check_counting()

    @property
    def default_initializer(self):
        return Constant(1.0)

    def slot_specs(self, dim):
        return (SlotSpec("last_seen_step", 1, 0, "int32"),)

    ROW_MATH = batch_softmax_update

    def reference_update(self, w, slots, g, lr, ctx):
        last = slots["last_seen_step"]
        s = ctx.step + 1
        w[...] = (1.0 - lr) * w + lr * (s - last)
        last[...] = s
