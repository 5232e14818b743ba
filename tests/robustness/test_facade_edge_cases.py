"""Edge cases of the admit/decode/finish facade and the seed types, one test per case: one-shot
iterables, ctypes buffers, calls made while a round resolves its backend, tokens whose
``__index__`` changes their list, concurrent publishes, rounds and identities, the u32 limit of a
token count, misaligned arrays, read-only views and the forms a prompt may take.  Each would
otherwise crash, give a wrong result or miss an error.  The cases of calls made from user code
rest on the ownership rule (docs/DESIGN.md, "Ownership"): every mutating call resolves
everything that can run user code first, then owns every object it touches, then mutates;
tests/robustness/test_ownership.py and tests/robustness/test_seeded_stress.py test the rule
itself.  Threads are bounded by iteration counts and event timeouts, never by timings.
"""

from __future__ import annotations

import ctypes
import operator
import threading
import time

import numpy as np
import pytest
from helpers.ctypes_abi import CCopy, CItem, COutput, CView  # noqa: E402
from helpers.facade_checks import invariants  # noqa: E402

import qualia  # a core that is not built fails the import: never a silent skip
from qualia import twin  # noqa: E402
from qualia.errors import BusyError, DecodeRoundError, PoolError, SchedulerError, TableError  # noqa: E402

ITEM, OUTPUT, VIEW, COPY = (qualia.RAGGED_BATCH_ITEM, qualia.RAGGED_BATCH_OUTPUT,
                            qualia.REQUEST_VIEW, qualia.COPY_OP)
U32_MAX = 2**32 - 1
WAIT = 20  # seconds: the bound of every event wait (never reached when the code is right)


# -- helpers --------------------------------------------------------------------------------------




def state(s):
    views = s.runnable()
    rids = views["request_id"].tolist()
    return (s.stats(), s.pool.refcounts().tobytes(), views.tobytes(),
            tuple(s.block_table(r).tobytes() for r in rids),
            tuple(s.requests.pending_token(r) for r in rids),
            tuple((i.hex(), tuple(s.prefixes.pages_of(i))) for i in s.prefixes.identities()))


def hash_outputs(items, outputs, vocab=32000):
    for i, it in enumerate(items.tolist()):
        rid, slot, tok, pos = it[0], it[1], it[2], it[3]
        outputs[i] = (rid, slot, qualia.hash_next_token(rid, pos, tok, vocab))


class PyBackend:
    """A correct Python backend (the hash rule) with a copy_pages that records its copies."""

    def __init__(self):
        self.copies = []

    def execute_ragged(self, items, block_table, outputs):
        hash_outputs(items, outputs)
        return (len(items), 1)

    def copy_pages(self, copies):
        self.copies.append(copies.tolist())


def shared_world():
    """Request 1 decodes at token 10 (pages 0-2, page 2 its own); its first 6 tokens are
    published; request 2 attached them (token_count 6, so its decode page 1 is shared: a copy);
    request 3 decodes at a page boundary (token_count 8: its decode page 2 is allocated)."""
    s = qualia.Scheduler(max_requests=4, num_pages=32, page_tokens=4, logical_pages=4,
                         prefix_caching="explicit")
    prompt = list(range(1, 11))
    s.admit(1)
    s.reserve(1, 10)
    s.advance(1, 10)
    s.complete_prefill(1, 3)
    s.publish_prefix(1, prompt, prefix_len=6)
    assert s.admit(2, prompt, prefix_len=6).prefix_hit
    s.complete_prefill(2, 4)
    s.admit(3)
    s.reserve(3, 8)
    s.advance(3, 8)
    s.complete_prefill(3, 5)
    return s


def decoding_sched(n_decode=1, n_prefill=1):
    pool, store = qualia.BlockPool(16), qualia.PrefixKvStore(2, 2)
    sched = qualia.RequestScheduler(4, 4)
    for rid in range(1, n_decode + n_prefill + 1):
        sched.admit_with_prefix(rid, None, store, pool)
        sched.ensure_writable(rid, 0, pool)
        sched.seed_decode_token(rid, 7)
        if rid <= n_decode:
            sched.mark_prefill_complete(rid)
    return pool, store, sched


# -- one-shot iterables ----------------------------------------------------------------------------


def _gen(xs):
    yield from xs


@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 300, 5000])
@pytest.mark.parametrize("make", [iter, _gen, lambda xs: map(int, xs)], ids=["iter", "gen", "map"])
def test_a_one_shot_iterable_prompt_has_the_identity_of_its_list(n, make):
    tokens = list(range(n))
    expected = qualia.PrefixIdentity.of_tokens(tokens)
    assert qualia.PrefixIdentity.of_tokens(make(tokens)) == expected
    if n:
        assert expected != qualia.PrefixIdentity.of_tokens([])
    assert qualia.PrefixIdentity.of_tokens(make(tokens), "ns") == \
        qualia.PrefixIdentity.of_tokens(tokens, "ns")


def test_one_shot_iterable_prompts_publish_and_admit_like_lists():
    s = qualia.Scheduler(max_requests=4, num_pages=256, page_tokens=16, logical_pages=32,
                         prefix_caching="explicit")
    published = list(range(1000, 1300))
    s.admit(1)
    s.reserve(1, 300)
    s.advance(1, 300)
    s.publish_prefix(1, _gen(published))
    assert s.identity_for(_gen(published)) == qualia.PrefixIdentity.of_tokens(published)
    assert s.admit(2, _gen(published)).prefix_hit
    other = list(range(2000, 2300))
    assert not s.admit(3, _gen(other)).prefix_hit
    assert not s.admit(4, map(int, other)).prefix_hit
    invariants(s)
    # identities computed by the caller: another one-shot prompt must not hit these pages
    pool, store = qualia.BlockPool(8), qualia.PrefixKvStore(2, 2)
    sched = qualia.RequestScheduler(2, 2)
    store.publish(qualia.PrefixIdentity.of_tokens(_gen(published)), [pool.allocate()], 300, pool)
    adm = sched.admit_with_prefix(1, qualia.PrefixIdentity.of_tokens(_gen(other)), store, pool)
    assert not adm.prefix_hit


# -- ctypes buffers (NULL strides) -----------------------------------------------------------------






class CWrongOutput(ctypes.Structure):  # same size as an output, wrong fields
    _fields_ = [("request_id", ctypes.c_uint32), ("slot", ctypes.c_uint32),
                ("next_token_id", ctypes.c_uint64)]


def test_runnable_into_takes_ctypes_buffers():
    pool, store, sched = decoding_sched(2, 1)
    out = (CView * 4)()
    assert sched.runnable_into(out) == 3
    got = [(v.request_id, v.slot, v.state, v.token_count, v.prefix_tokens) for v in out[:3]]
    assert got == [tuple(v) for v in sched.runnable().tolist()]
    with pytest.raises(SchedulerError.OutputTooSmall):
        sched.runnable_into((CView * 2)())


def test_a_decode_round_takes_ctypes_buffers():
    expect_pool, _, expect = decoding_sched(2, 1)
    items, table, outs = np.zeros(4, ITEM), np.zeros(8, np.uint32), np.zeros(4, OUTPUT)
    assert expect.execute_decode_round(qualia.HashBackend(), items, table, outs) == (2, 1)
    for backend in (qualia.HashBackend(), PyBackend()):
        pool, store, sched = decoding_sched(2, 1)
        citems, ctable, couts = (CItem * 4)(), (ctypes.c_uint32 * 8)(), (COutput * 4)()
        assert sched.execute_decode_round(backend, citems, ctable, couts) == (2, 1)
        assert [(o.request_id, o.slot, o.next_token_id) for o in couts[:2]] == \
            [tuple(o) for o in outs[:2].tolist()]
        assert list(ctable[:2]) == table[:2].tolist()
        assert sched.runnable().tobytes() == expect.runnable().tobytes()


def test_the_hash_backend_methods_take_ctypes_buffers():
    b = qualia.HashBackend()
    items = (CItem * 2)()
    items[0].request_id, items[0].slot, items[0].token_id, items[0].position = 5, 0, 9, 3
    items[1].request_id, items[1].slot, items[1].token_id, items[1].position = 6, 1, 8, 4
    outs = (COutput * 2)()
    assert b.execute_ragged(items, (ctypes.c_uint32 * 1)(), outs) == (2, 1)
    assert outs[0].next_token_id == qualia.hash_next_token(5, 3, 9)
    assert outs[1].next_token_id == qualia.hash_next_token(6, 4, 8)
    copies = (CCopy * 3)()
    b.copy_pages(copies)
    assert b.pages_copied == 3


def test_ctypes_buffers_of_the_wrong_layout_are_refused():
    pool, store, sched = decoding_sched(2, 1)
    before = sched.runnable().tobytes()
    for bufs in [((ctypes.c_uint64 * 16)(), (ctypes.c_uint32 * 8)(), (COutput * 4)()),
                 ((CItem * 4)(), (ctypes.c_uint16 * 8)(), (COutput * 4)()),
                 ((CItem * 4)(), (ctypes.c_uint32 * 8)(), (CWrongOutput * 4)()),
                 ((CItem * 4)(), (ctypes.c_int32 * 8)(), (COutput * 4)())]:
        with pytest.raises(TypeError):
            sched.execute_decode_round(qualia.HashBackend(), *bufs)
    with pytest.raises(TypeError):
        sched.runnable_into((CCopy * 8)())
    with pytest.raises(TypeError):
        qualia.HashBackend().copy_pages((CView * 2)())
    assert sched.runnable().tobytes() == before


# -- a finish() while decode resolves its backend --------------------------------------------------


class FinishOnLookup(PyBackend):
    """Looking up the C interface (a missing attribute: __getattr__) finishes a request."""

    def __init__(self, s, victim, fail=False, copy=True):
        super().__init__()
        self.s, self.victim, self.fail, self.fired = s, victim, fail, False
        if not copy:
            self.copy_pages = None

    def __getattr__(self, name):
        if name == "__qualia_backend__" and not self.fired:
            self.fired = True
            self.s.finish(self.victim)
        raise AttributeError(name)

    def execute_ragged(self, items, block_table, outputs):
        if self.fail:
            raise RuntimeError("backend failed")
        return super().execute_ragged(items, block_table, outputs)


@pytest.mark.parametrize("victim, fail", [(2, False), (2, True), (3, True), (3, False)],
                         ids=["copy-ok", "copy-fail", "alloc-fail", "alloc-ok"])
def test_a_finish_while_decode_resolves_its_backend_leaves_the_round_whole(victim, fail):
    s = shared_world()
    b = FinishOnLookup(s, victim, fail=fail)
    if fail:
        with pytest.raises(DecodeRoundError.Backend):
            s.decode(b)
    else:
        receipt, out = s.decode(b)
        assert receipt.batch_size == 2 and victim not in out["request_id"].tolist()
    assert b.fired
    rids = invariants(s)
    assert victim not in rids
    # the freed slot is clean: a new request there has an empty table and finishes at once
    s.admit(99)
    assert len(s.block_table(99)) == 0
    s.finish(99)
    for rid in rids:
        s.finish(rid)
    for ident in s.prefixes.identities():
        s.evict(ident)
    assert s.free_pages == s.num_pages


def test_a_finish_from_a_backend_without_copy_pages_leaves_the_round_whole():
    s = shared_world()
    b = FinishOnLookup(s, 2, copy=False)  # the round needs no copy once request 2 is gone
    receipt, out = s.decode(b)
    assert out["request_id"].tolist() == [1, 3]
    invariants(s)


# -- the decode count is read after the backend is resolved ----------------------------------------


class PromoteOnLookup:
    """A __qualia_backend__ property that moves another request to Decode, then hands over the
    built-in C backend."""

    def __init__(self, sched, rid):
        self.sched, self.rid, self.inner = sched, rid, qualia.HashBackend()

    @property
    def __qualia_backend__(self):
        self.sched.mark_prefill_complete(self.rid)
        return self.inner.__qualia_backend__


def test_decode_counts_its_requests_after_resolving_the_backend():
    pool, store, sched = decoding_sched(1, 1)  # request 1 decodes, request 2 is seeded
    big_items, big_table, big_outs = np.zeros(4, ITEM), np.zeros(4, np.uint32), np.zeros(4, OUTPUT)
    with pytest.raises(DecodeRoundError.ItemBufferTooSmall):
        sched.execute_decode_round(PromoteOnLookup(sched, 2), big_items[:1], big_table,
                                   big_outs[:1])
    # nothing was written past the caller's scratch
    assert not big_items[1:].tobytes().strip(b"\0")
    assert not big_table.any()
    assert not big_outs[1:].tobytes().strip(b"\0")
    assert sched.runnable()["token_count"].tolist() == [0, 0]
    # with room for both, the round runs both
    assert sched.execute_decode_round(qualia.HashBackend(), big_items[:2], big_table[:2],
                                      big_outs[:2]) == (2, 1)


# -- a token whose __index__ shrinks the list ------------------------------------------------------


@pytest.mark.parametrize("n", [8, 300])
def test_a_token_whose_index_empties_its_list_is_read_from_a_copy(n):
    def shrinking():
        lst = list(range(n))

        class Shrink:
            def __index__(self):
                lst.clear()
                return 7

        lst[1] = Shrink()
        return lst

    expected_tokens = [0, 7] + list(range(2, n))
    expected = qualia.PrefixIdentity.of_tokens(expected_tokens)
    assert qualia.PrefixIdentity.of_tokens(shrinking()) == expected
    assert twin.PrefixIdentity.of_tokens(shrinking()).digest == expected.digest
    s = qualia.Scheduler(max_requests=4, num_pages=64, page_tokens=16, logical_pages=32,
                         prefix_caching="explicit")
    assert s.identity_for(shrinking()) == expected
    s.admit(1, shrinking())
    s.reserve(1, n)
    s.advance(1, n)
    assert s.publish_prefix(1, shrinking()) == expected
    assert s.admit(2, expected_tokens).prefix_hit
    invariants(s)


# -- publish_prefix racing a finish + admit --------------------------------------------------------


def test_publish_prefix_publishes_its_own_pages():
    """A second thread, woken as publish_prefix starts, finishes the request and admits another
    into its slot; the store must map the prompt to the publishing request's pages or refuse
    (UnknownRequest), never to the newcomer's."""
    pt, lp = 16, 4096
    L = pt * lp  # a long prompt: hashing it takes a while
    s = qualia.Scheduler(max_requests=2, num_pages=2 * lp + 8, page_tokens=pt, logical_pages=lp,
                         prefix_caching="explicit")
    prompt = np.arange(L, dtype=np.uint32)
    go, done, stop = threading.Event(), threading.Event(), threading.Event()
    spare = []
    errors = []

    def intruder():
        while not stop.is_set():
            if not go.is_set():
                time.sleep(0)  # yield the GIL; stay ready to take it
                continue
            go.clear()
            try:
                s.finish(1)
                spare.append(s.pool.allocate())  # shifts the newcomer's pages by one
                s.admit(2)
                s.reserve(2, L)
            except (BusyError, SchedulerError.UnknownRequest):
                pass
            except Exception as exc:  # pragma: no cover - a bug
                errors.append(exc)
            done.set()

    t = threading.Thread(target=intruder, daemon=True)
    t.start()
    mismatches = 0
    try:
        for _ in range(20):
            s.admit(1)
            s.reserve(1, L)
            s.advance(1, L)
            expected = s.block_table(1).tolist()
            done.clear()
            go.set()
            try:
                ident = s.publish_prefix(1, prompt)
            except (BusyError, SchedulerError.UnknownRequest):
                ident = None
            assert done.wait(WAIT)
            if ident is not None and ident in s.prefixes:
                if s.prefixes.pages_of(ident) != expected:
                    mismatches += 1
                s.evict(ident)
            for rid in (1, 2):
                try:
                    s.finish(rid)
                except SchedulerError.UnknownRequest:
                    pass
            while spare:
                s.pool.release(spare.pop())
            invariants(s)
    finally:
        stop.set()
        t.join(WAIT)
    assert not errors
    assert mismatches == 0
    assert s.free_pages == s.num_pages


# -- two decode rounds of one scheduler in flight --------------------------------------------------


class BlockingLookup:
    """A __qualia_backend__ property that releases the GIL: it waits until the other thread's
    round is inside its backend."""

    def __init__(self, entered, proceed):
        self.entered, self.proceed, self.inner = entered, proceed, qualia.HashBackend()

    @property
    def __qualia_backend__(self):
        self.entered.set()
        assert self.proceed.wait(WAIT)
        return self.inner.__qualia_backend__


class WaitingBackend(PyBackend):
    """A Python backend that signals it is inside the round, then waits to be released."""

    def __init__(self, inside, release):
        super().__init__()
        self.inside, self.release = inside, release

    def execute_ragged(self, items, block_table, outputs):
        self.inside.set()
        assert self.release.wait(WAIT)
        return super().execute_ragged(items, block_table, outputs)


@pytest.mark.parametrize("which", ["execute_decode_round", "Scheduler.decode"])
def test_two_decode_rounds_of_one_scheduler_never_run_at_once(which):
    if which == "Scheduler.decode":
        s = shared_world()
        before = s.runnable()["token_count"].tolist()
        run = s.decode
        counts = lambda: s.runnable()["token_count"].tolist()  # noqa: E731
    else:
        pool, store, sched = decoding_sched(2, 0)
        before = sched.runnable()["token_count"].tolist()
        run = lambda b: sched.execute_decode_round(  # noqa: E731
            b, np.zeros(4, ITEM), np.zeros(8, np.uint32), np.zeros(4, OUTPUT))
        counts = lambda: sched.runnable()["token_count"].tolist()  # noqa: E731
    resolving, inside, release = threading.Event(), threading.Event(), threading.Event()
    results = {}

    def call(name, backend):
        try:
            results[name] = run(backend)
        except BaseException as exc:
            results[name] = exc

    # t1 passes any entry check, then blocks resolving its backend (GIL released) until t2's
    # round is inside its backend
    t1 = threading.Thread(target=call, args=("t1", BlockingLookup(resolving, inside)))
    t1.start()
    assert resolving.wait(WAIT)
    t2 = threading.Thread(target=call, args=("t2", WaitingBackend(inside, release)))
    t2.start()
    t1.join(WAIT)
    release.set()
    t2.join(WAIT)
    assert not t1.is_alive() and not t2.is_alive()
    assert isinstance(results["t1"], BusyError), results["t1"]
    assert not isinstance(results["t2"], BaseException), results["t2"]
    assert counts() == [c + 1 for c in before]  # exactly one round ran


# -- a re-entrant publish_prefix must not expose a page being written ------------------------------


class PublishOnLookup(PyBackend):
    def __init__(self, s, rid, prompt):
        super().__init__()
        self.s, self.rid, self.prompt, self.fired, self.seen = s, rid, prompt, False, []

    def __getattr__(self, name):
        if name == "__qualia_backend__" and not self.fired:
            self.fired = True
            self.s.publish_prefix(self.rid, self.prompt)
        raise AttributeError(name)

    def execute_ragged(self, items, block_table, outputs):
        pt = self.s.page_tokens
        held = {p for i in self.s.prefixes.identities() for p in self.s.prefixes.pages_of(i)}
        for it in items.tolist():
            page = int(block_table[it[4] + it[3] // pt])
            self.seen.append((page, self.s.pool.refcount(page), page in held))
        return super().execute_ragged(items, block_table, outputs)


def test_a_reentrant_publish_cannot_expose_a_page_being_written():
    s = qualia.Scheduler(max_requests=4, num_pages=16, page_tokens=4, logical_pages=4,
                         prefix_caching="explicit")
    prompt = [9, 8, 7, 6, 5]
    s.admit(1)
    s.reserve(1, 5)
    s.advance(1, 5)
    s.complete_prefill(1, 4)  # decodes position 5: page 1, which the prompt's prefix covers
    # request 2 decodes in a shared page, so the round has a copy to hand over
    other = [1, 2, 3, 4, 5, 6]
    s.admit(3)
    s.reserve(3, 6)
    s.advance(3, 6)
    s.publish_prefix(3, other)
    s.finish(3)
    assert s.admit(2, other).prefix_tokens == 6
    s.complete_prefill(2, 4)
    b = PublishOnLookup(s, 1, prompt)
    s.decode(b)
    assert b.fired and len(b.seen) == 2
    for _page, count, in_store in b.seen:
        assert count == 1 and not in_store, b.seen
    ident = qualia.PrefixIdentity.of_tokens(prompt)
    assert b.seen[0][0] not in s.prefixes.pages_of(ident)
    assert len(b.copies[0]) == 2  # request 1's newly shared page was copied too
    invariants(s)


# -- identities computed on several threads at once ------------------------------------------------


def test_identities_computed_on_several_threads_are_right():
    s = qualia.Scheduler(max_requests=4, num_pages=1200, page_tokens=16, logical_pages=512,
                         prefix_caching="explicit")
    prompts = [list(range(k, k + 8192)) for k in (0, 100_000)]
    expected = [qualia.PrefixIdentity.of_tokens(p) for p in prompts]
    s.admit(1)
    s.reserve(1, 8192)
    s.advance(1, 8192)
    s.publish_prefix(1, prompts[0])
    wrong = []
    barrier = threading.Barrier(2, timeout=WAIT)

    def identities(k):
        barrier.wait()
        for _ in range(30):
            if s.identity_for(prompts[k]) != expected[k]:
                wrong.append(k)

    def admissions():
        barrier.wait()
        for _ in range(30):
            while True:
                try:
                    adm = s.admit(2, prompts[0])
                    break
                except BusyError:  # pragma: no cover - identity_for owns nothing
                    continue
            if not adm.prefix_hit:
                wrong.append("miss")
            s.finish(2)

    threads = [threading.Thread(target=identities, args=(1,)),
               threading.Thread(target=admissions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert not any(t.is_alive() for t in threads)
    assert not wrong
    invariants(s)


# -- decode's page check at token_count == 2**32 - 1 -----------------------------------------------


def test_decode_checks_its_page_at_a_token_count_of_u32_max():
    s = qualia.Scheduler(max_requests=2, num_pages=8, page_tokens=1, logical_pages=4,
                         prefix_caching="explicit")
    s.admit(1)
    assert s.advance(1, U32_MAX) == U32_MAX
    s.complete_prefill(1, 5)
    before = state(s)
    with pytest.raises(DecodeRoundError.Scheduler) as info:
        s.decode(qualia.HashBackend())
    assert info.value.chain == ("DecodeRoundError.Scheduler", "SchedulerError.Table",
                                "TableError.OutOfRange")
    assert state(s) == before
    with pytest.raises(SchedulerError.Table):
        s.reserve(1, 1)
    assert state(s) == before


# -- misaligned token arrays -----------------------------------------------------------------------


def _misaligned(tokens):
    raw = np.zeros(4 * len(tokens) + 8, np.uint8)
    a = raw[1:1 + 4 * len(tokens)].view(np.uint32)
    a[:] = tokens
    assert a.ctypes.data % 4 != 0
    return a


@pytest.mark.parametrize("n", [1, 31, 32, 33, 300, 5000])
def test_misaligned_and_strided_token_arrays_are_read_right(n):
    tokens = list(range(7, 7 + n))
    expected = qualia.PrefixIdentity.of_tokens(tokens)
    assert qualia.PrefixIdentity.of_tokens(_misaligned(tokens)) == expected
    assert qualia.PrefixIdentity.of_tokens(np.array(tokens, np.uint32)[::-1][::-1]) == expected
    assert qualia.PrefixIdentity.of_tokens(np.array(tokens, ">u4")) == expected
    big = np.zeros(2 * n, np.uint32)
    big[::2] = tokens
    assert qualia.PrefixIdentity.of_tokens(big[::2]) == expected
    s = qualia.Scheduler(max_requests=2, num_pages=400, page_tokens=16, logical_pages=320,
                         prefix_caching="explicit")
    assert s.identity_for(_misaligned(tokens)) == expected
    s.admit(1, _misaligned(tokens))
    s.reserve(1, n)
    s.advance(1, n)
    assert s.publish_prefix(1, _misaligned(tokens)) == expected


# -- read-only views stay read-only ----------------------------------------------------------------


def _root(arr):
    while isinstance(arr, np.ndarray):
        arr = arr.base
    return arr


def test_backend_views_cannot_be_made_writable():
    flips = []

    class Flipper(PyBackend):
        def execute_ragged(self, items, block_table, outputs):
            for name, v in (("items", items), ("block_table", block_table)):
                try:
                    v.flags.writeable = True
                    flips.append(name)
                except ValueError:
                    pass
                assert memoryview(_root(v)).readonly
            return super().execute_ragged(items, block_table, outputs)

        def copy_pages(self, copies):
            try:
                copies.flags.writeable = True
                flips.append("copies")
            except ValueError:
                pass
            super().copy_pages(copies)

    pool, store, sched = decoding_sched(2, 0)
    sched.execute_decode_round(Flipper(), np.zeros(4, ITEM), np.zeros(8, np.uint32),
                               np.zeros(4, OUTPUT))
    s = shared_world()
    b = Flipper()
    s.decode(b)
    assert b.copies
    assert flips == []


def test_decode_outputs_are_read_only_and_the_backends_own():
    s = shared_world()
    kept = []

    class Keeper(PyBackend):
        def execute_ragged(self, items, block_table, outputs):
            kept.append(outputs)
            return super().execute_ragged(items, block_table, outputs)

    receipt, out = s.decode(Keeper())
    held = out.copy()
    with pytest.raises(ValueError):
        out.flags.writeable = True
    with pytest.raises(ValueError):
        out[:1].flags.writeable = True
    assert memoryview(_root(out)).readonly
    with pytest.raises((TypeError, BufferError)):
        memoryview(_root(out)).cast("B")[0] = 1
    kept[0]["request_id"] = 12345  # the backend writes into its old outputs view later
    kept[0]["next_token_id"] = 1
    assert out.tobytes() == held.tobytes()
    assert invariants(s)


# -- prompt forms and prefix identities ------------------------------------------------------------


def test_a_too_long_generator_prompt_is_a_value_error():
    s = qualia.Scheduler(max_requests=2, num_pages=8, page_tokens=4, logical_pages=2,
                         prefix_caching="explicit")
    before = state(s)
    for call in (lambda g: s.admit(1, g), lambda g: s.identity_for(g),
                 lambda g: s.publish_prefix(1, g)):
        with pytest.raises(ValueError, match="more than 8 tokens"):
            call(_gen(range(9)))
        with pytest.raises(ValueError, match="more than"):
            call(iter(range(10**12)))  # read at most 9 items far
        with pytest.raises(ValueError, match="has 9 tokens"):
            call(list(range(9)))
    assert state(s) == before


@pytest.mark.parametrize("mod", [qualia, twin], ids=["core", "twin"])
def test_prefix_identity_is_immutable(mod):
    ident = mod.PrefixIdentity.of_tokens([1, 2, 3])
    digest, h = ident.digest, hash(ident)
    with pytest.raises(TypeError):
        ident.__init__(b"\x00" * 16)
    assert ident.digest == digest and hash(ident) == h
    made = mod.PrefixIdentity(digest)
    with pytest.raises(TypeError):
        made.__init__(b"\x01" * 16)
    assert made == ident


@pytest.mark.parametrize("mod", [qualia, twin], ids=["core", "twin"])
def test_prefix_identity_bytes_int_and_hash_agree(mod):
    ident = mod.PrefixIdentity.of_tokens([4, 5, 6], "ns")
    with pytest.raises(TypeError):
        operator.index(ident)
    assert bytes(ident) == ident.digest
    assert int(ident) == int.from_bytes(ident.digest, "big")
    other = (twin if mod is qualia else qualia).PrefixIdentity(ident.digest)
    assert bytes(other) == bytes(ident) and int(other) == int(ident)
    assert hash(other) == hash(ident)
    assert mod.PrefixIdentity(ident.digest) == ident
    assert ident != mod.PrefixIdentity.of_tokens([4, 5, 6])


BYTES_LIKE = [b"\x01\x02", bytearray(b"\x01\x02"), memoryview(b"\x01\x02"), "ab"]


@pytest.mark.parametrize("tokens", BYTES_LIKE, ids=lambda t: type(t).__name__)
def test_bytes_like_tokens_are_rejected(tokens):
    for mod in (qualia, twin):
        with pytest.raises(TypeError):
            mod.PrefixIdentity.of_tokens(tokens)
    s = qualia.Scheduler(max_requests=2, num_pages=8, page_tokens=4, logical_pages=2,
                         prefix_caching="explicit")
    s.admit(1)
    s.reserve(1, 4)
    s.advance(1, 4)
    before = state(s)
    for call in (lambda: s.admit(2, tokens), lambda: s.identity_for(tokens),
                 lambda: s.publish_prefix(1, tokens)):
        with pytest.raises(TypeError):
            call()
    assert state(s) == before
    t = qualia.SequenceBlockTable(4)
    with pytest.raises(TypeError):
        t.attach(tokens, s.pool)


# -- Also: BlockPool(0) ----------------------------------------------------------------------------


@pytest.mark.parametrize("mod", [qualia, twin], ids=["core", "twin"])
def test_block_pool_of_zero_pages(mod):
    pool = mod.BlockPool(0)
    assert pool.num_blocks == 0 and pool.free_count == 0
    with pytest.raises(PoolError.Exhausted):
        pool.allocate()
    for call in (pool.retain, pool.release, pool.refcount):
        with pytest.raises(PoolError.InvalidPage):
            call(0)
    table = mod.SequenceBlockTable(2)
    with pytest.raises(TableError.Exhausted):
        table.ensure_writable(0, pool)
    with pytest.raises(TableError.InvalidPage):
        table.attach([0], pool)
    if mod is qualia:
        assert pool.refcounts().tolist() == []
        with pytest.raises(ValueError):
            qualia.Scheduler(max_requests=1, num_pages=0, page_tokens=1, logical_pages=1,
                             prefix_caching="explicit")


def test_rejected_token_lists_free_their_scratch():
    """A long exact-int list with an id out of range is converted into heap memory first; the
    error path frees it (measured with tracemalloc over many calls)."""
    import tracemalloc

    bad = list(range(1000)) + [2**32]
    s = qualia.Scheduler(max_requests=2, num_pages=8, page_tokens=1024, logical_pages=2,
                         prefix_caching="explicit")
    calls = (lambda: qualia.PrefixIdentity.of_tokens(bad), lambda: s.identity_for(bad),
             lambda: s.admit(1, bad), lambda: s.publish_prefix(1, bad))
    for call in calls:
        with pytest.raises(OverflowError):
            call()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(500):
            for call in calls:
                try:
                    call()
                except OverflowError:
                    pass
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 500 * 4000 // 4, grown  # a leak would keep 4 KB per call
