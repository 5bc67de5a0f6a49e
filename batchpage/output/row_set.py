"""The rows a job has done, as a bitmap: a bit per row index where a set of ints holds an int
object and a hash-table slot for each."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np


class RowSet:
    """A set of non-negative ints (row indices) as a bitmap that grows to the largest one.

    Row indices are dense (0 .. rows - 1), so the bitmap takes about rows / 8 bytes whatever
    order the rows come in. Adding and testing one index is a few byte operations; `update`
    takes an array of them at once (a shard's index column)."""

    __slots__ = ("_bits", "_count")

    def __init__(self, indices: Iterable[int] | np.ndarray = ()) -> None:
        self._bits = bytearray()
        self._count = 0
        self.update(indices)

    def add(self, index: int) -> bool:
        """Add `index` (>= 0); False when it was in already."""
        if index < 0:
            raise ValueError(f"a row index is >= 0, got {index}")
        byte, bit = index >> 3, 1 << (index & 7)
        if byte >= len(self._bits):
            self._grow(byte)
        if self._bits[byte] & bit:
            return False
        self._bits[byte] |= bit
        self._count += 1
        return True

    def update(self, indices: Iterable[int] | np.ndarray) -> None:
        """Add every index of `indices` (repeats allowed)."""
        found = np.asarray(indices if isinstance(indices, np.ndarray) else list(indices))
        if not found.size:
            return
        if not np.issubdtype(found.dtype, np.integer) or found.min() < 0:
            raise ValueError("row indices are ints >= 0")
        found = np.unique(found.astype(np.int64, copy=False))
        self._grow(int(found[-1]) >> 3)
        view = np.frombuffer(self._bits, dtype=np.uint8)
        where, masks = found >> 3, np.left_shift(1, found & 7).astype(np.uint8)
        self._count += int(np.count_nonzero((view[where] & masks) == 0))
        np.bitwise_or.at(view, where, masks)
        del view  # the bitmap can grow again once no array looks at it

    def __contains__(self, index: object) -> bool:
        if not isinstance(index, (int, np.integer)) or index < 0:
            return False
        byte = int(index) >> 3
        return byte < len(self._bits) and bool(self._bits[byte] >> (int(index) & 7) & 1)

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[int]:
        """The indices in increasing order."""
        bits = np.unpackbits(np.frombuffer(self._bits, dtype=np.uint8), bitorder="little")
        return iter(np.flatnonzero(bits).tolist())

    def check_integrity(self) -> None:
        assert self._count == int.from_bytes(self._bits, "little").bit_count(), "count"

    def _grow(self, byte: int) -> None:
        """Room for byte `byte`, doubling, so that rows added one by one copy the bitmap a
        logarithmic number of times."""
        if byte >= len(self._bits):
            self._bits.extend(bytes(max(byte + 1, 2 * len(self._bits)) - len(self._bits)))
