"""Low-level helpers numba does not expose: software prefetch of a table row, and scratch rows
on the stack.

Random rows of a large table come from DRAM; the loops over touched rows are short enough that
the CPU does not run ahead to the next row's loads on its own, so the kernels prefetch the row
they will need a few iterations later.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.arrayobj import populate_array

from . import kernel

# Elements of a float32 / int32 row per 64-byte cache line.
LINE = 16


def _make_prefetch(write: int):
    @intrinsic
    def prefetch(typingctx, arr, row, col):
        """``llvm.prefetch`` of the cache line holding ``arr[row, col]``."""

        def codegen(context, builder, sig, args):
            aryty = sig.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            ptr = cgutils.get_item_pointer2(
                context,
                builder,
                data=ary.data,
                shape=cgutils.unpack_tuple(builder, ary.shape),
                strides=cgutils.unpack_tuple(builder, ary.strides),
                layout=aryty.layout,
                inds=[args[1], args[2]],
                wraparound=False,
                boundscheck=False,
            )
            i8p = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
            # (address, read 0 / write 1, locality 3 = keep in all levels, data cache)
            builder.call(
                fn,
                [
                    builder.bitcast(ptr, i8p),
                    ir.Constant(i32, write),
                    ir.Constant(i32, 3),
                    ir.Constant(i32, 1),
                ],
            )
            return context.get_dummy_value()

        return types.void(arr, types.intp, types.intp), codegen

    return prefetch


prefetch_line = _make_prefetch(0)  # prefetch_line(arr, i, j): the line of arr[i, j], to read
_prefetch_write = _make_prefetch(1)


@kernel(inline="always")
def prefetch_row(arr, row, width):
    """Prefetch ``arr[row, :width]`` for reading (a 2-D C-contiguous 4-byte array)."""
    for col in range(0, width, LINE):
        prefetch_line(arr, row, col)
    prefetch_line(arr, row, width - 1)  # rows need not start on a line boundary


@kernel(inline="always")
def prefetch_row_for_write(arr, row, width):
    """Prefetch ``arr[row, :width]`` with the intent to write it."""
    for col in range(0, width, LINE):
        _prefetch_write(arr, row, col)
    _prefetch_write(arr, row, width - 1)


@intrinsic(prefer_literal=True)
def stack_row(typingctx, n):
    """A float32 array of ``n`` elements (a compile-time constant) on the stack, uninitialised.

    A heap array's stores cannot be moved out of a loop that also loads table rows (LLVM cannot
    rule out that the two alias), so a sum built in one is stored after every row; a fixed-size
    stack array is promoted to registers. Only for use inside the function that creates it."""
    if not isinstance(n, types.IntegerLiteral) or n.literal_value < 1:
        return None
    size = n.literal_value
    aryty = types.Array(types.float32, 1, "C")

    def codegen(context, builder, sig, args):
        ptr = cgutils.alloca_once(builder, ir.FloatType(), size=size)  # in the entry block
        ary = context.make_array(aryty)(context, builder)
        intp = context.get_value_type(types.intp)
        populate_array(
            ary,
            data=ptr,
            shape=[ir.Constant(intp, size)],
            strides=[ir.Constant(intp, 4)],
            itemsize=ir.Constant(intp, 4),
            meminfo=None,
        )
        return ary._getvalue()

    return aryty(n), codegen


@intrinsic
def fetch_add(typingctx, arr, i, value):
    """Atomically ``old = arr[i]; arr[i] += value; return old`` on a 1-D int64 array.

    A shared task counter: numba's prange hands each thread a fixed share of the iterations
    (``parallel_chunksize`` does not change that under the omp layer, measured), so kernels
    whose tasks differ widely in cost claim them one at a time from a counter instead."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = cgutils.get_item_pointer2(
            context,
            builder,
            data=ary.data,
            shape=cgutils.unpack_tuple(builder, ary.shape),
            strides=cgutils.unpack_tuple(builder, ary.strides),
            layout=sig.args[0].layout,
            inds=[args[1]],
            wraparound=False,
            boundscheck=False,
        )
        return builder.atomic_rmw("add", ptr, args[2], "seq_cst")

    return types.int64(arr, types.intp, types.int64), codegen


def _make_rows_at(dtype, llvm_type, itemsize: int):
    @intrinsic
    def rows_at(typingctx, address, rows, cols):
        """A C-contiguous ``[rows, cols]`` view of the memory at ``address`` (an int64).

        Lets one kernel reach several tables of different widths, whose arrays a numba list
        would hand over only with a reference count per access. No ownership: the caller keeps
        the memory alive for the call (the engine holds its tables; outputs are allocated
        before the call)."""
        aryty = types.Array(dtype, 2, "C")

        def codegen(context, builder, sig, args):
            intp = context.get_value_type(types.intp)
            ptr = builder.inttoptr(args[0], llvm_type.as_pointer())
            ary = context.make_array(aryty)(context, builder)
            stride = builder.mul(args[2], ir.Constant(intp, itemsize))
            populate_array(
                ary,
                data=ptr,
                shape=[args[1], args[2]],
                strides=[stride, ir.Constant(intp, itemsize)],
                itemsize=ir.Constant(intp, itemsize),
                meminfo=None,
            )
            return ary._getvalue()

        return aryty(types.int64, types.intp, types.intp), codegen

    return rows_at


@intrinsic
def readonly_int64_at(typingctx, address, n):
    """A read-only ``[n]`` int64 view of the memory at ``address`` (an int64): the type of a
    slice of a frozen array (``inputs.frozen``), so that a kernel given a feature's ids by
    address compiles as for the same ids concatenated into one array. No ownership, as
    ``rows_at``."""
    aryty = types.Array(types.int64, 1, "C", readonly=True)

    def codegen(context, builder, sig, args):
        intp = context.get_value_type(types.intp)
        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        ary = context.make_array(aryty)(context, builder)
        populate_array(
            ary,
            data=ptr,
            shape=[args[1]],
            strides=[ir.Constant(intp, 8)],
            itemsize=ir.Constant(intp, 8),
            meminfo=None,
        )
        return ary._getvalue()

    return aryty(types.int64, types.intp), codegen


# float32_rows_at(address, rows, cols): a table's rows, an activation matrix.
float32_rows_at = _make_rows_at(types.float32, ir.FloatType(), 4)
# int64_rows_at(address, rows, cols): a keyed table's keys by row (kernels/keyed_index.py).
int64_rows_at = _make_rows_at(types.int64, ir.IntType(64), 8)
# int32_rows_at(address, rows, cols): a keyed table's index slots and row metadata.
int32_rows_at = _make_rows_at(types.int32, ir.IntType(32), 4)
# uint8_rows_at(address, rows, cols): per-row flags.
uint8_rows_at = _make_rows_at(types.uint8, ir.IntType(8), 1)
# uint16_rows_at(address, rows, units): a 16-bit table's rows (its units, precision.py).
uint16_rows_at = _make_rows_at(types.uint16, ir.IntType(16), 2)


@intrinsic
def as_readonly(typingctx, arr):
    """``arr`` typed read-only (the same array, its reference counted): a kernel passing an
    array it wrote to a function that also takes read-only ones (frozen inputs) calls that
    function's one compiled version instead of compiling another for the writable type."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, sig, args):
        context.nrt.incref(builder, sig.args[0], args[0])
        return args[0]

    return arr.copy(readonly=True)(arr), codegen
