"""Dense parts of click models; their embeddings come from an EmbeddingLayer (or torch).

Every model maps ``(embeddings: dict[name, Tensor[B, d]], dense: Tensor[B, n_dense])`` to
logits ``[B]``.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["DLRM", "FM", "MODELS", "embedding_dim"]


def _mlp(sizes: list[int], last_activation: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or last_activation:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """DLRM (Naumov et al. 2019): a bottom MLP turns the dense features into one more vector of
    width d; all pairwise dot products of the vectors, with the bottom output, feed a top MLP.

    With ``first_order`` the top MLP also sees every embedding itself (concatenated), not only
    their dot products: a feature's own effect (an item's popularity, a user's mean rating) then
    needs no partner vector to pass through.
    """

    def __init__(
        self,
        feature_names: list[str],
        dim: int,
        n_dense: int,
        bottom: tuple[int, ...] = (64,),
        top: tuple[int, ...] = (64, 32),
        first_order: bool = True,
    ):
        super().__init__()
        self.names = list(feature_names)
        self.first_order = first_order
        self.bottom = _mlp([n_dense, *bottom, dim], last_activation=True) if n_dense else None
        n_vectors = len(self.names) + (1 if n_dense else 0)
        n_pairs = n_vectors * (n_vectors - 1) // 2
        width = n_pairs + (dim if n_dense else 0) + (dim * len(self.names) if first_order else 0)
        self.top = _mlp([width, *top, 1], last_activation=False)
        rows, cols = torch.triu_indices(n_vectors, n_vectors, offset=1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)

    def forward(self, embeddings: dict[str, torch.Tensor], dense: torch.Tensor) -> torch.Tensor:
        vectors = [embeddings[n] for n in self.names]
        parts = []
        if self.bottom is not None:
            x = self.bottom(dense)
            vectors.append(x)
            parts.append(x)
        if self.first_order:
            parts.extend(embeddings[n] for n in self.names)
        z = torch.stack(vectors, dim=1)  # [B, F, d]
        dots = torch.bmm(z, z.transpose(1, 2))[:, self.rows, self.cols]
        parts.append(dots)
        return self.top(torch.cat(parts, dim=1)).squeeze(1)


class FM(nn.Module):
    """Factorization machine (Rendle 2010). Each feature's embedding has width k + 1: the first
    k columns are its factor v, the last its linear weight w::

        logit = b + dense @ u + sum_f w_f + 1/2 * sum_j ((sum_f v_fj)^2 - sum_f v_fj^2)
    """

    def __init__(self, feature_names: list[str], dim: int, n_dense: int):
        super().__init__()
        self.names = list(feature_names)
        self.linear = nn.Linear(n_dense, 1) if n_dense else None
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, embeddings: dict[str, torch.Tensor], dense: torch.Tensor) -> torch.Tensor:
        e = torch.stack([embeddings[n] for n in self.names], dim=1)  # [B, F, k + 1]
        v, w = e[..., :-1], e[..., -1]
        pairwise = 0.5 * (v.sum(1).pow(2) - v.pow(2).sum(1)).sum(1)
        logit = self.bias + w.sum(1) + pairwise
        if self.linear is not None:
            logit = logit + self.linear(dense).squeeze(1)
        return logit


MODELS = {"dlrm": DLRM, "fm": FM}


def embedding_dim(model: str, dim: int) -> int:
    """Table width a model needs for factor size ``dim`` (FM adds its linear weight)."""
    return dim + 1 if model == "fm" else dim
