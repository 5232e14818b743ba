"""Out-of-tree backends built against the installed package, as a C or Cython engine would build
them: examples/c_backend includes only the shipped ``qualia.h`` (``qualia.get_include()``), and
examples/cython_backend cimports only the shipped ``qualia/_abi.pxd``.  Both are compiled into a
temporary folder (the ``example_backend`` and ``cython_backend`` fixtures of conftest.py), imported,
and driven through full decode rounds of ``RequestScheduler.execute_decode_round`` and
``qualia.Scheduler.decode``, output for output against the same rule in Python."""

from __future__ import annotations

import os
from importlib import metadata

import numpy as np
import pytest

import qualia

LAYOUT_DTYPES = {"item": qualia.RAGGED_BATCH_ITEM, "output": qualia.RAGGED_BATCH_OUTPUT,
                 "receipt": qualia.RAGGED_BATCH_RECEIPT, "request_view": qualia.REQUEST_VIEW,
                 "copy_op": qualia.COPY_OP}


def example_next(item, table, vocab):
    """Both examples' "model": (31 * token + position + sum of the item's pages) mod vocab."""
    pages = table[item["block_table_offset"]: item["block_table_offset"] + item["logical_pages"]]
    return (31 * int(item["token_id"]) + int(item["position"])
            + int(pages.astype(np.uint64).sum())) % vocab


class PyExample:
    """The examples' rule as a Python backend, for comparison."""

    def __init__(self, vocab):
        self.vocab = vocab

    def execute_ragged(self, items, block_table, outputs):
        for i, it in enumerate(items):
            outputs[i] = (it["request_id"], it["slot"], example_next(it, block_table, self.vocab))
        return (len(items), 1)

    def copy_pages(self, copies):
        pass


class Consumer:
    """One compiled example behind one interface: new(vocab) -> backend, stats(backend)."""

    def __init__(self, kind, module):
        self.kind, self.module = kind, module

    def new(self, vocab):
        if self.kind == "c":
            return self.module.new(vocab)  # the capsule itself
        return self.module.Backend(vocab)  # an object with __qualia_backend__

    def capsule(self, backend):
        return backend if self.kind == "c" else backend.__qualia_backend__

    def stats(self, backend):
        if self.kind == "c":
            return self.module.stats(backend)
        return backend.stats()


@pytest.fixture(params=["c", "cython"])
def consumer(request):
    fixture = {"c": "example_backend", "cython": "cython_backend"}[request.param]
    return Consumer(request.param, request.getfixturevalue(fixture))


def scratch(n, pages):
    return (np.zeros(n, qualia.RAGGED_BATCH_ITEM), np.zeros(n * pages, np.uint32),
            np.zeros(n, qualia.RAGGED_BATCH_OUTPUT))


def make_world(n_requests=5, pages_each=3, max_requests=8, logical_pages=6):
    pool = qualia.BlockPool(64)
    store = qualia.PrefixKvStore(4, 4)
    sched = qualia.RequestScheduler(max_requests, logical_pages)
    for rid in range(n_requests):
        sched.admit_with_prefix(rid * 7 + 1, None, store, pool)
        for lp in range(pages_each - (rid % 2)):
            sched.ensure_writable(rid * 7 + 1, lp, pool)
        for _ in range(rid * 3):
            sched.record_token(rid * 7 + 1)
        sched.mark_prefill_complete(rid * 7 + 1)
        sched.seed_decode_token(rid * 7 + 1, 100 + rid)
    return pool, store, sched


def test_c_consumer_sees_the_same_layout(example_backend):
    c_layout = example_backend.layout()
    for name, dtype in LAYOUT_DTYPES.items():
        size, align, fields = c_layout[name]
        assert size == dtype.itemsize and align == dtype.alignment
        assert {f: dtype.fields[f][1] for f in dtype.names} == fields
    assert c_layout["backend"][0] == qualia._core.BACKEND_STRUCT_SIZE
    assert list(c_layout["backend"][2]) == ["abi_version", "struct_size", "ctx", "execute_ragged",
                                            "copy_pages"]


def test_cython_consumer_sees_the_same_sizes(cython_backend):
    sizes = cython_backend.sizes()
    assert {name: sizes[name] for name in LAYOUT_DTYPES} == \
        {name: dtype.itemsize for name, dtype in LAYOUT_DTYPES.items()}
    assert sizes["backend"] == qualia._core.BACKEND_STRUCT_SIZE


@pytest.mark.parametrize("handover", ["capsule", "attribute", "method", "as_built"])
def test_consumer_drives_full_rounds(consumer, handover):
    backend = consumer.new(1000)
    cap = consumer.capsule(backend)
    given = {"capsule": cap, "attribute": type("B", (), {"__qualia_backend__": cap})(),
             "method": type("B", (), {"__qualia_backend__": lambda self: cap})(),
             "as_built": backend}[handover]
    pool, store, sched = make_world()
    pool2, store2, sched2 = make_world()
    bufs, bufs2 = scratch(8, 6), scratch(8, 6)
    for _ in range(20):
        r = sched.execute_decode_round(given, *bufs)
        r2 = sched2.execute_decode_round(PyExample(1000), *bufs2)
        assert r == r2 == (5, 1)
        assert np.array_equal(bufs[2][:5], bufs2[2][:5])
        assert np.array_equal(sched.runnable(), sched2.runnable())
        for rid in range(5):
            assert sched.pending_token(rid * 7 + 1) == sched2.pending_token(rid * 7 + 1)
    assert consumer.stats(backend)[:2] == (20, 100)


def test_consumer_returns_its_own_status(consumer):
    """Called through its struct as the scheduler calls it, with an item whose pages lie outside
    the block table, each example returns its status 17 (which a scheduler would raise as
    DecodeRoundError.Backend(RaggedBackendError.Failed(17)))."""
    backend = consumer.new(1000)
    items, table, outputs = scratch(2, 2)
    items["logical_pages"] = 1
    assert _call_execute(consumer.capsule(backend), items, table, outputs) == 0
    items[0]["block_table_offset"] = 2
    items[0]["logical_pages"] = 3  # past the end of the 4-entry table
    assert _call_execute(consumer.capsule(backend), items, table, outputs) == 17


def _call_execute(capsule, items, table, outputs):
    """Call a capsule's execute_ragged directly, as a scheduler would (ctypes)."""
    import ctypes

    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    ptr = get(capsule, qualia.BACKEND_CAPSULE_NAME.encode())

    class Iface(ctypes.Structure):
        _fields_ = [("abi_version", ctypes.c_uint32), ("struct_size", ctypes.c_uint32),
                    ("ctx", ctypes.c_void_p), ("execute_ragged", ctypes.c_void_p),
                    ("copy_pages", ctypes.c_void_p)]

    iface = Iface.from_address(ptr)
    assert iface.abi_version == qualia.BACKEND_ABI_VERSION
    assert iface.struct_size == qualia._core.BACKEND_STRUCT_SIZE
    fn = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32,
                          ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p,
                          ctypes.c_void_p)(iface.execute_ragged)
    receipt = np.zeros(1, qualia.RAGGED_BATCH_RECEIPT)
    return fn(iface.ctx, items.ctypes.data, len(items), table.ctypes.data, len(table),
              outputs.ctypes.data, receipt.ctypes.data)


def test_facade_with_consumer_and_python_backends_gives_identical_outputs(consumer):
    def run(backend):
        s = qualia.Scheduler(max_requests=6, num_pages=48, page_tokens=4, logical_pages=12,
                             prefix_caching="explicit")
        prompt = list(range(50, 60))
        outs, copied_by_caller = {}, 0
        for rid in range(4):
            p = prompt + [rid] * (rid + 1)
            adm = s.admit(rid, p, prefix_len=len(prompt))
            start = adm.prefix_tokens
            copied_by_caller += len(s.reserve(rid, len(p) - start))  # the caller's to copy
            s.advance(rid, len(p) - start)
            s.complete_prefill(rid, p[-1])
            if not adm.prefix_hit:
                s.publish_prefix(rid, p, prefix_len=len(prompt))
            outs[rid] = []
        for _ in range(30):
            receipt, out = s.decode(backend)  # copy-on-write copies go to backend's copy_pages
            assert receipt.backend_launches == 1
            for o in out:
                outs[int(o["request_id"])].append(int(o["next_token_id"]))
        stats = s.stats()
        for rid in range(4):
            s.finish(rid)
        held = sum(len(s.prefixes.pages_of(i)) for i in s.prefixes.identities())
        assert s.free_pages == s.num_pages - held
        return outs, stats, copied_by_caller

    backend = consumer.new(997)
    c_outs, c_stats, c_copied = run(backend)
    py_outs, py_stats, py_copied = run(PyExample(997))
    assert c_outs == py_outs
    assert c_stats == py_stats and c_copied == py_copied
    assert c_stats["prefix_hits"] == 3
    calls, items, pages_copied = consumer.stats(backend)
    assert calls == c_stats["decode_rounds"] == 30
    assert items == sum(len(v) for v in c_outs.values())
    # every copy-on-write copy of a decode round went to the consumer's copy_pages
    assert pages_copied == c_stats["pages_copied"] - c_copied > 0


def test_cython_capsule_outlives_its_backend_object(cython_backend):
    backend = cython_backend.Backend(10)
    cap = backend.__qualia_backend__
    del backend
    pool, store, sched = make_world()
    assert sched.execute_decode_round(cap, *scratch(8, 6)) == (5, 1)


def test_cython_backend_rejects_a_zero_vocab(cython_backend):
    with pytest.raises(ValueError, match="vocab"):
        cython_backend.Backend(0)


# -- what the installed distribution holds --------------------------------------------------------


def _installed_distribution():
    """The distribution that holds the imported package, or None when the imported package is
    the source tree itself (an editable install, or ``python -m pytest`` from the checkout,
    which puts the checkout first on sys.path).  Looked up where the package was imported from,
    so a checkout's own ``qualia.egg-info`` is never taken for the installed distribution."""
    package = os.path.dirname(os.path.abspath(qualia.__file__))
    if os.path.isdir(os.path.join(package, "core")):    # the compiled core's sources are here
        return None
    found = list(metadata.distributions(name="qualia", path=[os.path.dirname(package)]))
    assert found, f"no qualia distribution beside the imported package in {package}"
    return found[0]


def test_installed_package_ships_the_interface_and_no_sources():
    """The wheel carries the header, the .pxd, the stubs and py.typed, but no .pyx/.pxi/.c."""
    dist = _installed_distribution()
    if dist is None:
        pytest.skip("the imported package is the source tree itself")
    files = {str(f).replace(os.sep, "/") for f in dist.files or ()}
    for name in ("qualia/include/qualia.h", "qualia/_abi.pxd", "qualia/__init__.pyi",
                 "qualia/_core.pyi", "qualia/py.typed"):
        assert name in files, name
    sources = sorted(f for f in files if f.endswith((".pyx", ".pxi", ".c")))
    assert not sources, sources
