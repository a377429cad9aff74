"""The update kernels of a registered row math (``embengine.optimizers.row_math``).

No generated code is committed: every row math, embengine's own and a user's, gets the template
of ``codegen.py`` rendered when its kernels are first needed, into a module file named
``embengine_kernels_<name>_<hash>.py``, the hash that of its text, which holds the template's
output and a hash of the row math's source (``codegen.row_math_digest``). An edited row math
or template so gets a new file, and numba's cache of the kernels (stamped with their file and
the kernels folder's digest, ``cache_stamp``) compiles afresh. Rendering per row math, on first
use, keeps ``import embengine`` from building modules an engine may never use.

The file is written whole under a temporary name, then renamed (``os.replace``): a process
that reads it, or one killed while writing it, never leaves or sees half a module. An existing
file of that name is used if it holds exactly the text, rewritten otherwise. The folder
(``folder()``) is the first writable of: ``__pycache__/generated`` beside this module; for a
read-only install, ``embengine-generated`` in numba's cache folder (``NUMBA_CACHE_DIR``) if one
is set, the user's cache folder (``$XDG_CACHE_HOME`` or ``~/.cache``)
``/embengine/generated``, and a per-user folder under the system's temporary directory.

Files of older digests do not pile up: when a process writes a row math's module, it removes
that row math's modules of other digests, with their compiled caches, that no process has
loaded for ``PRUNE_AFTER_SECONDS`` (``prune``). Every load refreshes its file's modification
time, so a process still running older code keeps its file; one that loses it to a pruning
process between its check and its import writes it again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..optimizers import RowMath
from . import codegen

__all__ = [
    "Kernels",
    "PRUNE_AFTER_SECONDS",
    "fixed_half_kernels",
    "folder",
    "half_kernels",
    "kernels",
    "prune",
]

# (fused_update, update_every_row or None, fixed-layout factory (DIM, NS) -> kernel, or None)
Kernels = tuple

_LOADED: dict[str, tuple] = {}
_LOCK = threading.Lock()

# A module of another digest is removed once unused for this long: longer than any process
# takes from checking its file to importing it, short enough that edits do not pile up files.
PRUNE_AFTER_SECONDS = 600.0


def _writable(path: Path) -> bool:
    """Whether files can be made in ``path`` (made if missing): tried, not judged by mode bits
    (a read-only mount refuses even root)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
        return True
    except OSError:
        return False


def candidates() -> list[Path]:
    """The folders rendered modules may go to, in order of preference (module docstring)."""
    import numba

    found = [Path(__file__).resolve().parent / "__pycache__" / "generated"]
    if numba.config.CACHE_DIR:
        found.append(Path(numba.config.CACHE_DIR) / "embengine-generated")
    user_cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    found.append(Path(user_cache) / "embengine" / "generated")
    found.append(Path(tempfile.gettempdir()) / f"embengine-generated-{os.getuid()}")
    return found


def folder() -> Path:
    """The first writable folder of ``candidates()``; OSError naming them if none is."""
    tried = candidates()
    for path in tried:
        if _writable(path):
            return path
    raise OSError(
        "embengine cannot write its generated kernels to any of "
        f"{', '.join(map(str, tried))}; make one writable, or set NUMBA_CACHE_DIR to a "
        "writable folder"
    )


def write_atomically(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole, or is left as it was: written to a temporary file in its
    folder, flushed to disk, then renamed over it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _current(path: Path, text: str) -> bool:
    try:
        return path.read_text(encoding="utf-8") == text
    except (OSError, UnicodeDecodeError):
        return False


def module_path(rm: RowMath) -> tuple[str, Path, str]:
    """(module name, file, text) of ``rm``'s rendered kernels module."""
    text = codegen.render([rm])
    name = f"embengine_kernels_{rm.name}_{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    return name, folder() / f"{name}.py", text


def _import(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def prune(rm_name: str, keep: Path, cache_dirs, max_age: float = PRUNE_AFTER_SECONDS) -> list[Path]:
    """Remove the rendered modules of row math ``rm_name`` in ``keep``'s folder other than
    ``keep`` whose file is older than ``max_age`` seconds (not loaded since, see ``_load``),
    and their caches: files ``<module>.*`` in ``cache_dirs`` (numba's index and data, Python's
    bytecode; numba reads a missing entry as a cache miss). Errors are ignored: another process
    may prune, write or load the same files at once. Returns the modules removed."""
    own = re.compile(rf"embengine_kernels_{re.escape(rm_name)}_[0-9a-f]{{16}}\.py")
    now = time.time()
    removed = []
    try:
        entries = list(keep.parent.iterdir())
    except OSError:
        return removed
    for path in entries:
        if path.name == keep.name or not own.fullmatch(path.name):
            continue
        try:
            if now - path.stat().st_mtime <= max_age:
                continue
            path.unlink()
        except OSError:
            continue
        removed.append(path)
        for cache_dir in cache_dirs:
            try:
                stale = list(Path(cache_dir).glob(f"{path.stem}.*"))
            except OSError:
                continue
            for f in stale:
                try:
                    f.unlink()
                except OSError:
                    pass
    return removed


def _load(rm: RowMath) -> Kernels:
    """(fused_update, update_every_row, fixed-layout factory) of ``rm``'s module, rendered and
    imported afresh."""
    return _load_all(rm)[:3]


def _load_all(rm: RowMath) -> tuple:
    """``_load``'s kernels, then the half kernels of 16-bit tables."""
    name, path, text = module_path(rm)
    written = not _current(path, text)
    if written:
        write_atomically(path, text)
    else:
        try:
            os.utime(path)  # in use: not prunable for PRUNE_AFTER_SECONDS
        except OSError:
            pass
    try:
        module = _import(name, path)
    except FileNotFoundError:  # pruned by another process since the check above
        write_atomically(path, text)
        module = _import(name, path)
    fused, every_row = module.KERNELS[rm.name]
    if written:
        caches = {path.parent / "__pycache__"}
        try:
            caches.add(Path(fused.stats.cache_path))
        except (AttributeError, TypeError):  # no numba cache (caching disabled)
            pass
        prune(rm.name, path, caches)
    return (
        fused,
        every_row,
        module.FIXED_KERNELS.get(rm.name),
        module.HALF_KERNELS[rm.name],
        module.FIXED_HALF_KERNELS[rm.name],
    )


def _loaded(rm: RowMath) -> tuple:
    with _LOCK:
        found = _LOADED.get(rm.name)
        if found is None or found[-1] is not rm:
            found = (*_load_all(rm), rm)
            _LOADED[rm.name] = found
    return found


def kernels(rm: RowMath) -> Kernels:
    """``rm``'s (fused_update, update_every_row, fixed-layout factory), rendered and imported
    on first use (see the module docstring). The kernels themselves compile (or load from
    numba's cache) on their first call."""
    return _loaded(rm)[:3]


def half_kernels(rm: RowMath) -> dict:
    """``rm``'s kernels for tables with 16-bit columns (codegen's HALF_UPDATE), from the same
    rendered module as ``kernels``: {(weights kind, slots kind): (fused_update,
    update_every_row)}, kinds as ``precision.KIND`` (slots F32 for a row math without float
    slots; ``codegen.half_pairs``)."""
    return _loaded(rm)[3]


def fixed_half_kernels(rm: RowMath) -> dict:
    """``rm``'s factories of the fused update of 16-bit tables for one row layout (codegen's
    FIXED_HALF_KERNEL): {(weights kind, slots kind): factory of ``(dim, f0, n0, f1, n1, f2,
    n2)``}, kinds as ``half_kernels``."""
    return _loaded(rm)[4]
