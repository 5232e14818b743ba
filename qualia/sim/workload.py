"""Requests and synthetic traces: what ``python -m qualia simulate`` serves.

:class:`Workload` makes a reproducible synthetic trace: ``N`` requests with Poisson arrivals
(``arrival_rate`` requests per second), prompt and output lengths drawn from clipped
uniform or lognormal distributions, ``K`` shared system prompts that a fraction
(``share_ratio``) of the prompts start with, and ``T`` tenants, each with its own prefix-cache
namespace (``b"tenant-3"``): two tenants never share KV pages, even for the same system prompt.
With ``turns > 1`` every request opens a conversation: when a turn completes, the next turn's
prompt is the previous prompt + its answer + a new user message (:meth:`Workload.next_turn`),
arriving as soon as the previous turn's last token did, so automatic prefix caching can reuse the
previous turn's answer too.

Real traces are in :mod:`qualia.sim.trace`.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import numbers
import operator
from dataclasses import asdict, dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

__all__ = ["Request", "Workload", "Arrivals", "UnservableRequest", "checked_request",
           "pages_needed", "unservable_reason", "MAX_ARRIVAL_S"]

#: The latest arrival a request may have, in seconds (about 31.7 years): past it, a float
#: second count cannot add a step's microseconds (the serving clock would stop).  An arrival
#: rate so small that a workload's last arrival comes later is refused (``Workload.generate``
#: raises ``ValueError``), a trace may span no more (its arrivals start at 0), and
#: :func:`checked_request` refuses a later ``arrival_s``.
MAX_ARRIVAL_S = 1e9


@dataclass(eq=False)
class Request:
    """One request of a trace.

    ``prompt`` is a list of token ids (or a uint32 numpy array: a :class:`Trace`'s prompts);
    ``shared_prefix_len`` is the length of the prompt's
    cacheable prefix (its system prompt; 0 for none); ``arrival_s`` is the time in seconds since
    the start of the run at which it arrives (None: when the engine reaches ``arrival_step``);
    ``arrival_step`` is the first engine step it may arrive at (0 for a workload's first turns
    and a trace's rows, which arrive by time).  ``namespace``
    (``b"tenant-<tenant>"``) scopes the prefix cache."""

    request_id: int
    """The request's id."""
    tenant: int
    """The tenant, which names the cache namespace."""
    prompt: Union[List[int], np.ndarray]
    shared_prefix_len: int
    max_new_tokens: int
    """Tokens to generate at most."""
    arrival_step: int = 0
    system_prompt: Optional[int] = None
    """The index of the system prompt the prompt opens with, None for none."""
    conversation: Optional[int] = None
    """The conversation a turn belongs to, None for none."""
    turn: int = 0
    """0 for the first turn of a conversation."""
    arrival_s: Optional[float] = None
    """Seconds since the start of the run, None: by step."""

    @property
    def namespace(self) -> bytes:
        """The prefix cache's namespace of the request: ``b"tenant-<tenant>"``."""
        return f"tenant-{self.tenant}".encode()

    def to_dict(self) -> dict:
        """The request as a dict of plain values (the prompt as a list of ints)."""
        d = asdict(self)
        d["prompt"] = [int(t) for t in np.asarray(self.prompt).tolist()]
        return d


class Arrivals:
    """Requests that have not arrived yet, for an engine (or a router) that steps a serving
    clock.  A request is due once the engine has reached its ``arrival_step`` and the serving
    clock its ``arrival_s`` (None: no time to wait for); :meth:`due` hands out the due ones by
    arrival time, then in the order they were added.  ``push(request, item)`` keeps ``item``
    (default: the request) for it."""

    def __init__(self) -> None:
        self._order = itertools.count()
        self._by_step: List[Tuple[int, int, Any, Request]] = []  # not yet at their step
        self._by_time: List[Tuple[float, int, Any]] = []  # at their step: by arrival time

    def push(self, request: Request, item: Any = None) -> None:
        heapq.heappush(self._by_step, (int(request.arrival_step), next(self._order),
                                       request if item is None else item, request))

    def __len__(self) -> int:
        return len(self._by_step) + len(self._by_time)

    def has_due(self, step: int, now: float) -> bool:
        """Whether :meth:`due` at engine step ``step`` and serving time ``now`` would hand out
        a request or move one to wait for its time (a test of the heads of two heaps)."""
        by_step, by_time = self._by_step, self._by_time
        return bool((by_step and by_step[0][0] <= step) or (by_time and by_time[0][0] <= now))

    def horizon(self) -> Tuple[float, float]:
        """The engine step and the serving time from which :meth:`has_due` holds: ``has_due(step,
        now)`` is ``step >= horizon()[0] or now >= horizon()[1]`` until the next :meth:`push` or
        :meth:`due` (``inf`` where no request waits)."""
        by_step, by_time = self._by_step, self._by_time
        return (by_step[0][0] if by_step else math.inf, by_time[0][0] if by_time else math.inf)

    def _reach(self, step: int) -> None:
        """Move the requests whose ``arrival_step`` engine step ``step`` reached to wait for
        their time."""
        by_step, by_time = self._by_step, self._by_time
        while by_step and by_step[0][0] <= step:
            _, order, item, request = heapq.heappop(by_step)
            at = -math.inf if request.arrival_s is None else float(request.arrival_s)
            heapq.heappush(by_time, (at, order, item))

    def due(self, step: int, now: float) -> List[Any]:
        """The items of the requests due at engine step ``step`` and serving time ``now``."""
        self._reach(step)
        by_time = self._by_time
        out = []
        while by_time and by_time[0][0] <= now:
            out.append(heapq.heappop(by_time)[2])
        return out

    def next_event(self, step: int, now: float) -> Tuple[int, float]:
        """Where an engine with nothing to do at engine step ``step`` skips to: the serving
        time of the earliest request whose ``arrival_step`` ``step`` reached (one pushed at a
        step already reached counts, not only those :meth:`due` moved), or else the step of the
        earliest request by step (its time, if it has one, is skipped to once that step is
        reached).  ``(step, now)`` when nothing waits."""
        self._reach(step)
        if self._by_time:
            return step, max(now, self._by_time[0][0])
        if self._by_step:
            return max(step, self._by_step[0][0]), now
        return step, now


class UnservableRequest(ValueError):
    """A request that needs more pages than the whole pool or than ``logical_pages``, or that
    arrives after :data:`MAX_ARRIVAL_S`; ``option_message`` says so in the command line's
    option names."""

    def __init__(self, message: str, option_message: Optional[str] = None) -> None:
        super().__init__(message)
        self.option_message = message if option_message is None else option_message


def pages_needed(prompt_len: int, max_new_tokens: int, page_tokens: int) -> int:
    """Pages a request occupies at its peak: the K/V of the prompt and of every generated token
    but the last (which is never fed back)."""
    positions = prompt_len + max(max_new_tokens, 1) - 1
    return -(-positions // page_tokens)


def unservable_reason(what: str, prompt_len: int, max_new_tokens: int, *, page_tokens: int,
                      num_pages: int, logical_pages: int,
                      beam_width: Optional[int] = None, options: bool = False) -> Optional[str]:
    """Why a request (``what``: "request 7", ...) with a prompt of ``prompt_len`` tokens and
    ``max_new_tokens`` can never be served by a step scheduler of ``num_pages`` pages of
    ``page_tokens`` tokens and ``logical_pages`` pages per request (with ``beam_width`` beams
    side by side), or None when it can.  Pure arithmetic on the lengths: a trace's rows are
    checked with it before their prompts are drawn.  The scheduler's own rules: the pages of its
    peak (:func:`pages_needed`) fit the pool and a request's table, and its prompt and every new
    token fit the table's ``logical_pages x page_tokens`` tokens.  ``options``: the message
    names the command line's options (``--logical-pages``) instead of the keywords."""
    need = pages_needed(prompt_len, max_new_tokens, page_tokens)
    if options:
        asked = f"a prompt of {prompt_len} tokens and an output of {max_new_tokens} tokens"
        pool = f"the pool has only {num_pages} pages (--num-pages)"
        table_limit = f"a request may map at most {logical_pages} pages (--logical-pages)"
        product = "--logical-pages x --page-tokens"
        pages = f"{need} pages of {page_tokens} tokens (--page-tokens)"
    else:
        asked = f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens}"
        pool = f"the whole pool has only {num_pages} pages"
        table_limit = f"a request may map at most logical_pages={logical_pages} pages"
        product = "logical_pages x page_tokens"
        pages = f"{need} pages of {page_tokens} tokens"
    limits = []
    if need > num_pages:
        limits.append(pool)
    if need > logical_pages:
        limits.append(table_limit)
    if limits:
        return f"{what} can never be served: {asked} need {pages}, but " + " and ".join(limits)
    table = logical_pages * page_tokens
    if prompt_len + max_new_tokens > table:  # the scheduler holds every token, the last one too
        return (f"{what} can never be served: {asked} are more than the {table} tokens a "
                f"request may hold ({product})")
    if beam_width is not None:  # the beams are computed side by side
        pt, w = page_tokens, beam_width
        tail = -(-(prompt_len + max_new_tokens - 1) // pt) - prompt_len // pt
        beams = prompt_len // pt + w * tail
        if beams > num_pages:
            where = " (--num-pages)" if options else ""
            return (f"{what} can never be served: its {w} beams need {beams} pages side by "
                    f"side (the prompt's full pages once, each beam's own tail), the pool has "
                    f"{num_pages}{where}")
    return None


def _is_integer(value: Any) -> bool:
    """Whether ``value`` is an integer (``int``, a numpy integer, an object with
    ``__index__``; not a bool)."""
    if isinstance(value, (bool, np.bool_)):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _checked_prompt(rid: int, prompt, vocab: Optional[int]) -> np.ndarray:
    """A request's prompt as a uint32 numpy array, checked without a Python loop over its
    tokens (a list of ints goes through one conversion): ``TypeError`` for what is not a 1-D
    sequence of integers, ``ValueError`` for an integer outside the token ids."""
    limit = 2**32 if vocab is None else min(int(vocab), 2**32)
    what = "u32" if vocab is None else f"in [0, {vocab})"
    not_ids = TypeError(f"request {rid}: prompt token ids must be a 1-D sequence of integers, "
                        f"got {type(prompt).__name__}")
    if isinstance(prompt, np.ndarray):
        arr = prompt
    else:
        if isinstance(prompt, (str, bytes, dict)):
            raise not_ids
        try:
            arr = np.array(prompt if isinstance(prompt, (list, tuple)) else list(prompt))
        except OverflowError:
            raise ValueError(f"request {rid}: prompt token ids must be {what}") from None
        except (TypeError, ValueError):  # not iterable, or ragged
            raise not_ids from None
    if arr.ndim != 1:
        raise not_ids
    if arr.dtype == object:  # ints past int64, or objects that are not all integers
        if not all(_is_integer(v) for v in arr):
            raise not_ids
        raise ValueError(f"request {rid}: prompt token ids must be {what}")
    if arr.size and arr.dtype.kind not in "ui":
        raise not_ids
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= limit):
        raise ValueError(f"request {rid}: prompt token ids must be {what}")
    return np.ascontiguousarray(arr, dtype=np.uint32)


def _integer(what: str, name: str, value: Any, low: Optional[int] = 0) -> int:
    """``value`` as a plain ``int``: an integer (``int``, a numpy integer or an object with
    ``__index__``; not a bool) of at least ``low`` (None: any; the caller checks its range).
    ``TypeError`` for any other type, ``ValueError`` below ``low``; ``what`` ("request 7", or
    "" before the request's id is known) and ``name`` make the message."""
    field = f"{what}: {name}" if what else name
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{field} must be an integer, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{field} must be an integer, got {value!r}") from None
    if low is not None and n < low:
        raise ValueError(f"{field} must be an integer >= {low}, got {n}")
    return n


def _is_real(value: Any) -> bool:
    """Whether ``value`` is a real number (``int``, ``float``, numpy numbers; not a bool)."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _optional_integer(what: str, name: str, value: Any) -> Optional[int]:
    return None if value is None else _integer(what, name, value)


def checked_request(request: Request, *, page_tokens: int, num_pages: int, logical_pages: int,
                    vocab: Optional[int] = None) -> Request:
    """``request`` with plain ``int`` and ``float`` fields and its prompt as a uint32 numpy
    array, once it is known servable by a scheduler of ``num_pages`` pages of
    ``page_tokens`` tokens and ``logical_pages`` pages per request.  Raises
    :class:`UnservableRequest` (a ``ValueError``) for a request that needs more pages than
    either or more tokens than a request's table holds (:func:`unservable_reason`), or whose
    ``arrival_s`` comes after :data:`MAX_ARRIVAL_S` (the latest arrival a run may have).

    Every field has its type, nothing is rounded or parsed: ``request_id``, ``tenant``,
    ``shared_prefix_len``, ``max_new_tokens``, ``arrival_step`` and ``turn`` (and
    ``system_prompt`` and ``conversation`` unless None) are integers (``int``, numpy integers,
    objects with ``__index__``; not bools, floats or strings), ``arrival_s`` is None or a real
    number (``int``, ``float``, numpy numbers; not a bool or a string), and the prompt a 1-D
    sequence of integers (not floats, a string, None or rows), else ``TypeError`` naming the
    field.  ``ValueError`` for a request id that is not a u64, a negative
    ``tenant``, ``arrival_step``, ``turn``, ``system_prompt`` or ``conversation``, an empty
    prompt, no tokens to generate (``max_new_tokens`` < 1), ``shared_prefix_len`` outside
    ``[0, len(prompt)]``, a token id outside ``[0, vocab)`` (u32 when ``vocab`` is None) or an
    arrival time that is not a finite number >= 0 (NaN, inf)."""
    rid = _integer("", "request_id", request.request_id, low=None)
    if not 0 <= rid <= 2**64 - 1:
        raise ValueError(f"request {rid}: request_id must be a u64")
    what = f"request {rid}"
    tenant = _integer(what, "tenant", request.tenant)
    max_new = _integer(what, "max_new_tokens", request.max_new_tokens, low=None)
    shared = _integer(what, "shared_prefix_len", request.shared_prefix_len, low=None)
    arrival_step = _integer(what, "arrival_step", request.arrival_step)
    turn = _integer(what, "turn", request.turn)
    system_prompt = _optional_integer(what, "system_prompt", request.system_prompt)
    conversation = _optional_integer(what, "conversation", request.conversation)
    arrival_s = request.arrival_s
    if arrival_s is not None:
        if not _is_real(arrival_s):
            raise TypeError(f"{what}: arrival_s must be a number of seconds or None, "
                            f"got {arrival_s!r}")
        arrival_s = float(arrival_s)
        if not 0.0 <= arrival_s < math.inf:
            raise ValueError(f"{what}: arrival_s must be a finite number >= 0, got {arrival_s}")
        if arrival_s > MAX_ARRIVAL_S:
            raise UnservableRequest(f"{what}: arrival_s must be at most {MAX_ARRIVAL_S:g} s "
                                    f"(the latest arrival a run may have), got {arrival_s:g}")
    prompt = _checked_prompt(rid, request.prompt, vocab)
    if not len(prompt):
        raise ValueError(f"{what}: the prompt is empty")
    if max_new < 1:
        raise ValueError(f"{what}: max_new_tokens must be >= 1, got {max_new}")
    if not 0 <= shared <= len(prompt):
        raise ValueError(f"{what}: shared_prefix_len must be in [0, len(prompt)] "
                         f"= [0, {len(prompt)}], got {shared}")

    def why_not(options: bool) -> Optional[str]:
        return unservable_reason(what, len(prompt), max_new, page_tokens=page_tokens,
                                 num_pages=num_pages, logical_pages=logical_pages,
                                 options=options)

    why = why_not(False)
    if why is not None:
        raise UnservableRequest(why, why_not(True))
    return dataclasses.replace(request, request_id=rid, tenant=tenant, prompt=prompt,
                               shared_prefix_len=shared, max_new_tokens=max_new,
                               arrival_step=arrival_step, turn=turn,
                               system_prompt=system_prompt, conversation=conversation,
                               arrival_s=arrival_s)


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
    clipped to the range).  ``eos_token_id`` (optional) is the id that ends a generation; it never
    appears in a prompt (pass the same id to the engine).  A shared prompt is one of the
    ``system_prompts`` system prompts (each ``system_prompt_len`` tokens, the same token ids for
    every tenant) followed by the user's part; its total length is drawn like any other prompt
    but is at least ``system_prompt_len + 1``.  Token ids are drawn uniformly from
    ``[0, vocab)``.  ``seed`` is any non-negative integer.  ``arrival_rate`` is in requests per
    second of the serving clock (a Poisson process: exponential gaps), ``inf`` for everything at
    0 s; a rate so small that the last arrival would come after :data:`MAX_ARRIVAL_S` seconds
    is refused by :meth:`generate`.

    ``turns`` (>= 1) is the number of turns of each conversation: :meth:`generate` makes the
    ``requests`` first turns; each later turn is made by :meth:`next_turn` when the previous one
    completes (its prompt: the previous prompt, the answer less a final end token, and a new
    user message of ``user_len`` tokens; it arrives when the previous turn completed, and
    reaches the scheduler at the next step).  ``requests`` with ``turns`` is ``requests x
    turns`` requests in all (:attr:`total_requests`), less the turns of conversations that
    outgrow a request's table.  Turn ``t`` of
    conversation ``c`` has request id ``first_request_id + t * requests + c``."""

    requests: int = 48
    seed: int = 0
    arrival_rate: float = 1.0
    prompt_len: Tuple[int, int] = (24, 96)
    output_len: Tuple[int, int] = (16, 48)
    system_prompts: int = 4
    system_prompt_len: int = 40
    share_ratio: float = 0.75
    """The share of first turns whose prompt opens with a system prompt."""
    tenants: int = 2
    """Tenants the requests are spread over (each a cache namespace)."""
    vocab: int = 512
    length_dist: str = "uniform"
    first_request_id: int = 0
    eos_token_id: Optional[int] = None
    turns: int = 1
    user_len: Tuple[int, int] = (8, 32)

    def __post_init__(self) -> None:
        self.user_len = _length_range(self.user_len, "user_len")
        if isinstance(self.turns, bool) or not isinstance(self.turns, int) or self.turns < 1:
            raise ValueError(f"turns must be an integer >= 1, got {self.turns!r}")
        self.prompt_len = _length_range(self.prompt_len, "prompt_len")
        self.output_len = _length_range(self.output_len, "output_len")
        if self.requests < 0:
            raise ValueError("requests must be >= 0")
        try:
            seed = None if isinstance(self.seed, bool) else operator.index(self.seed)
        except TypeError:
            seed = None
        if seed is None or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if not self.arrival_rate > 0:  # also refuses nan
            raise ValueError("arrival_rate must be > 0 (requests per second; inf: all at 0 s)")
        if self.system_prompts < 0 or self.tenants < 1 or self.vocab < 1:
            raise ValueError("system_prompts must be >= 0, tenants and vocab >= 1")
        if not 0.0 <= self.share_ratio <= 1.0:
            raise ValueError("share_ratio must be in [0, 1]")
        if self.system_prompts and self.system_prompt_len < 1:
            raise ValueError("system_prompt_len must be >= 1")
        if self.length_dist not in ("uniform", "lognormal"):
            raise ValueError("length_dist must be 'uniform' or 'lognormal'")
        if self.eos_token_id is not None and not 0 <= self.eos_token_id < self.vocab:
            raise ValueError(f"eos_token_id must be in [0, {self.vocab}), got {self.eos_token_id}")
        if self.eos_token_id is not None and self.vocab < 2:
            raise ValueError("an end token needs vocab >= 2")

    def memory_estimate(self) -> int:
        """Rough bytes the trace takes once generated and served: the prompts (a Python int and
        list slots per token), the outputs and per-request bookkeeping, at the mean lengths."""
        mean_prompt = max(sum(self.prompt_len) / 2, self.system_prompt_len if self.system_prompts
                          else 0)
        mean_output = sum(self.output_len) / 2
        mean_user = sum(self.user_len) / 2
        per_turn = [mean_prompt + t * (mean_output + mean_user) for t in range(self.turns)]
        return int(self.requests * sum(48 * p + 52 * mean_output + 700 for p in per_turn))

    def _tokens(self, rng: np.random.Generator, n: int) -> List[int]:
        toks = rng.integers(0, self.vocab, size=n)
        if self.eos_token_id is not None:  # prompts never hold the end token
            toks[toks == self.eos_token_id] = (self.eos_token_id + 1) % self.vocab
        return toks.tolist()

    def _lengths(self, rng: np.random.Generator, rng_range: Tuple[int, int], n: int) -> np.ndarray:
        lo, hi = rng_range
        if self.length_dist == "uniform":
            return rng.integers(lo, hi + 1, size=n)
        median = math.sqrt(lo * hi)
        values = np.rint(rng.lognormal(math.log(median), 0.5, size=n))
        return np.clip(values, lo, hi).astype(np.int64)

    @property
    def total_requests(self) -> int:
        """Requests in all when every conversation runs its ``turns``: ``requests x turns``."""
        return self.requests * self.turns

    def _arrivals(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Arrival times in seconds: a Poisson process of ``arrival_rate`` per second."""
        if math.isinf(self.arrival_rate):
            return np.zeros(n, dtype=np.float64)
        with np.errstate(over="ignore"):
            times = np.cumsum(rng.exponential(1.0 / self.arrival_rate, size=n))
        if n and not times[-1] <= MAX_ARRIVAL_S:  # inf too
            raise ValueError(
                f"arrival_rate={self.arrival_rate!r} is too small: the last of {n} arrivals "
                f"would come after {MAX_ARRIVAL_S:g} s")
        return times

    def system_prompt_tokens(self) -> List[List[int]]:
        """The ``K`` system prompts (drawn from their own stream of the seed)."""
        rng = np.random.default_rng([self.seed, 1])
        return [self._tokens(rng, self.system_prompt_len) for _ in range(self.system_prompts)]

    def generate(self) -> List[Request]:
        """The ``requests`` first turns, by request id, with their arrival times; the same list for
        the same fields and seed."""
        n = self.requests
        rng = np.random.default_rng([self.seed, 0])
        systems = self.system_prompt_tokens()
        arrivals = self._arrivals(rng, n)
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
                arrival_step=0,
                system_prompt=sp,
                arrival_s=float(arrivals[i]),
                conversation=i,
            ))
        return out

    def next_turn(self, request: Request, answer: Sequence[int], step: int,
                  arrival_s: Optional[float] = None) -> Optional[Request]:
        """The turn after ``request`` (which completed at ``step``, at ``arrival_s`` seconds,
        with ``answer``), or None when its conversation has no more turns.  It arrives at
        ``arrival_s`` (None: by step) and at the earliest at step ``step + 1``.  Deterministic:
        drawn from the seed, the conversation and the turn."""
        c, t = request.conversation, int(request.turn) + 1
        if c is None or t >= self.turns:
            return None
        rng = np.random.default_rng([int(self.seed), 2, int(c), t])
        said = [int(x) for x in answer]
        if said and self.eos_token_id is not None and said[-1] == self.eos_token_id:
            said.pop()  # prompts never hold the end token
        user = self._tokens(rng, int(self._lengths(rng, self.user_len, 1)[0]))
        return Request(
            request_id=self.first_request_id + t * self.requests + int(c),
            tenant=request.tenant,
            prompt=[int(x) for x in np.asarray(request.prompt).tolist()] + said + user,
            shared_prefix_len=request.shared_prefix_len,
            max_new_tokens=int(self._lengths(rng, self.output_len, 1)[0]),
            arrival_step=int(step) + 1,
            system_prompt=request.system_prompt,
            conversation=int(c),
            turn=t,
            arrival_s=None if arrival_s is None else float(arrival_s),
        )

    __call__ = generate

    def __iter__(self):
        return iter(self.generate())
