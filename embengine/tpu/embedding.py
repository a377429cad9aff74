"""``TPUEmbedding`` and ``TPUEmbeddingForServing`` on top of EmbeddingEngine.

TF's shape rules are applied here, so the engine only sees bag features:

- a dense array ``[B]`` or ``[..., 1]``: one id per output position (weights not allowed);
  the activation is ``[B, dim]`` or ``[..., dim]``;
- a ragged input (``embengine.Ragged``, a list of lists) with B samples: combined into ``[B, dim]``;
  as a sequence ``[B, S, dim]`` when ``max_sequence_length = S > 0`` (ids past S dropped, missing
  positions zero); ``FeatureConfig.output_shape`` with product P: P == B combines then reshapes,
  P = k * B makes a sequence of length k, reshaped to output_shape.

A sequence position is a bag of at most one id, so the engine's combiners give exactly the row.
2-D NumPy arrays are dense inputs here (their last dim must be 1, as in TF); pass ``Ragged`` for
variable-length samples.

TensorFlow inputs (``tf.Tensor``, ``tf.RaggedTensor``, ``tf.SparseTensor``; see ``tf_interop``)
follow the same rules; a SparseTensor of rank R gives a bag per index of its first R - 1 dims
(activation ``[*dense_shape[:-1], dim]``), and as a sequence (rank 2 only) its column is the
position. When any input of a call is a TF object, the activations come back as ``tf.Tensor``.
"""

from __future__ import annotations

import contextlib
import logging
import math

import numpy as np

from .. import config as ee_config
from ..engine import EmbeddingEngine
from ..inputs import Ragged, as_numpy, check_values, to_ragged
from ..optimizers import SGD, Optimizer
from ..optimizers._checks import is_flag
from .config import FeatureConfig, TableConfig
from .nest import flatten_like, flatten_with_paths, pack_like
from .tf_interop import ActivationVariables, TFSparse, gradient_to_numpy, is_tf, to_tf, unpack

__all__ = ["TPUEmbedding", "TPUEmbeddingForServing"]

log = logging.getLogger("embengine.tpu")


def _is_feature(x) -> bool:
    return isinstance(x, FeatureConfig)


def _is_dense(x) -> bool:
    return not isinstance(x, Ragged | list | tuple) and as_numpy(x).dtype.kind in "iu"


def _check_dense_ids(ids: np.ndarray, vocabulary_size: int) -> None:
    """Range-check dense ids, naming the bad one by its index in the input's shape."""
    if ids.size and (ids.min() < 0 or ids.max() >= vocabulary_size):
        bad = (ids < 0) | (ids >= vocabulary_size)
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"id {int(ids[where])} at {list(where)} is out of range [0, {vocabulary_size})"
        )


@contextlib.contextmanager
def _naming(path: str):
    """Prefix a TypeError / ValueError from the engine's input helpers with the feature's path
    (TF's own messages below name it already)."""
    try:
        yield
    except (TypeError, ValueError) as e:
        cls = TypeError if isinstance(e, TypeError) else ValueError
        raise cls(f"feature {path!r}: {e}") from None


def _check_sparse_ids(sp: TFSparse, vocabulary_size: int) -> None:
    """Range-check a SparseTensor's ids, naming the bad one by its index in the dense shape."""
    ids = sp.values
    if ids.size and (ids.min() < 0 or ids.max() >= vocabulary_size):
        k = int(np.argmax((ids < 0) | (ids >= vocabulary_size)))
        raise ValueError(
            f"id {int(ids[k])} at {sp.indices[k].tolist()} (values[{k}]) is out of range "
            f"[0, {vocabulary_size})"
        )


def _sparse_bags(path: str, sp: TFSparse, seq: int) -> Ragged:
    """A SparseTensor's entries as bags: one per index of the leading dims, or with ``seq`` one
    per ``(row, column < seq)`` position (columns past ``seq`` dropped, missing ones empty).
    Entries are put in bag order only if they are not already (TF's canonical order is)."""
    lead = sp.dense_shape[:-1]
    num_bags = int(np.prod(lead))
    if len(lead) == 1:
        bag = sp.indices[:, 0]
    else:
        bag = np.ravel_multi_index(tuple(sp.indices[:, :-1].T), tuple(int(d) for d in lead))
    ids, weights, where = sp.values, sp.weights, sp.indices
    if seq:
        col = sp.indices[:, -1]
        keep = col < seq
        bag, ids, where = bag[keep] * seq + col[keep], ids[keep], where[keep]
        num_bags *= seq
    if bag.size > 1 and (bag[1:] < bag[:-1]).any():
        order = np.argsort(bag, kind="stable")
        bag, ids, where = bag[order], ids[order], where[order]
        weights = None if weights is None else weights[order]
    if seq and bag.size > 1:
        twice = bag[1:] == bag[:-1]
        if twice.any():
            k = int(np.argmax(twice)) + 1
            raise ValueError(
                f"feature {path!r}: two ids at index {where[k].tolist()}; a sequence holds one "
                "id per position"
            )
    return Ragged(ids, lengths=np.bincount(bag, minlength=num_bags), weights=weights)


def _sequence_bags(r: Ragged, seq: int) -> Ragged:
    """Positions ``(b, p < seq)`` as ``B * seq`` bags of at most one id (truncate, pad)."""
    lengths = r.lengths
    keep_pos = np.arange(len(r.ids)) - np.repeat(r.offsets[:-1], lengths) < seq
    filled = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
    return Ragged(r.ids[keep_pos], lengths=filled.reshape(-1))


def _layout(path: str, feature: FeatureConfig, lead: tuple[int, ...]):
    """(sequence length or 0, activation shape without dim) of a ragged or sparse input whose
    bags have shape ``lead`` (``(B,)`` for a ragged input): TF's output_shape and
    max_sequence_length rules (a sequence only for a single leading dim, as in TF)."""
    n = math.prod(lead)
    if feature.output_shape:
        total = math.prod(feature.output_shape)
        if total == n:
            return 0, tuple(feature.output_shape)
        if total > n and n > 0 and total % n == 0:
            return total // n, tuple(feature.output_shape)
        raise ValueError(
            "Output shape set in the FeatureConfig should be the factor of the input data "
            f"batch size. But instead got output shape {feature.output_shape}, input data "
            f"batch size {n} for input {path}"
        )
    if feature.max_sequence_length > 0 and len(lead) == 1:
        return feature.max_sequence_length, (n, feature.max_sequence_length)
    return 0, lead


class _EmbeddingBase:
    """Feature flattening, table naming and engine construction shared by both classes."""

    def __init__(self, feature_config, optimizer, *, seed: int, backend: str):
        self._feature_config = feature_config
        flat = flatten_with_paths(feature_config, _is_feature)
        if not flat:
            raise ValueError("feature_config holds no FeatureConfig")
        self._paths = [p for p, _ in flat]
        self._features = [f for _, f in flat]
        self._tables: list[TableConfig] = []
        for f in self._features:
            if not any(f.table is t for t in self._tables):
                self._tables.append(f.table)
        if optimizer is not None and not isinstance(optimizer, Optimizer):
            raise ValueError(
                f"{type(optimizer)} is an unsupported optimizer class. Please pass an instance of "
                "one of the optimizer classes under embengine.tpu."
            )
        self._optimizer = optimizer
        names = set()
        for i, table in enumerate(self._tables):
            if table.optimizer is None:
                table.optimizer = optimizer  # TF fills the global optimizer into the table
            if table.name is None:
                table.name = f"table_{i}"
            if table.name in names:
                raise ValueError(
                    f"Tables must have a unique name. Multiple tables with name {table.name} found."
                )
            names.add(table.name)
        self._seed = seed
        self._backend = backend
        self._engine: EmbeddingEngine | None = None
        self._output_shapes: list[tuple[int, ...] | None] = [
            tuple(f.output_shape) if f.output_shape else None for f in self._features
        ]

    def _maybe_build(self) -> EmbeddingEngine:
        if self._engine is None:
            engine_tables = {}
            for t in self._tables:
                engine_tables[id(t)] = ee_config.TableConfig(
                    t.vocabulary_size,
                    t.dim,
                    initializer=t.engine_initializer(),
                    optimizer=t.optimizer if t.optimizer is not None else self._lookup_only_sgd(t),
                    combiner=t.combiner,
                    name=t.name,
                    quantization_config=t.quantization_config,
                )
            features = {
                path: ee_config.FeatureConfig(
                    engine_tables[id(f.table)],
                    validate_weights_and_indices=f.validate_weights_and_indices,
                )
                for path, f in zip(self._paths, self._features, strict=True)
            }
            self._engine = EmbeddingEngine(features, seed=self._seed, backend=self._backend)
        return self._engine

    def _lookup_only_sgd(self, table: TableConfig) -> Optimizer:
        raise ValueError(
            f"{type(None)} is an unsupported optimizer class. Please pass an instance of one of "
            f"the optimizer classes under embengine.tpu (table {table.name!r} has none)."
        )

    @property
    def engine(self) -> EmbeddingEngine:
        """The EmbeddingEngine behind this object (checkpoints, slots, step)."""
        return self._maybe_build()

    @property
    def embedding_tables(self) -> dict[TableConfig, np.ndarray]:
        """TableConfig -> live weights ``[vocabulary_size, dim]``."""
        tables = self._maybe_build().embedding_tables
        return {t: tables[t.name] for t in self._tables}

    def _convert(self, path: str, feature: FeatureConfig, value, weight, serving: bool):
        """One feature's input -> (engine Ragged, activation shape without dim)."""
        if is_tf(value) or is_tf(weight):
            value, weight = unpack(path, value, weight)
        if isinstance(value, TFSparse):
            return self._convert_sparse(path, feature, value, serving)
        with _naming(path):
            dense = _is_dense(value)
        if dense:
            ids = as_numpy(value)
            if weight is not None:
                if serving:
                    raise ValueError(f"Weight specified for {path}, but input is dense.")
                raise ValueError(
                    f"Weight specified for dense input {path}, which is not allowed. Weight will "
                    "always be 1 in this case."
                )
            if ids.ndim < 1:
                raise ValueError(
                    f"Only rank 1 and above dense tensor is supported, find rank {ids.ndim} "
                    f"sparse tensor for input {path}"
                )
            if serving:
                if feature.max_sequence_length > 0:
                    raise ValueError(
                        f"Feature {path} is a sequence feature but a dense tensor was passed."
                    )
                shape = ids.shape
            elif ids.ndim == 1:
                shape = ids.shape
            else:
                if ids.shape[-1] != 1:
                    raise ValueError(
                        "Rank 2 or above dense tensor should have last dimension as 1 as the last "
                        f"dimension will always be reduced. Instead got dense tensor as shape "
                        f"{list(ids.shape)} for input {path}"
                    )
                shape = ids.shape[:-1]
            flat = ids.reshape(-1)
            with _naming(path):
                r = Ragged(flat, offsets=np.arange(len(flat) + 1))
                # Here, not in the engine: its message would give the flat index as the sample.
                _check_dense_ids(ids, feature.table.vocabulary_size)
            return r, tuple(int(s) for s in shape)
        with _naming(path):
            r = to_ragged(value, weight)
        seq, shape = _layout(path, feature, (r.num_samples,))
        if seq:
            if r.weights is not None:
                raise ValueError(f"Weight specified for {path}, but this is a sequence feature.")
            # Checked before the positions become bags: the engine would name bag b * seq + p.
            with _naming(path):
                check_values(r, feature.table.vocabulary_size, check_weights=False)
            r = _sequence_bags(r, seq)
        return r, shape

    def _convert_sparse(self, path: str, feature: FeatureConfig, sp: TFSparse, serving: bool):
        """A SparseTensor -> (engine Ragged, activation shape without dim)."""
        lead = tuple(int(d) for d in sp.dense_shape[:-1])
        if (
            serving
            and sp.weights is not None
            and (feature.validate_weights_and_indices or len(lead) > 1)
            and feature.table.combiner != "sum"
        ):
            # TF's serving lookup is safe_embedding_lookup_sparse here, which drops the entries
            # of weight <= 0 unless the combiner is "sum" (a non-finite weight is left to the
            # engine's check, an error).
            keep = ~(sp.weights <= 0)
            if not keep.all():
                sp = TFSparse(sp.indices[keep], sp.values[keep], sp.dense_shape, sp.weights[keep])
        if len(lead) > 1 and feature.max_sequence_length > 0 and not feature.output_shape:
            log.warning(
                "Input tensor is rank %d which is above 2, the max_sequence_length setting will "
                "be ignored.",
                len(lead) + 1,
            )
        seq, shape = _layout(path, feature, lead)
        if seq and sp.weights is not None:
            raise ValueError(f"Weight specified for {path}, but this is a sequence feature.")
        with _naming(path):
            _check_sparse_ids(sp, feature.table.vocabulary_size)
        return _sparse_bags(path, sp, seq), shape

    def _lookup(self, features, weights, serving: bool, *, training: bool):
        engine = self._maybe_build()
        flat_in = flatten_like(self._feature_config, features, _is_feature, "features")
        if weights is not None:
            flat_w = flatten_like(self._feature_config, weights, _is_feature, "weights")
        else:
            flat_w = [None] * len(flat_in)
        engine_features, shapes = {}, []
        for i, (path, feature) in enumerate(zip(self._paths, self._features, strict=True)):
            r, shape = self._convert(path, feature, flat_in[i], flat_w[i], serving)
            engine_features[path] = r
            shapes.append(shape)
        acts = engine.lookup(engine_features, training=training)
        as_tf = any(is_tf(x) for x in flat_in) or any(is_tf(w) for w in flat_w)
        return acts, shapes, as_tf


def _is_array(x) -> bool:
    return (
        isinstance(x, np.ndarray | np.generic) or type(x).__module__.startswith("torch") or is_tf(x)
    )


class TPUEmbedding(_EmbeddingBase):
    """``tf.tpu.experimental.embedding.TPUEmbedding`` on the CPU: enqueue -> dequeue ->
    apply_gradients, one fused optimizer step per touched row.

    Args:
      feature_config: a FeatureConfig or a nested dict / list / tuple of them; outputs and
        gradients keep this structure (dict keys in sorted order, as tf.nest).
      optimizer: the global optimizer, for tables that name none.
      pipeline_execution_with_tensor_core: a bool, accepted for TF compatibility. On a TPU,
        True overlaps the embedding with the TensorCore, so lookups see tables one step old;
        here every lookup sees the previous step's update (TF's False), and True says so
        with a warning.
      seed, backend: passed to the EmbeddingEngine.
    """

    def __init__(
        self,
        feature_config,
        optimizer,
        pipeline_execution_with_tensor_core=False,
        *,
        seed: int = 0,
        backend: str = "numba",
    ):
        if not is_flag(pipeline_execution_with_tensor_core):
            raise ValueError(
                "Argument `pipeline_execution_with_tensor_core` must be a boolean. "
                f"Received: {pipeline_execution_with_tensor_core!r}"
            )
        super().__init__(feature_config, optimizer, seed=seed, backend=backend)
        for table in self._tables:
            if table.optimizer is None:
                self._lookup_only_sgd(table)  # raises TF's error: training needs an optimizer
        if pipeline_execution_with_tensor_core:
            log.warning(
                "pipeline_execution_with_tensor_core=True is ignored: on a TPU it makes lookups "
                "see tables one step old; embengine always looks up the tables as the last "
                "apply_gradients left them (pipeline_execution_with_tensor_core=False)"
            )
        self._activations = None
        self._training = True
        self._as_tf = False
        self._tf_activations: ActivationVariables | None = None

    def build(self, per_replica_input_shapes=None, per_replica_batch_size=None):
        """Create the tables. Shapes given here fix the activation shapes, as in TF."""
        self._maybe_build()
        if per_replica_input_shapes is None and per_replica_batch_size is None:
            return
        if per_replica_input_shapes is None or isinstance(per_replica_input_shapes, int):
            size = per_replica_batch_size or per_replica_input_shapes
            shapes = [
                (size, f.max_sequence_length) if f.max_sequence_length else (size,)
                for f in self._features
            ]
        else:
            flat = flatten_with_paths(
                per_replica_input_shapes,
                lambda x: (
                    (isinstance(x, list | tuple) and all(isinstance(e, int) for e in x))
                    or (is_tf(x) and hasattr(x, "as_list"))
                ),  # a tf.TensorShape
            )
            if len(flat) != len(self._features):
                raise ValueError(
                    f"per_replica_input_shapes has {len(flat)} shapes for "
                    f"{len(self._features)} features"
                )
            shapes = []
            for (_, shape), f in zip(flat, self._features, strict=True):
                shape = list(shape.as_list() if hasattr(shape, "as_list") else shape)
                if len(shape) < 1:
                    raise ValueError(
                        f"Received input tensor of shape {shape}. Rank must be 1 and above"
                    )
                if len(shape) == 2 and shape[-1] != 1 and f.max_sequence_length > 0:
                    shape.insert(1, f.max_sequence_length)
                shapes.append(tuple(shape) if len(shape) == 1 else tuple(shape[:-1]))
        for i, shape in enumerate(shapes):
            if self._output_shapes[i] is None:
                self._output_shapes[i] = shape

    def enqueue(self, features, weights=None, training: bool = True, name=None, device=None):
        """Look the features up now; ``dequeue`` returns the activations."""
        acts, shapes, as_tf = self._lookup(features, weights, serving=False, training=training)
        for i, (path, shape) in enumerate(zip(self._paths, shapes, strict=True)):
            old = self._output_shapes[i]
            if old is not None and tuple(old) != tuple(shape):
                raise ValueError(
                    f"Inconsistent shape founded for input feature {path}, Output shape is set to "
                    f"be {list(old)}, But got incoming output shape {list(shape)}"
                )
            self._output_shapes[i] = tuple(shape)
        self._activations = [
            acts[path].reshape(*shape, f.table.dim)
            for path, shape, f in zip(self._paths, shapes, self._features, strict=True)
        ]
        self._training = training
        self._as_tf = as_tf

    def dequeue(self, name=None):
        """The activations of the last enqueue, in the structure of the feature config: NumPy
        arrays, or ``tf.Tensor`` if any input of that enqueue was a TF object (each the value of
        a trainable variable, so a ``tf.GradientTape`` open around ``dequeue`` records it:
        ``tape.gradient(loss, activations)`` gives what ``apply_gradients`` takes)."""
        if self._activations is None:
            raise RuntimeError("dequeue called before enqueue: there are no activations to return")
        flat = self._activations
        if self._as_tf:
            if self._tf_activations is None:
                self._tf_activations = ActivationVariables()
            flat = [
                self._tf_activations.value(p, a) for p, a in zip(self._paths, flat, strict=True)
            ]
        return pack_like(self._feature_config, flat, _is_feature)

    def apply_gradients(self, gradients, name=None):
        """One optimizer step from the gradients of the dequeued activations. A None gradient
        means zeros (with a warning), as in TF."""
        if self._activations is None:
            raise RuntimeError("apply_gradients called before enqueue")
        if not self._training:
            raise RuntimeError(
                "apply_gradients after enqueue(training=False): that batch was for inference"
            )
        flat = flatten_like(self._feature_config, gradients, _is_feature, "gradients")
        grads = {}
        for g, path, act in zip(flat, self._paths, self._activations, strict=True):
            if g is None:
                log.warning(
                    "No gradient passed for feature %s, sending zero gradient. This may not be "
                    "correct behavior for certain optimizers like Adam.",
                    path,
                )
                g = np.zeros_like(act)
            elif not _is_array(g):
                raise ValueError(f"found non-tensor type: {type(g)} at path {path}.")
            g = gradient_to_numpy(path, g) if is_tf(g) else as_numpy(g)
            if tuple(g.shape) != act.shape:
                raise ValueError(
                    f"Found gradient of shape {list(g.shape)} at path {path}. Expected shape "
                    f"{list(act.shape)}."
                )
            grads[path] = g.reshape(-1, act.shape[-1])
        self._maybe_build().apply_gradients(grads)
        self._activations = None


class TPUEmbeddingForServing(_EmbeddingBase):
    """Lookup only (``tf.tpu.experimental.embedding.TPUEmbeddingForServing``): ``layer(features,
    weights)`` returns activations with TF's CPU serving shapes (a dense input of shape S gives
    ``[*S, dim]``)."""

    def __init__(self, feature_config, optimizer=None, *, seed: int = 0, backend: str = "numba"):
        super().__init__(feature_config, optimizer, seed=seed, backend=backend)

    def _lookup_only_sgd(self, table):
        # Serving never updates; the engine still wants an optimizer spec per table.
        return SGD(0.0)

    def build(self) -> None:
        """Create the tables (TF's ``build``); the first lookup does it too. Idempotent."""
        self._maybe_build()

    def embedding_lookup(self, features, weights=None):
        """Look ``features`` up (no update): activations in the structure of the feature
        config, ``tf.Tensor`` if any input was a TF object, else NumPy arrays."""
        acts, shapes, as_tf = self._lookup(features, weights, serving=True, training=False)
        flat = [
            acts[path].reshape(*shape, f.table.dim)
            for path, shape, f in zip(self._paths, shapes, self._features, strict=True)
        ]
        if as_tf:
            flat = [to_tf(a) for a in flat]
        return pack_like(self._feature_config, flat, _is_feature)

    def __call__(self, features, weights=None):
        """``embedding_lookup(features, weights)``, as TF's layer call."""
        return self.embedding_lookup(features, weights)
