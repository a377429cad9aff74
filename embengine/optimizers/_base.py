"""What every optimizer spec shares: common knobs, their checks, slots and the row-math contract.

An optimizer here is a frozen, validated dataclass (TF's argument names and defaults) plus:

- ``slot_specs(dim)``: the per-row state it keeps, under TF's slot names;
- ``reference_update(w, slots, g, lr, ctx)``: its per-row math in plain NumPy (float64, vectorised
  over the touched rows). This is the oracle every fast backend must match.

The common per-row pipeline is not the optimizer's business; the backend applies it around the
optimizer's row math, in this order (DESIGN.md section 3)::

    g = clip(g, clipvalue)                      # gradient clipping
    g = g + f * w                               # weight_decay_mode="l2" only
    w = w - f * (lr if multiply_by_lr else 1) * w   # weight_decay_mode="decoupled" (default)
    w, slots = optimizer(w, slots, g, lr)       # the optimizer's own row math
    w = clip(w, clip_weight_min, clip_weight_max)
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, fields
from typing import Any, Literal

import numpy as np

from ._checks import flag, is_integer, is_number

__all__ = [
    "FLOAT32_MAX",
    "DynamicLearningRate",
    "LearningRate",
    "Optimizer",
    "RowContext",
    "SlotSpec",
]


@dataclass(frozen=True)
class DynamicLearningRate:
    """A learning rate whose value the caller supplies at every step.

    ``engine.apply_gradients(grads, learning_rates=[...])`` takes one scalar per tag, like the TPU
    send-gradients op takes one per dynamic learning-rate tag. Tags must be non-negative and
    cover ``[0, n)`` without gaps, with ``n`` at most the number of tables.
    """

    tag: int

    def __post_init__(self):
        if not is_integer(self.tag):
            raise TypeError(f"DynamicLearningRate: tag must be an int, got {self.tag!r}")
        if self.tag < 0:
            raise ValueError(f"DynamicLearningRate: tag must be >= 0, got {self.tag}")


LearningRate = float | Callable[[], float] | Callable[[int], float] | DynamicLearningRate


@dataclass(frozen=True)
class SlotSpec:
    """One piece of per-row optimizer state: ``width`` columns per row, of ``dtype``."""

    name: str
    width: int
    initial_value: float = 0.0
    dtype: Literal["float32", "int32"] = "float32"


@dataclass(frozen=True)
class RowContext:
    """What a row update may know besides the row: the 0-based global step being applied."""

    step: int


# Tables and slots are float32: a hyperparameter or learning rate beyond this turns into Inf.
FLOAT32_MAX = float(np.finfo(np.float32).max)


_is_number = is_number


def learning_rate_arity(fn: Callable) -> int:
    """0 for ``fn()``, 1 for ``fn(step)``; a TypeError for anything else."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise TypeError(
            f"learning_rate callable {fn!r} has no inspectable signature; wrap it in a "
            "lambda taking no argument or the step"
        ) from None
    required = [
        p
        for p in sig.parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(required) > 1 or any(
        p.default is p.empty and p.kind == p.KEYWORD_ONLY for p in sig.parameters.values()
    ):
        raise TypeError(
            f"learning_rate callable {fn!r} must take no argument or one (the step), "
            f"its signature is {sig}"
        )
    return len(required)


def _check_bound(name: str, what: str, v, side: str) -> None:
    """A clipping bound: None, a finite number within float32 range, or the infinity of its
    open side (``-inf`` for a lower bound, ``+inf`` for an upper one), which means no bound, as
    an unset bound of the TPU proto's ClippingLimits does. The other infinity would clip every
    value to Inf."""
    if v is None:
        return
    if not _is_number(v) or math.isnan(v):
        raise ValueError(f"{name}: {what} must be a number or None, got {v!r}")
    if math.isinf(v):
        if (v > 0) == (side == "lo"):
            raise ValueError(
                f"{name}: {what} is {v!r}, which would clip every value to it; use "
                f"{'-' if side == 'lo' else '+'}inf or None for no bound"
            )
    elif abs(v) > FLOAT32_MAX:
        raise ValueError(
            f"{name}: {what} must be within float32 range (|x| <= {FLOAT32_MAX:.7g}) or "
            f"{'-' if side == 'lo' else '+'}inf / None for no bound, got {v!r}"
        )


def _clip_bounds(name: str, c) -> tuple[float, float] | None:
    """Normalise ``clipvalue`` to ``(lo, hi)``; ValueError naming the bad value. Infinite
    sides mean no bound (see _check_bound)."""
    if c is None:
        return None
    if _is_number(c):
        if not c > 0:
            raise ValueError(f"{name}: a scalar clipvalue must be > 0, got {c!r}")
        _check_bound(name, "clipvalue", c, "hi")
        return (-float(c), float(c))
    if isinstance(c, tuple | list) and len(c) == 2:
        lo, hi = c
        _check_bound(name, "clipvalue min", lo, "lo")
        _check_bound(name, "clipvalue max", hi, "hi")
        lo = -math.inf if lo is None else float(lo)
        hi = math.inf if hi is None else float(hi)
        if lo > hi:
            raise ValueError(f"{name}: clipvalue min {lo} must be <= max {hi}")
        return (lo, hi)
    raise ValueError(
        f"{name}: clipvalue must be a positive number, a (min, max) tuple or None, got {c!r}"
    )


@dataclass(frozen=True)
class Optimizer:
    """Common knobs of every optimizer (TF names and defaults).

    Args:
      learning_rate: a float, a callable of no argument (TF) or of the 0-based step, or a
        ``DynamicLearningRate(tag)`` whose value is passed to ``apply_gradients``.
      use_gradient_accumulation: True (default): every occurrence of a row in a step (all features,
        all samples) is summed first and the row gets ONE update. False: each occurrence is its own
        update, applied in order of appearance.
      clip_weight_min, clip_weight_max: weights are clipped to this range after the update
        (None, or -inf / +inf: no bound on that side, as in the TPU proto's ClippingLimits).
      weight_decay_factor: ``f``; None means no decay. Applies to touched rows only.
      multiply_weight_decay_factor_by_learning_rate: decay by ``f * lr`` instead of ``f``.
      weight_decay_mode: "decoupled" (TF: ``w -= f * w`` before the update) or "l2" (Monolith:
        ``g += f * w`` after gradient clipping).
      clipvalue: gradient clipping: a positive scalar ``c`` means ``(-c, c)``; a ``(min, max)``
        tuple whose sides may be None. Requires gradient accumulation (as in TF).
      low_dimensional_packing_status: accepted for TF compatibility. With the CPU backends it is a
        storage hint only (tables of dim 1, 2 or 4 with equal optimizers may be stored together);
        results never depend on it: a packed 16-bit table's members round in their own
        stochastic-rounding streams, as they do unpacked.
    """

    learning_rate: LearningRate = 0.01
    _: KW_ONLY
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    weight_decay_mode: Literal["decoupled", "l2"] = "decoupled"
    clipvalue: float | tuple[float | None, float | None] | None = None
    low_dimensional_packing_status: bool = False

    def __post_init__(self):
        name = type(self).__name__
        self._check_learning_rate(name)
        flag(name, "use_gradient_accumulation", self.use_gradient_accumulation)
        flag(name, "low_dimensional_packing_status", self.low_dimensional_packing_status)
        _check_bound(name, "clip_weight_min", self.clip_weight_min, "lo")
        _check_bound(name, "clip_weight_max", self.clip_weight_max, "hi")
        if (
            self.clip_weight_min is not None
            and self.clip_weight_max is not None
            and self.clip_weight_min > self.clip_weight_max
        ):
            raise ValueError(
                f"{name}: clip_weight_min={self.clip_weight_min} must be <= "
                f"clip_weight_max={self.clip_weight_max}"
            )
        f = self.weight_decay_factor
        if f is not None and (not _is_number(f) or not math.isfinite(f) or f < 0):
            raise ValueError(f"{name}: weight_decay_factor must be a finite number >= 0, got {f!r}")
        if self.multiply_weight_decay_factor_by_learning_rate and f is None:
            raise ValueError(
                f"{name}: multiply_weight_decay_factor_by_learning_rate=True needs "
                "weight_decay_factor to be set"
            )
        if self.weight_decay_mode not in ("decoupled", "l2"):
            raise ValueError(
                f"{name}: weight_decay_mode must be 'decoupled' or 'l2', "
                f"got {self.weight_decay_mode!r}"
            )
        _clip_bounds(name, self.clipvalue)
        if self.clipvalue is not None and not self.use_gradient_accumulation:
            raise ValueError(
                f"{name}: clipvalue={self.clipvalue!r} needs use_gradient_accumulation=True "
                "(gradient clipping applies to the accumulated gradient, as in TF)"
            )
        reason = self._needs_accumulation()
        if reason and not self.use_gradient_accumulation:
            raise ValueError(f"{name}: {reason} needs use_gradient_accumulation=True")
        self._check()
        self._check_float32_range(name)
        lr = self.learning_rate
        if _is_number(lr):
            try:
                self.check_learning_rate(lr)
            except ValueError as e:
                raise ValueError(f"{name}: learning_rate: {e}") from None

    # The knobs checked on their own (learning rate, clipping bounds) or not numbers.
    _RANGE_CHECKED_ELSEWHERE = ("learning_rate", "clip_weight_min", "clip_weight_max", "clipvalue")

    def _check_float32_range(self, name: str) -> None:
        """Every numeric hyperparameter finite and within float32 range: the kernels use them
        next to float32 tables, where a larger one (a decay of 1e300) becomes Inf."""
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in self._RANGE_CHECKED_ELSEWHERE or not _is_number(v):
                continue
            if not (math.isfinite(v) and abs(v) <= FLOAT32_MAX):
                raise ValueError(
                    f"{name}: {f.name} must be finite and within float32 range "
                    f"(|x| <= {FLOAT32_MAX:.7g}), got {v!r}"
                )

    def check_learning_rate(self, lr: float) -> None:
        """Raise ValueError unless ``lr`` is a learning rate this optimizer can apply: finite,
        >= 0 and within float32 range (subclasses add their own rule, e.g. FTRL's lr > 0).
        The engine calls it for every table before any table changes in a step."""
        if not (math.isfinite(lr) and 0 <= lr <= FLOAT32_MAX):
            raise ValueError(
                f"learning rate {lr!r} must be finite, >= 0 and <= {FLOAT32_MAX:.7g} "
                "(float32 range)"
            )

    def _check_learning_rate(self, name: str) -> None:
        lr = self.learning_rate
        if isinstance(lr, DynamicLearningRate):
            return
        if callable(lr):
            learning_rate_arity(lr)
            return
        if not _is_number(lr) or not math.isfinite(lr) or lr < 0:
            raise ValueError(
                f"{name}: learning_rate must be a finite number >= 0, a callable or a "
                f"DynamicLearningRate, got {lr!r}"
            )

    def _check(self) -> None:
        """Subclass hook: validate the optimizer's own hyperparameters."""

    def _needs_accumulation(self) -> str | None:
        """Subclass hook: why this configuration needs one accumulated gradient per row, if so."""
        return None

    # -- derived views of the knobs -------------------------------------------------------------

    @property
    def gradient_clip_bounds(self) -> tuple[float, float] | None:
        """``(lo, hi)`` for gradient clipping (infinite where a side is open), or None."""
        return _clip_bounds(type(self).__name__, self.clipvalue)

    @property
    def weight_clip_bounds(self) -> tuple[float, float] | None:
        if self.clip_weight_min is None and self.clip_weight_max is None:
            return None
        lo = -math.inf if self.clip_weight_min is None else float(self.clip_weight_min)
        hi = math.inf if self.clip_weight_max is None else float(self.clip_weight_max)
        return (lo, hi)

    def weight_decay_rate(self, lr: float) -> float:
        """The decay factor for this step: ``f`` or ``f * lr`` (0 without weight decay)."""
        if not self.weight_decay_factor:
            return 0.0
        f = float(self.weight_decay_factor)
        return f * lr if self.multiply_weight_decay_factor_by_learning_rate else f

    @property
    def default_initializer(self):
        """The initializer of a table that names none, if this optimizer needs a particular one."""
        return None

    @property
    def updates_every_row(self) -> bool:
        """True when every row of the table is updated each step (e.g. non-lazy Adam)."""
        return False

    # -- what subclasses provide ----------------------------------------------------------------

    def check_dim(self, dim: int) -> None:
        """Raise ValueError when this optimizer cannot serve a table of this dim."""

    def slot_specs(self, dim: int) -> tuple[SlotSpec, ...]:
        """Per-row state, in TF's slot order and names."""
        return ()

    def int_slot_range(self, name: str, step: int) -> tuple[int, int] | None:
        """``(lo, hi)``: the values int32 slot ``name`` can hold once ``step`` training steps
        have run (``load_state_dict`` refuses a state holding others); None: any int32."""
        return None

    # The registered row math the numba backend compiles for this optimizer (``row_math``
    # decorator, optimizers/_row_math.py); a class attribute, so subclasses inherit it.
    ROW_MATH = None

    def row_math(self, dim: int):
        """The ``RowMath`` serving this configuration on a table of this dim (``ROW_MATH``
        unless a spec picks among several, like Adagrad's row-wise form); None: no numba
        kernel (the reference backend runs any spec)."""
        return self.ROW_MATH

    def reference_update(
        self,
        w: np.ndarray,
        slots: dict[str, np.ndarray],
        g: np.ndarray,
        lr: float,
        ctx: RowContext,
    ) -> None:
        """Apply the optimizer's row math in place on float64 arrays of shape ``[rows, ...]``."""
        raise NotImplementedError

    def hyperparameters(self) -> dict[str, Any]:
        """All constructor arguments, for manifests and error messages."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
