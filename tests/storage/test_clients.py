"""Choosing the client from the URL: a scheme whose client package is missing is a StorageError
naming the `cloud` extra; memory:// (fsspec's own) needs nothing."""

from __future__ import annotations

import sys

import pytest

from batchpage.storage import CLIENTS, StorageConfig, StorageError, Stores
from batchpage.storage.objects import CLIENT_OF, ObjectStore


@pytest.mark.parametrize("scheme", ["s3", "gs", "az"])
def test_a_missing_client_names_the_extra(scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    package = CLIENTS[scheme]
    monkeypatch.setitem(sys.modules, package, None)  # `import <package>` now fails
    with pytest.raises(StorageError) as e:
        Stores().store_for(f"{scheme}://bucket/prompts.jsonl")
    assert str(e.value) == (
        f"reading/writing {scheme}:// paths needs {package}: pip install 'batchpage[cloud]'"
    )


def test_the_client_table_is_the_packages_one() -> None:
    assert CLIENT_OF == CLIENTS


def test_an_unknown_scheme_is_a_storage_error() -> None:
    with pytest.raises(StorageError, match="no filesystem for nosuch://"):
        Stores().store_for("nosuch://bucket/x")


def test_memory_needs_no_extra() -> None:
    store = Stores().store_for("memory://bp-clients/x")
    assert isinstance(store, ObjectStore) and store.scheme == "memory"
    store.write_bytes("memory://bp-clients/x/a", b"1")
    assert store.glob("memory://bp-clients/x/*") == ["memory://bp-clients/x/a"]
    store.delete("memory://bp-clients/x/a")


def test_storage_options_reach_the_filesystem() -> None:
    from tests.extras import require

    require("s3fs", "cloud")
    config = StorageConfig(s3={"endpoint_url": "http://127.0.0.1:1", "default_block_size": 7 << 20})
    store = ObjectStore.for_scheme("s3", config)
    assert store.fs.endpoint_url == "http://127.0.0.1:1"
    assert store.fs.default_block_size == 7 << 20


def test_a_client_without_credentials_names_where_they_come_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tests.extras import require

    require("adlfs", "cloud")
    for name in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(StorageError) as e:
        Stores().store_for("az://container/prompts.jsonl")
    assert "az:// client could not start" in str(e.value)
    assert "AZURE_STORAGE_CONNECTION_STRING" in str(e.value)
