"""Memory-mapped tables own their files: an exclusive lock per table file (a second engine on one
storage_dir fails and leaves the first untouched), blocks reserved at creation (a full disk is an
OSError, not SIGBUS), and a file truncated under a live table is an error, not SIGBUS.

Anything that could kill the interpreter runs in a subprocess with a hard timeout."""

from __future__ import annotations

import errno
import gc
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import embengine as ee
from embengine import optimizers as O
from embengine.storage import DenseTable, StorageError

REPO = Path(__file__).resolve().parents[1]


def _engine(storage_dir, backend="reference", vocab=100, dim=4) -> ee.EmbeddingEngine:
    t = ee.TableConfig(vocab, dim, name="t", optimizer=O.Adagrad(0.1))
    return ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t)}, storage="mmap", storage_dir=storage_dir, backend=backend
    )


def _step(eng: ee.EmbeddingEngine) -> None:
    eng.lookup({"f": [[1, 2], [3, 4]]})
    eng.apply_gradients({"f": np.full((2, 4), 0.5, np.float32)})


def _state(eng: ee.EmbeddingEngine) -> dict[str, np.ndarray]:
    return {
        "weights": np.array(eng.embedding_tables["t"]),
        **{k: np.array(v) for k, v in eng.slots("t").items()},
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _python(code: str, timeout: float, prefix: list[str] | None = None):
    """Run ``code`` in a fresh interpreter (this checkout's embengine); never waits forever."""
    return subprocess.run(
        [*(prefix or []), sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# -- 1. one engine per table file -----------------------------------------------------------------


def test_second_engine_in_this_process_fails_and_leaves_the_first_untouched(tmp_path):
    first = _engine(tmp_path)
    _step(first)
    before = _state(first)
    with pytest.raises(StorageError) as info:
        _engine(tmp_path)
    msg = str(info.value)
    assert str(tmp_path) in msg and "'t'" in msg and "t.f32" in msg, msg
    assert f"pid {os.getpid()}, this process" in msg, msg
    _assert_same(before, _state(first))  # not re-initialised under it
    # the file too, and the first engine trains on
    first._physical[0].flush()
    on_disk = np.fromfile(tmp_path / "t.f32", dtype=np.float32).reshape(100, -1)
    np.testing.assert_array_equal(on_disk[:, :4], before["weights"])
    _step(first)
    assert not np.array_equal(before["weights"], first.embedding_tables["t"])


def test_second_engine_in_another_process_fails_and_leaves_the_first_untouched(tmp_path):
    first = _engine(tmp_path)
    _step(first)
    before = _state(first)
    out = _python(
        f"""
        import embengine as ee
        t = ee.TableConfig(100, 4, name="t", optimizer=ee.optimizers.SGD(0.1))
        try:
            ee.EmbeddingEngine({{"f": ee.FeatureConfig(t)}}, storage="mmap",
                               storage_dir={str(tmp_path)!r}, backend="reference")
        except ValueError as e:  # StorageError
            print("refused:", type(e).__name__, e)
        """,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused: StorageError"), out.stdout
    assert str(tmp_path) in out.stdout and "'t'" in out.stdout, out.stdout
    assert f"(pid {os.getpid()})" in out.stdout, out.stdout  # the holder: this process
    _assert_same(before, _state(first))
    first._physical[0].flush()
    on_disk = np.fromfile(tmp_path / "t.f32", dtype=np.float32).reshape(100, -1)
    np.testing.assert_array_equal(on_disk[:, :4], before["weights"])


def test_the_lock_goes_with_a_garbage_collected_engine(tmp_path):
    first = _engine(tmp_path)
    _step(first)
    weights = first.embedding_tables["t"]  # a view keeps the mapping, and so the lock, alive
    del first
    gc.collect()
    with pytest.raises(StorageError, match="in use"):
        _engine(tmp_path)
    del weights
    gc.collect()
    second = _engine(tmp_path)  # a fresh table, initialised again
    _step(second)


def test_close_releases_the_lock_unless_views_are_alive(tmp_path):
    eng = _engine(tmp_path)
    _step(eng)
    before = _state(eng)
    table = eng._physical[0]
    slots = eng.slots("t")
    with pytest.raises(StorageError, match="arrays viewing its memory are alive"):
        table.close()
    # a refused close changes nothing: the table still trains, the file is still locked
    _assert_same(before, _state(eng))
    with pytest.raises(StorageError, match="in use"):
        _engine(tmp_path)
    del slots
    table.close()
    table.close()  # twice is fine
    with pytest.raises(StorageError, match="'t' is closed"):
        eng.lookup({"f": [[1]]})
    with pytest.raises(StorageError, match="'t' is closed"):
        table.flush()
    on_disk = np.fromfile(tmp_path / "t.f32", dtype=np.float32).reshape(100, -1)
    np.testing.assert_array_equal(on_disk[:, :4], before["weights"])  # closing kept the data
    other = _engine(tmp_path)  # the lock is free
    _step(other)
    ram = DenseTable("r", 3, 2, (), ee.initializers.Zeros(), 0)
    ram.close()  # RAM: nothing to release, still usable
    assert ram.data.shape == (3, 2)


# -- 2. a full disk fails at creation -------------------------------------------------------------

_CREATE_ON_SMALL_DISK = """
    import errno, os
    import embengine as ee
    d = {dir!r}
    with open(os.path.join(d, "fill"), "wb") as f:  # leave ~424 KiB of the 1 MiB free
        f.write(b"x" * 600 * 1024)
    t = ee.TableConfig(2000, 32, name="t", optimizer=ee.optimizers.Adagrad(0.1))  # 512,000 B
    make = lambda: ee.EmbeddingEngine({{"f": ee.FeatureConfig(t)}}, storage="mmap",
                                      storage_dir=d, backend="reference")
    try:
        make()
        print("created")
    except OSError as e:
        print("errno", e.errno, "|", e)
    print("size after", os.path.getsize(os.path.join(d, "t.f32")))
    os.remove(os.path.join(d, "fill"))
    eng = make()  # room again; the failed attempt left no lock behind
    eng.lookup({{"f": [[1, 2]]}})
    print("then created")
"""


def test_full_disk_is_an_oserror_at_creation_not_sigbus(tmp_path):
    """A real full file system: a 1 MiB tmpfs mounted in a private user + mount namespace
    (``unshare -Urm``; invisible to other processes, gone with the namespace). Without the
    reservation the file was sparse and initialisation died of SIGBUS once the tmpfs filled."""
    small = tmp_path / "small"
    small.mkdir()
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1) to mount a small tmpfs")
    mount = f"mount -t tmpfs -o size=1m none '{small}'"
    probe = subprocess.run(
        [unshare, "-Urm", "sh", "-c", mount], capture_output=True, text=True, timeout=30
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {probe.stderr.strip()}")
    code = textwrap.dedent(_CREATE_ON_SMALL_DISK.format(dir=str(small)))
    # sh mounts, then execs Python with the code as its argument (no quoting of the code)
    out = subprocess.run(
        [unshare, "-Urm", "sh", "-c", f'{mount} && exec "$0" -c "$1"', sys.executable, code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, f"returncode {out.returncode}:\n{out.stdout}\n{out.stderr}"
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"errno {errno.ENOSPC} |"), out.stdout
    assert str(small / "t.f32") in lines[0] and "512,000 bytes" in lines[0], lines[0]
    assert "'t'" in lines[0] and "bytes are free there" in lines[0], lines[0]
    assert lines[1:] == ["size after 0", "then created"], out.stdout  # the space went back


def test_file_size_limit_is_an_oserror_naming_the_file_and_bytes(tmp_path):
    """Portable variant (no namespaces): RLIMIT_FSIZE below the table's size; SIGXFSZ ignored
    so that the write fails with EFBIG instead of killing the process."""
    out = _python(
        f"""
        import resource, signal
        import embengine as ee
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
        t = ee.TableConfig(2000, 32, name="t", optimizer=ee.optimizers.Adagrad(0.1))
        try:
            ee.EmbeddingEngine({{"f": ee.FeatureConfig(t)}}, storage="mmap",
                               storage_dir={str(tmp_path)!r}, backend="reference")
            print("created")
        except OSError as e:
            print("errno", e.errno, "|", e)
        """,
        timeout=120,
    )
    assert out.returncode == 0, f"returncode {out.returncode}:\n{out.stdout}\n{out.stderr}"
    assert out.stdout.startswith(f"errno {errno.EFBIG} |"), out.stdout
    assert str(tmp_path / "t.f32") in out.stdout and "512,000 bytes" in out.stdout, out.stdout
    assert (tmp_path / "t.f32").stat().st_size == 0


def test_a_keyed_tables_file_that_cannot_grow_is_an_oserror_and_keeps_its_rows(tmp_path):
    """keyed-mmap grows its file as keys come: a growth refused (RLIMIT_FSIZE: EFBIG) is an
    OSError naming the table, the file and the bytes; the rows already in the file stay."""
    out = _python(
        f"""
        import resource, signal
        import numpy as np
        import embengine as ee
        t = ee.TableConfig(None, 16, name="k", combiner="sum",
                           initializer=ee.initializers.RowId(0),
                           dynamic=ee.DynamicVocabulary())
        eng = ee.EmbeddingEngine({{"f": ee.FeatureConfig(t)}}, optimizer=ee.optimizers.SGD(0.1),
                                 storage="mmap", storage_dir={str(tmp_path)!r})
        eng.lookup({{"f": [[k] for k in range(1000)]}})  # 1024 rows of 64 bytes: 65,536
        eng.lookup({{"f": [[7]]}}, training=False)  # numba's caches written before the limit
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
        try:
            eng.lookup({{"f": [[k] for k in range(1000, 3000)]}})
            print("grown")
        except OSError as e:
            print("errno", e.errno, "|", e)
        print(eng.lookup({{"f": [[7]]}}, training=False)["f"][0, 0])
        """,
        timeout=600,  # a fresh clone may compile the keyed kernels here
    )
    assert out.returncode == 0, f"returncode {out.returncode}:\n{out.stdout}\n{out.stderr}"
    first, value = out.stdout.splitlines()
    assert first.startswith(f"errno {errno.EFBIG} |"), out.stdout
    assert "table 'k'" in first and str(tmp_path / "k.f32") in first, first
    assert "growing it to" in first, first
    assert float(value) == 7.0  # RowId(0): key 7's row is 7.0, still in the file
    assert (tmp_path / "k.f32").stat().st_size >= 65_536


# -- 3. a file truncated under a live table -------------------------------------------------------


@pytest.mark.parametrize("when", ["before lookup", "before apply_gradients"])
def test_file_truncated_under_a_running_engine_raises_not_sigbus(tmp_path, backend, when):
    out = _python(
        f"""
        import subprocess
        import numpy as np
        import embengine as ee
        t = ee.TableConfig(5000, 16, name="t", optimizer=ee.optimizers.Adagrad(0.1))
        eng = ee.EmbeddingEngine({{"f": ee.FeatureConfig(t)}}, storage="mmap",
                                 storage_dir={str(tmp_path)!r}, backend={backend!r})
        ids = [[1, 4999], [2500, 3]]  # row 4999 lies past the truncated end
        eng.lookup({{"f": ids}})
        eng.apply_gradients({{"f": np.ones((2, 16), np.float32)}})
        truncate = lambda: subprocess.run(["truncate", "-s", "4096", {str(tmp_path / "t.f32")!r}],
                                          check=True, timeout=30)  # another program
        try:
            if {when!r} == "before lookup":
                truncate()
            eng.lookup({{"f": ids}})
            if {when!r} == "before apply_gradients":
                truncate()
            eng.apply_gradients({{"f": np.ones((2, 16), np.float32)}})
            print("no error")
        except ValueError as e:  # StorageError
            print("refused:", type(e).__name__, e)
        """,
        timeout=900 if backend == "numba" else 120,  # a first numba compile takes minutes
    )
    assert out.returncode != -signal.SIGBUS, f"SIGBUS:\n{out.stdout}\n{out.stderr}"
    assert out.returncode == 0, f"returncode {out.returncode}:\n{out.stdout}\n{out.stderr}"
    assert out.stdout.startswith("refused: StorageError"), out.stdout
    msg = out.stdout
    assert str(tmp_path / "t.f32") in msg and "4,096 bytes" in msg, msg
    assert f"needs {5000 * 32 * 4:,}" in msg, msg


def test_check_file_is_silent_on_a_healthy_table(tmp_path):
    eng = _engine(tmp_path)
    table = eng._physical[0]
    table.check_file()
    DenseTable("r", 3, 2, (), ee.initializers.Zeros(), 0).check_file()  # RAM: nothing to check
    os.truncate(tmp_path / "t.f32", table.nbytes - 4)  # one float short
    with pytest.raises(StorageError, match=f"is {table.nbytes - 4:,} bytes"):
        table.check_file()


def test_an_engine_closes_its_files_for_another_engine(tmp_path):
    """The in-use error says to close the other engine: ``engine.close()`` (or a ``with``
    block) releases every table's file, keyed tables' too; its RAM tables still work."""
    keyed = ee.TableConfig(None, 4, name="k", optimizer=O.Adagrad(0.1))
    ram = ee.TableConfig(5, 4, name="r", optimizer=O.Adagrad(0.1))

    def engine():
        return ee.EmbeddingEngine(
            {
                "f": ee.FeatureConfig(ee.TableConfig(100, 4, name="t")),
                "g": ee.FeatureConfig(keyed),
                "h": ee.FeatureConfig(ram),
            },
            optimizer=O.Adagrad(0.1),
            storage={"t": "mmap", "k": "mmap", "r": "ram"},
            storage_dir=tmp_path,
        )

    first = engine()
    first.lookup({"f": [[1]], "g": [[7]], "h": [[2]]})
    weights = first.slots("t")  # a live view of the mmap table
    with pytest.raises(StorageError, match=r"in use .*engine\.close\(\)"):
        engine()
    with pytest.raises(StorageError, match="arrays viewing its memory are alive"):
        first.close()  # 't' stays open (a view of it is alive); 'k' closed
    del weights
    first.close()
    first.close()  # twice is fine
    with pytest.raises(StorageError, match="is closed"):
        first.lookup({"f": [[1]], "g": [[7]], "h": [[2]]})
    with engine() as second:  # the files are free
        second.lookup({"f": [[1]], "g": [[7]], "h": [[2]]})
    third = engine()  # and free again after the block
    third.close()
