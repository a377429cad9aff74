"""Crafted checkpoints and exports: a real one, damaged or edited, then loaded.

``make_base(workdir)`` saves a checkpoint of the "mixed" engine after two training steps (with
extra tensors and metadata), a second one after three steps ("outside": real files with other
values, for path traversal to point at) and an fp32 export of each. ``tasks(base, seed)`` lists
(mutation, operation) pairs; a child process (``runner``, kind "ckpt") copies the base, applies
the mutation and runs the operation:

- ``load``: ``EmbeddingEngine.load(path)``;
- ``restore``: ``engine.restore(path)`` into a fresh engine of the same configs;
- ``export``: ``serving.export(path, out)``, then the export looked up;
- ``serve``: ``ServingEngine.load(export)`` and a lookup of every row.

Mutation groups:

- ``accidental``: what disks and copies do (truncation, flipped bits in headers, data and
  manifests, deleted or appended files), checksums left as they were;
- ``crafted``: deliberate edits with every checksum recomputed (``files`` entries and
  ``manifest.sha256``), so only structural checks can catch them: manifest keys deleted or of the
  wrong type, path traversal (relative, absolute, unlisted files), huge declared shapes (a memory
  bomb), tensors with short data, missing tensors or other dtypes;
- ``control``: harmless edits (indentation, an unknown key): must load, unchanged.

Outcomes (``OUTCOMES``): ``refused`` (CheckpointError and nothing changed), ``other_exception``
(any other exception), ``accepted_same`` (loaded, equal to the original), ``accepted_wrong``
(loaded, differs: other values, configs or step), ``partial`` (a failed restore that changed
the engine), and the runner's ``crash`` / ``hang``. Every result also carries the seconds and the
peak memory growth (MiB) of the operation, so a refusal after a big allocation shows.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import resource
import shutil
import struct
import tempfile
import traceback
from pathlib import Path

import numpy as np

OUTCOMES = (
    "refused",
    "other_exception",
    "accepted_same",
    "accepted_wrong",
    "partial",
    "crash",
    "hang",
    "harness_error",
)
TABLE_FILES = ("table-000.safetensors", "table-001.safetensors", "table-002.safetensors")
OPS = {"ckpt": ("load", "restore", "export"), "export": ("serve",)}
HUGE_ROWS = 200_000_000


# -- the base ----------------------------------------------------------------------------------


def _train(engine, steps: int) -> None:
    rng = np.random.default_rng(steps)
    for _ in range(steps):
        feats = {
            "user": [list(rng.integers(0, 10, 2)), [3]],
            "item": [[1, 2], list(rng.integers(0, 8, 3))],
            "hist": [[1, 2, 3, 4], [5]],
            "cat": [[0], list(rng.integers(0, 6, 2))],
        }
        acts = engine.lookup(feats)
        engine.apply_gradients({k: np.full_like(v, 0.5) for k, v in acts.items()})


def make_base(workdir: Path) -> dict:
    """The real checkpoints and exports every mutation starts from (paths as strings)."""
    from embengine import serving

    from .configs import build_engine

    out = {}
    for name, steps in (("base", 2), ("outside", 3)):
        engine = build_engine("mixed", "reference")
        _train(engine, steps)
        ckpt = engine.save(
            workdir / name,
            extra_tensors={"dense/w": np.arange(6, dtype=np.float32).reshape(2, 3) * steps},
            extra_metadata={"epoch": steps},
        )
        serving.export(ckpt, workdir / f"{name}-export", "fp32")
        out[name] = str(ckpt)
        out[f"{name}_export"] = str(workdir / f"{name}-export")
    return out


# -- safetensors and manifest editing -----------------------------------------------------------


def read_st(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_st(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def fix_checksums(folder: Path) -> None:
    """Recompute every ``files`` entry of the manifest that names an existing file inside the
    folder, then ``manifest.sha256`` (if the format has one): what a deliberate editor does."""
    mpath = folder / "manifest.json"
    manifest = json.loads(mpath.read_text())
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if isinstance(files, dict):
        for name, info in files.items():
            f = folder / name
            if isinstance(info, dict) and "/" not in name and f.is_file():
                info["sha256"] = hashlib.sha256(f.read_bytes()).hexdigest()
                info["bytes"] = f.stat().st_size
    text = json.dumps(manifest, indent=1).encode()
    mpath.write_bytes(text)
    if (folder / "manifest.sha256").exists() or manifest.get("format") == "embengine-checkpoint":
        (folder / "manifest.sha256").write_bytes(hashlib.sha256(text).hexdigest().encode())


def _edit_manifest(folder: Path, fn) -> None:
    mpath = folder / "manifest.json"
    manifest = json.loads(mpath.read_text())
    fn(manifest)
    mpath.write_text(json.dumps(manifest, indent=1))


def _set(obj, keys: list, value) -> None:
    for k in keys[:-1]:
        obj = obj[k]
    if value == "<delete>":
        del obj[keys[-1]]
    else:
        obj[keys[-1]] = value


# -- mutations -----------------------------------------------------------------------------------


def apply_mutation(folder: Path, m: dict, base: dict) -> None:
    """Apply mutation ``m`` to the copy ``folder`` (a checkpoint or an export)."""
    kind = m["kind"]
    file = folder / m.get("file", "manifest.json")
    if kind == "truncate":
        raw = file.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8]) if len(raw) >= 8 else (0,)
        size = {
            "zero": 0,
            "short": 7,
            "mid_header": 8 + n // 2,
            "data_start": 8 + n,
            "one_byte": 8 + n + 1,
            "minus_one": len(raw) - 1,
        }[m["at"]]
        file.write_bytes(raw[: max(0, min(size, len(raw) - 1))])
    elif kind == "flip":
        raw = bytearray(file.read_bytes())
        (n,) = struct.unpack("<Q", raw[:8]) if file.suffix == ".safetensors" else (len(raw),)
        lo, hi = {
            "length": (0, 8),
            "header": (8, 8 + n),
            "data": (8 + n, len(raw)),
            "any": (0, len(raw)),
        }[m["region"]]
        if hi > lo:
            pos = lo + m["pos"] % (hi - lo)
            raw[pos] ^= 1 << m["bit"]
        file.write_bytes(bytes(raw))
    elif kind == "delete":
        file.unlink()
    elif kind == "append":
        with open(file, "ab") as f:
            f.write(b"\x00garbage" * 3)
    elif kind == "replace":
        file.write_bytes(m["content"].encode())
    elif kind == "manifest":
        _edit_manifest(folder, lambda man: _set(man, m["keys"], m["value"]))
    elif kind == "traversal":
        src = Path(base[m["source"]]) / m["source_file"]
        if m["how"] == "relative":
            name = os.path.relpath(src, folder)  # "../../../.../outside/ckpt-.../table-000..."
        elif m["how"] == "absolute":
            name = str(src)
        elif m["how"] == "subdir":
            (folder / "sub").mkdir()
            shutil.copy(src, folder / "sub" / "x.safetensors")
            name = "sub/x.safetensors"
        else:  # "unlisted": a plain name the manifest's files do not list, so never hashed
            shutil.copy(src, folder / "other.safetensors")
            name = "other.safetensors"
        _edit_manifest(folder, lambda man: _set(man, m["keys"], name))
    elif kind == "header":
        header, data = read_st(file)
        name = m.get("tensor") or next(k for k in header if k != "__metadata__")
        info = header[name]
        if m["edit"] == "dtype_f16":
            info["dtype"] = "F16"
            lo, hi = info["data_offsets"]
            info["data_offsets"] = [lo, lo + (hi - lo) // 2]
        elif m["edit"] == "short_data":
            lo, hi = info["data_offsets"]
            info["data_offsets"] = [lo, hi - 4]
        elif m["edit"] == "drop_tensor":
            del header[name]
        elif m["edit"] == "shape":
            info["shape"] = [info["shape"][0] + 1, *info["shape"][1:]]
        elif m["edit"] == "offsets_past_end":
            info["data_offsets"] = [0, len(data) + 64]
        elif m["edit"] == "overlap":
            lo, hi = info["data_offsets"]
            info["data_offsets"] = [max(0, lo - 4), hi - 4]
        elif m["edit"] == "not_a_dict":
            header = ["x"]
        write_st(file, header, data)
    elif kind == "huge":
        # A memory bomb: the manifest and the file's header both declare HUGE_ROWS rows, the
        # data stays a few bytes.
        rows = m.get("rows", HUGE_ROWS)

        def edit(man):
            t = man["tables"][0]
            t["vocabulary_size"] = rows
            if m.get("dim"):
                t["dim"] = m["dim"]
                for slot in t.get("slots", []):  # Adagrad's accumulators are dim wide
                    slot["width"] = m["dim"]

        _edit_manifest(folder, edit)
        header, data = read_st(folder / "table-000.safetensors")
        for name, info in header.items():
            if name != "__metadata__":
                width = m.get("dim") or info["shape"][1]
                info["shape"] = [rows, width]
        write_st(folder / "table-000.safetensors", header, data)
    elif kind == "swap_files":

        def edit(man):
            t = man["tables"]
            t[0]["file"], t[1]["file"] = t[1]["file"], t[0]["file"]

        _edit_manifest(folder, edit)
    elif kind == "swap_names":

        def edit(man):
            t = man["tables"]
            t[0]["name"], t[1]["name"] = t[1]["name"], t[0]["name"]

        _edit_manifest(folder, edit)
    elif kind == "reindent":
        _edit_manifest(folder, lambda man: None)
    else:
        raise AssertionError(kind)
    if m["group"] != "accidental":
        fix_checksums(folder)


def _mutations(target: str, seed: int, flips: int) -> list[dict]:
    rng = random.Random(seed)
    out: list[dict] = []

    def add(group, kind, **kw):
        out.append({"group": group, "kind": kind, **kw})

    files = list(TABLE_FILES) + (["extra.safetensors"] if target == "ckpt" else [])
    for f in files:
        for at in ("zero", "short", "mid_header", "data_start", "one_byte", "minus_one"):
            add("accidental", "truncate", file=f, at=at)
        for region in ("length", "header", "data"):
            for _ in range(flips):
                add(
                    "accidental",
                    "flip",
                    file=f,
                    region=region,
                    pos=rng.randrange(1 << 30),
                    bit=rng.randrange(8),
                )
        add("accidental", "delete", file=f)
        add("accidental", "append", file=f)
    for _ in range(flips * 2):
        add(
            "accidental",
            "flip",
            file="manifest.json",
            region="any",
            pos=rng.randrange(1 << 30),
            bit=rng.randrange(8),
        )
    add("accidental", "truncate", file="manifest.json", at="minus_one")
    add("accidental", "replace", file="manifest.json", content="")
    add("accidental", "replace", file="manifest.json", content="{not json")
    add("accidental", "delete", file="manifest.json")
    if target == "ckpt":
        add("accidental", "flip", file="manifest.sha256", region="any", pos=3, bit=1)
        add("accidental", "delete", file="manifest.sha256")
    # crafted: manifest keys deleted or of the wrong type
    man_keys = ["format", "format_version", "tables", "features", "files"]
    man_keys += (
        ["step", "seed", "extra", "learning_rate_tags"] if target == "ckpt" else ["source_step"]
    )
    for k in man_keys:
        add("crafted", "manifest", keys=[k], value="<delete>")
    table_keys = ["name", "vocabulary_size", "dim", "combiner", "file"]
    table_keys += (
        ["optimizer", "initializer", "slots", "storage"]
        if target == "ckpt"
        else ["compression", "params"]
    )
    for k in table_keys:
        add("crafted", "manifest", keys=["tables", 1, k], value="<delete>")
    for k in ("name", "table", "max_sequence_length", "output_shape"):
        add("crafted", "manifest", keys=["features", 0, k], value="<delete>")
    add("crafted", "manifest", keys=["files", "table-001.safetensors"], value="<delete>")
    for keys, values in [
        (["format_version"], [2, "1", None]),
        (["format"], ["nope", None]),
        (["tables"], [{}, "x", []]),
        (["features"], [{}, "x", [{"name": "user"}]]),
        (["files"], [[], "x"]),
        (["tables", 0, "vocabulary_size"], [-1, 0, "10", 10.5, True, 11]),
        (["tables", 0, "dim"], [0, -3, "3", 4]),
        (["tables", 0, "combiner"], ["max", None]),
        (["tables", 0, "name"], [None, 7, "t_item"]),
        (["tables", 1, "file"], [None, 7, "manifest.json", "table-002.safetensors"]),
        (["features", 0, "table"], ["nope", None]),
        # (A valid value, e.g. max_sequence_length 2, is an edit of the configs, not damage: a
        # plain hash cannot tell who edited the manifest, so such edits are not tried.)
        (["features", 0, "max_sequence_length"], [-1, "x"]),
        # ([0] is valid: the shape of a batch of no samples, so it is an edit, not damage.)
        (["features", 0, "output_shape"], [[-1], "x"]),
        (["files", "table-000.safetensors"], ["x", {}]),
    ]:
        for v in values:
            add("crafted", "manifest", keys=keys, value=v)
    if target == "ckpt":
        for keys, values in [
            (["step"], ["x", -1, 1.5, None, 1 << 70]),
            (["seed"], ["x", None]),
            (["extra"], ["x", {"file": "x.safetensors"}]),
            (["extra", "metadata"], ["x"]),
            (["tables", 0, "slots"], [[], "x", [{"name": "accumulators"}]]),
            (["tables", 0, "optimizer", "class"], ["Nope", "Optimizer", None]),
            (["tables", 0, "optimizer", "params", "evil"], [1]),
            (
                ["tables", 0, "optimizer", "params", "learning_rate"],
                [{"tag": 99}, {"constant": "x"}, "x"],
            ),
            (["tables", 0, "optimizer", "params", "initial_accumulator_value"], [-5, "x"]),
            (["tables", 0, "optimizer"], ["x", {}]),
            (["tables", 0, "initializer", "class"], ["Nope", None]),
            (["tables", 0, "initializer", "params"], [{"minval": 5, "maxval": 1}, "x"]),
            (["tables", 0, "storage"], ["disk"]),
            (["learning_rate_tags"], ["x"]),
        ]:
            for v in values:
                add("crafted", "manifest", keys=keys, value=v)
    else:
        for keys, values in [
            (["tables", 0, "compression"], ["nope", "fp16", None]),
            (["tables", 0, "params"], ["x", {"fixed_range": "x"}]),
            (["source_step"], ["x"]),
        ]:
            for v in values:
                add("crafted", "manifest", keys=keys, value=v)
    # path traversal: a real safetensors file outside the folder, with other values
    source = "outside" if target == "ckpt" else "outside_export"
    for how in ("relative", "absolute", "subdir", "unlisted"):
        add(
            "crafted",
            "traversal",
            how=how,
            keys=["tables", 0, "file"],
            source=source,
            source_file="table-000.safetensors",
        )
    if target == "ckpt":
        for how in ("relative", "absolute"):
            add(
                "crafted",
                "traversal",
                how=how,
                keys=["extra", "file"],
                source="outside",
                source_file="extra.safetensors",
            )
    # huge declared shapes, tensors that do not match
    add("crafted", "huge")  # 200M x 3 (4.5 GiB with its slot)
    add("crafted", "huge", dim=64)  # 200M x 64 (95 GiB)
    add("crafted", "huge", rows=50_000_000)  # 1.1 GiB: allocated, then found short
    for edit in (
        "dtype_f16",
        "short_data",
        "drop_tensor",
        "shape",
        "offsets_past_end",
        "overlap",
        "not_a_dict",
    ):
        for f in ("table-000.safetensors", "table-001.safetensors"):
            add("crafted", "header", file=f, edit=edit)
    if target == "ckpt":
        add(
            "crafted",
            "header",
            file="table-001.safetensors",
            edit="short_data",
            tensor="t_item/linears",
        )
        add(
            "crafted",
            "header",
            file="table-001.safetensors",
            edit="drop_tensor",
            tensor="t_item/linears",
        )
    if target == "ckpt":  # a step the checkpoint's folder name contradicts
        out.append(
            {
                "group": "crafted",
                "kind": "manifest",
                "keys": ["step"],
                "value": 5,
                "dirname": "ckpt",
            }
        )
    add("crafted", "swap_files")
    add("crafted", "swap_names")
    # controls
    add("control", "reindent")
    add("control", "manifest", keys=["comment"], value="an unknown key")
    return out


def tasks(base: dict, seed: int = 0, flips: int = 2) -> list[dict]:
    """Every (mutation, operation) of checkpoints and exports, each with a folder name: a
    checkpoint is copied under its own name (``ckpt-...``) or a plain one (``copy``) at random,
    since some checks depend on the name."""
    rng = random.Random(seed)
    out = []
    for target in ("ckpt", "export"):
        for m in _mutations(target, seed, flips):
            for op in OPS[target]:
                plain = target == "export" or rng.random() < 0.5
                if m.get("dirname") == "ckpt":
                    plain = False
                out.append(
                    {
                        "target": target,
                        "mutation": m,
                        "op": op,
                        "base": base,
                        "dirname": "copy" if plain else None,
                    }
                )
    for i, t in enumerate(out):
        t["i"] = i
    return out


def describe(task: dict) -> str:
    m = {k: v for k, v in task["mutation"].items() if k not in ("group", "kind")}
    return f"{task['target']} {task['mutation']['kind']} {m} -> {task['op']}"


# -- running one task (in the child) ---------------------------------------------------------------

_ORIGINAL: dict = {}


def _all_rows_batch(spec) -> dict:
    """Every row of every table, one id per sample (any combiner gives the row itself)."""
    return {f.name: [[r] for r in range(f.vocab)] for f in spec.features}


def _declared_rows_batch(folder: Path, spec) -> dict:
    """Every row the export's manifest declares (so that an export claiming more rows than its
    files hold is looked up where it has none); the original's batch if it is unreadable."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        vocab = {t["name"]: int(t["vocabulary_size"]) for t in manifest["tables"]}
        batch = {f["name"]: [[r] for r in range(vocab[f["table"]])] for f in manifest["features"]}
        if set(batch) == set(spec.names) and all(0 < len(v) < 1 << 20 for v in batch.values()):
            return batch
    except Exception:  # noqa: BLE001 - a broken manifest: probe with the original's batch
        pass
    return _all_rows_batch(spec)


def _original(base: dict) -> dict:
    """The unmutated checkpoint loaded, its spec, extras and every row looked up from its export
    (once per process)."""
    key = base["base"]
    if key not in _ORIGINAL:
        import embengine as ee
        from embengine import serving

        from .configs import SPECS, build_engine
        from .execute import snapshot

        engine = ee.EmbeddingEngine.load(base["base"])
        probe = build_engine("mixed", "reference")
        info = probe.restore(base["base"])
        lookup = serving.ServingEngine.load(base["base_export"]).lookup(
            _all_rows_batch(SPECS["mixed"])
        )
        _ORIGINAL[key] = {
            "state": snapshot(engine),
            "spec": engine.spec(),
            "extra": info.extra_tensors,
            "metadata": info.extra_metadata,
            "lookup": lookup,
        }
    return _ORIGINAL[key]


def _same_lookup(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes() for k in a
    )


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_task(task: dict) -> dict:
    """Copy, mutate, operate, judge (see the module docstring)."""
    import time

    try:
        return _run_task(task, time)
    except Exception:  # noqa: BLE001 - a bug here must not look like embengine's
        return {"outcome": "harness_error", "detail": traceback.format_exc()[-1500:]}


def _run_task(task: dict, time) -> dict:
    import embengine as ee
    from embengine import checkpoint, serving

    from .configs import SPECS, build_engine
    from .execute import same_bits, snapshot

    base = task["base"]
    original = _original(base)
    work = Path(tempfile.mkdtemp(prefix="embengine-crafted-"))
    try:
        src = Path(base["base"] if task["target"] == "ckpt" else base["base_export"])
        # Two levels deep, so that "../../outside/..." climbs out of the copy.
        folder = work / "a" / (task["dirname"] or src.name)
        shutil.copytree(src, folder)
        apply_mutation(folder, copy.deepcopy(task["mutation"]), base)
        op = task["op"]
        engine = before = None
        if op == "restore":
            engine = build_engine("mixed", "reference")
            before = snapshot(engine)
        rss0, t0 = _maxrss_mb(), time.perf_counter()
        try:
            if op == "load":
                result = ee.EmbeddingEngine.load(folder)
            elif op == "restore":
                result = engine.restore(folder)
            elif op == "export":
                result = serving.export(folder, work / "out")
            else:
                result = serving.ServingEngine.load(folder)
            error = None
        except Exception as e:  # noqa: BLE001 - judged below
            error = e
        cost = {
            "seconds": round(time.perf_counter() - t0, 4),
            "peak_mb": round(max(0.0, _maxrss_mb() - rss0), 1),
        }
        if error is not None:
            text = f"{type(error).__name__}: {error}"[:500]
            if engine is not None and not same_bits(before, snapshot(engine)):
                return {"outcome": "partial", "detail": text, **cost}
            outcome = (
                "refused" if isinstance(error, checkpoint.CheckpointError) else ("other_exception")
            )
            return {"outcome": outcome, "detail": text, **cost}
        # Accepted: is it the original?
        why = None
        if op == "load":
            if not same_bits(snapshot(result), original["state"]):
                why = "other tables, slots or step"
            elif result.spec() != original["spec"]:
                why = "other configs"
        elif op == "restore":
            if not same_bits(snapshot(engine), original["state"]):
                why = "other tables, slots or step"
            elif result.extra_metadata != original["metadata"] or not (
                result.extra_tensors.keys() == original["extra"].keys()
                and all(
                    np.array_equal(result.extra_tensors[k], original["extra"][k])
                    for k in original["extra"]
                )
            ):
                why = "other extra tensors or metadata"
        else:
            try:
                exported = work / "out" if op == "export" else folder
                served = serving.ServingEngine.load(exported) if op == "export" else result
                lookup = served.lookup(_declared_rows_batch(exported, SPECS["mixed"]))
            except Exception as e:  # noqa: BLE001
                if op == "export":  # it exported a checkpoint it should have refused
                    return {
                        "outcome": "accepted_wrong",
                        "detail": f"the export it wrote does not serve: {type(e).__name__}: {e}"[
                            :500
                        ],
                        **cost,
                    }
                return {
                    "outcome": "other_exception",
                    "detail": f"loaded, then lookup: {type(e).__name__}: {e}"[:500],
                    **cost,
                }
            if not _same_lookup(lookup, original["lookup"]):
                why = "serves other values"
        if why:
            return {"outcome": "accepted_wrong", "detail": why, **cost}
        return {"outcome": "accepted_same", "detail": "", **cost}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def warm_up() -> None:
    """Nothing to compile: the reference backend and the serving kernels load on first use."""
