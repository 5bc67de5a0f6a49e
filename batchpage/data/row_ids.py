"""Row ids key the output rows: one pass over an id column finds duplicates and nulls."""

from __future__ import annotations

from typing import Any

from batchpage.data.readers import DatasetError

_SHOWN = 5  # duplicates and nulls named in the message


class IdTally:
    """The values of one id column, taken in row order up to `limit` rows: every id seen (to
    find duplicates), the first few duplicates and null rows, and how many nulls."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.seen: dict[str, int] = {}
        self.duplicates: list[str] = []
        self.nulls: list[int] = []
        self.null_count = 0

    def add(self, index: int, value: Any) -> None:
        """Row `index`'s id (None: the row has none)."""
        if self.limit is not None and index >= self.limit:
            return
        if value is None:
            self.null_count += 1
            if len(self.nulls) < _SHOWN:
                self.nulls.append(index)
            return
        key = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
        first = self.seen.setdefault(key, index)
        if first != index and len(self.duplicates) < _SHOWN:
            self.duplicates.append(f"{key!r} (rows {first} and {index})")

    def check(self, what: str, fix: str, nulls_allowed: bool = False) -> None:
        """Raise DatasetError naming the first duplicates, else the first null rows (unless
        `nulls_allowed`)."""
        if self.duplicates:
            raise DatasetError(
                f"{what} has duplicate ids: {', '.join(self.duplicates)}; ids must be unique "
                f"({fix})"
            )
        if self.null_count and not nulls_allowed:
            more = ", ..." if self.null_count > len(self.nulls) else ""
            shown = ", ".join(map(str, self.nulls)) + more
            raise DatasetError(f"{what} is null at rows {shown}; fill those ids ({fix})")
