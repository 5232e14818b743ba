"""Seeded stress of the facade and the raw seed types against their invariants.

After every step:
  * the sum of the reference counts equals the references held by block tables and store entries,
    page by page;
  * free pages + pages in use == total pages;
  * a call that failed changed nothing (state snapshot before == after), unless user code it ran
    before owning anything (a hostile backend or token) legitimately changed the state itself.
Inputs include hostile ones: iterators, generators, ctypes buffers, misaligned arrays, tokens
whose __index__ raises or mutates the container, backends whose __getattr__ or properties call
finish()/publish_prefix()/decode() re-entrantly, GC callbacks and weakref finalizers firing
re-entrant calls, and threads racing on one scheduler.  Fixed seeds, bounded steps: a few
seconds in the release build; tools/sanitize.sh runs it under ASan + UBSan too.
"""

from __future__ import annotations

import ctypes
import gc
import random
import threading
import time
import weakref
from collections import Counter

import numpy as np
import pytest
from helpers.ctypes_abi import CItem, COutput  # noqa: E402
from helpers.facade_checks import invariants  # noqa: E402

import qualia  # a core that is not built fails the import: never a silent skip
from qualia.errors import BusyError, QualiaError  # noqa: E402

ITEM, OUTPUT, VIEW = qualia.RAGGED_BATCH_ITEM, qualia.RAGGED_BATCH_OUTPUT, qualia.REQUEST_VIEW
SEEDS = [11, 22, 33, 44, 55, 66]
STEPS = 400
EXPECTED = (QualiaError, TypeError, ValueError, OverflowError, RuntimeError)


class Hostile(RuntimeError):
    """Raised on purpose by hostile inputs."""


# -- the facade ------------------------------------------------------------------------------------


def facade_state(s):
    views = s.runnable()
    rids = views["request_id"].tolist()
    return (tuple(sorted(s.stats().items())),
            s.pool.refcounts().tobytes(), views.tobytes(),
            tuple(s.block_table(r).tobytes() for r in rids),
            tuple(s.requests.pending_token(r) for r in rids),
            tuple((i.hex(), tuple(s.prefixes.pages_of(i)), s.prefixes.tokens_of(i))
                  for i in s.prefixes.identities()))




class Reentered:
    """Records whether a hostile re-entrant action changed the state (it ran) or not."""

    def __init__(self):
        self.ran = False

    def attempt(self, action):
        try:
            action()
            self.ran = True
        except BusyError:
            pass
        except EXPECTED:
            pass


class HashPy:
    """A correct Python backend: the built-in hash rule, and a copy_pages."""

    def execute_ragged(self, items, block_table, outputs):
        for i, it in enumerate(items.tolist()):
            outputs[i] = (it[0], it[1], qualia.hash_next_token(it[0], it[3], it[2]))
        return (len(items), 1)

    def copy_pages(self, copies):
        pass


class GetattrBackend(HashPy):
    """__getattr__ (called for the missing __qualia_backend__) runs a re-entrant action: the
    decode has not resolved its backend yet, so the action may run in full."""

    def __init__(self, action, log):
        self.action, self.log = action, log

    def __getattr__(self, name):
        if name == "__qualia_backend__":
            self.log.attempt(self.action)
        raise AttributeError(name)


class InsideBackend(HashPy):
    """Runs a re-entrant action inside the round (owned: it must get BusyError)."""

    def __init__(self, action, log, fail=False):
        self.action, self.log, self.fail = action, log, fail

    def execute_ragged(self, items, block_table, outputs):
        self.log.attempt(self.action)
        if self.fail:
            raise Hostile("backend failure")
        return super().execute_ragged(items, block_table, outputs)


class BadReceipt(HashPy):
    def execute_ragged(self, items, block_table, outputs):
        super().execute_ragged(items, block_table, outputs)
        return (len(items) + 1, 1)


class PropertyBackend(HashPy):
    def __init__(self, action, log):
        self.action, self.log = action, log

    @property
    def copy_pages(self):
        self.log.attempt(self.action)
        return HashPy.copy_pages.__get__(self)


class FacadeFuzz:
    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.s = qualia.Scheduler(max_requests=6, num_pages=40, page_tokens=4, logical_pages=8,
                                  prefix_entries=4, prefix_caching="explicit")
        base = [self.rng.randrange(1000) for _ in range(32)]
        self.prompts = [base[:k] for k in (5, 8, 13, 20)] + [[7] * 9, list(range(30))]
        self.next_rid = 1
        self.prompt_of = {}
        self.gc_action = None

    # hostile and friendly token inputs
    def tokens(self, prompt):
        rng = self.rng
        k = rng.randrange(12)
        if k == 0:
            return iter(prompt)
        if k == 1:
            return (t for t in prompt)
        if k == 2:
            return map(int, prompt)
        if k == 3:
            return np.array(prompt, np.uint32)
        if k == 4:
            return np.array(prompt, np.int64)
        if k == 5:
            raw = np.zeros(4 * len(prompt) + 8, np.uint8)
            a = raw[1:1 + 4 * len(prompt)].view(np.uint32)
            a[:] = prompt
            return a
        if k == 6:
            return (ctypes.c_uint32 * len(prompt))(*prompt)
        if k == 7 and prompt:
            lst = list(prompt)

            class Shrink:
                def __index__(self):
                    lst.clear()
                    return prompt[0]

            lst[0] = Shrink()
            return lst
        if k == 8 and prompt:
            class Raise:
                def __index__(self):
                    raise Hostile("token __index__")

            return list(prompt[:-1]) + [Raise()]
        if k == 9:
            return rng.choice([b"ab", bytearray(b"ab"), memoryview(b"ab"), "ab", 3, None])
        if k == 10:
            return tuple(prompt)
        return list(prompt)

    def live(self):
        return self.s.runnable()["request_id"].tolist()

    def pick(self):
        live = self.live()
        if live and self.rng.random() < 0.85:
            return self.rng.choice(live)
        return self.rng.randrange(1, self.next_rid + 2)

    def reentrant_action(self):
        s, rng = self.s, self.rng
        k = rng.randrange(4)
        if k == 0:
            rid = self.pick()
            return lambda: s.finish(rid)
        if k == 1:
            rid, p = self.pick(), rng.choice(self.prompts)
            return lambda: s.publish_prefix(rid, p, prefix_len=min(len(p), 4))
        if k == 2:
            return lambda: s.decode(qualia.HashBackend())
        self.next_rid += 1
        rid = self.next_rid
        return lambda: s.admit(rid, rng.choice(self.prompts))

    def backend(self, log):
        rng = self.rng
        k = rng.randrange(8)
        if k == 0:
            return GetattrBackend(self.reentrant_action(), log)
        if k == 1:
            return InsideBackend(self.reentrant_action(), log)
        if k == 2:
            return InsideBackend(self.reentrant_action(), log, fail=True)
        if k == 3:
            return BadReceipt()
        if k == 4:
            return PropertyBackend(self.reentrant_action(), log)
        if k == 5:
            return HashPy()
        return qualia.HashBackend(fault=rng.choice([None, None, None, "error", "swap"]))

    def step(self):
        s, rng = self.s, self.rng
        log = Reentered()
        k = rng.randrange(12)
        if k <= 1 or (k in (8, 9) and s.active_count < 3):
            self.next_rid += 1
            rid = self.next_rid if rng.random() < 0.9 else self.pick()
            p = rng.choice(self.prompts)
            plen = rng.choice([None, None, 0, 4, len(p)])

            def call():
                s.admit(rid, self.tokens(p), prefix_len=plen)
                self.prompt_of[rid] = p
        elif k == 2:
            rid = self.pick()
            p = self.prompt_of.get(rid, [])

            def call():  # prefill the whole prompt, then decode
                n = max(len(p) - s.token_count(rid), 0)
                s.reserve(rid, n)
                s.advance(rid, n)
                s.complete_prefill(rid, rng.randrange(100))
        elif k == 3:
            rid, n = self.pick(), rng.randrange(0, 10)
            call = rng.choice([lambda: s.reserve(rid, n), lambda: s.advance(rid, n)])
        elif k == 4:
            rid = self.pick()
            p = self.prompt_of.get(rid) or rng.choice(self.prompts)
            plen = rng.choice([None, None, 4, 5, len(p) + 1])
            call = lambda: s.publish_prefix(rid, self.tokens(p), prefix_len=plen)  # noqa: E731
        elif k in (5, 6):
            b = self.backend(log)
            call = lambda: s.decode(b)  # noqa: E731
        elif k in (7, 8):
            rid = self.pick()
            call = lambda: s.finish(rid)  # noqa: E731
        elif k == 9 and rng.random() < 0.4:
            call = rng.choice([s.evict_lru, s.evict_unused_lru,
                               lambda: s.evict(qualia.PrefixIdentity.of_tokens(
                                   rng.choice(self.prompts)[:4]))])
        elif k == 10:
            rid = self.pick()
            call = lambda: s.complete_prefill(rid, rng.randrange(100))  # noqa: E731
        else:
            p = rng.choice(self.prompts)
            call = lambda: s.identity_for(self.tokens(p),  # noqa: E731
                                          prefix_len=rng.choice([None, 4]))
        before = facade_state(s)
        # a GC callback may fire inside the call and try a re-entrant action
        if rng.random() < 0.15:
            self.gc_action = (self.reentrant_action(), log)
        failed = False
        try:
            call()
        except EXPECTED:
            failed = True
        finally:
            self.gc_action = None
        if failed and not log.ran:
            assert facade_state(s) == before, "a failed call changed the state"
        invariants(s)


class _GcFuzzHook:
    def __init__(self):
        self.fuzz = None

    def __call__(self, phase, info):
        f = self.fuzz
        if phase == "start" and f is not None and f.gc_action is not None:
            action, log = f.gc_action
            f.gc_action = None
            log.attempt(action)


@pytest.fixture
def gc_hook():
    hook = _GcFuzzHook()
    old = gc.get_threshold()
    gc.callbacks.append(hook)
    gc.set_threshold(50, 5, 5)  # collections happen inside the calls under test
    try:
        yield hook
    finally:
        gc.callbacks.remove(hook)
        gc.set_threshold(*old)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_facade_calls_keep_the_invariants(seed, gc_hook):
    f = FacadeFuzz(seed)
    gc_hook.fuzz = f
    for _ in range(STEPS):
        f.step()
    # drain: everything can still be finished and evicted, and every page comes back
    for rid in f.live():
        f.s.finish(rid)
    while f.s.evict_lru() is not None:
        pass
    assert f.s.free_pages == f.s.num_pages


def test_weakref_finalizers_during_random_facade_calls_keep_the_invariants():
    """Finalizers of collected cycles fire re-entrant calls at arbitrary points."""
    f = FacadeFuzz(99)
    fired = []

    def plant():
        class Node:
            pass

        a, b = Node(), Node()
        a.b, b.a = b, a
        action = f.reentrant_action()

        def finalizer():
            try:
                action()
                fired.append("ran")
            except BusyError:
                fired.append("busy")
            except EXPECTED:
                fired.append("error")

        weakref.finalize(a, finalizer)

    old = gc.get_threshold()
    gc.set_threshold(20, 2, 2)
    try:
        for i in range(STEPS):
            if i % 3 == 0:
                plant()
            # a failed call may find the state changed only when a finalizer ran a re-entrant
            # action in full during it
            ran = fired.count("ran")
            try:
                f.step()
            except AssertionError as exc:
                if "changed the state" not in str(exc) or fired.count("ran") == ran:
                    raise
            invariants(f.s)
    finally:
        gc.set_threshold(*old)
        gc.collect()
    invariants(f.s)
    assert fired


def test_random_facade_calls_on_threads_keep_the_invariants():
    """Two threads run the fuzz on one scheduler at once (a C backend releases the GIL): every
    call runs in full or fails cleanly; the invariants hold at the end."""
    f = FacadeFuzz(5)
    lock = threading.Lock()
    errors = []
    barrier = threading.Barrier(3, timeout=20)

    def worker(seed):
        rng = random.Random(seed)
        barrier.wait()
        for _ in range(150):
            s = f.s
            k = rng.randrange(6)
            try:
                if k == 0:
                    with lock:
                        f.next_rid += 1
                        rid = f.next_rid
                    s.admit(rid, rng.choice(f.prompts))
                elif k == 1:
                    live = s.runnable()["request_id"].tolist()
                    if live:
                        rid = rng.choice(live)
                        s.reserve(rid, 4)
                        s.advance(rid, 4)
                        s.complete_prefill(rid, 1)
                elif k == 2:
                    s.decode(rng.choice([qualia.HashBackend(), HashPy()]))
                elif k == 3:
                    live = s.runnable()["request_id"].tolist()
                    if live:
                        s.finish(rng.choice(live))
                elif k == 4:
                    live = s.runnable()["request_id"].tolist()
                    if live:
                        s.publish_prefix(rng.choice(live), rng.choice(f.prompts), prefix_len=4)
                else:
                    s.evict_unused_lru()
            except EXPECTED:
                pass
            except Exception as exc:  # pragma: no cover - would be a bug
                errors.append(exc)
            if rng.random() < 0.3:
                time.sleep(0)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    invariants(f.s)


# -- the raw seed types ----------------------------------------------------------------------------




class RawFuzz:
    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.pool = qualia.BlockPool(self.rng.choice([0, 3, 24]))
        self.store = qualia.PrefixKvStore(3, 3)
        self.sched = qualia.RequestScheduler(4, 4)
        self.tables = [qualia.SequenceBlockTable(3) for _ in range(2)]
        self.idents = [qualia.PrefixIdentity.of_tokens([k]) for k in range(4)]
        self.next_rid = 0
        self.extra = Counter()  # references the fuzz itself holds (allocate / retain)

    def allocate(self):
        page = self.pool.allocate()
        self.extra[page] += 1

    def retain(self, page):
        self.pool.retain(page)
        self.extra[page] += 1

    def release_extra(self):
        if self.extra:
            page = self.rng.choice(sorted(self.extra))
            self.pool.release(page)
            self.extra[page] -= 1
            if not self.extra[page]:
                del self.extra[page]

    def state(self):
        views = self.sched.runnable()
        assert self.pool.refcounts().sum() >= 0
        rids = views["request_id"].tolist()
        return (self.pool.refcounts().tobytes(), self.pool.free_count, views.tobytes(),
                tuple(tuple(self.sched.block_table(r)) for r in rids),
                tuple(self.sched.pending_token(r) for r in rids),
                tuple(tuple(t.entries()) for t in self.tables),
                tuple((i.hex(), tuple(self.store.pages_of(i))) for i in self.store.identities()))

    def invariants(self):
        held = Counter()
        for rid in self.sched.runnable()["request_id"].tolist():
            held.update(self.sched.block_table(rid))
        for t in self.tables:
            held.update(t.entries())
        for ident in self.store.identities():
            held.update(self.store.pages_of(ident))
        held.update(self.extra)
        refcounts = self.pool.refcounts().tolist()
        assert refcounts == [held[p] for p in range(self.pool.num_blocks)]
        assert self.pool.free_count + sum(1 for c in refcounts if c) == self.pool.num_blocks

    def rid(self):
        live = self.sched.runnable()["request_id"].tolist()
        if live and self.rng.random() < 0.8:
            return self.rng.choice(live)
        return self.rng.randrange(0, self.next_rid + 2)

    def scratch(self):
        rng = self.rng
        n = rng.choice([0, 1, 4, 8])
        if rng.random() < 0.3:
            return (CItem * max(n, 1))(), (ctypes.c_uint32 * 16)(), (COutput * max(n, 1))()
        return np.zeros(n, ITEM), np.zeros(16, np.uint32), np.zeros(n, OUTPUT)

    def step(self):
        rng, pool, store, sched = self.rng, self.pool, self.store, self.sched
        log = Reentered()
        k = rng.randrange(12)
        table = rng.choice(self.tables)
        ident = rng.choice(self.idents)
        if k == 0:
            self.next_rid += 1
            rid, idn = self.next_rid, rng.choice([None, ident])
            call = lambda: sched.admit_with_prefix(rid, idn, store, pool)  # noqa: E731
        elif k == 1:
            rid, lp = self.rid(), rng.randrange(5)
            call = lambda: sched.ensure_writable(rid, lp, pool)  # noqa: E731
        elif k == 2:
            rid = self.rid()
            call = rng.choice([lambda: sched.mark_prefill_complete(rid),
                               lambda: sched.seed_decode_token(rid, rng.randrange(9)),
                               lambda: sched.record_token(rid)])
        elif k in (3, 4):
            # the scheduler is owned by the round (BusyError); the store and pool are not
            action = rng.choice([lambda: sched.finish(self.rid(), pool),
                                 lambda: sched.record_token(self.rid()),
                                 lambda: store.evict_lru(pool)])
            backend = rng.choice([qualia.HashBackend(), HashPy(), BadReceipt(),
                                  InsideBackend(action, log),
                                  GetattrBackend(action, log)])
            bufs = self.scratch()
            call = lambda: sched.execute_decode_round(backend, *bufs)  # noqa: E731
        elif k == 5:
            rid = self.rid()
            call = lambda: sched.finish(rid, pool)  # noqa: E731
        elif k == 6:
            lp = rng.randrange(4)
            call = lambda: table.ensure_writable(lp, pool)  # noqa: E731
        elif k == 7:
            pages = [rng.randrange(max(pool.num_blocks, 1) + 1) for _ in range(rng.randrange(3))]
            call = rng.choice([lambda: table.attach(pages, pool),
                               lambda: table.release_all(pool)])
        elif k == 8:
            pages = [rng.randrange(max(pool.num_blocks, 1) + 1) for _ in range(rng.randrange(4))]
            call = lambda: store.publish(ident, iter(pages), rng.randrange(3), pool)  # noqa: E731
        elif k == 9:
            call = rng.choice([lambda: store.attach(ident, table, pool),
                               lambda: store.evict(ident, pool),
                               lambda: store.evict_lru(pool)])
        elif k == 10:
            page = rng.randrange(max(pool.num_blocks, 1) + 1)
            call = rng.choice([self.allocate, lambda: self.retain(page), self.release_extra])
        else:
            out = (ctypes.c_uint8 * 8)() if rng.random() < 0.2 else np.zeros(rng.randrange(5), VIEW)
            call = lambda: sched.runnable_into(out)  # noqa: E731
        before = self.state()
        try:
            call()
        except EXPECTED:
            if not log.ran:
                assert self.state() == before, "a failed call changed the state"
        self.invariants()


@pytest.mark.parametrize("seed", SEEDS)
def test_random_calls_on_the_raw_types_keep_the_invariants(seed, gc_hook):
    f = RawFuzz(seed)
    for _ in range(STEPS):
        f.step()
