"""Momentum, RMSProp (plain and centered) and Adadelta, as TF's training ops define them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _checks as check
from ._base import LearningRate, Optimizer, SlotSpec
from ._row_math import row_math

f32 = np.float32

# Row math (numba kernels, optimizers/_row_math.py). RMSProp and Adadelta compute in float32
# like the storage (float64 square roots and divisions cost more than the memory traffic);
# Momentum in float64.


@row_math(
    "momentum",
    params=("momentum",),
    flags=("use_nesterov", "velocity_includes_learning_rate"),
    slots=("momenta",),
)
def momentum_update(w, momenta, g, lr, momentum, use_nesterov, velocity_includes_learning_rate):
    mu = momentum
    if velocity_includes_learning_rate:
        v = mu * momenta - lr * g
        return w + ((1.0 + mu) * v - mu * momenta if use_nesterov else v), v
    m = mu * momenta + g
    return w - (lr * (g + mu * m) if use_nesterov else lr * m), m


@row_math(
    "rmsprop",
    params=("rho", "momentum", "epsilon"),
    flags=("centered", "sum_inside_sqrt"),
    slots=("ms", "mom", "mg"),
)
def rmsprop_update(w, ms, mom, mg, g, lr, rho, momentum, epsilon, centered, sum_inside_sqrt):
    """mg: centered only."""
    r, mu, eps = f32(rho), f32(momentum), f32(epsilon)
    gf, c_rho = f32(g), f32(1.0 - rho)
    new_ms = r * f32(ms) + c_rho * gf * gf
    new_mg = r * f32(mg) + c_rho * gf if centered else f32(mg)
    d = new_ms - new_mg * new_mg if centered else new_ms
    e_in, e_out = (eps, f32(0.0)) if sum_inside_sqrt else (f32(0.0), eps)
    root = np.sqrt(d + e_in) + e_out
    new_mom = mu * f32(mom) + f32(lr) * gf / root
    return f32(w) - new_mom, new_ms, new_mom, new_mg


@row_math("adadelta", params=("rho", "epsilon"), slots=("accumulators", "updates"))
def adadelta_update(w, accumulators, updates, g, lr, rho, epsilon):
    r, eps, c_rho, gf = f32(rho), f32(epsilon), f32(1.0 - rho), f32(g)
    acc = r * f32(accumulators) + c_rho * gf * gf
    u = np.sqrt(f32(updates) + eps) / np.sqrt(acc + eps) * gf
    return f32(w) - f32(lr) * u, acc, r * f32(updates) + c_rho * u * u


@dataclass(frozen=True)
class Momentum(Optimizer):
    """Heavy-ball momentum. TF's ``ApplyMomentum`` (default)::

        m <- momentum * m + g                          # slot "momenta"
        w <- w - lr * (g + momentum * m)    if use_nesterov
        w <- w - lr * m                     otherwise

    With ``velocity_includes_learning_rate=True`` (Monolith) the slot holds the step itself, so
    a change of learning rate is not applied retroactively to the accumulated velocity::

        v <- momentum * v - lr * g                     # slot "momenta"
        w <- w + (1 + momentum) * v - momentum * v_old    if use_nesterov
        w <- w + v                                         otherwise

    The two agree exactly while the learning rate is constant (then v = -lr * m).
    """

    learning_rate: LearningRate = 0.01
    momentum: float = 0.9
    use_nesterov: bool = False
    velocity_includes_learning_rate: bool = False

    def _check(self):
        check.non_negative("Momentum", "momentum", self.momentum)
        check.flag("Momentum", "use_nesterov", self.use_nesterov)
        check.flag(
            "Momentum", "velocity_includes_learning_rate", self.velocity_includes_learning_rate
        )

    def slot_specs(self, dim):
        return (SlotSpec("momenta", dim, 0.0),)

    ROW_MATH = momentum_update

    def reference_update(self, w, slots, g, lr, ctx):
        m, mu = slots["momenta"], self.momentum
        if self.velocity_includes_learning_rate:
            old = m.copy()
            m[...] = mu * m - lr * g
            w += (1.0 + mu) * m - mu * old if self.use_nesterov else m
        else:
            m[...] = mu * m + g
            w -= lr * (g + mu * m) if self.use_nesterov else lr * m


@dataclass(frozen=True)
class RMSProp(Optimizer):
    """RMSProp (TF's ``ApplyRMSProp`` / ``ApplyCenteredRMSProp``)::

        ms  <- rho * ms + (1 - rho) * g^2              # slot "ms", starts at initial_ms_value
        mg  <- rho * mg + (1 - rho) * g                # slot "mg", centered only
        d    = ms - mg^2   if centered   else   ms
        r    = sqrt(d + epsilon)   if sum_inside_sqrt (TF)   else   sqrt(d) + epsilon
        mom <- momentum * mom + lr * g / r             # slot "mom"
        w   <- w - mom

    TF starts "ms" at 1; Monolith's RMSProp is ``momentum=0, epsilon=1, sum_inside_sqrt=False,
    initial_ms_value=0`` with its "momentum" as rho.
    """

    learning_rate: LearningRate = 0.001
    rho: float = 0.9
    momentum: float = 0.0
    epsilon: float = 1e-10
    centered: bool = False
    sum_inside_sqrt: bool = True
    initial_ms_value: float = 1.0

    def _check(self):
        check.unit_interval("RMSProp", "rho", self.rho)
        check.non_negative("RMSProp", "momentum", self.momentum)
        check.positive("RMSProp", "epsilon", self.epsilon)
        check.flag("RMSProp", "centered", self.centered)
        check.flag("RMSProp", "sum_inside_sqrt", self.sum_inside_sqrt)
        check.non_negative("RMSProp", "initial_ms_value", self.initial_ms_value)

    def slot_specs(self, dim):
        slots = (SlotSpec("ms", dim, float(self.initial_ms_value)), SlotSpec("mom", dim, 0.0))
        return slots + (SlotSpec("mg", dim, 0.0),) if self.centered else slots

    ROW_MATH = rmsprop_update

    def reference_update(self, w, slots, g, lr, ctx):
        ms, mom = slots["ms"], slots["mom"]
        ms[...] = self.rho * ms + (1.0 - self.rho) * g * g
        d = ms
        if self.centered:
            mg = slots["mg"]
            mg[...] = self.rho * mg + (1.0 - self.rho) * g
            d = ms - mg * mg
        r = np.sqrt(d + self.epsilon) if self.sum_inside_sqrt else np.sqrt(d) + self.epsilon
        mom[...] = self.momentum * mom + lr * g / r
        w -= mom


@dataclass(frozen=True)
class Adadelta(Optimizer):
    """Adadelta (TF's ``ApplyAdadelta``); both slots start at 0::

    a <- rho * a + (1 - rho) * g^2                 # slot "accumulators"
    u  = sqrt(b + epsilon) / sqrt(a + epsilon) * g
    w <- w - lr * u
    b <- rho * b + (1 - rho) * u^2                 # slot "updates"
    """

    learning_rate: LearningRate = 0.001
    rho: float = 0.95
    epsilon: float = 1e-08

    def _check(self):
        check.unit_interval("Adadelta", "rho", self.rho)
        check.positive("Adadelta", "epsilon", self.epsilon)

    def slot_specs(self, dim):
        return (SlotSpec("accumulators", dim, 0.0), SlotSpec("updates", dim, 0.0))

    ROW_MATH = adadelta_update

    def reference_update(self, w, slots, g, lr, ctx):
        a, b = slots["accumulators"], slots["updates"]
        a[...] = self.rho * a + (1.0 - self.rho) * g * g
        u = np.sqrt(b + self.epsilon) / np.sqrt(a + self.epsilon) * g
        w -= lr * u
        b[...] = self.rho * b + (1.0 - self.rho) * u * u
