"""Figures tables and findings lists for the fuzz, crafted-checkpoint and kill campaigns."""

from __future__ import annotations

import collections
import json

FUZZ_COLUMNS = (
    "clear_error",
    "unclear_error",
    "right_answer",
    "wrong_answer",
    "partial_update",
    "crash",
    "hang",
    "harness_error",
    "not_run",
)
FUZZ_HEADERS = (
    "clear",
    "unclear",
    "right",
    "wrong",
    "partial",
    "crash",
    "hang",
    "harness",
    "not run",
)
GOOD_FUZZ = ("clear_error", "right_answer")
CRAFTED_COLUMNS = (
    "refused",
    "other_exception",
    "accepted_same",
    "accepted_wrong",
    "partial",
    "crash",
    "hang",
    "harness_error",
    "not_run",
)
CRAFTED_HEADERS = (
    "refused",
    "other exc",
    "acc same",
    "acc wrong",
    "partial",
    "crash",
    "hang",
    "harness",
    "not run",
)


def _table(rows: list[tuple[str, collections.Counter]], columns, headers, first: str) -> str:
    width = max([len(first)] + [len(name) for name, _ in rows]) + 2
    lines = [f"{first:<{width}}{'cases':>8}" + "".join(f"{h:>10}" for h in headers)]
    total: collections.Counter = collections.Counter()
    for name, counts in rows:
        total += counts
        lines.append(
            f"{name:<{width}}{sum(counts.values()):>8}"
            + "".join(f"{counts.get(c, 0):>10}" for c in columns)
        )
    lines.append(
        f"{'all':<{width}}{sum(total.values()):>8}"
        + "".join(f"{total.get(c, 0):>10}" for c in columns)
    )
    return "\n".join(lines)


def fuzz_table(cases: list[dict], results: list[dict]) -> str:
    """Outcomes per input path and backend."""
    per: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for case, result in zip(cases, results, strict=True):
        per[f"{case['path']} / {case['backend']}"][result["outcome"]] += 1
    return _table(sorted(per.items()), FUZZ_COLUMNS, FUZZ_HEADERS, "path / backend")


def fault_kind(case: dict) -> str:
    return case["fault"]["kind"] if case["fault"] else "valid"


def fuzz_findings(cases: list[dict], results: list[dict], limit: int = 60) -> str:
    """Every outcome other than a clear error or the right answer, grouped by (outcome, path,
    fault kind), most frequent first, with one example each (its index and recipe)."""
    groups: dict[tuple, list[int]] = collections.defaultdict(list)
    for case, result in zip(cases, results, strict=True):
        if result["outcome"] not in GOOD_FUZZ and result["outcome"] != "not_run":
            groups[(result["outcome"], case["path"], fault_kind(case))].append(case["i"])
    lines = []
    order = sorted(groups.items(), key=lambda kv: (FUZZ_COLUMNS.index(kv[0][0]), -len(kv[1])))
    for (outcome, path, kind), idx in order[:limit]:
        example = results[idx[0]]["detail"].replace("\n", " ")[:300]
        backends = sorted({cases[i]["backend"] for i in idx})
        lines.append(
            f"{outcome:<14} {len(idx):>5} x {path} ({'/'.join(backends)}) {kind}: {example}"
        )
        lines.append(f"{'':<22}e.g. case {idx[0]}: {json.dumps(cases[idx[0]])[:400]}")
    if len(order) > limit:
        lines.append(f"... and {len(order) - limit} more groups")
    return "\n".join(lines)


def crafted_table(tasks: list[dict], results: list[dict]) -> str:
    """Outcomes per target, mutation group and operation."""
    per: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for task, result in zip(tasks, results, strict=True):
        key = f"{task['target']} / {task['mutation']['group']} / {task['op']}"
        per[key][result["outcome"]] += 1
    return _table(sorted(per.items()), CRAFTED_COLUMNS, CRAFTED_HEADERS, "target / group / op")


def crafted_findings(tasks: list[dict], results: list[dict], limit: int = 80) -> str:
    """Every crafted or accidental mutation not refused (and every control not accepted
    unchanged), and refusals that took more than a second or 100 MiB."""
    from .crafted import describe

    lines = []
    for task, result in zip(tasks, results, strict=True):
        group, outcome = task["mutation"]["group"], result["outcome"]
        slow = result.get("seconds", 0) > 1 or result.get("peak_mb", 0) > 100
        if outcome == "not_run":
            continue
        expected = "accepted_same" if group == "control" else "refused"
        if outcome == expected and not slow:
            continue
        cost = f"[{result.get('seconds', '?')} s, +{result.get('peak_mb', '?')} MiB]"
        lines.append(
            f"{outcome:<16} {describe(task)[:150]} {cost}: "
            f"{result['detail'].replace(chr(10), ' ')[:200]}"
        )
    if len(lines) > limit:
        lines = lines[:limit] + [f"... and {len(lines) - limit} more"]
    return "\n".join(lines)


def kills_table(figures: dict) -> str:
    f = figures
    return "\n".join(
        [
            f"SIGKILLs sent                      {f['kills']}",
            f"  landed during a save             {f['during_save']}",
            f"  landed between saves             {f['between_saves']}",
            f"  landed before the first save     {f['before_first_save']}",
            f"rounds with no checkpoint yet      {f['no_checkpoint']}",
            f"newest checkpoint loads (verified) {f['newest_loads']}",
            f"newest equals the replayed state   {f['newest_correct']}",
            f"every listed checkpoint verifies   {f['all_load']}",
        ]
    )


def kills_ok(figures: dict) -> bool:
    with_ckpt = figures["kills"] - figures["no_checkpoint"]
    return (
        figures["newest_loads"] == with_ckpt
        and figures["newest_correct"] == with_ckpt
        and figures["all_load"] == with_ckpt
    )
