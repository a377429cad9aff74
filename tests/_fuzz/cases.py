"""Fuzz cases: what the fuzzer feeds embengine, as plain data drawn by hypothesis.

A case ("recipe") is a JSON-able dict; the child process that runs it builds the real inputs
from it (``execute.run_case``), so a case is small, can be written to a file, replayed alone and
printed in a report::

    {"i": 17, "path": "train", "backend": "numba", "config": "mixed",
     "batch": {feature: {"samples": [[ids], ...], "weights": [[w], ...] | None, "form": str}},
     "fault": {"kind": str, "feature": str | None, ...parameters} | None,
     "grad_seed": int, "lrs": [float] | None, "history": [[key]] (keyed / 16-bit configs)}

``batch`` is the *logical* batch: valid ids of each sample, in range, and their weights. The
form says how it is handed over (a Ragged, a padded array, lists of lists, torch tensors...).
``fault`` (None for a valid case) is one malformation, applied on top by the child: a bad id or
dtype, inconsistent lengths, an array mutated after validation, a batch prepared elsewhere, a
bad gradient or learning rate... Each fault kind declares what the right outcome is:

- ``error``: a clear error and no change of any table or slot;
- ``valid``: the right answer (the fault only changes the representation, e.g. uint64 ids);
- ``either``: a clear error, or the right answer of the logical batch (e.g. offsets mutated
  after a Ragged was built: refusing them, or having kept a copy of the validated ones, are both
  right; reading the mutated ones is not). Results must stay finite (``either`` faults include
  finite inputs whose results overflow: weights of 3e38, learning rates of 1e300).

A keyed table's feature takes any int64 id (-1 is padding in 2-D input only): the faults
``KEYED_VALUES`` put a value the feature's dense twin would refuse (past the vocabulary,
negative, int64's largest, -1 in 1-D input) into a keyed feature as a key, which is valid (the
logical batch holds it); a caller's array mutated after it was passed in is the caller's new
input (``Ragged``'s documented views), except that a training batch holds copies.

Paths (``PATHS``) are every public way a batch reaches the tables; ``FAULTS`` lists every fault
kind with the paths, configs, features and forms it applies to.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import strategies as st

from .configs import (
    ENGINE_CONFIGS,
    KEY_POOL,
    MAX_TIME,
    NEW_CONFIGS,
    SMALL_KEYS,
    SPECS,
    TIMED_CONFIGS,
    TIMES,
    ConfigSpec,
    FeatureSpec,
)

# -- paths and input forms -----------------------------------------------------------------------

# path -> what it calls (see execute.py)
PATHS = {
    "lookup_eval": "EmbeddingEngine.lookup(features, weights, training=False)",
    "train": "EmbeddingEngine.lookup(features, weights) + apply_gradients(grads)",
    "train_eval": "lookup(features, weights) + lookup(..., training=False) + apply_gradients",
    "prepared": "preprocess(features, weights) + lookup(batch) + apply_gradients(batch=batch)",
    "prepared_eval": "preprocess(..., training=False) + lookup(batch, training=False)",
    "torch": "torch EmbeddingLayer(dict of inputs) forward + backward",
    "torch_kjt": "torch EmbeddingLayer(KeyedJagged) forward + backward",
    "torch_prepared": "torch EmbeddingLayer(layer.preprocess(...)) forward + backward",
    "tpu": "tpu.TPUEmbedding enqueue + dequeue + apply_gradients",
    "tpu_serving": "tpu.TPUEmbeddingForServing(features, weights)",
    "serving": "serving.ServingEngine.lookup over an fp32 export (of the config's engine)",
    "train_two": "two training lookups (A, then B), an evaluation lookup, then "
    "apply_gradients(batch=A) and apply_gradients() of B, in either order",
}
TRAINING_PATHS = {
    "train",
    "train_eval",
    "prepared",
    "torch",
    "torch_kjt",
    "torch_prepared",
    "tpu",
    "train_two",
}
# Paths only the new config sets drive (``configs_for``): the dense list stays as it was.
NEW_PATHS = {"train_two"}
# Training paths whose calls take ``timestamp=`` (a timed config's cases carry one).
TIMESTAMP_PATHS = TRAINING_PATHS - {"tpu"}
PREPARED_PATHS = {"prepared", "prepared_eval", "torch_prepared", "serving"}
ENGINE_PATHS = {
    "lookup_eval",
    "train",
    "train_eval",
    "prepared",
    "prepared_eval",
    "torch",
    "torch_prepared",
    "train_two",
}
TPU_PATHS = {"tpu", "tpu_serving"}
ALL_PATHS = set(PATHS)
LR_PATHS = {"train", "train_eval", "prepared", "torch", "torch_kjt", "torch_prepared", "train_two"}

# Forms of one feature's value. "single" forms hold exactly one id per sample.
ENGINE_FORMS = (
    "ragged_offsets",
    "ragged_lengths",
    "lists",
    "tuple_lists",
    "list_of_arrays",
    "padded",
    "torch2d",
    "array1d",
    "flat_list",
    "int32",
    "torch1d",
)
SINGLE_FORMS = {"array1d", "flat_list", "int32", "torch1d", "dense1d", "dense2d", "torch_dense"}
WEIGHT_FORMS = {
    "ragged_offsets",
    "ragged_lengths",
    "lists",
    "tuple_lists",
    "list_of_arrays",
    "padded",
    "torch2d",
    "array1d",
    "flat_list",
    "torch1d",
    "int32",
}
TPU_FORMS = ("ragged_offsets", "lists", "dense1d", "dense2d", "torch_dense")
TPU_SEQ_FORMS = ("ragged_offsets", "lists")
TPU_SERVING_FORMS = ("ragged_offsets", "lists", "dense1d", "torch_dense")
TPU_WEIGHT_FORMS = {"ragged_offsets", "lists"}
RAGGED_FORMS = {"ragged_offsets", "ragged_lengths"}
ARRAY_FORMS = {"array1d", "padded", "int32", "dense1d", "dense2d"}  # a NumPy array the caller owns


def forms_for(path: str, feature: FeatureSpec) -> tuple[str, ...]:
    if path == "torch_kjt":
        return ("kjt",)
    if path == "tpu_serving":
        return TPU_SEQ_FORMS if feature.is_sequence else TPU_SERVING_FORMS
    if path == "tpu":
        return TPU_SEQ_FORMS if feature.is_sequence else TPU_FORMS
    return ENGINE_FORMS


def weight_forms(path: str) -> set[str]:
    return TPU_WEIGHT_FORMS if path in TPU_PATHS else WEIGHT_FORMS


# -- faults --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """One kind of malformation.

    expect: "error", "valid" or "either" (see the module docstring).
    paths: where it applies. configs: which configs (None: any the path takes).
    target: None (the whole batch), "any", "bag" or "seq": the feature it spoils.
    forms: the target feature's forms it can be applied to (None: any of the path's).
    needs_ids: the target feature must hold at least one id (sample 0 gets one).
    names: what a clear error must name (see oracle.clear_error): "feature" (the target),
      "missing" / "extra" (the feature left out / added), "table" (a feature or table name, or
      "pack"), or None (only the type of the error is judged).
    params: hypothesis strategies of the fault's parameters.
    """

    kind: str
    expect: str
    paths: frozenset[str]
    target: str | None = "any"
    forms: frozenset[str] | None = None
    configs: frozenset[str] | None = None
    needs_ids: bool = True
    names: str | None = "feature"
    params: dict = field(default_factory=dict)


def _f(
    kind,
    expect,
    paths,
    target="any",
    forms=None,
    configs=None,
    needs_ids=True,
    names="feature",
    **params,
) -> Fault:
    return Fault(
        kind,
        expect,
        frozenset(paths),
        target,
        None if forms is None else frozenset(forms),
        None if configs is None else frozenset(configs),
        needs_ids,
        names,
        params,
    )


_ANY_INPUT = ALL_PATHS - {"torch_kjt"}
_DICT_INPUT = _ANY_INPUT - TPU_PATHS  # paths taking a dict of engine forms
_PREPARED_ENGINE = {"prepared", "prepared_eval", "torch_prepared"}
_GRAD_PATHS = {"train", "train_eval", "prepared", "tpu", "train_two"}
_APPLY_PATHS = {"train", "train_eval", "prepared", "train_two"}  # they call apply_gradients
_BAD_BIG = st.sampled_from([0, 1, 3, 1 << 20, 1 << 40])
_FLOAT_FORMS = {
    "array1d",
    "padded",
    "ragged_offsets",
    "torch1d",
    "torch2d",
    "dense1d",
    "dense2d",
    "torch_dense",
}
_NONFINITE = st.sampled_from(["nan", "inf", "-inf"])

# Faults whose id is a valid key of a keyed table's feature: the key is part of the logical batch.
KEYED_VALUES = {"id_too_big", "id_int64_max", "id_negative", "id_minus_one", "kjt_id_out_of_range"}
# Faults that narrow or reinterpret a feature's ids: a keyed feature's ids are SMALL_KEYS then.
NARROWING = {"narrow_int_ok", "uint64_ok"}
_OLD_AND_NEW = ENGINE_CONFIGS + NEW_CONFIGS

FAULTS: dict[str, Fault] = {
    f.kind: f
    for f in [
        # ids out of range or not ids at all
        _f("id_too_big", "error", _ANY_INPUT, extra=_BAD_BIG),
        _f("id_int64_max", "error", _ANY_INPUT, forms=ENGINE_FORMS + TPU_FORMS),
        _f(
            "id_negative",
            "error",
            _ANY_INPUT,
            value=st.sampled_from([-2, -7, -(1 << 40), -(1 << 63)]),
            forms=set(ENGINE_FORMS + TPU_FORMS) - {"int32"},
        ),
        _f(
            "id_minus_one",
            "error",
            _ANY_INPUT,
            forms={
                "ragged_offsets",
                "ragged_lengths",
                "lists",
                "tuple_lists",
                "list_of_arrays",
                "array1d",
                "flat_list",
                "int32",
                "torch1d",
            },
        ),
        _f(
            "id_beyond_int64",
            "error",
            _ANY_INPUT,
            forms={"lists", "tuple_lists", "flat_list"},
            value=st.sampled_from([1 << 63, 1 << 64, -(1 << 63) - 1]),
        ),
        _f(
            "dtype_float",
            "error",
            _ANY_INPUT,
            forms=_FLOAT_FORMS,
            fraction=st.sampled_from([0.0, 0.5]),
        ),
        _f(
            "dtype_float_element",
            "error",
            _ANY_INPUT,
            forms={"lists", "tuple_lists", "flat_list"},
            value=st.sampled_from([1.0, 1.5, "nan"]),
        ),
        _f("dtype_object", "error", _ANY_INPUT, forms={"array1d", "padded", "dense1d"}),
        _f("dtype_str", "error", _ANY_INPUT, forms={"array1d", "dense1d", "lists", "flat_list"}),
        _f(
            "dtype_bool",
            "error",
            _ANY_INPUT,
            forms={"array1d", "padded", "lists", "flat_list", "dense1d", "torch1d"},
        ),
        _f("dtype_complex", "error", _ANY_INPUT, forms={"array1d", "dense1d"}),
        _f(
            "uint64_big",
            "error",
            _ANY_INPUT,
            forms={"array1d", "padded", "ragged_offsets", "dense1d", "dense2d"},
        ),
        _f("uint64_ok", "valid", _ANY_INPUT, forms={"array1d", "ragged_offsets", "dense1d"}),
        _f(
            "narrow_int_ok",
            "valid",
            _ANY_INPUT,
            forms={"array1d", "padded", "ragged_offsets", "dense1d", "torch1d", "torch2d"},
            dtype=st.sampled_from(["int8", "int16", "int32", "uint8", "uint16", "uint32"]),
        ),
        _f(
            "noncontiguous_ok",
            "valid",
            _ANY_INPUT,
            forms={"array1d", "padded", "ragged_offsets", "dense1d", "torch1d"},
            needs_ids=False,
        ),
        _f("value_none", "error", _ANY_INPUT, forms=None, needs_ids=False),
        _f("value_scalar", "error", _ANY_INPUT, needs_ids=False),
        _f("value_3d", "error", _ANY_INPUT - {"tpu_serving"}, needs_ids=False),  # serving: any rank
        _f("value_string", "error", _ANY_INPUT, needs_ids=False),
        _f("value_object", "error", _ANY_INPUT, needs_ids=False),
        _f(
            "ragged_lists",
            "error",
            _ANY_INPUT - {"tpu", "tpu_serving"},
            forms={"array1d"},
            needs_ids=False,
        ),  # np.array of ragged lists (dtype object) where an array was meant
        # Ragged structure
        _f(
            "lengths_mismatch",
            "error",
            _ANY_INPUT,
            forms={"ragged_lengths"},
            delta=st.sampled_from([-1, 1, 5]),
        ),
        _f("lengths_negative", "error", _ANY_INPUT, forms={"ragged_lengths"}),
        _f(
            "lengths_overflow",
            "error",
            _ANY_INPUT,
            forms={"ragged_lengths"},
            needs_ids=False,
            variant=st.sampled_from(["two_max", "quarters", "max_last"]),
        ),
        _f(
            "offsets_bad",
            "error",
            _ANY_INPUT,
            forms={"ragged_offsets"},
            needs_ids=False,
            variant=st.sampled_from(["start", "decreasing", "end", "2d", "huge", "empty"]),
        ),
        _f(
            "offsets_mutated",
            "either",
            _ANY_INPUT,
            forms={"ragged_offsets", "ragged_lengths"},
            variant=st.sampled_from(["past_end", "negative", "decreasing", "huge"]),
        ),
        _f(
            "ids_mutated",
            "either",
            _ANY_INPUT,
            forms={"ragged_offsets", "ragged_lengths"},
            value=st.sampled_from([1 << 20, -3, 1 << 62]),
        ),
        _f(
            "caller_ids_mutated",
            "either",
            _ANY_INPUT,
            forms=ARRAY_FORMS | {"ragged_offsets"},
            value=st.sampled_from([1 << 20, -3, 1 << 62]),
            when=st.sampled_from(["after_build", "after_preprocess"]),
        ),
        # weights
        _f("weights_nonfinite", "error", _ANY_INPUT, target="bag", value=_NONFINITE),
        _f("weights_shape", "error", _ANY_INPUT, target="bag", delta=st.sampled_from([-1, 1])),
        _f(
            "weights_dtype",
            "error",
            _ANY_INPUT,
            target="bag",
            dtype=st.sampled_from(["str", "object", "complex"]),
        ),
        _f(
            "weights_huge",
            "either",
            _ANY_INPUT,
            target="bag",
            value=st.sampled_from([3e38, -3e38, 1e30]),
        ),
        _f("weights_zero_sum_ok", "valid", _ANY_INPUT, target="bag"),
        _f("weights_on_sequence", "error", _ANY_INPUT, target="seq"),
        _f(
            "weights_twice",
            "error",
            _ANY_INPUT - TPU_PATHS,
            target="bag",
            forms={"ragged_offsets", "ragged_lengths"},
        ),
        _f(
            "weights_mutated",
            "either",
            _ANY_INPUT,
            target="bag",
            forms={"ragged_offsets", "ragged_lengths"},
            value=_NONFINITE,
        ),
        _f("weights_unknown_feature", "error", _ANY_INPUT - TPU_PATHS, target=None, names="extra"),
        _f("weights_not_mapping", "error", _ANY_INPUT - TPU_PATHS, target=None, names=None),
        # the feature dict
        _f("missing_feature", "error", ALL_PATHS, names="missing", needs_ids=False),
        _f("extra_feature", "error", ALL_PATHS - TPU_PATHS, target=None, names="extra"),
        _f("features_not_mapping", "error", _DICT_INPUT | TPU_PATHS, target=None, names=None),
        _f(
            "wrong_nesting",
            "error",
            TPU_PATHS,
            target=None,
            names="missing",
            variant=st.sampled_from(["flat", "list", "extra_key"]),
        ),
        # prepared batches
        _f(
            "foreign_vocab_out",
            "error",
            PREPARED_PATHS,
            configs=ENGINE_CONFIGS,
            names="table",
            target=None,
        ),
        _f(
            "foreign_vocab_in",
            "either",
            PREPARED_PATHS,
            configs=ENGINE_CONFIGS,
            names="table",
            target=None,
        ),
        _f(
            "foreign_packing",
            "error",
            PREPARED_PATHS - {"serving"},
            configs={"packed"},
            names="table",
            target=None,
        ),
        _f("foreign_features", "error", PREPARED_PATHS, names="table", target=None),
        _f("twin_batch", "valid", PREPARED_PATHS - {"serving"}, target=None),
        _f(
            "batch_mutated",
            "either",
            PREPARED_PATHS,
            target=None,
            names=None,
            array=st.integers(0, 7),
            value=st.sampled_from([1 << 20, -5, 1 << 62, "nan"]),
        ),
        _f(
            "lookup_only_batch_trained",
            "error",
            {"prepared", "torch_prepared"},
            target=None,
            names=None,
        ),
        _f("batch_with_weights", "error", _PREPARED_ENGINE, target=None, names=None),
        _f("not_a_batch", "error", {"prepared"}, target=None, names=None),
        # gradients
        _f(
            "grad_shape",
            "error",
            _GRAD_PATHS,
            needs_ids=False,
            variant=st.sampled_from(["row", "col", "flat", "transposed"]),
        ),
        _f(
            "grad_nonfinite",
            "error",
            _GRAD_PATHS,
            configs={"mixed", "packed", "tpu", *NEW_CONFIGS} - {"keyed_half"},
            value=_NONFINITE,
        ),
        _f(
            "grad_nonfinite_skip",
            "valid",
            _GRAD_PATHS,
            configs={"dynamic", "keyed_half"},
            value=_NONFINITE,
        ),
        _f(
            "grad_dtype",
            "error",
            _GRAD_PATHS,
            needs_ids=False,
            dtype=st.sampled_from(["str", "object", "complex", "bool"]),
        ),
        _f("grad_missing", "error", _GRAD_PATHS - {"tpu"}, names="missing", needs_ids=False),
        _f("grad_none_tpu", "valid", {"tpu"}, needs_ids=False),
        _f("grad_extra", "error", _GRAD_PATHS, target=None, names="extra"),
        _f("grad_not_mapping", "error", _GRAD_PATHS, target=None, names=None),
        _f("grad_list", "error", {"tpu"}, needs_ids=False),
        _f(
            "grad_representation_ok",
            "valid",
            _GRAD_PATHS - {"tpu"},
            needs_ids=False,
            variant=st.sampled_from(["float64", "int64", "list", "torch", "fortran", "strided"]),
        ),
        _f("grad_huge", "either", _GRAD_PATHS, value=st.sampled_from([3e38, -1e38, 1e30])),
        _f(
            "grad_nan_backward",
            "error",
            {"torch", "torch_kjt", "torch_prepared"},
            configs={"mixed", "packed", *NEW_CONFIGS} - {"keyed_half"},
        ),
        # learning rates (the dynamic config's two tags)
        _f(
            "lr_bad",
            "error",
            LR_PATHS,
            configs={"dynamic"},
            target=None,
            names=None,
            value=st.sampled_from(["nan", "inf", -0.5, "str", None, "-inf"]),
            tag=st.integers(0, 1),
        ),
        _f(
            "lr_count",
            "error",
            LR_PATHS,
            configs={"dynamic"},
            target=None,
            names=None,
            count=st.sampled_from([0, 1, 3]),
        ),
        _f("lr_missing", "error", LR_PATHS, configs={"dynamic"}, target=None, names=None),
        _f(
            "lr_unexpected",
            "error",
            LR_PATHS,
            configs={"mixed", "packed", *NEW_CONFIGS},
            target=None,
            names=None,
        ),
        _f(
            "lr_extreme",
            "either",
            LR_PATHS,
            configs={"dynamic"},
            target=None,
            names=None,
            value=st.sampled_from([0.0, 1e300, 1e-320, 3e38]),
            tag=st.integers(0, 1),
        ),
        # KeyedJagged
        _f("kjt_lengths_overflow", "error", {"torch_kjt"}, target=None, names=None),
        _f(
            "kjt_lengths_mismatch",
            "error",
            {"torch_kjt"},
            target=None,
            names=None,
            delta=st.sampled_from([-1, 1]),
        ),
        _f("kjt_lengths_negative", "error", {"torch_kjt"}, names=None),
        _f(
            "kjt_offsets_bad",
            "error",
            {"torch_kjt"},
            target=None,
            names=None,
            variant=st.sampled_from(["start", "decreasing"]),
        ),
        _f("kjt_unknown_key", "error", {"torch_kjt"}, target=None, names="extra"),
        _f("kjt_duplicate_key", "error", {"torch_kjt"}, target=None, names=None),
        _f(
            "kjt_float_values",
            "error",
            {"torch_kjt"},
            target=None,
            names=None,
            fraction=st.sampled_from([0.0, 0.5]),
        ),
        _f("kjt_weights_length", "error", {"torch_kjt"}, target=None, names=None),
        _f("kjt_id_out_of_range", "error", {"torch_kjt"}, extra=_BAD_BIG),
        # the TF port's own rules
        _f("tpu_dense_weights", "error", TPU_PATHS, target="bag", forms={"dense1d", "torch_dense"}),
        _f("tpu_dense_last_dim", "error", {"tpu"}, forms={"dense2d"}, needs_ids=False),
        _f("tpu_dense_sequence", "error", {"tpu_serving"}, target="seq", needs_ids=False),
        _f("tpu_grad_nested", "error", {"tpu"}, target=None, names="missing"),
        # timestamps (the timed configs: every training call carries one)
        _f(
            "timestamp_bad",
            "error",
            TIMESTAMP_PATHS,
            configs=TIMED_CONFIGS,
            target=None,
            names=None,
            needs_ids=False,
            value=st.sampled_from(
                [-1, 1 << 62, -(1 << 63), 1 << 64, 1.5, float(1 << 20), "nan", "1000", True]
            ),
            at=st.sampled_from(["lookup", "apply"]),
        ),
        _f(
            "timestamp_missing",
            "error",
            TIMESTAMP_PATHS,
            configs=TIMED_CONFIGS,
            target=None,
            names="table",
            needs_ids=False,
        ),
        _f(
            "timestamp_eval",
            "error",
            {"lookup_eval", "prepared_eval", "train_eval"},
            configs=TIMED_CONFIGS,
            target=None,
            names=None,
            needs_ids=False,
        ),
        _f(
            "timestamp_repr_ok",
            "valid",
            TIMESTAMP_PATHS,
            configs=TIMED_CONFIGS,
            target=None,
            names=None,
            needs_ids=False,
            dtype=st.sampled_from(["int64", "uint64", "int32"]),
        ),
    ]
}


def applicable(fault: Fault, path: str, config: str) -> bool:
    """The fault can be built on this path and config (a feature of it can carry it)."""
    if path not in fault.paths:
        return False
    if fault.configs is not None and config not in fault.configs:
        return False
    return fault.target is None or any(_target_ok(fault, path, f) for f in SPECS[config].features)


def configs_for(path: str, configs: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The configs a path drives, of ``configs`` (None: the dense float32 ones, ENGINE_CONFIGS,
    "tpu"; the keyed and 16-bit configs are asked for by name)."""
    if configs is None and path in NEW_PATHS:
        return ()
    if path in TPU_PATHS:
        out: tuple[str, ...] = ("tpu",)
    elif path == "serving":
        out = ("mixed", *NEW_CONFIGS)
    elif path == "train_eval":  # a keyed table's pending step: the new configs only
        out = NEW_CONFIGS
    else:
        out = _OLD_AND_NEW
    if configs is None:
        configs = (*ENGINE_CONFIGS, "tpu")
    return tuple(c for c in out if c in configs)


def backends_for(path: str) -> tuple[str, ...]:
    return ("serving",) if path == "serving" else ("numba", "reference")


def _target_ok(fault: Fault, path: str, f: FeatureSpec) -> bool:
    if fault.target == "bag" and f.is_sequence:
        return False
    if fault.target == "seq" and not f.is_sequence:
        return False
    if fault.forms is None:
        return True
    forms = set(forms_for(path, f))
    if fault.target == "bag" and fault.kind.startswith("weights"):
        forms &= weight_forms(path)
    return bool(forms & fault.forms)


# -- the strategy --------------------------------------------------------------------------------

_WEIGHTS = st.sampled_from([1.0, 0.5, 2.0, -1.0, 0.0, 1.5, 0.25, 3.0])
_LRS = st.sampled_from([0.1, 0.05, 0.5, 1.0, 0.01])


@st.composite
def _samples(draw, f: FeatureSpec, form: str, batch_size: int, need_id: bool, narrow: bool = False):
    if form in SINGLE_FORMS:
        lengths = [1] * batch_size
    else:
        lengths = [draw(st.integers(0, 4)) for _ in range(batch_size)]
        if need_id and batch_size and lengths[0] == 0:
            lengths[0] = 1
    if f.keyed:  # keys (KEY_POOL); SMALL_KEYS where the form or a fault narrows the ids
        ids = st.sampled_from(SMALL_KEYS if narrow or form == "int32" else KEY_POOL)
    else:
        ids = st.integers(0, f.vocab - 1)
    return [[draw(ids) for _ in range(n)] for n in lengths]


VALID = "valid"  # the stratum of cases without a fault


@st.composite
def recipes(
    draw,
    paths: tuple[str, ...] | None = None,
    backend: str | None = None,
    kind: str | None = None,
    configs: tuple[str, ...] | None = None,
) -> dict:
    """One fuzz case (see the module docstring); ``backend`` and ``kind`` (a fault kind, or
    VALID) fix those choices; ``configs`` the configs to draw from (``configs_for``)."""
    allowed = configs
    paths = tuple(p for p in sorted(paths or PATHS) if configs_for(p, allowed))
    path = draw(st.sampled_from(paths))
    if backend is None:
        backend = draw(st.sampled_from(backends_for(path)))
    configs = configs_for(path, allowed)
    if kind not in (None, VALID):
        configs = tuple(c for c in configs if applicable(FAULTS[kind], path, c))
    config = draw(st.sampled_from(configs))
    spec: ConfigSpec = SPECS[config]
    kinds = sorted(k for k, f in FAULTS.items() if applicable(f, path, config))
    fault = None
    target = None
    with_fault = draw(st.integers(0, 4)) > 0 if kind is None else kind != VALID
    if with_fault and kinds:  # by default 4 in 5 cases carry a fault
        kind = kind or draw(st.sampled_from(kinds))
        fdef = FAULTS[kind]
        fault = {"kind": kind, "feature": None}
        if fdef.target is not None or fdef.names == "missing":
            choices = [f.name for f in spec.features if _target_ok(fdef, path, f)]
            if not choices:
                fault = None  # no feature of this config can carry it: a valid case
            else:
                target = draw(st.sampled_from(choices))
                fault["feature"] = target
        if fault is not None:
            for name, strategy in fdef.params.items():
                fault[name] = draw(strategy)
    fdef = FAULTS[fault["kind"]] if fault else None
    batch_size = draw(st.integers(0, 4))
    if fdef is not None and fdef.needs_ids and (target is not None or fdef.target is None):
        batch_size = max(batch_size, 1)
    batch = {}
    for f in spec.features:
        forms = forms_for(path, f)
        if f.name == target and fdef.forms is not None:
            allowed = set(fdef.forms)
            if fdef.target == "bag" and fdef.kind.startswith("weights"):
                allowed &= weight_forms(path)
            forms = tuple(x for x in forms if x in allowed)
        if f.name == target and fdef.kind.startswith("weights"):
            forms = tuple(x for x in forms if x in weight_forms(path)) or forms
        form = draw(st.sampled_from(forms))
        need_id = f.name == target and fdef.needs_ids
        narrow = f.name == target and fdef.kind in NARROWING
        samples = draw(
            _samples(
                f, form, batch_size, need_id or (fdef is not None and fdef.target is None), narrow
            )
        )
        weights = None
        weighted = not f.is_sequence and form in weight_forms(path)
        if weighted and (
            draw(st.integers(0, 2)) == 0
            or (f.name == target and fdef.kind.startswith("weights") and fdef.target == "bag")
        ):
            weights = [[draw(_WEIGHTS) for _ in s] for s in samples]
        if f.name == target and fdef.kind == "weights_zero_sum_ok":
            weights = [[(1.0 if k % 2 == 0 else -1.0) for k in range(len(s))] for s in samples]
        batch[f.name] = {"samples": samples, "weights": weights, "form": form}
    if path == "torch_kjt" or (fdef is not None and fdef.kind == "kjt_weights_length"):
        for fb in batch.values():
            fb["weights"] = None  # a KeyedJagged carries all features' weights or none
    lrs = [draw(_LRS) for _ in range(spec.dynamic_tags)] if spec.dynamic_tags else None
    out = {
        "path": path,
        "backend": backend,
        "config": config,
        "batch": batch,
        "fault": fault,
        "grad_seed": draw(st.integers(0, 2**32 - 1)),
        "lrs": lrs,
    }
    if spec.prelude and path != "serving":
        # up to 3 more training steps after the prelude (configs.build_engine): other rows,
        # counts, ages and steps for the rules to meet (drawn last: the dense configs' cases
        # are the same as before)
        step = st.lists(st.sampled_from(KEY_POOL), min_size=1, max_size=6)
        out["history"] = draw(st.lists(step, max_size=3))
    # drawn after the rest: the cases of the configs and paths before these came are the same
    times = st.sampled_from(TIMES) | st.just(MAX_TIME)
    if spec.timed and path != "serving":
        out["history_times"] = [draw(times) for _ in out["history"]]
    if path == "train_two":
        # batch B: valid, any form; A (``batch``) carries the fault
        size2 = draw(st.integers(0, 4))
        batch2 = {}
        for f in spec.features:
            form = draw(st.sampled_from(ENGINE_FORMS))
            samples = draw(_samples(f, form, size2, False))
            weights = None
            if not f.is_sequence and form in WEIGHT_FORMS and draw(st.integers(0, 2)) == 0:
                weights = [[draw(_WEIGHTS) for _ in s] for s in samples]
            batch2[f.name] = {"samples": samples, "weights": weights, "form": form}
        out["batch2"] = batch2
        out["grad_seed2"] = draw(st.integers(0, 2**32 - 1))
        out["via"] = draw(st.sampled_from(["prepared", "with_batch"]))
        out["order"] = draw(st.sampled_from(["batch_first", "pending_first"]))
        out["eval"] = draw(st.booleans())
    if spec.timed and path in TIMESTAMP_PATHS:
        # each training call's timestamp (an update's None: its step's lookup's)
        out["timestamps"] = {
            "lookup": draw(times),
            "apply": draw(st.none() | times),
            "lookup2": draw(times),
            "apply2": draw(st.none() | times),
        }
    return out


def _draw(strategy, n: int, seed: int) -> list[dict]:
    """``n`` examples of ``strategy``, drawn by hypothesis from ``seed``: the same list for the
    same arguments and hypothesis version (generation only: no database, no shrinking)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    out: list[dict] = []

    @hseed(seed)
    @settings(
        max_examples=n,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(case):
        out.append(case)

    collect()
    return out


def generate(
    n: int,
    seed: int,
    paths: tuple[str, ...] | None = None,
    run: int = 10,
    configs: tuple[str, ...] | None = None,
) -> list[dict]:
    """``n`` cases drawn at random over every path, backend and fault, in short hypothesis runs
    of ``run`` cases: a long run keeps mutating its recent cases (runs of cases alike), and
    each run's first, simplest case (no fault, no sample) is dropped. ``configs``: as
    ``configs_for`` (None: the dense float32 configs, the same cases as before the keyed and
    16-bit configs came)."""
    out: list[dict] = []
    for k in range(0, n, run):
        out += _draw(recipes(paths, configs=configs), min(run, n - k) + 1, seed * 100_003 + k)[1:]
    for i, case in enumerate(out):
        case["i"] = i
    return out


def strata(
    paths: tuple[str, ...] | None = None, configs: tuple[str, ...] | None = None
) -> list[tuple[str, str, str]]:
    """Every (path, backend, fault kind or VALID) the fuzzer can build (on ``configs``, as
    ``configs_for``)."""
    out = []
    for path in sorted(paths or PATHS):
        cs = configs_for(path, configs)
        if not cs:
            continue
        kinds = sorted({k for k, f in FAULTS.items() for c in cs if applicable(f, path, c)})
        for backend in backends_for(path):
            out += [(path, backend, k) for k in [VALID, *kinds]]
    return out


def generate_stratified(
    per_stratum: int,
    seed: int,
    paths: tuple[str, ...] | None = None,
    configs: tuple[str, ...] | None = None,
    backends: tuple[str, ...] | None = None,
    kinds: tuple[str, ...] | None = None,
) -> list[dict]:
    """``per_stratum`` cases of every stratum (``strata``): each path on each backend meets
    every fault that applies to it, and valid batches. Hypothesis's first example of a stratum
    is its simplest (the first feature, form and variant, one sample or none): it is dropped,
    so that the cases spread over features, forms and variants. ``backends`` and ``kinds``
    keep only those strata (a short list: test_fuzz.py's keyed and 16-bit cases)."""
    out = []
    for k, (path, backend, kind) in enumerate(strata(paths, configs)):
        if (backends and backend not in backends) or (kinds and kind not in kinds):
            continue
        strategy = recipes((path,), backend, kind, configs)
        out += _draw(strategy, per_stratum + 1, seed * 100_003 + k)[1:]
    for i, case in enumerate(out):
        case["i"] = i
    return out
