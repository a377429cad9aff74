"""User input -> ``Ragged`` (ids int64, offsets int64, weights float32 or None), with validation.

Accepted per feature:

- ``Ragged(ids, offsets=None, lengths=None, weights=None)``: the canonical form; sample ``b`` holds
  ``ids[offsets[b]:offsets[b+1]]``.
- a 1-D integer array (NumPy or torch): one id per sample;
- a 2-D integer array padded with -1: row ``b`` is sample ``b``; -1 entries are padding;
- a list of lists of ints (one list per sample), or a flat list of ints (one id per sample).

Weights (float) follow the same layout as the ids: 1-D of the same length, 2-D of the same shape
(padding entries ignored) or a list of lists.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["Ragged", "to_ragged", "as_numpy", "is_keyed_jagged", "keyed_jagged_to_features"]


def as_numpy(x) -> np.ndarray:
    """A NumPy view of a NumPy array, torch tensor or sequence, without importing torch."""
    if isinstance(x, np.ndarray):
        return x
    mod = type(x).__module__
    if mod.startswith("torch") and hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _int_array(x, what: str) -> np.ndarray:
    a = as_numpy(x)
    if a.dtype.kind not in "iu":
        if a.size == 0 and a.dtype.kind == "f":  # np.asarray([]) is float64
            return np.zeros(a.shape, dtype=np.int64)
        raise TypeError(f"{what} must be integers, got dtype {a.dtype}")
    if a.dtype == np.uint64 and a.size and a.max() > np.iinfo(np.int64).max:
        k = int(np.argmax(a > np.iinfo(np.int64).max))
        raise ValueError(f"{what}[{k}]={int(a[k])} does not fit in int64")
    return a.astype(np.int64, copy=False)


def _float_array(x, what: str) -> np.ndarray:
    a = as_numpy(x)
    if a.dtype.kind not in "iuf":
        raise TypeError(f"{what} must be numbers, got dtype {a.dtype}")
    return a.astype(np.float32, copy=False)


class Ragged:
    """A batch of variable-length samples: sample ``b`` is ``ids[offsets[b]:offsets[b+1]]``.

    Give either ``offsets`` (length B+1, starting at 0, non-decreasing, ending at ``len(ids)``) or
    ``lengths`` (length B, each >= 0). ``weights``, if given, has one float per id.
    """

    __slots__ = ("ids", "offsets", "weights")

    def __init__(self, ids, offsets=None, lengths=None, weights=None):
        ids = _int_array(ids, "ids")
        if ids.ndim != 1:
            raise ValueError(f"Ragged ids must be 1-D, got shape {ids.shape}")
        if (offsets is None) == (lengths is None):
            raise ValueError("Ragged needs exactly one of offsets= or lengths=")
        if lengths is not None:
            lengths = _int_array(lengths, "lengths")
            if lengths.ndim != 1:
                raise ValueError(f"Ragged lengths must be 1-D, got shape {lengths.shape}")
            if lengths.size and lengths.min() < 0:
                k = int(np.argmax(lengths < 0))
                raise ValueError(f"lengths[{k}]={int(lengths[k])} is negative")
            offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            if offsets[-1] != len(ids):
                raise ValueError(f"lengths sum to {int(offsets[-1])} but there are {len(ids)} ids")
        else:
            offsets = _int_array(offsets, "offsets")
            if offsets.ndim != 1 or len(offsets) < 1:
                raise ValueError(f"Ragged offsets must be 1-D with >= 1 entry, got {offsets.shape}")
            if offsets[0] != 0:
                raise ValueError(f"offsets[0]={int(offsets[0])} must be 0")
            step = np.diff(offsets)
            if step.size and step.min() < 0:
                k = int(np.argmax(step < 0)) + 1
                raise ValueError(
                    f"offsets[{k}]={int(offsets[k])} is less than offsets[{k - 1}]="
                    f"{int(offsets[k - 1])}: offsets must be non-decreasing"
                )
            if offsets[-1] != len(ids):
                raise ValueError(
                    f"offsets[-1]={int(offsets[-1])} must equal the number of ids ({len(ids)})"
                )
        if weights is not None:
            weights = _float_array(weights, "weights")
            if weights.shape != ids.shape:
                raise ValueError(
                    f"weights has shape {weights.shape} but ids has shape {ids.shape}; "
                    "give one weight per id"
                )
        self.ids = ids
        self.offsets = offsets
        self.weights = weights

    @property
    def num_samples(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        w = "" if self.weights is None else ", weights=..."
        return f"Ragged(num_samples={self.num_samples}, num_ids={len(self.ids)}{w})"

    def where(self, k: int) -> str:
        """'sample b, position p' for the k-th id."""
        b = int(np.searchsorted(self.offsets, k, side="right")) - 1
        return f"sample {b}, position {k - int(self.offsets[b])}"


def _is_nested(x) -> bool:
    return (
        isinstance(x, Sequence)
        and not isinstance(x, str | bytes)
        and any(isinstance(e, Sequence | np.ndarray) and not isinstance(e, str | bytes) for e in x)
    )


def _from_lists(value, weights) -> Ragged:
    lengths = [len(s) for s in value]
    flat = [v for s in value for v in s]
    for k, v in enumerate(flat):
        if not isinstance(v, int | np.integer) or isinstance(v, bool):
            b = int(np.searchsorted(np.cumsum(lengths), k, side="right"))
            raise TypeError(f"ids must be integers, got {v!r} at sample {b}")
    ids = np.asarray(flat, dtype=np.int64)
    w = None
    if weights is not None:
        if (
            not isinstance(weights, Sequence | np.ndarray)
            or len(weights) != len(value)
            or not all(isinstance(ws, Sequence | np.ndarray) for ws in weights)
        ):
            raise ValueError(
                f"weights must be a list of {len(value)} lists, one per sample, like the ids"
            )
        for b, (s, ws) in enumerate(zip(value, weights, strict=True)):
            if len(ws) != len(s):
                raise ValueError(
                    f"weights of sample {b} has {len(ws)} entries but the sample has {len(s)} ids"
                )
        w = np.asarray([x for ws in weights for x in ws], dtype=np.float32)
    return Ragged(ids, lengths=np.asarray(lengths, dtype=np.int64), weights=w)


def _from_padded(ids: np.ndarray, weights) -> Ragged:
    bad = ids < -1
    if bad.any():
        b, j = np.argwhere(bad)[0]
        raise ValueError(
            f"id {int(ids[b, j])} at [{b}, {j}] is negative; only -1 marks padding in 2-D input"
        )
    keep = ids != -1
    w = None
    if weights is not None:
        w = _float_array(weights, "weights")
        if w.shape != ids.shape:
            raise ValueError(
                f"weights has shape {w.shape} but the ids have shape {ids.shape}; give 2-D "
                "weights of the same shape"
            )
        w = w[keep]
    return Ragged(ids[keep], lengths=keep.sum(axis=1), weights=w)


def to_ragged(value, weights=None) -> Ragged:
    """Convert any accepted input form (see module docstring) to a structurally valid Ragged."""
    if isinstance(value, Ragged):
        if weights is not None:
            if value.weights is not None:
                raise ValueError("weights given twice: in the Ragged and in weights=")
            return Ragged(value.ids, offsets=value.offsets, weights=weights)
        return value
    if isinstance(value, list | tuple) and _is_nested(value):
        return _from_lists(value, weights)
    try:
        ids = _int_array(value, "ids")
    except ValueError as e:  # e.g. np.asarray of ragged lists
        raise TypeError(f"cannot read ids from {type(value).__name__}: {e}") from None
    if ids.ndim == 2:
        return _from_padded(ids, weights)
    if ids.ndim == 1:
        w = None if weights is None else _float_array(weights, "weights").reshape(-1)
        return Ragged(ids, offsets=np.arange(len(ids) + 1, dtype=np.int64), weights=w)
    raise ValueError(
        f"ids must be 1-D (one id per sample), 2-D (padded with -1) or a Ragged, got shape "
        f"{ids.shape}"
    )


def check_values(r: Ragged, vocabulary_size: int, check_weights: bool = True) -> None:
    """Range-check ids and (optionally) finite-check weights, naming the first bad position."""
    ids = r.ids
    # Two reductions and no temporaries in the common, valid case; the position only on error.
    if ids.size and (ids.min() < 0 or ids.max() >= vocabulary_size):
        bad = (ids < 0) | (ids >= vocabulary_size)
        if bad.any():
            k = int(np.argmax(bad))
            raise ValueError(
                f"id {int(ids[k])} at {r.where(k)} (ids[{k}]) is out of range "
                f"[0, {vocabulary_size})"
            )
    if check_weights and r.weights is not None and r.weights.size:
        bad = ~np.isfinite(r.weights)
        if bad.any():
            k = int(np.argmax(bad))
            raise ValueError(f"weight {r.weights[k]} at {r.where(k)} (weights[{k}]) is not finite")


# -- KeyedJagged (embengine.torch.KeyedJagged, TorchRec's KeyedJaggedTensor): duck-typed here, so
# that preparing one (Preprocessor, EmbeddingLayer) needs neither torch nor the torch package.


def is_keyed_jagged(x) -> bool:
    """Whether ``x`` looks like a KeyedJagged: callable ``keys``, ``values`` and ``lengths``."""
    return all(callable(getattr(x, name, None)) for name in ("keys", "values", "lengths"))


def keyed_jagged_to_features(kjt) -> dict[str, Ragged]:
    """Split a KeyedJagged (or TorchRec KJT) into one Ragged per key."""
    keys = list(kjt.keys())
    values = as_numpy(kjt.values()).astype(np.int64, copy=False)
    lengths = as_numpy(kjt.lengths()).astype(np.int64, copy=False)
    weights_fn = getattr(kjt, "weights_or_none", None)
    weights = weights_fn() if weights_fn is not None else None
    weights = None if weights is None else as_numpy(weights)
    if not keys:
        return {}
    batch = len(lengths) // len(keys)
    out = {}
    start = 0
    for i, key in enumerate(keys):
        lens = lengths[i * batch : (i + 1) * batch]
        stop = start + int(lens.sum())
        out[key] = Ragged(
            values[start:stop],
            lengths=lens,
            weights=None if weights is None else weights[start:stop],
        )
        start = stop
    return out
