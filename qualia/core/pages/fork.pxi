# Copy-on-write forks (docs/DESIGN.md, "Forks").  A fork gives a new request (the child) a free
# slot, every page of a decoding request (the parent) -- the partly filled last page included --
# and the parent's token state.  Pages are shared by reference count, never copied here: the
# first write of either into a shared page copies it (table_ensure_writable in reserve and in the
# decode round), and finish releases one member's references only.  O(pages of the parent).


cdef int sched_fork(Sched *s, Pool *p, int32_t parent, uint64_t child_rid,
                    int32_t *out) noexcept nogil:
    # Checks in this order, each changing nothing: the parent is in its prefill, the child id is
    # active (the parent's own id included), no slot is free, a page's count would overflow.
    cdef Slot *ps = &s.slots[parent]
    cdef Slot *cs
    cdef int32_t index
    cdef uint32_t i, j
    cdef int rc
    if ps.state != QUALIA_STATE_DECODE:
        return Q_FORK_IN_PREFILL
    if sched_find(s, child_rid) >= 0:
        return Q_DUPLICATE_REQUEST
    index = sched_lowest_free(s)
    if index < 0:
        return Q_FULL
    for i in range(ps.blocks.len):
        rc = pool_retain(p, ps.blocks.entries[i])
        if rc:
            # every page retained so far had a count >= 1 before: releasing cannot free it
            for j in range(i):
                pool_release(p, ps.blocks.entries[j])
            return rc
    cs = &s.slots[index]
    if ps.blocks.len:
        memcpy(cs.blocks.entries, ps.blocks.entries, ps.blocks.len * sizeof(uint32_t))
    cs.blocks.len = ps.blocks.len
    cs.request_id = child_rid
    cs.token_count = ps.token_count
    cs.prefix_tokens = ps.prefix_tokens
    cs.next_token_id = ps.next_token_id
    cs.token_ready = ps.token_ready
    cs.state = QUALIA_STATE_PREFILL
    slot_set_decode(s, index)
    sched_index_insert(s, index)
    s.free_bits[index >> 6] &= ~((<uint64_t>1) << (index & 63))
    s.active += 1
    out[0] = index
    return Q_OK


cdef void auto_fork_stream(Streams *ss, PageCache *c, uint32_t parent, uint32_t child,
                           uint32_t *child_row) noexcept nogil:
    # The child's token stream continues the parent's.  Only the live tail is copied, so the
    # cost does not grow with the context: auto_fill starts at page `done` (reading the chain
    # value and cache entry of page done-1) and a decode notes tokens at positions
    # >= token_count >= done * page_tokens, so nothing before that is ever read again.  A page
    # the parent holds is never reclaimable, so the retains of sched_fork move nothing in the
    # cache.  `child_row` NULL: the tail is copied into the child slot's own row; else the
    # child's stream reads `child_row`, which the lender filled with the parent's tokens.
    cdef Stream *src = &ss.st[parent]
    cdef Stream *dst = &ss.st[child]
    cdef uint32_t pt = ss.page_tokens, first
    cdef size_t po = _sp(ss, parent), co = _sp(ss, child)
    if dst.live:
        # the slot's last request was finished through the raw RequestScheduler (see auto_admit)
        stream_stop(ss, dst)
        dst.live = 0
        ns_unref(&c.ns, dst.ns)
    cdef uint32_t *row = child_row if child_row != NULL else dst.row
    dst[0] = src[0]
    dst.row = row
    dst.has_pending = 0
    if not src.live:
        return
    ns_ref(&c.ns, src.ns)
    if src.broken:
        return           # stream_stop counts only live, unbroken streams; nothing is read again
    ss.cacheable += 1
    first = src.done - 1 if src.done else 0
    if src.hashed > first:      # hashed >= done: page done - 1's entry is copied too
        memcpy(&ss.refs[co + first], &ss.refs[po + first],
               (src.hashed - first) * sizeof(PageRef))
    if child_row == NULL and src.known > src.done * pt:
        memcpy(&row[<size_t>src.done * pt], &src.row[<size_t>src.done * pt],
               (src.known - src.done * pt) * sizeof(uint32_t))


cdef int facade_fork(Sched *s, Pool *p, PageCache *c, Streams *ss, bint auto, int32_t parent,
                     uint64_t child_rid, uint32_t *child_row, int32_t *out) noexcept nogil:
    # the facade's fork: the scheduler's, then (automatic mode) the token stream
    cdef int rc = sched_fork(s, p, parent, child_rid, out)
    if rc == Q_OK and auto:
        auto_fork_stream(ss, c, <uint32_t>parent, <uint32_t>out[0], child_row)
    return rc


cdef inline void fork_writer_seen(Pool *p, Table *t, uint32_t lp, Undo *log,
                                  Py_ssize_t *n) noexcept nogil:
    # A decode round's page count (the facade's _auto_decode_prepare) met a writer of logical
    # page lp, already counted.  When that page is shared, the writer copies it and lets go of
    # it, so the next writer of the same page sees one holder fewer: count it so by lowering the
    # count now (never to 0: it is >= 2), logged in `log` (the round's undo log, unused until
    # its make-writable loop) and restored by fork_writers_restore before anything else reads it.
    cdef uint32_t page
    if lp >= t.len:
        return
    page = t.entries[lp]
    if page < p.num_blocks and p.refcount[page] >= 2:
        p.refcount[page] -= 1
        log[n[0]].src = page
        n[0] += 1


cdef inline void fork_writers_restore(Pool *p, Undo *log, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t k
    for k in range(n):
        p.refcount[log[k].src] += 1
