# The seed's request scheduler.  Request lookup goes through an open-addressing index keyed by
# request id (the seed scans; results are identical because ids of active requests are unique).

cdef inline uint32_t _rid_home(Sched *s, uint64_t rid) noexcept nogil:
    cdef uint64_t h = rid * <uint64_t>0x9E3779B97F4A7C15
    return <uint32_t>((h >> 32) & s.index_mask)


cdef int32_t sched_find(Sched *s, uint64_t rid) noexcept nogil:
    cdef uint32_t i = _rid_home(s, rid)
    cdef int32_t e
    while True:
        e = s.index[i]
        if e < 0:
            return -1
        if s.slots[e].request_id == rid:
            return e
        i = (i + 1) & s.index_mask


cdef uint32_t _sched_home_of(void *ctx, int32_t slot) noexcept nogil:
    cdef Sched *s = <Sched *>ctx
    return _rid_home(s, s.slots[slot].request_id)


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


cdef class RequestScheduler:
    """The seed's fixed-capacity request scheduler (``RequestScheduler<REQUESTS>``)."""
    cdef Sched s
    cdef int busy
    cdef list _receipts

    def __cinit__(self, max_requests, logical_pages):
        cdef uint32_t mr = _u32(max_requests, "max_requests")
        cdef uint32_t lp = _u32(logical_pages, "logical_pages")
        cdef uint32_t i, size = 2
        if mr == 0:
            raise ValueError("max_requests must be at least 1")
        if mr > 65536:
            raise OverflowError("max_requests must be at most 65536 (slots are u16)")
        while size < 2 * mr:
            size <<= 1
        self.s.slots = <Slot *>PyMem_Calloc(mr, sizeof(Slot))
        self.s.table_storage = <uint32_t *>PyMem_Malloc(
            (<size_t>mr * lp if lp else 1) * sizeof(uint32_t))
        self.s.index = <int32_t *>PyMem_Malloc(size * sizeof(int32_t))
        self.s.n_words = (mr + 63) // 64
        self.s.free_bits = <uint64_t *>PyMem_Calloc(self.s.n_words, sizeof(uint64_t))
        self.s.decode_bits = <uint64_t *>PyMem_Calloc(self.s.n_words, sizeof(uint64_t))
        self.s.lowered = <uint32_t *>PyMem_Malloc(mr * sizeof(uint32_t))
        if (self.s.slots == NULL or self.s.table_storage == NULL or self.s.index == NULL
                or self.s.free_bits == NULL or self.s.decode_bits == NULL
                or self.s.lowered == NULL):
            raise MemoryError(f"cannot allocate a scheduler of {mr} x {lp} pages")
        for i in range(size):
            self.s.index[i] = -1
        self.s.index_mask = size - 1
        for i in range(mr):
            self.s.slots[i].blocks.entries = &self.s.table_storage[<size_t>i * lp]
            self.s.slots[i].blocks.capacity = lp
            self.s.free_bits[i >> 6] |= (<uint64_t>1) << (i & 63)
        self.s.max_requests = mr
        self.s.logical_pages = lp
        self._receipts = [None] * (mr + 1)

    def __dealloc__(self):
        PyMem_Free(self.s.slots)
        PyMem_Free(self.s.table_storage)
        PyMem_Free(self.s.index)
        PyMem_Free(self.s.free_bits)
        PyMem_Free(self.s.decode_bits)
        PyMem_Free(self.s.lowered)

    @property
    def max_requests(self):
        return self.s.max_requests

    @property
    def logical_pages(self):
        return self.s.logical_pages

    def active_count(self):
        return self.s.active

    cdef int32_t _find(self, object request_id) except -2:
        cdef uint64_t rid = _u64(request_id, "request_id")
        cdef int32_t index = sched_find(&self.s, rid)
        if index < 0:
            raise SchedulerError.UnknownRequest()
        return index

    cdef int32_t _find_idle(self, object request_id) except -2:
        # mutating methods: arguments first, then Busy, then the lookup, so a backend calling
        # back mid-round gets BusyError whatever id it passes
        cdef uint64_t rid = _u64(request_id, "request_id")
        _check_busy(self.busy, "scheduler")
        cdef int32_t index = sched_find(&self.s, rid)
        if index < 0:
            raise SchedulerError.UnknownRequest()
        return index

    def admit_with_prefix(self, request_id, identity, PrefixKvStore prefixes not None,
                          BlockPool pool not None):
        """Admit a request, attaching the prefix's pages on a hit (seed ``admit_with_prefix``)."""
        cdef uint64_t rid = _u64(request_id, "request_id")
        cdef Admission_c adm
        cdef uint64_t hi = 0, lo = 0
        if identity is not None:
            if not isinstance(identity, PrefixIdentity):
                raise TypeError(f"identity must be a PrefixIdentity or None, "
                                f"not {type(identity).__name__}")
            hi = (<PrefixIdentity>identity).hi
            lo = (<PrefixIdentity>identity).lo
        _check_busy(self.busy, "scheduler")
        _check_busy(prefixes.busy, "prefix store")
        _check_busy(pool.busy, "pool")
        cdef int rc = sched_admit(&self.s, rid, identity is not None, hi, lo, &prefixes.store,
                                  &pool.pool, &adm)
        if rc:
            raise _error(E_ADMIT, rc)
        return Admission(adm.slot, adm.prefix_tokens != 0, adm.prefix_tokens)

    def ensure_writable(self, request_id, logical_page, BlockPool pool not None):
        cdef uint32_t lp = _u32(logical_page, "logical_page")
        cdef int32_t index = self._find_idle(request_id)
        cdef Cow c
        _check_busy(pool.busy, "pool")
        cdef int rc = table_ensure_writable(&self.s.slots[index].blocks, lp, &pool.pool, &c)
        if rc:
            raise _error(E_SCHED, rc)
        return _cow(&c)

    def mark_prefill_complete(self, request_id):
        cdef int32_t index = self._find_idle(request_id)
        slot_set_decode(&self.s, index)

    def seed_decode_token(self, request_id, token_id):
        cdef uint32_t tok = _u32(token_id, "token_id")
        cdef int32_t index = self._find_idle(request_id)
        self.s.slots[index].next_token_id = tok
        self.s.slots[index].token_ready = 1

    def record_token(self, request_id):
        cdef int32_t index = self._find_idle(request_id)
        self.s.slots[index].token_count = sat_add1(self.s.slots[index].token_count)
        return self.s.slots[index].token_count

    def finish(self, request_id, BlockPool pool not None):
        """Release the request's pages and free its slot (completion and cancellation alike)."""
        cdef int32_t index = self._find_idle(request_id)
        _check_busy(pool.busy, "pool")
        cdef int rc = sched_finish(&self.s, index, &pool.pool)
        if rc:
            raise _error(E_SCHED, rc)

    def block_table(self, request_id):
        cdef int32_t index = self._find(request_id)
        cdef Table *t = &self.s.slots[index].blocks
        cdef uint32_t i
        return [t.entries[i] for i in range(t.len)]

    def pending_token(self, request_id):
        """The input token of the request's next decode step, or None if none was seeded."""
        cdef int32_t index = self._find(request_id)
        if not self.s.slots[index].token_ready:
            return None
        return self.s.slots[index].next_token_id

    def request_view(self, request_id):
        cdef int32_t index = self._find(request_id)
        cdef Slot *sl = &self.s.slots[index]
        return (sl.request_id, index, RequestState(sl.state), sl.token_count, sl.prefix_tokens)

    cdef Py_ssize_t _runnable_into(self, qualia_request_view *out, Py_ssize_t cap) except -1:
        cdef uint32_t i
        cdef Py_ssize_t written = 0
        cdef Slot *sl
        if cap < self.s.active:
            raise SchedulerError.OutputTooSmall()
        for i in range(self.s.max_requests):
            sl = &self.s.slots[i]
            if sl.state == QUALIA_STATE_EMPTY:
                continue
            memset(&out[written], 0, sizeof(qualia_request_view))
            out[written].request_id = sl.request_id
            out[written].slot = <uint16_t>i
            out[written].state = sl.state
            out[written].token_count = sl.token_count
            out[written].prefix_tokens = sl.prefix_tokens
            written += 1
        return written

    def runnable_into(self, out):
        """Write every active request's view into ``out`` in slot order; return the count."""
        cdef _Buffer b = _acquire(out, "out", "request_view", sizeof(qualia_request_view),
                                  QUALIA_ALIGN_VIEW, True)
        return self._runnable_into(<qualia_request_view *>b.ptr, b.length)

    def runnable(self):
        """Every active request's view, as a fresh REQUEST_VIEW array."""
        arr = np.zeros(self.s.active, dtype=REQUEST_VIEW)
        cdef _Buffer b = _acquire(arr, "out", "request_view", sizeof(qualia_request_view),
                                  QUALIA_ALIGN_VIEW, True)
        self._runnable_into(<qualia_request_view *>b.ptr, b.length)
        return arr

    cdef object _round(self, object backend,
                       qualia_batch_item *items, Py_ssize_t items_cap, object items_obj,
                       uint32_t *table, Py_ssize_t table_cap, object table_obj,
                       qualia_batch_output *outs, Py_ssize_t outs_cap, object outs_obj):
        # One ragged decode round, the seed's checks in the seed's order.
        cdef Sched *s = &self.s
        cdef uint32_t i, j, w, n = 0, decode_count = s.n_decode
        cdef uint64_t bits
        cdef size_t need = 0, off = 0
        cdef Slot *sl
        cdef qualia_backend *cb = NULL
        cdef qualia_batch_receipt rec
        cdef int32_t status = 0
        cdef object holder = None
        cdef object fn = None
        # the backend is resolved first: a wrong one fails every round, empty or not
        holder = _c_backend(backend, &cb)
        if holder is None:
            fn = getattr(backend, "execute_ragged", None)
            if not callable(fn):
                raise TypeError(f"backend must be a C backend (__qualia_backend__ capsule) or have "
                                f"an execute_ragged(items, block_table, outputs) method, not "
                                f"{type(backend).__name__}")
        for w in range(s.n_words):
            bits = s.decode_bits[w]
            while bits:
                need += s.slots[w * 64 + __builtin_ctzll(bits)].blocks.len
                bits &= bits - 1
        if items_cap < decode_count:
            raise DecodeRoundError.ItemBufferTooSmall()
        if outs_cap < decode_count:
            raise DecodeRoundError.OutputBufferTooSmall()
        if <size_t>table_cap < need:
            raise DecodeRoundError.BlockTableBufferTooSmall()
        for w in range(s.n_words):
            bits = s.decode_bits[w]
            while bits:
                i = w * 64 + __builtin_ctzll(bits)
                bits &= bits - 1
                sl = &s.slots[i]
                if not sl.token_ready:
                    raise DecodeRoundError.MissingInputToken()
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
        if n == 0:
            return _ZERO_RECEIPT
        if off > U32_MAX:
            raise OverflowError("the lowered block table exceeds 2**32-1 entries")
        rec.batch_size = 0
        rec.backend_launches = 0
        self.busy = 1
        try:
            if holder is not None:
                with nogil:
                    status = cb.execute_ragged(cb.ctx, items, n, table, <uint32_t>off, outs, &rec)
                if status != 0:
                    raise DecodeRoundError.Backend(RaggedBackendError.Failed(status))
            else:
                try:
                    result = fn(_readonly_view(items_obj, n), _readonly_view(table_obj, off),
                                np.asarray(outs_obj)[:n])
                except BaseException as exc:
                    if not isinstance(exc, Exception):
                        raise  # KeyboardInterrupt and friends pass through untouched
                    raise DecodeRoundError.Backend(exc) from exc
                _parse_receipt(result, &rec)
        finally:
            self.busy = 0
        if rec.batch_size != n:
            raise DecodeRoundError.OutputIdentityMismatch()
        if rec.backend_launches != 1:
            raise DecodeRoundError.BackendLaunchCount()
        for j in range(n):
            i = s.lowered[j]
            if outs[j].request_id != s.slots[i].request_id or outs[j].slot != i:
                raise DecodeRoundError.OutputIdentityMismatch()
        for j in range(n):
            sl = &s.slots[s.lowered[j]]
            sl.next_token_id = outs[j].next_token_id
            sl.token_count = sat_add1(sl.token_count)
            sl.token_ready = 1
        return _receipt(self._receipts, n)

    def execute_decode_round(self, backend, item_scratch, block_table_scratch, output_scratch):
        """Lower every decoding request into the scratch buffers and call the backend once."""
        _check_busy(self.busy, "scheduler")
        cdef Py_buffer bi, bt, bo
        cdef int held = 0
        cdef void *pi = NULL
        cdef void *pt = NULL
        cdef void *po = NULL
        cdef Py_ssize_t ni = 0, nt = 0, no = 0
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
            return self._round(backend, <qualia_batch_item *>pi, ni, item_scratch,
                               <uint32_t *>pt, nt, block_table_scratch,
                               <qualia_batch_output *>po, no, output_scratch)
        finally:
            if held & 4:
                PyBuffer_Release(&bo)
            if held & 2:
                PyBuffer_Release(&bt)
            if held & 1:
                PyBuffer_Release(&bi)

    def __repr__(self):
        return (f"RequestScheduler(max_requests={self.s.max_requests}, "
                f"logical_pages={self.s.logical_pages}, active={self.s.active})")
