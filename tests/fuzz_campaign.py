"""Long fuzz campaigns: input fuzzing, crafted checkpoints, kills during saves; prints figures.

    python tests/fuzz_campaign.py                      # 10,000 cases + crafted + 30 kills
    python tests/fuzz_campaign.py --cases 2000 --no-crafted --kills 0
    python tests/fuzz_campaign.py --stratified 3       # 3 cases of every path x backend x fault
    python tests/fuzz_campaign.py --replay 17          # case 17 of test_fuzz.py's list, alone
    python tests/fuzz_campaign.py --replay 3 --replay-list new   # of its keyed / 16-bit list
    python tests/fuzz_campaign.py --configs dense      # only the dense float32 configs (+ tpu)
    python tests/fuzz_campaign.py --json out.json      # also write every case and result

Every case runs in a child process (tests/_fuzz/runner.py); a crash or a hang is recorded
against its case (``--attribute bisect`` also looks for an earlier case that corrupted memory)
and the campaign carries on. The figures are printed per input path and backend; then every
kind of failure found, with one reproducible example each (the case's recipe).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # this checkout's embengine and the harness

from _fuzz import cases, crafted, kills, report  # noqa: E402
from _fuzz.runner import Runner  # noqa: E402


def _progress(every: int, label: str):
    counts: dict[str, int] = {}
    start = time.monotonic()

    def show(i: int, n: int, result: dict) -> None:
        counts[result["outcome"]] = counts.get(result["outcome"], 0) + 1
        done = sum(counts.values())
        if done % every == 0 or done == n:
            parts = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            print(
                f"  {label}: {done}/{n} in {time.monotonic() - start:.0f} s ({parts})",
                file=sys.stderr,
                flush=True,
            )

    return show


CONFIG_SETS = {
    "all": (*cases.ENGINE_CONFIGS, "tpu", *cases.NEW_CONFIGS),
    "dense": None,  # the dense float32 configs and tpu: the cases before keyed / 16-bit came
    "new": cases.NEW_CONFIGS,
}


def run_fuzz(args) -> dict:
    configs = CONFIG_SETS[args.configs]
    if args.stratified:
        todo = cases.generate_stratified(args.stratified, args.seed, configs=configs)
    else:
        todo = cases.generate(args.cases, args.seed, configs=configs)
    print(f"fuzz: {len(todo)} cases (seed {args.seed})", file=sys.stderr, flush=True)
    runner = Runner(
        "case",
        todo,
        case_timeout=args.case_timeout,
        attribute=args.attribute,
        progress=_progress(500, "fuzz"),
    )
    start = time.monotonic()
    results = runner.run()
    print(
        f"\n== Input fuzzing: {len(todo)} cases, {time.monotonic() - start:.0f} s, "
        f"{runner.children_started} child processes =="
    )
    print(report.fuzz_table(todo, results))
    print("\nFailures (outcome, count, path (backends), fault kind: one example):")
    print(report.fuzz_findings(todo, results, args.findings) or "none")
    return {"cases": todo, "results": results}


def run_crafted(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="embengine-crafted-") as tmp:
        base = crafted.make_base(Path(tmp))
        todo = crafted.tasks(base, seed=args.seed, flips=args.flips)
        print(f"crafted: {len(todo)} tasks", file=sys.stderr, flush=True)
        runner = Runner(
            "ckpt",
            todo,
            case_timeout=args.case_timeout,
            attribute="alone",
            progress=_progress(200, "crafted"),
        )
        results = runner.run()
    print(
        f"\n== Crafted checkpoints and exports: {len(todo)} (mutation, operation) pairs, "
        f"{len({json.dumps(t['mutation'], sort_keys=True) + t['target'] for t in todo})} "
        "mutations =="
    )
    print(report.crafted_table(todo, results))
    print("\nNot refused (controls: not accepted unchanged), or refused slowly:")
    print(report.crafted_findings(todo, results, args.findings * 2) or "none")
    return {"tasks": todo, "results": results}


def run_kills(args) -> dict:
    start = time.monotonic()

    def show(r, n, line):
        print(f"  kill {r + 1}/{n}: {line}", file=sys.stderr, flush=True)

    out = kills.campaign(kills=args.kills, seed=args.seed, progress=show)
    print(f"\n== Kill during save: {args.kills} rounds, {time.monotonic() - start:.0f} s ==")
    print(report.kills_table(out["figures"]))
    for line in out["rounds"]:
        if "error" in line or "unreadable" in line:
            print("  ", line)
    return out


def replay(index: int, seed: int, which: str = "dense") -> int:
    """Rerun one case of test_fuzz.py's list alone and print it (``which``: "dense", the
    first list; "new", its keyed and 16-bit list)."""
    if which == "new":
        from test_fuzz import new_config_cases

        todo = new_config_cases(seed)
    else:
        todo = cases.generate_stratified(1, seed)
    case = todo[index]
    result = Runner("case", [case], attribute="none").run()[0]
    print(json.dumps(case, indent=1))
    print(f"-> {result['outcome']}: {result['detail']}")
    return 0 if result["outcome"] in report.GOOD_FUZZ else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", type=int, default=10_000, help="random fuzz cases (default 10000)")
    p.add_argument(
        "--stratified",
        type=int,
        default=0,
        metavar="K",
        help="instead: K cases of every (path, backend, fault kind)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--configs",
        choices=tuple(CONFIG_SETS),
        default="all",
        help="engine configs to draw from: all (default), dense (float32, as before keyed and "
        "16-bit tables came), new (keyed and 16-bit)",
    )
    p.add_argument("--case-timeout", type=float, default=30.0, help="seconds before a hang")
    p.add_argument(
        "--attribute",
        choices=("none", "alone", "bisect"),
        default="alone",
        help="how to find the case behind a crash (see _fuzz/runner.py)",
    )
    p.add_argument("--no-fuzz", action="store_true")
    p.add_argument("--no-crafted", action="store_true")
    p.add_argument("--flips", type=int, default=3, help="random bit flips per file and region")
    p.add_argument("--kills", type=int, default=30, help="SIGKILL rounds (0: none)")
    p.add_argument("--findings", type=int, default=60, help="failure groups to print")
    p.add_argument("--json", type=Path, help="write every case and result here")
    p.add_argument(
        "--replay",
        type=int,
        metavar="I",
        help="rerun case I of test_fuzz.py alone (with --seed 0, the test's seed)",
    )
    p.add_argument("--replay-list", choices=("dense", "new"), default="dense")
    args = p.parse_args(argv)
    if args.replay is not None:
        seed = args.seed if "--seed" in (argv or sys.argv) else 0
        return replay(args.replay, seed, args.replay_list)
    out: dict = {}
    if not args.no_fuzz:
        out["fuzz"] = run_fuzz(args)
    if not args.no_crafted:
        out["crafted"] = run_crafted(args)
    if args.kills:
        out["kills"] = run_kills(args)
    if args.json:
        args.json.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
