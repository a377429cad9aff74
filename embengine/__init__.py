"""embengine: train very large embedding tables on CPU, the way the TPU embedding engine does.

The engine owns the tables and each table's optimizer state; it looks rows up and applies each
table's own optimizer straight to the touched rows (no dense gradient ever exists).

``embengine.torch`` (EmbeddingLayer, KeyedJagged) needs PyTorch; it is imported on first use,
so ``import embengine`` works, and stays light, without it.
"""

from . import initializers, optimizers
from .batch import PreparedBatch
from .config import Compressor, DynamicVocabulary, FeatureConfig, QuantizationConfig, TableConfig
from .engine import EmbeddingEngine, NonFiniteGradientError, NonFiniteUpdateError
from .inputs import Ragged
from .optimizers import DynamicLearningRate
from .version import __version__

__all__ = [
    "DynamicLearningRate",
    "Compressor",
    "DynamicVocabulary",
    "EmbeddingEngine",
    "FeatureConfig",
    "NonFiniteGradientError",
    "NonFiniteUpdateError",
    "PreparedBatch",
    "QuantizationConfig",
    "SpinningThreadsWarning",
    "Ragged",
    "TableConfig",
    "__version__",
    "initializers",
    "optimizers",
]


def __getattr__(name: str):
    """``embengine.torch`` on first use (PEP 562): importing embengine never imports torch; nor
    numba for ``SpinningThreadsWarning`` (``embengine.kernels.tasks``)."""
    if name == "SpinningThreadsWarning":
        from .kernels.tasks import SpinningThreadsWarning

        return SpinningThreadsWarning
    if name == "torch":
        import importlib

        try:
            import torch  # noqa: F401
        except ImportError as e:
            raise ImportError(
                "embengine.torch needs PyTorch, which is not installed: "
                "pip install 'embengine[torch]'"
            ) from e
        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
