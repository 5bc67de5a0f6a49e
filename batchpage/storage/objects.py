"""Object storage behind the storage seam: S3, GCS, Azure Blob and any other fsspec filesystem.

    store = ObjectStore.for_scheme("s3", StorageConfig())
    store.create_bytes("s3://bucket/run-1/shard-00000001.parquet", data)   # If-None-Match: *

Paths are full URLs in and out: everything returned keeps the scheme it was asked with. Writes
are whole or absent without a rename: a single PUT or a multipart upload becomes an object only
when it completes, and one that fails is aborted. Requests that fail for a passing reason are
tried again (retry.py); a bucket that does not exist or refuses us is a StorageError that names
the URL and the fix. No message holds a credential: they name the URL (without any user:secret@
part), the error's class and code, and where credentials are read from.
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib
import io
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any, BinaryIO, NoReturn, TypeVar

import fsspec

from batchpage.storage.config import StorageConfig
from batchpage.storage.retry import RetryPolicy, error_code, is_transient, status_of
from batchpage.storage.store import JobLock, ObjectInfo, StorageError, Store, safe_url

T = TypeVar("T")

# A reader's block: a read fetches what it asks for plus this much ahead (fsspec's readahead
# cache), so a sequential scan is a few large GETs and reading an object's head costs two blocks.
READ_BLOCK = 4 * 2**20
# Parts of a multipart (S3) or resumable (GCS: a multiple of 256 KiB) upload: what an upload
# holds in memory, and the size past which an object goes up in parts. S3's 10,000 parts make
# objects of up to 160 GiB.
WRITE_BLOCK = 16 * 2**20

# URL schemes and their client package: CLIENTS of storage/__init__.py, which this module cannot
# import (the package imports this module; tests/test_imports.py forbids the cycle);
# tests/storage/test_clients.py checks that the two agree.
CLIENT_OF = {
    "s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs",
    "az": "adlfs", "abfs": "adlfs", "abfss": "adlfs",
}  # fmt: skip

# Where each client reads credentials from, for the message of a refused request.
CREDENTIALS = {
    "s3fs": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or AWS_PROFILE (AWS_ENDPOINT_URL for a "
    "server other than AWS), or storage.s3={key: ..., secret: ..., endpoint_url: ...}",
    "gcsfs": "GOOGLE_APPLICATION_CREDENTIALS or `gcloud auth application-default login` "
    "(STORAGE_EMULATOR_HOST for an emulator), or storage.gs={token: ..., project: ...}",
    "adlfs": "AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME with "
    "AZURE_STORAGE_ACCOUNT_KEY or AZURE_CLIENT_ID/AZURE_TENANT_ID/AZURE_CLIENT_SECRET, or "
    "storage.az={account_name: ...}",
}
DENIED_CODES = frozenset(
    {
        "AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch",
        "ExpiredToken", "InvalidToken", "AuthorizationFailure", "AuthenticationFailed",
    }
)  # fmt: skip
MISSING_BUCKET_CODES = frozenset({"NoSuchBucket", "ContainerNotFound"})
# Client errors that mean no usable credentials were found (named: no client import needed).
NO_CREDENTIALS = frozenset(
    {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
     "DefaultCredentialsError", "ClientAuthenticationError"}
)  # fmt: skip


class ObjectStore(Store):
    """One fsspec filesystem, addressed with full URLs of one scheme."""

    def __init__(self, fs: fsspec.AbstractFileSystem, scheme: str, retries: int = 6) -> None:
        self.fs = fs
        self.scheme = scheme
        self.client = CLIENT_OF.get(scheme)
        self.policy = RetryPolicy(tries=retries)
        # Buckets seen to exist: a missing object is then just missing, without asking again.
        self._buckets: set[str] = set()

    @classmethod
    def for_scheme(cls, scheme: str, config: StorageConfig) -> ObjectStore:
        """The store for `<scheme>://` URLs with the job's `storage.<scheme>` options.
        StorageError when the scheme's client package is not installed or fsspec has none."""
        client = CLIENT_OF.get(scheme)
        if client is not None:
            try:
                importlib.import_module(client)
            except ImportError:
                raise StorageError(
                    f"reading/writing {scheme}:// paths needs {client}: "
                    "pip install 'batchpage[cloud]'"
                ) from None
        options: dict[str, Any] = config.options(scheme)
        if client == "s3fs":
            # botocore's own retries off: our policy is the one count of tries (`retries`).
            conf = dict(options.get("config_kwargs") or {})
            conf.setdefault("retries", {"mode": "standard", "total_max_attempts": 1})
            options["config_kwargs"] = conf
        if client is not None:
            # No listing cache: `info` and listings must see what other writers changed since
            # (a cached listing hides a replaced input object from InputWatch's HEAD).
            options.setdefault("use_listings_cache", False)
        if scheme not in fsspec.available_protocols():
            raise StorageError(f"no filesystem for {scheme}:// paths (fsspec knows none)")
        try:
            # A fresh instance: fsspec's cache would share one (and the attributes set below)
            # with every other user of the same options in this process.
            fs = fsspec.filesystem(scheme, skip_instance_cache=True, **options)
        except (ValueError, TypeError, ImportError) as e:
            where = CREDENTIALS.get(client or "", f"storage.{scheme} options")
            raise StorageError(
                f"the {scheme}:// client could not start ({type(e).__name__}); check its "
                f"settings: {where}"
            ) from e
        if client == "s3fs":
            fs.retries = 1  # s3fs's retry loop off too, for the same reason
        return cls(fs, scheme, config.retries)

    # --- names ---------------------------------------------------------------------------------

    def join(self, base: str, *names: str) -> str:
        parts = [base.rstrip("/"), *(n.strip("/") for n in names if n.strip("/"))]
        return "/".join(parts)

    def _key(self, url: str) -> str:
        """The filesystem's own form of a URL (bucket/key, no scheme)."""
        return self.fs._strip_protocol(url).rstrip("/")

    def _url(self, key: str) -> str:
        return f"{self.scheme}://{key.lstrip('/')}"

    def _bucket(self, url: str) -> str:
        return self._key(url).lstrip("/").partition("/")[0]

    # --- calls, retried and explained ----------------------------------------------------------

    def _call(self, path: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) with transient failures retried; a failure about the bucket or
        our credentials becomes a StorageError naming `path` and the fix."""
        try:
            return self.policy.call(fn, *args, **kwargs)
        except FileNotFoundError as e:
            if error_code(e) in MISSING_BUCKET_CODES or not self._bucket_exists(path):
                raise self._no_bucket(path) from None
            raise
        except StorageError:
            raise
        except Exception as e:
            self._reraise(e, path)

    def _reraise(self, e: Exception, path: str) -> NoReturn:
        explained = self._explain(e, path)
        if explained is e:
            raise e
        raise explained from e

    def _explain(self, e: Exception, path: str) -> Exception:
        """A StorageError for a refused or unreachable store; other errors as they are."""
        code = error_code(e)
        what = f"{type(e).__name__}" + (f" {code}" if code else "")
        if code in MISSING_BUCKET_CODES:
            return self._no_bucket(path)
        if (
            isinstance(e, PermissionError)
            or code in DENIED_CODES
            or status_of(e) in (401, 403)
            or str(e).startswith("Forbidden")
            or any(cls.__name__ in NO_CREDENTIALS for cls in type(e).__mro__)
        ):
            where = CREDENTIALS.get(self.client or "", f"storage.{self.scheme} options")
            return StorageError(
                f"{safe_url(path)}: access denied ({what}); check the credentials this job "
                f"runs with ({where}) and that they may read and write this bucket"
            )
        if is_transient(e):
            status = status_of(e)
            return StorageError(
                f"{safe_url(path)}: the storage server failed {self.policy.tries} tries "
                f"({what}{f', HTTP {status}' if status else ''}); check the endpoint and the "
                "network, or raise storage.retries"
            )
        return e

    def _no_bucket(self, path: str) -> StorageError:
        kind = "container" if self.client == "adlfs" else "bucket"
        return StorageError(
            f"{safe_url(path)}: the {kind} {self._bucket(path)!r} does not exist; create it "
            f"(or fix the URL) and run again"
        )

    def _bucket_exists(self, path: str) -> bool:
        """Whether the URL's bucket exists (asked once per bucket); stores without buckets
        (memory://) always say yes."""
        if self.client is None:
            return True
        bucket = self._bucket(path)
        if bucket in self._buckets:
            return True
        try:
            there = bool(self.policy.call(self.fs.exists, bucket))
        except Exception as e:
            self._reraise(e, path)
        if there:
            self._buckets.add(bucket)
        return there

    # --- reading -------------------------------------------------------------------------------

    def info(self, path: str) -> ObjectInfo:
        d = self._call(path, self.fs.info, path)
        if d.get("type") != "file":
            raise FileNotFoundError(f"{path} is not an object (a prefix?)")
        return self._info(d)

    def _info(self, d: dict[str, Any]) -> ObjectInfo:
        return ObjectInfo(self._url(d["name"]), int(d.get("size") or 0), version_of(d))

    def is_dir(self, path: str) -> bool:
        return bool(self._call(path, self.fs.isdir, path))

    def files_under(self, folder: str) -> list[ObjectInfo]:
        root = self._key(folder)
        found = self._call(folder, self.fs.find, root, detail=True)
        infos = (
            self._info(d)
            for name, d in found.items()
            if d.get("type") == "file" and name.startswith(f"{root}/")  # not the folder itself
        )
        return sorted((i for i in infos if not is_temp(self.name(i.path))), key=lambda i: i.path)

    def glob(self, pattern: str) -> list[str]:
        found = self._call(pattern, self.fs.glob, pattern, detail=True)
        urls = (self._url(d["name"]) for d in found.values() if d.get("type") == "file")
        return sorted(u for u in urls if not is_temp(self.name(u)))

    def open_read(self, path: str) -> BinaryIO:
        if not hasattr(self.fs, "_open") or self.scheme == "memory":
            # memory:// hands out its one shared buffer; a copy keeps readers apart.
            return io.BytesIO(self._call(path, self.fs.cat_file, path))
        f = self._call(
            path, self.fs.open, path, "rb", block_size=READ_BLOCK, cache_type="readahead"
        )
        cache = getattr(f, "cache", None)
        if cache is not None and callable(getattr(cache, "fetcher", None)):
            # Each ranged GET of the stream is retried like any other request (the clients'
            # own retry loops are off, see for_scheme).
            fetch = cache.fetcher
            cache.fetcher = lambda start, end: self._call(path, fetch, start, end)
        return f

    # --- writing -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def write_stream(self, path: str) -> Iterator[BinaryIO]:
        if self.scheme == "memory":
            # memory:// makes a file visible as soon as it is opened: spool, then put whole.
            buf = io.BytesIO()
            yield buf
            self._call(path, self.fs.pipe_file, path, buf.getvalue())
            return
        f = self._call(path, self.fs.open, path, "wb", block_size=WRITE_BLOCK)
        if callable(getattr(f, "_call_s3", None)):
            # s3fs: each request of the upload (create, part, complete) retried on its own; a
            # part's body is bytes in hand, so a retry sends the same part again.
            f._call_s3 = self.policy.wrap(f._call_s3)
        try:
            yield f
        except BaseException:
            # fsspec's close (and __exit__) would commit what was written: abort the upload
            # instead (s3fs: AbortMultipartUpload; gcsfs: cancel the resumable session).
            with contextlib.suppress(Exception):
                f.discard()
            f.closed = True
            raise
        try:
            f.close()
        except Exception as e:
            with contextlib.suppress(Exception):
                f.discard()
            self._reraise(e, path)

    def write_bytes(self, path: str, data: bytes) -> None:
        self._call(path, self.fs.pipe_file, path, data)

    def create_bytes(self, path: str, data: bytes) -> bool:
        """A conditional PUT (S3 If-None-Match: *, GCS ifGenerationMatch=0). A create retried
        after a lost answer may find its own first try there: an object holding exactly `data`
        after such a retry counts as ours."""
        tries: list[Exception] = []

        def create() -> None:
            try:
                self.fs.pipe_file(path, data, mode="create")
            except Exception as e:
                tries.append(e)
                raise

        try:
            self._call(path, create)
        except Exception as e:
            if not is_precondition_failure(e):
                raise
            earlier_failed = len(tries) > 1
            return earlier_failed and self.read_bytes(path) == data
        return True

    def delete(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._call(path, self.fs.rm_file, path)

    def move_aside(self, path: str, new_name: str) -> str:
        # Object stores have no rename: a server-side copy, then the original's delete.
        target = self.join(self.parent(path), new_name)
        self._call(path, self.fs.copy, path, target)
        self.delete(path)
        return target

    # --- the job's folder ----------------------------------------------------------------------

    def lock(self, folder: str, lease_seconds: float) -> JobLock:
        from batchpage.storage.lease import Lease

        return Lease.take(self, folder, lease_seconds)

    def remove_leftovers(self, folder: str, patterns: tuple[str, ...]) -> list[str]:
        """Objects matching `patterns` in `folder` and its subfolders one level down, and on S3
        the unfinished multipart uploads under `folder` (invisible, but billed until aborted).
        GCS resumable upload sessions and Azure uncommitted blocks are never visible or listed
        as objects and their services drop them after a week: nothing to do for them here."""
        root = self._key(folder)
        removed = []
        for key in self._call(folder, self.fs.find, root, withdirs=False):
            parts = key[len(root) :].lstrip("/").split("/")
            if len(parts) <= 2 and any(fnmatch.fnmatch(parts[-1], p) for p in patterns):
                self.delete(self._url(key))
                removed.append(self._url(key))
        if self.client == "s3fs":
            removed += self._abort_uploads(folder)
        return removed

    def _abort_uploads(self, folder: str) -> list[str]:
        bucket, _, prefix = self._key(folder).lstrip("/").partition("/")
        prefix = f"{prefix}/" if prefix else ""
        aborted = []
        marker: dict[str, str] = {}
        while True:
            page = self._call(
                folder,
                self.fs.call_s3,
                "list_multipart_uploads",
                Bucket=bucket,
                Prefix=prefix,
                **marker,
            )
            for up in page.get("Uploads", []):
                self._call(
                    folder,
                    self.fs.call_s3,
                    "abort_multipart_upload",
                    Bucket=bucket,
                    Key=up["Key"],
                    UploadId=up["UploadId"],
                )
                aborted.append(self._url(f"{bucket}/{up['Key']}"))
            if not page.get("IsTruncated"):
                return aborted
            marker = {"KeyMarker": page["NextKeyMarker"]}
            if page.get("NextUploadIdMarker"):
                marker["UploadIdMarker"] = page["NextUploadIdMarker"]

    # --- identity ------------------------------------------------------------------------------

    def digest(self, path: str) -> list:
        info = self.info(path)
        return [self.name(path), info.size, info.version]


def version_of(d: dict[str, Any]) -> str:
    """An object's version from its listing or HEAD: GCS's generation, S3's ETag, else an etag
    or a modification time (Azure, memory://)."""
    for key in ("generation", "ETag", "etag", "last_modified", "LastModified", "mtime", "created"):
        value = d.get(key)
        if isinstance(value, datetime):  # a listing and a HEAD must give the same string
            value = value.timestamp()
        if value not in (None, ""):
            return str(value).strip('"')
    raise StorageError(f"{d.get('name')}: the store reports no version of this object")


def is_precondition_failure(e: BaseException) -> bool:
    """Whether a conditional write was refused because the object exists."""
    return (
        isinstance(e, FileExistsError)
        or status_of(e) == 412
        or error_code(e) in ("PreconditionFailed", "ConditionNotMet")
    )


def is_temp(name: str) -> bool:
    """The store's own temporary files (as LocalStore names them)."""
    return name.startswith(".") and name.endswith(".tmp")
