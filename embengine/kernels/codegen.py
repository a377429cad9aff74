"""Generate the fused update kernels: one template, each optimizer contributes its row math.

Every registered row math (``embengine.optimizers.row_math``, see optimizers/_row_math.py) gets
a kernel pair written from the template below, with its function called directly, its
arguments matched by name (hyperparameters are locals named like the spec's fields, slots
like the spec's slots) and the per-row pipeline spelled out as plain loops. That is what makes
them fast: a kernel that branches on the optimizer per row, or calls a branching helper with
array arguments, runs several times slower (LLVM gives up on vectorising, numba keeps atomic
reference counts). A row math's module is rendered when first needed (``kernels/row_math.py``)
and its kernels compiled the first time they are called, then cached on disk, so unused
optimizers cost neither.

Per touched row the kernels: sum the row's gradient in float64 from its occurrences (a float32
sum loses too much under cancellation for optimizers that amplify small gradients); copy the
row's weights and float slots to scratch arrays (two offsets into the packed row would defeat
vectorisation); run ``g = clip(g) -> weight decay -> row math -> w = clip(w)``; copy back,
only if every new float32 value of the row (weights and float slots) is finite.

The result guard: a row whose update would store a NaN or Inf keeps its old values, weights,
float slots and the int32 slots a prologue counts (Adam's per-row step), and is marked in the
output ``unchanged`` (one byte per unique row; per table row for ``update_every_row``), which
the engine reads after the call. Finiteness is reduced branch-free, ``fin += x - x`` over the
row (0, or NaN iff some x is not finite; ``x * 0`` in the fixed kernels), so the loops stay
vectorised.

Element and row-wise variants also get a *fixed-layout* kernel factory, ``fixed_<kernel>(DIM,
NS)``: the same loop for rows of DIM weights followed by NS float slots at columns DIM, 2 DIM,
3 DIM. With those offsets compile-time constants LLVM can tell that a row's weights and slots
do not overlap, so the body works on the table row in place, vectorised, without the scratch
copies (which cost more than the row math: docs/performance.md, "Figures behind the code"). The
offsets are literal inside the kernel (computed from DIM inside a ``prange`` kernel, they
reached its loop as run-time values and the gain was lost). ``numba_backend.kernels_for``
picks a fixed kernel where the table's rows fit one. Working in place, the fixed kernels guard
the result by saving each value as they overwrite it and putting the row back if it is not
finite (FIXED_UPDATE below).

Tables with 16-bit weights or slots (``TableConfig.weights_dtype`` / ``slots_dtype``) get a
third pair per pair of stored dtypes, ``half_<kernel>_<weights>_<slots>`` (HALF_UPDATE below):
the any-layout loop on the uint16 row array, widening to float32 on copy-in and rounding
stochastically on write-back (``kernels/rounding.py``; the rule and the random stream in
``embengine.precision``). One kernel per dtype pair, not one taking the dtypes as run-time
codes: every load and store site then is one call of its dtype's helper, and each kernel
compiles only the path it runs (docs/performance.md, "Figures behind the code").

Nothing generated is committed: ``row_math.kernels`` renders a row math's module when its
kernels are first needed, into a cache folder, the file named by a hash of its text (the
template's output and the row math's source hash). numba's cache of every kernel is stamped
with the digest of the whole kernels folder (``cache_stamp``), so an edit to this template or
to a file the kernels call recompiles them. To read what the template makes:

    python -m embengine.kernels.codegen OUT.py [NAME ...]  # embengine's row math, or NAMEs
"""

from __future__ import annotations

import hashlib
import inspect
import re
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from ..precision import BF16, F16, F32

if TYPE_CHECKING:
    from ..optimizers import RowMath

HEADER = '''"""GENERATED from the template of embengine/kernels/codegen.py; do not edit (not committed).
Row math source hash: {digest}

Per registered row math of embengine.optimizers (optimizers/_row_math.py):

- ``fused_update_<name>``: updates the rows ``unique`` of one table from the activation
  gradient (``unique`` holds the batch's resolved rows, ``TableBatch.unique_rows``, not ids;
  a row of -1, an id the storage has no row for, is left out). With accumulation a row gets
  one update from the sum of its occurrences; without, one per occurrence, in order. Rows u
  with ``skipped[u]`` (skip_row policy; an empty array otherwise) are left alone. An update
  whose result would not be finite is not stored (the row keeps its old weights and slots)
  and sets ``unchanged[u] = 1``. It runs tasks of ``bounds`` (``balanced_tasks``: about
  equal work each; hot rows have thousands of occurrences), each claimed from ``claims``.
- ``update_every_row_<name>``: every live row of the table (``live``: the storage's
  ``live_rows()``, ``[start, stop)`` ranges) gets an update (non-lazy Adam / Lion); rows the
  batch did not touch get g = 0; ``unchanged[r]`` per table row. It runs tasks of
  ``task_start`` and ``where`` (``every_row_tasks``), each claimed from ``claims``.

Every kernel is serial: ``embengine.kernels.tasks.run`` runs it on several threads at once,
which take the tasks ``0 .. n_tasks - 1`` one at a time from the shared counter ``claims``.
"""

# ruff: noqa: E501
import numpy as np

from embengine.kernels import kernel
from embengine.kernels._intrinsics import fetch_add, prefetch_row, prefetch_row_for_write
from embengine.kernels.pipeline import (
    H_COMMON,
    H_GCLIP_HI,
    H_GCLIP_LO,
    H_WCLIP_HI,
    H_WCLIP_LO,
    M_ACCUMULATE,
    M_DIM,
    M_F0,
    M_GCLIP,
    M_WCLIP,
    M_WD_MODE,
    GRAD_PREFETCH,
    ROWS_PER_TASK,
    WD_DECOUPLED,
    WD_L2,
    WD_NONE,
)
{imports}
'''

# The imports of the row math a module's kernels call: registered by the modules of
# ``embengine.optimizers`` (imported first) or by a user's module, already imported.
IMPORTS = """from embengine import optimizers  # noqa: F401 (registers embengine's row math)
from embengine.kernels.pipeline import compiled
from embengine.kernels.rounding import (
    random_words,
    round_bf16,
    round_bf16_finite,
    round_f16,
    round_f16_finite,
    row_stream,
    widen_bf16,
    widen_f16,
)
from embengine.optimizers._row_math import ROW_MATH
"""

# Scalars every kernel reads once per call.
SETUP = """    dim = meta[M_DIM]
    accumulate = meta[M_ACCUMULATE] != 0
    skip = skipped.shape[0] > 0
    gclip = meta[M_GCLIP] != 0
    wclip = meta[M_WCLIP] != 0
    mode = meta[M_WD_MODE]
    glo, ghi, wlo, whi = hp[H_GCLIP_LO], hp[H_GCLIP_HI], hp[H_WCLIP_LO], hp[H_WCLIP_HI]
    f0, n0, f1, n1 = meta[M_F0], meta[M_F0 + 1], meta[M_F0 + 2], meta[M_F0 + 3]
    f2, n2 = meta[M_F0 + 4], meta[M_F0 + 5]
    width = data.shape[1]
    n_occurrences = unique_segments.shape[0]"""

SCRATCH = """g = np.zeros(dim, dtype=np.float64)
w = np.zeros(dim, dtype=np.float32)"""

# The row update, g holding its gradient; indented for the kernels' innermost block.
UPDATE = """for j in range(dim):
    w[j] = data[r, j]
{load_slots}{save_ints}{body}
fin = np.float32(0.0)
for j in range(dim):
    fin += w[j] - w[j]
{check_slots}if fin == 0.0:
    for j in range(dim):
        data[r, j] = w[j]
{store_slots}else:
{restore_ints}    unchanged[{at}] = 1"""

# UPDATE for a 16-bit table (``half_<kernel>_<weights>_<slots>``, one pair of stored dtypes
# per kernel, so every load, rounding and store below is one call of its dtype's helper):
# ``data_h`` is the uint16 row array, ``data`` its float32 view; 16-bit values take one unit
# each, a float32 one two (``data[r, c >> 1]`` for unit c). Copy-in widens; the results are
# rounded stochastically into uint16 scratch rows (``h``-prefixed) with the row's random bits
# (``rbits[c]`` for unit c, drawn from the first 16-bit unit's word on), and the guard checks
# their widened values, so a value that overflows float16 leaves the row unchanged; the store
# copies the rounded bits.
HALF_UPDATE = """{random_words}for j in range(dim):
    w[j] = {load_w}
{load_slots}{save_ints}{body}
fin = np.float32(0.0)
for j in range(dim):
{check_w}
{check_slots}if fin == 0.0:
    for j in range(dim):
        {store_w}
{store_slots}else:
{restore_ints}    unchanged[{at}] = 1"""

# HALF_UPDATE in place, for FIXED_HALF_KERNEL's element-wise row math with slots: one loop
# over the row's coordinates widens each column's value, computes, rounds and stores it
# (HalfFixedAccess), saving the value it overwrites to ``old_h`` (16-bit columns, by unit) or
# ``old_f`` (float32 ones, by float32 column) as FIXED_UPDATE does; a row with a value that
# is not finite, before its rounding or after, gets its saved values back. The same values as HALF_UPDATE, in
# one pass over the row instead of a copy-in, a compute and a round pass over scratch rows
# (docs/performance.md, "16-bit update kernels in place").
HALF_FIXED_UPDATE = """{random_words}fin = np.float32(0.0)
{save_ints}{body}
if fin != 0.0:
    for j in range(dim):
        {restore_w}
{restore_slots}{restore_ints}    unchanged[{at}] = 1"""

# A guarded in-place store to a 16-bit unit column ``{c}``: the old bits saved, ``{x}``
# checked, rounded with the column's random bits, its widened value checked. The first check
# (NaN or an infinity) puts the row back, so the rounding needs no NaN case of its own
# (``round_bf16_finite``); the second catches a finite value rounded up to infinity.
_HALF_GUARDED = (
    "old_h[{c}] = data_h[r, {c}]\n{ind}x32 = np.float32({x})\n{ind}fin += x32 - x32\n"
    "{ind}h = {round}_finite(x32, rbits[{c}])\n"
    "{ind}data_h[r, {c}] = h\n{ind}v = {widen}(h)\n{ind}fin += v - v"
)
# The same for a float32 column of a 16-bit table's row (float32 column ``{c}`` of ``data``).
_HALF_F32_GUARDED = (
    "old_f[{c}] = data[r, {c}]\n{ind}v = np.float32({x})\n{ind}data[r, {c}] = v\n"
    "{ind}fin += v * np.float32(0.0)"
)

# The fixed-layout kernels update the row in place. The body's stores (FixedAccess) save each
# value they overwrite to a per-task scratch row ``old`` and add ``x * 0`` of the stored float32
# value to ``fin``, in the loop that computes it: no extra pass over the row (separate save and
# check passes were measurably slower: docs/design.md). A row whose ``fin`` is not 0
# gets its saved values back. ROWLEN: the columns the body writes (row-wise variants: the
# weights; their slot value is saved as a scalar).
FIXED_UPDATE = """fin = np.float32(0.0)
{save_ints}{body}
if fin != 0.0:
    for j in range(ROWLEN):
        data[r, j] = old[j]
{restore_scalar}{restore_ints}    unchanged[u] = 1"""

# Prologues (Adam's per-row step, the last-hit step) write int32 slots: saved as bits, per
# slot column, and restored with the row.
SAVE_INTS = """for k in range(cols.shape[0]):
    old_i[k] = data_i[r, cols[k]]
"""
RESTORE_INTS = """    for k in range(cols.shape[0]):
        data_i[r, cols[k]] = old_i[k]
"""

# The element-wise row math with clipping and weight decay, per coordinate.
ELEMENT_GENERAL = """    for j in range(dim):
        gj = g[j]
        if gclip:
            gj = min(max(gj, glo), ghi)
        wj = np.float64({w})
        if mode == WD_L2:
            gj += wd * wj
        elif mode == WD_DECOUPLED:
            wj -= wd * wj
        {targets} = {call_decayed}
        if wclip:
            wj = min(max(wj, wlo), whi)
        {store_w}
{store_slots}"""

# Without clipping or weight decay (the usual case) a loop without their per-coordinate tests
# (what they cost Adam on W1: docs/performance.md, "Figures behind the code"). The 16-bit
# any-layout kernels keep ELEMENT_GENERAL alone: there the tests cost nothing measurable, and a
# second inlined copy of the row math a fifth of the compile time (same place). The 16-bit
# fixed-layout ones (in place, HALF_FIXED_UPDATE) take this loop too: with a float32 gradient
# it runs 8 coordinates a vector, Adam's bfloat16 update 13% less CPU time for ~0.5 s more
# compile (docs/performance.md, "16-bit fixed-layout kernels take the float32 loop").
ELEMENT_BODY = """{prologue}if gclip or wclip or mode != WD_NONE:
{general}
else:
{round_g}    for j in range(dim):
        {targets} = {call}
        {store_w}
{store_slots}"""

# A row math with ``float32_gradient`` gets the row's gradient rounded to float32 once, in
# ``gf``: its loop then reads no float64 value and runs twice as many coordinates a vector.
ROUND_GRADIENT = """    for j in range(dim):
        gf[j] = np.float32(g[j])
"""

# Clip the row's gradient and apply weight decay, in place: the first steps of the row-level
# bodies (ELEMENT_BODY does the same per coordinate, inside its loop). The loop runs only when
# there is something to do: with its stores to the row it does not vectorise (its share of
# row-wise Adagrad's W1 update: docs/performance.md, "Figures behind the code").
ROW_PRELUDE = """if gclip or mode != WD_NONE:
    for j in range(dim):
        gj = g[j]
        if gclip:
            gj = min(max(gj, glo), ghi)
        if mode == WD_L2:
            gj += wd * np.float64({w})
        elif mode == WD_DECOUPLED:
            {w} = np.float64({w}) - wd * np.float64({w})
        g[j] = gj"""

ROW_BODY = (
    ROW_PRELUDE
    + """
{call}
if wclip:
    for j in range(dim):
        w[j] = min(max(np.float64(w[j]), wlo), whi)"""
)

# Row-wise preconditioning (row-wise Adagrad): a scalar function turns the row's first slot
# value and its sum of squared gradients into the new slot value and a step size; every
# coordinate then moves by -step * g. Scalars only, so the loops vectorise and hold no array
# references (an array-taking row function slowed the W1 update: docs/performance.md,
# "Figures behind the code").
SCALED_BODY = (
    ROW_PRELUDE
    + """
sum_g2 = 0.0
for j in range(dim):
    sum_g2 += g[j] * g[j]
slot, scale = {call}
{s0_first} = slot
for j in range(dim):
    wj = np.float64({w}) - scale * g[j]
    if wclip:
        wj = min(max(wj, wlo), whi)
    {w} = wj"""
)

# SCALED_BODY in place on a fixed layout. Decoupled weight decay moves from the prelude into
# the weights' loop (it does not enter the step size), so that loop alone writes the row and
# saves what it overwrites (FIXED_UPDATE); rounded to float32 as the prelude stores it. Without
# clipping or decay a bound decides first: |w_j - scale * g_j| <= sum_k |w_k| + |scale| *
# sqrt(sum_g2), so below 1e38 every new weight is a finite float32 and the row is written
# without saving it (NaN fails the test too): row-wise Adagrad's step is a few operations per
# coordinate, so the save alone is a visible share of it.
FIXED_SCALED_BODY = """if gclip or mode == WD_L2:
    for j in range(dim):
        gj = g[j]
        if gclip:
            gj = min(max(gj, glo), ghi)
        if mode == WD_L2:
            gj += wd * np.float64(data[r, j])
        g[j] = gj
sum_g2 = 0.0
w_abs = 0.0
for j in range(dim):
    sum_g2 += g[j] * g[j]
    w_abs += abs(np.float64(data[r, j]))
slot, scale = {call}
old_s = data[r, f0]
v = np.float32(slot)
if not wclip and mode != WD_DECOUPLED and abs(slot) < 1e38 and w_abs + abs(scale) * np.sqrt(sum_g2) < 1e38:
    data[r, f0] = v
    for j in range(dim):
        data[r, j] = np.float64(data[r, j]) - scale * g[j]
else:
    data[r, f0] = v
    fin += v * np.float32(0.0)
    for j in range(dim):
        wv = data[r, j]
        if mode == WD_DECOUPLED:
            wv = np.float32(np.float64(wv) - wd * np.float64(wv))
        wj = np.float64(wv) - scale * g[j]
        if wclip:
            wj = min(max(wj, wlo), whi)
        {store_w_8}"""

GRADIENT = """for j in range(dim):
    g[j] = 0.0
for p in range(lo, hi):
    if p + GRAD_PREFETCH < n_occurrences:  # activation-gradient rows come from L2 / L3
        prefetch_row(grad, unique_segments[p + GRAD_PREFETCH], dim)
    gk = np.float64(unique_gains[p])
    seg = unique_segments[p]
    for j in range(dim):  # indexed, not a row view: a view costs atomic reference counts
        g[j] += gk * grad[seg, j]"""

# The fused update's loop over touched rows (tasks of about equal work), with ``update`` run
# on row ``r`` once its gradient is in ``g``; shared by the any-layout and fixed-layout kernels.
ROW_LOOP = """while True:
    task = fetch_add(claims, 0, 1)  # the next task no thread has taken (kernels/tasks.py)
    if task >= n_tasks:
        break
{scratch}
    stop = bounds[task + 1]
    for u in range(bounds[task], stop):
        if u + prefetch < stop:
            prefetch_row_for_write(data, unique[u + prefetch], width)
        r = unique[u]
        if r < 0:  # the storage has no row for this id: no update
            continue
        first, last = unique_offsets[u], unique_offsets[u + 1]
        if skip and skipped[u]:
            continue
        n_units = 1 if accumulate else last - first
        for unit in range(n_units):
            lo = first if accumulate else first + unit
            hi = last if accumulate else lo + 1
{gradient_12}
{update_12}"""

KERNELS = """

@kernel()
def fused_update_{name}(claims, n_tasks, bounds, data, data_i, meta, hp, cols, lr, wd, step, unique, unique_offsets, unique_gains, unique_segments, grad, skipped, unchanged, prefetch):
{setup}
{row_loop}


@kernel()
def update_every_row_{name}(claims, n_tasks, task_start, where, data, data_i, meta, hp, cols, lr, wd, step, unique, unique_offsets, unique_gains, unique_segments, grad, skipped, unchanged, prefetch, live):
{setup}
    n_ranges = live.shape[0]
    while True:
        task = fetch_add(claims, 0, 1)
        if task >= n_tasks:
            break
{scratch}
        a, b = 0, n_ranges  # the range holding this task: task_start[a] <= task < task_start[a + 1]
        while b - a > 1:
            mid = (a + b) // 2
            if task_start[mid] <= task:
                a = mid
            else:
                b = mid
        row_lo = live[a, 0] + (task - task_start[a]) * ROWS_PER_TASK
        for r in range(row_lo, min(live[a, 1], row_lo + ROWS_PER_TASK)):
            u = where[r]
            if skip and u >= 0 and skipped[u]:
                continue
            lo, hi = (unique_offsets[u], unique_offsets[u + 1]) if u >= 0 else (0, 0)
{every_gradient_12}
{every_update_12}
"""

# Where KERNELS' every-row kernel starts: a row math without one keeps the text before it.
EVERY_ROW_START = "\n\n@kernel()\ndef update_every_row"

FIXED_KERNEL = """

def fixed_fused_update_{name}(DIM, NS):
    \"\"\"``fused_update_{name}`` for rows of DIM weights followed by NS float slots (slot i from
    column (i + 1) * DIM; row-wise variants: slot 0 at DIM, any width).\"\"\"
    F1, F2 = 2 * DIM, 3 * DIM  # computed here: numba inlines free variables as constants
    ROWLEN = {rowlen}  # the values saved before the in-place update

    @kernel()
    def fused_update_{name}_fixed(claims, n_tasks, bounds, data, data_i, meta, hp, cols, lr, wd, step, unique, unique_offsets, unique_gains, unique_segments, grad, skipped, unchanged, prefetch):
{setup}
{row_loop}

    return fused_update_{name}_fixed
"""

# A 16-bit table's fused update for one row layout (HALF_KERNELS' kernel with the row width
# and the float slots' columns as the factory's constants): LLVM then unrolls and vectorises
# the per-row loops of the widening, the row math and the rounding, which a run-time width
# leaves as loops with alias checks (docs/performance.md, "16-bit update kernels").
FIXED_HALF_KERNEL = """

def fixed_fused_update_{name}(LAYOUT):
    \"\"\"``fused_update_{name}`` for one row layout, ``LAYOUT = (dim, f0, n0, f1, n1, f2, n2)``
    (the start column and width of each float slot, 0 for none; the kernel's ``meta`` holds the
    same values): compile-time constants.\"\"\"
    DIM, F0, N0, F1, N1, F2, N2 = LAYOUT  # free variables: numba inlines them as constants

    @kernel()
    def fused_update_{name}_fixed(claims, n_tasks, bounds, data, data_h, data_i, meta, hp, cols, lr, wd, step, unique, unique_offsets, unique_gains, unique_segments, grad, skipped, unchanged, prefetch, key, row_keys):
{setup}
{row_loop}

    return fused_update_{name}_fixed
"""

FOOTER = """

# Row math name -> (fused_update, update_every_row or None).
KERNELS = {{
{entries}
}}

# Row math name -> factory of its fused update for a fixed row layout: (DIM, NS) -> kernel.
FIXED_KERNELS = {{
{fixed_entries}
}}

# Row math name -> {{(weights kind, slots kind): (fused_update, update_every_row or None)}} of
# 16-bit tables (HALF_UPDATE; kinds as precision.KIND; slots kind F32 for a row math without
# float slots).
HALF_KERNELS = {{
{half_entries}
}}

# Row math name -> {{(weights kind, slots kind): factory of the fused update of 16-bit tables
# for one row layout}} (FIXED_HALF_KERNEL).
FIXED_HALF_KERNELS = {{
{fixed_half_entries}
}}
"""

# A 16-bit table's row: its random words (four unit columns each).
_HALF_SETUP = """    n_words = (data_h.shape[1] + 3) >> 2"""

# Per stored dtype: the short name in kernel names, the widening and the rounding function.
HALF_KINDS = {
    "f32": (F32, None, None),
    "f16": (F16, "widen_f16", "round_f16"),
    "bf16": (BF16, "widen_bf16", "round_bf16"),
}

# A store to the table row saves the value it overwrites to ``old`` (same column) and adds
# ``x * 0`` of the stored float32 value to ``fin`` (0, or NaN iff x is not finite).
_GUARDED = (
    "old[{c}] = data[r, {c}]\n{ind}v = np.float32({x})\n{ind}data[r, {c}] = v\n"
    "{ind}fin += v * np.float32(0.0)"
)


class GenericAccess:
    """The any-layout kernels reach a row's weights and float slots through scratch copies."""

    w = "w[j]"
    store_w = "w[j] = wj"
    s0_first = "s0[0]"

    @staticmethod
    def load(k: int) -> str:
        return f"np.float64(s{k}[j])"

    @staticmethod
    def store(k: int, name: str) -> str:
        return f"        s{k}[j] = {name}"


class FixedAccess:
    """The fixed-layout kernels work in the table row itself, at offsets that are compile-time
    constants (slot k at column f{k}; a slot the table does not hold reads as 0)."""

    w = "data[r, j]"
    store_w = _GUARDED.format(c="j", x="wj", ind=" " * 8)
    s0_first = "data[r, f0]"

    @staticmethod
    def load(k: int) -> str:
        return f"np.float64(data[r, f{k} + j]) if NS > {k} else 0.0"

    @staticmethod
    def store(k: int, name: str) -> str:
        guarded = _GUARDED.format(c=f"f{k} + j", x=name, ind=" " * 12)
        return f"        if NS > {k}:\n            {guarded}"


class HalfFixedAccess:
    """FIXED_HALF_KERNEL's element-wise row math works in the 16-bit table row itself: each
    column's value widened where it is read, rounded and stored in place (HALF_FIXED_UPDATE);
    slot k from unit column f{k} (its width n{k} is 0 or the row's, constants of the layout).
    A float32 column of the row (a dtype pair with one float32 member) is read and written
    through the float32 view ``data`` at float32 column ``(unit >> 1) + j``."""

    def __init__(self, wkind: str, skind: str):
        self.skind = skind
        self.w = self._value(wkind, "0")
        self.store_w = self._store(wkind, "0", "wj", 8)

    @staticmethod
    def _column(kind: str, first: str) -> str:
        """The index of coordinate j of the column from unit ``first``, in ``data_h`` units
        (16-bit) or ``data`` floats (float32)."""
        if kind == "f32":
            return "j" if first == "0" else f"({first} >> 1) + j"
        return "j" if first == "0" else f"{first} + j"

    def _value(self, kind: str, first: str) -> str:
        at = self._column(kind, first)
        if kind == "f32":
            return f"data[r, {at}]"
        return f"{HALF_KINDS[kind][1]}(data_h[r, {at}])"

    def _store(self, kind: str, first: str, x: str, indent: int) -> str:
        at = self._column(kind, first)
        if kind == "f32":
            return _HALF_F32_GUARDED.format(c=at, x=x, ind=" " * indent)
        _, widen, round_ = HALF_KINDS[kind]
        return _HALF_GUARDED.format(c=at, x=x, ind=" " * indent, round=round_, widen=widen)

    def restore(self, kind: str, first: str) -> str:
        """The statement putting coordinate j's saved value back."""
        at = self._column(kind, first)
        if kind == "f32":
            return f"data[r, {at}] = old_f[{at}]"
        return f"data_h[r, {at}] = old_h[{at}]"

    def load(self, k: int) -> str:
        return f"np.float64({self._value(self.skind, f'f{k}')}) if n{k} > 0 else 0.0"

    def store(self, k: int, name: str) -> str:
        guarded = self._store(self.skind, f"f{k}", name, 12)
        return f"        if n{k} > 0:\n            {guarded}"


def _indent(text: str, spaces: int) -> str:
    return "\n".join((" " * spaces + line) if line else line for line in text.splitlines())


def reserved_names() -> frozenset[str]:
    """Every name the kernel template uses: a row math's params, flags, slots and prologue
    result become locals of the kernel, so none may be one of these."""
    texts = (
        HEADER,
        IMPORTS,
        SETUP,
        SCRATCH,
        UPDATE,
        FIXED_UPDATE,
        SAVE_INTS,
        RESTORE_INTS,
        ELEMENT_GENERAL,
        ELEMENT_BODY,
        ROUND_GRADIENT,
        ROW_PRELUDE,
        SCALED_BODY,
        FIXED_SCALED_BODY,
        GRADIENT,
        ROW_LOOP,
        KERNELS,
        FIXED_KERNEL,
        FIXED_HALF_KERNEL,
        _GUARDED,
        HALF_UPDATE,
        HALF_FIXED_UPDATE,
        _HALF_GUARDED,
        _HALF_F32_GUARDED,
        _HALF_SETUP,
        "rbits words v x32 random_words widen_bf16 widen_f16 round_bf16 round_f16 "
        "round_bf16_finite round_f16_finite data_h key",
    )
    names = set()
    for text in texts:
        code = re.sub(r'(\\?"){3}.*?(\\?"){3}', "", text, flags=re.S)  # docstrings
        code = re.sub(r"#.*|\{[a-z_0-9]*\}", "", code)  # comments, format fields
        names.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", code))
    scratch = {"hw", "hs0", "hs1", "hs2"}  # the 16-bit kernels' rounded copies (_half_column)
    return frozenset(names | scratch | {"f0", "f1", "f2", "n0", "n1", "n2", "s0", "s1", "s2"})


def check_names(rm: RowMath) -> None:
    """ValueError if a name of ``rm`` would shadow one of the kernel template's."""
    reserved = reserved_names()
    functions = [rm.function.__name__] + ([rm.prologue.__name__] if rm.prologue else [])
    locals_ = [*rm.params, *rm.flags, *rm.slots, *([rm.prologue_result] if rm.prologue else [])]
    bad = sorted({n for n in locals_ + functions if n in reserved} | set(functions) & set(locals_))
    if bad:
        raise ValueError(
            f"row math {rm.name!r}: {bad} are names the update kernels use themselves; rename "
            "them (a param or slot name is the spec's field or slot name, a function its def)"
        )


def _call(rm: RowMath, given: dict[str, str]) -> str:
    """The call of ``rm``'s function, each argument the expression of its name: ``given`` for
    the template's values, the slots' loads, and the params, flags and constants by name."""
    names = dict(given)
    names.update({n: n for n in (*rm.params, *rm.flags)})
    names.update({n: repr(v) for n, v in rm.constants.items()})
    if rm.prologue is not None:
        names[rm.prologue_result] = rm.prologue_result
    return f"{rm.function.__name__}({', '.join(names[a] for a in rm.arguments)})"


def _prologue(rm: RowMath) -> str:
    if rm.prologue is None:
        return ""
    names = {n: n for n in ("data_i", "r", "cols", "step", "lr", *rm.params, *rm.flags)}
    names.update({n: repr(v) for n, v in rm.constants.items()})
    args = ", ".join(names[a] for a in rm.prologue_arguments)
    return f"{rm.prologue_result} = {rm.prologue.__name__}({args})\n"


def _writes_ints(rm: RowMath) -> bool:
    """A prologue that takes the int32 view may count in the row's int32 slots."""
    return "data_i" in rm.prologue_arguments


def _body(rm: RowMath, access, one_path: bool = False) -> str:
    """The row math's part of the update; ``one_path``: an element-wise one as ELEMENT_GENERAL
    alone (the 16-bit kernels)."""
    if rm.form == "scaled":
        first = "data[r, f0]" if access is FixedAccess else access.s0_first
        call = _call(
            rm, {rm.slots[0]: f"np.float64({first})", "sum_g2": "sum_g2", "lr": "lr", "dim": "dim"}
        )
        if access is FixedAccess:
            return FIXED_SCALED_BODY.format(call=call, store_w_8=access.store_w)
        return SCALED_BODY.format(call=call, w=access.w, s0_first=access.s0_first)
    if rm.form == "row":
        call = _call(rm, {"w": "w", rm.slots[0]: "s0", "g": "g", "lr": "lr", "dim": "dim"})
        return ROW_BODY.format(call=call, w=access.w)
    loads = {name: access.load(k) for k, name in enumerate(rm.slots)}
    targets = ", ".join(("wj", *rm.slots))
    store_slots = "\n".join(access.store(k, name) for k, name in enumerate(rm.slots))
    general = ELEMENT_GENERAL.format(
        w=access.w,
        store_w=access.store_w,
        targets=targets,
        call_decayed=_call(rm, {"w": "wj", "g": "gj", "lr": "lr", **loads}),
        store_slots=store_slots,
    )
    if one_path:
        return _prologue(rm) + textwrap.dedent(general)
    return ELEMENT_BODY.format(
        prologue=_prologue(rm),
        general=general,
        w=access.w,
        store_w=access.store_w,
        targets=targets,
        call=_call(
            rm,
            {
                "w": f"np.float64({access.w})",
                "g": "gf[j]" if rm.float32_gradient else "g[j]",
                "lr": "lr",
                **loads,
            },
        ),
        store_slots=store_slots,
        round_g=ROUND_GRADIENT if rm.float32_gradient else "",
    )


def _params(rm: RowMath) -> str:
    """The row math's hyperparameters as locals named like the spec's fields: params, then
    flags (hp after the common values, in that order)."""
    lines = [f"    {n} = hp[H_COMMON + {i}]" for i, n in enumerate(rm.params)]
    lines += [
        f"    {n} = hp[H_COMMON + {i}] != 0.0" for i, n in enumerate(rm.flags, start=len(rm.params))
    ]
    return "\n".join(lines)


def _setup(rm: RowMath) -> str:
    return "\n".join(filter(None, (SETUP, _params(rm))))


def _fixed_setup(rm: RowMath) -> str:
    """SETUP for a fixed layout: the row width and slot offsets are the factory's constants."""
    lines = SETUP.replace("dim = meta[M_DIM]", "dim = DIM").splitlines()
    lines = [ln for ln in lines if not ln.lstrip().startswith(("f0, n0", "f2, n2"))]
    lines.append("    f0, f1, f2 = DIM, F1, F2")
    return _indent("\n".join(filter(None, ("\n".join(lines), _params(rm)))), 4)


def _slot_loops(rm: RowMath, line: str) -> str:
    """``line`` (with {k}) in a loop over each float slot's columns, for the scratch copies."""
    return "".join(f"for j in range(n{k}):\n    {line.format(k=k)}\n" for k in range(len(rm.slots)))


def _generic_update(rm: RowMath, at: str) -> str:
    """UPDATE for the any-layout kernels; ``at``: the index of ``unchanged`` (u or r)."""
    ints = _writes_ints(rm)
    return UPDATE.format(
        body=_body(rm, GenericAccess),
        at=at,
        load_slots=_slot_loops(rm, "s{k}[j] = data[r, f{k} + j]"),
        check_slots=_slot_loops(rm, "fin += s{k}[j] - s{k}[j]"),
        store_slots=_indent(_slot_loops(rm, "data[r, f{k} + j] = s{k}[j]"), 4)
        + ("\n" if rm.slots else ""),
        save_ints=SAVE_INTS if ints else "",
        restore_ints=RESTORE_INTS if ints else "",
    )


def _half_column(kind: str, name: str, first: str, width: str) -> tuple[str, str, str, str]:
    """(copy-in, check, store, scratch) lines of one column of a 16-bit table's row, of stored
    dtype ``kind``, into float32 scratch ``name`` from unit ``first`` (``name[j]`` for j in
    ``range(width)``): float32 through the float32 view, 16-bit widened and rounded into the
    uint16 scratch ``h<name>``."""
    if kind == "f32":
        at = f"data[r, ({first} >> 1) + j]" if first != "0" else "data[r, j]"
        return at, f"fin += {name}[j] - {name}[j]", f"{at} = {name}[j]", ""
    _, widen, round_ = HALF_KINDS[kind]
    at = f"data_h[r, {first} + j]" if first != "0" else "data_h[r, j]"
    unit = f"{first} + j" if first != "0" else "j"
    check = (
        f"h{name}[j] = {round_}({name}[j], rbits[{unit}])\nv = {widen}(h{name}[j])\nfin += v - v"
    )
    scratch = f"\nh{name} = np.zeros({width}, dtype=np.uint16)"
    return f"{widen}({at})", check, f"{at} = h{name}[j]", scratch


def _half_update(rm: RowMath, wkind: str, skind: str, at: str, unit: str) -> str:
    """HALF_UPDATE of ``rm`` for weights of stored dtype ``wkind`` and float slots of
    ``skind`` (HALF_KINDS' names); ``at``: the index of ``unchanged``, ``unit``: the update's
    index among its row's updates this step (the rounding stream's counter)."""
    ints = _writes_ints(rm)
    load_w, check_w, store_w, _ = _half_column(wkind, "w", "0", "dim")
    slots = [_half_column(skind, f"s{k}", f"f{k}", "dim") for k in range(len(rm.slots))]

    words = _random_bits(rm, wkind, skind, unit)[1]

    def loops(part: int, indent: int = 0) -> str:
        lines = "".join(
            f"for j in range(n{k}):\n{_indent(col[part], 4)}\n" for k, col in enumerate(slots)
        )
        return (_indent(lines, indent) + "\n") if lines and indent else lines

    load_slots = "".join(
        f"for j in range(n{k}):\n    s{k}[j] = {col[0]}\n" for k, col in enumerate(slots)
    )
    return HALF_UPDATE.format(
        random_words=words,
        load_w=load_w,
        body=_body(rm, GenericAccess, one_path=True),
        at=at,
        load_slots=load_slots,
        check_w=_indent(check_w, 4),
        check_slots=loops(1),
        store_w=store_w,
        store_slots=loops(2, 4),
        save_ints=SAVE_INTS if ints else "",
        restore_ints=RESTORE_INTS if ints else "",
    )


def in_place(wkind: str, skind: str, slots: bool = True) -> bool:
    """Whether the row layout kernel of this stored dtype pair (HALF_KINDS' names) updates a
    row in place (HALF_FIXED_UPDATE) or in passes over scratch rows (HALF_UPDATE): in place
    for bfloat16 rows and rows with a float32 member, which it made 12-40% faster; float16
    with another 16-bit member measured 0-10% slower in place (docs/performance.md, "16-bit
    update kernels in place"). A row math without float slots (``slots=False``: SGD) runs in
    place but for float16 weights, which measured 23% slower so (docs/performance.md,
    "SGD's 16-bit update in place")."""
    if not slots:
        return wkind != "f16"
    return (wkind, skind) == ("bf16", "bf16") or "f32" in (wkind, skind)


def _half_fixed_update(rm: RowMath, wkind: str, skind: str) -> str:
    """HALF_FIXED_UPDATE of an element-wise ``rm`` with slots for the stored dtype pair
    (``_half_update``'s arguments; the fused update's ``u`` and ``unit``)."""
    ints = _writes_ints(rm)
    access = HalfFixedAccess(wkind, skind)
    words = _random_bits(rm, wkind, skind, "unit")[1]
    restore_slots = "".join(
        f"    if n{k} > 0:\n        for j in range(n{k}):\n"
        f"            {access.restore(skind, f'f{k}')}\n"
        for k in range(len(rm.slots))
    )
    return HALF_FIXED_UPDATE.format(
        random_words=words,
        save_ints=SAVE_INTS if ints else "",
        body=_body(rm, access),
        restore_w=access.restore(wkind, "0"),
        restore_slots=restore_slots,
        restore_ints=RESTORE_INTS if ints else "",
        at="u",
    )


def _random_bits(rm: RowMath, wkind: str, skind: str, unit: str) -> tuple[str, str]:
    """(the per-task scratch line of a row's random words, the statement drawing them for
    update ``unit`` of row ``r``) of this dtype pair's kernels; both "" if it rounds nothing."""
    rounds = _rounded_from(rm, wkind, skind)
    if not rounds:
        return "", ""
    return (
        "\nwords = np.zeros(n_words, dtype=np.uint64)\nrbits = words.view(np.uint16)",
        f"random_words(row_stream(key, step, row_keys, r, {unit}), words, {rounds})\n",
    )


def _rounded_from(rm: RowMath, wkind: str, skind: str) -> str:
    """The first word of random bits a row of this dtype pair uses (its first 16-bit unit's),
    as an expression of the kernel; "" if it rounds nothing (float32 weights, no float slot)."""
    if wkind != "f32":
        return "0"
    return "f0 >> 2" if rm.slots and skind != "f32" else ""


def half_pairs(rm: RowMath) -> list[tuple[str, str]]:
    """The (weights, slots) stored-dtype pairs ``rm`` gets 16-bit kernels for (HALF_KINDS'
    names): any pair with a 16-bit member. A row math without float slots gets (w, "f32") for
    every w: its table is 16-bit for its slots dtype alone (a uint16 row of float32 weights)."""
    kinds = list(HALF_KINDS)
    if not rm.slots:
        return [(w, "f32") for w in kinds]
    return [(w, s) for w in kinds for s in kinds if "f32" != w or "f32" != s]


def _fixed_half_setup(rm: RowMath) -> str:
    """The half kernels' setup with the row layout taken from FIXED_HALF_KERNEL's constants."""
    text = _setup(rm) + "\n" + _HALF_SETUP
    for old, new in (
        ("dim = meta[M_DIM]", "dim = DIM"),
        (
            "f0, n0, f1, n1 = meta[M_F0], meta[M_F0 + 1], meta[M_F0 + 2], meta[M_F0 + 3]",
            "f0, n0, f1, n1 = F0, N0, F1, N1",
        ),
        ("f2, n2 = meta[M_F0 + 4], meta[M_F0 + 5]", "f2, n2 = F2, N2"),
    ):
        if old not in text:
            raise AssertionError(f"the setup has no {old!r}: FIXED_HALF_KERNEL needs it")
        text = text.replace(old, new)
    return _indent(text, 4)


def _half_kernels(rm: RowMath, scratch: str, wkind: str, skind: str) -> str:
    """KERNELS for 16-bit tables of one stored dtype pair: named ``half_<name>_<w>_<s>``,
    taking the uint16 rows ``data_h`` beside their float32 view ``data`` and the table's
    rounding key, with HALF_UPDATE; then FIXED_HALF_KERNEL's factory of the fused one."""
    columns = [_half_column(wkind, "w", "0", "dim")]
    columns += [_half_column(skind, f"s{k}", f"f{k}", "dim") for k in range(len(rm.slots))]
    scratch += "".join(c[3] for c in columns) + _random_bits(rm, wkind, skind, "unit")[0]
    row_loop = ROW_LOOP.format(
        scratch=_indent(scratch, 4),
        gradient_12=_indent(GRADIENT, 12),
        update_12=_indent(_half_update(rm, wkind, skind, "u", "unit"), 12),
    )
    text = KERNELS.format(
        name=f"half_{rm.name}_{wkind}_{skind}",
        setup=_setup(rm) + "\n" + _HALF_SETUP,
        scratch=_indent(scratch, 8),
        row_loop=_indent(row_loop, 4),
        every_gradient_12=_indent(GRADIENT, 12),
        every_update_12=_indent(_half_update(rm, wkind, skind, "r", "0"), 12),
    )
    if not rm.every_row:
        text = text[: text.index(EVERY_ROW_START)] + "\n"
    text = text.replace(" data, data_i, ", " data, data_h, data_i, ")
    text = text.replace("prefetch):", "prefetch, key, row_keys):")
    text = text.replace("prefetch, live):", "prefetch, live, key, row_keys):")
    if rm.form == "element" and in_place(wkind, skind, bool(rm.slots)):
        scratch = _scratch(rm, "g = np.zeros(dim, dtype=np.float64)")
        scratch += "\nold_h = np.zeros(data_h.shape[1], dtype=np.uint16)"
        scratch += "\nold_f = np.zeros(data.shape[1], dtype=np.float32)"
        scratch += _random_bits(rm, wkind, skind, "unit")[0]
        row_loop = ROW_LOOP.format(
            scratch=_indent(scratch, 4),
            gradient_12=_indent(GRADIENT, 12),
            update_12=_indent(_half_fixed_update(rm, wkind, skind), 12),
        )
    return text + FIXED_HALF_KERNEL.format(
        name=f"half_{rm.name}_{wkind}_{skind}",
        setup=_fixed_half_setup(rm),
        row_loop=_indent(row_loop, 8),
    )


def _fixed_update(rm: RowMath) -> str:
    ints = _writes_ints(rm)
    return FIXED_UPDATE.format(
        body=_body(rm, FixedAccess),
        save_ints=SAVE_INTS if ints else "",
        restore_ints=RESTORE_INTS if ints else "",
        restore_scalar="    data[r, f0] = old_s\n" if rm.form == "scaled" else "",
    )


def _scratch(rm: RowMath, base: str) -> str:
    """Per-task scratch: ``base``, the float32 gradient of ``float32_gradient`` and the int-slot
    save of a prologue that counts."""
    if rm.float32_gradient and rm.form == "element":
        base += "\ngf = np.zeros(dim, dtype=np.float32)"
    if _writes_ints(rm):
        base += "\nold_i = np.zeros(cols.shape[0], dtype=np.int32)"
    return base


def _functions(rms: list[RowMath]) -> dict[str, str]:
    """Module global -> the import of the compiled function the kernels call by that name."""
    out: dict[str, tuple] = {}
    for rm in rms:
        for attr in ("function", "prologue"):
            fn = getattr(rm, attr)
            if fn is None:
                continue
            name = fn.__name__
            if name in out and out[name][0] is not fn:
                raise ValueError(f"two row math functions are named {name!r}; rename one")
            out.setdefault(name, (fn, f'{name} = compiled(ROW_MATH["{rm.name}"].{attr})'))
    return {name: line for name, (_, line) in sorted(out.items())}


def render(rms: list[RowMath] | None = None) -> str:
    """The kernels module of ``rms`` (default: embengine's own row math)."""
    rms = builtin_row_math() if rms is None else rms
    for rm in rms:
        check_names(rm)
    imports = IMPORTS + "\n" + "\n".join(_functions(rms).values())
    parts = [HEADER.format(digest=row_math_digest(rms), imports=imports)]
    entries, fixed_entries, half_entries, fixed_half_entries = [], [], [], []
    for rm in rms:
        name = rm.name
        scratch = _scratch(
            rm,
            SCRATCH
            + "".join(f"\ns{k} = np.zeros(dim, dtype=np.float32)" for k in range(len(rm.slots))),
        )
        row_loop = ROW_LOOP.format(
            scratch=_indent(scratch, 4),
            gradient_12=_indent(GRADIENT, 12),
            update_12=_indent(_generic_update(rm, "u"), 12),
        )
        kernels = KERNELS.format(
            name=name,
            setup=_setup(rm),
            scratch=_indent(scratch, 8),
            row_loop=_indent(row_loop, 4),
            every_gradient_12=_indent(GRADIENT, 12),
            every_update_12=_indent(_generic_update(rm, "r"), 12),
        )
        if not rm.every_row:  # the fused update only
            kernels = kernels[: kernels.index(EVERY_ROW_START)]
            kernels += "\n"
        parts.append(kernels)
        every = f"update_every_row_{name}" if rm.every_row else "None"
        entries.append(f'    "{name}": (fused_update_{name}, {every}),')
        pairs, fixed_pairs = [], []
        for wkind, skind in half_pairs(rm):
            parts.append(_half_kernels(rm, scratch, wkind, skind))
            half = f"half_{name}_{wkind}_{skind}"
            every = f"update_every_row_{half}" if rm.every_row else "None"
            key = f"({HALF_KINDS[wkind][0]}, {HALF_KINDS[skind][0]})"
            pairs.append(f"        {key}: (fused_update_{half}, {every}),")
            fixed_pairs.append(f"        {key}: fixed_fused_update_{half},")
        half_entries.append(f'    "{name}": {{\n' + "\n".join(pairs) + "\n    },")
        fixed_half_entries.append(f'    "{name}": {{\n' + "\n".join(fixed_pairs) + "\n    },")
        if rm.fixed_layout:
            # No scratch rows: the body works on the table row (FixedAccess).
            scratch = _scratch(rm, "g = np.zeros(dim, dtype=np.float64)")
            scratch += "\nold = np.zeros(ROWLEN, dtype=np.float32)"
            row_loop = ROW_LOOP.format(
                scratch=_indent(scratch, 4),
                gradient_12=_indent(GRADIENT, 12),
                update_12=_indent(_fixed_update(rm), 12),
            )
            rowlen = "DIM * (1 + NS)" if rm.form == "element" else "DIM"
            parts.append(
                FIXED_KERNEL.format(
                    name=name, setup=_fixed_setup(rm), rowlen=rowlen, row_loop=_indent(row_loop, 8)
                )
            )
            fixed_entries.append(f'    "{name}": fixed_fused_update_{name},')
    parts.append(
        FOOTER.format(
            entries="\n".join(entries),
            fixed_entries="\n".join(fixed_entries),
            half_entries="\n".join(half_entries),
            fixed_half_entries="\n".join(fixed_half_entries),
        )
    )
    return "".join(parts)


def builtin_row_math() -> list[RowMath]:
    """The row math embengine's optimizers register (others' get kernels when first used)."""
    from .. import optimizers
    from ..optimizers._row_math import ROW_MATH

    package = optimizers.__name__ + "."
    return [rm for rm in ROW_MATH.values() if rm.function.__module__.startswith(package)]


def row_math_digest(rms: list[RowMath]) -> str:
    """A hash of the row math's source (function and prologue): the rendered module holds it,
    so an edit to the function changes the module's text, its file name and numba's stamp."""
    h = hashlib.sha256()
    for rm in rms:
        for fn in (rm.function, rm.prologue):
            if fn is not None:
                h.update(inspect.getsource(fn).encode())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    """``python -m embengine.kernels.codegen OUT.py [NAME ...]``: write the kernels module of
    embengine's registered row math (or of the NAMEs registered) to OUT.py, for reading. The
    package never imports it: it renders each row math's module itself (``row_math.py``)."""
    from ..optimizers._row_math import ROW_MATH

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        print(main.__doc__.split("\n")[0].strip("`: "), file=sys.stderr)
        return 2
    out, names = Path(argv[0]), argv[1:]
    unknown = [n for n in names if n not in ROW_MATH]
    if unknown:
        print(
            f"no row math registered as {unknown}; registered: {sorted(ROW_MATH)}", file=sys.stderr
        )
        return 2
    rms = [ROW_MATH[n] for n in names] if names else builtin_row_math()
    out.write_text(render(rms))
    print(f"wrote {out} ({', '.join(rm.name for rm in rms)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
