"""KeyedJagged: a batch of several variable-length features in one flat layout (TorchRec's KJT).

``values`` holds every id, key by key and, within a key, sample by sample; ``lengths`` (or
``offsets``) has ``len(keys) * batch_size`` entries in the same order. TorchRec's own
KeyedJaggedTensor is accepted too wherever a KeyedJagged is (duck-typed; torchrec is not a
dependency), and checked the same way when it is split (``keyed_jagged_to_features``). This
module needs no torch; ``embengine.torch.KeyedJagged`` is the same class.

Lengths are checked so that no sum of them can wrap around int64 (each length in
``[0, len(values)]``, every running sum checked, not only the total); errors name the key and
the sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .inputs import Ragged, _float_array, _int_array, read_only

__all__ = ["KeyedJagged", "is_keyed_jagged", "keyed_jagged_to_features"]


def _where(keys: list[str], batch: int, k: int) -> str:
    """Key and sample of entry ``k`` of a KJT's lengths (key-major)."""
    return f"key {keys[k // batch]!r}, sample {k % batch}"


def _batch_size(keys: list[str], num_lengths: int) -> int:
    if not keys:
        if num_lengths:
            raise ValueError(f"KeyedJagged has no keys but {num_lengths} lengths")
        return 0
    if num_lengths % len(keys):
        raise ValueError(
            f"KeyedJagged has {num_lengths} lengths for {len(keys)} keys; it needs "
            "len(keys) * batch_size"
        )
    return num_lengths // len(keys)


def _offsets_from_lengths(keys: list[str], lengths: np.ndarray, num_values: int) -> np.ndarray:
    """Offsets ``[len(lengths) + 1]`` of a KJT's lengths, checked without overflow."""
    if lengths.ndim != 1:
        raise ValueError(f"KeyedJagged lengths must be 1-D, got shape {lengths.shape}")
    batch = _batch_size(keys, len(lengths))
    if lengths.size:
        if lengths.min() < 0:
            k = int(np.argmax(lengths < 0))
            raise ValueError(
                f"KeyedJagged {_where(keys, batch, k)}: length {int(lengths[k])} (lengths[{k}]) "
                "is negative"
            )
        if lengths.max() > num_values:
            k = int(np.argmax(lengths > num_values))
            raise ValueError(
                f"KeyedJagged {_where(keys, batch, k)}: length {int(lengths[k])} (lengths[{k}]) "
                f"is more than the number of values ({num_values})"
            )
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    wrapped = offsets[1:] < offsets[:-1]  # lengths are >= 0: only a wrap can decrease a sum
    if wrapped.any():
        k = int(np.argmax(wrapped))
        raise ValueError(
            f"KeyedJagged lengths sum to more than the number of values ({num_values}): the "
            f"running sum overflows int64 at lengths[{k}] ({_where(keys, batch, k)})"
        )
    if offsets[-1] != num_values:
        raise ValueError(
            f"KeyedJagged lengths sum to {int(offsets[-1])} but there are {num_values} values"
        )
    return offsets


def _check_offsets(keys: list[str], offsets: np.ndarray, num_values: int) -> None:
    if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0:
        raise ValueError("KeyedJagged offsets must be 1-D and start at 0")
    batch = _batch_size(keys, len(offsets) - 1)
    # Compared, not subtracted: np.diff wraps around near the int64 limits.
    down = offsets[1:] < offsets[:-1]
    if down.any():
        k = int(np.argmax(down)) + 1
        raise ValueError(
            f"KeyedJagged {_where(keys, batch, k - 1)}: offsets[{k}]={int(offsets[k])} is less "
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


def _weights(weights, num_values: int) -> np.ndarray | None:
    if weights is None:
        return None
    w = _float_array(weights, "KeyedJagged weights")
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


class KeyedJagged:
    """``keys``, integer ``values`` and exactly one of ``lengths`` / ``offsets`` (see module
    docstring), optional float ``weights`` (one per value). Checked when built; the arrays it
    hands out are read-only."""

    def __init__(self, keys: Sequence[str], values, lengths=None, offsets=None, weights=None):
        keys = _keys(keys)
        values = _values(values)
        if (lengths is None) == (offsets is None):
            raise ValueError("KeyedJagged needs exactly one of lengths= or offsets=")
        if lengths is None:
            offsets = np.array(_int_array(offsets, "KeyedJagged offsets"), np.int64, copy=True)
            _check_offsets(keys, offsets, len(values))
            lengths = np.diff(offsets)  # non-decreasing from 0: no difference wraps
        else:
            lengths = np.array(_int_array(lengths, "KeyedJagged lengths"), np.int64, copy=True)
            _offsets_from_lengths(keys, lengths, len(values))
        lengths.flags.writeable = False
        w = _weights(weights, len(values))
        self._keys = keys
        self._values = read_only(values)
        self._lengths = lengths
        self._weights = None if w is None else read_only(w)

    def keys(self) -> list[str]:
        return list(self._keys)

    def values(self):
        return self._values

    def lengths(self):
        return self._lengths

    def weights_or_none(self):
        return self._weights

    @property
    def batch_size(self) -> int:
        return len(self._lengths) // len(self._keys) if self._keys else 0


def is_keyed_jagged(x) -> bool:
    """Whether ``x`` looks like a KeyedJagged: callable ``keys``, ``values`` and ``lengths``."""
    return all(callable(getattr(x, name, None)) for name in ("keys", "values", "lengths"))


def keyed_jagged_to_features(kjt) -> dict[str, Ragged]:
    """Split a KeyedJagged (or TorchRec KJT) into one Ragged per key, checking it first (a
    TorchRec KJT was never checked by us); errors name the key and sample."""
    keys = _keys(kjt.keys())
    values = _values(kjt.values())
    lengths = _int_array(kjt.lengths(), "KeyedJagged lengths")
    offsets = _offsets_from_lengths(keys, lengths, len(values))
    weights_fn = getattr(kjt, "weights_or_none", None)
    weights = _weights(weights_fn() if weights_fn is not None else None, len(values))
    if not keys:
        return {}
    batch = len(lengths) // len(keys)
    out = {}
    for i, key in enumerate(keys):
        lo, hi = i * batch, (i + 1) * batch
        start, stop = int(offsets[lo]), int(offsets[hi])
        try:
            out[key] = Ragged(
                values[start:stop],
                offsets=offsets[lo : hi + 1] - start,
                weights=None if weights is None else weights[start:stop],
            )
        except (TypeError, ValueError) as e:
            raise type(e)(f"KeyedJagged key {key!r}: {e}") from None
    return out
