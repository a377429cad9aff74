"""Stochastic rounding to bfloat16 / float16: numba and NumPy give the same bits, each rounding
is unbiased, the stream is reproducible, and updates below half a quantum survive on average."""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from embengine import precision as pr
from embengine.kernels import rounding as kr

KINDS = [pr.BF16, pr.F16]
floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


def _numba_round(x, kind, key, step, rows, unit, columns):
    out = np.zeros(len(x), dtype=np.uint16)
    rows, columns = np.asarray(rows, np.int64), np.asarray(columns, np.int64)
    kr.round_array(np.asarray(x, np.float32), kind, np.uint64(key), step, rows, unit, columns, out)
    return out


def _numpy_round(x, kind, key, step, rows, unit, columns):
    bits = pr.hash_bits(key, step, np.asarray(rows), unit, np.asarray(columns))
    return pr.stochastic_round(np.asarray(x, np.float32), kind, bits)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=60, deadline=None)
@given(
    xs=st.lists(floats32, min_size=1, max_size=40),
    key=st.integers(0, 2**64 - 1),
    step=st.integers(0, 2**40),
    unit=st.integers(0, 1000),
)
def test_numba_and_numpy_round_to_the_same_bits(kind, xs, key, step, unit):
    rows = np.arange(len(xs)) * 7919 % 1000
    cols = np.arange(len(xs)) % 13
    a = _numba_round(xs, kind, key, step, rows, unit, cols)
    b = _numpy_round(xs, kind, key, step, rows, unit, cols)
    np.testing.assert_array_equal(a, b)
    # NaN stays NaN, and a finite value rounds to one of its two neighbours (or Inf past the top)
    back = pr.widen(b, kind)
    x = np.asarray(xs, np.float32)
    np.testing.assert_array_equal(np.isnan(back), np.isnan(x))
    lo, hi = _neighbours(x, kind)
    fin = np.isfinite(x)
    assert np.all((back[fin] == lo[fin]) | (back[fin] == hi[fin])), (x, back, lo, hi)


def _neighbours(x: np.ndarray, kind: int) -> tuple[np.ndarray, np.ndarray]:
    """The representable values next to x towards zero and away from it (equal if x is
    representable), Inf past the largest; from bit patterns, whose magnitudes are ordered."""
    x = np.asarray(x, np.float32)
    if kind == pr.BF16:
        lo = (x.view(np.uint32) >> 16).astype(np.uint16)
    else:
        with np.errstate(over="ignore"):
            lo = x.astype(np.float16).view(np.uint16)
        too_far = np.abs(pr.widen(lo, kind).astype(np.float64)) > np.abs(x.astype(np.float64))
        lo = np.where(too_far, lo - 1, lo).astype(np.uint16)
    exact = pr.widen(lo, kind) == x
    hi = np.where(exact, lo, lo + 1).astype(np.uint16)
    return pr.widen(lo, kind), pr.widen(hi, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_widening_numba_equals_numpy_for_every_bit_pattern(kind):
    h = np.arange(1 << 16, dtype=np.uint16)
    out = np.zeros(len(h), np.float32)
    kr.widen_array(h, kind, out)
    want = pr.widen(h, kind)
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
    dt = np.float16 if kind == pr.F16 else pr.numpy_dtype("bfloat16")
    ref = h.view(dt).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    ok = ~np.isnan(ref)
    np.testing.assert_array_equal(out[ok].view(np.uint32), ref[ok].view(np.uint32))


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=40, deadline=None)
@given(x=st.floats(-60000.0, 60000.0, width=32, allow_subnormal=True))
def test_rounding_is_unbiased(kind, x):
    n = 40_000
    xs = np.full(n, x, np.float32)
    bits = pr.hash_bits(12345, 7, np.arange(n), 0, 3)
    back = pr.widen(pr.stochastic_round(xs, kind, bits), kind).astype(np.float64)
    lo, hi = _neighbours(np.float32([x]), kind)
    quantum = abs(float(hi[0]) - float(lo[0]))
    # a Bernoulli(p) mean over n draws: 6 standard deviations of quantum * sqrt(p(1-p)/n)
    bound = 6 * quantum * 0.5 / np.sqrt(n) + quantum * 2.0**-16  # float16 subnormals: 16 bits
    assert abs(back.mean() - float(np.float32(x))) <= bound, (x, back.mean(), quantum)


@pytest.mark.parametrize("kind", KINDS)
def test_the_stream_is_reproducible_and_depends_on_each_counter(kind):
    x = np.full(1000, 1.0 + 3 * 2.0**-12, np.float32)  # between two neighbours of either kind
    args = (99, 5, np.arange(1000), 0, 2)
    first = pr.stochastic_round(x, kind, pr.hash_bits(*args))
    np.testing.assert_array_equal(first, pr.stochastic_round(x, kind, pr.hash_bits(*args)))
    for i, other in enumerate([100, 6, np.arange(1, 1001), 1, 3]):
        changed = list(args)
        changed[i] = other
        assert not np.array_equal(first, pr.stochastic_round(x, kind, pr.hash_bits(*changed)))


@pytest.mark.parametrize("kind", KINDS)
def test_a_tiny_update_that_round_to_nearest_loses_is_kept_on_average(kind):
    # w = 1, and 1000 steps add 1e-4 each: far below half a quantum at 1 (bf16 2**-8, f16
    # 2**-11), so round-to-nearest stays at 1.0 for ever; stochastic rounding ends near 1.1.
    steps, rows, delta = 1000, 256, np.float32(1e-4)
    w = np.full(rows, pr.nearest(np.float32(1.0), kind), np.uint16)
    w_nearest = w.copy()
    for step in range(steps):
        x = pr.widen(w, kind) + delta
        w = pr.stochastic_round(x, kind, pr.hash_bits(1, step, np.arange(rows), 0, 0))
        w_nearest = pr.nearest(pr.widen(w_nearest, kind) + delta, kind)
    assert np.all(pr.widen(w_nearest, kind) == 1.0)
    mean = pr.widen(w, kind).astype(np.float64).mean()
    assert abs(mean - (1.0 + steps * float(delta))) < 0.01, mean


def test_overflow_to_infinity_and_nan():
    big = np.float32([65519.0, 65520.0, 1e6, np.inf, -np.inf, np.nan, 3.4e38])
    bits = pr.hash_bits(0, 0, np.arange(len(big)), 0, 0)
    f16 = pr.widen(pr.round_f16(big, bits), pr.F16)
    assert f16[1] in (65504.0, np.inf) and f16[2] == np.inf and f16[3] == np.inf
    assert f16[4] == -np.inf and np.isnan(f16[5]) and f16[6] == np.inf
    bf = pr.widen(pr.round_bf16(big, bits), pr.BF16)
    assert bf[3] == np.inf and bf[4] == -np.inf and np.isnan(bf[5])
    bf16_max = pr.widen(np.uint16(0x7F7F), pr.BF16)
    assert bf[6] in (bf16_max, np.inf), bf[6]


@pytest.mark.parametrize(
    ("finite", "full"),
    [(kr.round_bf16_finite, kr.round_bf16), (kr.round_f16_finite, kr.round_f16)],
    ids=["bf16", "f16"],
)
@settings(max_examples=200, deadline=None)
@given(x=st.floats(width=32, allow_nan=False), bits=st.integers(0, 0xFFFF))
@example(x=3.3961514e38, bits=0xFFFF)  # past bfloat16's largest finite: Inf, both ways
@example(x=65519.0, bits=0xFFFF)  # float16's top
@example(x=-np.inf, bits=1)
@example(x=2.0**-25, bits=0x8000)  # a float16 subnormal
def test_the_roundings_without_a_nan_case_equal_the_full_ones_but_for_nan(finite, full, x, bits):
    """The in-place 16-bit kernels round with ``round_*_finite``, whose guard has checked the
    value before rounding: for every value but NaN, the same bits as the full rounding."""
    x, bits = np.float32(x), np.uint16(bits)
    assert finite(x, bits) == full(x, bits)


def test_a_nan_with_every_payload_bit_rounds_to_zero_without_its_nan_case():
    """Why the in-place kernels check a value before rounding it: a NaN's bits plus the random
    bits carry into the sign, and bfloat16's rounding without its NaN case makes it a zero,
    which no check after rounding sees (tests/test_reduced_precision.py puts it to a row)."""
    for u, zero in ((0x7FFFFFFF, 0x8000), (0xFFFFFFFF, 0x0000)):
        nan = np.uint32(u).view(np.float32)
        assert kr.round_bf16_finite(nan, np.uint16(1)) == zero
        assert kr.round_bf16(nan, np.uint16(1)) in (0x7FC0, 0xFFC0)  # the full one: NaN


def test_dtype_names_are_checked():
    assert pr.check_dtype("TableConfig(name='t')", "weights_dtype", "bfloat16") == "bfloat16"
    with pytest.raises(
        ValueError,
        match=r"TableConfig\(name='t'\): weights_dtype must be one of"
        r" \['float32', 'float16', 'bfloat16'\], got 'half'",
    ):
        pr.check_dtype("TableConfig(name='t')", "weights_dtype", "half")


def test_the_kernels_draw_a_rows_bits_four_values_to_a_hash_round_as_numpy_does():
    # random_words fills a row's words in one pass, one splitmix64 round per four unit
    # columns; its uint16 view must be the NumPy stream, column for column
    key, step, row, unit = 0x0123456789ABCDEF, 9, 4321, 2
    words = np.zeros(7, np.uint64)
    kr.random_words(kr.row_hash(np.uint64(key), step, row, unit), words, 0)
    want = pr.hash_bits(key, step, row, unit, np.arange(28))
    np.testing.assert_array_equal(words.view(np.uint16), want.astype(np.uint16))
    # and the four values of a word are its four 16-bit pieces, not four rounds
    assert len(set(want[:4].tolist())) == 4
    assert int(words[0]) == sum(int(b) << (16 * i) for i, b in enumerate(want[:4]))


@pytest.mark.parametrize(
    ("optimizer", "weights", "slots", "name"),
    [
        ("adam", "bfloat16", "bfloat16", "half_adam_bf16_bf16"),
        ("adam", "float32", "float16", "half_adam_f32_f16"),
        ("adam", "float16", "float32", "half_adam_f16_f32"),
        ("sgd", "float32", "float16", "half_sgd_f32_f32"),  # no float slot: a float32 row
        ("sgd", "bfloat16", "float16", "half_sgd_bf16_f32"),
    ],
)
def test_a_16_bit_table_gets_the_kernels_of_its_dtype_pair(optimizer, weights, slots, name):
    import embengine as ee
    from embengine import optimizers as opt
    from embengine.backends.numba_backend import kernels_for

    o = {"adam": opt.Adam(0.1, lazy_adam=False), "sgd": opt.SGD(0.1)}[optimizer]
    t = ee.TableConfig(10, 4, name="t", weights_dtype=weights, slots_dtype=slots)
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=o)
    assert eng._physical[0].data.dtype == np.uint16
    fused, every_row = kernels_for(o, eng._physical[0])
    assert fused.py_func.__name__ == f"fused_update_{name}"
    if optimizer == "adam":  # non-lazy: every row's update too
        assert every_row.py_func.__name__ == f"update_every_row_{name}"


def test_a_rows_place_in_the_stream_numba_equals_numpy():
    """``kernels.rounding.hash_row`` and ``precision.rounding_places`` give each row its place
    alike: a dense table's row, a keyed table's key (column 0 of its records), a row-sharded
    shard's global id ``r W + rank`` (``[[W, rank, 0]]``)."""
    from numba import njit

    @njit
    def places(row_keys, rows):
        out = np.empty(len(rows), np.int64)
        for i in range(len(rows)):
            out[i] = kr.hash_row(row_keys, rows[i])
        return out

    rows = np.array([0, 3, 1, 7], np.int64)
    records = np.array([[-5, 1], [9, 2], [2**40, 3], [11, 4], [0, 0], [1, 1], [2, 2], [-1, 9]])
    for row_keys, want in (
        (np.zeros((0, 1), np.int64), rows),
        (records, records[rows, 0]),
        (np.array([[3, 2, 0]], np.int64), rows * 3 + 2),
    ):
        assert places(row_keys, rows).tolist() == want.tolist()
        assert pr.rounding_places(row_keys, rows).tolist() == want.tolist()
    assert pr.rounding_places(None, rows).tolist() == rows.tolist()


def test_a_packed_tables_rows_round_in_their_members_streams():
    """``kernels.rounding.row_stream`` and ``precision.rounding_streams`` agree on a table that
    stacks members (``[first, rows, key, 0]`` each): row r of a member draws the bits of row
    ``r - first`` of a table of the member's key, as the member unpacked draws them."""
    from numba import njit

    @njit
    def bits(key, step, row_keys, rows, unit, column):
        out = np.empty(len(rows), np.uint16)
        for i in range(len(rows)):
            out[i] = kr.unit_bits(kr.row_stream(key, step, row_keys, rows[i], unit), column)
        return out

    keys = np.array([pr.table_key(0, n) for n in ("a", "b", "c")], dtype=np.uint64)
    members = np.array([[0, 3, 0, 0], [3, 5, 0, 0], [8, 2, 0, 0]], np.int64)
    members[:, 2] = keys.view(np.int64)
    rows = np.array([0, 2, 3, 7, 8, 9], np.int64)
    got_keys, places = pr.rounding_streams(pr.table_key(0, "a+b+c"), members, rows)
    assert got_keys.tolist() == keys[[0, 0, 1, 1, 2, 2]].tolist()
    assert places.tolist() == [0, 2, 0, 4, 0, 1]
    packed = bits(np.uint64(pr.table_key(0, "a+b+c")), 5, members, rows, 1, 6)
    want = pr.hash_bits(got_keys, 5, places, 1, 6)
    assert packed.tolist() == want.tolist()
    alone = np.zeros((0, 1), np.int64)  # member b unpacked: its rows are its ids
    assert bits(keys[1], 5, alone, places[2:4], 1, 6).tolist() == packed[2:4].tolist()
    with pytest.raises(ValueError, match="rounding_streams"):
        pr.rounding_places(members, rows)
