# The facade: admit / decode / finish over one pool, one store and one scheduler, with
# automatic prefix caching (core/pagecache.pxi, core/autoprefix.pxi) by default.

cdef enum:
    MODE_AUTO = 0
    MODE_EXPLICIT = 1
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

cdef void _undo(Sched *s, Pool *p, Undo *log, Py_ssize_t n) noexcept nogil:
    # Reverse every ensure_writable of the log, newest first, so the free stack is restored
    # exactly: a page popped by an allocation is pushed back on top.
    cdef Py_ssize_t k
    cdef Table *t
    for k in range(n - 1, -1, -1):
        t = &s.slots[log[k].slot].blocks
        if log[k].kind == COW_ALLOCATED:
            t.len -= 1
            pool_release(p, log[k].dst)
        elif log[k].kind == COW_COPY:
            t.entries[log[k].logical_page] = log[k].src
            pool_retain(p, log[k].src)
            pool_release(p, log[k].dst)


cdef class Scheduler:
    """admit / decode / finish over an owned BlockPool, PrefixKvStore and RequestScheduler.

    Everything (pages, prefix entries, request slots, every scratch buffer) is sized here, once.
    """
    cdef readonly BlockPool pool
    cdef readonly PrefixKvStore prefixes
    cdef readonly RequestScheduler requests
    cdef readonly uint32_t page_tokens
    cdef object _items
    cdef object _outputs
    cdef object _table
    cdef object _copies
    cdef object _items_ro
    cdef object _table_ro
    cdef object _copies_ro
    cdef object _tokens
    cdef qualia_batch_item *items_p
    cdef qualia_batch_output *outs_p
    cdef uint32_t *table_p
    cdef qualia_copy_op *copies_p
    cdef uint32_t *tokens_p
    cdef Py_ssize_t items_cap
    cdef Py_ssize_t table_cap
    cdef Py_ssize_t tokens_cap
    cdef Undo *undo
    cdef Py_ssize_t undo_cap
    cdef uint64_t pages_copied
    cdef uint64_t pages_allocated
    cdef uint64_t rounds
    cdef list _results
    cdef int mode
    cdef PageCache cache
    cdef Streams streams
    cdef uint64_t tok_epoch
    cdef list _admissions      # per slot: the last Admission returned for it (immutable, reused)

    def __cinit__(self, max_requests, num_blocks, page_tokens, logical_pages,
                  prefix_entries=64, prefix_pages=None, prefix_caching="auto", cache_key=None,
                  max_namespaces=1024, event_capacity=4096):
        cdef uint32_t pt = _u32(page_tokens, "page_tokens")
        if pt == 0:
            raise ValueError("page_tokens must be at least 1")
        if not isinstance(prefix_caching, str):
            raise TypeError(f"prefix_caching must be 'auto', 'explicit' or 'off', "
                            f"not {type(prefix_caching).__name__}")
        if prefix_caching not in _MODE_NAMES:
            raise ValueError(f"prefix_caching must be 'auto', 'explicit' or 'off', "
                             f"not {prefix_caching!r}")
        self.mode = _MODE_NAMES.index(prefix_caching)
        cdef bytes key = _cache_key_bytes(cache_key)
        cdef uint32_t max_ns = _u32(max_namespaces, "max_namespaces")
        if max_ns == 0 or max_ns > (1 << 20):
            raise ValueError(f"max_namespaces must be in [1, 1048576], got {max_ns}")
        cdef uint32_t ev_cap = _u32(event_capacity, "event_capacity")
        if ev_cap > (1 << 26):
            raise ValueError(f"event_capacity must be in [0, 67108864], got {ev_cap}")
        self.page_tokens = pt
        self.pool = BlockPool(num_blocks)
        self.requests = RequestScheduler(max_requests, logical_pages)
        lp = self.requests.logical_pages
        self.prefixes = PrefixKvStore(prefix_entries,
                                      prefix_pages if prefix_pages is not None else max(lp, 1))
        mr = self.requests.max_requests
        self._items = np.zeros(mr, dtype=RAGGED_BATCH_ITEM)
        self._outputs = np.zeros(mr, dtype=RAGGED_BATCH_OUTPUT)
        self._table = np.zeros(max(mr * lp, 1), dtype=np.uint32)
        self.undo_cap = max(mr, lp, 1)
        self._copies = np.zeros(self.undo_cap, dtype=COPY_OP)
        self._items_ro = self._items.view()
        self._items_ro.setflags(write=False)
        self._table_ro = self._table.view()
        self._table_ro.setflags(write=False)
        self._copies_ro = self._copies.view()
        self._copies_ro.setflags(write=False)
        self.tokens_cap = max(<Py_ssize_t>lp * pt, 1)
        self._tokens = np.zeros(self.tokens_cap, dtype=np.uint32)
        self.items_cap = mr
        self.table_cap = max(mr * lp, 1)
        self.items_p = <qualia_batch_item *><uintptr_t>self._items.ctypes.data
        self.outs_p = <qualia_batch_output *><uintptr_t>self._outputs.ctypes.data
        self.table_p = <uint32_t *><uintptr_t>self._table.ctypes.data
        self.copies_p = <qualia_copy_op *><uintptr_t>self._copies.ctypes.data
        self.tokens_p = <uint32_t *><uintptr_t>self._tokens.ctypes.data
        self.undo = <Undo *>PyMem_Malloc(self.undo_cap * sizeof(Undo))
        if self.undo == NULL:
            raise MemoryError()
        self._results = [None] * (mr + 1)
        self._admissions = [None] * mr
        if self.mode == MODE_AUTO:
            pc_init(&self.cache, self.pool.pool.num_blocks, pt, max_ns, ev_cap,
                    <const uint8_t *><char *>key)
            streams_init(&self.streams, mr, lp, pt)

    def __dealloc__(self):
        PyMem_Free(self.undo)
        pc_free(&self.cache)
        streams_free(&self.streams)

    # -- properties and stats ------------------------------------------------------------------
    @property
    def max_requests(self):
        return self.requests.s.max_requests

    @property
    def logical_pages(self):
        return self.requests.s.logical_pages

    @property
    def num_blocks(self):
        return self.pool.pool.num_blocks

    @property
    def active_count(self):
        return self.requests.s.active

    @property
    def free_pages(self):
        """Pages an allocation can take: free pages plus reclaimable cached pages."""
        return self.pool.pool.free_top + self.cache.n_state[PC_RECLAIMABLE]

    @property
    def prefix_caching(self):
        return _MODE_NAMES[self.mode]

    def stats(self):
        cdef uint32_t free = self.pool.pool.free_top + self.cache.n_state[PC_RECLAIMABLE]
        return {
            "active": self.requests.s.active,
            "max_requests": self.requests.s.max_requests,
            "num_blocks": self.pool.pool.num_blocks,
            "free_pages": free,
            "used_pages": self.pool.pool.num_blocks - free,
            "cached_pages": self.cache.n_state[PC_INUSE] + self.cache.n_state[PC_RECLAIMABLE],
            "reclaimable_pages": self.cache.n_state[PC_RECLAIMABLE],
            "prefix_entries": self.prefixes.store.count,
            "prefix_hits": self.prefixes.store.hits,
            "prefix_misses": self.prefixes.store.misses,
            "pages_copied": self.pages_copied,
            "pages_allocated": self.pages_allocated,
            "decode_rounds": self.rounds,
        }

    cdef int _check_idle(self) except -1:
        _check_busy(self.requests.busy, "scheduler")
        _check_busy(self.prefixes.busy, "prefix store")
        _check_busy(self.pool.busy, "pool")
        return 0

    cdef void _set_busy(self, int v) noexcept:
        self.requests.busy = v
        self.prefixes.busy = v
        self.pool.busy = v

    # -- identities ----------------------------------------------------------------------------
    cdef Py_ssize_t _load_tokens(self, object prompt_tokens) except -1:
        cdef Py_ssize_t n = _tokens_into(prompt_tokens, self.tokens_p, self.tokens_cap)
        if n > self.tokens_cap:
            raise ValueError(f"the prompt has {len(prompt_tokens)} tokens, more than "
                             f"logical_pages x page_tokens = {self.tokens_cap}")
        return n

    cdef Py_ssize_t _prefix_len(self, object prefix_len, Py_ssize_t n) except -1:
        if prefix_len is None:
            return n
        cdef uint32_t L = _u32(prefix_len, "prefix_len")
        if L > n:
            raise ValueError(f"prefix_len {L} is longer than the prompt ({n} tokens)")
        return L

    def identity_for(self, prompt_tokens, prefix_len=None, namespace=b""):
        """The PrefixIdentity of ``prompt_tokens[:prefix_len]`` in ``namespace``."""
        cdef bytes ns = _namespace_bytes(namespace)
        cdef Py_ssize_t n = self._load_tokens(prompt_tokens)
        cdef Py_ssize_t L = self._prefix_len(prefix_len, n)
        return _identity_of(self.tokens_p, L, ns)

    # -- admission and prefill -----------------------------------------------------------------
    def admit(self, request_id, prompt_tokens=None, namespace=b"", prefix_len=None):
        """Admit a request.  Automatic mode: share the longest verified cached run of the
        prompt's full pages (at least one prompt token is left to compute).  Explicit mode: look
        up ``prompt_tokens[:prefix_len]`` in the prefix store and attach its pages on a hit."""
        if self.mode != MODE_EXPLICIT:
            return self._admit_auto(request_id, prompt_tokens, namespace, prefix_len)
        identity = None
        if prompt_tokens is not None:
            ns = _namespace_bytes(namespace)
            n = self._load_tokens(prompt_tokens)
            L = self._prefix_len(prefix_len, n)
            if L > 0:
                identity = _identity_of(self.tokens_p, L, ns)
        elif prefix_len is not None:
            raise ValueError("prefix_len needs prompt_tokens")
        return self.requests.admit_with_prefix(request_id, identity, self.prefixes, self.pool)

    cdef int _make_writable(self, int32_t index, uint32_t first, uint32_t last,
                                   Py_ssize_t *n_undo, Py_ssize_t *n_copies) except -1:
        # ensure_writable for logical pages first..last of one request, logging for undo
        cdef Cow c
        cdef uint32_t lp
        cdef int rc
        cdef Sched *s = &self.requests.s
        for lp in range(first, last + 1):
            rc = table_ensure_writable(&s.slots[index].blocks, lp, &self.pool.pool, &c)
            if rc:
                return rc
            if c.kind == COW_EXCLUSIVE:
                continue
            self.undo[n_undo[0]].slot = index
            self.undo[n_undo[0]].logical_page = lp
            self.undo[n_undo[0]].kind = c.kind
            self.undo[n_undo[0]].src = c.src
            self.undo[n_undo[0]].dst = c.page
            n_undo[0] += 1
            if c.kind == COW_COPY:
                self.copies_p[n_copies[0]].src_page = c.src
                self.copies_p[n_copies[0]].dst_page = c.page
                n_copies[0] += 1
        return Q_OK

    def reserve(self, request_id, num_tokens):
        """Make writable every page of the next ``num_tokens`` positions; return the copies."""
        cdef uint32_t n = _u32(num_tokens, "num_tokens")
        self._check_idle()
        cdef int32_t index = self.requests._find(request_id)
        cdef Sched *s = &self.requests.s
        cdef uint64_t start = s.slots[index].token_count
        cdef Py_ssize_t n_undo = 0, n_copies = 0
        cdef int rc
        if n == 0:
            return np.zeros(0, dtype=COPY_OP)
        if start + n - 1 > U32_MAX:
            raise OverflowError("token_count would pass 2**32-1")
        cdef uint64_t first = start // self.page_tokens
        cdef uint64_t last = (start + n - 1) // self.page_tokens
        if last >= s.logical_pages:
            raise SchedulerError.Table(TableError.OutOfRange())
        if self.mode == MODE_AUTO:
            rc = self._auto_make_room(index, <uint32_t>first, <uint32_t>last)
            if rc:
                raise _error(E_SCHED, rc)
        rc = self._make_writable(index, <uint32_t>first, <uint32_t>last, &n_undo, &n_copies)
        if rc:
            _undo(s, &self.pool.pool, self.undo, n_undo)
            raise _error(E_SCHED, rc)
        if self.mode == MODE_AUTO:
            auto_after_cow(&self.cache, &self.pool.pool, self.undo, n_undo)
        self.pages_copied += n_copies
        self.pages_allocated += n_undo
        return self._copies[:n_copies].copy()

    def advance(self, request_id, num_tokens):
        """``record_token`` ``num_tokens`` times (saturating); returns the new token count."""
        cdef uint32_t n = _u32(num_tokens, "num_tokens")
        self._check_idle()
        cdef int32_t index = self.requests._find(request_id)
        cdef Slot *sl = &self.requests.s.slots[index]
        cdef uint64_t t = <uint64_t>sl.token_count + n
        sl.token_count = <uint32_t>(t if t <= U32_MAX else U32_MAX)
        if self.mode == MODE_AUTO:
            auto_fill(&self.requests.s, &self.pool.pool, &self.cache, &self.streams, index)
        return sl.token_count

    def complete_prefill(self, request_id, first_token):
        """The prompt is prefilled: go to Decode with ``first_token`` as the next input."""
        cdef uint32_t tok = _u32(first_token, "first_token")
        self._check_idle()
        cdef int32_t index = self.requests._find(request_id)
        slot_set_decode(&self.requests.s, index)
        self.requests.s.slots[index].next_token_id = tok
        self.requests.s.slots[index].token_ready = 1

    def publish_prefix(self, request_id, prompt_tokens, prefix_len=None, namespace=b""):
        """Publish the request's pages covering ``prompt_tokens[:prefix_len]`` to the store
        (explicit mode only)."""
        self._explicit_only("publish_prefix")
        cdef bytes ns = _namespace_bytes(namespace)
        cdef Py_ssize_t n = self._load_tokens(prompt_tokens)
        cdef Py_ssize_t L = self._prefix_len(prefix_len, n)
        self._check_idle()
        cdef int32_t index = self.requests._find(request_id)
        cdef Slot *sl = &self.requests.s.slots[index]
        cdef uint32_t pages
        if L == 0:
            raise PrefixKvError.EmptyPrefix()
        pages = <uint32_t>((L + self.page_tokens - 1) // self.page_tokens)
        if sl.token_count < L or sl.blocks.len < pages:
            raise ValueError(f"request {request_id} holds {sl.token_count} tokens in "
                             f"{sl.blocks.len} pages; it cannot publish a {L}-token prefix")
        identity = _identity_of(self.tokens_p, L, ns)
        cdef int rc = store_publish(&self.prefixes.store, (<PrefixIdentity>identity).hi,
                                    (<PrefixIdentity>identity).lo, sl.blocks.entries, pages,
                                    <uint32_t>L, &self.pool.pool)
        if rc:
            raise _error(E_STORE, rc)
        return identity

    # -- decode --------------------------------------------------------------------------------
    def decode(self, backend):
        """Make each decoding request's next page writable, hand the copies to the backend, run
        one round.  Returns ``(receipt, outputs)``; on any failure nothing changed."""
        cdef Sched *s = &self.requests.s
        cdef Py_ssize_t n_undo = 0, n_copies = 0
        cdef uint32_t i, w, lp
        cdef uint64_t bits
        cdef int rc
        cdef int32_t status = 0
        cdef qualia_backend *cb = NULL
        cdef object holder = None
        self._check_idle()
        if self.mode == MODE_AUTO:
            rc = self._auto_decode_prepare()
            if rc:
                raise _error(E_DECODE, rc)
        for w in range(s.n_words):
            bits = s.decode_bits[w]
            while bits:
                i = w * 64 + __builtin_ctzll(bits)
                bits &= bits - 1
                lp = s.slots[i].token_count // self.page_tokens
                rc = self._make_writable(i, lp, lp, &n_undo, &n_copies)
                if rc:
                    _undo(s, &self.pool.pool, self.undo, n_undo)
                    raise _error(E_DECODE, rc)
        try:
            if n_copies:
                holder = _c_backend(backend, &cb)
                if holder is not None and cb.copy_pages != NULL:
                    self._set_busy(1)
                    try:
                        with nogil:
                            status = cb.copy_pages(cb.ctx, self.copies_p, <uint32_t>n_copies)
                    finally:
                        self._set_busy(0)
                    if status != 0:
                        raise DecodeRoundError.Backend(RaggedBackendError.Failed(status))
                else:
                    fn = getattr(backend, "copy_pages", None)
                    if fn is None:
                        raise TypeError(f"this round needs {n_copies} page copies but backend "
                                        f"{type(backend).__name__} has no copy_pages")
                    self._set_busy(1)
                    try:
                        fn(self._copies_ro[:n_copies])
                    except Exception as exc:
                        raise DecodeRoundError.Backend(exc) from exc
                    finally:
                        self._set_busy(0)
            # the round itself holds the scheduler busy; hold the pool and store too
            self.pool.busy = 1
            self.prefixes.busy = 1
            try:
                receipt = self.requests._round(backend, self.items_p, self.items_cap,
                                               self._items_ro, self.table_p, self.table_cap,
                                               self._table_ro,
                                               self.outs_p, self.items_cap, self._outputs)
            finally:
                self.pool.busy = 0
                self.prefixes.busy = 0
        except BaseException:
            _undo(s, &self.pool.pool, self.undo, n_undo)
            raise
        self.pages_copied += n_copies
        self.pages_allocated += n_undo - n_copies
        self.rounds += 1
        n = (<tuple>receipt)[0]
        if self.mode == MODE_AUTO:
            self._auto_after_round(n)
            auto_after_cow(&self.cache, &self.pool.pool, self.undo, n_undo)
        r = self._results[n]
        if r is None:
            v = self._outputs[:n]
            v.flags.writeable = False
            r = (receipt, v)
            self._results[n] = r
        return r

    def finish(self, request_id):
        """Release the request's pages and free its slot.  Automatic mode: pages are released
        last page first; cached pages nobody else holds become reclaimable."""
        cdef uint64_t rid
        cdef int32_t index
        cdef int rc
        if self.mode != MODE_AUTO:
            self.requests.finish(request_id, self.pool)
            return
        rid = _u64(request_id, "request_id")
        self._check_idle()
        index = sched_find(&self.requests.s, rid)
        if index < 0:
            raise SchedulerError.UnknownRequest()
        rc = auto_finish(&self.requests.s, &self.pool.pool, &self.cache, &self.streams, index)
        if rc:
            raise _error(E_SCHED, rc)

    # -- pass-throughs ---------------------------------------------------------------------------
    def evict(self, identity):
        self.prefixes.evict(identity, self.pool)

    def evict_lru(self):
        return self.prefixes.evict_lru(self.pool)

    def evict_unused_lru(self):
        """Evict the least recent entry whose pages only the store holds (so eviction frees
        them); None when there is none."""
        cdef Store *st = &self.prefixes.store
        cdef Pool *p = &self.pool.pool
        cdef int32_t e = st.lru_head
        cdef uint32_t k, m, occ
        cdef uint32_t *pg
        cdef bint unused
        cdef int rc
        self._check_idle()
        while e >= 0:
            pg = &st.pages[<size_t>e * st.max_pages]
            unused = True
            for k in range(st.entries[e].npages):
                occ = 0
                for m in range(st.entries[e].npages):
                    if pg[m] == pg[k]:
                        occ += 1
                if pg[k] >= p.num_blocks or p.refcount[pg[k]] != occ:
                    unused = False
                    break
            if unused:
                ident = _identity_from_entry(&st.entries[e])
                rc = store_evict_entry(st, e, p)
                if rc:
                    raise _error(E_STORE, rc)
                return ident
            e = st.entries[e].next
        return None

    def block_table(self, request_id):
        cdef int32_t index = self.requests._find(request_id)
        cdef Table *t = &self.requests.s.slots[index].blocks
        out = np.empty(t.len, dtype=np.uint32)
        cdef uint32_t[::1] v = out
        if t.len:
            memcpy(&v[0], t.entries, t.len * sizeof(uint32_t))
        return out

    def token_count(self, request_id):
        return self.requests.s.slots[self.requests._find(request_id)].token_count

    def runnable(self):
        return self.requests.runnable()

    def __repr__(self):
        return (f"Scheduler(max_requests={self.max_requests}, num_blocks={self.num_blocks}, "
                f"page_tokens={self.page_tokens}, logical_pages={self.logical_pages}, "
                f"prefix_caching={self.prefix_caching!r}, "
                f"active={self.active_count}, free_pages={self.free_pages})")

    # -- automatic prefix caching (core/pagecache.pxi, core/autoprefix.pxi) ---------------------
    cdef int _explicit_only(self, str what) except -1:
        if self.mode != MODE_EXPLICIT:
            raise ValueError(f"{what} is for prefix_caching='explicit'; this scheduler uses "
                             f"prefix_caching={_MODE_NAMES[self.mode]!r}")
        return 0

    cdef Py_ssize_t _load_tokens_once(self, object prompt_tokens) except -1:
        # convert into the token scratch; a call re-entered from a token's __index__ would
        # overwrite the scratch, so it is detected and refused
        self.tok_epoch += 1
        cdef uint64_t epoch = self.tok_epoch
        cdef Py_ssize_t n = self._load_tokens(prompt_tokens)
        if self.tok_epoch != epoch:
            raise BusyError(None, "the scheduler was re-entered while converting prompt tokens")
        return n

    cdef object _admit_auto(self, object request_id, object prompt_tokens, object namespace,
                            object prefix_len):
        cdef uint64_t rid = _u64(request_id, "request_id")
        cdef Admission_c adm
        cdef Py_ssize_t n = 0, nsl
        cdef uint64_t nsh
        cdef int rc
        if prefix_len is not None:
            self._explicit_only("prefix_len")
        cdef bytes ns = _namespace_bytes(namespace)
        nsl = len(ns)
        if nsl > NS_MAX_BYTES:
            raise ValueError(f"a namespace is at most {NS_MAX_BYTES} bytes, got {nsl}")
        if prompt_tokens is not None:
            n = self._load_tokens_once(prompt_tokens)
        if self.mode == MODE_OFF:
            return self.requests.admit_with_prefix(rid, None, self.prefixes, self.pool)
        self._check_idle()
        nsh = self.cache.ns.hashes[0] if nsl == 0 else \
            pc_ns_hash(&self.cache, <const uint8_t *><char *>ns, <uint32_t>nsl)
        rc = auto_admit(&self.requests.s, &self.pool.pool, &self.cache, &self.streams, rid,
                        self.tokens_p, <uint32_t>n, <const uint8_t *><char *>ns, <uint32_t>nsl,
                        nsh, &adm)
        if rc:
            raise _error(E_AUTO, rc)
        # an admission is immutable: reuse the slot's last one when it says the same
        r = self._admissions[adm.slot]
        if r is None or <uint32_t>(<tuple>r)[2] != adm.prefix_tokens:
            r = Admission(adm.slot, adm.prefix_tokens != 0, adm.prefix_tokens)
            self._admissions[adm.slot] = r
        return r

    cdef int _auto_make_room(self, int32_t index, uint32_t first, uint32_t last) noexcept:
        # reserve: reclaim what the call will allocate, or fail before changing anything
        cdef uint64_t need = 0
        cdef int rc = auto_need_pages(&self.requests.s.slots[index].blocks, first, last,
                                      &self.pool.pool, &self.cache, &need)
        if rc:
            return rc
        return pc_make_room(&self.cache, &self.pool.pool, need)

    cdef int _auto_decode_prepare(self) noexcept:
        # decode: note each decoding slot's input token and position (streams still cached);
        # reclaim what the round's make-writable will allocate, or fail before changing anything.
        # With no reclaimable page there is nothing to reclaim, and the make-writable loop fails
        # with the same first error, changing nothing, so the count is skipped.
        cdef Sched *s = &self.requests.s
        cdef Pool *p = &self.pool.pool
        cdef uint64_t need = 0
        cdef uint64_t avail = <uint64_t>p.free_top + self.cache.n_state[PC_RECLAIMABLE]
        cdef bint count = self.cache.n_state[PC_RECLAIMABLE] != 0
        cdef bint note = self.streams.cacheable != 0
        if not count and not note:
            return Q_OK
        cdef uint32_t i, w, lp, page
        cdef uint64_t bits
        cdef int rc
        cdef Slot *sl
        cdef Stream *st
        for w in range(s.n_words):
            bits = s.decode_bits[w]
            while bits:
                i = w * 64 + __builtin_ctzll(bits)
                bits &= bits - 1
                sl = &s.slots[i]
                if note:
                    st = &self.streams.st[i]
                    st.has_pending = st.live and not st.broken and sl.token_ready
                    st.pending = sl.next_token_id
                    st.pending_pos = sl.token_count
                if not count:
                    continue
                lp = sl.token_count // self.page_tokens
                if lp == sl.blocks.len and lp < sl.blocks.capacity:
                    need += 1                      # the usual cases, inline
                    if need > avail:
                        return Q_EXHAUSTED
                elif lp < sl.blocks.len and sl.blocks.entries[lp] < p.num_blocks \
                        and p.refcount[sl.blocks.entries[lp]] == 1:
                    pass
                else:
                    rc = auto_need_pages(&sl.blocks, lp, lp, p, &self.cache, &need)
                    if rc:
                        return rc
        if count:
            return pc_make_room(&self.cache, p, need)
        return Q_OK

    cdef void _auto_after_round(self, uint32_t n) noexcept:
        # the round computed each item's input token at its position: record it, cache what
        # filled
        cdef Sched *s = &self.requests.s
        cdef uint32_t j, i
        cdef Stream *st
        if self.streams.cacheable == 0:
            return
        for j in range(n):
            i = s.lowered[j]
            st = &self.streams.st[i]
            if st.has_pending:
                auto_note_token(s, &self.streams, i, st.pending_pos, st.pending)
                st.has_pending = 0
            auto_fill(s, &self.pool.pool, &self.cache, &self.streams, i)

    def cached_prefix_tokens(self, prompt_tokens, namespace=b""):
        """How many tokens of ``prompt_tokens`` an admission in ``namespace`` would take from
        the cache right now (verified, at least one token left to compute).  Changes nothing,
        counts nothing."""
        return self._probe(prompt_tokens, namespace, "cached_prefix_tokens", False)

    def cached_prefix(self, prompt_tokens, namespace=b""):
        """``CachedPrefix(tokens, pages, reclaimable)``: what an admission of ``prompt_tokens``
        in ``namespace`` would take from the cache right now, and how many of those pages are
        reclaimable now (the admission takes them out of ``free_pages``).  Changes nothing."""
        return self._probe(prompt_tokens, namespace, "cached_prefix", True)

    cdef object _probe(self, object prompt_tokens, object namespace, str what, bint detail):
        cdef Py_ssize_t n, nsl
        cdef uint32_t ns, hashed, k, i, rec = 0
        cdef bint collided
        cdef uint64_t nsh
        if self.mode != MODE_AUTO:
            raise ValueError(f"{what} is for prefix_caching='auto'; this "
                             f"scheduler uses prefix_caching={_MODE_NAMES[self.mode]!r}")
        cdef bytes nsb = _namespace_bytes(namespace)
        nsl = len(nsb)
        if nsl > NS_MAX_BYTES:
            raise ValueError(f"a namespace is at most {NS_MAX_BYTES} bytes, got {nsl}")
        n = self._load_tokens_once(prompt_tokens)
        nsh = self.cache.ns.hashes[0] if nsl == 0 else \
            pc_ns_hash(&self.cache, <const uint8_t *><char *>nsb, <uint32_t>nsl)
        ns = ns_find(&self.cache.ns, nsh, <const uint8_t *><char *>nsb, <uint32_t>nsl)
        if ns == U32_MAX:
            return CachedPrefix(0, 0, 0) if detail else 0
        hashed = (n - 1) // self.page_tokens if n else 0
        k = auto_match(&self.cache, self.tokens_p, <uint32_t>n, ns, nsh, hashed,
                       self.streams.probe_ident, self.streams.probe_canon,
                       self.streams.probe_gen, &collided)
        if not detail:
            return k * self.page_tokens
        for i in range(k):
            rec += pc_rec(&self.cache, self.streams.probe_canon[i]).state == PC_RECLAIMABLE
        return CachedPrefix(k * self.page_tokens, k, rec)

    def drain_events(self, out=None):
        """Pending KV events, oldest first.  Without ``out``: a new KV_EVENT array of all of
        them.  With ``out`` (a writable 1-D KV_EVENT array): write up to ``len(out)`` events
        into it and return how many (no allocation).  Events left in the ring stay pending."""
        cdef void *ptr
        cdef Py_ssize_t n
        if out is None:
            arr = np.empty(self.cache.ev.count, dtype=_DT_KV_EVENT)
            if self.cache.ev.count:
                pc_drain(&self.cache, <KvEvent *>cnp.PyArray_DATA(<cnp.ndarray>arr),
                         self.cache.ev.count)
            return arr
        if not _fast_array(out, _DT_KV_EVENT, 8, True, &ptr, &n):
            raise TypeError("out must be a writable 1-D C-contiguous numpy array of dtype "
                            "KV_EVENT")
        return pc_drain(&self.cache, <KvEvent *>ptr,
                        <uint32_t>(n if n < <Py_ssize_t>U32_MAX else U32_MAX))

    def clear_cache(self):
        """Drop every cache entry (pages held by requests stay with them); emits one "cleared"
        event.  Returns the number of entries dropped."""
        self._check_idle()
        if self.mode != MODE_AUTO:
            return 0
        return pc_clear(&self.cache, &self.pool.pool)

    def cache_stats(self):
        """Counters of automatic prefix caching, as a CacheStats."""
        cdef PageCache *c = &self.cache
        cdef uint32_t nb = self.pool.pool.num_blocks
        cdef uint32_t held = nb - self.pool.pool.free_top - c.n_state[PC_RECLAIMABLE]
        return CacheStats(c.lookups, c.lookup_tokens, c.hit_tokens, c.reclaims,
                          c.n_state[PC_INUSE] + c.n_state[PC_RECLAIMABLE],
                          c.n_state[PC_RECLAIMABLE], c.stored, c.duplicates, c.collisions,
                          c.pages_hashed, c.ev.count, c.ev.dropped, c.ns.count,
                          (<double>held) / nb if nb else 0.0)

    def reclaimable_pages(self):
        """The reclaimable cached pages, least recently used (next to be reclaimed) first."""
        out = np.empty(self.cache.n_state[PC_RECLAIMABLE], dtype=np.uint32)
        if self.mode != MODE_AUTO:
            return out  # no cache: empty
        cdef uint32_t[::1] v = out
        cdef uint32_t p = self.cache.head[PC_RECLAIMABLE]
        cdef Py_ssize_t k = 0
        while p != U32_MAX:
            v[k] = p
            k += 1
            p = pc_rec(&self.cache, p).next
        return out

    def cache_entry(self, page):
        """The cache entry of physical ``page`` as a CacheEntry, or None when it is not
        cached."""
        cdef uint32_t pg = _u32(page, "page")
        cdef CachePage *x
        if pg >= self.pool.pool.num_blocks:
            raise PoolError.InvalidPage()
        if self.mode != MODE_AUTO or pc_rec(&self.cache, pg).state == PC_NONE:
            return None
        x = pc_rec(&self.cache, pg)
        return CacheEntry(x.ident, x.parent_ident if x.has_parent else None, x.ns, x.gen,
                          x.state == PC_RECLAIMABLE)

    def page_identities(self, tokens, namespace=b""):
        """The chained identities of the full pages of ``tokens`` in ``namespace`` under this
        scheduler's cache key (a uint64 array): what a router computes to predict hits."""
        if self.mode != MODE_AUTO:
            raise ValueError(f"page_identities is for prefix_caching='auto'; this scheduler "
                             f"uses prefix_caching={_MODE_NAMES[self.mode]!r}")
        cdef bytes ns = _namespace_bytes(namespace)
        cdef Py_ssize_t nsl = len(ns)
        if nsl > NS_MAX_BYTES:
            raise ValueError(f"a namespace is at most {NS_MAX_BYTES} bytes, got {nsl}")
        arr = _token_array(tokens)
        cdef const uint32_t[::1] t = arr
        cdef Py_ssize_t k, pages = arr.shape[0] // self.page_tokens
        out = np.empty(pages, dtype=np.uint64)
        cdef uint64_t[::1] v = out
        cdef uint64_t nsh = pc_ns_hash(&self.cache, <const uint8_t *><char *>ns, <uint32_t>nsl)
        cdef uint64_t chain = 0
        for k in range(pages):
            chain = pc_chain(&self.cache, chain, k > 0, nsh, &t[k * self.page_tokens])
            v[k] = pc_ident(&self.cache, chain)
        return out

    def _debug_identity_mask(self, mask, parent_mask=0xFFFFFFFFFFFFFFFF):
        """Test hook: AND every page identity computed from now on with ``mask`` (0 makes every
        page collide) and the parent identity it is derived from with ``parent_mask`` (0 makes
        identities blind to the parent), to prove that verification, not the hash, decides a
        hit."""
        cdef uint64_t m = _u64(mask, "mask")
        cdef uint64_t pm = _u64(parent_mask, "parent_mask")
        self.cache.ident_mask = m
        self.cache.parent_mask = pm
