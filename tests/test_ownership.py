"""The ownership rule (docs/DESIGN.md, "Ownership").

Every mutating call resolves everything that can run user code first, then owns every object it
touches (atomically: all or nothing, BusyError otherwise), mutates, and releases; only the owner
releases.  Anything that runs while the objects are owned -- a Python backend, a property or
__getattr__ of the backend, a GC callback, a weakref finalizer, another thread -- gets BusyError
from every mutating call and changes nothing; reads keep working.  Threads are bounded by
iteration counts and event timeouts, never by timings.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

import numpy as np
import pytest

qualia = pytest.importorskip("qualia")
if not hasattr(qualia, "Scheduler"):  # pragma: no cover
    pytest.skip("compiled core not built", allow_module_level=True)

from facade_checks import invariants  # noqa: E402

from qualia.errors import BusyError, QualiaError  # noqa: E402

ITEM, OUTPUT = qualia.RAGGED_BATCH_ITEM, qualia.RAGGED_BATCH_OUTPUT
WAIT = 20




def state(s):
    views = s.runnable()
    rids = views["request_id"].tolist()
    return (s.pool.refcounts().tobytes(), views.tobytes(),
            tuple(s.block_table(r).tobytes() for r in rids),
            tuple(s.requests.pending_token(r) for r in rids),
            tuple((i.hex(), tuple(s.prefixes.pages_of(i))) for i in s.prefixes.identities()))


def world():
    s = qualia.Scheduler(max_requests=6, num_blocks=48, page_tokens=4, logical_pages=6,
                         prefix_caching="explicit")
    prompt = list(range(1, 11))
    s.admit(1)
    s.reserve(1, 10)
    s.advance(1, 10)
    s.complete_prefill(1, 3)
    s.publish_prefix(1, prompt, prefix_len=6)
    s.admit(2, prompt, prefix_len=6)
    s.complete_prefill(2, 4)
    s.admit(3)
    return s, prompt


class Backend:
    """A correct Python backend (the hash rule); `during` runs inside the round."""

    def __init__(self, during=None):
        self.during = during

    def execute_ragged(self, items, block_table, outputs):
        if self.during is not None:
            self.during()
        for i, it in enumerate(items.tolist()):
            outputs[i] = (it[0], it[1], qualia.hash_next_token(it[0], it[3], it[2]))
        return (len(items), 1)

    def copy_pages(self, copies):
        pass


def mutators(s, prompt):
    """Every mutating call reachable from a facade (on it, its parts, and a table using its
    pool)."""
    ident = qualia.PrefixIdentity.of_tokens(prompt[:6])
    other = qualia.PrefixIdentity.of_tokens([77])
    table = qualia.SequenceBlockTable(4)
    items, tbl, outs = np.zeros(8, ITEM), np.zeros(64, np.uint32), np.zeros(8, OUTPUT)
    return {
        "admit": lambda: s.admit(9, prompt),
        "reserve": lambda: s.reserve(1, 1),
        "advance": lambda: s.advance(1, 1),
        "complete_prefill": lambda: s.complete_prefill(3, 1),
        "publish_prefix": lambda: s.publish_prefix(1, prompt, prefix_len=9),
        "decode": lambda: s.decode(qualia.HashBackend()),
        "finish": lambda: s.finish(1),
        "finish_unknown": lambda: s.finish(12345),
        "evict": lambda: s.evict(ident),
        "evict_lru": lambda: s.evict_lru(),
        "evict_unused_lru": lambda: s.evict_unused_lru(),
        "pool.allocate": lambda: s.pool.allocate(),
        "pool.retain": lambda: s.pool.retain(0),
        "pool.release": lambda: s.pool.release(0),
        "pool._debug_set_refcount": lambda: s.pool._debug_set_refcount(0, 5),
        "table.ensure_writable": lambda: table.ensure_writable(0, s.pool),
        "table.attach": lambda: table.attach([0], s.pool),
        "table.release_all": lambda: table.release_all(s.pool),
        "prefixes.publish": lambda: s.prefixes.publish(other, [0], 1, s.pool),
        "prefixes.attach": lambda: s.prefixes.attach(ident, table, s.pool),
        "prefixes.evict": lambda: s.prefixes.evict(ident, s.pool),
        "prefixes.evict_lru": lambda: s.prefixes.evict_lru(s.pool),
        "requests.admit_with_prefix": lambda: s.requests.admit_with_prefix(9, None, s.prefixes,
                                                                           s.pool),
        "requests.ensure_writable": lambda: s.requests.ensure_writable(1, 3, s.pool),
        "requests.mark_prefill_complete": lambda: s.requests.mark_prefill_complete(3),
        "requests.seed_decode_token": lambda: s.requests.seed_decode_token(3, 1),
        "requests.record_token": lambda: s.requests.record_token(1),
        "requests.finish": lambda: s.requests.finish(1, s.pool),
        "requests.execute_decode_round": lambda: s.requests.execute_decode_round(
            qualia.HashBackend(), items, tbl, outs),
    }


def readers(s, prompt):
    ident = qualia.PrefixIdentity.of_tokens(prompt[:6])
    return [lambda: s.runnable(), lambda: s.block_table(1), lambda: s.token_count(1),
            lambda: s.stats(), lambda: s.identity_for(prompt), lambda: s.pool.refcounts(),
            lambda: s.pool.refcount(0), lambda: s.prefixes.pages_of(ident),
            lambda: s.prefixes.identities(), lambda: ident in s.prefixes,
            lambda: s.requests.pending_token(1), lambda: s.requests.request_view(1),
            lambda: s.requests.block_table(1), lambda: s.requests.runnable(), lambda: repr(s)]


def test_every_mutating_call_is_busy_during_a_decode_round():
    s, prompt = world()
    calls = mutators(s, prompt)
    outcomes = {}

    def during():
        snapshot = state(s)
        for name, call in calls.items():
            try:
                call()
                outcomes[name] = "ran"
            except BusyError:
                outcomes[name] = "busy"
            except Exception as exc:  # pragma: no cover - would be a bug
                outcomes[name] = repr(exc)
        assert state(s) == snapshot  # nothing changed
        for read in readers(s, prompt):
            read()

    receipt, out = s.decode(Backend(during))
    assert receipt == (2, 1)
    assert outcomes == {name: "busy" for name in calls}
    invariants(s)
    # and afterwards every object is free again
    s.pool.release(s.pool.allocate())
    s.finish(3)


def test_a_refused_call_does_not_release_the_owner():
    s, prompt = world()
    seen = []

    def during():
        for call in (lambda: s.finish(1), lambda: s.pool.allocate(), lambda: s.finish(1),
                     lambda: s.requests.record_token(1), lambda: s.prefixes.evict_lru(s.pool)):
            try:
                call()
                seen.append("ran")
            except BusyError:
                seen.append("busy")

    s.decode(Backend(during))
    assert seen == ["busy"] * 5


def test_a_raw_round_owns_only_its_scheduler():
    pool, store = qualia.BlockPool(8), qualia.PrefixKvStore(2, 2)
    sched = qualia.RequestScheduler(2, 2)
    sched.admit_with_prefix(1, None, store, pool)
    sched.ensure_writable(1, 0, pool)
    sched.mark_prefill_complete(1)
    sched.seed_decode_token(1, 5)
    seen = []

    def during():
        page = pool.allocate()  # the round does not touch the pool: free
        pool.release(page)
        for call in (lambda: sched.record_token(1), lambda: sched.finish(1, pool),
                     lambda: sched.admit_with_prefix(2, None, store, pool)):
            try:
                call()
            except BusyError:
                seen.append("busy")

    assert sched.execute_decode_round(Backend(during), np.zeros(2, ITEM),
                                      np.zeros(2, np.uint32), np.zeros(2, OUTPUT)) == (1, 1)
    assert seen == ["busy"] * 3


def test_two_schedulers_do_not_share_ownership():
    a, prompt = world()
    b, _ = world()

    def during():
        b.finish(3)
        b.decode(qualia.HashBackend())

    a.decode(Backend(during))
    invariants(a)
    invariants(b)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, GeneratorExit])
def test_base_exceptions_in_a_backend_release_ownership(exc):
    s, prompt = world()
    before = state(s)

    def during():
        raise exc()

    with pytest.raises(exc):
        s.decode(Backend(during))
    assert state(s) == before
    s.decode(qualia.HashBackend())
    pool, store = qualia.BlockPool(8), qualia.PrefixKvStore(2, 2)
    sched = qualia.RequestScheduler(2, 2)
    sched.admit_with_prefix(1, None, store, pool)
    sched.mark_prefill_complete(1)
    sched.seed_decode_token(1, 5)
    with pytest.raises(exc):
        sched.execute_decode_round(Backend(during), np.zeros(2, ITEM), np.zeros(2, np.uint32),
                                   np.zeros(2, OUTPUT))
    assert sched.record_token(1) == 1


# -- user code in the RESOLVE phase runs before anything is owned or read --------------------------


class PropertyBackend(Backend):
    """execute_ragged and copy_pages are properties that mutate the scheduler when looked up."""

    def __init__(self, s, victim):
        super().__init__()
        self.s, self.victim, self.lookups = s, victim, []

    @property
    def execute_ragged(self):
        self.lookups.append("execute_ragged")
        self.s.finish(self.victim)
        self.s.admit(50)
        return super().execute_ragged

    @property
    def copy_pages(self):
        self.lookups.append("copy_pages")
        self.s.advance(50, 3)
        return super().copy_pages


def test_backend_properties_run_before_the_round_owns_anything():
    s, prompt = world()
    b = PropertyBackend(s, 2)
    receipt, out = s.decode(b)
    assert b.lookups == ["execute_ragged", "copy_pages"]
    assert out["request_id"].tolist() == [1]
    assert s.token_count(50) == 3
    invariants(s)


def test_a_callable_qualia_backend_attribute_runs_before_ownership():
    s, prompt = world()
    inner = qualia.HashBackend()

    class Lazy:
        def __qualia_backend__(self):
            s.finish(1)  # allowed: nothing is owned yet
            return inner.__qualia_backend__

    receipt, out = s.decode(Lazy())
    assert out["request_id"].tolist() == [2]
    invariants(s)


def test_prompt_iteration_runs_before_ownership():
    s, prompt = world()

    def prompt_gen():
        s.finish(2)  # runs while the prompt is converted: nothing is owned yet
        yield from prompt

    adm = s.admit(9, prompt_gen(), prefix_len=6)
    assert adm.prefix_hit
    assert 2 not in s.runnable()["request_id"].tolist()
    invariants(s)


# -- GC callbacks and finalizers -------------------------------------------------------------------


class GcHook:
    """A gc callback that, while armed, runs `action` once per collection (catching BusyError)."""

    def __init__(self, action):
        self.action, self.armed, self.outcomes = action, False, []

    def __call__(self, phase, info):
        if phase != "start" or not self.armed:
            return
        self.armed = False
        try:
            self.action()
            self.outcomes.append("ran")
        except BusyError:
            self.outcomes.append("busy")
        except QualiaError as exc:
            self.outcomes.append(type(exc).__name__)

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def test_gc_callback_during_a_round_gets_busy():
    s, prompt = world()
    hook = GcHook(lambda: s.finish(1))

    def during():
        hook.armed = True
        gc.collect()

    with hook:
        before_rounds = s.stats()["decode_rounds"]
        s.decode(Backend(during))
    assert hook.outcomes == ["busy"]
    assert s.stats()["decode_rounds"] == before_rounds + 1
    assert 1 in invariants(s)


def test_weakref_finalizer_during_a_round_gets_busy():
    s, prompt = world()
    outcomes = []

    def finalizer():
        for call in (lambda: s.finish(2), lambda: s.admit(40), lambda: s.evict_lru()):
            try:
                call()
                outcomes.append("ran")
            except BusyError:
                outcomes.append("busy")

    def during():
        class Node:
            pass

        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle: only the collector frees it
        weakref.finalize(a, finalizer)
        del a, b
        gc.collect()

    s.decode(Backend(during))
    assert outcomes == ["busy", "busy", "busy"]
    invariants(s)


def test_gc_callbacks_at_every_allocation_keep_the_state_exact():
    """With the collector running at (nearly) every allocation, a callback that finishes,
    admits, reserves and decodes fires inside every kind of call; each either runs in full or
    gets BusyError, and the page accounting stays exact."""
    s, prompt = world()
    rng = np.random.default_rng(7)
    counter = [100]

    def action():
        k = int(rng.integers(0, 4))
        if k == 0:
            rids = s.runnable()["request_id"].tolist()
            if rids:
                s.finish(rids[0])
        elif k == 1:
            counter[0] += 1
            s.admit(counter[0], prompt, prefix_len=6)
        elif k == 2:
            s.decode(qualia.HashBackend())
        else:
            for rid in s.runnable()["request_id"].tolist():
                s.reserve(rid, 1)

    hook = GcHook(action)
    old = gc.get_threshold()
    try:
        with hook:
            gc.set_threshold(1, 1, 1)
            for step in range(150):
                hook.armed = True
                try:
                    k = step % 5
                    if k == 0:
                        s.decode(Backend())
                    elif k == 1:
                        counter[0] += 1
                        s.admit(counter[0], list(prompt), prefix_len=6)
                    elif k == 2:
                        s.publish_prefix(1, prompt, prefix_len=9)
                    elif k == 3:
                        s.decode(qualia.HashBackend())
                    else:
                        rids = s.runnable()["request_id"].tolist()
                        if len(rids) > 3:
                            s.finish(rids[-1])
                except (QualiaError, ValueError):
                    pass
                hook.armed = False
                invariants(s)
    finally:
        gc.set_threshold(*old)
    assert "ran" in hook.outcomes


# -- threads ---------------------------------------------------------------------------------------


class YieldingBackend(Backend):
    """A Python backend that lets other threads run (GIL released) while it owns the round."""

    def execute_ragged(self, items, block_table, outputs):
        time.sleep(0)
        return super().execute_ragged(items, block_table, outputs)

    def copy_pages(self, copies):
        time.sleep(0)


def test_threads_racing_on_one_scheduler():
    """Two decoders (a yielding Python backend and the C backend, which runs without the GIL)
    and two churners (admit with a prefix, reserve, advance, publish, finish, evict) on one
    scheduler: every call runs in full or raises a clean error, and the accounting is exact."""
    s = qualia.Scheduler(max_requests=8, num_blocks=640, page_tokens=4, logical_pages=64,
                         prefix_caching="explicit")
    prompt = list(range(1, 13))
    errors = []
    admitted, decoded, busy, unseeded = [], [], [], []  # list.append is atomic; += is not
    barrier = threading.Barrier(4, timeout=WAIT)

    def retry(call):
        while True:
            try:
                return call()
            except BusyError:
                busy.append(1)
                time.sleep(0)

    def decoder(backend):
        barrier.wait()
        mine = 0
        deadline = time.monotonic() + WAIT
        attempts = 0
        # at least 100 attempts, and go on until this decoder has run a round of its own: under
        # a slow (debug, sanitizer) build the churners can hold the scheduler for all 100
        while (attempts < 100 or not mine) and time.monotonic() < deadline:
            attempts += 1
            try:
                s.decode(backend)
                decoded.append(type(backend).__name__)
                mine += 1
            except BusyError:
                busy.append(1)
            except qualia.DecodeRoundError.MissingInputToken:
                # a prefix-hit admission starts in Decode with no input token until its
                # complete_prefill: a round in that window fails cleanly (the seed's rule)
                unseeded.append(1)
            except Exception as exc:  # pragma: no cover - would be a bug
                errors.append(exc)

    def churner(base):
        barrier.wait()
        for i in range(60):
            rid = base + i
            try:
                retry(lambda: s.admit(rid, prompt, prefix_len=8))
                retry(lambda: s.reserve(rid, 12))
                retry(lambda: s.advance(rid, 12))
                retry(lambda: s.complete_prefill(rid, 1))
                try:
                    retry(lambda: s.publish_prefix(rid, prompt, prefix_len=8))
                except qualia.PrefixKvError.Duplicate:
                    pass
                if i:
                    retry(lambda: s.finish(rid - 1))
                if i % 7 == 0:
                    retry(lambda: s.evict_unused_lru())
                admitted.append(rid)
            except Exception as exc:  # pragma: no cover - would be a bug
                errors.append(exc)

    threads = [threading.Thread(target=decoder, args=(YieldingBackend(),)),
               threading.Thread(target=decoder, args=(qualia.HashBackend(),)),
               threading.Thread(target=churner, args=(1000,)),
               threading.Thread(target=churner, args=(2000,))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * WAIT)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert len(admitted) == 120
    assert set(decoded) == {"YieldingBackend", "HashBackend"}  # each decoder ran a round
    rids = invariants(s)
    assert sorted(rids) == [1059, 2059]
    for rid in rids:
        s.finish(rid)
    while s.evict_lru() is not None:
        pass
    assert s.free_pages == s.num_blocks


def test_concurrent_identities_without_the_scheduler():
    """identity_for reads no scheduler state and shares no scratch: it works from any thread,
    even while a round owns the scheduler."""
    s, prompt = world()
    prompts = [list(range(k, k + 3000)) for k in (0, 10**6)]
    s2 = qualia.Scheduler(max_requests=2, num_blocks=8, page_tokens=1000, logical_pages=3,
                          prefix_caching="explicit")
    expected = [qualia.PrefixIdentity.of_tokens(p) for p in prompts]
    wrong = []

    def work(k):
        for _ in range(40):
            if s2.identity_for(prompts[k]) != expected[k]:
                wrong.append(k)

    def during():
        work(0)

    t = threading.Thread(target=work, args=(1,))
    t.start()
    s.decode(YieldingBackend(during))
    t.join(WAIT)
    assert not t.is_alive() and not wrong
