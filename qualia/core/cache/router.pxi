# The router's index (docs/DESIGN.md, "Replicas and the prefix router").
#
# Which replicas hold which page identities, built from the KV events their automatic prefix
# caches emit.  One open-addressing table (linear probing, load <= 1/2, deletion by shifting back,
# as core/cache/index.pxi) of 16-byte slots keyed inline: the page identity and a bitset of the
# replicas holding it (up to 64).  A slot whose bitset is zero is empty, so a lookup touches one
# cache line and an identity can be any 64-bit value.  Sized at construction; applying events and
# matching allocate nothing.
#
# A full table drops the new identity and counts it (as the event ring does): the router then
# sees a miss for that page, never a wrong hit.  A removal of an identity the table does not hold
# (dropped earlier, or never seen) is counted and ignored.

cdef struct RouteSlot:
    uint64_t ident
    uint64_t bits        # replicas holding the identity; 0: the slot is empty

cdef struct RouteIndex:
    RouteSlot *slots
    uint64_t mask        # slots - 1
    uint64_t capacity    # most identities held at once
    uint64_t count
    uint32_t max_replicas
    uint64_t stored
    uint64_t removed
    uint64_t cleared
    uint64_t dropped
    uint64_t unknown_removals
    uint64_t matches


cdef inline uint64_t _ri_home(RouteIndex *x, uint64_t ident) noexcept nogil:
    # identities are already mixed (a bijective finaliser); fold the high half in anyway so a
    # caller's structured ids spread too
    return (ident ^ (ident >> 29)) & x.mask


cdef inline uint64_t _ri_find(RouteIndex *x, uint64_t ident) noexcept nogil:
    # the slot of `ident`, or of the empty slot where it would go
    cdef uint64_t i = _ri_home(x, ident)
    while x.slots[i].bits != 0 and x.slots[i].ident != ident:
        i = (i + 1) & x.mask
    return i


cdef void _ri_delete(RouteIndex *x, uint64_t i) noexcept nogil:
    # empty slot i, shifting later members of its run back (no tombstones)
    cdef uint64_t j = i, k
    while True:
        j = (j + 1) & x.mask
        if x.slots[j].bits == 0:
            break
        k = _ri_home(x, x.slots[j].ident)
        # leave slot j where it is if its home lies cyclically in (i, j]
        if (i <= j and i < k and k <= j) or (i > j and (i < k or k <= j)):
            continue
        x.slots[i] = x.slots[j]
        i = j
    x.slots[i].bits = 0
    x.slots[i].ident = 0
    x.count -= 1


cdef void ri_store(RouteIndex *x, uint64_t ident, uint64_t bit) noexcept nogil:
    cdef uint64_t i = _ri_find(x, ident)
    if x.slots[i].bits != 0:
        x.slots[i].bits |= bit
        return
    if x.count >= x.capacity:
        x.dropped += 1
        return
    x.slots[i].ident = ident
    x.slots[i].bits = bit
    x.count += 1


cdef void ri_remove(RouteIndex *x, uint64_t ident, uint64_t bit) noexcept nogil:
    cdef uint64_t i = _ri_find(x, ident)
    if x.slots[i].bits & bit == 0:
        x.unknown_removals += 1
        return
    x.slots[i].bits &= ~bit
    if x.slots[i].bits == 0:
        _ri_delete(x, i)


cdef uint64_t ri_clear_replica(RouteIndex *x, uint64_t bit) noexcept nogil:
    # Take `bit` off every identity.  The walk starts just after an empty slot (there is one:
    # load <= 1/2) and goes once round the table; after a deletion it looks at the same slot
    # again, since shifting back only moves a later member of the run into it.  Returns how many
    # identities the replica held.
    cdef uint64_t start = 0, seen = 0, n = 0, i
    while x.slots[start].bits != 0:
        start += 1
    i = (start + 1) & x.mask
    while seen < x.mask:
        if x.slots[i].bits & bit:
            n += 1
            x.slots[i].bits &= ~bit
            if x.slots[i].bits == 0:
                _ri_delete(x, i)
                continue
        i = (i + 1) & x.mask
        seen += 1
    return n


cdef int ri_check_events(RouteIndex *x, const KvEvent *ev, Py_ssize_t n,
                         Py_ssize_t *bad) noexcept nogil:
    cdef Py_ssize_t k
    for k in range(n):
        if ev[k].kind != KV_STORED and ev[k].kind != KV_REMOVED and ev[k].kind != KV_CLEARED:
            bad[0] = k
            return -1
    return 0


cdef void ri_apply(RouteIndex *x, uint64_t bit, const KvEvent *ev, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t k
    for k in range(n):
        if ev[k].kind == KV_STORED:
            ri_store(x, ev[k].identity, bit)
            x.stored += 1
        elif ev[k].kind == KV_REMOVED:
            ri_remove(x, ev[k].identity, bit)
            x.removed += 1
        else:
            ri_clear_replica(x, bit)
            x.cleared += 1


cdef uint32_t ri_match(RouteIndex *x, const uint64_t *ids, Py_ssize_t n,
                       uint32_t *out) noexcept nogil:
    # out[r] = the number of leading identities replica r holds (out has max_replicas entries);
    # returns the longest.  The home slots of every page are prefetched first: the lookups are
    # independent, so their cache misses overlap instead of queueing one after another.
    cdef Py_ssize_t k
    cdef uint64_t alive, held, gone, i
    cdef uint32_t r
    for r in range(x.max_replicas):
        out[r] = 0
    for k in range(n):
        qualia_prefetch(&x.slots[_ri_home(x, ids[k])])
    alive = U64_MAX if x.max_replicas == 64 else ((<uint64_t>1) << x.max_replicas) - 1
    x.matches += 1
    for k in range(n):
        i = _ri_find(x, ids[k])
        held = alive & x.slots[i].bits
        gone = alive & ~held
        while gone:
            out[__builtin_ctzll(gone)] = <uint32_t>k
            gone &= gone - 1
        if held == 0:
            return <uint32_t>k
        alive = held
    while alive:
        out[__builtin_ctzll(alive)] = <uint32_t>n
        alive &= alive - 1
    return <uint32_t>n


cdef extern from "<math.h>" nogil:
    const double INFINITY


cdef int ri_pick(const uint32_t *pages, const double *cost, Py_ssize_t c) noexcept nogil:
    # argmax over r < c of pages[r] - cost[r] (an infinite cost: not eligible); ties go to the
    # lower cost, then the lower index; -1 when no replica is eligible (cost holds no NaN)
    cdef Py_ssize_t r
    cdef int best = -1
    cdef double score, best_score = 0.0
    for r in range(c):
        if cost[r] == INFINITY:
            continue
        score = <double>pages[r] - cost[r]
        if best < 0 or score > best_score or (score == best_score and cost[r] < cost[best]):
            best = <int>r
            best_score = score
    return best

cdef object _DT_U64 = np.dtype(np.uint64)
cdef object _DT_F64 = np.dtype(np.float64)


cdef class PrefixRouterIndex:
    """Which replicas hold which page identities: the router's global view of every replica's
    automatic prefix cache, fed by their KV events.

    ``PrefixRouterIndex(capacity, max_replicas=64)`` holds up to ``capacity`` distinct
    identities (a table of twice that many 16-byte slots, rounded up to a power of two,
    allocated once) for replicas ``0 .. max_replicas-1`` (at most 64).  ``apply_events(replica,
    events)`` folds a KV_EVENT array drained from one replica into the index;
    ``match(identities)`` gives, for every replica, how many leading pages of a prompt (its
    page identities, page 0 first) it holds.  A full index drops new identities and counts them
    (``stats()["dropped"]``): a miss, never a wrong hit."""
    cdef RouteIndex x
    cdef uint64_t owner
    cdef uint32_t *scratch      # max_replicas entries (match without an out array)

    def __cinit__(self, capacity, max_replicas=64):
        cdef uint64_t cap = _u64(capacity, "capacity")
        cdef uint32_t mr = _u32(max_replicas, "max_replicas")
        cdef uint64_t size = 2
        if cap < 1 or cap > ((<uint64_t>1) << 32):
            raise ValueError(f"capacity must be in [1, 2**32], got {cap}")
        if mr < 1 or mr > 64:
            raise ValueError(f"max_replicas must be in [1, 64], got {mr}")
        while size < 2 * cap:
            size <<= 1
        memset(&self.x, 0, sizeof(RouteIndex))
        self.x.slots = <RouteSlot *>qualia_big_zalloc(size * sizeof(RouteSlot))
        self.scratch = <uint32_t *>PyMem_Calloc(mr, sizeof(uint32_t))
        if self.x.slots == NULL or self.scratch == NULL:
            raise MemoryError(f"cannot allocate a router index of {size} slots")
        self.x.mask = size - 1
        self.x.capacity = cap
        self.x.max_replicas = mr

    def __dealloc__(self):
        qualia_big_free(self.x.slots)
        self.x.slots = NULL
        PyMem_Free(self.scratch)
        self.scratch = NULL

    cdef inline uint64_t _own(self) except 0:
        return own_acquire(&self.owner, NULL, NULL, NULL)

    cdef inline void _unown(self, uint64_t token) noexcept:
        own_release(token, &self.owner, NULL, NULL, NULL)

    @property
    def capacity(self):
        """Identities the index holds at most; a new identity past it is dropped and counted in
        ``dropped``."""
        return self.x.capacity

    @property
    def max_replicas(self):
        """Replicas the index tracks (ids ``0 .. max_replicas - 1``, at most 64)."""
        return self.x.max_replicas

    @property
    def slots(self):
        """Slots of the open-addressing table: twice ``capacity``, rounded up to a power of two."""
        return self.x.mask + 1

    def __len__(self):
        return self.x.count

    cdef uint64_t _bit(self, object replica) except 0:
        cdef uint64_t r = _int(replica, "replica", self.x.max_replicas - 1)
        return (<uint64_t>1) << r

    def apply_events(self, replica, events):
        """Fold ``events`` (a 1-D KV_EVENT array, oldest first, as ``Scheduler.drain_events``
        returns) from ``replica`` into the index: "stored" adds the replica to the identity,
        "removed" takes it off, "cleared" takes it off every identity.  Returns the number of
        events applied.  Every event is checked before any is applied: a bad kind is a
        ValueError and changes nothing."""
        cdef void *ptr
        cdef Py_ssize_t n, bad = 0
        cdef uint64_t bit = self._bit(replica)
        cdef object keep = events
        if not _fast_array(events, _DT_KV_EVENT, 8, False, &ptr, &n):
            if not (isinstance(events, np.ndarray) and events.ndim == 1
                    and events.dtype == _DT_KV_EVENT):
                raise TypeError("events must be a 1-D numpy array of dtype KV_EVENT, got "
                                f"{type(events).__name__}"
                                + (f" of dtype {events.dtype}"
                                   if isinstance(events, np.ndarray) else ""))
            # an equal dtype from elsewhere (unpickled, a strided view): one contiguous copy
            keep = np.ascontiguousarray(events).view(_DT_KV_EVENT)
            if not _fast_array(keep, _DT_KV_EVENT, 8, False, &ptr, &n):
                keep = np.array(keep, dtype=_DT_KV_EVENT, copy=True)
                _fast_array(keep, _DT_KV_EVENT, 8, False, &ptr, &n)
        if ri_check_events(&self.x, <const KvEvent *>ptr, n, &bad):
            raise ValueError(f"events[{bad}] has kind "
                             f"{(<const KvEvent *>ptr)[bad].kind}, not a KV event kind "
                             f"({KV_STORED}, {KV_REMOVED} or {KV_CLEARED})")
        cdef uint64_t tok = self._own()
        try:
            ri_apply(&self.x, bit, <const KvEvent *>ptr, n)
        finally:
            self._unown(tok)
        return n

    def remove_replica(self, replica):
        """Take ``replica`` off every identity (it died, or its cache was dropped): what a
        "cleared" event does.  Returns how many identities it held.  O(table size)."""
        cdef uint64_t bit = self._bit(replica)
        cdef uint64_t n
        cdef uint64_t tok = self._own()
        try:
            n = ri_clear_replica(&self.x, bit)
            self.x.cleared += 1
        finally:
            self._unown(tok)
        return n

    def clear(self):
        """Forget every identity."""
        cdef uint64_t tok = self._own()
        try:
            memset(self.x.slots, 0, (self.x.mask + 1) * sizeof(RouteSlot))
            self.x.count = 0
        finally:
            self._unown(tok)

    def replicas_of(self, identity):
        """The replicas holding ``identity``, as a bitset (bit r: replica r); 0 when none."""
        cdef uint64_t ident = _u64(identity, "identity")
        return self.x.slots[_ri_find(&self.x, ident)].bits

    cdef object _ids(self, object identities, const uint64_t **ptr, Py_ssize_t *n):
        # the identities as a uint64 pointer and length; returns what keeps them alive
        cdef Py_ssize_t k
        cdef uint64_t[::1] v
        cdef cnp.ndarray a
        if cnp.PyArray_CheckExact(identities):
            a = <cnp.ndarray>identities
            if (cnp.PyArray_NDIM(a) == 1 and <void *>cnp.PyArray_DESCR(a) == <void *>_DT_U64
                    and cnp.PyArray_FLAGS(a) & cnp.NPY_ARRAY_C_CONTIGUOUS
                    and (<uintptr_t>cnp.PyArray_DATA(a)) % 8 == 0):
                ptr[0] = <const uint64_t *>cnp.PyArray_DATA(a)
                n[0] = cnp.PyArray_DIMS(a)[0]
                return identities
        if isinstance(identities, _BYTES_LIKE):
            raise TypeError("identities must be a sequence of integers, not "
                            f"{type(identities).__name__}")
        if isinstance(identities, np.ndarray):
            if identities.ndim != 1:
                raise ValueError(f"identities must be 1-D, got {identities.ndim} dimensions")
            if identities.dtype.kind not in "iu":
                raise TypeError(f"identities must be integers, got dtype {identities.dtype}")
            items = tuple(np.asarray(identities).tolist())   # no subclass method runs
        else:
            try:
                items = tuple(identities)   # no __index__ run below can change it
            except TypeError:
                raise TypeError("identities must be a sequence of integers, not "
                                f"{type(identities).__name__}") from None
        out = np.empty(len(items), dtype=np.uint64)
        v = out
        for k in range(len(items)):
            v[k] = _u64((<tuple>items)[k], "identity")
        ptr[0] = <const uint64_t *>cnp.PyArray_DATA(<cnp.ndarray>out)
        n[0] = len(items)
        return out

    def match(self, identities):
        """Per replica, how many leading pages of a prompt it holds: ``identities`` are the
        prompt's page identities, page 0 first (``Scheduler.page_identities``).  Returns a uint32
        array of ``max_replicas`` entries.  Reads only; allocates the result."""
        cdef const uint64_t *ids
        cdef Py_ssize_t n
        keep = self._ids(identities, &ids, &n)
        out = np.empty(self.x.max_replicas, dtype=np.uint32)
        ri_match(&self.x, ids, n, <uint32_t *>cnp.PyArray_DATA(<cnp.ndarray>out))
        return out

    def match_into(self, identities, out):
        """``match`` into ``out`` (a writable 1-D uint32 array of at least ``max_replicas``
        entries; the rest is left alone); returns the longest match.  Allocates nothing for a
        uint64 array of identities."""
        cdef const uint64_t *ids
        cdef Py_ssize_t n, m
        cdef void *optr
        keep = self._ids(identities, &ids, &n)   # user code first: out is read after it
        if not _fast_array(out, _DT_U32, 4, True, &optr, &m):
            raise TypeError("out must be a writable 1-D C-contiguous numpy array of dtype "
                            "uint32")
        if m < self.x.max_replicas:
            raise ValueError(f"out must have at least {self.x.max_replicas} entries, got {m}")
        return ri_match(&self.x, ids, n, <uint32_t *>optr)

    def route(self, identities, cost, out):
        """One routing decision: ``match_into(identities, out)``, then the replica ``r`` among
        ``0 .. len(cost)-1`` with the most ``out[r] - cost[r]`` (pages held minus a cost in
        pages, e.g. a load penalty); ties go to the lower cost, then the lower index.  A replica
        whose cost is ``inf`` is not eligible (down, or full).  ``cost`` is a 1-D float64 array of
        at most ``max_replicas`` entries, none NaN.  Returns the replica, or -1 when none is
        eligible.  Allocates nothing for uint64 identities."""
        cdef const uint64_t *ids
        cdef Py_ssize_t n, m, c
        cdef void *optr
        cdef void *cptr
        keep = self._ids(identities, &ids, &n)   # user code first: out and cost are read after
        if not _fast_array(out, _DT_U32, 4, True, &optr, &m):
            raise TypeError("out must be a writable 1-D C-contiguous numpy array of dtype "
                            "uint32")
        if m < self.x.max_replicas:
            raise ValueError(f"out must have at least {self.x.max_replicas} entries, got {m}")
        if not _fast_array(cost, _DT_F64, 8, False, &cptr, &c):
            raise TypeError("cost must be a 1-D C-contiguous numpy array of dtype float64")
        if c > self.x.max_replicas:
            raise ValueError(f"cost has {c} entries, more than max_replicas "
                             f"({self.x.max_replicas})")
        for m in range(c):
            if (<const double *>cptr)[m] != (<const double *>cptr)[m]:
                raise ValueError(f"cost[{m}] is NaN")
        ri_match(&self.x, ids, n, <uint32_t *>optr)
        return ri_pick(<uint32_t *>optr, <const double *>cptr, c)

    def stats(self):
        """Counters: identities held, capacity, slots, events applied by kind, identities
        dropped for want of room, removals of unknown identities, matches."""
        cdef RouteIndex x = self.x    # a copy: building the dict runs Python code
        return {"identities": x.count, "capacity": x.capacity, "slots": x.mask + 1,
                "max_replicas": x.max_replicas, "stored": x.stored, "removed": x.removed,
                "cleared": x.cleared, "dropped": x.dropped,
                "unknown_removals": x.unknown_removals, "matches": x.matches}

    def __repr__(self):
        return (f"PrefixRouterIndex(identities={self.x.count}, capacity={self.x.capacity}, "
                f"max_replicas={self.x.max_replicas})")
