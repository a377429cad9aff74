"""KeyedTensor: pooled embeddings of several features side by side, as TorchRec's KeyedTensor.

``values()`` is ``[batch_size, sum of the keys' dims]``: key ``k`` occupies columns
``offset_per_key()[k]`` to ``offset_per_key()[k + 1]``. It is what TorchRec's
EmbeddingBagCollection returns; ``EmbeddingLayer(engine, output="keyed")`` returns one, so code
written against TorchRec's KeyedTensor (``kt.values()``, ``kt["key"]``, ``kt.to_dict()``) runs
unchanged. Gradients flow through ``values()`` and every view of it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["KeyedTensor"]


class KeyedTensor:
    """``keys``, ``length_per_key`` (each key's width along ``key_dim``) and ``values``, whose
    size along ``key_dim`` is the sum of the lengths (TorchRec's constructor and methods)."""

    def __init__(
        self,
        keys: Sequence[str],
        length_per_key: Sequence[int],
        values: torch.Tensor,
        key_dim: int = 1,
    ):
        keys, lengths = list(keys), [int(n) for n in length_per_key]
        if len(keys) != len(lengths):
            raise ValueError(f"KeyedTensor has {len(keys)} keys and {len(lengths)} lengths")
        if len(set(keys)) != len(keys):
            raise ValueError(f"KeyedTensor keys must be unique, got {keys}")
        if values.dim() <= key_dim or values.shape[key_dim] != sum(lengths):
            raise ValueError(
                f"KeyedTensor values of shape {list(values.shape)} need {sum(lengths)} entries "
                f"along dim {key_dim} (the sum of length_per_key {lengths})"
            )
        self._keys, self._lengths, self._values, self._key_dim = keys, lengths, values, key_dim
        self._offsets = [0]
        for n in lengths:
            self._offsets.append(self._offsets[-1] + n)
        self._index = {k: i for i, k in enumerate(keys)}

    @classmethod
    def from_tensor_list(
        cls, keys: Sequence[str], tensors: Sequence[torch.Tensor], key_dim: int = 1
    ) -> KeyedTensor:
        """Concatenate ``tensors`` (one per key, equal but for ``key_dim``) along ``key_dim``."""
        lengths = [t.shape[key_dim] for t in tensors]
        return cls(keys, lengths, torch.cat(list(tensors), dim=key_dim), key_dim)

    def keys(self) -> list[str]:
        return list(self._keys)

    def values(self) -> torch.Tensor:
        return self._values

    def key_dim(self) -> int:
        return self._key_dim

    def length_per_key(self) -> list[int]:
        return list(self._lengths)

    def offset_per_key(self) -> list[int]:
        """``[0, l0, l0 + l1, ..., sum]``: ``len(keys) + 1`` entries."""
        return list(self._offsets)

    def device(self) -> torch.device:
        return self._values.device

    def __getitem__(self, key: str) -> torch.Tensor:
        """A view of ``key``'s columns of ``values()``."""
        try:
            i = self._index[key]
        except KeyError:
            raise KeyError(f"KeyedTensor has no key {key!r}; keys are {self._keys}") from None
        return self._values.narrow(self._key_dim, self._offsets[i], self._lengths[i])

    def to_dict(self) -> dict[str, torch.Tensor]:
        """Key -> view of its columns, in key order."""
        parts = self._values.split(self._lengths, dim=self._key_dim)
        return dict(zip(self._keys, parts, strict=True))

    def to(self, device, non_blocking: bool = False) -> KeyedTensor:
        return KeyedTensor(
            self._keys,
            self._lengths,
            self._values.to(device, non_blocking=non_blocking),
            self._key_dim,
        )

    def __repr__(self) -> str:
        return (
            f"KeyedTensor(keys={self._keys}, length_per_key={self._lengths}, "
            f"values={list(self._values.shape)})"
        )
