# The running set and its block-table rows: running entries in admission order, one row of the
# plan's dense block table per running entry (rewritten where it changes, marked dirty), the
# slots they hold, leaving the running set (finish, preemption) and the victim a preemption
# picks.

cdef enum:
    ROW_DEFERRED = -2   # row_owner of a row whose request was aborted in the pending plan
    # A step over many rows: the lines each row touches at random (its block-table entry in
    # schedule(), its token arena line in update()) are prefetched ROWS_AHEAD rows ahead.  A
    # step of fewer than FAR_ROWS rows finds them in cache from the step before (measured:
    # bench/RESULTS-step.md), where the prefetch would only add instructions.
    ROWS_AHEAD = 16
    FAR_ROWS = 1024
    # A step of DEEP_ROWS rows or more also prefetches, 2 * ROWS_AHEAD rows ahead, the lines
    # the loads of those prefetches read (the rows' entries), so that no load waits on memory
    DEEP_ROWS = 2048


cdef struct StepRunning:
    int32_t *ents           # running entries, in admission order
    uint32_t n
    uint64_t admissions     # admission counter
    int32_t *order          # max_seqs: scratch, this step's running order
    int32_t *order_pre      # max_seqs: scratch, its prefills
    int32_t *row_owner      # max_seqs: entry holding each row, -1 when free
    uint64_t *dirty         # max_seqs bits, 64 a word: rows rewritten since the previous plan
    uint32_t *row_len       # max_seqs: leading entries of the row that may be set


cdef inline void prefetch_entry(StepState *st, int32_t e) noexcept nogil:
    # entry e's two lines a pass over the rows reads (its request and place, then its group),
    # 2 * ROWS_AHEAD rows ahead, for the prefetches that load the first (a hint only)
    qualia_prefetch_r(&st.ent[e])
    qualia_prefetch_r(&st.ent[e].mem)


cdef inline void row_mark_dirty(StepState *st, int32_t r) noexcept nogil:
    st.run.dirty[<uint32_t>r >> 6] |= (<uint64_t>1) << (<uint32_t>r & 63)


cdef void running_remove(StepState *st, int32_t e) noexcept nogil:
    cdef uint32_t i = 0
    while i < st.run.n and st.run.ents[i] != e:
        i += 1
    if i == st.run.n:
        return
    memmove(&st.run.ents[i], &st.run.ents[i + 1], (st.run.n - i - 1) * sizeof(int32_t))
    st.run.n -= 1


cdef void row_release(StepState *st, int32_t e) noexcept nogil:
    # the row is cleared to -1 (a change when it held pages) and freed
    cdef int32_t r = st.ent[e].at.row
    cdef int32_t *row
    cdef uint32_t k
    if r < 0:
        return
    row = &st.buf.block_table[<size_t>r * st.lim.logical_pages]
    if st.run.row_len[r]:
        for k in range(st.run.row_len[r]):
            row[k] = -1
        st.run.row_len[r] = 0
        row_mark_dirty(st, r)
    st.run.row_owner[r] = -1
    st.ent[e].at.row = -1


cdef inline int32_t row_lowest_free(StepState *st) noexcept nogil:
    cdef uint32_t r
    for r in range(st.lim.max_seqs):
        if st.run.row_owner[r] == -1:
            return <int32_t>r
    return -1


cdef void row_clear_deferred(StepState *st, int32_t r) noexcept nogil:
    # the row of a request aborted while in the pending plan, now that the plan is done
    cdef int32_t *row = &st.buf.block_table[<size_t>r * st.lim.logical_pages]
    cdef uint32_t k
    if st.run.row_owner[r] != ROW_DEFERRED:
        return
    if st.run.row_len[r]:
        for k in range(st.run.row_len[r]):
            row[k] = -1
        st.run.row_len[r] = 0
        row_mark_dirty(st, r)
    st.run.row_owner[r] = -1


cdef void row_write(StepState *st, int32_t e, uint32_t first, uint32_t last) noexcept nogil:
    # the row of entry e mirrors its slot's pages first..last (inclusive); marked when it changed
    cdef int32_t r = st.ent[e].at.row
    cdef Table *t = &st.pg.s.slots[st.ent[e].at.slot].blocks
    cdef int32_t *row = &st.buf.block_table[<size_t>r * st.lim.logical_pages]
    cdef uint32_t k
    cdef int32_t v
    if last >= t.len:
        last = t.len - 1 if t.len else 0
    if t.len:
        for k in range(first, last + 1):
            v = <int32_t>t.entries[k]
            if row[k] != v:
                row[k] = v
                row_mark_dirty(st, r)
    st.run.row_len[r] = t.len


cdef inline int slot_finish(StepState *st, int32_t slot) noexcept nogil:
    # facade finish: release the slot's pages (auto mode: into the cache) and free the slot;
    # first the copies owed that name its pages (owed_leave, core/step/copies.pxi)
    cdef int rc = Q_OK, r2
    if st.cp.n:
        rc = owed_leave(st, slot)
    if st.lim.mode == MODE_AUTO:
        r2 = auto_finish(st.pg.s, st.pg.p, st.pg.c, st.pg.ss, slot)
    else:
        r2 = sched_finish(st.pg.s, slot, st.pg.p)
    return rc if rc else r2


cdef int slot_release(StepState *st, int32_t e) noexcept nogil:
    cdef int rc = slot_finish(st, st.ent[e].at.slot)
    st.ent[e].at.slot = -1
    return rc


cdef int release_deferred(StepState *st) noexcept nogil:
    # the plan is retired (applied or discarded): the slots of the requests aborted while it
    # was pending hand their pages back now, in abort order
    cdef uint32_t k
    cdef int rc, first = Q_OK
    for k in range(st.plan.n_deferred):
        rc = slot_finish(st, st.plan.deferred_slot[k])
        if rc and first == Q_OK:
            first = rc
    st.plan.n_deferred = 0
    return first


cdef int32_t pick_victim(StepState *st, int32_t cur) noexcept nogil:
    # among running requests not yet scheduled in this step, plus the current one: the highest
    # priority value, ties -> the most recently admitted.  A computed beam waiting for its group
    # (it keeps its candidates) goes first, before anything that still computes (the twin's
    # _pick_victim)
    cdef int32_t best = -1, e
    cdef uint32_t i
    for i in range(st.run.n):
        e = st.run.ents[i]
        if not st.ent[e].mem.has_cand:
            continue
        if best < 0 or (st.ent[e].ord.priority > st.ent[best].ord.priority
                        or (st.ent[e].ord.priority == st.ent[best].ord.priority
                            and st.ent[e].ord.admitted > st.ent[best].ord.admitted)):
            best = e
    if best >= 0:
        return best
    best = cur
    for i in range(st.run.n):
        e = st.run.ents[i]
        if e != cur and st.ent[e].at.sched_step == st.plan.step_no:
            continue
        if (st.ent[e].ord.priority > st.ent[best].ord.priority
                or (st.ent[e].ord.priority == st.ent[best].ord.priority
                    and st.ent[e].ord.admitted > st.ent[best].ord.admitted)):
            best = e
    return best


cdef int leave_running(StepState *st, int32_t e) noexcept nogil:
    # release the pages (full pages stay cached in auto mode) and the row; forget the computed
    # tokens
    cdef int rc = slot_release(st, e)
    row_release(st, e)
    running_remove(st, e)
    st.ent[e].at.num_computed = 0
    st.ent[e].at.row_fresh = 0
    return rc


cdef int preempt(StepState *st, int32_t e) noexcept nogil:
    # recompute: back to waiting with its arrival number and outputs; a computed beam is parked
    # with its candidates instead
    cdef int rc
    if st.plan.n_preempted >= st.buf.cap[PB_PREEMPTED]:
        return plan_overrun(st, PB_PREEMPTED)
    rc = leave_running(st, e)
    if st.ent[e].mem.has_cand:
        beam_park(st, e)
    else:
        heap_push(st, e)
    st.buf.preempted_ids[st.plan.n_preempted] = st.ent[e].req.rid
    st.plan.n_preempted += 1
    return rc
