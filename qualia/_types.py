"""Small value types returned by the core and by the pure-Python reference alike."""

from __future__ import annotations

import enum
from typing import Any, Dict, List, NamedTuple, Optional

import numpy as np

__all__ = ["RequestState", "Admission", "RaggedBatchReceipt", "CopyOnWrite", "CacheStats",
           "CacheEntry", "CachedPrefix", "FinishedRequest", "FinishedGroup", "RunResult",
           "STEP_STATS", "STEP_TOTALS", "RUN_STATS_ROWS"]


class RequestState(enum.IntEnum):
    """The seed's ``RequestState``; the C mirror stores it in one byte."""

    EMPTY = 0
    PREFILL = 1
    DECODE = 2


class Admission(NamedTuple):
    """Result of ``admit_with_prefix``: the slot taken and what the prefix store gave."""

    slot: int
    """The request slot taken."""
    prefix_hit: bool
    """Whether the prefix store (or the page cache) gave pages."""
    prefix_tokens: int
    """Tokens the request starts with, taken from the store or the cache."""


class RaggedBatchReceipt(NamedTuple):
    """What a backend reports for one decode round (``Default`` is all zeros)."""

    batch_size: int = 0
    """Items the backend computed."""
    backend_launches: int = 0
    """Backend launches the round took (1 for a valid round)."""


class CopyOnWrite(NamedTuple):
    """Result of ``ensure_writable``.

    ``kind`` is ``"exclusive"`` (write in place), ``"allocated"`` (a fresh page was appended) or
    ``"copy"`` (the backend must copy physical page ``src`` to ``page`` before writing).
    ``page`` is always the page to write.
    """

    kind: str
    """``"exclusive"``, ``"allocated"`` or ``"copy"``."""
    page: int
    """The page to write."""
    src: Optional[int] = None
    """The page to copy from first (a copy only)."""

    @classmethod
    def exclusive(cls, page: int) -> "CopyOnWrite":
        """Write ``page`` in place."""
        return cls("exclusive", page, None)

    @classmethod
    def allocated(cls, page: int) -> "CopyOnWrite":
        """``page`` was allocated and appended."""
        return cls("allocated", page, None)

    @classmethod
    def copy(cls, src: int, dst: int) -> "CopyOnWrite":
        """Copy ``src`` to ``dst`` before writing ``dst``."""
        return cls("copy", dst, src)


class CacheStats(NamedTuple):
    """Counters of automatic prefix caching (``Scheduler.cache_stats()``); all zero in the other
    modes except ``usage``."""

    lookups: int
    """Admissions that looked a prompt up."""
    lookup_tokens: int
    """Prompt tokens looked up."""
    hit_tokens: int
    """Prompt tokens served from cached pages."""
    reclaims: int
    """Cached pages reclaimed to satisfy an allocation."""
    cached_pages: int
    """Pages the cache holds now (in use and reclaimable)."""
    reclaimable_pages: int
    """Cached pages only the cache holds."""
    stored: int
    """Pages inserted."""
    duplicates: int
    """Full pages not inserted: an identical verified entry existed."""
    collisions: int
    """Identity matches rejected by verification."""
    pages_hashed: int
    """Page identities computed."""
    events_pending: int
    """KV events waiting in the ring."""
    events_dropped: int
    """KV events lost to a full ring."""
    namespaces: int
    """Namespaces interned now (the empty one included)."""
    usage: float
    """Fraction of the pool's pages that requests hold."""

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / lookup_tokens`` (0.0 before the first lookup)."""
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


class CachedPrefix(NamedTuple):
    """What an admission of a prompt would take from the cache now
    (``Scheduler.cached_prefix``): ``tokens`` reused in ``pages`` pages, of which
    ``reclaimable`` are reclaimable now (the admission takes them out of ``free_pages``)."""

    tokens: int
    """Tokens an admission would reuse."""
    pages: int
    """Pages holding them."""
    reclaimable: int
    """Of those pages, how many are reclaimable now."""


class CacheEntry(NamedTuple):
    """One cached page (``Scheduler.cache_entry(page)``)."""

    identity: int
    """The page's 64-bit identity."""
    parent: Optional[int]
    """The parent page's identity; None for the first page of a chain."""
    namespace_id: int
    """The interned id of the page's namespace."""
    generation: int
    """The insertion stamp that names this entry for ever."""
    reclaimable: bool
    """Whether only the cache holds the page."""


class FinishedRequest(NamedTuple):
    """A request the engine step finished: its id, the tokens it generated (a uint32 array, the
    prompt not included) and why it stopped: ``"length"`` (max_new_tokens reached) or
    ``"stop"`` (its eos token, unless ignored, or one of its stop token ids)."""

    request_id: int
    """The request's id."""
    output_tokens: Any
    """The generated tokens, a uint32 array (the prompt not included)."""
    finish_reason: str
    """``"length"`` or ``"stop"``."""


class FinishedGroup(NamedTuple):
    """A finished request group: the parent's id; ``n``: one uint32 output per member in member
    order, why each stopped, ``scores=None`` and the members' ids (what the sampler keys on);
    beam search: the hypotheses best first, why each ended, their cumulative
    log-probabilities, and ``member_ids=[]``."""

    request_id: int
    """The group's id (its parent's)."""
    outputs: List[Any]
    """One uint32 array per member (``n``) or hypothesis (beam search, best first)."""
    finish_reasons: List[str]
    """Why each output ended."""
    scores: Optional[List[float]]
    """The hypotheses' cumulative log-probabilities (beam search), or None."""
    member_ids: List[int]
    """The members' ids, what the sampler keys on (``n``); empty for beam search."""


#: One row per step of ``run()`` (and what the twin's ``run()`` returns): the plan's sizes, what
#: the step admitted, preempted and finished, and the queues and free pages after its update.
STEP_STATS = np.dtype([
    ("num_seqs", "<u4"),            # requests in the plan
    ("num_tokens", "<u4"),          # tokens in the plan
    ("num_prefill_tokens", "<u4"),
    ("num_decode_tokens", "<u4"),
    ("num_sampled", "<u4"),         # rows sampled
    ("num_new", "<u4"),             # named new: admitted (or a discarded plan's again)
    ("num_preempted", "<u4"),
    ("num_cached_tokens", "<u4"),   # prompt tokens the prefix cache skipped at admissions
    ("num_finished", "<u4"),        # finished by this step's update
    ("num_waiting", "<u4"),         # after the update
    ("num_running", "<u4"),
    ("free_pages", "<u4"),          # free plus reclaimable cached pages, after the update
])


#: The ``STEP_STATS`` fields that ``RunResult.totals`` sums over every step of a ``run()`` call
#: (the others are queue lengths and free pages after a step, which do not add up).
STEP_TOTALS = ("num_seqs", "num_tokens", "num_prefill_tokens", "num_decode_tokens",
               "num_sampled", "num_new", "num_preempted", "num_cached_tokens", "num_finished")

#: The ``STEP_STATS`` rows ``run()`` keeps by default: those of its last 4096 steps.
RUN_STATS_ROWS = 4096


class RunResult(NamedTuple):
    """What ``run()`` returns.

    ``stats``: one ``STEP_STATS`` row for each of the last ``min(steps, stats_rows)`` steps of
    the call, oldest first (``stats_rows``, a keyword of ``run()``, default ``RUN_STATS_ROWS``,
    bounds the call's memory however many steps it runs); ``finished``: the requests (and
    groups) it finished, in the order they finished; ``steps``: the steps it ran; ``totals``:
    each ``STEP_TOTALS`` field summed over all ``steps`` steps."""

    stats: Any
    """``STEP_STATS`` rows of the last ``min(steps, stats_rows)`` steps, oldest first."""
    finished: List[Any]
    """``FinishedRequest`` and ``FinishedGroup`` results, in the order they finished."""
    steps: int
    """Steps the call ran."""
    totals: Dict[str, int]
    """Each ``STEP_TOTALS`` field summed over all the steps."""
