"""The serving loop: a continuous-batching engine on the scheduler's engine step.

This is what ``python -m qualia simulate`` runs.  :class:`Engine` serves requests
(:class:`qualia.sim.workload.Request`, from a :class:`~qualia.sim.workload.Workload` or a
:class:`~qualia.sim.trace.Trace`) on the step API of one scheduler.  The scheduler decides
everything about a step (admission by priority then arrival, token budget, chunked prefill,
prefix-cache hits, reclaim, preemption, stop conditions); the engine only keeps the policy glue
around it and the books:

    add_request for the arrivals due  ->  plan = schedule()  ->  sampled = execute_step(plan)
    ->  finished = update(sampled)  ->  record the finished requests (and submit the next turn
    of their conversation)

The scheduler and its options are an :class:`~qualia.sim.config.EngineConfig` (the compiled
core's by default, or its pure-Python twin: ``scheduler="twin"``); the backend's
``execute_step(plan)`` returns one sampled token id per sampled row of the plan, through the
adapters of :mod:`qualia.sim.adapters` for a model or a decode rule; the figures are kept by
:class:`~qualia.sim.books.Books`.  With a model the generated tokens can be checked against
the dense model, with a decode rule against the pure-Python hash rule (:mod:`qualia.sim.check`).

Time: the serving clock starts at 0 s and advances after every step by the step's time on the
engine's clock (:func:`qualia.sim.clock.serving_clock`): by default the modeled time of the
plan on a GPU profile (:class:`~qualia.sim.clock.ModeledClock`, deterministic), or a fixed time
per step, or the step's measured time on this machine.  It jumps over idle gaps.  A request is
due once the serving clock reaches its ``arrival_s`` (a workload's and a trace's requests) and
the engine its ``arrival_step``; due requests wait in the engine while the scheduler's queue is
full (``max_queued``).  Every sampled token is delivered at the end of the step that sampled
it: a completed request's :class:`~qualia.sim.figures.RequestRecord` (its arrival, its tokens'
times, its token counts) gives vLLM's serving figures (:meth:`Engine.figures`).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from array import array
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional

import numpy as np

from .._core import KV_EVENT
from .._types import FinishedRequest
from ..errors import StepError
from .adapters import is_model, step_backend
from .books import Books, TokenTimes
from .check import CheckResult, check_groups, check_outputs, progress_reporter, verify_end_state
from .clock import MIN_STEP_S, FixedClock, ModeledClock, serving_clock
from .config import EngineConfig, make_step_scheduler
from .figures import RequestRecord, serving_figures
from .report import Counters, EngineResult, GroupOutput, Timeline, backend_label, collect_stats
from .resources import memory_estimate
from .timing import (
    BACKEND,
    CHECK,
    ENGINE,
    SCHEDULER,
    SETUP,
    SUBMISSION,
    WORKLOAD,
    Stopwatch,
    TimedBackend,
    is_c_backend,
)
from .trace import Trace
from .workload import (
    Arrivals,
    Request,
    UnservableRequest,
    Workload,
    checked_request,
    pages_needed,
    unservable_reason,
)

__all__ = [
    "Engine",
    "Counters",
    "Timeline",
    "UnservableRequest",
    "pages_needed",
    "EngineConfig",
    "GroupOutput",
    # re-exported: the engine's input and output types, and the memory estimate
    "memory_estimate",
    "Request",
    "Workload",
    "Trace",
    "EngineResult",
    "CheckResult",
    "TimedBackend",
    "RequestRecord",
]

_now = time.perf_counter


# --------------------------------------------------------------------------------------------
# the engine
# --------------------------------------------------------------------------------------------


class _Live:
    """Engine-side record of one request (of one group: ``n > 1`` or beam search): when it
    arrived, got its first token, finished; ``outputs`` is its answer (a group's first member or
    best hypothesis), ``longest`` the most tokens one of its sequences generated."""

    __slots__ = ("req", "arrival_step", "arrival_t", "first_step", "first_t", "end_step",
                 "end_t", "outputs", "longest")

    def __init__(self, req: Request) -> None:
        self.req = req
        self.arrival_step = -1
        self.arrival_t = 0.0
        self.first_step = -1
        self.first_t = 0.0
        self.end_step = -1
        self.end_t = 0.0
        self.outputs: List[int] = []
        self.longest = 0


class Engine:
    """Serve requests on the engine step of one scheduler (see the module docstring).

    ``backend``: ``"model"`` (a :class:`~qualia.model.PagedModelBackend` over
    ``ModelWeights.random(model_config)``), ``"c"`` (``qualia.HashBackend(vocab_size)``), or a
    backend object (one with ``execute_step``, a model with ``prefill``, or a decode-rule
    backend).  A Python backend's time is charged to the backend row of the stopwatch.

    The scheduler: ``config`` (an :class:`~qualia.sim.config.EngineConfig`), or its fields as
    keywords (``num_pages``, ``page_tokens``, ``logical_pages``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``max_prefill_chunk``, ``max_queued``, ``eos_token_id``,
    ``prefix_caching``, ``n``, ``beam_width``, ``vocab_size``, ``scheduler``), which replace
    the config's.  ``vocab_size``: the decode rule's vocabulary (None: the backend's, or
    32000); a model's is its own.

    Forks (docs/DESIGN.md, "Forks in the engine"): ``n > 1`` adds every request with
    ``add_request(..., n=n)`` (one prefill, ``n`` sampled sequences sharing the prompt's pages
    copy-on-write), ``beam_width=w`` with ``add_request(..., beam_width=w)`` (beam search, model
    backend only).  A finished group's sequences are all in :attr:`groups`;
    ``outputs[request_id]`` is its first member (``n``) or best hypothesis (beam).
    ``sampling`` (a :class:`qualia.model.SamplingParams`; model backend only; default greedy)
    draws each token keyed by ``(seed, member id, position)``: the members of an ``n`` group
    differ only with a temperature > 0.

    ``clock``: the serving clock (:func:`qualia.sim.clock.serving_clock`): None, the modeled
    time of each plan on the default profile (``llama3.1-8b-h100``); a profile name or
    :class:`~qualia.sim.clock.Profile`, the modeled time on it; ``"measured"``, each step's
    measured time on this machine; or a clock object.  ``step_seconds`` (not with ``clock``):
    a fixed time per step.  ``stopwatch`` is the :class:`~qualia.sim.timing.Stopwatch` the
    engine charges its own wall time to (the CLI passes one started before anything else); by
    default the engine makes one that counts only while an engine method runs.
    ``on_complete(request_id, tokens)`` is called whenever a request completes.

    Records (:attr:`records`, one :class:`~qualia.sim.figures.RequestRecord` per completed
    request): its arrival, the time of each output token (the end of the step that sampled it)
    and its token counts.  A group (``n > 1``) is one request whose output tokens are all its
    members' tokens, each at the end of the step that sampled it (what a client streaming
    every sequence of the request receives); a beam search is one request whose output tokens
    are its longest hypothesis's, from its first token to the end of the search, without
    per-token times (its hypotheses are chosen at the end)."""

    def __init__(self, backend="model", config: Optional[EngineConfig] = None, *,
                 model_config=None, sampling=None, clock: Any = None,
                 step_seconds: Optional[float] = None, stopwatch: Optional[Stopwatch] = None,
                 on_complete: Optional[Callable[[int, List[int]], None]] = None,
                 **options: Any) -> None:
        self._owns_stopwatch = stopwatch is None
        self.stopwatch = stopwatch if stopwatch is not None else Stopwatch(SETUP)
        token = self.stopwatch.enter(SETUP)
        config = dataclasses.replace(config or EngineConfig(), **options).checked()
        if step_seconds is not None:
            if clock is not None:
                raise ValueError("give clock or step_seconds, not both")
            if isinstance(step_seconds, bool) or not isinstance(step_seconds, (int, float)) \
                    or not MIN_STEP_S <= float(step_seconds) < float("inf"):
                raise ValueError(f"step_seconds must be a finite number >= {MIN_STEP_S:.6f} "
                                 f"(a microsecond: the serving clock must move), "
                                 f"got {step_seconds!r}")
            clock = float(step_seconds)
        #: the serving clock: how far each step moves the time requests are served at
        self.clock = serving_clock(clock)
        backend = self._backend(backend, config, model_config, sampling)
        self.config = config = dataclasses.replace(config, vocab_size=self.vocab)
        self.backend = TimedBackend(step_backend(
            backend, vocab=self.vocab or 32000, beams=config.beam_width is not None,
            batched=config.forking or not self.sampling.greedy), self.stopwatch)
        # the loop calls the wrapped backend itself (unless execute_step was replaced on the
        # wrapper: _serve), times the call and tells the wrapper (_settle)
        self._timed_step = self.backend.execute_step
        self.scheduler = make_step_scheduler(config)
        s = self.scheduler
        # the facade under the step API: the scheduler itself (core) or the twin's facade
        self.facade = getattr(s, "facade", s)
        self.implementation = "twin" if s is not self.facade else "core"
        self.caching = self.facade.prefix_caching
        # the KV events drained each step, counted by kind when the buffer fills and when the
        # engine settles its books (_settle)
        self._events = np.zeros(self.EVENT_BUFFER, dtype=KV_EVENT)
        self._events_at = 0
        self._events_free = self._events[:]
        # the free end of the buffer past each count of events, made once each
        self._free_views: List[Any] = [None] * self.EVENT_BUFFER
        self.on_complete = on_complete
        self._progress: Optional[Callable[[str, int, int], None]] = None
        self._drains = self.caching == "auto"

        self.step_no = 0
        self.now = 0.0  # the serving clock, seconds
        self._empty_plans = 0  # consecutive plans that scheduled nothing
        self.books = Books(config.num_pages, config.page_tokens, config.n,
                           forking=config.forking)
        self.counters, self.timeline = self.books.counters, self.books.timeline
        # whether the clock reads a step's measured time (the known clocks that do not are
        # handed 0.0)
        self._measures = not isinstance(self.clock, (ModeledClock, FixedClock))
        # the modeled clock's O(1) cost of a decode step, from the sum of its seq_lens the
        # books keep (without forks: Books.context)
        self._work_seconds = (self.clock.work_seconds
                                if isinstance(self.clock, ModeledClock)
                                and type(self.clock).step_time is ModeledClock.step_time
                                else None)
        self._c = self.books.counters.__dict__  # written in place (see Books)
        self._requests: Dict[int, Request] = {}
        self._live: Dict[int, _Live] = {}
        self._arrivals = Arrivals()  # not yet due
        # the step and the serving time from which an arrival is due (Arrivals.horizon)
        self._due_step, self._due_t = self._arrivals.horizon()
        self._backlog: Deque[_Live] = collections.deque()  # due, waiting for queue room
        self._completions: Dict[int, int] = {}
        self.outputs: Dict[int, List[int]] = {}
        self.finish_reasons: Dict[int, str] = {}
        #: every sequence of each finished group (n > 1 or beam search), by request id
        self.groups: Dict[int, GroupOutput] = {}
        # a multi-turn Workload's next_turn(request, answer, step), set by submit_all
        self._next_turn: Optional[Callable[..., Optional[Request]]] = None
        # per step with work: seconds in the scheduler calls and in the backend
        self.step_sched_s = array("d")
        self.step_backend_s = array("d")
        self._sched_append, self._backend_append = (self.step_sched_s.append,
                                                    self.step_backend_s.append)
        self._num_pages, self._page_tokens = config.num_pages, config.page_tokens
        #: the serving clock's seconds of the steps with work (idle gaps are not steps)
        self.busy_s = 0.0
        #: sequence-seconds: each step's time times the sequences it computed
        self.sequence_s = 0.0
        # every sampled token's delivery time (none for beam search)
        self._token_times = TokenTimes()
        self._log = self._token_times.log if config.beam_width is None else None
        # completed requests whose records are still to be made from the token times: (their
        # live record, the ids their tokens were sampled under, their output tokens, the
        # steps logged when they completed)
        self._unrecorded: List[tuple] = []
        self._records: Dict[int, RequestRecord] = {}
        # steps whose scheduler and backend times the stopwatch's rows and the TimedBackend
        # were charged (_settle)
        self._charged = 0
        self.last_check: Optional[CheckResult] = None
        if self._owns_stopwatch:
            self.stopwatch.stop()  # an engine-owned stopwatch counts only inside engine methods
        else:
            self.stopwatch.leave(token)

    def _backend(self, backend, config: EngineConfig, model_config, sampling):
        """The backend object (built for ``"model"`` and ``"c"``), with what the engine reads
        of it: its weights, its vocabulary and how it samples."""
        from ..model import GREEDY, SamplingParams

        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a qualia.model.SamplingParams, not "
                            f"{type(sampling).__name__}")
        self.weights = None
        if backend == "model" and isinstance(backend, str):
            from ..model import ModelConfig, ModelWeights, PagedModelBackend

            self.weights = ModelWeights.random(model_config or ModelConfig())
            backend = PagedModelBackend(self.weights, config.num_pages, config.page_tokens,
                                        sampling=GREEDY if sampling is None else sampling)
        elif backend == "c" and isinstance(backend, str):
            import qualia

            backend = qualia.HashBackend(vocab=config.vocab_size or 32000)
        elif isinstance(backend, str):
            raise ValueError(f"backend must be 'model', 'c' or a backend object, not "
                             f"{backend!r}")
        self.raw_backend = backend
        self.is_model = is_model(backend)
        self.is_c_backend = is_c_backend(backend)
        self.backend_label = backend_label(backend, self.is_model, self.is_c_backend)
        if self.is_model:
            self.weights = getattr(backend, "weights", self.weights)
            bt = getattr(backend, "page_tokens", config.page_tokens)
            bn = getattr(backend, "num_pages", getattr(backend, "num_pages", config.num_pages))
            if bt != config.page_tokens or bn < config.num_pages:
                raise ValueError(
                    f"the model backend has {bn} pages of {bt} tokens; the scheduler needs "
                    f"{config.num_pages} pages of {config.page_tokens} tokens")
            own_vocab = getattr(getattr(backend, "config", None), "vocab", 0)
            #: the vocabulary of the sampled ids (None: not known)
            self.vocab: Optional[int] = int(own_vocab or 0) or config.vocab_size
            self._prompt_vocab = self.vocab
        else:  # the decode rule's vocabulary; any u32 prompt token id is fine
            vocab: Any = config.vocab_size or getattr(backend, "vocab", 32000)
            self.vocab = int(vocab)
            self._prompt_vocab = None
        own = getattr(backend, "sampling", None) if self.is_model else None
        if sampling is not None and not sampling.greedy and not self.is_model:
            raise ValueError("sampling needs the model backend (a decode rule has no "
                             "logits to sample)")
        if sampling is not None and own is not None and own != sampling:
            raise ValueError(f"sampling={sampling} differs from the model backend's own "
                             f"sampling={own}: set it on one of them")
        #: how the model backend picks tokens (greedy for a decode rule)
        self.sampling = sampling if sampling is not None else (
            own if isinstance(own, SamplingParams) else GREEDY)
        if config.beam_width is not None and not self.is_model:
            raise ValueError("beam search needs the model backend: it ranks candidates by the "
                             "model's log-probabilities, which a decode rule does not have")
        return backend

    @property
    def n(self) -> int:
        """Sequences per request (``n > 1``: parallel sampling on forks)."""
        return self.config.n

    @property
    def beam_width(self) -> Optional[int]:
        """The beam width of every request, or None (no beam search)."""
        return self.config.beam_width

    @property
    def forking(self) -> bool:
        """Requests are added as groups (``n > 1`` or beam search)."""
        return self.config.forking

    @property
    def page_tokens(self) -> int:
        """Token positions per page of the engine's scheduler."""
        return self.config.page_tokens

    @property
    def eos_token_id(self) -> Optional[int]:
        """The end-of-sequence token every request stops at, or None."""
        return self.config.eos_token_id

    # -- properties ---------------------------------------------------------------------------

    @property
    def records(self) -> Dict[int, RequestRecord]:
        """One :class:`~qualia.sim.figures.RequestRecord` per completed request, by request id
        (in completion order)."""
        self._make_records()
        return self._records

    @property
    def pending(self) -> int:
        """Requests submitted and not yet completed."""
        return len(self._live)

    @property
    def wall_s(self) -> float:
        """Seconds on the engine's stopwatch so far (the sum of its rows)."""
        return self.stopwatch.wall_s

    def _call(self, fn, *args, **kwargs):
        """A scheduler call, charged to the scheduler row."""
        watch = self.stopwatch
        prev = watch.switch(SCHEDULER)
        try:
            return fn(*args, **kwargs)
        finally:
            watch.switch(prev)

    # -- submission ---------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queue a request for its arrival.  Raises :class:`UnservableRequest` (a
        ``ValueError``) for a request that needs more pages than the whole pool or more tokens
        than a request's table holds (``logical_pages * page_tokens``) or that arrives after
        :data:`~qualia.sim.workload.MAX_ARRIVAL_S` (1e9 s), ``TypeError`` for a field of the
        wrong type (a prompt that is not a 1-D sequence of integers) and ``ValueError`` for an
        empty prompt, no tokens to generate, bad token ids, a negative or non-finite arrival or
        a duplicate request id
        (:func:`~qualia.sim.workload.checked_request`)."""
        token = self.stopwatch.enter(SUBMISSION)
        try:
            self._submit(request)
        finally:
            self.stopwatch.leave(token)

    def submit_all(self, requests: Iterable[Request]) -> int:
        """Submit every request of ``requests`` (a :class:`~qualia.sim.workload.Workload` or
        :class:`~qualia.sim.trace.Trace` is generated first, charged to the workload row);
        returns how many were submitted.  All or nothing: every request is checked as
        :meth:`submit` checks it (a request id used twice in ``requests`` is a duplicate too)
        before any is queued, so a call that raises leaves :attr:`pending` as it was."""
        token = self.stopwatch.enter(WORKLOAD)
        try:
            next_turn = None
            if isinstance(requests, Workload):
                if requests.turns > 1:
                    next_turn = requests.next_turn
                requests = requests.generate()
            elif isinstance(requests, Trace):
                requests = requests.generate()
            self.stopwatch.switch(SUBMISSION)
            checked: List[Request] = []
            ids: set = set()
            for req in requests:
                req = self._checked(req)
                if req.request_id in ids:
                    raise ValueError(f"request {req.request_id}: duplicate request id")
                ids.add(req.request_id)
                checked.append(req)
            if next_turn is not None:
                self._next_turn = next_turn
            for req in checked:
                self._enqueue(req)
        finally:
            self.stopwatch.leave(token)
        return len(checked)

    def _checked(self, request: Request) -> Request:
        """``request`` checked for this engine (:func:`checked_request`, the beams' pages and
        the ids already submitted)."""
        c = self.config
        request = checked_request(request, page_tokens=c.page_tokens, num_pages=c.num_pages,
                                  logical_pages=c.logical_pages, vocab=self._prompt_vocab)
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id}: duplicate request id")
        if c.beam_width is not None:
            def why_not(options: bool) -> Optional[str]:
                return unservable_reason(
                    f"request {request.request_id}", len(request.prompt),
                    request.max_new_tokens, page_tokens=c.page_tokens, num_pages=c.num_pages,
                    logical_pages=c.logical_pages, beam_width=c.beam_width, options=options)

            why = why_not(False)
            if why is not None:
                raise UnservableRequest(why, why_not(True))
        return request

    def _submit(self, request: Request) -> None:
        self._enqueue(self._checked(request))

    def _enqueue(self, request: Request) -> None:
        """Queue a checked request for its arrival."""
        rid = request.request_id
        self._requests[rid] = request
        live = _Live(request)
        self._live[rid] = live
        self._arrivals.push(request, live)
        self._due_step, self._due_t = self._arrivals.horizon()

    # -- the loop -----------------------------------------------------------------------------

    def run(self, requests: Iterable[Request] = (), *, check: bool = False,
            progress: Optional[Callable[[str, int, int], None]] = None) -> EngineResult:
        """Submit ``requests``, serve everything submitted to completion, verify the end state
        (every request completed exactly once, nothing queued or running, every page free or
        cached), run the check if ``check``, and report.

        ``progress(phase, done, total)`` is called with phase ``"serve"`` as requests complete
        and ``"check"`` as they are checked (first with ``done == 0``)."""
        self.submit_all(requests)
        token = self.stopwatch.enter(ENGINE)
        self._progress = progress
        try:
            self._serve(None)
            self.verify_end_state()
        finally:
            self._settle()
            self._progress = None
            self.stopwatch.leave(token)
        checked = None
        if check:
            checked = self.check(None if progress is None
                                 else progress_reporter(progress, len(self.outputs)))
            self.last_check = checked
        return EngineResult(self.stats(), dict(self.outputs), checked, self.timeline,
                            dict(self.groups), self.figures(), dict(self.records))

    def step(self) -> None:
        """One engine step: the arrivals due, then schedule, execute and update."""
        token = self.stopwatch.enter(ENGINE)
        try:
            self._serve(1)
        finally:
            self._settle()
            self.stopwatch.leave(token)

    def _take_arrivals(self) -> None:
        """Move the arrivals due to the scheduler (the engine's backlog while its queue is
        full)."""
        backlog = self._backlog
        for live in self._arrivals.due(self.step_no, self.now):
            live.arrival_step = self.step_no
            r = live.req
            live.arrival_t = self.now if r.arrival_s is None else float(r.arrival_s)
            backlog.append(live)
        self._due_step, self._due_t = self._arrivals.horizon()
        s = self.scheduler
        config = self.config
        room = config.queue_limit - s.num_waiting - s.num_running
        group, eos, n = config.group_keywords(), config.eos_token_id, config.n
        add, secs = s.add_request, self.stopwatch.seconds
        while backlog and room > 0:
            live = backlog.popleft()
            r = live.req
            t = _now()  # the call is charged to the scheduler row
            try:
                add(r.request_id, r.prompt, max_new_tokens=r.max_new_tokens,
                    namespace=r.namespace, eos_token_id=eos, **group)
            except StepError.QueueFull:
                # a group takes n entries, its stopped members' too, until its result is
                # returned: the queue is fuller than num_waiting + num_running say
                if not config.forking:
                    raise
                backlog.appendleft(live)
                return
            finally:
                t = _now() - t
                secs[SCHEDULER] += t
                secs[ENGINE] -= t
            room -= n

    def _skip_idle(self) -> None:
        """Nothing queued or running: jump the step counter or the serving clock to the next
        arrival."""
        step, now = self._arrivals.next_event(self.step_no, self.now)
        self.counters.idle_steps += step - self.step_no
        self.counters.idle_s += now - self.now
        self.step_no, self.now = step, now

    def _serve(self, limit: Optional[int]) -> None:
        """Run ``limit`` engine steps (None: until no request is pending).  A step: the
        arrivals due, then schedule, execute and update, then the books.  What the loop calls
        is looked up once: the scheduler, the backend's ``execute_step`` (the wrapped
        backend's, or the wrapper's where it was replaced), the books, the clock."""
        s, f, live = self.scheduler, self.facade, self._live
        execute = self.backend.execute_step
        if execute is self._timed_step:
            execute = self.backend.inner.execute_step
        books = self.books
        book, t_append = books.book, books.timeline.t.append
        copy_holds = books.copy_holds if books.forking else None
        log, again = self._log, self._token_times.again  # log None: no token times
        work_seconds, step_time = self._work_seconds, self.clock.step_time
        sched_append, backend_append = self._sched_append, self._backend_append
        num_pages, page_tokens, measures = self._num_pages, self._page_tokens, self._measures
        drains, free_views, buffer_size = self._drains, self._free_views, self.EVENT_BUFFER
        done = 0
        # the last step's update finished nothing while a request ran (so the scheduler has
        # one unfinished), and its plan computed no prefill token
        running_on = decoding = False
        # the serving clock's busy seconds and sequence-seconds, kept here and written back
        busy, sequence = self.busy_s, self.sequence_s
        try:
            while (live if limit is None else done < limit):
                done += 1
                t0 = _now() if measures else 0.0
                arrived = self._backlog or self.step_no >= self._due_step \
                    or self.now >= self._due_t
                if arrived:
                    self._take_arrivals()
                if not running_on and not s.has_unfinished():
                    if self._arrivals:
                        self._skip_idle()
                    continue
                # the scheduler's and the backend's calls, timed here; the stopwatch's rows are
                # charged with them when the engine settles its books (_settle)
                tb = tc = None
                ta = _now()
                try:
                    plan = s.schedule()
                    held = num_pages - f.free_pages  # the step's pages are held
                    running = s.num_running
                    if (copy_holds is not None and len(plan.preempted_request_ids)
                            and len(plan.copies)):
                        held -= copy_holds(s, plan)  # held by a copy owed, not a request
                    tb = _now()
                    try:
                        sampled = execute(plan)
                    except BaseException:
                        tc = _now()
                        discard = getattr(s, "discard_plan", None)
                        if callable(discard):
                            discard()
                        raise
                    tc = _now()
                    if isinstance(sampled, tuple):  # beam rows: (ids, topk_ids, topk_logprobs)
                        finished = s.update(*sampled)
                    else:
                        finished = s.update(sampled)
                    drained = f.drain_events(self._events_free) if drains else 0
                except BaseException:
                    td = _now()
                    if tb is None:
                        sched, waited = td - ta, 0.0
                    elif tc is None:
                        sched, waited = tb - ta, td - tb
                    else:
                        sched, waited = (tb - ta) + (td - tc), tc - tb
                    secs = self.stopwatch.seconds
                    secs[SCHEDULER] += sched
                    secs[BACKEND] += waited
                    secs[ENGINE] -= sched + waited
                    raise
                td = _now()
                sched_append((tb - ta) + (td - tc))
                backend_append(tc - tb)
                if drained:  # the next drain writes past these events (_drained)
                    at = self._events_at + drained
                    if at < buffer_size:
                        self._events_at = at
                        free = free_views[at]
                        if free is None:
                            free = free_views[at] = self._events[at:]
                        self._events_free = free
                    else:
                        self._drained(drained)
                step = self.step_no
                firsts = book(plan, held, running, live, step, s, f, len(self._backlog),
                              not (arrived or finished))
                seqs = len(plan.request_ids)
                context = books.context
                if work_seconds is None or context is None:
                    dt = float(step_time(plan, _now() - t0))
                elif books.steady:  # a decode step, its attention pairs its context, no copy
                    dt = work_seconds(seqs, context, context, seqs)
                elif seqs and not plan.num_prefill_tokens and plan.num_decode_tokens == seqs:
                    dt = work_seconds(seqs, context, context, len(plan.logits_indices),
                                      len(plan.copies), page_tokens)
                else:
                    dt = float(step_time(plan, _now() - t0))
                busy += dt
                sequence += dt * seqs
                self.now = now = self.now + dt
                t_append(now)
                steady = books.steady
                if log is not None:  # every sampled token is delivered at the step's end
                    if steady and decoding:  # a decode step after one: the same sampled ids
                        again(now)
                    else:
                        log(plan.sampled_request_ids, now)
                decoding = steady or not plan.num_prefill_tokens
                running_on = running and not finished
                if not seqs:
                    self._check_progress(plan)
                elif self._empty_plans:
                    self._empty_plans = 0
                for lv in firsts:
                    lv.first_t = now
                self.step_no = step + 1
                for fin in finished:
                    self._complete(fin)
        finally:
            self.busy_s, self.sequence_s = busy, sequence

    #: Consecutive empty plans after which the engine gives up (an empty plan happens when the
    #: only running request preempts itself for pages; the next step admits it again).
    MAX_EMPTY_PLANS = 64
    #: KV events the engine drains into before it counts them.
    EVENT_BUFFER = 4096

    def _settle(self) -> None:
        """Bring the figures kept for many steps at once up to date: the books' (settle), the
        steps counted, the KV events' counts, the scheduler's and the backend's times on the
        stopwatch's rows and the backend's on its wrapper."""
        self.books.settle()
        self._count_events()
        done = len(self.step_sched_s)
        self._c["steps"] = done
        at = self._charged
        if done > at:
            sched = sum(self.step_sched_s[at:])
            waited = sum(self.step_backend_s[at:])
            secs = self.stopwatch.seconds
            secs[SCHEDULER] += sched
            secs[BACKEND] += waited
            secs[ENGINE] -= sched + waited
            charge = getattr(self.backend, "charge", None)
            if callable(charge):
                charge("execute_step", waited, done - at)
            self._charged = done

    def _check_progress(self, plan) -> None:
        if len(plan.request_ids):
            self._empty_plans = 0
            return
        self._empty_plans += 1
        if self._empty_plans > self.MAX_EMPTY_PLANS:
            s = self.scheduler
            raise RuntimeError(
                f"engine stuck: {self._empty_plans} steps in a row scheduled nothing with "
                f"{s.num_waiting} waiting and {s.num_running} running requests")

    def _complete(self, fin) -> None:
        rid = int(fin.request_id)
        lv = self._live.pop(rid)
        c = self._c
        if type(fin) is not FinishedRequest and hasattr(fin, "outputs"):
            # a FinishedGroup: n members, or beam hypotheses
            outs = [np.asarray(o).tolist() for o in fin.outputs]
            reasons = [str(x) for x in fin.finish_reasons]
            self.groups[rid] = GroupOutput(
                "n" if self.beam_width is None else "beam", outs, reasons,
                [int(m) for m in fin.member_ids],
                None if fin.scores is None else [float(x) for x in fin.scores])
            lv.outputs = outs[0]
            lv.longest = max(len(o) for o in outs)
            generated = sum(len(o) for o in outs)
            stopped = reasons.count("stop")
            reason = reasons[0]
            members = [int(m) for m in fin.member_ids]
        else:
            lv.outputs = np.asarray(fin.output_tokens).tolist()
            lv.longest = generated = len(lv.outputs)
            reason = str(fin.finish_reason)
            stopped = reason == "stop"
            outs, members = [lv.outputs], [rid]
        lv.end_step, lv.end_t = self.step_no - 1, self.now
        if self.beam_width is not None:  # its longest hypothesis, without token times
            tokens = lv.longest
            self._records[rid] = RequestRecord(rid, lv.arrival_t, lv.first_t, lv.end_t,
                                               len(lv.req.prompt), tokens)
        else:  # made from the token log (_make_records)
            tokens = generated
            self._unrecorded.append((lv, members, tokens, len(self._token_times)))
        self._completions[rid] = self._completions.get(rid, 0) + 1
        self.outputs[rid] = lv.outputs
        self.finish_reasons[rid] = reason
        self.timeline.finish(lv, tokens)
        c["completed"] += 1
        c["sequences_completed"] += len(outs)
        c["tokens_generated"] += generated
        c["finished_stop"] += stopped
        c["finished_length"] += len(outs) - stopped
        if self.on_complete is not None:
            self.on_complete(rid, lv.outputs)
        if self._next_turn is not None:
            self._submit_next_turn(lv)
        if self._progress is not None:
            self._progress("serve", len(self.outputs), len(self._requests))

    def _make_records(self) -> None:
        """The records of the requests completed since the last call, in completion order:
        each one's token times are those sampled under its ids (its members', for a group)
        up to its completion (:class:`~qualia.sim.books.TokenTimes`)."""
        todo = self._unrecorded
        if not todo:
            return
        self._unrecorded = []
        taken = self._token_times.take_all([(members, before)
                                            for _, members, _, before in todo])
        for (lv, _, tokens, _), times in zip(todo, taken):
            rid = int(lv.req.request_id)
            if len(times) != tokens:
                raise RuntimeError(f"request {rid}: {len(times)} tokens sampled for {tokens} "
                                   f"output tokens")
            self._records[rid] = RequestRecord._from_engine(rid, lv.arrival_t,
                                                         len(lv.req.prompt), times)

    def _submit_next_turn(self, live: _Live) -> None:
        """Submit the next turn of ``live``'s conversation, if it has one and it fits."""
        next_turn = self._next_turn
        nxt = None if next_turn is None else next_turn(live.req, live.outputs, self.step_no - 1,
                                                       self.now)
        if nxt is None:
            return
        prev = self.stopwatch.switch(SUBMISSION)
        try:
            self._submit(nxt)
            self.counters.follow_up_turns += 1
        except UnservableRequest:  # it outgrew the pool or logical_pages, or arrives too late
            self.counters.conversations_cut += 1
        finally:
            self.stopwatch.switch(prev)

    def _drained(self, n: int) -> None:
        """``n`` KV events were drained into the free end of the event buffer: move past them,
        and while they filled it (the ring may hold more), count the buffer and drain on."""
        buf = self._events
        while True:
            room = len(buf) - self._events_at
            self._events_at += n
            if n < room:  # the ring is empty
                break
            self._count_events()
            n = self._call(self.facade.drain_events, buf)
        self._events_free = buf[self._events_at:]

    def _count_events(self) -> None:
        """Count the KV events in the buffer by kind (a router would forward them) and empty
        it."""
        n = self._events_at
        if not n:
            return
        kinds = np.bincount(self._events["kind"][:n], minlength=4)
        c = self._c
        c["kv_events_stored"] += int(kinds[1])
        c["kv_events_removed"] += int(kinds[2])
        c["kv_events_cleared"] += int(kinds[3])
        self._events_at = 0
        self._events_free = self._events[:]

    # -- end state, check, stats --------------------------------------------------------------

    def verify_end_state(self) -> None:
        """Raise ``RuntimeError`` unless every submitted request completed exactly once,
        nothing is queued or running, and every page is free or only cached."""
        if self.scheduler.has_unfinished():
            raise RuntimeError(
                f"engine end state is wrong: {self.scheduler.num_waiting} waiting and "
                f"{self.scheduler.num_running} running requests left in the scheduler")
        verify_end_state(self.facade, self._requests, self._completions,
                         self.pending + len(self._backlog))

    def check(self, on_checked: Optional[Callable[[int], None]] = None) -> CheckResult:
        """Compare every completed request's tokens with the dense model (model backend, with
        the engine's sampler) or the pure-Python hash rule (decode-rule backend); a group's
        every member with its own reference run, a beam group with the dense beam search of
        the same width; see :mod:`qualia.sim.check`.  Charged to
        the check row; the result is also kept in ``last_check``.  ``on_checked(request_id)``
        is called after each request."""
        if self.is_model and self.weights is None:
            raise ValueError("check needs the model backend's weights")
        token = self.stopwatch.enter(CHECK)
        try:
            weights = self.weights if self.is_model else None
            sampling = None if self.sampling.greedy else self.sampling
            if self.forking:
                self.last_check = check_groups(
                    self._requests, self.groups, weights=weights, eos_token_id=self.eos_token_id,
                    vocab=self.vocab or 32000, on_checked=on_checked, sampling=sampling,
                    beam_width=self.beam_width, n=self.n)
            else:
                self.last_check = check_outputs(
                    self._requests, self.outputs, weights=weights, eos_token_id=self.eos_token_id,
                    vocab=self.vocab or 32000, on_checked=on_checked, sampling=sampling)
        finally:
            self.stopwatch.leave(token)
        return self.last_check

    def latencies(self) -> Dict[str, List[float]]:
        """Per completed request, in engine steps: time to first token, time per output token
        after the first (requests of more than one token) and end-to-end latency
        (``ttft_steps``, ``tpot_steps``, ``e2el_steps``; see
        :meth:`qualia.sim.report.Timeline.finish`).  In seconds: :attr:`records`."""
        return self.timeline.latencies()

    def figures(self, percentiles=(99,)) -> Dict[str, Any]:
        """vLLM's serving figures of the requests completed so far
        (:func:`qualia.sim.figures.serving_figures` of :attr:`records`, the run starting at 0 s
        on the serving clock)."""
        records = self.records
        return serving_figures([records[k] for k in sorted(records)], start_s=0.0,
                               percentiles=percentiles)

    def stats(self) -> Dict[str, object]:
        """The run's figures and where its time went (:func:`qualia.sim.report.collect_stats`)."""
        self._settle()
        return collect_stats(self)
