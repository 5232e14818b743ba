# n groups (docs/DESIGN.md, "Forks at the step level"): one prefill, then k members on
# copy-on-write forks of the parent -- forked when a slot and a row are free, else queued.

cdef struct StepGroups:
    uint64_t forks          # children forked
    uint64_t fork_fallbacks  # children queued for lack of a slot or row


cdef int step_spawn(StepState *st, int32_t pe, int32_t ce) noexcept nogil:
    # child entry ce of the running parent pe, with the parent's tokens so far: forked (a slot
    # and a row are free) or queued as an ordinary request (admitted later through the cache)
    cdef StepEntry *par = &st.ent[pe]
    cdef StepEntry *ch = &st.ent[ce]
    cdef int32_t row = row_lowest_free(st), slot = -1
    cdef Slot *ps
    cdef int rc
    arena_copy(st, ce, pe)
    st.ids.count += 1
    if par.at.state == SR_RUNNING and row >= 0 and st.pg.s.active < st.pg.s.max_requests:
        ps = &st.pg.s.slots[par.at.slot]
        if ps.state != QUALIA_STATE_DECODE:
            # fork takes decoding requests only: the parent's prefill is complete
            slot_set_decode(st.pg.s, par.at.slot)
            ps.next_token_id = 0
            ps.token_ready = 1
        rc = facade_fork(st.pg.s, st.pg.p, st.pg.c, st.pg.ss, st.lim.mode == MODE_AUTO,
                         par.at.slot, ch.req.rid, arena_at(st, ce), &slot)
        if rc:
            return rc       # cannot happen: a slot is free and the pages are held
        ch.at.state = SR_RUNNING
        ch.at.slot = slot
        ch.at.num_computed = par.at.num_computed
        st.run.admissions += 1
        ch.ord.admitted = st.run.admissions
        ch.at.row = row
        ch.at.row_fresh = 1
        st.run.row_owner[row] = ce
        st.run.ents[st.run.n] = ce
        st.run.n += 1
        st.groups.forks += 1
        # always: an update forks each n child once (<= max_queued) and beam children that
        # live past it (<= max_seqs); children that finish at once free their rows for more
        if st.done.n_fork_acc < st.done.fork_cap:
            st.done.fork_acc[2 * st.done.n_fork_acc] = ch.req.rid
            st.done.fork_acc[2 * st.done.n_fork_acc + 1] = par.req.rid
            st.done.n_fork_acc += 1
    else:
        heap_push(st, ce)
        st.groups.fork_fallbacks += 1
    return Q_OK


cdef int step_fork_n(StepState *st, int32_t e, const uint32_t *toks) noexcept nogil:
    # the leader e of an n group sampled toks[0..k): fork the k - 1 children, then each member
    # takes its own token (the children first, the parent last)
    cdef int32_t c
    cdef uint32_t j
    cdef int rc, first = Q_OK
    st.ent[e].mem.forked = 1
    c = st.ent[e].mem.next_member
    while c >= 0:
        rc = step_spawn(st, e, c)
        if rc and first == Q_OK:
            first = rc
        c = st.ent[c].mem.next_member
    c = st.ent[e].mem.next_member
    j = 1
    while c >= 0:
        rc = step_take(st, c, toks[j])
        if rc and first == Q_OK:
            first = rc
        j += 1
        c = st.ent[c].mem.next_member
    rc = step_take(st, e, toks[0])
    if rc and first == Q_OK:
        first = rc
    return first
