"""The LoRA adapters a job's rows name (dataset.lora_column): a name of `model.loras`, or an
adapter folder.

Named adapters get lora_int_ids 1..N in name order; a folder named by a row gets the next id
when first seen, so every row of one adapter shares its id (its slot and its cached prefixes).
Named adapters' files are part of the job's fingerprint: a changed adapter is another job.
They are read and checked before the model loads (all but their fit to the base model, which
the engine checks when it reads them): a named adapter that cannot run is the job's error (exit
2), one that a row names by its folder is that row's error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from batchpage.fileio import file_digest
from batchpage.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, AdapterError, read_adapter
from batchpage.lora.request import LoRARequest


class JobAdapters:
    def __init__(self, named: dict[str, str], max_rank: int) -> None:
        """`named`: model.loras, name -> adapter folder; `max_rank`: the engine's max_lora_rank.
        ValueError (one line, the fix) for a folder without PEFT's two files, or an adapter
        read_adapter refuses (the base model's shapes are checked when the engine reads it)."""
        for name, path in sorted(named.items()):
            if not isinstance(path, str):  # a nested dict gets past Hydra's merge of a dict
                raise ValueError(f"model.loras.{name} must be an adapter folder, got {path!r}")
            folder = Path(path)
            missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if not (folder / f).is_file()]
            if missing:
                raise ValueError(
                    f"model.loras.{name}={path}: {' and '.join(missing)} not found there; give "
                    "the folder PEFT's save_pretrained wrote"
                )
            try:
                read_adapter(LoRARequest(name, 1, path), None, max_rank=max_rank)
            except AdapterError as exc:
                raise ValueError(f"model.loras.{name}: {exc}") from None
        self._by_name = {
            name: LoRARequest(name, i + 1, str(path))
            for i, (name, path) in enumerate(sorted(named.items()))
        }
        self._by_path: dict[str, LoRARequest] = {}

    def resolve(self, value: str) -> LoRARequest | str:
        """The adapter a row's lora value names, or the row's error."""
        named = self._by_name.get(value)
        if named is not None:
            return named
        known = self._by_path.get(value)
        if known is not None:
            return known
        if (Path(value) / CONFIG_FILE).is_file():
            request = LoRARequest(value, len(self._by_name) + len(self._by_path) + 1, value)
            self._by_path[value] = request
            return request
        names = ", ".join(self._by_name) or "none"
        return (
            f"lora {value!r} is neither a name of model.loras ({names}) nor a folder holding "
            f"{CONFIG_FILE}"
        )

    def fingerprint(self) -> dict[str, Any]:
        """Each named adapter's files' digests, by name."""
        return {
            name: {f: file_digest(Path(r.lora_path) / f) for f in (CONFIG_FILE, WEIGHTS_FILE)}
            for name, r in self._by_name.items()
        }
