"""The error families of the scheduler core, one Python exception class per variant.

Every family (``PoolError``, ``TableError``, ``PrefixKvError``, ``SchedulerError``,
``DecodeRoundError``, ``RaggedBackendError``) is a subclass of :class:`QualiaError`, and each of
its variants is a subclass of the family, reachable as an attribute of it::

    try:
        sched.admit_with_prefix(7, identity, store, pool)
    except qualia.SchedulerError.Prefix as err:
        err.cause            # PrefixKvError.Table(...)
        err.chain   # ('SchedulerError.Prefix', 'PrefixKvError.Table', 'TableError.OutOfRange')

Wrapping variants (``SchedulerError.Prefix``, ``DecodeRoundError.Backend`` ...) carry the inner
error as ``.cause``; it is also chained as ``__cause__`` so tracebacks show it.  The nesting is that
of the error enums in docs/DESIGN.md ("Errors"); Python users get it without parsing strings.

Every family and variant is written out below as a class statement, so that type checkers see
``SchedulerError.Prefix`` as an exception class: a family declares its variants as class
attributes, and each variant class is attached to its family by ``@_variant`` (which also names it
``Family.Variant`` for reprs and pickling, and records it in the family's ``VARIANTS``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict, Optional, Tuple, Type, TypeVar

__all__ = [
    "QualiaError",
    "BusyError",
    "PoolError",
    "TableError",
    "PrefixKvError",
    "SchedulerError",
    "DecodeRoundError",
    "RaggedBackendError",
    "PrefixCacheError",
    "StepError",
    "BackendAbiError",
]


class QualiaError(Exception):
    """Base of every error the package raises for one of its error variants."""

    #: The family's name (``"TableError"``).
    family: ClassVar[str] = "QualiaError"
    #: The variant's name (``"OutOfRange"``); empty for a family.
    variant: ClassVar[str] = ""
    #: Each family's variants by name (``PoolError.VARIANTS["Exhausted"] is PoolError.Exhausted``).
    VARIANTS: ClassVar[Dict[str, Type[QualiaError]]] = {}

    #: The wrapped inner error (a wrapping variant), also chained as ``__cause__``; else None.
    cause: Optional[BaseException]
    #: A message detail (which value was refused and why); may be empty.
    detail: str

    def __init__(self, cause: Optional[BaseException] = None, detail: str = "") -> None:
        self.cause = cause
        self.detail = detail
        if cause is not None:
            self.__cause__ = cause
        super().__init__(self._message())

    def _message(self) -> str:
        text = self._nested()
        if self.detail:
            text = f"{text}: {self.detail}"
        return text

    def _nested(self) -> str:
        if self.cause is None:
            return self.name
        if isinstance(self.cause, QualiaError):
            return f"{self.name}({self.cause._nested()})"
        return f"{self.name}({self.cause!r})"

    @property
    def name(self) -> str:
        """``Family.Variant``, e.g. ``'TableError.OutOfRange'``."""
        return f"{self.family}.{self.variant}" if self.variant else self.family

    @property
    def chain(self) -> Tuple[str, ...]:
        """Names of this error and every nested cause, outermost first."""
        names = [self.name]
        cause = self.cause
        while isinstance(cause, QualiaError):
            names.append(cause.name)
            cause = cause.cause
        return tuple(names)

    @property
    def root(self) -> BaseException:
        """The innermost error of the chain (this error when it wraps nothing)."""
        err: BaseException = self
        while isinstance(err, QualiaError) and err.cause is not None:
            err = err.cause
        return err

    def __reduce__(self) -> Tuple[Any, ...]:  # keep pickling (multiprocessing engines) working
        return (type(self), (self.cause, self.detail))


_V = TypeVar("_V", bound=Type[QualiaError])


def _variant(cls: _V) -> _V:
    """Attach a variant class to its family (its direct base): ``Family.<variant>``, an entry of
    ``Family.VARIANTS``, and the qualified name ``Family.Variant`` (reprs, pickling)."""
    family: Type[QualiaError] = cls.__bases__[0]
    name = cls.variant
    if name not in family.__annotations__:  # declared in the family's class body
        raise TypeError(f"{family.__name__} does not declare the variant {name}")
    cls.__name__ = name
    cls.__qualname__ = f"{family.__name__}.{name}"
    setattr(family, name, cls)
    family.VARIANTS[name] = cls
    return cls


# -- the families, each declaring its variants ---------------------------------------------------


class PoolError(QualiaError):
    """Errors of the block pool."""

    family = "PoolError"
    VARIANTS: ClassVar[Dict[str, Type[QualiaError]]] = {}
    Exhausted: ClassVar[Type[_PoolExhausted]]
    InvalidPage: ClassVar[Type[_PoolInvalidPage]]
    NotAllocated: ClassVar[Type[_PoolNotAllocated]]
    Overflow: ClassVar[Type[_PoolOverflow]]


class TableError(QualiaError):
    """Errors of a sequence block table; pool errors met by a table are flattened in."""

    family = "TableError"
    VARIANTS: ClassVar[Dict[str, Type[QualiaError]]] = {}
    OutOfRange: ClassVar[Type[_TableOutOfRange]]
    Gap: ClassVar[Type[_TableGap]]
    Exhausted: ClassVar[Type[_TableExhausted]]
    InvalidPage: ClassVar[Type[_TableInvalidPage]]
    NotAllocated: ClassVar[Type[_TableNotAllocated]]
    Overflow: ClassVar[Type[_TableOverflow]]
    NotEmpty: ClassVar[Type[_TableNotEmpty]]


class PrefixKvError(QualiaError):
    """Errors of the prefix KV store."""

    family = "PrefixKvError"
    VARIANTS: ClassVar[Dict[str, Type[QualiaError]]] = {}
    EmptyPrefix: ClassVar[Type[_PrefixEmptyPrefix]]
    TooManyPages: ClassVar[Type[_PrefixTooManyPages]]
    Duplicate: ClassVar[Type[_PrefixDuplicate]]
    Full: ClassVar[Type[_PrefixFull]]
    Unknown: ClassVar[Type[_PrefixUnknown]]
    Table: ClassVar[Type[_PrefixTable]]
    Pool: ClassVar[Type[_PrefixPool]]


class SchedulerError(QualiaError):
    """Errors of the request scheduler."""

    family = "SchedulerError"
    VARIANTS: ClassVar[Dict[str, Type[QualiaError]]] = {}
    DuplicateRequest: ClassVar[Type[_SchedulerDuplicateRequest]]
    Full: ClassVar[Type[_SchedulerFull]]
    UnknownRequest: ClassVar[Type[_SchedulerUnknownRequest]]
    OutputTooSmall: ClassVar[Type[_SchedulerOutputTooSmall]]
    ForkInPrefill: ClassVar[Type[_SchedulerForkInPrefill]]
    Prefix: ClassVar[Type[_SchedulerPrefix]]
    Table: ClassVar[Type[_SchedulerTable]]


class DecodeRoundError(QualiaError):
    """Errors of one decode round."""

    family = "DecodeRoundError"
    VARIANTS: ClassVar[Dict[str, Type[QualiaError]]] = {}
    Scheduler: ClassVar[Type[_RoundScheduler]]
    ItemBufferTooSmall: ClassVar[Type[_RoundItemBufferTooSmall]]
    BlockTableBufferTooSmall: ClassVar[Type[_RoundBlockTableBufferTooSmall]]
    OutputBufferTooSmall: ClassVar[Type[_RoundOutputBufferTooSmall]]
    MissingInputToken: ClassVar[Type[_RoundMissingInputToken]]
    Backend: ClassVar[Type[_RoundBackend]]
    BackendLaunchCount: ClassVar[Type[_RoundBackendLaunchCount]]
    OutputIdentityMismatch: ClassVar[Type[_RoundOutputIdentityMismatch]]


class RaggedBackendError(QualiaError):
    """An error reported by a decode backend itself."""

    family = "RaggedBackendError"
    VARIANTS: ClassVar[Dict[str, Type[QualiaError]]] = {}
    Failed: ClassVar[Type[_BackendFailed]]


class PrefixCacheError(QualiaError):
    """Errors of automatic prefix caching (docs/DESIGN.md, "Automatic prefix caching")."""

    family = "PrefixCacheError"
    VARIANTS: ClassVar[Dict[str, Type[QualiaError]]] = {}
    NamespaceTableFull: ClassVar[Type[_CacheNamespaceTableFull]]


class StepError(QualiaError):
    """Errors of the engine step, ``StepScheduler``: add_request / abort / schedule / update /
    run (docs/DESIGN.md, "The engine step")."""

    family = "StepError"
    VARIANTS: ClassVar[Dict[str, Type[QualiaError]]] = {}
    DuplicateRequest: ClassVar[Type[_StepDuplicateRequest]]
    UnknownRequest: ClassVar[Type[_StepUnknownRequest]]
    NeverFits: ClassVar[Type[_StepNeverFits]]
    QueueFull: ClassVar[Type[_StepQueueFull]]
    PlanPending: ClassVar[Type[_StepPlanPending]]
    NoPlan: ClassVar[Type[_StepNoPlan]]


# -- PoolError -----------------------------------------------------------------------------------


@_variant
class _PoolExhausted(PoolError):
    """No free page is left."""

    variant = "Exhausted"


@_variant
class _PoolInvalidPage(PoolError):
    """The page id is past the end of the pool."""

    variant = "InvalidPage"


@_variant
class _PoolNotAllocated(PoolError):
    """The page's reference count is 0."""

    variant = "NotAllocated"


@_variant
class _PoolOverflow(PoolError):
    """The page's reference count is already 2**32 - 1."""

    variant = "Overflow"


# -- TableError ----------------------------------------------------------------------------------


@_variant
class _TableOutOfRange(TableError):
    """The logical page is at or past the table's capacity."""

    variant = "OutOfRange"


@_variant
class _TableGap(TableError):
    """The logical page is past the mapped length; pages map contiguously from 0."""

    variant = "Gap"


@_variant
class _TableExhausted(TableError):
    """The pool had no free page for a new or copied page."""

    variant = "Exhausted"


@_variant
class _TableInvalidPage(TableError):
    """A mapped page id is past the end of the pool."""

    variant = "InvalidPage"


@_variant
class _TableNotAllocated(TableError):
    """A mapped page was released behind the table's back."""

    variant = "NotAllocated"


@_variant
class _TableOverflow(TableError):
    """A page's reference count would overflow."""

    variant = "Overflow"


@_variant
class _TableNotEmpty(TableError):
    """attach() needs an empty table."""

    variant = "NotEmpty"


# -- PrefixKvError -------------------------------------------------------------------------------


@_variant
class _PrefixEmptyPrefix(PrefixKvError):
    """A prefix needs at least one page and one token."""

    variant = "EmptyPrefix"


@_variant
class _PrefixTooManyPages(PrefixKvError):
    """The prefix has more pages than an entry holds."""

    variant = "TooManyPages"


@_variant
class _PrefixDuplicate(PrefixKvError):
    """The identity is already published."""

    variant = "Duplicate"


@_variant
class _PrefixFull(PrefixKvError):
    """Every entry of the store is in use."""

    variant = "Full"


@_variant
class _PrefixUnknown(PrefixKvError):
    """The identity is not in the store."""

    variant = "Unknown"


@_variant
class _PrefixTable(PrefixKvError):
    """A block-table error while attaching; see .cause."""

    variant = "Table"


@_variant
class _PrefixPool(PrefixKvError):
    """A pool error while publishing or evicting; see .cause."""

    variant = "Pool"


# -- SchedulerError ------------------------------------------------------------------------------


@_variant
class _SchedulerDuplicateRequest(SchedulerError):
    """A request with this id is already active."""

    variant = "DuplicateRequest"


@_variant
class _SchedulerFull(SchedulerError):
    """Every request slot is in use."""

    variant = "Full"


@_variant
class _SchedulerUnknownRequest(SchedulerError):
    """No active request has this id."""

    variant = "UnknownRequest"


@_variant
class _SchedulerOutputTooSmall(SchedulerError):
    """The output buffer is smaller than the number of active requests."""

    variant = "OutputTooSmall"


@_variant
class _SchedulerForkInPrefill(SchedulerError):
    """fork: the parent is still in its prefill (only a decoding request can be forked)."""

    variant = "ForkInPrefill"


@_variant
class _SchedulerPrefix(SchedulerError):
    """A prefix-store error during admission; see .cause."""

    variant = "Prefix"


@_variant
class _SchedulerTable(SchedulerError):
    """A block-table error; see .cause."""

    variant = "Table"


# -- DecodeRoundError ----------------------------------------------------------------------------


@_variant
class _RoundScheduler(DecodeRoundError):
    """A scheduler error; see .cause."""

    variant = "Scheduler"


@_variant
class _RoundItemBufferTooSmall(DecodeRoundError):
    """The item scratch holds fewer items than decoding requests."""

    variant = "ItemBufferTooSmall"


@_variant
class _RoundBlockTableBufferTooSmall(DecodeRoundError):
    """The block-table scratch is smaller than the lowered tables."""

    variant = "BlockTableBufferTooSmall"


@_variant
class _RoundOutputBufferTooSmall(DecodeRoundError):
    """The output scratch holds fewer outputs than decoding requests."""

    variant = "OutputBufferTooSmall"


@_variant
class _RoundMissingInputToken(DecodeRoundError):
    """A decoding request has no seeded input token."""

    variant = "MissingInputToken"


@_variant
class _RoundBackend(DecodeRoundError):
    """The backend failed; .cause is RaggedBackendError.Failed or the Python exception."""

    variant = "Backend"


@_variant
class _RoundBackendLaunchCount(DecodeRoundError):
    """The backend reported a launch count other than 1."""

    variant = "BackendLaunchCount"


@_variant
class _RoundOutputIdentityMismatch(DecodeRoundError):
    """The backend's outputs do not match the lowered batch."""

    variant = "OutputIdentityMismatch"


# -- RaggedBackendError --------------------------------------------------------------------------


@_variant
class _BackendFailed(RaggedBackendError):
    """The backend failed with its own i32 status code (``.code``)."""

    variant = "Failed"
    code: int

    def __init__(self, code: int = -1, detail: str = "") -> None:
        self.code = int(code)
        super().__init__(None, detail or f"backend status {self.code}")

    def __reduce__(self) -> Tuple[Any, ...]:
        return (type(self), (self.code, self.detail))


# -- PrefixCacheError ----------------------------------------------------------------------------


@_variant
class _CacheNamespaceTableFull(PrefixCacheError):
    """Every namespace id is in use by a live request or a cached page."""

    variant = "NamespaceTableFull"


# -- StepError -----------------------------------------------------------------------------------


@_variant
class _StepDuplicateRequest(StepError):
    """The request id is already waiting, running or finished but not yet collected."""

    variant = "DuplicateRequest"


@_variant
class _StepUnknownRequest(StepError):
    """No step request has this id."""

    variant = "UnknownRequest"


@_variant
class _StepNeverFits(StepError):
    """The request could never run: its prompt plus max_new_tokens passes the block table
    (logical_pages x page_tokens tokens) or needs more pages than the pool holds."""

    variant = "NeverFits"


@_variant
class _StepQueueFull(StepError):
    """Every one of the max_queued request entries is in use."""

    variant = "QueueFull"


@_variant
class _StepPlanPending(StepError):
    """schedule() was called while the previous plan still waits for its update()."""

    variant = "PlanPending"


@_variant
class _StepNoPlan(StepError):
    """update() was called with no plan pending (no schedule() since the last update())."""

    variant = "NoPlan"


# -- errors outside the families -----------------------------------------------------------------


class BusyError(QualiaError, RuntimeError):
    """The object is owned by another mutating call still in progress (a decode round running
    without the GIL in another thread, or a call re-entered from a backend, a GC callback or a
    finalizer: retry after that call), or it is the pool of a StepScheduler, which owns it for
    its whole life (docs/DESIGN.md, "Ownership").  Nothing was changed."""

    family = "BusyError"


class BackendAbiError(QualiaError, TypeError):
    """A C backend capsule has the wrong name, ABI version or struct size."""

    family = "BackendAbiError"
