"""The serving loop: a continuous-batching engine on the scheduler's engine step.

This is what ``python -m qualia simulate`` runs.  :class:`Engine` serves requests
(:class:`qualia.workload.Request`, from a :class:`~qualia.workload.Workload` or a
:class:`~qualia.workload.Trace`) on the step API of one scheduler.  The scheduler decides
everything about a step (admission by priority then arrival, token budget, chunked prefill,
prefix-cache hits, reclaim, preemption, stop conditions); the engine only keeps the policy glue
around it and the books:

    add_request for the arrivals due  ->  plan = schedule()  ->  sampled = execute_step(plan)
    ->  finished = update(sampled)  ->  record the finished requests (and submit the next turn
    of their conversation)

The scheduler is ``qualia.StepScheduler`` when the compiled core has the step API, else its
pure-Python twin ``qualia.twin_step.StepScheduler`` (``implementation="auto"``); pass
``implementation="core"`` or ``"twin"``, or ``scheduler_factory``, to choose.

The backend's ``execute_step(plan)`` returns one sampled token id per sampled row of the plan.
Three kinds are accepted: an object with ``execute_step`` (used as it is); a *model* with the
per-sequence ``prefill(tokens, start_position, block_table)`` of
:class:`qualia.model.PagedModelBackend`, driven request by request over the plan (its K/V is
written where the plan's block table says; the copy-on-write copies go first); and a
decode-rule backend (the C ``qualia.HashBackend``, ``qualia.twin.PyHashBackend``), whose hash
rule gives each sampled row's token from the request id, the last token's position and the
token.  With a model the generated tokens can be checked against the dense model, with a
decode rule against the pure-Python hash rule (:mod:`qualia.check`).

Arrivals: a request is due once the engine reaches its ``arrival_step`` and, for a trace, once
the serving clock reaches its ``arrival_s``.  The serving clock is the measured time of the
steps (``step_seconds=None``) or a fixed cost per step (deterministic), and jumps over idle
gaps.  Due requests wait in the engine while the scheduler's queue is full (``max_queued``).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import operator
import time
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, Tuple

import numpy as np

from .check import CheckResult, check_groups, check_outputs, progress_reporter, verify_end_state
from .errors import StepError
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
from .workload import (
    Request,
    Trace,
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
    "make_scheduler_factory",
    "ModelSteps",
    "PlanModelSteps",
    "DecodeRuleSteps",
    "core_supports",
    "GroupOutput",
    # re-exported: the engine's input and output types, and the memory estimate
    "memory_estimate",
    "Request",
    "Workload",
    "Trace",
    "EngineResult",
    "CheckResult",
    "TimedBackend",
]

_now = time.perf_counter


# --------------------------------------------------------------------------------------------
# the scheduler
# --------------------------------------------------------------------------------------------


def core_has_step_api() -> bool:
    """True when the compiled core has the engine step (``qualia.StepScheduler``)."""
    import qualia

    return callable(getattr(getattr(qualia, "StepScheduler", None), "add_request", None))


_CORE_FORKS: Dict[str, bool] = {}


def core_supports(feature: str) -> bool:
    """Whether this build's compiled ``qualia.StepScheduler`` takes ``add_request(..., n=k)``
    (``feature="n"``) or ``add_request(..., beam_width=w)`` with the beam plan
    (``plan.num_topk``, ``update(ids, topk_ids, topk_logprobs)``; ``feature="beam"``).  Found
    once by adding a one-token request to a throwaway scheduler of a few pages."""
    if feature not in ("n", "beam"):
        raise ValueError(f"feature must be 'n' or 'beam', not {feature!r}")
    if feature not in _CORE_FORKS:
        _CORE_FORKS[feature] = _probe_core(feature)
    return _CORE_FORKS[feature]


def _probe_core(feature: str) -> bool:
    if not core_has_step_api():
        return False
    import qualia

    try:
        s: Any = qualia.StepScheduler(4, 4, 2, 2)
        kw = {"n": 2} if feature == "n" else {"beam_width": 2}
        s.add_request(0, [1, 2], max_new_tokens=1, **kw)
        if feature == "beam":
            plan = s.schedule()
            if int(getattr(plan, "num_topk", 0) or 0) != 2:
                return False
            s.discard_plan()
    except Exception:  # any refusal: this build does not take it
        return False
    return True


def make_scheduler_factory(implementation: str = "auto", *, n: int = 1,
                           beam_width: Optional[int] = None) -> Callable[..., Any]:
    """The class the engine builds its scheduler with: ``"core"`` (``qualia.StepScheduler``),
    ``"twin"`` (``qualia.twin_step.StepScheduler``, or ``qualia.twin_fork.ForkStepScheduler``
    for ``n > 1`` or ``beam_width``) or ``"auto"`` (the core when it has the step API and
    supports the forks asked for, else the twin)."""
    if implementation not in ("auto", "core", "twin"):
        raise ValueError(f"implementation must be 'auto', 'core' or 'twin', not "
                         f"{implementation!r}")
    feature = "beam" if beam_width is not None else "n" if n > 1 else None
    if implementation == "auto":
        ok = core_has_step_api() and (feature is None or core_supports(feature))
        implementation = "core" if ok else "twin"
    if implementation == "core":
        import qualia

        if not core_has_step_api():
            raise ValueError("implementation='core': this build's compiled core has no "
                             "engine step (qualia.StepScheduler)")
        if feature is not None and not core_supports(feature):
            what = "beam search (beam_width)" if feature == "beam" else "parallel sampling (n)"
            raise ValueError(f"implementation='core': this build's qualia.StepScheduler has no "
                             f"{what}; use implementation='auto' or 'twin' (the pure-Python "
                             f"qualia.twin_fork.ForkStepScheduler)")
        return qualia.StepScheduler
    if feature is not None:
        from .twin_fork import ForkStepScheduler

        return ForkStepScheduler
    from .twin_step import StepScheduler

    return StepScheduler


def _group_options(n, beam_width, max_seqs: int, max_queued: Optional[int]
                   ) -> Tuple[int, Optional[int]]:
    """``n`` and ``beam_width`` checked: ints, at least 1, at most ``max_seqs`` (a group's
    sequences run side by side), ``n`` at most ``max_queued`` (a group takes ``n`` queue
    entries), and not both."""
    sizes: Dict[str, Optional[int]] = {}
    for name, value in (("n", n), ("beam_width", beam_width)):
        if value is None and name == "beam_width":
            sizes[name] = None
            continue
        if isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} must be an int, not bool")
        try:  # anything with __index__ is an integer; an int subclass's comparisons never run
            v = int.__index__(operator.index(value))  # exact int: never a subclass's methods
        except TypeError:
            raise TypeError(f"{name} must be an int, not {type(value).__name__}") from None
        if not 1 <= v <= max_seqs:
            raise ValueError(f"{name} must be in [1, max_seqs={max_seqs}] (a group's sequences "
                             f"run side by side), got {v}")
        sizes[name] = v
    n, beam_width = sizes["n"], sizes["beam_width"]
    assert n is not None
    if beam_width is not None and n != 1:
        raise ValueError("n > 1 and beam_width exclude each other: beam search returns "
                         "beam_width hypotheses")
    if max_queued is not None and n > int(max_queued):
        raise ValueError(f"n={n} is more than max_queued={max_queued}: a group takes n queue "
                         f"entries")
    return n, beam_width


# --------------------------------------------------------------------------------------------
# backends over a plan
# --------------------------------------------------------------------------------------------


class ModelSteps:
    """``execute_step(plan)`` over a model with a per-sequence ``prefill(tokens,
    start_position, block_table) -> next token`` (:class:`qualia.model.PagedModelBackend`): the
    plan's copies first (``copy_pages``), then each request's chunk, through the pages of its
    context (``kv_indices``); the sampled rows get the model's greedy token."""

    def __init__(self, model) -> None:
        self.model = model
        self.steps = 0

    def execute_step(self, plan) -> np.ndarray:
        model = self.model
        if len(plan.copies):
            model.copy_pages(plan.copies)
        qsl = plan.query_start_loc.tolist()
        indptr = plan.kv_indptr.tolist()
        logits = set(plan.logits_indices.tolist())
        ids, pos, pages = plan.input_ids, plan.positions, plan.kv_indices
        out: List[int] = []
        for i in range(len(qsl) - 1):
            a, b = qsl[i], qsl[i + 1]
            token = model.prefill(ids[a:b], int(pos[a]), pages[indptr[i]:indptr[i + 1]])
            if b - 1 in logits:
                out.append(int(token))
        self.steps += 1
        return np.array(out, dtype=np.uint32)

    def __getattr__(self, name):  # weights, config, counters of the model
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)


class PlanModelSteps:
    """``execute_step(plan)`` over a model with the batched step of
    :class:`qualia.model.PagedModelBackend` (``step_logits`` and ``sample``): one forward over
    the plan (its copies first), then one token per sampled row, drawn by the model's keyed
    sampler for ``plan.sampled_request_ids`` (so the members of a group, sampling the same
    logits row, draw apart).  A plan with beam rows (``plan.num_topk > 0``) also gets each
    row's ``num_topk`` most likely ids and their log-probabilities (best first, ties: the lower
    id): ``(ids, topk_ids, topk_logprobs)``, what ``update`` takes."""

    def __init__(self, model) -> None:
        for name in ("step_logits", "sample"):
            if not callable(getattr(model, name, None)):
                raise TypeError(f"{type(model).__name__} has no {name}(): sampling and forks "
                                f"need a model with the batched step of "
                                f"qualia.model.PagedModelBackend")
        self.model = model
        self.steps = 0

    def execute_step(self, plan):
        from .model import _topk_of, log_softmax

        model = self.model
        logits = model.step_logits(plan)
        li = np.asarray(plan.logits_indices, dtype=np.int64)
        ids = model.sample(logits, plan.sampled_request_ids,
                           np.asarray(plan.positions, dtype=np.int64)[li] + 1)
        self.steps += 1
        k = int(getattr(plan, "num_topk", 0) or 0)
        if not k:
            return ids
        top_ids, top_lps = _topk_of(log_softmax(logits), k)
        return ids, top_ids, top_lps

    def __getattr__(self, name):  # weights, config, counters of the model
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)


class DecodeRuleSteps:
    """``execute_step(plan)`` for a decode-rule backend: each sampled row's token is
    ``rule(request_id, position, token)`` of the row's last token (``qualia.hash_next_token``
    over ``vocab`` for the C ``qualia.HashBackend``; a backend's own ``next_token`` for
    :class:`qualia.twin.PyHashBackend`).  A prefill chunk that samples nothing computes
    nothing: a decode rule keeps no K/V."""

    def __init__(self, backend, rule: Callable[[int, int, int, int], int], vocab: int) -> None:
        self.backend = backend
        self.rule = rule
        self.vocab = int(vocab)

    def execute_step(self, plan) -> np.ndarray:
        rows = plan.logits_indices
        rule, vocab = self.rule, self.vocab
        rids = plan.sampled_request_ids.tolist()
        pos = plan.positions[rows].tolist()
        tok = plan.input_ids[rows].tolist()
        return np.array([rule(r, p, t, vocab) for r, p, t in zip(rids, pos, tok)],
                        dtype=np.uint32)


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
    ``ModelWeights.random(model_config)``), ``"c"`` (``qualia.HashBackend(vocab)``), or a
    backend object (one with ``execute_step``, a model with ``prefill``, or a decode-rule
    backend).  A Python backend's time is charged to the backend row of the clock.

    The step: ``max_batched_tokens`` tokens and ``max_seqs`` requests per plan (None:
    ``max_requests``), prefill chunks of at most ``max_prefill_chunk`` tokens (None: only the
    budget limits them), at most ``max_queued`` requests queued in the scheduler (None: its
    default).  ``prefix_caching`` is ``"auto"`` (the default) or ``"off"``.

    ``implementation`` (``"auto"``, ``"core"``, ``"twin"``) or ``scheduler_factory`` (called
    with the scheduler's constructor arguments) choose the scheduler class.

    Forks (docs/DESIGN.md, "Forks in the engine"): ``n > 1`` adds every request with
    ``add_request(..., n=n)`` (one prefill, ``n`` sampled sequences sharing the prompt's pages
    copy-on-write), ``beam_width=w`` with ``add_request(..., beam_width=w)`` (beam search, model
    backend only); at most one of the two, each at most ``max_seqs``.  ``"auto"`` takes the core
    when it supports what is asked, else the twin ``qualia.twin_fork.ForkStepScheduler``.  A
    finished group's sequences are all in :attr:`groups`; ``outputs[request_id]`` is its first
    member (``n``) or best hypothesis (beam).  ``sampling`` (a
    :class:`qualia.model.SamplingParams`; model backend only; default greedy) draws each token
    keyed by ``(seed, member id, position)``: the members of an ``n`` group differ only with a
    temperature > 0.

    ``step_seconds``: the serving clock's cost of one step (None: the measured time of each
    step).  ``clock`` is the :class:`~qualia.timing.Stopwatch` the engine charges its time to
    (the CLI passes one started before anything else); by default the engine makes one that
    counts only while an engine method runs.  ``on_complete(request_id, tokens)`` is called
    whenever a request completes."""

    def __init__(
        self,
        backend="model",
        *,
        max_requests: int = 24,
        num_blocks: int = 96,
        page_tokens: int = 16,
        logical_pages: int = 16,
        max_batched_tokens: int = 2048,
        max_seqs: Optional[int] = None,
        max_prefill_chunk: Optional[int] = None,
        max_queued: Optional[int] = None,
        end_token: Optional[int] = None,
        model_config=None,
        vocab: Optional[int] = None,
        on_complete: Optional[Callable[[int, List[int]], None]] = None,
        clock: Optional[Stopwatch] = None,
        prefix_caching: str = "auto",
        implementation: str = "auto",
        scheduler_factory: Optional[Callable[..., Any]] = None,
        step_seconds: Optional[float] = None,
        n: int = 1,
        beam_width: Optional[int] = None,
        sampling=None,
    ) -> None:
        import qualia

        from .model import GREEDY, SamplingParams

        self._owns_clock = clock is None
        self.clock = clock if clock is not None else Stopwatch(SETUP)
        token = self.clock.enter(SETUP)
        if prefix_caching not in ("auto", "off"):
            raise ValueError(f"prefix_caching must be 'auto' or 'off' (the engine step has no "
                             f"explicit breakpoints), not {prefix_caching!r}")
        if step_seconds is not None and not 0.0 <= float(step_seconds) < float("inf"):
            raise ValueError(f"step_seconds must be a finite number >= 0, got {step_seconds!r}")
        self.step_seconds = None if step_seconds is None else float(step_seconds)
        seqs = int(max_requests if max_seqs is None else max_seqs)
        if not 1 <= seqs <= int(max_requests):
            # the engine's slots: at most max_requests requests run at once
            raise ValueError(f"max_num_seqs must be in [1, max_requests={max_requests}], "
                             f"got {seqs}")
        self.n, self.beam_width = _group_options(n, beam_width, seqs, max_queued)
        #: requests are added as groups (n > 1 or beam search)
        self.forking = self.n > 1 or self.beam_width is not None
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a qualia.model.SamplingParams, not "
                            f"{type(sampling).__name__}")
        self.page_tokens = int(page_tokens)
        self.end_token = None if end_token is None else int(end_token)

        # the backend, and the vocabulary of its sampled ids
        self.weights = None
        if isinstance(backend, str):
            if backend == "model":
                from .model import ModelConfig, ModelWeights, PagedModelBackend

                cfg = model_config if model_config is not None else ModelConfig()
                self.weights = ModelWeights.random(cfg)
                backend = PagedModelBackend(self.weights, num_blocks, page_tokens,
                                            sampling=GREEDY if sampling is None else sampling)
            elif backend == "c":
                backend = qualia.HashBackend(vocab=32000 if vocab is None else vocab)
            else:
                raise ValueError(f"backend must be 'model', 'c' or a backend object, not "
                                 f"{backend!r}")
        self.raw_backend = backend
        self.is_model = (callable(getattr(backend, "prefill", None))
                         or getattr(backend, "weights", None) is not None)
        self.is_c_backend = is_c_backend(backend)
        self.backend_label = backend_label(backend, self.is_model, self.is_c_backend)
        if self.is_model:
            self.weights = getattr(backend, "weights", self.weights)
            bt = getattr(backend, "page_tokens", self.page_tokens)
            bn = getattr(backend, "num_blocks", num_blocks)
            if bt != self.page_tokens or bn < num_blocks:
                raise ValueError(
                    f"the model backend has {bn} pages of {bt} tokens; the scheduler needs "
                    f"{num_blocks} pages of {self.page_tokens} tokens")
            cfg_vocab = getattr(getattr(backend, "config", None), "vocab", 0)
            self.vocab: Optional[int] = int(cfg_vocab or 0) or (
                None if vocab is None else int(vocab))
            self._prompt_vocab = self.vocab
        else:
            # the decode rule's vocabulary; any u32 prompt token id is fine
            self.vocab = int(vocab if vocab is not None else getattr(backend, "vocab", 32000))
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
        if self.beam_width is not None and not self.is_model:
            raise ValueError("beam search needs the model backend: it ranks candidates by the "
                             "model's log-probabilities, which a decode rule does not have")
        steps = self._step_backend(backend)
        self.backend = TimedBackend(steps, self.clock)

        # the scheduler
        factory = (scheduler_factory if scheduler_factory is not None
                   else make_scheduler_factory(implementation, n=self.n,
                                               beam_width=self.beam_width))
        if (scheduler_factory is None and implementation == "auto" and self.forking
                and prefix_caching == "off" and factory is not qualia.StepScheduler):
            # "auto" fell back to the twin, which models automatic caching only: say why
            what = "beam search" if self.beam_width is not None else "parallel sampling (n)"
            raise ValueError(f"{what} with prefix_caching='off' needs the compiled core's "
                             f"{what}, which this build lacks; its pure-Python twin "
                             f"(qualia.twin_fork.ForkStepScheduler) models "
                             f"prefix_caching='auto' only")
        self.max_requests = int(max_requests)
        self.max_queued = 4 * self.max_requests if max_queued is None else int(max_queued)
        self.scheduler = factory(
            num_blocks, page_tokens, logical_pages, seqs,
            prefix_caching=prefix_caching, max_num_batched_tokens=max_batched_tokens,
            max_queued=self.max_queued, max_prefill_chunk=max_prefill_chunk,
            vocab_size=self.vocab)
        s = self.scheduler
        # the facade under the step API: the scheduler itself (core) or the twin's facade
        self.facade = getattr(s, "facade", s)
        self.implementation = "twin" if s is not self.facade else "core"
        self.caching = self.facade.prefix_caching
        self.num_blocks = int(self.facade.num_pages)
        self.logical_pages = int(self.facade.logical_pages)
        self.max_batched_tokens = int(max_batched_tokens)
        self.max_seqs = seqs
        self.max_prefill_chunk = max_prefill_chunk
        self._events = np.zeros(256, dtype=qualia.KV_EVENT)  # drained each step
        self.on_complete = on_complete
        self._progress: Optional[Callable[[str, int, int], None]] = None

        self.step_no = 0
        self.now = 0.0  # the serving clock, seconds
        self._empty_plans = 0  # consecutive plans that scheduled nothing
        # per running sequence (a request, or one member of a group): its tokens with K/V
        # after the last plan it was in, and the pages that many tokens take on their own
        # (the non-sharing count); per sequence that left the running set (preempted,
        # parked): what it had computed (its recompute, when it resumes); admissions so far
        self._seq_of: Dict[int, int] = {}
        self._unshared = 0  # sum of ceil(seq_len / page_tokens) over self._seq_of
        self._left: Dict[int, int] = {}
        self._admitted: Dict[int, int] = {}
        # children of n groups sampled at their fork (a plan row under a member id that is not
        # one of the plan's requests) and in no plan since: the tokens with K/V they share
        # from their parent.  update() forks them or queues them (no slot or row free); the
        # forked ones hold pages before their first plan (the last holder of a shared page
        # its siblings copied away from), so they count in the non-sharing figure too
        self._unseen: Dict[int, int] = {}
        self._parked_seen = 0
        self._awaiting_first: Dict[int, _Live] = {}  # admitted, no token sampled yet
        self._requests: Dict[int, Request] = {}
        self._live: Dict[int, _Live] = {}
        # not yet due: a heap of (arrival_step, arrival_s, submission number, request)
        self._arrivals: List[Tuple[int, float, int, _Live]] = []
        self._submitted = itertools.count()
        self._backlog: Deque[_Live] = collections.deque()  # due, waiting for queue room
        self._completions: Dict[int, int] = {}
        self.outputs: Dict[int, List[int]] = {}
        self.finish_reasons: Dict[int, str] = {}
        #: every sequence of each finished group (n > 1 or beam search), by request id
        self.groups: Dict[int, GroupOutput] = {}
        # a multi-turn Workload's next_turn(request, answer, step), set by submit_all
        self._next_turn: Optional[Callable[[Request, List[int], int], Optional[Request]]] = None

        # per step with work: seconds in the scheduler calls and in the backend
        self.round_sched_s: List[float] = []
        self.round_backend_s: List[float] = []
        self.counters = Counters()
        self.timeline = Timeline()
        self.last_check: Optional[CheckResult] = None
        if self._owns_clock:
            self.clock.stop()  # an engine-owned clock counts only inside engine methods
        else:
            self.clock.leave(token)

    def _step_backend(self, backend):
        """``backend`` as an object with ``execute_step(plan)`` (see the module docstring)."""
        if self.is_model and self.beam_width is not None:
            return PlanModelSteps(backend)  # the beam rows' candidates too
        if callable(getattr(backend, "execute_step", None)):
            return backend
        if callable(getattr(backend, "prefill", None)):
            if self.forking or not self.sampling.greedy:
                return PlanModelSteps(backend)  # rows sampled per member, not per sequence
            return ModelSteps(backend)
        rule = getattr(backend, "next_token", None)
        if callable(rule):
            return DecodeRuleSteps(backend, rule, self.vocab or 32000)
        if is_c_backend(backend) and type(backend).__name__ == "HashBackend":
            import qualia

            return DecodeRuleSteps(backend, qualia.hash_next_token, self.vocab or 32000)
        raise TypeError(f"{type(backend).__name__} is not a step backend: it needs "
                        f"execute_step(plan), a model's prefill(tokens, start, block_table) or "
                        f"a decode rule next_token(request_id, position, token, vocab)")

    # -- properties ---------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Requests submitted and not yet completed."""
        return len(self._live)

    @property
    def wall_s(self) -> float:
        """Seconds on the engine's clock so far (the sum of its rows)."""
        return self.clock.wall_s

    def _call(self, fn, *args, **kwargs):
        """A scheduler call, charged to the scheduler row."""
        clock = self.clock
        prev = clock.switch(SCHEDULER)
        try:
            return fn(*args, **kwargs)
        finally:
            clock.switch(prev)

    # -- submission ---------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queue a request for its arrival.  Raises :class:`UnservableRequest` (a
        ``ValueError``) for a request that needs more pages than the whole pool or more tokens
        than a request's table holds (``logical_pages * page_tokens``), and ``ValueError`` for
        an empty prompt, no tokens to generate, bad token ids or a duplicate request id."""
        token = self.clock.enter(SUBMISSION)
        try:
            self._submit(request)
        finally:
            self.clock.leave(token)

    def submit_all(self, requests: Iterable[Request]) -> int:
        """Submit every request of ``requests`` (a :class:`~qualia.workload.Workload` or
        :class:`~qualia.workload.Trace` is generated first, charged to the workload row);
        returns how many were submitted."""
        n = 0
        token = self.clock.enter(WORKLOAD)
        try:
            if isinstance(requests, Workload):
                if requests.turns > 1:
                    self._next_turn = requests.next_turn
                requests = requests.generate()
            elif isinstance(requests, Trace):
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
        request = checked_request(request, page_tokens=self.page_tokens,
                                  num_blocks=self.num_blocks, logical_pages=self.logical_pages,
                                  vocab=self._prompt_vocab)
        if self.beam_width is not None:
            why = unservable_reason(f"request {request.request_id}", len(request.prompt),
                                    request.max_new_tokens, page_tokens=self.page_tokens,
                                    num_blocks=self.num_blocks,
                                    logical_pages=self.logical_pages, beam_width=self.beam_width)
            if why is not None:
                raise UnservableRequest(why)
        rid = request.request_id
        self._requests[rid] = request
        live = _Live(request)
        self._live[rid] = live
        heapq.heappush(self._arrivals, (request.arrival_step, request.arrival_s or 0.0,
                                        next(self._submitted), live))

    # -- the loop -----------------------------------------------------------------------------

    def run(self, requests: Iterable[Request] = (), *, check: bool = False,
            progress: Optional[Callable[[str, int, int], None]] = None) -> EngineResult:
        """Submit ``requests``, serve everything submitted to completion, verify the end state
        (every request completed exactly once, nothing queued or running, every page free or
        cached), run the check if ``check``, and report.

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
        return EngineResult(self.stats(), dict(self.outputs), checked, self.timeline,
                            dict(self.groups))

    def step(self) -> None:
        """One engine step: the arrivals due, then schedule, execute and update."""
        token = self.clock.enter(ENGINE)
        try:
            self._step()
        finally:
            self.clock.leave(token)

    def _due(self, live: _Live) -> bool:
        r = live.req
        return r.arrival_step <= self.step_no and (r.arrival_s is None or r.arrival_s <= self.now)

    def _take_arrivals(self) -> None:
        """Move the arrivals due to the scheduler (the engine's backlog while its queue is
        full)."""
        arrivals, backlog = self._arrivals, self._backlog
        while arrivals and self._due(arrivals[0][3]):
            live = heapq.heappop(arrivals)[3]
            live.arrival_step = self.step_no
            r = live.req
            live.arrival_t = self.now if r.arrival_s is None else float(r.arrival_s)
            backlog.append(live)
        s = self.scheduler
        room = self.max_queued - s.num_waiting - s.num_running
        group = ({} if not self.forking else {"n": self.n} if self.beam_width is None
                 else {"beam_width": self.beam_width})
        while backlog and room > 0:
            live = backlog.popleft()
            r = live.req
            try:
                self._call(s.add_request, r.request_id, r.prompt,
                           max_new_tokens=r.max_new_tokens, namespace=r.namespace,
                           eos_token_id=self.end_token, **group)
            except StepError.QueueFull:
                # a group takes n entries, its stopped members' too, until its result is
                # returned: the queue is fuller than num_waiting + num_running say
                if not self.forking:
                    raise
                backlog.appendleft(live)
                return
            room -= self.n

    def _skip_idle(self) -> None:
        """Nothing queued or running: jump the step counter and the clock to the next
        arrival."""
        nxt = self._arrivals[0][3].req
        if nxt.arrival_step > self.step_no:
            self.counters.idle_steps += nxt.arrival_step - self.step_no
            self.step_no = nxt.arrival_step
        if nxt.arrival_s is not None and nxt.arrival_s > self.now:
            self.counters.idle_s += nxt.arrival_s - self.now
            self.now = float(nxt.arrival_s)

    def _step(self) -> None:
        t0 = _now()
        self._take_arrivals()
        s = self.scheduler
        if not s.has_unfinished():
            if self._arrivals:
                self._skip_idle()
            return
        secs = self.clock.seconds
        s0, b0 = secs[SCHEDULER], secs[BACKEND]
        plan = self._call(s.schedule)
        held = self.num_blocks - int(self.facade.free_pages)  # the step's pages are reserved
        running = int(s.num_running)
        try:
            sampled = self.backend.execute_step(plan)
        except BaseException:
            discard = getattr(s, "discard_plan", None)
            if callable(discard):
                discard()
            raise
        if isinstance(sampled, tuple):  # beam rows: (ids, topk_ids, topk_logprobs)
            finished = self._call(s.update, *sampled)
        else:
            finished = self._call(s.update, sampled)
        firsts = self._record(plan, held, running)
        if self.forking:
            self._count_forks()
        self._check_progress(plan)
        if self.caching == "auto":
            self._drain_events()
        self.round_sched_s.append(secs[SCHEDULER] - s0)
        self.round_backend_s.append(secs[BACKEND] - b0)
        self.now += (_now() - t0) if self.step_seconds is None else self.step_seconds
        for lv in firsts:
            lv.first_t = self.now
        self.step_no += 1
        self.counters.steps += 1
        for fin in finished:
            self._complete(fin)
        self._sample()

    #: Consecutive empty plans after which the engine gives up (an empty plan happens when the
    #: only running request preempts itself for pages; the next step admits it again).
    MAX_EMPTY_PLANS = 64

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

    def _count_forks(self) -> None:
        """The scheduler's fork counters, after the step's update."""
        s, c = self.scheduler, self.counters
        c.forks = int(getattr(s, "forks", 0))
        c.fork_fallbacks = int(getattr(s, "fork_fallbacks", 0))
        parked = int(getattr(s, "parked", 0))
        if parked != self._parked_seen:
            # beams parked by this update left the running set outside any plan: every
            # sequence not in a plan since is treated as gone (what it computed is kept for
            # its recompute); a running one is counted again from its next plan
            self._parked_seen = parked
            self._left.update(self._seq_of)
            self._seq_of.clear()
            self._unshared = 0
        c.beams_parked = parked

    def _record(self, plan, held: int, running: int) -> List[_Live]:
        """The books of one step (``held``: pages requests held right after the schedule,
        ``running``: sequences running then): tokens, admissions, hits, preemptions, pages
        with and without sharing; returns the requests that got their first token."""
        c, live = self.counters, self._live
        n_tokens = len(plan.input_ids)
        c.scheduled_tokens += n_tokens
        c.prefill_tokens += int(plan.num_prefill_tokens)
        c.decode_tokens += int(plan.num_decode_tokens)
        c.pages_copied += len(plan.copies)
        c.preemptions += len(plan.preempted_request_ids)
        c.max_plan_tokens = max(c.max_plan_tokens, n_tokens)
        c.max_plan_seqs = max(c.max_plan_seqs, len(plan.request_ids))
        if plan.num_prefill_tokens and plan.num_decode_tokens:
            c.mixed_steps += 1
        seq_of, left, admitted, unseen = self._seq_of, self._left, self._admitted, self._unseen
        pt = self.page_tokens
        unshared = self._unshared
        for rid in plan.finished_request_ids.tolist():  # stopped since the last plan
            unseen.pop(rid, None)
            seq = seq_of.pop(rid, None)
            if seq is not None:
                unshared -= -(-seq // pt)
            left.pop(rid, None)
            admitted.pop(rid, None)
        for rid in plan.preempted_request_ids.tolist():  # what it computed: its last plan's
            if rid in unseen:  # a forked child preempted before its first plan
                seq_of[rid] = unseen.pop(rid)
                unshared += -(-seq_of[rid] // pt)
                admitted.setdefault(rid, 1)
            seq = seq_of.pop(rid, None)
            if seq is not None:
                unshared -= -(-seq // pt)
                left[rid] = seq
        new = plan.new_request_ids.tolist()
        if new:
            n, k = len(plan.request_ids), len(new)
            ids = plan.request_ids.tolist()
            qsl = plan.query_start_loc
            if ids[n - k:] == new:  # admissions come last in a plan
                at = list(range(n - k, n))
            else:  # pragma: no cover - a scheduler that orders them otherwise
                index = {rid: i for i, rid in enumerate(ids)}
                at = [index[rid] for rid in new]
            hits = plan.positions[qsl[at]].tolist()
            for rid, hit in zip(new, hits):
                unseen.pop(rid, None)  # a child queued at its fork, admitted now
                lv = live.get(rid)  # None: a group's child (queued at its fork, or parked)
                if lv is not None and lv.first_step < 0:
                    self._awaiting_first[rid] = lv
                c.admissions += 1
                if hit:
                    c.prefix_hits += 1
                    c.cached_tokens += hit
                times = admitted[rid] = admitted.get(rid, 0) + 1
                if times > 1:  # resumed after a preemption: what it computed before, less
                    c.resumed += 1  # what the cache kept, is computed again
                    c.tokens_recomputed += max(0, left.pop(rid, 0) - hit)
        ids, seqs = plan.request_ids.tolist(), plan.seq_lens.tolist()
        for rid, seq in zip(ids, seqs):
            old = seq_of.get(rid)
            if old is not None:
                unshared -= -(-old // pt)
            else:
                left.pop(rid, None)
                if unseen.pop(rid, None) is not None:  # a forked child's first plan: it was
                    admitted.setdefault(rid, 1)  # admitted by its fork (a later one resumes)
            seq_of[rid] = seq
            unshared += -(-seq // pt)
        self._unshared = unshared
        # the forked children in no plan yet: running minus the sequences seen in plans; which
        # of the unseen children those are (the others wait, queued) is not known, so the
        # smallest count, never more than they hold
        extra = max(0, running - len(seq_of))
        if extra and unseen:
            unshared += sum(sorted(-(-seq // pt) for seq in unseen.values())[:extra])
        c.peak_held_pages = max(c.peak_held_pages, held)
        if unshared > c.peak_unshared_pages:
            c.peak_unshared_pages = unshared
            c.pages_saved_at_peak = unshared - held
        if self.n > 1:  # rows under a member id not planned: the forks this update makes
            in_plan = set(ids)
            forks = [(row, rid) for row, rid in zip(plan.logits_indices.tolist(),
                                                    plan.sampled_request_ids.tolist())
                     if rid not in in_plan]
            if forks:
                seq_at = dict(zip(plan.query_start_loc[1:].tolist(), seqs))  # end row -> seq
                for row, rid in forks:
                    unseen[rid] = seq_at[row + 1]
        firsts = []
        awaiting = self._awaiting_first
        if awaiting:
            sampled = set(plan.sampled_request_ids.tolist())
            for rid in [r for r in awaiting if r in sampled]:
                got = awaiting.pop(rid)
                got.first_step = self.step_no
                firsts.append(got)
        c.sampled_tokens += len(plan.logits_indices)
        return firsts

    def _sample(self) -> None:
        """The timeline row of the step just made, and the first tokens' times."""
        s, f, tl = self.scheduler, self.facade, self.timeline
        step, now = self.step_no - 1, self.now
        stats = f.cache_stats()
        used = self.num_blocks - int(f.free_pages)
        tl.append(step=step, t=now, running=int(s.num_running),
                  waiting=int(s.num_waiting) + len(self._backlog), pages_used=used,
                  pages_cached=int(stats.reclaimable_pages),
                  hit_rate=(stats.hit_tokens / stats.lookup_tokens
                            if stats.lookup_tokens else 0.0))
        c = self.counters
        c.peak_pages = max(c.peak_pages, used)
        c.peak_running = max(c.peak_running, int(s.num_running))
        c.peak_waiting = max(c.peak_waiting, int(s.num_waiting) + len(self._backlog))

    def _complete(self, fin) -> None:
        rid = int(fin.request_id)
        lv = self._live.pop(rid)
        c = self.counters
        if hasattr(fin, "outputs"):  # a FinishedGroup: n members, or beam hypotheses
            outs = [np.asarray(o).tolist() for o in fin.outputs]
            reasons = [str(x) for x in fin.finish_reasons]
            self.groups[rid] = GroupOutput(
                "n" if self.beam_width is None else "beam", outs, reasons,
                [int(m) for m in fin.member_ids],
                None if fin.scores is None else [float(x) for x in fin.scores])
        else:
            outs = [np.asarray(fin.output_tokens).tolist()]
            reasons = [str(fin.finish_reason)]
        lv.outputs = outs[0]
        lv.longest = max(len(o) for o in outs)
        lv.end_step, lv.end_t = self.step_no - 1, self.now
        self._completions[rid] = self._completions.get(rid, 0) + 1
        self.outputs[rid] = lv.outputs
        self.finish_reasons[rid] = reasons[0]
        self.timeline.finish(lv)
        c.completed += 1
        c.sequences_completed += len(outs)
        c.tokens_generated += sum(len(o) for o in outs)
        stopped = reasons.count("stop")
        c.finished_stop += stopped
        c.finished_length += len(reasons) - stopped
        if self.on_complete is not None:
            self.on_complete(rid, lv.outputs)
        if self._next_turn is not None:
            self._submit_next_turn(lv)
        if self._progress is not None:
            self._progress("serve", len(self.outputs), len(self._requests))

    def _submit_next_turn(self, live: _Live) -> None:
        """Submit the next turn of ``live``'s conversation, if it has one and it fits."""
        next_turn = self._next_turn
        nxt = None if next_turn is None else next_turn(live.req, live.outputs, self.step_no - 1)
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
        f, buf, c = self.facade, self._events, self.counters
        while True:
            n = self._call(f.drain_events, buf)
            if not n:
                return
            kinds = np.bincount(buf["kind"][:n], minlength=4)
            c.kv_events_stored += int(kinds[1])
            c.kv_events_removed += int(kinds[2])
            c.kv_events_cleared += int(kinds[3])

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
        the same width; see :mod:`qualia.check`.  Charged to
        the check row; the result is also kept in ``last_check``.  ``on_checked(request_id)``
        is called after each request."""
        if self.is_model and self.weights is None:
            raise ValueError("check needs the model backend's weights")
        token = self.clock.enter(CHECK)
        try:
            weights = self.weights if self.is_model else None
            sampling = None if self.sampling.greedy else self.sampling
            if self.forking:
                self.last_check = check_groups(
                    self._requests, self.groups, weights=weights, end_token=self.end_token,
                    vocab=self.vocab or 32000, on_checked=on_checked, sampling=sampling,
                    beam_width=self.beam_width, n=self.n)
            else:
                self.last_check = check_outputs(
                    self._requests, self.outputs, weights=weights, end_token=self.end_token,
                    vocab=self.vocab or 32000, on_checked=on_checked, sampling=sampling)
        finally:
            self.clock.leave(token)
        return self.last_check

    def latencies(self) -> Dict[str, List[float]]:
        """Per completed request: time to first token and time per output token after the
        first, in steps and in seconds of the serving clock (``ttft_steps``, ``ttft_s``,
        ``tpot_steps``, ``tpot_s``; the TPOT lists skip requests of one token)."""
        return self.timeline.latencies()

    def stats(self) -> Dict[str, object]:
        """The run's figures and where its time went (:func:`qualia.report.collect_stats`)."""
        return collect_stats(self)
