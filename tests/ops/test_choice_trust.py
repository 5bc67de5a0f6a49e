"""Measured linear choices that survive a busy start: a measurement too noisy to tell the winner,
or taken while other work held the CPUs, is not cached as a win (it is repeated, then kept
apart as provisional, or the cached choice is kept) and the next start measures again unless
the machine is still busy; a cached choice is spot-checked against its runner-up and measured
again where it loses by more than a margin; a quiet, clean measurement is cached as before.
The timings run through a scripted Clock (the seam the measurement reads): fake layers advance
its wall clock by their speed, and it injects noise, the run queue's wait and the load average.
The last tests read the real machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from batchpage import LLM, SamplingParams
from batchpage.metrics import RunStats
from batchpage.ops.choice_cache import ChoiceCache
from batchpage.ops.linear import LinearOp
from batchpage.ops.linear_method import IntCandidate, LinearMethod
from batchpage.ops.linear_timing import (
    BUSY_SHARE,
    LOSS_MARGIN,
    NOISY_SPREAD,
    REPEATS,
    Clock,
    CpuTimes,
    RowTimes,
    cpu_times,
    judge,
    run_share,
)
from batchpage.ops.measured_linear import TRIES, MeasuredLinears, setup_key

ROWS = (1, 8, 64)  # the spot check's row count: 8


class Machine:
    """A scripted machine: `speeds[name]` seconds a row for each fake layer, a wall clock they
    advance, readings of it after a call late by `late` (in calls, cycled: the timer's noise),
    the share of their ready time our threads run (`share`) and the load average per CPU."""

    def __init__(self, speeds: dict[str, float]) -> None:
        self.speeds = speeds
        self.now = self.ran = self.waited = 0.0
        self.share, self.load = 1.0, 0.2
        self.late: list[float] = []  # none: an exact clock
        self.noisy_rows: set[int] | None = None  # late at these row counts only (None: all)
        self.quiet_after: int | None = None  # calls after which `share` is 1 (None: never)
        self.last = 0.0  # the last call's seconds, the scale of the lateness
        self.read_since_call = True
        self.readings = 0  # readings after a call, which `late` cycles over
        self.calls: list[tuple[str, int]] = []  # (layer, rows) of every call

    def run(self, name: str, rows: int) -> None:
        self.last = self.speeds[name] * rows
        quiet = self.quiet_after is not None and len(self.calls) >= self.quiet_after
        share = 1.0 if quiet else self.share
        self.now += self.last
        self.ran += self.last * share
        self.waited += self.last * (1 - share)
        self.calls.append((name, rows))
        self.read_since_call = False

    def wall(self) -> float:
        """The time; the first reading after a call late by the next of `late` (a monotonic
        clock all the same)."""
        noisy = self.noisy_rows is None or bool(self.calls) and self.calls[-1][1] in self.noisy_rows
        if not self.read_since_call and self.late and noisy:
            self.now += self.late[self.readings % len(self.late)] * self.last
            self.readings += 1
        self.read_since_call = True
        return self.now

    @property
    def clock(self) -> Clock:
        return Clock(self.wall, lambda: CpuTimes(self.ran, self.waited), lambda: self.load)


class Layer(LinearOp):
    """A fake candidate's layer: F.linear, costing its candidate's speed on the machine."""

    def __init__(self, machine: Machine, name: str, weight: torch.Tensor) -> None:
        super().__init__()
        self.machine, self.name, self.weight = machine, name, weight

    def apply(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        self.machine.run(self.name, x.shape[0])
        return F.linear(x, self.weight)

    @property
    def weight_format(self) -> str:
        return "f32"


def candidates(machine: Machine) -> list[LinearMethod]:
    return [
        LinearMethod(n, lambda w, b, n=n: Layer(machine, n, w), version="v1")
        for n in ("cpu_f32", "torch")
    ]


def engine(machine: Machine, folder: Path) -> MeasuredLinears:
    """One start's measured linears on `machine`, its choices cached in `folder`."""
    dense = candidates(machine)
    cache = ChoiceCache(setup_key(dense, torch.float32, ROWS), folder)
    return MeasuredLinears(dense, torch.float32, ROWS, cache, clock=machine.clock)


def bind(m: MeasuredLinears, n: int = 6, k: int = 4) -> Layer:
    return m.method().make(torch.randn(n, k), None)  # type: ignore[return-value]


def test_a_quiet_clean_measurement_is_cached_with_its_runner_up_and_load(tmp_path: Path) -> None:
    machine = Machine({"cpu_f32": 1.0, "torch": 1.3})
    m = engine(machine, tmp_path)
    assert bind(m).name == "cpu_f32" and m.measured == 1
    note = m.report()["shapes"]["6x4"]
    assert note["how"] == "measured" and note["tries"] == 1
    assert note["load"] == 0.2 and note["run_share"] == 1.0 and note["margin"] == 1.3
    # One measurement: REPEATS timed calls (and a warm-up) per candidate and row count.
    assert len(machine.calls) == len(ROWS) * 2 * (REPEATS + 1)
    on_disk = json.loads(m.cache.path.read_text())
    assert on_disk["choices"] == {"6x4": "cpu_f32"}
    assert on_disk["measured"]["6x4"]["runner_up"] == "torch"
    assert on_disk["measured"]["6x4"]["load"] == 0.2


def test_a_noisy_measurement_is_not_cached_as_a_win(tmp_path: Path) -> None:
    """The two candidates a near tie, the clock's readings late by none, one or two calls in
    turn (each candidate's repeats 1, 3 and 2 calls long or 2, 1 and 3: medians twice the
    fastest): measured TRIES times, never to be trusted, so the winner of the last is used for
    this run, provisional: no win is cached, and a quiet next start measures again and caches
    its winner."""
    machine = Machine({"cpu_f32": 1.0, "torch": 1.04})
    machine.late = [0.0, 1.0, 2.0]
    m = engine(machine, tmp_path)
    chosen = bind(m).name
    note = m.report()["shapes"]["6x4"]
    assert note["how"] == "provisional" and note["tries"] == TRIES
    assert note["spread"] > NOISY_SPREAD and note["margin"] < note["spread"]
    assert m.choices == {"6x4": chosen}  # used for this run
    assert len(machine.calls) == TRIES * len(ROWS) * 2 * (REPEATS + 1)  # bounded
    assert ChoiceCache(m.cache.key, tmp_path).get("6x4") is None
    assert bind(m).name == chosen and m.measured == 1  # another layer: not measured again

    quiet = Machine({"cpu_f32": 1.0, "torch": 1.04})
    again = engine(quiet, tmp_path)
    assert bind(again).name == "cpu_f32" and again.measured == 1
    assert again.report()["shapes"]["6x4"]["how"] == "measured"
    assert ChoiceCache(m.cache.key, tmp_path).get("6x4") == "cpu_f32"


def test_a_busy_measurement_is_provisional_and_measured_again_at_the_next_start(
    tmp_path: Path,
) -> None:
    """Other work held the CPUs half the time our threads were ready (a clean, wide win all the
    same): measured twice, provisional, its load recorded; a next start on the machine still
    busy reuses it after its spot check; the next quiet one measures and caches."""
    busy = Machine({"cpu_f32": 1.0, "torch": 0.5})  # torch wins while busy
    busy.share, busy.load = 0.5, 3.0
    m = engine(busy, tmp_path)
    assert bind(m).name == "torch"
    note = m.report()["shapes"]["6x4"]
    assert note["how"] == "provisional" and note["tries"] == 2  # busy twice: it lasts
    assert note["run_share"] == 0.5 and note["load"] == 3.0
    entry = ChoiceCache(m.cache.key, tmp_path).entry("6x4")
    assert m.cache.get("6x4") is None and entry.provisional and entry.choice == "torch"

    busy.calls.clear()  # a next start on the still busy machine: its spot check, no more
    still = engine(busy, tmp_path)
    assert bind(still).name == "torch" and still.measured == 0
    assert still.report()["shapes"]["6x4"]["how"] == "reused"
    assert {rows for _, rows in busy.calls} == {8}

    quiet = Machine({"cpu_f32": 1.0, "torch": 1.5})  # on the quiet machine cpu_f32 wins
    again = engine(quiet, tmp_path)
    assert bind(again).name == "cpu_f32" and again.measured == 1
    assert again.report()["shapes"]["6x4"] == {
        "how": "measured", "load": 0.2, "run_share": 1.0, "spread": 1.0, "margin": 1.5,
        "tries": 1, "spot_rival": "cpu_f32", "spot_loss": 1.5, "spot_spread": 1.0,
        "spot_run_share": 1.0,
    }  # fmt: skip
    entry = ChoiceCache(m.cache.key, tmp_path).entry("6x4")
    assert entry[:2] == ("cpu_f32", "torch") and not entry.provisional


def test_a_burst_of_load_that_passes_is_measured_again_and_cached(tmp_path: Path) -> None:
    machine = Machine({"cpu_f32": 1.0, "torch": 1.5})
    machine.share, machine.quiet_after = 0.3, len(ROWS) * 2 * (REPEATS + 1)  # one measurement
    m = engine(machine, tmp_path)
    assert bind(m).name == "cpu_f32"
    note = m.report()["shapes"]["6x4"]
    assert note["how"] == "measured" and note["tries"] == 2 and note["run_share"] == 1.0
    assert ChoiceCache(m.cache.key, tmp_path).get("6x4") == "cpu_f32"


@pytest.mark.parametrize("older_cache", [False, True])
def test_a_stale_cached_choice_is_spot_checked_measured_again_and_replaced(
    tmp_path: Path, older_cache: bool
) -> None:
    """The cache says torch (a busy start's, or a cache written before runner-ups were kept);
    at the spot check cpu_f32 is three times faster: measured in full and replaced. The next
    start's spot check passes and measures nothing."""
    machine = Machine({"cpu_f32": 1.0, "torch": 3.0})
    m = engine(machine, tmp_path)
    if older_cache:
        m.cache.path.parent.mkdir(parents=True, exist_ok=True)
        m.cache.path.write_text(json.dumps({"key": m.cache.key, "choices": {"6x4": "torch"}}))
    else:
        m.cache.put("6x4", "torch", "cpu_f32", {"load": 2.5})
    assert bind(m).name == "cpu_f32" and m.measured == 1
    note = m.report()["shapes"]["6x4"]
    assert note["how"] == "re-measured" and note["spot_loss"] == 3.0 and note["load"] == 0.2
    # The spot check: both at 8 rows, a warm-up and REPEATS each, before the full measurement.
    spot = machine.calls[: 2 * (REPEATS + 1)]
    assert {rows for _, rows in spot} == {8} and {n for n, _ in spot} == {"cpu_f32", "torch"}
    assert ChoiceCache(m.cache.key, tmp_path).entry("6x4")[:2] == ("cpu_f32", "torch")

    machine.calls.clear()
    again = engine(machine, tmp_path)
    assert bind(again).name == "cpu_f32" and again.measured == 0
    assert again.report()["shapes"]["6x4"]["how"] == "cached"
    assert len(machine.calls) == 2 * (REPEATS + 1)  # the spot check alone


def test_a_cached_choice_within_the_margin_is_kept_unmeasured(tmp_path: Path) -> None:
    machine = Machine({"cpu_f32": 1.0, "torch": 1.0 * LOSS_MARGIN * 0.95})
    m = engine(machine, tmp_path)
    m.cache.put("6x4", "torch", "cpu_f32", {"load": 0.1, "run_share": 0.99})
    assert bind(m).name == "torch" and m.measured == 0
    note = m.report()["shapes"]["6x4"]
    assert note["how"] == "cached" and note["load"] == 0.1 and note["spot_rival"] == "cpu_f32"


def test_a_lost_spot_check_keeps_the_cached_choice_when_the_new_measurement_is_noisy(
    tmp_path: Path,
) -> None:
    """The spot check (at 8 rows, clean) says the cached torch loses; the full measurement is
    noisy at 1 row (medians five times the fastest repeat, more than the lead over three row
    counts): not to be trusted, so torch stays, cached and bound."""
    machine = Machine({"cpu_f32": 1.0, "torch": 1.5})
    machine.late, machine.noisy_rows = [0.0, 4.0, 8.0], {1}
    m = engine(machine, tmp_path)
    m.cache.put("6x4", "torch", "cpu_f32", {})
    assert bind(m).name == "torch" and m.measured == 1
    note = m.report()["shapes"]["6x4"]
    assert note["how"] == "kept" and note["tries"] == TRIES and note["spot_loss"] == 1.5
    assert ChoiceCache(m.cache.key, tmp_path).get("6x4") == "torch"


def test_a_busy_spot_check_decides_nothing(tmp_path: Path) -> None:
    machine = Machine({"cpu_f32": 1.0, "torch": 3.0})
    machine.share = 0.4
    m = engine(machine, tmp_path)
    m.cache.put("6x4", "torch", "cpu_f32", {"load": 0.1})
    assert bind(m).name == "torch" and m.measured == 0
    assert m.report()["shapes"]["6x4"]["how"] == "unchecked"


class IntLayer(LinearOp):
    """A fake int implementation's layer: x @ W.T from the dequantized weight, on the machine."""

    def __init__(self, machine: Machine, name: str, weight) -> None:
        super().__init__()
        self.machine, self.name = machine, name
        self.dense = weight.dequantize(torch.float32)
        self.out_features, self.in_features = self.dense.shape

    def apply(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        self.machine.run(self.name, x.shape[0])
        return F.linear(x, self.dense)


def test_the_int_candidates_choice_is_provisional_when_busy_and_replaced_when_stale(
    tmp_path: Path,
) -> None:
    from batchpage.quant.scheme import QuantScheme
    from tests.ops.test_onednn_int8_linear import random_weight

    w = random_weight(6, 8, 8, 8, False, seed=2)
    scheme = QuantScheme("compressed-tensors", 8, None, True, False, int8_activations=True)

    def start(machine: Machine) -> MeasuredLinears:
        ints = [
            IntCandidate(n, lambda w, b, s, n=n: IntLayer(machine, n, w), lambda w, s: True, "v1")
            for n in ("int_a8", "onednn_int8")
        ]
        dense = candidates(machine)
        key = setup_key([*dense, *ints], torch.float32, ROWS)
        cache = ChoiceCache(key, tmp_path)
        return MeasuredLinears(dense, torch.float32, ROWS, cache, ints, clock=machine.clock)

    busy = Machine({"int_a8": 2.0, "onednn_int8": 1.0})
    busy.share = 0.5
    m = start(busy)
    assert m.method().make_int(w, None, scheme).name == "onednn_int8"
    (shape,) = m.choices
    assert m.report()["shapes"][shape]["how"] == "provisional" and m.cache.get(shape) is None

    stale = Machine({"int_a8": 1.0, "onednn_int8": 2.0})
    m = start(stale)
    m.cache.put(shape, "onednn_int8", "int_a8", {"load": 3.0})
    assert m.method().make_int(w, None, scheme).name == "int_a8"
    assert m.report()["shapes"][shape]["how"] == "re-measured"
    assert m.cache.get(shape) == "int_a8"


def test_a_provisional_choice_is_no_win_and_never_replaces_one(tmp_path: Path) -> None:
    cache = ChoiceCache({"setup": "x"}, tmp_path)
    cache.put("4x4", "torch", "cpu_f32", {"run_share": 0.4}, provisional=True)
    assert cache.get("4x4") is None  # what an older batchpage reads: no choice
    assert json.loads(cache.path.read_text())["choices"] == {}
    assert cache.entry("4x4") == ("torch", "cpu_f32", {"run_share": 0.4}, True)
    cache.put("4x4", "cpu_f32", "torch", {"run_share": 1.0})
    assert cache.entry("4x4") == ("cpu_f32", "torch", {"run_share": 1.0}, False)
    cache.put("4x4", "torch", None, {}, provisional=True)
    assert cache.get("4x4") == "cpu_f32" and not cache.entry("4x4").provisional


def test_judge_weighs_the_lead_against_the_spread() -> None:
    """A wide spread with a wider lead is a clear win; the same spread with a narrow lead is
    noise; a busy sample is busy whatever its figures."""

    def sample(a: list[float], b: list[float], waited: float = 0.0) -> RowTimes:
        return RowTimes({"a": a, "b": b}, ran=1.0, waited=waited, load=None)

    wide_lead = judge([sample([1.0, 1.6, 1.3], [3.0, 3.1, 3.2])], "a")
    assert wide_lead.reliable and wide_lead.runner_up == "b"
    assert wide_lead.spread == pytest.approx(1.3) and wide_lead.margin == pytest.approx(3.1 / 1.3)
    narrow = judge([sample([1.0, 1.6, 1.3], [1.35, 1.4, 1.4])], "a")
    assert narrow.noisy and not narrow.reliable and "noisy" in narrow.why()
    busy = judge([sample([1.0, 1.0, 1.0], [3.0, 3.0, 3.0], waited=0.5)], "a")
    assert busy.busy and not busy.noisy and busy.run_share == pytest.approx(1 / 1.5)
    assert busy.load is None and busy.record()["load"] is None


def test_run_stats_carry_the_linear_measurement_into_run_json_records() -> None:
    stats = RunStats(8, 16, 0.0, 1.0)
    stats.linear_measurement = {"seconds": 0.5, "measured": 1, "shapes": {"6x4": {"how": "kept"}}}
    back = RunStats.from_record(json.loads(json.dumps(stats.to_record())), 16)
    assert back.linear_measurement == stats.linear_measurement
    assert RunStats.merged([RunStats(8, 16, 0.0, 1.0), back]).as_dict()["linear_measurement"] == (
        stats.linear_measurement
    )


# --- the real machine ----------------------------------------------------------------------------

# Each pins itself to the CPU given as its argument.
SPIN = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
end = time.time() + 30
while time.time() < end:
    pass
"""
MEASURE = """
import json, os, sys, time
from batchpage.ops.linear_timing import cpu_times
os.sched_setaffinity(0, {int(sys.argv[1])})
before, start = cpu_times(), time.perf_counter()
while time.perf_counter() - start < 1.0:
    pass
after = cpu_times()
print(json.dumps([after.ran - before.ran, after.waited - before.waited]))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux's schedstat")
def test_the_run_share_of_a_thread_sharing_its_cpu_with_two_busy_processes() -> None:
    """Pinned to one CPU beside two spinning processes, a spinning thread runs at most about a
    third of the time it is ready: a busy machine, read from the kernel's run-queue wait."""
    cpu = str(min(os.sched_getaffinity(0)))
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN, cpu]) for _ in range(2)]
    try:
        out = subprocess.run(
            [sys.executable, "-c", MEASURE, cpu], capture_output=True, text=True, check=True,
            timeout=60,
        )  # fmt: skip
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    ran, waited = json.loads(out.stdout)
    share = run_share([RowTimes({}, ran, waited, None)])
    assert ran + waited == pytest.approx(1.0, abs=0.2)
    assert 0.05 < share < 0.45 < BUSY_SHARE  # a third, less where other work shares it too


def test_cpu_times_count_this_process_running() -> None:
    before = cpu_times()
    torch.randn(512, 512) @ torch.randn(512, 512)
    after = cpu_times()
    assert after.ran > before.ran and after.waited >= before.waited


def test_an_engine_reports_how_its_choices_were_made_and_caches_only_trusted_ones(
    tiny_folder: Path, tmp_path: Path, monkeypatch
) -> None:
    """Real measurements on this machine, whatever its load: every bound shape says how its
    choice was made and the load and run share it was measured under (llm.stats, as run.json
    records it); the cache file holds exactly the trusted ones; a second start spot-checks
    those and measures the provisional ones again."""
    monkeypatch.setenv("BATCHPAGE_CACHE", str(tmp_path))

    def start() -> dict:
        llm = LLM(str(tiny_folder), dtype="float32", kv_cache_memory=2**22)
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
        return llm.stats

    stats = start()
    report = stats["linear_measurement"]
    shapes = report["shapes"]
    assert shapes.keys() == stats["linear_methods"].keys()
    assert {n["how"] for n in shapes.values()} <= {"measured", "provisional"}
    assert report["measured"] == len(shapes)
    assert all(
        {"load", "run_share", "spread", "margin", "tries"} <= n.keys() for n in shapes.values()
    )
    (cache_file,) = (tmp_path / "linear_choices").glob("*.json")
    on_disk = json.loads(cache_file.read_text())
    trusted = {s for s, n in shapes.items() if n["how"] == "measured"}
    assert set(on_disk["choices"]) >= trusted
    assert set(on_disk["provisional"]) & shapes.keys() == shapes.keys() - trusted
    assert not set(on_disk["choices"]) & set(on_disk["provisional"])
    again = start()["linear_measurement"]["shapes"]
    for shape in again.keys() & shapes.keys():
        note = again[shape]
        if shape in trusted:
            assert note["how"] in {"cached", "unchecked", "re-measured", "kept"}, (shape, note)
        else:
            assert note["how"] in {"measured", "provisional", "reused"}, (shape, note)
