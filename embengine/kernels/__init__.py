"""numba kernels: dedup, gather + combine, and the fused per-row update.

Every kernel is compiled once per process type signature and cached on disk (``cache=True``),
the cache valid while no file of this folder changes (``cache_stamp``);
the arrays they take have fixed dtypes (int64 indices, float32 tables), so each kernel has one
specialisation whatever the optimizer, combiner or table shape. The exceptions are the kernels
for common row widths (FIXED_DIMS): pooling, and the fused updates of rows laid out as weights
then full-width slots, compiled with the width a constant (each on first use), and the fused
updates of long 16-bit rows (HALF_FIXED_DIMS), compiled for their row layout.
"""

# Row widths with kernels of their own (lookup.pool_kernel, numba_backend.fixed_layout). The
# small ones serve packed and other low-dimensional tables, whose steps they make faster than
# the any-layout kernels do (W2: docs/performance.md, "Figures behind the code").
FIXED_DIMS = (1, 2, 4, 8, 16, 32, 64, 128)
# Row widths whose 16-bit tables get a fused update compiled for their row layout
# (numba_backend.half_layout): a kernel per row math, dtype pair and layout, so only where a
# row is long enough to pay for it (docs/performance.md, "16-bit update kernels").
HALF_FIXED_DIMS = (32, 64, 128)

# The vectors every kernel compiles for (512-bit on the AVX-512 hosts where they pay), chosen
# now, before any kernel of the package compiles: numba fixes them at its first compile.
from .vector_width import VECTORS  # noqa: E402, F401

# error_model="numpy": division by zero gives inf/nan like NumPy instead of a checked branch.
# fastmath: only the flags that let LLVM vectorise sums and fuse multiply-adds; none that assumes
# finite values ("nnan", "ninf"), since the skip_row policy looks for NaN / Inf.
NUMBA_OPTIONS = dict(
    cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "contract", "arcp"}
)


def kernel(**options):
    """``numba.njit(**NUMBA_OPTIONS, **options)`` with the dispatcher's on-disk cache stamped
    with the digest of this folder (``cache_stamp``) and under a cross-process lock
    (``compile_lock``): every kernel of embengine is made with it. ``options`` override
    NUMBA_OPTIONS (e.g. ``fastmath=False``)."""
    import numba

    from .cache_stamp import stamped
    from .compile_lock import locked

    def decorate(py_func):
        opts = dict(NUMBA_OPTIONS, **options)
        # Made without numba's own cache (cache=True would build a FunctionCache to replace).
        disp = numba.njit(**dict(opts, cache=False))(py_func)
        return locked(stamped(disp) if opts["cache"] else disp)

    return decorate
