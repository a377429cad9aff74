"""The vectors numba compiles the kernels for (kernels/vector_width.py): 512-bit on AVX-512 hosts
with VBMI2 unless told otherwise, chosen before any kernel compiles."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from embengine.kernels.vector_width import ENV, decide

WIDE = "+sse2,+avx2,+avx512f,+avx512vbmi2"  # Ice Lake, Sapphire Rapids, Zen 4
SKYLAKE = "+sse2,+avx2,+avx512f,-avx512vbmi2"
AVX2 = "+sse2,+avx2,-avx512f"


def test_wide_vectors_on_avx512_hosts_with_vbmi2_only():
    features, words = decide("", False, WIDE, target_made=False)
    assert features == WIDE + ",-prefer-256-bit" and words == "512-bit"
    assert decide("", False, SKYLAKE, False)[0] is None  # LLVM's tuning for these hosts stands
    assert decide("", False, AVX2, False) == (
        None,
        "LLVM's default (no AVX-512, or NUMBA_ENABLE_AVX=0)",
    )
    assert decide("", False, "", False)[0] is None  # features unknown: nothing to add to


def test_the_setting_chooses_or_keeps_numbas_own():
    assert decide("256", False, WIDE, False) == (None, f"LLVM's default ({ENV}=256)")
    assert decide("512", False, SKYLAKE, False)[0] == SKYLAKE + ",-prefer-256-bit"
    # numba's CPU name or features set by the user (environment or numba's config file)
    assert decide("", True, WIDE, False)[0] is None
    assert decide("512", True, WIDE, False)[0] is None
    # numba made its CPU target (and fixed its features) with its first function
    assert decide("", False, WIDE, target_made=True) == (
        None,
        "LLVM's default (a numba function was made before embengine's kernels)",
    )


@pytest.mark.parametrize("value", ["1024", "wide", " 512"])
def test_a_bad_setting_is_an_error_naming_it(value):
    with pytest.raises(ValueError, match=f"{ENV}='{value}': expected 256 or 512"):
        decide(value, False, WIDE, False)


def test_512_on_a_host_without_avx512_is_an_error():
    with pytest.raises(ValueError, match="no AVX-512"):
        decide("512", False, AVX2, False)


# A fresh process: what it chose, numba's features, and whether a loop over rows of 64 floats,
# compiled with the kernels' options, uses 512-bit registers.
PROBE = textwrap.dedent(
    """
    import sys
    if sys.argv[1] == "numba-first":  # a function of the user's, defined (not called) first
        import numba
        numba.njit(lambda x: x + 1)
    import numba
    import numpy as np
    from embengine.kernels import NUMBA_OPTIONS, VECTORS

    @numba.njit(**dict(NUMBA_OPTIONS, cache=False))  # as kernel() compiles, without the disk
    def axpy(a, b, n):
        for r in range(n):
            for j in range(64):
                a[r, j] += np.float32(2.0) * b[r, j]

    a = np.ones((4, 64), dtype=np.float32)
    axpy(a, a, 4)
    asm = "".join(axpy.inspect_asm().values())
    print(VECTORS)
    print(numba.config.CPU_FEATURES is not None and
          numba.config.CPU_FEATURES.endswith(",-prefer-256-bit"))
    print("zmm" in asm)
    """
)


def _probe(mode: str, *, stderr: list | None = None, **env) -> list[str]:
    unset = (ENV, "NUMBA_CPU_FEATURES", "NUMBA_CPU_NAME", "NUMBA_ENABLE_AVX")
    environ = {k: v for k, v in os.environ.items() if k not in unset}
    environ.update(env)
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        env=environ,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    if stderr is not None:
        stderr.append(done.stderr)
    return done.stdout.split("\n")[:3]


def _host_wide() -> bool:
    import llvmlite.binding as ll

    features = set(ll.get_host_cpu_features().flatten().split(","))
    return {"+avx512f", "+avx512vbmi2"} <= features


def test_a_process_compiles_its_kernels_as_chosen():
    """On this host: 512-bit registers in the kernel's loop iff chosen (this test was written
    on an AVX-512 VBMI2 host, where it checks both ways)."""
    words, set_, zmm = _probe("plain")
    if _host_wide():
        assert (words, set_, zmm) == ("512-bit", "True", "True")
        assert _probe("plain", **{ENV: "256"}) == [f"LLVM's default ({ENV}=256)", "False", "False"]
        # AVX turned off for numba stays off (its host features have none)
        off = _probe("plain", NUMBA_ENABLE_AVX="0")
        assert off == ["LLVM's default (no AVX-512, or NUMBA_ENABLE_AVX=0)", "False", "False"]
    else:
        assert (set_, zmm) == ("False", "False") and words.startswith("LLVM's default")


def test_numba_compiling_first_keeps_its_features_and_says_so():
    """numba fixes its features with its first function: one defined before the kernels load
    keeps 256-bit vectors, and where 512 were due the import warns (not with the 256 asked)."""
    said: list[str] = []
    words, set_, _ = _probe("numba-first", stderr=said)
    assert set_ == "False"
    if _host_wide():
        assert words == "LLVM's default (a numba function was made before embengine's kernels)"
        assert "a numba function was made before embengine's kernels" in said[0]
        quiet: list[str] = []
        assert _probe("numba-first", stderr=quiet, **{ENV: "256"})[0] == (
            f"LLVM's default ({ENV}=256)"
        )
        assert "numba function was made" not in quiet[0]
    else:
        assert words.startswith("LLVM's default") and "numba function was made" not in said[0]
