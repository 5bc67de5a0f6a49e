"""A device's Efficiency from measured times: the factors (share of peak FLOP/s for the linears
and for attention, share of peak bandwidth, overhead per step, per running sequence and per
prefilling sequence) that make the
step-cost model's time of each measured group of steps its measured time.

A group is a list of simulated steps (StepWork, from a replay with keep_steps) and the seconds
they measured: a whole run (jobs/bench/simulated.py fit), or the steps of one kind in a
calibration run (simulate/calibrate.py). The fit is least squares on log time, so every group
weighs the same whatever its length; the steps are held as arrays, so a fit over thousands of
steps takes well under a second.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from batchpage.simulate.step_cost import Efficiency, StepCost, StepWork

FIT_NAMES = (
    "compute", "attention", "decode_attention", "memory", "overhead_s", "per_seq_s",
    "per_prefill_s",
)  # fmt: skip


# Where a fitted factor may go (natural log): a share of a peak or an overhead in seconds
# between 1e-9 and 1e9, so that a factor the groups do not constrain stays finite.
_LOG_RANGE = (math.log(1e-9), math.log(1e9))


class FitGroup(NamedTuple):
    works: Sequence[StepWork]
    measured_s: float
    fixed_s: float = 0.0  # seconds in the measured time the efficiency does not change (swaps)


class _Steps(NamedTuple):
    """One group's steps as float64 columns."""

    flops: torch.Tensor
    attention: torch.Tensor  # a prompt's rows'
    decode_attention: torch.Tensor
    bytes: torch.Tensor
    seqs: torch.Tensor
    prefills: torch.Tensor
    comm_s: float  # the group's all-reduce seconds, and fixed_s


def _columns(group: FitGroup, cost: StepCost) -> _Steps:
    def column(name: str) -> torch.Tensor:
        return torch.tensor([float(getattr(w, name)) for w in group.works], dtype=torch.float64)

    comm = sum(cost.comm_seconds(w) for w in group.works)
    decodes = column("decode_attention_flops")
    return _Steps(
        column("flops"), column("attention_flops") - decodes, decodes, column("bytes"),
        column("seqs"), column("prefills"), comm + group.fixed_s,
    )  # fmt: skip


def group_seconds(steps: _Steps, cost: StepCost, values: torch.Tensor) -> torch.Tensor:
    """The group's modelled seconds under the factors `values` (FIT_NAMES' order)."""
    compute, attention, decode_attention, memory, overhead, per_seq, per_prefill = values.unbind()
    peak, bandwidth = cost.device.flops, cost.device.bandwidth
    computing = (
        steps.flops / (peak * compute)
        + steps.attention / (peak * attention)
        + steps.decode_attention / (peak * decode_attention)
    )
    reading = steps.bytes / (bandwidth * memory)
    busy = torch.maximum(computing, reading) if cost.device.overlap else computing + reading
    per_step = overhead + per_seq * steps.seqs + per_prefill * steps.prefills
    return (per_step + busy).sum() + steps.comm_s


def fit_efficiency(
    groups: Sequence[FitGroup],
    cost: StepCost,
    free: Sequence[str] = FIT_NAMES,
    starts: Sequence[Efficiency] = (),
) -> Efficiency:
    """The Efficiency whose modelled times of the groups best match their measured ones (least
    squares on log time); the factors not in `free` stay as cost.eff has them. Each factor is
    fitted on a log scale, so it stays positive; since a factor's gradient there is
    proportional to its value, one started near zero stays there: `starts` are further starting
    points (their free factors), the best fit of all kept."""
    if not groups:
        raise ValueError("no measured groups to fit")
    columns = [(_columns(g, cost), math.log(g.measured_s)) for g in groups]
    best = None
    for start in (cost.eff, *starts):
        fitted, loss = _fit_from(columns, cost, free, start)
        if best is None or loss < best[1]:
            best = (fitted, loss)
    assert best is not None
    return best[0]


def _fit_from(
    columns: list[tuple[_Steps, float]], cost: StepCost, free: Sequence[str], eff: Efficiency
) -> tuple[Efficiency, float]:
    fixed = torch.tensor([getattr(cost.eff, n) for n in FIT_NAMES], dtype=torch.float64)
    first = torch.tensor([max(getattr(eff, n), 1e-9) for n in FIT_NAMES], dtype=torch.float64)
    mask = torch.tensor([n in free for n in FIT_NAMES])
    start = torch.where(mask, first, fixed.clamp_min(1e-9))
    logs = start.log().clone().requires_grad_(True)
    optimizer = torch.optim.LBFGS([logs], max_iter=200, line_search_fn="strong_wolfe")

    def values() -> torch.Tensor:
        return torch.where(mask, logs.clamp(*_LOG_RANGE), start.log()).exp()

    def loss() -> torch.Tensor:
        optimizer.zero_grad()
        now = values()
        total = torch.zeros((), dtype=torch.float64)
        for steps, measured in columns:
            total = total + (torch.log(group_seconds(steps, cost, now)) - measured) ** 2
        total.backward()
        return total

    optimizer.step(loss)
    with torch.no_grad():
        now = values()
        final = sum(
            float((torch.log(group_seconds(steps, cost, now)) - measured) ** 2)
            for steps, measured in columns
        )
    final = final if math.isfinite(final) else math.inf  # a diverged start loses
    return Efficiency(**dict(zip(FIT_NAMES, now.tolist(), strict=True))), final
