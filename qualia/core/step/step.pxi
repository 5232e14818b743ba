# The engine step (docs/DESIGN.md, "The engine step"): requests queued in C with their tokens
# in an arena sized at construction, a waiting heap and a running list, one step planned under
# a token budget (schedule), its sampled tokens applied (update), and the plan's kernel-ready
# metadata written into buffers sized once.
#
# Built on the facade's primitives, in the order the pure-Python twin (qualia/twin_step.py)
# uses them: admission (auto_admit with its automatic prefix hit, or the seed's plain admit in
# mode "off"), page reservation (facade_make_room + facade_make_writable: reclaim, then
# copy-on-write / allocate), advance (token_count += n and auto_fill), noting a sampled token
# into the slot's stream (auto_note_token) and finish (auto_finish, which hands the pages to the
# cache).  So physical pages agree with the twin's by construction.
#
# step_schedule and step_update are `noexcept nogil` and return status codes: Scheduler.run()
# loops schedule -> execute -> update without the GIL for a C step backend.

from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC
from libc.stdlib cimport malloc, free
from libc.math cimport NAN

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
    ROW_DEFERRED = -2   # row_owner of a row whose request was aborted in the pending plan

cdef enum:
    FIN_NONE = 0
    FIN_LENGTH = 1
    FIN_STOP = 2

cdef tuple _FINISH_REASONS = (None, "length", "stop")

#: Stop token ids a request may name (held inline in its entry).
MAX_STOP_TOKENS = 16
cdef enum:
    STOP_MAX = 16


cdef struct StepReq:
    uint64_t rid
    uint64_t arrival        # add_request counter: ties of equal priority, oldest first
    uint64_t admitted       # admission counter: "most recently admitted" picks victims
    int64_t priority        # lower is served first
    uint64_t nsh            # namespace hash (auto mode)
    uint8_t *nsb            # namespace bytes (malloc'd; NULL when empty)
    uint32_t nsl
    uint32_t num_prompt
    uint32_t num_tokens     # prompt + outputs
    uint32_t num_computed   # tokens whose K/V is written
    uint32_t max_new
    uint32_t eos
    uint32_t n_stop
    uint32_t stop[STOP_MAX]
    int32_t slot            # facade slot while running, else -1
    int32_t row             # block-table row while running, else -1
    int32_t heap_pos        # position in the waiting heap while waiting, else -1
    int32_t plan_pos        # position in the pending plan, else -1
    uint64_t sched_step     # the step that last scheduled it
    uint8_t has_eos
    uint8_t ignore_eos
    uint8_t state
    uint8_t reason
    uint8_t decode          # scheduled in the pending plan as a decode
    # n groups (docs/DESIGN.md, "Forks at the step level"): every member's entry is taken from
    # add_request until the group's result is collected
    int32_t group           # the leader (parent) entry of its n group, -1 for none
    int32_t next_member     # the next member in member order, -1 after the last
    uint32_t n_members      # leader: k
    uint32_t n_members_done  # leader: members stopped so far
    uint8_t forked          # leader: the children are forked (or queued)
    uint8_t row_fresh       # forked child: its row is written whole when next lowered
    uint8_t nsb_borrowed    # nsb is the leader's (freed with it)
    uint8_t unseen          # admitted or resumed; in no applied plan since
    uint64_t enq            # enqueue number: equal (priority, arrival) -> the latest first
    # beam groups (docs/DESIGN.md, "Beam search at the step level"): the group's record is an
    # entry past max_queued (state SR_GROUP, its id the group's, group == itself, beam = 1,
    # n_members = width, n_members_done = hypotheses so far); each live beam and each stored
    # hypothesis holds one of the w entries the group reserved (group == the record)
    uint8_t beam            # record: a beam group
    uint8_t has_cand        # live beam: its candidates are in its entry's candidate buffer
    uint8_t unindexed       # not in the id index (the parent beam, a hypothesis)
    uint8_t in_sel          # record: queued for selection in this update
    double score            # live beam: cumulative log-probability; hypothesis: its score
    uint32_t hyp_seq        # hypothesis: its order of finishing (ties: earlier first)
    uint32_t n_spare        # record: reserved entries not holding a beam or hypothesis
    int32_t next_hyp        # record: first hypothesis; hypothesis: the next one
    int32_t parent_beam     # record: the entry of the beam with the group's id, -1 once gone
    int32_t next_group      # record: the next beam group in add order
    int32_t prev_group


cdef struct SelCand:
    double score
    uint32_t rank
    uint32_t tok
    int32_t beam            # its beam's entry
    int32_t dest            # update: the entry that takes it (continuing beam or hypothesis)
    uint8_t reason          # FIN_NONE: continues


# One row of STEP_STATS (qualia._types): twelve uint32 fields, no padding.
cdef struct StepStat:
    uint32_t num_seqs
    uint32_t num_tokens
    uint32_t num_prefill_tokens
    uint32_t num_decode_tokens
    uint32_t num_sampled
    uint32_t num_new
    uint32_t num_preempted
    uint32_t num_cached_tokens
    uint32_t num_finished
    uint32_t num_waiting
    uint32_t num_running
    uint32_t free_pages

if STEP_STATS.itemsize != sizeof(StepStat) or any(
        STEP_STATS.fields[name][0] != np.dtype("<u4") or STEP_STATS.fields[name][1] != 4 * k
        for k, name in enumerate(STEP_STATS.names)):
    raise ImportError("qualia._types.STEP_STATS does not match the core's StepStat")


cdef struct StepState:
    # limits
    uint32_t budget         # max_num_batched_tokens
    uint32_t max_seqs       # max_num_seqs: rows of the block table, requests of a plan
    uint32_t max_chunk      # max_prefill_chunk (0: only the budget limits a chunk)
    uint32_t max_queued
    uint32_t entry_cap      # tokens of one arena entry = logical_pages * page_tokens
    uint32_t page_tokens
    uint32_t logical_pages
    uint64_t vocab          # 0: any uint32 id
    int mode
    # the facade's state
    Sched *s
    Pool *p
    PageCache *c
    Streams *ss
    Undo *undo
    qualia_copy_op *cow     # the facade's copies scratch (one reservation)
    uint64_t *pages_copied
    uint64_t *pages_allocated
    # requests
    StepReq *req            # max_queued
    uint32_t *arena         # max_queued x entry_cap
    int32_t *free_ids       # stack of free entries
    uint32_t n_free
    int32_t *index          # request id -> entry (open addressing)
    uint32_t index_mask
    uint64_t arrivals
    uint64_t admissions
    uint32_t count          # waiting + running
    int32_t *heap           # waiting, by (priority, arrival)
    uint32_t n_waiting
    int32_t *running        # admission order
    uint32_t n_running
    int32_t *row_owner      # max_seqs: entry holding each row, -1 when free
    uint8_t *row_dirty      # max_seqs: rewritten since the previous plan
    uint32_t *row_len       # max_seqs: leading entries of the row that may be set
    int32_t *order          # max_seqs: scratch, this step's running order
    # the plan
    uint64_t step_no
    bint pending
    uint32_t n              # scheduled requests
    uint32_t T              # scheduled tokens
    uint32_t m              # sampled rows
    uint32_t n_changed
    uint32_t n_kv
    uint32_t n_copies
    uint32_t copies_cap
    uint32_t n_new
    uint32_t n_preempted
    uint32_t n_finished     # finished ids of the plan (copied from the accumulator)
    uint32_t num_prefill_tokens
    uint32_t num_decode_tokens
    uint32_t num_cached_tokens
    int32_t *plan_entry     # max_seqs
    uint32_t *plan_chunk    # max_seqs
    int32_t *plan_sample    # max_seqs: sampled row or -1
    uint8_t *plan_alive     # max_seqs: 0 once aborted after schedule
    # slots of requests aborted while in the pending plan, in abort order: their pages stay
    # held (a kernel may be executing the plan) until update() or discard_plan() retires it
    int32_t *deferred_slot  # max_seqs
    uint32_t n_deferred
    uint64_t *request_ids
    int32_t *query_start_loc
    int32_t *seq_lens
    uint32_t *input_ids
    int32_t *positions
    int64_t *slot_mapping
    int32_t *logits_indices
    uint64_t *sampled_request_ids
    int32_t *block_table
    int32_t *block_table_rows
    int32_t *changed_rows
    int32_t *kv_indptr
    int32_t *kv_indices
    int32_t *kv_last_page_len
    qualia_copy_op *copies
    uint64_t *new_ids
    uint64_t *preempted_ids
    uint64_t *fork_child_ids  # the plan's forks since the previous plan: children...
    uint64_t *fork_parent_ids  # ...and their parents
    uint32_t n_forks
    uint64_t *fork_acc      # forks since the previous plan: (child, parent) pairs, accum_cap
    uint32_t n_fork_acc
    uint64_t *finished_ids  # the plan's copy
    uint32_t finished_cap
    uint64_t *fin_accum     # finished or aborted since the previous plan
    uint32_t n_accum
    uint32_t accum_cap
    # finished requests not yet handed to Python (entries in state SR_FINISHED)
    int32_t *done
    uint32_t n_done
    uint32_t *sampled       # max_queued: update()'s validated sampled ids
    uint32_t rows_cap       # sampled rows a plan may have (max_queued: one per member entry)
    uint64_t next_child     # the next internal child id to try (from 2**63 up)
    uint64_t enqueues       # heap_push counter
    uint64_t forks          # children forked
    uint64_t fork_fallbacks  # children queued for lack of a slot or row
    # beam groups
    uint32_t reserved       # entries promised to beam groups (spares), not in use
    int32_t *rec_free       # stack of free record entries (max_queued .. 2 * max_queued)
    uint32_t n_rec_free
    int32_t beam_head       # beam group records in add order
    int32_t beam_tail
    uint32_t num_topk       # the pending plan's candidates per row (0: no beam row)
    uint32_t *cand_ids      # max_queued x max_seqs, by entry: a computed beam's candidates
    double *cand_lps        # their log-probabilities (both allocated with the first beam group)
    SelCand *sel            # max_seqs: the kept candidates of one selection
    int32_t *sel_groups     # max_seqs: groups with a beam row in the plan being applied
    uint32_t n_sel_groups
    uint64_t parked         # beams parked (docs/DESIGN.md)
    uint32_t *topk_ids_buf  # run() with a C backend: the backend's candidates
    float *topk_lps_buf
    size_t topk_cap


cdef inline uint64_t _now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <uint64_t>ts.tv_sec * 1000000000 + <uint64_t>ts.tv_nsec


cdef extern from *:
    """
    #include <time.h>
    #ifdef CLOCK_MONOTONIC_COARSE
    #define QUALIA_CLOCK_COARSE CLOCK_MONOTONIC_COARSE
    #else
    #define QUALIA_CLOCK_COARSE CLOCK_MONOTONIC
    #endif
    """
    int QUALIA_CLOCK_COARSE


cdef inline uint64_t _coarse_now_ns() noexcept nogil:
    # the monotonic clock at the kernel tick's resolution (a few ms) where there is one: a few
    # ns a read, cheap enough for every step of run()'s C loop
    cdef timespec ts
    clock_gettime(QUALIA_CLOCK_COARSE, &ts)
    return <uint64_t>ts.tv_sec * 1000000000 + <uint64_t>ts.tv_nsec


# -- facade primitives without the GIL (Scheduler.reserve/decode call the same functions) ------

cdef int facade_make_writable(Sched *s, Pool *p, Undo *undo, qualia_copy_op *copies,
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


cdef int facade_make_room(Sched *s, Pool *p, PageCache *c, int32_t index, uint32_t first,
                          uint32_t last) noexcept nogil:
    # reserve (automatic mode): reclaim what the call will allocate, or fail before changing
    # anything
    cdef uint64_t need = 0
    cdef int rc = auto_need_pages(&s.slots[index].blocks, first, last, p, c, &need)
    if rc:
        return rc
    return pc_make_room(c, p, need)


# -- entries, the id index, the waiting heap, rows ----------------------------------------------

cdef inline uint32_t _step_home(StepState *st, uint64_t rid) noexcept nogil:
    return id_home(rid, st.index_mask)


cdef uint32_t _step_home_of(void *ctx, int32_t e) noexcept nogil:
    cdef StepState *st = <StepState *>ctx
    return id_home(st.req[e].rid, st.index_mask)


cdef inline int32_t step_find(StepState *st, uint64_t rid) noexcept nogil:
    return id_find(st.index, st.index_mask, st.req, sizeof(StepReq), rid)


cdef inline bint _before(StepState *st, int32_t a, int32_t b) noexcept nogil:
    # waiting order: (priority, arrival)
    if st.req[a].priority != st.req[b].priority:
        return st.req[a].priority < st.req[b].priority
    if st.req[a].arrival != st.req[b].arrival:
        return st.req[a].arrival < st.req[b].arrival
    # members of a group share their arrival: the one enqueued last goes first (the twin
    # inserts before equal keys)
    return st.req[a].enq > st.req[b].enq


cdef inline void _heap_set(StepState *st, uint32_t i, int32_t e) noexcept nogil:
    st.heap[i] = e
    st.req[e].heap_pos = <int32_t>i


cdef void _heap_up(StepState *st, uint32_t i) noexcept nogil:
    cdef int32_t e = st.heap[i]
    cdef uint32_t parent
    while i > 0:
        parent = (i - 1) >> 1
        if not _before(st, e, st.heap[parent]):
            break
        _heap_set(st, i, st.heap[parent])
        i = parent
    _heap_set(st, i, e)


cdef void _heap_down(StepState *st, uint32_t i) noexcept nogil:
    cdef int32_t e = st.heap[i]
    cdef uint32_t child
    while True:
        child = 2 * i + 1
        if child >= st.n_waiting:
            break
        if child + 1 < st.n_waiting and _before(st, st.heap[child + 1], st.heap[child]):
            child += 1
        if not _before(st, st.heap[child], e):
            break
        _heap_set(st, i, st.heap[child])
        i = child
    _heap_set(st, i, e)


cdef void heap_push(StepState *st, int32_t e) noexcept nogil:
    st.req[e].state = SR_WAITING
    st.enqueues += 1
    st.req[e].enq = st.enqueues
    _heap_set(st, st.n_waiting, e)
    st.n_waiting += 1
    _heap_up(st, st.n_waiting - 1)


cdef void heap_remove(StepState *st, int32_t e) noexcept nogil:
    cdef uint32_t i = <uint32_t>st.req[e].heap_pos
    cdef int32_t last
    st.n_waiting -= 1
    st.req[e].heap_pos = -1
    if i == st.n_waiting:
        return
    last = st.heap[st.n_waiting]
    _heap_set(st, i, last)
    _heap_up(st, i)
    _heap_down(st, <uint32_t>st.req[last].heap_pos)


cdef void running_remove(StepState *st, int32_t e) noexcept nogil:
    cdef uint32_t i = 0
    while i < st.n_running and st.running[i] != e:
        i += 1
    if i == st.n_running:
        return
    memmove(&st.running[i], &st.running[i + 1], (st.n_running - i - 1) * sizeof(int32_t))
    st.n_running -= 1


cdef void row_release(StepState *st, int32_t e) noexcept nogil:
    # the row is cleared to -1 (a change when it held pages) and freed
    cdef int32_t r = st.req[e].row
    cdef int32_t *row
    cdef uint32_t k
    if r < 0:
        return
    row = &st.block_table[<size_t>r * st.logical_pages]
    if st.row_len[r]:
        for k in range(st.row_len[r]):
            row[k] = -1
        st.row_len[r] = 0
        st.row_dirty[r] = 1
    st.row_owner[r] = -1
    st.req[e].row = -1


cdef inline int32_t row_lowest_free(StepState *st) noexcept nogil:
    cdef uint32_t r
    for r in range(st.max_seqs):
        if st.row_owner[r] == -1:
            return <int32_t>r
    return -1


cdef void row_clear_deferred(StepState *st, int32_t r) noexcept nogil:
    # the row of a request aborted while in the pending plan, now that the plan is done
    cdef int32_t *row = &st.block_table[<size_t>r * st.logical_pages]
    cdef uint32_t k
    if st.row_owner[r] != ROW_DEFERRED:
        return
    if st.row_len[r]:
        for k in range(st.row_len[r]):
            row[k] = -1
        st.row_len[r] = 0
        st.row_dirty[r] = 1
    st.row_owner[r] = -1


cdef void row_write(StepState *st, int32_t e, uint32_t first, uint32_t last) noexcept nogil:
    # the row of entry e mirrors its slot's pages first..last (inclusive); marked when it changed
    cdef int32_t r = st.req[e].row
    cdef Table *t = &st.s.slots[st.req[e].slot].blocks
    cdef int32_t *row = &st.block_table[<size_t>r * st.logical_pages]
    cdef uint32_t k
    cdef int32_t v
    if last >= t.len:
        last = t.len - 1 if t.len else 0
    if t.len:
        for k in range(first, last + 1):
            v = <int32_t>t.entries[k]
            if row[k] != v:
                row[k] = v
                st.row_dirty[r] = 1
    st.row_len[r] = t.len


cdef void accum_finished(StepState *st, uint64_t rid) noexcept nogil:
    # the caller made room (abort grows the buffer with the GIL; update needs at most max_seqs)
    if st.n_accum < st.accum_cap:
        st.fin_accum[st.n_accum] = rid
        st.n_accum += 1


cdef inline int slot_finish(StepState *st, int32_t slot) noexcept nogil:
    # facade finish: release the slot's pages (auto mode: into the cache) and free the slot
    if st.mode == MODE_AUTO:
        return auto_finish(st.s, st.p, st.c, st.ss, slot)
    return sched_finish(st.s, slot, st.p)


cdef int slot_release(StepState *st, int32_t e) noexcept nogil:
    cdef int rc = slot_finish(st, st.req[e].slot)
    st.req[e].slot = -1
    return rc


cdef int release_deferred(StepState *st) noexcept nogil:
    # the plan is retired (applied or discarded): the slots of the requests aborted while it
    # was pending hand their pages back now, in abort order
    cdef uint32_t k
    cdef int rc, first = Q_OK
    for k in range(st.n_deferred):
        rc = slot_finish(st, st.deferred_slot[k])
        if rc and first == Q_OK:
            first = rc
    st.n_deferred = 0
    return first


cdef void entry_free(StepState *st, int32_t e) noexcept nogil:
    # forget the entry: id index, namespace reference, stop ids
    cdef StepReq *r = &st.req[e]
    if not r.unindexed:
        oa_remove(st.index, st.index_mask, _step_home(st, r.rid), e, _step_home_of, st)
    r.unindexed = 0
    if r.nsb != NULL and not r.nsb_borrowed:
        free(r.nsb)
    r.nsb = NULL
    r.state = SR_FREE
    if <uint32_t>e >= st.max_queued:
        st.rec_free[st.n_rec_free] = e
        st.n_rec_free += 1
        return
    st.free_ids[st.n_free] = e
    st.n_free += 1


# -- schedule --------------------------------------------------------------------------------

cdef int step_reserve(StepState *st, int32_t e, uint32_t n) noexcept nogil:
    # the facade's reserve of the next n positions of entry e (reclaim, then make writable);
    # copies go to the plan, the row mirrors the pages.  On failure nothing changed.
    cdef int32_t slot = st.req[e].slot
    cdef uint64_t start = st.s.slots[slot].token_count
    cdef uint32_t first = <uint32_t>(start // st.page_tokens)
    cdef uint32_t last = <uint32_t>((start + n - 1) // st.page_tokens)
    cdef Py_ssize_t n_undo = 0, n_copies = 0, k
    cdef int rc = Q_OK
    cdef Table *t = &st.s.slots[slot].blocks
    cdef uint32_t page
    if last >= st.logical_pages:
        return Q_OUT_OF_RANGE
    if first == last and first < t.len:
        # the common decode case: a page the request already holds alone is written in place
        # (what ensure_writable would find); nothing to reclaim, allocate or rewrite
        page = t.entries[first]
        if page < st.p.num_blocks and st.p.refcount[page] == 1:
            return Q_OK
    if st.mode == MODE_AUTO:
        rc = facade_make_room(st.s, st.p, st.c, slot, first, last)
    if rc == Q_OK:
        rc = facade_make_writable(st.s, st.p, st.undo, st.cow, slot, first, last, &n_undo,
                                  &n_copies)
    if rc == Q_OK and st.n_copies + n_copies > st.copies_cap:
        rc = Q_OUTPUT_TOO_SMALL     # cannot happen: copies_cap bounds a step's pages
    if rc:
        _undo(st.s, st.p, st.undo, n_undo)
        return rc
    for k in range(n_copies):
        st.copies[st.n_copies] = st.cow[k]
        st.n_copies += 1
    st.pages_copied[0] += n_copies
    st.pages_allocated[0] += n_undo - n_copies
    if st.mode == MODE_AUTO:
        auto_after_cow(st.c, st.p, st.undo, n_undo)
    row_write(st, e, first, last)
    return Q_OK


cdef int32_t pick_victim(StepState *st, int32_t cur) noexcept nogil:
    # among running requests not yet scheduled in this step, plus the current one: the highest
    # priority value, ties -> the most recently admitted.  A computed beam waiting for its group
    # (it keeps its candidates) goes first, before anything that still computes (the twin's
    # _pick_victim)
    cdef int32_t best = -1, e
    cdef uint32_t i
    for i in range(st.n_running):
        e = st.running[i]
        if not st.req[e].has_cand:
            continue
        if best < 0 or (st.req[e].priority > st.req[best].priority
                        or (st.req[e].priority == st.req[best].priority
                            and st.req[e].admitted > st.req[best].admitted)):
            best = e
    if best >= 0:
        return best
    best = cur
    for i in range(st.n_running):
        e = st.running[i]
        if e != cur and st.req[e].sched_step == st.step_no:
            continue
        if (st.req[e].priority > st.req[best].priority
                or (st.req[e].priority == st.req[best].priority
                    and st.req[e].admitted > st.req[best].admitted)):
            best = e
    return best


cdef int leave_running(StepState *st, int32_t e) noexcept nogil:
    # release the pages (full pages stay cached in auto mode) and the row; forget the computed
    # tokens
    cdef int rc = slot_release(st, e)
    row_release(st, e)
    running_remove(st, e)
    st.req[e].num_computed = 0
    st.req[e].row_fresh = 0
    return rc


cdef inline void beam_park(StepState *st, int32_t e) noexcept nogil:
    # a computed beam out of the running list (leave_running first): it keeps its candidates
    # and waits for its group's selection outside the queues
    st.req[e].state = SR_PARKED
    st.parked += 1


cdef int preempt(StepState *st, int32_t e) noexcept nogil:
    # recompute: back to waiting with its arrival number and outputs; a computed beam is parked
    # with its candidates instead
    cdef int rc = leave_running(st, e)
    if st.req[e].has_cand:
        beam_park(st, e)
    else:
        heap_push(st, e)
    st.preempted_ids[st.n_preempted] = st.req[e].rid
    st.n_preempted += 1
    return rc


cdef inline uint32_t _chunk(StepState *st, uint32_t remaining, uint32_t left) noexcept nogil:
    cdef uint32_t n = remaining if remaining < left else left
    if remaining > 1 and st.max_chunk and n > st.max_chunk:
        n = st.max_chunk
    return n


cdef void plan_add(StepState *st, int32_t e, uint32_t n) noexcept nogil:
    cdef uint32_t j = st.n
    st.plan_entry[j] = e
    st.plan_chunk[j] = n
    st.plan_alive[j] = 1
    st.req[e].plan_pos = <int32_t>j
    st.req[e].sched_step = st.step_no
    st.n += 1


cdef int admit_waiting(StepState *st, int32_t e, uint32_t left, uint32_t *chunk,
                       uint32_t *cached) noexcept nogil:
    # The head of the waiting queue: its cache hit (auto mode), its chunk, whether its pages fit
    # (free + reclaimable, less the reclaimable pages its own hit takes); then admit, reserve,
    # take a row.  Q_EXHAUSTED when it does not fit (nothing changed).
    cdef StepReq *r = &st.req[e]
    cdef const uint32_t *tok = &st.arena[<size_t>e * st.entry_cap]
    cdef uint32_t hit = 0, k, rec = 0, n, need
    cdef int32_t row
    cdef Admission_c adm
    cdef int rc
    cdef uint64_t avail
    cdef Table *t
    if st.mode == MODE_AUTO:
        k = _probe_hit(st, e, &rec)
        hit = k * st.page_tokens
    n = _chunk(st, r.num_tokens - hit, left)
    need = <uint32_t>((hit + n - 1) // st.page_tokens + 1 - hit // st.page_tokens)
    avail = <uint64_t>st.p.free_top + st.c.n_state[PC_RECLAIMABLE] - rec
    if need > avail:
        return Q_EXHAUSTED
    row = row_lowest_free(st)
    if row < 0 or st.s.active >= st.s.max_requests:
        return Q_EXHAUSTED      # cannot happen: running < max_num_seqs <= max_requests
    # what the admission counts, for the undo below
    cdef uint64_t lookups = st.c.lookups, lookup_tokens = st.c.lookup_tokens
    cdef uint64_t hit_tokens = st.c.hit_tokens, collisions = st.c.collisions
    cdef uint64_t hashed = st.c.pages_hashed, admitted = r.admitted
    if st.mode == MODE_AUTO:
        rc = auto_admit(st.s, st.p, st.c, st.ss, r.rid, tok, r.num_tokens,
                        r.nsb if r.nsb != NULL else <const uint8_t *>"", r.nsl, r.nsh, &adm)
    else:
        rc = sched_admit(st.s, r.rid, False, 0, 0, NULL, st.p, &adm)
    if rc:
        return rc
    heap_remove(st, e)
    r.state = SR_RUNNING
    r.slot = adm.slot
    r.num_computed = adm.prefix_tokens
    r.row = row
    st.row_owner[row] = e
    st.admissions += 1
    r.admitted = st.admissions
    st.running[st.n_running] = e
    st.n_running += 1
    rc = step_reserve(st, e, n)
    if rc:
        # The fit test above promised this reservation (its hit is the admission's: one cache
        # state, read twice in one C stretch that nothing else runs in), so this is a broken
        # invariant.  Never leave a request half-admitted (running, in no plan, never named
        # new): undo the admission and report the error.  Its hit's cached pages go back to
        # the cache (reclaimable ones at the recent end of the reclaim order).
        slot_release(st, e)
        running_remove(st, e)
        st.row_owner[row] = -1
        r.row = -1
        r.num_computed = 0
        st.admissions -= 1
        r.admitted = admitted
        r.state = SR_WAITING        # back in the heap under its own (priority, arrival, enq)
        _heap_set(st, st.n_waiting, e)
        st.n_waiting += 1
        _heap_up(st, st.n_waiting - 1)
        if st.mode == MODE_AUTO:
            st.c.lookups = lookups
            st.c.lookup_tokens = lookup_tokens
            st.c.hit_tokens = hit_tokens
            st.c.collisions = collisions
            st.c.pages_hashed = hashed
        return rc
    # the row mirrors the whole table: the hit's pages and the chunk's
    t = &st.s.slots[adm.slot].blocks
    row_write(st, e, 0, t.len - 1 if t.len else 0)
    chunk[0] = n
    cached[0] = adm.prefix_tokens
    return Q_OK


cdef uint32_t _probe_hit(StepState *st, int32_t e, uint32_t *rec) noexcept nogil:
    # the pages an admission of entry e would take from the cache now, and how many of them are
    # reclaimable (cached_prefix's rule)
    cdef StepReq *r = &st.req[e]
    cdef const uint32_t *tok = &st.arena[<size_t>e * st.entry_cap]
    cdef uint32_t n = r.num_tokens
    cdef uint32_t hashed = (n - 1) // st.page_tokens if n else 0
    cdef uint32_t k, i, ns
    cdef bint collided
    rec[0] = 0
    ns = ns_find(&st.c.ns, r.nsh, r.nsb if r.nsb != NULL else <const uint8_t *>"", r.nsl)
    if ns == U32_MAX:
        return 0
    k = auto_match(st.c, tok, n, ns, r.nsh, hashed, st.ss.probe_ident, st.ss.probe_canon,
                   st.ss.probe_gen, &collided)
    for i in range(k):
        rec[0] += pc_rec(st.c, st.ss.probe_canon[i]).state == PC_RECLAIMABLE
    return k


cdef int step_schedule(StepState *st) noexcept nogil:
    cdef uint32_t i, j, nd = 0, left = st.budget, n, rem, pages, q, pos, t, hit, lp, off, run, k
    cdef int64_t sm
    cdef int32_t e, v, slot
    cdef bint preempted = False
    cdef int rc
    cdef StepReq *r
    cdef Table *tb
    cdef size_t base
    if st.pending:
        return Q_PLAN_PENDING
    st.step_no += 1
    st.n = st.T = st.m = st.n_kv = st.n_copies = st.n_new = st.n_preempted = 0
    st.num_topk = 0
    st.num_prefill_tokens = st.num_decode_tokens = st.num_cached_tokens = 0
    # 1. running requests: decodes, then prefills, each in admission order
    for i in range(st.n_running):
        e = st.running[i]
        if st.req[e].num_tokens - st.req[e].num_computed == 1:
            st.order[nd] = e
            nd += 1
    j = nd
    for i in range(st.n_running):
        e = st.running[i]
        if st.req[e].num_tokens - st.req[e].num_computed > 1:
            st.order[j] = e
            j += 1
    for i in range(j):
        e = st.order[i]
        if left == 0:
            break
        if st.req[e].state != SR_RUNNING:
            continue            # preempted earlier in this step
        rem = st.req[e].num_tokens - st.req[e].num_computed
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
        if st.req[e].state != SR_RUNNING:
            continue
        plan_add(st, e, n)
        st.req[e].decode = rem == 1
        if st.req[e].unseen:
            # admitted by a discarded plan: named until a plan with it is applied
            st.new_ids[st.n_new] = st.req[e].rid
            st.n_new += 1
        left -= n
    # 2. waiting requests by (priority, arrival), unless this step preempted
    if not preempted:
        while st.n_waiting and left > 0 and st.n_running < st.max_seqs:
            e = st.heap[0]
            rc = admit_waiting(st, e, left, &n, &hit)
            if rc == Q_EXHAUSTED:
                break
            if rc == Q_NAMESPACES_FULL and st.n_running:
                break           # running requests will free namespace ids
            if rc:
                # the admission changed nothing (admit_waiting undoes its own); the requests
                # this step scheduled before it keep their pages, as after discard_plan()
                return rc
            st.req[e].unseen = 1
            st.new_ids[st.n_new] = st.req[e].rid
            st.n_new += 1
            st.num_cached_tokens += hit
            plan_add(st, e, n)
            st.req[e].decode = 0
            left -= n
    # 3. metadata, in plan order
    st.query_start_loc[0] = 0
    st.kv_indptr[0] = 0
    for j in range(st.n):
        e = st.plan_entry[j]
        r = &st.req[e]
        n = st.plan_chunk[j]
        q = r.num_computed
        slot = r.slot
        tb = &st.s.slots[slot].blocks
        st.request_ids[j] = r.rid
        st.seq_lens[j] = <int32_t>(q + n)
        st.block_table_rows[j] = r.row
        memcpy(&st.input_ids[st.T], &st.arena[<size_t>e * st.entry_cap + q],
               n * sizeof(uint32_t))
        # positions and slot mapping, a page at a time (no division per token)
        pos = q
        t = st.T
        lp = q // st.page_tokens
        off = q - lp * st.page_tokens
        while pos < q + n:
            sm = <int64_t>tb.entries[lp] * st.page_tokens
            run = st.page_tokens - off
            if run > q + n - pos:
                run = q + n - pos
            for k in range(run):
                st.positions[t + k] = <int32_t>(pos + k)
                st.slot_mapping[t + k] = sm + off + k
            pos += run
            t += run
            lp += 1
            off = 0
        if r.decode:
            st.num_decode_tokens += n
        else:
            st.num_prefill_tokens += n
        st.T += n
        st.query_start_loc[j + 1] = <int32_t>st.T
        if r.row_fresh:
            # a forked child's first plan: its row takes the whole table (the twin's lowering
            # writes every page of a scheduled request's row)
            row_write(st, e, 0, tb.len - 1 if tb.len else 0)
            r.row_fresh = 0
        if q + n == r.num_tokens:
            st.plan_sample[j] = <int32_t>st.m
            if r.group == e and not r.forked:
                # the prompt's last row, once per member of the n group, in member order
                v = e
                while v >= 0:
                    st.logits_indices[st.m] = <int32_t>(st.T - 1)
                    st.sampled_request_ids[st.m] = st.req[v].rid
                    st.m += 1
                    v = st.req[v].next_member
            else:
                st.logits_indices[st.m] = <int32_t>(st.T - 1)
                st.sampled_request_ids[st.m] = r.rid
                st.m += 1
                if r.group >= 0 and st.req[r.group].beam and \
                        st.req[r.group].n_members > st.num_topk:
                    st.num_topk = st.req[r.group].n_members
        else:
            st.plan_sample[j] = -1
        pages = (q + n + st.page_tokens - 1) // st.page_tokens
        # page ids are < num_blocks <= 2**32-1 and a pool is far smaller than 2**31 pages in
        # practice; the int32 view of the same bits is what kernels take
        memcpy(&st.kv_indices[st.n_kv], tb.entries, pages * sizeof(int32_t))
        st.n_kv += pages
        st.kv_indptr[j + 1] = <int32_t>st.n_kv
        st.kv_last_page_len[j] = <int32_t>(q + n - (pages - 1) * st.page_tokens)
    st.n_changed = 0
    for i in range(st.max_seqs):
        if st.row_dirty[i]:
            st.row_dirty[i] = 0
            st.changed_rows[st.n_changed] = <int32_t>i
            st.n_changed += 1
    # the plan reports what finished or was aborted, and the forks made, since the previous plan
    memcpy(st.finished_ids, st.fin_accum, st.n_accum * sizeof(uint64_t))
    st.n_finished = st.n_accum
    st.n_accum = 0
    for i in range(st.n_fork_acc):
        st.fork_child_ids[i] = st.fork_acc[2 * i]
        st.fork_parent_ids[i] = st.fork_acc[2 * i + 1]
    st.n_forks = st.n_fork_acc
    st.n_fork_acc = 0
    st.pending = True
    return Q_OK


# -- update ----------------------------------------------------------------------------------

cdef inline bint is_stop_token(StepReq *r, uint32_t tok) noexcept nogil:
    # eos (unless ignored) or one of the request's stop ids
    cdef uint32_t k
    if r.has_eos and not r.ignore_eos and tok == r.eos:
        return True
    for k in range(r.n_stop):
        if r.stop[k] == tok:
            return True
    return False


cdef int step_take(StepState *st, int32_t e, uint32_t tok) noexcept nogil:
    # one sampled token for entry e (running, or a queued child of an n group): note it, apply
    # the stop conditions; a stopped plain request goes to st.done (SR_FINISHED), a stopped
    # member waits for its group (SR_MEMBER_DONE) and the last one puts the leader in st.done
    cdef StepReq *r = &st.req[e]
    cdef StepReq *g
    cdef uint32_t pos = r.num_tokens
    cdef uint8_t reason = FIN_NONE
    cdef int rc = Q_OK
    st.arena[<size_t>e * st.entry_cap + pos] = tok
    if st.mode == MODE_AUTO and r.state == SR_RUNNING:
        auto_note_token(st.s, st.ss, <uint32_t>r.slot, pos, tok)
    r.num_tokens += 1
    if r.num_tokens - r.num_prompt >= r.max_new:
        reason = FIN_LENGTH
    elif is_stop_token(r, tok):
        reason = FIN_STOP
    if reason == FIN_NONE:
        return Q_OK
    r.reason = reason
    if r.state == SR_RUNNING:
        rc = slot_release(st, e)
        row_release(st, e)
        running_remove(st, e)
    else:
        heap_remove(st, e)
    st.count -= 1
    accum_finished(st, r.rid)
    if r.group < 0:
        r.state = SR_FINISHED
        st.done[st.n_done] = e
        st.n_done += 1
        return rc
    r.state = SR_MEMBER_DONE
    g = &st.req[r.group]
    g.n_members_done += 1
    if g.n_members_done == g.n_members:
        g.state = SR_FINISHED
        st.done[st.n_done] = r.group
        st.n_done += 1
    return rc


cdef int step_spawn(StepState *st, int32_t pe, int32_t ce) noexcept nogil:
    # child entry ce of the running parent pe, with the parent's tokens so far: forked (a slot
    # and a row are free) or queued as an ordinary request (admitted later through the cache)
    cdef StepReq *par = &st.req[pe]
    cdef StepReq *ch = &st.req[ce]
    cdef int32_t row = row_lowest_free(st), slot = -1
    cdef Slot *ps
    cdef int rc
    memcpy(&st.arena[<size_t>ce * st.entry_cap], &st.arena[<size_t>pe * st.entry_cap],
           <size_t>par.num_tokens * sizeof(uint32_t))
    ch.num_tokens = par.num_tokens
    st.count += 1
    if par.state == SR_RUNNING and row >= 0 and st.s.active < st.s.max_requests:
        ps = &st.s.slots[par.slot]
        if ps.state != QUALIA_STATE_DECODE:
            # fork takes decoding requests only: the parent's prefill is complete
            slot_set_decode(st.s, par.slot)
            ps.next_token_id = 0
            ps.token_ready = 1
        rc = facade_fork(st.s, st.p, st.c, st.ss, st.mode == MODE_AUTO, par.slot, ch.rid,
                         &slot)
        if rc:
            return rc       # cannot happen: a slot is free and the pages are held
        ch.state = SR_RUNNING
        ch.slot = slot
        ch.num_computed = par.num_computed
        st.admissions += 1
        ch.admitted = st.admissions
        ch.row = row
        ch.row_fresh = 1
        st.row_owner[row] = ce
        st.running[st.n_running] = ce
        st.n_running += 1
        st.forks += 1
        # always: an update forks each n child once (<= max_queued) and beam children that
        # live past it (<= max_seqs); children that finish at once free their rows for more
        if st.n_fork_acc < st.accum_cap:
            st.fork_acc[2 * st.n_fork_acc] = ch.rid
            st.fork_acc[2 * st.n_fork_acc + 1] = par.rid
            st.n_fork_acc += 1
    else:
        heap_push(st, ce)
        st.fork_fallbacks += 1
    return Q_OK


cdef int step_fork_n(StepState *st, int32_t e, const uint32_t *toks) noexcept nogil:
    # the leader e of an n group sampled toks[0..k): fork the k - 1 children, then each member
    # takes its own token (the children first, the parent last)
    cdef int32_t c
    cdef uint32_t j
    cdef int rc, first = Q_OK
    st.req[e].forked = 1
    c = st.req[e].next_member
    while c >= 0:
        rc = step_spawn(st, e, c)
        if rc and first == Q_OK:
            first = rc
        c = st.req[c].next_member
    c = st.req[e].next_member
    j = 1
    while c >= 0:
        rc = step_take(st, c, toks[j])
        if rc and first == Q_OK:
            first = rc
        j += 1
        c = st.req[c].next_member
    rc = step_take(st, e, toks[0])
    if rc and first == Q_OK:
        first = rc
    return first


# -- beam groups (docs/DESIGN.md, "Beam search at the step level") -------------------------------

cdef inline int32_t beam_take_entry(StepState *st, int32_t g) noexcept nogil:
    # one of group g's reserved spare entries (the counting guarantees one is there)
    cdef int32_t e
    st.n_free -= 1
    e = st.free_ids[st.n_free]
    st.req[g].n_spare -= 1
    st.reserved -= 1
    return e


cdef inline void beam_give_entry(StepState *st, int32_t g, int32_t e) noexcept nogil:
    # a beam entry of group g is free again: back to the group's spares
    entry_free(st, e)
    st.req[g].n_spare += 1
    st.reserved += 1


cdef inline void beam_unindex(StepState *st, int32_t e) noexcept nogil:
    if not st.req[e].unindexed:
        oa_remove(st.index, st.index_mask, _step_home(st, st.req[e].rid), e, _step_home_of, st)
        st.req[e].unindexed = 1


cdef int beam_stop(StepState *st, int32_t g, int32_t b) noexcept nogil:
    # a live beam without continuation leaves the queues (the twin's _finish_member)
    cdef int rc = Q_OK
    if st.req[b].state == SR_RUNNING:
        rc = slot_release(st, b)
        row_release(st, b)
        running_remove(st, b)
    elif st.req[b].state == SR_WAITING:
        heap_remove(st, b)
    st.req[b].has_cand = 0
    st.count -= 1
    accum_finished(st, st.req[b].rid)
    if st.req[g].parent_beam == b:
        st.req[g].parent_beam = -1
    return rc


cdef inline bint _sel_before(double s, uint32_t rank, uint32_t tok, SelCand *x) noexcept nogil:
    # candidate order: higher score, then the earlier beam, then the lower id
    if s != x.score:
        return s > x.score
    if rank != x.rank:
        return rank < x.rank
    return tok < x.tok


cdef int beam_select(StepState *st, int32_t g) noexcept nogil:
    # The twin's _select: when every live beam of group g has its candidates (running and
    # computed, or parked), the best w - hypotheses candidates are kept; each either finishes a
    # hypothesis (stored in an entry of the group) or continues a beam (the first continuation
    # of a beam takes the beam itself, each further one forks a child).  No live continuation:
    # the group is done (st.done).  Allocates nothing.
    cdef StepReq *R = &st.req[g]
    cdef uint32_t w = R.n_members, K, nk = 0, rank = 0, c, i, p, n_cont = 0
    cdef int32_t b, d, prev, src
    cdef size_t base
    cdef double sc
    cdef uint32_t tok
    cdef int rc = Q_OK, r2
    cdef StepReq *x
    b = R.next_member
    while b >= 0:
        x = &st.req[b]
        if not x.has_cand:
            return Q_OK
        b = x.next_member
    K = w - R.n_members_done
    b = R.next_member
    while b >= 0:
        x = &st.req[b]
        base = <size_t>b * st.max_seqs
        for c in range(w):
            sc = x.score + st.cand_lps[base + c]
            tok = st.cand_ids[base + c]
            p = nk
            while p > 0 and _sel_before(sc, rank, tok, &st.sel[p - 1]):
                p -= 1
            if p >= K:
                continue
            if nk < K:
                nk += 1
            i = nk - 1
            while i > p:
                st.sel[i] = st.sel[i - 1]
                i -= 1
            st.sel[p].score = sc
            st.sel[p].rank = rank
            st.sel[p].tok = tok
            st.sel[p].beam = b
        x.has_cand = 0
        rank += 1
        b = x.next_member
    # classify; in_sel on a beam: 1 continues, 2 finishes a hypothesis, 4 its entry holds one
    for i in range(nk):
        x = &st.req[st.sel[i].beam]
        if is_stop_token(x, st.sel[i].tok):
            st.sel[i].reason = FIN_STOP
        elif x.num_tokens - x.num_prompt + 1 >= x.max_new:
            st.sel[i].reason = FIN_LENGTH
        else:
            st.sel[i].reason = FIN_NONE
        if st.sel[i].reason == FIN_NONE:
            x.in_sel |= 1
            n_cont += 1
        else:
            x.in_sel |= 2
    # beams with no live continuation leave first (member order: the twin's finish order);
    # those sourcing no hypothesis give their entry back now
    prev = -1
    b = R.next_member
    while b >= 0:
        d = st.req[b].next_member
        if not (st.req[b].in_sel & 1):
            r2 = beam_stop(st, g, b)
            if r2 and rc == Q_OK:
                rc = r2
            if not (st.req[b].in_sel & 2):
                st.req[b].in_sel = 0
                beam_give_entry(st, g, b)
        b = d
    # hypotheses whose beam continues, or second ones of a beam: copied into a spare entry
    # (read before any beam's own entry takes its hypothesis in place)
    for i in range(nk):
        if st.sel[i].reason == FIN_NONE:
            continue
        src = st.sel[i].beam
        x = &st.req[src]
        if not (x.in_sel & 1) and not (x.in_sel & 4):
            x.in_sel |= 4           # this one goes in place, below
            st.sel[i].dest = src
            continue
        d = beam_take_entry(st, g)
        memset(&st.req[d], 0, sizeof(StepReq))
        memcpy(&st.arena[<size_t>d * st.entry_cap], &st.arena[<size_t>src * st.entry_cap],
               <size_t>x.num_tokens * sizeof(uint32_t))
        st.req[d].rid = x.rid
        st.req[d].num_prompt = x.num_prompt
        st.req[d].num_tokens = x.num_tokens
        st.req[d].unindexed = 1
        st.sel[i].dest = d
    for i in range(nk):
        if st.sel[i].reason == FIN_NONE:
            continue
        d = st.sel[i].dest
        x = &st.req[d]
        if d == st.sel[i].beam:
            beam_unindex(st, d)
            x.in_sel = 0
        st.arena[<size_t>d * st.entry_cap + x.num_tokens] = st.sel[i].tok
        x.num_tokens += 1
        x.state = SR_MEMBER_DONE
        x.group = g
        x.slot = -1
        x.row = -1
        x.heap_pos = -1
        x.plan_pos = -1
        x.next_member = -1
        x.score = st.sel[i].score
        x.reason = st.sel[i].reason
        x.hyp_seq = R.n_members_done
        R.n_members_done += 1
        x.next_hyp = R.next_hyp
        R.next_hyp = d
    if n_cont == 0:
        R.next_member = -1
        R.state = SR_FINISHED
        st.done[st.n_done] = g
        st.n_done += 1
        return rc
    # continuations in kept order: a beam's first takes the beam, each further one forks
    for i in range(nk):
        if st.sel[i].reason != FIN_NONE:
            continue
        b = st.sel[i].beam
        if not (st.req[b].in_sel & 8):
            st.req[b].in_sel |= 8
            st.sel[i].dest = b
            continue
        d = beam_take_entry(st, g)
        st.req[d] = st.req[b]
        x = &st.req[d]
        x.rid = st.next_child
        st.next_child += 1
        while step_find(st, x.rid) >= 0:
            x.rid = st.next_child
            st.next_child += 1
        x.nsb_borrowed = 1
        x.unindexed = 0
        x.heap_pos = -1
        x.plan_pos = -1
        x.slot = -1
        x.row = -1
        x.num_computed = 0
        x.has_cand = 0
        x.in_sel = 0
        x.decode = 0
        x.row_fresh = 0
        x.next_member = -1
        x.state = SR_RESERVED
        oa_insert(st.index, st.index_mask, _step_home(st, x.rid), d)
        r2 = step_spawn(st, b, d)
        if r2 and rc == Q_OK:
            rc = r2
        st.sel[i].dest = d
    prev = -1
    for i in range(nk):
        if st.sel[i].reason != FIN_NONE:
            continue
        d = st.sel[i].dest
        x = &st.req[d]
        x.in_sel = 0
        st.arena[<size_t>d * st.entry_cap + x.num_tokens] = st.sel[i].tok
        if st.mode == MODE_AUTO and x.state == SR_RUNNING:
            auto_note_token(st.s, st.ss, <uint32_t>x.slot, x.num_tokens, st.sel[i].tok)
        x.num_tokens += 1
        if x.state == SR_PARKED:
            heap_push(st, d)        # a parked beam continues: it has a token to compute
        x.score = st.sel[i].score
        x.next_member = -1
        if prev < 0:
            R.next_member = d
        else:
            st.req[prev].next_member = d
        prev = d
    return rc


cdef void beam_park_blocked(StepState *st) noexcept nogil:
    # The twin's _park_blocked_beams, after a step that scheduled nothing: every running beam
    # (each is computed and waits for a sibling) is parked with its candidates, not reported
    # as preempted, groups in add order and beams in member order
    cdef int32_t g = st.beam_head, b
    cdef StepReq *x
    while g >= 0:
        if st.req[g].state == SR_GROUP:
            b = st.req[g].next_member
            while b >= 0:
                x = &st.req[b]
                if x.state == SR_RUNNING and x.num_computed == x.num_tokens:
                    leave_running(st, b)
                    beam_park(st, b)
                b = x.next_member
        g = st.req[g].next_group


cdef void beam_group_free(StepState *st, int32_t g) noexcept nogil:
    # the group's result is returned (or it was aborted): every entry it holds is free again
    cdef int32_t b = st.req[g].next_hyp, nxt
    while b >= 0:
        nxt = st.req[b].next_hyp
        entry_free(st, b)
        b = nxt
    b = st.req[g].next_member
    while b >= 0:
        nxt = st.req[b].next_member
        entry_free(st, b)
        b = nxt
    st.reserved -= st.req[g].n_spare
    if st.req[g].prev_group >= 0:
        st.req[st.req[g].prev_group].next_group = st.req[g].next_group
    else:
        st.beam_head = st.req[g].next_group
    if st.req[g].next_group >= 0:
        st.req[st.req[g].next_group].prev_group = st.req[g].prev_group
    else:
        st.beam_tail = st.req[g].prev_group
    entry_free(st, g)


cdef int step_update(StepState *st, const uint32_t *sampled, const uint32_t *tk_ids,
                     const double *tk_lps, const float *tk_lps_f) noexcept nogil:
    # sampled[0..m) was validated by the caller, and so were the candidates of a plan with beam
    # rows (tk_ids and tk_lps or tk_lps_f: [m, num_topk], row-major).  Finished entries go to
    # st.done (state SR_FINISHED) for the caller to report and free.
    cdef uint32_t j, n, c, w, k = st.num_topk
    cdef size_t src, dst
    cdef int32_t e, g
    cdef StepReq *r
    cdef Slot *sl
    cdef int rc, first = Q_OK
    cdef uint64_t tc
    if not st.pending:
        return Q_NO_PLAN
    for j in range(st.n):
        e = st.plan_entry[j]
        if not st.plan_alive[j]:
            continue
        r = &st.req[e]
        r.plan_pos = -1
        r.unseen = 0
        n = st.plan_chunk[j]
        # advance: the chunk's K/V is written; pages that filled go to the cache
        sl = &st.s.slots[r.slot]
        tc = <uint64_t>sl.token_count + n
        sl.token_count = <uint32_t>(tc if tc <= U32_MAX else U32_MAX)
        r.num_computed += n
        if st.mode == MODE_AUTO:
            auto_fill(st.s, st.p, st.c, st.ss, <uint32_t>r.slot)
        if st.plan_sample[j] < 0:
            continue
        if r.group >= 0 and st.req[r.group].beam:
            # a beam row: its candidates wait for the group's selection
            g = r.group
            w = st.req[g].n_members
            src = <size_t>st.plan_sample[j] * k
            dst = <size_t>e * st.max_seqs
            for c in range(w):
                st.cand_ids[dst + c] = tk_ids[src + c]
                st.cand_lps[dst + c] = tk_lps[src + c] if tk_lps != NULL else tk_lps_f[src + c]
            r.has_cand = 1
            if not st.req[g].in_sel:
                st.req[g].in_sel = 1
                st.sel_groups[st.n_sel_groups] = g
                st.n_sel_groups += 1
            continue
        if r.group == e and not r.forked:
            rc = step_fork_n(st, e, &sampled[st.plan_sample[j]])
        else:
            rc = step_take(st, e, sampled[st.plan_sample[j]])
        if rc and first == Q_OK:
            first = rc
    # beam groups select in the order their first row appears in the plan
    for j in range(st.n_sel_groups):
        g = st.sel_groups[j]
        st.req[g].in_sel = 0
        rc = beam_select(st, g)
        if rc and first == Q_OK:
            first = rc
    st.n_sel_groups = 0
    if st.T == 0 and st.beam_head >= 0:
        beam_park_blocked(st)
    # the rows of requests aborted in the plan are free again once it is applied (after the
    # forks above: a child never takes a row the executing plan may still read)
    for j in range(st.n):
        if not st.plan_alive[j]:
            row_clear_deferred(st, st.block_table_rows[j])
    rc = release_deferred(st)
    if rc and first == Q_OK:
        first = rc
    st.pending = False
    return first


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
    cdef uint32_t k = st.num_topk, j, a, b, w
    cdef size_t i, n = <size_t>st.m * k, base
    cdef double v
    cdef int32_t g
    for i in range(n):
        v = lps[i] if lps != NULL else lps_f[i]
        if not v <= 0:          # NaN compares false
            row[0] = <uint32_t>(i // k)
            return TOPK_BAD_LOGPROB
    for j in range(st.n):
        if not st.plan_alive[j] or st.plan_sample[j] < 0:
            continue
        g = st.req[st.plan_entry[j]].group
        if g < 0 or not st.req[g].beam:
            continue
        w = st.req[g].n_members
        base = <size_t>st.plan_sample[j] * k
        for a in range(1, w):
            for b in range(a):
                if ids[base + a] == ids[base + b]:
                    row[0] = <uint32_t>st.plan_sample[j]
                    return TOPK_REPEATED
        for a in range(1, k):
            if ((lps[base + a] > lps[base + a - 1]) if lps != NULL
                    else (lps_f[base + a] > lps_f[base + a - 1])):
                row[0] = <uint32_t>st.plan_sample[j]
                return TOPK_UNSORTED
    return TOPK_OK


cdef int step_discard(StepState *st) noexcept nogil:
    # drop the pending plan: reserved pages stay with their requests, nothing advances.  Its
    # changed rows and finished ids are reported again by the next plan (a backend whose
    # execution failed may not have applied them); the caller made room in fin_accum.  The
    # requests aborted while it was pending hand their pages back (a pool error: its code).
    cdef uint32_t j
    cdef int rc
    if not st.pending:
        return Q_OK     # no plan: nothing to drop
    for j in range(st.n):
        if st.plan_alive[j]:
            st.req[st.plan_entry[j]].plan_pos = -1
        else:
            row_clear_deferred(st, st.block_table_rows[j])
    for j in range(st.n_changed):
        st.row_dirty[st.changed_rows[j]] = 1
    if st.n_finished and st.n_accum + st.n_finished <= st.accum_cap:
        memmove(&st.fin_accum[st.n_finished], st.fin_accum, st.n_accum * sizeof(uint64_t))
        memcpy(st.fin_accum, st.finished_ids, st.n_finished * sizeof(uint64_t))
        st.n_accum += st.n_finished
    if st.n_forks and st.n_fork_acc + st.n_forks <= st.accum_cap:
        # no update ran since the plan: nothing forked since, in practice
        memmove(&st.fork_acc[2 * st.n_forks], st.fork_acc, 2 * st.n_fork_acc * sizeof(uint64_t))
        for j in range(st.n_forks):
            st.fork_acc[2 * j] = st.fork_child_ids[j]
            st.fork_acc[2 * j + 1] = st.fork_parent_ids[j]
        st.n_fork_acc += st.n_forks
    st.n_forks = 0
    rc = release_deferred(st)
    st.pending = False
    return rc


# -- requests in and out -------------------------------------------------------------------------

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
    cdef StepReq *r
    cdef StepReq *ch
    if step_find(st, rid) >= 0:
        return Q_STEP_DUPLICATE
    if total > st.entry_cap:
        return Q_NEVER_FITS
    pages = (total - 1 + st.page_tokens - 1) // st.page_tokens
    if pages > num_blocks:
        return Q_NEVER_FITS
    if st.n_free - st.reserved < (beam_width if beam_width else n_members):
        return Q_QUEUE_FULL
    st.n_free -= 1
    e = st.free_ids[st.n_free]
    r = &st.req[e]
    memset(r, 0, sizeof(StepReq))
    r.rid = rid
    r.arrival = st.arrivals
    st.arrivals += 1
    r.priority = priority
    r.nsh = nsh
    r.nsb = nsb
    r.nsl = nsl
    r.num_prompt = n
    r.num_tokens = n
    r.max_new = max_new
    r.has_eos = has_eos
    r.eos = eos
    r.ignore_eos = ignore_eos
    r.n_stop = n_stop
    if n_stop:
        memcpy(r.stop, stop, n_stop * sizeof(uint32_t))
    r.slot = -1
    r.row = -1
    r.heap_pos = -1
    r.plan_pos = -1
    r.group = -1
    r.next_member = -1
    memcpy(&st.arena[<size_t>e * st.entry_cap], tok, <size_t>n * sizeof(uint32_t))
    if beam_width:
        # the group's record holds the id (and the namespace); the parent beam is one of the w
        # entries, the other w - 1 are reserved
        st.n_rec_free -= 1
        c = st.rec_free[st.n_rec_free]
        st.req[c] = r[0]
        ch = &st.req[c]
        ch.state = SR_GROUP
        ch.group = c
        ch.beam = 1
        ch.n_members = beam_width
        ch.n_spare = beam_width - 1
        ch.next_member = e
        ch.next_hyp = -1
        ch.parent_beam = e
        ch.next_group = -1
        ch.prev_group = st.beam_tail
        if st.beam_tail >= 0:
            st.req[st.beam_tail].next_group = c
        else:
            st.beam_head = c
        st.beam_tail = c
        st.reserved += beam_width - 1
        r.group = c
        r.nsb_borrowed = r.nsb != NULL
        r.unindexed = 1
        oa_insert(st.index, st.index_mask, _step_home(st, rid), c)
    else:
        oa_insert(st.index, st.index_mask, _step_home(st, rid), e)
    st.count += 1
    heap_push(st, e)
    if n_members > 1:
        r.group = e
        r.n_members = n_members
        prev = e
        for k in range(1, n_members):
            cid = st.next_child
            st.next_child += 1
            while step_find(st, cid) >= 0:
                cid = st.next_child
                st.next_child += 1
            st.n_free -= 1
            c = st.free_ids[st.n_free]
            ch = &st.req[c]
            ch[0] = st.req[e]
            ch.rid = cid
            ch.nsb_borrowed = ch.nsb != NULL
            ch.heap_pos = -1
            ch.next_member = -1
            ch.n_members = 0
            ch.state = SR_RESERVED
            oa_insert(st.index, st.index_mask, _step_home(st, cid), c)
            st.req[prev].next_member = c
            prev = c
    return Q_OK


cdef int step_abort_one(StepState *st, int32_t e) noexcept nogil:
    # a waiting or running entry leaves the queues (its entry is freed by the caller)
    cdef int rc = Q_OK
    if st.req[e].state == SR_RUNNING:
        if st.pending and st.req[e].plan_pos >= 0:
            # the pending plan may be executing: its pages stay held by the slot and its
            # block-table row keeps them, until update() or discard_plan() retires the plan
            # (release_deferred, row_clear_deferred); nothing allocates them meanwhile
            st.plan_alive[st.req[e].plan_pos] = 0
            st.row_owner[st.req[e].row] = ROW_DEFERRED
            st.req[e].row = -1
            st.deferred_slot[st.n_deferred] = st.req[e].slot
            st.n_deferred += 1
            st.req[e].slot = -1
        else:
            rc = slot_release(st, e)
            row_release(st, e)
        running_remove(st, e)
    elif st.req[e].state == SR_WAITING:
        heap_remove(st, e)
    st.count -= 1
    accum_finished(st, st.req[e].rid)
    return rc


cdef int step_abort(StepState *st, uint64_t rid) noexcept nogil:
    # a waiting or running request, or an n group by its parent's id (every member still
    # queued or running, in member order); a member alone is refused.  The caller made room
    # in fin_accum.
    cdef int32_t e = step_find(st, rid), c, nxt
    cdef int rc = Q_OK, r2
    if e < 0 or st.req[e].state == SR_FINISHED:
        return Q_STEP_UNKNOWN
    if st.req[e].group >= 0 and st.req[e].group != e:
        return Q_STEP_UNKNOWN       # a member of a group: abort the group
    if st.req[e].group != e:
        rc = step_abort_one(st, e)
        entry_free(st, e)
        return rc
    if st.req[e].beam:
        # a beam group: its live beams in member order, then every entry it holds
        c = st.req[e].next_member
        while c >= 0:
            r2 = step_abort_one(st, c)
            if r2 and rc == Q_OK:
                rc = r2
            c = st.req[c].next_member
        beam_group_free(st, e)
        return rc
    c = e
    while c >= 0:
        if st.req[c].state == SR_RUNNING or st.req[c].state == SR_WAITING:
            r2 = step_abort_one(st, c)
            if r2 and rc == Q_OK:
                rc = r2
        c = st.req[c].next_member
    c = e
    while c >= 0:
        nxt = st.req[c].next_member
        entry_free(st, c)
        c = nxt
    return rc


# -- Python side: the plan object, allocation ---------------------------------------------------

cdef class StepPlan:
    """One step's plan (docs/DESIGN.md, "The engine step", "The plan"): read-only numpy views
    over buffers the scheduler sized at construction, valid until its next ``schedule()``."""
    cdef readonly object request_ids
    cdef readonly object query_start_loc
    cdef readonly object seq_lens
    cdef readonly object input_ids
    cdef readonly object positions
    cdef readonly object slot_mapping
    cdef readonly object logits_indices
    cdef readonly object sampled_request_ids
    cdef readonly object block_table
    cdef readonly object block_table_rows
    cdef readonly object changed_rows
    cdef readonly object kv_indptr
    cdef readonly object kv_indices
    cdef readonly object kv_last_page_len
    cdef readonly object copies
    cdef readonly object new_request_ids
    cdef readonly object preempted_request_ids
    cdef readonly object finished_request_ids
    cdef readonly object fork_child_ids
    cdef readonly object fork_parent_ids
    cdef readonly uint32_t num_prefill_tokens
    cdef readonly uint32_t num_decode_tokens
    cdef readonly uint32_t num_cached_tokens
    cdef readonly uint32_t page_tokens
    cdef readonly uint32_t num_topk

    @property
    def num_seqs(self):
        return len(self.request_ids)

    @property
    def num_tokens(self):
        return len(self.input_ids)

    def __reduce__(self):
        raise TypeError("a StepPlan cannot be pickled: its arrays are views of a scheduler's "
                        "buffers, valid until its next schedule() (copy the arrays to keep them)")

    def __repr__(self):
        return (f"StepPlan(num_seqs={self.num_seqs}, num_tokens={self.num_tokens}, "
                f"num_prefill_tokens={self.num_prefill_tokens}, "
                f"num_decode_tokens={self.num_decode_tokens})")


cdef class _StepBuffers:
    """The plan's buffers (one read-only region each) and full-length views of them; a plan's
    arrays are slices of these views."""
    cdef list regions
    cdef dict full
    cdef dict last      # name -> (length, view): the last slice, reused while its length holds

    def __cinit__(self):
        self.regions = []
        self.full = {}
        self.last = {}

    cdef object view(self, str name, Py_ssize_t n):
        # a read-only slice of the buffer's first n records; the same object as last time when
        # n did not change (steady-state steps then build no array objects)
        cdef tuple hit = <tuple>self.last.get(name)
        if hit is not None and <Py_ssize_t>hit[0] == n:
            return hit[1]
        v = self.full[name][:n]
        self.last[name] = (n, v)
        return v

    cdef void *add(self, str name, object dtype, Py_ssize_t n) except NULL:
        cdef Py_ssize_t size = (n if n > 0 else 1) * (<cnp.dtype>dtype).itemsize
        cdef _Region r = _region_new(size, False)
        self.regions.append(r)
        self.full[name] = qualia_np_view(dtype, r.ptr, n, False, r)
        self.last.pop(name, None)
        return r.ptr


cdef object _DT_PLAN_I32 = np.dtype(np.int32)
cdef object _DT_PLAN_I64 = np.dtype(np.int64)
cdef object _DT_PLAN_U64 = np.dtype(np.uint64)


cdef int step_init(StepState *st, _StepBuffers bufs, Sched *s, Pool *p, PageCache *c,
                   Streams *ss, Undo *undo, qualia_copy_op *cow, uint64_t *copied,
                   uint64_t *allocated, int mode, uint32_t page_tokens, uint32_t budget,
                   uint32_t max_seqs, uint32_t max_queued, uint32_t max_chunk,
                   uint64_t vocab) except -1:
    cdef uint32_t lp = s.logical_pages, i
    cdef size_t cap = 1
    cdef size_t entry_cap = <size_t>lp * page_tokens
    memset(st, 0, sizeof(StepState))
    st.budget = budget
    st.max_seqs = max_seqs
    st.max_chunk = max_chunk
    st.max_queued = max_queued
    st.page_tokens = page_tokens
    st.logical_pages = lp
    st.entry_cap = <uint32_t>entry_cap
    st.vocab = vocab
    st.mode = mode
    st.s = s
    st.p = p
    st.c = c
    st.ss = ss
    st.undo = undo
    st.cow = cow
    st.pages_copied = copied
    st.pages_allocated = allocated
    # entries and beam-group records (at most max_queued each) at load <= 1/2
    while cap < 4 * <size_t>max_queued:
        cap <<= 1
    st.index_mask = <uint32_t>(cap - 1)
    st.req = <StepReq *>PyMem_Calloc(2 * <size_t>max_queued, sizeof(StepReq))
    st.arena = <uint32_t *>PyMem_Malloc(max(<size_t>max_queued * entry_cap, 1) * sizeof(uint32_t))
    st.free_ids = <int32_t *>PyMem_Malloc(max_queued * sizeof(int32_t))
    st.index = <int32_t *>PyMem_Malloc(cap * sizeof(int32_t))
    st.heap = <int32_t *>PyMem_Malloc(max_queued * sizeof(int32_t))
    st.running = <int32_t *>PyMem_Malloc(max_seqs * sizeof(int32_t))
    st.row_owner = <int32_t *>PyMem_Malloc(max_seqs * sizeof(int32_t))
    st.row_dirty = <uint8_t *>PyMem_Calloc(max_seqs, 1)
    st.row_len = <uint32_t *>PyMem_Calloc(max_seqs, sizeof(uint32_t))
    st.order = <int32_t *>PyMem_Malloc(max_seqs * sizeof(int32_t))
    st.plan_entry = <int32_t *>PyMem_Malloc(max_seqs * sizeof(int32_t))
    st.plan_chunk = <uint32_t *>PyMem_Malloc(max_seqs * sizeof(uint32_t))
    st.plan_sample = <int32_t *>PyMem_Malloc(max_seqs * sizeof(int32_t))
    st.plan_alive = <uint8_t *>PyMem_Malloc(max_seqs)
    st.deferred_slot = <int32_t *>PyMem_Malloc(max_seqs * sizeof(int32_t))
    st.done = <int32_t *>PyMem_Malloc(max_queued * sizeof(int32_t))
    st.rows_cap = max_queued
    st.next_child = (<uint64_t>1) << 63
    st.sampled = <uint32_t *>PyMem_Malloc(max_queued * sizeof(uint32_t))
    st.accum_cap = max_queued + max_seqs
    st.fin_accum = <uint64_t *>PyMem_Malloc(st.accum_cap * sizeof(uint64_t))
    st.fork_acc = <uint64_t *>PyMem_Malloc(2 * <size_t>st.accum_cap * sizeof(uint64_t))
    st.rec_free = <int32_t *>PyMem_Malloc(max_queued * sizeof(int32_t))
    st.sel = <SelCand *>PyMem_Malloc(max_seqs * sizeof(SelCand))
    st.sel_groups = <int32_t *>PyMem_Malloc(max_seqs * sizeof(int32_t))
    st.beam_head = st.beam_tail = -1
    if (st.rec_free == NULL or st.sel == NULL or st.sel_groups == NULL or st.req == NULL
            or st.arena == NULL or st.free_ids == NULL or st.index == NULL
            or st.heap == NULL or st.running == NULL or st.row_owner == NULL
            or st.row_dirty == NULL or st.row_len == NULL or st.order == NULL
            or st.plan_entry == NULL or st.plan_chunk == NULL or st.plan_sample == NULL
            or st.plan_alive == NULL or st.deferred_slot == NULL or st.done == NULL
            or st.sampled == NULL or st.fin_accum == NULL or st.fork_acc == NULL):
        raise MemoryError(f"cannot allocate the engine step's state for {max_queued} requests "
                          f"of {entry_cap} tokens")
    for i in range(max_queued):
        st.free_ids[i] = <int32_t>(max_queued - 1 - i)   # entry 0 is taken first
    st.n_free = max_queued
    for i in range(max_queued):
        st.rec_free[i] = <int32_t>(2 * max_queued - 1 - i)
    st.n_rec_free = max_queued
    for i in range(cap):
        st.index[i] = -1
    for i in range(max_seqs):
        st.row_owner[i] = -1
    st.copies_cap = budget // page_tokens + 2 * max_seqs + 1
    st.request_ids = <uint64_t *>bufs.add("request_ids", _DT_PLAN_U64, max_seqs)
    st.query_start_loc = <int32_t *>bufs.add("query_start_loc", _DT_PLAN_I32, max_seqs + 1)
    st.seq_lens = <int32_t *>bufs.add("seq_lens", _DT_PLAN_I32, max_seqs)
    st.input_ids = <uint32_t *>bufs.add("input_ids", _DT_U32, budget)
    st.positions = <int32_t *>bufs.add("positions", _DT_PLAN_I32, budget)
    st.slot_mapping = <int64_t *>bufs.add("slot_mapping", _DT_PLAN_I64, budget)
    st.logits_indices = <int32_t *>bufs.add("logits_indices", _DT_PLAN_I32, max_queued)
    st.sampled_request_ids = <uint64_t *>bufs.add("sampled_request_ids", _DT_PLAN_U64,
                                                  max_queued)
    st.block_table = <int32_t *>bufs.add("block_table", _DT_PLAN_I32, <Py_ssize_t>max_seqs * lp)
    st.block_table_rows = <int32_t *>bufs.add("block_table_rows", _DT_PLAN_I32, max_seqs)
    st.changed_rows = <int32_t *>bufs.add("changed_rows", _DT_PLAN_I32, max_seqs)
    st.kv_indptr = <int32_t *>bufs.add("kv_indptr", _DT_PLAN_I32, max_seqs + 1)
    st.kv_indices = <int32_t *>bufs.add("kv_indices", _DT_PLAN_I32, <Py_ssize_t>max_seqs * lp)
    st.kv_last_page_len = <int32_t *>bufs.add("kv_last_page_len", _DT_PLAN_I32, max_seqs)
    st.copies = <qualia_copy_op *>bufs.add("copies", _DT_COPY, st.copies_cap)
    st.new_ids = <uint64_t *>bufs.add("new_request_ids", _DT_PLAN_U64, max_seqs)
    st.preempted_ids = <uint64_t *>bufs.add("preempted_request_ids", _DT_PLAN_U64, max_seqs)
    st.finished_ids = <uint64_t *>bufs.add("finished_request_ids", _DT_PLAN_U64, st.accum_cap)
    st.fork_child_ids = <uint64_t *>bufs.add("fork_child_ids", _DT_PLAN_U64, st.accum_cap)
    st.fork_parent_ids = <uint64_t *>bufs.add("fork_parent_ids", _DT_PLAN_U64, st.accum_cap)
    st.finished_cap = st.accum_cap
    for i in range(<uint32_t>(max_seqs * lp)):
        st.block_table[i] = -1
    bufs.full["block_table"] = bufs.full["block_table"].reshape(max_seqs, lp)
    return 0


cdef void step_free(StepState *st) noexcept:
    cdef uint32_t e
    if st.req != NULL:
        for e in range(2 * st.max_queued):
            if st.req[e].nsb != NULL and not st.req[e].nsb_borrowed:
                free(st.req[e].nsb)
    PyMem_Free(st.req)
    PyMem_Free(st.arena)
    PyMem_Free(st.free_ids)
    PyMem_Free(st.index)
    PyMem_Free(st.heap)
    PyMem_Free(st.running)
    PyMem_Free(st.row_owner)
    PyMem_Free(st.row_dirty)
    PyMem_Free(st.row_len)
    PyMem_Free(st.order)
    PyMem_Free(st.plan_entry)
    PyMem_Free(st.plan_chunk)
    PyMem_Free(st.plan_sample)
    PyMem_Free(st.plan_alive)
    PyMem_Free(st.deferred_slot)
    PyMem_Free(st.done)
    PyMem_Free(st.sampled)
    PyMem_Free(st.fin_accum)
    PyMem_Free(st.fork_acc)
    PyMem_Free(st.rec_free)
    PyMem_Free(st.sel)
    PyMem_Free(st.sel_groups)
    PyMem_Free(st.cand_ids)
    PyMem_Free(st.cand_lps)
    PyMem_Free(st.topk_ids_buf)
    PyMem_Free(st.topk_lps_buf)
    memset(st, 0, sizeof(StepState))


cdef object step_plan(StepState *st, _StepBuffers bufs):
    """The pending plan as a StepPlan of slices of the buffers' views."""
    cdef StepPlan plan = StepPlan.__new__(StepPlan)
    cdef Py_ssize_t n = st.n, T = st.T, m = st.m
    plan.request_ids = bufs.view("request_ids", n)
    plan.query_start_loc = bufs.view("query_start_loc", n + 1)
    plan.seq_lens = bufs.view("seq_lens", n)
    plan.input_ids = bufs.view("input_ids", T)
    plan.positions = bufs.view("positions", T)
    plan.slot_mapping = bufs.view("slot_mapping", T)
    plan.logits_indices = bufs.view("logits_indices", m)
    plan.sampled_request_ids = bufs.view("sampled_request_ids", m)
    plan.block_table = bufs.full["block_table"]
    plan.block_table_rows = bufs.view("block_table_rows", n)
    plan.changed_rows = bufs.view("changed_rows", st.n_changed)
    plan.kv_indptr = bufs.view("kv_indptr", n + 1)
    plan.kv_indices = bufs.view("kv_indices", st.n_kv)
    plan.kv_last_page_len = bufs.view("kv_last_page_len", n)
    plan.copies = bufs.view("copies", st.n_copies)
    plan.new_request_ids = bufs.view("new_request_ids", st.n_new)
    plan.preempted_request_ids = bufs.view("preempted_request_ids", st.n_preempted)
    plan.finished_request_ids = bufs.view("finished_request_ids", st.n_finished)
    plan.fork_child_ids = bufs.view("fork_child_ids", st.n_forks)
    plan.fork_parent_ids = bufs.view("fork_parent_ids", st.n_forks)
    plan.num_prefill_tokens = st.num_prefill_tokens
    plan.num_decode_tokens = st.num_decode_tokens
    plan.num_cached_tokens = st.num_cached_tokens
    plan.page_tokens = st.page_tokens
    plan.num_topk = st.num_topk
    return plan


cdef list step_collect(StepState *st):
    """FinishedRequest (FinishedGroup for an n group) for every entry in st.done, in order;
    the entries are freed."""
    cdef list out = []
    cdef uint32_t k
    cdef int32_t e
    cdef StepReq *r
    cdef int32_t c, nxt
    for k in range(st.n_done):
        e = st.done[k]
        r = &st.req[e]
        if r.beam:
            # a beam group: the hypotheses best first (ties: finished first first)
            hyps = []
            c = r.next_hyp
            while c >= 0:
                hyps.append((-st.req[c].score, st.req[c].hyp_seq, c))
                c = st.req[c].next_hyp
            hyps.sort()
            out.append(FinishedGroup(
                r.rid, [_step_output(st, h[2]) for h in hyps],
                [_FINISH_REASONS[st.req[h[2]].reason] for h in hyps],
                [st.req[h[2]].score for h in hyps], []))
        elif r.group == e:
            # an n group: the members' outputs in member order
            outs, reasons, ids = [], [], []
            c = e
            while c >= 0:
                outs.append(_step_output(st, c))
                reasons.append(_FINISH_REASONS[st.req[c].reason])
                ids.append(st.req[c].rid)
                c = st.req[c].next_member
            out.append(FinishedGroup(r.rid, outs, reasons, None, ids))
        else:
            out.append(FinishedRequest(r.rid, _step_output(st, e), _FINISH_REASONS[r.reason]))
    for k in range(st.n_done):
        e = st.done[k]
        if st.req[e].beam:
            beam_group_free(st, e)
        elif st.req[e].group == e:
            c = e
            while c >= 0:
                nxt = st.req[c].next_member
                entry_free(st, c)
                c = nxt
        else:
            entry_free(st, e)
    st.n_done = 0
    return out


cdef object _step_output(StepState *st, int32_t e):
    cdef StepReq *r = &st.req[e]
    cdef uint32_t[::1] v
    arr = np.empty(r.num_tokens - r.num_prompt, dtype=np.uint32)
    v = arr
    if r.num_tokens > r.num_prompt:
        memcpy(&v[0], &st.arena[<size_t>e * st.entry_cap + r.num_prompt],
               (r.num_tokens - r.num_prompt) * sizeof(uint32_t))
    return arr


cdef enum:
    # run() with a C backend: a stretch of steps without the GIL ends at the first step that
    # ends this long after it began, so signals are serviced every few milliseconds
    RUN_SLICE_NS = 5000000

cdef enum:
    # fields of StepStat summed into RunResult.totals: the first STAT_TOTALS (the rest are queue
    # lengths and free pages after the step, which do not add up)
    STAT_TOTALS = 9

if STEP_TOTALS != STEP_STATS.names[:STAT_TOTALS]:
    raise ImportError("qualia._types.STEP_TOTALS is not the first STAT_TOTALS STEP_STATS fields")


cdef void stats_note(StepStat *row, StepStat *ring, uint32_t ring_rows, uint32_t *head,
                     uint64_t *totals) noexcept nogil:
    # one step's row: into the ring of the last ring_rows steps (head: the next row to write,
    # the oldest once the ring is full), and added to the running totals
    cdef const uint32_t *f = <const uint32_t *>row
    cdef uint32_t k
    if ring_rows:
        ring[head[0]] = row[0]
        head[0] = head[0] + 1 if head[0] + 1 < ring_rows else 0
    for k in range(STAT_TOTALS):
        totals[k] += f[k]


cdef void step_stat(StepState *st, StepStat *row, uint32_t finished) noexcept nogil:
    row.num_seqs = st.n
    row.num_tokens = st.T
    row.num_prefill_tokens = st.num_prefill_tokens
    row.num_decode_tokens = st.num_decode_tokens
    row.num_sampled = st.m
    row.num_new = st.n_new
    row.num_preempted = st.n_preempted
    row.num_cached_tokens = st.num_cached_tokens
    row.num_finished = finished
    row.num_waiting = st.n_waiting
    row.num_running = st.n_running
    row.free_pages = st.p.free_top + st.c.n_state[PC_RECLAIMABLE]


# -- the loop without the GIL, for a C step backend --------------------------------------------

cdef void step_abi_plan(StepState *st, qualia_step_plan *p) noexcept nogil:
    # the pending plan as the ABI struct: pointers into the buffers sized at construction
    p.struct_size = sizeof(qualia_step_plan)
    p.page_tokens = st.page_tokens
    p.num_requests = st.n
    p.num_tokens = st.T
    p.num_sampled = st.m
    p.num_prefill_tokens = st.num_prefill_tokens
    p.num_decode_tokens = st.num_decode_tokens
    p.num_kv_indices = st.n_kv
    p.block_table_num_rows = st.max_seqs
    p.block_table_num_cols = st.logical_pages
    p.block_table_row_stride = st.logical_pages
    p.num_changed_rows = st.n_changed
    p.num_copies = st.n_copies
    p.num_new = st.n_new
    p.num_preempted = st.n_preempted
    p.num_finished = st.n_finished
    p.request_ids = st.request_ids
    p.query_start_loc = st.query_start_loc
    p.seq_lens = st.seq_lens
    p.input_ids = st.input_ids
    p.positions = st.positions
    p.slot_mapping = st.slot_mapping
    p.logits_indices = st.logits_indices
    p.sampled_request_ids = st.sampled_request_ids
    p.block_table = st.block_table
    p.block_table_rows = st.block_table_rows
    p.changed_rows = st.changed_rows
    p.kv_indptr = st.kv_indptr
    p.kv_indices = st.kv_indices
    p.kv_last_page_len = st.kv_last_page_len
    p.copies = st.copies
    p.new_request_ids = st.new_ids
    p.preempted_request_ids = st.preempted_ids
    p.finished_request_ids = st.finished_ids
    p.num_topk = st.num_topk
    p.num_forks = st.n_forks
    p.fork_child_ids = st.fork_child_ids
    p.fork_parent_ids = st.fork_parent_ids
    p.topk_ids_out = st.topk_ids_buf if st.num_topk else NULL
    p.topk_logprobs_out = st.topk_lps_buf if st.num_topk else NULL


cdef int step_run(StepState *st, qualia_step_backend *cb, uint64_t max_steps,
                  uint64_t deadline_ns, StepStat *ring, uint32_t ring_rows, uint32_t *head,
                  uint64_t *totals, uint64_t *steps, int32_t *status,
                  uint32_t *token) noexcept nogil:
    # schedule -> execute -> update until no request is left, max_steps steps ran, or a step
    # ends at or after deadline_ns (_coarse_now_ns; at least one step runs), so the caller
    # takes the GIL every few milliseconds to service signals.  Each step's statistics go to
    # the ring and the totals (stats_note).  A failing step is discarded (nothing of it
    # applied) and ends the loop; the loop never ends with a plan pending.  A failure's code is
    # a Q_RUN_* status, *status the failing row (or the backend's own status), *token the row's
    # sampled id.
    cdef qualia_step_plan plan
    cdef StepStat stat
    cdef uint64_t k = 0
    cdef uint32_t done, i, row = 0
    cdef size_t j
    cdef int rc = Q_OK
    cdef int32_t s
    cdef uint64_t limit = st.vocab - 1 if st.vocab else U32_MAX
    while st.count and k < max_steps:
        rc = step_schedule(st)
        if rc:
            break
        if st.num_topk and (not (cb.flags & QUALIA_STEP_WRITES_TOPK)
                            or <size_t>st.m * st.num_topk > st.topk_cap):
            step_discard(st)
            rc = Q_RUN_NO_TOPK
            break
        step_abi_plan(st, &plan)
        # the sampled ids are poisoned as the candidates are: a backend that returns 0 without
        # writing a row fails the step instead of handing the previous step's ids (or, at the
        # first step, whatever the buffer held) to the update.  U32_MAX is no token id a step
        # backend may return (qualia.h)
        for i in range(st.m):
            st.sampled[i] = U32_MAX
        if st.num_topk:
            # a backend that declares the flag but leaves candidates unwritten fails the step
            # (the check below) instead of handing the previous step's to the selection
            for j in range(<size_t>st.m * st.num_topk):
                st.topk_ids_buf[j] = 0
                st.topk_lps_buf[j] = <float>NAN
        s = 0
        if cb.copy_pages != NULL and st.n_copies:
            s = cb.copy_pages(cb.ctx, st.copies, st.n_copies)
        if s == 0:
            s = cb.execute_step(cb.ctx, &plan, st.sampled, NULL)
        if s != 0:
            step_discard(st)
            status[0] = s
            rc = Q_RUN_BACKEND_FAILED
            break
        for i in range(st.m):
            if st.sampled[i] == U32_MAX or st.sampled[i] > limit:
                step_discard(st)
                status[0] = <int32_t>i
                token[0] = st.sampled[i]
                rc = Q_RUN_UNWRITTEN if st.sampled[i] == U32_MAX else Q_RUN_BAD_TOKEN
                break
        if rc:
            break
        if st.num_topk:
            for j in range(<size_t>st.m * st.num_topk):
                if st.topk_ids_buf[j] > limit:
                    step_discard(st)
                    status[0] = <int32_t>(j // st.num_topk)
                    rc = Q_RUN_BAD_TOPK
                    break
            if rc:
                break
            i = <uint32_t>step_check_topk(st, st.topk_ids_buf, NULL, st.topk_lps_buf, &row)
            if i:
                step_discard(st)
                status[0] = <int32_t>row
                rc = (Q_RUN_BAD_TOPK_LOGPROB if i == TOPK_BAD_LOGPROB else
                      Q_RUN_REPEATED_TOPK if i == TOPK_REPEATED else Q_RUN_UNSORTED_TOPK)
                break
        done = st.n_done
        rc = step_update(st, st.sampled, st.topk_ids_buf, NULL, st.topk_lps_buf)
        step_stat(st, &stat, st.n_done - done)
        stats_note(&stat, ring, ring_rows, head, totals)
        k += 1
        if rc or _coarse_now_ns() >= deadline_ns:
            break
    steps[0] = k
    return rc
