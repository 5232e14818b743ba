"""A small continuous-batching serving engine on the :class:`qualia.Scheduler` facade.

This is what ``python -m qualia simulate`` runs.  It has two halves:

* :class:`Workload` makes a reproducible synthetic trace: ``N`` requests with Poisson arrivals
  (``arrival_rate`` requests per decode step), prompt and output lengths drawn from clipped
  uniform or lognormal distributions, ``K`` shared system prompts that a fraction
  (``share_ratio``) of the prompts start with, and ``T`` tenants, each with its own prefix-cache
  namespace (``b"tenant-3"``): two tenants never share KV pages, even for the same system prompt.
* :class:`Engine` serves such requests on one :class:`qualia.Scheduler`, step by step.  Every
  step admits waiting requests (first come, first served) while a request slot is free and the
  pool has the pages for the prompt plus one page of headroom, prefills them, publishes their
  shared prefix to the prefix store, then runs one decode round over every running request.

The backend is either a *model* (it has ``prefill(tokens, start_position, block_table)``, e.g.
:class:`qualia.model.PagedModelBackend`): the engine prefills prompts through it and the
generated tokens can be checked against :class:`qualia.model.DenseModel`; or a decode-only
backend such as the built-in C ``qualia.HashBackend``: prefill then only reserves and
advances the pages, and the first token is the reference decode rule (docs/DESIGN.md
"Reference decode backend") applied to the last prompt token at its position.

Prefix caching uses explicit breakpoints: a request's ``shared_prefix_len`` (its system prompt)
is what is looked up at admission and published after its prefill, capped at
``len(prompt) - 1`` so that a hit always leaves at least one prompt token to prefill (the one
whose logits give the first generated token).

Memory pressure.  When the pool runs out (admission cannot fit the head of the queue, or a
``reserve``/``decode`` fails with ``TableError.Exhausted`` somewhere in its error chain) the
engine first evicts least-recently-used prefix entries that no running request holds
(``evict_unused_lru``); if none is left it *preempts* the most recently admitted running request:
the request is finished (its pages released) and goes back to the front of the waiting queue
keeping the tokens generated so far; on re-admission it is prefilled with ``prompt +
generated[:-1]`` (recompute) and decoding continues from ``generated[-1]``.  When a single
request is running and the pool is still short, the store's remaining entries are evicted
(``evict_lru``) even if that request shares them, which turns its shared pages into exclusive
ones.  A request whose ``prompt + max_new_tokens`` cannot fit in the whole pool (or in
``logical_pages``) is rejected by :meth:`Engine.submit` with a ``ValueError``, so the engine
cannot deadlock: with nothing else running, the head of the queue always fits.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "Request",
    "Workload",
    "Engine",
    "EngineResult",
    "CheckResult",
    "TimedBackend",
    "hash_next_token",
    "reference_generate",
    "is_exhausted",
    "pages_needed",
]

_U64_MAX = 2**64 - 1


# --------------------------------------------------------------------------------------------
# requests and workloads
# --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Request:
    """One request of a trace.

    ``prompt`` is a list of token ids; ``shared_prefix_len`` is the length of the prompt's
    cacheable prefix (its system prompt; 0 for none); ``arrival_step`` is the decode step at
    which the request reaches the engine.  ``namespace`` (``b"tenant-<tenant>"``) scopes the
    prefix cache."""

    request_id: int
    tenant: int
    prompt: List[int]
    shared_prefix_len: int
    max_new_tokens: int
    arrival_step: int = 0
    system_prompt: Optional[int] = None  # index of the system prompt, None for none

    @property
    def namespace(self) -> bytes:
        return f"tenant-{self.tenant}".encode()

    def to_dict(self) -> dict:
        d = asdict(self)
        d["prompt"] = [int(t) for t in self.prompt]
        return d


def _length_range(value, what: str) -> Tuple[int, int]:
    try:
        lo, hi = (int(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a (min, max) pair of integers, got {value!r}") from None
    if lo < 1 or hi < lo:
        raise ValueError(f"{what} must satisfy 1 <= min <= max, got ({lo}, {hi})")
    return lo, hi


@dataclass
class Workload:
    """A seedable synthetic trace (see the module docstring).

    ``prompt_len`` and ``output_len`` are inclusive ``(min, max)`` ranges; ``length_dist`` is
    ``"uniform"`` or ``"lognormal"`` (median at the geometric mean of the range, ``sigma`` 0.5,
    clipped to the range).  ``end_token`` (optional) is the id that ends a generation; it never
    appears in a prompt (pass the same id to :class:`Engine`).  A shared prompt is one of the ``system_prompts`` system prompts
    (each ``system_prompt_len`` tokens, the same token ids for every tenant) followed by the
    user's part; its total length is drawn like any other prompt but is at least
    ``system_prompt_len + 1``.  Token ids are drawn uniformly from ``[0, vocab)``."""

    requests: int = 48
    seed: int = 0
    arrival_rate: float = 1.0
    prompt_len: Tuple[int, int] = (24, 96)
    output_len: Tuple[int, int] = (16, 48)
    system_prompts: int = 4
    system_prompt_len: int = 40
    share_ratio: float = 0.75
    tenants: int = 2
    vocab: int = 512
    length_dist: str = "uniform"
    first_request_id: int = 0
    end_token: Optional[int] = None

    def __post_init__(self) -> None:
        self.prompt_len = _length_range(self.prompt_len, "prompt_len")
        self.output_len = _length_range(self.output_len, "output_len")
        if self.requests < 0:
            raise ValueError("requests must be >= 0")
        if not self.arrival_rate > 0:
            raise ValueError("arrival_rate must be > 0 (requests per decode step; inf: all at 0)")
        if self.system_prompts < 0 or self.tenants < 1 or self.vocab < 1:
            raise ValueError("system_prompts must be >= 0, tenants and vocab >= 1")
        if not 0.0 <= self.share_ratio <= 1.0:
            raise ValueError("share_ratio must be in [0, 1]")
        if self.system_prompts and self.system_prompt_len < 1:
            raise ValueError("system_prompt_len must be >= 1")
        if self.length_dist not in ("uniform", "lognormal"):
            raise ValueError("length_dist must be 'uniform' or 'lognormal'")
        if self.end_token is not None and not 0 <= self.end_token < self.vocab:
            raise ValueError(f"end_token must be in [0, {self.vocab}), got {self.end_token}")
        if self.end_token is not None and self.vocab < 2:
            raise ValueError("an end token needs vocab >= 2")

    def _tokens(self, rng: np.random.Generator, n: int) -> List[int]:
        toks = rng.integers(0, self.vocab, size=n)
        if self.end_token is not None:  # prompts never hold the end token
            toks[toks == self.end_token] = (self.end_token + 1) % self.vocab
        return toks.tolist()

    def _lengths(self, rng: np.random.Generator, rng_range: Tuple[int, int], n: int) -> np.ndarray:
        lo, hi = rng_range
        if self.length_dist == "uniform":
            return rng.integers(lo, hi + 1, size=n)
        median = math.sqrt(lo * hi)
        values = np.rint(rng.lognormal(math.log(median), 0.5, size=n))
        return np.clip(values, lo, hi).astype(np.int64)

    def system_prompt_tokens(self) -> List[List[int]]:
        """The ``K`` system prompts (drawn from their own stream of the seed)."""
        rng = np.random.default_rng([self.seed, 1])
        return [self._tokens(rng, self.system_prompt_len) for _ in range(self.system_prompts)]

    def generate(self) -> List[Request]:
        n = self.requests
        rng = np.random.default_rng([self.seed, 0])
        systems = self.system_prompt_tokens()
        if math.isinf(self.arrival_rate):
            arrivals = np.zeros(n, dtype=np.int64)
        else:
            arrivals = np.floor(np.cumsum(rng.exponential(1.0 / self.arrival_rate, size=n)))
            arrivals = arrivals.astype(np.int64)
        prompt_lens = self._lengths(rng, self.prompt_len, n)
        output_lens = self._lengths(rng, self.output_len, n)
        shared = rng.random(n) < self.share_ratio if systems else np.zeros(n, dtype=bool)
        which = rng.integers(0, max(1, len(systems)), size=n)
        tenants = rng.integers(0, self.tenants, size=n)
        out = []
        for i in range(n):
            length = int(prompt_lens[i])
            if shared[i]:
                sp = int(which[i])
                system = systems[sp]
                length = max(length, len(system) + 1)
                user = self._tokens(rng, length - len(system))
                prompt, prefix = system + user, len(system)
            else:
                sp = None
                prompt, prefix = self._tokens(rng, length), 0
            out.append(Request(
                request_id=self.first_request_id + i,
                tenant=int(tenants[i]),
                prompt=[int(t) for t in prompt],
                shared_prefix_len=prefix,
                max_new_tokens=int(output_lens[i]),
                arrival_step=int(arrivals[i]),
                system_prompt=sp,
            ))
        return out

    __call__ = generate

    def __iter__(self):
        return iter(self.generate())


# --------------------------------------------------------------------------------------------
# the reference decode rule (docs/DESIGN.md) in pure Python
# --------------------------------------------------------------------------------------------


def hash_next_token(request_id: int, position: int, token_id: int, vocab: int = 32000) -> int:
    """DESIGN.md "Reference decode backend" (one definition, in qualia.twin)."""
    from .twin import PyHashBackend

    return PyHashBackend.next_token(request_id, position, token_id, vocab)


def reference_generate(request_id: int, prompt: Sequence[int], max_new_tokens: int,
                       end_token: Optional[int] = None, vocab: int = 32000) -> List[int]:
    """What the engine must produce with a decode-only reference backend: the first token is
    the rule applied to the last prompt token at its position, every next one the rule applied
    to the previous output at the following position."""
    prompt = [int(t) for t in prompt]
    if max_new_tokens < 1:
        return []
    position = len(prompt) - 1
    out = [hash_next_token(request_id, position, prompt[-1], vocab)]
    while len(out) < max_new_tokens and (end_token is None or out[-1] != end_token):
        position += 1
        out.append(hash_next_token(request_id, position, out[-1], vocab))
    return out


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def is_exhausted(err: BaseException) -> bool:
    """True when a qualia error is (or wraps) the pool running out of pages."""
    chain = getattr(err, "chain", None)
    if chain is None:
        return False
    return any(name in ("TableError.Exhausted", "PoolError.Exhausted") for name in chain)


def pages_needed(prompt_len: int, max_new_tokens: int, page_tokens: int) -> int:
    """Pages a request occupies at its peak: the K/V of the prompt and of every generated token
    but the last (which is never fed back)."""
    positions = prompt_len + max(max_new_tokens, 1) - 1
    return -(-positions // page_tokens)


class TimedBackend:
    """Wraps a Python backend, adding up the time spent inside ``execute_ragged``,
    ``prefill`` and ``copy_pages`` (``.seconds``; per method in ``.by_method``)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.seconds = 0.0
        self.by_method: Dict[str, float] = {"execute_ragged": 0.0, "prefill": 0.0,
                                            "copy_pages": 0.0}
        self.calls: Dict[str, int] = {k: 0 for k in self.by_method}
        self.pages_copied = 0

    def _timed(self, name, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            dt = time.perf_counter() - t0
            self.seconds += dt
            self.by_method[name] += dt
            self.calls[name] += 1

    def execute_ragged(self, items, block_table, outputs):
        return self._timed("execute_ragged", self.inner.execute_ragged, items, block_table,
                           outputs)

    def prefill(self, tokens, start_position, block_table):
        return self._timed("prefill", self.inner.prefill, tokens, start_position, block_table)

    def copy_pages(self, copies):
        self.pages_copied += len(copies)
        return self._timed("copy_pages", self.inner.copy_pages, copies)

    def __getattr__(self, name):  # weights, config, counters of the wrapped backend
        return getattr(self.inner, name)


def _percentile(values: Sequence[float], q: float) -> float:
    if not len(values):
        return 0.0
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


# --------------------------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------------------------


@dataclass
class CheckResult:
    ok: bool
    checked: int
    mismatched: List[int]
    against: str

    def describe(self) -> str:
        if self.ok:
            return f"all {self.checked} requests match the {self.against}"
        ids = ", ".join(str(r) for r in self.mismatched[:10])
        more = "" if len(self.mismatched) <= 10 else f" (+{len(self.mismatched) - 10} more)"
        return (f"{len(self.mismatched)} of {self.checked} requests DIFFER from the "
                f"{self.against}: {ids}{more}")


@dataclass
class EngineResult:
    """What :meth:`Engine.run` reports.  ``outputs`` maps request id -> generated tokens."""

    stats: Dict[str, object]
    outputs: Dict[int, List[int]] = field(repr=False)
    check: Optional[CheckResult] = None

    def to_dict(self, with_outputs: bool = False) -> dict:
        d = {"stats": dict(self.stats)}
        if self.check is not None:
            d["check"] = asdict(self.check)
            d["check"]["message"] = self.check.describe()
        if with_outputs:
            d["outputs"] = {str(k): v for k, v in sorted(self.outputs.items())}
        return d


class _Live:
    """Engine-side state of one request."""

    __slots__ = ("req", "generated", "preemptions", "admissions", "done")

    def __init__(self, req: Request) -> None:
        self.req = req
        self.generated: List[int] = []
        self.preemptions = 0
        self.admissions = 0
        self.done = False

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


# --------------------------------------------------------------------------------------------
# the engine
# --------------------------------------------------------------------------------------------


class Engine:
    """Serve requests on one :class:`qualia.Scheduler` (see the module docstring).

    ``backend``: ``"model"`` (a :class:`~qualia.model.PagedModelBackend` over
    ``ModelWeights.random(model_config)``), ``"c"`` (``qualia.HashBackend(vocab)``), or a
    backend object.  A backend with a ``prefill`` method is a model: it is wrapped in a
    :class:`TimedBackend` to measure backend time.  Other backends are passed to
    ``Scheduler.decode`` as they are (a C backend keeps its GIL-free path) and their time is
    the time of the ``decode`` call.

    ``on_complete(request_id, tokens)`` is called whenever a request completes."""

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
    ) -> None:
        import qualia

        self.page_tokens = int(page_tokens)
        self.scheduler = qualia.Scheduler(
            max_requests, num_blocks, page_tokens, logical_pages,
            prefix_entries=prefix_entries, prefix_pages=prefix_pages, prefix_caching="explicit")
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
                raise ValueError(f"backend must be 'model', 'c' or a backend object, not {backend!r}")
        self.raw_backend = backend
        self.is_model = callable(getattr(backend, "prefill", None))
        if self.is_model:
            self.weights = getattr(backend, "weights", self.weights)
            bt = getattr(backend, "page_tokens", self.page_tokens)
            bn = getattr(backend, "num_blocks", self.scheduler.num_blocks)
            if bt != self.page_tokens or bn < self.scheduler.num_blocks:
                raise ValueError(
                    f"the model backend has {bn} pages of {bt} tokens; the scheduler needs "
                    f"{self.scheduler.num_blocks} pages of {self.page_tokens} tokens")
            self.backend = TimedBackend(backend)
            # prompt token ids must be in the model's vocabulary
            self.vocab = int(getattr(getattr(backend, "config", None), "vocab", 0) or 0) or None
            self._prompt_vocab = self.vocab
        else:
            self.backend = backend
            # the decode rule's vocabulary; any u32 prompt token id is fine
            self.vocab = int(vocab if vocab is not None else getattr(backend, "vocab", 32000))
            self._prompt_vocab = None
        self._can_copy = callable(getattr(self.backend, "copy_pages", None))
        self.on_complete = on_complete

        self.step_no = 0
        self._requests: Dict[int, Request] = {}
        self._arrivals: collections.deque = collections.deque()  # sorted by arrival step
        self._waiting: collections.deque = collections.deque()
        self._running: "collections.OrderedDict[int, _Live]" = collections.OrderedDict()
        self._completions: Dict[int, int] = {}
        self.outputs: Dict[int, List[int]] = {}
        self._sorted = True

        self._sched_s = 0.0  # facade time of the current step, backend time excluded
        self._backend_s = 0.0  # backend time of the current step
        self.round_sched_s: List[float] = []
        self.round_backend_s: List[float] = []
        self.c = collections.Counter()
        self.peak_pages = 0
        self.peak_running = 0
        self.wall_s = 0.0

    # -- properties ---------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.scheduler.num_blocks

    @property
    def pending(self) -> int:
        """Requests submitted and not yet completed."""
        return len(self._arrivals) + len(self._waiting) + len(self._running)

    # -- submission ---------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queue a request for its arrival step.  Raises ``ValueError`` for a request that can
        never be served (empty prompt, no tokens to generate, bad token ids, or more pages than
        the whole pool or a request's ``logical_pages``) and for a duplicate request id."""
        rid = int(request.request_id)
        if not 0 <= rid <= _U64_MAX:
            raise ValueError(f"request {rid}: request_id must be a u64")
        if rid in self._requests:
            raise ValueError(f"request {rid}: duplicate request id")
        prompt = [int(t) for t in request.prompt]
        if not prompt:
            raise ValueError(f"request {rid}: the prompt is empty")
        if int(request.max_new_tokens) < 1:
            raise ValueError(f"request {rid}: max_new_tokens must be >= 1")
        if self._prompt_vocab is not None and any(not 0 <= t < self._prompt_vocab
                                                  for t in prompt):
            raise ValueError(
                f"request {rid}: prompt token ids must be in [0, {self._prompt_vocab})")
        if any(not 0 <= t < 2**32 for t in prompt):
            raise ValueError(f"request {rid}: prompt token ids must be u32")
        if not 0 <= int(request.shared_prefix_len) <= len(prompt):
            raise ValueError(f"request {rid}: shared_prefix_len must be in [0, len(prompt)]")
        need = pages_needed(len(prompt), int(request.max_new_tokens), self.page_tokens)
        s = self.scheduler
        limits = []
        if need > s.num_blocks:
            limits.append(f"the whole pool has only {s.num_blocks} pages")
        if need > s.logical_pages:
            limits.append(f"a request may map at most logical_pages={s.logical_pages} pages")
        if limits:
            raise ValueError(
                f"request {rid} can never be served: prompt of {len(prompt)} tokens + "
                f"max_new_tokens={request.max_new_tokens} needs {need} pages of "
                f"{self.page_tokens} tokens, but " + " and ".join(limits))
        request = dataclasses.replace(request, request_id=rid, prompt=prompt,
                                      shared_prefix_len=int(request.shared_prefix_len),
                                      max_new_tokens=int(request.max_new_tokens),
                                      arrival_step=int(request.arrival_step))
        self._requests[rid] = request
        if self._arrivals and request.arrival_step < self._arrivals[-1].req.arrival_step:
            self._sorted = False
        self._arrivals.append(_Live(request))

    # -- timing helpers -----------------------------------------------------------------------

    def _call(self, fn, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self._sched_s += time.perf_counter() - t0

    def _backend_call(self, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._backend_s += time.perf_counter() - t0

    def _sample_pool(self) -> None:
        used = self.scheduler.num_blocks - self.scheduler.free_pages
        if used > self.peak_pages:
            self.peak_pages = used
        if len(self._running) > self.peak_running:
            self.peak_running = len(self._running)

    # -- the loop -----------------------------------------------------------------------------

    def run(self, requests: Iterable[Request] = (), *, check: bool = False) -> EngineResult:
        """Submit ``requests``, serve everything submitted to completion, verify the end state
        (every request completed exactly once, no request active, the pool holding only the
        prefix store's pages) and report."""
        for req in requests:
            self.submit(req)
        t0 = time.perf_counter()
        while self.pending:
            self.step()
        self.wall_s += time.perf_counter() - t0
        self.verify_end_state()
        result = EngineResult(self.stats(), dict(self.outputs))
        if check:
            t1 = time.perf_counter()
            result.check = self.check()
            result.stats["check_ok"] = result.check.ok
            result.stats["check_s"] = time.perf_counter() - t1
        return result

    def step(self) -> None:
        """One engine step: arrivals, admission + prefill, one decode round."""
        if not self._sorted:
            self._arrivals = collections.deque(
                sorted(self._arrivals, key=lambda lv: lv.req.arrival_step))
            self._sorted = True
        while self._arrivals and self._arrivals[0].req.arrival_step <= self.step_no:
            self._waiting.append(self._arrivals.popleft())
        if not self._waiting and not self._running:
            if self._arrivals:  # idle: jump to the next arrival
                self.c["idle_steps"] += self._arrivals[0].req.arrival_step - self.step_no
                self.step_no = self._arrivals[0].req.arrival_step
            return
        self._sched_s = 0.0
        self._backend_s = 0.0
        b0 = self.backend.seconds if self.is_model else 0.0
        self._admit_waiting()
        self._decode_round()
        if self.is_model:  # prefill, copies and the round, all through the timing proxy
            self._backend_s = self.backend.seconds - b0
        self.round_sched_s.append(self._sched_s)
        self.round_backend_s.append(self._backend_s)
        self.step_no += 1
        self.c["steps"] += 1

    # -- admission and prefill ----------------------------------------------------------------

    def _prefix_len(self, req: Request) -> int:
        return max(0, min(int(req.shared_prefix_len), len(req.prompt) - 1))

    def _admission_pages(self, live: _Live) -> int:
        """Free pages the head of the queue needs to be admitted: the pages its prefill
        allocates (less the full pages a prefix hit would share), plus one of headroom, capped
        at what the request needs at its peak."""
        s, pt = self.scheduler, self.page_tokens
        ctx = len(live.req.prompt) + max(0, len(live.generated) - 1)
        shared = 0
        plen = self._prefix_len(live.req)
        if plen:
            ident = s.identity_for(live.req.prompt, plen, live.req.namespace)
            if s.prefixes.contains(ident):
                shared = s.prefixes.tokens_of(ident) // pt
        total = pages_needed(len(live.req.prompt), live.req.max_new_tokens, pt)
        prefill_pages = -(-ctx // pt) - shared
        return max(0, min(prefill_pages + 1, total - shared))

    def _admit_waiting(self) -> None:
        s = self.scheduler
        while self._waiting and len(self._running) < s.max_requests:
            live = self._waiting[0]
            while True:
                need = self._admission_pages(live)
                if s.free_pages >= need:
                    break
                if self._call(s.evict_unused_lru) is None:
                    break
                self.c["evictions"] += 1
                self.c["evictions_for_pages"] += 1
            if s.free_pages < need:
                if not self._running:  # cannot happen: submit() rejects what cannot fit
                    raise RuntimeError(
                        f"engine stuck: request {live.req.request_id} needs {need} pages, "
                        f"{s.free_pages} free with nothing running")
                self.c["admission_waits"] += 1
                break  # first come, first served: the head of the queue waits
            self._waiting.popleft()
            if not self._prefill(live):
                break

    def _prefill(self, live: _Live) -> bool:
        """Admit ``live`` and prefill its context; returns False if it had to be put back."""
        s, req, rid = self.scheduler, live.req, live.req.request_id
        ctx = live.context()
        plen = self._prefix_len(req)
        if plen:
            adm = self._call(s.admit, rid, req.prompt, namespace=req.namespace, prefix_len=plen)
            self.c["prefix_lookups"] += 1
        else:
            adm = self._call(s.admit, rid)
        live.admissions += 1
        self._running[rid] = live
        start = int(adm.prefix_tokens) if adm.prefix_hit else 0
        if adm.prefix_hit:
            self.c["prefix_hits"] += 1
            self.c["prefix_tokens_reused"] += start
        if live.generated:
            self.c["recomputes"] += 1

        # _prefix_len() caps the looked-up prefix at len(prompt) - 1, so a hit always leaves
        # at least the last prompt token to prefill (its logits give the first token)
        assert start < len(ctx), "prefix hit covers the whole context"
        n = len(ctx) - start
        copies = self._reserve_for_prefill(live, n)
        if copies is None:
            return False
        self._copy(copies)
        token = self._first_token(rid, ctx[start:], start, ctx)
        self._call(s.advance, rid, n)
        self.c["tokens_prefilled"] += n
        if live.generated:
            self.c["tokens_recomputed"] += n

        if live.generated:  # recompute: the pending token is the one generated before
            if token != live.generated[-1]:
                self.c["recompute_mismatches"] += 1
            token = live.generated[-1]
        else:
            live.generated.append(int(token))
        self._call(s.complete_prefill, rid, token)
        self._publish(live)
        self._sample_pool()
        if live.finished(self.end_token):
            self._complete(live)
        return True

    def _first_token(self, rid: int, tokens: List[int], start: int, ctx: List[int]) -> int:
        if self.is_model:
            table = self._call(self.scheduler.block_table, rid)
            return int(self.backend.prefill(tokens, start, table))
        return hash_next_token(rid, len(ctx) - 1, ctx[-1], self.vocab)

    def _copy(self, copies) -> None:
        n = len(copies)
        if not n:
            return
        self.c["pages_copied_prefill"] += n
        if self._can_copy:
            if self.is_model:
                self.backend.copy_pages(copies)
            else:
                self._backend_call(self.backend.copy_pages, copies)

    def _reserve_for_prefill(self, live: _Live, n: int):
        s, rid = self.scheduler, live.req.request_id
        while True:
            try:
                return self._call(s.reserve, rid, n)
            except Exception as err:
                if not is_exhausted(err):
                    raise
            if self._call(s.evict_unused_lru) is not None:
                self.c["evictions"] += 1
                self.c["evictions_for_pages"] += 1
                continue
            if len(self._running) > 1:  # others hold the pages: wait for them
                self._rollback(live)
                return None
            if self._call(s.evict_lru) is not None:
                self.c["evictions"] += 1
                self.c["evictions_for_pages"] += 1
                continue
            raise RuntimeError(f"engine stuck: cannot reserve {n} pages for request {rid} alone")

    def _rollback(self, live: _Live) -> None:
        """Undo an admission that could not get its pages: back to the front of the queue."""
        self._call(self.scheduler.finish, live.req.request_id)
        del self._running[live.req.request_id]
        self._waiting.appendleft(live)
        self.c["admission_rollbacks"] += 1

    def _publish(self, live: _Live) -> None:
        s, req = self.scheduler, live.req
        plen = self._prefix_len(req)
        if not plen:
            return
        ident = self._call(s.identity_for, req.prompt, plen, req.namespace)
        if s.prefixes.contains(ident):
            return
        if -(-plen // self.page_tokens) > s.prefixes.max_pages:
            self.c["publish_skipped_too_long"] += 1
            return
        if len(s.prefixes) >= s.prefixes.capacity:
            victim = self._call(s.evict_unused_lru)
            if victim is None:
                victim = self._call(s.evict_lru)
            if victim is None:  # pragma: no cover - capacity >= 1
                return
            self.c["evictions"] += 1
            self.c["evictions_for_entries"] += 1
        self._call(s.publish_prefix, req.request_id, req.prompt, plen, req.namespace)
        self.c["prefixes_published"] += 1

    # -- decode -------------------------------------------------------------------------------

    def _decode_round(self) -> None:
        if not self._running:
            return
        s = self.scheduler
        while True:
            t0 = time.perf_counter()
            b0 = self.backend.seconds if self.is_model else 0.0
            failed = None
            try:
                receipt, outputs = s.decode(self.backend)
            except Exception as err:
                failed = err
            dt = time.perf_counter() - t0
            if self.is_model:
                self._sched_s += dt - (self.backend.seconds - b0)
            else:
                self._backend_s += dt
            if failed is None:
                break
            if not is_exhausted(failed):
                raise failed
            self.c["decode_exhausted"] += 1
            if not self._relieve_decode():
                raise RuntimeError("engine stuck: a decode round cannot get a page") from failed
        self.c["decode_rounds"] += 1
        self.c["decode_items"] += int(receipt.batch_size)
        ids = outputs["request_id"].tolist()
        tokens = outputs["next_token_id"].tolist()
        self._sample_pool()
        for rid, token in zip(ids, tokens):
            live = self._running[rid]
            live.generated.append(int(token))
            if live.finished(self.end_token):
                self._complete(live)

    def _relieve_decode(self) -> bool:
        s = self.scheduler
        if self._call(s.evict_unused_lru) is not None:
            self.c["evictions"] += 1
            self.c["evictions_for_pages"] += 1
            return True
        if len(self._running) > 1:
            self._preempt(next(reversed(self._running)))
            return True
        if self._call(s.evict_lru) is not None:
            self.c["evictions"] += 1
            self.c["evictions_for_pages"] += 1
            return True
        return False

    def _preempt(self, rid: int) -> None:
        live = self._running.pop(rid)
        self._call(self.scheduler.finish, rid)
        live.preemptions += 1
        self.c["preemptions"] += 1
        self._waiting.appendleft(live)

    def _complete(self, live: _Live) -> None:
        rid = live.req.request_id
        self._call(self.scheduler.finish, rid)
        del self._running[rid]
        live.done = True
        self._completions[rid] = self._completions.get(rid, 0) + 1
        self.outputs[rid] = list(live.generated)
        self.c["completed"] += 1
        if self.on_complete is not None:
            self.on_complete(rid, self.outputs[rid])

    # -- end state, check, stats --------------------------------------------------------------

    def store_pages(self) -> List[int]:
        """Every page the prefix store holds (once per entry occurrence)."""
        st = self.scheduler.prefixes
        return [p for ident in st.identities() for p in st.pages_of(ident)]

    def verify_end_state(self) -> None:
        """Raise ``RuntimeError`` unless every submitted request completed exactly once and
        the pool holds nothing but the prefix store's pages."""
        s = self.scheduler
        problems = []
        submitted = set(self._requests)
        done = set(self._completions)
        if submitted != done:
            missing = sorted(submitted - done)[:10]
            extra = sorted(done - submitted)[:10]
            problems.append(f"not completed: {missing}; unknown completed: {extra}")
        dup = sorted(r for r, n in self._completions.items() if n != 1)
        if dup:
            problems.append(f"completed more than once: {dup[:10]}")
        if self.pending:
            problems.append(f"{self.pending} requests still pending")
        if s.active_count != 0:
            problems.append(f"{s.active_count} requests still active in the scheduler")
        held = collections.Counter(self.store_pages())
        if s.free_pages + len(held) != s.num_blocks:
            problems.append(
                f"pool leak: {s.free_pages} free + {len(held)} store pages != {s.num_blocks}")
        for page, count in held.items():
            if s.pool.refcount(page) != count:
                problems.append(f"page {page}: refcount {s.pool.refcount(page)}, store holds "
                                f"{count}")
                break
        if problems:
            raise RuntimeError("engine end state is wrong: " + "; ".join(problems))

    def check(self, on_checked: Optional[Callable[[int], None]] = None) -> CheckResult:
        """Compare every completed request's tokens with an independent reference: the dense
        (unpaged) model for a model backend, the pure-Python decode rule for the reference
        backend.  ``on_checked(request_id)`` is called after each request."""
        mismatched = []
        if self.is_model:
            from .model import DenseModel

            if self.weights is None:
                raise ValueError("check needs the model backend's weights")
            dense = DenseModel(self.weights)
            against = "dense reference"
            for rid in sorted(self.outputs):
                req = self._requests[rid]
                want = dense.generate(req.prompt, req.max_new_tokens, self.end_token)
                if want != self.outputs[rid]:
                    mismatched.append(rid)
                if on_checked is not None:
                    on_checked(rid)
        else:
            against = "pure-Python reference decode rule"
            for rid in sorted(self.outputs):
                req = self._requests[rid]
                want = reference_generate(rid, req.prompt, req.max_new_tokens, self.end_token,
                                          self.vocab)
                if want != self.outputs[rid]:
                    mismatched.append(rid)
                if on_checked is not None:
                    on_checked(rid)
        n = len(self.outputs)
        ok = not mismatched and n == len(self._requests)
        return CheckResult(ok, n, mismatched, against)

    def pages_copied(self) -> int:
        """Copy-on-write page copies handed to the backend (prefill and decode), as counted by
        the facade."""
        return int(self.scheduler.stats().get("pages_copied", self.c["pages_copied_prefill"]))

    def stats(self) -> Dict[str, object]:
        s, c = self.scheduler, self.c
        lookups = c["prefix_lookups"]
        sched_us = [x * 1e6 for x in self.round_sched_s]
        back_us = [x * 1e6 for x in self.round_backend_s]
        generated = sum(len(v) for v in self.outputs.values())
        out = {
            "backend": "model" if self.is_model else type(self.raw_backend).__name__,
            "requests_submitted": len(self._requests),
            "requests_completed": c["completed"],
            "tokens_generated": generated,
            "tokens_prefilled": c["tokens_prefilled"],
            "tokens_recomputed": c["tokens_recomputed"],
            "decode_rounds": c["decode_rounds"],
            "decode_items": c["decode_items"],
            "mean_batch": (c["decode_items"] / c["decode_rounds"]) if c["decode_rounds"] else 0.0,
            "steps": c["steps"],
            "idle_steps": c["idle_steps"],
            "prefix_lookups": lookups,
            "prefix_hits": c["prefix_hits"],
            "prefix_hit_rate": (c["prefix_hits"] / lookups) if lookups else 0.0,
            "prefix_tokens_reused": c["prefix_tokens_reused"],
            "prefixes_published": c["prefixes_published"],
            "pages_copied": self.pages_copied(),
            "pages_copied_prefill": c["pages_copied_prefill"],
            "evictions": c["evictions"],
            "evictions_for_pages": c["evictions_for_pages"],
            "evictions_for_entries": c["evictions_for_entries"],
            "preemptions": c["preemptions"],
            "recomputes": c["recomputes"],
            "recompute_mismatches": c["recompute_mismatches"],
            "admission_waits": c["admission_waits"],
            "admission_rollbacks": c["admission_rollbacks"],
            "decode_exhausted": c["decode_exhausted"],
            "num_blocks": s.num_blocks,
            "page_tokens": self.page_tokens,
            "max_requests": s.max_requests,
            "peak_pages_used": self.peak_pages,
            "peak_pool_use": self.peak_pages / s.num_blocks,
            "peak_running": self.peak_running,
            "store_entries_at_end": len(s.prefixes),
            "store_pages_at_end": len(set(self.store_pages())),
            "free_pages_at_end": s.free_pages,
            "sched_us_per_round_p50": _percentile(sched_us, 50),
            "sched_us_per_round_p99": _percentile(sched_us, 99),
            "sched_s_total": sum(self.round_sched_s),
            "backend_us_per_round_p50": _percentile(back_us, 50),
            "backend_us_per_round_p99": _percentile(back_us, 99),
            "backend_s_total": sum(self.round_backend_s),
            "backend_time_is": ("time inside execute_ragged/prefill/copy_pages" if self.is_model
                                else "time of the Scheduler.decode call"),
            "wall_s": self.wall_s,
        }
        return out
