"""``embengine inspect``: what a checkpoint or an export holds, with its checksums verified."""

from __future__ import annotations

import json
from pathlib import Path

from .checkpoint import FORMAT, manifest_held, read_own_file
from .safetensors_io import read_header
from .serving import SERVING_FORMAT, read_serving_manifest

__all__ = ["describe"]


def _format_of(path: Path) -> str:
    """The format a folder's manifest names; a folder of checkpoints, or a manifest that is not
    a JSON object, goes to read_manifest, which picks the newest or says what is wrong."""
    manifest = path / "manifest.json"
    if manifest.is_file():
        try:
            data = json.loads(read_own_file(manifest))
        except (ValueError, RecursionError):  # CheckpointError: read_manifest says it again
            return FORMAT
        return data.get("format", FORMAT) if isinstance(data, dict) else FORMAT
    return FORMAT


def _tensors(file: Path) -> list[str]:
    header, _ = read_header(file)
    return [
        f"    {name:36s} {info['dtype']:5s} {info['shape']}"
        for name, info in header.items()
        if name != "__metadata__"
    ]


def _keyed_stats(keyed: dict) -> str:
    """A keyed table's rows, pending keys and stats totals, as its manifest records them."""
    out = f"{keyed['rows']} keys"
    if "pending_keys" in keyed:
        out += f" ({keyed['pending_keys']} pending admission"
        total = keyed.get("total") or {}
        out += "".join(f", {k} {v}" for k, v in total.items() if k not in ("lookups", "hits"))
        if total.get("lookups"):
            out += f", hit rate {total.get('hits', 0) / total['lookups']:.3f}"
        out += ")"
    return out


def describe(path: str | Path, verify: bool = True) -> str:
    """What the checkpoint (or folder of checkpoints: the newest) or export at ``path`` holds,
    after every check of its loader (``verify``: with the hashes). A checkpoint stays locked
    (shared) until its table headers are read again: a save's keep=N pruned it in between,
    and the header read was a bare FileNotFoundError."""
    path = Path(path)
    if _format_of(path) == SERVING_FORMAT:
        manifest = read_serving_manifest(path, verify)
        head = [f"export {path} (from step {manifest['source_step']})"]
        return _describe(path, manifest, head, verify)
    with manifest_held(path, verify) as (root, manifest):
        lines = [
            f"checkpoint {root}: step {manifest['step']}, seed {manifest['seed']}, "
            f"written by embengine {manifest['embengine_version']}"
        ]
        bad = [t["name"] for t in manifest["tables"] if t.get("finite") is False]
        if bad:
            lines.append(
                f"NaN or Inf in tables {bad} when written (keep=N keeps the newest "
                "finite checkpoint besides this one)"
            )
        return _describe(root, manifest, lines, verify)


def _describe(root: Path, manifest: dict, lines: list[str], verify: bool) -> str:
    """``describe``'s text: ``lines`` (what the folder is), then files, tables with their
    tensors (headers read from ``root``) and features."""
    total = sum(f["bytes"] for f in manifest["files"].values())
    lines.append(
        f"{len(manifest['files'])} files, {total / 2**20:.2f} MiB, checksums "
        + ("verified" if verify else "not checked")
    )
    for t in manifest["tables"]:
        if t["vocabulary_size"] is None:  # keyed: its rows are its keys
            head = f"table {t['name']!r}: keyed, {_keyed_stats(t['keyed'])} x {t['dim']}"
        else:
            head = f"table {t['name']!r}: {t['vocabulary_size']} x {t['dim']}"
        head += f", combiner {t['combiner']}"
        if "optimizer" in t:
            opt = t["optimizer"]
            params = ", ".join(f"{k}={v}" for k, v in opt["params"].items() if v not in (None,))
            head += f", {opt['class']}({params}), storage {t['storage']}"
        else:
            head += f", compression {t['compression']}"
        lines.append(head)
        lines.extend(_tensors(root / t["file"]))
    lines.append(
        "features: "
        + ", ".join(
            f"{f['name']} -> {f['table']}"
            + (f" (sequence {f['max_sequence_length']})" if f["max_sequence_length"] else "")
            for f in manifest["features"]
        )
    )
    return "\n".join(lines)
