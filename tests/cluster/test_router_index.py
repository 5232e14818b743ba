"""The router's index (qualia.PrefixRouterIndex): page identity -> replicas holding it, fed by KV
events, and the per-replica longest cached prefix of a prompt."""

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qualia
from qualia import KV_EVENT, PrefixRouterIndex
from qualia._core import KV_CLEARED_KIND, KV_REMOVED_KIND, KV_STORED_KIND


def events(*pairs):
    """KV_EVENT array from (kind, identity) pairs."""
    ev = np.zeros(len(pairs), dtype=KV_EVENT)
    for k, (kind, ident) in enumerate(pairs):
        ev[k]["kind"] = kind
        ev[k]["identity"] = ident
    return ev


S, R, C = KV_STORED_KIND, KV_REMOVED_KIND, KV_CLEARED_KIND


class Model:
    """The index in plain Python: identity -> set of replicas, with the same capacity rule."""

    def __init__(self, capacity, max_replicas):
        self.capacity = capacity
        self.max_replicas = max_replicas
        self.held = {}
        self.dropped = 0

    def apply(self, replica, pairs):
        for kind, ident in pairs:
            if kind == S:
                if ident in self.held:
                    self.held[ident].add(replica)
                elif len(self.held) < self.capacity:
                    self.held[ident] = {replica}
                else:
                    self.dropped += 1
            elif kind == R:
                if replica in self.held.get(ident, ()):
                    self.held[ident].discard(replica)
                    if not self.held[ident]:
                        del self.held[ident]
            else:
                self.remove_replica(replica)

    def remove_replica(self, replica):
        for ident in list(self.held):
            self.held[ident].discard(replica)
            if not self.held[ident]:
                del self.held[ident]

    def match(self, ids):
        out = []
        for r in range(self.max_replicas):
            k = 0
            while k < len(ids) and r in self.held.get(ids[k], ()):
                k += 1
            out.append(k)
        return out


def test_exported():
    assert qualia.PrefixRouterIndex is PrefixRouterIndex
    assert "PrefixRouterIndex" in qualia.__all__


def test_sized_at_construction():
    x = PrefixRouterIndex(1000, 8)
    assert (x.capacity, x.max_replicas, x.slots, len(x)) == (1000, 8, 2048, 0)
    assert PrefixRouterIndex(1).slots == 2
    assert PrefixRouterIndex(1).max_replicas == 64


@pytest.mark.parametrize("args, exc", [
    ((0,), ValueError), ((-1,), OverflowError), ((10, 0), ValueError), ((10, 65), ValueError),
    (("10",), TypeError), ((10, True), TypeError), ((2**32 + 1,), ValueError)])
def test_bad_construction(args, exc):
    with pytest.raises(exc):
        PrefixRouterIndex(*args)


def test_stored_removed_cleared():
    x = PrefixRouterIndex(100, 4)
    assert x.apply_events(0, events((S, 11), (S, 12))) == 2
    x.apply_events(2, events((S, 11)))
    assert x.replicas_of(11) == 0b101 and x.replicas_of(12) == 0b001 and len(x) == 2
    x.apply_events(0, events((R, 11)))
    assert x.replicas_of(11) == 0b100
    x.apply_events(2, events((C, 0)))
    assert x.replicas_of(11) == 0 and len(x) == 1
    assert x.stats()["cleared"] == 1


def test_match_walks_from_page_zero():
    x = PrefixRouterIndex(100, 3)
    x.apply_events(0, events((S, 1), (S, 2), (S, 3)))
    x.apply_events(1, events((S, 1), (S, 3)))        # page 1 missing: its prefix stops at 1
    x.apply_events(2, events((S, 2), (S, 3)))        # page 0 missing: nothing
    assert x.match([1, 2, 3]).tolist() == [3, 1, 0]
    assert x.match(np.array([1, 2, 3, 4], dtype=np.uint64)).tolist() == [3, 1, 0]
    assert x.match([]).tolist() == [0, 0, 0]
    assert x.match([9]).tolist() == [0, 0, 0]
    out = np.full(5, 77, dtype=np.uint32)
    assert x.match_into([1, 2], out) == 2
    assert out.tolist() == [2, 1, 0, 77, 77]


def test_identity_zero_and_max_are_ordinary():
    x = PrefixRouterIndex(4, 2)
    x.apply_events(1, events((S, 0), (S, 2**64 - 1)))
    assert x.match([0, 2**64 - 1]).tolist() == [0, 2]


def test_full_index_drops_and_counts():
    x = PrefixRouterIndex(2, 2)
    x.apply_events(0, events((S, 1), (S, 2), (S, 3)))
    assert len(x) == 2 and x.replicas_of(3) == 0 and x.stats()["dropped"] == 1
    x.apply_events(1, events((S, 1)))                # a known identity still gains replicas
    assert x.replicas_of(1) == 0b11
    x.apply_events(0, events((R, 3)))                # removing what was dropped: counted
    assert x.stats()["unknown_removals"] == 1


def test_bad_kind_changes_nothing():
    x = PrefixRouterIndex(10, 2)
    x.apply_events(0, events((S, 5)))
    before = x.stats()
    with pytest.raises(ValueError, match=r"events\[1\]"):
        x.apply_events(1, events((S, 6), (9, 7)))
    assert x.stats() == before and x.replicas_of(6) == 0


@pytest.mark.parametrize("replica, exc", [(2, OverflowError), (-1, OverflowError),
                                          (True, TypeError), (1.0, TypeError)])
def test_bad_replica_changes_nothing(replica, exc):
    x = PrefixRouterIndex(10, 2)
    with pytest.raises(exc):
        x.apply_events(replica, events((S, 5)))
    with pytest.raises(exc):
        x.remove_replica(replica)
    assert len(x) == 0


@pytest.mark.parametrize("bad", [[1, 2], np.zeros(3, dtype=np.uint64),
                                 np.zeros((2, 1), dtype=KV_EVENT), b"abc"])
def test_bad_events_type(bad):
    x = PrefixRouterIndex(10, 2)
    with pytest.raises((TypeError, ValueError)):
        x.apply_events(0, bad)
    assert len(x) == 0


def test_events_equal_dtype_strided_or_read_only():
    x = PrefixRouterIndex(10, 2)
    ev = events((S, 1), (S, 2), (S, 3), (S, 4))
    strided = ev[::2]
    ro = ev.copy()
    ro.flags.writeable = False
    x.apply_events(0, strided)
    x.apply_events(1, ro)
    assert x.replicas_of(1) == 0b11 and x.replicas_of(2) == 0b10
    unpickled = pickle.loads(pickle.dumps(events((S, 8))))     # what a Ray actor sends
    x.apply_events(1, unpickled)
    assert x.replicas_of(8) == 0b10
    other = np.zeros(1, dtype=[("identity", "<u8"), ("kind", "u1")])
    with pytest.raises(TypeError):                    # not the KV_EVENT layout
        x.apply_events(0, other)


@pytest.mark.parametrize("bad, exc", [([-1], OverflowError), ([2**64], OverflowError),
                                      (["a"], TypeError), ("ab", TypeError),
                                      (np.zeros(2, dtype=np.float64), TypeError),
                                      (np.zeros((1, 1), dtype=np.uint64), ValueError),
                                      (5, TypeError)])
def test_bad_identities(bad, exc):
    x = PrefixRouterIndex(10, 2)
    with pytest.raises(exc):
        x.match(bad)


def test_match_into_bad_out():
    x = PrefixRouterIndex(10, 4)
    with pytest.raises(ValueError):
        x.match_into([1], np.zeros(3, dtype=np.uint32))
    with pytest.raises(TypeError):
        x.match_into([1], np.zeros(4, dtype=np.int64))
    ro = np.zeros(4, dtype=np.uint32)
    ro.flags.writeable = False
    with pytest.raises(TypeError):
        x.match_into([1], ro)


def test_events_of_a_real_scheduler():
    """Events drained from the facade's automatic cache, matched with its page identities."""
    key = bytes(range(16))
    pt, prompt = 4, np.arange(1, 18, dtype=np.uint32)
    s = qualia.Scheduler(4, 32, pt, 8, cache_key=key)
    s.admit(1, prompt)
    s.reserve(1, len(prompt))
    s.advance(1, len(prompt))
    s.finish(1)
    x = PrefixRouterIndex(64, 2)
    x.apply_events(1, s.drain_events())
    ids = s.page_identities(prompt)
    assert len(ids) == 4
    got = x.match(ids).tolist()
    assert got[0] == 0 and got[1] == s.cached_prefix(np.append(prompt, 0)).pages
    assert x.match(s.page_identities(np.arange(100, 117, dtype=np.uint32))).tolist() == [0, 0]
    s.clear_cache()
    x.apply_events(1, s.drain_events())
    assert len(x) == 0


ops = st.lists(st.one_of(
    st.tuples(st.just("apply"), st.integers(0, 3),
              st.lists(st.tuples(st.sampled_from([S, S, R, C]), st.integers(0, 40)),
                       max_size=12)),
    st.tuples(st.just("remove"), st.integers(0, 3), st.just(None))), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops, st.lists(st.integers(0, 40), max_size=8))
def test_matches_the_model(script, probe):
    # a tiny table (16 slots) over 41 identities: runs, wrap-around and shifting back all occur;
    # structured identities (multiples of 16) share a home slot
    x, m = PrefixRouterIndex(8, 4), Model(8, 4)
    for op, replica, pairs in script:
        if op == "apply":
            pairs = [(k, i * 16) for k, i in pairs]
            x.apply_events(replica, events(*pairs))
            m.apply(replica, pairs)
        else:
            x.remove_replica(replica)
            m.remove_replica(replica)
        assert len(x) == len(m.held)
        for ident in range(0, 41 * 16, 16):
            bits = sum(1 << r for r in m.held.get(ident, ()))
            assert x.replicas_of(ident) == bits
    assert x.stats()["dropped"] == m.dropped
    ids = [i * 16 for i in probe]
    assert x.match(ids).tolist() == m.match(ids)


def test_ownership_busy_while_applying():
    # apply_events resolves its arguments before it owns the index: an __index__ that mutates
    # the index runs before, and the call still applies cleanly
    x = PrefixRouterIndex(10, 2)

    class Sneaky:
        def __index__(self):
            x.apply_events(0, events((S, 99)))
            return 1

    x.apply_events(Sneaky(), events((S, 5)))
    assert x.replicas_of(99) == 0b01 and x.replicas_of(5) == 0b10


def test_route_prefers_the_longest_prefix_minus_cost():
    x = PrefixRouterIndex(100, 4)
    x.apply_events(0, events((S, 1), (S, 2), (S, 3)))
    x.apply_events(1, events((S, 1)))
    out = np.zeros(4, dtype=np.uint32)
    assert x.route([1, 2, 3], np.zeros(3), out) == 0
    assert out.tolist() == [3, 1, 0, 0]
    assert x.route([1, 2, 3], np.array([2.5, 0.0, 0.0]), out) == 1   # 0.5 < 1
    assert x.route([1, 2, 3], np.array([np.inf, np.inf, 0.0]), out) == 2
    assert x.route([1, 2, 3], np.array([np.inf] * 3), out) == -1
    assert x.route([9], np.array([3.0, 1.0, 2.0]), out) == 1          # nobody holds it
    assert x.route([9], np.array([1.0, 1.0]), out) == 0               # ties: lower index


@pytest.mark.parametrize("cost, exc", [(np.array([np.nan]), ValueError),
                                       (np.zeros(5), ValueError),
                                       (np.zeros(2, dtype=np.float32), TypeError),
                                       ([0.0, 1.0], TypeError)])
def test_route_bad_cost(cost, exc):
    x = PrefixRouterIndex(10, 4)
    x.apply_events(0, events((S, 1)))
    out = np.full(4, 7, dtype=np.uint32)
    with pytest.raises(exc):
        x.route([1], cost, out)
    assert out.tolist() == [7, 7, 7, 7]
