# The plan (docs/DESIGN.md, "The engine step", "The plan"): its state while built and pending,
# its arrays (buffers sized at construction), their lowering from the scheduled entries, and the
# two views of a pending plan: the Python StepPlan (read-only numpy slices) and the C ABI's
# qualia_step_plan (pointers, for a C step backend).

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
    uint32_t overrun        # the PB_* buffer a Q_PLAN_OVERRUN refused to overrun
    uint8_t csr             # the pending plan's CSR form is built (plan_csr)
    int32_t *plan_entry     # max_seqs
    uint32_t *plan_chunk    # max_seqs
    int32_t *plan_sample    # max_seqs: sampled row or -1
    uint8_t *plan_alive     # max_seqs: 0 once aborted after schedule
    uint32_t *fill_rows     # max_seqs: the rows whose chunk completes a page (auto mode), in
    uint32_t n_fill_rows    # order: update() prefetches their fills ahead
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
    # Guards: every write into a plan buffer (and into the plan's own per-request arrays) first
    # checks its count against cap[PB_*], in release builds too, and refuses the step with
    # Q_PLAN_OVERRUN instead of writing past the buffer.  The scheduler's limits make an overrun
    # impossible (a chunk fits the budget, a plan has at most max_num_seqs requests, ...): a
    # guard that fires is a broken invariant, caught before it corrupts memory.  size[PB_*] is
    # what was allocated; cap[] equals it except where a test hook narrows it
    # (StepScheduler._debug_plan_capacity).
    uint32_t cap[PB_KINDS]
    uint32_t size[PB_KINDS]


cdef inline int plan_overrun(StepState *st, uint32_t kind) noexcept nogil:
    # a guard refused a write into buffer `kind`: the step fails with Q_PLAN_OVERRUN
    st.plan.overrun = kind
    return Q_PLAN_OVERRUN


cdef inline int plan_add(StepState *st, int32_t e, uint32_t n) noexcept nogil:
    cdef uint32_t j = st.plan.n
    if j >= st.buf.cap[PB_SEQS]:
        return plan_overrun(st, PB_SEQS)
    st.plan.plan_entry[j] = e
    st.plan.plan_chunk[j] = n
    st.plan.plan_alive[j] = 1
    st.ent[e].at.plan_pos = <int32_t>j
    st.ent[e].at.sched_step = st.plan.step_no
    st.plan.n += 1
    return Q_OK


cdef inline void _lower_run(int32_t *positions, int64_t *slot_mapping, uint32_t pos, int64_t sm,
                            uint32_t run) noexcept nogil:
    # the positions and slots of `run` tokens of one page from position `pos` and slot `sm`: a
    # whole page of the common size in fixed vector stores; any other run in two loops through
    # pointers, each with a counter of its array's width, which the compiler may vectorise (a
    # u32 index may wrap, which keeps a loop scalar), though for a run as short as a page their
    # setup costs about what vectors save (16-token pages through these loops: 5.57 M
    # instructions in the mixed workload, beside 4.35 M through the fixed stores)
    cdef uint32_t k
    cdef int64_t k64
    if run == 16:
        qualia_lower_page16(positions, slot_mapping, pos, sm)
        return
    for k in range(run):
        positions[k] = <int32_t>(pos + k)
    for k64 in range(<int64_t>run):
        slot_mapping[k64] = sm + k64


cdef inline void _prefetch_lower(StepState *st, const int32_t *plan_entry, uint32_t j,
                                 uint32_t n_plan) noexcept nogil:
    # a plan of many rows: what lowering row j + ROWS_AHEAD reads at random (the block-table
    # entry of its first position), and the entry of row j + 2 * ROWS_AHEAD, which the
    # former's load finds in cache when that row's turn comes (hints only)
    cdef StepEntry *r = &st.ent[plan_entry[j + ROWS_AHEAD]]
    if r.at.slot >= 0:
        qualia_prefetch_r(st.pg.s.slots[r.at.slot].blocks.entries + pt_div(st, r.at.num_computed))
    if j + 2 * ROWS_AHEAD < n_plan:
        prefetch_entry(st, plan_entry[j + 2 * ROWS_AHEAD])


cdef int plan_lower(StepState *st) noexcept nogil:
    # The scheduled entries (plan_entry / plan_chunk) lowered into the plan's arrays, in plan
    # order: ids, lengths, input ids from the arena, positions and slot mapping, the sampled rows
    # (an n group's prompt once per member), the rows that changed; then what finished, was
    # aborted or forked since the previous plan.  The CSR form is built on request (plan_csr).
    # Each write is guarded (see PlanBuffers); a guard that fires returns Q_PLAN_OVERRUN before
    # anything is taken from the accumulators or the dirty rows (a forked child's fresh row was
    # written and marked dirty already: the next plan reports it), so the failed step leaves
    # what a discarded plan does.  The plan's counters and the buffers' pointers are held in
    # locals (a store through one buffer pointer could alias any field of *st otherwise).
    cdef uint32_t i, j, n, q, pos, lp, off, run, k, w
    cdef uint32_t pt = st.lim.page_tokens, T = 0, m = 0, topk = 0, ndec = 0, npre = 0
    cdef uint32_t cap_tokens = st.buf.cap[PB_TOKENS], cap_rows = st.buf.cap[PB_ROWS]
    cdef uint32_t n_plan = st.plan.n
    cdef int64_t sm
    cdef int32_t e, v
    cdef uint64_t bits
    cdef StepEntry *r
    cdef StepEntry *ents = st.ent
    cdef Table *tb
    cdef Slot *slots = st.pg.s.slots
    cdef const int32_t *plan_entry = st.plan.plan_entry
    cdef const uint32_t *plan_chunk = st.plan.plan_chunk
    cdef int32_t *plan_sample = st.plan.plan_sample
    cdef uint64_t *request_ids = st.buf.request_ids
    cdef int32_t *seq_lens = st.buf.seq_lens
    cdef int32_t *rows = st.buf.block_table_rows
    cdef int32_t *qsl = st.buf.query_start_loc
    cdef uint32_t *input_ids = st.buf.input_ids
    cdef int32_t *positions = st.buf.positions
    cdef int64_t *slot_mapping = st.buf.slot_mapping
    cdef int32_t *logits = st.buf.logits_indices
    cdef uint64_t *sampled_ids = st.buf.sampled_request_ids
    cdef const uint32_t *tok
    cdef uint32_t *fill_rows = st.plan.fill_rows
    cdef uint32_t nfill = 0
    cdef bint auto = st.lim.mode == MODE_AUTO, deep = n_plan >= DEEP_ROWS
    if n_plan > st.buf.cap[PB_SEQS]:
        return plan_overrun(st, PB_SEQS)
    qsl[0] = 0
    st.plan.n_fill_rows = 0
    st.plan.csr = 0
    for j in range(n_plan):
        if deep and j + ROWS_AHEAD < n_plan:
            _prefetch_lower(st, plan_entry, j, n_plan)
        e = plan_entry[j]
        r = &ents[e]
        n = plan_chunk[j]
        q = r.at.num_computed
        tb = &slots[r.at.slot].blocks
        if n > cap_tokens - T:
            return plan_overrun(st, PB_TOKENS)
        request_ids[j] = r.req.rid
        seq_lens[j] = <int32_t>(q + n)
        rows[j] = r.at.row
        tok = arena_at(st, e) + q
        lp = pt_div(st, q)
        off = q - lp * pt
        if auto and off + n >= pt:
            fill_rows[nfill] = j
            nfill += 1
        if n == 1:
            # a decode (or a 1-token chunk): one token, in one page; the last token is kept in
            # the entry's first line (the arena's line is a cache miss per row in a large step)
            input_ids[T] = r.at.last_token if q + 1 == r.req.num_tokens else tok[0]
            positions[T] = <int32_t>q
            slot_mapping[T] = <int64_t>tb.entries[lp] * pt + off
        else:
            memcpy(&input_ids[T], tok, n * sizeof(uint32_t))
            # positions and slot mapping, a page at a time (no division per token)
            pos = q
            i = T
            while pos < q + n:
                sm = <int64_t>tb.entries[lp] * pt + off
                run = pt - off
                if run > q + n - pos:
                    run = q + n - pos
                _lower_run(&positions[i], &slot_mapping[i], pos, sm, run)
                pos += run
                i += run
                lp += 1
                off = 0
        if r.at.decode:
            ndec += n
        else:
            npre += n
        T += n
        qsl[j + 1] = <int32_t>T
        if r.at.row_fresh:
            # a forked child's first plan: its row takes the whole table (the twin's lowering
            # writes every page of a scheduled request's row)
            row_write(st, e, 0, tb.len - 1 if tb.len else 0)
            r.at.row_fresh = 0
        if q + n == r.req.num_tokens:
            plan_sample[j] = <int32_t>m
            if r.mem.group < 0:
                if m >= cap_rows:
                    return plan_overrun(st, PB_ROWS)
                logits[m] = <int32_t>(T - 1)
                sampled_ids[m] = r.req.rid
                m += 1
            elif r.mem.group == e and not r.mem.forked:
                # the prompt's last row, once per member of the n group, in member order
                v = e
                while v >= 0:
                    if m >= cap_rows:
                        return plan_overrun(st, PB_ROWS)
                    logits[m] = <int32_t>(T - 1)
                    sampled_ids[m] = ents[v].req.rid
                    m += 1
                    v = ents[v].mem.next_member
            else:
                if m >= cap_rows:
                    return plan_overrun(st, PB_ROWS)
                logits[m] = <int32_t>(T - 1)
                sampled_ids[m] = r.req.rid
                m += 1
                if ents[r.mem.group].rec.beam and ents[r.mem.group].mem.n_members > topk:
                    topk = ents[r.mem.group].mem.n_members
        else:
            plan_sample[j] = -1
    st.plan.T = T
    st.plan.n_fill_rows = nfill
    st.plan.m = m
    st.plan.num_topk = topk
    st.plan.num_decode_tokens = ndec
    st.plan.num_prefill_tokens = npre
    # every copy owed, in the order made: a discarded plan's (and a failed schedule's) first
    if st.cp.n > st.buf.cap[PB_COPIES]:
        return plan_overrun(st, PB_COPIES)
    if st.done.n_accum > st.buf.cap[PB_FINISHED]:
        return plan_overrun(st, PB_FINISHED)
    if st.done.n_fork_acc > st.buf.cap[PB_FORKS]:
        return plan_overrun(st, PB_FORKS)
    owed_list(st)
    # (one record per row of max_num_seqs: changed_rows holds them all), ascending, a word of
    # 64 rows at a time
    k = 0
    for w in range((st.lim.max_seqs + 63) >> 6):
        bits = st.run.dirty[w]
        if bits:
            st.run.dirty[w] = 0
            while bits:
                st.buf.changed_rows[k] = <int32_t>((w << 6) + <uint32_t>__builtin_ctzll(bits))
                k += 1
                bits &= bits - 1
    st.plan.n_changed = k
    # the plan reports what finished or was aborted, and the forks made, since the previous plan
    memcpy(st.buf.finished_ids, st.done.fin_accum, st.done.n_accum * sizeof(uint64_t))
    st.plan.n_finished = st.done.n_accum
    st.done.n_accum = 0
    st.done.n_ahead = 0
    for i in range(st.done.n_fork_acc):
        st.buf.fork_child_ids[i] = st.done.fork_acc[2 * i]
        st.buf.fork_parent_ids[i] = st.done.fork_acc[2 * i + 1]
    st.plan.n_forks = st.done.n_fork_acc
    st.done.n_fork_acc = 0
    return Q_OK


cdef int plan_csr(StepState *st) noexcept nogil:
    # The pending plan's paged-KV CSR form, built once on request (a backend that reads it): for
    # each scheduled request, the pages of its block-table row covering seq_lens.  While the
    # plan is pending its requests' rows mirror their pages (a request aborted meanwhile keeps
    # its row until the plan is retired), so the rows and the lengths are all it needs.
    # O(pages of the scheduled requests); guarded like every plan write.
    cdef uint32_t j, pages, seq, n_kv = 0, pt = st.lim.page_tokens
    cdef const int32_t *row
    if st.plan.csr:
        return Q_OK
    if st.plan.n > st.buf.cap[PB_SEQS]:
        return plan_overrun(st, PB_SEQS)
    st.buf.kv_indptr[0] = 0
    for j in range(st.plan.n):
        seq = <uint32_t>st.buf.seq_lens[j]
        pages = (seq + pt - 1) // pt
        if pages > st.buf.cap[PB_KV] - n_kv:
            return plan_overrun(st, PB_KV)
        row = &st.buf.block_table[<size_t>st.buf.block_table_rows[j] * st.lim.logical_pages]
        # page ids are < num_blocks <= 2**31 (the constructor's limit): the int32 row holds them
        memcpy(&st.buf.kv_indices[n_kv], row, pages * sizeof(int32_t))
        n_kv += pages
        st.buf.kv_indptr[j + 1] = <int32_t>n_kv
        st.buf.kv_last_page_len[j] = <int32_t>(seq - (pages - 1) * pt)
    st.plan.n_kv = n_kv
    st.plan.csr = 1
    return Q_OK


cdef class StepPlan:
    """One step's plan (docs/DESIGN.md, "The engine step", "The plan"): read-only numpy views
    over buffers the scheduler sized at construction, valid until its next ``schedule()``."""
    cdef readonly object request_ids
    """uint64 [n]: the scheduled requests in plan order (decodes, running prefill chunks,
    admissions)."""
    cdef readonly object query_start_loc
    """int32 [n+1]: prefix sums of the chunk lengths; request ``i`` computes flat tokens
    ``query_start_loc[i] .. query_start_loc[i+1] - 1``."""
    cdef readonly object seq_lens
    """int32 [n]: each request's context length once this step is done (the keys its attention
    reads)."""
    cdef readonly object input_ids
    """uint32 [T]: the token of each flat row."""
    cdef readonly object positions
    """int32 [T]: the position of each flat row in its request."""
    cdef readonly object slot_mapping
    """int64 [T]: the KV slot each flat row's key and value are written to, ``page * page_tokens +
    position % page_tokens``."""
    cdef readonly object logits_indices
    """int32 [m]: the flat row whose logits each sampled row samples (a decode's token, or the last
    token of a prompt's final chunk)."""
    cdef readonly object sampled_request_ids
    """uint64 [m]: the request (or group member) of each sampled row, what a sampler keys on."""
    cdef readonly object block_table
    """int32 [max_num_seqs, logical_pages]: the persistent dense block table; row
    ``block_table_rows[i]`` lists request ``i``'s pages, -1 past them."""
    cdef readonly object block_table_rows
    """int32 [n]: each scheduled request's row of ``block_table``."""
    cdef readonly object changed_rows
    """int32 [k]: the rows of ``block_table`` written since the previous plan, ascending (a device
    mirror uploads only these)."""
    cdef object _kv_indptr      # the CSR form: built on first read (see kv_indices)
    cdef object _kv_indices
    cdef object _kv_last_page_len
    cdef object _owner          # the StepScheduler whose plan this is
    cdef uint64_t _step_no
    cdef readonly object copies
    """``COPY_OP`` [c]: copy-on-write page copies to perform before the forward pass (distinct
    destinations, none of them a source)."""
    cdef readonly object new_request_ids
    """uint64: requests no applied plan has held yet (admitted in this step, resumed, or named by a
    discarded plan): set up their per-request state."""
    cdef readonly object preempted_request_ids
    """uint64: requests preempted in this step (their pages are gone; they are recomputed when
    admitted again)."""
    cdef readonly object finished_request_ids
    """uint64: requests finished or aborted since the previous plan: drop their per-request
    state."""
    cdef readonly object fork_child_ids
    """uint64 [f]: the copy-on-write forks made since the previous plan, child ids (copy the
    parent's per-request state to each)."""
    cdef readonly object fork_parent_ids
    """uint64 [f]: the parent of each ``fork_child_ids`` entry."""
    cdef readonly uint32_t num_prefill_tokens
    """Flat rows that are prompt (or recomputed) tokens."""
    cdef readonly uint32_t num_decode_tokens
    """Flat rows that are generated tokens fed back (``num_prefill_tokens + num_decode_tokens ==
    num_tokens``)."""
    cdef readonly uint32_t num_cached_tokens
    """Prompt tokens this step's admissions took from the prefix cache instead of computing them."""
    cdef readonly uint32_t page_tokens
    """Token positions per page (the scheduler's ``page_tokens``)."""
    cdef readonly uint32_t num_topk
    """Candidates each sampled row of a beam group needs (``update(ids, topk_ids, topk_logprobs)``);
    0 when the plan has no beam rows."""

    @property
    def kv_indptr(self):
        """The paged-KV CSR form's offsets (int32 [n+1]); see ``kv_indices``."""
        if self._kv_indptr is None:
            _plan_csr_views(self)
        return self._kv_indptr

    @property
    def kv_indices(self):
        """The pages covering each request's ``seq_lens``, request after request (int32).  The
        CSR form (``kv_indptr``, ``kv_indices``, ``kv_last_page_len``) is built on its first
        read, which must come while the plan is pending (before ``update()`` or
        ``discard_plan()``; ``StepError.NoPlan`` otherwise): a step whose backend reads the
        pages through ``block_table`` never pays for it."""
        if self._kv_indices is None:
            _plan_csr_views(self)
        return self._kv_indices

    @property
    def kv_last_page_len(self):
        """Positions used in each request's last page, 1..page_tokens (int32 [n]); see
        ``kv_indices``."""
        if self._kv_last_page_len is None:
            _plan_csr_views(self)
        return self._kv_last_page_len

    @property
    def num_seqs(self):
        """Requests in the plan (``n``)."""
        return len(self.request_ids)

    @property
    def num_tokens(self):
        """Flat token rows in the plan (``T``)."""
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


cdef int plan_buffers_init(StepState *st, _StepBuffers bufs) except -1:
    # the plan's arrays, sized by the limits (the finished-id buffer grows with the accumulator,
    # see StepScheduler._accum_room); the dense block table starts all -1
    cdef uint32_t seqs = st.lim.max_seqs, queued = st.lim.max_queued, budget = st.lim.budget
    cdef uint32_t lp = st.lim.logical_pages, accum = st.done.accum_cap, i
    cdef PlanBuffers *b = &st.buf
    b.request_ids = <uint64_t *>bufs.add("request_ids", _DT_PLAN_U64, seqs)
    b.query_start_loc = <int32_t *>bufs.add("query_start_loc", _DT_PLAN_I32, seqs + 1)
    b.seq_lens = <int32_t *>bufs.add("seq_lens", _DT_PLAN_I32, seqs)
    b.input_ids = <uint32_t *>bufs.add("input_ids", _DT_U32, budget)
    b.positions = <int32_t *>bufs.add("positions", _DT_PLAN_I32, budget)
    b.slot_mapping = <int64_t *>bufs.add("slot_mapping", _DT_PLAN_I64, budget)
    b.logits_indices = <int32_t *>bufs.add("logits_indices", _DT_PLAN_I32, queued)
    b.sampled_request_ids = <uint64_t *>bufs.add("sampled_request_ids", _DT_PLAN_U64, queued)
    b.block_table = <int32_t *>bufs.add("block_table", _DT_PLAN_I32, <Py_ssize_t>seqs * lp)
    b.block_table_rows = <int32_t *>bufs.add("block_table_rows", _DT_PLAN_I32, seqs)
    b.changed_rows = <int32_t *>bufs.add("changed_rows", _DT_PLAN_I32, seqs)
    b.kv_indptr = <int32_t *>bufs.add("kv_indptr", _DT_PLAN_I32, seqs + 1)
    b.kv_indices = <int32_t *>bufs.add("kv_indices", _DT_PLAN_I32, <Py_ssize_t>seqs * lp)
    b.kv_last_page_len = <int32_t *>bufs.add("kv_last_page_len", _DT_PLAN_I32, seqs)
    b.copies = <qualia_copy_op *>bufs.add("copies", _DT_COPY, st.plan.copies_cap)
    b.new_ids = <uint64_t *>bufs.add("new_request_ids", _DT_PLAN_U64, seqs)
    b.preempted_ids = <uint64_t *>bufs.add("preempted_request_ids", _DT_PLAN_U64, seqs)
    b.finished_ids = <uint64_t *>bufs.add("finished_request_ids", _DT_PLAN_U64, accum)
    b.fork_child_ids = <uint64_t *>bufs.add("fork_child_ids", _DT_PLAN_U64, accum)
    b.fork_parent_ids = <uint64_t *>bufs.add("fork_parent_ids", _DT_PLAN_U64, accum)
    b.size[PB_SEQS] = seqs
    b.size[PB_TOKENS] = budget
    b.size[PB_ROWS] = queued
    b.size[PB_KV] = seqs * lp
    b.size[PB_COPIES] = st.plan.copies_cap
    b.size[PB_NEW] = seqs
    b.size[PB_PREEMPTED] = seqs
    b.size[PB_FINISHED] = accum
    b.size[PB_FORKS] = st.done.fork_cap
    memcpy(b.cap, b.size, sizeof(b.cap))
    for i in range(<uint32_t>(seqs * lp)):
        b.block_table[i] = -1
    bufs.full["block_table"] = bufs.full["block_table"].reshape(seqs, lp)
    return 0


cdef object step_plan(StepState *st, _StepBuffers bufs, object owner):
    """The pending plan as a StepPlan of slices of the buffers' views (the CSR form's on its
    first read, through `owner`, the StepScheduler)."""
    cdef StepPlan plan = StepPlan.__new__(StepPlan)
    plan._owner = owner
    plan._step_no = st.plan.step_no
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


cdef int step_abi_plan(StepState *st, qualia_step_plan *p, bint csr) noexcept nogil:
    # the pending plan as the ABI struct: pointers into the buffers sized at construction; the
    # CSR form built when `csr` (the backend reads it), else left out (NULL, no indices)
    cdef int rc = Q_OK
    if csr:
        rc = plan_csr(st)
        if rc:
            return rc
    p.struct_size = sizeof(qualia_step_plan)
    p.page_tokens = st.lim.page_tokens
    p.num_requests = st.plan.n
    p.num_tokens = st.plan.T
    p.num_sampled = st.plan.m
    p.num_prefill_tokens = st.plan.num_prefill_tokens
    p.num_decode_tokens = st.plan.num_decode_tokens
    p.num_kv_indices = st.plan.n_kv if csr else 0
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
    p.kv_indptr = st.buf.kv_indptr if csr else NULL
    p.kv_indices = st.buf.kv_indices if csr else NULL
    p.kv_last_page_len = st.buf.kv_last_page_len if csr else NULL
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
    return Q_OK
