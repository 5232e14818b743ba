# run()'s loop without the GIL, for a C step backend (docs/DESIGN.md, "The loop"):
# schedule -> execute -> update in C, stretches of a few milliseconds between which the caller
# services signals, each step's statistics into a ring of STEP_STATS rows and running totals.

from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC


from libc.math cimport NAN


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
    cdef uint64_t limit = token_limit(st)
    while st.ids.count and k < max_steps:
        rc = step_schedule(st)
        if rc:
            break
        if st.plan.num_topk and (not (cb.flags & QUALIA_STEP_WRITES_TOPK)
                                 or <size_t>st.plan.m * st.plan.num_topk > st.beams.topk_cap):
            step_discard(st)
            rc = Q_RUN_NO_TOPK
            break
        rc = step_abi_plan(st, &plan, not (cb.flags & QUALIA_STEP_NO_CSR))
        if rc:
            step_discard(st)
            break
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
            i = <uint32_t>step_check_topk(st, st.beams.topk_ids_buf, NULL, st.beams.topk_lps_buf,
                                          &row)
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


cdef int _attach_finished(object err, list finished) except -1:
    # run()'s failure carries the requests its earlier steps finished: they are no longer
    # queued, so this is the only place they are reported (docs/DESIGN.md, "The loop")
    try:
        err.finished = finished
    except Exception:
        pass    # an exception that takes no attributes: nothing more can be done
    return 0
