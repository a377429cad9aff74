"""Checkpoints: round trips of every optimizer's state, resuming in a fresh process, crash safety
under SIGKILL, tampering, compatibility checks, keep=N, safetensors interop and mmap storage."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import random
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import embengine as ee
from embengine import checkpoint as ckpt_mod
from embengine import optimizers as O
from embengine.checkpoint import CheckpointError, latest_checkpoint, read_manifest
from embengine.safetensors_io import read_header, read_tensor, write_safetensors

REPO = Path(__file__).resolve().parents[1]


# -- helpers --------------------------------------------------------------------------------------


def _state(eng: ee.EmbeddingEngine) -> dict[str, np.ndarray]:
    """Copies of every table and slot, keyed "{table}" and "{table}/{slot}"."""
    out = {}
    for name, w in eng.embedding_tables.items():
        out[name] = np.array(w)
        for slot, a in eng.slots(name).items():
            out[f"{name}/{slot}"] = np.array(a)
    return out


def _assert_same_state(a: ee.EmbeddingEngine, b: ee.EmbeddingEngine) -> None:
    assert a.step == b.step
    sa, sb = _state(a), _state(b)
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert sa[k].shape == sb[k].shape, k
        assert sa[k].tobytes() == sb[k].tobytes(), f"{k} differs"


def _batch(eng: ee.EmbeddingEngine, step: int, n: int = 12) -> tuple[dict, dict]:
    """Deterministic features and activation gradients for ``step``: bags with repeated ids, and
    for sequence features a Ragged input."""
    rng = np.random.default_rng(1000 + step)
    feats = {}
    for fname, fc in eng.feature_config.items():
        vocab = fc.table.vocabulary_size
        lengths = rng.integers(0, 4, size=n)
        lengths[0] = 2
        ids = rng.integers(0, min(vocab, 7), size=int(lengths.sum()))  # few ids: duplicates
        feats[fname] = ee.Ragged(ids, lengths=lengths)
    acts = eng.lookup(feats)
    grads = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in acts.items()}
    return feats, grads


def _run_steps(eng: ee.EmbeddingEngine, steps: int, lrs=None) -> None:
    for _ in range(steps):
        _, grads = _batch(eng, eng.step)
        eng.apply_gradients(grads, learning_rates=lrs)


def _flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) - 3 if offset is None else offset
    data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def _small_engine(backend="reference", optimizer=None, vocab=20, dim=4, **kw):
    t = ee.TableConfig(vocab, dim, name="t", combiner="sum")
    u = ee.TableConfig(15, 2, name="u", optimizer=O.FTRL(learning_rate=0.2))
    return ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t), "g": ee.FeatureConfig(u)},
        optimizer=optimizer or O.Adagrad(learning_rate=0.1),
        seed=3,
        backend=backend,
        **kw,
    )


# -- 1. every optimizer's slots round trip ---------------------------------------------------------

OPTIMIZER_CASES = {
    "SGD": (
        O.SGD(
            learning_rate=0.1,
            clipvalue=(-0.5, None),
            weight_decay_factor=0.01,
            clip_weight_min=-2.0,
            clip_weight_max=2.0,
        ),
        4,
    ),
    "Adagrad": (O.Adagrad(learning_rate=0.1), 4),
    "Adagrad-hct2": (O.Adagrad(learning_rate=0.1, hessian_compression_times=2), 4),
    "Adagrad-rowwise": (O.Adagrad(learning_rate=0.1, hessian_compression_times=4), 4),
    "AdagradMomentum": (
        O.AdagradMomentum(learning_rate=0.1, momentum=0.9, use_nesterov=True, beta2=0.99),
        4,
    ),
    "ProximalAdagrad": (
        O.ProximalAdagrad(
            learning_rate=0.1, l1_regularization_strength=0.01, l2_regularization_strength=0.02
        ),
        4,
    ),
    "Adam": (O.Adam(learning_rate=0.05), 4),
    "Adam-per_row": (O.Adam(learning_rate=0.05, bias_correction="per_row"), 4),
    "Adam-global-nonlazy": (
        O.Adam(learning_rate=0.05, bias_correction="global", lazy_adam=False, use_nesterov=True),
        4,
    ),
    "AMSGrad": (O.AMSGrad(learning_rate=0.05), 4),
    "AMSGrad-per_row": (O.AMSGrad(learning_rate=0.05, bias_correction="per_row"), 4),
    "Lion": (O.Lion(learning_rate=0.01), 4),
    "FTRL": (
        O.FTRL(
            learning_rate=0.1,
            l1_regularization_strength=0.01,
            beta=0.1,
            l2_regularization_strength=0.01,
        ),
        4,
    ),
    "Momentum": (O.Momentum(learning_rate=0.1, momentum=0.9, use_nesterov=True), 4),
    "RMSProp-centered": (O.RMSProp(learning_rate=0.01, momentum=0.5, centered=True), 4),
    "Adadelta": (O.Adadelta(learning_rate=1.0), 4),
    "Assign": (O.Assign(), 4),
    "FrequencyEstimator": (O.FrequencyEstimator(tau=0.2, max_delta=50.0), 1),
    "BatchSoftmax": (O.BatchSoftmax(learning_rate=0.3), 1),
}


def test_optimizer_cases_cover_every_optimizer_class():
    exported = {
        name
        for name in O.__all__
        if isinstance(getattr(O, name), type)
        and issubclass(getattr(O, name), O.Optimizer)
        and getattr(O, name) is not O.Optimizer
    }
    covered = {type(opt).__name__ for opt, _ in OPTIMIZER_CASES.values()}
    assert exported <= covered, f"not covered: {sorted(exported - covered)}"


@pytest.mark.parametrize("case", list(OPTIMIZER_CASES))
def test_every_optimizer_round_trips_bit_for_bit(tmp_path, backend, case):
    opt, dim = OPTIMIZER_CASES[case]
    t = ee.TableConfig(30, dim, name="emb", combiner="sum", optimizer=opt)
    s = ee.TableConfig(10, 2, name="side")  # second table, global optimizer
    eng = ee.EmbeddingEngine(
        {"a": ee.FeatureConfig(t), "b": ee.FeatureConfig(t), "c": ee.FeatureConfig(s)},
        optimizer=O.Momentum(learning_rate=0.05),
        seed=7,
        backend=backend,
    )
    before = _state(eng)
    _run_steps(eng, 2)
    after = _state(eng)
    assert any(before[k].tobytes() != after[k].tobytes() for k in before if k.startswith("emb"))
    path = eng.save(tmp_path / "ck")
    assert path.name == "ckpt-000001-step000000000002"
    loaded = ee.EmbeddingEngine.load(path, backend=backend)
    assert loaded.step == 2
    assert type(loaded.optimizer("emb")) is type(opt)
    assert loaded.optimizer("emb") == opt
    _assert_same_state(eng, loaded)
    for slot, arr in eng.slots("emb").items():
        assert loaded.slots("emb")[slot].dtype == arr.dtype
    if case.endswith("per_row"):
        assert eng.slots("emb")["steps"].dtype == np.int32
        assert eng.slots("emb")["steps"].max() >= 1
    # One more identical step on both engines: identical state.
    _run_steps(eng, 1)
    _run_steps(loaded, 1)
    _assert_same_state(eng, loaded)


def test_packed_low_dimensional_tables_round_trip(tmp_path, backend):
    """Dim-1 and dim-2 tables with equal optimizers are packed into one DenseTable."""
    fe = O.FrequencyEstimator(low_dimensional_packing_status=True)
    ad = O.Adagrad(learning_rate=0.1, low_dimensional_packing_status=True)
    tables = [ee.TableConfig(9 + i, 1, name=f"fe{i}", optimizer=fe) for i in range(3)]
    tables += [ee.TableConfig(11 + i, 2, name=f"ad{i}", optimizer=ad) for i in range(2)]
    eng = ee.EmbeddingEngine(
        {f"f{i}": ee.FeatureConfig(t) for i, t in enumerate(tables)}, backend=backend
    )
    assert len(eng.storage_plan.physical_tables) == 2  # packing did happen
    _run_steps(eng, 3)
    loaded = ee.EmbeddingEngine.load(eng.save(tmp_path), backend=backend)
    _assert_same_state(eng, loaded)
    _run_steps(eng, 1)
    _run_steps(loaded, 1)
    _assert_same_state(eng, loaded)


def test_restore_into_fresh_engine_with_extra_tensors_and_metadata(tmp_path, backend):
    eng = _small_engine(backend)
    _run_steps(eng, 3)
    import ml_dtypes
    from safetensors.numpy import load_file

    dense = {
        "mlp/w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "mlp/b": np.array([1, 2], dtype=np.int64),
        # bfloat16 came back as its uint16 bits, and uint16 went out labelled "BF16"
        "bf16": np.array([1.0, 2.0, -0.5], ml_dtypes.bfloat16),
        "u16": np.array([1, 2, 65535], np.uint16),
        "f16": np.array([0.5, -2.0], np.float16),
    }
    meta = {"epoch": 2, "note": "hi", "nested": {"a": [1, 2]}}
    path = eng.save(tmp_path, extra_tensors=dense, extra_metadata=meta)
    # the safetensors package reads the file as written (its own dtype names)
    read = load_file(str(path / "extra.safetensors"))
    assert read["u16"].dtype == np.uint16 and read["u16"].tolist() == [1, 2, 65535]
    fresh = _small_engine(backend)
    assert fresh.step == 0
    info = fresh.restore(tmp_path)  # a root: the newest checkpoint
    assert info.path == path and info.step == 3 and fresh.step == 3
    assert info.extra_metadata == meta
    assert sorted(info.extra_tensors) == sorted(dense)
    for k, v in dense.items():
        assert info.extra_tensors[k].dtype == v.dtype
        np.testing.assert_array_equal(info.extra_tensors[k], v)
    _assert_same_state(eng, fresh)
    _run_steps(eng, 2)
    _run_steps(fresh, 2)
    _assert_same_state(eng, fresh)


def test_load_without_checkpoint_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        ee.EmbeddingEngine.load(tmp_path)
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "does-not-exist") is None


# -- 2. resume equality in fresh processes -------------------------------------------------------

RESUME_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import embengine as ee
    from embengine import optimizers as O

    mode, backend, root, steps, out = sys.argv[1:]
    steps = int(steps)


    def lr_schedule(step):
        return 0.1 / (1.0 + 0.05 * step)


    def build():
        adam = O.Adam(learning_rate=lr_schedule, bias_correction="per_row")
        user = ee.TableConfig(3000, 8, name="user", combiner="sum", optimizer=adam)
        ftrl = O.FTRL(learning_rate=0.05, l1_regularization_strength=0.001)
        item = ee.TableConfig(120, 4, name="item", optimizer=ftrl)
        count = ee.TableConfig(40, 1, name="count", optimizer=O.FrequencyEstimator(max_delta=100.0))
        hist = ee.TableConfig(200, 8, name="hist",
                              optimizer=O.Adagrad(learning_rate=0.1, hessian_compression_times=2))
        other = ee.TableConfig(50, 4, name="other", combiner="sqrtn")  # global optimizer
        feats = {"user": ee.FeatureConfig(user), "item": ee.FeatureConfig(item),
                 "count": ee.FeatureConfig(count), "hist": ee.FeatureConfig(hist, 5),
                 "other": ee.FeatureConfig(other), "item2": ee.FeatureConfig(item)}
        return ee.EmbeddingEngine(feats, optimizer=O.RMSProp(learning_rate=0.01, centered=True),
                                  seed=11, backend=backend)


    def step(eng):
        s = eng.step
        rng = np.random.default_rng(12345 + s)
        b = 512  # several parallel tasks of 64 rows, so 2 threads do split the work
        feats = {}
        for name, fc in eng.feature_config.items():
            vocab = fc.table.vocabulary_size
            lengths = rng.integers(0, 6, size=b)
            ids = rng.integers(0, vocab, size=int(lengths.sum()))
            feats[name] = ee.Ragged(ids, lengths=lengths)
        acts = eng.lookup(feats)
        grads = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in acts.items()}
        eng.apply_gradients(grads)


    def dump(eng, path):
        arrays = {"__step__": np.array(eng.step)}
        for name, w in eng.embedding_tables.items():
            arrays[name] = np.array(w)
            for slot, a in eng.slots(name).items():
                arrays[name + "/" + slot] = np.array(a)
        np.savez(path, **arrays)


    if mode == "save":
        eng = build()
        for _ in range(steps):
            step(eng)
        eng.save(root)
    elif mode == "resume":
        eng = ee.EmbeddingEngine.load(root, callables={0: lr_schedule})
        assert eng.backend == backend, eng.backend
        for _ in range(steps):
            step(eng)
        dump(eng, out)
    else:
        eng = build()
        for _ in range(steps):
            step(eng)
        dump(eng, out)
    """
)


def _run_py(script: Path, args, env_extra=None, **kw):
    env = dict(os.environ)
    env.update(env_extra or {})
    return subprocess.Popen(
        [sys.executable, str(script), *map(str, args)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def _wait_ok(proc: subprocess.Popen, timeout=120) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"subprocess failed ({proc.returncode}):\n{out}\n{err}"
    return out


@pytest.mark.parametrize(
    "backend, threads",
    [("reference", 1), ("numba", 1), ("numba", 2)],
    ids=["reference", "numba-1thread", "numba-2threads"],
)
def test_resume_in_fresh_process_equals_straight_run(tmp_path, backend, threads, record_property):
    n, m = 4, 3
    script = tmp_path / "resume_script.py"
    script.write_text(RESUME_SCRIPT)
    env = {"NUMBA_NUM_THREADS": str(threads)}
    root = tmp_path / "ck"
    # The N-step save and the N+M straight run are independent processes: run them together.
    saver = _run_py(script, ["save", backend, root, n, "-"], env)
    straight = _run_py(script, ["straight", backend, "-", n + m, tmp_path / "straight.npz"], env)
    _wait_ok(saver)
    _wait_ok(straight)
    assert latest_checkpoint(root).name == f"ckpt-000001-step{n:012d}"
    resumed = _run_py(script, ["resume", backend, root, m, tmp_path / "resumed.npz"], env)
    _wait_ok(resumed)
    a = np.load(tmp_path / "straight.npz")
    b = np.load(tmp_path / "resumed.npz")
    assert sorted(a.files) == sorted(b.files)
    assert int(a["__step__"]) == int(b["__step__"]) == n + m
    identical = all(a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in a.files)
    worst = max(
        float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64))))
        for k in a.files
        if a[k].size
    )
    record_property("bit_identical", identical)
    record_property("max_abs_diff", worst)
    print(f"{backend} with {threads} thread(s): bit-identical={identical}, max abs diff={worst}")
    if threads == 1:
        assert identical, f"resume differs from a straight run (max abs diff {worst})"
    else:
        for k in a.files:
            if a[k].dtype.kind == "i":
                np.testing.assert_array_equal(a[k], b[k], err_msg=k)
            else:
                np.testing.assert_allclose(a[k], b[k], rtol=0, atol=1e-6, err_msg=k)


# -- 3. crash safety under SIGKILL -----------------------------------------------------------------

CRASH_CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    import embengine as ee
    from embengine import optimizers as O
    from embengine.checkpoint import latest_checkpoint

    root, rows = sys.argv[1], int(sys.argv[2])
    table = ee.TableConfig(rows, 16, name="big", initializer=ee.initializers.Zeros())
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(table)},
                             optimizer=O.Adagrad(learning_rate=0.1), backend="reference")
    if latest_checkpoint(root) is not None:
        eng.restore(root)
    w = eng.embedding_tables["big"]
    acc = eng.slots("big")["accumulators"]
    print("ready", eng.step, flush=True)
    while True:
        s = eng.step + 1
        # Every value of the checkpoint of step s is derived from s; a zero gradient keeps them.
        w[...] = s
        acc[...] = 2 * s
        a = eng.lookup({"f": np.array([0])})
        eng.apply_gradients({"f": np.zeros_like(a["f"])})
        assert eng.step == s
        print("saving", s, flush=True)
        eng.save(root, keep=2, extra_metadata={"step": s},
                 extra_tensors={"marker": np.full(3, s, dtype=np.int64)})
        print("saved", s, flush=True)
    """
)


def _check_crash_checkpoint(eng: ee.EmbeddingEngine, path: Path) -> int:
    info = eng.restore(path)  # verifies every checksum
    s = info.step
    assert path.name.endswith(f"-step{s:012d}")
    assert info.extra_metadata == {"step": s}
    np.testing.assert_array_equal(info.extra_tensors["marker"], np.full(3, s))
    w = eng.embedding_tables["big"]
    acc = eng.slots("big")["accumulators"]
    assert np.all(w == s), f"torn weights in {path}: {np.unique(w)[:5]} (step {s})"
    assert np.all(acc == 2 * s), f"torn slot in {path}: {np.unique(acc)[:5]} (step {s})"
    return s


def test_sigkill_during_repeated_saves_never_leaves_a_bad_latest_checkpoint(tmp_path):
    # 300k x (16 weights + 16 accumulators) floats = 38 MB: a save long enough to be killed in
    # (its time: docs/performance.md, "Figures behind the code").
    rows = 300_000
    script = tmp_path / "crash_child.py"
    script.write_text(CRASH_CHILD)
    root = tmp_path / "ck"
    table = ee.TableConfig(rows, 16, name="big", initializer=ee.initializers.Zeros())
    checker = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(table)}, optimizer=O.Adagrad(learning_rate=0.1), backend="reference"
    )
    rng = random.Random(1234)
    trials, saved_any, last_saved, mid_save_kills, leaked = 20, False, 0, 0, set()
    for trial in range(trials):
        proc = _run_py(script, [root, rows])
        try:
            line = proc.stdout.readline()
            assert line.startswith("ready"), line + proc.stderr.read()
            assert int(line.split()[1]) >= last_saved  # resumed from the newest durable save
            # Kill at a random moment: after the k-th save began, plus a random delay.
            k = rng.randint(1, 3)
            seen = 0
            while seen < k:
                line = proc.stdout.readline()
                assert line, proc.stderr.read()
                if line.startswith("saving"):
                    seen += 1
                elif line.startswith("saved"):
                    saved_any, last_saved = True, int(line.split()[1])
            time.sleep(rng.uniform(0.0, 0.3))
        finally:
            proc.send_signal(signal.SIGKILL)
            rest, _ = proc.communicate()
        assert proc.returncode == -signal.SIGKILL
        for line in rest.splitlines():
            if line.startswith("saved"):
                saved_any, last_saved = True, int(line.split()[1])
        if list(root.glob(".tmp-*")):
            mid_save_kills += 1
        leaked |= {p.name for p in root.glob("ckpt-*") if not (p / "manifest.json").exists()}
        latest = latest_checkpoint(root)
        if saved_any:
            assert latest is not None, f"trial {trial}: no checkpoint after a completed save"
        if latest is None:
            continue
        s = _check_crash_checkpoint(checker, latest)
        assert s >= last_saved, (
            f"trial {trial}: save of step {last_saved} was reported done, "
            f"but the newest checkpoint is step {s}"
        )
    assert saved_any
    # The kills did land inside saves (a stale .tmp-* was left behind) at least sometimes.
    assert mid_save_kills >= 1, "no kill landed during a save; the test proved nothing"
    print(f"{trials} kills, {mid_save_kills} left a .tmp-* folder; leaked dirs: {sorted(leaked)}")
    # No kill leaves a checkpoint's name without its manifest (saves rename their folder in
    # whole, prunes rename it away first): a save need never delete such a folder.
    assert not leaked, f"killed saves or prunes left {sorted(leaked)} without manifest.json"
    # Stale .tmp-* folders (from killed saves, plus a fake one with a bogus manifest) must not
    # break loading or the next save; the next save removes them.
    fake = root / ".tmp-ckpt-999999999999-001-1-deadbeef"
    fake.mkdir(exist_ok=True)
    (fake / "manifest.json").write_text("{not json")
    assert latest_checkpoint(root) is not None and not latest_checkpoint(root).name.startswith(".")
    loaded = ee.EmbeddingEngine.load(root)
    s = loaded.step
    assert np.all(loaded.embedding_tables["big"] == s)
    loaded.embedding_tables["big"][...] = s + 1
    loaded.slots("big")["accumulators"][...] = 2 * (s + 1)
    a = loaded.lookup({"f": np.array([0])})
    loaded.apply_gradients({"f": np.zeros_like(a["f"])})
    new = loaded.save(
        root,
        keep=2,
        extra_metadata={"step": s + 1},
        extra_tensors={"marker": np.full(3, s + 1, dtype=np.int64)},
    )
    assert new.name.endswith(f"-step{s + 1:012d}")
    assert latest_checkpoint(root) == new
    assert len(ckpt_mod.list_checkpoints(root)) == 2  # keep=2
    assert not list(root.glob(".tmp-*"))
    _check_crash_checkpoint(checker, new)


def test_stale_tmp_folder_does_not_break_save_or_load(tmp_path):
    eng = _small_engine()
    _run_steps(eng, 1)
    first = eng.save(tmp_path)
    # A save killed after writing a full-looking folder but before the rename.
    stale = tmp_path / f".tmp-ckpt-{5:012d}-001-4242-abcdef01"
    stale.mkdir()
    for f in first.iterdir():
        (stale / f.name).write_bytes(f.read_bytes())
    assert latest_checkpoint(tmp_path) == first
    assert ee.EmbeddingEngine.load(tmp_path).step == 1
    _run_steps(eng, 1)
    second = eng.save(tmp_path)
    assert not stale.exists()
    assert latest_checkpoint(tmp_path) == second


def test_a_folder_named_like_a_checkpoint_without_manifest_is_never_deleted(tmp_path):
    """A save removed every ``ckpt-*`` folder without manifest.json as a half-deleted
    checkpoint, but no save or prune leaves one (a save renames its folder in complete, a
    prune renames a checkpoint away before deleting it: the SIGKILL test finds none): it is a
    user's folder, or an empty folder made for an export, and saves deleted it, contents and
    all. It is left alone, never listed, and new checkpoints are numbered past it."""
    eng = _small_engine()
    _run_steps(eng, 1)
    first = eng.save(tmp_path)
    mine = tmp_path / "ckpt-000007-step000000000005"
    (mine / "notes").mkdir(parents=True)
    (mine / "notes" / "run.txt").write_text("precious")
    empty = tmp_path / "ckpt-000008-step000000000006"
    empty.mkdir()
    half = eng.save(tmp_path)
    (half / "manifest.json").unlink()  # what an embengine before 70ffd8c's prune could leave
    assert latest_checkpoint(tmp_path) == first
    saved = []
    for _ in range(3):
        _run_steps(eng, 1)
        saved.append(eng.save(tmp_path, keep=2))
    assert (mine / "notes" / "run.txt").read_text() == "precious"
    assert empty.is_dir() and half.is_dir()
    assert [p.name for p in saved] == [
        "ckpt-000010-step000000000002",
        "ckpt-000011-step000000000003",
        "ckpt-000012-step000000000004",
    ]
    assert ckpt_mod.list_checkpoints(tmp_path) == saved[1:]


# -- 4. tampering ----------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    eng = _small_engine()
    _run_steps(eng, 2)
    path = eng.save(tmp_path / "ck", extra_tensors={"dense": np.ones(4, np.float32)})
    return eng, path


def _load_error(path) -> str:
    with pytest.raises(CheckpointError) as exc:
        ee.EmbeddingEngine.load(path)
    fresh = _small_engine()
    with pytest.raises(CheckpointError) as exc2:
        fresh.restore(path)
    assert fresh.step == 0  # nothing was touched
    return str(exc.value) + "\n" + str(exc2.value)


@pytest.mark.parametrize(
    "file", ["table-000.safetensors", "table-001.safetensors", "extra.safetensors"]
)
@pytest.mark.parametrize("where", ["data", "header"])
def test_flipped_byte_is_a_checksum_mismatch_naming_the_file(saved, file, where):
    _, path = saved
    _flip_byte(path / file, 20 if where == "header" else None)
    msg = _load_error(path)
    assert "checksum mismatch" in msg and file in msg


def test_truncated_file_is_named(saved):
    _, path = saved
    f = path / "table-000.safetensors"
    f.write_bytes(f.read_bytes()[:-16])
    msg = _load_error(path)
    assert "table-000.safetensors" in msg and "truncated" in msg


def test_missing_file_is_named(saved):
    _, path = saved
    (path / "table-001.safetensors").unlink()
    msg = _load_error(path)
    assert "table-001.safetensors" in msg and "missing" in msg


def test_loading_the_root_with_a_tampered_newest_checkpoint_fails(saved):
    eng, path = saved
    _flip_byte(path / "table-000.safetensors")
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        ee.EmbeddingEngine.load(path.parent)


def _edit_manifest(path: Path, fn, resign: bool = False) -> None:
    """Edit manifest.json; with ``resign`` also rewrite manifest.sha256, as a forger would, so
    the checks behind the manifest's own checksum are reached."""
    m = json.loads((path / "manifest.json").read_text())
    fn(m)
    text = json.dumps(m).encode()
    (path / "manifest.json").write_bytes(text)
    if resign:
        (path / "manifest.sha256").write_text(hashlib.sha256(text).hexdigest())


def test_edited_manifest_step_is_refused(saved):
    """The manifest is part of the checkpoint: editing its step must not load silently."""
    _, path = saved
    _edit_manifest(path, lambda m: m.__setitem__("step", 7))
    msg = _load_error(path)
    assert "manifest" in msg


def test_edited_manifest_hyperparameter_is_refused(saved):
    _, path = saved

    def edit(m):
        m["tables"][0]["optimizer"]["params"]["initial_accumulator_value"] = 5.0

    _edit_manifest(path, edit)
    with pytest.raises(CheckpointError):
        ee.EmbeddingEngine.load(path)


def test_invalid_json_manifest(saved):
    _, path = saved
    (path / "manifest.json").write_text("{ nope")
    with pytest.raises(CheckpointError, match="manifest.json"):
        ee.EmbeddingEngine.load(path)


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda m: m.__setitem__("format", "pickle"), "pickle"),
        (lambda m: m.pop("format"), "not an embengine checkpoint"),
        (lambda m: m.__setitem__("format_version", 2), "format version 2"),
        (lambda m: m.__setitem__("format_version", "1"), "format version"),
        (
            lambda m: m["files"].__setitem__("model.pkl", {"sha256": "0" * 64, "bytes": 1}),
            "model.pkl",
        ),
        (
            lambda m: (
                m["tables"][0].__setitem__("file", "table-000.pkl")
                or m["files"].__setitem__("table-000.pkl", m["files"].pop("table-000.safetensors"))
            ),
            "table-000.pkl",
        ),
        (
            lambda m: m["files"].__setitem__("../outside.safetensors", {"sha256": "0", "bytes": 1}),
            "outside",
        ),
    ],
    ids=[
        "format-pickle",
        "no-format",
        "version-2",
        "version-str",
        "lists-pkl",
        "table-pkl",
        "path-escape",
    ],
)
def test_foreign_formats_and_versions_are_refused(saved, edit, words):
    _, path = saved
    _edit_manifest(path, edit)
    for verify in (True, False):
        with pytest.raises(CheckpointError, match=words.replace(".", r"\.")):
            ee.EmbeddingEngine.load(path, verify=verify)
    with pytest.raises(CheckpointError):
        read_manifest(path)


def test_pickle_file_is_never_unpickled(saved, tmp_path):
    """A .pkl listed in the manifest is refused before it is opened."""
    _, path = saved
    marker = tmp_path / "unpickled"
    import pickle

    class Boom:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (path / "evil.pkl").write_bytes(pickle.dumps(Boom()))
    _edit_manifest(
        path,
        lambda m: m["files"].__setitem__(
            "evil.pkl",
            {
                "sha256": hashlib.sha256((path / "evil.pkl").read_bytes()).hexdigest(),
                "bytes": (path / "evil.pkl").stat().st_size,
            },
        ),
    )
    with pytest.raises(CheckpointError, match="evil.pkl"):
        ee.EmbeddingEngine.load(path)
    assert not marker.exists()


def _replace_with_rehash(path: Path, name: str, data: bytes) -> None:
    (path / name).write_bytes(data)
    _edit_manifest(
        path,
        lambda m: m["files"].__setitem__(
            name, {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        ),
        resign=True,
    )


def test_read_header_rejects_bad_header_length(tmp_path):
    f = tmp_path / "foreign.safetensors"
    f.write_bytes(struct.pack("<Q", 10**12) + b"{}" + b"\0" * 30)
    with pytest.raises(ValueError, match="header length"):
        read_header(f)
    f.write_bytes(b"abc")
    with pytest.raises(ValueError, match="too short"):
        read_header(f)
    f.write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{]")
    with pytest.raises(ValueError, match="corrupt"):
        read_header(f)


@pytest.mark.parametrize(
    "payload",
    [
        struct.pack("<Q", 10**12) + b"{}" + b"\0" * 30,  # header length past the file
        struct.pack("<Q", 8) + b"not json",  # header not JSON
        struct.pack("<Q", 2) + b"[]",  # header not a dict
        struct.pack("<Q", 40) + b'{"t":{"dtype":"F32","shape":[20,4]}}    ',  # no data_offsets
        struct.pack("<Q", 8) + b'{"t":5} ',  # entry not a dict
    ],
    ids=["bad-length", "not-json", "not-dict", "no-offsets", "entry-not-dict"],
)
def test_foreign_safetensors_file_with_matching_checksum_is_a_checkpoint_error(saved, payload):
    """Even when the manifest's checksum matches (a foreign file put in place together with its
    hash), a file that is not valid safetensors is a CheckpointError naming it."""
    _, path = saved
    _replace_with_rehash(path, "table-000.safetensors", payload)
    with pytest.raises(CheckpointError, match="table-000.safetensors"):
        ee.EmbeddingEngine.load(path)


@pytest.mark.parametrize(
    "tensors, words",
    [
        (
            {"t": np.zeros((3, 3), np.float32), "t/accumulators": np.zeros((20, 4), np.float32)},
            "shape",
        ),
        ({"t": np.zeros((20, 4), np.float32)}, "t/accumulators"),
    ],
    ids=["wrong-shape", "missing-slot"],
)
def test_foreign_safetensors_with_wrong_tensors_is_a_checkpoint_error(saved, tensors, words):
    """A well-formed safetensors file (checksum matching) that lacks a tensor or has one of the
    wrong shape: a CheckpointError naming the file and the tensor, and no table changes."""
    _, path = saved
    tmp = path / "x.safetensors"
    write_safetensors(tmp, tensors)
    data = tmp.read_bytes()
    tmp.unlink()
    _replace_with_rehash(path, "table-000.safetensors", data)
    with pytest.raises(CheckpointError, match=words) as exc:
        ee.EmbeddingEngine.load(path)
    assert "table-000.safetensors" in str(exc.value)


def test_restore_of_a_structurally_bad_file_leaves_the_engine_untouched(saved):
    """The second table's file lacks a slot (checksum matching): restore must fail before it has
    overwritten anything, as it does for a checksum mismatch."""
    eng, path = saved
    tmp = path / "x.safetensors"
    write_safetensors(tmp, {"u": np.zeros((15, 2), np.float32)})  # FTRL slots missing
    data = tmp.read_bytes()
    tmp.unlink()
    _replace_with_rehash(path, "table-001.safetensors", data)
    other = _small_engine()
    before = _state(other)
    with pytest.raises(CheckpointError, match="table-001.safetensors"):
        other.restore(path)
    after = _state(other)
    changed = [k for k in before if before[k].tobytes() != after[k].tobytes()]
    assert not changed, f"a failed restore changed {changed}"
    assert other.step == 0


# -- 5. incompatible engines and learning rates ----------------------------------------------------


def test_restore_into_engine_with_other_shape_names_the_table(saved, backend):
    _, path = saved
    for vocab, dim in ((21, 4), (20, 8)):
        other = _small_engine(backend, vocab=vocab, dim=dim)
        before = _state(other)
        with pytest.raises(CheckpointError, match="'t'.*shape"):
            other.restore(path)
        after = _state(other)
        assert all(before[k].tobytes() == after[k].tobytes() for k in before)
        assert other.step == 0


@pytest.mark.parametrize(
    "optimizer",
    [
        O.Adagrad(learning_rate=0.1, initial_accumulator_value=0.2),
        O.Adagrad(learning_rate=0.1, hessian_compression_times=2),
        O.Adagrad(learning_rate=0.1, clipvalue=1.0),
        O.Adagrad(learning_rate=0.1, weight_decay_factor=0.1),
        O.SGD(learning_rate=0.1),
        O.ProximalAdagrad(learning_rate=0.1),
    ],
    ids=["init-acc", "hct", "clipvalue", "weight-decay", "sgd", "proximal"],
)
def test_restore_into_engine_with_other_optimizer_names_the_table(saved, optimizer):
    _, path = saved
    other = _small_engine(optimizer=optimizer)
    with pytest.raises(CheckpointError, match="table 't'"):
        other.restore(path)
    assert other.step == 0


def test_restore_into_engine_with_other_tables(saved):
    _, path = saved
    t = ee.TableConfig(20, 4, name="renamed", combiner="sum")
    u = ee.TableConfig(15, 2, name="u", optimizer=O.FTRL(learning_rate=0.2))
    other = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t), "g": ee.FeatureConfig(u)}, optimizer=O.Adagrad(learning_rate=0.1)
    )
    with pytest.raises(CheckpointError, match="renamed"):
        other.restore(path)


def test_restore_with_a_different_constant_learning_rate_is_allowed(saved):
    eng, path = saved
    other = _small_engine(optimizer=O.Adagrad(learning_rate=0.5))
    other.restore(path)
    _assert_same_state(eng, other)


def _schedule(step):
    return 0.1 / (1 + step)


def test_callable_learning_rate_needs_callables_on_load(tmp_path, backend):
    eng = _small_engine(backend, optimizer=O.Adagrad(learning_rate=_schedule))
    _run_steps(eng, 2)
    path = eng.save(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["learning_rate_tags"] == [{"tag": 0, "callable": "_schedule"}]
    with pytest.raises(CheckpointError) as exc:
        ee.EmbeddingEngine.load(path)
    assert "tag 0" in str(exc.value) and "_schedule" in str(exc.value)
    assert "callables" in str(exc.value)
    loaded = ee.EmbeddingEngine.load(path, callables={0: _schedule}, backend=backend)
    assert loaded.learning_rate_tag("t") == 0
    _assert_same_state(eng, loaded)
    _run_steps(eng, 2)
    _run_steps(loaded, 2)
    _assert_same_state(eng, loaded)
    # Restoring into an engine built with the callable needs nothing more.
    fresh = _small_engine(backend, optimizer=O.Adagrad(learning_rate=_schedule))
    fresh.restore(path)
    assert fresh.step == 2


def test_two_callables_get_two_tags(tmp_path):
    def lr_a(step):
        return 0.1

    def lr_b():
        return 0.2

    t = ee.TableConfig(10, 2, name="a", optimizer=O.SGD(learning_rate=lr_a))
    u = ee.TableConfig(10, 2, name="b", optimizer=O.SGD(learning_rate=lr_b))
    eng = ee.EmbeddingEngine(
        {"a": ee.FeatureConfig(t), "b": ee.FeatureConfig(u)}, backend="reference"
    )
    _run_steps(eng, 1)
    path = eng.save(tmp_path)
    with pytest.raises(CheckpointError, match=r"tag 1.*lr_b"):
        ee.EmbeddingEngine.load(path, callables={0: lr_a})
    loaded = ee.EmbeddingEngine.load(path, callables={0: lr_a, 1: lr_b})
    _run_steps(eng, 1)
    _run_steps(loaded, 1)
    _assert_same_state(eng, loaded)


def test_dynamic_learning_rate_loads_without_callables(tmp_path, backend):
    eng = _small_engine(backend, optimizer=O.Adagrad(learning_rate=ee.DynamicLearningRate(0)))
    _run_steps(eng, 2, lrs=[0.3])
    loaded = ee.EmbeddingEngine.load(eng.save(tmp_path))
    assert isinstance(loaded.optimizer("t").learning_rate, ee.DynamicLearningRate)
    assert loaded.learning_rate_tag("t") == 0
    _assert_same_state(eng, loaded)
    with pytest.raises(ValueError, match="learning_rates"):
        _run_steps(loaded, 1)
    _run_steps(eng, 1, lrs=[0.2])
    _run_steps(loaded, 1, lrs=[0.2])
    _assert_same_state(eng, loaded)


# -- 6. keep=N and repeated saves at one step ------------------------------------------------------


def test_keep_keeps_only_the_newest(tmp_path):
    eng = _small_engine()
    paths = []
    for _ in range(5):
        _run_steps(eng, 1)
        paths.append(eng.save(tmp_path, keep=2))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [paths[3].name, paths[4].name]
    assert names == ["ckpt-000004-step000000000004", "ckpt-000005-step000000000005"]
    assert latest_checkpoint(tmp_path) == paths[4]
    _run_steps(eng, 1)
    eng.save(tmp_path, keep=1)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-000006-step000000000006"]
    # keep=None keeps everything
    for _ in range(3):
        _run_steps(eng, 1)
        eng.save(tmp_path)
    assert len(list(tmp_path.iterdir())) == 4


def test_a_save_failing_after_its_commit_says_the_checkpoint_is_there(tmp_path):
    """A save whose pruning failed after its rename into place raised the bare OSError, as if
    nothing was saved (a caller saving again saves the checkpoint twice), where a
    ShardedEngine's save raises a CheckpointError naming the committed checkpoint. The single
    engine's does so too now: ``path`` the checkpoint, chained to the OSError. The failure is
    a real one: the older checkpoint's folder, renamed to a name of 250 characters (zeros
    padding its number: still a checkpoint's name), cannot be renamed away to its trash name
    (``.trash-<name>-<8 hex>``, past the 255 bytes a name may have: ENAMETOOLONG). Permissions
    could not make it fail: the tests may run as root."""
    eng = _small_engine()
    _run_steps(eng, 1)
    first = eng.save(tmp_path)
    padded = tmp_path / f"ckpt-{1:0{250 - len('ckpt--step000000000001')}d}-step000000000001"
    assert len(padded.name) == 250 and ckpt_mod.is_checkpoint_name(padded.name)
    first.rename(padded)
    _run_steps(eng, 1)
    with pytest.raises(CheckpointError) as info:
        eng.save(tmp_path, keep=1)
    new = tmp_path / "ckpt-000002-step000000000002"
    assert info.value.path == new
    cause = info.value.__cause__
    assert isinstance(cause, OSError) and cause.errno == errno.ENAMETOOLONG, repr(cause)
    assert str(info.value).startswith(
        f"the checkpoint {new} was committed (complete: it restores), but the save then failed "
        "while pruning the checkpoints past keep=1 (older ones may remain): OSError: "
    ), str(info.value)
    assert ckpt_mod.list_checkpoints(tmp_path) == [padded, new]  # no temporary folder left
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([padded.name, new.name])
    _assert_same_state(eng, ee.EmbeddingEngine.load(tmp_path))  # the new one, complete


def test_a_save_interrupted_after_its_commit_notes_the_checkpoint(tmp_path, monkeypatch):
    """A KeyboardInterrupt after a save's commit is raised as it is (not wrapped), with a note
    naming the committed checkpoint. Pruning is replaced (one helper) to raise it: no real
    file operation raises a KeyboardInterrupt."""
    eng = _small_engine()
    _run_steps(eng, 1)

    def interrupted(root, keep):
        raise KeyboardInterrupt("the test's")

    monkeypatch.setattr(ckpt_mod, "_prune", interrupted)
    with pytest.raises(KeyboardInterrupt) as info:
        eng.save(tmp_path, keep=1)
    new = tmp_path / "ckpt-000001-step000000000001"
    assert info.value.__notes__ == [
        f"the checkpoint {new} was committed (complete: it restores), but the save then failed "
        "while pruning the checkpoints past keep=1 (older ones may remain): KeyboardInterrupt: "
        "the test's"
    ]
    assert ckpt_mod.list_checkpoints(tmp_path) == [new]


@pytest.mark.parametrize("keep", [0, -1, 1.5, "2"])
def test_bad_keep_is_refused_before_writing(tmp_path, keep):
    eng = _small_engine()
    with pytest.raises(ValueError, match="keep"):
        eng.save(tmp_path, keep=keep)
    assert latest_checkpoint(tmp_path) is None


def test_keep_true_is_refused_like_other_bools(tmp_path):
    """keep=True is not an int >= 1 (the engine rejects bools for seed, tags, ...); it must not
    silently mean keep=1 and delete older checkpoints."""
    eng = _small_engine()
    eng.save(tmp_path)
    _run_steps(eng, 1)
    with pytest.raises(ValueError, match="keep"):
        eng.save(tmp_path, keep=True)
    assert len(ckpt_mod.list_checkpoints(tmp_path)) == 1


def test_same_step_saved_twice_gets_numbered_and_newest_loads(tmp_path):
    eng = _small_engine()
    _run_steps(eng, 3)
    a = eng.save(tmp_path)
    eng.embedding_tables["t"][0] = 42.0  # change the state without a step
    b = eng.save(tmp_path)
    assert (a.name, b.name) == ("ckpt-000001-step000000000003", "ckpt-000002-step000000000003")
    assert latest_checkpoint(tmp_path) == b
    loaded = ee.EmbeddingEngine.load(tmp_path)
    assert np.all(loaded.embedding_tables["t"][0] == 42.0)
    _assert_same_state(eng, loaded)
    c = eng.save(tmp_path, keep=1)
    assert c.name == "ckpt-000003-step000000000003"
    assert [p.name for p in tmp_path.iterdir()] == [c.name]


def test_names_widen_past_their_digits_and_order_by_number(tmp_path):
    """A step >= 10^12 or the 1,000,000th save widens the name (it no longer matched the
    fixed-width pattern: the newer checkpoint was invisible, restore(root) loaded an older one
    and keep=N never pruned it); checkpoints are ordered by their numbers, old names read."""
    eng = _small_engine()
    _run_steps(eng, 1)
    eng.save(tmp_path / "a")
    state = eng.state_dict()
    state["step"] = 10**12
    eng.load_state_dict(state)
    _run_steps(eng, 1)
    big = eng.save(tmp_path / "a", keep=1)
    assert big.name == "ckpt-000002-step1000000000001"
    assert [p.name for p in (tmp_path / "a").iterdir()] == [big.name]
    assert latest_checkpoint(tmp_path / "a") == big
    assert _small_engine().restore(tmp_path / "a").step == 10**12 + 1
    # the 999,999th save (an older one renamed), then the 1,000,000th
    old = eng.save(tmp_path / "b")
    old.rename(tmp_path / "b" / ckpt_mod.checkpoint_name(999_999, eng.step))
    _run_steps(eng, 1)
    new = eng.save(tmp_path / "b")
    assert new.name == f"ckpt-1000000-step{eng.step:012d}"
    assert latest_checkpoint(tmp_path / "b") == new
    assert ee.EmbeddingEngine.load(tmp_path / "b").step == eng.step
    last = eng.save(tmp_path / "b", keep=1)  # the same step again: numbered after it
    assert [p.name for p in (tmp_path / "b").iterdir()] == [last.name]
    assert last.name == f"ckpt-1000001-step{eng.step:012d}"


def test_save_with_keep_returns_an_existing_checkpoint_after_rewinding(tmp_path):
    """Restoring an older checkpoint and saving again (e.g. after discarding a bad run) must not
    delete the checkpoint that was just written: save() returns its directory."""
    eng = _small_engine()
    _run_steps(eng, 2)
    early = eng.save(tmp_path / "early")
    _run_steps(eng, 3)
    eng.save(tmp_path / "ck")  # step 5
    rewound = ee.EmbeddingEngine.load(early)  # step 2
    _run_steps(rewound, 1)
    path = rewound.save(tmp_path / "ck", keep=1)  # step 3
    assert path.is_dir(), f"save() returned {path.name}, which keep=1 deleted"
    assert latest_checkpoint(tmp_path / "ck") == path


# -- 7. the files are standard safetensors ---------------------------------------------------------


def test_files_load_with_the_safetensors_package(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    t = ee.TableConfig(25, 4, name="emb", optimizer=O.Adam(bias_correction="per_row"))
    c = ee.TableConfig(10, 1, name="cnt", optimizer=O.FrequencyEstimator())
    r = ee.TableConfig(12, 3, name="rms", optimizer=O.RMSProp(centered=True))
    eng = ee.EmbeddingEngine(
        {"a": ee.FeatureConfig(t), "b": ee.FeatureConfig(c), "c": ee.FeatureConfig(r)},
        backend="reference",
    )
    _run_steps(eng, 2)
    path = eng.save(tmp_path, extra_tensors={"dense/w": np.eye(3, dtype=np.float64)})
    manifest = json.loads((path / "manifest.json").read_text())
    for entry in manifest["tables"]:
        name = entry["name"]
        loaded = st.load_file(str(path / entry["file"]))
        expected = {name, *(f"{name}/{s}" for s in eng.slots(name))}
        assert set(loaded) == expected
        np.testing.assert_array_equal(loaded[name], eng.embedding_tables[name])
        assert loaded[name].dtype == np.float32
        for s, arr in eng.slots(name).items():
            assert loaded[f"{name}/{s}"].dtype == arr.dtype
            np.testing.assert_array_equal(loaded[f"{name}/{s}"], arr)
    assert set(st.load_file(str(path / "table-000.safetensors"))) == {
        "emb",
        "emb/momenta",
        "emb/velocities",
        "emb/steps",
    }
    assert st.load_file(str(path / "table-000.safetensors"))["emb/steps"].dtype == np.int32
    extra = st.load_file(str(path / "extra.safetensors"))
    np.testing.assert_array_equal(extra["dense/w"], np.eye(3))
    from safetensors import safe_open

    with safe_open(str(path / "table-001.safetensors"), framework="numpy") as f:
        assert f.metadata() == {"table": "cnt"}


def test_files_written_by_the_safetensors_package_are_read(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    arrays = {
        "a": np.arange(12, dtype=np.float32).reshape(3, 4),
        "b": np.array([[1], [2]], dtype=np.int32),
        "c": np.zeros((0, 3), np.float32),
        "d": np.float16([1.5, -2]),
    }
    st.save_file(arrays, str(tmp_path / "x.safetensors"))
    header = read_header(tmp_path / "x.safetensors")
    for k, v in arrays.items():
        got = read_tensor(tmp_path / "x.safetensors", k, header=header)
        assert got.dtype == v.dtype and got.shape == v.shape
        np.testing.assert_array_equal(got, v)
        out = np.empty_like(v)
        read_tensor(tmp_path / "x.safetensors", k, out=out, header=header)
        np.testing.assert_array_equal(out, v)


def test_chunked_write_of_a_strided_view(tmp_path, monkeypatch):
    """Tables are strided views of the packed storage, written in chunks of rows."""
    from embengine import safetensors_io

    monkeypatch.setattr(safetensors_io, "CHUNK_BYTES", 64)
    st = pytest.importorskip("safetensors.numpy")
    base = np.arange(7 * 10, dtype=np.float32).reshape(7, 10)
    view = base[:, 2:5]
    write_safetensors(tmp_path / "v.safetensors", {"v": view, "i": base.view(np.int32)[:, 9:]})
    got = st.load_file(str(tmp_path / "v.safetensors"))
    np.testing.assert_array_equal(got["v"], view)
    np.testing.assert_array_equal(got["i"], base.view(np.int32)[:, 9:])
    out = np.zeros((7, 10), np.float32)
    read_tensor(tmp_path / "v.safetensors", "v", out=out[:, 5:8])
    np.testing.assert_array_equal(out[:, 5:8], view)


# -- 8. mmap storage ------------------------------------------------------------------------------


def _mmap_features():
    a = ee.TableConfig(
        40,
        8,
        name="a",
        combiner="sum",
        optimizer=O.Adam(learning_rate=0.05, bias_correction="per_row"),
    )
    b = ee.TableConfig(30, 4, name="b", optimizer=O.FTRL(learning_rate=0.1))
    c = ee.TableConfig(20, 1, name="c", optimizer=O.FrequencyEstimator())
    return {
        "fa": ee.FeatureConfig(a),
        "fa2": ee.FeatureConfig(a, 3),
        "fb": ee.FeatureConfig(b),
        "fc": ee.FeatureConfig(c),
    }


@pytest.mark.parametrize("storage", ["mmap", {"a": "mmap", "c": "mmap"}], ids=["all", "dict"])
def test_mmap_storage_matches_ram_and_saves_like_ram(tmp_path, backend, storage):
    ram = ee.EmbeddingEngine(_mmap_features(), optimizer=O.SGD(0.1), seed=5, backend=backend)
    mm = ee.EmbeddingEngine(
        _mmap_features(),
        optimizer=O.SGD(0.1),
        seed=5,
        backend=backend,
        storage=storage,
        storage_dir=tmp_path / "store",
    )
    mapped = ["a", "b", "c"] if storage == "mmap" else ["a", "c"]
    widths = {"a": 8 + 8 + 8 + 1, "b": 4 + 4 + 4, "c": 1 + 1}  # weights + slots, 4 bytes each
    for name in ["a", "b", "c"]:
        f = tmp_path / "store" / f"{name}.f32"
        assert f.exists() == (name in mapped), name
        if name in mapped:
            vocab = ram.table_configs[name].vocabulary_size
            assert f.stat().st_size == vocab * widths[name] * 4, name
    _assert_same_state(ram, mm)
    for _ in range(4):
        feats, grads = _batch(ram, ram.step)
        acts_r = ram.lookup(feats)
        acts_m = mm.lookup(feats)
        for k in acts_r:
            assert acts_r[k].tobytes() == acts_m[k].tobytes(), k
        ram.apply_gradients(grads)
        mm.apply_gradients(grads)
        _assert_same_state(ram, mm)
    # The file holds the live table.
    mm.flush()
    np.testing.assert_array_equal(
        np.fromfile(tmp_path / "store" / "a.f32", dtype=np.float32).reshape(40, -1)[:, :8],
        mm.embedding_tables["a"],
    )
    # Save / load like RAM, into RAM or into mmap storage elsewhere.
    p_ram = ram.save(tmp_path / "ck_ram")
    p_mm = mm.save(tmp_path / "ck_mm")
    for f in ("table-000.safetensors", "table-001.safetensors", "table-002.safetensors"):
        assert (p_ram / f).read_bytes() == (p_mm / f).read_bytes()
    storage_of = {
        t["name"]: t["storage"] for t in json.loads((p_mm / "manifest.json").read_text())["tables"]
    }
    assert storage_of == {n: ("mmap" if n in mapped else "ram") for n in "abc"}
    back_ram = ee.EmbeddingEngine.load(p_mm, backend=backend)
    back_mm = ee.EmbeddingEngine.load(
        p_ram, backend=backend, storage=storage, storage_dir=tmp_path / "store2"
    )
    assert (tmp_path / "store2" / "a.f32").exists()
    _assert_same_state(ram, back_ram)
    _assert_same_state(ram, back_mm)
    restored = ee.EmbeddingEngine(
        _mmap_features(),
        optimizer=O.SGD(0.1),
        seed=5,
        backend=backend,
        storage=storage,
        storage_dir=tmp_path / "store3",
    )
    restored.restore(p_ram)
    _assert_same_state(ram, restored)
    for e in (ram, back_ram, back_mm, restored):
        feats, grads = _batch(e, e.step)
        e.apply_gradients(grads)
    _assert_same_state(ram, back_ram)
    _assert_same_state(ram, back_mm)
    _assert_same_state(ram, restored)


def test_ram_tables_start_on_a_cache_line():
    for vocab in (3, 100_000):  # small (NumPy allocation) and large
        t = ee.TableConfig(vocab, 64, name="t", optimizer=O.Adagrad(0.1))
        eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)})
        assert eng._physical[0].data.ctypes.data % 64 == 0


def test_mmap_tables_are_advised_random_except_for_sequential_work(tmp_path, monkeypatch):
    from embengine.storage import dense

    advice = []
    real = dense._advise
    monkeypatch.setattr(dense, "_advise", lambda m, a: (advice.append(a), real(m, a))[1])
    t = ee.TableConfig(50, 4, name="t", optimizer=O.Adam(0.1, lazy_adam=False))
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, storage="mmap", storage_dir=tmp_path)
    # random for training, sequential while initialising
    assert advice == ["MADV_RANDOM", "MADV_SEQUENTIAL", "MADV_RANDOM"]
    advice.clear()
    eng.lookup({"f": [[1, 2]]})
    eng.apply_gradients({"f": np.ones((1, 4), np.float32)})  # non-lazy Adam sweeps every row
    assert advice == ["MADV_SEQUENTIAL", "MADV_RANDOM"]
    advice.clear()
    path = eng.save(tmp_path / "ck")
    eng.restore(path)
    assert advice == ["MADV_SEQUENTIAL", "MADV_RANDOM"] * 2
    # an error while reading still puts random access back
    advice.clear()
    table = eng._physical[0]
    with pytest.raises(RuntimeError), table.sequential_access():
        raise RuntimeError("boom")
    assert advice == ["MADV_SEQUENTIAL", "MADV_RANDOM"]


def test_mmap_storage_errors(tmp_path):
    with pytest.raises(ValueError, match="storage_dir"):
        ee.EmbeddingEngine(_mmap_features(), optimizer=O.SGD(0.1), storage="mmap")
    with pytest.raises(ValueError, match="zzz"):
        ee.EmbeddingEngine(
            _mmap_features(), optimizer=O.SGD(0.1), storage={"zzz": "mmap"}, storage_dir=tmp_path
        )
    with pytest.raises(ValueError, match="'a'"):
        ee.EmbeddingEngine(
            _mmap_features(), optimizer=O.SGD(0.1), storage={"a": "disk"}, storage_dir=tmp_path
        )


def test_manifest_describes_the_engine(saved):
    eng, path = saved
    m = json.loads((path / "manifest.json").read_text())
    assert m["format"] == "embengine-checkpoint" and m["format_version"] == 1
    assert m["step"] == 2 and m["seed"] == 3 and m["backend"] == "reference"
    assert [t["name"] for t in m["tables"]] == ["t", "u"]
    assert m["tables"][0]["optimizer"]["class"] == "Adagrad"
    assert m["tables"][1]["optimizer"]["params"]["learning_rate"] == {"constant": 0.2}
    assert set(m["files"]) == {
        "table-000.safetensors",
        "table-001.safetensors",
        "extra.safetensors",
    }
    for name, info in m["files"].items():
        data = (path / name).read_bytes()
        assert info == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    assert not any(p.suffix in (".pkl", ".pt", ".npy") for p in path.iterdir())
    assert dataclasses.is_dataclass(ckpt_mod.CheckpointInfo)
