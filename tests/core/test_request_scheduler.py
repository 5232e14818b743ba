"""The request scheduler and decode rounds (DESIGN.md "Request scheduler", "Decode round")."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qualia._types import Admission, RaggedBatchReceipt, RequestState
from qualia.errors import (
    BusyError,
    DecodeRoundError,
    PrefixKvError,
    RaggedBackendError,
    SchedulerError,
    TableError,
)

U32_MAX = 2**32 - 1


def world(impl, blocks=16, requests=4, logical_pages=4, entries=4, max_pages=4):
    return (impl.BlockPool(blocks), impl.PrefixKvStore(entries, max_pages),
            impl.RequestScheduler(requests, logical_pages))


def scratch(impl, items=8, table=32, outputs=8):
    return (np.zeros(items, impl.RAGGED_BATCH_ITEM), np.zeros(table, np.uint32),
            np.zeros(outputs, impl.RAGGED_BATCH_OUTPUT))


def full_state(impl, pool, store, sched):
    return (impl.pool_state(pool), impl.store_state(store), impl.sched_state(sched))


def decoding(impl, pool, store, sched, rid, pages=1, token=None):
    """Admit `rid` on a miss, write `pages` pages, and move it to Decode (seeded if token)."""
    sched.admit_with_prefix(rid, None, store, pool)
    for lp in range(pages):
        sched.ensure_writable(rid, lp, pool)
    sched.mark_prefill_complete(rid)
    if token is not None:
        sched.seed_decode_token(rid, token)


class Recorder:
    """A backend that records what it was handed, then delegates to PyHashBackend
    (or to `reply`, a function (items, table, outputs) -> receipt)."""

    def __init__(self, impl, fault=None, reply=None, **kw):
        self.inner = impl.PyHashBackend(fault=fault, **kw)
        self.reply = reply
        self.calls = 0
        self.items = self.table = None
        self.flags = None

    def execute_ragged(self, items, block_table, outputs):
        self.calls += 1
        self.items = items.copy()
        self.table = block_table.copy()
        self.flags = (items.flags.writeable, block_table.flags.writeable, outputs.flags.writeable,
                      len(items), len(block_table), len(outputs), items.dtype, outputs.dtype)
        if self.reply is not None:
            return self.reply(items, block_table, outputs)
        return self.inner.execute_ragged(items, block_table, outputs)


def test_dtype_layouts(impl):
    item = impl.RAGGED_BATCH_ITEM
    assert item.itemsize == 32
    assert {k: v[1] for k, v in item.fields.items()} == {
        "request_id": 0, "slot": 8, "token_id": 12, "position": 16, "block_table_offset": 20,
        "logical_pages": 24, "_reserved": 28}
    assert item.fields["request_id"][0] == np.dtype("<u8")
    out = impl.RAGGED_BATCH_OUTPUT
    assert out.itemsize == 16
    assert {k: v[1] for k, v in out.fields.items()} == {
        "request_id": 0, "slot": 8, "next_token_id": 12}
    view = impl.REQUEST_VIEW
    assert view.itemsize == 24
    assert {k: (v[1], v[0].itemsize) for k, v in view.fields.items()} == {
        "request_id": (0, 8), "slot": (8, 2), "state": (10, 1), "token_count": (12, 4),
        "prefix_tokens": (16, 4)}
    rec = impl.RAGGED_BATCH_RECEIPT
    assert rec.itemsize == 8
    assert {k: v[1] for k, v in rec.fields.items()} == {"batch_size": 0, "backend_launches": 4}
    cop = impl.COPY_OP
    assert cop.itemsize == 8
    assert {k: v[1] for k, v in cop.fields.items()} == {"src_page": 0, "dst_page": 4}


# -- construction ---------------------------------------------------------------------------------


def test_construction(impl):
    sched = impl.RequestScheduler(3, 5)
    assert sched.max_requests == 3 and sched.logical_pages == 5
    assert sched.active_count() == 0
    assert len(sched.runnable()) == 0
    assert impl.RequestScheduler(65536, 0).max_requests == 65536


@pytest.mark.parametrize("args, exc", [((0, 1), ValueError), ((65537, 1), OverflowError),
                                       ((-1, 1), OverflowError), ((1, -1), OverflowError),
                                       ((1, 2**32), OverflowError), ((1.0, 1), TypeError),
                                       ((True, 1), TypeError), ((1, None), TypeError)])
def test_bad_construction(impl, args, exc):
    with pytest.raises(exc):
        impl.RequestScheduler(*args)


# -- admission -------------------------------------------------------------------------------------


def test_admit_miss_starts_in_prefill(impl):
    pool, store, sched = world(impl)
    x = impl.PrefixIdentity.of_tokens([1])
    adm = sched.admit_with_prefix(10, x, store, pool)
    assert adm == Admission(0, False, 0)
    assert (adm.slot, adm.prefix_hit, adm.prefix_tokens) == (0, False, 0)
    assert store.misses == 1
    assert sched.runnable().tolist() == [(10, 0, RequestState.PREFILL, 0, 0)]
    assert sched.block_table(10) == [] and sched.pending_token(10) is None


def test_admit_without_identity(impl):
    pool, store, sched = world(impl)
    assert sched.admit_with_prefix(0, None, store, pool) == Admission(0, False, 0)
    assert store.misses == 0  # no lookup at all
    assert sched.active_count() == 1


def test_request_id_range(impl):
    pool, store, sched = world(impl)
    sched.admit_with_prefix(0, None, store, pool)
    sched.admit_with_prefix(2**64 - 1, None, store, pool)
    assert [v[0] for v in sched.runnable().tolist()] == [0, 2**64 - 1]


def test_duplicate_before_full(impl):
    pool, store, sched = world(impl, requests=1)
    sched.admit_with_prefix(7, None, store, pool)
    before = full_state(impl, pool, store, sched)
    with pytest.raises(SchedulerError.DuplicateRequest):
        sched.admit_with_prefix(7, impl.PrefixIdentity.of_tokens([1]), store, pool)
    with pytest.raises(SchedulerError.Full):
        sched.admit_with_prefix(8, impl.PrefixIdentity.of_tokens([1]), store, pool)
    assert full_state(impl, pool, store, sched) == before  # no miss counted either


def test_lowest_free_slot_reused(impl):
    pool, store, sched = world(impl)
    assert [sched.admit_with_prefix(r, None, store, pool).slot for r in (1, 2, 3)] == [0, 1, 2]
    sched.finish(2, pool)
    assert sched.admit_with_prefix(4, None, store, pool).slot == 1
    sched.finish(1, pool)
    assert sched.admit_with_prefix(5, None, store, pool).slot == 0
    assert sched.admit_with_prefix(6, None, store, pool).slot == 3
    assert [(v[0], v[1]) for v in sched.runnable().tolist()] == [(5, 0), (4, 1), (3, 2), (6, 3)]


def test_finished_id_can_be_readmitted(impl):
    pool, store, sched = world(impl)
    sched.admit_with_prefix(1, None, store, pool)
    sched.finish(1, pool)
    assert sched.admit_with_prefix(1, None, store, pool).slot == 0


def publish_prefix(impl, pool, store, sched, tokens=20, pages=2, rid=99):
    """Prefill a request over `pages` pages, publish them, finish it: the store holds them."""
    sched.admit_with_prefix(rid, None, store, pool)
    for lp in range(pages):
        sched.ensure_writable(rid, lp, pool)
    x = impl.PrefixIdentity.of_tokens(list(range(tokens)), b"ns")
    store.publish(x, sched.block_table(rid), tokens, pool)
    shared = sched.block_table(rid)
    sched.finish(rid, pool)
    return x, shared


def test_prefix_hit_starts_in_decode(impl):
    pool, store, sched = world(impl)
    x, shared = publish_prefix(impl, pool, store, sched, tokens=20, pages=2)
    adm = sched.admit_with_prefix(5, x, store, pool)
    assert adm == Admission(0, True, 20)
    assert sched.runnable().tolist() == [(5, 0, RequestState.DECODE, 20, 20)]
    assert sched.block_table(5) == shared
    assert [pool.refcount(p) for p in shared] == [2, 2]
    assert store.hits == 1 and store.misses == 0


def test_first_write_into_shared_page_is_copy(impl):
    pool, store, sched = world(impl)
    x, shared = publish_prefix(impl, pool, store, sched, tokens=20, pages=2)
    sched.admit_with_prefix(5, x, store, pool)
    cow = sched.ensure_writable(5, 1, pool)
    assert cow.kind == "copy" and cow.src == shared[1] and cow.page not in shared
    assert sched.block_table(5) == [shared[0], cow.page]
    assert store.pages_of(x) == shared
    assert [pool.refcount(p) for p in shared] == [2, 1]  # store's page intact, held once
    assert pool.refcount(cow.page) == 1
    assert sched.ensure_writable(5, 1, pool).kind == "exclusive"
    assert sched.ensure_writable(5, 2, pool).kind == "allocated"


def test_two_hits_share_then_diverge(impl):
    pool, store, sched = world(impl)
    x, shared = publish_prefix(impl, pool, store, sched, tokens=8, pages=1)
    sched.admit_with_prefix(1, x, store, pool)
    sched.admit_with_prefix(2, x, store, pool)
    assert pool.refcount(shared[0]) == 3
    a = sched.ensure_writable(1, 0, pool)
    b = sched.ensure_writable(2, 0, pool)
    assert a.kind == b.kind == "copy" and a.page != b.page
    assert pool.refcount(shared[0]) == 1
    assert store.hits == 2


def test_admission_failing_in_table_changes_nothing(impl):
    pool = impl.BlockPool(16)
    store = impl.PrefixKvStore(4, 4)
    big = impl.RequestScheduler(2, 4)
    x, _ = publish_prefix(impl, pool, store, big, tokens=30, pages=3)
    sched = impl.RequestScheduler(2, 2)  # tables too small for the 3-page prefix
    before = full_state(impl, pool, store, sched)
    with pytest.raises(SchedulerError.Prefix) as info:
        sched.admit_with_prefix(5, x, store, pool)
    err = info.value
    assert err.chain == ("SchedulerError.Prefix", "PrefixKvError.Table", "TableError.OutOfRange")
    assert isinstance(err.cause, PrefixKvError.Table)
    assert isinstance(err.cause.cause, TableError.OutOfRange)
    assert err.__cause__ is err.cause
    assert full_state(impl, pool, store, sched) == before
    assert store.hits == 0 and store.misses == 0


# -- per-request methods ---------------------------------------------------------------------------


def test_mark_prefill_complete(impl):
    pool, store, sched = world(impl)
    sched.admit_with_prefix(1, None, store, pool)
    sched.mark_prefill_complete(1)
    assert sched.runnable()["state"].tolist() == [RequestState.DECODE]
    sched.mark_prefill_complete(1)  # in Decode: stays Decode
    assert sched.runnable()["state"].tolist() == [RequestState.DECODE]


def test_seed_decode_token_any_state(impl):
    pool, store, sched = world(impl)
    sched.admit_with_prefix(1, None, store, pool)
    sched.seed_decode_token(1, 77)  # in Prefill: allowed, no state change
    assert sched.pending_token(1) == 77
    assert sched.runnable()["state"].tolist() == [RequestState.PREFILL]
    sched.mark_prefill_complete(1)
    sched.seed_decode_token(1, U32_MAX)
    assert sched.pending_token(1) == U32_MAX


def test_record_token_any_state(impl):
    pool, store, sched = world(impl)
    sched.admit_with_prefix(1, None, store, pool)
    assert sched.record_token(1) == 1
    assert sched.record_token(1) == 2
    sched.mark_prefill_complete(1)
    assert sched.record_token(1) == 3
    assert sched.runnable()["token_count"].tolist() == [3]
    assert sched.runnable()["prefix_tokens"].tolist() == [0]


def test_record_token_saturates(impl):
    pool, store, sched = world(impl)
    x, _ = publish_prefix(impl, pool, store, sched, tokens=5, pages=1)
    y = impl.PrefixIdentity.of_tokens([1], b"max")
    store.publish(y, store.pages_of(x), U32_MAX, pool)
    assert sched.admit_with_prefix(3, y, store, pool) == Admission(0, True, U32_MAX)
    assert sched.record_token(3) == U32_MAX
    assert sched.record_token(3) == U32_MAX
    assert sched.runnable().tolist() == [(3, 0, RequestState.DECODE, U32_MAX, U32_MAX)]


def test_decode_round_saturates(impl):
    pool, store, sched = world(impl)
    x, _ = publish_prefix(impl, pool, store, sched, tokens=5, pages=1)
    y = impl.PrefixIdentity.of_tokens([1], b"max")
    store.publish(y, store.pages_of(x), U32_MAX, pool)
    sched.admit_with_prefix(3, y, store, pool)
    sched.seed_decode_token(3, 11)
    backend = Recorder(impl)
    assert sched.execute_decode_round(backend, *scratch(impl)) == RaggedBatchReceipt(1, 1)
    assert backend.items["position"].tolist() == [U32_MAX]
    assert sched.runnable()["token_count"].tolist() == [U32_MAX]
    assert sched.pending_token(3) == impl.PyHashBackend.next_token(3, U32_MAX, 11)


@pytest.mark.parametrize("call", ["ensure_writable", "mark_prefill_complete", "seed_decode_token",
                                  "record_token", "finish", "block_table", "pending_token"])
def test_unknown_request(impl, call):
    pool, store, sched = world(impl)
    sched.admit_with_prefix(1, None, store, pool)
    sched.ensure_writable(1, 0, pool)
    sched.admit_with_prefix(2, None, store, pool)
    sched.finish(2, pool)  # a finished request is unknown too
    args = {"ensure_writable": (0, pool), "seed_decode_token": (5,),
            "finish": (pool,)}.get(call, ())
    before = full_state(impl, pool, store, sched)
    for rid in (2, 3):
        with pytest.raises(SchedulerError.UnknownRequest):
            getattr(sched, call)(rid, *args)
    assert full_state(impl, pool, store, sched) == before


def test_ensure_writable_table_errors_wrapped(impl):
    pool, store, sched = world(impl, blocks=2, logical_pages=3)
    sched.admit_with_prefix(1, None, store, pool)
    before = full_state(impl, pool, store, sched)
    with pytest.raises(SchedulerError.Table) as info:
        sched.ensure_writable(1, 3, pool)
    assert info.value.chain == ("SchedulerError.Table", "TableError.OutOfRange")
    with pytest.raises(SchedulerError.Table) as info:
        sched.ensure_writable(1, 1, pool)
    assert info.value.chain == ("SchedulerError.Table", "TableError.Gap")
    assert full_state(impl, pool, store, sched) == before
    sched.ensure_writable(1, 0, pool)
    sched.ensure_writable(1, 1, pool)
    with pytest.raises(SchedulerError.Table) as info:
        sched.ensure_writable(1, 2, pool)
    assert info.value.chain == ("SchedulerError.Table", "TableError.Exhausted")


# -- runnable_into ---------------------------------------------------------------------------------


def test_runnable_into_stable_slot_order(impl):
    pool, store, sched = world(impl)
    for rid in (30, 10, 20):
        sched.admit_with_prefix(rid, None, store, pool)
    sched.mark_prefill_complete(10)
    sched.record_token(20)
    out = np.zeros(5, impl.REQUEST_VIEW)
    assert sched.runnable_into(out) == 3
    assert out[:3].tolist() == [(30, 0, 1, 0, 0), (10, 1, 2, 0, 0), (20, 2, 1, 1, 0)]
    sched.finish(30, pool)
    assert sched.runnable_into(out) == 2
    assert out[:2].tolist() == [(10, 1, 2, 0, 0), (20, 2, 1, 1, 0)]
    fresh = sched.runnable()
    assert fresh.dtype == impl.REQUEST_VIEW and fresh.tolist() == out[:2].tolist()
    assert sched.runnable_into(np.zeros(2, impl.REQUEST_VIEW)) == 2


def test_runnable_into_output_too_small(impl):
    pool, store, sched = world(impl)
    for rid in (1, 2):
        sched.admit_with_prefix(rid, None, store, pool)
    out = np.zeros(1, impl.REQUEST_VIEW)
    with pytest.raises(SchedulerError.OutputTooSmall):
        sched.runnable_into(out)
    assert out.tolist() == [(0, 0, 0, 0, 0)]
    with pytest.raises(SchedulerError.OutputTooSmall):
        sched.runnable_into(np.zeros(0, impl.REQUEST_VIEW))
    empty = impl.RequestScheduler(1, 1)
    assert empty.runnable_into(np.zeros(0, impl.REQUEST_VIEW)) == 0


@pytest.mark.parametrize("make, exc", [
    (lambda d: np.zeros(4, np.uint8), TypeError),
    (lambda d: np.zeros(4, np.int64), TypeError),
    (lambda d: [0, 0, 0], TypeError),
    (lambda d: None, TypeError),
    (lambda d: np.zeros((2, 2), d), ValueError),
    (lambda d: np.zeros(8, d)[::2], ValueError),
    (lambda d: readonly(np.zeros(4, d)), ValueError),
    (lambda d: misaligned(d, 4), ValueError),
])
def test_runnable_into_bad_buffer(impl, make, exc):
    pool, store, sched = world(impl)
    sched.admit_with_prefix(1, None, store, pool)
    with pytest.raises(exc):
        sched.runnable_into(make(impl.REQUEST_VIEW))


def readonly(a):
    a.flags.writeable = False
    return a


def misaligned(dtype, n):
    raw = np.zeros(n * dtype.itemsize + 16, np.uint8)
    start = 1 if raw.ctypes.data % 8 == 0 else 0
    a = raw[start:start + n * dtype.itemsize].view(dtype)
    assert a.ctypes.data % 8 != 0
    return a


# -- decode rounds ------------------------------------------------------------------------------


def test_decode_round_lowers_and_applies(impl):
    pool, store, sched = world(impl, blocks=32, requests=5)
    decoding(impl, pool, store, sched, 100, pages=2, token=7)
    sched.admit_with_prefix(200, None, store, pool)  # Prefill: not in the round
    sched.ensure_writable(200, 0, pool)
    decoding(impl, pool, store, sched, 300, pages=1, token=9)
    decoding(impl, pool, store, sched, 400, pages=3, token=0)
    sched.record_token(300)
    sched.record_token(300)
    tables = {r: sched.block_table(r) for r in (100, 300, 400)}
    backend = Recorder(impl)
    items, table, outs = scratch(impl)
    receipt = sched.execute_decode_round(backend, items, table, outs)
    assert receipt == RaggedBatchReceipt(3, 1)
    assert isinstance(receipt, RaggedBatchReceipt)
    assert backend.calls == 1 and backend.inner.calls == 1
    assert backend.items.tolist() == [
        (100, 0, 7, 0, 0, 2, 0),
        (300, 2, 9, 2, 2, 1, 0),
        (400, 3, 0, 0, 3, 3, 0),
    ]
    assert backend.table.tolist() == tables[100] + tables[300] + tables[400]
    ro_items, ro_table, w_out, n_items, n_table, n_out, _, _ = backend.flags
    assert (ro_items, ro_table, w_out) == (False, False, True)
    assert (n_items, n_table, n_out) == (3, 6, 3)
    nt = impl.PyHashBackend.next_token
    assert sched.pending_token(100) == nt(100, 0, 7)
    assert sched.pending_token(300) == nt(300, 2, 9)
    assert sched.pending_token(400) == nt(400, 0, 0)
    assert sched.pending_token(200) is None
    assert sched.runnable()["token_count"].tolist() == [1, 0, 3, 1]
    # a second round consumes the generated tokens
    sched.execute_decode_round(backend, items, table, outs)
    assert sched.pending_token(100) == nt(100, 1, nt(100, 0, 7))
    assert sched.runnable()["token_count"].tolist() == [2, 0, 4, 2]


def test_decode_round_exact_size_buffers(impl):
    pool, store, sched = world(impl)
    decoding(impl, pool, store, sched, 1, pages=2, token=1)
    decoding(impl, pool, store, sched, 2, pages=0, token=2)  # no pages mapped yet
    backend = Recorder(impl)
    receipt = sched.execute_decode_round(backend, *scratch(impl, 2, 2, 2))
    assert receipt == (2, 1)
    assert backend.items["block_table_offset"].tolist() == [0, 2]
    assert backend.items["logical_pages"].tolist() == [2, 0]


def test_empty_round_does_not_call_backend(impl):
    pool, store, sched = world(impl)
    sched.admit_with_prefix(1, None, store, pool)  # Prefill only, unseeded
    backend = Recorder(impl)
    before = full_state(impl, pool, store, sched)
    assert sched.execute_decode_round(backend, *scratch(impl, 0, 0, 0)) == RaggedBatchReceipt(0, 0)
    assert backend.calls == 0
    assert full_state(impl, pool, store, sched) == before
    empty = impl.RequestScheduler(2, 2)
    assert empty.execute_decode_round(backend, *scratch(impl)) == (0, 0)
    assert backend.calls == 0


def failing_round(impl, sched, pool, store, backend, bufs, exc):
    before = full_state(impl, pool, store, sched)
    with pytest.raises(exc) as info:
        sched.execute_decode_round(backend, *bufs)
    assert full_state(impl, pool, store, sched) == before
    return info.value


def two_decoding(impl, seeded=(True, True)):
    pool, store, sched = world(impl)
    decoding(impl, pool, store, sched, 11, pages=2, token=3 if seeded[0] else None)
    decoding(impl, pool, store, sched, 22, pages=1, token=4 if seeded[1] else None)
    return pool, store, sched


def test_buffer_checks_in_seed_order(impl):
    pool, store, sched = two_decoding(impl)
    b = Recorder(impl)
    failing_round(impl, sched, pool, store, b, scratch(impl, 1, 0, 0),
                  DecodeRoundError.ItemBufferTooSmall)
    failing_round(impl, sched, pool, store, b, scratch(impl, 2, 0, 1),
                  DecodeRoundError.OutputBufferTooSmall)
    failing_round(impl, sched, pool, store, b, scratch(impl, 2, 2, 2),
                  DecodeRoundError.BlockTableBufferTooSmall)
    assert b.calls == 0


def test_table_buffer_checked_before_missing_token(impl):
    pool, store, sched = two_decoding(impl, seeded=(True, False))
    b = Recorder(impl)
    failing_round(impl, sched, pool, store, b, scratch(impl, 2, 2, 2),
                  DecodeRoundError.BlockTableBufferTooSmall)
    assert b.calls == 0


@pytest.mark.parametrize("seeded", [(True, False), (False, True), (False, False)])
def test_missing_input_token_fails_whole_round(impl, seeded):
    pool, store, sched = two_decoding(impl, seeded=seeded)
    b = Recorder(impl)
    failing_round(impl, sched, pool, store, b, scratch(impl),
                  DecodeRoundError.MissingInputToken)
    assert b.calls == 0


def test_backend_error_code(impl):
    pool, store, sched = two_decoding(impl)
    b = impl.PyHashBackend(fault="error", code=-7)
    err = failing_round(impl, sched, pool, store, b, scratch(impl), DecodeRoundError.Backend)
    assert isinstance(err.cause, RaggedBackendError.Failed)
    assert err.cause.code == -7
    assert err.__cause__ is err.cause
    assert err.chain == ("DecodeRoundError.Backend", "RaggedBackendError.Failed")
    assert b.calls == 1


def test_backend_python_exception_chained(impl):
    pool, store, sched = two_decoding(impl)
    b = impl.PyHashBackend(fault="raise")
    err = failing_round(impl, sched, pool, store, b, scratch(impl), DecodeRoundError.Backend)
    assert isinstance(err.cause, RuntimeError)
    assert err.__cause__ is err.cause
    assert b.calls == 1


def test_wrong_batch_size(impl):
    pool, store, sched = two_decoding(impl)
    b = impl.PyHashBackend(fault="batch_size")
    failing_round(impl, sched, pool, store, b, scratch(impl),
                  DecodeRoundError.OutputIdentityMismatch)
    assert b.calls == 1


def test_wrong_batch_size_reported_before_launch_count(impl):
    pool, store, sched = two_decoding(impl)

    def reply(items, table, outputs):
        impl.PyHashBackend().execute_ragged(items, table, outputs)
        return RaggedBatchReceipt(len(items) + 1, 2)

    failing_round(impl, sched, pool, store, Recorder(impl, reply=reply), scratch(impl),
                  DecodeRoundError.OutputIdentityMismatch)


def test_two_launches(impl):
    pool, store, sched = two_decoding(impl)
    b = impl.PyHashBackend(fault="launches")
    failing_round(impl, sched, pool, store, b, scratch(impl), DecodeRoundError.BackendLaunchCount)


@pytest.mark.parametrize("count", [1, 2])
def test_swapped_outputs(impl, count):
    pool, store, sched = world(impl)
    for rid in range(count):
        decoding(impl, pool, store, sched, rid + 1, pages=1, token=rid)
    b = impl.PyHashBackend(fault="swap")
    failing_round(impl, sched, pool, store, b, scratch(impl),
                  DecodeRoundError.OutputIdentityMismatch)


def test_outputs_checked_against_lowered_batch_not_scratch(impl):
    pool, store, sched = two_decoding(impl)
    items, table, outs = scratch(impl)

    def reply(items_view, table_view, outputs):
        items["request_id"][:2] = [555, 666]  # the caller's writable buffer, not the view
        outputs[:2] = [(555, 0, 1), (666, 1, 2)]
        return (2, 1)

    failing_round(impl, sched, pool, store, Recorder(impl, reply=reply), (items, table, outs),
                  DecodeRoundError.OutputIdentityMismatch)


def test_views_are_read_only(impl):
    pool, store, sched = two_decoding(impl)

    def reply(items, table, outputs):
        items["token_id"][0] = 1

    err = failing_round(impl, sched, pool, store, Recorder(impl, reply=reply), scratch(impl),
                        DecodeRoundError.Backend)
    assert isinstance(err.cause, ValueError)


@pytest.mark.parametrize("receipt", [None, 2, (2,), (2, 1, 0), ("2", 1), (2.0, 1), (-1, 1),
                                     (2, -1), (True, 1), "21", {"batch_size": 2}])
def test_malformed_receipt(impl, receipt):
    pool, store, sched = two_decoding(impl)

    def reply(items, table, outputs):
        impl.PyHashBackend().execute_ragged(items, table, outputs)
        return receipt

    err = failing_round(impl, sched, pool, store, Recorder(impl, reply=reply), scratch(impl),
                        DecodeRoundError.Backend)
    assert isinstance(err.cause, TypeError)


@pytest.mark.parametrize("receipt", [[2, 1], (np.uint32(2), np.int64(1)), RaggedBatchReceipt(2, 1)])
def test_receipt_forms_accepted(impl, receipt):
    pool, store, sched = two_decoding(impl)

    def reply(items, table, outputs):
        impl.PyHashBackend().execute_ragged(items, table, outputs)
        return receipt

    assert sched.execute_decode_round(Recorder(impl, reply=reply), *scratch(impl)) == (2, 1)
    assert sched.runnable()["token_count"].tolist() == [1, 1]


@pytest.mark.parametrize("which, make, exc", [
    (0, lambda: np.zeros(4, np.uint8), TypeError),
    (1, lambda: np.zeros(4, np.int32), TypeError),
    (1, lambda: np.zeros(4, ">u4"), TypeError),
    (1, lambda: [0, 0, 0, 0], TypeError),
    (2, lambda: None, TypeError),
    (0, "2d", ValueError),
    (1, lambda: np.zeros(16, np.uint32)[::2], ValueError),
    (2, "readonly", ValueError),
    (0, "readonly", ValueError),
    (1, lambda: readonly(np.zeros(8, np.uint32)), ValueError),
    (0, "misaligned", ValueError),
])
def test_bad_scratch_buffers(impl, which, make, exc):
    pool, store, sched = two_decoding(impl)
    bufs = list(scratch(impl))
    dtypes = [impl.RAGGED_BATCH_ITEM, np.dtype(np.uint32), impl.RAGGED_BATCH_OUTPUT]
    if make == "2d":
        bufs[which] = np.zeros((4, 2), dtypes[which])
    elif make == "readonly":
        bufs[which] = readonly(np.zeros(8, dtypes[which]))
    elif make == "misaligned":
        bufs[which] = misaligned(dtypes[which], 8)
    else:
        bufs[which] = make()
    b = Recorder(impl)
    failing_round(impl, sched, pool, store, b, bufs, exc)
    assert b.calls == 0


def test_backend_without_execute_ragged(impl):
    pool, store, sched = two_decoding(impl)
    with pytest.raises(TypeError):
        sched.execute_decode_round(object(), *scratch(impl))


def test_reentrant_backend_is_busy(impl):
    pool, store, sched = two_decoding(impl)
    seen = []

    def reply(items, table, outputs):
        for call in (lambda: sched.record_token(11), lambda: sched.finish(11, pool),
                     lambda: sched.seed_decode_token(11, 1),
                     lambda: sched.admit_with_prefix(50, None, store, pool),
                     lambda: sched.execute_decode_round(impl.PyHashBackend(), *scratch(impl))):
            try:
                call()
            except BusyError as exc:
                seen.append(exc)
        return impl.PyHashBackend().execute_ragged(items, table, outputs)

    assert sched.execute_decode_round(Recorder(impl, reply=reply), *scratch(impl)) == (2, 1)
    assert len(seen) == 5 and all(isinstance(e, BusyError) for e in seen)
    assert sched.runnable()["token_count"].tolist() == [1, 1]
    assert sched.record_token(11) == 2  # not busy after the round


def test_reentrant_backend_error_propagates_as_backend_error(impl):
    pool, store, sched = two_decoding(impl)

    def reply(items, table, outputs):
        sched.finish(22, pool)

    err = failing_round(impl, sched, pool, store, Recorder(impl, reply=reply), scratch(impl),
                        DecodeRoundError.Backend)
    assert isinstance(err.cause, BusyError)
    sched.finish(22, pool)  # usable again


# -- finish ---------------------------------------------------------------------------------------


def test_finish_returns_pool_to_store_pages(impl):
    pool, store, sched = world(impl, blocks=16)
    x, shared = publish_prefix(impl, pool, store, sched, tokens=20, pages=2)
    sched.admit_with_prefix(1, x, store, pool)
    sched.ensure_writable(1, 1, pool)  # copy
    sched.ensure_writable(1, 2, pool)  # allocate
    sched.admit_with_prefix(2, x, store, pool)
    decoding(impl, pool, store, sched, 3, pages=3, token=1)
    sched.seed_decode_token(1, 5)
    sched.seed_decode_token(2, 6)
    assert sched.execute_decode_round(impl.PyHashBackend(), *scratch(impl)) == (3, 1)
    for rid in (2, 1, 3):
        sched.finish(rid, pool)
    assert sched.active_count() == 0
    assert pool.free_count == 16 - len(set(shared))
    assert [pool.refcount(p) for p in shared] == [1, 1]
    store.evict(x, pool)
    assert pool.free_count == 16


def test_finish_after_pool_corruption(impl):
    pool, store, sched = world(impl)
    decoding(impl, pool, store, sched, 1, pages=3, token=2)
    pages = sched.block_table(1)
    pool.release(pages[1])  # released outside the scheduler
    view = sched.runnable().tolist()
    with pytest.raises(SchedulerError.Table) as info:
        sched.finish(1, pool)
    assert info.value.chain == ("SchedulerError.Table", "TableError.NotAllocated")
    assert sched.active_count() == 1  # still active ...
    assert sched.runnable().tolist() == view
    assert sched.block_table(1) == []  # ... with an empty table
    assert [pool.refcount(p) for p in pages] == [0, 0, 0]
    assert pool.free_count == pool.num_blocks
    sched.finish(1, pool)
    assert sched.active_count() == 0


# -- bad input ------------------------------------------------------------------------------------


def test_bad_request_id(impl, bad_u64):
    value, exc = bad_u64
    pool, store, sched = world(impl)
    decoding(impl, pool, store, sched, 1, pages=1, token=1)
    before = full_state(impl, pool, store, sched)
    for call in (lambda: sched.admit_with_prefix(value, None, store, pool),
                 lambda: sched.ensure_writable(value, 0, pool),
                 lambda: sched.mark_prefill_complete(value),
                 lambda: sched.seed_decode_token(value, 1),
                 lambda: sched.record_token(value),
                 lambda: sched.finish(value, pool),
                 lambda: sched.block_table(value),
                 lambda: sched.pending_token(value)):
        with pytest.raises(exc):
            call()
    assert full_state(impl, pool, store, sched) == before


def test_bad_u32_arguments(impl, bad_u32):
    value, exc = bad_u32
    pool, store, sched = world(impl)
    decoding(impl, pool, store, sched, 1, pages=1, token=1)
    before = full_state(impl, pool, store, sched)
    with pytest.raises(exc):
        sched.ensure_writable(1, value, pool)
    with pytest.raises(exc):
        sched.seed_decode_token(1, value)
    assert full_state(impl, pool, store, sched) == before


def test_wrong_object_types(impl):
    pool, store, sched = world(impl)
    decoding(impl, pool, store, sched, 1, pages=1, token=1)
    before = full_state(impl, pool, store, sched)
    for call in (lambda: sched.admit_with_prefix(2, b"\x00" * 16, store, pool),
                 lambda: sched.admit_with_prefix(2, None, pool, pool),
                 lambda: sched.admit_with_prefix(2, None, store, store),
                 lambda: sched.admit_with_prefix(2, None, None, pool),
                 lambda: sched.ensure_writable(1, 0, store),
                 lambda: sched.finish(1, None)):
        with pytest.raises(TypeError):
            call()
    assert full_state(impl, pool, store, sched) == before


# -- an engine's life cycle (DESIGN.md "Driving the scheduler") ---------------------------------


def test_engine_life_cycle(impl):
    page_tokens = 4
    pool, store, sched = world(impl, blocks=12, requests=3, logical_pages=4)
    backend = impl.PyHashBackend()
    bufs = scratch(impl)
    prompt = list(range(100, 106))  # 6 tokens over 2 pages

    def prefill(rid, start):
        for p in range(start, len(prompt)):
            cow = sched.ensure_writable(rid, p // page_tokens, pool)
            if cow.kind == "copy":
                backend.copy_pages([cow])
            sched.record_token(rid)
        sched.mark_prefill_complete(rid)
        sched.seed_decode_token(rid, prompt[-1])

    x = impl.PrefixIdentity.of_tokens(prompt, b"tenant")
    assert not sched.admit_with_prefix(1, x, store, pool).prefix_hit
    prefill(1, 0)
    store.publish(x, sched.block_table(1), len(prompt), pool)
    adm = sched.admit_with_prefix(2, x, store, pool)
    assert adm.prefix_hit and adm.prefix_tokens == 6
    sched.mark_prefill_complete(2)
    sched.seed_decode_token(2, prompt[-1])
    for _ in range(5):
        for view in sched.runnable().tolist():
            if view[2] == RequestState.DECODE:
                cow = sched.ensure_writable(view[0], view[3] // page_tokens, pool)
                if cow.kind == "copy":
                    backend.copy_pages([cow])
        sched.execute_decode_round(backend, *bufs)
    assert backend.calls == 5
    assert backend.pages_copied == 2  # both requests copy the store's partly filled page once
    assert sched.runnable()["token_count"].tolist() == [11, 11]
    for rid in (1, 2):  # five chained steps from position 6
        token = prompt[-1]
        for pos in range(6, 11):
            token = impl.PyHashBackend.next_token(rid, pos, token)
        assert sched.pending_token(rid) == token
    sched.finish(1, pool)
    sched.finish(2, pool)
    assert pool.free_count == pool.num_blocks - 2
    assert store.evict_lru(pool) == x
    assert pool.free_count == pool.num_blocks


# -- property: refcounts equal the holders across random scheduler operations ------------------

sched_ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "admit_prefix", "write", "mark", "seed", "record", "round",
                         "finish", "publish", "evict"]),
        st.integers(0, 4),
        st.integers(0, 3),
    ),
    max_size=40,
)


@settings(max_examples=500, deadline=None)
@given(sched_ops)
def test_refcounts_match_tables_and_store(impl, sequence):
    n = 10
    pool, store, sched = world(impl, blocks=n, requests=3, logical_pages=3, entries=2,
                               max_pages=3)
    backend = impl.PyHashBackend()
    bufs = scratch(impl)
    idents = [impl.PrefixIdentity.of_tokens([i]) for i in range(3)]
    for op, rid, arg in sequence:
        before = full_state(impl, pool, store, sched)
        try:
            if op == "admit":
                sched.admit_with_prefix(rid, None, store, pool)
            elif op == "admit_prefix":
                sched.admit_with_prefix(rid, idents[arg % 3], store, pool)
            elif op == "write":
                sched.ensure_writable(rid, arg, pool)
            elif op == "mark":
                sched.mark_prefill_complete(rid)
            elif op == "seed":
                sched.seed_decode_token(rid, arg)
            elif op == "record":
                sched.record_token(rid)
            elif op == "round":
                sched.execute_decode_round(backend, *bufs)
            elif op == "finish":
                sched.finish(rid, pool)
            elif op == "publish":
                store.publish(idents[arg % 3], sched.block_table(rid), 1 + arg, pool)
            elif op == "evict":
                store.evict_lru(pool)
        except (SchedulerError, DecodeRoundError, PrefixKvError) as err:
            assert not isinstance(err, SchedulerError.Table) or op != "finish"
            assert full_state(impl, pool, store, sched) == before, (op, err)
        holders = [p for v in sched.runnable().tolist() for p in sched.block_table(v[0])]
        holders += [p for i in store.identities() for p in store.pages_of(i)]
        for p in range(n):
            assert pool.refcount(p) == holders.count(p)
        assert pool.free_count == sum(1 for p in range(n) if pool.refcount(p) == 0)
        views = sched.runnable().tolist()
        assert len({v[0] for v in views}) == len(views) == sched.active_count()
        for v in views:
            assert (v[2] == RequestState.DECODE) or v[4] == 0
