"""How much CPU time the hypervisor took from this machine while something ran ("steal").

On a virtual machine whose host is oversubscribed, the guest's CPUs wait while other
guests run; Linux counts that time per CPU as steal (/proc/stat, the eighth value of each
cpu line). It slows every job alike and no code in the guest can help it: in one session
here a bundled-model GPTQ that ran in 0.84-0.93 s took 1.6-2.4 s a quarter of an hour later,
while a best-of-thirty GEMM timing stayed at its usual rate, and /proc/stat showed 5.7
CPU-seconds stolen out of 20 during one 10-second run. The benchmarks record the stolen
share of each timed run beside its time, so a table says whether it was measured on a
quiet machine, and can run again a case whose run lost too much (--max-steal). Steal is
not all a busy host costs: memory and caches shared with its other guests slow a run
without counting as steal (a quiet run with 1% stolen took 1.7 s, one with 8.6% 2.4 s).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

STAT = Path("/proc/stat")
STEAL_FIELD = 8  # of "cpu user nice system idle iowait irq softirq steal ...": index in split()


def stolen_seconds(stat: Path = STAT) -> float | None:
    """CPU-seconds stolen from all of this machine's CPUs since boot; None where the
    kernel does not say (no /proc/stat, or a kernel too old to count steal)."""
    try:
        fields = stat.read_text().splitlines()[0].split()
    except OSError:
        return None
    if fields[0] != "cpu" or len(fields) <= STEAL_FIELD:
        return None
    return int(fields[STEAL_FIELD]) / os.sysconf("SC_CLK_TCK")


@dataclass
class Steal:
    """What one measured stretch lost: `share` of the machine's CPU time (stolen CPU-seconds
    over wall seconds times CPUs); None where the kernel does not count steal."""

    share: float | None = None

    def shown(self) -> str:
        return largest_share([self.share])


def largest_share(shares: list[float | None]) -> str:
    """The largest of the shares that were measured, as a percentage; n/a where none was."""
    known = [share for share in shares if share is not None]
    return f"{100 * max(known):.0f}%" if known else "n/a"


@contextmanager
def measured_steal(stat: Path = STAT) -> Iterator[Steal]:
    """Steal over the with block: the yielded Steal's share is set when it ends."""
    steal, before, start = Steal(), stolen_seconds(stat), time.perf_counter()
    try:
        yield steal
    finally:
        after, wall = stolen_seconds(stat), time.perf_counter() - start
        if before is not None and after is not None and wall > 0:
            steal.share = max(0.0, after - before) / (wall * (os.cpu_count() or 1))


def little_steal(run: Callable[[], dict], max_share: float, retries: int) -> tuple[dict, int]:
    """run()'s result (a dict with its "stolen" share, and "wall" seconds), run again up to
    `retries` times while that share is over max_share (not a failed run's: "error"); and
    how many times it ran again."""
    result, again = run(), 0
    while again < retries and "error" not in result and (share := result.get("stolen")) is not None \
            and share > max_share:
        print(f"  {result.get('wall', float('nan')):.1f} s with {100 * share:.0f}% of the CPU stolen by the "
              f"hypervisor (over {100 * max_share:g}%): run again", flush=True)
        result, again = run(), again + 1
    return result, again
