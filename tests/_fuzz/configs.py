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

``foreign`` variants build the same features with other tables: ``vocab`` multiplies every
vocabulary by 10 (a batch prepared there can hold ids past this engine's tables); ``packing``
turns packing off for one table, so the same features are stored as another number of tables.
"""

from __future__ import annotations

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

    @property
    def is_sequence(self) -> bool:
        return self.seq > 0


@dataclass(frozen=True)
class ConfigSpec:
    name: str
    features: tuple[FeatureSpec, ...]
    dynamic_tags: int = 0  # number of DynamicLearningRate tags (learning_rates= values)
    skip_nonfinite: bool = False  # nonfinite_gradients="skip_row"
    tpu: bool = False

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
}

ENGINE_CONFIGS = ("mixed", "packed", "dynamic")


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
    raise ValueError(config)


def build_engine(config: str, backend: str, foreign: str | None = None):
    """A fresh EmbeddingEngine of an engine config (``foreign``: None, "vocab" or "packing")."""
    import embengine as ee
    from embengine import initializers as init

    spec = SPECS[config]
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
    features = {
        f.name: ee.FeatureConfig(tables[f.table], max_sequence_length=f.seq) for f in spec.features
    }
    return ee.EmbeddingEngine(
        features,
        optimizer=global_opt,
        seed=SEED,
        backend=backend,
        nonfinite_gradients="skip_row" if spec.skip_nonfinite else "error",
    )


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
