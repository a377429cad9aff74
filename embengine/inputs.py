"""User input -> ``Ragged`` (ids int64, offsets int64, weights float32 or None), with validation.

Accepted per feature:

- ``Ragged(ids, offsets=None, lengths=None, weights=None)``: the canonical form; sample ``b`` holds
  ``ids[offsets[b]:offsets[b+1]]``.
- a 1-D integer array (NumPy or torch): one id per sample;
- a 2-D integer array padded with -1: row ``b`` is sample ``b``; -1 entries are padding, dropped
  wherever they stand (a sequence feature's ids take positions 0, 1, ... in row order: a -1
  between two ids leaves no gap; give a Ragged or lists to say which positions are empty);
- a list of lists of ints (one list per sample), or a flat list of ints (one id per sample);
  a sample may be a 1-D NumPy array or torch tensor (a list of tensors, as a DataLoader's
  ``collate_fn`` gathers samples of different lengths), an id a 0-d one;
- TorchRec's ``JaggedTensor`` (``kjt[key]``, ``kjt.to_dict()``): its values, offsets and
  weights, read as a ``Ragged`` (duck-typed: torch and torchrec are not imported);
- a torch nested tensor (``torch.nested.nested_tensor(rows)``, either layout) of 1-D integer
  rows: row ``b`` is sample ``b``'s ids, as a list of those rows is read (a 0-d row is a
  sample of one id); its weights a nested tensor of the same row lengths, or any form the
  ids could take as a ``Ragged``'s (one flat weight per id).

Weights (float) follow the same layout as the ids: 1-D of the same length, 2-D of the same shape
(padding entries ignored) or a list of lists. They are float32: a value past its range, and an
integer it cannot hold exactly (past 2**24 in magnitude), is refused, named where it stands.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Set

import numpy as np

__all__ = ["Ragged", "to_ragged", "as_numpy", "offsets_from_lengths", "read_only"]


def as_numpy(x, what: str = "the array") -> np.ndarray:
    """A NumPy view of a NumPy array, torch tensor or sequence, without importing torch.

    A masked array (``numpy.ma``) is refused (TypeError naming ``what``): the checks (its
    ``max()``, ``any()``) skip its masked entries, the kernels read the values under the mask
    (an id past the table read and wrote outside it)."""
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(
            f"{what} is a masked array (numpy.ma): the checks skip its masked entries, the "
            "lookup would read the values under the mask; pass a plain array (.filled(v): v "
            "in place of each masked entry; -1 pads 2-D ids)"
        )
    if isinstance(x, np.ndarray):
        return x
    mod = type(x).__module__
    if mod.startswith("torch") and hasattr(x, "detach"):
        if getattr(x, "is_nested", False):
            raise TypeError(
                f"{what} is a torch nested tensor, which is read only as one feature's ids or "
                "weights (one row per sample); pass a plain tensor here (nested.values(), or "
                "torch.cat(nested.unbind()))"
            )
        _check_tensor_readable(x, what)
        try:
            return x.detach().cpu().numpy()
        except (TypeError, RuntimeError) as e:  # a dtype NumPy lacks, a tensor subclass
            raise TypeError(
                f"cannot read {what} (a torch tensor of dtype {x.dtype}) as a NumPy array: {e}"
            ) from None
    return np.asarray(x)


def _check_tensor_readable(x, what: str) -> None:
    """Refuse, naming ``what``, a torch tensor whose values cannot be read as an array: a meta
    tensor (no data) and a sparse one (``to_dense()`` would make every missing id 0)."""
    if x.device.type == "meta":
        raise TypeError(
            f"{what} is a meta tensor (device 'meta', shape {list(x.shape)}): it has no "
            "values to look up; pass a tensor holding them (on the CPU or a GPU)"
        )
    layout = str(x.layout)
    if layout != "torch.strided":
        raise TypeError(
            f"{what} is a {layout} tensor; embengine reads dense tensors (to_dense() would "
            "make every missing entry 0, a real id): give a KeyedJagged, a Ragged, a list "
            "per sample, or a dense tensor padded with -1"
        )


_ARRAY_FORMS = "a list, a NumPy array or a torch tensor"


def _refuse_non_sequence(x, what: str, forms: str = _ARRAY_FORMS) -> None:
    """Refuse, naming what ``x`` is and what to pass (``forms``), an iterable that is neither
    a sequence nor an array: a set, a generator or other iterator, a dict or a dict view.
    NumPy reads one as a single object (a 0-d array of dtype object), which was refused as
    "must be integers, got dtype object"; a set has no order to read its entries in."""
    if isinstance(x, Sequence | np.ndarray | str | bytes) or not isinstance(x, Iterable):
        return
    if any(hasattr(x, a) for a in ("__array__", "__array_interface__", "__array_struct__")):
        return  # an array of another library: NumPy reads it
    if _is_torch_tensor(x):
        return
    try:
        memoryview(x)  # the buffer protocol: NumPy reads it
        return
    except TypeError:
        pass
    name = type(x).__name__
    if isinstance(x, Set):
        raise TypeError(
            f"{what}: got {_a(name)}, which has no order (its entries would come in hash "
            f"order); pass {forms} (sorted(s) for ascending order)"
        )
    if isinstance(x, Iterator):
        raise TypeError(
            f"{what}: got {_a(name)}, an iterator (NumPy reads it as one object); pass {forms} "
            "(list(it) reads it)"
        )
    raise TypeError(
        f"{what}: got {_a(name)}, an iterable but not a sequence (NumPy reads it as one "
        f"object); pass {forms} (list(x) of it, if its order is the one meant)"
    )


def _a(noun: str) -> str:
    """``noun`` with its indefinite article ("an object", "a set")."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _refuse_object(a: np.ndarray, x, what: str, must: str) -> None:
    """Refuse an object NumPy read as one (a 0-d array of dtype object), naming its type."""
    if a.dtype.kind == "O" and a.ndim == 0:
        raise TypeError(
            f"{what} must be {must}, got {_a(type(x).__name__)} {x!r:.40}; pass {_ARRAY_FORMS}"
        )


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _check_python_ints(values, what: str) -> None:
    """Ids given as Python numbers (a list): ints (not bools), each fitting in int64; NumPy
    would turn True into 1 and refuse a bigger int with a bare OverflowError."""
    for k, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int | np.integer):
            raise TypeError(f"{what} must be integers, got {v!r} at {what}[{k}]")
        if isinstance(v, int) and not _INT64_MIN <= v <= _INT64_MAX:
            raise ValueError(f"{what}[{k}]={v} does not fit in int64")


def _int_array(x, what: str) -> np.ndarray:
    _refuse_non_sequence(x, what)
    if isinstance(x, list | tuple):
        _check_python_ints(x, what)
    if (
        _is_torch_tensor(x)
        and not x.is_nested  # as_numpy refuses it by name
        and (x.is_floating_point() or x.is_complex() or str(x.dtype) == "torch.bool")
    ):
        _check_tensor_readable(x, what)
        if x.is_floating_point() and x.numel() == 0:  # torch.tensor([]) is float32
            return np.zeros(tuple(x.shape), dtype=np.int64)
        # refused before NumPy reads it: NumPy has no bfloat16 ("unsupported ScalarType")
        raise TypeError(f"{what} must be integers, got dtype {str(x.dtype)[len('torch.') :]}")
    a = as_numpy(x, what)
    if a.dtype.kind not in "iu":
        _refuse_object(a, x, what, "integers")
        if a.size == 0 and a.dtype.kind == "f":  # np.asarray([]) is float64
            return np.zeros(a.shape, dtype=np.int64)
        raise TypeError(f"{what} must be integers, got dtype {a.dtype}")
    if a.dtype == np.uint64 and a.size and a.max() > np.iinfo(np.int64).max:
        k = int(np.argmax(a.reshape(-1) > np.iinfo(np.int64).max))
        at = k if a.ndim == 1 else tuple(int(i) for i in np.unravel_index(k, a.shape))
        raise ValueError(f"{what}[{at}]={int(a.reshape(-1)[k])} does not fit in int64")
    return a.astype(np.int64, copy=False)


def _check_python_numbers(values, what: str, name: Callable[[int], str] | None = None) -> None:
    """Weights given as (nested) lists: every entry an int or float (Python or NumPy, or an
    array of numbers), never a bool, which NumPy would read as 1.0 or 0.0, nor a string; an
    int one float32 holds exactly (``_check_int_weight``: a list mixing ints and floats
    becomes a float64 array, whose check could not tell the int). ``name(k)``: how to name
    the k-th entry of a flat list in that error (default: its index)."""
    stack = [(values, what)]
    while stack:
        seq, where = stack.pop()
        for k, v in enumerate(seq):
            if isinstance(v, list | tuple):
                stack.append((v, f"{where}[{k}]"))
            elif isinstance(v, np.ndarray) and v.ndim and v.dtype.kind in "iuf":
                continue
            elif not _is_number(v):
                raise TypeError(f"{what} must be numbers, got {v!r} at {where}[{k}]")
            else:
                at = name(k) if name is not None and seq is values else f"{where}[{k}]"
                _check_int_weight(v, what, at)


_F32_EXACT = 2**24  # float32 holds every integer up to this in magnitude, exactly


def _int_inexact(n: int) -> bool:
    """Whether float32 cannot hold the integer ``n`` exactly: it has more than 24 significant
    bits (``2**24 + 1`` rounds to ``2**24``; ``2**25`` is exact). Past float32's range
    (``2**128``) it is not this check's: the range check names it."""
    m = abs(n)
    if m <= _F32_EXACT or m >= 2**128:
        return False
    return m >> ((m & -m).bit_length() - 1) >= _F32_EXACT  # its odd part


def _inexact_message(what: str, value: int, at: str) -> str:
    return (
        f"{what}: integer {value} at {at} would round to {int(np.float32(value))}: per-id "
        "weights are float32, exact for integers up to 2**24 in magnitude; pass weights "
        "float32 holds, or floats to accept the rounding"
    )


def _inexact_int_weight(v) -> int | None:
    """``v`` as an int if it is an int weight (Python or NumPy, or a 0-d int array) float32
    cannot hold exactly, else None."""
    if isinstance(v, np.ndarray):
        if v.dtype.kind not in "iu":
            return None
        v = v.item()
    if isinstance(v, int | np.integer) and not isinstance(v, bool) and _int_inexact(int(v)):
        return int(v)
    return None


def _check_int_weight(v, what: str, at: str) -> None:
    """Refuse an int weight float32 cannot hold exactly (``_inexact_int_weight``)."""
    n = _inexact_int_weight(v)
    if n is not None:
        raise ValueError(_inexact_message(what, n, at))


def _first_int_inexact(a: np.ndarray) -> int | None:
    """The flat index of the first entry of integer array ``a`` float32 cannot hold exactly,
    or None. One max and one min in the common case; the rest only for the entries past
    ``2**24`` in magnitude: an integer is exact when its odd part is below ``2**24`` (its
    magnitude as uint64, so that int64's minimum has one)."""
    if a.dtype.itemsize <= 2 or not a.size:
        return None
    if not (int(a.max()) > _F32_EXACT or int(a.min()) < -_F32_EXACT):
        return None
    flat = a.reshape(-1)
    big = np.flatnonzero((flat > _F32_EXACT) | (flat < -_F32_EXACT))
    v = flat[big]
    if a.dtype.kind == "u":
        m = v.astype(np.uint64)
    else:
        v = v.astype(np.int64)
        neg = v < 0
        m = v.astype(np.uint64)  # two's complement: -v is 2**64 + v
        m[neg] = ~m[neg] + np.uint64(1)
    odd = m // (m & (~m + np.uint64(1)))  # m >> its trailing zeros
    bad = odd >= _F32_EXACT
    return int(big[np.argmax(bad)]) if bad.any() else None


def _float_array(x, what: str, where: Callable[[int], str] | None = None) -> np.ndarray:
    """``x`` (per-id weights: numbers in any array form) as float32, checked by
    ``_as_float32`` (``where``: how to name an entry of a 1-D ``x``)."""
    if type(x).__module__.startswith("torch") and hasattr(x, "detach"):
        if getattr(x, "requires_grad", False):
            # torchrec's weighted modules pass a gradient to the weights; the engine pools
            # them as constants, and detaching them here dropped that gradient silently
            raise ValueError(
                f"{what} require grad, but embengine takes per-id weights as constants (no "
                "gradient reaches them); pass them detached (weights.detach()) to use them so"
            )
        if x.is_floating_point() and x.element_size() < 2 or str(x.dtype) == "torch.bfloat16":
            x = x.float()  # NumPy has no bfloat16 nor float8: their float32 values (exact)
    _refuse_non_sequence(x, what)
    if isinstance(x, list | tuple):
        _check_python_numbers(x, what, where)
    a = as_numpy(x, what)
    if a.dtype.kind not in "iuf":
        _refuse_object(a, x, what, "numbers")
        raise TypeError(f"{what} must be numbers, got dtype {a.dtype}")
    return _as_float32(a, what, where if a.ndim == 1 else None)


def _as_float32(a: np.ndarray, what: str, where: Callable[[int], str] | None = None) -> np.ndarray:
    """``a`` (numbers) as float32; a finite value past float32's range (it would become inf)
    is refused, named as given, not as the "weight inf ... is not finite" the check of the
    float32 weights would say; so is an integer float32 cannot hold exactly (past ``2**24``
    in magnitude, with more than 24 significant bits), which would round silently (TorchRec
    refuses integer weights outright). ``where(k)``: how to name the k-th entry of a 1-D
    ``a`` (default: its index)."""

    def at_str(at: tuple[int, ...]) -> str:
        return where(at[0]) if where is not None else f"{what}[{', '.join(map(str, at))}]"

    if a.dtype.kind in "iu":
        k = _first_int_inexact(a)
        if k is not None:
            at = tuple(int(i) for i in np.unravel_index(k, a.shape))
            raise ValueError(_inexact_message(what, int(a[at]), at_str(at)))
    with np.errstate(over="ignore"):
        out = a.astype(np.float32, copy=False)
    if a.dtype.kind == "f" and a.dtype.itemsize > 4 and out.size and np.isinf(out).any():
        over = np.isinf(out) & np.isfinite(a)
        if over.any():
            at = tuple(int(i) for i in np.argwhere(over)[0])
            raise ValueError(
                f"{what}: {float(a[at])!r} at {at_str(at)} is past float32's range (about "
                "3.4e38): per-id weights are float32"
            )
    return out


def read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a`` (no copy): whoever holds the view cannot write through it."""
    v = a.view()
    v.flags.writeable = False
    return v


def frozen(a: np.ndarray) -> np.ndarray:
    """``a`` as a read-only array (``a`` itself if it is, else a view, no copy), for a kernel
    argument the kernel only reads.

    numba compiles a kernel once per argument *type*, and an array's type includes whether it
    is writable: the same call with a caller's read-only ids (a frozen batch, a memory-mapped
    file, ``Ragged``) and with a fresh array compiled twice, and for the pooling kernels nine
    times twice (one per row width). Every read-only input goes to the kernels read-only, so
    each kernel compiles once whatever the caller's arrays are."""
    return a if not a.flags.writeable else read_only(a)


def _check_offsets(offsets: np.ndarray, num_ids: int) -> None:
    """Offsets must run from 0 to ``num_ids``, never decreasing."""
    if offsets.ndim != 1 or len(offsets) < 1:
        raise ValueError(f"Ragged offsets must be 1-D with >= 1 entry, got {offsets.shape}")
    if offsets[0] != 0:
        raise ValueError(f"offsets[0]={int(offsets[0])} must be 0")
    # Neighbours are compared, not subtracted: np.diff wraps around for offsets near the int64
    # limits, and [0, 2**63 - 1, -2**63, -2, 3] would pass as non-decreasing.
    down = offsets[1:] < offsets[:-1]
    if down.any():
        k = int(np.argmax(down)) + 1
        raise ValueError(
            f"offsets[{k}]={int(offsets[k])} is less than offsets[{k - 1}]="
            f"{int(offsets[k - 1])}: offsets must be non-decreasing"
        )
    if offsets[-1] != num_ids:
        raise ValueError(f"offsets[-1]={int(offsets[-1])} must equal the number of ids ({num_ids})")


def offsets_from_lengths(lengths: np.ndarray, num_ids: int) -> np.ndarray:
    """Offsets ``[0, l0, l0 + l1, ...]`` of int64 ``lengths``, checked so that no sum wraps.

    Each length must be in ``[0, num_ids]`` and they must add up to ``num_ids``. A sum of int64
    lengths can wrap around (``[2**63 - 1, 2**63 - 1, 5]`` adds up to 3): every partial sum is
    checked, not only the total (the first wrapped one is negative, below the sum before it)."""
    if lengths.ndim != 1:
        raise ValueError(f"Ragged lengths must be 1-D, got shape {lengths.shape}")
    if lengths.size:
        if lengths.min() < 0:
            k = int(np.argmax(lengths < 0))
            raise ValueError(f"lengths[{k}]={int(lengths[k])} is negative")
        if lengths.max() > num_ids:
            k = int(np.argmax(lengths > num_ids))
            raise ValueError(
                f"lengths[{k}]={int(lengths[k])} is more than the number of ids ({num_ids})"
            )
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    wrapped = offsets[1:] < offsets[:-1]  # lengths are >= 0: only a wrap can decrease a sum
    if wrapped.any():
        k = int(np.argmax(wrapped))
        raise ValueError(
            f"lengths sum to more than the number of ids ({num_ids}): the running sum "
            f"overflows int64 at lengths[{k}] (sample {k})"
        )
    if offsets[-1] != num_ids:
        raise ValueError(f"lengths sum to {int(offsets[-1])} but there are {num_ids} ids")
    return offsets


class Ragged:
    """A batch of variable-length samples: sample ``b`` is ``ids[offsets[b]:offsets[b+1]]``.

    Give either ``offsets`` (length B+1, starting at 0, non-decreasing, ending at ``len(ids)``) or
    ``lengths`` (length B, each in ``[0, len(ids)]``, adding up to ``len(ids)``). ``weights``, if
    given, has one float per id.

    A Ragged does not change after it is validated, so what the checks saw is what the kernels
    read:

    - ``offsets`` is the Ragged's own read-only copy (B + 1 ints), made before it is checked;
    - ``ids`` and ``weights`` are read-only views of the arrays given, not copies (a batch holds
      millions of ids): nothing can write to them through the Ragged, and their length cannot
      change. Their values do not shape the Ragged; ids are range-checked when a batch is
      prepared from it (``EmbeddingEngine.preprocess`` / ``lookup``), and a training batch
      keeps copies of them (its deduplication data). A lookup-only batch
      (``preprocess(..., training=False)``) keeps these views: its ids are checked again when
      it is looked up, so an array the caller changed in between gives an error, never a read
      outside a table. Do not write to an array after passing it in: the views see the change.

    The attributes are read-only; build a new Ragged for other values.
    """

    __slots__ = ("_ids", "_offsets", "_weights")

    def __init__(self, ids, offsets=None, lengths=None, weights=None):
        ids = _int_array(ids, "ids")
        if ids.ndim != 1:
            raise ValueError(f"Ragged ids must be 1-D, got shape {ids.shape}")
        if (offsets is None) == (lengths is None):
            raise ValueError("Ragged needs exactly one of offsets= or lengths=")
        if lengths is not None:
            offsets = offsets_from_lengths(_int_array(lengths, "lengths"), len(ids))
        else:
            # Our own copy, checked after copying: the caller's array may change later.
            offsets = np.array(_int_array(offsets, "offsets"), dtype=np.int64, copy=True)
            _check_offsets(offsets, len(ids))
        offsets.flags.writeable = False
        if weights is not None:
            weights = _float_array(weights, "weights")
            if weights.shape != ids.shape:
                raise ValueError(
                    f"weights has shape {weights.shape} but ids has shape {ids.shape}; "
                    "give one weight per id"
                )
            weights = read_only(weights)
        self._ids = read_only(ids)
        self._offsets = offsets
        self._weights = weights

    @property
    def ids(self) -> np.ndarray:
        """int64 ``[N]``, read-only."""
        return self._ids

    @property
    def offsets(self) -> np.ndarray:
        """int64 ``[B + 1]``, read-only, the Ragged's own."""
        return self._offsets

    @property
    def weights(self) -> np.ndarray | None:
        """float32 ``[N]`` (read-only) or None."""
        return self._weights

    # A copy or an unpickled Ragged (a lookup-only batch sent from a DataLoader worker) is built
    # and checked again: unpickled arrays are writable, and a pickle may have been edited.
    def __reduce__(self):
        return (_rebuild_ragged, (self._ids, self._offsets, self._weights))

    @property
    def num_samples(self) -> int:
        return len(self._offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self._offsets)

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        w = "" if self._weights is None else ", weights=..."
        return f"Ragged(num_samples={self.num_samples}, num_ids={len(self._ids)}{w})"

    def where(self, k: int) -> str:
        """'sample b, position p' for the k-th id."""
        b = int(np.searchsorted(self._offsets, k, side="right")) - 1
        return f"sample {b}, position {k - int(self._offsets[b])}"


def _rebuild_ragged(ids, offsets, weights) -> Ragged:
    return Ragged(ids, offsets=offsets, weights=weights)


def _is_torch_tensor(x) -> bool:
    """A torch tensor, told by its class's module (torch is not imported here)."""
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _is_jagged(x) -> bool:
    """TorchRec's JaggedTensor: callable ``values``, ``offsets`` and ``weights_or_none``, and no
    ``keys`` (a KeyedJaggedTensor has them)."""
    return not callable(getattr(x, "keys", None)) and all(
        callable(getattr(x, m, None)) for m in ("values", "offsets", "weights_or_none")
    )


def _from_jagged(jt) -> Ragged:
    """TorchRec's JaggedTensor as a Ragged: its lengths when it holds them (``JaggedTensor.
    empty()``'s offsets are empty), else its offsets; one holding both must have them agree
    (TorchRec reads either)."""
    lengths = jt.lengths_or_none() if callable(getattr(jt, "lengths_or_none", None)) else None
    given = jt.offsets_or_none() if callable(getattr(jt, "offsets_or_none", None)) else None
    weights = jt.weights_or_none()
    if lengths is None:
        return Ragged(jt.values(), offsets=jt.offsets(), weights=weights)
    r = Ragged(jt.values(), lengths=lengths, weights=weights)
    if given is not None:
        given = _int_array(given, "offsets")
        if given.shape == (0,) and r.num_samples == 0:  # JaggedTensor.empty()
            return r
        if given.shape != r.offsets.shape:
            raise ValueError(
                f"offsets have shape {list(given.shape)} but there are {r.num_samples} lengths; "
                f"a JaggedTensor's offsets and lengths must agree (give one of them)"
            )
        differ = given != r.offsets
        if differ.any():
            k = int(np.argmax(differ))
            raise ValueError(
                f"offsets[{k}]={int(given[k])} but the lengths give {int(r.offsets[k])}; a "
                "JaggedTensor's offsets and lengths must agree (give one of them)"
            )
    return r


def _sample_arrays(value, what: str):
    """A list or tuple holding torch tensors (one per sample) as the list of their NumPy arrays,
    as a list of NumPy arrays is read (a 0-d tensor: its Python number); anything else as it
    is. Weights that require grad are refused, as ``_float_array`` refuses them."""
    if not isinstance(value, list | tuple) or not any(_is_torch_tensor(v) for v in value):
        return value
    out = []
    for v in value:
        if _is_torch_tensor(v):
            if getattr(v, "requires_grad", False):
                raise ValueError(
                    f"{what} require grad, but embengine takes per-id weights as constants (no "
                    "gradient reaches them); pass them detached (weights.detach()) to use them so"
                )
            if v.dim() == 0:
                _check_tensor_readable(v, what)
                v = v.item()
            else:
                if str(v.dtype) == "torch.bfloat16":  # NumPy has no bfloat16: float32 values
                    v = v.float()
                v = as_numpy(v, what)
        out.append(v)
    return out


def _is_nested_tensor(x) -> bool:
    """A torch nested tensor (``torch.nested``, strided or jagged layout)."""
    return _is_torch_tensor(x) and bool(getattr(x, "is_nested", False))


def _nested_rows(x, what: str) -> list:
    """A nested tensor's rows, each 1-D (a 0-d row: one entry). Rows of two or more
    dimensions are refused, naming the row."""
    rows = []
    for b, r in enumerate(x.unbind()):
        if r.dim() > 1:
            raise ValueError(
                f"{what} is a nested tensor whose row {b} has shape {list(r.shape)}; each row "
                "is one sample's ids, 1-D"
            )
        rows.append(r.reshape(-1))
    return rows


def _flat(rows: list, x):
    """The rows of nested tensor ``x`` as one flat tensor and their int64 lengths."""
    torch = sys.modules["torch"]  # x is a torch tensor: torch is loaded (not imported here)
    flat = torch.cat(rows) if rows else torch.empty(0, dtype=x.dtype)
    return flat, np.array([len(r) for r in rows], dtype=np.int64)


def _from_nested(value, weights) -> Ragged:
    """A nested tensor of ids (one row per sample) as a Ragged. Weights: a nested tensor of
    the ids' row lengths, a list of one list (or 1-D tensor) per sample, or one flat entry
    per id (``Ragged(weights=)``)."""
    rows = _nested_rows(value, "ids")
    if isinstance(weights, list | tuple):  # per sample, as for a list of the rows
        return _from_lists([as_numpy(r, "ids") for r in rows], _sample_arrays(weights, "weights"))
    ids, lengths = _flat(rows, value)
    if _is_nested_tensor(weights):
        weights, w_lengths = _flat(_nested_rows(weights, "weights"), weights)
        if len(w_lengths) != len(lengths):
            raise ValueError(
                f"weights is a nested tensor of {len(w_lengths)} rows but the ids have "
                f"{len(lengths)} rows (samples); give one row of weights per sample"
            )
        diff = w_lengths != lengths
        if diff.any():
            b = int(np.argmax(diff))
            raise ValueError(
                f"weights of sample {b} has {int(w_lengths[b])} entries but the sample has "
                f"{int(lengths[b])} ids"
            )
    return Ragged(ids, lengths=lengths, weights=weights)


def _is_nested(x) -> bool:
    return (
        isinstance(x, Sequence)
        and not isinstance(x, str | bytes)
        and any(isinstance(e, Sequence | np.ndarray) and not isinstance(e, str | bytes) for e in x)
    )


def _is_list_like(x) -> bool:
    """A sequence or an array of at least one dimension, not a string."""
    if isinstance(x, np.ndarray):
        return x.ndim >= 1
    return isinstance(x, Sequence) and not isinstance(x, str | bytes)


def _is_number(x) -> bool:
    """An int or float (Python or NumPy, or a 0-d array of one), not a bool."""
    if isinstance(x, bool | np.bool_):
        return False
    if isinstance(x, int | float | np.integer | np.floating):
        return True
    return isinstance(x, np.ndarray) and x.ndim == 0 and x.dtype.kind in "iuf"


def _from_lists(value, weights) -> Ragged:
    for b, s in enumerate(value):
        if not _is_list_like(s):
            raise TypeError(
                f"sample {b} is {type(s).__name__} {s!r}: a list of lists holds one list of ids "
                "per sample"
            )
    lengths = [len(s) for s in value]
    flat = [v for s in value for v in s]
    for k, v in enumerate(flat):
        if not isinstance(v, int | np.integer) or isinstance(v, bool):
            b = int(np.searchsorted(np.cumsum(lengths), k, side="right"))
            raise TypeError(f"ids must be integers, got {v!r} at sample {b}")
        if not _INT64_MIN <= int(v) <= _INT64_MAX:  # a Python int, or NumPy's uint64
            b = int(np.searchsorted(np.cumsum(lengths), k, side="right"))
            raise ValueError(f"id {int(v)} at sample {b} does not fit in int64")
    ids = np.asarray(flat, dtype=np.int64)
    w = None
    if weights is not None:
        if (
            not _is_list_like(weights)
            or len(weights) != len(value)
            or not all(_is_list_like(ws) for ws in weights)
        ):
            raise ValueError(
                f"weights must be a list of {len(value)} lists, one per sample, like the ids"
            )
        for b, (s, ws) in enumerate(zip(value, weights, strict=True)):
            if len(ws) != len(s):
                raise ValueError(
                    f"weights of sample {b} has {len(ws)} entries but the sample has {len(s)} ids"
                )
        flat_w = [x for ws in weights for x in ws]
        # Numbers only: np.asarray would read True as 1.0 and "0.5" as 0.5.
        bad = next((k for k, x in enumerate(flat_w) if not _is_number(x)), None)
        if bad is not None:
            b = int(np.searchsorted(np.cumsum(lengths), bad, side="right"))
            raise TypeError(f"weights must be numbers, got {flat_w[bad]!r} at sample {b}")

        def sample(k: int) -> str:
            return f"sample {int(np.searchsorted(np.cumsum(lengths), k, side='right'))}"

        # before float64, which cannot tell 2**53 + 1 from 2**53 either
        bad = next((k for k, x in enumerate(flat_w) if _inexact_int_weight(x) is not None), None)
        if bad is not None:
            _check_int_weight(flat_w[bad], "weights", sample(bad))

        try:
            w64 = np.asarray(flat_w, dtype=np.float64)
        except OverflowError:  # a Python int past float64's range
            k = next(k for k, x in enumerate(flat_w) if abs(x) > 1e308)
            raise ValueError(
                f"weights: an int of {len(str(abs(flat_w[k])))} digits at {sample(k)} is past "
                "float32's range (about 3.4e38): per-id weights are float32"
            ) from None
        w = _as_float32(w64, "weights", sample)
    return Ragged(ids, lengths=np.asarray(lengths, dtype=np.int64), weights=w)


def _from_padded(ids: np.ndarray, weights, keyed: bool = False) -> Ragged:
    bad = ids < -1
    if not keyed and bad.any():  # a keyed table's keys may be negative; -1 is padding still
        b, j = np.argwhere(bad)[0]
        raise ValueError(
            f"id {int(ids[b, j])} at [{b}, {j}] is negative; only -1 marks padding in 2-D input"
        )
    keep = ids != -1
    w = None
    if weights is not None:
        w = _float_array(weights, "weights")
        if w.shape != ids.shape:
            raise ValueError(
                f"weights has shape {w.shape} but the ids have shape {ids.shape}; give 2-D "
                "weights of the same shape"
            )
        w = w[keep]
    return Ragged(ids[keep], lengths=keep.sum(axis=1), weights=w)


def to_ragged(value, weights=None, keyed: bool = False) -> Ragged:
    """Convert any accepted input form (see module docstring) to a structurally valid Ragged.
    ``keyed``: for a keyed table, whose ids are any int64 keys: 2-D input may hold negative
    keys other than -1 (the padding)."""
    if value is None or isinstance(value, str | bytes | Mapping):
        raise TypeError(
            "ids must be an integer array, a Ragged or a list of lists of ints, got "
            f"{type(value).__name__} {value!r:.40}"
        )
    if all(callable(getattr(value, m, None)) for m in ("keys", "values", "lengths")):
        raise TypeError(
            f"ids are a {type(value).__name__} (several features): pass it as the features "
            "themselves (layer(kjt), engine.lookup(keyed_jagged_to_features(kjt))), or this "
            "feature's own kjt[key]"
        )
    if _is_jagged(value):
        try:
            value = _from_jagged(value)
        except (TypeError, ValueError) as e:
            raise type(e)(f"(a JaggedTensor) {e}") from None
    if _is_nested_tensor(value):
        return _from_nested(value, weights)
    if _is_nested_tensor(weights):
        raise TypeError(
            "weights is a nested tensor but the ids are not; give nested weights with nested "
            "ids (a row per sample), or weights in the ids' form"
        )
    value = _sample_arrays(value, "ids")
    weights = _sample_arrays(weights, "weights")
    if isinstance(value, Ragged):
        if weights is not None:
            if value.weights is not None:
                raise ValueError(
                    "weights given twice: with the ids (a Ragged's or a KeyedJaggedTensor's) "
                    "and in weights=; pass them once"
                )
            return Ragged(value.ids, offsets=value.offsets, weights=weights)
        return value
    if isinstance(value, list | tuple) and _is_nested(value):
        return _from_lists(value, weights)
    forms = "a list, a NumPy array, a torch tensor, a Ragged or a list of lists per sample"
    _refuse_non_sequence(value, "ids", forms)
    try:
        ids = _int_array(value, "ids")
    except ValueError as e:  # e.g. np.asarray of ragged lists
        raise TypeError(f"cannot read ids from {type(value).__name__}: {e}") from None
    if ids.ndim == 2:
        return _from_padded(ids, weights, keyed)
    if ids.ndim == 1:
        w = None
        if weights is not None:
            w = _float_array(weights, "weights")
            if w.shape != ids.shape:  # e.g. [[w0, w1, w2]] for ids [a, b, c]: not flattened
                raise ValueError(
                    f"weights has shape {w.shape} but the ids have shape {ids.shape}; give 1-D "
                    "weights of the same shape, one per id"
                )
        return Ragged(ids, offsets=np.arange(len(ids) + 1, dtype=np.int64), weights=w)
    raise ValueError(
        f"ids must be 1-D (one id per sample), 2-D (padded with -1) or a Ragged, got shape "
        f"{ids.shape}"
    )


def check_values(r: Ragged, vocabulary_size: int | None, check_weights: bool = True) -> None:
    """Range-check ids (not for a keyed table: ``vocabulary_size`` None, any int64 is a key)
    and (optionally) finite-check weights, naming the first bad position."""
    ids = r.ids
    # One reduction and no temporary in the common, valid case (a negative id read as uint64 is
    # above any vocabulary); the position only on error.
    if (
        vocabulary_size is not None
        and ids.size
        and int(ids.view(np.uint64).max()) >= vocabulary_size
    ):
        bad = (ids < 0) | (ids >= vocabulary_size)
        if bad.any():
            k = int(np.argmax(bad))
            raise ValueError(
                f"id {int(ids[k])} at {r.where(k)} (ids[{k}]) is out of range "
                f"[0, {vocabulary_size})"
            )
    if check_weights and r.weights is not None and r.weights.size:
        bad = ~np.isfinite(r.weights)
        if bad.any():
            k = int(np.argmax(bad))
            raise ValueError(f"weight {r.weights[k]} at {r.where(k)} (weights[{k}]) is not finite")
