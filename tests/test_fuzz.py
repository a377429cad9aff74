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

from _fuzz import cases, crafted, kills, report
from _fuzz.runner import Runner

SEED = 0
# Budget: ~900 cases, ~35 ms each on this 2-core machine, plus one child's start (~10 s). On
# broken code each crash costs a restart and a rerun alone, and each hang twice CASE_TIMEOUT:
# after MAX_FAULTS the test stops (and fails) rather than running on.
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
    results = Runner("case", todo, case_timeout=CASE_TIMEOUT, attribute="alone",
                     max_faults=MAX_FAULTS, budget=BUDGET).run()  # fmt: skip
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
        results = Runner("ckpt", todo, case_timeout=CASE_TIMEOUT, attribute="none",
                         max_faults=MAX_FAULTS, budget=BUDGET).run()  # fmt: skip
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
