"""Settings for every test process (pytest-xdist workers and the subprocesses tests start), the
``backend`` fixture, and the helpers several test files share (import them with
``from conftest import ...``; pytest puts tests/ on the path)."""

import os

# Before anything imports torch: libgomp's threads (torch's and numba's "omp" layer) otherwise
# spin for milliseconds after each parallel region, and with pytest-xdist's workers filling the
# cores, the spinning steals the time the other worker needs (docs/performance.md, test time).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import embengine as ee  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(params=ee.engine.BACKENDS)
def backend(request) -> str:
    """Each backend by name: a test taking ``backend`` runs on every one, since numba must
    match the reference (the oracle). A test that wants fewer parametrizes ``backend`` itself."""
    return request.param


def run_python(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter from the repository root (this checkout's embengine),
    so that a crash or a hang cannot take pytest with it."""
    try:
        return subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the subprocess did not finish in {timeout} s")


def keyed_engine(backend="numba", optimizer=None, dim=2, init=None, **dynamic):
    """One keyed table "k" (``DynamicVocabulary(**dynamic)``, sum, RowId(0) unless ``init``,
    SGD(1.0) unless ``optimizer``) under feature "f"."""
    t = ee.TableConfig(
        None,
        dim,
        name="k",
        combiner="sum",
        initializer=init or ee.initializers.RowId(0),
        dynamic=ee.DynamicVocabulary(**dynamic),
    )
    o = optimizer or ee.optimizers.SGD(1.0)
    return ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=o, backend=backend, seed=1)


def train_bags(eng, bags, timestamp=None, grad=1.0) -> np.ndarray:
    """One step on feature "f": look ``bags`` up, apply the constant gradient ``grad``; returns
    the activations."""
    acts = eng.lookup({"f": bags}, timestamp=timestamp)["f"]
    eng.apply_gradients({"f": np.full_like(acts, grad)})
    return acts


def keyed_keys(eng) -> list[int]:
    """The keys table "k" holds, sorted."""
    return eng.table_contents("k")["keys"].tolist()
