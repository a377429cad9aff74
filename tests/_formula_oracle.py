"""The independent oracle of the optimizer formula tests (tests/test_formulas_*.py).

Every expectation is recomputed here with plain Python float64 loops from the written contract
(never from embengine internals), rounded to float32 after each row update the way the engine
stores its state; ``run_and_check`` compares it after EVERY step against the engine's weights,
every slot array (name, shape, dtype, value) and the activations.

Contract summary (what the reference below implements):
  * combiners sum / mean / sqrtn with per-id weights; empty bag -> zeros; backward gains
    w, w / sum(w), w / sqrt(sum(w^2)) (zero denominator -> 0).
  * accumulation on: all occurrences of a row in the step (all features of the table, all
    samples, duplicates) are summed, ONE update per touched row (non-lazy Adam / AMSGrad /
    Lion: every row of the table, untouched rows with g = 0).
  * accumulation off: one full update per occurrence, in feature-dict order, then sample order,
    then position in the sample.
  * per-row pipeline: clip g (clipvalue) -> weight decay (decoupled: w -= f*w ; l2: g += f*w ;
    f *= lr if multiply_weight_decay_factor_by_learning_rate) -> optimizer -> clip w
    (clip_weight_min / clip_weight_max).
  * FrequencyEstimator / BatchSoftmax ignore the gradient; s = engine.step + 1 is the 1-based
    number of the step being applied; a row hit several times in one step is updated once.
"""

from __future__ import annotations

import math

import numpy as np

import embengine as ee
from embengine import initializers as init
from embengine import optimizers as opt

RTOL, ATOL = 1e-5, 1e-6


def f32(x: float) -> float:
    return float(np.float32(x))


def sign(x: float) -> float:
    return 1.0 if x > 0 else (-1.0 if x < 0 else 0.0)


# ------------------------------------------------------------------------------------------------
# Independent reference model
# ------------------------------------------------------------------------------------------------

ADAM_DEFAULTS = dict(
    learning_rate=0.001,
    beta_1=0.9,
    beta_2=0.999,
    epsilon=1e-7,
    lazy_adam=True,
    sum_inside_sqrt=True,
    use_nesterov=False,
    bias_correction=None,
)
DEFAULTS = {
    "SGD": dict(learning_rate=0.01),
    "Adagrad": dict(
        learning_rate=0.001, initial_accumulator_value=0.1, hessian_compression_times=1
    ),
    "AdagradMomentum": dict(
        learning_rate=0.001,
        momentum=0.0,
        use_nesterov=False,
        exponent=2.0,
        beta2=1.0,
        epsilon=1e-10,
    ),
    "ProximalAdagrad": dict(
        learning_rate=0.001,
        l1_regularization_strength=0.0,
        l2_regularization_strength=0.0,
        initial_accumulator_value=0.1,
    ),
    "Adam": ADAM_DEFAULTS,
    "AMSGrad": ADAM_DEFAULTS,
    "FTRL": dict(
        learning_rate=0.001,
        learning_rate_power=-0.5,
        l1_regularization_strength=0.0,
        l2_regularization_strength=0.0,
        beta=0.0,
        initial_accumulator_value=0.1,
        multiply_linear_by_learning_rate=False,
        allow_zero_accumulator=False,
    ),
    "Lion": dict(learning_rate=1e-4, beta_1=0.9, beta_2=0.99, lazy_lion=True),
    "Momentum": dict(learning_rate=0.01, momentum=0.9, use_nesterov=False),
    "RMSProp": dict(
        learning_rate=0.001,
        rho=0.9,
        momentum=0.0,
        epsilon=1e-10,
        centered=False,
        sum_inside_sqrt=True,
        initial_ms_value=1.0,
    ),
    "Adadelta": dict(learning_rate=0.001, rho=0.95, epsilon=1e-8),
    "Assign": dict(learning_rate=0.0),
    "FrequencyEstimator": dict(
        learning_rate=0.0, tau=0.1, max_delta=1000.0, outlier_threshold=10.0, weight_exponent=1.0
    ),
    "BatchSoftmax": dict(learning_rate=0.1),
}
COMMON_DEFAULTS = dict(
    use_gradient_accumulation=True,
    clip_weight_min=None,
    clip_weight_max=None,
    weight_decay_factor=None,
    multiply_weight_decay_factor_by_learning_rate=None,
    weight_decay_mode="decoupled",
    clipvalue=None,
)
GRADIENT_FREE = ("FrequencyEstimator", "BatchSoftmax")


def slot_specs(kind: str, P: dict, dim: int) -> list[tuple[str, int, float, bool]]:
    """(name, columns, initial value, is_int32) in the documented order."""
    if kind == "SGD":
        return []
    if kind == "FTRL":
        return [
            ("accumulators", dim, P["initial_accumulator_value"], False),
            ("linears", dim, 0.0, False),
        ]
    if kind == "Adagrad":
        k = P["hessian_compression_times"]
        return [("accumulators", dim // k, P["initial_accumulator_value"], False)]
    if kind == "AdagradMomentum":
        return [("accumulators", dim, 0.0, False), ("momenta", dim, 0.0, False)]
    if kind == "ProximalAdagrad":
        return [("accumulators", dim, P["initial_accumulator_value"], False)]
    if kind in ("Adam", "AMSGrad"):
        out = [("momenta", dim, 0.0, False), ("velocities", dim, 0.0, False)]
        if kind == "AMSGrad":
            out.append(("vhats", dim, 0.0, False))
        if P["bias_correction"] == "per_row":
            out.append(("steps", 1, 0, True))
        return out
    if kind in ("Lion", "Momentum"):
        return [("momenta", dim, 0.0, False)]
    if kind == "RMSProp":
        out = [("ms", dim, P["initial_ms_value"], False), ("mom", dim, 0.0, False)]
        if P["centered"]:
            out.append(("mg", dim, 0.0, False))
        return out
    if kind == "Adadelta":
        return [("accumulators", dim, 0.0, False), ("updates", dim, 0.0, False)]
    if kind == "Assign":
        return []
    if kind == "FrequencyEstimator":
        return [("last_hit_step", 1, 0, True)]
    if kind == "BatchSoftmax":
        return [("last_seen_step", 1, 0, True)]
    raise AssertionError(kind)


def optimizer_math(kind, P, w, S, g, lr, s):
    """Optimizer formula for one row. w, g: lists (float); S: slot name -> list (mutated).
    s: 1-based number of the step being applied. Returns the new w list."""
    dim = len(w)
    w = list(w)
    if kind == "SGD":
        w = [w[d] - lr * g[d] for d in range(dim)]
    elif kind == "FTRL":
        for d in range(dim):
            w[d], S["accumulators"][d], S["linears"][d] = ftrl_element(
                P, w[d], S["accumulators"][d], S["linears"][d], g[d], lr
            )
    elif kind == "Adagrad":
        k = P["hessian_compression_times"]
        acc = S["accumulators"]
        for j in range(dim // k):
            grp = range(j * k, (j + 1) * k)
            a = acc[j] + sum(g[d] * g[d] for d in grp) / k
            for d in grp:
                w[d] = w[d] - lr * g[d] / math.sqrt(a)
            acc[j] = a
    elif kind == "AdagradMomentum":
        mu, b2, eps, p = P["momentum"], P["beta2"], P["epsilon"], P["exponent"]
        for d in range(dim):
            a = S["accumulators"][d]
            a = a + g[d] * g[d] if b2 == 1 else b2 * a + (1.0 - b2) * g[d] * g[d]
            sc = (a + eps) ** (-1.0 / p) * g[d]
            m = mu * S["momenta"][d] + sc
            w[d] -= lr * (mu * m + sc if P["use_nesterov"] else m)
            S["accumulators"][d], S["momenta"][d] = a, m
    elif kind == "ProximalAdagrad":
        l1, l2 = P["l1_regularization_strength"], P["l2_regularization_strength"]
        for d in range(dim):
            a = S["accumulators"][d] + g[d] * g[d]
            r = lr / math.sqrt(a)
            v = w[d] - r * g[d]
            w[d] = sign(v) * max(abs(v) - r * l1, 0.0) / (1.0 + r * l2)
            S["accumulators"][d] = a
    elif kind in ("Adam", "AMSGrad"):
        b1, b2, eps = P["beta_1"], P["beta_2"], P["epsilon"]
        bc = P["bias_correction"]
        if bc is None:
            alpha = lr
        else:
            if bc == "per_row":
                S["steps"][0] += 1
                t = S["steps"][0]
            else:
                assert bc == "global"
                t = s
            alpha = lr * math.sqrt(1.0 - b2**t) / (1.0 - b1**t)
        for d in range(dim):
            m = b1 * S["momenta"][d] + (1.0 - b1) * g[d]
            v = b2 * S["velocities"][d] + (1.0 - b2) * g[d] * g[d]
            S["momenta"][d], S["velocities"][d] = m, v
            if kind == "AMSGrad":
                v = max(S["vhats"][d], v)
                S["vhats"][d] = v
            u = b1 * m + (1.0 - b1) * g[d] if P["use_nesterov"] else m
            if P["sum_inside_sqrt"]:
                w[d] -= alpha * u / math.sqrt(v + eps * eps)
            else:
                w[d] -= alpha * u / (math.sqrt(v) + eps)
    elif kind == "Lion":
        b1, b2 = P["beta_1"], P["beta_2"]
        for d in range(dim):
            m = S["momenta"][d]
            w[d] -= lr * sign(b1 * m + (1.0 - b1) * g[d])
            S["momenta"][d] = b2 * m + (1.0 - b2) * g[d]
    elif kind == "Momentum":
        mu = P["momentum"]
        for d in range(dim):
            m = mu * S["momenta"][d] + g[d]
            w[d] -= lr * (g[d] + mu * m) if P["use_nesterov"] else lr * m
            S["momenta"][d] = m
    elif kind == "RMSProp":
        rho, mu, eps = P["rho"], P["momentum"], P["epsilon"]
        for d in range(dim):
            ms = rho * S["ms"][d] + (1.0 - rho) * g[d] * g[d]
            S["ms"][d] = ms
            if P["centered"]:
                mg = rho * S["mg"][d] + (1.0 - rho) * g[d]
                S["mg"][d] = mg
                den = ms - mg * mg
            else:
                den = ms
            r = math.sqrt(den + eps) if P["sum_inside_sqrt"] else math.sqrt(den) + eps
            mom = mu * S["mom"][d] + lr * g[d] / r
            S["mom"][d] = mom
            w[d] -= mom
    elif kind == "Adadelta":
        rho, eps = P["rho"], P["epsilon"]
        for d in range(dim):
            a = rho * S["accumulators"][d] + (1.0 - rho) * g[d] * g[d]
            b = S["updates"][d]
            u = math.sqrt(b + eps) / math.sqrt(a + eps) * g[d]
            w[d] -= lr * u
            S["accumulators"][d] = a
            S["updates"][d] = rho * b + (1.0 - rho) * u * u
    elif kind == "Assign":
        w = list(g)
    elif kind == "FrequencyEstimator":
        last = S["last_hit_step"][0]
        delta = s - last
        c = min(float(delta), P["max_delta"])
        D = w[0]
        if delta >= P["outlier_threshold"] * D:
            D = c
        else:
            D = (1.0 - P["tau"]) * D + P["tau"] * c
        w[0] = D
        S["last_hit_step"][0] = s
    elif kind == "BatchSoftmax":
        a = P["learning_rate"]
        last = S["last_seen_step"][0]
        w[0] = (1.0 - a) * w[0] + a * (s - last)
        S["last_seen_step"][0] = s
    else:
        raise AssertionError(kind)
    return w


def ftrl_element(P, w, a, z, g, lr):
    """FTRL for one element (TF's formula, learning_rate_power -p). Returns (w, a, z)."""
    p = -P["learning_rate_power"]
    l1 = P["l1_regularization_strength"]
    l2 = P["l2_regularization_strength"]
    beta = P["beta"]
    a_new = a + g * g
    ap_new = a_new**p if a_new > 0 else 0.0
    ap_old = a**p if a > 0 else 0.0
    if P["multiply_linear_by_learning_rate"]:
        z = z + lr * g - (ap_new - ap_old) * w
        q = ap_new + 2.0 * l2 * lr + beta
        thr = l1 * lr
    else:
        z = z + g - (ap_new - ap_old) / lr * w
        q = ap_new / lr + 2.0 * l2 + beta / lr
        thr = l1
    w = (sign(z) * thr - z) / q if abs(z) > thr else 0.0
    return w, a_new, z


def update_row(kind, P, w, S, g, lr, s):
    """The whole per-row pipeline. Returns (w, S) (new objects)."""
    w = [float(x) for x in w]
    g = [float(x) for x in g]
    S = {k: list(v) for k, v in S.items()}
    if kind not in GRADIENT_FREE:
        cv = P["clipvalue"]
        if cv is not None:
            lo, hi = cv if isinstance(cv, tuple) else (-float(cv), float(cv))
            g = [x if lo is None else max(x, float(lo)) for x in g]
            g = [x if hi is None else min(x, float(hi)) for x in g]
        f = P["weight_decay_factor"]
        if f is not None:
            f = float(f) * (lr if P["multiply_weight_decay_factor_by_learning_rate"] else 1.0)
            if P["weight_decay_mode"] == "l2":
                g = [gd + f * wd for gd, wd in zip(g, w, strict=True)]
            else:
                w = [wd - f * wd for wd in w]
    w = optimizer_math(kind, P, w, S, g, lr, s)
    if P["clip_weight_min"] is not None:
        w = [max(x, float(P["clip_weight_min"])) for x in w]
    if P["clip_weight_max"] is not None:
        w = [min(x, float(P["clip_weight_max"])) for x in w]
    return w, S


def initial_value(init_spec, row):
    kind, arg = init_spec
    if kind == "rowid":
        return float(row + arg)
    if kind in ("const", "default"):
        return float(arg)
    if kind == "zeros":
        return 0.0
    raise AssertionError(kind)


def make_initializer(init_spec):
    kind, arg = init_spec
    if kind == "rowid":
        return init.RowId(offset=arg)
    if kind == "const":
        return init.Constant(arg)
    if kind == "zeros":
        return init.Zeros()
    assert kind == "default"  # no initializer on the TableConfig; arg = documented default value
    return None


class RefTable:
    def __init__(self, vocab, dim, init_spec, combiner, kind, kwargs):
        P = dict(COMMON_DEFAULTS)
        P.update(DEFAULTS[kind])
        P.update(kwargs)
        self.kind, self.P = kind, P
        self.vocab, self.dim, self.combiner = vocab, dim, combiner
        self.w = [[f32(initial_value(init_spec, r)) for _ in range(dim)] for r in range(vocab)]
        self.specs = slot_specs(kind, P, dim)
        self.slots = {
            name: [[(int(v0) if is_int else f32(v0)) for _ in range(cols)] for _ in range(vocab)]
            for name, cols, v0, is_int in self.specs
        }
        self.int_slots = {name for name, _, _, is_int in self.specs if is_int}

    def gains(self, bag):
        ws = [f32(wt) for _, wt in bag]
        if self.combiner == "sum":
            return ws
        if self.combiner == "mean":
            tot = sum(ws)
        else:
            tot = math.sqrt(sum(x * x for x in ws))
        return [x / tot if tot != 0 else 0.0 for x in ws]

    def forward(self, bags):
        out = []
        for bag in bags:
            acc = [0.0] * self.dim
            if bag:
                for (rid, _), gain in zip(bag, self.gains(bag), strict=True):
                    for d in range(self.dim):
                        acc[d] += gain * self.w[rid][d]
            out.append(acc)
        return out

    def _update(self, r, gvec, lr, s):
        S = {name: arr[r] for name, arr in self.slots.items()}
        w, S = update_row(self.kind, self.P, self.w[r], S, gvec, lr, s)
        self.w[r] = [f32(x) for x in w]
        for name in self.slots:
            if name in self.int_slots:
                self.slots[name][r] = [int(x) for x in S[name]]
            else:
                self.slots[name][r] = [f32(x) for x in S[name]]

    def nonlazy(self):
        return (self.kind in ("Adam", "AMSGrad") and not self.P["lazy_adam"]) or (
            self.kind == "Lion" and not self.P["lazy_lion"]
        )

    def step(self, feature_bags, feature_grads, lr, s):
        """feature_bags / feature_grads in the table's feature-dict order; s = engine.step + 1."""
        occurrences = []
        for bags, grads in zip(feature_bags, feature_grads, strict=True):
            for b, bag in enumerate(bags):
                if not bag:
                    continue
                for (rid, _), gain in zip(bag, self.gains(bag), strict=True):
                    occurrences.append((rid, [gain * float(grads[b][d]) for d in range(self.dim)]))
        if self.kind in GRADIENT_FREE:
            assert self.P["use_gradient_accumulation"]
            for r in sorted({rid for rid, _ in occurrences}):
                self._update(r, [0.0] * self.dim, lr, s)
        elif self.P["use_gradient_accumulation"]:
            summed: dict[int, list[float]] = {}
            for rid, gv in occurrences:
                acc = summed.setdefault(rid, [0.0] * self.dim)
                for d in range(self.dim):
                    acc[d] += gv[d]
            rows = range(self.vocab) if self.nonlazy() else sorted(summed)
            for r in rows:
                self._update(r, summed.get(r, [0.0] * self.dim), lr, s)
        else:
            for rid, gv in occurrences:
                self._update(rid, gv, lr, s)


# ------------------------------------------------------------------------------------------------
# Engine harness
# ------------------------------------------------------------------------------------------------


def norm_bag(bag):
    return [(x, 1.0) if isinstance(x, int) else (int(x[0]), float(x[1])) for x in bag]


def engine_input(bags, variant):
    """bags: normalized bags. Weighted bags -> Ragged with weights; otherwise alternate between
    Ragged(lengths=...) and a list of lists."""
    ids = [rid for bag in bags for rid, _ in bag]
    lengths = [len(bag) for bag in bags]
    if any(wt != 1.0 for bag in bags for _, wt in bag):
        return ee.Ragged(ids, lengths=lengths, weights=[wt for bag in bags for _, wt in bag])
    if variant % 2 == 0:
        return ee.Ragged(np.array(ids, dtype=np.int64), lengths=lengths)
    return [[rid for rid, _ in bag] for bag in bags]


def to_engine_input(fmt, bags):
    """bags in one named input format: (engine input, lookup weights or None)."""
    if fmt in ("ragged", "ragged_w"):
        ids = [rid for bag in bags for rid, _ in bag]
        offsets = [0]
        for bag in bags:
            offsets.append(offsets[-1] + len(bag))
        weights = [wt for bag in bags for _, wt in bag] if fmt == "ragged_w" else None
        return ee.Ragged(ids, offsets=offsets, weights=weights), None
    if fmt == "list":
        return [[rid for rid, _ in bag] for bag in bags], None
    if fmt == "list_w":
        return [[rid for rid, _ in bag] for bag in bags], [[wt for _, wt in bag] for bag in bags]
    if fmt == "1d":
        assert all(len(bag) == 1 for bag in bags)
        return np.array([bag[0][0] for bag in bags], dtype=np.int64), None
    if fmt == "2d":
        width = max(1, max(len(bag) for bag in bags))
        arr = -np.ones((len(bags), width), dtype=np.int64)
        for b, bag in enumerate(bags):
            for k, (rid, _) in enumerate(bag):
                arr[b, k] = rid
        return arr, None
    raise AssertionError(fmt)


def feature_input(entry, variant):
    """One feature of a step: a list of bags (the input format chosen by ``engine_input``) or
    ``(format, bags)`` (``to_engine_input``). Returns (normalized bags, input, weights or None)."""
    if isinstance(entry, tuple):
        fmt, bags = entry
        bags = [norm_bag(b) for b in bags]
        x, weights = to_engine_input(fmt, bags)
        return bags, x, weights
    bags = [norm_bag(b) for b in entry]
    return bags, engine_input(bags, variant), None


def U(*ids):
    """Unweighted bag."""
    return [(i, 1.0) for i in ids]


def check_state(eng, refs, when):
    for name, ref in refs.items():
        np.testing.assert_allclose(
            eng.embedding_tables[name],
            np.array(ref.w, dtype=np.float64),
            rtol=RTOL,
            atol=ATOL,
            err_msg=f"table {name!r} weights {when}",
        )
        got = eng.slots(name)
        assert set(got) == set(ref.slots), (name, when, list(got), list(ref.slots))
        for sname, arr in ref.slots.items():
            g = np.asarray(got[sname])
            exp = np.array(arr)
            assert g.shape == exp.shape, (name, sname, g.shape, exp.shape)
            if sname in ref.int_slots:
                assert g.dtype == np.int32, (name, sname, g.dtype)
                np.testing.assert_array_equal(
                    g, exp, err_msg=f"table {name!r} slot {sname!r} {when}"
                )
            else:
                np.testing.assert_allclose(
                    g,
                    exp,
                    rtol=RTOL,
                    atol=ATOL,
                    err_msg=f"table {name!r} slot {sname!r} {when}",
                )


def build(backend, tables, features, global_opt=None):
    """tables: name -> dict(vocab, dim, init, combiner, kind, kwargs, on_table)."""
    cfgs, refs = {}, {}
    for name, spec in tables.items():
        kind, kwargs = (spec["kind"], spec["kwargs"]) if spec["on_table"] else global_opt
        cfgs[name] = ee.TableConfig(
            vocabulary_size=spec["vocab"],
            dim=spec["dim"],
            initializer=make_initializer(spec["init"]),
            optimizer=getattr(opt, kind)(**kwargs) if spec["on_table"] else None,
            combiner=spec["combiner"],
            name=name,
        )
        # callable learning rates: run_and_check's lr_of_step gives the reference their values
        ref_kwargs = {k: v for k, v in kwargs.items() if not callable(v)}
        refs[name] = RefTable(
            spec["vocab"], spec["dim"], spec["init"], spec["combiner"], kind, ref_kwargs
        )
    eng = ee.EmbeddingEngine(
        {f: ee.FeatureConfig(cfgs[t]) for f, t in features},
        optimizer=getattr(opt, global_opt[0])(**global_opt[1]) if global_opt else None,
        seed=0,
        backend=backend,
    )
    return eng, refs


def run_and_check(
    backend, tables, features, steps, global_opt=None, seed=7, grad_scale=1.0, lr_of_step=None
):
    """steps: list of {feature: bags or (format, bags)} (see ``feature_input``). Checks
    activations before, and weights + every slot after, every step.
    lr_of_step: table name -> pure function of the 0-based step giving the learning rate the
    reference uses (for callable learning rates); otherwise kwargs["learning_rate"] (or default).
    Returns (engine, reference tables)."""
    lr_of_step = lr_of_step or {}
    eng, refs = build(backend, tables, features, global_opt)
    rng = np.random.default_rng(seed)
    check_state(eng, refs, "at init")
    for i, step in enumerate(steps):
        assert eng.step == i
        nbags, inputs, weights = {}, {}, {}
        for k, (f, _) in enumerate(features):
            nbags[f], inputs[f], w = feature_input(step[f], i + k)
            if w is not None:
                weights[f] = w
        acts = eng.lookup(inputs, weights=weights or None)
        grads = {}
        for f, t in features:
            np.testing.assert_allclose(
                acts[f],
                np.array(refs[t].forward(nbags[f])).reshape(len(nbags[f]), refs[t].dim),
                rtol=RTOL,
                atol=ATOL,
                err_msg=f"activation of {f!r} at step {i}",
            )
            grads[f] = (grad_scale * rng.standard_normal((len(nbags[f]), refs[t].dim))).astype(
                np.float32
            )
        eng.apply_gradients(grads)
        for name, ref in refs.items():
            names = [f for f, t in features if t == name]
            lr = lr_of_step[name](i) if name in lr_of_step else ref.P["learning_rate"]
            ref.step(
                [nbags[f] for f in names],
                [[[float(x) for x in row] for row in grads[f]] for f in names],
                float(lr),
                i + 1,
            )
        check_state(eng, refs, f"after step {i} (s={i + 1})")
    assert eng.step == len(steps)
    return eng, refs


def shared_case(backend, kind, kwargs, init_spec, combiner, steps, dim, order=("f1", "f2"), **kw):
    """Features ``order`` (of f1, f2) sharing table "a" (vocab 10) over ``steps``."""
    tables = {
        "a": dict(
            vocab=10,
            dim=dim,
            init=init_spec,
            combiner=combiner,
            kind=kind,
            kwargs=kwargs,
            on_table=True,
        )
    }
    return run_and_check(backend, tables, [(f, "a") for f in order], steps, **kw)


ROWID = ("rowid", -4)  # rows -4 .. 5: negative, zero and positive weights
CONST = ("const", 0.5)
ZEROS = ("zeros", None)
