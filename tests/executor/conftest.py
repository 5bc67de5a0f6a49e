"""A local Ray instance shared by a test module (starting one takes tens of seconds on 2 cores)."""

from __future__ import annotations

import pytest

from tests.extras import require


@pytest.fixture(scope="module")
def ray_instance():
    ray = require("ray", "ray")
    if not ray.is_initialized():
        # A private instance, whatever else runs on the machine (a `ray start` cluster).
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=True,
            logging_level="WARNING",
        )
    yield ray
    ray.shutdown()
