/*
 * An out-of-tree C decode backend for qualia: a CPython extension module that includes only
 * qualia.h (found with qualia.get_include()) and hands the scheduler a `qualia_backend` in a
 * PyCapsule.  The scheduler calls it with the GIL released; nothing here touches Python during a
 * round.
 *
 * Its "model" is a checksum: next token = (31 * token_id + position + sum of the item's pages)
 * mod vocab, so a test can tell that every item saw exactly its own slice of the block table.
 *
 *   example_backend.new(vocab, delay_us=0) -> capsule   (delay_us sleeps inside each call)
 *   example_backend.stats(capsule) -> (calls, items, pages_copied)
 *   example_backend.layout() -> {struct: (sizeof, {field: offsetof})} as this compiler sees it
 *
 * It is also a step backend (the step ABI of qualia.h): one whole engine step per call.
 *
 *   example_backend.new_step(vocab, logprobs=False, topk=True, delay_us=0)
 *       -> "qualia.step_backend.v1" capsule   (delay_us sleeps inside each step)
 *   example_backend.step_stats(capsule) -> (steps, sampled, pages_copied)
 *
 * Its step "model": for sampled row r, with t = logits_indices[r] and i the request whose tokens
 * hold t, next token = (31 * input_ids[t] + positions[t] + seq_lens[i] + sum of request i's
 * kv_indices) mod vocab.  Before sampling it checks that the plan is self-consistent (each
 * request's block-table row starts with its kv_indices, and every token's slot_mapping names the
 * page of its position), returning status 18 / 19 otherwise.  With logprobs it declares
 * QUALIA_STEP_WRITES_LOGPROBS and writes -(next token) / vocab (float32).
 *
 * Beam candidates: with topk (the default) it declares QUALIA_STEP_WRITES_TOPK, and for a plan
 * with k = num_topk > 0 it writes, for every sampled row r and j < k, candidate j = (next + j) mod
 * vocab with log-probability (-(next) / vocab) - j, both steps in float32: candidate 0 is the
 * sampled token with its logprob, and the log-probabilities strictly decrease, so the candidates
 * are best first without ties.  A plan asking for more candidates than the vocabulary has ids
 * (k > vocab) gets status 23.  topk=False leaves the flag out: the scheduler then never hands it
 * a plan with beam rows.
 *
 * Reading a plan (the pattern for every ABI consumer): plan->struct_size is the size of
 * qualia_step_plan as the scheduler was compiled, and a field exists for this call only when it
 * lies inside it (PLAN_HAS below).  A backend built against an older header never reads past the
 * fields it knows, which a newer scheduler's plan always has; a backend built against this header
 * must check struct_size before reading num_topk and the candidate buffers, since an older
 * scheduler's plan ends before them (then there are no beam rows: k is 0).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <time.h>

#include "qualia.h"

typedef struct example_backend {
    qualia_backend iface; /* first, so the capsule pointer is the interface */
    uint32_t vocab;
    uint32_t delay_us;
    uint64_t calls;
    uint64_t items;
    uint64_t pages_copied;
} example_backend;

static int32_t example_execute(void *ctx, const qualia_batch_item *items, uint32_t n_items,
                               const uint32_t *block_table, uint32_t n_table,
                               qualia_batch_output *outputs, qualia_batch_receipt *receipt)
{
    example_backend *self = (example_backend *)ctx;
    self->calls++;
    if (self->delay_us) {
        struct timespec ts = {self->delay_us / 1000000u, (long)(self->delay_us % 1000000u) * 1000L};
        nanosleep(&ts, NULL);
    }
    for (uint32_t i = 0; i < n_items; i++) {
        const qualia_batch_item *it = &items[i];
        if ((uint64_t)it->block_table_offset + it->logical_pages > n_table) {
            return 17; /* the lowered table does not hold this item's pages */
        }
        uint64_t sum = 0;
        for (uint32_t k = 0; k < it->logical_pages; k++) sum += block_table[it->block_table_offset + k];
        outputs[i].request_id = it->request_id;
        outputs[i].slot = it->slot;
        outputs[i].next_token_id =
            (uint32_t)((31ull * it->token_id + it->position + sum) % self->vocab);
    }
    self->items += n_items;
    receipt->batch_size = n_items;
    receipt->backend_launches = 1;
    return 0;
}

static int32_t example_copy_pages(void *ctx, const qualia_copy_op *ops, uint32_t n_ops)
{
    example_backend *self = (example_backend *)ctx;
    (void)ops;
    self->pages_copied += n_ops;
    return 0;
}

typedef struct example_step_backend {
    qualia_step_backend iface; /* first, so the capsule pointer is the interface */
    uint32_t vocab;
    uint32_t delay_us;
    uint64_t steps;
    uint64_t sampled;
    uint64_t pages_copied;
} example_step_backend;

static int32_t example_step_check(const qualia_step_plan *p)
{
    for (uint32_t i = 0; i < p->num_requests; i++) {
        const int32_t *row = p->block_table + (size_t)p->block_table_rows[i] * p->block_table_row_stride;
        int32_t lo = p->kv_indptr[i], hi = p->kv_indptr[i + 1];
        if ((uint32_t)(hi - lo) > p->block_table_num_cols) return 18;
        for (int32_t k = lo; k < hi; k++) {
            if (row[k - lo] != p->kv_indices[k]) return 18;
        }
        for (int32_t t = p->query_start_loc[i]; t < p->query_start_loc[i + 1]; t++) {
            uint32_t pos = (uint32_t)p->positions[t];
            uint32_t lp = pos / p->page_tokens;
            if ((int64_t)lp >= hi - lo) return 19;
            int64_t want = (int64_t)p->kv_indices[lo + lp] * p->page_tokens + pos % p->page_tokens;
            if (p->slot_mapping[t] != want) return 19;
        }
    }
    return 0;
}

/* Whether the plan, as the scheduler that built it was compiled, has `field` (read it only then). */
#define PLAN_HAS(plan, field) \
    ((plan)->struct_size >= offsetof(qualia_step_plan, field) + sizeof((plan)->field))

static int32_t example_execute_step(void *ctx, const qualia_step_plan *plan,
                                    uint32_t *sampled_out, float *logprobs_out)
{
    example_step_backend *self = (example_step_backend *)ctx;
    self->steps++;
    if (self->delay_us) {
        struct timespec ts = {self->delay_us / 1000000u, (long)(self->delay_us % 1000000u) * 1000L};
        nanosleep(&ts, NULL);
    }
    /* the fields of the first step ABI must all be there */
    if (!PLAN_HAS(plan, finished_request_ids) || plan->page_tokens == 0) return 20;
    /* the beam-row fields were appended later: an older scheduler's plan has none */
    uint32_t topk = 0;
    if ((self->iface.flags & QUALIA_STEP_WRITES_TOPK) && PLAN_HAS(plan, topk_logprobs_out)) {
        topk = plan->num_topk;
        if (topk > 0 && (plan->topk_ids_out == NULL || plan->topk_logprobs_out == NULL)) return 22;
        if (topk > self->vocab) return 23; /* fewer distinct ids than candidates asked for */
    }
    int32_t status = example_step_check(plan);
    if (status != 0) return status;
    uint32_t i = 0;
    for (uint32_t r = 0; r < plan->num_sampled; r++) {
        int32_t t = plan->logits_indices[r];
        if (t < 0 || (uint32_t)t >= plan->num_tokens) return 21;
        /* the request holding flat token t (rows are sampled in plan order) */
        while (i + 1 < plan->num_requests && plan->query_start_loc[i + 1] <= t) i++;
        uint64_t sum = 0;
        for (int32_t k = plan->kv_indptr[i]; k < plan->kv_indptr[i + 1]; k++) {
            sum += (uint32_t)plan->kv_indices[k];
        }
        uint32_t next = (uint32_t)((31ull * plan->input_ids[t] + (uint32_t)plan->positions[t]
                                    + (uint32_t)plan->seq_lens[i] + sum) % self->vocab);
        float lp = -(float)next / (float)self->vocab;
        sampled_out[r] = next;
        if (logprobs_out != NULL) logprobs_out[r] = lp;
        for (uint32_t j = 0; j < topk; j++) { /* row r's candidates, best first */
            plan->topk_ids_out[(size_t)r * topk + j] = (uint32_t)(((uint64_t)next + j) % self->vocab);
            plan->topk_logprobs_out[(size_t)r * topk + j] = lp - (float)j;
        }
    }
    self->sampled += plan->num_sampled;
    return 0;
}

static int32_t example_step_copy_pages(void *ctx, const qualia_copy_op *ops, uint32_t n_ops)
{
    example_step_backend *self = (example_step_backend *)ctx;
    (void)ops;
    self->pages_copied += n_ops;
    return 0;
}

static void example_step_free(PyObject *capsule)
{
    PyMem_Free(PyCapsule_GetPointer(capsule, QUALIA_STEP_CAPSULE_NAME));
}

static PyObject *example_new_step(PyObject *mod, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"vocab", "logprobs", "topk", "delay_us", NULL};
    unsigned int vocab, delay_us = 0;
    int logprobs = 0, topk = 1;
    (void)mod;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "I|ppI", kwlist, &vocab, &logprobs, &topk,
                                     &delay_us)) {
        return NULL;
    }
    if (vocab == 0) {
        PyErr_SetString(PyExc_ValueError, "vocab must be at least 1");
        return NULL;
    }
    example_step_backend *b = PyMem_Calloc(1, sizeof *b);
    if (!b) return PyErr_NoMemory();
    b->iface.abi_version = QUALIA_STEP_ABI_VERSION;
    b->iface.struct_size = sizeof(qualia_step_backend);
    b->iface.flags = (logprobs ? QUALIA_STEP_WRITES_LOGPROBS : 0u)
                     | (topk ? QUALIA_STEP_WRITES_TOPK : 0u);
    b->iface.ctx = b;
    b->iface.execute_step = example_execute_step;
    b->iface.copy_pages = example_step_copy_pages;
    b->vocab = vocab;
    b->delay_us = delay_us;
    PyObject *cap = PyCapsule_New(&b->iface, QUALIA_STEP_CAPSULE_NAME, example_step_free);
    if (!cap) PyMem_Free(b);
    return cap;
}

static PyObject *example_step_stats(PyObject *mod, PyObject *cap)
{
    (void)mod;
    example_step_backend *b = PyCapsule_GetPointer(cap, QUALIA_STEP_CAPSULE_NAME);
    if (!b) return NULL;
    return Py_BuildValue("(KKK)", (unsigned long long)b->steps, (unsigned long long)b->sampled,
                         (unsigned long long)b->pages_copied);
}

static void example_free(PyObject *capsule)
{
    PyMem_Free(PyCapsule_GetPointer(capsule, QUALIA_BACKEND_CAPSULE_NAME));
}

static PyObject *example_new(PyObject *mod, PyObject *args)
{
    unsigned int vocab, delay_us = 0;
    (void)mod;
    if (!PyArg_ParseTuple(args, "I|I", &vocab, &delay_us)) return NULL;
    if (vocab == 0) {
        PyErr_SetString(PyExc_ValueError, "vocab must be at least 1");
        return NULL;
    }
    example_backend *b = PyMem_Calloc(1, sizeof *b);
    if (!b) return PyErr_NoMemory();
    b->iface.abi_version = QUALIA_BACKEND_ABI_VERSION;
    b->iface.struct_size = sizeof(qualia_backend);
    b->iface.ctx = b;
    b->iface.execute_ragged = example_execute;
    b->iface.copy_pages = example_copy_pages;
    b->vocab = vocab;
    b->delay_us = delay_us;
    PyObject *cap = PyCapsule_New(&b->iface, QUALIA_BACKEND_CAPSULE_NAME, example_free);
    if (!cap) PyMem_Free(b);
    return cap;
}

static PyObject *example_stats(PyObject *mod, PyObject *cap)
{
    (void)mod;
    example_backend *b = PyCapsule_GetPointer(cap, QUALIA_BACKEND_CAPSULE_NAME);
    if (!b) return NULL;
    return Py_BuildValue("(KKK)", (unsigned long long)b->calls, (unsigned long long)b->items,
                         (unsigned long long)b->pages_copied);
}

#define FIELD(d, T, f)                                                       \
    do {                                                                     \
        PyObject *v = PyLong_FromSize_t(offsetof(T, f));                     \
        if (!v || PyDict_SetItemString(d, #f, v) < 0) return NULL;           \
        Py_DECREF(v);                                                        \
    } while (0)
#define STRUCT(out, name, T, fields_dict)                                                   \
    do {                                                                                    \
        PyObject *t = Py_BuildValue("(nnO)", (Py_ssize_t)sizeof(T),                          \
                                    (Py_ssize_t)_Alignof(T), fields_dict);                   \
        if (!t || PyDict_SetItemString(out, name, t) < 0) return NULL;                       \
        Py_DECREF(t);                                                                       \
        Py_DECREF(fields_dict);                                                             \
    } while (0)

static PyObject *example_layout(PyObject *mod, PyObject *unused)
{
    (void)mod;
    (void)unused;
    PyObject *out = PyDict_New(), *d;
    if (!out) return NULL;
    d = PyDict_New();
    FIELD(d, qualia_batch_item, request_id); FIELD(d, qualia_batch_item, slot);
    FIELD(d, qualia_batch_item, token_id); FIELD(d, qualia_batch_item, position);
    FIELD(d, qualia_batch_item, block_table_offset); FIELD(d, qualia_batch_item, logical_pages);
    FIELD(d, qualia_batch_item, _reserved);
    STRUCT(out, "item", qualia_batch_item, d);
    d = PyDict_New();
    FIELD(d, qualia_batch_output, request_id); FIELD(d, qualia_batch_output, slot);
    FIELD(d, qualia_batch_output, next_token_id);
    STRUCT(out, "output", qualia_batch_output, d);
    d = PyDict_New();
    FIELD(d, qualia_batch_receipt, batch_size); FIELD(d, qualia_batch_receipt, backend_launches);
    STRUCT(out, "receipt", qualia_batch_receipt, d);
    d = PyDict_New();
    FIELD(d, qualia_request_view, request_id); FIELD(d, qualia_request_view, slot);
    FIELD(d, qualia_request_view, state); FIELD(d, qualia_request_view, token_count);
    FIELD(d, qualia_request_view, prefix_tokens);
    STRUCT(out, "request_view", qualia_request_view, d);
    d = PyDict_New();
    FIELD(d, qualia_copy_op, src_page); FIELD(d, qualia_copy_op, dst_page);
    STRUCT(out, "copy_op", qualia_copy_op, d);
    d = PyDict_New();
    FIELD(d, qualia_backend, abi_version); FIELD(d, qualia_backend, struct_size);
    FIELD(d, qualia_backend, ctx); FIELD(d, qualia_backend, execute_ragged);
    FIELD(d, qualia_backend, copy_pages);
    STRUCT(out, "backend", qualia_backend, d);
    d = PyDict_New();
    FIELD(d, qualia_step_plan, struct_size); FIELD(d, qualia_step_plan, page_tokens);
    FIELD(d, qualia_step_plan, num_requests); FIELD(d, qualia_step_plan, num_tokens);
    FIELD(d, qualia_step_plan, num_sampled); FIELD(d, qualia_step_plan, num_prefill_tokens);
    FIELD(d, qualia_step_plan, num_decode_tokens); FIELD(d, qualia_step_plan, num_kv_indices);
    FIELD(d, qualia_step_plan, block_table_num_rows);
    FIELD(d, qualia_step_plan, block_table_num_cols);
    FIELD(d, qualia_step_plan, block_table_row_stride);
    FIELD(d, qualia_step_plan, num_changed_rows); FIELD(d, qualia_step_plan, num_copies);
    FIELD(d, qualia_step_plan, num_new); FIELD(d, qualia_step_plan, num_preempted);
    FIELD(d, qualia_step_plan, num_finished);
    FIELD(d, qualia_step_plan, request_ids); FIELD(d, qualia_step_plan, query_start_loc);
    FIELD(d, qualia_step_plan, seq_lens); FIELD(d, qualia_step_plan, input_ids);
    FIELD(d, qualia_step_plan, positions); FIELD(d, qualia_step_plan, slot_mapping);
    FIELD(d, qualia_step_plan, logits_indices); FIELD(d, qualia_step_plan, sampled_request_ids);
    FIELD(d, qualia_step_plan, block_table); FIELD(d, qualia_step_plan, block_table_rows);
    FIELD(d, qualia_step_plan, changed_rows); FIELD(d, qualia_step_plan, kv_indptr);
    FIELD(d, qualia_step_plan, kv_indices); FIELD(d, qualia_step_plan, kv_last_page_len);
    FIELD(d, qualia_step_plan, copies); FIELD(d, qualia_step_plan, new_request_ids);
    FIELD(d, qualia_step_plan, preempted_request_ids);
    FIELD(d, qualia_step_plan, finished_request_ids);
    FIELD(d, qualia_step_plan, num_topk); FIELD(d, qualia_step_plan, num_forks);
    FIELD(d, qualia_step_plan, topk_ids_out); FIELD(d, qualia_step_plan, topk_logprobs_out);
    FIELD(d, qualia_step_plan, fork_child_ids); FIELD(d, qualia_step_plan, fork_parent_ids);
    STRUCT(out, "step_plan", qualia_step_plan, d);
    d = PyDict_New();
    FIELD(d, qualia_step_backend, abi_version); FIELD(d, qualia_step_backend, struct_size);
    FIELD(d, qualia_step_backend, flags); FIELD(d, qualia_step_backend, _reserved);
    FIELD(d, qualia_step_backend, ctx); FIELD(d, qualia_step_backend, execute_step);
    FIELD(d, qualia_step_backend, copy_pages);
    STRUCT(out, "step_backend", qualia_step_backend, d);
    return out;
}

static PyMethodDef example_methods[] = {
    {"new", example_new, METH_VARARGS, "new(vocab, delay_us=0) -> backend capsule"},
    {"stats", example_stats, METH_O, "stats(capsule) -> (calls, items, pages_copied)"},
    {"layout", example_layout, METH_NOARGS, "ABI layout as this compiler sees qualia.h"},
    {"new_step", (PyCFunction)(void (*)(void))example_new_step, METH_VARARGS | METH_KEYWORDS,
     "new_step(vocab, logprobs=False, topk=True, delay_us=0) -> step backend capsule"},
    {"step_stats", example_step_stats, METH_O, "step_stats(capsule) -> (steps, sampled, pages_copied)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef example_module = {PyModuleDef_HEAD_INIT, "example_backend",
                                            "An out-of-tree C backend for qualia.", -1,
                                            example_methods};

PyMODINIT_FUNC PyInit_example_backend(void) { return PyModule_Create(&example_module); }
