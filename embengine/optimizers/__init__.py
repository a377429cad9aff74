"""Optimizer specs: validated hyperparameters, slots under TF's names, and the row math.

Each class's docstring carries its formula; ``reference_update`` is that formula in NumPy, and
the registered row math (``row_math``, ``RowMath``) the per-coordinate form numba compiles.
"""

from ._base import DynamicLearningRate, LearningRate, Optimizer, RowContext, SlotSpec
from ._row_math import RowMath, row_math
from .adagrad import Adagrad, AdagradMomentum, ProximalAdagrad
from .adam import Adam, AMSGrad, Lion
from .frequency import BatchSoftmax, FrequencyEstimator
from .ftrl import FTRL
from .momentum import Adadelta, Momentum, RMSProp
from .sgd import SGD, Assign

__all__ = [
    "AMSGrad",
    "BatchSoftmax",
    "FTRL",
    "SGD",
    "Adadelta",
    "Adagrad",
    "AdagradMomentum",
    "Adam",
    "Assign",
    "DynamicLearningRate",
    "FrequencyEstimator",
    "LearningRate",
    "Lion",
    "Momentum",
    "Optimizer",
    "ProximalAdagrad",
    "RMSProp",
    "RowContext",
    "RowMath",
    "SlotSpec",
    "row_math",
]
