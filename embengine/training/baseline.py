"""The comparison points: the same embeddings as torch ``nn.EmbeddingBag`` tables, initialised
with the engine's values.

- ``embeddings="torch"``: ``nn.EmbeddingBag(sparse=True)`` tables trained by the torch optimizer
  that stands in for the engine's (TORCH_OPTIMIZERS): the same update, to compare speed.
- ``embeddings="plain"``: the plain torch DLRM, the way it is usually written: dense-gradient
  ``nn.EmbeddingBag`` tables trained with the dense layers by one ``torch.optim.Adam`` (the
  ``--dense-lr``). ``embengine train --baseline`` trains it after the engine's run, on the same
  data, and prints both.
"""

from __future__ import annotations

import numpy as np
import torch

from ..data.dataset import FeatureSpec
from ..initializers import TruncatedNormal
from ..inputs import Ragged

__all__ = ["TorchEmbeddings", "TORCH_OPTIMIZERS"]

# Sparse-capable torch optimizers, by the embengine optimizer name they stand in for.
TORCH_OPTIMIZERS = {
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr),
    "adagrad": lambda params, lr: torch.optim.Adagrad(
        params, lr=lr, initial_accumulator_value=0.1, eps=1e-10
    ),
    "adam": lambda params, lr: torch.optim.SparseAdam(params, lr=lr),
}


class TorchEmbeddings(torch.nn.Module):
    """One EmbeddingBag per feature; sqrtn bags are sums with per-id weights 1/sqrt(n)."""

    def __init__(self, features: list[FeatureSpec], dim: int, seed: int, sparse: bool = True):
        super().__init__()
        self.specs = {f.name: f for f in features}
        self.bags = torch.nn.ModuleDict()
        init = TruncatedNormal()
        for f in features:
            mode = "mean" if f.combiner == "mean" else "sum"
            bag = torch.nn.EmbeddingBag(f.vocabulary_size, dim, mode=mode, sparse=sparse)
            values = init.init(seed, f.name, np.arange(f.vocabulary_size), dim)
            with torch.no_grad():
                bag.weight.copy_(torch.from_numpy(values))
            self.bags[f.name] = bag

    def forward(self, sparse: dict[str, Ragged]) -> dict[str, torch.Tensor]:
        out = {}
        for name, r in sparse.items():
            # Copies: a Ragged's arrays are read-only, which torch.from_numpy warns about.
            ids = torch.from_numpy(r.ids.copy())
            offsets = torch.from_numpy(r.offsets[:-1].copy())
            weights = None
            if self.specs[name].combiner == "sqrtn":
                lengths = np.maximum(r.lengths, 1).astype(np.float32)
                weights = torch.from_numpy(np.repeat(1.0 / np.sqrt(lengths), r.lengths))
            out[name] = self.bags[name](ids, offsets, per_sample_weights=weights)
        return out
