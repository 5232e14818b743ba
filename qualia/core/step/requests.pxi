# Request entries and the id index (docs/DESIGN.md, "The engine step", "Requests"): every queued
# request, n-group member, live beam and finished hypothesis holds one of max_queued entries, a
# beam group's record one of max_queued more; an open-addressing index maps request ids to them.
# Requests in (add_request) and out (abort, the finished requests collected for Python).

cdef struct StepState        # core/step/state.pxi: every concept's part, composed

from libc.stdlib cimport malloc, free


cdef enum:
    SR_FREE = 0
    SR_WAITING = 1
    SR_RUNNING = 2
    SR_FINISHED = 3     # finished inside run(), waiting to be collected
    SR_RESERVED = 4     # a child of an n group not forked yet (its id is taken)
    # SR_MEMBER_DONE: a member of an n group that stopped, its output waiting for the group; in
    # a beam group, a hypothesis (its tokens, score and reason)
    SR_MEMBER_DONE = 5
    SR_GROUP = 6        # a beam group's record (no tokens: an entry past max_queued)
    # SR_PARKED: a live beam with its candidates that holds nothing (no slot, row, pages or
    # heap position) until its group selects (docs/DESIGN.md, "Progress")
    SR_PARKED = 7


cdef enum:
    FIN_NONE = 0
    FIN_LENGTH = 1
    FIN_STOP = 2


cdef tuple _FINISH_REASONS = (None, "length", "stop")


#: Stop token ids a request may name (held inline in its entry).
MAX_STOP_TOKENS = 16


cdef enum:
    STOP_MAX = 16


# A request entry (core/step/requests.pxi): one per queued request, n-group member, live beam
# or finished hypothesis (max_queued), and past them one per beam group's record.  Its fields
# by concept: the request as added, where it is now, its group membership, a beam group's
# record, a beam's score / a hypothesis.


cdef struct StepRequest:
    # what the decode path reads of the request (32 bytes: with StepPlace, the entry's first
    # cache line)
    uint64_t rid            # first field: the id index reads it (id_find)
    uint32_t num_prompt
    uint32_t num_tokens     # prompt + outputs (in the token arena)
    uint32_t max_new
    uint32_t eos
    uint32_t n_stop
    uint8_t has_eos
    uint8_t ignore_eos
    uint8_t reason          # why it finished (FIN_*)
    uint8_t unindexed       # not in the id index (the parent beam, a hypothesis, finished)


cdef struct StepPlace:
    # where the entry is now, as the decode path reads it (32 bytes)
    uint64_t sched_step     # the step that last scheduled it
    uint32_t num_computed   # tokens whose K/V is written
    int32_t slot            # slot while running, else -1
    int32_t row             # block-table row while running, else -1
    int32_t plan_pos        # position in the pending plan, else -1
    uint8_t state           # SR_*
    uint8_t decode          # scheduled in the pending plan as a decode
    uint8_t unseen          # admitted or resumed; in no applied plan since
    uint8_t row_fresh       # forked child: its row is written whole when next lowered
    # the arena's token at num_tokens - 1: a decode's lowering reads it here, in the line it
    # reads anyway, not in the arena
    uint32_t last_token


cdef struct StepOrder:
    # the keys that order entries: the waiting queue's and the preemption victim's
    uint64_t arrival        # add_request counter: ties of equal priority, oldest first
    int64_t priority        # lower is served first
    uint64_t admitted       # admission counter: "most recently admitted" picks victims
    uint64_t enq            # enqueue number: equal (priority, arrival) -> the latest first
    int32_t heap_pos        # position in the waiting heap while waiting, else -1


cdef struct StepNames:
    # the request's namespace (auto mode) and stop ids
    uint64_t nsh            # namespace hash
    uint8_t *nsb            # namespace bytes (malloc'd; NULL when empty)
    uint32_t nsl
    uint8_t nsb_borrowed    # nsb is the leader's or the record's (freed with it)
    uint32_t stop[STOP_MAX]


cdef struct GroupMember:
    # n groups (docs/DESIGN.md, "Forks at the step level"): every member's entry is taken from
    # add_request until the group's result is collected; beam groups: the record and its beams
    int32_t group           # the leader (n) or the record (beam) of its group, -1 for none
    int32_t next_member     # the next member in member order (record: its first beam), -1
    uint32_t n_members      # leader: n; record: the width w
    uint32_t n_members_done  # leader: members stopped so far; record: hypotheses so far
    uint8_t forked          # leader: the children are forked (or queued)
    uint8_t has_cand        # live beam: its candidates are in its entry's candidate row
    uint8_t in_sel          # record: queued for selection; beam: its part in the selection


cdef struct BeamRecord:
    # a beam group's record (docs/DESIGN.md, "Beam search at the step level"): an entry past
    # max_queued (state SR_GROUP, its id the group's, group == itself); each live beam and each
    # stored hypothesis holds one of the w entries the group reserved
    uint8_t beam            # this entry is a beam group's record
    uint32_t n_spare        # reserved entries not holding a beam or hypothesis
    int32_t parent_beam     # the entry of the beam with the group's id, -1 once gone
    int32_t next_group      # beam groups in add order
    int32_t prev_group


cdef struct Hypothesis:
    double score            # live beam: cumulative log-probability; hypothesis: its score
    uint32_t hyp_seq        # hypothesis: its order of finishing (ties: earlier first)
    int32_t next_hyp        # record: its first hypothesis; hypothesis: the next one


cdef struct StepEntry:
    # the fields a decode reads first (req, at: one 64-byte line of a 64-byte aligned entry,
    # see entries_alloc), then its group; 256 bytes on 64-bit platforms
    StepRequest req
    StepPlace at
    GroupMember mem
    BeamRecord rec
    Hypothesis hyp
    StepOrder ord
    StepNames names
    uint64_t _pad


cdef struct StepIds:
    # the id index over the entries, the free entries and what they are promised to
    int32_t *index          # request id -> entry (open addressing)
    uint32_t index_mask
    int32_t *free_ids       # stack of free entries
    uint32_t n_free
    int32_t *rec_free       # stack of free record entries (max_queued .. 2 * max_queued)
    uint32_t n_rec_free
    uint32_t reserved       # entries promised to beam groups (spares), not in use
    uint32_t count          # waiting + running
    uint64_t arrivals       # add_request counter
    uint64_t next_child     # the next internal child id to try (from 2**63 up)


cdef inline uint32_t _step_home(StepState *st, uint64_t rid) noexcept nogil:
    return id_home(rid, st.ids.index_mask)


cdef uint32_t _step_home_of(void *ctx, int32_t e) noexcept nogil:
    cdef StepState *st = <StepState *>ctx
    return id_home(st.ent[e].req.rid, st.ids.index_mask)


cdef inline int32_t step_find(StepState *st, uint64_t rid) noexcept nogil:
    return id_find(st.ids.index, st.ids.index_mask, st.ent, sizeof(StepEntry), rid)


cdef inline bint child_id_taken(StepState *st, uint64_t rid) noexcept nogil:
    # a child id skips every id the step holds, every id a slot still holds (a request aborted
    # in the pending plan has left the step's index, but its slot keeps its id until the plan
    # is retired: release_deferred) and every id the next plan reports finished (a backend
    # applies a plan's forks before its finished ids: a child under such an id would lose the
    # state it was just given)
    return step_find(st, rid) >= 0 or sched_find(st.pg.s, rid) >= 0 or accum_holds(st, rid)


cdef inline void entry_unindex(StepState *st, int32_t e) noexcept nogil:
    # entry e's id leaves the id index, once (a beam hypothesis at once, what finished at the
    # end of its update, any entry when it is freed)
    if not st.ent[e].req.unindexed:
        oa_remove(st.ids.index, st.ids.index_mask, _step_home(st, st.ent[e].req.rid), e,
                  _step_home_of, st)
        st.ent[e].req.unindexed = 1


cdef void entry_free(StepState *st, int32_t e) noexcept nogil:
    # forget the entry: id index, namespace reference, stop ids
    cdef StepEntry *r = &st.ent[e]
    entry_unindex(st, e)
    r.req.unindexed = 0
    if r.names.nsb != NULL and not r.names.nsb_borrowed:
        free(r.names.nsb)
    r.names.nsb = NULL
    r.at.state = SR_FREE
    if <uint32_t>e >= st.lim.max_queued:
        st.ids.rec_free[st.ids.n_rec_free] = e
        st.ids.n_rec_free += 1
        return
    st.ids.free_ids[st.ids.n_free] = e
    st.ids.n_free += 1


cdef int step_add(StepState *st, uint64_t rid, const uint32_t *tok, uint32_t n,
                  uint32_t max_new, int64_t priority, bint has_eos, uint32_t eos,
                  const uint32_t *stop, uint32_t n_stop, bint ignore_eos, uint8_t *nsb,
                  uint32_t nsl, uint64_t nsh, uint32_t num_blocks,
                  uint32_t n_members, uint32_t beam_width) noexcept nogil:
    # Queue a request (the twin's checks, in its order).  On success the entry owns nsb.  With
    # n_members > 1 the request leads an n group: n_members - 1 more entries are taken for its
    # children now (state SR_RESERVED, ids from 2**63 up, skipping ids in use).
    cdef uint64_t total = <uint64_t>n + max_new
    cdef uint64_t pages, cid
    cdef int32_t e, c, prev
    cdef uint32_t k
    cdef StepEntry *r
    cdef StepEntry *ch
    if step_find(st, rid) >= 0:
        return Q_STEP_DUPLICATE
    if total > st.arena.entry_cap:
        return Q_NEVER_FITS
    pages = (total - 1 + st.lim.page_tokens - 1) // st.lim.page_tokens
    if pages > num_blocks:
        return Q_NEVER_FITS
    if st.ids.n_free - st.ids.reserved < (beam_width if beam_width else n_members):
        return Q_QUEUE_FULL
    st.ids.n_free -= 1
    e = st.ids.free_ids[st.ids.n_free]
    r = &st.ent[e]
    memset(r, 0, sizeof(StepEntry))
    r.req.rid = rid
    r.ord.arrival = st.ids.arrivals
    st.ids.arrivals += 1
    r.ord.priority = priority
    r.names.nsh = nsh
    r.names.nsb = nsb
    r.names.nsl = nsl
    r.req.num_prompt = n
    r.req.num_tokens = n
    r.req.max_new = max_new
    r.req.has_eos = has_eos
    r.req.eos = eos
    r.req.ignore_eos = ignore_eos
    r.req.n_stop = n_stop
    if n_stop:
        memcpy(r.names.stop, stop, n_stop * sizeof(uint32_t))
    r.at.slot = -1
    r.at.row = -1
    r.ord.heap_pos = -1
    r.at.plan_pos = -1
    r.mem.group = -1
    r.mem.next_member = -1
    memcpy(arena_at(st, e), tok, <size_t>n * sizeof(uint32_t))
    r.at.last_token = tok[n - 1] if n else 0
    if beam_width:
        # the group's record holds the id (and the namespace); the parent beam is one of the w
        # entries, the other w - 1 are reserved
        st.ids.n_rec_free -= 1
        c = st.ids.rec_free[st.ids.n_rec_free]
        st.ent[c] = r[0]
        ch = &st.ent[c]
        ch.at.state = SR_GROUP
        ch.mem.group = c
        ch.rec.beam = 1
        ch.mem.n_members = beam_width
        ch.rec.n_spare = beam_width - 1
        ch.mem.next_member = e
        ch.hyp.next_hyp = -1
        ch.rec.parent_beam = e
        ch.rec.next_group = -1
        ch.rec.prev_group = st.beams.beam_tail
        if st.beams.beam_tail >= 0:
            st.ent[st.beams.beam_tail].rec.next_group = c
        else:
            st.beams.beam_head = c
        st.beams.beam_tail = c
        st.ids.reserved += beam_width - 1
        r.mem.group = c
        r.names.nsb_borrowed = r.names.nsb != NULL
        r.req.unindexed = 1
        oa_insert(st.ids.index, st.ids.index_mask, _step_home(st, rid), c)
    else:
        oa_insert(st.ids.index, st.ids.index_mask, _step_home(st, rid), e)
    st.ids.count += 1
    heap_push(st, e)
    if n_members > 1:
        r.mem.group = e
        r.mem.n_members = n_members
        prev = e
        for k in range(1, n_members):
            cid = st.ids.next_child
            st.ids.next_child += 1
            while child_id_taken(st, cid):
                cid = st.ids.next_child
                st.ids.next_child += 1
            st.ids.n_free -= 1
            c = st.ids.free_ids[st.ids.n_free]
            ch = &st.ent[c]
            ch[0] = st.ent[e]
            ch.req.rid = cid
            ch.names.nsb_borrowed = ch.names.nsb != NULL
            ch.ord.heap_pos = -1
            ch.mem.next_member = -1
            ch.mem.n_members = 0
            ch.at.state = SR_RESERVED
            oa_insert(st.ids.index, st.ids.index_mask, _step_home(st, cid), c)
            st.ent[prev].mem.next_member = c
            prev = c
    return Q_OK


cdef int step_abort_one(StepState *st, int32_t e) noexcept nogil:
    # a waiting or running entry leaves the queues (its entry is freed by the caller)
    cdef int rc = Q_OK
    if st.ent[e].at.state == SR_RUNNING:
        if st.plan.pending and st.ent[e].at.plan_pos >= 0:
            # the pending plan may be executing: its pages stay held by the slot and its
            # block-table row keeps them, until update() or discard_plan() retires the plan
            # (release_deferred, row_clear_deferred); nothing allocates them meanwhile
            st.plan.plan_alive[st.ent[e].at.plan_pos] = 0
            st.run.row_owner[st.ent[e].at.row] = ROW_DEFERRED
            st.ent[e].at.row = -1
            st.plan.deferred_slot[st.plan.n_deferred] = st.ent[e].at.slot
            st.plan.n_deferred += 1
            st.ent[e].at.slot = -1
        else:
            rc = slot_release(st, e)
            row_release(st, e)
        running_remove(st, e)
    elif st.ent[e].at.state == SR_WAITING:
        heap_remove(st, e)
    st.ids.count -= 1
    accum_finished(st, st.ent[e].req.rid)
    return rc


cdef int step_abort(StepState *st, uint64_t rid) noexcept nogil:
    # a waiting or running request, or an n group by its parent's id (every member still
    # queued or running, in member order); a member alone is refused.  The caller made room
    # in fin_accum.
    cdef int32_t e = step_find(st, rid), c, nxt
    cdef int rc = Q_OK, r2
    if e < 0 or st.ent[e].at.state == SR_FINISHED:
        return Q_STEP_UNKNOWN
    if st.ent[e].mem.group >= 0 and st.ent[e].mem.group != e:
        return Q_STEP_UNKNOWN       # a member of a group: abort the group
    if st.ent[e].mem.group != e:
        rc = step_abort_one(st, e)
        entry_free(st, e)
        return rc
    if st.ent[e].rec.beam:
        # a beam group: its live beams in member order, then every entry it holds
        c = st.ent[e].mem.next_member
        while c >= 0:
            r2 = step_abort_one(st, c)
            if r2 and rc == Q_OK:
                rc = r2
            c = st.ent[c].mem.next_member
        beam_group_free(st, e)
        return rc
    c = e
    while c >= 0:
        if st.ent[c].at.state == SR_RUNNING or st.ent[c].at.state == SR_WAITING:
            r2 = step_abort_one(st, c)
            if r2 and rc == Q_OK:
                rc = r2
        c = st.ent[c].mem.next_member
    c = e
    while c >= 0:
        nxt = st.ent[c].mem.next_member
        entry_free(st, c)
        c = nxt
    return rc


cdef list step_collect(StepState *st):
    """FinishedRequest (FinishedGroup for an n group) for every entry in st.done.ents, in order;
    the entries are freed."""
    cdef list out = []
    cdef uint32_t k
    cdef int32_t e
    cdef StepEntry *r
    cdef int32_t c, nxt
    for k in range(st.done.n):
        e = st.done.ents[k]
        r = &st.ent[e]
        if r.rec.beam:
            # a beam group: the hypotheses best first (ties: finished first first)
            hyps = []
            c = r.hyp.next_hyp
            while c >= 0:
                hyps.append((-st.ent[c].hyp.score, st.ent[c].hyp.hyp_seq, c))
                c = st.ent[c].hyp.next_hyp
            hyps.sort()
            out.append(FinishedGroup(
                r.req.rid, [_step_output(st, h[2]) for h in hyps],
                [_FINISH_REASONS[st.ent[h[2]].req.reason] for h in hyps],
                [st.ent[h[2]].hyp.score for h in hyps], []))
        elif r.mem.group == e:
            # an n group: the members' outputs in member order
            outs, reasons, ids = [], [], []
            c = e
            while c >= 0:
                outs.append(_step_output(st, c))
                reasons.append(_FINISH_REASONS[st.ent[c].req.reason])
                ids.append(st.ent[c].req.rid)
                c = st.ent[c].mem.next_member
            out.append(FinishedGroup(r.req.rid, outs, reasons, None, ids))
        else:
            out.append(FinishedRequest(r.req.rid, _step_output(st, e),
                                       _FINISH_REASONS[r.req.reason]))
    for k in range(st.done.n):
        e = st.done.ents[k]
        if st.ent[e].rec.beam:
            beam_group_free(st, e)
        elif st.ent[e].mem.group == e:
            c = e
            while c >= 0:
                nxt = st.ent[c].mem.next_member
                entry_free(st, c)
                c = nxt
        else:
            entry_free(st, e)
    st.done.n = 0
    return out
