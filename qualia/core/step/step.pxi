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


# A request entry (core/step/requests.pxi): one per queued request, n-group member, live beam
# or finished hypothesis (max_queued), and past them one per beam group's record.  Its fields
# by concept: the request as added, where it is now, its group membership, a beam group's
# record, a beam's score / a hypothesis.

cdef struct StepRequest:
    uint64_t rid            # first field: the id index reads it (id_find)
    uint64_t arrival        # add_request counter: ties of equal priority, oldest first
    int64_t priority        # lower is served first
    uint64_t nsh            # namespace hash (auto mode)
    uint8_t *nsb            # namespace bytes (malloc'd; NULL when empty)
    uint32_t nsl
    uint8_t nsb_borrowed    # nsb is the leader's or the record's (freed with it)
    uint32_t num_prompt
    uint32_t num_tokens     # prompt + outputs (in the token arena)
    uint32_t max_new
    uint32_t eos
    uint32_t n_stop
    uint32_t stop[STOP_MAX]
    uint8_t has_eos
    uint8_t ignore_eos
    uint8_t reason          # why it finished (FIN_*)
    uint8_t unindexed       # not in the id index (the parent beam, a hypothesis)

cdef struct StepPlace:
    uint8_t state           # SR_*
    uint64_t admitted       # admission counter: "most recently admitted" picks victims
    uint64_t enq            # enqueue number: equal (priority, arrival) -> the latest first
    uint64_t sched_step     # the step that last scheduled it
    uint32_t num_computed   # tokens whose K/V is written
    int32_t slot            # slot while running, else -1
    int32_t row             # block-table row while running, else -1
    int32_t heap_pos        # position in the waiting heap while waiting, else -1
    int32_t plan_pos        # position in the pending plan, else -1
    uint8_t decode          # scheduled in the pending plan as a decode
    uint8_t unseen          # admitted or resumed; in no applied plan since
    uint8_t row_fresh       # forked child: its row is written whole when next lowered

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
    StepRequest req
    StepPlace at
    GroupMember mem
    BeamRecord rec
    Hypothesis hyp


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


cdef struct StepLimits:
    uint32_t budget         # max_num_batched_tokens
    uint32_t max_seqs       # max_num_seqs: slots and rows of the block table, requests of a plan
    uint32_t max_chunk      # max_prefill_chunk (0: only the budget limits a chunk)
    uint32_t max_queued
    uint32_t page_tokens
    uint32_t logical_pages
    uint64_t vocab          # 0: any uint32 id
    int mode                # MODE_AUTO or MODE_OFF

cdef struct StepPages:
    # the pages, slots and cache the step works on (its StepScheduler's), and the scratch of
    # one reservation
    Sched *s
    Pool *p
    PageCache *c
    Streams *ss
    Undo *undo
    qualia_copy_op *cow
    uint64_t *pages_copied
    uint64_t *pages_allocated

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

cdef struct StepArena:
    uint32_t *tokens        # max_queued x entry_cap: each entry's prompt and outputs
    uint32_t entry_cap      # tokens of one entry = logical_pages * page_tokens

cdef struct StepQueue:
    int32_t *heap           # waiting entries, by (priority, arrival, latest enqueue)
    uint32_t n
    uint64_t enqueues       # heap_push counter

cdef struct StepRunning:
    int32_t *ents           # running entries, in admission order
    uint32_t n
    uint64_t admissions     # admission counter
    int32_t *order          # max_seqs: scratch, this step's running order
    int32_t *row_owner      # max_seqs: entry holding each row, -1 when free
    uint8_t *row_dirty      # max_seqs: rewritten since the previous plan
    uint32_t *row_len       # max_seqs: leading entries of the row that may be set

cdef struct PlanState:
    # the plan being built, then pending until update() or discard_plan() retires it
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
    uint32_t n_forks
    uint32_t num_prefill_tokens
    uint32_t num_decode_tokens
    uint32_t num_cached_tokens
    uint32_t num_topk       # candidates per row (0: no beam row)
    int32_t *plan_entry     # max_seqs
    uint32_t *plan_chunk    # max_seqs
    int32_t *plan_sample    # max_seqs: sampled row or -1
    uint8_t *plan_alive     # max_seqs: 0 once aborted after schedule
    # slots of requests aborted while in the pending plan, in abort order: their pages stay
    # held (a kernel may be executing the plan) until update() or discard_plan() retires it
    int32_t *deferred_slot  # max_seqs
    uint32_t n_deferred
    uint32_t *sampled       # rows_cap: update()'s validated sampled ids
    uint32_t rows_cap       # sampled rows a plan may have (max_queued: one per member entry)

cdef struct PlanBuffers:
    # the plan's arrays (core/step/plan.pxi), sized at construction and viewed by StepPlan
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
    uint64_t *finished_ids  # the plan's copy of the accumulator
    uint32_t finished_cap

cdef struct StepDone:
    uint64_t *fin_accum     # finished or aborted since the previous plan
    uint32_t n_accum
    uint32_t accum_cap
    uint64_t *fork_acc      # forks since the previous plan: (child, parent) pairs, accum_cap
    uint32_t n_fork_acc
    int32_t *ents           # finished entries (state SR_FINISHED) not yet handed to Python
    uint32_t n

cdef struct StepGroups:
    uint64_t forks          # children forked
    uint64_t fork_fallbacks  # children queued for lack of a slot or row

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

cdef struct StepState:
    StepLimits lim          # sizes fixed at construction
    StepPages pg            # the owner's pages, slots and cache
    StepEntry *ent          # request entries (max_queued), then beam-group records (max_queued)
    StepIds ids             # the id index and the free entries
    StepArena arena         # token arena
    StepQueue wait          # waiting heap
    StepRunning run         # running set and block-table rows
    PlanState plan          # the plan
    PlanBuffers buf         # the plan's arrays
    StepDone done           # what finished, was aborted or forked since the previous plan
    StepGroups groups       # n groups
    StepBeams beams         # beam groups


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
    return id_home(rid, st.ids.index_mask)


cdef uint32_t _step_home_of(void *ctx, int32_t e) noexcept nogil:
    cdef StepState *st = <StepState *>ctx
    return id_home(st.ent[e].req.rid, st.ids.index_mask)


cdef inline int32_t step_find(StepState *st, uint64_t rid) noexcept nogil:
    return id_find(st.ids.index, st.ids.index_mask, st.ent, sizeof(StepEntry), rid)


cdef inline bint _before(StepState *st, int32_t a, int32_t b) noexcept nogil:
    # waiting order: (priority, arrival)
    if st.ent[a].req.priority != st.ent[b].req.priority:
        return st.ent[a].req.priority < st.ent[b].req.priority
    if st.ent[a].req.arrival != st.ent[b].req.arrival:
        return st.ent[a].req.arrival < st.ent[b].req.arrival
    # members of a group share their arrival: the one enqueued last goes first (the twin
    # inserts before equal keys)
    return st.ent[a].at.enq > st.ent[b].at.enq


cdef inline void _heap_set(StepState *st, uint32_t i, int32_t e) noexcept nogil:
    st.wait.heap[i] = e
    st.ent[e].at.heap_pos = <int32_t>i


cdef void _heap_up(StepState *st, uint32_t i) noexcept nogil:
    cdef int32_t e = st.wait.heap[i]
    cdef uint32_t parent
    while i > 0:
        parent = (i - 1) >> 1
        if not _before(st, e, st.wait.heap[parent]):
            break
        _heap_set(st, i, st.wait.heap[parent])
        i = parent
    _heap_set(st, i, e)


cdef void _heap_down(StepState *st, uint32_t i) noexcept nogil:
    cdef int32_t e = st.wait.heap[i]
    cdef uint32_t child
    while True:
        child = 2 * i + 1
        if child >= st.wait.n:
            break
        if child + 1 < st.wait.n and _before(st, st.wait.heap[child + 1], st.wait.heap[child]):
            child += 1
        if not _before(st, st.wait.heap[child], e):
            break
        _heap_set(st, i, st.wait.heap[child])
        i = child
    _heap_set(st, i, e)


cdef void heap_push(StepState *st, int32_t e) noexcept nogil:
    st.ent[e].at.state = SR_WAITING
    st.wait.enqueues += 1
    st.ent[e].at.enq = st.wait.enqueues
    _heap_set(st, st.wait.n, e)
    st.wait.n += 1
    _heap_up(st, st.wait.n - 1)


cdef void heap_remove(StepState *st, int32_t e) noexcept nogil:
    cdef uint32_t i = <uint32_t>st.ent[e].at.heap_pos
    cdef int32_t last
    st.wait.n -= 1
    st.ent[e].at.heap_pos = -1
    if i == st.wait.n:
        return
    last = st.wait.heap[st.wait.n]
    _heap_set(st, i, last)
    _heap_up(st, i)
    _heap_down(st, <uint32_t>st.ent[last].at.heap_pos)


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
        st.run.row_dirty[r] = 1
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
        st.run.row_dirty[r] = 1
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
                st.run.row_dirty[r] = 1
    st.run.row_len[r] = t.len


cdef void accum_finished(StepState *st, uint64_t rid) noexcept nogil:
    # the caller made room (abort grows the buffer with the GIL; update needs at most max_seqs)
    if st.done.n_accum < st.done.accum_cap:
        st.done.fin_accum[st.done.n_accum] = rid
        st.done.n_accum += 1


cdef inline int slot_finish(StepState *st, int32_t slot) noexcept nogil:
    # facade finish: release the slot's pages (auto mode: into the cache) and free the slot
    if st.lim.mode == MODE_AUTO:
        return auto_finish(st.pg.s, st.pg.p, st.pg.c, st.pg.ss, slot)
    return sched_finish(st.pg.s, slot, st.pg.p)


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


cdef void entry_free(StepState *st, int32_t e) noexcept nogil:
    # forget the entry: id index, namespace reference, stop ids
    cdef StepEntry *r = &st.ent[e]
    if not r.req.unindexed:
        oa_remove(st.ids.index, st.ids.index_mask, _step_home(st, r.req.rid), e, _step_home_of, st)
    r.req.unindexed = 0
    if r.req.nsb != NULL and not r.req.nsb_borrowed:
        free(r.req.nsb)
    r.req.nsb = NULL
    r.at.state = SR_FREE
    if <uint32_t>e >= st.lim.max_queued:
        st.ids.rec_free[st.ids.n_rec_free] = e
        st.ids.n_rec_free += 1
        return
    st.ids.free_ids[st.ids.n_free] = e
    st.ids.n_free += 1


# -- schedule --------------------------------------------------------------------------------

cdef int step_reserve(StepState *st, int32_t e, uint32_t n) noexcept nogil:
    # the facade's reserve of the next n positions of entry e (reclaim, then make writable);
    # copies go to the plan, the row mirrors the pages.  On failure nothing changed.
    cdef int32_t slot = st.ent[e].at.slot
    cdef uint64_t start = st.pg.s.slots[slot].token_count
    cdef uint32_t first = <uint32_t>(start // st.lim.page_tokens)
    cdef uint32_t last = <uint32_t>((start + n - 1) // st.lim.page_tokens)
    cdef Py_ssize_t n_undo = 0, n_copies = 0, k
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
        rc = facade_make_room(st.pg.s, st.pg.p, st.pg.c, slot, first, last)
    if rc == Q_OK:
        rc = facade_make_writable(st.pg.s, st.pg.p, st.pg.undo, st.pg.cow, slot, first, last, &n_undo,
                                  &n_copies)
    if rc == Q_OK and st.plan.n_copies + n_copies > st.plan.copies_cap:
        rc = Q_OUTPUT_TOO_SMALL     # cannot happen: copies_cap bounds a step's pages
    if rc:
        _undo(st.pg.s, st.pg.p, st.pg.undo, n_undo)
        return rc
    for k in range(n_copies):
        st.buf.copies[st.plan.n_copies] = st.pg.cow[k]
        st.plan.n_copies += 1
    st.pg.pages_copied[0] += n_copies
    st.pg.pages_allocated[0] += n_undo - n_copies
    if st.lim.mode == MODE_AUTO:
        auto_after_cow(st.pg.c, st.pg.p, st.pg.undo, n_undo)
    row_write(st, e, first, last)
    return Q_OK


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
        if best < 0 or (st.ent[e].req.priority > st.ent[best].req.priority
                        or (st.ent[e].req.priority == st.ent[best].req.priority
                            and st.ent[e].at.admitted > st.ent[best].at.admitted)):
            best = e
    if best >= 0:
        return best
    best = cur
    for i in range(st.run.n):
        e = st.run.ents[i]
        if e != cur and st.ent[e].at.sched_step == st.plan.step_no:
            continue
        if (st.ent[e].req.priority > st.ent[best].req.priority
                or (st.ent[e].req.priority == st.ent[best].req.priority
                    and st.ent[e].at.admitted > st.ent[best].at.admitted)):
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


cdef inline void beam_park(StepState *st, int32_t e) noexcept nogil:
    # a computed beam out of the running list (leave_running first): it keeps its candidates
    # and waits for its group's selection outside the queues
    st.ent[e].at.state = SR_PARKED
    st.beams.parked += 1


cdef int preempt(StepState *st, int32_t e) noexcept nogil:
    # recompute: back to waiting with its arrival number and outputs; a computed beam is parked
    # with its candidates instead
    cdef int rc = leave_running(st, e)
    if st.ent[e].mem.has_cand:
        beam_park(st, e)
    else:
        heap_push(st, e)
    st.buf.preempted_ids[st.plan.n_preempted] = st.ent[e].req.rid
    st.plan.n_preempted += 1
    return rc


cdef inline uint32_t _chunk(StepState *st, uint32_t remaining, uint32_t left) noexcept nogil:
    cdef uint32_t n = remaining if remaining < left else left
    if remaining > 1 and st.lim.max_chunk and n > st.lim.max_chunk:
        n = st.lim.max_chunk
    return n


cdef void plan_add(StepState *st, int32_t e, uint32_t n) noexcept nogil:
    cdef uint32_t j = st.plan.n
    st.plan.plan_entry[j] = e
    st.plan.plan_chunk[j] = n
    st.plan.plan_alive[j] = 1
    st.ent[e].at.plan_pos = <int32_t>j
    st.ent[e].at.sched_step = st.plan.step_no
    st.plan.n += 1


cdef int admit_waiting(StepState *st, int32_t e, uint32_t left, uint32_t *chunk,
                       uint32_t *cached) noexcept nogil:
    # The head of the waiting queue: its cache hit (auto mode), its chunk, whether its pages fit
    # (free + reclaimable, less the reclaimable pages its own hit takes); then admit, reserve,
    # take a row.  Q_EXHAUSTED when it does not fit (nothing changed).
    cdef StepEntry *r = &st.ent[e]
    cdef const uint32_t *tok = &st.arena.tokens[<size_t>e * st.arena.entry_cap]
    cdef uint32_t hit = 0, k, rec = 0, n, need
    cdef int32_t row
    cdef Admission_c adm
    cdef int rc
    cdef uint64_t avail
    cdef Table *t
    if st.lim.mode == MODE_AUTO:
        k = _probe_hit(st, e, &rec)
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
    cdef uint64_t hashed = st.pg.c.pages_hashed, admitted = r.at.admitted
    if st.lim.mode == MODE_AUTO:
        rc = auto_admit(st.pg.s, st.pg.p, st.pg.c, st.pg.ss, r.req.rid, tok, r.req.num_tokens,
                        r.req.nsb if r.req.nsb != NULL else <const uint8_t *>"", r.req.nsl, r.req.nsh, &adm)
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
    r.at.admitted = st.run.admissions
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
        r.at.admitted = admitted
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


cdef uint32_t _probe_hit(StepState *st, int32_t e, uint32_t *rec) noexcept nogil:
    # the pages an admission of entry e would take from the cache now, and how many of them are
    # reclaimable (cached_prefix's rule)
    cdef StepEntry *r = &st.ent[e]
    cdef const uint32_t *tok = &st.arena.tokens[<size_t>e * st.arena.entry_cap]
    cdef uint32_t n = r.req.num_tokens
    cdef uint32_t hashed = (n - 1) // st.lim.page_tokens if n else 0
    cdef uint32_t k, i, ns
    cdef bint collided
    rec[0] = 0
    ns = ns_find(&st.pg.c.ns, r.req.nsh, r.req.nsb if r.req.nsb != NULL else <const uint8_t *>"", r.req.nsl)
    if ns == U32_MAX:
        return 0
    k = auto_match(st.pg.c, tok, n, ns, r.req.nsh, hashed, st.pg.ss.probe_ident, st.pg.ss.probe_canon,
                   st.pg.ss.probe_gen, &collided)
    for i in range(k):
        rec[0] += pc_rec(st.pg.c, st.pg.ss.probe_canon[i]).state == PC_RECLAIMABLE
    return k


cdef int step_schedule(StepState *st) noexcept nogil:
    cdef uint32_t i, j, nd = 0, left = st.lim.budget, n, rem, pages, q, pos, t, hit, lp, off, run, k
    cdef int64_t sm
    cdef int32_t e, v, slot
    cdef bint preempted = False
    cdef int rc
    cdef StepEntry *r
    cdef Table *tb
    cdef size_t base
    if st.plan.pending:
        return Q_PLAN_PENDING
    st.plan.step_no += 1
    st.plan.n = st.plan.T = st.plan.m = st.plan.n_kv = st.plan.n_copies = st.plan.n_new = st.plan.n_preempted = 0
    st.plan.num_topk = 0
    st.plan.num_prefill_tokens = st.plan.num_decode_tokens = st.plan.num_cached_tokens = 0
    # 1. running requests: decodes, then prefills, each in admission order
    for i in range(st.run.n):
        e = st.run.ents[i]
        if st.ent[e].req.num_tokens - st.ent[e].at.num_computed == 1:
            st.run.order[nd] = e
            nd += 1
    j = nd
    for i in range(st.run.n):
        e = st.run.ents[i]
        if st.ent[e].req.num_tokens - st.ent[e].at.num_computed > 1:
            st.run.order[j] = e
            j += 1
    for i in range(j):
        e = st.run.order[i]
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
        plan_add(st, e, n)
        st.ent[e].at.decode = rem == 1
        if st.ent[e].at.unseen:
            # admitted by a discarded plan: named until a plan with it is applied
            st.buf.new_ids[st.plan.n_new] = st.ent[e].req.rid
            st.plan.n_new += 1
        left -= n
    # 2. waiting requests by (priority, arrival), unless this step preempted
    if not preempted:
        while st.wait.n and left > 0 and st.run.n < st.lim.max_seqs:
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
            plan_add(st, e, n)
            st.ent[e].at.decode = 0
            left -= n
    # 3. metadata, in plan order
    st.buf.query_start_loc[0] = 0
    st.buf.kv_indptr[0] = 0
    for j in range(st.plan.n):
        e = st.plan.plan_entry[j]
        r = &st.ent[e]
        n = st.plan.plan_chunk[j]
        q = r.at.num_computed
        slot = r.at.slot
        tb = &st.pg.s.slots[slot].blocks
        st.buf.request_ids[j] = r.req.rid
        st.buf.seq_lens[j] = <int32_t>(q + n)
        st.buf.block_table_rows[j] = r.at.row
        memcpy(&st.buf.input_ids[st.plan.T], &st.arena.tokens[<size_t>e * st.arena.entry_cap + q],
               n * sizeof(uint32_t))
        # positions and slot mapping, a page at a time (no division per token)
        pos = q
        t = st.plan.T
        lp = q // st.lim.page_tokens
        off = q - lp * st.lim.page_tokens
        while pos < q + n:
            sm = <int64_t>tb.entries[lp] * st.lim.page_tokens
            run = st.lim.page_tokens - off
            if run > q + n - pos:
                run = q + n - pos
            for k in range(run):
                st.buf.positions[t + k] = <int32_t>(pos + k)
                st.buf.slot_mapping[t + k] = sm + off + k
            pos += run
            t += run
            lp += 1
            off = 0
        if r.at.decode:
            st.plan.num_decode_tokens += n
        else:
            st.plan.num_prefill_tokens += n
        st.plan.T += n
        st.buf.query_start_loc[j + 1] = <int32_t>st.plan.T
        if r.at.row_fresh:
            # a forked child's first plan: its row takes the whole table (the twin's lowering
            # writes every page of a scheduled request's row)
            row_write(st, e, 0, tb.len - 1 if tb.len else 0)
            r.at.row_fresh = 0
        if q + n == r.req.num_tokens:
            st.plan.plan_sample[j] = <int32_t>st.plan.m
            if r.mem.group == e and not r.mem.forked:
                # the prompt's last row, once per member of the n group, in member order
                v = e
                while v >= 0:
                    st.buf.logits_indices[st.plan.m] = <int32_t>(st.plan.T - 1)
                    st.buf.sampled_request_ids[st.plan.m] = st.ent[v].req.rid
                    st.plan.m += 1
                    v = st.ent[v].mem.next_member
            else:
                st.buf.logits_indices[st.plan.m] = <int32_t>(st.plan.T - 1)
                st.buf.sampled_request_ids[st.plan.m] = r.req.rid
                st.plan.m += 1
                if r.mem.group >= 0 and st.ent[r.mem.group].rec.beam and \
                        st.ent[r.mem.group].mem.n_members > st.plan.num_topk:
                    st.plan.num_topk = st.ent[r.mem.group].mem.n_members
        else:
            st.plan.plan_sample[j] = -1
        pages = (q + n + st.lim.page_tokens - 1) // st.lim.page_tokens
        # page ids are < num_blocks <= 2**32-1 and a pool is far smaller than 2**31 pages in
        # practice; the int32 view of the same bits is what kernels take
        memcpy(&st.buf.kv_indices[st.plan.n_kv], tb.entries, pages * sizeof(int32_t))
        st.plan.n_kv += pages
        st.buf.kv_indptr[j + 1] = <int32_t>st.plan.n_kv
        st.buf.kv_last_page_len[j] = <int32_t>(q + n - (pages - 1) * st.lim.page_tokens)
    st.plan.n_changed = 0
    for i in range(st.lim.max_seqs):
        if st.run.row_dirty[i]:
            st.run.row_dirty[i] = 0
            st.buf.changed_rows[st.plan.n_changed] = <int32_t>i
            st.plan.n_changed += 1
    # the plan reports what finished or was aborted, and the forks made, since the previous plan
    memcpy(st.buf.finished_ids, st.done.fin_accum, st.done.n_accum * sizeof(uint64_t))
    st.plan.n_finished = st.done.n_accum
    st.done.n_accum = 0
    for i in range(st.done.n_fork_acc):
        st.buf.fork_child_ids[i] = st.done.fork_acc[2 * i]
        st.buf.fork_parent_ids[i] = st.done.fork_acc[2 * i + 1]
    st.plan.n_forks = st.done.n_fork_acc
    st.done.n_fork_acc = 0
    st.plan.pending = True
    return Q_OK


# -- update ----------------------------------------------------------------------------------

cdef inline bint is_stop_token(StepEntry *r, uint32_t tok) noexcept nogil:
    # eos (unless ignored) or one of the request's stop ids
    cdef uint32_t k
    if r.req.has_eos and not r.req.ignore_eos and tok == r.req.eos:
        return True
    for k in range(r.req.n_stop):
        if r.req.stop[k] == tok:
            return True
    return False


cdef int step_take(StepState *st, int32_t e, uint32_t tok) noexcept nogil:
    # one sampled token for entry e (running, or a queued child of an n group): note it, apply
    # the stop conditions; a stopped plain request goes to st.done.ents (SR_FINISHED), a stopped
    # member waits for its group (SR_MEMBER_DONE) and the last one puts the leader in st.done.ents
    cdef StepEntry *r = &st.ent[e]
    cdef StepEntry *g
    cdef uint32_t pos = r.req.num_tokens
    cdef uint8_t reason = FIN_NONE
    cdef int rc = Q_OK
    st.arena.tokens[<size_t>e * st.arena.entry_cap + pos] = tok
    if st.lim.mode == MODE_AUTO and r.at.state == SR_RUNNING:
        auto_note_token(st.pg.s, st.pg.ss, <uint32_t>r.at.slot, pos, tok)
    r.req.num_tokens += 1
    if r.req.num_tokens - r.req.num_prompt >= r.req.max_new:
        reason = FIN_LENGTH
    elif is_stop_token(r, tok):
        reason = FIN_STOP
    if reason == FIN_NONE:
        return Q_OK
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


cdef int step_spawn(StepState *st, int32_t pe, int32_t ce) noexcept nogil:
    # child entry ce of the running parent pe, with the parent's tokens so far: forked (a slot
    # and a row are free) or queued as an ordinary request (admitted later through the cache)
    cdef StepEntry *par = &st.ent[pe]
    cdef StepEntry *ch = &st.ent[ce]
    cdef int32_t row = row_lowest_free(st), slot = -1
    cdef Slot *ps
    cdef int rc
    memcpy(&st.arena.tokens[<size_t>ce * st.arena.entry_cap], &st.arena.tokens[<size_t>pe * st.arena.entry_cap],
           <size_t>par.req.num_tokens * sizeof(uint32_t))
    ch.req.num_tokens = par.req.num_tokens
    st.ids.count += 1
    if par.at.state == SR_RUNNING and row >= 0 and st.pg.s.active < st.pg.s.max_requests:
        ps = &st.pg.s.slots[par.at.slot]
        if ps.state != QUALIA_STATE_DECODE:
            # fork takes decoding requests only: the parent's prefill is complete
            slot_set_decode(st.pg.s, par.at.slot)
            ps.next_token_id = 0
            ps.token_ready = 1
        rc = facade_fork(st.pg.s, st.pg.p, st.pg.c, st.pg.ss, st.lim.mode == MODE_AUTO, par.at.slot, ch.req.rid,
                         &slot)
        if rc:
            return rc       # cannot happen: a slot is free and the pages are held
        ch.at.state = SR_RUNNING
        ch.at.slot = slot
        ch.at.num_computed = par.at.num_computed
        st.run.admissions += 1
        ch.at.admitted = st.run.admissions
        ch.at.row = row
        ch.at.row_fresh = 1
        st.run.row_owner[row] = ce
        st.run.ents[st.run.n] = ce
        st.run.n += 1
        st.groups.forks += 1
        # always: an update forks each n child once (<= max_queued) and beam children that
        # live past it (<= max_seqs); children that finish at once free their rows for more
        if st.done.n_fork_acc < st.done.accum_cap:
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


# -- beam groups (docs/DESIGN.md, "Beam search at the step level") -------------------------------

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


cdef inline void beam_unindex(StepState *st, int32_t e) noexcept nogil:
    if not st.ent[e].req.unindexed:
        oa_remove(st.ids.index, st.ids.index_mask, _step_home(st, st.ent[e].req.rid), e, _step_home_of, st)
        st.ent[e].req.unindexed = 1


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
    # The twin's _select: when every live beam of group g has its candidates (running and
    # computed, or parked), the best w - hypotheses candidates are kept; each either finishes a
    # hypothesis (stored in an entry of the group) or continues a beam (the first continuation
    # of a beam takes the beam itself, each further one forks a child).  No live continuation:
    # the group is done (st.done.ents).  Allocates nothing.
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
        memcpy(&st.arena.tokens[<size_t>d * st.arena.entry_cap], &st.arena.tokens[<size_t>src * st.arena.entry_cap],
               <size_t>x.req.num_tokens * sizeof(uint32_t))
        st.ent[d].req.rid = x.req.rid
        st.ent[d].req.num_prompt = x.req.num_prompt
        st.ent[d].req.num_tokens = x.req.num_tokens
        st.ent[d].req.unindexed = 1
        st.beams.sel[i].dest = d
    for i in range(nk):
        if st.beams.sel[i].reason == FIN_NONE:
            continue
        d = st.beams.sel[i].dest
        x = &st.ent[d]
        if d == st.beams.sel[i].beam:
            beam_unindex(st, d)
            x.mem.in_sel = 0
        st.arena.tokens[<size_t>d * st.arena.entry_cap + x.req.num_tokens] = st.beams.sel[i].tok
        x.req.num_tokens += 1
        x.at.state = SR_MEMBER_DONE
        x.mem.group = g
        x.at.slot = -1
        x.at.row = -1
        x.at.heap_pos = -1
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
        while step_find(st, x.req.rid) >= 0:
            x.req.rid = st.ids.next_child
            st.ids.next_child += 1
        x.req.nsb_borrowed = 1
        x.req.unindexed = 0
        x.at.heap_pos = -1
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
        st.arena.tokens[<size_t>d * st.arena.entry_cap + x.req.num_tokens] = st.beams.sel[i].tok
        if st.lim.mode == MODE_AUTO and x.at.state == SR_RUNNING:
            auto_note_token(st.pg.s, st.pg.ss, <uint32_t>x.at.slot, x.req.num_tokens, st.beams.sel[i].tok)
        x.req.num_tokens += 1
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
    # The twin's _park_blocked_beams, after a step that scheduled nothing: every running beam
    # (each is computed and waits for a sibling) is parked with its candidates, not reported
    # as preempted, groups in add order and beams in member order
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
    if not st.plan.pending:
        return Q_NO_PLAN
    for j in range(st.plan.n):
        e = st.plan.plan_entry[j]
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
        if st.lim.mode == MODE_AUTO:
            auto_fill(st.pg.s, st.pg.p, st.pg.c, st.pg.ss, <uint32_t>r.at.slot)
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
                st.beams.cand_lps[dst + c] = tk_lps[src + c] if tk_lps != NULL else tk_lps_f[src + c]
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
    st.plan.pending = False
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


cdef int step_discard(StepState *st) noexcept nogil:
    # drop the pending plan: reserved pages stay with their requests, nothing advances.  Its
    # changed rows and finished ids are reported again by the next plan (a backend whose
    # execution failed may not have applied them); the caller made room in fin_accum.  The
    # requests aborted while it was pending hand their pages back (a pool error: its code).
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
        st.run.row_dirty[st.buf.changed_rows[j]] = 1
    if st.plan.n_finished and st.done.n_accum + st.plan.n_finished <= st.done.accum_cap:
        memmove(&st.done.fin_accum[st.plan.n_finished], st.done.fin_accum, st.done.n_accum * sizeof(uint64_t))
        memcpy(st.done.fin_accum, st.buf.finished_ids, st.plan.n_finished * sizeof(uint64_t))
        st.done.n_accum += st.plan.n_finished
    if st.plan.n_forks and st.done.n_fork_acc + st.plan.n_forks <= st.done.accum_cap:
        # no update ran since the plan: nothing forked since, in practice
        memmove(&st.done.fork_acc[2 * st.plan.n_forks], st.done.fork_acc, 2 * st.done.n_fork_acc * sizeof(uint64_t))
        for j in range(st.plan.n_forks):
            st.done.fork_acc[2 * j] = st.buf.fork_child_ids[j]
            st.done.fork_acc[2 * j + 1] = st.buf.fork_parent_ids[j]
        st.done.n_fork_acc += st.plan.n_forks
    st.plan.n_forks = 0
    rc = release_deferred(st)
    st.plan.pending = False
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
    r.req.arrival = st.ids.arrivals
    st.ids.arrivals += 1
    r.req.priority = priority
    r.req.nsh = nsh
    r.req.nsb = nsb
    r.req.nsl = nsl
    r.req.num_prompt = n
    r.req.num_tokens = n
    r.req.max_new = max_new
    r.req.has_eos = has_eos
    r.req.eos = eos
    r.req.ignore_eos = ignore_eos
    r.req.n_stop = n_stop
    if n_stop:
        memcpy(r.req.stop, stop, n_stop * sizeof(uint32_t))
    r.at.slot = -1
    r.at.row = -1
    r.at.heap_pos = -1
    r.at.plan_pos = -1
    r.mem.group = -1
    r.mem.next_member = -1
    memcpy(&st.arena.tokens[<size_t>e * st.arena.entry_cap], tok, <size_t>n * sizeof(uint32_t))
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
        r.req.nsb_borrowed = r.req.nsb != NULL
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
            while step_find(st, cid) >= 0:
                cid = st.ids.next_child
                st.ids.next_child += 1
            st.ids.n_free -= 1
            c = st.ids.free_ids[st.ids.n_free]
            ch = &st.ent[c]
            ch[0] = st.ent[e]
            ch.req.rid = cid
            ch.req.nsb_borrowed = ch.req.nsb != NULL
            ch.at.heap_pos = -1
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
    st.lim.budget = budget
    st.lim.max_seqs = max_seqs
    st.lim.max_chunk = max_chunk
    st.lim.max_queued = max_queued
    st.lim.page_tokens = page_tokens
    st.lim.logical_pages = lp
    st.arena.entry_cap = <uint32_t>entry_cap
    st.lim.vocab = vocab
    st.lim.mode = mode
    st.pg.s = s
    st.pg.p = p
    st.pg.c = c
    st.pg.ss = ss
    st.pg.undo = undo
    st.pg.cow = cow
    st.pg.pages_copied = copied
    st.pg.pages_allocated = allocated
    # entries and beam-group records (at most max_queued each) at load <= 1/2
    while cap < 4 * <size_t>max_queued:
        cap <<= 1
    st.ids.index_mask = <uint32_t>(cap - 1)
    st.ent = <StepEntry *>PyMem_Calloc(2 * <size_t>max_queued, sizeof(StepEntry))
    st.arena.tokens = <uint32_t *>PyMem_Malloc(max(<size_t>max_queued * entry_cap, 1) * sizeof(uint32_t))
    st.ids.free_ids = <int32_t *>PyMem_Malloc(max_queued * sizeof(int32_t))
    st.ids.index = <int32_t *>PyMem_Malloc(cap * sizeof(int32_t))
    st.wait.heap = <int32_t *>PyMem_Malloc(max_queued * sizeof(int32_t))
    st.run.ents = <int32_t *>PyMem_Malloc(max_seqs * sizeof(int32_t))
    st.run.row_owner = <int32_t *>PyMem_Malloc(max_seqs * sizeof(int32_t))
    st.run.row_dirty = <uint8_t *>PyMem_Calloc(max_seqs, 1)
    st.run.row_len = <uint32_t *>PyMem_Calloc(max_seqs, sizeof(uint32_t))
    st.run.order = <int32_t *>PyMem_Malloc(max_seqs * sizeof(int32_t))
    st.plan.plan_entry = <int32_t *>PyMem_Malloc(max_seqs * sizeof(int32_t))
    st.plan.plan_chunk = <uint32_t *>PyMem_Malloc(max_seqs * sizeof(uint32_t))
    st.plan.plan_sample = <int32_t *>PyMem_Malloc(max_seqs * sizeof(int32_t))
    st.plan.plan_alive = <uint8_t *>PyMem_Malloc(max_seqs)
    st.plan.deferred_slot = <int32_t *>PyMem_Malloc(max_seqs * sizeof(int32_t))
    st.done.ents = <int32_t *>PyMem_Malloc(max_queued * sizeof(int32_t))
    st.plan.rows_cap = max_queued
    st.ids.next_child = (<uint64_t>1) << 63
    st.plan.sampled = <uint32_t *>PyMem_Malloc(max_queued * sizeof(uint32_t))
    st.done.accum_cap = max_queued + max_seqs
    st.done.fin_accum = <uint64_t *>PyMem_Malloc(st.done.accum_cap * sizeof(uint64_t))
    st.done.fork_acc = <uint64_t *>PyMem_Malloc(2 * <size_t>st.done.accum_cap * sizeof(uint64_t))
    st.ids.rec_free = <int32_t *>PyMem_Malloc(max_queued * sizeof(int32_t))
    st.beams.sel = <SelCand *>PyMem_Malloc(max_seqs * sizeof(SelCand))
    st.beams.sel_groups = <int32_t *>PyMem_Malloc(max_seqs * sizeof(int32_t))
    st.beams.beam_head = st.beams.beam_tail = -1
    if (st.ids.rec_free == NULL or st.beams.sel == NULL or st.beams.sel_groups == NULL or st.ent == NULL
            or st.arena.tokens == NULL or st.ids.free_ids == NULL or st.ids.index == NULL
            or st.wait.heap == NULL or st.run.ents == NULL or st.run.row_owner == NULL
            or st.run.row_dirty == NULL or st.run.row_len == NULL or st.run.order == NULL
            or st.plan.plan_entry == NULL or st.plan.plan_chunk == NULL or st.plan.plan_sample == NULL
            or st.plan.plan_alive == NULL or st.plan.deferred_slot == NULL or st.done.ents == NULL
            or st.plan.sampled == NULL or st.done.fin_accum == NULL or st.done.fork_acc == NULL):
        raise MemoryError(f"cannot allocate the engine step's state for {max_queued} requests "
                          f"of {entry_cap} tokens")
    for i in range(max_queued):
        st.ids.free_ids[i] = <int32_t>(max_queued - 1 - i)   # entry 0 is taken first
    st.ids.n_free = max_queued
    for i in range(max_queued):
        st.ids.rec_free[i] = <int32_t>(2 * max_queued - 1 - i)
    st.ids.n_rec_free = max_queued
    for i in range(cap):
        st.ids.index[i] = -1
    for i in range(max_seqs):
        st.run.row_owner[i] = -1
    st.plan.copies_cap = budget // page_tokens + 2 * max_seqs + 1
    st.buf.request_ids = <uint64_t *>bufs.add("request_ids", _DT_PLAN_U64, max_seqs)
    st.buf.query_start_loc = <int32_t *>bufs.add("query_start_loc", _DT_PLAN_I32, max_seqs + 1)
    st.buf.seq_lens = <int32_t *>bufs.add("seq_lens", _DT_PLAN_I32, max_seqs)
    st.buf.input_ids = <uint32_t *>bufs.add("input_ids", _DT_U32, budget)
    st.buf.positions = <int32_t *>bufs.add("positions", _DT_PLAN_I32, budget)
    st.buf.slot_mapping = <int64_t *>bufs.add("slot_mapping", _DT_PLAN_I64, budget)
    st.buf.logits_indices = <int32_t *>bufs.add("logits_indices", _DT_PLAN_I32, max_queued)
    st.buf.sampled_request_ids = <uint64_t *>bufs.add("sampled_request_ids", _DT_PLAN_U64,
                                                  max_queued)
    st.buf.block_table = <int32_t *>bufs.add("block_table", _DT_PLAN_I32, <Py_ssize_t>max_seqs * lp)
    st.buf.block_table_rows = <int32_t *>bufs.add("block_table_rows", _DT_PLAN_I32, max_seqs)
    st.buf.changed_rows = <int32_t *>bufs.add("changed_rows", _DT_PLAN_I32, max_seqs)
    st.buf.kv_indptr = <int32_t *>bufs.add("kv_indptr", _DT_PLAN_I32, max_seqs + 1)
    st.buf.kv_indices = <int32_t *>bufs.add("kv_indices", _DT_PLAN_I32, <Py_ssize_t>max_seqs * lp)
    st.buf.kv_last_page_len = <int32_t *>bufs.add("kv_last_page_len", _DT_PLAN_I32, max_seqs)
    st.buf.copies = <qualia_copy_op *>bufs.add("copies", _DT_COPY, st.plan.copies_cap)
    st.buf.new_ids = <uint64_t *>bufs.add("new_request_ids", _DT_PLAN_U64, max_seqs)
    st.buf.preempted_ids = <uint64_t *>bufs.add("preempted_request_ids", _DT_PLAN_U64, max_seqs)
    st.buf.finished_ids = <uint64_t *>bufs.add("finished_request_ids", _DT_PLAN_U64, st.done.accum_cap)
    st.buf.fork_child_ids = <uint64_t *>bufs.add("fork_child_ids", _DT_PLAN_U64, st.done.accum_cap)
    st.buf.fork_parent_ids = <uint64_t *>bufs.add("fork_parent_ids", _DT_PLAN_U64, st.done.accum_cap)
    st.buf.finished_cap = st.done.accum_cap
    for i in range(<uint32_t>(max_seqs * lp)):
        st.buf.block_table[i] = -1
    bufs.full["block_table"] = bufs.full["block_table"].reshape(max_seqs, lp)
    return 0


cdef void step_free(StepState *st) noexcept:
    cdef uint32_t e
    if st.ent != NULL:
        for e in range(2 * st.lim.max_queued):
            if st.ent[e].req.nsb != NULL and not st.ent[e].req.nsb_borrowed:
                free(st.ent[e].req.nsb)
    PyMem_Free(st.ent)
    PyMem_Free(st.arena.tokens)
    PyMem_Free(st.ids.free_ids)
    PyMem_Free(st.ids.index)
    PyMem_Free(st.wait.heap)
    PyMem_Free(st.run.ents)
    PyMem_Free(st.run.row_owner)
    PyMem_Free(st.run.row_dirty)
    PyMem_Free(st.run.row_len)
    PyMem_Free(st.run.order)
    PyMem_Free(st.plan.plan_entry)
    PyMem_Free(st.plan.plan_chunk)
    PyMem_Free(st.plan.plan_sample)
    PyMem_Free(st.plan.plan_alive)
    PyMem_Free(st.plan.deferred_slot)
    PyMem_Free(st.done.ents)
    PyMem_Free(st.plan.sampled)
    PyMem_Free(st.done.fin_accum)
    PyMem_Free(st.done.fork_acc)
    PyMem_Free(st.ids.rec_free)
    PyMem_Free(st.beams.sel)
    PyMem_Free(st.beams.sel_groups)
    PyMem_Free(st.beams.cand_ids)
    PyMem_Free(st.beams.cand_lps)
    PyMem_Free(st.beams.topk_ids_buf)
    PyMem_Free(st.beams.topk_lps_buf)
    memset(st, 0, sizeof(StepState))


cdef object step_plan(StepState *st, _StepBuffers bufs):
    """The pending plan as a StepPlan of slices of the buffers' views."""
    cdef StepPlan plan = StepPlan.__new__(StepPlan)
    cdef Py_ssize_t n = st.plan.n, T = st.plan.T, m = st.plan.m
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
    plan.changed_rows = bufs.view("changed_rows", st.plan.n_changed)
    plan.kv_indptr = bufs.view("kv_indptr", n + 1)
    plan.kv_indices = bufs.view("kv_indices", st.plan.n_kv)
    plan.kv_last_page_len = bufs.view("kv_last_page_len", n)
    plan.copies = bufs.view("copies", st.plan.n_copies)
    plan.new_request_ids = bufs.view("new_request_ids", st.plan.n_new)
    plan.preempted_request_ids = bufs.view("preempted_request_ids", st.plan.n_preempted)
    plan.finished_request_ids = bufs.view("finished_request_ids", st.plan.n_finished)
    plan.fork_child_ids = bufs.view("fork_child_ids", st.plan.n_forks)
    plan.fork_parent_ids = bufs.view("fork_parent_ids", st.plan.n_forks)
    plan.num_prefill_tokens = st.plan.num_prefill_tokens
    plan.num_decode_tokens = st.plan.num_decode_tokens
    plan.num_cached_tokens = st.plan.num_cached_tokens
    plan.page_tokens = st.lim.page_tokens
    plan.num_topk = st.plan.num_topk
    return plan


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
            out.append(FinishedRequest(r.req.rid, _step_output(st, e), _FINISH_REASONS[r.req.reason]))
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


cdef object _step_output(StepState *st, int32_t e):
    cdef StepEntry *r = &st.ent[e]
    cdef uint32_t[::1] v
    arr = np.empty(r.req.num_tokens - r.req.num_prompt, dtype=np.uint32)
    v = arr
    if r.req.num_tokens > r.req.num_prompt:
        memcpy(&v[0], &st.arena.tokens[<size_t>e * st.arena.entry_cap + r.req.num_prompt],
               (r.req.num_tokens - r.req.num_prompt) * sizeof(uint32_t))
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
    row.num_seqs = st.plan.n
    row.num_tokens = st.plan.T
    row.num_prefill_tokens = st.plan.num_prefill_tokens
    row.num_decode_tokens = st.plan.num_decode_tokens
    row.num_sampled = st.plan.m
    row.num_new = st.plan.n_new
    row.num_preempted = st.plan.n_preempted
    row.num_cached_tokens = st.plan.num_cached_tokens
    row.num_finished = finished
    row.num_waiting = st.wait.n
    row.num_running = st.run.n
    row.free_pages = st.pg.p.free_top + st.pg.c.n_state[PC_RECLAIMABLE]


# -- the loop without the GIL, for a C step backend --------------------------------------------

cdef void step_abi_plan(StepState *st, qualia_step_plan *p) noexcept nogil:
    # the pending plan as the ABI struct: pointers into the buffers sized at construction
    p.struct_size = sizeof(qualia_step_plan)
    p.page_tokens = st.lim.page_tokens
    p.num_requests = st.plan.n
    p.num_tokens = st.plan.T
    p.num_sampled = st.plan.m
    p.num_prefill_tokens = st.plan.num_prefill_tokens
    p.num_decode_tokens = st.plan.num_decode_tokens
    p.num_kv_indices = st.plan.n_kv
    p.block_table_num_rows = st.lim.max_seqs
    p.block_table_num_cols = st.lim.logical_pages
    p.block_table_row_stride = st.lim.logical_pages
    p.num_changed_rows = st.plan.n_changed
    p.num_copies = st.plan.n_copies
    p.num_new = st.plan.n_new
    p.num_preempted = st.plan.n_preempted
    p.num_finished = st.plan.n_finished
    p.request_ids = st.buf.request_ids
    p.query_start_loc = st.buf.query_start_loc
    p.seq_lens = st.buf.seq_lens
    p.input_ids = st.buf.input_ids
    p.positions = st.buf.positions
    p.slot_mapping = st.buf.slot_mapping
    p.logits_indices = st.buf.logits_indices
    p.sampled_request_ids = st.buf.sampled_request_ids
    p.block_table = st.buf.block_table
    p.block_table_rows = st.buf.block_table_rows
    p.changed_rows = st.buf.changed_rows
    p.kv_indptr = st.buf.kv_indptr
    p.kv_indices = st.buf.kv_indices
    p.kv_last_page_len = st.buf.kv_last_page_len
    p.copies = st.buf.copies
    p.new_request_ids = st.buf.new_ids
    p.preempted_request_ids = st.buf.preempted_ids
    p.finished_request_ids = st.buf.finished_ids
    p.num_topk = st.plan.num_topk
    p.num_forks = st.plan.n_forks
    p.fork_child_ids = st.buf.fork_child_ids
    p.fork_parent_ids = st.buf.fork_parent_ids
    p.topk_ids_out = st.beams.topk_ids_buf if st.plan.num_topk else NULL
    p.topk_logprobs_out = st.beams.topk_lps_buf if st.plan.num_topk else NULL


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
    cdef uint64_t limit = st.lim.vocab - 1 if st.lim.vocab else U32_MAX
    while st.ids.count and k < max_steps:
        rc = step_schedule(st)
        if rc:
            break
        if st.plan.num_topk and (not (cb.flags & QUALIA_STEP_WRITES_TOPK)
                            or <size_t>st.plan.m * st.plan.num_topk > st.beams.topk_cap):
            step_discard(st)
            rc = Q_RUN_NO_TOPK
            break
        step_abi_plan(st, &plan)
        # the sampled ids are poisoned as the candidates are: a backend that returns 0 without
        # writing a row fails the step instead of handing the previous step's ids (or, at the
        # first step, whatever the buffer held) to the update.  U32_MAX is no token id a step
        # backend may return (qualia.h)
        for i in range(st.plan.m):
            st.plan.sampled[i] = U32_MAX
        if st.plan.num_topk:
            # a backend that declares the flag but leaves candidates unwritten fails the step
            # (the check below) instead of handing the previous step's to the selection
            for j in range(<size_t>st.plan.m * st.plan.num_topk):
                st.beams.topk_ids_buf[j] = 0
                st.beams.topk_lps_buf[j] = <float>NAN
        s = 0
        if cb.copy_pages != NULL and st.plan.n_copies:
            s = cb.copy_pages(cb.ctx, st.buf.copies, st.plan.n_copies)
        if s == 0:
            s = cb.execute_step(cb.ctx, &plan, st.plan.sampled, NULL)
        if s != 0:
            step_discard(st)
            status[0] = s
            rc = Q_RUN_BACKEND_FAILED
            break
        for i in range(st.plan.m):
            if st.plan.sampled[i] == U32_MAX or st.plan.sampled[i] > limit:
                step_discard(st)
                status[0] = <int32_t>i
                token[0] = st.plan.sampled[i]
                rc = Q_RUN_UNWRITTEN if st.plan.sampled[i] == U32_MAX else Q_RUN_BAD_TOKEN
                break
        if rc:
            break
        if st.plan.num_topk:
            for j in range(<size_t>st.plan.m * st.plan.num_topk):
                if st.beams.topk_ids_buf[j] > limit:
                    step_discard(st)
                    status[0] = <int32_t>(j // st.plan.num_topk)
                    rc = Q_RUN_BAD_TOPK
                    break
            if rc:
                break
            i = <uint32_t>step_check_topk(st, st.beams.topk_ids_buf, NULL, st.beams.topk_lps_buf, &row)
            if i:
                step_discard(st)
                status[0] = <int32_t>row
                rc = (Q_RUN_BAD_TOPK_LOGPROB if i == TOPK_BAD_LOGPROB else
                      Q_RUN_REPEATED_TOPK if i == TOPK_REPEATED else Q_RUN_UNSORTED_TOPK)
                break
        done = st.done.n
        rc = step_update(st, st.plan.sampled, st.beams.topk_ids_buf, NULL, st.beams.topk_lps_buf)
        step_stat(st, &stat, st.done.n - done)
        stats_note(&stat, ring, ring_rows, head, totals)
        k += 1
        if rc or _coarse_now_ns() >= deadline_ns:
            break
    steps[0] = k
    return rc
