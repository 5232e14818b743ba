"""Pure-Python twin of automatic prefix caching (docs/DESIGN.md, "Automatic prefix caching").

``Scheduler`` here is the facade ``qualia.Scheduler`` in ``prefix_caching="auto"`` mode, written
plainly: dicts and ordered dicts instead of intrusive lists and open addressing, Python ints for
the hash.  It makes the same decisions in the same order as the compiled core (which pages are
shared at admission, which pages are inserted as they fill, which pages are reclaimed and in what
order, every event and counter, every page id the pool hands out), so the stateful tests can
compare the two after every step.  It takes Python decode backends only (``execute_ragged``).

It is a model, not a fast path.  It stays one file past 600 lines on purpose: it is read beside
core/cache/pagecache.pxi, core/cache/autoprefix.pxi and the facade's automatic mode, function by
function.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Dict, List, Optional, Set, Tuple

import numpy as np

from qualia._types import (
    Admission,
    CachedPrefix,
    CacheEntry,
    CacheStats,
    RaggedBatchReceipt,
    RequestState,
)
from qualia.errors import (
    DecodeRoundError,
    PoolError,
    PrefixCacheError,
    SchedulerError,
    TableError,
)
from qualia.twin.seed import (
    COPY_OP,
    RAGGED_BATCH_ITEM,
    RAGGED_BATCH_OUTPUT,
    REQUEST_VIEW,
    U32_MAX,
    BlockPool,
    SequenceBlockTable,
    _int,
    _namespace_bytes,
    _receipt,
    _RequestSlot,
    _u32,
    _u64,
    backend_attr,
)

__all__ = ["Scheduler", "KV_EVENT", "KV_STORED", "KV_REMOVED", "KV_CLEARED", "NS_MAX_BYTES",
           "page_chain", "page_identity", "namespace_hash",
           "expand_key"]

M32 = 2**32 - 1
M64 = 2**64 - 1
NS_MAX_BYTES = 256
KV_STORED, KV_REMOVED, KV_CLEARED = 1, 2, 3

try:  # pragma: no cover - depends on whether the core is built
    from qualia._core import KV_EVENT
except ImportError:
    KV_EVENT = np.dtype({"names": ["identity", "parent", "namespace_id", "token_count", "page",
                                   "kind", "has_parent"],
                         "formats": ["<u8", "<u8", "<u4", "<u4", "<u4", "u1", "u1"],
                         "offsets": [0, 8, 16, 20, 24, 28, 29], "itemsize": 32}, align=True)


# -- the hash --------------------------------------------------------------------------------------

def mix64(z: int) -> int:
    """The splitmix64 finaliser."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def mum(a: int, b: int) -> int:
    """64x64 -> 128-bit product, folded: low word XOR high word."""
    r = a * b
    return (r & M64) ^ (r >> 64)


def nh_words(page_tokens: int) -> int:
    return 2 * ((page_tokens + 3) // 4)


def expand_key(key: bytes, page_tokens: int) -> Tuple[List[int], List[int]]:
    """The 8 scalar keys and the NH key words derived from a 16-byte key."""
    s = int.from_bytes(key[:8], "little") ^ 0x6A09E667F3BCC908
    t = int.from_bytes(key[8:16], "little") ^ 0xBB67AE8584CAA73B
    words = []
    for _ in range(8 + nh_words(page_tokens)):
        s = (s + 0x9E3779B97F4A7C15) & M64
        t = (t + 0xD1B54A32D192ED03) & M64
        words.append(mix64(mix64(s) ^ t))
    return words[:8], words[8:]


def page_chain(k: List[int], nh: List[int], parent: int, has_parent: bool, ns_hash: int,
               tokens) -> int:
    """Chain value of one full page: NH with 64-bit words over the tokens (two tokens per
    word, little-endian, zero-padded to a multiple of four tokens; 128-bit sum), folded to 64
    bits with the namespace hash, then with the parent page's chain value."""
    tok = list(tokens) + [0] * (-len(tokens) % 4)
    s = 0
    for j in range(0, len(tok), 4):
        w0 = tok[j] | tok[j + 1] << 32
        w1 = tok[j + 2] | tok[j + 3] << 32
        s += ((w0 + nh[j // 2]) & M64) * ((w1 + nh[j // 2 + 1]) & M64)
    s &= 2**128 - 1
    u = mum((s & M64) ^ k[2], (s >> 64) ^ k[4]) ^ ns_hash
    x = parent if has_parent else k[0]
    return mum(x ^ k[1], u ^ k[3])


def page_identity(k: List[int], chain: int) -> int:
    """A page's identity: the splitmix64 finaliser of its chain value."""
    return mix64(chain ^ k[5])


def namespace_hash(k: List[int], name: bytes) -> int:
    h = k[6] ^ len(name)
    for i in range(0, len(name), 8):
        h = (mix64(h ^ int.from_bytes(name[i:i + 8], "little")) + k[7]) & M64
    return mix64((h + k[7]) & M64)


def _cache_key(cache_key) -> bytes:
    if cache_key is None:
        return os.urandom(16)
    if isinstance(cache_key, str):
        raise TypeError("cache_key must be 16 bytes, not str")
    try:
        key = bytes(memoryview(cache_key).cast("B"))
    except TypeError:
        raise TypeError(f"cache_key must be 16 bytes, not {type(cache_key).__name__}") from None
    if len(key) != 16:
        raise ValueError(f"cache_key must be exactly 16 bytes, got {len(key)}")
    return key


# -- the cache -------------------------------------------------------------------------------------

class _Entry:
    """One cached page (a record of core/cache/pagecache.pxi)."""

    __slots__ = ("ident", "parent_ident", "has_parent", "parent", "parent_gen", "gen", "ns",
                 "tokens")

    def __init__(self) -> None:
        self.ident = 0
        self.parent_ident = 0
        self.has_parent = False
        self.parent = U32_MAX
        self.parent_gen = 0
        self.gen = 0
        self.ns = 0
        self.tokens: Tuple[int, ...] = ()


class _Stream:
    """One slot's token stream (core/cache/autoprefix.pxi): known tokens, chain values (``ids``),
    and the entry standing for each handed-over page (``canon``: (page, generation))."""

    __slots__ = ("known", "hashed", "done", "ns", "live", "broken", "tokens", "ids", "canon",
                 "pending")

    def __init__(self) -> None:
        self.known = 0
        self.hashed = 0
        self.done = 0
        self.ns = 0
        self.live = False
        self.broken = False
        self.tokens: List[int] = []
        self.ids: List[int] = []
        self.canon: List[Tuple[int, int]] = []
        self.pending: Optional[Tuple[int, int]] = None


class Scheduler:
    """``qualia.Scheduler(..., prefix_caching="auto")`` in plain Python."""

    def __init__(self, max_requests, num_pages, page_tokens, logical_pages, prefix_entries=64,
                 prefix_pages=None, prefix_caching="auto", cache_key=None, max_namespaces=1024,
                 event_capacity=4096) -> None:
        pt = _u32(page_tokens, "page_tokens")
        if pt == 0:
            raise ValueError("page_tokens must be at least 1")
        if prefix_caching != "auto":
            raise ValueError("the twin models prefix_caching='auto' only")
        key = _cache_key(cache_key)
        max_ns = _u32(max_namespaces, "max_namespaces")
        if max_ns == 0 or max_ns > (1 << 20):
            raise ValueError(f"max_namespaces must be in [1, 1048576], got {max_ns}")
        ev_cap = _u32(event_capacity, "event_capacity")
        if ev_cap > (1 << 26):
            raise ValueError(f"event_capacity must be in [0, 67108864], got {ev_cap}")
        self.page_tokens = pt
        self.pool = BlockPool(num_pages)
        mr = _int(max_requests, "max_requests", 65536, minimum=1)
        self._lp = _u32(logical_pages, "logical_pages")
        self._slots = [_RequestSlot(self._lp) for _ in range(mr)]
        self._streams = [_Stream() for _ in range(mr)]
        self._k, self._nh = expand_key(key, pt)
        self._mask = M64
        self._parent_mask = M64
        # cache
        self._entries: Dict[int, _Entry] = {}
        self._index: Dict[int, int] = {}
        self._inuse: Set[int] = set()          # cached pages a request holds (no order)
        self._reclaimable: "OrderedDict[int, None]" = OrderedDict()
        self._gen = 0
        # namespaces: name -> id, id -> [name, hash, refs, reclaimable pages]; free ids with
        # the lowest on top; the idle namespaces (every reference a reclaimable page), least
        # recently used first
        self._ns_ids: Dict[bytes, int] = {b"": 0}
        self._ns: Dict[int, list] = {0: [b"", namespace_hash(self._k, b""), 0, 0]}
        self._ns_free = list(range(max_ns - 1, 0, -1))
        self._ns_idle: "OrderedDict[int, None]" = OrderedDict()
        # events
        self._ev_cap = ev_cap
        self._events: List[tuple] = []
        self._dropped = 0
        self._c = dict(lookups=0, lookup_tokens=0, hit_tokens=0, reclaims=0, collisions=0,
                       stored=0, duplicates=0, pages_hashed=0)
        # stats(): pages copied (copy-on-write) and allocated (fresh pages, copies' destinations
        # not among them) by reserve and decode rounds, and the decode rounds
        self._pages = dict(copied=0, allocated=0, rounds=0)

    # -- properties -------------------------------------------------------------------------------
    @property
    def max_requests(self) -> int:
        return len(self._slots)

    @property
    def logical_pages(self) -> int:
        return self._lp

    @property
    def num_pages(self) -> int:
        return self.pool.num_blocks

    @property
    def active_count(self) -> int:
        return sum(1 for s in self._slots if s.state != RequestState.EMPTY)

    @property
    def free_pages(self) -> int:
        return self.pool.free_count + len(self._reclaimable)

    @property
    def prefix_caching(self) -> str:
        return "auto"

    # -- cache primitives (pagecache.pxi) ----------------------------------------------------------
    def _chain(self, parent: int, has_parent: bool, ns_hash: int, tokens) -> int:
        return page_chain(self._k, self._nh, parent & self._parent_mask, has_parent, ns_hash,
                          tokens)

    def _ident(self, chain: int) -> int:
        return page_identity(self._k, chain) & self._mask

    def _emit(self, kind, ident, parent, has_parent, ns, tokens, page) -> None:
        if len(self._events) == self._ev_cap:
            self._dropped += 1
            return
        self._events.append((ident, parent, ns, tokens, page, kind, int(has_parent)))

    def _state(self, page: int) -> int:
        if page in self._inuse:
            return 1
        if page in self._reclaimable:
            return 2
        return 0

    def _on_release(self, page: int) -> None:
        if page in self._inuse and self.pool.refcount(page) == 1:
            self._inuse.discard(page)
            self._reclaimable[page] = None
            ns = self._entries[page].ns
            self._ns[ns][3] += 1
            self._ns_touch(ns)

    def _on_retain(self, page: int) -> None:
        if page in self._reclaimable and self.pool.refcount(page) >= 2:
            del self._reclaimable[page]
            self._inuse.add(page)
            ns = self._entries[page].ns
            self._ns[ns][3] -= 1
            self._ns_touch(ns)

    def _matches(self, q: int, ns: int, has_parent: bool, parent: int, parent_gen: int,
                 tokens) -> bool:
        e = self._entries[q]
        if e.ns != ns or e.has_parent != has_parent:
            return False
        if has_parent and (e.parent != parent or e.parent_gen != parent_gen):
            return False
        return e.tokens == tuple(tokens)

    def _live(self, page: int, gen: int) -> bool:
        e = self._entries.get(page)
        return e is not None and e.gen == gen

    def _insert(self, page, ident, has_parent, parent_ident, parent, parent_gen, ns,
                tokens) -> bool:
        try:
            self.pool.retain(page)
        except PoolError:
            return False
        self._gen += 1
        e = _Entry()
        e.ident = ident
        e.parent_ident = parent_ident if has_parent else 0
        e.has_parent = has_parent
        e.parent = parent if has_parent else U32_MAX
        e.parent_gen = parent_gen if has_parent else 0
        e.gen = self._gen
        e.ns = ns
        e.tokens = tuple(tokens)
        self._entries[page] = e
        self._index[ident] = page
        if self.pool.refcount(page) == 1:
            self._reclaimable[page] = None
            self._ns[ns][3] += 1
        else:
            self._inuse.add(page)
        self._ns_ref(ns)
        self._c["stored"] += 1
        self._emit(KV_STORED, ident, e.parent_ident, has_parent, ns, self.page_tokens, page)
        return True

    def _ns_touch(self, ns: int) -> None:
        """After a namespace's references or reclaimable pages changed: it is idle (on the idle
        list, joining at the most recent end) while it has references and all are reclaimable
        pages.  Id 0 is never idle (it is never freed)."""
        refs, rec = self._ns[ns][2], self._ns[ns][3]
        if ns != 0 and refs != 0 and refs == rec:
            if ns not in self._ns_idle:
                self._ns_idle[ns] = None
        else:
            self._ns_idle.pop(ns, None)

    def _ns_ref(self, ns: int) -> None:
        self._ns[ns][2] += 1
        self._ns_touch(ns)

    def _ns_unref(self, ns: int) -> None:
        self._ns[ns][2] -= 1
        self._ns_touch(ns)
        self._ns_free_if_unused(ns)

    def _intern(self, name: bytes) -> int:
        """The id of namespace `name`, interning it when new; with every id in use, the least
        recently used idle namespace's pages are reclaimed (least recently used first) to free
        its id.  ``NamespaceTableFull``, changing nothing, when no namespace is idle."""
        ns = self._ns_ids.get(name)
        if ns is not None:
            return ns
        if not self._ns_free:
            if not self._ns_idle:
                raise PrefixCacheError.NamespaceTableFull(None, f"{len(self._ns)} namespaces")
            victim = next(iter(self._ns_idle))
            for page in [q for q in self._reclaimable if self._entries[q].ns == victim]:
                try:
                    self._drop(page, True)
                except PoolError as exc:     # the pool was changed behind the cache's back
                    raise SchedulerError.Table(TableError.VARIANTS[exc.variant]()) from exc
                self._c["reclaims"] += 1
        ns = self._ns_free.pop()
        self._ns_ids[name] = ns
        self._ns[ns] = [name, namespace_hash(self._k, name), 0, 0]
        return ns

    def _ns_free_if_unused(self, ns: int) -> None:
        if ns == 0 or self._ns[ns][2] != 0:
            return
        del self._ns_ids[self._ns[ns][0]]
        del self._ns[ns]
        self._ns_free.append(ns)

    def _drop(self, page: int, emit: bool) -> None:
        e = self._entries.pop(page)
        del self._index[e.ident]
        self._inuse.discard(page)
        if page in self._reclaimable:
            del self._reclaimable[page]
            self._ns[e.ns][3] -= 1
        self._ns_unref(e.ns)
        if emit:
            self._emit(KV_REMOVED, e.ident, e.parent_ident, e.has_parent, e.ns,
                       self.page_tokens, page)
        self.pool.release(page)

    def _make_room(self, need: int) -> Optional[str]:
        free = self.pool.free_count
        if need <= free:
            return None
        if need > free + len(self._reclaimable):
            return "Exhausted"
        while self.pool.free_count < need:
            page = next(iter(self._reclaimable))
            try:
                self._drop(page, True)
            except PoolError as exc:     # the pool was changed behind the cache's back
                return exc.variant
            self._c["reclaims"] += 1
        return None

    # -- the facade's automatic mode (autoprefix.pxi) ----------------------------------------------
    def _find(self, request_id) -> int:
        for i, s in enumerate(self._slots):
            if s.state != RequestState.EMPTY and s.request_id == request_id:
                return i
        raise SchedulerError.UnknownRequest(None, f"request {request_id}")

    def _load_tokens(self, prompt) -> List[int]:
        cap = max(self._lp * self.page_tokens, 1)
        if isinstance(prompt, np.ndarray) and prompt.dtype == np.uint32 and prompt.ndim == 1:
            seq = prompt.tolist()
        elif type(prompt) in (list, tuple):
            if len(prompt) > cap:
                raise ValueError(f"the prompt has {len(prompt)} tokens, more than "
                                 f"logical_pages x page_tokens = {cap}")
            seq = [_u32(t, "token id") for t in prompt]
        else:
            if isinstance(prompt, (str, bytes, bytearray, memoryview)):
                raise TypeError(f"tokens must be a sequence of token ids, "
                                f"not {type(prompt).__name__}")
            if isinstance(prompt, np.ndarray):
                if prompt.ndim != 1:
                    raise ValueError(f"tokens must be 1-D, got {prompt.ndim} dimensions")
                if prompt.dtype.kind == "b" or prompt.dtype.kind not in "iu":
                    raise TypeError(f"tokens must be integers, got dtype {prompt.dtype}")
                if prompt.size and (prompt.min() < 0 or prompt.max() > U32_MAX):
                    raise OverflowError("token ids must be in [0, 4294967295]")
                seq = prompt.tolist()
            else:
                try:
                    seq = [_u32(t, "token id") for t in list(prompt)]
                except TypeError as exc:
                    if "token id" in str(exc):
                        raise
                    raise TypeError(f"tokens must be a sequence of token ids, "
                                    f"not {type(prompt).__name__}") from None
        if len(seq) > cap:
            raise ValueError(f"the prompt has {len(seq)} tokens, more than "
                             f"logical_pages x page_tokens = {cap}")
        return seq

    def admit(self, request_id, prompt_tokens=None, namespace=b"", prefix_len=None) -> Admission:
        rid = _u64(request_id, "request_id")
        if prefix_len is not None:
            raise ValueError("prefix_len is for prefix_caching='explicit'; this scheduler uses "
                             "prefix_caching='auto'")
        ns_name = _namespace_bytes(namespace)
        if len(ns_name) > NS_MAX_BYTES:
            raise ValueError(f"a namespace is at most {NS_MAX_BYTES} bytes, got {len(ns_name)}")
        tok = [] if prompt_tokens is None else self._load_tokens(prompt_tokens)
        n = len(tok)
        if any(s.state != RequestState.EMPTY and s.request_id == rid for s in self._slots):
            raise SchedulerError.DuplicateRequest(None, f"request {rid}")
        index = next((i for i, s in enumerate(self._slots) if s.state == RequestState.EMPTY),
                     None)
        if index is None:
            raise SchedulerError.Full(None, f"{len(self._slots)} slots")
        ns = self._intern(ns_name)
        pt = self.page_tokens
        k, ids, canon, collided = self._match(tok, ns, self._ns[ns][1], n // pt)
        slot = self._slots[index]
        try:
            slot.blocks.attach([q for q, _ in canon], self.pool)
        except TableError as err:
            self._ns_free_if_unused(ns)
            raise SchedulerError.Table(err) from err
        for q, _ in canon:
            self._on_retain(q)
        slot.request_id = rid
        slot.state = RequestState.PREFILL
        slot.token_count = k * pt
        slot.prefix_tokens = k * pt
        st = self._streams[index]
        st.live = True
        st.broken = False
        st.pending = None
        st.ns = ns
        st.known = n
        st.hashed = len(ids)
        st.done = k
        st.tokens = list(tok)
        st.ids = ids
        st.canon = canon
        if n:
            self._c["lookups"] += 1
            self._c["lookup_tokens"] += n
            self._c["hit_tokens"] += k * pt
        self._c["collisions"] += int(collided)
        self._c["pages_hashed"] += len(ids)
        self._ns_ref(ns)
        return Admission(index, k != 0, k * pt)

    def _fill(self, index: int) -> None:
        st = self._streams[index]
        sl = self._slots[index]
        pt = self.page_tokens
        if not st.live or st.broken:
            return
        limit = min(sl.token_count, st.known) // pt
        entries = sl.blocks._entries
        limit = min(limit, len(entries))
        nsh = self._ns[st.ns][1]
        while st.done < limit:
            k = st.done
            t = st.tokens[k * pt:(k + 1) * pt]
            if k >= st.hashed:
                del st.ids[k:]
                st.ids.append(self._chain(st.ids[k - 1] if k else 0, k > 0, nsh, t))
                st.hashed = k + 1
                self._c["pages_hashed"] += 1
            ident = self._ident(st.ids[k])
            pp, pg = 0, 0
            if k:
                pp, pg = st.canon[k - 1]
                if not self._live(pp, pg):
                    st.broken = True
                    return
            q = self._index.get(ident)
            del st.canon[k:]
            if q is not None:
                if not self._matches(q, st.ns, k > 0, pp, pg, t):
                    self._c["collisions"] += 1
                    st.broken = True
                    return
                if q != entries[k]:
                    self._c["duplicates"] += 1
                st.canon.append((q, self._entries[q].gen))
            else:
                own = entries[k]
                if own >= self.pool.num_blocks or own in self._entries:
                    st.broken = True
                    return
                if not self._insert(own, ident, k > 0, self._ident(st.ids[k - 1]) if k else 0,
                                    pp, pg, st.ns, t):
                    st.broken = True
                    return
                st.canon.append((own, self._entries[own].gen))
            st.done = k + 1
        if sl.token_count > len(entries) * pt or sl.token_count > st.known:
            st.broken = True

    def _note_token(self, index: int, pos: int, tok: int) -> None:
        st = self._streams[index]
        pt = self.page_tokens
        if not st.live or st.broken or pos > st.known:
            return
        if pos < st.known:
            if st.tokens[pos] == tok:
                return
            st.known = pos
            del st.tokens[pos:]
            if st.hashed > pos // pt:
                st.hashed = pos // pt
        if pos < self._lp * pt:
            del st.tokens[pos:]
            st.tokens.append(tok)
            st.known = pos + 1

    def _need_pages(self, table: SequenceBlockTable, first: int, last: int,
                    need: List[int]) -> Optional[str]:
        vlen = len(table)
        avail = self.pool.free_count + len(self._reclaimable)
        for lp in range(first, last + 1):
            if lp >= table.capacity:
                return "OutOfRange"
            if lp > vlen:
                return "Gap"
            if lp == vlen:
                vlen += 1
                need[0] += 1
            else:
                page = table._entries[lp]
                if page >= self.pool.num_blocks:
                    return "InvalidPage"
                count = self.pool.refcount(page)
                if count == 0:
                    return "NotAllocated"
                if count == 1:
                    continue
                need[0] += 1
            if need[0] > avail:
                return "Exhausted"
        return None

    def _make_writable(self, index: int, first: int, last: int, log: list) -> None:
        table = self._slots[index].blocks
        for lp in range(first, last + 1):
            cow = table.ensure_writable(lp, self.pool)
            if cow.kind != "exclusive":
                log.append((index, lp, cow))

    def _undo(self, log: list) -> None:
        for index, lp, cow in reversed(log):
            table = self._slots[index].blocks
            if cow.kind == "allocated":
                table._entries.pop()
                self.pool.release(cow.page)
            else:
                table._entries[lp] = cow.src
                self.pool.retain(cow.src)
                self.pool.release(cow.page)

    def _count_pages(self, log: list) -> None:
        # a committed make-writable: its copies and its fresh pages
        copied = sum(1 for _, _, c in log if c.kind == "copy")
        self._pages["copied"] += copied
        self._pages["allocated"] += len(log) - copied

    def _after_cow(self, log: list) -> None:
        for _, _, cow in log:
            if cow.kind == "copy":
                self._on_release(cow.src)

    # -- the facade verbs --------------------------------------------------------------------------
    def reserve(self, request_id, num_tokens) -> np.ndarray:
        n = _u32(num_tokens, "num_tokens")
        index = self._find(_u64(request_id, "request_id"))
        sl = self._slots[index]
        if n == 0:
            return np.zeros(0, dtype=COPY_OP)
        start = sl.token_count
        if start + n - 1 > U32_MAX:
            raise OverflowError("token_count would pass 2**32-1")
        first = start // self.page_tokens
        last = (start + n - 1) // self.page_tokens
        if last >= self._lp:
            raise SchedulerError.Table(TableError.OutOfRange())
        need = [0]
        err = self._need_pages(sl.blocks, first, last, need) or self._make_room(need[0])
        if err:
            raise SchedulerError.Table(TableError.VARIANTS[err]())
        log: list = []
        try:
            self._make_writable(index, first, last, log)
        except TableError as exc:
            self._undo(log)
            raise SchedulerError.Table(exc) from exc
        self._after_cow(log)
        copies = [(c.src, c.page) for _, _, c in log if c.kind == "copy"]
        self._count_pages(log)
        return np.array(copies, dtype=COPY_OP)

    def advance(self, request_id, num_tokens) -> int:
        n = _u32(num_tokens, "num_tokens")
        index = self._find(_u64(request_id, "request_id"))
        sl = self._slots[index]
        sl.token_count = min(sl.token_count + n, U32_MAX)
        self._fill(index)
        return sl.token_count

    def complete_prefill(self, request_id, first_token) -> None:
        tok = _u32(first_token, "first_token")
        sl = self._slots[self._find(_u64(request_id, "request_id"))]
        sl.state = RequestState.DECODE
        sl.next_token_id = tok
        sl.token_ready = True

    def decode(self, backend):
        decoding = [i for i, s in enumerate(self._slots) if s.state == RequestState.DECODE]
        need = [0]
        seen: List[int] = []     # a shared page's writers: each but the last holder copies it
        try:
            for i in decoding:
                lp = self._slots[i].token_count // self.page_tokens
                blocks = self._slots[i].blocks
                err = self._need_pages(blocks, lp, lp, need)
                if err:
                    raise DecodeRoundError.Scheduler(
                        SchedulerError.Table(TableError.VARIANTS[err]()))
                if lp < len(blocks):
                    page = blocks._entries[lp]
                    if page < self.pool.num_blocks and self.pool._refcounts[page] >= 2:
                        self.pool._refcounts[page] -= 1
                        seen.append(page)
        finally:
            for page in seen:
                self.pool._refcounts[page] += 1
        err = self._make_room(need[0])
        if err:
            raise DecodeRoundError.Scheduler(SchedulerError.Table(TableError.VARIANTS[err]()))
        for i in decoding:
            s = self._slots[i]
            self._streams[i].pending = (s.token_count, s.next_token_id) if s.token_ready else None
        log: list = []
        try:
            for i in decoding:
                lp = self._slots[i].token_count // self.page_tokens
                self._make_writable(i, lp, lp, log)
        except TableError as exc:
            self._undo(log)
            raise DecodeRoundError.Scheduler(SchedulerError.Table(exc)) from exc
        try:
            copies = [(c.src, c.page) for _, _, c in log if c.kind == "copy"]
            if copies:
                fn = backend_attr(backend, "copy_pages")
                if fn is None:
                    raise TypeError(f"this round needs {len(copies)} page copies but backend "
                                    f"{type(backend).__name__} has no copy_pages")
                try:
                    fn(np.array(copies, dtype=COPY_OP))
                except Exception as exc:
                    raise DecodeRoundError.Backend(exc) from exc
            receipt, outputs = self._round(backend, decoding)
        except BaseException:
            self._undo(log)
            raise
        for i in decoding:
            st = self._streams[i]
            if st.pending is not None:
                self._note_token(i, *st.pending)
                st.pending = None
            self._fill(i)
        self._after_cow(log)
        self._count_pages(log)
        self._pages["rounds"] += 1
        return receipt, outputs

    def _round(self, backend, decoding):
        execute = backend_attr(backend, "execute_ragged")
        if not callable(execute):
            raise TypeError(f"backend must have an execute_ragged(items, block_table, outputs) "
                            f"method, not {type(backend).__name__}")
        n = len(decoding)
        items = np.zeros(n, dtype=RAGGED_BATCH_ITEM)
        table = np.zeros(sum(len(self._slots[i].blocks) for i in decoding), dtype=np.uint32)
        outputs = np.zeros(n, dtype=RAGGED_BATCH_OUTPUT)
        off = 0
        for j, i in enumerate(decoding):
            s = self._slots[i]
            if not s.token_ready:
                raise DecodeRoundError.MissingInputToken()
            e = s.blocks._entries
            table[off:off + len(e)] = e
            items[j] = (s.request_id, i, s.next_token_id, s.token_count, off, len(e), 0)
            off += len(e)
        if n == 0:
            return RaggedBatchReceipt(0, 0), outputs
        iv = items.view()
        iv.flags.writeable = False
        tv = table.view()
        tv.flags.writeable = False
        try:
            result = execute(iv, tv, outputs)
        except Exception as exc:
            raise DecodeRoundError.Backend(exc) from exc
        batch_size, launches = _receipt(result)
        if batch_size != n:
            raise DecodeRoundError.OutputIdentityMismatch()
        if launches != 1:
            raise DecodeRoundError.BackendLaunchCount()
        for j, i in enumerate(decoding):
            if (int(outputs["request_id"][j]) != self._slots[i].request_id
                    or int(outputs["slot"][j]) != i):
                raise DecodeRoundError.OutputIdentityMismatch()
        for j, i in enumerate(decoding):
            s = self._slots[i]
            s.next_token_id = int(outputs["next_token_id"][j])
            s.token_count = min(s.token_count + 1, U32_MAX)
            s.token_ready = True
        outputs.flags.writeable = False
        return RaggedBatchReceipt(n, 1), outputs

    def finish(self, request_id) -> None:
        index = self._find(_u64(request_id, "request_id"))
        sl = self._slots[index]
        first = None
        for page in reversed(sl.blocks._entries):
            try:
                self.pool.release(page)
            except PoolError as err:
                if first is None:
                    first = err
            else:
                self._on_release(page)
        sl.blocks._entries = []
        if first is not None:
            raise SchedulerError.Table(TableError.VARIANTS[first.variant]())
        sl.clear()
        st = self._streams[index]
        if st.live:
            st.live = False
            self._ns_unref(st.ns)

    def fork(self, parent_id, child_id) -> int:
        """``qualia.Scheduler.fork``: the child shares every page of the decoding parent and
        continues its token stream (core/pages/fork.pxi)."""
        prid = _u64(parent_id, "parent_id")
        crid = _u64(child_id, "child_id")
        parent = self._slots[self._find(prid)]
        pindex = self._slots.index(parent)
        if parent.state != RequestState.DECODE:
            raise SchedulerError.ForkInPrefill(None, f"request {prid}")
        if any(s.state != RequestState.EMPTY and s.request_id == crid for s in self._slots):
            raise SchedulerError.DuplicateRequest(None, f"request {crid}")
        index = next((i for i, s in enumerate(self._slots) if s.state == RequestState.EMPTY),
                     None)
        if index is None:
            raise SchedulerError.Full(None, f"{len(self._slots)} slots")
        pages = parent.blocks._entries
        err = self.pool._first_retain_error(pages)
        if err is not None:
            raise SchedulerError.Table(TableError.VARIANTS[err.variant]())
        for page in pages:
            self.pool.retain(page)   # a page a request holds is never reclaimable
        self._slots[index].fork_from(parent, crid)
        src, dst = self._streams[pindex], self._streams[index]
        if dst.live:
            dst.live = False
            self._ns_unref(dst.ns)
        dst.known, dst.hashed, dst.done, dst.ns = src.known, src.hashed, src.done, src.ns
        dst.live, dst.broken, dst.pending = src.live, src.broken, None
        dst.tokens, dst.ids, dst.canon = list(src.tokens), list(src.ids), list(src.canon)
        if src.live:
            self._ns_ref(src.ns)
        return index

    # -- events, stats, introspection --------------------------------------------------------------
    def _match(self, tok, ns, nsh, nhash):
        pt = self.page_tokens
        n = len(tok)
        cap = (n - 1) // pt if n else 0
        ids: List[int] = []
        for k in range(nhash):
            ids.append(self._chain(ids[k - 1] if k else 0, k > 0, nsh, tok[k * pt:(k + 1) * pt]))
        canon: List[Tuple[int, int]] = []
        collided = False
        k = 0
        while k < cap:
            q = self._index.get(self._ident(ids[k]))
            if q is None:
                break
            pp, pg = canon[k - 1] if k else (0, 0)
            if not self._matches(q, ns, k > 0, pp, pg, tok[k * pt:(k + 1) * pt]):
                collided = True
                break
            canon.append((q, self._entries[q].gen))
            k += 1
        return k, ids, canon, collided

    def cached_prefix(self, prompt_tokens, namespace=b"") -> CachedPrefix:
        ns_name = _namespace_bytes(namespace)
        if len(ns_name) > NS_MAX_BYTES:
            raise ValueError(f"a namespace is at most {NS_MAX_BYTES} bytes, got {len(ns_name)}")
        tok = self._load_tokens(prompt_tokens)
        ns = self._ns_ids.get(ns_name)
        if ns is None:
            return CachedPrefix(0, 0, 0)
        cap = (len(tok) - 1) // self.page_tokens if tok else 0
        k, _, canon, _ = self._match(tok, ns, self._ns[ns][1], cap)
        return CachedPrefix(k * self.page_tokens, k,
                            sum(1 for q, _ in canon if q in self._reclaimable))

    def cached_prefix_tokens(self, prompt_tokens, namespace=b"") -> int:
        return self.cached_prefix(prompt_tokens, namespace).tokens

    def drain_events(self, out=None):
        if out is None:
            events, self._events = self._events, []
            return np.array(events, dtype=KV_EVENT)
        if not (isinstance(out, np.ndarray) and out.dtype == KV_EVENT and out.ndim == 1
                and out.flags.c_contiguous and out.flags.writeable):
            raise TypeError("out must be a writable 1-D C-contiguous numpy array of dtype "
                            "KV_EVENT")
        n = min(len(out), len(self._events))
        for i in range(n):
            out[i] = self._events[i]
        del self._events[:n]
        return n

    def clear_cache(self) -> int:
        # the reclaimable pages least recent first, then the pages in use in page order
        n = 0
        while self._reclaimable:
            self._drop(next(iter(self._reclaimable)), False)
            n += 1
        for page in sorted(self._inuse):
            self._drop(page, False)
            n += 1
        self._emit(KV_CLEARED, 0, 0, False, 0, 0, U32_MAX)
        return n

    def stats(self) -> Dict[str, int]:
        """``qualia.Scheduler.stats()``: requests, pages free, used, cached and reclaimable,
        pages copied and allocated, decode rounds.  The explicit prefix store (``prefix_*``)
        is never used in automatic mode: its counters stay 0."""
        nb = self.pool.num_blocks
        free = self.free_pages
        return {
            "active": self.active_count,
            "max_requests": self.max_requests,
            "num_pages": nb,
            "free_pages": free,
            "used_pages": nb - free,
            "cached_pages": len(self._entries),
            "reclaimable_pages": len(self._reclaimable),
            "prefix_entries": 0,
            "prefix_hits": 0,
            "prefix_misses": 0,
            "pages_copied": self._pages["copied"],
            "pages_allocated": self._pages["allocated"],
            "decode_rounds": self._pages["rounds"],
        }

    def cache_stats(self) -> CacheStats:
        c = self._c
        nb = self.pool.num_blocks
        held = nb - self.pool.free_count - len(self._reclaimable)
        return CacheStats(c["lookups"], c["lookup_tokens"], c["hit_tokens"], c["reclaims"],
                          len(self._entries), len(self._reclaimable), c["stored"],
                          c["duplicates"], c["collisions"], c["pages_hashed"], len(self._events),
                          self._dropped, len(self._ns), held / nb if nb else 0.0)

    def reclaimable_pages(self) -> np.ndarray:
        return np.array(list(self._reclaimable), dtype=np.uint32)

    def cache_entry(self, page) -> Optional[CacheEntry]:
        page = _u32(page, "page")
        if page >= self.pool.num_blocks:
            raise PoolError.InvalidPage()
        e = self._entries.get(page)
        if e is None:
            return None
        return CacheEntry(e.ident, e.parent_ident if e.has_parent else None, e.ns, e.gen,
                          page in self._reclaimable)

    def page_identities(self, tokens, namespace=b"") -> np.ndarray:
        ns = _namespace_bytes(namespace)
        if len(ns) > NS_MAX_BYTES:
            raise ValueError(f"a namespace is at most {NS_MAX_BYTES} bytes, got {len(ns)}")
        tok = [_u32(t, "token id") for t in (tokens.tolist() if isinstance(tokens, np.ndarray)
                                             else list(tokens))]
        nsh = namespace_hash(self._k, ns)
        pt = self.page_tokens
        out: List[int] = []
        chain = 0
        for k in range(len(tok) // pt):
            chain = self._chain(chain, k > 0, nsh, tok[k * pt:(k + 1) * pt])
            out.append(self._ident(chain))
        return np.array(out, dtype=np.uint64)

    def _debug_namespaces(self) -> Tuple[List[Tuple[int, bytes, int, int]], List[int]]:
        rows = [(i, v[0], v[2], v[3]) for i, v in sorted(self._ns.items())]
        return rows, list(self._ns_idle)

    def _debug_identity_mask(self, mask, parent_mask=M64) -> None:
        m = _u64(mask, "mask")
        self._parent_mask = _u64(parent_mask, "parent_mask")
        self._mask = m

    def block_table(self, request_id) -> np.ndarray:
        index = self._find(_u64(request_id, "request_id"))
        return np.array(self._slots[index].blocks._entries, dtype=np.uint32)

    def token_count(self, request_id) -> int:
        return self._slots[self._find(_u64(request_id, "request_id"))].token_count

    def runnable(self) -> np.ndarray:
        views = [(s.request_id, i, int(s.state), s.token_count, s.prefix_tokens)
                 for i, s in enumerate(self._slots) if s.state != RequestState.EMPTY]
        return np.array(views, dtype=REQUEST_VIEW)

    def __repr__(self) -> str:
        return (f"twin_cache.Scheduler(max_requests={self.max_requests}, "
                f"num_pages={self.num_pages}, page_tokens={self.page_tokens}, "
                f"logical_pages={self._lp}, active={self.active_count})")
