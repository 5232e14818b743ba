# Open addressing (linear probing, load <= 1/2) shared by the explicit prefix store's index,
# the namespace table and the two request indexes (the seed scheduler's slots, the engine
# step's entries); the automatic cache's page index has its own slots (pagecache.pxi).
# Deletion shifts later entries back instead of leaving tombstones, so lookups stay O(1)
# however long an engine runs.

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


# The request indexes: records whose first field is a uint64 request id, at `home(id)`.

cdef inline uint32_t id_home(uint64_t rid, uint32_t mask) noexcept nogil:
    cdef uint64_t h = rid * <uint64_t>0x9E3779B97F4A7C15
    return <uint32_t>((h >> 32) & mask)


cdef inline int32_t id_find(const int32_t *index, uint32_t mask, const void *records,
                            size_t stride, uint64_t rid) noexcept nogil:
    # the record (of `stride` bytes, its id first) whose id is rid, or -1
    cdef uint32_t i = id_home(rid, mask)
    cdef int32_t e
    while True:
        e = index[i]
        if e < 0:
            return -1
        if (<const uint64_t *>(<const char *>records + <size_t>e * stride))[0] == rid:
            return e
        i = (i + 1) & mask
