"""TorchRec's table configs as embengine FeatureConfigs: the names and defaults mapped, so a
TorchRec model's tables pool and start as TorchRec's would (see docs/torchrec.md).

``EmbeddingBagConfig(num_embeddings, embedding_dim, name, feature_names, pooling=SUM,
weight_init_min/max)`` becomes ``TableConfig(vocabulary_size=num_embeddings,
dim=embedding_dim, name=name, combiner=pooling, initializer=RandomUniform(min, max))`` read by
one ``FeatureConfig`` per feature name. Pooling SUM is "sum" (TorchRec's default; embengine's
own default combiner is TF's "mean"), MEAN is "mean"; a table's initial values are uniform in
TorchRec's bounds (``+-sqrt(1 / num_embeddings)`` unless set), though not the same draws;
TorchRec's own default ``init_fn`` (its EmbeddingBagConfig sets one from those bounds, a
``functools.partial`` of ``torch.nn.init.uniform_``) is read as its bounds, so the engine's
``seed`` decides the draws; any other ``init_fn`` is called on the whole table's float32
weight, as TorchRec calls it (``initializers.FromFunction``). ``data_type`` FP32, FP16 and
BF16 become ``weights_dtype`` "float32", "float16" and "bfloat16"; the integer types
(TorchRec's quantized inference tables) and an ``EmbeddingConfig`` (TorchRec's unpooled
EmbeddingCollection) are refused by name. A virtual table (``use_virtual_table=True``: ids in a
space like 2^50, a row made when its id trains) becomes a keyed table (``TableConfig(None,
...)`` with ``DynamicVocabulary()``: any int64 id, rows made as ids are looked up in training);
its ``virtual_table_eviction_policy``, if set, has no mapping and is refused by name (give the
feature a keyed table with ``DynamicVocabulary(expire_steps=..., max_rows=...)`` yourself).
``need_pos`` is accepted as it changes nothing here (a position-weighted feature's weights come
in the KJT, as TorchRec's feature processors make them). Any other field of the config's
dataclass set away from its default (``num_embeddings_post_pruning``, ``input_dim``,
``total_num_buckets``, ``enable_embedding_update``, ``stash_weights``, or a field a later
torchrec adds) has no mapping and is refused by name rather than dropped. Duck-typed: torchrec
is not imported.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

from ..config import DynamicVocabulary, FeatureConfig, TableConfig
from ..initializers import FromFunction, RandomUniform
from ..optimizers import Optimizer

__all__ = ["feature_configs_from_torchrec"]

_POOLING = {"SUM": "sum", "MEAN": "mean"}


_DATA_TYPES = {"FP32": "float32", "FP16": "float16", "BF16": "bfloat16"}

# The fields of TorchRec's EmbeddingBagConfig read below, and the one whose value changes
# nothing here; any other set away from its default is refused (``_refuse_unmapped``).
_READ = frozenset(
    {
        "num_embeddings",
        "embedding_dim",
        "name",
        "data_type",
        "feature_names",
        "weight_init_max",
        "weight_init_min",
        "init_fn",
        "use_virtual_table",
        "virtual_table_eviction_policy",
        "pooling",
    }
)
_NO_EFFECT = frozenset({"need_pos"})  # position weights come in the KJT's weights


def _name(value) -> str:
    """An enum member's (or a string's) name, upper case."""
    return str(getattr(value, "name", getattr(value, "value", value))).upper()


def _refuse_unmapped(cfg) -> None:
    """Refuse, naming it, a field of ``cfg`` (a dataclass: TorchRec's configs are) that is
    neither read here nor without effect and holds other than its default: dropping it would
    train another table than TorchRec's (``num_embeddings_post_pruning`` changes how TorchRec's
    row-wise sharding splits the rows, ``input_dim`` / ``total_num_buckets`` belong to its
    managed-collision and bucketed tables)."""
    if not dataclasses.is_dataclass(cfg):
        return
    for f in dataclasses.fields(cfg):
        if f.name in _READ or f.name in _NO_EFFECT:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        value = getattr(cfg, f.name, default)
        if default is dataclasses.MISSING or value != default:
            raise ValueError(
                f"table {getattr(cfg, 'name', None)!r}: {type(cfg).__name__}.{f.name} = "
                f"{value!r} has no embengine mapping (left at its default "
                f"{'none' if default is dataclasses.MISSING else repr(default)}, it is "
                "accepted); build that table's TableConfig yourself if embengine has what it "
                "asks for"
            )


def _weights_dtype(cfg) -> str:
    data_type = getattr(cfg, "data_type", None)
    if data_type is None:
        return "float32"
    name = _name(data_type)
    if name not in _DATA_TYPES:
        raise ValueError(
            f"table {cfg.name!r}: data_type {data_type!r} has no embengine table dtype; FP32, "
            "FP16 and BF16 do (weights_dtype), integer types are TorchRec's quantized "
            "inference tables"
        )
    return _DATA_TYPES[name]


def _uniform_bounds(init_fn) -> tuple[float, float] | None:
    """``(a, b)`` if ``init_fn`` is ``functools.partial(torch.nn.init.uniform_, a=, b=)``, the
    init_fn TorchRec's EmbeddingBagConfig sets when given none; else None."""
    if not isinstance(init_fn, functools.partial) or init_fn.args:
        return None
    fn = init_fn.func
    if (getattr(fn, "__module__", None), getattr(fn, "__name__", None)) != (
        "torch.nn.init",
        "uniform_",
    ):
        return None
    if set(init_fn.keywords) - {"a", "b"}:  # a generator=: torch's draws, as given
        return None
    return float(init_fn.keywords.get("a", 0.0)), float(init_fn.keywords.get("b", 1.0))


def _initializer(cfg):
    """TorchRec's: uniform in ``[weight_init_min, weight_init_max]`` (default
    ``+-sqrt(1 / num_embeddings)``; TorchRec's default init_fn is read as these bounds), else
    ``init_fn(weight)`` on the whole table (in place)."""
    init_fn = getattr(cfg, "init_fn", None)
    bounds = _uniform_bounds(init_fn)
    if bounds is not None:
        return RandomUniform(*bounds)
    if init_fn is not None:
        if not callable(init_fn):
            raise TypeError(f"table {cfg.name!r}: init_fn must be callable, got {init_fn!r}")

        def table_values(shape, dtype):
            import torch

            weight = torch.empty(tuple(shape), dtype=torch.float32)
            with torch.no_grad():
                init_fn(weight)
            return weight.numpy()

        return FromFunction(table_values)
    n = int(cfg.num_embeddings)
    bound = math.sqrt(1 / n) if n > 0 else 0.0
    lo = getattr(cfg, "weight_init_min", None)
    hi = getattr(cfg, "weight_init_max", None)
    return RandomUniform(-bound if lo is None else lo, bound if hi is None else hi)


def _vocabulary(cfg) -> tuple[int | None, DynamicVocabulary | None]:
    """``(vocabulary_size, dynamic)``: TorchRec's number of rows, or for a virtual table
    (``use_virtual_table``: ids up to ``num_embeddings`` ~ 2^50, materialized as they train) a
    keyed table; as a dense table it was an allocation of num_embeddings rows (16 PiB for 2^50
    rows of 4 floats, a MemoryError naming no table)."""
    if not getattr(cfg, "use_virtual_table", False):
        return int(cfg.num_embeddings), None
    policy = getattr(cfg, "virtual_table_eviction_policy", None)
    if policy is not None:
        raise ValueError(
            f"table {cfg.name!r}: virtual_table_eviction_policy {policy!r} has no embengine "
            "mapping; leave it None (a keyed table that keeps every row), or give the feature "
            f"a keyed table yourself: TableConfig(None, {int(cfg.embedding_dim)}, name="
            f"{cfg.name!r}, combiner=..., dynamic=ee.DynamicVocabulary(expire_steps=..., "
            "max_rows=...))"
        )
    return None, DynamicVocabulary()


def _pooling(cfg) -> str:
    if type(cfg).__name__ == "EmbeddingConfig":
        raise ValueError(
            f"table {cfg.name!r} is an EmbeddingConfig (TorchRec's unpooled "
            "EmbeddingCollection, a vector per id): embengine pools bags; give an "
            "EmbeddingBagConfig, or a FeatureConfig(max_sequence_length=...) for a vector per "
            "position"
        )
    pooling = getattr(cfg, "pooling", "SUM")
    name = _name(pooling)
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
        _pooling(cfg)  # an EmbeddingConfig is refused as such first
        _refuse_unmapped(cfg)
        vocabulary_size, dynamic = _vocabulary(cfg)
        table = TableConfig(
            vocabulary_size=vocabulary_size,
            dim=int(cfg.embedding_dim),
            initializer=_initializer(cfg),
            optimizer=optimizer,
            combiner=_pooling(cfg),
            name=cfg.name or None,
            weights_dtype=_weights_dtype(cfg),
            dynamic=dynamic,
        )
        for feature in cfg.feature_names:
            if feature in out:
                raise ValueError(f"feature {feature!r} is in two tables; TorchRec refuses it too")
            out[feature] = FeatureConfig(table)
    return out
