"""Input normalisation: every accepted form becomes the same Ragged; structure errors are clear."""

import copy
import pickle
import re

import numpy as np
import pytest
import torch
from conftest import run_python
from hypothesis import example, given, settings
from hypothesis import strategies as st

import embengine as ee
from embengine import Ragged
from embengine.inputs import to_ragged


def _same(r: Ragged, ids, offsets, weights=None):
    np.testing.assert_array_equal(r.ids, ids)
    np.testing.assert_array_equal(r.offsets, offsets)
    assert r.ids.dtype == np.int64 and r.offsets.dtype == np.int64
    if weights is None:
        assert r.weights is None
    else:
        assert r.weights.dtype == np.float32
        np.testing.assert_array_equal(r.weights, weights)


def test_ragged_from_offsets_and_lengths_agree():
    a = Ragged([3, 1, 4, 1], offsets=[0, 2, 2, 4])
    b = Ragged(np.array([3, 1, 4, 1], dtype=np.int32), lengths=[2, 0, 2])
    _same(a, [3, 1, 4, 1], [0, 2, 2, 4])
    _same(b, [3, 1, 4, 1], [0, 2, 2, 4])
    assert a.num_samples == 3
    np.testing.assert_array_equal(a.lengths, [2, 0, 2])


def test_one_d_array_is_one_id_per_sample():
    _same(to_ragged(np.array([5, 6, 7])), [5, 6, 7], [0, 1, 2, 3])


def test_two_d_padded_drops_minus_one_and_keeps_weights_aligned():
    ids = np.array([[1, 2, -1], [-1, -1, -1], [3, -1, 4]])
    w = np.array([[0.5, 2.0, 9.0], [9.0, 9.0, 9.0], [1.0, 9.0, 3.0]])
    _same(to_ragged(ids, w), [1, 2, 3, 4], [0, 2, 2, 4], [0.5, 2.0, 1.0, 3.0])


def test_list_of_lists_and_flat_list():
    _same(
        to_ragged([[1, 2], [], [3]], [[0.5, 1.5], [], [2.0]]),
        [1, 2, 3],
        [0, 2, 2, 3],
        [0.5, 1.5, 2.0],
    )
    _same(to_ragged([4, 5]), [4, 5], [0, 1, 2])


def test_torch_tensors_are_accepted():
    ids = torch.tensor([[1, -1], [2, 3]])
    w = torch.tensor([[1.0, 0.0], [2.0, 3.0]])
    _same(to_ragged(ids, w), [1, 2, 3], [0, 1, 3], [1.0, 2.0, 3.0])
    r = Ragged(torch.tensor([7, 8]), lengths=torch.tensor([1, 1]))
    _same(r, [7, 8], [0, 1, 2])


def test_a_list_of_tensors_is_read_as_the_list_of_their_arrays():
    """A collate_fn gathers samples of different lengths as a list of 1-D tensors (or of 0-d
    ones, one id each): refused ("ids must be integers, got tensor([1, 2]) at ids[0]") where
    the same list of NumPy arrays is read, by the engine and by a DataLoader worker's
    Preprocessor alike. Weights too; weights that require grad are refused by name."""
    ids = [torch.tensor([1, 2]), torch.tensor([], dtype=torch.int32), torch.tensor([3])]
    w = [torch.tensor([0.5, 2.0]), torch.tensor([]), torch.tensor([4.0], dtype=torch.bfloat16)]
    _same(to_ragged(ids, w), [1, 2, 3], [0, 2, 2, 3], [0.5, 2.0, 4.0])
    _same(to_ragged((torch.tensor(4), torch.tensor(5))), [4, 5], [0, 1, 2])
    _same(to_ragged([torch.tensor([6]), [7, 8]]), [6, 7, 8], [0, 1, 3])
    with pytest.raises(ValueError, match="weights require grad"):
        to_ragged(ids, [torch.tensor([0.5, 2.0], requires_grad=True), [], [4.0]])
    with pytest.raises(TypeError, match="ids must be integers"):
        to_ragged([torch.tensor([1.0]), torch.tensor([2.0])])
    with pytest.raises(TypeError, match="ids must be integers, got True"):
        to_ragged([torch.tensor(True), torch.tensor(1)])
    t = ee.TableConfig(10, 2, name="t", combiner="sum", initializer=ee.initializers.RowId(0))
    eng = ee.EmbeddingEngine({"a": ee.FeatureConfig(t)}, optimizer=ee.optimizers.SGD(0.1))
    pre = pickle.loads(pickle.dumps(eng.preprocessor()))  # as a DataLoader worker has it
    for batch in (pre({"a": ids}), pre({"a": ids}, training=False), {"a": ids}):
        acts = eng.lookup(batch, training=False)["a"]
        assert acts.tolist() == [[3.0, 3.0], [0.0, 0.0], [3.0, 3.0]]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(ids=[1, 2], offsets=[1, 2]), r"offsets\[0\]=1 must be 0"),
        (dict(ids=[1, 2, 3], offsets=[0, 2, 1, 3]), r"offsets\[2\]=1 is less than offsets\[1\]=2"),
        (
            dict(ids=[1, 2, 3], offsets=[0, 2]),
            r"offsets\[-1\]=2 must equal the number of ids \(3\)",
        ),
        (dict(ids=[1, 2], lengths=[1, -1, 2]), r"lengths\[1\]=-1 is negative"),
        (dict(ids=[1, 2], lengths=[1, 2]), r"lengths sum to 3 but there are 2 ids"),
        (dict(ids=[1, 2], offsets=[0, 2], weights=[1.0]), r"weights has shape \(1,\)"),
        (dict(ids=[1, 2]), r"exactly one of offsets= or lengths="),
    ],
)
def test_ragged_structure_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Ragged(**kwargs)


def test_non_integer_ids_are_a_type_error():
    with pytest.raises(TypeError, match="ids must be integers, got dtype float64"):
        to_ragged(np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match="ids must be integers, got 2.5 at sample 1"):
        to_ragged([[1], [2.5]])
    with pytest.raises(TypeError, match="ids must be integers"):
        Ragged(np.array([True, False]), lengths=[2])


def test_negative_padding_other_than_minus_one():
    with pytest.raises(ValueError, match=r"id -2 at \[1, 0\] is negative; only -1 marks padding"):
        to_ragged(np.array([[1, 2], [-2, 3]]))


def test_weights_given_twice():
    # The ids may have come as a KeyedJaggedTensor, whose user never made a Ragged.
    said = r"weights given twice: with the ids \(a Ragged's or a KeyedJaggedTensor's\) and in"
    with pytest.raises(ValueError, match=said):
        to_ragged(Ragged([1], lengths=[1], weights=[1.0]), [2.0])


def test_weights_layout_must_follow_ids():
    with pytest.raises(ValueError, match="weights of sample 1 has 2 entries but the sample has 1"):
        to_ragged([[1], [2]], [[1.0], [1.0, 2.0]])
    with pytest.raises(ValueError, match="weights must be a list of 2 lists"):
        to_ragged([[1], [2]], [1.0, 2.0])
    with pytest.raises(ValueError, match=r"weights has shape \(2, 3\) but the ids have shape"):
        to_ragged(np.array([[1, 2], [3, 4]]), np.ones((2, 3)))
    # 1-D ids take 1-D weights of their shape: [[w0, w1, w2]] is not flattened.
    for bad in (np.ones((1, 3)), np.ones((3, 1)), np.ones(2)):
        with pytest.raises(ValueError, match=r"weights has shape .* ids have shape \(3,\)"):
            to_ragged(np.array([1, 2, 3]), bad)
    assert to_ragged(np.array([1, 2, 3]), np.ones(3)).weights.shape == (3,)


def test_three_d_ids_rejected():
    with pytest.raises(ValueError, match=r"got shape \(1, 1, 1\)"):
        to_ragged(np.zeros((1, 1, 1), dtype=np.int64))


# -- lengths and offsets that would overflow, arrays that change after validation ----------------


WRAPPING_LENGTHS = [2**63 - 1, 2**63 - 1, 5]  # int64 sum: 3, the number of ids


def test_lengths_whose_sum_wraps_are_refused():
    with pytest.raises(
        ValueError,
        match=r"lengths\[0\]=9223372036854775807 is more than the "
        r"number of ids \(3\)",
    ):
        Ragged([1, 2, 3], lengths=WRAPPING_LENGTHS)
    with pytest.raises(ValueError, match=r"lengths\[1\]=4 is more than the number of ids \(3\)"):
        Ragged(np.array([1, 2, 3], dtype=np.int32), lengths=np.array([0, 4], dtype=np.uint32))


def test_a_running_sum_that_wraps_is_refused_even_if_each_length_fits():
    from embengine.inputs import offsets_from_lengths

    # Each length fits in num_ids, but a batch of 2**62 ids... is too big to build: the check
    # is on the running sum, shown here with the number of ids given directly.
    n = 2**62
    with pytest.raises(
        ValueError,
        match=r"lengths sum to more than the number of ids "
        r"\(4611686018427387904\): the running sum overflows "
        r"int64 at lengths\[1\]",
    ):
        offsets_from_lengths(np.array([n, n, n, n], dtype=np.int64), n)
    np.testing.assert_array_equal(
        offsets_from_lengths(np.array([n // 2, n // 2]), n), [0, n // 2, n]
    )


def test_offsets_near_the_int64_limits_are_compared_not_subtracted():
    # np.diff of these wraps to [2**63 - 1, 1, 2**63 - 2, 5]: all >= 0.
    with pytest.raises(
        ValueError,
        match=r"offsets\[2\]=-9223372036854775808 is less than "
        r"offsets\[1\]=9223372036854775807",
    ):
        Ragged([1, 2, 3], offsets=[0, 2**63 - 1, -(2**63), -2, 3])


@pytest.mark.parametrize("training", [True, False])
def test_wrapping_lengths_never_reach_the_kernels(backend, training):
    # Before: the reference backend segfaulted, the numba kernels never returned.
    code = f"""
import embengine as ee
t = ee.TableConfig(10, 2, name="t")
eng = ee.EmbeddingEngine({{"f": ee.FeatureConfig(t)}}, optimizer=ee.optimizers.SGD(0.1),
                         backend={backend!r})
eng.lookup({{"f": ee.Ragged([1, 2, 3], lengths={WRAPPING_LENGTHS})}}, training={training})
print("no error", flush=True)
"""
    out = run_python(code, timeout=180)
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
    assert "ValueError: lengths[0]=9223372036854775807 is more than the number of ids (3)" in (
        out.stderr
    )


def test_a_ragged_does_not_change_after_validation():
    ids = np.array([1, 2, 3])
    offsets = np.array([0, 2, 3])
    weights = np.array([0.5, 1.0, 2.0], dtype=np.float32)
    r = Ragged(ids, offsets=offsets, weights=weights)
    offsets[1] = 10**12  # the caller's array: the Ragged has its own copy
    np.testing.assert_array_equal(r.offsets, [0, 2, 3])
    for a in (r.ids, r.offsets, r.weights, Ragged(ids, lengths=[1, 2]).offsets):
        with pytest.raises(ValueError, match="read-only"):
            a[0] = 7
    with pytest.raises(AttributeError):
        r.offsets = np.array([0, 3, 3])
    # No copy of the ids (millions per batch): a view, range-checked when a batch is prepared.
    assert np.shares_memory(r.ids, ids)
    assert ids.flags.writeable  # the caller's array is left as it was


def test_an_unpickled_ragged_is_read_only_and_checked_again():
    r = Ragged([1, 2, 3], lengths=[2, 1], weights=[1.0, 2.0, 3.0])
    back = pickle.loads(pickle.dumps(r))
    _same(back, [1, 2, 3], [0, 2, 3], [1.0, 2.0, 3.0])
    assert not (back.ids.flags.writeable or back.offsets.flags.writeable)
    assert not back.weights.flags.writeable
    assert not copy.deepcopy(r).offsets.flags.writeable
    edited = pickle.dumps(r).replace(np.array([0, 2, 3]).tobytes(), np.array([0, 5, 3]).tobytes())
    with pytest.raises(ValueError, match=r"offsets\[2\]=3 is less than offsets\[1\]=5"):
        pickle.loads(edited)


@pytest.mark.parametrize("training", [True, False])
def test_offsets_changed_after_the_ragged_was_built_never_reach_the_kernels(backend, training):
    # Before: the Ragged kept the caller's offsets; changed afterwards, they reached the kernels
    # unchecked (numba: SIGSEGV). Now the lookup uses the offsets as they were validated.
    code = f"""
import numpy as np
import embengine as ee
t = ee.TableConfig(10, 2, name="t", initializer=ee.initializers.RowId())
eng = ee.EmbeddingEngine({{"f": ee.FeatureConfig(t)}}, optimizer=ee.optimizers.SGD(0.1),
                         backend={backend!r})
offsets = np.array([0, 2, 3])
r = ee.Ragged(np.array([1, 2, 3]), offsets=offsets)
offsets[1] = 10**12
print(eng.lookup({{"f": r}}, training={training})["f"][:, 0].tolist(), flush=True)
"""
    out = run_python(code, timeout=180)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.strip() == "[1.5, 3.0]"  # mean of rows 1, 2 and row 3


_INT64 = st.integers(-(2**63), 2**63 - 1)
_SMALL = st.integers(-1, 4)


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(_INT64 | _SMALL, max_size=5), num_ids=st.integers(0, 6))
@example(lengths=WRAPPING_LENGTHS, num_ids=3)
@example(lengths=[2**63 - 1, 1, 2**63 - 1, 2], num_ids=1)
def test_any_int64_lengths_are_accepted_exactly_when_they_are_valid(lengths, num_ids):
    valid = all(x >= 0 for x in lengths) and sum(lengths) == num_ids  # Python ints: exact
    try:
        r = Ragged(np.arange(num_ids), lengths=np.array(lengths, dtype=np.int64))
    except ValueError:
        assert not valid
    else:
        assert valid
        assert r.offsets.tolist() == [sum(lengths[:b]) for b in range(len(lengths) + 1)]


@settings(max_examples=300, deadline=None)
@given(offsets=st.lists(_INT64 | _SMALL, min_size=1, max_size=5), num_ids=st.integers(0, 6))
@example(offsets=[0, 2**63 - 1, -(2**63), -2, 3], num_ids=3)
def test_any_int64_offsets_are_accepted_exactly_when_they_are_valid(offsets, num_ids):
    valid = (
        offsets[0] == 0
        and offsets[-1] == num_ids
        and all(a <= b for a, b in zip(offsets, offsets[1:], strict=False))
    )
    try:
        r = Ragged(np.arange(num_ids), offsets=np.array(offsets, dtype=np.int64))
    except ValueError:
        assert not valid
    else:
        assert valid and r.offsets.tolist() == offsets


@pytest.mark.parametrize(
    "value, error, words",
    [
        ([[1, 2**64]], ValueError, "id 18446744073709551616 at sample 0 does not fit in int64"),
        ([[1], [-(2**63) - 1]], ValueError, "at sample 1 does not fit in int64"),
        ([3, 2**63], TypeError, "ids[1]=9223372036854775808 does not fit in int64"),
        ([True, 2], TypeError, "got True at ids[0]"),
        ((1, 2.0), TypeError, "got 2.0 at ids[1]"),
    ],
)
def test_python_ids_outside_int64_or_not_ints_are_named(value, error, words):
    # NumPy turns True into 1 and refuses ints beyond int64 with a bare OverflowError.
    import embengine as ee

    table = ee.TableConfig(100, 4, name="t")
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(table)},
        optimizer=ee.optimizers.SGD(learning_rate=0.1),
        backend="reference",
    )
    with pytest.raises(error, match=re.escape("feature 'f': ") + ".*" + re.escape(words)):
        eng.lookup({"f": value})


def test_a_sequence_features_2d_padding_is_dropped_wherever_it_stands():
    """-1 is padding anywhere in 2-D input: [[5, -1, 7]] is the sequence 5, 7 (7 at position
    1; a Ragged or lists say which positions are empty), as for a bag."""
    r = to_ragged(np.array([[5, -1, 7], [-1, -1, -1]]))
    assert r.ids.tolist() == [5, 7] and r.offsets.tolist() == [0, 2, 2]
    t = ee.TableConfig(100, 4, name="t", initializer=ee.initializers.RowId())
    eng = ee.EmbeddingEngine(
        {"s": ee.FeatureConfig(t, max_sequence_length=3)}, optimizer=ee.optimizers.SGD(0.1)
    )
    got = eng.lookup({"s": np.array([[5, -1, 7]])}, training=False)["s"][0]
    want = eng.lookup({"s": [[5, 7]]}, training=False)["s"][0]
    np.testing.assert_array_equal(got, want)
    assert got[2].tolist() == [0.0] * 4


@pytest.mark.parametrize(
    "ids, weights, where",
    [
        ([1, 2, 3], [True, 0.5, 1.0], r"True at weights\[0\]"),
        ([1, 2, 3], [1.0, "0.5", 1.0], r"'0.5' at weights\[1\]"),
        ([1, 2, 3], [torch.tensor(1.0), torch.tensor(False), 1.0], r"False at weights\[1\]"),
        (np.array([[1, -1], [2, 3]]), [[1.0, 0.0], [False, 2.0]], r"False at weights\[1\]\[0\]"),
        (Ragged([1, 2], lengths=[1, 1]), [0.5, np.True_], r"np.True_ at weights\[1\]"),
    ],
)
def test_weights_given_as_lists_refuse_bools_and_strings(ids, weights, where):
    """Per-id weights refuse a bool (a list of lists did; ``_from_lists``), but a flat list
    for 1-D ids, a list of lists for 2-D ids, a 0-d bool tensor in a list and a Ragged's
    list weights went through ``np.asarray``, which read True as 1.0 (and False as 0.0)
    silently. Each entry is checked now and the first bad one named."""
    with pytest.raises(TypeError, match="weights must be numbers, got " + where):
        to_ragged(ids, weights)
    _same(to_ragged([1, 2], [np.float32(0.5), 2]), [1, 2], [0, 1, 2], [0.5, 2.0])


@pytest.mark.parametrize(
    "ids, weights, where",
    [
        ([1, 2], [1.0, 1e300], r"1e\+300 at weights\[1\]"),
        (np.array([[1, -1], [2, 3]]), np.array([[1.0, 0.0], [-1e39, 2.0]]), r"at weights\[1, 0\]"),
        ([[1], [2, 3]], [[1.0], [2.0, 1e300]], "1e\\+300 at sample 1"),
        ([[1], [2]], [[1.0], [10**400]], "an int of 401 digits at sample 1"),
        ([1, 2], torch.tensor([1.0, -1e300], dtype=torch.float64), r"-1e\+300 at weights\[1\]"),
    ],
)
def test_float64_weights_past_float32_s_range_are_named_as_given(ids, weights, where):
    """Weights are float32: a finite float64 weight past its range became inf in the cast,
    and was then refused as "weight inf at sample 1 ... is not finite", a value the caller
    never gave (with a RuntimeWarning from the cast); a Python int past float64's range was
    an OverflowError. Each is named as given, where it stands."""
    with pytest.raises(ValueError, match=f"weights: .*{where} is past float32's range"):
        to_ragged(ids, weights)


_ROUNDS = 2**24 + 1  # the smallest positive integer float32 cannot hold: it rounds to 2**24


@pytest.mark.parametrize(
    "ids, weights, where",
    [
        ([1, 2], np.array([1, _ROUNDS]), r"weights\[1\]"),
        ([1, 2], torch.tensor([-_ROUNDS, 3], dtype=torch.int32), r"weights\[0\]"),
        ([1, 2], np.array([7, 2**64 - 1], dtype=np.uint64), r"weights\[1\]"),
        ([1, 2], [0.5, _ROUNDS], r"weights\[1\]"),  # a float64 array after np.asarray
        ([[1], [2]], [[1.0], [2**53 + 1]], "sample 1"),  # 2**53 in float64
        ([[1], [2]], [np.array([1]), np.array([_ROUNDS])], "sample 1"),
        (np.array([[1, -1], [2, 3]]), np.array([[1, 0], [2, _ROUNDS]]), r"weights\[1, 1\]"),
        (np.array([[1, -1], [2, 3]]), [[1, 0], [2, _ROUNDS]], r"weights\[1\]\[1\]"),
    ],
)
def test_integer_weights_float32_cannot_hold_are_refused_by_position(ids, weights, where):
    """Weights are float32, which holds integers exactly only up to 2**24 in magnitude (then
    those with at most 24 significant bits): integer weights past it rounded silently
    (16777217 became 16777216, as a Python int in a list of lists via float64 too); TorchRec
    refuses integer weights outright. Refused as the float64 weights past float32's range are:
    the value and where it stands; those float32 holds are read exactly."""
    with pytest.raises(ValueError, match=f"weights: integer .* at {where} would round to"):
        to_ragged(ids, weights)
    exact = [2**24, -(2**24), 2**25, 3 * 2**40, -(2**63)]
    for w in (np.array(exact), exact, torch.tensor(exact)):
        _same(to_ragged([1, 2, 3, 4, 5], w), [1, 2, 3, 4, 5], range(6), exact)


def test_integer_weights_are_named_by_feature():
    t = ee.TableConfig(10, 2, name="t", combiner="sum")
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t), "g": ee.FeatureConfig(t)}, optimizer=ee.optimizers.SGD(0.1)
    )
    with pytest.raises(ValueError, match=r"feature 'g': weights: integer 16777217 at weights\[1"):
        eng.lookup({"f": [1, 2], "g": [1, 2]}, weights={"g": np.array([1, _ROUNDS])})


class _Iterable:
    def __iter__(self):
        return iter([1, 2])


@pytest.mark.parametrize(
    "value, words",
    [
        ({3, 1}, "got a set, which has no order"),
        (frozenset([3]), "got a frozenset, which has no order"),
        ({3: 0}.keys(), "got a dict_keys, which has no order"),
        ((i for i in [1, 2]), "got a generator, an iterator"),
        (map(int, "12"), "got a map, an iterator"),
        ({3: 0}.values(), "got a dict_values, an iterable but not a sequence"),
        (_Iterable(), "got a _Iterable, an iterable but not a sequence"),
        (object(), "must be integers, got an object <object object"),
    ],
)
def test_ids_that_are_not_a_sequence_are_named_saying_what_to_pass(value, words):
    """A set, a generator, a dict view (any iterable neither a sequence nor an array) was
    read by NumPy as one object and refused as "ids must be integers, got dtype object",
    which says neither what came nor what to pass (nor that a set has no order)."""
    t = ee.TableConfig(10, 2, name="t")
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=ee.optimizers.SGD(0.1))
    pass_ = "pass a list, a NumPy array, a torch tensor, a Ragged or a list of lists per sample"
    if type(value) is object:  # not iterable: as NumPy read it
        pass_ = "pass a list, a NumPy array or a torch tensor"
    with pytest.raises(TypeError, match=f"feature 'f': ids.*{words}.*{pass_}"):
        eng.lookup({"f": value})
    with pytest.raises(TypeError, match="weights: got a set, which has no order"):
        eng.lookup({"f": [1, 2]}, weights={"f": {0.5, 2.0}})
    with pytest.raises(TypeError, match="weights: got a generator"):
        to_ragged([1, 2], (w for w in [0.5, 2.0]))
    with pytest.raises(TypeError, match="ids: got a set"):
        Ragged({1, 2}, lengths=[1, 1])
    # sequences and arrays NumPy reads are read as before
    for same in (range(1, 3), np.array([1, 2]), torch.tensor([1, 2]), memoryview(np.array([1, 2]))):
        _same(to_ragged(same), [1, 2], [0, 1, 2])
