# Reserving pages for a request's next positions, shared by the facade (reserve, decode) and the
# engine step (core/step/schedule.pxi): copy-on-write / allocate each logical page (logging every
# change for undo), and, with automatic prefix caching, reclaim cached pages first for what the
# call will allocate -- or fail before changing anything.

cdef void reserve_undo(Sched *s, Pool *p, Undo *log, Py_ssize_t n) noexcept nogil:
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


cdef int reserve_writable(Sched *s, Pool *p, Undo *undo, qualia_copy_op *copies,
                          int32_t index, uint64_t first, uint64_t last,
                          Py_ssize_t *n_undo, Py_ssize_t *n_copies) noexcept nogil:
    # ensure_writable for logical pages first..last of one request, logging for undo.  The
    # loop runs in 64 bits: `last` may be 2**32-1, where a u32 `last + 1` would wrap and skip
    # the check.
    cdef Cow c
    cdef uint64_t lp = first
    cdef int rc
    while lp <= last:
        if lp > U32_MAX:
            return Q_OUT_OF_RANGE
        rc = table_ensure_writable(&s.slots[index].blocks, <uint32_t>lp, p, &c)
        if rc:
            return rc
        if c.kind != COW_EXCLUSIVE:
            undo[n_undo[0]].slot = index
            undo[n_undo[0]].logical_page = <uint32_t>lp
            undo[n_undo[0]].kind = c.kind
            undo[n_undo[0]].src = c.src
            undo[n_undo[0]].dst = c.page
            n_undo[0] += 1
            if c.kind == COW_COPY:
                copies[n_copies[0]].src_page = c.src
                copies[n_copies[0]].dst_page = c.page
                n_copies[0] += 1
        lp += 1
    return Q_OK


cdef int reserve_room(Sched *s, Pool *p, PageCache *c, int32_t index, uint32_t first,
                      uint32_t last) noexcept nogil:
    # reserve (automatic mode): reclaim what the call will allocate, or fail before changing
    # anything
    cdef uint64_t need = 0
    cdef int rc = auto_need_pages(&s.slots[index].blocks, first, last, p, c, &need)
    if rc:
        return rc
    return pc_make_room(c, p, need)
