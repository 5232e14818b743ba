# qualia.StepScheduler: the engine step (docs/DESIGN.md, "The engine step") as its own class.
# It owns its pool (lent read-only as `pool`), its slot table, its page cache and its step state,
# and mutates them through the step's C functions (core/step/) and the primitives it shares with
# the facade Scheduler (admission, reservation, finish: core/seed/, core/cache/).

cdef uint64_t I32_LIMIT = 2147483647   # the largest value of the plan's int32 arrays


cdef int _plan_csr_views(StepPlan plan) except -1:
    # StepPlan's CSR arrays on their first read: built while the plan is pending (a read: the
    # plan's own buffers are written, nothing of the scheduler's state changes)
    cdef StepScheduler s = <StepScheduler>plan._owner
    cdef StepState *st
    cdef int rc
    own_readable(s.gil_free)
    st = &s.step
    if not st.plan.pending or st.plan.step_no != plan._step_no:
        raise StepError.NoPlan(None, "the CSR form of a plan (kv_indptr, kv_indices, "
                                     "kv_last_page_len) is built on its first read, while the "
                                     "plan is pending: read it before update() or "
                                     "discard_plan()")
    rc = plan_csr(st)
    if rc:
        raise _schedule_error(st, rc)
    plan._kv_indptr = s._step_bufs.view("kv_indptr", st.plan.n + 1)
    plan._kv_indices = s._step_bufs.view("kv_indices", st.plan.n_kv)
    plan._kv_last_page_len = s._step_bufs.view("kv_last_page_len", st.plan.n)
    return 0


cdef object _schedule_error(StepState *st, int rc):
    # the exception of a failed step_schedule (a refused overrun names its buffer)
    if rc == Q_PLAN_OVERRUN:
        return _error(E_STEP, rc, st.plan.overrun, 0, st.buf.cap[st.plan.overrun])
    return _error(E_STEP, rc)


cdef bint _is_topk_triple(object out) except -1:
    # a Python step backend returns the sampled ids (an array or a sequence of ints, a tuple of
    # ints included) or (sampled, topk_ids, topk_logprobs): a tuple whose first item is not an
    # integer, which must then be that triple
    if type(out) is not tuple or not out or isinstance((<tuple>out)[0], (int, np.integer)):
        return False
    if len(<tuple>out) != 3:
        raise ValueError("execute_step returns the sampled ids, or (sampled, topk_ids, "
                         "topk_logprobs)")
    return True


cdef int _check_stops(uint64_t limit, object eos, list stops) except -1:
    # an end or stop id is a token id a step can sample (token_limit): another never matches
    if eos is not None and eos > limit:
        raise ValueError(f"eos_token_id {eos} is outside [0, {limit}]: no sampled token can "
                         f"match it")
    for x in stops:
        if x > limit:
            raise ValueError(f"stop token id {x} is outside [0, {limit}]: no sampled token can "
                             f"match it")
    return 0


# no tp_clear: __dealloc__ hands the pool back, so the cycle collector must not clear
# self.pool first (a cycle through a scheduler is still broken at its other objects)
@cython.no_gc_clear
cdef class StepScheduler:
    """The engine step over an owned pool, slot table and page cache (docs/DESIGN.md, "The engine
    step"): requests go in with ``add_request``; each ``schedule()`` returns a
    :class:`StepPlan`, what the next forward pass computes and where every token's K/V goes;
    ``update()`` takes the sampled tokens back, applies the stop conditions and returns the
    requests that finished.

    Verbs: ``add_request`` (a request, or a group on copy-on-write forks: ``n`` samples or
    ``beam_width`` beams), ``abort``, ``schedule``, ``update``, ``discard_plan`` (after a failed
    execution) and ``run`` (schedule -> execute -> update in a loop, without the GIL for a C step
    backend).  Reads: ``has_unfinished``, ``num_waiting``, ``num_running``, ``requests``,
    ``request_tokens``, ``group_members``, ``forks``, ``fork_fallbacks``, ``parked``, ``stats``,
    ``active_count``, ``free_pages``, and the page cache's ``cached_prefix``,
    ``cached_prefix_tokens``, ``cache_stats``, ``cache_entry``, ``reclaimable_pages``,
    ``page_identities``, ``drain_events``, ``clear_cache``.  It has none of the facade's verbs
    (that is :class:`Scheduler`, which shares no state with it).

    Everything (pages, slots, queue entries and their token arena, every plan buffer) is sized
    here, once; steady-state steps allocate nothing.  Every mutating method owns the scheduler
    for the whole call (docs/DESIGN.md, "Ownership"): a call made meanwhile -- from a backend, a
    GC callback or another thread -- raises ``BusyError`` and changes nothing.  ``pool`` is the
    scheduler's own, for its whole life: its reads work, its mutating calls raise ``BusyError``.

    While ``run()`` with a C step backend runs its GIL-free loop, every other call on the
    scheduler and on its pool raises ``BusyError`` and changes nothing, reads included
    (``stats``, ``cached_prefix``, ``request_tokens``, ``num_waiting``, ...), except
    ``drain_events()``, which drains the KV event ring concurrently; configuration properties
    and ``page_identities`` read nothing the loop changes and work too (docs/DESIGN.md,
    "Concurrency").  Reads work at every other time, from a Python backend mid-step too.
    """
    cdef readonly BlockPool pool
    """The scheduler's pool, for reading: it is the scheduler's for its whole life, so its
    mutating calls raise ``BusyError``.  A pool that outlives its scheduler is handed back with
    every page free."""
    cdef readonly uint32_t page_tokens
    """Token positions per page."""
    cdef uint64_t owner
    cdef uint64_t pool_token    # the pool's owner field: this scheduler's token, for life
    cdef uint8_t gil_free       # run()'s GIL-free loop is changing everything (ownership.pxi)
    cdef int mode
    cdef Sched slots            # one slot per running request (max_num_seqs)
    cdef PageCache cache
    cdef Streams streams
    cdef Undo *undo             # one reservation's undo log and copies (logical_pages)
    cdef qualia_copy_op *cow
    cdef uint64_t pages_copied
    cdef uint64_t pages_allocated
    cdef Py_ssize_t tokens_cap
    cdef StepState step
    cdef _StepBuffers _step_bufs

    def __cinit__(self, num_pages, page_tokens, logical_pages, max_num_seqs, *,
                  max_num_batched_tokens=2048, max_queued=None, max_prefill_chunk=None,
                  vocab_size=None, prefix_caching="auto", cache_key=None, max_namespaces=1024,
                  event_capacity=4096):
        cdef uint32_t pt = _u32(page_tokens, "page_tokens")
        cdef uint32_t nb = _u32(num_pages, "num_pages")
        if pt == 0:
            raise ValueError("page_tokens must be at least 1")
        if nb == 0:
            raise ValueError("num_pages must be at least 1")
        self.mode, key, max_ns, ev_cap = cache_options(prefix_caching, cache_key, max_namespaces,
                                                       event_capacity, ("auto", "off"))
        cdef uint32_t budget = _u32(max_num_batched_tokens, "max_num_batched_tokens")
        if budget == 0:
            raise ValueError("max_num_batched_tokens must be at least 1")
        # the step plan's arrays are int32 (what kernels take): page ids, positions, row
        # offsets and CSR offsets must fit, or a plan would wrap silently
        if nb > I32_LIMIT + 1:
            raise ValueError(f"num_pages must be at most 2**31 (page ids are int32 in the step "
                             f"plan), got {nb}")
        if budget > I32_LIMIT:
            raise ValueError(f"max_num_batched_tokens must be at most 2**31-1 (token offsets "
                             f"are int32 in the step plan), got {budget}")
        cdef uint32_t lp = _u32(logical_pages, "logical_pages")
        cdef uint32_t seqs = _u32(max_num_seqs, "max_num_seqs")
        if seqs == 0 or seqs > 65536:
            raise ValueError(f"max_num_seqs must be in [1, 65536], got {seqs}")
        cdef uint64_t queued = 4 * <uint64_t>seqs
        if max_queued is not None:
            queued = _u32(max_queued, "max_queued")
        cdef uint32_t chunk = 0
        if max_prefill_chunk is not None:
            chunk = _u32(max_prefill_chunk, "max_prefill_chunk")
            if chunk == 0:
                raise ValueError("max_prefill_chunk must be at least 1 (or None)")
        cdef uint64_t vocab = 0
        if vocab_size is not None:
            vocab = _u32(vocab_size, "vocab_size")
            if vocab == 0:
                raise ValueError("vocab_size must be at least 1 (or None)")
        if <uint64_t>lp * pt > I32_LIMIT:
            raise ValueError(f"logical_pages x page_tokens must be at most 2**31-1 (positions "
                             f"are int32 in the step plan), got {lp} x {pt}")
        if <uint64_t>lp * seqs > I32_LIMIT:
            raise ValueError(f"max_num_seqs x logical_pages must be at most 2**31-1 (the "
                             f"paged-KV offsets are int32 in the step plan)")
        if queued < seqs or queued > (1 << 30):
            raise ValueError(f"max_queued must be in [max_num_seqs={seqs}, 2**30], "
                             f"got {queued}")
        self.page_tokens = pt
        self.pool = BlockPool(nb)
        self.pool_token = own_acquire(&self.pool.owner, NULL, NULL, NULL)
        sched_init(&self.slots, seqs, lp)
        cdef size_t cap = max(lp, 1)
        self.undo = <Undo *>PyMem_Malloc(cap * sizeof(Undo))
        self.cow = <qualia_copy_op *>PyMem_Malloc(cap * sizeof(qualia_copy_op))
        if self.undo == NULL or self.cow == NULL:
            raise MemoryError()
        self.tokens_cap = max(<Py_ssize_t>lp * pt, 1)
        if self.mode == MODE_AUTO:
            pc_init(&self.cache, nb, pt, max_ns, ev_cap, <const uint8_t *><char *>key)
            streams_init(&self.streams, seqs, lp, pt, False)
        self._step_bufs = _StepBuffers()
        step_init(&self.step, self._step_bufs, &self.slots, &self.pool.pool, &self.cache,
                  &self.streams, self.undo, self.cow, &self.pages_copied,
                  &self.pages_allocated, self.mode, pt, budget, seqs, <uint32_t>queued, chunk,
                  vocab)

    def __dealloc__(self):
        # the pool may outlive the scheduler: hand it back free, with every page free (every
        # reference in it was the scheduler's: its requests', its cache's, its plans')
        if self.pool is not None and self.pool.owner == self.pool_token:
            pool_reset(&self.pool.pool)
            self.pool.owner = 0
        step_free(&self.step)
        sched_free(&self.slots)
        PyMem_Free(self.undo)
        PyMem_Free(self.cow)
        pc_free(&self.cache)
        streams_free(&self.streams)

    # -- ownership -------------------------------------------------------------------------------
    cdef inline uint64_t _own(self) except 0:
        return own_acquire(&self.owner, NULL, NULL, NULL)

    cdef inline void _unown(self, uint64_t token) noexcept:
        own_release(token, &self.owner, NULL, NULL, NULL)

    cdef inline void _gil_free(self, uint8_t on) noexcept:
        # with the GIL, around run()'s GIL-free stretch (under ownership): every read of the
        # scheduler and of its pool raises BusyError while it is set
        self.gil_free = on
        self.pool.gil_free = on

    # -- configuration (read nothing the loop changes) -----------------------------------------
    @property
    def num_pages(self):
        """Pages in the pool, fixed at construction."""
        return self.pool.pool.num_blocks

    @property
    def logical_pages(self):
        """Capacity of a request's block-table row, in pages: a request holds at most
        ``logical_pages * page_tokens`` tokens (prompt and output)."""
        return self.slots.logical_pages

    @property
    def prefix_caching(self):
        """The prefix-caching mode: ``"auto"`` or ``"off"``."""
        return _MODE_NAMES[self.mode]

    @property
    def num_waiting(self):
        """Requests in the waiting queue (queued, preempted, or children queued at their fork)."""
        own_readable(self.gil_free)
        return self.step.wait.n

    @property
    def num_running(self):
        """Requests that hold a slot, a block-table row and pages."""
        own_readable(self.gil_free)
        return self.step.run.n

    @property
    def max_num_batched_tokens(self):
        """The token budget of one step: prefill chunks and decodes together."""
        return self.step.lim.budget

    @property
    def max_num_seqs(self):
        """Requests one step runs at most: the slots and block-table rows."""
        return self.step.lim.max_seqs

    @property
    def max_queued(self):
        """Queue entries (and token-arena entries): requests held at once, waiting, running or
        parked; a group takes its width."""
        return self.step.lim.max_queued

    @property
    def max_prefill_chunk(self):
        """The longest prefill chunk of one request in one step, or None (the budget is the only
        cap)."""
        return self.step.lim.max_chunk if self.step.lim.max_chunk else None

    @property
    def vocab_size(self):
        """Sampled ids must be below it, or None (not checked)."""
        return self.step.lim.vocab if self.step.lim.vocab else None

    def has_unfinished(self):
        """Whether any request is waiting, running or parked (True until every request finished or
        was aborted)."""
        own_readable(self.gil_free)
        return self.step.ids.count != 0

    def add_request(self, request_id, prompt_tokens, *, max_new_tokens, namespace=b"",
                    priority=0, eos_token_id=None, stop_token_ids=(), ignore_eos=False, n=1,
                    beam_width=None):
        """Queue a request: its prompt is copied into the token arena (docs/DESIGN.md, "The
        engine step", "Requests").  ``n > 1`` samples ``n`` continuations of the prompt on
        copy-on-write forks (docs/DESIGN.md, "Forks at the step level"): one prefill, ``n``
        members, one ``FinishedGroup`` under ``request_id``; the group takes ``n`` entries of
        the queue.  ``beam_width=w`` runs beam search of width ``w`` on forks (docs/DESIGN.md,
        "Beam search at the step level"): plans with beam rows have ``num_topk > 0`` and
        ``update`` takes each row's best ids and log-probabilities; one ``FinishedGroup`` with
        the ``w`` hypotheses best first and their scores; the group takes ``w`` entries."""
        cdef uint64_t rid = _u64(request_id, "request_id")
        n = _group_size(n, "n", self.step.lim.max_seqs)
        cdef uint32_t bw = 0
        if beam_width is not None:
            beam_width = _group_size(beam_width, "beam_width", self.step.lim.max_seqs)
            if n != 1:
                raise ValueError("beam search returns beam_width hypotheses: leave n at 1")
            if self.step.lim.vocab and beam_width > self.step.lim.vocab:
                # a beam row's w candidates are distinct tokens of the vocabulary
                raise ValueError(f"beam_width must be at most vocab_size={self.step.lim.vocab}, "
                                 f"got {beam_width}")
            bw = <uint32_t>beam_width
        cdef uint32_t n_members = <uint32_t>n
        cdef uint32_t max_new = _u32(max_new_tokens, "max_new_tokens")
        cdef uint32_t stop[STOP_MAX]
        cdef uint32_t n_stop = 0, eos = 0
        cdef bint has_eos = eos_token_id is not None
        cdef Toks t
        cdef uint64_t nsh = 0, tok
        cdef uint8_t *nsb = NULL
        cdef int rc = Q_OK
        if max_new == 0:
            raise ValueError("max_new_tokens must be at least 1")
        if isinstance(priority, (bool, np.bool_)):
            raise TypeError("priority must be an integer, not bool")
        prio = int.__index__(operator.index(priority))   # exact int (3.9: a subclass)
        if not -(1 << 31) <= prio < (1 << 31):
            raise OverflowError(f"priority must be in [-2**31, 2**31-1], got {prio}")
        if has_eos:
            eos = _u32(eos_token_id, "eos_token_id")
        if isinstance(stop_token_ids, (str, bytes, bytearray, memoryview)):
            raise TypeError("stop_token_ids must be a sequence of token ids")
        stops = [_u32(x, "stop token id") for x in stop_token_ids]
        if len(stops) > STOP_MAX:
            raise ValueError(f"at most {STOP_MAX} stop token ids, got {len(stops)}")
        _check_stops(token_limit(&self.step), eos if has_eos else None, stops)
        for n_stop in range(len(stops)):
            stop[n_stop] = stops[n_stop]
        n_stop = len(stops)
        cdef bint ignore = bool(ignore_eos)
        ns, nsl = cache_namespace(namespace)
        keep = self._prompt(prompt_tokens, &t)   # last: no user code runs after it
        try:
            if t.n == 0:
                raise ValueError("the prompt must have at least one token")
            if t.n > U32_MAX:
                raise StepError.NeverFits()
            if bw and max_new:
                # the w beams are computed side by side: the prompt's full pages once (shared)
                # and each beam's own tail must fit the pool together.  Without a prefix cache
                # (mode "off") a parked or queued beam recomputes its prompt into pages of its
                # own, so each beam's whole sequence must fit beside the others
                pt = self.page_tokens
                tail = -(-(t.n + max_new - 1) // pt) - t.n // pt
                need = t.n // pt + bw * tail
                if self.mode == MODE_OFF:
                    need = bw * (t.n // pt + tail)
                if need > self.pool.pool.num_blocks:
                    raise StepError.NeverFits(None, f"{bw} beams need {need} pages side by "
                                                    f"side, the pool has "
                                                    f"{self.pool.pool.num_blocks}")
            if self.mode == MODE_AUTO:
                nsh = self.cache.ns.hashes[0] if nsl == 0 else \
                    pc_ns_hash(&self.cache, <const uint8_t *><char *>ns, <uint32_t>nsl)
                if nsl:
                    nsb = <uint8_t *>malloc(nsl)
                    if nsb == NULL:
                        raise MemoryError()
                    memcpy(nsb, <char *>ns, nsl)
            rc = -1     # until step_add says otherwise, nsb is ours to free
            try:
                tok = self._own()
                try:
                    if bw:
                        self._beam_buffers()
                    rc = step_add(&self.step, rid, t.ptr, <uint32_t>t.n, max_new, prio, has_eos,
                                  eos, stop, n_stop, ignore, nsb, <uint32_t>nsl, nsh,
                                  self.pool.pool.num_blocks, n_members, bw)
                finally:
                    self._unown(tok)
            finally:
                if rc:
                    free(nsb)   # on success the entry owns it
        finally:
            _tokens_free(&t)
        if rc:
            raise _error(E_STEP, rc)

    cdef int _beam_buffers(self) except -1:
        # under ownership: the candidate buffers, allocated with the first beam group (one row
        # of max_num_seqs candidates per entry: a parked beam keeps its candidates)
        cdef StepState *st = &self.step
        return _alloc_candidates(<void **>&st.beams.cand_ids, <void **>&st.beams.cand_lps,
                                 <size_t>st.lim.max_queued * st.lim.max_seqs, sizeof(double))

    cdef int _topk_buffers(self) except -1:
        # under ownership, before run() hands beam plans to a C backend: room for every row's
        # candidates (rows_cap rows of max_num_seqs)
        cdef StepState *st = &self.step
        cdef size_t n = <size_t>st.plan.rows_cap * st.lim.max_seqs
        _alloc_candidates(<void **>&st.beams.topk_ids_buf, <void **>&st.beams.topk_lps_buf, n,
                          sizeof(float))
        st.beams.topk_cap = n
        return 0

    def abort(self, request_id):
        """Drop a waiting or running request.  A running one hands its pages back now, unless it
        is in the pending plan: update() skips it, and its pages stay pinned until update() or
        discard_plan() retires the plan (a kernel may be executing it)."""
        cdef uint64_t rid = _u64(request_id, "request_id")
        cdef StepState *st = &self.step
        cdef int rc
        cdef int32_t e
        cdef uint64_t tok = self._own()
        try:
            # room for this abort (a group: its members); update() makes room for its own
            e = step_find(st, rid)
            self._accum_room(<uint64_t>st.done.n_accum + (
                st.ent[e].mem.n_members if e >= 0 and st.ent[e].mem.group == e else 1))
            rc = step_abort(st, rid)
        finally:
            self._unown(tok)
        if rc:
            raise _error(E_STEP, rc)

    def schedule(self):
        """Plan the next step (docs/DESIGN.md, "The engine step", "One step")."""
        cdef int rc
        cdef uint64_t tok = self._own()
        try:
            rc = step_schedule(&self.step)
            if rc == Q_OK:
                # built while owned: no other call (a GC callback, another thread) can update,
                # abort or re-plan between the plan and its views
                plan = step_plan(&self.step, self._step_bufs, self)
        finally:
            self._unown(tok)
        if rc:
            raise _schedule_error(&self.step, rc)
        return plan

    cdef list _update_owned(self, object values, tuple topk):
        # update() with the scheduler owned by the caller
        update_load_sampled(&self.step, values)
        return self._update_loaded(update_load_topk(&self.step, topk))

    cdef list _update_loaded(self, object cand):
        # the rest of update(), owned, once update_load_sampled and update_load_topk (its result:
        # cand)
        # have checked the plan's tokens back
        cdef int rc
        cdef const uint32_t *tk_ids = NULL
        cdef const double *tk_lps = NULL
        if cand is not None:
            tk_ids = <const uint32_t *>cnp.PyArray_DATA(<cnp.ndarray>cand[0])
            tk_lps = <const double *>cnp.PyArray_DATA(<cnp.ndarray>cand[1])
        # every id an update may note finished: each entry at most once (a request's, a member
        # forked in it, a running, waiting or parked beam a selection stops), and there are
        # max_queued entries
        self._accum_room(<uint64_t>self.step.done.n_accum + self.step.lim.max_queued)
        rc = step_update(&self.step, self.step.plan.sampled, tk_ids, tk_lps, NULL)
        finished = step_collect(&self.step)
        if rc:
            raise _error(E_STEP, rc)
        return finished

    def update(self, sampled_token_ids, topk_ids=None, topk_logprobs=None):
        """Apply one plan's sampled tokens; returns the finished requests, in plan order.  A plan
        with beam rows (``num_topk > 0``) also takes each row's ``num_topk`` best token ids and
        their log-probabilities (``[m, num_topk]`` arrays, best first)."""
        cdef uint64_t tok
        if not self.gil_free and not self.step.plan.pending:
            # fails early (a read, so not while the loop runs); checked again once owned
            raise StepError.NoPlan(None, "schedule() first")
        # the candidates first: their conversion runs user code (__array__), and the sampled
        # ids may be the caller's array, read in place once owned
        topk = _resolve_topk(topk_ids, topk_logprobs)
        values = update_resolve_sampled(sampled_token_ids)
        tok = self._own()
        try:
            return self._update_owned(values, topk)
        finally:
            self._unown(tok)

    cdef int _accum_room(self, uint64_t need) except -1:
        # under ownership: fin_accum (and the plan's finished-id buffer) hold at least `need` ids
        cdef StepState *st = &self.step
        cdef uint64_t *grown
        cdef uint32_t cap = st.done.accum_cap
        if need <= cap:
            return 0
        while cap < need:
            cap *= 2
        grown = <uint64_t *>PyMem_Realloc(st.done.fin_accum, cap * sizeof(uint64_t))
        if grown == NULL:
            raise MemoryError()
        st.done.fin_accum = grown
        st.done.accum_cap = cap
        if cap > st.buf.size[PB_FINISHED]:
            # the pending plan's ids move along: its views keep the old buffer alive
            grown = <uint64_t *>self._step_bufs.add("finished_request_ids", _DT_PLAN_U64, cap)
            memcpy(grown, st.buf.finished_ids, st.plan.n_finished * sizeof(uint64_t))
            st.buf.finished_ids = grown
            st.buf.size[PB_FINISHED] = cap
            st.buf.cap[PB_FINISHED] = cap
        return 0

    def discard_plan(self):
        """Drop the pending plan after its execution failed: the reserved pages stay with their
        requests and the same tokens are scheduled again; the plan's changed rows, finished
        ids and copy-on-write copies are reported again by the next plan (its copies first).
        Requests aborted while it was pending hand their pages back now."""
        cdef int rc
        cdef uint64_t tok = self._own()
        try:
            if self.step.plan.pending:
                self._accum_room(<uint64_t>self.step.done.n_accum + self.step.plan.n_finished)
            rc = step_discard(&self.step)
        finally:
            self._unown(tok)
        if rc:
            raise _error(E_STEP, rc)

    cdef int32_t _live_entry(self, object request_id) except -1:
        # the entry of a queued, running or parked request (a beam group's id: its beam with
        # that id); the id resolved first (it may run user code), then the busy check
        cdef uint64_t rid = _u64(request_id, "request_id")
        own_readable(self.gil_free)
        cdef int32_t e = step_find(&self.step, rid)
        if e >= 0 and self.step.ent[e].at.state == SR_GROUP:
            e = self.step.ent[e].rec.parent_beam
        if e < 0 or (self.step.ent[e].at.state != SR_WAITING
                     and self.step.ent[e].at.state != SR_RUNNING
                     and self.step.ent[e].at.state != SR_PARKED):
            raise StepError.UnknownRequest(None, f"request {rid}")
        return e

    def request_tokens(self, request_id):
        """Prompt plus generated tokens of a queued, running or parked request."""
        cdef int32_t e = self._live_entry(request_id)
        return _array_of(arena_at(&self.step, e), self.step.ent[e].req.num_tokens)

    def request_pages(self, request_id):
        """The pages a queued, running or parked request holds, in logical order (a uint32
        array; empty while it waits or is parked: those hold no pages).  For a beam group's
        id, its beam with that id."""
        cdef int32_t e = self._live_entry(request_id)
        cdef Table *t
        if self.step.ent[e].at.state != SR_RUNNING or self.step.ent[e].at.slot < 0:
            return _array_of(NULL, 0)
        t = &self.step.pg.s.slots[self.step.ent[e].at.slot].blocks
        return _array_of(t.entries, t.len)

    def group_members(self, request_id):
        """The member ids of a queued or running ``n`` group, in member order: the parent's
        id, then its children's (what the sampler keys on); for a beam group, its live beams."""
        cdef uint64_t rid = _u64(request_id, "request_id")
        cdef StepState *st = &self.step
        own_readable(self.gil_free)
        cdef int32_t e = step_find(st, rid), c
        cdef uint32_t k = 0, j
        if e < 0 or st.ent[e].mem.group != e or st.ent[e].at.state == SR_FINISHED:
            raise StepError.UnknownRequest(None, f"no group {rid}")
        # the ids into C memory first: building the list runs Python code (see _list_of)
        cdef uint64_t *ids = <uint64_t *>PyMem_Malloc(st.lim.max_seqs * sizeof(uint64_t))
        if ids == NULL:
            raise MemoryError()
        try:
            c = st.ent[e].mem.next_member if st.ent[e].rec.beam else e
            while c >= 0 and k < st.lim.max_seqs:
                ids[k] = st.ent[c].req.rid
                k += 1
                c = st.ent[c].mem.next_member
            return [ids[j] for j in range(k)]
        finally:
            PyMem_Free(ids)

    @property
    def forks(self):
        """Children of ``n`` groups forked so far (each shares its parent's pages)."""
        own_readable(self.gil_free)
        return self.step.groups.forks

    @property
    def parked(self):
        """Beams parked so far: computed beams that left the running list with their
        candidates (after a step that scheduled nothing, or preempted) to wait, holding
        nothing, for their group's selection (docs/DESIGN.md, "Progress")."""
        own_readable(self.gil_free)
        return self.step.beams.parked

    @property
    def fork_fallbacks(self):
        """Children of ``n`` groups queued for lack of a free slot or row."""
        own_readable(self.gil_free)
        return self.step.groups.fork_fallbacks

    def requests(self):
        """Ids of the queued, running and parked requests, in arrival order."""
        cdef StepState *st = &self.step
        cdef uint32_t e, k = 0, j
        own_readable(self.gil_free)
        # (arrival, id) pairs into C memory first: building the list runs Python code
        cdef size_t size = 2 * <size_t>st.lim.max_queued * sizeof(uint64_t)
        cdef uint64_t *pairs = <uint64_t *>PyMem_Malloc(size)
        if pairs == NULL:
            raise MemoryError()
        try:
            for e in range(st.lim.max_queued):
                if (st.ent[e].at.state == SR_WAITING or st.ent[e].at.state == SR_RUNNING
                        or st.ent[e].at.state == SR_PARKED):
                    pairs[2 * k] = st.ent[e].ord.arrival
                    pairs[2 * k + 1] = st.ent[e].req.rid
                    k += 1
            found = sorted([(pairs[2 * j], pairs[2 * j + 1]) for j in range(k)])
        finally:
            PyMem_Free(pairs)
        return [rid for _, rid in found]

    def run(self, backend, max_steps=None, *, stats_rows=RUN_STATS_ROWS):
        """schedule -> execute -> update until no request is left or ``max_steps`` steps ran.
        Returns ``RunResult(stats, finished, steps, totals)``: the STEP_STATS rows of the last
        ``min(steps, stats_rows)`` steps, oldest first (a ring sized when the call starts, so
        the call's memory does not grow with its length), the finished requests in the order
        they finished, the number of steps, and each STEP_TOTALS field summed over all of them.

        The scheduler is owned for the whole call: a backend (or a GC callback, or another
        thread) calling a mutating method meanwhile gets BusyError; reads work (the state
        stands still while Python runs).  A C step backend (``__qualia_step_backend__``) runs
        stretches of steps in C without the GIL; while a stretch runs, every other call on the
        scheduler and on its pool raises BusyError, reads included, except
        drain_events().  Every few milliseconds (5 ms) the stretch ends between two steps, the
        finished requests are collected and pending signals are serviced with the GIL: a signal
        handler that raises (KeyboardInterrupt) stops the call there.  A Python backend's
        ``execute_step(plan)`` is called with the GIL, between schedule and update.  If a
        backend fails, or a signal handler raises, the step being run is discarded (nothing of
        it applied) and the error propagates with the requests the earlier steps of this call
        finished as its ``finished`` attribute (they are no longer queued)."""
        cdef object limit = None if max_steps is None else _u32(max_steps, "max_steps")
        cdef uint32_t ring_rows = _u32(stats_rows, "stats_rows")
        cdef qualia_step_backend *cb = NULL
        cdef qualia_step_backend store
        cdef StepStat row
        cdef StepStat *ring
        cdef uint32_t head = 0
        cdef uint64_t steps = 0, total = 0, want
        cdef uint64_t totals[STAT_TOTALS]
        cdef int32_t status = 0
        cdef uint32_t token = 0
        cdef int rc = Q_OK
        cdef uint64_t tok
        handle = _resolve_step_backend(backend, &cb, &store)   # RESOLVE: may run user code
        if limit is not None and <uint32_t>limit < ring_rows:
            ring_rows = <uint32_t>limit
        stats = np.empty(ring_rows, dtype=STEP_STATS)
        ring = <StepStat *>cnp.PyArray_DATA(<cnp.ndarray>stats)
        memset(totals, 0, sizeof(totals))
        finished = []
        tok = self._own()
        try:
            if cb == NULL:
                while self.step.ids.count and (limit is None or total < limit):
                    rc = step_schedule(&self.step)
                    if rc:
                        raise _schedule_error(&self.step, rc)
                    plan = step_plan(&self.step, self._step_bufs, self)
                    try:
                        # the backend and the conversion of its ids run while the scheduler
                        # is owned: a call back into it gets BusyError
                        out = handle(plan)
                        if _is_topk_triple(out):
                            ids, tk, tl = out
                        else:
                            ids, tk, tl = out, None, None
                        topk = _resolve_topk(tk, tl)
                        values = update_resolve_sampled(ids)
                        update_load_sampled(&self.step, values)
                        cand = update_load_topk(&self.step, topk)
                    except BaseException:
                        step_discard(&self.step)
                        raise
                    done = self._update_loaded(cand)
                    finished.extend(done)
                    step_stat(&self.step, &row, <uint32_t>len(done))
                    stats_note(&row, ring, ring_rows, &head, totals)
                    total += 1
            else:
                if self.step.beams.beam_head >= 0:
                    if not (cb.flags & QUALIA_STEP_WRITES_TOPK):
                        # refused before any step: nothing is scheduled, admitted or discarded
                        raise TypeError("a beam group is queued or running and the C step "
                                        "backend does not declare QUALIA_STEP_WRITES_TOPK (its "
                                        "plans need candidates); nothing was run")
                    self._topk_buffers()
                while self.step.ids.count and (limit is None or total < limit):
                    want = U64_MAX if limit is None else <uint64_t>limit - total
                    self._gil_free(1)
                    with nogil:
                        rc = step_run(&self.step, cb, want, _coarse_now_ns() + RUN_SLICE_NS, ring,
                                      ring_rows, &head, totals, &steps, &status, &token)
                    self._gil_free(0)
                    finished.extend(step_collect(&self.step))
                    total += steps
                    if rc == Q_PLAN_OVERRUN:
                        raise _schedule_error(&self.step, rc)
                    if rc:
                        raise _error(E_STEP, rc, status, token,
                                     token_limit(&self.step))
                    # between two steps, nothing pending: a signal handler that raises stops
                    # the call here (the steps so far stay applied)
                    PyErr_CheckSignals()
            if total > ring_rows:
                # the ring wrapped: its oldest row is at head
                stats = np.concatenate((stats[head:], stats[:head]))
            elif total < ring_rows:
                stats = stats[:total].copy()
            return RunResult(stats, finished, total,
                             {name: totals[k] for k, name in enumerate(STEP_TOTALS)})
        except BaseException as err:
            # the requests earlier steps of this call finished are freed: report them
            _attach_finished(err, finished)
            raise
        finally:
            self._unown(tok)

    # -- pages and the page cache (core/cache/reads.pxi) ---------------------------------------
    @property
    def active_count(self):
        """Slots held: running requests, and requests aborted while in the pending plan (their
        pages stay pinned until the plan is retired)."""
        own_readable(self.gil_free)
        return self.slots.active

    @property
    def free_pages(self):
        """Pages an allocation can take: free pages plus reclaimable cached pages."""
        own_readable(self.gil_free)
        return self.pool.pool.free_top + self.cache.n_state[PC_RECLAIMABLE]

    def stats(self):
        """Page counters: running requests' slots, pages free, used, cached and reclaimable,
        pages copied (copy-on-write) and allocated so far."""
        # C values first: building the dict runs Python code
        own_readable(self.gil_free)
        cdef uint32_t active = self.slots.active, seqs = self.slots.max_requests
        cdef uint32_t nb = self.pool.pool.num_blocks
        cdef uint32_t free = self.pool.pool.free_top + self.cache.n_state[PC_RECLAIMABLE]
        cdef uint32_t cached = self.cache.n_state[PC_INUSE] + self.cache.n_state[PC_RECLAIMABLE]
        cdef uint32_t reclaimable = self.cache.n_state[PC_RECLAIMABLE]
        cdef uint64_t copied = self.pages_copied, allocated = self.pages_allocated
        return {
            "active": active,
            "max_num_seqs": seqs,
            "num_pages": nb,
            "free_pages": free,
            "used_pages": nb - free,
            "cached_pages": cached,
            "reclaimable_pages": reclaimable,
            "pages_copied": copied,
            "pages_allocated": allocated,
        }

    def cached_prefix_tokens(self, prompt_tokens, namespace=b""):
        """How many tokens of ``prompt_tokens`` an admission in ``namespace`` would take from
        the cache right now (verified, at least one token left to compute).  Changes nothing,
        counts nothing."""
        return self._probe(prompt_tokens, namespace, "cached_prefix_tokens", False)

    def cached_prefix(self, prompt_tokens, namespace=b""):
        """``CachedPrefix(tokens, pages, reclaimable)``: what an admission of ``prompt_tokens``
        in ``namespace`` would take from the cache right now, and how many of those pages are
        reclaimable now (the admission takes them out of ``free_pages``).  Changes nothing
        and writes no scratch of the core (it has its own)."""
        return self._probe(prompt_tokens, namespace, "cached_prefix", True)

    cdef object _probe(self, object prompt_tokens, object namespace, str what, bint detail):
        # read-only: RESOLVE, then one C stretch that reads the cache into C values
        cdef Toks t
        cache_need_auto(self.mode, what)
        nsb, nsl = cache_namespace(namespace)
        keep = self._prompt(prompt_tokens, &t)   # last: no user code runs after it
        try:
            own_readable(self.gil_free)
            return cache_probe(&self.cache, &self.streams, t.ptr, t.n, nsb, detail)
        finally:
            _tokens_free(&t)

    cdef object _prompt(self, object prompt_tokens, Toks *t):
        return _tokens_resolve(prompt_tokens, t, self.tokens_cap, "logical_pages x page_tokens")

    def drain_events(self, out=None):
        """Pending KV events, oldest first.  Without ``out``: a new KV_EVENT array of all of
        them.  With ``out`` (a writable 1-D KV_EVENT array): write up to ``len(out)`` events
        into it and return how many (no allocation).  Events left in the ring stay pending.
        The ring is a single-producer, single-consumer ring: the core writes it (without the
        GIL inside run()), drain_events reads it (with the GIL, one caller at a time), so it
        takes no ownership and may be called at any time, from any thread, even while run()'s
        GIL-free loop runs: every event comes out once, in order.  A full ring drops new
        events and counts them (``cache_stats().events_dropped``)."""
        return cache_drain(&self.cache, out)

    def clear_cache(self):
        """Drop every cache entry (pages held by requests stay with them); emits one "cleared"
        event.  Returns the number of entries dropped."""
        cdef uint32_t n = 0
        cdef uint64_t tok = self._own()
        try:
            if self.mode == MODE_AUTO:
                n = pc_clear(&self.cache, &self.pool.pool)
        finally:
            self._unown(tok)
        return n

    def cache_stats(self):
        """Counters of automatic prefix caching, as a CacheStats."""
        own_readable(self.gil_free)
        return cache_stats_of(&self.cache, &self.pool.pool)

    def reclaimable_pages(self):
        """The reclaimable cached pages, least recently used (next to be reclaimed) first."""
        own_readable(self.gil_free)
        return cache_reclaimable(&self.cache, self.mode)

    def cache_entry(self, page):
        """The cache entry of physical ``page`` as a CacheEntry, or None when it is not
        cached."""
        cdef uint32_t pg = _u32(page, "page")
        if pg >= self.pool.pool.num_blocks:
            raise PoolError.InvalidPage()
        own_readable(self.gil_free)
        return cache_entry_of(&self.cache, self.mode, pg)

    def page_identities(self, tokens, namespace=b""):
        """The chained identities of the full pages of ``tokens`` in ``namespace`` under this
        scheduler's cache key (a uint64 array): what a router computes to predict hits.  Reads
        only the key."""
        cache_need_auto(self.mode, "page_identities")
        return cache_page_identities(&self.cache, tokens, namespace)

    def _debug_plan_capacity(self, buffer, capacity=None):
        """Test hook: the capacity the guards of plan buffer ``buffer`` check (one of
        ``_PLAN_BUFFER_NAMES``: "per-request", "per-token", ...) set to ``capacity`` records, at
        most what was allocated (None: all of it), to prove that a plan which would overrun a
        buffer fails its step with a SystemError instead of writing past it.  Returns the
        capacity now checked."""
        cdef uint32_t kind, cap
        if buffer not in _PLAN_BUFFER_NAMES:
            raise ValueError(f"buffer must be one of {_PLAN_BUFFER_NAMES}, got {buffer!r}")
        kind = <uint32_t>_PLAN_BUFFER_NAMES.index(buffer)
        cdef uint64_t tok = self._own()
        try:
            cap = self.step.buf.size[kind] if capacity is None else _u32(capacity, "capacity")
            if cap > self.step.buf.size[kind]:
                raise ValueError(f"the {buffer} buffer holds {self.step.buf.size[kind]} records")
            self.step.buf.cap[kind] = cap
        finally:
            self._unown(tok)
        return cap

    def _debug_namespaces(self):
        """Test hook: the namespace table as ``(rows, idle)``: ``(id, name, references,
        reclaimable pages)`` for every id in use, by id, and the idle ids, least recently used
        first, for tests that hold it against the twin's."""
        own_readable(self.gil_free)
        cache_need_auto(self.mode, "_debug_namespaces")
        return cache_namespaces(&self.cache)

    def _debug_identity_mask(self, mask, parent_mask=0xFFFFFFFFFFFFFFFF):
        """Test hook: AND every page identity computed from now on with ``mask`` (0 makes every
        page collide) and the parent identity it is derived from with ``parent_mask`` (0 makes
        identities blind to the parent), to prove that verification, not the hash, decides a
        hit."""
        cdef uint64_t m = _u64(mask, "mask")
        cdef uint64_t pm = _u64(parent_mask, "parent_mask")
        cdef uint64_t tok = self._own()
        try:
            self.cache.ident_mask = m
            self.cache.parent_mask = pm
        finally:
            self._unown(tok)

    def __repr__(self):
        if self.gil_free:   # a repr never raises: it leaves out what the loop is changing
            return (f"StepScheduler(num_pages={self.num_pages}, page_tokens={self.page_tokens}, "
                    f"logical_pages={self.logical_pages}, max_num_seqs={self.max_num_seqs}, "
                    f"prefix_caching={self.prefix_caching!r}, busy)")
        return (f"StepScheduler(num_pages={self.num_pages}, page_tokens={self.page_tokens}, "
                f"logical_pages={self.logical_pages}, max_num_seqs={self.max_num_seqs}, "
                f"prefix_caching={self.prefix_caching!r}, waiting={self.step.wait.n}, "
                f"running={self.step.run.n}, free_pages={self.free_pages})")
