"""Preprocessing in torch DataLoader workers: forked (Linux's default) and spawned.

A forked worker inherits its parent's OpenMP state without its threads: numba's omp layer
killed it at the first parallel kernel ("fork() called from a process already using GNU
OpenMP"). Preparation runs a serial build of the same kernel there, with the same results bit
for bit. A spawned worker gets the pickled collate function: a Preprocessor, a few hundred
bytes, instead of an engine with its tables. The DataLoader runs in a subprocess with a hard
timeout, since the failure kills or hangs processes.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import embengine as ee
from embengine import optimizers as opt
from embengine.backends.numba_backend import build_tables_numba
from embengine.batch import PreparedBatch, build_tables_numpy, plan_tables
from embengine.kernels import pool

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 600  # seconds for a whole subprocess (cold numba caches compile for minutes)


def _engine(backend: str = "numba", seed: int = 0, learning_rate=0.1) -> ee.EmbeddingEngine:
    """Bag features with weights (mean, sqrtn), a sequence feature, two dim-4 tables that
    are packed into one storage table, a shared table."""
    init = ee.initializers.RandomUniform(-0.5, 0.5)
    users = ee.TableConfig(500, 8, init, combiner="sqrtn", name="users")
    items = ee.TableConfig(300, 8, init, combiner="mean", name="items")
    small_a = ee.TableConfig(40, 4, init, combiner="sum", name="small_a")
    small_b = ee.TableConfig(60, 4, init, combiner="mean", name="small_b")
    features = {
        "user": ee.FeatureConfig(users),
        "item": ee.FeatureConfig(items),
        "history": ee.FeatureConfig(items, max_sequence_length=3),
        "a": ee.FeatureConfig(small_a),
        "b": ee.FeatureConfig(small_b),
    }
    adagrad = opt.Adagrad(learning_rate=learning_rate, low_dimensional_packing_status=True)
    return ee.EmbeddingEngine(features, optimizer=adagrad, seed=seed, backend=backend)


def _features(seed: int, batch: int = 16):
    """One batch for _engine: ragged bags (some empty), weights, repeated ids."""
    rng = np.random.default_rng(seed)

    def ragged(vocab, max_len, weighted=False):
        lengths = rng.integers(0, max_len + 1, batch)
        ids = rng.integers(0, vocab, int(lengths.sum()))
        w = rng.uniform(0.1, 2.0, len(ids)).astype(np.float32) if weighted else None
        return ee.Ragged(ids, lengths=lengths), w

    user, user_w = ragged(20, 3, weighted=True)  # few distinct ids: duplicates
    item, item_w = ragged(300, 4, weighted=True)
    history, _ = ragged(300, 5)
    a, _ = ragged(40, 2)
    b, _ = ragged(60, 3)
    features = {"user": user, "item": item, "history": history, "a": a, "b": b}
    return features, {"user": user_w, "item": item_w}


def _assert_same(x, y, where: str = "batch") -> None:
    """Equal bit for bit, field by field (any field a PreparedBatch gains is compared too)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        assert type(x) is type(y), where
        for f in dataclasses.fields(x):
            _assert_same(getattr(x, f.name), getattr(y, f.name), f"{where}.{f.name}")
    elif isinstance(x, np.ndarray):
        assert isinstance(y, np.ndarray) and x.dtype == y.dtype, where
        assert np.array_equal(x, y), where
    elif isinstance(x, dict):
        assert list(x) == list(y), where
        for k in x:
            _assert_same(x[k], y[k], f"{where}[{k!r}]")
    elif isinstance(x, tuple | list):
        assert len(x) == len(y), where
        for i, (a, b) in enumerate(zip(x, y, strict=True)):
            _assert_same(a, b, f"{where}[{i}]")
    elif isinstance(x, ee.Ragged):
        for name in ("ids", "offsets", "weights"):
            a, b = getattr(x, name), getattr(y, name)
            assert (a is None) == (b is None), f"{where}.{name}"
            if a is not None:
                _assert_same(a, b, f"{where}.{name}")
    else:
        assert x == y, f"{where}: {x!r} != {y!r}"


# -- in this process ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_serial_preparation_equals_the_parallel_one_bit_for_bit(seed):
    # The serial kernel runs in forked workers, the parallel one in the main process: a batch
    # must not depend on where it was built.
    engine = _engine()
    features, weights = _features(seed, batch=64)
    parts, _ = plan_tables(engine._resolved, features, weights, engine._storage_layout)
    assert len(parts) < len(engine.table_names), "the dim-4 tables should be packed"
    serial = build_tables_numba(parts, parallel=False)
    _assert_same(serial, build_tables_numba(parts, parallel=True), "serial vs parallel")
    _assert_same(serial, build_tables_numpy(parts), "serial vs numpy")


def test_the_main_process_is_not_forked():
    assert not pool.forked()


@pytest.mark.parametrize("training", [True, False])
def test_preprocessor_batches_equal_preprocess_and_train_the_same(backend, training):
    from embengine.preprocessing import Preprocessor

    engine = _engine(backend)
    pre = engine.preprocessor()
    assert isinstance(pre, Preprocessor) and pre.backend == backend
    features, weights = _features(3)
    mine, theirs = (
        pre(features, weights, training=training),
        engine.preprocess(features, weights, training=training),
    )
    assert isinstance(mine, PreparedBatch)
    _assert_same(mine, theirs)
    acts = engine.lookup(mine, training=training)
    _assert_same(acts, engine.lookup(theirs, training=training), "activations")
    if not training:
        return
    # An engine updated from the Preprocessor's batch ends where preprocess's batch leads.
    other = _engine(backend)
    grads = {n: np.full(a.shape, 0.5, np.float32) for n, a in acts.items()}
    engine.apply_gradients(grads, batch=mine)
    other.apply_gradients(grads, batch=other.preprocess(features, weights))
    _assert_same(engine.embedding_tables, other.embedding_tables, "tables")


def test_layer_preprocessor_takes_keyed_jagged():
    from embengine.torch import EmbeddingLayer, KeyedJagged

    layer = EmbeddingLayer(_engine())
    kjt = KeyedJagged(
        ["user", "item", "history", "a", "b"],
        values=np.arange(10) % 20,
        lengths=[1, 1, 2, 0, 1, 1, 2, 0, 1, 1],
    )
    _assert_same(layer.preprocessor()(kjt), layer.preprocess(kjt))


def test_preprocessor_errors_name_the_feature():
    engine = _engine()
    features, _ = _features(0)
    features["item"] = [[3], [300]]
    with pytest.raises(ValueError) as mine:
        engine.preprocessor()(features)
    with pytest.raises(ValueError) as theirs:
        engine.preprocess(features)
    assert str(mine.value) == str(theirs.value)
    assert "feature 'item'" in str(mine.value) and "300" in str(mine.value)


def test_preprocessor_pickles_small_without_tables_or_optimizers():
    # A callable learning rate (a lambda does not pickle) and a 4 MB table: an engine, or a
    # layer's bound preprocess, sends all of it to every spawned worker.
    from embengine.torch import EmbeddingLayer

    big = ee.TableConfig(100_000, 8, name="big", optimizer=opt.SGD(learning_rate=lambda: 0.1))
    small = ee.TableConfig(50, 4, name="small")
    engine = ee.EmbeddingEngine(
        {"x": ee.FeatureConfig(big), "y": ee.FeatureConfig(small)},
        optimizer=opt.Adagrad(learning_rate=0.1),
    )
    layer = EmbeddingLayer(_engine())  # a picklable engine (no lambda), for the contrast
    assert len(pickle.dumps(layer.preprocess)) > layer.engine.storage_bytes
    pre = engine.preprocessor()
    data = pickle.dumps(pre)
    assert len(data) < 4_000, len(data)
    assert len(data) * 1000 < engine.storage_bytes
    copy = pickle.loads(data)
    assert copy.table_configs["big"].vocabulary_size == 100_000
    assert copy.table_configs["big"].optimizer is None
    features = {"x": [[1, 99_999, 1], [5]], "y": [3, 49]}
    _assert_same(copy(features), engine.preprocess(features))
    assert "big: 100000x8" in repr(copy)


# -- DataLoader workers, in a subprocess ------------------------------------------------------

_SCRIPT = """
import functools, os, sys
import numpy as np
import torch
sys.path.insert(0, {tests!r})
import embengine as ee
from embengine.torch import EmbeddingLayer
from test_dataloader import _assert_same, _engine, _features

N_BATCHES = 6


class Batches(torch.utils.data.Dataset):
    def __len__(self):
        return N_BATCHES

    def __getitem__(self, i):
        return _features(100 + i)


def collate(items, pre):
    (features, weights), = items
    return features, weights, pre(features, weights), os.getpid()


def train_on(layer, batch, w):
    acts = layer(batch)
    loss = sum((a * w[: a.shape[-1]]).sum() for a in acts.values())
    loss.backward()


if __name__ == "__main__":
    start, collate_with = sys.argv[1:3]
    w = torch.linspace(-1.0, 1.0, 8)
    layer = EmbeddingLayer(_engine(seed=7))
    main_layer = EmbeddingLayer(_engine(seed=7))  # trained on batches built here
    # A step first, so that numba's and torch's OpenMP pools are live when the workers fork.
    for layer_ in (layer, main_layer):
        train_on(layer_, _features(99)[0], w)
    if collate_with == "layer":  # the documented use before the Preprocessor (fork only)
        collate_fn = lambda items: collate(items, layer.preprocess)  # noqa: E731
    else:
        collate_fn = functools.partial(collate, pre=layer.preprocessor())
    loader = torch.utils.data.DataLoader(
        Batches(), batch_size=1, num_workers=2, collate_fn=collate_fn, timeout=300,
        multiprocessing_context=start,
    )
    for epoch in range(2):
        seen = 0
        for features, weights, batch, worker in loader:
            assert worker != os.getpid()
            _assert_same(batch, layer.engine.preprocess(features, weights))
            train_on(layer, batch, w)
            train_on(main_layer, main_layer.preprocess(features, weights), w)
            seen += 1
        assert seen == N_BATCHES
        print("epoch", epoch, "done", flush=True)
    _assert_same(layer.engine.embedding_tables, main_layer.engine.embedding_tables, "tables")
    _assert_same(layer.engine.slots("users"), main_layer.engine.slots("users"), "slots")
    print("OK")
"""


def _run_script(tmp_path: Path, text: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``text`` as a file (spawned workers import their main module from it), with this
    checkout's embengine first on the path."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(text))
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


@pytest.mark.parametrize(
    "start, collate_with", [("fork", "layer"), ("fork", "preprocessor"), ("spawn", "preprocessor")]
)
def test_dataloader_workers_prepare_what_the_main_process_would(tmp_path, start, collate_with):
    # Two epochs, two workers; the workers' batches equal the main process's bit for bit, and
    # training on them ends with the same tables.
    done = _run_script(tmp_path, _SCRIPT.format(tests=str(REPO / "tests")), start, collate_with)
    assert done.returncode == 0 and done.stdout.endswith("OK\n"), (
        f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    )
    assert "GNU OpenMP" not in done.stderr


_FORKED_LOOKUP = """
import os, sys
import numpy as np
sys.path.insert(0, {tests!r})
from embengine.kernels import pool
from test_dataloader import _engine, _features

engine = _engine()
features, weights = _features(0)
acts = engine.lookup(features, weights)  # starts numba's pool
engine.apply_gradients({{n: np.ones_like(a) for n, a in acts.items()}})
pid = os.fork()
if pid == 0:
    code = 1
    try:
        batch = engine.preprocess(features, weights)  # the serial kernel: fine here
        print("forked", pool.forked(), flush=True)
        engine.lookup(batch)
        print("lookup ran", flush=True)
        code = 0
    except RuntimeError as e:
        print("RuntimeError:", e, flush=True)
        code = 3
    os._exit(code)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status), flush=True)
"""


@pytest.mark.parametrize("layer", ["omp", "workqueue"])
def test_a_lookup_in_a_forked_process(tmp_path, monkeypatch, layer):
    # Under the omp layer numba used to SIGTERM the process; now an error says why and what
    # works. The fork-safe workqueue layer runs parallel kernels there, as before.
    monkeypatch.setenv("NUMBA_THREADING_LAYER", layer)
    done = _run_script(tmp_path, _FORKED_LOOKUP.format(tests=str(REPO / "tests")))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "forked True" in done.stdout  # so preprocess took the serial kernel
    if layer == "workqueue":
        assert "lookup ran" in done.stdout and "child exit 0" in done.stdout, done.stdout
        return
    assert "child exit 3" in done.stdout, f"{done.stdout}\n{done.stderr[-3000:]}"
    assert "was forked from process" in done.stdout
    assert "spawn" in done.stdout


def test_the_example_runs(tmp_path):
    done = _run_script(
        tmp_path, (REPO / "examples" / "dataloader.py").read_text(), "--samples", "3000"
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-3000:]}"
    assert "embedding tables equal bit for bit: True" in done.stdout
