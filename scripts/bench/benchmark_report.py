"""What every ``scripts/bench/bench_*.py`` prints about the machine it ran on, and how it summarises its rounds.

A benchmark's figures only mean something next to the machine that produced them: the CPU model, how many cores the
process could use, how many threads the benchmark used, and the load average when it started (another job's load
slows the measured side and can move a ratio either way). Every benchmark prints ``machine_line`` first and runs at
least three rounds; each figure is reported as its median with the min and max over the rounds
(``Rounds.describe``), and the headline (last line) uses the median.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Iterable


def timed(fn):
    """(fn's result, wall seconds, CPU seconds of this process: all its threads, not the other processes' load)."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what the platform module reports."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine_line(threads: int | str) -> str:
    """One line: CPU model, cores (online / usable by this process), threads the benchmark uses, load at start."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"machine: {cpu_model()}; {os.cpu_count()} cores ({usable} usable by this process); threads used: "
            f"{threads}; load average at start (1/5/15 min): {load}")


def check_rounds(rounds: int, flag: str = "--rounds") -> int:
    if rounds < 3:
        raise SystemExit(f"{flag}={rounds}: a benchmark reports min / median / max over at least 3 rounds; "
                         f"pass {flag} 3 or more.")
    return rounds


class Rounds:
    """Values of one figure, one per round."""

    def __init__(self, values: Iterable[float] = ()):
        self.values = [float(v) for v in values]

    def append(self, value: float) -> None:
        self.values.append(float(value))

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def describe(self, fmt: str = ".2f", unit: str = "") -> str:
        """``median <m> (min <a>, max <b>, <n> rounds)``."""
        return (f"median {self.median:{fmt}}{unit} (min {min(self.values):{fmt}}{unit}, max "
                f"{max(self.values):{fmt}}{unit}, {len(self.values)} rounds)")
