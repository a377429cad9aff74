"""EmbeddingLayer: the engine as a torch ``nn.Module`` whose backward applies the fused update.

The tables are not torch Parameters (a dense torch optimizer never sees them): the layer's
outputs require grad, and their backward hands the activation gradients to
``engine.apply_gradients``, as TorchRec/FBGEMM's "optimizer in backward" does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from ..batch import PreparedBatch
from ..engine import EmbeddingEngine
from ..keyed_jagged import is_keyed_jagged, keyed_jagged_to_features

__all__ = ["EmbeddingLayer"]


class _Pending:
    """One forward's batch, waiting for its backward (which must update at most once)."""

    __slots__ = ("engine", "batch", "names", "learning_rates", "applied")

    def __init__(self, engine, batch, names, learning_rates):
        self.engine = engine
        self.batch = batch
        self.names = names
        self.learning_rates = learning_rates
        self.applied = False


class _FusedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, pending, *activations):
        ctx.pending = pending
        # New tensors sharing memory: the outputs of this node, not its inputs.
        return tuple(a.view_as(a) for a in activations)

    @staticmethod
    def backward(ctx, *grads):
        pending: _Pending = ctx.pending
        if pending.applied:
            # backward(retain_graph=True) called again: the step's update happened already.
            return (None, None) + (None,) * len(grads)
        shapes = {n: lay.shape for n, lay in pending.batch.features.items()}
        gradients = {}
        for name, g in zip(pending.names, grads, strict=True):
            if g is None:
                gradients[name] = np.zeros(shapes[name], dtype=np.float32)
            else:
                gradients[name] = g.detach().to(torch.float32).contiguous().numpy()
        pending.engine.apply_gradients(
            gradients, learning_rates=pending.learning_rates, batch=pending.batch
        )
        pending.applied = True
        return (None, None) + (None,) * len(grads)


class EmbeddingLayer(torch.nn.Module):
    """Looks features up in an EmbeddingEngine; backward applies one fused update per step.

    ``forward(features, weights=None, learning_rates=None)`` takes a dict of feature name ->
    ids (torch tensors, NumPy arrays, ``Ragged``, lists of lists), a ``KeyedJagged`` (or
    TorchRec's KeyedJaggedTensor), or a ``PreparedBatch`` from ``layer.preprocess`` (e.g. built
    in a DataLoader worker). It returns a dict of float32 tensors. In training mode with grad
    enabled they require grad; their backward updates every touched row once, whatever the
    number of branches they feed; calling backward again on the same graph does nothing.
    ``learning_rates`` (one per dynamic learning-rate tag) is used by that update. In eval mode
    or under ``torch.no_grad()`` the lookup never updates anything and skips the deduplication
    (a lookup-only batch); a batch from ``preprocess(..., training=False)`` is refused in
    training mode.
    """

    def __init__(self, engine: EmbeddingEngine):
        super().__init__()
        if not isinstance(engine, EmbeddingEngine):
            raise TypeError(f"EmbeddingLayer needs an EmbeddingEngine, got {type(engine)}")
        self.engine = engine

    def preprocess(
        self, features, weights: Mapping | None = None, *, training: bool = True
    ) -> PreparedBatch:
        """Validate and deduplicate a batch without touching the tables (DataLoader-safe);
        ``training=False`` builds a cheaper lookup-only batch (see EmbeddingEngine.preprocess)."""
        return self.engine.preprocess(self._feature_dict(features), weights, training=training)

    def preprocessor(self):
        """The engine's ``Preprocessor`` (``engine.preprocessor()``): ``preprocess`` for
        DataLoader workers, small to pickle (no tables), fork-safe; it takes KeyedJagged too."""
        return self.engine.preprocessor()

    @staticmethod
    def _feature_dict(features):
        if is_keyed_jagged(features):
            return keyed_jagged_to_features(features)
        return features

    def forward(
        self,
        features,
        weights: Mapping | None = None,
        learning_rates: Sequence[float] | None = None,
    ) -> dict[str, torch.Tensor]:
        training = self.training and torch.is_grad_enabled()
        if isinstance(features, PreparedBatch):
            if weights is not None:
                raise ValueError("weights must be given to preprocess(), not with a PreparedBatch")
            if training and not features.deduplicated:
                raise ValueError(
                    "this PreparedBatch was built with training=False and cannot be trained on; "
                    "build it with layer.preprocess(features)"
                )
        else:
            # Features straight to the engine: a training lookup then deduplicates and pools in
            # one parallel region (see EmbeddingEngine.lookup).
            features = self._feature_dict(features)
        # The batch comes back with the activations: the engine's pending batch, read
        # afterwards, could be another thread's.
        acts, batch = self.engine.lookup_with_batch(features, weights, training=training)
        names = list(acts)
        tensors = [torch.from_numpy(acts[n]) for n in names]
        if not training:
            return dict(zip(names, tensors, strict=True))
        anchor = torch.empty(0, requires_grad=True)  # makes the outputs part of the graph
        pending = _Pending(self.engine, batch, names, learning_rates)
        outputs = _FusedLookup.apply(anchor, pending, *tensors)
        return dict(zip(names, outputs, strict=True))

    def extra_repr(self) -> str:
        tables = ", ".join(
            f"{n}: {c.vocabulary_size}x{c.dim}" for n, c in self.engine.table_configs.items()
        )
        return f"tables=[{tables}], backend={self.engine.backend!r}"
