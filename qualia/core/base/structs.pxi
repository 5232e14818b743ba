# The core's status codes and the C declarations every part uses.  Each struct is declared with
# its concept (core/pages/pool.pxi: Pool, ...); all are private to the extension module: the
# public ABI is csrc/qualia.h (mirrored by qualia/_abi.pxd), and nothing here is exported.

# Status codes of the nogil core.  0 is success; the names match the error variants, and the
# def wrappers turn each code into the exception class of the layer that called.
cdef enum:
    Q_OK = 0
    Q_EXHAUSTED = 1
    Q_INVALID_PAGE = 2
    Q_NOT_ALLOCATED = 3
    Q_OVERFLOW = 4
    Q_OUT_OF_RANGE = 5
    Q_GAP = 6
    Q_NOT_EMPTY = 7
    Q_EMPTY_PREFIX = 8
    Q_TOO_MANY_PAGES = 9
    Q_DUPLICATE = 10
    Q_STORE_FULL = 11
    Q_UNKNOWN = 12
    Q_DUPLICATE_REQUEST = 13
    Q_FULL = 14
    Q_UNKNOWN_REQUEST = 15
    Q_OUTPUT_TOO_SMALL = 16
    Q_ITEM_BUFFER_TOO_SMALL = 17
    Q_OUTPUT_BUFFER_TOO_SMALL = 18
    Q_TABLE_BUFFER_TOO_SMALL = 19
    Q_MISSING_INPUT_TOKEN = 20
    Q_OUTPUT_IDENTITY_MISMATCH = 21
    Q_BACKEND_LAUNCH_COUNT = 22
    Q_ROUND_TOO_LARGE = 23      # the lowered block table passes 2**32-1 entries (OverflowError)
    Q_NAMESPACES_FULL = 24      # automatic prefix caching: every namespace id is in use
    Q_STEP_DUPLICATE = 25       # the engine step (core/step/): StepError variants
    Q_STEP_UNKNOWN = 26
    Q_NEVER_FITS = 27
    Q_QUEUE_FULL = 28
    Q_PLAN_PENDING = 29
    Q_NO_PLAN = 30
    Q_FORK_IN_PREFILL = 31      # fork of a request that is still in its prefill
    # a C step backend's failed step in StepScheduler.run() (core/step/loop.pxi): no error
    # variant of the families but RaggedBackendError.Failed(status) and ValueError / TypeError
    # with the row that failed (core/base/errors.pxi, _PLAIN)
    Q_RUN_BACKEND_FAILED = 32   # the backend returned nonzero (its status)
    Q_RUN_UNWRITTEN = 33        # a sampled row left unwritten
    Q_RUN_BAD_TOKEN = 34        # a sampled id past vocab_size
    Q_RUN_NO_TOPK = 35          # a plan with beam rows, a backend that writes no candidates
    Q_RUN_BAD_TOPK = 36         # a candidate id past vocab_size
    Q_RUN_BAD_TOPK_LOGPROB = 37  # a candidate log-probability NaN, above 0, or unwritten
    Q_RUN_REPEATED_TOPK = 38    # a beam row repeats a candidate id
    Q_RUN_UNSORTED_TOPK = 39    # a beam row's candidates are not best first
    # a write into a plan buffer past its capacity (core/step/plan.pxi, "guards"): a broken
    # invariant of the scheduler, refused before the write; SystemError (_PLAIN)
    Q_PLAN_OVERRUN = 40
    Q_CODES = 41

# The plan's buffers by the capacity that guards their writes (core/step/plan.pxi): what a
# Q_PLAN_OVERRUN names (core/base/errors.pxi, _PLAN_BUFFER_NAMES)
cdef enum:
    PB_SEQS = 0         # one record per scheduled request: max_num_seqs
    PB_TOKENS = 1       # one per scheduled token: max_num_batched_tokens
    PB_ROWS = 2         # one per sampled row: max_queued
    PB_KV = 3           # kv_indices: max_num_seqs x logical_pages
    PB_COPIES = 4       # copy-on-write copies
    PB_NEW = 5          # new_request_ids: max_num_seqs
    PB_PREEMPTED = 6    # preempted_request_ids: max_num_seqs
    PB_FINISHED = 7     # finished_request_ids: grows with the accumulator
    PB_FORKS = 8        # fork_child_ids / fork_parent_ids
    PB_KINDS = 9

cdef extern from "Python.h":
    unsigned long long _as_ull "PyLong_AsUnsignedLongLong"(object o)
    Py_ssize_t Py_SIZE(object o)

cdef extern from "qualia_internal.h" nogil:
    void qualia_prefix_digest(const uint8_t *ns, uint32_t ns_len, const void *tokens,
                              size_t n, uint8_t *out)
    void qualia_lower_page16(int32_t *positions, int64_t *slots, uint32_t pos, int64_t slot)

cdef extern from *:
    """
    #include "qualia.h"
    #define QUALIA_ALIGN_ITEM _Alignof(qualia_batch_item)
    #define QUALIA_ALIGN_OUTPUT _Alignof(qualia_batch_output)
    #define QUALIA_ALIGN_RECEIPT _Alignof(qualia_batch_receipt)
    #define QUALIA_ALIGN_VIEW _Alignof(qualia_request_view)
    #define QUALIA_ALIGN_COPY _Alignof(qualia_copy_op)
    #define QUALIA_ALIGN_BACKEND _Alignof(qualia_backend)
    #define QUALIA_ALIGN_STEP_PLAN _Alignof(qualia_step_plan)
    #define QUALIA_ALIGN_STEP_BACKEND _Alignof(qualia_step_backend)
    """
    size_t QUALIA_ALIGN_ITEM
    size_t QUALIA_ALIGN_OUTPUT
    size_t QUALIA_ALIGN_RECEIPT
    size_t QUALIA_ALIGN_VIEW
    size_t QUALIA_ALIGN_COPY
    size_t QUALIA_ALIGN_BACKEND
    size_t QUALIA_ALIGN_STEP_PLAN
    size_t QUALIA_ALIGN_STEP_BACKEND
    int __builtin_ctzll(unsigned long long) nogil

cdef extern from "<stdint.h>":
    const uint32_t U32_MAX "UINT32_MAX"
    const uint64_t U64_MAX "UINT64_MAX"
