# Declarations of the compiled core, so Cython code can cimport the classes and C structs.
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int32_t
from qualia._abi cimport (qualia_batch_item, qualia_batch_output, qualia_batch_receipt,
                          qualia_request_view, qualia_copy_op, qualia_backend,
                          qualia_hash_backend)

# Status codes of the nogil core.  0 is success; the names match the error variants, and the
# def wrappers turn each code into the exception class of the layer that called.
cdef enum:
    Q_OK = 0
    Q_EXHAUSTED = 1
    Q_INVALID_PAGE = 2
    Q_NOT_ALLOCATED = 3
    Q_OVERFLOW = 4
    Q_OUT_OF_RANGE = 5
    Q_GAP = 6
    Q_NOT_EMPTY = 7
    Q_EMPTY_PREFIX = 8
    Q_TOO_MANY_PAGES = 9
    Q_DUPLICATE = 10
    Q_STORE_FULL = 11
    Q_UNKNOWN = 12
    Q_DUPLICATE_REQUEST = 13
    Q_FULL = 14
    Q_UNKNOWN_REQUEST = 15
    Q_OUTPUT_TOO_SMALL = 16

cdef enum:
    COW_EXCLUSIVE = 0
    COW_ALLOCATED = 1
    COW_COPY = 2

cdef struct Pool:
    uint32_t num_blocks
    uint32_t free_top
    uint32_t *refcount
    uint32_t *free_stack

cdef struct Table:
    uint32_t *entries
    uint32_t len
    uint32_t capacity

cdef struct Cow:
    int kind
    uint32_t page
    uint32_t src

cdef struct StoreEntry:
    uint64_t hi
    uint64_t lo
    uint32_t tokens
    uint32_t npages
    int32_t prev
    int32_t next
    uint32_t used

cdef struct Store:
    StoreEntry *entries
    uint32_t *pages
    int32_t *index
    uint32_t index_mask
    uint32_t capacity
    uint32_t max_pages
    uint32_t count
    int32_t lru_head
    int32_t lru_tail
    int32_t free_head
    uint64_t hits
    uint64_t misses

cdef struct Slot:
    uint64_t request_id
    uint32_t token_count
    uint32_t prefix_tokens
    uint32_t next_token_id
    uint8_t state
    uint8_t token_ready
    Table blocks

cdef struct Sched:
    Slot *slots
    uint32_t *table_storage
    int32_t *index
    uint32_t index_mask
    uint64_t *free_bits
    uint64_t *decode_bits
    uint32_t n_decode
    uint32_t n_words
    uint32_t max_requests
    uint32_t logical_pages
    uint32_t active
    uint32_t *lowered

cdef struct Undo:
    uint32_t slot
    uint32_t logical_page
    int kind
    uint32_t src
    uint32_t dst

cdef int pool_allocate(Pool *p, uint32_t *out) noexcept nogil
cdef int pool_retain(Pool *p, uint32_t page) noexcept nogil
cdef int pool_release(Pool *p, uint32_t page) noexcept nogil
cdef int table_ensure_writable(Table *t, uint32_t logical_page, Pool *p, Cow *out) noexcept nogil
cdef int table_attach(Table *t, const uint32_t *pages, uint32_t n, Pool *p) noexcept nogil
cdef int table_release_all(Table *t, Pool *p) noexcept nogil

cdef class BlockPool:
    cdef Pool pool
    cdef int busy

cdef class SequenceBlockTable:
    cdef Table table

cdef class PrefixIdentity:
    cdef uint64_t hi
    cdef uint64_t lo

cdef class PrefixKvStore:
    cdef Store store
    cdef int busy
    cdef int32_t _entry(self, PrefixIdentity identity) except -2

cdef class RequestScheduler:
    cdef Sched s
    cdef int busy
    cdef list _receipts
    cdef int32_t _find(self, object request_id) except -2
    cdef int32_t _find_idle(self, object request_id) except -2
    cdef Py_ssize_t _runnable_into(self, qualia_request_view *out, Py_ssize_t cap) except -1
    cdef object _round(self, object backend,
                       qualia_batch_item *items, Py_ssize_t items_cap, object items_obj,
                       uint32_t *table, Py_ssize_t table_cap, object table_obj,
                       qualia_batch_output *outs, Py_ssize_t outs_cap, object outs_obj)

cdef class HashBackend:
    cdef qualia_hash_backend *st
    cdef qualia_backend *iface
    cdef object _capsule

cdef class Scheduler:
    cdef readonly BlockPool pool
    cdef readonly PrefixKvStore prefixes
    cdef readonly RequestScheduler requests
    cdef readonly uint32_t page_tokens
    cdef object _items
    cdef object _outputs
    cdef object _table
    cdef object _copies
    cdef object _items_ro
    cdef object _table_ro
    cdef object _copies_ro
    cdef object _tokens
    cdef qualia_batch_item *items_p
    cdef qualia_batch_output *outs_p
    cdef uint32_t *table_p
    cdef qualia_copy_op *copies_p
    cdef uint32_t *tokens_p
    cdef Py_ssize_t items_cap
    cdef Py_ssize_t table_cap
    cdef Py_ssize_t tokens_cap
    cdef Undo *undo
    cdef Py_ssize_t undo_cap
    cdef uint64_t pages_copied
    cdef uint64_t pages_allocated
    cdef uint64_t rounds
    cdef list _results
    cdef int _check_idle(self) except -1
    cdef void _set_busy(self, int v) noexcept
    cdef Py_ssize_t _load_tokens(self, object prompt_tokens) except -1
    cdef Py_ssize_t _prefix_len(self, object prefix_len, Py_ssize_t n) except -1
    cdef int _make_writable(self, int32_t index, uint32_t first, uint32_t last,
                            Py_ssize_t *n_undo, Py_ssize_t *n_copies) except -1
