# Beam groups (docs/DESIGN.md, "Beam search at the step level"): a record entry per group, its
# live beams (each with a row of candidates once computed) and its finished hypotheses; the
# selection that keeps the best continuations; parking; the checks of a plan's candidates.

cdef struct SelCand:
    double score
    uint32_t rank
    uint32_t tok
    int32_t beam            # its beam's entry
    int32_t dest            # update: the entry that takes it (continuing beam or hypothesis)
    uint8_t reason          # FIN_NONE: continues


cdef struct StepBeams:
    int32_t beam_head       # beam group records in add order
    int32_t beam_tail
    uint32_t *cand_ids      # max_queued x max_seqs, by entry: a computed beam's candidates
    double *cand_lps        # their log-probabilities (both allocated with the first beam group)
    SelCand *sel            # max_seqs: the kept candidates of one selection
    int32_t *sel_groups     # max_seqs: groups with a beam row in the plan being applied
    uint32_t n_sel_groups
    uint64_t parked         # beams parked (docs/DESIGN.md, "Progress")
    uint32_t *topk_ids_buf  # run() with a C backend: the backend's candidates
    float *topk_lps_buf
    size_t topk_cap


cdef inline void beam_park(StepState *st, int32_t e) noexcept nogil:
    # a computed beam out of the running list (leave_running first): it keeps its candidates
    # and waits for its group's selection outside the queues
    st.ent[e].at.state = SR_PARKED
    st.beams.parked += 1


cdef inline int32_t beam_take_entry(StepState *st, int32_t g) noexcept nogil:
    # one of group g's reserved spare entries (the counting guarantees one is there)
    cdef int32_t e
    st.ids.n_free -= 1
    e = st.ids.free_ids[st.ids.n_free]
    st.ent[g].rec.n_spare -= 1
    st.ids.reserved -= 1
    return e


cdef inline void beam_give_entry(StepState *st, int32_t g, int32_t e) noexcept nogil:
    # a beam entry of group g is free again: back to the group's spares
    entry_free(st, e)
    st.ent[g].rec.n_spare += 1
    st.ids.reserved += 1


cdef int beam_stop(StepState *st, int32_t g, int32_t b) noexcept nogil:
    # a live beam without continuation leaves the queues (the twin's _finish_member)
    cdef int rc = Q_OK
    if st.ent[b].at.state == SR_RUNNING:
        rc = slot_release(st, b)
        row_release(st, b)
        running_remove(st, b)
    elif st.ent[b].at.state == SR_WAITING:
        heap_remove(st, b)
    st.ent[b].mem.has_cand = 0
    st.ids.count -= 1
    accum_finished(st, st.ent[b].req.rid)
    if st.ent[g].rec.parent_beam == b:
        st.ent[g].rec.parent_beam = -1
    return rc


cdef inline bint _sel_before(double s, uint32_t rank, uint32_t tok, SelCand *x) noexcept nogil:
    # candidate order: higher score, then the earlier beam, then the lower id
    if s != x.score:
        return s > x.score
    if rank != x.rank:
        return rank < x.rank
    return tok < x.tok


cdef int beam_select(StepState *st, int32_t g) noexcept nogil:
    # The twin's select (qualia/twin/groups.py): when every live beam of group g has its
    # candidates (running and computed, or parked), the best w - hypotheses candidates are kept;
    # each either finishes a hypothesis (stored in an entry of the group) or continues a beam
    # (the first continuation of a beam takes the beam itself, each further one forks a child).
    # No live continuation: the group is done (st.done.ents).  Allocates nothing.
    cdef StepEntry *R = &st.ent[g]
    cdef uint32_t w = R.mem.n_members, K, nk = 0, rank = 0, c, i, p, n_cont = 0
    cdef int32_t b, d, prev, src
    cdef size_t base
    cdef double sc
    cdef uint32_t tok
    cdef int rc = Q_OK, r2
    cdef StepEntry *x
    b = R.mem.next_member
    while b >= 0:
        x = &st.ent[b]
        if not x.mem.has_cand:
            return Q_OK
        b = x.mem.next_member
    K = w - R.mem.n_members_done
    b = R.mem.next_member
    while b >= 0:
        x = &st.ent[b]
        base = <size_t>b * st.lim.max_seqs
        for c in range(w):
            sc = x.hyp.score + st.beams.cand_lps[base + c]
            tok = st.beams.cand_ids[base + c]
            p = nk
            while p > 0 and _sel_before(sc, rank, tok, &st.beams.sel[p - 1]):
                p -= 1
            if p >= K:
                continue
            if nk < K:
                nk += 1
            i = nk - 1
            while i > p:
                st.beams.sel[i] = st.beams.sel[i - 1]
                i -= 1
            st.beams.sel[p].score = sc
            st.beams.sel[p].rank = rank
            st.beams.sel[p].tok = tok
            st.beams.sel[p].beam = b
        x.mem.has_cand = 0
        rank += 1
        b = x.mem.next_member
    # classify; in_sel on a beam: 1 continues, 2 finishes a hypothesis, 4 its entry holds one
    for i in range(nk):
        x = &st.ent[st.beams.sel[i].beam]
        if is_stop_token(x, st.beams.sel[i].tok):
            st.beams.sel[i].reason = FIN_STOP
        elif x.req.num_tokens - x.req.num_prompt + 1 >= x.req.max_new:
            st.beams.sel[i].reason = FIN_LENGTH
        else:
            st.beams.sel[i].reason = FIN_NONE
        if st.beams.sel[i].reason == FIN_NONE:
            x.mem.in_sel |= 1
            n_cont += 1
        else:
            x.mem.in_sel |= 2
    # beams with no live continuation leave first (member order: the twin's finish order);
    # those sourcing no hypothesis give their entry back now
    prev = -1
    b = R.mem.next_member
    while b >= 0:
        d = st.ent[b].mem.next_member
        if not (st.ent[b].mem.in_sel & 1):
            r2 = beam_stop(st, g, b)
            if r2 and rc == Q_OK:
                rc = r2
            if not (st.ent[b].mem.in_sel & 2):
                st.ent[b].mem.in_sel = 0
                beam_give_entry(st, g, b)
        b = d
    # hypotheses whose beam continues, or second ones of a beam: copied into a spare entry
    # (read before any beam's own entry takes its hypothesis in place)
    for i in range(nk):
        if st.beams.sel[i].reason == FIN_NONE:
            continue
        src = st.beams.sel[i].beam
        x = &st.ent[src]
        if not (x.mem.in_sel & 1) and not (x.mem.in_sel & 4):
            x.mem.in_sel |= 4           # this one goes in place, below
            st.beams.sel[i].dest = src
            continue
        d = beam_take_entry(st, g)
        memset(&st.ent[d], 0, sizeof(StepEntry))
        arena_copy(st, d, src)
        st.ent[d].req.rid = x.req.rid
        st.ent[d].req.num_prompt = x.req.num_prompt
        st.ent[d].req.unindexed = 1
        st.beams.sel[i].dest = d
    for i in range(nk):
        if st.beams.sel[i].reason == FIN_NONE:
            continue
        d = st.beams.sel[i].dest
        x = &st.ent[d]
        if d == st.beams.sel[i].beam:
            entry_unindex(st, d)
            x.mem.in_sel = 0
        arena_append(st, d, st.beams.sel[i].tok)
        x.at.state = SR_MEMBER_DONE
        x.mem.group = g
        x.at.slot = -1
        x.at.row = -1
        x.ord.heap_pos = -1
        x.at.plan_pos = -1
        x.mem.next_member = -1
        x.hyp.score = st.beams.sel[i].score
        x.req.reason = st.beams.sel[i].reason
        x.hyp.hyp_seq = R.mem.n_members_done
        R.mem.n_members_done += 1
        x.hyp.next_hyp = R.hyp.next_hyp
        R.hyp.next_hyp = d
    if n_cont == 0:
        R.mem.next_member = -1
        R.at.state = SR_FINISHED
        st.done.ents[st.done.n] = g
        st.done.n += 1
        return rc
    # continuations in kept order: a beam's first takes the beam, each further one forks
    for i in range(nk):
        if st.beams.sel[i].reason != FIN_NONE:
            continue
        b = st.beams.sel[i].beam
        if not (st.ent[b].mem.in_sel & 8):
            st.ent[b].mem.in_sel |= 8
            st.beams.sel[i].dest = b
            continue
        d = beam_take_entry(st, g)
        st.ent[d] = st.ent[b]
        x = &st.ent[d]
        x.req.rid = st.ids.next_child
        st.ids.next_child += 1
        while child_id_taken(st, x.req.rid):
            x.req.rid = st.ids.next_child
            st.ids.next_child += 1
        x.names.nsb_borrowed = 1
        x.req.unindexed = 0
        x.ord.heap_pos = -1
        x.at.plan_pos = -1
        x.at.slot = -1
        x.at.row = -1
        x.at.num_computed = 0
        x.mem.has_cand = 0
        x.mem.in_sel = 0
        x.at.decode = 0
        x.at.row_fresh = 0
        x.mem.next_member = -1
        x.at.state = SR_RESERVED
        oa_insert(st.ids.index, st.ids.index_mask, _step_home(st, x.req.rid), d)
        r2 = step_spawn(st, b, d)
        if r2 and rc == Q_OK:
            rc = r2
        st.beams.sel[i].dest = d
    prev = -1
    for i in range(nk):
        if st.beams.sel[i].reason != FIN_NONE:
            continue
        d = st.beams.sel[i].dest
        x = &st.ent[d]
        x.mem.in_sel = 0
        arena_append(st, d, st.beams.sel[i].tok)
        if x.at.state == SR_PARKED:
            heap_push(st, d)        # a parked beam continues: it has a token to compute
        x.hyp.score = st.beams.sel[i].score
        x.mem.next_member = -1
        if prev < 0:
            R.mem.next_member = d
        else:
            st.ent[prev].mem.next_member = d
        prev = d
    return rc


cdef void beam_park_blocked(StepState *st) noexcept nogil:
    # The twin's park_blocked (qualia/twin/groups.py), after a step that scheduled nothing:
    # every running beam (each is computed and waits for a sibling) is parked with its
    # candidates, not reported as preempted, groups in add order and beams in member order
    cdef int32_t g = st.beams.beam_head, b
    cdef StepEntry *x
    while g >= 0:
        if st.ent[g].at.state == SR_GROUP:
            b = st.ent[g].mem.next_member
            while b >= 0:
                x = &st.ent[b]
                if x.at.state == SR_RUNNING and x.at.num_computed == x.req.num_tokens:
                    leave_running(st, b)
                    beam_park(st, b)
                b = x.mem.next_member
        g = st.ent[g].rec.next_group


cdef void beam_group_free(StepState *st, int32_t g) noexcept nogil:
    # the group's result is returned (or it was aborted): every entry it holds is free again
    cdef int32_t b = st.ent[g].hyp.next_hyp, nxt
    while b >= 0:
        nxt = st.ent[b].hyp.next_hyp
        entry_free(st, b)
        b = nxt
    b = st.ent[g].mem.next_member
    while b >= 0:
        nxt = st.ent[b].mem.next_member
        entry_free(st, b)
        b = nxt
    st.ids.reserved -= st.ent[g].rec.n_spare
    if st.ent[g].rec.prev_group >= 0:
        st.ent[st.ent[g].rec.prev_group].rec.next_group = st.ent[g].rec.next_group
    else:
        st.beams.beam_head = st.ent[g].rec.next_group
    if st.ent[g].rec.next_group >= 0:
        st.ent[st.ent[g].rec.next_group].rec.prev_group = st.ent[g].rec.prev_group
    else:
        st.beams.beam_tail = st.ent[g].rec.prev_group
    entry_free(st, g)


cdef enum:
    TOPK_OK = 0
    TOPK_BAD_LOGPROB = 1    # a log-probability that is NaN or above 0
    TOPK_REPEATED = 2       # a beam row names a token twice among its first w candidates
    TOPK_UNSORTED = 3       # a beam row's log-probabilities are not best first


cdef int step_check_topk(StepState *st, const uint32_t *ids, const double *lps,
                         const float *lps_f, uint32_t *row) noexcept nogil:
    # The pending plan's candidates ([m, num_topk], ids already in the vocabulary), before
    # anything is applied: every log-probability a number at most 0 (-inf is a token of
    # probability 0; NaN would make the scores unordered, and a value above 0 is no
    # log-probability: added up, 1e308s overflow to +inf, and +inf + -inf is NaN), each live
    # beam row's first w ids distinct (w continuations of one beam) and its k log-probabilities best
    # first (a group narrower than num_topk reads the first w as its best).  *row: the first
    # bad row.
    cdef uint32_t k = st.plan.num_topk, j, a, b, w
    cdef size_t i, n = <size_t>st.plan.m * k, base
    cdef double v
    cdef int32_t g
    for i in range(n):
        v = lps[i] if lps != NULL else lps_f[i]
        if not v <= 0:          # NaN compares false
            row[0] = <uint32_t>(i // k)
            return TOPK_BAD_LOGPROB
    for j in range(st.plan.n):
        if not st.plan.plan_alive[j] or st.plan.plan_sample[j] < 0:
            continue
        g = st.ent[st.plan.plan_entry[j]].mem.group
        if g < 0 or not st.ent[g].rec.beam:
            continue
        w = st.ent[g].mem.n_members
        base = <size_t>st.plan.plan_sample[j] * k
        for a in range(1, w):
            for b in range(a):
                if ids[base + a] == ids[base + b]:
                    row[0] = <uint32_t>st.plan.plan_sample[j]
                    return TOPK_REPEATED
        for a in range(1, k):
            if ((lps[base + a] > lps[base + a - 1]) if lps != NULL
                    else (lps_f[base + a] > lps_f[base + a - 1])):
                row[0] = <uint32_t>st.plan.plan_sample[j]
                return TOPK_UNSORTED
    return TOPK_OK


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
