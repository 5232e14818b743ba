"""The error families of the seed, one Python exception class per variant.

Every family (``PoolError``, ``TableError``, ``PrefixKvError``, ``SchedulerError``,
``DecodeRoundError``, ``RaggedBackendError``) is a subclass of :class:`QualiaError`, and each of
its variants is a subclass of the family, reachable as an attribute of it::

    try:
        sched.admit_with_prefix(7, identity, store, pool)
    except qualia.SchedulerError.Prefix as err:
        err.cause            # PrefixKvError.Table(...)
        err.chain            # ('SchedulerError.Prefix', 'PrefixKvError.Table', 'TableError.OutOfRange')

Wrapping variants (``SchedulerError.Prefix``, ``DecodeRoundError.Backend`` ...) carry the inner
error as ``.cause``; it is also chained as ``__cause__`` so tracebacks show it.  The Rust seed
reports these as nested enum values; Python users get the same nesting without parsing strings.
"""

from __future__ import annotations

from typing import ClassVar, Dict, Optional, Tuple, Type

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
    "BackendAbiError",
]


class QualiaError(Exception):
    """Base of every error the package raises for a seed or SPEC error variant."""

    family: ClassVar[str] = "QualiaError"
    variant: ClassVar[str] = ""
    VARIANTS: ClassVar[Dict[str, Type["QualiaError"]]] = {}

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

    def __reduce__(self):  # keep pickling (multiprocessing engines) working
        return (type(self), (self.cause, self.detail))


def _family(name: str, doc: str, variants: Dict[str, str]) -> Type[QualiaError]:
    family = type(name, (QualiaError,), {"__doc__": doc, "family": name, "__module__": __name__})
    table: Dict[str, Type[QualiaError]] = {}
    for variant, vdoc in variants.items():
        cls = type(
            variant,
            (family,),
            {"__doc__": vdoc, "variant": variant, "__module__": __name__,
             "__qualname__": f"{name}.{variant}"},
        )
        setattr(family, variant, cls)
        table[variant] = cls
    family.VARIANTS = table
    return family


PoolError = _family(
    "PoolError",
    "Errors of the block pool (SPEC §2).",
    {
        "Exhausted": "No free page is left.",
        "InvalidPage": "The page id is past the end of the pool.",
        "NotAllocated": "The page's reference count is 0.",
        "Overflow": "The page's reference count is already 2**32 - 1.",
    },
)

TableError = _family(
    "TableError",
    "Errors of a sequence block table (SPEC §3); pool errors met by a table are flattened in.",
    {
        "OutOfRange": "The logical page is at or past the table's capacity.",
        "Gap": "The logical page is past the mapped length; pages map contiguously from 0.",
        "Exhausted": "The pool had no free page for a new or copied page.",
        "InvalidPage": "A mapped page id is past the end of the pool.",
        "NotAllocated": "A mapped page was released behind the table's back.",
        "Overflow": "A page's reference count would overflow.",
        "NotEmpty": "attach() needs an empty table.",
    },
)

PrefixKvError = _family(
    "PrefixKvError",
    "Errors of the prefix KV store (SPEC §4).",
    {
        "EmptyPrefix": "A prefix needs at least one page and one token.",
        "TooManyPages": "The prefix has more pages than an entry holds.",
        "Duplicate": "The identity is already published.",
        "Full": "Every entry of the store is in use.",
        "Unknown": "The identity is not in the store.",
        "Table": "A block-table error while attaching; see .cause.",
        "Pool": "A pool error while publishing or evicting; see .cause.",
    },
)

SchedulerError = _family(
    "SchedulerError",
    "Errors of the request scheduler (the seed's SchedulerError).",
    {
        "DuplicateRequest": "A request with this id is already active.",
        "Full": "Every request slot is in use.",
        "UnknownRequest": "No active request has this id.",
        "OutputTooSmall": "The output buffer is smaller than the number of active requests.",
        "Prefix": "A prefix-store error during admission; see .cause.",
        "Table": "A block-table error; see .cause.",
    },
)

DecodeRoundError = _family(
    "DecodeRoundError",
    "Errors of one decode round (the seed's DecodeRoundError).",
    {
        "Scheduler": "A scheduler error; see .cause.",
        "ItemBufferTooSmall": "The item scratch holds fewer items than decoding requests.",
        "BlockTableBufferTooSmall": "The block-table scratch is smaller than the lowered tables.",
        "OutputBufferTooSmall": "The output scratch holds fewer outputs than decoding requests.",
        "MissingInputToken": "A decoding request has no seeded input token.",
        "Backend": "The backend failed; .cause is RaggedBackendError.Failed or the Python exception.",
        "BackendLaunchCount": "The backend reported a launch count other than 1.",
        "OutputIdentityMismatch": "The backend's outputs do not match the lowered batch.",
    },
)

RaggedBackendError = _family(
    "RaggedBackendError",
    "An error reported by a decode backend itself.",
    {"Failed": "The backend failed with its own i32 status code (.code)."},
)


PrefixCacheError = _family(
    "PrefixCacheError",
    "Errors of automatic prefix caching (docs/DESIGN.md, \"Automatic prefix caching\").",
    {"NamespaceTableFull": "Every namespace id is in use by a live request or a cached page."},
)


def _failed_init(self, code: int = -1, detail: str = "") -> None:
    self.code = int(code)
    QualiaError.__init__(self, None, detail or f"backend status {self.code}")


def _failed_reduce(self):
    return (type(self), (self.code, self.detail))


RaggedBackendError.Failed.__init__ = _failed_init  # type: ignore[attr-defined]
RaggedBackendError.Failed.__reduce__ = _failed_reduce  # type: ignore[attr-defined]


class BusyError(QualiaError, RuntimeError):
    """The object is in use by a decode round running without the GIL in another thread
    (or a backend called back into the scheduler mid-round).  Nothing was changed; retry
    after the round."""

    family = "BusyError"


class BackendAbiError(QualiaError, TypeError):
    """A C backend capsule has the wrong name, ABI version or struct size."""

    family = "BackendAbiError"
