"""Say so while numba compiles kernels: a first run otherwise sits silent for tens of seconds.

numba compiles a kernel on its first call and caches it on disk, so only the first run of a
program pays. ``compile_notice()`` wraps the code that makes those first calls: once the process
has used NOTICE_AFTER CPU seconds inside it (CPU, not wall time: on a loaded machine, loading
cached kernels takes long in wall time but little CPU), it prints NOTICE, then
rewrites one stderr line with the seconds so far (on a terminal), and when the block ends,
"kernels compiled in S s". A later run loads the kernels from the cache and prints nothing.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["NOTICE", "NOTICE_AFTER", "compile_notice"]

# CPU seconds of this process: loading cached kernels takes a fraction of it, compiling them
# many times more (docs/performance.md has both).
NOTICE_AFTER = 5.0
NOTICE = "compiling kernels, first run only (numba caches them for later runs)"


class _Notice:
    """A thread that, unless stopped first, prints NOTICE once the process has used ``delay``
    CPU seconds since it started, then rewrites one stderr line with the seconds elapsed (only
    on a terminal)."""

    def __init__(self, log: Callable[[str], None], delay: float, live: bool):
        self.log, self.delay, self.live = log, delay, live
        self.done = threading.Event()
        self.shown = False
        self.seconds = 0.0
        self.start = time.perf_counter()
        self.cpu_start = time.process_time()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while time.process_time() - self.cpu_start < self.delay:
            if self.done.wait(0.1):
                return
        self.shown = True
        self.log(NOTICE)
        while self.live and not self.done.wait(1.0):
            sys.stderr.write(f"\rcompiling kernels: {time.perf_counter() - self.start:.0f} s")
            sys.stderr.flush()

    def stop(self) -> float:
        self.done.set()
        self.thread.join()
        self.seconds = seconds = time.perf_counter() - self.start
        self.cpu_seconds = time.process_time() - self.cpu_start
        if self.shown:
            if self.live:
                sys.stderr.write("\r\033[K")
                sys.stderr.flush()
            self.log(f"kernels compiled in {seconds:.1f} s")
        return seconds


@contextmanager
def compile_notice(log: Callable[[str], None] = print, live: bool = True) -> Iterator[_Notice]:
    """Run the block; print NOTICE if it uses more than NOTICE_AFTER CPU seconds (see the module
    docstring). ``live``: also a line of elapsed seconds on stderr, when stderr is a terminal.
    The value bound by ``as`` has ``seconds`` (wall) and ``shown`` once the block is done."""
    notice = _Notice(log, NOTICE_AFTER, live and sys.stderr.isatty())
    try:
        yield notice
    finally:
        notice.stop()
