# Backends: resolving a backend object into a C interface or a Python method, parsing what a
# Python backend returns, and the built-in hash backend (csrc/hash_backend.c).

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


cdef object _resolve_backend(object backend, qualia_backend **cb):
    # RESOLVE for a decode round: for a C backend, set *cb and return its capsule (which keeps
    # *cb alive); for a Python backend, leave *cb NULL and return its bound execute_ragged.
    # Runs user code (properties, __getattr__), so it is called before the round owns anything.
    cb[0] = NULL
    cap = _c_backend(backend, cb)
    if cap is not None:
        return cap
    fn = getattr(backend, "execute_ragged", None)
    if not callable(fn):
        raise TypeError(f"backend must be a C backend (__qualia_backend__ capsule) or have an "
                        f"execute_ragged(items, block_table, outputs) method, not "
                        f"{type(backend).__name__}")
    return fn


cdef int _run_backend(qualia_backend *cb, object fn,
                      qualia_batch_item *items, uint32_t n, uint32_t *table, uint32_t off,
                      qualia_batch_output *outs, object items_v, object table_v, object outs_v,
                      qualia_batch_receipt *rec) except -1:
    # Call the backend once, with the round's objects owned.  A C backend (cb != NULL) runs
    # without the GIL while the core touches nothing; a Python backend gets the views.
    cdef int32_t status = 0
    rec.batch_size = 0
    rec.backend_launches = 0
    if cb != NULL:
        with nogil:
            status = cb.execute_ragged(cb.ctx, items, n, table, off, outs, rec)
        if status != 0:
            raise DecodeRoundError.Backend(RaggedBackendError.Failed(status))
        return 0
    try:
        result = fn(items_v, table_v, outs_v)
    except BaseException as exc:
        if not isinstance(exc, Exception):
            raise  # KeyboardInterrupt and friends pass through untouched
        raise DecodeRoundError.Backend(exc) from exc
    _parse_receipt(result, rec)
    return 0


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


# -- the built-in hash backend --------------------------------------------------------------

cdef extern from "hash_backend.h" nogil:
    enum:
        QUALIA_FAULT_NONE
        QUALIA_FAULT_ERROR
        QUALIA_FAULT_BATCH_SIZE
        QUALIA_FAULT_LAUNCHES
        QUALIA_FAULT_SWAP

    ctypedef struct qualia_hash_backend:
        uint32_t vocab
        int32_t fault
        int32_t code
        uint64_t calls
        uint64_t items
        uint64_t pages_copied
        uint64_t copy_calls

    uint32_t qualia_hash_next_token(uint64_t request_id, uint32_t position,
                                         uint32_t token_id, uint32_t vocab)
    int32_t qualia_hash_execute_ragged(void *ctx, const qualia_batch_item *items,
                                            uint32_t n_items, const uint32_t *block_table,
                                            uint32_t n_table, qualia_batch_output *outputs,
                                            qualia_batch_receipt *receipt)
    int32_t qualia_hash_copy_pages(void *ctx, const qualia_copy_op *ops, uint32_t n_ops)


cdef dict _FAULTS = {None: QUALIA_FAULT_NONE, "error": QUALIA_FAULT_ERROR,
                     "batch_size": QUALIA_FAULT_BATCH_SIZE, "launches": QUALIA_FAULT_LAUNCHES,
                     "swap": QUALIA_FAULT_SWAP}


def hash_next_token(request_id, position, token_id, vocab=32000):
    """The hash backend's deterministic next token (docs/DESIGN.md, "Hash backend")."""
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
    cdef qualia_hash_backend *st
    cdef qualia_backend *iface
    cdef object _capsule

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
