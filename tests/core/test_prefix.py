"""Prefix identity and the prefix KV store (DESIGN.md "Prefix identity", "Prefix KV store")."""

import hashlib
import pickle
import struct

import numpy as np
import pytest

from qualia.errors import PoolError, PrefixKvError, TableError

U32_MAX = 2**32 - 1


def blake(tokens, namespace=b""):
    data = struct.pack("<I", len(namespace)) + namespace
    data += b"".join(struct.pack("<I", t) for t in tokens)
    return hashlib.blake2b(data, digest_size=16).digest()


# -- PrefixIdentity ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens, namespace",
    [([], b""), ([1, 2, 3], b""), ([1, 2, 3], b"tenant-a"), ([0, U32_MAX, 7], b"m\x00del"),
     (list(range(300)), b"x" * 70)],
)
def test_of_tokens_known_answer(impl, tokens, namespace):
    ident = impl.PrefixIdentity.of_tokens(tokens, namespace)
    assert ident.digest == blake(tokens, namespace)
    assert ident.hex() == blake(tokens, namespace).hex()


def test_of_tokens_default_namespace_is_empty(impl):
    assert impl.PrefixIdentity.of_tokens([5]) == impl.PrefixIdentity.of_tokens([5], b"")
    assert impl.PrefixIdentity.of_tokens([5]).digest == blake([5])


def test_str_namespace_is_utf8(impl):
    a = impl.PrefixIdentity.of_tokens([1], "tenant-é")
    assert a == impl.PrefixIdentity.of_tokens([1], "tenant-é".encode("utf-8"))
    assert a.digest == blake([1], "tenant-é".encode())
    assert impl.PrefixIdentity.of_tokens([1], bytearray(b"ns")).digest == blake([1], b"ns")


@pytest.mark.parametrize("kind", [tuple, list, lambda t: np.array(t, dtype=np.uint32),
                                  lambda t: np.array(t, dtype=np.int64)])
def test_of_tokens_accepts_sequences_and_numpy(impl, kind):
    assert impl.PrefixIdentity.of_tokens(kind([9, 8, 7]), b"n").digest == blake([9, 8, 7], b"n")


def test_namespace_separation(impl):
    a = impl.PrefixIdentity.of_tokens([1, 2, 3], b"tenant-a")
    b = impl.PrefixIdentity.of_tokens([1, 2, 3], b"tenant-b")
    assert a != b
    # the length prefix keeps namespace bytes and token bytes apart
    c = impl.PrefixIdentity.of_tokens([], b"\x01\x00\x00\x00")
    d = impl.PrefixIdentity.of_tokens([1], b"")
    assert c != d


@pytest.mark.parametrize(
    "bad, exc",
    [(-1, OverflowError), (2**32, OverflowError), (1.5, TypeError), (True, TypeError),
     (None, TypeError), ("1", TypeError)],
)
def test_of_tokens_bad_token(impl, bad, exc):
    with pytest.raises(exc):
        impl.PrefixIdentity.of_tokens([1, bad], b"")


@pytest.mark.parametrize("namespace", [None, 5, [1, 2]])
def test_of_tokens_bad_namespace(impl, namespace):
    with pytest.raises(TypeError):
        impl.PrefixIdentity.of_tokens([1], namespace)


def test_of_tokens_float_array_rejected(impl):
    with pytest.raises(TypeError):
        impl.PrefixIdentity.of_tokens(np.array([1.0, 2.0]))


def test_round_trips(impl):
    ident = impl.PrefixIdentity.of_tokens([4, 5, 6], b"rt")
    digest = ident.digest
    assert isinstance(digest, bytes) and len(digest) == 16
    assert impl.PrefixIdentity(digest) == ident
    text = ident.hex()
    assert text == digest.hex() and len(text) == 32 and text == text.lower()
    assert impl.PrefixIdentity.fromhex(text) == ident
    assert impl.PrefixIdentity.fromhex(text.upper()) == ident
    assert int(ident) == int.from_bytes(digest, "big")
    assert impl.PrefixIdentity((1).to_bytes(16, "big")).hex() == "0" * 31 + "1"
    assert int(impl.PrefixIdentity((1).to_bytes(16, "big"))) == 1
    assert text in repr(ident)


def test_equality_and_hash(impl):
    a = impl.PrefixIdentity.of_tokens([1, 2])
    b = impl.PrefixIdentity.of_tokens([1, 2])
    c = impl.PrefixIdentity.of_tokens([2, 1])
    assert a == b and hash(a) == hash(b) and not (a != b)
    assert a != c
    assert len({a, b, c}) == 2
    assert a != a.digest  # an identity is not its bytes


@pytest.mark.parametrize("digest, exc", [(b"\x00" * 15, ValueError), (b"\x00" * 17, ValueError),
                                         (123, TypeError), (None, TypeError)])
def test_identity_bad_digest(impl, digest, exc):
    with pytest.raises(exc):
        impl.PrefixIdentity(digest)


@pytest.mark.parametrize("text", ["0" * 31, "0" * 33, "g" * 32, ""])
def test_fromhex_bad(impl, text):
    with pytest.raises(ValueError):
        impl.PrefixIdentity.fromhex(text)


# -- PrefixKvStore --------------------------------------------------------------------------------


def ident(impl, n):
    return impl.PrefixIdentity.of_tokens([n], b"test")


def setup(impl, blocks=8, entries=2, pages=3):
    pool = impl.BlockPool(blocks)
    store = impl.PrefixKvStore(entries, pages)
    return pool, store


def state(impl, pool, store, *tables):
    return (impl.pool_state(pool), impl.store_state(store)) + tuple(
        impl.table_state(t) for t in tables)


def test_store_construction(impl):
    store = impl.PrefixKvStore(3, 5)
    assert store.capacity == 3 and store.max_pages == 5
    assert len(store) == 0 and store.hits == 0 and store.misses == 0
    assert store.identities() == []


@pytest.mark.parametrize("args, exc", [((0, 1), ValueError), ((1, 0), ValueError),
                                       ((-1, 1), OverflowError), ((1, -1), OverflowError),
                                       ((True, 1), TypeError), ((1, 2.0), TypeError)])
def test_store_bad_construction(impl, args, exc):
    with pytest.raises(exc):
        impl.PrefixKvStore(*args)


def test_publish_retains_each_page(impl):
    pool, store = setup(impl)
    a, b = pool.allocate(), pool.allocate()
    x = ident(impl, 1)
    store.publish(x, [a, b, a], 40, pool)
    assert pool.refcount(a) == 3 and pool.refcount(b) == 2
    assert len(store) == 1
    assert store.contains(x) and x in store
    assert store.pages_of(x) == [a, b, a]
    assert store.tokens_of(x) == 40
    assert store.identities() == [x]
    assert store.hits == 0 and store.misses == 0


def test_publish_empty_prefix_first(impl):
    pool, store = setup(impl, entries=1, pages=1)
    a = pool.allocate()
    x = ident(impl, 1)
    store.publish(x, [a], 1, pool)
    before = state(impl, pool, store)
    with pytest.raises(PrefixKvError.EmptyPrefix):
        store.publish(ident(impl, 2), [], 5, pool)
    with pytest.raises(PrefixKvError.EmptyPrefix):
        store.publish(ident(impl, 2), [a], 0, pool)
    with pytest.raises(PrefixKvError.EmptyPrefix):  # before TooManyPages, Duplicate, Full, Pool
        store.publish(x, [a, 99, a], 0, pool)
    assert state(impl, pool, store) == before


def test_publish_too_many_pages_before_duplicate(impl):
    pool, store = setup(impl, entries=1, pages=2)
    a = pool.allocate()
    x = ident(impl, 1)
    store.publish(x, [a], 1, pool)
    before = state(impl, pool, store)
    with pytest.raises(PrefixKvError.TooManyPages):
        store.publish(x, [a, a, a], 3, pool)
    assert state(impl, pool, store) == before


def test_publish_duplicate_before_full(impl):
    pool, store = setup(impl, entries=1)
    a = pool.allocate()
    x = ident(impl, 1)
    store.publish(x, [a], 1, pool)
    before = state(impl, pool, store)
    with pytest.raises(PrefixKvError.Duplicate):
        store.publish(x, [99], 1, pool)  # store also full, page also invalid
    assert state(impl, pool, store) == before


def test_publish_full_before_pool(impl):
    pool, store = setup(impl, entries=1)
    a = pool.allocate()
    store.publish(ident(impl, 1), [a], 1, pool)
    before = state(impl, pool, store)
    with pytest.raises(PrefixKvError.Full):
        store.publish(ident(impl, 2), [99], 1, pool)
    with pytest.raises(PrefixKvError.Full):
        store.publish(ident(impl, 2), [a], 1, pool)
    assert state(impl, pool, store) == before


@pytest.mark.parametrize("bad, inner", [(5, PoolError.NotAllocated), (8, PoolError.InvalidPage),
                                        (U32_MAX, PoolError.InvalidPage)])
def test_publish_pool_error_atomic(impl, bad, inner):
    pool, store = setup(impl)
    a, b = pool.allocate(), pool.allocate()
    before = state(impl, pool, store)
    with pytest.raises(PrefixKvError.Pool) as info:
        store.publish(ident(impl, 1), [a, bad, b], 3, pool)
    assert isinstance(info.value.cause, inner)
    assert info.value.__cause__ is info.value.cause
    assert info.value.chain == ("PrefixKvError.Pool", inner.__qualname__)
    assert state(impl, pool, store) == before


def test_publish_overflow_by_repetition_atomic(impl):
    pool, store = setup(impl)
    a, b = pool.allocate(), pool.allocate()
    impl.set_refcount(pool, b, U32_MAX - 1)  # room for exactly one more reference
    before = state(impl, pool, store)
    with pytest.raises(PrefixKvError.Pool) as info:
        store.publish(ident(impl, 1), [a, b, b], 3, pool)
    assert isinstance(info.value.cause, PoolError.Overflow)
    assert state(impl, pool, store) == before
    store.publish(ident(impl, 1), [a, b], 3, pool)
    assert pool.refcount(b) == U32_MAX and pool.refcount(a) == 2


def test_publish_tokens_range(impl):
    pool, store = setup(impl)
    a = pool.allocate()
    store.publish(ident(impl, 1), [a], U32_MAX, pool)
    assert store.tokens_of(ident(impl, 1)) == U32_MAX
    before = state(impl, pool, store)
    with pytest.raises(OverflowError):
        store.publish(ident(impl, 2), [a], 2**32, pool)
    with pytest.raises(TypeError):
        store.publish(ident(impl, 2), [a], 1.0, pool)
    with pytest.raises(TypeError):
        store.publish(ident(impl, 2), [a], True, pool)
    assert state(impl, pool, store) == before


@pytest.mark.parametrize("which", ["identity", "pool", "pages"])
def test_publish_wrong_types(impl, which):
    pool, store = setup(impl)
    a = pool.allocate()
    args = {"identity": ident(impl, 1), "pages": [a], "tokens": 1, "pool": pool}
    args[which] = {"identity": b"\x00" * 16, "pool": store, "pages": None}[which]
    before = state(impl, pool, store)
    with pytest.raises(TypeError):
        store.publish(args["identity"], args["pages"], args["tokens"], args["pool"])
    assert state(impl, pool, store) == before


# -- attach -----------------------------------------------------------------------------------


def test_attach_hit(impl):
    pool, store = setup(impl)
    a, b = pool.allocate(), pool.allocate()
    x = ident(impl, 1)
    store.publish(x, [a, b], 20, pool)
    table = impl.SequenceBlockTable(4)
    assert store.attach(x, table, pool) == 20
    assert table.entries() == [a, b]
    assert pool.refcount(a) == 3 and pool.refcount(b) == 3  # owner + store + table
    assert store.hits == 1 and store.misses == 0


def test_attach_miss_touches_nothing(impl):
    pool, store = setup(impl)
    table = impl.SequenceBlockTable(4)
    table.ensure_writable(0, pool)  # a non-empty table is not even looked at on a miss
    before = state(impl, pool, store, table)
    assert store.attach(ident(impl, 9), table, pool) is None
    after = state(impl, pool, store, table)
    assert after[0] == before[0] and after[2] == before[2]
    assert store.misses == 1 and store.hits == 0


def test_attach_hit_marks_most_recent(impl):
    pool, store = setup(impl, entries=3)
    page = pool.allocate()
    x, y, z = ident(impl, 1), ident(impl, 2), ident(impl, 3)
    for i in (x, y, z):
        store.publish(i, [page], 1, pool)
    assert store.identities() == [x, y, z]
    store.attach(x, impl.SequenceBlockTable(1), pool)
    assert store.identities() == [y, z, x]
    store.attach(ident(impl, 4), impl.SequenceBlockTable(1), pool)  # a miss changes no order
    assert store.identities() == [y, z, x]


@pytest.mark.parametrize("case", ["not_empty", "out_of_range"])
def test_attach_table_error_atomic(impl, case):
    pool, store = setup(impl, entries=3)
    a, b = pool.allocate(), pool.allocate()
    x, y = ident(impl, 1), ident(impl, 2)
    store.publish(x, [a, b], 9, pool)
    store.publish(y, [a], 9, pool)
    if case == "not_empty":
        table = impl.SequenceBlockTable(4)
        table.ensure_writable(0, pool)
        inner = TableError.NotEmpty
    else:
        table = impl.SequenceBlockTable(1)
        inner = TableError.OutOfRange
    before = state(impl, pool, store, table)
    with pytest.raises(PrefixKvError.Table) as info:
        store.attach(x, table, pool)
    assert isinstance(info.value.cause, inner)
    assert info.value.chain == ("PrefixKvError.Table", inner.__qualname__)
    assert state(impl, pool, store, table) == before  # no hit counted, recency unchanged
    assert store.identities() == [x, y]


def test_attach_table_error_not_allocated(impl):
    pool, store = setup(impl)
    a, b = pool.allocate(), pool.allocate()
    x = ident(impl, 1)
    store.publish(x, [a, b], 9, pool)
    for _ in range(2):
        pool.release(b)  # corrupt: the store's page is freed behind its back
    table = impl.SequenceBlockTable(4)
    before = state(impl, pool, store, table)
    with pytest.raises(PrefixKvError.Table) as info:
        store.attach(x, table, pool)
    assert isinstance(info.value.cause, TableError.NotAllocated)
    assert state(impl, pool, store, table) == before


def test_attach_wrong_types(impl):
    pool, store = setup(impl)
    with pytest.raises(TypeError):
        store.attach(ident(impl, 1), pool, pool)
    with pytest.raises(TypeError):
        store.attach(None, impl.SequenceBlockTable(1), pool)
    with pytest.raises(TypeError):
        store.attach(ident(impl, 1), impl.SequenceBlockTable(1), None)
    assert store.misses == 0


# -- evict -----------------------------------------------------------------------------------------


def test_evict_drops_its_pages(impl):
    pool, store = setup(impl)
    a, b = pool.allocate(), pool.allocate()
    x = ident(impl, 1)
    store.publish(x, [a, b, a], 3, pool)
    pool.release(a)
    pool.release(b)  # the store is now the only holder
    store.evict(x, pool)
    assert len(store) == 0 and not store.contains(x)
    assert pool.refcount(a) == pool.refcount(b) == 0
    assert pool.free_count == 8


def test_evict_unknown(impl):
    pool, store = setup(impl)
    a = pool.allocate()
    store.publish(ident(impl, 1), [a], 1, pool)
    before = state(impl, pool, store)
    with pytest.raises(PrefixKvError.Unknown):
        store.evict(ident(impl, 2), pool)
    assert state(impl, pool, store) == before


def test_evict_lru_order(impl):
    pool, store = setup(impl, entries=3)
    page = pool.allocate()
    x, y, z = ident(impl, 1), ident(impl, 2), ident(impl, 3)
    for i in (x, y, z):
        store.publish(i, [page], 1, pool)
    store.attach(x, impl.SequenceBlockTable(1), pool)  # x most recent now
    assert pool.refcount(page) == 5
    assert store.evict_lru(pool) == y
    assert store.evict_lru(pool) == z
    assert store.evict_lru(pool) == x
    assert store.evict_lru(pool) is None
    assert pool.refcount(page) == 2  # the owner and the table
    assert len(store) == 0


def test_publish_after_evict_reuses_entry(impl):
    pool, store = setup(impl, entries=1)
    page = pool.allocate()
    store.publish(ident(impl, 1), [page], 1, pool)
    store.evict(ident(impl, 1), pool)
    store.publish(ident(impl, 2), [page], 1, pool)
    assert store.identities() == [ident(impl, 2)]


def test_evict_on_corrupted_pool_reports_after_releasing_rest(impl):
    pool, store = setup(impl)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    x = ident(impl, 1)
    store.publish(x, [a, b, c], 3, pool)
    for p in (a, b, c):
        pool.release(p)  # store is the only holder
    pool.release(b)  # corrupt
    with pytest.raises(PrefixKvError.Pool) as info:
        store.evict(x, pool)
    assert isinstance(info.value.cause, PoolError.NotAllocated)
    assert len(store) == 0
    assert [pool.refcount(p) for p in (a, b, c)] == [0, 0, 0]
    assert pool.free_count == 8


def test_lookups_unknown(impl):
    pool, store = setup(impl)
    with pytest.raises(PrefixKvError.Unknown):
        store.pages_of(ident(impl, 1))
    with pytest.raises(PrefixKvError.Unknown):
        store.tokens_of(ident(impl, 1))


def test_store_errors_pickle(impl):
    pool, store = setup(impl)
    with pytest.raises(PrefixKvError.Pool) as info:
        store.publish(ident(impl, 1), [7], 1, pool)
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is PrefixKvError.Pool
    assert again.chain == info.value.chain
