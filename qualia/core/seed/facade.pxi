# qualia.Scheduler, the facade: admit / decode / finish over the seed's types (one pool, one
# prefix store, one request scheduler), with automatic prefix caching (core/cache/) by default.
# The engine step is another class, StepScheduler (core/step/scheduler.pxi): the two share the
# C functions below them, never an object.

cdef class Scheduler:
    """The facade: an engine drives the seed's types by hand, one verb per event of a request's
    life, over an owned BlockPool, PrefixKvStore and RequestScheduler (docs/DESIGN.md, "The
    facade").  It has no engine step (that is :class:`StepScheduler`, which shares no state with
    it).

    Verbs: ``admit`` (a request, sharing the longest cached run of its prompt's pages),
    ``reserve`` (pages for the next tokens; returns the copy-on-write copies to perform first),
    ``advance`` (tokens whose K/V were written), ``complete_prefill`` (the first generated
    token), ``decode`` (one backend call for every decoding request), ``fork``
    (a copy-on-write child of a decoding request), ``finish``; in ``"explicit"`` mode
    ``publish_prefix``, ``identity_for``, ``evict``, ``evict_lru`` and ``evict_unused_lru``.
    Reads: ``block_table``, ``token_count``, ``runnable``, ``stats``, ``active_count``,
    ``free_pages``, and the page cache's ``cached_prefix``, ``cached_prefix_tokens``,
    ``cache_stats``, ``cache_entry``, ``reclaimable_pages``, ``page_identities``,
    ``drain_events``, ``clear_cache``.

    Everything (pages, prefix entries, request slots, every scratch buffer) is sized here, once.
    Every mutating method owns the facade and its pool, store and request scheduler for the whole
    call (docs/DESIGN.md, "Ownership"): a call made meanwhile -- from a backend, a GC callback or
    another thread, on the facade or on ``pool``/``prefixes``/``requests`` -- raises
    ``BusyError`` and changes nothing.  Reads work at any time, from a backend mid-round too.
    """
    cdef readonly BlockPool pool
    """The facade's pool (its mutating calls raise ``BusyError`` while the facade is owned)."""
    cdef readonly PrefixKvStore prefixes
    """The facade's explicit prefix store."""
    cdef readonly RequestScheduler requests
    """The facade's request scheduler (use the facade's verbs: changing it directly bypasses the
    page cache's bookkeeping)."""
    cdef readonly uint32_t page_tokens
    """Token positions per page."""
    cdef uint64_t owner
    # Scratch, written only by the core under ownership.  items/table/copies/results are exported
    # to Python read-only; backend_out is the one buffer a backend writes.
    cdef _Region _items_r
    cdef _Region _table_r
    cdef _Region _copies_r
    cdef _Region _bout_r
    cdef _Region _results_r
    cdef qualia_batch_item *items_p
    cdef uint32_t *table_p
    cdef qualia_copy_op *copies_p
    cdef qualia_batch_output *bout_p
    cdef qualia_batch_output *results_p
    cdef Py_ssize_t items_cap
    cdef Py_ssize_t table_cap
    cdef Py_ssize_t tokens_cap
    cdef Undo *undo
    cdef Py_ssize_t undo_cap
    cdef uint64_t pages_copied
    cdef uint64_t pages_allocated
    cdef uint64_t rounds
    cdef list _results      # batch size -> (receipt, read-only view of the results)
    cdef list _item_views   # batch size -> read-only view of the items (Python backends)
    cdef list _bout_views   # batch size -> writable view of backend_out (Python backends)
    cdef int mode
    cdef PageCache cache
    cdef Streams streams
    cdef list _admissions   # per slot: the last Admission returned for it (immutable, reused)

    def __cinit__(self, max_requests, num_pages, page_tokens, logical_pages,
                  prefix_entries=64, prefix_pages=None, prefix_caching="auto", cache_key=None,
                  max_namespaces=1024, event_capacity=4096):
        cdef uint32_t pt = _u32(page_tokens, "page_tokens")
        cdef uint32_t nb = _u32(num_pages, "num_pages")
        if pt == 0:
            raise ValueError("page_tokens must be at least 1")
        if nb == 0:
            raise ValueError("num_pages must be at least 1")
        self.mode, key, max_ns, ev_cap = cache_options(prefix_caching, cache_key, max_namespaces,
                                                       event_capacity, _MODE_NAMES)
        self.page_tokens = pt
        self.pool = BlockPool(nb)
        self.requests = RequestScheduler(max_requests, logical_pages)
        lp = self.requests.logical_pages
        self.prefixes = PrefixKvStore(prefix_entries,
                                      prefix_pages if prefix_pages is not None else max(lp, 1))
        mr = self.requests.max_requests
        self.items_cap = mr
        self.table_cap = max(mr * lp, 1)
        self.undo_cap = max(mr, lp, 1)
        self.tokens_cap = max(<Py_ssize_t>lp * pt, 1)
        self._items_r = _region_new(mr * sizeof(qualia_batch_item), False)
        self._table_r = _region_new(self.table_cap * sizeof(uint32_t), False)
        self._copies_r = _region_new(self.undo_cap * sizeof(qualia_copy_op), False)
        self._bout_r = _region_new(mr * sizeof(qualia_batch_output), True)
        self._results_r = _region_new(mr * sizeof(qualia_batch_output), False)
        self.items_p = <qualia_batch_item *>self._items_r.ptr
        self.table_p = <uint32_t *>self._table_r.ptr
        self.copies_p = <qualia_copy_op *>self._copies_r.ptr
        self.bout_p = <qualia_batch_output *>self._bout_r.ptr
        self.results_p = <qualia_batch_output *>self._results_r.ptr
        if ((<uintptr_t>self.items_p) % QUALIA_ALIGN_ITEM
                or (<uintptr_t>self.bout_p) % QUALIA_ALIGN_OUTPUT
                or (<uintptr_t>self.results_p) % QUALIA_ALIGN_OUTPUT
                or (<uintptr_t>self.copies_p) % QUALIA_ALIGN_COPY):
            raise SystemError("qualia internal error: misaligned scratch")
        self.undo = <Undo *>PyMem_Malloc(self.undo_cap * sizeof(Undo))
        if self.undo == NULL:
            raise MemoryError()
        self._results = [None] * (mr + 1)
        self._item_views = [None] * (mr + 1)
        self._bout_views = [None] * (mr + 1)
        self._admissions = [None] * mr
        if self.mode == MODE_AUTO:
            pc_init(&self.cache, nb, pt, max_ns, ev_cap, <const uint8_t *><char *>key)
            streams_init(&self.streams, mr, lp, pt, True)

    def __dealloc__(self):
        PyMem_Free(self.undo)
        pc_free(&self.cache)
        streams_free(&self.streams)

    # -- ownership -------------------------------------------------------------------------------
    cdef inline uint64_t _own(self) except 0:
        return own_acquire(&self.owner, &self.requests.owner, &self.prefixes.owner,
                           &self.pool.owner)

    cdef inline void _unown(self, uint64_t token) noexcept:
        own_release(token, &self.owner, &self.requests.owner, &self.prefixes.owner,
                    &self.pool.owner)

    # -- properties and stats ------------------------------------------------------------------
    @property
    def max_requests(self):
        """Request slots, fixed at construction."""
        return self.requests.s.max_requests

    @property
    def logical_pages(self):
        """Capacity of each request's block table, in pages: a request holds at most ``logical_pages
        * page_tokens`` tokens."""
        return self.requests.s.logical_pages

    @property
    def num_pages(self):
        """Pages in the pool, fixed at construction."""
        return self.pool.pool.num_blocks

    @property
    def active_count(self):
        """Requests admitted and not finished."""
        return self.requests.s.active

    @property
    def free_pages(self):
        """Pages an allocation can take: free pages plus reclaimable cached pages."""
        return self.pool.pool.free_top + self.cache.n_state[PC_RECLAIMABLE]

    @property
    def prefix_caching(self):
        """The prefix-caching mode: ``"auto"``, ``"explicit"`` or ``"off"``."""
        return _MODE_NAMES[self.mode]

    def stats(self):
        """Counters as a dict: active requests and slots, pages (free counting the reclaimable
        ones, used, cached, reclaimable), explicit prefix entries, hits and misses, pages copied
        (copy-on-write) and allocated, decode rounds."""
        # C values first: building the dict runs Python code
        cdef uint32_t active = self.requests.s.active, mr = self.requests.s.max_requests
        cdef uint32_t nb = self.pool.pool.num_blocks
        cdef uint32_t free = self.pool.pool.free_top + self.cache.n_state[PC_RECLAIMABLE]
        cdef uint32_t cached = self.cache.n_state[PC_INUSE] + self.cache.n_state[PC_RECLAIMABLE]
        cdef uint32_t reclaimable = self.cache.n_state[PC_RECLAIMABLE]
        cdef uint32_t entries = self.prefixes.store.count
        cdef uint64_t hits = self.prefixes.store.hits, misses = self.prefixes.store.misses
        cdef uint64_t copied = self.pages_copied, allocated = self.pages_allocated
        cdef uint64_t rounds = self.rounds
        return {
            "active": active,
            "max_requests": mr,
            "num_pages": nb,
            "free_pages": free,
            "used_pages": nb - free,
            "cached_pages": cached,
            "reclaimable_pages": reclaimable,
            "prefix_entries": entries,
            "prefix_hits": hits,
            "prefix_misses": misses,
            "pages_copied": copied,
            "pages_allocated": allocated,
            "decode_rounds": rounds,
        }

    # -- identities ----------------------------------------------------------------------------
    cdef object _prompt(self, object prompt_tokens, Toks *t):
        return _tokens_resolve(prompt_tokens, t, self.tokens_cap, "logical_pages x page_tokens")

    cdef Py_ssize_t _prefix_len(self, object prefix_len, Py_ssize_t n) except -1:
        # prefix_len was resolved to an int before the tokens (see admit)
        if prefix_len is None:
            return n
        cdef uint32_t L = <uint32_t>prefix_len
        if L > n:
            raise ValueError(f"prefix_len {L} is longer than the prompt ({n} tokens)")
        return L

    def identity_for(self, prompt_tokens, prefix_len=None, namespace=b""):
        """The PrefixIdentity of ``prompt_tokens[:prefix_len]`` in ``namespace`` (reads nothing
        of the scheduler's state)."""
        cdef Toks t
        cdef bytes ns = _namespace_bytes(namespace)
        if prefix_len is not None:
            prefix_len = _u32(prefix_len, "prefix_len")
        keep = self._prompt(prompt_tokens, &t)
        try:
            return _identity_of(t.ptr, self._prefix_len(prefix_len, t.n), ns)
        finally:
            _tokens_free(&t)

    # -- admission and prefill -----------------------------------------------------------------
    def admit(self, request_id, prompt_tokens=None, namespace=b"", prefix_len=None):
        """Admit a request.  Automatic mode: share the longest verified cached run of the
        prompt's full pages (at least one prompt token is left to compute).  Explicit mode: look
        up ``prompt_tokens[:prefix_len]`` in the prefix store and attach its pages on a hit."""
        if self.mode != MODE_EXPLICIT:
            return self._admit_auto(request_id, prompt_tokens, namespace, prefix_len)
        cdef uint64_t rid = _u64(request_id, "request_id")
        cdef Toks t
        cdef Py_ssize_t L = 0
        cdef bytes ns = b""
        cdef uint64_t hi = 0, lo = 0, tok
        cdef Admission_c adm
        cdef int rc
        t.heap = NULL
        keep = None
        if prompt_tokens is None:
            if prefix_len is not None:
                raise ValueError("prefix_len needs prompt_tokens")
        else:
            ns = _namespace_bytes(namespace)
            if prefix_len is not None:
                prefix_len = _u32(prefix_len, "prefix_len")
            keep = self._prompt(prompt_tokens, &t)  # last: no user code runs after it
        try:
            if prompt_tokens is not None:
                L = self._prefix_len(prefix_len, t.n)
            tok = self._own()
            try:
                if L > 0:
                    _digest_hilo(t.ptr, L, ns, &hi, &lo)
                rc = sched_admit(&self.requests.s, rid, L > 0, hi, lo, &self.prefixes.store,
                                 &self.pool.pool, &adm)
            finally:
                self._unown(tok)
        finally:
            _tokens_free(&t)
        if rc:
            raise _error(E_ADMIT, rc)
        return Admission(adm.slot, adm.prefix_tokens != 0, adm.prefix_tokens)

    cdef int _make_writable(self, int32_t index, uint64_t first, uint64_t last,
                            Py_ssize_t *n_undo, Py_ssize_t *n_copies) noexcept:
        # ensure_writable for logical pages first..last of one request, logging for undo
        # (reserve_writable, core/seed/reserve.pxi: the engine step reserves through it too)
        return reserve_writable(&self.requests.s, &self.pool.pool, self.undo, self.copies_p,
                                index, first, last, n_undo, n_copies)

    def reserve(self, request_id, num_tokens):
        """Make writable every page of the next ``num_tokens`` positions; return the copies."""
        cdef uint64_t rid = _u64(request_id, "request_id")
        cdef uint32_t n = _u32(num_tokens, "num_tokens")
        cdef Sched *s = &self.requests.s
        cdef Py_ssize_t n_undo = 0, n_copies = 0
        cdef int rc = Q_OK
        cdef int32_t index
        cdef uint64_t start, first, last
        cdef uint64_t tok = self._own()
        try:
            index = _slot_of(s, rid)
            if n == 0:
                return np.zeros(0, dtype=COPY_OP)
            start = s.slots[index].token_count
            if start + n - 1 > U32_MAX:
                raise OverflowError("token_count would pass 2**32-1")
            first = start // self.page_tokens
            last = (start + n - 1) // self.page_tokens
            if last >= s.logical_pages:
                raise SchedulerError.Table(TableError.OutOfRange())
            if self.mode == MODE_AUTO:  # reclaim what the call allocates, or change nothing
                rc = self._auto_make_room(index, <uint32_t>first, <uint32_t>last)
            if rc == Q_OK:
                rc = self._make_writable(index, first, last, &n_undo, &n_copies)
            if rc == Q_OK:
                try:
                    copies = np.empty(n_copies, dtype=COPY_OP)
                    if n_copies:
                        memcpy(<void *>cnp.PyArray_DATA(<cnp.ndarray>copies), self.copies_p,
                               n_copies * sizeof(qualia_copy_op))
                except BaseException:
                    reserve_undo(s, &self.pool.pool, self.undo, n_undo)
                    raise
                self.pages_copied += n_copies
                self.pages_allocated += n_undo - n_copies
                if self.mode == MODE_AUTO:
                    auto_after_cow(&self.cache, &self.pool.pool, self.undo, n_undo)
            else:
                reserve_undo(s, &self.pool.pool, self.undo, n_undo)
        finally:
            self._unown(tok)
        if rc:
            raise _error(E_SCHED, rc)
        return copies

    def advance(self, request_id, num_tokens):
        """``record_token`` ``num_tokens`` times (saturating); returns the new token count."""
        cdef uint64_t rid = _u64(request_id, "request_id")
        cdef uint32_t n = _u32(num_tokens, "num_tokens")
        cdef Slot *sl
        cdef uint64_t t
        cdef uint32_t count
        cdef int32_t index
        cdef uint64_t tok = self._own()
        try:
            index = _slot_of(&self.requests.s, rid)
            sl = &self.requests.s.slots[index]
            t = <uint64_t>sl.token_count + n
            sl.token_count = <uint32_t>(t if t <= U32_MAX else U32_MAX)
            count = sl.token_count
            if self.mode == MODE_AUTO:  # pages that filled go to the cache
                auto_fill(&self.requests.s, &self.pool.pool, &self.cache, &self.streams,
                          <uint32_t>index)
        finally:
            self._unown(tok)
        return count

    def complete_prefill(self, request_id, first_token):
        """The prompt is prefilled: go to Decode with ``first_token`` as the next input."""
        cdef uint64_t rid = _u64(request_id, "request_id")
        cdef uint32_t t = _u32(first_token, "first_token")
        cdef int32_t index
        cdef uint64_t tok = self._own()
        try:
            index = _slot_of(&self.requests.s, rid)
            slot_set_decode(&self.requests.s, index)
            self.requests.s.slots[index].next_token_id = t
            self.requests.s.slots[index].token_ready = 1
        finally:
            self._unown(tok)

    def publish_prefix(self, request_id, prompt_tokens, prefix_len=None, namespace=b""):
        """Publish the request's pages covering ``prompt_tokens[:prefix_len]`` to the store
        (explicit mode only)."""
        self._explicit_only("publish_prefix")
        cdef uint64_t rid = _u64(request_id, "request_id")
        cdef bytes ns = _namespace_bytes(namespace)
        cdef Toks t
        cdef Py_ssize_t L
        cdef uint64_t hi = 0, lo = 0, tok
        cdef uint32_t pages, count, held
        cdef Slot *sl
        cdef int rc = Q_OK
        if prefix_len is not None:
            prefix_len = _u32(prefix_len, "prefix_len")
        keep = self._prompt(prompt_tokens, &t)
        try:
            L = self._prefix_len(prefix_len, t.n)
            tok = self._own()
            try:
                # the slot is looked up, checked, hashed for and published from in one owned,
                # GIL-held stretch: no other call can finish or replace the request meanwhile
                sl = &self.requests.s.slots[_slot_of(&self.requests.s, rid)]
                if L == 0:
                    raise PrefixKvError.EmptyPrefix()
                pages = <uint32_t>((L + self.page_tokens - 1) // self.page_tokens)
                count = sl.token_count
                held = sl.blocks.len
                if count < L or held < pages:
                    raise ValueError(f"request {rid} holds {count} tokens in {held} pages; it "
                                     f"cannot publish a {L}-token prefix")
                _digest_hilo(t.ptr, L, ns, &hi, &lo)
                rc = store_publish(&self.prefixes.store, hi, lo, sl.blocks.entries, pages,
                                   <uint32_t>L, &self.pool.pool)
            finally:
                self._unown(tok)
        finally:
            _tokens_free(&t)
        if rc:
            raise _error(E_STORE, rc)
        return _identity_from_hilo(hi, lo)

    # -- decode --------------------------------------------------------------------------------
    def decode(self, backend):
        """Make each decoding request's next page writable, hand the copies to the backend, run
        one round.  Returns ``(receipt, outputs)``; on any failure nothing changed.

        ``outputs`` is a read-only view of the round's RAGGED_BATCH_OUTPUT records, valid until
        the next ``decode`` on this scheduler (which overwrites it; copy it to keep it).  A
        Python backend writes into its own output buffer; the core checks and copies the
        records, so a backend that keeps its ``outputs`` cannot change what ``decode``
        returned.  The read-only ``items``, ``block_table`` and ``copies`` views a Python
        backend gets are valid during the call."""
        cdef qualia_backend *cb = NULL
        cdef qualia_backend store
        cdef int rc = Q_OK
        # RESOLVE the whole backend before anything is owned or read: its capsule or bound
        # methods (properties and __getattr__ run user code)
        handle = _resolve_backend(backend, &cb, &store)
        copy_fn = None
        if cb == NULL or cb.copy_pages == NULL:
            copy_fn = backend_attr(backend, "copy_pages")
        cdef uint64_t tok = self._own()
        try:
            result = self._decode(cb, handle, copy_fn, &rc)
        finally:
            self._unown(tok)
        if rc:
            raise _error(E_DECODE, rc)
        return result

    cdef object _decode(self, qualia_backend *cb, object fn, object copy_fn, int *rc_out):
        # The round, with the facade, scheduler, store and pool owned by the caller.  A status
        # error returns None with *rc_out set; a Python exception propagates.  Either way every
        # page change is undone first.  Nothing is committed before the outputs are verified.
        cdef Sched *s = &self.requests.s
        cdef Py_ssize_t n_undo = 0, n_copies = 0
        cdef uint32_t i, w, n = 0, off = 0
        cdef uint64_t bits
        cdef int rc = Q_OK
        cdef int32_t status = 0
        cdef qualia_batch_receipt rec
        result = None
        if self.mode == MODE_AUTO:
            # reclaim what the make-writable steps below allocate, or fail changing nothing
            rc = auto_decode_prepare(&self.requests.s, &self.pool.pool, &self.cache,
                                     &self.streams, self.undo, self.page_tokens)
            if rc:
                rc_out[0] = rc
                return None
        for w in range(s.n_words):
            bits = s.decode_bits[w]
            while bits:
                i = w * 64 + __builtin_ctzll(bits)
                bits &= bits - 1
                rc = self._make_writable(i, s.slots[i].token_count // self.page_tokens,
                                         s.slots[i].token_count // self.page_tokens,
                                         &n_undo, &n_copies)
                if rc:
                    reserve_undo(s, &self.pool.pool, self.undo, n_undo)
                    rc_out[0] = rc
                    return None
        try:
            if n_copies:
                if cb != NULL and cb.copy_pages != NULL:
                    with nogil:
                        status = cb.copy_pages(cb.ctx, self.copies_p, <uint32_t>n_copies)
                    if status != 0:
                        raise DecodeRoundError.Backend(RaggedBackendError.Failed(status))
                elif copy_fn is None:
                    raise TypeError(f"this round needs {n_copies} page copies but the backend "
                                    f"has no copy_pages")
                else:
                    try:
                        copy_fn(_np_view(self._copies_r, _DT_COPY, n_copies, False))
                    except BaseException as exc:
                        if not isinstance(exc, Exception):
                            raise
                        raise DecodeRoundError.Backend(exc) from exc
            rc = round_sizes(s, self.items_cap, self.table_cap, self.items_cap)
            if rc == Q_OK:
                rc = round_lower(s, self.items_p, self.table_p, &n, &off)
            if rc == Q_OK and n:
                if cb != NULL:
                    rec.batch_size = 0
                    rec.backend_launches = 0
                    with nogil:  # everything is owned; the core touches nothing meanwhile
                        status = cb.execute_ragged(cb.ctx, self.items_p, n, self.table_p, off,
                                                   self.bout_p, &rec)
                    if status != 0:
                        raise DecodeRoundError.Backend(RaggedBackendError.Failed(status))
                else:
                    _run_backend(NULL, fn, self.items_p, n, self.table_p, off, self.bout_p,
                                 self._item_view(n), _np_view(self._table_r, _DT_U32, off, False),
                                 self._bout_view(n), &rec)
                rc = round_verify(s, self.bout_p, n, &rec)
            if rc == Q_OK:
                result = self._results[n]
                if result is None:
                    result = (_receipt(self.requests._receipts, n) if n else _ZERO_RECEIPT,
                              _np_view(self._results_r, _DT_OUTPUT, n, False))
                    self._results[n] = result
        except BaseException:
            reserve_undo(s, &self.pool.pool, self.undo, n_undo)
            raise
        if rc:
            reserve_undo(s, &self.pool.pool, self.undo, n_undo)
            rc_out[0] = rc
            return None
        # commit: from here nothing can fail or run Python code
        if n:
            memcpy(self.results_p, self.bout_p, n * sizeof(qualia_batch_output))
            round_commit(s, self.bout_p, n)
        if self.mode == MODE_AUTO:
            auto_after_round(&self.requests.s, &self.pool.pool, &self.cache, &self.streams, n)
            auto_after_cow(&self.cache, &self.pool.pool, self.undo, n_undo)
        self.pages_copied += n_copies
        self.pages_allocated += n_undo - n_copies
        self.rounds += 1
        return result

    cdef object _item_view(self, uint32_t n):
        v = self._item_views[n]
        if v is None:
            v = _np_view(self._items_r, _DT_ITEM, n, False)
            self._item_views[n] = v
        return v

    cdef object _bout_view(self, uint32_t n):
        v = self._bout_views[n]
        if v is None:
            v = _np_view(self._bout_r, _DT_OUTPUT, n, True)
            self._bout_views[n] = v
        return v

    def finish(self, request_id):
        """Release the request's pages and free its slot.  Automatic mode: pages are released
        last page first; cached pages nobody else holds become reclaimable."""
        cdef uint64_t rid = _u64(request_id, "request_id")
        cdef int rc
        cdef uint64_t tok = self._own()
        try:
            if self.mode == MODE_AUTO:
                rc = auto_finish(&self.requests.s, &self.pool.pool, &self.cache, &self.streams,
                                 _slot_of(&self.requests.s, rid))
            else:
                rc = sched_finish(&self.requests.s, _slot_of(&self.requests.s, rid),
                                  &self.pool.pool)
        finally:
            self._unown(tok)
        if rc:
            raise _error(E_SCHED, rc)

    def fork(self, parent_id, child_id):
        """Start request ``child_id`` as a copy-on-write fork of the decoding request
        ``parent_id`` (docs/DESIGN.md, "Forks"); returns the child's slot."""
        cdef uint64_t prid = _u64(parent_id, "parent_id")
        cdef uint64_t crid = _u64(child_id, "child_id")
        cdef int32_t child = -1
        cdef int rc
        cdef uint64_t tok = self._own()
        try:
            rc = facade_fork(&self.requests.s, &self.pool.pool, &self.cache, &self.streams,
                             self.mode == MODE_AUTO, _slot_of(&self.requests.s, prid), crid,
                             NULL, &child)
        finally:
            self._unown(tok)
        if rc:
            raise _error(E_SCHED, rc)
        return child

    # -- prefix store --------------------------------------------------------------------------
    def evict(self, PrefixIdentity identity not None):
        """Drop the explicit prefix entry ``identity`` and release its pages
        (``PrefixKvError.Unknown`` when absent)."""
        cdef int rc
        cdef uint64_t tok = self._own()
        try:
            rc = store_evict(&self.prefixes.store, identity.hi, identity.lo, &self.pool.pool)
        finally:
            self._unown(tok)
        if rc:
            raise _error(E_STORE, rc)

    def evict_lru(self):
        """Drop the least recently used explicit prefix entry; returns its identity, or None when
        the store is empty."""
        cdef int rc = Q_OK
        cdef int32_t e
        cdef uint64_t hi = 0, lo = 0
        cdef Store *st = &self.prefixes.store
        cdef uint64_t tok = self._own()
        try:
            e = st.lru_head
            if e >= 0:
                hi = st.entries[e].hi
                lo = st.entries[e].lo
                rc = store_evict_entry(st, e, &self.pool.pool)
        finally:
            self._unown(tok)
        if e < 0:
            return None
        if rc:
            raise _error(E_STORE, rc)
        return _identity_from_hilo(hi, lo)

    def evict_unused_lru(self):
        """Evict the least recent entry whose pages only the store holds (so eviction frees
        them); None when there is none."""
        cdef Store *st = &self.prefixes.store
        cdef Pool *p = &self.pool.pool
        cdef int32_t e
        cdef uint32_t k, m, occ
        cdef uint32_t *pg
        cdef bint unused = False
        cdef int rc = Q_OK
        cdef uint64_t hi = 0, lo = 0
        cdef uint64_t tok = self._own()
        try:
            e = st.lru_head
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
                    hi = st.entries[e].hi
                    lo = st.entries[e].lo
                    rc = store_evict_entry(st, e, p)
                    break
                e = st.entries[e].next
        finally:
            self._unown(tok)
        if not unused:
            return None
        if rc:
            raise _error(E_STORE, rc)
        return _identity_from_hilo(hi, lo)

    # -- reads ---------------------------------------------------------------------------------
    def block_table(self, request_id):
        """The request's pages in logical order (a uint32 array)."""
        cdef int32_t index = self.requests._find(request_id)
        cdef Table *t = &self.requests.s.slots[index].blocks
        return _array_of(t.entries, t.len)

    def token_count(self, request_id):
        """Positions of the request that hold K/V: the position of its next token."""
        return self.requests.s.slots[self.requests._find(request_id)].token_count

    def runnable(self):
        """One ``REQUEST_VIEW`` record per active request, in slot order (a new array)."""
        return _views_array(&self.requests.s)

    def __repr__(self):
        return (f"Scheduler(max_requests={self.max_requests}, num_pages={self.num_pages}, "
                f"page_tokens={self.page_tokens}, logical_pages={self.logical_pages}, "
                f"prefix_caching={self.prefix_caching!r}, "
                f"active={self.active_count}, free_pages={self.free_pages})")

    # -- automatic prefix caching (core/cache/) ---------------------
    cdef int _explicit_only(self, str what) except -1:
        if self.mode != MODE_EXPLICIT:
            raise ValueError(f"{what} is for prefix_caching='explicit'; this scheduler uses "
                             f"prefix_caching={_MODE_NAMES[self.mode]!r}")
        return 0

    cdef object _admit_auto(self, object request_id, object prompt_tokens, object namespace,
                            object prefix_len):
        # admit in the automatic and the off modes: RESOLVE (id, namespace, tokens into private
        # memory), OWN, admit in C, RELEASE, then report
        cdef uint64_t rid = _u64(request_id, "request_id")
        cdef Admission_c adm
        cdef Toks t
        cdef Py_ssize_t nsl
        cdef uint64_t nsh, tok
        cdef int rc
        t.heap = NULL
        t.ptr = t.local
        t.n = 0
        if prefix_len is not None:
            self._explicit_only("prefix_len")
        cdef bytes ns = _namespace_bytes(namespace)
        nsl = len(ns)
        if nsl > NS_MAX_BYTES:
            raise ValueError(f"a namespace is at most {NS_MAX_BYTES} bytes, got {nsl}")
        keep = None
        if prompt_tokens is not None:
            keep = self._prompt(prompt_tokens, &t)  # last: no user code runs after it
        try:
            tok = self._own()
            try:
                if self.mode == MODE_OFF:
                    rc = sched_admit(&self.requests.s, rid, False, 0, 0, &self.prefixes.store,
                                     &self.pool.pool, &adm)
                else:
                    nsh = self.cache.ns.hashes[0] if nsl == 0 else \
                        pc_ns_hash(&self.cache, <const uint8_t *><char *>ns, <uint32_t>nsl)
                    rc = auto_admit(&self.requests.s, &self.pool.pool, &self.cache,
                                    &self.streams, rid, t.ptr, <uint32_t>t.n,
                                    <const uint8_t *><char *>ns, <uint32_t>nsl, nsh, NULL, NULL,
                                    &adm)
            finally:
                self._unown(tok)
        finally:
            _tokens_free(&t)
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
        # (reserve_room, core/seed/reserve.pxi: the engine step reserves through it too)
        return reserve_room(&self.requests.s, &self.pool.pool, &self.cache, index, first, last)

    def cached_prefix_tokens(self, prompt_tokens, namespace=b""):
        """How many tokens of ``prompt_tokens`` an admission in ``namespace`` would take from
        the cache right now (verified, at least one token left to compute).  Changes nothing,
        counts nothing."""
        return self._probe(prompt_tokens, namespace, "cached_prefix_tokens", False)

    def cached_prefix(self, prompt_tokens, namespace=b""):
        """``CachedPrefix(tokens, pages, reclaimable)``: what an admission of ``prompt_tokens``
        in ``namespace`` would take from the cache right now, and how many of those pages are
        reclaimable now (the admission takes them out of ``free_pages``).  Changes nothing
        and writes no scratch of the core (it has its own)."""
        return self._probe(prompt_tokens, namespace, "cached_prefix", True)

    cdef object _probe(self, object prompt_tokens, object namespace, str what, bint detail):
        # read-only: RESOLVE, then one C stretch that reads the cache into C values
        cdef Toks t
        cache_need_auto(self.mode, what)
        nsb, nsl = cache_namespace(namespace)
        keep = self._prompt(prompt_tokens, &t)   # last: no user code runs after it
        try:
            return cache_probe(&self.cache, &self.streams, t.ptr, t.n, nsb, detail)
        finally:
            _tokens_free(&t)

    def drain_events(self, out=None):
        """Pending KV events, oldest first.  Without ``out``: a new KV_EVENT array of all of
        them.  With ``out`` (a writable 1-D KV_EVENT array): write up to ``len(out)`` events
        into it and return how many (no allocation).  Events left in the ring stay pending.
        A full ring drops new events and counts them (``cache_stats().events_dropped``)."""
        return cache_drain(&self.cache, out)

    def clear_cache(self):
        """Drop every cache entry (pages held by requests stay with them); emits one "cleared"
        event.  Returns the number of entries dropped."""
        cdef uint32_t n = 0
        cdef uint64_t tok = self._own()
        try:
            if self.mode == MODE_AUTO:
                n = pc_clear(&self.cache, &self.pool.pool)
        finally:
            self._unown(tok)
        return n

    def cache_stats(self):
        """Counters of automatic prefix caching, as a CacheStats."""
        return cache_stats_of(&self.cache, &self.pool.pool)

    def reclaimable_pages(self):
        """The reclaimable cached pages, least recently used (next to be reclaimed) first."""
        return cache_reclaimable(&self.cache, self.mode)

    def cache_entry(self, page):
        """The cache entry of physical ``page`` as a CacheEntry, or None when it is not
        cached."""
        cdef uint32_t pg = _u32(page, "page")
        if pg >= self.pool.pool.num_blocks:
            raise PoolError.InvalidPage()
        return cache_entry_of(&self.cache, self.mode, pg)

    def page_identities(self, tokens, namespace=b""):
        """The chained identities of the full pages of ``tokens`` in ``namespace`` under this
        scheduler's cache key (a uint64 array): what a router computes to predict hits.  Reads
        only the key."""
        cache_need_auto(self.mode, "page_identities")
        return cache_page_identities(&self.cache, tokens, namespace)

    def _debug_namespaces(self):
        """Test hook: the namespace table as ``(rows, idle)``: ``(id, name, references,
        reclaimable pages)`` for every id in use, by id, and the idle ids, least recently used
        first, for tests that hold it against the twin's."""
        cache_need_auto(self.mode, "_debug_namespaces")
        return cache_namespaces(&self.cache)

    def _debug_identity_mask(self, mask, parent_mask=0xFFFFFFFFFFFFFFFF):
        """Test hook: AND every page identity computed from now on with ``mask`` (0 makes every
        page collide) and the parent identity it is derived from with ``parent_mask`` (0 makes
        identities blind to the parent), to prove that verification, not the hash, decides a
        hit."""
        cdef uint64_t m = _u64(mask, "mask")
        cdef uint64_t pm = _u64(parent_mask, "parent_mask")
        cdef uint64_t tok = self._own()
        try:
            self.cache.ident_mask = m
            self.cache.parent_mask = pm
        finally:
            self._unown(tok)
