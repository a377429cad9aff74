"""KeyedJagged: a batch of several variable-length features in one flat layout (TorchRec's KJT).

``values`` holds every id, key by key and, within a key, sample by sample; ``lengths`` (or
``offsets``) has ``len(keys) * batch_size`` entries in the same order. TorchRec's own
KeyedJaggedTensor is accepted too wherever a KeyedJagged is (duck-typed; torchrec is not a
dependency).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..inputs import as_numpy, is_keyed_jagged, keyed_jagged_to_features

__all__ = ["KeyedJagged", "to_feature_dict"]


class KeyedJagged:
    def __init__(self, keys: Sequence[str], values, lengths=None, offsets=None, weights=None):
        keys = list(keys)
        if len(set(keys)) != len(keys):
            raise ValueError(f"KeyedJagged keys must be unique, got {keys}")
        values = as_numpy(values)
        if (lengths is None) == (offsets is None):
            raise ValueError("KeyedJagged needs exactly one of lengths= or offsets=")
        if lengths is None:
            offsets = as_numpy(offsets).astype(np.int64)
            if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0:
                raise ValueError("KeyedJagged offsets must be 1-D and start at 0")
            lengths = np.diff(offsets)
        lengths = as_numpy(lengths).astype(np.int64)
        if keys and len(lengths) % len(keys):
            raise ValueError(
                f"KeyedJagged has {len(lengths)} lengths for {len(keys)} keys; it needs "
                "len(keys) * batch_size"
            )
        if int(lengths.sum()) != len(values):
            raise ValueError(
                f"KeyedJagged lengths sum to {int(lengths.sum())} but there are "
                f"{len(values)} values"
            )
        if weights is not None and len(as_numpy(weights)) != len(values):
            raise ValueError("KeyedJagged weights must have one entry per value")
        self._keys = keys
        self._values = values
        self._lengths = lengths
        self._weights = None if weights is None else as_numpy(weights)

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


# The conversion lives in embengine.inputs (no torch needed); these names stay for callers.
_is_keyed_jagged = is_keyed_jagged
to_feature_dict = keyed_jagged_to_features
