"""The hardening fuzz tests: no crash, no hang, no partial update, no wrong answer, clear errors.

Every case runs in a child process (tests/_fuzz/runner.py), so a segfault or a hang fails the
test with the case that caused it instead of killing pytest. The cases are fixed (hypothesis
with a fixed seed, generation only), so a failure reproduces: ``python tests/fuzz_campaign.py
--replay <case index>`` reruns one case of this test's list alone, and ``python
tests/fuzz_campaign.py`` runs the long campaigns and prints all the figures.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from _fuzz import cases, crafted, execute, kills, report
from _fuzz.runner import Runner

import embengine.batch
from embengine.backends.reference import ReferenceBackend

SEED = 0
# Budget: ~900 cases and one child's start (their times: docs/performance.md, "Figures behind
# the code"). On broken code each crash costs a restart and a rerun alone, and each hang twice
# CASE_TIMEOUT: after MAX_FAULTS the test stops (and fails) rather than running on.
CASE_TIMEOUT = 20.0
MAX_FAULTS = 4
BUDGET = 150.0


def fuzz_cases() -> list[dict]:
    """One case per (input path, backend, fault kind or valid): the test's fixed list."""
    return cases.generate_stratified(1, SEED)


def test_fuzz_every_input_path_and_backend():
    """Every public input path (EmbeddingEngine lookup / preprocess / apply_gradients, the torch
    EmbeddingLayer with dicts, KeyedJagged and prepared batches, the TF port, ServingEngine) on
    both backends, with every kind of malformed input and valid ones: each case must give a
    clear error naming the feature and change nothing, or the right answer."""
    todo = fuzz_cases()
    results = Runner(
        "case",
        todo,
        case_timeout=CASE_TIMEOUT,
        attribute="alone",
        max_faults=MAX_FAULTS,
        budget=BUDGET,
    ).run()
    bad = [r for r in results if r["outcome"] not in report.GOOD_FUZZ]
    assert not bad, (
        f"{len(bad)} of {len(todo)} fuzz cases failed "
        f"(stopped after {MAX_FAULTS} crashes/hangs or {BUDGET:.0f} s: 'not run' cases)\n"
        + report.fuzz_table(todo, results)
        + "\n\n"
        + report.fuzz_findings(todo, results, 40)
    )


def test_crafted_checkpoints_and_exports_are_refused():
    """Damaged checkpoints and exports (truncated, flipped bits, deleted files: checksums left
    stale) and crafted ones (every checksum recomputed: manifest keys deleted or of the wrong
    type, path traversal, huge declared shapes, mismatched tensors) are refused with
    CheckpointError, without changing the engine a restore was given; harmless edits load."""
    with tempfile.TemporaryDirectory(prefix="embengine-crafted-") as tmp:
        base = crafted.make_base(Path(tmp))
        todo = crafted.tasks(base, seed=SEED, flips=1)
        results = Runner(
            "ckpt",
            todo,
            case_timeout=CASE_TIMEOUT,
            attribute="none",
            max_faults=MAX_FAULTS,
            budget=BUDGET,
        ).run()
    wrong = []
    for task, result in zip(todo, results, strict=True):
        group, outcome = task["mutation"]["group"], result["outcome"]
        if group == "control":
            if outcome != "accepted_same":
                wrong.append((task, result))
        elif outcome not in ("refused", "accepted_same") or (
            group == "accidental" and outcome != "refused"
        ):
            wrong.append((task, result))
    assert not wrong, (
        f"{len(wrong)} of {len(todo)} crafted-checkpoint cases were not refused cleanly\n"
        + report.crafted_table(todo, results)
        + "\n\n"
        + report.crafted_findings([t for t, _ in wrong], [r for _, r in wrong], 60)
    )


def test_sigkill_during_save_leaves_a_readable_newest_checkpoint():
    """A process saving in a loop is SIGKILLed at random times: the newest checkpoint always
    loads with its checksums verified and holds exactly the state of its step; every
    checkpoint the folder lists verifies."""
    with tempfile.TemporaryDirectory(prefix="embengine-kills-") as tmp:
        out = kills.campaign(kills=4, seed=SEED, workdir=Path(tmp), max_delay=1.0)
    figures = out["figures"]
    assert report.kills_ok(figures), (
        report.kills_table(figures) + "\n" + "\n".join(map(str, out["rounds"]))
    )


# -- the harness itself ---------------------------------------------------------------------------


def test_the_runner_records_crashes_and_hangs_against_their_task():
    """A segfault and a hang are recorded against the task that ran (and reproduced alone); a
    task that corrupts the process so that a later one dies is found by bisection."""
    actions = ["ok", "segv", "ok", "hang", "ok", "poison", "ok", "ok", "segv_if_poisoned", "ok"]
    results = Runner(
        "selftest", [{"action": a} for a in actions], case_timeout=3.0, attribute="bisect"
    ).run()
    outcomes = [r["outcome"] for r in results]
    assert outcomes == [
        "right_answer",
        "crash",
        "right_answer",
        "hang",
        "right_answer",
        "crash",
        "right_answer",
        "right_answer",
        "right_answer",
        "right_answer",
    ]
    assert "SIGSEGV" in results[1]["detail"] and "reproduced alone" in results[1]["detail"]
    assert "reproduced alone" in results[3]["detail"]
    assert "kills the process later (task 8 died after it" in results[5]["detail"]
    assert "culprit task 5" in results[8]["detail"]


def test_a_case_s_time_limit_leaves_out_numba_compiling_and_waiting_for_a_compile_lock():
    """Under a parallel test run a case may compile a specialisation, or wait while another
    process compiles it: that time is not the case's. Here a compile, and a wait for a lock
    this test holds for longer than the limit, both finish as right answers."""
    import fcntl
    import threading

    from _fuzz.runner import locked_selftest_kernel

    # The child's start-up (imports) comes out of it: seconds on a loaded host (its time:
    # docs/performance.md, "Figures behind the code").
    held = 5.0
    limit = 0.5
    lock_path = locked_selftest_kernel()._cache.lock_path
    Path(lock_path).parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        timer = threading.Timer(held, fcntl.flock, (lock, fcntl.LOCK_UN))
        timer.start()
        try:
            results = Runner(
                "selftest",
                [
                    {"action": "locked", "value": 2},
                    {"action": "compile", "seconds": 3 * limit},
                    {"action": "hang"},
                ],
                case_timeout=limit,
                attribute="none",
            ).run()
        finally:
            timer.cancel()
    outcomes = [r["outcome"] for r in results]
    assert outcomes == ["right_answer", "right_answer", "hang"], results
    assert results[0]["seconds"] > 2 * limit, results[0]  # it waited for the lock past the limit
    assert results[1]["seconds"] > limit, results[1]  # it did compile for longer than the limit
    assert "besides compiling" in results[2]["detail"]


def _valid_case(**changes) -> dict:
    batch = {
        "user": {"samples": [[1, 2], [3]], "weights": [[0.5, 2.0], [1.0]], "form": "lists"},
        "item": {"samples": [[4], []], "weights": None, "form": "padded"},
        "hist": {"samples": [[1, 2, 3, 4], [5]], "weights": None, "form": "ragged_lengths"},
        "cat": {"samples": [[0, 1], [2]], "weights": None, "form": "ragged_offsets"},
    }
    case = {
        "path": "train",
        "backend": "reference",
        "config": "mixed",
        "batch": batch,
        "fault": None,
        "grad_seed": 3,
        "lrs": None,
        "i": 0,
    }
    case.update(changes)
    return case


def test_the_oracle_tells_right_answers_from_wrong_ones_and_partial_updates(monkeypatch):
    """The oracle is not vacuous: a combiner off by 0.1%, an update that fails after its first
    table, and an error of the wrong type are each caught (valid batches on the reference
    backend, in this process: nothing here can crash)."""
    assert execute.run_case(_valid_case())["outcome"] == "right_answer"
    gains = embengine.batch.combiner_gains
    monkeypatch.setattr(
        embengine.batch, "combiner_gains", lambda r, c: gains(r, c) * np.float32(1.001)
    )
    assert execute.run_case(_valid_case(path="lookup_eval"))["outcome"] == "wrong_answer"
    monkeypatch.undo()

    apply, calls = ReferenceBackend.apply, []

    def fails_second_table(self, *args):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("feature 'user': fails after the first table")
        return apply(self, *args)

    monkeypatch.setattr(ReferenceBackend, "apply", fails_second_table)
    assert execute.run_case(_valid_case())["outcome"] == "partial_update"
    monkeypatch.undo()

    bad_id = {"kind": "id_too_big", "feature": "cat", "extra": 0}
    assert execute.run_case(_valid_case(fault=bad_id))["outcome"] == "clear_error"

    def index_error(*args, **kwargs):
        raise IndexError("index 6 is out of bounds for axis 0 with size 6")

    monkeypatch.setattr(embengine.batch, "check_values", index_error)
    assert execute.run_case(_valid_case(fault=bad_id))["outcome"] == "unclear_error"
