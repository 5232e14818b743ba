# Block pool (docs/DESIGN.md, "Block pool").  One free stack: pages pushed in descending
# order so never-used pages come out ascending; a released page goes on top and is reused first.

cdef struct Pool:
    uint32_t num_blocks
    uint32_t free_top
    uint32_t *refcount
    uint32_t *free_stack


cdef int pool_init(Pool *p, uint32_t n) except -1:
    # n == 0 is a valid pool: every allocate is Exhausted, every page id InvalidPage
    cdef size_t m = n if n > 0 else 1
    p.refcount = <uint32_t *>PyMem_Calloc(m, sizeof(uint32_t))
    p.free_stack = <uint32_t *>PyMem_Malloc(m * sizeof(uint32_t))
    if p.refcount == NULL or p.free_stack == NULL:
        raise MemoryError(f"cannot allocate a pool of {n} pages")
    p.num_blocks = n
    pool_reset(p)
    return 0


cdef void pool_reset(Pool *p) noexcept nogil:
    # every page free, the free stack as a new pool's (never-used pages come out ascending)
    cdef uint32_t i, n = p.num_blocks
    memset(p.refcount, 0, n * sizeof(uint32_t))
    for i in range(n):
        p.free_stack[i] = n - 1 - i
    p.free_top = n


cdef void pool_free(Pool *p) noexcept:
    PyMem_Free(p.refcount)
    PyMem_Free(p.free_stack)
    p.refcount = NULL
    p.free_stack = NULL


cdef int pool_allocate(Pool *p, uint32_t *out) noexcept nogil:
    cdef uint32_t page
    if p.free_top == 0:
        return Q_EXHAUSTED
    p.free_top -= 1
    page = p.free_stack[p.free_top]
    p.refcount[page] = 1
    out[0] = page
    return Q_OK


cdef int pool_retain(Pool *p, uint32_t page) noexcept nogil:
    if page >= p.num_blocks:
        return Q_INVALID_PAGE
    if p.refcount[page] == 0:
        return Q_NOT_ALLOCATED
    if p.refcount[page] == U32_MAX:
        return Q_OVERFLOW
    p.refcount[page] += 1
    return Q_OK


cdef int pool_release(Pool *p, uint32_t page) noexcept nogil:
    if page >= p.num_blocks:
        return Q_INVALID_PAGE
    if p.refcount[page] == 0:
        return Q_NOT_ALLOCATED
    p.refcount[page] -= 1
    if p.refcount[page] == 0:
        p.free_stack[p.free_top] = page
        p.free_top += 1
    return Q_OK


cdef class BlockPool:
    """Physical KV pages ``0 .. num_blocks-1`` with reference counts (docs/DESIGN.md,
    "Block pool"): ``allocate``, ``retain``, ``release``, ``refcount``, ``refcounts``.
    ``BlockPool(0)`` is valid: every ``allocate`` is ``Exhausted`` and every page id
    ``InvalidPage``."""
    cdef Pool pool
    cdef uint64_t owner
    cdef uint8_t gil_free   # its StepScheduler's GIL-free loop is changing it (ownership.pxi)

    def __cinit__(self, num_blocks):
        cdef uint64_t n = _int(num_blocks, "num_blocks", U32_MAX)
        pool_init(&self.pool, <uint32_t>n)

    def __dealloc__(self):
        pool_free(&self.pool)

    @property
    def num_blocks(self):
        """Pages in the pool, fixed at construction."""
        return self.pool.num_blocks

    @property
    def free_count(self):
        """Pages on the free stack now (reference count 0)."""
        own_readable(self.gil_free)
        return self.pool.free_top

    def allocate(self):
        """A free page with reference count 1 (``PoolError.Exhausted`` when none is free)."""
        cdef uint32_t page = 0
        cdef int rc
        cdef uint64_t tok = own_acquire(&self.owner, NULL, NULL, NULL)
        try:
            rc = pool_allocate(&self.pool, &page)
        finally:
            own_release(tok, &self.owner, NULL, NULL, NULL)
        if rc:
            raise _error(E_POOL, rc)
        return page

    def retain(self, page):
        """One more reference on ``page`` (``PoolError.InvalidPage``, ``NotAllocated`` for a free
        page, ``Overflow`` at 2**32-1)."""
        cdef uint32_t p = _u32(page, "page")
        cdef int rc
        cdef uint64_t tok = own_acquire(&self.owner, NULL, NULL, NULL)
        try:
            rc = pool_retain(&self.pool, p)
        finally:
            own_release(tok, &self.owner, NULL, NULL, NULL)
        if rc:
            raise _error(E_POOL, rc)

    def release(self, page):
        """One reference less on ``page``; at 0 it goes on top of the free stack
        (``PoolError.InvalidPage``, ``NotAllocated``)."""
        cdef uint32_t p = _u32(page, "page")
        cdef int rc
        cdef uint64_t tok = own_acquire(&self.owner, NULL, NULL, NULL)
        try:
            rc = pool_release(&self.pool, p)
        finally:
            own_release(tok, &self.owner, NULL, NULL, NULL)
        if rc:
            raise _error(E_POOL, rc)

    def refcount(self, page):
        """The reference count of ``page`` (``PoolError.InvalidPage`` past the end)."""
        cdef uint32_t p = _u32(page, "page")
        if p >= self.pool.num_blocks:
            raise PoolError.InvalidPage()
        own_readable(self.gil_free)
        return self.pool.refcount[p]

    def _debug_set_refcount(self, page, count):
        """Test hook: set an allocated page's count (1 .. 2**32-1) without touching the free
        stack, to reach ``Overflow`` without 4 billion retains."""
        cdef uint32_t p = _u32(page, "page")
        cdef uint32_t c = _u32(count, "count")
        cdef int rc = Q_OK
        cdef uint64_t tok = own_acquire(&self.owner, NULL, NULL, NULL)
        try:
            if p >= self.pool.num_blocks:
                rc = Q_INVALID_PAGE
            elif c == 0:
                rc = -1
            elif self.pool.refcount[p] == 0:
                rc = Q_NOT_ALLOCATED
            else:
                self.pool.refcount[p] = c
        finally:
            own_release(tok, &self.owner, NULL, NULL, NULL)
        if rc == -1:
            raise OverflowError("count must be in [1, 4294967295]")
        if rc:
            raise _error(E_POOL, rc)

    def refcounts(self):
        """Every page's reference count, as a fresh numpy array."""
        own_readable(self.gil_free)
        return _array_of(self.pool.refcount, self.pool.num_blocks)

    def __repr__(self):
        if self.gil_free:   # a repr never raises: it leaves out what the loop is changing
            return f"BlockPool(num_blocks={self.pool.num_blocks}, busy)"
        return f"BlockPool(num_blocks={self.pool.num_blocks}, free_count={self.pool.free_top})"

    def __reduce__(self):
        raise TypeError("BlockPool cannot be pickled: it owns the page state of a live engine")
