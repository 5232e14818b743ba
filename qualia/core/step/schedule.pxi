# schedule() (docs/DESIGN.md, "One step"): running requests first (decodes, then prefill
# chunks, preempting when pages run out), then waiting ones by (priority, arrival) until one does
# not fit; then the plan is lowered (core/step/plan.pxi).  Built on the primitives the facade
# uses, in the order the pure-Python twin (qualia/twin/step.py) uses them: admission (auto_admit,
# or the seed's plain admit in mode "off"), page reservation (reserve_room + reserve_writable:
# reclaim, then copy-on-write / allocate).  So physical pages agree with the twin's by
# construction.

cdef int step_reserve(StepState *st, int32_t e, uint32_t n) noexcept nogil:
    # the reservation of the next n positions of entry e (reclaim, then make writable);
    # its copies are owed (core/step/copies.pxi), the row mirrors the pages.  On failure
    # nothing changed.
    cdef int32_t slot = st.ent[e].at.slot
    cdef uint64_t start = st.pg.s.slots[slot].token_count
    cdef uint32_t first = pt_div(st, start)
    cdef uint32_t last = first if n == 1 else pt_div(st, start + n - 1)
    cdef Py_ssize_t n_undo = 0, n_copies = 0
    cdef int rc = Q_OK
    cdef Table *t = &st.pg.s.slots[slot].blocks
    cdef uint32_t page
    if last >= st.lim.logical_pages:
        return Q_OUT_OF_RANGE
    if first == last and first < t.len:
        # the common decode case: a page the request already holds alone is written in place
        # (what ensure_writable would find); nothing to reclaim, allocate or rewrite
        page = t.entries[first]
        if page < st.pg.p.num_blocks and st.pg.p.refcount[page] == 1:
            return Q_OK
    if st.lim.mode == MODE_AUTO:
        rc = reserve_room(st.pg.s, st.pg.p, st.pg.c, slot, first, last)
    if rc == Q_OK:
        rc = reserve_writable(st.pg.s, st.pg.p, st.pg.undo, st.pg.cow, slot, first, last,
                              &n_undo, &n_copies)
    if rc == Q_OK and not owed_room(st, n_copies):
        rc = Q_OUTPUT_TOO_SMALL     # cannot happen: at most one copy owed per slot
    if rc:
        reserve_undo(st.pg.s, st.pg.p, st.pg.undo, n_undo)
        return rc
    # owed until a plan listing them is applied (docs/DESIGN.md, "Copies owed")
    owed_add(st, slot, st.pg.cow, n_copies)
    st.pg.pages_copied[0] += n_copies
    st.pg.pages_allocated[0] += n_undo - n_copies
    if st.lim.mode == MODE_AUTO and n_copies:
        auto_after_cow(st.pg.c, st.pg.p, st.pg.undo, n_undo)   # it acts on the copies only
    row_write(st, e, first, last)
    return Q_OK


cdef inline uint32_t _chunk(StepState *st, uint32_t remaining, uint32_t left) noexcept nogil:
    cdef uint32_t n = remaining if remaining < left else left
    if remaining > 1 and st.lim.max_chunk and n > st.lim.max_chunk:
        n = st.lim.max_chunk
    return n


cdef int admit_waiting(StepState *st, int32_t e, uint32_t left, uint32_t *chunk,
                       uint32_t *cached) noexcept nogil:
    # The head of the waiting queue: its cache hit (auto mode), its chunk, whether its pages fit
    # (free + reclaimable, less the reclaimable pages its own hit takes); then admit, reserve,
    # take a row.  Q_EXHAUSTED when it does not fit (nothing changed).
    cdef StepEntry *r = &st.ent[e]
    cdef const uint32_t *tok = arena_at(st, e)
    cdef uint32_t hit = 0, k, rec = 0, n, need
    cdef int32_t row
    cdef Admission_c adm
    cdef int rc
    cdef uint64_t avail
    cdef Table *t
    cdef Probe probe
    cdef const Probe *pr = NULL
    if st.lim.mode == MODE_AUTO:
        k = _probe_hit(st, e, &rec, &probe)
        if probe.refs != NULL:
            pr = &probe
        hit = k * st.lim.page_tokens
    n = _chunk(st, r.req.num_tokens - hit, left)
    need = <uint32_t>((hit + n - 1) // st.lim.page_tokens + 1 - hit // st.lim.page_tokens)
    avail = <uint64_t>st.pg.p.free_top + st.pg.c.n_state[PC_RECLAIMABLE] - rec
    if need > avail:
        return Q_EXHAUSTED
    row = row_lowest_free(st)
    if row < 0 or st.pg.s.active >= st.pg.s.max_requests:
        return Q_EXHAUSTED      # cannot happen: running < max_num_seqs <= max_requests
    # what the admission counts, for the undo below
    cdef uint64_t lookups = st.pg.c.lookups, lookup_tokens = st.pg.c.lookup_tokens
    cdef uint64_t hit_tokens = st.pg.c.hit_tokens, collisions = st.pg.c.collisions
    cdef uint64_t hashed = st.pg.c.pages_hashed, admitted = r.ord.admitted
    if st.lim.mode == MODE_AUTO:
        rc = auto_admit(st.pg.s, st.pg.p, st.pg.c, st.pg.ss, r.req.rid, tok, r.req.num_tokens,
                        r.names.nsb if r.names.nsb != NULL else <const uint8_t *>"", r.names.nsl,
                        r.names.nsh, arena_at(st, e), pr, &adm)
    else:
        rc = sched_admit(st.pg.s, r.req.rid, False, 0, 0, NULL, st.pg.p, &adm)
    if rc:
        return rc
    heap_remove(st, e)
    r.at.state = SR_RUNNING
    r.at.slot = adm.slot
    r.at.num_computed = adm.prefix_tokens
    r.at.row = row
    st.run.row_owner[row] = e
    st.run.admissions += 1
    r.ord.admitted = st.run.admissions
    st.run.ents[st.run.n] = e
    st.run.n += 1
    rc = step_reserve(st, e, n)
    if rc:
        # The fit test above promised this reservation (its hit is the admission's: one cache
        # state, read twice in one C stretch that nothing else runs in), so this is a broken
        # invariant.  Never leave a request half-admitted (running, in no plan, never named
        # new): undo the admission and report the error.  Its hit's cached pages go back to
        # the cache (reclaimable ones at the recent end of the reclaim order).
        slot_release(st, e)
        running_remove(st, e)
        st.run.row_owner[row] = -1
        r.at.row = -1
        r.at.num_computed = 0
        st.run.admissions -= 1
        r.ord.admitted = admitted
        r.at.state = SR_WAITING        # back in the heap under its own (priority, arrival, enq)
        _heap_set(st, st.wait.n, e)
        st.wait.n += 1
        _heap_up(st, st.wait.n - 1)
        if st.lim.mode == MODE_AUTO:
            st.pg.c.lookups = lookups
            st.pg.c.lookup_tokens = lookup_tokens
            st.pg.c.hit_tokens = hit_tokens
            st.pg.c.collisions = collisions
            st.pg.c.pages_hashed = hashed
        return rc
    # the row mirrors the whole table: the hit's pages and the chunk's
    t = &st.pg.s.slots[adm.slot].blocks
    row_write(st, e, 0, t.len - 1 if t.len else 0)
    chunk[0] = n
    cached[0] = adm.prefix_tokens
    return Q_OK


cdef uint32_t _probe_hit(StepState *st, int32_t e, uint32_t *rec, Probe *probe) noexcept nogil:
    # the pages an admission of entry e would take from the cache now, and how many of them are
    # reclaimable (cached_prefix's rule); `probe` the match, for the admission to take (its
    # refs NULL when the namespace is not interned: the admission interns it and matches).
    # The match is written where the admission keeps it: the page records of the slot it
    # will take (the lowest free one; a free slot's records are read by no one).  No free
    # slot: no admission, no match.
    cdef StepEntry *r = &st.ent[e]
    cdef const uint32_t *tok = arena_at(st, e)
    cdef uint32_t n = r.req.num_tokens
    cdef uint32_t hashed = (n - 1) // st.lim.page_tokens if n else 0
    cdef uint32_t k, i, ns
    cdef int32_t slot
    cdef bint collided
    cdef PageRef *refs
    rec[0] = 0
    probe.refs = NULL
    slot = sched_lowest_free(st.pg.s)
    if slot < 0:
        return 0
    ns = ns_find(&st.pg.c.ns, r.names.nsh,
                 r.names.nsb if r.names.nsb != NULL else <const uint8_t *>"", r.names.nsl)
    if ns == U32_MAX:
        return 0
    refs = stream_refs(st.pg.ss, <uint32_t>slot)
    k = auto_match(st.pg.c, tok, n, ns, r.names.nsh, hashed, refs, &collided)
    probe.refs = refs
    probe.hashed = hashed
    probe.k = k
    probe.collided = collided
    for i in range(k):
        rec[0] += pc_rec(st.pg.c, refs[i].canon).state == PC_RECLAIMABLE
    return k


cdef inline void _prefetch_table(StepState *st, int32_t e) noexcept nogil:
    # the block-table entry that step_reserve reads for running entry e's next position (a
    # hint only: a prefetch never faults, and nothing changes)
    cdef int32_t slot = st.ent[e].at.slot
    cdef Slot *sl
    if slot < 0:
        return
    sl = &st.pg.s.slots[slot]
    qualia_prefetch_r(sl.blocks.entries + pt_div(st, sl.token_count))


cdef int step_schedule(StepState *st) noexcept nogil:
    cdef uint32_t i, j, nd = 0, left = st.lim.budget, n, rem, hit
    cdef int32_t e, v
    cdef bint preempted = False, far, deep
    cdef int rc
    cdef PlanState *pl = &st.plan
    if pl.pending:
        return Q_PLAN_PENDING
    pl.step_no += 1
    pl.n = pl.T = pl.m = pl.n_kv = pl.n_copies = pl.n_new = pl.n_preempted = 0
    pl.num_topk = 0
    pl.num_prefill_tokens = pl.num_decode_tokens = pl.num_cached_tokens = 0
    # 1. running requests: decodes, then prefills, each in admission order
    j = 0
    for i in range(st.run.n):
        e = st.run.ents[i]
        rem = st.ent[e].req.num_tokens - st.ent[e].at.num_computed
        if rem == 1:
            st.run.order[nd] = e
            nd += 1
        elif rem > 1:
            st.run.order_pre[j] = e
            j += 1
    if j:
        memcpy(&st.run.order[nd], st.run.order_pre, j * sizeof(int32_t))
    j += nd
    far = j >= FAR_ROWS
    deep = j >= DEEP_ROWS
    for i in range(j):
        e = st.run.order[i]
        if far and i + ROWS_AHEAD < j:
            _prefetch_table(st, st.run.order[i + ROWS_AHEAD])
            if deep and i + 2 * ROWS_AHEAD < j:
                qualia_prefetch_r(&st.ent[st.run.order[i + 2 * ROWS_AHEAD]])   # for the former
        if left == 0:
            break
        if st.ent[e].at.state != SR_RUNNING:
            continue            # preempted earlier in this step
        rem = st.ent[e].req.num_tokens - st.ent[e].at.num_computed
        n = _chunk(st, rem, left)
        while True:
            rc = step_reserve(st, e, n)
            if rc == Q_OK:
                break
            if rc != Q_EXHAUSTED:
                return rc
            v = pick_victim(st, e)
            rc = preempt(st, v)
            if rc:
                return rc
            preempted = True
            if v == e:
                break
        if st.ent[e].at.state != SR_RUNNING:
            continue
        rc = plan_add(st, e, n)
        if rc:
            return rc
        # a decode feeds back a generated token: the last token of a prompt is prefilled
        st.ent[e].at.decode = rem == 1 and st.ent[e].at.num_computed >= st.ent[e].req.num_prompt
        if st.ent[e].at.unseen:
            # admitted by a discarded plan: named until a plan with it is applied
            if st.plan.n_new >= st.buf.cap[PB_NEW]:
                return plan_overrun(st, PB_NEW)
            st.buf.new_ids[st.plan.n_new] = st.ent[e].req.rid
            st.plan.n_new += 1
        left -= n
    # 2. waiting requests by (priority, arrival), unless this step preempted
    if not preempted:
        while st.wait.n and left > 0 and st.run.n < st.lim.max_seqs:
            # (the admitted request's plan records: checked before it is admitted)
            if st.plan.n >= st.buf.cap[PB_SEQS]:
                return plan_overrun(st, PB_SEQS)
            if st.plan.n_new >= st.buf.cap[PB_NEW]:
                return plan_overrun(st, PB_NEW)
            e = st.wait.heap[0]
            rc = admit_waiting(st, e, left, &n, &hit)
            if rc == Q_EXHAUSTED:
                break
            if rc == Q_NAMESPACES_FULL and st.run.n:
                break           # running requests will free namespace ids
            if rc:
                # the admission changed nothing (admit_waiting undoes its own); the requests
                # this step scheduled before it keep their pages, as after discard_plan()
                return rc
            st.ent[e].at.unseen = 1
            st.buf.new_ids[st.plan.n_new] = st.ent[e].req.rid
            st.plan.n_new += 1
            st.plan.num_cached_tokens += hit
            plan_add(st, e, n)      # room checked above
            st.ent[e].at.decode = 0
            left -= n
    # 3. the plan's arrays, in plan order
    rc = plan_lower(st)
    if rc:
        return rc
    st.plan.pending = True
    return Q_OK
