"""Memory-mapped tables own their files: an exclusive lock per table file (a second engine on one
storage_dir fails and leaves the first untouched).

Anything that could kill the interpreter runs in a subprocess with a hard timeout."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import embengine as ee
from embengine import optimizers as O
from embengine.storage import StorageError

REPO = Path(__file__).resolve().parents[1]


def _engine(storage_dir, backend="reference", vocab=100, dim=4) -> ee.EmbeddingEngine:
    t = ee.TableConfig(vocab, dim, name="t", optimizer=O.Adagrad(0.1))
    return ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, storage="mmap",
                              storage_dir=storage_dir, backend=backend)  # fmt: skip


def _step(eng: ee.EmbeddingEngine) -> None:
    eng.lookup({"f": [[1, 2], [3, 4]]})
    eng.apply_gradients({"f": np.full((2, 4), 0.5, np.float32)})


def _state(eng: ee.EmbeddingEngine) -> dict[str, np.ndarray]:
    return {"weights": np.array(eng.embedding_tables["t"]),
            **{k: np.array(v) for k, v in eng.slots("t").items()}}  # fmt: skip


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _python(code: str, timeout: float, prefix: list[str] | None = None):
    """Run ``code`` in a fresh interpreter (this checkout's embengine); never waits forever."""
    return subprocess.run([*(prefix or []), sys.executable, "-c", textwrap.dedent(code)],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)  # fmt: skip


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
