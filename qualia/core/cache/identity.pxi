# Prefix identity: BLAKE2b-128 over u32-LE len(namespace), namespace, u32-LE tokens.

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
    # RESOLVE: a private bytes copy (a bytearray namespace changed later changes nothing)
    cdef bytes ns
    if isinstance(namespace, str):
        ns = (<str>namespace).encode("utf-8")
    elif isinstance(namespace, bytes):
        ns = <bytes>namespace
    else:
        try:
            ns = bytes(memoryview(namespace))
        except TypeError:
            raise TypeError(f"namespace must be bytes-like or str, "
                            f"not {type(namespace).__name__}") from None
    if len(ns) > U32_MAX:
        raise OverflowError("namespace longer than 2**32-1 bytes")
    return ns


cdef inline void _digest_hilo(const uint32_t *tokens, size_t n, bytes ns, uint64_t *hi,
                              uint64_t *lo) noexcept:
    # Hashed with the GIL held and no Python code running: nothing can change the tokens or
    # the state around them meanwhile (a 4k-token prompt takes ~50 us).
    cdef uint8_t d[16]
    qualia_prefix_digest(<const uint8_t *><char *>ns, <uint32_t>len(ns), tokens, n, d)
    hi[0] = _be64(d)
    lo[0] = _be64(d + 8)


cdef extern from *:
    """
    /* Convert the first n items of an exact list or tuple (n <= its length) into u32 token ids.
       Runs no Python code: each item must be an exact int, read without __index__.  Returns -1
       when all n were converted; otherwise the index of the first item that is not an exact
       int (*why = 1) or is out of [0, 2**32-1] (*why = 2). */
    #if PY_VERSION_HEX < 0x030B0000
    #include "longintrepr.h"
    #endif
    /* An exact int of at most one digit (every token id of a vocabulary under 2**30): its
       value, read from the object itself; 0 for any other int (read by the C API). */
    static inline int qualia_one_digit(PyObject *o, long long *v)
    {
    #if PY_VERSION_HEX >= 0x030C0000
        if (!PyUnstable_Long_IsCompact((PyLongObject *)o))
            return 0;
        *v = (long long)PyUnstable_Long_CompactValue((PyLongObject *)o);
        return 1;
    #else
        Py_ssize_t size = Py_SIZE(o);
        if (size == 0) { *v = 0; return 1; }
        if (size != 1) return 0;
        *v = (long long)((PyLongObject *)o)->ob_digit[0];
        return 1;
    #endif
    }

    static Py_ssize_t qualia_exact_u32s(PyObject *seq, uint32_t *dst, Py_ssize_t n, int *why)
    {
        PyObject **items = PySequence_Fast_ITEMS(seq);
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *o = items[i];
            int overflow = 0;
            long long v;
            if (!PyLong_CheckExact(o)) { *why = 1; return i; }
            if (!qualia_one_digit(o, &v))
                v = PyLong_AsLongLongAndOverflow(o, &overflow);
            if (overflow || v < 0 || v > 0xFFFFFFFFLL) { *why = 2; return i; }
            dst[i] = (uint32_t)v;
        }
        return -1;
    }
    """
    Py_ssize_t qualia_exact_u32s(object seq, uint32_t *dst, Py_ssize_t n, int *why)


cdef enum:
    TOKENS_INLINE = 256


cdef struct Toks:
    # resolved token ids: ptr[0 .. n), in the caller's array, in `local`, in `heap`, or in a
    # private array (see _tokens_resolve)
    const uint32_t *ptr
    Py_ssize_t n
    uint32_t *heap
    uint32_t local[TOKENS_INLINE]


cdef inline void _tokens_free(Toks *t) noexcept:
    if t.heap != NULL:
        PyMem_Free(t.heap)
        t.heap = NULL


cdef inline bint _u32_array(object obj, const uint32_t **ptr, Py_ssize_t *n) noexcept:
    # An exact 1-D ndarray of native uint32, C-contiguous and 4-byte aligned: hash it in place.
    if not cnp.PyArray_CheckExact(obj):
        return False
    cdef cnp.ndarray a = <cnp.ndarray>obj
    if (cnp.PyArray_NDIM(a) != 1 or cnp.PyArray_TYPE(a) != cnp.NPY_UINT32
            or not cnp.PyArray_ISNOTSWAPPED(a)
            or not (cnp.PyArray_FLAGS(a) & cnp.NPY_ARRAY_C_CONTIGUOUS)
            or (<uintptr_t>cnp.PyArray_DATA(a)) % sizeof(uint32_t) != 0):
        return False
    ptr[0] = <const uint32_t *>cnp.PyArray_DATA(a)
    n[0] = cnp.PyArray_DIMS(a)[0]
    return True


cdef int _too_long(Py_ssize_t n, Py_ssize_t limit, str limit_what) except -1:
    if n >= 0:
        raise ValueError(f"the prompt has {n} tokens, more than {limit_what} = {limit}")
    raise ValueError(f"the prompt has more than {limit} tokens ({limit_what} = {limit})")


cdef object _tokens_resolve(object tokens, Toks *t, Py_ssize_t limit, str limit_what):
    """RESOLVE token ids once (docs/DESIGN.md, "Ownership") into t.ptr[0 .. t.n):

    * an exact, aligned, C-contiguous, native uint32 ndarray: its own data, no copy;
    * an exact list or tuple of exact ints: converted in C into t's local or heap memory
      (no Python code can run while the list is read, so nothing can change it);
    * anything else (iterators, generators, map, other integer arrays, misaligned or strided
      arrays, objects with __index__): converted once into a private uint32 array.  User code
      runs here, before any state is touched; afterwards only the private copy is read, so a
      token whose __index__ shrinks the caller's list reads nothing out of bounds.

    str, bytes, bytearray and memoryview are rejected with TypeError.  With limit >= 0, more
    than `limit` tokens is a ValueError (an iterator is read at most limit + 1 items far).
    Returns the object that keeps t.ptr alive; the caller calls _tokens_free(t) when done (on an
    exception t holds nothing)."""
    cdef const uint32_t *p
    cdef Py_ssize_t n, i, bad
    cdef int why = 0
    cdef uint32_t *dst
    cdef uint32_t[::1] v
    t.heap = NULL
    t.ptr = t.local
    t.n = 0
    if _u32_array(tokens, &p, &n):
        if limit >= 0 and n > limit:
            _too_long(n, limit, limit_what)
        t.ptr = p
        t.n = n
        return tokens
    if type(tokens) is list or type(tokens) is tuple:
        # from here to the end of the conversion no Python code runs
        n = Py_SIZE(tokens)
        if limit >= 0 and n > limit:
            _too_long(n, limit, limit_what)
        if n <= TOKENS_INLINE:
            dst = t.local
        else:
            dst = <uint32_t *>PyMem_Malloc(n * sizeof(uint32_t))
            if dst == NULL:
                raise MemoryError()
            t.heap = dst
        bad = qualia_exact_u32s(tokens, dst, n, &why)
        if bad < 0:
            t.ptr = dst
            t.n = n
            return None
        _tokens_free(t)  # on every path below, t holds no memory if an exception is raised
        if why == 2:
            _u32(tokens[bad], "token id")  # raises the out-of-range error for that id
        # not all exact ints: take the general path below
    if isinstance(tokens, _BYTES_LIKE):
        raise TypeError(f"tokens must be a sequence of token ids, not {type(tokens).__name__}")
    if isinstance(tokens, np.ndarray):
        arr = np.asarray(tokens)   # a subclass read as an ndarray: none of its methods run
        if arr.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got {arr.ndim} dimensions")
        if arr.dtype.kind == "b" or arr.dtype.kind not in "iu":
            raise TypeError(f"tokens must be integers, got dtype {arr.dtype}")
        n = arr.shape[0]
        if limit >= 0 and n > limit:
            _too_long(n, limit, limit_what)
        if n and (arr.min() < 0 or arr.max() > U32_MAX):
            raise OverflowError("token ids must be in [0, 4294967295]")
        private = np.array(arr, dtype=np.uint32, copy=True, order="C", subok=False)
    else:
        try:
            it = iter(tokens)
        except TypeError:
            raise TypeError(f"tokens must be a sequence of token ids, "
                            f"not {type(tokens).__name__}") from None
        # a tuple: no __index__ run below can change what is read
        seq = tuple(_islice(it, limit + 1)) if limit >= 0 else tuple(it)
        n = len(seq)
        if limit >= 0 and n > limit:
            _too_long(-1, limit, limit_what)
        private = np.empty(n, dtype=np.uint32)
        if n:
            v = private
            for i in range(n):
                v[i] = _u32((<tuple>seq)[i], "token id")
    if not _u32_array(private, &p, &n):
        raise SystemError("qualia internal error: a private token array is not plain uint32")
    t.ptr = p
    t.n = n
    return private


cdef PrefixIdentity _identity_from_hilo(uint64_t hi, uint64_t lo):
    cdef PrefixIdentity ident = PrefixIdentity.__new__(PrefixIdentity)
    ident.hi = hi
    ident.lo = lo
    ident.frozen = True
    return ident


cdef PrefixIdentity _identity_of(const uint32_t *tokens, size_t n, bytes ns):
    cdef uint64_t hi, lo
    _digest_hilo(tokens, n, ns, &hi, &lo)  # before the allocation below can run any code
    return _identity_from_hilo(hi, lo)


cdef PrefixIdentity _identity_of_tokens(object tokens, bytes ns):
    cdef Toks t
    keep = _tokens_resolve(tokens, &t, -1, None)
    try:
        return _identity_of(t.ptr, t.n, ns)
    finally:
        _tokens_free(&t)


cdef class PrefixIdentity:
    """A 128-bit digest naming a prompt prefix (docs/DESIGN.md, "Prefix identity").  Immutable:
    ``__init__`` runs once; ``bytes(ident)`` is the digest, ``int(ident)`` its big-endian value."""
    cdef uint64_t hi
    cdef uint64_t lo
    cdef bint frozen

    def __init__(self, digest):
        cdef const uint8_t[::1] v
        if self.frozen:
            raise TypeError("PrefixIdentity is immutable: __init__ cannot be called again")
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
        self.frozen = True

    @classmethod
    def of_tokens(cls, tokens, namespace=b""):
        """BLAKE2b-128 of ``u32le(len(ns)) || ns || u32le(token) ...``."""
        return _identity_of_tokens(tokens, _namespace_bytes(namespace))

    @classmethod
    def fromhex(cls, s):
        """The identity of 32 hexadecimal digits (either case), as ``hex()`` writes them."""
        if not isinstance(s, str):
            raise TypeError(f"fromhex() takes a str, not {type(s).__name__}")
        if len(s) != 32:
            raise ValueError(f"a prefix identity is 32 hex digits, got {len(s)} characters")
        return cls(bytes.fromhex(s))

    @property
    def digest(self):
        """The 16-byte BLAKE2b digest (``bytes``)."""
        cdef uint8_t d[16]
        _put_be64(d, self.hi)
        _put_be64(d + 8, self.lo)
        return PyBytes_FromStringAndSize(<char *>d, 16)

    def __bytes__(self):
        return self.digest

    def hex(self):
        """The digest as 32 lower-case hexadecimal digits."""
        return f"{self.hi:016x}{self.lo:016x}"

    def __int__(self):
        return (int(self.hi) << 64) | int(self.lo)

    def __hash__(self):
        # the same value as qualia.twin.PrefixIdentity.__hash__ (64-bit platforms)
        cdef uint64_t h = self.hi ^ (self.lo * <uint64_t>0x9E3779B97F4A7C15)
        cdef Py_ssize_t r = <Py_ssize_t>(h >> 1)  # never -1 on 64-bit platforms
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
