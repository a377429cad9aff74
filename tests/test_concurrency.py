"""One engine, several threads: the concurrency contract of EmbeddingEngine (its docstring).

Real threads, real kernels, real files; every wait has a timeout, so a deadlock fails instead of
hanging. The workloads use SGD with values exact in float32, so the result of any interleaving
is known exactly: a test passes on the locked engine whatever the scheduling, and fails on an
engine without the lock as soon as two updates (or an update and a save) overlap.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import embengine as ee
from embengine import initializers as I
from embengine import optimizers as O
from embengine.checkpoint import list_checkpoints, read_checkpoint
from embengine.torch import EmbeddingLayer

TIMEOUT = 300


def _run_threads(targets) -> None:
    """Start one thread per callable, join them with a timeout, re-raise the first error."""
    errors: list[BaseException] = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # re-raised below
                errors.append(e)

        return run

    threads = [threading.Thread(target=wrap(fn), daemon=True) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


def _counting_engine(backend: str = "numba") -> ee.EmbeddingEngine:
    """Three tables of zeros, SGD with learning rate 1: a step whose gradient is -1 for every
    row adds exactly 1 to every weight, so every row holds the step it was last saved at."""
    feats = {}
    for t in range(3):
        table = ee.TableConfig(20_000, 16, name=f"t{t}", combiner="sum", initializer=I.Zeros())
        feats[f"f{t}"] = ee.FeatureConfig(table)
    return ee.EmbeddingEngine(feats, optimizer=O.SGD(1.0), backend=backend)


def _every_row_step(eng: ee.EmbeddingEngine) -> None:
    ids = np.arange(20_000, dtype=np.int64)
    feats = {f"f{t}": ee.Ragged(ids, lengths=np.ones(20_000, np.int64)) for t in range(3)}
    acts = eng.lookup(feats)
    eng.apply_gradients({k: np.full_like(a, -1.0) for k, a in acts.items()})


def test_a_save_while_another_thread_trains_holds_one_step(tmp_path, backend):
    eng = _counting_engine(backend)
    root = tmp_path / "ck"
    stop = threading.Event()
    saves = 20

    def train():
        while not stop.is_set():
            _every_row_step(eng)

    def save():
        try:
            for _ in range(saves):
                eng.save(root)
        finally:
            stop.set()

    _run_threads([train, save])
    checkpoints = list_checkpoints(root)
    assert len(checkpoints) == saves
    torn = []
    for path in checkpoints:
        spec, reader = read_checkpoint(path)
        state = reader.state_dict()
        step = state["step"]
        for name, arrays in state["tables"].items():
            w = np.empty(arrays["weights"].shape, np.float32)
            arrays["weights"].read_into(w)
            if not (w == step).all():
                torn.append((path.name, name, step, sorted(set(np.unique(w).tolist()))[:4]))
    assert not torn, f"checkpoints holding tables of other steps than their own: {torn}"


def _layer_features(ids: np.ndarray) -> dict:
    return {"f": torch.from_numpy(ids.reshape(-1, 2))}


def test_two_threads_training_through_embedding_layer_lose_no_update():
    """Two threads train through EmbeddingLayer's backward, each on rows of its own and on rows
    both hit; the result must be the sequential one exactly (SGD, gradients of 1/4, lr 1/2:
    every value is exact in float32, so the order of the updates does not matter). Without the
    engine's lock two updates of a shared row overlap and one of them is lost."""
    n, steps = 2_000, 150
    vocab = 3 * n
    table = ee.TableConfig(vocab, 8, name="t", combiner="sum", initializer=I.Zeros())
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(table)}, optimizer=O.SGD(0.5))
    layer = EmbeddingLayer(eng)
    # Thread k owns rows [k * n, (k + 1) * n); rows [2n, 3n) are shared. Sample i of thread k
    # hits its own row i and shared row i.
    shared = np.arange(2 * n, 3 * n, dtype=np.int64)
    batches = [
        np.stack([np.arange(k * n, (k + 1) * n), shared], axis=1).reshape(-1) for k in range(2)
    ]
    barrier = threading.Barrier(2, timeout=TIMEOUT)

    def train(k):
        def run():
            barrier.wait()
            for _ in range(steps):
                out = layer(_layer_features(batches[k]))["f"]
                (out * 0.25).sum().backward()

        return run

    _run_threads([train(0), train(1)])
    w = eng.embedding_tables["t"]
    assert eng.step == 2 * steps
    # Each occurrence subtracts lr * 1/4 = 1/8: own rows get one a step, shared rows two.
    expected = np.full((vocab, 8), -steps / 8, np.float32)
    expected[shared] = -2 * steps / 8
    lost = np.flatnonzero((w != expected).any(axis=1))
    assert len(lost) == 0, (
        f"{len(lost)} rows lost updates, e.g. row {lost[0]}: {w[lost[0]]} != {expected[lost[0]]}"
    )


def test_each_thread_applies_gradients_to_its_own_lookup(backend):
    """Thread A looks up, then thread B, then A and B apply gradients without batch=: each
    update must land on the rows its own thread looked up."""
    table = ee.TableConfig(100, 4, name="t", combiner="sum", initializer=I.Zeros())
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(table)}, optimizer=O.SGD(1.0), backend=backend)
    looked_up = [threading.Event(), threading.Event()]
    applied_a = threading.Event()

    def thread_a():
        acts = eng.lookup({"f": [[1], [2]]})
        looked_up[0].set()
        assert looked_up[1].wait(TIMEOUT)
        eng.apply_gradients({"f": np.full_like(acts["f"], -1.0)})
        applied_a.set()

    def thread_b():
        assert looked_up[0].wait(TIMEOUT)
        acts = eng.lookup({"f": [[50], [60]]})
        looked_up[1].set()
        assert applied_a.wait(TIMEOUT)
        eng.apply_gradients({"f": np.full_like(acts["f"], -2.0)})

    _run_threads([thread_a, thread_b])
    w = eng.embedding_tables["t"][:, 0]
    assert w[[1, 2]].tolist() == [1.0, 1.0], "thread A's update did not reach A's rows"
    assert w[[50, 60]].tolist() == [2.0, 2.0], "thread B's update did not reach B's rows"
    assert np.count_nonzero(w) == 4
    assert eng.step == 2


def test_a_load_forgets_every_threads_pending_batch():
    table = ee.TableConfig(10, 2, name="t", combiner="sum")
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(table)}, optimizer=O.SGD(0.1))
    state = {
        "step": 0,
        "tables": {"t": {k: np.array(v) for k, v in eng.state_dict()["tables"]["t"].items()}},
    }
    looked_up, loaded = threading.Event(), threading.Event()
    errors = []

    def worker():
        acts = eng.lookup({"f": [[1]]})
        looked_up.set()
        assert loaded.wait(TIMEOUT)
        try:
            eng.apply_gradients({"f": np.ones_like(acts["f"])})
        except ValueError as e:
            errors.append(e)

    def loader():
        assert looked_up.wait(TIMEOUT)
        eng.load_state_dict(state, strict=False)
        loaded.set()

    _run_threads([worker, loader])
    assert len(errors) == 1 and "needs a lookup" in str(errors[0])
    assert eng.step == 0


def test_the_lock_is_reentrant_and_pickles_away():
    import pickle

    table = ee.TableConfig(10, 2, name="t", combiner="sum")
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(table)}, optimizer=O.SGD(0.1))
    with eng.lock:  # a caller holding the lock can still train and read
        acts = eng.lookup({"f": [[1]]})
        eng.apply_gradients({"f": np.ones_like(acts["f"])})
        snapshot = {k: np.array(v) for k, v in eng.state_dict()["tables"]["t"].items()}
    copy = pickle.loads(pickle.dumps(eng))
    assert copy.lock is not eng.lock
    np.testing.assert_array_equal(copy.embedding_tables["t"], snapshot["weights"])
    # The copy has no pending batch (the original's was consumed; a copy starts without).
    with pytest.raises(ValueError, match="needs a lookup"):
        copy.apply_gradients({"f": np.ones((1, 2), np.float32)})
