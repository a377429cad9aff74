"""TensorFlow inputs and outputs for ``embengine.tpu``, with TensorFlow optional.

A value is a TF object when its class lives in the ``tensorflow`` package; that test imports
nothing, and ``tensorflow`` is imported only once such a value arrives (so it is already loaded).

Inputs, per feature, follow ``tf.tpu.experimental.embedding.TPUEmbedding.enqueue``:

- ``tf.Tensor`` (or a ``tf.Variable``): a dense input, read as the NumPy array of the same shape;
- ``tf.RaggedTensor`` of rank 2 (``ragged_rank`` 1): row ``b`` is sample ``b``;
- ``tf.SparseTensor`` of rank >= 2: entry ``indices[k] = [*lead, j]`` puts ``values[k]`` into
  bag ``lead`` (a bag per index of the leading ``rank - 1`` dims); as a sequence, ``j`` is its
  position (so a rank 2 SparseTensor may leave gaps, which look up zeros, as in TF).

Weights, where allowed, have the same type and structure as the ids (the same ``row_splits``,
the same ``indices``). Ids must be integers and weights numbers; the arrays are read without a
copy (``np.asarray`` of an eager tensor is a read-only view) unless they must be cast to int64 /
float32 or put in row order.

Outputs: activations become ``tf.Tensor``. ``TPUEmbedding.dequeue`` returns the value of a
trainable ``tf.Variable`` per feature (assigned each step), so a ``tf.GradientTape`` around
``dequeue`` records it and ``tape.gradient(loss, activations)`` works with or without
``tape.watch``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..inputs import Ragged

__all__ = ["is_tf", "TFSparse", "unpack", "gradient_to_numpy", "ActivationVariables", "to_tf"]


def is_tf(x: Any) -> bool:
    """True if ``x`` is a TensorFlow object (tensor, RaggedTensor, SparseTensor, Variable,
    IndexedSlices, TensorShape), decided from its class's module: TF is not imported."""
    mod = type(x).__module__
    return mod == "tensorflow" or mod.startswith("tensorflow.")


def _tf():
    import tensorflow as tf  # lazy: only reached when a TF object came in, so TF is loaded

    return tf


@dataclass(frozen=True)
class TFSparse:
    """A SparseTensor's arrays: ``indices`` int64 ``[N, rank]``, ``values`` int64 ``[N]``,
    ``dense_shape`` int64 ``[rank]``, ``weights`` float32 ``[N]`` or None."""

    indices: np.ndarray
    values: np.ndarray
    dense_shape: np.ndarray
    weights: np.ndarray | None


def _eager(path: str, t) -> np.ndarray:
    """The NumPy view of an eager tensor; a TypeError for a symbolic one (inside tf.function)."""
    if not hasattr(t, "_numpy"):
        raise TypeError(
            f"feature {path!r}: got a symbolic {type(t).__name__} (inside tf.function?); "
            "embengine.tpu looks up eagerly: call enqueue, dequeue and apply_gradients outside "
            "tf.function"
        )
    return np.asarray(t)


def _ids(path: str, t, what: str) -> np.ndarray:
    if not t.dtype.is_integer:
        raise TypeError(f"feature {path!r}: {what} must be integers, got tf dtype {t.dtype.name}")
    a = _eager(path, t)
    if a.dtype == np.uint64 and a.size and a.max() > np.iinfo(np.int64).max:
        flat = a.reshape(-1)  # a scalar or an N-d tensor: its first such value, by position
        k = int(np.argmax(flat > np.iinfo(np.int64).max))
        at = "".join(f"[{i}]" for i in np.unravel_index(k, a.shape))
        raise ValueError(f"feature {path!r}: {what}{at}={int(flat[k])} does not fit in int64")
    return a.astype(np.int64, copy=False)


def _weights(path: str, t) -> np.ndarray:
    if not (t.dtype.is_floating or t.dtype.is_integer):
        raise TypeError(f"feature {path!r}: weights must be numbers, got tf dtype {t.dtype.name}")
    return _eager(path, t).astype(np.float32, copy=False)


def _type_mismatch(path: str, weight, value) -> ValueError:
    return ValueError(
        f"Weight for {path} is type {type(weight)} which does not match type input which is "
        f"{type(value).__name__}."
    )


def unpack(path: str, value, weight):
    """One feature's TF input (and weight) -> ``(ids, weight)`` for the port's shape rules:
    a NumPy array (a dense tensor; ``weight`` passed on for the port's dense-weight error), a
    ``Ragged`` (weights inside, ``weight`` None) or a ``TFSparse``."""
    tf = _tf()
    if isinstance(value, tf.RaggedTensor):
        return _unpack_ragged(tf, path, value, weight), None
    if isinstance(value, tf.SparseTensor):
        return _unpack_sparse(tf, path, value, weight), None
    if is_tf(weight) and not is_tf(value):
        raise _type_mismatch(path, weight, value)
    if not is_tf(value):
        return value, weight
    try:
        t = tf.convert_to_tensor(value)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"feature {path!r}: expected a tf.Tensor, tf.RaggedTensor or tf.SparseTensor, got "
            f"{type(value).__name__} ({e})"
        ) from None
    return _ids(path, t, "ids"), weight


def _unpack_ragged(tf, path: str, value, weight) -> Ragged:
    if value.ragged_rank != 1 or value.shape.rank != 2:
        raise ValueError(
            f"Only rank 2 ragged tensor is supported, find rank {value.shape.rank} ragged tensor "
            f"(ragged_rank {value.ragged_rank}) for input {path}"
        )
    ids = _ids(path, value.values, "ids")
    w = None
    if weight is not None:
        if not isinstance(weight, tf.RaggedTensor):
            raise _type_mismatch(path, weight, value)
        splits = _eager(path, value.row_splits)
        w_splits = _eager(path, weight.row_splits)
        if weight.ragged_rank != 1 or not np.array_equal(splits, w_splits):
            raise ValueError(
                f"feature {path!r}: the weights' row_splits differ from the ids' row_splits; "
                "give weights of the same structure as the ids"
            )
        w = _weights(path, weight.values)
        if w.shape != ids.shape:
            raise ValueError(
                f"feature {path!r}: weights has shape {list(w.shape)} but the ids' values have "
                f"shape {list(ids.shape)}; give one weight per id"
            )
    try:
        return Ragged(ids, offsets=_ids(path, value.row_splits, "row_splits"), weights=w)
    except (TypeError, ValueError) as e:
        raise type(e)(f"feature {path!r}: {e}") from None


def _unpack_sparse(tf, path: str, value, weight) -> TFSparse:
    shape = _eager(path, value.dense_shape).astype(np.int64, copy=False)
    if shape.ndim != 1 or len(shape) < 2:
        raise ValueError(
            f"Only rank 2 and above sparse tensor is supported, find rank {len(shape)} sparse "
            f"tensor for input {path}"
        )
    indices = _eager(path, value.indices).astype(np.int64, copy=False)
    ids = _ids(path, value.values, "ids")
    if indices.shape != (len(ids), len(shape)):
        raise ValueError(
            f"feature {path!r}: indices has shape {list(indices.shape)} for {len(ids)} values of "
            f"a rank {len(shape)} SparseTensor"
        )
    outside = (indices < 0) | (indices >= shape)
    if outside.any():
        k = int(np.argmax(outside.any(axis=1)))
        raise ValueError(
            f"feature {path!r}: indices[{k}] = {indices[k].tolist()} is outside the dense_shape "
            f"{shape.tolist()}"
        )
    w = None
    if weight is not None:
        if not isinstance(weight, tf.SparseTensor):
            raise _type_mismatch(path, weight, value)
        w_indices = _eager(path, weight.indices)
        if w_indices.shape != indices.shape or not np.array_equal(w_indices, indices):
            raise ValueError(
                f"feature {path!r}: the weights' indices differ from the ids' indices; give "
                "weights of the same structure as the ids"
            )
        w = _weights(path, weight.values)
    return TFSparse(indices, ids, shape, w)


def gradient_to_numpy(path: str, g) -> np.ndarray:
    """A gradient from ``tape.gradient``: a tf.Tensor or tf.IndexedSlices -> float32 NumPy."""
    tf = _tf()
    t = tf.convert_to_tensor(g)  # IndexedSlices become dense, a Tensor stays itself
    if not (t.dtype.is_floating or t.dtype.is_integer):
        raise TypeError(
            f"found gradient of tf dtype {t.dtype.name} at path {path}; gradients must be numbers"
        )
    return _eager(path, t).astype(np.float32, copy=False)


def to_tf(a: np.ndarray):
    """A constant tf.Tensor holding ``a`` (serving: no gradient needed)."""
    return _tf().convert_to_tensor(a)


class ActivationVariables:
    """One trainable ``tf.Variable`` per feature path; ``value(path, a)`` assigns ``a`` and reads
    it back, so a GradientTape records the read (tapes watch the trainable variables they see
    read). Assigning does not change a value read earlier: reads are snapshots."""

    def __init__(self) -> None:
        self._vars: dict[str, Any] = {}

    def value(self, path: str, a: np.ndarray):
        tf = _tf()
        var = self._vars.get(path)
        if var is None or tuple(var.shape) != a.shape or var.dtype.as_numpy_dtype != a.dtype:
            var = tf.Variable(a, trainable=True, name="embengine_activations")
            self._vars[path] = var
        else:
            var.assign(a)
        return var.read_value()
