"""Serving: export a checkpoint's weights (no slots), compressed, and look up from the export.

Compressions and their error bounds on ``|served - trained|`` for a value ``x``:

- ``fp32``: float32, unchanged; 0.
- ``fp16``: IEEE half, round to nearest even; ``|x| * 2**-11`` (``2**-25`` near 0; |x| <= 65504).
- ``bf16``: bfloat16, the top 16 bits rounded to even; ``|x| * 2**-8``.
- ``fixed_r8``: int8 codes ``k``, value ``k * r / 128`` (Monolith's FixedR8Compressor,
  ``r = fixed_range``); ``r / 256`` for ``x`` in ``[-r, 127 r / 128]``, values outside clipped.
- ``int8_rowwise``: int8 codes with a float32 scale and bias per row,
  ``x = bias + scale * (k + 128)``; ``(max - min) / 255 / 2`` of the row.

An export is a folder: ``manifest.json`` (format, features, tables, each table's compression and
the SHA-256 of every file) and one safetensors file per table. ``ServingEngine.load`` memory-maps
it and looks features up with the same combiners, sequence lengths and output shapes as the
training engine; it is read-only and safe to call from many threads.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .batch import PreparedBatch, build_tables_numpy, prepare
from .checkpoint import CheckpointError, read_manifest
from .config import FeatureConfig, QuantizationConfig, TableConfig, resolve_features
from .kernels.lookup import PREFETCH_DISTANCE, pool_kernel
from .safetensors_io import read_header, read_tensor, sha256_file, write_safetensors

__all__ = ["COMPRESSIONS", "export", "ServingEngine", "ExportReport", "SERVING_FORMAT"]

SERVING_FORMAT = "embengine-serving"
SERVING_VERSION = 1
COMPRESSIONS = ("fp32", "fp16", "bf16", "fixed_r8", "int8_rowwise")
_ROWS_PER_CHUNK = 1 << 16


# -- codecs: float32 rows <-> stored arrays -------------------------------------------------------


def _to_bf16(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + 0x7FFF  # round to nearest, ties to even
    return ((bits + rounding) >> 16).astype(np.uint16)


def _from_bf16(b: np.ndarray) -> np.ndarray:
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


def decode(arrays: Mapping[str, np.ndarray], compression: str, rows: np.ndarray,
           params: Mapping) -> np.ndarray:  # fmt: skip
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
    """The per-value bound on |decode(encode(x)) - x| stated in the module docstring."""
    x = np.asarray(x, dtype=np.float64)
    if compression == "fp32":
        return np.zeros_like(x)
    if compression == "fp16":
        return np.maximum(np.abs(x) * 2.0**-11, 2.0**-25)
    if compression == "bf16":
        return np.abs(x) * 2.0**-8
    if compression == "fixed_r8":
        r = params["fixed_range"]
        return np.full_like(x, r / 256.0) + np.maximum(np.abs(np.clip(x, -r, r * 127 / 128) - x), 0)
    if compression == "int8_rowwise":
        span = x.max(axis=1, keepdims=True) - x.min(axis=1, keepdims=True)
        return np.broadcast_to(span / 255.0 / 2.0 * 1.0001 + 1e-7, x.shape)
    raise ValueError(f"unknown compression {compression!r}")


# -- export ---------------------------------------------------------------------------------------


@dataclass
class ExportReport:
    path: Path
    rows: list[dict]  # per table: name, compression, bytes before / after, max abs error

    def format(self) -> str:
        lines = [f"{'table':20s} {'compression':12s} {'fp32 MiB':>10s} {'export MiB':>10s} "
                 f"{'ratio':>6s} {'max abs error':>14s}"]  # fmt: skip
        for r in self.rows:
            before, after = r["bytes_before"], r["bytes_after"]
            lines.append(
                f"{r['table']:20s} {r['compression']:12s} {before / 2**20:10.2f} "
                f"{after / 2**20:10.2f} {before / max(1, after):6.2f} {r['max_abs_error']:14.3g}"
            )
        if self.rows:
            before = sum(r["bytes_before"] for r in self.rows)
            after = sum(r["bytes_after"] for r in self.rows)
            worst = max(r["max_abs_error"] for r in self.rows)
            lines.append(
                f"{'all tables':20s} {'':12s} {before / 2**20:10.2f} {after / 2**20:10.2f} "
                f"{before / max(1, after):6.2f} {worst:14.3g}"
            )
        return "\n".join(lines)


def _encode_table(weights: np.ndarray, compression: str, params: Mapping):
    """(arrays to store, max abs error), chunk by chunk over rows."""
    vocab, dim = weights.shape
    if compression == "fp32":
        return {"weights": weights}, 0.0
    out: dict[str, np.ndarray] = {}
    if compression in ("fp16", "bf16", "fixed_r8", "int8_rowwise"):
        dtype = {"fp16": np.float16, "bf16": np.uint16, "fixed_r8": np.int8,
                 "int8_rowwise": np.int8}[compression]  # fmt: skip
        out["weights"] = np.empty((vocab, dim), dtype=dtype)
    if compression == "int8_rowwise":
        out["scale"] = np.empty(vocab, dtype=np.float32)
        out["bias"] = np.empty(vocab, dtype=np.float32)
    worst = 0.0
    for lo in range(0, vocab, _ROWS_PER_CHUNK):
        hi = min(vocab, lo + _ROWS_PER_CHUNK)
        x = np.asarray(weights[lo:hi], dtype=np.float32)
        if compression == "fp16":
            out["weights"][lo:hi] = x.astype(np.float16)
        elif compression == "bf16":
            out["weights"][lo:hi] = _to_bf16(x)
        elif compression == "fixed_r8":
            out["weights"][lo:hi] = _fixed_r8(x, params["fixed_range"])
        else:
            out["weights"][lo:hi], out["scale"][lo:hi], out["bias"][lo:hi] = _rowwise(x)
        back = decode(out, compression, np.arange(lo, hi), params) if hi > lo else x
        if x.size:
            worst = max(worst, float(np.abs(back.astype(np.float64) - x).max()))
    return out, worst


def export(checkpoint: str | Path, out: str | Path, compress: str = "fp32",
           per_table: Mapping[str, str] | None = None,
           fixed_range: float = 1.0) -> ExportReport:  # fmt: skip
    """Write the weights of a checkpoint (no slots) to ``out``, each table compressed with
    ``per_table.get(name, compress)``. The folder is written beside and renamed into place."""
    ckpt, manifest = read_manifest(checkpoint, verify=True)
    per_table = dict(per_table or {})
    names = [t["name"] for t in manifest["tables"]]
    unknown = [n for n in per_table if n not in names]
    if unknown:
        raise ValueError(f"per-table compression for unknown tables {unknown}; tables are {names}")
    for name, c in [("default", compress), *per_table.items()]:
        if c not in COMPRESSIONS:
            raise ValueError(f"compression for {name} must be one of {COMPRESSIONS}, got {c!r}")
    if not fixed_range > 0:
        raise ValueError(f"fixed_range must be > 0, got {fixed_range}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    tables, files, rows = [], {}, []
    for i, t in enumerate(manifest["tables"]):
        comp = per_table.get(t["name"], compress)
        src = ckpt / t["file"]
        header = read_header(src)
        weights = read_tensor(src, t["name"], header=header)  # memory-mapped
        params = {"fixed_range": fixed_range} if comp == "fixed_r8" else {}
        arrays, worst = _encode_table(weights, comp, params)
        file = f"table-{i:03d}.safetensors"
        files[file] = {"sha256": write_safetensors(tmp / file, arrays)}
        files[file]["bytes"] = (tmp / file).stat().st_size
        tables.append({"name": t["name"], "vocabulary_size": t["vocabulary_size"], "dim": t["dim"],
                       "combiner": t["combiner"], "compression": comp, "params": params,
                       "quantization_config": t.get("quantization_config"),
                       "file": file})  # fmt: skip
        rows.append({"table": t["name"], "compression": comp, "bytes_before": weights.nbytes,
                     "bytes_after": sum(a.nbytes for a in arrays.values()),
                     "max_abs_error": worst})  # fmt: skip
    manifest_out = {"format": SERVING_FORMAT, "format_version": SERVING_VERSION,
                    "source_step": manifest["step"], "features": manifest["features"],
                    "tables": tables, "files": files}  # fmt: skip
    with open(tmp / "manifest.json", "w") as f:
        json.dump(manifest_out, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    if out.exists():
        old = out.parent / f".old-{out.name}-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)
    return ExportReport(out, rows)


def read_serving_manifest(path: str | Path, verify: bool = True) -> dict:
    path = Path(path)
    file = path / "manifest.json"
    if not file.is_file():
        raise CheckpointError(f"{path}: no manifest.json (not an embengine export)")
    manifest = json.loads(file.read_text())
    fmt, version = manifest.get("format"), manifest.get("format_version")
    if fmt != SERVING_FORMAT:
        raise CheckpointError(f"{path}: not an embengine export (format {fmt!r})")
    if version != SERVING_VERSION:
        raise CheckpointError(
            f"{path}: export format version {version!r} is not supported (this embengine "
            f"reads {SERVING_VERSION})"
        )
    for name, info in manifest["files"].items():
        if not name.endswith(".safetensors") or "/" in name:
            raise CheckpointError(f"{path}: manifest lists {name!r}; only safetensors are read")
        if verify:
            f = path / name
            if not f.is_file() or f.stat().st_size != info["bytes"]:
                raise CheckpointError(f"{f} is missing or truncated")
            if sha256_file(f) != info["sha256"]:
                raise CheckpointError(f"checksum mismatch in {f}: the file was modified")
    return manifest


# -- lookup ---------------------------------------------------------------------------------------


class ServingEngine:
    """Lookup-only engine over an export: memory-mapped, read-only, thread-safe."""

    def __init__(self, path: Path, manifest: dict):
        self.path = path
        self._tables = {}
        configs = {}
        for t in manifest["tables"]:
            file = path / t["file"]
            header = read_header(file)
            arrays = {name: read_tensor(file, name, header=header)
                      for name in header[0] if name != "__metadata__"}  # fmt: skip
            self._tables[t["name"]] = (arrays, t["compression"], t["params"], t["dim"])
            q = t.get("quantization_config")
            configs[t["name"]] = TableConfig(
                t["vocabulary_size"], t["dim"], combiner=t["combiner"], name=t["name"],
                quantization_config=None if q is None else QuantizationConfig(**q),
            )  # fmt: skip
        features = {
            f["name"]: FeatureConfig(
                configs[f["table"]], f["max_sequence_length"], f["validate_weights_and_indices"],
                None if f["output_shape"] is None else tuple(f["output_shape"]),
            )
            for f in manifest["features"]
        }  # fmt: skip
        self._resolved = resolve_features(features)
        self._configs = configs

    @classmethod
    def load(cls, path: str | Path, verify: bool = True) -> ServingEngine:
        path = Path(path)
        return cls(path, read_serving_manifest(path, verify))

    @property
    def table_names(self) -> tuple[str, ...]:
        return self._resolved.table_names

    def preprocess(self, features, weights=None) -> PreparedBatch:
        return prepare(self._resolved, features, weights, build_tables_numpy)

    def lookup(self, features, weights=None) -> dict[str, np.ndarray]:
        """Activations per feature, exactly as EmbeddingEngine.lookup computes them from the
        (decompressed) weights."""
        batch = (
            features if isinstance(features, PreparedBatch) else self.preprocess(features, weights)
        )
        per_table = []
        for name, tb in zip(self._resolved.table_names, batch.tables, strict=True):
            arrays, comp, params, dim = self._tables[name]
            compact = np.ascontiguousarray(decode(arrays, comp, tb.unique_ids, params))
            quant = self._configs[name].quantization_config
            q = (np.zeros(3) if quant is None else
                 np.array([quant.num_buckets, quant.lower, quant.upper], np.float64))  # fmt: skip
            out = np.empty((tb.num_outputs, dim), dtype=np.float32)
            rows = np.arange(len(tb.unique_ids), dtype=np.int64)
            pool = pool_kernel(dim)
            pool(compact.reshape(len(rows), dim), dim, rows, tb.inverse, tb.gains,
                 tb.output_offsets, out, q, PREFETCH_DISTANCE)  # fmt: skip
            per_table.append(out)
        return {
            name: per_table[lay.table][lay.start : lay.stop].reshape(lay.shape)
            for name, lay in batch.features.items()
        }
