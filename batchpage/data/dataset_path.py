"""Where dataset.path points: a bundled name, or a file, folder or glob on local disk or at a URL
(s3://bucket/prefix/, gs://bucket/data/*.parquet), resolved through the job's `Store`.

Local paths keep the spelling pathlib gives them ("./a//b" is "a/b"): it is each file's key in
a job's fingerprint, which earlier jobs' output_dirs were filed under.
"""

from __future__ import annotations

import os
from pathlib import Path

import batchpage.data.presets as presets
from batchpage.data.input_files import (
    DatasetError,
    glob_files,
    is_local,
    sort_paths,
    storage_error,
)
from batchpage.storage import Store, Stores


def input_root(path: str, stores: Stores | None = None) -> tuple[str, bool] | None:
    """Where dataset.path reads from: (the file, False), or (the folder or prefix it reads, or a
    glob's part before its first wildcard, True); a local one resolved (absolute, links
    followed); a URL as written, a prefix unless an object is there. None for a bundled name or
    a local path that does not exist (validate says what is wrong with it)."""
    if not path or presets.is_preset(path):
        return None
    try:
        store = (stores or Stores()).store_for(path)
        local = is_local(store)
        expanded = os.path.expanduser(path) if local else path
        if _is_glob(expanded):
            where, is_folder = _glob_base(expanded) or ".", True
        elif not local:
            # One HEAD: an object is a file, anything else a prefix (a listing costs more, and
            # a prefix that holds nothing is validate's to report).
            where, is_folder = expanded, not store.exists(expanded)
        elif store.is_dir(expanded) or store.exists(expanded):
            where, is_folder = expanded, store.is_dir(expanded)
        else:
            return None
    except OSError:
        return None
    return (str(Path(where).resolve()) if local else where.rstrip("/")), is_folder


def _is_glob(path: str) -> bool:
    return any(ch in path for ch in "*?[")


def _glob_base(pattern: str) -> str:
    """A glob's part before its first wildcard ("" when it starts with one)."""
    parts = pattern.split("/")
    return "/".join(parts[: next(i for i, part in enumerate(parts) if _is_glob(part))])


def resolve_path(
    path: str, stores: Stores
) -> tuple[list[str], presets.ResolvedPreset | None, Store]:
    """The paths dataset.path names (a glob's files, or the one file or folder), the preset it
    names if any, and the store that holds them."""
    if not path:
        raise DatasetError(
            f"dataset.path is empty; give a file, folder, glob or one of "
            f"the bundled datasets: {presets.describe_presets()}"
        )
    # A bundled name wins over a same-named local folder; write ./name for the folder.
    if presets.is_preset(path):
        try:
            res = presets.resolve_preset(path)
        except (RuntimeError, OSError) as e:  # its source package is missing, or no cache dir
            raise DatasetError(f"bundled dataset {path!r} is unavailable: {e}") from e
        return [str(res.path)], res, stores.store_for(str(res.path))
    store = stores.store_for(path)
    local = is_local(store)
    expanded = os.path.expanduser(path) if local else path
    # pathlib's spelling of local paths (see the module docstring).
    spelled = (lambda p: str(Path(p))) if local else (lambda p: p)
    if _is_glob(expanded):
        files = sort_paths([spelled(f) for f in glob_files(store, expanded)])
        if files:
            return files, None, store
        if local:
            raise DatasetError(f"dataset.path={path!r} matches no files (cwd: {os.getcwd()})")
        store.exists(_glob_base(expanded))  # a missing bucket: StorageError, naming it
        raise DatasetError(
            f"dataset.path={path!r} matches no objects; check the pattern (** crosses folders) "
            "and the prefix before it"
        )
    if store.is_dir(expanded) or store.exists(expanded):
        return [spelled(expanded)], None, store
    if local and os.path.exists(expanded):  # there, yet neither a folder nor a file
        # /dev/zero, a FIFO or a socket: reading (or digesting) it may never end.
        raise DatasetError(
            f"dataset.path={path!r} is not a regular file (a device, FIFO or socket); "
            "point it at a data file, a folder or a glob"
        )
    if not local:
        raise storage_error(path, FileNotFoundError(path))
    hint = ""
    if os.sep not in path and "." not in path:
        hint = f"; bundled datasets are: {presets.describe_presets()}"
    raise DatasetError(
        f"dataset.path={path!r}: no such file or folder ({Path(expanded).absolute()}) and not a "
        f"bundled dataset{hint}"
    )
