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
    return out;
}

static PyMethodDef example_methods[] = {
    {"new", example_new, METH_VARARGS, "new(vocab, delay_us=0) -> backend capsule"},
    {"stats", example_stats, METH_O, "stats(capsule) -> (calls, items, pages_copied)"},
    {"layout", example_layout, METH_NOARGS, "ABI layout as this compiler sees qualia.h"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef example_module = {PyModuleDef_HEAD_INIT, "example_backend",
                                            "An out-of-tree C backend for qualia.", -1,
                                            example_methods};

PyMODINIT_FUNC PyInit_example_backend(void) { return PyModule_Create(&example_module); }
