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


cdef void plan_add(StepState *st, int32_t e, uint32_t n) noexcept nogil:
    cdef uint32_t j = st.plan.n
    st.plan.plan_entry[j] = e
    st.plan.plan_chunk[j] = n
    st.plan.plan_alive[j] = 1
    st.ent[e].at.plan_pos = <int32_t>j
    st.ent[e].at.sched_step = st.plan.step_no
    st.plan.n += 1


cdef void plan_lower(StepState *st) noexcept nogil:
    # The scheduled entries (plan_entry / plan_chunk) lowered into the plan's arrays, in plan
    # order: ids, lengths, input ids from the arena, positions and slot mapping, the sampled rows
    # (an n group's prompt once per member), the CSR pages, the rows that changed; then what
    # finished, was aborted or forked since the previous plan.
    cdef uint32_t i, j, n, q, pos, t, lp, off, run, k, pages
    cdef int64_t sm
    cdef int32_t e, v, slot
    cdef StepEntry *r
    cdef Table *tb
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
        memcpy(&st.buf.input_ids[st.plan.T], arena_at(st, e) + q, n * sizeof(uint32_t))
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
    # every copy owed, in the order made: a discarded plan's (and a failed schedule's) first
    owed_list(st)
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
    cdef readonly object kv_indptr
    """int32 [n+1]: the paged-KV CSR offsets: request ``i``'s pages are ``kv_indices[kv_indptr[i] :
    kv_indptr[i+1]]``."""
    cdef readonly object kv_indices
    """int32: the pages covering each request's ``seq_lens``, request after request."""
    cdef readonly object kv_last_page_len
    """int32 [n]: the positions used in each request's last page, 1 .. ``page_tokens``."""
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
    b.finished_cap = accum
    for i in range(<uint32_t>(seqs * lp)):
        b.block_table[i] = -1
    bufs.full["block_table"] = bufs.full["block_table"].reshape(seqs, lp)
    return 0


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
