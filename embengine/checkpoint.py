"""Checkpoints: self-describing, atomic, checksummed directories of safetensors files.

Layout of ``engine.save(root)``::

    root/ckpt-000007-step000000001000/  the 7th checkpoint written under root, at step 1000
        manifest.json                   format, version, seed, step, every table / feature /
                                        optimizer (hyperparameters), learning-rate tags, and the
                                        SHA-256 and size of every file
        manifest.sha256                 the SHA-256 of manifest.json
        table-000.safetensors           "{table}" (weights) and "{table}/{slot}" per slot, under
        table-001.safetensors           TF's slot names
        extra.safetensors               optional caller tensors (e.g. the dense model)

A save writes into ``root/.tmp-*``, fsyncs every file and the directory, then renames it into
place (atomic), so the newest complete checkpoint is always readable, even if the process is
killed mid-save; only then are the oldest checkpoints beyond ``keep`` (in the order they were
written) renamed away and deleted. Loading verifies the format, version, every checksum and
every tensor's name, dtype and shape before touching an engine, and never unpickles anything.
Tables are written and read in chunks of rows, so memory stays bounded for tables larger than
RAM.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import initializers as _init
from . import optimizers as _opt
from .config import FeatureConfig, QuantizationConfig, TableConfig
from .safetensors_io import read_header, read_tensor, sha256_file, write_safetensors

if TYPE_CHECKING:
    from .engine import EmbeddingEngine

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointInfo",
    "save",
    "restore",
    "load",
    "latest_checkpoint",
    "read_manifest",
]

FORMAT = "embengine-checkpoint"
FORMAT_VERSION = 1
_NAME = re.compile(r"^ckpt-(\d{6})-step(\d{12})$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, corrupt, foreign or incompatible."""


@dataclass
class CheckpointInfo:
    path: Path
    step: int
    extra_tensors: dict[str, np.ndarray]
    extra_metadata: dict


# -- specs <-> JSON ------------------------------------------------------------------------------


def _spec_class(obj, module) -> type:
    """The nearest class of ``obj`` defined in ``module`` (so embengine.tpu.Adam -> Adam)."""
    for cls in type(obj).__mro__:
        if cls.__module__.startswith(module.__name__) and dataclasses.is_dataclass(cls):
            return cls
    raise CheckpointError(f"{type(obj).__name__} is not an embengine spec")


def _jsonable(value):
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, np.generic):
        return value.item()
    return value


def optimizer_to_json(opt: _opt.Optimizer, tag: int | None) -> dict:
    cls = _spec_class(opt, _opt)
    params = {}
    for f in dataclasses.fields(cls):
        value = getattr(opt, f.name)
        if f.name == "learning_rate":
            if isinstance(value, _opt.DynamicLearningRate):
                value = {"tag": value.tag}
            elif callable(value):
                value = {"tag": tag, "callable": getattr(value, "__qualname__", repr(value))}
            else:
                value = {"constant": float(value)}
        params[f.name] = _jsonable(value)
    return {"class": cls.__name__, "params": params}


def optimizer_from_json(data: dict, callables: Mapping[int, Callable]) -> _opt.Optimizer:
    cls = getattr(_opt, data["class"], None)
    if not (isinstance(cls, type) and issubclass(cls, _opt.Optimizer)):
        raise CheckpointError(f"unknown optimizer class {data['class']!r}")
    params = dict(data["params"])
    lr = params["learning_rate"]
    if "constant" in lr:
        params["learning_rate"] = lr["constant"]
    elif "callable" in lr:
        tag = lr["tag"]
        if tag not in callables:
            raise CheckpointError(
                f"the checkpoint's learning rate of tag {tag} was the callable "
                f"{lr['callable']!r}; pass callables={{{tag}: <function>}} to load it"
            )
        params["learning_rate"] = callables[tag]
    else:
        params["learning_rate"] = _opt.DynamicLearningRate(lr["tag"])
    if isinstance(params.get("clipvalue"), list):
        params["clipvalue"] = tuple(params["clipvalue"])
    return cls(**params)


def initializer_to_json(init: _init.Initializer) -> dict:
    cls = _spec_class(init, _init)
    if cls is _init.FromFunction:
        return {"class": "FromFunction", "function": getattr(init.fn, "__qualname__", "?")}
    return {"class": cls.__name__, "params": dataclasses.asdict(init)}


def initializer_from_json(data: dict) -> _init.Initializer:
    if data["class"] == "FromFunction":
        return _init.Zeros()  # values come from the checkpoint; the function is not stored
    cls = getattr(_init, data["class"], None)
    if not (isinstance(cls, type) and issubclass(cls, _init.Initializer)):
        raise CheckpointError(f"unknown initializer class {data['class']!r}")
    return cls(**data.get("params", {}))


def engine_spec(engine: EmbeddingEngine) -> dict:
    """Everything needed to rebuild the engine's configuration, as JSON."""
    from .engine import _initializer_for

    tables = []
    for i, (name, cfg) in enumerate(engine.table_configs.items()):
        opt = engine.optimizer(name)
        table = engine._tables[i]
        q = cfg.quantization_config
        tables.append({
            "name": name,
            "vocabulary_size": cfg.vocabulary_size,
            "dim": cfg.dim,
            "combiner": cfg.combiner,
            "initializer": initializer_to_json(_initializer_for(cfg, opt)),
            "optimizer": optimizer_to_json(opt, engine.learning_rate_tag(name)),
            "quantization_config": None if q is None else dataclasses.asdict(q),
            "storage": table.storage,
            "slots": [dataclasses.asdict(s) for s in table.slot_specs],
            "file": f"table-{i:03d}.safetensors",
        })  # fmt: skip
    features = [
        {"name": name, "table": engine.table_names[engine._resolved.feature_table[name]],
         "max_sequence_length": fc.max_sequence_length,
         "validate_weights_and_indices": fc.validate_weights_and_indices,
         "output_shape": None if fc.output_shape is None else list(fc.output_shape)}
        for name, fc in engine.feature_config.items()
    ]  # fmt: skip
    tags = [
        {"tag": t, "callable": (lambda c: None if c is None else getattr(c, "__qualname__", "?"))(
            engine._learning_rates.tag_callable(t))}
        for t in range(engine.num_learning_rate_tags)
    ]  # fmt: skip
    return {"tables": tables, "features": features, "learning_rate_tags": tags,
            "seed": engine.seed, "backend": engine.backend,
            "nonfinite_gradients": engine.nonfinite_gradients}  # fmt: skip


# -- saving ---------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, in the order they were written (a folder renamed
    into place is complete; one without manifest was being deleted)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / "manifest.json").is_file()]
    return sorted(found, key=lambda p: p.name)


def _discard(path: Path) -> None:
    """Delete a folder so that a kill midway never leaves a half-deleted checkpoint behind
    under a checkpoint's name: rename it away first."""
    trash = path.parent / f".trash-{path.name}-{uuid.uuid4().hex[:8]}"
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def latest_checkpoint(root: str | Path) -> Path | None:
    done = list_checkpoints(Path(root))
    return done[-1] if done else None


def save(engine: EmbeddingEngine, root: str | Path, keep: int | None = None,
         extra_tensors: Mapping[str, np.ndarray] | None = None,
         extra_metadata: Mapping[str, Any] | None = None) -> Path:  # fmt: skip
    """Write a new checkpoint of ``engine`` under ``root``; see the module docstring."""
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be an int >= 1 or None, got {keep!r}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    # Leftovers of killed saves and deletions (a complete checkpoint always has its manifest).
    for stale in [*root.glob(".tmp-*"), *root.glob(".trash-*")]:
        shutil.rmtree(stale, ignore_errors=True)
    for p in root.iterdir():
        if _NAME.match(p.name) and not (p / "manifest.json").is_file():
            _discard(p)
    step = engine.step
    seqs = [int(_NAME.match(p.name)[1]) for p in root.iterdir() if _NAME.match(p.name)]
    final = root / f"ckpt-{max(seqs, default=0) + 1:06d}-step{step:012d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    spec = engine_spec(engine)
    files = {}
    for table, entry in zip(engine._tables, spec["tables"], strict=True):
        tensors = {table.name: table.weights}
        tensors.update({f"{table.name}/{n}": a for n, a in table.slots.items()})
        with table.sequential_access():
            digest = write_safetensors(tmp / entry["file"], tensors, {"table": table.name})
        files[entry["file"]] = {"sha256": digest, "bytes": (tmp / entry["file"]).stat().st_size}
    extra = {"file": None, "metadata": dict(extra_metadata or {})}
    if extra_tensors:
        digest = write_safetensors(tmp / "extra.safetensors", dict(extra_tensors))
        size = (tmp / "extra.safetensors").stat().st_size
        files["extra.safetensors"] = {"sha256": digest, "bytes": size}
        extra["file"] = "extra.safetensors"
    from . import __version__

    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION,
                "embengine_version": __version__,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "step": step, **spec, "extra": extra, "files": files}  # fmt: skip
    text = json.dumps(manifest, indent=1, default=_json_default).encode()
    for name, data in (("manifest.json", text),
                       ("manifest.sha256", hashlib.sha256(text).hexdigest().encode())):  # fmt: skip
        with open(tmp / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    _fsync_dir(tmp)
    os.rename(tmp, final)  # the commit point
    _fsync_dir(root)
    if keep is not None:
        for old in list_checkpoints(root)[:-keep]:
            _discard(old)
    return final


def _json_default(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    raise TypeError(f"extra_metadata holds {type(value).__name__}, which is not JSON")


# -- loading --------------------------------------------------------------------------------------


def _resolve(path: str | Path) -> Path:
    path = Path(path)
    if (path / "manifest.json").is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"no complete checkpoint at {path}")
    return latest


def read_manifest(path: str | Path, verify: bool = True) -> tuple[Path, dict]:
    """(checkpoint directory, manifest) after checking format, version and, with ``verify``,
    every file's size and SHA-256."""
    ckpt = _resolve(path)
    raw = (ckpt / "manifest.json").read_bytes()
    try:
        manifest = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{ckpt / 'manifest.json'} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        fmt = manifest.get("format") if isinstance(manifest, dict) else None
        raise CheckpointError(
            f"{ckpt}: not an embengine checkpoint (format {fmt!r}); embengine never loads "
            "pickled or foreign formats"
        )
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{ckpt}: format version {manifest.get('format_version')!r} is not supported "
            f"(this embengine reads version {FORMAT_VERSION})"
        )
    files = manifest.get("files", {})
    for name in files:
        if not name.endswith(".safetensors") or "/" in name or name.startswith("."):
            raise CheckpointError(
                f"{ckpt}: manifest lists {name!r}; only safetensors files are loaded, never pickle"
            )
    digest_file = ckpt / "manifest.sha256"
    if verify and (
        not digest_file.is_file()
        or digest_file.read_text().strip() != hashlib.sha256(raw).hexdigest()
    ):
        raise CheckpointError(
            f"checksum mismatch in {ckpt / 'manifest.json'}: the manifest was modified (or "
            "manifest.sha256 is missing)"
        )
    if verify:
        for name, info in files.items():
            file = ckpt / name
            if not file.is_file():
                raise CheckpointError(f"{file} is missing")
            if file.stat().st_size != info["bytes"]:
                raise CheckpointError(
                    f"{file} has {file.stat().st_size} bytes, the manifest says {info['bytes']} "
                    "(truncated or replaced)"
                )
            if sha256_file(file) != info["sha256"]:
                raise CheckpointError(f"checksum mismatch in {file}: the file was modified")
        _check_tensors(ckpt, manifest)
    return ckpt, manifest


def _check_tensors(ckpt: Path, manifest: dict) -> None:
    """Every table file holds the weights and slots the manifest describes (names, dtypes,
    shapes), so a restore cannot fail halfway through."""
    dtypes = {"float32": "F32", "int32": "I32"}
    for t in manifest["tables"]:
        file = ckpt / t["file"]
        expected = {t["name"]: ("F32", [t["vocabulary_size"], t["dim"]])}
        for slot in t["slots"]:
            expected[f"{t['name']}/{slot['name']}"] = (
                dtypes.get(slot["dtype"], "?"), [t["vocabulary_size"], slot["width"]]
            )  # fmt: skip
        try:
            header, _ = read_header(file)
            for name, (dtype, shape) in expected.items():
                info = header.get(name)
                if not isinstance(info, dict):
                    raise ValueError(f"no tensor {name!r}")
                if info.get("dtype") != dtype or list(info.get("shape", ())) != shape:
                    raise ValueError(
                        f"tensor {name!r} has dtype {info.get('dtype')} and shape "
                        f"{info.get('shape')}, expected {dtype} and shape {shape}"
                    )
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{file}: {e}") from None


def _check_name(ckpt: Path, manifest: dict) -> None:
    match = _NAME.match(ckpt.name)
    if match and int(match[2]) != manifest.get("step"):
        raise CheckpointError(
            f"{ckpt}: the manifest says step {manifest.get('step')!r} but the checkpoint was "
            f"written at step {int(match[2])}"
        )


def _check_compatible(engine: EmbeddingEngine, manifest: dict, ckpt: Path) -> None:
    stored = {t["name"]: t for t in manifest["tables"]}
    mine = engine_spec(engine)["tables"]
    names = sorted(t["name"] for t in mine)
    if sorted(stored) != names:
        raise CheckpointError(f"{ckpt} holds tables {sorted(stored)}, the engine has {names}")
    for t in mine:
        s = stored[t["name"]]
        if (s["vocabulary_size"], s["dim"]) != (t["vocabulary_size"], t["dim"]):
            raise CheckpointError(
                f"table {t['name']!r}: checkpoint shape ({s['vocabulary_size']}, {s['dim']}) "
                f"differs from the engine's ({t['vocabulary_size']}, {t['dim']})"
            )
        # The learning rate may be a callable, and packing is a storage hint: neither changes
        # what the stored slots mean.
        free = ("learning_rate", "low_dimensional_packing_status")
        a, b = dict(s["optimizer"]), dict(t["optimizer"])
        a["params"] = {k: v for k, v in a["params"].items() if k not in free}
        b["params"] = {k: v for k, v in b["params"].items() if k not in free}
        if a != b or s["slots"] != t["slots"]:
            raise CheckpointError(
                f"table {t['name']!r}: checkpoint optimizer {s['optimizer']['class']} "
                f"{a['params']} differs from the engine's {b['params']}"
            )


def restore(engine: EmbeddingEngine, path: str | Path, verify: bool = True) -> CheckpointInfo:
    """Load tables, slots and step into an engine built from the same configs."""
    ckpt, manifest = read_manifest(path, verify)
    _check_name(ckpt, manifest)
    _check_compatible(engine, manifest, ckpt)
    by_name = {t["name"]: t for t in manifest["tables"]}
    for table in engine._tables:
        file = ckpt / by_name[table.name]["file"]
        header = read_header(file)
        with table.sequential_access():
            read_tensor(file, table.name, out=table.weights, header=header)
            for slot, array in table.slots.items():
                read_tensor(file, f"{table.name}/{slot}", out=array, header=header)
            table.flush()
    engine._step = int(manifest["step"])
    engine._last_batch = None
    extra = manifest.get("extra") or {}
    tensors = {}
    if extra.get("file"):
        file = ckpt / extra["file"]
        header = read_header(file)
        tensors = {name: np.array(read_tensor(file, name, header=header))
                   for name in header[0] if name != "__metadata__"}  # fmt: skip
    return CheckpointInfo(ckpt, engine._step, tensors, extra.get("metadata", {}))


def load(path: str | Path, callables: Mapping[int, Callable] | None = None,
         verify: bool = True, **engine_kwargs) -> EmbeddingEngine:  # fmt: skip
    """A new engine from a checkpoint alone (see EmbeddingEngine.load)."""
    from .engine import EmbeddingEngine

    ckpt, manifest = read_manifest(path, verify)
    callables = dict(callables or {})
    tables = {}
    for t in manifest["tables"]:
        q = t.get("quantization_config")
        tables[t["name"]] = TableConfig(
            t["vocabulary_size"], t["dim"],
            initializer=initializer_from_json(t["initializer"]),
            optimizer=optimizer_from_json(t["optimizer"], callables),
            combiner=t["combiner"], name=t["name"],
            quantization_config=None if q is None else QuantizationConfig(**q),
        )  # fmt: skip
    features = {
        f["name"]: FeatureConfig(
            tables[f["table"]], f["max_sequence_length"], f["validate_weights_and_indices"],
            None if f["output_shape"] is None else tuple(f["output_shape"]),
        )
        for f in manifest["features"]
    }  # fmt: skip
    kwargs = {"seed": manifest["seed"], "backend": manifest.get("backend", "numba"),
              "nonfinite_gradients": manifest.get("nonfinite_gradients", "error")}  # fmt: skip
    kwargs.update(engine_kwargs)
    engine = EmbeddingEngine(features, **kwargs)
    restore(engine, ckpt, verify=False)
    return engine
