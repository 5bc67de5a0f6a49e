"""A measured device: its datasheet-style peaks (DeviceSpec) and the Efficiency fitted to steps
timed on it, with what else the fit measured (the model's load time, its weights' bytes, each
calibration run's measured against modelled seconds). One JSON file each: the calibration cache
of this machine (cache_dir()/step_costs/<key digest>.json, like the linear choices' cache) and a
device file that a job elsewhere names in plan.devices are the same format, so a calibration
copied from a GPU box is a device here.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from batchpage.fileio import atomic_write_text
from batchpage.paths import cache_dir
from batchpage.simulate.devices import DeviceSpec
from batchpage.simulate.step_cost import Efficiency

log = logging.getLogger(__name__)

# Bump when the calibration's steps or the fit change: cached calibrations are then measured again.
CALIBRATION_VERSION = 3


@dataclass(frozen=True)
class MeasuredDevice:
    spec: DeviceSpec
    efficiency: Efficiency
    source: str  # what was measured, for the report: "calibrated <when>", a file's path
    load_s: float | None = None  # LLM(...) on the calibrated setup (None: not measured)
    weight_bytes: int | None = None  # what the loaded model holds (CausalLM.weight_bytes)
    per_request_s: float = 0.0  # a generate call's host work per request outside the steps
    # Each calibration group: its kind, measured and modelled seconds.
    checks: list[dict[str, Any]] = field(default_factory=list)
    key: dict[str, str] = field(default_factory=dict)  # what decides the calibration
    # On a CPU: what the engine held after the calibration's steps beyond its weights and K/V
    # pages (activations the allocator keeps, kernel buffers, libraries); None: not measured.
    engine_bytes: int | None = None

    def to_json(self) -> str:
        data = asdict(self)
        data["version"] = CALIBRATION_VERSION
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> MeasuredDevice:
        """ValueError for a file that is not a measured device of this version."""
        try:
            data = json.loads(text)
            if data.get("version") != CALIBRATION_VERSION:
                raise ValueError(f"version {data.get('version')}, not {CALIBRATION_VERSION}")
            return cls(
                DeviceSpec(**data["spec"]),
                Efficiency(**data["efficiency"]),
                data["source"],
                data.get("load_s"),
                data.get("weight_bytes"),
                float(data.get("per_request_s", 0.0)),
                list(data.get("checks", [])),
                dict(data.get("key", {})),
                data.get("engine_bytes"),
            )
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
            raise ValueError(f"not a measured device ({type(e).__name__}: {e})") from None


def load_device(path: str | Path) -> MeasuredDevice:
    """A device file (plan.devices=[path.json]). ValueError naming the file when it is not one."""
    try:
        return MeasuredDevice.from_json(Path(path).expanduser().read_text())
    except (OSError, ValueError) as e:
        raise ValueError(
            f"device file {path}: {e}; give a calibration file (cache_dir()/step_costs/*.json "
            "of the machine measured)"
        ) from None


class CalibrationCache:
    """Measured devices by setup (`key`: what decides the step costs), one JSON file each
    under `folder` (default: cache_dir()/step_costs)."""

    def __init__(self, key: dict[str, str], folder: Path | None = None) -> None:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self.key = key
        self.path = (folder or cache_dir() / "step_costs") / f"{digest}.json"

    def get(self) -> MeasuredDevice | None:
        try:
            found = MeasuredDevice.from_json(self.path.read_text())
        except (OSError, ValueError):
            return None
        return found if found.key == self.key else None

    def put(self, measured: MeasuredDevice) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, measured.to_json())
        except OSError as exc:  # a read-only cache folder: measured again next time
            log.warning("cannot save the step-cost calibration to %s (%s)", self.path, exc)
