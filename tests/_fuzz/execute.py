"""Run one fuzz case in this process and judge it (the child side of the runner).

``run_case(recipe)`` builds the case's inputs (``cases`` module docstring), drives its path,
and returns ``{"outcome": ..., "detail": ...}`` with outcome one of ``OUTCOMES``:

- ``clear_error``: a TypeError / ValueError (or subclass) that names what it must (below), and
  every table, slot and the step bit-identical to before;
- ``unclear_error``: an error of another type (IndexError, KeyError, OverflowError,
  ZeroDivisionError, RuntimeError...), or one that does not name the feature it is about;
- ``right_answer``: the activations equal an independent NumPy model of the logical batch
  (float64 gather and combine; rtol = atol = 1e-5) and, on training paths, the tables and slots
  after the step equal those of the reference backend given the same batch in the canonical form
  (``Ragged`` with offsets) through ``lookup`` + ``apply_gradients`` (rtol 1e-5, atol 1e-6),
  every value finite; lookup-only paths change nothing;
- ``wrong_answer``: anything else without an error, a malformed input accepted (expect
  "error"), or a valid input refused (expect "valid");
- ``partial_update``: an error after a table, a slot or the step changed, except a
  ``NonFiniteUpdateError`` (an update whose result overflowed from finite inputs, policy
  "error"): the step is then done for every other row by contract, so it is judged like a
  valid step: no non-finite value, and the state equal to the reference's, which must raise
  it too (``right_answer``);
- ``harness_error``: the harness itself failed (a bug here, not in embengine).

Keyed and 16-bit configs (configs.py, after their prelude). The state compared is the whole
``state_dict`` (a keyed table's keys, rows, slots, last-touched steps, touch counts, pending
admissions, counters), 16-bit values to within a neighbouring 16-bit value of the
reference's (the backends' float32 math agrees to an ulp, and stochastic rounding may then
round to the neighbour). The model knows the rules of
``DynamicVocabulary`` (``keyed_model``): an evaluation lookup sees a key's row if it has one
that has not expired, else zeros, and changes nothing; a training lookup of a table first
drops its expired rows, then a key with a row sees it, a new key admitted (threshold 0, or
its count in earlier steps, the state's pending counts, at least the threshold) sees its
initial row (the initializer at the key, rounded to nearest to the stored dtype) when the
table inserts on lookup, zeros otherwise; a batch whose own keys need more than ``max_rows``
rows must be refused: a ValueError naming the table, nothing changed. After a training step
the table holds exactly the keys the rules leave (expired rows gone, the victims of
``max_rows`` by LRU / LFU gone, admitted keys added); the values are the reference backend's.
An error raised by the update (``apply_gradients``, torch's backward) after a training lookup
succeeded is judged against the state after that lookup, which the lookup may change.

The runner adds ``crash`` (the process died) and ``hang`` (no result within the timeout).

When is an error clear? Its type is TypeError or ValueError (embengine's CheckpointError is a
ValueError), and, for a fault about one feature, its message names that feature: the feature's
name (a TF-port path like ``grp/cat`` or its last part) appears as a word. A fault about the
feature dict names the missing or unknown key. A batch prepared for other tables names a
feature, a table or says "pack". Errors raised while the caller builds an input object
(``Ragged(...)``, ``KeyedJagged(...)``) or assigns into one need no feature name: the caller
is holding that object; the type rule still applies (AttributeError counts for assignments,
which is how a read-only attribute refuses).
"""

from __future__ import annotations

import copy
import math
import os
import re
import tempfile
import traceback
from pathlib import Path

import numpy as np

from embengine import NonFiniteUpdateError

from . import inputs
from .cases import FAULTS, TPU_PATHS, TRAINING_PATHS
from .configs import NEW_CONFIGS, PRELUDE_TIMES, SPECS, build_engine, build_tpu
from .inputs import ApiError, api, logical_batch, nest, unnest

OUTCOMES = (
    "clear_error",
    "unclear_error",
    "right_answer",
    "wrong_answer",
    "partial_update",
    "crash",
    "hang",
    "harness_error",
)

ACT_RTOL = ACT_ATOL = 1e-5
STATE_RTOL, STATE_ATOL = 1e-5, 1e-6


# -- state ---------------------------------------------------------------------------------------


def _new_kind(engine) -> bool:
    """The engine has a keyed or a 16-bit table."""
    return any(
        c.vocabulary_size is None or c.weights_dtype != "float32" or c.slots_dtype != "float32"
        for c in engine.table_configs.values()
    )


def _half(a: np.ndarray) -> bool:
    """A 16-bit float array (float16, or ml_dtypes' bfloat16)."""
    return a.dtype.itemsize == 2 and a.dtype.kind not in "iu"


def snapshot(engine) -> dict:
    """Every table's weights and slots (copies, by public API) and the step; an engine with a
    keyed or 16-bit table: its whole state_dict (16-bit values as float32)."""
    out = {"step": engine.step}
    if _new_kind(engine):
        for name, entries in engine.state_dict()["tables"].items():
            for k, v in entries.items():
                out[name if k == "weights" else f"{name}/{k}"] = np.array(v)
        return out
    for name, w in engine.embedding_tables.items():
        out[name] = np.array(w)
        for slot, arr in engine.slots(name).items():
            out[f"{name}/{slot}"] = np.array(arr)
    return out


def same_bits(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k, v in a.items():
        if k == "step":
            if v != b[k]:
                return False
        elif v.tobytes() != b[k].tobytes():
            return False
    return True


def state_diff(a: dict, b: dict) -> str | None:
    """None if the states agree within the tolerance, else what differs first."""
    if a.keys() != b.keys():
        return f"different tables/slots: {sorted(a)} vs {sorted(b)}"
    for k, v in a.items():
        if k == "step":
            if v != b[k]:
                return f"step {v} vs {b[k]}"
            continue
        if v.shape != b[k].shape:
            return f"{k}: shape {v.shape} vs {b[k].shape}"
        if _half(v):
            # The backends' float32 math agrees to an ulp, so a 16-bit value may round to the
            # neighbouring one (tests/test_reduced_precision.py's rule); a zero's sign may differ.
            ha, hb = v.view(np.uint16).astype(np.int64), b[k].view(np.uint16).astype(np.int64)
            near = (np.abs(ha - hb) <= 1) | (((ha | hb) & 0x7FFF) == 0)
            if not near.all():
                i = np.unravel_index(int(np.argmax(~near)), v.shape)
                return f"{k}{list(map(int, i))}: {v[i]} vs reference {b[k][i]} (16-bit)"
            continue
        if not np.allclose(v, b[k], rtol=STATE_RTOL, atol=STATE_ATOL, equal_nan=True):
            i = np.unravel_index(
                int(
                    np.argmax(
                        ~np.isclose(v, b[k], rtol=STATE_RTOL, atol=STATE_ATOL, equal_nan=True)
                    )
                ),
                v.shape,
            )
            return f"{k}{list(map(int, i))}: {v[i]} vs reference {b[k][i]}"
    return None


def nonfinite(state: dict) -> str | None:
    for k, v in state.items():
        if k != "step" and _half(v):
            v = v.astype(np.float32)
        if k != "step" and v.dtype.kind == "f" and not np.isfinite(v).all():
            return f"{k} holds {int((~np.isfinite(v)).sum())} non-finite values"
    return None


# -- the independent model -----------------------------------------------------------------------


def model_activation(fs, samples, weights, table, magnitude: bool = False):
    """float64 activation of one feature: gather and combine, as the docs define them.
    ``table``: the rows by id (an array), or a keyed table's rows by key (a dict; a key
    without a row looks up as zeros). ``magnitude``: also the sum of the terms' magnitudes
    (``|gain * row|``) of each value, (activation, magnitudes)."""
    if isinstance(table, dict):
        zero = np.zeros(fs.dim)
        w = _KeyRows({k: np.asarray(v, np.float64) for k, v in table.items()}, zero)
    else:
        w = table.astype(np.float64)
    b = len(samples)
    if fs.is_sequence:
        out = np.zeros((b, fs.seq, fs.dim))
        for i, s in enumerate(samples):
            for p, r in enumerate(s[: fs.seq]):
                out[i, p] = w[r]
        return (out, np.abs(out)) if magnitude else out
    out = np.zeros((b, fs.dim))
    mag = np.zeros((b, fs.dim))
    for i, s in enumerate(samples):
        # The engine holds weights as float32: so does the model, then computes in float64.
        ws = (
            np.ones(len(s))
            if weights is None
            else (np.asarray(weights[i], dtype=np.float32).astype(np.float64))
        )
        if fs.combiner == "sum":
            gains = ws
        else:
            denom = ws.sum() if fs.combiner == "mean" else math.sqrt((ws * ws).sum())
            gains = ws / denom if denom != 0 else np.zeros_like(ws)
        for g, r in zip(gains, s, strict=True):
            out[i] += g * w[r]
            mag[i] += np.abs(g * w[r])
    return (out, mag) if magnitude else out


class _KeyRows(dict):
    def __init__(self, rows: dict, zero: np.ndarray):
        super().__init__(rows)
        self.zero = zero

    def __missing__(self, key):
        return self.zero


# -- keyed tables' rules (config.DynamicVocabulary) -----------------------------------------------


def initial_row(spec, table: str, key: int, dim: int) -> np.ndarray:
    """A new key's row: the table's initializer at the key, rounded to nearest to its dtype
    (past a 16-bit range: Inf, which the table must refuse)."""
    from embengine import initializers as init

    from .configs import SEED

    initializer = init.RowId() if spec.table_spec(table).rowid else init.RandomUniform(-1.0, 1.0)
    row = initializer.init(SEED, table, np.array([key], np.int64), dim)[0]
    row = np.asarray(row, np.float32)
    dtype = spec.table_spec(table).weights_dtype
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return row.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        import ml_dtypes

        return row.astype(ml_dtypes.bfloat16).astype(np.float32)
    return row


NO_TIME = -(1 << 63)  # a keyed table's data time before any timestamp


def _batch_keys(spec, logical: dict, table: str) -> set[int]:
    """The keys of ``table`` in the step's batch (``logical``: per feature, its samples), a
    sequence feature's cut at its length."""
    return {
        int(k)
        for f in spec.features
        if f.table == table
        for s in logical[f.name]["samples"]
        for k in s[: f.seq or None]
    }


def keyed_model(
    spec, logical: dict, before: dict, training: bool, timestamp: int | None = None
) -> dict:
    """What the rules say of each keyed table for this batch (see the module docstring):
    {table: {"rows": {key: row seen}, "refuse": bool, "keys_after": set or None}}.
    ``timestamp``: a training call's data time (a table expiring by ``expire_seconds`` sees
    rows whose data time is at most that many seconds behind the newer of it and the
    table's data time; an evaluation lookup: behind the table's)."""
    out = {}
    step = before["step"]
    for table in spec.keyed_tables:
        ts = spec.table_spec(table)
        rules = ts.rules
        dim = next(f.dim for f in spec.features if f.table == table)
        keys = [int(k) for k in before[f"{table}/keys"]]
        weights = before[table]
        last = [int(t) for t in before[f"{table}/last_touched"]]
        touches = [int(t) for t in before[f"{table}/touch_counts"]]
        expire = rules.get("expire_steps")
        seconds = rules.get("expire_seconds")
        now = NO_TIME
        if seconds is not None:
            now = int(before[f"{table}/data_time"][0])
            if training and timestamp is not None:
                now = max(now, int(timestamp))
        times = [int(t) for t in before[f"{table}/last_time"]] if seconds is not None else []
        live = {
            k: (weights[i], last[i], touches[i])
            for i, k in enumerate(keys)
            if (expire is None or not step > last[i] + expire)
            and (now == NO_TIME or not now - times[i] > seconds)
        }
        batch = _batch_keys(spec, logical, table)
        if not training:
            out[table] = {"rows": {k: v[0] for k, v in live.items()}, "refuse": False}
            out[table]["keys_after"] = None
            continue
        if not batch:  # a table without keys in the batch runs no rule
            out[table] = {"rows": {}, "refuse": False, "keys_after": set(keys)}
            continue
        threshold = rules.get("occurrence_threshold", 0)
        pending = {
            int(k): int(e) + (int(c) if int(ps) < step else 0)
            for k, e, ps, c in zip(
                before[f"{table}/pending_keys"],
                before[f"{table}/pending_earlier"],
                before[f"{table}/pending_step"],
                before[f"{table}/pending_current"],
                strict=True,
            )
        }
        hits = batch & set(live)
        admitted = {
            k for k in batch - set(live) if threshold == 0 or pending.get(k, 0) >= threshold
        }
        max_rows = rules.get("max_rows")
        if max_rows is not None and len(hits) + len(admitted) > max_rows:
            out[table] = {"rows": {}, "refuse": True, "keys_after": set(keys)}
            continue
        if ts.rowid and any(
            not np.isfinite(initial_row(spec, table, k, dim)).all() for k in admitted
        ):  # an initial value past the 16-bit range: refused
            out[table] = {"rows": {}, "refuse": True, "keys_after": set(keys)}
            continue
        on_lookup = rules.get("insert_on", "lookup") == "lookup"
        rows = {k: live[k][0] for k in hits}
        if on_lookup:
            rows.update({k: initial_row(spec, table, k, dim) for k in admitted})
        after = set(live)
        over = len(after) + len(admitted) - (max_rows or len(after) + len(admitted))
        if over > 0:
            lfu = rules.get("eviction", "lru") == "lfu"
            order = sorted(
                (k for k in after if k not in batch),
                key=lambda k: (live[k][2], live[k][1], k) if lfu else (live[k][1], k),
            )
            after -= set(order[:over])
        out[table] = {"rows": rows, "refuse": False, "keys_after": after | admitted}
        out[table]["live"] = set(live)
    return out


def time_diff(spec, logical: dict, before: dict, after: dict, stamps: dict) -> str | None:
    """None if the data times after a training step are the rules' (``expire_seconds``:
    config.DynamicVocabulary, docs/design.md "Keyed tables expire in data time"), else what
    differs first. For each timed table with keys in the batch: the table's data time is
    the newest of its own, the lookup's timestamp and, inserting on apply, the update's (its
    own, else the lookup's: ``stamps``); a row the lookup found keeps the newer of its time
    and the lookup's, a row it made gets the lookup's, a row the update made the update's
    (late data never ages a row; a new row from late data keeps its old time)."""
    t_look = stamps["lookup"]
    t_apply = stamps["apply"] if stamps["apply"] is not None else t_look
    for table in spec.keyed_tables:
        rules = spec.table_spec(table).rules
        if "expire_seconds" not in rules or t_look is None:
            continue
        batch = _batch_keys(spec, logical, table)
        if not batch:
            continue
        on_apply = rules.get("insert_on", "lookup") == "apply"
        clock = max(int(before[f"{table}/data_time"][0]), t_look)
        if on_apply:
            clock = max(clock, t_apply)
        got = int(after[f"{table}/data_time"][0])
        if got != clock:
            return f"{table}: data time {got} after the step, the rules give {clock}"
        was = dict(
            zip(
                before[f"{table}/keys"].tolist(), before[f"{table}/last_time"].tolist(), strict=True
            )
        )
        now = dict(
            zip(after[f"{table}/keys"].tolist(), after[f"{table}/last_time"].tolist(), strict=True)
        )
        model = keyed_model(spec, logical, before, True, t_look)[table]
        for k in sorted(batch & set(now)):
            if k in model.get("live", ()):
                want = max(was[k], t_look)  # found by the lookup
            else:
                want = t_apply if on_apply else t_look  # made by the lookup or the update
            if now[k] != want:
                return (
                    f"{table}: key {k}'s data time {now[k]} after the step, the rules give {want}"
                )
    return None


def acts_diff(
    name: str, got: np.ndarray, want64: np.ndarray, slack: np.ndarray | None = None
) -> str | None:
    """None if ``got`` (float32) is the model's ``want64`` within the tolerance (or
    ``slack``, absolute, per value), else what differs first."""
    got = np.asarray(got)
    if got.shape != want64.shape:
        return f"{name}: activation shape {got.shape}, expected {want64.shape}"
    if got.dtype != np.float32:
        return f"{name}: activation dtype {got.dtype}, expected float32"
    with np.errstate(over="ignore"):
        want = want64.astype(np.float32)
    g64 = got.astype(np.float64)
    close = np.isclose(g64, want64, rtol=ACT_RTOL, atol=ACT_ATOL) | (
        (g64 == want) & ~np.isfinite(want)
    )
    # Near float32's limit the order of a sum decides between a huge value and inf.
    huge = np.abs(want64) > 1e37
    close |= huge & ((np.abs(g64) > 1e37) & (np.sign(g64) == np.sign(want64)))
    if slack is not None:
        close |= np.abs(g64 - want64) <= slack
    if not close.all():
        i = np.unravel_index(int(np.argmax(~close)), got.shape)
        return f"{name}{list(map(int, i))}: {got[i]} vs model {want64[i]}"
    return None


# -- one case ------------------------------------------------------------------------------------

_SERVING: dict = {}


def serving_engine(config: str = "mixed"):
    """The ServingEngine over an fp32 export of a fresh engine of ``config`` (one per process
    and config; a keyed or 16-bit config's after its prelude), and that engine's tables."""
    if config != "mixed":
        key = f"serving:{config}"
        if key not in _SERVING:
            from embengine import serving

            eng = build_engine(config, "reference")
            tmp = Path(
                tempfile.mkdtemp(
                    prefix="embengine-fuzz-serving-", dir=os.environ.get("EMBENGINE_FUZZ_TMP")
                )
            )
            ckpt = eng.save(tmp / "ckpt")
            serving.export(ckpt, tmp / "export", "fp32")
            _SERVING[key] = (serving.ServingEngine.load(tmp / "export"), snapshot(eng), tmp)
        return _SERVING[key][:2]
    if "engine" not in _SERVING:
        from embengine import serving

        eng = build_engine("mixed", "reference")
        tmp = Path(
            tempfile.mkdtemp(
                prefix="embengine-fuzz-serving-", dir=os.environ.get("EMBENGINE_FUZZ_TMP")
            )
        )
        ckpt = eng.save(tmp / "ckpt")
        serving.export(ckpt, tmp / "export", "fp32")
        _SERVING["engine"] = serving.ServingEngine.load(tmp / "export")
        _SERVING["tables"] = snapshot(eng)
        _SERVING["dir"] = tmp
    return _SERVING["engine"], _SERVING["tables"]


def _case_engine(recipe: dict, backend: str, clean: bool):
    """The engine a case runs on: its config's, after the case's history (at its times);
    ``clean`` (the oracle's run): an mmap config's tables in RAM."""
    return build_engine(
        recipe["config"],
        backend,
        history=inputs.history(recipe),
        times=inputs.history_times(recipe),
        ram=clean,
    )


def drive(recipe, backend: str, clean: bool) -> dict:
    """Drive one path; returns acts (by feature name), states and the ApiError if any."""
    import torch

    path = recipe["path"] if not clean else _canonical_path(recipe["path"])
    spec = SPECS[recipe["config"]]
    fault = None if clean else recipe["fault"]
    kind = fault["kind"] if fault else None
    res = {"acts": None, "error": None, "before": None, "after": None, "engine": None}
    res["mid"] = None  # keyed / 16-bit configs: the state after a training lookup that passed

    def looked_up():
        if spec.prelude and path in TRAINING_PATHS:
            res["mid"] = snapshot(engine)

    if recipe["path"] == "train_two":
        return drive_two(recipe, backend, clean)
    logical = inputs.base_grads(spec, recipe)
    grads = logical if clean else inputs.subject_grads(logical, fault)
    lrs = inputs.logical_lrs(recipe) if clean else inputs.subject_lrs(recipe)
    view = dict(recipe)
    view["path"] = path
    view["case_path"] = recipe["path"]  # the logical batch's (inputs.keyed_change)
    t = inputs.timestamps(view, clean)
    ts = inputs.ts
    try:
        if path in ("tpu", "tpu_serving"):
            obj = build_tpu(backend, serving=path == "tpu_serving")
            engine = obj.engine
        elif path == "serving":
            obj, tables = serving_engine(recipe["config"])
            engine = None
            res["before"] = res["after"] = tables
        else:
            engine = _case_engine(recipe, backend, clean)
            obj = engine
        res["engine"] = engine
        if engine is not None:
            res["before"] = snapshot(engine)
        if path == "torch_kjt":
            feats, weights, built = inputs.keyed_jagged(spec, view, clean), None, {}
        else:
            feats, weights, built = inputs.features(spec, view, clean)
        if path in ("lookup_eval", "train"):
            training = path == "train"
            acts = api(
                "call",
                engine.lookup,
                feats,
                weights,
                training=training,
                **ts(t["lookup"] if training else t["eval"]),
            )
            if training:
                looked_up()
                api("call", engine.apply_gradients, grads, learning_rates=lrs, **ts(t["apply"]))
        elif path == "train_eval":
            # an evaluation lookup between a training lookup and its update: it sees the
            # tables as the training lookup left them, and leaves the pending step alone
            acts = api("call", engine.lookup, feats, weights, training=True, **ts(t["lookup"]))
            looked_up()
            res["eval_acts"] = api(
                "call", engine.lookup, feats, weights, training=False, **ts(t["eval"])
            )
            res["eval_after"] = snapshot(engine)
            api("call", engine.apply_gradients, grads, learning_rates=lrs, **ts(t["apply"]))
        elif path in ("prepared", "prepared_eval"):
            training = path == "prepared"
            batch = inputs.prepared_batch(engine, spec, view, feats, weights, training)
            if kind == "caller_ids_mutated" and inputs.late_mutation(view):
                inputs.mutate_caller_ids(built[fault["feature"]], fault)
            if kind == "batch_with_weights":
                acts = api(
                    "call", engine.lookup, batch, {spec.names[0]: [[1.0]]}, training=training
                )
            else:
                acts = api(
                    "call",
                    engine.lookup,
                    batch,
                    training=training,
                    **ts(t["lookup"] if training else t["eval"]),
                )
            if training:
                looked_up()
                target = {"user": [[0]]} if kind == "not_a_batch" else batch
                api(
                    "call",
                    engine.apply_gradients,
                    grads,
                    learning_rates=lrs,
                    batch=target,
                    **ts(t["apply"]),
                )
        elif path == "serving":
            if kind and kind.startswith(("foreign", "batch_", "twin")):
                batch = inputs.prepared_batch(obj, spec, view, feats, weights, True)
                acts = api("call", obj.lookup, batch)
            else:
                acts = api("call", obj.lookup, feats, weights)
        elif path in ("torch", "torch_kjt", "torch_prepared"):
            from embengine.torch import EmbeddingLayer

            layer = EmbeddingLayer(engine)
            given, w = feats, weights
            if path == "torch_prepared":
                given = inputs.prepared_batch(layer, spec, view, feats, weights, True)
                if kind == "caller_ids_mutated" and inputs.late_mutation(view):
                    inputs.mutate_caller_ids(built[fault["feature"]], fault)
                w = {spec.names[0]: [[1.0]]} if kind == "batch_with_weights" else None
            out = api("call", layer, given, w, learning_rates=lrs, **ts(t["lookup"]))
            looked_up()
            acts = {k: v.detach().numpy().copy() for k, v in out.items()}
            shapes_ok = all(k in grads and tuple(out[k].shape) == np.shape(grads[k]) for k in out)
            if shapes_ok:  # else the activations are wrong, and judged so
                loss = sum(
                    (out[k] * torch.from_numpy(np.asarray(grads[k], np.float32))).sum() for k in out
                )
                if isinstance(loss, torch.Tensor) and loss.requires_grad:
                    api("backward", loss.backward)
        elif path == "tpu":
            api("call", obj.enqueue, feats, weights)
            acts = unnest(api("call", obj.dequeue))
            if kind == "tpu_grad_nested":
                tg = dict(grads)
            else:
                tg = nest(grads) if isinstance(grads, dict) else grads
            api("call", obj.apply_gradients, tg)
        elif path == "tpu_serving":
            acts = unnest(api("call", obj, feats, weights))
        else:
            raise AssertionError(path)
        res["acts"] = acts
    except ApiError as e:
        res["error"] = e
    if res["engine"] is not None:
        res["after"] = snapshot(res["engine"])
    return res


def _canonical_path(path: str) -> str:
    if path in TPU_PATHS:
        return path
    return "train" if path in TRAINING_PATHS else "lookup_eval"


def _tokens(spec, recipe) -> list[str] | None:
    """What a clear error must name (see the module docstring); None: nothing."""
    fault = recipe["fault"]
    fdef = FAULTS[fault["kind"]]
    if fdef.names is None:
        return None
    if fault["kind"] == "wrong_nesting":
        return {"flat": ["grp"], "extra_key": ["zzz"], "list": None}[fault["variant"]]
    if fdef.names in ("feature", "missing"):
        name = fault["feature"]
        return [name, *name.split("/")] if "/" in name else [name]
    if fdef.names == "extra":
        return ["nope"]
    # "table": any feature or table of either engine, or the word "pack"
    return [*spec.names, *spec.tables, "pack"]


def _names(message: str, tokens: list[str]) -> bool:
    return any(re.search(rf"(?<![\w/]){re.escape(t)}(?![\w/])", message) for t in tokens)


def judge(recipe: dict) -> dict:
    """Run the case on its backend and classify it (see the module docstring)."""
    if recipe["path"] == "train_two":
        return judge_two(recipe)
    spec = SPECS[recipe["config"]]
    fault = recipe["fault"]
    expect = FAULTS[fault["kind"]].expect if fault else "valid"
    change = inputs.keyed_change(recipe)
    if change == "value":
        expect = "valid"  # a key of a keyed table
    path = recipe["path"]
    training = path in TRAINING_PATHS
    backend = recipe["backend"] if recipe["backend"] != "serving" else "reference"
    res = drive(recipe, backend, clean=False)
    before, after = res["before"], res["after"]
    # the logical batches a right answer may be of (two for a lookup-only batch whose caller
    # changed the ids after preparing it), and what the keyed rules say of the first
    logicals = [logical_batch(recipe)]
    if change == "either":
        logicals.append(logical_batch(recipe, mutated=False))
    stamp = inputs.timestamps(dict(recipe, case_path=path), clean=True)["lookup"]
    models = (
        [keyed_model(spec, lb, before, training, stamp) for lb in logicals]
        if spec.prelude
        else [{}]
    )
    refusing = [t for t, m in models[0].items() if m["refuse"]]
    if res["error"] is not None and isinstance(res["error"].error, NonFiniteUpdateError):
        return _judge_policed(recipe, res)
    if res["error"] is not None:
        err, stage = res["error"].error, res["error"].stage
        text = f"{stage}: {type(err).__name__}: {err}"[:600]
        base = res["mid"] if res["mid"] is not None else before
        if base is not None and not same_bits(base, after):
            return {"outcome": "partial_update", "detail": text}
        if expect == "valid" and not refusing:
            return {"outcome": "wrong_answer", "detail": "refused a valid input: " + text}
        types = (TypeError, ValueError) + ((AttributeError,) if stage == "mutate" else ())
        if not isinstance(err, types):
            return {"outcome": "unclear_error", "detail": text}
        if stage in ("build", "mutate"):
            return {"outcome": "clear_error", "detail": text}
        tokens = None if expect == "valid" else _tokens(spec, recipe)
        if refusing and (tokens is not None or expect == "valid"):  # max_rows: the table
            tokens = (tokens or []) + refusing
        if tokens is not None and not _names(str(err), tokens):
            return {"outcome": "unclear_error", "detail": f"does not name {tokens}: {text}"}
        return {"outcome": "clear_error", "detail": text}
    if expect == "error":
        return {"outcome": "wrong_answer", "detail": "accepted a malformed input"}
    if refusing:
        return {
            "outcome": "wrong_answer",
            "detail": f"accepted a batch whose keys need more than max_rows rows of {refusing}",
        }
    # The right answer: activations of the logical batch, then the reference's update.
    acts = res["acts"]
    for logical, model in zip(logicals, models, strict=True):
        d = _acts_of(spec, acts, logical, before, model)
        if d is None:
            break
    if d:
        return {"outcome": "wrong_answer", "detail": d}
    if path == "train_eval":
        mid = res["mid"]
        if not same_bits(mid, res["eval_after"]):
            return {"outcome": "wrong_answer", "detail": "the evaluation lookup changed the tables"}
        for logical in logicals:
            model = keyed_model(spec, logical, mid, False)
            d = _acts_of(spec, res["eval_acts"], logical, mid, model)
            if d is None:
                break
        if d:
            return {"outcome": "wrong_answer", "detail": "evaluation lookup: " + d}
    if not training:
        if after is not None and not same_bits(before, after):
            return {"outcome": "wrong_answer", "detail": "a lookup changed the tables"}
        return {"outcome": "right_answer", "detail": ""}
    bad = nonfinite(after)
    if bad:
        return {"outcome": "wrong_answer", "detail": f"non-finite state written: {bad}"}
    for table, m in models[0].items():
        got = {int(k) for k in after[f"{table}/keys"]}
        if got != m["keys_after"]:
            return {
                "outcome": "wrong_answer",
                "detail": f"{table}: keys {sorted(got)} after the step, the rules leave "
                f"{sorted(m['keys_after'])}",
            }
    if spec.timed:
        stamps = inputs.timestamps(dict(recipe, case_path=path), clean=True)
        d = time_diff(spec, logicals[0], before, after, stamps)
        if d:
            return {"outcome": "wrong_answer", "detail": d}
    ref = drive(recipe, "reference", clean=True)
    if ref["error"] is not None:
        e = ref["error"].error
        return {
            "outcome": "wrong_answer",
            "detail": f"the reference refuses the logical batch: {type(e).__name__}: {e}",
        }
    d = state_diff(after, ref["after"])
    if d:
        return {"outcome": "wrong_answer", "detail": d}
    return {"outcome": "right_answer", "detail": ""}


def _acts_of(spec, acts, logical: dict, before: dict, model: dict) -> str | None:
    """None if ``acts`` are the model's activations of ``logical``, else what differs first."""
    for fs in spec.features:
        fb = logical[fs.name]
        table = model[fs.table]["rows"] if fs.table in model else before[fs.table]
        slack = None
        if spec.prelude:
            # float32 pooling of terms that cancel (a RowId table's keys of 2^62 and -2^62)
            # keeps the terms' rounding, not the result's: a few ulps of the terms' sum
            want, mag = model_activation(fs, fb["samples"], fb["weights"], table, True)
            slack = mag * 2.0**-20
        else:
            want = model_activation(fs, fb["samples"], fb["weights"], table)
        if fs.name not in acts:
            return f"no activation for {fs.name}"
        d = acts_diff(fs.name, acts[fs.name], want, slack)
        if d:
            return d
    return None


# -- two training lookups before their updates ----------------------------------------------------

_STAGES = ("prepare_a", "prepare_b", "lookup_a", "lookup_b", "eval", "apply_a", "apply_b")


def _batch_b(recipe: dict) -> dict:
    """train_two's batch B as a recipe of its own (valid: no fault)."""
    return dict(recipe, batch=recipe["batch2"], grad_seed=recipe["grad_seed2"], fault=None)


def drive_two(recipe: dict, backend: str, clean: bool) -> dict:
    """train_two: lookups of A (the case's batch, with its fault) and B (``batch2``, valid)
    before their updates, an evaluation lookup of A's features between (``eval``), then
    ``apply_gradients(gA, batch=A)`` and ``apply_gradients(gB)`` (B's, pending) in the
    case's ``order``. ``via``: "prepared" (A and B from ``preprocess``, looked up with
    ``lookup``) or "with_batch" (``lookup_with_batch``'s batch). ``clean``: the oracle's run
    on the reference backend (tables in RAM): the same calls with the logical batches in the
    canonical form through ``lookup_with_batch``; for a config without keyed tables the
    updates one after the other instead (lookup A, update A, lookup B, update B; B first if
    the case updates B first), which must leave the same tables. Returns acts, acts2,
    eval_acts, the error and its stage, and ``snaps``: the state before each stage ("before":
    at the start; "after": at the end)."""
    spec = SPECS[recipe["config"]]
    fault = None if clean else recipe["fault"]
    view = dict(recipe, case_path="train_two")
    t = inputs.timestamps(view, clean)
    ts = inputs.ts
    gA = inputs.base_grads(spec, recipe)
    if not clean:
        gA = inputs.subject_grads(gA, fault)
    gB = inputs.base_grads(spec, _batch_b(recipe))
    lrs = inputs.logical_lrs(recipe) if clean else inputs.subject_lrs(recipe)
    via = "with_batch" if clean else recipe["via"]
    b_first = recipe["order"] == "pending_first"
    res: dict = {"acts": None, "acts2": None, "eval_acts": None, "error": None, "stage": None}
    snaps: dict = {}
    res["snaps"] = snaps
    engine = _case_engine(recipe, backend, clean)
    res["engine"] = engine
    snaps["before"] = snapshot(engine)

    def call(stage, fn, *args, **kwargs):
        snaps[stage] = snapshot(engine)
        res["stage"] = stage
        return api("call", fn, *args, **kwargs)

    try:
        feats_a, w_a, _ = inputs.features(spec, view, clean)
        feats_b, w_b, _ = inputs.features(spec, dict(_batch_b(view), fault=None), clean)
        if clean and not spec.keyed_tables:  # the updates one after the other
            steps = [("a", feats_a, w_a, gA, "acts"), ("b", feats_b, w_b, gB, "acts2")]
            for x, f, w, g, key in steps[::-1] if b_first else steps:
                res[key] = call(f"lookup_{x}", engine.lookup, f, w)
                call(f"apply_{x}", engine.apply_gradients, g, learning_rates=lrs)
        else:
            if via == "prepared":
                batch_a = call("prepare_a", engine.preprocess, feats_a, w_a)
                batch_b = call("prepare_b", engine.preprocess, feats_b, w_b)
                res["acts"] = call("lookup_a", engine.lookup, batch_a, **ts(t["lookup"]))
                res["acts2"] = call("lookup_b", engine.lookup, batch_b, **ts(t["lookup2"]))
            else:
                res["acts"], batch_a = call(
                    "lookup_a", engine.lookup_with_batch, feats_a, w_a, **ts(t["lookup"])
                )
                res["acts2"], _ = call(
                    "lookup_b", engine.lookup_with_batch, feats_b, w_b, **ts(t["lookup2"])
                )
            if recipe["eval"] or t["eval"] is not None:
                res["eval_acts"] = call(
                    "eval", engine.lookup, feats_a, w_a, training=False, **ts(t["eval"])
                )

            def apply_a():
                call(
                    "apply_a",
                    engine.apply_gradients,
                    gA,
                    learning_rates=lrs,
                    batch=batch_a,
                    **ts(t["apply"]),
                )

            def apply_b():
                call("apply_b", engine.apply_gradients, gB, learning_rates=lrs, **ts(t["apply2"]))

            for step in (apply_b, apply_a) if b_first else (apply_a, apply_b):
                step()
    except ApiError as e:
        res["error"] = e
        if e.stage != "call":  # building or changing an input (before any call)
            res["stage"] = e.stage
            snaps[e.stage] = snaps["before"]
    res["after"] = snaps["after"] = snapshot(engine)
    res["before"] = snaps["before"]
    return res


def _lost_rows(spec, model_a: dict, pre: dict) -> list[str]:
    """The keyed tables where a key that had a row at A's lookup (``model_a``) has none
    before A's update (``pre``): later calls removed it, and the update must be refused."""
    out = []
    for table, m in model_a.items():
        held = set(m["rows"])
        if held - {int(k) for k in pre[f"{table}/keys"]}:
            out.append(table)
    return out


def judge_two(recipe: dict) -> dict:
    """Judge a train_two case (``drive_two``): activations of A by the keyed rules at its
    lookup, of B at B's (after A's), of the evaluation lookup at its own (and it changes
    nothing); an update of A whose keys later calls removed must be refused naming the table
    (``KeyedTable.check_update_rows``); an error changes nothing since its call began; the
    tables at the end are the oracle run's (``drive_two(clean=True)``)."""
    spec = SPECS[recipe["config"]]
    fault = recipe["fault"]
    expect = FAULTS[fault["kind"]].expect if fault else "valid"
    change = inputs.keyed_change(recipe)
    if change == "value":
        expect = "valid"
    res = drive_two(recipe, recipe["backend"], clean=False)
    snaps, after = res["snaps"], res["after"]
    if res["error"] is not None and isinstance(res["error"].error, NonFiniteUpdateError):
        return _judge_policed(recipe, res)
    t = inputs.timestamps(dict(recipe, case_path="train_two"), clean=True)
    logicals = [logical_batch(recipe)]
    if change == "either":
        logicals.append(logical_batch(recipe, mutated=False))
    logical_b = copy.deepcopy(recipe["batch2"])

    def model(stage: str, logical: dict, training: bool, stamp=None) -> dict:
        if not spec.prelude or stage not in snaps:
            return {}
        return keyed_model(spec, logical, snaps[stage], training, stamp)

    model_a = model("lookup_a", logicals[0], True, t["lookup"])
    model_b = model("lookup_b", logical_b, True, t["lookup2"])
    refuse = {
        "lookup_a": [x for x, m in model_a.items() if m["refuse"]],
        "lookup_b": [x for x, m in model_b.items() if m["refuse"]],
        "apply_a": _lost_rows(spec, model_a, snaps["apply_a"]) if "apply_a" in snaps else [],
    }
    if res["error"] is not None:
        err, stage = res["error"].error, res["stage"]
        text = f"{stage}: {type(err).__name__}: {err}"[:600]
        if not same_bits(snaps[stage], after):
            return {"outcome": "partial_update", "detail": text}
        types = (TypeError, ValueError) + ((AttributeError,) if stage == "mutate" else ())
        if not isinstance(err, types):
            return {"outcome": "unclear_error", "detail": text}
        if stage in ("build", "mutate"):
            return {"outcome": "clear_error", "detail": text}
        tokens = None if expect == "valid" else _tokens(spec, recipe)
        if refuse.get(stage) and (tokens is not None or expect == "valid"):
            tokens = (tokens or []) + refuse[stage]
        elif expect == "valid":
            ref = drive_two(recipe, "reference", clean=True)
            e = ref["error"]
            if e is None or ref["stage"] != stage or type(e.error) is not type(err):
                return {"outcome": "wrong_answer", "detail": "refused a valid input: " + text}
            tokens = spec.tables  # as the oracle's run refuses it: naming a table
        if tokens is not None and not _names(str(err), tokens):
            return {"outcome": "unclear_error", "detail": f"does not name {tokens}: {text}"}
        return {"outcome": "clear_error", "detail": text}
    if expect == "error":
        return {"outcome": "wrong_answer", "detail": "accepted a malformed input"}
    for stage, tables in refuse.items():
        if tables:
            return {"outcome": "wrong_answer", "detail": f"{stage} of {tables} not refused"}
    for logical in logicals:
        d = _acts_of(spec, res["acts"], logical, snaps["lookup_a"], model_a)
        if d is None:
            break
    if d:
        return {"outcome": "wrong_answer", "detail": "batch A: " + d}
    d = _acts_of(spec, res["acts2"], logical_b, snaps["lookup_b"], model_b)
    if d:
        return {"outcome": "wrong_answer", "detail": "batch B: " + d}
    if "eval" in snaps:
        nxt = snaps["apply_b" if recipe["order"] == "pending_first" else "apply_a"]
        if not same_bits(snaps["eval"], nxt):
            return {"outcome": "wrong_answer", "detail": "the evaluation lookup changed the tables"}
        for logical in logicals:
            d = _acts_of(
                spec, res["eval_acts"], logical, snaps["eval"], model("eval", logical, False)
            )
            if d is None:
                break
        if d:
            return {"outcome": "wrong_answer", "detail": "evaluation lookup: " + d}
    bad = nonfinite(after)
    if bad:
        return {"outcome": "wrong_answer", "detail": f"non-finite state written: {bad}"}
    ref = drive_two(recipe, "reference", clean=True)
    if ref["error"] is not None:
        e = ref["error"].error
        return {
            "outcome": "wrong_answer",
            "detail": f"the oracle's run refuses the logical batches at {ref['stage']}: "
            f"{type(e).__name__}: {e}",
        }
    d = state_diff(after, ref["after"])
    if d:
        return {"outcome": "wrong_answer", "detail": d}
    return {"outcome": "right_answer", "detail": ""}


def _judge_policed(recipe: dict, res: dict) -> dict:
    """A NonFiniteUpdateError: rows whose result was not finite left alone, the rest updated."""
    text = f"{type(res['error'].error).__name__}: {res['error'].error}"[:600]
    if recipe["path"] not in TRAINING_PATHS:
        return {"outcome": "wrong_answer", "detail": "a lookup raised " + text}
    bad = nonfinite(res["after"])
    if bad:
        return {"outcome": "wrong_answer", "detail": f"non-finite state written: {bad}"}
    ref = drive(recipe, "reference", clean=True)
    if ref["error"] is None or not isinstance(ref["error"].error, NonFiniteUpdateError):
        return {
            "outcome": "wrong_answer",
            "detail": f"the reference does not refuse the same rows: {text}",
        }
    d = state_diff(res["after"], ref["after"])
    if d:
        return {"outcome": "wrong_answer", "detail": d}
    return {"outcome": "right_answer", "detail": "policed: " + text}


def run_case(recipe: dict) -> dict:
    """``judge`` with the harness's own failures caught (outcome "harness_error")."""
    try:
        return judge(recipe)
    except Exception:  # noqa: BLE001 - a bug here must not look like embengine's
        return {"outcome": "harness_error", "detail": traceback.format_exc()[-1500:]}


def warm_up() -> None:
    """Load (or compile) the kernels every path uses, on valid batches, so that a case's time
    limit measures the case, not numba."""
    for config in ("mixed", "packed", "dynamic", "tpu", *NEW_CONFIGS):
        spec = SPECS[config]
        batch = {
            fs.name: {"samples": [[0], [1]], "weights": None, "form": "ragged_offsets"}
            for fs in spec.features
        }
        paths = ("tpu", "tpu_serving") if spec.tpu else ("train", "prepared_eval", "lookup_eval")
        if config == "mixed":
            paths += ("serving",)
        faults = [None]
        if not spec.tpu:
            # A lookup-only batch keeps views of the caller's ids: non-contiguous ids are another
            # numba type, compiled on first use (over the case's limit on a loaded 2-core host).
            arrays = {name: dict(b, form="array1d") for name, b in batch.items()}
            faults += [{"kind": "noncontiguous_ok", "feature": name} for name in arrays]
        for path in paths:
            for fault in faults if path == "lookup_eval" else [None]:
                recipe = {
                    "path": path,
                    "backend": "numba",
                    "config": config,
                    "batch": batch if fault is None else arrays,
                    "fault": fault,
                    "grad_seed": 0,
                    "lrs": [0.1] * spec.dynamic_tags or None,
                }
                if spec.timed:
                    recipe["timestamps"] = dict.fromkeys(("lookup", "lookup2"), PRELUDE_TIMES[-1])
                run_case(recipe)
