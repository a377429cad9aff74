"""No committed generated code; one digest of embengine/kernels keys numba's cache.

- the update kernels are rendered when first needed into a cache folder (kernels/row_math.py):
  written atomically, rewritten if damaged, elsewhere when the install is read-only;
- every kernel's numba cache is stamped with the digest of the whole kernels folder
  (kernels/cache_stamp.py): in a copy of the package, editing a helper a kernel calls makes
  it compile again, and an unchanged tree loads it from the cache.

Processes run with hard timeouts on a fresh NUMBA_CACHE_DIR.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 300  # seconds for any one child (it compiles one small kernel at most)


def _copy_package(dest: Path) -> Path:
    """A copy of the embengine package under ``dest`` (no caches, no generated files)."""
    shutil.copytree(
        REPO / "embengine", dest / "embengine", ignore=shutil.ignore_patterns("__pycache__")
    )
    return dest


def _run(script: str, root: Path, env: dict, prefix: tuple = ()) -> dict:
    """Run ``script`` with the package at ``root`` first on the path; its last stdout line,
    parsed as JSON."""
    env = {**os.environ, **env, "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [*prefix, sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


# -- nothing generated is committed ----------------------------------------------------------


def test_no_generated_kernel_file_is_in_git():
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "embengine/kernels"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert "embengine/kernels/codegen.py" in listed
    generated = [p for p in listed if "GENERATED" in (REPO / p).read_text().split("\n", 1)[0]]
    assert not generated and "embengine/kernels/fused.py" not in listed, generated
    hash_lines = [p for p in listed if "Callees' hash" in (REPO / p).read_text()]
    assert not hash_lines, hash_lines


# -- the digest --------------------------------------------------------------------------------


def test_the_digest_covers_every_module_of_the_kernels_folder_and_nothing_else(tmp_path):
    from embengine.kernels import cache_stamp

    folder = _copy_package(tmp_path)
    kernels = folder / "embengine" / "kernels"
    assert cache_stamp.folder_digest(kernels) == cache_stamp.digest()
    before = cache_stamp.folder_digest(kernels)
    # A new kernel module needs no registration: it is in the digest by being there.
    (kernels / "shard_route.py").write_text("X = 1\n")
    after_new = cache_stamp.folder_digest(kernels)
    assert after_new != before
    with open(kernels / "_intrinsics.py", "a") as f:
        f.write("# a changed helper file\n")
    assert cache_stamp.folder_digest(kernels) != after_new
    changed = cache_stamp.folder_digest(kernels)
    # Caches and generated modules, and files outside the folder, are not the kernels' code.
    (kernels / "__pycache__" / "generated").mkdir(parents=True)
    (kernels / "__pycache__" / "generated" / "embengine_kernels_x_0.py").write_text("Y = 2\n")
    (folder / "embengine" / "spec.py").write_text("# elsewhere\n")
    assert cache_stamp.folder_digest(kernels) == changed


def test_every_kernel_is_stamped_with_the_digest_the_generated_ones_too():
    from embengine.kernels import cache_stamp, pipeline, row_math
    from embengine.optimizers._row_math import ROW_MATH

    fused, every_row, fixed = row_math.kernels(ROW_MATH["adam"])
    for disp in (pipeline.balanced_tasks, fused, every_row, fixed(8, 2)):
        stamp = disp._cache._cache._cache_file._source_stamp  # the index's stamp (numba 0.68)
        assert isinstance(disp._cache._cache, cache_stamp.StampedCache)
        assert stamp[1] == cache_stamp.digest() and len(stamp[1]) == 64, disp


# The kernel observed: prepare._dedup, which inlines _intrinsics.prefetch_line. Compiled for one
# signature; prints whether it came from numba's cache.
DEDUP = """
import json
from numba import types
from embengine.kernels import prepare

prepare._dedup.compile((types.int64[::1],) * 6)
stats = prepare._dedup.stats
print(json.dumps({"hits": sum(stats.cache_hits.values()),
                  "misses": sum(stats.cache_misses.values())}))
"""


def test_editing_a_called_helper_recompiles_the_kernels_that_use_it(tmp_path):
    """numba's own cache key is the defining file (prepare.py): without the folder's digest
    the kernel kept the old code of a helper edited in another file (_intrinsics.py)."""
    root = _copy_package(tmp_path / "pkg")
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    assert _run(DEDUP, root, env) == {"hits": 0, "misses": 1}  # a fresh cache: compiled
    assert _run(DEDUP, root, env) == {"hits": 1, "misses": 0}  # unchanged: loaded
    # Outside the kernels folder: not the kernels' code, still loaded.
    with open(root / "embengine" / "spec.py", "a") as f:
        f.write("\n# an unrelated edit\n")
    assert _run(DEDUP, root, env) == {"hits": 1, "misses": 0}
    # The helper the kernel inlines, in another file: prefetch with locality 2, not 3.
    helper = root / "embengine" / "kernels" / "_intrinsics.py"
    text = helper.read_text()
    assert text.count("ir.Constant(i32, 3)") == 1
    helper.write_text(text.replace("ir.Constant(i32, 3)", "ir.Constant(i32, 2)"))
    assert _run(DEDUP, root, env) == {"hits": 0, "misses": 1}  # compiled again
    assert _run(DEDUP, root, env) == {"hits": 1, "misses": 0}  # and cached again


def test_a_numba_that_differs_is_an_import_error_naming_its_version(monkeypatch):
    import numba
    from numba.core import caching

    from embengine.kernels import cache_stamp

    cache_stamp._check_numba()  # the installed numba is what the module extends
    monkeypatch.setattr(caching.FunctionCache, "_impl_class", caching.CodeLibraryCacheImpl)
    with pytest.raises(ImportError, match=re.escape(f"numba {numba.__version__} is not")):
        cache_stamp._check_numba()


def test_stamped_replaces_only_numbas_own_caches():
    import numba
    from numba.core import caching

    from embengine.kernels.cache_stamp import StampedCache, stamped

    for cache in (False, True):  # numba's NullCache, its FunctionCache
        disp = numba.njit(cache=cache)(lambda x: x + 1)
        assert isinstance(stamped(disp)._cache, StampedCache)
    disp._cache = caching.make_library_cache("x")(disp.py_func)
    with pytest.raises(TypeError, match="is not a numba function dispatcher with no cache or"):
        stamped(disp)


# -- the rendered modules ----------------------------------------------------------------------


@pytest.fixture
def generated(tmp_path, monkeypatch):
    """Rendered modules go to tmp_path / "gen" (not the tree's folder other tests share)."""
    from embengine.kernels import row_math

    folder = tmp_path / "gen"
    monkeypatch.setattr(row_math, "candidates", lambda: [folder])
    return folder


def test_a_damaged_rendered_module_is_rewritten(generated):
    from embengine.kernels import row_math
    from embengine.optimizers._row_math import ROW_MATH

    rm = ROW_MATH["sgd"]
    name, path, text = row_math.module_path(rm)
    assert path.parent == generated and path.name == f"{name}.py"
    path.write_text(text[: len(text) // 2])  # half a module (an old non-atomic writer's)
    fused, _, _ = row_math._load(rm)
    assert path.read_text() == text and fused.py_func.__code__.co_filename == str(path)
    assert [p.name for p in generated.iterdir() if p.suffix != ".py"] == ["__pycache__"]


def test_modules_of_other_digests_are_pruned_when_a_new_one_is_written(generated, monkeypatch):
    """Writing adam's module removes adam's modules of other digests unused for
    PRUNE_AFTER_SECONDS, with their caches; a recent one (a process may be importing it) and
    other row maths' modules stay."""
    import time

    from embengine.kernels import row_math
    from embengine.optimizers._row_math import ROW_MATH

    rm = ROW_MATH["adam"]
    _, path, _ = row_math.module_path(rm)
    cache = generated / "__pycache__"
    cache.mkdir(parents=True)
    old = time.time() - 2 * row_math.PRUNE_AFTER_SECONDS

    def module(stem: str, unused: bool) -> list[Path]:
        """A module file and its cache entries (numba's index and data, Python's bytecode)."""
        files = [
            generated / f"{stem}.py",
            cache / f"{stem}.fused_update_adam-51.py311.nbi",
            cache / f"{stem}.fused_update_adam-51.py311.1.nbc",
            cache / f"{stem}.cpython-311.pyc",
        ]
        for f in files:
            f.write_text("KERNELS = {}\n")
            if unused:
                os.utime(f, (old, old))
        return files

    stale = module("embengine_kernels_adam_" + "0" * 16, unused=True)
    recent = module("embengine_kernels_adam_" + "1" * 16, unused=False)
    other = module("embengine_kernels_adam_bias_" + "2" * 16, unused=True)  # not adam's
    row_math._load(rm)
    assert path.exists()
    assert not any(f.exists() for f in stale)
    assert all(f.exists() for f in recent + other)

    # Loading an existing module marks it in use: a process of other code, writing its own
    # adam module, keeps it.
    os.utime(path, (old, old))
    row_math._load(rm)
    assert (
        row_math.prune("adam", generated / f"embengine_kernels_adam_{'3' * 16}.py", [cache]) == []
    )
    assert path.exists()

    # A module pruned between this process's check and its import is written again.
    def pruned_after_the_check(p, text):
        p.unlink()
        return True

    monkeypatch.setattr(row_math, "_current", pruned_after_the_check)
    fused, _, _ = row_math._load(rm)
    assert path.exists() and fused.py_func.__code__.co_filename == str(path)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    from embengine.kernels.row_math import write_atomically

    path = tmp_path / "m.py"
    write_atomically(path, "A = 1\n")
    with pytest.raises(UnicodeEncodeError):
        write_atomically(path, "B = 2\n" * 1000 + "\ud800")  # fails part way through
    assert path.read_text() == "A = 1\n" and os.listdir(tmp_path) == ["m.py"]


# Writes the rendered module of sgd into argv[1], but is SIGKILLed after writing all of it to
# the temporary file and before renaming it.
KILLED_WRITER = """
import os, signal, sys
from pathlib import Path
from embengine.kernels import row_math
from embengine.optimizers._row_math import ROW_MATH

row_math.candidates = lambda: [Path(sys.argv[1])]
os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
row_math.kernels(ROW_MATH["sgd"])
"""

LOAD = """
import json, sys
from pathlib import Path
from embengine.kernels import row_math
from embengine.optimizers._row_math import ROW_MATH

row_math.candidates = lambda: [Path(sys.argv[1])]
fused = row_math.kernels(ROW_MATH["sgd"])[0]
print(json.dumps({"file": fused.py_func.__code__.co_filename}))
"""


def test_a_writer_killed_mid_write_leaves_no_module_and_the_next_process_writes_it(tmp_path):
    folder = tmp_path / "gen"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_WRITER, str(folder)],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not list(folder.glob("*.py"))  # only the abandoned temporary file
    assert [p.suffix for p in folder.iterdir()] == [".tmp"]
    out = subprocess.run(
        [sys.executable, "-c", LOAD, str(folder)],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    path = Path(json.loads(out.stdout.splitlines()[-1])["file"])
    assert path.parent == folder and path.read_text().startswith('"""GENERATED from the template')


# In a read-only install: where the sgd module and a small kernel's numba cache went.
READ_ONLY = """
import json
import numpy as np
from embengine.kernels import pipeline, row_math
from embengine.optimizers._row_math import ROW_MATH

fused = row_math.kernels(ROW_MATH["sgd"])[0]
pipeline.balanced_tasks(np.array([0, 2, 5], dtype=np.int64))
stats = pipeline.balanced_tasks.stats
print(json.dumps({"module": fused.py_func.__code__.co_filename, "cache": stats.cache_path,
                  "misses": sum(stats.cache_misses.values())}))
"""


def _read_only_prefix(root: Path) -> tuple:
    """The command prefix that runs a child with ``root`` read-only: ``chmod -R a-w`` for a
    normal user; for root, whom modes do not stop, a read-only bind mount in a private mount
    namespace (skipped where that is not allowed)."""
    if os.geteuid() != 0:
        subprocess.run(["chmod", "-R", "a-w", str(root)], check=True)
        return ()
    prefix = (
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        'mount --bind -o ro "$0" "$0" && exec "$@"',
        str(root),
    )
    probe = subprocess.run(
        [*prefix, "sh", "-c", f'! touch "{root}/probe" 2>/dev/null'],
        capture_output=True,
        timeout=60,
    )
    if probe.returncode != 0 or (root / "probe").exists():
        pytest.skip("running as root, and no read-only bind mount here (unshare -m)")
    return prefix


def test_a_read_only_install_renders_into_numbas_or_the_users_cache_folder(tmp_path):
    root = _copy_package(tmp_path / "pkg")
    prefix = _read_only_prefix(root)
    try:
        numba_dir, xdg = tmp_path / "numba", tmp_path / "xdg"
        env = {"NUMBA_CACHE_DIR": str(numba_dir), "XDG_CACHE_HOME": str(xdg)}
        out = _run(READ_ONLY, root, env, prefix)
        assert Path(out["module"]).parent == numba_dir / "embengine-generated", out
        assert Path(out["cache"]).is_relative_to(numba_dir) and out["misses"] == 1, out
        # Without NUMBA_CACHE_DIR: the user's cache folder (numba's own goes there too).
        env = {"NUMBA_CACHE_DIR": "", "XDG_CACHE_HOME": str(xdg)}
        out = _run(READ_ONLY, root, env, prefix)
        assert Path(out["module"]).parent == xdg / "embengine" / "generated", out
        assert Path(out["cache"]).is_relative_to(xdg) and out["misses"] == 1, out
        assert not list((root / "embengine").rglob("__pycache__"))  # nothing written there
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(root)], check=True)
