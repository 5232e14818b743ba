"""Proof of correctness: the compiled core and the pure-Python twin, step by step.

Two hypothesis state machines:

* ``CoreVsReference`` drives ``qualia.{BlockPool, SequenceBlockTable, PrefixKvStore,
  PrefixIdentity, RequestScheduler}`` and ``qualia.twin.*`` with the same random operations,
  valid and invalid (admissions, copy-on-write, decode rounds with every backend fault and with
  misbehaving Python backends, undersized buffers, prefix publish/attach/evict, direct pool
  operations including corrupting releases, refcounts pushed near 2**32-1 with the
  ``_debug_set_refcount`` hook).  After every step both worlds must agree on return values,
  exception classes and ``.chain``, page ids, reference counts, free counts, runnable views,
  block tables, pending tokens, scratch buffers and the store's contents and recency order; and,
  unless the test itself released a page behind a holder's back, reference counts are conserved
  (refcount == table entries + store occurrences + pages the test holds).

* ``FacadeInvariants`` drives ``qualia.Scheduler`` (no reference twin): every call that raised
  must have left ``stats()``, ``pool.refcounts()``, ``runnable()``, every block table, every
  token count and the store unchanged, and reference counts are conserved after every step.
  Its counters are kept by the machine and compared after every step: the store's entries,
  hits and misses, the active requests and free pages, and the pages copied (each reservation's
  copies, each round's copies as its backend counts them) and allocated (the growth of the
  block tables a reservation or a round wrote), and the decode rounds.

Fast profile (default, a few seconds):
    pytest tests/differential/test_seed_vs_twin.py -q -p no:cacheprovider
Long profile (2000 examples x up to 60 steps per machine: about 110k steps per machine,
220k in all; 4.5 minutes here):
    QUALIA_LONG=1 pytest tests/differential/test_seed_vs_twin.py -q -p no:cacheprovider

No hypothesis health check is suppressed: the machines draw small data quickly, and a slow or
filter-heavy strategy should fail loudly rather than quietly shrink the search.
"""

from __future__ import annotations

import os
import types
from collections import Counter

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import qualia
from qualia import twin as R
from qualia._types import RaggedBatchReceipt
from qualia.errors import QualiaError, RaggedBackendError

LONG = os.environ.get("QUALIA_LONG", "") not in ("", "0")
SETTINGS = settings(
    max_examples=2000 if LONG else 100,
    stateful_step_count=60 if LONG else 50,
    deadline=None,
)

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
ALLOWED = (QualiaError, TypeError, ValueError, OverflowError)

# -- comparing outcomes ---------------------------------------------------------------------------


class Raised:
    def __init__(self, exc):
        self.exc = exc

    def __repr__(self):
        return f"Raised({self.exc!r})"


def attempt(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - compared below
        return Raised(exc)


def describe_exc(exc):
    d = [type(exc)]
    if isinstance(exc, QualiaError):
        d.append(exc.chain)
        root = exc.root
        d.append(type(root))
        if isinstance(root, RaggedBackendError.Failed):
            d.append(root.code)
    return tuple(d)


def norm(v):
    """A comparable form of a result of either implementation."""
    if isinstance(v, Raised):
        return ("raised",) + describe_exc(v.exc)
    if isinstance(v, (qualia.PrefixIdentity, R.PrefixIdentity)):
        return ("identity", v.hex())
    if isinstance(v, np.ndarray):
        return ("array", str(v.dtype), v.shape, v.tolist())
    if isinstance(v, tuple) and hasattr(v, "_fields"):  # Admission, CopyOnWrite, receipt
        return (type(v),) + tuple(norm(x) for x in v)
    if isinstance(v, (list, tuple)):
        return (type(v),) + tuple(norm(x) for x in v)
    if v is None or type(v) in (bool, int, str, bytes):
        return (type(v), v)
    raise AssertionError(f"unexpected result type {type(v).__name__}: {v!r}")


def check_allowed(out, what):
    if isinstance(out, Raised):
        assert isinstance(out.exc, ALLOWED), f"{what} raised an unexpected {out.exc!r}"


# -- prompts, identities, Python backends ----------------------------------------------------------

IDENTS = [
    ((1, 2, 3), b""),
    ((1, 2, 3), b"tenant-b"),
    ((7,), b""),
    ((4, 5, 6, 7, 8), b""),
    ((), b""),
    ((9, 9), "ns"),
]
IDENT_HEX = [R.PrefixIdentity.of_tokens(list(t), ns).hex() for t, ns in IDENTS]
IDENT = st.one_of(st.tuples(st.just("stored"), st.integers(0, 7)), st.integers(0, len(IDENTS) - 1))
RIDS = st.one_of(
    st.tuples(st.just("active"), st.integers(0, 31)),
    st.sampled_from([0, 1, 2, 3, 5, 2**32, U64_MAX]),
)
ACTIVE = st.tuples(st.just("active"), st.integers(0, 31))
TOKENS = st.one_of(st.sampled_from([3, 0, 1, 31999, U32_MAX]), st.integers(0, U32_MAX))
LOGICAL = st.sampled_from([0, 1, 2, 3, 4, 5, 6, U32_MAX])
CODES = st.sampled_from([-1, 1, 7, -(2**31), 2**31 - 1])
VOCABS = st.sampled_from([1, 2, 32000, U32_MAX])
C_FAULTS = [None, "error", "batch_size", "launches", "swap"]
FAULTS = st.sampled_from([None, None, None, "error", "batch_size", "launches", "swap", "raise"])
PY_KINDS = [
    "ok", "ok", "ok_list", "ok_array", "raise", "raise_failed", "write_items", "write_table",
    "reenter", "keep", "none", "short_tuple", "long_tuple", "negative", "float", "too_big",
    "string", "bool", "wrong_tokens", "no_outputs",
]
GROW_ARGS = dict(
    rid=st.sampled_from([0, 1, 2, 3, 5, 2**32, U64_MAX]),
    ident=st.one_of(IDENT, st.none()),
    pages=st.sampled_from([2, 1, 3, 0]),
    per_page=st.sampled_from([2, 1, 4, 0]),
    decode=st.sampled_from([True, False]),
    token=TOKENS,
    rewrite=st.sampled_from([0, 1, 2, 7]),
    make_room=st.sampled_from([True, False]),
)
SIZES = st.sampled_from(["exact", "big"] * 4 + ["short", "zero"])
DECODE_ARGS = dict(
    mode=st.sampled_from(["twin", "twin", "twin", "py_reference", "c_for_both", "python",
                          "python"]),
    fault=FAULTS,
    kind=st.sampled_from(PY_KINDS),
    code=CODES,
    vocab=VOCABS,
    sizes=st.tuples(SIZES, SIZES, SIZES),
)
BAD_INTS = [-1, 2**64, 1.5, None, "1", True]


class PyBackend:
    """A Python backend misbehaving in one of PY_KINDS ways (the same class for both worlds)."""

    def __init__(self, kind, vocab, world):
        self.kind = kind
        self.vocab = vocab
        self.world = world
        self.kept = []
        self.calls = 0

    def execute_ragged(self, items, block_table, outputs):
        self.calls += 1
        n = len(items)
        kind = self.kind
        if kind == "raise":
            raise ValueError("backend exploded")
        if kind == "raise_failed":
            raise RaggedBackendError.Failed(42)
        if kind == "write_items":
            items["token_id"][:] = 5  # read-only: ValueError
        if kind == "write_table":
            block_table[:] = 0  # read-only (even when empty)
        if kind == "reenter":
            # BusyError (a live id: for an unknown id the core reports UnknownRequest first, see
            # tests/robustness/test_bad_input.py::test_reentrant_unknown_request_is_busy_in_both)
            self.world.sched.record_token(int(items["request_id"][0]))
        if kind == "keep":
            self.kept.append(outputs)
        if kind != "no_outputs":
            ids = items["request_id"].tolist()
            slots = items["slot"].tolist()
            pos = items["position"].tolist()
            tok = items["token_id"].tolist()
            for i in range(n):
                t = R.PyHashBackend.next_token(ids[i], pos[i], tok[i], self.vocab)
                if kind == "wrong_tokens":
                    t = (t * 31 + 7) % (U32_MAX + 1)
                outputs[i] = (ids[i], slots[i], t)
        return {
            "ok": RaggedBatchReceipt(n, 1), "ok_list": [n, 1],
            "ok_array": np.array([n, 1], dtype=np.uint64), "none": None,
            "short_tuple": (n,), "long_tuple": (n, 1, 0), "negative": (-1, 1),
            "float": (float(n), 1.0), "too_big": (2**32 + n, 1), "string": "n1",
            "bool": (True, True),
        }.get(kind, (n, 1))


# -- the core vs reference machine -----------------------------------------------------------------


def op(group, pre=None, **strategies):
    """Mark a method as an operation of ``group``: a dispatching rule draws one operation of the
    group (among those whose ``pre`` holds) and its arguments.  Grouping keeps hypothesis'
    uniform choice among rules from drowning the productive rules (prefill, decode, publish) in
    small ones."""

    def deco(f):
        f.op = (group, pre, strategies)
        return f

    return deco


class CoreVsReference(RuleBasedStateMachine):
    @initialize(
        # productive values first: hypothesis leans towards (and shrinks to) the first choice
        num_blocks=st.sampled_from([12, 8, 16, 3, 20, 6, 1, 10]),
        max_requests=st.sampled_from([3, 2, 4, 5, 1]),
        logical_pages=st.sampled_from([4, 3, 5, 2, 6, 0]),
        entries=st.sampled_from([2, 3, 1, 4]),
        max_pages=st.sampled_from([4, 3, 5, 2, 6, 1]),
        prefill=st.sampled_from([2, 1, 3, 0]),
        publish=st.sampled_from([True, False]),
    )
    def setup(self, num_blocks, max_requests, logical_pages, entries, max_pages, prefill,
              publish):
        self.n = num_blocks
        self.worlds = []
        for m in (qualia, R):
            self.worlds.append((m, types.SimpleNamespace(
                pool=m.BlockPool(num_blocks),
                store=m.PrefixKvStore(entries, max_pages),
                sched=m.RequestScheduler(max_requests, logical_pages),
                tables=[],
                backends=[],
            )))
        self.held = Counter()  # references the test itself holds, page -> count
        self.corrupt = False  # a direct release dropped a reference the test did not hold
        self.steps = 0
        # a head start: a few prefilled, seeded requests and maybe a published prefix
        for k in range(prefill):
            self.grow_request(100 + k, None, 1 + k % 2, 2, True, 7 * k, 0, False)
        if publish and any(self.ref.sched.block_table(r) for r in self.active()):
            self.publish_request_prefix(0, 0, 1, "count")

    # -- helpers -----------------------------------------------------------------------------------
    @property
    def ref(self):
        return self.worlds[1][1]

    def both(self, what, fn):
        """Run fn(module, world) in both worlds; assert the outcomes agree; return the core's."""
        outs = [attempt(lambda m=m, w=w: fn(m, w)) for m, w in self.worlds]
        assert norm(outs[0]) == norm(outs[1]), f"{what}: core {outs[0]!r} != reference {outs[1]!r}"
        check_allowed(outs[0], what)
        return outs[0]

    def active(self):
        return self.ref.sched.runnable()["request_id"].tolist()

    def rid(self, r):
        if isinstance(r, tuple):
            ids = self.active()
            return ids[r[1] % len(ids)] if ids else 12345
        return r

    def pick_ident(self, choice):
        """An index into IDENTS: given, or ("stored", k) for the k-th identity the store holds
        (so that admissions and attaches hit)."""
        if isinstance(choice, tuple):
            stored = [IDENT_HEX.index(i.hex()) for i in self.ref.store.identities()
                      if i.hex() in IDENT_HEX]
            return stored[choice[1] % len(stored)] if stored else choice[1] % len(IDENTS)
        return choice

    @staticmethod
    def ident(m, i):
        if i is None:
            return None
        tokens, ns = IDENTS[i]
        return m.PrefixIdentity.of_tokens(list(tokens), ns)

    def pages_from(self, source, k, pick, rand):
        r = self.ref
        if source == "request":
            ids = [i for i in self.active() if r.sched.block_table(i)] or self.active()
            pages = r.sched.block_table(ids[pick % len(ids)]) if ids else []
            return pages[:k] if k else pages
        if source == "request_dup":
            ids = [i for i in self.active() if r.sched.block_table(i)] or self.active()
            pages = r.sched.block_table(ids[pick % len(ids)]) if ids else []
            return pages + pages[:1] + pages[-1:]
        if source == "held":
            pages = [p for p, c in sorted(self.held.items()) for _ in range(min(c, 2))]
            return pages[:k or None]
        if source == "table":
            tables = [t.entries() for t in r.tables if len(t)]
            return tables[pick % len(tables)] if tables else []
        if source == "empty":
            return []
        return list(rand)

    def note_release(self, page, out):
        if not isinstance(out, Raised):
            if self.held[page] > 0:
                self.held[page] -= 1
                if not self.held[page]:
                    del self.held[page]
            else:
                self.corrupt = True

    # -- scheduler ---------------------------------------------------------------------------------
    @op('request', rid=RIDS, ident=st.one_of(st.none(), IDENT))
    def admit(self, rid, ident):
        ident = self.pick_ident(ident)
        rid = self.rid(rid)
        self.both("admit_with_prefix", lambda m, w: w.sched.admit_with_prefix(
            rid, self.ident(m, ident), w.store, w.pool))

    @rule(**GROW_ARGS)
    def grow_request(self, rid, ident, pages, per_page, decode, token, rewrite, make_room):
        """A prefill in one rule (every call compared): admit (finishing the oldest request
        first if the scheduler is full and make_room), append pages, record tokens, touch an
        existing (maybe shared) page, go to Decode with a seeded token."""
        ident = self.pick_ident(ident)
        ids = self.active()
        if make_room and ids and len(ids) == self.ref.sched.max_requests and rid not in ids:
            self.both("finish", lambda m, w: w.sched.finish(ids[0], w.pool))
        self.both("admit_with_prefix", lambda m, w: w.sched.admit_with_prefix(
            rid, self.ident(m, ident), w.store, w.pool))
        if rid not in self.active():
            pages = min(pages, 1)  # unknown request: one round of UnknownRequest is enough
        for _ in range(pages):
            lp = len(self.ref.sched.block_table(rid)) if rid in self.active() else 0
            self.both("ensure_writable", lambda m, w: w.sched.ensure_writable(rid, lp, w.pool))
            for _ in range(per_page):
                self.both("record_token", lambda m, w: w.sched.record_token(rid))
        self.both("ensure_writable", lambda m, w: w.sched.ensure_writable(rid, rewrite, w.pool))
        if decode:
            self.both("mark_prefill_complete", lambda m, w: w.sched.mark_prefill_complete(rid))
            self.both("seed_decode_token", lambda m, w: w.sched.seed_decode_token(rid, token))

    @op('request', rid=RIDS, lp=LOGICAL)
    def ensure_writable(self, rid, lp):
        rid = self.rid(rid)
        self.both("ensure_writable", lambda m, w: w.sched.ensure_writable(rid, lp, w.pool))

    @op('request', rid=RIDS)
    def mark_prefill_complete(self, rid):
        rid = self.rid(rid)
        self.both("mark_prefill_complete", lambda m, w: w.sched.mark_prefill_complete(rid))

    @op('request', rid=RIDS, token=TOKENS)
    def seed_decode_token(self, rid, token):
        rid = self.rid(rid)
        self.both("seed_decode_token", lambda m, w: w.sched.seed_decode_token(rid, token))

    @op('request', rid=RIDS, times=st.integers(1, 3))
    def record_token(self, rid, times):
        rid = self.rid(rid)
        for _ in range(times):
            self.both("record_token", lambda m, w: w.sched.record_token(rid))

    @op('request', rid=RIDS)
    def finish(self, rid):
        rid = self.rid(rid)
        self.both("finish", lambda m, w: w.sched.finish(rid, w.pool))

    @op('request', parent=st.one_of(ACTIVE, ACTIVE, RIDS),
        child=st.one_of(st.sampled_from([200, 201, 2**63]), RIDS), lp=LOGICAL)
    def fork(self, parent, child, lp):
        """fork (any outcome compared, refcounts conserved by `agree`), then the child writes a
        page it shares with the parent: copy-on-write."""
        parent = self.rid(parent)
        child = self.rid(child)
        out = self.both("fork", lambda m, w: w.sched.fork(parent, child, w.pool))
        if not isinstance(out, Raised):
            r = self.ref.sched
            assert r.block_table(child) == r.block_table(parent)
            assert r.pending_token(child) == r.pending_token(parent)
            self.both("ensure_writable", lambda m, w: w.sched.ensure_writable(child, lp, w.pool))

    @op('request', extra=st.integers(-2, 2))
    def runnable_into(self, extra):
        size = max(0, len(self.active()) + extra)
        bufs = {}

        def go(m, w):
            b = np.zeros(size, m.REQUEST_VIEW)
            b["request_id"] = 0xDEAD
            b["token_count"] = 77
            bufs[m] = b
            return w.sched.runnable_into(b)

        self.both("runnable_into", go)
        assert norm(bufs[qualia]) == norm(bufs[R]), "runnable_into wrote different views"

    @rule(**DECODE_ARGS)
    def decode_round(self, mode, fault, kind, code, vocab, sizes):
        r = self.ref
        decoding = [v for v in r.sched.runnable().tolist() if v[2] == 2]
        need_items = len(decoding)
        need_table = sum(len(r.sched.block_table(v[0])) for v in decoding)
        big = (r.sched.max_requests, r.sched.max_requests * r.sched.logical_pages + 2)

        def size(choice, need, biggest):
            return {"exact": need, "big": max(biggest, need), "short": max(need - 1, 0),
                    "zero": 0}[choice]

        n_items = size(sizes[0], need_items, big[0])
        n_table = size(sizes[1], need_table, big[1])
        n_outs = size(sizes[2], need_items, big[0])
        bufs = {}

        def go(m, w):
            cfault = None if fault == "raise" else fault  # "raise" is the Python twin's only
            if mode == "twin":
                b = (qualia.HashBackend(vocab, fault=cfault, code=code) if m is qualia
                     else R.PyHashBackend(vocab, fault=cfault, code=code))
            elif mode == "py_reference":
                b = R.PyHashBackend(vocab, fault=fault, code=code)
            elif mode == "c_for_both":
                b = qualia.HashBackend(vocab, fault=cfault, code=code)
            else:
                b = PyBackend(kind, vocab, w)
            w.backends.append(b)
            items = np.zeros(n_items, m.RAGGED_BATCH_ITEM)
            items["request_id"] = 0xAAAA
            table = np.full(n_table, 0xBBBB, np.uint32)
            outs = np.zeros(n_outs, m.RAGGED_BATCH_OUTPUT)
            outs["next_token_id"] = 0xCCCC
            bufs[m] = (items, table, outs)
            return w.sched.execute_decode_round(b, items, table, outs)

        self.both(f"execute_decode_round[{mode} {fault} {kind}]", go)
        for a, b, name in zip(bufs[qualia], bufs[R], ("items", "table", "outputs")):
            assert norm(a) == norm(b), f"decode round left different {name} scratch"

    @rule(data=st.data())
    def decode_round_again(self, data):
        self.decode_round(**data.draw(st.fixed_dictionaries(DECODE_ARGS)))

    @op('store', pre=lambda self: any(b.kept for _, w in self.worlds for b in w.backends
                                      if isinstance(b, PyBackend)), token=TOKENS)
    def late_write_into_kept_outputs(self, token):
        # a backend that kept its outputs view writes later: only the old scratch changes
        for _, w in self.worlds:
            for b in w.backends:
                if isinstance(b, PyBackend):
                    for v in b.kept:
                        v["next_token_id"] = token
                        v["request_id"] = 999

    # -- prefix store ------------------------------------------------------------------------------
    @rule(
        ident=IDENT,
        source=st.sampled_from(["request", "request_dup", "request", "held", "table", "random",
                                "empty"]),
        k=st.integers(0, 6),
        pick=st.integers(0, 31),
        rand=st.lists(st.integers(0, 24), max_size=6),
        tokens=st.sampled_from([5, 1, 16, 8, U32_MAX - 1, 3, U32_MAX, 0]),
    )
    def publish(self, ident, source, k, pick, rand, tokens):
        ident = self.pick_ident(ident)
        pages = self.pages_from(source, k, pick, rand)
        self.both("publish", lambda m, w: w.store.publish(self.ident(m, ident), pages, tokens,
                                                          w.pool))

    @precondition(lambda self: any(self.ref.sched.block_table(r) for r in self.active()))
    @rule(ident=IDENT, pick=st.integers(0, 31), k=st.integers(0, 6),
          tokens=st.sampled_from(["count", "count", 1, U32_MAX - 1]))
    def publish_request_prefix(self, ident, pick, k, tokens):
        """What an engine does after a prefill: publish the request's first pages."""
        ident = self.pick_ident(ident)
        ids = [r for r in self.active() if self.ref.sched.block_table(r)]
        rid = ids[pick % len(ids)]
        pages = self.ref.sched.block_table(rid)
        pages = pages[:k] if k else pages
        if tokens == "count":
            view = [v for v in self.ref.sched.runnable().tolist() if v[0] == rid][0]
            tokens = max(view[3], 1)
        self.both("publish", lambda m, w: w.store.publish(self.ident(m, ident), pages, tokens,
                                                          w.pool))

    @op('store', pre=lambda self: self.ref.tables, ident=IDENT, t=st.integers(0, 7))
    def store_attach(self, ident, t):
        ident = self.pick_ident(ident)
        t %= len(self.ref.tables)
        self.both("store.attach", lambda m, w: w.store.attach(self.ident(m, ident), w.tables[t],
                                                              w.pool))

    @op('store', ident=IDENT)
    def evict(self, ident):
        ident = self.pick_ident(ident)
        self.both("evict", lambda m, w: w.store.evict(self.ident(m, ident), w.pool))

    @op('store')
    def evict_lru(self):
        self.both("evict_lru", lambda m, w: w.store.evict_lru(w.pool))

    @op('store', ident=IDENT)
    def store_lookups(self, ident):
        ident = self.pick_ident(ident)
        self.both("contains", lambda m, w: w.store.contains(self.ident(m, ident)))
        self.both("in", lambda m, w: self.ident(m, ident) in w.store)
        self.both("pages_of", lambda m, w: w.store.pages_of(self.ident(m, ident)))
        self.both("tokens_of", lambda m, w: w.store.tokens_of(self.ident(m, ident)))

    @op('store', tokens=st.lists(TOKENS, max_size=8),
        ns=st.sampled_from([b"", b"a", "a", "\u00e9", b"\x00" * 3, bytearray(b"zz")]))
    def identity(self, tokens, ns):
        out = self.both("of_tokens", lambda m, w: m.PrefixIdentity.of_tokens(tokens, ns))
        self.both("fromhex", lambda m, w: m.PrefixIdentity.fromhex(out.hex()))
        self.both("digest", lambda m, w: m.PrefixIdentity(out.digest).digest)
        self.both("int", lambda m, w: int(m.PrefixIdentity(out.digest)))

    # -- standalone tables -------------------------------------------------------------------------
    @op('table', pre=lambda self: len(self.ref.tables) < 4, capacity=st.integers(0, 6))
    def new_table(self, capacity):
        for m, w in self.worlds:
            w.tables.append(m.SequenceBlockTable(capacity))

    @op('table', pre=lambda self: self.ref.tables, t=st.integers(0, 7), lp=LOGICAL)
    def table_ensure_writable(self, t, lp):
        t %= len(self.ref.tables)
        self.both("table.ensure_writable", lambda m, w: w.tables[t].ensure_writable(lp, w.pool))

    @op('table', pre=lambda self: self.ref.tables, t=st.integers(0, 7),
        source=st.sampled_from(["request", "request_dup", "held", "table", "random", "empty"]),
        k=st.integers(0, 6), pick=st.integers(0, 31),
        rand=st.lists(st.integers(0, 24), max_size=7))
    def table_attach(self, t, source, k, pick, rand):
        t %= len(self.ref.tables)
        pages = self.pages_from(source, k, pick, rand)
        self.both("table.attach", lambda m, w: w.tables[t].attach(pages, w.pool))

    @op('table', pre=lambda self: self.ref.tables, t=st.integers(0, 7))
    def table_release_all(self, t):
        t %= len(self.ref.tables)
        self.both("table.release_all", lambda m, w: w.tables[t].release_all(w.pool))

    # -- direct pool operations --------------------------------------------------------------------
    @op('pool', times=st.integers(1, 3))
    def pool_allocate(self, times):
        for _ in range(times):
            out = self.both("allocate", lambda m, w: w.pool.allocate())
            if not isinstance(out, Raised):
                self.held[out] += 1

    def any_page(self, source, pick, page):
        if source == "held" and self.held:
            pages = sorted(self.held)
            return pages[pick % len(pages)]
        if source == "mapped":
            mapped = sorted({p for rid in self.active() for p in self.ref.sched.block_table(rid)})
            if mapped:
                return mapped[pick % len(mapped)]
        return page

    @op('pool', source=st.sampled_from(["held", "mapped", "random"]), pick=st.integers(0, 31),
        page=st.one_of(st.integers(0, 24), st.sampled_from([U32_MAX])))
    def pool_retain(self, source, pick, page):
        page = self.any_page(source, pick, page)
        out = self.both("retain", lambda m, w: w.pool.retain(page))
        if not isinstance(out, Raised):
            self.held[page] += 1

    @op('pool', source=st.sampled_from(["held", "held", "held", "mapped", "random"]),
        pick=st.integers(0, 31), page=st.integers(0, 24))
    def pool_release(self, source, pick, page):
        page = self.any_page(source, pick, page)
        out = self.both("release", lambda m, w: w.pool.release(page))
        self.note_release(page, out)

    @op('pool', page=st.one_of(st.integers(0, 24), st.sampled_from([U32_MAX])))
    def pool_refcount(self, page):
        self.both("refcount", lambda m, w: w.pool.refcount(page))

    @op('pool', pre=lambda self: self.held, pick=st.integers(0, 31), below=st.integers(0, 2))
    def push_refcount_near_max(self, pick, below):
        # the test holds a reference on `page`; count the hook's extra references as its own
        pages = sorted(self.held)
        page = pages[pick % len(pages)]
        old = self.ref.pool.refcount(page)
        new = U32_MAX - below
        self.both("_debug_set_refcount", lambda m, w: w.pool._debug_set_refcount(page, new))
        self.held[page] += new - old

    # -- bad arguments (consistently ordered cases; robustness/test_bad_input.py has the rest) --
    @rule(bad=st.sampled_from(BAD_INTS),
          call=st.sampled_from(["retain", "release", "refcount", "record_token", "finish",
                                "mark_prefill_complete", "seed_rid", "seed_token",
                                "ensure_lp", "publish_page", "publish_tokens", "admit_rid",
                                "table_lp", "table_attach", "fork_parent", "fork_child"]))
    def bad_argument(self, bad, call):
        ids = self.active()
        live = ids[0] if ids else 0
        calls = {
            "retain": lambda m, w: w.pool.retain(bad),
            "release": lambda m, w: w.pool.release(bad),
            "refcount": lambda m, w: w.pool.refcount(bad),
            "record_token": lambda m, w: w.sched.record_token(bad),
            "finish": lambda m, w: w.sched.finish(bad, w.pool),
            "mark_prefill_complete": lambda m, w: w.sched.mark_prefill_complete(bad),
            "seed_rid": lambda m, w: w.sched.seed_decode_token(bad, 1),
            "admit_rid": lambda m, w: w.sched.admit_with_prefix(bad, None, w.store, w.pool),
            "fork_parent": lambda m, w: w.sched.fork(bad, 201, w.pool),
            "fork_child": lambda m, w: w.sched.fork(live, bad, w.pool),
        }
        if ids:
            calls["seed_token"] = lambda m, w: w.sched.seed_decode_token(live, bad)
            calls["ensure_lp"] = lambda m, w: w.sched.ensure_writable(live, bad, w.pool)
        calls["publish_page"] = lambda m, w: w.store.publish(self.ident(m, 0), [bad], 1, w.pool)
        calls["publish_tokens"] = lambda m, w: w.store.publish(self.ident(m, 0), [0], bad, w.pool)
        if self.ref.tables:
            calls["table_lp"] = lambda m, w: w.tables[0].ensure_writable(bad, w.pool)
            calls["table_attach"] = lambda m, w: w.tables[0].attach([bad], w.pool)
        fn = calls.get(call)
        if fn is None:
            return
        out = self.both(f"bad argument {call}({bad!r})", fn)
        assert isinstance(out, Raised) and isinstance(out.exc, (TypeError, OverflowError)), out

    # -- dispatch ----------------------------------------------------------------------------------
    def dispatch(self, data, group):
        names = [n for n, (g, pre, _) in OPS.items() if g == group and (pre is None or pre(self))]
        if not names:
            return
        name = data.draw(st.sampled_from(names), label=f"{group} op")
        kwargs = data.draw(st.fixed_dictionaries(OPS[name][2]), label=name)
        getattr(self, name)(**kwargs)

    @rule(data=st.data())
    def request_op(self, data):
        self.dispatch(data, "request")

    @rule(data=st.data())
    def request_op_again(self, data):
        self.dispatch(data, "request")

    @rule(data=st.data())
    def grow_request_again(self, data):
        self.grow_request(**data.draw(st.fixed_dictionaries(GROW_ARGS)))

    @rule(data=st.data())
    def store_op(self, data):
        self.dispatch(data, "store")

    @rule(data=st.data())
    def table_op(self, data):
        self.dispatch(data, "table")

    @rule(data=st.data())
    def pool_op(self, data):
        self.dispatch(data, "pool")

    # -- comparison of the whole state after every step --------------------------------------------
    @invariant()
    def agree(self):
        if not hasattr(self, "worlds"):
            return
        (_, c), (_, r) = self.worlds
        n = self.n
        rc = c.pool.refcounts().tolist()
        rr = [r.pool.refcount(p) for p in range(n)]
        assert rc == rr, f"refcounts differ: core {rc} reference {rr}"
        assert [c.pool.refcount(p) for p in range(n)] == rc
        assert c.pool.free_count == r.pool.free_count
        assert c.pool.num_blocks == r.pool.num_blocks == n
        # free pages + pages in use == num_blocks, even on a corrupted pool
        assert r.pool.free_count + sum(1 for x in rr if x) == n
        # store: contents and recency order
        assert (len(c.store), c.store.hits, c.store.misses) == (
            len(r.store), r.store.hits, r.store.misses)
        ci = [(i.hex(), c.store.pages_of(i), c.store.tokens_of(i)) for i in c.store.identities()]
        ri = [(i.hex(), r.store.pages_of(i), r.store.tokens_of(i)) for i in r.store.identities()]
        assert ci == ri, f"store differs: core {ci} reference {ri}"
        # scheduler
        cv, rv = c.sched.runnable(), r.sched.runnable()
        assert cv.dtype == rv.dtype and cv.tobytes() == rv.tobytes(), (cv, rv)
        assert c.sched.active_count() == r.sched.active_count() == len(rv)
        for rid in rv["request_id"].tolist():
            assert c.sched.block_table(rid) == r.sched.block_table(rid), rid
            assert c.sched.pending_token(rid) == r.sched.pending_token(rid), rid
        # standalone tables
        assert [(len(t), t.capacity, t.entries()) for t in c.tables] == [
            (len(t), t.capacity, t.entries()) for t in r.tables]
        if not self.corrupt:
            expect = Counter(self.held)
            for rid in rv["request_id"].tolist():
                expect.update(r.sched.block_table(rid))
            for t in r.tables:
                expect.update(t.entries())
            for _, pages, _ in ri:
                expect.update(pages)
            assert rr == [expect[p] for p in range(n)], (
                f"refcount conservation broken: counts {rr}, holders {dict(expect)}")
        self.steps += 1

    def teardown(self):
        if not hasattr(self, "worlds"):
            return
        for rid in self.active():
            self.both("finish (teardown)", lambda m, w: w.sched.finish(rid, w.pool))
        for t in range(len(self.ref.tables)):
            self.both("release_all (teardown)", lambda m, w: w.tables[t].release_all(w.pool))
        if self.corrupt:
            return
        assert self.ref.sched.active_count() == 0
        for page, count in sorted(self.held.items()):
            now = self.ref.pool.refcount(page)
            if count > 1:
                self.both("_debug_set_refcount (teardown)",
                          lambda m, w: w.pool._debug_set_refcount(page, now - count + 1))
            self.both("release (teardown)", lambda m, w: w.pool.release(page))
        self.held.clear()
        # every request finished, every table released: the pool holds exactly the store's pages
        occurrences = Counter()
        for i in self.ref.store.identities():
            occurrences.update(self.ref.store.pages_of(i))
        for _, w in self.worlds:
            assert [w.pool.refcount(p) for p in range(self.n)] == [
                occurrences[p] for p in range(self.n)]
            assert w.pool.free_count == self.n - len(occurrences)
        while len(self.ref.store):
            self.both("evict_lru (teardown)", lambda m, w: w.store.evict_lru(w.pool))
        for _, w in self.worlds:
            assert w.pool.free_count == self.n
            assert not any(w.pool.refcount(p) for p in range(self.n))


OPS = {name: f.op for name, f in vars(CoreVsReference).items() if hasattr(f, "op")}
TestCoreVsReference = CoreVsReference.TestCase
TestCoreVsReference.settings = SETTINGS


# -- the facade ------------------------------------------------------------------------------------

PROMPTS = [
    tuple(range(1, 9)),
    (1, 2, 3, 4, 9, 9),
    (5,),
    tuple(range(100, 120)),
    (),
]
# prefix lengths relative to the prompt ("half": len // 2 ...); integers are absolute
PREFIX_LENS = st.sampled_from(["half", None, "short", 1, 0, 4, 25])


def plen(tokens, choice):
    if choice == "half":
        return len(tokens) // 2
    if choice == "short":
        return max(len(tokens) - 1, 0)
    return choice
NAMESPACES = st.sampled_from([b"", b"t2"])


class NoCopyBackend:
    """A Python backend without copy_pages (fine until a round needs a page copy)."""

    def __init__(self, vocab):
        self.inner = R.PyHashBackend(vocab)

    def execute_ragged(self, items, block_table, outputs):
        return self.inner.execute_ragged(items, block_table, outputs)


class FailingCopyBackend(NoCopyBackend):
    def copy_pages(self, copies):
        copies["src_page"][:] = 0  # read-only: raises inside the backend


class FacadeInvariants(RuleBasedStateMachine):
    @initialize(
        max_requests=st.sampled_from([3, 2, 4, 1]),
        num_blocks=st.sampled_from([16, 10, 24, 6, 3, 1]),
        page_tokens=st.sampled_from([2, 4, 1, 3]),
        logical_pages=st.sampled_from([5, 4, 6, 3, 1, 0]),
        prefix_entries=st.sampled_from([2, 3, 1]),
        prefix_pages=st.sampled_from([None, 2, 6, 1]),
        head_start=st.sampled_from([2, 1, 0]),
    )
    def setup(self, max_requests, num_blocks, page_tokens, logical_pages, prefix_entries,
              prefix_pages, head_start):
        self.s = qualia.Scheduler(max_requests, num_blocks, page_tokens, logical_pages,
                                  prefix_entries=prefix_entries, prefix_pages=prefix_pages,
                                  prefix_caching="explicit")
        self.vocab = 32000
        self.pages = {"pages_copied": 0, "pages_allocated": 0, "decode_rounds": 0}
        for k in range(head_start):
            self.serve(100 + k, k, "half", True, b"", False, 3)

    @rule(rid=st.sampled_from([0, 1, 2, 3, 5, U64_MAX]),
          prompt=st.integers(0, len(PROMPTS) - 1), prefix_len=PREFIX_LENS,
          publish=st.sampled_from([True, False]), ns=NAMESPACES,
          make_room=st.sampled_from([True, False]), first=TOKENS)
    def serve(self, rid, prompt, prefix_len, publish, ns, make_room, first):
        """The engine's prefill path (DESIGN.md "Driving the scheduler") in one rule, every call
        guarded: admit with the prompt's prefix, reserve and advance the uncovered tokens,
        complete the prefill, maybe publish the prefix."""
        tokens = list(PROMPTS[prompt])
        prefix_len = plen(tokens, prefix_len)
        ids = self.active()
        if make_room and len(ids) == self.s.max_requests and rid not in ids:
            self.guarded("finish", lambda: self.s.finish(ids[0]))
        adm = self.guarded("admit", lambda: self.s.admit(rid, tokens, namespace=ns,
                                                         prefix_len=prefix_len))
        if isinstance(adm, Raised):
            return
        rest = max(len(tokens) - adm.prefix_tokens, 0)
        self.counted_reserve(rid, rest)
        self.guarded("advance", lambda: self.s.advance(rid, rest))
        self.guarded("complete_prefill", lambda: self.s.complete_prefill(rid, first))
        if publish:
            self.guarded("publish_prefix", lambda: self.s.publish_prefix(
                rid, tokens, prefix_len=prefix_len, namespace=ns))

    @rule(data=st.data())
    def serve_again(self, data):
        self.serve(**data.draw(st.fixed_dictionaries(dict(
            rid=RIDS, prompt=st.integers(0, len(PROMPTS) - 1), prefix_len=PREFIX_LENS,
            publish=st.sampled_from([True, False]), ns=NAMESPACES,
            make_room=st.sampled_from([True, False]), first=TOKENS))))

    def active(self):
        return self.s.runnable()["request_id"].tolist()

    def rid(self, r):
        if isinstance(r, tuple):
            ids = self.active()
            return ids[r[1] % len(ids)] if ids else 12345
        return r

    def snapshot(self):
        s = self.s
        views = s.runnable()
        rids = views["request_id"].tolist()
        store = s.prefixes
        return (
            s.stats(),
            s.pool.refcounts().tobytes(),
            s.pool.free_count,
            views.tobytes(),
            tuple(s.block_table(r).tobytes() for r in rids),
            tuple(s.token_count(r) for r in rids),
            tuple(s.requests.pending_token(r) for r in rids),
            tuple((i.hex(), tuple(store.pages_of(i)), store.tokens_of(i))
                  for i in store.identities()),
        )

    def table_lengths(self):
        return {r: len(self.s.block_table(r)) for r in self.active()}

    def counted_reserve(self, rid, n):
        # a reservation counts its copies, and its fresh pages as allocations
        before = self.table_lengths().get(rid, 0)
        out = self.guarded("reserve", lambda: self.s.reserve(rid, n))
        if not isinstance(out, Raised):
            self.pages["pages_copied"] += len(out)
            self.pages["pages_allocated"] += self.table_lengths()[rid] - before
        return out

    def guarded(self, what, fn):
        before = self.snapshot()
        out = attempt(fn)
        if isinstance(out, Raised):
            check_allowed(out, what)
            after = self.snapshot()
            assert after == before, f"{what} raised {out.exc!r} and changed the state"
        return out

    @rule(rid=RIDS, prompt=st.one_of(st.none(), st.integers(0, len(PROMPTS) - 1)),
          prefix_len=PREFIX_LENS, ns=NAMESPACES)
    def admit(self, rid, prompt, prefix_len, ns):
        rid = self.rid(rid)
        tokens = None if prompt is None else list(PROMPTS[prompt])
        prefix_len = plen(tokens or [], prefix_len)
        out = self.guarded("admit", lambda: self.s.admit(rid, tokens, namespace=ns,
                                                          prefix_len=prefix_len))
        if not isinstance(out, Raised):
            assert out.prefix_hit == (out.prefix_tokens != 0)
            assert self.s.token_count(rid) == out.prefix_tokens

    @rule(rid=RIDS, n=st.one_of(st.integers(0, 12), st.sampled_from([U32_MAX, -1])))
    def reserve(self, rid, n):
        rid = self.rid(rid)
        out = self.counted_reserve(rid, n)
        if not isinstance(out, Raised):
            assert out.dtype == qualia.COPY_OP

    @rule(rid=RIDS, n=st.one_of(st.integers(0, 12), st.sampled_from([U32_MAX, 2**32])))
    def advance(self, rid, n):
        rid = self.rid(rid)
        self.guarded("advance", lambda: self.s.advance(rid, n))

    @rule(rid=RIDS, token=TOKENS)
    def complete_prefill(self, rid, token):
        rid = self.rid(rid)
        self.guarded("complete_prefill", lambda: self.s.complete_prefill(rid, token))

    @rule(rid=RIDS, prompt=st.integers(0, len(PROMPTS) - 1), prefix_len=PREFIX_LENS,
          ns=NAMESPACES)
    def publish_prefix(self, rid, prompt, prefix_len, ns):
        rid = self.rid(rid)
        prefix_len = plen(PROMPTS[prompt], prefix_len)
        self.guarded("publish_prefix", lambda: self.s.publish_prefix(
            rid, list(PROMPTS[prompt]), prefix_len=prefix_len, namespace=ns))

    @rule(kind=st.sampled_from(["c", "c", "c", "py", "nocopy", "failcopy"]),
          fault=st.sampled_from(C_FAULTS), code=CODES)
    def decode(self, kind, fault, code):
        if kind == "c":
            backend = qualia.HashBackend(self.vocab, fault=fault, code=code)
        elif kind == "py":
            backend = R.PyHashBackend(self.vocab, fault=fault if fault else "raise",
                                           code=code)
        elif kind == "nocopy":
            backend = NoCopyBackend(self.vocab)
        else:
            backend = FailingCopyBackend(self.vocab)
        views = self.s.runnable()
        decoding = [v for v in views.tolist() if v[2] == 2]
        pending = {v[0]: self.s.requests.pending_token(v[0]) for v in decoding}
        rounds = self.s.stats()["decode_rounds"]
        lengths = sum(self.table_lengths().values())
        copied = getattr(backend, "pages_copied", 0)
        out = self.guarded(f"decode[{kind} {fault}]", lambda: self.s.decode(backend))
        if isinstance(out, Raised):
            return
        # a round counts the copies its backend made, and the pages its tables grew by
        self.pages["pages_copied"] += getattr(backend, "pages_copied", 0) - copied
        self.pages["pages_allocated"] += sum(self.table_lengths().values()) - lengths
        self.pages["decode_rounds"] += 1
        receipt, outputs = out
        assert receipt.batch_size == len(decoding) == len(outputs)
        assert self.s.stats()["decode_rounds"] == rounds + 1
        assert not outputs.flags.writeable
        for v, o in zip(decoding, outputs.tolist()):
            rid, slot, _, count, _ = v
            assert o[:2] == (rid, slot)
            assert o[2] == qualia.hash_next_token(rid, count, pending[rid], self.vocab)
            assert self.s.token_count(rid) == min(count + 1, U32_MAX)
            assert self.s.requests.pending_token(rid) == o[2]

    @rule(rid=RIDS)
    def finish(self, rid):
        rid = self.rid(rid)
        self.guarded("finish", lambda: self.s.finish(rid))

    @rule(parent=st.one_of(ACTIVE, ACTIVE, RIDS),
          child=st.one_of(st.sampled_from([200, 201]), RIDS),
          reserve=st.sampled_from([0, 0, 1, 3]))
    def fork(self, parent, child, reserve):
        # a fork, then maybe a reservation of the child's next tokens (it copies the shared
        # last page when that page is partly filled)
        parent = self.rid(parent)
        child = self.rid(child)
        out = self.guarded("fork", lambda: self.s.fork(parent, child))
        if not isinstance(out, Raised):
            s = self.s
            assert s.block_table(child).tolist() == s.block_table(parent).tolist()
            assert s.token_count(child) == s.token_count(parent)
            assert s.requests.pending_token(child) == s.requests.pending_token(parent)
            assert s.requests.request_view(child)[2] == qualia.RequestState.DECODE
            if reserve:
                self.counted_reserve(child, reserve)

    @rule()
    def evict_unused_lru(self):
        store = self.s.prefixes
        before = [(i, store.pages_of(i)) for i in store.identities()]
        out = self.guarded("evict_unused_lru", self.s.evict_unused_lru)
        if isinstance(out, Raised):
            return
        refs = self.s.pool.refcounts()
        if out is None:
            # no entry's pages were held by the store alone
            for _, pages in before:
                assert any(refs[p] != pages.count(p) for p in pages)
        else:
            assert out not in store
            # the first entry of recency order whose pages only the store held
            for ident, pages in before:
                if ident == out:
                    break
                assert any(refs[p] != pages.count(p) for p in pages)

    @rule()
    def evict_lru(self):
        self.guarded("evict_lru", self.s.evict_lru)

    @rule(prompt=st.integers(0, len(PROMPTS) - 1), prefix_len=PREFIX_LENS, ns=NAMESPACES)
    def evict(self, prompt, prefix_len, ns):
        prefix_len = plen(PROMPTS[prompt], prefix_len)
        ident = attempt(lambda: self.s.identity_for(list(PROMPTS[prompt]), prefix_len, ns))
        if isinstance(ident, Raised):
            check_allowed(ident, "identity_for")
            return
        assert ident == qualia.PrefixIdentity.of_tokens(
            list(PROMPTS[prompt])[:prefix_len], ns)
        self.guarded("evict", lambda: self.s.evict(ident))

    @rule(rid=RIDS, lp=LOGICAL)
    def raw_ensure_writable(self, rid, lp):
        # the facade exposes its RequestScheduler; using it must keep the facade consistent
        rid = self.rid(rid)
        self.guarded("requests.ensure_writable",
                     lambda: self.s.requests.ensure_writable(rid, lp, self.s.pool))

    @rule(bad=st.sampled_from(BAD_INTS),
          call=st.sampled_from(["admit", "reserve", "advance", "complete_prefill", "finish",
                                "publish_prefix", "token_count", "block_table"]))
    def bad_argument(self, bad, call):
        s = self.s
        fn = {
            "admit": lambda: s.admit(bad),
            "reserve": lambda: s.reserve(bad, 1),
            "advance": lambda: s.advance(bad, 1),
            "complete_prefill": lambda: s.complete_prefill(bad, 1),
            "finish": lambda: s.finish(bad),
            "publish_prefix": lambda: s.publish_prefix(bad, [1]),
            "token_count": lambda: s.token_count(bad),
            "block_table": lambda: s.block_table(bad),
        }[call]
        out = self.guarded(f"{call}({bad!r})", fn)
        assert isinstance(out, Raised) and isinstance(out.exc, (TypeError, OverflowError)), out

    @invariant()
    def conserved(self):
        if not hasattr(self, "s"):
            return
        s = self.s
        refs = s.pool.refcounts().tolist()
        expect = Counter()
        rids = self.active()
        for r in rids:
            expect.update(s.block_table(r).tolist())
        store = s.prefixes
        for i in store.identities():
            expect.update(store.pages_of(i))
        assert refs == [expect[p] for p in range(s.num_pages)], (refs, dict(expect))
        assert s.free_pages + sum(1 for x in refs if x) == s.num_pages
        st_ = s.stats()
        assert st_["active"] == len(rids) == s.active_count
        assert st_["free_pages"] == s.free_pages == s.pool.free_count
        assert st_["used_pages"] == s.num_pages - s.free_pages
        assert st_["prefix_entries"] == len(store)
        assert (st_["prefix_hits"], st_["prefix_misses"]) == (store.hits, store.misses)
        assert {k: st_[k] for k in self.pages} == self.pages

    def teardown(self):
        if not hasattr(self, "s"):
            return
        s = self.s
        for r in self.active():
            s.finish(r)
        occurrences = Counter()
        for i in s.prefixes.identities():
            occurrences.update(s.prefixes.pages_of(i))
        assert s.pool.refcounts().tolist() == [occurrences[p] for p in range(s.num_pages)]
        while s.evict_lru() is not None:
            pass
        assert s.free_pages == s.num_pages


TestFacadeInvariants = FacadeInvariants.TestCase
TestFacadeInvariants.settings = SETTINGS
