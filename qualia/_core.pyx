# The compiled core of qualia: block pool, block tables with copy-on-write, prefix identity and
# prefix KV store, the seed's request scheduler, the built-in C reference backend and the
# admit/decode/finish facade.
#
# Layout of this file: every operation has a `noexcept nogil` C function returning a status code
# (Q_OK or the variant), and a thin `def` wrapper that checks Python arguments and turns the code
# into the exception class of the caller's layer.  All memory is allocated in __cinit__; the
# operations themselves never allocate.

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_STRIDES, PyBUF_FORMAT
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_Occurred, PyErr_Clear
from cpython.long cimport PyLong_CheckExact
from cpython.mem cimport PyMem_Malloc, PyMem_Calloc, PyMem_Free
from cpython.pycapsule cimport (PyCapsule_New, PyCapsule_CheckExact, PyCapsule_GetName,
                                PyCapsule_GetPointer)
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int32_t, int64_t, uintptr_t
from libc.string cimport memcpy, memset, strcmp

from qualia._abi cimport *

import operator
from collections.abc import Sequence as _AbcSequence

import numpy as np

cimport numpy as cnp

cnp.import_array()

from qualia._types import Admission, CopyOnWrite, RaggedBatchReceipt, RequestState
from qualia.errors import (BackendAbiError, BusyError, DecodeRoundError, PoolError,
                           PrefixKvError, QualiaError, RaggedBackendError, SchedulerError,
                           TableError)

cdef extern from "Python.h":
    unsigned long long _as_ull "PyLong_AsUnsignedLongLong"(object o)
    Py_ssize_t Py_SIZE(object o)

cdef extern from "qualia_internal.h" nogil:
    void qualia_prefix_digest(const uint8_t *ns, uint32_t ns_len, const uint32_t *tokens,
                              size_t n, uint8_t *out)

cdef extern from *:
    """
    #include "qualia.h"
    #define QUALIA_ALIGN_ITEM _Alignof(qualia_batch_item)
    #define QUALIA_ALIGN_OUTPUT _Alignof(qualia_batch_output)
    #define QUALIA_ALIGN_RECEIPT _Alignof(qualia_batch_receipt)
    #define QUALIA_ALIGN_VIEW _Alignof(qualia_request_view)
    #define QUALIA_ALIGN_COPY _Alignof(qualia_copy_op)
    #define QUALIA_ALIGN_BACKEND _Alignof(qualia_backend)
    """
    size_t QUALIA_ALIGN_ITEM
    size_t QUALIA_ALIGN_OUTPUT
    size_t QUALIA_ALIGN_RECEIPT
    size_t QUALIA_ALIGN_VIEW
    size_t QUALIA_ALIGN_COPY
    size_t QUALIA_ALIGN_BACKEND
    int __builtin_ctzll(unsigned long long) nogil

cdef extern from "<stdint.h>":
    const uint32_t U32_MAX "UINT32_MAX"
    const uint64_t U64_MAX "UINT64_MAX"

# ---------------------------------------------------------------------------------------------
# The ABI: numpy dtypes derived from the compiled structs.

cdef qualia_batch_item _item
cdef qualia_batch_output _out
cdef qualia_batch_receipt _rec
cdef qualia_request_view _view
cdef qualia_copy_op _cop


def _layout():
    """Sizes, alignments and field offsets of the compiled C structs (from sizeof/offsetof)."""
    cdef char *b
    layout = {}
    b = <char *>&_item
    layout["item"] = (sizeof(qualia_batch_item), QUALIA_ALIGN_ITEM, [
        ("request_id", "<u8", <char *>&_item.request_id - b),
        ("slot", "<u4", <char *>&_item.slot - b),
        ("token_id", "<u4", <char *>&_item.token_id - b),
        ("position", "<u4", <char *>&_item.position - b),
        ("block_table_offset", "<u4", <char *>&_item.block_table_offset - b),
        ("logical_pages", "<u4", <char *>&_item.logical_pages - b),
        ("_reserved", "<u4", <char *>&_item._reserved - b)])
    b = <char *>&_out
    layout["output"] = (sizeof(qualia_batch_output), QUALIA_ALIGN_OUTPUT, [
        ("request_id", "<u8", <char *>&_out.request_id - b),
        ("slot", "<u4", <char *>&_out.slot - b),
        ("next_token_id", "<u4", <char *>&_out.next_token_id - b)])
    b = <char *>&_rec
    layout["receipt"] = (sizeof(qualia_batch_receipt), QUALIA_ALIGN_RECEIPT, [
        ("batch_size", "<u4", <char *>&_rec.batch_size - b),
        ("backend_launches", "<u4", <char *>&_rec.backend_launches - b)])
    b = <char *>&_view
    layout["request_view"] = (sizeof(qualia_request_view), QUALIA_ALIGN_VIEW, [
        ("request_id", "<u8", <char *>&_view.request_id - b),
        ("slot", "<u2", <char *>&_view.slot - b),
        ("state", "u1", <char *>&_view.state - b),
        ("token_count", "<u4", <char *>&_view.token_count - b),
        ("prefix_tokens", "<u4", <char *>&_view.prefix_tokens - b)])
    b = <char *>&_cop
    layout["copy_op"] = (sizeof(qualia_copy_op), QUALIA_ALIGN_COPY, [
        ("src_page", "<u4", <char *>&_cop.src_page - b),
        ("dst_page", "<u4", <char *>&_cop.dst_page - b)])
    layout["backend"] = (sizeof(qualia_backend), QUALIA_ALIGN_BACKEND, [])
    return layout


def _dtype(entry):
    size, align, fields = entry
    return np.dtype({"names": [f[0] for f in fields], "formats": [f[1] for f in fields],
                     "offsets": [f[2] for f in fields], "itemsize": size}, align=True)


_LAYOUT = _layout()
RAGGED_BATCH_ITEM = _dtype(_LAYOUT["item"])
RAGGED_BATCH_OUTPUT = _dtype(_LAYOUT["output"])
RAGGED_BATCH_RECEIPT = _dtype(_LAYOUT["receipt"])
REQUEST_VIEW = _dtype(_LAYOUT["request_view"])
COPY_OP = _dtype(_LAYOUT["copy_op"])
BACKEND_CAPSULE_NAME = (<bytes>QUALIA_BACKEND_CAPSULE_NAME).decode()
BACKEND_ABI_VERSION = QUALIA_BACKEND_ABI_VERSION
BACKEND_STRUCT_SIZE = sizeof(qualia_backend)


def _normalize_format(fmt):
    # Buffer exporters spell the same little-endian layout in several ways ('@', '=', '<',
    # 'Q' or 'L' for u64 on LP64): compare the canonical form.
    out = fmt.replace("@", "").replace("=", "").replace("<", "")
    if sizeof(long) == 8:
        out = out.replace("Q", "L").replace("q", "l")
    return out


cdef dict _FORMATS = {}
for _name, _dt in (("item", RAGGED_BATCH_ITEM), ("output", RAGGED_BATCH_OUTPUT),
                   ("request_view", REQUEST_VIEW), ("copy_op", COPY_OP),
                   ("u32", np.dtype(np.uint32))):
    _FORMATS[_name] = (memoryview(np.zeros(1, _dt)).format,
                       _normalize_format(memoryview(np.zeros(1, _dt)).format),
                       memoryview(np.zeros(1, _dt)).format.encode("ascii"))
del _name, _dt

cdef object _DT_ITEM = RAGGED_BATCH_ITEM
cdef object _DT_OUTPUT = RAGGED_BATCH_OUTPUT
cdef object _DT_VIEW = REQUEST_VIEW
cdef object _DT_COPY = COPY_OP
cdef object _DT_U32 = np.dtype(np.uint32)


cdef inline bint _fast_array(object obj, object dtype, size_t align, bint writable,
                             void **ptr, Py_ssize_t *n) noexcept:
    # A plain 1-D C-contiguous ndarray of exactly our dtype object: read its data pointer
    # directly.  numpy builds a format string on every buffer export of a structured dtype,
    # which would cost a microsecond and several allocations per decode round.  Anything else
    # takes the checked buffer-protocol path.
    if not cnp.PyArray_CheckExact(obj):
        return False
    cdef cnp.ndarray a = <cnp.ndarray>obj
    if <void *>cnp.PyArray_DESCR(a) != <void *>dtype or cnp.PyArray_NDIM(a) != 1:
        return False
    cdef int flags = cnp.PyArray_FLAGS(a)
    if not (flags & cnp.NPY_ARRAY_C_CONTIGUOUS):
        return False
    if writable and not (flags & cnp.NPY_ARRAY_WRITEABLE):
        return False
    if (<uintptr_t>cnp.PyArray_DATA(a)) % align != 0:
        return False
    ptr[0] = cnp.PyArray_DATA(a)
    n[0] = cnp.PyArray_DIMS(a)[0]
    return True

# ---------------------------------------------------------------------------------------------
# Argument checking: ints only (bools rejected), range checked, clear messages.

cdef uint64_t _int_slow(object v, str what, uint64_t maxval) except? 0xFFFFFFFFFFFFFFFF:
    if isinstance(v, bool) or isinstance(v, np.bool_):
        raise TypeError(f"{what} must be an integer, not bool")
    try:
        iv = operator.index(v)
    except TypeError:
        raise TypeError(f"{what} must be an integer, not {type(v).__name__}") from None
    if iv < 0 or iv > maxval:
        raise OverflowError(f"{what} must be in [0, {maxval}], got {iv}")
    return <uint64_t>iv


cdef inline uint64_t _int(object v, str what, uint64_t maxval) except? 0xFFFFFFFFFFFFFFFF:
    cdef unsigned long long x
    if PyLong_CheckExact(v):
        x = _as_ull(v)
        if x == <unsigned long long>U64_MAX and PyErr_Occurred() != NULL:
            PyErr_Clear()
        elif x <= maxval:
            return x
    return _int_slow(v, what, maxval)


cdef inline uint32_t _u32(object v, str what) except? 0xFFFFFFFF:
    return <uint32_t>_int(v, what, U32_MAX)


cdef inline uint64_t _u64(object v, str what) except? 0xFFFFFFFFFFFFFFFF:
    return _int(v, what, U64_MAX)


cdef class _Buffer:
    """A held Py_buffer of one of the ABI dtypes, checked once for dtype, shape and alignment."""
    cdef Py_buffer view
    cdef bint held
    cdef Py_ssize_t length
    cdef void *ptr

    def __dealloc__(self):
        if self.held:
            PyBuffer_Release(&self.view)
            self.held = False


cdef int _get_buffer(object obj, Py_buffer *view, str what, str kind, Py_ssize_t itemsize,
                     size_t align, bint writable) except -1:
    # Acquire and check `obj` as a 1-D C-contiguous aligned buffer of one ABI dtype.  On success
    # the caller owns `view` (PyBuffer_Release); on failure nothing is held.  The success path
    # creates no Python object, so a steady-state decode round allocates nothing.
    cdef tuple spec = <tuple>_FORMATS[kind]
    try:
        PyObject_GetBuffer(obj, view, PyBUF_STRIDES | PyBUF_FORMAT)
    except (TypeError, BufferError, ValueError) as exc:
        raise TypeError(f"{what} must be a 1-D numpy array of dtype {_dtype_name(kind)}, "
                        f"got {type(obj).__name__}") from exc
    try:
        if (view.format == NULL or strcmp(view.format, <const char *><bytes>spec[2]) != 0
                or view.itemsize != itemsize):
            got = (<bytes>view.format).decode("ascii", "replace") if view.format != NULL else "B"
            if _normalize_format(got) != spec[1] or view.itemsize != itemsize:
                raise TypeError(f"{what} must have dtype {_dtype_name(kind)} (buffer format "
                                f"{spec[0]!r}), got format {got!r} with itemsize {view.itemsize}")
        if view.ndim != 1:
            raise ValueError(f"{what} must be 1-D, got {view.ndim} dimensions")
        if view.shape[0] > 1 and view.strides[0] != itemsize:
            raise ValueError(f"{what} must be C-contiguous (stride {itemsize}), "
                             f"got stride {view.strides[0]}")
        if view.shape[0] > 0 and (<uintptr_t>view.buf) % align != 0:
            raise ValueError(f"{what} is misaligned: its data must be {align}-byte aligned")
        if writable and view.readonly:
            raise ValueError(f"{what} must be writable, got a read-only buffer")
    except BaseException:
        PyBuffer_Release(view)
        raise
    return 0


cdef _Buffer _acquire(object obj, str what, str kind, Py_ssize_t itemsize, size_t align,
                      bint writable):
    cdef _Buffer b = _Buffer.__new__(_Buffer)
    _get_buffer(obj, &b.view, what, kind, itemsize, align, writable)
    b.held = True
    b.length = b.view.shape[0]
    b.ptr = b.view.buf
    return b


def _dtype_name(kind):
    return {"item": "RAGGED_BATCH_ITEM", "output": "RAGGED_BATCH_OUTPUT",
            "request_view": "REQUEST_VIEW", "copy_op": "COPY_OP", "u32": "uint32"}[kind]


cdef inline int _check_busy(int busy, str what) except -1:
    if busy:
        raise BusyError(None, f"the {what} is in use by a decode round; retry after it")
    return 0

# ---------------------------------------------------------------------------------------------
# Error construction from status codes.

cdef tuple _POOL_NAMES = (None, "Exhausted", "InvalidPage", "NotAllocated", "Overflow")
cdef dict _TABLE_NAMES = {Q_EXHAUSTED: "Exhausted", Q_INVALID_PAGE: "InvalidPage",
                          Q_NOT_ALLOCATED: "NotAllocated", Q_OVERFLOW: "Overflow",
                          Q_OUT_OF_RANGE: "OutOfRange", Q_GAP: "Gap", Q_NOT_EMPTY: "NotEmpty"}
cdef dict _STORE_NAMES = {Q_EMPTY_PREFIX: "EmptyPrefix", Q_TOO_MANY_PAGES: "TooManyPages",
                          Q_DUPLICATE: "Duplicate", Q_STORE_FULL: "Full", Q_UNKNOWN: "Unknown"}
cdef dict _SCHED_NAMES = {Q_DUPLICATE_REQUEST: "DuplicateRequest", Q_FULL: "Full",
                          Q_UNKNOWN_REQUEST: "UnknownRequest", Q_OUTPUT_TOO_SMALL: "OutputTooSmall"}


cdef object _pool_error(int rc):
    return PoolError.VARIANTS[_POOL_NAMES[rc]]()


cdef object _table_error(int rc):
    return TableError.VARIANTS[_TABLE_NAMES[rc]]()


cdef object _store_publish_error(int rc):
    # pool failures while retaining are PrefixKvError.Pool(PoolError.X)
    if rc in _STORE_NAMES:
        return PrefixKvError.VARIANTS[_STORE_NAMES[rc]]()
    return PrefixKvError.Pool(_pool_error(rc))


cdef object _store_attach_error(int rc):
    return PrefixKvError.Table(_table_error(rc))


cdef object _sched_error(int rc):
    if rc in _SCHED_NAMES:
        return SchedulerError.VARIANTS[_SCHED_NAMES[rc]]()
    return SchedulerError.Table(_table_error(rc))

# ---------------------------------------------------------------------------------------------
# Block pool (SPEC §2).  One free stack: pages pushed in descending order so never-used pages
# come out ascending; a released page goes on top and is reused first.

cdef int pool_init(Pool *p, uint32_t n) except -1:
    cdef uint32_t i
    p.refcount = <uint32_t *>PyMem_Calloc(n, sizeof(uint32_t))
    p.free_stack = <uint32_t *>PyMem_Malloc(n * sizeof(uint32_t))
    if p.refcount == NULL or p.free_stack == NULL:
        raise MemoryError(f"cannot allocate a pool of {n} pages")
    p.num_blocks = n
    for i in range(n):
        p.free_stack[i] = n - 1 - i
    p.free_top = n
    return 0


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
    """Physical KV pages ``0 .. num_blocks-1`` with reference counts (SPEC §2)."""

    def __cinit__(self, num_blocks):
        cdef uint64_t n = _int(num_blocks, "num_blocks", U32_MAX)
        if n == 0:
            raise ValueError("num_blocks must be at least 1")
        pool_init(&self.pool, <uint32_t>n)

    def __dealloc__(self):
        pool_free(&self.pool)

    @property
    def num_blocks(self):
        return self.pool.num_blocks

    @property
    def free_count(self):
        return self.pool.free_top

    def allocate(self):
        """A free page with reference count 1 (``PoolError.Exhausted`` when none is free)."""
        cdef uint32_t page
        _check_busy(self.busy, "pool")
        cdef int rc = pool_allocate(&self.pool, &page)
        if rc:
            raise _pool_error(rc)
        return page

    def retain(self, page):
        cdef uint32_t p = _u32(page, "page")
        _check_busy(self.busy, "pool")
        cdef int rc = pool_retain(&self.pool, p)
        if rc:
            raise _pool_error(rc)

    def release(self, page):
        cdef uint32_t p = _u32(page, "page")
        _check_busy(self.busy, "pool")
        cdef int rc = pool_release(&self.pool, p)
        if rc:
            raise _pool_error(rc)

    def refcount(self, page):
        cdef uint32_t p = _u32(page, "page")
        if p >= self.pool.num_blocks:
            raise PoolError.InvalidPage()
        return self.pool.refcount[p]

    def _debug_set_refcount(self, page, count):
        """Test hook: set an allocated page's count (1 .. 2**32-1) without touching the free
        stack, to reach ``Overflow`` without 4 billion retains."""
        cdef uint32_t p = _u32(page, "page")
        cdef uint32_t c = _u32(count, "count")
        _check_busy(self.busy, "pool")
        if p >= self.pool.num_blocks:
            raise PoolError.InvalidPage()
        if c == 0:
            raise OverflowError("count must be in [1, 4294967295]")
        if self.pool.refcount[p] == 0:
            raise PoolError.NotAllocated()
        self.pool.refcount[p] = c

    def refcounts(self):
        """Every page's reference count, as a fresh numpy array."""
        out = np.empty(self.pool.num_blocks, dtype=np.uint32)
        cdef uint32_t[::1] v = out
        if self.pool.num_blocks:
            memcpy(&v[0], self.pool.refcount, self.pool.num_blocks * sizeof(uint32_t))
        return out

    def __repr__(self):
        return f"BlockPool(num_blocks={self.pool.num_blocks}, free_count={self.pool.free_top})"

    def __reduce__(self):
        raise TypeError("BlockPool cannot be pickled: it owns the page state of a live engine")

# ---------------------------------------------------------------------------------------------
# Sequence block table (SPEC §3).

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
    # Python sequence (or u32 array) of page ids -> a PyMem buffer the caller frees.
    cdef Py_ssize_t n, i
    cdef uint32_t *buf
    if isinstance(pages, np.ndarray):
        if pages.dtype.kind == "b" or pages.dtype.kind not in "iu":
            raise TypeError(f"{what} must hold integers, got dtype {pages.dtype}")
        if pages.ndim != 1:
            raise ValueError(f"{what} must be 1-D, got {pages.ndim} dimensions")
        seq = pages.tolist()
    elif isinstance(pages, (str, bytes, bytearray)):
        raise TypeError(f"{what} must be a sequence of page ids, not {type(pages).__name__}")
    else:
        try:
            seq = list(pages)
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
            buf[i] = _u32(seq[i], "page")
    except BaseException:
        PyMem_Free(buf)
        raise
    n_out[0] = <uint32_t>n
    return buf


cdef class SequenceBlockTable:
    """The logical -> physical page map of one request, fixed capacity (SPEC §3)."""

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
        return self.table.capacity

    def __len__(self):
        return self.table.len

    def entries(self):
        """The mapped pages ``[0, len)`` in logical order."""
        cdef uint32_t i
        return [self.table.entries[i] for i in range(self.table.len)]

    def ensure_writable(self, logical_page, BlockPool pool not None):
        cdef uint32_t lp = _u32(logical_page, "logical_page")
        cdef Cow c
        _check_busy(pool.busy, "pool")
        cdef int rc = table_ensure_writable(&self.table, lp, &pool.pool, &c)
        if rc:
            raise _table_error(rc)
        return _cow(&c)

    def attach(self, pages, BlockPool pool not None):
        cdef uint32_t n
        _check_busy(pool.busy, "pool")
        cdef uint32_t *buf = _pages_from(pages, &n, "pages")
        cdef int rc = table_attach(&self.table, buf, n, &pool.pool)
        PyMem_Free(buf)
        if rc:
            raise _table_error(rc)

    def release_all(self, BlockPool pool not None):
        _check_busy(pool.busy, "pool")
        cdef int rc = table_release_all(&self.table, &pool.pool)
        if rc:
            raise _table_error(rc)

    def __repr__(self):
        return f"SequenceBlockTable(capacity={self.table.capacity}, entries={self.entries()})"

# ---------------------------------------------------------------------------------------------
# Prefix identity (SPEC §4): BLAKE2b-128 over u32-LE len(namespace), namespace, u32-LE tokens.

cdef inline uint64_t _be64(const uint8_t *b) noexcept nogil:
    cdef uint64_t x = 0
    cdef int i
    for i in range(8):
        x = (x << 8) | b[i]
    return x


cdef inline void _put_be64(uint8_t *b, uint64_t x) noexcept nogil:
    cdef int i
    for i in range(8):
        b[7 - i] = <uint8_t>(x & 0xFF)
        x >>= 8


cdef bytes _namespace_bytes(object namespace):
    if isinstance(namespace, str):
        return (<str>namespace).encode("utf-8")
    if isinstance(namespace, bytes):
        return <bytes>namespace
    try:
        return bytes(memoryview(namespace))
    except TypeError:
        raise TypeError(f"namespace must be bytes-like or str, "
                        f"not {type(namespace).__name__}") from None


cdef object _token_array(object tokens):
    # Any sequence of ints or integer array -> a contiguous uint32 numpy array, range-checked.
    if isinstance(tokens, np.ndarray):
        arr = tokens
        if arr.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got {arr.ndim} dimensions")
        if arr.dtype == np.uint32:
            return np.ascontiguousarray(arr)
        if arr.dtype.kind == "b" or arr.dtype.kind not in "iu":
            raise TypeError(f"tokens must be integers, got dtype {arr.dtype}")
        if arr.size and (arr.min() < 0 or arr.max() > U32_MAX):
            raise OverflowError("token ids must be in [0, 4294967295]")
        return arr.astype(np.uint32)
    if isinstance(tokens, (str, bytes)):
        raise TypeError(f"tokens must be a sequence of token ids, not {type(tokens).__name__}")
    try:
        seq = tokens if isinstance(tokens, (list, tuple)) else list(tokens)
    except TypeError:
        raise TypeError(f"tokens must be a sequence of token ids, "
                        f"not {type(tokens).__name__}") from None
    cdef Py_ssize_t i, n = len(seq)
    out = np.empty(n, dtype=np.uint32)
    cdef uint32_t[::1] v = out
    for i in range(n):
        v[i] = _u32(seq[i], "token id")
    return out


cdef PrefixIdentity _identity_from_digest(const uint8_t *d):
    cdef PrefixIdentity ident = PrefixIdentity.__new__(PrefixIdentity)
    ident.hi = _be64(d)
    ident.lo = _be64(d + 8)
    return ident


cdef PrefixIdentity _identity_of(const uint32_t *tokens, size_t n, bytes ns):
    cdef uint8_t d[16]
    cdef const uint8_t *nsp = <const uint8_t *><char *>ns
    cdef Py_ssize_t nsl = len(ns)
    if nsl > U32_MAX:
        raise OverflowError("namespace longer than 2**32-1 bytes")
    if n > 4096:  # long prompts: let other threads run while we hash
        with nogil:
            qualia_prefix_digest(nsp, <uint32_t>nsl, tokens, n, d)
    else:
        qualia_prefix_digest(nsp, <uint32_t>nsl, tokens, n, d)
    return _identity_from_digest(d)


cdef Py_ssize_t _tokens_into(object tokens, uint32_t *dst, Py_ssize_t cap) except -1:
    # Copy token ids into dst[0..cap) (range-checked); returns the count, or cap + 1 without
    # copying when there are more than cap tokens.
    cdef void *ptr
    cdef Py_ssize_t i, n
    if _fast_array(tokens, _DT_U32, sizeof(uint32_t), False, &ptr, &n):
        if n > cap:
            return cap + 1
        if n:
            memcpy(dst, ptr, n * sizeof(uint32_t))
        return n
    if type(tokens) is list or type(tokens) is tuple:
        n = len(tokens)
        if n > cap:
            return cap + 1
        for i in range(n):
            dst[i] = _u32(tokens[i], "token id")
        return n
    arr = _token_array(tokens)
    n = arr.shape[0]
    if n > cap:
        return cap + 1
    cdef const uint32_t[::1] v = arr
    if n:
        memcpy(dst, &v[0], n * sizeof(uint32_t))
    return n


cdef PrefixIdentity _identity_of_tokens(object tokens, bytes ns):
    cdef uint32_t stack[256]
    cdef void *ptr
    cdef Py_ssize_t n
    if _fast_array(tokens, _DT_U32, sizeof(uint32_t), False, &ptr, &n):
        return _identity_of(<uint32_t *>ptr, n, ns)
    n = _tokens_into(tokens, stack, 256)
    if n <= 256:
        return _identity_of(stack, n, ns)
    cdef uint32_t *heap
    if type(tokens) is list or type(tokens) is tuple:
        n = len(tokens)
        heap = <uint32_t *>PyMem_Malloc(n * sizeof(uint32_t))
        if heap == NULL:
            raise MemoryError()
        try:
            _tokens_into(tokens, heap, n)
            return _identity_of(heap, n, ns)
        finally:
            PyMem_Free(heap)
    arr = _token_array(tokens)
    cdef const uint32_t[::1] v = arr
    return _identity_of(&v[0], v.shape[0], ns)


cdef class PrefixIdentity:
    """A 128-bit digest naming a prompt prefix (SPEC §4)."""

    def __init__(self, digest):
        cdef const uint8_t[::1] v
        if isinstance(digest, str):
            raise TypeError("PrefixIdentity takes the 16-byte digest; use fromhex() for hex")
        try:
            v = memoryview(digest).cast("B")
        except TypeError:
            raise TypeError(f"digest must be 16 bytes, not {type(digest).__name__}") from None
        if v.shape[0] != 16:
            raise ValueError(f"digest must be exactly 16 bytes, got {v.shape[0]}")
        self.hi = _be64(&v[0])
        self.lo = _be64(&v[8])

    @classmethod
    def of_tokens(cls, tokens, namespace=b""):
        """BLAKE2b-128 of ``u32le(len(ns)) || ns || u32le(token) ...``."""
        return _identity_of_tokens(tokens, _namespace_bytes(namespace))

    @classmethod
    def fromhex(cls, s):
        if not isinstance(s, str):
            raise TypeError(f"fromhex() takes a str, not {type(s).__name__}")
        if len(s) != 32:
            raise ValueError(f"a prefix identity is 32 hex digits, got {len(s)} characters")
        return cls(bytes.fromhex(s))

    @property
    def digest(self):
        cdef uint8_t d[16]
        _put_be64(d, self.hi)
        _put_be64(d + 8, self.lo)
        return PyBytes_FromStringAndSize(<char *>d, 16)

    def hex(self):
        return f"{self.hi:016x}{self.lo:016x}"

    def __int__(self):
        return (int(self.hi) << 64) | int(self.lo)

    def __index__(self):
        return (int(self.hi) << 64) | int(self.lo)

    def __hash__(self):
        cdef uint64_t h = self.hi ^ (self.lo * <uint64_t>0x9E3779B97F4A7C15)
        cdef Py_ssize_t r = <Py_ssize_t>(h >> 1)
        return r if r != -1 else -2

    def __eq__(self, other):
        if not isinstance(other, PrefixIdentity):
            return NotImplemented
        return self.hi == (<PrefixIdentity>other).hi and self.lo == (<PrefixIdentity>other).lo

    def __ne__(self, other):
        if not isinstance(other, PrefixIdentity):
            return NotImplemented
        return not (self.hi == (<PrefixIdentity>other).hi and
                    self.lo == (<PrefixIdentity>other).lo)

    def __repr__(self):
        return f"PrefixIdentity.fromhex('{self.hex()}')"

    def __reduce__(self):
        return (PrefixIdentity, (self.digest,))

# ---------------------------------------------------------------------------------------------
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

# ---------------------------------------------------------------------------------------------
# Prefix KV store (SPEC §4): fixed entries, open-addressing index by digest (backward-shift
# deletion, load <= 1/2), intrusive LRU list (head = least recent).

cdef inline uint32_t _home(Store *st, uint64_t hi, uint64_t lo) noexcept nogil:
    return <uint32_t>((lo ^ (hi >> 7)) & st.index_mask)


cdef int32_t store_find(Store *st, uint64_t hi, uint64_t lo) noexcept nogil:
    cdef uint32_t i = _home(st, hi, lo)
    cdef int32_t e
    while True:
        e = st.index[i]
        if e < 0:
            return -1
        if st.entries[e].hi == hi and st.entries[e].lo == lo:
            return e
        i = (i + 1) & st.index_mask


cdef uint32_t _store_home_of(void *ctx, int32_t e) noexcept nogil:
    cdef Store *st = <Store *>ctx
    return _home(st, st.entries[e].hi, st.entries[e].lo)


cdef inline void store_index_insert(Store *st, int32_t e) noexcept nogil:
    oa_insert(st.index, st.index_mask, _store_home_of(st, e), e)


cdef inline void store_index_remove(Store *st, int32_t e) noexcept nogil:
    oa_remove(st.index, st.index_mask, _store_home_of(st, e), e, _store_home_of, st)


cdef void lru_unlink(Store *st, int32_t e) noexcept nogil:
    cdef StoreEntry *x = &st.entries[e]
    if x.prev >= 0:
        st.entries[x.prev].next = x.next
    else:
        st.lru_head = x.next
    if x.next >= 0:
        st.entries[x.next].prev = x.prev
    else:
        st.lru_tail = x.prev
    x.prev = -1
    x.next = -1


cdef void lru_push(Store *st, int32_t e) noexcept nogil:
    cdef StoreEntry *x = &st.entries[e]
    x.prev = st.lru_tail
    x.next = -1
    if st.lru_tail >= 0:
        st.entries[st.lru_tail].next = e
    else:
        st.lru_head = e
    st.lru_tail = e


cdef int store_publish(Store *st, uint64_t hi, uint64_t lo, const uint32_t *pages, uint32_t n,
                       uint32_t tokens, Pool *p) noexcept nogil:
    cdef uint32_t i, j
    cdef int rc
    cdef int32_t e
    if n == 0 or tokens == 0:
        return Q_EMPTY_PREFIX
    if n > st.max_pages:
        return Q_TOO_MANY_PAGES
    if store_find(st, hi, lo) >= 0:
        return Q_DUPLICATE
    if st.free_head < 0:
        return Q_STORE_FULL
    for i in range(n):
        rc = pool_retain(p, pages[i])
        if rc:
            for j in range(i):
                pool_release(p, pages[j])
            return rc
    e = st.free_head
    st.free_head = st.entries[e].next
    st.entries[e].hi = hi
    st.entries[e].lo = lo
    st.entries[e].tokens = tokens
    st.entries[e].npages = n
    st.entries[e].used = 1
    memcpy(&st.pages[<size_t>e * st.max_pages], pages, n * sizeof(uint32_t))
    store_index_insert(st, e)
    lru_push(st, e)
    st.count += 1
    return Q_OK


cdef int store_attach(Store *st, uint64_t hi, uint64_t lo, Table *t, Pool *p,
                      uint32_t *tokens_out) noexcept nogil:
    # tokens_out = 0 on a miss; a table error counts nothing
    cdef int32_t e = store_find(st, hi, lo)
    cdef int rc
    if e < 0:
        st.misses += 1
        tokens_out[0] = 0
        return Q_OK
    rc = table_attach(t, &st.pages[<size_t>e * st.max_pages], st.entries[e].npages, p)
    if rc:
        return rc
    st.hits += 1
    lru_unlink(st, e)
    lru_push(st, e)
    tokens_out[0] = st.entries[e].tokens
    return Q_OK


cdef int store_evict_entry(Store *st, int32_t e, Pool *p) noexcept nogil:
    cdef uint32_t i
    cdef int rc, first = Q_OK
    cdef uint32_t *pg = &st.pages[<size_t>e * st.max_pages]
    lru_unlink(st, e)
    store_index_remove(st, e)
    for i in range(st.entries[e].npages):
        rc = pool_release(p, pg[i])
        if rc and first == Q_OK:
            first = rc
    st.entries[e].used = 0
    st.entries[e].npages = 0
    st.entries[e].next = st.free_head
    st.free_head = e
    st.count -= 1
    return first


cdef class PrefixKvStore:
    """At most ``entries`` published prefixes of at most ``pages`` pages each (SPEC §4)."""

    def __cinit__(self, entries, pages):
        cdef uint32_t ne = _u32(entries, "entries")
        cdef uint32_t npg = _u32(pages, "pages")
        cdef uint32_t i, size = 2
        if ne == 0 or npg == 0:
            raise ValueError("a prefix store needs at least 1 entry of at least 1 page")
        if ne > (1 << 30):
            raise OverflowError("entries must be at most 2**30")
        while size < 2 * ne:
            size <<= 1
        self.store.entries = <StoreEntry *>PyMem_Calloc(ne, sizeof(StoreEntry))
        self.store.pages = <uint32_t *>PyMem_Malloc(<size_t>ne * npg * sizeof(uint32_t))
        self.store.index = <int32_t *>PyMem_Malloc(size * sizeof(int32_t))
        if self.store.entries == NULL or self.store.pages == NULL or self.store.index == NULL:
            raise MemoryError(f"cannot allocate a prefix store of {ne} x {npg} pages")
        for i in range(size):
            self.store.index[i] = -1
        self.store.index_mask = size - 1
        self.store.capacity = ne
        self.store.max_pages = npg
        for i in range(ne):
            self.store.entries[i].next = <int32_t>(i + 1) if i + 1 < ne else -1
            self.store.entries[i].prev = -1
        self.store.free_head = 0
        self.store.lru_head = -1
        self.store.lru_tail = -1

    def __dealloc__(self):
        PyMem_Free(self.store.entries)
        PyMem_Free(self.store.pages)
        PyMem_Free(self.store.index)

    @property
    def capacity(self):
        return self.store.capacity

    @property
    def max_pages(self):
        return self.store.max_pages

    @property
    def hits(self):
        return self.store.hits

    @property
    def misses(self):
        return self.store.misses

    def __len__(self):
        return self.store.count

    def contains(self, PrefixIdentity identity not None):
        return store_find(&self.store, identity.hi, identity.lo) >= 0

    def __contains__(self, identity):
        if not isinstance(identity, PrefixIdentity):
            return False
        return store_find(&self.store, (<PrefixIdentity>identity).hi,
                          (<PrefixIdentity>identity).lo) >= 0

    cdef int32_t _entry(self, PrefixIdentity identity) except -2:
        cdef int32_t e = store_find(&self.store, identity.hi, identity.lo)
        if e < 0:
            raise PrefixKvError.Unknown()
        return e

    def publish(self, PrefixIdentity identity not None, pages, tokens, BlockPool pool not None):
        cdef uint32_t ntok = _u32(tokens, "tokens")
        cdef uint32_t n
        _check_busy(self.busy, "prefix store")
        _check_busy(pool.busy, "pool")
        cdef uint32_t *buf = _pages_from(pages, &n, "pages")
        cdef int rc = store_publish(&self.store, identity.hi, identity.lo, buf, n, ntok, &pool.pool)
        PyMem_Free(buf)
        if rc:
            raise _store_publish_error(rc)

    def attach(self, PrefixIdentity identity not None, SequenceBlockTable table not None,
               BlockPool pool not None):
        """On a hit map the entry's pages into the empty table and return its token count."""
        cdef uint32_t tokens
        _check_busy(self.busy, "prefix store")
        _check_busy(pool.busy, "pool")
        cdef int rc = store_attach(&self.store, identity.hi, identity.lo, &table.table,
                                   &pool.pool, &tokens)
        if rc:
            raise _store_attach_error(rc)
        return tokens if tokens else None

    def evict(self, PrefixIdentity identity not None, BlockPool pool not None):
        _check_busy(self.busy, "prefix store")
        _check_busy(pool.busy, "pool")
        cdef int32_t e = self._entry(identity)
        cdef int rc = store_evict_entry(&self.store, e, &pool.pool)
        if rc:
            raise PrefixKvError.Pool(_pool_error(rc))

    def evict_lru(self, BlockPool pool not None):
        """Drop the least recently published-or-hit entry; None when the store is empty."""
        _check_busy(self.busy, "prefix store")
        _check_busy(pool.busy, "pool")
        cdef int32_t e = self.store.lru_head
        if e < 0:
            return None
        ident = _identity_from_entry(&self.store.entries[e])
        cdef int rc = store_evict_entry(&self.store, e, &pool.pool)
        if rc:
            raise PrefixKvError.Pool(_pool_error(rc))
        return ident

    def pages_of(self, PrefixIdentity identity not None):
        cdef int32_t e = self._entry(identity)
        cdef uint32_t i
        cdef uint32_t *pg = &self.store.pages[<size_t>e * self.store.max_pages]
        return [pg[i] for i in range(self.store.entries[e].npages)]

    def tokens_of(self, PrefixIdentity identity not None):
        return self.store.entries[self._entry(identity)].tokens

    def identities(self):
        """Published identities, least recent first."""
        out = []
        cdef int32_t e = self.store.lru_head
        while e >= 0:
            out.append(_identity_from_entry(&self.store.entries[e]))
            e = self.store.entries[e].next
        return out

    def __repr__(self):
        return (f"PrefixKvStore(entries={self.store.capacity}, pages={self.store.max_pages}, "
                f"len={self.store.count}, hits={self.store.hits}, misses={self.store.misses})")


cdef PrefixIdentity _identity_from_entry(StoreEntry *x):
    cdef PrefixIdentity ident = PrefixIdentity.__new__(PrefixIdentity)
    ident.hi = x.hi
    ident.lo = x.lo
    return ident

# ---------------------------------------------------------------------------------------------
# The seed's request scheduler.  Request lookup goes through an open-addressing index keyed by
# request id (the seed scans; results are identical because ids of active requests are unique).

cdef inline uint32_t _rid_home(Sched *s, uint64_t rid) noexcept nogil:
    cdef uint64_t h = rid * <uint64_t>0x9E3779B97F4A7C15
    return <uint32_t>((h >> 32) & s.index_mask)


cdef int32_t sched_find(Sched *s, uint64_t rid) noexcept nogil:
    cdef uint32_t i = _rid_home(s, rid)
    cdef int32_t e
    while True:
        e = s.index[i]
        if e < 0:
            return -1
        if s.slots[e].request_id == rid:
            return e
        i = (i + 1) & s.index_mask


cdef uint32_t _sched_home_of(void *ctx, int32_t slot) noexcept nogil:
    cdef Sched *s = <Sched *>ctx
    return _rid_home(s, s.slots[slot].request_id)


cdef inline void sched_index_insert(Sched *s, int32_t slot) noexcept nogil:
    oa_insert(s.index, s.index_mask, _sched_home_of(s, slot), slot)


cdef inline void sched_index_remove(Sched *s, int32_t slot) noexcept nogil:
    oa_remove(s.index, s.index_mask, _sched_home_of(s, slot), slot, _sched_home_of, s)


cdef inline int32_t sched_lowest_free(Sched *s) noexcept nogil:
    cdef uint32_t w
    cdef uint64_t bits
    for w in range(s.n_words):
        bits = s.free_bits[w]
        if bits:
            return <int32_t>(w * 64 + __builtin_ctzll(bits))
    return -1


cdef inline uint32_t sat_add1(uint32_t x) noexcept nogil:
    return x + 1 if x != U32_MAX else x


cdef struct Admission_c:
    uint16_t slot
    uint32_t prefix_tokens


cdef int sched_admit(Sched *s, uint64_t rid, bint has_identity, uint64_t hi, uint64_t lo,
                     Store *st, Pool *p, Admission_c *out) noexcept nogil:
    cdef int32_t index
    cdef uint32_t prefix_tokens = 0
    cdef int rc
    cdef Slot *slot
    if sched_find(s, rid) >= 0:
        return Q_DUPLICATE_REQUEST
    index = sched_lowest_free(s)
    if index < 0:
        return Q_FULL
    if has_identity:
        rc = store_attach(st, hi, lo, &s.slots[index].blocks, p, &prefix_tokens)
        if rc:
            return rc
    slot = &s.slots[index]
    slot.request_id = rid
    slot.state = QUALIA_STATE_PREFILL
    if prefix_tokens != 0:
        slot_set_decode(s, index)
    slot.token_count = prefix_tokens
    slot.prefix_tokens = prefix_tokens
    sched_index_insert(s, index)
    s.free_bits[index >> 6] &= ~((<uint64_t>1) << (index & 63))
    s.active += 1
    out.slot = <uint16_t>index
    out.prefix_tokens = prefix_tokens
    return Q_OK


cdef inline void slot_set_decode(Sched *s, uint32_t index) noexcept nogil:
    # every decoding slot has its bit set, so a round visits decoding slots only
    if s.slots[index].state != QUALIA_STATE_DECODE:
        s.slots[index].state = QUALIA_STATE_DECODE
        s.decode_bits[index >> 6] |= (<uint64_t>1) << (index & 63)
        s.n_decode += 1


cdef void slot_clear(Sched *s, int32_t index) noexcept nogil:
    cdef Slot *slot = &s.slots[index]
    sched_index_remove(s, index)
    if slot.state == QUALIA_STATE_DECODE:
        s.decode_bits[index >> 6] &= ~((<uint64_t>1) << (index & 63))
        s.n_decode -= 1
    slot.request_id = 0
    slot.state = QUALIA_STATE_EMPTY
    slot.token_count = 0
    slot.prefix_tokens = 0
    slot.next_token_id = 0
    slot.token_ready = 0
    s.free_bits[index >> 6] |= (<uint64_t>1) << (index & 63)
    s.active -= 1


cdef int sched_finish(Sched *s, int32_t index, Pool *p) noexcept nogil:
    # the seed: `slot.blocks.release_all(pool)?; slot.clear();` -- on a pool error the table is
    # already empty but the request stays active
    cdef int rc = table_release_all(&s.slots[index].blocks, p)
    if rc:
        return rc
    slot_clear(s, index)
    return Q_OK


cdef object _receipt(list cache, uint32_t n):
    r = cache[n]
    if r is None:
        r = RaggedBatchReceipt(n, 1)
        cache[n] = r
    return r


_ZERO_RECEIPT = RaggedBatchReceipt(0, 0)


cdef object _c_backend(object backend, qualia_backend **out):
    # A C backend is a PyCapsule named QUALIA_BACKEND_CAPSULE_NAME, handed over directly or as
    # the backend's __qualia_backend__ attribute (or the result of calling it).
    cdef const char *name
    cdef qualia_backend *b
    if PyCapsule_CheckExact(backend):
        cap = backend
    else:
        cap = getattr(backend, "__qualia_backend__", None)
        if cap is None:
            return None
        if not PyCapsule_CheckExact(cap) and callable(cap):
            cap = cap()
        if not PyCapsule_CheckExact(cap):
            raise BackendAbiError(None, f"__qualia_backend__ must be a PyCapsule named "
                                        f"{BACKEND_CAPSULE_NAME!r}, got {type(cap).__name__}")
    name = PyCapsule_GetName(cap)
    if name == NULL or strcmp(name, QUALIA_BACKEND_CAPSULE_NAME) != 0:
        got = None if name == NULL else (<bytes>name).decode("utf-8", "replace")
        raise BackendAbiError(None, f"backend capsule is named {got!r}, "
                                    f"expected {BACKEND_CAPSULE_NAME!r}")
    b = <qualia_backend *>PyCapsule_GetPointer(cap, name)
    if b == NULL:
        raise BackendAbiError(None, "backend capsule holds a NULL pointer")
    if b.abi_version != QUALIA_BACKEND_ABI_VERSION:
        raise BackendAbiError(None, f"backend ABI version {b.abi_version}, expected "
                                    f"{QUALIA_BACKEND_ABI_VERSION}")
    if b.struct_size < sizeof(qualia_backend):
        raise BackendAbiError(None, f"backend struct_size {b.struct_size}, expected at least "
                                    f"{sizeof(qualia_backend)}")
    if b.execute_ragged == NULL:
        raise BackendAbiError(None, "backend execute_ragged pointer is NULL")
    out[0] = b
    return cap


cdef object _readonly_view(object arr, Py_ssize_t n):
    if cnp.PyArray_CheckExact(arr) and not (cnp.PyArray_FLAGS(<cnp.ndarray>arr)
                                             & cnp.NPY_ARRAY_WRITEABLE):
        return arr[:n]  # already a read-only base (the facade's buffers)
    v = np.asarray(arr)[:n]
    v.setflags(write=False)
    return v


cdef int _parse_receipt(object result, qualia_batch_receipt *rec) except -1:
    # A RaggedBatchReceipt, any 2-sequence of u32 ints, or a RAGGED_BATCH_RECEIPT record; not an
    # iterator, mapping or bytes (whose items happen to be ints).
    if type(result) is RaggedBatchReceipt:
        try:
            rec.batch_size = _u32(result[0], "receipt batch_size")
            rec.backend_launches = _u32(result[1], "receipt backend_launches")
            return 0
        except Exception:
            pass
    try:
        if isinstance(result, np.void) and result.dtype.names:
            result = result.item()
        elif isinstance(result, np.ndarray) and result.ndim == 1:
            result = result.tolist()
        if (not isinstance(result, _AbcSequence) or isinstance(result, (str, bytes, bytearray))
                or len(result) != 2):
            raise TypeError("not a 2-sequence")
        rec.batch_size = _u32(result[0], "receipt batch_size")
        rec.backend_launches = _u32(result[1], "receipt backend_launches")
    except Exception as exc:
        err = TypeError(f"execute_ragged must return a RaggedBatchReceipt or a "
                        f"(batch_size, backend_launches) pair of u32, got {result!r:.80}")
        err.__cause__ = exc
        raise DecodeRoundError.Backend(err) from err
    return 0


cdef class RequestScheduler:
    """The seed's fixed-capacity request scheduler (``RequestScheduler<REQUESTS>``)."""

    def __cinit__(self, max_requests, logical_pages):
        cdef uint32_t mr = _u32(max_requests, "max_requests")
        cdef uint32_t lp = _u32(logical_pages, "logical_pages")
        cdef uint32_t i, size = 2
        if mr == 0:
            raise ValueError("max_requests must be at least 1")
        if mr > 65536:
            raise OverflowError("max_requests must be at most 65536 (slots are u16)")
        while size < 2 * mr:
            size <<= 1
        self.s.slots = <Slot *>PyMem_Calloc(mr, sizeof(Slot))
        self.s.table_storage = <uint32_t *>PyMem_Malloc(
            (<size_t>mr * lp if lp else 1) * sizeof(uint32_t))
        self.s.index = <int32_t *>PyMem_Malloc(size * sizeof(int32_t))
        self.s.n_words = (mr + 63) // 64
        self.s.free_bits = <uint64_t *>PyMem_Calloc(self.s.n_words, sizeof(uint64_t))
        self.s.decode_bits = <uint64_t *>PyMem_Calloc(self.s.n_words, sizeof(uint64_t))
        self.s.lowered = <uint32_t *>PyMem_Malloc(mr * sizeof(uint32_t))
        if (self.s.slots == NULL or self.s.table_storage == NULL or self.s.index == NULL
                or self.s.free_bits == NULL or self.s.decode_bits == NULL
                or self.s.lowered == NULL):
            raise MemoryError(f"cannot allocate a scheduler of {mr} x {lp} pages")
        for i in range(size):
            self.s.index[i] = -1
        self.s.index_mask = size - 1
        for i in range(mr):
            self.s.slots[i].blocks.entries = &self.s.table_storage[<size_t>i * lp]
            self.s.slots[i].blocks.capacity = lp
            self.s.free_bits[i >> 6] |= (<uint64_t>1) << (i & 63)
        self.s.max_requests = mr
        self.s.logical_pages = lp
        self._receipts = [None] * (mr + 1)

    def __dealloc__(self):
        PyMem_Free(self.s.slots)
        PyMem_Free(self.s.table_storage)
        PyMem_Free(self.s.index)
        PyMem_Free(self.s.free_bits)
        PyMem_Free(self.s.decode_bits)
        PyMem_Free(self.s.lowered)

    @property
    def max_requests(self):
        return self.s.max_requests

    @property
    def logical_pages(self):
        return self.s.logical_pages

    def active_count(self):
        return self.s.active

    cdef int32_t _find(self, object request_id) except -2:
        cdef uint64_t rid = _u64(request_id, "request_id")
        cdef int32_t index = sched_find(&self.s, rid)
        if index < 0:
            raise SchedulerError.UnknownRequest()
        return index

    cdef int32_t _find_idle(self, object request_id) except -2:
        # mutating methods: arguments first, then Busy, then the lookup, so a backend calling
        # back mid-round gets BusyError whatever id it passes
        cdef uint64_t rid = _u64(request_id, "request_id")
        _check_busy(self.busy, "scheduler")
        cdef int32_t index = sched_find(&self.s, rid)
        if index < 0:
            raise SchedulerError.UnknownRequest()
        return index

    def admit_with_prefix(self, request_id, identity, PrefixKvStore prefixes not None,
                          BlockPool pool not None):
        """Admit a request, attaching the prefix's pages on a hit (seed ``admit_with_prefix``)."""
        cdef uint64_t rid = _u64(request_id, "request_id")
        cdef Admission_c adm
        cdef uint64_t hi = 0, lo = 0
        if identity is not None:
            if not isinstance(identity, PrefixIdentity):
                raise TypeError(f"identity must be a PrefixIdentity or None, "
                                f"not {type(identity).__name__}")
            hi = (<PrefixIdentity>identity).hi
            lo = (<PrefixIdentity>identity).lo
        _check_busy(self.busy, "scheduler")
        _check_busy(prefixes.busy, "prefix store")
        _check_busy(pool.busy, "pool")
        cdef int rc = sched_admit(&self.s, rid, identity is not None, hi, lo, &prefixes.store,
                                  &pool.pool, &adm)
        if rc:
            if rc in _SCHED_NAMES:
                raise _sched_error(rc)
            raise SchedulerError.Prefix(_store_attach_error(rc))
        return Admission(adm.slot, adm.prefix_tokens != 0, adm.prefix_tokens)

    def ensure_writable(self, request_id, logical_page, BlockPool pool not None):
        cdef uint32_t lp = _u32(logical_page, "logical_page")
        cdef int32_t index = self._find_idle(request_id)
        cdef Cow c
        _check_busy(pool.busy, "pool")
        cdef int rc = table_ensure_writable(&self.s.slots[index].blocks, lp, &pool.pool, &c)
        if rc:
            raise SchedulerError.Table(_table_error(rc))
        return _cow(&c)

    def mark_prefill_complete(self, request_id):
        cdef int32_t index = self._find_idle(request_id)
        slot_set_decode(&self.s, index)

    def seed_decode_token(self, request_id, token_id):
        cdef uint32_t tok = _u32(token_id, "token_id")
        cdef int32_t index = self._find_idle(request_id)
        self.s.slots[index].next_token_id = tok
        self.s.slots[index].token_ready = 1

    def record_token(self, request_id):
        cdef int32_t index = self._find_idle(request_id)
        self.s.slots[index].token_count = sat_add1(self.s.slots[index].token_count)
        return self.s.slots[index].token_count

    def finish(self, request_id, BlockPool pool not None):
        """Release the request's pages and free its slot (completion and cancellation alike)."""
        cdef int32_t index = self._find_idle(request_id)
        _check_busy(pool.busy, "pool")
        cdef int rc = sched_finish(&self.s, index, &pool.pool)
        if rc:
            raise SchedulerError.Table(_table_error(rc))

    def block_table(self, request_id):
        cdef int32_t index = self._find(request_id)
        cdef Table *t = &self.s.slots[index].blocks
        cdef uint32_t i
        return [t.entries[i] for i in range(t.len)]

    def pending_token(self, request_id):
        """The input token of the request's next decode step, or None if none was seeded."""
        cdef int32_t index = self._find(request_id)
        if not self.s.slots[index].token_ready:
            return None
        return self.s.slots[index].next_token_id

    def request_view(self, request_id):
        cdef int32_t index = self._find(request_id)
        cdef Slot *sl = &self.s.slots[index]
        return (sl.request_id, index, RequestState(sl.state), sl.token_count, sl.prefix_tokens)

    cdef Py_ssize_t _runnable_into(self, qualia_request_view *out, Py_ssize_t cap) except -1:
        cdef uint32_t i
        cdef Py_ssize_t written = 0
        cdef Slot *sl
        if cap < self.s.active:
            raise SchedulerError.OutputTooSmall()
        for i in range(self.s.max_requests):
            sl = &self.s.slots[i]
            if sl.state == QUALIA_STATE_EMPTY:
                continue
            memset(&out[written], 0, sizeof(qualia_request_view))
            out[written].request_id = sl.request_id
            out[written].slot = <uint16_t>i
            out[written].state = sl.state
            out[written].token_count = sl.token_count
            out[written].prefix_tokens = sl.prefix_tokens
            written += 1
        return written

    def runnable_into(self, out):
        """Write every active request's view into ``out`` in slot order; return the count."""
        cdef _Buffer b = _acquire(out, "out", "request_view", sizeof(qualia_request_view),
                                  QUALIA_ALIGN_VIEW, True)
        return self._runnable_into(<qualia_request_view *>b.ptr, b.length)

    def runnable(self):
        """Every active request's view, as a fresh REQUEST_VIEW array."""
        arr = np.zeros(self.s.active, dtype=REQUEST_VIEW)
        cdef _Buffer b = _acquire(arr, "out", "request_view", sizeof(qualia_request_view),
                                  QUALIA_ALIGN_VIEW, True)
        self._runnable_into(<qualia_request_view *>b.ptr, b.length)
        return arr

    cdef object _round(self, object backend,
                       qualia_batch_item *items, Py_ssize_t items_cap, object items_obj,
                       uint32_t *table, Py_ssize_t table_cap, object table_obj,
                       qualia_batch_output *outs, Py_ssize_t outs_cap, object outs_obj):
        # One ragged decode round, the seed's checks in the seed's order.
        cdef Sched *s = &self.s
        cdef uint32_t i, j, w, n = 0, decode_count = s.n_decode
        cdef uint64_t bits
        cdef size_t need = 0, off = 0
        cdef Slot *sl
        cdef qualia_backend *cb = NULL
        cdef qualia_batch_receipt rec
        cdef int32_t status = 0
        cdef object holder = None
        cdef object fn = None
        # the backend is resolved first: a wrong one fails every round, empty or not
        holder = _c_backend(backend, &cb)
        if holder is None:
            fn = getattr(backend, "execute_ragged", None)
            if not callable(fn):
                raise TypeError(f"backend must be a C backend (__qualia_backend__ capsule) or have "
                                f"an execute_ragged(items, block_table, outputs) method, not "
                                f"{type(backend).__name__}")
        for w in range(s.n_words):
            bits = s.decode_bits[w]
            while bits:
                need += s.slots[w * 64 + __builtin_ctzll(bits)].blocks.len
                bits &= bits - 1
        if items_cap < decode_count:
            raise DecodeRoundError.ItemBufferTooSmall()
        if outs_cap < decode_count:
            raise DecodeRoundError.OutputBufferTooSmall()
        if <size_t>table_cap < need:
            raise DecodeRoundError.BlockTableBufferTooSmall()
        for w in range(s.n_words):
            bits = s.decode_bits[w]
            while bits:
                i = w * 64 + __builtin_ctzll(bits)
                bits &= bits - 1
                sl = &s.slots[i]
                if not sl.token_ready:
                    raise DecodeRoundError.MissingInputToken()
                if sl.blocks.len:
                    memcpy(&table[off], sl.blocks.entries, sl.blocks.len * sizeof(uint32_t))
                items[n].request_id = sl.request_id
                items[n].slot = i
                items[n].token_id = sl.next_token_id
                items[n].position = sl.token_count
                items[n].block_table_offset = <uint32_t>off
                items[n].logical_pages = sl.blocks.len
                items[n]._reserved = 0
                s.lowered[n] = i
                n += 1
                off += sl.blocks.len
        if n == 0:
            return _ZERO_RECEIPT
        if off > U32_MAX:
            raise OverflowError("the lowered block table exceeds 2**32-1 entries")
        rec.batch_size = 0
        rec.backend_launches = 0
        self.busy = 1
        try:
            if holder is not None:
                with nogil:
                    status = cb.execute_ragged(cb.ctx, items, n, table, <uint32_t>off, outs, &rec)
                if status != 0:
                    raise DecodeRoundError.Backend(RaggedBackendError.Failed(status))
            else:
                try:
                    result = fn(_readonly_view(items_obj, n), _readonly_view(table_obj, off),
                                np.asarray(outs_obj)[:n])
                except BaseException as exc:
                    if not isinstance(exc, Exception):
                        raise  # KeyboardInterrupt and friends pass through untouched
                    raise DecodeRoundError.Backend(exc) from exc
                _parse_receipt(result, &rec)
        finally:
            self.busy = 0
        if rec.batch_size != n:
            raise DecodeRoundError.OutputIdentityMismatch()
        if rec.backend_launches != 1:
            raise DecodeRoundError.BackendLaunchCount()
        for j in range(n):
            i = s.lowered[j]
            if outs[j].request_id != s.slots[i].request_id or outs[j].slot != i:
                raise DecodeRoundError.OutputIdentityMismatch()
        for j in range(n):
            sl = &s.slots[s.lowered[j]]
            sl.next_token_id = outs[j].next_token_id
            sl.token_count = sat_add1(sl.token_count)
            sl.token_ready = 1
        return _receipt(self._receipts, n)

    def execute_decode_round(self, backend, item_scratch, block_table_scratch, output_scratch):
        """Lower every decoding request into the scratch buffers and call the backend once."""
        _check_busy(self.busy, "scheduler")
        cdef Py_buffer bi, bt, bo
        cdef int held = 0
        cdef void *pi = NULL
        cdef void *pt = NULL
        cdef void *po = NULL
        cdef Py_ssize_t ni = 0, nt = 0, no = 0
        try:
            if not _fast_array(item_scratch, _DT_ITEM, QUALIA_ALIGN_ITEM, True, &pi, &ni):
                _get_buffer(item_scratch, &bi, "item_scratch", "item", sizeof(qualia_batch_item),
                            QUALIA_ALIGN_ITEM, True)
                held |= 1
                pi = bi.buf
                ni = bi.shape[0]
            if not _fast_array(block_table_scratch, _DT_U32, sizeof(uint32_t), True, &pt, &nt):
                _get_buffer(block_table_scratch, &bt, "block_table_scratch", "u32",
                            sizeof(uint32_t), sizeof(uint32_t), True)
                held |= 2
                pt = bt.buf
                nt = bt.shape[0]
            if not _fast_array(output_scratch, _DT_OUTPUT, QUALIA_ALIGN_OUTPUT, True, &po, &no):
                _get_buffer(output_scratch, &bo, "output_scratch", "output",
                            sizeof(qualia_batch_output), QUALIA_ALIGN_OUTPUT, True)
                held |= 4
                po = bo.buf
                no = bo.shape[0]
            return self._round(backend, <qualia_batch_item *>pi, ni, item_scratch,
                               <uint32_t *>pt, nt, block_table_scratch,
                               <qualia_batch_output *>po, no, output_scratch)
        finally:
            if held & 4:
                PyBuffer_Release(&bo)
            if held & 2:
                PyBuffer_Release(&bt)
            if held & 1:
                PyBuffer_Release(&bi)

    def __repr__(self):
        return (f"RequestScheduler(max_requests={self.s.max_requests}, "
                f"logical_pages={self.s.logical_pages}, active={self.s.active})")

# ---------------------------------------------------------------------------------------------
# The built-in reference C backend.

cdef dict _FAULTS = {None: QUALIA_FAULT_NONE, "error": QUALIA_FAULT_ERROR,
                     "batch_size": QUALIA_FAULT_BATCH_SIZE, "launches": QUALIA_FAULT_LAUNCHES,
                     "swap": QUALIA_FAULT_SWAP}


def hash_next_token(request_id, position, token_id, vocab=32000):
    """The reference backend's deterministic next token (see docs/DESIGN.md)."""
    return qualia_hash_next_token(_u64(request_id, "request_id"), _u32(position, "position"),
                                       _u32(token_id, "token_id"), _u32(vocab, "vocab"))


cdef struct _RefBlock:
    qualia_backend iface
    qualia_hash_backend state


cdef void _free_ref_block(object cap) noexcept:
    PyMem_Free(PyCapsule_GetPointer(cap, QUALIA_BACKEND_CAPSULE_NAME))


cdef class HashBackend:
    """A deterministic decode backend in C: next token = hash(request_id, position, token_id).

    Exposes ``__qualia_backend__`` (the capsule the scheduler calls without the GIL) and the
    same computation as Python methods ``execute_ragged``/``copy_pages``.  ``fault`` injects a
    failure: ``"error"`` (returns ``code``), ``"batch_size"``, ``"launches"`` or ``"swap"``.
    """

    def __cinit__(self, vocab=32000, fault=None, code=-1):
        cdef uint32_t v = _u32(vocab, "vocab")
        if v == 0:
            raise ValueError("vocab must be at least 1")
        # The interface and its state live in one block owned by the capsule, so a capsule kept
        # after the backend object is gone still points at live memory.
        cdef _RefBlock *blk = <_RefBlock *>PyMem_Calloc(1, sizeof(_RefBlock))
        if blk == NULL:
            raise MemoryError()
        try:
            self._capsule = PyCapsule_New(&blk.iface, QUALIA_BACKEND_CAPSULE_NAME,
                                          _free_ref_block)
        except BaseException:
            PyMem_Free(blk)
            raise
        self.iface = &blk.iface
        self.st = &blk.state
        self.st.vocab = v
        self.iface.abi_version = QUALIA_BACKEND_ABI_VERSION
        self.iface.struct_size = sizeof(qualia_backend)
        self.iface.ctx = self.st
        self.iface.execute_ragged = qualia_hash_execute_ragged
        self.iface.copy_pages = qualia_hash_copy_pages
        self.fault = fault
        self.code = code

    @property
    def __qualia_backend__(self):
        return self._capsule

    @property
    def vocab(self):
        return self.st.vocab

    @property
    def fault(self):
        for k, v in _FAULTS.items():
            if v == self.st.fault:
                return k

    @fault.setter
    def fault(self, value):
        if value not in _FAULTS:
            raise ValueError(f"fault must be one of {list(_FAULTS)}, got {value!r}")
        self.st.fault = _FAULTS[value]

    @property
    def code(self):
        return self.st.code

    @code.setter
    def code(self, value):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError("code must be an int")
        if not -2**31 <= value < 2**31:
            raise OverflowError("code must fit in i32")
        if value == 0:
            raise ValueError("an error code must be nonzero")
        self.st.code = value

    @property
    def calls(self):
        return self.st.calls

    @property
    def items(self):
        return self.st.items

    @property
    def pages_copied(self):
        return self.st.pages_copied

    @property
    def copy_calls(self):
        return self.st.copy_calls

    def execute_ragged(self, items, block_table, outputs):
        cdef _Buffer bi = _acquire(items, "items", "item", sizeof(qualia_batch_item),
                                   QUALIA_ALIGN_ITEM, False)
        cdef _Buffer bt = _acquire(block_table, "block_table", "u32", sizeof(uint32_t),
                                   sizeof(uint32_t), False)
        cdef _Buffer bo = _acquire(outputs, "outputs", "output", sizeof(qualia_batch_output),
                                   QUALIA_ALIGN_OUTPUT, True)
        cdef qualia_batch_receipt rec
        if bo.length < bi.length:
            raise ValueError("outputs is shorter than items")
        cdef int32_t rc = qualia_hash_execute_ragged(
            self.st, <qualia_batch_item *>bi.ptr, <uint32_t>bi.length, <uint32_t *>bt.ptr,
            <uint32_t>bt.length, <qualia_batch_output *>bo.ptr, &rec)
        if rc:
            raise RaggedBackendError.Failed(rc)
        return RaggedBatchReceipt(rec.batch_size, rec.backend_launches)

    def copy_pages(self, copies):
        cdef _Buffer bc = _acquire(copies, "copies", "copy_op", sizeof(qualia_copy_op),
                                   QUALIA_ALIGN_COPY, False)
        qualia_hash_copy_pages(self.st, <qualia_copy_op *>bc.ptr, <uint32_t>bc.length)

    def __repr__(self):
        return f"HashBackend(vocab={self.st.vocab}, fault={self.fault!r})"

# ---------------------------------------------------------------------------------------------
# The facade: admit / decode / finish over one pool, one store and one scheduler.

cdef void _undo(Sched *s, Pool *p, Undo *log, Py_ssize_t n) noexcept nogil:
    # Reverse every ensure_writable of the log, newest first, so the free stack is restored
    # exactly: a page popped by an allocation is pushed back on top.
    cdef Py_ssize_t k
    cdef Table *t
    for k in range(n - 1, -1, -1):
        t = &s.slots[log[k].slot].blocks
        if log[k].kind == COW_ALLOCATED:
            t.len -= 1
            pool_release(p, log[k].dst)
        elif log[k].kind == COW_COPY:
            t.entries[log[k].logical_page] = log[k].src
            pool_retain(p, log[k].src)
            pool_release(p, log[k].dst)


cdef class Scheduler:
    """admit / decode / finish over an owned BlockPool, PrefixKvStore and RequestScheduler.

    Everything (pages, prefix entries, request slots, every scratch buffer) is sized here, once.
    """

    def __cinit__(self, max_requests, num_blocks, page_tokens, logical_pages,
                  prefix_entries=64, prefix_pages=None):
        cdef uint32_t pt = _u32(page_tokens, "page_tokens")
        if pt == 0:
            raise ValueError("page_tokens must be at least 1")
        self.page_tokens = pt
        self.pool = BlockPool(num_blocks)
        self.requests = RequestScheduler(max_requests, logical_pages)
        lp = self.requests.logical_pages
        self.prefixes = PrefixKvStore(prefix_entries,
                                      prefix_pages if prefix_pages is not None else max(lp, 1))
        mr = self.requests.max_requests
        self._items = np.zeros(mr, dtype=RAGGED_BATCH_ITEM)
        self._outputs = np.zeros(mr, dtype=RAGGED_BATCH_OUTPUT)
        self._table = np.zeros(max(mr * lp, 1), dtype=np.uint32)
        self.undo_cap = max(mr, lp, 1)
        self._copies = np.zeros(self.undo_cap, dtype=COPY_OP)
        self._items_ro = self._items.view()
        self._items_ro.setflags(write=False)
        self._table_ro = self._table.view()
        self._table_ro.setflags(write=False)
        self._copies_ro = self._copies.view()
        self._copies_ro.setflags(write=False)
        self.tokens_cap = max(<Py_ssize_t>lp * pt, 1)
        self._tokens = np.zeros(self.tokens_cap, dtype=np.uint32)
        self.items_cap = mr
        self.table_cap = max(mr * lp, 1)
        self.items_p = <qualia_batch_item *><uintptr_t>self._items.ctypes.data
        self.outs_p = <qualia_batch_output *><uintptr_t>self._outputs.ctypes.data
        self.table_p = <uint32_t *><uintptr_t>self._table.ctypes.data
        self.copies_p = <qualia_copy_op *><uintptr_t>self._copies.ctypes.data
        self.tokens_p = <uint32_t *><uintptr_t>self._tokens.ctypes.data
        self.undo = <Undo *>PyMem_Malloc(self.undo_cap * sizeof(Undo))
        if self.undo == NULL:
            raise MemoryError()
        self._results = [None] * (mr + 1)

    def __dealloc__(self):
        PyMem_Free(self.undo)

    # -- properties and stats ------------------------------------------------------------------
    @property
    def max_requests(self):
        return self.requests.s.max_requests

    @property
    def logical_pages(self):
        return self.requests.s.logical_pages

    @property
    def num_blocks(self):
        return self.pool.pool.num_blocks

    @property
    def active_count(self):
        return self.requests.s.active

    @property
    def free_pages(self):
        return self.pool.pool.free_top

    def stats(self):
        return {
            "active": self.requests.s.active,
            "max_requests": self.requests.s.max_requests,
            "num_blocks": self.pool.pool.num_blocks,
            "free_pages": self.pool.pool.free_top,
            "used_pages": self.pool.pool.num_blocks - self.pool.pool.free_top,
            "prefix_entries": self.prefixes.store.count,
            "prefix_hits": self.prefixes.store.hits,
            "prefix_misses": self.prefixes.store.misses,
            "pages_copied": self.pages_copied,
            "pages_allocated": self.pages_allocated,
            "decode_rounds": self.rounds,
        }

    cdef int _check_idle(self) except -1:
        _check_busy(self.requests.busy, "scheduler")
        _check_busy(self.prefixes.busy, "prefix store")
        _check_busy(self.pool.busy, "pool")
        return 0

    cdef void _set_busy(self, int v) noexcept:
        self.requests.busy = v
        self.prefixes.busy = v
        self.pool.busy = v

    # -- identities ----------------------------------------------------------------------------
    cdef Py_ssize_t _load_tokens(self, object prompt_tokens) except -1:
        cdef Py_ssize_t n = _tokens_into(prompt_tokens, self.tokens_p, self.tokens_cap)
        if n > self.tokens_cap:
            raise ValueError(f"the prompt has {len(prompt_tokens)} tokens, more than "
                             f"logical_pages x page_tokens = {self.tokens_cap}")
        return n

    cdef Py_ssize_t _prefix_len(self, object prefix_len, Py_ssize_t n) except -1:
        if prefix_len is None:
            return n
        cdef uint32_t L = _u32(prefix_len, "prefix_len")
        if L > n:
            raise ValueError(f"prefix_len {L} is longer than the prompt ({n} tokens)")
        return L

    def identity_for(self, prompt_tokens, prefix_len=None, namespace=b""):
        """The PrefixIdentity of ``prompt_tokens[:prefix_len]`` in ``namespace``."""
        cdef bytes ns = _namespace_bytes(namespace)
        cdef Py_ssize_t n = self._load_tokens(prompt_tokens)
        cdef Py_ssize_t L = self._prefix_len(prefix_len, n)
        return _identity_of(self.tokens_p, L, ns)

    # -- admission and prefill -----------------------------------------------------------------
    def admit(self, request_id, prompt_tokens=None, namespace=b"", prefix_len=None):
        """Admit a request; with a prompt, attach the published pages of its prefix on a hit."""
        identity = None
        if prompt_tokens is not None:
            ns = _namespace_bytes(namespace)
            n = self._load_tokens(prompt_tokens)
            L = self._prefix_len(prefix_len, n)
            if L > 0:
                identity = _identity_of(self.tokens_p, L, ns)
        elif prefix_len is not None:
            raise ValueError("prefix_len needs prompt_tokens")
        return self.requests.admit_with_prefix(request_id, identity, self.prefixes, self.pool)

    cdef int _make_writable(self, int32_t index, uint32_t first, uint32_t last,
                                   Py_ssize_t *n_undo, Py_ssize_t *n_copies) except -1:
        # ensure_writable for logical pages first..last of one request, logging for undo
        cdef Cow c
        cdef uint32_t lp
        cdef int rc
        cdef Sched *s = &self.requests.s
        for lp in range(first, last + 1):
            rc = table_ensure_writable(&s.slots[index].blocks, lp, &self.pool.pool, &c)
            if rc:
                return rc
            if c.kind == COW_EXCLUSIVE:
                continue
            self.undo[n_undo[0]].slot = index
            self.undo[n_undo[0]].logical_page = lp
            self.undo[n_undo[0]].kind = c.kind
            self.undo[n_undo[0]].src = c.src
            self.undo[n_undo[0]].dst = c.page
            n_undo[0] += 1
            if c.kind == COW_COPY:
                self.copies_p[n_copies[0]].src_page = c.src
                self.copies_p[n_copies[0]].dst_page = c.page
                n_copies[0] += 1
        return Q_OK

    def reserve(self, request_id, num_tokens):
        """Make writable every page of the next ``num_tokens`` positions; return the copies."""
        cdef uint32_t n = _u32(num_tokens, "num_tokens")
        self._check_idle()
        cdef int32_t index = self.requests._find(request_id)
        cdef Sched *s = &self.requests.s
        cdef uint64_t start = s.slots[index].token_count
        cdef Py_ssize_t n_undo = 0, n_copies = 0
        cdef int rc
        if n == 0:
            return np.zeros(0, dtype=COPY_OP)
        if start + n - 1 > U32_MAX:
            raise OverflowError("token_count would pass 2**32-1")
        cdef uint64_t first = start // self.page_tokens
        cdef uint64_t last = (start + n - 1) // self.page_tokens
        if last >= s.logical_pages:
            raise SchedulerError.Table(TableError.OutOfRange())
        rc = self._make_writable(index, <uint32_t>first, <uint32_t>last, &n_undo, &n_copies)
        if rc:
            _undo(s, &self.pool.pool, self.undo, n_undo)
            raise SchedulerError.Table(_table_error(rc))
        self.pages_copied += n_copies
        self.pages_allocated += n_undo
        return self._copies[:n_copies].copy()

    def advance(self, request_id, num_tokens):
        """``record_token`` ``num_tokens`` times (saturating); returns the new token count."""
        cdef uint32_t n = _u32(num_tokens, "num_tokens")
        self._check_idle()
        cdef int32_t index = self.requests._find(request_id)
        cdef Slot *sl = &self.requests.s.slots[index]
        cdef uint64_t t = <uint64_t>sl.token_count + n
        sl.token_count = <uint32_t>(t if t <= U32_MAX else U32_MAX)
        return sl.token_count

    def complete_prefill(self, request_id, first_token):
        """The prompt is prefilled: go to Decode with ``first_token`` as the next input."""
        cdef uint32_t tok = _u32(first_token, "first_token")
        self._check_idle()
        cdef int32_t index = self.requests._find(request_id)
        slot_set_decode(&self.requests.s, index)
        self.requests.s.slots[index].next_token_id = tok
        self.requests.s.slots[index].token_ready = 1

    def publish_prefix(self, request_id, prompt_tokens, prefix_len=None, namespace=b""):
        """Publish the request's pages covering ``prompt_tokens[:prefix_len]`` to the store."""
        cdef bytes ns = _namespace_bytes(namespace)
        cdef Py_ssize_t n = self._load_tokens(prompt_tokens)
        cdef Py_ssize_t L = self._prefix_len(prefix_len, n)
        self._check_idle()
        cdef int32_t index = self.requests._find(request_id)
        cdef Slot *sl = &self.requests.s.slots[index]
        cdef uint32_t pages
        if L == 0:
            raise PrefixKvError.EmptyPrefix()
        pages = <uint32_t>((L + self.page_tokens - 1) // self.page_tokens)
        if sl.token_count < L or sl.blocks.len < pages:
            raise ValueError(f"request {request_id} holds {sl.token_count} tokens in "
                             f"{sl.blocks.len} pages; it cannot publish a {L}-token prefix")
        identity = _identity_of(self.tokens_p, L, ns)
        cdef int rc = store_publish(&self.prefixes.store, (<PrefixIdentity>identity).hi,
                                    (<PrefixIdentity>identity).lo, sl.blocks.entries, pages,
                                    <uint32_t>L, &self.pool.pool)
        if rc:
            raise _store_publish_error(rc)
        return identity

    # -- decode --------------------------------------------------------------------------------
    def decode(self, backend):
        """Make each decoding request's next page writable, hand the copies to the backend, run
        one round.  Returns ``(receipt, outputs)``; on any failure nothing changed."""
        cdef Sched *s = &self.requests.s
        cdef Py_ssize_t n_undo = 0, n_copies = 0
        cdef uint32_t i, w, lp
        cdef uint64_t bits
        cdef int rc
        cdef int32_t status = 0
        cdef qualia_backend *cb = NULL
        cdef object holder = None
        self._check_idle()
        for w in range(s.n_words):
            bits = s.decode_bits[w]
            while bits:
                i = w * 64 + __builtin_ctzll(bits)
                bits &= bits - 1
                lp = s.slots[i].token_count // self.page_tokens
                rc = self._make_writable(i, lp, lp, &n_undo, &n_copies)
                if rc:
                    _undo(s, &self.pool.pool, self.undo, n_undo)
                    raise DecodeRoundError.Scheduler(SchedulerError.Table(_table_error(rc)))
        try:
            if n_copies:
                holder = _c_backend(backend, &cb)
                if holder is not None and cb.copy_pages != NULL:
                    self._set_busy(1)
                    try:
                        with nogil:
                            status = cb.copy_pages(cb.ctx, self.copies_p, <uint32_t>n_copies)
                    finally:
                        self._set_busy(0)
                    if status != 0:
                        raise DecodeRoundError.Backend(RaggedBackendError.Failed(status))
                else:
                    fn = getattr(backend, "copy_pages", None)
                    if fn is None:
                        raise TypeError(f"this round needs {n_copies} page copies but backend "
                                        f"{type(backend).__name__} has no copy_pages")
                    self._set_busy(1)
                    try:
                        fn(self._copies_ro[:n_copies])
                    except Exception as exc:
                        raise DecodeRoundError.Backend(exc) from exc
                    finally:
                        self._set_busy(0)
            # the round itself holds the scheduler busy; hold the pool and store too
            self.pool.busy = 1
            self.prefixes.busy = 1
            try:
                receipt = self.requests._round(backend, self.items_p, self.items_cap,
                                               self._items_ro, self.table_p, self.table_cap,
                                               self._table_ro,
                                               self.outs_p, self.items_cap, self._outputs)
            finally:
                self.pool.busy = 0
                self.prefixes.busy = 0
        except BaseException:
            _undo(s, &self.pool.pool, self.undo, n_undo)
            raise
        self.pages_copied += n_copies
        self.pages_allocated += n_undo - n_copies
        self.rounds += 1
        n = (<tuple>receipt)[0]
        r = self._results[n]
        if r is None:
            v = self._outputs[:n]
            v.flags.writeable = False
            r = (receipt, v)
            self._results[n] = r
        return r

    def finish(self, request_id):
        """Release the request's pages and free its slot."""
        self.requests.finish(request_id, self.pool)

    # -- pass-throughs ---------------------------------------------------------------------------
    def evict(self, identity):
        self.prefixes.evict(identity, self.pool)

    def evict_lru(self):
        return self.prefixes.evict_lru(self.pool)

    def evict_unused_lru(self):
        """Evict the least recent entry whose pages only the store holds (so eviction frees
        them); None when there is none."""
        cdef Store *st = &self.prefixes.store
        cdef Pool *p = &self.pool.pool
        cdef int32_t e = st.lru_head
        cdef uint32_t k, m, occ
        cdef uint32_t *pg
        cdef bint unused
        cdef int rc
        self._check_idle()
        while e >= 0:
            pg = &st.pages[<size_t>e * st.max_pages]
            unused = True
            for k in range(st.entries[e].npages):
                occ = 0
                for m in range(st.entries[e].npages):
                    if pg[m] == pg[k]:
                        occ += 1
                if pg[k] >= p.num_blocks or p.refcount[pg[k]] != occ:
                    unused = False
                    break
            if unused:
                ident = _identity_from_entry(&st.entries[e])
                rc = store_evict_entry(st, e, p)
                if rc:
                    raise PrefixKvError.Pool(_pool_error(rc))
                return ident
            e = st.entries[e].next
        return None

    def block_table(self, request_id):
        cdef int32_t index = self.requests._find(request_id)
        cdef Table *t = &self.requests.s.slots[index].blocks
        out = np.empty(t.len, dtype=np.uint32)
        cdef uint32_t[::1] v = out
        if t.len:
            memcpy(&v[0], t.entries, t.len * sizeof(uint32_t))
        return out

    def token_count(self, request_id):
        return self.requests.s.slots[self.requests._find(request_id)].token_count

    def runnable(self):
        return self.requests.runnable()

    def __repr__(self):
        return (f"Scheduler(max_requests={self.max_requests}, num_blocks={self.num_blocks}, "
                f"page_tokens={self.page_tokens}, logical_pages={self.logical_pages}, "
                f"active={self.active_count}, free_pages={self.free_pages})")
