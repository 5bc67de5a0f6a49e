"""BlockPool against a brute-force model of reference counts, under random operations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpage.cache.block_pool import BlockPool, OutOfBlocks

ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "share", "release", "cow"]), st.integers(0, 10**6)),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 12), ops=ops)
def test_pool_matches_brute_force(num_blocks: int, ops: list[tuple[str, int]]) -> None:
    pool = BlockPool(num_blocks)
    model: dict[int, int] = {}  # block -> holders, for held blocks only
    holdings: list[int] = []  # one entry per reference the test holds
    for op, r in ops:
        if op == "alloc":
            n = r % 4
            if n > num_blocks - len(model):
                with pytest.raises(OutOfBlocks):
                    pool.allocate(n)
            else:
                got = pool.allocate(n)
                assert len(set(got)) == n and not set(got) & set(model)
                for b in got:
                    model[b] = 1
                    holdings.append(b)
        elif op == "share" and holdings:
            b = holdings[r % len(holdings)]
            pool.share([b])
            model[b] += 1
            holdings.append(b)
        elif op == "release" and holdings:
            b = holdings.pop(r % len(holdings))
            freed = pool.release([b])
            model[b] -= 1
            assert freed == ([b] if model[b] == 0 else [])
            if model[b] == 0:
                del model[b]
        elif op == "cow" and holdings:
            i = r % len(holdings)
            b = holdings[i]
            if model[b] > 1 and len(model) == num_blocks:
                with pytest.raises(OutOfBlocks):
                    pool.cow(b)
            else:
                res = pool.cow(b)
                if model[b] == 1:
                    assert res.block == b and res.copy_from is None
                else:
                    assert res.copy_from == b and res.block not in model
                    model[b] -= 1
                    model[res.block] = 1
                    holdings[i] = res.block
        pool.check_integrity()
        assert pool.num_free == num_blocks - len(model)
        assert all(pool.refcount(b) == c for b, c in model.items())
    pool.release(holdings)
    pool.check_integrity()
    assert pool.num_free == num_blocks


def test_misuse_is_refused() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)
    with pytest.raises(ValueError, match="free and cannot be shared"):
        pool.share([0])
    with pytest.raises(ValueError, match="released more often"):
        pool.release([1])
