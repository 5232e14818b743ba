# cython: language_level=3
"""An out-of-tree decode backend for qualia written in Cython.

It uses nothing from qualia but the backend ABI: the structs and constants of ``qualia.h`` as
declared by the installed ``qualia/_abi.pxd`` (``from qualia._abi cimport ...``).  The round runs
in ``_execute``, a ``noexcept nogil`` C function: the scheduler calls it through the
``qualia_backend`` struct with the GIL released.

Its "model" is the same checksum as examples/c_backend: next token = (31 * token_id + position +
sum of the item's pages) mod vocab, so a test can tell that every item saw exactly its own slice
of the block table.

    backend = cython_backend.Backend(vocab)
    sched.decode(backend)                 # qualia finds backend.__qualia_backend__
    backend.stats() -> (calls, items, pages_copied)
    cython_backend.sizes() -> {struct: sizeof} as this compiler sees qualia.h
"""

from cpython.mem cimport PyMem_Calloc, PyMem_Free
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_New
from libc.stdint cimport int32_t, uint32_t, uint64_t

from qualia._abi cimport (
    QUALIA_BACKEND_ABI_VERSION,
    QUALIA_BACKEND_CAPSULE_NAME,
    qualia_backend,
    qualia_batch_item,
    qualia_batch_output,
    qualia_batch_receipt,
    qualia_copy_op,
    qualia_request_view,
)


ctypedef struct state:
    qualia_backend iface  # first, so that the capsule's pointer is the interface
    uint32_t vocab
    uint64_t calls
    uint64_t items
    uint64_t pages_copied


cdef int32_t _execute(void *ctx, const qualia_batch_item *items, uint32_t n_items,
                      const uint32_t *block_table, uint32_t n_table,
                      qualia_batch_output *outputs,
                      qualia_batch_receipt *receipt) noexcept nogil:
    cdef state *self = <state *>ctx
    cdef uint32_t i, k
    cdef uint64_t pages
    self.calls += 1
    for i in range(n_items):
        if <uint64_t>items[i].block_table_offset + items[i].logical_pages > n_table:
            return 17  # the lowered table does not hold this item's pages
        pages = 0
        for k in range(items[i].logical_pages):
            pages += block_table[items[i].block_table_offset + k]
        outputs[i].request_id = items[i].request_id
        outputs[i].slot = items[i].slot
        outputs[i].next_token_id = <uint32_t>(
            (31 * <uint64_t>items[i].token_id + items[i].position + pages) % self.vocab)
    self.items += n_items
    receipt.batch_size = n_items
    receipt.backend_launches = 1
    return 0


cdef int32_t _copy_pages(void *ctx, const qualia_copy_op *ops,
                         uint32_t n_ops) noexcept nogil:
    (<state *>ctx).pages_copied += n_ops  # a real backend copies ops[i].src_page -> dst_page
    return 0


cdef void _free(object capsule) noexcept:
    PyMem_Free(PyCapsule_GetPointer(capsule, QUALIA_BACKEND_CAPSULE_NAME))


cdef class Backend:
    """A decode backend; qualia takes it as it is (``__qualia_backend__``)."""

    cdef readonly object __qualia_backend__
    cdef state *_state

    def __cinit__(self, unsigned int vocab):
        if vocab == 0:
            raise ValueError("vocab must be at least 1")
        cdef state *s = <state *>PyMem_Calloc(1, sizeof(state))
        if s == NULL:
            raise MemoryError()
        s.iface.abi_version = QUALIA_BACKEND_ABI_VERSION
        s.iface.struct_size = sizeof(qualia_backend)
        s.iface.ctx = s
        s.iface.execute_ragged = _execute
        s.iface.copy_pages = _copy_pages
        s.vocab = vocab
        try:
            self.__qualia_backend__ = PyCapsule_New(&s.iface, QUALIA_BACKEND_CAPSULE_NAME,
                                                    _free)
        except BaseException:
            PyMem_Free(s)
            raise
        self._state = s  # owned by the capsule, which may outlive this object

    def stats(self):
        """(calls, items, pages_copied) so far."""
        return (self._state.calls, self._state.items, self._state.pages_copied)


def sizes():
    """sizeof of every ABI struct, as this compiler sees qualia.h."""
    return {
        "item": sizeof(qualia_batch_item),
        "output": sizeof(qualia_batch_output),
        "receipt": sizeof(qualia_batch_receipt),
        "request_view": sizeof(qualia_request_view),
        "copy_op": sizeof(qualia_copy_op),
        "backend": sizeof(qualia_backend),
    }
