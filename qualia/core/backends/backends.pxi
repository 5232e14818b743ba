# Backends: resolving a backend object into a C interface or a Python method, parsing what a
# Python backend returns, and the built-in hash backend (csrc/hash_backend.c).

cdef object _receipt(list cache, uint32_t n):
    r = cache[n]
    if r is None:
        r = RaggedBatchReceipt(n, 1)
        cache[n] = r
    return r


_ZERO_RECEIPT = RaggedBatchReceipt(0, 0)


cdef object _ABSENT = object()


cdef bint _declares(object obj, str name):
    # whether obj has `name` where the lookup finds it without running obj's code: in a class
    # dict of its type's MRO (where a property or any descriptor lives) or its own __dict__
    # (a class object: inspect's full static lookup, its bases and metaclass included)
    if isinstance(obj, type):
        import inspect
        return inspect.getattr_static(obj, name, _ABSENT) is not _ABSENT
    for klass in type(obj).__mro__:
        if name in (<type>klass).__dict__:
            return True
    try:
        d = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        return False
    return type(d) is dict and name in <dict>d


cdef object backend_attr(object backend, str name):
    # backend.name, or None when the backend has no such attribute.  An AttributeError raised
    # while getting one that it has (a property's, a descriptor's) is raised, not taken for
    # "absent": a C interface whose property fails is an error, never a silent fall back to
    # the Python method.  (A __getattr__ that raises AttributeError means absent.)  An absent
    # attribute costs a lookup and a scan of the type's MRO dicts, as a decode round of a
    # Python backend asks for two (__qualia_backend__, copy_pages) every call.
    value = getattr(backend, name, _ABSENT)
    if value is not _ABSENT:
        return value
    if _declares(backend, name):
        return getattr(backend, name)      # the attribute's own error, raised again
    return None


cdef object _c_backend(object backend, qualia_backend **out, qualia_backend *store):
    # A C backend is a PyCapsule named QUALIA_BACKEND_CAPSULE_NAME, handed over directly or as
    # the backend's __qualia_backend__ attribute (or the result of calling it).
    cdef const char *name
    cdef qualia_backend *b
    if PyCapsule_CheckExact(backend):
        cap = backend
    else:
        cap = backend_attr(backend, "__qualia_backend__")
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
    # the core reads a copy, taken with the checks: a backend that changes its own struct later
    # (a NULL function pointer) changes nothing the core calls
    store[0] = b[0]
    out[0] = store
    return cap


cdef object _resolve_backend(object backend, qualia_backend **cb, qualia_backend *store):
    # RESOLVE for a decode round: for a C backend, copy its checked struct into *store, point
    # *cb at the copy and return its capsule (which keeps the backend's context alive); for a
    # Python backend, leave *cb NULL and return its bound execute_ragged.
    # Runs user code (properties, __getattr__), so it is called before the round owns anything.
    cb[0] = NULL
    cap = _c_backend(backend, cb, store)
    if cap is not None:
        return cap
    fn = backend_attr(backend, "execute_ragged")
    if not callable(fn):
        raise TypeError(f"backend must be a C backend (__qualia_backend__ capsule) or have an "
                        f"execute_ragged(items, block_table, outputs) method, not "
                        f"{type(backend).__name__}")
    return fn


cdef object _c_step_backend(object backend, qualia_step_backend **out,
                            qualia_step_backend *store):
    # A C step backend is a PyCapsule named QUALIA_STEP_CAPSULE_NAME, handed over directly or as
    # the backend's __qualia_step_backend__ attribute (or the result of calling it).  The same
    # checks as the decode-round interface: name, ABI version, struct size, function pointer.
    cdef const char *name
    cdef qualia_step_backend *b
    if PyCapsule_CheckExact(backend):
        cap = backend
    else:
        cap = backend_attr(backend, "__qualia_step_backend__")
        if cap is None:
            return None
        if not PyCapsule_CheckExact(cap) and callable(cap):
            cap = cap()
        if not PyCapsule_CheckExact(cap):
            raise BackendAbiError(None, f"__qualia_step_backend__ must be a PyCapsule named "
                                        f"{STEP_CAPSULE_NAME!r}, got {type(cap).__name__}")
    name = PyCapsule_GetName(cap)
    if name == NULL or strcmp(name, QUALIA_STEP_CAPSULE_NAME) != 0:
        got = None if name == NULL else (<bytes>name).decode("utf-8", "replace")
        raise BackendAbiError(None, f"step backend capsule is named {got!r}, "
                                    f"expected {STEP_CAPSULE_NAME!r}")
    b = <qualia_step_backend *>PyCapsule_GetPointer(cap, name)
    if b == NULL:
        raise BackendAbiError(None, "step backend capsule holds a NULL pointer")
    if b.abi_version != QUALIA_STEP_ABI_VERSION:
        raise BackendAbiError(None, f"step backend ABI version {b.abi_version}, expected "
                                    f"{QUALIA_STEP_ABI_VERSION}")
    if b.struct_size < sizeof(qualia_step_backend):
        raise BackendAbiError(None, f"step backend struct_size {b.struct_size}, expected at "
                                    f"least {sizeof(qualia_step_backend)}")
    if b.execute_step == NULL:
        raise BackendAbiError(None, "step backend execute_step pointer is NULL")
    store[0] = b[0]     # the copy the core reads (as _c_backend's)
    out[0] = store
    return cap


cdef object _resolve_step_backend(object backend, qualia_step_backend **cb,
                                  qualia_step_backend *store):
    # RESOLVE for an engine step: for a C step backend, copy its checked struct into *store,
    # point *cb at the copy and return its capsule (which keeps the backend's context alive);
    # for a Python backend, leave *cb NULL and return its bound execute_step.
    # Runs user code (properties, __getattr__), so it is called before a step owns anything.
    cb[0] = NULL
    cap = _c_step_backend(backend, cb, store)
    if cap is not None:
        return cap
    fn = backend_attr(backend, "execute_step")
    if not callable(fn):
        raise TypeError(f"backend must be a C step backend (__qualia_step_backend__ capsule) or "
                        f"have an execute_step(plan) method, not {type(backend).__name__}")
    return fn


# -- lowering a Python step plan into a qualia_step_plan --------------------------------------

cdef class _LoweredPlan:
    """A qualia_step_plan over the arrays of a Python plan object, with every buffer held (and
    checked: dtype, 1-D, C-contiguous, lengths consistent, indices in range, and each request's
    positions, slots and CSR pages as the step ABI states them) for as long as this object
    lives.  Lets Python-loop users (and tests) call C step code over any plan."""
    cdef qualia_step_plan plan
    cdef list held
    cdef Py_buffer table
    cdef bint table_held
    cdef void *priv         # the private copies the plan points into (PyMem)

    def __dealloc__(self):
        if self.table_held:
            PyBuffer_Release(&self.table)
            self.table_held = False
        PyMem_Free(self.priv)
        self.priv = NULL


cdef tuple _PLAN_KINDS = (("request_ids", "u64"), ("query_start_loc", "i32"),
                          ("seq_lens", "i32"), ("input_ids", "u32"), ("positions", "i32"),
                          ("slot_mapping", "i64"), ("logits_indices", "i32"),
                          ("sampled_request_ids", "u64"), ("block_table_rows", "i32"),
                          ("changed_rows", "i32"), ("kv_indptr", "i32"), ("kv_indices", "i32"),
                          ("kv_last_page_len", "i32"), ("copies", "copy_op"),
                          ("new_request_ids", "u64"), ("preempted_request_ids", "u64"),
                          ("finished_request_ids", "u64"), ("fork_child_ids", "u64"),
                          ("fork_parent_ids", "u64"))
cdef frozenset _PLAN_OPTIONAL = frozenset({"copies", "new_request_ids", "preempted_request_ids",
                                           "finished_request_ids", "fork_child_ids",
                                           "fork_parent_ids"})
cdef dict _KIND_SIZE = {"u64": 8, "i64": 8, "i32": 4, "u32": 4, "copy_op": sizeof(qualia_copy_op)}


cdef _Buffer _plan_array(object plan, str name, str kind):
    arr = getattr(plan, name, None)
    if arr is None:
        if name not in _PLAN_OPTIONAL:
            raise TypeError(f"plan has no {name!r} array")
        arr = np.zeros(0, COPY_OP if kind == "copy_op" else np.uint64)
    cdef Py_ssize_t size = _KIND_SIZE[kind]
    return _acquire(arr, f"plan.{name}", kind, size, size if kind != "copy_op" else
                    QUALIA_ALIGN_COPY, False)


cdef object _plan_count(object plan, str name):
    # a count the plan must have (num_topk alone defaults to 0: no beam rows)
    value = getattr(plan, name, None)
    if value is None:
        raise TypeError(f"plan has no {name!r}")
    return value


cdef int _check_prefix_sums(const int32_t *a, Py_ssize_t n1, int64_t total, str what) except -1:
    # a[0] == 0, non-decreasing, a[n1 - 1] == total
    cdef Py_ssize_t i
    if a[0] != 0 or a[n1 - 1] != total:
        raise ValueError(f"{what} must run from 0 to {total}")
    for i in range(1, n1):
        if a[i] < a[i - 1]:
            raise ValueError(f"{what} must be non-decreasing")
    return 0


cdef int _check_indices(const int32_t *a, Py_ssize_t n, int64_t limit, str what) except -1:
    cdef Py_ssize_t i
    for i in range(n):
        if a[i] < 0 or a[i] >= limit:
            raise ValueError(f"{what}[{i}] = {a[i]} is outside [0, {limit})")
    return 0


cdef int _check_layout(const qualia_step_plan *p) except -1:
    # what the step ABI states of each request (qualia.h), on the private copies: its chunk
    # (at least one token) ends its context, so its positions run up to seq_lens - 1; each
    # token's slot is its page's (from its block-table row) times page_tokens plus its offset;
    # the CSR form lists the row's pages covering seq_lens, the last holding 1..page_tokens
    cdef uint32_t i, k, pt = p.page_tokens
    cdef int64_t t, q0, chunk, start, pos, want, npages, last
    cdef const int32_t *row
    if pt == 0:
        raise ValueError("plan.page_tokens must be at least 1")
    if <uint64_t>p.num_prefill_tokens + p.num_decode_tokens != p.num_tokens:
        raise ValueError(f"plan.num_prefill_tokens ({p.num_prefill_tokens}) + "
                         f"plan.num_decode_tokens ({p.num_decode_tokens}) must be the plan's "
                         f"{p.num_tokens} tokens")
    for i in range(p.num_requests):
        q0 = p.query_start_loc[i]
        chunk = p.query_start_loc[i + 1] - q0
        start = <int64_t>p.seq_lens[i] - chunk
        if chunk < 1 or start < 0:
            raise ValueError(f"plan request {i} has seq_lens {p.seq_lens[i]} and a chunk of "
                             f"{chunk} tokens: a chunk holds at least 1 token and ends the "
                             f"request's context")
        row = p.block_table + <size_t>p.block_table_rows[i] * p.block_table_row_stride
        npages = (<int64_t>p.seq_lens[i] + pt - 1) // pt
        if npages > p.block_table_num_cols:
            raise ValueError(f"plan request {i}'s {p.seq_lens[i]} tokens take {npages} pages, "
                             f"its block-table row has {p.block_table_num_cols}")
        for k in range(<uint32_t>npages):
            if row[k] < 0:
                raise ValueError(f"plan request {i}'s block-table row has no page {k} (of "
                                 f"the {npages} its {p.seq_lens[i]} tokens take)")
        for t in range(q0, q0 + chunk):
            pos = start + t - q0
            if p.positions[t] != pos:
                raise ValueError(f"plan.positions[{t}] = {p.positions[t]}, expected {pos}: "
                                 f"request {i}'s chunk ends its context")
            want = <int64_t>row[pos // pt] * pt + pos % pt
            if p.slot_mapping[t] != want:
                raise ValueError(f"plan.slot_mapping[{t}] = {p.slot_mapping[t]}, expected "
                                 f"{want} (page {row[pos // pt]}, offset {pos % pt})")
        if p.kv_indptr[i + 1] - p.kv_indptr[i] != npages:
            raise ValueError(f"plan.kv_indptr gives request {i} "
                             f"{p.kv_indptr[i + 1] - p.kv_indptr[i]} pages, its "
                             f"{p.seq_lens[i]} tokens take {npages}")
        for k in range(<uint32_t>npages):
            if p.kv_indices[p.kv_indptr[i] + k] != row[k]:
                raise ValueError(f"plan.kv_indices[{p.kv_indptr[i] + k}] = "
                                 f"{p.kv_indices[p.kv_indptr[i] + k]}, request {i}'s page {k} "
                                 f"is {row[k]}")
        last = <int64_t>p.seq_lens[i] - (npages - 1) * pt
        if p.kv_last_page_len[i] != last:
            raise ValueError(f"plan.kv_last_page_len[{i}] = {p.kv_last_page_len[i]}, expected "
                             f"{last} (1..{pt}: the tokens on request {i}'s last page)")
    return 0


cdef _LoweredPlan _lower_step_plan(object plan):
    # RESOLVE: read every array of `plan` (attributes named as StepPlan's), copy them into
    # private memory, check the copies and fill a qualia_step_plan pointing into them.  Runs
    # user code (attribute access, buffer exports) before the copies only.
    cdef _LoweredPlan lp = _LoweredPlan.__new__(_LoweredPlan)
    cdef dict bufs = {}
    cdef _Buffer b
    # the scalars first: their __index__ may write the plan's arrays, which are checked below
    # and must not change after (no user code runs from the first check on)
    cdef uint32_t num_prefill = _u32(_plan_count(plan, "num_prefill_tokens"),
                                     "plan.num_prefill_tokens")
    cdef uint32_t num_decode = _u32(_plan_count(plan, "num_decode_tokens"),
                                    "plan.num_decode_tokens")
    cdef uint32_t num_topk = _u32(getattr(plan, "num_topk", 0), "plan.num_topk")
    cdef uint32_t pt = _u32(_plan_count(plan, "page_tokens"), "plan.page_tokens")
    lp.held = []
    for name, kind in _PLAN_KINDS:
        b = _plan_array(plan, name, kind)
        bufs[name] = b
        lp.held.append(b)
    table = getattr(plan, "block_table", None)
    if table is None:
        raise TypeError("plan has no 'block_table' array")
    cdef qualia_step_plan *p = &lp.plan
    memset(p, 0, sizeof(qualia_step_plan))
    p.struct_size = sizeof(qualia_step_plan)
    p.page_tokens = pt
    # the 2-D block table: int32, rows of contiguous entries, row stride a whole number of entries
    try:
        PyObject_GetBuffer(table, &lp.table, PyBUF_STRIDES | PyBUF_FORMAT)
    except (TypeError, BufferError, ValueError) as exc:
        raise TypeError(f"plan.block_table must be a 2-D int32 numpy array, "
                        f"got {type(table).__name__}") from exc
    lp.table_held = True
    fmt = (<bytes>lp.table.format).decode("ascii", "replace") if lp.table.format != NULL else "B"
    # the exact spelling numpy exports first (no normalizing, which costs a regex a step)
    if ((fmt != _FORMATS["i32"][0] and _normalize_format(fmt) != _FORMATS["i32"][1])
            or lp.table.itemsize != 4):
        raise TypeError(f"plan.block_table must have dtype int32, got format {fmt!r}")
    if lp.table.ndim != 2:
        raise ValueError(f"plan.block_table must be 2-D, got {lp.table.ndim} dimensions")
    if lp.table.suboffsets != NULL and lp.table.suboffsets[0] >= 0:
        raise ValueError("plan.block_table must not be an indirect buffer")
    cdef Py_ssize_t rows = lp.table.shape[0], cols = lp.table.shape[1]
    cdef Py_ssize_t s0 = lp.table.strides[0] if lp.table.strides != NULL else 4 * cols
    cdef Py_ssize_t s1 = lp.table.strides[1] if lp.table.strides != NULL else 4
    if (cols > 1 and s1 != 4) or (rows > 1 and (s0 % 4 != 0 or s0 < 4 * cols)):
        raise ValueError("plan.block_table rows must be contiguous int32 entries with a row "
                         "stride of at least one row")
    if rows * cols > 0 and (<uintptr_t>lp.table.buf) % 4 != 0:
        raise ValueError("plan.block_table is misaligned")
    if rows > U32_MAX or cols > U32_MAX or s0 // 4 > U32_MAX:
        raise OverflowError("plan.block_table is too large")
    # PRIVATE COPIES, before any check: every array (and the block table's rows) copied into
    # C memory no Python code can reach, which is what is checked and what the backend reads.
    # A gc callback, or an output array that shares memory with a plan array (the caller's
    # sampled_out is written before the backend runs), may change the plan's own arrays later.
    cdef size_t total = 0, off = 0, nbytes
    cdef char *base
    cdef Py_ssize_t r
    for name, kind in _PLAN_KINDS:
        total += ((<size_t>(<_Buffer>bufs[name]).length * <size_t>_KIND_SIZE[kind] + 63)
                  & ~(<size_t>63))
    total += (<size_t>rows * <size_t>cols * 4 + 63) & ~(<size_t>63)
    lp.priv = PyMem_Malloc(total + 64)
    if lp.priv == NULL:
        raise MemoryError()
    base = <char *>((<uintptr_t>lp.priv + 63) & ~(<uintptr_t>63))
    for name, kind in _PLAN_KINDS:
        b = <_Buffer>bufs[name]
        nbytes = <size_t>b.length * <size_t>_KIND_SIZE[kind]
        if nbytes:
            memcpy(base + off, b.ptr, nbytes)
        b.ptr = base + off
        off += (nbytes + 63) & ~(<size_t>63)
    for r in range(rows):
        memcpy(base + off + <size_t>r * cols * 4, <char *>lp.table.buf + r * s0,
               <size_t>cols * 4)
    p.block_table = <const int32_t *>(base + off)
    p.block_table_num_rows = <uint32_t>rows
    p.block_table_num_cols = <uint32_t>cols
    p.block_table_row_stride = <uint32_t>cols
    cdef Py_ssize_t n = (<_Buffer>bufs["request_ids"]).length
    cdef Py_ssize_t T = (<_Buffer>bufs["input_ids"]).length
    cdef Py_ssize_t m = (<_Buffer>bufs["logits_indices"]).length
    if n > U32_MAX or T > 0x7FFFFFFF or m > U32_MAX:
        raise OverflowError("plan is too large for the step ABI")
    for name, want in (("query_start_loc", n + 1), ("seq_lens", n), ("positions", T),
                       ("slot_mapping", T), ("sampled_request_ids", m),
                       ("block_table_rows", n), ("kv_indptr", n + 1),
                       ("kv_last_page_len", n)):
        if (<_Buffer>bufs[name]).length != want:
            raise ValueError(f"plan.{name} has {(<_Buffer>bufs[name]).length} entries, "
                             f"expected {want}")
    cdef Py_ssize_t nkv = (<_Buffer>bufs["kv_indices"]).length
    _check_prefix_sums(<const int32_t *>(<_Buffer>bufs["query_start_loc"]).ptr, n + 1, T,
                       "plan.query_start_loc")
    _check_prefix_sums(<const int32_t *>(<_Buffer>bufs["kv_indptr"]).ptr, n + 1, nkv,
                       "plan.kv_indptr")
    _check_indices(<const int32_t *>(<_Buffer>bufs["logits_indices"]).ptr, m, T,
                   "plan.logits_indices")
    _check_indices(<const int32_t *>(<_Buffer>bufs["block_table_rows"]).ptr, n, rows,
                   "plan.block_table_rows")
    _check_indices(<const int32_t *>(<_Buffer>bufs["changed_rows"]).ptr,
                   (<_Buffer>bufs["changed_rows"]).length, rows, "plan.changed_rows")
    p.num_requests = <uint32_t>n
    p.num_tokens = <uint32_t>T
    p.num_sampled = <uint32_t>m
    p.num_kv_indices = <uint32_t>nkv
    p.num_prefill_tokens = num_prefill
    p.num_decode_tokens = num_decode
    p.num_changed_rows = <uint32_t>(<_Buffer>bufs["changed_rows"]).length
    p.num_copies = <uint32_t>(<_Buffer>bufs["copies"]).length
    p.num_new = <uint32_t>(<_Buffer>bufs["new_request_ids"]).length
    p.num_preempted = <uint32_t>(<_Buffer>bufs["preempted_request_ids"]).length
    p.num_finished = <uint32_t>(<_Buffer>bufs["finished_request_ids"]).length
    p.request_ids = <const uint64_t *>(<_Buffer>bufs["request_ids"]).ptr
    p.query_start_loc = <const int32_t *>(<_Buffer>bufs["query_start_loc"]).ptr
    p.seq_lens = <const int32_t *>(<_Buffer>bufs["seq_lens"]).ptr
    p.input_ids = <const uint32_t *>(<_Buffer>bufs["input_ids"]).ptr
    p.positions = <const int32_t *>(<_Buffer>bufs["positions"]).ptr
    p.slot_mapping = <const int64_t *>(<_Buffer>bufs["slot_mapping"]).ptr
    p.logits_indices = <const int32_t *>(<_Buffer>bufs["logits_indices"]).ptr
    p.sampled_request_ids = <const uint64_t *>(<_Buffer>bufs["sampled_request_ids"]).ptr
    p.block_table_rows = <const int32_t *>(<_Buffer>bufs["block_table_rows"]).ptr
    p.changed_rows = <const int32_t *>(<_Buffer>bufs["changed_rows"]).ptr
    p.kv_indptr = <const int32_t *>(<_Buffer>bufs["kv_indptr"]).ptr
    p.kv_indices = <const int32_t *>(<_Buffer>bufs["kv_indices"]).ptr
    p.kv_last_page_len = <const int32_t *>(<_Buffer>bufs["kv_last_page_len"]).ptr
    p.copies = <const qualia_copy_op *>(<_Buffer>bufs["copies"]).ptr
    p.new_request_ids = <const uint64_t *>(<_Buffer>bufs["new_request_ids"]).ptr
    p.preempted_request_ids = <const uint64_t *>(<_Buffer>bufs["preempted_request_ids"]).ptr
    p.finished_request_ids = <const uint64_t *>(<_Buffer>bufs["finished_request_ids"]).ptr
    if (<_Buffer>bufs["fork_child_ids"]).length != (<_Buffer>bufs["fork_parent_ids"]).length:
        raise ValueError("plan.fork_child_ids and plan.fork_parent_ids differ in length")
    p.num_forks = <uint32_t>(<_Buffer>bufs["fork_child_ids"]).length
    p.fork_child_ids = <const uint64_t *>(<_Buffer>bufs["fork_child_ids"]).ptr
    p.fork_parent_ids = <const uint64_t *>(<_Buffer>bufs["fork_parent_ids"]).ptr
    # beam rows: the caller points topk_ids_out / topk_logprobs_out at [m, num_topk] buffers
    p.num_topk = num_topk
    _check_layout(p)
    return lp


cdef tuple _step_outputs(uint32_t m, object sampled_out, object logprobs_out, bint want_logprobs):
    # The caller's output arrays (checked: uint32 / float32, 1-D, writable, >= m entries), or
    # fresh ones.  Returns (sampled, logprobs or None, _Buffer, _Buffer or None).
    if sampled_out is None:
        sampled_out = np.empty(m, np.uint32)
    cdef _Buffer bs = _acquire(sampled_out, "sampled_out", "u32", 4, 4, True)
    if bs.length < m:
        raise ValueError(f"sampled_out has {bs.length} entries, the plan samples {m}")
    cdef _Buffer bl = None
    if logprobs_out is None and want_logprobs:
        logprobs_out = np.empty(m, np.float32)
    if logprobs_out is not None:
        bl = _acquire(logprobs_out, "logprobs_out", "f32", 4, 4, True)
        if bl.length < m:
            raise ValueError(f"logprobs_out has {bl.length} entries, the plan samples {m}")
    return sampled_out, logprobs_out, bs, bl


def _call_step_backend(backend, plan, sampled_out=None, logprobs_out=None, logprobs=False):
    """Run one step of a C step backend (capsule, or an object exposing
    ``__qualia_step_backend__``) over a Python plan object, as the scheduler calls it: resolve and
    check the capsule, lower the plan, call ``copy_pages`` (when set and the plan has copies),
    then ``execute_step`` without the GIL.  Returns ``sampled`` or ``(sampled, logprobs)`` when
    ``logprobs`` (logprobs stay NaN unless the backend declares QUALIA_STEP_WRITES_LOGPROBS).
    A nonzero status raises ``RaggedBackendError.Failed(status)``; a sampled row the backend
    left unwritten (each is set to 2**32-1, no token id, before the call) raises ``ValueError``.
    For tests and Python loops that drive C step backends; not a hot path."""
    cdef qualia_step_backend *cb = NULL
    cdef qualia_step_backend store
    cap = _c_step_backend(backend, &cb, &store)
    if cap is None:
        raise TypeError(f"backend must be a C step backend (__qualia_step_backend__ capsule), "
                        f"not {type(backend).__name__}")
    want_logprobs = bool(logprobs)   # user code: before the plan is lowered and checked
    cdef _LoweredPlan lp = _lower_step_plan(plan)
    lp.plan.num_topk = 0    # no candidates asked for here
    out, lps, bs, bl = _step_outputs(lp.plan.num_sampled, sampled_out, logprobs_out,
                                     want_logprobs)
    cdef float *lptr = NULL
    cdef float nan = float("nan")
    cdef Py_ssize_t i
    if bl is not None:
        lptr = <float *>(<_Buffer>bl).ptr
        if not (cb.flags & QUALIA_STEP_WRITES_LOGPROBS):
            lptr = NULL  # the backend does not produce them: it gets NULL, the caller NaN
        for i in range(lp.plan.num_sampled):
            (<float *>(<_Buffer>bl).ptr)[i] = nan
    cdef int32_t status = 0
    cdef uint32_t *sp = <uint32_t *>(<_Buffer>bs).ptr
    for i in range(lp.plan.num_sampled):
        sp[i] = U32_MAX
    with nogil:
        if cb.copy_pages != NULL and lp.plan.num_copies > 0:
            status = cb.copy_pages(cb.ctx, lp.plan.copies, lp.plan.num_copies)
        if status == 0:
            status = cb.execute_step(cb.ctx, &lp.plan, <uint32_t *>(<_Buffer>bs).ptr, lptr)
    if status != 0:
        raise RaggedBackendError.Failed(status)
    for i in range(lp.plan.num_sampled):
        if sp[i] == U32_MAX:
            raise ValueError(f"the step backend returned 0 without writing sampled row {i} (or "
                             f"wrote 4294967295, which is no token id)")
    return (out, lps) if lps is not None else out


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
            result = np.asarray(result).tolist()   # no subclass method runs
        if (not isinstance(result, _AbcSequence) or isinstance(result, (str, bytes, bytearray))
                or len(result) != 2):
            raise TypeError("not a 2-sequence")
        pair = tuple(result)   # what is read below: no __index__ can change it
        if len(pair) != 2:
            raise TypeError("not a 2-sequence")
        rec.batch_size = _u32(pair[0], "receipt batch_size")
        rec.backend_launches = _u32(pair[1], "receipt backend_launches")
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
        uint64_t step_calls
        uint64_t sampled

    int32_t QUALIA_HASH_BAD_PLAN
    float qualia_hash_logprob(uint64_t request_id, uint32_t position, uint32_t token_id)
    int32_t qualia_hash_execute_step(void *ctx, const qualia_step_plan *plan,
                                     uint32_t *sampled_out, float *logprobs_out)
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


def hash_logprob(request_id, position, token_id):
    """The hash backend's deterministic stand-in log-probability of the token it samples for
    (request_id, position, token_id): -(low 16 bits of the mixed hash word) / 4096, in (-16, 0]
    (docs/DESIGN.md, "Hash backend")."""
    return qualia_hash_logprob(_u64(request_id, "request_id"), _u32(position, "position"),
                               _u32(token_id, "token_id"))


cdef struct _RefBlock:
    qualia_backend iface
    qualia_step_backend step_iface
    qualia_hash_backend state


cdef void _free_ref_block(object cap) noexcept:
    PyMem_Free(PyCapsule_GetPointer(cap, QUALIA_BACKEND_CAPSULE_NAME))


cdef void _free_step_capsule(object cap) noexcept:
    # The step capsule points into the block the round capsule owns; it holds a reference to
    # that capsule (its context), so the block outlives every capsule that points into it.
    cdef void *ctx = PyCapsule_GetContext(cap)
    if ctx != NULL:
        Py_DECREF(<object>ctx)


cdef class HashBackend:
    """A deterministic decode and step backend in C: next token = hash(request_id, position,
    token_id) (docs/DESIGN.md, "Hash backend").  It stands in for a model in tests, benchmarks
    and examples.

    Exposes ``__qualia_backend__`` (the decode-round capsule) and ``__qualia_step_backend__``
    (the step capsule), which the scheduler calls without the GIL, and the same computations as
    Python methods ``execute_ragged``/``execute_step``/``copy_pages``.  ``fault`` injects a
    failure: ``"error"`` (returns ``code``, rounds and steps), ``"batch_size"``, ``"launches"``
    or ``"swap"`` (rounds only).
    """
    cdef qualia_hash_backend *st
    cdef qualia_backend *iface
    cdef qualia_step_backend *step_iface
    cdef object _capsule
    cdef object _step_capsule

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
        self.step_iface = &blk.step_iface
        self.step_iface.abi_version = QUALIA_STEP_ABI_VERSION
        self.step_iface.struct_size = sizeof(qualia_step_backend)
        # it reads a plan's sampled rows only: no CSR form needed
        self.step_iface.flags = (QUALIA_STEP_WRITES_LOGPROBS | QUALIA_STEP_WRITES_TOPK
                                 | QUALIA_STEP_NO_CSR)
        self.step_iface.ctx = self.st
        self.step_iface.execute_step = qualia_hash_execute_step
        self.step_iface.copy_pages = qualia_hash_copy_pages
        step_cap = PyCapsule_New(self.step_iface, QUALIA_STEP_CAPSULE_NAME, _free_step_capsule)
        PyCapsule_SetContext(step_cap, <void *>self._capsule)
        Py_INCREF(self._capsule)
        self._step_capsule = step_cap
        self.fault = fault
        self.code = code

    @property
    def __qualia_backend__(self):
        return self._capsule

    @property
    def __qualia_step_backend__(self):
        return self._step_capsule

    @property
    def vocab(self):
        """The vocabulary size: every token it returns is below it."""
        return self.st.vocab

    @property
    def fault(self):
        """The failure it injects: None, ``"error"`` (returns ``code``, in rounds and steps),
        ``"batch_size"``, ``"launches"`` or ``"swap"`` (rounds only). Settable."""
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
        """The nonzero i32 status the ``"error"`` fault returns. Settable."""
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
        """Decode rounds executed."""
        return self.st.calls

    @property
    def items(self):
        """Batch items of every decode round executed."""
        return self.st.items

    @property
    def pages_copied(self):
        """Pages copied by ``copy_pages``, for rounds and steps alike."""
        return self.st.pages_copied

    @property
    def copy_calls(self):
        """Calls of ``copy_pages``."""
        return self.st.copy_calls

    @property
    def step_calls(self):
        """Engine steps executed."""
        return self.st.step_calls

    @property
    def sampled(self):
        """Rows sampled over every step executed."""
        return self.st.sampled

    def execute_step(self, plan, sampled_out=None, logprobs_out=None):
        """One engine step over ``plan`` (a StepPlan, or any object with its arrays): for each
        sampled row r, the next token of (``sampled_request_ids[r]``, the position and input
        token of flat row ``logits_indices[r]``), by the same C function the scheduler calls
        through ``__qualia_step_backend__``.  Returns ``sampled_out`` (a new uint32 array of m
        ids when None); ``logprobs_out`` (float32, optional) receives ``hash_logprob`` of each
        row.  The plan's copies are not performed here (call ``copy_pages``).  Candidates for
        beam rows are not written (see ``execute_step_topk``)."""
        cdef _LoweredPlan lp = _lower_step_plan(plan)
        lp.plan.num_topk = 0
        out, lps, bs, bl = _step_outputs(lp.plan.num_sampled, sampled_out, logprobs_out, False)
        cdef float *lptr = NULL if bl is None else <float *>(<_Buffer>bl).ptr
        cdef int32_t rc = qualia_hash_execute_step(self.st, &lp.plan,
                                                   <uint32_t *>(<_Buffer>bs).ptr, lptr)
        if rc:
            raise RaggedBackendError.Failed(rc)
        return out

    def execute_step_topk(self, plan):
        """``execute_step`` that also writes each row's ``plan.num_topk = k`` candidates (the
        rule of docs/DESIGN.md, "Hash backend"): returns ``(sampled, topk_ids, topk_logprobs)``
        with ``[m, k]`` uint32 / float32 candidate arrays, best first -- what
        ``Scheduler.update`` takes for a plan with beam rows (``k`` may be 0)."""
        cdef _LoweredPlan lp = _lower_step_plan(plan)
        if lp.plan.num_topk > self.st.vocab:
            raise ValueError(f"plan.num_topk={lp.plan.num_topk} exceeds the backend's vocabulary "
                             f"({self.st.vocab}): its candidates would repeat")
        out, lps, bs, bl = _step_outputs(lp.plan.num_sampled, None, None, False)
        cdef uint32_t[:, ::1] tv
        cdef float[:, ::1] lv
        tids = np.zeros((lp.plan.num_sampled, lp.plan.num_topk), np.uint32)
        tlps = np.zeros((lp.plan.num_sampled, lp.plan.num_topk), np.float32)
        if lp.plan.num_sampled and lp.plan.num_topk:
            tv = tids
            lv = tlps
            lp.plan.topk_ids_out = &tv[0, 0]
            lp.plan.topk_logprobs_out = &lv[0, 0]
        cdef int32_t rc = qualia_hash_execute_step(self.st, &lp.plan,
                                                   <uint32_t *>(<_Buffer>bs).ptr, NULL)
        if rc:
            raise RaggedBackendError.Failed(rc)
        return out, tids, tlps

    def execute_ragged(self, items, block_table, outputs):
        """One decode round over ``items`` (``RAGGED_BATCH_ITEM``), ``block_table`` (uint32) and
        writable ``outputs`` (``RAGGED_BATCH_OUTPUT``), by the same C function the scheduler calls
        through ``__qualia_backend__``; returns the ``RaggedBatchReceipt``. The ``"error"`` fault
        raises ``RaggedBackendError.Failed(code)``."""
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
        """Count the ``COPY_OP`` records of ``copies`` as copied (the hash backend holds no K/V)."""
        cdef _Buffer bc = _acquire(copies, "copies", "copy_op", sizeof(qualia_copy_op),
                                   QUALIA_ALIGN_COPY, False)
        qualia_hash_copy_pages(self.st, <qualia_copy_op *>bc.ptr, <uint32_t>bc.length)

    def __repr__(self):
        return f"HashBackend(vocab={self.st.vocab}, fault={self.fault!r})"
