"""The optimizer classes of ``tf.tpu.experimental.embedding``, with TF's positional signatures.

Each is the embengine optimizer of the same name (same math, same checks), constructed with TF's
argument order. TF's argument names are the base spec's field names, so every ``__init__`` hands
its arguments to the base by name through one helper, ``_construct``; the common knobs
(accumulation, clipping, weight decay, packing) are then checked by ``Optimizer`` alone, the same
way in every class. ``slot_variable_creation_fn`` must stay None: slots live in the engine.
"""

from __future__ import annotations

from typing import Any

from .. import optimizers as _opt

__all__ = ["SGD", "Adagrad", "AdagradMomentum", "Adam", "FTRL"]


def _construct(cls: type, self: _opt.Optimizer, arguments: dict[str, Any]) -> None:
    """Initialise ``self`` as ``cls``'s embengine base with TF's ``arguments`` (an
    ``__init__``'s ``locals()``), all passed by name; ``slot_variable_creation_fn`` is refused
    unless None."""
    kwargs = {k: v for k, v in arguments.items() if k not in ("self", "__class__")}
    if kwargs.pop("slot_variable_creation_fn", None) is not None:
        raise ValueError(
            f"{cls.__name__}: slot_variable_creation_fn is not supported; embengine creates and "
            "owns the slots (see engine.slots(table_name))"
        )
    super(cls, self).__init__(**kwargs)


class SGD(_opt.SGD):
    """``tf.tpu.experimental.embedding.SGD``: ``w -= lr * g``."""

    def __init__(
        self,
        learning_rate=0.01,
        use_gradient_accumulation=True,
        clip_weight_min=None,
        clip_weight_max=None,
        weight_decay_factor=None,
        multiply_weight_decay_factor_by_learning_rate=None,
        clipvalue=None,
        low_dimensional_packing_status=False,
    ):
        _construct(SGD, self, locals())


class Adagrad(_opt.Adagrad):
    """``tf.tpu.experimental.embedding.Adagrad`` (see embengine.optimizers.Adagrad)."""

    def __init__(
        self,
        learning_rate=0.001,
        initial_accumulator_value=0.1,
        use_gradient_accumulation=True,
        clip_weight_min=None,
        clip_weight_max=None,
        weight_decay_factor=None,
        multiply_weight_decay_factor_by_learning_rate=None,
        slot_variable_creation_fn=None,
        clipvalue=None,
        low_dimensional_packing_status=False,
    ):
        _construct(Adagrad, self, locals())


class AdagradMomentum(_opt.AdagradMomentum):
    """``tf.tpu.experimental.embedding.AdagradMomentum`` (see embengine.optimizers)."""

    def __init__(
        self,
        learning_rate=0.001,
        momentum=0.0,
        use_nesterov=False,
        exponent=2,
        beta2=1,
        epsilon=1e-10,
        use_gradient_accumulation=True,
        clip_weight_min=None,
        clip_weight_max=None,
        weight_decay_factor=None,
        multiply_weight_decay_factor_by_learning_rate=None,
        slot_variable_creation_fn=None,
        clipvalue=None,
        low_dimensional_packing_status=False,
    ):
        _construct(AdagradMomentum, self, locals())


class Adam(_opt.Adam):
    """``tf.tpu.experimental.embedding.Adam``: lazy by default, no bias correction."""

    def __init__(
        self,
        learning_rate=0.001,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-07,
        lazy_adam=True,
        sum_inside_sqrt=True,
        use_gradient_accumulation=True,
        clip_weight_min=None,
        clip_weight_max=None,
        weight_decay_factor=None,
        multiply_weight_decay_factor_by_learning_rate=None,
        slot_variable_creation_fn=None,
        clipvalue=None,
        low_dimensional_packing_status=False,
    ):
        _construct(Adam, self, locals())


class FTRL(_opt.FTRL):
    """``tf.tpu.experimental.embedding.FTRL`` (see embengine.optimizers.FTRL)."""

    def __init__(
        self,
        learning_rate=0.001,
        learning_rate_power=-0.5,
        l1_regularization_strength=0.0,
        l2_regularization_strength=0.0,
        beta=0.0,
        initial_accumulator_value=0.1,
        use_gradient_accumulation=True,
        clip_weight_min=None,
        clip_weight_max=None,
        weight_decay_factor=None,
        multiply_weight_decay_factor_by_learning_rate=None,
        slot_variable_creation_fn=None,
        clipvalue=None,
        multiply_linear_by_learning_rate=False,
        allow_zero_accumulator=False,
        low_dimensional_packing_status=False,
    ):
        _construct(FTRL, self, locals())
