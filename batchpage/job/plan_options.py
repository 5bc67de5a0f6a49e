"""The job's `plan.*` group: what a dry run estimates besides the job's shape.

`dry_run` stays the switch (a bool: `dry_run=true`), so its options cannot be its children (a
config node is a value or a group, not both): they are `plan.*`, e.g.
`dry_run=true plan.devices=[this,h100,h100:tp8,l4] plan.output_tokens=sample:32`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchpage.simulate.devices import parse_device
from batchpage.simulate.options import parse_output_tokens


@dataclass
class PlanConfig:
    """What `dry_run=true` estimates besides the job's shape, KV bytes, memory and preemption.

    devices: where to estimate the wall time: `this` (this machine: a few seconds of
    calibration steps on the model the first time, cached), h100, a100-80gb, h200, l4 (their
    datasheets), `name:tpN` for N devices (tensor parallel), or a device file (.json). Empty: no
    wall time (the dry run stays as fast as the tokenizing pass).
    output_tokens: the output-length estimate (max_tokens is always the bound): `max`, a number
    of tokens, or `sample:N`, which generates N of the job's rows for real to learn it.
    simulated_rows: rows whose schedule is simulated; a larger job is sampled (whole windows,
    uniformly) and scaled."""

    devices: list[str] = field(default_factory=list)
    output_tokens: str = "max"
    simulated_rows: int = 8192

    def __post_init__(self) -> None:
        for name in self.devices:
            try:
                parse_device(name)
            except ValueError as e:
                raise ValueError(f"plan.devices: {e}") from None
        try:
            parse_output_tokens(self.output_tokens)
        except ValueError as e:
            raise ValueError(f"plan.{e}") from None
        if self.simulated_rows < 1:
            raise ValueError(f"plan.simulated_rows={self.simulated_rows} must be >= 1")
