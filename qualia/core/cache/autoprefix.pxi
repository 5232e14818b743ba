# Automatic prefix caching, part 2: what the facade does with the page cache (docs/DESIGN.md,
# "Automatic prefix caching").
#
# The facade keeps every request's token stream in a per-slot row (prompt tokens copied at
# admission, each decode round's input token written at its position); the engine step lends
# each stream its entry's row of the step's token arena instead, which already holds the prompt
# and every sampled token, so nothing is copied.  Per logical page the stream keeps (one
# PageRef, so that a page's fill reads one line of them)
# the page's identity and the cache entry that stands for it (the request's own page once
# inserted, or an identical entry that was already cached).  Admission shares the longest
# verified cached run from page 0; every page that fills is inserted; finish hands pages back
# last page first; allocations reclaim least recently used pages for what the free stack lacks,
# decided before anything is mutated.  Each function is O(pages of one request or one call).

cdef struct PageRef:
    uint64_t ident      # the page's chain value (pc_chain)
    uint64_t gen        # the generation of `canon` when it was matched or inserted
    uint32_t canon      # the cache entry standing for the page
    uint32_t pad


cdef struct Stream:
    uint32_t *row       # the slot's tokens (logical_pages x page_tokens): its own, or lent
    uint32_t known      # leading positions whose tokens the stream's row holds
    uint32_t hashed     # leading pages whose identity is computed
    uint32_t done       # leading pages handed to the cache (hit, inserted or deduplicated)
    uint32_t ns
    uint32_t pending    # the input token and position of the slot's current decode round
    uint32_t pending_pos
    uint8_t live        # the slot holds a request of the automatic mode
    uint8_t broken      # the chain cannot be continued: no later page is cached
    uint8_t has_pending

cdef struct Probe:
    # a match auto_match made for the same prompt and namespace on the same cache state (the
    # engine step's fit test, just before it admits): the admission takes it instead of
    # hashing and looking up again; `refs` may be the admitted slot's own page records
    const PageRef *refs     # the chain values of the first `hashed` pages, the matched
    uint32_t hashed         # entries of the first `k`
    uint32_t k
    bint collided


cdef struct Streams:
    Stream *st          # max_requests
    uint32_t *tokens    # the rows' storage when the streams own them, else NULL
    PageRef *refs       # max_requests x logical_pages
    PageRef *read       # logical_pages: cached_prefix's own (a read writes no core scratch)
    uint32_t *hit       # logical_pages: an admission's matched entries, for table_attach
    uint32_t logical_pages
    uint32_t page_tokens
    uint32_t pt_shift   # log2(page_tokens) when it is a power of two (pt_pow2)
    bint pt_pow2
    uint32_t cacheable  # streams that are live and not broken: 0 lets a decode round skip them


cdef inline void stream_stop(Streams *ss, Stream *st) noexcept nogil:
    # no later page of this stream is cached
    if st.live and not st.broken:
        ss.cacheable -= 1
    st.broken = 1


cdef int streams_init(Streams *ss, uint32_t max_requests, uint32_t logical_pages,
                      uint32_t page_tokens, bint own_rows) except -1:
    # own_rows: the streams hold each slot's tokens themselves (the facade); else every
    # admission and fork lends the slot's row (auto_admit, auto_fork_stream: the engine step)
    cdef size_t pages = <size_t>max_requests * logical_pages
    cdef uint32_t i
    memset(ss, 0, sizeof(Streams))
    ss.st = <Stream *>PyMem_Calloc(max_requests, sizeof(Stream))
    if own_rows:
        ss.tokens = <uint32_t *>qualia_big_zalloc((pages * page_tokens if pages else 1)
                                                  * sizeof(uint32_t))
    ss.refs = <PageRef *>qualia_big_zalloc((pages if pages else 1) * sizeof(PageRef))
    ss.read = <PageRef *>PyMem_Malloc((logical_pages + 1) * sizeof(PageRef))
    ss.hit = <uint32_t *>PyMem_Malloc((logical_pages + 1) * sizeof(uint32_t))
    if ss.st == NULL or (own_rows and ss.tokens == NULL) or ss.refs == NULL \
            or ss.read == NULL or ss.hit == NULL:
        raise MemoryError(f"cannot allocate token streams of {max_requests} x {logical_pages} "
                          f"x {page_tokens} tokens")
    ss.logical_pages = logical_pages
    ss.page_tokens = page_tokens
    ss.pt_pow2 = page_shift(page_tokens, &ss.pt_shift)
    if own_rows:
        for i in range(max_requests):
            ss.st[i].row = &ss.tokens[<size_t>i * logical_pages * page_tokens]
    return 0


cdef void streams_free(Streams *ss) noexcept:
    PyMem_Free(ss.st)
    qualia_big_free(ss.tokens)
    qualia_big_free(ss.refs)
    PyMem_Free(ss.read)
    PyMem_Free(ss.hit)
    memset(ss, 0, sizeof(Streams))


cdef inline size_t _sp(Streams *ss, uint32_t slot) noexcept nogil:
    # offset of the slot's first page in the per-page arrays
    return <size_t>slot * ss.logical_pages


cdef inline PageRef *stream_refs(Streams *ss, uint32_t slot) noexcept nogil:
    # the slot's page records
    return &ss.refs[_sp(ss, slot)]


cdef enum:
    HASH_AHEAD = 1024   # how many bytes ahead auto_match prefetches the tokens it hashes


cdef uint32_t auto_match(PageCache *c, const uint32_t *tok, uint32_t n, uint32_t ns,
                         uint64_t nsh, uint32_t nhash, PageRef *refs,
                         bint *collided) noexcept nogil:
    # Hash tok's first `nhash` full pages (at least the `cap` pages an admission may reuse): their
    # chain values into refs[].ident; then find the longest verified cached run from page 0
    # (refs[].canon and .gen: each matched entry).  Two passes: the chain is the critical path,
    # and the lookups of different pages do not depend on each other, so the CPU overlaps them.
    cdef uint32_t k, q, pt = c.page_tokens, pp = 0
    cdef uint32_t cap = (n - 1) // pt if n else 0
    cdef uint64_t prev = 0, pg = 0
    cdef size_t i, end = <size_t>nhash * pt
    for k in range(nhash):
        # the tokens HASH_AHEAD bytes past this page's, a line at a time: a prompt's tokens
        # were written when it was queued and have left the cache since
        i = <size_t>k * pt + HASH_AHEAD // sizeof(uint32_t)
        while i < end and i < <size_t>(k + 1) * pt + HASH_AHEAD // sizeof(uint32_t):
            qualia_prefetch_r(&tok[i])
            i += 64 // sizeof(uint32_t)
        prev = pc_chain(c, prev, k > 0, nsh, &tok[<size_t>k * pt])
        refs[k].ident = prev
    collided[0] = False
    k = 0
    while k < cap:
        q = pc_find(c, pc_ident(c, refs[k].ident))
        if q == U32_MAX:
            break
        if not pc_matches(c, q, ns, k > 0, pp, pg, &tok[<size_t>k * pt]):
            collided[0] = True
            break
        pp = q
        pg = pc_rec(c, q).gen
        refs[k].canon = pp
        refs[k].gen = pg
        k += 1
    return k


cdef int auto_admit(Sched *s, Pool *p, PageCache *c, Streams *ss, uint64_t rid,
                    const uint32_t *tok, uint32_t n, const uint8_t *nsb, uint32_t nsl,
                    uint64_t nsh, uint32_t *row, const Probe *probe,
                    Admission_c *out) noexcept nogil:
    # Admit `rid` with prompt tok[0..n): share the longest verified cached run of full pages
    # from page 0, leaving at least one token to compute.  Nothing changes on failure (a
    # namespace interned for this call is freed again).  `row` NULL: the prompt is copied into
    # the slot's own row; else the stream reads `row`, which holds tok[0..n) and whose
    # positions below the stream's known count the lender never changes while the request
    # holds the slot (row == tok in the engine step).  `probe`, if not NULL, is the match
    # auto_match made for this prompt in the namespace interned here, on this cache state.
    cdef int32_t index
    cdef uint32_t ns, k, hashed, i, pt = c.page_tokens
    cdef bint collided
    cdef int rc
    cdef Admission_c adm
    cdef PageRef *refs
    cdef Stream *st
    if sched_find(s, rid) >= 0:
        return Q_DUPLICATE_REQUEST
    index = sched_lowest_free(s)
    if index < 0:
        return Q_FULL
    st = &ss.st[index]
    if st.live:
        # the slot's last request was finished through the raw RequestScheduler, behind the
        # facade's back: drop its namespace reference now
        stream_stop(ss, st)
        st.live = 0
        ns_unref(&c.ns, st.ns)
    # A new namespace may take an idle namespace's id (reclaiming its pages) and then has no
    # cached page: its match is empty, and attaching no page to the free slot's empty table
    # cannot fail, so nothing after a reclaim can fail.
    rc = pc_intern_ns(c, p, nsh, nsb, nsl, &ns)
    if rc:
        return rc
    refs = stream_refs(ss, index)
    hashed = n // pt   # every full page of the prompt is hashed here, once
    if probe != NULL and probe.hashed <= hashed:
        # the probe's chain values and match (copied unless the probe wrote them here); the
        # last full page is hashed here if the probe left it (it hashes the pages an
        # admission may reuse)
        if probe.refs != refs:
            memcpy(refs, probe.refs, <size_t>probe.hashed * sizeof(PageRef))
        for i in range(probe.hashed, hashed):
            refs[i].ident = pc_chain(c, refs[i - 1].ident if i else 0, i > 0, nsh,
                                     &tok[<size_t>i * pt])
        k = probe.k
        collided = probe.collided
    else:
        k = auto_match(c, tok, n, ns, nsh, hashed, refs, &collided)
    for i in range(k):
        ss.hit[i] = refs[i].canon
    rc = table_attach(&s.slots[index].blocks, ss.hit, k, p)
    if rc:
        ns_free_if_unused(&c.ns, ns)
        return rc
    for i in range(k):
        pc_on_retain(c, p, refs[i].canon)
    sched_admit(s, rid, False, 0, 0, NULL, p, &adm)   # cannot fail: checked above
    s.slots[index].token_count = k * pt
    s.slots[index].prefix_tokens = k * pt
    st.live = 1
    st.broken = 0
    ss.cacheable += 1
    st.has_pending = 0
    st.ns = ns
    st.known = n
    st.hashed = hashed
    st.done = k
    if row != NULL:
        st.row = row
    elif n:
        memcpy(st.row, tok, <size_t>n * sizeof(uint32_t))
    if n:
        c.lookups += 1
        c.lookup_tokens += n
        c.hit_tokens += <uint64_t>k * pt
    c.collisions += collided
    c.pages_hashed += hashed
    ns_ref(&c.ns, ns)
    out.slot = <uint16_t>index
    out.prefix_tokens = k * pt
    return Q_OK


cdef void auto_fill(Sched *s, Pool *p, PageCache *c, Streams *ss, uint32_t index) noexcept nogil:
    # Hand every page that is now full (computed and with known tokens) to the cache, in order.
    cdef Stream *st = &ss.st[index]
    cdef Slot *sl = &s.slots[index]
    cdef uint32_t pt = c.page_tokens
    cdef uint32_t limit, k, first, q, slot, ahead = 0, pp = 0
    cdef uint64_t ident, pid = 0, pg = 0
    cdef uint64_t ids[PC_AHEAD]     # identities of the pages prefetched ahead, by k % PC_AHEAD
    cdef PageRef *refs = stream_refs(ss, index)
    cdef const uint32_t *entries = sl.blocks.entries
    cdef const uint32_t *t
    cdef CachePage *x
    if not st.live or st.broken:
        return
    limit = (sl.token_count if sl.token_count < st.known else st.known)
    limit = limit >> ss.pt_shift if ss.pt_pow2 else limit // pt
    if limit > sl.blocks.len:
        limit = sl.blocks.len
    k = first = st.done
    if k < limit:
        if k:
            pp = refs[k - 1].canon
            pg = refs[k - 1].gen
            pid = pc_ident(c, refs[k - 1].ident)
        # the pages already hashed (a prompt's, at admission): their index slots and records
        # are prefetched PC_AHEAD pages ahead, so that the lookups and inserts overlap their
        # misses
        ahead = limit if limit < st.hashed else st.hashed
        while k < ahead and k < st.done + PC_AHEAD:
            ids[k % PC_AHEAD] = pc_ident(c, refs[k].ident)
            pc_prefetch_fill(c, ids[k % PC_AHEAD], entries[k])
            k += 1
        k = st.done
    while k < limit:
        t = &st.row[<size_t>k * pt]
        if k < ahead:
            ident = ids[k % PC_AHEAD]
            if k + PC_AHEAD < ahead:
                ids[k % PC_AHEAD] = pc_ident(c, refs[k + PC_AHEAD].ident)
                pc_prefetch_fill(c, ids[k % PC_AHEAD], entries[k + PC_AHEAD])
        else:
            # past the pages hashed so far (k >= st.hashed)
            refs[k].ident = pc_chain(c, refs[k - 1].ident if k else 0, k > 0,
                                     c.ns.hashes[st.ns], t)
            st.hashed = k + 1
            c.pages_hashed += 1
            ident = pc_ident(c, refs[k].ident)
        if k == first and k and not pc_live(c, pp, pg):
            # the parent entry was reclaimed or cleared (checked for the first page only: the
            # later pages' parents were matched or inserted here, and nothing here drops one)
            stream_stop(ss, st)
            return
        q = pc_find_slot(c, ident, &slot)
        if q != U32_MAX:
            if not pc_matches(c, q, st.ns, k > 0, pp, pg, t):
                c.collisions += 1          # a different page has this identity: not cached
                stream_stop(ss, st)
                return
            if q != entries[k]:
                c.duplicates += 1          # identical entry: the request keeps its own page
            x = pc_rec(c, q)
        else:
            q = entries[k]
            if q >= c.num_blocks:
                stream_stop(ss, st)
                return
            x = pc_rec(c, q)
            if x.state != PC_NONE or pc_insert(c, p, q, x, ident, slot, pid,
                                               pp if k else U32_MAX, pg, st.ns, t):
                stream_stop(ss, st)         # cached under another identity, or refcount
                return                      # overflow: not cached
        pp = q
        pg = x.gen
        pid = ident
        refs[k].canon = pp
        refs[k].gen = pg
        k += 1
        st.done = k
    if sl.token_count > <uint64_t>sl.blocks.len * pt:
        stream_stop(ss, st)  # tokens counted past the mapped pages: their KV is nowhere
    elif sl.token_count > st.known:
        stream_stop(ss, st)  # positions with unknown tokens: never continued


cdef inline void auto_hash_ahead_lent(Sched *s, Pool *p, PageCache *c, Streams *ss,
                                      uint32_t index, uint32_t num_tokens) noexcept nogil:
    # Ahead of auto_fill_lent for a chunk that completes a page: the first page it will hand
    # to the cache is hashed here, as auto_fill would hash it (its tokens are all in the row,
    # which only grows at its end: the chain value stays right), and what the fill reads is
    # prefetched (the index slot, the page's record and pool count, the parent's record), so
    # that the fill neither hashes it again nor waits on them.
    cdef Stream *st = &ss.st[index]
    cdef Slot *sl = &s.slots[index]
    cdef uint32_t k = st.done, pt = c.page_tokens, page
    cdef uint64_t chain
    cdef PageRef *refs = stream_refs(ss, index)
    if not st.live or st.broken or k >= sl.blocks.len or <uint64_t>(k + 1) * pt > num_tokens:
        return
    if k < st.hashed:
        chain = refs[k].ident
    else:
        chain = pc_chain(c, refs[k - 1].ident if k else 0, k > 0, c.ns.hashes[st.ns],
                         &st.row[<size_t>k * pt])
        refs[k].ident = chain
        st.hashed = k + 1
        c.pages_hashed += 1
    page = sl.blocks.entries[k]
    pc_prefetch_fill(c, pc_ident(c, chain), page)
    if page < p.num_blocks:
        qualia_prefetch_w(&p.refcount[page])             # the cache's reference the fill takes
    if k and refs[k - 1].canon < c.num_blocks:
        qualia_prefetch_r(pc_rec(c, refs[k - 1].canon))   # the parent, whose entry the fill checks


cdef inline void auto_note_token(Sched *s, Streams *ss, uint32_t index, uint32_t pos,
                                 uint32_t tok) noexcept nogil:
    # A decode round computed `tok` at position `pos` of the slot's stream.
    cdef Stream *st = &ss.st[index]
    cdef uint32_t *arena = st.row
    if not st.live or st.broken or pos > st.known:
        return   # not cached any more, or a gap: positions whose tokens are unknown
    if pos < st.known:
        if arena[pos] == tok:
            return
        st.known = pos   # the stream leaves the planned prompt here
        if st.hashed > pos // ss.page_tokens:
            st.hashed = pos // ss.page_tokens
    if pos < <uint64_t>ss.logical_pages * ss.page_tokens:
        arena[pos] = tok
        st.known = pos + 1


cdef inline void auto_fill_lent(Sched *s, Pool *p, PageCache *c, Streams *ss, uint32_t index,
                                uint32_t num_tokens) noexcept nogil:
    # auto_fill for a stream whose row is lent (the engine step): the row holds the request's
    # first `num_tokens` tokens and only ever grows at its end, so the stream knows them all.
    # The engine step calls this only when a page may have filled, so that a decode that fills
    # none touches no stream.
    cdef Stream *st = &ss.st[index]
    if not st.live or st.broken:
        return
    st.known = num_tokens
    auto_fill(s, p, c, ss, index)


cdef int auto_finish(Sched *s, Pool *p, PageCache *c, Streams *ss, int32_t index) noexcept nogil:
    # Release the request's pages from its last page to its first, so that its tail pages are
    # reclaimed before its head pages; on a pool error the table is emptied and the request
    # stays active (as the seed's finish).
    cdef Table *t = &s.slots[index].blocks
    cdef uint32_t i, page
    cdef int rc, first = Q_OK
    cdef PcRun run
    # what the releases write (pool counts, records), prefetched PC_AHEAD pages ahead
    i = t.len
    while i > 0 and i + PC_AHEAD > t.len:
        i -= 1
        pc_prefetch_page(c, p, t.entries[i])
    i = t.len
    pc_run_begin(c, &run)
    while i > 0:
        i -= 1
        if i >= PC_AHEAD:
            pc_prefetch_page(c, p, t.entries[i - PC_AHEAD])
        page = t.entries[i]
        rc = pool_release(p, page)
        if rc:
            if first == Q_OK:
                first = rc
        else:
            pc_run_release(c, p, page, &run)
    pc_run_end(c, &run)
    t.len = 0
    if first:
        return first
    slot_clear(s, index)
    if ss.st[index].live:
        stream_stop(ss, &ss.st[index])
        ss.st[index].live = 0
        ns_unref(&c.ns, ss.st[index].ns)
    return Q_OK


cdef int auto_need_pages(Table *t, uint32_t first, uint32_t last, Pool *p, PageCache *c,
                         uint64_t *need) noexcept nogil:
    # What table_ensure_writable over logical pages first..last would allocate, and the error
    # it would stop at, without doing it: OutOfRange, Gap, InvalidPage, NotAllocated, or
    # Exhausted where the running count passes free + reclaimable pages.
    cdef uint64_t vlen = t.len
    cdef uint64_t avail = <uint64_t>p.free_top + c.n_state[PC_RECLAIMABLE]
    cdef uint64_t lp
    cdef uint32_t page
    if first == vlen and first <= last and last < t.capacity:
        # every page is appended (a prefill chunk's): the loop's count at once, and where it
        # would stop
        if need[0] + (last - first + 1) > avail:
            need[0] = (avail if need[0] <= avail else need[0]) + 1
            return Q_EXHAUSTED
        need[0] += last - first + 1
        return Q_OK
    for lp in range(first, <uint64_t>last + 1):
        if lp >= t.capacity:
            return Q_OUT_OF_RANGE
        if lp > vlen:
            return Q_GAP
        if lp == vlen:
            vlen += 1
            need[0] += 1
        else:
            page = t.entries[lp]
            if page >= p.num_blocks:
                return Q_INVALID_PAGE
            if p.refcount[page] == 0:
                return Q_NOT_ALLOCATED
            if p.refcount[page] == 1:
                continue
            need[0] += 1
        if need[0] > avail:
            return Q_EXHAUSTED
    return Q_OK


cdef void auto_after_cow(PageCache *c, Pool *p, Undo *log, Py_ssize_t n) noexcept nogil:
    # after a call succeeded: a cached page that a copy-on-write let go may now be reclaimable
    cdef Py_ssize_t k
    for k in range(n):
        if log[k].kind == COW_COPY:
            pc_on_release(c, p, log[k].src)


cdef int auto_decode_prepare(Sched *s, Pool *p, PageCache *c, Streams *ss, Undo *undo,
                             uint32_t page_tokens) noexcept nogil:
    # The facade's decode round: note each decoding slot's input token and position (streams
    # still cached); reclaim what the round's make-writable will allocate, or fail before
    # changing anything.
    # With no reclaimable page there is nothing to reclaim, and the make-writable loop fails
    # with the same first error, changing nothing, so the count is skipped.  A page several
    # decoding forks share is counted as the round will find it: each writer but the last
    # holder copies it (fork_writer_seen, undone before returning).
    cdef uint64_t need = 0
    cdef uint64_t avail = <uint64_t>p.free_top + c.n_state[PC_RECLAIMABLE]
    cdef bint count = c.n_state[PC_RECLAIMABLE] != 0
    cdef bint note = ss.cacheable != 0
    cdef uint32_t i, w, lp
    cdef uint64_t bits
    cdef int rc = Q_OK
    cdef Py_ssize_t n_seen = 0
    cdef Slot *sl
    cdef Stream *st
    if not count and not note:
        return Q_OK
    for w in range(s.n_words):
        bits = s.decode_bits[w]
        while bits:
            i = w * 64 + __builtin_ctzll(bits)
            bits &= bits - 1
            sl = &s.slots[i]
            if note:
                st = &ss.st[i]
                st.has_pending = st.live and not st.broken and sl.token_ready
                st.pending = sl.next_token_id
                st.pending_pos = sl.token_count
            if not count:
                continue
            lp = sl.token_count // page_tokens
            if lp == sl.blocks.len and lp < sl.blocks.capacity:
                need += 1                      # the usual cases, inline
                if need > avail:
                    rc = Q_EXHAUSTED
                    break
            elif lp < sl.blocks.len and sl.blocks.entries[lp] < p.num_blocks \
                    and p.refcount[sl.blocks.entries[lp]] == 1:
                pass
            else:
                rc = auto_need_pages(&sl.blocks, lp, lp, p, c, &need)
                if rc:
                    break
                fork_writer_seen(p, &sl.blocks, lp, undo, &n_seen)
        if rc:
            break
    fork_writers_restore(p, undo, n_seen)
    if rc:
        return rc
    if count:
        return pc_make_room(c, p, need)
    return Q_OK


cdef void auto_after_round(Sched *s, Pool *p, PageCache *c, Streams *ss,
                           uint32_t n) noexcept nogil:
    # the round computed each item's input token at its position: record it, cache what
    # filled
    cdef uint32_t j, i
    cdef Stream *st
    if ss.cacheable == 0:
        return
    for j in range(n):
        i = s.lowered[j]
        st = &ss.st[i]
        if st.has_pending:
            auto_note_token(s, ss, i, st.pending_pos, st.pending)
            st.has_pending = 0
        auto_fill(s, p, c, ss, i)
