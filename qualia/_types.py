"""Small value types returned by the core and by the pure-Python reference alike."""

from __future__ import annotations

import enum
from typing import NamedTuple, Optional

__all__ = ["RequestState", "Admission", "RaggedBatchReceipt", "CopyOnWrite"]


class RequestState(enum.IntEnum):
    """The seed's ``RequestState``; the C mirror stores it in one byte."""

    EMPTY = 0
    PREFILL = 1
    DECODE = 2


class Admission(NamedTuple):
    """Result of ``admit_with_prefix``: the slot taken and what the prefix store gave."""

    slot: int
    prefix_hit: bool
    prefix_tokens: int


class RaggedBatchReceipt(NamedTuple):
    """What a backend reports for one decode round (``Default`` is all zeros)."""

    batch_size: int = 0
    backend_launches: int = 0


class CopyOnWrite(NamedTuple):
    """Result of ``ensure_writable``.

    ``kind`` is ``"exclusive"`` (write in place), ``"allocated"`` (a fresh page was appended) or
    ``"copy"`` (the backend must copy physical page ``src`` to ``page`` before writing).
    ``page`` is always the page to write.
    """

    kind: str
    page: int
    src: Optional[int] = None

    @classmethod
    def exclusive(cls, page: int) -> "CopyOnWrite":
        return cls("exclusive", page, None)

    @classmethod
    def allocated(cls, page: int) -> "CopyOnWrite":
        return cls("allocated", page, None)

    @classmethod
    def copy(cls, src: int, dst: int) -> "CopyOnWrite":
        return cls("copy", dst, src)
