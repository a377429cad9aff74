"""``tf.tpu.experimental.embedding`` TableConfig, FeatureConfig, QuantizationConfig and
RowIdInitializer, with TF's arguments, defaults and checks.

Like TF's, these are plain mutable objects: TPUEmbedding fills in a table's optimizer and name.
"""

from __future__ import annotations

import math

import numpy as np

from .. import initializers
from ..config import COMBINERS, MAX_NDIM, MAX_SEQUENCE_LENGTH, QuantizationConfig
from ..optimizers import Optimizer
from ..optimizers._checks import is_flag, is_integer

__all__ = ["TableConfig", "FeatureConfig", "QuantizationConfig", "RowIdInitializer"]


class RowIdInitializer(initializers.RowId):
    """Row ``r`` is filled with ``r + offset`` (TF's RowIdInitializer); callable TF-style too."""

    def __init__(self, offset: int = 0):
        super().__init__(offset)

    def __call__(self, shape, dtype=np.float32):
        rows = np.arange(shape[0], dtype=np.int64)
        return self.init(0, "", rows, shape[1]).astype(dtype)


def _dtype_name(dtype) -> str:
    """A dtype's name, whatever names it: "float32", np.float32, tf.float32."""
    name = getattr(dtype, "name", None)
    if isinstance(name, str):
        return name
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


class TableConfig:
    """One embedding table (TF's argument order and defaults; TF 2.21's ``dtype`` float32
    only).

    ``initializer`` may be an embengine initializer or any callable ``fn(shape, dtype)``; the
    default is TruncatedNormal(mean=0, stddev=1/sqrt(dim)).
    """

    def __init__(
        self,
        vocabulary_size: int,
        dim: int,
        initializer=None,
        optimizer=None,
        combiner: str = "mean",
        name: str | None = None,
        quantization_config: QuantizationConfig | None = None,
        layout=None,
        dtype=None,
    ):
        if dtype is not None and _dtype_name(dtype) != "float32":
            raise ValueError(
                f"Argument `dtype` must be float32 (the tables here are float32; 16-bit tables "
                f"are embengine.TableConfig(weights_dtype=...)). Received: {dtype}"
            )
        if not is_integer(vocabulary_size) or vocabulary_size < 1:
            raise ValueError(
                "Argument `vocabulary_size` must be an int and must be >= 1. "
                f"Received: {vocabulary_size}"
            )
        if not is_integer(dim) or dim < 1:
            raise ValueError(
                f"Argument `dim` (embedding dimension) must be an int and must be >= 1. "
                f"Received: {dim}"
            )
        if initializer is not None and not (
            callable(initializer) or isinstance(initializer, initializers.Initializer)
        ):
            raise ValueError(
                f"Argument `initializer` must be a callable (or None). Received: {initializer}"
            )
        if combiner not in COMBINERS:
            raise ValueError(
                f"Argument `combiner` must be one of {COMBINERS}. Received: {combiner}"
            )
        if optimizer is not None and not isinstance(optimizer, Optimizer):
            raise ValueError(
                f"{type(optimizer)} is an unsupported optimizer class. Please pass an instance of "
                "one of the optimizer classes under embengine.tpu."
            )
        if layout is not None:
            raise ValueError("Argument `layout` (a SparseCore table layout) is not supported")
        if quantization_config is not None and not isinstance(
            quantization_config, QuantizationConfig
        ):
            raise ValueError(
                f"quantization_config must be a QuantizationConfig, got {quantization_config!r}"
            )
        self.vocabulary_size = int(vocabulary_size)
        self.dim = int(dim)
        self.initializer = initializer
        self.optimizer = optimizer
        self.combiner = combiner
        self.name = name
        self.quantization_config = quantization_config
        self.layout = layout

    def engine_initializer(self) -> initializers.Initializer:
        init = self.initializer
        if init is None:
            return initializers.TruncatedNormal(0.0, 1.0 / math.sqrt(self.dim))
        if isinstance(init, initializers.Initializer):
            return init
        return initializers.FromFunction(init)

    def __repr__(self):
        return (
            f"TableConfig(vocabulary_size={self.vocabulary_size!r}, dim={self.dim!r}, "
            f"initializer={self.initializer!r}, optimizer={self.optimizer!r}, "
            f"combiner={self.combiner!r}, name={self.name!r}, "
            f"quantization_config={self.quantization_config!r})"
        )


class FeatureConfig:
    """One input feature (TF's arguments): ``output_shape`` is the activation shape without the
    table dim; see TPUEmbedding for how input shapes map to outputs."""

    def __init__(
        self,
        table: TableConfig,
        max_sequence_length: int = 0,
        validate_weights_and_indices: bool = True,
        output_shape=None,
        name: str | None = None,
    ):
        if not isinstance(table, TableConfig):
            raise ValueError(
                f"Argument `table` has invalid type {type(table)}. Expected "
                "`embengine.tpu.TableConfig`."
            )
        if not is_integer(max_sequence_length) or max_sequence_length < 0:
            raise ValueError(
                "Argument `max_sequence_length` must be an int and must be >= 0. "
                f"Received: {max_sequence_length}"
            )
        if max_sequence_length > MAX_SEQUENCE_LENGTH:
            raise ValueError(
                f"Argument `max_sequence_length` must be at most {MAX_SEQUENCE_LENGTH} (every "
                "lookup pads each sample to it), set it to the longest sequence the model reads. "
                f"Received: {max_sequence_length} (feature {name!r}, table {table.name!r})"
            )
        if not is_flag(validate_weights_and_indices):
            raise ValueError(
                "Argument `validate_weights_and_indices` must be a boolean. "
                f"Received: {validate_weights_and_indices}"
            )
        if output_shape is not None:
            given = output_shape
            try:
                output_shape = [int(s) for s in given]
            except (TypeError, ValueError):
                output_shape = None
            if not output_shape or any(s < 0 for s in output_shape):
                raise ValueError(
                    f"Argument `output_shape` must be a non-empty list of sizes >= 0 (known "
                    "sizes: embengine infers none of them; leave output_shape=None for the "
                    f"input's shape). Received: {given}"
                )
            if len(output_shape) >= MAX_NDIM:  # the activation adds dim: NumPy's limit
                raise ValueError(
                    f"Argument `output_shape` must have at most {MAX_NDIM - 1} sizes (the "
                    f"activation [*output_shape, dim] is a NumPy array). Received "
                    f"{len(output_shape)} sizes"
                )
        self.table = table
        self.max_sequence_length = int(max_sequence_length)
        self.validate_weights_and_indices = bool(validate_weights_and_indices)
        self.output_shape = output_shape
        self.name = name

    def __repr__(self):
        return (
            f"FeatureConfig(table={self.table!r}, max_sequence_length="
            f"{self.max_sequence_length!r}, validate_weights_and_indices="
            f"{self.validate_weights_and_indices!r}, output_shape={self.output_shape!r}, "
            f"name={self.name!r})"
        )
