# Copies owed (docs/DESIGN.md, "Copies owed"): a copy-on-write copy made by a reservation stays
# owed until a plan listing it is applied.  Every plan lists every copy owed, in the order made,
# so a discarded plan's (and a failed schedule's) copies come first in the next plan.  When a
# request lets its pages go, the copies owed into them are dropped, and a copy still owed whose
# source is one of them holds its source page (one more reference) until the copy is applied.

cdef struct StepCopies:
    # the copies owed, in the order made (cap entries: plan copies_cap), each with the slot
    # whose page is its destination and whether its source page carries a hold
    qualia_copy_op *owed
    int32_t *slot
    uint8_t *held
    uint32_t n
    uint32_t cap


cdef inline int hold_page(StepState *st, uint32_t page) noexcept nogil:
    # one more reference to an allocated page (a reclaimable cached page is in use again)
    cdef int rc = pool_retain(st.pg.p, page)
    if rc == Q_OK and st.lim.mode == MODE_AUTO:
        pc_on_retain(st.pg.c, st.pg.p, page)
    return rc


cdef inline int unhold_page(StepState *st, uint32_t page) noexcept nogil:
    # the reference hold_page took (a cached page only the cache holds is reclaimable)
    cdef int rc = pool_release(st.pg.p, page)
    if rc == Q_OK and st.lim.mode == MODE_AUTO:
        pc_on_release(st.pg.c, st.pg.p, page)
    return rc


cdef inline int owed_room(StepState *st, Py_ssize_t n) noexcept nogil:
    # whether n more copies fit (they always do: at most one copy owed per slot and page)
    return st.cp.n + n <= st.cp.cap


cdef inline void owed_add(StepState *st, int32_t slot, const qualia_copy_op *copies,
                          Py_ssize_t n) noexcept nogil:
    # a reservation's copies into slot's pages: owed until a plan listing them is applied
    cdef Py_ssize_t k
    for k in range(n):
        st.cp.owed[st.cp.n] = copies[k]
        st.cp.slot[st.cp.n] = slot
        st.cp.held[st.cp.n] = 0
        st.cp.n += 1


cdef inline void owed_list(StepState *st) noexcept nogil:
    # the plan's copies: every copy owed, in the order made
    memcpy(st.buf.copies, st.cp.owed, st.cp.n * sizeof(qualia_copy_op))
    st.plan.n_copies = st.cp.n


cdef int owed_leave(StepState *st, int32_t slot) noexcept nogil:
    # The request in `slot` is about to let its pages go: the copies owed into its pages are
    # moot (dropped, in order, their holds released), then each copy still owed whose source
    # page is one of its pages, not held yet, holds that page, so the source outlives its last
    # holder until the copy is applied.
    cdef Table *t = &st.pg.s.slots[slot].blocks
    cdef uint32_t k, j = 0, i
    cdef int rc, first = Q_OK
    for k in range(st.cp.n):
        if st.cp.slot[k] == slot:
            if st.cp.held[k]:
                rc = unhold_page(st, st.cp.owed[k].src_page)
                if rc and first == Q_OK:
                    first = rc
            continue
        if j != k:
            st.cp.owed[j] = st.cp.owed[k]
            st.cp.slot[j] = st.cp.slot[k]
            st.cp.held[j] = st.cp.held[k]
        j += 1
    st.cp.n = j
    for k in range(st.cp.n):
        if st.cp.held[k]:
            continue
        for i in range(t.len):
            if t.entries[i] == st.cp.owed[k].src_page:
                rc = hold_page(st, st.cp.owed[k].src_page)
                if rc == Q_OK:
                    st.cp.held[k] = 1
                elif first == Q_OK:
                    first = rc
                break
    return first


cdef int owed_applied(StepState *st) noexcept nogil:
    # update(): the pending plan listed every copy owed and was applied: the holds go, in order
    cdef uint32_t k
    cdef int rc, first = Q_OK
    for k in range(st.cp.n):
        if st.cp.held[k]:
            rc = unhold_page(st, st.cp.owed[k].src_page)
            if rc and first == Q_OK:
                first = rc
    st.cp.n = 0
    return first


cdef int copies_init(StepState *st) except -1:
    # sized like the plan's copies (copies_cap), by step_init
    st.cp.cap = st.plan.copies_cap
    st.cp.owed = <qualia_copy_op *>PyMem_Malloc(st.cp.cap * sizeof(qualia_copy_op))
    st.cp.slot = <int32_t *>PyMem_Malloc(st.cp.cap * sizeof(int32_t))
    st.cp.held = <uint8_t *>PyMem_Malloc(st.cp.cap)
    if st.cp.owed == NULL or st.cp.slot == NULL or st.cp.held == NULL:
        raise MemoryError(f"cannot allocate the engine step's {st.cp.cap} owed copies")
    return 0


cdef void copies_free(StepState *st) noexcept:
    PyMem_Free(st.cp.owed)
    PyMem_Free(st.cp.slot)
    PyMem_Free(st.cp.held)
