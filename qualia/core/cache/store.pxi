# Prefix KV store (docs/DESIGN.md, "Prefix KV store"): fixed entries, an open-addressing index
# by digest (backward-shift deletion, load <= 1/2), an intrusive LRU list (head = least recent).

cdef struct StoreEntry:
    uint64_t hi
    uint64_t lo
    uint32_t tokens
    uint32_t npages
    int32_t prev
    int32_t next
    uint32_t used

cdef struct Store:
    StoreEntry *entries
    uint32_t *pages
    int32_t *index
    uint32_t index_mask
    uint32_t capacity
    uint32_t max_pages
    uint32_t count
    int32_t lru_head
    int32_t lru_tail
    int32_t free_head
    uint64_t hits
    uint64_t misses


cdef inline uint32_t _home(Store *st, uint64_t hi, uint64_t lo) noexcept nogil:
    return <uint32_t>((lo ^ (hi >> 7)) & st.index_mask)


cdef int32_t store_find(Store *st, uint64_t hi, uint64_t lo) noexcept nogil:
    cdef uint32_t i = _home(st, hi, lo)
    cdef int32_t e
    while True:
        e = st.index[i]
        if e < 0:
            return -1
        if st.entries[e].hi == hi and st.entries[e].lo == lo:
            return e
        i = (i + 1) & st.index_mask


cdef uint32_t _store_home_of(void *ctx, int32_t e) noexcept nogil:
    cdef Store *st = <Store *>ctx
    return _home(st, st.entries[e].hi, st.entries[e].lo)


cdef inline void store_index_insert(Store *st, int32_t e) noexcept nogil:
    oa_insert(st.index, st.index_mask, _store_home_of(st, e), e)


cdef inline void store_index_remove(Store *st, int32_t e) noexcept nogil:
    oa_remove(st.index, st.index_mask, _store_home_of(st, e), e, _store_home_of, st)


cdef void lru_unlink(Store *st, int32_t e) noexcept nogil:
    cdef StoreEntry *x = &st.entries[e]
    if x.prev >= 0:
        st.entries[x.prev].next = x.next
    else:
        st.lru_head = x.next
    if x.next >= 0:
        st.entries[x.next].prev = x.prev
    else:
        st.lru_tail = x.prev
    x.prev = -1
    x.next = -1


cdef void lru_push(Store *st, int32_t e) noexcept nogil:
    cdef StoreEntry *x = &st.entries[e]
    x.prev = st.lru_tail
    x.next = -1
    if st.lru_tail >= 0:
        st.entries[st.lru_tail].next = e
    else:
        st.lru_head = e
    st.lru_tail = e


cdef int store_publish(Store *st, uint64_t hi, uint64_t lo, const uint32_t *pages, uint32_t n,
                       uint32_t tokens, Pool *p) noexcept nogil:
    cdef uint32_t i, j
    cdef int rc
    cdef int32_t e
    if n == 0 or tokens == 0:
        return Q_EMPTY_PREFIX
    if n > st.max_pages:
        return Q_TOO_MANY_PAGES
    if store_find(st, hi, lo) >= 0:
        return Q_DUPLICATE
    if st.free_head < 0:
        return Q_STORE_FULL
    for i in range(n):
        rc = pool_retain(p, pages[i])
        if rc:
            for j in range(i):
                pool_release(p, pages[j])
            return rc
    e = st.free_head
    st.free_head = st.entries[e].next
    st.entries[e].hi = hi
    st.entries[e].lo = lo
    st.entries[e].tokens = tokens
    st.entries[e].npages = n
    st.entries[e].used = 1
    memcpy(&st.pages[<size_t>e * st.max_pages], pages, n * sizeof(uint32_t))
    store_index_insert(st, e)
    lru_push(st, e)
    st.count += 1
    return Q_OK


cdef int store_attach(Store *st, uint64_t hi, uint64_t lo, Table *t, Pool *p,
                      uint32_t *tokens_out) noexcept nogil:
    # tokens_out = 0 on a miss; a table error counts nothing
    cdef int32_t e = store_find(st, hi, lo)
    cdef int rc
    if e < 0:
        st.misses += 1
        tokens_out[0] = 0
        return Q_OK
    rc = table_attach(t, &st.pages[<size_t>e * st.max_pages], st.entries[e].npages, p)
    if rc:
        return rc
    st.hits += 1
    lru_unlink(st, e)
    lru_push(st, e)
    tokens_out[0] = st.entries[e].tokens
    return Q_OK


cdef int store_evict_entry(Store *st, int32_t e, Pool *p) noexcept nogil:
    cdef uint32_t i
    cdef int rc, first = Q_OK
    cdef uint32_t *pg = &st.pages[<size_t>e * st.max_pages]
    lru_unlink(st, e)
    store_index_remove(st, e)
    for i in range(st.entries[e].npages):
        rc = pool_release(p, pg[i])
        if rc and first == Q_OK:
            first = rc
    st.entries[e].used = 0
    st.entries[e].npages = 0
    st.entries[e].next = st.free_head
    st.free_head = e
    st.count -= 1
    return first


cdef int store_evict(Store *st, uint64_t hi, uint64_t lo, Pool *p) noexcept nogil:
    cdef int32_t e = store_find(st, hi, lo)
    if e < 0:
        return Q_UNKNOWN
    return store_evict_entry(st, e, p)


cdef class PrefixKvStore:
    """The seed's explicit prefix store: at most ``entries`` published prefixes of at most
    ``pages`` pages each, in recency order (docs/DESIGN.md, "Prefix KV store"): ``publish``,
    ``attach``, ``evict``, ``evict_lru`` and the reads ``contains``, ``pages_of``,
    ``tokens_of``, ``identities``."""
    cdef Store store
    cdef uint64_t owner

    def __cinit__(self, entries, pages):
        cdef uint32_t ne = _u32(entries, "entries")
        cdef uint32_t npg = _u32(pages, "pages")
        cdef uint32_t i, size = 2
        if ne == 0 or npg == 0:
            raise ValueError("a prefix store needs at least 1 entry of at least 1 page")
        if ne > (1 << 30):
            raise OverflowError("entries must be at most 2**30")
        while size < 2 * ne:
            size <<= 1
        self.store.entries = <StoreEntry *>PyMem_Calloc(ne, sizeof(StoreEntry))
        self.store.pages = <uint32_t *>PyMem_Malloc(<size_t>ne * npg * sizeof(uint32_t))
        self.store.index = <int32_t *>PyMem_Malloc(size * sizeof(int32_t))
        if self.store.entries == NULL or self.store.pages == NULL or self.store.index == NULL:
            raise MemoryError(f"cannot allocate a prefix store of {ne} x {npg} pages")
        for i in range(size):
            self.store.index[i] = -1
        self.store.index_mask = size - 1
        self.store.capacity = ne
        self.store.max_pages = npg
        for i in range(ne):
            self.store.entries[i].next = <int32_t>(i + 1) if i + 1 < ne else -1
            self.store.entries[i].prev = -1
        self.store.free_head = 0
        self.store.lru_head = -1
        self.store.lru_tail = -1

    def __dealloc__(self):
        PyMem_Free(self.store.entries)
        PyMem_Free(self.store.pages)
        PyMem_Free(self.store.index)

    @property
    def capacity(self):
        """Entries the store can hold at once, fixed at construction."""
        return self.store.capacity

    @property
    def max_pages(self):
        """Pages one entry can hold, fixed at construction."""
        return self.store.max_pages

    @property
    def hits(self):
        """Attaches that found their identity."""
        return self.store.hits

    @property
    def misses(self):
        """Attaches that did not find their identity."""
        return self.store.misses

    def __len__(self):
        return self.store.count

    def contains(self, PrefixIdentity identity not None):
        """Whether ``identity`` is published (also ``identity in store``)."""
        return store_find(&self.store, identity.hi, identity.lo) >= 0

    def __contains__(self, identity):
        if not isinstance(identity, PrefixIdentity):
            return False
        return store_find(&self.store, (<PrefixIdentity>identity).hi,
                          (<PrefixIdentity>identity).lo) >= 0

    cdef int32_t _entry(self, PrefixIdentity identity) except -2:
        cdef int32_t e = store_find(&self.store, identity.hi, identity.lo)
        if e < 0:
            raise PrefixKvError.Unknown()
        return e

    def publish(self, PrefixIdentity identity not None, pages, tokens, BlockPool pool not None):
        """Record a prefilled prefix of ``tokens`` tokens living in ``pages`` (logical order),
        retaining each page; the entry becomes the most recent (``PrefixKvError.EmptyPrefix``,
        ``TooManyPages``, ``Duplicate``, ``Full``, ``Pool``; nothing changes on an error)."""
        cdef uint32_t ntok = _u32(tokens, "tokens")
        cdef uint32_t n
        cdef int rc
        cdef uint64_t tok
        cdef uint32_t *buf = _pages_from(pages, &n, "pages")
        try:
            tok = own_acquire(&self.owner, &pool.owner, NULL, NULL)
            try:
                rc = store_publish(&self.store, identity.hi, identity.lo, buf, n, ntok,
                                   &pool.pool)
            finally:
                own_release(tok, &self.owner, &pool.owner, NULL, NULL)
        finally:
            PyMem_Free(buf)
        if rc:
            raise _error(E_STORE, rc)

    def attach(self, PrefixIdentity identity not None, SequenceBlockTable table not None,
               BlockPool pool not None):
        """On a hit map the entry's pages into the empty table and return its token count."""
        cdef uint32_t tokens = 0
        cdef int rc
        cdef uint64_t tok = own_acquire(&self.owner, &pool.owner, NULL, NULL)
        try:
            rc = store_attach(&self.store, identity.hi, identity.lo, &table.table,
                              &pool.pool, &tokens)
        finally:
            own_release(tok, &self.owner, &pool.owner, NULL, NULL)
        if rc:
            raise _error(E_ATTACH, rc)
        return tokens if tokens else None

    def evict(self, PrefixIdentity identity not None, BlockPool pool not None):
        """Drop the entry of ``identity``, then release its page references
        (``PrefixKvError.Unknown`` when absent)."""
        cdef int rc
        cdef uint64_t tok = own_acquire(&self.owner, &pool.owner, NULL, NULL)
        try:
            rc = store_evict(&self.store, identity.hi, identity.lo, &pool.pool)
        finally:
            own_release(tok, &self.owner, &pool.owner, NULL, NULL)
        if rc:
            raise _error(E_STORE, rc)

    def evict_lru(self, BlockPool pool not None):
        """Drop the least recently published-or-hit entry; None when the store is empty."""
        cdef int rc = Q_OK
        cdef int32_t e
        cdef uint64_t hi = 0, lo = 0
        cdef uint64_t tok = own_acquire(&self.owner, &pool.owner, NULL, NULL)
        try:
            e = self.store.lru_head
            if e >= 0:
                hi = self.store.entries[e].hi
                lo = self.store.entries[e].lo
                rc = store_evict_entry(&self.store, e, &pool.pool)
        finally:
            own_release(tok, &self.owner, &pool.owner, NULL, NULL)
        if e < 0:
            return None
        if rc:
            raise _error(E_STORE, rc)
        return _identity_from_hilo(hi, lo)

    def pages_of(self, PrefixIdentity identity not None):
        """The pages of ``identity``'s entry, in logical order (``PrefixKvError.Unknown`` when
        absent)."""
        cdef int32_t e = self._entry(identity)
        return _list_of(&self.store.pages[<size_t>e * self.store.max_pages],
                        self.store.entries[e].npages)

    def tokens_of(self, PrefixIdentity identity not None):
        """The token count of ``identity``'s entry (``PrefixKvError.Unknown`` when absent)."""
        return self.store.entries[self._entry(identity)].tokens

    def identities(self):
        """Published identities, least recent first."""
        # snapshot the LRU order into C memory first (see _list_of)
        cdef uint32_t j, k, n
        cdef int32_t e
        n = self.store.count
        e = self.store.lru_head
        cdef uint64_t *tmp = <uint64_t *>PyMem_Malloc((2 * n if n else 1) * sizeof(uint64_t))
        if tmp == NULL:
            raise MemoryError()
        try:
            k = 0
            while e >= 0 and k < n:
                tmp[2 * k] = self.store.entries[e].hi
                tmp[2 * k + 1] = self.store.entries[e].lo
                e = self.store.entries[e].next
                k += 1
            return [_identity_from_hilo(tmp[2 * j], tmp[2 * j + 1]) for j in range(k)]
        finally:
            PyMem_Free(tmp)

    def __repr__(self):
        return (f"PrefixKvStore(entries={self.store.capacity}, pages={self.store.max_pages}, "
                f"len={self.store.count}, hits={self.store.hits}, misses={self.store.misses})")
