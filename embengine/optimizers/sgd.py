"""Stochastic gradient descent."""

from __future__ import annotations

from dataclasses import dataclass

from ._base import LearningRate, Optimizer
from ._row_math import row_math


@row_math("sgd")
def sgd_update(w, g, lr):
    return w - lr * g


@row_math("assign", needs_accumulation=True)
def assign_update(g):
    return g


@dataclass(frozen=True)
class SGD(Optimizer):
    """Plain SGD::

        w <- w - lr * g

    No slots.
    """

    learning_rate: LearningRate = 0.01

    ROW_MATH = sgd_update

    def reference_update(self, w, slots, g, lr, ctx):
        w -= lr * g


@dataclass(frozen=True)
class Assign(Optimizer):
    """Sets the weights to the (accumulated) gradient, as the TPU's Assign::

        w <- g

    Needs gradient accumulation: the row's value is the sum of its contributions in the step.
    The learning rate is not used.
    """

    learning_rate: LearningRate = 0.0

    def _needs_accumulation(self):
        return "Assign (w = accumulated g)"

    ROW_MATH = assign_update

    def reference_update(self, w, slots, g, lr, ctx):
        w[...] = g
