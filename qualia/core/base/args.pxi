# Argument checking: ints only (bools rejected), range checked, clear messages.

# Iterating these yields one int per byte (or a str per character): never a sequence of token or
# page ids, so they are rejected with TypeError wherever ids are expected.
cdef tuple _BYTES_LIKE = (str, bytes, bytearray, memoryview)


cdef uint64_t _int_slow(object v, str what, uint64_t maxval) except? 0xFFFFFFFFFFFFFFFF:
    if isinstance(v, bool) or isinstance(v, np.bool_):
        raise TypeError(f"{what} must be an integer, not bool")
    try:
        # an exact int: an int subclass's own comparisons never run (Python 3.9's index()
        # returns the subclass itself)
        iv = int.__index__(operator.index(v))
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


cdef object _group_size(object v, str what, uint32_t max_num_seqs):
    # n or beam_width: an integer (__index__, numpy integers too; not a bool) in
    # [1, max_num_seqs], returned as an exact int (an int subclass's own comparisons never run)
    if isinstance(v, bool) or isinstance(v, np.bool_):
        raise TypeError(f"{what} must be an int, not bool")
    try:
        iv = int.__index__(operator.index(v))   # exact int: never a subclass's own methods
    except TypeError:
        raise TypeError(f"{what} must be an int, not {type(v).__name__}") from None
    if not 1 <= iv <= max_num_seqs:
        raise ValueError(f"{what} must be in [1, max_num_seqs={max_num_seqs}], got {iv}")
    return iv


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
    # THE buffer validator: every caller buffer (scratch of execute_decode_round, runnable_into's
    # out, copy_pages' copies, HashBackend.execute_ragged's arguments) goes through here.
    # Acquire and check `obj` as a 1-D C-contiguous aligned buffer of one ABI dtype.  On success
    # the caller owns `view` (PyBuffer_Release); on failure nothing is held.  The success path
    # creates no Python object, so a steady-state decode round allocates nothing.
    cdef tuple spec = <tuple>_FORMATS[kind]
    cdef Py_ssize_t stride
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
        if view.ndim != 1 or view.shape == NULL:
            raise ValueError(f"{what} must be 1-D, got {view.ndim} dimensions")
        if view.suboffsets != NULL and view.suboffsets[0] >= 0:
            raise ValueError(f"{what} must be C-contiguous, got an indirect (suboffset) buffer")
        # NULL strides mean C-contiguous (ctypes exports its arrays that way)
        stride = view.strides[0] if view.strides != NULL else itemsize
        if view.shape[0] > 1 and stride != itemsize:
            raise ValueError(f"{what} must be C-contiguous (stride {itemsize}), "
                             f"got stride {stride}")
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
            "request_view": "REQUEST_VIEW", "copy_op": "COPY_OP", "u32": "uint32",
            "i32": "int32", "i64": "int64", "u64": "uint64", "f32": "float32"}[kind]


# -- memory handed to Python as numpy views ------------------------------------------------------

cdef class _Region:
    """Bytes that numpy views are made over: a PyMem block this object owns (the facade's
    scratch), or a held buffer export of a caller's object (the views a Python backend gets of
    execute_decode_round's scratch).  It exports itself read-only unless made writable, and a
    view's base is the region: numpy asks the base for a writable buffer when someone sets
    ``flags.writeable = True``, so a read-only view can never be made writable again."""
    cdef char *ptr
    cdef Py_ssize_t size
    cdef Py_ssize_t one
    cdef bint writable
    cdef bint owns
    cdef bint held
    cdef Py_buffer src
    cdef object keep        # a caller's exact ndarray whose data the region points into
    cdef Py_ssize_t nitems  # records of the caller's buffer (_region_acquire)

    def __cinit__(self):
        self.one = 1

    def __dealloc__(self):
        if self.owns:
            PyMem_Free(self.ptr)
            self.ptr = NULL
        if self.held:
            PyBuffer_Release(&self.src)
            self.held = False

    def __getbuffer__(self, Py_buffer *buffer, int flags):
        if (flags & PyBUF_WRITABLE) == PyBUF_WRITABLE and not self.writable:
            raise BufferError("this qualia buffer is read-only")
        buffer.buf = self.ptr
        buffer.obj = self
        buffer.len = self.size
        buffer.readonly = 0 if self.writable else 1
        buffer.itemsize = 1
        buffer.format = <char *>"B" if (flags & PyBUF_FORMAT) == PyBUF_FORMAT else NULL
        buffer.ndim = 1
        buffer.shape = &self.size if (flags & PyBUF_ND) == PyBUF_ND else NULL
        buffer.strides = &self.one if (flags & PyBUF_STRIDES) == PyBUF_STRIDES else NULL
        buffer.suboffsets = NULL
        buffer.internal = NULL

    def __releasebuffer__(self, Py_buffer *buffer):
        pass

    def __reduce__(self):
        raise TypeError("qualia scratch memory cannot be pickled")


cdef _Region _region_new(Py_ssize_t size, bint writable):
    """A zeroed PyMem block of `size` bytes (at least 16-byte aligned), owned by the region."""
    cdef _Region r = _Region.__new__(_Region)
    r.ptr = <char *>PyMem_Calloc(size if size > 0 else 1, 1)
    if r.ptr == NULL:
        raise MemoryError(f"cannot allocate {size} bytes of scratch")
    r.owns = True
    r.size = size
    r.writable = writable
    return r


cdef _Region _region_acquire(object obj, str what, str kind, object dtype, Py_ssize_t itemsize,
                             size_t align, bint export_writable):
    """A region over a caller's buffer, checked once (the caller's memory must be writable: the
    core writes it).  A plain ndarray of exactly `dtype` is kept by reference (numpy builds a
    format string on every buffer export of a structured dtype: a microsecond); anything else
    is acquired by the buffer validator and the export is held.  Either way the memory stays
    alive, and cannot be resized (short of numpy's unsafe ``refcheck=False``), for as long as a
    view of the region lives.  The region re-exports the bytes read-only unless
    `export_writable`."""
    cdef _Region r = _Region.__new__(_Region)
    cdef void *p
    cdef Py_ssize_t n
    if _fast_array(obj, dtype, align, True, &p, &n):
        r.keep = obj
        r.ptr = <char *>p
        r.nitems = n
    else:
        _get_buffer(obj, &r.src, what, kind, itemsize, align, True)
        r.held = True
        r.ptr = <char *>r.src.buf
        r.nitems = r.src.shape[0]
    r.size = r.nitems * itemsize
    r.writable = export_writable
    return r


cdef extern from *:
    """
    /* A 1-D ndarray of n records of `dtype` at `data`, with `base` as its base object. */
    static PyObject *qualia_np_view(PyObject *dtype, void *data, npy_intp n, int writable,
                                    PyObject *base)
    {
        PyObject *arr;
        int flags = NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED;
        if (writable) flags |= NPY_ARRAY_WRITEABLE;
        Py_INCREF(dtype); /* PyArray_NewFromDescr steals the descriptor */
        arr = PyArray_NewFromDescr(&PyArray_Type, (PyArray_Descr *)dtype, 1, &n, NULL, data,
                                   flags, NULL);
        if (arr == NULL) return NULL;
        Py_INCREF(base); /* PyArray_SetBaseObject steals the base, even on failure */
        if (PyArray_SetBaseObject((PyArrayObject *)arr, base) < 0) {
            Py_DECREF(arr);
            return NULL;
        }
        return arr;
    }
    """
    object qualia_np_view(object dtype, void *data, cnp.npy_intp n, int writable, object base)


cdef object _np_view(_Region r, object dtype, Py_ssize_t n, bint writable):
    """A 1-D ndarray of the first `n` records of `dtype` in `r`, based on `r`."""
    if n * (<cnp.dtype>dtype).itemsize > r.size:
        raise SystemError("qualia internal error: a view past the end of its region")
    if writable and not r.writable:
        raise SystemError("qualia internal error: a writable view of a read-only region")
    return qualia_np_view(dtype, r.ptr, n, writable, r)


# -- snapshots for read-only calls -------------------------------------------------------------
# Building a Python object allocates, and an allocation can run a GC callback or a finalizer that
# mutates the state being read.  So read-only calls copy what they read into C memory first
# (PyMem_Malloc runs no Python code), then build the result from the copy.

cdef list _list_of(const uint32_t *src, uint32_t n):
    cdef uint32_t i
    cdef uint32_t *tmp = <uint32_t *>PyMem_Malloc((n if n > 0 else 1) * sizeof(uint32_t))
    if tmp == NULL:
        raise MemoryError()
    if n:
        memcpy(tmp, src, n * sizeof(uint32_t))
    try:
        return [tmp[i] for i in range(n)]
    finally:
        PyMem_Free(tmp)


cdef object _array_of(const uint32_t *src, uint32_t n):
    cdef uint32_t *tmp = <uint32_t *>PyMem_Malloc((n if n > 0 else 1) * sizeof(uint32_t))
    cdef uint32_t[::1] v
    if tmp == NULL:
        raise MemoryError()
    if n:
        memcpy(tmp, src, n * sizeof(uint32_t))
    try:
        out = np.empty(n, dtype=np.uint32)
        if n:
            v = out
            memcpy(&v[0], tmp, n * sizeof(uint32_t))
        return out
    finally:
        PyMem_Free(tmp)
