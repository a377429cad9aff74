"""KeyedTensor: pooled embeddings of several features side by side, as TorchRec's KeyedTensor.

``values()`` is ``[batch_size, sum of the keys' dims]``: key ``k`` occupies columns
``offset_per_key()[k]`` to ``offset_per_key()[k + 1]``. It is what TorchRec's
EmbeddingBagCollection returns; ``EmbeddingLayer(engine, output="keyed")`` returns one, so code
written against TorchRec's KeyedTensor runs unchanged: it has every public method of TorchRec's
(``keys``, ``values``, ``key_dim``, ``length_per_key``, ``offset_per_key``, ``to_dict``,
``kt["key"]``, ``regroup``, ``regroup_as_dict``, ``size_in_bytes``, ``to``, ``device``,
``record_stream``) and the ``_key_indices`` its regrouping functions call, so TorchRec's
``KeyedTensor.regroup`` and ``KTRegroupAsDict`` take ours. It is not an instance of TorchRec's
class (torchrec is not a dependency). Gradients flow through ``values()`` and every view of it.
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
        cls,
        keys: Sequence[str],
        tensors: Sequence[torch.Tensor],
        key_dim: int = 1,
        cat_dim: int = 1,
    ) -> KeyedTensor:
        """Concatenate ``tensors`` (one per key, equal but for ``key_dim``) along ``cat_dim``
        (TorchRec's arguments; ``cat_dim`` is ``key_dim`` but for odd layouts)."""
        lengths = [t.shape[key_dim] for t in tensors]
        return cls(keys, lengths, torch.cat(list(tensors), dim=cat_dim), key_dim)

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

    def size_in_bytes(self) -> int:
        """The bytes of ``values()``'s elements."""
        return self._values.element_size() * self._values.numel()

    def record_stream(self, stream) -> None:
        """``values().record_stream(stream)`` (a CUDA stream)."""
        self._values.record_stream(stream)

    def _key_indices(self) -> dict[str, int]:
        """Key -> its index in ``keys()`` (TorchRec's regrouping functions call it)."""
        return dict(self._index)

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

    @staticmethod
    def regroup(keyed_tensors: Sequence, groups: Sequence[Sequence[str]]) -> list[torch.Tensor]:
        """One tensor per group: its keys' columns side by side, in the group's order, taken
        from ``keyed_tensors`` (ours or TorchRec's; a key in several: the last one's, as
        TorchRec). Gradients flow back to every input's ``values()``."""
        where = {}
        for kt in keyed_tensors:
            for key in kt.keys():
                where[key] = kt
        if not keyed_tensors:
            raise ValueError("KeyedTensor.regroup needs at least one KeyedTensor")
        key_dim = keyed_tensors[0].key_dim()
        parts, widths = [], []
        for group in groups:
            width = 0
            for key in group:
                if key not in where:
                    raise KeyError(
                        f"KeyedTensor.regroup: key {key!r} of group {list(group)} is in none of "
                        f"the KeyedTensors (keys {list(where)})"
                    )
                part = where[key][key]
                parts.append(part)
                width += part.shape[key_dim]
            widths.append(width)
        if not parts:  # every group empty: [batch, 0] each
            return [keyed_tensors[0].values().narrow(key_dim, 0, 0) for _ in groups]
        return list(torch.cat(parts, dim=key_dim).split(widths, dim=key_dim))

    @staticmethod
    def regroup_as_dict(
        keyed_tensors: Sequence, groups: Sequence[Sequence[str]], keys: Sequence[str]
    ) -> dict[str, torch.Tensor]:
        """``regroup``'s tensors by name: ``keys[i]`` -> group ``i``'s tensor."""
        if len(groups) != len(keys):
            raise ValueError(
                f"KeyedTensor.regroup_as_dict has {len(groups)} groups and {len(keys)} keys; "
                "give one key per group"
            )
        return dict(zip(keys, KeyedTensor.regroup(keyed_tensors, groups), strict=True))

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
