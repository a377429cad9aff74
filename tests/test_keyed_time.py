"""Keyed tables in data time (issue 15, item 8): ``DynamicVocabulary(expire_seconds=D)`` and
``lookup(..., timestamp=t)``; Monolith's ``expire_time`` (days) through
``embengine.monolith.dynamic_vocabulary``. Scripted streams with exact expected outcomes: rows
expire when data time passes (never wall time), timestamps going backwards move nothing back,
and a checkpoint keeps every row's data time."""

import json

import numpy as np
import pytest
from conftest import keyed_engine, keyed_keys, train_bags

import embengine as ee
from embengine import monolith
from embengine import optimizers as opt
from embengine.initializers import RowId
from embengine.storage.keyed import NO_TIME

A, B, C, D = 11, 22, 33, 44


def _times(eng):
    s = eng.state_dict()["tables"]["k"]
    return dict(zip(s["keys"].tolist(), s["last_time"].tolist(), strict=True))


def test_rows_expire_when_data_time_passes_not_steps_or_wall_time(backend):
    eng = keyed_engine(backend, expire_seconds=100)
    train_bags(eng, [[A, B]], timestamp=1000)
    for _ in range(30):  # many steps (and wall time) at one data time: nothing expires
        train_bags(eng, [[B]], timestamp=1000)
    assert keyed_keys(eng) == [A, B]
    train_bags(eng, [[B]], timestamp=1100)  # exactly 100 s behind: A stays (more than D expires)
    assert keyed_keys(eng) == [A, B] and eng.table_stats()["k"]["data_time"] == 1100
    # An evaluation lookup sees the table at its data time: A is still there.
    np.testing.assert_array_equal(eng.lookup({"f": [[A]]}, training=False)["f"], [[A - 1] * 2])
    train_bags(eng, [[B]], timestamp=1101)  # 101 s: A is removed before this lookup
    assert keyed_keys(eng) == [B]
    s = eng.table_stats()["k"]
    assert s["this_step"]["expired"] == 1 and s["total"]["expired"] == 1
    assert not eng.lookup({"f": [[A]]}, training=False)["f"].any()
    # A again: a new row, its initial values.
    np.testing.assert_array_equal(train_bags(eng, [[A]], timestamp=1102), [[A, A]])
    assert _times(eng) == {A: 1102, B: 1101}


def test_timestamps_going_backwards_move_nothing_back(backend):
    eng = keyed_engine(backend, expire_seconds=100)
    train_bags(eng, [[A, B]], timestamp=1000)
    train_bags(eng, [[B]], timestamp=1080)
    train_bags(eng, [[A], [C]], timestamp=900)  # an older batch: late data
    s = eng.table_stats()["k"]
    assert s["data_time"] == 1080  # the table's data time stays at the newest it has seen
    # A keeps 1000 (the newest time that touched it); C, new, has its batch's time.
    assert _times(eng) == {A: 1000, B: 1080, C: 900}
    # The late call saw the table at 1080: C (180 s behind) goes before the next lookup,
    # an old batch's timestamp does not bring A closer to expiry (Monolith would set A to 900
    # and expire it here).
    train_bags(eng, [[B]], timestamp=1095)
    assert keyed_keys(eng) == [A, B]
    train_bags(eng, [[B]], timestamp=1101)
    assert keyed_keys(eng) == [B]


def test_the_update_takes_its_steps_time_and_a_missing_one_is_an_error(backend):
    eng = keyed_engine(backend, expire_seconds=50, insert_on="apply")
    acts = eng.lookup({"f": [[A]]}, timestamp=500)["f"]
    assert not acts.any()  # insert on apply: zeros before the update
    eng.apply_gradients({"f": np.ones_like(acts)})  # no timestamp: the step's lookup's
    assert _times(eng) == {A: 500}
    # A later step's update may bring its own (the same rule: max with the step's).
    acts = eng.lookup({"f": [[B]]}, timestamp=510)["f"]
    eng.apply_gradients({"f": np.ones_like(acts)}, timestamp=520)
    assert _times(eng) == {A: 500, B: 520}
    before, stats, step = eng.table_contents("k"), eng.table_stats(), eng.step
    # A training call of a step without a timestamp: an error naming the table, no change.
    with pytest.raises(
        ValueError,
        match="table 'k' expires rows by data time .*expire_seconds=50.*timestamp=seconds",
    ):
        eng.lookup({"f": [[C]]})
    batch = eng.preprocess({"f": [[C]]})
    with pytest.raises(ValueError, match="table 'k' expires rows by data time"):
        eng.apply_gradients({"f": np.ones((1, 2), np.float32)}, batch=batch)
    after = eng.table_contents("k")
    assert all(after[k].tobytes() == before[k].tobytes() for k in before)
    assert eng.table_stats() == stats and eng.step == step
    # Bad timestamps, and a timestamp on an evaluation lookup.
    for bad, error, match in [
        (1.5, TypeError, "timestamp must be an int .* got 1.5"),
        (True, TypeError, "got True"),
        (-1, ValueError, "timestamp must be in \\[0, 2\\^62\\) .* got -1"),
        (2**62, ValueError, "got 4611686018427387904"),
    ]:
        with pytest.raises(error, match=match):
            eng.lookup({"f": [[C]]}, timestamp=bad)
        with pytest.raises(error, match=match):
            eng.apply_gradients({"f": np.ones((1, 2), np.float32)}, batch=batch, timestamp=bad)
    with pytest.raises(ValueError, match="evaluation lookup .* sees each table at its data"):
        eng.lookup({"f": [[C]]}, training=False, timestamp=600)
    assert eng.table_stats() == stats
    eng.apply_gradients({"f": np.ones((1, 2), np.float32)}, batch=batch, timestamp=530)
    assert _times(eng) == {A: 500, B: 520, C: 530}


def test_steps_and_data_time_together_and_tables_without_time(backend):
    both = keyed_engine(backend, expire_seconds=1000, expire_steps=2)
    train_bags(both, [[A, B]], timestamp=10)
    train_bags(both, [[B]], timestamp=20)
    train_bags(both, [[B]], timestamp=30)
    train_bags(both, [[B]], timestamp=40)  # step 3: A last touched at step 0 (3 > 2 steps)
    assert keyed_keys(both) == [B]
    train_bags(both, [[A, B]], timestamp=50)
    train_bags(both, [[B]], timestamp=1051)  # A: 1001 s behind
    assert keyed_keys(both) == [B]
    # A table without expire_seconds takes timestamps (its data time shows in the stats)
    # and needs none; a dense table ignores them.
    plain = keyed_engine(backend, expire_steps=5)
    train_bags(plain, [[A]])
    train_bags(plain, [[A]], timestamp=77)
    assert plain.table_stats()["k"]["data_time"] == 77
    assert plain.state_dict()["tables"]["k"]["last_time"].tolist() == [NO_TIME]
    dense = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(ee.TableConfig(5, 2))}, optimizer=opt.SGD(0.1), backend=backend
    )
    acts = dense.lookup({"f": [[1]]}, timestamp=5)["f"]
    dense.apply_gradients({"f": acts}, timestamp=6)
    assert dense.step == 1


def _stream(eng, steps, start=0):
    """Timestamps that mostly advance and sometimes go back; keys from a small pool."""
    rng = np.random.default_rng(7)
    out = []
    for s in range(steps):
        keys = rng.integers(0, 30, size=(4, 3))
        t = 1000 + 10 * s - (25 if s % 4 == 3 else 0)
        if s >= start:
            out.append(train_bags(eng, keys.tolist(), timestamp=t, grad=0.1))
    return out


def test_a_checkpoint_keeps_the_data_times_and_continues_bit_identically(tmp_path, backend):
    rules = dict(expire_seconds=35, occurrence_threshold=1, max_rows=25)
    whole = keyed_engine(backend, **rules)
    want = _stream(whole, 9)[5:]
    half = keyed_engine(backend, **rules)
    _stream(half, 5)
    path = half.save(tmp_path / "ckpt")
    state = half.state_dict()["tables"]["k"]
    assert state["data_time"].tolist() == [1040] and (state["last_time"] > 0).all()
    loaded = ee.EmbeddingEngine.load(path, backend=backend)
    assert _times(loaded) == _times(half)
    assert loaded.table_stats()["k"]["data_time"] == 1040
    # Steps 5..8 on the loaded engine, against the uninterrupted one.
    got = _stream(loaded, 9, start=5)
    assert [a.tobytes() for a in got] == [a.tobytes() for a in want]
    arena = ("capacity", "load_factor", "bytes")  # a restore compacts the arena
    stats = [
        {k: v for k, v in e.table_stats()["k"].items() if k not in arena} for e in (loaded, whole)
    ]
    assert stats[0] == stats[1]
    got, want = loaded.state_dict()["tables"]["k"], whole.state_dict()["tables"]["k"]
    for k in want:
        assert np.asarray(got[k]).tobytes() == np.asarray(want[k]).tobytes(), k
    assert whole.table_stats()["k"]["total"]["expired"] > 0


def test_a_state_with_bad_data_times_is_refused_and_changes_nothing():
    eng = keyed_engine("reference", expire_seconds=10)
    train_bags(eng, [[A, B]], timestamp=100)
    before = eng.state_dict()
    for entry, value, match in [
        (
            "last_time",
            np.array([100, 101]),
            "\\['last_time'\\]\\[1\\] is 101; it must be in \\[0, 100\\]",
        ),
        ("last_time", np.array([-5, 100]), "\\['last_time'\\]\\[0\\] is -5"),
        ("data_time", np.array([-3]), "\\['data_time'\\]\\[0\\] is -3"),
    ]:
        state = {**before, "tables": {"k": {**before["tables"]["k"], entry: value}}}
        with pytest.raises(ValueError, match=match):
            eng.load_state_dict(state)
        assert _times(eng) == {A: 100, B: 100}
        assert eng.table_stats()["k"]["data_time"] == 100


def test_expire_seconds_is_validated_and_round_trips_through_the_spec():
    with pytest.raises(ValueError, match="expire_seconds must be None .* got 0"):
        ee.DynamicVocabulary(expire_seconds=0)
    with pytest.raises(ValueError, match="expire_seconds must be None .* got 2.5"):
        ee.DynamicVocabulary(expire_seconds=2.5)
    eng = keyed_engine("reference", expire_seconds=3600, expire_steps=9)
    spec = json.loads(json.dumps(eng.spec()))
    again = ee.EmbeddingEngine.from_spec(spec)
    assert again.table_configs["k"].dynamic == eng.table_configs["k"].dynamic
    assert again.table_configs["k"].dynamic.expire_seconds == 3600


def test_monolith_slot_rules_map_to_a_dynamic_vocabulary():
    d = monolith.dynamic_vocabulary(occurrence_threshold=3, expire_time=2)
    assert d == ee.DynamicVocabulary(
        occurrence_threshold=3, expire_seconds=2 * 86400, insert_on="apply"
    )
    assert monolith.dynamic_vocabulary(expire_time=monolith.DEFAULT_EXPIRE_TIME).expire_seconds == (
        monolith.DEFAULT_EXPIRE_TIME * 86400
    )
    # Monolith's default (100 years) is never: no rule, so no timestamps needed.
    never = monolith.dynamic_vocabulary(occurrence_threshold=2)
    assert (never.expire_seconds, never.expire_steps) == (None, None)
    # Without timestamps, steps count.
    d = monolith.dynamic_vocabulary(expire_time=3, steps_per_day=100, max_rows=50)
    assert (d.expire_steps, d.expire_seconds, d.max_rows) == (300, None, 50)
    for kwargs, match in [
        (dict(occurrence_threshold=-1), "occurrence_threshold must be an int >= 0, got -1"),
        (dict(expire_time=0), "expire_time must be an int >= 1, got 0"),
        (dict(expire_time=1.5), "expire_time must be an int >= 1, got 1.5"),
        (dict(steps_per_day=0), "steps_per_day must be an int >= 1, got 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            monolith.dynamic_vocabulary(**kwargs)


def test_a_monolith_slot_of_the_default_expire_time_trains_without_timestamps(backend):
    # Monolith's default expire_time is 100 years: the port used to turn it into
    # expire_seconds, so every training lookup without timestamp= raised "expires rows by data
    # time". Admission alone needs no time.
    rules = monolith.dynamic_vocabulary(occurrence_threshold=1)
    t = ee.TableConfig(None, 2, name="k", combiner="sum", initializer=RowId(0), dynamic=rules)
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t)}, optimizer=monolith.SgdOptimizer(1.0), backend=backend
    )
    assert not train_bags(eng, [[A]]).any()  # seen once: filtered
    assert not train_bags(eng, [[A]]).any()  # admitted: zeros until its first update
    np.testing.assert_array_equal(train_bags(eng, [[A]]), [[A - 1, A - 1]])
    assert keyed_keys(eng) == [A]


def test_a_monolith_slot_expires_after_its_days_of_data_time(backend):
    day = 86400
    rules = monolith.dynamic_vocabulary(occurrence_threshold=1, expire_time=2)
    t = ee.TableConfig(None, 2, name="k", combiner="sum", initializer=RowId(0), dynamic=rules)
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t)}, optimizer=monolith.SgdOptimizer(1.0), backend=backend
    )
    t0 = 1_700_000_000
    assert not train_bags(eng, [[A]], timestamp=t0).any()  # seen once: filtered
    assert not train_bags(eng, [[A], [B]], timestamp=t0 + 10).any()  # admitted: zeros, then its row
    assert keyed_keys(eng) == [A]
    np.testing.assert_array_equal(train_bags(eng, [[A]], timestamp=t0 + day), [[A - 1, A - 1]])
    train_bags(eng, [[B]], timestamp=t0 + 3 * day)  # A: exactly 2 days since t0 + day, so it stays
    assert keyed_keys(eng) == [A, B]
    train_bags(eng, [[B]], timestamp=t0 + 3 * day + 1)
    assert keyed_keys(eng) == [B]


def test_an_export_leaves_out_rows_stale_at_the_tables_data_time(tmp_path):
    from embengine.serving import ServingEngine, export

    eng = keyed_engine("numba", expire_seconds=100)
    train_bags(eng, [[A]], timestamp=1000)
    train_bags(eng, [[B]], timestamp=1200)  # A (200 s behind) went before this lookup
    train_bags(eng, [[C]], timestamp=1050)  # late data: C's row is 150 s behind the table's 1200
    assert keyed_keys(eng) == [B, C]  # still held: removed before the next training lookup
    probe = {"f": [[B], [C], [A]]}
    want = eng.lookup(probe, training=False)["f"]
    assert want[0].any() and not want[1:].any()  # evaluation already sees C as gone
    out = tmp_path / "export"
    export(eng.save(tmp_path / "ckpt"), out)
    served = ServingEngine.load(out)
    assert served._tables["k"][0]["keys"].tolist() == [B]
    assert served.lookup(probe)["f"].tobytes() == want.tobytes()


def test_an_embedding_layer_carries_the_timestamp_to_its_update():
    torch = pytest.importorskip("torch")
    from embengine.torch import EmbeddingLayer

    layer = EmbeddingLayer(keyed_engine("numba", expire_seconds=100, insert_on="apply"))
    for t, bags in ((1000, [[A]]), (1050, [[B]]), (1101, [[B]])):
        layer({"f": bags}, timestamp=t)["f"].sum().backward()
    # The update (insert on apply) stamped A and B with their forward's time; A expired at 1101.
    assert keyed_keys(layer.engine) == [B] and _times(layer.engine) == {B: 1101}
    layer.eval()
    assert layer({"f": [[B]]}, timestamp=5)["f"].tolist() == [[B - 2.0, B - 2.0]]
    layer.train()
    with pytest.raises(ValueError, match="table 'k' expires rows by data time"):
        layer({"f": [[C]]})
    assert torch.is_grad_enabled()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(expire_time=10**20), r"expire_time must be at most 4294967295 days"),
        (
            dict(expire_time=2**32 - 1, steps_per_day=2**32),
            r"expire_time \* steps_per_day = .* steps, more than expire_steps allows",
        ),
        (  # fits int64, but past the int32 last-touched steps' reach
            dict(expire_time=4000, steps_per_day=10**6),
            r"= 4000000000 steps, more than expire_steps allows \(at most 3221225471",
        ),
    ],
)
def test_monolith_expire_time_past_int64_is_refused_when_made(kwargs, match):
    """Monolith's expire_time is a uint32 number of days. A larger one was accepted, became
    expire_seconds / expire_steps past int64, and the first lookup of the table failed inside
    numba ("non-precise type pyobject", naming no argument). The largest uint32 still trains."""
    with pytest.raises(ValueError, match=match):
        monolith.dynamic_vocabulary(**kwargs)
    rules = monolith.dynamic_vocabulary(expire_time=2**32 - 1)
    t = ee.TableConfig(None, 1, name="k", combiner="sum", initializer=RowId(0), dynamic=rules)
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=monolith.SgdOptimizer(1.0))
    train_bags(eng, [[A]], timestamp=1_700_000_000)
    assert keyed_keys(eng) == [A]
