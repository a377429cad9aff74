"""Layers import down only: the specs (config, optimizers, initializers), the storage plan and the
backend protocol load without numba, which loads when a backend is made or a kernel first runs;
backends declare their interface instead of being probed."""

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import embengine as ee
from embengine import optimizers as opt
from embengine.backends import Backend
from embengine.backends.numba_backend import NumbaBackend
from embengine.backends.reference import ReferenceBackend


def _run(code: str) -> subprocess.CompletedProcess:
    # From the repository root, so that the child imports this checkout's embengine.
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )


def test_specs_plan_and_engine_class_import_without_numba():
    done = _run("""
        import sys
        import embengine.config
        assert "numba" not in sys.modules, "import embengine.config loaded numba"
        import embengine as ee
        import embengine.backends, embengine.initializers, embengine.optimizers
        import embengine.storage, embengine.storage.plan, embengine.storage.registry
        import embengine.checkpoint, embengine.inspect, embengine.serving
        from embengine.config import resolve_features
        ee.EmbeddingEngine  # the class, not an engine
        init = ee.initializers.RandomUniform(-1.0, 1.0)
        t = ee.TableConfig(10, 4, name="t", initializer=init, optimizer=ee.optimizers.Adam(0.1))
        r = resolve_features({"f": ee.FeatureConfig(t)})
        plan = ee.storage.plan_storage(r, [t.optimizer], "ram")
        assert init.fill(4) == ee.initializers.Fill("uniform", -1.0, 1.0)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "numba")
        assert not loaded, f"numba modules loaded: {loaded[:5]}"
        # numba loads with the first kernel: here the initializer's fill.
        init.init(0, "t", [0, 1], 4)
        assert "numba" in sys.modules
        print("ok")
    """)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_both_backends_implement_the_protocol():
    for backend in (ReferenceBackend(), NumbaBackend()):
        assert isinstance(backend, Backend), type(backend).__name__
    assert {m for m in dir(Backend) if not m.startswith("_")} >= {
        "build_tables",
        "build_tables_and_lookup",
        "lookup",
        "lookup_rows",
        "apply",
    }


def _engine(backend):
    tables = [
        ee.TableConfig(30, d, name=f"t{i}", combiner=c)
        for i, (d, c) in enumerate(((4, "mean"), (2, "sqrtn"), (2, "sum")))
    ]
    o = opt.SGD(0.1, low_dimensional_packing_status=True)
    feats = {t.name: ee.FeatureConfig(t) for t in tables}
    feats["seq"] = ee.FeatureConfig(tables[0], max_sequence_length=2)
    return ee.EmbeddingEngine(feats, optimizer=o, backend=backend, seed=3)


def test_reference_training_lookup_goes_through_the_declared_fused_lookup(monkeypatch):
    # The engine calls build_tables_and_lookup on every backend (no probing); the reference
    # one builds the batch, then pools it: the same as preprocess then lookup.
    calls = []
    real = ReferenceBackend.build_tables_and_lookup

    def counted(self, *args):
        calls.append(len(args[0]))
        return real(self, *args)

    monkeypatch.setattr(ReferenceBackend, "build_tables_and_lookup", counted)
    eng = _engine("reference")
    rng = np.random.default_rng(0)
    feats = {
        n: [list(rng.integers(0, 30, rng.integers(0, 4))) for _ in range(9)]
        for n in eng.feature_config
    }
    acts = eng.lookup(feats)
    assert calls == [len(eng.storage_plan.physical_tables)] == [2]  # t1 and t2 packed
    apart = eng.lookup(eng.preprocess(feats))
    for k in acts:
        np.testing.assert_array_equal(acts[k], apart[k])
    eng.apply_gradients({k: np.ones_like(a) for k, a in acts.items()})


def test_lookup_rows_equals_lookup_of_the_table(backend):
    # lookup_rows (serving's path) over a table's rows gives the table's lookup, bit for bit.
    eng = _engine(backend)
    be = eng._backend
    rng = np.random.default_rng(1)
    feats = {
        n: [list(rng.integers(0, 30, rng.integers(0, 5))) for _ in range(70)]
        for n in eng.feature_config
    }
    for training in (True, False):
        batch = eng.preprocess(feats, training=training)
        for p, spec in enumerate(eng.storage_plan.physical_tables):
            table = eng._physical[p]
            want = be.lookup(table, batch.tables[p])
            got = be.lookup_rows(np.ascontiguousarray(table.weights), spec.dim, batch.tables[p])
            assert got.tobytes() == want.tobytes()
            # Into a given array (a slice of a larger buffer, as the sharded answers are).
            buffer = np.full(want.size + 7, np.nan, dtype=np.float32)
            into = buffer[3 : 3 + want.size].reshape(want.shape)
            rows = np.ascontiguousarray(table.weights)
            assert be.lookup_rows(rows, spec.dim, batch.tables[p], out=into) is into
            assert into.tobytes() == want.tobytes()
            assert np.isnan(buffer[:3]).all() and np.isnan(buffer[3 + want.size :]).all()
            frozen_out = np.empty(want.shape, np.float32)
            frozen_out.flags.writeable = False
            for bad, said in (
                (np.empty((want.shape[0] + 1, spec.dim), np.float32), "float32"),
                (np.empty(want.shape, np.float64), "float64"),
                (np.empty(want.shape[::-1], np.float32).T, "not C-contiguous"),
                (frozen_out, "read-only"),
            ):
                with pytest.raises(ValueError, match=f"out must be a writable C-cont.*{said}"):
                    be.lookup_rows(rows, spec.dim, batch.tables[p], out=bad)
            # Not over the rows it pools from (the pooling would read what it wrote).
            within = np.zeros((want.size + rows.size,), np.float32)
            table_rows = within[: rows.size].reshape(rows.shape)
            table_rows[:] = rows
            overlap = within[rows.size - 8 : rows.size - 8 + want.size].reshape(want.shape)
            with pytest.raises(ValueError, match="out overlaps the rows it would be pooled"):
                be.lookup_rows(table_rows, spec.dim, batch.tables[p], out=overlap)
