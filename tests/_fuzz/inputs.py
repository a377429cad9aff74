"""Building a fuzz case's inputs: its logical batch in the case's forms, with its fault applied.

Everything handed to embengine goes through ``api(stage, fn, ...)``, so that an exception raised
by embengine (or by NumPy or torch inside it) is told apart from a failure of the harness:
"build" (constructing an input object: ``Ragged``, ``KeyedJagged``), "mutate" (assigning into
one after it was built), "call" (the engine, layer, TF port or serving engine), "backward"
(torch's backward, which applies the update).
"""

from __future__ import annotations

import copy

import numpy as np

from .cases import TPU_PATHS
from .configs import SPECS, build_engine

M64 = (1 << 63) - 1


class ApiError(Exception):
    """An exception raised by embengine (or torch / NumPy called by it), with the stage."""

    def __init__(self, error: BaseException, stage: str):
        super().__init__(repr(error))
        self.error = error
        self.stage = stage


def api(stage: str, fn, *args, **kwargs):
    """Call public API: its exceptions are results to judge, not harness failures."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - every exception is judged
        raise ApiError(e, stage) from e


# -- one feature's value ------------------------------------------------------------------------


def _flat(samples):
    return [x for s in samples for x in s]


def _lengths(samples):
    return [len(s) for s in samples]


def _offsets(samples):
    return np.concatenate([[0], np.cumsum(_lengths(samples), dtype=np.int64)]).astype(np.int64)


def _padded(samples, fill=-1, dtype=np.int64):
    width = max(_lengths(samples), default=0)
    out = np.full((len(samples), width), fill, dtype=dtype)
    for i, s in enumerate(samples):
        out[i, : len(s)] = s
    return out


def _single(samples):
    return [s[0] for s in samples]


class Built:
    """One feature's value, weights and the handles a fault may mutate later."""

    def __init__(self, value, weights=None):
        self.value = value
        self.weights = weights  # what goes into weights= (None: nothing)
        self.ragged = None  # the Ragged built, if any
        self.caller_ids = None  # the NumPy array the caller owns and may mutate


def _id_array(ids: list, fault: dict | None, shape=None) -> np.ndarray:
    """ids as the fault wants their dtype (int64 by default)."""
    kind = fault["kind"] if fault else None
    a = np.asarray(ids, dtype=np.int64)
    if shape is not None:
        a = a.reshape(shape)
    if kind == "dtype_float":
        return a.astype(np.float64) + fault["fraction"]
    if kind == "dtype_object":
        return a.astype(object)
    if kind == "dtype_str":
        return a.astype(str)
    if kind == "dtype_bool":
        return a > 0
    if kind == "dtype_complex":
        return a.astype(np.complex128)
    if kind in ("uint64_big", "uint64_ok"):
        u = np.where(a < 0, 0, a).astype(np.uint64) if kind == "uint64_big" else a.astype(np.uint64)
        if kind == "uint64_big" and u.size:
            # the first id, not padding (a keyed feature's negative keys are ids too)
            u.reshape(-1)[np.flatnonzero(a.reshape(-1) != -1)[:1]] = np.uint64((1 << 63) + 5)
        return u
    if kind == "narrow_int_ok":
        dtype = np.dtype(fault["dtype"])
        if dtype.kind == "u" and (a < 0).any():  # -1 padding needs a signed type
            dtype = np.dtype(f"int{dtype.itemsize * 8}")
        return a.astype(dtype)
    if kind == "noncontiguous_ok":
        if a.ndim == 1:
            return np.repeat(a, 2)[::2]
        return np.repeat(a, 2, axis=1)[:, ::2]
    return a


def _weights_array(ws: list, fault: dict | None, shape=None):
    a = np.asarray(ws, dtype=np.float32)
    if shape is not None:
        a = a.reshape(shape)
    if fault and fault["kind"] == "weights_dtype":
        return {
            "str": a.astype(str),
            "object": a.astype(object),
            "complex": a.astype(np.complex64),
        }[fault["dtype"]]
    return a


def build_feature(fs, fb: dict, path: str, fault: dict | None):
    """One feature's input in its form, with this feature's fault (``fault`` is None unless it
    targets this feature) applied to the representation."""
    import torch

    import embengine as ee

    kind = fault["kind"] if fault else None
    samples = copy.deepcopy(fb["samples"])
    weights = copy.deepcopy(fb["weights"])
    form = fb["form"]
    if kind in ("id_too_big", "kjt_id_out_of_range", "id_int64_max", "id_negative", "id_minus_one"):
        samples[0][0] = fault_id(fs, fault)
    elif kind == "id_beyond_int64":
        samples[0][0] = fault["value"]
    elif kind == "dtype_float_element":
        samples[0][0] = float(fault["value"]) if fault["value"] != 1.5 else 1.5
    elif kind == "dtype_str" and form in ("lists", "flat_list"):
        samples[0][0] = str(samples[0][0])
    elif kind == "dtype_bool" and form in ("lists", "flat_list"):
        samples[0][0] = True
    if kind in ("weights_nonfinite", "weights_mutated") and weights is None:
        weights = [[1.0] * len(s) for s in samples]
    if kind == "weights_nonfinite":
        weights[0][0] = float(fault["value"])
    if kind in ("weights_on_sequence", "tpu_dense_weights", "weights_twice") and weights is None:
        weights = [[1.0] * len(s) for s in samples]
    if kind == "weights_shape" and weights is None:
        weights = [[1.0] * len(s) for s in samples]

    def shaped_weights(ws_flat):
        ws_flat = list(ws_flat)
        if kind == "weights_shape":
            ws_flat = ws_flat + [1.0] if fault["delta"] > 0 else ws_flat[:-1]
        return _weights_array(ws_flat, fault)

    if form in ("ragged_offsets", "ragged_lengths"):
        ids = _id_array(_flat(samples), fault)
        w = None if weights is None else shaped_weights(_flat(weights))
        built = Built(None)
        built.caller_ids = ids
        if form == "ragged_offsets":
            offsets = _offsets(samples)
            if kind == "offsets_bad":
                offsets = _bad_offsets(offsets, len(ids), fault["variant"])
            r = api("build", ee.Ragged, ids, offsets=offsets, weights=w)
        else:
            lengths = np.asarray(_lengths(samples), dtype=np.int64)
            if kind == "lengths_mismatch":
                lengths[-1] += fault["delta"]
            elif kind == "lengths_negative":
                lengths[0] = -1
            elif kind == "lengths_overflow":
                lengths = _overflow_lengths(len(ids), fault["variant"])
            r = api("build", ee.Ragged, ids, lengths=lengths, weights=w)
        built.value = built.ragged = r
        if kind == "weights_twice":
            built.weights = _weights_array(_flat(weights), None)
        return built
    if form in ("lists", "tuple_lists", "list_of_arrays"):
        if form == "list_of_arrays":
            value = [_id_array(s, fault) for s in samples]
        else:
            value = [list(s) for s in samples]
            if form == "tuple_lists":
                value = tuple(value)
        w = None
        if weights is not None:
            w = [list(ws) for ws in weights]
            if kind == "weights_shape":
                w[0] = w[0] + [1.0] if fault["delta"] > 0 else w[0][:-1]
            if kind == "weights_dtype":
                w = [
                    [{"str": "x", "object": object(), "complex": 1j}[fault["dtype"]] for _ in ws]
                    for ws in w
                ]
        return Built(value, w)
    if form in ("padded", "torch2d"):
        pad = _padded(samples)
        arr = _id_array(pad.reshape(-1), fault, pad.shape)
        w = None
        if weights is not None:
            w = _padded(weights, 0.0, np.float32)
            if kind == "weights_shape":
                w = np.pad(w, ((0, 0), (0, 1))) if fault["delta"] > 0 else w[:, :-1]
            w = _weights_array(w, fault)
        if form == "torch2d":
            arr = torch.from_numpy(np.ascontiguousarray(arr)) if arr.dtype.kind in "iub" else arr
            if isinstance(arr, np.ndarray) and arr.dtype.kind == "f":
                arr = torch.from_numpy(arr)
            if w is not None and w.dtype.kind == "f":
                w = torch.from_numpy(w)
        built = Built(arr, w)
        built.caller_ids = arr if isinstance(arr, np.ndarray) else None
        return built
    if form in ("array1d", "int32", "dense1d", "dense2d", "torch1d", "torch_dense"):
        ids = _single(samples)
        if form == "int32" and not kind:
            arr = np.asarray(ids, dtype=np.int32)
        elif form == "int32":
            arr = _id_array(ids, fault)
            if arr.dtype == np.int64 and all(-(1 << 31) <= x < (1 << 31) for x in ids):
                arr = arr.astype(np.int32)
        else:
            arr = _id_array(ids, fault)
        if form == "dense2d":
            arr = arr.reshape(-1, 1)
            if kind == "tpu_dense_last_dim":
                arr = np.concatenate([arr, arr], axis=1)
        w = None
        if weights is not None:
            w = shaped_weights(_single(weights))
        if form in ("torch1d", "torch_dense"):
            arr = torch.from_numpy(np.ascontiguousarray(arr)) if arr.dtype.kind in "iubf" else arr
            if kind == "noncontiguous_ok":
                arr = torch.from_numpy(np.repeat(np.asarray(ids, np.int64), 2))[::2]
        built = Built(arr, w)
        built.caller_ids = arr if isinstance(arr, np.ndarray) else None
        return built
    if form == "flat_list":
        value = _single(samples)
        if kind == "dtype_str":
            value = [str(x) for x in value]
        w = None
        if weights is not None:
            w = list(_single(weights))
            if kind == "weights_shape":
                w = w + [1.0] if fault["delta"] > 0 else w[:-1]
            if kind == "weights_dtype":
                w = [{"str": "x", "object": object(), "complex": 1j}[fault["dtype"]] for _ in w]
        return Built(value, w)
    raise AssertionError(f"unknown form {form!r}")


def _bad_offsets(offsets: np.ndarray, n: int, variant: str) -> np.ndarray:
    o = offsets.copy()
    if variant == "start":
        o[0] = 1
    elif variant == "decreasing":
        o = np.array([0, n + 1, n], dtype=np.int64)
    elif variant == "end":
        o[-1] = n + 1
    elif variant == "2d":
        o = o.reshape(1, -1)
    elif variant == "huge":
        o = np.array([0, 1 << 62, n], dtype=np.int64)
    elif variant == "empty":
        o = np.zeros(0, dtype=np.int64)
    return o


def _overflow_lengths(n: int, variant: str) -> np.ndarray:
    """Lengths whose int64 sum wraps around to ``n`` (the number of ids)."""
    if variant == "two_max":
        return np.array([M64, M64, n + 2], dtype=np.int64)
    if variant == "quarters":
        return np.array([1 << 62] * 4 + [n], dtype=np.int64)
    return np.array([n + 2, M64, M64], dtype=np.int64)  # "max_last"


def _mutate_built(built: Built, fs, fault: dict) -> None:
    """Faults that change an input after it was built (and validated by its constructor)."""
    kind = fault["kind"]
    if kind == "offsets_mutated":
        r = built.ragged
        n = len(r.ids)
        v = fault["variant"]

        def set_offset():
            if v == "past_end":
                r.offsets[-1] = n + 1000
            elif v == "negative":
                r.offsets[1] = -5
            elif v == "decreasing":
                r.offsets[1] = n + 3
            else:
                r.offsets[-1] = 1 << 62

        api("mutate", set_offset)
    elif kind == "ids_mutated":
        api("mutate", _setitem, built.ragged.ids, 0, fault["value"])
    elif kind == "weights_mutated":
        api("mutate", _setitem, built.ragged.weights, 0, float(fault["value"]))


def _setitem(array, index, value):
    array[index] = value


def _fits(array: np.ndarray, value: int) -> int:
    info = np.iinfo(array.dtype)
    return value if info.min <= value <= info.max else 1 << 20


# -- gradients and learning rates ----------------------------------------------------------------


def history(recipe: dict) -> tuple:
    """A keyed / 16-bit case's steps after the prelude (configs.build_engine), as tuples."""
    return tuple(tuple(step) for step in recipe.get("history") or ())


def history_times(recipe: dict) -> tuple:
    """A timed config's history steps' timestamps (configs.build_engine)."""
    return tuple(recipe.get("history_times") or ())


_INT32_MAX = (1 << 31) - 1


def timestamps(recipe: dict, clean: bool) -> dict:
    """The ``timestamp=`` of each call of the case (None: none given): "lookup" and "apply"
    (batch A's), "lookup2" and "apply2" (train_two's batch B), "eval" (an evaluation lookup);
    with the case's timestamp fault unless ``clean`` (a timestamp of another integer type is
    its value: clipped to int32's largest if the fault gives it that type). Paths that do not
    call apply_gradients themselves (torch's backward) take the lookup's."""
    out = dict.fromkeys(("lookup", "apply", "lookup2", "apply2", "eval"))
    out.update(recipe.get("timestamps") or {})
    applies = recipe.get("case_path", recipe["path"]) in (
        "train",
        "train_eval",
        "prepared",
        "train_two",
    )
    if not applies:
        out["apply"] = out["apply2"] = None
    fault = recipe["fault"]
    kind = fault["kind"] if fault else None
    if kind == "timestamp_repr_ok" and fault["dtype"] == "int32":
        out = {k: v if v is None else min(v, _INT32_MAX) for k, v in out.items()}
    if clean:
        return out
    if kind == "timestamp_repr_ok":
        out = {k: v if v is None else np.dtype(fault["dtype"]).type(v) for k, v in out.items()}
    elif kind == "timestamp_bad":
        at = fault["at"] if applies else "lookup"
        v = fault["value"]
        out[at] = float("nan") if v == "nan" else v
    elif kind == "timestamp_missing":
        out = dict.fromkeys(out)
    elif kind == "timestamp_eval":
        out["eval"] = out["lookup"] or 1_000_090
    return out


def ts(value) -> dict:
    """``timestamp=value`` as keyword arguments ({} for None)."""
    return {} if value is None else {"timestamp": value}


def fault_id(fs, fault: dict) -> int:
    """The id an id fault puts at sample 0's first place."""
    kind = fault["kind"]
    if kind in ("id_too_big", "kjt_id_out_of_range"):
        return fs.vocab + fault["extra"]
    if kind == "id_int64_max":
        return M64
    if kind == "id_negative":
        return fault["value"]
    if kind == "id_minus_one":
        return -1
    raise AssertionError(kind)


def keyed_change(recipe: dict) -> str | None:
    """How the case's fault changes a keyed feature's logical ids (see the cases module):
    "value" (the faulty id is a key of the logical batch), "mutated" (the caller's array was
    changed before the engine read it: the new value is the input), "either" (a lookup-only
    batch prepared before the change: it may keep the ids or see the change), or None."""
    from .cases import KEYED_VALUES

    fault = recipe["fault"]
    if not fault or not fault.get("feature"):
        return None
    spec = SPECS[recipe["config"]]
    if fault["feature"] not in spec.names or not spec.feature(fault["feature"]).keyed:
        return None
    if fault["kind"] in KEYED_VALUES:
        return "value"
    if fault["kind"] == "caller_ids_mutated":
        case = dict(recipe, path=recipe.get("case_path", recipe["path"]))  # not the clean run's
        if not late_mutation(case):
            return "mutated"
        return "either" if case["path"] == "prepared_eval" else None  # training: copies
    return None


def logical_batch(recipe: dict, mutated: bool = True) -> dict:
    """The batch the right answer is computed from: the recipe's, with the faults that change
    values rather than their representation applied (a weight of 3e38 is a weight; a keyed
    feature's key past a dense vocabulary is a key: ``keyed_change``; ``mutated`` False: the
    alternative of an "either" change, the ids before it)."""
    batch = copy.deepcopy(recipe["batch"])
    fault = recipe["fault"]
    if fault and fault["kind"] == "weights_huge":
        fb = batch[fault["feature"]]
        if fb["weights"] is None:
            fb["weights"] = [[1.0] * len(s) for s in fb["samples"]]
        fb["weights"][0][0] = float(fault["value"])
    change = keyed_change(recipe)
    if change == "value":
        fs = SPECS[recipe["config"]].feature(fault["feature"])
        batch[fault["feature"]]["samples"][0][0] = fault_id(fs, fault)
    elif change in ("mutated", "either") and mutated:
        fb = batch[fault["feature"]]
        v = fault["value"]
        if fb["form"] == "int32" and not -(1 << 31) <= v < (1 << 31):
            v = 1 << 20  # _fits
        fb["samples"][0][0] = v
    return batch


def expected_shape(fs, fb: dict, path: str) -> tuple[int, ...]:
    b = len(fb["samples"])
    if fs.is_sequence:
        return (b, fs.seq, fs.dim)
    return (b, fs.dim)


def base_grads(spec, recipe) -> dict[str, np.ndarray]:
    """The logical gradient of every feature: multiples of 1/4 (exact in float32)."""
    rng = np.random.default_rng(recipe["grad_seed"])
    out = {}
    for fs in spec.features:
        shape = expected_shape(fs, recipe["batch"][fs.name], recipe["path"])
        out[fs.name] = (rng.integers(-4, 5, size=shape) * 0.25).astype(np.float32)
    fault = recipe["fault"]
    if fault and fault["kind"] == "grad_representation_ok" and fault["variant"] == "int64":
        out = {k: np.round(v) for k, v in out.items()}
    if fault and fault["kind"] in ("grad_nonfinite_skip", "grad_huge"):
        g = out[fault["feature"]]
        if g.size:
            g.reshape(-1)[0] = float(fault["value"])
    if fault and fault["kind"] == "grad_none_tpu":
        out[fault["feature"]] = np.zeros_like(out[fault["feature"]])
    return out


def subject_grads(logical: dict, fault: dict | None) -> dict:
    """The gradients handed over: the logical ones, with a gradient fault applied."""
    import torch

    grads = {k: v.copy() for k, v in logical.items()}
    kind = fault["kind"] if fault else None
    f = fault["feature"] if fault else None
    if kind == "grad_shape":
        g = grads[f]
        v = fault["variant"]
        if v == "row":
            grads[f] = np.concatenate(
                [g, g[:1] if len(g) else np.zeros((1, *g.shape[1:]), g.dtype)]
            )
        elif v == "col":
            grads[f] = np.concatenate([g, g[..., :1]], axis=-1)
        elif v == "flat":
            grads[f] = g.reshape(-1)
        else:
            t = np.swapaxes(g, 0, 1)
            grads[f] = t if t.shape != g.shape else np.concatenate([g, g[:1]])
    elif kind in ("grad_nonfinite", "grad_nan_backward"):
        g = grads[f]
        g.reshape(-1)[0] = float(fault.get("value", "nan"))
    elif kind == "grad_dtype":
        grads[f] = {
            "str": grads[f].astype(str),
            "object": grads[f].astype(object),
            "complex": grads[f].astype(np.complex64),
            "bool": grads[f] > 0,
        }[fault["dtype"]]
    elif kind == "grad_missing":
        del grads[f]
    elif kind == "grad_none_tpu":
        grads[f] = None
    elif kind == "grad_extra":
        grads["nope"] = np.zeros((1, 1), np.float32)
    elif kind == "grad_list":
        grads[f] = grads[f].tolist()
    elif kind == "grad_representation_ok":
        g = grads[f]
        v = fault["variant"]
        grads[f] = {
            "float64": lambda: g.astype(np.float64),
            "int64": lambda: g.astype(np.int64),
            # an empty batch's gradient as a list is [], of no shape: the array is kept
            "list": lambda: g.tolist() if len(g) else g,
            "torch": lambda: torch.from_numpy(g),
            "fortran": lambda: np.asfortranarray(g),
            "strided": lambda: np.repeat(g, 2, axis=-1)[..., ::2],
        }[v]()
    if kind == "grad_not_mapping":
        return list(grads.values())
    return grads


def subject_lrs(recipe) -> list | None:
    lrs = None if recipe["lrs"] is None else list(recipe["lrs"])
    fault = recipe["fault"]
    kind = fault["kind"] if fault else None
    if kind == "lr_bad":
        v = fault["value"]
        lrs[fault["tag"]] = float(v) if v in ("nan", "inf", "-inf") else v
    elif kind == "lr_count":
        lrs = (lrs + [0.1, 0.1])[: fault["count"]]
    elif kind == "lr_missing":
        lrs = None
    elif kind == "lr_unexpected":
        lrs = [0.1]
    elif kind == "lr_extreme":
        lrs[fault["tag"]] = fault["value"]
    return lrs


def logical_lrs(recipe) -> list | None:
    fault = recipe["fault"]
    if fault and fault["kind"] == "lr_extreme":
        return subject_lrs(recipe)
    return None if recipe["lrs"] is None else list(recipe["lrs"])


# -- the TF port's nesting -----------------------------------------------------------------------


def nest(flat: dict) -> dict:
    """{"grp/cat": x, "user": y} -> {"grp": {"cat": x}, "user": y}."""
    out: dict = {}
    for path, v in flat.items():
        parts = path.split("/")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v
    return out


def unnest(tree, prefix="") -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(unnest(v, f"{prefix}{k}/"))
        return out
    return {prefix[:-1]: tree}


def features(spec, recipe, clean: bool):
    """(features dict, weights dict or None, built per feature) of the case's logical batch;
    ``clean``: the canonical form and no fault."""
    fault = None if clean else recipe["fault"]
    path = recipe["path"]
    feats, weights, built = {}, {}, {}
    # the case's own input: the ids before a caller's mutation, which the fault then makes
    logical = logical_batch(recipe, mutated=clean)
    for fs in spec.features:
        fb = dict(logical[fs.name])
        if clean:
            fb["form"] = "ragged_offsets"
        ffault = fault if fault and fault.get("feature") == fs.name else None
        if ffault and ffault["kind"].startswith(("grad", "lr", "kjt", "foreign", "batch")):
            ffault = None
        if ffault and ffault["kind"] == "kjt_id_out_of_range":
            ffault = None
        b = build_feature(fs, fb, path, ffault)
        built[fs.name] = b
        feats[fs.name] = b.value
        if b.weights is not None:
            weights[fs.name] = b.weights
        if ffault and ffault["kind"] in ("offsets_mutated", "ids_mutated", "weights_mutated"):
            _mutate_built(b, fs, ffault)
        if ffault and ffault["kind"] == "value_none":
            feats[fs.name] = None
        elif ffault and ffault["kind"] == "value_scalar":
            feats[fs.name] = np.int64(1)
        elif ffault and ffault["kind"] == "value_3d":
            # (B, 1, 1) is a valid dense input of the TF port; (B, 2, 2) is not (last dim 2)
            feats[fs.name] = np.zeros((len(fb["samples"]), 2, 2), dtype=np.int64)
        elif ffault and ffault["kind"] == "value_string":
            feats[fs.name] = "0,1"
        elif ffault and ffault["kind"] == "value_object":
            feats[fs.name] = object()
        elif ffault and ffault["kind"] == "ragged_lists":
            feats[fs.name] = np.array([[1, 2], [3]], dtype=object)
        elif ffault and ffault["kind"] == "tpu_dense_sequence":
            feats[fs.name] = np.asarray(
                [s[0] if s else 0 for s in fb["samples"]] or [0], dtype=np.int64
            )
    if fault and fault["kind"] == "caller_ids_mutated" and not late_mutation(recipe):
        mutate_caller_ids(built[fault["feature"]], fault)
    kind = fault["kind"] if fault else None
    if kind == "missing_feature":
        del feats[fault["feature"]]
        weights.pop(fault["feature"], None)
    elif kind == "extra_feature":
        feats["nope"] = [[0]]
    elif kind == "weights_unknown_feature":
        weights["nope"] = [[1.0]]
    if path in TPU_PATHS:
        tw = None
        if weights:
            tw = nest({fs.name: weights.get(fs.name) for fs in spec.features if fs.name in feats})
        feats = nest(feats)
        if kind == "wrong_nesting":
            v = fault["variant"]
            if v == "flat":
                feats = unnest(feats)
            elif v == "list":
                feats = list(unnest(feats).values())
            else:
                feats["zzz"] = np.array([0])
        if kind == "features_not_mapping":
            feats = list(unnest(feats).values())
        return feats, tw, built
    if kind == "features_not_mapping":
        feats = list(feats.values())
    if kind == "weights_not_mapping":
        weights = [1.0]
    return feats, (weights or None), built


def late_mutation(recipe: dict) -> bool:
    """caller_ids_mutated between preprocess and lookup (paths with a preprocess step), else
    right after the input was built."""
    fault = recipe["fault"]
    return fault["when"] == "after_preprocess" and recipe["path"] in (
        "prepared",
        "prepared_eval",
        "torch_prepared",
    )


def mutate_caller_ids(b: Built, fault: dict) -> None:
    a = b.caller_ids
    if a is None or a.size == 0:
        return
    api("mutate", _setitem, a, (0,) * a.ndim, _fits(a, fault["value"]))


def keyed_jagged(spec, recipe, clean: bool):
    """The whole batch as one KeyedJagged (TorchRec's layout), with a kjt fault applied."""
    from embengine.torch import KeyedJagged

    fault = None if clean else recipe["fault"]
    kind = fault["kind"] if fault else None
    keys = list(spec.names)
    values, lengths = [], []
    logical = logical_batch(recipe)
    for fs in spec.features:
        samples = copy.deepcopy(logical[fs.name]["samples"])
        if kind == "kjt_id_out_of_range" and fault["feature"] == fs.name:
            samples[0][0] = fs.vocab + fault["extra"]
        values += _flat(samples)
        lengths += _lengths(samples)
    if kind == "missing_feature":
        j = keys.index(fault["feature"])
        per_key = len(lengths) // len(keys)
        start = sum(lengths[: j * per_key])
        stop = start + sum(lengths[j * per_key : (j + 1) * per_key])
        values = values[:start] + values[stop:]
        lengths = lengths[: j * per_key] + lengths[(j + 1) * per_key :]
        keys.pop(j)
    if kind == "extra_feature":
        keys.append("nope")
        lengths += [0] * (len(lengths) // max(1, len(keys) - 1))
    values = np.asarray(values, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    weights = None
    if kind == "kjt_lengths_overflow":
        lengths[0] += M64
        lengths[1] += M64
        lengths[2] += 2
    elif kind == "kjt_lengths_mismatch":
        lengths[-1] += fault["delta"]
    elif kind == "kjt_lengths_negative":
        lengths[keys.index(fault["feature"]) * (len(lengths) // len(keys))] = -1
    elif kind == "kjt_unknown_key":
        keys[0] = "nope"
    elif kind == "kjt_duplicate_key":
        keys[1] = keys[0]
    elif kind == "kjt_float_values":
        values = values.astype(np.float64) + fault["fraction"]
    elif kind == "kjt_weights_length":
        weights = np.ones(len(values) + 1, dtype=np.float32)
    if kind == "kjt_offsets_bad":
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        if fault["variant"] == "start":
            offsets[0] = 1
        else:
            offsets[1], offsets[2] = offsets[2] + 1, offsets[1]
        return api("build", KeyedJagged, keys, values, offsets=offsets)
    import torch

    return api(
        "build", KeyedJagged, keys, torch.from_numpy(values), lengths=lengths, weights=weights
    )


def prepared_batch(engine, spec, recipe, feats, weights, training: bool):
    """The PreparedBatch a prepared path hands over: the engine's own, or one a batch fault
    makes elsewhere."""
    import embengine as ee

    fault = recipe["fault"]
    kind = fault["kind"] if fault else None
    path = recipe["path"]
    prep = (
        (lambda f, w, training: engine.preprocess(f, w))
        if path == "serving"
        else (engine.preprocess)
    )
    if kind in (
        "foreign_vocab_out",
        "foreign_vocab_in",
        "foreign_packing",
        "foreign_features",
        "twin_batch",
    ):
        backend = recipe["backend"] if recipe["backend"] != "serving" else "reference"
        config = recipe["config"]
        if kind == "foreign_features":
            other = "packed" if config != "packed" else "mixed"
            other_spec = SPECS[other]
            feats = {fs.name: [[0]] * 2 for fs in other_spec.features}
            weights = None
            maker = build_engine(other, backend)
        elif kind == "twin_batch":
            other = "numba" if backend == "reference" else "reference"
            maker = build_engine(
                config, other, history=history(recipe), times=history_times(recipe)
            )
        else:
            maker = build_engine(
                config, backend, "packing" if kind == "foreign_packing" else "vocab"
            )
            if kind == "foreign_vocab_out":
                first = next(
                    fs
                    for fs in spec.features
                    if recipe["batch"][fs.name]["samples"]
                    and recipe["batch"][fs.name]["samples"][0]
                )
                samples = copy.deepcopy(recipe["batch"][first.name]["samples"])
                samples[0][0] = first.vocab + 3
                feats = dict(feats)
                feats[first.name] = ee.Ragged(_flat(samples), offsets=_offsets(samples))
        return api("call", maker.preprocess, feats, weights, training=training)
    if kind == "lookup_only_batch_trained":
        return api("call", prep, feats, weights, training=False)
    batch = api("call", prep, feats, weights, training=training)
    if kind == "batch_mutated":
        _mutate_batch(batch, fault)
    return batch


def _mutate_batch(batch, fault: dict) -> None:
    arrays = []
    for tb in batch.tables:
        if hasattr(tb, "unique_ids"):
            names = (
                "unique_ids",
                "inverse",
                "gains",
                "segments",
                "output_offsets",
                "unique_offsets",
                "unique_gains",
                "unique_segments",
            )
            arrays.append([getattr(tb, n) for n in names])
        else:
            per = []
            for p in tb.parts:
                per += [p.ragged.ids, p.ragged.offsets]
                if p.ragged.weights is not None:
                    per.append(p.ragged.weights)
            arrays.append(per)
    k = fault["array"]
    for per in arrays:  # the first table with a non-empty array of that index
        nonempty = [a for a in per if a.size]
        if not nonempty:
            continue
        a = nonempty[k % len(nonempty)]
        v = fault["value"]
        if a.dtype.kind == "f":
            value = float("nan") if v == "nan" else float(v)
        else:
            value = -5 if v == "nan" else _fits(a, v)
        api("mutate", _setitem, a, a.size - 1 if k % 2 else 0, value)
        return
