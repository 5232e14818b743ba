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


cdef uint64_t I32_LIMIT = 2147483647   # the largest value of the plan's int32 arrays


cdef int _attach_finished(object err, list finished) except -1:
    # run()'s failure carries the requests its earlier steps finished: they are no longer
    # queued, so this is the only place they are reported (docs/DESIGN.md, "The loop")
    try:
        err.finished = finished
    except Exception:
        pass    # an exception that takes no attributes: nothing more can be done
    return 0


cdef tuple _resolve_topk(object topk_ids, object topk_logprobs):
    # RESOLVE update()'s candidates, reading no scheduler state: private copies (user code runs
    # here only), or the conversion's error, raised by _load_topk only when the plan has beam
    # rows (a plan without them ignores the arguments)
    if topk_ids is None or topk_logprobs is None:
        return (None, None, None)
    try:
        return (np.array(topk_ids), np.array(topk_logprobs), None)
    except Exception as exc:
        return (None, None, exc)


cdef int _alloc_candidates(void **ids, void **lps, size_t n, size_t lp_size) except -1:
    # a pair of candidate buffers of n entries (uint32 ids; log-probabilities of lp_size bytes),
    # allocated once: both, or neither and MemoryError
    if ids[0] != NULL:
        return 0
    ids[0] = PyMem_Malloc(n * sizeof(uint32_t))
    lps[0] = PyMem_Malloc(n * lp_size)
    if ids[0] == NULL or lps[0] == NULL:
        PyMem_Free(ids[0])
        PyMem_Free(lps[0])
        ids[0] = NULL
        lps[0] = NULL
        raise MemoryError()
    return 0


cdef class Scheduler:
    """admit / decode / finish over an owned BlockPool, PrefixKvStore and RequestScheduler.

    Everything (pages, prefix entries, request slots, every scratch buffer) is sized here, once.
    Every mutating method owns the facade and its pool, store and request scheduler for the whole
    call (docs/DESIGN.md, "Ownership"): a call made meanwhile -- from a backend, a GC callback or
    another thread, on the facade or on ``pool``/``prefixes``/``requests`` -- raises
    ``BusyError`` and changes nothing.

    While ``run()`` with a C step backend runs its GIL-free loop, every other call on the
    facade and on its raw objects raises ``BusyError`` and changes nothing, reads included
    (``stats``, ``cached_prefix``, ``request_tokens``, ``num_waiting``, ...), except
    ``drain_events()``, which drains the KV event ring concurrently; configuration properties
    and ``page_identities`` read nothing the loop changes and work too (docs/DESIGN.md,
    "Concurrency").  Reads work at every other time, from a Python backend mid-step too.
    """
    cdef readonly BlockPool pool
    cdef readonly PrefixKvStore prefixes
    cdef readonly RequestScheduler requests
    cdef readonly uint32_t page_tokens
    cdef uint64_t owner
    cdef uint8_t gil_free   # run()'s GIL-free loop is changing everything (ownership.pxi)
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
    cdef StepState step     # the engine step (core/step.pxi)
    cdef _StepBuffers _step_bufs

    def __cinit__(self, max_requests, num_blocks, page_tokens, logical_pages,
                  prefix_entries=64, prefix_pages=None, prefix_caching="auto", cache_key=None,
                  max_namespaces=1024, event_capacity=4096, max_num_batched_tokens=2048,
                  max_num_seqs=None, max_queued=None, max_prefill_chunk=None, vocab_size=None):
        cdef uint32_t pt = _u32(page_tokens, "page_tokens")
        cdef uint32_t nb = _u32(num_blocks, "num_blocks")
        if pt == 0:
            raise ValueError("page_tokens must be at least 1")
        if nb == 0:
            raise ValueError("num_blocks must be at least 1")
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
        cdef uint32_t budget = _u32(max_num_batched_tokens, "max_num_batched_tokens")
        if budget == 0:
            raise ValueError("max_num_batched_tokens must be at least 1")
        # the step plan's arrays are int32 (what kernels take): page ids, positions, row
        # offsets and CSR offsets must fit, or a plan would wrap silently
        if nb > I32_LIMIT + 1:
            raise ValueError(f"num_blocks must be at most 2**31 (page ids are int32 in the step "
                             f"plan), got {nb}")
        if budget > I32_LIMIT:
            raise ValueError(f"max_num_batched_tokens must be at most 2**31-1 (token offsets "
                             f"are int32 in the step plan), got {budget}")
        cdef object seqs = None if max_num_seqs is None else _u32(max_num_seqs, "max_num_seqs")
        cdef object queued = None if max_queued is None else _u32(max_queued, "max_queued")
        cdef uint32_t chunk = 0
        if max_prefill_chunk is not None:
            chunk = _u32(max_prefill_chunk, "max_prefill_chunk")
            if chunk == 0:
                raise ValueError("max_prefill_chunk must be at least 1 (or None)")
        cdef uint64_t vocab = 0
        if vocab_size is not None:
            vocab = _u32(vocab_size, "vocab_size")
            if vocab == 0:
                raise ValueError("vocab_size must be at least 1 (or None)")
        self.page_tokens = pt
        self.pool = BlockPool(nb)
        self.requests = RequestScheduler(max_requests, logical_pages)
        lp = self.requests.logical_pages
        self.prefixes = PrefixKvStore(prefix_entries,
                                      prefix_pages if prefix_pages is not None else max(lp, 1))
        mr = self.requests.max_requests
        if <uint64_t>lp * pt > I32_LIMIT:
            raise ValueError(f"logical_pages x page_tokens must be at most 2**31-1 (positions "
                             f"are int32 in the step plan), got {lp} x {pt}")
        if <uint64_t>lp * (mr if seqs is None else seqs) > I32_LIMIT:
            raise ValueError(f"max_num_seqs x logical_pages must be at most 2**31-1 (the "
                             f"paged-KV offsets are int32 in the step plan)")
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
            streams_init(&self.streams, mr, lp, pt)
        if seqs is None:
            seqs = mr
        if not 1 <= seqs <= mr:
            raise ValueError(f"max_num_seqs must be in [1, max_requests={mr}], got {seqs}")
        if queued is None:
            queued = 4 * mr
        if queued < seqs or queued > (1 << 30):
            raise ValueError(f"max_queued must be in [max_num_seqs={seqs}, 2**30], "
                             f"got {queued}")
        self._step_bufs = _StepBuffers()
        step_init(&self.step, self._step_bufs, &self.requests.s, &self.pool.pool, &self.cache,
                  &self.streams, self.undo, self.copies_p, &self.pages_copied,
                  &self.pages_allocated, self.mode, pt, budget, <uint32_t>seqs,
                  <uint32_t>queued, chunk, vocab)

    def __dealloc__(self):
        # the raw objects may outlive the facade: hand them back free
        if self.requests is not None and self.requests.owner == OWN_STEP_HELD:
            self.requests.owner = 0
        if self.prefixes is not None and self.prefixes.owner == OWN_STEP_HELD:
            self.prefixes.owner = 0
        if self.pool is not None and self.pool.owner == OWN_STEP_HELD:
            self.pool.owner = 0
        step_free(&self.step)
        PyMem_Free(self.undo)
        pc_free(&self.cache)
        streams_free(&self.streams)

    # -- ownership -------------------------------------------------------------------------------
    cdef inline uint64_t _own(self) except 0:
        # raw objects held for the step (OWN_STEP_HELD) are taken over by the facade's own calls
        cdef bint held = self.owner == 0 and self.requests.owner == OWN_STEP_HELD
        if held:
            self._hold_raw(OWN_STEP_HELD, 0)
        try:
            return own_acquire(&self.owner, &self.requests.owner, &self.prefixes.owner,
                               &self.pool.owner)
        except BaseException:
            if held:
                self._hold_raw(0, OWN_STEP_HELD)
            raise

    cdef inline void _unown(self, uint64_t token) noexcept:
        own_release(token, &self.owner, &self.requests.owner, &self.prefixes.owner,
                    &self.pool.owner)
        if self.owner == 0 and self._step_mode():
            self._hold_raw(0, OWN_STEP_HELD)

    cdef inline bint _step_mode(self) noexcept:
        # The facade belongs to the engine step while step requests exist (queued, running or
        # uncollected) or a plan is pending: a kernel may be executing the plan, and every page
        # it names stays pinned until update() or discard_plan() retires it (requests aborted
        # meanwhile hand their pages back then), whatever API asks for pages
        return self.step.count != 0 or self.step.n_done != 0 or self.step.pending

    cdef inline void _gil_free(self, uint8_t on) noexcept:
        # with the GIL, around run()'s GIL-free stretch (under ownership): every read of the
        # facade and of its raw objects raises BusyError while it is set
        self.gil_free = on
        self.pool.gil_free = on
        self.prefixes.gil_free = on
        self.requests.gil_free = on

    cdef inline void _hold_raw(self, uint64_t was, uint64_t now) noexcept:
        if self.requests.owner == was:
            self.requests.owner = now
        if self.prefixes.owner == was:
            self.prefixes.owner = now
        if self.pool.owner == was:
            self.pool.owner = now

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
        own_readable(self.gil_free)
        return self.requests.s.active

    @property
    def free_pages(self):
        """Pages an allocation can take: free pages plus reclaimable cached pages."""
        own_readable(self.gil_free)
        return self.pool.pool.free_top + self.cache.n_state[PC_RECLAIMABLE]

    @property
    def prefix_caching(self):
        return _MODE_NAMES[self.mode]

    def stats(self):
        # C values first: building the dict runs Python code
        own_readable(self.gil_free)
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
            "num_blocks": nb,
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
                self._no_step()     # under ownership, after every argument is resolved
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
        # (facade_make_writable, core/step.pxi: the engine step reserves through it too)
        return facade_make_writable(&self.requests.s, &self.pool.pool, self.undo, self.copies_p,
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
            self._no_step()     # under ownership, after every argument is resolved
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
                    _undo(s, &self.pool.pool, self.undo, n_undo)
                    raise
                self.pages_copied += n_copies
                self.pages_allocated += n_undo
                if self.mode == MODE_AUTO:
                    auto_after_cow(&self.cache, &self.pool.pool, self.undo, n_undo)
            else:
                _undo(s, &self.pool.pool, self.undo, n_undo)
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
            self._no_step()     # under ownership, after every argument is resolved
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
            self._no_step()     # under ownership, after every argument is resolved
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
        cdef int rc = Q_OK
        # RESOLVE the whole backend before anything is owned or read: its capsule or bound
        # methods (properties and __getattr__ run user code)
        handle = _resolve_backend(backend, &cb)
        copy_fn = None
        if cb == NULL or cb.copy_pages == NULL:
            copy_fn = getattr(backend, "copy_pages", None)
        cdef uint64_t tok = self._own()
        try:
            self._no_step()     # under ownership, after every argument is resolved
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
            rc = self._auto_decode_prepare()
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
                    _undo(s, &self.pool.pool, self.undo, n_undo)
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
            _undo(s, &self.pool.pool, self.undo, n_undo)
            raise
        if rc:
            _undo(s, &self.pool.pool, self.undo, n_undo)
            rc_out[0] = rc
            return None
        # commit: from here nothing can fail or run Python code
        if n:
            memcpy(self.results_p, self.bout_p, n * sizeof(qualia_batch_output))
            round_commit(s, self.bout_p, n)
        if self.mode == MODE_AUTO:
            self._auto_after_round(n)
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
            self._no_step()     # under ownership, after every argument is resolved
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
            self._no_step()     # under ownership, after every argument is resolved
            rc = facade_fork(&self.requests.s, &self.pool.pool, &self.cache, &self.streams,
                             self.mode == MODE_AUTO, _slot_of(&self.requests.s, prid), crid,
                             &child)
        finally:
            self._unown(tok)
        if rc:
            raise _error(E_SCHED, rc)
        return child

    # -- prefix store --------------------------------------------------------------------------
    def evict(self, PrefixIdentity identity not None):
        cdef int rc
        cdef uint64_t tok = self._own()
        try:
            rc = store_evict(&self.prefixes.store, identity.hi, identity.lo, &self.pool.pool)
        finally:
            self._unown(tok)
        if rc:
            raise _error(E_STORE, rc)

    def evict_lru(self):
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
        cdef int32_t index = self.requests._find(request_id)
        cdef Table *t = &self.requests.s.slots[index].blocks
        return _array_of(t.entries, t.len)

    def token_count(self, request_id):
        return self.requests.s.slots[self.requests._find(request_id)].token_count

    def runnable(self):
        own_readable(self.gil_free)
        return _views_array(&self.requests.s)

    def __repr__(self):
        if self.gil_free:   # a repr never raises: it leaves out what the loop is changing
            return (f"Scheduler(max_requests={self.max_requests}, num_blocks={self.num_blocks}, "
                    f"page_tokens={self.page_tokens}, logical_pages={self.logical_pages}, "
                    f"prefix_caching={self.prefix_caching!r}, busy)")
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

    cdef int _auto_only(self, str what) except -1:
        if self.mode != MODE_AUTO:
            raise ValueError(f"{what} is for prefix_caching='auto'; this scheduler uses "
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
                self._no_step()     # under ownership, after every argument is resolved
                if self.mode == MODE_OFF:
                    rc = sched_admit(&self.requests.s, rid, False, 0, 0, &self.prefixes.store,
                                     &self.pool.pool, &adm)
                else:
                    nsh = self.cache.ns.hashes[0] if nsl == 0 else \
                        pc_ns_hash(&self.cache, <const uint8_t *><char *>ns, <uint32_t>nsl)
                    rc = auto_admit(&self.requests.s, &self.pool.pool, &self.cache,
                                    &self.streams, rid, t.ptr, <uint32_t>t.n,
                                    <const uint8_t *><char *>ns, <uint32_t>nsl, nsh, &adm)
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
        # (facade_make_room, core/step.pxi: the engine step reserves through it too)
        return facade_make_room(&self.requests.s, &self.pool.pool, &self.cache, index, first,
                                last)

    cdef int _auto_decode_prepare(self) noexcept:
        # decode: note each decoding slot's input token and position (streams still cached);
        # reclaim what the round's make-writable will allocate, or fail before changing anything.
        # With no reclaimable page there is nothing to reclaim, and the make-writable loop fails
        # with the same first error, changing nothing, so the count is skipped.  A page several
        # decoding forks share is counted as the round will find it: each writer but the last
        # holder copies it (fork_writer_seen, undone before returning).
        cdef Sched *s = &self.requests.s
        cdef Pool *p = &self.pool.pool
        cdef uint64_t need = 0
        cdef uint64_t avail = <uint64_t>p.free_top + self.cache.n_state[PC_RECLAIMABLE]
        cdef bint count = self.cache.n_state[PC_RECLAIMABLE] != 0
        cdef bint note = self.streams.cacheable != 0
        cdef uint32_t i, w, lp
        cdef uint64_t bits
        cdef int rc = Q_OK
        cdef Py_ssize_t n_seen = 0
        cdef Slot *sl
        cdef Stream *st
        if not count and not note:
            return Q_OK
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
                        rc = Q_EXHAUSTED
                        break
                elif lp < sl.blocks.len and sl.blocks.entries[lp] < p.num_blocks \
                        and p.refcount[sl.blocks.entries[lp]] == 1:
                    pass
                else:
                    rc = auto_need_pages(&sl.blocks, lp, lp, p, &self.cache, &need)
                    if rc:
                        break
                    fork_writer_seen(p, &sl.blocks, lp, self.undo, &n_seen)
            if rc:
                break
        fork_writers_restore(p, self.undo, n_seen)
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
        reclaimable now (the admission takes them out of ``free_pages``).  Changes nothing
        and writes no scratch of the core (it has its own)."""
        return self._probe(prompt_tokens, namespace, "cached_prefix", True)

    cdef object _probe(self, object prompt_tokens, object namespace, str what, bint detail):
        # read-only: RESOLVE, then one C stretch that reads the cache into C values
        cdef Toks t
        cdef Py_ssize_t nsl
        cdef uint32_t ns, k = 0, i, rec = 0, hashed
        cdef bint collided
        cdef uint64_t nsh
        self._auto_only(what)
        cdef bytes nsb = _namespace_bytes(namespace)
        nsl = len(nsb)
        if nsl > NS_MAX_BYTES:
            raise ValueError(f"a namespace is at most {NS_MAX_BYTES} bytes, got {nsl}")
        keep = self._prompt(prompt_tokens, &t)   # last: no user code runs after it
        try:
            own_readable(self.gil_free)
            # the reads' own scratch (read_*): the core's probe scratch belongs to the step,
            # which may be between its probe and its admission (a Python backend calling back)
            nsh = self.cache.ns.hashes[0] if nsl == 0 else \
                pc_ns_hash(&self.cache, <const uint8_t *><char *>nsb, <uint32_t>nsl)
            ns = ns_find(&self.cache.ns, nsh, <const uint8_t *><char *>nsb, <uint32_t>nsl)
            if ns != U32_MAX:
                hashed = (t.n - 1) // self.page_tokens if t.n else 0
                k = auto_match(&self.cache, t.ptr, <uint32_t>t.n, ns, nsh, hashed,
                               self.streams.read_ident, self.streams.read_canon,
                               self.streams.read_gen, &collided)
                for i in range(k):
                    rec += pc_rec(&self.cache, self.streams.read_canon[i]).state \
                        == PC_RECLAIMABLE
        finally:
            _tokens_free(&t)
        if not detail:
            return k * self.page_tokens
        return CachedPrefix(k * self.page_tokens, k, rec)

    def drain_events(self, out=None):
        """Pending KV events, oldest first.  Without ``out``: a new KV_EVENT array of all of
        them.  With ``out`` (a writable 1-D KV_EVENT array): write up to ``len(out)`` events
        into it and return how many (no allocation).  Events left in the ring stay pending.
        The ring is a single-producer, single-consumer ring: the core writes it (without the
        GIL inside run()), drain_events reads it (with the GIL, one caller at a time), so it
        takes no ownership and may be called at any time, from any thread, even while run()'s
        GIL-free loop runs: every event comes out once, in order.  A full ring drops new
        events and counts them (``cache_stats().events_dropped``)."""
        cdef void *ptr
        cdef Py_ssize_t n
        cdef uint32_t count
        if out is None:
            count = pc_pending(&self.cache)
            arr = np.empty(count, dtype=_DT_KV_EVENT)
            # the allocation may have run a GC callback that drained or added events: take at
            # most what the array holds
            return arr[:pc_drain(&self.cache, <KvEvent *>cnp.PyArray_DATA(<cnp.ndarray>arr),
                                 count)]
        if not _fast_array(out, _DT_KV_EVENT, 8, True, &ptr, &n):
            raise TypeError("out must be a writable 1-D C-contiguous numpy array of dtype "
                            "KV_EVENT")
        return pc_drain(&self.cache, <KvEvent *>ptr,
                        <uint32_t>(n if n < <Py_ssize_t>U32_MAX else U32_MAX))

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
        # C values first: building the tuple runs Python code
        own_readable(self.gil_free)
        cdef PageCache *c = &self.cache
        cdef uint32_t nb = self.pool.pool.num_blocks
        cdef uint32_t held = nb - self.pool.pool.free_top - c.n_state[PC_RECLAIMABLE]
        cdef uint64_t lookups = c.lookups, lookup_tokens = c.lookup_tokens
        cdef uint64_t hit_tokens = c.hit_tokens, reclaims = c.reclaims, stored = c.stored
        cdef uint64_t duplicates = c.duplicates, collisions = c.collisions
        cdef uint64_t hashed = c.pages_hashed, dropped = c.ev.dropped
        cdef uint32_t cached = c.n_state[PC_INUSE] + c.n_state[PC_RECLAIMABLE]
        cdef uint32_t reclaimable = c.n_state[PC_RECLAIMABLE], pending = pc_pending(c)
        cdef uint32_t namespaces = c.ns.count
        return CacheStats(lookups, lookup_tokens, hit_tokens, reclaims, cached, reclaimable,
                          stored, duplicates, collisions, hashed, pending, dropped, namespaces,
                          (<double>held) / nb if nb else 0.0)

    def reclaimable_pages(self):
        """The reclaimable cached pages, least recently used (next to be reclaimed) first."""
        own_readable(self.gil_free)
        cdef uint32_t n = self.cache.n_state[PC_RECLAIMABLE] if self.mode == MODE_AUTO else 0
        cdef uint32_t *tmp = <uint32_t *>PyMem_Malloc((n if n else 1) * sizeof(uint32_t))
        cdef uint32_t p, k = 0
        if tmp == NULL:
            raise MemoryError()
        try:
            if n:
                p = self.cache.head[PC_RECLAIMABLE]
                while p != U32_MAX and k < n:
                    tmp[k] = p
                    k += 1
                    p = pc_rec(&self.cache, p).next
            return _array_of(tmp, k)
        finally:
            PyMem_Free(tmp)

    def cache_entry(self, page):
        """The cache entry of physical ``page`` as a CacheEntry, or None when it is not
        cached."""
        cdef uint32_t pg = _u32(page, "page")
        cdef CachePage x
        if pg >= self.pool.pool.num_blocks:
            raise PoolError.InvalidPage()
        own_readable(self.gil_free)
        if self.mode != MODE_AUTO or pc_rec(&self.cache, pg).state == PC_NONE:
            return None
        x = pc_rec(&self.cache, pg)[0]  # a copy: building the result runs Python code
        return CacheEntry(x.ident, x.parent_ident if x.has_parent else None, x.ns, x.gen,
                          x.state == PC_RECLAIMABLE)

    def page_identities(self, tokens, namespace=b""):
        """The chained identities of the full pages of ``tokens`` in ``namespace`` under this
        scheduler's cache key (a uint64 array): what a router computes to predict hits.  Reads
        only the key."""
        cdef Toks t
        cdef Py_ssize_t k, pages, nsl
        cdef uint64_t nsh, chain = 0
        cdef uint64_t[::1] v
        self._auto_only("page_identities")
        cdef bytes ns = _namespace_bytes(namespace)
        nsl = len(ns)
        if nsl > NS_MAX_BYTES:
            raise ValueError(f"a namespace is at most {NS_MAX_BYTES} bytes, got {nsl}")
        keep = _tokens_resolve(tokens, &t, -1, "")
        try:
            pages = t.n // self.page_tokens
            out = np.empty(pages, dtype=np.uint64)
            v = out
            nsh = pc_ns_hash(&self.cache, <const uint8_t *><char *>ns, <uint32_t>nsl)
            for k in range(pages):
                chain = pc_chain(&self.cache, chain, k > 0, nsh, &t.ptr[k * self.page_tokens])
                v[k] = pc_ident(&self.cache, chain)
        finally:
            _tokens_free(&t)
        return out

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

    # -- the engine step (core/step.pxi; docs/DESIGN.md, "The engine step") ---------------------
    cdef int _no_step(self) except -1:
        # the manual verbs refuse while step requests exist (queued, running or uncollected)
        # or a plan is pending (its pages are pinned, see _step_mode)
        if self._step_mode():
            raise StepError.ModeConflict(None, "engine-step requests exist or a plan is "
                                               "pending; the manual verbs (admit/reserve/"
                                               "advance/complete_prefill/decode/finish) are "
                                               "refused until they are done")
        return 0

    @property
    def num_waiting(self):
        own_readable(self.gil_free)
        return self.step.n_waiting

    @property
    def num_running(self):
        own_readable(self.gil_free)
        return self.step.n_running

    @property
    def max_num_batched_tokens(self):
        return self.step.budget

    @property
    def max_num_seqs(self):
        return self.step.max_seqs

    @property
    def max_queued(self):
        return self.step.max_queued

    @property
    def max_prefill_chunk(self):
        return self.step.max_chunk if self.step.max_chunk else None

    @property
    def vocab_size(self):
        return self.step.vocab if self.step.vocab else None

    def has_unfinished(self):
        own_readable(self.gil_free)
        return self.step.count != 0

    def add_request(self, request_id, prompt_tokens, *, max_new_tokens, namespace=b"",
                    priority=0, eos_token_id=None, stop_token_ids=(), ignore_eos=False, n=1,
                    beam_width=None):
        """Queue a request: its prompt is copied into the token arena (docs/DESIGN.md, "The
        engine step", "Requests").  ``n > 1`` samples ``n`` continuations of the prompt on
        copy-on-write forks (docs/DESIGN.md, "Forks at the step level"): one prefill, ``n``
        members, one ``FinishedGroup`` under ``request_id``; the group takes ``n`` entries of
        the queue.  ``beam_width=w`` runs beam search of width ``w`` on forks (docs/DESIGN.md,
        "Beam search at the step level"): plans with beam rows have ``num_topk > 0`` and
        ``update`` takes each row's best ids and log-probabilities; one ``FinishedGroup`` with
        the ``w`` hypotheses best first and their scores; the group takes ``w`` entries."""
        cdef uint64_t rid = _u64(request_id, "request_id")
        n = _group_size(n, "n", self.step.max_seqs)
        cdef uint32_t bw = 0
        if beam_width is not None:
            beam_width = _group_size(beam_width, "beam_width", self.step.max_seqs)
            if n != 1:
                raise ValueError("beam search returns beam_width hypotheses: leave n at 1")
            if self.step.vocab and beam_width > self.step.vocab:
                # a beam row's w candidates are distinct tokens of the vocabulary
                raise ValueError(f"beam_width must be at most vocab_size={self.step.vocab}, "
                                 f"got {beam_width}")
            bw = <uint32_t>beam_width
        cdef uint32_t n_members = <uint32_t>n
        cdef uint32_t max_new = _u32(max_new_tokens, "max_new_tokens")
        cdef uint32_t stop[STOP_MAX]
        cdef uint32_t n_stop = 0, eos = 0
        cdef bint has_eos = eos_token_id is not None
        cdef Toks t
        cdef Py_ssize_t nsl
        cdef uint64_t nsh = 0, tok
        cdef uint8_t *nsb = NULL
        cdef int rc = Q_OK
        if max_new == 0:
            raise ValueError("max_new_tokens must be at least 1")
        if isinstance(priority, (bool, np.bool_)):
            raise TypeError("priority must be an integer, not bool")
        prio = int.__index__(operator.index(priority))   # exact int (3.9: a subclass)
        if not -(1 << 31) <= prio < (1 << 31):
            raise OverflowError(f"priority must be in [-2**31, 2**31-1], got {prio}")
        if has_eos:
            eos = _u32(eos_token_id, "eos_token_id")
        if isinstance(stop_token_ids, (str, bytes, bytearray, memoryview)):
            raise TypeError("stop_token_ids must be a sequence of token ids")
        stops = [_u32(x, "stop token id") for x in stop_token_ids]
        if len(stops) > STOP_MAX:
            raise ValueError(f"at most {STOP_MAX} stop token ids, got {len(stops)}")
        for n_stop in range(len(stops)):
            stop[n_stop] = stops[n_stop]
        n_stop = len(stops)
        cdef bint ignore = bool(ignore_eos)
        cdef bytes ns = _namespace_bytes(namespace)
        nsl = len(ns)
        if nsl > NS_MAX_BYTES:
            raise ValueError(f"a namespace is at most {NS_MAX_BYTES} bytes, got {nsl}")
        if self.mode == MODE_EXPLICIT:
            raise StepError.ModeConflict(None, "the engine step works in prefix_caching 'auto' "
                                               "and 'off', not 'explicit'")
        keep = self._prompt(prompt_tokens, &t)   # last: no user code runs after it
        try:
            if t.n == 0:
                raise ValueError("the prompt must have at least one token")
            if t.n > U32_MAX:
                raise StepError.NeverFits()
            if bw and max_new:
                # the w beams are computed side by side: the prompt's full pages once (shared)
                # and each beam's own tail must fit the pool together.  Without a prefix cache
                # (mode "off") a parked or queued beam recomputes its prompt into pages of its
                # own, so each beam's whole sequence must fit beside the others
                pt = self.page_tokens
                tail = -(-(t.n + max_new - 1) // pt) - t.n // pt
                need = t.n // pt + bw * tail
                if self.mode == MODE_OFF:
                    need = bw * (t.n // pt + tail)
                if need > self.pool.pool.num_blocks:
                    raise StepError.NeverFits(None, f"{bw} beams need {need} pages side by "
                                                    f"side, the pool has "
                                                    f"{self.pool.pool.num_blocks}")
            if self.mode == MODE_AUTO:
                nsh = self.cache.ns.hashes[0] if nsl == 0 else \
                    pc_ns_hash(&self.cache, <const uint8_t *><char *>ns, <uint32_t>nsl)
                if nsl:
                    nsb = <uint8_t *>malloc(nsl)
                    if nsb == NULL:
                        raise MemoryError()
                    memcpy(nsb, <char *>ns, nsl)
            rc = -1     # until step_add says otherwise, nsb is ours to free
            try:
                tok = self._own()
                try:
                    if bw:
                        self._beam_buffers()
                    rc = step_add(&self.step, rid, t.ptr, <uint32_t>t.n, max_new, prio, has_eos,
                                  eos, stop, n_stop, ignore, nsb, <uint32_t>nsl, nsh,
                                  self.pool.pool.num_blocks, n_members, bw)
                finally:
                    self._unown(tok)
            finally:
                if rc:
                    free(nsb)   # on success the entry owns it
        finally:
            _tokens_free(&t)
        if rc:
            raise _error(E_STEP, rc)

    cdef int _beam_buffers(self) except -1:
        # under ownership: the candidate buffers, allocated with the first beam group (one row
        # of max_num_seqs candidates per entry: a parked beam keeps its candidates)
        cdef StepState *st = &self.step
        return _alloc_candidates(<void **>&st.cand_ids, <void **>&st.cand_lps,
                                 <size_t>st.max_queued * st.max_seqs, sizeof(double))

    cdef int _topk_buffers(self) except -1:
        # under ownership, before run() hands beam plans to a C backend: room for every row's
        # candidates (rows_cap rows of max_num_seqs)
        cdef StepState *st = &self.step
        cdef size_t n = <size_t>st.rows_cap * st.max_seqs
        _alloc_candidates(<void **>&st.topk_ids_buf, <void **>&st.topk_lps_buf, n, sizeof(float))
        st.topk_cap = n
        return 0

    def abort(self, request_id):
        """Drop a waiting or running request.  A running one hands its pages back now, unless it
        is in the pending plan: update() skips it, and its pages stay pinned until update() or
        discard_plan() retires the plan (a kernel may be executing it)."""
        cdef uint64_t rid = _u64(request_id, "request_id")
        cdef StepState *st = &self.step
        cdef int rc
        cdef int32_t e
        cdef uint64_t tok = self._own()
        try:
            # room for this abort (a group: its members); update() makes room for its own
            e = step_find(st, rid)
            self._accum_room(<uint64_t>st.n_accum + (
                st.req[e].n_members if e >= 0 and st.req[e].group == e else 1))
            rc = step_abort(st, rid)
        finally:
            self._unown(tok)
        if rc:
            raise _error(E_STEP, rc)

    def schedule(self):
        """Plan the next step (docs/DESIGN.md, "The engine step", "One step")."""
        cdef int rc
        cdef uint64_t tok = self._own()
        try:
            rc = step_schedule(&self.step)
            if rc == Q_OK:
                # built while owned: no other call (a GC callback, another thread) can update,
                # abort or re-plan between the plan and its views
                plan = step_plan(&self.step, self._step_bufs)
        finally:
            self._unown(tok)
        if rc:
            raise _error(E_STEP, rc)
        return plan

    cdef object _resolve_sampled(self, object ids):
        # RESOLVE update()'s sampled ids, reading no scheduler state: an exact 1-D native uint32
        # ndarray is returned as it is (read in place, under ownership); anything else becomes
        # a private list of exact ints (user code -- __index__, iterators -- runs here only).
        cdef const uint32_t *p
        cdef Py_ssize_t n
        if _u32_array(ids, &p, &n):
            return ids
        if isinstance(ids, np.ndarray):
            if ids.ndim != 1:
                raise ValueError(f"sampled_token_ids must be 1-D, got {ids.ndim} dimensions")
            if ids.dtype.kind not in "iu":
                raise TypeError(f"sampled_token_ids must be integers, got dtype {ids.dtype}")
            return ids.tolist()
        if isinstance(ids, (str, bytes, bytearray, memoryview)):
            raise TypeError("sampled_token_ids must be a sequence of token ids")
        return [_u32(x, "sampled token id") for x in ids]

    cdef int _load_sampled(self, object values) except -1:
        # under ownership: the pending plan's length and the vocabulary checked, the ids copied
        # into step.sampled.  No user code runs: values is an exact uint32 ndarray (copied
        # first, then checked, so a thread writing the caller's array cannot slip an id past
        # the check) or a private list of exact ints.
        cdef StepState *st = &self.step
        cdef const uint32_t *p
        cdef Py_ssize_t n, i
        cdef uint64_t limit = st.vocab - 1 if st.vocab else U32_MAX
        if not st.pending:
            raise StepError.NoPlan(None, "schedule() first")
        if type(values) is list:
            n = len(<list>values)
            if n != st.m:
                raise ValueError(f"the plan samples {st.m} rows, got {n} token ids")
            for x in <list>values:
                if not 0 <= x <= limit:
                    raise ValueError(f"sampled token id {x} is outside [0, {limit}]")
            for i in range(n):
                st.sampled[i] = <uint32_t>(<list>values)[i]
            return 0
        _u32_array(values, &p, &n)
        if n != st.m:
            raise ValueError(f"the plan samples {st.m} rows, got {n} token ids")
        memcpy(st.sampled, p, n * sizeof(uint32_t))
        for i in range(n):
            if st.sampled[i] > limit:
                raise ValueError(f"sampled token id {st.sampled[i]} is outside [0, {limit}]")
        return 0

    cdef object _load_topk(self, tuple topk):
        # under ownership, after _load_sampled: a plan with beam rows takes [m, num_topk]
        # candidates (ids in the vocabulary, real log-probabilities, neither NaN nor +inf, a
        # beam row's first w ids distinct); returns them as private contiguous uint32 / float64
        # arrays, or None for a plan without beam rows
        cdef StepState *st = &self.step
        cdef uint32_t k = st.num_topk, m = st.m, row = 0
        cdef uint64_t limit = st.vocab - 1 if st.vocab else U32_MAX
        cdef int why
        if k == 0:
            return None
        tids, tlps, err = topk
        if tids is None and err is None:
            raise ValueError(f"this plan has beam rows: pass topk_ids and topk_logprobs of shape "
                             f"({m}, {k})")
        if err is not None:
            raise err
        if (tids.shape != (m, k) or tlps.shape != (m, k) or tids.dtype.kind not in "iu"
                or tlps.dtype.kind not in "fiu"):
            raise ValueError(f"topk_ids / topk_logprobs must be ({m}, {k}) integer / float "
                             f"arrays")
        if tids.size and (int(tids.min()) < 0 or int(tids.max()) > limit):
            raise ValueError(f"a topk token id is outside [0, {limit}]")
        cand = (np.ascontiguousarray(tids, dtype=np.uint32),
                np.ascontiguousarray(tlps, dtype=np.float64))
        why = step_check_topk(st, <const uint32_t *>cnp.PyArray_DATA(<cnp.ndarray>cand[0]),
                              <const double *>cnp.PyArray_DATA(<cnp.ndarray>cand[1]), NULL,
                              &row)
        if why == TOPK_BAD_LOGPROB:
            raise ValueError(f"topk_logprobs row {row} holds NaN or a value above 0 (a "
                             f"log-probability is at most 0)")
        if why == TOPK_UNSORTED:
            raise ValueError(f"topk_logprobs row {row} is not best first (non-increasing)")
        if why:
            raise ValueError(f"topk_ids row {row} repeats a token among its beam's candidates")
        return cand

    cdef list _update_owned(self, object values, tuple topk):
        # update() with the scheduler owned by the caller
        self._load_sampled(values)
        return self._update_loaded(self._load_topk(topk))

    cdef list _update_loaded(self, object cand):
        # the rest of update(), owned, once _load_sampled and _load_topk (its result: cand)
        # have checked the plan's tokens back
        cdef int rc
        cdef const uint32_t *tk_ids = NULL
        cdef const double *tk_lps = NULL
        if cand is not None:
            tk_ids = <const uint32_t *>cnp.PyArray_DATA(<cnp.ndarray>cand[0])
            tk_lps = <const double *>cnp.PyArray_DATA(<cnp.ndarray>cand[1])
        # every sampled member, and every running beam a selection may finish
        self._accum_room(<uint64_t>self.step.n_accum + self.step.m + self.step.n_running)
        rc = step_update(&self.step, self.step.sampled, tk_ids, tk_lps, NULL)
        finished = step_collect(&self.step)
        if rc:
            raise _error(E_STEP, rc)
        return finished

    def update(self, sampled_token_ids, topk_ids=None, topk_logprobs=None):
        """Apply one plan's sampled tokens; returns the finished requests, in plan order.  A plan
        with beam rows (``num_topk > 0``) also takes each row's ``num_topk`` best token ids and
        their log-probabilities (``[m, num_topk]`` arrays, best first)."""
        cdef uint64_t tok
        if not self.gil_free and not self.step.pending:
            # fails early (a read, so not while the loop runs); checked again once owned
            raise StepError.NoPlan(None, "schedule() first")
        values = self._resolve_sampled(sampled_token_ids)
        topk = _resolve_topk(topk_ids, topk_logprobs)
        tok = self._own()
        try:
            return self._update_owned(values, topk)
        finally:
            self._unown(tok)

    cdef int _accum_room(self, uint64_t need) except -1:
        # under ownership: fin_accum (and the plan's finished-id buffer) hold at least `need` ids
        cdef StepState *st = &self.step
        cdef uint64_t *grown
        cdef uint32_t cap = st.accum_cap
        if need <= cap:
            return 0
        while cap < need:
            cap *= 2
        grown = <uint64_t *>PyMem_Realloc(st.fin_accum, cap * sizeof(uint64_t))
        if grown == NULL:
            raise MemoryError()
        st.fin_accum = grown
        st.accum_cap = cap
        if cap > st.finished_cap:
            # the pending plan's ids move along: its views keep the old buffer alive
            grown = <uint64_t *>self._step_bufs.add("finished_request_ids", _DT_PLAN_U64, cap)
            memcpy(grown, st.finished_ids, st.n_finished * sizeof(uint64_t))
            st.finished_ids = grown
            st.finished_cap = cap
        return 0

    def discard_plan(self):
        """Drop the pending plan after its execution failed: the reserved pages stay with their
        requests and the same tokens are scheduled again; the plan's changed rows and finished
        ids are reported again by the next plan.  Requests aborted while it was pending hand
        their pages back now."""
        cdef int rc
        cdef uint64_t tok = self._own()
        try:
            if self.step.pending:
                self._accum_room(<uint64_t>self.step.n_accum + self.step.n_finished)
            rc = step_discard(&self.step)
        finally:
            self._unown(tok)
        if rc:
            raise _error(E_STEP, rc)

    def request_tokens(self, request_id):
        """Prompt plus generated tokens of a queued or running request."""
        cdef uint64_t rid = _u64(request_id, "request_id")
        own_readable(self.gil_free)
        cdef int32_t e = step_find(&self.step, rid)
        if e >= 0 and self.step.req[e].state == SR_GROUP:
            e = self.step.req[e].parent_beam    # a beam group: its beam with the group's id
        if e < 0 or (self.step.req[e].state != SR_WAITING
                     and self.step.req[e].state != SR_RUNNING
                     and self.step.req[e].state != SR_PARKED):
            raise StepError.UnknownRequest(None, f"request {rid}")
        return _array_of(&self.step.arena[<size_t>e * self.step.entry_cap],
                         self.step.req[e].num_tokens)

    def group_members(self, request_id):
        """The member ids of a queued or running ``n`` group, in member order: the parent's
        id, then its children's (what the sampler keys on); for a beam group, its live beams."""
        cdef uint64_t rid = _u64(request_id, "request_id")
        cdef StepState *st = &self.step
        own_readable(self.gil_free)
        cdef int32_t e = step_find(st, rid), c
        cdef uint32_t k = 0, j
        if e < 0 or st.req[e].group != e or st.req[e].state == SR_FINISHED:
            raise StepError.UnknownRequest(None, f"no group {rid}")
        # the ids into C memory first: building the list runs Python code (see _list_of)
        cdef uint64_t *ids = <uint64_t *>PyMem_Malloc(st.max_seqs * sizeof(uint64_t))
        if ids == NULL:
            raise MemoryError()
        try:
            c = st.req[e].next_member if st.req[e].beam else e
            while c >= 0 and k < st.max_seqs:
                ids[k] = st.req[c].rid
                k += 1
                c = st.req[c].next_member
            return [ids[j] for j in range(k)]
        finally:
            PyMem_Free(ids)

    @property
    def forks(self):
        """Children of ``n`` groups forked so far (each shares its parent's pages)."""
        own_readable(self.gil_free)
        return self.step.forks

    @property
    def parked(self):
        """Beams parked so far: computed beams that left the running list with their
        candidates (after a step that scheduled nothing, or preempted) to wait, holding
        nothing, for their group's selection (docs/DESIGN.md, "Progress")."""
        own_readable(self.gil_free)
        return self.step.parked

    @property
    def fork_fallbacks(self):
        """Children of ``n`` groups queued for lack of a free slot or row."""
        own_readable(self.gil_free)
        return self.step.fork_fallbacks

    def step_requests(self):
        """Ids of the queued, running and parked requests, in arrival order."""
        cdef StepState *st = &self.step
        cdef uint32_t e, k = 0, j
        own_readable(self.gil_free)
        # (arrival, id) pairs into C memory first: building the list runs Python code
        cdef size_t size = 2 * <size_t>st.max_queued * sizeof(uint64_t)
        cdef uint64_t *pairs = <uint64_t *>PyMem_Malloc(size)
        if pairs == NULL:
            raise MemoryError()
        try:
            for e in range(st.max_queued):
                if (st.req[e].state == SR_WAITING or st.req[e].state == SR_RUNNING
                        or st.req[e].state == SR_PARKED):
                    pairs[2 * k] = st.req[e].arrival
                    pairs[2 * k + 1] = st.req[e].rid
                    k += 1
            found = sorted([(pairs[2 * j], pairs[2 * j + 1]) for j in range(k)])
        finally:
            PyMem_Free(pairs)
        return [rid for _, rid in found]

    cdef int _raise_run_failure(self, int rc, int32_t status) except -1:
        # the C loop's failed step (discarded by step_run) as its exception
        if rc == RUN_BACKEND_FAILED:
            raise RaggedBackendError.Failed(status)
        if rc == RUN_UNWRITTEN:
            raise ValueError(f"the step backend returned 0 without writing sampled row {status} "
                             f"(or wrote 4294967295, which is no token id); the step was "
                             f"discarded")
        if rc == RUN_BAD_TOKEN:
            raise ValueError(f"the step backend sampled token id "
                             f"{self.step.sampled[status]} (row {status}), outside "
                             f"[0, {self.step.vocab - 1}]")
        if rc == RUN_BAD_TOPK:
            raise ValueError(f"the step backend wrote a candidate token id outside "
                             f"[0, {self.step.vocab - 1}] (row {status})")
        if rc == RUN_BAD_TOPK_LOGPROB:
            raise ValueError(f"the step backend wrote a candidate log-probability that "
                             f"is NaN or above 0 (a log-probability is at most 0), or left it "
                             f"unwritten (row {status})")
        if rc == RUN_REPEATED_TOPK:
            raise ValueError(f"the step backend repeated a token among a beam's "
                             f"candidates (row {status})")
        if rc == RUN_UNSORTED_TOPK:
            raise ValueError(f"the step backend wrote a beam row's candidates out of "
                             f"order: not best first (row {status})")
        if rc == RUN_NO_TOPK:
            raise TypeError("the plan has beam rows (num_topk > 0) and the C step "
                            "backend does not declare QUALIA_STEP_WRITES_TOPK; the "
                            "step was discarded")
        raise _error(E_STEP, rc)

    def run(self, backend, max_steps=None, *, stats_rows=RUN_STATS_ROWS):
        """schedule -> execute -> update until no request is left or ``max_steps`` steps ran.
        Returns ``RunResult(stats, finished, steps, totals)``: the STEP_STATS rows of the last
        ``min(steps, stats_rows)`` steps, oldest first (a ring sized when the call starts, so
        the call's memory does not grow with its length), the finished requests in the order
        they finished, the number of steps, and each STEP_TOTALS field summed over all of them.

        The scheduler is owned for the whole call: a backend (or a GC callback, or another
        thread) calling a mutating method meanwhile gets BusyError; reads work (the state
        stands still while Python runs).  A C step backend (``__qualia_step_backend__``) runs
        stretches of steps in C without the GIL; while a stretch runs, every other call on the
        scheduler and its raw objects raises BusyError, reads included, except
        drain_events().  Every few milliseconds (5 ms) the stretch ends between two steps, the
        finished requests are collected and pending signals are serviced with the GIL: a signal
        handler that raises (KeyboardInterrupt) stops the call there.  A Python backend's
        ``execute_step(plan)`` is called with the GIL, between schedule and update.  If a
        backend fails, or a signal handler raises, the step being run is discarded (nothing of
        it applied) and the error propagates with the requests the earlier steps of this call
        finished as its ``finished`` attribute (they are no longer queued)."""
        cdef object limit = None if max_steps is None else _u32(max_steps, "max_steps")
        cdef uint32_t ring_rows = _u32(stats_rows, "stats_rows")
        cdef qualia_step_backend *cb = NULL
        cdef StepStat row
        cdef StepStat *ring
        cdef uint32_t head = 0
        cdef uint64_t steps = 0, total = 0, want
        cdef uint64_t totals[STAT_TOTALS]
        cdef int32_t status = 0
        cdef int rc = Q_OK
        cdef uint64_t tok
        handle = _resolve_step_backend(backend, &cb)   # RESOLVE: may run user code
        if limit is not None and <uint32_t>limit < ring_rows:
            ring_rows = <uint32_t>limit
        stats = np.empty(ring_rows, dtype=STEP_STATS)
        ring = <StepStat *>cnp.PyArray_DATA(<cnp.ndarray>stats)
        memset(totals, 0, sizeof(totals))
        finished = []
        tok = self._own()
        try:
            if cb == NULL:
                while self.step.count and (limit is None or total < limit):
                    rc = step_schedule(&self.step)
                    if rc:
                        raise _error(E_STEP, rc)
                    plan = step_plan(&self.step, self._step_bufs)
                    try:
                        # the backend and the conversion of its ids run while the scheduler
                        # is owned: a call back into it gets BusyError
                        out = handle(plan)
                        if isinstance(out, tuple):
                            if len(<tuple>out) != 3:
                                raise ValueError("execute_step returns the sampled ids, or "
                                                 "(sampled, topk_ids, topk_logprobs)")
                            ids, tk, tl = out
                        else:
                            ids, tk, tl = out, None, None
                        values = self._resolve_sampled(ids)
                        topk = _resolve_topk(tk, tl)
                        self._load_sampled(values)
                        cand = self._load_topk(topk)
                    except BaseException:
                        step_discard(&self.step)
                        raise
                    done = self._update_loaded(cand)
                    finished.extend(done)
                    step_stat(&self.step, &row, <uint32_t>len(done))
                    stats_note(&row, ring, ring_rows, &head, totals)
                    total += 1
            else:
                if self.step.beam_head >= 0:
                    if not (cb.flags & QUALIA_STEP_WRITES_TOPK):
                        # refused before any step: nothing is scheduled, admitted or discarded
                        raise TypeError("a beam group is queued or running and the C step "
                                        "backend does not declare QUALIA_STEP_WRITES_TOPK (its "
                                        "plans need candidates); nothing was run")
                    self._topk_buffers()
                while self.step.count and (limit is None or total < limit):
                    want = U64_MAX if limit is None else <uint64_t>limit - total
                    self._gil_free(1)
                    with nogil:
                        rc = step_run(&self.step, cb, want, _coarse_now_ns() + RUN_SLICE_NS, ring,
                                      ring_rows, &head, totals, &steps, &status)
                    self._gil_free(0)
                    finished.extend(step_collect(&self.step))
                    total += steps
                    if rc:
                        self._raise_run_failure(rc, status)
                    # between two steps, nothing pending: a signal handler that raises stops
                    # the call here (the steps so far stay applied)
                    PyErr_CheckSignals()
            if total > ring_rows:
                # the ring wrapped: its oldest row is at head
                stats = np.concatenate((stats[head:], stats[:head]))
            elif total < ring_rows:
                stats = stats[:total].copy()
            return RunResult(stats, finished, total,
                             {name: totals[k] for k, name in enumerate(STEP_TOTALS)})
        except BaseException as err:
            # the requests earlier steps of this call finished are freed: report them
            _attach_finished(err, finished)
            raise
        finally:
            self._unown(tok)
