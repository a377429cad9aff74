"""EmbeddingLayer: the engine as a torch ``nn.Module`` whose backward applies the fused update.

The tables are not torch Parameters (a dense torch optimizer never sees them): the layer's
outputs require grad, and their backward hands the activation gradients to
``engine.apply_gradients``, as TorchRec/FBGEMM's "optimizer in backward" does. They are in the
module's ``state_dict()`` all the same (``tables.<table>.weights``, ``tables.<table>.<slot>``,
``step``), so ``torch.save(model.state_dict())`` holds them; ``lr_handle()`` lets torch's
learning-rate schedulers drive the tables' dynamic learning rates; ``output="keyed"`` returns a
TorchRec-style ``KeyedTensor``. See docs/torchrec.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from ..batch import PreparedBatch
from ..engine import EmbeddingEngine
from ..inputs import Ragged, _is_jagged
from ..keyed_jagged import is_keyed_jagged, keyed_jagged_to_features
from ..learning_rates import check_learning_rates
from ..safetensors_io import BFLOAT16
from .keyed_tensor import KeyedTensor
from .lr_handle import LearningRateHandle

__all__ = ["EmbeddingLayer"]

OUTPUTS = ("dict", "keyed")


class _Pending:
    """One forward's batch, waiting for its backward (which must update at most once).
    ``learning_rates``: the values given to forward, else a LearningRateHandle read when the
    update runs, else None. ``applied``: the gradients the update used, once it ran."""

    __slots__ = ("engine", "batch", "names", "learning_rates", "timestamp", "applied")

    def __init__(self, engine, batch, names, learning_rates, timestamp=None):
        self.engine = engine
        self.batch = batch
        self.names = names
        self.learning_rates = learning_rates
        self.timestamp = timestamp
        self.applied: dict[str, np.ndarray] | None = None


def _timestamp(t) -> dict:
    """``timestamp=t`` for the engine's lookup or update (EmbeddingEngine's and ShardedEngine's
    alike), or no argument at all for None, so the engine's own default applies."""
    return {} if t is None else {"timestamp": t}


def _timestamp_value(t):
    """A 0-d integer tensor (a DataLoader's collated time, ``batch["time"].max()``) as its
    int, as NumPy's integer scalars are read; anything else as it is, for the engine to check
    (and refuse by name: a float, a bool, more than one value). A meta tensor is refused
    here (a TypeError, as for meta ids): it holds no value, and ``item()`` raised torch's own
    "Tensor.item() cannot be called on meta tensors"."""
    if isinstance(t, torch.Tensor) and t.device.type == "meta":
        raise TypeError(
            f"timestamp is a meta tensor (device 'meta', shape {list(t.shape)}, dtype "
            f"{str(t.dtype)[len('torch.') :]}): it holds no value; pass an int (seconds of "
            "data time) or a tensor holding one"
        )
    if isinstance(t, torch.Tensor) and t.dim() == 0:
        if not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
            return int(t.item())
    return t


def _owner(a: np.ndarray) -> np.ndarray:
    """The array owning ``a``'s memory (numpy points a view's ``base`` at it)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


class _SharedTensors:
    """Torch tensors sharing memory with an engine's float32 state arrays, one torch storage per
    array owning the memory (a physical table: weights, float slots and packed neighbours).
    ``torch.save`` then writes each table's memory once: a tensor made by ``torch.from_numpy``
    from a strided view gets a storage of its own spanning nearly the whole table, so the
    weights and each slot would write it again. int32 slots (step counters) are copies, small
    ``[rows, 1]`` ones: torch.save refuses tensors of two dtypes on one storage."""

    def __init__(self):
        self._storages: dict[int, tuple[np.ndarray, torch.UntypedStorage]] = {}

    def tensor(self, a: np.ndarray) -> torch.Tensor:
        if a.dtype == BFLOAT16:  # a bfloat16 table's: torch.bfloat16, a copy (its bits)
            return torch.from_numpy(np.array(a, copy=True).view(np.int16)).view(torch.bfloat16)
        if a.dtype != np.float32:
            return torch.from_numpy(np.array(a, copy=True))
        owner = _owner(a)
        item = a.itemsize
        offset = a.__array_interface__["data"][0] - owner.__array_interface__["data"][0]
        fits = (
            owner.flags.c_contiguous
            and owner.flags.writeable
            and owner.nbytes % item == 0
            and offset % item == 0
            and all(s >= 0 and s % item == 0 for s in a.strides)
        )
        if not fits:  # not a layout one storage can hold: a storage of its own
            return torch.from_numpy(a)
        key = id(owner)
        if key not in self._storages:
            flat = torch.from_numpy(owner.reshape(-1).view(np.uint8))
            self._storages[key] = (owner, flat.untyped_storage())
        storage = self._storages[key][1]
        out = torch.empty(0, dtype=torch.float32)
        out.set_(storage, offset // item, a.shape, [s // item for s in a.strides])
        return out


class _FusedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, pending, arrays):
        ctx.pending = pending
        # Tensors made here are this node's own outputs, not views of an input: they can be
        # modified in place (relu_, +=) as an nn.EmbeddingBag's output can.
        return tuple(torch.from_numpy(a) for a in arrays)

    @staticmethod
    def backward(ctx, *grads):
        pending: _Pending = ctx.pending
        shapes = {n: lay.shape for n, lay in pending.batch.features.items()}
        gradients = {}
        for name, g in zip(pending.names, grads, strict=True):
            if g is None:
                gradients[name] = np.zeros(shapes[name], dtype=np.float32)
            else:
                gradients[name] = g.detach().to(torch.float32).contiguous().numpy()
        if pending.applied is not None:
            _check_repeated(pending, gradients)
            return (None, None, None)
        lrs = pending.learning_rates
        if isinstance(lrs, LearningRateHandle):
            lrs = lrs.learning_rates()  # the scheduler's value now, at the update
        pending.engine.apply_gradients(
            gradients, learning_rates=lrs, batch=pending.batch, **_timestamp(pending.timestamp)
        )
        pending.applied = gradients
        return (None, None, None)


def _check_repeated(pending: _Pending, gradients: Mapping[str, np.ndarray]) -> None:
    """A second backward through an applied forward: the same gradients again (backward on
    the same loss with ``retain_graph=True``) or zeros change nothing; other gradients (a
    second loss of the same outputs) cannot join an update that has run, and are refused
    rather than lost."""
    other = [
        n
        for n in pending.names
        if gradients[n].any() and not np.array_equal(gradients[n], pending.applied[n])
    ]
    if other:
        raise RuntimeError(
            f"EmbeddingLayer: this backward brings gradients for features {other} of a forward "
            "whose update an earlier backward applied already (the tables update once per "
            "forward, in its first backward); they would be lost. Add the losses and call "
            "backward once, e.g. (loss_a + loss_b).backward(), or call the layer once per "
            "backward"
        )


def _samples(value) -> int | None:
    """The samples of one feature's input as the engine reads it (``inputs.to_ragged``): a
    Ragged's bags, a JaggedTensor's lengths, a nested tensor's rows (its ``shape`` is an
    internal error), the first axis of a 1-D or 2-D array or tensor, a sequence's items (a
    list, a range: the engine reads them all); None for anything else (the engine's lookup
    refuses it, naming it)."""
    if isinstance(value, Ragged):
        return value.num_samples
    if isinstance(value, torch.Tensor) and value.is_nested:
        return int(value.size(0))
    if _is_jagged(value):  # TorchRec's JaggedTensor: one length per sample
        return int(len(value.lengths()))
    if isinstance(value, np.ndarray | torch.Tensor):
        return int(value.shape[0]) if value.ndim in (1, 2) else None
    if isinstance(value, str | bytes | Mapping):  # refused by the engine, by name
        return None
    try:  # a list or tuple, or any sequence NumPy reads (range, array.array): its items
        return len(value)
    except TypeError:
        return None


class EmbeddingLayer(torch.nn.Module):
    """Looks features up in an EmbeddingEngine; backward applies one fused update per step.

    A ``ShardedEngine`` (embengine.distributed) works too: each rank's layer looks up its own
    samples and its backward is the collective update, so every rank must run one forward
    and one backward per step (the dense part under DDP, whose collectives run in their own
    group). Its tables are not in ``state_dict()``: save them with ``engine.save``.

    ``forward(features, weights=None, learning_rates=None)`` takes a dict of feature name ->
    ids (torch tensors, NumPy arrays, ``Ragged``, lists of lists or of 1-D tensors, torch
    nested tensors of 1-D rows, TorchRec's ``JaggedTensor``), a ``KeyedJagged`` (or
    TorchRec's KeyedJaggedTensor, also with a variable batch per feature: see
    embengine.keyed_jagged), or a ``PreparedBatch`` from ``layer.preprocess`` (e.g. built in a
    DataLoader worker). It returns a dict of float32 tensors, or with ``output="keyed"`` a
    ``KeyedTensor`` (TorchRec's EmbeddingBagCollection output: ``values()`` is ``[batch, sum of
    dims]``; every feature must be pooled, ``[batch, dim]``, with the same batch). In training
    mode with grad enabled they require grad; their backward updates every touched row once,
    whatever the number of branches they feed; calling backward again on the same graph does
    nothing, and a later backward bringing other gradients (a second loss of the same
    outputs, backpropagated on its own) is refused: add the losses and call backward once.
    ``learning_rates`` (one per dynamic learning-rate tag) is used by that update; without it,
    the ``lr_handle()``'s values are, if the layer has one. ``timestamp``: the batch's data
    time (an int of seconds, or a 0-d integer tensor), passed to the training lookup and its
    update (keyed tables that expire by data time need it; ignored in eval mode). In eval
    mode, under ``torch.no_grad()`` or after ``layer.requires_grad_(False)`` (which freezes
    the tables) the lookup never updates anything and skips the deduplication (a lookup-only
    batch); a batch from ``preprocess(..., training=False)`` is refused in training mode.

    Pooling is each table's ``combiner``, whose default is TF's ``"mean"``; TorchRec's
    EmbeddingBagConfig pools by ``"sum"`` by default: set ``combiner="sum"`` on the
    TableConfig (or build the configs with ``feature_configs_from_torchrec``) to port a TorchRec
    model. ``state_dict()`` holds the engine's tables and slots (``tables.<table>.<entry>``)
    and its ``step``; ``load_state_dict`` restores them through ``engine.load_state_dict``.
    """

    def __init__(self, engine: EmbeddingEngine, output: str = "dict"):
        super().__init__()
        from ..distributed import ShardedEngine

        if not isinstance(engine, EmbeddingEngine | ShardedEngine):
            raise TypeError(
                f"EmbeddingLayer needs an EmbeddingEngine or a ShardedEngine, got {type(engine)}"
            )
        # A ShardedEngine's tables are saved collectively (engine.save), not in state_dict.
        self._sharded = isinstance(engine, ShardedEngine)
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        self.engine = engine
        self.output = output
        self._lr_handle: LearningRateHandle | None = None

    # A class default, so that a layer pickled before the attribute existed unpickles trainable.
    trainable = True

    def requires_grad_(self, requires_grad: bool = True) -> EmbeddingLayer:
        """Freeze (``False``) or unfreeze the tables, as ``requires_grad_`` does a module's
        parameters: a frozen layer's forward is a lookup (its outputs need no grad, nothing
        updates), in training mode too. The tables are not Parameters, so
        ``model.requires_grad_(False)`` on a parent module and ``p.requires_grad = False``
        over ``parameters()`` do not reach them: call this on the layer."""
        self.trainable = bool(requires_grad)
        return super().requires_grad_(requires_grad)

    def lr_handle(self, lr: float | Sequence[float] | None = None) -> LearningRateHandle:
        """The layer's ``LearningRateHandle`` (made on the first call, with ``lr``: see
        embengine.torch.lr_handle): a torch ``Optimizer`` with one param group per dynamic
        learning-rate tag, for ``torch.optim.lr_scheduler`` schedulers. Every later update
        without ``learning_rates=`` uses its groups' ``lr``."""
        if self._lr_handle is None:
            self._lr_handle = LearningRateHandle(self.engine, lr)
        elif lr is not None:
            raise ValueError(
                "the layer has its lr_handle already; set its param_groups' 'lr' instead of "
                "passing lr= again"
            )
        return self._lr_handle

    def preprocess(
        self, features, weights: Mapping | None = None, *, training: bool = True
    ) -> PreparedBatch:
        """Validate and deduplicate a batch without touching the tables (DataLoader-safe);
        ``training=False`` builds a cheaper lookup-only batch (see EmbeddingEngine.preprocess)."""
        return self.engine.preprocess(self._feature_dict(features), weights, training=training)

    def preprocessor(self):
        """The engine's ``Preprocessor`` (``engine.preprocessor()``): ``preprocess`` for
        DataLoader workers, small to pickle (no tables), fork-safe; it takes KeyedJagged too."""
        return self.engine.preprocessor()

    @staticmethod
    def _feature_dict(features):
        if is_keyed_jagged(features):
            return keyed_jagged_to_features(features)
        return features

    # Not traced by torch.compile: the lookup is NumPy and numba code dynamo cannot trace
    # (it failed inside the engine); a compiled model runs the layer eagerly, the rest compiled.
    @torch.compiler.disable
    def forward(
        self,
        features,
        weights: Mapping | None = None,
        learning_rates: Sequence[float] | None = None,
        timestamp: int | torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor] | KeyedTensor:
        training = self.training and self.trainable and torch.is_grad_enabled()
        extra = {}
        try:
            # evaluation sees the tables as they are
            timestamp = _timestamp_value(timestamp) if training else None
            features, learning_rates = self._checked_inputs(
                features, weights, learning_rates, training
            )
        except Exception as e:
            if not self._sharded:
                raise
            # The other ranks are in the lookup's collective: the engine fails it on every
            # rank (this one raising ``e``) instead of leaving them to wait for this rank.
            extra["refused"] = e
        # The batch comes back with the activations: the engine's pending batch, read
        # afterwards, could be another thread's.
        acts, batch = self.engine.lookup_with_batch(
            features, weights, training=training, **_timestamp(timestamp), **extra
        )
        names = list(acts)
        if self.output == "keyed":
            self._check_keyed({name: a.shape for name, a in acts.items()})
        if training:
            anchor = torch.empty(0, requires_grad=True)  # makes the outputs part of the graph
            if learning_rates is None:
                learning_rates = self._lr_handle
            pending = _Pending(self.engine, batch, names, learning_rates, timestamp)
            tensors = _FusedLookup.apply(anchor, pending, [acts[n] for n in names])
        else:
            tensors = [torch.from_numpy(acts[n]) for n in names]
        if self.output == "keyed":
            return KeyedTensor.from_tensor_list(names, tensors)
        return dict(zip(names, tensors, strict=True))

    def _checked_inputs(self, features, weights, learning_rates, training: bool):
        """``forward``'s features (a KeyedJagged read as a dict) and learning rates (checked),
        after what the update or the output would refuse, refused before the lookup changes
        anything (a training lookup inserts and counts keyed tables' keys)."""
        if isinstance(features, PreparedBatch):
            if weights is not None:
                raise ValueError("weights must be given to preprocess(), not with a PreparedBatch")
            if training and not features.deduplicated:
                raise ValueError(
                    "this PreparedBatch was built with training=False and cannot be trained on; "
                    "build it with layer.preprocess(features)"
                )
        else:
            # Features straight to the engine: a training lookup then deduplicates and pools in
            # one parallel region (see EmbeddingEngine.lookup).
            features = self._feature_dict(features)
        if self.output == "keyed":
            self._check_keyed_inputs(features)
        if (
            training
            and learning_rates is not None
            and not isinstance(learning_rates, LearningRateHandle)
        ):
            learning_rates = check_learning_rates(
                learning_rates, self.engine.num_learning_rate_tags
            )
        if training and learning_rates is None and self._lr_handle is None:
            self._check_rates_known()
        return features, learning_rates

    def _check_rates_known(self) -> None:
        """Tables with an explicit ``DynamicLearningRate`` tag have no rate of their own: the
        update (in backward) would refuse a step without ``learning_rates``, after the lookup,
        naming ``apply_gradients``, which a torch loop never calls."""
        engine = self.engine
        tables = [
            name
            for name in engine.table_names
            if engine.learning_rate_tag(name) is not None
            and not callable(engine.optimizer(name).learning_rate)
        ]
        if tables:
            raise ValueError(
                f"tables {tables} use DynamicLearningRate, which has no value of its own: pass "
                f"learning_rates=[...] ({engine.num_learning_rate_tags} values, one per tag) "
                "to the layer's forward, or make layer.lr_handle(lr=...) (a torch optimizer "
                "for lr schedulers) before training"
            )

    def _check_keyed_inputs(self, features) -> None:
        """``_check_keyed`` on the activations' shapes before the lookup: a prepared batch's,
        or each feature's from its config and samples (``FeatureConfig.activation_shape``; a
        Ragged's bags, the rows of a 2-D array or tensor, the ids of a 1-D one, a list's
        items), so a sequence feature, an output_shape or two batch sizes are refused before
        anything is looked up (on every rank of a ShardedEngine, which takes the error into
        the lookup's collective). What the engine reads otherwise (it refuses what it cannot
        read) is left to ``_check_keyed`` after."""
        if isinstance(features, PreparedBatch):
            shapes = {name: lay.shape for name, lay in features.features.items()}
        elif isinstance(features, Mapping):
            configs, shapes = self.engine.feature_config, {}
            for name, value in features.items():
                n = _samples(value)
                if n is not None and name in configs:  # an unknown name: the engine's error
                    try:
                        shapes[name] = configs[name].activation_shape(n)
                    except ValueError:
                        continue  # an output_shape that does not fit: the engine's error
        else:
            return
        self._check_keyed(shapes)

    @staticmethod
    def _check_keyed(shapes: Mapping[str, tuple[int, ...]]) -> None:
        """A KeyedTensor puts every feature's ``[batch, dim]`` side by side (``shapes``: the
        activations')."""
        batch = None
        for name, shape in shapes.items():
            if len(shape) != 2:
                raise ValueError(
                    f"output='keyed' needs pooled [batch, dim] activations; feature {name!r} has "
                    f"shape {list(shape)} (a sequence feature or an output_shape): use "
                    "output='dict'"
                )
            if batch is None:
                batch = (name, shape[0])
            elif shape[0] != batch[1]:
                raise ValueError(
                    f"output='keyed' needs one batch size; feature {name!r} has {shape[0]} "
                    f"samples, feature {batch[0]!r} has {batch[1]}"
                )

    # -- state_dict: the engine's tables and slots, and its step --------------------------------

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        """``{prefix}step`` (int64 scalar) and ``{prefix}tables.<table>.<entry>`` for the
        weights and every slot: float32 tensors sharing memory with the tables, as a
        Parameter's entry does (they change with training; clone for a snapshot; read them
        while no update runs); int32 slots are copies (see _SharedTensors)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._sharded:
            return
        state = self.engine.state_dict()
        destination[prefix + "step"] = torch.tensor(state["step"], dtype=torch.int64)
        shared = _SharedTensors()
        for table, entries in state["tables"].items():
            for entry, array in entries.items():
                destination[f"{prefix}tables.{table}.{entry}"] = shared.tensor(array)

    def _state_keys(self, prefix: str) -> dict[str, tuple[str, str] | None]:
        """Each state_dict key of the engine -> (table, entry), or None for the step."""
        if self._sharded:
            return {}
        keys: dict[str, tuple[str, str] | None] = {prefix + "step": None}
        for table, entries in self.engine.state_dict()["tables"].items():
            for entry in entries:
                keys[f"{prefix}tables.{table}.{entry}"] = (table, entry)
        return keys

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        """Restore the tables, slots and step through ``engine.load_state_dict``, which checks
        every entry before it copies anything. All or nothing: a missing or unknown key, or a
        shape or dtype that does not fit (in error_msgs), changes nothing, whatever
        ``strict`` (torch does not tell a module whether it was given; with strict=False the
        keys are in the result). ``engine.load_state_dict(state, strict=False)`` loads part of
        a state. Values are copied into the tables (``assign=True`` too)."""
        ours = self._state_keys(prefix)
        rest = {k: v for k, v in state_dict.items() if k not in ours}
        super()._load_from_state_dict(
            rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        unknown = [k for k in rest if k.startswith(prefix + "tables.")]
        unexpected_keys.extend(k for k in unknown if k not in unexpected_keys)
        missing = [k for k in ours if k not in state_dict]
        missing_keys.extend(missing)
        if missing or unknown:
            return
        if self._sharded:  # nothing of the engine is in the dict
            return
        state: dict = {"tables": {}}
        for key, where in ours.items():
            if key not in state_dict:
                continue
            value = state_dict[key]
            if where is None:
                # An integer scalar tensor as an int; anything else as it is, for the
                # engine's check to refuse by name (int() would truncate 3.7 and take True).
                integral = isinstance(value, torch.Tensor) and value.numel() == 1
                integral = integral and not (
                    value.is_floating_point() or value.is_complex() or value.dtype == torch.bool
                )
                state["step"] = int(value.item()) if integral else value
                continue
            if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16:
                value = value.detach().cpu().view(torch.int16).numpy().view(BFLOAT16)
            elif isinstance(value, torch.Tensor):
                value = value.detach().cpu().numpy()
            table, entry = where
            state["tables"].setdefault(table, {})[entry] = value
        try:
            self.engine.load_state_dict(state)
        except (TypeError, ValueError) as e:
            error_msgs.append(f"while loading the EmbeddingLayer's engine state at {prefix!r}: {e}")

    def extra_repr(self) -> str:
        # a keyed table (vocabulary_size None) has no number of rows to show: "keyed"
        tables = ", ".join(
            f"{n}: {'keyed' if c.vocabulary_size is None else c.vocabulary_size}x{c.dim}"
            for n, c in self.engine.table_configs.items()
        )
        return f"tables=[{tables}], backend={self.engine.backend!r}"
