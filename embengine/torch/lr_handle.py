"""LearningRateHandle: the engine's dynamic learning rates as a torch optimizer's param_groups,
so that ``torch.optim.lr_scheduler`` schedulers drive the tables' learning rates.

The tables update in backward (``EmbeddingLayer``), not in a torch optimizer's ``step``; what a
scheduler needs is an ``Optimizer`` whose ``param_groups[i]["lr"]`` it can set. Here group ``i``
is the engine's dynamic learning-rate tag ``i`` (``ee.DynamicLearningRate(i)``, or a callable
learning rate, numbered after the explicit tags; see embengine.learning_rates): ``{"params":
[], "lr": float, "tag": i, "tables": [table names]}``. Each backward of the layer passes
``[group["lr"] for each group]`` as ``apply_gradients(learning_rates=...)``, read when the
update runs (as a torch optimizer reads ``lr`` in ``step``), so ``scheduler.step()`` after a
step sets the next step's rate. A callable tag is then driven by the handle, not by its
function. Tables with a constant learning rate have no group: give a table a scheduler should
drive a ``DynamicLearningRate`` tag.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..engine import EmbeddingEngine
from ..learning_rates import check_rate
from ..optimizers._base import learning_rate_arity

__all__ = ["LearningRateHandle"]


def _tag_tables(engine: EmbeddingEngine) -> list[list[str]]:
    tables: list[list[str]] = [[] for _ in range(engine.num_learning_rate_tags)]
    for name in engine.table_names:
        tag = engine.learning_rate_tag(name)
        if tag is not None:
            tables[tag].append(name)
    return tables


def _per_tag(lr):
    """``lr`` as None, one value for every tag, or a list of one per tag: a 1-D array or
    tensor is its list (as ``forward(learning_rates=...)`` reads one), a 0-d one its value. A
    string is refused (as a sequence it was read as one value per character)."""
    if isinstance(lr, str | bytes):
        raise TypeError(
            f"lr must be a number (every tag's) or a sequence of one number per tag, got the "
            f"string {lr!r}"
        )
    if isinstance(lr, np.ndarray | torch.Tensor):
        if lr.ndim > 1:
            raise ValueError(
                f"lr must be one number, or one per tag (a 1-D sequence), got an array of shape "
                f"{list(lr.shape)}"
            )
        return lr.tolist() if lr.ndim == 1 else lr.item()
    return lr


class LearningRateHandle(torch.optim.Optimizer):
    """One param group per dynamic learning-rate tag of ``engine`` (see the module docstring).

    ``lr``: one float for every tag, a sequence of one per tag, or None: a callable tag starts
    at its function's value for the engine's current step; an explicit ``DynamicLearningRate``
    tag has no value of its own and needs one. ``step()`` and ``zero_grad()`` change nothing
    (the update happened in backward); they are there so a torch training loop and the
    schedulers' checks run unchanged. ``state_dict`` / ``load_state_dict`` are torch's, and a
    state whose groups are other tags or tables is refused.
    """

    def __init__(self, engine: EmbeddingEngine, lr: float | Sequence[float] | None = None):
        tables = _tag_tables(engine)
        if not tables:
            raise ValueError(
                "the engine has no dynamic learning rate: every table's is a constant. Give the "
                "tables a scheduler should drive optimizer=...(learning_rate="
                "ee.DynamicLearningRate(tag)) (or a callable), then make the handle with lr= "
                "their starting values"
            )
        self._engine = engine
        lr = _per_tag(lr)
        groups = [
            {"params": [], "lr": self._start(engine, tag, names, lr), "tag": tag, "tables": names}
            for tag, names in enumerate(tables)
        ]
        super().__init__(groups, {"lr": 0.0})

    @staticmethod
    def _start(engine, tag: int, names: list[str], lr) -> float:
        if lr is None:
            fn = engine.optimizer(names[0]).learning_rate
            if not callable(fn):
                raise ValueError(
                    f"tables {names} use DynamicLearningRate({tag}), which has no value of its "
                    f"own: pass lr= (one float, or one per tag: {engine.num_learning_rate_tags})"
                )
            # the engine's rule for a callable: called with the step if it takes an argument
            return float(fn(engine.step) if learning_rate_arity(fn) else fn())
        if isinstance(lr, Sequence):
            if len(lr) != engine.num_learning_rate_tags:
                raise ValueError(
                    f"lr has {len(lr)} values but the engine has "
                    f"{engine.num_learning_rate_tags} dynamic learning-rate tags; give one per tag"
                )
            return check_rate(lr[tag], f"lr[{tag}]")
        return check_rate(lr, "lr")

    def learning_rates(self) -> list[float]:
        """The value of every tag, in tag order: what the next update uses. A group's "lr"
        set to a bool or a string (which ``float`` would read as 1.0 or parse), or to a
        negative or non-finite number, is refused by name, as the engine's learning rates."""
        return [
            check_rate(g["lr"], f"the lr_handle's param_groups[{i}]['lr'] (tag {g['tag']})")
            for i, g in sorted(enumerate(self.param_groups), key=lambda ig: ig[1]["tag"])
        ]

    def step(self, closure=None):
        """Nothing to do: the layer's backward updated the tables with ``learning_rates()``."""
        return None if closure is None else closure()

    def load_state_dict(self, state_dict) -> None:
        ours = [(g["tag"], g["tables"]) for g in self.param_groups]
        theirs = [(g.get("tag"), g.get("tables")) for g in state_dict.get("param_groups", [])]
        if ours != theirs:
            raise ValueError(
                f"this state's param groups are (tag, tables) {theirs}; the engine's are {ours}"
            )
        super().load_state_dict(state_dict)
