"""batchpage.omp_wait: OMP_WAIT_POLICY chosen at import from the machine's load, and only where
nothing decided it already. Others' busy cores against a process spinning beside the sample
(/proc/stat, the kernel's own count, as the reference)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchpage.omp_wait import BUSY_CORES, _cpu_times, choose_wait_policy, others_busy_cores

ROOT = Path(__file__).resolve().parents[1]
linux = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="/proc/stat is Linux's")
two_cores = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: nothing to wait for")


@two_cores
def test_passive_only_where_the_machine_is_busy_and_nothing_decided() -> None:
    busy = BUSY_CORES + 0.1
    assert choose_wait_policy({}, False, busy) == "PASSIVE"
    assert choose_wait_policy({}, False, BUSY_CORES - 0.1) is None
    assert choose_wait_policy({}, False, None) is None  # no /proc: libgomp's default
    assert choose_wait_policy({}, True, busy) is None  # torch read its environment already
    assert choose_wait_policy({"OMP_WAIT_POLICY": "ACTIVE"}, False, busy) is None
    assert choose_wait_policy({"GOMP_SPINCOUNT": "1000"}, False, busy) is None
    assert choose_wait_policy({"OMP_NUM_THREADS": "1"}, False, busy) is None
    assert choose_wait_policy({"OMP_NUM_THREADS": "2"}, False, busy) == "PASSIVE"


def test_cpu_times_read_the_first_line(tmp_path) -> None:
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 5 50 800 20 3 2 1 40 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    assert _cpu_times(stat) == (100 + 5 + 50 + 3 + 2 + 1, 981)


def _spinner() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


@linux
@two_cores
def test_a_spinning_process_counts_as_a_busy_core_and_this_ones_own_work_does_not() -> None:
    spinner = _spinner()
    try:
        assert others_busy_cores(0.5) >= 0.7  # one core, less the scheduler's share elsewhere
    finally:
        spinner.kill()
        spinner.wait()


@linux
@two_cores
def test_importing_batchpage_beside_a_busy_process_sets_passive_unless_decided() -> None:
    def policy(code: str, **env: str) -> str:
        environ = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY",
                   "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}  # fmt: skip
        environ |= {"PYTHONPATH": str(ROOT), **env}
        done = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True,
                              text=True, timeout=120, check=True)  # fmt: skip
        return done.stdout.strip()

    show = "import os; print(os.environ.get('OMP_WAIT_POLICY', 'unset'))"
    spinner = _spinner()
    try:
        assert policy(f"import batchpage; {show}") == "PASSIVE"
        assert policy(f"import batchpage; {show}", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"
        assert policy(f"import torch, batchpage; {show}") == "unset"
    finally:
        spinner.kill()
        spinner.wait()
