"""Bad input at every Python boundary of the core (and of the reference where it applies).

Every call gets wrong types, bools where ints are expected, negative and too-large integers,
floats, None, wrong dtypes, strided / read-only / misaligned / 2-D / zero-length buffers, and
Python backends that misbehave in every way we could think of.  Each must raise a Python
exception with a clear message (TypeError / ValueError / OverflowError, or the seed's error
class), never crash, and leave the state exactly as it was (snapshot before / after).

    pytest tests/robustness/test_bad_input.py -q -p no:cacheprovider
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

import qualia
from qualia import twin as R
from qualia._types import RaggedBatchReceipt
from qualia.errors import (
    BackendAbiError,
    BusyError,
    DecodeRoundError,
    PrefixKvError,
    QualiaError,
    RaggedBackendError,
    SchedulerError,
)

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
ARG_ERRORS = (TypeError, ValueError, OverflowError)

ITEM = qualia.RAGGED_BATCH_ITEM
OUTPUT = qualia.RAGGED_BATCH_OUTPUT
VIEW = qualia.REQUEST_VIEW
COPY = qualia.COPY_OP
U32 = np.dtype(np.uint32)

# integers that are not valid u32 / u64 arguments, and the class each must raise
BAD_U32 = [(-1, OverflowError), (2**32, OverflowError), (2**64, OverflowError),
           (-(2**70), OverflowError), (1.0, TypeError), (0.5, TypeError), (None, TypeError),
           (True, TypeError), (False, TypeError), (np.bool_(True), TypeError), ("1", TypeError),
           (b"1", TypeError), ([1], TypeError), (1 + 0j, TypeError), (np.float32(1), TypeError)]
BAD_U64 = [(-1, OverflowError), (2**64, OverflowError), (2**100, OverflowError),
           (1.0, TypeError), (None, TypeError), (True, TypeError), ("0", TypeError),
           (np.float64(0), TypeError), (object(), TypeError)]


def ids(cases):
    return [repr(v) for v, _ in cases]


# -- worlds and snapshots ------------------------------------------------------------------------


class World:
    """Pool + store + scheduler + a standalone table of one implementation, with two decoding
    requests (11 and 22, seeded, 2 and 1 pages), one prefilling request (33) and one published
    prefix (request 11's first page), so that every operation has something to break."""

    def __init__(self, impl):
        self.impl = impl
        self.pool = impl.BlockPool(16)
        self.store = impl.PrefixKvStore(4, 4)
        self.sched = impl.RequestScheduler(4, 4)
        self.table = impl.SequenceBlockTable(3)
        s, p, st = self.sched, self.pool, self.store
        for rid, pages in ((11, 2), (22, 1), (33, 1)):
            s.admit_with_prefix(rid, None, st, p)
            for lp in range(pages):
                s.ensure_writable(rid, lp, p)
                s.record_token(rid)
        for rid, tok in ((11, 5), (22, 6)):
            s.mark_prefill_complete(rid)
            s.seed_decode_token(rid, tok)
        self.ident = impl.PrefixIdentity.of_tokens([1, 2, 3])
        st.publish(self.ident, s.block_table(11)[:1], 1, p)
        self.table.ensure_writable(0, p)

    def state(self):
        i = self.impl
        return (i.pool_state(self.pool), i.store_state(self.store), i.sched_state(self.sched),
                i.table_state(self.table))

    @staticmethod
    def scratch(items=8, table=16, outputs=8):
        return (np.zeros(items, ITEM), np.zeros(table, U32), np.zeros(outputs, OUTPUT))

    def round(self, backend, *bufs):
        return self.sched.execute_decode_round(backend, *(bufs or self.scratch()))


def expect_unchanged(world, fn, exc):
    """fn() raises exc (a class or tuple) and the world's state is unchanged."""
    before = world.state()
    with pytest.raises(exc) as info:
        fn()
    assert str(info.value), "the error message is empty"
    assert world.state() == before, f"{info.value!r} changed the state"
    return info.value


# -- bad buffers ---------------------------------------------------------------------------------


def readonly(a):
    a.flags.writeable = False
    return a


def misaligned(dtype, n):
    """A view at byte offset 1 of a uint8 buffer, viewed as dtype."""
    raw = np.zeros(n * dtype.itemsize + 16, np.uint8)
    start = 1 if raw.ctypes.data % 2 == 0 else 2
    a = raw[start:start + n * dtype.itemsize].view(dtype)
    assert n == 0 or a.ctypes.data % 2 == 1
    return a


def big_endian(dtype):
    if dtype.names is None:
        return dtype.newbyteorder(">")
    return np.dtype({"names": dtype.names,
                     "formats": [dtype.fields[n][0].newbyteorder(">") for n in dtype.names],
                     "offsets": [dtype.fields[n][1] for n in dtype.names],
                     "itemsize": dtype.itemsize})


def same_size_other_fields(dtype):
    return np.dtype([(f"f{i}", "<u4") for i in range(dtype.itemsize // 4)])


BAD_BUFFERS = {
    # name: (maker(dtype, n), exception)
    "none": (lambda dt, n: None, TypeError),
    "int": (lambda dt, n: 8, TypeError),
    "list": (lambda dt, n: [0] * n, TypeError),
    "bytes": (lambda dt, n: bytes(n * dt.itemsize), TypeError),
    "bytearray": (lambda dt, n: bytearray(n * dt.itemsize), TypeError),
    "uint8": (lambda dt, n: np.zeros(n * dt.itemsize, np.uint8), TypeError),
    "int32": (lambda dt, n: np.zeros(n * dt.itemsize // 4, np.int32), TypeError),
    "float64": (lambda dt, n: np.zeros(n, np.float64), TypeError),
    "big_endian": (lambda dt, n: np.zeros(n, big_endian(dt)), TypeError),
    "other_fields": (lambda dt, n: np.zeros(n, same_size_other_fields(dt)), TypeError),
    "2d": (lambda dt, n: np.zeros((n, 2), dt), ValueError),
    "strided": (lambda dt, n: np.zeros(2 * n, dt)[::2], ValueError),
    "reversed": (lambda dt, n: np.zeros(n, dt)[::-1], ValueError),
    "misaligned": (misaligned, ValueError),
    "readonly": (lambda dt, n: readonly(np.zeros(n, dt)), ValueError),
}
WRITABLE_BAD = sorted(BAD_BUFFERS)
READABLE_BAD = sorted(set(BAD_BUFFERS) - {"readonly"})


class CountingBackend:
    def __init__(self, impl=None):
        self.inner = R.PyHashBackend()
        self.calls = 0

    def execute_ragged(self, items, block_table, outputs):
        self.calls += 1
        return self.inner.execute_ragged(items, block_table, outputs)

    def copy_pages(self, copies):
        return self.inner.copy_pages(copies)


@pytest.mark.parametrize("which", [0, 1, 2], ids=["items", "block_table", "outputs"])
@pytest.mark.parametrize("kind", WRITABLE_BAD)
def test_execute_decode_round_bad_scratch(impl, which, kind):
    w = World(impl)
    make, exc = BAD_BUFFERS[kind]
    bufs = list(w.scratch())
    dtype = (ITEM, U32, OUTPUT)[which]
    bufs[which] = make(dtype, 8 if which != 1 else 16)
    b = CountingBackend()
    expect_unchanged(w, lambda: w.round(b, *bufs), exc)
    assert b.calls == 0


@pytest.mark.parametrize("which, err", [
    (0, DecodeRoundError.ItemBufferTooSmall),
    (1, DecodeRoundError.BlockTableBufferTooSmall),
    (2, DecodeRoundError.OutputBufferTooSmall),
], ids=["items", "block_table", "outputs"])
@pytest.mark.parametrize("length", ["zero", "one_short"])
def test_execute_decode_round_short_scratch(impl, which, err, length):
    w = World(impl)
    need = (2, 3, 2)[which]  # two decoding requests holding three pages
    sizes = [8, 16, 8]
    sizes[which] = 0 if length == "zero" else need - 1
    b = CountingBackend()
    expect_unchanged(w, lambda: w.round(b, *w.scratch(*sizes)), err)
    assert b.calls == 0


def test_execute_decode_round_exact_and_zero_length_when_nothing_decodes(impl):
    w = World(impl)
    # exact sizes work
    assert w.round(CountingBackend(), *w.scratch(2, 3, 2)) == (2, 1)
    # with nothing decoding, zero-length (and misaligned zero-length) buffers are fine
    pool, store, sched = impl.BlockPool(2), impl.PrefixKvStore(1, 1), impl.RequestScheduler(2, 2)
    sched.admit_with_prefix(1, None, store, pool)
    b = CountingBackend()
    empty = (np.zeros(0, ITEM), np.zeros(0, U32), np.zeros(0, OUTPUT))
    assert sched.execute_decode_round(b, *empty) == (0, 0)
    assert sched.execute_decode_round(b, misaligned(ITEM, 0), misaligned(U32, 0),
                                      misaligned(OUTPUT, 0)) == (0, 0)
    assert b.calls == 0


def test_execute_decode_round_accepts_memoryviews(impl):
    w = World(impl)
    items, table, outs = w.scratch()
    assert w.round(CountingBackend(), memoryview(items), memoryview(table),
                   memoryview(outs)) == (2, 1)


@pytest.mark.parametrize("kind", WRITABLE_BAD)
def test_runnable_into_bad_buffer(impl, kind):
    w = World(impl)
    make, exc = BAD_BUFFERS[kind]
    expect_unchanged(w, lambda: w.sched.runnable_into(make(VIEW, 8)), exc)


@pytest.mark.parametrize("size", [0, 1, 2])
def test_runnable_into_too_small(impl, size):
    w = World(impl)
    buf = np.zeros(size, VIEW)
    expect_unchanged(w, lambda: w.sched.runnable_into(buf), SchedulerError.OutputTooSmall)
    assert not buf.tobytes().strip(b"\0")


def test_runnable_into_zero_length_when_idle(impl):
    sched = impl.RequestScheduler(2, 2)
    assert sched.runnable_into(np.zeros(0, VIEW)) == 0
    assert sched.runnable_into(misaligned(VIEW, 0)) == 0


# -- integer arguments ---------------------------------------------------------------------------


def u32_calls(w):
    p, st, s, t = w.pool, w.store, w.sched, w.table
    return {
        "pool.retain": lambda v: p.retain(v),
        "pool.release": lambda v: p.release(v),
        "pool.refcount": lambda v: p.refcount(v),
        "table.ensure_writable": lambda v: t.ensure_writable(v, p),
        "table.attach[page]": lambda v: impl_table(w).attach([v], p),
        "store.publish[page]": lambda v: st.publish(w.impl.PrefixIdentity.of_tokens([9]), [v],
                                                    1, p),
        "store.publish[tokens]": lambda v: st.publish(w.impl.PrefixIdentity.of_tokens([9]),
                                                      [0], v, p),
        "sched.ensure_writable[lp]": lambda v: s.ensure_writable(11, v, p),
        "sched.ensure_writable[lp, unknown id]": lambda v: s.ensure_writable(999, v, p),
        "sched.seed_decode_token[token]": lambda v: s.seed_decode_token(11, v),
        "sched.seed_decode_token[token, unknown id]": lambda v: s.seed_decode_token(999, v),
        "of_tokens[token]": lambda v: w.impl.PrefixIdentity.of_tokens([1, v]),
        "_debug_set_refcount[count]": lambda v: p._debug_set_refcount(0, v),
    }


def impl_table(w):
    return w.impl.SequenceBlockTable(4)


def u64_calls(w):
    p, st, s = w.pool, w.store, w.sched
    return {
        "admit_with_prefix": lambda v: s.admit_with_prefix(v, None, st, p),
        "ensure_writable": lambda v: s.ensure_writable(v, 0, p),
        "mark_prefill_complete": lambda v: s.mark_prefill_complete(v),
        "seed_decode_token": lambda v: s.seed_decode_token(v, 1),
        "record_token": lambda v: s.record_token(v),
        "finish": lambda v: s.finish(v, p),
        "block_table": lambda v: s.block_table(v),
        "pending_token": lambda v: s.pending_token(v),
    }


U32_CALLS = [
    "pool.retain", "pool.release", "pool.refcount", "table.ensure_writable",
    "table.attach[page]", "store.publish[page]", "store.publish[tokens]",
    "sched.ensure_writable[lp]", "sched.ensure_writable[lp, unknown id]",
    "sched.seed_decode_token[token]", "sched.seed_decode_token[token, unknown id]",
    "of_tokens[token]", "_debug_set_refcount[count]"]
U64_CALLS = ["admit_with_prefix", "ensure_writable", "mark_prefill_complete",
             "seed_decode_token", "record_token", "finish", "block_table", "pending_token"]


@pytest.mark.parametrize("value, exc", BAD_U32, ids=ids(BAD_U32))
@pytest.mark.parametrize("call", U32_CALLS)
def test_bad_u32_arguments(impl, call, value, exc):
    w = World(impl)
    err = expect_unchanged(w, lambda: u32_calls(w)[call](value), exc)
    assert not isinstance(err, QualiaError), "an argument error must not be a seed error"


@pytest.mark.parametrize("value, exc", BAD_U64, ids=ids(BAD_U64))
@pytest.mark.parametrize("call", U64_CALLS)
def test_bad_u64_request_ids(impl, call, value, exc):
    w = World(impl)
    expect_unchanged(w, lambda: u64_calls(w)[call](value), exc)


@pytest.mark.parametrize("value", [np.uint32(3), np.int64(3), np.uint64(3)])
def test_numpy_integers_are_integers(impl, value):
    pool = impl.BlockPool(8)
    for _ in range(4):
        pool.allocate()
    pool.retain(value)
    assert pool.refcount(value) == 2
    sched = impl.RequestScheduler(2, 4)
    store = impl.PrefixKvStore(1, 1)
    sched.admit_with_prefix(value, None, store, pool)
    assert sched.ensure_writable(value, np.uint8(0), pool).kind == "allocated"


@pytest.mark.parametrize("args, exc", [
    ((-1,), OverflowError), ((2**32,), OverflowError), ((True,), TypeError),
    ((1.0,), TypeError), ((None,), TypeError), (("4",), TypeError),
])
def test_block_pool_constructor(impl, args, exc):
    with pytest.raises(exc):
        impl.BlockPool(*args)


@pytest.mark.parametrize("args, exc", [
    ((-1,), OverflowError), ((2**32,), OverflowError), ((True,), TypeError), ((1.5,), TypeError),
    ((None,), TypeError),
])
def test_table_constructor(impl, args, exc):
    with pytest.raises(exc):
        impl.SequenceBlockTable(*args)


@pytest.mark.parametrize("args, exc", [
    ((0, 1), ValueError), ((1, 0), ValueError), ((-1, 1), OverflowError), ((1, -1), OverflowError),
    ((2**32, 1), OverflowError), ((1, 2**32), OverflowError), ((True, 1), TypeError),
    ((1, 1.0), TypeError), ((None, 1), TypeError),
])
def test_store_constructor(impl, args, exc):
    with pytest.raises(exc):
        impl.PrefixKvStore(*args)


@pytest.mark.parametrize("args, exc", [
    ((0, 1), ValueError), ((65537, 1), OverflowError), ((-1, 1), OverflowError),
    ((1, -1), OverflowError), ((1, 2**32), OverflowError), ((True, 1), TypeError),
    ((1, False), TypeError), ((2.0, 1), TypeError), ((1, None), TypeError),
])
def test_scheduler_constructor(impl, args, exc):
    with pytest.raises(exc):
        impl.RequestScheduler(*args)


# -- page lists, tokens, identities, namespaces ----------------------------------------------------


BAD_PAGE_LISTS = [
    ("str", "01", TypeError), ("bytes", b"\x00\x01", TypeError),
    ("bytearray", bytearray(b"\x00"), TypeError), ("int", 3, TypeError), ("none", None, TypeError),
    ("floats", [0.0], TypeError), ("bools", [True], TypeError), ("negative", [-1], OverflowError),
    ("too_big", [2**32], OverflowError), ("float_array", np.zeros(1, np.float64), TypeError),
    ("bool_array", np.zeros(1, np.bool_), TypeError), ("nested", [[0]], TypeError),
    ("mixed", [0, "1"], TypeError),
    ("2d_array", np.zeros((1, 1), np.uint32), (TypeError, ValueError)),
]


@pytest.mark.parametrize("name, pages, exc", BAD_PAGE_LISTS, ids=[c[0] for c in BAD_PAGE_LISTS])
def test_bad_page_lists(impl, name, pages, exc):
    w = World(impl)
    t = impl.SequenceBlockTable(4)
    expect_unchanged(w, lambda: t.attach(pages, w.pool), exc)
    assert len(t) == 0
    fresh = impl.PrefixIdentity.of_tokens([42])
    expect_unchanged(w, lambda: w.store.publish(fresh, pages, 1, w.pool), exc)


def test_page_list_generator_that_raises(impl):
    w = World(impl)

    def pages():
        yield 0
        raise RuntimeError("generator failed")

    t = impl.SequenceBlockTable(4)
    expect_unchanged(w, lambda: t.attach(pages(), w.pool), RuntimeError)
    assert len(t) == 0


BAD_TOKENS = [
    ("str", "abc", TypeError), ("bytes", b"ab", TypeError), ("int", 5, TypeError),
    ("none", None, TypeError), ("floats", [1.0], TypeError), ("bools", [False], TypeError),
    ("negative", [-1], OverflowError), ("too_big", [2**32], OverflowError),
    ("negative_one_digit", [5, -(2**30 - 1)], OverflowError),
    ("negative_two_digits", [5, -(2**30)], OverflowError),
    ("too_big_three_digits", [5, 2**62], OverflowError),
    ("too_big_long_list", [7] * 300 + [2**40], OverflowError),
    ("float_array", np.ones(2, np.float32), TypeError),
    ("bool_array", np.ones(2, np.bool_), TypeError),
    ("negative_array", np.array([-1], np.int64), OverflowError),
    ("too_big_array", np.array([2**32], np.int64), OverflowError),
    ("2d_array", np.zeros((2, 2), np.uint32), ValueError),
]


@pytest.mark.parametrize("name, tokens, exc", BAD_TOKENS, ids=[c[0] for c in BAD_TOKENS])
def test_of_tokens_bad_tokens(impl, name, tokens, exc):
    with pytest.raises(exc):
        impl.PrefixIdentity.of_tokens(tokens)


# around the sizes of an int's digits (30 bits, or 15 where a build uses 15-bit digits)
EDGE_IDS = [0, 1, 2**15 - 1, 2**15, 2**30 - 1, 2**30, 2**31, 2**32 - 1]


@pytest.mark.parametrize("length", [len(EDGE_IDS), 300])
def test_token_ids_from_a_list_of_ints_equal_those_from_a_uint32_array(impl, length):
    ids = (EDGE_IDS * (length // len(EDGE_IDS) + 1))[:length]
    arr = np.array(ids, np.uint32)
    assert impl.PrefixIdentity.of_tokens(ids) == impl.PrefixIdentity.of_tokens(arr)
    assert impl.PrefixIdentity.of_tokens(tuple(ids)) == impl.PrefixIdentity.of_tokens(arr)
    assert impl.PrefixIdentity.of_tokens(ids) != impl.PrefixIdentity.of_tokens(arr[::-1])


@pytest.mark.parametrize("ns", [1, None, 1.0, [b"a"], object()])
def test_of_tokens_bad_namespace(impl, ns):
    with pytest.raises(TypeError):
        impl.PrefixIdentity.of_tokens([1], ns)


def test_of_tokens_accepts_token_arrays_and_namespace_kinds(impl):
    a = impl.PrefixIdentity.of_tokens([1, 2], b"ns")
    for tokens in (np.array([1, 2], np.uint32), np.array([1, 2], np.int64), (1, 2),
                   np.array([0, 1, 2, 3], np.uint32)[1:3], np.array([2, 1], np.uint32)[::-1]):
        assert impl.PrefixIdentity.of_tokens(tokens, b"ns") == a
    for ns in ("ns", bytearray(b"ns"), memoryview(b"ns")):
        assert impl.PrefixIdentity.of_tokens([1, 2], ns) == a


@pytest.mark.parametrize("digest, exc", [
    (b"\0" * 15, ValueError), (b"\0" * 17, ValueError), (b"", ValueError), ("0" * 16, TypeError),
    (16, TypeError), (None, TypeError), ([0] * 16, TypeError),
])
def test_identity_bad_digest(impl, digest, exc):
    with pytest.raises(exc):
        impl.PrefixIdentity(digest)


@pytest.mark.parametrize("text, exc", [
    ("0" * 31, ValueError), ("0" * 33, ValueError), ("g" * 32, ValueError), (b"0" * 32, TypeError),
    (None, TypeError), (12, TypeError),
])
def test_identity_bad_hex(impl, text, exc):
    with pytest.raises(exc):
        impl.PrefixIdentity.fromhex(text)


WRONG_OBJECTS = [None, 1, "pool", object()]


@pytest.mark.parametrize("bad", WRONG_OBJECTS, ids=repr)
def test_wrong_objects_where_pool_store_table_identity_expected(impl, bad):
    w = World(impl)
    p, st, s, t = w.pool, w.store, w.sched, w.table
    calls = [
        lambda: t.ensure_writable(0, bad), lambda: t.attach([0], bad), lambda: t.release_all(bad),
        lambda: st.publish(bad, [0], 1, p), lambda: st.publish(w.ident, [0], 1, bad),
        lambda: st.attach(bad, impl.SequenceBlockTable(2), p),
        lambda: st.attach(w.ident, bad, p),
        lambda: st.attach(w.ident, impl.SequenceBlockTable(2), bad),
        lambda: st.evict(bad, p), lambda: st.evict(w.ident, bad), lambda: st.evict_lru(bad),
        lambda: st.pages_of(bad), lambda: st.tokens_of(bad),
        lambda: s.admit_with_prefix(1, None, bad, p), lambda: s.admit_with_prefix(1, None, st, bad),
        lambda: s.ensure_writable(11, 0, bad), lambda: s.finish(11, bad),
    ]
    if bad is not None:
        calls.append(lambda: s.admit_with_prefix(1, bad, st, p))
    for call in calls:
        expect_unchanged(w, call, TypeError)


def test_objects_of_the_other_implementation_are_rejected(impl):
    other = R if impl.name == "core" else qualia
    w = World(impl)
    opool, ostore = other.BlockPool(4), other.PrefixKvStore(1, 1)
    otable = other.SequenceBlockTable(2)
    oident = other.PrefixIdentity.of_tokens([1, 2, 3])
    for call in (lambda: w.table.ensure_writable(0, opool),
                 lambda: w.store.attach(w.ident, otable, w.pool),
                 lambda: w.store.attach(oident, impl.SequenceBlockTable(2), w.pool),
                 lambda: w.store.publish(oident, [0], 1, w.pool),
                 lambda: w.sched.admit_with_prefix(1, oident, w.store, w.pool),
                 lambda: w.sched.admit_with_prefix(1, None, ostore, w.pool),
                 lambda: w.sched.finish(11, opool)):
        expect_unchanged(w, call, TypeError)


# -- Python backends that misbehave ----------------------------------------------------------------


class Scripted:
    """execute_ragged computes correct outputs with PyHashBackend, then does `act`."""

    def __init__(self, act=None, receipt="ok"):
        self.act = act
        self.receipt = receipt
        self.calls = 0
        self.kept = None

    def execute_ragged(self, items, block_table, outputs):
        self.calls += 1
        R.PyHashBackend().execute_ragged(items, block_table, outputs)
        if self.act is not None:
            self.act(self, items, block_table, outputs)
        r = self.receipt
        n = len(items)
        if isinstance(r, str) and r == "ok":
            return RaggedBatchReceipt(n, 1)
        return r(n) if callable(r) else r


class EvilIndex:
    def __index__(self):
        raise RuntimeError("__index__ of a receipt field exploded")


class EvilSequence:
    def __len__(self):
        return 2

    def __iter__(self):
        raise RuntimeError("iterating the receipt exploded")

    def __getitem__(self, i):
        raise RuntimeError("indexing the receipt exploded")


GARBAGE_RECEIPTS = {
    "none": None, "int": 2, "str": "21", "bytes": b"\x02\x01", "one": (2,), "three": (2, 1, 0),
    "empty": (), "negative_size": (-1, 1), "negative_launches": (2, -1),
    "float_size": (2.0, 1), "float_launches": (2, 1.0), "str_field": ("2", 1),
    "bool_fields": (True, True), "none_field": (None, 1), "too_big": (2**32 + 2, 1),
    "huge": (2**80, 1), "nan": (float("nan"), 1), "dict_one_key": {"batch_size": 2},
    "object": object(), "nested": ((2, 1),), "float_array": np.array([2.0, 1.0]),
    "2d_array": np.array([[2, 1]]), "numpy_float_field": (np.float64(2), 1),
}


@pytest.mark.parametrize("name", sorted(GARBAGE_RECEIPTS))
def test_backend_returning_garbage(impl, name):
    w = World(impl)
    b = Scripted(receipt=GARBAGE_RECEIPTS[name])
    err = expect_unchanged(w, lambda: w.round(b), DecodeRoundError.Backend)
    assert isinstance(err.cause, TypeError), err.cause
    assert "execute_ragged must return" in str(err)
    assert b.calls == 1


@pytest.mark.parametrize("receipt, err", [
    (lambda n: (n + 1, 1), DecodeRoundError.OutputIdentityMismatch),
    (lambda n: (n - 1, 1), DecodeRoundError.OutputIdentityMismatch),
    (lambda n: (0, 0), DecodeRoundError.OutputIdentityMismatch),
    (lambda n: (n, 0), DecodeRoundError.BackendLaunchCount),
    (lambda n: (n, 2), DecodeRoundError.BackendLaunchCount),
    (lambda n: (U32_MAX, U32_MAX), DecodeRoundError.OutputIdentityMismatch),
], ids=["n+1", "n-1", "zero", "no_launch", "two_launches", "max"])
def test_backend_returning_wrong_counts(impl, receipt, err):
    w = World(impl)
    expect_unchanged(w, lambda: w.round(Scripted(receipt=receipt)), err)


@pytest.mark.parametrize("receipt", [
    lambda n: [n, 1], lambda n: (np.uint32(n), np.int64(1)), lambda n: np.array([n, 1], np.uint8),
    lambda n: RaggedBatchReceipt(n, 1),
    lambda n: np.array([(n, 1)], qualia.RAGGED_BATCH_RECEIPT)[0],
], ids=["list", "numpy_ints", "u8_array", "receipt", "receipt_record"])
def test_backend_receipt_forms_accepted(impl, receipt):
    w = World(impl)
    assert w.round(Scripted(receipt=receipt)) == (2, 1)


@pytest.mark.parametrize("receipt", [
    lambda n: iter([n, 1]), lambda n: (x for x in (n, 1)), lambda n: {n: "a", 1: "b"},
], ids=["iterator", "generator", "dict_two_keys"])
def test_receipt_that_is_no_sequence_is_rejected_by_both(impl, receipt):
    """The reference rejects a receipt that is not a sequence (DESIGN: a RaggedBatchReceipt or a
    (batch_size, backend_launches) pair); the core must agree."""
    w = World(impl)
    err = expect_unchanged(w, lambda: w.round(Scripted(receipt=receipt)), DecodeRoundError.Backend)
    assert isinstance(err.cause, TypeError)


@pytest.mark.parametrize("receipt", [lambda n: (EvilIndex(), 1), lambda n: (n, EvilIndex()),
                                     lambda n: EvilSequence()],
                         ids=["index_of_size", "index_of_launches", "iter"])
def test_receipt_whose_methods_raise_is_a_backend_error(impl, receipt):
    """A receipt's __index__ / __iter__ is backend code: what it raises is the backend failing
    (DESIGN.md "Backends": DecodeRoundError.Backend with the original chained), not a bare
    exception."""
    w = World(impl)
    err = expect_unchanged(w, lambda: w.round(Scripted(receipt=receipt)),
                           (DecodeRoundError.Backend, RuntimeError))
    assert isinstance(err, DecodeRoundError.Backend), f"bare {err!r} escaped the round"
    assert isinstance(err.root, (RuntimeError, TypeError))
    w.round(CountingBackend())  # not left busy


RAISING = [ValueError("backend failed"), RuntimeError("x"), MemoryError(), ZeroDivisionError(),
           RaggedBackendError.Failed(-7), StopIteration(), AssertionError("a")]


@pytest.mark.parametrize("exc", RAISING, ids=lambda e: type(e).__name__)
def test_backend_raising(impl, exc):
    w = World(impl)

    def act(self, items, table, outputs):
        raise exc

    err = expect_unchanged(w, lambda: w.round(Scripted(act)), DecodeRoundError.Backend)
    assert err.cause is exc and err.__cause__ is exc
    if isinstance(exc, RaggedBackendError.Failed):
        assert err.chain == ("DecodeRoundError.Backend", "RaggedBackendError.Failed")
        assert err.cause.code == -7


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit], ids=lambda e: e.__name__)
def test_backend_base_exceptions_pass_through_untouched(impl, exc):
    w = World(impl)

    def act(self, items, table, outputs):
        raise exc("stop")

    expect_unchanged(w, lambda: w.round(Scripted(act)), exc)
    assert w.round(CountingBackend()) == (2, 1)  # not left busy


MUTATIONS = {
    "items_field": lambda b, i, t, o: i.__setitem__("token_id", 1),
    "items_record": lambda b, i, t, o: i.__setitem__(0, i[1]),
    "items_fill": lambda b, i, t, o: i.fill(0),
    "items_reserved": lambda b, i, t, o: i["_reserved"].__setitem__(0, 9),
    "table_slice": lambda b, i, t, o: t.__setitem__(slice(None), 0),
    "table_item": lambda b, i, t, o: t.__setitem__(0, 99),
    "table_inplace": lambda b, i, t, o: np.add(t, 1, out=t),
    "items_resize": lambda b, i, t, o: i.resize(100, refcheck=False),
    "table_resize": lambda b, i, t, o: t.resize(100, refcheck=False),
    "outputs_resize": lambda b, i, t, o: o.resize(100, refcheck=False),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_backend_mutating_its_inputs(impl, name):
    """items and block_table are read-only views: the write raises inside the backend, which
    is a DecodeRoundError.Backend; resizing a view raises too."""
    w = World(impl)
    err = expect_unchanged(w, lambda: w.round(Scripted(MUTATIONS[name])), DecodeRoundError.Backend)
    assert isinstance(err.cause, ValueError), err.cause


def test_backend_flipping_writeable_cannot_defeat_the_identity_check(impl):
    w = World(impl)
    refused = []

    def act(self, items, table, outputs):
        try:
            items.flags.writeable = True
        except ValueError:
            refused.append(True)
            return  # numpy refused (the views are truly read-only): the round runs normally
        # claim the outputs' (swapped) identities were the inputs'
        items["request_id"][:] = items["request_id"][::-1].copy()
        items["slot"][:] = items["slot"][::-1].copy()
        outputs["request_id"][:] = items["request_id"]
        outputs["slot"][:] = items["slot"]

    before = w.state()
    try:
        w.round(Scripted(act))
    except DecodeRoundError.OutputIdentityMismatch:
        assert not refused and w.state() == before
    else:
        assert refused


def test_backend_keeping_outputs_and_writing_later(impl):
    w = World(impl)
    before_tokens = w.sched.runnable()["token_count"].tolist()
    b = Scripted(lambda self, i, t, o: setattr(self, "kept", o))
    bufs = w.scratch()
    assert w.round(b, *bufs) == (2, 1)
    after = w.state()
    assert w.sched.runnable()["token_count"].tolist() == [c + (i < 2) for i, c in
                                                          enumerate(before_tokens)]
    # the backend writes into its old outputs view later: only the caller's scratch changes
    b.kept["request_id"] = 12345
    b.kept["next_token_id"] = 7
    b.kept["slot"] = 3
    assert w.state() == after
    assert bufs[2]["request_id"][:2].tolist() == [12345, 12345]
    # and the next round ignores the stale scratch
    assert w.round(CountingBackend(), *bufs) == (2, 1)
    assert bufs[2]["request_id"][:2].tolist() == [11, 22]


def test_backend_keeping_inputs_sees_read_only_views_later(impl):
    w = World(impl)
    b = Scripted(lambda self, i, t, o: setattr(self, "kept", (i, t)))
    w.round(b)
    with pytest.raises(ValueError):
        b.kept[0]["token_id"] = 0
    with pytest.raises(ValueError):
        b.kept[1][:] = 0


def test_backend_writing_garbage_outputs(impl):
    w = World(impl)
    for act in (lambda b, i, t, o: o.fill(0),
                lambda b, i, t, o: o.__setitem__("slot", 2**32 - 1),
                lambda b, i, t, o: o.__setitem__("request_id", 2**64 - 1)):
        expect_unchanged(w, lambda: w.round(Scripted(act)),
                         DecodeRoundError.OutputIdentityMismatch)


def test_backend_writing_outputs_of_the_wrong_type_raises_inside(impl):
    w = World(impl)
    # (2**64, not -1: numpy < 2 silently wraps -1 into a uint32 field)
    for act in (lambda b, i, t, o: o.__setitem__("next_token_id", 2**64),
                lambda b, i, t, o: o.__setitem__("request_id", "x"),
                lambda b, i, t, o: o.__setitem__(0, (1, 2))):
        err = expect_unchanged(w, lambda: w.round(Scripted(act)), DecodeRoundError.Backend)
        assert isinstance(err.cause, (ValueError, TypeError, OverflowError))


def test_backend_without_execute_ragged(impl):
    w = World(impl)
    for b in (object(), None, 3, "backend", type("NoCall", (), {"execute_ragged": 5})()):
        expect_unchanged(w, lambda: w.round(b), TypeError)


def test_backend_without_execute_ragged_on_an_empty_round():
    """Core and reference agree on a backend of the wrong type when nothing decodes."""
    outcomes = []
    for m in (qualia, R):
        sched = m.RequestScheduler(2, 2)
        try:
            outcomes.append(sched.execute_decode_round(object(), *World.scratch()))
        except TypeError as exc:
            outcomes.append(type(exc))
    assert outcomes[0] == outcomes[1], f"core {outcomes[0]!r} != reference {outcomes[1]!r}"


@pytest.mark.parametrize("call", ["record_token", "finish", "seed_decode_token", "admit",
                                  "mark_prefill_complete", "ensure_writable", "round"])
@pytest.mark.parametrize("rid", [11, 999], ids=["live", "unknown"])
def test_reentrant_backend_is_busy(impl, call, rid):
    """A backend calling back into the scheduler gets BusyError (wrapped as the round's
    Backend error) -- for a known and for an unknown request id alike."""
    w = World(impl)
    s, p, st = w.sched, w.pool, w.store
    calls = {
        "record_token": lambda: s.record_token(rid),
        "finish": lambda: s.finish(rid, p),
        "seed_decode_token": lambda: s.seed_decode_token(rid, 1),
        "admit": lambda: s.admit_with_prefix(rid, None, st, p),
        "mark_prefill_complete": lambda: s.mark_prefill_complete(rid),
        "ensure_writable": lambda: s.ensure_writable(rid, 0, p),
        "round": lambda: s.execute_decode_round(CountingBackend(), *w.scratch()),
    }

    def act(self, items, table, outputs):
        calls[call]()

    err = expect_unchanged(w, lambda: w.round(Scripted(act)), DecodeRoundError.Backend)
    assert err.chain == ("DecodeRoundError.Backend", "BusyError"), err.chain


def test_reentrant_unknown_request_is_busy_in_both():
    """Core and reference report the same error to a backend that re-enters with an unknown
    id (the reference checks busy first: BusyError)."""
    chains = []
    for m in (qualia, R):
        pool, store, sched = m.BlockPool(8), m.PrefixKvStore(2, 2), m.RequestScheduler(2, 2)
        sched.admit_with_prefix(5, None, store, pool)
        sched.mark_prefill_complete(5)
        sched.seed_decode_token(5, 1)

        def act(self, items, table, outputs, sched=sched):
            sched.record_token(999)

        with pytest.raises(DecodeRoundError.Backend) as info:
            sched.execute_decode_round(Scripted(act), *World.scratch())
        chains.append(info.value.chain)
    assert chains[0] == chains[1], f"core {chains[0]} != reference {chains[1]}"


def test_backend_reading_scheduler_during_round_is_fine(impl):
    w = World(impl)
    seen = []

    def act(self, items, table, outputs):
        seen.append((w.sched.runnable().tolist(), w.sched.block_table(11),
                     w.sched.pending_token(22), w.sched.active_count()))

    assert w.round(Scripted(act)) == (2, 1)
    assert seen and seen[0][1] == w.sched.block_table(11)


def test_aliased_scratch_buffers_do_not_crash(impl):
    """items, block table and outputs over the same memory: garbage in, but no crash, and the
    scheduler stays consistent (outputs are checked against its own record of the batch)."""
    for backend in (CountingBackend(), qualia.HashBackend()):
        w = World(impl)
        raw = np.zeros(8 * ITEM.itemsize, np.uint8)
        items, table, outs = raw.view(ITEM), raw.view(U32), raw.view(OUTPUT)
        before = w.state()
        try:
            w.round(backend, items, table, outs)
        except QualiaError:
            assert w.state() == before
        views = w.sched.runnable()
        assert views["token_count"].tolist() in ([2, 1, 1], [3, 2, 1])


# -- the C reference backend's Python methods ------------------------------------------------------


def lowered(n=2):
    items = np.zeros(n, ITEM)
    items["request_id"] = np.arange(n) + 10
    items["slot"] = np.arange(n)
    return items, np.zeros(4, U32), np.zeros(n, OUTPUT)


@pytest.mark.parametrize("which", [0, 1, 2], ids=["items", "block_table", "outputs"])
@pytest.mark.parametrize("kind", WRITABLE_BAD)
def test_hash_backend_execute_ragged_bad_buffers(which, kind):
    make, exc = BAD_BUFFERS[kind]
    bufs = list(lowered())
    dtype = (ITEM, U32, OUTPUT)[which]
    if kind == "readonly" and which != 2:
        # inputs may be read-only (that is what a scheduler hands a backend)
        bufs[which] = readonly(bufs[which])
        b = qualia.HashBackend()
        assert b.execute_ragged(*bufs) == (2, 1)
        return
    bufs[which] = make(dtype, 2 if which != 1 else 4)
    b = qualia.HashBackend()
    outs = bufs[2] if isinstance(bufs[2], np.ndarray) else None
    before = None if outs is None else outs.tobytes()
    with pytest.raises(exc):
        b.execute_ragged(*bufs)
    assert b.calls == 0
    if before is not None:
        assert outs.tobytes() == before


def test_hash_backend_outputs_shorter_than_items():
    items, table, outs = lowered(3)
    b = qualia.HashBackend()
    with pytest.raises(ValueError):
        b.execute_ragged(items, table, outs[:2])
    assert b.calls == 0 and not outs.tobytes().strip(b"\0")


def test_hash_backend_zero_length():
    b = qualia.HashBackend()
    assert b.execute_ragged(np.zeros(0, ITEM), np.zeros(0, U32), np.zeros(0, OUTPUT)) == (0, 1)
    b.copy_pages(np.zeros(0, COPY))


@pytest.mark.parametrize("kind", READABLE_BAD)
def test_hash_backend_copy_pages_bad_buffers(kind):
    make, exc = BAD_BUFFERS[kind]
    b = qualia.HashBackend()
    with pytest.raises(exc):
        b.copy_pages(make(COPY, 3))
    assert b.pages_copied == 0
    b.copy_pages(readonly(np.zeros(3, COPY)))  # read-only copies are fine
    assert b.pages_copied == 3


@pytest.mark.parametrize("kwargs, exc", [
    (dict(vocab=0), ValueError), (dict(vocab=-1), OverflowError),
    (dict(vocab=2**32), OverflowError),
    (dict(vocab=1.0), TypeError), (dict(vocab=True), TypeError), (dict(vocab=None), TypeError),
    (dict(fault="bogus"), ValueError), (dict(fault=1), ValueError),
    (dict(fault="raise"), ValueError),
    (dict(code=0), ValueError), (dict(code=2**31), OverflowError),
    (dict(code=-(2**31) - 1), OverflowError),
    (dict(code=1.0), TypeError), (dict(code=True), TypeError), (dict(code=None), TypeError),
])
def test_hash_backend_constructor(kwargs, exc):
    with pytest.raises(exc):
        qualia.HashBackend(**kwargs)


def test_hash_backend_setters():
    b = qualia.HashBackend(fault="error", code=3)
    for attr, value, exc in (("fault", "nope", ValueError), ("code", 0, ValueError),
                             ("code", "1", TypeError), ("code", 2**40, OverflowError)):
        with pytest.raises(exc):
            setattr(b, attr, value)
    assert (b.fault, b.code) == ("error", 3)


@pytest.mark.parametrize("args, exc", [
    ((-1, 0, 0), OverflowError), ((0, -1, 0), OverflowError), ((0, 0, 2**32), OverflowError),
    ((0, 0, 0, 2**32), OverflowError), ((0.0, 0, 0), TypeError), ((True, 0, 0), TypeError),
    ((None, 0, 0), TypeError), ((2**64, 0, 0), OverflowError),
])
def test_hash_next_token_bad_args(args, exc):
    with pytest.raises(exc):
        qualia.hash_next_token(*args)


# -- the facade -----------------------------------------------------------------------------------


def facade(**kw):
    kw = {**dict(max_requests=4, num_pages=24, page_tokens=4, logical_pages=4,
                 prefix_caching="explicit"), **kw}
    s = qualia.Scheduler(**kw)
    prompt = list(range(1, 11))
    s.admit(1, prompt, prefix_len=8)
    s.reserve(1, 10)
    s.advance(1, 10)
    s.complete_prefill(1, 3)
    s.publish_prefix(1, prompt, prefix_len=6)
    s.admit(2, prompt, prefix_len=6)  # a hit: shares two pages, the second one partly filled
    s.complete_prefill(2, 4)
    s.admit(3)  # prefilling, no pages
    return s


def facade_state(s):
    views = s.runnable()
    rids = views["request_id"].tolist()
    store = s.prefixes
    return (s.stats(), s.pool.refcounts().tobytes(), views.tobytes(),
            tuple(s.block_table(r).tobytes() for r in rids),
            tuple(s.token_count(r) for r in rids),
            tuple(s.requests.pending_token(r) for r in rids),
            tuple((i.hex(), tuple(store.pages_of(i)), store.tokens_of(i))
                  for i in store.identities()))


def facade_unchanged(s, fn, exc):
    before = facade_state(s)
    with pytest.raises(exc) as info:
        fn()
    assert str(info.value)
    assert facade_state(s) == before, f"{info.value!r} changed the facade"
    return info.value


@pytest.mark.parametrize("kwargs, exc", [
    (dict(max_requests=0), ValueError), (dict(max_requests=65537), OverflowError),
    (dict(num_pages=0), ValueError), (dict(num_pages=-1), OverflowError),
    (dict(page_tokens=0), ValueError), (dict(page_tokens=2**32), OverflowError),
    (dict(logical_pages=-1), OverflowError), (dict(prefix_entries=0), ValueError),
    (dict(prefix_pages=0), ValueError), (dict(max_requests=True), TypeError),
    (dict(num_pages=2.0), TypeError), (dict(page_tokens=None), TypeError),
    (dict(logical_pages="4"), TypeError), (dict(prefix_entries=1.5), TypeError),
    (dict(prefix_pages=True), TypeError),
])
def test_facade_constructor(kwargs, exc):
    kw = {**dict(max_requests=2, num_pages=8, page_tokens=4, logical_pages=4), **kwargs}
    with pytest.raises(exc):
        qualia.Scheduler(**kw)


FACADE_INT_CALLS = {
    "admit[rid]": lambda s, v: s.admit(v),
    "reserve[rid]": lambda s, v: s.reserve(v, 1),
    "reserve[n]": lambda s, v: s.reserve(1, v),
    "reserve[n, unknown id]": lambda s, v: s.reserve(99, v),
    "advance[rid]": lambda s, v: s.advance(v, 1),
    "advance[n]": lambda s, v: s.advance(1, v),
    "complete_prefill[rid]": lambda s, v: s.complete_prefill(v, 1),
    "complete_prefill[token]": lambda s, v: s.complete_prefill(3, v),
    "publish_prefix[rid]": lambda s, v: s.publish_prefix(v, [1, 2]),
    "publish_prefix[prefix_len]": lambda s, v: s.publish_prefix(1, list(range(1, 11)), v),
    "admit[prefix_len]": lambda s, v: s.admit(9, [1, 2, 3], prefix_len=v),
    "identity_for[prefix_len]": lambda s, v: s.identity_for([1, 2, 3], v),
    "finish[rid]": lambda s, v: s.finish(v),
    "block_table[rid]": lambda s, v: s.block_table(v),
    "token_count[rid]": lambda s, v: s.token_count(v),
}
# The prompt length of each `[prefix_len]` call above (prefix_len=None means the whole prompt).
PREFIX_LEN_PROMPT = {"publish_prefix[prefix_len]": 10, "admit[prefix_len]": 3,
                     "identity_for[prefix_len]": 3}
BAD_INTS = [(-1, OverflowError), (2**64, OverflowError), (1.0, TypeError), (None, TypeError),
            (True, TypeError), ("1", TypeError)]


@pytest.mark.parametrize("value, exc", BAD_INTS, ids=ids(BAD_INTS))
@pytest.mark.parametrize("call", sorted(FACADE_INT_CALLS))
def test_facade_bad_ints(call, value, exc):
    s = facade()
    if value is None and call.endswith("[prefix_len]"):
        # None is no bad int here: it means "the whole prompt", exactly like passing its length
        whole = facade()
        got = FACADE_INT_CALLS[call](s, None)
        want = FACADE_INT_CALLS[call](whole, PREFIX_LEN_PROMPT[call])
        assert got == want
        assert facade_state(s) == facade_state(whole)
        return
    facade_unchanged(s, lambda: FACADE_INT_CALLS[call](s, value), exc)


@pytest.mark.parametrize("tokens, exc", [
    ("abc", TypeError), (b"abc", TypeError), (5, TypeError), ([1.0], TypeError),
    ([True], TypeError), ([-1], OverflowError), ([2**32], OverflowError),
    (np.ones(2, np.float64), TypeError), (np.ones((2, 2), np.uint32), ValueError),
    (list(range(17)), ValueError),  # longer than logical_pages x page_tokens
])
def test_facade_bad_prompts(tokens, exc):
    s = facade()
    for call in (lambda: s.admit(9, tokens), lambda: s.publish_prefix(1, tokens),
                 lambda: s.identity_for(tokens)):
        facade_unchanged(s, call, exc)


def test_facade_prefix_len_rules():
    s = facade()
    facade_unchanged(s, lambda: s.admit(9, [1, 2], prefix_len=3), ValueError)
    facade_unchanged(s, lambda: s.admit(9, None, prefix_len=1), ValueError)
    facade_unchanged(s, lambda: s.publish_prefix(1, [1, 2], prefix_len=0),
                     PrefixKvError.EmptyPrefix)
    facade_unchanged(s, lambda: s.publish_prefix(3, [1, 2]), ValueError)  # holds no tokens


@pytest.mark.parametrize("ns", [1, None, 1.5, [b"a"]])
def test_facade_bad_namespaces(ns):
    s = facade()
    for call in (lambda: s.admit(9, [1, 2], namespace=ns),
                 lambda: s.publish_prefix(1, [1, 2], namespace=ns),
                 lambda: s.identity_for([1, 2], namespace=ns)):
        facade_unchanged(s, call, TypeError)


@pytest.mark.parametrize("bad", [None, 1, "x", b"\0" * 16, R.PrefixIdentity(b"\0" * 16)],
                         ids=["none", "int", "str", "bytes", "reference_identity"])
def test_facade_evict_bad_identity(bad):
    s = facade()
    facade_unchanged(s, lambda: s.evict(bad), TypeError)


class FacadeBackend(Scripted):
    def __init__(self, act=None, receipt="ok", copy=None):
        super().__init__(act, receipt)
        self.copy = copy
        self.copies = []

    def copy_pages(self, copies):
        self.copies.append(copies.copy())
        if self.copy is not None:
            self.copy(copies)


@pytest.mark.parametrize("backend", [None, 3, "backend", object()], ids=repr)
def test_facade_decode_bad_backend(backend):
    s = facade()
    facade_unchanged(s, lambda: s.decode(backend), TypeError)


def test_facade_decode_bad_capsule():
    import ctypes

    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    holder = ctypes.c_uint64(0)
    cap = new(ctypes.addressof(holder), b"not.qualia", None)
    s = facade()
    facade_unchanged(s, lambda: s.decode(cap), BackendAbiError)
    facade_unchanged(s, lambda: s.decode(type("B", (), {"__qualia_backend__": 5})()),
                     BackendAbiError)


@pytest.mark.parametrize("name", sorted(GARBAGE_RECEIPTS))
def test_facade_decode_garbage_receipt(name):
    s = facade()
    b = FacadeBackend(receipt=GARBAGE_RECEIPTS[name])
    err = facade_unchanged(s, lambda: s.decode(b), DecodeRoundError.Backend)
    assert isinstance(err.cause, TypeError)


@pytest.mark.parametrize("name", sorted(set(MUTATIONS) - {"outputs_resize"}))
def test_facade_decode_backend_mutating_inputs(name):
    s = facade()
    err = facade_unchanged(s, lambda: s.decode(FacadeBackend(MUTATIONS[name])),
                           DecodeRoundError.Backend)
    assert isinstance(err.cause, ValueError)


@pytest.mark.parametrize("copy", [
    lambda c: c.__setitem__("src_page", 0),
    lambda c: (_ for _ in ()).throw(RuntimeError("copy failed")),
    lambda c: c.resize(10, refcheck=False),
], ids=["write", "raise", "resize"])
def test_facade_decode_copy_pages_failing(copy):
    s = facade()
    b = FacadeBackend(copy=copy)
    facade_unchanged(s, lambda: s.decode(b), DecodeRoundError.Backend)
    assert len(b.copies) == 1 and len(b.copies[0]) == 1  # request 2 writes a shared page
    assert b.calls == 0


@pytest.mark.parametrize("exc", [ValueError("x"), RaggedBackendError.Failed(9),
                                 KeyboardInterrupt("stop")],
                         ids=lambda e: type(e).__name__)
def test_facade_decode_backend_raising(exc):
    s = facade()

    def act(self, items, table, outputs):
        raise exc

    facade_unchanged(s, lambda: s.decode(FacadeBackend(act)), (DecodeRoundError.Backend,
                                                                KeyboardInterrupt))
    receipt, outputs = s.decode(FacadeBackend())  # not left busy, pages restored exactly
    assert receipt == (2, 1)


def test_facade_decode_backend_keeping_outputs():
    s = facade()
    b = FacadeBackend(lambda self, i, t, o: setattr(self, "kept", o))
    receipt, outputs = s.decode(b)
    state = facade_state(s)
    b.kept["request_id"] = 999  # writes into the facade's output scratch later
    assert facade_state(s) == state  # the scheduler's own state is untouched
    with pytest.raises(ValueError):
        outputs["request_id"] = 1  # the caller's view is read-only
    receipt, outputs = s.decode(FacadeBackend())
    assert outputs["request_id"].tolist() == [1, 2]


def test_facade_reentrant_backend_is_busy():
    s = facade()
    for call in (lambda: s.finish(1), lambda: s.admit(50), lambda: s.reserve(1, 1),
                 lambda: s.advance(1, 1), lambda: s.evict_lru(), lambda: s.decode(FacadeBackend()),
                 lambda: s.pool.allocate(), lambda: s.requests.record_token(1),
                 lambda: s.prefixes.evict_lru(s.pool), lambda: s.evict_unused_lru()):
        def act(self, items, table, outputs, call=call):
            call()

        err = facade_unchanged(s, lambda: s.decode(FacadeBackend(act)), DecodeRoundError.Backend)
        assert err.chain == ("DecodeRoundError.Backend", "BusyError"), err.chain
    assert s.decode(FacadeBackend())[0] == (2, 1)


def test_no_reference_cycles_or_garbage_from_errors():
    """Failed calls leave no uncollectable garbage behind (the error keeps no frame cycle that
    holds scratch buffers alive forever)."""
    gc.collect()
    before = len(gc.garbage)
    s = facade()
    for _ in range(50):
        for call in (lambda: s.reserve(99, 1), lambda: s.decode(FacadeBackend(receipt=None)),
                     lambda: s.admit(1), lambda: s.publish_prefix(1, "x")):
            try:
                call()
            except (QualiaError, TypeError, ValueError):
                pass
    gc.collect()
    assert len(gc.garbage) == before


def test_busy_error_is_a_runtime_error():
    assert issubclass(BusyError, RuntimeError) and issubclass(BusyError, QualiaError)
