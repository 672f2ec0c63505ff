"""Timing shared by the benchmarks: A and B interleaved in one process, reported as min / median / max.

Timing all of A and then all of B lets a change of machine load (other jobs on a shared CPU, frequency
scaling, a cold cache) fall on one side only. `interleaved` runs the variants in rounds (A B, B A, A B, ...:
the order rotates so no variant always runs right after the same other one), so a load change lands on
all of them, and the spread (min..max) shows how noisy the machine was. A speed-up is the ratio of the
medians; when the two [min, max] ranges overlap the difference is within the spread and `speedup` says so.

    from _timing import interleaved, speedup
    t = interleaved({"batched": f, "one by one": g}, repeats=5, warmup=1)
    print(t["batched"].fmt(scale=1e3), speedup(t["one by one"], t["batched"]))   # "12.1 / 12.5 / 14.0", "2.9x"

Not a package module: the scripts in benchmarks/ import it by file name (their folder is on sys.path when
run as `python benchmarks/x.py`).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence


@dataclass(frozen=True)
class Spread:
    """Repeated measurements of one quantity (seconds per call, or any per-repeat value), in run order."""

    values: tuple[float, ...]

    def __post_init__(self):
        if not self.values:
            raise ValueError("Spread: no values (repeats must be >= 1)")

    @property
    def min(self) -> float:
        return min(self.values)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def max(self) -> float:
        return max(self.values)

    def rate(self, items: float) -> "Spread":
        """items / value per repeat (e.g. images/s from seconds per batch); its min comes from the slowest run."""
        return Spread(tuple(items / v for v in self.values))

    def fmt(self, scale: float = 1.0, digits: int = 2) -> str:
        """`min / median / max`, each multiplied by `scale` (1e3: seconds -> ms)."""
        return " / ".join(f"{scale * v:.{digits}f}" for v in (self.min, self.median, self.max))

    def fmt_median(self, scale: float = 1.0, digits: int = 2) -> str:
        """`median (min-max)`: for table cells where the median is the headline number."""
        m, lo, hi = (f"{scale * v:.{digits}f}" for v in (self.median, self.min, self.max))
        return f"{m} ({lo}-{hi})"


def interleaved(fns: Mapping[str, Callable[[], object]], repeats: int = 5, warmup: int = 1,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, Spread]:
    """Seconds per call of every function in `fns`, timed in `repeats` rounds in one process.

    Each round calls every function once; round r starts with function r mod len(fns) (A B, B A, A B, ...
    for two). `warmup` untimed rounds first (lazy imports, allocator, first-call caches)."""
    if not fns:
        raise ValueError("interleaved: no functions to time")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"interleaved: repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = clock()
            fns[name]()
            times[name].append(clock() - t0)
    return {name: Spread(tuple(v)) for name, v in times.items()}


def overlaps(a: Spread, b: Spread) -> bool:
    """True when the [min, max] ranges of a and b overlap: their difference is within the run-to-run spread."""
    return a.min <= b.max and b.min <= a.max


def speedup(slow: Spread, fast: Spread, digits: int = 2) -> str:
    """`slow.median / fast.median` as "2.95x", with " (within spread)" when the ranges overlap."""
    text = f"{slow.median / fast.median:.{digits}f}x"
    return text + " (within spread)" if overlaps(slow, fast) else text


def machine(threads: int | None = None) -> str:
    """One line for a table caption: date, CPU, cores, torch version and threads."""
    import torch

    cpu = platform.processor() or platform.machine()
    return (f"{datetime.date.today().isoformat()}, {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{threads if threads is not None else torch.get_num_threads()} torch thread(s)")


def spread_of(values: Sequence[float]) -> Spread:
    """A Spread of already measured values (e.g. one ratio per training step)."""
    return Spread(tuple(float(v) for v in values))


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table: the header row, the separator, then one line per row (cells as str)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])
