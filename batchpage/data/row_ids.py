"""Row ids key the output rows: one pass over an id column finds duplicates and nulls.

The pass holds every id until it is checked, so it holds them compactly: each id's UTF-8 bytes
end to end in one buffer, with its hash, row and end offset as 8-byte words (where a dict holds
a str object, an int object and a hash-table entry an id). Duplicates are found by sorting the
hashes; ids whose hashes agree are then compared byte for byte, so a hash collision is never
taken for a duplicate.
"""

from __future__ import annotations

from array import array
from itertools import pairwise
from typing import Any

import numpy as np

from batchpage.data.readers import DatasetError

_SHOWN = 5  # duplicates and nulls named in the message


class IdTally:
    """The values of one id column, taken in row order up to `limit` rows: every id seen (to
    find duplicates), the first few null rows, and how many nulls. A value's id is its text
    (str(value); bytes decoded as UTF-8), so 7 and "7" are the same id."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.nulls: list[int] = []
        self.null_count = 0
        self._hashes = array("q")  # hash of each id, in the order added
        self._rows = array("q")  # its row
        self._ends = array("q")  # where its bytes end in _text
        self._text = bytearray()

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
        self._hashes.append(hash(key))
        self._rows.append(index)
        # surrogatepass: a JSON "\ud800" is a str that strict UTF-8 refuses; it stays distinct.
        self._text += key.encode("utf-8", "surrogatepass")
        self._ends.append(len(self._text))

    @property
    def duplicates(self) -> list[str]:
        """The first few ids seen again, in the order their repeats were added, each with the
        row of its first copy and the repeat's row."""
        repeats = self._repeats()
        return [f"{key!r} (rows {first} and {row})" for _, key, first, row in repeats[:_SHOWN]]

    def check(self, what: str, fix: str, nulls_allowed: bool = False) -> None:
        """Raise DatasetError naming the first duplicates, else the first null rows (unless
        `nulls_allowed`)."""
        duplicates = self.duplicates
        if duplicates:
            raise DatasetError(
                f"{what} has duplicate ids: {', '.join(duplicates)}; ids must be unique ({fix})"
            )
        if self.null_count and not nulls_allowed:
            more = ", ..." if self.null_count > len(self.nulls) else ""
            shown = ", ".join(map(str, self.nulls)) + more
            raise DatasetError(f"{what} is null at rows {shown}; fill those ids ({fix})")

    def check_integrity(self) -> None:
        assert len(self._hashes) == len(self._rows) == len(self._ends), "parallel arrays"
        assert (self._ends[-1] if self._ends else 0) == len(self._text), "text length"
        assert all(a <= b for a, b in pairwise(self._ends)), "ends in order"
        assert len(self.nulls) == min(self.null_count, _SHOWN), "nulls shown"

    def _repeats(self) -> list[tuple[int, str, int, int]]:
        """Every id added again: (the repeat's position among the ids added, the id, its first
        copy's row, the repeat's row), by position. Only ids whose hashes collide are read
        back and compared."""
        hashes = np.frombuffer(self._hashes, dtype=np.int64)
        if len(hashes) < 2:
            return []
        order = np.argsort(hashes, kind="stable")  # equal hashes keep the order added
        ordered = hashes[order]
        same = ordered[1:] == ordered[:-1]
        if not same.any():
            return []
        # Each run of equal hashes: the positions (in order added) of its ids.
        starts = np.flatnonzero(np.concatenate(([True], ~same)))
        bounds = np.append(starts, len(ordered))
        found: list[tuple[int, str, int, int]] = []
        for lo, hi in pairwise(bounds.tolist()):
            if hi - lo < 2:
                continue
            first: dict[bytes, int] = {}  # an id's bytes -> position of its first copy
            for position in order[lo:hi].tolist():
                text = self._bytes(position)
                earlier = self._rows[first.setdefault(text, position)]
                if earlier != self._rows[position]:  # one row told twice is no duplicate
                    key = text.decode("utf-8", "surrogatepass")
                    found.append((position, key, earlier, self._rows[position]))
        found.sort()
        return found

    def _bytes(self, position: int) -> bytes:
        start = self._ends[position - 1] if position else 0
        return bytes(self._text[start : self._ends[position]])
