"""Automatic prefix caching, one test per rule (docs/DESIGN.md, "Automatic prefix caching").

Every test runs against the compiled core and the pure-Python twin (``qualia.twin.cache``).
"""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

import qualia
from qualia.errors import PrefixCacheError, SchedulerError, TableError
from qualia.twin import PyHashBackend
from qualia.twin import cache as twin_cache

KEY = bytes(range(16))
PT = 4


@pytest.fixture(params=["core", "twin"])
def make(request):
    cls = qualia.Scheduler if request.param == "core" else twin_cache.Scheduler

    def build(max_requests=4, num_pages=32, page_tokens=PT, logical_pages=16, **kw):
        kw.setdefault("cache_key", KEY)
        return cls(max_requests, num_pages, page_tokens, logical_pages, **kw)
    build.kind = request.param
    return build


def prefill(s, rid, prompt, first=0):
    """Compute the rest of the prompt (reserve + advance) and seed the first decode token."""
    rest = len(prompt) - s.token_count(rid)
    s.reserve(rid, rest)
    s.advance(rid, rest)
    s.complete_prefill(rid, first)


def serve(s, rid, prompt, rounds=0, namespace=b"", finish=True):
    """One turn: admit, prefill, decode, finish; returns (admission, whole token stream)."""
    adm = s.admit(rid, prompt, namespace=namespace)
    prefill(s, rid, prompt, first=1000 + rid)
    stream = list(prompt)
    token = 1000 + rid
    backend = PyHashBackend()
    for _ in range(rounds):
        _, out = s.decode(backend)
        stream.append(token)
        token = int(out["next_token_id"][list(out["request_id"]).index(rid)])
    if finish:
        s.finish(rid)
    return adm, stream


def events(s):
    return [tuple(e) for e in s.drain_events().tolist()]


def state(s):
    rids = s.runnable()["request_id"].tolist()
    refs = (s.pool.refcounts().tolist() if hasattr(s.pool, "refcounts")
            else list(s.pool._refcounts))
    return (refs, s.pool.free_count, s.free_pages, s.reclaimable_pages().tolist(),
            tuple(s.cache_entry(p) for p in range(s.num_pages)), s.runnable().tolist(),
            tuple(s.block_table(r).tolist() for r in rids), s.cache_stats())


PROMPT = list(range(1, 4 * PT + 2))   # 4 full pages and one token


# -- hits -----------------------------------------------------------------------------------------

def test_longest_prefix_is_shared_and_counted(make):
    s = make()
    adm, _ = serve(s, 1, PROMPT)
    assert (adm.prefix_hit, adm.prefix_tokens) == (False, 0)
    first_pages = None
    adm = s.admit(2, PROMPT[:3 * PT] + [99, 98, 97, 96, 95])
    assert (adm.prefix_hit, adm.prefix_tokens) == (True, 3 * PT)
    first_pages = s.block_table(2).tolist()
    assert len(first_pages) == 3
    for p in first_pages:
        assert s.cache_entry(p) is not None and not s.cache_entry(p).reclaimable
    st = s.cache_stats()
    assert (st.lookups, st.lookup_tokens, st.hit_tokens) == (2, len(PROMPT) + 3 * PT + 5, 3 * PT)
    assert st.hit_rate == st.hit_tokens / st.lookup_tokens
    assert s.token_count(2) == 3 * PT
    assert s.runnable()["state"].tolist() == [int(qualia.RequestState.PREFILL)]


def test_cached_prefix_tokens_predicts_the_admission_and_changes_nothing(make):
    s = make()
    serve(s, 1, PROMPT, namespace="a")
    probe = PROMPT[:3 * PT] + [99, 98]
    before = state(s)
    assert s.cached_prefix_tokens(probe, "a") == 3 * PT
    assert s.cached_prefix_tokens(probe) == 0
    assert s.cached_prefix_tokens(probe, "unknown") == 0
    assert s.cached_prefix(probe, "a") == (3 * PT, 3, 3)     # all three pages reclaimable
    assert state(s) == before
    assert s.admit(2, probe, namespace="a").prefix_tokens == 3 * PT
    assert s.cached_prefix(probe, "a") == (3 * PT, 3, 0)     # request 2 holds them now


def test_at_least_one_token_is_left_to_compute(make):
    s = make()
    exact = PROMPT[:4 * PT]                      # exactly four full pages, all cached below
    serve(s, 1, exact + [5, 5, 5, 5, 5])
    adm = s.admit(2, exact)
    assert adm.prefix_tokens == 3 * PT           # the last page is recomputed
    prefill(s, 2, exact)
    # the recomputed last page fills: an identical verified entry exists, so it is not cached
    assert s.cache_stats().duplicates == 1
    assert s.cache_entry(s.block_table(2).tolist()[3]) is None
    s.finish(2)
    assert s.admit(3, [1]).prefix_tokens == 0
    assert s.admit(4, []).prefix_tokens == 0


def test_verified_hits_reject_forced_collisions(make):
    s = make()
    s._debug_identity_mask(0)                     # every page of every prompt has identity 0
    serve(s, 1, PROMPT)
    assert s.cache_stats().cached_pages == 1      # page 1 collides with page 0: not cached
    assert s.cache_stats().collisions == 1
    other = [p + 100 for p in PROMPT]
    adm = s.admit(2, other)
    assert adm.prefix_tokens == 0                 # the identity matches, the tokens do not
    assert s.cache_stats().collisions == 2
    prefill(s, 2, other)
    assert s.cache_stats().collisions == 3        # its first page is not inserted either
    assert s.cache_stats().cached_pages == 1
    s.finish(2)
    assert s.admit(3, PROMPT).prefix_tokens == PT  # the genuine page still hits


def test_a_removal_from_the_index_leaves_the_entry_after_it_at_its_home(make):
    # identities narrowed to one bit: a first page of identity 0 sits at index slot 0 and one of
    # identity 1 at slot 1, its home, right after it.  Reclaiming the first shifts the cluster
    # behind it back; an entry at its home stays there, where a lookup starts
    s = make(max_requests=3, num_pages=3, logical_pages=2)
    s._debug_identity_mask(1)
    by_identity = {}
    t = 0
    while len(by_identity) < 2:
        page = [t, t + 1, t + 2, t + 3]
        by_identity.setdefault(int(s.page_identities(page)[0]), page)
        t += 4
    first, second = by_identity[0] + [7], by_identity[1] + [7]
    serve(s, 1, first)
    serve(s, 2, second)                           # both cached, "first" least recently used
    assert s.cached_prefix_tokens(first) == s.cached_prefix_tokens(second) == PT
    s.admit(3, [9])
    prefill(s, 3, [9])                            # the free page
    s.admit(4, [8])
    prefill(s, 4, [8])                            # no page free: "first" is reclaimed
    assert s.cache_stats().reclaims == 1
    assert s.cached_prefix_tokens(first) == 0
    assert s.cached_prefix_tokens(second) == PT


def test_the_parent_entry_is_verified(make):
    s = make()
    s._debug_identity_mask(2**64 - 1, parent_mask=0)   # identities ignore the parent
    x, y, z = [1] * PT, [2] * PT, [9] * PT
    serve(s, 1, x + y + [3])                 # caches x (page 0) and y under x (page 1)
    assert s.cache_stats().cached_pages == 2
    adm, _ = serve(s, 2, z + y + [3])        # z is cached; y's identity collides with x+y's
    assert adm.prefix_tokens == 0
    assert s.cache_stats().collisions == 1   # y under z was rejected: another parent
    assert s.cache_stats().cached_pages == 3
    adm = s.admit(3, z + y + [3])
    assert adm.prefix_tokens == PT           # z hits; y under z is refused again
    assert s.cache_stats().collisions == 2


def test_the_parent_generation_is_verified(make):
    # A page's parent entry can be reclaimed while the page stays cached: request 2 computed
    # its own copy of page 0 (request 1 cached it first) and inserted its page 1 under request
    # 1's page 0.  Once that page is reclaimed and reused for other tokens, a colliding lookup
    # must not reach request 2's page 1 through it.
    s = make(num_pages=7, max_requests=3)
    s._debug_identity_mask(2**64 - 1, parent_mask=0)
    x, y1, y2, w = [1] * PT, [2] * PT, [3] * PT, [4] * PT
    s.admit(1, x + y1 + [0])
    s.admit(2, x + y2 + [0])                 # both miss
    prefill(s, 1, x + y1 + [0])              # caches x on page 0, y1 on page 1
    prefill(s, 2, x + y2 + [0])              # x: duplicate; y2 cached on its own page 4
    assert s.cache_stats().duplicates == 1
    y2_page = s.block_table(2).tolist()[1]
    assert s.cache_entry(y2_page).parent == s.page_identities(x).tolist()[0]
    s.finish(1)                              # x and y1 reclaimable (y1 first)
    assert s.reclaimable_pages().tolist() == [1, 0]
    s.admit(3, w + [0])
    s.reserve(3, 4 * PT)                     # 2 free pages + both reclaimable ones
    assert s.cache_stats().reclaims == 2
    assert s.block_table(3).tolist()[0] == 0  # page 0 now holds other tokens
    s.advance(3, PT + 1)                     # ... and is cached again, as w
    assert s.cache_entry(0).identity == s.page_identities(w).tolist()[0]
    s.finish(3)
    collisions = s.cache_stats().collisions
    adm = s.admit(4, w + y2 + [0])           # y2's identity matches, its parent entry does not
    assert adm.prefix_tokens == PT
    assert s.cache_stats().collisions == collisions + 1


def test_no_page_is_cached_under_a_parent_entry_dropped_since(make):
    # The request's page 0 is cached, then the cache is cleared: its later pages fill with no
    # parent entry, so neither they nor any page after them is cached.
    s = make()
    prompt = [1] * PT + [2] * PT + [3] * PT + [4]
    s.admit(1, prompt)
    s.reserve(1, len(prompt))
    s.advance(1, PT)
    assert s.cache_stats().cached_pages == 1
    assert s.clear_cache() == 1
    s.advance(1, len(prompt) - PT)
    assert s.cache_stats().cached_pages == 0
    assert s.cache_stats().stored == 1
    s.complete_prefill(1, 0)
    s.finish(1)
    assert s.admit(2, prompt).prefix_tokens == 0


def test_every_page_of_a_long_run_is_cached_under_its_parent(make):
    # 40 pages fill in one call (more than the fill looks ahead): each is cached on the
    # request's own page, under the previous page's entry, with its own identity
    n = 40
    s = make(num_pages=64, page_tokens=1, logical_pages=48)
    prompt = list(range(100, 100 + n))
    s.admit(1, prompt)
    s.reserve(1, len(prompt))
    s.advance(1, len(prompt))
    ids = s.page_identities(prompt).tolist()
    pages = s.block_table(1).tolist()
    assert s.cache_stats().stored == n
    for k in range(n):
        e = s.cache_entry(pages[k])
        assert e.identity == ids[k]
        assert e.parent == (ids[k - 1] if k else None)
    s.complete_prefill(1, 0)
    s.finish(1)
    assert s.admit(2, prompt).prefix_tokens == n - 1   # one token is left to compute


def test_namespaces_never_share_pages(make):
    s = make()
    serve(s, 1, PROMPT, namespace="tenant-a")
    assert s.admit(2, PROMPT, namespace=b"tenant-b").prefix_tokens == 0
    assert s.admit(3, PROMPT).prefix_tokens == 0
    assert s.admit(4, PROMPT, namespace=b"tenant-a").prefix_tokens == 4 * PT
    stored = [e for e in events(s) if e[5] == twin_cache.KV_STORED]
    assert {e[2] for e in stored} == {1}          # tenant-a is namespace id 1
    assert s.page_identities(PROMPT, "tenant-a").tolist() != s.page_identities(PROMPT).tolist()


def test_namespaces_are_verified_not_only_hashed(make):
    s = make()
    s._debug_identity_mask(0)                     # both namespaces hash every page to 0
    serve(s, 1, PROMPT, namespace="a")
    assert s.admit(2, PROMPT, namespace="b").prefix_tokens == 0
    assert s.cache_stats().collisions == 2        # page 1 of request 1, page 0 of request 2
    assert s.admit(3, PROMPT, namespace="a").prefix_tokens == PT


def test_multi_turn_reuses_the_previous_answer(make):
    s = make()
    _, stream = serve(s, 1, PROMPT, rounds=2 * PT + 1)   # the answer fills two more pages
    assert len(stream) == len(PROMPT) + 2 * PT + 1
    turn2 = stream + [77, 78, 79]
    adm = s.admit(2, turn2)
    assert adm.prefix_tokens == (len(stream) // PT) * PT
    assert adm.prefix_tokens > len(PROMPT)                # the answer's pages were reused


def test_page_identities_are_what_the_cache_stores(make):
    s = make()
    serve(s, 1, PROMPT)
    stored = [e for e in events(s) if e[5] == twin_cache.KV_STORED]
    ids = s.page_identities(PROMPT).tolist()
    assert [e[0] for e in stored] == ids
    assert [e[1] for e in stored] == [0] + ids[:-1]
    assert [e[6] for e in stored] == [0, 1, 1, 1]
    assert all(e[3] == PT for e in stored)


def test_each_prompt_page_is_hashed_once(make):
    s = make()
    serve(s, 1, PROMPT)                 # a miss, then the prefill inserts every page
    assert s.cache_stats().pages_hashed == 4
    serve(s, 2, PROMPT)                 # a hit of 4 pages: the 4th page is not re-inserted
    assert s.cache_stats().pages_hashed == 8


# -- reclaim --------------------------------------------------------------------------------------

def test_tail_pages_are_reclaimed_before_head_pages(make):
    s = make(num_pages=6)
    serve(s, 1, PROMPT)                                  # 5 pages, 4 of them cached
    table = [0, 1, 2, 3]
    assert s.reclaimable_pages().tolist() == table[::-1]  # last page first
    assert s.free_pages == 6 and s.pool.free_count == 2
    events(s)
    s.admit(2)
    s.reserve(2, 3 * PT)                                 # 3 pages: 2 free + 1 reclaimed
    assert s.cache_stats().reclaims == 1
    assert s.cache_entry(3) is None and s.cache_entry(0) is not None
    removed = [e for e in events(s) if e[5] == twin_cache.KV_REMOVED]
    assert [e[4] for e in removed] == [3]
    # the head of the prompt is still cached: a hit on the first three pages
    s.finish(2)
    assert s.admit(3, PROMPT).prefix_tokens == 3 * PT


def test_a_hit_retakes_a_reclaimable_page_in_place(make):
    s = make()
    serve(s, 1, PROMPT[:PT] + [50])                       # page 0 of chain A
    serve(s, 2, [9] * PT + [51])                          # page 0 of chain B
    serve(s, 3, [8] * PT + [52])                          # page 0 of chain C
    order = s.reclaimable_pages().tolist()
    assert len(order) == 3
    s.admit(4, [9] * PT + [53])                           # retake the middle one
    assert s.reclaimable_pages().tolist() == [order[0], order[2]]
    s.finish(4)                                           # back as the most recent
    assert s.reclaimable_pages().tolist() == [order[0], order[2], order[1]]


def test_a_hit_retakes_the_head_a_reclaim_left(make):
    s = make(num_pages=4, max_requests=3)
    serve(s, 1, PROMPT[:PT] + [50])                       # page 0 of chain A
    serve(s, 2, [9] * PT + [51])                          # page 0 of chain B
    serve(s, 3, [8] * PT + [52])                          # page 0 of chain C
    a, b, c = s.reclaimable_pages().tolist()
    assert s.pool.free_count == 1
    s.admit(4)
    s.reserve(4, 2 * PT)                                  # one page short: reclaims A
    assert s.reclaimable_pages().tolist() == [b, c]
    s.admit(5, [9] * PT + [53])                           # retakes B, the new head
    assert s.reclaimable_pages().tolist() == [c]
    s.reserve(4, 3 * PT)                                  # reclaims C, not B
    assert s.reclaimable_pages().tolist() == []
    assert s.cache_stats().reclaims == 2
    assert s.admit(6, [9] * PT + [54]).prefix_tokens == PT


def test_pages_retaken_and_released_many_times_keep_the_reclaim_order(make):
    # each hit takes a page off the reclaimable list and its finish puts the page back at the
    # most recent end: many times the pool's size over, the list keeps exactly that order, and
    # reclaims then drop its pages least recently used first
    s = make(num_pages=4, max_requests=3)
    chains = [[t] * PT for t in (7, 8, 9)]
    for i, chain in enumerate(chains):
        serve(s, 100 + i, chain + [50])
    pages = s.reclaimable_pages().tolist()
    order = [0, 1, 2]                                     # chains, least recently used first
    rng = np.random.default_rng(3)
    for rid in range(40):
        i = int(rng.integers(0, 3))
        assert serve(s, rid, chains[i] + [60 + rid])[0].prefix_tokens == PT
        order.remove(i)
        order.append(i)
        assert s.reclaimable_pages().tolist() == [pages[j] for j in order], rid
    s.admit(200)
    s.reserve(200, 3 * PT)                                # two reclaims: the two oldest
    assert s.reclaimable_pages().tolist() == [pages[order[2]]]
    assert s.cache_stats().reclaims == 2
    assert s.admit(201, chains[order[2]] + [1]).prefix_tokens == PT
    assert s.admit(202, chains[order[0]] + [1]).prefix_tokens == 0


def test_reclaims_between_hits_keep_the_reclaim_order(make):
    # more one-page chains than the pool holds, used at random: a hit takes its page off the
    # reclaimable list and its finish puts it back at the most recent end; a miss reclaims the
    # least recently used pages it lacks.  The list keeps exactly that order throughout, while
    # the hits leave entries behind for the ring to compact and the reclaims take its head.
    s = make(num_pages=40, max_requests=2)
    chains = [[t] * PT for t in range(10, 54)]
    cached = {}                                        # chain -> its cached page
    order = []                                         # the expected list, oldest first
    rng = np.random.default_rng(5)
    for rid in range(1200):
        i = int(rng.integers(0, len(chains)))
        hit = i in cached
        if hit:
            order.remove(cached[i])
        lack = (1 if hit else 2) - s.pool.free_count   # the partial page, and a miss's full one
        for page in order[:max(lack, 0)]:
            del cached[next(c for c, q in cached.items() if q == page)]
        order = order[max(lack, 0):]
        adm, _ = serve(s, rid, chains[i] + [100 + rid], finish=False)
        assert adm.prefix_tokens == (PT if hit else 0), rid
        cached[i] = s.block_table(rid)[0]
        s.finish(rid)
        order.append(cached[i])
        assert s.reclaimable_pages().tolist() == order, rid
    assert s.cache_stats().reclaims > 100


def hits_on_the_oldest_then_a_miss(make, pages, old, new, every_hit=False):
    # a pool of `pages` pages holding pages - 1 one-page chains, all reclaimable; `old` hits on
    # the least recently used chain, then `new` on the most recently used one, the reclaim
    # order checked (after every hit with every_hit); then a miss, which reclaims the oldest
    # page still on the list.  Returns the scheduler and the order before the miss.
    s = make(num_pages=pages, max_requests=2)
    chains = [[t] * PT for t in range(10, 10 + pages)]
    for i in range(pages - 1):
        serve(s, i, chains[i] + [50])
    order = s.reclaimable_pages().tolist()           # chains 0 .. pages - 2, oldest first
    lru = list(range(pages - 1))
    for h in range(old + new):
        i = lru.pop(0) if h < old else lru[-1]
        assert serve(s, 1000 + h, chains[i] + [60])[0].prefix_tokens == PT
        if h < old:
            lru.append(i)
            order.append(order.pop(0))
        if every_hit:
            assert s.reclaimable_pages().tolist() == order, (old, new, h)
    assert s.reclaimable_pages().tolist() == order, (old, new)
    serve(s, 2000, chains[-1] + [70])                # a miss: the oldest page goes
    assert s.reclaimable_pages().tolist()[:-1] == order[1:], (old, new)
    return s, order


def test_a_reclaim_after_hits_on_the_oldest_pages_takes_the_oldest_left(make):
    # hits on the least recently used page leave a run of dead entries at the head of the
    # ring, and hits on the most recently used one more dead entries behind; once the ring
    # holds enough, the compaction reads them a few at a time, passing the run at the head.
    # A miss then reclaims the oldest page still on the list, whatever the two counts.
    for old in range(12):
        for new in range(20):
            hits_on_the_oldest_then_a_miss(make, 8, old, new, every_hit=True)


def test_a_reclaim_after_a_long_run_of_hits_on_the_oldest_pages_takes_the_oldest_left(make):
    # as above, with runs of dead entries at the head long enough to be passed many slots at
    # a time, from every head position the ring reaches (it wraps), before and during a
    # compaction
    for old in (31, 32, 33, 63, 64, 65, 96, 97, 130, 151, 170, 199, 230):
        for new in (0, 1, 9, 40):
            s, order = hits_on_the_oldest_then_a_miss(make, 100, old, new)
            serve(s, 2001, [5] * (3 * PT) + [70])    # three more: the next three
            assert s.reclaimable_pages().tolist()[:-4] == order[4:], (old, new)


def test_decode_reclaims_when_the_pool_is_exhausted(make):
    s = make(num_pages=5, max_requests=2)
    serve(s, 1, PROMPT[:2 * PT] + [1])                    # pages 0, 1 cached; 2 freed
    s.admit(2)
    s.reserve(2, 3 * PT)
    s.advance(2, 3 * PT)                                  # holds 3 pages
    s.complete_prefill(2, 5)
    assert s.pool.free_count == 0 and s.free_pages == 2
    s.decode(PyHashBackend())                             # needs one page: reclaims page 1
    assert s.cache_stats().reclaims == 1
    assert s.reclaimable_pages().tolist() == [0]


def test_a_call_that_cannot_be_satisfied_reclaims_nothing(make):
    s = make(num_pages=6, max_requests=2)
    serve(s, 1, PROMPT)
    before = state(s)
    s.admit(2)
    after_admit = state(s)
    with pytest.raises(SchedulerError.Table) as info:
        s.reserve(2, 7 * PT)                              # 7 pages > 2 free + 4 reclaimable
    assert isinstance(info.value.cause, TableError.Exhausted)
    assert state(s) == after_admit
    s.finish(2)
    assert state(s)[:5] == before[:5]


def test_reclaims_of_a_failing_decode_stay_reclaimed(make):
    s = make(num_pages=5, max_requests=2)
    serve(s, 1, PROMPT[:2 * PT] + [1])
    s.admit(2)
    s.reserve(2, 3 * PT)
    s.advance(2, 3 * PT)
    s.complete_prefill(2, 5)
    tables = s.block_table(2).tolist()
    with pytest.raises(qualia.DecodeRoundError.Backend):
        s.decode(PyHashBackend(fault="raise"))
    # the round changed nothing; the page reclaimed for it held no request's data
    assert s.block_table(2).tolist() == tables and s.token_count(2) == 3 * PT
    assert s.cache_stats().reclaims == 1 and s.pool.free_count == 1


def test_finish_then_reuse_many_times_keeps_counts_conserved(make):
    s = make(num_pages=12, max_requests=2)
    for rid in range(20):
        serve(s, rid, PROMPT[: (rid % 5) * PT + 1] + [rid], rounds=rid % 3)
    refs = s.pool.refcounts().tolist() if hasattr(s.pool, "refcounts") else s.pool._refcounts
    cached = [s.cache_entry(p) is not None for p in range(s.num_pages)]
    assert refs == [int(c) for c in cached]
    assert s.free_pages == s.num_pages


# -- clear, events, stats ------------------------------------------------------------------------

def test_clear_cache_keeps_pages_held_by_requests(make):
    s = make()
    serve(s, 1, PROMPT)
    s.admit(2, PROMPT)                       # holds 4 cached pages
    held = s.block_table(2).tolist()
    events(s)
    assert s.clear_cache() == 4
    assert s.cache_stats().cached_pages == 0
    assert s.block_table(2).tolist() == held
    assert [s.pool.refcount(p) for p in held] == [1] * 4
    assert events(s) == [(0, 0, 0, 0, 2**32 - 1, twin_cache.KV_CLEARED, 0)]
    s.finish(2)
    assert s.pool.free_count == s.num_pages


def test_event_overflow_is_counted_never_silent(make):
    s = make(event_capacity=2)
    serve(s, 1, PROMPT)                      # 4 stored events, room for 2
    st = s.cache_stats()
    assert (st.events_pending, st.events_dropped) == (2, 2)
    buf = np.zeros(1, dtype=qualia.KV_EVENT)
    assert s.drain_events(buf) == 1
    assert buf["kind"][0] == twin_cache.KV_STORED
    assert len(s.drain_events()) == 1
    assert s.cache_stats().events_pending == 0
    none = make(event_capacity=0)
    serve(none, 1, PROMPT)
    assert none.cache_stats().events_dropped == 4 and len(none.drain_events()) == 0


def test_drain_into_a_buffer_allocates_nothing(make):
    s = make(event_capacity=64)
    buf = np.zeros(8, dtype=qualia.KV_EVENT)
    serve(s, 1, PROMPT)
    assert s.drain_events(buf) == 4
    assert buf["page"][:4].tolist() == [0, 1, 2, 3]
    with pytest.raises(TypeError):
        s.drain_events(np.zeros(4, dtype=np.uint64))


def test_replicas_with_one_key_agree_and_default_keys_differ(make):
    a, b = make(cache_key=KEY), make(cache_key=bytearray(KEY))
    assert a.page_identities(PROMPT).tolist() == b.page_identities(PROMPT).tolist()
    serve(a, 1, PROMPT)
    serve(b, 1, PROMPT)
    assert events(a) == events(b)
    c, d = make(cache_key=None), make(cache_key=None)
    assert c.page_identities(PROMPT).tolist() != d.page_identities(PROMPT).tolist()


def test_usage_counts_pages_requests_hold(make):
    s = make(num_pages=10)
    serve(s, 1, PROMPT)
    assert s.cache_stats().usage == 0.0
    s.admit(2, PROMPT)
    assert s.cache_stats().usage == pytest.approx(4 / 10)


# -- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("key, exc", [(b"short", ValueError), (b"x" * 17, ValueError),
                                      ("0123456789abcdef", TypeError), (12, TypeError)])
def test_bad_cache_key(make, key, exc):
    with pytest.raises(exc):
        make(cache_key=key)


@pytest.mark.parametrize("kw, exc", [(dict(max_namespaces=0), ValueError),
                                     (dict(max_namespaces=-1), OverflowError),
                                     (dict(event_capacity=2**27), ValueError),
                                     (dict(event_capacity=1.0), TypeError)])
def test_bad_cache_sizes(make, kw, exc):
    with pytest.raises(exc):
        make(**kw)


def test_bad_mode():
    with pytest.raises(ValueError):
        qualia.Scheduler(1, 4, 4, 4, prefix_caching="lru")
    with pytest.raises(TypeError):
        qualia.Scheduler(1, 4, 4, 4, prefix_caching=None)


def test_bad_admissions_change_nothing(make):
    s = make(max_namespaces=2)
    serve(s, 1, PROMPT)
    s.admit(2, PROMPT, namespace="a")
    before = state(s)
    cases = [
        (lambda: s.admit(3, list(range(16 * PT + 1))), ValueError),     # longer than the table
        (lambda: s.admit(3, PROMPT, namespace=b"n" * 257), ValueError),  # namespace too long
        (lambda: s.admit(3, PROMPT, prefix_len=4), ValueError),          # explicit-mode only
        (lambda: s.admit(3, PROMPT, namespace="b"), PrefixCacheError.NamespaceTableFull),
        (lambda: s.admit(3, [1, -1]), OverflowError),
        (lambda: s.admit(3, "abc"), TypeError),
        (lambda: s.admit(2, PROMPT), SchedulerError.DuplicateRequest),
    ]
    for fn, exc in cases:
        with pytest.raises(exc):
            fn()
        assert state(s) == before, exc
    s.finish(2)                       # namespace "a" is used by nothing any more
    s.admit(3, PROMPT, namespace="b")
    assert s.cache_stats().namespaces == 2


def test_a_namespace_with_a_live_request_keeps_its_id(make):
    s = make(max_namespaces=2)
    serve(s, 1, PROMPT, namespace="a", finish=False)     # its pages are in use
    before = state(s)
    with pytest.raises(PrefixCacheError.NamespaceTableFull):
        s.admit(2, PROMPT, namespace="b")
    assert state(s) == before
    s.finish(1)
    s.admit(2, PROMPT, namespace="b")


def test_an_idle_namespace_gives_its_pages_and_id_to_a_new_one(make):
    s = make(max_namespaces=2)
    serve(s, 1, PROMPT, namespace="a")
    pages = s.reclaimable_pages().tolist()       # a's pages, least recently used first
    assert len(pages) == 4 and all(s.cache_entry(p).namespace_id == 1 for p in pages)
    idents = [s.cache_entry(p).identity for p in pages]
    events(s)
    before = s.cache_stats()
    adm = s.admit(2, PROMPT, namespace="b")      # every id in use: "a" is idle, so it goes
    assert adm.prefix_tokens == 0
    assert [(e[0], e[2], e[4], e[5]) for e in events(s)] == \
        [(i, 1, p, twin_cache.KV_REMOVED) for i, p in zip(idents, pages)]
    after = s.cache_stats()
    assert after.reclaims == before.reclaims + 4
    assert (after.cached_pages, after.reclaimable_pages, after.namespaces) == (0, 0, 2)
    assert s.cached_prefix_tokens(PROMPT, "a") == 0
    prefill(s, 2, PROMPT)
    assert {s.cache_entry(p).namespace_id for p in s.block_table(2).tolist()[:4]} == {1}


def test_the_least_recently_used_idle_namespace_goes_first(make):
    s = make(max_namespaces=3, num_pages=40)
    serve(s, 1, PROMPT, namespace="a")
    serve(s, 2, PROMPT, namespace="b")
    serve(s, 3, PROMPT, namespace="a")           # a hit: "a" is used again, after "b"
    s.admit(4, [5, 6], namespace="c")
    assert s.cached_prefix_tokens(PROMPT, "a") == 4 * PT
    assert s.cached_prefix_tokens(PROMPT, "b") == 0
    s.finish(4)                                  # "c" had no page: its id is free again
    s.admit(5, [5, 6], namespace="d")
    assert s.cached_prefix_tokens(PROMPT, "a") == 4 * PT
    assert s.cache_stats().namespaces == 3


def test_a_namespace_whose_pages_an_allocation_reclaimed_goes_idle_with_its_last_request(make):
    s = make(max_namespaces=2, num_pages=16)
    serve(s, 1, PROMPT, namespace="a")                         # 4 reclaimable pages of "a"
    other = [100 + t for t in PROMPT]
    serve(s, 2, other, namespace="a", finish=False)            # "a" in use by a live request
    assert len(s.reclaimable_pages()) == 4
    before = s.cache_stats().reclaims
    third = list(range(500, 500 + s.free_pages * PT))          # every free and reclaimable page
    s.admit(3, third)
    prefill(s, 3, third)
    assert s.cache_stats().reclaims == before + 4              # request 1's pages, all of them
    s.finish(3)
    with pytest.raises(PrefixCacheError.NamespaceTableFull):
        s.admit(4, PROMPT, namespace="b")                      # "a" still has a live request
    s.finish(2)                                                # now only reclaimable pages: idle
    adm = s.admit(4, PROMPT, namespace="b")                    # so "b" takes the id of "a"
    assert adm.prefix_tokens == 0 and s.cache_stats().namespaces == 2
    assert s.cached_prefix_tokens(other, "a") == 0


@pytest.mark.parametrize("new_namespace", [False, True])
def test_a_reclaim_of_a_page_released_behind_the_caches_back_fails_uncounted(make,
                                                                              new_namespace):
    s = make(max_requests=2, num_pages=8, page_tokens=1, logical_pages=8, max_namespaces=2)
    serve(s, 1, [1, 2, 3, 4], namespace="a" if new_namespace else "")
    first = int(s.reclaimable_pages()[0])
    s.pool.release(first)                 # the cache's reference, not through the facade
    with pytest.raises(SchedulerError.Table) as info:
        if new_namespace:
            s.admit(2, [9, 9], namespace="b")          # "a" is idle: its pages go
        else:
            s.admit(2, list(range(100, 108)))
            s.reserve(2, 8)                            # every free page and one reclaim
    assert isinstance(info.value.cause, TableError.NotAllocated)
    assert s.cache_stats().reclaims == 0
    assert s.cache_entry(first) is None and first not in s.reclaimable_pages().tolist()


@pytest.mark.parametrize("kind", ["core", "twin"])
def test_the_engine_step_serves_more_tenants_than_namespace_ids(kind):
    from qualia.twin import StepScheduler
    cls = qualia.StepScheduler if kind == "core" else StepScheduler
    s = cls(64, PT, 16, 2, cache_key=KEY, max_namespaces=3, max_queued=12)
    finished = []
    for tenant in range(12):
        s.add_request(tenant, PROMPT, max_new_tokens=2, namespace=f"tenant-{tenant}")
    while s.has_unfinished():
        plan = s.schedule()
        ids = (np.asarray(plan.input_ids)[np.asarray(plan.logits_indices)] + 1) % 50
        finished += [f.request_id for f in s.update(ids.astype(np.uint32))]
    assert sorted(finished) == list(range(12))
    stats = (s if kind == "core" else s.facade).cache_stats()
    assert stats.namespaces <= 3 and stats.reclaims > 0


def test_the_empty_namespace_never_gives_its_id(make):
    s = make(max_namespaces=1)
    serve(s, 1, PROMPT)
    before = state(s)
    with pytest.raises(PrefixCacheError.NamespaceTableFull):
        s.admit(2, PROMPT, namespace="a")
    assert state(s) == before


def test_explicit_verbs_are_refused_in_auto_mode():
    s = qualia.Scheduler(2, 8, 4, 4)
    assert s.prefix_caching == "auto"
    s.admit(1, [1, 2, 3])
    with pytest.raises(ValueError, match="explicit"):
        s.publish_prefix(1, [1, 2, 3])


def test_off_and_explicit_modes_do_not_cache():
    for mode in ("off", "explicit"):
        s = qualia.Scheduler(2, 16, 4, 4, prefix_caching=mode)
        serve(s, 1, PROMPT[:9])
        assert s.admit(2, PROMPT[:9]).prefix_tokens == 0
        assert s.cache_stats().cached_pages == 0 and len(s.drain_events()) == 0
        assert s.free_pages == s.pool.free_count
        assert s.reclaimable_pages().tolist() == [] and s.cache_entry(0) is None
        assert s.clear_cache() == 0
    off = qualia.Scheduler(2, 16, 4, 4, prefix_caching="off")
    with pytest.raises(ValueError):
        off.admit(3, [1], prefix_len=1)
    with pytest.raises(ValueError):
        off.page_identities([1, 2, 3, 4])


def test_a_pool_of_one_page_reclaims_it_for_the_next_request(make):
    s = make(num_pages=1, max_requests=1, logical_pages=4)
    serve(s, 1, [1, 2, 3, 4])                # the page fills and is cached
    assert s.reclaimable_pages().tolist() == [0] and s.free_pages == 1
    assert s.admit(2, [1, 2, 3, 4]).prefix_tokens == 0   # one token must be computed
    s.reserve(2, 4)
    assert s.cache_stats().reclaims == 1 and s.block_table(2).tolist() == [0]


# -- zero allocation -----------------------------------------------------------------------------

def test_admit_finish_cycles_do_not_grow_the_heap():
    s = qualia.Scheduler(4, 256, 16, 80, cache_key=KEY)
    prompt = np.arange(1024, dtype=np.uint32)
    s.admit(1, prompt)
    s.reserve(1, 1024)
    s.advance(1, 1024)
    s.finish(1)

    def cycle(k):
        for _ in range(k):
            s.admit(2, prompt)
            s.finish(2)

    cycle(100)

    def traced_growth(k):
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            cycle(k)
            return tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()

    probe = traced_growth(0)         # the probe's own objects
    assert traced_growth(2000) - probe <= 0
    assert traced_growth(2000) - probe <= 0
    assert s.cache_stats().hit_tokens == 63 * 16 * 4100


# -- ownership (docs/DESIGN.md, "Ownership"): the core only ----------------------------------------

class _During:
    """A Python backend that runs ``fn`` inside its round, then answers like PyHashBackend."""

    def __init__(self, fn):
        self.fn = fn
        self.inner = PyHashBackend()

    def execute_ragged(self, items, block_table, outputs):
        self.fn()
        return self.inner.execute_ragged(items, block_table, outputs)


def _auto_state(s):
    return (s.pool.refcounts().tolist(), s.reclaimable_pages().tolist(), s.cache_stats(),
            tuple(s.cache_entry(p) for p in range(s.num_pages)), s.runnable().tolist())


def test_cache_calls_are_busy_during_a_decode_round():
    s = qualia.Scheduler(4, 32, PT, 16, cache_key=KEY)
    serve(s, 1, PROMPT)                      # cached, reclaimable pages
    s.admit(2, PROMPT)
    prefill(s, 2, PROMPT)                    # decoding: the round below runs it
    mutators = {
        "admit": lambda: s.admit(3, PROMPT),
        "reserve": lambda: s.reserve(2, 1),
        "advance": lambda: s.advance(2, 1),
        "finish": lambda: s.finish(2),
        "clear_cache": lambda: s.clear_cache(),
        "identity mask": lambda: s._debug_identity_mask(0),
    }
    outcomes = {}
    reads = []

    def during():
        before = _auto_state(s)
        for name, call in mutators.items():
            try:
                call()
                outcomes[name] = "ran"
            except qualia.BusyError:
                outcomes[name] = "busy"
        assert _auto_state(s) == before
        # reads and draining take no ownership
        reads.append((s.cached_prefix(PROMPT), s.cache_stats().cached_pages,
                      len(s.drain_events()), s.page_identities(PROMPT).tolist()))

    s.decode(_During(during))
    assert outcomes == {name: "busy" for name in mutators}
    assert reads and reads[0][0] == (4 * PT, 4, 0) and reads[0][1] == 4
    s.finish(2)
    assert s.clear_cache() == 4             # free again after the round


def test_a_token_that_reenters_admit_cannot_corrupt_the_stream():
    s = qualia.Scheduler(4, 32, PT, 16, cache_key=KEY)
    other = [50 + i for i in range(2 * PT + 1)]

    class Sneaky:
        """A token id whose __index__ admits another request mid-conversion."""

        def __init__(self, value):
            self.value = value

        def __index__(self):
            if not s.active_count:
                s.admit(9, other)
            return self.value

    mine = list(range(1, 2 * PT + 2))
    adm = s.admit(1, [Sneaky(t) for t in mine])   # converted first, into private memory
    assert adm.slot == 1                          # request 9 took slot 0 meanwhile
    for rid, toks in ((1, mine), (9, other)):
        prefill(s, rid, toks)
    ids = s.page_identities(mine).tolist() + s.page_identities(other).tolist()
    cached = sorted(e.identity for e in map(s.cache_entry, range(s.num_pages)) if e)
    assert cached == sorted(ids)                 # each stream cached its own tokens


def test_a_gc_callback_during_a_round_cannot_change_the_cache():
    import gc as _gc

    s = qualia.Scheduler(4, 32, PT, 16, cache_key=KEY)
    serve(s, 1, PROMPT)
    s.admit(2, PROMPT)
    prefill(s, 2, PROMPT)
    seen = []

    def callback(phase, info):
        if phase == "start" and not seen:
            try:
                s.clear_cache()
                seen.append("ran")
            except qualia.BusyError:
                seen.append("busy")

    def during():
        _gc.callbacks.append(callback)
        try:
            _gc.collect()
        finally:
            _gc.callbacks.remove(callback)

    s.decode(_During(during))
    assert seen == ["busy"] and s.cache_stats().cached_pages == 4
