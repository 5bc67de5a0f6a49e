"""Starts gcp-storage-emulator with two behaviours of GCS that it lacks.

    python -m tests.gcs_emulator_launcher --host 127.0.0.1 --port PORT

- GCS answers an upload with `ifGenerationMatch=0` for a name that already exists with 412
  Precondition Failed (https://cloud.google.com/storage/docs/request-preconditions); the
  emulator ignores the parameter and overwrites. The object-insert and resumable-upload
  handlers are wrapped to answer 412 as GCS does.
- GCS cancels a resumable upload on a DELETE of its session URI and answers 499
  (https://cloud.google.com/storage/docs/performing-resumable-uploads#cancel-upload); the
  emulator answers 501, which gcsfs retries for half a minute. A DELETE handler is added.

Both fill gaps of the test server, not of our client: gcsfs sends these requests, and a real
bucket honours them.
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, NamedTuple

from gcp_storage_emulator import server as emulator
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

Handler = Callable[..., Any]


def _object_name(request: Any, storage: Any) -> str | None:
    """The name an upload request writes: from the query, a multipart upload's metadata, or
    the resumable session it continues."""
    if "upload_id" in request.query:
        return storage.get_resumable_file_obj(request.query["upload_id"][0])["name"]
    if "name" in request.query:
        return request.query["name"][0]
    data = request.data
    if isinstance(data, dict):
        meta = data.get("meta") if isinstance(data.get("meta"), dict) else data
        return meta.get("name")
    return None


def create_only(handler: Handler, lock: threading.Lock) -> Handler:
    """`handler`, answering 412 when ifGenerationMatch=0 names an object that exists; the check
    and the write hold one lock, so of racing creates exactly one succeeds."""

    def wrapped(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
        if request.query.get("ifGenerationMatch") != ["0"]:
            return handler(request, response, storage, *args, **kwargs)
        with lock:
            try:
                name = _object_name(request, storage)
                if name is not None:
                    storage.get_file_obj(request.params["bucket_name"], name)
                    response.status = HTTPStatus.PRECONDITION_FAILED
                    response.json(
                        {
                            "error": {
                                "code": 412,
                                "message": "At least one of the pre-conditions you "
                                "specified did not hold.",
                            }
                        }
                    )
                    return None
            except NotFound:
                pass
            return handler(request, response, storage, *args, **kwargs)

    return wrapped


class _Status(NamedTuple):
    """A status http.HTTPStatus lacks (the emulator's response writes .value and .phrase)."""

    value: int
    phrase: str


CANCELLED = _Status(499, "Client Closed Request")


def cancel_upload(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> None:
    """DELETE of a resumable session URI: the session and its bytes are gone; 499 as GCS."""
    upload_id = request.query.get("upload_id", [None])[0]
    try:
        storage.delete_resumable_file_obj(upload_id)
    except NotFound:
        response.status = HTTPStatus.NOT_FOUND
        return
    response.status = CANCELLED


def install() -> None:
    """Wrap the emulator's upload handlers in its routing table (and the module attribute its
    router falls back to for uploads posted without the /upload prefix)."""
    lock = threading.Lock()
    wrapped = {
        objects.insert: create_only(objects.insert, lock),
        objects.upload_partial: create_only(objects.upload_partial, lock),
    }
    for _, handlers in emulator.HANDLERS:
        for method, handler in list(handlers.items()):
            if handler in wrapped:
                handlers[method] = wrapped[handler]
        if handlers.get(emulator.PUT) is wrapped[objects.upload_partial]:
            handlers[emulator.DELETE] = cancel_upload
    objects.insert = wrapped[objects.insert]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    install()
    emulator.create_server(args.host, args.port, in_memory=True).run()


if __name__ == "__main__":
    main()
