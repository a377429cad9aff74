"""Thread settings for a process that runs numba kernels and torch ops alternately.

What we measured (docs/performance.md): numba's "omp" threading layer and torch both end up in
torch's libgomp, so the two share one OpenMP pool and do not fight by design. What does hurt is
spin-waiting: after each parallel region GOMP spins for milliseconds, and when any other process
needs a core the spinning worker steals the slice its partner needs (FBGEMM's step grew several
times over that way: docs/performance.md, "Figures behind the code"). ``OMP_WAIT_POLICY=PASSIVE``
removes that at no measurable cost on a quiet machine. It must be set before libgomp starts,
i.e. before torch is imported.
"""

from __future__ import annotations

import os
import sys


def configure_threads() -> None:
    """Set the wait policy for this process if nobody chose one (call before importing torch)."""
    if "torch" in sys.modules:
        return  # too late to change libgomp's policy; leave the user's process alone
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def describe_threads() -> str:
    import numba

    parts = [
        f"numba {numba.__version__}: {numba.get_num_threads()} threads, layer "
        f"{numba.config.THREADING_LAYER}",
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}",
    ]
    try:
        import torch

        parts.insert(1, f"torch {torch.__version__}: {torch.get_num_threads()} threads")
    except ImportError:
        pass
    return "; ".join(parts)
