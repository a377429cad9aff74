"""Checkpoints against bad inputs: malformed manifests, file names that leave the checkpoint
folder, tiny files declaring huge tables, restores that would fail halfway, concurrent saves to
one root, and keep=N after NaN reached the tables."""

from __future__ import annotations

import copy
import hashlib
import json
import multiprocessing
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import embengine as ee
from embengine import checkpoint as ckpt_mod
from embengine import optimizers as O
from embengine.checkpoint import CheckpointError, list_checkpoints, read_manifest
from embengine.inspect import describe
from embengine.safetensors_io import read_header, read_tensor, write_safetensors
from embengine.serving import ServingEngine, export, read_serving_manifest

REPO = Path(__file__).resolve().parents[1]


# -- helpers --------------------------------------------------------------------------------------


def _engine(seed: int = 3, vocab: int = 20, dim: int = 4) -> ee.EmbeddingEngine:
    """Two tables: "t" (Adagrad: one float slot) and "u" (FTRL: two float slots)."""
    t = ee.TableConfig(vocab, dim, name="t", combiner="sum")
    u = ee.TableConfig(15, 2, name="u", optimizer=O.FTRL(learning_rate=0.2))
    return ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t), "g": ee.FeatureConfig(u)},
        optimizer=O.Adagrad(learning_rate=0.1),
        seed=seed,
        backend="reference",
    )


def _train(eng: ee.EmbeddingEngine, steps: int = 2) -> None:
    rng = np.random.default_rng(eng.step)
    for _ in range(steps):
        feats = {
            "f": ee.Ragged(rng.integers(0, 7, 6), lengths=[2, 2, 2]),
            "g": ee.Ragged(rng.integers(0, 7, 3), lengths=[1, 1, 1]),
        }
        acts = eng.lookup(feats)
        eng.apply_gradients(
            {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in acts.items()}
        )


def _state(eng: ee.EmbeddingEngine) -> dict[str, bytes]:
    out = {}
    for name, w in eng.embedding_tables.items():
        out[name] = np.array(w).tobytes()
        for slot, a in eng.slots(name).items():
            out[f"{name}/{slot}"] = np.array(a).tobytes()
    return out


def _assert_unchanged(eng: ee.EmbeddingEngine, before: dict[str, bytes], step: int) -> None:
    after = _state(eng)
    changed = [k for k in before if before[k] != after[k]]
    assert not changed, f"a refused restore changed {changed}"
    assert eng.step == step


def _edit_manifest(path: Path, fn) -> None:
    """Edit manifest.json and rewrite manifest.sha256 to match, as a forger (or a buggy tool)
    would, so the checks behind the manifest's checksum are the ones that must catch it."""
    m = json.loads((path / "manifest.json").read_text())
    fn(m)
    text = json.dumps(m).encode()
    (path / "manifest.json").write_bytes(text)
    (path / "manifest.sha256").write_text(hashlib.sha256(text).hexdigest())


def _file_entry(file: Path) -> dict:
    data = file.read_bytes()
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def _replace_file(path: Path, name: str, data: bytes) -> None:
    """Put ``data`` in place of a checkpoint file, with a matching manifest entry and hash."""
    (path / name).write_bytes(data)
    _edit_manifest(path, lambda m: m["files"].__setitem__(name, _file_entry(path / name)))


def _raw_safetensors(entries: list[tuple[str, str, list[int], int]], data_bytes: int) -> bytes:
    """A safetensors file whose header declares ``(name, dtype, shape, nbytes)`` entries one
    after another (whatever their shapes need), followed by ``data_bytes`` zero bytes."""
    header, offset = {}, 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"\0" * data_bytes


def _all_refusals(path: Path, tmp_path: Path, match: str | None = None) -> list[str]:
    """Every way to read a checkpoint refuses ``path`` with a CheckpointError (never KeyError,
    TypeError, AttributeError, ...), whatever ``verify`` says; a refused restore leaves the
    engine bit-identical. Returns the messages."""
    msgs = []
    for verify in (True, False):
        with pytest.raises(CheckpointError, match=match) as exc:
            ee.EmbeddingEngine.load(path, verify=verify)
        msgs.append(str(exc.value))
        eng = _engine(seed=11)
        _train(eng, 1)
        before = _state(eng)
        with pytest.raises(CheckpointError, match=match) as exc:
            eng.restore(path, verify=verify)
        msgs.append(str(exc.value))
        _assert_unchanged(eng, before, 1)
        with pytest.raises(CheckpointError, match=match):
            read_manifest(path, verify=verify)
        with pytest.raises(CheckpointError, match=match):
            describe(path, verify=verify)
    with pytest.raises(CheckpointError, match=match):
        export(path, tmp_path / "served")
    return msgs


@pytest.fixture
def saved(tmp_path) -> tuple[ee.EmbeddingEngine, Path]:
    eng = _engine()
    _train(eng, 2)
    return eng, eng.save(tmp_path / "ck", extra_tensors={"dense": np.ones(4, np.float32)})


def test_the_fixture_checkpoint_reads_every_way(saved, tmp_path):
    """The unedited checkpoint passes everything _all_refusals expects to fail."""
    eng, path = saved
    for verify in (True, False):
        assert ee.EmbeddingEngine.load(path, verify=verify).step == 2
        assert read_manifest(path, verify=verify)[0] == path
        assert "table 't'" in describe(path, verify=verify)
    export(path, tmp_path / "served")


# -- item 12: a malformed manifest is a CheckpointError naming the key ----------------------------


def _set(*keys_and_value):
    """An edit that sets m[k1][k2]... = value."""
    *keys, value = keys_and_value

    def edit(m):
        for k in keys[:-1]:
            m = m[k]
        m[keys[-1]] = value

    return edit


def _pop(*keys):
    def edit(m):
        for k in keys[:-1]:
            m = m[k]
        del m[keys[-1]]

    return edit


def _dup_table(m):
    m["tables"].append(dict(m["tables"][0]))


def _dup_feature(m):
    m["features"].append(dict(m["features"][0]))


T0 = r"tables\[0\]"
CORRUPT_MANIFESTS = {
    "step-missing": (_pop("step"), r"\bstep is missing"),
    "step-negative": (_set("step", -1), r"\bstep must be an int in \[0, 2\*\*63\)"),
    "step-string": (_set("step", "2"), r"\bstep must be an int in \[0, 2\*\*63\)"),
    "step-bool": (_set("step", True), r"\bstep must be an int in \[0, 2\*\*63\)"),
    "step-beyond-int64": (_set("step", 2**70), r"\bstep must be an int in \[0, 2\*\*63\)"),
    "format-version-bool": (_set("format_version", True), r"format version True"),
    "seed-missing": (_pop("seed"), r"\bseed is missing"),
    "seed-float": (_set("seed", 1.5), r"\bseed must be an int"),
    "version-missing": (_pop("embengine_version"), "embengine_version is missing"),
    "backend-unknown": (_set("backend", "cuda"), "backend must be one of"),
    "tables-object": (_set("tables", {"t": 1}), "tables must be a non-empty list"),
    "tables-empty": (_set("tables", []), "tables must be a non-empty list"),
    "table-string": (_set("tables", 0, "t"), rf"{T0} must be an object"),
    "table-name-missing": (_pop("tables", 0, "name"), rf"{T0}\.name is missing"),
    "table-name-duplicate": (_dup_table, r"tables\[2\]\.name 't' names an earlier table"),
    "vocabulary-string": (
        _set("tables", 0, "vocabulary_size", "20"),
        rf"{T0}\.vocabulary_size must be an int >= 1",
    ),
    "vocabulary-zero": (
        _set("tables", 0, "vocabulary_size", 0),
        rf"{T0}\.vocabulary_size must be an int >= 1",
    ),
    "dim-missing": (_pop("tables", 0, "dim"), rf"{T0}\.dim is missing"),
    "dim-float": (_set("tables", 0, "dim", 4.0), rf"{T0}\.dim must be an int >= 1"),
    "combiner-int": (_set("tables", 0, "combiner", 3), rf"{T0}\.combiner must be a string"),
    "combiner-unknown": (_set("tables", 0, "combiner", "max"), rf"{T0} \('t'\).*combiner"),
    "storage-missing": (_pop("tables", 0, "storage"), rf"{T0}\.storage is missing"),
    "file-missing": (_pop("tables", 0, "file"), rf"{T0}\.file is missing"),
    "file-int": (_set("tables", 0, "file", 0), rf"{T0}\.file must be a string"),
    "slots-int": (_set("tables", 0, "slots", 5), rf"{T0}\.slots must be a list"),
    "slot-width-missing": (
        _pop("tables", 0, "slots", 0, "width"),
        rf"{T0}\.slots\[0\]\.width is missing",
    ),
    "slot-dtype-unknown": (
        _set("tables", 0, "slots", 0, "dtype", "float64"),
        rf"{T0}\.slots\[0\]\.dtype must be one of",
    ),
    "slots-not-the-optimizers": (
        _set("tables", 1, "slots", []),
        r"tables\[1\]\.slots \[\] are not the slots of its optimizer",
    ),
    "optimizer-params-missing": (
        _pop("tables", 0, "optimizer", "params"),
        rf"{T0}\.optimizer\.params is missing",
    ),
    "optimizer-class-list": (
        _set("tables", 0, "optimizer", "class", []),
        rf"{T0}\.optimizer\.class must be a string",
    ),
    "optimizer-class-unknown": (
        _set("tables", 0, "optimizer", "class", "Nope"),
        "unknown optimizer class 'Nope'",
    ),
    "optimizer-param-unknown": (
        _set("tables", 0, "optimizer", "params", "bogus", 1),
        rf"{T0} \('t'\).*bogus",
    ),
    "learning-rate-number": (
        _set("tables", 0, "optimizer", "params", "learning_rate", 0.1),
        rf"{T0}\.optimizer\.params\.learning_rate must be an object",
    ),
    "learning-rate-tag-string": (
        _set("tables", 0, "optimizer", "params", "learning_rate", {"tag": "0"}),
        rf"{T0}\.optimizer\.params\.learning_rate\.tag must be an int >= 0",
    ),
    "initializer-class-int": (
        _set("tables", 0, "initializer", "class", 5),
        rf"{T0}\.initializer\.class must be a string",
    ),
    "initializer-params-list": (
        _set("tables", 0, "initializer", "params", [1]),
        rf"{T0}\.initializer\.params must be an object",
    ),
    "quantization-unknown-key": (
        _set("tables", 0, "quantization_config", {"bits": 8}),
        rf"{T0} \('t'\).*bits",
    ),
    "features-missing": (_pop("features"), "features is missing"),
    "feature-table-unknown": (
        _set("features", 0, "table", "nope"),
        r"features\[0\]\.table must be one of the tables",
    ),
    "feature-table-list": (
        _set("features", 0, "table", ["t"]),
        r"features\[0\]\.table must be one of the tables",
    ),
    "feature-name-duplicate": (_dup_feature, r"features\[2\]\.name 'f' names an earlier"),
    "feature-sequence-string": (
        _set("features", 0, "max_sequence_length", "0"),
        r"features\[0\]\.max_sequence_length must be an int >= 0",
    ),
    "feature-sequence-huge": (  # every lookup would pad to it: a bare MemoryError
        _set("features", 0, "max_sequence_length", 2**40),
        r"features\[0\] \('f'\).*max_sequence_length=1,099,511,627,776 is more than 16,777,216",
    ),
    "feature-output-shape-dims": (  # every lookup's reshape: a numpy ValueError
        _set("features", 0, "output_shape", [1] * 70),
        r"features\[0\] \('f'\).*output_shape has 70 dims",
    ),
    "feature-output-shape-string": (
        _set("features", 0, "output_shape", "ab"),
        r"features\[0\]\.output_shape must be null or a list",
    ),
    "files-list": (_set("files", []), "files must be an object"),
    "file-entry-no-bytes": (
        _pop("files", "table-000.safetensors", "bytes"),
        r"files\['table-000.safetensors'\]\.bytes is missing",
    ),
    "file-entry-bytes-string": (
        _set("files", "table-000.safetensors", "bytes", "1"),
        r"files\['table-000.safetensors'\]\.bytes must be an int",
    ),
    "file-entry-sha-short": (
        _set("files", "table-000.safetensors", "sha256", "abc"),
        r"files\['table-000.safetensors'\]\.sha256 must be 64",
    ),
    "extra-string": (_set("extra", "x"), "extra must be an object"),
    "extra-metadata-list": (_set("extra", "metadata", []), r"extra\.metadata must be an object"),
    "extra-file-int": (_set("extra", "file", 1), r"extra\.file must be null or a string"),
}


@pytest.mark.parametrize("case", list(CORRUPT_MANIFESTS))
def test_corrupt_manifest_is_a_checkpoint_error_naming_the_key(saved, tmp_path, case):
    """Each manifest is re-signed (manifest.sha256 matches), so the schema check, not the
    checksum, must catch it: a CheckpointError naming the key and the manifest, for load,
    restore (engine untouched), read_manifest, inspect and export, with and without verify."""
    _, path = saved
    edit, key = CORRUPT_MANIFESTS[case]
    _edit_manifest(path, edit)
    for msg in _all_refusals(path, tmp_path, match=key):
        assert str(path) in msg


def test_a_manifest_that_is_not_an_object_is_refused_by_inspect(saved, tmp_path):
    _, path = saved
    for text in ("[1, 2]", "{ nope", '"x"', "[" * 100_000):
        (path / "manifest.json").write_text(text)
        _all_refusals(path, tmp_path)


def test_inspect_of_a_path_that_is_no_checkpoint_says_what_it_is(saved, tmp_path):
    """A file (the manifest itself, a data file), a missing path and a folder without
    checkpoints: each named for what it is and what to give instead (was: "no complete
    checkpoint at PATH" for all)."""
    _, path = saved
    cases = {
        path / "manifest.json": "is a file; give the checkpoint's folder",
        tmp_path / "missing": "does not exist",
        tmp_path / "empty": "holds neither manifest.json",
    }
    (tmp_path / "empty").mkdir()
    for where, what in cases.items():
        with pytest.raises(CheckpointError, match=f"no complete checkpoint at {where}: {what}"):
            describe(where)


# -- item 4: every file is a plain name inside the checkpoint, listed and checksummed -------------


@pytest.fixture
def outside(tmp_path) -> Path:
    """A real, well-formed safetensors file outside the checkpoint, holding what table "t" of
    the fixture needs (all 7.0)."""
    file = tmp_path / "outside.safetensors"
    write_safetensors(
        file,
        {
            "t": np.full((20, 4), 7.0, np.float32),
            "t/accumulators": np.full((20, 4), 7.0, np.float32),
        },
    )
    return file


def _point_table_at(name: str, listed: bool, source: Path | None):
    def edit(m):
        m["tables"][0]["file"] = name
        m["files"].pop("table-000.safetensors")
        if listed:  # the forger lists the outside file with its correct hash and size
            m["files"][name] = _file_entry(source)

    return edit


@pytest.mark.parametrize("listed", [False, True], ids=["unlisted", "listed"])
@pytest.mark.parametrize("kind", ["absolute", "dotdot", "backslash", "subfolder", "hidden"])
def test_table_file_outside_the_checkpoint_is_refused(saved, outside, tmp_path, kind, listed):
    _, path = saved
    name = {
        "absolute": str(outside),
        "dotdot": "../../outside.safetensors",  # path is tmp_path/ck/ckpt-...
        "backslash": "..\\..\\outside.safetensors",
        "subfolder": "sub/table-000.safetensors",
        "hidden": ".table-000.safetensors",
    }[kind]
    assert kind != "dotdot" or (path / name).resolve() == outside.resolve()
    if kind in ("subfolder", "hidden"):  # a real file there, to be sure it is not read
        (path / name).parent.mkdir(exist_ok=True)
        shutil.copy(outside, path / name)
    _edit_manifest(path, _point_table_at(name, listed, outside))
    msgs = _all_refusals(path, tmp_path, match="plain")
    assert all(repr(name) in m for m in msgs), msgs[0]


def test_extra_file_outside_the_checkpoint_is_refused(saved, outside, tmp_path):
    _, path = saved
    for name in (str(outside), "../../outside.safetensors"):
        _edit_manifest(path, _set("extra", "file", name))
        _all_refusals(path, tmp_path, match=r"extra\.file .* is not a plain")


def test_a_table_file_not_listed_in_files_is_refused(saved, tmp_path):
    """A plain name inside the folder that the manifest does not list (so nothing would check its
    hash or size): refused."""
    _, path = saved
    shutil.copy(path / "table-000.safetensors", path / "other.safetensors")
    _edit_manifest(path, _set("tables", 0, "file", "other.safetensors"))
    _all_refusals(path, tmp_path, match=r"tables\[0\]\.file 'other.safetensors' is not listed")


def test_a_symlinked_table_file_is_refused(saved, tmp_path):
    """A plain name that is a symbolic link (here to an identical copy, so every hash matches)
    leaves the folder: refused."""
    _, path = saved
    copy = tmp_path / "copy.safetensors"
    shutil.copy(path / "table-000.safetensors", copy)
    (path / "table-000.safetensors").unlink()
    (path / "table-000.safetensors").symlink_to(copy)
    _all_refusals(path, tmp_path, match="not a regular file")


@pytest.mark.parametrize("name", ["manifest.json", "manifest.sha256"])
def test_a_symlinked_manifest_is_refused(saved, tmp_path, name):
    """manifest.json and manifest.sha256 are refused as links too (they were followed, to
    wherever they led); manifest.sha256 is read only with verify."""
    _, path = saved
    moved = tmp_path / "outside" / name
    moved.parent.mkdir()
    shutil.move(path / name, moved)
    (path / name).symlink_to(moved)
    if name == "manifest.json":
        _all_refusals(path, tmp_path, match=f"{name} is not a regular file")
        return
    for read in (ee.EmbeddingEngine.load, read_manifest, describe, _engine().restore):
        with pytest.raises(CheckpointError, match=f"{name} is not a regular file"):
            read(path)
    assert ee.EmbeddingEngine.load(path, verify=False).step == 2


@pytest.mark.parametrize("name", ["manifest.json", "manifest.sha256"])
def test_a_manifest_larger_than_the_cap_is_refused_before_it_is_read(saved, tmp_path, name):
    """manifest.json and manifest.sha256 are read whole: one past MAX_MANIFEST_BYTES (sparse,
    so free on disk) is a CheckpointError naming the file and the limit, never a MemoryError
    (a 3 GiB one was read whole); manifest.sha256 is read only with verify."""
    _, path = saved
    limit = ckpt_mod.MAX_MANIFEST_BYTES
    with open(path / name, "r+b") as f:
        f.truncate(limit + 1)
    match = f"{name} is {limit + 1:,} bytes, more than a manifest may be \\({limit:,} bytes"
    if name == "manifest.json":
        _all_refusals(path, tmp_path, match=match)
    else:
        for read in (ee.EmbeddingEngine.load, read_manifest, describe, _engine().restore):
            with pytest.raises(CheckpointError, match=match):
                read(path)
    out = subprocess.run(
        [sys.executable, "-m", "embengine", "inspect", str(path)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 1 and "more than a manifest may be" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_verify_false_skips_only_the_hashing(saved, tmp_path):
    """verify=False still checks names, sizes and headers: a truncated file is refused before
    anything changes (it used to fail halfway through the restore)."""
    _, path = saved
    f = path / "table-001.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-16])
    _all_refusals(path, tmp_path, match="truncated")
    # A changed byte of table data (same size, valid header) is caught only by the hashing.
    f.write_bytes(data[:-3] + bytes([data[-3] ^ 0x5A]) + data[-2:])
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        ee.EmbeddingEngine.load(path)
    assert ee.EmbeddingEngine.load(path, verify=False).step == 2


@pytest.mark.parametrize("verify", ["no", "False", 0, 1, None])
def test_verify_must_be_a_bool(saved, tmp_path, verify):
    """A truthy non-bool (``verify="no"``) used to verify, silently, and a falsy one to skip
    the hashing: every reader of checkpoints and exports refuses it with a TypeError naming
    the value, before anything is read or changed (one check, ``checkpoint.check_verify``)."""
    eng, path = saved
    served = tmp_path / "served"
    export(path, served)
    other = _engine(seed=9)
    before = _state(other)
    match = rf"verify must be True or False, got {verify!r}"
    calls = [
        lambda: ee.EmbeddingEngine.load(path, verify=verify),
        lambda: other.restore(path, verify=verify),
        lambda: ckpt_mod.restore(other, path, verify),
        lambda: ckpt_mod.read_checkpoint(path, verify=verify),
        lambda: read_manifest(path, verify=verify),
        lambda: describe(path, verify=verify),
        lambda: ServingEngine.load(served, verify=verify),
        lambda: read_serving_manifest(served, verify=verify),
        lambda: describe(served, verify=verify),
    ]
    for call in calls:
        with pytest.raises(TypeError, match=match):
            call()
    _assert_unchanged(other, before, 0)


# -- item 5: a tiny file declaring a huge table is refused before anything is allocated -----------

BOMB_CHILD = textwrap.dedent(
    """
    import resource, sys, time
    # A safety net: the old code allocated the declared table (47.7 GiB here) before checking.
    resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))
    import embengine as ee
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    try:
        ee.EmbeddingEngine.load(sys.argv[1], verify=sys.argv[2] == "1")
        result = "loaded"
    except Exception as e:
        result = f"{type(e).__name__}: {e}"
    seconds = time.perf_counter() - t0
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB on Linux
    print(f"{seconds:.3f} {grew}")
    print(result)
    """
)


@pytest.mark.parametrize("verify", [True, False])
def test_tiny_checkpoint_declaring_a_huge_table_is_refused_before_allocation(tmp_path, verify):
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(ee.TableConfig(10, 64, name="big"))},
        optimizer=O.SGD(learning_rate=0.1),
        backend="reference",
    )
    path = eng.save(tmp_path / "ck")
    vocab = 200_000_000
    # The header declares the 200M x 64 table the manifest says, over a 16-byte data range.
    _replace_file(
        path, "table-000.safetensors", _raw_safetensors([("big", "F32", [vocab, 64], 16)], 16)
    )
    _edit_manifest(path, _set("tables", 0, "vocabulary_size", vocab))
    assert sum(f.stat().st_size for f in path.iterdir()) < 4096
    proc = subprocess.run(
        [sys.executable, "-c", BOMB_CHILD, str(path), "1" if verify else "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    timing, result = proc.stdout.strip().split("\n", 1)
    seconds, grew_kib = float(timing.split()[0]), int(timing.split()[1])
    assert result.startswith("CheckpointError"), result
    assert "table-000.safetensors" in result and "'big'" in result
    assert "needs 51200000000" in result, result
    assert seconds < 5, f"refusing took {seconds:.1f} s"
    assert grew_kib < 100 << 10, f"peak memory grew by {grew_kib >> 10} MiB while refusing"


def test_read_header_refuses_data_ranges_that_do_not_match_the_shape(tmp_path):
    f = tmp_path / "x.safetensors"
    cases = {
        "short": ([("a", "F32", [4, 2], 16)], 16, "has 16 bytes of data, its F32 shape"),
        "long": ([("a", "F32", [1, 2], 16)], 16, "has 16 bytes of data"),
        "huge-shape": ([("a", "F32", [2**62, 2**62], 8)], 8, "needs"),
        "negative-dim": ([("a", "F32", [-1, 2], 8)], 8, "not a list of ints >= 0"),
        "float-dim": ([("a", "F32", [2.0, 1], 8)], 8, "not a list of ints >= 0"),
        "outside": ([("a", "F32", [4, 2], 32)], 16, "lies outside the file"),
        "dtype": ([("a", "F99", [2], 8)], 8, "dtype 'F99'"),
    }
    for entries, data, words in cases.values():
        f.write_bytes(_raw_safetensors(entries, data))
        with pytest.raises(ValueError, match=words):
            read_header(f)
    # Headers JSON cannot turn into objects: a ValueError too, never RecursionError/TypeError.
    for raw, words in (
        (b"[" * 100_000, "corrupt"),
        (b'{"a": ' + b"9" * 5000 + b"}", "corrupt"),
        (b'{"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}', "dtype"),
    ):
        f.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 8)
        with pytest.raises(ValueError, match=words):
            read_header(f)


def _offsets_file(ranges: dict[str, tuple[int, int]], data_bytes: int) -> bytes:
    """A safetensors file of U8 tensors at the given data ranges, then ``data_bytes`` bytes."""
    header = {
        name: {"dtype": "U8", "shape": [hi - lo], "data_offsets": [lo, hi]}
        for name, (lo, hi) in ranges.items()
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"\1" * data_bytes


def test_read_header_requires_contiguous_ranges_that_cover_the_data(tmp_path):
    """What the safetensors package requires: the ranges, in offset order, follow each other
    without gaps or overlaps and end with the file. Two tensors on one range (one read as the
    other) and trailing bytes were accepted; the package agrees on every case."""
    f = tmp_path / "x.safetensors"
    refused = {
        "alias": ({"a": (0, 8), "b": (0, 8)}, 8, "'b' .* overlaps another tensor's"),
        "overlap": ({"a": (0, 8), "b": (4, 12)}, 12, "'b' .* overlaps"),
        "gap": ({"a": (0, 4), "b": (8, 12)}, 12, "'b' .* leaves bytes 4:8 unused"),
        "trailing": ({"a": (0, 8)}, 12, "ends at byte 8, the file holds 12 data bytes"),
        "no-tensor": ({}, 4, "ends at byte 0, the file holds 4"),
    }
    accepted = {
        "listed-out-of-order": ({"b": (4, 8), "a": (0, 4)}, 8),
        "empty-tensors-share-an-offset": ({"a": (0, 0), "b": (0, 0), "c": (0, 4)}, 4),
        "empty-at-the-end": ({"c": (0, 4), "a": (4, 4)}, 4),
        "nothing": ({}, 0),
    }
    try:
        from safetensors.numpy import load_file
    except ImportError:  # an optional cross-check
        load_file = None
    for ranges, data, words in refused.values():
        f.write_bytes(_offsets_file(ranges, data))
        with pytest.raises(ValueError, match=f"x.safetensors: .*{words}"):
            read_header(f)
        if load_file is not None:
            with pytest.raises(Exception, match="offset|not fully covered"):
                load_file(f)
    for ranges, data in accepted.values():
        f.write_bytes(_offsets_file(ranges, data))
        assert sorted(n for n in read_header(f)[0] if n != "__metadata__") == sorted(ranges)
        if load_file is not None:
            assert sorted(load_file(f)) == sorted(ranges)


@pytest.mark.parametrize("how", ["alias", "trailing"])
def test_a_checkpoint_whose_tensors_share_bytes_is_refused(saved, tmp_path, how):
    """An accumulator pointed at its table's weights (or bytes after the data), hashes
    recomputed: every reader refuses it, the engine unchanged (the restore loaded the weights
    as accumulators)."""
    _, path = saved
    f = path / "table-000.safetensors"
    header, start = read_header(f)
    raw = f.read_bytes()
    header = dict(header)
    if how == "alias":
        header["t/accumulators"] = dict(header["t/accumulators"])
        header["t/accumulators"]["data_offsets"] = list(header["t"]["data_offsets"])
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    data = raw[start:] + (b"\0" * 8 if how == "trailing" else b"")
    _replace_file(path, f.name, struct.pack("<Q", len(text)) + text + data)
    words = "overlaps another tensor's" if how == "alias" else "trailing bytes"
    _all_refusals(path, tmp_path, match=f"table-000.safetensors.*{words}")


def test_a_checkpoint_file_listed_under_two_names_is_refused(saved, tmp_path):
    """Two listed names of one file (a hard link) would be parsed and hashed once per name
    (1,000 links of a 100 MB header asked for hundreds of GB): refused, naming both."""
    _, path = saved
    os.link(path / "table-000.safetensors", path / "again.safetensors")
    _edit_manifest(
        path,
        lambda m: m["files"].__setitem__(
            "again.safetensors", _file_entry(path / "again.safetensors")
        ),
    )
    _all_refusals(
        path, tmp_path, match="again.safetensors and .*table-000.safetensors are one file"
    )


def test_headers_are_parsed_one_at_a_time(saved, tmp_path):
    """Files a manifest lists beyond its tables' (each here a distinct file whose header lists
    60,000 empty tensors) are checked and dropped, and a table file's unused entries too: a
    load holds one parsed header at a time, not all of them (it kept every one)."""
    import tracemalloc

    _, path = saved
    ckpt_mod.read_checkpoint(path)  # what it imports the first time is not measured
    entry = '"x%06d":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}'
    text = ("{" + ",".join(entry % i for i in range(60_000)) + "}").encode()
    text += b" " * (-len(text) % 8)
    names = [f"big-{i}.safetensors" for i in range(4)]
    for name in names:
        (path / name).write_bytes(struct.pack("<Q", len(text)) + text)

    def add(m):
        for name in names:
            m["files"][name] = _file_entry(path / name)

    _edit_manifest(path, add)
    tracemalloc.start()
    try:
        read_header(path / names[0])
        one = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        _, reader = ckpt_mod.read_checkpoint(path, verify=False)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - before < 2 * one, f"peak {peak - before:,} bytes, one header {one:,}"
    assert held - before < one / 10, f"{held - before:,} bytes held after the checks"
    assert reader.state_dict()["step"] == 2


# -- item 6: a restore either fails before any table changes, or succeeds -------------------------


@pytest.mark.parametrize("verify", [True, False])
def test_restore_of_a_tensor_with_a_short_data_range_leaves_the_engine_untouched(saved, verify):
    """The second table's file has the right header shapes but one data range too short (the
    file's hash matches): the restore used to overwrite table "t" and then fail on "u"."""
    _, path = saved
    short = _raw_safetensors(
        [
            ("u", "F32", [15, 2], 120),
            ("u/accumulators", "F32", [15, 2], 120),
            ("u/linears", "F32", [15, 2], 64),
        ],
        304,
    )
    _replace_file(path, "table-001.safetensors", short)
    eng = _engine(seed=11)
    _train(eng, 1)
    before = _state(eng)
    with pytest.raises(CheckpointError, match="u/linears.*has 64 bytes of data"):
        eng.restore(path, verify=verify)
    _assert_unchanged(eng, before, 1)


@pytest.mark.parametrize("verify", [True, False])
def test_restore_of_a_manifest_without_step_leaves_the_engine_untouched(saved, tmp_path, verify):
    """A checkpoint copied to a folder of another name (so the step in the folder name is not
    checked) whose manifest lacks ``step``: this used to raise KeyError after every table was
    overwritten."""
    _, path = saved
    plain = tmp_path / "my-model"
    shutil.copytree(path, plain)
    _edit_manifest(plain, _pop("step"))
    eng = _engine(seed=11)
    _train(eng, 1)
    before = _state(eng)
    with pytest.raises(CheckpointError, match=r"manifest.json: step is missing"):
        eng.restore(plain, verify=verify)
    _assert_unchanged(eng, before, 1)


def test_restore_that_fails_while_copying_says_the_engine_is_partially_restored(saved):
    """What is not guaranteed: a file changing after every check passed. The error says which
    tables were overwritten and that the step is unchanged."""
    _, path = saved
    _, reader = ckpt_mod.read_checkpoint(path, verify=True)  # every check, then the copy
    f = path / "table-001.safetensors"
    f.write_bytes(f.read_bytes()[:200])  # truncated between the checks and the copy
    eng = _engine(seed=11)
    with pytest.raises(CheckpointError, match=r"Tables \['t'\] and part of 'u'.*step is still 0"):
        reader.restore(eng)
    assert eng.step == 0


TRUNCATE_CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    from embengine import safetensors_io as io

    io.CHUNK_BYTES = 4096  # several chunks
    path = sys.argv[1]
    io.write_safetensors(path, {"a": np.ones((4096, 16), np.float32)})
    header = io.read_header(path)

    class TruncatesOnFirstWrite(np.ndarray):
        def __setitem__(self, key, value):
            if not getattr(self, "done", False):
                open(path, "r+b").truncate(64)  # the file shrinks during the copy
                TruncatesOnFirstWrite.done = True
            super().__setitem__(key, value)

    out = np.zeros((4096, 16), np.float32).view(TruncatesOnFirstWrite)
    try:
        io.read_tensor(path, "a", out=out, header=header)
        print("read")
    except ValueError as e:
        print("ValueError", e)
    """
)


def test_a_file_truncated_during_the_copy_is_an_error_not_a_crash(tmp_path):
    """read_tensor(out=...) reads with read(), so a file shrinking under it is a ValueError; a
    memory map would SIGBUS and kill the process (run in a subprocess)."""
    proc = subprocess.run(
        [sys.executable, "-c", TRUNCATE_CHILD, str(tmp_path / "a.safetensors")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"the reader crashed ({proc.returncode}): {proc.stderr[-500:]}"
    assert proc.stdout.startswith("ValueError") and "ends early" in proc.stdout, proc.stdout


def test_read_tensor_into_out_matches_the_memory_map(tmp_path):
    """The read() path copies every dtype and shape (0-d, empty, strided views) exactly."""
    from embengine import safetensors_io

    tensors = {
        "a": np.arange(70, dtype=np.float32).reshape(7, 10),
        "b": np.arange(5, dtype=np.int64),
        "s": np.array(3.5, np.float64),
        "e": np.zeros((0, 3), np.float32),
        "h": np.arange(6, dtype=np.uint16),
    }
    f = tmp_path / "x.safetensors"
    write_safetensors(f, tensors)
    header = read_header(f)
    for chunk in (safetensors_io.CHUNK_BYTES, 16):
        safetensors_io.CHUNK_BYTES, old = chunk, safetensors_io.CHUNK_BYTES
        try:
            for name, want in tensors.items():
                out = np.full(want.shape, 9, want.dtype)
                read_tensor(f, name, out=out, header=header)
                np.testing.assert_array_equal(out, want)
            big = np.zeros((7, 14), np.float32)
            read_tensor(f, "a", out=big[:, 2:12], header=header)
            np.testing.assert_array_equal(big[:, 2:12], tensors["a"])
        finally:
            safetensors_io.CHUNK_BYTES = old


# -- item 9: concurrent saves to one root ---------------------------------------------------------


def _check_root(root: Path, expected: int) -> None:
    """``expected`` complete, verified checkpoints numbered 1..expected, nothing else left."""
    done = list_checkpoints(root)
    seqs = sorted(int(p.name[5:11]) for p in done)
    assert seqs == list(range(1, expected + 1)), [p.name for p in done]
    for p in done:
        read_manifest(p, verify=True)
    left = [p.name for p in root.iterdir() if p not in done]
    assert not left, f"left behind: {left}"


def test_two_threads_saving_to_one_root(tmp_path):
    root = tmp_path / "ck"
    engines = [_engine(seed=s, vocab=20_000, dim=16) for s in (1, 2)]
    barrier = threading.Barrier(2, timeout=60)
    errors: list[BaseException] = []
    saves = 8

    def run(eng):
        try:
            barrier.wait()
            for _ in range(saves):
                eng.save(root)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(e,), daemon=True) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a save hung"
    assert not errors, errors
    _check_root(root, 2 * saves)


def _save_in_process(root: str, seed: int, saves: int, barrier) -> None:
    eng = _engine(seed=seed, vocab=20_000, dim=16)
    barrier.wait()
    for _ in range(saves):
        eng.save(root)


def test_two_processes_saving_to_one_root(tmp_path):
    root = tmp_path / "ck"
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2, timeout=120)
    saves = 6
    procs = [
        ctx.Process(target=_save_in_process, args=(str(root), s, saves, barrier)) for s in (1, 2)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 300
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)
    assert [p.exitcode for p in procs] == [0, 0]
    _check_root(root, 2 * saves)


def test_a_save_does_not_remove_the_temporary_folder_of_a_running_save(tmp_path):
    """A save cleaning up leftovers skips a .tmp-ckpt-* folder whose save is still running (it
    holds the folder's lock), and removes one nobody holds (a killed save's)."""
    import fcntl

    eng = _engine()
    root = tmp_path / "ck"
    root.mkdir()
    running, killed = root / ".tmp-ckpt-step000000000000-1-aaaa", root / ".tmp-ckpt-x-2-bbbb"
    for d in (running, killed):
        d.mkdir()
        (d / "table-000.safetensors").write_bytes(b"partial")
    fd = os.open(running, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        eng.save(root)
        assert running.is_dir() and (running / "table-000.safetensors").is_file()
        assert not killed.exists()
    finally:
        os.close(fd)
    eng.save(root)
    assert not running.exists()


def test_a_failed_save_removes_its_temporary_folder(tmp_path):
    eng = _engine()
    with pytest.raises(TypeError, match="extra_metadata"):
        eng.save(tmp_path, extra_metadata={"x": object()})
    assert list(tmp_path.iterdir()) == []


# -- item 11: keep=N never deletes the newest checkpoint whose tables are all finite --------------


def test_keep_never_deletes_the_newest_finite_checkpoint(tmp_path):
    eng = _engine()
    _train(eng, 1)
    good = eng.save(tmp_path, keep=1)
    eng.embedding_tables["t"][15, 1] = np.nan  # NaN reached a row training does not touch
    _train(eng, 1)
    bad1 = eng.save(tmp_path, keep=1)
    assert list_checkpoints(tmp_path) == [good, bad1]
    manifest = read_manifest(bad1)[1]
    assert manifest["finite"] is False
    assert [t["finite"] for t in manifest["tables"]] == [False, True]
    bad2 = eng.save(tmp_path, keep=1)
    assert list_checkpoints(tmp_path) == [good, bad2]
    assert "NaN or Inf in tables ['t']" in describe(bad2)
    # Once the tables are finite again, the new checkpoint is the one kept.
    restored = _engine()
    restored.restore(good)
    fixed = restored.save(tmp_path, keep=1)
    assert list_checkpoints(tmp_path) == [fixed]
    assert read_manifest(fixed)[1]["finite"] is True


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_nonfinite_float_slot_counts_as_not_finite(tmp_path, value):
    eng = _engine()
    good = eng.save(tmp_path)
    eng.slots("u")["linears"][14, 1] = value  # the last value written of table "u"
    bad = eng.save(tmp_path, keep=1)
    assert list_checkpoints(tmp_path) == [good, bad]
    assert [t["finite"] for t in read_manifest(bad)[1]["tables"]] == [True, False]


def test_checkpoints_without_the_finite_flag_count_as_finite(tmp_path):
    """Checkpoints written before the flag existed are kept as the last good one."""
    eng = _engine()
    old = eng.save(tmp_path)

    def strip(m):
        del m["finite"]
        for t in m["tables"]:
            del t["finite"]

    _edit_manifest(old, strip)
    eng.embedding_tables["u"][0, 0] = np.inf
    bad = eng.save(tmp_path, keep=1)
    assert list_checkpoints(tmp_path) == [old, bad]
    assert ee.EmbeddingEngine.load(old).step == 0


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_an_export_named_like_a_checkpoint_is_never_taken_for_one(tmp_path):
    """An export in a folder of checkpoints under a checkpoint's name (an older embengine
    wrote it there, or it was copied in) was listed as the newest checkpoint: restore(root)
    failed "not an embengine checkpoint", and keep=N kept it as the newest finite checkpoint,
    deleting the real one (or deleted the export). Listing reads the manifest's format."""
    root = tmp_path / "root"
    eng = _engine()
    _train(eng, 1)
    good = eng.save(root)
    export(good, tmp_path / "served")
    served = root / ckpt_mod.checkpoint_name(9, 123)
    (tmp_path / "served").rename(served)
    files = _snapshot(served)
    assert ckpt_mod.latest_checkpoint(root) == good
    assert list_checkpoints(root) == [good]
    assert ee.EmbeddingEngine.load(root).step == 1
    with pytest.raises(CheckpointError, match=r"not an embengine checkpoint.*embengine-serving"):
        ee.EmbeddingEngine.load(served)  # named directly: the format's error, as before
    # keep=1 with NaN in the tables: the last finite checkpoint is the real one, kept.
    eng.embedding_tables["t"][15, 1] = np.nan
    _train(eng, 1)
    bad = [eng.save(root, keep=1) for _ in range(2)]
    assert list_checkpoints(root) == [good, bad[1]]
    assert _snapshot(served) == files
    assert ServingEngine.load(served).table_names == ("t", "u")
    # A damaged manifest is still listed: restoring it says so, never an older one silently.
    (bad[1] / "manifest.json").write_text("{not json")
    assert ckpt_mod.latest_checkpoint(root) == bad[1]
    with pytest.raises(CheckpointError, match=r"manifest.json is not valid JSON"):
        ee.EmbeddingEngine.load(root)
    # A folder holding only the export holds no checkpoint.
    alone = tmp_path / "alone"
    alone.mkdir()
    served.rename(alone / served.name)
    assert ckpt_mod.latest_checkpoint(alone) is None and list_checkpoints(alone) == []
    with pytest.raises(CheckpointError, match=r"no complete checkpoint at"):
        ee.EmbeddingEngine.load(alone)


# -- the step's bound: int64, as the kernels and checkpoints hold it -----------------------------

LAST_STEP = 2**63 - 1


def _at_step(eng: ee.EmbeddingEngine, step: int) -> ee.EmbeddingEngine:
    state = eng.state_dict()
    state["step"] = step
    eng.load_state_dict(state)
    return eng


def _features() -> dict:
    return {
        "f": ee.Ragged(np.array([1, 2, 3]), lengths=[2, 1]),
        "g": ee.Ragged(np.array([4, 5]), lengths=[1, 1]),
    }


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_a_checkpoint_at_the_last_step_restores_and_refuses_the_next_training_step(
    tmp_path, backend
):
    """Step 2**63 - 1 restores; the training step that would count past it is a ValueError
    naming the step, before anything changes. It used to run (its ``step + 1`` wrapped in the
    kernels: NaN for Adam's bias correction, -9.2e17 in a FrequencyEstimator table), count the
    step to 2**63 and save a checkpoint no restore accepts (numba: OverflowError next step)."""
    path = _at_step(_engine(), LAST_STEP).save(tmp_path)
    eng = ee.EmbeddingEngine.load(path, backend=backend)
    assert eng.step == LAST_STEP
    before = _state(eng)
    with pytest.raises(ValueError, match=r"step is 9,223,372,036,854,775,807 \(2\*\*63 - 1\)"):
        eng.lookup(_features())
    _assert_unchanged(eng, before, LAST_STEP)
    eng.lookup(_features(), training=False)  # evaluation is not a step
    batch = eng.preprocess(_features())
    with pytest.raises(ValueError, match="one more training step would overflow"):
        eng.lookup(batch)
    grads = {"f": np.ones((2, 4), np.float32), "g": np.ones((2, 2), np.float32)}
    with pytest.raises(ValueError, match="one more training step would overflow"):
        eng.apply_gradients(grads, batch=batch)
    _assert_unchanged(eng, before, LAST_STEP)
    assert ee.EmbeddingEngine.load(eng.save(tmp_path)).step == LAST_STEP


@pytest.mark.parametrize(
    "opt", [O.Adam(learning_rate=0.1, bias_correction="global")], ids=["adam_global"]
)
def test_the_step_before_the_last_trains_with_its_one_based_step_in_range(tmp_path, opt):
    """The optimizers that use ``step + 1`` (numba kernels, int64) train at 2**63 - 2, and the
    engine then stands at the last step, which saves and restores (a table that keeps steps
    in an int32 slot stops at 2**31 - 1: the test below)."""
    dim = 1 if isinstance(opt, O.FrequencyEstimator) else 4
    table = ee.TableConfig(20, dim, name="t", combiner="sum", optimizer=opt)
    eng = _at_step(
        ee.EmbeddingEngine({"f": ee.FeatureConfig(table)}, backend="numba"), LAST_STEP - 1
    )
    acts = eng.lookup({"f": ee.Ragged(np.array([1, 2, 3]), lengths=[2, 1])})
    eng.apply_gradients({"f": np.ones_like(acts["f"])})
    assert eng.step == LAST_STEP
    assert np.isfinite(eng.embedding_tables["t"]).all()
    assert (eng.embedding_tables["t"] > -1e6).all()  # no wrapped step in a frequency table
    assert ee.EmbeddingEngine.load(eng.save(tmp_path)).step == LAST_STEP
    with pytest.raises(ValueError, match="one more training step would overflow"):
        eng.lookup({"f": ee.Ragged(np.array([1]), lengths=[1])})


INT32_LAST = 2**31 - 1


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize(
    "opt",
    [O.FrequencyEstimator(), O.BatchSoftmax(0.25), O.Adam(0.1, bias_correction="per_row")],
    ids=["frequency", "batch_softmax", "adam_per_row"],
)
def test_a_table_keeping_steps_in_int32_stops_at_2_31(backend, opt):
    """FrequencyEstimator's and BatchSoftmax's last step seen (``step + 1``) and Adam's
    per-row update counts live in int32 slots: the training step at 2**31 - 2 stores 2**31 - 1
    exactly; the next would wrap it silently (every row then looked unseen for ~2**32 steps),
    so it is a ValueError naming the table and its slot, nothing changed; evaluation goes on.
    An engine without such a slot trains past 2**31."""
    dim = 4 if isinstance(opt, O.Adam) else 1
    table = ee.TableConfig(20, dim, name="t", combiner="sum", optimizer=opt)
    eng = _at_step(
        ee.EmbeddingEngine({"f": ee.FeatureConfig(table)}, backend=backend), INT32_LAST - 1
    )
    feats = {"f": ee.Ragged(np.array([1, 2, 3]), lengths=[2, 1])}
    acts = eng.lookup(feats)
    eng.apply_gradients({"f": np.ones_like(acts["f"])})
    (slot,) = [k for k, v in eng.slots("t").items() if v.dtype == np.int32]
    stored = eng.slots("t")[slot][[1, 2, 3], 0]
    assert (stored == (INT32_LAST if dim == 1 else 1)).all(), stored
    before = _state(eng)
    message = rf"table 't' \({type(opt).__name__}\) keeps steps in its int32 slot '{slot}'"
    with pytest.raises(ValueError, match=message + r".*step is 2,147,483,647"):
        eng.lookup(feats)
    with pytest.raises(ValueError, match=message):
        eng.apply_gradients({"f": np.ones_like(acts["f"])}, batch=eng.preprocess(feats))
    _assert_unchanged(eng, before, INT32_LAST)
    eng.lookup(feats, training=False)
    plain = ee.TableConfig(20, 4, name="t", combiner="sum", optimizer=O.Adagrad(0.1))
    other = _at_step(ee.EmbeddingEngine({"f": ee.FeatureConfig(plain)}, backend=backend), 2**32)
    acts = other.lookup(feats)
    other.apply_gradients({"f": np.ones_like(acts["f"])})
    assert other.step == 2**32 + 1


def _counting_engine(opt, backend="reference") -> ee.EmbeddingEngine:
    dim = 4 if isinstance(opt, O.Adam) else 1
    table = ee.TableConfig(20, dim, name="t", combiner="sum", optimizer=opt)
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(table)}, backend=backend)
    for ids in ([1, 2, 3], [2, 3, 3]):
        acts = eng.lookup({"f": ee.Ragged(np.array(ids), lengths=[2, 1])})
        eng.apply_gradients({"f": np.ones_like(acts["f"])})
    return eng


def _rewrite_slot(path: Path, tensor: str, row: int, value: int) -> None:
    """Set one int32 value of a checkpoint's tensor, its file's size and hash in the manifest
    rewritten to match (a crafted checkpoint)."""
    m = json.loads((path / "manifest.json").read_text())
    (name,) = [f for f in m["files"] if f.endswith(".safetensors")]
    header = read_header(path / name)
    tensors = {
        n: np.array(read_tensor(path / name, n, header=header))
        for n in header[0]
        if n != "__metadata__"
    }
    tensors[tensor][row, 0] = value
    (path / name).unlink()
    write_safetensors(path / name, tensors, header[0].get("__metadata__"))
    _edit_manifest(path, lambda m: m["files"].__setitem__(name, _file_entry(path / name)))


@pytest.mark.parametrize("value", [-1, 3, INT32_LAST], ids=["negative", "past_step", "int32_max"])
@pytest.mark.parametrize(
    "opt",
    [
        O.FrequencyEstimator(),
        O.BatchSoftmax(0.25),
        O.Adam(0.1, bias_correction="per_row"),
        O.AMSGrad(0.1, bias_correction="per_row"),
    ],
    ids=["frequency", "batch_softmax", "adam_per_row", "amsgrad_per_row"],
)
def test_a_step_counter_out_of_its_range_is_refused_at_load(tmp_path, opt, value):
    """An int32 slot of steps holds, after real training, a value in [0, step]: the 1-based
    step that last saw the row (0: never), or the row's count of updates (one a step with
    gradient accumulation). A state or checkpoint holding another is refused, naming the
    table, slot, id and value, before anything changes; it used to load, and the next update
    raised NonFiniteUpdateError blaming the learning rates (a negative count made Adam's
    bias correction NaN), or at 2**31 - 1 wrapped (reference) or raised (numba)."""
    src = _counting_engine(opt)
    (slot,) = [k for k, v in src.slots("t").items() if v.dtype == np.int32]
    assert src.slots("t")[slot].min() >= 0 and src.slots("t")[slot].max() == 2
    path = src.save(tmp_path)
    assert ee.EmbeddingEngine.load(path).slots("t")[slot].tobytes() == (
        src.slots("t")[slot].tobytes()
    )
    state = copy.deepcopy(src.state_dict())
    state["tables"]["t"][slot][3, 0] = value
    message = (
        rf"table 't': slot '{slot}' of id 3 is {value} \(state\['tables'\]\['t'\]"
        rf"\['{slot}'\]\[3, 0\]\), out of range \[0, 2\] \(what {type(opt).__name__} "
        r"holds there at step 2\); nothing was changed"
    )
    eng = _counting_engine(opt)
    eng.lookup({"f": ee.Ragged(np.array([4]), lengths=[1])})  # a pending batch: kept
    before = _state(eng)
    with pytest.raises(ValueError, match=message):
        eng.load_state_dict(state)
    _assert_unchanged(eng, before, 2)
    eng.apply_gradients({"f": np.ones((1, eng.embedding_tables["t"].shape[1]), np.float32)})
    _rewrite_slot(path, f"t/{slot}", 3, value)
    eng = _counting_engine(opt)
    before = _state(eng)
    with pytest.raises(CheckpointError, match=message):
        eng.restore(path)
    _assert_unchanged(eng, before, 2)
    with pytest.raises(CheckpointError, match=message):
        ee.EmbeddingEngine.load(path)


def test_adam_without_accumulation_counts_past_the_step_and_loads():
    """Without gradient accumulation each occurrence is an update: Adam's per-row count may
    pass the step (2**31 - 1 at most), and such a state loads; a negative one does not."""
    opt = O.Adam(0.1, bias_correction="per_row", use_gradient_accumulation=False)
    src = _counting_engine(opt)
    assert src.slots("t")["steps"][3, 0] == 3  # ids 3 and 3 at step 1
    state = copy.deepcopy(src.state_dict())
    eng = _counting_engine(opt)
    state["tables"]["t"]["steps"][5, 0] = INT32_LAST
    eng.load_state_dict(state)
    assert eng.slots("t")["steps"][5, 0] == INT32_LAST
    state["tables"]["t"]["steps"][5, 0] = -1
    with pytest.raises(ValueError, match=r"slot 'steps' of id 5 is -1 .* \[0, 2,147,483,647\]"):
        eng.load_state_dict(state)


@pytest.mark.parametrize("opt_class", [O.Adam, O.AMSGrad])
def test_a_per_row_update_count_stops_at_int32s_largest_on_both_backends(opt_class):
    """Without gradient accumulation a hot row counts an update per occurrence, so training
    alone may take its count to 2**31 - 1: the count stops there (it wrapped to -2**31 on
    the reference backend, and the bias correction of a negative count is not a number), and
    both backends give the same rows."""
    opt = opt_class(0.1, bias_correction="per_row", use_gradient_accumulation=False)
    engines = [_counting_engine(opt, backend) for backend in ("reference", "numba")]
    state = copy.deepcopy(engines[0].state_dict())
    state["tables"]["t"]["steps"][5, 0] = INT32_LAST - 1
    for eng in engines:
        eng.load_state_dict(state)
        acts = eng.lookup({"f": ee.Ragged(np.array([5, 5, 5, 6]), lengths=[3, 1])})
        eng.apply_gradients({"f": np.ones_like(acts["f"])})  # row 5: three updates
    ref, fast = (e.slots("t") for e in engines)
    assert ref["steps"][5, 0] == fast["steps"][5, 0] == INT32_LAST
    for name in ("momenta", "velocities"):
        np.testing.assert_allclose(fast[name], ref[name], rtol=1e-6)
    rows = [e.embedding_tables["t"] for e in engines]
    assert np.isfinite(rows[0]).all() and np.isfinite(rows[1]).all()
    np.testing.assert_allclose(rows[1], rows[0], rtol=1e-6, atol=1e-7)


class _PastInt64(ee.EmbeddingEngine):
    """An engine whose step reads past int64 (as another Stateful's might)."""

    @property
    def step(self) -> int:
        return 2**63


def test_save_refuses_a_step_no_restore_accepts(tmp_path):
    eng = _PastInt64(
        {"f": ee.FeatureConfig(ee.TableConfig(5, 2, name="t"))},
        optimizer=O.SGD(learning_rate=0.1),
        backend="reference",
    )
    with pytest.raises(
        ValueError, match=r"step 9223372036854775808 is not an int in \[0, 2\*\*63\)"
    ):
        ckpt_mod.save(eng, tmp_path / "ck")
    assert not (tmp_path / "ck").exists() or list_checkpoints(tmp_path / "ck") == []


# -- keep=N and checkpoints being read ------------------------------------------------------------


class _SavesMidRestore(ee.EmbeddingEngine):
    """An engine whose restore lets another engine save to the same root with keep=1 after the
    first table is copied (as a trainer saving in another process would, with its own open
    file description of the folder: flock makes no difference between the two)."""

    root: Path

    def load_state_dict(self, state, strict=True):
        source = state["tables"]["u"]["weights"]
        root = self.root

        class SaveFirst:
            shape, dtype = source.shape, source.dtype

            def read_into(self, out):
                other = _engine(seed=9)
                _train(other, 3)
                other.save(root, keep=1)
                source.read_into(out)

        state["tables"]["u"]["weights"] = SaveFirst()
        return super().load_state_dict(state, strict)


def test_keep_does_not_delete_a_checkpoint_while_it_is_restored(tmp_path):
    """A save with keep=1 while an older checkpoint was being restored deleted it: the
    restore failed after table "t" was copied ("Tables ['t'] and part of 'u'"), the engine
    half restored. The checkpoint being read is kept now, and the next save prunes it."""
    eng = _engine()
    _train(eng, 1)
    old = eng.save(tmp_path)
    _train(eng, 1)
    eng.save(tmp_path)
    target = _SavesMidRestore(
        {
            "f": ee.FeatureConfig(ee.TableConfig(20, 4, name="t", combiner="sum")),
            "g": ee.FeatureConfig(
                ee.TableConfig(15, 2, name="u", optimizer=O.FTRL(learning_rate=0.2))
            ),
        },
        optimizer=O.Adagrad(learning_rate=0.1),
        seed=3,
        backend="reference",
    )
    target.root = tmp_path
    assert target.restore(old).step == 1
    assert _state(target) == _state(ee.EmbeddingEngine.load(old))
    newest = list_checkpoints(tmp_path)[-1]
    assert list_checkpoints(tmp_path) == [old, newest]  # kept while read, pruned after
    last = eng.save(tmp_path, keep=1)
    assert list_checkpoints(tmp_path) == [last]


def test_an_open_reader_keeps_its_checkpoint_until_closed(tmp_path):
    eng = _engine()
    _train(eng, 1)
    old = eng.save(tmp_path)
    spec, reader = ckpt_mod.read_checkpoint(old)
    newer = eng.save(tmp_path, keep=1)
    assert list_checkpoints(tmp_path) == [old, newer]
    restored = _engine(seed=11)
    assert reader.restore(restored).step == 1
    reader.close()
    newest = eng.save(tmp_path, keep=1)
    assert list_checkpoints(tmp_path) == [newest]
    with pytest.raises(CheckpointError, match=r"checkpoint .*ckpt-000001-step000000000001 is gone"):
        _engine(seed=11).restore(old)


@pytest.mark.parametrize("given", ["root", "checkpoint"])
def test_inspect_keeps_its_checkpoint_until_the_headers_are_read(tmp_path, monkeypatch, given):
    """``describe`` (embengine inspect) read the manifest under the checkpoint's lock, released
    it, then read every table file's header again: a save with keep=1 in between pruned the
    checkpoint, and the header read was a bare FileNotFoundError. A real save runs just before
    the first header read here (``inspect.read_header``, delegating); the checkpoint is kept
    while described, and pruned by the next save after."""
    from embengine import inspect

    eng = _engine()
    _train(eng, 1)
    old = eng.save(tmp_path)
    header, saves = inspect.read_header, []

    def save_then_read(*args, **kwargs):
        if not saves:
            _train(eng, 1)
            saves.append(eng.save(tmp_path, keep=1))
        return header(*args, **kwargs)

    monkeypatch.setattr(inspect, "read_header", save_then_read)
    text = describe(tmp_path if given == "root" else old)
    assert text.startswith(f"checkpoint {old}: step 1") and "table 't'" in text
    assert list_checkpoints(tmp_path) == [old, saves[0]]
    newest = eng.save(tmp_path, keep=1)
    assert list_checkpoints(tmp_path) == [newest]


def test_a_link_to_a_checkpoint_folder_is_read_through_its_lock(tmp_path):
    """The read lock compares the folder it locked with the path's target (a link such as
    ``latest -> ckpt-...`` is not a folder renamed away)."""
    eng = _engine()
    _train(eng, 1)
    (tmp_path / "latest").symlink_to(eng.save(tmp_path / "ck"))
    assert ee.EmbeddingEngine.load(tmp_path / "latest").step == 1


def _restore_the_older_in_a_loop(root: str, seconds: float, queue) -> None:
    """Restore the older of two checkpoints again and again while another process saves with
    keep=2: each restore succeeds or, if the checkpoint went before it was opened, says so
    with the engine unchanged. Reports the outcomes."""
    eng = _engine(seed=11, vocab=50_000, dim=16)
    outcomes: dict[str, int] = {}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done = list_checkpoints(Path(root))
        if len(done) < 2:
            continue
        try:
            eng.restore(done[0])
            what = "ok"
        except CheckpointError as e:
            what = "gone" if " is gone " in str(e) else f"CheckpointError: {e}"
        except Exception as e:  # reported
            what = f"{type(e).__name__}: {e}"
        outcomes[what] = outcomes.get(what, 0) + 1
    queue.put(outcomes)


def _save_in_a_loop(root: str, stop) -> None:
    eng = _engine(seed=5, vocab=50_000, dim=16)
    while not stop.is_set():
        eng.save(root, keep=2)


def test_restores_in_one_process_while_another_saves_with_keep(tmp_path):
    """Across processes: at HEAD about one restore in seven left a half-restored engine and
    one in seven raised a bare FileNotFoundError."""
    root = tmp_path / "ck"
    eng = _engine(seed=5, vocab=50_000, dim=16)
    eng.save(root)
    eng.save(root)
    ctx = multiprocessing.get_context("spawn")
    stop, queue = ctx.Event(), ctx.Queue()
    saver = ctx.Process(target=_save_in_a_loop, args=(str(root), stop))
    reader = ctx.Process(target=_restore_the_older_in_a_loop, args=(str(root), 4.0, queue))
    saver.start()
    reader.start()
    try:
        outcomes = queue.get(timeout=300)
    finally:
        stop.set()
        for p in (reader, saver):
            p.join(60)
            if p.is_alive():
                p.kill()
    assert set(outcomes) <= {"ok", "gone"}, outcomes
    assert outcomes.get("ok", 0) >= 5, outcomes
    assert saver.exitcode == 0
