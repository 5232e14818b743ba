/* The built-in deterministic reference backend: a stand-in model whose "next token" is a hash of
 * (request_id, position, token_id), cheap enough that a benchmark through it measures the
 * scheduler, and with fault injection so tests can exercise every DecodeRoundError. */
#include <stddef.h>

#include "hash_backend.h"

static inline uint64_t qualia_hash_mix(uint64_t request_id, uint32_t position, uint32_t token_id)
{
    uint64_t x = request_id * 0x9E3779B97F4A7C15ull + (uint64_t)position * 0xBF58476D1CE4E5B9ull
                 + (uint64_t)token_id;
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 31;
    return x;
}

uint32_t qualia_hash_next_token(uint64_t request_id, uint32_t position, uint32_t token_id,
                                     uint32_t vocab)
{
    uint64_t x = qualia_hash_mix(request_id, position, token_id);
    /* multiply-high range reduction: uniform like x % vocab, without a 64-bit divide */
    return (uint32_t)(((unsigned __int128)x * vocab) >> 64);
}

float qualia_hash_logprob(uint64_t request_id, uint32_t position, uint32_t token_id)
{
    return -(float)(qualia_hash_mix(request_id, position, token_id) & 0xFFFFu) / 4096.0f;
}

int32_t qualia_hash_execute_ragged(void *ctx, const qualia_batch_item *items,
                                        uint32_t n_items, const uint32_t *block_table,
                                        uint32_t n_table, qualia_batch_output *outputs,
                                        qualia_batch_receipt *receipt)
{
    qualia_hash_backend *self = (qualia_hash_backend *)ctx;
    (void)block_table;
    (void)n_table;
    self->calls += 1;
    if (self->fault == QUALIA_FAULT_ERROR) {
        return self->code;
    }
    for (uint32_t i = 0; i < n_items; i++) {
        outputs[i].request_id = items[i].request_id;
        outputs[i].slot = items[i].slot;
        outputs[i].next_token_id = qualia_hash_next_token(
            items[i].request_id, items[i].position, items[i].token_id, self->vocab);
    }
    self->items += n_items;
    receipt->batch_size = n_items;
    receipt->backend_launches = 1;
    if (self->fault == QUALIA_FAULT_BATCH_SIZE) {
        receipt->batch_size = n_items + 1;
    } else if (self->fault == QUALIA_FAULT_LAUNCHES) {
        receipt->backend_launches = 2;
    } else if (self->fault == QUALIA_FAULT_SWAP && n_items > 0) {
        if (n_items > 1) {
            uint64_t request_id = outputs[0].request_id;
            uint32_t slot = outputs[0].slot;
            outputs[0].request_id = outputs[1].request_id;
            outputs[0].slot = outputs[1].slot;
            outputs[1].request_id = request_id;
            outputs[1].slot = slot;
        } else {
            outputs[0].slot += 1;
        }
    }
    return 0;
}

int32_t qualia_hash_execute_step(void *ctx, const qualia_step_plan *plan, uint32_t *sampled_out,
                                 float *logprobs_out)
{
    qualia_hash_backend *self = (qualia_hash_backend *)ctx;
    uint32_t m = plan->num_sampled;
    self->step_calls += 1;
    if (self->fault == QUALIA_FAULT_ERROR) {
        return self->code;
    }
    for (uint32_t r = 0; r < m; r++) {
        int32_t t = plan->logits_indices[r];
        if (t < 0 || (uint32_t)t >= plan->num_tokens) {
            return QUALIA_HASH_BAD_PLAN;
        }
        uint64_t request_id = plan->sampled_request_ids[r];
        uint32_t position = (uint32_t)plan->positions[t];
        uint32_t token_id = plan->input_ids[t];
        sampled_out[r] = qualia_hash_next_token(request_id, position, token_id, self->vocab);
        if (logprobs_out != NULL) {
            logprobs_out[r] = qualia_hash_logprob(request_id, position, token_id);
        }
    }
    /* beam rows (fields appended to the plan: read only when struct_size covers them) */
    if (plan->struct_size >= offsetof(qualia_step_plan, topk_logprobs_out) + sizeof(float *)
        && plan->num_topk > 0 && plan->topk_ids_out != NULL && plan->topk_logprobs_out != NULL) {
        uint32_t k = plan->num_topk;
        for (uint32_t r = 0; r < m; r++) {
            int32_t t = plan->logits_indices[r];
            uint64_t request_id = plan->sampled_request_ids[r];
            uint32_t position = (uint32_t)plan->positions[t];
            uint32_t token_id = plan->input_ids[t];
            uint32_t base = qualia_hash_next_token(request_id, position, token_id, self->vocab);
            float lp = qualia_hash_logprob(request_id, position, token_id);
            for (uint32_t j = 0; j < k; j++) {
                if (j > 0) {
                    uint64_t x = qualia_hash_mix(request_id, position, token_id + j);
                    lp -= (float)(1u + (uint32_t)(x & 0x3FFFu)) / 4096.0f;
                }
                plan->topk_ids_out[(size_t)r * k + j] = (uint32_t)((base + (uint64_t)j) % self->vocab);
                plan->topk_logprobs_out[(size_t)r * k + j] = lp;
            }
        }
    }
    self->sampled += m;
    return 0;
}

int32_t qualia_hash_copy_pages(void *ctx, const qualia_copy_op *ops, uint32_t n_ops)
{
    qualia_hash_backend *self = (qualia_hash_backend *)ctx;
    (void)ops;
    self->copy_calls += 1;
    self->pages_copied += n_ops;
    return 0;
}
