"""Recycled memory for prepared batches (backends/block_pool.py): a block is reused only when
nothing made from it is alive, and batches built on recycled memory are the same batches."""

import copy
import pickle
import threading
import time

import numpy as np
import pytest
import torch

import embengine as ee
from embengine import optimizers as opt
from embengine.backends import numba_backend
from embengine.backends.block_pool import BlockPool, Carver


def _addr(a: np.ndarray) -> int:
    return a.ctypes.data


def test_a_block_comes_back_only_when_nothing_uses_it():
    pool = BlockPool()
    block = pool.take(1000)
    assert block.dtype == np.uint8 and len(block) >= 1000
    view = Carver(block).empty(100, np.int64)
    first = _addr(block)
    del block
    # The view keeps the block in use: a second request gets another block.
    other = pool.take(1000)
    assert _addr(other) != first
    del other
    del view
    pool.take(1000)
    assert len(pool._blocks) == 2  # both were free again: no third block
    # Views of views and foreign wrappers of the memory count as uses too.
    pool2 = BlockPool()
    b = pool2.take(4096)
    addr = _addr(b)
    t = torch.from_numpy(Carver(b).empty(10, np.float32)[2:5].reshape(3, 1))
    del b
    assert _addr(pool2.take(4096)) != addr
    del t
    assert [_addr(pool2._blocks[i]) for i in pool2._free()] == [addr, _addr(pool2._blocks[1])]


def test_the_smallest_fitting_free_block_within_the_slack():
    pool = BlockPool(max_free=4, max_slack=4.0)
    big, small = pool.take(100_000), pool.take(1_000)
    big_addr, small_addr = _addr(big), _addr(small)
    del big, small
    assert _addr(pool.take(900)) == small_addr  # both fit; the smaller is taken
    assert _addr(pool.take(50_000)) == big_addr
    # A request far smaller than every free block gets a block of its own size.
    pool3 = BlockPool(max_slack=2.0)
    huge = pool3.take(1 << 20)
    huge_addr = _addr(huge)
    del huge
    tiny = pool3.take(1000)
    assert _addr(tiny) != huge_addr and len(tiny) < 2000


def test_free_blocks_beyond_max_free_are_released():
    pool = BlockPool(max_free=2)
    held = [pool.take(1000 * (i + 1)) for i in range(6)]
    assert len(pool._blocks) == 6  # in use: all kept
    del held
    pool.take(10**6)  # larger than all: a new block, and the surplus of free ones goes
    assert len(pool._blocks) == 3
    assert pool.nbytes == sum(len(b) for b in pool._blocks)


def test_releasing_blocks_in_front_of_the_chosen_one_returns_the_chosen_one():
    pool = BlockPool(max_free=1, max_slack=1.5)
    small = [pool.take(1000 + i) for i in range(3)]  # oldest: released when the big is reused
    big = pool.take(50_000)
    big_addr, kept = _addr(big), _addr(small[2])
    busy = pool.take(60_000)  # in use throughout: must never be handed out
    del small, big
    again = pool.take(45_000)
    assert _addr(again) == big_addr
    # The two oldest small ones went; the newest stays as the one free block kept.
    assert [_addr(b) for b in pool._blocks] == [kept, big_addr, _addr(busy)]
    assert _addr(pool.take(59_000)) not in {_addr(busy), big_addr}


def test_trim_releases_the_surplus_without_a_request():
    pool = BlockPool(max_free=1)
    held = [pool.take(1000) for _ in range(4)]
    last = _addr(held[-1])
    del held
    pool.trim()
    assert [_addr(b) for b in pool._blocks] == [last]
    BlockPool().trim()  # an empty pool: nothing to do


def test_a_copied_or_unpickled_pool_starts_empty():
    pool = BlockPool(max_free=3, max_slack=2.0)
    in_use = pool.take(1000)
    for clone in (copy.deepcopy(pool), pickle.loads(pickle.dumps(pool))):
        assert (clone.max_free, clone.max_slack, clone.nbytes) == (3, 2.0, 0)
        assert _addr(clone.take(1000)) != _addr(in_use)
    # ... so an engine can be pickled for a DataLoader worker and deep-copied.
    e = _engine("numba")
    for clone in (copy.deepcopy(e), pickle.loads(pickle.dumps(e))):
        batch = clone.preprocess(_features(np.random.default_rng(3)))
        assert len(batch.tables) == 2


def test_carved_arrays_are_aligned_disjoint_and_bounded():
    specs = [(7, np.int64), (3, np.float32), (0, np.int64), (1000, np.float32), (5, np.int64)]
    block = BlockPool().take(Carver.size(*specs))
    carve = Carver(block)
    arrays = [carve.empty(n, dt) for n, dt in specs]
    spans = []
    for a, (n, dt) in zip(arrays, specs, strict=True):
        assert a.dtype == dt and a.shape == (n,) and a.flags.c_contiguous
        if n:  # (an empty array's address is NumPy's business)
            assert _addr(a) % 64 == 0
            spans.append((_addr(a), _addr(a) + a.nbytes))
    for a in arrays:
        a[...] = 1  # writable, and (below) no two share a byte
    spans.sort()
    assert all(spans[i][1] <= spans[i + 1][0] for i in range(len(spans) - 1))
    with pytest.raises(ValueError, match="block of .* bytes is full"):
        carve.empty(len(block), np.uint8)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="max_free must be >= 0, got -1"):
        BlockPool(max_free=-1)
    with pytest.raises(ValueError, match="max_slack must be >= 1, got 0.5"):
        BlockPool(max_slack=0.5)
    with pytest.raises(ValueError, match="nbytes must be >= 0, got -3"):
        BlockPool().take(-3)


def test_threads_never_share_a_block():
    pool = BlockPool(max_free=1)
    errors = []
    start = threading.Barrier(4)
    hold = threading.Barrier(4)
    addresses = [0] * 4

    def work(k: int) -> None:
        start.wait()
        for i in range(100):
            a = Carver(pool.take(512)).empty(64, np.int64)
            a[:] = k * 1000 + i
            time.sleep(0)  # let the others run between the write and the check
            if not (a == k * 1000 + i).all():
                errors.append((k, i))
            del a
        b = pool.take(512)  # all four at once: four different blocks
        addresses[k] = _addr(b)
        hold.wait()

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(addresses)) == 4


def test_carving_from_a_block_that_starts_off_a_cache_line():
    specs = [(3, np.int64), (5, np.float32), (17, np.int64)]
    size = Carver.size(*specs)
    raw = np.empty(size + 64, np.uint8)
    for k in range(64):
        carve = Carver(raw[k : k + size])
        arrays = [carve.empty(n, dt) for n, dt in specs]
        assert all(_addr(a) % 64 == 0 for a in arrays)
        assert _addr(arrays[-1]) + arrays[-1].nbytes <= _addr(raw) + k + size


def _engine(backend: str) -> ee.EmbeddingEngine:
    tables = [ee.TableConfig(50, d, name=f"t{d}", combiner=c) for d, c in ((4, "sum"), (8, "mean"))]
    feats = {
        "a": ee.FeatureConfig(tables[0]),
        "b": ee.FeatureConfig(tables[1]),
        "s": ee.FeatureConfig(tables[0], max_sequence_length=3),
    }
    return ee.EmbeddingEngine(feats, optimizer=opt.Adam(0.05), backend=backend)


def _features(rng):
    bag = lambda: [list(rng.integers(0, 50, rng.integers(0, 5))) for _ in range(7)]  # noqa: E731
    return {"a": bag(), "b": bag(), "s": bag()}


def test_batches_on_recycled_memory_are_the_same_batches(monkeypatch):
    # Every batch on pooled memory, however small (the default pools only big ones).
    monkeypatch.setattr(numba_backend, "POOLED_BATCH_BYTES", 0)
    fast, ref = _engine("numba"), _engine("reference")
    pool = fast._backend.batch_memory
    rng = np.random.default_rng(0)
    kept = fast.preprocess(_features(np.random.default_rng(99)))
    kept_copy = [
        {k: np.array(v) for k, v in vars(tb).items() if isinstance(v, np.ndarray)}
        for tb in kept.tables
    ]
    for step in range(6):
        feats = _features(rng)
        acts = fast.lookup(feats)
        expected = ref.lookup(feats)
        for k in acts:
            np.testing.assert_allclose(acts[k], expected[k], rtol=1e-5, atol=1e-7)
        grads = {
            k: np.cos(np.arange(v.size) + step).reshape(v.shape).astype(np.float32)
            for k, v in acts.items()
        }
        fast.apply_gradients(grads)
        ref.apply_gradients(grads)
    for name in ref.table_names:
        np.testing.assert_allclose(
            fast.embedding_tables[name], ref.embedding_tables[name], rtol=1e-5, atol=1e-7
        )
    # The batch held all along was never written over by the later ones.
    for tb, saved in zip(kept.tables, kept_copy, strict=True):
        for k, v in saved.items():
            np.testing.assert_array_equal(getattr(tb, k), v)
    # The steps reused their blocks: the pool holds the kept batch's, plus at most
    # max_free free ones and the last step's.
    assert len(pool._blocks) <= pool.max_free + 2


def test_big_batches_take_pooled_memory_and_small_ones_do_not(monkeypatch):
    e = _engine("numba")
    pool = e._backend.batch_memory
    e.preprocess(_features(np.random.default_rng(1)))
    assert pool.nbytes == 0  # a few dozen ids: fresh arrays
    monkeypatch.setattr(numba_backend, "POOLED_BATCH_BYTES", 1)
    batch = e.preprocess(_features(np.random.default_rng(1)))
    assert pool.nbytes > 0
    owner = batch.tables[0].unique_ids.base
    assert any(owner is b for b in pool._blocks)


def test_small_batches_release_the_blocks_big_ones_left(monkeypatch):
    e = _engine("numba")
    pool = e._backend.batch_memory
    monkeypatch.setattr(numba_backend, "POOLED_BATCH_BYTES", 1)
    held = [e.preprocess(_features(np.random.default_rng(i))) for i in range(4)]
    assert len(pool._blocks) >= 4  # one output block per batch held
    del held
    monkeypatch.setattr(numba_backend, "POOLED_BATCH_BYTES", 1 << 40)
    e.preprocess(_features(np.random.default_rng(9)))  # small: fresh arrays, and a trim
    assert len(pool._blocks) == pool.max_free
