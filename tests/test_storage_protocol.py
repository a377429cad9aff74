"""The storage seam: kernels see rows, not ids.

A storage class written here alone, registered as a storage kind the way a user would add one,
keeps its rows in reverse order after a few spare rows (id k of logical table i is row
``PAD + N - 1 - (first_i + k)``): an engine on it trains bit for bit like one on DenseTable,
for every optimizer, packed tables, weights, sequence features, empty bags, duplicate ids, both
backends, training and lookup-only, and checkpoints. It is the proof that no kernel assumes
id == row. A second class admits only even ids (rows_for gives -1 for odd ones): those pool as
zeros and are never updated.
"""

import ast
import re
from pathlib import Path

import numpy as np
import pytest

import embengine as ee
from embengine import optimizers as opt
from embengine.storage import DenseTable, TableStorage, TableView, register_storage_kind
from embengine.storage.registry import storage_kind

PAD = 3
SENTINEL = 7.0


class ReversedTable(DenseTable):
    """DenseTable's rows in reverse order after PAD spare rows full of SENTINEL, which no kernel
    may read or write. Rows are not ids at a base (``row_bases`` is None): only ``rows_for``
    knows where an id lives."""

    def __init__(self, spec, slot_specs, segments, seed):
        n = spec.vocabulary_size
        shifted = [(name, first + PAD, rows, init) for name, first, rows, init in segments]
        super().__init__(
            spec.name, n + PAD, spec.dim, slot_specs, segments[0][3], seed, segments=shifted
        )
        data = self.data
        data[PAD:] = data[PAD:][::-1].copy()
        data[:PAD] = SENTINEL
        self._n = n
        self._firsts = [first for _, first, _, _ in segments]
        self._kind = spec.storage

    @property
    def storage(self) -> str:
        return self._kind

    @property
    def row_bases(self):
        return None

    def rows_for(self, logical, ids, insert=True):
        ids = np.asarray(ids, dtype=np.int64)
        return PAD + self._n - 1 - (self._firsts[logical] + ids)

    def live_rows(self):
        return np.array([[PAD, PAD + self._n]], dtype=np.int64)

    def view(self, logical):
        name, first, rows = self._members[logical]
        first -= PAD
        top = PAD + self._n - 1 - first  # the row of id 0; ids go down from there
        return TableView(self, name, first, rows, rows=slice(top, top - rows, -1))


class EvenOnlyTable(DenseTable):
    """One logical table that admits only even ids: id 2j is row j, odd ids have no row (-1)."""

    def __init__(self, spec, slot_specs, segments, seed):
        ((name, _, rows, init),) = segments
        super().__init__(spec.name, (rows + 1) // 2, spec.dim, slot_specs, init, seed)
        # Row j holds id 2j, initialised as id 2j.
        self.data[:, : spec.dim] = init.init(seed, name, np.arange(0, rows, 2), spec.dim)

    @property
    def row_bases(self):
        return None

    def rows_for(self, logical, ids, insert=True):
        ids = np.asarray(ids, dtype=np.int64)
        return np.where(ids % 2 == 0, ids // 2, -1)


register_storage_kind("reversed-test", ReversedTable, packable=True)
register_storage_kind("even-only-test", EvenOnlyTable)

# Every optimizer class, the non-lazy sweeps and the no-accumulation paths.
OPTIMIZERS = [
    opt.SGD(0.1),
    opt.SGD(0.1, use_gradient_accumulation=False, clip_weight_min=-0.5, clip_weight_max=0.7),
    opt.Adagrad(0.2),
    opt.Adagrad(0.2, hessian_compression_times=2, clipvalue=0.5),
    opt.AdagradMomentum(0.1, momentum=0.9, use_nesterov=True, beta2=0.9, epsilon=0.1),
    opt.ProximalAdagrad(0.3, l1_regularization_strength=0.05, l2_regularization_strength=0.1),
    opt.Adam(0.05),
    opt.Adam(0.05, bias_correction="per_row", use_gradient_accumulation=False),
    opt.Adam(0.05, lazy_adam=False, weight_decay_factor=0.01, weight_decay_mode="l2"),
    opt.AMSGrad(0.05, bias_correction="per_row"),
    opt.Lion(0.01),
    opt.Lion(0.01, lazy_lion=False),
    opt.FTRL(0.2, l1_regularization_strength=0.05, beta=0.5),
    opt.Momentum(0.1, momentum=0.8, use_nesterov=True),
    opt.RMSProp(0.05, rho=0.8, momentum=0.5, centered=True, epsilon=1e-3),
    opt.Adadelta(1.0, rho=0.9, epsilon=1e-3),
    opt.Assign(weight_decay_factor=0.5),
]
COUNTING = [opt.FrequencyEstimator(tau=0.3, max_delta=50.0), opt.BatchSoftmax(0.25)]


def _packing(o: opt.Optimizer) -> opt.Optimizer:
    return type(o)(**{**o.hyperparameters(), "low_dimensional_packing_status": True})


def _engine(storage, backend, optimizer, dims=(2, 2, 4, 8, 6), seed=0, **kw):
    """Tables of the given dims (2, 2 and 4 packed into one physical table, 8 the fixed-layout
    kernels, 6 the any-layout ones), combiners in turn, a sequence feature on table 0."""
    o = _packing(optimizer)
    tables = [
        ee.TableConfig(
            17 + 3 * i,
            d,
            name=f"t{i}",
            combiner=("mean", "sum", "sqrtn")[i % 3],
            initializer=ee.initializers.RandomUniform(-0.3, 0.3),
        )
        for i, d in enumerate(dims)
    ]
    feats = {f"f{i}": ee.FeatureConfig(t) for i, t in enumerate(tables)}
    feats["seq"] = ee.FeatureConfig(tables[0], max_sequence_length=3)
    return ee.EmbeddingEngine(feats, optimizer=o, backend=backend, storage=storage, seed=seed, **kw)


def _features(eng, rng):
    """Duplicate ids, empty bags, weights on the bag features."""
    feats, weights = {}, {}
    for name, fc in eng.feature_config.items():
        n = fc.table.vocabulary_size
        bags = [list(rng.integers(0, n, rng.integers(0, 5))) for _ in range(6)]
        bags[1] = []  # an empty bag
        bags[2] = [3, 3, 3]  # duplicates
        feats[name] = bags
        if fc.max_sequence_length == 0:
            weights[name] = [list(rng.uniform(0.1, 2.0, len(b)).astype(np.float32)) for b in bags]
    return feats, weights


def _state_bytes(eng) -> dict:
    tables = eng.state_dict()["tables"]
    return {
        (t, k): np.ascontiguousarray(a).tobytes()
        for t, arrays in tables.items()
        for k, a in arrays.items()
    }


def _steps(engines, steps, seed=0):
    """The same steps on every engine; activations must be equal bit for bit."""
    rng = np.random.default_rng(seed)
    for step in range(steps):
        feats, weights = _features(engines[0], rng)
        results = []
        for e in engines:
            inference = e.lookup(feats, weights, training=False)
            pre = e.lookup(e.preprocess(feats, weights), training=False)  # dedup, no insert
            acts = e.lookup(feats, weights)
            for k in acts:
                assert inference[k].tobytes() == acts[k].tobytes(), k
                assert pre[k].tobytes() == acts[k].tobytes(), k
            grads = {
                k: np.sin(np.arange(v.size) * 0.7 + step).reshape(v.shape).astype(np.float32)
                for k, v in acts.items()
            }
            e.apply_gradients(grads)
            results.append(acts)
        for acts in results[1:]:
            for k in acts:
                assert acts[k].tobytes() == results[0][k].tobytes(), k


def _spare_rows_untouched(eng):
    for table in eng._physical:
        if isinstance(table, ReversedTable):
            assert (table.data[:PAD] == SENTINEL).all(), table.name


def test_the_test_storages_implement_the_protocol():
    spec = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(ee.TableConfig(10, 2, name="t"))},
        optimizer=opt.SGD(0.1),
        storage="reversed-test",
        backend="reference",
    )
    table = spec._physical[0]
    assert isinstance(table, TableStorage)
    assert spec.storage_plan.physical_tables[0].storage == "reversed-test"
    assert storage_kind("reversed-test").packable and not storage_kind("reversed-test").row_ids
    # The plan leaves a storage that maps its own ids out of the batches' row resolution.
    assert spec.storage_plan.storage_layout() == [[("f", -1)]]
    np.testing.assert_array_equal(table.rows_for(0, [0, 9]), [PAD + 9, PAD])


@pytest.mark.parametrize("optimizer", OPTIMIZERS + COUNTING, ids=lambda o: type(o).__name__)
def test_reversed_rows_train_like_dense_rows(backend, optimizer):
    dims = (1, 1, 1) if optimizer in COUNTING else (2, 2, 4, 8, 6)
    dense = _engine("ram", backend, optimizer, dims)
    rev = _engine("reversed-test", backend, optimizer, dims)
    assert [p.name for p in rev.storage_plan.physical_tables] == [
        p.name for p in dense.storage_plan.physical_tables
    ]
    assert any(len(p.tables) > 1 for p in rev.storage_plan.physical_tables)  # packed too
    assert _state_bytes(dense) == _state_bytes(rev)  # the same initial values, by logical row
    _steps([dense, rev], steps=3)
    assert _state_bytes(dense) == _state_bytes(rev)
    _spare_rows_untouched(rev)  # an every-row sweep goes over the live rows only


def test_reversed_storage_without_accumulation_and_skip_row():
    # skip_row: the non-finite check reads the batch's rows too.
    o = opt.Adagrad(0.2)
    engines = [
        _engine(s, "numba", o, nonfinite_gradients="skip_row") for s in ("ram", "reversed-test")
    ]
    rng = np.random.default_rng(1)
    feats, weights = _features(engines[0], rng)
    for e in engines:
        acts = e.lookup(feats, weights)
        grads = {k: np.ones_like(v) for k, v in acts.items()}
        grads["f1"][0, 0] = np.nan
        e.apply_gradients(grads)
    assert _state_bytes(engines[0]) == _state_bytes(engines[1])


def test_reversed_storage_checkpoints_round_trip(backend, tmp_path):
    o = opt.Adam(0.05, lazy_adam=False)
    dense = _engine("ram", backend, o)
    rev = _engine("reversed-test", backend, o)
    _steps([dense, rev], steps=2)
    rev.save(tmp_path / "rev")
    dense.save(tmp_path / "dense")
    # Checkpoints are keyed by logical table and row: each loads into the other storage.
    from_rev = _engine("ram", backend, o, seed=5)
    from_rev.restore(tmp_path / "rev")
    from_dense = _engine("reversed-test", backend, o, seed=5)
    from_dense.restore(tmp_path / "dense")
    loaded = ee.EmbeddingEngine.load(tmp_path / "rev", storage="reversed-test")
    assert loaded._physical[0].storage == "reversed-test"
    for e in (from_rev, from_dense, loaded):
        assert e.step == 2
        assert _state_bytes(e) == _state_bytes(dense)
    _steps([dense, rev, from_rev, from_dense, loaded], steps=2, seed=1)
    for e in (rev, from_rev, from_dense, loaded):
        assert _state_bytes(e) == _state_bytes(dense)
        _spare_rows_untouched(e)


def test_a_batch_prepared_for_dense_rows_is_refused_by_reversed_storage(backend):
    o = opt.SGD(0.1)
    dense, rev = _engine("ram", backend, o), _engine("reversed-test", backend, o)
    feats, weights = _features(dense, np.random.default_rng(0))
    with pytest.raises(ValueError, match="prepared for another engine"):
        rev.lookup(dense.preprocess(feats, weights))
    # A batch prepared by the engine itself (e.g. in a DataLoader worker) has no rows yet:
    # the engine resolves them once, at the lookup.
    batch = rev.preprocessor()(feats, weights)
    assert all(tb.unique_rows is None for tb in batch.tables)
    acts = rev.lookup(batch)
    want = dense.lookup(feats, weights)
    for k in want:
        assert acts[k].tobytes() == want[k].tobytes()


def test_ids_without_a_row_pool_zeros_and_get_no_update(backend):
    table = ee.TableConfig(10, 8, name="t", combiner="sum", initializer=ee.initializers.RowId(1))
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(table)},
        optimizer=opt.Adagrad(0.5),
        storage="even-only-test",
        backend=backend,
    )
    dense = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(table)}, optimizer=opt.Adagrad(0.5), backend=backend
    )
    assert eng._physical[0].data.shape[0] == 5  # rows for ids 0, 2, 4, 6, 8 only
    before = eng._physical[0].data.copy()
    feats = {"f": [[1, 3], [2, 5, 2], [], [9], [4, 4, 7]]}
    for training in (False, True):
        acts = eng.lookup(feats, training=training)["f"]
        full = dense.lookup(feats, training=False)["f"]  # RowId(1): row k is k everywhere
        # Odd ids add nothing: each bag sums only its even ids.
        even = dense.lookup({"f": [[], [2, 2], [], [], [4, 4]]}, training=False)["f"]
        np.testing.assert_array_equal(acts, even)
        assert not np.array_equal(acts, full)
    eng.apply_gradients({"f": np.ones((5, 8), np.float32)})
    after = eng._physical[0].data
    changed = np.flatnonzero((after != before).any(axis=1))
    np.testing.assert_array_equal(changed, [1, 2])  # ids 2 and 4; no row for 1, 3, 5, 7, 9
    # Each even id moved as it would in a dense table (the same gradient sums).
    dense.lookup(feats)
    dense.apply_gradients({"f": np.ones((5, 8), np.float32)})
    np.testing.assert_array_equal(
        eng.state_dict()["tables"]["t"]["weights"], dense.embedding_tables["t"][::2]
    )


def test_non_lazy_adam_sweeps_the_storage_live_rows_only():
    # The every-row sweep (non-lazy Adam) gets the live rows; a sweep of range(rows) would
    # change the spare rows (m = 1 there: a zero gradient still moves w).
    o = opt.Adam(0.1, lazy_adam=False)
    for backend in ("numba", "reference"):
        eng = _engine("reversed-test", backend, o, dims=(8,))
        table = eng._physical[0]
        table.data[:PAD] = SENTINEL
        feats, weights = _features(eng, np.random.default_rng(0))
        acts = eng.lookup(feats, weights)
        eng.apply_gradients({k: np.ones_like(v) for k, v in acts.items()})
        assert (table.data[:PAD] == SENTINEL).all()
        assert (table.data[PAD:, :8] != eng.embedding_tables["t0"][::-1]).sum() == 0


def test_no_kernel_mentions_an_id_offset():
    # Ids become rows in one place (the storage's rows_for, or batch.identity_rows for storages
    # whose rows are ids); no kernel shifts an id.
    kernels = Path(ee.__file__).parent / "kernels"
    for path in sorted(kernels.glob("*.py")):
        source = path.read_text()
        assert not re.search(r"id_?offset|ID_OFFSET", source, re.IGNORECASE), path.name
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Name | ast.arg):
                name = node.id if isinstance(node, ast.Name) else node.arg
                assert "offset" not in name.lower() or name in {
                    "offsets",
                    "f_offsets",
                    "task_offsets",
                    "output_offsets",
                    "unique_offsets",
                    "run_offsets",
                    "_offsets",
                }, f"{path.name}: {name}"


def test_rows_a_guard_left_unchanged_are_reported_by_id(backend):
    """A storage whose rows are not ids: the result guard's report names each table's ids
    (through the batch), and a row the batch did not touch (an every-row sweep) by its row."""
    big = 3e38
    t = ee.TableConfig(12, 4, name="t", combiner="sum")
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t)}, optimizer=opt.SGD(0.5), backend=backend, storage="reversed-test"
    )
    ids = np.array([1, 2, 5])
    acts = eng.lookup({"f": ee.Ragged(ids, lengths=[1, 1, 1], weights=[big, 1.0, -big])})
    g = np.full_like(acts["f"], big)
    with pytest.raises(ee.NonFiniteUpdateError, match=r"table 't': 2 rows \(ids 1, 5\)") as e:
        eng.apply_gradients({"f": g})
    assert {k: v.tolist() for k, v in e.value.rows.items()} == {"t": [1, 5]}

    # Non-lazy Adam sweeps every live row; id 7's (outside the batch) overflows with g = 0.
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t)},
        optimizer=opt.Adam(0.5, lazy_adam=False),
        backend=backend,
        storage="reversed-test",
    )
    table = eng._physical[0]
    row = int(table.rows_for(0, np.array([7]))[0])
    table.data[row, :4] = 3.3e38
    col = table.columns["momenta"].start
    table.data[row, col : col + 4] = -3e38  # a first moment that pushes w past float32's max
    acts = eng.lookup({"f": ee.Ragged(np.array([2]), lengths=[1])})
    with pytest.raises(ee.NonFiniteUpdateError) as e:
        eng.apply_gradients({"f": np.ones_like(acts["f"])})
    assert {k: v.tolist() for k, v in e.value.rows.items()} == {f"{table.name} rows": [row]}
