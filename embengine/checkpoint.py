"""Checkpoints: self-describing, atomic, checksummed directories of safetensors files.

Layout of ``engine.save(root)``::

    root/ckpt-000007-step000000001000/  the 7th checkpoint committed under root, at step 1000
                                        (numbers wider than 6 and 12 digits widen the name;
                                        checkpoints are ordered by the numbers)
        manifest.json                   format, version, seed, step, every table / feature /
                                        optimizer (hyperparameters), learning-rate tags, whether
                                        every table was finite, and the SHA-256 and size of every
                                        file
        manifest.sha256                 the SHA-256 of manifest.json
        table-000.safetensors           "{table}" (weights) and "{table}/{slot}" per slot, under
        table-001.safetensors           TF's slot names
        extra.safetensors               optional caller tensors (e.g. the dense model)

The layout is keyed by logical table and logical row: one file per table of the engine's
configuration, whose tensors have one row per id (row r is id r), whether the engine packed the
table with others or kept it in a memory-mapped file; so any engine of the same configuration
reads it, and a sharded table writes the same tensors. A keyed table (``vocabulary_size``
null) has one row per key instead: its file holds "{table}/keys" (sorted) and the rows aligned
with them, plus its other state entries ("{table}/last_touched", ... : ``embengine.state``),
and its manifest entry says ``keyed: {rows, pending_keys, total}``, the lengths its shapes
need (and the stats totals, for inspect). The manifest is the engine's ``spec()``
(embengine.spec) plus the checkpoint's own keys (format, version, step, finite, extra, files,
and each table's file, finite flag and, keyed, ``keyed``).

This module uses only the engine's public state API (``spec()``, ``state_dict()``,
``load_state_dict()``, ``step``, ``sequential_access()``) and imports nothing from the engine:
``EmbeddingEngine.load`` is ``read_checkpoint`` (every check below), ``from_spec`` and
``CheckpointReader.restore``.

Saving. A save writes into ``root/.tmp-ckpt-*``, fsyncs every file and the directory, then
renames it into place (atomic), so the newest complete checkpoint is always readable, even if
the process is killed mid-save. Saves to one root from several threads or processes do not
interfere: each holds an flock on its own temporary folder while it writes (a later save
removes only temporary folders nobody holds, i.e. those of killed saves), and the short steps
that must not interleave (cleaning up, numbering, renaming, pruning) run under an flock of the
root folder, so every save gets its own sequence number, in commit order. These are advisory
POSIX locks on a local file system. After the commit, ``keep=N`` deletes (rename away, then
remove) the checkpoints older than the newest N, except the newest one whose tables (weights
and float slots) were all finite when written: the manifest records that (``"finite"``,
checked chunk by chunk while writing), so NaN reaching the tables never costs the last good
checkpoint. Manifests written before the flag existed count as finite. Nor does it delete a
checkpoint being read: ``read_checkpoint`` (restore, load, export) and ``manifest_held``
(inspect) hold a shared flock of the checkpoint's folder from before they read the manifest
until the restore, export or description ends (a CheckpointReader until ``close()``), and
pruning skips a folder it cannot lock exclusively (a later save prunes it). A restore thus
never loses its files midway to a save, in this process or another; a checkpoint deleted
before the reader locked it (or by anything else) is a CheckpointError naming it, nothing
read.

A save's errors say whether it committed. Before the rename, any error (an OSError of a full
disk, ...) is raised as it is and nothing was committed (the temporary folder is removed): save
again. After it (syncing the root folder, pruning), the checkpoint is complete and restores,
so the error is a CheckpointError saying so, its ``path`` the checkpoint, chained to the
failure (``__cause__``), as a ShardedEngine's save says on every rank; a KeyboardInterrupt is
raised as it is, with that text as a note. Not an OSError: nothing here promised one, and a
caller catching OSError to save again would save the checkpoint twice.

Loading. ``read_checkpoint`` (``restore``, ``EmbeddingEngine.load``, export) and
``read_manifest`` (inspect) check, in this order and before any engine is built or any table
byte changes:

1. the manifest: format, version, then one schema check of every key the loaders use (types,
   presence, ``step`` an int >= 0, ...), naming the key and the checkpoint;
2. every file the manifest names (tables' ``file``, ``extra.file``, every key of ``files``) is
   a plain ``*.safetensors`` name inside the checkpoint folder (no path, no ``..``, no leading
   dot), listed in ``files`` with its SHA-256 and size, and a regular file (not a symlink) of
   exactly that size, no two of them one file (hard links); manifest.json and manifest.sha256
   are regular files too (``own_file``: a link is refused, never followed, here and in
   exports);
3. with ``verify`` (the default): ``manifest.sha256`` and every file's SHA-256 (manifest.json
   and manifest.sha256 are read only up to MAX_MANIFEST_BYTES, 64 MiB: a larger one is
   refused before it is read);
4. every file's safetensors header: each tensor's dtype and shape are those the manifest
   describes, and its data range lies inside the file and holds exactly the bytes its shape
   needs. A small file can therefore never make a load allocate a large table. Headers are
   parsed one at a time, keeping only the entries the readers use.

``verify=False`` skips only the hashing (3), never 1, 2 or 4. Nothing is ever unpickled.

What the checksums protect: SHA-256 of the files and of manifest.json catch accidental
corruption (truncation, bit flips, a file replaced by another one). They do not protect against
tampering: ``manifest.sha256`` is a plain hash, not a signature, so anyone who can write the
folder can rewrite a file and both hashes. Load checkpoints only from sources you trust with
your model; the checks above only guarantee that such a checkpoint cannot make embengine read
files outside its folder, allocate more than its files hold, or raise anything but
CheckpointError for a malformed manifest.

What a restore guarantees: every check above passes before the first table byte changes, so a
checkpoint that is corrupt at rest leaves the engine bit-identical; then ``load_state_dict``
checks every tensor's name, shape and dtype against the engine and copies under the engine's
lock, each table's tensors read straight into its memory. A keyed table's keys and metadata
are read into memory and their values checked first (keys sorted and distinct, pending keys
without rows, counts >= 0, steps not after the checkpoint's, at most ``max_rows`` rows): a
crafted keyed checkpoint is a CheckpointError naming the entry, the engine unchanged; its rows
are read in their turn straight into its new arena. A keyed table
also makes room for its rows (its arena, or its file's blocks) before any table changes, so a
full disk or exhausted memory is a CheckpointError with the engine unchanged. It does not make
the copy itself atomic (that would need a second copy of every table): if reading fails midway
(an I/O error, or a file modified or truncated while it is being copied), the tables already
copied and part of the current one hold the checkpoint's values, the engine's step is
unchanged, and the CheckpointError says so; restore again before using the engine. Tables are
read with ordinary reads, so a file truncated during the copy is an error, not a SIGBUS.

Tables are written and read in chunks of rows, so memory stays bounded for tables larger than
RAM: a keyed table's rows are gathered in key order a chunk at a time as they are written
(``state_dict(lazy=True)``), and read into its new arena the same way; only its keys and
per-key metadata (8-40 bytes a key) are held whole.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import stat
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .backends.registry import BACKENDS
from .config import COMPRESSIONS
from .initializers import Zeros
from .precision import DTYPES as PRECISIONS
from .precision import numpy_dtype
from .safetensors_io import (
    BFLOAT16,
    DTYPES,
    NUMPY,
    TensorRows,
    read_header,
    read_tensor,
    sha256_file,
    write_safetensors,
)
from .spec import NONFINITE_POLICIES, SpecError, feature_configs_from_spec
from .state import (
    KEYED_COUNTERS,
    KEYED_ENTRIES,
    MAX_STEP,
    NO_TIME,
    TIME_ENTRIES,
    WEIGHTS,
    PartialLoadError,
    Stateful,
    keyed_entries,
)
from .version import __version__

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointReader",
    "StoredTensor",
    "save",
    "restore",
    "read_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "read_manifest",
]

FORMAT = "embengine-checkpoint"
FORMAT_VERSION = 1
# The caller's extra tensors (a single engine's save, and a sharded engine's rank 0).
EXTRA_FILE = "extra.safetensors"
# A checkpoint's folder: its commit sequence number and step, zero-padded to 6 and 12 digits
# (so names of one width sort as their numbers) and wider when they grow past them; ordered by
# the numbers, never by the names (ckpt-1000000-... comes after ckpt-999999-...).
_NAME = re.compile(r"^ckpt-(\d{6,})-step(\d{12,})$")


def checkpoint_name(seq: int, step: int) -> str:
    """The folder name of the ``seq``-th checkpoint committed under a root, at ``step``."""
    return f"ckpt-{seq:06d}-step{step:012d}"


def is_checkpoint_name(name: str) -> bool:
    """Whether ``name`` is a checkpoint folder's name (``ckpt-<sequence>-step<step>``, as
    ``checkpoint_name`` makes): in a folder of checkpoints, a folder of that name is numbered
    with them and, with a checkpoint's manifest, listed as one."""
    return _NAME.match(name) is not None


def _sequence(path: Path) -> int:
    """The commit sequence number of a checkpoint folder (its name matches _NAME)."""
    return int(_NAME.match(path.name)[1])


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, corrupt, foreign or incompatible; or a save
    that failed after it committed its checkpoint (syncing the root folder or pruning failed:
    an EmbeddingEngine's, or rank 0's of a ShardedEngine). ``path``: that committed
    checkpoint's folder (complete: it restores), so a caller need not parse the message for
    it; None on any other."""

    def __init__(self, *args: object, path: Path | None = None):
        super().__init__(*args)
        self.path = path


@dataclass
class CheckpointInfo:
    path: Path
    step: int
    extra_tensors: dict[str, np.ndarray]
    extra_metadata: dict


# -- saving ---------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, in the order they were written: folders named
    like checkpoints (``ckpt-<sequence>-step<step>``) holding a manifest.json. A save renames
    its folder into place complete and a prune renames a checkpoint away before deleting it, so
    a folder of that name without manifest.json is no save's: it is never listed (nor
    deleted). Nor is one whose manifest.json is of another format (an export named like a
    checkpoint: restore(root) took it for the newest checkpoint and failed, and ``keep=N``
    kept it as the newest finite checkpoint, deleting the real one, or pruned it). Each
    manifest is read (``_foreign_format``): ``latest_checkpoint`` reads only the newest."""
    return [p for p in _named(root) if _foreign_format(p) is None]


def _named(root: str | Path) -> list[Path]:
    """The folders under ``root`` named like checkpoints and holding a manifest.json, in
    commit order (their numbers), whatever the manifest says."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / "manifest.json").is_file()]
    return sorted(found, key=lambda p: (_sequence(p), p.name))


def _foreign_format(folder: Path) -> str | None:
    """The ``format`` of ``folder``'s manifest.json when it names another format than a
    checkpoint's (an export's "embengine-serving": an older embengine exported under a
    checkpoint's name, or one was copied there), else None. A manifest that cannot be read or
    has no string ``format`` is None too: a damaged checkpoint stays listed, and loading it
    says what is wrong (skipped, a restore would silently take an older one)."""
    fmt = (read_json_dict(folder / "manifest.json") or {}).get("format")
    return fmt if isinstance(fmt, str) and fmt != FORMAT else None


def read_json_dict(file: Path) -> dict | None:
    """The JSON object in ``file``, or None if it is missing, unreadable or not a JSON object
    (``read_own_file``: a link is no checkpoint's or export's manifest)."""
    try:
        data = json.loads(read_own_file(file))
    except (OSError, ValueError, RecursionError):  # CheckpointError is a ValueError
        return None
    return data if isinstance(data, dict) else None


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (``list_checkpoints``' last), or None.
    Reads manifests from the newest down only until one is a checkpoint's."""
    return next((p for p in reversed(_named(root)) if _foreign_format(p) is None), None)


def _lock(fd: int, path: Path, flags: int) -> None:
    try:
        fcntl.flock(fd, flags)
    except BlockingIOError:
        raise
    except OSError as e:
        raise OSError(
            e.errno,
            f"cannot lock {path} ({e.strerror}): saving checkpoints needs a file "
            "system with flock (a local one)",
        ) from e


def _unlock(fd: int) -> None:
    """Unlock explicitly before closing: a child forked meanwhile (a data loader's worker)
    shares the open file description, and would otherwise keep the lock until it exits."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive flock of the folder ``path`` for the block (blocks until free). flock locks
    belong to an open file description, so two threads of one process exclude each other too;
    the kernel releases the lock when its holder dies."""
    fd = os.open(path, os.O_RDONLY)
    try:
        _lock(fd, path, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    try:
        yield
    finally:
        _unlock(fd)


def _remove_leftovers(root: Path) -> None:
    """Under the root's lock: remove the temporary folders of killed saves (nobody holds their
    lock; a running save, in this process or another, does) and the trash of killed prunes
    (pruning happens under the root's lock, so any trash seen here is stale). Only the names
    saves and prunes write: ``.tmp-ckpt-*`` and ``.trash-ckpt-*`` (``_discard_unless_read``
    renames a ``ckpt-*`` folder to one before deleting it); an export's temporary folder beside
    its OUT is ``.export-*`` (embengine.serving), never one of these.

    Never a ``ckpt-*`` folder, even one without manifest.json: a save renames its folder into
    place with its manifest already inside, and a prune renames the whole folder away first,
    so no save or prune, killed at any moment, leaves such a folder (embengines before
    70ffd8c pruned with an in-place rmtree, which could). It is someone else's: a user's
    folder, or an empty export folder made ahead of an export, which saves deleted."""
    for tmp in root.glob(".tmp-ckpt-*"):
        try:
            fd = os.open(tmp, os.O_RDONLY)
        except OSError:  # removed meanwhile
            continue
        try:
            _lock(fd, tmp, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a save is writing into it
            os.close(fd)
            continue
        except BaseException:
            os.close(fd)
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        _unlock(fd)
    for trash in root.glob(".trash-ckpt-*"):
        shutil.rmtree(trash, ignore_errors=True)


def _written_finite(ckpt: Path) -> bool:
    """Whether a checkpoint's manifest says every table was finite when written (manifests
    without the flag predate it: finite). An unreadable manifest is not a good checkpoint."""
    try:
        manifest = json.loads(read_own_file(ckpt / "manifest.json"))
    except (OSError, ValueError, RecursionError):  # CheckpointError is a ValueError
        return False
    return isinstance(manifest, dict) and manifest.get("finite", True) is True


def _prune(root: Path, keep: int) -> None:
    """Under the root's lock: discard all but the newest ``keep`` checkpoints and the newest
    one whose tables were all finite. A checkpoint being read (a restore, load, export or open
    CheckpointReader, in this process or another, holds its folder's shared lock:
    ``_ReadLock``) is kept; a later save prunes it."""
    done = list_checkpoints(root)
    good = next((p for p in reversed(done) if _written_finite(p)), None)
    for old in done[:-keep]:
        if old != good:
            _discard_unless_read(old)


def _discard_unless_read(ckpt: Path) -> None:
    """``_discard`` a checkpoint folder unless a reader holds its shared lock: an exclusive
    lock, never waited for, held while the folder is renamed away (a reader that opened it
    before then finds it gone: ``_ReadLock``)."""
    try:
        fd = os.open(ckpt, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # being read: kept for now
        os.close(fd)
        return
    except OSError:  # no flock here (saving needs it anyway): prune as before
        pass
    except BaseException:
        os.close(fd)
        raise
    trash = None
    try:
        trash = ckpt.parent / f".trash-{ckpt.name}-{uuid.uuid4().hex[:8]}"
        os.rename(ckpt, trash)
    finally:
        _unlock(fd)
    shutil.rmtree(trash, ignore_errors=True)


class _FiniteCheck:
    """Sees every chunk of a table's float arrays as it is written (write_safetensors'
    ``on_chunk``) and remembers whether all were finite; after the first NaN/Inf it stops
    looking. One vectorised pass over data the writer reads anyway."""

    def __init__(self) -> None:
        self.finite = True

    def __call__(self, name: str, chunk: np.ndarray) -> None:
        floating = chunk.dtype.kind == "f" or chunk.dtype == BFLOAT16
        if self.finite and floating and not np.isfinite(chunk).all():
            self.finite = False


def save(
    engine: Stateful,
    root: str | Path,
    keep: int | None = None,
    extra_tensors: Mapping[str, np.ndarray] | None = None,
    extra_metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write a new checkpoint of ``engine`` under ``root``; see the module docstring. Reads the
    engine through ``spec()`` and ``state_dict()`` (live views): call it while no update runs,
    as ``engine.save`` does (it holds the engine's lock)."""
    check_save_arguments(keep, extra_metadata, root, extra_tensors)
    step = engine.step
    if (
        isinstance(step, bool)
        or not isinstance(step, int | np.integer)
        or not 0 <= step <= MAX_STEP
    ):
        # what a restore accepts (the manifest's schema): never write a checkpoint none can load
        raise ValueError(
            f"the engine's step {step!r} is not an int in [0, 2**63): a checkpoint of it could "
            "not be restored; nothing was written"
        )
    step = int(step)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root):
        _remove_leftovers(root)
        # Created and locked under the root's lock, so no other save sees it unlocked.
        tmp = root / f".tmp-ckpt-step{step:012d}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        tmp_fd = os.open(tmp, os.O_RDONLY)
        try:
            _lock(tmp_fd, tmp, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new and ours: never contended
        except BaseException:
            os.close(tmp_fd)
            raise
    try:
        final = _write(engine, root, tmp, step, keep, extra_tensors, extra_metadata)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        _unlock(tmp_fd)
    return final


def _write(
    engine: Stateful,
    root: Path,
    tmp: Path,
    step: int,
    keep: int | None,
    extra_tensors: Mapping[str, np.ndarray] | None,
    extra_metadata: Mapping[str, Any] | None,
) -> Path:
    """Fill ``tmp`` (held locked by the caller), then number it and rename it into place."""
    spec = engine.spec()
    # keyed tables' rows gathered as they are written: a chunk of memory, not a copy
    state = engine.state_dict(lazy=True)
    files = {}
    # One file per logical table: "{table}" and "{table}/{slot}", row r = the table's id r.
    for i, entry in enumerate(spec["tables"]):
        name = entry["name"]
        entry["file"] = f"table-{i:03d}.safetensors"
        arrays = state["tables"][name]
        tensors = {name if key == WEIGHTS else f"{name}/{key}": a for key, a in arrays.items()}
        check = _FiniteCheck()
        with engine.sequential_access(name):
            digest = write_safetensors(
                tmp / entry["file"], tensors, {"table": name}, on_chunk=check
            )
        entry["finite"] = check.finite
        if entry["vocabulary_size"] is None:  # keyed: the lengths its tensors' shapes need
            counters = np.asarray(arrays["counters"])
            entry["keyed"] = {
                "rows": len(arrays["keys"]),
                "pending_keys": len(arrays["pending_keys"]),
                "times": True,  # last_time / data_time present (older checkpoints: absent)
                "total": {
                    k: int(counters[0, i] + counters[1, i]) for i, k in enumerate(KEYED_COUNTERS)
                },
            }
        files[entry["file"]] = {"sha256": digest, "bytes": (tmp / entry["file"]).stat().st_size}
    extra = {"file": None, "metadata": dict(extra_metadata or {})}
    if extra_tensors:
        digest = write_safetensors(tmp / EXTRA_FILE, dict(extra_tensors))
        size = (tmp / EXTRA_FILE).stat().st_size
        files[EXTRA_FILE] = {"sha256": digest, "bytes": size}
        extra["file"] = EXTRA_FILE
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "embengine_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "step": step,
        **spec,
        "finite": all(t["finite"] for t in spec["tables"]),
        "extra": extra,
        "files": files,
    }
    try:
        return commit(root, tmp, manifest, step, keep)
    except Committed as late:
        _committed_then_failed(late)


class Committed(Exception):
    """``commit`` renamed the checkpoint into place (``final``: complete, it restores), then
    failed with ``error`` while ``doing`` (syncing the root folder or pruning)."""

    def __init__(self, final: Path, doing: str, error: BaseException):
        super().__init__(f"{final}: {doing}: {error}")
        self.final, self.doing, self.error = final, doing, error


def commit(root: Path, tmp: Path, manifest: dict, step: int, keep: int | None) -> Path:
    """Write ``manifest`` (and its SHA-256) into the filled folder ``tmp``, sync it, and rename
    it into ``root`` as the next checkpoint of ``step`` (the commit point), then sync the root
    and prune past ``keep``: the checkpoint's folder. Numbered at the commit, under the root's
    lock: concurrent saves get distinct numbers, and the highest number is the last
    committed. A failure after the rename is a ``Committed`` (the save's error must say the
    checkpoint is there: ``_committed_then_failed``, the sharded save's own); before it,
    the error as it is, nothing committed. Both engines' saves end here."""
    text = json.dumps(manifest, indent=1, default=_json_default).encode()
    for name, data in (
        ("manifest.json", text),
        ("manifest.sha256", hashlib.sha256(text).hexdigest().encode()),
    ):
        with open(tmp / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    _fsync_dir(tmp)
    with _locked(root):
        seqs = [int(m[1]) for p in root.iterdir() if (m := _NAME.match(p.name))]
        final = root / checkpoint_name(max(seqs, default=0) + 1, step)
        os.rename(tmp, final)  # the commit point: what fails now fails a saved checkpoint
        doing = "syncing the root folder after the rename (a crash may still lose the name)"
        try:
            _fsync_dir(root)
            if keep is not None:
                doing = f"pruning the checkpoints past keep={keep} (older ones may remain)"
                _prune(root, keep)
        except BaseException as e:
            raise Committed(final, doing, e) from e
    return final


def _committed_then_failed(late: Committed) -> None:
    """A save committed ``late.final``, then failed (``commit``): raise a CheckpointError
    saying so, its ``path`` the checkpoint, chained to the failure, so that a caller does not
    save again believing nothing was saved (the sharded save's error,
    ``distributed.checkpoint._committed_then_failed``). An error that is not an Exception (a
    KeyboardInterrupt) is raised as it is, that text as a note."""
    error = late.error
    text = (
        f"the checkpoint {late.final} was committed (complete: it restores), but the save then "
        f"failed while {late.doing}: {type(error).__name__}: {error}"
    )
    if not isinstance(error, Exception):
        error.add_note(text)
        raise error
    raise CheckpointError(text, path=late.final) from error


def check_path(path, what: str) -> None:
    """TypeError naming ``what`` unless ``path`` is a str or os.PathLike."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{what} must be a path (str or os.PathLike), got {path!r:.80}")


def check_save_arguments(
    keep: int | None,
    extra_metadata: Mapping[str, Any] | None,
    root=".",
    extra_tensors: Mapping[str, np.ndarray] | None = None,
) -> None:
    """The ValueError / TypeError a save raises for its ``root``, ``keep``, ``extra_metadata``
    or ``extra_tensors`` before it writes anything (a sharded save checks them on every rank
    before its first collective)."""
    check_path(root, "the checkpoint root")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be an int >= 1 or None, got {keep!r}")
    if extra_tensors is not None:
        if not isinstance(extra_tensors, Mapping):
            kind = type(extra_tensors).__name__
            raise TypeError(f"extra_tensors must be a mapping of name -> array, got {kind}")
        for name, value in extra_tensors.items():
            if not isinstance(name, str):
                raise TypeError(f"extra_tensors: names must be str, got {name!r:.80}")
            if not isinstance(value, np.ndarray) or np.dtype(value.dtype) not in DTYPES:
                what = value.dtype if isinstance(value, np.ndarray) else type(value).__name__
                raise TypeError(
                    f"extra_tensors[{name!r}] must be a NumPy array of a safetensors dtype "
                    f"({', '.join(sorted(str(d) for d in DTYPES))}), got {what}"
                )
    if extra_metadata is not None:
        if not isinstance(extra_metadata, Mapping):
            kind = type(extra_metadata).__name__
            raise TypeError(f"extra_metadata must be a mapping, got {kind}")
        json.dumps(dict(extra_metadata), default=_json_default)


def _json_default(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    raise TypeError(f"extra_metadata holds {type(value).__name__}, which is not JSON")


# -- loading: the manifest's schema ---------------------------------------------------------------

# A file a manifest names: a plain name inside the checkpoint folder (no path, no "..", no leading
# dot), of a safetensors file; embengine writes table-000.safetensors and extra.safetensors.
_PLAIN_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.safetensors")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SLOT_DTYPES = {"float32": "F32", "int32": "I32"}
_MISSING = object()


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _file_name_problem(name) -> str | None:
    """Why ``name`` may not be read as a file of a checkpoint, or None."""
    if not isinstance(name, str):
        return f"is {type(name).__name__}, not a file name"
    if not _PLAIN_FILE.fullmatch(name) or ".." in name:
        return (
            f"{name!r} is not a plain *.safetensors name inside the checkpoint folder "
            "(letters, digits, '_', '-', '.'; no path, no '..', no leading dot): embengine "
            "reads only the checkpoint's own safetensors files, never pickle"
        )
    return None


class _Schema:
    """Type and presence checks of manifest keys, raising CheckpointError naming the key (as
    ``tables[1].optimizer.params``) and the manifest."""

    def __init__(self, ckpt: Path):
        self.where = ckpt / "manifest.json"

    def fail(self, key: str, problem: str) -> None:
        raise CheckpointError(f"{self.where}: {key} {problem}")

    def get(
        self,
        obj: dict,
        key: str,
        at: str,
        ok: Callable[[Any], bool],
        what: str,
        optional: bool = False,
    ) -> Any:
        """``obj[key]`` if ``ok`` accepts it (``what`` describes what it accepts); None if
        ``optional`` and absent."""
        name = f"{at}.{key}" if at else key
        value = obj.get(key, _MISSING)
        if value is _MISSING:
            if optional:
                return None
            self.fail(name, "is missing")
        if not ok(value):
            shown = repr(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            self.fail(name, f"must be {what}, got {shown}")
        return value

    def obj(self, obj: dict, key: str, at: str, optional: bool = False) -> dict | None:
        return self.get(obj, key, at, lambda v: isinstance(v, dict), "an object", optional)

    def items(self, obj: dict, key: str, at: str, empty: bool = False) -> list[tuple[str, dict]]:
        """(path, entry) of each object in the list ``obj[key]`` (which may be empty only if
        ``empty``)."""
        entries = self.get(
            obj,
            key,
            at,
            lambda v: isinstance(v, list) and (empty or len(v) > 0),
            "a list" if empty else "a non-empty list",
        )
        out = []
        for i, entry in enumerate(entries):
            path = f"{at}.{key}[{i}]" if at else f"{key}[{i}]"
            if not isinstance(entry, dict):
                self.fail(path, f"must be an object, got {type(entry).__name__}")
            out.append((path, entry))
        return out


def _check_schema(ckpt: Path, m: dict) -> None:
    """Every key the loaders (restore, load, export, inspect) read, with its type; then the file
    names; then the values, by building the table and feature configs load() builds. Runs
    before anything else reads the manifest, so a malformed manifest is always a
    CheckpointError naming the key, never a KeyError or TypeError from deep inside a loader."""
    s = _Schema(ckpt)
    s.get(m, "step", "", lambda v: _is_int(v) and 0 <= v <= MAX_STEP, "an int in [0, 2**63)")
    s.get(m, "seed", "", _is_int, "an int")
    s.get(m, "embengine_version", "", lambda v: isinstance(v, str), "a string")
    s.get(
        m,
        "backend",
        "",
        lambda v: isinstance(v, str) and v in BACKENDS,
        f"one of {BACKENDS}",
        optional=True,
    )
    s.get(
        m,
        "nonfinite_gradients",
        "",
        lambda v: isinstance(v, str) and v in NONFINITE_POLICIES,
        f"one of {NONFINITE_POLICIES}",
        optional=True,
    )
    s.get(m, "finite", "", lambda v: isinstance(v, bool), "true or false", optional=True)
    names: set[str] = set()
    for at, t in s.items(m, "tables", ""):
        name = s.get(t, "name", at, lambda v: isinstance(v, str) and v != "", "a non-empty string")
        if name in names:
            s.fail(f"{at}.name", f"{name!r} names an earlier table too")
        names.add(name)
        keyed = t.get("vocabulary_size") is None and "dynamic" in t
        size_ok = (lambda v: True) if keyed else (lambda v: _is_int(v) and v >= 1)
        s.get(
            t,
            "vocabulary_size",
            at,
            size_ok,
            "an int >= 1 (or null for a keyed table, which has 'dynamic')",
        )
        s.get(t, "dim", at, lambda v: _is_int(v) and v >= 1, "an int >= 1")
        if keyed:
            k = s.obj(t, "keyed", at)
            for key in ("rows", "pending_keys"):
                s.get(
                    k,
                    key,
                    f"{at}.keyed",
                    lambda v: _is_int(v) and 0 <= v < 2**48,
                    "an int in [0, 2**48)",
                )
            s.get(k, "times", f"{at}.keyed", lambda v: v is True, "true", optional=True)
            total = s.obj(k, "total", f"{at}.keyed", optional=True) or {}
            for key, v in total.items():
                if not (_is_int(v) and v >= 0):
                    s.fail(f"{at}.keyed.total.{key}", f"must be an int >= 0, got {v!r:.60}")
        elif "keyed" in t:
            s.fail(f"{at}.keyed", "is only for a keyed table (vocabulary_size null, 'dynamic')")
        for key in ("combiner", "storage", "file"):
            s.get(t, key, at, lambda v: isinstance(v, str), "a string")
        for key in ("weights_dtype", "slots_dtype"):  # only a 16-bit table's manifest has them
            s.get(
                t, key, at, lambda v: v in PRECISIONS, f"one of {list(PRECISIONS)}", optional=True
            )
        s.get(t, "finite", at, lambda v: isinstance(v, bool), "true or false", optional=True)
        s.get(
            t,
            "quantization_config",
            at,
            lambda v: v is None or isinstance(v, dict),
            "null or an object",
            optional=True,
        )
        if "compressor" in t:
            comp = s.obj(t, "compressor", at)
            s.get(
                comp,
                "compression",
                f"{at}.compressor",
                lambda v: v in COMPRESSIONS,
                f"one of {COMPRESSIONS}",
            )
            s.get(
                comp,
                "fixed_range",
                f"{at}.compressor",
                lambda v: _is_number(v) and math.isfinite(v) and v > 0,
                "a number > 0",
            )
        init = s.obj(t, "initializer", at)
        s.get(init, "class", f"{at}.initializer", lambda v: isinstance(v, str), "a string")
        s.obj(init, "params", f"{at}.initializer", optional=True)
        opt = s.obj(t, "optimizer", at)
        s.get(opt, "class", f"{at}.optimizer", lambda v: isinstance(v, str), "a string")
        params = s.obj(opt, "params", f"{at}.optimizer")
        lr_at = f"{at}.optimizer.params"
        lr = s.obj(params, "learning_rate", lr_at)
        lr_at += ".learning_rate"
        if "constant" in lr:
            s.get(lr, "constant", lr_at, _is_number, "a number")
        else:
            s.get(lr, "tag", lr_at, lambda v: _is_int(v) and v >= 0, "an int >= 0")
            s.get(lr, "callable", lr_at, lambda v: isinstance(v, str), "a string", optional=True)
        for slot_at, slot in s.items(t, "slots", at, empty=True):
            s.get(
                slot,
                "name",
                slot_at,
                lambda v: isinstance(v, str) and v != "",
                "a non-empty string",
            )
            s.get(slot, "width", slot_at, lambda v: _is_int(v) and v >= 1, "an int >= 1")
            s.get(slot, "initial_value", slot_at, _is_number, "a number")
            s.get(
                slot,
                "dtype",
                slot_at,
                lambda v: isinstance(v, str) and v in _SLOT_DTYPES,
                f"one of {sorted(_SLOT_DTYPES)}",
            )
    features: set[str] = set()
    for at, f in s.items(m, "features", ""):
        name = s.get(f, "name", at, lambda v: isinstance(v, str) and v != "", "a non-empty string")
        if name in features:
            s.fail(f"{at}.name", f"{name!r} names an earlier feature too")
        features.add(name)
        s.get(
            f,
            "table",
            at,
            lambda v: isinstance(v, str) and v in names,
            f"one of the tables {sorted(names)}",
        )
        s.get(f, "max_sequence_length", at, lambda v: _is_int(v) and v >= 0, "an int >= 0")
        s.get(f, "validate_weights_and_indices", at, lambda v: isinstance(v, bool), "true or false")
        s.get(
            f,
            "output_shape",
            at,
            lambda v: v is None or (isinstance(v, list) and all(_is_int(d) for d in v)),
            "null or a list of ints",
        )
    files = s.obj(m, "files", "")
    for name, info in files.items():
        problem = _file_name_problem(name)
        if problem is not None:
            s.fail("files", f"key {problem}")
        at = f"files[{name!r}]"
        if not isinstance(info, dict):
            s.fail(at, f"must be an object, got {type(info).__name__}")
        s.get(
            info,
            "sha256",
            at,
            lambda v: isinstance(v, str) and _SHA256.fullmatch(v),
            "64 lowercase hex digits",
        )
        s.get(info, "bytes", at, lambda v: _is_int(v) and v >= 0, "an int >= 0")
    extra = s.obj(m, "extra", "")
    s.get(extra, "file", "extra", lambda v: v is None or isinstance(v, str), "null or a string")
    s.obj(extra, "metadata", "extra")
    named = [(f"{at}.file", t["file"]) for at, t in s.items(m, "tables", "")]
    if extra["file"] is not None:
        named.append(("extra.file", extra["file"]))
    for key, name in named:
        problem = _file_name_problem(name)
        if problem is not None:
            s.fail(key, problem)
        if name not in files:
            s.fail(key, f"{name!r} is not listed in files (every file needs its sha256 and size)")
    _configs(ckpt, m)  # the values: what the configs accept


class _Every(Mapping):
    """A mapping that has every key, ``make()`` giving each its own value: the schema check's
    stand-ins for what a manifest names but does not hold (learning-rate callables, FromFunction
    initializers), so such a manifest is checked without the caller's objects. Distinct values
    per key: two callable tags must stay two tags."""

    def __init__(self, make: Callable[[], Any]):
        self.make = make
        self.made: dict = {}

    def __getitem__(self, key) -> Any:
        if key not in self.made:
            self.made[key] = self.make()
        return self.made[key]

    def __contains__(self, key) -> bool:
        return True

    def __iter__(self) -> Iterator:
        return iter(())

    def __len__(self) -> int:
        return 0


def _stand_in() -> Callable[[int], float]:
    """A new learning-rate function (a new object per tag)."""

    def rate(step: int) -> float:
        return 0.01

    return rate


def _configs(ckpt: Path, manifest: dict) -> None:
    """Build the feature and table configs a type-checked manifest describes (with stand-ins
    for callables and FromFunction initializers): a CheckpointError naming the entry for
    values the configs refuse, or slots that are not its optimizer's, before anything is
    allocated."""
    try:
        feature_configs_from_spec(manifest, _Every(_stand_in), _Every(Zeros))
    except SpecError as e:
        raise CheckpointError(f"{ckpt / 'manifest.json'}: {e}") from None


# -- loading: files -------------------------------------------------------------------------------


def own_file(file: Path) -> os.stat_result:
    """The lstat of a file a checkpoint or an export is read from (manifest.json,
    manifest.sha256, a listed safetensors file): a CheckpointError if it is missing or is not a
    regular file of its folder. A symbolic link could lead to any file the process can read, so
    links are refused, never followed."""
    try:
        st = os.lstat(file)
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(
            f"{file} is not a regular file (a symbolic link, folder or device): checkpoint and "
            "export files must be the folder's own files"
        )
    return st


# manifest.json and manifest.sha256 are read whole, so their size is capped before reading (a
# sparse file of many GiB costs nothing on disk). A manifest takes ~1.7 KB a table (its
# optimizer, initializer, slots and file) and ~0.2 KB a feature: 64 MiB holds ~40,000 tables,
# ten times the largest models' thousands, and parsing it takes a few hundred MB at most.
MAX_MANIFEST_BYTES = 64 << 20


def read_own_file(file: Path) -> bytes:
    """The bytes of ``file`` (manifest.json, manifest.sha256), a regular file of its folder
    (``own_file``) of at most MAX_MANIFEST_BYTES, opened without following a link (O_NOFOLLOW:
    a link swapped in after the check is refused too; O_NONBLOCK: a FIFO swapped in does not
    hang the open). A CheckpointError names the file and its size if it is larger."""
    size = own_file(file).st_size
    if size > MAX_MANIFEST_BYTES:
        raise CheckpointError(_too_large(file, size))
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(file, flags)
    except OSError as e:
        raise CheckpointError(f"{file} cannot be read ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{file} is not a regular file (replaced while being read)")
        if st.st_size > MAX_MANIFEST_BYTES:
            raise CheckpointError(_too_large(file, st.st_size))
        # its size and one byte more, never the cap: read(n) allocates n bytes up front
        data = f.read(st.st_size + 1)
    if len(data) > st.st_size:
        raise CheckpointError(f"{file} grew while being read (written meanwhile?)")
    return data


def _too_large(file: Path, size: int) -> str:
    return (
        f"{file} is {size:,} bytes, more than a manifest may be ({MAX_MANIFEST_BYTES:,} bytes, "
        "room for tens of thousands of tables): not an embengine manifest"
    )


def _resolve(path: str | Path) -> Path:
    path = Path(path)
    if (path / "manifest.json").is_file():
        return path
    if _NAME.match(path.name) and not os.path.lexists(path):  # a checkpoint's name, not a root
        raise CheckpointError(_gone(path))
    latest = latest_checkpoint(path)
    if latest is None:
        if not os.path.lexists(path):
            what = "does not exist"
        elif not path.is_dir():
            what = "is a file; give the checkpoint's folder (or the folder holding checkpoints)"
        else:
            what = (
                "holds neither manifest.json (a checkpoint's folder) nor complete ckpt-* "
                "folders (a folder of checkpoints)"
            )
        raise CheckpointError(f"no complete checkpoint at {path}: {what}")
    return latest


Headers = dict[str, tuple[dict, int]]


class _ReadLock:
    """A shared flock of a checkpoint folder while it is read, so that ``save(..., keep=N)``
    (in this process or another) does not delete it meanwhile: pruning skips a folder it cannot
    lock exclusively. Taken before the manifest is read; if the folder was renamed away before
    the lock was granted, a CheckpointError names it. Released by ``release()`` (or when
    collected). Where the file system has no flock, reading goes on without it."""

    def __init__(self, ckpt: Path):
        flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(ckpt, flags)
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointError(_gone(ckpt)) from None
        except OSError:  # not readable as a folder: the checks below say what is wrong
            self._finalize = None
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # a pruner holds it only while it renames
            st, now = os.fstat(fd), os.stat(ckpt)  # (a link to a checkpoint: its target)
        except FileNotFoundError:
            os.close(fd)
            raise CheckpointError(_gone(ckpt)) from None
        except OSError:  # no flock: read without it
            os.close(fd)
            self._finalize = None
            return
        except BaseException:
            os.close(fd)
            raise
        self._finalize = weakref.finalize(self, _unlock, fd)
        if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):  # renamed away, another put there
            self.release()
            raise CheckpointError(_gone(ckpt))

    def release(self) -> None:
        if self._finalize is not None:
            self._finalize()


def _gone(ckpt: Path) -> str:
    return (
        f"checkpoint {ckpt} is gone (deleted: a save with keep=N prunes older checkpoints, "
        "keeping only those being read); nothing was read. Restore another checkpoint, e.g. "
        "the newest: latest_checkpoint(root)"
    )


def check_verify(verify) -> None:
    """``verify`` of every reader of checkpoints and exports must be a bool: a string such as
    "no" is truthy, so it verified, silently (TypeError naming the value)."""
    if not isinstance(verify, bool):
        raise TypeError(f"verify must be True or False, got {verify!r}")


ManifestCheck = Callable[[Path, dict], None]


def _read(
    path: str | Path, verify: bool, check: ManifestCheck | None = None
) -> tuple[Path, dict, Headers, _ReadLock]:
    """(checkpoint directory, manifest, every file's checked safetensors header by name, the
    folder's read lock, held) after every check of the module docstring; ``verify=False``
    skips only the hashing. A folder of checkpoints whose newest is pruned before it is
    locked (two saves meanwhile) is resolved again. ``check(ckpt, manifest)``, if given, runs
    on the schema-checked (and, with ``verify``, checksummed) manifest before any table file
    is read or hashed: a caller's refusal comes before the minutes of hashing."""
    check_verify(verify)
    for attempt in range(3):
        ckpt = _resolve(path)
        try:
            lock = _ReadLock(ckpt)
            break
        except CheckpointError:
            if ckpt == Path(path) or attempt == 2:
                raise
    try:
        return (*_read_locked(ckpt, verify, check), lock)
    except BaseException:
        lock.release()
        raise


def _read_locked(
    ckpt: Path, verify: bool, check: ManifestCheck | None = None
) -> tuple[Path, dict, Headers]:
    raw = read_own_file(ckpt / "manifest.json")
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSON, UTF-8, too many digits, too deep
        raise CheckpointError(f"{ckpt / 'manifest.json'} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        fmt = manifest.get("format") if isinstance(manifest, dict) else None
        raise CheckpointError(
            f"{ckpt}: not an embengine checkpoint (format {fmt!r}); embengine never loads "
            "pickled or foreign formats"
        )
    version = manifest.get("format_version")
    if not _is_int(version) or version != FORMAT_VERSION:
        raise CheckpointError(
            f"{ckpt}: format version {version!r} is not supported "
            f"(this embengine reads version {FORMAT_VERSION})"
        )
    _check_schema(ckpt, manifest)
    digest_file = ckpt / "manifest.sha256"
    if verify and (
        not os.path.lexists(digest_file)
        or read_own_file(digest_file).strip() != hashlib.sha256(raw).hexdigest().encode()
    ):
        raise CheckpointError(
            f"checksum mismatch in {ckpt / 'manifest.json'}: the manifest was modified (or "
            "manifest.sha256 is missing)"
        )
    if check is not None:
        check(ckpt, manifest)
    files = manifest["files"]
    seen: dict[tuple[int, int], str] = {}
    for name, info in files.items():
        file = ckpt / name
        st = own_file(file)
        if st.st_size != info["bytes"]:
            raise CheckpointError(wrong_size(file, st.st_size, info["bytes"]))
        # A file under two names would be parsed and hashed once per name; embengine never
        # writes one.
        other = seen.setdefault((st.st_dev, st.st_ino), name)
        if other != name:
            raise CheckpointError(
                f"{file} and {ckpt / other} are one file (hard links): a checkpoint's files "
                "are distinct files"
            )
    if verify:
        for name, info in files.items():
            try:
                digest = sha256_file(ckpt / name)
            except OSError as e:
                raise CheckpointError(_unreadable(ckpt / name, e)) from None
            if digest != info["sha256"]:
                raise CheckpointError(f"checksum mismatch in {ckpt / name}: the file was modified")
    return ckpt, manifest, _check_tensors(ckpt, manifest)


def _unreadable(file: Path, e: OSError) -> str:
    return (
        f"{file} cannot be read ({e.strerror or e}): deleted or replaced while the checkpoint "
        "was being checked? Nothing was loaded"
    )


def read_manifest(path: str | Path, verify: bool = True) -> tuple[Path, dict]:
    """(checkpoint directory, manifest) after every check of the module docstring: format,
    version, schema, file names and sizes, safetensors headers against the manifest and, with
    ``verify``, every SHA-256. The checkpoint's read lock is released on return: a save's
    keep=N may prune it then (to read its files afterwards, use ``manifest_held``)."""
    with manifest_held(path, verify) as (ckpt, manifest):
        return ckpt, manifest


@contextlib.contextmanager
def manifest_held(path: str | Path, verify: bool = True) -> Iterator[tuple[Path, dict]]:
    """``read_manifest`` whose checkpoint stays locked (shared: ``_ReadLock``) for the block,
    so a save's keep=N does not prune it while the block reads its files (``embengine
    inspect`` reads the table headers again)."""
    ckpt, manifest, _, lock = _read(path, verify)
    try:
        yield ckpt, manifest
    finally:
        lock.release()


def _check_tensors(ckpt: Path, manifest: dict) -> Headers:
    """Every file's header is valid safetensors whose data ranges lie inside the file and hold
    exactly the bytes their shapes need (read_header), and every table file holds the weights
    and slots the manifest describes (names, dtypes, shapes). So nothing is allocated for a
    tensor the file does not hold, and a restore cannot fail halfway on a file at rest.

    Headers are parsed one file at a time, and only what the readers use is kept: a table
    file's entries of its table's tensors, the extra file's whole header (its tensors are all
    the caller's); other listed files are checked, then dropped. So however many files a
    manifest lists (each header up to 100 MB of JSON), one parsed header at a time is held."""
    tables: dict[str, list[dict]] = {}
    for t in manifest["tables"]:
        tables.setdefault(t["file"], []).append(t)
    extra = manifest["extra"]["file"]
    headers: Headers = {}
    for file_name in manifest["files"]:
        file = ckpt / file_name
        try:
            header, start = read_header(file)
        except ValueError as e:  # the message names the file and the tensor
            raise CheckpointError(str(e)) from None
        except OSError as e:
            raise CheckpointError(_unreadable(file, e)) from None
        kept = header if file_name == extra else {}
        for t in tables.get(file_name, ()):
            for name, (dtype, shape) in _expected_tensors(t).items():
                info = header.get(name)
                if info is None or name == "__metadata__":
                    raise CheckpointError(f"{file}: no tensor {name!r}")
                if info["dtype"] != dtype or info["shape"] != shape:
                    raise CheckpointError(
                        f"{file}: tensor {name!r} has dtype {info['dtype']} and shape "
                        f"{info['shape']}, expected {dtype} and shape {shape}"
                    )
                kept[name] = info
        if file_name in tables or file_name == extra:
            headers[file_name] = (kept, start)
        del header  # before the next file's is parsed
    return headers


def _expected_tensors(t: dict) -> dict[str, tuple[str, list[int]]]:
    """Tensor name -> (safetensors dtype, shape) of a schema-checked manifest table: weights
    "{table}" and slots "{table}/{slot}", a row per id; a keyed table's rows are its keys
    (``keyed.rows``), and it has the keyed entries of ``embengine.state`` too."""
    name = t["name"]
    slots = [(s["name"], s["width"], s["dtype"]) for s in t["slots"]]
    if t["vocabulary_size"] is None:
        sizes = {"n": t["keyed"]["rows"], "p": t["keyed"]["pending_keys"]}
        entries = keyed_entries(
            t["dim"], slots, t.get("weights_dtype", "float32"), t.get("slots_dtype", "float32")
        )
        if not t["keyed"].get("times", False):  # written before data time: none stored
            for key in TIME_ENTRIES:
                del entries[key]
    else:
        sizes = {}
        stored = _stored_dtypes(t)
        entries = {WEIGHTS: ((t["vocabulary_size"], t["dim"]), stored[WEIGHTS])}
        entries.update({s: ((t["vocabulary_size"], w), stored[s]) for s, w, _ in slots})
    return {
        name if key == WEIGHTS else f"{name}/{key}": (
            DTYPES[np.dtype(dtype)],
            [sizes.get(d, d) for d in shape],
        )
        for key, (shape, dtype) in entries.items()
    }


def _stored_dtypes(t: dict) -> dict[str, np.dtype]:
    """A manifest table's weights and slots -> the dtype they are stored in: its
    ``weights_dtype`` / ``slots_dtype`` (float32 when absent) for weights and float slots."""
    out = {WEIGHTS: numpy_dtype(t.get("weights_dtype", "float32"))}
    for s in t["slots"]:
        float_slot = s["dtype"] == "float32"
        out[s["name"]] = (
            numpy_dtype(t.get("slots_dtype", "float32")) if float_slot else (np.dtype(s["dtype"]))
        )
    return out


def _check_name(ckpt: Path, manifest: dict) -> None:
    match = _NAME.match(ckpt.name)
    if match and int(match[2]) != manifest["step"]:
        raise CheckpointError(
            f"{ckpt}: the manifest says step {manifest['step']!r} but the checkpoint was "
            f"written at step {int(match[2])}"
        )


def _check_compatible(engine_spec: dict, manifest: dict, ckpt: Path) -> None:
    """The engine (its ``spec()``) can take the checkpoint's state: the same tables, shapes,
    optimizers (but for the learning rate) and slots."""
    stored = {t["name"]: t for t in manifest["tables"]}
    mine = engine_spec["tables"]
    names = sorted(t["name"] for t in mine)
    if sorted(stored) != names:
        raise CheckpointError(f"{ckpt} holds tables {sorted(stored)}, the engine has {names}")
    for t in mine:
        s = stored[t["name"]]
        if (s["vocabulary_size"] is None) != (t["vocabulary_size"] is None):
            kinds = [
                "keyed" if v is None else "dense"
                for v in (s["vocabulary_size"], t["vocabulary_size"])
            ]
            raise CheckpointError(
                f"table {t['name']!r}: the checkpoint's table is {kinds[0]}, the engine's is "
                f"{kinds[1]} (vocabulary_size=None makes a keyed table)"
            )
        if (s["vocabulary_size"], s["dim"]) != (t["vocabulary_size"], t["dim"]):
            raise CheckpointError(
                f"table {t['name']!r}: checkpoint shape ({s['vocabulary_size']}, {s['dim']}) "
                f"differs from the engine's ({t['vocabulary_size']}, {t['dim']})"
            )
        for key in ("weights_dtype", "slots_dtype"):  # no silent cast: docs/design.md
            theirs, ours = s.get(key, "float32"), t.get(key, "float32")
            if theirs != ours:
                raise CheckpointError(
                    f"table {t['name']!r}: the checkpoint stores {key} {theirs!r}, the engine "
                    f"{ours!r}; restore into an engine built with TableConfig({key}={theirs!r}), "
                    "or cast explicitly in an EmbeddingEngine: load_state_dict(...) of the "
                    f"checkpoint's arrays converted with .astype(...) to {ours!r} (and save it, "
                    "for a ShardedEngine to restore)"
                )
        # The learning rate may be a callable, and packing is a storage hint: neither changes
        # what the stored slots mean.
        free = ("learning_rate", "low_dimensional_packing_status")
        a, b = dict(s["optimizer"]), dict(t["optimizer"])
        a["params"] = {k: v for k, v in a["params"].items() if k not in free}
        b["params"] = {k: v for k, v in b["params"].items() if k not in free}
        if a != b or s["slots"] != t["slots"]:
            raise CheckpointError(
                f"table {t['name']!r}: checkpoint optimizer {s['optimizer']['class']} "
                f"{a['params']} differs from the engine's {b['params']}"
            )


# -- loading: into an engine ----------------------------------------------------------------------

# Manifest keys that describe the checkpoint, not the engine: the rest is the engine's spec.
_CHECKPOINT_KEYS = (
    "format",
    "format_version",
    "embengine_version",
    "created",
    "step",
    "finite",
    "extra",
    "files",
)
_CHECKPOINT_TABLE_KEYS = ("file", "finite", "keyed")


# What to do about a checkpoint file that changed after it was checked.
_COPY_AGAIN = (
    "; copy the checkpoint again (whole), or use another checkpoint, and never write over a "
    "checkpoint that is being read"
)


def wrong_size(
    file: Path, size: int, expected: int, when: str = "", advice: str = _COPY_AGAIN
) -> str:
    """The error text of a checkpoint's or an export's file whose size is not its manifest's
    (``when``: since when, e.g. " while served"; ``advice``: what to do, a checkpoint's by
    default)."""
    return (
        f"{file} has {size:,} bytes, the manifest says {expected:,}: it was truncated or "
        f"replaced{when}{advice}"
    )


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a checked checkpoint file, not yet read: a ``state.TensorSource``.
    ``read_into(out)`` copies it chunk by chunk with read() (never a second copy of the table,
    and a file truncated meanwhile is an error, not a SIGBUS)."""

    file: Path
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    header: tuple[dict, int]

    def read_into(self, out: np.ndarray) -> None:
        read_tensor(self.file, self.name, out=out, header=self.header)


class CheckpointReader:
    """A checkpoint whose every check has passed (``read_checkpoint``): its step, extra data and
    tensors, for restoring into an engine or exporting. Keyed by logical table and row: table
    ``t``'s weights are the tensor ``t`` and its slots ``t/<slot>`` of its file, row ``r`` being
    id ``r``, whichever engine (packed or not, RAM or mmap) wrote or reads them."""

    def __init__(self, ckpt: Path, manifest: dict, headers: Headers, lock: _ReadLock | None = None):
        self.path = ckpt
        self.manifest = manifest
        self._headers = headers
        self._tables = {t["name"]: t for t in manifest["tables"]}
        self._lock = lock

    def close(self) -> None:
        """Let ``save(..., keep=N)`` prune the checkpoint again (while a reader is open, its
        folder is kept). Also when the reader is collected, or at the end of a ``with``."""
        if self._lock is not None:
            self._lock.release()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def step(self) -> int:
        return self.manifest["step"]

    @property
    def extra_metadata(self) -> dict:
        return self.manifest["extra"]["metadata"]

    @property
    def table_names(self) -> tuple[str, ...]:
        return tuple(self._tables)

    def file_of(self, table: str) -> Path:
        """The file holding ``table``'s tensors."""
        return self.path / self._tables[table]["file"]

    def tensor(self, table: str, entry: str = WEIGHTS) -> StoredTensor:
        """``table``'s weights (``entry="weights"``) or one of its slots, not yet read."""
        t = self._tables[table]
        name = table if entry == WEIGHTS else f"{table}/{entry}"
        header = self._headers[t["file"]]
        info = header[0][name]
        dtype = NUMPY[info["dtype"]].newbyteorder("<")
        if info["dtype"] == "BF16":  # a 16-bit table's bfloat16 values (read_tensor: bits)
            dtype = BFLOAT16
        return StoredTensor(self.path / t["file"], name, tuple(info["shape"]), dtype, header)

    def weights(self, table: str) -> np.ndarray:
        """``table``'s weights, memory-mapped read-only (no copy), in their stored dtype (a
        bfloat16 table's as ``ml_dtypes.bfloat16``). The file's size is checked before it is
        mapped (``check_size``); a file truncated while the array is in use would kill the
        process with SIGBUS at its next read past the end: ``rows`` reads without a map."""
        t = self._tables[table]
        self.check_size(table)
        out = read_tensor(self.path / t["file"], table, header=self._headers[t["file"]])
        return out.view(BFLOAT16) if self._is_bf16(table, table) else out

    def rows(self, table: str, entry: str = WEIGHTS) -> TensorRows | np.ndarray:
        """One of ``table``'s tensors (as ``array``), read on demand with read(), chunk by chunk
        (``safetensors_io.TensorRows``; what export reads): never mapped, so a file truncated
        meanwhile is a ValueError naming it and its sizes, not a SIGBUS. bfloat16 weights and
        slots come as ``ml_dtypes.bfloat16``. The file's size is checked first."""
        t = self._tables[table]
        if self._unstored_time(t, entry):
            return self._keyed_entry(table, entry)
        self.check_size(table)
        name = table if entry == WEIGHTS else f"{table}/{entry}"
        return TensorRows(
            self.path / t["file"],
            name,
            self._headers[t["file"]],
            dtype=BFLOAT16 if self._is_bf16(table, name) else None,
            advice=_COPY_AGAIN,
        )

    def _is_bf16(self, table: str, name: str) -> bool:
        """Whether tensor ``name`` of ``table``'s file holds bfloat16 values (a "BF16" tensor:
        read as their bits, uint16, and viewed as ``ml_dtypes.bfloat16``)."""
        return self._headers[self._tables[table]["file"]][0][name]["dtype"] == "BF16"

    def check_size(self, table: str) -> None:
        """Raise a CheckpointError if the file of ``table`` no longer has the size the manifest
        says (it was checked when the checkpoint was read; truncated since, a memory map of it
        would kill the process with SIGBUS at the first row past the end)."""
        file = self._tables[table]["file"]
        expected = self.manifest["files"][file]["bytes"]
        size = own_file(self.path / file).st_size
        if size != expected:
            raise CheckpointError(
                wrong_size(self.path / file, size, expected, " after the checkpoint was checked")
            )

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint as an engine state (embengine.state) of StoredTensors, for
        ``engine.load_state_dict``; nothing is read until then."""
        tables = {}
        for name, t in self._tables.items():
            tables[name] = {WEIGHTS: self.tensor(name)}
            tables[name].update({s["name"]: self.tensor(name, s["name"]) for s in t["slots"]})
            if self.is_keyed(name):
                tables[name].update({k: self._keyed_entry(name, k) for k in KEYED_ENTRIES})
        return {"step": self.step, "tables": tables}

    def _keyed_entry(self, table: str, entry: str):
        """A keyed table's entry as a StoredTensor; a checkpoint written before data time
        (no ``keyed.times``) has no ``last_time`` / ``data_time``: "no time" (NO_TIME) for
        every row and the table, what a table that never saw a timestamp holds."""
        t = self._tables[table]
        if entry in TIME_ENTRIES and not t["keyed"].get("times", False):
            n = 1 if entry == "data_time" else t["keyed"]["rows"]
            return np.full(n, NO_TIME, np.int64)
        return self.tensor(table, entry)

    @staticmethod
    def _unstored_time(t: dict, entry: str) -> bool:
        """Whether ``entry`` of the manifest's table ``t`` is a keyed table's data time that
        a checkpoint written before data time does not hold (``_keyed_entry`` makes it)."""
        return (
            t["vocabulary_size"] is None
            and entry in TIME_ENTRIES
            and not t["keyed"].get("times", False)
        )

    def is_keyed(self, table: str) -> bool:
        """Whether ``table`` is keyed (``vocabulary_size`` null): its rows are its ``keys``."""
        return self._tables[table]["vocabulary_size"] is None

    def array(self, table: str, entry: str) -> np.ndarray:
        """One of ``table``'s tensors (``entry``: "weights", a slot, or a keyed table's entry
        such as "keys" or "last_touched"), memory-mapped read-only (no copy), in its stored
        dtype (bfloat16 as ``ml_dtypes.bfloat16``). The file's size is checked before it is
        mapped, as in ``weights``."""
        t = self._tables[table]
        if self._unstored_time(t, entry):
            return self._keyed_entry(table, entry)
        self.check_size(table)
        name = table if entry == WEIGHTS else f"{table}/{entry}"
        out = read_tensor(self.path / t["file"], name, header=self._headers[t["file"]])
        return out.view(BFLOAT16) if self._is_bf16(table, name) else out

    def extra_tensors(self) -> dict[str, np.ndarray]:
        """The caller's extra tensors (saved with ``extra_tensors=``), read into memory."""
        extra = self.manifest["extra"]
        tensors: dict[str, np.ndarray] = {}
        if extra["file"] is None:
            return tensors
        file = self.path / extra["file"]
        header = self._headers[extra["file"]]
        try:
            for name, info in header[0].items():
                if name != "__metadata__":
                    out = np.empty(info["shape"], dtype=NUMPY[info["dtype"]].newbyteorder("<"))
                    out = read_tensor(file, name, out=out, header=header)
                    # a bfloat16 tensor's bits, as bfloat16 again
                    tensors[name] = out.view(BFLOAT16) if info["dtype"] == "BF16" else out
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{file}: cannot be read ({e}); the engine is unchanged") from e
        return tensors

    def restore(self, engine: Stateful) -> CheckpointInfo:
        """Copy the checkpoint's tables and step into ``engine`` (``engine.load_state_dict``,
        which checks every entry and copies under the engine's lock), after checking that the
        engine's configuration can take them. See the module docstring for a failure midway."""
        _check_compatible(engine.spec(), self.manifest, self.path)
        tensors = self.extra_tensors()  # first: a failure here leaves the engine untouched
        try:
            engine.load_state_dict(self.state_dict())
        except (TypeError, ValueError) as e:  # checked before any change (a keyed table's values)
            raise CheckpointError(f"{self.path}: {e}; the engine is unchanged") from e
        except (OSError, MemoryError) as e:  # a keyed table's room, made before any change
            raise CheckpointError(
                f"{self.path}: cannot make room for the checkpoint's rows ({e}); the engine is "
                "unchanged"
            ) from e
        except PartialLoadError as e:
            cause = e.__cause__ if e.__cause__ is not None else e
            raise CheckpointError(
                f"{self.path}: restore failed while copying table {e.table!r} from "
                f"{self.file_of(e.table)} ({cause}) after every check had passed (the file "
                f"changed or could not be read). Tables {e.done} and part of {e.table!r} now "
                f"hold the checkpoint's values, the step is still {e.step}: restore a "
                "checkpoint again before using the engine"
            ) from cause
        return CheckpointInfo(self.path, engine.step, tensors, self.extra_metadata)


def _spec_of(manifest: dict) -> dict[str, Any]:
    """The engine spec a manifest holds (embengine.spec): the manifest without the
    checkpoint's own keys."""
    spec = {k: v for k, v in manifest.items() if k not in _CHECKPOINT_KEYS}
    spec["tables"] = [
        {k: v for k, v in t.items() if k not in _CHECKPOINT_TABLE_KEYS} for t in manifest["tables"]
    ]
    return spec


def read_checkpoint(
    path: str | Path, verify: bool = True, *, check: ManifestCheck | None = None
) -> tuple[dict, CheckpointReader]:
    """(the engine spec, a CheckpointReader) of the checkpoint at ``path`` (a checkpoint
    directory, or a folder of them: the newest), after every check of the module docstring, so
    an engine built from the spec is never larger than the files that fill it.
    ``EmbeddingEngine.load`` is ``from_spec(spec)`` then ``reader.restore(engine)``.

    ``check(checkpoint folder, manifest)``, if given, runs on the manifest (schema-checked,
    and with ``verify`` checksummed) before any table file is read or hashed; what it raises
    propagates, the checkpoint's lock released (export's unknown ``--table`` names)."""
    ckpt, manifest, headers, lock = _read(path, verify, check)
    try:
        _check_name(ckpt, manifest)
    except BaseException:
        lock.release()
        raise
    return _spec_of(manifest), CheckpointReader(ckpt, manifest, headers, lock)


def restore(engine: Stateful, path: str | Path, verify: bool = True) -> CheckpointInfo:
    """Load tables, slots and step into an engine built from the same configs. Every check
    (module docstring) passes before the first table byte changes, whatever ``verify`` says."""
    _, reader = read_checkpoint(path, verify)
    with reader:
        return reader.restore(engine)
