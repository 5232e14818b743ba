# The page cache as its two owners see it (Scheduler and StepScheduler each own a pool, a page
# cache and token streams): the caching mode and its options, and the cache's reads.  Each owner
# wraps these in its own ownership (docs/DESIGN.md, "Ownership"): a read resolves its arguments,
# calls own_readable(), then one of the functions below, which copy the C values they need before
# they build any Python object.

cdef enum:
    MODE_AUTO = 0
    MODE_EXPLICIT = 1   # Scheduler only: the prefix store's explicit breakpoints
    MODE_OFF = 2

cdef tuple _MODE_NAMES = ("auto", "explicit", "off")


cdef bytes _cache_key_bytes(object cache_key):
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


cdef tuple cache_options(object prefix_caching, object cache_key, object max_namespaces,
                         object event_capacity, tuple modes):
    # RESOLVE the caching arguments of a constructor: (mode, 16-byte key, max_namespaces,
    # event_capacity); `modes` are the mode names the owner takes
    cdef Py_ssize_t last = len(modes) - 1
    cdef str names = ", ".join([repr(m) for m in modes[:last]]) + f" or {modes[last]!r}"
    if not isinstance(prefix_caching, str):
        raise TypeError(f"prefix_caching must be {names}, not {type(prefix_caching).__name__}")
    if prefix_caching not in modes:
        raise ValueError(f"prefix_caching must be {names}, not {prefix_caching!r}")
    cdef int mode = _MODE_NAMES.index(prefix_caching)
    cdef bytes key = _cache_key_bytes(cache_key)
    cdef uint32_t max_ns = _u32(max_namespaces, "max_namespaces")
    if max_ns == 0 or max_ns > (1 << 20):
        raise ValueError(f"max_namespaces must be in [1, 1048576], got {max_ns}")
    cdef uint32_t ev_cap = _u32(event_capacity, "event_capacity")
    if ev_cap > (1 << 26):
        raise ValueError(f"event_capacity must be in [0, 67108864], got {ev_cap}")
    return (mode, key, max_ns, ev_cap)


cdef int cache_need_auto(int mode, str what) except -1:
    if mode != MODE_AUTO:
        raise ValueError(f"{what} is for prefix_caching='auto'; this scheduler uses "
                         f"prefix_caching={_MODE_NAMES[mode]!r}")
    return 0


cdef tuple cache_namespace(object namespace):
    # RESOLVE a namespace: (bytes, length), at most NS_MAX_BYTES
    cdef bytes ns = _namespace_bytes(namespace)
    cdef Py_ssize_t nsl = len(ns)
    if nsl > NS_MAX_BYTES:
        raise ValueError(f"a namespace is at most {NS_MAX_BYTES} bytes, got {nsl}")
    return (ns, nsl)


cdef object cache_probe(PageCache *c, Streams *ss, const uint32_t *tok, Py_ssize_t n,
                        bytes nsb, bint detail):
    # what an admission of tok[0..n) in namespace nsb would take from the cache now: tokens, or
    # CachedPrefix(tokens, pages, reclaimable).  Reads with the reads' own scratch (read_*),
    # never into a slot's page records, where the engine step's admissions match
    cdef uint32_t ns, k = 0, i, rec = 0, hashed
    cdef bint collided
    cdef Py_ssize_t nsl = len(nsb)
    cdef uint64_t nsh = c.ns.hashes[0] if nsl == 0 else \
        pc_ns_hash(c, <const uint8_t *><char *>nsb, <uint32_t>nsl)
    ns = ns_find(&c.ns, nsh, <const uint8_t *><char *>nsb, <uint32_t>nsl)
    if ns != U32_MAX:
        hashed = (n - 1) // c.page_tokens if n else 0
        k = auto_match(c, tok, <uint32_t>n, ns, nsh, hashed, ss.read, &collided)
        for i in range(k):
            rec += pc_rec(c, ss.read[i].canon).state == PC_RECLAIMABLE
    if not detail:
        return k * c.page_tokens
    return CachedPrefix(k * c.page_tokens, k, rec)


cdef object cache_drain(PageCache *c, object out):
    # drain_events(): the KV event ring is a single-producer, single-consumer ring, read here
    # with the GIL by one caller at a time; it takes no ownership (core/cache/pagecache.pxi)
    cdef void *ptr
    cdef Py_ssize_t n
    cdef uint32_t count
    if out is None:
        count = pc_pending(c)
        arr = np.empty(count, dtype=_DT_KV_EVENT)
        # the allocation may have run a GC callback that drained or added events: take at most
        # what the array holds
        return arr[:pc_drain(c, <KvEvent *>cnp.PyArray_DATA(<cnp.ndarray>arr), count)]
    if not _fast_array(out, _DT_KV_EVENT, 8, True, &ptr, &n):
        raise TypeError("out must be a writable 1-D C-contiguous numpy array of dtype KV_EVENT")
    return pc_drain(c, <KvEvent *>ptr, <uint32_t>(n if n < <Py_ssize_t>U32_MAX else U32_MAX))


cdef object cache_stats_of(PageCache *c, Pool *p):
    # C values first: building the tuple runs Python code
    cdef uint32_t nb = p.num_blocks
    cdef uint32_t held = nb - p.free_top - c.n_state[PC_RECLAIMABLE]
    cdef uint64_t lookups = c.lookups, lookup_tokens = c.lookup_tokens
    cdef uint64_t hit_tokens = c.hit_tokens, reclaims = c.reclaims, stored = c.stored
    cdef uint64_t duplicates = c.duplicates, collisions = c.collisions
    cdef uint64_t hashed = c.pages_hashed, dropped = c.ev.dropped
    cdef uint32_t cached = c.n_state[PC_INUSE] + c.n_state[PC_RECLAIMABLE]
    cdef uint32_t reclaimable = c.n_state[PC_RECLAIMABLE], pending = pc_pending(c)
    cdef uint32_t namespaces = c.ns.count
    return CacheStats(lookups, lookup_tokens, hit_tokens, reclaims, cached, reclaimable, stored,
                      duplicates, collisions, hashed, pending, dropped, namespaces,
                      (<double>held) / nb if nb else 0.0)


cdef tuple cache_namespaces(PageCache *c):
    # the namespace table: (id, name, references, reclaimable pages) for every id in use, by
    # id, and the idle ids, least recently used first (a test hook's reading)
    cdef NsTable *t = &c.ns
    cdef uint32_t i, e
    cdef size_t at
    cdef set free = {t.free_ids[i] for i in range(t.n_free)}
    cdef list rows = []
    cdef list idle = []
    for i in range(t.capacity):
        if i not in free:
            at = <size_t>i * NS_MAX_BYTES
            rows.append((i, (<char *>t.names)[at:at + t.lens[i]], t.refs[i], t.n_rec[i]))
    e = t.idle_head
    while e != U32_MAX and len(idle) <= t.capacity:
        idle.append(e)         # a cycle or an id out of range ends the walk, shown as it is
        if e >= t.capacity:
            break
        e = t.idle_next[e]
    return rows, idle


cdef object cache_reclaimable(PageCache *c, int mode):
    # the reclaimable cached pages, least recently used first
    cdef uint32_t n = c.n_state[PC_RECLAIMABLE] if mode == MODE_AUTO else 0
    cdef uint32_t *tmp = <uint32_t *>PyMem_Malloc((n if n else 1) * sizeof(uint32_t))
    cdef uint32_t i, s, k = 0
    if tmp == NULL:
        raise MemoryError()
    try:
        if n:
            # the live ring entries from the head (a read: the dead ones are skipped in place)
            for i in range(c.ring_len):
                s = _pc_slot(c, i)
                if _pc_live(c, s) and k < n:
                    tmp[k] = c.order[s]
                    k += 1
        return _array_of(tmp, k)
    finally:
        PyMem_Free(tmp)


cdef object cache_entry_of(PageCache *c, int mode, uint32_t page):
    # the cache entry of a physical page (checked in range) as a CacheEntry, or None
    cdef CachePage x
    if mode != MODE_AUTO or pc_rec(c, page).state == PC_NONE:
        return None
    x = pc_rec(c, page)[0]  # a copy: building the result runs Python code
    return CacheEntry(x.ident, x.parent_ident if x.has_parent else None, x.ns, x.gen,
                      x.state == PC_RECLAIMABLE)


cdef object cache_page_identities(PageCache *c, object tokens, object namespace):
    # the chained identities of the full pages of `tokens` under the cache's key (reads only
    # the key)
    cdef Toks t
    cdef Py_ssize_t k, pages
    cdef uint64_t nsh, chain = 0
    cdef uint64_t[::1] v
    ns, nsl = cache_namespace(namespace)
    keep = _tokens_resolve(tokens, &t, -1, "")
    try:
        pages = t.n // c.page_tokens
        out = np.empty(pages, dtype=np.uint64)
        v = out
        nsh = pc_ns_hash(c, <const uint8_t *><char *>ns, <uint32_t>nsl)
        for k in range(pages):
            chain = pc_chain(c, chain, k > 0, nsh, &t.ptr[k * c.page_tokens])
            v[k] = pc_ident(c, chain)
    finally:
        _tokens_free(&t)
    return out
