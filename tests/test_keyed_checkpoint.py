"""Keyed tables (issue 15, item 7) in the state API, checkpoints, export and serving.

A keyed engine saved mid-stream and loaded into a fresh engine continues bit for bit like the
engine that never stopped: keys, rows with their slots, stats counters, pending admissions and
lookups, for admission, expiry, LRU and LFU capacity and insertion on apply, on both backends.
Crafted keyed checkpoints are refused with a CheckpointError naming the entry, the engine
unchanged. An export of a keyed table serves its keys (unknown keys: zeros) exactly as the
training engine's evaluation lookup.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import mmap
import os
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import embengine as ee
from embengine import optimizers as O
from embengine import safetensors_io
from embengine.checkpoint import CheckpointError
from embengine.cli import main as cli_main
from embengine.initializers import RandomUniform
from embengine.inspect import describe
from embengine.safetensors_io import read_header, read_tensor, write_safetensors
from embengine.serving import ServingEngine, export
from embengine.state import GatheredRows, PartialLoadError

# (id, DynamicVocabulary arguments): each rule of a keyed table, mid-stream at the save.
RULES = [
    ("admit1", dict(occurrence_threshold=1)),
    ("admit3-expire", dict(occurrence_threshold=3, expire_steps=2)),
    ("lru", dict(max_rows=12, eviction="lru", occurrence_threshold=1)),
    ("lfu", dict(max_rows=12, eviction="lfu")),
    ("apply-expire", dict(insert_on="apply", expire_steps=3, occurrence_threshold=1)),
]
POOL = np.array([2**62 + 7 * i for i in range(10)] + list(range(-5, 15)), np.int64)


def _engine(backend: str, **dynamic) -> ee.EmbeddingEngine:
    """A keyed table "k" (Adam with a per-row int32 step slot; a bag and a sequence feature)
    and a dense table "d"."""
    k = ee.TableConfig(
        None,
        3,
        name="k",
        combiner="sum",
        initializer=RandomUniform(-0.5, 0.5),
        optimizer=O.Adam(0.05, bias_correction="per_row"),
        dynamic=ee.DynamicVocabulary(**dynamic),
    )
    d = ee.TableConfig(9, 2, name="d", optimizer=O.Adagrad(0.2))
    feats = {"f": ee.FeatureConfig(k), "s": ee.FeatureConfig(k, 2), "g": ee.FeatureConfig(d)}
    return ee.EmbeddingEngine(feats, backend=backend, seed=5)


def _stream(steps: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        f = rng.choice(POOL, (3, 2))
        f[0, 1] = -1  # padding
        out.append({"f": f, "s": rng.choice(POOL, (2, 2)), "g": rng.integers(0, 9, (3, 2))})
    return out


def _step(eng, batch) -> dict:
    acts = eng.lookup(batch)
    eng.apply_gradients({k: np.sin(3 * v) + 0.25 for k, v in acts.items()})
    return acts


def _stats(eng) -> dict:
    """Stats without what describes the arena's memory (a restore compacts it)."""
    st = eng.table_stats()["k"]
    return {k: v for k, v in st.items() if k not in ("capacity", "load_factor", "bytes")}


def _same(a, b) -> None:
    for table in ("k", "d"):
        ca, cb = a.table_contents(table), b.table_contents(table)
        assert set(ca) == set(cb)
        for key in ca:
            assert ca[key].dtype == cb[key].dtype and ca[key].tobytes() == cb[key].tobytes(), key
    assert _stats(a) == _stats(b)
    assert a.step == b.step


@pytest.mark.parametrize("rules", [r for _, r in RULES], ids=[i for i, _ in RULES])
def test_save_load_mid_stream_continues_bit_identically(tmp_path, backend, rules):
    stream, probe = _stream(14), _stream(1, seed=9)[0]
    a = _engine(backend, **rules)
    for batch in stream[:6]:
        _step(a, batch)
    st = a.table_stats()["k"]
    assert st["rows"] > 0 and st["total"]["admitted"] > 0  # mid-stream: the rules are at work
    if "max_rows" in rules:
        assert st["total"]["evicted"] > 0
    if rules.get("occurrence_threshold"):
        assert st["pending_keys"] > 0
    path = a.save(tmp_path / "ckpt")
    loaded = ee.EmbeddingEngine.load(path)
    restored = _engine(backend, **rules)
    restored.restore(path)
    copied = _engine(backend, **rules)
    copied.load_state_dict(copy.deepcopy(a.state_dict()))
    others = (loaded, restored, copied)
    for eng in others:
        _same(a, eng)
    for batch in stream[6:]:
        want = _step(a, batch)
        for eng in others:
            got = _step(eng, batch)
            assert all(got[k].tobytes() == want[k].tobytes() for k in want)
        evaluated = a.lookup(probe, training=False)
        for eng in others:
            got = eng.lookup(probe, training=False)
            assert all(got[k].tobytes() == evaluated[k].tobytes() for k in evaluated)
    for eng in others:
        _same(a, eng)
    assert a.table_stats()["k"]["total"]["expired" if "expire_steps" in rules else "admitted"] > 0


def test_state_dict_of_a_keyed_table_is_a_sorted_snapshot():
    eng = _engine("numba", occurrence_threshold=2)
    for batch in _stream(4):
        _step(eng, batch)
    state = eng.state_dict()["tables"]["k"]
    contents = eng.table_contents("k")
    keys = state["keys"]
    assert keys.dtype == np.int64 and (np.diff(keys) > 0).all()
    for key in ("keys", "weights", "momenta", "velocities", "steps"):
        assert state[key].tobytes() == contents[key].tobytes()
    assert state["steps"].dtype == np.int32
    assert (np.diff(state["pending_keys"]) > 0).all()
    assert not np.isin(state["pending_keys"], keys).any()
    assert (state["touch_counts"] >= 1).all() and (state["last_touched"] < eng.step).all()
    stats = eng.table_stats()["k"]
    total = state["counters"].sum(axis=0)
    assert dict(zip(ee.state.KEYED_COUNTERS, total.tolist(), strict=True)) == stats["total"]
    assert state["meta"].tolist() == [stats["step"], 1 << 22]  # max_pending without max_rows
    before = state["weights"].copy()
    _step(eng, _stream(1, seed=3)[0])
    assert state["weights"].tobytes() == before.tobytes()  # a snapshot, not a view


def test_load_state_dict_checks_a_keyed_state_before_any_change():
    eng = _engine("numba", max_rows=12)
    for batch in _stream(5):
        _step(eng, batch)
    good = copy.deepcopy(eng.state_dict())
    target = _engine("numba", max_rows=12)
    _step(target, _stream(1, seed=4)[0])
    before = copy.deepcopy(target.state_dict())
    at = "state\\['tables'\\]\\['k'\\]"
    n = len(good["tables"]["k"]["keys"])

    def bad(**changes):
        state = copy.deepcopy(good)
        state["tables"]["k"].update(changes)
        return state

    keys = good["tables"]["k"]["keys"]
    cases = [
        (bad(keys=keys[::-1].copy()), f"{at}\\['keys'\\]: key .* comes after the larger key"),
        (bad(keys=np.concatenate([keys[:1], keys[:-1]])), "appears twice"),
        (
            bad(touch_counts=-good["tables"]["k"]["touch_counts"]),
            f"{at}\\['touch_counts'\\]\\[0\\] is -\\d+; it must be >= 0",
        ),
        (
            bad(last_touched=good["tables"]["k"]["last_touched"] + 100),
            f"{at}\\['last_touched'\\]\\[0\\] is \\d+; it must be in \\[0, 5\\]",
        ),
        (bad(keys=keys[:-1]), f"{at}\\['keys'\\] has {n - 1} rows, {at}\\['weights'\\] has {n}"),
        (bad(meta=np.array([9, 5], np.int64)), "meta'\\]\\[0\\] .* is 9"),
    ]
    pend = dict(
        pending_keys=keys[:1],
        pending_earlier=np.ones(1, np.int64),
        pending_step=np.zeros(1, np.int64),
        pending_current=np.zeros(1, np.int64),
    )
    cases.append((bad(**pend), f"{at}\\['pending_keys'\\]: key {keys[0]} has a row too"))
    partial = copy.deepcopy(good)
    del partial["tables"]["k"]["meta"]
    for state, match in cases:
        with pytest.raises(ValueError, match=match):
            target.load_state_dict(state)
        _assert_state(target, before)
    with pytest.raises(ValueError, match="a keyed table's state is loaded whole"):
        target.load_state_dict(partial, strict=False)
    small = _engine("numba", max_rows=n - 1)
    with pytest.raises(ValueError, match=f"holds {n} rows, more than the table's max_rows={n - 1}"):
        small.load_state_dict(good)
    assert small.table_stats()["k"]["rows"] == 0


def _assert_state(eng, want) -> None:
    got = eng.state_dict()
    assert got["step"] == want["step"]
    for table, arrays in want["tables"].items():
        assert set(got["tables"][table]) == set(arrays)
        for key, a in arrays.items():
            assert got["tables"][table][key].tobytes() == a.tobytes(), (table, key)


def _dense_then_keyed(tmp_path: Path, name: str, storage: str) -> ee.EmbeddingEngine:
    """A dense table "a" (copied first by a restore), then a keyed table "k"."""
    a = ee.TableConfig(50, 4, name="a", combiner="sum")
    k = ee.TableConfig(None, 8, name="k", combiner="sum", dynamic=ee.DynamicVocabulary())
    return ee.EmbeddingEngine(
        {"fa": ee.FeatureConfig(a), "fk": ee.FeatureConfig(k)},
        optimizer=O.Adagrad(learning_rate=0.1),
        seed=1,
        backend="reference",
        storage=storage,
        storage_dir=tmp_path / name if storage == "mmap" else None,
    )


class _NoAnonymousMemory:
    """The mmap module, but an anonymous mapping is refused (ENOMEM), as a system out of
    address space refuses it."""

    def __getattr__(self, name):
        return getattr(mmap, name)

    @staticmethod
    def mmap(fileno, *args, **kwargs):
        if fileno == -1:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return mmap.mmap(fileno, *args, **kwargs)


@pytest.mark.parametrize("storage", ["ram", "mmap"])
def test_a_restore_whose_keyed_table_cannot_grow_changes_nothing(tmp_path, monkeypatch, storage):
    """A keyed table makes room for the checkpoint's rows (its arena, or its file) before any
    table changes: a growth the system refuses (a full disk, no memory) is a CheckpointError,
    every table, slot, key, stat and the step as before (it emptied the keyed table after the
    dense one was copied, with a bare OSError)."""
    big = _dense_then_keyed(tmp_path, "big", storage)
    _step(big, {"fa": np.arange(5000) % 50, "fk": np.arange(5000, dtype=np.int64) * 7})
    _step(big, {"fa": np.arange(3) % 50, "fk": np.arange(3, dtype=np.int64)})
    path = big.save(tmp_path / "ckpt")
    small = _dense_then_keyed(tmp_path, "small", storage)
    _step(small, {"fa": np.arange(100) % 50, "fk": np.arange(100, dtype=np.int64)})
    want = copy.deepcopy(small.state_dict())
    stats = small.table_stats()["k"]
    if storage == "mmap":  # the file cannot grow past its 1,024 rows

        def full_disk(fd, offset, length):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", full_disk)
        words = "cannot reserve .*k.f32"
    else:
        from embengine.storage import keyed as keyed_mod

        monkeypatch.setattr(keyed_mod, "mmap", _NoAnonymousMemory())
        words = "table 'k': cannot map"
    with pytest.raises(CheckpointError, match=f"cannot make room.*{words}.*engine is unchanged"):
        small.restore(path)
    _assert_state(small, want)
    assert small.table_stats()["k"] == stats
    monkeypatch.undo()  # room again: the same restore succeeds
    small.restore(path)
    _assert_state(small, big.state_dict())


def test_a_restore_keeps_the_engines_max_pending(tmp_path):
    """The rules are the engine's, max_pending too (restore took the checkpoint's bound, any
    value >= 0, 2^62 too). Pending keys past the engine's bound are forgotten as the bound
    forgets them, seen longest ago first, then smaller keys, and counted as forgotten; a
    bound the setter refuses is refused in a state."""

    def engine(max_rows=None):
        dynamic = ee.DynamicVocabulary(occurrence_threshold=5, max_rows=max_rows)
        k = ee.TableConfig(None, 4, name="k", combiner="sum", dynamic=dynamic)
        return ee.EmbeddingEngine(
            {"f": ee.FeatureConfig(k)}, optimizer=O.SGD(0.1), seed=1, backend="reference"
        )

    src = engine()  # max_pending 2^22
    for keys in (np.arange(30), np.arange(100, 130)):  # steps 0 and 1: 60 keys pending
        _step(src, {"f": keys.astype(np.int64)})
    assert src.table_stats()["k"]["pending_keys"] == 60
    path = src.save(tmp_path / "ckpt")
    dst = engine(max_rows=10)  # max_pending 4 * 10
    dst.restore(path)
    assert dst._physical[0].max_pending == 40
    stats = dst.table_stats()["k"]
    assert stats["pending_keys"] == 40 and stats["total"]["forgotten"] == 20
    want = list(range(20, 30)) + list(range(100, 130))  # step 0's smaller keys forgotten
    assert dst.state_dict()["tables"]["k"]["pending_keys"].tolist() == want
    loaded = copy.deepcopy(src.state_dict())
    dst.load_state_dict(loaded)  # the same through the state API
    assert dst.state_dict()["tables"]["k"]["pending_keys"].tolist() == want
    for bad in (2**31, 2**62, -1):
        loaded["tables"]["k"]["meta"][1] = bad
        with pytest.raises(ValueError, match=rf"\['meta'\]\[1\] \(max_pending\) is {bad}; it"):
            dst.load_state_dict(loaded)
    assert dst._physical[0].max_pending == 40


def test_keyed_counters_past_2_62_are_refused_and_saves_saturate(tmp_path):
    """Stats counters near 2^63 loaded, and then the next save wrote a total that wrapped
    negative (its checkpoint unloadable), and one step later every save failed. A load takes
    counters up to 2^62 - 1, which saves saturate at: whatever is saved loads again."""
    eng = _engine("reference", occurrence_threshold=1)
    _step(eng, _stream(1)[0])
    state = copy.deepcopy(eng.state_dict())
    top = 2**62 - 1
    state["tables"]["k"]["counters"][1, 5] = top + 1
    with pytest.raises(ValueError, match=r"\['counters'\]\[1\]\[5\] \(total 'lookups'\) is"):
        eng.load_state_dict(state)
    state["tables"]["k"]["counters"][:] = top
    eng.load_state_dict(state)
    for batch in _stream(2, seed=3):  # counts more, past 2^62 - 1
        _step(eng, batch)
    path = eng.save(tmp_path / "ckpt")
    loaded = ee.EmbeddingEngine.load(path)
    this, totals = loaded.state_dict()["tables"]["k"]["counters"].tolist()
    assert totals == [top] * 7 and this == list(eng.table_stats()["k"]["this_step"].values())
    entry = json.loads((path / "manifest.json").read_text())["tables"][0]
    assert list(entry["keyed"]["total"].values()) == [top + n for n in this]
    # a crafted checkpoint: a CheckpointError naming the entry, the engine unchanged
    _rewrite(path, change_tensors=_set("k/counters", (0, 0), top + 1))
    want = copy.deepcopy(loaded.state_dict())
    with pytest.raises(CheckpointError, match=r"\['counters'\]\[0\]\[0\] \(this step 'admitted'\)"):
        loaded.restore(path)
    _assert_state(loaded, want)


def _empty_keyed(tmp_path: Path) -> Path:
    """A checkpoint of a keyed table "k" (dim 4, SGD) without rows."""
    k = ee.TableConfig(None, 4, name="k", combiner="sum", dynamic=ee.DynamicVocabulary())
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(k)}, optimizer=O.SGD(0.1), seed=1, backend="reference"
    )
    return eng.save(tmp_path / "ckpt")


@pytest.mark.parametrize("dim", [2**16 + 1, 2**31, 2**70])
def test_a_keyed_table_without_rows_cannot_declare_a_huge_dim(tmp_path, dim):
    """A keyed table without rows holds no bytes whatever its dim, so its files cannot bound
    dim: a 788-byte export of dim 2^31 loaded (a lookup of 2 ids allocated 16 GiB), dim 2^70
    was a bare numpy error. The library's own limit (config.MAX_DIM) is checked on load, a
    CheckpointError naming the manifest, the table and the dim."""
    path = _empty_keyed(tmp_path)
    out = tmp_path / "export"
    export(path, out)
    # the export: the manifest's dim and the weights' header shape [0, dim], hashes recomputed
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["tables"][0]
    entry["dim"] = dim
    f = out / entry["file"]
    header, start = read_header(f)
    header = {**header, "weights": {**header["weights"], "shape": [0, dim]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + f.read_bytes()[start:])
    manifest["files"][entry["file"]] = {
        "sha256": hashlib.sha256(f.read_bytes()).hexdigest(),
        "bytes": f.stat().st_size,
    }
    text = json.dumps(manifest).encode()
    (out / "manifest.json").write_bytes(text)
    (out / "manifest.sha256").write_bytes(hashlib.sha256(text).hexdigest().encode())
    words = rf"manifest.json: tables\[0\] \('k'\): .*dim must be an int in \[1, 65,536\], got {dim}"
    with pytest.raises(CheckpointError, match=words):
        ServingEngine.load(out)
    with pytest.raises(CheckpointError, match=words):
        describe(out)
    # the checkpoint (weights of shape [0, dim]: a dim numpy can make)
    if dim < 2**62:

        def wide(t):
            t["k"] = np.zeros((0, dim), np.float32)

        def manifest_dim(m, entry):
            entry["dim"] = dim
            for p in m.get("storage_plan", {}).get("physical_tables", []):
                p["dim"] = dim

        _rewrite(path, wide, manifest_dim)
        with pytest.raises(CheckpointError, match=words):
            ee.EmbeddingEngine.load(path)
        with pytest.raises(CheckpointError, match=words):
            export(path, tmp_path / "again")


# -- crafted checkpoints ------------------------------------------------------------------------


def _rewrite(ckpt: Path, change_tensors=None, change_manifest=None) -> None:
    """Rewrite the keyed table's file and the manifest of a checkpoint consistently (sizes and
    hashes), as a crafted checkpoint would be."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    entry = next(t for t in manifest["tables"] if t["name"] == "k")
    file = ckpt / entry["file"]
    if change_tensors is not None:
        header = read_header(file)
        tensors = {
            n: np.array(read_tensor(file, n, header=header))
            for n in header[0]
            if n != "__metadata__"
        }
        change_tensors(tensors)
        file.unlink()
        digest = write_safetensors(file, tensors, {"table": "k"})
        manifest["files"][entry["file"]] = {"sha256": digest, "bytes": file.stat().st_size}
    if change_manifest is not None:
        change_manifest(manifest, entry)
    text = json.dumps(manifest, indent=1).encode()
    (ckpt / "manifest.json").write_bytes(text)
    (ckpt / "manifest.sha256").write_bytes(hashlib.sha256(text).hexdigest().encode())


def _swap_first(name):
    def change(t):
        t[name][[0, 1]] = t[name][[1, 0]]

    return change


def _set(name, index, value):
    def change(t):
        t[name][index] = value

    return change


def _duplicate_key(t):
    t["k/keys"][1] = t["k/keys"][0]


def _more_rows_in_manifest(m, entry):
    entry["keyed"]["rows"] += 1


def _max_rows(n):
    def change(m, entry):
        entry["dynamic"]["max_rows"] = n

    return change


def test_crafted_keyed_checkpoints_are_refused_and_change_nothing(tmp_path, backend):
    src = _engine(backend, occurrence_threshold=1)
    for batch in _stream(6):
        _step(src, batch)
    n = src.table_stats()["k"]["rows"]
    at = "state\\['tables'\\]\\['k'\\]"
    cases = [
        ("unsorted", _swap_first("k/keys"), None, f"{at}\\['keys'\\]: key .* comes after"),
        ("duplicate", _duplicate_key, None, f"{at}\\['keys'\\]: key .* appears twice"),
        (
            "negative",
            _set("k/touch_counts", 2, -1),
            None,
            f"{at}\\['touch_counts'\\]\\[2\\] is -1; it must be >= 0",
        ),
        ("pending", _set("k/pending_current", 0, -3), None, "pending_current'\\]\\[0\\] is -3"),
        ("future", _set("k/last_touched", 0, 99), None, "last_touched'\\]\\[0\\] is 99"),
        (
            "negative_steps",
            _set("k/steps", (0, 0), -1),
            None,
            f"table 'k': slot 'steps' of key {src.table_contents('k')['keys'][0]} is -1 "
            f"\\({at}\\['steps'\\]\\[0, 0\\]\\), out of range \\[0, 6\\]",
        ),
        ("future_steps", _set("k/steps", (1, 0), 7), None, "'steps' of key .* is 7 .*\\[0, 6\\]"),
        (
            "rows",
            None,
            _more_rows_in_manifest,
            f"tensor 'k' has dtype F32 and shape \\[{n}, 3\\], expected F32 and shape "
            f"\\[{n + 1}, 3\\]",
        ),
        (
            "max_rows",
            None,
            _max_rows(n - 1),
            f"{at}\\['keys'\\] holds {n} rows, more than the table's max_rows={n - 1}",
        ),
    ]
    for name, tensors, manifest, match in cases:
        path = src.save(tmp_path / name)
        _rewrite(path, tensors, manifest)
        target = _engine(
            backend, occurrence_threshold=1, max_rows=n - 1 if name == "max_rows" else None
        )
        _step(target, _stream(1, seed=8)[0])
        before = copy.deepcopy(target.state_dict())
        with pytest.raises(CheckpointError, match=match):
            target.restore(path)
        _assert_state(target, before)
        with pytest.raises(CheckpointError, match=match):
            ee.EmbeddingEngine.load(path)


def test_a_keyed_checkpoint_does_not_restore_into_a_dense_table(tmp_path):
    src = _engine("numba")
    _step(src, _stream(1)[0])
    path = src.save(tmp_path / "c")
    k = ee.TableConfig(30, 3, name="k", combiner="sum", optimizer=O.Adam(0.05))
    d = ee.TableConfig(9, 2, name="d", optimizer=O.Adagrad(0.2))
    dense = ee.EmbeddingEngine({"f": ee.FeatureConfig(k), "g": ee.FeatureConfig(d)})
    with pytest.raises(
        CheckpointError, match="table 'k': the checkpoint's table is keyed, the engine's is dense"
    ):
        dense.restore(path)


# -- export, serving, inspect -------------------------------------------------------------------


@pytest.mark.parametrize("rules", [{}, dict(expire_steps=1)], ids=["all", "expire"])
def test_served_keyed_lookups_equal_the_training_engines_evaluation(tmp_path, rules):
    eng = _engine("numba", **rules)
    for batch in _stream(6):
        _step(eng, batch)
    path = eng.save(tmp_path / "ckpt")
    probes = _stream(4, seed=11)
    probes[0]["f"][1] = [2**40, -(2**63)]  # never seen: zeros
    for comp in ("fp32", "fp16", "int8_rowwise"):
        out = tmp_path / f"export-{comp}"
        export(path, out, compress=comp)
        served = ServingEngine.load(out)
        rows = len(served._tables["k"][0]["keys"])
        if rules:  # rows expired at the saved step are not exported
            assert 0 < rows < eng.table_stats()["k"]["rows"]
        for probe in probes:
            want = eng.lookup(probe, training=False)
            got = served.lookup(probe)
            for name in want:
                if comp == "fp32":
                    assert got[name].tobytes() == want[name].tobytes(), name
                else:
                    np.testing.assert_allclose(got[name], want[name], atol=0.02)
        assert not served.lookup(probes[0])["f"][1].any()


def test_batches_prepared_by_the_training_engine_and_by_serving_are_interchangeable(tmp_path):
    """A PreparedBatch of a keyed table is served, and a served one looked up by the engine, as
    with dense tables: serving laid a keyed table out at row 0 where the engine has -1 (rows
    that are not ids), so each refused the other's batch as "prepared for another engine",
    naming storage offsets the caller never chose."""
    eng = _engine("numba", occurrence_threshold=1)
    for batch in _stream(5):
        _step(eng, batch)
    assert eng.table_stats()["k"]["pending_keys"] > 0  # some probed keys have no row yet
    export(eng.save(tmp_path / "ckpt"), tmp_path / "out")
    served = ServingEngine.load(tmp_path / "out")
    for probe in _stream(3, seed=21):
        probe["f"][2, 0] = 2**40  # never seen
        want = eng.lookup(probe, training=False)
        for batch in (
            eng.preprocess(probe),
            eng.preprocess(probe, training=False),
            served.preprocess(probe),
        ):
            for got in (served.lookup(batch), eng.lookup(batch, training=False)):
                assert sorted(got) == sorted(want)
                for name in want:
                    assert got[name].tobytes() == want[name].tobytes(), name


def test_a_crafted_export_with_unsorted_keys_is_refused(tmp_path):
    eng = _engine("numba")
    for batch in _stream(3):
        _step(eng, batch)
    out = tmp_path / "export"
    export(eng.save(tmp_path / "ckpt"), out)
    manifest = json.loads((out / "manifest.json").read_text())
    entry = next(t for t in manifest["tables"] if t["name"] == "k")
    file = out / entry["file"]
    header = read_header(file)
    tensors = {
        n: np.array(read_tensor(file, n, header=header)) for n in header[0] if n != "__metadata__"
    }
    tensors["keys"][[0, 1]] = tensors["keys"][[1, 0]]
    file.unlink()
    digest = write_safetensors(file, tensors, {"table": "k"})
    manifest["files"][entry["file"]] = {"sha256": digest, "bytes": file.stat().st_size}
    text = json.dumps(manifest, indent=1).encode()
    (out / "manifest.json").write_bytes(text)
    (out / "manifest.sha256").write_bytes(hashlib.sha256(text).hexdigest().encode())
    with pytest.raises(CheckpointError, match="table 'k' .*key .* at position 1 is not greater"):
        ServingEngine.load(out)


@pytest.mark.parametrize("change", [_swap_first("k/keys"), _duplicate_key], ids=["unsorted", "dup"])
def test_export_of_a_crafted_keyed_checkpoint_is_refused_and_keeps_the_previous(tmp_path, change):
    """Keys out of order or twice in a checkpoint (restore refuses them) were exported as they
    were: the export succeeded, and with --replace deleted a good previous export for one
    that ServingEngine.load refuses (its keys "must be sorted and distinct")."""
    eng = _engine("numba")
    for batch in _stream(3):
        _step(eng, batch)
    out = tmp_path / "export"
    export(eng.save(tmp_path / "good"), out)
    want = ServingEngine.load(out).lookup(_stream(1, seed=4)[0])
    path = eng.save(tmp_path / "crafted")
    _rewrite(path, change)
    with pytest.raises(CheckpointError, match=r"table 'k': key .* at position 1 .*sorted"):
        export(path, out, replace=True)
    got = ServingEngine.load(out).lookup(_stream(1, seed=4)[0])
    assert all(got[k].tobytes() == want[k].tobytes() for k in want)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["crafted", "export", "good"]


def test_inspect_and_the_cli_show_a_keyed_table(tmp_path, capsys):
    eng = _engine("numba", occurrence_threshold=1, max_rows=12)
    for batch in _stream(6):
        _step(eng, batch)
    st = eng.table_stats()["k"]
    path = eng.save(tmp_path / "ckpt")
    text = describe(path)
    total = st["total"]
    assert (
        f"table 'k': keyed, {st['rows']} keys ({st['pending_keys']} pending admission, "
        f"admitted {total['admitted']}, filtered {total['filtered']}, evicted "
        f"{total['evicted']}"
    ) in text
    assert "k/pending_keys" in text and "table 'd': 9 x 2" in text
    assert cli_main(["export", str(path), str(tmp_path / "out"), "--compress", "fp16"]) == 0
    assert cli_main(["inspect", str(tmp_path / "out")]) == 0
    shown = capsys.readouterr().out
    assert f"table 'k': keyed, {st['rows']} keys x 3, combiner sum, compression fp16" in shown


def test_an_embedding_layer_of_a_keyed_table_round_trips_its_state_dict():
    torch = pytest.importorskip("torch")
    from embengine.torch import EmbeddingLayer

    stream = _stream(8)
    a = EmbeddingLayer(_engine("numba", occurrence_threshold=1))
    for batch in stream[:4]:
        sum(v.sum() for v in a(batch).values()).backward()
    state = a.state_dict()
    assert state["tables.k.keys"].dtype == torch.int64
    b = EmbeddingLayer(_engine("numba", occurrence_threshold=1))
    b.load_state_dict(state)
    for batch in stream[4:]:
        for layer in (a, b):
            sum((v * v).sum() for v in layer(batch).values()).backward()
    _same(a.engine, b.engine)


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_a_batch_whose_keyed_rows_predate_a_load_is_refused(backend, tmp_path):
    """A looked-up batch holds the rows its keyed table gave its keys; a load lays the rows out
    anew (by key), so its update would write another key's row, or past the table (a
    segfault on an mmap table). It is refused, nothing changed, as is a batch looked up by
    another engine of the same configuration; looked up again, it trains. A dense batch looked
    up before a load is refused too: its gradients are of the tables before it."""
    k = ee.TableConfig(None, 2, name="k", optimizer=O.SGD(1.0), initializer=RandomUniform())
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(k)}, backend=backend)
    for key in (50, 40, 30, 20, 10):  # rows 0..4 hold 50 .. 10; a load sorts them by key
        a = eng.lookup({"f": np.array([[key]])})
        eng.apply_gradients({"f": np.zeros_like(a["f"])})
    snap = copy.deepcopy(eng.state_dict())
    values = {"f": np.array([[10]])}
    grads = {"f": np.ones((1, 2), np.float32)}
    saved = eng.save(tmp_path)  # before the lookup: a save halfway through a step is refused
    for reload in (lambda: eng.load_state_dict(snap), lambda: eng.restore(saved)):
        _, b = eng.lookup_with_batch(values)
        reload()
        before = eng.table_contents("k")
        with pytest.raises(ValueError, match="keyed rows were resolved in another state"):
            eng.apply_gradients(grads, batch=b)
        with pytest.raises(ValueError, match="keyed rows were resolved in another state"):
            eng.lookup(b)
        after = eng.table_contents("k")
        assert all(after[n].tobytes() == before[n].tobytes() for n in before)
    other = ee.EmbeddingEngine({"f": ee.FeatureConfig(k)}, backend=backend)  # same config
    _, b = other.lookup_with_batch(values)
    with pytest.raises(ValueError, match="keyed rows were resolved in another state"):
        eng.apply_gradients(grads, batch=b)
    _, b = eng.lookup_with_batch(values)
    eng.apply_gradients(grads, batch=b)
    c = eng.table_contents("k")
    np.testing.assert_array_equal(c["weights"][c["keys"] == 10], before["weights"][0:1] - 1)
    dense = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(ee.TableConfig(60, 2, name="d", optimizer=O.SGD(1.0)))},
        backend=backend,
    )
    state = copy.deepcopy(dense.state_dict())
    _, b = dense.lookup_with_batch(values)
    dense.load_state_dict(state)
    with pytest.raises(ValueError, match="looked up before a load_state_dict or restore"):
        dense.apply_gradients(grads, batch=b)
    assert dense.step == 0


def test_load_asks_for_a_keyed_tables_from_function_initializer(tmp_path):
    """A FromFunction initializer's function is not stored. A dense table's rows all come from
    the checkpoint (load builds it with zeros first); a keyed table's new keys need the
    function: load without it is a CheckpointError naming the table (it silently gave new keys
    zeros), and with ``initializers=`` the loaded engine continues as the saved one."""
    from embengine.initializers import FromFunction

    init = FromFunction(lambda shape, dtype: np.full(shape, 0.5, np.float32))
    tables = {
        "f": ee.FeatureConfig(ee.TableConfig(None, 2, name="k", initializer=init)),
        "g": ee.FeatureConfig(ee.TableConfig(9, 2, name="d", initializer=init)),
    }
    eng = ee.EmbeddingEngine(tables, optimizer=O.SGD(0.1))
    a = eng.lookup({"f": np.array([[1, 2]]), "g": np.array([[3]])})
    eng.apply_gradients({k: np.ones_like(v) for k, v in a.items()})
    ckpt = eng.save(tmp_path)
    with pytest.raises(CheckpointError, match=r"table 'k' is keyed .*initializers=\{'k': \.\.\.\}"):
        ee.EmbeddingEngine.load(ckpt)
    loaded = ee.EmbeddingEngine.load(ckpt, initializers={"k": init})
    new = {"f": np.array([[7, 1]]), "g": np.array([[3]])}
    want, got = eng.lookup(new), loaded.lookup(new)
    for name in new:
        np.testing.assert_array_equal(got[name], want[name])
    assert got["f"][0, 0] != 0  # key 7's new row: the function's 0.5, plus key 1's


def test_a_save_halfway_through_a_step_of_a_keyed_table_is_refused(tmp_path):
    """A training lookup counts a keyed table's keys and gives new keys rows before its update:
    a checkpoint then would hold half a step, which a restore cannot finish (the lookup done
    again counts twice). The save is refused, nothing written; after the update it saves. An
    evaluation lookup changes nothing, a dense engine's lookup neither, and a load forgets the
    half step (its pending batch with it)."""
    eng = _engine("numba", occurrence_threshold=1)
    batch = _stream(1)[0]
    snapshot = copy.deepcopy(eng.state_dict())
    eng.lookup(batch, training=False)
    eng.save(tmp_path / "eval")
    eng.lookup(batch)
    with pytest.raises(ValueError, match=r"step 0 has been looked up for training but not app"):
        eng.save(tmp_path / "half")
    assert not (tmp_path / "half").exists() or not any((tmp_path / "half").iterdir())
    eng.load_state_dict(snapshot)
    eng.save(tmp_path / "loaded")
    _step(eng, batch)
    eng.save(tmp_path / "applied")
    dense = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(ee.TableConfig(9, 2, name="d"))}, optimizer=O.SGD(0.1)
    )
    dense.lookup({"f": np.array([[1, 2]])})
    dense.save(tmp_path / "dense")  # a dense lookup changes no table


def _big_keyed_engine(storage_path=None) -> ee.EmbeddingEngine:
    """One keyed table of 30,000 keys, dim 64 with Adagrad's accumulators (15 MB of rows)."""
    t = ee.TableConfig(None, 64, name="k", optimizer=O.Adagrad(0.1), combiner="sum")
    kwargs = {} if storage_path is None else dict(storage="mmap", storage_dir=storage_path)
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, seed=3, **kwargs)
    keys = np.random.default_rng(0).integers(-(2**62), 2**62, size=(30_000, 1))
    eng.lookup({"f": keys})
    eng.apply_gradients({"f": np.full((30_000, 64), 0.25, np.float32)})
    return eng


@pytest.mark.parametrize("storage", ["keyed", "keyed-mmap"])
def test_a_keyed_table_is_saved_and_restored_a_chunk_at_a_time(tmp_path, monkeypatch, storage):
    """Saving a keyed table gathers its rows in key order a chunk at a time as they are
    written, and restoring reads them straight into the new arena: the memory either
    allocates is a small part of the table's (a keyed-mmap table may exceed RAM), where both
    used to copy the whole table first."""
    mmap_dir = None if storage == "keyed" else tmp_path / "rows"
    eng = _big_keyed_engine(mmap_dir)
    assert eng.storage_plan.physical_tables[0].storage == storage
    table_bytes = 30_000 * 128 * 4
    monkeypatch.setattr(safetensors_io, "CHUNK_BYTES", 64 * 1024)
    peaks = {}
    for what in ("save", "restore"):
        tracemalloc.start()
        try:
            if what == "save":
                path = eng.save(tmp_path / "ckpt")
            else:
                restored = _big_keyed_engine(None if mmap_dir is None else tmp_path / "rows2")
                tracemalloc.reset_peak()
                restored.restore(path)
            peaks[what] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    # keys, their order and metadata are held whole (8-40 bytes a key); rows never are
    assert peaks["save"] < table_bytes / 8, (peaks, table_bytes)
    assert peaks["restore"] < table_bytes / 4, (peaks, table_bytes)
    want, got = eng.table_contents("k"), restored.table_contents("k")
    assert all(want[k].tobytes() == got[k].tobytes() for k in want)
    assert ee.EmbeddingEngine.load(path).table_contents("k")["weights"].tobytes() == (
        want["weights"].tobytes()
    )


def test_a_lazy_keyed_state_gathers_the_same_values_as_the_snapshot():
    eng = _engine("numba", occurrence_threshold=1, expire_seconds=100)
    for i, batch in enumerate(_stream(5)):  # with data time: last_time is gathered too
        acts = eng.lookup(batch, timestamp=10 * i)
        eng.apply_gradients({k: np.sin(3 * v) + 0.25 for k, v in acts.items()})
    state = eng.state_dict()["tables"]["k"]
    lazy = eng.state_dict(lazy=True)["tables"]["k"]
    assert list(lazy) == list(state)
    for key, value in state.items():
        g = lazy[key]
        if isinstance(g, GatheredRows):
            assert key not in ("keys", "pending_keys", "counters")
            assert g.shape == value.shape and g.dtype == value.dtype and len(g) == len(value)
            assert g[1:4].tobytes() == value[1:4].tobytes()
            assert g[len(value) :].shape == (0, *value.shape[1:])
        assert np.asarray(g).tobytes() == value.tobytes(), key
    with pytest.raises(TypeError, match="takes a slice of rows"):
        lazy["weights"][[0, 1]]


def test_a_keyed_row_read_failing_midway_is_a_partial_load_error(tmp_path):
    """The rows are read into the new arena by the install, after every check: a read that
    fails there says which table is part new, as for a dense table."""

    class Failing:
        def __init__(self, shape, dtype):
            self.shape, self.dtype = shape, np.dtype(dtype)

        def read_into(self, out):
            out[: len(out) // 2] = 7
            raise OSError("the file went away")

    eng = _engine("numba")
    for batch in _stream(3):
        _step(eng, batch)
    state = copy.deepcopy(eng.state_dict())
    weights = state["tables"]["k"]["weights"]
    state["tables"]["k"]["weights"] = Failing(weights.shape, weights.dtype)
    with pytest.raises(PartialLoadError, match=r"table 'k' \(the file went away\)"):
        eng.load_state_dict(state)


@pytest.mark.parametrize("given", [False, True])
def test_a_batch_looked_up_before_a_partial_load_is_refused(given):
    """A load failing midway has laid a keyed table out anew (rows by key) before it failed:
    a batch looked up before it (the engine's pending one, or a PreparedBatch) held rows that
    are now other keys', and its update wrote them (past the table's rows too). It is refused,
    nothing changed, as after a load that succeeds."""

    class Failing:
        def __init__(self, shape, dtype):
            self.shape, self.dtype = shape, np.dtype(dtype)

        def read_into(self, out):
            raise OSError("the file went away")

    k = ee.TableConfig(None, 2, name="k", optimizer=O.SGD(1.0), initializer=RandomUniform())
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(k)})
    for key in (50, 40, 30, 20, 10):  # rows 0..4 hold 50 .. 10; a load sorts them by key
        a = eng.lookup({"f": np.array([[key]])})
        eng.apply_gradients({"f": np.zeros_like(a["f"])})
    state = copy.deepcopy(eng.state_dict())
    state["tables"]["k"]["weights"] = Failing((5, 2), np.float32)
    values = {"f": np.array([[10]])}
    grads = {"f": np.ones((1, 2), np.float32)}
    if given:
        _, b = eng.lookup_with_batch(values)
    else:
        eng.lookup(values)
    with pytest.raises(PartialLoadError):
        eng.load_state_dict(state)
    before = eng.table_contents("k")
    with pytest.raises(ValueError, match="another state|needs a lookup"):
        if given:
            eng.apply_gradients(grads, batch=b)
        else:
            eng.apply_gradients(grads)
    after = eng.table_contents("k")
    assert all(after[n].tobytes() == before[n].tobytes() for n in before)
