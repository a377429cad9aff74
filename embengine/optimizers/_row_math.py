"""An optimizer's row math, registered for the numba backend: a plain function of named values.

The numba backend compiles each registration into its own fused update kernels (the template
of ``embengine/kernels/codegen.py``: gradient sum, clipping, weight decay, the result guard),
calling the function where the update happens. Its arguments are matched by NAME, so the
generated code reads like the formula; what each name is given:

- ``w``, ``g``, ``lr``: the weight, its gradient (float64: accumulated, clipped, with l2 decay)
  and the step's learning rate;
- each name of ``slots``: the row's float slot of that name (the spec's ``slot_specs`` order);
- each name of ``params`` / ``flags``: the spec's attribute of that name (``getattr(spec,
  name)``), a float64 / a bool, the same for every row of a step;
- each name of ``constants``: its value, a literal in the generated code, so the compiler drops
  the branches it decides (one function serves two kernels: Adam and AMSGrad);
- ``prologue_result``: what ``prologue`` returned for this row (see below);
- ``dim``, ``sum_g2``: the row's width and sum of squared gradients (row and scaled forms).

Forms (``form``):

- ``"element"``: ``f(...) -> (w, *slots)`` on the scalars of one coordinate: the new weight and
  the new value of every slot of ``slots``, in that order. Scalar functions inline into the
  kernel's loop over coordinates, which LLVM vectorises. An optional ``prologue`` runs once per
  row first, on ``data_i, r, cols, step, lr`` (the table as int32, the row, the slots' start
  columns in ``slot_specs`` order, the 0-based global step) and named params; a prologue that
  takes ``data_i`` may update the row's int32 slots (Adam's per-row step count), which the
  result guard then restores with the row. Its result is passed as ``prologue_result``.
- ``"scaled"``: ``f(slot, sum_g2, lr, dim, ...) -> (slot, step)``: row-wise preconditioning (one
  slot value per row); every coordinate then moves by ``-step * g`` (row-wise Adagrad).
- ``"row"``: ``f(w, slot, g, lr, dim, ...)`` updating the row's arrays in place, for updates
  that mix coordinates (Adagrad with one accumulator per group of k dims).

Capabilities, checked when an engine is built (``NumbaBackend.check_optimizer``): a table holds
a prefix of ``slots`` as its float slots (at most ``MAX_SLOTS``, each at most dim wide);
``fixed_layout``: the kernel also gets a variant for rows of a constant width with slots at
constant offsets (vectorised in place); ``needs_accumulation``: the kernel needs one accumulated
gradient per row (counting optimizers); ``every_row``: it can sweep every row of the table
(non-lazy updates, ``Optimizer.updates_every_row``); ``float32_gradient`` (element form): the
function reads ``g`` only as float32 (``f(g) == f(float64(float32(g)))``, as when its first step
rounds g), so the kernel rounds the summed gradient once per row and the math runs in float32
lanes, twice as many per vector as float64 ones; without clipping or weight decay only (with
them ``g`` stays the float64 value the function got before). Registration calls the function on
samples and refuses a declaration they contradict. The results are the undeclared kernel's up
to fastmath's ``contract``: LLVM may fuse other multiply-adds in the loop it now vectorises
otherwise (Adam with bias correction on rows 4 or 8 wide, fixed layout: the last bits of 2-5% of
its velocities; the same bits with ``contract`` off).

A spec points at its registration (``Optimizer.row_math(dim)``; the class attribute
``ROW_MATH`` by default), so subclasses (the TPU and Monolith ports) inherit it. This module
imports no numba: the function is plain Python (NumPy scalars), compiled where the kernel is.
"""

from __future__ import annotations

import inspect
import keyword
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

__all__ = ["MAX_SLOTS", "ROW_MATH", "RowMath", "row_math"]

# Float slots a kernel carries per row (the template's scratch rows and metadata columns).
MAX_SLOTS = 3
FORMS = ("element", "scaled", "row")
# What each form passes besides slots, params, flags and constants.
_GIVEN = {
    "element": ("w", "g", "lr"),
    "scaled": ("sum_g2", "lr", "dim"),
    "row": ("w", "g", "lr", "dim"),
}
_PROLOGUE_GIVEN = ("data_i", "r", "cols", "step", "lr")

# Every registration by name: the numba backend's kernels, one pair per name.
ROW_MATH: dict[str, RowMath] = {}


# Flags up to this many: ``_check_float32_gradient`` tries every combination of their values.
_FLAG_COMBINATIONS = 4


def _near_half_step(x: float) -> float:
    """A float64 just short of half a float32 step beyond ``float32(x)``: its rounding to
    float32 moves it about as far as rounding can."""
    f = np.float32(x)
    return float(np.float64(f) + np.sign(f) * np.float64(np.spacing(abs(f))) * (0.5 - 2.0**-12))


def _rounded(x: float) -> np.float64:
    """``x`` rounded to float32, as float64 (1e39: inf, without numpy's overflow warning)."""
    with np.errstate(over="ignore"):
        return np.float64(np.float32(x))


# The gradients ``_check_float32_gradient`` calls a function with, each with its rounding.
_GRADIENT_SAMPLES = tuple(
    (np.float64(g), _rounded(g))
    for g in (
        *(_near_half_step(x) for x in (0.1, -3e-5, 0.7, -1.3e-3, 290.3, 4.1e-7, -0.37, 5.3)),
        1.0 + 2.0**-30,
        1e39,
    )
)


def _flag_samples(flags: tuple[str, ...]) -> list[dict[str, bool]]:
    """The flag values ``_check_float32_gradient`` tries: every combination of up to
    ``_FLAG_COMBINATIONS`` flags; for more, all False, all True and each one alone True."""
    if len(flags) <= _FLAG_COMBINATIONS:
        return [
            {n: bool(bits >> i & 1) for i, n in enumerate(flags)} for bits in range(2 ** len(flags))
        ]
    return [
        {n: False for n in flags},
        {n: True for n in flags},
        *({n: n == on for n in flags} for on in flags),
    ]


def _arguments(fn: Callable) -> tuple[str, ...]:
    params = inspect.signature(fn).parameters.values()
    if any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params):
        raise TypeError(f"row math {fn.__name__}: only plain positional arguments, no *args")
    return tuple(p.name for p in params)


@dataclass(frozen=True, eq=False)
class RowMath:
    """One registered row math: the function, what its arguments are, and what its kernel can
    do (see the module docstring). Calling it calls the function (plain Python)."""

    name: str
    function: Callable
    form: Literal["element", "scaled", "row"] = "element"
    params: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()
    slots: tuple[str, ...] = ()
    constants: Mapping[str, bool | float] = field(default_factory=dict)
    prologue: Callable | None = None
    prologue_result: str | None = None
    fixed_layout: bool = True
    needs_accumulation: bool = False
    every_row: bool = True
    float32_gradient: bool = False

    def __post_init__(self):
        where = f"row math {self.name!r}"
        if not self.name.isidentifier():
            raise ValueError(f"{where}: the name must be an identifier")
        if self.form not in FORMS:
            raise ValueError(f"{where}: form must be one of {FORMS}, got {self.form!r}")
        for kind in ("params", "flags", "slots"):
            if isinstance(getattr(self, kind), str):
                raise TypeError(
                    f"{where}: {kind} must be a tuple of names, got the string "
                    f"{getattr(self, kind)!r}; write ({getattr(self, kind)!r},)"
                )
        object.__setattr__(self, "params", tuple(self.params))
        object.__setattr__(self, "flags", tuple(self.flags))
        object.__setattr__(self, "slots", tuple(self.slots))
        object.__setattr__(self, "constants", dict(self.constants))
        if len(self.slots) > MAX_SLOTS:
            raise ValueError(f"{where}: at most {MAX_SLOTS} float slots, got {self.slots}")
        if self.form != "element" and len(self.slots) != 1:
            raise ValueError(f"{where}: a {self.form} function takes one slot, got {self.slots}")
        if self.form == "row" and self.fixed_layout:
            raise ValueError(f"{where}: a row function has no fixed-layout kernel")
        if self.float32_gradient and self.form != "element":
            raise ValueError(
                f"{where}: float32_gradient is for element functions (g per coordinate); a "
                f"{self.form} function is given {_GIVEN[self.form]}"
            )
        named = [*self.params, *self.flags, *self.slots, *self.constants]
        if self.prologue_result:
            named.append(self.prologue_result)
        # Each name is a variable of the generated kernel: a keyword or a non-identifier
        # would only show as a SyntaxError when the kernel is first compiled.
        bad = sorted(
            {repr(n) for n in named if not (isinstance(n, str) and n.isidentifier())}
            | {repr(n) for n in named if isinstance(n, str) and keyword.iskeyword(n)}
        )
        if bad:
            raise ValueError(
                f"{where}: {', '.join(bad)} cannot name a value of the kernel; params, flags, "
                "slots, constants and prologue_result must be Python identifiers, not keywords"
            )
        given = _GIVEN[self.form]
        clash = sorted({n for n in named if named.count(n) > 1 or n in given})
        if clash:
            raise ValueError(f"{where}: names given twice: {clash}")
        if (self.prologue is None) != (self.prologue_result is None):
            raise ValueError(f"{where}: give both prologue and prologue_result, or neither")
        if self.prologue is not None and self.form != "element":
            raise ValueError(f"{where}: only an element function has a prologue")
        known = set(given) | set(named)
        self._check_arguments(self.function, known, where)
        for slot in self.slots:
            if slot not in self.arguments:
                raise ValueError(f"{where}: slot {slot!r} is not an argument of the function")
        if self.prologue is not None:
            self._check_arguments(
                self.prologue,
                set(_PROLOGUE_GIVEN) | set(self.params) | set(self.flags) | set(self.constants),
                f"{where} (prologue)",
            )

        self._check_result(where)
        if self.float32_gradient:
            self._check_float32_gradient(where)

    def _check_float32_gradient(self, where: str) -> None:
        """Call the function in Python with gradients that float32 cannot hold and with their
        float32 roundings, and refuse a declaration of ``float32_gradient`` that the results
        contradict: the kernel would hand it the rounded gradient and so change the optimizer's
        results. The other values: 0.5 everywhere, then 0.3 (a product with 0.5 is exact, so
        ``f32(lr * g)`` would round alike), each combination of the flags (each flag alone and
        all for more than ``_FLAG_COMBINATIONS``). The gradients lie near half a float32 step
        from their rounding (a float64 read shows in a result rounded to float32 about half the
        time each), plus ``1 + 2^-30`` (``w - lr * g`` cancels to 0 for its rounding) and 1e39
        (float32 infinity). A sample: a function that reads g in float64 only on other values
        passes. Values on which the function raises are skipped."""
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            self._compare_roundings(where)

    def _compare_roundings(self, where: str) -> None:
        """``_check_float32_gradient``'s calls (warnings and floating-point errors silenced)."""
        arguments = self.arguments
        for flags in _flag_samples(self.flags):
            for value in (0.5, 0.3):
                values = {n: np.float64(value) for n in (*_GIVEN[self.form], *self.params)}
                values.update({n: np.float64(value) for n in self.slots})
                values.update(flags)
                values.update(self.constants)
                if self.prologue is not None:
                    values[self.prologue_result] = np.float64(value)
                try:
                    bad = next(
                        (
                            g
                            for g, rounded in _GRADIENT_SAMPLES
                            if self._result(values, g, arguments)
                            != self._result(values, rounded, arguments)
                        ),
                        None,
                    )
                except Exception:
                    continue  # raises on these values: the next ones
                if bad is not None:
                    on = [n for n, v in flags.items() if v]
                    raise ValueError(
                        f"{where}: declares float32_gradient, but {self.function.__name__} "
                        f"returns other values for g = {float(bad)!r} than for its float32 "
                        f"rounding (other values {value}, flags "
                        f"{'set: ' + ', '.join(on) if on else 'all False'}); round g to float32 "
                        "first (f32(g)) or leave float32_gradient False"
                    )

    def _result(self, values: dict, g: np.float64, arguments: tuple[str, ...]) -> bytes:
        """The function's result on ``values`` with ``g`` (its ``arguments`` in order), as the
        bytes of float64 values."""
        values["g"] = g
        out = self.function(*(values[a] for a in arguments))
        return np.asarray(out, dtype=np.float64).tobytes()

    def _check_result(self, where: str) -> None:
        """Call the function once in Python on sample values (0.5; flags False; dim 4; a
        prologue's result from a call of the prologue on a row of int32 zeros at step 0) and
        refuse a result the kernel cannot unpack: an element function returns the weight alone
        without slots, else ``(w, *slots)``; a scaled one ``(slot, step)``. A wrong arity would
        otherwise be a numba TypingError in the generated code when the kernel first compiles.
        A function (or prologue) that raises on these values is not checked, nor a row
        function (it updates the row in place; what it returns is not read)."""
        if self.form == "row":
            return
        want = 2 if self.form == "scaled" else 1 + len(self.slots)
        values = {n: np.float64(0.5) for n in (*_GIVEN[self.form], *self.params, *self.slots)}
        values.update({n: False for n in self.flags})
        values.update(self.constants)
        values["dim"] = 4
        try:
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")
                if self.prologue is not None:
                    before = {
                        "data_i": np.zeros((1, 4 * MAX_SLOTS), dtype=np.int32),
                        "r": 0,
                        "cols": np.arange(0, 4 * MAX_SLOTS, 4, dtype=np.int64),
                        "step": 0,
                        **values,
                    }
                    values[self.prologue_result] = self.prologue(
                        *(before[a] for a in self.prologue_arguments)
                    )
                result = self.function(*(values[a] for a in self.arguments))
        except Exception:
            return
        got = len(result) if isinstance(result, tuple) else None
        if want == 1 and got is None or got == want and want > 1:
            return
        parts = ("w", *self.slots) if self.form == "element" else (self.slots[0], "step")
        shape = (
            "the new weight alone (it keeps no slots)"
            if want == 1
            else f"a tuple of {want}: ({', '.join(parts)})"
        )
        returned = f"a tuple of {got}" if got is not None else f"one {type(result).__name__}"
        raise ValueError(
            f"{where}: {self.function.__name__} returned {returned}; a {self.form} function "
            f"returns {shape}"
        )

    @staticmethod
    def _check_arguments(fn: Callable, known: set, where: str) -> None:
        unknown = [a for a in _arguments(fn) if a not in known]
        if unknown:
            raise ValueError(
                f"{where}: {fn.__name__} takes {unknown}, which are none of the names it is "
                f"given ({sorted(known)}); name them in params, flags, slots or constants"
            )

    @property
    def arguments(self) -> tuple[str, ...]:
        """The function's argument names, in order."""
        return _arguments(self.function)

    @property
    def prologue_arguments(self) -> tuple[str, ...]:
        return _arguments(self.prologue) if self.prologue is not None else ()

    @property
    def max_slots(self) -> int:
        return len(self.slots)

    def __call__(self, *args, **kwargs):
        return self.function(*args, **kwargs)

    def variant(self, name: str, **changes) -> RowMath:
        """A registration like this one under another name, with ``changes`` (fields)."""
        return register(replace(self, name=name, **changes))

    def values(self, optimizer) -> list[float]:
        """The spec's params then flags as float64 values, in the kernel's order."""
        return [float(getattr(optimizer, n)) for n in (*self.params, *self.flags)]


def _same_function(a: Callable, b: Callable) -> bool:
    # A module imported twice (pytest's rewriting, importlib.reload) defines equal functions anew.
    return a is b or (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)


def register(rm: RowMath) -> RowMath:
    """Add ``rm`` to ``ROW_MATH``; ValueError if another function holds its name."""
    old = ROW_MATH.get(rm.name)
    if old is not None and not _same_function(old.function, rm.function):
        raise ValueError(
            f"row math {rm.name!r} is registered already (by {old.function.__module__}."
            f"{old.function.__qualname__}); choose another name"
        )
    ROW_MATH[rm.name] = rm
    return rm


def row_math(
    name: str,
    *,
    form: Literal["element", "scaled", "row"] = "element",
    params: tuple[str, ...] = (),
    flags: tuple[str, ...] = (),
    slots: tuple[str, ...] = (),
    constants: Mapping[str, bool | float] | None = None,
    prologue: Callable | None = None,
    prologue_result: str | None = None,
    fixed_layout: bool | None = None,
    needs_accumulation: bool = False,
    every_row: bool = True,
    float32_gradient: bool = False,
) -> Callable[[Callable], RowMath]:
    """Register the decorated function as the row math ``name`` (see the module docstring);
    returns its ``RowMath``, which a spec names as ``ROW_MATH`` (or returns from ``row_math``).
    ``fixed_layout`` defaults to True except for the row form."""

    def decorate(fn: Callable) -> RowMath:
        return register(
            RowMath(
                name,
                fn,
                form,
                params,
                flags,
                slots,
                constants or {},
                prologue,
                prologue_result,
                form != "row" if fixed_layout is None else fixed_layout,
                needs_accumulation,
                every_row,
                float32_gradient,
            )
        )

    return decorate
