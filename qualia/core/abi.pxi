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
