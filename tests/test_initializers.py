"""Initializers are a pure function of (seed, table name, row id)."""

import numpy as np
import pytest

from embengine import initializers as init

RANDOM = [init.RandomUniform(-0.5, 0.25), init.TruncatedNormal(0.1, 0.3), init.TruncatedNormal()]


@pytest.mark.parametrize("i", RANDOM)
def test_values_do_not_depend_on_chunking_or_order(i):
    rows = np.arange(1000)
    whole = i.init(7, "tab", rows, 8)
    perm = np.random.default_rng(0).permutation(1000)
    shuffled = i.init(7, "tab", perm, 8)
    np.testing.assert_array_equal(shuffled, whole[perm])
    parts = np.concatenate([i.init(7, "tab", rows[a : a + 37], 8) for a in range(0, 1000, 37)])
    np.testing.assert_array_equal(parts, whole)
    assert not np.array_equal(i.init(7, "other", rows, 8), whole)
    assert not np.array_equal(i.init(8, "tab", rows, 8), whole)
    assert whole.dtype == np.float32


def test_distributions():
    u = init.RandomUniform(-0.5, 0.25).init(0, "t", np.arange(20000), 4)
    assert u.min() >= -0.5 and u.max() < 0.25
    assert abs(u.mean() - (-0.125)) < 0.005
    z = init.TruncatedNormal(1.0, 2.0).init(0, "t", np.arange(20000), 4)
    assert z.min() >= 1.0 - 4.0 - 1e-5 and z.max() <= 1.0 + 4.0 + 1e-5
    # A normal truncated at 2 sigma has std 0.8796 sigma.
    assert abs(z.std() / 2.0 - 0.8796) < 0.01 and abs(z.mean() - 1.0) < 0.02
    d = init.TruncatedNormal().init(0, "t", np.arange(5000), 16)
    assert abs(d.std() - 0.8796 / 4) < 0.01


def test_constant_zeros_rowid():
    np.testing.assert_array_equal(init.Zeros().init(0, "t", np.arange(3), 2), np.zeros((3, 2)))
    np.testing.assert_array_equal(
        init.Constant(1.5).init(0, "t", np.arange(2), 2), np.full((2, 2), 1.5)
    )
    np.testing.assert_array_equal(
        init.RowId(10).init(0, "t", np.array([4, 2]), 3), [[14, 14, 14], [12, 12, 12]]
    )


def test_values_are_pinned():
    # The values of the random initializers, bit for bit, as before they named their fill
    # (fill_values imports the kernels lazily): SHA-256 of the float32 bytes.
    import hashlib

    rows = np.concatenate([np.arange(1000), [2**40 + 3, 10**12, 7]])
    h = hashlib.sha256()
    for i in [
        init.RandomUniform(-0.5, 0.25),
        init.RandomUniform(-1, 1),
        init.TruncatedNormal(0.1, 0.3),
        init.TruncatedNormal(),
    ]:
        for dim in (1, 3, 8):
            v = i.init(7, "tab", rows, dim)
            assert v.dtype == np.float32 and v.shape == (len(rows), dim)
            h.update(v.tobytes())
    assert h.hexdigest() == "a7e203931e7286892bf79634b319c30e41e546794e5cff9e24adb362529c80b5"


def test_random_initializers_name_their_fill():
    assert init.RandomUniform(-0.5, 0.25).fill(8) == init.Fill("uniform", -0.5, 0.25)
    assert init.TruncatedNormal(0.1, 0.3).fill(8) == init.Fill("truncated_normal", 0.1, 0.3)
    assert init.TruncatedNormal().fill(16) == init.Fill("truncated_normal", 0.0, 0.25)
    for i in (init.Zeros(), init.Constant(2.0), init.RowId(3)):
        assert i.fill(4) is None
    with pytest.raises(ValueError, match="kind must be one of .* got 'normal'"):
        init.Fill("normal", 0.0, 1.0)
    values = init.fill_values(init.Fill("uniform", -0.5, 0.25), 7, "tab", np.arange(5), 3)
    np.testing.assert_array_equal(
        values, init.RandomUniform(-0.5, 0.25).init(7, "tab", np.arange(5), 3)
    )


def test_an_engine_initialises_with_custom_and_builtin_initializers():
    # A user's Initializer subclass (no fill) and the built-ins give the engine's initial rows.
    import embengine as ee
    from embengine import optimizers as O

    class Squares(init.Initializer):
        def init(self, seed, table_name, rows, dim):
            return np.repeat((np.asarray(rows, np.float32) ** 2)[:, None], dim, axis=1)

    tables = {"sq": Squares(), "u": init.RandomUniform(-0.5, 0.25), "z": init.TruncatedNormal()}
    feats = {
        n: ee.FeatureConfig(ee.TableConfig(6, 3, name=n, initializer=i)) for n, i in tables.items()
    }
    eng = ee.EmbeddingEngine(feats, optimizer=O.SGD(0.1), seed=4, backend="reference")
    for n, i in tables.items():
        np.testing.assert_array_equal(eng.embedding_tables[n], i.init(4, n, np.arange(6), 3))


def test_a_function_initializer_is_called_once_for_the_whole_table():
    """A TF-style ``fn(shape, dtype)`` makes a dense table's values in one call of shape
    ``(vocabulary_size, dim)``, as TF calls it once per task: here past the 2^22 values a chunk
    of other initializers holds (70,000 x 64), a row-id function's last row is 69,999, where
    chunked calls started again at 0 from row 65,536."""
    import embengine as ee

    shapes = []

    def row_ids(shape, dtype):
        shapes.append(tuple(shape))
        return np.repeat(np.arange(shape[0], dtype=np.float32)[:, None], shape[1], axis=1)

    t = ee.TableConfig(70_000, 64, name="t", initializer=init.FromFunction(row_ids))
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=ee.optimizers.SGD(0.1))
    assert shapes == [(70_000, 64)]
    np.testing.assert_array_equal(eng.embedding_tables["t"][:, 0], np.arange(70_000))
