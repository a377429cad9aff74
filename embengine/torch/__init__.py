"""PyTorch integration: ``EmbeddingLayer`` (an nn.Module over an EmbeddingEngine),
``KeyedJagged`` inputs, ``KeyedTensor`` outputs and the ``LearningRateHandle`` that torch's
learning-rate schedulers drive. Needs the ``torch`` extra. See docs/torchrec.md."""

from .keyed_jagged import KeyedJagged
from .keyed_tensor import KeyedTensor
from .layer import EmbeddingLayer
from .lr_handle import LearningRateHandle
from .porting import feature_configs_from_torchrec

__all__ = [
    "EmbeddingLayer",
    "KeyedJagged",
    "KeyedTensor",
    "LearningRateHandle",
    "feature_configs_from_torchrec",
]
