"""Hyperparameter checks shared by optimizer specs; each error names the parameter and value.

One vocabulary: a number is an int or float, NumPy's included (``np.float32(0.9)``), never a
bool; an integer is an int or NumPy integer, never a bool; a flag is a bool or NumPy bool.
"""

from __future__ import annotations

import math

import numpy as np


def is_number(value) -> bool:
    """An int or float, NumPy's included, not a bool."""
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)


def is_integer(value) -> bool:
    """An int or NumPy integer, not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def is_flag(value) -> bool:
    """A bool or NumPy bool."""
    return isinstance(value, bool | np.bool_)


_number = is_number


def positive(owner: str, name: str, value) -> None:
    if not (_number(value) and math.isfinite(value) and value > 0):
        raise ValueError(f"{owner}: {name} must be a finite number > 0, got {value!r}")


def non_negative(owner: str, name: str, value) -> None:
    if not (_number(value) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{owner}: {name} must be a finite number >= 0, got {value!r}")


def non_positive(owner: str, name: str, value) -> None:
    if not (_number(value) and math.isfinite(value) and value <= 0):
        raise ValueError(f"{owner}: {name} must be a finite number <= 0, got {value!r}")


def integer(owner: str, name: str, value, *, minimum: int) -> None:
    if not is_integer(value) or value < minimum:
        raise ValueError(f"{owner}: {name} must be an int >= {minimum}, got {value!r}")


def unit_interval(owner: str, name: str, value, *, include_one: bool = False) -> None:
    """value in [0, 1) (or [0, 1] with include_one)."""
    ok = _number(value) and 0.0 <= value and (value <= 1.0 if include_one else value < 1.0)
    if not ok:
        bounds = "[0, 1]" if include_one else "[0, 1)"
        raise ValueError(f"{owner}: {name} must be in {bounds}, got {value!r}")


def flag(owner: str, name: str, value) -> None:
    if not is_flag(value):
        raise TypeError(f"{owner}: {name} must be a bool, got {value!r}")


def choice(owner: str, name: str, value, options: tuple) -> None:
    if value not in options:
        raise ValueError(f"{owner}: {name} must be one of {options}, got {value!r}")
