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
