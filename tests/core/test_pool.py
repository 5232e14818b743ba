"""The block pool (DESIGN.md "Block pool")."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qualia.errors import PoolError, QualiaError

U32_MAX = 2**32 - 1


def test_construction(impl):
    pool = impl.BlockPool(5)
    assert pool.num_blocks == 5
    assert pool.free_count == 5
    assert [pool.refcount(p) for p in range(5)] == [0] * 5


@pytest.mark.parametrize(
    "value, exc",
    [(-1, OverflowError), (2**32, OverflowError), (2**64, OverflowError),
     (4.0, TypeError), ("4", TypeError), (None, TypeError), (True, TypeError)],
)
def test_construction_bad_size(impl, value, exc):
    with pytest.raises(exc):
        impl.BlockPool(value)


def test_allocation_ascending_then_exhausted(impl):
    pool = impl.BlockPool(4)
    assert [pool.allocate() for _ in range(4)] == [0, 1, 2, 3]
    assert [pool.refcount(p) for p in range(4)] == [1, 1, 1, 1]
    assert pool.free_count == 0
    before = impl.pool_state(pool)
    with pytest.raises(PoolError.Exhausted):
        pool.allocate()
    assert impl.pool_state(pool) == before


def test_released_page_reused_before_never_used(impl):
    pool = impl.BlockPool(6)
    assert [pool.allocate() for _ in range(4)] == [0, 1, 2, 3]
    pool.release(1)
    pool.release(3)
    assert pool.free_count == 4
    # last freed, first reused; then never-used pages ascending
    assert [pool.allocate() for _ in range(4)] == [3, 1, 4, 5]


def test_lifo_reuse_with_single_release(impl):
    pool = impl.BlockPool(3)
    assert pool.allocate() == 0
    pool.release(0)
    assert pool.allocate() == 0
    assert pool.allocate() == 1


def test_retain_release_counts(impl):
    pool = impl.BlockPool(2)
    page = pool.allocate()
    pool.retain(page)
    pool.retain(page)
    assert pool.refcount(page) == 3
    pool.release(page)
    assert pool.refcount(page) == 2
    assert pool.free_count == 1
    pool.release(page)
    pool.release(page)
    assert pool.refcount(page) == 0
    assert pool.free_count == 2
    assert pool.allocate() == page


@pytest.mark.parametrize("page", [4, 5, 1000, U32_MAX])
@pytest.mark.parametrize("op", ["retain", "release", "refcount"])
def test_invalid_page(impl, op, page):
    pool = impl.BlockPool(4)
    pool.allocate()
    before = impl.pool_state(pool)
    with pytest.raises(PoolError.InvalidPage):
        getattr(pool, op)(page)
    assert impl.pool_state(pool) == before


def test_retain_not_allocated(impl):
    pool = impl.BlockPool(4)
    a = pool.allocate()
    pool.release(a)
    before = impl.pool_state(pool)
    with pytest.raises(PoolError.NotAllocated):
        pool.retain(a)  # released page
    with pytest.raises(PoolError.NotAllocated):
        pool.retain(3)  # never used
    assert impl.pool_state(pool) == before
    assert pool.allocate() == a


def test_release_not_allocated_keeps_free_stack(impl):
    pool = impl.BlockPool(4)
    a, b = pool.allocate(), pool.allocate()
    pool.release(a)
    before = impl.pool_state(pool)
    with pytest.raises(PoolError.NotAllocated):
        pool.release(a)  # double release must not push the page twice
    with pytest.raises(PoolError.NotAllocated):
        pool.release(3)
    assert impl.pool_state(pool) == before
    assert [pool.allocate() for _ in range(3)] == [a, 2, 3]
    with pytest.raises(PoolError.Exhausted):
        pool.allocate()
    assert b == 1


def test_retain_overflow(impl):
    pool = impl.BlockPool(2)
    page = pool.allocate()
    impl.set_refcount(pool, page, U32_MAX - 1)
    pool.retain(page)
    assert pool.refcount(page) == U32_MAX
    before = impl.pool_state(pool)
    with pytest.raises(PoolError.Overflow):
        pool.retain(page)
    assert impl.pool_state(pool) == before
    pool.release(page)
    assert pool.refcount(page) == U32_MAX - 1


def test_pool_errors_are_qualia_errors(impl):
    pool = impl.BlockPool(1)
    pool.allocate()
    with pytest.raises(QualiaError) as info:
        pool.allocate()
    assert info.value.name == "PoolError.Exhausted"
    assert info.value.chain == ("PoolError.Exhausted",)
    assert isinstance(info.value, PoolError)


@pytest.mark.parametrize("op", ["retain", "release", "refcount"])
def test_bad_page_argument(impl, op, bad_u32):
    value, exc = bad_u32
    pool = impl.BlockPool(4)
    pool.allocate()
    before = impl.pool_state(pool)
    with pytest.raises(exc):
        getattr(pool, op)(value)
    assert impl.pool_state(pool) == before


@pytest.mark.parametrize("page", [np.uint32(0), np.int64(0), np.uint8(0)])
def test_numpy_integers_accepted(impl, page):
    pool = impl.BlockPool(2)
    pool.allocate()
    pool.retain(page)
    assert pool.refcount(page) == 2
    pool.release(page)
    assert pool.refcount(0) == 1


def test_numpy_bool_rejected(impl):
    pool = impl.BlockPool(2)
    pool.allocate()
    with pytest.raises(TypeError):
        pool.retain(np.bool_(False))


# -- model-based property: a random operation sequence against an independent model -----------

ops = st.lists(
    st.tuples(st.sampled_from(["allocate", "retain", "release"]), st.integers(0, 7)),
    max_size=60,
)


@settings(max_examples=600, deadline=None)
@given(ops)
def test_pool_matches_model(impl, sequence):
    n = 6
    pool = impl.BlockPool(n)
    counts = [0] * n
    free = list(range(n - 1, -1, -1))
    for op, page in sequence:
        if op == "allocate":
            if free:
                expect = free.pop()
                counts[expect] = 1
                assert pool.allocate() == expect
            else:
                with pytest.raises(PoolError.Exhausted):
                    pool.allocate()
        elif page >= n:
            with pytest.raises(PoolError.InvalidPage):
                getattr(pool, op)(page)
        elif counts[page] == 0:
            with pytest.raises(PoolError.NotAllocated):
                getattr(pool, op)(page)
        elif op == "retain":
            pool.retain(page)
            counts[page] += 1
        else:
            pool.release(page)
            counts[page] -= 1
            if counts[page] == 0:
                free.append(page)
        assert [pool.refcount(p) for p in range(n)] == counts
        assert pool.free_count == len(free) == sum(1 for c in counts if c == 0)
