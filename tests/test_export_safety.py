"""Export hardening: where ``export`` may write (never over a checkpoint or other files; --replace
replaces only a previous export; no temporary folders left behind, even by killed exports), the
export manifest's checksum and plain file names, and corrupt exports refused with
CheckpointError before anything is mapped."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import embengine as ee
from embengine import cli
from embengine import optimizers as O
from embengine.checkpoint import (
    CheckpointError,
    checkpoint_name,
    latest_checkpoint,
    read_manifest,
)
from embengine.serving import SERVING_FORMAT, ServingEngine, export, read_serving_manifest

REPO = Path(__file__).resolve().parents[1]
B = 6


def _engine() -> ee.EmbeddingEngine:
    one = ee.TableConfig(60, 8, name="one", combiner="sum")
    bag = ee.TableConfig(50, 4, name="bag", combiner="mean")
    rows = ee.TableConfig(40, 4, name="rows", combiner="sum")
    feats = {
        "one": ee.FeatureConfig(one),
        "bag": ee.FeatureConfig(bag),
        "rows": ee.FeatureConfig(rows, max_sequence_length=2),
    }
    eng = ee.EmbeddingEngine(feats, optimizer=O.SGD(learning_rate=0.5), seed=3, backend="reference")
    acts = eng.lookup(_inputs())
    eng.apply_gradients({k: np.ones_like(v) for k, v in acts.items()})
    return eng


def _inputs() -> dict:
    rng = np.random.default_rng(0)
    lengths = np.array([0, 1, 2, 3, 1, 2])
    return {
        "one": rng.integers(0, 60, size=B),
        "bag": ee.Ragged(rng.integers(0, 50, size=lengths.sum()), lengths=lengths),
        "rows": ee.Ragged(rng.integers(0, 40, size=lengths.sum()), lengths=lengths),
    }


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory) -> Path:
    """A folder of checkpoints (two, so it is a root, not a single checkpoint)."""
    root = tmp_path_factory.mktemp("ck") / "root"
    eng = _engine()
    eng.save(root)
    eng.save(root)
    return root


@pytest.fixture(scope="module")
def ckpt(ckpt_root) -> Path:
    path, _ = read_manifest(ckpt_root)
    return path


# Table 0 fp16, table 1 fixed_r8, table 2 int8_rowwise: every kind of stored tensors.
PER_TABLE = {"bag": "fixed_r8", "rows": "int8_rowwise"}


def _export(ckpt: Path, out: Path, **kwargs):
    return export(ckpt, out, compress="fp16", per_table=PER_TABLE, **kwargs)


def _snapshot(folder: Path) -> dict[str, str]:
    """Relative path -> SHA-256 of every file under ``folder``."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _leftovers(parent: Path) -> list[str]:
    return sorted(
        p.name for p in parent.iterdir() if p.name.startswith((".export-", ".tmp-", ".old-"))
    )


# -- item 7: what export may write over -----------------------------------------------------------


@pytest.mark.parametrize("replace", [False, True])
def test_export_refuses_the_checkpoint_folder(ckpt_root, ckpt, replace):
    before = _snapshot(ckpt_root)
    with pytest.raises(ValueError, match=r"is the checkpoint being exported"):
        _export(ckpt, ckpt, replace=replace)
    with pytest.raises(ValueError, match=r"is the checkpoint being exported"):
        _export(ckpt_root, ckpt_root, replace=replace)  # a folder of checkpoints, newest taken
    assert _snapshot(ckpt_root) == before
    read_manifest(ckpt, verify=True)
    assert not _leftovers(ckpt_root) and not _leftovers(ckpt_root.parent)


@pytest.mark.parametrize("replace", [False, True])
def test_export_refuses_a_parent_of_the_checkpoint(ckpt_root, ckpt, replace):
    before = _snapshot(ckpt_root.parent)
    for out in (ckpt_root, ckpt_root.parent):
        with pytest.raises(ValueError, match=r"holds the checkpoint being exported.*never"):
            _export(ckpt, out, replace=replace)
    with pytest.raises(ValueError, match=r"holds the checkpoint being exported"):
        _export(ckpt_root, ckpt_root.parent, replace=replace)
    assert _snapshot(ckpt_root.parent) == before
    assert not _leftovers(ckpt_root) and not _leftovers(ckpt_root.parent)


def test_export_refuses_a_folder_inside_the_checkpoint(ckpt_root, ckpt):
    before = _snapshot(ckpt_root)
    for src, out in ((ckpt, ckpt / "serving"), (ckpt_root, ckpt_root / "serving")):
        with pytest.raises(ValueError, match=r"is inside the checkpoint being exported"):
            _export(src, out)
    assert _snapshot(ckpt_root) == before
    assert not (ckpt / "serving").exists() and not (ckpt_root / "serving").exists()


@pytest.mark.parametrize("replace", [False, True])
def test_export_never_replaces_other_checkpoints(ckpt, tmp_path, replace):
    other_root = tmp_path / "other"
    _engine().save(other_root)
    other, _ = read_manifest(other_root)
    before = _snapshot(other_root)
    with pytest.raises(
        ValueError,
        match=r"holds a checkpoint \(manifest.json of format "
        r"'embengine-checkpoint'\); a checkpoint is never replaced",
    ):
        _export(ckpt, other, replace=replace)
    with pytest.raises(ValueError, match=r"holds checkpoints \('ckpt-000001-.*never replaced"):
        _export(ckpt, other_root, replace=replace)
    assert _snapshot(other_root) == before
    assert not _leftovers(tmp_path)


def test_export_refuses_a_folder_with_user_files(ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(
        ValueError,
        match=r"out is not empty \(it holds 'notes.txt'\); pass "
        r"--replace \(replace=True\) to replace a previous export",
    ):
        _export(ckpt, out)
    with pytest.raises(
        ValueError,
        match=r"out is not an embengine export .*only a previous "
        r"export, never other files",
    ):
        _export(ckpt, out, replace=True)
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert _leftovers(tmp_path) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"file is a file, not a folder"):
        _export(ckpt, tmp_path / "file", replace=True)
    assert (tmp_path / "file").read_text() == "x"


def test_export_refuses_a_previous_export_with_user_files(ckpt, tmp_path):
    out = tmp_path / "out"
    _export(ckpt, out)
    (out / "notes.txt").write_text("mine")
    (out / "sub").mkdir()
    before = _snapshot(out)
    with pytest.raises(
        ValueError,
        match=r"holds 'notes.txt', 'sub', which its export manifest "
        r"does not list; .* never replaced",
    ):
        _export(ckpt, out, replace=True)
    assert _snapshot(out) == before
    assert _leftovers(tmp_path) == []


def test_export_over_a_previous_export_needs_replace(ckpt, tmp_path):
    out = tmp_path / "out"
    _export(ckpt, out)
    before = _snapshot(out)
    with pytest.raises(ValueError, match=r"out is not empty .* pass --replace \(replace=True\)"):
        export(ckpt, out, compress="fp32")
    assert _snapshot(out) == before
    export(ckpt, out, compress="fp32", replace=True)
    manifest = json.loads((out / "manifest.json").read_text())
    assert {t["compression"] for t in manifest["tables"]} == {"fp32"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing aside, nothing tmp
    ServingEngine.load(out)


def test_export_into_an_empty_folder(ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    report = _export(ckpt, out)
    assert report.path == out
    ServingEngine.load(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_export_refuses_a_symlink_and_a_replace_that_is_not_a_bool(ckpt, tmp_path):
    """A symbolic link OUT (here to a previous export) is refused, not replaced by a folder:
    the link would silently stop pointing where its owner chose."""
    target = tmp_path / "v1"
    _export(ckpt, target)
    before = _snapshot(target)
    (tmp_path / "current").symlink_to(target)
    with pytest.raises(ValueError, match=r"current is a symbolic link; pass the folder"):
        _export(ckpt, tmp_path / "current", replace=True)
    assert (tmp_path / "current").is_symlink() and _snapshot(target) == before
    with pytest.raises(TypeError, match=r"replace must be True or False, got 'yes'"):
        _export(ckpt, tmp_path / "new", replace="yes")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current", "v1"]


def test_export_takes_a_path_as_the_os_does(ckpt, tmp_path, monkeypatch):
    """``link/../out`` is ``out`` beside the link's target, as mkdir makes it, not ``./out``
    (os.path.abspath folded the ".." by the letters)."""
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "link").symlink_to(tmp_path / "real" / "sub")
    monkeypatch.chdir(tmp_path / "work")
    _export(ckpt, Path("link/../out"))
    ServingEngine.load(tmp_path / "real" / "out")
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["link"]


@pytest.mark.parametrize("where", ["parent", "grandparent", "name", "beside"])
def test_export_refuses_a_folder_it_cannot_make_before_reading_the_checkpoint(
    ckpt, tmp_path, monkeypatch, where
):
    """A file among OUT's parents, or a name too long for OUT or for the temporary folder
    export writes beside it: refused before the checkpoint is read, naming the cause. They
    were bare OS errors after the checkpoint had been read and hashed ("File exists" naming
    the parent, "File name too long")."""
    from embengine import serving

    (tmp_path / "afile").write_text("a file")
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    beside = len(f".export--{os.getpid()}-12345678")  # what the temporary folder adds
    parent = r"cannot be made: \S*afile is a file, not a folder"
    out, words = {
        "parent": (tmp_path / "afile" / "out", parent),
        "grandparent": (tmp_path / "afile" / "sub" / "out", parent),
        "name": (tmp_path / ("x" * (limit + 1)), rf"is {limit + 1} bytes; a name in "),
        "beside": (
            tmp_path / ("y" * (limit - beside + 1)),
            rf"is {limit - beside + 1} bytes, and export writes it beside as '\.export-yyyyyyyy"
            rf"\.\.\.' \({limit + 1} bytes\); a name in \S+ takes at most {limit}",
        ),
    }[where]

    def read(*args, **kwargs):
        raise AssertionError("the checkpoint was read")

    monkeypatch.setattr(serving, "read_checkpoint", read)
    with pytest.raises(ValueError, match=words):
        _export(ckpt, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_export_takes_the_longest_name_its_temporary_folder_allows(ckpt, tmp_path):
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    out = tmp_path / ("z" * (limit - len(f".export--{os.getpid()}-12345678")))
    _export(ckpt, out)
    ServingEngine.load(out)


@pytest.mark.parametrize("out", [".", ".."])
def test_export_refuses_the_current_folder_and_those_holding_it(ckpt, tmp_path, monkeypatch, out):
    """An export is renamed into place: into the (empty) current folder it took the folder away
    from under the shell, which saw an empty, unlinked folder."""
    here = tmp_path / "empty"
    here.mkdir()
    monkeypatch.chdir(here)
    with pytest.raises(ValueError, match="is the current folder or holds it"):
        _export(ckpt, Path(out))
    assert here.is_dir() and not list(here.iterdir())


def test_replace_accepts_an_export_written_before_manifest_sha256(ckpt, tmp_path):
    out = tmp_path / "out"
    _export(ckpt, out)
    (out / "manifest.sha256").unlink()  # what older embengines wrote
    export(ckpt, out, compress="fp32", replace=True)
    assert (out / "manifest.sha256").is_file()
    ServingEngine.load(out)


_FAILING_EXPORT = """
import os, resource, signal, sys
from embengine.serving import export
ckpt, out, replace, ignore = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1"
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
# Ignored (Python's default), a write past the limit fails with EFBIG, like a full disk; with
# the signal's default action the kernel kills the process midway through the write.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN if ignore else signal.SIG_DFL)
print(os.getpid(), flush=True)
resource.setrlimit(resource.RLIMIT_FSIZE, (1500, resource.RLIM_INFINITY))
try:
    export(ckpt, out, compress="fp32", replace=replace)  # table 0 alone is 1920 bytes
except OSError as e:
    print(f"OSError {e.errno}", flush=True)
    sys.exit(3)
"""


def _failing_export(ckpt: Path, out: Path, replace: bool, ignore_sigxfsz: bool):
    args = [str(ckpt), str(out), "1" if replace else "0", "1" if ignore_sigxfsz else "0"]
    return subprocess.run(
        [sys.executable, "-c", _FAILING_EXPORT, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("previous", [False, True], ids=["new", "replace"])
def test_a_failed_export_removes_its_temporary_folder(ckpt, tmp_path, previous):
    out = tmp_path / "out"
    if previous:
        _export(ckpt, out)
    before = _snapshot(tmp_path)
    res = _failing_export(ckpt, out, replace=previous, ignore_sigxfsz=True)
    assert res.returncode == 3, (res.stdout, res.stderr)
    assert "OSError 27" in res.stdout  # EFBIG: the write failed midway
    assert _leftovers(tmp_path) == []
    assert _snapshot(tmp_path) == before  # the previous export (or nothing) is untouched
    if previous:
        ServingEngine.load(out)


def test_leftovers_of_killed_exports_are_removed_by_the_next_export(ckpt, tmp_path):
    out = tmp_path / "out"
    killed = _failing_export(ckpt, out, replace=False, ignore_sigxfsz=False)
    assert killed.returncode == -signal.SIGXFSZ, (killed.stdout, killed.stderr)
    dead_pid = int(killed.stdout.split()[0])
    left = _leftovers(tmp_path)
    assert len(left) == 1 and left[0].startswith(f".export-out-{dead_pid}-"), left
    # A running export of another process (a live pid, a folder younger than it) is left alone,
    # so is one of this process (another thread may be exporting) and any other OUT's.
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.1)
        keep = [
            tmp_path / f".export-out-{live.pid}-0000abcc",
            tmp_path / f".tmp-out-{live.pid}-0000abcd",
            tmp_path / f".tmp-out-{os.getpid()}-0000abce",
            tmp_path / f".tmp-other-{dead_pid}-0000abcf",
            tmp_path / f".tmp-out-{dead_pid}-notours",
        ]
        # Older than the process that has its pid now (pid reused), or unnamed and older than
        # this process (written by an embengine before pids were in the names): stale.
        stale = [
            tmp_path / f".export-out-{os.getpid()}-0000abcf",
            tmp_path / f".tmp-out-{os.getpid()}-0000abd0",
            tmp_path / ".tmp-out-0000abd1",
            tmp_path / f".old-out-{dead_pid}-0000abd2",
        ]
        for p in keep + stale:
            p.mkdir()
            (p / "table-000.safetensors").write_bytes(b"partial")
        for p in stale[:3]:
            os.utime(p, (1e9, 1e9))  # 2001
        _export(ckpt, out)
        assert sorted(_leftovers(tmp_path)) == sorted(p.name for p in keep)
    finally:
        live.kill()
        live.wait(timeout=10)
    ServingEngine.load(out)


@pytest.mark.parametrize("replace", [False, True])
def test_export_refuses_a_folder_named_like_a_checkpoint(ckpt_root, ckpt, tmp_path, replace):
    """``export CKPT root/ckpt-000009-step000000000123`` wrote an export that the folder of
    checkpoints listed as its newest checkpoint (restore(root) then failed "not an embengine
    checkpoint"), and a save there deleted that OUT while it was empty. Refused wherever it
    is, before the checkpoint is read, and nothing written; an earlier export of that name is
    not replaced either."""
    before = _snapshot(ckpt_root)
    name = checkpoint_name(9, 123)
    words = rf"export folder .*/{name} is named like a checkpoint \('{name}'.*choose another name"
    for out in (ckpt_root / name, tmp_path / name):
        with pytest.raises(ValueError, match=words):
            _export(ckpt, out, replace=replace)
        assert not out.exists()
        with pytest.raises(ValueError, match=words):  # before the checkpoint is read
            _export(tmp_path / "no-checkpoint-here", out, replace=replace)
    earlier = tmp_path / name
    _export(ckpt, tmp_path / "served")
    (tmp_path / "served").rename(earlier)  # an older embengine's export of that name
    served = _snapshot(earlier)
    with pytest.raises(ValueError, match=words):
        _export(ckpt, earlier, replace=replace)
    assert _snapshot(earlier) == served and _snapshot(ckpt_root) == before
    assert _leftovers(tmp_path) == [] and _leftovers(ckpt_root) == []
    assert latest_checkpoint(ckpt_root) == ckpt


def test_a_save_beside_an_export_named_ckpt_leaves_the_export_in_progress(tmp_path, monkeypatch):
    """An export whose OUT is named ``ckpt-*`` inside a folder of checkpoints wrote its tables
    to ``.tmp-ckpt-<...>``, the name of a save's temporary folder; a save there meanwhile took
    it for a killed save's (unlocked) and removed it, and the export failed midway
    (FileNotFoundError). A real save runs between the export's table writes here."""
    from embengine import serving

    eng = _engine()
    root = tmp_path / "root"
    ckpt = eng.save(root)
    out = root / "ckpt-export"
    write, saves = serving.write_safetensors, []

    def save_then_write(*args, **kwargs):
        saves.append(eng.save(root))  # cleans up the leftovers of killed saves in root
        return write(*args, **kwargs)

    monkeypatch.setattr(serving, "write_safetensors", save_then_write)
    _export(ckpt, out)
    assert len(saves) == 3
    ServingEngine.load(out)
    assert _leftovers(root) == []


def test_an_export_never_removes_a_running_save_s_folder(tmp_path):
    """An older embengine's export leftovers, ``.tmp-<OUT>-<pid>-<random>`` or
    ``.tmp-<OUT>-<random>``, are removed by the next export; with OUT named
    ``ckpt-step000000000001-<pid>`` that was also a running save's folder, of a trainer with
    that pid started before the exporting process: removed under the save. A save's folder is
    the saves' to remove (a killed one's: unlocked), and they still do."""
    import fcntl

    eng = _engine()
    root = tmp_path / "root"
    ckpt = eng.save(root)
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        saving = root / f".tmp-ckpt-step000000000001-{trainer.pid}-0000abcd"
        saving.mkdir()
        (saving / "table-000.safetensors").write_bytes(b"partial")
        os.utime(saving, (1e9, 1e9))  # the save began before this process
        fd = os.open(saving, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # as the running save holds it
            _export(ckpt, root / f"ckpt-step000000000001-{trainer.pid}")
            assert (saving / "table-000.safetensors").read_bytes() == b"partial"
            eng.save(root)
            assert saving.is_dir()
        finally:
            os.close(fd)  # the save was killed
        eng.save(root)
        assert not saving.exists()
    finally:
        trainer.kill()
        trainer.wait(timeout=10)


def test_a_save_removes_only_the_trash_of_its_own_prunes(tmp_path):
    """A save removes ``.trash-ckpt-*`` (a killed prune's), not every ``.trash-*`` folder."""
    eng = _engine()
    root = tmp_path / "root"
    root.mkdir()
    mine, other = root / ".trash-ckpt-000001-step000000000000-0000abcd", root / ".trash-notes"
    for d in (mine, other):
        d.mkdir()
        (d / "a.txt").write_text("a")
    eng.save(root)
    assert not mine.exists() and (other / "a.txt").read_text() == "a"


# -- the command line -----------------------------------------------------------------------------


def test_cli_export_refusals_and_replace(ckpt_root, ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # main() would set it for the process
    before = _snapshot(ckpt_root)
    assert cli.main(["export", str(ckpt), str(ckpt), "--replace"]) == 2
    err = capsys.readouterr().err
    assert f"embengine export: error: export folder {ckpt} is the checkpoint" in err
    assert cli.main(["export", str(ckpt), str(ckpt_root)]) == 2
    assert "holds the checkpoint being exported" in capsys.readouterr().err
    named = ckpt_root / checkpoint_name(9, 123)
    assert cli.main(["export", str(ckpt), str(named)]) == 2
    err = capsys.readouterr().err
    assert f"embengine export: error: export folder {named} is named like a checkpoint" in err
    assert _snapshot(ckpt_root) == before

    out = tmp_path / "out"
    assert cli.main(["export", str(ckpt), str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert cli.main(["export", str(ckpt), str(out), "--compress", "fp32"]) == 2
    err = capsys.readouterr().err
    assert f"export folder {out} is not empty" in err and "--replace" in err
    assert cli.main(["export", str(ckpt), str(out), "--compress", "fp32", "--replace"]) == 0
    capsys.readouterr()
    manifest = json.loads((out / "manifest.json").read_text())
    assert {t["compression"] for t in manifest["tables"]} == {"fp32"}

    user = tmp_path / "user"
    user.mkdir()
    (user / "data.csv").write_text("1,2")
    assert cli.main(["export", str(ckpt), str(user), "--replace"]) == 2
    assert "is not an embengine export" in capsys.readouterr().err
    assert (user / "data.csv").read_text() == "1,2"
    assert _leftovers(tmp_path) == []


# -- items 4, 5/12: the export manifest -----------------------------------------------------------


@pytest.fixture
def exported(ckpt, tmp_path) -> Path:
    out = tmp_path / "out"
    _export(ckpt, out)
    return out


def _write_manifest(path: Path, manifest: dict | bytes) -> None:
    """Rewrite manifest.json with a matching manifest.sha256, so only the content checks can
    refuse it."""
    raw = manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode()
    (path / "manifest.json").write_bytes(raw)
    (path / "manifest.sha256").write_text(hashlib.sha256(raw).hexdigest())


def test_export_writes_a_checksummed_manifest_of_plain_names(exported):
    raw = (exported / "manifest.json").read_bytes()
    assert (exported / "manifest.sha256").read_text() == hashlib.sha256(raw).hexdigest()
    manifest = json.loads(raw)
    assert manifest["format"] == SERVING_FORMAT
    names = sorted(p.name for p in exported.iterdir())
    assert names == ["manifest.json", "manifest.sha256", *sorted(manifest["files"])]
    for name, info in manifest["files"].items():
        assert "/" not in name and name.endswith(".safetensors")
        data = (exported / name).read_bytes()
        assert info == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def test_manifest_checksum_is_verified(exported):
    manifest = json.loads((exported / "manifest.json").read_text())
    manifest["source_step"] = 7  # a valid manifest, but not the one manifest.sha256 was made of
    (exported / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"checksum mismatch in .*manifest.json"):
        ServingEngine.load(exported)
    ServingEngine.load(exported, verify=False)  # skips only the hashing


def test_export_without_manifest_sha256_needs_verify_false(ckpt, exported):
    """The rule for exports written before manifest.sha256: verify=True refuses them and says
    how to re-export; verify=False loads them with every other check."""
    want = ServingEngine.load(exported).lookup(_inputs())
    (exported / "manifest.sha256").unlink()
    words = r"no manifest.sha256.*re-export it with `embengine export CKPT OUT --replace`, or "
    with pytest.raises(CheckpointError, match=words + "load it with verify=False"):
        ServingEngine.load(exported)
    got = ServingEngine.load(exported, verify=False).lookup(_inputs())
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    f = exported / "table-001.safetensors"
    f.write_bytes(f.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match=r"table-001.safetensors has \d+ bytes, the manifest"):
        ServingEngine.load(exported, verify=False)  # sizes are checked even without hashing


@pytest.mark.parametrize("how", ["absolute", "dotdot", "table-file-only"])
@pytest.mark.parametrize("verify", [True, False])
def test_manifest_paths_outside_the_export_are_refused(ckpt, exported, tmp_path, how, verify):
    """A manifest naming a real, correctly hashed safetensors file outside the folder (in
    ``files`` and the table, or only in the table: that one was read unchecked)."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    target = outside / "table-000.safetensors"
    target.write_bytes((exported / "table-000.safetensors").read_bytes())
    manifest = json.loads((exported / "manifest.json").read_text())
    info = manifest["files"].pop("table-000.safetensors")
    name = {
        "absolute": str(target),
        "dotdot": "../elsewhere/table-000.safetensors",
        "table-file-only": "../elsewhere/table-000.safetensors",
    }[how]
    manifest["files"]["table-000.safetensors" if how == "table-file-only" else name] = info
    manifest["tables"][0]["file"] = name
    _write_manifest(exported, manifest)
    with pytest.raises(CheckpointError, match=r"table-000.safetensors") as exc:
        ServingEngine.load(exported, verify=verify)
    assert "directly inside" in str(exc.value) or "do not list" in str(exc.value)
    with pytest.raises(CheckpointError):
        read_serving_manifest(exported, verify=verify)


@pytest.mark.parametrize("how", ["absolute", "dotdot"])
def test_export_reads_only_files_the_checkpoint_lists(ckpt, tmp_path, how):
    """A checkpoint manifest whose table "file" points outside it, at a real table file (its
    own listed files intact, manifest.sha256 recomputed): export refuses it before writing."""
    copy = tmp_path / "ck" / ckpt.name
    shutil.copytree(ckpt, copy)
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes((copy / "table-000.safetensors").read_bytes())
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["tables"][0]["file"] = (
        str(outside) if how == "absolute" else "../../elsewhere.safetensors"
    )
    _write_manifest(copy, manifest)
    with pytest.raises(CheckpointError, match=r"elsewhere\.safetensors"):
        _export(copy, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert _leftovers(tmp_path) == []


def _t(i: int, key: str, value=None, delete: bool = False) -> Callable[[dict], None]:
    def edit(m: dict) -> None:
        if delete:
            del m["tables"][i][key]
        else:
            m["tables"][i][key] = value

    return edit


def _f(i: int, key: str, value=None, delete: bool = False) -> Callable[[dict], None]:
    def edit(m: dict) -> None:
        if delete:
            del m["features"][i][key]
        else:
            m["features"][i][key] = value

    return edit


def _file0(key: str, value=None, delete: bool = False) -> Callable[[dict], None]:
    def edit(m: dict) -> None:
        if delete:
            del m["files"]["table-000.safetensors"][key]
        else:
            m["files"]["table-000.safetensors"][key] = value

    return edit


def _set(key: str, value=None, delete: bool = False) -> Callable[[dict], None]:
    def edit(m: dict) -> None:
        if delete:
            del m[key]
        else:
            m[key] = value

    return edit


def _extra_file(m: dict) -> None:
    m["files"]["extra.safetensors"] = {"sha256": "0" * 64, "bytes": 0}


def _duplicate(part: str) -> Callable[[dict], None]:
    def edit(m: dict) -> None:
        m[part][1]["name"] = m[part][0]["name"]

    return edit


def _params(key: str, value=None, delete: bool = False) -> Callable[[dict], None]:
    def edit(m: dict) -> None:  # table 1 is fixed_r8
        if delete:
            del m["tables"][1]["params"][key]
        else:
            m["tables"][1]["params"][key] = value

    return edit


# (id, edit of the manifest dict or the raw bytes, what the error must say)
CORRUPT = [
    ("not-json", b"{not json", r"is not valid JSON"),
    ("not-utf8", b"\xff\xfe{}", r"is not valid JSON"),
    ("list", b"[1, 2]", r"not an embengine export"),
    ("no-source-step", _set("source_step", delete=True), r"has no 'source_step'"),
    ("source-step-negative", _set("source_step", -1), r"\['source_step'\] must be an int >= 0"),
    ("no-tables", _set("tables", delete=True), r"has no 'tables'"),
    ("tables-object", _set("tables", {}), r"\['tables'\] must be a list"),
    ("tables-empty", _set("tables", []), r"lists no tables"),
    ("table-not-object", lambda m: m["tables"].__setitem__(0, "one"), r"tables\[0\] must be an"),
    ("no-table-name", _t(0, "name", delete=True), r"tables\[0\] has no 'name'"),
    ("table-name-int", _t(0, "name", 5), r"tables\[0\]\['name'\] must be a non-empty string"),
    ("duplicate-table", _duplicate("tables"), r"table name 'one' appears twice"),
    ("no-vocabulary", _t(0, "vocabulary_size", delete=True), r"has no 'vocabulary_size'"),
    ("vocabulary-str", _t(0, "vocabulary_size", "60"), r"\['vocabulary_size'\] must be an int"),
    ("vocabulary-zero", _t(0, "vocabulary_size", 0), r"\['vocabulary_size'\] must be an int >= 1"),
    ("dim-bool", _t(0, "dim", True), r"tables\[0\]\['dim'\] must be an int >= 1, got True"),
    ("dim-float", _t(0, "dim", 8.0), r"tables\[0\]\['dim'\] must be an int >= 1, got 8.0"),
    ("no-combiner", _t(0, "combiner", delete=True), r"has no 'combiner'"),
    ("combiner-max", _t(0, "combiner", "max"), r"\['combiner'\] must be one of"),
    ("no-compression", _t(0, "compression", delete=True), r"has no 'compression'"),
    ("compression-int4", _t(0, "compression", "int4"), r"\['compression'\] must be one of"),
    ("params-null", _t(0, "params", None), r"tables\[0\]\['params'\] must be an object"),
    ("fixed-range-missing", _params("fixed_range", delete=True), r"fixed_range'\] must be a"),
    ("fixed-range-negative", _params("fixed_range", -1.0), r"fixed_range'\] must be a finite"),
    ("fixed-range-nan", _params("fixed_range", float("nan")), r"fixed_range'\] must be a finite"),
    ("fixed-range-str", _params("fixed_range", "1"), r"fixed_range'\] must be a finite"),
    ("fixed-range-huge", _params("fixed_range", 1e300), r"fixed_range'\] must make a step"),
    ("quantization-list", _t(0, "quantization_config", [5, 0, 1]), r"must be an object or null"),
    ("quantization-keys", _t(0, "quantization_config", {"num_buckets": 5}), r"keys \['num_b"),
    (
        "quantization-values",
        _t(0, "quantization_config", {"num_buckets": 1, "lower": 0.0, "upper": 1.0}),
        r"num_buckets must be an int >= 2",
    ),
    (
        "quantization-str",
        _t(0, "quantization_config", {"num_buckets": 5, "lower": "a", "upper": 1.0}),
        r"values must be numbers",
    ),
    ("no-file", _t(0, "file", delete=True), r"tables\[0\] has no 'file'"),
    ("file-int", _t(0, "file", 3), r"tables\[0\]\['file'\] must be a non-empty string"),
    ("file-unlisted", _t(0, "file", "other.safetensors"), r"reads 'other.safetensors', which"),
    ("file-shared", _t(1, "file", "table-000.safetensors"), r"tables\[0\] and tables\[1\] share"),
    ("files-list", _set("files", []), r"\['files'\] must be an object"),
    (
        "files-entry-str",
        lambda m: m["files"].__setitem__("table-000.safetensors", "abc"),
        r"files\['table-000.safetensors'\] must be an object",
    ),
    ("files-no-sha", _file0("sha256", delete=True), r"has no 'sha256'"),
    ("files-sha-int", _file0("sha256", 5), r"\['sha256'\] must be a SHA-256"),
    ("files-sha-short", _file0("sha256", "abc"), r"\['sha256'\] must be a SHA-256"),
    ("files-no-bytes", _file0("bytes", delete=True), r"has no 'bytes'"),
    ("files-bytes-str", _file0("bytes", "1984"), r"\['bytes'\] must be an int >= 0"),
    ("files-bytes-negative", _file0("bytes", -1), r"\['bytes'\] must be an int >= 0"),
    (
        "files-pickle",
        lambda m: m["files"].__setitem__("model.pkl", {"sha256": "0" * 64, "bytes": 1}),
        r"manifest lists 'model.pkl'",
    ),
    (
        "files-hidden",
        lambda m: m["files"].__setitem__(".x.safetensors", {"sha256": "0" * 64, "bytes": 1}),
        r"manifest lists '.x.safetensors'",
    ),
    ("files-unused", _extra_file, r"files 'extra.safetensors' belong to no table"),
    ("no-features", _set("features", delete=True), r"has no 'features'"),
    ("features-object", _set("features", {}), r"\['features'\] must be a list"),
    ("features-empty", _set("features", []), r"lists no features"),
    ("feature-not-object", lambda m: m["features"].__setitem__(0, 1), r"features\[0\] must be"),
    ("no-feature-name", _f(0, "name", delete=True), r"features\[0\] has no 'name'"),
    ("duplicate-feature", _duplicate("features"), r"feature name 'one' appears twice"),
    ("feature-table-unknown", _f(0, "table", "nope"), r"looks up table 'nope', which"),
    ("no-feature-table", _f(0, "table", delete=True), r"features\[0\] has no 'table'"),
    ("no-sequence-length", _f(0, "max_sequence_length", delete=True), r"'max_sequence_length'"),
    ("sequence-length-negative", _f(2, "max_sequence_length", -2), r"must be an int >= 0"),
    (
        "sequence-length-huge",
        _f(2, "max_sequence_length", 2**40),
        r"features\[2\] \('.*'\): .*max_sequence_length=1,099,511,627,776 is more than",
    ),
    ("validate-str", _f(0, "validate_weights_and_indices", "yes"), r"must be true or false"),
    ("no-output-shape", _f(0, "output_shape", delete=True), r"has no 'output_shape'"),
    ("output-shape-str", _f(0, "output_shape", "3x2"), r"must be a list of ints or null"),
    ("output-shape-items", _f(0, "output_shape", ["a"]), r"output_shape must be a non-empty"),
    ("output-shape-dims", _f(0, "output_shape", [1] * 70), r"output_shape has 70 dims"),
    # Tensor headers that do not match the manifest (right checksums, wrong description).
    (
        "vocabulary-mismatch",
        _t(0, "vocabulary_size", 61),
        r"tensor 'weights' has dtype F16 and shape \[60, 8\], expected F16 and shape \[61, 8\]",
    ),
    ("dim-mismatch", _t(1, "dim", 5), r"shape \[50, 4\], expected I8 and shape \[50, 5\]"),
    ("vocabulary-bomb", _t(0, "vocabulary_size", 200_000_000), r"expected F16 and shape \[2000"),
    ("dtype-mismatch", _t(0, "compression", "fp32"), r"has dtype F16 .* expected F32"),
    (
        "fp16-as-rowwise",
        _t(0, "compression", "int8_rowwise"),
        r"holds tensors \['weights'\], expected \['bias', 'scale', 'weights'\]",
    ),
    (
        "rowwise-as-fixed",
        lambda m: m["tables"][2].update(compression="fixed_r8", params={"fixed_range": 1.0}),
        r"holds tensors \['bias', 'scale', 'weights'\], expected \['weights'\]",
    ),
]


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("edit, words", [c[1:] for c in CORRUPT], ids=[c[0] for c in CORRUPT])
def test_corrupt_export_manifests_are_refused(exported, edit, words, verify):
    if isinstance(edit, bytes):
        raw = edit
    else:
        manifest = json.loads((exported / "manifest.json").read_text())
        edit(manifest)
        raw = json.dumps(manifest).encode()
    _write_manifest(exported, raw)
    with pytest.raises(CheckpointError, match=words):
        ServingEngine.load(exported, verify=verify)
    with pytest.raises(CheckpointError, match=words):
        read_serving_manifest(exported, verify=verify)  # what `embengine inspect` reads


def _safetensors(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize("case", ["short-range", "extra-tensor", "bad-offsets", "trailing"])
@pytest.mark.parametrize("verify", [True, False])
def test_table_files_whose_header_disagrees_are_refused(exported, case, verify):
    """Rewritten table files with their checksums and sizes updated: only the header check can
    refuse them."""
    f = exported / "table-000.safetensors"  # fp16 weights [60, 8]
    data = b"\0" * (60 * 8 * 2)
    weights = {"dtype": "F16", "shape": [60, 8], "data_offsets": [0, len(data)]}
    if case == "short-range":
        weights["data_offsets"] = [0, 2]
        header = {"weights": weights}
    elif case == "extra-tensor":
        header = {"weights": weights, "more": {"dtype": "I8", "shape": [0], "data_offsets": [0, 0]}}
    elif case == "bad-offsets":
        weights["data_offsets"] = "all"
        header = {"weights": weights}
    else:  # bytes after the data no tensor holds: the safetensors package refuses them
        header, data = {"weights": weights}, data + b"\0" * 8
    f.write_bytes(_safetensors(header, data))
    manifest = json.loads((exported / "manifest.json").read_text())
    manifest["files"]["table-000.safetensors"] = {
        "sha256": hashlib.sha256(f.read_bytes()).hexdigest(),
        "bytes": f.stat().st_size,
    }
    _write_manifest(exported, manifest)
    with pytest.raises(CheckpointError, match=r"table-000.safetensors.*table 'one'"):
        ServingEngine.load(exported, verify=verify)
