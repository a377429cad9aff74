"""A checkpoint written by the code before the state API (commit c523859) still loads, restores,
exports and trains on to the result that code produced; the new code writes the same layout.

The fixture ``tests/fixtures/checkpoint_c523859/`` (a few KB: five small tables, two pairs of
them packed, three optimizers, extra tensors and metadata) was made with the tree of c523859::

    git archive c523859 | tar -x -C /tmp/old
    cd /tmp/old && PYTHONPATH=. python make_fixture.py $REPO/tests/fixtures/checkpoint_c523859

with this ``make_fixture.py`` (the old engine saves after 3 steps, trains 2 more and records every
table and slot at both points in ``expected.json``; the reference backend, so the values are
exact)::

    import json
    import sys
    from pathlib import Path

    import numpy as np

    import embengine as ee
    from embengine import initializers as init
    from embengine import optimizers as opt

    out = Path(sys.argv[1])
    ada = opt.Adagrad(0.1, low_dimensional_packing_status=True)
    adam = opt.Adam(0.01, low_dimensional_packing_status=True)
    tables = {
        "a": ee.TableConfig(7, 2, optimizer=ada, combiner="sum", name="a",
                            initializer=init.RandomUniform(-0.5, 0.5)),
        "b": ee.TableConfig(5, 2, optimizer=ada, name="b"),  # packed with "a"
        "c": ee.TableConfig(6, 4, optimizer=adam, combiner="sqrtn", name="c"),
        "d": ee.TableConfig(4, 4, optimizer=adam, name="d",  # packed with "c"
                            initializer=init.Constant(0.25)),
        "e": ee.TableConfig(5, 3, optimizer=opt.SGD(0.5), name="e", initializer=init.RowId()),
    }
    features = {
        "fa": ee.FeatureConfig(tables["a"]),
        "fb": ee.FeatureConfig(tables["b"]),
        "fc": ee.FeatureConfig(tables["c"]),
        "fd": ee.FeatureConfig(tables["d"]),
        "fd2": ee.FeatureConfig(tables["d"]),
        "fe": ee.FeatureConfig(tables["e"], max_sequence_length=2),
    }


    def batch(step):
        return {"fa": [[0, 6, 6], [step % 7]], "fb": [[1, 4], [2]], "fc": [[5], [0, 1, 5]],
                "fd": [[3], [step % 4]], "fd2": [[0, 0], [1]], "fe": [[4, 2], [step % 5]]}


    def grads(acts, step):
        return {k: np.linspace(-1, 1, a.size, dtype=np.float32).reshape(a.shape) * (step + 1)
                for k, a in acts.items()}


    def train(engine, steps):
        for _ in range(steps):
            acts = engine.lookup(batch(engine.step))
            engine.apply_gradients(grads(acts, engine.step))


    def state(engine):
        return {name: {"weights": engine.embedding_tables[name].tolist(),
                       **{s: a.tolist() for s, a in engine.slots(name).items()}}
                for name in engine.table_names}


    eng = ee.EmbeddingEngine(features, seed=3, backend="reference")
    assert len(eng._physical) == 3  # a+b and c+d packed
    train(eng, 3)
    eng.save(out / "checkpoints", extra_tensors={"dense": np.arange(6, dtype=np.float32)},
             extra_metadata={"epoch": 1})
    saved = state(eng)
    train(eng, 2)
    (out / "expected.json").write_text(json.dumps(
        {"made_by": "c523859", "saved_step": 3, "saved": saved, "after_two_more_steps": state(eng),
         "step": eng.step}))
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

import embengine as ee
from embengine import checkpoint as ckpt_mod
from embengine import initializers as init
from embengine import optimizers as opt
from embengine.inspect import describe
from embengine.safetensors_io import read_header
from embengine.serving import ServingEngine, export

FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint_c523859"
CKPT = FIXTURE / "checkpoints" / "ckpt-000001-step000000000003"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())


# The script's configuration, batches and gradients (above), for this code.


def _features() -> dict[str, ee.FeatureConfig]:
    ada = opt.Adagrad(0.1, low_dimensional_packing_status=True)
    adam = opt.Adam(0.01, low_dimensional_packing_status=True)
    tables = {
        "a": ee.TableConfig(
            7, 2, optimizer=ada, combiner="sum", name="a", initializer=init.RandomUniform(-0.5, 0.5)
        ),
        "b": ee.TableConfig(5, 2, optimizer=ada, name="b"),
        "c": ee.TableConfig(6, 4, optimizer=adam, combiner="sqrtn", name="c"),
        "d": ee.TableConfig(4, 4, optimizer=adam, name="d", initializer=init.Constant(0.25)),
        "e": ee.TableConfig(5, 3, optimizer=opt.SGD(0.5), name="e", initializer=init.RowId()),
    }
    return {
        "fa": ee.FeatureConfig(tables["a"]),
        "fb": ee.FeatureConfig(tables["b"]),
        "fc": ee.FeatureConfig(tables["c"]),
        "fd": ee.FeatureConfig(tables["d"]),
        "fd2": ee.FeatureConfig(tables["d"]),
        "fe": ee.FeatureConfig(tables["e"], max_sequence_length=2),
    }


def _batch(step: int) -> dict:
    return {
        "fa": [[0, 6, 6], [step % 7]],
        "fb": [[1, 4], [2]],
        "fc": [[5], [0, 1, 5]],
        "fd": [[3], [step % 4]],
        "fd2": [[0, 0], [1]],
        "fe": [[4, 2], [step % 5]],
    }


def _train(engine: ee.EmbeddingEngine, steps: int) -> None:
    for _ in range(steps):
        acts = engine.lookup(_batch(engine.step))
        engine.apply_gradients(
            {
                k: np.linspace(-1, 1, a.size, dtype=np.float32).reshape(a.shape) * (engine.step + 1)
                for k, a in acts.items()
            }
        )


def _assert_state(engine: ee.EmbeddingEngine, expected: dict) -> None:
    """Every table and slot equals the old code's, bit for bit."""
    state = engine.state_dict()["tables"]
    assert sorted(state) == sorted(expected)
    for table, entries in expected.items():
        assert sorted(state[table]) == sorted(entries), table
        for key, values in entries.items():
            got = state[table][key]
            want = np.array(values, dtype=got.dtype)
            assert got.shape == want.shape, (table, key)
            assert got.tobytes() == want.tobytes(), f"{table}/{key} differs from the old code's"


def test_the_fixture_is_in_the_old_format():
    manifest = json.loads((CKPT / "manifest.json").read_text())
    assert "finite" not in manifest  # written before checkpoints recorded finiteness
    assert not any("finite" in t for t in manifest["tables"])
    assert [t["name"] for t in manifest["tables"]] == ["a", "b", "c", "d", "e"]
    assert EXPECTED["made_by"] == "c523859" and EXPECTED["saved_step"] == 3


@pytest.mark.parametrize("where", ["root", "checkpoint"])
def test_load_of_an_old_checkpoint_trains_on_to_the_old_result(where):
    path = FIXTURE / "checkpoints" if where == "root" else CKPT
    engine = ee.EmbeddingEngine.load(path)
    assert engine.backend == "reference" and engine.seed == 3 and engine.step == 3
    _assert_state(engine, EXPECTED["saved"])
    _train(engine, 2)
    assert engine.step == EXPECTED["step"] == 5
    _assert_state(engine, EXPECTED["after_two_more_steps"])


def test_restore_of_an_old_checkpoint_into_an_engine_of_the_same_configs():
    engine = ee.EmbeddingEngine(_features(), seed=3, backend="reference")
    _train(engine, 1)
    info = engine.restore(FIXTURE / "checkpoints")
    assert info.path == CKPT and info.step == 3 and engine.step == 3
    assert info.extra_metadata == {"epoch": 1}
    np.testing.assert_array_equal(info.extra_tensors["dense"], np.arange(6, dtype=np.float32))
    _assert_state(engine, EXPECTED["saved"])
    _train(engine, 2)
    _assert_state(engine, EXPECTED["after_two_more_steps"])


def test_read_checkpoint_gives_the_spec_of_the_engine_that_wrote_it():
    spec, reader = ckpt_mod.read_checkpoint(FIXTURE / "checkpoints")
    assert reader.step == 3 and reader.table_names == ("a", "b", "c", "d", "e")
    built = ee.EmbeddingEngine.from_spec(spec)
    fresh = ee.EmbeddingEngine(_features(), seed=3, backend="reference")
    assert built.spec() == fresh.spec()
    # Old checkpoints predate the storage plan in the spec; the rest is the same.
    assert "storage_plan" not in spec
    assert {k: v for k, v in built.spec().items() if k != "storage_plan"} == spec


def test_the_new_code_writes_the_old_layout(tmp_path):
    """Keyed by logical table and row: one file per table, tensors "{table}" and
    "{table}/{slot}" of ``[vocabulary_size, width]``, whether the engine packs the table or not."""
    engine = ee.EmbeddingEngine.load(CKPT)
    new = engine.save(tmp_path)
    old_m = json.loads((CKPT / "manifest.json").read_text())
    new_m = json.loads((new / "manifest.json").read_text())
    assert set(old_m) <= set(new_m) and set(new_m) - set(old_m) == {"finite", "storage_plan"}
    for old_t, new_t in zip(old_m["tables"], new_m["tables"], strict=True):
        assert {k: v for k, v in new_t.items() if k != "finite"} == old_t
        tensors = [
            {
                k: (v["dtype"], v["shape"])
                for k, v in read_header(f)[0].items()
                if k != "__metadata__"
            }
            for f in (CKPT / old_t["file"], new / new_t["file"])
        ]
        assert tensors[0] == tensors[1], old_t["name"]
    for key in ("features", "learning_rate_tags", "seed", "backend", "nonfinite_gradients"):
        assert new_m[key] == old_m[key], key


def test_an_old_checkpoint_exports_and_inspects(tmp_path):
    export(FIXTURE / "checkpoints", tmp_path / "served")
    served = ServingEngine.load(tmp_path / "served")
    engine = ee.EmbeddingEngine.load(CKPT)
    feats = _batch(3)
    want = engine.lookup(feats, training=False)
    got = served.lookup(feats)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6)  # numba's pooling
    assert "step 3" in describe(CKPT)


# A keyed checkpoint written before data-time expiry (stop 16's tree, 6ec1dd3): its manifest
# has no ``keyed.times`` and its files no ``last_time`` / ``data_time``. Made with
#     git archive 6ec1dd3 | tar -x -C /tmp/old16
#     cd /tmp/old16 && PYTHONPATH=. python $FIXTURE/make_fixture.py $FIXTURE
# (FIXTURE: that folder; the script is kept in it), which builds a keyed table beside a dense
# one (reference backend), trains the first three ``_keyed_batches``, saves, trains the last
# two and records ``table_contents`` of both tables at both points in ``expected.json``.
KEYED_FIXTURE = Path(__file__).parent / "fixtures" / "keyed_checkpoint_6ec1dd3"


def _keyed_batches():
    rng = np.random.default_rng(5)
    for _ in range(5):
        keys = rng.choice(
            np.array([3, 10**12 + 7, -(2**40), 2**62 + 1, 17, 99, 5], np.int64), size=(4, 3)
        )
        yield {"fk": keys, "fd": rng.integers(0, 6, size=(4, 2))}


def _keyed_contents(engine):
    return {
        name: {k: np.asarray(v).tolist() for k, v in engine.table_contents(name).items()}
        for name in ("k", "d")
    }


def test_a_keyed_checkpoint_written_before_data_time_loads_and_trains_on(tmp_path):
    from embengine import checkpoint
    from embengine.storage import keyed

    assert checkpoint.NO_TIME == keyed.NO_TIME
    expected = json.loads((KEYED_FIXTURE / "expected.json").read_text())
    engine = ee.EmbeddingEngine.load(KEYED_FIXTURE / "ckpt", backend="reference")
    assert engine.step == 3
    assert _keyed_contents(engine) == expected["at_save"]
    assert engine.table_stats()["k"]["data_time"] is None  # it never saw a timestamp
    export(KEYED_FIXTURE / "ckpt", tmp_path / "served")
    served = ServingEngine.load(tmp_path / "served")
    batch = next(_keyed_batches())
    np.testing.assert_allclose(
        served.lookup(batch)["fk"], engine.lookup(batch, training=False)["fk"], rtol=1e-6
    )
    for batch in list(_keyed_batches())[3:]:
        acts = engine.lookup(batch)
        engine.apply_gradients({k: np.full_like(v, 0.25) for k, v in acts.items()})
    assert _keyed_contents(engine) == expected["after"]


def test_a_keyed_checkpoint_declaring_times_must_hold_them(tmp_path):
    """``keyed.times`` is what tells an old checkpoint from a damaged one: a manifest that
    declares the entries and a file without them is refused (checksums recomputed)."""
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(next((KEYED_FIXTURE / "ckpt").iterdir()), ckpt)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for t in manifest["tables"]:
        if t["vocabulary_size"] is None:
            t["keyed"]["times"] = True
    raw = json.dumps(manifest).encode()
    (ckpt / "manifest.json").write_bytes(raw)
    (ckpt / "manifest.sha256").write_text(hashlib.sha256(raw).hexdigest())
    with pytest.raises(ckpt_mod.CheckpointError, match="no tensor 'k/last_time'"):
        ee.EmbeddingEngine.load(ckpt, backend="reference")


def test_keyed_times_in_a_manifest_must_be_true(tmp_path):
    """``keyed.times`` is true or absent; anything else is a schema error naming the field."""
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(next((KEYED_FIXTURE / "ckpt").iterdir()), ckpt)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for t in manifest["tables"]:
        if t["vocabulary_size"] is None:
            t["keyed"]["times"] = "yes"
    raw = json.dumps(manifest).encode()
    (ckpt / "manifest.json").write_bytes(raw)
    (ckpt / "manifest.sha256").write_text(hashlib.sha256(raw).hexdigest())
    with pytest.raises(ckpt_mod.CheckpointError, match="keyed.times"):
        ee.EmbeddingEngine.load(ckpt, backend="reference")
