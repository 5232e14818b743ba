"""No leaks: 10,000 create/use/destroy cycles of every object, and of every failing call.

Each scenario runs a warm-up (free lists, caches, interned objects, lazily built dtypes), then
10,000 cycles, and requires the memory traced by tracemalloc (Python objects, PyMem blocks of
the core, numpy data) to come back to within SLACK of where it was after the warm-up, and the
resident set size (/proc/self/statm) to within RSS_SLACK.  A leak of one 8-byte block per cycle
shows as 80 KB, past SLACK; `test_harness_detects_a_small_leak` checks that it does.

    pytest tests/core/test_leaks.py -q -p no:cacheprovider
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers.memory import CYCLES, SLACK, measure

import qualia
from qualia import twin as R
from qualia._types import RaggedBatchReceipt
from qualia.errors import QualiaError

RSS_SLACK = 4 * 1024 * 1024
# AddressSanitizer's quarantine keeps freed memory resident: RSS says nothing under it
UNDER_ASAN = "asan" in os.environ.get("LD_PRELOAD", "")

ITEM, OUTPUT, VIEW, COPY = (qualia.RAGGED_BATCH_ITEM, qualia.RAGGED_BATCH_OUTPUT,
                            qualia.REQUEST_VIEW, qualia.COPY_OP)


def assert_flat(cycle, cycles=CYCLES):
    traced, resident = measure(cycle, cycles)
    assert traced < SLACK, f"traced memory grew by {traced} bytes over {cycles} cycles"
    if not UNDER_ASAN:
        assert resident < RSS_SLACK, f"RSS grew by {resident} bytes over {cycles} cycles"


def fails(fn, exc=(QualiaError, TypeError, ValueError, OverflowError)):
    try:
        fn()
    except exc:
        return
    raise AssertionError(f"{fn} did not fail")


class PyBackend:
    def __init__(self, receipt=None, raise_=None):
        self.receipt = receipt
        self.raise_ = raise_

    def execute_ragged(self, items, table, outputs):
        if self.raise_ is not None:
            raise self.raise_
        n = len(items)
        outputs["request_id"] = items["request_id"]
        outputs["slot"] = items["slot"]
        outputs["next_token_id"] = items["token_id"]
        return RaggedBatchReceipt(n, 1) if self.receipt is None else self.receipt

    def copy_pages(self, copies):
        pass


class Reentrant:
    def __init__(self, sched):
        self.sched = sched

    def execute_ragged(self, items, table, outputs):
        self.sched.record_token(1)  # BusyError


class NoCopy:  # fine until a round needs a page copy
    def execute_ragged(self, items, table, outputs):
        return (len(items), 1)


# (classes are made once: a class made per cycle is freed only by a later collection, which
# shows as a constant offset of a few 10 KB)

# -- create / use / destroy ------------------------------------------------------------------------


def cycle_pool(i):
    pool = qualia.BlockPool(64)
    pages = [pool.allocate() for _ in range(8)]
    pool.retain(pages[0])
    pool.release(pages[0])
    for p in pages:
        pool.release(p)
    pool.refcount(3)
    pool.refcounts()
    repr(pool)
    _ = pool.free_count, pool.num_blocks


def cycle_table(i):
    pool = qualia.BlockPool(16)
    t = qualia.SequenceBlockTable(4)
    t.ensure_writable(0, pool)
    t.ensure_writable(0, pool)  # exclusive
    u = qualia.SequenceBlockTable(4)
    u.attach(t.entries(), pool)
    u.ensure_writable(0, pool)  # copy
    _ = u.attach  # a bound method
    t.release_all(pool)
    u.release_all(pool)
    repr(t)
    len(t)


def cycle_identity(i):
    a = qualia.PrefixIdentity.of_tokens([1, 2, i & 0xFFFF], b"tenant")
    b = qualia.PrefixIdentity.of_tokens(np.array([1, 2, i & 0xFFFF], np.uint32), "tenant")
    c = qualia.PrefixIdentity.fromhex(a.hex())
    d = qualia.PrefixIdentity(b.digest)
    assert a == b == c == d and hash(a) == hash(d)
    int(a)
    repr(a)
    a.__reduce__()
    {a: 1}[d]


def cycle_store(i):
    pool = qualia.BlockPool(16)
    store = qualia.PrefixKvStore(4, 4)
    ident = qualia.PrefixIdentity.of_tokens([i & 0xFF])
    pages = [pool.allocate(), pool.allocate()]
    store.publish(ident, pages, 7, pool)
    t = qualia.SequenceBlockTable(4)
    store.attach(ident, t, pool)
    store.attach(qualia.PrefixIdentity.of_tokens([999]), qualia.SequenceBlockTable(4), pool)
    store.identities()
    store.pages_of(ident)
    store.tokens_of(ident)
    _ = ident in store
    store.contains(ident)
    t.release_all(pool)
    store.evict(ident, pool)
    store.publish(ident, pages, 7, pool)
    store.evict_lru(pool)
    store.evict_lru(pool)
    repr(store)


def cycle_request_scheduler(i):
    pool = qualia.BlockPool(32)
    store = qualia.PrefixKvStore(4, 4)
    sched = qualia.RequestScheduler(4, 4)
    ident = qualia.PrefixIdentity.of_tokens([1, 2])
    sched.admit_with_prefix(1, ident, store, pool)
    sched.ensure_writable(1, 0, pool)
    sched.record_token(1)
    store.publish(ident, sched.block_table(1), 1, pool)
    sched.mark_prefill_complete(1)
    sched.seed_decode_token(1, 5)
    sched.admit_with_prefix(2, ident, store, pool)  # hit
    sched.seed_decode_token(2, 6)
    sched.ensure_writable(2, 0, pool)  # copy
    items, table, outs = np.zeros(4, ITEM), np.zeros(16, np.uint32), np.zeros(4, OUTPUT)
    sched.execute_decode_round(qualia.HashBackend(), items, table, outs)
    sched.execute_decode_round(PyBackend(), items, table, outs)
    sched.execute_decode_round(PyBackend(receipt=(2, 1)), items, table, outs)
    sched.runnable()
    sched.runnable_into(np.zeros(4, VIEW))
    sched.pending_token(1)
    sched.request_view(2)
    repr(sched)
    sched.finish(1, pool)
    sched.finish(2, pool)
    store.evict(ident, pool)


def cycle_facade(i):
    s = qualia.Scheduler(4, 32, 4, 4, prefix_entries=4, prefix_caching="explicit")
    prompt = [1, 2, 3, 4, 5, 6, 7]
    s.admit(1, prompt, prefix_len=6)
    s.reserve(1, 7)
    s.advance(1, 7)
    s.complete_prefill(1, 9)
    ident = s.publish_prefix(1, prompt, prefix_len=6)
    s.admit(2, prompt, prefix_len=6)
    s.reserve(2, 1)
    s.advance(2, 1)
    s.complete_prefill(2, 3)
    s.decode(qualia.HashBackend())
    s.decode(PyBackend())
    s.decode(R.PyHashBackend())
    s.block_table(1)
    s.token_count(2)
    s.runnable()
    s.stats()
    s.identity_for(prompt, 6)
    repr(s)
    s.finish(1)
    s.finish(2)
    s.evict_unused_lru()
    s.admit(3, prompt)
    s.finish(3)
    s.evict(ident) if ident in s.prefixes else None
    s.evict_lru()


def cycle_hash_backend(i):
    for fault in (None, "error", "batch_size", "launches", "swap"):
        b = qualia.HashBackend(32000, fault=fault, code=-3)
        cap = b.__qualia_backend__
        items, table, outs = np.zeros(2, ITEM), np.zeros(2, np.uint32), np.zeros(2, OUTPUT)
        try:
            b.execute_ragged(items, table, outs)
        except QualiaError:
            pass
        b.copy_pages(np.zeros(2, COPY))
        _ = b.calls, b.items, b.pages_copied, b.fault, b.code, b.vocab
        repr(b)
        del b
        del cap  # the capsule outlives the object, then goes too
    qualia.hash_next_token(1, 2, 3)


CREATE_USE_DESTROY = {
    "BlockPool": cycle_pool,
    "SequenceBlockTable": cycle_table,
    "PrefixIdentity": cycle_identity,
    "PrefixKvStore": cycle_store,
    "RequestScheduler": cycle_request_scheduler,
    "Scheduler": cycle_facade,
    "HashBackend": cycle_hash_backend,
}


@pytest.mark.parametrize("name", sorted(CREATE_USE_DESTROY))
def test_create_use_destroy(name):
    assert_flat(CREATE_USE_DESTROY[name])


# -- failing calls ---------------------------------------------------------------------------------


class ErrWorld:
    """Long-lived objects for the error-path cycles: the failures themselves must not leak."""

    def __init__(self):
        self.pool = qualia.BlockPool(8)
        self.store = qualia.PrefixKvStore(1, 2)
        self.sched = qualia.RequestScheduler(2, 2)
        self.ident = qualia.PrefixIdentity.of_tokens([1])
        self.other = qualia.PrefixIdentity.of_tokens([2])
        s, p, st = self.sched, self.pool, self.store
        s.admit_with_prefix(1, None, st, p)
        s.ensure_writable(1, 0, p)
        s.mark_prefill_complete(1)
        s.seed_decode_token(1, 4)
        st.publish(self.ident, s.block_table(1), 1, p)
        s.admit_with_prefix(2, None, st, p)
        s.mark_prefill_complete(2)  # decoding, but not seeded
        self.full = qualia.BlockPool(1)
        self.full.allocate()
        self.big = qualia.BlockPool(2)
        self.big.allocate()
        self.big._debug_set_refcount(0, 2**32 - 1)


ERR = None


def err_world():
    global ERR
    if ERR is None:
        ERR = ErrWorld()
    return ERR


def cycle_pool_errors(i):
    w = err_world()
    fails(w.full.allocate)
    fails(lambda: w.pool.retain(100))
    fails(lambda: w.pool.release(7))
    fails(lambda: w.big.retain(0))
    fails(lambda: w.pool.refcount(8))
    fails(lambda: w.pool.retain(-1))
    fails(lambda: w.pool.release(True))
    fails(lambda: w.pool.refcount(1.5))
    fails(lambda: qualia.BlockPool(0).allocate())
    fails(lambda: qualia.BlockPool(-1))
    fails(lambda: qualia.BlockPool(None))


def cycle_table_errors(i):
    w = err_world()
    t = qualia.SequenceBlockTable(2)
    fails(lambda: t.ensure_writable(5, w.pool))
    fails(lambda: t.ensure_writable(1, w.pool))
    fails(lambda: t.ensure_writable(0, w.full))
    fails(lambda: t.attach([0, 0, 0], w.pool))
    fails(lambda: t.attach([100], w.pool))
    fails(lambda: t.attach([7], w.pool))
    fails(lambda: t.attach([0], w.big))
    fails(lambda: t.attach("ab", w.pool))
    fails(lambda: t.attach([-1], w.pool))
    fails(lambda: t.attach(5, w.pool))
    fails(lambda: t.ensure_writable(0, None))
    fails(lambda: qualia.SequenceBlockTable(-1))
    u = qualia.SequenceBlockTable(1)
    u.attach([0], w.pool)
    fails(lambda: u.attach([0], w.pool))
    u.release_all(w.pool)


def cycle_store_errors(i):
    w = err_world()
    st, p = w.store, w.pool
    fails(lambda: st.publish(w.other, [], 1, p))
    fails(lambda: st.publish(w.other, [0], 0, p))
    fails(lambda: st.publish(w.other, [0, 0, 0], 1, p))
    fails(lambda: st.publish(w.ident, [0], 1, p))
    fails(lambda: st.publish(w.other, [0], 1, p))  # full
    fails(lambda: qualia.PrefixKvStore(2, 2).publish(w.other, [7], 1, p))
    fails(lambda: qualia.PrefixKvStore(2, 2).publish(w.other, [0, 100], 1, p))
    fails(lambda: st.evict(w.other, p))
    fails(lambda: st.pages_of(w.other))
    fails(lambda: st.tokens_of(w.other))
    fails(lambda: st.attach(w.ident, qualia.SequenceBlockTable(0), p))
    fails(lambda: st.publish(None, [0], 1, p))
    fails(lambda: st.publish(w.other, "x", 1, p))
    fails(lambda: qualia.PrefixKvStore(0, 1))
    fails(lambda: qualia.PrefixIdentity(b"short"))
    fails(lambda: qualia.PrefixIdentity.fromhex("zz"))
    fails(lambda: qualia.PrefixIdentity.of_tokens([-1]))
    fails(lambda: qualia.PrefixIdentity.of_tokens([1], 5))


def cycle_scheduler_errors(i):
    w = err_world()
    s, p, st = w.sched, w.pool, w.store
    fails(lambda: s.admit_with_prefix(1, None, st, p))
    fails(lambda: s.admit_with_prefix(3, None, st, p))  # full
    fails(lambda: s.ensure_writable(9, 0, p))
    fails(lambda: s.ensure_writable(1, 5, p))
    fails(lambda: s.ensure_writable(1, 2, p))
    fails(lambda: s.mark_prefill_complete(9))
    fails(lambda: s.seed_decode_token(9, 1))
    fails(lambda: s.record_token(9))
    fails(lambda: s.finish(9, p))
    fails(lambda: s.runnable_into(np.zeros(1, VIEW)))
    fails(lambda: s.runnable_into(np.zeros(4, np.uint8)))
    fails(lambda: s.runnable_into(np.zeros((2, 2), VIEW)))
    fails(lambda: s.admit_with_prefix(-1, None, st, p))
    fails(lambda: s.admit_with_prefix(3, "x", st, p))
    fails(lambda: qualia.RequestScheduler(0, 1))
    fails(lambda: qualia.RequestScheduler(70000, 1))
    # SchedulerError.Prefix: the hit does not fit a 0-page table
    small = qualia.RequestScheduler(1, 0)
    fails(lambda: small.admit_with_prefix(1, w.ident, st, p))


# Fresh bad buffers every cycle (a Py_buffer the core forgot to release would keep each one
# alive), made without `arr.flags.writeable = False` or `arr.ctypes`: those two alone make
# numpy's traced memory wander by tens of KB (bounded, but past SLACK under ASan).


def misaligned(dtype, n):
    """dtype records at byte offset 1 of a fresh bytearray (odd address)."""
    return np.frombuffer(bytearray(n * dtype.itemsize + 1), dtype=dtype, count=n, offset=1)


def readonly_zeros(n, dtype):
    """A fresh read-only array (over a bytes object)."""
    return np.frombuffer(bytes(n * np.dtype(dtype).itemsize), dtype=dtype)


def cycle_decode_errors(i):
    w = err_world()
    s = w.sched

    def scratch(items=4, table=8, outs=4):
        return np.zeros(items, ITEM), np.zeros(table, np.uint32), np.zeros(outs, OUTPUT)

    b = qualia.HashBackend()
    fails(lambda: s.execute_decode_round(b, *scratch()))  # MissingInputToken (request 2)
    fails(lambda: s.execute_decode_round(b, *scratch(items=1)))
    fails(lambda: s.execute_decode_round(b, *scratch(outs=1)))
    fails(lambda: s.execute_decode_round(b, *scratch(table=0)))
    fails(lambda: s.execute_decode_round(b, np.zeros(4, np.uint8), *scratch()[1:]))
    fails(lambda: s.execute_decode_round(b, scratch()[0], np.zeros(8, np.int32), scratch()[2]))
    fails(lambda: s.execute_decode_round(b, scratch()[0], scratch()[1],
                                         readonly_zeros(4, OUTPUT)))
    fails(lambda: s.execute_decode_round(b, misaligned(ITEM, 4), *scratch()[1:]))
    fails(lambda: s.execute_decode_round(b, np.zeros((4, 2), ITEM), *scratch()[1:]))
    fails(lambda: s.execute_decode_round(b, np.zeros(8, ITEM)[::2], *scratch()[1:]))
    fails(lambda: s.execute_decode_round(b, None, None, None))


def decoding_world():
    pool, store = qualia.BlockPool(8), qualia.PrefixKvStore(1, 1)
    sched = qualia.RequestScheduler(2, 2)
    for rid in (1, 2):
        sched.admit_with_prefix(rid, None, store, pool)
        sched.ensure_writable(rid, 0, pool)
        sched.mark_prefill_complete(rid)
        sched.seed_decode_token(rid, rid)
    return pool, store, sched


DW = None


def cycle_backend_errors(i):
    global DW
    if DW is None:
        backends = [qualia.HashBackend(fault=f) for f in ("batch_size", "launches", "swap")]
        backends += [PyBackend(receipt="garbage"), PyBackend(receipt=(2.0, 1)),
                     PyBackend(receipt=(3, 1)), PyBackend(receipt=(2, 2)),
                     R.PyHashBackend(fault="raise"), object()]
        DW = decoding_world() + (backends,)
    pool, store, s, backends = DW
    bufs = (np.zeros(2, ITEM), np.zeros(4, np.uint32), np.zeros(2, OUTPUT))
    # fresh backends failing (an error status, a Python exception, a code) ...
    fails(lambda: s.execute_decode_round(qualia.HashBackend(fault="error"), *bufs))
    fails(lambda: s.execute_decode_round(PyBackend(raise_=ValueError("boom")), *bufs))
    fails(lambda: s.execute_decode_round(R.PyHashBackend(fault="error", code=5), *bufs))
    # ... and long-lived ones with every other fault
    for backend in backends:
        fails(lambda: s.execute_decode_round(backend, *bufs))

    fails(lambda: s.execute_decode_round(Reentrant(s), *bufs))


FW = None


def cycle_facade_errors(i):
    global FW
    if FW is None:
        # request 2 hit a 3-token prefix: its next write is a copy of a shared page
        FW = qualia.Scheduler(2, 6, 2, 3, prefix_entries=1, prefix_caching="explicit")
        FW.admit(1, [1, 2, 3, 4], prefix_len=3)
        FW.reserve(1, 4)
        FW.advance(1, 4)
        FW.complete_prefill(1, 7)
        FW.publish_prefix(1, [1, 2, 3, 4], prefix_len=3)
        FW.admit(2, [1, 2, 3, 4], prefix_len=3)
        FW.complete_prefill(2, 8)
        tiny = qualia.Scheduler(1, 1, 1, 4)
        tiny.admit(1)
        FW = (FW, tiny)
    s, tiny = FW
    fails(lambda: s.admit(1))
    fails(lambda: s.admit(3))  # full
    fails(lambda: s.admit(3, "abc"))
    fails(lambda: s.admit(3, [1], prefix_len=5))
    fails(lambda: s.reserve(9, 1))
    fails(lambda: s.reserve(1, 100))  # out of range
    fails(lambda: tiny.reserve(1, 3))  # exhausted after one page: undone
    fails(lambda: s.advance(9, 1))
    fails(lambda: s.complete_prefill(1, -1))
    fails(lambda: s.publish_prefix(1, [1, 2, 3, 4], prefix_len=3))  # duplicate
    fails(lambda: s.publish_prefix(1, [1, 2, 3, 4, 5, 6, 7]))
    fails(lambda: s.publish_prefix(2, [9, 9], prefix_len=0))
    fails(lambda: s.decode(qualia.HashBackend(fault="error")))
    fails(lambda: s.decode(PyBackend(raise_=RuntimeError("x"))))
    fails(lambda: s.decode(PyBackend(receipt=None or "garbage")))
    fails(lambda: s.decode(NoCopy()))
    fails(lambda: s.decode(None))
    fails(lambda: s.finish(9))
    fails(lambda: s.evict(qualia.PrefixIdentity.of_tokens([5])))
    fails(lambda: s.evict("x"))
    fails(lambda: s.token_count(9))
    fails(lambda: qualia.Scheduler(0, 1, 1, 1))
    fails(lambda: qualia.Scheduler(1, 0, 1, 1))
    fails(lambda: qualia.Scheduler(1, 1, 0, 1))
    fails(lambda: qualia.Scheduler(1, 1, 1, 1, prefix_entries=0))
    fails(lambda: qualia.HashBackend(fault="nope"))
    fails(lambda: qualia.HashBackend(code=0))
    fails(lambda: qualia.HashBackend(vocab=0))


def cycle_hash_backend_errors(i):
    b = qualia.HashBackend()
    items, table, outs = np.zeros(2, ITEM), np.zeros(2, np.uint32), np.zeros(2, OUTPUT)
    fails(lambda: b.execute_ragged(items, table, outs[:1]))
    fails(lambda: b.execute_ragged(np.zeros(2, np.uint8), table, outs))
    fails(lambda: b.execute_ragged(items, table, readonly_zeros(2, OUTPUT)))
    fails(lambda: b.execute_ragged(items, misaligned(np.dtype(np.uint32), 2), outs))
    fails(lambda: b.copy_pages(np.zeros(2, np.uint64)))
    fails(lambda: b.copy_pages([(0, 1)]))
    fails(lambda: setattr(b, "fault", "nope"))
    fails(lambda: setattr(b, "code", 0))


FAILING = {
    "pool": cycle_pool_errors,
    "table": cycle_table_errors,
    "store": cycle_store_errors,
    "scheduler": cycle_scheduler_errors,
    "decode_round": cycle_decode_errors,
    "backend": cycle_backend_errors,
    "facade": cycle_facade_errors,
    "hash_backend": cycle_hash_backend_errors,
}


@pytest.mark.parametrize("name", sorted(FAILING))
def test_failing_calls(name):
    assert_flat(FAILING[name])


def test_failing_calls_left_the_long_lived_objects_intact():
    w = err_world()
    assert w.sched.active_count() == 2 and w.sched.block_table(1) == [0]
    assert w.pool.refcounts().tolist()[:2] == [2, 0] and len(w.store) == 1
    if FW is not None:
        s, tiny = FW
        assert s.stats()["active"] == 2 and s.stats()["decode_rounds"] == 0
        assert s.token_count(1) == 4 and s.token_count(2) == 3
        assert tiny.free_pages == 1 and tiny.block_table(1).tolist() == []


# -- the harness itself ----------------------------------------------------------------------------


def test_harness_detects_a_small_leak():
    kept = []
    traced, _ = measure(lambda i: kept.append(qualia.PrefixIdentity.of_tokens([i])),
                        cycles=CYCLES)
    assert traced > SLACK, f"a leak of one object per cycle went unnoticed ({traced} bytes)"
    kept.clear()


def test_harness_sees_pymem_blocks_of_the_core():
    kept = []
    traced, _ = measure(lambda i: kept.append(qualia.SequenceBlockTable(64)), cycles=2000)
    assert traced > 2000 * 64 * 4, traced  # the tables' PyMem entries are traced
    kept.clear()
