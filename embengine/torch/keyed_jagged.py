"""KeyedJagged (TorchRec's KJT layout) for the torch layer: the class and its conversion live in
``embengine.keyed_jagged``, which needs no torch; these names stay for callers."""

from __future__ import annotations

from ..keyed_jagged import KeyedJagged, is_keyed_jagged, keyed_jagged_to_features

__all__ = ["KeyedJagged", "to_feature_dict"]

_is_keyed_jagged = is_keyed_jagged
to_feature_dict = keyed_jagged_to_features
