"""Object-storage servers for tests, on 127.0.0.1 only: moto's server (the S3 API) and
gcp-storage-emulator (the GCS API, through tests/gcs_emulator_launcher.py). The job reaches them
with the same clients (s3fs, gcsfs) and the same environment variables as the cloud.

    server = S3Server.start()          # conftest's session fixtures do this
    bucket = server.new_bucket()       # a fresh, empty bucket
    url = server.url(bucket, "run-1")  # "s3://<bucket>/run-1"
    subprocess.run([...], env={**os.environ, **server.env})
    server.read(url + "/x")            # bytes through boto3 / google-cloud-storage (reference)
    server.stop()
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_up(process: subprocess.Popen, endpoint: str, name: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode} at start")
        try:
            urllib.request.urlopen(endpoint, timeout=2).close()
            return
        except urllib.error.HTTPError:
            return  # it answers, if not with 200 to "/"
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"{name} did not answer at {endpoint} in {START_TIMEOUT_S:.0f} s")


def split_url(url: str) -> tuple[str, str]:
    """("bucket", "key") of "s3://bucket/key"."""
    bucket, _, key = url.partition("://")[2].partition("/")
    return bucket, key


@dataclass
class StorageServer(ABC):
    """A running server: `endpoint` (http://127.0.0.1:PORT), `env` (what a client process
    needs to find it, to add to os.environ), and reference reads through the service's own
    Python client."""

    scheme: str
    endpoint: str
    env: dict[str, str]
    process: subprocess.Popen
    made: list[str] = field(default_factory=list)

    def url(self, bucket: str, *keys: str) -> str:
        return "/".join([f"{self.scheme}://{bucket}", *keys])

    def new_bucket(self) -> str:
        name = f"bp-{uuid.uuid4().hex[:16]}"
        self._create_bucket(name)
        self.made.append(name)
        return name

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    @abstractmethod
    def endpoint_at(self, endpoint: str) -> dict[str, str]:
        """`env` with the endpoint replaced (e.g. a proxy in front of this server)."""

    # --- the reference client ------------------------------------------------------------------

    @abstractmethod
    def _create_bucket(self, name: str) -> None: ...

    @abstractmethod
    def read(self, url: str) -> bytes:
        """An object's bytes, read with the service's own client."""

    @abstractmethod
    def keys(self, url: str) -> list[str]:
        """The object URLs under a prefix URL, sorted."""


@dataclass
class S3Server(StorageServer):
    @classmethod
    def start(cls) -> S3Server:
        port = free_port()
        endpoint = f"http://127.0.0.1:{port}"
        process = subprocess.Popen(
            [sys.executable, "-c", "from moto.server import main; main()"]
            + ["-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_until_up(process, endpoint, "moto_server")
        return cls("s3", endpoint, cls._env(endpoint), process)

    @staticmethod
    def _env(endpoint: str) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            # No profile or config file of this machine's user may change where requests go.
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def endpoint_at(self, endpoint: str) -> dict[str, str]:
        return self._env(endpoint)

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def _create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def read(self, url: str) -> bytes:
        bucket, key = split_url(url)
        return self.client().get_object(Bucket=bucket, Key=key)["Body"].read()

    def keys(self, url: str) -> list[str]:
        bucket, prefix = split_url(url)
        pages = (
            self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        )
        return sorted(
            self.url(bucket, o["Key"]) for page in pages for o in page.get("Contents", [])
        )

    def pending_uploads(self, bucket: str) -> list[str]:
        """Keys with an unfinished multipart upload."""
        out = self.client().list_multipart_uploads(Bucket=bucket)
        return sorted(u["Key"] for u in out.get("Uploads", []))


@dataclass
class GCSServer(StorageServer):
    @classmethod
    def start(cls) -> GCSServer:
        port = free_port()
        endpoint = f"http://127.0.0.1:{port}"
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.gcs_emulator_launcher"]
            + ["--host", "127.0.0.1", "--port", str(port)],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_until_up(process, endpoint, "gcp-storage-emulator")
        return cls("gs", endpoint, cls._env(endpoint), process)

    @staticmethod
    def _env(endpoint: str) -> dict[str, str]:
        return {
            "STORAGE_EMULATOR_HOST": endpoint,
            # gcsfs otherwise probes the bucket's type over gRPC, which the emulator lacks
            # (each probe waits out a timeout); read when gcsfs is first imported.
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            "GOOGLE_CLOUD_PROJECT": "batchpage-test",
            # Credentials: none. No probe of a metadata server off this machine.
            "NO_GCE_CHECK": "true",
            "GCE_METADATA_HOST": "127.0.0.1:9",
            "GCE_METADATA_IP": "127.0.0.1:9",
        }

    def endpoint_at(self, endpoint: str) -> dict[str, str]:
        return self._env(endpoint)

    def client(self) -> Any:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(
            project="batchpage-test",
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": self.endpoint},
        )

    def _create_bucket(self, name: str) -> None:
        self.client().create_bucket(name)

    def read(self, url: str) -> bytes:
        bucket, key = split_url(url)
        return self.client().bucket(bucket).blob(key).download_as_bytes()

    def keys(self, url: str) -> list[str]:
        bucket, prefix = split_url(url)
        blobs = self.client().list_blobs(bucket, prefix=prefix)
        return sorted(self.url(bucket, b.name) for b in blobs)
