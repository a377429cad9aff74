"""Serving: export with every compression, lookups within the stated bounds, per-table overrides,
report sizes, tamper detection, thread safety, sequence features and output_shape, and the
``embengine export`` / ``embengine inspect`` commands."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import embengine as ee
from embengine import checkpoint as ckpt_mod
from embengine import optimizers as O
from embengine.checkpoint import CheckpointError
from embengine.engine import BACKENDS
from embengine.inspect import describe
from embengine.serving import (
    COMPRESSIONS,
    ExportReport,
    ServingEngine,
    error_bound,
    export,
    read_serving_manifest,
)

REPO = Path(__file__).resolve().parents[1]
EMBENGINE = Path(sys.executable).parent / "embengine"
B = 12  # samples per batch

# Per-table combiner (sum for single ids / weighted bags, mean for the bag table).
COMBINER = {"one": "sum", "bag": "mean", "wsum": "sum", "seq": "sum"}


def _features():
    one = ee.TableConfig(60, 8, name="one", combiner="sum", optimizer=O.Adagrad(learning_rate=0.5))
    bag = ee.TableConfig(50, 6, name="bag", combiner="mean", optimizer=O.Adam(learning_rate=0.05))
    wsum = ee.TableConfig(30, 4, name="wsum", combiner="sum")
    seq = ee.TableConfig(40, 4, name="seq", combiner="sum")
    return {
        "one": ee.FeatureConfig(one),  # one id per sample
        "shaped": ee.FeatureConfig(one, output_shape=(3, 4)),  # [3, 4, 8]
        "bag": ee.FeatureConfig(bag),  # mean over 0..4 ids
        "wsum": ee.FeatureConfig(wsum),  # weighted sum
        "seq": ee.FeatureConfig(seq, max_sequence_length=3),  # [B, 3, 4]
        "seq_shaped": ee.FeatureConfig(seq, max_sequence_length=2, output_shape=(B * 2,)),
    }


def _inputs(seed: int):
    """(features, weights) with single ids, bags (some empty) and sequences."""
    rng = np.random.default_rng(seed)
    bag_len = rng.integers(0, 5, size=B)
    bag_len[0] = 0
    w_len = rng.integers(1, 4, size=B)
    s_len = rng.integers(0, 5, size=B)
    s2_len = rng.integers(0, 3, size=B)
    feats = {
        "one": rng.integers(0, 60, size=B),
        "shaped": rng.integers(0, 60, size=B),
        "bag": ee.Ragged(rng.integers(0, 50, size=bag_len.sum()), lengths=bag_len),
        "wsum": ee.Ragged(rng.integers(0, 30, size=w_len.sum()), lengths=w_len),
        "seq": ee.Ragged(rng.integers(0, 40, size=s_len.sum()), lengths=s_len),
        "seq_shaped": ee.Ragged(rng.integers(0, 40, size=s2_len.sum()), lengths=s2_len),
    }
    weights = {"wsum": rng.uniform(-2, 2, size=int(w_len.sum())).astype(np.float32)}
    return feats, weights


def _train(backend: str, steps: int = 3) -> ee.EmbeddingEngine:
    eng = ee.EmbeddingEngine(
        _features(), optimizer=O.SGD(learning_rate=0.3), seed=1, backend=backend
    )
    for s in range(steps):
        feats, weights = _inputs(100 + s)
        acts = eng.lookup(feats, weights)
        rng = np.random.default_rng(s)
        eng.apply_gradients(
            {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in acts.items()}
        )
    return eng


_TRAINED: dict[str, tuple] = {}


def _trained(backend, tmp_path_factory):
    if backend not in _TRAINED:
        eng = _train(backend)
        _TRAINED[backend] = (eng, eng.save(tmp_path_factory.mktemp(f"ck-{backend}")))
    return _TRAINED[backend]


@pytest.fixture(scope="module", params=BACKENDS)
def trained(request, tmp_path_factory):
    return _trained(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def trained_ref(tmp_path_factory):
    return _trained("reference", tmp_path_factory)


def _expected_bound(eng, feats, weights, bounds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per activation value: sum over the sample's ids of |gain| * the id's per-value bound, plus
    float32 rounding slack of the pooling (both sides pool in float32 / round once)."""
    out = {}
    tables = eng.embedding_tables
    for name, fc in eng.feature_config.items():
        t = fc.table.name
        b, x = bounds[t], np.abs(tables[t].astype(np.float64))
        f = feats[name]
        if isinstance(f, ee.Ragged):
            ids, offsets = f.ids, f.offsets
        else:
            ids, offsets = np.asarray(f), np.arange(len(f) + 1)
        w = weights.get(name, np.ones(len(ids)))
        dim = fc.table.dim
        seq = fc.max_sequence_length
        if seq:
            bound = np.zeros((B, seq, dim))
            mag = np.zeros((B, seq, dim))
            for s in range(B):
                for p, k in enumerate(range(offsets[s], min(offsets[s + 1], offsets[s] + seq))):
                    bound[s, p] = b[ids[k]]
                    mag[s, p] = x[ids[k]]
        else:
            bound = np.zeros((B, dim))
            mag = np.zeros((B, dim))
            for s in range(B):
                ks = range(offsets[s], offsets[s + 1])
                if not len(ks):
                    continue
                gains = np.array([w[k] for k in ks], dtype=np.float64)
                if COMBINER[t] == "mean":
                    gains = gains / gains.sum()
                for g, k in zip(gains, ks, strict=True):
                    bound[s] += abs(g) * b[ids[k]]
                    mag[s] += abs(g) * x[ids[k]]
        shape = fc.activation_shape(B)
        out[name] = (bound + 4 * 2.0**-24 * mag * 4 + 1e-30).reshape(shape)
    return out


def _compare(served, trained_acts, bound):
    assert sorted(served) == sorted(trained_acts)
    for k in trained_acts:
        assert served[k].shape == trained_acts[k].shape, k
        assert served[k].dtype == np.float32, k
        err = np.abs(served[k].astype(np.float64) - trained_acts[k].astype(np.float64))
        bad = err > bound[k]
        assert not bad.any(), (
            f"feature {k}: |served - trained| = {err[bad].max()} exceeds the bound "
            f"{bound[k][bad][np.argmax(err[bad])]} at {np.argwhere(bad)[0].tolist()}"
        )


# -- every compression, within its bound -----------------------------------------------------------

CASES = [
    ("fp32", 1.0),
    ("fp16", 1.0),
    ("bf16", 1.0),
    ("fixed_r8", 1.0),
    ("fixed_r8", 0.25),
    ("int8_rowwise", 1.0),
]


@pytest.mark.parametrize("compression, fixed_range", CASES, ids=[f"{c}-{r}" for c, r in CASES])
def test_served_lookups_are_within_the_stated_bound(trained, tmp_path, compression, fixed_range):
    eng, path = trained
    report = export(path, tmp_path / "out", compress=compression, fixed_range=fixed_range)
    assert report.path == tmp_path / "out"
    serving = ServingEngine.load(tmp_path / "out")
    assert set(serving.table_names) == set(eng.table_names)
    params = {"fixed_range": fixed_range}
    bounds = {t: error_bound(compression, w, params) for t, w in eng.embedding_tables.items()}
    if compression == "fixed_r8" and fixed_range == 0.25:
        # Some weights lie outside [-r, r): the bound includes the clipping.
        assert any(np.abs(w).max() > 0.25 for w in eng.embedding_tables.values())
    # The report's max abs error respects the per-value bound of each table.
    for row in report.rows:
        assert row["compression"] == compression
        assert row["max_abs_error"] <= bounds[row["table"]].max()
    for seed in range(3):
        feats, weights = _inputs(seed)
        expect = eng.lookup(feats, weights)
        got = serving.lookup(feats, weights)
        _compare(got, expect, _expected_bound(eng, feats, weights, bounds))
        if compression == "fp32" and eng.backend == "numba":
            for k in expect:  # the same float32 pooling: bit for bit
                assert got[k].tobytes() == expect[k].tobytes(), k
        if compression == "fp32":
            for k in ("one", "shaped", "seq", "seq_shaped"):  # single ids: exact on any backend
                np.testing.assert_array_equal(got[k], expect[k], err_msg=k)


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_codec_round_trip_respects_error_bound(compression):
    from embengine.serving import _encode_table, decode

    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.standard_normal((50, 16)).astype(np.float32) * 0.3,
            rng.uniform(-1, 0.99, (50, 16)).astype(np.float32),
            np.zeros((2, 16), np.float32),  # constant rows
            np.full((2, 16), 0.123, np.float32),
            (rng.standard_normal((4, 16)) * 1e-6).astype(np.float32),  # tiny values
            rng.uniform(-3, 3, (4, 16)).astype(np.float32),  # outside fixed_r8's range
        ]
    )
    params = {"fixed_range": 1.0}
    arrays, worst = _encode_table(x, compression, params)
    back = decode(arrays, compression, np.arange(len(x)), params)
    assert back.dtype == np.float32 and back.shape == x.shape
    err = np.abs(back.astype(np.float64) - x)
    bound = error_bound(compression, x, params)
    assert np.all(err <= bound), f"max excess {np.max(err - bound)}"
    assert worst == pytest.approx(err.max())
    if compression == "fp32":
        assert worst == 0.0


def _round_trip_excess(compression: str, x: np.ndarray, params: dict) -> float | None:
    """The largest ``|decode(encode(x)) - x| - error_bound`` over ``x`` (> 0: the stated bound
    fails), or None if the compression refuses ``x`` (values it cannot represent)."""
    from embengine.serving import _encode_table, decode

    x = np.asarray(x, np.float32)
    try:
        arrays, worst = _encode_table(x, compression, params)
    except ValueError:  # would be Inf: refused, naming the row
        return None
    back = decode(arrays, compression, np.arange(len(x)), params).astype(np.float64)
    err = np.abs(back - x)
    assert worst == (err.max() if x.size else 0.0)
    return float((err - error_bound(compression, x, params)).max()) if x.size else 0.0


# Rows the previous bounds did not hold for, rounded in float32 as decoding is.
_ADVERSARIAL = {
    # near -1e5 float32's step is 2**-7: spread over ~6, the decoded sum rounds past
    # (max - min) / 510 (up to 1.3 times it)
    "int8_rowwise": (
        -1e5 + np.random.default_rng(1).uniform(0, 10, (2000, 16)),
        {},
    ),
    # float32 subnormals: bfloat16's step there is 2**-133, whatever |x|
    "bf16": (np.arange(1, 4001, dtype=np.uint32).view(np.float32).reshape(250, 16), {}),
    # half steps of r / 128 (not a float32: its rounding, times the code, adds to the half step)
    "fixed_r8": ((np.arange(-128, 127).reshape(-1, 5) + 0.5) * (0.1 / 128), {"fixed_range": 0.1}),
}


@pytest.mark.parametrize("compression", sorted(_ADVERSARIAL))
def test_the_stated_bound_holds_for_rows_it_used_to_miss(compression):
    """The bounds stated in embengine.serving's docstring (``error_bound``) hold for the rows
    that broke the old ones: int8_rowwise's ``(max - min) / 510`` for a row far from 0 with a
    small spread (decoding rounds to float32), bf16's ``|x| * 2**-8`` for subnormals,
    fixed_r8's ``r / 256`` with ``r / 128`` not a float32."""
    x, params = _ADVERSARIAL[compression]
    assert _round_trip_excess(compression, x, params) <= 0


_F32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@st.composite
def _rows(draw) -> np.ndarray:
    """float32 rows: any float32 values, or an offset plus a spread (large offsets, small
    spreads), subnormals included."""
    shape = (draw(st.integers(1, 4)), draw(st.integers(1, 8)))
    if draw(st.booleans()):
        return draw(hnp.arrays(np.float32, shape, elements=_F32))
    offset = np.float32(draw(_F32))
    spread = np.float32(2.0 ** draw(st.integers(-149, 20)))
    u = draw(hnp.arrays(np.float32, shape, elements=st.floats(0, 1, width=32)))
    with np.errstate(over="ignore", invalid="ignore"):
        x = (offset + spread * u).astype(np.float32)
    assume(np.isfinite(x).all())
    return x


@settings(max_examples=300, deadline=None)
@given(
    compression=st.sampled_from(COMPRESSIONS),
    x=_rows(),
    fixed_range=st.sampled_from([1.0, 0.1, 0.3, 3.7, 1e-3, 2.0**-100]),
)
def test_the_stated_bound_holds_for_any_float32_rows(compression, x, fixed_range):
    """``|decode(encode(x)) - x| <= error_bound(x)`` for every compression (values a compression
    refuses aside), over float32 rows of any magnitude, offset and spread."""
    params = {"fixed_range": fixed_range} if compression == "fixed_r8" else {}
    excess = _round_trip_excess(compression, x, params)
    assert excess is None or excess <= 0, excess


def test_export_report_sizes(trained, tmp_path):
    _, path = trained
    vocab_dim = {"one": (60, 8), "bag": (50, 6), "wsum": (30, 4), "seq": (40, 4)}
    expected = {
        "fp32": lambda v, d: v * d * 4,
        "fp16": lambda v, d: v * d * 2,
        "bf16": lambda v, d: v * d * 2,
        "fixed_r8": lambda v, d: v * d,
        "int8_rowwise": lambda v, d: v * d + 8 * v,
    }
    disk = {}
    for comp in COMPRESSIONS:
        report = export(path, tmp_path / comp, compress=comp)
        assert [r["table"] for r in report.rows] == ["one", "bag", "wsum", "seq"]
        for r in report.rows:
            v, d = vocab_dim[r["table"]]
            assert r["bytes_before"] == v * d * 4
            assert r["bytes_after"] == expected[comp](v, d), (comp, r)
        text = report.format()
        assert all(name in text for name in vocab_dim) and comp in text
        total = text.splitlines()[-1].split()
        assert total[:2] == ["all", "tables"]
        before = sum(r["bytes_before"] for r in report.rows)
        after = sum(r["bytes_after"] for r in report.rows)
        assert float(total[2]) == pytest.approx(before / 2**20, abs=0.006)
        assert float(total[3]) == pytest.approx(after / 2**20, abs=0.006)
        disk[comp] = sum(f.stat().st_size for f in (tmp_path / comp).glob("*.safetensors"))
    # fp16 about half of fp32 on disk too (plus small headers)
    assert 0.45 < disk["fp16"] / disk["fp32"] < 0.6
    assert disk["fixed_r8"] < disk["fp16"]
    assert "2.00" in export(path, tmp_path / "fp16b", compress="fp16").format()


def test_export_report_totals_keep_a_tables_nan_error(tmp_path):
    """A table with a NaN max abs error (weights holding NaN are refused by export since;
    the report's sum stays right for any): the "all tables" line took max() of the tables'
    errors, which drops a NaN after a number: it showed the other table's."""
    row = {"compression": "fp16", "bytes_before": 160, "bytes_after": 80}
    rows = [{"table": "a", **row, "max_abs_error": 1e-3}]
    rows.append({"table": "b", **row, "max_abs_error": float("nan")})
    lines = ExportReport(tmp_path, rows).format().splitlines()
    assert lines[1].split()[-1] != "nan" and lines[2].split()[-1] == "nan"
    assert lines[-1].split()[:2] == ["all", "tables"] and lines[-1].split()[-1] == "nan"


def test_export_report_counts_a_keyed_tables_keys_in_both_sizes(tmp_path, capsys):
    """A keyed table's export holds its int64 keys beside its rows: the "fp32 MiB" column left
    them out and "export MiB" counted them, so an fp32 export (nothing compressed) showed a
    ratio of 0.50 at dim 2. Both count them now, and the report says so."""
    from embengine import cli

    t = ee.TableConfig(None, 2, name="k", combiner="sum")
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=O.SGD(0.1))
    acts = eng.lookup({"f": np.arange(40)})
    eng.apply_gradients({"f": np.ones_like(acts["f"])})
    path = eng.save(tmp_path / "ck")
    for comp, ratio in (("fp32", 1.0), ("fp16", 16 / 12)):
        out = tmp_path / comp
        assert cli.main(["export", str(path), str(out), "--compress", comp]) == 0
        report = export(path, tmp_path / f"{comp}-api", compress=comp)
        (row,) = report.rows
        assert row["bytes_before"] == 40 * (2 * 4 + 8)  # rows as float32, and the keys
        assert row["bytes_after"] == 40 * (2 * {"fp32": 4, "fp16": 2}[comp] + 8)
        text = capsys.readouterr().out
        assert f"{ratio:6.2f}" in text.splitlines()[1]
        assert "(keyed tables: both sizes count their int64 keys)" in text


def test_per_table_overrides_apply(trained, tmp_path):
    eng, path = trained
    per_table = {"bag": "int8_rowwise", "seq": "fp32"}
    report = export(path, tmp_path / "out", compress="fp16", per_table=per_table)
    comps = {r["table"]: r["compression"] for r in report.rows}
    assert comps == {"one": "fp16", "bag": "int8_rowwise", "wsum": "fp16", "seq": "fp32"}
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert {t["name"]: t["compression"] for t in manifest["tables"]} == comps
    st = pytest.importorskip("safetensors.numpy")
    files = {t["name"]: t["file"] for t in manifest["tables"]}
    bag = st.load_file(str(tmp_path / "out" / files["bag"]))
    assert bag["weights"].dtype == np.int8 and set(bag) == {"weights", "scale", "bias"}
    assert st.load_file(str(tmp_path / "out" / files["one"]))["weights"].dtype == np.float16
    seq = st.load_file(str(tmp_path / "out" / files["seq"]))["weights"]
    np.testing.assert_array_equal(seq, eng.embedding_tables["seq"])
    serving = ServingEngine.load(tmp_path / "out")
    bounds = {t: error_bound(comps[t], w, {}) for t, w in eng.embedding_tables.items()}
    for seed in range(2):
        feats, weights = _inputs(seed)
        expect = eng.lookup(feats, weights)
        got = serving.lookup(feats, weights)
        _compare(got, expect, _expected_bound(eng, feats, weights, bounds))
        np.testing.assert_array_equal(got["seq"], expect["seq"])  # fp32 table: exact


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"compress": "fp8"}, "fp8"),
        ({"per_table": {"nope": "fp16"}}, "nope"),
        ({"per_table": {"bag": "int4"}}, "int4"),
        ({"compress": "fixed_r8", "fixed_range": 0.0}, "fixed_range"),
        ({"compress": "fixed_r8", "fixed_range": float("nan")}, "fixed_range"),
        # its step r / 128 must be a normal float32: beyond, every value decoded to NaN or Inf
        ({"compress": "fixed_r8", "fixed_range": float("inf")}, "fixed_range"),
        ({"compress": "fixed_r8", "fixed_range": 1e300}, "fixed_range .* normal numbers"),
        ({"compress": "fixed_r8", "fixed_range": 1e-40}, "fixed_range .* normal numbers"),
    ],
    ids=[
        "compress",
        "unknown-table",
        "table-compress",
        "range-0",
        "range-nan",
        "range-inf",
        "range-huge",
        "range-tiny",
    ],
)
def test_export_argument_errors(trained, tmp_path, kwargs, words):
    _, path = trained
    with pytest.raises(ValueError, match=words):
        export(path, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".export-*")) and not list(tmp_path.glob(".tmp-*"))


def test_export_replaces_an_existing_export(trained, tmp_path):
    _, path = trained
    export(path, tmp_path / "out", compress="fp32")
    export(path, tmp_path / "out", compress="int8_rowwise", replace=True)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert {t["compression"] for t in manifest["tables"]} == {"int8_rowwise"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    ServingEngine.load(tmp_path / "out")


def test_export_takes_the_newest_checkpoint_of_a_root(tmp_path):
    eng = _train("reference", steps=1)
    eng.save(tmp_path / "ck")
    feats, weights = _inputs(5)
    acts = eng.lookup(feats, weights)
    eng.apply_gradients({k: np.ones_like(v) for k, v in acts.items()})
    eng.save(tmp_path / "ck")
    export(tmp_path / "ck", tmp_path / "out", compress="fp32")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["source_step"] == 2
    got = ServingEngine.load(tmp_path / "out").lookup(feats, weights)
    want = eng.lookup(feats, weights)
    for k in ("one", "seq"):
        np.testing.assert_array_equal(got[k], want[k])


# -- tampering -------------------------------------------------------------------------------------


def _flip(path: Path, offset: int = -3) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def test_export_of_a_tampered_checkpoint_fails(trained, tmp_path):
    _, path = trained
    copy = tmp_path / "ck" / path.name
    shutil.copytree(path, copy)
    _flip(copy / "table-001.safetensors")
    with pytest.raises(CheckpointError, match=r"checksum mismatch.*table-001\.safetensors"):
        export(copy, tmp_path / "out", compress="fp16")
    assert not (tmp_path / "out").exists()
    (copy / "table-001.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        export(copy, tmp_path / "out")


@pytest.fixture
def exported(trained, tmp_path):
    _, path = trained
    export(path, tmp_path / "out", compress="fp16", per_table={"bag": "int8_rowwise"})
    return tmp_path / "out"


@pytest.mark.parametrize("tamper", ["flip-data", "flip-header", "truncate", "delete"])
def test_serving_engine_refuses_a_tampered_export(exported, tamper):
    f = exported / "table-001.safetensors"
    if tamper == "flip-data":
        _flip(f)
    elif tamper == "flip-header":
        _flip(f, 12)
    elif tamper == "truncate":
        f.write_bytes(f.read_bytes()[:-8])
    else:
        f.unlink()
    with pytest.raises(CheckpointError) as exc:
        ServingEngine.load(exported)
    assert "table-001.safetensors" in str(exc.value)
    if tamper.startswith("flip"):
        assert "checksum mismatch" in str(exc.value)


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.__setitem__("format", "pickle"),
        lambda m: m.__setitem__("format", "embengine-checkpoint"),
        lambda m: m.__setitem__("format_version", 99),
        lambda m: m["files"].__setitem__("model.pkl", {"sha256": "0", "bytes": 0}),
    ],
    ids=["pickle", "checkpoint-format", "version", "pkl-file"],
)
def test_serving_engine_refuses_foreign_manifests(exported, edit):
    m = json.loads((exported / "manifest.json").read_text())
    edit(m)
    (exported / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError):
        ServingEngine.load(exported)


@pytest.mark.parametrize("version", [True, 1.0], ids=["true", "float"])
@pytest.mark.parametrize("verify", [True, False])
def test_an_export_format_version_must_be_an_int(exported, version, verify):
    """``format_version: true`` (True == 1) or ``1.0`` used to pass as version 1; a
    checkpoint's manifest refuses both (``checkpoint._is_int``), and now an export's does."""
    m = json.loads((exported / "manifest.json").read_text())
    assert m["format_version"] == 1
    m["format_version"] = version
    text = json.dumps(m).encode()
    (exported / "manifest.json").write_bytes(text)
    (exported / "manifest.sha256").write_text(hashlib.sha256(text).hexdigest())
    match = rf"export format version {version!r} is not supported \(this embengine reads 1\)"
    with pytest.raises(CheckpointError, match=match):
        ServingEngine.load(exported, verify=verify)
    with pytest.raises(CheckpointError, match=match):
        read_serving_manifest(exported, verify=verify)


def test_serving_engine_refuses_a_folder_without_export(tmp_path, trained):
    with pytest.raises(CheckpointError, match="manifest.json"):
        ServingEngine.load(tmp_path)
    _, path = trained
    with pytest.raises(CheckpointError, match="not an embengine export"):
        ServingEngine.load(path)  # a training checkpoint is not an export


def test_serving_a_checkpoint_says_to_export_it_first(tmp_path, trained_ref):
    """What a training job leaves, a checkpoint or the folder of them, loaded as an export:
    "no manifest.json" (the root holds ckpt-* folders) or "not an embengine export (format
    'embengine-checkpoint')" named no way out; a missing path was "no manifest.json" too."""
    _, path = trained_ref
    with pytest.raises(CheckpointError) as e:
        ServingEngine.load(path)
    assert str(e.value).startswith(f"{path} is a checkpoint, not an embengine export; export")
    assert "`embengine export CKPT OUT`" in str(e.value)
    with pytest.raises(CheckpointError) as e:
        ServingEngine.load(path.parent)
    assert str(e.value).startswith(f"{path.parent} is a folder of checkpoints, not an embengine")
    assert "`embengine export CKPT OUT`" in str(e.value)
    with pytest.raises(CheckpointError, match=r"missing does not exist \(not an embengine"):
        ServingEngine.load(tmp_path / "missing")


@pytest.mark.parametrize(
    "name, verify",
    [
        ("table-000.safetensors", True),
        ("table-000.safetensors", False),
        ("manifest.json", True),
        ("manifest.json", False),
        ("manifest.sha256", True),  # read only with verify
    ],
)
def test_serving_refuses_symlinked_files(trained_ref, tmp_path, name, verify):
    """A file of an export that is a symbolic link (here to the same file moved outside the
    export, so every hash matches) could lead to any file the server can read: refused, as a
    checkpoint's are (it was followed: is_file() and stat() follow links)."""
    _, path = trained_ref
    out = tmp_path / "out"
    export(path, out)
    moved = tmp_path / "outside" / name
    moved.parent.mkdir()
    shutil.move(out / name, moved)
    (out / name).symlink_to(moved)
    with pytest.raises(CheckpointError, match=f"{name} is not a regular file"):
        ServingEngine.load(out, verify=verify)
    with pytest.raises(CheckpointError, match=f"{name} is not a regular file"):
        describe(out, verify=verify)


@pytest.mark.parametrize("name", ["manifest.json", "manifest.sha256"])
def test_serving_refuses_a_manifest_larger_than_the_cap(trained_ref, tmp_path, name):
    """An export's manifest.json / manifest.sha256 past MAX_MANIFEST_BYTES (sparse: free on
    disk) is refused before it is read, naming the file and the limit (it was read whole)."""
    _, path = trained_ref
    out = tmp_path / "out"
    export(path, out)
    limit = ckpt_mod.MAX_MANIFEST_BYTES
    with open(out / name, "r+b") as f:
        f.truncate(limit + 1)
    match = f"{name} is {limit + 1:,} bytes, more than a manifest may be \\({limit:,} bytes"
    for read in (ServingEngine.load, describe):
        with pytest.raises(CheckpointError, match=match):
            read(out)


# -- threads, sequences, output_shape -------------------------------------------------------------


def test_concurrent_lookups_equal_sequential(exported):
    serving = ServingEngine.load(exported)
    batches = [_inputs(seed) for seed in range(48)]
    sequential = [serving.lookup(f, w) for f, w in batches]
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(serving.lookup, f, w) for f, w in batches * 2]
        concurrent = [fut.result() for fut in futures]
    for i, got in enumerate(concurrent):
        want = sequential[i % len(batches)]
        assert sorted(got) == sorted(want)
        for k in want:
            assert got[k].tobytes() == want[k].tobytes(), (i, k)


def test_sequence_features_and_output_shape_in_serving(trained, tmp_path):
    eng, path = trained
    export(path, tmp_path / "out", compress="fp32")
    serving = ServingEngine.load(tmp_path / "out")
    feats, weights = _inputs(7)
    got = serving.lookup(feats, weights)
    want = eng.lookup(feats, weights)
    assert got["shaped"].shape == (3, 4, 8)
    assert got["seq"].shape == (B, 3, 4)
    assert got["seq_shaped"].shape == (B * 2, 4)
    assert got["one"].shape == (B, 8) and got["bag"].shape == (B, 6)
    for k in ("shaped", "seq", "seq_shaped", "one"):
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    # Positions past a sample's length are zero-padded; ids past max_sequence_length dropped.
    lengths = feats["seq"].lengths
    table = eng.embedding_tables["seq"]
    for s in range(B):
        ids = feats["seq"].ids[feats["seq"].offsets[s] : feats["seq"].offsets[s + 1]][:3]
        np.testing.assert_array_equal(got["seq"][s, : len(ids)], table[ids])
        assert not got["seq"][s, min(lengths[s], 3) :].any()
    # The empty bag of sample 0 gives zeros; "shaped" is "one"'s ids laid out as [3, 4].
    assert not got["bag"][0].any()
    np.testing.assert_array_equal(
        got["shaped"].reshape(B, 8), eng.embedding_tables["one"][feats["shaped"]]
    )
    # A PreparedBatch works too, and bad input is an error naming the feature.
    batch = serving.preprocess(feats, weights)
    again = serving.lookup(batch)
    for k in got:
        np.testing.assert_array_equal(again[k], got[k])
    bad = dict(feats, one=np.full(B, 60))
    with pytest.raises(ValueError, match="one"):
        serving.lookup(bad, weights)


def test_serving_quantization_config_is_applied(tmp_path):
    q = ee.QuantizationConfig(num_buckets=5, lower=-0.5, upper=0.5)
    t = ee.TableConfig(20, 4, name="q", combiner="sum", quantization_config=q)
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=O.SGD(0.1), backend="numba")
    ids = np.arange(20)
    want = eng.lookup({"f": ids})["f"]
    export(eng.save(tmp_path / "ck"), tmp_path / "out", compress="fp32")
    got = ServingEngine.load(tmp_path / "out").lookup({"f": ids})["f"]
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(got)) <= 5


@pytest.mark.parametrize(
    "q", [ee.QuantizationConfig(10, 0.1, 1.0), ee.QuantizationConfig(256, -1.0, 1.0)]
)
def test_serving_unknown_keys_of_a_quantized_keyed_table_add_nothing(tmp_path, q):
    """An unknown key pools nothing in serving, as in the engine's evaluation lookup: a zero row
    in its place was quantized like any other (to ``lower`` when the range excludes 0). Bags
    of known and unknown keys, unknown alone, empty; lookup-only and prepared batches."""
    t = ee.TableConfig(None, 4, name="k", combiner="sum", quantization_config=q)
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=O.SGD(0.1), backend="numba")
    acts = eng.lookup({"f": np.array([7, 9])})
    eng.apply_gradients({"f": np.ones_like(acts["f"])})
    export(eng.save(tmp_path / "ck"), tmp_path / "out", compress="fp32")
    serving = ServingEngine.load(tmp_path / "out")
    feats = {"f": ee.Ragged([7, 12345, 7, 9, 12345, -5], offsets=[0, 1, 2, 5, 5, 6])}
    want = eng.lookup(feats, training=False)["f"]
    assert (want[1] == 0).all() and (want[4] == 0).all()
    np.testing.assert_array_equal(serving.lookup(feats)["f"], want)
    np.testing.assert_array_equal(serving.lookup(serving.preprocess(feats))["f"], want)


_WITHOUT_ML_DTYPES = """
import sys
sys.modules["ml_dtypes"] = None  # an install without the train / bfloat16 extras
from embengine.cli import main
sys.exit(main(["export", sys.argv[1], sys.argv[2], "--compress", "bf16"]))
"""


def _export_without_ml_dtypes(checkpoint: Path, out: Path) -> subprocess.CompletedProcess:
    """``embengine export CHECKPOINT OUT --compress bf16`` in a child that cannot import
    ml_dtypes."""
    env = {**os.environ, "PYTHONPATH": str(Path(ee.__file__).parents[1])}
    return subprocess.run(
        [sys.executable, "-c", _WITHOUT_ML_DTYPES, str(checkpoint), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_bf16_export_without_ml_dtypes_equals_one_with_it(trained_ref, tmp_path):
    """``--compress bf16`` needs no ml_dtypes (numpy alone installs embengine): its bits are
    written as a "BF16" tensor all the same. Without it, a float64 view of them was written and
    reported as written; the loader then refused the export."""
    _, path = trained_ref
    export(path, tmp_path / "with", compress="bf16")
    done = _export_without_ml_dtypes(path, tmp_path / "without")
    assert done.returncode == 0, done.stderr
    tensors = sorted(p.name for p in (tmp_path / "with").glob("*.safetensors"))
    assert tensors == sorted(p.name for p in (tmp_path / "without").glob("*.safetensors"))
    for name in tensors:  # the same bytes
        assert (tmp_path / "without" / name).read_bytes() == (tmp_path / "with" / name).read_bytes()
    want = ServingEngine.load(tmp_path / "with")
    got = ServingEngine.load(tmp_path / "without")
    feats, weights = _inputs(3)
    for n, v in want.lookup(feats, weights).items():
        np.testing.assert_array_equal(got.lookup(feats, weights)[n], v)


def test_export_of_a_bfloat16_table_without_ml_dtypes_says_what_to_install(tmp_path):
    """A bfloat16 table's checkpoint needs ml_dtypes to be read: without it the command says
    so (exit 2), where it ended in a traceback."""
    t = ee.TableConfig(10, 4, name="h", weights_dtype="bfloat16")
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=O.SGD(0.1))
    done = _export_without_ml_dtypes(eng.save(tmp_path / "ck"), tmp_path / "out")
    assert done.returncode == 2, done.stderr
    assert "embengine export: error:" in done.stderr and "ml_dtypes" in done.stderr
    assert "Traceback" not in done.stderr


# -- the command line ------------------------------------------------------------------------------


def test_cli_export_and_inspect(trained_ref, tmp_path):
    """The installed ``embengine`` command (each run imports torch: ~2 s, so three runs, in
    parallel); other paths of the same handlers run in-process below."""
    eng, path = trained_ref
    bad_ckpt = tmp_path / "bad" / path.name
    shutil.copytree(path, bad_ckpt)
    _flip(bad_ckpt / "table-000.safetensors")
    out = tmp_path / "out"
    commands = {
        "export": [
            "export",
            str(path),
            str(out),
            "--compress",
            "fp16",
            "--table",
            "bag=int8_rowwise",
        ],
        "inspect": ["inspect", str(path.parent)],
        "inspect-bad": ["inspect", str(bad_ckpt)],
    }
    # PYTHONPATH: the command imports this checkout's embengine, not the one it was installed from
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = {
        k: subprocess.Popen(
            [str(EMBENGINE), *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for k, args in commands.items()
    }
    res = {k: (p.wait(timeout=120), *p.communicate()) for k, p in procs.items()}

    code, stdout, stderr = res["export"]
    assert code == 0, stderr
    assert "int8_rowwise" in stdout and "fp16" in stdout and f"wrote {out}" in stdout
    for name in ("one", "bag", "wsum", "seq"):
        assert name in stdout
    manifest = json.loads((out / "manifest.json").read_text())
    comps = {t["name"]: t["compression"] for t in manifest["tables"]}
    assert comps == {"one": "fp16", "bag": "int8_rowwise", "wsum": "fp16", "seq": "fp16"}
    serving = ServingEngine.load(out)
    feats, weights = _inputs(3)
    bounds = {t: error_bound(comps[t], w, {}) for t, w in eng.embedding_tables.items()}
    _compare(
        serving.lookup(feats, weights),
        eng.lookup(feats, weights),
        _expected_bound(eng, feats, weights, bounds),
    )

    code, stdout, stderr = res["inspect"]
    assert code == 0, stderr
    assert "checksums verified" in stdout and path.name in stdout and "step 3" in stdout
    for name in ("'one'", "'bag'", "'wsum'", "'seq'", "bag/momenta", "one/accumulators"):
        assert name in stdout, name
    assert "seq -> seq (sequence 3)" in stdout

    code, stdout, stderr = res["inspect-bad"]
    assert code == 1, (stdout, stderr)
    assert "error" in stderr and "checksum mismatch" in stderr
    assert "table-000.safetensors" in stderr


def _cli(handler, capsys, **kwargs):
    import argparse

    from embengine import cli

    code = getattr(cli, handler)(argparse.Namespace(**kwargs))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_export_table_names_with_an_equals_sign_and_given_twice(tmp_path, capsys):
    """--table NAME=COMPRESSION split at the first '=': a table named "user=id" could not be
    given one (compression 'id=fp32' refused); a table given twice took the last silently."""
    from embengine import cli

    t = ee.TableConfig(10, 4, name="user=id")
    path = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=O.SGD(0.1)).save(tmp_path / "c")
    argv = ["export", str(path), str(tmp_path / "out"), "--compress", "fp16"]
    assert cli.main([*argv, "--table", "user=id=int8_rowwise"]) == 0
    assert "user=id              int8_rowwise" in capsys.readouterr().out
    twice = ["--table", "user=id=fp32", "--table", "user=id=bf16", "--replace"]
    assert cli.main([*argv, *twice]) == 2
    assert "--table gives table 'user=id' twice" in capsys.readouterr().err


def test_cli_export_names_an_unknown_table_before_hashing_the_checkpoint(tmp_path, capsys):
    """`--table NAME` of a table the checkpoint does not hold is refused from its manifest,
    before any table file is read or hashed: it was found after the whole checkpoint had been
    hashed (minutes for a large one). A table file damaged at the same size shows which came
    first: its checksum mismatch was the error."""
    from embengine import cli

    t = ee.TableConfig(10, 4, name="user")
    item = ee.TableConfig(12, 4, name="item")
    feats = {"u": ee.FeatureConfig(t), "i": ee.FeatureConfig(item)}
    path = ee.EmbeddingEngine(feats, optimizer=O.SGD(0.1)).save(tmp_path / "c")
    table = path / json.loads((path / "manifest.json").read_text())["tables"][0]["file"]
    data = bytearray(table.read_bytes())
    data[-1] ^= 0xFF
    table.write_bytes(bytes(data))
    out = tmp_path / "out"
    assert cli.main(["export", str(path), str(out), "--table", "usr=fp32"]) == 2
    err = capsys.readouterr().err
    assert f"unknown tables ['usr']: checkpoint {path} holds tables ['user', 'item']" in err
    assert "checksum" not in err and not out.exists()
    assert cli.main(["export", str(path), str(out), "--table", "user=fp32"]) == 2
    assert f"checksum mismatch in {table}" in capsys.readouterr().err  # hashed: still verified


def test_cli_handlers_for_exports_and_errors(trained_ref, tmp_path, capsys):
    _, path = trained_ref
    out = tmp_path / "out"
    code, stdout, _ = _cli(
        "_export",
        capsys,
        checkpoint=str(path),
        out=str(out),
        compress="bf16",
        table=None,
        fixed_range=1.0,
        replace=False,
    )
    assert code == 0 and "bf16" in stdout
    code, stdout, _ = _cli("_inspect", capsys, path=str(out), no_verify=False)
    assert code == 0
    assert "checksums verified" in stdout and "compression bf16" in stdout
    assert "from step 3" in stdout and "table 'bag'" in stdout
    bad_export = tmp_path / "bad_export"
    shutil.copytree(out, bad_export)
    _flip(bad_export / "table-002.safetensors")
    code, stdout, stderr = _cli("_inspect", capsys, path=str(bad_export), no_verify=False)
    assert code == 1 and "checksum mismatch" in stderr and "table-002.safetensors" in stderr
    code, stdout, _ = _cli("_inspect", capsys, path=str(bad_export), no_verify=True)
    assert code == 0 and "not checked" in stdout
    bad_ckpt = tmp_path / "bad" / path.name
    shutil.copytree(path, bad_ckpt)
    _flip(bad_ckpt / "table-000.safetensors")
    code, _, stderr = _cli(
        "_export",
        capsys,
        checkpoint=str(bad_ckpt),
        out=str(tmp_path / "n"),
        compress="fp16",
        table=None,
        fixed_range=1.0,
        replace=False,
    )
    assert code != 0 and "checksum mismatch" in stderr
    assert not (tmp_path / "n").exists()
    code, _, stderr = _cli(
        "_export",
        capsys,
        checkpoint=str(path),
        out=str(tmp_path / "n"),
        compress="fp16",
        table=["bag"],
        fixed_range=1.0,
        replace=False,
    )
    assert code == 2 and "NAME=COMPRESSION" in stderr
    code, _, stderr = _cli(
        "_export",
        capsys,
        checkpoint=str(path),
        out=str(tmp_path / "n"),
        compress="fp16",
        table=["zzz=fp16"],
        fixed_range=1.0,
        replace=False,
    )
    assert code == 2 and "zzz" in stderr


def test_serving_refuses_a_batch_prepared_for_other_tables(trained_ref, tmp_path):
    # A batch prepared by a serving engine of bigger tables would read rows past the end of
    # these ones: it is refused naming the difference, like EmbeddingEngine does.
    _, ckpt = trained_ref
    served = ServingEngine.load(export(ckpt, tmp_path / "out").path)
    feats, weights = _inputs(7)
    tables = {}
    for fc in _features().values():
        t = fc.table
        tables.setdefault(t.name, ee.TableConfig(10_000, t.dim, name=t.name, combiner=t.combiner))
    bigger = {
        name: ee.FeatureConfig(
            tables[fc.table.name], fc.max_sequence_length, output_shape=fc.output_shape
        )
        for name, fc in _features().items()
    }
    other = ee.EmbeddingEngine(bigger, optimizer=O.SGD(learning_rate=0.1), backend="reference")
    far = dict(feats, one=np.full(B, 9_999))
    with pytest.raises(ValueError, match="feature 'one': prepared for a table of 10000 rows"):
        served.lookup(other.preprocess(far, weights))
    own = served.preprocess(feats, weights)
    # Its own batches are served as before.
    for name, act in served.lookup(feats, weights).items():
        np.testing.assert_array_equal(served.lookup(own)[name], act)


# -- serving looks rows up through the backend's lookup path ---------------------------------------


def _deduplicated_lookup(serving, feats, weights):
    """Serving's lookup as it was before it used the backend: deduplicate (NumPy), decode the
    unique rows, pool them with the training lookup's kernel."""
    from embengine.batch import build_tables_numpy, prepare
    from embengine.kernels.lookup import PREFETCH_DISTANCE, pool_kernel
    from embengine.serving import decode

    batch = prepare(serving._resolved, feats, weights, build_tables_numpy)
    per_table = []
    for name, tb in zip(serving.table_names, batch.tables, strict=True):
        arrays, comp, params, dim = serving._tables[name]
        compact = np.ascontiguousarray(decode(arrays, comp, tb.unique_ids, params))
        q = serving._configs[name].quantization_config
        quant = np.zeros(3) if q is None else np.array([q.num_buckets, q.lower, q.upper])
        out = np.empty((tb.num_outputs, dim), dtype=np.float32)
        pool_kernel(dim)(
            compact.reshape(-1, dim),
            dim,
            np.arange(len(tb.unique_ids)),
            tb.inverse,
            tb.gains,
            tb.output_offsets,
            out,
            quant,
            PREFETCH_DISTANCE,
        )
        per_table.append(out)
    return {
        name: per_table[lay.table][lay.start : lay.stop].reshape(lay.shape)
        for name, lay in batch.features.items()
    }


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_serving_pools_decoded_rows_without_deduplicating(
    trained, tmp_path, compression, monkeypatch
):
    from embengine.backends.numba_backend import NumbaBackend

    _, path = trained
    export(path, tmp_path / "out", compress=compression, fixed_range=1.0)
    serving = ServingEngine.load(tmp_path / "out")
    inputs = [_inputs(seed) for seed in (3, 4)]
    want = [_deduplicated_lookup(serving, f, w) for f, w in inputs]

    def no_dedup(*args):
        raise AssertionError("serving deduplicated a batch")

    calls = []
    real = NumbaBackend.lookup_rows
    monkeypatch.setattr(ee.batch, "dedup", no_dedup)
    monkeypatch.setattr(
        NumbaBackend, "lookup_rows", lambda self, *a: calls.append(a[1]) or real(self, *a)
    )
    for (f, w), expected in zip(inputs, want, strict=True):
        got = serving.lookup(f, w)
        assert sorted(got) == sorted(expected)
        for k in expected:
            assert got[k].dtype == np.float32 and got[k].shape == expected[k].shape, k
            assert got[k].tobytes() == expected[k].tobytes(), k
        batch = serving.preprocess(f, w)  # lookup-only: nothing to deduplicate
        assert not batch.deduplicated
        again = serving.lookup(batch)
        for k in expected:
            assert again[k].tobytes() == expected[k].tobytes(), k
    assert len(calls) == 2 * 2 * len(serving.table_names)


@pytest.mark.parametrize("compression", ["fp32", "int8_rowwise"])
def test_export_refuses_weights_holding_nan_or_inf_and_exports_diverged_slots(
    tmp_path, compression
):
    """A checkpoint saved after training diverged (its manifest says a table was not finite):
    weights holding NaN or Inf are refused, naming the file, the table and the first row,
    nothing written (served, every bag holding the row would be NaN; an fp32 export copied
    them and reported no error); a table whose slots alone diverged exports."""
    features = {"f": ee.FeatureConfig(ee.TableConfig(300, 4, name="t"))}
    eng = ee.EmbeddingEngine(features, optimizer=O.Adagrad(0.1), seed=2)
    eng.slots("t")["accumulators"][5, 1] = np.inf
    slots_only = eng.save(tmp_path / "a")
    report = export(slots_only, tmp_path / "ok", compress=compression)
    assert report.rows[0]["table"] == "t"
    eng.embedding_tables["t"][250, 2] = np.nan
    eng.embedding_tables["t"][260, 0] = -np.inf
    bad = eng.save(tmp_path / "b")
    with pytest.raises(ValueError, match="table 't' has 2 rows of weights holding NaN or Inf") as e:
        export(bad, tmp_path / "out", compress=compression)
    assert "the first at row 250" in str(e.value) and "table-000.safetensors" in str(e.value)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []


@pytest.mark.parametrize(
    ("weights_dtype", "compression", "value"),
    [("float32", "fp16", 1e6), ("bfloat16", "fp16", -7e4), ("float32", "bf16", 3.4e38)],
)
def test_export_refuses_a_compression_that_overflows_finite_weights(
    tmp_path, weights_dtype, compression, value
):
    """Finite weights past the compressed type's range (fp16 above 65504, bf16 near float32's
    largest) became Inf in the export, silently (a NumPy warning at most; served, every bag
    holding the row was Inf): refused, naming the table, the first row and the value, nothing
    written; the table exports with a compression that holds it."""
    table = ee.TableConfig(300, 4, name="t", combiner="sum", weights_dtype=weights_dtype)
    eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(table)}, optimizer=O.SGD(0.1), seed=2)
    eng.embedding_tables["t"][200, 3] = value
    eng.embedding_tables["t"][210, 0] = value
    ckpt = eng.save(tmp_path / "ck")
    words = f"table 't': 2 rows hold values {compression} cannot represent"
    with pytest.raises(ValueError, match=words) as e:
        export(ckpt, tmp_path / "out", compress=compression)
    assert "the first at row 200" in str(e.value)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []
    export(ckpt, tmp_path / "out", compress="fp32")
    served = ServingEngine.load(tmp_path / "out").lookup({"f": ee.Ragged([200], lengths=[1])})
    want = eng.lookup({"f": ee.Ragged([200], lengths=[1])}, training=False)
    assert served["f"].tobytes() == want["f"].tobytes()
