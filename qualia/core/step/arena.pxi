# The token arena: each entry's prompt and generated tokens, max_queued rows of
# logical_pages x page_tokens tokens sized at construction (the plan's input ids are copied from
# here, sampled tokens appended here).

cdef struct StepArena:
    uint32_t *tokens        # max_queued x entry_cap: each entry's prompt and outputs
    uint32_t entry_cap      # tokens of one entry = logical_pages * page_tokens


cdef inline uint32_t *arena_at(StepState *st, int32_t e) noexcept nogil:
    # entry e's tokens: its prompt, then its outputs
    return &st.arena.tokens[<size_t>e * st.arena.entry_cap]


# Every change to an entry's tokens goes through step_add or the two calls below, which keep
# the entry's last token (StepPlace.last_token) equal to the arena's token at num_tokens - 1.

cdef inline void arena_append(StepState *st, int32_t e, uint32_t tok) noexcept nogil:
    # one token after entry e's tokens
    cdef StepEntry *r = &st.ent[e]
    arena_at(st, e)[r.req.num_tokens] = tok
    r.req.num_tokens += 1
    r.at.last_token = tok


cdef inline void arena_copy(StepState *st, int32_t d, int32_t src) noexcept nogil:
    # entry d's tokens become a copy of entry src's
    memcpy(arena_at(st, d), arena_at(st, src),
           <size_t>st.ent[src].req.num_tokens * sizeof(uint32_t))
    st.ent[d].req.num_tokens = st.ent[src].req.num_tokens
    st.ent[d].at.last_token = st.ent[src].at.last_token


cdef object _step_output(StepState *st, int32_t e):
    cdef StepEntry *r = &st.ent[e]
    cdef uint32_t[::1] v
    arr = np.empty(r.req.num_tokens - r.req.num_prompt, dtype=np.uint32)
    v = arr
    if r.req.num_tokens > r.req.num_prompt:
        memcpy(&v[0], arena_at(st, e) + r.req.num_prompt,
               (r.req.num_tokens - r.req.num_prompt) * sizeof(uint32_t))
    return arr
