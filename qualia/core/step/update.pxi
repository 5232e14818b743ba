# update() (docs/DESIGN.md, "Tokens back"): the pending plan's chunks advance (pages that fill
# go to the cache), each sampled row's token is noted and the stop conditions applied; n groups
# fork, beam groups select; discard_plan() drops a plan instead.  What finished, was aborted or
# forked since the previous plan accumulates here for the next plan to report.

cdef struct StepDone:
    uint64_t *fin_accum     # finished or aborted since the previous plan
    uint32_t n_accum
    uint32_t accum_cap
    uint32_t n_ahead        # of them, ids at or past the children's next id when noted
    uint64_t *fork_acc      # forks since the previous plan: (child, parent) pairs, fork_cap
    uint32_t n_fork_acc
    uint32_t fork_cap       # fixed at construction (an update forks at most max_queued)
    int32_t *ents           # finished entries (state SR_FINISHED) not yet handed to Python
    uint32_t n


cdef void accum_finished(StepState *st, uint64_t rid) noexcept nogil:
    # the caller made room: abort grows the buffer with the GIL, and an update notes each of
    # the max_queued entries at most once (update() grows it to n_accum + max_queued first; in
    # run()'s loop each update follows a schedule, which emptied it, and accum_cap is
    # max_queued + max_seqs)
    if st.done.n_accum < st.done.accum_cap:
        st.done.fin_accum[st.done.n_accum] = rid
        st.done.n_accum += 1
        # a child id could meet it only if it lies ahead of the children's counter (which
        # only grows): user ids from 2**63 up
        st.done.n_ahead += rid >= st.ids.next_child


cdef void accum_recount(StepState *st) noexcept nogil:
    # n_ahead after the list was rebuilt (a discarded plan's ids back in front)
    cdef uint32_t i
    st.done.n_ahead = 0
    for i in range(st.done.n_accum):
        st.done.n_ahead += st.done.fin_accum[i] >= st.ids.next_child


cdef bint accum_holds(StepState *st, uint64_t rid) noexcept nogil:
    # is rid among the ids the next plan reports finished?  (a scan, only while some noted id
    # lies ahead of the children's counter)
    cdef uint32_t i
    if st.done.n_ahead == 0:
        return False
    for i in range(st.done.n_accum):
        if st.done.fin_accum[i] == rid:
            return True
    return False


cdef inline bint is_stop_token(StepEntry *r, uint32_t tok) noexcept nogil:
    # eos (unless ignored) or one of the request's stop ids
    cdef uint32_t k
    if r.req.has_eos and not r.req.ignore_eos and tok == r.req.eos:
        return True
    for k in range(r.req.n_stop):
        if r.names.stop[k] == tok:
            return True
    return False


cdef inline int step_take(StepState *st, int32_t e, uint32_t tok) noexcept nogil:
    # one sampled token for entry e (running, or a queued child of an n group): note it, apply
    # the stop conditions (step_stop)
    cdef StepEntry *r = &st.ent[e]
    cdef uint32_t pos = r.req.num_tokens
    arena_append(st, e, tok)       # the token stream (auto mode) reads it there too
    if pos + 1 - r.req.num_prompt >= r.req.max_new:
        return step_stop(st, e, FIN_LENGTH)
    if (r.req.has_eos or r.req.n_stop) and is_stop_token(r, tok):
        return step_stop(st, e, FIN_STOP)
    return Q_OK


cdef int step_stop(StepState *st, int32_t e, uint8_t reason) noexcept nogil:
    # entry e stopped: a plain request goes to st.done.ents (SR_FINISHED), a member waits for
    # its group (SR_MEMBER_DONE) and the last one puts the leader in st.done.ents
    cdef StepEntry *r = &st.ent[e]
    cdef StepEntry *g
    cdef int rc = Q_OK
    r.req.reason = reason
    if r.at.state == SR_RUNNING:
        rc = slot_release(st, e)
        row_release(st, e)
        running_remove(st, e)
    else:
        heap_remove(st, e)
    st.ids.count -= 1
    accum_finished(st, r.req.rid)
    if r.mem.group < 0:
        r.at.state = SR_FINISHED
        st.done.ents[st.done.n] = e
        st.done.n += 1
        return rc
    r.at.state = SR_MEMBER_DONE
    g = &st.ent[r.mem.group]
    g.mem.n_members_done += 1
    if g.mem.n_members_done == g.mem.n_members:
        g.at.state = SR_FINISHED
        st.done.ents[st.done.n] = r.mem.group
        st.done.n += 1
    return rc


cdef enum:
    FILL_AHEAD = 4      # how many page-completing plan rows ahead update() prefetches a fill


cdef inline void _hash_fill_ahead(StepState *st, uint32_t f) noexcept nogil:
    # the f-th plan row whose chunk completes a page: hash the page its fill will take (kept
    # for the fill, auto_hash_ahead_lent) and prefetch what the fill will read
    cdef uint32_t j = st.plan.fill_rows[f]
    cdef StepEntry *r
    if not st.plan.plan_alive[j]:
        return
    r = &st.ent[st.plan.plan_entry[j]]
    if r.at.slot >= 0:
        auto_hash_ahead_lent(st.pg.s, st.pg.p, st.pg.c, st.pg.ss, <uint32_t>r.at.slot,
                             r.req.num_tokens)


cdef inline void _prefetch_fill_refs(StepState *st, uint32_t f) noexcept nogil:
    # further ahead of _hash_fill_ahead, in a step of many rows: the chain value it continues
    # (the previous page's), the page's tokens and its block-table entry, which the stream's
    # last fill or admission left long ago (a hint only: a prefetch never faults, and nothing
    # changes)
    cdef uint32_t j = st.plan.fill_rows[f]
    cdef int32_t slot = st.ent[st.plan.plan_entry[j]].at.slot
    cdef Stream *sm
    if slot < 0:
        return
    sm = &st.pg.ss.st[slot]
    if not sm.live or sm.broken or sm.done >= st.pg.s.slots[slot].blocks.len:
        return
    qualia_prefetch_r(stream_refs(st.pg.ss, <uint32_t>slot) + (sm.done - 1 if sm.done else 0))
    qualia_prefetch_r(sm.row + <size_t>sm.done * st.pg.ss.page_tokens)
    qualia_prefetch_r(st.pg.s.slots[slot].blocks.entries + sm.done)


cdef inline void _prefetch_take(StepState *st, int32_t e) noexcept nogil:
    # the arena line step_take writes entry e's next token to (a hint only: a prefetch never
    # faults, and nothing changes)
    qualia_prefetch_w(arena_at(st, e) + st.ent[e].req.num_tokens)


cdef void done_unindex(StepState *st, uint32_t first) noexcept nogil:
    # The ids of what finished since st.done.ents[first] leave the id index (the entries stay
    # until step_collect hands them to Python): an id is taken until the update that finished
    # it ends, however many steps a GIL-free run() takes before it collects.  An n group's
    # members all go; a beam group's id is its group entry's (its hypotheses left at once).
    cdef uint32_t k
    cdef int32_t e, c
    for k in range(first, st.done.n):
        e = st.done.ents[k]
        if st.ent[e].mem.group == e and not st.ent[e].rec.beam:
            c = e
            while c >= 0:
                entry_unindex(st, c)
                c = st.ent[c].mem.next_member
        else:
            entry_unindex(st, e)


cdef int step_update(StepState *st, const uint32_t *sampled, const uint32_t *tk_ids,
                     const double *tk_lps, const float *tk_lps_f) noexcept nogil:
    # sampled[0..m) was validated by the caller, and so were the candidates of a plan with beam
    # rows (tk_ids and tk_lps or tk_lps_f: [m, num_topk], row-major).  Finished entries go to
    # st.done.ents (state SR_FINISHED) for the caller to report and free.
    cdef uint32_t j, n, c, w, k = st.plan.num_topk
    cdef size_t src, dst
    cdef int32_t e, g
    cdef StepEntry *r
    cdef Slot *sl
    cdef int rc, first = Q_OK
    cdef uint64_t tc
    cdef uint32_t done0 = st.done.n, f, nfill
    cdef bint fills, far, deep
    if not st.plan.pending:
        return Q_NO_PLAN
    # the plan listed every copy owed, and it was applied
    first = owed_applied(st)
    # the fills ahead are prefetched (the list is empty but in auto mode)
    nfill = st.plan.n_fill_rows
    far = st.plan.n >= FAR_ROWS
    deep = st.plan.n >= DEEP_ROWS
    if deep:
        for f in range(nfill if nfill < 2 * FILL_AHEAD else 2 * FILL_AHEAD):
            _prefetch_fill_refs(st, f)
    for f in range(nfill if nfill < FILL_AHEAD else FILL_AHEAD):
        _hash_fill_ahead(st, f)
    f = 0
    for j in range(st.plan.n):
        fills = f < nfill and st.plan.fill_rows[f] == j   # its chunk completes a page
        if fills:
            if f + FILL_AHEAD < nfill:
                _hash_fill_ahead(st, f + FILL_AHEAD)
                if deep and f + 2 * FILL_AHEAD < nfill:
                    _prefetch_fill_refs(st, f + 2 * FILL_AHEAD)
            f += 1
        e = st.plan.plan_entry[j]
        if far and j + ROWS_AHEAD < st.plan.n:
            _prefetch_take(st, st.plan.plan_entry[j + ROWS_AHEAD])
            if deep and j + 2 * ROWS_AHEAD < st.plan.n:
                prefetch_entry(st, st.plan.plan_entry[j + 2 * ROWS_AHEAD])
        if not st.plan.plan_alive[j]:
            continue
        r = &st.ent[e]
        r.at.plan_pos = -1
        r.at.unseen = 0
        n = st.plan.plan_chunk[j]
        # advance: the chunk's K/V is written; pages that filled go to the cache
        sl = &st.pg.s.slots[r.at.slot]
        tc = <uint64_t>sl.token_count + n
        sl.token_count = <uint32_t>(tc if tc <= U32_MAX else U32_MAX)
        r.at.num_computed += n
        if fills:
            # the chunk completed a page (the lowering listed the row): hand it to the cache
            auto_fill_lent(st.pg.s, st.pg.p, st.pg.c, st.pg.ss, <uint32_t>r.at.slot,
                           r.req.num_tokens)
        if st.plan.plan_sample[j] < 0:
            continue
        if r.mem.group >= 0 and st.ent[r.mem.group].rec.beam:
            # a beam row: its candidates wait for the group's selection
            g = r.mem.group
            w = st.ent[g].mem.n_members
            src = <size_t>st.plan.plan_sample[j] * k
            dst = <size_t>e * st.lim.max_seqs
            for c in range(w):
                st.beams.cand_ids[dst + c] = tk_ids[src + c]
                st.beams.cand_lps[dst + c] = (tk_lps[src + c] if tk_lps != NULL
                                              else tk_lps_f[src + c])
            r.mem.has_cand = 1
            if not st.ent[g].mem.in_sel:
                st.ent[g].mem.in_sel = 1
                st.beams.sel_groups[st.beams.n_sel_groups] = g
                st.beams.n_sel_groups += 1
            continue
        if r.mem.group == e and not r.mem.forked:
            rc = step_fork_n(st, e, &sampled[st.plan.plan_sample[j]])
        else:
            rc = step_take(st, e, sampled[st.plan.plan_sample[j]])
        if rc and first == Q_OK:
            first = rc
    # beam groups select in the order their first row appears in the plan
    for j in range(st.beams.n_sel_groups):
        g = st.beams.sel_groups[j]
        st.ent[g].mem.in_sel = 0
        rc = beam_select(st, g)
        if rc and first == Q_OK:
            first = rc
    st.beams.n_sel_groups = 0
    if st.plan.T == 0 and st.beams.beam_head >= 0:
        beam_park_blocked(st)
    # the rows of requests aborted in the plan are free again once it is applied (after the
    # forks above: a child never takes a row the executing plan may still read)
    for j in range(st.plan.n):
        if not st.plan.plan_alive[j]:
            row_clear_deferred(st, st.buf.block_table_rows[j])
    rc = release_deferred(st)
    if rc and first == Q_OK:
        first = rc
    done_unindex(st, done0)
    st.plan.pending = False
    return first


cdef int step_discard(StepState *st) noexcept nogil:
    # drop the pending plan: reserved pages stay with their requests, nothing advances.  Its
    # changed rows and finished ids are reported again by the next plan (a backend whose
    # execution failed may not have applied them), and its copies stay owed (the next plan lists
    # them first); the caller made room in fin_accum.  The requests aborted while it was pending
    # hand their pages back (a pool error: its code).
    cdef uint32_t j
    cdef int rc
    if not st.plan.pending:
        return Q_OK     # no plan: nothing to drop
    for j in range(st.plan.n):
        if st.plan.plan_alive[j]:
            st.ent[st.plan.plan_entry[j]].at.plan_pos = -1
        else:
            row_clear_deferred(st, st.buf.block_table_rows[j])
    for j in range(st.plan.n_changed):
        row_mark_dirty(st, st.buf.changed_rows[j])
    if st.plan.n_finished and st.done.n_accum + st.plan.n_finished <= st.done.accum_cap:
        memmove(&st.done.fin_accum[st.plan.n_finished], st.done.fin_accum,
                st.done.n_accum * sizeof(uint64_t))
        memcpy(st.done.fin_accum, st.buf.finished_ids, st.plan.n_finished * sizeof(uint64_t))
        st.done.n_accum += st.plan.n_finished
        accum_recount(st)
    if st.plan.n_forks and st.done.n_fork_acc + st.plan.n_forks <= st.done.fork_cap:
        # no update ran since the plan: nothing forked since, in practice
        memmove(&st.done.fork_acc[2 * st.plan.n_forks], st.done.fork_acc,
                2 * st.done.n_fork_acc * sizeof(uint64_t))
        for j in range(st.plan.n_forks):
            st.done.fork_acc[2 * j] = st.buf.fork_child_ids[j]
            st.done.fork_acc[2 * j + 1] = st.buf.fork_parent_ids[j]
        st.done.n_fork_acc += st.plan.n_forks
    st.plan.n_forks = 0
    rc = release_deferred(st)
    st.plan.pending = False
    return rc


# -- update()'s arguments: resolved with no state read, then loaded and checked under ownership

cdef tuple _resolve_topk(object topk_ids, object topk_logprobs):
    # RESOLVE update()'s candidates, reading no scheduler state: private copies (user code runs
    # here only), or the conversion's error, raised by update_load_topk only when the plan has beam
    # rows (a plan without them ignores the arguments)
    if topk_ids is None or topk_logprobs is None:
        return (None, None, None)
    try:
        return (np.array(topk_ids), np.array(topk_logprobs), None)
    except Exception as exc:
        return (None, None, exc)


cdef object update_resolve_sampled(object ids):
    # RESOLVE update()'s sampled ids, reading no scheduler state: an exact 1-D native uint32
    # ndarray is returned as it is (read in place, under ownership); anything else becomes
    # a private list of exact ints (user code -- __index__, iterators -- runs here only).
    cdef const uint32_t *p
    cdef Py_ssize_t n
    if _u32_array(ids, &p, &n):
        return ids
    if isinstance(ids, np.ndarray):
        ids = np.asarray(ids)   # an ndarray subclass read as an ndarray: none of its methods run
        if ids.ndim != 1:
            raise ValueError(f"sampled_token_ids must be 1-D, got {ids.ndim} dimensions")
        if ids.dtype.kind not in "iu":
            raise TypeError(f"sampled_token_ids must be integers, got dtype {ids.dtype}")
        return ids.tolist()   # exact ints (ndarray's own tolist), checked under ownership
    if isinstance(ids, (str, bytes, bytearray, memoryview)):
        raise TypeError("sampled_token_ids must be a sequence of token ids")
    return [_u32(x, "sampled token id") for x in ids]


cdef int update_load_sampled(StepState *st, object values) except -1:
    # under ownership: the pending plan's length and the vocabulary checked, the ids copied
    # into step.sampled.  No user code runs: values is an exact uint32 ndarray (copied
    # first, then checked, so a thread writing the caller's array cannot slip an id past
    # the check) or a private list of exact ints.
    cdef const uint32_t *p
    cdef Py_ssize_t n, i
    cdef uint64_t limit = token_limit(st)
    if not st.plan.pending:
        raise StepError.NoPlan(None, "schedule() first")
    if type(values) is list:
        n = len(<list>values)
        if n != st.plan.m:
            raise ValueError(f"the plan samples {st.plan.m} rows, got {n} token ids")
        for x in <list>values:
            if not 0 <= x <= limit:
                raise ValueError(f"sampled token id {x} is outside [0, {limit}]")
        for i in range(n):
            st.plan.sampled[i] = <uint32_t>(<list>values)[i]
        return 0
    if not _u32_array(values, &p, &n):
        # the caller's uint32 array, read in place, was changed since it was resolved (its
        # dtype or shape, by user code: a topk argument's __array__, a gc callback)
        raise TypeError("sampled_token_ids changed while update() resolved its arguments: "
                        "pass an array that nothing changes during the call")
    if n != st.plan.m:
        raise ValueError(f"the plan samples {st.plan.m} rows, got {n} token ids")
    memcpy(st.plan.sampled, p, n * sizeof(uint32_t))
    for i in range(n):
        if st.plan.sampled[i] > limit:
            raise ValueError(f"sampled token id {st.plan.sampled[i]} is outside [0, {limit}]")
    return 0


cdef object update_load_topk(StepState *st, tuple topk):
    # under ownership, after update_load_sampled: a plan with beam rows takes [m, num_topk]
    # candidates (ids in the vocabulary, real log-probabilities, neither NaN nor +inf, a
    # beam row's first w ids distinct); returns them as private contiguous uint32 / float64
    # arrays, or None for a plan without beam rows
    cdef uint32_t k = st.plan.num_topk, m = st.plan.m, row = 0
    cdef uint64_t limit = token_limit(st)
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
