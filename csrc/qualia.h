/*
 * qualia.h: the C ABI shared by the qualia scheduler core and decode backends.
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

#ifdef __cplusplus
}
#endif

#endif /* QUALIA_H */
