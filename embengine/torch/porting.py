"""TorchRec's table configs as embengine FeatureConfigs: the names and defaults mapped, so a
TorchRec model's tables pool and start as TorchRec's would (see docs/torchrec.md).

``EmbeddingBagConfig(num_embeddings, embedding_dim, name, feature_names, pooling=SUM,
weight_init_min/max)`` becomes ``TableConfig(vocabulary_size=num_embeddings,
dim=embedding_dim, name=name, combiner=pooling, initializer=RandomUniform(min, max))`` read by
one ``FeatureConfig`` per feature name. Pooling SUM is "sum" (TorchRec's default; embengine's
own default combiner is TF's "mean"), MEAN is "mean"; a table's initial values are uniform in
TorchRec's bounds (``+-sqrt(1 / num_embeddings)`` unless set), though not the same draws.
Duck-typed: torchrec is not imported.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..config import FeatureConfig, TableConfig
from ..initializers import RandomUniform
from ..optimizers import Optimizer

__all__ = ["feature_configs_from_torchrec"]

_POOLING = {"SUM": "sum", "MEAN": "mean"}


def _pooling(cfg) -> str:
    pooling = getattr(cfg, "pooling", "SUM")  # an EmbeddingConfig (no pooling) is refused below
    name = str(getattr(pooling, "value", getattr(pooling, "name", pooling))).upper()
    if name not in _POOLING:
        raise ValueError(
            f"table {cfg.name!r}: pooling {pooling!r} has no embengine combiner; SUM and MEAN "
            "do (a sequence feature is FeatureConfig(max_sequence_length=...))"
        )
    return _POOLING[name]


def feature_configs_from_torchrec(
    tables: Sequence, optimizer: Optimizer | None = None
) -> dict[str, FeatureConfig]:
    """Feature name -> FeatureConfig for TorchRec ``EmbeddingBagConfig``s (or objects with
    their fields), in the order of the tables and their ``feature_names``. ``optimizer``, if
    given, is every table's (else give the engine a global one)."""
    out: dict[str, FeatureConfig] = {}
    for cfg in tables:
        if not getattr(cfg, "feature_names", None):
            raise ValueError(f"table {cfg.name!r} has no feature_names; TorchRec needs them too")
        n = int(cfg.num_embeddings)
        bound = math.sqrt(1 / n) if n > 0 else 0.0
        lo = getattr(cfg, "weight_init_min", None)
        hi = getattr(cfg, "weight_init_max", None)
        table = TableConfig(
            vocabulary_size=n,
            dim=int(cfg.embedding_dim),
            initializer=RandomUniform(-bound if lo is None else lo, bound if hi is None else hi),
            optimizer=optimizer,
            combiner=_pooling(cfg),
            name=cfg.name or None,
        )
        for feature in cfg.feature_names:
            if feature in out:
                raise ValueError(f"feature {feature!r} is in two tables; TorchRec refuses it too")
            out[feature] = FeatureConfig(table)
    return out
