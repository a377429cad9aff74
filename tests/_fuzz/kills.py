"""Kill during save: a child trains and saves in a loop; the parent SIGKILLs it at a random time.

Round after round, a child process restores the newest checkpoint under one root (or starts
fresh), then trains one step at a time on deterministic batches and saves after every step
(``keep=3``), writing ``saving <step>`` and ``saved <step>`` to a marker file around each save.
The parent kills it (SIGKILL, the whole process group) at a random moment, then checks:

- the newest checkpoint loads with full verification (``EmbeddingEngine.load``);
- every checkpoint the folder lists loads too (no unreadable checkpoint is left behind);
- the newest one holds exactly the state of an engine trained to its step in the parent (bit
  for bit: the reference backend is deterministic);
- where the kill landed (during a save, or between saves), from the marker file.

The tables are big enough (``ROWS`` rows) that a save takes a while, so most kills land in one.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .runner import REPO, _child_env

ROWS = 200_000
DIM = 16


def build_engine():
    import embengine as ee
    from embengine import initializers as init
    from embengine import optimizers as opt

    big = ee.TableConfig(
        ROWS,
        DIM,
        name="big",
        combiner="sum",
        optimizer=opt.Adagrad(0.1),
        initializer=init.RandomUniform(-1.0, 1.0),
    )
    small = ee.TableConfig(50, 4, name="small", optimizer=opt.FTRL(0.1))
    return ee.EmbeddingEngine(
        {"big": ee.FeatureConfig(big), "small": ee.FeatureConfig(small, max_sequence_length=2)},
        seed=3,
        backend="reference",
    )


def train_step(engine) -> None:
    """One step on a batch that depends only on the step (so the parent can replay it)."""
    rng = np.random.default_rng(engine.step)
    feats = {
        "big": [list(rng.integers(0, ROWS, 4)) for _ in range(64)],
        "small": [list(rng.integers(0, 50, 3)) for _ in range(8)],
    }
    acts = engine.lookup(feats)
    engine.apply_gradients(
        {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in acts.items()}
    )


def child_main(root: str, marker: str) -> None:
    from embengine import checkpoint

    engine = build_engine()
    if checkpoint.latest_checkpoint(root) is not None:
        engine.restore(root)
    fd = os.open(marker, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, b"ready\n")
    while True:
        train_step(engine)
        os.write(fd, f"saving {engine.step}\n".encode())
        engine.save(root, keep=3)
        os.write(fd, f"saved {engine.step}\n".encode())


def _snapshot(engine) -> dict:
    from .execute import snapshot

    return snapshot(engine)


def campaign(
    kills: int = 30,
    seed: int = 0,
    workdir: Path | None = None,
    max_delay: float = 1.5,
    progress=None,
) -> dict:
    """Run ``kills`` rounds; returns the figures and one line per round."""
    import embengine as ee
    from embengine import checkpoint

    from .execute import same_bits

    rng = random.Random(seed)
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="embengine-kills-") as tmp:
            return campaign(kills, seed, Path(tmp), max_delay, progress)
    workdir = Path(workdir)
    root, marker = workdir / "ckpts", workdir / "marker"
    replay = build_engine()  # trained forward as the newest checkpoint's step grows
    figures = {
        "kills": 0,
        "during_save": 0,
        "between_saves": 0,
        "before_first_save": 0,
        "newest_loads": 0,
        "all_load": 0,
        "newest_correct": 0,
        "no_checkpoint": 0,
    }
    rounds = []
    for r in range(kills):
        marker.write_text("")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from _fuzz.kills import child_main; "
                "child_main(sys.argv[1], sys.argv[2])",
                str(root),
                str(marker),
            ],
            cwd=REPO,
            env=_child_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        deadline = time.monotonic() + 300
        while "ready" not in marker.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                err = proc.stderr.read().decode()[-2000:] if proc.poll() is not None else ""
                os.killpg(proc.pid, signal.SIGKILL)
                raise RuntimeError(f"kill round {r}: the saving child did not start:\n{err}")
            time.sleep(0.01)
        time.sleep(rng.uniform(0.02, max_delay))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stderr.close()
        figures["kills"] += 1
        lines = marker.read_text().split()
        last = [ln for ln in marker.read_text().splitlines() if ln.startswith("sav")]
        where = (
            "before_first_save"
            if not last
            else "during_save"
            if last[-1].startswith("saving")
            else "between_saves"
        )
        figures[where] += 1
        line = {"round": r, "killed": where, "last_marker": last[-1] if last else None}
        newest = checkpoint.latest_checkpoint(root)
        if newest is None:
            figures["no_checkpoint"] += 1
            line["newest"] = None
        else:
            line["newest"] = newest.name
            try:
                loaded = ee.EmbeddingEngine.load(newest)
                figures["newest_loads"] += 1
                while replay.step < loaded.step:
                    train_step(replay)
                if replay.step == loaded.step and same_bits(_snapshot(replay), _snapshot(loaded)):
                    figures["newest_correct"] += 1
                else:
                    line["error"] = f"newest holds other values (step {loaded.step})"
            except Exception as e:  # noqa: BLE001 - an unreadable checkpoint is the finding
                line["error"] = f"newest does not load: {type(e).__name__}: {e}"[:300]
            bad = []
            for ck in checkpoint.list_checkpoints(root):
                try:
                    checkpoint.read_manifest(ck, verify=True)
                except Exception as e:  # noqa: BLE001
                    bad.append(f"{ck.name}: {type(e).__name__}")
            if not bad:
                figures["all_load"] += 1
            else:
                line["unreadable"] = bad
        line["marker_lines"] = len(lines)
        rounds.append(line)
        if progress is not None:
            progress(r, kills, line)
    return {"figures": figures, "rounds": rounds}
