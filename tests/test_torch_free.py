"""embengine without its extras: the CLI (``embengine`` and ``python -m embengine``), inspect
and export run with numpy + numba only; the commands that need torch, tqdm or matplotlib say
which extra to install; the package metadata declares what the code imports."""

from __future__ import annotations

import ast
import subprocess
import sys
import sys as _sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import embengine as ee

ROOT = Path(ee.__file__).parent.parent
if _sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

# The child hides the extras from every import (including importlib.util.find_spec), as a venv
# without them would, then runs ``python -m embengine ARGS``.
CHILD = textwrap.dedent(
    """
    import runpy, sys
    BLOCKED = {"torch", "tqdm", "matplotlib", "tensorflow"}

    class Hide:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Hide())
    sys.path.insert(0, sys.argv.pop(1))
    if sys.argv[1] == "-c":
        exec(sys.argv[2])
    else:
        sys.argv = ["python -m embengine", *sys.argv[1:]]
        runpy.run_module("embengine", run_name="__main__", alter_sys=True)
    """
)


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(ROOT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def _checkpoint(folder: Path) -> Path:
    t = ee.TableConfig(20, 4, name="t")
    engine = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=ee.optimizers.SGD(0.1))
    engine.lookup({"f": np.array([1, 2, 3])})
    engine.apply_gradients({"f": np.ones((3, 4), np.float32)})
    engine.save(folder)
    return folder


def test_the_child_really_hides_torch():
    out = _run("-c", "import torch")
    assert out.returncode != 0
    assert "No module named 'torch'" in out.stderr


def test_cli_help_inspect_and_export_without_torch(tmp_path):
    ckpt = _checkpoint(tmp_path / "ckpt")
    out = _run("--help")
    assert out.returncode == 0, out.stderr
    for command in ("train", "bench", "export", "inspect"):
        assert command in out.stdout
    out = _run("train", "--help")
    assert out.returncode == 0, out.stderr
    assert "--optimizer" in out.stdout and "--baseline" in out.stdout
    out = _run("inspect", str(ckpt))
    assert out.returncode == 0, out.stderr
    assert "step 1" in out.stdout and "checksums verified" in out.stdout, out.stdout
    assert "table 't': 20 x 4" in out.stdout
    out = _run("export", str(ckpt), str(tmp_path / "served"), "--compress", "fp16")
    assert out.returncode == 0, out.stderr
    assert "wrote" in out.stdout
    out = _run("inspect", str(tmp_path / "served"))
    assert out.returncode == 0, out.stderr


def test_train_without_torch_names_the_extra_and_checks_options_first(tmp_path):
    out = _run("train", "--no-progress")
    assert out.returncode == 2
    assert "torch" in out.stderr and "pip install 'embengine[train]'" in out.stderr
    assert "Traceback" not in out.stderr
    out = _run("train")  # with the progress bar: tqdm is needed too
    assert "torch and tqdm" in out.stderr
    out = _run("train", "--plot", str(tmp_path / "curves.png"))
    assert "matplotlib" in out.stderr
    # A bad option is reported as such, before the missing packages.
    out = _run("train", "--steps", "0")
    assert out.returncode == 2
    assert "--steps must be >= 1, got 0" in out.stderr


def test_import_embengine_does_not_import_torch_and_ee_torch_names_the_extra():
    code = (
        "import sys, embengine as ee\n"
        "assert 'torch' not in sys.modules\n"
        "e = ee.Ragged([1, 2], lengths=[1, 1])\n"
        "try:\n"
        "    ee.torch\n"
        "except ImportError as exc:\n"
        "    print('ERR', exc)\n"
    )
    out = _run("-c", code)
    assert out.returncode == 0, out.stderr
    assert "ERR embengine.torch needs PyTorch" in out.stdout
    assert "pip install 'embengine[torch]'" in out.stdout


def test_tpu_port_runs_on_numpy_without_tensorflow():
    # TF hidden as if not installed: NumPy inputs train and serve, NumPy comes back, and no
    # TF module was looked for (the port tells TF objects by their class's module).
    code = (
        "import sys, numpy as np\n"
        "import embengine.tpu as embedding\n"
        "t = embedding.TableConfig(10, 2, initializer=embedding.RowIdInitializer())\n"
        "emb = embedding.TPUEmbedding({'f': embedding.FeatureConfig(t)}, embedding.SGD(0.5))\n"
        "emb.enqueue({'f': [[1, 2], [3]]})\n"
        "acts = emb.dequeue()\n"
        "assert type(acts['f']) is np.ndarray, type(acts['f'])\n"
        "emb.apply_gradients({'f': np.ones((2, 2), np.float32)})\n"
        "srv = embedding.TPUEmbeddingForServing({'f': embedding.FeatureConfig(t)})\n"
        "srv.build()\n"
        "print('OUT', srv.embedding_lookup({'f': np.array([4])})['f'].tolist())\n"
        "print('TF', sorted(m for m in sys.modules if m.split('.')[0] == 'tensorflow'))\n"
    )
    out = _run("-c", code)
    assert out.returncode == 0, out.stderr
    assert "OUT [[4.0, 4.0]]" in out.stdout and "TF []" in out.stdout, out.stdout


def test_ee_torch_is_the_torch_adapter_when_torch_is_installed():
    code = (
        "import sys, embengine as ee\n"
        "assert 'torch' not in sys.modules\n"
        "from embengine.torch import EmbeddingLayer, KeyedJagged\n"
        "assert ee.torch.EmbeddingLayer is EmbeddingLayer\n"
        "assert ee.torch.KeyedJagged is KeyedJagged\n"
        "try:\n"
        "    ee.no_such_name\n"
        "except AttributeError as exc:\n"
        "    print('ERR', exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert "ERR module 'embengine' has no attribute 'no_such_name'" in out.stdout


def test_python_dash_m_embengine_runs_the_cli():
    out = subprocess.run(
        [sys.executable, "-m", "embengine", "inspect", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert "--no-verify" in out.stdout


# -- metadata ------------------------------------------------------------------------------------


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_file_is_the_apache_2_text():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert "APPENDIX: How to apply the Apache License to your work." in text
    assert _pyproject()["project"]["license"] == {"text": "Apache-2.0"}


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level package -> the embengine modules importing it (anywhere in the module)."""
    std = set(sys.stdlib_module_names)
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "embengine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in std and top not in ("embengine", "__future__"):
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


# Distributions whose import name differs from their name.
IMPORT_NAMES = {"tensorflow-cpu": "tensorflow"}


def _names(requirements: list[str]) -> set[str]:
    """The import names that ``requirements`` provide."""
    names = {r.split(">")[0].split("=")[0].split("<")[0].strip() for r in requirements}
    return {IMPORT_NAMES.get(n, n) for n in names}


def test_dependencies_and_extras_match_the_imports():
    project = _pyproject()["project"]
    core = _names(project["dependencies"])
    extras = {k: _names(v) for k, v in project["optional-dependencies"].items()}
    assert core == {"numpy", "numba", "llvmlite"}
    assert "torch" in extras["torch"]
    assert {"torch", "tqdm", "matplotlib"} <= extras["train"]
    imports = _third_party_imports()
    # Installed by `make bench`, never a dependency: the benchmark reports it missing.
    imports.pop("fbgemm_gpu", None)
    declared = core | set().union(*extras.values())
    assert set(imports) <= declared, {k: v for k, v in imports.items() if k not in declared}
    # TensorFlow: an extra of its own, imported (lazily) by the TF port's interop module only.
    assert extras["tf"] == {"tensorflow"}
    assert imports.get("tensorflow", set()) <= {"embengine/tpu/tf_interop.py"}, imports
    # tqdm and matplotlib serve the training job only.
    for extra in ("tqdm", "matplotlib"):
        assert all(p.startswith("embengine/training/") for p in imports.get(extra, ())), imports
