"""Error classes (DESIGN.md "Errors"): every variant reachable and raised as its class, declared
statically; bad input never crashes; the hash backend's twin."""

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qualia import errors
from qualia._types import CopyOnWrite
from qualia.errors import (
    BusyError,
    DecodeRoundError,
    PoolError,
    PrefixKvError,
    QualiaError,
    RaggedBackendError,
    SchedulerError,
    TableError,
)

FAMILIES = [PoolError, TableError, PrefixKvError, SchedulerError, DecodeRoundError,
            RaggedBackendError]


def test_error_hierarchy(impl):
    for family in FAMILIES:
        assert issubclass(family, QualiaError)
        for name, cls in family.VARIANTS.items():
            assert getattr(family, name) is cls and issubclass(cls, family)
            assert cls().name == f"{family.__name__}.{name}"
    assert issubclass(BusyError, QualiaError) and issubclass(BusyError, RuntimeError)
    assert set(TableError.VARIANTS) >= set(PoolError.VARIANTS)  # pool errors flatten into tables


def test_every_variant_is_declared_in_its_family():
    """Type checkers see the variants: each family's class body declares every variant it has
    (a ClassVar annotation), and nothing else is attached at run time."""
    for family in FAMILIES:
        declared = {name for name, hint in vars(family)["__annotations__"].items()
                    if "Type[" in str(hint) and name != "VARIANTS"}
        assert declared == set(family.VARIANTS), family.__name__
        for name, cls in family.VARIANTS.items():
            assert cls.__qualname__ == f"{family.__name__}.{name}" and cls.__name__ == name
            assert cls.__module__ == "qualia.errors" and cls.__bases__ == (family,)
            assert cls.__doc__


# -- every variant raised by an operation, as exactly its class ---------------------------------


def _world(impl):
    pool = impl.BlockPool(4)
    store = impl.PrefixKvStore(1, 2)
    sched = impl.RequestScheduler(1, 2)
    return pool, store, sched


def _bufs(impl, items=4, table=8, outputs=4):
    return (np.zeros(items, impl.RAGGED_BATCH_ITEM), np.zeros(table, np.uint32),
            np.zeros(outputs, impl.RAGGED_BATCH_OUTPUT))


def _decoding(impl, pool, store, sched, seeded=True):
    sched.admit_with_prefix(1, None, store, pool)
    sched.ensure_writable(1, 0, pool)
    sched.mark_prefill_complete(1)
    if seeded:
        sched.seed_decode_token(1, 5)


def _trigger(impl, variant):
    pool, store, sched = _world(impl)
    ident = impl.PrefixIdentity.of_tokens([1])
    table = impl.SequenceBlockTable(1)
    if variant == "PoolError.Exhausted":
        for _ in range(4):
            pool.allocate()
        pool.allocate()
    elif variant == "PoolError.InvalidPage":
        pool.retain(4)
    elif variant == "PoolError.NotAllocated":
        pool.release(0)
    elif variant == "PoolError.Overflow":
        page = pool.allocate()
        impl.set_refcount(pool, page, 2**32 - 1)
        pool.retain(page)
    elif variant == "TableError.OutOfRange":
        table.ensure_writable(1, pool)
    elif variant == "TableError.Gap":
        impl.SequenceBlockTable(3).ensure_writable(1, pool)
    elif variant == "TableError.Exhausted":
        for _ in range(4):
            pool.allocate()
        table.ensure_writable(0, pool)
    elif variant == "TableError.InvalidPage":
        table.attach([9], pool)
    elif variant == "TableError.NotAllocated":
        table.attach([0], pool)
    elif variant == "TableError.Overflow":
        page = pool.allocate()
        impl.set_refcount(pool, page, 2**32 - 1)
        table.attach([page], pool)
    elif variant == "TableError.NotEmpty":
        table.ensure_writable(0, pool)
        table.attach([0], pool)
    elif variant == "PrefixKvError.EmptyPrefix":
        store.publish(ident, [], 1, pool)
    elif variant == "PrefixKvError.TooManyPages":
        store.publish(ident, [0, 0, 0], 1, pool)
    elif variant in ("PrefixKvError.Duplicate", "PrefixKvError.Full"):
        store.publish(ident, [pool.allocate()], 1, pool)
        other = ident if variant.endswith("Duplicate") else impl.PrefixIdentity.of_tokens([2])
        store.publish(other, [0], 1, pool)
    elif variant == "PrefixKvError.Unknown":
        store.evict(ident, pool)
    elif variant == "PrefixKvError.Table":
        store.publish(ident, [pool.allocate()], 1, pool)
        table.ensure_writable(0, pool)
        store.attach(ident, table, pool)
    elif variant == "PrefixKvError.Pool":
        store.publish(ident, [3], 1, pool)
    elif variant == "SchedulerError.DuplicateRequest":
        sched.admit_with_prefix(1, None, store, pool)
        sched.admit_with_prefix(1, None, store, pool)
    elif variant == "SchedulerError.Full":
        sched.admit_with_prefix(1, None, store, pool)
        sched.admit_with_prefix(2, None, store, pool)
    elif variant == "SchedulerError.ForkInPrefill":
        sched.admit_with_prefix(1, None, store, pool)
        sched.fork(1, 2, pool)
    elif variant == "SchedulerError.UnknownRequest":
        sched.record_token(1)
    elif variant == "SchedulerError.OutputTooSmall":
        sched.admit_with_prefix(1, None, store, pool)
        sched.runnable_into(np.zeros(0, impl.REQUEST_VIEW))
    elif variant == "SchedulerError.Prefix":
        store.publish(ident, [pool.allocate()] * 2, 1, pool)
        impl.RequestScheduler(1, 1).admit_with_prefix(1, ident, store, pool)
    elif variant == "SchedulerError.Table":
        sched.admit_with_prefix(1, None, store, pool)
        sched.ensure_writable(1, 2, pool)
    elif variant.startswith("DecodeRoundError."):
        name = variant.split(".")[1]
        _decoding(impl, pool, store, sched, seeded=name != "MissingInputToken")
        fault = {"Backend": "error", "BackendLaunchCount": "launches",
                 "OutputIdentityMismatch": "swap"}.get(name)
        sizes = {"ItemBufferTooSmall": (0, 8, 4), "OutputBufferTooSmall": (4, 8, 0),
                 "BlockTableBufferTooSmall": (4, 0, 4)}.get(name, (4, 8, 4))
        sched.execute_decode_round(impl.PyHashBackend(fault=fault, code=3),
                                   *_bufs(impl, *sizes))
    else:  # pragma: no cover
        raise AssertionError(variant)


REACHABLE = [f"{f.__name__}.{v}" for f in FAMILIES[:-1] for v in f.VARIANTS
             if (f.__name__, v) != ("DecodeRoundError", "Scheduler")]  # no seed path makes it


@pytest.mark.parametrize("variant", REACHABLE)
def test_every_variant_is_raised_as_its_class(impl, variant):
    family, name = variant.split(".")
    cls = getattr(errors, family).VARIANTS[name]
    with pytest.raises(QualiaError) as info:
        _trigger(impl, variant)
    assert type(info.value) is cls
    assert info.value.name == variant
    assert info.value.chain[0] == variant
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is cls and again.chain == info.value.chain


def test_backend_failed_code(impl):
    with pytest.raises(DecodeRoundError.Backend) as info:
        _trigger(impl, "DecodeRoundError.Backend")
    cause = info.value.cause
    assert type(cause) is RaggedBackendError.Failed and cause.code == 3
    assert info.value.root is cause
    assert pickle.loads(pickle.dumps(cause)).code == 3


def test_nested_chain_and_root(impl):
    with pytest.raises(SchedulerError.Prefix) as info:
        _trigger(impl, "SchedulerError.Prefix")
    err = info.value
    assert err.chain == ("SchedulerError.Prefix", "PrefixKvError.Table", "TableError.OutOfRange")
    assert type(err.root) is TableError.OutOfRange
    assert err.__cause__ is err.cause and err.cause.__cause__ is err.cause.cause
    assert "TableError.OutOfRange" in str(err)


# -- bad input never crashes --------------------------------------------------------------------

junk = st.one_of(
    st.integers(-2**70, 2**70), st.booleans(), st.none(), st.floats(allow_nan=True),
    st.text(max_size=3), st.binary(max_size=17), st.lists(st.integers(-3, 2**33), max_size=3),
)


@settings(max_examples=800, deadline=None)
@given(st.integers(0, 12), junk, junk)
def test_junk_arguments(impl, which, a, b):
    pool = impl.BlockPool(4)
    store = impl.PrefixKvStore(2, 2)
    sched = impl.RequestScheduler(2, 2)
    table = impl.SequenceBlockTable(2)
    sched.admit_with_prefix(1, None, store, pool)
    sched.ensure_writable(1, 0, pool)
    calls = [
        lambda: pool.retain(a), lambda: pool.release(a), lambda: pool.refcount(a),
        lambda: table.ensure_writable(a, pool), lambda: table.attach(a, pool),
        lambda: store.publish(impl.PrefixIdentity.of_tokens([1]), a, b, pool),
        lambda: impl.PrefixIdentity.of_tokens(a, b), lambda: impl.PrefixIdentity(a),
        lambda: sched.admit_with_prefix(a, None, store, pool),
        lambda: sched.ensure_writable(a, b, pool), lambda: sched.seed_decode_token(a, b),
        lambda: sched.record_token(a), lambda: sched.finish(a, pool),
    ]
    def snapshot():
        return (impl.pool_state(pool), impl.store_state(store), impl.sched_state(sched),
                impl.table_state(table))

    before = snapshot()
    try:
        calls[which]()
    except (TypeError, ValueError, OverflowError, QualiaError):
        assert snapshot() == before
    else:
        assert a is not None and not isinstance(a, (bool, float, str))


# -- the hash backend's twin (DESIGN.md "Hash backend") -------------------------------------


def splitmix_token(request_id, position, token_id, vocab=32000):
    m = (1 << 64) - 1
    x = (request_id * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + token_id) & m
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & m
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & m
    x ^= x >> 31
    return (x * vocab) >> 64


@pytest.mark.parametrize("args", [(0, 0, 0), (1, 2, 3), (2**64 - 1, 2**32 - 1, 2**32 - 1),
                                  (12345678901234, 77, 31999)])
def test_pybackend_next_token(impl, args):
    assert impl.PyHashBackend.next_token(*args) == splitmix_token(*args)
    assert impl.PyHashBackend.next_token(*args, vocab=7) == splitmix_token(*args, vocab=7)


def test_pybackend_execute(impl):
    b = impl.PyHashBackend(vocab=1000)
    items = np.zeros(2, impl.RAGGED_BATCH_ITEM)
    items[0] = (5, 0, 9, 3, 0, 1, 0)
    items[1] = (6, 2, 1, 0, 1, 0, 0)
    outs = np.zeros(2, impl.RAGGED_BATCH_OUTPUT)
    receipt = b.execute_ragged(items, np.zeros(1, np.uint32), outs)
    assert tuple(receipt) == (2, 1)
    assert outs.tolist() == [(5, 0, splitmix_token(5, 3, 9, 1000)),
                             (6, 2, splitmix_token(6, 0, 1, 1000))]
    assert b.calls == 1


@pytest.mark.parametrize("fault, expect", [("batch_size", (3, 1)), ("launches", (2, 2))])
def test_pybackend_receipt_faults(impl, fault, expect):
    b = impl.PyHashBackend(fault=fault)
    items = np.zeros(2, impl.RAGGED_BATCH_ITEM)
    assert tuple(b.execute_ragged(items, np.zeros(0, np.uint32),
                                  np.zeros(2, impl.RAGGED_BATCH_OUTPUT))) == expect


def test_pybackend_swap(impl):
    b = impl.PyHashBackend(fault="swap")
    items = np.zeros(2, impl.RAGGED_BATCH_ITEM)
    items["request_id"] = [10, 20]
    items["slot"] = [0, 1]
    outs = np.zeros(2, impl.RAGGED_BATCH_OUTPUT)
    b.execute_ragged(items, np.zeros(0, np.uint32), outs)
    assert outs[["request_id", "slot"]].tolist() == [(20, 1), (10, 0)]
    one = np.zeros(1, impl.RAGGED_BATCH_OUTPUT)
    b.execute_ragged(items[:1], np.zeros(0, np.uint32), one)
    assert one[["request_id", "slot"]].tolist() == [(10, 1)]


def test_pybackend_raising_faults(impl):
    items = np.zeros(1, impl.RAGGED_BATCH_ITEM)
    outs = np.zeros(1, impl.RAGGED_BATCH_OUTPUT)
    with pytest.raises(RaggedBackendError.Failed) as info:
        impl.PyHashBackend(fault="error", code=-5).execute_ragged(items, items, outs)
    assert info.value.code == -5
    with pytest.raises(RuntimeError):
        impl.PyHashBackend(fault="raise").execute_ragged(items, items, outs)
    with pytest.raises(ValueError):
        impl.PyHashBackend(fault="nonsense")


def test_pybackend_copy_pages(impl):
    b = impl.PyHashBackend()
    assert b.copy_pages([CopyOnWrite.copy(1, 2), CopyOnWrite.exclusive(3),
                         CopyOnWrite.allocated(4)]) == 1
    ops = np.zeros(3, impl.COPY_OP)
    ops["src_page"] = [1, 2, 3]
    ops["dst_page"] = [4, 5, 6]
    assert b.copy_pages(ops) == 3
    assert b.copy_pages([(7, 8)]) == 1
    assert b.pages_copied == 5
