"""The host a benchmark ran on, printed at the top of every table.

Speed ratios against FBGEMM differ 3-4x between hosts (AMD or Intel, with or without AVX-512),
so a figure means nothing without the host it was measured on; docs/performance.md keeps one
results table per host kind, keyed by this line.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass


@dataclass(frozen=True)
class Host:
    cpu: str  # the CPU model as the OS names it
    cores: int  # cores this process may run on
    avx512: bool  # AVX-512 foundation instructions (avx512f)
    memory_gib: float | None  # physical memory; None where the OS does not say
    # The vectors the kernels compile for (``kernels.vector_width.VECTORS``); None: not said
    vectors: str | None = None

    def describe(self) -> str:
        """One line, e.g. ``host: AMD EPYC, 2 cores, AVX-512, 24 GiB; kernels: 512-bit``."""
        mem = f", {self.memory_gib:.0f} GiB" if self.memory_gib is not None else ""
        avx = "AVX-512" if self.avx512 else "no AVX-512"
        kernels = f"; kernels: {self.vectors}" if self.vectors is not None else ""
        return f"host: {self.cpu}, {self.cores} cores, {avx}{mem}{kernels}"


def _cpuinfo(text: str) -> tuple[str | None, bool]:
    """(model name, has avx512f) from the text of /proc/cpuinfo (Linux)."""
    model, flags = None, ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = value
    return model, "avx512f" in flags.split()


def _memory_gib(text: str) -> float | None:
    """MemTotal of /proc/meminfo's text, in GiB."""
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 2**20  # kB
    return None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def host() -> Host:
    """This machine (Linux reads /proc; elsewhere the CPU is platform's name and AVX-512 is
    reported as absent, since it cannot be checked), and the vectors the kernels compile for."""
    from ..kernels.vector_width import VECTORS

    model, avx512 = _cpuinfo(_read("/proc/cpuinfo"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return Host(
        cpu=model or platform.processor() or platform.machine() or "unknown CPU",
        cores=int(cores or 1),
        avx512=avx512,
        memory_gib=_memory_gib(_read("/proc/meminfo")),
        vectors=VECTORS,
    )
