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
from helpers.facade_checks import invariants  # noqa: E402

import qualia  # a core that is not built fails the import: never a silent skip
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
    s = qualia.Scheduler(max_requests=6, num_pages=48, page_tokens=4, logical_pages=6,
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
    s = qualia.Scheduler(max_requests=8, num_pages=640, page_tokens=4, logical_pages=64,
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
    assert s.free_pages == s.num_pages


def test_concurrent_identities_without_the_scheduler():
    """identity_for reads no scheduler state and shares no scratch: it works from any thread,
    even while a round owns the scheduler."""
    s, prompt = world()
    prompts = [list(range(k, k + 3000)) for k in (0, 10**6)]
    s2 = qualia.Scheduler(max_requests=2, num_pages=8, page_tokens=1000, logical_pages=3,
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


# -- the GIL-free loop of run() and other threads (docs/DESIGN.md, "Concurrency") ----------------

_KEEP = []


def gil_free_backend(during):
    """A C step backend over a ctypes callback: run() calls it inside its GIL-free section (the
    loop is paused in execute_step; ctypes takes the GIL to run Python), ``during(plan)`` runs,
    then every sampled row gets token 5."""
    import ctypes

    from helpers.ctypes_abi import EXECUTE_STEP, CStepBackend

    @EXECUTE_STEP
    def execute(ctx, plan, out, logprobs):
        during(plan.contents)
        arr = (ctypes.c_uint32 * max(plan.contents.num_sampled, 1)).from_address(out)
        for i in range(plan.contents.num_sampled):
            arr[i] = 5
        return 0

    iface = CStepBackend(qualia.STEP_ABI_VERSION, ctypes.sizeof(CStepBackend), 0, 0, None,
                         ctypes.cast(execute, ctypes.c_void_p), None)
    name = qualia.STEP_CAPSULE_NAME.encode()
    _KEEP.append((iface, execute, name))    # the capsule holds raw pointers into these
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(ctypes.addressof(iface), name, None)


def step_world(**kw):
    s = qualia.StepScheduler(num_pages=64, page_tokens=4, logical_pages=8, max_num_seqs=4,
                             cache_key=b"t" * 16, **kw)
    shared = list(range(1, 13))
    s.add_request(1, shared + [20], max_new_tokens=6)
    s.run(qualia.HashBackend())             # pages of `shared` are cached now
    s.add_request(2, shared + [21], max_new_tokens=6)
    s.add_request(3, [7, 8, 9, 10, 11], max_new_tokens=3, n=2)
    return s, shared


def step_reads(s, shared):
    """Every read of a StepScheduler and of the pool it lends, by name: under the contract each
    raises BusyError while a GIL-free section runs."""
    return {
        "stats": lambda: s.stats(),
        "active_count": lambda: s.active_count,
        "free_pages": lambda: s.free_pages,
        "cached_prefix": lambda: s.cached_prefix(shared + [1]),
        "cached_prefix_tokens": lambda: s.cached_prefix_tokens(shared + [1]),
        "cache_stats": lambda: s.cache_stats(),
        "reclaimable_pages": lambda: s.reclaimable_pages(),
        "cache_entry": lambda: s.cache_entry(0),
        "_debug_namespaces": lambda: s._debug_namespaces(),
        "num_waiting": lambda: s.num_waiting,
        "num_running": lambda: s.num_running,
        "has_unfinished": lambda: s.has_unfinished(),
        "request_tokens": lambda: s.request_tokens(2),
        "request_pages": lambda: s.request_pages(2),
        "group_members": lambda: s.group_members(3),
        "forks": lambda: s.forks,
        "fork_fallbacks": lambda: s.fork_fallbacks,
        "parked": lambda: s.parked,
        "requests": lambda: s.requests(),
        "pool.free_count": lambda: s.pool.free_count,
        "pool.refcount": lambda: s.pool.refcount(0),
        "pool.refcounts": lambda: s.pool.refcounts(),
    }


def step_calls_that_work(s, shared):
    """What works while a GIL-free section runs: the KV events (a single-producer,
    single-consumer ring), what reads no state the loop changes, and repr."""
    return {
        "drain_events": lambda: s.drain_events(),
        "drain_events_out": lambda: s.drain_events(np.zeros(4, qualia.KV_EVENT)),
        "page_identities": lambda: s.page_identities(shared),
        "num_pages": lambda: s.num_pages,
        "logical_pages": lambda: s.logical_pages,
        "page_tokens": lambda: s.page_tokens,
        "prefix_caching": lambda: s.prefix_caching,
        "max_num_batched_tokens": lambda: s.max_num_batched_tokens,
        "max_num_seqs": lambda: s.max_num_seqs,
        "max_queued": lambda: s.max_queued,
        "max_prefill_chunk": lambda: s.max_prefill_chunk,
        "vocab_size": lambda: s.vocab_size,
        "pool.num_blocks": lambda: s.pool.num_blocks,
        "repr": lambda: (repr(s), repr(s.pool)),
    }


def outcome(call):
    try:
        call()
        return "ran"
    except BusyError:
        return "busy"
    except Exception as exc:  # noqa: BLE001 - reported in the assertion
        return repr(exc)


def run_record(s, backend):
    """run() to the end; what it returned, the events and the state it left (for replays)."""
    r = s.run(backend)
    events = s.drain_events()
    return ([(f.request_id, [t.tolist() for t in f.outputs] if hasattr(f, "outputs")
              else f.output_tokens.tolist()) for f in r.finished],
            r.stats.tobytes(), events.tobytes(), s.cache_stats(), s.stats(),
            s.pool.refcounts().tolist(), s.reclaimable_pages().tolist())


def test_every_read_is_busy_inside_the_gil_free_loop_and_changes_nothing():
    """A C step backend calling back into the scheduler from inside run()'s GIL-free section:
    every read of the scheduler and of its pool raises BusyError (the loop owns the
    state); the event ring, reads of no loop state, and repr keep working; the run is the run
    without the calls."""
    s, shared = step_world()
    seen = {}

    def during(plan):
        if seen:
            return
        for name, call in step_reads(s, shared).items():
            seen[name] = outcome(call)
        for name, call in step_calls_that_work(s, shared).items():
            seen[name] = outcome(call)
        for name, call in {"add_request": lambda: s.add_request(9, [1], max_new_tokens=1),
                           "abort": lambda: s.abort(2), "schedule": lambda: s.schedule(),
                           "discard_plan": lambda: s.discard_plan(),
                           "clear_cache": lambda: s.clear_cache()}.items():
            seen[name] = outcome(call)

    s.drain_events()
    got = run_record(s, gil_free_backend(during))
    want_busy = set(step_reads(s, shared)) | {"add_request", "abort", "schedule", "discard_plan",
                                               "clear_cache"}
    assert seen == {name: "busy" if name in want_busy else "ran" for name in seen}
    replay, _ = step_world()
    replay.drain_events()
    assert got == run_record(replay, gil_free_backend(lambda plan: None))
    # and afterwards every read works again
    for call in step_reads(s, shared).values():
        try:
            call()
        except (qualia.StepError.UnknownRequest, qualia.SchedulerError.UnknownRequest,
                qualia.PrefixKvError.Unknown):
            pass


def test_another_thread_gets_busy_from_every_read_while_the_loop_runs():
    """The loop paused inside its GIL-free section hands the GIL to a second thread: every read
    there raises BusyError, drain_events works."""
    s, shared = step_world()
    inside, done = threading.Event(), threading.Event()
    seen = {}

    def reader():
        assert inside.wait(WAIT)
        for name, call in step_reads(s, shared).items():
            seen[name] = outcome(call)
        seen["drain_events"] = outcome(lambda: s.drain_events())
        done.set()

    def during(plan):
        if not inside.is_set():
            inside.set()
            assert done.wait(WAIT)      # releases the GIL: the reader runs now

    t = threading.Thread(target=reader)
    t.start()
    s.run(gil_free_backend(during))
    t.join(WAIT)
    assert not t.is_alive()
    assert seen == {**{name: "busy" for name in step_reads(s, shared)}, "drain_events": "ran"}


def test_reads_from_a_python_backend_mid_step_see_the_state_and_change_nothing():
    """A Python backend runs with the GIL while run() owns the scheduler and the state stands
    still: reads work there (cached_prefix included) and the run equals the run without them."""
    s, shared = step_world()
    seen = []

    class Reader:
        def execute_step(self, plan):
            rids = plan.request_ids.tolist()
            seen.append((s.num_running, s.cached_prefix(shared + [1]).tokens,
                         {r: len(s.request_tokens(r)) for r in rids if r in (1, 2)},
                         s.stats()["active"], s.active_count))
            for call in step_reads(s, shared).values():
                try:
                    call()
                except (qualia.StepError.UnknownRequest, qualia.SchedulerError.UnknownRequest,
                        qualia.PrefixKvError.Unknown):
                    pass
            return np.full(len(plan.logits_indices), 5, np.uint32)

    class Plain:
        def execute_step(self, plan):
            return np.full(len(plan.logits_indices), 5, np.uint32)

    got = run_record(s, Reader())
    replay, _ = step_world()
    assert got == run_record(replay, Plain())
    assert seen and all(active == running for running, _, _, active, _ in seen)
    assert all(hit == 12 for _, hit, _, _, _ in seen)


def replayable_runs(s, base, rounds):
    """`rounds` workloads of requests sharing a long cached prefix (each admission sizes a
    cache hit) near the table's end, each run to the end by run(HashBackend())."""
    out = []
    L = s.page_tokens * s.logical_pages
    for k in range(rounds):
        for i in range(16):
            s.add_request(base + 100 * k + i, list(range(1, L - s.page_tokens - 1)) + [1000 + i],
                          max_new_tokens=1 + i % 2)
        r = s.run(qualia.HashBackend())
        out.append(sorted((f.request_id, f.output_tokens.tolist()) for f in r.finished))
    return out


def test_cached_prefix_racing_the_gil_free_loop_never_half_admits():
    """A thread hammering cached_prefix (and other reads) while run(HashBackend()) admits
    requests with cache hits: each read runs in full or raises BusyError, no run fails, and
    every run, the events and the state equal a single-threaded replay."""
    def make():
        return qualia.StepScheduler(600, 4, 64, 8, cache_key=b"r" * 16, max_num_batched_tokens=1024)

    s = make()
    probe = list(range(5000, 5256))
    stop = threading.Event()
    counts = {"ran": 0, "busy": 0}
    errors = []

    def hammer():
        while not stop.is_set():
            for call in (lambda: s.cached_prefix(probe), lambda: s.cached_prefix(probe),
                         lambda: s.cached_prefix_tokens(probe), lambda: s.stats()):
                try:
                    call()
                    counts["ran"] += 1
                except BusyError:
                    counts["busy"] += 1
                except Exception as exc:  # pragma: no cover - would be a bug
                    errors.append(exc)

    t = threading.Thread(target=hammer)
    t.start()
    try:
        got = replayable_runs(s, 0, 150)
    finally:
        stop.set()
        t.join(WAIT)
    assert not errors, errors[:3]
    replay = make()
    assert got == replayable_runs(replay, 0, 150)
    assert s.drain_events().tobytes() == replay.drain_events().tobytes()
    assert s.cache_stats() == replay.cache_stats()
    assert s.pool.refcounts().tolist() == replay.pool.refcounts().tolist()
    assert counts["busy"] > 0      # the hammer met the loop


def test_a_router_thread_draining_events_during_run_gets_every_event_once_in_order():
    """drain_events in a router thread while run(HashBackend()) fills the ring without the GIL:
    the concatenated drains equal the events of a single-threaded replay (none lost,
    duplicated or made up), and nothing is dropped while the ring has room."""
    def make():
        return qualia.StepScheduler(96, 2, 16, 8, cache_key=b"e" * 16, max_num_batched_tokens=64,
                                    max_queued=512, event_capacity=1 << 16)

    def workload(s):
        rng = np.random.default_rng(7)
        for i in range(400):
            prompt = rng.integers(0, 40, size=int(rng.integers(2, 24))).tolist()
            s.add_request(i, prompt, max_new_tokens=int(rng.integers(1, 8)))

    s = make()
    workload(s)
    stop = threading.Event()
    drained = []
    buf = np.zeros(7, qualia.KV_EVENT)
    prompt = list(range(30))
    idents = s.page_identities(prompt).tolist()
    wrong = []

    def router():
        k = 0
        while not stop.is_set():
            k += 1
            if s.page_identities(prompt).tolist() != idents:    # reads only the cache key
                wrong.append(k)
            if k % 2:
                drained.append(s.drain_events().copy())
            else:
                n = s.drain_events(buf)
                drained.append(buf[:n].copy())

    t = threading.Thread(target=router)
    t.start()
    try:
        s.run(qualia.HashBackend())
    finally:
        stop.set()
        t.join(WAIT)
    drained.append(s.drain_events())
    got = np.concatenate(drained)
    replay = make()
    workload(replay)
    replay.run(qualia.HashBackend())
    want = replay.drain_events()
    assert len(want) > 1000 and s.cache_stats().events_dropped == 0 and not wrong
    assert (got["kind"] != 0).all()
    assert got.tolist() == want.tolist()    # by field: concatenate leaves the padding as is
