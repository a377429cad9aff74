"""The ``tf.tpu.experimental.embedding`` API on embengine: port TPU code by changing one import.

    import embengine.tpu as embedding     # was: embedding = tf.tpu.experimental.embedding

Names, arguments, defaults and checks follow TF; TPUEmbedding runs enqueue / dequeue /
apply_gradients on an EmbeddingEngine (``.engine``). Inputs may be NumPy arrays, lists of lists,
``embengine.Ragged`` or, with TensorFlow installed (it is optional), ``tf.Tensor``,
``tf.RaggedTensor`` and ``tf.SparseTensor``; activations are ``tf.Tensor`` when any input of the
call was a TF object, else NumPy arrays (docs/tensorflow.md).
"""

from .config import FeatureConfig, QuantizationConfig, RowIdInitializer, TableConfig
from .embedding import TPUEmbedding, TPUEmbeddingForServing
from .optimizers import FTRL, SGD, Adagrad, AdagradMomentum, Adam

__all__ = [
    "FTRL",
    "SGD",
    "Adagrad",
    "AdagradMomentum",
    "Adam",
    "FeatureConfig",
    "QuantizationConfig",
    "RowIdInitializer",
    "TPUEmbedding",
    "TPUEmbeddingForServing",
    "TableConfig",
]
