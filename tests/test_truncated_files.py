"""Files that are memory-mapped after their manifest was checked, truncated (a partial copy,
a full disk, a copy written over them in place): an error naming the file and its sizes, never
a SIGBUS that kills the process.

Two readers map such files: ``ServingEngine`` (an export's table files, for as long as it
serves) and export (a checkpoint's tables, while it encodes them). A truncation before loading
was refused already (the manifest's sizes); one after the file was checked read zeros from the
last page of the file, or killed the process with SIGBUS past it. Memory-mapped tables
(``storage="mmap"``) and keyed-mmap arenas are files the engine creates and sizes itself:
tests/test_mmap_storage.py."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import embengine as ee
from embengine import optimizers as O
from embengine import serving
from embengine.checkpoint import CheckpointError, read_checkpoint
from embengine.serving import ServingEngine, export, read_serving_manifest

VOCAB, DIM = 4096, 16  # fp32: 256 KiB of rows, 64 pages
ROW = DIM * 4  # bytes of one row (fp32)
FILE = "table-000.safetensors"
CUTS = {"few-bytes": 3, "one-row": ROW}


def _engine(keyed: bool = False) -> ee.EmbeddingEngine:
    vocab = None if keyed else VOCAB
    dynamic = ee.DynamicVocabulary(expire_steps=100) if keyed else None
    t = ee.TableConfig(vocab, DIM, name="t", dynamic=dynamic)
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t)}, optimizer=O.SGD(learning_rate=0.1), seed=1, backend="numba"
    )
    if keyed:  # rows for keys 0 .. VOCAB - 1
        eng.lookup({"f": np.arange(VOCAB)})
        eng.apply_gradients({"f": np.ones((VOCAB, DIM), np.float32)})
    return eng


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return _engine().save(tmp_path_factory.mktemp("ck"))


@pytest.fixture
def exported(checkpoint, tmp_path) -> Path:
    export(checkpoint, tmp_path / "out")
    return tmp_path / "out"


def _truncate(file: Path, cut: int) -> tuple[int, int]:
    """Shorten ``file`` by ``cut`` bytes in place: (its size before, its size after)."""
    size = file.stat().st_size
    os.truncate(file, size - cut)
    return size, size - cut


def _sizes(file: Path, size: int, expected: int) -> str:
    """The part of the error every refusal here makes: the file, its size, the expected one."""
    return f"{file} has {size:,} bytes, the manifest says {expected:,}"


def _child(code: str, *args: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(ee.__file__).parents[1])}
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


# -- ServingEngine ---------------------------------------------------------------------------------

_SERVE_THEN_TRUNCATE = """
import os, sys
import numpy as np
from embengine.serving import ServingEngine
out = sys.argv[1]
serving = ServingEngine.load(out)
serving.lookup({"f": np.array([4095])})  # mapped and read
os.truncate(os.path.join(out, "table-000.safetensors"), 4096)  # a copy over it, under way
try:
    serving.lookup({"f": np.array([4095])})  # row 4095 lies 60 pages past the end
except ValueError as e:
    print("refused:", e)
"""


def test_a_lookup_in_a_file_truncated_while_served_does_not_kill_the_process(exported):
    """The crash: a file of a served export truncated in place (here to 4 KiB; a copy of a new
    export written over the served one), then a lookup of a row past its new end: the process
    died of SIGBUS. Now the lookup raises, naming the file and both sizes."""
    file = exported / FILE
    size = file.stat().st_size
    done = _child(_SERVE_THEN_TRUNCATE, exported)
    assert done.returncode != -signal.SIGBUS, f"SIGBUS:\n{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, done.stderr
    assert f"refused: {_sizes(file, 4096, size)}" in done.stdout, done.stdout


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("cut", CUTS.values(), ids=CUTS.keys())
def test_serving_refuses_a_truncated_export_at_load(exported, cut, verify):
    """A file truncated before the export is loaded (a partial copy, a full disk): refused
    before anything is mapped, with and without the hashes, naming the file, its size and the
    manifest's, and saying what to do."""
    file = exported / FILE
    size, short = _truncate(file, cut)
    with pytest.raises(CheckpointError) as e:
        ServingEngine.load(exported, verify=verify)
    assert _sizes(file, short, size) in str(e.value)
    assert "copy the export again, whole, or re-export it" in str(e.value)


@pytest.mark.parametrize("cut", CUTS.values(), ids=CUTS.keys())
def test_serving_engine_checks_the_size_of_the_file_it_maps(exported, cut):
    """A file truncated after ``read_serving_manifest`` checked it and before the engine maps
    it: the engine checks the size (and the header) of the file it opens and maps, and refuses
    it as the load does (it was a bare ValueError of the header, which it read again)."""
    file = exported / FILE
    manifest = read_serving_manifest(exported)
    size, short = _truncate(file, cut)
    with pytest.raises(CheckpointError, match="re-export it") as e:
        ServingEngine(exported, manifest)
    assert _sizes(file, short, size) in str(e.value)


@pytest.mark.parametrize("cut", CUTS.values(), ids=CUTS.keys())
def test_serving_refuses_a_lookup_in_a_file_truncated_while_served(exported, cut):
    """A served file truncated by less than its last page does not crash, but its rows past
    the end read as zeros: every lookup is refused instead (one fstat per table file), the
    rows at the start of the file too, naming the file and both sizes."""
    file = exported / FILE
    served = ServingEngine.load(exported)
    before = served.lookup({"f": np.array([0, VOCAB - 1])})["f"]
    assert np.all(before[1] != 0)
    size, short = _truncate(file, cut)
    for ids in ([VOCAB - 1], [0]):
        with pytest.raises(CheckpointError, match="while served") as e:
            served.lookup({"f": np.array(ids)})
        assert _sizes(file, short, size) in str(e.value)


def test_serving_refuses_a_lookup_in_a_file_written_over_at_the_same_size(exported, tmp_path):
    """Another export of the same size copied over a served file in place (the path keeps
    its inode, the mapping shows the new bytes at the old manifest's offsets): every lookup is
    refused, naming the file, from the file's modification time (the same fstat as the size)."""
    other = _engine()
    other.lookup({"f": np.arange(VOCAB)})
    other.apply_gradients({"f": np.full((VOCAB, DIM), 3.0, np.float32)})
    export(other.save(tmp_path / "ck2"), tmp_path / "out2")
    file, new = exported / FILE, (tmp_path / "out2" / FILE).read_bytes()
    assert len(new) == file.stat().st_size and new != file.read_bytes()
    served = ServingEngine.load(exported)
    before = served.lookup({"f": np.array([0, 7])})["f"]
    ino = file.stat().st_ino
    with open(file, "r+b") as f:  # in place: no truncation, the same size
        f.write(new)
    st = file.stat()
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # a coarse clock's same tick
    assert file.stat().st_ino == ino
    with pytest.raises(CheckpointError, match="was written while served") as e:
        served.lookup({"f": np.array([0, 7])})
    assert str(file) in str(e.value)
    again = ServingEngine.load(tmp_path / "out2").lookup({"f": np.array([0, 7])})["f"]
    assert not np.array_equal(again, before)  # what the old mapping would have mixed in


# -- export: a checkpoint's tables -----------------------------------------------------------------


@pytest.mark.parametrize("cut", CUTS.values(), ids=CUTS.keys())
def test_export_refuses_a_checkpoint_file_truncated_while_read(
    checkpoint, tmp_path, cut, monkeypatch
):
    """A checkpoint file truncated after export checked it, while its rows are read: export
    reads them with read(), so the short read is a ValueError naming the file and both sizes
    (a memory map read zeros there: the export was written, its last values zeros), and OUT is
    not written."""
    ck = tmp_path / "ck"
    shutil.copytree(checkpoint, ck)
    file = ck / FILE
    encode = serving._encode_table

    def truncating(weights, *args):
        sizes.append(_truncate(file, cut))
        return encode(weights, *args)

    sizes: list[tuple[int, int]] = []
    monkeypatch.setattr(serving, "_encode_table", truncating)
    with pytest.raises(ValueError) as e:
        export(ck, tmp_path / "out")
    ((size, short),) = sizes
    assert f"{file} has {short:,} bytes, its header says {size:,}" in str(e.value)
    assert "copy the checkpoint again" in str(e.value)
    assert not (tmp_path / "out").exists()


def test_export_of_a_keyed_table_checks_the_checkpoint_file_first(tmp_path, monkeypatch):
    """A keyed table's checkpoint file truncated after the checks and before export reads it
    (keys, last touched steps, weights): refused by its size first, whichever tensor lost its
    bytes (a tensor export does not read was not noticed; a mapped one was a bare "mmap length
    is greater than file size")."""
    ck = _engine(keyed=True).save(tmp_path / "ck")
    file = ck / FILE
    real = serving._export
    sizes: list[tuple[int, int]] = []

    def truncating(*args):
        sizes.append(_truncate(file, 3))
        return real(*args)

    monkeypatch.setattr(serving, "_export", truncating)
    with pytest.raises(CheckpointError) as e:
        export(ck, tmp_path / "out")
    ((size, short),) = sizes
    assert _sizes(file, short, size) in str(e.value)
    assert "copy the checkpoint again" in str(e.value)


@pytest.mark.parametrize("cut", CUTS.values(), ids=CUTS.keys())
@pytest.mark.parametrize("read", ["weights", "array", "rows"])
def test_checkpoint_reader_checks_the_size_before_mapping(checkpoint, tmp_path, cut, read):
    """``CheckpointReader.weights`` / ``array`` map a tensor, ``rows`` reads it: a file
    truncated since the checkpoint was checked is a CheckpointError naming it and both sizes
    before anything is mapped or read (``np.memmap`` said "mmap length is greater than file
    size", naming nothing)."""
    ck = tmp_path / "ck"
    shutil.copytree(checkpoint, ck)
    file = ck / FILE
    _, reader = read_checkpoint(ck)
    with reader:
        size, short = _truncate(file, cut)
        get = {
            "weights": lambda: reader.weights("t"),
            "array": lambda: reader.array("t", "weights"),
            "rows": lambda: reader.rows("t"),
        }[read]
        with pytest.raises(CheckpointError) as e:
            get()
    assert _sizes(file, short, size) in str(e.value)
    assert "copy the checkpoint again" in str(e.value)


_EXPORT_A_TRUNCATED_CHECKPOINT = """
import os, sys
from embengine import serving
ck, out = sys.argv[1], sys.argv[2]
encode = serving._encode_table
def truncating(weights, *args):  # after every check of the checkpoint, before its rows are read
    os.truncate(os.path.join(ck, "table-000.safetensors"), 4096)
    return encode(weights, *args)
serving._encode_table = truncating
try:
    serving.export(ck, out)
except ValueError as e:
    print("refused:", e)
"""


def test_an_export_of_a_checkpoint_truncated_midway_does_not_kill_the_process(checkpoint, tmp_path):
    """The same crash in export: it mapped the checkpoint's tables (after checking their sizes
    and hashes) and read them chunk by chunk; a file truncated meanwhile killed it with SIGBUS.
    It reads them with read() now: the export fails, naming the file, and OUT is not written."""
    ck = tmp_path / "ck"
    shutil.copytree(checkpoint, ck)
    file = ck / FILE
    size = file.stat().st_size
    done = _child(_EXPORT_A_TRUNCATED_CHECKPOINT, ck, tmp_path / "out")
    assert done.returncode != -signal.SIGBUS, f"SIGBUS:\n{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, done.stderr
    assert "refused: " in done.stdout and str(file) in done.stdout, done.stdout
    assert f"has {4096:,} bytes" in done.stdout and f"{size:,}" in done.stdout, done.stdout
    assert not (tmp_path / "out").exists()
