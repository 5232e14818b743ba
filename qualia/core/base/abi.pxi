# The ABI: numpy dtypes derived from the compiled structs.

cdef qualia_batch_item _item
cdef qualia_batch_output _out
cdef qualia_batch_receipt _rec
cdef qualia_request_view _view
cdef qualia_copy_op _cop
cdef qualia_step_plan _splan
cdef qualia_step_backend _sbk

# The step plan's fields in declaration order: (name, numpy type of the field or of what the
# pointer points at, is a pointer).  Pointers are laid out as "<u8" in _layout (LP64).
_STEP_PLAN_COUNTS = ("struct_size", "page_tokens", "num_requests", "num_tokens", "num_sampled",
                     "num_prefill_tokens", "num_decode_tokens", "num_kv_indices",
                     "block_table_num_rows", "block_table_num_cols", "block_table_row_stride",
                     "num_changed_rows", "num_copies", "num_new", "num_preempted",
                     "num_finished")
_STEP_PLAN_ARRAYS = (("request_ids", "<u8"), ("query_start_loc", "<i4"), ("seq_lens", "<i4"),
                     ("input_ids", "<u4"), ("positions", "<i4"), ("slot_mapping", "<i8"),
                     ("logits_indices", "<i4"), ("sampled_request_ids", "<u8"),
                     ("block_table", "<i4"), ("block_table_rows", "<i4"),
                     ("changed_rows", "<i4"), ("kv_indptr", "<i4"), ("kv_indices", "<i4"),
                     ("kv_last_page_len", "<i4"), ("copies", "copy_op"),
                     ("new_request_ids", "<u8"), ("preempted_request_ids", "<u8"),
                     ("finished_request_ids", "<u8"))


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
    b = <char *>&_splan
    counts = [
        <char *>&_splan.struct_size - b, <char *>&_splan.page_tokens - b,
        <char *>&_splan.num_requests - b, <char *>&_splan.num_tokens - b,
        <char *>&_splan.num_sampled - b, <char *>&_splan.num_prefill_tokens - b,
        <char *>&_splan.num_decode_tokens - b, <char *>&_splan.num_kv_indices - b,
        <char *>&_splan.block_table_num_rows - b, <char *>&_splan.block_table_num_cols - b,
        <char *>&_splan.block_table_row_stride - b, <char *>&_splan.num_changed_rows - b,
        <char *>&_splan.num_copies - b, <char *>&_splan.num_new - b,
        <char *>&_splan.num_preempted - b, <char *>&_splan.num_finished - b]
    ptrs = [
        <char *>&_splan.request_ids - b, <char *>&_splan.query_start_loc - b,
        <char *>&_splan.seq_lens - b, <char *>&_splan.input_ids - b,
        <char *>&_splan.positions - b, <char *>&_splan.slot_mapping - b,
        <char *>&_splan.logits_indices - b, <char *>&_splan.sampled_request_ids - b,
        <char *>&_splan.block_table - b, <char *>&_splan.block_table_rows - b,
        <char *>&_splan.changed_rows - b, <char *>&_splan.kv_indptr - b,
        <char *>&_splan.kv_indices - b, <char *>&_splan.kv_last_page_len - b,
        <char *>&_splan.copies - b, <char *>&_splan.new_request_ids - b,
        <char *>&_splan.preempted_request_ids - b, <char *>&_splan.finished_request_ids - b]
    # appended in the same ABI version: beam rows
    tail = [("num_topk", "<u4", <char *>&_splan.num_topk - b),
            ("num_forks", "<u4", <char *>&_splan.num_forks - b),
            ("topk_ids_out", "<u8", <char *>&_splan.topk_ids_out - b),
            ("topk_logprobs_out", "<u8", <char *>&_splan.topk_logprobs_out - b),
            ("fork_child_ids", "<u8", <char *>&_splan.fork_child_ids - b),
            ("fork_parent_ids", "<u8", <char *>&_splan.fork_parent_ids - b)]
    layout["step_plan"] = (sizeof(qualia_step_plan), QUALIA_ALIGN_STEP_PLAN,
                           [(name, "<u4", off) for name, off in zip(_STEP_PLAN_COUNTS, counts)]
                           + [(f[0], "<u8", off) for f, off in zip(_STEP_PLAN_ARRAYS, ptrs)]
                           + tail)
    b = <char *>&_sbk
    layout["step_backend"] = (sizeof(qualia_step_backend), QUALIA_ALIGN_STEP_BACKEND, [
        ("abi_version", "<u4", <char *>&_sbk.abi_version - b),
        ("struct_size", "<u4", <char *>&_sbk.struct_size - b),
        ("flags", "<u4", <char *>&_sbk.flags - b),
        ("_reserved", "<u4", <char *>&_sbk._reserved - b),
        ("ctx", "<u8", <char *>&_sbk.ctx - b),
        ("execute_step", "<u8", <char *>&_sbk.execute_step - b),
        ("copy_pages", "<u8", <char *>&_sbk.copy_pages - b)])
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
STEP_CAPSULE_NAME = (<bytes>QUALIA_STEP_CAPSULE_NAME).decode()
STEP_ABI_VERSION = QUALIA_STEP_ABI_VERSION
STEP_PLAN_STRUCT_SIZE = sizeof(qualia_step_plan)
STEP_BACKEND_STRUCT_SIZE = sizeof(qualia_step_backend)
STEP_WRITES_LOGPROBS = QUALIA_STEP_WRITES_LOGPROBS
STEP_WRITES_TOPK = QUALIA_STEP_WRITES_TOPK
STEP_NO_CSR = QUALIA_STEP_NO_CSR


def _normalize_format(fmt):
    # Buffer exporters spell the same little-endian layout in several ways ('@', '=', '<', 'Q' or
    # 'L' for u64 on LP64, padding 'x' written out by numpy but left implicit by ctypes): compare
    # the canonical form.  In a struct "T{code:name:code:name:...}" only the codes are
    # rewritten, never the field names.  Memory safety never rests on the format: the core
    # checks the itemsize, the length and the alignment.
    def code(c):
        c = c.replace("@", "").replace("=", "").replace("<", "")
        c = _re.sub(r"[0-9]*x", "", c)
        if sizeof(long) == 8:
            c = c.replace("Q", "L").replace("q", "l")
        return c
    if fmt.startswith("T{") and fmt.endswith("}"):
        parts = fmt[2:-1].split(":")
        return "T{" + ":".join(code(p) if k % 2 == 0 else p for k, p in enumerate(parts)) + "}"
    return code(fmt)


cdef dict _FORMATS = {}
for _name, _dt in (("item", RAGGED_BATCH_ITEM), ("output", RAGGED_BATCH_OUTPUT),
                   ("request_view", REQUEST_VIEW), ("copy_op", COPY_OP),
                   ("u32", np.dtype(np.uint32)), ("i32", np.dtype(np.int32)),
                   ("i64", np.dtype(np.int64)), ("u64", np.dtype(np.uint64)),
                   ("f32", np.dtype(np.float32))):
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
