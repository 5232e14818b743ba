"""The pure-Python twin of the compiled core: the semantics of docs/DESIGN.md in plain Python.

This module is meant to be read beside docs/DESIGN.md: every class is a plain transliteration of
its section there (lists, dicts and ints), every check is made in the order that section gives,
and every failed call leaves all state as it was.  Comments cite the sections by name.  It shares
the public API of the compiled core (DESIGN.md "API") and raises the same error classes
(``qualia.errors``), so the test suite runs unchanged against both.

It is a model, not a fast path: the block pool keeps one Python list per page, and decode rounds
walk numpy records one at a time.
"""

# Why one file past 600 lines: the twin is one transliteration, read beside the compiled core
# class by class in the order the core composes them (pool, table, identity, store, request
# scheduler, hash backend), and the differential tests drive all of them as one model.

from __future__ import annotations

import hashlib
import inspect
import operator
from collections.abc import Sequence as _AbcSequence
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np

# the compiled core's numpy dtypes, so that buffers made for one implementation are accepted by
# the other (importing the package imports the core, so they always exist)
from qualia._core import (
    COPY_OP,
    RAGGED_BATCH_ITEM,
    RAGGED_BATCH_OUTPUT,
    RAGGED_BATCH_RECEIPT,
    REQUEST_VIEW,
)
from qualia._types import Admission, CopyOnWrite, RaggedBatchReceipt, RequestState
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

__all__ = [
    "BlockPool",
    "SequenceBlockTable",
    "PrefixIdentity",
    "PrefixKvStore",
    "RequestScheduler",
    "PyHashBackend",
    "RAGGED_BATCH_ITEM",
    "RAGGED_BATCH_OUTPUT",
    "RAGGED_BATCH_RECEIPT",
    "REQUEST_VIEW",
    "COPY_OP",
    "U32_MAX",
    "U64_MAX",
]

U16_MAX = 2**16 - 1
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
_MASK64 = U64_MAX

_PAGE_TABLE = np.dtype("<u4")  # the block-table scratch: one u32 page id per entry


# ---------------------------------------------------------------------------------------------
# Argument checking (DESIGN.md "Bad input")
# ---------------------------------------------------------------------------------------------


_ABSENT = object()


def backend_attr(backend, name: str):
    """``backend.name``, or None when the backend has no such attribute; an AttributeError
    raised while getting one that it has (a property's) is raised, not taken for absence."""
    value = getattr(backend, name, _ABSENT)
    if value is not _ABSENT:
        return value
    if _declares(backend, name):
        return getattr(backend, name)      # the attribute's own error, raised again
    return None


def _declares(obj, name: str) -> bool:
    """Whether ``obj`` has ``name`` where the lookup finds it without running ``obj``'s code:
    a class dict of its type's MRO or its own ``__dict__`` (a class object: inspect's full
    static lookup)."""
    if isinstance(obj, type):
        return inspect.getattr_static(obj, name, _ABSENT) is not _ABSENT
    if any(name in klass.__dict__ for klass in type(obj).__mro__):
        return True
    try:
        d = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        return False
    return type(d) is dict and name in d


def token_limit(vocab_size: Optional[int]) -> int:
    """The largest token id a step takes as sampled or as a candidate: below ``vocab_size``,
    and never ``0xFFFFFFFF``, which is no token id."""
    return U32_MAX - 1 if vocab_size is None else vocab_size - 1


def exact_int(value, name: str) -> int:
    """An integer argument as an exact ``int``: anything with ``__index__`` (numpy integers
    too), never a bool (``TypeError``), and never an int subclass's own methods (its
    comparisons and arithmetic cannot run).  Every integer argument check of the twins and the
    simulator starts here."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, not bool")
    try:
        return int.__index__(operator.index(value))
    except TypeError:
        raise TypeError(f"{name} must be an integer, not {type(value).__name__}") from None


def _int(value, name: str, maximum: int, minimum: int = 0) -> int:
    """An integer argument: bool -> TypeError, non-integer -> TypeError, out of
    [minimum, maximum] -> OverflowError (below 0 or above the field) / ValueError (0 where >= 1
    is needed)."""
    v = exact_int(value, name)
    if v < 0:
        raise OverflowError(f"{name} must be >= 0, got {v}")
    if v > maximum:
        raise OverflowError(f"{name} must be <= {maximum}, got {v}")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def _u32(value, name: str) -> int:
    return _int(value, name, U32_MAX)


def _u64(value, name: str) -> int:
    return _int(value, name, U64_MAX)


def _u32_list(values, name: str) -> List[int]:
    """A sequence of u32 ids (page ids, token ids): any iterable of integers, numpy arrays too."""
    if isinstance(values, (str, bytes, bytearray, memoryview)):
        raise TypeError(f"{name} must be an iterable of integers, not {type(values).__name__}")
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got {values.ndim}-D")
        if values.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, not {values.dtype}")
        values = values.tolist()
    try:
        items = list(values)
    except TypeError:
        raise TypeError(
            f"{name} must be an iterable of integers, not {type(values).__name__}") from None
    return [_u32(v, f"{name}[{i}]") for i, v in enumerate(items)]


def _need(obj, cls, name: str):
    if not isinstance(obj, cls):
        raise TypeError(
            f"{name} must be a {cls.__module__}.{cls.__name__}, not {type(obj).__name__}")
    return obj


def _buffer(obj, dtype: np.dtype, name: str, align: int) -> np.ndarray:
    """A caller buffer: numpy.asarray(obj) must be 1-D, C-contiguous, aligned, writable and of
    exactly ``dtype``."""
    try:
        arr = np.asarray(obj)
    except Exception as exc:  # e.g. ragged nested lists
        raise TypeError(f"{name} must be a numpy array of dtype {dtype}: {exc}") from None
    if arr.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, not {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got {arr.ndim}-D")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    if not arr.flags.writeable:
        raise ValueError(f"{name} must be writable")
    if arr.size and arr.ctypes.data % align:
        raise ValueError(f"{name} is misaligned (needs {align}-byte alignment)")
    return arr


def _flatten(err: QualiaError, family) -> QualiaError:
    """A pool error met by a table becomes the same-named variant of ``family`` (DESIGN.md
    "Errors")."""
    return family.VARIANTS[err.variant](None, err.detail)


# ---------------------------------------------------------------------------------------------
# Block pool (DESIGN.md "Block pool")
# ---------------------------------------------------------------------------------------------


class BlockPool:
    """Physical KV pages ``0 .. num_blocks-1``, each with a u32 reference count.

    One free stack: it starts holding every page with page 0 on top, so never-used pages come out
    ascending; a released page is pushed on top (last freed, first reused).  ``BlockPool(0)`` is
    valid: every ``allocate`` is ``Exhausted`` and every page id ``InvalidPage``."""

    def __init__(self, num_blocks) -> None:
        n = _int(num_blocks, "num_blocks", U32_MAX)
        self._refcounts: List[int] = [0] * n
        self._free: List[int] = list(range(n - 1, -1, -1))  # top of stack is the end

    @property
    def num_blocks(self) -> int:
        return len(self._refcounts)

    @property
    def free_count(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise PoolError.Exhausted(None, "no free page")
        page = self._free.pop()
        self._refcounts[page] = 1
        return page

    def _check(self, page: int) -> None:
        if page >= len(self._refcounts):
            raise PoolError.InvalidPage(None, f"page {page} >= num_blocks {len(self._refcounts)}")

    def retain(self, page) -> None:
        page = _u32(page, "page")
        self._check(page)
        count = self._refcounts[page]
        if count == 0:
            raise PoolError.NotAllocated(None, f"page {page}")
        if count == U32_MAX:
            raise PoolError.Overflow(None, f"page {page}")
        self._refcounts[page] = count + 1

    def release(self, page) -> None:
        page = _u32(page, "page")
        self._check(page)
        count = self._refcounts[page]
        if count == 0:
            raise PoolError.NotAllocated(None, f"page {page}")
        self._refcounts[page] = count - 1
        if count == 1:
            self._free.append(page)

    def refcount(self, page) -> int:
        page = _u32(page, "page")
        self._check(page)
        return self._refcounts[page]

    def _first_retain_error(self, pages: List[int]) -> Optional[QualiaError]:
        """The error ``retain`` would raise for the first failing page if every page of
        ``pages`` were retained in order, or None.  Lets callers be atomic: validate, then
        retain."""
        pending: Dict[int, int] = {}
        for page in pages:
            if page >= len(self._refcounts):
                return PoolError.InvalidPage(
                    None, f"page {page} >= num_blocks {len(self._refcounts)}")
            count = self._refcounts[page]
            if count == 0:
                return PoolError.NotAllocated(None, f"page {page}")
            if count + pending.get(page, 0) == U32_MAX:
                return PoolError.Overflow(None, f"page {page}")
            pending[page] = pending.get(page, 0) + 1
        return None

    def _debug_set_refcount(self, page, count) -> None:
        """Test hook: set an allocated page's count (1 .. 2**32-1) without touching the free
        stack, to reach ``Overflow`` without 4 billion retains."""
        page = _u32(page, "page")
        self._check(page)
        count = _int(count, "count", U32_MAX, minimum=1)
        if self._refcounts[page] == 0:
            raise PoolError.NotAllocated(None, f"page {page}")
        self._refcounts[page] = count

    def __repr__(self) -> str:
        return f"BlockPool(num_blocks={self.num_blocks}, free_count={self.free_count})"


# ---------------------------------------------------------------------------------------------
# Sequence block table with copy-on-write (DESIGN.md "Sequence block table and copy-on-write")
# ---------------------------------------------------------------------------------------------


class SequenceBlockTable:
    """The logical->physical page map of one request; ``entries()`` is the mapped prefix."""

    def __init__(self, capacity) -> None:
        self._capacity = _u32(capacity, "capacity")
        self._entries: List[int] = []

    @property
    def capacity(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> List[int]:
        return list(self._entries)

    def ensure_writable(self, logical_page, pool) -> CopyOnWrite:
        logical_page = _u32(logical_page, "logical_page")
        _need(pool, BlockPool, "pool")
        # 1. past the capacity
        if logical_page >= self._capacity:
            raise TableError.OutOfRange(
                None, f"logical page {logical_page} >= capacity {self._capacity}")
        # 2. pages are mapped contiguously from 0
        if logical_page > len(self._entries):
            raise TableError.Gap(
                None, f"logical page {logical_page} > mapped length {len(self._entries)}")
        # 3. the next page: allocate and append
        if logical_page == len(self._entries):
            try:
                page = pool.allocate()
            except PoolError as err:
                raise _flatten(err, TableError) from None
            self._entries.append(page)
            return CopyOnWrite.allocated(page)
        src = self._entries[logical_page]
        try:
            count = pool.refcount(src)
        except PoolError as err:  # 4. a page id past this pool's end
            raise _flatten(err, TableError) from None
        # 5. released behind the table's back
        if count == 0:
            raise TableError.NotAllocated(None, f"mapped page {src}")
        # 6. sole holder: write in place
        if count == 1:
            return CopyOnWrite.exclusive(src)
        # 7. shared: allocate dst, drop our reference on src, map dst
        try:
            dst = pool.allocate()
        except PoolError as err:
            raise _flatten(err, TableError) from None
        pool.release(src)  # count >= 2, cannot fail or free
        self._entries[logical_page] = dst
        return CopyOnWrite.copy(src, dst)

    def attach(self, pages: Iterable[int], pool) -> None:
        pages = _u32_list(pages, "pages")
        _need(pool, BlockPool, "pool")
        if self._entries:
            raise TableError.NotEmpty(None, f"table holds {len(self._entries)} pages")
        if len(pages) > self._capacity:
            raise TableError.OutOfRange(None, f"{len(pages)} pages > capacity {self._capacity}")
        err = pool._first_retain_error(pages)  # atomic: validate every retain first
        if err is not None:
            raise _flatten(err, TableError)
        for page in pages:
            pool.retain(page)
        self._entries = pages

    def release_all(self, pool) -> None:
        _need(pool, BlockPool, "pool")
        first: Optional[QualiaError] = None
        for page in self._entries:
            try:
                pool.release(page)
            except PoolError as err:
                if first is None:
                    first = err
        self._entries = []
        if first is not None:
            raise _flatten(first, TableError)

    def __repr__(self) -> str:
        return f"SequenceBlockTable(capacity={self._capacity}, entries={self._entries!r})"


# ---------------------------------------------------------------------------------------------
# Prefix identity and prefix KV store (DESIGN.md "Prefix identity", "Prefix KV store")
# ---------------------------------------------------------------------------------------------


def _namespace_bytes(namespace) -> bytes:
    if isinstance(namespace, str):
        return namespace.encode("utf-8")
    if isinstance(namespace, (bytes, bytearray, memoryview)):
        return bytes(namespace)
    raise TypeError(f"namespace must be bytes-like or str, not {type(namespace).__name__}")


class PrefixIdentity:
    """A 128-bit digest naming a prompt prefix.  Immutable: ``__init__`` runs once;
    ``bytes(ident)`` is the digest, ``int(ident)`` its big-endian value."""

    __slots__ = ("_digest",)

    def __init__(self, digest) -> None:
        if hasattr(self, "_digest"):
            raise TypeError("PrefixIdentity is immutable: __init__ cannot be called again")
        if not isinstance(digest, (bytes, bytearray, memoryview)):
            raise TypeError(f"digest must be 16 bytes, not {type(digest).__name__}")
        digest = bytes(digest)
        if len(digest) != 16:
            raise ValueError(f"digest must be 16 bytes, got {len(digest)}")
        self._digest = digest

    @classmethod
    def of_tokens(cls, tokens, namespace=b"") -> "PrefixIdentity":
        ns = _namespace_bytes(namespace)
        if len(ns) > U32_MAX:
            raise OverflowError("namespace longer than 2**32-1 bytes")
        ids = _u32_list(tokens, "tokens")
        h = hashlib.blake2b(digest_size=16)
        h.update(len(ns).to_bytes(4, "little"))
        h.update(ns)
        for token in ids:
            h.update(token.to_bytes(4, "little"))
        return cls(h.digest())

    @classmethod
    def fromhex(cls, text) -> "PrefixIdentity":
        if not isinstance(text, str):
            raise TypeError(f"fromhex needs a str, not {type(text).__name__}")
        if len(text) != 32 or any(c not in "0123456789abcdefABCDEF" for c in text):
            raise ValueError(f"a prefix identity is 32 hex digits, got {text!r}")
        return cls(bytes.fromhex(text))

    @property
    def digest(self) -> bytes:
        return self._digest

    def hex(self) -> str:
        return self._digest.hex()

    def __bytes__(self) -> bytes:
        return self._digest

    def __int__(self) -> int:
        return int.from_bytes(self._digest, "big")

    def __eq__(self, other):
        if isinstance(other, PrefixIdentity):
            return self._digest == other._digest
        return NotImplemented

    def __ne__(self, other):
        if isinstance(other, PrefixIdentity):
            return self._digest != other._digest
        return NotImplemented

    def __hash__(self) -> int:
        # the same value as the compiled core's PrefixIdentity (64-bit platforms)
        hi = int.from_bytes(self._digest[:8], "big")
        lo = int.from_bytes(self._digest[8:], "big")
        return (hi ^ ((lo * 0x9E3779B97F4A7C15) & _MASK64)) >> 1

    def __repr__(self) -> str:
        return f"PrefixIdentity.fromhex('{self.hex()}')"


class _PrefixEntry:
    __slots__ = ("pages", "tokens")

    def __init__(self, pages: List[int], tokens: int) -> None:
        self.pages = pages
        self.tokens = tokens


class PrefixKvStore:
    """At most ``entries`` prefixes of at most ``pages`` pages each, holding one reference per
    page occurrence.  ``self._entries`` is a dict in recency order: first key = least recent
    (a publish or a hit re-inserts the key at the end)."""

    def __init__(self, entries, pages) -> None:
        self._capacity = _int(entries, "entries", U32_MAX, minimum=1)
        self._max_pages = _int(pages, "pages", U32_MAX, minimum=1)
        self._entries: dict = {}
        self._hits = 0
        self._misses = 0

    # -- counters and lookups ------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def max_pages(self) -> int:
        return self._max_pages

    @property
    def hits(self) -> int:
        return self._hits

    @property
    def misses(self) -> int:
        return self._misses

    def __len__(self) -> int:
        return len(self._entries)

    def contains(self, identity) -> bool:
        return _need(identity, PrefixIdentity, "identity") in self._entries

    __contains__ = contains

    def _entry(self, identity) -> _PrefixEntry:
        _need(identity, PrefixIdentity, "identity")
        entry = self._entries.get(identity)
        if entry is None:
            raise PrefixKvError.Unknown(None, identity.hex())
        return entry

    def pages_of(self, identity) -> List[int]:
        return list(self._entry(identity).pages)

    def tokens_of(self, identity) -> int:
        return self._entry(identity).tokens

    def identities(self) -> List[PrefixIdentity]:
        """Least recent first."""
        return list(self._entries)

    # -- operations -----------------------------------------------------------------------------
    def publish(self, identity, pages, tokens, pool) -> None:
        _need(identity, PrefixIdentity, "identity")
        pages = _u32_list(pages, "pages")
        tokens = _u32(tokens, "tokens")
        _need(pool, BlockPool, "pool")
        if not pages or tokens == 0:
            raise PrefixKvError.EmptyPrefix(None, f"{len(pages)} pages, {tokens} tokens")
        if len(pages) > self._max_pages:
            raise PrefixKvError.TooManyPages(None, f"{len(pages)} pages > {self._max_pages}")
        if identity in self._entries:
            raise PrefixKvError.Duplicate(None, identity.hex())
        if len(self._entries) >= self._capacity:
            raise PrefixKvError.Full(None, f"{self._capacity} entries")
        err = pool._first_retain_error(pages)  # atomic: validate every retain first
        if err is not None:
            raise PrefixKvError.Pool(err)
        for page in pages:
            pool.retain(page)
        self._entries[identity] = _PrefixEntry(pages, tokens)  # most recent

    def attach(self, identity, table, pool) -> Optional[int]:
        _need(identity, PrefixIdentity, "identity")
        _need(table, SequenceBlockTable, "table")
        _need(pool, BlockPool, "pool")
        entry = self._entries.get(identity)
        if entry is None:
            self._misses += 1
            return None
        try:
            table.attach(entry.pages, pool)
        except TableError as err:
            raise PrefixKvError.Table(err) from err
        self._hits += 1
        del self._entries[identity]  # mark most recent
        self._entries[identity] = entry
        return entry.tokens

    def _drop(self, identity, pool) -> None:
        entry = self._entries.pop(identity)
        first = None
        for page in entry.pages:
            try:
                pool.release(page)
            except PoolError as err:
                if first is None:
                    first = err
        if first is not None:
            raise PrefixKvError.Pool(first)

    def evict(self, identity, pool) -> None:
        _need(identity, PrefixIdentity, "identity")
        _need(pool, BlockPool, "pool")
        if identity not in self._entries:
            raise PrefixKvError.Unknown(None, identity.hex())
        self._drop(identity, pool)

    def evict_lru(self, pool) -> Optional[PrefixIdentity]:
        _need(pool, BlockPool, "pool")
        if not self._entries:
            return None
        identity = next(iter(self._entries))  # least recent
        self._drop(identity, pool)
        return identity

    def __repr__(self) -> str:
        return f"PrefixKvStore(entries={self._capacity}, pages={self._max_pages}, len={len(self)})"


# ---------------------------------------------------------------------------------------------
# The request scheduler (DESIGN.md "Request scheduler", "Decode round")
# ---------------------------------------------------------------------------------------------


class _RequestSlot:  # one fixed request slot
    __slots__ = ("request_id", "state", "token_count", "prefix_tokens", "next_token_id",
                 "token_ready", "blocks")

    def __init__(self, logical_pages: int) -> None:
        self.blocks = SequenceBlockTable(logical_pages)
        self.clear()

    def clear(self) -> None:
        self.request_id = 0
        self.state = RequestState.EMPTY
        self.token_count = 0
        self.prefix_tokens = 0
        self.next_token_id = 0
        self.token_ready = False

    def fork_from(self, parent: "_RequestSlot", request_id: int) -> None:
        """This empty slot becomes ``request_id``, a decoding copy of ``parent`` sharing its
        pages (retained by the caller)."""
        self.blocks._entries = list(parent.blocks._entries)
        self.request_id = request_id
        self.state = RequestState.DECODE
        self.token_count = parent.token_count
        self.prefix_tokens = parent.prefix_tokens
        self.next_token_id = parent.next_token_id
        self.token_ready = parent.token_ready


class RequestScheduler:
    """Fixed-request-capacity scheduler; ``max_requests`` is the seed's ``REQUESTS``."""

    def __init__(self, max_requests, logical_pages) -> None:
        max_requests = _int(max_requests, "max_requests", U16_MAX + 1, minimum=1)
        self._logical_pages = _u32(logical_pages, "logical_pages")
        self._slots = [_RequestSlot(self._logical_pages) for _ in range(max_requests)]
        self._busy = False

    @property
    def max_requests(self) -> int:
        return len(self._slots)

    @property
    def logical_pages(self) -> int:
        return self._logical_pages

    def _enter(self) -> None:
        if self._busy:
            raise BusyError(None, "the scheduler is running a decode round")

    def active_count(self) -> int:
        return sum(1 for slot in self._slots if slot.state != RequestState.EMPTY)

    def _find(self, request_id: int) -> _RequestSlot:  # the seed's scan; the core uses an index
        for slot in self._slots:
            if slot.state != RequestState.EMPTY and slot.request_id == request_id:
                return slot
        raise SchedulerError.UnknownRequest(None, f"request {request_id}")

    def admit_with_prefix(self, request_id, identity, prefixes, pool) -> Admission:
        request_id = _u64(request_id, "request_id")
        if identity is not None:
            _need(identity, PrefixIdentity, "identity")
        _need(prefixes, PrefixKvStore, "prefixes")
        _need(pool, BlockPool, "pool")
        self._enter()
        if any(s.state != RequestState.EMPTY and s.request_id == request_id for s in self._slots):
            raise SchedulerError.DuplicateRequest(None, f"request {request_id}")
        index = next((i for i, s in enumerate(self._slots) if s.state == RequestState.EMPTY), None)
        if index is None:
            raise SchedulerError.Full(None, f"{len(self._slots)} slots")
        prefix_tokens = 0
        if identity is not None:
            try:
                tokens = prefixes.attach(identity, self._slots[index].blocks, pool)
            except PrefixKvError as err:
                raise SchedulerError.Prefix(err) from err
            prefix_tokens = 0 if tokens is None else tokens
        slot = self._slots[index]
        slot.request_id = request_id
        slot.state = RequestState.PREFILL if prefix_tokens == 0 else RequestState.DECODE
        slot.token_count = prefix_tokens
        slot.prefix_tokens = prefix_tokens
        return Admission(index, prefix_tokens != 0, prefix_tokens)

    def ensure_writable(self, request_id, logical_page, pool) -> CopyOnWrite:
        request_id = _u64(request_id, "request_id")
        logical_page = _u32(logical_page, "logical_page")
        _need(pool, BlockPool, "pool")
        self._enter()
        slot = self._find(request_id)
        try:
            return slot.blocks.ensure_writable(logical_page, pool)
        except TableError as err:
            raise SchedulerError.Table(err) from err

    def mark_prefill_complete(self, request_id) -> None:  # in any active state
        request_id = _u64(request_id, "request_id")
        self._enter()
        self._find(request_id).state = RequestState.DECODE

    def seed_decode_token(self, request_id, token_id) -> None:
        request_id = _u64(request_id, "request_id")
        token_id = _u32(token_id, "token_id")
        self._enter()
        slot = self._find(request_id)
        slot.next_token_id = token_id
        slot.token_ready = True

    def record_token(self, request_id) -> int:
        request_id = _u64(request_id, "request_id")
        self._enter()
        slot = self._find(request_id)
        slot.token_count = min(slot.token_count + 1, U32_MAX)  # saturating_add
        return slot.token_count

    def runnable_into(self, out) -> int:
        out = _buffer(out, REQUEST_VIEW, "out", 8)
        required = self.active_count()
        if len(out) < required:
            raise SchedulerError.OutputTooSmall(None, f"{len(out)} < {required}")
        written = 0
        for index, slot in enumerate(self._slots):
            if slot.state == RequestState.EMPTY:
                continue
            out[written] = (slot.request_id, index, int(slot.state), slot.token_count,
                            slot.prefix_tokens)
            written += 1
        return written

    def runnable(self) -> np.ndarray:
        out = np.zeros(self.active_count(), dtype=REQUEST_VIEW)
        self.runnable_into(out)
        return out

    def execute_decode_round(self, backend, item_scratch, block_table_scratch,
                             output_scratch) -> RaggedBatchReceipt:  # DESIGN.md "Decode round"
        execute = backend_attr(backend, "execute_ragged")
        if not callable(execute):
            raise TypeError(
                f"backend must have an execute_ragged(items, block_table, outputs) method "
                f"(the twin takes Python backends only), not {type(backend).__name__}")
        items = _buffer(item_scratch, RAGGED_BATCH_ITEM, "item_scratch", 8)
        table = _buffer(block_table_scratch, _PAGE_TABLE, "block_table_scratch", 4)
        outputs = _buffer(output_scratch, RAGGED_BATCH_OUTPUT, "output_scratch", 8)
        self._enter()

        decoding = [(i, s) for i, s in enumerate(self._slots) if s.state == RequestState.DECODE]
        if len(items) < len(decoding):  # check 2
            raise DecodeRoundError.ItemBufferTooSmall(None, f"{len(items)} < {len(decoding)}")
        if len(outputs) < len(decoding):  # check 3
            raise DecodeRoundError.OutputBufferTooSmall(None, f"{len(outputs)} < {len(decoding)}")
        required_table_entries = sum(len(s.blocks) for _, s in decoding)  # check 4
        if len(table) < required_table_entries:
            raise DecodeRoundError.BlockTableBufferTooSmall(
                None, f"{len(table)} < {required_table_entries}")

        # Step 5, lowering.  `lowered` is the scheduler's own record of the batch's identities
        # (step 10 checks the outputs against it, not against the scratch).
        lowered: List[Tuple[int, int]] = []
        table_offset = 0
        for index, slot in decoding:
            if not slot.token_ready:
                raise DecodeRoundError.MissingInputToken(None, f"request {slot.request_id}")
            entries = slot.blocks._entries
            table[table_offset:table_offset + len(entries)] = entries
            items[len(lowered)] = (slot.request_id, index, slot.next_token_id, slot.token_count,
                                   table_offset, len(entries), 0)
            lowered.append((slot.request_id, index))
            table_offset += len(entries)
        item_count = len(lowered)
        if item_count == 0:  # step 6
            return RaggedBatchReceipt(0, 0)

        # truly read-only: based on read-only memoryviews, so flags.writeable = True raises
        items_view = np.frombuffer(items[:item_count].data.toreadonly(),
                                   dtype=RAGGED_BATCH_ITEM)
        table_view = np.frombuffer(table[:table_offset].data.toreadonly(),
                                   dtype=_PAGE_TABLE)
        outputs_view = outputs[:item_count]

        self._busy = True  # a backend calling back into a mutating method gets BusyError
        try:
            result = execute(items_view, table_view, outputs_view)  # step 7
        except Exception as exc:
            raise DecodeRoundError.Backend(exc) from exc
        finally:
            self._busy = False
        batch_size, launches = _receipt(result)

        if batch_size != item_count:  # check 8
            raise DecodeRoundError.OutputIdentityMismatch(
                None, f"batch_size {batch_size} != {item_count} items")
        if launches != 1:  # check 9
            raise DecodeRoundError.BackendLaunchCount(None, f"{launches} launches")
        out_ids = outputs_view["request_id"].tolist()
        out_slots = outputs_view["slot"].tolist()
        out_tokens = outputs_view["next_token_id"].tolist()
        for i, (request_id, index) in enumerate(lowered):  # check 10
            if out_ids[i] != request_id or out_slots[i] != index:
                raise DecodeRoundError.OutputIdentityMismatch(
                    None, f"output {i} is ({out_ids[i]}, {out_slots[i]}), "
                          f"expected ({request_id}, {index})")
        for i, (_, index) in enumerate(lowered):  # step 11: only now does state change
            slot = self._slots[index]
            slot.next_token_id = out_tokens[i]
            slot.token_count = min(slot.token_count + 1, U32_MAX)
            slot.token_ready = True
        return RaggedBatchReceipt(batch_size, launches)

    def finish(self, request_id, pool) -> None:
        request_id = _u64(request_id, "request_id")
        _need(pool, BlockPool, "pool")
        self._enter()
        slot = self._find(request_id)
        try:
            slot.blocks.release_all(pool)
        except TableError as err:
            raise SchedulerError.Table(err) from err  # `?` before clear(): stays active
        slot.clear()

    def fork(self, parent_id, child_id, pool) -> int:
        """Start ``child_id`` as a copy-on-write fork of the decoding request ``parent_id``
        (DESIGN.md "Forks"): a free slot, every page retained, the token state copied."""
        parent_id = _u64(parent_id, "parent_id")
        child_id = _u64(child_id, "child_id")
        _need(pool, BlockPool, "pool")
        self._enter()
        parent = self._find(parent_id)
        if parent.state != RequestState.DECODE:
            raise SchedulerError.ForkInPrefill(None, f"request {parent_id}")
        if any(s.state != RequestState.EMPTY and s.request_id == child_id for s in self._slots):
            raise SchedulerError.DuplicateRequest(None, f"request {child_id}")
        index = next((i for i, s in enumerate(self._slots) if s.state == RequestState.EMPTY), None)
        if index is None:
            raise SchedulerError.Full(None, f"{len(self._slots)} slots")
        pages = parent.blocks._entries
        err = pool._first_retain_error(pages)  # atomic: validate every retain first
        if err is not None:
            raise SchedulerError.Table(_flatten(err, TableError))
        for page in pages:
            pool.retain(page)
        self._slots[index].fork_from(parent, child_id)
        return index

    # -- introspection (DESIGN.md API) ------------------------------------------------------------
    def block_table(self, request_id) -> List[int]:
        return self._find(_u64(request_id, "request_id")).blocks.entries()

    def pending_token(self, request_id) -> Optional[int]:
        slot = self._find(_u64(request_id, "request_id"))
        return slot.next_token_id if slot.token_ready else None

    def __repr__(self) -> str:
        return (f"RequestScheduler(max_requests={self.max_requests}, "
                f"logical_pages={self._logical_pages}, active={self.active_count()})")


def _receipt(result):
    """(batch_size, backend_launches) from what a Python backend returned: a RaggedBatchReceipt,
    any 2-sequence of u32 ints, or a RAGGED_BATCH_RECEIPT record."""
    bad = DecodeRoundError.Backend(TypeError(
        "execute_ragged must return a RaggedBatchReceipt or (batch_size, backend_launches) "
        f"of u32 ints, not {result!r}"))
    if isinstance(result, np.void) and result.dtype.names:
        result = result.item()
    elif isinstance(result, np.ndarray) and result.ndim == 1:
        result = result.tolist()
    if not isinstance(result, _AbcSequence) or isinstance(result, (str, bytes, bytearray)):
        raise bad
    if len(result) != 2:
        raise bad
    values = []
    for v in result:
        try:
            values.append(_u32(v, "receipt field"))
        except Exception as exc:  # whatever a garbage receipt raises is the backend's fault
            raise bad from exc
    return values[0], values[1]


# ---------------------------------------------------------------------------------------------
# The hash backend's twin (DESIGN.md "Hash backend")
# ---------------------------------------------------------------------------------------------

_FAULTS = (None, "error", "batch_size", "launches", "swap", "raise")


class PyHashBackend:
    """Deterministic Python decode backend; ``fault`` injects one misbehaviour per call."""

    def __init__(self, vocab=32000, fault=None, code=-1) -> None:
        self.vocab = _int(vocab, "vocab", U32_MAX, minimum=1)
        if fault not in _FAULTS:
            raise ValueError(f"fault must be one of {_FAULTS}, not {fault!r}")
        self.fault = fault
        if isinstance(code, bool) or not isinstance(code, int) or not -2**31 <= code < 2**31:
            raise TypeError("code must be an i32 int")
        self.code = code
        self.calls = 0
        self.step_calls = 0
        self.sampled = 0
        self.pages_copied = 0
        self.copy_log: List[tuple] = []

    @staticmethod
    def _mix(request_id, position, token_id) -> int:
        x = (int(request_id) * 0x9E3779B97F4A7C15 + int(position) * 0xBF58476D1CE4E5B9
             + int(token_id)) & _MASK64
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & _MASK64
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & _MASK64
        x ^= x >> 31
        return x

    @staticmethod
    def next_token(request_id, position, token_id, vocab=32000) -> int:
        """The hash rule's next token of (``request_id``, ``position``, ``token_id``) below
        ``vocab``: ``qualia.hash_next_token`` (DESIGN.md "Hash backend")."""
        x = PyHashBackend._mix(request_id, position, token_id)
        return (x * int(vocab)) >> 64  # multiply-high range reduction, as the C backend

    @staticmethod
    def logprob(request_id, position, token_id) -> float:
        """The hash backend's stand-in log-probability (DESIGN.md "Hash backend")."""
        return -(PyHashBackend._mix(request_id, position, token_id) & 0xFFFF) / 4096

    def execute_step(self, plan, sampled_out=None, logprobs_out=None):
        """One engine step: sampled row r gets next_token(sampled_request_ids[r], the position
        and input token of flat row logits_indices[r]), as HashBackend.execute_step."""
        self.step_calls += 1
        if self.fault == "raise":
            raise RuntimeError("PyHashBackend: injected fault")
        if self.fault == "error":
            raise RaggedBackendError.Failed(self.code)
        rows = np.asarray(plan.logits_indices).tolist()
        ids = np.asarray(plan.sampled_request_ids).tolist()
        positions = np.asarray(plan.positions)
        tokens = np.asarray(plan.input_ids)
        out = np.empty(len(rows), np.uint32) if sampled_out is None else sampled_out
        for r, (rid, t) in enumerate(zip(ids, rows)):
            out[r] = self.next_token(rid, int(positions[t]), int(tokens[t]), self.vocab)
            if logprobs_out is not None:
                logprobs_out[r] = self.logprob(rid, int(positions[t]), int(tokens[t]))
        self.sampled += len(rows)
        return out

    def execute_ragged(self, items, block_table, outputs):
        self.calls += 1
        n = len(items)
        if self.fault == "raise":
            raise RuntimeError("PyHashBackend: injected fault")
        if self.fault == "error":
            raise RaggedBackendError.Failed(self.code)
        ids = items["request_id"].tolist()
        slots = items["slot"].tolist()
        positions = items["position"].tolist()
        tokens = items["token_id"].tolist()
        for i in range(n):
            outputs[i] = (ids[i], slots[i],
                          self.next_token(ids[i], positions[i], tokens[i], self.vocab))
        if self.fault == "swap" and n >= 2:
            first = (int(outputs["request_id"][0]), int(outputs["slot"][0]))
            outputs["request_id"][0] = outputs["request_id"][1]
            outputs["slot"][0] = outputs["slot"][1]
            outputs["request_id"][1], outputs["slot"][1] = first
        elif self.fault == "swap" and n == 1:
            outputs["slot"][0] = slots[0] + 1
        if self.fault == "batch_size":
            return RaggedBatchReceipt(n + 1, 1)
        if self.fault == "launches":
            return RaggedBatchReceipt(n, 2)
        return RaggedBatchReceipt(n, 1)

    def copy_pages(self, copies) -> int:
        """Perform (count) page copies: a COPY_OP array, CopyOnWrite results (non-copies are
        skipped) or (src, dst) pairs.  Returns how many were copied."""
        if isinstance(copies, np.ndarray):
            pairs = list(zip(copies["src_page"].tolist(), copies["dst_page"].tolist()))
        else:
            pairs = []
            for c in copies:
                if isinstance(c, CopyOnWrite):
                    if c.kind == "copy":
                        pairs.append((c.src, c.page))
                else:
                    src, dst = c
                    pairs.append((_u32(src, "src_page"), _u32(dst, "dst_page")))
        self.pages_copied += len(pairs)
        self.copy_log.extend(pairs)
        return len(pairs)
