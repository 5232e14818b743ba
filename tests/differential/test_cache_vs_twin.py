"""Automatic prefix caching: the compiled core and its pure-Python twin, step by step.

``CacheVsTwin`` drives ``qualia.Scheduler(prefix_caching="auto")`` and
``qualia.twin.cache.Scheduler`` with the same random operations, valid and invalid: admissions
of prompts that share prefixes (system prompts, multi-turn conversations that extend a finished
request's whole token stream, other namespaces), reserve / advance / complete_prefill, decode
rounds with backend faults, finish, cache clears, event drains into buffers of every size,
identity masks that force hash collisions, bad arguments.  After every step both must agree on
the result or the exception (class and chain), every reference count, the free count, the
reclaimable pages in reclaim order, every cache entry, every block table and token count, every
counter (``stats()``: pages copied and allocated, decode rounds, ...; ``cache_stats()``: lookups,
hits, reclaims, events pending and dropped, ...) and the drained events; and reference counts
are conserved: a page's count is the number of block tables that map it plus one if it is
cached.  The namespace tables are small (1 to 4 ids for up to five namespaces), and
``NamespaceTableFull`` is only allowed when no namespace is idle: every id but the empty
namespace's is held by a live request.

Fast profile (default): a few seconds.  Long profile: QUALIA_LONG=1.
"""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
from helpers.step_checks import assert_same_facade_counters
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import qualia
from qualia.errors import PrefixCacheError, QualiaError
from qualia.twin import PyHashBackend
from qualia.twin import cache as T

LONG = os.environ.get("QUALIA_LONG", "") not in ("", "0")
SETTINGS = settings(
    max_examples=1000 if LONG else 150,
    stateful_step_count=80 if LONG else 50,
    deadline=None,
)
U32_MAX = 2**32 - 1
ALLOWED = (QualiaError, TypeError, ValueError, OverflowError)

SYSTEM = [7, 7, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11]
PROMPTS = [
    SYSTEM + [20, 21, 22],
    SYSTEM + [30],
    SYSTEM[:5],
    SYSTEM,
    [1, 2, 3, 4, 5, 6, 7, 8],
    [1, 2, 3, 4, 9],
    [5],
    [],
]
NAMESPACES = st.sampled_from([b"", b"", b"", "tenant-a", b"tenant-b", "tenant-c", b"tenant-d",
                              b"x" * 257])
RIDS = st.one_of(st.tuples(st.just("active"), st.integers(0, 7)), st.integers(0, 5),
                 st.sampled_from([2**64 - 1]))
TOKENS = st.one_of(st.integers(0, 40), st.sampled_from([U32_MAX]))
FAULTS = st.sampled_from([None, None, None, None, "error", "batch_size", "launches", "swap",
                          "raise"])
ACTIVE = st.tuples(st.just("active"), st.integers(0, 7))
MASKS = st.sampled_from([2**64 - 1, 2**64 - 1, 0, 0x3])


class Raised:
    def __init__(self, exc):
        self.exc = exc


def attempt(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - compared below
        return Raised(exc)


def norm(v):
    if isinstance(v, Raised):
        d = ("raised", type(v.exc))
        if isinstance(v.exc, QualiaError):
            d += (v.exc.chain,)
        return d
    if isinstance(v, np.ndarray):
        return ("array", str(v.dtype), v.tolist())
    if isinstance(v, tuple):
        return tuple(norm(x) for x in v)
    return v


class CacheVsTwin(RuleBasedStateMachine):
    @initialize(
        max_requests=st.sampled_from([3, 2, 4, 1]),
        num_blocks=st.sampled_from([12, 8, 24, 5, 2]),
        page_tokens=st.sampled_from([2, 4, 1, 3]),
        logical_pages=st.sampled_from([8, 6, 12, 3]),
        max_namespaces=st.sampled_from([4, 2, 3, 1]),
        event_capacity=st.sampled_from([64, 5, 0]),
        key=st.binary(min_size=16, max_size=16),
    )
    def setup(self, max_requests, num_blocks, page_tokens, logical_pages, max_namespaces,
              event_capacity, key):
        args = (max_requests, num_blocks, page_tokens, logical_pages)
        kw = dict(cache_key=key, max_namespaces=max_namespaces, event_capacity=event_capacity)
        self.c = qualia.Scheduler(*args, **kw)
        self.t = T.Scheduler(*args, **kw)
        self.pt = page_tokens
        self.streams = {}      # rid -> the token stream the test believes the request has
        self.ns_of = {}        # rid -> the namespace (bytes) of each live request
        self.max_namespaces = max_namespaces
        self.history = [[]]    # finished streams: later prompts continue them

    # -- running one call on both -----------------------------------------------------------------
    def both(self, name, *args, **kw):
        a = attempt(lambda: getattr(self.c, name)(*args, **kw))
        b = attempt(lambda: getattr(self.t, name)(*args, **kw))
        assert norm(a) == norm(b), (name, args, kw, norm(a), norm(b))
        if isinstance(a, Raised):
            assert isinstance(a.exc, ALLOWED), f"{name} raised an unexpected {a.exc!r}"
        return a

    def active(self):
        return self.c.runnable()["request_id"].tolist()

    def rid(self, r):
        if isinstance(r, tuple):
            ids = self.active()
            return ids[r[1] % len(ids)] if ids else 12345
        return r

    def new_rid(self):
        ids = set(self.active())
        return next(r for r in range(100, 200) if r not in ids)

    # -- rules -------------------------------------------------------------------------------------
    @rule(rid=RIDS, prompt=st.integers(0, len(PROMPTS) - 1), ns=NAMESPACES,
          cont=st.integers(0, 7), as_array=st.booleans())
    def admit(self, rid, prompt, ns, cont, as_array):
        rid = self.rid(rid)
        if cont % 4 != 3:   # a later turn of a finished conversation
            tokens = self.history[-1 - cont % len(self.history)] + list(PROMPTS[prompt])
        else:
            tokens = list(PROMPTS[prompt])
        arg = np.array(tokens, dtype=np.uint32) if as_array else tokens
        out = self.both("admit", rid, arg, namespace=ns)
        self.check_table_full(out)
        if not isinstance(out, Raised):
            self.streams[rid] = list(tokens)
            self.ns_of[rid] = ns.encode() if isinstance(ns, str) else ns
            assert out.prefix_tokens % self.pt == 0
            assert out.prefix_tokens < max(len(tokens), 1)   # one token is left to compute

    @rule(prompt=st.integers(0, len(PROMPTS) - 1), ns=NAMESPACES, cont=st.integers(0, 7),
          first=TOKENS, rounds=st.integers(0, 6), finish=st.sampled_from([True, True, False]))
    def serve(self, prompt, ns, cont, first, rounds, finish):
        """One conversation turn: admit (continuing a finished stream or not), prefill,
        decode a few rounds, finish and remember the whole stream."""
        rid = self.new_rid()
        active = self.active()
        if len(active) == self.c.max_requests:
            self.finish(active[0], True)
        self.admit(rid, prompt, ns, cont, False)
        if rid not in self.streams:
            return
        self.prefill(rid, first, 0)
        for _ in range(rounds):
            self.decode(None, 32000)
        if finish:
            self.finish(rid, True)

    @rule(prompt=st.integers(0, len(PROMPTS) - 1), ns=NAMESPACES, cont=st.integers(0, 7),
          first=TOKENS, rounds=st.integers(1, 3), reserve=st.sampled_from([0, 1, 3]))
    def serve_and_fork(self, prompt, ns, cont, first, rounds, reserve):
        """A request served up to its first decode, then forked: the child shares the partly
        filled last page, which the next reservation or decode round copies."""
        rid = self.new_rid()
        self.serve(prompt, ns, cont, first, 0, False)
        active = self.active()
        if rid in active:
            child = next(r for r in (300, 301, 302, 303) if r not in active)
            self.fork(rid, child, rounds, True, reserve)

    @rule(prompt=st.integers(0, len(PROMPTS) - 1), ns=NAMESPACES, cont=st.integers(0, 7))
    def probe(self, prompt, ns, cont):
        tokens = self.history[-1 - cont % len(self.history)] + list(PROMPTS[prompt])
        before = self.state()
        self.both("cached_prefix_tokens", tokens, ns)
        self.both("cached_prefix", tokens, ns)
        assert self.state() == before

    @rule(rid=RIDS)
    def admit_without_prompt(self, rid):
        rid = self.rid(rid)
        if not isinstance(self.both("admit", rid), Raised):
            self.streams[rid] = []
            self.ns_of[rid] = b""

    @rule(rid=RIDS, first=TOKENS, extra=st.sampled_from([0, 0, 1, -1]))
    def prefill(self, rid, first, extra):
        """reserve + advance the rest of the prompt, then complete_prefill."""
        rid = self.rid(rid)
        stream = self.streams.get(rid, [])
        count = attempt(lambda: self.c.token_count(rid))
        if isinstance(count, Raised):
            return
        rest = max(len(stream) - count + extra, 0)
        if isinstance(self.both("reserve", rid, rest), Raised):
            return
        self.both("advance", rid, rest)
        self.both("complete_prefill", rid, first)

    @rule(rid=RIDS, n=st.one_of(st.integers(0, 6), st.sampled_from([U32_MAX, -1])))
    def reserve(self, rid, n):
        rid = self.rid(rid)
        self.both("reserve", rid, n)

    @rule(rid=RIDS, n=st.one_of(st.integers(0, 6), st.sampled_from([2**32])))
    def advance(self, rid, n):
        rid = self.rid(rid)
        self.both("advance", rid, n)

    @rule(rid=RIDS, token=TOKENS)
    def complete_prefill(self, rid, token):
        rid = self.rid(rid)
        self.both("complete_prefill", rid, token)

    @rule(fault=FAULTS, vocab=st.sampled_from([32000, 3]))
    def decode(self, fault, vocab):
        views = self.c.runnable().tolist()
        before = {v[0]: (v[3], self.c.requests.pending_token(v[0])) for v in views if v[2] == 2}
        backend_c = PyHashBackend(vocab, fault=fault)
        backend_t = PyHashBackend(vocab, fault=fault)
        a = attempt(lambda: self.c.decode(backend_c))
        b = attempt(lambda: self.t.decode(backend_t))
        assert norm(a) == norm(b), (fault, norm(a), norm(b))
        if isinstance(a, Raised):
            assert isinstance(a.exc, ALLOWED), a.exc
            return
        for rid, (count, token) in before.items():
            s = self.streams.setdefault(rid, [])
            if count <= len(s):
                del s[count:]
                s.append(token)

    @rule(rid=RIDS, keep=st.booleans())
    def finish(self, rid, keep):
        rid = self.rid(rid)
        count = attempt(lambda: self.c.token_count(rid))
        if not isinstance(self.both("finish", rid), Raised):
            self.ns_of.pop(rid, None)
            stream = self.streams.pop(rid, [])
            if keep and not isinstance(count, Raised):
                self.history.append(stream[:count])

    @rule(parent=st.one_of(ACTIVE, ACTIVE, RIDS),
          child=st.one_of(st.sampled_from([300, 301, 302]), RIDS), rounds=st.integers(0, 3),
          room=st.booleans(), reserve=st.sampled_from([0, 0, 1, 3]))
    def fork(self, parent, child, rounds, room, reserve):
        """Fork (valid or not: unknown parent, parent in its prefill, duplicate child, full
        table), then maybe a reservation of the child's next tokens and a few decode rounds:
        either copies the shared last page."""
        parent = self.rid(parent)
        child = self.rid(child)
        others = [r for r in self.active() if r != parent]
        if room and others and len(others) + 1 == self.c.max_requests:
            self.finish(others[0], True)
        before = self.state()
        out = self.both("fork", parent, child)
        if isinstance(out, Raised):
            assert self.state() == before, f"fork raised {out.exc!r} and changed the state"
            return
        assert self.c.block_table(child).tolist() == self.c.block_table(parent).tolist()
        assert self.c.token_count(child) == self.c.token_count(parent)
        assert self.c.requests.pending_token(child) == self.c.requests.pending_token(parent)
        self.streams[child] = list(self.streams.get(parent, []))
        self.ns_of[child] = self.ns_of[parent]
        if reserve:
            self.both("reserve", child, reserve)
        for _ in range(rounds):
            self.decode(None, 32000)

    @rule()
    def clear_cache(self):
        self.both("clear_cache")

    @rule(size=st.sampled_from([None, None, 0, 1, 3, 100]))
    def drain_events(self, size):
        if size is None:
            self.both("drain_events")
            return
        a = np.zeros(size, dtype=qualia.KV_EVENT)
        b = np.zeros(size, dtype=qualia.KV_EVENT)
        na = self.c.drain_events(a)
        nb = self.t.drain_events(b)
        assert na == nb and a.tolist() == b.tolist()

    @rule(mask=MASKS)
    def identity_mask(self, mask):
        self.both("_debug_identity_mask", mask)

    @rule(rid=RIDS, bad=st.sampled_from([-1, 2**64, 1.5, None, True, "1"]),
          call=st.sampled_from(["admit", "reserve", "advance", "complete_prefill", "finish",
                                "admit_prefix_len", "admit_prompt", "admit_ns", "fork_parent",
                                "fork_child"]))
    def bad_argument(self, rid, bad, call):
        rid = self.rid(rid)
        fn = {
            "admit": lambda s: s.admit(bad),
            "reserve": lambda s: s.reserve(rid, bad),
            "advance": lambda s: s.advance(rid, bad),
            "complete_prefill": lambda s: s.complete_prefill(rid, bad),
            "finish": lambda s: s.finish(bad),
            "admit_prefix_len": lambda s: s.admit(rid, [1, 2, 3], prefix_len=2),
            "admit_prompt": lambda s: s.admit(rid, [1, bad, 3]),
            "admit_ns": lambda s: s.admit(rid, [1, 2, 3], namespace=bad),
            "fork_parent": lambda s: s.fork(bad, 300),
            "fork_child": lambda s: s.fork(rid, bad),
        }[call]
        before = self.state()
        a = attempt(lambda: fn(self.c))
        b = attempt(lambda: fn(self.t))
        assert norm(a) == norm(b), (call, bad, norm(a), norm(b))
        if isinstance(a, Raised):
            assert isinstance(a.exc, ALLOWED)
            assert self.state() == before, f"{call}({bad!r}) raised and changed the state"
        elif call.startswith("admit"):
            self.streams[rid if call != "admit" else bad] = []
            self.ns_of[rid if call != "admit" else bad] = \
                bad.encode() if call == "admit_ns" else b""
        elif call.startswith("fork"):
            self.streams[bad] = list(self.streams.get(rid, []))
            self.ns_of[bad] = self.ns_of[rid]

    @rule(rid=RIDS)
    def overlong_prompt(self, rid):
        rid = self.rid(rid)
        before = self.state()
        too_long = list(range(self.c.logical_pages * self.pt + 1))
        out = self.both("admit", rid, too_long)
        assert isinstance(out, Raised) and isinstance(out.exc, ValueError)
        assert self.state() == before

    def check_table_full(self, out):
        """A namespace whose every page is reclaimable (and no live request uses) gives its id
        to a new namespace: the table is full only when every id but the empty namespace's is
        held by a namespace of a live request."""
        if isinstance(out, Raised) and isinstance(out.exc, PrefixCacheError.NamespaceTableFull):
            live = {self.ns_of[r] for r in self.active()} - {b""}
            assert self.c.cache_stats().namespaces == self.max_namespaces
            assert len(live) == self.max_namespaces - 1, (live, self.max_namespaces)

    # -- comparing the two worlds ------------------------------------------------------------------
    def state(self):
        c = self.c
        rids = self.active()
        return (
            c.pool.refcounts().tolist(),
            c.pool.free_count,
            c.free_pages,
            c.reclaimable_pages().tolist(),
            tuple(c.cache_entry(p) for p in range(c.num_pages)),
            c.runnable().tolist(),
            tuple(c.block_table(r).tolist() for r in rids),
            c.cache_stats(),
        )

    @invariant()
    def agree(self):
        if not hasattr(self, "c"):
            return
        c, t = self.c, self.t
        assert c.pool.refcounts().tolist() == t.pool._refcounts
        assert c.pool.free_count == t.pool.free_count
        assert c.free_pages == t.free_pages
        assert c.reclaimable_pages().tolist() == t.reclaimable_pages().tolist()
        for p in range(c.num_pages):
            assert c.cache_entry(p) == t.cache_entry(p), p
        assert c.runnable().tolist() == t.runnable().tolist()
        for r in self.active():
            assert c.block_table(r).tolist() == t.block_table(r).tolist()
        assert_same_facade_counters(c, t)

    @invariant()
    def conserved(self):
        if not hasattr(self, "c"):
            return
        c = self.c
        expect = Counter()
        for r in self.active():
            expect.update(c.block_table(r).tolist())
        refs = c.pool.refcounts().tolist()
        for p in range(c.num_pages):
            cached = c.cache_entry(p) is not None
            assert refs[p] == expect[p] + cached, (p, refs[p], expect[p], cached)
            if cached:
                assert c.cache_entry(p).reclaimable == (expect[p] == 0)
        st_ = c.cache_stats()
        assert st_.reclaimable_pages == len(c.reclaimable_pages())
        assert c.free_pages == c.pool.free_count + st_.reclaimable_pages

    def teardown(self):
        if not hasattr(self, "c"):
            return
        for r in self.active():
            self.both("finish", r)
        self.agree()
        self.both("clear_cache")
        self.agree()
        assert self.c.pool.free_count == self.c.num_pages


TestCacheVsTwin = CacheVsTwin.TestCase
TestCacheVsTwin.settings = SETTINGS
