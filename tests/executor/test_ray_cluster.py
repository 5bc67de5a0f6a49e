"""executor=ray beside a Ray cluster that runs on the machine (`ray start --head`, the normal
state of a Ray user's box): no executor.address starts a private local instance sized as
configured, never the cluster (Ray refused the resource arguments there); an address or `auto`
joins the cluster as it is sized.

The cluster is a real one, started here on free ports in a temp folder of its own and stopped
afterwards by its process group (never `ray stop`, which stops every Ray on the machine)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.executor.jobs import job_args, ray_args, run_json, write_rows
from tests.extras import require

ROOT = Path(__file__).resolve().parents[2]
CONNECT = (
    "import json, sys, ray\n"
    "from batchpage.executor.config import ExecutorConfig\n"
    "from batchpage.executor.ray_cluster import connect\n"
    "c = connect(ExecutorConfig(kind='ray', num_replicas=1, address=sys.argv[1]))\n"
    "print(json.dumps({'address': c.address, 'owned': c.owned,\n"
    "    'cpus': ray.cluster_resources().get('CPU'),\n"
    "    'gcs': ray.get_runtime_context().gcs_address}))\n"
    "ray.shutdown()\n"
)


@dataclass(frozen=True)
class Head:
    address: str  # host:port of its GCS
    cpus: int  # what it was started with: never this machine's count
    # Ray's token auth, as a user's cluster would have it: a process joins with the cluster's
    # token. The token is the test's own, not ~/.ray/auth_token's, which a local ray.init may
    # have made for another cluster.
    auth: dict[str, str]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_cpus() -> int:
    return len(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def ray_head() -> Iterator[Head]:
    require("ray", "ray")
    temp = tempfile.mkdtemp(prefix="bp-ray-", dir="/tmp")  # short: Ray's socket paths
    port, cpus = free_port(), local_cpus() + 1
    ports = {
        name: free_port()
        for name in (
            "node-manager-port", "object-manager-port", "metrics-export-port",
            "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
        )
    }  # fmt: skip
    cmd = [
        "ray", "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
        f"--num-cpus={cpus}", "--num-gpus=0", "--include-dashboard=false",
        f"--temp-dir={temp}", "--disable-usage-stats",
        *(f"--{name}={value}" for name, value in ports.items()),
    ]  # fmt: skip
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, **auth},
    )  # fmt: skip
    try:
        seen = []
        for line in proc.stdout:  # type: ignore[union-attr]
            seen.append(line)
            if "Ray runtime started" in line:
                break
        else:
            pytest.fail("ray start --head did not start:\n" + "".join(seen[-30:]))
        yield Head(f"127.0.0.1:{port}", cpus, auth)
    finally:
        # --block: `ray start` stops what it started on SIGTERM; the group catches the rest.
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def connect_in_a_fresh_process(address: str, head: Head) -> dict:
    """connect() in a new Python with RAY_ADDRESS naming the running cluster, as on a machine
    where `ray start` ran (ray.init would join it unasked)."""
    env = {**os.environ, **head.auth, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": head.address}
    proc = subprocess.run(
        [sys.executable, "-c", CONNECT, address],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_no_address_starts_a_private_instance_beside_a_running_cluster(ray_head: Head) -> None:
    got = connect_in_a_fresh_process("", ray_head)
    assert (got["address"], got["owned"]) == ("local", True)
    assert got["cpus"] == local_cpus()  # sized as configured, not the cluster's
    assert got["gcs"] != ray_head.address


@pytest.mark.parametrize("how", ["address", "auto"])
def test_an_address_or_auto_joins_the_cluster_as_it_is_sized(ray_head: Head, how: str) -> None:
    address = ray_head.address if how == "address" else "auto"
    got = connect_in_a_fresh_process(address, ray_head)
    assert (got["address"], got["owned"]) == (address, True)
    assert got["cpus"] == ray_head.cpus
    assert got["gcs"].rsplit(":", 1)[1] == ray_head.address.rsplit(":", 1)[1]


@pytest.mark.slow
def test_the_job_runs_on_a_private_instance_beside_a_running_cluster(
    tmp_path: Path, tiny_folder: Path, ray_head: Head
) -> None:
    data = write_rows(tmp_path / "d.jsonl", 6, bad=False)
    out = tmp_path / "out"
    args = job_args(data, tiny_folder, out, *ray_args(replicas=1))
    env = {**os.environ, **ray_head.auth, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": ray_head.address}
    proc = subprocess.run(
        [sys.executable, "-m", "batchpage.run", *args, f"hydra.run.dir={tmp_path}/hydra"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert run_json(out)["runs"][-1]["settings"]["executor"]["address"] == "local"
