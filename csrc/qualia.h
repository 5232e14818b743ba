/*
 * qualia.h: the C ABI shared by the qualia scheduler core and its backends (decode rounds,
 * and whole engine steps).
 *
 * Every struct a backend sees is declared here, once.  The Python package derives its numpy
 * dtypes from these definitions (sizeof/offsetof of the compiled structs), and its tests assert
 * each size, alignment and offset, so a C/C++/CUDA engine can include this header and hand
 * qualia a backend without any Python in the decode loop.
 *
 * Layouts mirror the #[repr(C)] types of the original Rust request table (docs/DESIGN.md,
 * "C layouts").  Integers are fixed-width; page and token ids are uint32_t, request ids
 * uint64_t.
 */
#ifndef QUALIA_H
#define QUALIA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One decoding request lowered into a ragged batch (RaggedBatchItem, 32 bytes). */
typedef struct qualia_batch_item {
    uint64_t request_id;
    uint32_t slot;
    uint32_t token_id;            /* input token of this step */
    uint32_t position;            /* its position: the request's token_count before the step */
    uint32_t block_table_offset;  /* first entry of its pages in the lowered block table */
    uint32_t logical_pages;       /* number of its pages in the lowered block table */
    uint32_t _reserved;           /* always 0 */
} qualia_batch_item;

/* What the backend writes for each item (RaggedBatchOutput, 16 bytes). */
typedef struct qualia_batch_output {
    uint64_t request_id;
    uint32_t slot;
    uint32_t next_token_id;
} qualia_batch_output;

/* What the backend reports for one round (RaggedBatchReceipt, 8 bytes). */
typedef struct qualia_batch_receipt {
    uint32_t batch_size;
    uint32_t backend_launches;
} qualia_batch_receipt;

/* RequestState, pinned to one byte. */
enum {
    QUALIA_STATE_EMPTY = 0,
    QUALIA_STATE_PREFILL = 1,
    QUALIA_STATE_DECODE = 2
};

/* A read-only view of one active request (RequestView, 24 bytes). */
typedef struct qualia_request_view {
    uint64_t request_id;
    uint16_t slot;
    uint8_t state;
    uint32_t token_count;
    uint32_t prefix_tokens;
} qualia_request_view;

/* A page copy the backend performs before writing (copy-on-write), 8 bytes. */
typedef struct qualia_copy_op {
    uint32_t src_page;
    uint32_t dst_page;
} qualia_copy_op;

/*
 * The C backend interface.
 *
 * A backend object exposes a PyCapsule named QUALIA_BACKEND_CAPSULE_NAME (as its
 * `__qualia_backend__` attribute, or a method of that name returning it) whose pointer is a
 * `qualia_backend`.  The struct must outlive the capsule.  The scheduler checks abi_version and
 * struct_size once per call, then calls the function pointers with the GIL released: they must
 * not touch Python.
 *
 * execute_ragged: one decode round.  items[0..n_items) and block_table[0..n_table) are
 * read-only; write outputs[0..n_items) and *receipt.  Return 0 on success, any other value is the
 * backend's own error code (reported as DecodeRoundError.Backend(RaggedBackendError.Failed(code))).
 *
 * copy_pages (may be NULL): copy physical KV page src_page to dst_page for each op, in order,
 * before the round that writes into dst_page.  Return 0 on success.
 */
#define QUALIA_BACKEND_ABI_VERSION 1u
#define QUALIA_BACKEND_CAPSULE_NAME "qualia.backend.v1"

typedef int32_t (*qualia_execute_ragged_fn)(void *ctx,
                                            const qualia_batch_item *items, uint32_t n_items,
                                            const uint32_t *block_table, uint32_t n_table,
                                            qualia_batch_output *outputs,
                                            qualia_batch_receipt *receipt);

typedef int32_t (*qualia_copy_pages_fn)(void *ctx, const qualia_copy_op *ops, uint32_t n_ops);

typedef struct qualia_backend {
    uint32_t abi_version;   /* QUALIA_BACKEND_ABI_VERSION */
    uint32_t struct_size;   /* sizeof(qualia_backend) */
    void *ctx;              /* handed back to every call */
    qualia_execute_ragged_fn execute_ragged;
    qualia_copy_pages_fn copy_pages;  /* optional */
} qualia_backend;

/*
 * The step backend interface (QUALIA_STEP_ABI_VERSION 1): one whole engine step.
 *
 * A versioned addition beside the decode-round interface above, which is unchanged.  The
 * scheduler lowers each step into a `qualia_step_plan` (every array it describes stays valid for
 * the duration of the call only) and hands it to `execute_step` with the GIL released.
 *
 * Counts come first, then pointers.  `struct_size` is sizeof(qualia_step_plan) as the scheduler was
 * compiled; a backend built against a later header reads a field only when it lies inside
 * struct_size.  Every pointer is read-only for the backend; a pointer whose count is 0 may be NULL.
 *
 * Conventions (the same arrays as the Python StepPlan, docs/DESIGN.md "The step backend ABI"):
 *   - the n scheduled requests appear in plan order: decodes, running prefill chunks, admissions;
 *   - request i computes flat tokens [query_start_loc[i], query_start_loc[i+1]) of the T tokens;
 *     seq_lens[i] is its context length after the step (tokens already computed + its chunk);
 *   - slot_mapping[t] = page * page_tokens + positions[t] % page_tokens: where token t's K/V goes;
 *   - the m sampled rows: logits_indices[r] is the flat token (0 <= . < T) whose logits are
 *     sampled for request sampled_request_ids[r] (the last token of a decode or of a prompt's
 *     last chunk);
 *   - block_table is dense and persistent: block_table_num_rows rows (max_num_seqs) of
 *     block_table_num_cols pages (logical_pages), row r starting at block_table[r *
 *     block_table_row_stride]; -1 past a request's pages.  block_table_rows[i] is request i's
 *     row; changed_rows lists, ascending, the rows rewritten since the previous step;
 *   - kv_indptr (n+1), kv_indices (num_kv_indices = kv_indptr[n]) and kv_last_page_len (n, each in
 *     1..page_tokens) are the paged-KV CSR form of the pages covering seq_lens;
 *   - copies are copy-on-write page copies that must happen before the forward pass, in any order
 *     or at once (distinct destinations, none of them a source); every plan lists again the
 *     copies of a discarded plan until a plan listing them is applied;
 *   - new / preempted / finished request ids tell the backend which per-request state to create or
 *     drop: not seen in an applied plan (admitted or resumed in this step, or named by a discarded
 *     plan: set-up must be idempotent), preempted in this step, finished or aborted since the
 *     previous step; forked children are named by fork_child_ids (below), not as new.
 */
#define QUALIA_STEP_ABI_VERSION 1u
#define QUALIA_STEP_CAPSULE_NAME "qualia.step_backend.v1"

typedef struct qualia_step_plan {
    uint32_t struct_size;            /* sizeof(qualia_step_plan) as the scheduler sees it */
    uint32_t page_tokens;            /* tokens per KV page */
    uint32_t num_requests;           /* n */
    uint32_t num_tokens;             /* T: scheduled tokens (prefill + decode) */
    uint32_t num_sampled;            /* m: rows to sample; sampled_out has m entries */
    uint32_t num_prefill_tokens;
    uint32_t num_decode_tokens;
    uint32_t num_kv_indices;         /* kv_indptr[n] */
    uint32_t block_table_num_rows;   /* max_num_seqs */
    uint32_t block_table_num_cols;   /* logical pages per row */
    uint32_t block_table_row_stride; /* int32 entries between row starts (>= num_cols) */
    uint32_t num_changed_rows;
    uint32_t num_copies;
    uint32_t num_new;
    uint32_t num_preempted;
    uint32_t num_finished;
    const uint64_t *request_ids;         /* [n] */
    const int32_t *query_start_loc;      /* [n + 1] */
    const int32_t *seq_lens;             /* [n] */
    const uint32_t *input_ids;           /* [T] */
    const int32_t *positions;            /* [T] */
    const int64_t *slot_mapping;         /* [T] */
    const int32_t *logits_indices;       /* [m] */
    const uint64_t *sampled_request_ids; /* [m] */
    const int32_t *block_table;          /* [num_rows * row_stride] */
    const int32_t *block_table_rows;     /* [n] */
    const int32_t *changed_rows;         /* [num_changed_rows] */
    const int32_t *kv_indptr;            /* [n + 1] */
    const int32_t *kv_indices;           /* [num_kv_indices] */
    const int32_t *kv_last_page_len;     /* [n] */
    const qualia_copy_op *copies;        /* [num_copies] */
    const uint64_t *new_request_ids;       /* [num_new] */
    const uint64_t *preempted_request_ids; /* [num_preempted] */
    const uint64_t *finished_request_ids;  /* [num_finished] */
    /* Appended in the same ABI version (read them only when struct_size covers them): beam rows.
     * num_topk > 0 when the plan has rows of beam groups; a backend that declares
     * QUALIA_STEP_WRITES_TOPK then writes, for every sampled row r (beam row or not),
     * topk_ids_out[r * num_topk + j] and topk_logprobs_out[r * num_topk + j] for j < num_topk:
     * the row's num_topk most likely next tokens, best first (ties: the lower id first), with
     * their natural-log probabilities.  Both are NULL when num_topk is 0.  The scheduler refuses
     * a plan with num_topk > 0 for a backend without that flag (the step is discarded), and
     * fails the step when a candidate id is past vocab_size, a log-probability is NaN or above 0
     * (a log-probability is at most 0; -inf is a token of probability 0), a candidate is left
     * unwritten (the scheduler sets each to id 0 and log-probability NaN before the call),
     * a beam row repeats an id among its first beam_width candidates, or a beam row's
     * log-probabilities are not best first (non-increasing). */
    uint32_t num_topk;
    /* Copy-on-write forks (n > 1 and beam search) made since the previous plan: child
     * fork_child_ids[i] continues from fork_parent_ids[i] and shares its pages; a backend
     * keeping per-request state copies the parent's for the child before it uses the child's
     * rows (then applies finished_request_ids: a child forked and aborted since the previous
     * plan is in both).  A discarded plan's forks are named again by the next plan. */
    uint32_t num_forks;
    uint32_t *topk_ids_out;              /* [num_sampled * num_topk], written by the backend */
    float *topk_logprobs_out;            /* [num_sampled * num_topk], written by the backend */
    const uint64_t *fork_child_ids;      /* [num_forks] */
    const uint64_t *fork_parent_ids;     /* [num_forks] */
} qualia_step_plan;

/*
 * A step backend exposes a PyCapsule named QUALIA_STEP_CAPSULE_NAME whose pointer is a
 * `qualia_step_backend`, as its `__qualia_step_backend__` attribute (or a method of that name
 * returning it).  The struct must outlive the capsule.  The scheduler checks abi_version,
 * struct_size and execute_step once when it resolves the backend, then calls it with the GIL
 * released, possibly for many consecutive steps: the functions must not touch Python.
 *
 * execute_step: run one step's forward pass over *plan and sample.  Write sampled_out[r] for every
 * r < plan->num_sampled: the token sampled for sampled_request_ids[r], below the scheduler's
 * vocab_size when it has one, and never 0xFFFFFFFF: the scheduler sets every entry to
 * 0xFFFFFFFF before the call and fails the step (nothing applied) when one is left so.  logprobs_out is NULL
 * unless the scheduler asks for log-probabilities; when not NULL it has num_sampled entries and a
 * backend that sets QUALIA_STEP_WRITES_LOGPROBS in flags writes the natural-log probability of
 * each sampled token there.  A backend that cannot produce them leaves flags without that bit and
 * ignores logprobs_out (the scheduler then does not read it).  Return 0 on success; any other value
 * is the backend's own error code, and the step is not applied.
 *
 * copy_pages (may be NULL): when set, the scheduler calls it with plan->copies just before
 * execute_step for every step that has copies; when NULL, execute_step performs plan->copies
 * itself before its forward pass.  Return 0 on success.
 */
enum {
    QUALIA_STEP_WRITES_LOGPROBS = 1u, /* flags: execute_step fills logprobs_out when given */
    QUALIA_STEP_WRITES_TOPK = 2u,     /* flags: execute_step fills topk_ids_out / topk_logprobs_out
                                         when plan->num_topk > 0 */
    QUALIA_STEP_NO_CSR = 4u           /* flags: execute_step reads no kv_indptr / kv_indices /
                                         kv_last_page_len (it reads the pages through block_table
                                         and block_table_rows): the scheduler does not build the
                                         CSR form for it, and the plan it gets has
                                         num_kv_indices == 0 and those three pointers NULL */
};

/*
 * The CSR form is built only when asked for.  It costs O(context) per request and step (every
 * page of every scheduled request is listed again), while the dense block table is written only
 * where it changes (changed_rows).  A backend that attends through block_table declares
 * QUALIA_STEP_NO_CSR and the scheduler's step stays O(scheduled tokens).  The bit is a versioned
 * addition both ways: a backend built against an earlier header leaves it clear and gets the CSR
 * form as before; a scheduler built against an earlier header ignores it and builds the form.
 */

typedef int32_t (*qualia_execute_step_fn)(void *ctx, const qualia_step_plan *plan,
                                          uint32_t *sampled_out, float *logprobs_out);

typedef struct qualia_step_backend {
    uint32_t abi_version;   /* QUALIA_STEP_ABI_VERSION */
    uint32_t struct_size;   /* sizeof(qualia_step_backend) */
    uint32_t flags;         /* QUALIA_STEP_WRITES_LOGPROBS | QUALIA_STEP_WRITES_TOPK, or 0 */
    uint32_t _reserved;     /* always 0 */
    void *ctx;              /* handed back to every call */
    qualia_execute_step_fn execute_step;
    qualia_copy_pages_fn copy_pages;  /* optional */
} qualia_step_backend;

#ifdef __cplusplus
}
#endif

#endif /* QUALIA_H */
