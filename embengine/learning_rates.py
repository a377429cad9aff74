"""Per-step learning rates: constants, callables and explicit dynamic tags, as the TPU does it.

Every distinct callable (by identity) gets a tag, in table order; explicit
``DynamicLearningRate(tag)`` values keep their own tags and callables are numbered after them.
Tags must be non-negative and cover ``[0, n)`` with ``n`` at most the number of tables (the TPU
proto's rule). Each step, each callable is evaluated once; ``learning_rates=[...]`` passed to
``apply_gradients`` supplies one scalar per tag instead (required when explicit tags exist).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .optimizers import DynamicLearningRate, Optimizer
from .optimizers._base import learning_rate_arity

__all__ = ["LearningRates", "Warmup", "check_learning_rates", "check_rate"]


@dataclass(frozen=True)
class Warmup:
    """Monolith's warm-up of a constant rate (``embengine.monolith``'s ``warmup_steps``): the
    learning rate at 0-based step s is ``learning_rate * min(s, W) / W``, ``W =
    warmup_steps``. A callable learning rate, but data: a spec and a checkpoint store it, so
    ``load`` rebuilds it where any other callable must be passed again (``callables=``)."""

    learning_rate: float
    warmup_steps: int

    def __call__(self, step: int) -> float:
        return self.learning_rate * min(step, self.warmup_steps) / self.warmup_steps


class LearningRates:
    def __init__(self, optimizers: Sequence[Optimizer], table_names: Sequence[str]):
        self._table_names = tuple(table_names)
        explicit: dict[int, list[str]] = {}
        callables: list[Callable] = []
        for opt, name in zip(optimizers, table_names, strict=True):
            lr = opt.learning_rate
            if isinstance(lr, DynamicLearningRate):
                explicit.setdefault(int(lr.tag), []).append(name)
            elif callable(lr) and not any(lr is c for c in callables):
                callables.append(lr)
        n_explicit = len(explicit)
        if explicit and sorted(explicit) != list(range(n_explicit)):
            missing = sorted(set(range(max(explicit) + 1)) - set(explicit))
            raise ValueError(
                f"dynamic learning-rate tags must cover 0..n-1 without gaps; tags in use "
                f"{sorted(explicit)}, missing {missing}"
            )
        n_tags = n_explicit + len(callables)
        if n_tags > len(table_names):
            raise ValueError(
                f"{n_tags} dynamic learning-rate tags for {len(table_names)} tables; there can "
                "be at most one per table"
            )
        self._callables = callables
        self._arity = [learning_rate_arity(c) for c in callables]
        self._n_explicit = n_explicit
        self.num_tags = n_tags
        # Per table: ("const", value) or ("tag", tag).
        self._sources: list[tuple[str, float | int]] = []
        for opt in optimizers:
            lr = opt.learning_rate
            if isinstance(lr, DynamicLearningRate):
                self._sources.append(("tag", int(lr.tag)))
            elif callable(lr):
                k = next(i for i, c in enumerate(callables) if c is lr)
                self._sources.append(("tag", n_explicit + k))
            else:
                self._sources.append(("const", float(lr)))

    def tag_of(self, table: int) -> int | None:
        kind, v = self._sources[table]
        return int(v) if kind == "tag" else None

    def tag_callable(self, tag: int) -> Callable | None:
        """The callable behind a tag, or None for an explicit DynamicLearningRate tag."""
        return None if tag < self._n_explicit else self._callables[tag - self._n_explicit]

    def resolve(self, step: int, learning_rates: Sequence[float] | None = None) -> list[float]:
        """The learning rate of every table for this step. Validates before returning."""
        if learning_rates is not None:
            tags = check_learning_rates(learning_rates, self.num_tags)
        else:
            if self._n_explicit:
                tables = [
                    self._table_names[i]
                    for i, (k, v) in enumerate(self._sources)
                    if k == "tag" and v < self._n_explicit
                ]
                raise ValueError(
                    f"tables {tables} use DynamicLearningRate; pass learning_rates=[...] with "
                    f"{self.num_tags} values to apply_gradients"
                )
            tags = []
            for fn, arity in zip(self._callables, self._arity, strict=True):
                tags.append(check_rate(fn(step) if arity else fn(), f"learning_rate {fn!r}"))
        return [v if kind == "const" else tags[int(v)] for kind, v in self._sources]


def check_learning_rates(learning_rates: Sequence[float], num_tags: int) -> list[float]:
    """``learning_rates`` given for a step (one per dynamic tag) as floats, checked: a
    sequence of ``num_tags`` finite numbers >= 0 (see ``check_rate``)."""
    if isinstance(learning_rates, str | bytes):
        raise TypeError(
            "learning_rates must be a sequence of numbers, one per tag, got the string "
            f"{learning_rates!r}"
        )
    values = list(learning_rates)
    if len(values) != num_tags:
        raise ValueError(
            f"learning_rates has {len(values)} values but the engine has {num_tags} "
            "dynamic learning-rate tags; give exactly one per tag"
        )
    return [check_rate(v, f"learning_rates[{i}]") for i, v in enumerate(values)]


def check_rate(value, what: str) -> float:
    """``value`` as a float, refused unless a finite number >= 0: a bool or a string (which
    ``float`` would read as 1.0 or parse) is a TypeError, as for per-id weights."""
    if isinstance(value, bool | np.bool_ | str | bytes):
        raise TypeError(f"{what} must be a number, got {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a number, got {value!r}") from None
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {v}")
    return v
