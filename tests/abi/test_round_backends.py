"""C backends (the capsule ABI and its checks), the built-in hash backend, the Python protocol,
and concurrency while a round runs without the GIL (driven by examples/c_backend, compiled at test
time by the `example_backend` fixture of conftest.py; tests/abi/test_out_of_tree_backends.py
drives the out-of-tree examples themselves)."""

import ctypes
import threading
import time

import numpy as np
import pytest

import qualia
from qualia import twin as ref
from qualia.errors import BackendAbiError, BusyError, DecodeRoundError, RaggedBackendError


def example_next(item, table, vocab):
    pages = table[item["block_table_offset"]: item["block_table_offset"] + item["logical_pages"]]
    return (31 * int(item["token_id"]) + int(item["position"])
            + int(pages.astype(np.uint64).sum())) % vocab


class PyExample:
    """The example C backend's rule in Python, for comparison."""

    def __init__(self, vocab):
        self.vocab = vocab

    def execute_ragged(self, items, block_table, outputs):
        for i, it in enumerate(items):
            outputs[i] = (it["request_id"], it["slot"], example_next(it, block_table, self.vocab))
        return (len(items), 1)

    def copy_pages(self, copies):
        pass


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


def test_hash_backend_matches_its_python_twin():
    pool, store, sched = make_world()
    pool2, store2, sched2 = make_world()
    b1, b2 = scratch(8, 6), scratch(8, 6)
    for _ in range(10):
        assert sched.execute_decode_round(qualia.HashBackend(), *b1) == \
            sched2.execute_decode_round(ref.PyHashBackend(), *b2)
        assert np.array_equal(b1[2], b2[2])
    # the C backend's Python methods compute the same as its capsule
    be = qualia.HashBackend(vocab=50)
    items, table, outs = b1[0][:5].copy(), b1[1].copy(), np.zeros(5, qualia.RAGGED_BATCH_OUTPUT)
    assert be.execute_ragged(items, table, outs) == (5, 1)
    for it, o in zip(items, outs):
        assert o["next_token_id"] == qualia.hash_next_token(
            int(it["request_id"]), int(it["position"]), int(it["token_id"]), 50)
        assert o["next_token_id"] == ref.PyHashBackend.next_token(
            int(it["request_id"]), int(it["position"]), int(it["token_id"]), 50)


def test_c_backend_status_becomes_backend_failed_with_code():
    pool, store, sched = make_world()
    before = sched.runnable()
    with pytest.raises(DecodeRoundError.Backend) as info:
        sched.execute_decode_round(qualia.HashBackend(fault="error", code=42), *scratch(8, 6))
    assert isinstance(info.value.cause, RaggedBackendError.Failed)
    assert info.value.cause.code == 42
    assert info.value.chain == ("DecodeRoundError.Backend", "RaggedBackendError.Failed")
    assert np.array_equal(before, sched.runnable())


@pytest.mark.parametrize("fault,err", [("batch_size", DecodeRoundError.OutputIdentityMismatch),
                                       ("launches", DecodeRoundError.BackendLaunchCount),
                                       ("swap", DecodeRoundError.OutputIdentityMismatch)])
def test_c_backend_faults_change_nothing(fault, err):
    pool, store, sched = make_world()
    before = (sched.runnable(), [sched.pending_token(r * 7 + 1) for r in range(5)])
    with pytest.raises(err):
        sched.execute_decode_round(qualia.HashBackend(fault=fault), *scratch(8, 6))
    after = (sched.runnable(), [sched.pending_token(r * 7 + 1) for r in range(5)])
    assert np.array_equal(before[0], after[0]) and before[1] == after[1]


class _CBackend(ctypes.Structure):
    _fields_ = [("abi_version", ctypes.c_uint32), ("struct_size", ctypes.c_uint32),
                ("ctx", ctypes.c_void_p), ("execute_ragged", ctypes.c_void_p),
                ("copy_pages", ctypes.c_void_p)]


def _capsule(struct, name):
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(ctypes.addressof(struct), name, None)


@pytest.mark.parametrize("field,value,needle", [
    ("name", b"other.backend", "named 'other.backend'"),
    ("abi_version", 2, "ABI version 2"),
    ("struct_size", 8, "struct_size 8"),
    ("execute_ragged", None, "NULL"),
])
def test_capsule_validation_names_what_it_expected(field, value, needle):
    good = ctypes.cast(ctypes.pythonapi.Py_IncRef, ctypes.c_void_p).value  # never called
    s = _CBackend(1, 32, None, good, None)
    name = qualia.BACKEND_CAPSULE_NAME.encode()
    if field == "name":
        name = value
    else:
        setattr(s, field, value)
    cap = _capsule(s, name)
    pool, store, sched = make_world()
    before = sched.runnable()
    with pytest.raises(BackendAbiError, match=needle) as info:
        sched.execute_decode_round(cap, *scratch(8, 6))
    assert isinstance(info.value, TypeError) and isinstance(info.value, qualia.QualiaError)
    assert np.array_equal(before, sched.runnable())


def test_non_capsule_attribute_is_rejected():
    pool, store, sched = make_world()
    with pytest.raises(BackendAbiError, match="PyCapsule"):
        sched.execute_decode_round(type("B", (), {"__qualia_backend__": 3})(), *scratch(8, 6))


def test_hash_backend_capsule_outlives_its_object():
    be = qualia.HashBackend(vocab=10)
    cap = be.__qualia_backend__
    del be
    pool, store, sched = make_world()
    assert sched.execute_decode_round(cap, *scratch(8, 6)) == (5, 1)


def test_python_protocol_is_runtime_checkable():
    assert isinstance(PyExample(3), qualia.RaggedBackend)
    assert isinstance(PyExample(3), qualia.CopyPagesBackend)
    assert isinstance(qualia.HashBackend(), qualia.CopyPagesBackend)
    assert not isinstance(object(), qualia.RaggedBackend)


def test_round_runs_without_the_gil_and_other_threads_get_busy(example_backend):
    """While a slow C backend runs (GIL released), another thread's mutating calls on the same
    scheduler, pool or store raise BusyError and change nothing; reads still work."""
    cap = example_backend.new(1000, 300_000)  # 0.3 s inside each call
    s = qualia.Scheduler(max_requests=4, num_pages=32, page_tokens=4, logical_pages=8)
    for rid in range(3):
        s.admit(rid)
        s.reserve(rid, 5)
        s.advance(rid, 5)
        s.complete_prefill(rid, 7)
    result = {}

    def worker():
        result["r"] = s.decode(cap)

    before = (s.stats(), s.pool.refcounts())
    t = threading.Thread(target=worker)
    t.start()
    deadline = time.monotonic() + 60
    while example_backend.stats(cap)[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.001)  # until the backend has been entered, with the GIL released
    assert example_backend.stats(cap)[0] == 1, "the round never entered the backend"
    assert t.is_alive()
    busy_calls = [
        lambda: s.finish(0), lambda: s.admit(9), lambda: s.reserve(1, 1),
        lambda: s.advance(1, 1), lambda: s.decode(cap), lambda: s.pool.allocate(),
        lambda: s.pool.release(0), lambda: s.evict_lru(), lambda: s.requests.record_token(1),
        lambda: s.requests.finish(2, s.pool),
        lambda: s.prefixes.publish(qualia.PrefixIdentity.of_tokens([1]), [0], 1, s.pool),
    ]
    for call in busy_calls:
        with pytest.raises(BusyError):
            call()
    assert s.active_count == 3 and len(s.runnable()) == 3  # reads are fine mid-round
    t.join()
    receipt, out = result["r"]
    assert receipt == (3, 1) and len(out) == 3
    assert s.stats()["decode_rounds"] == before[0]["decode_rounds"] + 1
    # and afterwards everything works again
    s.finish(0)
    assert s.active_count == 2


def test_hammering_threads_never_corrupt_state(example_backend):
    cap = example_backend.new(1000, 2_000)
    s = qualia.Scheduler(max_requests=8, num_pages=512, page_tokens=4, logical_pages=64)
    for rid in range(6):
        s.admit(rid)
        s.reserve(rid, 3)
        s.advance(rid, 3)
        s.complete_prefill(rid, 1)
    stop = threading.Event()
    errors = []
    done = {"rounds": 0, "requests": 0}

    def decoder():
        for _ in range(150):  # stays inside logical_pages * page_tokens
            if stop.is_set():
                break
            try:
                s.decode(cap)
                done["rounds"] += 1
            except Exception as exc:  # pragma: no cover - would be a bug
                errors.append(exc)

    def unless_busy(call):
        """Run one step of a request's life; a BusyError (a round holds the scheduler) changed
        nothing, so the same step is tried again, never skipped."""
        while True:
            try:
                return call()
            except BusyError:
                time.sleep(0)

    def churner():
        rid = 100
        while not stop.is_set():
            try:
                unless_busy(lambda: s.admit(rid))
                unless_busy(lambda: s.reserve(rid, 2))
                unless_busy(lambda: s.advance(rid, 2))
                unless_busy(lambda: s.complete_prefill(rid, 3))
                unless_busy(lambda: s.finish(rid))
            except Exception as exc:  # pragma: no cover - would be a bug
                errors.append(exc)
                return
            done["requests"] += 1
            rid += 1

    threads = [threading.Thread(target=decoder), threading.Thread(target=churner)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join()
    assert not errors
    assert done["rounds"] > 0 and done["requests"] > 0
    assert sorted(s.runnable()["request_id"].tolist()) == list(range(6))  # the churner's are gone
    for rid in range(6):
        s.finish(rid)
    assert s.active_count == 0
    assert s.free_pages == s.num_pages
    assert (s.pool.refcounts() == 0).all()
