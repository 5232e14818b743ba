# Sequence block table (docs/DESIGN.md, "Sequence block table and copy-on-write").

cdef enum:
    COW_EXCLUSIVE = 0
    COW_ALLOCATED = 1
    COW_COPY = 2

cdef inline bint page_shift(uint32_t page_tokens, uint32_t *shift) noexcept nogil:
    # whether page_tokens is a power of two, and then its log2 in *shift: the step and the
    # token streams divide by the page size with a shift (a division takes tens of cycles)
    cdef bint pow2 = page_tokens != 0 and (page_tokens & (page_tokens - 1)) == 0
    shift[0] = 0
    while pow2 and (<uint32_t>1 << shift[0]) < page_tokens:
        shift[0] += 1
    return pow2


cdef struct Table:
    uint32_t *entries
    uint32_t len
    uint32_t capacity

cdef struct Cow:
    int kind
    uint32_t page
    uint32_t src

# One change a reservation made to a slot's table, for undoing it (seed/reserve.pxi)
cdef struct Undo:
    uint32_t slot
    uint32_t logical_page
    int kind
    uint32_t src
    uint32_t dst


cdef int table_ensure_writable(Table *t, uint32_t logical_page, Pool *p, Cow *out) noexcept nogil:
    cdef uint32_t page, dst
    cdef int rc
    if logical_page >= t.capacity:
        return Q_OUT_OF_RANGE
    if logical_page > t.len:
        return Q_GAP
    if logical_page == t.len:
        rc = pool_allocate(p, &page)
        if rc:
            return rc
        t.entries[t.len] = page
        t.len += 1
        out.kind = COW_ALLOCATED
        out.page = page
        out.src = page
        return Q_OK
    page = t.entries[logical_page]
    if page >= p.num_blocks:
        return Q_INVALID_PAGE
    if p.refcount[page] == 0:
        return Q_NOT_ALLOCATED
    if p.refcount[page] == 1:
        out.kind = COW_EXCLUSIVE
        out.page = page
        out.src = page
        return Q_OK
    rc = pool_allocate(p, &dst)
    if rc:
        return rc
    pool_release(p, page)  # shared (count >= 2): never frees, never fails
    t.entries[logical_page] = dst
    out.kind = COW_COPY
    out.page = dst
    out.src = page
    return Q_OK


cdef int table_attach(Table *t, const uint32_t *pages, uint32_t n, Pool *p) noexcept nogil:
    cdef uint32_t i, j
    cdef int rc
    if t.len > 0:
        return Q_NOT_EMPTY
    if n > t.capacity:
        return Q_OUT_OF_RANGE
    for i in range(n):
        rc = pool_retain(p, pages[i])
        if rc:
            # undo: every retained page had count >= 1 before, so the release cannot free it
            for j in range(i):
                pool_release(p, pages[j])
            return rc
    if n:
        memcpy(t.entries, pages, n * sizeof(uint32_t))
    t.len = n
    return Q_OK


cdef int table_release_all(Table *t, Pool *p) noexcept nogil:
    cdef uint32_t i
    cdef int rc, first = Q_OK
    for i in range(t.len):
        rc = pool_release(p, t.entries[i])
        if rc and first == Q_OK:
            first = rc
    t.len = 0
    return first


cdef object _cow(Cow *c):
    if c.kind == COW_EXCLUSIVE:
        return CopyOnWrite("exclusive", c.page, None)
    if c.kind == COW_ALLOCATED:
        return CopyOnWrite("allocated", c.page, None)
    return CopyOnWrite("copy", c.page, c.src)


cdef uint32_t *_pages_from(object pages, uint32_t *n_out, str what) except NULL:
    # RESOLVE: a Python sequence (or integer array) of page ids -> a private PyMem buffer the
    # caller frees.  The ids are read from a private list, so an id whose __index__ changes the
    # caller's container changes nothing here.
    cdef Py_ssize_t n, i
    cdef uint32_t *buf
    if isinstance(pages, np.ndarray):
        if pages.dtype.kind == "b" or pages.dtype.kind not in "iu":
            raise TypeError(f"{what} must hold integers, got dtype {pages.dtype}")
        if pages.ndim != 1:
            raise ValueError(f"{what} must be 1-D, got {pages.ndim} dimensions")
        seq = tuple(np.asarray(pages).tolist())   # a subclass's own tolist never runs
    elif isinstance(pages, _BYTES_LIKE):
        raise TypeError(f"{what} must be a sequence of page ids, not {type(pages).__name__}")
    else:
        try:
            seq = tuple(pages)   # a tuple: no __index__ run below can change it
        except TypeError:
            raise TypeError(f"{what} must be a sequence of page ids, "
                            f"not {type(pages).__name__}") from None
    n = len(seq)
    if n > U32_MAX:
        raise OverflowError(f"too many {what}")
    buf = <uint32_t *>PyMem_Malloc((n if n > 0 else 1) * sizeof(uint32_t))
    if buf == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            buf[i] = _u32((<tuple>seq)[i], "page")
    except BaseException:
        PyMem_Free(buf)
        raise
    n_out[0] = <uint32_t>n
    return buf


cdef class SequenceBlockTable:
    """The logical -> physical page map of one request, fixed capacity (docs/DESIGN.md,
    "Sequence block table and copy-on-write"): ``ensure_writable`` (copy-on-write),
    ``attach``, ``release_all``, ``entries``."""
    cdef Table table

    def __cinit__(self, capacity):
        cdef uint32_t c = _u32(capacity, "capacity")
        self.table.entries = <uint32_t *>PyMem_Malloc((c if c > 0 else 1) * sizeof(uint32_t))
        if self.table.entries == NULL:
            raise MemoryError(f"cannot allocate a block table of {c} pages")
        self.table.capacity = c
        self.table.len = 0

    def __dealloc__(self):
        PyMem_Free(self.table.entries)
        self.table.entries = NULL

    @property
    def capacity(self):
        """Logical pages the table can map, fixed at construction."""
        return self.table.capacity

    def __len__(self):
        return self.table.len

    def entries(self):
        """The mapped pages ``[0, len)`` in logical order."""
        return _list_of(self.table.entries, self.table.len)

    # A table has no owner field: it is only ever mutated inside one C call, with the GIL held
    # and no Python code running (its arguments are resolved before), so nothing can re-enter
    # it.  The pool it allocates from can be held across user code, so that is acquired.

    def ensure_writable(self, logical_page, BlockPool pool not None):
        """Make ``logical_page`` safe to write and return a :class:`CopyOnWrite`: ``allocated`` (a
        page appended), ``exclusive`` (write in place) or ``copy`` (copy ``src`` to ``page`` first;
        the table now maps ``page``). A ``TableError`` changes nothing (docs/DESIGN.md, "Sequence
        block table and copy-on-write")."""
        cdef uint32_t lp = _u32(logical_page, "logical_page")
        cdef Cow c
        cdef int rc
        cdef uint64_t tok = own_acquire(&pool.owner, NULL, NULL, NULL)
        try:
            rc = table_ensure_writable(&self.table, lp, &pool.pool, &c)
        finally:
            own_release(tok, &pool.owner, NULL, NULL, NULL)
        if rc:
            raise _error(E_TABLE, rc)
        return _cow(&c)

    def attach(self, pages, BlockPool pool not None):
        """Map shared ``pages`` into this empty table, retaining each once per appearance; every
        retain is validated before any is made (``TableError.NotEmpty``, ``OutOfRange``,
        ``InvalidPage``, ``NotAllocated``, ``Overflow``)."""
        cdef uint32_t n
        cdef int rc
        cdef uint64_t tok
        cdef uint32_t *buf = _pages_from(pages, &n, "pages")
        try:
            tok = own_acquire(&pool.owner, NULL, NULL, NULL)
            try:
                rc = table_attach(&self.table, buf, n, &pool.pool)
            finally:
                own_release(tok, &pool.owner, NULL, NULL, NULL)
        finally:
            PyMem_Free(buf)
        if rc:
            raise _error(E_TABLE, rc)

    def release_all(self, BlockPool pool not None):
        """Release every mapped page in order and empty the table; a failed release is raised after
        all the others were released."""
        cdef int rc
        cdef uint64_t tok = own_acquire(&pool.owner, NULL, NULL, NULL)
        try:
            rc = table_release_all(&self.table, &pool.pool)
        finally:
            own_release(tok, &pool.owner, NULL, NULL, NULL)
        if rc:
            raise _error(E_TABLE, rc)

    def __repr__(self):
        return f"SequenceBlockTable(capacity={self.table.capacity}, entries={self.entries()})"
