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
    """A 128-bit digest naming a prompt prefix (docs/DESIGN.md, "Prefix identity")."""
    cdef uint64_t hi
    cdef uint64_t lo

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
