# StepState: the engine step's state, every concept's part composed, all of it allocated once
# by step_init (sized by the limits) and freed by step_free.  step_schedule, step_update and
# step_run are `noexcept nogil` and return status codes: StepScheduler.run() loops schedule ->
# execute -> update without the GIL for a C step backend.

cdef struct StepLimits:
    uint32_t budget         # max_num_batched_tokens
    uint32_t max_seqs       # max_num_seqs: slots and rows of the block table, requests of a plan
    uint32_t max_chunk      # max_prefill_chunk (0: only the budget limits a chunk)
    uint32_t max_queued
    uint32_t page_tokens
    uint32_t pt_shift       # log2(page_tokens) when it is a power of two (pt_div)
    uint8_t pt_pow2
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
    StepCopies cp           # copy-on-write copies owed until a plan listing them is applied
    StepDone done           # what finished, was aborted or forked since the previous plan
    StepGroups groups       # n groups
    StepBeams beams         # beam groups


cdef inline uint32_t pt_div(StepState *st, uint64_t x) noexcept nogil:
    # x // page_tokens: a shift for the usual power-of-two page (a division takes tens of cycles)
    if st.lim.pt_pow2:
        return <uint32_t>(x >> st.lim.pt_shift)
    return <uint32_t>(x // st.lim.page_tokens)


cdef inline uint64_t token_limit(StepState *st) noexcept nogil:
    # the largest token id a step takes as sampled or as a candidate: below vocab_size, and
    # never 0xFFFFFFFF, which is no token id (a C step backend's sampled ids are set to it
    # before each call: qualia.h), whichever way the id comes
    return st.lim.vocab - 1 if st.lim.vocab else U32_MAX - 1


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
    st.lim.pt_pow2 = page_shift(page_tokens, &st.lim.pt_shift)
    st.lim.logical_pages = lp
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
    # entries and beam-group records (at most max_queued each), their index at load <= 1/2
    while cap < 4 * <size_t>max_queued:
        cap <<= 1
    # 64-byte aligned: each entry's decode fields share one cache line (StepEntry)
    st.ent = <StepEntry *>qualia_big_zalloc(2 * <size_t>max_queued * sizeof(StepEntry))
    st.ids.index = <int32_t *>PyMem_Malloc(cap * sizeof(int32_t))
    st.ids.index_mask = <uint32_t>(cap - 1)
    st.ids.free_ids = <int32_t *>PyMem_Malloc(max_queued * sizeof(int32_t))
    st.ids.rec_free = <int32_t *>PyMem_Malloc(max_queued * sizeof(int32_t))
    st.ids.next_child = (<uint64_t>1) << 63
    st.arena.entry_cap = <uint32_t>entry_cap
    st.arena.tokens = <uint32_t *>qualia_big_zalloc(max(<size_t>max_queued * entry_cap, 1)
                                                    * sizeof(uint32_t))
    st.wait.heap = <int32_t *>PyMem_Malloc(max_queued * sizeof(int32_t))
    st.run.ents = <int32_t *>PyMem_Malloc(max_seqs * sizeof(int32_t))
    st.run.order = <int32_t *>PyMem_Malloc(max_seqs * sizeof(int32_t))
    st.run.order_pre = <int32_t *>PyMem_Malloc(max_seqs * sizeof(int32_t))
    st.run.row_owner = <int32_t *>PyMem_Malloc(max_seqs * sizeof(int32_t))
    st.run.dirty = <uint64_t *>PyMem_Calloc((max_seqs + 63) // 64, sizeof(uint64_t))
    st.run.row_len = <uint32_t *>PyMem_Calloc(max_seqs, sizeof(uint32_t))
    st.plan.plan_entry = <int32_t *>PyMem_Malloc(max_seqs * sizeof(int32_t))
    st.plan.plan_chunk = <uint32_t *>PyMem_Malloc(max_seqs * sizeof(uint32_t))
    st.plan.plan_sample = <int32_t *>PyMem_Malloc(max_seqs * sizeof(int32_t))
    st.plan.plan_alive = <uint8_t *>PyMem_Malloc(max_seqs)
    st.plan.fill_rows = <uint32_t *>PyMem_Malloc(max_seqs * sizeof(uint32_t))
    st.plan.deferred_slot = <int32_t *>PyMem_Malloc(max_seqs * sizeof(int32_t))
    st.plan.rows_cap = max_queued
    st.plan.sampled = <uint32_t *>PyMem_Malloc(max_queued * sizeof(uint32_t))
    st.plan.copies_cap = budget // page_tokens + 2 * max_seqs + 1
    st.done.accum_cap = max_queued + max_seqs
    st.done.fin_accum = <uint64_t *>PyMem_Malloc(st.done.accum_cap * sizeof(uint64_t))
    st.done.fork_cap = st.done.accum_cap
    st.done.fork_acc = <uint64_t *>PyMem_Malloc(2 * <size_t>st.done.fork_cap * sizeof(uint64_t))
    st.done.ents = <int32_t *>PyMem_Malloc(max_queued * sizeof(int32_t))
    st.beams.sel = <SelCand *>PyMem_Malloc(max_seqs * sizeof(SelCand))
    st.beams.sel_groups = <int32_t *>PyMem_Malloc(max_seqs * sizeof(int32_t))
    st.beams.beam_head = st.beams.beam_tail = -1
    if (st.ent == NULL or st.ids.index == NULL or st.ids.free_ids == NULL
            or st.ids.rec_free == NULL or st.arena.tokens == NULL or st.wait.heap == NULL
            or st.run.ents == NULL or st.run.order == NULL or st.run.order_pre == NULL
            or st.run.row_owner == NULL
            or st.run.dirty == NULL or st.run.row_len == NULL or st.plan.plan_entry == NULL
            or st.plan.plan_chunk == NULL or st.plan.plan_sample == NULL
            or st.plan.plan_alive == NULL or st.plan.fill_rows == NULL
            or st.plan.deferred_slot == NULL
            or st.plan.sampled == NULL or st.done.fin_accum == NULL or st.done.fork_acc == NULL
            or st.done.ents == NULL or st.beams.sel == NULL or st.beams.sel_groups == NULL):
        raise MemoryError(f"cannot allocate the engine step's state for {max_queued} requests "
                          f"of {entry_cap} tokens")
    for i in range(cap):
        st.ids.index[i] = -1
    for i in range(max_queued):
        st.ids.free_ids[i] = <int32_t>(max_queued - 1 - i)   # entry 0 is taken first
        st.ids.rec_free[i] = <int32_t>(2 * max_queued - 1 - i)
    st.ids.n_free = max_queued
    st.ids.n_rec_free = max_queued
    for i in range(max_seqs):
        st.run.row_owner[i] = -1
    plan_buffers_init(st, bufs)
    copies_init(st)
    return 0


cdef void step_free(StepState *st) noexcept:
    cdef uint32_t e
    if st.ent != NULL:
        for e in range(2 * st.lim.max_queued):
            if st.ent[e].names.nsb != NULL and not st.ent[e].names.nsb_borrowed:
                free(st.ent[e].names.nsb)
    qualia_big_free(st.ent)
    qualia_big_free(st.arena.tokens)
    PyMem_Free(st.ids.free_ids)
    PyMem_Free(st.ids.index)
    PyMem_Free(st.wait.heap)
    PyMem_Free(st.run.ents)
    PyMem_Free(st.run.row_owner)
    PyMem_Free(st.run.dirty)
    PyMem_Free(st.run.row_len)
    PyMem_Free(st.run.order)
    PyMem_Free(st.run.order_pre)
    PyMem_Free(st.plan.plan_entry)
    PyMem_Free(st.plan.plan_chunk)
    PyMem_Free(st.plan.plan_sample)
    PyMem_Free(st.plan.plan_alive)
    PyMem_Free(st.plan.fill_rows)
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
    copies_free(st)
    memset(st, 0, sizeof(StepState))
