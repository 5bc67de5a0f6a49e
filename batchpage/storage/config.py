"""The `storage` config group: what a job sets per store, beside each store's own credential
chain (environment variables such as AWS_ENDPOINT_URL, AWS_PROFILE, STORAGE_EMULATOR_HOST and
AZURE_STORAGE_CONNECTION_STRING, config files, instance metadata), which is always read."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Keys of a store's options whose values are secrets: run.json and logs show them as "***".
SECRET_WORDS = ("secret", "token", "password", "key", "credential", "sas", "connection_string")


@dataclass
class StorageConfig:
    """s3 / gs / az: keyword arguments of that store's fsspec filesystem (s3fs, gcsfs, adlfs),
    e.g. storage.s3={endpoint_url: http://127.0.0.1:9000, profile: nightly},
    storage.gs={project: my-project}. Typed Any: Hydra cannot set a mapping on an empty typed
    node in struct mode.
    lease_seconds: how long a job's lease on an object-storage output folder lasts without a
    heartbeat (it renews at a quarter of it); a job killed with kill -9 blocks a rerun on the
    same folder at most this long.
    retries: tries of a failed request (5xx, a timeout, a dropped connection) with exponential
    backoff before the job stops; its saved rows are kept and a rerun resumes.
    """

    s3: Any = None
    gs: Any = None
    az: Any = None
    lease_seconds: float = 120.0
    retries: int = 6

    def __post_init__(self) -> None:
        if not math.isfinite(self.lease_seconds) or self.lease_seconds < 5:
            raise ValueError(f"storage.lease_seconds={self.lease_seconds} must be >= 5 seconds")
        if self.retries < 1:
            raise ValueError(f"storage.retries={self.retries} must be >= 1")
        for name in ("s3", "gs", "az"):
            value = getattr(self, name)
            if value is not None and not hasattr(value, "items"):
                raise ValueError(
                    f"storage.{name} must be a mapping of that store's options, e.g. "
                    f"storage.{name}={{endpoint_url: ...}}; got {value!r}"
                )

    def options(self, scheme: str) -> dict[str, Any]:
        """The fsspec keyword arguments for a URL scheme (s3, gs/gcs, az/abfs)."""
        group = {"s3": self.s3, "s3a": self.s3, "gs": self.gs, "gcs": self.gs}.get(scheme)
        if group is None and scheme in ("az", "abfs", "abfss"):
            group = self.az
        return dict(group or {})


def redacted(value: Any) -> Any:
    """A config (any nesting of mappings and lists) with secret-looking keys' values hidden."""
    if hasattr(value, "items"):
        return {
            k: "***" if any(w in str(k).lower() for w in SECRET_WORDS) and v else redacted(v)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [redacted(v) for v in value]
    return value
