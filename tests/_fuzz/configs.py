"""The engines the fuzzer drives: plain-data specs (for the generators) and their builders.

Specs are plain data so that case generation needs no engine; builders make a fresh object for
every case (the TF port writes its optimizer and name into the TableConfig objects it is given,
so nothing is shared between cases). Feature and table names are distinct words, so that the
oracle can tell whether an error message names the feature (``user``) or only a table
(``t_user``).

- ``mixed``: a table per combiner (sum, mean, sqrtn), Adagrad / FTRL / the global SGD, dims 3
  (the any-layout kernels) and 2; ``item`` and ``hist`` (a sequence of 3) share ``t_item``.
- ``packed``: SGD tables of dim 2 (``t_a`` + ``t_b``) and dim 1, Adagrad tables of dim 4
  (``t_c`` + ``t_d``), all with ``low_dimensional_packing_status``: low-dimensional packing
  stores the dim-2 pair and the dim-4 pair as one table each.
- ``dynamic``: DynamicLearningRate tags 0 (Adagrad, dim 4) and 1 (FTRL, dim 2), and
  ``nonfinite_gradients="skip_row"``. The FTRL table comes first: tables are updated last
  first, so an update failing in it (FTRL divides by the learning rate) comes after another
  table changed.
- ``tpu``: the TF port (embengine.tpu) with a nested feature config (``grp/cat``).

Keyed tables (dynamic vocabularies) and 16-bit tables (``KEYED_CONFIGS``, ``HALF_CONFIGS``;
their rules: ``config.DynamicVocabulary``, ``precision.py``). Their engines are not fresh: a
``PRELUDE`` of three training steps (canonical input, fixed gradients; trained once per process
on the reference backend, and every engine loads the state it leaves) first fills the keyed
tables from ``KEY_POOL`` (keys of every size and sign, some seen twice, some once, some at
step 0 only: with an admission threshold, expiry and ``max_rows`` the case meets keys that are
admitted, pending, expired or evicted) and moves the 16-bit rows off their initial values
(stochastic rounding). A keyed feature's ids are keys of ``KEY_POOL``: the prelude's and new
ones.

- ``keyed``: keyed tables only: ``k_a`` (dim 3, sum, Adagrad; shared by the bag ``ka`` and the
  sequence ``ka_seq``; no rule but the defaults) and ``k_b`` (dim 2, mean, the global SGD;
  ``max_rows=6``, LRU).
- ``keyed_mix``: a dense table ``t_u`` (Adagrad) beside keyed ``k_c`` (dim 4, sqrtn, FTRL;
  ``occurrence_threshold=2``, ``expire_steps=1``) and ``k_d`` (dim 2, sum, Adagrad;
  ``insert_on="apply"``, ``max_rows=8``, LFU).
- ``half``: dense 16-bit tables: ``h_b`` (bfloat16 weights and slots, Adagrad, sum; a bag and a
  sequence feature), ``h_f`` (float16 weights, float32 slots, FTRL, mean) and ``h_g``
  (float32 weights, bfloat16 slots, Adagrad, sqrtn).
- ``keyed_half``: keyed 16-bit tables: ``k_h`` (bfloat16, Adagrad, sum; threshold 1,
  ``expire_steps=1``) and ``k_f`` (float16 weights, bfloat16 slots, Adagrad, mean;
  ``max_rows=7``), beside a dense float16 table ``h_d`` (the global SGD);
  ``nonfinite_gradients="skip_row"`` (a row given a NaN is left alone; a new key's row made
  on apply still is).
- ``keyed_rowid``: keyed tables whose initializer has no bound (RowId: a key's values are the
  key): ``k_r`` (float16, Adagrad, sum; a bag and a sequence feature) and ``k_s`` (bfloat16,
  the global SGD, mean, ``max_rows=9``). A batch admitting a key whose value a 16-bit table
  cannot hold (|key| >= 65520 in float16) must be refused naming the table, nothing changed;
  the prelude and histories use keys below ``ROWID_KEYS``.
- ``keyed_time``: keyed tables that expire rows by data time (``expire_seconds``): ``k_t``
  (dim 2, sum, Adagrad; a bag and a sequence feature; 60 s, also ``expire_steps=2``,
  ``max_rows=7``, LRU) and ``k_u`` (dim 3, mean, the global SGD; 100 s, threshold 1,
  ``insert_on="apply"``; its rows in a file, ``storage="mmap"``). Every training call
  carries a timestamp (``TIMES``: backwards, equal, later, far later, 0); the prelude's
  steps are at ``PRELUDE_TIMES``.
- ``keyed_mmap``: keyed tables with ``storage="mmap"`` (kind "keyed-mmap", files in a folder
  of their own per engine): ``k_m`` (dim 3, sum, Adagrad; a bag and a sequence feature;
  ``max_rows=6``, LFU) and ``k_n`` (dim 2, sqrtn, FTRL; threshold 2, ``expire_steps=1``,
  ``insert_on="apply"``, ``max_rows=8``). The oracle's reference engine keeps them in RAM.

``foreign`` variants build the same features with other tables: ``vocab`` multiplies every
vocabulary by 10 (a batch prepared there can hold ids past this engine's tables); ``packing``
turns packing off for one table, so the same features are stored as another number of tables.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass

SEED = 7


@dataclass(frozen=True)
class FeatureSpec:
    name: str
    table: str
    vocab: int
    dim: int
    combiner: str
    seq: int = 0  # max_sequence_length; 0: a bag feature
    keyed: bool = False  # a keyed table's feature: ids are any int64 (KEY_POOL); vocab unused

    @property
    def is_sequence(self) -> bool:
        return self.seq > 0


@dataclass(frozen=True)
class TableSpec:
    """A new config's table: its dtypes, optimizer ("adagrad", "ftrl", None: the global SGD)
    and, for a keyed table, its ``DynamicVocabulary`` arguments."""

    name: str
    optimizer: str | None = None
    weights_dtype: str = "float32"
    slots_dtype: str = "float32"
    dynamic: tuple[tuple[str, object], ...] | None = None  # DynamicVocabulary(**dict(...))
    rowid: bool = False  # initializer RowId (values: the key; no bound) instead of uniform
    storage: str = "ram"  # "mmap": a keyed table's rows in a file ("keyed-mmap")

    @property
    def rules(self) -> dict:
        return dict(self.dynamic or ())


@dataclass(frozen=True)
class ConfigSpec:
    name: str
    features: tuple[FeatureSpec, ...]
    dynamic_tags: int = 0  # number of DynamicLearningRate tags (learning_rates= values)
    skip_nonfinite: bool = False  # nonfinite_gradients="skip_row"
    tpu: bool = False
    table_specs: tuple[TableSpec, ...] = ()  # the new configs' tables (dtypes, keyed rules)

    @property
    def prelude(self) -> bool:
        """Its engine starts after PRELUDE (the keyed and 16-bit configs)."""
        return bool(self.table_specs)

    @property
    def timed(self) -> bool:
        """A table expires rows by data time (``expire_seconds``): training calls carry a
        timestamp."""
        return any("expire_seconds" in t.rules for t in self.table_specs)

    @property
    def mmap(self) -> bool:
        return any(t.storage == "mmap" for t in self.table_specs)

    def table_spec(self, name: str) -> TableSpec | None:
        return next((t for t in self.table_specs if t.name == name), None)

    @property
    def keyed_tables(self) -> list[str]:
        return [t.name for t in self.table_specs if t.dynamic is not None]

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.features]

    def feature(self, name: str) -> FeatureSpec:
        return next(f for f in self.features if f.name == name)

    @property
    def tables(self) -> list[str]:
        out: list[str] = []
        for f in self.features:
            if f.table not in out:
                out.append(f.table)
        return out


F = FeatureSpec
T = TableSpec


def K(name, table, dim, combiner, seq=0) -> FeatureSpec:
    return FeatureSpec(name, table, 0, dim, combiner, seq, keyed=True)


def _rules(**kw) -> tuple[tuple[str, object], ...]:
    return tuple(sorted(kw.items()))


# Keys of the keyed features: the prelude's (below) and new ones; never -1 (2-D padding).
KEY_POOL = (
    0,
    1,
    5,
    7,
    42,
    -2,
    -9,
    1 << 40,
    -(1 << 40),
    (1 << 63) - 1,
    -(1 << 63),
    12345678901,
    # not in the prelude
    3,
    8,
    99,
    -5,
    1 << 50,
    -(1 << 62),
    (1 << 62) + 1,
)
# Keys that every integer dtype holds (int8 .. uint64): a keyed feature's ids in a form or a
# fault that narrows them (int32 arrays, narrow_int_ok, uint64_ok).
SMALL_KEYS = (0, 1, 3, 5, 7, 8, 42, 99)
# The prelude: per step, the keys each keyed table is trained on (one per sample, 7 twice in
# step 0: two occurrences in one step), before the case (at step 3). With a threshold, 7 and
# 42 are admitted at step 1, 0 at step 2; 7's row, not touched since step 1, has expired by
# step 3 under expire_steps=1; keys seen once wait.
PRELUDE = (
    (0, 42, -2, 1 << 40, (1 << 63) - 1, 7, 7),
    (1, 5, -9, -(1 << 40), 42, 7),
    (0, 42, 12345678901, -(1 << 63)),
)

# The data time (seconds) of each PRELUDE step, for the configs whose tables expire rows by
# data time: with expire_seconds=60, step 0's rows not touched since have expired at the
# case's time T0 + 90 (its start's data time).
T0 = 1_000_000
PRELUDE_TIMES = (T0, T0 + 40, T0 + 90)
# The timestamps of a case's calls and history steps: backwards (far, a little), equal to the
# data time after the prelude, later by less and more than the expiry spans, far later, 0 and
# the largest one allowed (2^62 - 1).
TIMES = (T0 - 500, T0 + 50, T0 + 90, T0 + 100, T0 + 130, T0 + 160, T0 + 250, T0 + 10**6, 0)
MAX_TIME = (1 << 62) - 1

SPECS: dict[str, ConfigSpec] = {
    "mixed": ConfigSpec(
        "mixed",
        (
            F("user", "t_user", 10, 3, "sum"),
            F("item", "t_item", 8, 3, "mean"),
            F("hist", "t_item", 8, 3, "mean", seq=3),
            F("cat", "t_cat", 6, 2, "sqrtn"),
        ),
    ),
    "packed": ConfigSpec(
        "packed",
        (
            F("pa", "t_a", 7, 2, "sum"),
            F("pa_seq", "t_a", 7, 2, "sum", seq=2),
            F("pb", "t_b", 5, 2, "mean"),
            F("pc", "t_c", 9, 4, "sqrtn"),
            F("pd_seq", "t_d", 4, 4, "mean", seq=2),
            F("pe", "t_e", 3, 1, "sum"),
        ),
    ),
    "dynamic": ConfigSpec(
        "dynamic",
        (
            F("dy_seq", "t_y", 6, 2, "sum", seq=2),
            F("dx", "t_x", 12, 4, "mean"),
            F("dx2", "t_x", 12, 4, "mean"),
        ),
        dynamic_tags=2,
        skip_nonfinite=True,
    ),
    "tpu": ConfigSpec(
        "tpu",
        (
            F("user", "t_user", 10, 3, "sum"),
            F("item", "t_item", 8, 2, "mean"),
            F("hist", "t_item", 8, 2, "mean", seq=3),
            F("grp/cat", "t_cat", 5, 2, "sqrtn"),
        ),
        tpu=True,
    ),
    "keyed": ConfigSpec(
        "keyed",
        (
            K("ka", "k_a", 3, "sum"),
            K("ka_seq", "k_a", 3, "sum", seq=2),
            K("kb", "k_b", 2, "mean"),
        ),
        table_specs=(
            T("k_a", "adagrad", dynamic=_rules()),
            T("k_b", None, dynamic=_rules(max_rows=6)),
        ),
    ),
    "keyed_mix": ConfigSpec(
        "keyed_mix",
        (
            F("du", "t_u", 6, 2, "sum"),
            K("kc", "k_c", 4, "sqrtn"),
            K("kd", "k_d", 2, "sum"),
            K("kd_seq", "k_d", 2, "sum", seq=3),
        ),
        table_specs=(
            T("t_u", "adagrad"),
            T("k_c", "ftrl", dynamic=_rules(occurrence_threshold=2, expire_steps=1)),
            T("k_d", "adagrad", dynamic=_rules(insert_on="apply", max_rows=8, eviction="lfu")),
        ),
    ),
    "half": ConfigSpec(
        "half",
        (
            F("hb", "h_b", 9, 3, "sum"),
            F("hb_seq", "h_b", 9, 3, "sum", seq=2),
            F("hf", "h_f", 7, 2, "mean"),
            F("hg", "h_g", 5, 4, "sqrtn"),
        ),
        table_specs=(
            T("h_b", "adagrad", "bfloat16", "bfloat16"),
            T("h_f", "ftrl", "float16", "float32"),
            T("h_g", "adagrad", "float32", "bfloat16"),
        ),
    ),
    "keyed_half": ConfigSpec(
        "keyed_half",
        (
            K("kh", "k_h", 3, "sum"),
            K("kf", "k_f", 2, "mean"),
            F("hd", "h_d", 6, 2, "sqrtn"),
        ),
        table_specs=(
            T(
                "k_h",
                "adagrad",
                "bfloat16",
                "bfloat16",
                _rules(occurrence_threshold=1, expire_steps=1),
            ),
            T("k_f", "adagrad", "float16", "bfloat16", _rules(max_rows=7)),
            T("h_d", None, "float16", "float32"),
        ),
        skip_nonfinite=True,
    ),
    "keyed_rowid": ConfigSpec(
        "keyed_rowid",
        (
            K("kr", "k_r", 2, "sum"),
            K("kr_seq", "k_r", 2, "sum", seq=2),
            K("ks", "k_s", 3, "mean"),
        ),
        table_specs=(
            T("k_r", "adagrad", "float16", "float32", _rules(), rowid=True),
            T("k_s", None, "bfloat16", "float32", _rules(max_rows=9), rowid=True),
        ),
    ),
    "keyed_time": ConfigSpec(
        "keyed_time",
        (
            K("kt", "k_t", 2, "sum"),
            K("kt_seq", "k_t", 2, "sum", seq=2),
            K("ku", "k_u", 3, "mean"),
        ),
        table_specs=(
            T("k_t", "adagrad", dynamic=_rules(expire_seconds=60, expire_steps=2, max_rows=7)),
            T(
                "k_u",
                None,
                dynamic=_rules(expire_seconds=100, occurrence_threshold=1, insert_on="apply"),
                storage="mmap",
            ),
        ),
    ),
    "keyed_mmap": ConfigSpec(
        "keyed_mmap",
        (
            K("km", "k_m", 3, "sum"),
            K("km_seq", "k_m", 3, "sum", seq=3),
            K("kn", "k_n", 2, "sqrtn"),
        ),
        table_specs=(
            T("k_m", "adagrad", dynamic=_rules(max_rows=6, eviction="lfu"), storage="mmap"),
            T(
                "k_n",
                "ftrl",
                dynamic=_rules(
                    occurrence_threshold=2, expire_steps=1, insert_on="apply", max_rows=8
                ),
                storage="mmap",
            ),
        ),
    ),
}

ENGINE_CONFIGS = ("mixed", "packed", "dynamic")
KEYED_CONFIGS = ("keyed", "keyed_mix", "keyed_half", "keyed_rowid", "keyed_time", "keyed_mmap")
HALF_CONFIGS = ("half", "keyed_half", "keyed_rowid")
TIMED_CONFIGS = ("keyed_time",)
NEW_CONFIGS = (
    "keyed",
    "keyed_mix",
    "half",
    "keyed_half",
    "keyed_rowid",
    "keyed_time",
    "keyed_mmap",
)
# A RowId table's largest prelude / history key: within float16's range.
ROWID_KEYS = 60000


def _optimizers(config: str, foreign: str | None):
    from embengine import optimizers as opt

    if config == "mixed":
        return {"t_user": opt.Adagrad(0.1), "t_item": opt.FTRL(0.1), "t_cat": None}, opt.SGD(0.1)
    if config == "packed":
        sgd = opt.SGD(0.05, low_dimensional_packing_status=True)
        ada = opt.Adagrad(0.1, low_dimensional_packing_status=True)
        # "packing": t_b's SGD differs from t_a's only in the packing hint, so it is stored apart.
        sgd_b = opt.SGD(0.05) if foreign == "packing" else sgd
        return {"t_a": sgd, "t_b": sgd_b, "t_c": ada, "t_d": ada, "t_e": sgd}, None
    if config == "dynamic":
        return {
            "t_x": opt.Adagrad(opt.DynamicLearningRate(0)),
            "t_y": opt.FTRL(opt.DynamicLearningRate(1)),
        }, None
    spec = SPECS[config]
    if spec.table_specs:
        make = {"adagrad": lambda: opt.Adagrad(0.1), "ftrl": lambda: opt.FTRL(0.1), None: None}
        return {t.name: (make[t.optimizer]() if t.optimizer else None) for t in spec.table_specs}, (
            opt.SGD(0.1)
        )
    raise ValueError(config)


def _engine_of(spec: ConfigSpec, tables: dict, global_opt, backend: str, ram: bool = False):
    """The EmbeddingEngine of ``spec``'s features over ``tables`` (name -> TableConfig); its
    "mmap" tables in files of a new folder (removed with the engine) unless ``ram``."""
    import embengine as ee

    features = {
        f.name: ee.FeatureConfig(tables[f.table], max_sequence_length=f.seq) for f in spec.features
    }
    storage: dict = {}
    folder = None
    if spec.mmap and not ram:
        storage = {t.name: t.storage for t in spec.table_specs}
        folder = tempfile.mkdtemp(
            prefix="embengine-fuzz-mmap-", dir=os.environ.get("EMBENGINE_FUZZ_TMP")
        )
    engine = ee.EmbeddingEngine(
        features,
        optimizer=global_opt,
        seed=SEED,
        backend=backend,
        nonfinite_gradients="skip_row" if spec.skip_nonfinite else "error",
        **({"storage": storage, "storage_dir": folder} if folder else {}),
    )
    if folder is not None:
        weakref.finalize(engine, shutil.rmtree, folder, True)
    return engine


def _fresh(spec: ConfigSpec, backend: str, ram: bool = False):
    """An engine of a keyed / 16-bit config, as created (no step taken); ``ram``: every
    table in RAM (the oracle's engine of an mmap config)."""
    import embengine as ee
    from embengine import initializers as init

    per_table, global_opt = _optimizers(spec.name, None)
    tables = {}
    for f in spec.features:
        if f.table in tables:
            continue
        t = spec.table_spec(f.table)
        tables[f.table] = ee.TableConfig(
            None if t.dynamic is not None else f.vocab,
            f.dim,
            name=f.table,
            combiner=f.combiner,
            optimizer=per_table[f.table],
            initializer=init.RowId() if t.rowid else init.RandomUniform(-1.0, 1.0),
            dynamic=None if t.dynamic is None else ee.DynamicVocabulary(**t.rules),
            weights_dtype=t.weights_dtype,
            slots_dtype=t.slots_dtype,
        )
    return _engine_of(spec, tables, global_opt, backend, ram)


def _start_state(spec: ConfigSpec, history: tuple, times: tuple = ()) -> dict:
    """The state a case's engine starts from: the reference backend's after the PRELUDE and
    then the case's ``history`` (more steps of the same kind: keys per step; ``times``: their
    timestamps, a timed config's), computed once per process for each (config, history)."""
    key = (spec.name, history, times)
    if key not in _PRELUDE_STATE:
        ref = _fresh(spec, "reference", ram=True)
        if history:
            ref.load_state_dict(_start_state(spec, ()))
        steps = prelude_batches(spec, history or PRELUDE)
        stamps = (times if history else PRELUDE_TIMES) if spec.timed else (None,) * len(steps)
        for (batch, grads), t in zip(steps, stamps, strict=True):
            ref.lookup(batch, **({} if t is None else {"timestamp": t}))
            ref.apply_gradients(grads)
        if len(_PRELUDE_STATE) > 64:  # histories are per case: keep the preludes only
            for k in [k for k in _PRELUDE_STATE if k[1]]:
                del _PRELUDE_STATE[k]
        _PRELUDE_STATE[key] = copy.deepcopy(ref.state_dict())
    return _PRELUDE_STATE[key]


def _build_new(
    spec: ConfigSpec, backend: str, history: tuple = (), times: tuple = (), ram: bool = False
):
    """An engine of a keyed / 16-bit config after its PRELUDE and ``history`` (at ``times``).
    Every engine loads the reference backend's state after them: the backends' float32 math
    agrees to an ulp, so their 16-bit values may round to neighbours, and the case's state is
    compared with the reference's from the same start."""
    engine = _fresh(spec, backend, ram)
    engine.load_state_dict(_start_state(spec, history, times))
    return engine


_PRELUDE_STATE: dict = {}


def prelude_batches(spec: ConfigSpec, steps=PRELUDE):
    """The PRELUDE's steps (or ``steps``, keys per step) as (features, gradients): each
    table's keys (a dense table's ids, ``|k| % vocab``) as one-id samples of its first bag
    feature; the other features' samples empty; gradients 0.25."""
    import numpy as np

    import embengine as ee

    out = []
    for keys in steps:
        b = len(keys)
        first = {}
        for f in spec.features:
            if not f.is_sequence and f.table not in first:
                first[f.table] = f.name
        feats, grads = {}, {}
        for f in spec.features:
            if first.get(f.table) == f.name:
                ids = list(keys) if f.keyed else [abs(k) % f.vocab for k in keys]
                if spec.table_spec(f.table).rowid:  # keys whose RowId values fit float16
                    ids = [k if abs(k) < ROWID_KEYS else k % 1000 for k in ids]
                samples = [[k] for k in ids]
            else:
                samples = [[] for _ in range(b)]
            flat = [k for s in samples for k in s]
            lengths = [len(s) for s in samples]
            feats[f.name] = ee.Ragged(np.asarray(flat, np.int64), lengths=np.asarray(lengths))
            shape = (b, f.seq, f.dim) if f.is_sequence else (b, f.dim)
            grads[f.name] = np.full(shape, 0.25, np.float32)
        out.append((feats, grads))
    return out


def build_engine(
    config: str,
    backend: str,
    foreign: str | None = None,
    history: tuple = (),
    times: tuple = (),
    ram: bool = False,
):
    """A fresh EmbeddingEngine of an engine config (``foreign``: None, "vocab" or "packing");
    a keyed / 16-bit config's after its PRELUDE and ``history`` (a case's further steps,
    tuples of keys, at ``times`` for a timed config; ``foreign`` does not apply to them);
    ``ram``: an mmap config's tables in RAM (the oracle's)."""
    import embengine as ee
    from embengine import initializers as init

    spec = SPECS[config]
    if spec.table_specs:
        if foreign is not None:
            raise ValueError(f"no foreign variant of {config}")
        return _build_new(spec, backend, history, times, ram)
    per_table, global_opt = _optimizers(config, foreign)
    scale = 10 if foreign == "vocab" else 1
    tables = {}
    for f in spec.features:
        if f.table not in tables:
            # RowId-like values would make wrong rows easy to spot but hide combiner mistakes on
            # equal rows; a seeded random initializer gives every row distinct values.
            tables[f.table] = ee.TableConfig(
                f.vocab * scale,
                f.dim,
                name=f.table,
                combiner=f.combiner,
                optimizer=per_table[f.table],
                initializer=init.RandomUniform(-1.0, 1.0),
            )
    return _engine_of(spec, tables, global_opt, backend)


def tpu_feature_config():
    """A fresh nested feature config of the TF port (fresh: TPUEmbedding fills it in)."""
    from embengine import tpu

    t_user = tpu.TableConfig(10, 3, optimizer=tpu.Adagrad(0.1), combiner="sum", name="t_user")
    t_item = tpu.TableConfig(8, 2, combiner="mean", name="t_item")  # the global optimizer
    t_cat = tpu.TableConfig(5, 2, optimizer=tpu.FTRL(0.1), combiner="sqrtn", name="t_cat")
    return {
        "user": tpu.FeatureConfig(t_user),
        "item": tpu.FeatureConfig(t_item),
        "hist": tpu.FeatureConfig(t_item, max_sequence_length=3),
        "grp": {"cat": tpu.FeatureConfig(t_cat)},
    }


def build_tpu(backend: str, serving: bool = False):
    from embengine import tpu

    if serving:
        return tpu.TPUEmbeddingForServing(tpu_feature_config(), seed=SEED, backend=backend)
    return tpu.TPUEmbedding(tpu_feature_config(), tpu.SGD(0.1), seed=SEED, backend=backend)
