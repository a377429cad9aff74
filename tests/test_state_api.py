"""The engine's public state API: ``spec()`` / ``from_spec``, ``state_dict()`` /
``load_state_dict``, ``lookup_with_batch``; what checkpoints, export and the torch layer use."""

from __future__ import annotations

import copy
import json
import tracemalloc

import numpy as np
import pytest

import embengine as ee
from embengine import checkpoint as ckpt_mod
from embengine import initializers as I
from embengine import optimizers as O
from embengine import safetensors_io
from embengine.spec import SpecError
from embengine.state import PartialLoadError


def _lr_schedule(step: int) -> float:
    return 0.1 / (1 + step)


# Every optimizer class (non-default hyperparameters where they have any), each on its own table
# with one initializer of every class in turn; dims the optimizers accept.
OPTIMIZERS = [
    (O.SGD(0.1, clipvalue=(-0.5, None), weight_decay_factor=0.01), 4),
    (O.Adagrad(O.DynamicLearningRate(0), hessian_compression_times=2), 4),
    (O.AdagradMomentum(0.1, momentum=0.9, use_nesterov=True, beta2=0.99), 4),
    (O.ProximalAdagrad(0.1, l1_regularization_strength=0.01), 4),
    (O.Adam(_lr_schedule, bias_correction="per_row"), 4),
    (O.AMSGrad(0.05), 4),
    (O.Lion(0.01), 4),
    (O.FTRL(0.1, beta=0.1, l2_regularization_strength=0.01), 4),
    (O.Momentum(0.1, momentum=0.9), 4),
    (O.RMSProp(0.01, momentum=0.5, centered=True), 4),
    (O.Adadelta(1.0), 4),
    (O.Assign(), 4),
    (O.FrequencyEstimator(tau=0.2, max_delta=50.0), 1),
    (O.BatchSoftmax(0.3), 1),
    (O.Adagrad(0.1, low_dimensional_packing_status=True), 2),  # packed with the next one
    (O.Adagrad(0.1, low_dimensional_packing_status=True), 2),
]
INITIALIZERS = [
    None,
    I.Zeros(),
    I.Constant(0.5),
    I.RandomUniform(-0.2, 0.3),
    I.TruncatedNormal(0.1, 0.2),
    I.RowId(3),
]


def _every_kind_engine(backend: str = "reference", **kw) -> ee.EmbeddingEngine:
    tables = [
        ee.TableConfig(
            12 + t,
            dim,
            name=f"t{t}",
            optimizer=opt,
            combiner=("sum", "mean")[t % 2],
            initializer=INITIALIZERS[t % len(INITIALIZERS)],
            quantization_config=ee.QuantizationConfig(8, -1.0, 1.0) if t == 3 else None,
        )
        for t, (opt, dim) in enumerate(OPTIMIZERS)
    ]
    features = {f"f{t}": ee.FeatureConfig(table) for t, table in enumerate(tables)}
    features["seq"] = ee.FeatureConfig(tables[0], max_sequence_length=3)
    features["shaped"] = ee.FeatureConfig(
        tables[2], output_shape=(2, 2), validate_weights_and_indices=False
    )
    return ee.EmbeddingEngine(features, seed=7, backend=backend, **kw)


def _batch(eng: ee.EmbeddingEngine, step: int) -> dict:
    rng = np.random.default_rng(step)
    feats = {}
    for name, fc in eng.feature_config.items():
        vocab = fc.table.vocabulary_size
        feats[name] = [list(rng.integers(0, vocab, 1 + (i % 3))) for i in range(4)]
    return feats


def _train(eng: ee.EmbeddingEngine, steps: int) -> None:
    for _ in range(steps):
        acts = eng.lookup(_batch(eng, eng.step))
        rng = np.random.default_rng(100 + eng.step)
        grads = {k: rng.standard_normal(a.shape).astype(np.float32) for k, a in acts.items()}
        eng.apply_gradients(grads, learning_rates=[0.05, 0.01])  # tags 0 (Dynamic), 1 (callable)


def _copy_state(eng: ee.EmbeddingEngine) -> dict[str, np.ndarray]:
    return {
        f"{t}/{k}": np.array(a) for t, e in eng.state_dict()["tables"].items() for k, a in e.items()
    }


def _assert_same_state(a: ee.EmbeddingEngine, b: ee.EmbeddingEngine) -> None:
    assert a.step == b.step
    sa, sb = _copy_state(a), _copy_state(b)
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and sa[k].tobytes() == sb[k].tobytes(), k


# -- spec / from_spec ------------------------------------------------------------------------------


def test_the_cases_cover_every_optimizer_and_initializer_class():
    opts = {type(o).__name__ for o, _ in OPTIMIZERS}
    classes = [getattr(O, n) for n in O.__all__]
    exported = {
        c.__name__
        for c in classes
        if isinstance(c, type) and issubclass(c, O.Optimizer) and c is not O.Optimizer
    }
    assert exported <= opts, sorted(exported - opts)
    inits = {type(i).__name__ for i in INITIALIZERS if i is not None} | {"FromFunction"}
    classes = {
        n
        for n in I.__all__
        if isinstance(getattr(I, n), type) and issubclass(getattr(I, n), I.Initializer)
    } - {"Initializer"}
    assert classes <= inits, sorted(classes - inits)  # FromFunction: its own test below


def test_spec_round_trips_every_optimizer_and_initializer_through_json():
    eng = _every_kind_engine()
    spec = eng.spec()
    text = json.dumps(spec)  # JSON-able
    rebuilt = ee.EmbeddingEngine.from_spec(json.loads(text), callables={1: _lr_schedule})
    assert rebuilt.spec() == spec
    assert list(rebuilt.feature_config) == list(eng.feature_config)
    assert rebuilt.table_names == eng.table_names
    for name in eng.table_names:
        assert rebuilt.optimizer(name) == eng.optimizer(name), name
        assert type(rebuilt.optimizer(name)) is type(eng.optimizer(name))
        assert rebuilt.learning_rate_tag(name) == eng.learning_rate_tag(name)
    for name, fc in eng.feature_config.items():
        got = rebuilt.feature_config[name]
        assert (got.max_sequence_length, got.output_shape, got.validate_weights_and_indices) == (
            fc.max_sequence_length,
            fc.output_shape,
            fc.validate_weights_and_indices,
        )
        assert got.table.quantization_config == fc.table.quantization_config
    # Same seed and initializers: the same initial tables and slots, bit for bit; the same
    # hyperparameters: the same training.
    _assert_same_state(eng, rebuilt)
    _train(eng, 2)
    _train(rebuilt, 2)
    _assert_same_state(eng, rebuilt)


def test_from_spec_takes_overrides():
    eng = _every_kind_engine()
    rebuilt = ee.EmbeddingEngine.from_spec(
        eng.spec(), {1: _lr_schedule}, seed=8, nonfinite_gradients="skip_row"
    )
    assert rebuilt.seed == 8 and rebuilt.nonfinite_gradients == "skip_row"
    assert rebuilt.backend == "reference"


def test_from_spec_names_what_it_cannot_rebuild():
    eng = _every_kind_engine()
    words = r"tables\[4\] \('t4'\): .*tag 1 was the callable '_lr_schedule'.*callables=\{1: "
    with pytest.raises(SpecError, match=words):
        ee.EmbeddingEngine.from_spec(eng.spec())
    spec = eng.spec()
    spec["tables"][5]["optimizer"]["params"]["beta_1"] = 2.0
    with pytest.raises(SpecError, match=r"tables\[5\] \('t5'\): .*beta_1"):
        ee.EmbeddingEngine.from_spec(spec, {1: _lr_schedule})
    spec = eng.spec()
    del spec["tables"][2]["dim"]
    with pytest.raises(SpecError, match=r"tables\[2\] \('t2'\): no key 'dim'"):
        ee.EmbeddingEngine.from_spec(spec, {1: _lr_schedule})
    spec = eng.spec()
    spec["features"][0]["table"] = "nope"
    with pytest.raises(SpecError, match=r"features\[0\] \('f0'\): table 'nope' is not one of"):
        ee.EmbeddingEngine.from_spec(spec, {1: _lr_schedule})
    spec = eng.spec()
    spec["tables"][1]["slots"] = []
    with pytest.raises(
        SpecError,
        match=r"tables\[1\]\.slots \[\] are not the slots of its "
        "optimizer Adagrad",
    ):
        ee.EmbeddingEngine.from_spec(spec, {1: _lr_schedule})
    # One function for two callable tags would renumber the tags: refused.
    a = ee.TableConfig(5, 2, name="a", optimizer=O.SGD(lambda: 0.1))
    b = ee.TableConfig(5, 2, name="b", optimizer=O.SGD(lambda: 0.2))
    two = ee.EmbeddingEngine(
        {"fa": ee.FeatureConfig(a), "fb": ee.FeatureConfig(b)}, backend="reference"
    )
    with pytest.raises(
        SpecError, match="2 learning-rate tags, its tables with the callables given have 1"
    ):
        ee.EmbeddingEngine.from_spec(two.spec(), {0: _lr_schedule, 1: _lr_schedule})


def test_from_function_initializers_must_be_passed_to_from_spec():
    def fn(shape, dtype):
        return np.full(shape, 0.75, dtype)

    t = ee.TableConfig(6, 2, name="t", optimizer=O.SGD(0.1), initializer=I.FromFunction(fn))
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, backend="reference")
    spec = eng.spec()
    assert spec["tables"][0]["initializer"] == {
        "class": "FromFunction",
        "function": fn.__qualname__,
    }
    with pytest.raises(SpecError, match=r"FromFunction\(.*fn\).*initializers=\{'t': "):
        ee.EmbeddingEngine.from_spec(spec)
    rebuilt = ee.EmbeddingEngine.from_spec(spec, initializers={"t": I.FromFunction(fn)})
    _assert_same_state(eng, rebuilt)


def test_spec_is_what_a_checkpoint_stores(tmp_path):
    eng = _every_kind_engine()
    path = eng.save(tmp_path)
    spec, reader = ckpt_mod.read_checkpoint(path)
    assert spec == eng.spec()
    assert reader.step == 0 and reader.path == path


# -- state_dict / load_state_dict ------------------------------------------------------------------


def _packed_engine(backend="reference", packing=True) -> ee.EmbeddingEngine:
    ada = O.Adagrad(0.1, low_dimensional_packing_status=packing)
    a = ee.TableConfig(5, 2, name="a", optimizer=ada, combiner="sum", initializer=I.RowId())
    b = ee.TableConfig(7, 2, name="b", optimizer=ada, combiner="sum", initializer=I.RowId(100))
    c = ee.TableConfig(4, 1, name="c", optimizer=O.FrequencyEstimator(), combiner="sum")
    return ee.EmbeddingEngine(
        {"fa": ee.FeatureConfig(a), "fb": ee.FeatureConfig(b), "fc": ee.FeatureConfig(c)},
        seed=1,
        backend=backend,
    )


def _train_packed(eng: ee.EmbeddingEngine, steps: int) -> None:
    for _ in range(steps):
        s = eng.step
        acts = eng.lookup({"fa": [[s % 5, 1], [2]], "fb": [[6], [s % 7, 0]], "fc": [[1], [s % 4]]})
        eng.apply_gradients({k: np.full(a.shape, 0.5 + s, np.float32) for k, a in acts.items()})


def test_state_dict_is_live_views_keyed_by_logical_table_and_row():
    eng = _packed_engine()
    state = eng.state_dict()
    assert state["step"] == 0
    assert state["learning_rates"] == {"tags": []}
    assert list(state["tables"]) == ["a", "b", "c"]
    assert list(state["tables"]["b"]) == ["weights", "accumulators"]
    assert list(state["tables"]["c"]) == ["weights", "last_hit_step"]
    assert state["tables"]["c"]["last_hit_step"].dtype == np.int32
    w = state["tables"]["b"]["weights"]
    assert w.shape == (7, 2) and w.dtype == np.float32
    # b is packed after a in one storage table, but its row r is its id r.
    np.testing.assert_array_equal(w[:, 0], 100 + np.arange(7))
    np.testing.assert_array_equal(
        eng.lookup({"fa": [[0]], "fb": [[3]], "fc": [[0]]}, training=False)["fb"], [[103, 103]]
    )
    # Live: an update shows in the views taken before it, and writes go to the engine.
    before = w.copy()
    _train_packed(eng, 1)
    assert not np.array_equal(w, before)
    w[3] = 9.0
    np.testing.assert_array_equal(eng.embedding_tables["b"][3], [9, 9])
    assert eng.state_dict()["step"] == 1


def test_load_state_dict_between_packed_and_unpacked_engines(backend):
    packed, plain = _packed_engine(backend), _packed_engine(backend, packing=False)
    _train_packed(packed, 3)
    plain.load_state_dict(copy.deepcopy(packed.state_dict()))
    _assert_same_state(packed, plain)
    _train_packed(packed, 2)
    _train_packed(plain, 2)
    _assert_same_state(packed, plain)


def test_load_state_dict_of_its_own_state_and_forgets_the_pending_batch():
    eng = _packed_engine()
    _train_packed(eng, 2)
    snapshot = copy.deepcopy(eng.state_dict())
    _train_packed(eng, 1)
    acts = eng.lookup({"fa": [[1]], "fb": [[1]], "fc": [[1]]})  # pending training batch
    eng.load_state_dict(snapshot)
    assert eng.step == 2
    for t, entries in snapshot["tables"].items():
        for k, a in entries.items():
            np.testing.assert_array_equal(eng.state_dict()["tables"][t][k], a)
    with pytest.raises(ValueError, match="needs a lookup"):
        eng.apply_gradients({k: np.ones_like(a) for k, a in acts.items()})


def _set(*path_and_value):
    """An edit of a state: set ``state[k0][k1]... = value``."""
    *path, key, value = path_and_value

    def edit(state):
        for k in path:
            state = state[k]
        state[key] = value

    return edit


def _pop(*path):
    def edit(state):
        for k in path[:-1]:
            state = state[k]
        del state[path[-1]]

    return edit


# (what, edit of a copy of a good state, error, message). Each problem is in the last table or
# after every table, so a copy made while checking would show in the earlier tables.
BAD_STATES = [
    (
        "shape",
        _set("tables", "c", "weights", np.zeros((5, 1), np.float32)),
        ValueError,
        r"state\['tables'\]\['c'\]\['weights'\] is float32 \[5, 1\], table 'c' holds float32 "
        r"\[4, 1\]",
    ),
    (
        "dtype",
        _set("tables", "c", "last_hit_step", np.zeros((4, 1), np.float32)),
        ValueError,
        r"\['last_hit_step'\] is float32 \[4, 1\], table 'c' holds int32",
    ),
    (
        "not an array",
        _set("tables", "c", "weights", [[0.0]] * 4),
        TypeError,
        r"\['c'\]\['weights'\] must be a NumPy array or a TensorSource, got list",
    ),
    (
        "unknown entry",
        _set("tables", "c", "momenta", np.zeros((4, 1))),
        ValueError,
        r"\['c'\] has unknown entries \['momenta'\]",
    ),
    (
        "missing entry",
        _pop("tables", "c", "last_hit_step"),
        ValueError,
        r"\['c'\] has no \['last_hit_step'\]",
    ),
    (
        "unknown table",
        _set("tables", "zz", {}),
        ValueError,
        r"unknown tables \['zz'\]; the engine has \['a', 'b', 'c'\]",
    ),
    ("missing table", _pop("tables", "c"), ValueError, r"no entry for tables \['c'\]"),
    (
        "step",
        _set("step", -1),
        ValueError,
        r"state\['step'\] must be an int in \[0, 2\*\*63\), got -1",
    ),  # noqa: E501
    ("step bool", _set("step", True), ValueError, r"must be an int in \[0, 2\*\*63\), got True"),
    ("no step", _pop("step"), ValueError, "state has no 'step'"),
    ("key", _set("optimizer", {}), ValueError, r"unknown keys \['optimizer'\]"),
    (
        "tags",
        _set("learning_rates", {"tags": [{"tag": 0, "callable": "f"}]}),
        ValueError,
        r"1 dynamic tags \(callables at \[0\]\), the engine has 0",
    ),
    ("tables", _set("tables", []), TypeError, r"state\['tables'\] must be a dict"),
]


def test_load_state_dict_checks_every_entry_before_copying_any():
    donor = _packed_engine()
    _train_packed(donor, 3)
    eng = _packed_engine()
    _train_packed(eng, 1)
    before = _copy_state(eng)
    for what, edit, error, pattern in BAD_STATES:
        state = copy.deepcopy(donor.state_dict())
        edit(state)
        with pytest.raises(error, match=pattern):
            eng.load_state_dict(state)
        assert eng.step == 1, what
        after = _copy_state(eng)
        assert all(after[k].tobytes() == before[k].tobytes() for k in before), what
    with pytest.raises(TypeError, match="state must be a dict"):
        eng.load_state_dict([1, 2])


def test_load_state_dict_strict_false_leaves_what_the_state_lacks():
    donor = _packed_engine()
    _train_packed(donor, 3)
    eng = _packed_engine()
    state = copy.deepcopy(donor.state_dict())
    del state["step"], state["tables"]["a"], state["tables"]["b"]["accumulators"]
    state["learning_rates"] = {"tags": [{"tag": 0, "callable": None}]}  # ignored: not strict
    # c's last steps seen (1 to 3) are past the step a state without one keeps (0)
    with pytest.raises(ValueError, match=r"slot 'last_hit_step' of id 0 is 1 .*at step 0\)"):
        eng.load_state_dict(state, strict=False)
    eng.load_state_dict({"step": 3}, strict=False)
    before = _copy_state(eng)
    eng.load_state_dict(state, strict=False)
    assert eng.step == 3
    after = _copy_state(eng)
    for key in ("a/weights", "a/accumulators", "b/accumulators"):
        assert after[key].tobytes() == before[key].tobytes(), key
    for key in ("b/weights", "c/weights", "c/last_hit_step"):
        np.testing.assert_array_equal(after[key], _copy_state(donor)[key])
    # Unknown names stay errors: a misspelt table must not be skipped silently.
    with pytest.raises(ValueError, match=r"unknown tables \['B'\]"):
        eng.load_state_dict({"tables": {"B": {}}}, strict=False)


class _Source:
    """A TensorSource that fills with a value, or fails like a file truncated mid-read."""

    def __init__(self, shape, dtype, value=None):
        self.shape, self.dtype, self.value = shape, np.dtype(dtype), value

    def read_into(self, out):
        if self.value is None:
            out[: len(out) // 2] = 7  # part of the table, then the read fails
            raise OSError("the file went away")
        out[...] = self.value


def test_load_state_dict_reads_tensor_sources_into_the_tables():
    eng = _packed_engine()
    state = copy.deepcopy(eng.state_dict())
    state["step"] = 5
    state["tables"]["b"]["weights"] = _Source((7, 2), np.float32, 2.5)
    eng.load_state_dict(state)
    np.testing.assert_array_equal(eng.embedding_tables["b"], np.full((7, 2), 2.5))
    assert eng.step == 5


def test_a_tensor_source_failing_midway_is_a_partial_load_error():
    eng = _packed_engine()
    _train_packed(eng, 1)
    state = copy.deepcopy(eng.state_dict())
    state["step"] = 9
    state["tables"]["b"]["accumulators"] = _Source((7, 2), np.float32)
    words = r"table 'b' \(the file went away\).*Tables \['a'\] and part of 'b'.*step is still 1"
    with pytest.raises(PartialLoadError, match=words) as exc:
        eng.load_state_dict(state)
    assert (exc.value.table, exc.value.done, exc.value.step) == ("b", ["a"], 1)
    assert isinstance(exc.value.__cause__, OSError)
    assert eng.step == 1


def test_restore_copies_chunk_by_chunk_into_the_tables(tmp_path, monkeypatch):
    """A restore reads each table into the engine's own memory through a bounded buffer: the
    memory it allocates is a small fraction of the table's (an mmap table may exceed RAM)."""
    t = ee.TableConfig(40_000, 16, name="t", optimizer=O.Adagrad(0.1))
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, backend="reference")
    path = eng.save(tmp_path)
    table_bytes = 40_000 * 16 * 4 * 2  # weights and accumulators
    monkeypatch.setattr(safetensors_io, "CHUNK_BYTES", 64 * 1024)
    tracemalloc.start()
    try:
        eng.restore(path, verify=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < table_bytes / 8, (peak, table_bytes)


# -- lookup_with_batch -----------------------------------------------------------------------------


def test_lookup_with_batch_returns_the_batch_it_looked_up():
    eng = _packed_engine()
    feats = {"fa": [[1, 1]], "fb": [[2]], "fc": [[3]]}
    acts, batch = eng.lookup_with_batch(feats)
    assert isinstance(batch, ee.PreparedBatch) and batch.deduplicated
    np.testing.assert_array_equal(acts["fb"], eng.lookup(feats, training=False)["fb"])
    eng.lookup({"fa": [[4]], "fb": [[4]], "fc": [[0]]})  # another lookup in between
    eng.apply_gradients({k: np.ones_like(a) for k, a in acts.items()}, batch=batch)
    changed = np.flatnonzero(
        np.any(eng.embedding_tables["b"] != 100 + np.arange(7)[:, None], axis=1)
    )
    np.testing.assert_array_equal(changed, [2])  # the first lookup's rows, not the second's
    acts, batch = eng.lookup_with_batch(feats, training=False)
    assert not batch.deduplicated


def _evaluate(eng: ee.EmbeddingEngine, step: int) -> None:
    """Evaluation lookups of held-out batches, every way one can be made: features, a
    lookup-only PreparedBatch and a deduplicated one, each looked up with training=False."""
    held_out = _batch(eng, 1000 + step)
    eng.lookup(held_out, training=False)
    eng.lookup(eng.preprocess(_batch(eng, 2000 + step), training=False), training=False)
    eng.lookup_with_batch(eng.preprocess(held_out), training=False)


@pytest.mark.parametrize("explicit", [False, True], ids=["pending", "batch="])
def test_an_evaluation_lookup_between_a_training_lookup_and_its_update_changes_nothing(
    backend, explicit
):
    """A validation metric in the middle of a step: training lookup, evaluation lookups of
    held-out batches, then apply_gradients. The update is the one of the training lookup, bit
    for bit the update without the evaluation in between (every optimizer, packed, quantized
    and sequence features), and consumes that lookup; the training activations are left as
    they were. An evaluation lookup used to forget the pending batch: apply_gradients() then
    raised "needs a lookup", and apply_gradients(batch=) lost the lookup's resolved form."""
    plain, checked = _every_kind_engine(backend), _every_kind_engine(backend)
    for step in range(3):
        feats = _batch(plain, step)
        rng = np.random.default_rng(100 + step)
        grads = None
        for eng in (plain, checked):
            batch = eng.preprocess(feats) if explicit else None
            acts = eng.lookup(batch if explicit else feats)
            seen = {k: a.copy() for k, a in acts.items()}
            if eng is checked:
                _evaluate(eng, step)
                for k, a in acts.items():
                    assert a.tobytes() == seen[k].tobytes(), k
            if grads is None:
                grads = {k: rng.standard_normal(a.shape, np.float32) for k, a in seen.items()}
            eng.apply_gradients(grads, learning_rates=[0.05, 0.01], batch=batch)
            with pytest.raises(ValueError, match="needs a lookup"):  # one update per lookup
                eng.apply_gradients(grads, learning_rates=[0.05, 0.01])
        _assert_same_state(plain, checked)
    # An evaluation batch is never pending: after a completed step there is nothing to update.
    _evaluate(checked, 3)
    with pytest.raises(ValueError, match="needs a lookup"):
        checked.apply_gradients(grads, learning_rates=[0.05, 0.01])


def test_load_of_a_from_function_table_needs_no_function(tmp_path):
    """The function is not stored; the checkpoint's values replace what it would give."""

    def fn(shape, dtype):
        return np.full(shape, 0.75, dtype)

    t = ee.TableConfig(6, 2, name="t", optimizer=O.SGD(0.1), initializer=I.FromFunction(fn))
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, backend="reference")
    loaded = ee.EmbeddingEngine.load(eng.save(tmp_path))
    _assert_same_state(eng, loaded)
