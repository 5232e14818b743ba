"""The sequence block table and copy-on-write (DESIGN.md "Sequence block table and
copy-on-write")."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qualia.errors import TableError

U32_MAX = 2**32 - 1


def state(impl, pool, *tables):
    return (impl.pool_state(pool),) + tuple(impl.table_state(t) for t in tables)


def test_construction(impl):
    t = impl.SequenceBlockTable(3)
    assert t.capacity == 3
    assert len(t) == 0
    assert t.entries() == []
    assert impl.SequenceBlockTable(0).capacity == 0


@pytest.mark.parametrize(
    "value, exc",
    [(-1, OverflowError), (2**32, OverflowError), (3.0, TypeError), (None, TypeError),
     (True, TypeError), ("3", TypeError)],
)
def test_construction_bad_capacity(impl, value, exc):
    with pytest.raises(exc):
        impl.SequenceBlockTable(value)


# -- ensure_writable, in the order of DESIGN.md ------------------------------------------------


def test_allocated_appends(impl):
    pool, t = impl.BlockPool(4), impl.SequenceBlockTable(3)
    cow = t.ensure_writable(0, pool)
    assert (cow.kind, cow.page, cow.src) == ("allocated", 0, None)
    cow = t.ensure_writable(1, pool)
    assert (cow.kind, cow.page, cow.src) == ("allocated", 1, None)
    assert t.entries() == [0, 1] and len(t) == 2
    assert pool.refcount(0) == pool.refcount(1) == 1


def test_exclusive_writes_in_place(impl):
    pool, t = impl.BlockPool(4), impl.SequenceBlockTable(3)
    t.ensure_writable(0, pool)
    before = state(impl, pool, t)
    cow = t.ensure_writable(0, pool)
    assert (cow.kind, cow.page, cow.src) == ("exclusive", 0, None)
    assert state(impl, pool, t) == before


def test_out_of_range_before_gap(impl):
    pool, t = impl.BlockPool(4), impl.SequenceBlockTable(2)
    before = state(impl, pool, t)
    with pytest.raises(TableError.OutOfRange):
        t.ensure_writable(5, pool)  # also past len: OutOfRange wins
    with pytest.raises(TableError.OutOfRange):
        t.ensure_writable(2, pool)
    with pytest.raises(TableError.OutOfRange):
        t.ensure_writable(U32_MAX, pool)
    assert state(impl, pool, t) == before


def test_out_of_range_at_capacity_when_full(impl):
    pool, t = impl.BlockPool(4), impl.SequenceBlockTable(2)
    t.ensure_writable(0, pool)
    t.ensure_writable(1, pool)
    before = state(impl, pool, t)
    with pytest.raises(TableError.OutOfRange):
        t.ensure_writable(2, pool)  # == len, but at capacity: no allocation
    assert state(impl, pool, t) == before


def test_zero_capacity_table(impl):
    pool, t = impl.BlockPool(2), impl.SequenceBlockTable(0)
    with pytest.raises(TableError.OutOfRange):
        t.ensure_writable(0, pool)
    assert pool.free_count == 2


def test_gap(impl):
    pool, t = impl.BlockPool(4), impl.SequenceBlockTable(4)
    t.ensure_writable(0, pool)
    before = state(impl, pool, t)
    with pytest.raises(TableError.Gap):
        t.ensure_writable(2, pool)
    assert state(impl, pool, t) == before


def test_allocate_exhausted(impl):
    pool, t = impl.BlockPool(1), impl.SequenceBlockTable(4)
    t.ensure_writable(0, pool)
    before = state(impl, pool, t)
    with pytest.raises(TableError.Exhausted):
        t.ensure_writable(1, pool)
    assert state(impl, pool, t) == before


def test_not_allocated_behind_the_tables_back(impl):
    pool, t = impl.BlockPool(4), impl.SequenceBlockTable(4)
    t.ensure_writable(0, pool)
    pool.release(0)  # someone released the table's page
    before = state(impl, pool, t)
    with pytest.raises(TableError.NotAllocated):
        t.ensure_writable(0, pool)
    assert state(impl, pool, t) == before


def test_invalid_mapped_page_flattened(impl):
    big, small = impl.BlockPool(8), impl.BlockPool(2)
    pages = [big.allocate() for _ in range(6)]
    t = impl.SequenceBlockTable(2)
    t.attach([pages[5]], big)
    before = state(impl, small, t)
    with pytest.raises(TableError.InvalidPage):
        t.ensure_writable(0, small)  # page 5 is past the small pool's end
    assert state(impl, small, t) == before


def test_copy_on_shared_page(impl):
    pool, t = impl.BlockPool(4), impl.SequenceBlockTable(4)
    t.ensure_writable(0, pool)
    pool.retain(0)  # another holder
    cow = t.ensure_writable(0, pool)
    assert (cow.kind, cow.src, cow.page) == ("copy", 0, 1)
    assert t.entries() == [1]
    assert pool.refcount(0) == 1  # the other holder's reference stays
    assert pool.refcount(1) == 1
    assert pool.free_count == 2
    cow = t.ensure_writable(0, pool)  # now ours alone
    assert (cow.kind, cow.page) == ("exclusive", 1)


def test_copy_of_middle_page_with_three_holders(impl):
    pool, t = impl.BlockPool(6), impl.SequenceBlockTable(4)
    for lp in range(3):
        t.ensure_writable(lp, pool)
    pool.retain(1)
    pool.retain(1)
    cow = t.ensure_writable(1, pool)
    assert (cow.kind, cow.src, cow.page) == ("copy", 1, 3)
    assert t.entries() == [0, 3, 2]
    assert pool.refcount(1) == 2


def test_copy_exhausted_leaves_everything(impl):
    pool, t = impl.BlockPool(1), impl.SequenceBlockTable(2)
    t.ensure_writable(0, pool)
    pool.retain(0)
    before = state(impl, pool, t)
    with pytest.raises(TableError.Exhausted):
        t.ensure_writable(0, pool)
    assert state(impl, pool, t) == before
    assert pool.refcount(0) == 2


# -- attach ---------------------------------------------------------------------------------------


def test_attach_retains_each_occurrence(impl):
    pool, t = impl.BlockPool(4), impl.SequenceBlockTable(4)
    a, b = pool.allocate(), pool.allocate()
    t.attach([a, b, a], pool)
    assert t.entries() == [a, b, a]
    assert pool.refcount(a) == 3 and pool.refcount(b) == 2


@pytest.mark.parametrize("kind", [list, tuple, np.array, iter])
def test_attach_accepts_iterables(impl, kind):
    pool, t = impl.BlockPool(4), impl.SequenceBlockTable(4)
    a, b = pool.allocate(), pool.allocate()
    t.attach(kind([a, b]), pool)
    assert t.entries() == [a, b]


def test_attach_empty_is_noop(impl):
    pool, t = impl.BlockPool(2), impl.SequenceBlockTable(2)
    t.attach([], pool)
    assert len(t) == 0 and pool.free_count == 2


def test_attach_not_empty(impl):
    pool, t = impl.BlockPool(4), impl.SequenceBlockTable(2)
    t.ensure_writable(0, pool)
    a = pool.allocate()
    before = state(impl, pool, t)
    with pytest.raises(TableError.NotEmpty):
        t.attach([a], pool)
    with pytest.raises(TableError.NotEmpty):
        t.attach([a, a, a], pool)  # NotEmpty before OutOfRange
    with pytest.raises(TableError.NotEmpty):
        t.attach([], pool)
    assert state(impl, pool, t) == before


def test_attach_out_of_range(impl):
    pool, t = impl.BlockPool(4), impl.SequenceBlockTable(2)
    a = pool.allocate()
    before = state(impl, pool, t)
    with pytest.raises(TableError.OutOfRange):
        t.attach([a, a, a], pool)
    with pytest.raises(TableError.OutOfRange):
        t.attach([a, a, 99], pool)  # OutOfRange before the pool's InvalidPage
    assert state(impl, pool, t) == before


@pytest.mark.parametrize("bad, exc", [(3, TableError.NotAllocated), (9, TableError.InvalidPage)])
def test_attach_bad_page_in_the_middle_retains_nothing(impl, bad, exc):
    pool, t = impl.BlockPool(4), impl.SequenceBlockTable(4)
    a, b = pool.allocate(), pool.allocate()
    before = state(impl, pool, t)
    with pytest.raises(exc):
        t.attach([a, bad, b], pool)
    assert state(impl, pool, t) == before


def test_attach_overflow_atomic(impl):
    pool, t = impl.BlockPool(4), impl.SequenceBlockTable(4)
    a, b = pool.allocate(), pool.allocate()
    impl.set_refcount(pool, b, U32_MAX - 1)
    before = state(impl, pool, t)
    with pytest.raises(TableError.Overflow):
        t.attach([a, b, b], pool)  # the second retain of b would overflow
    assert state(impl, pool, t) == before
    t.attach([a, b], pool)
    assert pool.refcount(b) == U32_MAX


# -- release_all ----------------------------------------------------------------------------------


def test_release_all_in_order(impl):
    pool, t = impl.BlockPool(4), impl.SequenceBlockTable(4)
    for lp in range(3):
        t.ensure_writable(lp, pool)
    t.release_all(pool)
    assert len(t) == 0 and t.entries() == []
    assert pool.free_count == 4
    # released 0, 1, 2 in that order: 2 is on top of the free stack
    assert [pool.allocate() for _ in range(4)] == [2, 1, 0, 3]


def test_release_all_keeps_shared_pages(impl):
    pool, t = impl.BlockPool(4), impl.SequenceBlockTable(4)
    a = pool.allocate()
    t.attach([a, a], pool)
    t.release_all(pool)
    assert pool.refcount(a) == 1


def test_release_all_reports_error_after_releasing_the_rest(impl):
    pool, t = impl.BlockPool(4), impl.SequenceBlockTable(4)
    for lp in range(3):
        t.ensure_writable(lp, pool)
    pool.release(1)  # corrupted from outside
    with pytest.raises(TableError.NotAllocated):
        t.release_all(pool)
    assert len(t) == 0
    assert [pool.refcount(p) for p in range(4)] == [0, 0, 0, 0]
    assert pool.free_count == 4


def test_release_all_reports_the_first_error(impl):
    big, small = impl.BlockPool(8), impl.BlockPool(2)
    for _ in range(6):
        big.allocate()
    t = impl.SequenceBlockTable(4)
    t.attach([0, 5, 1], big)
    small.allocate()  # page 0 allocated in the small pool; 1 is not; 5 is invalid there
    with pytest.raises(TableError.InvalidPage):
        t.release_all(small)
    assert len(t) == 0
    assert small.refcount(0) == 0 and small.free_count == 2


# -- bad input ------------------------------------------------------------------------------------


def test_ensure_writable_bad_logical_page(impl, bad_u32):
    value, exc = bad_u32
    pool, t = impl.BlockPool(4), impl.SequenceBlockTable(4)
    t.ensure_writable(0, pool)
    before = state(impl, pool, t)
    with pytest.raises(exc):
        t.ensure_writable(value, pool)
    assert state(impl, pool, t) == before


def test_attach_bad_page_values(impl, bad_u32):
    value, exc = bad_u32
    pool, t = impl.BlockPool(4), impl.SequenceBlockTable(4)
    a = pool.allocate()
    before = state(impl, pool, t)
    with pytest.raises(exc):
        t.attach([a, value], pool)
    assert state(impl, pool, t) == before


@pytest.mark.parametrize("pages", [None, 5, 1.5])
def test_attach_not_iterable(impl, pages):
    pool, t = impl.BlockPool(4), impl.SequenceBlockTable(4)
    with pytest.raises(TypeError):
        t.attach(pages, pool)


@pytest.mark.parametrize("pool", [None, 3, "pool", object()])
def test_wrong_pool_type(impl, pool):
    t = impl.SequenceBlockTable(4)
    with pytest.raises(TypeError):
        t.ensure_writable(0, pool)
    with pytest.raises(TypeError):
        t.attach([], pool)
    with pytest.raises(TypeError):
        t.release_all(pool)
    assert len(t) == 0


def test_table_in_place_of_pool(impl):
    t = impl.SequenceBlockTable(4)
    with pytest.raises(TypeError):
        t.ensure_writable(0, impl.SequenceBlockTable(2))


# -- property: refcounts always equal the holders we know of -------------------------------------

table_ops = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.integers(0, 2), st.integers(0, 4)),
        st.tuples(st.just("attach"), st.integers(0, 2), st.lists(st.integers(0, 7), max_size=4)),
        st.tuples(st.just("release_all"), st.integers(0, 2), st.none()),
        st.tuples(st.just("take"), st.none(), st.none()),
        st.tuples(st.just("share"), st.integers(0, 2), st.integers(0, 3)),
        st.tuples(st.just("drop"), st.integers(0, 9), st.none()),
    ),
    max_size=40,
)


@settings(max_examples=600, deadline=None)
@given(table_ops)
def test_refcounts_match_holders(impl, sequence):
    n = 8
    pool = impl.BlockPool(n)
    tables = [impl.SequenceBlockTable(3) for _ in range(3)]
    holders = []  # references held outside the tables, one entry per reference
    for op, a, b in sequence:
        if op == "write":
            try:
                cow = tables[a].ensure_writable(b, pool)
                if cow.kind == "copy":
                    assert cow.src != cow.page
            except TableError:
                pass
        elif op == "attach":
            try:
                tables[a].attach(b, pool)
            except TableError:
                pass
        elif op == "release_all":
            tables[a].release_all(pool)  # never corrupted here: must not fail
        elif op == "take":
            try:
                holders.append(pool.allocate())
            except Exception:
                pass
        elif op == "share":
            entries = tables[a].entries()
            if b < len(entries):
                pool.retain(entries[b])
                holders.append(entries[b])
        elif op == "drop" and holders:
            pool.release(holders.pop(a % len(holders)))
        mapped = [p for t in tables for p in t.entries()] + holders
        for p in range(n):
            assert pool.refcount(p) == mapped.count(p)
        assert pool.free_count + sum(1 for p in range(n) if pool.refcount(p) > 0) == n
        for t in tables:
            assert len(t) <= t.capacity
