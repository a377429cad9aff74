"""Each optimizer's per-row math, for the fused update kernels that ``codegen.py`` writes.

The kernels own the loop over touched rows and the common pipeline (gradient clipping, weight
decay, weight clipping); an optimizer contributes only its math, in one of three forms:

- an *element* function, for optimizers whose update is elementwise::

      w, a, b, c = f(w, a, b, c, g, lr, h0, h1, h2, h3, h4, h5, pa, pb)

  on scalars: the weight ``w`` and float slots ``a``, ``b``, ``c`` (the row's first three float
  slots, in ``slot_specs`` order) of one coordinate, its gradient ``g`` (float64, accumulated,
  clipped, with l2 decay), the step's learning rate, the optimizer's ``kernel_params()`` as
  ``h0..h5`` and two per-row values ``pa, pb`` computed once per row by an optional *prologue*
  ``pa, pb = p(data_i, r, cols, step, lr, h0, h1, h2, h3, h4, h5)`` (which may update the row's
  int32 slots, such as Adam's per-row step count);
- a *scaled* function ``slot, step = f(slot, sum_g2, lr, h0, dim)`` for row-wise
  preconditioning: from the row's first slot value and its sum of squared gradients, the new
  slot value and one step size for the row (``w -= step * g``), e.g. row-wise Adagrad;
- a *row* function ``f(w, s0, g, lr, h0, dim)`` on the row's weights and first float slot, for
  other updates that mix coordinates (Adagrad with one accumulator per group of k dims).

Scalar functions without array arguments inline into the kernel's loop over coordinates, which
LLVM then vectorises; array arguments to a branching inlined function cost atomic reference
counts per row, and two offsets into one packed row defeat vectorisation, so the kernels copy
the row into scratch arrays first (see codegen.py).

Optimizers whose math is a few products, square roots and divisions (Adagrad, Adam, RMSProp,
Adadelta) compute in float32, like the storage: float64 square roots and divisions cost more
than the memory traffic. Those whose results hinge on thresholds, signs or powers of tiny values
(FTRL, ProximalAdagrad, AdagradMomentum, Lion, Momentum) compute in float64. The formulas are
those of the optimizer specs' docstrings; each spec's NumPy ``reference_update`` is the oracle
they are tested against.

After editing this file run ``python -m embengine.kernels.codegen`` (the tests check it).
"""

from __future__ import annotations

import numpy as np

from . import kernel

f32 = np.float32


@kernel(inline="always")
def sgd(w, a, b, c, g, lr, h0, h1, h2, h3, h4, h5, pa, pb):
    return w - lr * g, a, b, c


@kernel(inline="always")
def adagrad(w, a, b, c, g, lr, h0, h1, h2, h3, h4, h5, pa, pb):
    gf = f32(g)
    acc = f32(a) + gf * gf
    return f32(w) - f32(lr) * gf / np.sqrt(acc), acc, b, c


@kernel(inline="always")
def adagrad_rows(w, s0, g, lr, k, dim):
    """Adagrad with one accumulator per k dims, fed the mean of g^2 over its group."""
    k = np.int64(k)
    for grp in range(dim // k):
        s = 0.0
        for j in range(grp * k, grp * k + k):
            s += g[j] * g[j]
        acc = np.float64(s0[grp]) + s / k
        s0[grp] = acc
        scale = lr / np.sqrt(acc)
        for j in range(grp * k, grp * k + k):
            w[j] = w[j] - scale * g[j]


@kernel(inline="always")
def adagrad_rowwise(acc, sum_g2, lr, k, dim):
    """Adagrad with one accumulator per row (k = dim): acc += mean(g^2); step = lr / sqrt(acc)."""
    acc = acc + sum_g2 / dim
    return acc, lr / np.sqrt(acc)


@kernel(inline="always")
def _adagrad_momentum(w, a, b, c, g, lr, h0, h1, h2, h3, h4, square):
    momentum, nesterov, exponent, beta2, eps = h0, h1 != 0.0, h2, h3, h4
    acc = a + g * g if beta2 == 1.0 else beta2 * a + (1.0 - beta2) * g * g
    s = g / np.sqrt(acc + eps) if square else (acc + eps) ** (-1.0 / exponent) * g
    m = momentum * b + s
    return w - lr * (momentum * m + s if nesterov else m), acc, m, c


@kernel(inline="always")
def adagrad_momentum(w, a, b, c, g, lr, h0, h1, h2, h3, h4, h5, pa, pb):
    return _adagrad_momentum(w, a, b, c, g, lr, h0, h1, h2, h3, h4, False)


@kernel(inline="always")
def adagrad_momentum_square(w, a, b, c, g, lr, h0, h1, h2, h3, h4, h5, pa, pb):
    """exponent = 2: a square root instead of a power (each a variant: a branch between the
    two inside the loop would be if-converted into computing both)."""
    return _adagrad_momentum(w, a, b, c, g, lr, h0, h1, h2, h3, h4, True)


@kernel(inline="always")
def proximal_adagrad(w, a, b, c, g, lr, h0, h1, h2, h3, h4, h5, pa, pb):
    l1, l2 = h0, h1
    acc = a + g * g
    rate = lr / np.sqrt(acc)
    v = w - rate * g
    return np.sign(v) * max(abs(v) - rate * l1, 0.0) / (1.0 + rate * l2), acc, b, c


@kernel(inline="always")
def adam_prologue(data_i, r, cols, step, lr, h0, h1, h2, h3, h4, h5):
    """The step size: lr, or lr * sqrt(1 - b2^t) / (1 - b1^t) with t global (h5 == 1) or this
    row's update count (h5 == 2, stored as int32 after the float slots)."""
    b1, b2, bias = h0, h1, h5
    if bias == 1.0:
        t = np.float64(step + 1)
        return lr * np.sqrt(1.0 - b2**t) / (1.0 - b1**t), 0.0
    if bias == 2.0:
        col = cols[cols.shape[0] - 1]
        data_i[r, col] += 1
        t = np.float64(data_i[r, col])
        return lr * np.sqrt(1.0 - b2**t) / (1.0 - b1**t), 0.0
    return lr, 0.0


@kernel(inline="always")
def _adam(w, a, b, c, g, pa, h0, h1, h2, h3, h4, amsgrad):
    # 1 - beta in float64 before rounding: f32(1) - f32(0.999) is off by 1e-5 relative.
    b1, b2, c1, c2 = f32(h0), f32(h1), f32(1.0 - h0), f32(1.0 - h1)
    eps, inside, nesterov = f32(h2), h3 != 0.0, h4 != 0.0
    gf = f32(g)
    m = b1 * f32(a) + c1 * gf
    v = b2 * f32(b) + c2 * gf * gf
    vhat = max(f32(c), v) if amsgrad else v
    u = b1 * m + c1 * gf if nesterov else m
    # sqrt(v + eps^2) or sqrt(v) + eps, with one square root and no branch in the loop
    e_in, e_out = (eps, f32(0.0)) if inside else (f32(0.0), eps)
    d = np.sqrt(vhat + e_in * e_in) + e_out
    return f32(w) - f32(pa) * u / d, m, v, vhat


@kernel(inline="always")
def adam(w, a, b, c, g, lr, h0, h1, h2, h3, h4, h5, pa, pb):
    """a = momenta, b = velocities; pa = the step size (lr, or from adam_prologue)."""
    return _adam(w, a, b, c, g, pa, h0, h1, h2, h3, h4, False)


@kernel(inline="always")
def amsgrad(w, a, b, c, g, lr, h0, h1, h2, h3, h4, h5, pa, pb):
    """c = vhats, the running maximum of v."""
    return _adam(w, a, b, c, g, pa, h0, h1, h2, h3, h4, True)


@kernel(inline="always")
def lion(w, a, b, c, g, lr, h0, h1, h2, h3, h4, h5, pa, pb):
    b1, b2 = h0, h1
    return w - lr * np.sign(b1 * a + (1.0 - b1) * g), b2 * a + (1.0 - b2) * g, b, c


@kernel(inline="always")
def _ftrl(w, a, b, c, g, lr, h0, h1, h2, h3, h4, square_root):
    """a = accumulators, b = linears."""
    p, l1, l2, beta, mult = h0, h1, h2, h3, h4 != 0.0
    acc = a + g * g
    if square_root:
        root = np.sqrt(acc)
        growth = root - np.sqrt(a)
    else:
        root = acc**p
        growth = root - a**p
    if mult:
        z = b + lr * g - growth * w
        q = root + 2.0 * l2 * lr + beta
        threshold = l1 * lr
    else:
        z = b + g - growth / lr * w
        q = root / lr + 2.0 * l2 + beta / lr
        threshold = l1
    new_w = (np.sign(z) * threshold - z) / q if abs(z) > threshold else 0.0
    return new_w, acc, z, c


@kernel(inline="always")
def ftrl(w, a, b, c, g, lr, h0, h1, h2, h3, h4, h5, pa, pb):
    return _ftrl(w, a, b, c, g, lr, h0, h1, h2, h3, h4, False)


@kernel(inline="always")
def ftrl_sqrt(w, a, b, c, g, lr, h0, h1, h2, h3, h4, h5, pa, pb):
    """learning_rate_power = -0.5 (the default): square roots instead of powers."""
    return _ftrl(w, a, b, c, g, lr, h0, h1, h2, h3, h4, True)


@kernel(inline="always")
def momentum(w, a, b, c, g, lr, h0, h1, h2, h3, h4, h5, pa, pb):
    mu, nesterov, velocity = h0, h1 != 0.0, h2 != 0.0
    if velocity:
        v = mu * a - lr * g
        return w + ((1.0 + mu) * v - mu * a if nesterov else v), v, b, c
    m = mu * a + g
    return w - (lr * (g + mu * m) if nesterov else lr * m), m, b, c


@kernel(inline="always")
def rmsprop(w, a, b, c, g, lr, h0, h1, h2, h3, h4, h5, pa, pb):
    """a = ms, b = mom, c = mg (centered)."""
    rho, mu, eps, centered, inside = f32(h0), f32(h1), f32(h2), h3 != 0.0, h4 != 0.0
    gf, c_rho = f32(g), f32(1.0 - h0)
    ms = rho * f32(a) + c_rho * gf * gf
    mg = rho * f32(c) + c_rho * gf if centered else f32(c)
    d = ms - mg * mg if centered else ms
    e_in, e_out = (eps, f32(0.0)) if inside else (f32(0.0), eps)
    root = np.sqrt(d + e_in) + e_out
    mom = mu * f32(b) + f32(lr) * gf / root
    return f32(w) - mom, ms, mom, mg


@kernel(inline="always")
def adadelta(w, a, b, c, g, lr, h0, h1, h2, h3, h4, h5, pa, pb):
    """a = accumulators, b = updates."""
    rho, eps, c_rho, gf = f32(h0), f32(h1), f32(1.0 - h0), f32(g)
    acc = rho * f32(a) + c_rho * gf * gf
    u = np.sqrt(f32(b) + eps) / np.sqrt(acc + eps) * gf
    return f32(w) - f32(lr) * u, acc, rho * f32(b) + c_rho * u * u, c


@kernel(inline="always")
def assign(w, a, b, c, g, lr, h0, h1, h2, h3, h4, h5, pa, pb):
    return g, a, b, c


@kernel(inline="always")
def last_hit_prologue(data_i, r, cols, step, lr, h0, h1, h2, h3, h4, h5):
    """Steps since this row was last seen (pa), and record this step (1-based) as its last."""
    s = step + 1
    delta = np.float64(s - data_i[r, cols[0]])
    data_i[r, cols[0]] = s
    return delta, 0.0


@kernel(inline="always")
def frequency_estimator(w, a, b, c, g, lr, h0, h1, h2, h3, h4, h5, pa, pb):
    tau, max_delta, threshold, delta = h0, h1, h2, pa
    clipped = min(delta, max_delta)
    return (clipped if delta >= threshold * w else (1.0 - tau) * w + tau * clipped), a, b, c


@kernel(inline="always")
def batch_softmax(w, a, b, c, g, lr, h0, h1, h2, h3, h4, h5, pa, pb):
    return (1.0 - lr) * w + lr * pa, a, b, c


# Kernel variants: name -> ("element", element function, prologue or None), ("scaled", step
# function) or ("row", row function). codegen.py writes one kernel pair per variant; variant()
# picks it for an optimizer.
VARIANTS = {
    "sgd": ("element", "sgd", None),
    "adagrad": ("element", "adagrad", None),
    "adagrad_rowwise": ("scaled", "adagrad_rowwise"),
    "adagrad_grouped": ("row", "adagrad_rows"),
    "adagrad_momentum": ("element", "adagrad_momentum", None),
    "adagrad_momentum_square": ("element", "adagrad_momentum_square", None),
    "proximal_adagrad": ("element", "proximal_adagrad", None),
    "adam": ("element", "adam", None),
    "adam_bias": ("element", "adam", "adam_prologue"),
    "amsgrad": ("element", "amsgrad", None),
    "amsgrad_bias": ("element", "amsgrad", "adam_prologue"),
    "lion": ("element", "lion", None),
    "ftrl": ("element", "ftrl", None),
    "ftrl_sqrt": ("element", "ftrl_sqrt", None),
    "momentum": ("element", "momentum", None),
    "rmsprop": ("element", "rmsprop", None),
    "adadelta": ("element", "adadelta", None),
    "assign": ("element", "assign", None),
    "frequency_estimator": ("element", "frequency_estimator", "last_hit_prologue"),
    "batch_softmax": ("element", "batch_softmax", "last_hit_prologue"),
}


def variant(optimizer_class: str, hyperparameters: tuple, dim: int) -> str:
    """The kernel variant serving an optimizer (by class name) on a table of this dim."""
    if optimizer_class == "Adagrad":
        k = int(hyperparameters[0])
        return "adagrad" if k == 1 else "adagrad_rowwise" if k == dim else "adagrad_grouped"
    if optimizer_class in ("Adam", "AMSGrad"):  # hyperparameters[5]: the bias correction mode
        name = optimizer_class.lower()
        return name + "_bias" if hyperparameters[5] else name
    if optimizer_class == "FTRL":  # hyperparameters[0]: -learning_rate_power
        return "ftrl_sqrt" if hyperparameters[0] == 0.5 else "ftrl"
    if optimizer_class == "AdagradMomentum":  # hyperparameters[2]: the exponent
        return "adagrad_momentum_square" if hyperparameters[2] == 2 else "adagrad_momentum"
    names = {"SGD": "sgd", "AdagradMomentum": "adagrad_momentum",
             "ProximalAdagrad": "proximal_adagrad", "Adam": "adam", "AMSGrad": "amsgrad",
             "Lion": "lion", "FTRL": "ftrl", "Momentum": "momentum", "RMSProp": "rmsprop",
             "Adadelta": "adadelta", "Assign": "assign",
             "FrequencyEstimator": "frequency_estimator",
             "BatchSoftmax": "batch_softmax"}  # fmt: skip
    return names[optimizer_class]


OPTIMIZER_CLASSES = ("SGD", "Adagrad", "AdagradMomentum", "ProximalAdagrad", "Adam", "AMSGrad",
                     "Lion", "FTRL", "Momentum", "RMSProp", "Adadelta", "Assign",
                     "FrequencyEstimator", "BatchSoftmax")  # fmt: skip
