# Open addressing (linear probing, load <= 1/2) shared by the prefix index and the request
# index.  Deletion shifts later entries back instead of leaving tombstones, so lookups stay
# O(1) however long an engine runs.

ctypedef uint32_t (*home_fn)(void *ctx, int32_t e) noexcept nogil


cdef inline void oa_insert(int32_t *index, uint32_t mask, uint32_t home, int32_t e) noexcept nogil:
    cdef uint32_t i = home
    while index[i] >= 0:
        i = (i + 1) & mask
    index[i] = e


cdef void oa_remove(int32_t *index, uint32_t mask, uint32_t home, int32_t e, home_fn home_of,
                    void *ctx) noexcept nogil:
    cdef uint32_t i = home
    cdef uint32_t j, k
    while index[i] != e:
        i = (i + 1) & mask
    j = i
    while True:
        j = (j + 1) & mask
        if index[j] < 0:
            break
        k = home_of(ctx, index[j])
        # leave index[j] where it is if its home lies cyclically in (i, j]
        if (i <= j and i < k and k <= j) or (i > j and (i < k or k <= j)):
            continue
        index[i] = index[j]
        i = j
    index[i] = -1
