"""The hardening fuzzer: every public input path, both backends, crafted checkpoints, kills.

The contract it checks, per input: "a clear error naming the feature, or the right answer;
never a crash, a hang or a partial update". Pieces:

- ``configs``: the engines under test (plain specs + builders);
- ``cases``: fuzz cases as plain data, drawn by hypothesis (``generate``: at random;
  ``generate_stratified``: every path x backend x fault kind);
- ``execute``: runs one case in the current process and judges it (the oracle);
- ``runner``: runs cases in child processes, so that a segfault or a hang is recorded against
  its case instead of killing the caller;
- ``crafted``: real checkpoints and exports, damaged or edited, then loaded;
- ``kills``: SIGKILL during saves, then the newest checkpoint must load and be right;
- ``report``: the figures tables.

Used by tests/test_fuzz.py (bounded, deterministic) and tests/fuzz_campaign.py (long runs).
Importing this package imports neither embengine nor torch: the child processes do.
"""
