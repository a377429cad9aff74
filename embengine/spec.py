"""An engine's configuration as JSON: what ``EmbeddingEngine.spec()`` returns, what
``EmbeddingEngine.from_spec`` builds an engine from, and what a checkpoint's manifest stores.

A spec is a dict of JSON values::

    {"tables": [{"name", "vocabulary_size" (null: keyed), ["dynamic"], "dim", "combiner",
                 "initializer": {"class", "params"}, "optimizer": {"class", "params"},
                 "quantization_config", ["compressor": {"compression", "fixed_range"}],
                 ["weights_dtype"], ["slots_dtype"] (only when not "float32"),
                 "storage", "slots": [{"name", "width", "initial_value", "dtype"}]}, ...],
                                                             # in the engine's table order
     "features": [{"name", "table", "max_sequence_length", "validate_weights_and_indices",
                   "output_shape"}, ...],                    # in the engine's feature order
     "learning_rate_tags": [{"tag", "callable"}, ...],
     "seed", "backend", "nonfinite_gradients"}

Classes are named by their embengine class (``embengine.tpu.Adam`` is ``Adam``) and hold their
dataclass fields. A learning rate is ``{"constant": x}``, ``{"tag": t}`` (a
``DynamicLearningRate``) or ``{"tag": t, "callable": name}``, with ``"warmup":
{"learning_rate", "warmup_steps"}`` for a ``learning_rates.Warmup`` (rebuilt from it, one per
tag, unless ``callables`` gives the tag). What JSON cannot hold is recorded by name only, and
rebuilding needs it passed in: any other learning-rate callable (``callables={tag: fn}``) and
a ``FromFunction`` initializer's function (``initializers={table name: Initializer}``).
``storage`` says where the engine kept the table ("ram" or "mmap"); it is a property of the
machine the engine ran on, so ``from_spec`` builds RAM tables unless told otherwise
(``storage=`` / ``storage_dir=``).
"""

from __future__ import annotations

import dataclasses
import math
from collections import ChainMap
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from . import initializers as _init
from . import optimizers as _opt
from .config import Compressor, DynamicVocabulary, FeatureConfig, QuantizationConfig, TableConfig
from .learning_rates import LearningRates, Warmup

__all__ = [
    "NONFINITE_POLICIES",
    "SpecError",
    "engine_options",
    "feature_configs_from_spec",
    "initializer_from_json",
    "initializer_to_json",
    "compressor_entry",
    "dtype_entries",
    "optimizer_from_json",
    "optimizer_to_json",
]

NONFINITE_POLICIES = ("error", "skip_row")


class SpecError(ValueError):
    """A spec that cannot be rebuilt into an engine; the message names the entry."""


def _spec_class(obj, module) -> type:
    """The nearest class of ``obj`` defined in ``module`` (so embengine.tpu.Adam -> Adam)."""
    for cls in type(obj).__mro__:
        if cls.__module__.startswith(module.__name__) and dataclasses.is_dataclass(cls):
            return cls
    raise SpecError(f"{type(obj).__name__} is not an embengine spec")


def _jsonable(value):
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, np.generic):
        return value.item()
    return value


def _name_of(fn) -> str:
    return getattr(fn, "__qualname__", repr(fn))


def optimizer_to_json(opt: _opt.Optimizer, tag: int | None) -> dict:
    """``{"class", "params"}`` of an optimizer; ``tag`` is the learning-rate tag of a callable
    learning rate (the engine numbers them)."""
    cls = _spec_class(opt, _opt)
    entry: dict[str, Any] = {"class": cls.__name__}
    if cls is _opt.Optimizer:
        # An optimizer defined outside embengine: the base class has neither its fields nor its
        # math, so the spec names the user's class, found again among the classes defined in
        # the process that reads it (optimizer_from_json; a manifest never imports code).
        cls = type(opt)
        entry = {"class": cls.__qualname__, "module": cls.__module__}
    params = {}
    for f in dataclasses.fields(cls):
        value = getattr(opt, f.name)
        if f.name == "learning_rate":
            if isinstance(value, _opt.DynamicLearningRate):
                value = {"tag": value.tag}
            elif isinstance(value, Warmup):
                value = {
                    "tag": tag,
                    "callable": _name_of(value),
                    "warmup": {
                        "learning_rate": float(value.learning_rate),
                        "warmup_steps": int(value.warmup_steps),
                    },
                }
            elif callable(value):
                value = {"tag": tag, "callable": _name_of(value)}
            else:
                value = {"constant": float(value)}
        params[f.name] = _jsonable(value)
    return {**entry, "params": params}


def _user_optimizer_class(module: str, qualname: str) -> type:
    """The Optimizer subclass ``module.qualname`` defined (imported) in this process."""
    todo, seen = [_opt.Optimizer], set()
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
    found = [c for c in seen if (c.__module__, c.__qualname__) == (module, qualname)]
    if not found:
        raise SpecError(
            f"the optimizer class {qualname!r} of module {module!r} is not defined in this "
            "process; import the module that defines it before building or loading the engine"
        )
    return found[-1]


def optimizer_from_json(data: Mapping, callables: Mapping[int, Callable]) -> _opt.Optimizer:
    """The optimizer ``optimizer_to_json`` described; a callable learning rate comes from
    ``callables[tag]``."""
    if "module" in data:
        cls = _user_optimizer_class(data["module"], data["class"])
    else:
        cls = getattr(_opt, data["class"], None)
    if not (isinstance(cls, type) and issubclass(cls, _opt.Optimizer)):
        raise SpecError(f"unknown optimizer class {data['class']!r}")
    params = dict(data["params"])
    lr = params["learning_rate"]
    if "constant" in lr:
        params["learning_rate"] = lr["constant"]
    elif "callable" in lr:
        tag = lr["tag"]
        if tag not in callables and "warmup" in lr:
            params["learning_rate"] = _warmup_from_json(lr["warmup"], tag)
        elif tag not in callables:
            raise SpecError(
                f"the learning rate of tag {tag} was the callable {lr['callable']!r}, which is "
                f"not stored; pass callables={{{tag}: <function>}}"
            )
        else:
            params["learning_rate"] = callables[tag]
    else:
        params["learning_rate"] = _opt.DynamicLearningRate(lr["tag"])
    if isinstance(params.get("clipvalue"), list):
        params["clipvalue"] = tuple(params["clipvalue"])
    return cls(**params)


def _warmup_from_json(entry: Any, tag: Any) -> Warmup:
    """The ``Warmup`` a learning rate's ``"warmup"`` entry describes (SpecError if it is not one
    a Monolith optimizer could have made: a finite rate >= 0, an int of steps >= 1)."""
    if not isinstance(entry, Mapping) or set(entry) != {"learning_rate", "warmup_steps"}:
        raise SpecError(
            f"the warm-up of learning-rate tag {tag} must be {{'learning_rate', "
            f"'warmup_steps'}}, got {entry!r:.80}"
        )
    lr, steps = entry["learning_rate"], entry["warmup_steps"]
    good_lr = isinstance(lr, (int, float)) and not isinstance(lr, bool) and math.isfinite(lr)
    if not good_lr or lr < 0:
        raise SpecError(
            f"the warm-up of learning-rate tag {tag}: learning_rate {lr!r} is not a "
            "finite number >= 0"
        )
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise SpecError(
            f"the warm-up of learning-rate tag {tag}: warmup_steps {steps!r} is not an int >= 1"
        )
    return Warmup(float(lr), steps)


def _stored_warmups(tables: Any) -> dict[Any, Warmup]:
    """Tag -> the one ``Warmup`` every table of that tag shares (as the engine that wrote the
    spec shared it: a tag is one callable), from the tables' optimizer entries."""
    out: dict[Any, Warmup] = {}
    for t in tables if isinstance(tables, list) else ():
        try:
            lr = t["optimizer"]["params"]["learning_rate"]
            tag, entry = lr["tag"], lr["warmup"]
        except (KeyError, TypeError):
            continue  # not a warm-up; _table_config names what is missing, if anything
        try:
            hash(tag)
        except TypeError:
            continue
        warmup = _warmup_from_json(entry, tag)
        if out.setdefault(tag, warmup) != warmup:
            raise SpecError(
                f"learning-rate tag {tag} is two warm-ups, {out[tag]} and {warmup}: a tag is "
                "one learning rate"
            )
    return out


def initializer_to_json(init: _init.Initializer) -> dict:
    """``{"class", "params"}`` of an initializer; a FromFunction records its function's name."""
    cls = _spec_class(init, _init)
    if cls is _init.FromFunction:
        return {"class": "FromFunction", "function": _name_of(init.fn)}
    return {"class": cls.__name__, "params": dataclasses.asdict(init)}


def initializer_from_json(
    data: Mapping, table: str, initializers: Mapping[str, _init.Initializer]
) -> _init.Initializer:
    """The initializer ``initializer_to_json`` described. A FromFunction's function is not
    stored: ``initializers[table]`` replaces it, and is required."""
    if data["class"] == "FromFunction":
        if table not in initializers:
            raise SpecError(
                f"the initializer was FromFunction({data.get('function', '?')}), whose "
                f"function is not stored; pass initializers={{{table!r}: <Initializer>}}"
            )
        return initializers[table]
    cls = getattr(_init, data["class"], None)
    if not (isinstance(cls, type) and issubclass(cls, _init.Initializer)):
        raise SpecError(f"unknown initializer class {data['class']!r}")
    return cls(**data.get("params", {}))


def dtype_entries(cfg: TableConfig) -> dict:
    """A table's ``"weights_dtype"`` / ``"slots_dtype"`` keys, only those that are not float32
    (specs and manifests of float32 tables stay as they were)."""
    return {
        k: getattr(cfg, k) for k in ("weights_dtype", "slots_dtype") if getattr(cfg, k) != "float32"
    }


def compressor_entry(cfg: TableConfig) -> dict:
    """A table's ``"compressor"`` key, only when it has one (specs and manifests of tables
    without one stay as they were)."""
    c = cfg.compressor
    if c is None:
        return {}
    return {"compressor": {"compression": c.compression, "fixed_range": c.fixed_range}}


def initializer_for(table: TableConfig, optimizer: _opt.Optimizer) -> _init.Initializer:
    """The table's own initializer, else the optimizer's (e.g. FrequencyEstimator), else TF's."""
    if table.initializer is None and optimizer.default_initializer is not None:
        return optimizer.default_initializer
    return table.effective_initializer


def table_entries(resolved, optimizers, learning_rates: LearningRates, storages, slot_specs):
    """A spec's ``"tables"``: each table of a resolved configuration (``config.resolve``) with
    the initializer and optimizer it trains with (``optimizers[t]``, its learning-rate tag in
    ``learning_rates``), where its rows live (``storages[t]``) and its slots
    (``slot_specs[t]``)."""
    r = resolved
    out = []
    for t, (name, cfg) in enumerate(zip(r.table_names, r.tables, strict=True)):
        opt, q = optimizers[t], cfg.quantization_config
        out.append(
            {
                "name": name,
                "vocabulary_size": cfg.vocabulary_size,  # None: a keyed table
                **({} if cfg.dynamic is None else {"dynamic": dataclasses.asdict(cfg.dynamic)}),
                "dim": cfg.dim,
                "combiner": cfg.combiner,
                "initializer": initializer_to_json(initializer_for(cfg, opt)),
                "optimizer": optimizer_to_json(opt, learning_rates.tag_of(t)),
                "quantization_config": None if q is None else dataclasses.asdict(q),
                **compressor_entry(cfg),
                **dtype_entries(cfg),
                "storage": storages[t],
                "slots": [dataclasses.asdict(s) for s in slot_specs[t]],
            }
        )
    return out


def feature_entries(resolved) -> list[dict]:
    """A spec's ``"features"``: each feature of a resolved configuration
    (``config.resolve``) with its table and options."""
    r = resolved
    return [
        {
            "name": name,
            "table": r.table_names[r.feature_table[name]],
            "max_sequence_length": fc.max_sequence_length,
            "validate_weights_and_indices": fc.validate_weights_and_indices,
            "output_shape": None if fc.output_shape is None else list(fc.output_shape),
        }
        for name, fc in r.features.items()
    ]


def _table_config(
    t: Mapping, callables: Mapping[int, Callable], initializers: Mapping[str, _init.Initializer]
) -> TableConfig:
    opt = optimizer_from_json(t["optimizer"], callables)
    q = t.get("quantization_config")
    dynamic = t.get("dynamic")  # only a keyed table's spec has it
    compressor = t.get("compressor")  # only a table that has one
    cfg = TableConfig(
        t["vocabulary_size"],
        t["dim"],
        initializer=initializer_from_json(t["initializer"], t["name"], initializers),
        optimizer=opt,
        combiner=t["combiner"],
        name=t["name"],
        quantization_config=None if q is None else QuantizationConfig(**q),
        dynamic=None if dynamic is None else DynamicVocabulary(**dynamic),
        compressor=None if compressor is None else Compressor(**compressor),
        weights_dtype=t.get("weights_dtype", "float32"),
        slots_dtype=t.get("slots_dtype", "float32"),
    )
    return cfg


def feature_configs_from_spec(
    spec: Mapping[str, Any],
    callables: Mapping[int, Callable] | None = None,
    initializers: Mapping[str, _init.Initializer] | None = None,
) -> dict[str, FeatureConfig]:
    """Feature name -> FeatureConfig (sharing TableConfigs as the spec's features share tables),
    in the spec's feature order, so an engine built from them has the spec's table order. A
    SpecError names the entry (``tables[1] ('b'): ...``) of a value the configs refuse or a key
    that is missing."""
    if not isinstance(spec, Mapping):
        raise SpecError(f"a spec must be a dict, got {type(spec).__name__}")
    # Not copied: a caller may pass a Mapping that has every key (checkpoint's schema check).
    callables = {} if callables is None else callables
    initializers = {} if initializers is None else initializers
    for key in ("tables", "features"):
        if not isinstance(spec.get(key), list):
            raise SpecError(f"spec[{key!r}] must be a list, got {spec.get(key)!r:.60}")
    # a stored warm-up, one per tag, where the caller passed no callable for it
    callables = ChainMap(callables, _stored_warmups(spec["tables"]))
    tables: dict[str, TableConfig] = {}
    for i, t in enumerate(spec["tables"]):
        name = t.get("name") if isinstance(t, Mapping) else None
        try:
            tables[name] = _table_config(t, callables, initializers)
        except KeyError as e:
            raise SpecError(f"tables[{i}] ({name!r}): no key {e}") from None
        except (TypeError, ValueError) as e:  # SpecError too: add where it is
            raise SpecError(f"tables[{i}] ({name!r}): {e}") from None
        # The slots describe the state's arrays: they must be the ones this optimizer keeps.
        cfg = tables[name]
        slots = [dataclasses.asdict(s) for s in cfg.optimizer.slot_specs(cfg.dim)]
        if "slots" in t and slots != t["slots"]:
            raise SpecError(
                f"tables[{i}].slots {t['slots']} are not the slots of its optimizer "
                f"{t['optimizer']['class']} ({slots})"
            )
    features = {}
    for i, f in enumerate(spec["features"]):
        name = f.get("name") if isinstance(f, Mapping) else None
        try:
            if f["table"] not in tables:
                raise SpecError(f"table {f['table']!r} is not one of {sorted(tables)}")
            shape = f.get("output_shape")
            features[name] = FeatureConfig(
                tables[f["table"]],
                f.get("max_sequence_length", 0),
                f.get("validate_weights_and_indices", True),
                None if shape is None else tuple(shape),
            )
        except KeyError as e:
            raise SpecError(f"features[{i}] ({name!r}): no key {e}") from None
        except (TypeError, ValueError) as e:
            raise SpecError(f"features[{i}] ({name!r}): {e}") from None
    stored = spec.get("learning_rate_tags")
    if isinstance(stored, list):
        # One function passed for two callable tags would merge them: the tags, and so the
        # learning_rates=[...] a caller passes per step, would be renumbered.
        try:
            n = LearningRates([t.optimizer for t in tables.values()], list(tables)).num_tags
        except ValueError as e:
            raise SpecError(f"learning rates: {e}") from None
        if n != len(stored):
            raise SpecError(
                f"the spec has {len(stored)} learning-rate tags, its tables with the callables "
                f"given have {n}: pass a distinct function for each callable tag"
            )
    return features


def engine_options(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The EmbeddingEngine arguments besides the features that a spec records (seed, backend,
    nonfinite_gradients); specs of older checkpoints lack the last two (their defaults)."""
    if "seed" not in spec:
        raise SpecError("the spec has no 'seed'")
    return {
        "seed": spec["seed"],
        "backend": spec.get("backend", "numba"),
        "nonfinite_gradients": spec.get("nonfinite_gradients", "error"),
    }
