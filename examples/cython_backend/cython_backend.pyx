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

It is also a step backend (the step ABI), with the step model of examples/c_backend: sampled row r,
with t = logits_indices[r] in request i, gets (31 * input_ids[t] + positions[t] + seq_lens[i] +
sum of request i's kv_indices) mod vocab.  With topk (the default) it declares
QUALIA_STEP_WRITES_TOPK and writes beam candidates by examples/c_backend's rule: for a plan with
k = num_topk > 0, row r's candidate j is (next + j) mod vocab with log-probability
(-(next) / vocab) - j in float32 (best first, no ties; k > vocab gets status 23).  It reads
num_topk only when plan.struct_size covers the appended beam-row fields (an older scheduler's plan
ends before them), as every backend built against this header must.

    step = cython_backend.StepBackend(vocab, topk=True)  # qualia finds __qualia_step_backend__
    step.stats() -> (steps, sampled)
    cython_backend.step_plan_offsets() -> {field: offset} of qualia_step_plan as declared
"""

cimport cython
from cpython.mem cimport PyMem_Calloc, PyMem_Free
from cpython.pycapsule cimport (
    PyCapsule_GetName,
    PyCapsule_GetPointer,
    PyCapsule_New,
)
from libc.stdint cimport int32_t, uint32_t, uint64_t

from qualia._abi cimport (
    QUALIA_BACKEND_ABI_VERSION,
    QUALIA_BACKEND_CAPSULE_NAME,
    QUALIA_STEP_ABI_VERSION,
    QUALIA_STEP_CAPSULE_NAME,
    QUALIA_STEP_WRITES_TOPK,
    qualia_backend,
    qualia_batch_item,
    qualia_batch_output,
    qualia_batch_receipt,
    qualia_copy_op,
    qualia_request_view,
    qualia_step_backend,
    qualia_step_plan,
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


# -- shared by both backends: a state struct whose first member is the interface, owned by the
# capsule that hands the interface to qualia

cdef void _free(object capsule) noexcept:
    PyMem_Free(PyCapsule_GetPointer(capsule, PyCapsule_GetName(capsule)))


cdef void *_new_state(unsigned int vocab, size_t size) except NULL:
    """A zeroed state struct of `size` bytes, for a backend of `vocab` tokens."""
    if vocab == 0:
        raise ValueError("vocab must be at least 1")
    cdef void *s = PyMem_Calloc(1, size)
    if s == NULL:
        raise MemoryError()
    return s


cdef object _capsule(void *s, const char *name):
    """The capsule named `name` that owns state s (freed here if the capsule cannot be made);
    its pointer is s, the state's interface."""
    try:
        return PyCapsule_New(s, name, _free)
    except BaseException:
        PyMem_Free(s)
        raise


# -- the decode-round backend ---------------------------------------------------------------

cdef class Backend:
    """A decode backend; qualia takes it as it is (``__qualia_backend__``)."""

    cdef readonly object __qualia_backend__
    cdef state *_state

    def __cinit__(self, unsigned int vocab):
        cdef state *s = <state *>_new_state(vocab, sizeof(state))
        s.iface.abi_version = QUALIA_BACKEND_ABI_VERSION
        s.iface.struct_size = sizeof(qualia_backend)
        s.iface.ctx = s
        s.iface.execute_ragged = _execute
        s.iface.copy_pages = _copy_pages
        s.vocab = vocab
        self.__qualia_backend__ = _capsule(s, QUALIA_BACKEND_CAPSULE_NAME)
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
        "step_plan": sizeof(qualia_step_plan),
        "step_backend": sizeof(qualia_step_backend),
    }


# -- the step backend -----------------------------------------------------------------------

ctypedef struct step_state:
    qualia_step_backend iface  # first, so that the capsule's pointer is the interface
    uint32_t vocab
    uint64_t steps
    uint64_t sampled


cdef bint _has_topk_fields(const qualia_step_plan *plan) noexcept nogil:
    """Whether the scheduler's plan (struct_size bytes) reaches its appended beam-row fields."""
    cdef size_t end = <size_t>(<const char *>&plan.topk_logprobs_out - <const char *>plan)
    return plan.struct_size >= end + sizeof(plan.topk_logprobs_out)


@cython.cdivision(True)  # vocab >= 1: no division-by-zero checks without the GIL
cdef int32_t _execute_step(void *ctx, const qualia_step_plan *plan, uint32_t *sampled_out,
                           float *logprobs_out) noexcept nogil:
    cdef step_state *self = <step_state *>ctx
    cdef uint32_t r, j, next_id, i = 0, topk = 0
    cdef int32_t t, k
    cdef uint64_t pages
    cdef float lp
    self.steps += 1
    if (self.iface.flags & QUALIA_STEP_WRITES_TOPK) and _has_topk_fields(plan):
        topk = plan.num_topk
        if topk > 0 and (plan.topk_ids_out == NULL or plan.topk_logprobs_out == NULL):
            return 22
        if topk > self.vocab:
            return 23  # fewer distinct ids than candidates asked for
    for r in range(plan.num_sampled):
        t = plan.logits_indices[r]
        if t < 0 or <uint32_t>t >= plan.num_tokens:
            return 21
        while i + 1 < plan.num_requests and plan.query_start_loc[i + 1] <= t:
            i += 1
        pages = 0
        for k in range(plan.kv_indptr[i], plan.kv_indptr[i + 1]):
            pages += <uint32_t>plan.kv_indices[k]
        next_id = <uint32_t>((31 * <uint64_t>plan.input_ids[t]
                              + <uint32_t>plan.positions[t]
                              + <uint32_t>plan.seq_lens[i] + pages) % self.vocab)
        sampled_out[r] = next_id
        lp = -<float>next_id / <float>self.vocab
        for j in range(topk):  # row r's candidates, best first
            plan.topk_ids_out[<size_t>r * topk + j] = <uint32_t>(
                (<uint64_t>next_id + j) % self.vocab)
            plan.topk_logprobs_out[<size_t>r * topk + j] = lp - <float>j
    self.sampled += plan.num_sampled
    return 0


cdef class StepBackend:
    """A step backend; qualia takes it as it is (``__qualia_step_backend__``)."""

    cdef readonly object __qualia_step_backend__
    cdef step_state *_state

    def __cinit__(self, unsigned int vocab, bint topk=True):
        cdef step_state *s = <step_state *>_new_state(vocab, sizeof(step_state))
        s.iface.abi_version = QUALIA_STEP_ABI_VERSION
        s.iface.struct_size = sizeof(qualia_step_backend)
        # no log-probabilities; beam candidates unless topk=False
        s.iface.flags = QUALIA_STEP_WRITES_TOPK if topk else 0
        s.iface.ctx = s
        s.iface.execute_step = _execute_step
        s.iface.copy_pages = NULL  # it would perform plan.copies itself
        s.vocab = vocab
        self.__qualia_step_backend__ = _capsule(s, QUALIA_STEP_CAPSULE_NAME)
        self._state = s  # owned by the capsule, which may outlive this object

    def stats(self):
        """(steps, sampled) so far."""
        return (self._state.steps, self._state.sampled)


cdef qualia_step_plan _p


def step_plan_offsets():
    """Offsets of qualia_step_plan's fields, by the names _abi.pxd declares."""
    cdef char *b = <char *>&_p
    return {
        "struct_size": <char *>&_p.struct_size - b,
        "page_tokens": <char *>&_p.page_tokens - b,
        "num_requests": <char *>&_p.num_requests - b,
        "num_tokens": <char *>&_p.num_tokens - b,
        "num_sampled": <char *>&_p.num_sampled - b,
        "num_prefill_tokens": <char *>&_p.num_prefill_tokens - b,
        "num_decode_tokens": <char *>&_p.num_decode_tokens - b,
        "num_kv_indices": <char *>&_p.num_kv_indices - b,
        "block_table_num_rows": <char *>&_p.block_table_num_rows - b,
        "block_table_num_cols": <char *>&_p.block_table_num_cols - b,
        "block_table_row_stride": <char *>&_p.block_table_row_stride - b,
        "num_changed_rows": <char *>&_p.num_changed_rows - b,
        "num_copies": <char *>&_p.num_copies - b,
        "num_new": <char *>&_p.num_new - b,
        "num_preempted": <char *>&_p.num_preempted - b,
        "num_finished": <char *>&_p.num_finished - b,
        "request_ids": <char *>&_p.request_ids - b,
        "query_start_loc": <char *>&_p.query_start_loc - b,
        "seq_lens": <char *>&_p.seq_lens - b,
        "input_ids": <char *>&_p.input_ids - b,
        "positions": <char *>&_p.positions - b,
        "slot_mapping": <char *>&_p.slot_mapping - b,
        "logits_indices": <char *>&_p.logits_indices - b,
        "sampled_request_ids": <char *>&_p.sampled_request_ids - b,
        "block_table": <char *>&_p.block_table - b,
        "block_table_rows": <char *>&_p.block_table_rows - b,
        "changed_rows": <char *>&_p.changed_rows - b,
        "kv_indptr": <char *>&_p.kv_indptr - b,
        "kv_indices": <char *>&_p.kv_indices - b,
        "kv_last_page_len": <char *>&_p.kv_last_page_len - b,
        "copies": <char *>&_p.copies - b,
        "new_request_ids": <char *>&_p.new_request_ids - b,
        "preempted_request_ids": <char *>&_p.preempted_request_ids - b,
        "finished_request_ids": <char *>&_p.finished_request_ids - b,
        "num_topk": <char *>&_p.num_topk - b,
        "num_forks": <char *>&_p.num_forks - b,
        "topk_ids_out": <char *>&_p.topk_ids_out - b,
        "topk_logprobs_out": <char *>&_p.topk_logprobs_out - b,
        "fork_child_ids": <char *>&_p.fork_child_ids - b,
        "fork_parent_ids": <char *>&_p.fork_parent_ids - b,
    }
