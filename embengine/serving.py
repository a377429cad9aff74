"""Serving: export a checkpoint's weights (no slots), compressed, and look up from the export.

Compressions and their error bounds on ``|served - trained|`` for a (float32) value ``x``
(``error_bound`` computes them; decoding is float32 arithmetic, whose rounding they include):

- ``fp32``: float32, unchanged; 0.
- ``fp16``: IEEE half, round to nearest even; ``|x| * 2**-11`` (``2**-25`` near 0; |x| <= 65504).
- ``bf16``: bfloat16, the top 16 bits rounded to even; ``|x| * 2**-8``, and ``2**-134`` for
  float32's subnormals (``|x| < 2**-126``, where bfloat16's step is ``2**-133``, not relative).
- ``fixed_r8``: int8 codes ``k``, value ``k * r / 128`` (Monolith's FixedR8Compressor,
  ``r = fixed_range``), decoded as ``k * float32(r / 128)`` in float32; ``r / 256 + r * 2**-22``
  for ``x`` in ``[-r, 127 r / 128]`` (half a step, plus the float32 step's and product's
  rounding), plus the distance to that range for values outside it (clipped).
- ``int8_rowwise``: int8 codes with a float32 scale and bias per row,
  ``x = bias + scale * (k + 128)`` in float32; ``(max - min) / 510 + (max - min + max |x|) *
  2**-23 + 2**-140`` of the row: half a step, plus float32's rounding of the scale, the product
  and the sum. The last terms count for a row far from 0 with a small spread (near ``-1e5``,
  where float32's step is ``2**-7``, a row spread over 6 decoded up to 1.3 times
  ``(max - min) / 510`` away); ``2**-140`` for spreads below ``2**-118``, where the scale is
  subnormal.

A finite value a compression would make Inf (fp16 past 65504, bf16 next to float32's largest)
is refused: export raises a ValueError naming the table and the row, and writes nothing.

An export is a folder: ``manifest.json`` (format, features, tables, each table's compression and
the SHA-256 and size of every file), ``manifest.sha256`` (the SHA-256 of manifest.json, as in
checkpoints) and one safetensors file per table. ``ServingEngine.load`` memory-maps it and looks
features up with the same combiners, sequence lengths and output shapes as the training engine;
it is read-only and safe to call from many threads. A keyed table (``vocabulary_size`` null,
``keyed: {rows}``) stores its sorted int64 ``keys`` beside its weights (without the rows
expired at the checkpoint's step); a lookup finds each key by binary search, and a key it does
not hold looks up as zeros, as the training engine's ``lookup(..., training=False)`` does.

Where an export is written (``export(..., replace=False)``, ``embengine export ... --replace``):

- OUT may be missing or an empty folder. A non-empty OUT is refused, unless ``replace=True`` and
  OUT is a previous export: its manifest.json has the serving format and it holds nothing but
  manifest.json, manifest.sha256 and the files that manifest lists. A folder holding a checkpoint,
  checkpoints (``ckpt-*``), the checkpoint being exported (or OUT inside it), or any other file
  is never replaced, even with ``replace``. OUT named like a checkpoint
  (``ckpt-<sequence>-step<step>``) is refused wherever it is: in a folder of checkpoints it
  would be numbered with them and, by older embengines, restored as the newest one (which
  failed) or deleted by a save while empty. These checks run before any work, and again just
  before the new export is moved in.
- The export is written to ``.export-<OUT name>-<pid>-<random>`` beside OUT, fsynced and renamed
  into place; a replaced export is renamed aside (``.old-...``) first and deleted after. A failed
  export removes its own temporary folder. Leftovers of killed exports (a pid that is no longer
  running, or a folder older than the process that now has its pid) are removed by the next
  export to the same OUT; a running export's folder is left alone. Older embengines wrote
  ``.tmp-<OUT name>-<pid>-<random>`` (or ``-<random>`` alone: removed if older than this
  process), the names checkpoint saves write into (``.tmp-ckpt-*``) when OUT was named
  ``ckpt-*``: a save in that folder removed an export in progress. The two never share a name
  now, and an export never removes a ``.tmp-ckpt-*`` folder (a save's; a killed one's is
  removed by the next save there).

Loading (``ServingEngine.load(path, verify=True)``, ``read_serving_manifest``) checks, before it
builds or maps anything: the format and version; with ``verify``, manifest.sha256 against
manifest.json; every key and type of the manifest; that every file name is a plain
``*.safetensors`` name inside the folder, listed with its SHA-256 and size and used by exactly one
table; every file (manifest.json and manifest.sha256 too) a regular file, never a symbolic link
(which could lead outside the folder); manifest.json and manifest.sha256 at most
``checkpoint.MAX_MANIFEST_BYTES`` (64 MiB; read whole, so refused before reading); every file's
size; with ``verify``, every file's SHA-256; and every tensor's header (names, dtype, shape,
byte range) against the table's vocabulary_size, dim and compression. Any failure is a
``CheckpointError``. ``verify=False`` skips only the hashing (of manifest.json and of the
files), never the other checks.

``ServingEngine`` then opens each table file once (never through a symbolic link), checks its
size against the manifest's and its header against the table again, on that open file, and
maps it whole: every array it serves ends inside the file. A file truncated while served (a copy
written over the export truncates it first) killed the process with SIGBUS at the first row
read past its new end, and read zeros from its last page: every lookup first compares each
file's size with the manifest's (one fstat per table file) and raises a ``CheckpointError``
naming the file and both sizes. A truncation between that check and the rows' read still
crashes: write a new export to a new folder and load it from there, never over a served one.
Export reads a checkpoint's tables with read(), chunk by chunk (``CheckpointReader.rows``),
never mapped: a file truncated meanwhile is an error naming it, not a SIGBUS.

Exports written before manifest.sha256 existed have none: ``verify=True`` refuses them with an
error saying to re-export (``embengine export CKPT OUT --replace``) or to load with
``verify=False``, which checks everything but the hashes. manifest.sha256 catches accidents (a
truncated or damaged manifest), not tampering: whoever can write the folder can rewrite both.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import mmap
import os
import re
import shutil
import stat
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from .batch import (
    LookupOnlyTableBatch,
    PreparedBatch,
    TableBatch,
    batch_fingerprint,
    check_prepared_for,
    prepare,
)
from .checkpoint import FORMAT as CHECKPOINT_FORMAT
from .checkpoint import (
    CheckpointError,
    CheckpointReader,
    _is_int,
    check_verify,
    is_checkpoint_name,
    own_file,
    read_checkpoint,
    read_json_dict,
    read_own_file,
    wrong_size,
)
from .config import (
    COMBINERS,
    COMPRESSIONS,
    FeatureConfig,
    QuantizationConfig,
    ResolvedFeatures,
    TableConfig,
    fixed_range_error,
    resolve_features,
)
from .inputs import Ragged
from .safetensors_io import (
    BFLOAT16,
    NUMPY,
    TensorRows,
    read_header,
    sha256_file,
    write_safetensors,
)

__all__ = ["COMPRESSIONS", "export", "ServingEngine", "ExportReport", "SERVING_FORMAT"]

SERVING_FORMAT = "embengine-serving"
SERVING_VERSION = 1
_ROWS_PER_CHUNK = 1 << 16


# -- codecs: float32 rows <-> stored arrays -------------------------------------------------------


def _to_bf16(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + 0x7FFF  # round to nearest, ties to even
    return ((bits + rounding) >> 16).astype(np.uint16)


def _from_bf16(b: np.ndarray) -> np.ndarray:
    """float32 of bfloat16 bits (uint16), or of an ``ml_dtypes.bfloat16`` array's."""
    if b.dtype == BFLOAT16:
        b = b.view(np.uint16)
    return (b.astype(np.uint32) << 16).view(np.float32)


def _fixed_r8(x: np.ndarray, r: float) -> np.ndarray:
    step = r / 128.0
    return np.clip(np.floor(np.asarray(x, np.float64) / step + 0.5), -128, 127).astype(np.int8)


def _rowwise(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = np.asarray(x, dtype=np.float64)
    lo = x.min(axis=1) if x.shape[1] else np.zeros(len(x))
    hi = x.max(axis=1) if x.shape[1] else np.zeros(len(x))
    scale = (hi - lo) / 255.0
    safe = np.where(scale > 0, scale, 1.0)
    codes = np.clip(np.floor((x - lo[:, None]) / safe[:, None] + 0.5), 0, 255) - 128
    return codes.astype(np.int8), scale.astype(np.float32), lo.astype(np.float32)


def decode(
    arrays: Mapping[str, np.ndarray], compression: str, rows: np.ndarray, params: Mapping
) -> np.ndarray:
    """float32 values of ``rows`` of a stored table."""
    if compression == "fp32":
        return np.asarray(arrays["weights"][rows], dtype=np.float32)
    if compression == "fp16":
        return arrays["weights"][rows].astype(np.float32)
    if compression == "bf16":
        return _from_bf16(arrays["weights"][rows])
    if compression == "fixed_r8":
        return arrays["weights"][rows].astype(np.float32) * np.float32(params["fixed_range"] / 128)
    if compression == "int8_rowwise":
        codes = arrays["weights"][rows].astype(np.float32) + 128.0
        return arrays["bias"][rows][:, None] + arrays["scale"][rows][:, None] * codes
    raise ValueError(f"unknown compression {compression!r}")


def error_bound(compression: str, x: np.ndarray, params: Mapping) -> np.ndarray:
    """The per-value bound on |decode(encode(x)) - x| stated in the module docstring, for the
    float32 values ``x`` (rows of a table: int8_rowwise's bound is per row), in float64."""
    x = np.asarray(x, dtype=np.float64)
    if compression == "fp32":
        return np.zeros_like(x)
    if compression == "fp16":
        return np.maximum(np.abs(x) * 2.0**-11, 2.0**-25)
    if compression == "bf16":
        return np.maximum(np.abs(x) * 2.0**-8, 2.0**-134)
    if compression == "fixed_r8":
        r = params["fixed_range"]
        outside = np.abs(np.clip(x, -r, r * 127 / 128) - x)
        return np.full_like(x, r / 256.0 + r * 2.0**-22) + outside
    if compression == "int8_rowwise":
        if x.shape[-1] == 0:
            return np.zeros_like(x)
        span = x.max(axis=1, keepdims=True) - x.min(axis=1, keepdims=True)
        largest = np.abs(x).max(axis=1, keepdims=True)
        bound = span / 510.0 + (span + largest) * 2.0**-23 + 2.0**-140
        return np.broadcast_to(bound, x.shape)
    raise ValueError(f"unknown compression {compression!r}")


# -- export ---------------------------------------------------------------------------------------


@dataclass
class ExportReport:
    """What ``export`` wrote, per table (``rows``): name, compression, ``bytes_before`` (its
    exported rows as float32), ``bytes_after`` (the arrays written) and the max abs error. A
    keyed table's int64 keys are written with its rows and count in both sizes, so that an
    fp32 export's ratio is 1 (before, only the export's size counted them: 0.50 at dim 2)."""

    path: Path
    rows: list[dict]  # per table: name, compression, bytes before / after, max abs error

    def format(self) -> str:
        """The table printed by ``embengine export`` (sizes in MiB, ratio fp32 / export)."""
        lines = [
            f"{'table':20s} {'compression':12s} {'fp32 MiB':>10s} {'export MiB':>10s} "
            f"{'ratio':>6s} {'max abs error':>14s}"
        ]
        for r in self.rows:
            before, after = r["bytes_before"], r["bytes_after"]
            lines.append(
                f"{r['table']:20s} {r['compression']:12s} {before / 2**20:10.2f} "
                f"{after / 2**20:10.2f} {before / max(1, after):6.2f} {r['max_abs_error']:14.3g}"
            )
        if self.rows:
            before = sum(r["bytes_before"] for r in self.rows)
            after = sum(r["bytes_after"] for r in self.rows)
            errors = [r["max_abs_error"] for r in self.rows]
            # max() drops a NaN that follows a number: a table's NaN error is the total's
            worst = math.nan if any(e != e for e in errors) else max(errors)
            lines.append(
                f"{'all tables':20s} {'':12s} {before / 2**20:10.2f} {after / 2**20:10.2f} "
                f"{before / max(1, after):6.2f} {worst:14.3g}"
            )
        if any(r.get("keyed") for r in self.rows):
            lines.append("(keyed tables: both sizes count their int64 keys)")
        return "\n".join(lines)


def _encode_table(
    weights: np.ndarray | TensorRows, compression: str, params: Mapping, name: str = ""
):
    """(arrays to store, max abs error), chunk by chunk over rows. ``weights`` in the table's
    stored dtype (an array, or a checkpoint's rows read on demand: ``TensorRows``): a 16-bit
    table's are widened to float32 exactly, then compressed.

    Finite values the compression cannot represent (fp16 past 65504, bf16 next to float32's
    largest, an int8_rowwise row spanning more than float32's range) would decode to Inf:
    a ValueError naming table ``name``, the first such row and its value, nothing returned
    (they were written as Inf, silently: every bag holding one served Inf)."""
    vocab, dim = weights.shape
    if compression == "fp32" and weights.dtype == np.float32:
        return {"weights": weights}, 0.0
    out: dict[str, np.ndarray] = {}
    if compression == "fp32":
        out["weights"] = np.empty((vocab, dim), dtype=np.float32)
    if compression in ("fp16", "bf16", "fixed_r8", "int8_rowwise"):
        dtype = {
            "fp16": np.float16,
            "bf16": np.uint16,
            "fixed_r8": np.int8,
            "int8_rowwise": np.int8,
        }[compression]
        out["weights"] = np.empty((vocab, dim), dtype=dtype)
    if compression == "int8_rowwise":
        out["scale"] = np.empty(vocab, dtype=np.float32)
        out["bias"] = np.empty(vocab, dtype=np.float32)
    worst = 0.0
    overflows, first = 0, None
    for lo in range(0, vocab, _ROWS_PER_CHUNK):
        hi = min(vocab, lo + _ROWS_PER_CHUNK)
        x = np.asarray(weights[lo:hi], dtype=np.float32)
        if compression == "fp32":
            out["weights"][lo:hi] = x
        elif compression == "fp16":
            with np.errstate(over="ignore"):  # refused below, naming the table and the row
                out["weights"][lo:hi] = x.astype(np.float16)
        elif compression == "bf16":
            out["weights"][lo:hi] = _to_bf16(x)
        elif compression == "fixed_r8":
            out["weights"][lo:hi] = _fixed_r8(x, params["fixed_range"])
        else:
            out["weights"][lo:hi], out["scale"][lo:hi], out["bias"][lo:hi] = _rowwise(x)
        with np.errstate(over="ignore"):  # int8_rowwise: scale * code past float32's range
            back = decode(out, compression, np.arange(lo, hi), params) if hi > lo else x
        lost = (np.isfinite(x) & ~np.isfinite(back)).any(axis=tuple(range(1, x.ndim)))
        if lost.any():
            if first is None:
                row = int(np.argmax(lost))
                value = x[row][np.isfinite(x[row]) & ~np.isfinite(back[row])][0]
                first = (lo + row, float(value))
            overflows += int(lost.sum())
        if x.size:
            err = float(np.abs(back.astype(np.float64) - x).max())
            worst = err if not err <= worst else worst  # a NaN is kept, not hidden by max()
    if overflows:
        raise ValueError(
            f"table {name!r}: {overflows:,} rows hold values {compression} cannot represent (the "
            f"first at row {first[0]}: {first[1]!r}); exported, they would be Inf, and so would "
            "every bag holding one. Export the table with a compression whose range holds them "
            f"(per_table={{{name!r}: 'fp32'}}, `--table {name}=fp32`); nothing was written"
        )
    if compression == "bf16":  # bfloat16 bits: stored as a "BF16" tensor (uint16 is "U16")
        out["weights"] = out["weights"].view(BFLOAT16)
    return out, worst


def _check_finite_weights(file: Path, name: str, weights: np.ndarray | TensorRows) -> None:
    """A ValueError if a table's weights (rows read chunk by chunk) hold a NaN or an Inf:
    served, every bag holding such a row would be NaN. Called for the tables whose
    checkpoint says they were not finite when saved (the flag covers the float slots too: a
    table whose slots alone diverged exports)."""
    bad = first = 0
    for lo in range(0, len(weights), _ROWS_PER_CHUNK):
        x = np.asarray(weights[lo : lo + _ROWS_PER_CHUNK], dtype=np.float32)
        wrong = ~np.isfinite(x).all(axis=tuple(range(1, x.ndim)))
        if wrong.any() and not bad:
            first = lo + int(np.argmax(wrong))
        bad += int(wrong.sum())
    if bad:
        raise ValueError(
            f"{file}: table {name!r} has {bad:,} rows of weights holding NaN or Inf (the first "
            f"at row {first}): served, every bag holding one would be NaN. Export a checkpoint "
            "saved before the training diverged (`embengine inspect ROOT` says which are "
            "finite; a save's keep=N never deletes the newest finite one); nothing was written"
        )


def _live_keys(reader, t: dict, weights: TensorRows) -> tuple[np.ndarray, np.ndarray | TensorRows]:
    """A keyed table's (keys, weights) as an evaluation lookup at the checkpoint's step sees
    them: without the rows expired by then (``expire_steps``; ``expire_seconds`` at the table's
    data time), which the next training step would remove. Read with read() (``reader.rows``).
    Its keys must be sorted and distinct, as a restore requires and a served lookup's binary
    search needs: a CheckpointError naming the file and the key otherwise (a crafted or damaged
    checkpoint), before anything is written."""
    keys = np.asarray(reader.rows(t["name"], "keys"))
    bad = np.flatnonzero(keys[1:] <= keys[:-1])
    if len(bad):
        raise CheckpointError(
            f"{reader.file_of(t['name'])}: table {t['name']!r}: key {keys[bad[0] + 1]} at "
            f"position {bad[0] + 1} is not greater than the one before; a checkpoint's keys are "
            "sorted and distinct (a crafted or damaged checkpoint, which restore refuses too)"
        )
    dynamic = t.get("dynamic") or {}
    live = np.ones(len(keys), bool)
    expire = dynamic.get("expire_steps")
    if expire is not None:
        live &= reader.step - np.asarray(reader.rows(t["name"], "last_touched")) <= expire
    seconds = dynamic.get("expire_seconds")
    clock = int(np.asarray(reader.rows(t["name"], "data_time"))[0])
    if seconds is not None and clock != np.iinfo(np.int64).min:
        times = np.asarray(reader.rows(t["name"], "last_time"))
        live &= (times == np.iinfo(np.int64).min) | (clock - times <= seconds)
    if live.all():
        return keys, weights
    out = np.empty((int(live.sum()), *weights.shape[1:]), weights.dtype)
    at = 0
    for lo in range(0, len(live), _ROWS_PER_CHUNK):  # the live rows, chunk by chunk
        part = weights[lo : lo + _ROWS_PER_CHUNK][live[lo : lo + _ROWS_PER_CHUNK]]
        out[at : at + len(part)] = part
        at += len(part)
    return keys[live], out


# -- where an export may be written ---------------------------------------------------------------

_EXPORT_OWN_FILES = ("manifest.json", "manifest.sha256")
_CLOCK_SLACK = 2.0  # seconds: process start times from /proc are exact to ~1 s (boot time)


def _plain_name(name: object) -> bool:
    """A file name an export may list: ``*.safetensors`` directly inside the folder."""
    return (
        isinstance(name, str)
        and name.endswith(".safetensors")
        and not name.startswith(".")
        and not any(c in name for c in "/\\\0")
        and not os.path.isabs(name)
    )


def _some(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _is_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` holds a manifest.json of a checkpoint's format."""
    manifest = read_json_dict(folder / "manifest.json")
    return manifest is not None and manifest.get("format") == CHECKPOINT_FORMAT


def _temporary(out: Path, kind: str = "export") -> Path:
    """The folder beside ``out`` that an export writes (``kind`` "export") or that a replaced
    export is renamed to (``kind`` "old") before the new one moves in. Never ``.tmp-ckpt-*``
    or ``.trash-ckpt-*``, the names a checkpoint save writes and removes (an export named
    ``ckpt-*`` in a folder of checkpoints wrote ``.tmp-ckpt-...``, which a save there removed
    midway, the export's folder being no save's and unlocked)."""
    return out.parent / f".{kind}-{out.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _check_place(out: Path) -> None:
    """Refuse an export folder ``out`` that cannot be made where it is named: a file among
    its parents, or a name too long for the temporary folder export writes beside it. Found
    only after the checkpoint was read and hashed, these were bare OS errors ("File exists"
    naming the parent, "File name too long")."""
    parent = next((p for p in out.parents if p.exists()), None)
    if parent is None:  # a root: refused by name before this
        return
    if not parent.is_dir():
        raise ValueError(
            f"export folder {out} cannot be made: {parent} is a file, not a folder; choose a "
            "folder whose parents are folders (or do not exist yet)"
        )
    try:
        limit = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):  # no limit to ask for (a file system that says none)
        return
    size = len(os.fsencode(out.name))
    longest = len(os.fsencode(_temporary(out).name))  # a replaced export's ".old-" is shorter
    if longest > limit:
        beside = (
            ""
            if size > limit
            else f", and export writes it beside as '.export-{out.name[:8]}...' ({longest} bytes)"
        )
        raise ValueError(
            f"export folder name '{out.name[:40]}...' is {size} bytes{beside}; a name in "
            f"{parent} takes at most {limit}: choose a shorter name"
        )


def _check_out(out: Path, sources: Sequence[Path], replace: bool) -> None:
    """Refuse an export folder ``out`` that export must not write into or replace (see the
    module docstring). ``out`` is absolute; ``sources`` are the checkpoint paths read."""
    never = "never replaced, even with --replace (replace=True)"
    _check_place(out)  # first: a name too long fails every call on it
    if out.is_symlink():
        raise ValueError(
            f"export folder {out} is a symbolic link; pass the folder it points to instead"
        )
    real = out.resolve()
    for src in sources:
        s = src.resolve()
        if real == s:
            raise ValueError(
                f"export folder {out} is the checkpoint being exported ({src}); it is {never}; "
                "choose a folder outside it"
            )
        if real in s.parents:
            raise ValueError(
                f"export folder {out} holds the checkpoint being exported ({src}); it is "
                f"{never}; choose a folder outside it"
            )
        if s in real.parents:
            raise ValueError(
                f"export folder {out} is inside the checkpoint being exported ({src}); choose a "
                "folder outside it"
            )
    # After those and unless OUT is a checkpoint (below): their errors say more.
    if is_checkpoint_name(out.name) and not _is_checkpoint(out):
        raise ValueError(
            f"export folder {out} is named like a checkpoint ({out.name!r}: "
            "ckpt-<sequence>-step<step>); inside a folder of checkpoints it would be taken for "
            "one (older embengines restored it as the newest checkpoint and failed, and their "
            "saves deleted it while it was empty): choose another name, e.g. "
            f"'served-{out.name}'"
        )
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"export folder {out} is a file, not a folder; it is {never}")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    manifest = read_json_dict(out / "manifest.json")
    fmt = None if manifest is None else manifest.get("format")
    if fmt == CHECKPOINT_FORMAT:
        raise ValueError(
            f"export folder {out} holds a checkpoint (manifest.json of format "
            f"{CHECKPOINT_FORMAT!r}); a checkpoint is {never}"
        )
    ckpts = [e for e in entries if e.startswith("ckpt-")]
    if ckpts:
        raise ValueError(
            f"export folder {out} holds checkpoints ({_some(ckpts)}); a folder of "
            f"checkpoints is {never}"
        )
    if not replace:
        raise ValueError(
            f"export folder {out} is not empty (it holds {_some(entries)}); pass --replace "
            f"(replace=True) to replace a previous export (a folder whose manifest.json has the "
            f"format {SERVING_FORMAT!r}); any other folder is never replaced"
        )
    if fmt != SERVING_FORMAT:
        raise ValueError(
            f"export folder {out} is not an embengine export (no manifest.json of format "
            f"{SERVING_FORMAT!r}; it holds {_some(entries)}); --replace (replace=True) replaces "
            "only a previous export, never other files"
        )
    files = manifest.get("files")
    listed = {n for n in files if _plain_name(n)} if isinstance(files, dict) else set()
    foreign = [
        e
        for e in entries
        if (e not in _EXPORT_OWN_FILES and e not in listed)
        or (out / e).is_symlink()
        or not (out / e).is_file()
    ]
    if foreign:
        raise ValueError(
            f"export folder {out} holds {_some(foreign)}, which its export manifest does not "
            f"list; a previous export with other files in it is {never}"
        )


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False  # not a pid an export writes (os.kill(0, ...) would mean the group)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    except (OverflowError, OSError):
        return False
    return True


def _process_start(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), or None if unknown (no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22, starttime
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return int(line.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return None


def _older_than_process(folder: Path, pid: int) -> bool:
    """Whether ``folder`` was last changed before process ``pid`` started (so that process
    did not make it); False when unknown."""
    start = _process_start(pid)
    try:
        return start is not None and folder.stat().st_mtime < start - _CLOCK_SLACK
    except OSError:
        return False


def _remove_leftovers(parent: Path, name: str, kind: str) -> None:
    """Delete ``.{kind}-{name}-*`` folders that no running export owns (see the module
    docstring): the pid in the name is not running, or runs a process younger than the folder;
    unnamed ones (older embengines) must be older than this process. Never a ``.tmp-ckpt-*``
    folder: with ``kind`` "tmp" (older embengines' exports) and OUT named ``ckpt-*``, that is
    also the name of a checkpoint save's folder, which only saves remove (unlocked: killed)."""
    if f".{kind}-{name}".startswith(".tmp-ckpt-"):
        return
    with_pid = re.compile(rf"^\.{kind}-{re.escape(name)}-(\d+)-[0-9a-f]{{8}}$")
    unnamed = re.compile(rf"^\.{kind}-{re.escape(name)}-[0-9a-f]{{8}}$")
    for p in parent.glob(f".{kind}-*"):
        if (m := with_pid.match(p.name)) is not None:
            pid = int(m[1])
            stale = not _pid_alive(pid) or _older_than_process(p, pid)
        elif unnamed.match(p.name):
            stale = _older_than_process(p, os.getpid())
        else:
            continue
        if stale and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_table_names(ckpt: Path, manifest: dict, per_table: Mapping[str, str]) -> None:
    """A ValueError naming the tables of ``per_table`` the checkpoint's (schema-checked)
    ``manifest`` does not hold, and those it holds. Run before its files are hashed
    (``read_checkpoint(check=...)``): found after, a typo in ``--table`` cost the minutes of
    hashing a large checkpoint."""
    names = [t["name"] for t in manifest["tables"]]
    unknown = [n for n in per_table if n not in names]
    if unknown:
        raise ValueError(
            f"per-table compression for unknown tables {unknown}: checkpoint {ckpt} holds "
            f"tables {names}; nothing was read or written"
        )


def export(
    checkpoint: str | Path,
    out: str | Path,
    compress: str = "fp32",
    per_table: Mapping[str, str] | None = None,
    fixed_range: float = 1.0,
    replace: bool = False,
) -> ExportReport:
    """Write the weights of a checkpoint (no slots) to ``out``, each table compressed with
    ``per_table.get(name, compress)``.

    ``out`` must be missing or empty, or, with ``replace=True``, a previous export; a folder
    holding checkpoints or other files is never replaced (see the module docstring). The export
    is written beside ``out`` and renamed into place; a failure midway leaves ``out`` as it was
    and removes the temporary folder."""
    if not isinstance(replace, bool):
        raise TypeError(f"replace must be True or False, got {replace!r}")
    per_table = dict(per_table or {})
    for name, c in [("default", compress), *per_table.items()]:
        if c not in COMPRESSIONS:
            raise ValueError(f"compression for {name} must be one of {COMPRESSIONS}, got {c!r}")
    why = fixed_range_error(fixed_range)
    if why is not None:
        raise ValueError(f"fixed_range {why}")
    given = Path(out)
    # The path as the OS takes it: symbolic links among its folders followed before a "..",
    # which os.path.abspath folds away by the letters (link/../x is not ./x); the last name as
    # it is (_check_out refuses a link there).
    if given.name in ("", ".", ".."):
        out = Path(os.path.realpath(given))
    else:
        out = Path(os.path.realpath(given.parent)) / given.name
    if not out.name:
        raise ValueError(f"export folder {given} has no name (a filesystem root)")
    here = Path(os.path.realpath(os.getcwd()))
    if out == here or out in here.parents:
        raise ValueError(
            f"export folder {given} is the current folder or holds it ({out}): an export is "
            "written beside its folder and renamed into place, which would take the current "
            "folder away; name a new folder"
        )
    _check_out(out, [Path(checkpoint)], replace)  # before reading (and hashing) the checkpoint
    # Every check of a checkpoint (checkpoint module docstring), hashes included: its tables
    # are read only from the files it lists, inside it, of the sizes and hashes it lists.
    spec, reader = read_checkpoint(
        checkpoint, verify=True, check=lambda ckpt, m: _check_table_names(ckpt, m, per_table)
    )
    with reader:  # kept (a save's keep=N does not prune it) until exported
        return _export(
            reader, spec, checkpoint, out, given, compress, per_table, fixed_range, replace
        )


def _export(
    reader: CheckpointReader,
    spec: dict,
    checkpoint: str | Path,
    out: Path,
    given: Path,
    compress: str,
    per_table: dict[str, str],
    fixed_range: float,
    replace: bool,
) -> ExportReport:
    """``export`` of a checked checkpoint (``reader``) to ``out`` (resolved; ``given``: as
    the caller named it)."""
    ckpt = reader.path
    _check_out(out, [Path(checkpoint), ckpt], replace)  # ckpt: the newest one of a root
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(out.parent, out.name, "export")
    _remove_leftovers(out.parent, out.name, "tmp")  # older embengines' (not ckpt-*: a save's)
    tmp = _temporary(out)
    tmp.mkdir()
    # The manifest's flag per table: its weights and float slots were finite when saved.
    finite = {m["name"]: m.get("finite", True) for m in reader.manifest["tables"]}
    try:
        tables, files, rows = [], {}, []
        for i, t in enumerate(spec["tables"]):
            # The export's per-table choice, else the table's own compressor, else the default.
            own = t.get("compressor")
            if t["name"] in per_table or own is None:
                comp, r = per_table.get(t["name"], compress), fixed_range
            else:
                comp, r = own["compression"], own["fixed_range"]
            # Read with read(), chunk by chunk: a memory map of a file truncated meanwhile
            # killed the export with SIGBUS.
            weights = reader.rows(t["name"])
            keys = None
            if reader.is_keyed(t["name"]):
                keys, weights = _live_keys(reader, t, weights)
            if finite.get(t["name"], True) is not True:  # weights or slots held NaN or Inf
                _check_finite_weights(reader.file_of(t["name"]), t["name"], weights)
            params = {"fixed_range": r} if comp == "fixed_r8" else {}
            arrays, worst = _encode_table(weights, comp, params, t["name"])
            if keys is not None:
                arrays = {"keys": keys, **arrays}
            file = f"table-{i:03d}.safetensors"
            # The table's name inside its file: a manifest whose files were swapped is refused.
            digest = write_safetensors(tmp / file, arrays, {"table": t["name"]})
            files[file] = {"sha256": digest}
            files[file]["bytes"] = (tmp / file).stat().st_size
            tables.append(
                {
                    "name": t["name"],
                    "vocabulary_size": t["vocabulary_size"],
                    **({} if keys is None else {"keyed": {"rows": len(keys)}}),
                    "dim": t["dim"],
                    "combiner": t["combiner"],
                    "compression": comp,
                    "params": params,
                    "quantization_config": t.get("quantization_config"),
                    "file": file,
                }
            )
            rows.append(
                {
                    "table": t["name"],
                    "compression": comp,
                    # as float32 (the column says so), and the keys, as both columns count
                    "bytes_before": weights.size * 4 + (0 if keys is None else keys.nbytes),
                    "bytes_after": sum(a.nbytes for a in arrays.values()),
                    "keyed": keys is not None,
                    "max_abs_error": worst,
                }
            )
        manifest_out = {
            "format": SERVING_FORMAT,
            "format_version": SERVING_VERSION,
            "source_step": reader.step,
            "features": spec["features"],
            "tables": tables,
            "files": files,
        }
        text = json.dumps(manifest_out, indent=1).encode()
        digest = hashlib.sha256(text).hexdigest().encode()
        for name, data in (("manifest.json", text), ("manifest.sha256", digest)):
            with open(tmp / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        _fsync_dir(tmp)
        # OUT may have changed while the tables were written: check it again right before.
        _check_out(out, [Path(checkpoint), ckpt], replace)
        if out.is_dir() and any(out.iterdir()):  # a previous export (checked above)
            old = _temporary(out, "old")
            os.rename(out, old)
            try:
                os.rename(tmp, out)
            except BaseException:
                os.rename(old, out)  # put the previous export back
                raise
            _fsync_dir(out.parent)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)  # onto a missing or empty folder
            _fsync_dir(out.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    # Previous exports renamed aside by killed replaces: only now that OUT holds a new one.
    _remove_leftovers(out.parent, out.name, "old")
    return ExportReport(given, rows)


# -- reading an export ----------------------------------------------------------------------------

_KINDS = {
    "name": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "count": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an int >= 0"),
    "size": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an int >= 1"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "list": (lambda v: isinstance(v, list), "a list"),
    "object": (lambda v: isinstance(v, dict), "an object"),
    "object?": (lambda v: v is None or isinstance(v, dict), "an object or null"),
    "shape?": (lambda v: v is None or isinstance(v, list), "a list of ints or null"),
    "sha256": (
        lambda v: isinstance(v, str) and re.fullmatch("[0-9a-f]{64}", v) is not None,
        "a SHA-256 (64 lowercase hex digits)",
    ),
}


def _take(obj: dict, key: str, kind: str, where: str, file: Path):
    """``obj[key]``, or a CheckpointError naming the key if it is missing or of the wrong kind."""
    if key not in obj:
        raise CheckpointError(f"{file}: {where} has no {key!r}")
    ok, what = _KINDS[kind]
    if not ok(obj[key]):
        raise CheckpointError(f"{file}: {where}[{key!r}] must be {what}, got {obj[key]!r:.80}")
    return obj[key]


def _check_schema(path: Path, manifest: dict) -> None:
    """Every key the loaders use is present and of the right type (CheckpointError otherwise)."""
    file = path / "manifest.json"
    _take(manifest, "source_step", "count", "the manifest", file)
    files = _take(manifest, "files", "object", "the manifest", file)
    for name, info in files.items():
        if not _plain_name(name):
            raise CheckpointError(
                f"{path}: manifest lists {name!r}; only safetensors files directly inside the "
                "export folder are read (no paths, no hidden files, never pickle)"
            )
        where = f"files[{name!r}]"
        if not isinstance(info, dict):
            raise CheckpointError(f"{file}: {where} must be an object, got {info!r:.80}")
        _take(info, "sha256", "sha256", where, file)
        _take(info, "bytes", "count", where, file)
    tables = _take(manifest, "tables", "list", "the manifest", file)
    if not tables:
        raise CheckpointError(f"{file}: the manifest lists no tables")
    used: dict[str, int] = {}
    for i, t in enumerate(tables):
        where = f"tables[{i}]"
        if not isinstance(t, dict):
            raise CheckpointError(f"{file}: {where} must be an object, got {t!r:.80}")
        name = _take(t, "name", "name", where, file)
        if any(o.get("name") == name for o in tables[:i]):
            raise CheckpointError(f"{file}: {where}: table name {name!r} appears twice")
        if t.get("vocabulary_size", 0) is None:  # keyed: its rows are its keys
            _take(
                _take(t, "keyed", "object", where, file), "rows", "count", f"{where}['keyed']", file
            )
        else:
            _take(t, "vocabulary_size", "size", where, file)
        _take(t, "dim", "size", where, file)
        if _take(t, "combiner", "name", where, file) not in COMBINERS:
            raise CheckpointError(
                f"{file}: {where}['combiner'] must be one of {COMBINERS}, got {t['combiner']!r:.80}"
            )
        comp = _take(t, "compression", "name", where, file)
        if comp not in COMPRESSIONS:
            raise CheckpointError(
                f"{file}: {where}['compression'] must be one of {COMPRESSIONS}, got {comp!r:.80}"
            )
        params = _take(t, "params", "object", where, file)
        if comp == "fixed_r8":
            why = fixed_range_error(params.get("fixed_range"))
            if why is not None:
                raise CheckpointError(f"{file}: {where}['params']['fixed_range'] {why} (fixed_r8)")
        if t.get("quantization_config") is not None:
            q = _take(t, "quantization_config", "object?", where, file)
            try:
                if sorted(q) != ["lower", "num_buckets", "upper"]:
                    raise ValueError(f"keys {sorted(q)}, expected lower, num_buckets, upper")
                if not all(isinstance(q[k], int | float) and not isinstance(q[k], bool) for k in q):
                    raise ValueError(f"values must be numbers, got {q}")
                QuantizationConfig(**q)
            except (ValueError, TypeError) as e:
                raise CheckpointError(f"{file}: {where}['quantization_config']: {e}") from None
        f = _take(t, "file", "name", where, file)
        if f not in files:
            raise CheckpointError(
                f"{path}: {where} ({name!r}) reads {f!r}, which the manifest's files do not list "
                "(every file must be a listed, checksummed safetensors file inside the folder)"
            )
        if f in used:
            raise CheckpointError(f"{file}: tables[{used[f]}] and {where} share the file {f!r}")
        used[f] = i
    unused = [n for n in files if n not in used]
    if unused:
        raise CheckpointError(f"{file}: files {_some(unused)} belong to no table")
    features = _take(manifest, "features", "list", "the manifest", file)
    if not features:
        raise CheckpointError(f"{file}: the manifest lists no features")
    names = {t["name"] for t in tables}
    for j, feat in enumerate(features):
        where = f"features[{j}]"
        if not isinstance(feat, dict):
            raise CheckpointError(f"{file}: {where} must be an object, got {feat!r:.80}")
        _take(feat, "name", "name", where, file)
        if _take(feat, "table", "name", where, file) not in names:
            raise CheckpointError(
                f"{file}: {where} ({feat['name']!r}) looks up table {feat['table']!r}, which the "
                f"manifest does not hold; tables are {sorted(names)}"
            )
        _take(feat, "max_sequence_length", "count", where, file)
        _take(feat, "validate_weights_and_indices", "bool", where, file)
        _take(feat, "output_shape", "shape?", where, file)


# Per compression: tensor name -> (safetensors dtype, shape as a function of (vocabulary, dim)).
_STORED = {
    "fp32": {"weights": ("F32", lambda v, d: [v, d])},
    "fp16": {"weights": ("F16", lambda v, d: [v, d])},
    "bf16": {"weights": ("BF16", lambda v, d: [v, d])},
    "fixed_r8": {"weights": ("I8", lambda v, d: [v, d])},
    "int8_rowwise": {
        "weights": ("I8", lambda v, d: [v, d]),
        "scale": ("F32", lambda v, d: [v]),
        "bias": ("F32", lambda v, d: [v]),
    },
}
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "I8": 1, "I64": 8}


def _wrong_size(file: Path, size: int, expected: int, when: str = "") -> str:
    """The error of an export's file whose size is not the manifest's."""
    return wrong_size(
        file,
        size,
        expected,
        when,
        " (a partial copy, a full disk, a copy written over it); copy the export again, whole, "
        "or re-export it (`embengine export CKPT OUT --replace`)",
    )


def _check_files(path: Path, manifest: dict, verify: bool) -> None:
    """Every listed file exists, a regular file of the folder (a symbolic link is refused:
    ``own_file``), with its size; with ``verify``, its SHA-256."""
    for name, info in manifest["files"].items():
        f = path / name
        size = own_file(f).st_size
        if size != info["bytes"]:
            raise CheckpointError(_wrong_size(f, size, info["bytes"]))
    if verify:
        for name, info in manifest["files"].items():
            if sha256_file(path / name) != info["sha256"]:
                raise CheckpointError(f"checksum mismatch in {path / name}: the file was modified")


def _check_tensors(path: Path, manifest: dict) -> None:
    """Every table file holds exactly the tensors its compression stores, with the dtype, shape
    and byte count the manifest's vocabulary_size and dim give (so nothing is mapped or
    allocated from a header that disagrees with the manifest); a keyed table's keys sorted."""
    for t in manifest["tables"]:
        _check_table_file(path / t["file"], t, keys=True)


def _check_table_file(
    file: Path, t: dict, opened: BinaryIO | None = None, keys: bool = False
) -> tuple[dict, int]:
    """The header of table ``t``'s file (``read_header``; of ``opened``, the file already
    open, if given), checked against the manifest's table (``_check_tensors``); with ``keys``, a
    keyed table's keys read (with read(), never mapped) and checked sorted. A CheckpointError
    naming the file otherwise."""
    keyed = t["vocabulary_size"] is None
    v, d = t["keyed"]["rows"] if keyed else t["vocabulary_size"], t["dim"]
    expected = {n: (dt, shape(v, d)) for n, (dt, shape) in _STORED[t["compression"]].items()}
    if keyed:
        expected["keys"] = ("I64", [v])
    try:
        header, start = read_header(file, opened)
        stored = sorted(n for n in header if n != "__metadata__")
        # Exports before the table name was stored have no metadata.
        named = (header.get("__metadata__") or {}).get("table", t["name"])
        if named != t["name"]:
            raise ValueError(f"the file holds table {named!r}, not {t['name']!r}")
        if stored != sorted(expected):
            raise ValueError(f"holds tensors {stored}, expected {sorted(expected)}")
        for name, (dtype, shape) in expected.items():
            info = header[name]
            if info.get("dtype") != dtype or info.get("shape") != shape:
                raise ValueError(
                    f"tensor {name!r} has dtype {info.get('dtype')} and shape "
                    f"{info.get('shape')}, expected {dtype} and shape {shape}"
                )
            lo, hi = info["data_offsets"]
            if hi - lo != math.prod(shape) * _ITEMSIZE[dtype]:
                raise ValueError(f"tensor {name!r} has {hi - lo} bytes for shape {shape}")
        if keyed and keys:  # lookups search them: sorted and distinct
            _check_sorted(TensorRows(file, "keys", (header, start)))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"{file}: table {t['name']!r} ({t['compression']}, {v} x {d}): {e}"
        ) from None
    return header, start


def _check_sorted(keys: TensorRows) -> None:
    """A ValueError at the first key not greater than the one before, chunk by chunk."""
    for lo in range(0, len(keys), _ROWS_PER_CHUNK):
        first = max(lo - 1, 0)  # the chunk and the last key before it
        chunk = keys[first : lo + _ROWS_PER_CHUNK]
        bad = np.flatnonzero(chunk[1:] <= chunk[:-1])
        if len(bad):
            raise ValueError(
                f"key {chunk[bad[0] + 1]} at position {first + bad[0] + 1} is not greater than "
                "the one before; keys must be sorted and distinct"
            )


def _configs(path: Path, manifest: dict) -> tuple[dict[str, TableConfig], ResolvedFeatures]:
    """(TableConfig per table name, resolved features) of a schema-checked manifest; a value
    the configs refuse is a CheckpointError naming the table or feature."""
    file = path / "manifest.json"
    configs = {}
    for i, t in enumerate(manifest["tables"]):
        q = t.get("quantization_config")
        try:
            configs[t["name"]] = TableConfig(
                t["vocabulary_size"],
                t["dim"],
                combiner=t["combiner"],
                name=t["name"],
                quantization_config=None if q is None else QuantizationConfig(**q),
            )
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{file}: tables[{i}] ({t['name']!r}): {e}") from None
    features = {}
    for j, f in enumerate(manifest["features"]):
        where = f"{file}: features[{j}] ({f['name']!r})"
        if f["name"] in features:
            raise CheckpointError(f"{where}: feature name {f['name']!r} appears twice")
        try:
            features[f["name"]] = FeatureConfig(
                configs[f["table"]],
                f["max_sequence_length"],
                f["validate_weights_and_indices"],
                None if f["output_shape"] is None else tuple(f["output_shape"]),
                name=f["name"],
            )
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{where}: {e}") from None
    try:
        return configs, resolve_features(features)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{file}: {e}") from None


def read_serving_manifest(path: str | Path, verify: bool = True) -> dict:
    """The manifest of the export at ``path`` after every check of the module docstring
    (CheckpointError if one fails); ``verify=False`` skips only the hashing."""
    check_verify(verify)
    path = Path(path)
    file = path / "manifest.json"
    export_first = (
        "; export it first (`embengine export CKPT OUT`, embengine.serving.export) and load "
        "OUT, the export"
    )
    if not os.path.lexists(file):
        if not os.path.lexists(path):
            raise CheckpointError(f"{path} does not exist (not an embengine export)")
        if path.is_dir() and any(p.name.startswith("ckpt-") for p in path.iterdir()):
            raise CheckpointError(
                f"{path} is a folder of checkpoints, not an embengine export{export_first}"
            )
        raise CheckpointError(f"{path}: no manifest.json (not an embengine export)")
    raw = read_own_file(file)
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{file} is not valid JSON ({e})") from None
    fmt = manifest.get("format") if isinstance(manifest, dict) else None
    if fmt == CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is a checkpoint, not an embengine export{export_first}")
    if fmt != SERVING_FORMAT:
        raise CheckpointError(f"{path}: not an embengine export (format {fmt!r:.80})")
    version = manifest.get("format_version")
    if not _is_int(version) or version != SERVING_VERSION:  # True == 1 == 1.0: as a checkpoint
        raise CheckpointError(
            f"{path}: export format version {version!r:.80} is not supported (this embengine "
            f"reads {SERVING_VERSION})"
        )
    if verify:
        digest = path / "manifest.sha256"
        if not os.path.lexists(digest):
            raise CheckpointError(
                f"{path}: no manifest.sha256, so manifest.json cannot be verified (exports "
                "written before embengine checksummed their manifests have none); re-export it "
                "with `embengine export CKPT OUT --replace`, or load it with verify=False "
                "(`embengine inspect --no-verify`), which makes every check but the hashes"
            )
        if read_own_file(digest).strip() != hashlib.sha256(raw).hexdigest().encode():
            raise CheckpointError(
                f"checksum mismatch in {file}: the manifest was modified (manifest.sha256 differs)"
            )
    _check_schema(path, manifest)
    _configs(path, manifest)
    _check_files(path, manifest, verify)
    _check_tensors(path, manifest)
    return manifest


# -- lookup ---------------------------------------------------------------------------------------


class _MappedFile:
    """A table file of a served export, mapped whole and read-only, and the size the manifest
    gives it. The file is opened once (never through a symbolic link): its size (fstat) must be
    the manifest's before it is mapped, and its header, read from it, is checked against the
    manifest's table, so every array of ``arrays`` ends inside the file. ``check`` stats the
    file again (one fstat of the descriptor kept open, so the mapped file, not the path): a
    file truncated while mapped (a copy written over a served export) read zeros from its
    last page, and killed the process with SIGBUS past it; one written over in place at the
    same size (another export copied over it) read the other export's bytes at this one's
    offsets. Its modification time must be the one it had when mapped."""

    def __init__(self, file: Path, t: dict, expected: int):
        self.file, self.expected = file, expected
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a fifo
        try:
            fd = os.open(file, flags)
        except OSError as e:  # ELOOP: a symbolic link put there since the checks
            raise CheckpointError(f"{file} cannot be opened as the export's own file ({e})") from e
        f = open(fd, "rb")  # noqa: SIM115 - kept open for check(); closed with this object
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{file} is not a regular file (checked before: replaced)")
            if st.st_size != expected:
                raise CheckpointError(_wrong_size(file, st.st_size, expected))
            self.header, self.start = _check_table_file(file, t, opened=f)
            self.mapping = mmap.mmap(fd, expected, access=mmap.ACCESS_READ)
        except BaseException:
            f.close()
            raise
        self._opened, self._mtime = f, st.st_mtime_ns

    def arrays(self) -> dict[str, np.ndarray]:
        """The file's tensors: read-only views of the mapping."""
        out = {}
        for name, info in self.header.items():
            if name == "__metadata__":
                continue
            dtype = NUMPY[info["dtype"]].newbyteorder("<")
            lo, _ = info["data_offsets"]
            count = math.prod(info["shape"])
            a = np.frombuffer(self.mapping, dtype, count=count, offset=self.start + lo)
            out[name] = a.reshape(info["shape"])
        return out

    def check(self) -> None:
        """A CheckpointError if the file no longer has its size, or was written since it was
        mapped (before rows are read)."""
        st = os.fstat(self._opened.fileno())
        if st.st_size != self.expected:
            raise CheckpointError(
                _wrong_size(self.file, st.st_size, self.expected, " while served")
                + ", and load it again, from a new folder: a copy written over a served export "
                "truncates its files under the mapping, and a row read past the end kills the "
                "process (SIGBUS)"
            )
        if st.st_mtime_ns != self._mtime:
            raise CheckpointError(
                f"{self.file} was written while served (modified at {st.st_mtime_ns} ns, "
                f"mapped when modified at {self._mtime} ns): its rows are no longer the ones "
                "the manifest describes. Serve a new export from a new folder (ServingEngine."
                "load), never one copied over a served folder"
            )


class ServingEngine:
    """Lookup-only engine over an export: memory-mapped, read-only, thread-safe."""

    def __init__(self, path: Path, manifest: dict):
        """Map the tables of an export whose ``manifest`` read_serving_manifest checked (each
        file's size and header again, on the file mapped: ``_MappedFile``)."""
        self.path = path
        self._configs, self._resolved = _configs(path, manifest)
        self._tables = {}
        self._files: dict[str, _MappedFile] = {}
        for t in manifest["tables"]:
            mapped = _MappedFile(path / t["file"], t, manifest["files"][t["file"]]["bytes"])
            self._files[t["name"]] = mapped
            arrays = mapped.arrays()
            self._tables[t["name"]] = (arrays, t["compression"], t["params"], t["dim"])
        self._layout = _storage_layout(self._resolved)
        self._fingerprint = batch_fingerprint(self._resolved, self._layout)
        from .backends.numba_backend import NumbaBackend  # numba loads with a served engine

        self._backend = NumbaBackend()

    @classmethod
    def load(cls, path: str | Path, verify: bool = True) -> ServingEngine:
        path = Path(path)
        return cls(path, read_serving_manifest(path, verify))

    @property
    def table_names(self) -> tuple[str, ...]:
        return self._resolved.table_names

    def preprocess(self, features, weights=None) -> PreparedBatch:
        """Validate features into a lookup-only batch (no deduplication: serving updates
        nothing); errors name the feature, the position and the value."""
        return prepare(
            self._resolved,
            features,
            weights,
            storage_layout=self._layout,
            deduplicate=False,
            fingerprint=self._fingerprint,
        )

    def lookup(self, features, weights=None) -> dict[str, np.ndarray]:
        """Activations per feature, exactly as EmbeddingEngine.lookup computes them from the
        (decompressed) weights: the rows a batch reads are decoded, then pooled by the numba
        backend's lookup path (``lookup_rows``), with the training engine's sums and order."""
        if isinstance(features, PreparedBatch):
            if weights is not None:
                raise ValueError("weights must be given to preprocess(), not with a PreparedBatch")
            # A batch prepared for other tables would read rows past the end of these.
            check_prepared_for(features, self._fingerprint, self._resolved)
            batch = features
        else:
            batch = self.preprocess(features, weights)
        per_table = []
        for name, tb in zip(self._resolved.table_names, batch.tables, strict=True):
            self._files[name].check()  # a truncated file: an error, not a SIGBUS
            arrays, comp, params, dim = self._tables[name]
            rows, tb = _decoded_rows(arrays, comp, params, dim, tb)
            quant = self._configs[name].quantization_config
            per_table.append(self._backend.lookup_rows(rows, dim, tb, quant))
        return {
            name: per_table[lay.table][lay.start : lay.stop].reshape(lay.shape)
            for name, lay in batch.features.items()
        }


def _storage_layout(resolved: ResolvedFeatures) -> list[list[tuple[str, int]]]:
    """The storage layout (``batch.plan_tables``) of a served engine: one storage table per
    table, at row 0, and a keyed table's features at -1 (its rows are not its ids), as the
    training engine lays out an unpacked table (``StoragePlan.storage_layout``). So a batch the
    training engine prepared is served, and the engine looks up a served engine's batches
    (with -1 as 0, every batch of a keyed table was refused by the other as "prepared for
    another engine")."""
    return [
        [(f, -1 if resolved.tables[i].vocabulary_size is None else 0) for f in names]
        for i, names in enumerate(resolved.table_features)
    ]


def _decode_ids(
    arrays: Mapping[str, np.ndarray], compression: str, ids: np.ndarray, params: Mapping, dim: int
) -> tuple[np.ndarray, np.ndarray]:
    """(float32 rows, the row of each id in them): a dense table's rows by id; a keyed table's
    (``keys`` stored) by binary search in its sorted keys, -1 for a key it does not hold, which
    pools nothing, as in the engine (a zero row would be quantized like any other)."""
    keys = arrays.get("keys")
    if keys is None:
        return decode(arrays, compression, ids, params), np.arange(len(ids), dtype=np.int64)
    at = np.minimum(np.searchsorted(keys, ids), max(len(keys) - 1, 0))
    found = keys[at] == ids if len(keys) else np.zeros(len(ids), bool)
    where = np.full(len(ids), -1, dtype=np.int64)
    where[found] = np.arange(int(found.sum()), dtype=np.int64)
    if not found.any():
        return np.zeros((0, dim), np.float32), where
    return decode(arrays, compression, at[found], params), where


def _decoded_rows(
    arrays: Mapping[str, np.ndarray],
    compression: str,
    params: Mapping,
    dim: int,
    tb: TableBatch | LookupOnlyTableBatch,
):
    """(float32 rows, the batch with its ids renumbered into them): the decoded rows of every
    id the batch reads, so that only those are decompressed.

    A lookup-only batch gets one row per id, in order (row ``k`` of the table is the ``k``-th
    id of its features, so no deduplication); a deduplicated batch one per unique id."""
    if isinstance(tb, TableBatch):  # an export is keyed by logical id: one table per batch table
        rows, where = _decode_ids(arrays, compression, tb.unique_ids, params, dim)
        renumbered = dataclasses.replace(tb, unique_rows=where)
        return np.ascontiguousarray(rows, dtype=np.float32), renumbered
    ids = [p.ragged.ids for p in tb.parts]
    all_ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    rows, where = _decode_ids(arrays, compression, all_ids, params, dim)
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    parts, base = [], 0
    for p in tb.parts:
        r = p.ragged
        n = len(r.ids)
        local = Ragged(where[base : base + n], offsets=r.offsets, weights=r.weights)
        parts.append(dataclasses.replace(p, ragged=local, row_offset=0))
        base += n
    return rows, dataclasses.replace(tb, parts=tuple(parts))
