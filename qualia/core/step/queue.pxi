# The waiting queue: a binary heap of entries ordered by (priority, arrival), the latest
# enqueue first among equals (members of a group share their arrival).

cdef struct StepQueue:
    int32_t *heap           # waiting entries, by (priority, arrival, latest enqueue)
    uint32_t n
    uint64_t enqueues       # heap_push counter


cdef inline bint _before(StepState *st, int32_t a, int32_t b) noexcept nogil:
    # waiting order: (priority, arrival)
    if st.ent[a].ord.priority != st.ent[b].ord.priority:
        return st.ent[a].ord.priority < st.ent[b].ord.priority
    if st.ent[a].ord.arrival != st.ent[b].ord.arrival:
        return st.ent[a].ord.arrival < st.ent[b].ord.arrival
    # members of a group share their arrival: the one enqueued last goes first (the twin
    # inserts before equal keys)
    return st.ent[a].ord.enq > st.ent[b].ord.enq


cdef inline void _heap_set(StepState *st, uint32_t i, int32_t e) noexcept nogil:
    st.wait.heap[i] = e
    st.ent[e].ord.heap_pos = <int32_t>i


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
    st.ent[e].ord.enq = st.wait.enqueues
    _heap_set(st, st.wait.n, e)
    st.wait.n += 1
    _heap_up(st, st.wait.n - 1)


cdef void heap_remove(StepState *st, int32_t e) noexcept nogil:
    cdef uint32_t i = <uint32_t>st.ent[e].ord.heap_pos
    cdef int32_t last
    st.wait.n -= 1
    st.ent[e].ord.heap_pos = -1
    if i == st.wait.n:
        return
    last = st.wait.heap[st.wait.n]
    _heap_set(st, i, last)
    _heap_up(st, i)
    _heap_down(st, <uint32_t>st.ent[last].ord.heap_pos)
