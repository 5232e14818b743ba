"""Copy-on-write forks (DESIGN.md "Forks"): the child shares every page of a decoding parent,
the first write into a shared page copies it, finish releases one member's references, and every
refused fork changes nothing.  Run against the compiled core and the pure-Python twins."""

from __future__ import annotations

import numpy as np
import pytest

import qualia
from qualia import twin
from qualia.errors import SchedulerError, TableError
from qualia.twin import cache as twin_cache

FACADES = [qualia.Scheduler, twin_cache.Scheduler]
SEEDS = [qualia, twin]


class CopyingBackend(twin.PyHashBackend):
    def __init__(self):
        super().__init__()
        self.copied = []

    def copy_pages(self, copies):
        self.copied.extend(copies.tolist())
        return super().copy_pages(copies)


def decoding(S, prompt_len=10, page_tokens=4, rid=1, **kw):
    s = S(4, 32, page_tokens, 8, **kw)
    s.admit(rid, list(range(prompt_len)))
    s.reserve(rid, prompt_len)
    s.advance(rid, prompt_len)
    s.complete_prefill(rid, 99)
    return s


def pending(s, rid):
    if hasattr(s, "requests"):
        return s.requests.pending_token(rid)
    slot = s._slots[s._find(rid)]
    return slot.next_token_id if slot.token_ready else None


def refs(s):
    return np.array([s.pool.refcount(p) for p in range(s.num_pages)])


def snapshot(s):
    rids = s.runnable()["request_id"].tolist()
    return (refs(s).tolist(), s.pool.free_count, s.free_pages,
            s.runnable().tolist(), [s.block_table(r).tolist() for r in rids],
            s.reclaimable_pages().tolist(), s.cache_stats())


@pytest.mark.parametrize("S", FACADES)
def test_fork_shares_every_page_and_the_token_state(S):
    s = decoding(S)
    before = refs(s)
    table = s.block_table(1).tolist()
    assert len(table) == 3                      # 10 tokens in 4-token pages: last one partial
    free = s.pool.free_count
    slot = s.fork(1, 2)
    assert slot == 1
    assert s.block_table(2).tolist() == table
    assert s.pool.free_count == free            # no page allocated, none copied
    for p in table:
        assert s.pool.refcount(p) == before[p] + 1
    assert s.token_count(2) == s.token_count(1) == 10
    assert pending(s, 2) == 99
    assert s.runnable().tolist()[1][2] == qualia.RequestState.DECODE


@pytest.mark.parametrize("S", FACADES)
def test_decode_copies_the_shared_last_page_once(S):
    s = decoding(S)
    s.fork(1, 2)
    last = s.block_table(1).tolist()[-1]
    backend = CopyingBackend()
    receipt, out = s.decode(backend)
    assert receipt.batch_size == 2
    # the parent (lower slot) copies the shared page; the child is then its only holder
    assert len(backend.copied) == 1
    src, dst = backend.copied[0]
    assert src == last and s.block_table(1).tolist()[-1] == dst
    assert s.block_table(2).tolist()[-1] == last
    assert s.pool.refcount(last) == 1 and s.pool.refcount(dst) == 1
    if hasattr(s, "stats"):
        assert s.stats()["pages_copied"] == 1
    # the next round writes both in place
    s.decode(backend)
    assert len(backend.copied) == 1


@pytest.mark.parametrize("S", FACADES)
def test_fork_at_a_page_boundary_copies_nothing(S):
    s = decoding(S, prompt_len=8)
    s.fork(1, 2)
    backend = CopyingBackend()
    s.decode(backend)
    assert backend.copied == []
    assert s.block_table(1).tolist()[:2] == s.block_table(2).tolist()[:2]
    assert s.block_table(1).tolist()[2] != s.block_table(2).tolist()[2]


@pytest.mark.parametrize("S", FACADES)
def test_reserve_into_a_shared_page_copies_it(S):
    s = decoding(S)
    s.fork(1, 2)
    last = s.block_table(2).tolist()[-1]
    copies = s.reserve(2, 1)
    assert copies.tolist() == [(last, s.block_table(2).tolist()[-1])]
    assert s.block_table(1).tolist()[-1] == last and s.pool.refcount(last) == 1


@pytest.mark.parametrize("S,mode", [(qualia.Scheduler, "auto"), (qualia.Scheduler, "explicit"),
                                    (qualia.Scheduler, "off"), (twin_cache.Scheduler, "auto")],
                         ids=["core-auto", "core-explicit", "core-off", "twin-auto"])
def test_page_counters_count_a_copy_as_a_copy_and_a_fresh_page_as_an_allocation(S, mode):
    def pages():
        return s.stats()["pages_allocated"], s.stats()["pages_copied"]

    s = decoding(S, prefix_caching=mode)             # 10 tokens: pages 0, 1, 2 (2 partly filled)
    assert pages() == (3, 0)
    s.fork(1, 2)
    s.decode(CopyingBackend())                        # both write page 2: one copy, no fresh page
    assert pages() == (3, 1) and s.stats()["decode_rounds"] == 1
    s.fork(1, 3)                                      # 11 tokens: page 2 shared again
    assert len(s.reserve(3, 1)) == 1                  # one copy
    assert pages() == (3, 2)
    s.reserve(3, 2)                                   # positions 11, 12: one fresh page
    assert pages() == (4, 2)
    s.decode(CopyingBackend())                        # 1 and 2 write page 2 alone: nothing
    assert pages() == (4, 2) and s.stats()["decode_rounds"] == 2


@pytest.mark.parametrize("S", FACADES)
def test_finish_releases_only_its_own_references(S):
    s = decoding(S)
    s.fork(1, 2)
    s.fork(1, 3)
    counts = refs(s)
    s.finish(1)
    table = s.block_table(2).tolist()
    assert (refs(s)[table] == counts[table] - 1).all()
    s.decode(CopyingBackend())
    s.finish(2)
    s.finish(3)
    s.clear_cache()
    assert s.pool.free_count == s.num_pages


@pytest.mark.parametrize("S", FACADES)
def test_child_stream_continues_into_the_cache(S):
    # the child's decoded tokens fill its pages, which go to the cache under its own stream:
    # a later prompt of exactly that stream hits them
    s = decoding(S, prompt_len=10)
    s.fork(1, 2)
    stream = list(range(10))
    token = 99
    for _ in range(6):
        _, out = s.decode(CopyingBackend())
        stream.append(token)
        token = int(out["next_token_id"][1])
    assert s.token_count(2) == 16
    hit = s.cached_prefix_tokens(stream + [1])
    assert hit == 16


@pytest.mark.parametrize("S", FACADES)
@pytest.mark.parametrize("case", ["unknown", "prefill", "duplicate", "self", "full"])
def test_refused_fork_changes_nothing(S, case):
    s = decoding(S)
    s.admit(5, [1, 2, 3])
    if case == "full":
        s.fork(1, 6)
        s.fork(1, 7)
    before = snapshot(s)
    parent, child, err = {
        "unknown": (42, 9, SchedulerError.UnknownRequest),
        "prefill": (5, 9, SchedulerError.ForkInPrefill),
        "duplicate": (1, 5, SchedulerError.DuplicateRequest),
        "self": (1, 1, SchedulerError.DuplicateRequest),
        "full": (1, 9, SchedulerError.Full),
    }[case]
    with pytest.raises(err):
        s.fork(parent, child)
    assert snapshot(s) == before


@pytest.mark.parametrize("S", FACADES)
@pytest.mark.parametrize("bad", [-1, 2**64, 1.5, None, "1"])
def test_bad_ids_are_type_or_overflow_errors(S, bad):
    s = decoding(S)
    before = snapshot(s)
    for call in (lambda: s.fork(bad, 2), lambda: s.fork(1, bad)):
        with pytest.raises((TypeError, OverflowError)):
            call()
    assert snapshot(s) == before


@pytest.mark.parametrize("m", SEEDS)
def test_seed_fork_and_overflow(m):
    pool = m.BlockPool(8)
    store = m.PrefixKvStore(1, 2)
    sched = m.RequestScheduler(3, 4)
    sched.admit_with_prefix(1, None, store, pool)
    sched.ensure_writable(1, 0, pool)
    sched.ensure_writable(1, 1, pool)
    sched.record_token(1)
    sched.mark_prefill_complete(1)
    sched.seed_decode_token(1, 7)
    assert sched.fork(1, 2, pool) == 1
    assert sched.block_table(2) == sched.block_table(1) == [0, 1]
    assert sched.pending_token(2) == 7
    assert [pool.refcount(p) for p in (0, 1)] == [2, 2]
    assert sched.ensure_writable(2, 1, pool).kind == "copy"
    assert [pool.refcount(p) for p in (0, 1, 2)] == [2, 1, 1]
    # a page whose count would overflow: nothing retained
    pool._debug_set_refcount(1, 2**32 - 1)
    counts = [pool.refcount(p) for p in range(8)]
    with pytest.raises(SchedulerError.Table) as info:
        sched.fork(1, 3, pool)
    assert type(info.value.cause) is TableError.Overflow
    assert [pool.refcount(p) for p in range(8)] == counts
    assert sched.active_count() == 2


def test_compiled_fork_matches_its_twin_step_by_step():
    worlds = [decoding(S) for S in FACADES]
    for step in range(12):
        for s in worlds:
            if step == 0:
                s.fork(1, 2)
            if step == 3:
                s.fork(2, 3)
            if step == 7:
                s.finish(1)
            if step == 9:
                s.fork(3, 4)
        outs = [s.decode(CopyingBackend())[1].tolist() for s in worlds]
        assert outs[0] == outs[1]
        assert snapshot(worlds[0]) == snapshot(worlds[1])
    assert np.array_equal(worlds[0].block_table(4), worlds[1].block_table(4))


def test_fork_from_inside_a_round_is_busy_and_changes_nothing():
    s = decoding(qualia.Scheduler)
    seen = []

    class Reentrant(CopyingBackend):
        def execute_ragged(self, items, block_table, outputs):
            try:
                s.fork(1, 9)
            except qualia.BusyError as exc:
                seen.append(exc)
            return super().execute_ragged(items, block_table, outputs)

    s.decode(Reentrant())
    assert len(seen) == 1 and s.active_count == 1
    assert s.stats()["pages_copied"] == 0


@pytest.mark.parametrize("S", FACADES)
@pytest.mark.parametrize("reclaimable", [False, True])
def test_a_round_counts_a_page_shared_by_k_writers_as_k_minus_1_copies(S, reclaimable):
    # 4 members share the partly filled page 2: the round copies it 3 times (the last holder
    # writes in place), so 3 pages are enough, free or reclaimable
    s = S(4, 6, 4, 8)
    if reclaimable:
        s.admit(9, [50, 51, 52, 53, 54])
        s.reserve(9, 5)
        s.advance(9, 5)
        s.finish(9)                               # its full page stays cached, reclaimable
        assert len(s.reclaimable_pages()) == 1
    s.admit(1, list(range(10)))
    s.reserve(1, 10)
    s.advance(1, 10)
    s.complete_prefill(1, 99)
    for c in (2, 3, 4):
        s.fork(1, c)
    assert s.free_pages == 3
    backend = CopyingBackend()
    receipt, _ = s.decode(backend)
    assert receipt.batch_size == 4 and len(backend.copied) == 3
    assert s.free_pages == 0
    assert len({int(s.block_table(r)[2]) for r in (1, 2, 3, 4)}) == 4
