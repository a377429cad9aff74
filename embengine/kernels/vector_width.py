"""The width of the vectors numba compiles the kernels for: 512 bits on AVX-512 hosts of the
kinds where 512-bit instructions cost no clock speed, 256 elsewhere.

LLVM tunes most AVX-512 CPUs with ``prefer-256-bit``: on the first of them (Skylake-SP,
Cascade Lake) 512-bit instructions lowered the clock of the whole core, so its loop vectoriser
fills 8 float32 lanes where the registers hold 16. Hosts from Ice Lake and Zen 4 on have no
such penalty, and there 512-bit kernels run W1's Adam step ~15% faster, FTRL's ~8%,
row-wise Adagrad's ~5% (docs/performance.md, "512-bit vectors"). numba has one set of CPU
features per process, fixed when it first compiles (``numba.config.CPU_FEATURES``, from
``NUMBA_CPU_FEATURES``), so ``choose`` sets it, before any kernel compiles, to the host's own
features plus ``-prefer-256-bit``: every numba function of the process, the caller's too, then
compiles for 512-bit vectors. AVX-512 VBMI2 tells those hosts apart (Ice Lake, Sapphire Rapids,
Zen 4 and later have it; Skylake-SP and Cascade Lake do not).

``EMBENGINE_VECTOR_BITS``: unset (the rule above), ``256`` (leave numba's choice), or ``512``
(wide vectors on any AVX-512 host). A process that sets ``NUMBA_CPU_NAME`` or
``NUMBA_CPU_FEATURES`` itself keeps them, and a process whose numba compiled something before
embengine was imported keeps what it compiled with (``VECTORS`` says which applies).
"""

from __future__ import annotations

import os

__all__ = ["ENV", "VECTORS", "decide", "choose"]

ENV = "EMBENGINE_VECTOR_BITS"
_PREFER_256 = "-prefer-256-bit"


def decide(environ, host_features: str | None, compiled_before: bool) -> tuple[str | None, str]:
    """(numba's CPU features to set, or None to leave them, and the kernels' vectors in words)
    for a process with these environment variables, LLVM host features (``"+avx512f,
    +avx512vbmi2,..."``; None: unknown) and whether numba compiled before (module docstring).
    A bad ``EMBENGINE_VECTOR_BITS`` is a ValueError naming it."""
    asked = environ.get(ENV, "")
    if asked not in ("", "256", "512"):
        raise ValueError(
            f"{ENV}={asked!r}: expected 256 or 512 (the width of the vectors embengine's "
            "kernels are compiled for), or unset for the host's best"
        )
    if environ.get("NUMBA_CPU_FEATURES") is not None or environ.get("NUMBA_CPU_NAME") is not None:
        return None, "numba's (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES set)"
    if asked == "256":
        return None, f"LLVM's default ({ENV}=256)"
    if host_features is None:
        return None, "LLVM's default (the CPU's features are unknown)"
    features = set(host_features.split(","))
    if "+avx512f" not in features:
        if asked == "512":
            raise ValueError(f"{ENV}=512, but this CPU has no AVX-512 (no 512-bit vectors)")
        return None, "LLVM's default (no AVX-512)"
    if asked != "512" and "+avx512vbmi2" not in features:
        return None, f"LLVM's default (256-bit on AVX-512 before Ice Lake; {ENV}=512 for 512)"
    if compiled_before:
        return None, "LLVM's default (numba compiled before embengine was imported)"
    return f"{host_features},{_PREFER_256}", "512-bit"


def choose() -> str:
    """``decide`` for this process, applied: numba's CPU features set where it says so.
    Returns the words (``VECTORS``, printed by ``embengine bench``)."""
    import llvmlite.binding as ll
    import numba
    from numba.core.registry import cpu_target

    try:
        host_features = ll.get_host_cpu_features().flatten()
    except RuntimeError:  # as numba's own: no features known to add to
        host_features = None
    compiled_before = "_toplevel_target_context" in vars(cpu_target)
    features, words = decide(os.environ, host_features, compiled_before)
    if features is not None:
        numba.config.CPU_FEATURES = features
    return words


# Decided when the kernels package is imported, before any of its kernels compiles.
VECTORS = choose()
