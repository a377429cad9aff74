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


# The keyed configs' faults the fixed list meets: keys a dense table refuses, a caller's array
# changed, ids not int64, gradients refused, and valid batches; the 16-bit config's: values
# near its range, gradients refused, and valid batches.
KEYED_KINDS = (
    cases.VALID,
    "id_too_big",
    "id_negative",
    "id_minus_one",
    "id_int64_max",
    "kjt_id_out_of_range",
    "caller_ids_mutated",
    "uint64_big",
    "narrow_int_ok",
    "grad_nonfinite",
    "grad_nonfinite_skip",
)
HALF_KINDS = (cases.VALID, "weights_huge", "grad_huge", "grad_nonfinite")
# The timed config's: the keyed ones and bad, missing, misplaced or other-typed timestamps.
TIMED_KINDS = (
    *KEYED_KINDS,
    "timestamp_bad",
    "timestamp_missing",
    "timestamp_eval",
    "timestamp_repr_ok",
)
# Two lookups before their updates on the dense float32 configs: valid batches, a bad id, and
# gradients or learning rates refused at the first update.
TWO_KINDS = (cases.VALID, "id_too_big", "grad_nonfinite", "grad_shape", "lr_bad", "lr_unexpected")


def new_config_cases(seed: int = SEED) -> list[dict]:
    """The keyed and 16-bit configs' fixed list: for each config, one case per (input path,
    fault kind of KEYED_KINDS, HALF_KINDS for "half", TIMED_KINDS for the timed config) on
    the numba backend (the reference backend is the oracle's); then two lookups before their
    updates on the dense float32 configs (TWO_KINDS)."""
    out = []
    for k, config in enumerate(cases.NEW_CONFIGS):
        kinds = HALF_KINDS if config == "half" else KEYED_KINDS
        if config in cases.TIMED_CONFIGS:
            kinds = TIMED_KINDS
        out += cases.generate_stratified(
            1, seed + k, configs=(config,), backends=("numba",), kinds=kinds
        )
    out += cases.generate_stratified(
        1,
        seed,
        paths=("train_two",),
        configs=cases.ENGINE_CONFIGS,
        backends=("numba",),
        kinds=TWO_KINDS,
    )
    for i, case in enumerate(out):
        case["i"] = i
    return out


def _run_fuzz(todo: list) -> tuple[list, list]:
    """Each of ``todo``'s fuzz cases in child processes: (every result, the failed ones)."""
    results = Runner(
        "case",
        todo,
        case_timeout=CASE_TIMEOUT,
        attribute="alone",
        max_faults=MAX_FAULTS,
        budget=BUDGET,
    ).run()
    return results, [r for r in results if r["outcome"] not in report.GOOD_FUZZ]


def test_fuzz_every_input_path_and_backend():
    """Every public input path (EmbeddingEngine lookup / preprocess / apply_gradients, the torch
    EmbeddingLayer with dicts, KeyedJagged and prepared batches, the TF port, ServingEngine) on
    both backends, with every kind of malformed input and valid ones: each case must give a
    clear error naming the feature and change nothing, or the right answer."""
    todo = fuzz_cases()
    results, bad = _run_fuzz(todo)
    assert not bad, (
        f"{len(bad)} of {len(todo)} fuzz cases failed "
        f"(stopped after {MAX_FAULTS} crashes/hangs or {BUDGET:.0f} s: 'not run' cases)\n"
        + report.fuzz_table(todo, results)
        + "\n\n"
        + report.fuzz_findings(todo, results, 40)
    )


def test_fuzz_keyed_and_16_bit_tables():
    """The keyed (dynamic vocabulary) and 16-bit configs on every engine input path: a key a
    dense table would refuse (past the vocabulary, negative, int64's largest, -1 in 1-D input)
    is a key; a batch over ``max_rows`` is refused naming the table; the rows are the rules'
    (admission, expiry, eviction) and the update the reference's, 16-bit values to a
    neighbour."""
    todo = new_config_cases()
    results, bad = _run_fuzz(todo)
    assert not bad, (
        f"{len(bad)} of {len(todo)} keyed / 16-bit fuzz cases failed\n"
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


def _case(config: str, path: str, samples: dict, **changes) -> dict:
    batch = {f: {"samples": s, "weights": None, "form": "lists"} for f, s in samples.items()}
    case = {
        "path": path,
        "backend": "reference",
        "config": config,
        "batch": batch,
        "fault": None,
        "grad_seed": 5,
        "lrs": None,
        "i": 0,
    }
    case.update(changes)
    return case


def test_the_oracle_knows_the_keyed_rules(monkeypatch):
    """The keyed configs' oracle checks the rules, not only the reference backend (which shares
    the keyed storage): an expired row served by an evaluation lookup, and LRU evicting the
    wrong rows, are each caught; a batch over max_rows must be refused naming the table, and a
    key past any vocabulary is a key (reference backend, in this process)."""
    from embengine.storage.keyed import KeyedTable

    # keyed_mix's k_c: 7's row was last touched at step 1, so at step 3 it has expired
    expired = _case(
        "keyed_mix", "lookup_eval", {"du": [[1]], "kc": [[7, 42]], "kd": [[]], "kd_seq": [[]]}
    )
    assert execute.run_case(expired)["outcome"] == "right_answer"
    # keyed's k_b holds max_rows=6 rows: two new keys evict the two least recently touched
    evicting = _case("keyed", "train", {"ka": [[3]], "ka_seq": [[]], "kb": [[99, -5]]})
    assert execute.run_case(evicting)["outcome"] == "right_answer"
    over = _case(
        "keyed",
        "train",
        {"ka": [[]], "ka_seq": [[]], "kb": [[3, 8, 99, -5, 1 << 50, -(1 << 62), 1]]},
    )
    result = execute.run_case(over)
    assert result["outcome"] == "clear_error" and "k_b" in result["detail"], result
    big = {"kind": "id_too_big", "feature": "ka", "extra": 1 << 40}
    assert execute.run_case(dict(evicting, fault=big))["outcome"] == "right_answer"
    half = _case("half", "train", {"hb": [[1, 2]], "hb_seq": [[3]], "hf": [[4]], "hg": [[0, 0]]})
    assert execute.run_case(half)["outcome"] == "right_answer"

    monkeypatch.setattr(KeyedTable, "_expired", lambda self: np.zeros(0, np.int64))
    assert execute.run_case(expired)["outcome"] == "wrong_answer"
    monkeypatch.undo()

    order = KeyedTable._eviction_order
    monkeypatch.setattr(
        KeyedTable, "_eviction_order", lambda self, rows: [-c for c in order(self, rows)]
    )
    result = execute.run_case(evicting)
    assert result["outcome"] == "wrong_answer" and "the rules leave" in result["detail"], result


def test_the_oracle_knows_data_time_and_two_lookups_before_their_updates(monkeypatch):
    """The timed config's oracle checks expiry by data time, not only the reference backend:
    a row expired by the call's timestamp but served is caught; a training call without a
    timestamp must be refused naming a table. Two lookups of prepared batches before their
    updates must leave what ``lookup_with_batch``'s batches leave (the first's update
    resolved its keys a second time; reference backend, in this process)."""
    from _fuzz.configs import T0

    from embengine.storage.keyed import KeyedTable

    stamps = {"lookup": T0 + 130, "apply": None, "lookup2": T0 + 130, "apply2": None}
    # keyed_time's k_t: key 1 was last trained at T0 + 40; at T0 + 130 (60 s) it has expired
    late = _case(
        "keyed_time", "train", {"kt": [[1, 42]], "kt_seq": [[]], "ku": [[]]}, timestamps=stamps
    )
    assert execute.run_case(late)["outcome"] == "right_answer"
    missing = dict(late, fault={"kind": "timestamp_missing", "feature": None})
    result = execute.run_case(missing)
    assert result["outcome"] == "clear_error" and "k_t" in result["detail"], result
    # keyed_mix's k_c counts keys for a threshold of 2: 3 is new, and must be counted once
    two = _case(
        "keyed_mix",
        "train_two",
        {"du": [[1]], "kc": [[3]], "kd": [[]], "kd_seq": [[]]},
        batch2={
            f: {"samples": s, "weights": None, "form": "lists"}
            for f, s in {"du": [[2]], "kc": [[8]], "kd": [[5]], "kd_seq": [[]]}.items()
        },
        grad_seed2=6,
        via="prepared",
        order="batch_first",
        eval=True,
    )
    assert execute.run_case(two)["outcome"] == "right_answer"
    assert execute.run_case(dict(two, order="pending_first"))["outcome"] == "right_answer"

    monkeypatch.setattr(KeyedTable, "_expired", lambda self: np.zeros(0, np.int64))
    assert execute.run_case(late)["outcome"] == "wrong_answer"
