# The seed's request scheduler.  Request lookup goes through an open-addressing index keyed by
# request id (the seed scans; results are identical because ids of active requests are unique).

cdef struct Slot:
    uint64_t request_id
    uint32_t token_count
    uint32_t prefix_tokens
    uint32_t next_token_id
    uint8_t state
    uint8_t token_ready
    Table blocks

cdef struct Sched:
    Slot *slots
    uint32_t *table_storage
    int32_t *index
    uint32_t index_mask
    uint64_t *free_bits
    uint64_t *decode_bits
    uint32_t n_decode
    uint32_t n_words
    uint32_t max_requests
    uint32_t logical_pages
    uint32_t active
    uint32_t *lowered


cdef inline int32_t sched_find(Sched *s, uint64_t rid) noexcept nogil:
    return id_find(s.index, s.index_mask, s.slots, sizeof(Slot), rid)


cdef uint32_t _sched_home_of(void *ctx, int32_t slot) noexcept nogil:
    cdef Sched *s = <Sched *>ctx
    return id_home(s.slots[slot].request_id, s.index_mask)


cdef inline void sched_index_insert(Sched *s, int32_t slot) noexcept nogil:
    oa_insert(s.index, s.index_mask, _sched_home_of(s, slot), slot)


cdef inline void sched_index_remove(Sched *s, int32_t slot) noexcept nogil:
    oa_remove(s.index, s.index_mask, _sched_home_of(s, slot), slot, _sched_home_of, s)


cdef inline int32_t sched_lowest_free(Sched *s) noexcept nogil:
    cdef uint32_t w
    cdef uint64_t bits
    for w in range(s.n_words):
        bits = s.free_bits[w]
        if bits:
            return <int32_t>(w * 64 + __builtin_ctzll(bits))
    return -1


cdef inline uint32_t sat_add1(uint32_t x) noexcept nogil:
    return x + 1 if x != U32_MAX else x


cdef struct Admission_c:
    uint16_t slot
    uint32_t prefix_tokens


cdef int sched_admit(Sched *s, uint64_t rid, bint has_identity, uint64_t hi, uint64_t lo,
                     Store *st, Pool *p, Admission_c *out) noexcept nogil:
    cdef int32_t index
    cdef uint32_t prefix_tokens = 0
    cdef int rc
    cdef Slot *slot
    if sched_find(s, rid) >= 0:
        return Q_DUPLICATE_REQUEST
    index = sched_lowest_free(s)
    if index < 0:
        return Q_FULL
    if has_identity:
        rc = store_attach(st, hi, lo, &s.slots[index].blocks, p, &prefix_tokens)
        if rc:
            return rc
    slot = &s.slots[index]
    slot.request_id = rid
    slot.state = QUALIA_STATE_PREFILL
    if prefix_tokens != 0:
        slot_set_decode(s, index)
    slot.token_count = prefix_tokens
    slot.prefix_tokens = prefix_tokens
    sched_index_insert(s, index)
    s.free_bits[index >> 6] &= ~((<uint64_t>1) << (index & 63))
    s.active += 1
    out.slot = <uint16_t>index
    out.prefix_tokens = prefix_tokens
    return Q_OK


cdef inline void slot_set_decode(Sched *s, uint32_t index) noexcept nogil:
    # every decoding slot has its bit set, so a round visits decoding slots only
    if s.slots[index].state != QUALIA_STATE_DECODE:
        s.slots[index].state = QUALIA_STATE_DECODE
        s.decode_bits[index >> 6] |= (<uint64_t>1) << (index & 63)
        s.n_decode += 1


cdef void slot_clear(Sched *s, int32_t index) noexcept nogil:
    cdef Slot *slot = &s.slots[index]
    sched_index_remove(s, index)
    if slot.state == QUALIA_STATE_DECODE:
        s.decode_bits[index >> 6] &= ~((<uint64_t>1) << (index & 63))
        s.n_decode -= 1
    slot.request_id = 0
    slot.state = QUALIA_STATE_EMPTY
    slot.token_count = 0
    slot.prefix_tokens = 0
    slot.next_token_id = 0
    slot.token_ready = 0
    s.free_bits[index >> 6] |= (<uint64_t>1) << (index & 63)
    s.active -= 1


cdef int sched_finish(Sched *s, int32_t index, Pool *p) noexcept nogil:
    # the seed: `slot.blocks.release_all(pool)?; slot.clear();` -- on a pool error the table is
    # already empty but the request stays active
    cdef int rc = table_release_all(&s.slots[index].blocks, p)
    if rc:
        return rc
    slot_clear(s, index)
    return Q_OK


# -- the decode round, in C: sizes, lowering, verification, commit ---------------------------

cdef inline int round_sizes(Sched *s, Py_ssize_t items_cap, Py_ssize_t table_cap,
                            Py_ssize_t outs_cap) noexcept nogil:
    # the seed's buffer checks, in the seed's order, against the decode count read now
    cdef uint32_t w
    cdef uint64_t bits
    cdef size_t need = 0
    for w in range(s.n_words):
        bits = s.decode_bits[w]
        while bits:
            need += s.slots[w * 64 + __builtin_ctzll(bits)].blocks.len
            bits &= bits - 1
    if items_cap < <Py_ssize_t>s.n_decode:
        return Q_ITEM_BUFFER_TOO_SMALL
    if outs_cap < <Py_ssize_t>s.n_decode:
        return Q_OUTPUT_BUFFER_TOO_SMALL
    if <size_t>table_cap < need:
        return Q_TABLE_BUFFER_TOO_SMALL
    if need > U32_MAX:
        return Q_ROUND_TOO_LARGE
    return Q_OK


cdef inline int round_lower(Sched *s, qualia_batch_item *items, uint32_t *table,
                            uint32_t *n_out, uint32_t *off_out) noexcept nogil:
    # Write every decoding request (slot order) into items and its pages into table, and
    # remember the batch's identities in s.lowered: outputs are checked against those, never
    # against the scratch a backend saw.  The caller checked the sizes (round_sizes) with no
    # Python code run since.
    cdef uint32_t i, w, n = 0
    cdef uint64_t bits
    cdef size_t off = 0
    cdef Slot *sl
    for w in range(s.n_words):
        bits = s.decode_bits[w]
        while bits:
            i = w * 64 + __builtin_ctzll(bits)
            bits &= bits - 1
            sl = &s.slots[i]
            if not sl.token_ready:
                return Q_MISSING_INPUT_TOKEN
            if sl.blocks.len:
                memcpy(&table[off], sl.blocks.entries, sl.blocks.len * sizeof(uint32_t))
            items[n].request_id = sl.request_id
            items[n].slot = i
            items[n].token_id = sl.next_token_id
            items[n].position = sl.token_count
            items[n].block_table_offset = <uint32_t>off
            items[n].logical_pages = sl.blocks.len
            items[n]._reserved = 0
            s.lowered[n] = i
            n += 1
            off += sl.blocks.len
    n_out[0] = n
    off_out[0] = <uint32_t>off
    return Q_OK


cdef inline int round_verify(Sched *s, const qualia_batch_output *outs, uint32_t n,
                             const qualia_batch_receipt *rec) noexcept nogil:
    cdef uint32_t i, j
    if rec.batch_size != n:
        return Q_OUTPUT_IDENTITY_MISMATCH
    if rec.backend_launches != 1:
        return Q_BACKEND_LAUNCH_COUNT
    for j in range(n):
        i = s.lowered[j]
        if outs[j].request_id != s.slots[i].request_id or outs[j].slot != i:
            return Q_OUTPUT_IDENTITY_MISMATCH
    return Q_OK


cdef inline void round_commit(Sched *s, const qualia_batch_output *outs,
                              uint32_t n) noexcept nogil:
    cdef uint32_t j
    cdef Slot *sl
    for j in range(n):
        sl = &s.slots[s.lowered[j]]
        sl.next_token_id = outs[j].next_token_id
        sl.token_count = sat_add1(sl.token_count)
        sl.token_ready = 1


cdef int sched_views(Sched *s, qualia_request_view *out, Py_ssize_t cap,
                     Py_ssize_t *written) noexcept nogil:
    cdef uint32_t i
    cdef Py_ssize_t k = 0
    cdef Slot *sl
    if cap < <Py_ssize_t>s.active:
        return Q_OUTPUT_TOO_SMALL
    for i in range(s.max_requests):
        sl = &s.slots[i]
        if sl.state == QUALIA_STATE_EMPTY:
            continue
        memset(&out[k], 0, sizeof(qualia_request_view))
        out[k].request_id = sl.request_id
        out[k].slot = <uint16_t>i
        out[k].state = sl.state
        out[k].token_count = sl.token_count
        out[k].prefix_tokens = sl.prefix_tokens
        k += 1
    written[0] = k
    return Q_OK


cdef object _views_array(Sched *s):
    # runnable(): snapshot the views into C memory, then build the array (see _list_of)
    cdef Py_ssize_t written = 0
    cdef qualia_request_view *tmp = <qualia_request_view *>PyMem_Malloc(
        (s.active if s.active else 1) * sizeof(qualia_request_view))
    if tmp == NULL:
        raise MemoryError()
    try:
        sched_views(s, tmp, s.active, &written)
        arr = np.empty(written, dtype=REQUEST_VIEW)
        if written:
            memcpy(<void *>cnp.PyArray_DATA(<cnp.ndarray>arr), tmp,
                   written * sizeof(qualia_request_view))
        return arr
    finally:
        PyMem_Free(tmp)


cdef int32_t _slot_of(Sched *s, uint64_t rid) except -2:
    cdef int32_t index = sched_find(s, rid)
    if index < 0:
        raise SchedulerError.UnknownRequest()
    return index


cdef int sched_init(Sched *s, uint32_t mr, uint32_t lp) except -1:
    # mr slots (1 .. 65536) of lp logical pages each, all free
    cdef uint32_t i, size = 2
    while size < 2 * mr:
        size <<= 1
    memset(s, 0, sizeof(Sched))
    s.slots = <Slot *>PyMem_Calloc(mr, sizeof(Slot))
    s.table_storage = <uint32_t *>PyMem_Malloc((<size_t>mr * lp if lp else 1) * sizeof(uint32_t))
    s.index = <int32_t *>PyMem_Malloc(size * sizeof(int32_t))
    s.n_words = (mr + 63) // 64
    s.free_bits = <uint64_t *>PyMem_Calloc(s.n_words, sizeof(uint64_t))
    s.decode_bits = <uint64_t *>PyMem_Calloc(s.n_words, sizeof(uint64_t))
    s.lowered = <uint32_t *>PyMem_Malloc(mr * sizeof(uint32_t))
    if (s.slots == NULL or s.table_storage == NULL or s.index == NULL or s.free_bits == NULL
            or s.decode_bits == NULL or s.lowered == NULL):
        raise MemoryError(f"cannot allocate a scheduler of {mr} x {lp} pages")
    for i in range(size):
        s.index[i] = -1
    s.index_mask = size - 1
    for i in range(mr):
        s.slots[i].blocks.entries = &s.table_storage[<size_t>i * lp]
        s.slots[i].blocks.capacity = lp
        s.free_bits[i >> 6] |= (<uint64_t>1) << (i & 63)
    s.max_requests = mr
    s.logical_pages = lp
    return 0


cdef void sched_free(Sched *s) noexcept:
    PyMem_Free(s.slots)
    PyMem_Free(s.table_storage)
    PyMem_Free(s.index)
    PyMem_Free(s.free_bits)
    PyMem_Free(s.decode_bits)
    PyMem_Free(s.lowered)
    memset(s, 0, sizeof(Sched))


cdef class RequestScheduler:
    """The seed's fixed-capacity request scheduler: ``admit_with_prefix``, ``ensure_writable``,
    ``mark_prefill_complete``, ``seed_decode_token``, ``record_token``, ``runnable_into``,
    ``execute_decode_round``, ``fork``, ``finish`` (docs/DESIGN.md, "Request scheduler").

    Mutating methods take ownership of the scheduler (and of the pool and store they are given):
    a call made while another call owns one of them -- from a decode round's backend, a GC
    callback, or another thread -- raises ``BusyError`` and changes nothing."""
    cdef Sched s
    cdef uint64_t owner
    cdef list _receipts

    def __cinit__(self, max_requests, logical_pages):
        cdef uint32_t mr = _u32(max_requests, "max_requests")
        cdef uint32_t lp = _u32(logical_pages, "logical_pages")
        if mr == 0:
            raise ValueError("max_requests must be at least 1")
        if mr > 65536:
            raise OverflowError("max_requests must be at most 65536 (slots are u16)")
        sched_init(&self.s, mr, lp)
        self._receipts = [None] * (mr + 1)

    def __dealloc__(self):
        sched_free(&self.s)

    @property
    def max_requests(self):
        """Request slots, fixed at construction."""
        return self.s.max_requests

    @property
    def logical_pages(self):
        """Capacity of each slot's block table, in pages."""
        return self.s.logical_pages

    def active_count(self):
        """Requests admitted and not finished."""
        return self.s.active

    cdef int32_t _find(self, object request_id) except -2:
        # read-only lookups; mutating methods look up under ownership (arguments first, then
        # ownership, then the lookup, so a call made mid-round gets BusyError whatever id it
        # passes)
        cdef uint64_t rid = _u64(request_id, "request_id")
        return _slot_of(&self.s, rid)

    def admit_with_prefix(self, request_id, identity, PrefixKvStore prefixes not None,
                          BlockPool pool not None):
        """Admit a request, attaching the prefix's pages on a hit (seed ``admit_with_prefix``)."""
        cdef uint64_t rid = _u64(request_id, "request_id")
        cdef Admission_c adm
        cdef uint64_t hi = 0, lo = 0
        cdef int rc
        if identity is not None:
            if not isinstance(identity, PrefixIdentity):
                raise TypeError(f"identity must be a PrefixIdentity or None, "
                                f"not {type(identity).__name__}")
            hi = (<PrefixIdentity>identity).hi
            lo = (<PrefixIdentity>identity).lo
        cdef uint64_t tok = own_acquire(&self.owner, &prefixes.owner, &pool.owner, NULL)
        try:
            rc = sched_admit(&self.s, rid, identity is not None, hi, lo, &prefixes.store,
                             &pool.pool, &adm)
        finally:
            own_release(tok, &self.owner, &prefixes.owner, &pool.owner, NULL)
        if rc:
            raise _error(E_ADMIT, rc)
        return Admission(adm.slot, adm.prefix_tokens != 0, adm.prefix_tokens)

    def ensure_writable(self, request_id, logical_page, BlockPool pool not None):
        """The request's table's ``ensure_writable``: a :class:`CopyOnWrite`; table errors become
        ``SchedulerError.Table(...)``."""
        cdef uint64_t rid = _u64(request_id, "request_id")
        cdef uint32_t lp = _u32(logical_page, "logical_page")
        cdef Cow c
        cdef int rc
        cdef uint64_t tok = own_acquire(&self.owner, &pool.owner, NULL, NULL)
        try:
            rc = table_ensure_writable(&self.s.slots[_slot_of(&self.s, rid)].blocks, lp,
                                       &pool.pool, &c)
        finally:
            own_release(tok, &self.owner, &pool.owner, NULL, NULL)
        if rc:
            raise _error(E_SCHED, rc)
        return _cow(&c)

    def mark_prefill_complete(self, request_id):
        """Move the request to DECODE (in any active state)."""
        cdef uint64_t rid = _u64(request_id, "request_id")
        cdef uint64_t tok = own_acquire(&self.owner, NULL, NULL, NULL)
        try:
            slot_set_decode(&self.s, _slot_of(&self.s, rid))
        finally:
            own_release(tok, &self.owner, NULL, NULL, NULL)

    def seed_decode_token(self, request_id, token_id):
        """Set the input token of the request's next decode step (in any active state)."""
        cdef uint64_t rid = _u64(request_id, "request_id")
        cdef uint32_t t = _u32(token_id, "token_id")
        cdef Slot *sl
        cdef uint64_t tok = own_acquire(&self.owner, NULL, NULL, NULL)
        try:
            sl = &self.s.slots[_slot_of(&self.s, rid)]
            sl.next_token_id = t
            sl.token_ready = 1
        finally:
            own_release(tok, &self.owner, NULL, NULL, NULL)

    def record_token(self, request_id):
        """One more token with K/V (saturating at 2**32-1); returns the new token count."""
        cdef uint64_t rid = _u64(request_id, "request_id")
        cdef uint32_t count
        cdef Slot *sl
        cdef uint64_t tok = own_acquire(&self.owner, NULL, NULL, NULL)
        try:
            sl = &self.s.slots[_slot_of(&self.s, rid)]
            sl.token_count = sat_add1(sl.token_count)
            count = sl.token_count
        finally:
            own_release(tok, &self.owner, NULL, NULL, NULL)
        return count

    def finish(self, request_id, BlockPool pool not None):
        """Release the request's pages and free its slot (completion and cancellation alike)."""
        cdef uint64_t rid = _u64(request_id, "request_id")
        cdef int rc
        cdef uint64_t tok = own_acquire(&self.owner, &pool.owner, NULL, NULL)
        try:
            rc = sched_finish(&self.s, _slot_of(&self.s, rid), &pool.pool)
        finally:
            own_release(tok, &self.owner, &pool.owner, NULL, NULL)
        if rc:
            raise _error(E_SCHED, rc)

    def fork(self, parent_id, child_id, BlockPool pool not None):
        """Start request ``child_id`` as a copy-on-write fork of the decoding request
        ``parent_id``: it shares every page (retained in ``pool``) and copies the token state
        (docs/DESIGN.md, "Forks").  Returns the child's slot."""
        cdef uint64_t prid = _u64(parent_id, "parent_id")
        cdef uint64_t crid = _u64(child_id, "child_id")
        cdef int32_t child = -1
        cdef int rc
        cdef uint64_t tok = own_acquire(&self.owner, &pool.owner, NULL, NULL)
        try:
            rc = sched_fork(&self.s, &pool.pool, _slot_of(&self.s, prid), crid, &child)
        finally:
            own_release(tok, &self.owner, &pool.owner, NULL, NULL)
        if rc:
            raise _error(E_SCHED, rc)
        return child

    def block_table(self, request_id):
        """The request's mapped pages, in logical order (a list)."""
        cdef int32_t index = self._find(request_id)
        return _list_of(self.s.slots[index].blocks.entries, self.s.slots[index].blocks.len)

    def pending_token(self, request_id):
        """The input token of the request's next decode step, or None if none was seeded."""
        cdef int32_t index = self._find(request_id)
        if not self.s.slots[index].token_ready:
            return None
        return self.s.slots[index].next_token_id

    def request_view(self, request_id):
        """``(request_id, slot, state, token_count, prefix_tokens)`` of the request, the fields of a
        ``REQUEST_VIEW`` record."""
        cdef int32_t index = self._find(request_id)
        # C values first: building the tuple runs Python code
        cdef Slot sl = self.s.slots[index]
        return (sl.request_id, index, RequestState(sl.state), sl.token_count, sl.prefix_tokens)

    def runnable_into(self, out):
        """Write every active request's view into ``out`` in slot order; return the count."""
        cdef Py_ssize_t written = 0
        cdef _Buffer b = _acquire(out, "out", "request_view", sizeof(qualia_request_view),
                                  QUALIA_ALIGN_VIEW, True)
        cdef int rc = sched_views(&self.s, <qualia_request_view *>b.ptr, b.length, &written)
        if rc:
            raise _error(E_SCHED, rc)
        return written

    def runnable(self):
        """Every active request's view, as a fresh REQUEST_VIEW array."""
        return _views_array(&self.s)

    def execute_decode_round(self, backend, item_scratch, block_table_scratch, output_scratch):
        """Lower every decoding request into the scratch buffers and call the backend once.

        A Python backend gets ``items`` and ``block_table`` as read-only views of the scratch and
        ``outputs`` as a writable view of ``output_scratch``; they are valid during the call
        (after it they alias the caller's scratch, which the next round overwrites)."""
        cdef Py_buffer bi, bt, bo
        cdef int held = 0
        cdef void *pi = NULL
        cdef void *pt = NULL
        cdef void *po = NULL
        cdef Py_ssize_t ni = 0, nt = 0, no = 0
        cdef qualia_backend *cb = NULL
        cdef qualia_backend store
        cdef uint64_t tok
        cdef _Region ri, rt, ro
        # RESOLVE: the backend first (a wrong one fails every round, empty or not), then the
        # buffers; both can run user code
        handle = _resolve_backend(backend, &cb, &store)
        if cb == NULL:
            # a Python backend: each buffer is acquired and checked once, into a region that
            # keeps it alive and backs the views the backend gets
            ri = _region_acquire(item_scratch, "item_scratch", "item", _DT_ITEM,
                                 sizeof(qualia_batch_item), QUALIA_ALIGN_ITEM, False)
            rt = _region_acquire(block_table_scratch, "block_table_scratch", "u32", _DT_U32,
                                 sizeof(uint32_t), sizeof(uint32_t), False)
            ro = _region_acquire(output_scratch, "output_scratch", "output", _DT_OUTPUT,
                                 sizeof(qualia_batch_output), QUALIA_ALIGN_OUTPUT, True)
            tok = own_acquire(&self.owner, NULL, NULL, NULL)
            try:
                return self._round(NULL, handle,
                                   <qualia_batch_item *>ri.ptr, ri.nitems, ri,
                                   <uint32_t *>rt.ptr, rt.nitems, rt,
                                   <qualia_batch_output *>ro.ptr, ro.nitems, ro)
            finally:
                own_release(tok, &self.owner, NULL, NULL, NULL)
        # a C backend: the steady-state path creates no Python object
        try:
            if not _fast_array(item_scratch, _DT_ITEM, QUALIA_ALIGN_ITEM, True, &pi, &ni):
                _get_buffer(item_scratch, &bi, "item_scratch", "item", sizeof(qualia_batch_item),
                            QUALIA_ALIGN_ITEM, True)
                held |= 1
                pi = bi.buf
                ni = bi.shape[0]
            if not _fast_array(block_table_scratch, _DT_U32, sizeof(uint32_t), True, &pt, &nt):
                _get_buffer(block_table_scratch, &bt, "block_table_scratch", "u32",
                            sizeof(uint32_t), sizeof(uint32_t), True)
                held |= 2
                pt = bt.buf
                nt = bt.shape[0]
            if not _fast_array(output_scratch, _DT_OUTPUT, QUALIA_ALIGN_OUTPUT, True, &po, &no):
                _get_buffer(output_scratch, &bo, "output_scratch", "output",
                            sizeof(qualia_batch_output), QUALIA_ALIGN_OUTPUT, True)
                held |= 4
                po = bo.buf
                no = bo.shape[0]
            # ACQUIRE, then everything else reads the state as it is now
            tok = own_acquire(&self.owner, NULL, NULL, NULL)
            try:
                return self._round_c(cb, <qualia_batch_item *>pi, ni, <uint32_t *>pt, nt,
                                     <qualia_batch_output *>po, no)
            finally:
                own_release(tok, &self.owner, NULL, NULL, NULL)
        finally:
            if held & 4:
                PyBuffer_Release(&bo)
            if held & 2:
                PyBuffer_Release(&bt)
            if held & 1:
                PyBuffer_Release(&bi)

    cdef object _round_c(self, qualia_backend *cb, qualia_batch_item *items, Py_ssize_t items_cap,
                         uint32_t *table, Py_ssize_t table_cap, qualia_batch_output *outs,
                         Py_ssize_t outs_cap):
        # One ragged decode round with a C backend, the seed's checks in the seed's order; the
        # caller owns the scheduler.  Nothing is committed before the outputs are verified.
        cdef uint32_t n = 0, off = 0
        cdef int32_t status = 0
        cdef qualia_batch_receipt rec
        cdef int rc = round_sizes(&self.s, items_cap, table_cap, outs_cap)
        if rc == Q_OK:
            rc = round_lower(&self.s, items, table, &n, &off)
        if rc:
            raise _error(E_ROUND, rc)
        if n == 0:
            return _ZERO_RECEIPT
        rec.batch_size = 0
        rec.backend_launches = 0
        with nogil:  # the round owns the scheduler; the core touches nothing meanwhile
            status = cb.execute_ragged(cb.ctx, items, n, table, off, outs, &rec)
        if status != 0:
            raise DecodeRoundError.Backend(RaggedBackendError.Failed(status))
        rc = round_verify(&self.s, outs, n, &rec)
        if rc:
            raise _error(E_ROUND, rc)
        receipt = _receipt(self._receipts, n)
        round_commit(&self.s, outs, n)
        return receipt

    cdef object _round(self, qualia_backend *cb, object fn,
                       qualia_batch_item *items, Py_ssize_t items_cap, _Region items_r,
                       uint32_t *table, Py_ssize_t table_cap, _Region table_r,
                       qualia_batch_output *outs, Py_ssize_t outs_cap, _Region outs_r):
        # The same round with a Python backend, which gets views of the regions.
        cdef uint32_t n = 0, off = 0
        cdef qualia_batch_receipt rec
        cdef int rc = round_sizes(&self.s, items_cap, table_cap, outs_cap)
        if rc == Q_OK:
            rc = round_lower(&self.s, items, table, &n, &off)
        if rc:
            raise _error(E_ROUND, rc)
        if n == 0:
            return _ZERO_RECEIPT
        _run_backend(NULL, fn, items, n, table, off, outs,
                     _np_view(items_r, _DT_ITEM, n, False),
                     _np_view(table_r, _DT_U32, off, False),
                     _np_view(outs_r, _DT_OUTPUT, n, True), &rec)
        rc = round_verify(&self.s, outs, n, &rec)
        if rc:
            raise _error(E_ROUND, rc)
        receipt = _receipt(self._receipts, n)
        round_commit(&self.s, outs, n)
        return receipt

    def __repr__(self):
        return (f"RequestScheduler(max_requests={self.s.max_requests}, "
                f"logical_pages={self.s.logical_pages}, active={self.s.active})")
