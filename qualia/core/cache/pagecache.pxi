# Automatic prefix caching, part 1: the page cache (docs/DESIGN.md, "Automatic prefix caching").
#
# One record per physical page of the pool: whether the page is cached, its 64-bit identity, its
# parent link (the parent's physical page and the generation of the parent's entry, or none for
# the first page of a chain), its namespace id, the generation stamped when it was inserted, its
# links on its namespace's reclaimable list and its slot in the reclaim ring.  A copy of every
# cached page's tokens sits beside the records, and an open-addressing index maps identity ->
# page.  The cache holds one pool
# reference on every page it caches, so the block pool is unchanged.
#
# A cached page is "in use" (a request holds it too: counted, on no list, so that inserting or
# releasing it touches no other page's record) or "reclaimable" (only the cache holds it: on the
# reclaimable list, least recently used first, and on its namespace's list of reclaimable pages
# in the same order).  A namespace whose every reference is a reclaimable page is "idle": on the
# list of idle namespaces, least recently used first, whose head gives up its pages and its id
# when a new namespace needs one and none is free.  Lookups verify tokens, namespace and parent
# link, so a hash collision can never hand out the wrong page.  Every function is O(1) or
# O(pages of one call), amortised where a reclaim skips the ring's dead entries at its head
# (see PageCache.order), but clearing the cache, which walks the records once.  All memory is
# allocated by pc_init.

cdef enum:
    PC_NONE = 0          # record state: the page is not cached
    PC_INUSE = 1         # cached, and some request holds the page too
    PC_RECLAIMABLE = 2   # cached, and only the cache holds it

cdef enum:
    KV_STORED = 1
    KV_REMOVED = 2
    KV_CLEARED = 3

cdef enum:
    NS_MAX_BYTES = 256   # longest namespace the automatic cache interns
    PC_KEY_WORDS = 8

cdef struct KvEvent:
    uint64_t identity
    uint64_t parent
    uint32_t namespace_id
    uint32_t token_count
    uint32_t page
    uint8_t kind
    uint8_t has_parent
    uint16_t _reserved

cdef struct PcLinks:
    # a reclaimable page's links on its namespace's reclaimable list (U32_MAX: none)
    uint32_t ns_prev
    uint32_t ns_next

cdef struct CachePage:
    uint64_t ident
    uint64_t parent_ident
    uint64_t gen
    uint64_t parent_gen
    uint32_t parent       # the parent's physical page (U32_MAX: first page of a chain)
    uint32_t ns
    PcLinks lk
    uint32_t pos          # the ring slot of its live entry on the reclaimable list (U32_MAX: none)
    uint8_t state
    uint8_t has_parent

cdef struct NsTable:
    uint8_t *names        # capacity x NS_MAX_BYTES
    uint32_t *lens
    uint64_t *hashes
    uint32_t *refs        # live requests + cached pages in the namespace
    uint32_t *n_rec       # its reclaimable cached pages
    uint32_t *rec_head    # its reclaimable pages, least recently used first (U32_MAX: none)
    uint32_t *rec_tail
    uint32_t *idle_prev   # the idle list: namespaces whose references are all reclaimable
    uint32_t *idle_next   # pages, least recently used first (U32_MAX: none)
    uint8_t *idle         # on the idle list
    uint32_t idle_head
    uint32_t idle_tail
    int32_t *index        # open addressing by hash
    uint32_t *free_ids    # stack of unused ids, lowest on top
    uint32_t n_free
    uint32_t mask
    uint32_t capacity
    uint32_t count

cdef struct EventRing:
    # a single-producer, single-consumer ring (pc_emit, pc_drain): `tail` counts the events
    # ever written and is written only by the producer, `head` counts the events ever drained
    # and is written only by the consumer; record i lives at buf[i % capacity]
    KvEvent *buf
    uint32_t capacity
    uint32_t wpos         # the producer's: tail % capacity, kept without a division
    uint64_t head
    uint64_t tail
    uint64_t dropped      # the producer's: events refused because the ring was full

cdef struct PcSlot:
    uint32_t tag          # the identity folded to 32 bits (pc_tag): its low bits are the home
    int32_t page          # -1: empty


cdef struct PageCache:
    char *recs            # num_blocks records of `stride` bytes: a CachePage, then the tokens
    size_t stride
    # The reclaimable list, least recently used first, as a ring of ring_cap slots holding
    # pages: ring_len slots from ring_head, of which the live ones are the list in order.  A
    # live entry's slot is marked in `alive` and noted in its page's record (pos): a page that
    # leaves the list mid-way (a hit retakes it, a namespace gives it up) only has its slot
    # marked dead and its pos cleared, and the entry is skipped when the head reaches it.  A
    # reclaim reads the pages it will drop from consecutive slots, so it knows them ahead
    # without a load that waits on the one before.
    # The dead entries are compacted away a few at a time (ring_cap is 3 num_blocks; see
    # _pc_compact_some), so that no call does more than a bounded part of it.
    uint32_t *order       # ring_cap slots
    # whether each slot's entry is live (read in slot order, so that skipping and compacting
    # dead entries reads no record)
    uint8_t *alive        # ring_cap
    uint32_t ring_cap
    uint32_t ring_head
    uint32_t ring_len
    # The compaction in progress (cmp_on), as offsets from the head: the entries before cmp_w
    # are compacted (live when moved there, in order), those from cmp_w to cmp_r are dead (moved
    # on or dead already), those from cmp_r on are still to be read.  It starts when ring_len
    # reaches cmp_start and ends when cmp_r reaches the tail, which then moves back to cmp_w.
    uint32_t cmp_w
    uint32_t cmp_r
    uint32_t cmp_start
    bint cmp_on
    # open addressing by identity: each slot's page (-1: empty) beside its identity's 32-bit tag,
    # so that a probe reads no record but a tag's match (8 bytes a slot: 8 slots a cache line)
    PcSlot *index
    uint64_t *nh          # NH key words: 2 per 4 tokens (rounded up)
    uint32_t index_mask
    uint32_t num_blocks
    uint32_t page_tokens
    uint32_t n_state[3]
    uint64_t gen
    uint64_t ident_mask   # all ones; a test hook narrows it to force collisions
    uint64_t parent_mask  # all ones; a test hook clears it to make identities parent-blind
    uint64_t k[8]
    NsTable ns
    EventRing ev
    uint64_t lookups
    uint64_t lookup_tokens
    uint64_t hit_tokens
    uint64_t reclaims
    uint64_t collisions
    uint64_t stored
    uint64_t duplicates
    uint64_t pages_hashed


# The page hash (docs/DESIGN.md, "Automatic prefix caching"): NH with 64-bit words over the page's
# tokens (two u32 tokens per word, little-endian; 128-bit sum of (w0 + K0) * (w1 + K1) products),
# folded to 64 bits with the namespace hash by a keyed 64x64->128 multiply-fold; that folded with
# the parent page's chain value the same way gives the page's chain value; its identity is the
# splitmix64 finaliser of the chain value.
cdef extern from "qualia_cache.h" nogil:
    void *qualia_big_zalloc(size_t n)
    void qualia_big_free(void *p)
    uint64_t qualia_mum(uint64_t a, uint64_t b)
    uint64_t qualia_mix64(uint64_t z)
    uint64_t qualia_page_chain(const uint64_t *k, const uint64_t *K, uint32_t n, uint64_t parent,
                               int has_parent, uint64_t ns_hash, const uint32_t *t)
    uint64_t qualia_load_acquire(const uint64_t *p)
    void qualia_store_release(uint64_t *p, uint64_t v)


# Prefetch hints: a read with little reuse (the router's slots), and a read or a write of what
# the next few steps of a loop touch (the page cache's index slots and records).
cdef extern from *:
    """
    #define qualia_prefetch(p) __builtin_prefetch((p), 0, 1)
    #if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    /* an asm statement: GCC may delete a __builtin_prefetch whose address nothing else uses */
    #define qualia_prefetch_r(p) __asm__ __volatile__("prefetcht0 %0" :: "m"(*(const char *)(p)))
    #define qualia_prefetch_w(p) __asm__ __volatile__("prefetcht0 %0" :: "m"(*(const char *)(p)))
    #else
    #define qualia_prefetch_r(p) __builtin_prefetch((p), 0, 3)
    #define qualia_prefetch_w(p) __builtin_prefetch((p), 1, 3)
    #endif
    """
    void qualia_prefetch(const void *p) nogil
    void qualia_prefetch_r(const void *p) nogil
    void qualia_prefetch_w(const void *p) nogil


# -- hashing ------------------------------------------------------------------------------------

cdef inline CachePage *pc_rec(PageCache *c, uint32_t page) noexcept nogil:
    return <CachePage *>(c.recs + <size_t>page * c.stride)


cdef inline uint32_t *pc_tok(PageCache *c, uint32_t page) noexcept nogil:
    return <uint32_t *>(c.recs + <size_t>page * c.stride + sizeof(CachePage))


cdef inline void pc_copy_tokens(uint32_t *dst, const uint32_t *src, uint32_t n) noexcept nogil:
    # a page's tokens into its record: the common page size as a fixed-size copy (a few vector
    # moves, no call)
    if n == 16:
        memcpy(dst, src, 16 * sizeof(uint32_t))
    else:
        memcpy(dst, src, n * sizeof(uint32_t))


cdef inline bint pc_same_tokens(const uint32_t *a, const uint32_t *b, uint32_t n) noexcept nogil:
    # branch-free over the page (the compiler vectorises it); one branch at the end
    cdef uint32_t i, d = 0
    for i in range(n):
        d |= a[i] ^ b[i]
    return d == 0


cdef inline uint32_t pc_nh_words(uint32_t page_tokens) noexcept nogil:
    return 2 * ((page_tokens + 3) // 4)


cdef void pc_set_key(PageCache *c, uint64_t lo, uint64_t hi) noexcept nogil:
    # Expand the 16-byte key (two little-endian u64 halves) into the scalar keys and the NH key
    # words with a splitmix64-style generator over both halves.
    cdef uint64_t s = lo ^ <uint64_t>0x6A09E667F3BCC908
    cdef uint64_t t = hi ^ <uint64_t>0xBB67AE8584CAA73B
    cdef uint64_t w
    cdef uint32_t i, words = PC_KEY_WORDS + pc_nh_words(c.page_tokens)
    for i in range(words):
        s += <uint64_t>0x9E3779B97F4A7C15
        t += <uint64_t>0xD1B54A32D192ED03
        w = qualia_mix64(qualia_mix64(s) ^ t)
        if i < PC_KEY_WORDS:
            c.k[i] = w
        else:
            c.nh[i - PC_KEY_WORDS] = w


cdef inline uint64_t pc_chain(PageCache *c, uint64_t parent_chain, bint has_parent,
                              uint64_t ns_hash, const uint32_t *t) noexcept nogil:
    # the chain value of a page from its parent's chain value (ignored for page 0)
    return qualia_page_chain(c.k, c.nh, c.page_tokens, parent_chain & c.parent_mask,
                             has_parent, ns_hash, t)


cdef inline uint64_t pc_ident(PageCache *c, uint64_t chain) noexcept nogil:
    # a page's identity: its chain value through the finaliser (a bijection), off the chain
    return qualia_mix64(chain ^ c.k[5]) & c.ident_mask


cdef uint64_t pc_ns_hash(PageCache *c, const uint8_t *s, uint32_t n) noexcept nogil:
    # keyed hash of a namespace's bytes, 8 bytes (little-endian, zero-padded) per step
    cdef uint64_t h = c.k[6] ^ n, w
    cdef uint32_t i = 0, j
    while i < n:
        w = 0
        j = 0
        while j < 8 and i + j < n:
            w |= (<uint64_t>s[i + j]) << (8 * j)
            j += 1
        h = qualia_mix64(h ^ w) + c.k[7]
        i += 8
    return qualia_mix64(h + c.k[7])


# -- namespaces -----------------------------------------------------------------------------------
# Interned names, compared byte for byte.  Id 0 is the empty namespace and is never freed; any
# other id is freed when no live request and no cached page uses it, and may then be reused.  A
# namespace other than id 0 whose every reference is a reclaimable cached page is idle (on the
# idle list, in the order it became idle); pc_intern_ns reclaims the oldest idle namespace's pages
# to free its id when the table is full.

cdef inline uint32_t _ns_home(NsTable *t, uint64_t h) noexcept nogil:
    return <uint32_t>(h ^ (h >> 29)) & t.mask


cdef uint32_t _ns_home_of(void *ctx, int32_t e) noexcept nogil:
    cdef NsTable *t = <NsTable *>ctx
    return _ns_home(t, t.hashes[e])


cdef uint32_t ns_find(NsTable *t, uint64_t h, const uint8_t *s, uint32_t n) noexcept nogil:
    cdef uint32_t i = _ns_home(t, h)
    cdef int32_t e
    while True:
        e = t.index[i]
        if e < 0:
            return U32_MAX
        if (t.hashes[e] == h and t.lens[e] == n
                and (n == 0 or memcmp(&t.names[<size_t>e * NS_MAX_BYTES], s, n) == 0)):
            return <uint32_t>e
        i = (i + 1) & t.mask


cdef int ns_intern(NsTable *t, uint64_t h, const uint8_t *s, uint32_t n,
                   uint32_t *out) noexcept nogil:
    # the id of the namespace, interning it (with no reference) when new; Q_NAMESPACES_FULL
    # when every id is in use.  n <= NS_MAX_BYTES is checked by the caller.
    cdef uint32_t e = ns_find(t, h, s, n)
    if e != U32_MAX:
        out[0] = e
        return Q_OK
    if t.n_free == 0:
        return Q_NAMESPACES_FULL
    t.n_free -= 1
    e = t.free_ids[t.n_free]
    t.hashes[e] = h
    t.lens[e] = n
    t.refs[e] = 0
    t.n_rec[e] = 0
    t.rec_head[e] = U32_MAX
    t.rec_tail[e] = U32_MAX
    t.idle[e] = 0
    if n:
        memcpy(&t.names[<size_t>e * NS_MAX_BYTES], s, n)
    oa_insert(t.index, t.mask, _ns_home(t, h), <int32_t>e)
    t.count += 1
    out[0] = e
    return Q_OK


cdef inline void ns_touch(NsTable *t, uint32_t e) noexcept nogil:
    # after refs[e] or n_rec[e] changed: e is on the idle list (at the most recent end when it
    # joins) exactly while it has references and every one is a reclaimable page
    cdef bint idle = e != 0 and t.refs[e] != 0 and t.refs[e] == t.n_rec[e]
    if idle != t.idle[e]:
        _ns_move(t, e, idle)


cdef void _ns_move(NsTable *t, uint32_t e, bint idle) noexcept nogil:
    # ns_touch's change of list membership
    if idle and not t.idle[e]:
        t.idle[e] = 1
        t.idle_prev[e] = t.idle_tail
        t.idle_next[e] = U32_MAX
        if t.idle_tail != U32_MAX:
            t.idle_next[t.idle_tail] = e
        else:
            t.idle_head = e
        t.idle_tail = e
    elif not idle and t.idle[e]:
        t.idle[e] = 0
        if t.idle_prev[e] != U32_MAX:
            t.idle_next[t.idle_prev[e]] = t.idle_next[e]
        else:
            t.idle_head = t.idle_next[e]
        if t.idle_next[e] != U32_MAX:
            t.idle_prev[t.idle_next[e]] = t.idle_prev[e]
        else:
            t.idle_tail = t.idle_prev[e]


cdef void ns_free_if_unused(NsTable *t, uint32_t e) noexcept nogil:
    # (an id without references is never on the idle list: ns_touch took it off)
    if e == 0 or t.refs[e] != 0:
        return
    oa_remove(t.index, t.mask, _ns_home(t, t.hashes[e]), <int32_t>e, _ns_home_of, t)
    t.lens[e] = 0
    t.free_ids[t.n_free] = e
    t.n_free += 1
    t.count -= 1


cdef inline void ns_ref(NsTable *t, uint32_t e) noexcept nogil:
    t.refs[e] += 1
    ns_touch(t, e)


cdef inline void ns_unref(NsTable *t, uint32_t e) noexcept nogil:
    t.refs[e] -= 1
    ns_touch(t, e)
    ns_free_if_unused(t, e)


# -- events ---------------------------------------------------------------------------------------

cdef void pc_emit(PageCache *c, uint8_t kind, uint64_t ident, uint64_t parent, bint has_parent,
                  uint32_t ns, uint32_t tokens, uint32_t page) noexcept nogil:
    # The producer side of the ring (the core, with or without the GIL).  A full ring drops the
    # new event and counts it: the producer never waits for a consumer (the loop of run() must
    # not block on a router thread) and never overwrites a record a consumer may be copying.
    cdef EventRing *r = &c.ev
    cdef uint64_t t = r.tail                    # only the producer writes it
    cdef KvEvent *e
    if t - qualia_load_acquire(&r.head) >= r.capacity:
        r.dropped += 1
        return
    e = &r.buf[r.wpos]
    e.identity = ident
    e.parent = parent
    e.namespace_id = ns
    e.token_count = tokens
    e.page = page
    e.kind = kind
    e.has_parent = has_parent
    e._reserved = 0
    r.wpos = r.wpos + 1 if r.wpos + 1 < r.capacity else 0
    qualia_store_release(&r.tail, t + 1)        # the record is complete before it is seen


cdef inline uint32_t pc_pending(PageCache *c) noexcept nogil:
    # events written and not drained yet (at most capacity)
    return <uint32_t>(qualia_load_acquire(&c.ev.tail) - c.ev.head)


cdef uint32_t pc_drain(PageCache *c, KvEvent *out, uint32_t cap) noexcept nogil:
    # The consumer side (drain_events, with the GIL: one consumer at a time).  It may run while
    # the producer runs without the GIL: it copies only records below the tail it loaded, which
    # the producer does not touch until the head moves past them.
    cdef EventRing *r = &c.ev
    cdef uint64_t h = r.head                    # only the consumer writes it
    cdef uint64_t avail = qualia_load_acquire(&r.tail) - h
    cdef uint32_t n = <uint32_t>(avail if avail < cap else cap)
    cdef uint32_t i
    for i in range(n):
        out[i] = r.buf[(h + i) % r.capacity]
    if n:
        qualia_store_release(&r.head, h + n)    # the records are copied before they are reused
    return n


# -- lists ---------------------------------------------------------------------------------------

cdef inline uint32_t _pc_slot(PageCache *c, uint32_t i) noexcept nogil:
    # the ring slot i slots past the head (i < ring_cap; the sum in 64 bits: ring_cap may pass
    # 2**31)
    cdef uint64_t k = <uint64_t>c.ring_head + i
    return <uint32_t>(k - c.ring_cap if k >= c.ring_cap else k)


cdef inline bint _pc_live(PageCache *c, uint32_t k) noexcept nogil:
    # is the entry in ring slot k (one of the ring_len from the head) a page on the list?  (Its
    # page's record then has pos == k.)
    return c.alive[k]


cdef enum:
    # ring entries an append compacts: a compaction starts at 5/2 num_blocks entries, of which
    # each append reads 7 and adds 1 (reclaims only take entries away), so it ends after
    # about 5/12 num_blocks appends, before the ring (3 num_blocks slots) is full (the most it
    # can hold then is within two slots of that: a larger start or a smaller step needs this
    # bound checked again).  It leaves the entries that were live when it moved them, some
    # num_blocks or a few more (a page moved and then retaken leaves a dead one among them),
    # so entries are read at about 1.5 an append on average (1.6 measured in a model where
    # every hit retakes the oldest page) and never more than 7
    PC_COMPACT_STEP = 7
    PC_COMPACT_AHEAD = 8    # how many entries ahead the compaction prefetches the page's record


cdef void _pc_compact_some(PageCache *c, uint32_t m) noexcept nogil:
    # The compaction in progress reads up to m more entries: each live one moves back to the
    # first slot after the compacted ones (its old slot marked dead, its pos naming the new
    # one).  When every entry is read, the dead slots after the compacted ones leave the ring.
    cdef uint32_t k, w, page
    while m and c.cmp_r < c.ring_len:
        if c.cmp_r + PC_COMPACT_AHEAD < c.ring_len:
            k = _pc_slot(c, c.cmp_r + PC_COMPACT_AHEAD)
            if _pc_live(c, k) and c.cmp_w != c.cmp_r:
                qualia_prefetch_w(pc_rec(c, c.order[k]))    # the record whose pos moves
        k = _pc_slot(c, c.cmp_r)
        if _pc_live(c, k):
            if c.cmp_w != c.cmp_r:
                page = c.order[k]
                w = _pc_slot(c, c.cmp_w)
                c.alive[k] = 0
                c.order[w] = page
                c.alive[w] = 1
                pc_rec(c, page).pos = w
            c.cmp_w += 1
        c.cmp_r += 1
        m -= 1
    if c.cmp_r == c.ring_len:
        c.ring_len = c.cmp_w
        c.cmp_on = False
        c.cmp_w = c.cmp_r = 0


cdef inline void _pc_append(PageCache *c, uint32_t p) noexcept nogil:
    # page p to the tail (most recent end) of the reclaimable list, a step of the compaction
    # first (started here when the ring holds cmp_start entries)
    cdef uint32_t k
    if not c.cmp_on and c.ring_len >= c.cmp_start:
        c.cmp_on = True
    if c.cmp_on:
        _pc_compact_some(c, PC_COMPACT_STEP)
    if c.ring_len == c.ring_cap:
        # not reached (a compaction ends before the ring fills, see PC_COMPACT_STEP): were
        # it, the compaction would run to its end here, at once
        c.cmp_on = True
        _pc_compact_some(c, c.ring_len)
    k = _pc_slot(c, c.ring_len)
    c.order[k] = p
    c.alive[k] = 1
    pc_rec(c, p).pos = k
    c.ring_len += 1


cdef inline void _pc_pop_head(PageCache *c) noexcept nogil:
    # the head's entry leaves the ring (the compaction's offsets follow the head)
    c.alive[c.ring_head] = 0
    c.ring_head = _pc_slot(c, 1)
    c.ring_len -= 1
    if c.cmp_r:
        c.cmp_r -= 1
        if c.cmp_w:
            c.cmp_w -= 1


cdef inline uint32_t _pc_dead_run(const uint8_t *a, uint32_t n) noexcept nogil:
    # how many of the liveness bytes a[0..n) are zero before the first that is not (n if none),
    # read 32 bytes at a time once aligned: a long run of dead entries costs a few ns a line
    cdef uint32_t i = 0
    cdef uint64_t w[4]
    while i < n and (<uintptr_t>(a + i) & 31):
        if a[i]:
            return i
        i += 1
    while i + 32 <= n:
        memcpy(w, a + i, 32)
        if w[0] | w[1] | w[2] | w[3]:
            break
        i += 32
    while i < n and not a[i]:
        i += 1
    return i


cdef inline uint32_t pc_head(PageCache *c) noexcept nogil:
    # the head of the reclaimable list (U32_MAX: empty), the dead entries before it skipped
    # (they leave the ring: the list is unchanged); a head that has reached the dead slots of
    # the compaction in progress passes them all at once
    cdef uint32_t k, d, lim
    while c.ring_len:
        if c.cmp_w == 0 and c.cmp_r:
            c.ring_head = _pc_slot(c, c.cmp_r)
            c.ring_len -= c.cmp_r
            c.cmp_r = 0
            continue
        k = c.ring_head
        if _pc_live(c, k):
            return c.order[k]
        # the run of dead entries from the head leaves at once (their liveness bytes are zero
        # already), read no further than the ring's last slot in memory; the compaction's
        # offsets follow the head, none below zero (a run may pass every compacted entry, the
        # dead slots after them and unread entries too)
        lim = c.ring_len
        if c.ring_cap - k < lim:
            lim = c.ring_cap - k
        d = _pc_dead_run(&c.alive[k], lim)
        c.ring_head = _pc_slot(c, d)
        c.ring_len -= d
        if c.cmp_r:
            c.cmp_r -= d if d < c.cmp_r else c.cmp_r
            c.cmp_w -= d if d < c.cmp_w else c.cmp_w
    return U32_MAX


cdef inline void _pc_ns_append(PageCache *c, PcLinks *x, uint32_t p,
                               uint32_t ns) noexcept nogil:
    # reclaimable page p (x its links, ns its namespace) to the tail of the namespace's
    # reclaimable list
    cdef NsTable *t = &c.ns
    x.ns_prev = t.rec_tail[ns]
    x.ns_next = U32_MAX
    if t.rec_tail[ns] != U32_MAX:
        pc_rec(c, t.rec_tail[ns]).lk.ns_next = p
    else:
        t.rec_head[ns] = p
    t.rec_tail[ns] = p
    t.n_rec[ns] += 1


cdef inline void pc_link(PageCache *c, uint32_t p, uint8_t state) noexcept nogil:
    # a page in use is on no list (counted only: its links are all none, as pc_init and every
    # unlink leave them); a reclaimable page goes to the tail (most recent end) of the
    # reclaimable list and of its namespace's; the caller then calls ns_touch for the namespace
    cdef CachePage *x = pc_rec(c, p)
    if state == PC_INUSE:
        x.state = state
        c.n_state[state] += 1
        return
    _pc_ns_append(c, &x.lk, p, x.ns)
    x.state = state
    _pc_append(c, p)
    c.n_state[state] += 1


cdef inline void pc_unlink(PageCache *c, uint32_t p) noexcept nogil:
    # the caller then calls ns_touch for the namespace
    cdef CachePage *r = pc_rec(c, p)
    cdef PcLinks *x = &r.lk
    cdef uint8_t state = r.state
    cdef uint32_t ns
    cdef NsTable *t = &c.ns
    if state == PC_INUSE:
        c.n_state[state] -= 1      # on no list: no neighbour to touch
        return
    if state == PC_RECLAIMABLE:
        ns = r.ns
        if x.ns_prev != U32_MAX:
            pc_rec(c, x.ns_prev).lk.ns_next = x.ns_next
        else:
            t.rec_head[ns] = x.ns_next
        if x.ns_next != U32_MAX:
            pc_rec(c, x.ns_next).lk.ns_prev = x.ns_prev
        else:
            t.rec_tail[ns] = x.ns_prev
        x.ns_prev = U32_MAX
        x.ns_next = U32_MAX
        t.n_rec[ns] -= 1
        c.alive[r.pos] = 0         # its ring entry is dead
        r.pos = U32_MAX
    c.n_state[state] -= 1


cdef inline void pc_on_release(PageCache *c, Pool *p, uint32_t page) noexcept nogil:
    # after a request released `page`: a cached page only the cache holds becomes reclaimable
    if page < c.num_blocks and pc_rec(c, page).state == PC_INUSE and p.refcount[page] == 1:
        pc_unlink(c, page)
        pc_link(c, page, PC_RECLAIMABLE)
        ns_touch(&c.ns, pc_rec(c, page).ns)


# A run of releases (a finishing request's pages, last page first): pc_on_release for each, with
# the count of pages moved kept in the run until pc_run_end, and a namespace's idle check made
# once at the end of each run of its pages.  The lists, counts and
# idle list end as pc_on_release page by page leaves them: while the pages of one namespace
# are relinked only that namespace's n_rec changes, and it can turn idle only at the last of
# them (n_rec never passes refs), so one check after them finds what a check after each would.
cdef struct PcRun:
    uint32_t ns           # the namespace whose idle check is owed (U32_MAX: none)
    uint32_t moved        # pages relinked from in use to reclaimable


cdef inline void pc_run_begin(PageCache *c, PcRun *r) noexcept nogil:
    r.ns = U32_MAX
    r.moved = 0


cdef inline void pc_run_release(PageCache *c, Pool *p, uint32_t page, PcRun *r) noexcept nogil:
    # pc_on_release within a run
    cdef CachePage *x
    cdef uint32_t ns
    if page >= c.num_blocks or p.refcount[page] != 1:
        return
    x = pc_rec(c, page)
    if x.state != PC_INUSE:
        return
    ns = x.ns
    if ns != r.ns:
        if r.ns != U32_MAX:
            ns_touch(&c.ns, r.ns)
        r.ns = ns
    x.state = PC_RECLAIMABLE
    _pc_append(c, page)
    _pc_ns_append(c, &x.lk, page, ns)
    r.moved += 1


cdef inline void pc_run_end(PageCache *c, PcRun *r) noexcept nogil:
    c.n_state[PC_INUSE] -= r.moved
    c.n_state[PC_RECLAIMABLE] += r.moved
    if r.ns != U32_MAX:
        ns_touch(&c.ns, r.ns)


cdef inline void pc_on_retain(PageCache *c, Pool *p, uint32_t page) noexcept nogil:
    # after a request retained `page`: a reclaimable page is in use again (O(1))
    if pc_rec(c, page).state == PC_RECLAIMABLE and p.refcount[page] >= 2:
        pc_unlink(c, page)
        pc_link(c, page, PC_INUSE)
        ns_touch(&c.ns, pc_rec(c, page).ns)


# -- index, lookup, insert, drop -----------------------------------------------------------------

cdef inline uint32_t pc_tag(uint64_t ident) noexcept nogil:
    return <uint32_t>(ident ^ (ident >> 32))


cdef inline uint32_t _pc_home(PageCache *c, uint64_t ident) noexcept nogil:
    return pc_tag(ident) & c.index_mask


cdef inline uint32_t pc_find_slot(PageCache *c, uint64_t ident, uint32_t *slot) noexcept nogil:
    # the cached page of identity `ident` (a slot whose tag matches is confirmed by its record's
    # identity), or U32_MAX with *slot the empty slot that ended the probe: where inserting
    # `ident` goes while the index does not change
    cdef uint32_t tag = pc_tag(ident)
    cdef uint32_t mask = c.index_mask
    cdef uint32_t i = tag & mask
    cdef const PcSlot *ix = c.index
    cdef int32_t e
    while True:
        e = ix[i].page
        if e < 0:
            slot[0] = i
            return U32_MAX
        if ix[i].tag == tag and pc_rec(c, <uint32_t>e).ident == ident:
            return <uint32_t>e
        i = (i + 1) & mask


cdef inline uint32_t pc_find(PageCache *c, uint64_t ident) noexcept nogil:
    cdef uint32_t slot
    return pc_find_slot(c, ident, &slot)


cdef enum:
    PC_AHEAD = 16    # how many pages ahead a fill loop prefetches
    # what a reclaim prefetches (the drop's lines, then the index slot from the record)
    PC_DROP_AHEAD = 32
    PC_INDEX_AHEAD = 16


cdef inline void pc_prefetch_fill(PageCache *c, uint64_t ident, uint32_t page) noexcept nogil:
    # what looking `ident` up and inserting `page` will touch: the identity's home slot, the
    # page's record and the first line of its token copy (a hint only: no state changes)
    qualia_prefetch_r(&c.index[_pc_home(c, ident)])
    if page < c.num_blocks:
        qualia_prefetch_w(pc_rec(c, page))
        qualia_prefetch_w(<char *>pc_rec(c, page) + 64)


cdef inline void pc_prefetch_page(PageCache *c, Pool *p, uint32_t page) noexcept nogil:
    # what a request's release of `page`, or a reclaim's drop of it, writes first: its pool
    # count and its record (which holds its namespace links and ring slot; a hint only: no
    # state changes)
    if page < c.num_blocks and page < p.num_blocks:
        qualia_prefetch_w(&p.refcount[page])
        qualia_prefetch_w(pc_rec(c, page))


cdef void pc_index_remove(PageCache *c, uint32_t page, uint64_t ident) noexcept nogil:
    # linear-probing deletion without tombstones (as oa_remove), the homes of the entries that
    # follow read from their slots' tags instead of from their records
    cdef uint32_t mask = c.index_mask
    cdef uint32_t i = _pc_home(c, ident)
    cdef uint32_t j, k, src
    cdef bint move
    while c.index[i].page != <int32_t>page:
        i = (i + 1) & mask
    j = i
    while True:
        j = (j + 1) & mask
        if c.index[j].page < 0:
            break
        k = c.index[j].tag & mask
        # slot j moves back to the hole i unless its home k lies cyclically in (i, j]; the
        # move is made branch-free (slot i is rewritten with itself when nothing moves), as
        # whether an entry moves follows no pattern a branch predictor learns
        move = ((k - i - 1) & mask) >= ((j - i) & mask)
        src = i ^ ((i ^ j) & (<uint32_t>0 - <uint32_t>move))
        c.index[i] = c.index[src]
        i = src
    c.index[i].page = -1


cdef inline bint pc_matches(PageCache *c, uint32_t q, uint32_t ns, bint has_parent,
                            uint32_t parent, uint64_t parent_gen,
                            const uint32_t *t) noexcept nogil:
    # verification: same namespace, same parent entry (page and generation), same tokens
    cdef CachePage *x = pc_rec(c, q)
    if x.ns != ns or x.has_parent != has_parent:
        return False
    if has_parent and (x.parent != parent or x.parent_gen != parent_gen):
        return False
    return pc_same_tokens(pc_tok(c, q), t, c.page_tokens)


cdef inline bint pc_live(PageCache *c, uint32_t page, uint64_t gen) noexcept nogil:
    # is the entry (page, gen) still in the cache?
    return page < c.num_blocks and pc_rec(c, page).state != PC_NONE and pc_rec(c, page).gen == gen


cdef inline int pc_insert(PageCache *c, Pool *p, uint32_t page, CachePage *x, uint64_t ident,
                          uint32_t slot, uint64_t parent_ident, uint32_t parent,
                          uint64_t parent_gen, uint32_t ns, const uint32_t *t) noexcept nogil:
    # Cache `page` (x its record, not cached; a page some request holds) under `ident` at index
    # slot `slot` (pc_find_slot's, the index unchanged since), and take one pool reference on
    # it.  The parent fields are the record's as given (a first page's: 0, U32_MAX, 0).  The
    # page is in use: the request holds it too (its count is at least 2 after the retain).
    cdef int rc = pool_retain(p, page)
    cdef uint64_t gen
    if rc:
        return rc
    gen = c.gen + 1
    c.gen = gen
    x.ident = ident
    x.parent_ident = parent_ident
    x.gen = gen
    x.parent_gen = parent_gen
    x.parent = parent
    x.ns = ns
    x.has_parent = parent != U32_MAX
    pc_copy_tokens(pc_tok(c, page), t, c.page_tokens)
    c.index[slot].page = <int32_t>page
    c.index[slot].tag = pc_tag(ident)
    pc_link(c, page, PC_INUSE)
    # ns_ref without ns_touch: the request filling the page holds a reference to `ns` (taken
    # when its stream went live) besides its reclaimable pages', so `ns` is idle neither
    # before this nor after
    c.ns.refs[ns] += 1
    c.stored += 1
    pc_emit(c, KV_STORED, ident, parent_ident, parent != U32_MAX, ns, c.page_tokens, page)
    return Q_OK


cdef int pc_drop(PageCache *c, Pool *p, uint32_t page, bint emit) noexcept nogil:
    # Drop the entry of cached `page` and release the cache's reference (the page leaves its
    # lists and its namespace reference together: a drop never moves an idle namespace).
    cdef CachePage *x = pc_rec(c, page)
    pc_index_remove(c, page, x.ident)
    pc_unlink(c, page)
    x.state = PC_NONE
    ns_unref(&c.ns, x.ns)
    if emit:
        pc_emit(c, KV_REMOVED, x.ident, x.parent_ident, x.has_parent, x.ns, c.page_tokens, page)
    return pool_release(p, page)


cdef inline int _pc_drop_head(PageCache *c, Pool *p, uint32_t page) noexcept nogil:
    # pc_drop(c, p, page, True) for the head of the reclaimable list (pc_head), which is also
    # the head of its namespace's list (that list holds the namespace's reclaimable pages in
    # the global order): its ring entry leaves at the head and the namespace's head moves to
    # the page's successor, with none of pc_unlink's tests for a predecessor.  A page that is
    # not at both heads takes pc_drop.
    cdef CachePage *x = pc_rec(c, page)
    cdef PcLinks *lk = &x.lk
    cdef NsTable *t = &c.ns
    cdef uint32_t ns = x.ns, ns_nxt = lk.ns_next, k = c.ring_head
    if (not c.ring_len or c.order[k] != page or x.pos != k or lk.ns_prev != U32_MAX
            or x.state != PC_RECLAIMABLE):
        return pc_drop(c, p, page, True)
    pc_index_remove(c, page, x.ident)
    # the entry leaves the ring at its head (its pos is left: no slot outside the ring's
    # ring_len is read, and the next append of the page sets it)
    _pc_pop_head(c)
    t.rec_head[ns] = ns_nxt
    if ns_nxt != U32_MAX:
        pc_rec(c, ns_nxt).lk.ns_prev = U32_MAX
    else:
        t.rec_tail[ns] = U32_MAX
    lk.ns_next = U32_MAX
    t.n_rec[ns] -= 1
    c.n_state[PC_RECLAIMABLE] -= 1
    x.state = PC_NONE
    ns_unref(t, ns)
    pc_emit(c, KV_REMOVED, x.ident, x.parent_ident, x.has_parent, ns, c.page_tokens, page)
    return pool_release(p, page)


cdef inline void _pc_prefetch_index(PageCache *c, uint32_t page) noexcept nogil:
    # the index slot dropping `page` empties (its record prefetched before; a hint only)
    if page < c.num_blocks:
        qualia_prefetch_w(&c.index[_pc_home(c, pc_rec(c, page).ident)])


cdef int pc_make_room(PageCache *c, Pool *p, uint64_t need) noexcept nogil:
    # Make `need` pages allocatable: reclaim the least recently used reclaimable pages for what
    # the free stack lacks.  Q_EXHAUSTED, reclaiming nothing, when even that is not enough.
    # The pages to drop are read from the ring ahead of the head, no further than the last
    # page to reclaim (less the dead entries among them): PC_DROP_AHEAD slots ahead, what the drop
    # of a page reads and writes is prefetched (its record, with its namespace links and ring
    # slot, and its pool count; the liveness bytes are read in order); PC_INDEX_AHEAD slots
    # ahead, the identity is read from the record and its index slot prefetched.  So a drop
    # finds what it touches in cache (hints only: the drops decide what is reclaimed).
    cdef uint32_t page, i, left
    cdef int rc
    if need <= p.free_top:
        return Q_OK
    if need > <uint64_t>p.free_top + c.n_state[PC_RECLAIMABLE]:
        return Q_EXHAUSTED
    left = <uint32_t>(need - p.free_top)        # pages still to reclaim
    for i in range(left if left < PC_DROP_AHEAD else PC_DROP_AHEAD):
        if i < c.ring_len:
            pc_prefetch_page(c, p, c.order[_pc_slot(c, i)])
    for i in range(left if left < PC_INDEX_AHEAD else PC_INDEX_AHEAD):
        if i < c.ring_len:
            _pc_prefetch_index(c, c.order[_pc_slot(c, i)])
    while p.free_top < need:
        page = pc_head(c)
        if page == U32_MAX:
            return Q_EXHAUSTED   # only if the pool was changed behind the cache's back
        left = <uint32_t>(need - p.free_top)
        if PC_DROP_AHEAD < left and PC_DROP_AHEAD < c.ring_len:
            pc_prefetch_page(c, p, c.order[_pc_slot(c, PC_DROP_AHEAD)])
        if PC_INDEX_AHEAD < left and PC_INDEX_AHEAD < c.ring_len:
            _pc_prefetch_index(c, c.order[_pc_slot(c, PC_INDEX_AHEAD)])
        rc = _pc_drop_head(c, p, page)
        if rc:
            return rc    # the page's entry is gone, but its count was not the cache's
        c.reclaims += 1
    return Q_OK


cdef int pc_intern_ns(PageCache *c, Pool *p, uint64_t h, const uint8_t *s, uint32_t n,
                      uint32_t *out) noexcept nogil:
    # The id of the namespace, interning it (with no reference) when new.  When it is new and
    # every id is in use, the least recently used idle namespace gives its id up: its pages are
    # reclaimed, least recently used first (each counted in `reclaims` with its `removed`
    # event), and the last one frees the id.  Q_NAMESPACES_FULL, changing nothing, when no
    # namespace is idle.  n <= NS_MAX_BYTES is checked by the caller.
    cdef uint32_t e = ns_find(&c.ns, h, s, n)
    cdef int rc
    if e != U32_MAX:
        out[0] = e
        return Q_OK
    if c.ns.n_free == 0:
        e = c.ns.idle_head
        if e == U32_MAX:
            return Q_NAMESPACES_FULL
        while c.ns.rec_head[e] != U32_MAX:
            rc = pc_drop(c, p, c.ns.rec_head[e], True)
            if rc:
                return rc
            c.reclaims += 1
    return ns_intern(&c.ns, h, s, n, out)


cdef uint32_t pc_clear(PageCache *c, Pool *p) noexcept nogil:
    # Drop every entry: the reclaimable pages least recent first, then the pages in use in page
    # order (they are on no list: the one walk over the records); pages that requests hold stay
    # with them.  One "cleared" event; returns the number of entries dropped.
    cdef uint32_t n = 0, page
    page = pc_head(c)
    while page != U32_MAX:
        pc_drop(c, p, page, False)
        n += 1
        page = pc_head(c)
    page = 0
    while page < c.num_blocks and c.n_state[PC_INUSE]:
        if pc_rec(c, page).state == PC_INUSE:
            pc_drop(c, p, page, False)
            n += 1
        page += 1
    pc_emit(c, KV_CLEARED, 0, 0, False, 0, 0, U32_MAX)
    return n


# -- construction ---------------------------------------------------------------------------------

cdef int pc_init(PageCache *c, uint32_t num_blocks, uint32_t page_tokens, uint32_t max_ns,
                 uint32_t event_capacity, const uint8_t *key) except -1:
    cdef uint32_t i, size = 2, nsize = 2
    cdef uint64_t lo = 0, hi = 0
    if num_blocks > ((<uint32_t>1) << 30):
        raise OverflowError("automatic prefix caching supports at most 2**30 pages")
    while <uint64_t>size < 4 * <uint64_t>num_blocks:   # load at most 1/4
        size <<= 1
    while nsize < 2 * <uint64_t>max_ns:
        nsize <<= 1
    memset(c, 0, sizeof(PageCache))
    c.num_blocks = num_blocks
    c.page_tokens = page_tokens
    # one record per page: the CachePage, then its tokens, rounded up to whole cache lines so
    # that a lookup touches one record, not a record and a token array
    c.stride = (sizeof(CachePage) + <size_t>page_tokens * sizeof(uint32_t) + 63) & ~(<size_t>63)
    c.recs = <char *>qualia_big_zalloc((num_blocks if num_blocks else 1) * c.stride)
    c.ring_cap = 3 * num_blocks if num_blocks else 2
    c.cmp_start = 2 * num_blocks + num_blocks // 2
    c.order = <uint32_t *>qualia_big_zalloc(<size_t>c.ring_cap * sizeof(uint32_t))
    c.alive = <uint8_t *>qualia_big_zalloc(c.ring_cap)
    c.index = <PcSlot *>qualia_big_zalloc(size * sizeof(PcSlot))
    c.nh = <uint64_t *>PyMem_Calloc(pc_nh_words(page_tokens), sizeof(uint64_t))
    c.ns.names = <uint8_t *>PyMem_Malloc(<size_t>max_ns * NS_MAX_BYTES)
    c.ns.lens = <uint32_t *>PyMem_Calloc(max_ns, sizeof(uint32_t))
    c.ns.hashes = <uint64_t *>PyMem_Calloc(max_ns, sizeof(uint64_t))
    c.ns.refs = <uint32_t *>PyMem_Calloc(max_ns, sizeof(uint32_t))
    c.ns.n_rec = <uint32_t *>PyMem_Calloc(max_ns, sizeof(uint32_t))
    c.ns.rec_head = <uint32_t *>PyMem_Malloc(max_ns * sizeof(uint32_t))
    c.ns.rec_tail = <uint32_t *>PyMem_Malloc(max_ns * sizeof(uint32_t))
    c.ns.idle_prev = <uint32_t *>PyMem_Malloc(max_ns * sizeof(uint32_t))
    c.ns.idle_next = <uint32_t *>PyMem_Malloc(max_ns * sizeof(uint32_t))
    c.ns.idle = <uint8_t *>PyMem_Calloc(max_ns, sizeof(uint8_t))
    c.ns.index = <int32_t *>PyMem_Malloc(nsize * sizeof(int32_t))
    c.ns.free_ids = <uint32_t *>PyMem_Malloc(max_ns * sizeof(uint32_t))
    c.ev.buf = <KvEvent *>PyMem_Calloc(event_capacity if event_capacity else 1, sizeof(KvEvent))
    if (c.recs == NULL or c.order == NULL or c.alive == NULL or c.index == NULL or c.nh == NULL
            or c.ns.names == NULL or c.ns.lens == NULL or c.ns.hashes == NULL
            or c.ns.refs == NULL or c.ns.index == NULL or c.ns.free_ids == NULL
            or c.ns.n_rec == NULL or c.ns.rec_head == NULL or c.ns.rec_tail == NULL
            or c.ns.idle_prev == NULL or c.ns.idle_next == NULL or c.ns.idle == NULL
            or c.ev.buf == NULL):
        raise MemoryError(f"cannot allocate a page cache of {num_blocks} x {page_tokens} tokens")
    for i in range(size):
        c.index[i].page = -1
    c.index_mask = size - 1
    for i in range(num_blocks):
        pc_rec(c, i).pos = U32_MAX
        pc_rec(c, i).lk.ns_prev = U32_MAX
        pc_rec(c, i).lk.ns_next = U32_MAX
    c.ident_mask = U64_MAX
    c.parent_mask = U64_MAX
    for i in range(8):
        lo |= (<uint64_t>key[i]) << (8 * i)
        hi |= (<uint64_t>key[8 + i]) << (8 * i)
    pc_set_key(c, lo, hi)
    for i in range(nsize):
        c.ns.index[i] = -1
    c.ns.mask = nsize - 1
    c.ns.capacity = max_ns
    for i in range(max_ns):
        c.ns.rec_head[i] = U32_MAX
        c.ns.rec_tail[i] = U32_MAX
        c.ns.idle_prev[i] = U32_MAX
        c.ns.idle_next[i] = U32_MAX
    c.ns.idle_head = U32_MAX
    c.ns.idle_tail = U32_MAX
    for i in range(max_ns - 1):       # ids 1.. on the stack, lowest on top
        c.ns.free_ids[i] = max_ns - 1 - i
    c.ns.n_free = max_ns - 1
    c.ns.hashes[0] = pc_ns_hash(c, NULL, 0)   # id 0: the empty namespace, never freed
    oa_insert(c.ns.index, c.ns.mask, _ns_home(&c.ns, c.ns.hashes[0]), 0)
    c.ns.count = 1
    c.ev.capacity = event_capacity
    return 0


cdef void pc_free(PageCache *c) noexcept:
    qualia_big_free(c.recs)
    qualia_big_free(c.order)
    qualia_big_free(c.alive)
    qualia_big_free(c.index)
    PyMem_Free(c.nh)
    PyMem_Free(c.ns.names)
    PyMem_Free(c.ns.lens)
    PyMem_Free(c.ns.hashes)
    PyMem_Free(c.ns.refs)
    PyMem_Free(c.ns.n_rec)
    PyMem_Free(c.ns.rec_head)
    PyMem_Free(c.ns.rec_tail)
    PyMem_Free(c.ns.idle_prev)
    PyMem_Free(c.ns.idle_next)
    PyMem_Free(c.ns.idle)
    PyMem_Free(c.ns.index)
    PyMem_Free(c.ns.free_ids)
    PyMem_Free(c.ev.buf)
    memset(c, 0, sizeof(PageCache))


# -- the KV_EVENT dtype ---------------------------------------------------------------------------

cdef KvEvent _kev


def _kv_event_dtype():
    cdef char *b = <char *>&_kev
    fields = [("identity", "<u8", <char *>&_kev.identity - b),
              ("parent", "<u8", <char *>&_kev.parent - b),
              ("namespace_id", "<u4", <char *>&_kev.namespace_id - b),
              ("token_count", "<u4", <char *>&_kev.token_count - b),
              ("page", "<u4", <char *>&_kev.page - b),
              ("kind", "u1", <char *>&_kev.kind - b),
              ("has_parent", "u1", <char *>&_kev.has_parent - b)]
    return _dtype((sizeof(KvEvent), 8, fields))


KV_EVENT = _kv_event_dtype()
KV_STORED_KIND = KV_STORED
KV_REMOVED_KIND = KV_REMOVED
KV_CLEARED_KIND = KV_CLEARED
cdef object _DT_KV_EVENT = KV_EVENT
