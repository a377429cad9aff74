"""KeyedJagged: a batch of several variable-length features in one flat layout (TorchRec's KJT).

``values`` holds every id, key by key and, within a key, sample by sample; ``lengths`` (or
``offsets``) has one entry per sample of each key, in the same order: ``len(keys) *
batch_size`` entries, or ``sum(stride_per_key)`` when each key has its own number of samples
(TorchRec's variable batch per feature, "VBE").

A VBE batch also needs ``inverse_indices = (keys, indices)``, ``indices`` of shape
``[len(keys), batch_size]``: sample ``j`` of the batch reads row ``indices[k, j]`` of key
``k``. Its output is what TorchRec's EmbeddingBagCollection gives: each key pooled over its own
samples, then expanded to the batch by the inverse indices. Here the ids are expanded before
the lookup instead (``keyed_jagged_to_features``): every key then has ``batch_size`` samples,
the pooled rows are the same bits, and each row's gradient is the same sum. A VBE batch
without inverse indices is refused, naming the keys and their numbers of samples, as TorchRec
refuses it (there is no batch to give its outputs). Inverse indices on a KJT without a
variable batch per key are refused unless they are the identity: TorchRec's
EmbeddingBagCollection expands such a KJT by them and its sharded one does not.

TorchRec's own KeyedJaggedTensor is accepted wherever a KeyedJagged is (duck-typed; torchrec is
not a dependency: ``keys``, ``values``, ``lengths``, and where present the methods and
attributes ``TORCHREC_KJT_READS`` names) and checked the same way when it is split; every
redundant field it holds must agree with its lengths (``stride()``, ``stride_per_key()`` and
``stride_per_key_per_rank()`` included), its private caches too (``_jt_dict``,
``_index_per_key``, ``_lengths_offset_per_key``).
This module needs no torch; ``embengine.torch.KeyedJagged`` is the same class.

Lengths are checked so that no sum of them can wrap around int64 (each length in
``[0, len(values)]``, every running sum checked, not only the total); errors name the key and
the sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .inputs import Ragged, _float_array, _from_jagged, _int_array, read_only

__all__ = ["KeyedJagged", "is_keyed_jagged", "keyed_jagged_to_features"]

# What keyed_jagged_to_features reads of a TorchRec KJT beyond keys/values/lengths, where
# present (a missing one is read as not held, so a rename in torchrec would silently skip its
# check: tests/test_torchrec_interop.py asserts each on a real KJT).
TORCHREC_KJT_READS = (
    "lengths_or_none",
    "offsets_or_none",
    "weights_or_none",
    "variable_stride_per_key",
    "stride_per_key",
    "stride_per_key_per_rank",
    "inverse_indices_or_none",
    "stride",
    "length_per_key_or_none",
    "offset_per_key_or_none",
    "_index_per_key",
    "_lengths_offset_per_key",
    "_jt_dict",
)


class _Layout:
    """Which key and sample each entry of a KJT's lengths belongs to (key-major)."""

    def __init__(self, keys: list[str], strides: list[int]):
        self.keys = keys
        self.strides = strides
        self.starts = np.zeros(len(strides) + 1, dtype=np.int64)
        np.cumsum(strides, out=self.starts[1:])

    def where(self, k: int) -> str:
        i = int(np.searchsorted(self.starts, k, side="right")) - 1
        return f"key {self.keys[i]!r}, sample {k - int(self.starts[i])}"


def _uniform(keys: list[str], num_lengths: int) -> _Layout:
    if not keys:
        if num_lengths:
            raise ValueError(f"KeyedJagged has no keys but {num_lengths} lengths")
        return _Layout(keys, [])
    if num_lengths % len(keys):
        raise ValueError(
            f"KeyedJagged has {num_lengths} lengths for {len(keys)} keys; it needs "
            "len(keys) * batch_size, or stride_per_key (a variable batch per key)"
        )
    return _Layout(keys, [num_lengths // len(keys)] * len(keys))


def _variable(keys: list[str], stride_per_key, num_lengths: int) -> _Layout:
    if not hasattr(stride_per_key, "dtype"):  # a tensor or array is read as one (list() of
        stride_per_key = list(stride_per_key)  # a tensor gives 0-d tensors, refused as ints)
    strides = _int_array(stride_per_key, "KeyedJagged stride_per_key")
    if strides.ndim != 1:
        raise ValueError(
            f"KeyedJagged stride_per_key must be 1-D (one number per key), got shape "
            f"{list(strides.shape)}"
        )
    strides = list(strides)
    if len(strides) != len(keys):
        raise ValueError(
            f"KeyedJagged stride_per_key has {len(strides)} entries for {len(keys)} keys; give "
            "one number of samples per key"
        )
    for key, s in zip(keys, strides, strict=True):
        if s < 0:
            raise ValueError(f"KeyedJagged key {key!r}: stride_per_key {int(s)} is negative")
    total = sum(int(s) for s in strides)  # Python ints: no wrap
    if total != num_lengths:
        raise ValueError(
            f"KeyedJagged stride_per_key {dict(zip(keys, map(int, strides), strict=True))} adds "
            f"up to {total} samples but there are {num_lengths} lengths"
        )
    return _Layout(keys, [int(s) for s in strides])


def _offsets_from_lengths(layout: _Layout, lengths: np.ndarray, num_values: int) -> np.ndarray:
    """Offsets ``[len(lengths) + 1]`` of a KJT's lengths, checked without overflow."""
    if lengths.size:
        if lengths.min() < 0:
            k = int(np.argmax(lengths < 0))
            raise ValueError(
                f"KeyedJagged {layout.where(k)}: length {int(lengths[k])} (lengths[{k}]) "
                "is negative"
            )
        if lengths.max() > num_values:
            k = int(np.argmax(lengths > num_values))
            raise ValueError(
                f"KeyedJagged {layout.where(k)}: length {int(lengths[k])} (lengths[{k}]) "
                f"is more than the number of values ({num_values})"
            )
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    wrapped = offsets[1:] < offsets[:-1]  # lengths are >= 0: only a wrap can decrease a sum
    if wrapped.any():
        k = int(np.argmax(wrapped))
        raise ValueError(
            f"KeyedJagged lengths sum to more than the number of values ({num_values}): the "
            f"running sum overflows int64 at lengths[{k}] ({layout.where(k)})"
        )
    if offsets[-1] != num_values:
        raise ValueError(
            f"KeyedJagged lengths sum to {int(offsets[-1])} but there are {num_values} values"
        )
    return offsets


def _check_offsets(layout: _Layout, offsets: np.ndarray, num_values: int) -> None:
    # Compared, not subtracted: np.diff wraps around near the int64 limits.
    down = offsets[1:] < offsets[:-1]
    if down.any():
        k = int(np.argmax(down)) + 1
        raise ValueError(
            f"KeyedJagged {layout.where(k - 1)}: offsets[{k}]={int(offsets[k])} is less "
            f"than offsets[{k - 1}]={int(offsets[k - 1])}; offsets must be non-decreasing"
        )
    if offsets[-1] != num_values:
        raise ValueError(
            f"KeyedJagged offsets end at {int(offsets[-1])} but there are {num_values} values"
        )


def _values(values) -> np.ndarray:
    try:
        v = _int_array(values, "KeyedJagged values")
    except ValueError as e:  # e.g. np.asarray of ragged lists
        raise TypeError(f"cannot read KeyedJagged values: {e}") from None
    if v.ndim != 1:
        raise ValueError(f"KeyedJagged values must be 1-D, got shape {v.shape}")
    return v


def _lengths(lengths) -> np.ndarray:
    a = _int_array(lengths, "KeyedJagged lengths")
    if a.ndim != 1:
        raise ValueError(f"KeyedJagged lengths must be 1-D, got shape {a.shape}")
    return a


def _weights(weights, num_values: int, layout: _Layout, offsets: np.ndarray) -> np.ndarray | None:
    """A KJT's weights as float32 (one per value), an entry refused by ``_float_array`` named
    by its key, sample and position (``offsets``: of the KJT's lengths)."""
    if weights is None:
        return None

    def where(k: int) -> str:
        if not 0 <= k < int(offsets[-1]):
            return f"weights[{k}]"
        b = int(np.searchsorted(offsets, k, side="right")) - 1
        return f"{layout.where(b)}, position {k - int(offsets[b])} (weights[{k}])"

    w = _float_array(weights, "KeyedJagged weights", where)
    if w.shape != (num_values,):
        raise ValueError(
            f"KeyedJagged weights must have one entry per value: shape {w.shape}, "
            f"{num_values} values"
        )
    return w


def _keys(keys) -> list[str]:
    keys = list(keys)
    if len(set(keys)) != len(keys):
        raise ValueError(f"KeyedJagged keys must be unique, got {keys}")
    return keys


def _inverse_rows(layout: _Layout, inverse_indices) -> np.ndarray | None:
    """The inverse indices as int64 ``[len(keys), batch]``, one row per key of the KJT in its
    order (TorchRec picks rows by key name, as here), every index checked against its key's
    number of samples. None if there are none."""
    if inverse_indices is None:
        return None
    try:
        inv_keys, indices = inverse_indices
    except (TypeError, ValueError):
        raise TypeError(
            "KeyedJagged inverse_indices must be (keys, indices [len(keys), batch_size]), got "
            f"{type(inverse_indices).__name__}"
        ) from None
    inv_keys = list(inv_keys)
    indices = _int_array(indices, "KeyedJagged inverse_indices")
    if indices.ndim != 2 or indices.shape[0] != len(inv_keys):
        raise ValueError(
            f"KeyedJagged inverse_indices must have shape [{len(inv_keys)} keys, batch_size], "
            f"got {list(indices.shape)}"
        )
    rows = np.empty((len(layout.keys), indices.shape[1]), dtype=np.int64)
    for i, (key, stride) in enumerate(zip(layout.keys, layout.strides, strict=True)):
        if key not in inv_keys:
            raise ValueError(
                f"KeyedJagged key {key!r} has no row in inverse_indices (keys {inv_keys}); "
                "every key needs one"
            )
        row = indices[inv_keys.index(key)]
        bad = (row < 0) | (row >= stride)
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(
                f"KeyedJagged key {key!r}: inverse index {int(row[j])} at sample {j} is out of "
                f"range [0, {stride}) (the key has {stride} samples)"
            )
        rows[i] = row
    return rows


def _refuse_uniform_inverse(layout: _Layout, inverse: np.ndarray | None) -> None:
    """A KJT without a variable batch per key may carry inverse indices only if they are the
    identity: TorchRec's EmbeddingBagCollection expands such a KJT's outputs by them, its
    sharded EmbeddingBagCollection (which expands only a variable batch per key) and its
    EmbeddingCollection (which expands none) serve the KJT's own samples, so any other
    indices give two batches."""
    if inverse is None or not layout.keys:
        return
    n = layout.strides[0]
    if inverse.shape[1] == n and (inverse == np.arange(n)).all():
        return
    width = inverse.shape[1]
    k = len(layout.keys)
    raise ValueError(
        f"KeyedJagged has inverse_indices (a batch of {width} samples) but no variable batch "
        f"per key (each of its {k} keys has {n} samples, variable_stride_per_key() is "
        f"False): TorchRec's EmbeddingBagCollection expands its outputs to the {width} "
        f"samples by them, its sharded EmbeddingBagCollection and its EmbeddingCollection "
        f"serve the {n} samples. Give it a variable batch per key (TorchRec's "
        f"stride_per_key_per_rank={[[n]] * k}, KeyedJagged's stride_per_key={[n] * k}), which "
        "both its EmbeddingBagCollections expand, or drop the inverse indices"
    )


def _refuse_unexpanded(layout: _Layout) -> None:
    if len(set(layout.strides)) > 1:
        counts = dict(zip(layout.keys, layout.strides, strict=True))
        raise ValueError(
            f"KeyedJagged has a variable batch per key {counts} (stride_per_key) and no "
            "inverse_indices: the keys' outputs would have different batch sizes. Pass "
            "inverse_indices=(keys, indices [len(keys), batch_size]) saying which sample of "
            "each key every sample of the batch reads (as TorchRec's EmbeddingBagCollection "
            "needs), or give every key the same number of samples"
        )


class KeyedJagged:
    """``keys``, integer ``values`` and exactly one of ``lengths`` / ``offsets`` (see module
    docstring), optional float ``weights`` (one per value), and for a variable batch per key
    ``stride_per_key`` (one number of samples per key) with ``inverse_indices`` (keys, int
    ``[len(keys), batch_size]``), as TorchRec's KeyedJaggedTensor. Checked when built; the
    arrays it hands out are read-only."""

    def __init__(
        self,
        keys: Sequence[str],
        values,
        lengths=None,
        offsets=None,
        weights=None,
        *,
        stride_per_key: Sequence[int] | None = None,
        inverse_indices=None,
    ):
        keys = _keys(keys)
        values = _values(values)
        if (lengths is None) == (offsets is None):
            raise ValueError("KeyedJagged needs exactly one of lengths= or offsets=")
        if lengths is None:
            offsets = np.array(_int_array(offsets, "KeyedJagged offsets"), np.int64, copy=True)
            if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0:
                raise ValueError("KeyedJagged offsets must be 1-D and start at 0")
            num_lengths = len(offsets) - 1
        else:
            lengths = np.array(_lengths(lengths), np.int64, copy=True)
            num_lengths = len(lengths)
        if stride_per_key is None:
            layout = _uniform(keys, num_lengths)
        else:
            layout = _variable(keys, stride_per_key, num_lengths)
        if lengths is None:
            _check_offsets(layout, offsets, len(values))
            lengths = np.diff(offsets)  # non-decreasing from 0: no difference wraps
        else:
            offsets = _offsets_from_lengths(layout, lengths, len(values))
        inverse = _inverse_rows(layout, inverse_indices)
        if inverse is None:
            _refuse_unexpanded(layout)
        elif stride_per_key is None:
            _refuse_uniform_inverse(layout, inverse)
        lengths.flags.writeable = False
        w = _weights(weights, len(values), layout, offsets)
        self._keys = keys
        self._values = read_only(values)
        self._lengths = lengths
        self._weights = None if w is None else read_only(w)
        self._strides = None if stride_per_key is None else list(layout.strides)
        self._inverse = None if inverse is None else (list(keys), read_only(inverse))

    def keys(self) -> list[str]:
        return list(self._keys)

    def values(self):
        return self._values

    def lengths(self):
        return self._lengths

    def weights_or_none(self):
        return self._weights

    def variable_stride_per_key(self) -> bool:
        """Whether ``stride_per_key`` was given (TorchRec's name)."""
        return self._strides is not None

    def stride_per_key(self) -> list[int]:
        """Samples per key (TorchRec's "stride")."""
        if self._strides is not None:
            return list(self._strides)
        return [len(self._lengths) // len(self._keys)] * len(self._keys) if self._keys else []

    def inverse_indices_or_none(self):
        """``(keys, int64 [len(keys), batch_size])`` or None."""
        return self._inverse

    def stride(self) -> int:
        """The batch size (TorchRec's name): of the inverse indices when given."""
        if self._inverse is not None:
            return int(self._inverse[1].shape[1])
        return len(self._lengths) // len(self._keys) if self._keys else 0

    @property
    def batch_size(self) -> int:
        return self.stride()


def is_keyed_jagged(x) -> bool:
    """Whether ``x`` looks like a KeyedJagged: callable ``keys``, ``values`` and ``lengths``."""
    return all(callable(getattr(x, name, None)) for name in ("keys", "values", "lengths"))


def _optional(kjt, method: str):
    fn = getattr(kjt, method, None)
    return fn() if callable(fn) else None


def _expand(ids: np.ndarray, offsets: np.ndarray, weights, rows: np.ndarray):
    """A key's samples ``rows[j]`` for j in the batch: ids, offsets ``[len(rows) + 1]`` and
    weights of the expanded samples (sample j holds the ids of sample ``rows[j]``)."""
    starts, lengths = offsets[rows], offsets[rows + 1] - offsets[rows]
    new = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new[1:])
    # position of each expanded id in the key's ids: its sample's start, plus its rank in it
    pos = np.repeat(starts - new[:-1], lengths) + np.arange(int(new[-1]), dtype=np.int64)
    return ids[pos], new, None if weights is None else weights[pos]


def _given_offsets(
    kjt, layout: _Layout, num_lengths: int, num_values: int, holds_lengths: bool
) -> np.ndarray | None:
    """The offsets a TorchRec KJT holds (``offsets_or_none()``), or None. Its ``lengths()`` are
    then their differences (when it holds no lengths) or its own lengths, which the offsets
    must agree with: they are checked here as offsets (1-D, ``num_lengths + 1`` entries, from
    0, non-decreasing, ending at ``num_values``) when the KJT holds no lengths, so their
    errors name offsets, not the lengths TorchRec computed from them."""
    given = _optional(kjt, "offsets_or_none")
    if given is None:
        return None
    given = _int_array(given, "KeyedJagged offsets")
    if given.ndim != 1 or len(given) != num_lengths + 1:
        raise ValueError(
            f"KeyedJagged offsets have shape {list(given.shape)}; with {num_lengths} lengths "
            f"they need {num_lengths + 1} entries"
        )
    if not holds_lengths:
        if given[0] != 0:
            raise ValueError(f"KeyedJagged offsets[0]={int(given[0])} must be 0")
        _check_offsets(layout, given, num_values)
    return given


def _check_agree(layout: _Layout, given: np.ndarray, offsets: np.ndarray) -> None:
    """A KJT holding both lengths and offsets: they must agree (TorchRec reads either)."""
    differ = given != offsets
    if differ.any():
        k = int(np.argmax(differ))
        at = "" if k == 0 else f"{layout.where(k - 1)}: "
        raise ValueError(
            f"KeyedJagged {at}offsets[{k}]={int(given[k])} but its lengths give "
            f"{int(offsets[k])}; a KJT's offsets and lengths must agree (give one of them)"
        )


def _check_per_key(kjt, layout: _Layout, offsets: np.ndarray) -> None:
    """A TorchRec KJT's own ``length_per_key`` / ``offset_per_key`` (given, or kept from an
    earlier call), which TorchRec splits its values by, must be what its lengths give: keys
    are split here by the lengths, and a KJT whose numbers disagree gave its keys other ids
    than TorchRec's split does."""
    bounds = offsets[layout.starts]  # each key's first value, and the end
    want = {
        "length_per_key": (_optional(kjt, "length_per_key_or_none"), np.diff(bounds)),
        "offset_per_key": (_optional(kjt, "offset_per_key_or_none"), bounds),
    }
    for name, (got, expected) in want.items():
        expected = [int(n) for n in expected]
        if got is None:
            continue
        got = [int(n) for n in got]
        if got != expected:
            raise ValueError(
                f"KeyedJagged {name} is {got} but its lengths give {expected} (keys "
                f"{layout.keys}); they must agree: TorchRec splits the values by {name}"
            )


def _check_key_caches(kjt, layout: _Layout) -> None:
    """A TorchRec KJT's ``_index_per_key`` and ``_lengths_offset_per_key`` (given to its
    constructor, or kept from an earlier ``kjt[key]``), which ``kjt[key]`` picks a key's values
    and lengths by, must be what its keys and lengths give (TorchRec has no public accessor
    that returns them unchanged: the attributes are read where present)."""
    index = getattr(kjt, "_index_per_key", None)
    if index is not None:
        expected = {key: i for i, key in enumerate(layout.keys)}
        got = dict(index)
        if got != expected:
            raise ValueError(
                f"KeyedJagged index_per_key is {got} but its keys give {expected}; they must "
                "agree: TorchRec's kjt[key] picks a key's values by index_per_key"
            )
    starts = getattr(kjt, "_lengths_offset_per_key", None)
    if starts is not None:
        got = [int(n) for n in starts]
        expected = [int(n) for n in layout.starts]
        if got != expected:
            raise ValueError(
                f"KeyedJagged lengths_offset_per_key is {got} but its lengths give {expected} "
                f"(keys {layout.keys}); they must agree: TorchRec's kjt[key] picks a key's "
                "lengths by lengths_offset_per_key"
            )


def _jt_dict(kjt, keys: list[str]) -> dict | None:
    """A TorchRec KJT's ``_jt_dict`` (``to_dict()``'s result, given to its constructor or kept
    from an earlier call; TorchRec's EmbeddingBagCollection reads it, not the values), checked
    to hold exactly the KJT's keys; None if it has none."""
    cached = getattr(kjt, "_jt_dict", None)
    if cached is None:
        return None
    if sorted(cached) != sorted(keys):
        raise ValueError(
            f"KeyedJagged jt_dict (its cached to_dict()) has keys {list(cached)} but the KJT "
            f"has keys {keys}; they must agree: TorchRec's EmbeddingBagCollection reads "
            "to_dict()"
        )
    return cached


def _check_cached_key(jt, key: str, ids, offsets, weights) -> None:
    """Key ``key``'s JaggedTensor in a KJT's cached ``to_dict()`` must hold the ids, lengths
    and weights the KJT's values, lengths and weights give it (``offsets`` from 0); the first
    difference is named."""
    try:
        cached = _from_jagged(jt)
    except (TypeError, ValueError) as e:
        raise type(e)(f"KeyedJagged jt_dict[{key!r}] (its cached to_dict()): {e}") from None
    at = f"KeyedJagged key {key!r}: its cached to_dict()[{key!r}] (jt_dict)"
    agree = "; a KJT's jt_dict must agree with its values and lengths (TorchRec reads it)"
    if cached.num_samples != len(offsets) - 1:
        raise ValueError(
            f"{at} has {cached.num_samples} samples but its lengths give {len(offsets) - 1}" + agree
        )
    differ = cached.offsets != offsets
    if differ.any():
        b = int(np.argmax(differ)) - 1
        raise ValueError(
            f"{at} has length {int(cached.lengths[b])} at sample {b} but its lengths give "
            f"{int(offsets[b + 1] - offsets[b])}" + agree
        )
    differ = cached.ids != ids
    if differ.any():
        k = int(np.argmax(differ))
        raise ValueError(
            f"{at} has id {int(cached.ids[k])} at {cached.where(k)} but its values give "
            f"{int(ids[k])}" + agree
        )
    if (cached.weights is None) != (weights is None):
        has, has_not = ("the cache", "the KJT") if weights is None else ("the KJT", "the cache")
        raise ValueError(f"{at}: {has} has weights and {has_not} has none" + agree)
    if weights is not None:
        differ = cached.weights.view(np.uint32) != weights.view(np.uint32)  # bits: NaN, -0.0
        if differ.any():
            k = int(np.argmax(differ))
            raise ValueError(
                f"{at} has weight {float(cached.weights[k])!r} at {cached.where(k)} but its "
                f"weights give {float(weights[k])!r}" + agree
            )


def _check_stride(kjt, layout: _Layout) -> None:
    """A KJT's own ``stride()`` (its batch size; TorchRec's may be given, not computed) must
    be its number of samples a key: TorchRec's EmbeddingBagCollection fails on one that is
    not, where its lengths alone read as another batch."""
    stride = _optional(kjt, "stride")
    if stride is None or not layout.keys:
        return
    if int(stride) != layout.strides[0]:
        raise ValueError(
            f"KeyedJagged stride() is {int(stride)} but its {int(layout.starts[-1])} lengths "
            f"for {len(layout.keys)} keys give {layout.strides[0]} samples a key; its stride "
            "must be the batch size"
        )


def _check_stride_per_key(kjt, layout: _Layout, variable: bool) -> None:
    """A TorchRec KJT's numbers of samples per key must be what its layout gives. Without a
    variable batch per key, ``stride_per_key()`` (a constructor argument TorchRec returns as
    given) must be ``stride()`` for every key: TorchRec's own modules ignore it there, but its
    sharded EmbeddingBagCollection sends each rank its keys' lengths by it (one that disagrees
    failed there, or crashed the process). With one, the rows of
    ``stride_per_key_per_rank()`` must add up to ``stride_per_key()``: TorchRec's
    ``to_dict()`` splits the lengths by the one (given) and its ``split()`` by the other."""
    if not layout.keys:
        return
    if not variable:
        given = _optional(kjt, "stride_per_key")
        if given is None:
            return
        got = [int(n) for n in given]
        if got != layout.strides:
            raise ValueError(
                f"KeyedJagged stride_per_key() is {got} but its {int(layout.starts[-1])} "
                f"lengths for {len(layout.keys)} keys give {layout.strides} (keys "
                f"{layout.keys}; it has no variable batch per key: variable_stride_per_key() "
                "is False); they must agree: TorchRec's sharded EmbeddingBagCollection sends "
                "each rank the lengths by stride_per_key()"
            )
        return
    per_rank = _optional(kjt, "stride_per_key_per_rank")
    if per_rank is None or len(per_rank) == 0:
        return
    try:
        rows = [[int(n) for n in row] for row in per_rank]  # TorchRec's: a list of int lists
    except TypeError:
        raise TypeError(
            f"KeyedJagged stride_per_key_per_rank() must be one list of numbers of samples per "
            f"key (one per rank), got {per_rank!r}"
        ) from None
    if len(rows) != len(layout.keys):
        raise ValueError(
            f"KeyedJagged stride_per_key_per_rank has {len(rows)} rows for "
            f"{len(layout.keys)} keys; it needs one row per key"
        )
    sums = [sum(row) for row in rows]  # Python ints: no wrap
    if sums != layout.strides:
        raise ValueError(
            f"KeyedJagged stride_per_key() is {layout.strides} but its stride_per_key_per_rank "
            f"{rows} adds up to {sums} (keys {layout.keys}); they must agree: "
            "TorchRec's to_dict() splits the lengths by stride_per_key() and its split() by "
            "stride_per_key_per_rank"
        )


def keyed_jagged_to_features(kjt) -> dict[str, Ragged]:
    """Split a KeyedJagged (or TorchRec KJT) into one Ragged per key, checking it first (a
    TorchRec KJT was never checked by us); errors name the key and sample. A variable batch
    per key is expanded to the batch by its inverse indices (see the module docstring)."""
    keys = _keys(kjt.keys())
    values = _values(kjt.values())
    # asked before lengths(): TorchRec's computes the lengths of an offsets-only KJT and keeps them
    holds_lengths = _optional(kjt, "lengths_or_none") is not None
    lengths = _lengths(kjt.lengths())
    variable = bool(_optional(kjt, "variable_stride_per_key"))
    if variable:
        layout = _variable(keys, kjt.stride_per_key(), len(lengths))
    else:
        layout = _uniform(keys, len(lengths))
    given = _given_offsets(kjt, layout, len(lengths), len(values), holds_lengths)
    offsets = _offsets_from_lengths(layout, lengths, len(values))
    if given is not None:
        _check_agree(layout, given, offsets)
    _check_per_key(kjt, layout, offsets)
    _check_key_caches(kjt, layout)
    cached = _jt_dict(kjt, keys)
    weights = _weights(_optional(kjt, "weights_or_none"), len(values), layout, offsets)
    inverse = _inverse_rows(layout, _optional(kjt, "inverse_indices_or_none"))
    if inverse is None:
        _refuse_unexpanded(layout)
    if inverse is None or not variable:  # TorchRec views a uniform KJT's lengths by stride()
        _check_stride(kjt, layout)
    _check_stride_per_key(kjt, layout, variable)
    if not variable:
        _refuse_uniform_inverse(layout, inverse)
    out = {}
    for i, key in enumerate(keys):
        lo, hi = int(layout.starts[i]), int(layout.starts[i + 1])
        start, stop = int(offsets[lo]), int(offsets[hi])
        ids, offs = values[start:stop], offsets[lo : hi + 1] - start
        w = None if weights is None else weights[start:stop]
        if cached is not None:
            _check_cached_key(cached[key], key, ids, offs, w)
        if inverse is not None:
            ids, offs, w = _expand(ids, offs, w, inverse[i])
        try:
            out[key] = Ragged(ids, offsets=offs, weights=w)
        except (TypeError, ValueError) as e:
            raise type(e)(f"KeyedJagged key {key!r}: {e}") from None
    return out
