"""How torch's OpenMP threads wait between parallel regions, chosen once, before torch loads.

A step runs thousands of small parallel regions, each ending at a barrier. By default libgomp's
idle threads spin at the barrier before sleeping, which is fastest when every thread has a core
of its own. When other processes already keep cores busy, a spinning thread holds a core that
the thread the barrier waits for needs, and every region stalls for a scheduler time slice:
BENCHMARKS.md ("OpenMP on a busy machine") has a step several times slower, where passive
waiting (a waiting thread sleeps at once) loses little, and it has the price of passive waiting
on an idle machine too. Neither policy wins on both, and libgomp reads its policy once, when it
loads, so the choice is made from what the machine is doing then: when other processes keep at
least half a core busy over a short sample, OMP_WAIT_POLICY=PASSIVE; otherwise libgomp's
default. The policy never changes a result: the same threads split the same work.

Only where nothing decided already: an OMP_WAIT_POLICY or GOMP_SPINCOUNT of the user's, one
thread (no barrier to wait at), or torch loaded before batchpage (its OpenMP read the
environment then; set OMP_WAIT_POLICY yourself before importing torch to choose).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import NamedTuple

# Others' busy cores from which waiting passively pays (measured on 2 cores: one busy process).
BUSY_CORES = 0.5
SAMPLE_S = 0.05
PROC_STAT = Path("/proc/stat")
SELF_STAT = Path("/proc/self/stat")


class CpuTimes(NamedTuple):
    busy: int  # jiffies of every CPU not idle, since boot
    total: int


def _cpu_times(stat: Path) -> CpuTimes:
    fields = [int(x) for x in stat.read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle, iowait
    total = sum(fields[:8])  # guest time is counted in user already
    return CpuTimes(total - idle, total)


def _own_jiffies(self_stat: Path) -> int:
    # Fields after the command's closing parenthesis: utime and stime are the 12th and 13th.
    after = self_stat.read_text().rsplit(")", 1)[1].split()
    return int(after[11]) + int(after[12])


def others_busy_cores(
    sample_s: float = SAMPLE_S, stat: Path = PROC_STAT, self_stat: Path = SELF_STAT
) -> float | None:
    """Cores that other processes kept busy over `sample_s` seconds (this process sleeps
    through it; its own jiffies are taken off anyway), from /proc/stat; None where it cannot be
    read (not Linux)."""
    try:
        a, own_a = _cpu_times(stat), _own_jiffies(self_stat)
        time.sleep(sample_s)
        b, own_b = _cpu_times(stat), _own_jiffies(self_stat)
    except (OSError, ValueError, IndexError):
        return None
    elapsed = b.total - a.total
    if elapsed <= 0:
        return None
    cores = os.cpu_count() or 1
    return max(0.0, (b.busy - a.busy - (own_b - own_a)) / elapsed * cores)


def choose_wait_policy(
    environ: MutableMapping[str, str], torch_loaded: bool, busy_cores: float | None
) -> str | None:
    """The OMP_WAIT_POLICY to set, or None to leave the environment as it is."""
    if torch_loaded or "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return None
    if environ.get("OMP_NUM_THREADS", "").strip() == "1" or (os.cpu_count() or 1) < 2:
        return None
    if busy_cores is None or busy_cores < BUSY_CORES:
        return None
    return "PASSIVE"


def set_wait_policy() -> None:
    """Called once as batchpage is imported: sets OMP_WAIT_POLICY=PASSIVE in this process's
    environment (and so its workers') when choose_wait_policy says so. Samples the machine only
    when the choice is still open."""
    torch_loaded = "torch" in sys.modules
    if choose_wait_policy(os.environ, torch_loaded, BUSY_CORES) is None:
        return  # decided already: no sample needed
    policy = choose_wait_policy(os.environ, torch_loaded, others_busy_cores())
    if policy is not None:
        os.environ["OMP_WAIT_POLICY"] = policy
