"""embengine: train very large embedding tables on CPU, the way the TPU embedding engine does.

The engine owns the tables and each table's optimizer state; it looks rows up and applies each
table's own optimizer straight to the touched rows (no dense gradient ever exists).
"""

from . import initializers, optimizers
from .batch import PreparedBatch
from .config import FeatureConfig, QuantizationConfig, TableConfig
from .engine import EmbeddingEngine, NonFiniteUpdateError
from .inputs import Ragged
from .optimizers import DynamicLearningRate
from .version import __version__

__all__ = [
    "DynamicLearningRate",
    "EmbeddingEngine",
    "FeatureConfig",
    "NonFiniteUpdateError",
    "PreparedBatch",
    "QuantizationConfig",
    "Ragged",
    "TableConfig",
    "__version__",
    "initializers",
    "optimizers",
]
