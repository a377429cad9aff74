"""The storage plan as data: packing groups and row offsets, memory-mapped tables never packed
with RAM ones, JSON round trip, and errors naming bad storage values."""

import json

import numpy as np
import pytest

import embengine as ee
from embengine import optimizers as opt
from embengine.config import resolve_features
from embengine.storage import PhysicalTableSpec, StoragePlan, TableInStack, plan_storage


def _packable(n_tables=2, dim=2, **kw):
    o = opt.SGD(0.1, low_dimensional_packing_status=True)
    tables = [
        ee.TableConfig(
            10 + i, dim, name="ab"[i], optimizer=o, initializer=ee.initializers.Zeros(), **kw
        )
        for i in range(n_tables)
    ]
    return {f"f{t.name}": ee.FeatureConfig(t) for t in tables}


def _plan(feats, storage="ram", storage_dir=None, optimizer=None):
    r = resolve_features(feats)
    opts = [t.optimizer or optimizer for t in r.tables]
    return plan_storage(r, opts, storage, storage_dir)


def _kinds(plan):
    return [(p.name, p.storage) for p in plan.physical_tables]


def test_a_memory_mapped_table_is_never_packed_with_a_ram_table(tmp_path):
    # The defect: storage={"a": "mmap"} packed the RAM table b into a's file ('a+b', 'mmap').
    eng = ee.EmbeddingEngine(
        _packable(), storage={"a": "mmap"}, storage_dir=tmp_path, backend="reference"
    )
    row_bytes = 2 * 4  # SGD: weights only
    assert (tmp_path / "a.f32").stat().st_size == 10 * row_bytes  # a alone, not a + b
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.f32"]
    assert _kinds(eng.storage_plan) == [("a", "mmap"), ("b", "ram")]
    assert eng.storage_plan.physical_tables[0].path == str(tmp_path / "a.f32")
    # The RAM table lives in RAM: writing it leaves the file alone.
    before = (tmp_path / "a.f32").read_bytes()
    eng.embedding_tables["b"][:] = 7.0
    assert (tmp_path / "a.f32").read_bytes() == before
    # And the other way round: a RAM table first, then a memory-mapped one.
    assert _kinds(_plan(_packable(), {"b": "mmap"}, tmp_path)) == [("a", "ram"), ("b", "mmap")]


def test_memory_mapped_tables_are_not_packed_with_each_other(tmp_path):
    plan = _plan(_packable(), "mmap", tmp_path / "store")
    assert _kinds(plan) == [("a", "mmap"), ("b", "mmap")]
    assert [p.path for p in plan.physical_tables] == [
        str(tmp_path / "store" / "a.f32"),
        str(tmp_path / "store" / "b.f32"),
    ]
    assert not (tmp_path / "store").exists()  # planning touches no file


def test_packing_groups_offsets_and_features():
    sgd = opt.SGD(0.1, low_dimensional_packing_status=True)
    other = opt.SGD(0.2, low_dimensional_packing_status=True)
    plain = opt.SGD(0.1)  # no packing status
    q = ee.QuantizationConfig(num_buckets=4, lower=-1.0, upper=1.0)
    specs = [
        ("t0", 5, 1, sgd, None),
        ("t1", 6, 2, sgd, None),
        ("t2", 7, 1, sgd, None),
        ("t3", 8, 8, sgd, None),
        ("t4", 9, 2, other, None),
        ("t5", 3, 1, sgd, q),
        ("t6", 4, 1, plain, None),
        ("t7", 2, 1, sgd, None),
        ("t8", 6, 1, sgd, q),
    ]
    tables = {
        n: ee.TableConfig(v, d, name=n, optimizer=o, quantization_config=qc)
        for n, v, d, o, qc in specs
    }
    feats = {f"f{n}": ee.FeatureConfig(t) for n, t in tables.items()}
    feats["seq0"] = ee.FeatureConfig(tables["t0"], max_sequence_length=2)
    plan = _plan(feats)
    assert [p.name for p in plan.physical_tables] == ["t0+t2+t7", "t1", "t3", "t4", "t5+t8", "t6"]
    first = plan.physical_tables[0]
    assert first.dim == 1 and first.storage == "ram" and first.path is None
    assert first.vocabulary_size == 5 + 7 + 2
    assert first.tables == (
        TableInStack("t0", 0, 5, ("ft0", "seq0")),
        TableInStack("t2", 5, 7, ("ft2",)),
        TableInStack("t7", 12, 2, ("ft7",)),
    )
    assert plan.locate("t7") == (0, TableInStack("t7", 12, 2, ("ft7",)))
    assert plan.locate("t8") == (4, TableInStack("t8", 3, 6, ("ft8",)))
    assert plan.storage_layout()[0] == [("ft0", 0), ("seq0", 0), ("ft2", 5), ("ft7", 12)]
    assert plan == _plan(feats)  # deterministic
    # The engine builds its tables from the plan.
    eng = ee.EmbeddingEngine(feats, backend="reference")
    assert eng.storage_plan == plan
    assert eng.storage_bytes == 4 * sum(p.vocabulary_size * p.dim for p in plan.physical_tables)


def test_plan_round_trips_through_json(tmp_path):
    feats = _packable(2)
    feats["fc"] = ee.FeatureConfig(ee.TableConfig(4, 8, name="c", optimizer=opt.Adagrad(0.1)))
    plan = _plan(feats, {"c": "mmap"}, tmp_path)
    data = json.loads(json.dumps(plan.to_json()))
    assert StoragePlan.from_json(data) == plan
    assert data["physical_tables"][0]["tables"][1] == {
        "name": "b",
        "row_offset": 10,
        "vocabulary_size": 11,
        "features": ["fb"],
    }
    assert data["physical_tables"][1]["path"] == str(tmp_path / "c.f32")


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda d: d.pop("physical_tables"), r"missing keys \['physical_tables'\]"),
        (lambda d: d.update(format_version=9), "format_version 9"),
        (
            lambda d: d["physical_tables"][0].update(storage="disk"),
            r"physical_tables\[0\]\['storage'\] must be one of",
        ),
        (lambda d: d["physical_tables"][0].update(dim=0), r"physical_tables\[0\]\['dim'\]"),
        (
            lambda d: d["physical_tables"][0]["tables"][1].update(row_offset=3),
            r"physical_tables\[0\] \('a\+b'\): tables\[1\] \('b'\) starts at row 3; it must start "
            "at row 10",
        ),
        (
            lambda d: d["physical_tables"][0]["tables"][0].update(vocabulary_size="10"),
            r"\['tables'\]\[0\]\['vocabulary_size'\] must be an int >= 1, got '10'",
        ),
        (
            lambda d: d["physical_tables"][0].update(storage="mmap", path="/x/a.f32"),
            "holds one logical table",
        ),
        (lambda d: d["physical_tables"][0].update(path="/x/a.f32"), "a 'ram' table has none"),
        (lambda d: d["physical_tables"][0].update(name="a"), "joined by '\\+'"),
        (
            lambda d: d["physical_tables"][0]["tables"][1].update(features=["fa"]),
            "feature 'fa' of table 'b' also looks up table 'a'",
        ),
        (lambda d: d["physical_tables"][0]["tables"][0].update(extra=1), "unknown keys"),
    ],
)
def test_from_json_names_what_is_wrong(edit, words):
    data = _plan(_packable()).to_json()
    edit(data)
    with pytest.raises(ValueError, match=words):
        StoragePlan.from_json(data)


def test_a_plan_is_checked_when_built():
    a = TableInStack("a", 0, 10, ("fa",))
    with pytest.raises(ValueError, match="table 'a' is also in physical_tables"):
        StoragePlan(
            (
                PhysicalTableSpec("a", 2, "ram", None, (a,)),
                PhysicalTableSpec("a", 2, "ram", None, (a,)),
            )
        )
    with pytest.raises(ValueError, match="holds no table"):
        StoragePlan((PhysicalTableSpec("", 2, "ram", None, ()),))


@pytest.mark.parametrize(
    "storage, storage_dir, error, words",
    [
        ("disk", None, ValueError, "storage must be one of .* got 'disk'"),
        ({"a": "disk"}, "d", ValueError, "storage of table 'a' must be one of .* got 'disk'"),
        ({"a": None}, "d", ValueError, "storage of table 'a' .* got None"),
        ({"zzz": "mmap"}, "d", ValueError, r"storage names unknown tables \['zzz'\]"),
        (3, None, TypeError, "storage must be 'ram', 'mmap' or a dict, got 3"),
        ("mmap", None, ValueError, "needs storage_dir"),
        ("mmap", 5, TypeError, "storage_dir must be a path .* got 5"),
    ],
)
def test_errors_name_the_bad_storage_value(storage, storage_dir, error, words):
    with pytest.raises(error, match=words):
        _plan(_packable(), storage, storage_dir)
    with pytest.raises(error, match=words):
        ee.EmbeddingEngine(
            _packable(), storage=storage, storage_dir=storage_dir, backend="reference"
        )


@pytest.mark.parametrize("name", ["../escape", "/abs/t"])
def test_a_memory_mapped_table_file_stays_inside_storage_dir(tmp_path, name):
    feats = {"f": ee.FeatureConfig(ee.TableConfig(4, 2, name=name))}
    with pytest.raises(ValueError, match=f"table {name!r} is memory-mapped.*outside storage_dir"):
        _plan(feats, "mmap", tmp_path / "d", optimizer=opt.SGD(0.1))
    assert (
        _plan(feats, "ram", tmp_path / "d", optimizer=opt.SGD(0.1)).physical_tables[0].path is None
    )


def test_packed_engine_results_match_the_plan():
    # Looking a packed table up reads its own rows: ids are shifted by its row offset.
    feats = _packable(2)
    eng = ee.EmbeddingEngine(feats, backend="reference")
    (spec,) = eng.storage_plan.physical_tables
    assert spec.name == "a+b" and [t.row_offset for t in spec.tables] == [0, 10]
    eng.embedding_tables["a"][:] = np.arange(10, dtype=np.float32)[:, None]
    eng.embedding_tables["b"][:] = -np.arange(11, dtype=np.float32)[:, None]
    acts = eng.lookup({"fa": [3], "fb": [3]}, training=False)
    np.testing.assert_array_equal(acts["fa"], [[3, 3]])
    np.testing.assert_array_equal(acts["fb"], [[-3, -3]])


def test_table_files_give_each_table_its_own_file_by_plan_storages_rules(tmp_path):
    # A ShardedEngine's shards: no packing, a suffix per rank, the same errors as plan_storage.
    from embengine.storage.plan import table_files
    from embengine.storage.registry import register_storage_kind

    keyed = ee.TableConfig(None, 4, name="k", dynamic=ee.DynamicVocabulary())
    feats = {
        "a": ee.FeatureConfig(ee.TableConfig(10, 2, name="a")),
        "b": ee.FeatureConfig(ee.TableConfig(10, 2, name="b")),
        "k": ee.FeatureConfig(keyed),
    }
    r = resolve_features(feats)
    got = table_files(r, {"a": "mmap", "k": "mmap"}, tmp_path, suffix=".rank1")
    assert got == {
        "a": ("mmap", str(tmp_path / "a.rank1.f32")),
        "b": ("ram", None),
        "k": ("keyed-mmap", str(tmp_path / "k.rank1.f32")),
    }
    assert table_files(r, "ram", None) == {
        "a": ("ram", None),
        "b": ("ram", None),
        "k": ("keyed", None),
    }
    with pytest.raises(ValueError, match="storage='mmap' needs storage_dir="):
        table_files(r, "mmap", None)
    with pytest.raises(ValueError, match="storage must be one of"):
        table_files(r, "disk", tmp_path)
    with pytest.raises(TypeError, match="storage_dir must be a path"):
        table_files(r, "mmap", 3)
    register_storage_kind("plan-test-kind", ee.storage.DenseTable)
    with pytest.raises(ValueError, match="table 'a': storage 'plan-test-kind' is a registered"):
        table_files(r, {"a": "plan-test-kind"}, tmp_path)
