"""The update kernels of a registered row math (``embengine.optimizers.row_math``).

embengine's own optimizers' kernels are in ``fused.py`` (``python -m
embengine.kernels.codegen`` writes it). Another module's row math (a user's optimizer) gets the
same template rendered when it is first needed, into a module file whose name carries a hash
of its text, which holds a hash of the template and of the function's source
(``codegen.row_math_digest``): numba's on-disk cache watches only the file defining a kernel,
so an edited row math gets a new file and compiles afresh. The files
go to ``__pycache__/generated`` beside this module, or, where that is not writable, to a
per-user folder under the system's temporary directory.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from pathlib import Path

from ..optimizers import RowMath
from . import codegen

__all__ = ["Kernels", "kernels"]

# (fused_update, update_every_row or None, fixed-layout factory (DIM, NS) -> kernel, or None)
Kernels = tuple

_LOADED: dict[str, Kernels] = {}
_LOCK = threading.Lock()


def _folder() -> Path:
    """Where rendered kernel modules go (numba caches their kernels beside them)."""
    here = Path(__file__).resolve().parent / "__pycache__" / "generated"
    try:
        here.mkdir(parents=True, exist_ok=True)
        if os.access(here, os.W_OK):
            return here
    except OSError:
        pass
    there = Path(tempfile.gettempdir()) / f"embengine-kernels-{os.getuid()}"
    there.mkdir(mode=0o700, exist_ok=True)
    return there


def _load(rm: RowMath) -> Kernels:
    text = codegen.render([rm])  # its header holds the hash of the template and the source
    name = f"embengine_kernels_{rm.name}_{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    path = _folder() / f"{name}.py"
    if not path.exists():
        # Written whole under another name, then renamed: another process may be reading it.
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    fused, every_row = module.KERNELS[rm.name]
    return fused, every_row, module.FIXED_KERNELS.get(rm.name)


def kernels(rm: RowMath) -> Kernels:
    """``rm``'s (fused_update, update_every_row, fixed-layout factory): from ``fused.py`` for
    embengine's own row math, else rendered and imported on first use (see the module
    docstring). The kernels themselves compile (or load from numba's cache) on first call."""
    from . import fused

    if rm.name in fused.KERNELS and fused.ROW_MATH.get(rm.name) is rm:
        f, e = fused.KERNELS[rm.name]
        return f, e, fused.FIXED_KERNELS.get(rm.name)
    with _LOCK:
        found = _LOADED.get(rm.name)
        if found is None or found[3] is not rm:
            found = (*_load(rm), rm)
            _LOADED[rm.name] = found
    return found[:3]
