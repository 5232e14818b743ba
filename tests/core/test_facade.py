"""The admit/decode/finish facade: sizing, prefill helpers, copy-on-write hand-off, atomicity."""

import pytest

import qualia
from qualia import twin as ref
from qualia.errors import DecodeRoundError, PrefixKvError, SchedulerError, TableError


class Recorder:
    """A Python backend that records the copies and rounds it is given."""

    def __init__(self, fail=None):
        self.copies = []
        self.rounds = []
        self.fail = fail
        self.inner = ref.PyHashBackend()

    def copy_pages(self, copies):
        self.copies_writeable = copies.flags.writeable
        self.copies.append([(int(c["src_page"]), int(c["dst_page"])) for c in copies])
        if self.fail == "copy":
            raise RuntimeError("copy failed")

    def execute_ragged(self, items, block_table, outputs):
        self.rounds.append((items.copy(), block_table.copy()))
        if self.fail == "round":
            raise RuntimeError("round failed")
        return self.inner.execute_ragged(items, block_table, outputs)


def snapshot(s):
    return (s.stats(), s.pool.refcounts().tolist(), s.runnable().tolist(),
            {int(v["request_id"]): s.block_table(int(v["request_id"])).tolist()
             for v in s.runnable()},
            [i.hex() for i in s.prefixes.identities()])


def prefill(s, rid, prompt, backend=None, prefix_len=None, namespace=b""):
    adm = s.admit(rid, prompt, namespace=namespace, prefix_len=prefix_len)
    n = len(prompt) - adm.prefix_tokens
    copies = s.reserve(rid, n)
    if backend is not None and len(copies):
        backend.copy_pages(copies)
    s.advance(rid, n)
    s.complete_prefill(rid, prompt[-1])
    return adm


def test_sizes_are_fixed_at_construction():
    s = qualia.Scheduler(max_requests=3, num_pages=10, page_tokens=4, logical_pages=5,
                         prefix_entries=2, prefix_pages=3)
    assert (s.max_requests, s.num_pages, s.page_tokens, s.logical_pages) == (3, 10, 4, 5)
    assert s.prefixes.capacity == 2 and s.prefixes.max_pages == 3
    assert s.stats()["free_pages"] == 10 and s.active_count == 0
    with pytest.raises(ValueError):
        qualia.Scheduler(max_requests=3, num_pages=10, page_tokens=0, logical_pages=5)
    with pytest.raises(ValueError):
        qualia.Scheduler(max_requests=0, num_pages=10, page_tokens=4, logical_pages=5)


def test_prefill_reserves_exactly_the_pages_of_the_prompt():
    s = qualia.Scheduler(max_requests=2, num_pages=10, page_tokens=4, logical_pages=5)
    adm = s.admit(1, [1, 2, 3, 4, 5, 6])
    assert adm == (0, False, 0)
    assert len(s.reserve(1, 6)) == 0
    assert s.block_table(1).tolist() == [0, 1]
    assert s.advance(1, 6) == 6
    s.complete_prefill(1, 9)
    assert s.requests.pending_token(1) == 9
    assert s.requests.request_view(1)[2] == qualia.RequestState.DECODE


def test_prefix_hit_shares_pages_and_copies_on_the_first_write():
    s = qualia.Scheduler(max_requests=3, num_pages=16, page_tokens=4, logical_pages=6,
                         prefix_caching="explicit")
    system = [7] * 6
    be = Recorder()
    prefill(s, 1, system + [1, 2], be, prefix_len=6)
    ident = s.publish_prefix(1, system + [1, 2], prefix_len=6)
    assert s.prefixes.pages_of(ident) == [0, 1] and s.prefixes.tokens_of(ident) == 6
    adm = prefill(s, 2, system + [3, 4, 5], be, prefix_len=6)
    assert adm.prefix_hit and adm.prefix_tokens == 6
    # request 2 wrote position 6 into shared page 1: copy to a fresh page
    assert be.copies == [[(1, 2)]]
    assert s.block_table(2).tolist()[:2] == [0, 2]
    assert s.pool.refcount(0) == 3 and s.pool.refcount(1) == 2  # store + request 1
    # another tenant never shares
    adm = s.admit(3, system + [1], namespace=b"tenant-b", prefix_len=6)
    assert not adm.prefix_hit


def test_decode_hands_copies_to_the_backend_once_before_the_round():
    s = qualia.Scheduler(max_requests=3, num_pages=16, page_tokens=4, logical_pages=6,
                         prefix_caching="explicit")
    be = Recorder()
    prefill(s, 1, [5] * 8, be)  # exactly two full pages: next write is page 2
    s.publish_prefix(1, [5] * 8, prefix_len=7)  # shares pages 0 and 1
    prefill(s, 2, [5] * 7, be, prefix_len=7)  # hit; reserve(0 tokens)... token_count 7
    assert be.copies == []
    receipt, out = s.decode(be)
    # request 1 writes position 8 (fresh page 2); request 2 writes position 7 in shared page 1
    assert receipt == (2, 1)
    assert be.copies == [[(1, 3)]]
    assert be.copies_writeable is False
    items, table = be.rounds[-1]
    assert items["position"].tolist() == [8, 7]
    assert table.tolist() == [0, 1, 2, 0, 3]
    assert not out.flags.writeable
    assert out["request_id"].tolist() == [1, 2]
    assert s.stats()["pages_copied"] == 1


def test_backend_without_copy_pages_fails_cleanly():
    s = qualia.Scheduler(max_requests=3, num_pages=16, page_tokens=4, logical_pages=6,
                         prefix_caching="explicit")
    prefill(s, 1, [5] * 6)
    s.publish_prefix(1, [5] * 6)
    before = snapshot(s)

    class NoCopy:
        def execute_ragged(self, items, table, outputs):
            raise AssertionError("not reached")

    with pytest.raises(TypeError, match="copy_pages"):
        s.decode(NoCopy())
    assert snapshot(s) == before


@pytest.mark.parametrize("fail", ["copy", "round"])
def test_failed_decode_restores_pages_exactly(fail):
    s = qualia.Scheduler(max_requests=3, num_pages=16, page_tokens=4, logical_pages=6,
                         prefix_caching="explicit")
    be = Recorder()
    prefill(s, 1, [5] * 8, be)
    s.publish_prefix(1, [5] * 8, prefix_len=7)
    prefill(s, 2, [5] * 7, be, prefix_len=7)
    before = snapshot(s)
    with pytest.raises(DecodeRoundError.Backend):
        s.decode(Recorder(fail=fail))
    assert snapshot(s) == before
    # and the free stack order too: the next allocations are the same pages as before
    receipt, _ = s.decode(be)
    assert be.copies[-1] == [(1, 3)]


def test_exhaustion_while_making_pages_writable_fails_the_round_with_nothing_changed():
    s = qualia.Scheduler(max_requests=4, num_pages=6, page_tokens=2, logical_pages=4)
    for rid in range(3):
        prefill(s, rid, [rid, rid])  # one full page each: next decode needs a new page each
    s.pool.allocate()
    s.pool.allocate()  # 1 page left, 3 needed
    before = snapshot(s)
    with pytest.raises(DecodeRoundError.Scheduler) as info:
        s.decode(qualia.HashBackend())
    assert info.value.chain == ("DecodeRoundError.Scheduler", "SchedulerError.Table",
                                "TableError.Exhausted")
    assert snapshot(s) == before


def test_decode_past_logical_pages_is_out_of_range():
    s = qualia.Scheduler(max_requests=1, num_pages=6, page_tokens=2, logical_pages=1)
    prefill(s, 0, [1, 2])
    before = snapshot(s)
    with pytest.raises(DecodeRoundError.Scheduler) as info:
        s.decode(qualia.HashBackend())
    assert info.value.root.__class__ is TableError.OutOfRange
    assert snapshot(s) == before


def test_reserve_is_atomic():
    s = qualia.Scheduler(max_requests=2, num_pages=3, page_tokens=2, logical_pages=8)
    s.admit(1)
    before = snapshot(s)
    with pytest.raises(SchedulerError.Table) as info:
        s.reserve(1, 7)  # needs 4 pages, 3 exist
    assert isinstance(info.value.cause, TableError.Exhausted)
    assert snapshot(s) == before
    with pytest.raises(SchedulerError.Table):
        s.reserve(1, 17)  # past logical_pages
    assert snapshot(s) == before
    with pytest.raises(SchedulerError.UnknownRequest):
        s.reserve(2, 1)


def test_publish_prefix_checks_what_the_request_holds():
    s = qualia.Scheduler(max_requests=2, num_pages=8, page_tokens=2, logical_pages=4,
                         prefix_entries=1, prefix_caching="explicit")
    s.admit(1, [1, 2, 3])
    with pytest.raises(ValueError, match="cannot publish"):
        s.publish_prefix(1, [1, 2, 3])
    s.reserve(1, 3)
    s.advance(1, 3)
    with pytest.raises(ValueError, match="longer than the prompt"):
        s.publish_prefix(1, [1, 2, 3], prefix_len=4)
    with pytest.raises(PrefixKvError.EmptyPrefix):
        s.publish_prefix(1, [1, 2, 3], prefix_len=0)
    s.publish_prefix(1, [1, 2, 3])
    with pytest.raises(PrefixKvError.Duplicate):
        s.publish_prefix(1, [1, 2, 3])
    with pytest.raises(PrefixKvError.Full):
        s.publish_prefix(1, [1, 2])


def test_evict_unused_lru_skips_entries_a_request_still_holds():
    s = qualia.Scheduler(max_requests=3, num_pages=16, page_tokens=2, logical_pages=4,
                         prefix_caching="explicit")
    prefill(s, 1, [1, 2, 3])
    a = s.publish_prefix(1, [1, 2, 3], prefix_len=2)
    prefill(s, 2, [4, 5, 6])
    b = s.publish_prefix(2, [4, 5, 6], prefix_len=2)
    s.finish(2)  # b's page is now held by the store alone
    assert s.evict_unused_lru() == b
    assert s.evict_unused_lru() is None  # a is still mapped by request 1
    s.finish(1)
    assert s.evict_unused_lru() == a
    assert s.free_pages == 16


def test_identity_for_matches_of_tokens():
    s = qualia.Scheduler(max_requests=1, num_pages=4, page_tokens=2, logical_pages=4)
    assert s.identity_for([1, 2, 3], prefix_len=2, namespace="t") == \
        qualia.PrefixIdentity.of_tokens([1, 2], b"t")
    with pytest.raises(ValueError, match="more than logical_pages"):
        s.identity_for(list(range(9)))


def test_full_cycle_returns_the_pool_to_the_store_pages():
    s = qualia.Scheduler(max_requests=4, num_pages=64, page_tokens=4, logical_pages=16,
                         prefix_caching="explicit")
    be = qualia.HashBackend()
    system = list(range(100, 110))
    for rid in range(8):
        if s.active_count == s.max_requests:
            s.finish(rid - 4)
        prefill(s, rid, system + [rid] * 3, be, prefix_len=10)
        if not s.prefixes.contains(s.identity_for(system)):
            s.publish_prefix(rid, system + [rid] * 3, prefix_len=10)
        for _ in range(5):
            s.decode(be)
    for view in s.runnable():
        s.finish(int(view["request_id"]))
    held = sum(len(s.prefixes.pages_of(i)) for i in s.prefixes.identities())
    assert s.free_pages == s.num_pages - held
    assert s.stats()["prefix_hits"] == 7
