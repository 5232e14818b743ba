"""The serving loop: a small continuous-batching engine on the :class:`qualia.Scheduler` facade.

This is what ``python -m qualia simulate`` runs.  :class:`Engine` serves requests
(:class:`qualia.workload.Request`, e.g. from a :class:`qualia.workload.Workload` trace) on one
:class:`qualia.Scheduler`, step by step.  Every step admits waiting requests (first come, first
served) while a request slot is free and the pool has the pages for the prompt plus one page of
headroom, prefills them, then runs one decode round over every running request.  When a request
of a multi-turn :class:`~qualia.workload.Workload` completes, its conversation's next turn is
submitted (:meth:`Workload.next_turn <qualia.workload.Workload.next_turn>`).  The other jobs
live beside it: the check in :mod:`qualia.check`, the accounting of time in
:mod:`qualia.timing`, the summary in :mod:`qualia.report`.

The backend is either a *model* (it has ``prefill(tokens, start_position, block_table)``, e.g.
:class:`qualia.model.PagedModelBackend`): the engine prefills prompts through it and the
generated tokens can be checked against the dense model; or a decode-only backend such as the
built-in C ``qualia.HashBackend``: prefill then only reserves and advances the pages, and the
first token is the hash decode rule (``qualia.hash_next_token``) applied to the last prompt
token at its position.

Prefix caching (``prefix_caching``) is automatic by default: the scheduler shares the longest
cached run of a context's full pages at admission (the previous turns of a conversation
included), caches every page as it fills, and reclaims least recently used cached pages when it
needs pages; the engine only admits the context and reads the KV events.  ``"explicit"`` uses
breakpoints instead: a request's ``shared_prefix_len`` (its system prompt) is looked up at
admission and published after its prefill, capped at ``len(prompt) - 1`` so that a hit always
leaves at least one prompt token to prefill (the one whose logits give the first generated
token).  ``"off"`` shares nothing.

Memory pressure has one remedy, :meth:`Engine._relieve_pressure`, used when a ``reserve`` or a
``decode`` fails with ``TableError.Exhausted`` somewhere in its error chain (with automatic
caching: when even the reclaimable cached pages are not enough): in explicit mode, evict the
least recently used prefix entry that no running request holds; then, if other requests are
running, requeue the most recently admitted one (rolled back if it was being admitted,
*preempted* otherwise: its pages are released and it goes back to the front of the waiting queue
keeping the tokens generated so far; on re-admission it is prefilled with ``prompt +
generated[:-1]`` (recompute; with automatic caching the pages it had filled are usually still
cached) and decoding continues from ``generated[-1]``); with a single request running, in
explicit mode, evict any prefix entry even if that request shares it, which turns its shared
pages into exclusive ones.  Admission itself only evicts unused entries, then waits.  A request
whose ``prompt + max_new_tokens`` cannot fit in the whole pool (or in ``logical_pages``) is
rejected by :meth:`Engine.submit` (:class:`UnservableRequest`), so the engine cannot deadlock:
with nothing else running, the head of the queue always fits.
"""

from __future__ import annotations

import collections
from typing import Callable, Dict, Iterable, List, Optional

import numpy as np

from .check import CheckResult, check_outputs, progress_reporter, verify_end_state
from .report import Counters, EngineResult, backend_label, collect_stats
from .resources import memory_estimate
from .timing import (
    BACKEND,
    CHECK,
    DECODE_ROUND,
    ENGINE,
    SCHEDULER,
    SETUP,
    SUBMISSION,
    WORKLOAD,
    Stopwatch,
    TimedBackend,
    is_c_backend,
)
from .workload import Request, UnservableRequest, Workload, checked_request, pages_needed

__all__ = [
    "Engine",
    "Counters",
    "UnservableRequest",
    "is_exhausted",
    "pages_needed",
    # re-exported: the engine's input and output types, and the memory estimate
    "memory_estimate",
    "Request",
    "Workload",
    "EngineResult",
    "CheckResult",
    "TimedBackend",
]

_EVICTED, _REQUEUED = "evicted", "requeued"
_ROLLBACK, _PREEMPT = "rollback", "preemption"


def is_exhausted(err: BaseException) -> bool:
    """True when a qualia error is (or wraps) the pool running out of pages."""
    chain = getattr(err, "chain", None)
    if chain is None:
        return False
    return any(name in ("TableError.Exhausted", "PoolError.Exhausted") for name in chain)


class _Live:
    """Engine-side state of one request."""

    __slots__ = ("req", "generated")

    def __init__(self, req: Request) -> None:
        self.req = req
        self.generated: List[int] = []

    def context(self) -> List[int]:
        """Tokens whose K/V must be in the cache before the next decode: the prompt and every
        generated token but the pending last one."""
        if len(self.generated) > 1:
            return list(self.req.prompt) + self.generated[:-1]
        return list(self.req.prompt)

    def finished(self, end_token: Optional[int]) -> bool:
        g = self.generated
        return len(g) >= self.req.max_new_tokens or (
            end_token is not None and bool(g) and g[-1] == end_token)


class Engine:
    """Serve requests on one :class:`qualia.Scheduler` (see the module docstring).

    ``backend``: ``"model"`` (a :class:`~qualia.model.PagedModelBackend` over
    ``ModelWeights.random(model_config)``), ``"c"`` (``qualia.HashBackend(vocab)``), or a
    backend object.  A backend with a ``prefill`` method is a model.  A C backend (a
    ``__qualia_backend__`` capsule) is passed to ``Scheduler.decode`` as it is, keeping its
    GIL-free path: the time of that call is the scheduler's part of the round and the backend
    together (row ``decode_round``).  A Python backend is wrapped in a
    :class:`~qualia.timing.TimedBackend`, so that its time is told apart from the scheduler's.

    ``prefix_caching`` is ``"auto"`` (the default), ``"explicit"`` or ``"off"`` (see the module
    docstring and ``qualia.Scheduler``).

    ``clock`` is the :class:`~qualia.timing.Stopwatch` the engine charges its time to (the CLI
    passes one started before anything else); by default the engine makes one that counts only
    while an engine method runs.  ``on_complete(request_id, tokens)`` is called whenever a
    request completes."""

    def __init__(
        self,
        backend="model",
        *,
        max_requests: int = 24,
        num_blocks: int = 96,
        page_tokens: int = 16,
        logical_pages: int = 16,
        prefix_entries: int = 6,
        prefix_pages: Optional[int] = None,
        end_token: Optional[int] = None,
        model_config=None,
        vocab: Optional[int] = None,
        on_complete: Optional[Callable[[int, List[int]], None]] = None,
        clock: Optional[Stopwatch] = None,
        prefix_caching: str = "auto",
    ) -> None:
        import qualia

        self._owns_clock = clock is None
        self.clock = clock if clock is not None else Stopwatch(SETUP)
        token = self.clock.enter(SETUP)
        self.page_tokens = int(page_tokens)
        self.scheduler = qualia.Scheduler(
            max_requests, num_blocks, page_tokens, logical_pages,
            prefix_entries=prefix_entries, prefix_pages=prefix_pages,
            prefix_caching=prefix_caching)
        self.caching = self.scheduler.prefix_caching
        self._auto = self.caching == "auto"
        self._events = np.zeros(256, dtype=qualia.KV_EVENT)  # drained each step
        self.end_token = None if end_token is None else int(end_token)
        self.weights = None
        if isinstance(backend, str):
            if backend == "model":
                from .model import ModelConfig, ModelWeights, PagedModelBackend

                cfg = model_config if model_config is not None else ModelConfig()
                self.weights = ModelWeights.random(cfg)
                backend = PagedModelBackend(self.weights, num_blocks, page_tokens)
            elif backend == "c":
                backend = qualia.HashBackend(vocab=32000 if vocab is None else vocab)
            else:
                raise ValueError(f"backend must be 'model', 'c' or a backend object, not "
                                 f"{backend!r}")
        self.raw_backend = backend
        self.is_model = callable(getattr(backend, "prefill", None))
        self.is_c_backend = not self.is_model and is_c_backend(backend)
        self.backend_label = backend_label(backend, self.is_model, self.is_c_backend)
        if self.is_model:
            self.weights = getattr(backend, "weights", self.weights)
            bt = getattr(backend, "page_tokens", self.page_tokens)
            bn = getattr(backend, "num_blocks", self.scheduler.num_blocks)
            if bt != self.page_tokens or bn < self.scheduler.num_blocks:
                raise ValueError(
                    f"the model backend has {bn} pages of {bt} tokens; the scheduler needs "
                    f"{self.scheduler.num_blocks} pages of {self.page_tokens} tokens")
            # prompt token ids must be in the model's vocabulary
            self.vocab = int(getattr(getattr(backend, "config", None), "vocab", 0) or 0) or None
            self._prompt_vocab = self.vocab
        else:
            # the decode rule's vocabulary; any u32 prompt token id is fine
            self.vocab = int(vocab if vocab is not None else getattr(backend, "vocab", 32000))
            self._prompt_vocab = None
        self.backend = backend if self.is_c_backend else TimedBackend(backend, self.clock)
        self._can_copy = callable(getattr(self.backend, "copy_pages", None))
        self.on_complete = on_complete
        self._hash_next_token = qualia.hash_next_token
        self._progress: Optional[Callable[[str, int, int], None]] = None

        self.step_no = 0
        self._requests: Dict[int, Request] = {}
        self._arrivals: collections.deque = collections.deque()  # sorted by arrival step
        self._waiting: collections.deque = collections.deque()
        self._running: "collections.OrderedDict[int, _Live]" = collections.OrderedDict()
        self._completions: Dict[int, int] = {}
        self.outputs: Dict[int, List[int]] = {}
        self._sorted = True
        # a multi-turn Workload's next_turn(request, answer, step), set by submit_all
        self._next_turn: Optional[Callable[[Request, List[int], int], Optional[Request]]] = None

        # per step with work: seconds in the scheduler calls, in the decode call of a C backend
        # (scheduler and backend together) and in the backend
        self.round_sched_s: List[float] = []
        self.round_decode_s: List[float] = []
        self.round_backend_s: List[float] = []
        self.counters = Counters()
        self.peak_pages = 0
        self.peak_running = 0
        self.last_check: Optional[CheckResult] = None
        if self._owns_clock:
            self.clock.stop()  # an engine-owned clock counts only inside engine methods
        else:
            self.clock.leave(token)

    # -- properties ---------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.scheduler.num_blocks

    @property
    def pending(self) -> int:
        """Requests submitted and not yet completed."""
        return len(self._arrivals) + len(self._waiting) + len(self._running)

    @property
    def wall_s(self) -> float:
        """Seconds on the engine's clock so far (the sum of its rows)."""
        return self.clock.wall_s

    def _call(self, fn, *args, **kwargs):
        """A qualia.Scheduler bookkeeping call, charged to the scheduler row."""
        clock = self.clock
        prev = clock.switch(SCHEDULER)
        try:
            return fn(*args, **kwargs)
        finally:
            clock.switch(prev)

    # -- submission ---------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queue a request for its arrival step.  Raises :class:`UnservableRequest` (a
        ``ValueError``) for a request that needs more pages than the whole pool or a request's
        ``logical_pages``, and ``ValueError`` for an empty prompt, no tokens to generate, bad
        token ids or a duplicate request id."""
        token = self.clock.enter(SUBMISSION)
        try:
            self._submit(request)
        finally:
            self.clock.leave(token)

    def submit_all(self, requests: Iterable[Request]) -> int:
        """Submit every request of ``requests`` (a :class:`~qualia.workload.Workload` is
        generated first, charged to the workload row); returns how many were submitted."""
        n = 0
        token = self.clock.enter(WORKLOAD)
        try:
            if isinstance(requests, Workload):
                if requests.turns > 1:
                    self._next_turn = requests.next_turn
                requests = requests.generate()
            self.clock.switch(SUBMISSION)
            for req in requests:
                self._submit(req)
                n += 1
        finally:
            self.clock.leave(token)
        return n

    def _submit(self, request: Request) -> None:
        if int(request.request_id) in self._requests:
            raise ValueError(f"request {int(request.request_id)}: duplicate request id")
        s = self.scheduler
        request = checked_request(request, page_tokens=self.page_tokens,
                                  num_blocks=s.num_blocks, logical_pages=s.logical_pages,
                                  vocab=self._prompt_vocab)
        rid = request.request_id
        self._requests[rid] = request
        if self._arrivals and request.arrival_step < self._arrivals[-1].req.arrival_step:
            self._sorted = False
        self._arrivals.append(_Live(request))

    # -- the loop -----------------------------------------------------------------------------

    def run(self, requests: Iterable[Request] = (), *, check: bool = False,
            progress: Optional[Callable[[str, int, int], None]] = None) -> EngineResult:
        """Submit ``requests``, serve everything submitted to completion, verify the end state
        (every request completed exactly once, no request active, the pool holding only the
        prefix store's pages), run the check if ``check``, and report.

        ``progress(phase, done, total)`` is called with phase ``"serve"`` as requests complete
        and ``"check"`` as they are checked (first with ``done == 0``)."""
        self.submit_all(requests)
        token = self.clock.enter(ENGINE)
        self._progress = progress
        try:
            while self.pending:
                self._step()
            self.verify_end_state()
        finally:
            self._progress = None
            self.clock.leave(token)
        checked = None
        if check:
            checked = self.check(None if progress is None
                                 else progress_reporter(progress, len(self.outputs)))
            self.last_check = checked
        return EngineResult(self.stats(), dict(self.outputs), checked)

    def step(self) -> None:
        """One engine step: arrivals, admission + prefill, one decode round."""
        token = self.clock.enter(ENGINE)
        try:
            self._step()
        finally:
            self.clock.leave(token)

    def _step(self) -> None:
        if not self._sorted:
            self._arrivals = collections.deque(
                sorted(self._arrivals, key=lambda lv: lv.req.arrival_step))
            self._sorted = True
        while self._arrivals and self._arrivals[0].req.arrival_step <= self.step_no:
            self._waiting.append(self._arrivals.popleft())
        if not self._waiting and not self._running:
            if self._arrivals:  # idle: jump to the next arrival
                self.counters.idle_steps += self._arrivals[0].req.arrival_step - self.step_no
                self.step_no = self._arrivals[0].req.arrival_step
            return
        secs = self.clock.seconds
        s0, d0, b0 = secs[SCHEDULER], secs[DECODE_ROUND], secs[BACKEND]
        self._admit_waiting()
        self._decode_round()
        if self._auto:
            self._drain_events()
        self.round_sched_s.append(secs[SCHEDULER] - s0)
        self.round_decode_s.append(secs[DECODE_ROUND] - d0)
        self.round_backend_s.append(secs[BACKEND] - b0)
        self.step_no += 1
        self.counters.steps += 1

    def _sample_pool(self) -> None:
        used = self.scheduler.num_blocks - self.scheduler.free_pages
        if used > self.peak_pages:
            self.peak_pages = used
        if len(self._running) > self.peak_running:
            self.peak_running = len(self._running)

    # -- admission and prefill ----------------------------------------------------------------

    def _prefix_len(self, req: Request) -> int:
        return max(0, min(int(req.shared_prefix_len), len(req.prompt) - 1))

    def _admission_pages(self, live: _Live) -> int:
        """Free pages the head of the queue needs to be admitted: the pages its prefill
        allocates (less the full pages a prefix hit would share), plus one of headroom, capped
        at what the request needs at its peak; with automatic caching, plus the shared pages
        that are reclaimable now (sharing them takes them out of ``free_pages``)."""
        s, pt, req = self.scheduler, self.page_tokens, live.req
        ctx = len(req.prompt) + max(0, len(live.generated) - 1)
        shared = taken = 0
        plen = self._prefix_len(req) if self.caching == "explicit" else 0
        if self._auto:
            hit = self._call(s.cached_prefix, live.context(), req.namespace)
            shared, taken = hit.pages, hit.reclaimable
        elif plen:
            ident = self._call(s.identity_for, req.prompt, plen, req.namespace)
            if self._call(s.prefixes.contains, ident):
                shared = self._call(s.prefixes.tokens_of, ident) // pt
        total = pages_needed(len(req.prompt), req.max_new_tokens, pt)
        prefill_pages = -(-ctx // pt) - shared
        return max(0, min(prefill_pages + 1, total - shared)) + taken

    def _admit_waiting(self) -> None:
        s = self.scheduler
        while self._waiting and len(self._running) < s.max_requests:
            live = self._waiting[0]
            while True:
                need = self._admission_pages(live)
                if s.free_pages >= need or not self._evict(unused_only=True):
                    break
            if s.free_pages < need:
                if not self._running:  # cannot happen: submit() rejects what cannot fit
                    raise RuntimeError(
                        f"engine stuck: request {live.req.request_id} needs {need} pages, "
                        f"{s.free_pages} free with nothing running")
                self.counters.admission_waits += 1
                break  # first come, first served: the head of the queue waits
            self._waiting.popleft()
            if not self._prefill(live):
                break

    def _prefill(self, live: _Live) -> bool:
        """Admit ``live`` and prefill its context; returns False if it had to be put back."""
        s, c, req, rid = self.scheduler, self.counters, live.req, live.req.request_id
        ctx = live.context()
        plen = self._prefix_len(req) if self.caching == "explicit" else 0
        if self._auto:  # the whole context: a recompute finds the pages it filled before
            adm = self._call(s.admit, rid, ctx, namespace=req.namespace)
            c.prefix_lookups += 1
        elif plen:
            adm = self._call(s.admit, rid, req.prompt, namespace=req.namespace, prefix_len=plen)
            c.prefix_lookups += 1
        else:
            adm = self._call(s.admit, rid)
        self._running[rid] = live
        start = int(adm.prefix_tokens) if adm.prefix_hit else 0
        if adm.prefix_hit:
            c.prefix_hits += 1
            c.prefix_tokens_reused += start
        if live.generated:
            c.recomputes += 1

        # _prefix_len() caps the looked-up prefix at len(prompt) - 1, and automatic caching
        # reuses at most (len(ctx) - 1) // page_tokens pages, so a hit always leaves at least
        # the last token to prefill (its logits give the first token)
        assert start < len(ctx), "prefix hit covers the whole context"
        n = len(ctx) - start
        copies = self._reserve_for_prefill(live, n)
        if copies is None:
            return False
        self._copy(copies)
        token = self._first_token(rid, ctx, start)
        self._call(s.advance, rid, n)
        c.tokens_prefilled += n
        if live.generated:
            c.tokens_recomputed += n

        if live.generated:  # recompute: the pending token is the one generated before
            if token != live.generated[-1]:
                c.recompute_mismatches += 1
            token = live.generated[-1]
        else:
            live.generated.append(int(token))
        self._call(s.complete_prefill, rid, token)
        self._publish(live)
        self._sample_pool()
        if live.finished(self.end_token):
            self._complete(live)
        return True

    def _first_token(self, rid: int, ctx: List[int], start: int) -> int:
        if self.is_model:
            table = self._call(self.scheduler.block_table, rid)
            return int(self.backend.prefill(ctx[start:], start, table))
        # a decode-only backend: the engine stands in for its prefill with the hash rule (its
        # vocabulary is always set: only a model backend may leave self.vocab None)
        vocab = self.vocab
        assert vocab is not None
        return self._hash_next_token(rid, len(ctx) - 1, ctx[-1], vocab)

    def _copy(self, copies) -> None:
        n = len(copies)
        if not n:
            return
        self.counters.pages_copied_prefill += n
        if self._can_copy:
            if self.is_c_backend:
                prev = self.clock.switch(BACKEND)
                try:
                    self.backend.copy_pages(copies)
                finally:
                    self.clock.switch(prev)
            else:  # the TimedBackend charges itself
                self.backend.copy_pages(copies)

    def _reserve_for_prefill(self, live: _Live, n: int):
        """Reserve ``n`` tokens for ``live`` (just admitted); returns the copies to perform, or
        None when the admission had to be rolled back (``live`` is at the head of the queue
        again)."""
        s, rid = self.scheduler, live.req.request_id
        while True:
            try:
                return self._call(s.reserve, rid, n)
            except Exception as err:
                if not is_exhausted(err):
                    raise
                failure = err
            done = self._relieve_pressure(_ROLLBACK)
            if done is None:
                raise RuntimeError(
                    f"engine stuck: cannot reserve {n} pages for request {rid} alone"
                ) from failure
            if done == _REQUEUED:
                return None

    def _publish(self, live: _Live) -> None:
        s, req = self.scheduler, live.req
        if self.caching != "explicit":
            return
        plen = self._prefix_len(req)
        if not plen:
            return
        ident = self._call(s.identity_for, req.prompt, plen, req.namespace)
        if self._call(s.prefixes.contains, ident):
            return
        if -(-plen // self.page_tokens) > s.prefixes.max_pages:
            self.counters.publish_skipped_too_long += 1
            return
        if len(s.prefixes) >= s.prefixes.capacity:
            if not (self._evict(unused_only=True, for_entries=True)
                    or self._evict(unused_only=False, for_entries=True)):
                return  # pragma: no cover - capacity >= 1
        self._call(s.publish_prefix, req.request_id, req.prompt, plen, req.namespace)
        self.counters.prefixes_published += 1

    # -- memory pressure ----------------------------------------------------------------------

    def _evict(self, *, unused_only: bool, for_entries: bool = False) -> bool:
        """Evict the least recently used prefix entry (one no running request holds, if
        ``unused_only``); count it, for store entries or for pages.  False if none was left (and
        always outside explicit mode: there is no store to evict from)."""
        s = self.scheduler
        if self.caching != "explicit":
            return False
        victim = self._call(s.evict_unused_lru if unused_only else s.evict_lru)
        if victim is None:
            return False
        c = self.counters
        c.evictions += 1
        if for_entries:
            c.evictions_for_entries += 1
        else:
            c.evictions_for_pages += 1
        return True

    def _relieve_pressure(self, requeue_as: str) -> Optional[str]:
        """Free pages, the one way the engine does it (see the module docstring): evict an
        unused prefix entry; else, with other requests running, requeue the most recently
        admitted one (``requeue_as``: ``"rollback"`` of the admission being made, or
        ``"preemption"``); else evict any prefix entry.  Returns ``"evicted"``,
        ``"requeued"`` or None when nothing is left to free."""
        if self._evict(unused_only=True):
            return _EVICTED
        if len(self._running) > 1:
            rid = next(reversed(self._running))
            self._call(self.scheduler.finish, rid)
            self._waiting.appendleft(self._running.pop(rid))
            if requeue_as == _ROLLBACK:
                self.counters.admission_rollbacks += 1
            else:
                self.counters.preemptions += 1
            return _REQUEUED
        if self._evict(unused_only=False):
            return _EVICTED
        return None

    # -- decode -------------------------------------------------------------------------------

    def _decode_round(self) -> None:
        if not self._running:
            return
        s, clock = self.scheduler, self.clock
        while True:
            try:
                if self.is_c_backend:  # scheduler and C backend in one call
                    prev = clock.switch(DECODE_ROUND)
                    try:
                        receipt, outputs = s.decode(self.backend)
                    finally:
                        clock.switch(prev)
                else:  # the TimedBackend charges the backend's part to the backend row
                    receipt, outputs = self._call(s.decode, self.backend)
                break
            except Exception as err:
                if not is_exhausted(err):
                    raise
                failure = err
            self.counters.decode_exhausted += 1
            if self._relieve_pressure(_PREEMPT) is None:
                raise RuntimeError("engine stuck: a decode round cannot get a page") from failure
        self.counters.decode_rounds += 1
        self.counters.decode_items += int(receipt.batch_size)
        ids = outputs["request_id"].tolist()
        tokens = outputs["next_token_id"].tolist()
        self._sample_pool()
        for rid, token in zip(ids, tokens):
            live = self._running[rid]
            live.generated.append(int(token))
            if live.finished(self.end_token):
                self._complete(live)

    def _complete(self, live: _Live) -> None:
        rid = live.req.request_id
        self._call(self.scheduler.finish, rid)
        del self._running[rid]
        self._completions[rid] = self._completions.get(rid, 0) + 1
        self.outputs[rid] = list(live.generated)
        self.counters.completed += 1
        if self.on_complete is not None:
            self.on_complete(rid, self.outputs[rid])
        if self._next_turn is not None:
            self._submit_next_turn(live)
        if self._progress is not None:
            self._progress("serve", len(self.outputs), len(self._requests))

    def _submit_next_turn(self, live: _Live) -> None:
        """Submit the next turn of ``live``'s conversation, if it has one and it fits."""
        next_turn = self._next_turn
        nxt = None if next_turn is None else next_turn(live.req, live.generated, self.step_no)
        if nxt is None:
            return
        prev = self.clock.switch(SUBMISSION)
        try:
            self._submit(nxt)
            self.counters.follow_up_turns += 1
        except UnservableRequest:  # the conversation outgrew the pool or logical_pages
            self.counters.conversations_cut += 1
        finally:
            self.clock.switch(prev)

    def _drain_events(self) -> None:
        """Count the KV events of the step by kind (a router would forward them)."""
        s, buf, c = self.scheduler, self._events, self.counters
        while True:
            n = self._call(s.drain_events, buf)
            if not n:
                return
            kinds = np.bincount(buf["kind"][:n], minlength=4)
            c.kv_events_stored += int(kinds[1])
            c.kv_events_removed += int(kinds[2])
            c.kv_events_cleared += int(kinds[3])

    # -- end state, check, stats --------------------------------------------------------------

    def store_pages(self) -> List[int]:
        """Every page the prefix store holds (once per entry occurrence)."""
        st = self.scheduler.prefixes
        return [p for ident in st.identities() for p in st.pages_of(ident)]

    def verify_end_state(self) -> None:
        """Raise ``RuntimeError`` unless every submitted request completed exactly once and
        the pool holds nothing but the prefix store's pages."""
        verify_end_state(self.scheduler, self._requests, self._completions, self.pending)

    def check(self, on_checked: Optional[Callable[[int], None]] = None) -> CheckResult:
        """Compare every completed request's tokens with the dense model (model backend) or
        the pure-Python hash rule (decode-only backend); see :mod:`qualia.check`.  Charged to
        the check row; the result is also kept in ``last_check``.  ``on_checked(request_id)``
        is called after each request."""
        if self.is_model and self.weights is None:
            raise ValueError("check needs the model backend's weights")
        token = self.clock.enter(CHECK)
        try:
            self.last_check = check_outputs(
                self._requests, self.outputs, weights=self.weights if self.is_model else None,
                end_token=self.end_token, vocab=self.vocab or 32000, on_checked=on_checked)
        finally:
            self.clock.leave(token)
        return self.last_check

    def pages_copied(self) -> int:
        """Copy-on-write page copies handed to the backend (prefill and decode), as counted by
        the facade."""
        return int(self.scheduler.stats()["pages_copied"])

    def stats(self) -> Dict[str, object]:
        """The run's figures and where its time went (:func:`qualia.report.collect_stats`)."""
        return collect_stats(self)
