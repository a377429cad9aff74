"""Each kernel is called with one argument type whatever the caller's arrays are.

numba compiles a kernel once per argument type, and an array's type includes whether it is
writable. A pooling kernel compiles nine widths per type (seconds each), so a user whose ids
arrive read-only (a frozen batch, a memory-mapped file) or whose lookups mix weighted and plain
features must not pay the compile twice. The tests spy on the arguments the numba backend hands
its kernels (the real kernels still run) and compare their numba types across callers.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

import embengine as ee
from embengine import optimizers as opt
from embengine.backends import numba_backend as nbk
from embengine.kernels import train_lookup


def _types(args) -> tuple:
    return tuple(numba.typeof(a) for a in args)


class _Spy:
    """Calls ``kernel`` and records the numba types of its arguments."""

    def __init__(self, kernel, calls: list):
        self.kernel, self.calls = kernel, calls

    def __call__(self, *args, **kwargs):
        self.calls.append(_types(args))
        return self.kernel(*args, **kwargs)


def _engine(**table):
    t = ee.TableConfig(50, 8, name="t", **table)
    return ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t), "g": ee.FeatureConfig(t)},
        optimizer=opt.Adagrad(0.1),
        backend="numba",
    )


def _read_only(a: np.ndarray) -> np.ndarray:
    a = np.array(a)
    a.flags.writeable = False
    return a


def test_lookup_only_pooling_gets_one_type_for_plain_weighted_and_read_only_inputs(monkeypatch):
    calls: list = []
    # Dense and keyed tables' lookup-only batches are pooled in one region (pool_features);
    # pool_bags serves the others (a 16-bit table, a storage that maps ids itself).
    monkeypatch.setattr(train_lookup, "pool_features", _Spy(train_lookup.pool_features, calls))
    eng = _engine()
    ids = np.array([1, 2, 2, 7])
    lengths = np.array([2, 0, 2])
    eng.lookup({"f": ee.Ragged(ids, lengths=lengths), "g": ids[:3]}, training=False)
    eng.lookup(
        {
            "f": ee.Ragged(
                _read_only(ids), lengths=lengths, weights=np.array([0.5, 1.0, 2.0, 1.0], np.float32)
            ),
            "g": _read_only(ids[:3]),
        },
        training=False,
    )
    assert len(calls) == 2
    assert len(set(calls)) == 1, set(calls)


def test_training_and_lookup_only_pool_with_the_same_index_types(monkeypatch):
    """The training lookup (``prepare_and_pool``) and the lookup-only one (``pool_features``)
    call the same pooling task function: the arrays it reads arrive with the same types, so it
    and each width's pooling compile once for both."""
    bags: list = []
    train: list = []
    monkeypatch.setattr(train_lookup, "pool_features", _Spy(train_lookup.pool_features, bags))
    monkeypatch.setattr(
        train_lookup, "prepare_and_pool", _Spy(train_lookup.prepare_and_pool, train)
    )
    eng = _engine()
    feats = {
        "f": ee.Ragged(
            [1, 2, 2, 7], lengths=[2, 0, 2], weights=np.array([0.5, 1.0, 2.0, 1.0], np.float32)
        ),
        "g": np.array([3, 3, 9]),
    }
    eng.lookup(feats)
    eng.lookup(feats, training=False)
    assert train and bags
    # prepare_and_pool(order, threads, fmeta, offsets, weights, ..., tmeta, fdata, quant,
    # prefetch, probe_chunk); pool_features(threads, fmeta, offsets, weights, tmeta, fdata,
    # quant, prefetch, bad): the arrays the pooling tasks read (ids: at fmeta's addresses).
    assert train[0][2:5] == bags[0][1:4], (train[0][2:5], bags[0][1:4])
    assert train[0][-5:-1] == bags[0][-5:-1], (train[0][-5:-1], bags[0][-5:-1])
    assert all(not t.mutable for t in train[0][3:5])


@pytest.mark.parametrize("policy", ["error", "skip_row"])
def test_the_update_gets_one_type_for_writable_and_read_only_gradients(monkeypatch, policy):
    """A table with one feature gets the caller's gradient array as it is (no concatenation):
    a read-only one (a JAX array's buffer, a frozen batch) must not compile the update again,
    nor the non-finite check of ``skip_row``."""
    calls: list = []
    real = nbk.kernels_for

    def spied(optimizer, table):
        fused, every_row = real(optimizer, table)
        return _Spy(fused, calls), _Spy(every_row, calls)

    monkeypatch.setattr(nbk, "kernels_for", spied)
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(ee.TableConfig(50, 8, name="t"))},
        optimizer=opt.Adagrad(0.1),
        backend="numba",
        nonfinite_gradients=policy,
    )
    for grad_of in (np.array, _read_only):
        acts = eng.lookup({"f": np.array([1, 2, 2])})
        eng.apply_gradients({"f": grad_of(np.ones_like(acts["f"]))})
    assert len(calls) == 2
    assert calls[0] == calls[1], [
        (i, a, b) for i, (a, b) in enumerate(zip(*calls, strict=True)) if a != b
    ]


def test_an_initializer_fills_with_one_type_for_int_and_float_bounds(monkeypatch):
    from embengine import initializers as init
    from embengine.kernels import init as kinit

    calls: list = []
    monkeypatch.setattr(kinit, "fill_uniform", _Spy(kinit.fill_uniform, calls))
    a = init.RandomUniform(-1, 1).init(0, "t", np.arange(4), 8)
    b = init.RandomUniform(-1.0, 1.0).init(0, "t", np.arange(4), 8)
    np.testing.assert_array_equal(a, b)
    assert len(calls) == 2 and calls[0] == calls[1], calls


def test_a_keyed_tables_index_lookup_gets_one_type_for_writable_and_read_only_keys(monkeypatch):
    from embengine.kernels import keyed_index
    from embengine.storage.keyed import KeyIndex

    calls: list = []
    monkeypatch.setattr(keyed_index, "find_serial", _Spy(keyed_index.find_serial, calls))
    index = KeyIndex()
    index.insert(np.array([10**12, 5]), np.array([0, 1]))
    for keys in (np.array([5, 7]), _read_only([5, 7]), np.array([5, 7, 9])[::2]):
        np.testing.assert_array_equal(index.find(keys), [1, -1])
    assert len(calls) == 3 and len(set(calls)) == 1, calls
