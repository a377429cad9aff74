"""``Preprocessor``: an engine's ``preprocess`` without the engine, for DataLoader workers.

A DataLoader runs its ``collate_fn`` in worker processes. Under the "spawn" start method the
function is pickled into every worker, and a function that holds an engine (or an
EmbeddingLayer) sends every table and optimizer slot along. A Preprocessor holds only what
preparation reads: the features' resolved configs (without optimizers and initializers), the
storage layout (which tables are packed together, at which row) and the backend's name. Its
pickle takes a few hundred bytes whatever the tables' size (660 for examples/dataloader.py).

Which code builds the deduplication data (the results are the same bit for bit everywhere,
and the same as the engine's ``preprocess``):

- numba backend, in the main process or a spawned worker: the parallel preparation kernel
  (``kernels.prepare.prepare_tables``), as ``engine.preprocess``;
- numba backend, in a process forked from the main one (a DataLoader worker under Linux's
  default "fork" start method): the same per-table code compiled without ``parallel``
  (``kernels.prepare.prepare_tables_serial``), since GNU OpenMP is not fork-safe: a parallel
  region there is killed by numba's omp layer or hangs in libgomp (kernels/pool.py). The
  workers are the parallelism then. ``engine.preprocess`` takes the same path there;
- reference backend: NumPy (``batch.build_tables_numpy``) everywhere.

Example (see examples/dataloader.py)::

    pre = engine.preprocessor()
    def collate(samples):  # a top-level function or functools.partial under "spawn"
        return pre({"user": ..., "item": ...})
    loader = DataLoader(dataset, batch_size=256, num_workers=2, collate_fn=collate)
    for batch in loader:
        acts = layer(batch)   # the engine checks that the batch fits it
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from .backends.registry import make_backend
from .batch import PreparedBatch, prepare
from .config import FeatureConfig, ResolvedFeatures, TableConfig
from .keyed_jagged import is_keyed_jagged, keyed_jagged_to_features

__all__ = ["Preprocessor"]


def _preparation_configs(resolved: ResolvedFeatures) -> ResolvedFeatures:
    """The resolved features with each table's optimizer and initializer dropped: preparation
    reads neither, and a learning-rate callable or a custom initializer need not pickle."""
    tables = tuple(
        dataclasses.replace(t, optimizer=None, initializer=None) for t in resolved.tables
    )
    features: dict[str, FeatureConfig] = {
        name: dataclasses.replace(fc, table=tables[resolved.feature_table[name]])
        for name, fc in resolved.features.items()
    }
    return ResolvedFeatures(
        features,
        tables,
        resolved.table_names,
        dict(resolved.feature_table),
        resolved.table_features,
    )


class Preprocessor:
    """Builds the PreparedBatch that ``engine.preprocess`` would, without holding the engine.

    Get one from ``engine.preprocessor()`` (or ``EmbeddingLayer.preprocessor()``); call it like
    ``engine.preprocess``: ``pre(features, weights=None, *, training=True)``. ``features`` may
    also be a KeyedJagged (or TorchRec KeyedJaggedTensor), as ``EmbeddingLayer.preprocess``
    takes. The batch is accepted by that engine (and by any engine built from the same feature
    and table configs), in ``lookup`` / ``apply_gradients(batch=...)`` or an EmbeddingLayer.

    Pure and cheap to send: it reads no table and holds none; pickling it (spawned DataLoader
    workers) sends the configs only, and an unpickled one starts with empty batch memory. See
    the module docstring for which code runs in which process.
    """

    def __init__(
        self,
        resolved: ResolvedFeatures,
        storage_layout: list[list[tuple[str, int]]],
        backend: str,
        *,
        deduplicate_evaluation: bool = False,
    ):
        """``deduplicate_evaluation``: a ShardedEngine's (``ShardedEngine.preprocessor``):
        its evaluation batches are deduplicated too, as its ``preprocess`` builds them (its
        lookup asks each owner for a unique id once), and marked for evaluation
        (``PreparedBatch.training``)."""
        self._resolved = _preparation_configs(resolved)
        # Per storage table, its features and the row at which their table starts in it.
        self._storage_layout = [
            [(str(n), int(o)) for n, o in members] for members in storage_layout
        ]
        self._backend_name = backend
        self._deduplicate_evaluation = bool(deduplicate_evaluation)
        # The backend's own construction, as engine.preprocess calls it.
        self._build_tables = make_backend(backend).build_tables

    @classmethod
    def from_engine(cls, engine) -> Preprocessor:
        """The Preprocessor of an EmbeddingEngine: ``engine.preprocessor()`` (this module does
        not import the engine, which imports it)."""
        return engine.preprocessor()

    @property
    def backend(self) -> str:
        return self._backend_name

    @property
    def feature_config(self) -> dict[str, FeatureConfig]:
        """Feature name -> FeatureConfig (tables without optimizer and initializer)."""
        return dict(self._resolved.features)

    @property
    def table_configs(self) -> dict[str, TableConfig]:
        return dict(zip(self._resolved.table_names, self._resolved.tables, strict=True))

    def __call__(
        self, features, weights: Mapping | None = None, *, training: bool = True
    ) -> PreparedBatch:
        """Validate features and deduplicate ids per table, as ``engine.preprocess`` does
        (errors name the feature, the position and the value); ``training=False`` builds a
        batch for evaluation (an EmbeddingEngine's: lookup-only; a ShardedEngine's:
        deduplicated, marked ``training=False``)."""
        if not isinstance(features, Mapping) and is_keyed_jagged(features):
            features = keyed_jagged_to_features(features)
        return prepare(
            self._resolved,
            features,
            weights,
            self._build_tables,
            self._storage_layout,
            deduplicate=training or self._deduplicate_evaluation,
            training=training,
        )

    # Pickled (spawned workers): the configs and the backend's name; the backend's batch
    # memory is a cache and starts empty in the copy.
    def __getstate__(self) -> dict:
        return {
            "resolved": self._resolved,
            "storage_layout": self._storage_layout,
            "backend": self._backend_name,
            "deduplicate_evaluation": self._deduplicate_evaluation,
        }

    def __setstate__(self, state: dict) -> None:
        self._resolved = state["resolved"]
        self._storage_layout = state["storage_layout"]
        self._backend_name = state["backend"]
        self._deduplicate_evaluation = state["deduplicate_evaluation"]
        self._build_tables = make_backend(self._backend_name).build_tables

    def __repr__(self) -> str:
        tables = ", ".join(
            f"{n}: {t.vocabulary_size}x{t.dim}" for n, t in self.table_configs.items()
        )
        return f"Preprocessor(tables=[{tables}], backend={self._backend_name!r})"
