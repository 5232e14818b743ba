# Cython view of csrc/qualia.h: the structs shared with decode and step backends.  Cython users
# `cimport qualia._abi` with `include_dirs=[qualia.get_include()]`.
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int32_t, int64_t

cdef extern from "qualia.h" nogil:
    ctypedef struct qualia_batch_item:
        uint64_t request_id
        uint32_t slot
        uint32_t token_id
        uint32_t position
        uint32_t block_table_offset
        uint32_t logical_pages
        uint32_t _reserved

    ctypedef struct qualia_batch_output:
        uint64_t request_id
        uint32_t slot
        uint32_t next_token_id

    ctypedef struct qualia_batch_receipt:
        uint32_t batch_size
        uint32_t backend_launches

    ctypedef struct qualia_request_view:
        uint64_t request_id
        uint16_t slot
        uint8_t state
        uint32_t token_count
        uint32_t prefix_tokens

    ctypedef struct qualia_copy_op:
        uint32_t src_page
        uint32_t dst_page

    enum:
        QUALIA_STATE_EMPTY
        QUALIA_STATE_PREFILL
        QUALIA_STATE_DECODE

    unsigned int QUALIA_BACKEND_ABI_VERSION
    const char *QUALIA_BACKEND_CAPSULE_NAME

    ctypedef int32_t (*qualia_execute_ragged_fn)(void *ctx,
                                                 const qualia_batch_item *items, uint32_t n_items,
                                                 const uint32_t *block_table, uint32_t n_table,
                                                 qualia_batch_output *outputs,
                                                 qualia_batch_receipt *receipt)
    ctypedef int32_t (*qualia_copy_pages_fn)(void *ctx, const qualia_copy_op *ops, uint32_t n_ops)

    ctypedef struct qualia_backend:
        uint32_t abi_version
        uint32_t struct_size
        void *ctx
        qualia_execute_ragged_fn execute_ragged
        qualia_copy_pages_fn copy_pages

    # The step backend interface (QUALIA_STEP_ABI_VERSION 1): one whole engine step.
    unsigned int QUALIA_STEP_ABI_VERSION
    const char *QUALIA_STEP_CAPSULE_NAME

    enum:
        QUALIA_STEP_WRITES_LOGPROBS
        QUALIA_STEP_WRITES_TOPK
        QUALIA_STEP_NO_CSR

    ctypedef struct qualia_step_plan:
        uint32_t struct_size
        uint32_t page_tokens
        uint32_t num_requests
        uint32_t num_tokens
        uint32_t num_sampled
        uint32_t num_prefill_tokens
        uint32_t num_decode_tokens
        uint32_t num_kv_indices
        uint32_t block_table_num_rows
        uint32_t block_table_num_cols
        uint32_t block_table_row_stride
        uint32_t num_changed_rows
        uint32_t num_copies
        uint32_t num_new
        uint32_t num_preempted
        uint32_t num_finished
        const uint64_t *request_ids
        const int32_t *query_start_loc
        const int32_t *seq_lens
        const uint32_t *input_ids
        const int32_t *positions
        const int64_t *slot_mapping
        const int32_t *logits_indices
        const uint64_t *sampled_request_ids
        const int32_t *block_table
        const int32_t *block_table_rows
        const int32_t *changed_rows
        const int32_t *kv_indptr
        const int32_t *kv_indices
        const int32_t *kv_last_page_len
        const qualia_copy_op *copies
        const uint64_t *new_request_ids
        const uint64_t *preempted_request_ids
        const uint64_t *finished_request_ids
        uint32_t num_topk
        uint32_t num_forks
        uint32_t *topk_ids_out
        float *topk_logprobs_out
        const uint64_t *fork_child_ids
        const uint64_t *fork_parent_ids

    ctypedef int32_t (*qualia_execute_step_fn)(void *ctx, const qualia_step_plan *plan,
                                               uint32_t *sampled_out, float *logprobs_out)

    ctypedef struct qualia_step_backend:
        uint32_t abi_version
        uint32_t struct_size
        uint32_t flags
        uint32_t _reserved
        void *ctx
        qualia_execute_step_fn execute_step
        qualia_copy_pages_fn copy_pages
