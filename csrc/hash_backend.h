/* The built-in hash backend: private to the compiled core, not part of the backend ABI. */
#ifndef QUALIA_HASH_BACKEND_H
#define QUALIA_HASH_BACKEND_H

#include "qualia.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * The deterministic hash backend (hash_backend.c): next token = a hash of (request id,
 * position, token id), see docs/DESIGN.md "Hash backend".  Tests and benchmarks use it
 * as a backend that costs almost nothing; it is exposed to Python as qualia.HashBackend.
 */
enum {
    QUALIA_FAULT_NONE = 0,
    QUALIA_FAULT_ERROR = 1,       /* return `code` */
    QUALIA_FAULT_BATCH_SIZE = 2,  /* report n_items + 1 */
    QUALIA_FAULT_LAUNCHES = 3,    /* report 2 launches */
    QUALIA_FAULT_SWAP = 4         /* exchange identities of outputs 0 and 1 (or bump slot) */
};

typedef struct qualia_hash_backend {
    uint32_t vocab;
    int32_t fault;
    int32_t code;
    uint32_t _pad;
    uint64_t calls;         /* execute_ragged calls */
    uint64_t items;         /* items processed */
    uint64_t pages_copied;  /* copy ops seen */
    uint64_t copy_calls;
    uint64_t step_calls;    /* execute_step calls */
    uint64_t sampled;       /* sampled rows produced by execute_step */
} qualia_hash_backend;

/* execute_step's status when a plan's logits_indices names a token outside [0, num_tokens) */
#define QUALIA_HASH_BAD_PLAN (-22)

uint32_t qualia_hash_next_token(uint64_t request_id, uint32_t position, uint32_t token_id,
                                uint32_t vocab);
int32_t qualia_hash_execute_ragged(void *ctx, const qualia_batch_item *items, uint32_t n_items,
                                   const uint32_t *block_table, uint32_t n_table,
                                   qualia_batch_output *outputs, qualia_batch_receipt *receipt);
/* One engine step (the step ABI of qualia.h): for each sampled row r, with t = logits_indices[r],
 * sampled_out[r] = qualia_hash_next_token(sampled_request_ids[r], positions[t], input_ids[t]),
 * and, when logprobs_out is not NULL, logprobs_out[r] = qualia_hash_logprob(the same triple).
 * When plan->num_topk = k > 0 (QUALIA_STEP_WRITES_TOPK), row r's candidates are the k ids
 * (next + j) % vocab for j < k, next = sampled_out[r], with pseudo log-probabilities:
 * candidate 0 has qualia_hash_logprob(triple), candidate j > 0 that of candidate j - 1 less
 * (1 + (low 14 bits of the mixed word of (request, position, token_id + j))) / 4096 -- strictly
 * decreasing, exact in float32, a deterministic stand-in for a model's distribution. */
int32_t qualia_hash_execute_step(void *ctx, const qualia_step_plan *plan, uint32_t *sampled_out,
                                 float *logprobs_out);
/* A deterministic stand-in log-probability: -(low 16 bits of the hash's mixed word) / 4096,
 * exact in float32, in (-16, 0]. */
float qualia_hash_logprob(uint64_t request_id, uint32_t position, uint32_t token_id);
int32_t qualia_hash_copy_pages(void *ctx, const qualia_copy_op *ops, uint32_t n_ops);

#ifdef __cplusplus
}
#endif

#endif
