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
(wide vectors on any AVX-512 host). Left to numba: a process that sets numba's CPU name or
features itself (``NUMBA_CPU_NAME``, ``NUMBA_CPU_FEATURES``, or numba's config file), one
that turned AVX off (``NUMBA_ENABLE_AVX=0``: numba's host features, which this reads, then
have none), and one whose numba made a function before this package was first imported
(numba builds its CPU target, features and all, with the first function defined, called or
not; it warns then, since only the order of the caller's code kept the wider vectors).
``VECTORS`` says which applies.
"""

from __future__ import annotations

import os
import warnings

__all__ = ["ENV", "VECTORS", "decide", "choose"]

ENV = "EMBENGINE_VECTOR_BITS"
_PREFER_256 = "-prefer-256-bit"
_MADE_BEFORE = "LLVM's default (a numba function was made before embengine's kernels)"


def decide(
    asked: str, numba_cpu_set: bool, host_features: str, target_made: bool
) -> tuple[str | None, str]:
    """(numba's CPU features to set, or None to leave them, and the kernels' vectors in words)
    for ``EMBENGINE_VECTOR_BITS`` = ``asked`` ("" when unset), numba's CPU name or features set
    by the user or not, numba's host features (``"+avx512f,+avx512vbmi2,..."``; "" when
    unknown) and whether numba's CPU target was made already (module docstring). A bad
    ``asked`` is a ValueError naming it."""
    if asked not in ("", "256", "512"):
        raise ValueError(
            f"{ENV}={asked!r}: expected 256 or 512 (the width of the vectors embengine's "
            "kernels are compiled for), or unset for the host's best"
        )
    if numba_cpu_set:
        return None, "numba's own (its CPU name or features set: NUMBA_CPU_NAME / _FEATURES)"
    if asked == "256":
        return None, f"LLVM's default ({ENV}=256)"
    if not host_features:
        return None, "LLVM's default (the CPU's features are unknown)"
    features = set(host_features.split(","))
    if "+avx512f" not in features:
        if asked == "512":
            raise ValueError(
                f"{ENV}=512, but this CPU has no AVX-512 (or NUMBA_ENABLE_AVX=0 turned it off)"
            )
        return None, "LLVM's default (no AVX-512, or NUMBA_ENABLE_AVX=0)"
    if asked != "512" and "+avx512vbmi2" not in features:
        return None, f"LLVM's default (256-bit on AVX-512 before Ice Lake; {ENV}=512 for 512)"
    if target_made:
        return None, _MADE_BEFORE
    return f"{host_features},{_PREFER_256}", "512-bit"


def choose() -> str:
    """``decide`` for this process, applied: numba's CPU features set where it says so.
    Returns the words (``VECTORS``, printed by ``embengine bench``)."""
    import numba
    from numba.core.codegen import get_host_cpu_features
    from numba.core.registry import cpu_target

    asked = os.environ.get(ENV, "")
    host = get_host_cpu_features()  # numba's: "" if unknown, AVX off under NUMBA_ENABLE_AVX=0
    features, words = decide(
        asked,
        numba.config.CPU_NAME is not None or numba.config.CPU_FEATURES is not None,
        host,
        "_toplevel_target_context" in vars(cpu_target),
    )
    if features is not None:
        numba.config.CPU_FEATURES = features
    elif words == _MADE_BEFORE:  # 512-bit vectors were due here
        warnings.warn(
            "a numba function was made before embengine's kernels were first imported, and "
            "numba fixes its CPU features with its first function: the kernels compile for "
            "256-bit vectors on this host, where 512-bit ones run them faster (W1's Adam "
            "step ~15%). Create the engine (or import embengine.kernels) before defining "
            f"numba functions, or set {ENV}=256 to keep 256 bits without this warning",
            stacklevel=2,
        )
    return words


# Decided when the kernels package is imported, before any of its kernels compiles.
VECTORS = choose()
