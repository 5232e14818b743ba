"""Serving figures under the names and definitions of vLLM's ``vllm bench serve``.

A serving benchmark is compared by a small set of figures; vLLM's benchmark (and SGLang's,
which follows it) computes them from each request's stream of tokens as the client saw it.
:func:`serving_figures` computes the same figures, under the same keys, from
:class:`RequestRecord` s: when a request arrived, when each of its output tokens came, and its
token counts.  The definitions are vLLM's (``vllm/benchmarks/serve.py``, ``calculate_metrics``,
and the streaming request functions that time the chunks):

* ``ttft``, time to first token: the first token's time minus the arrival;
* ``e2el``, end-to-end latency: the last token's time minus the arrival;
* ``tpot``, time per output token after the first: ``(e2el - ttft) / (output_tokens - 1)``, one
  value per request of more than one output token (a one-token request has none);
* ``itl``, inter-token latency: every gap between consecutive tokens of a request, pooled over
  all requests (so a long answer weighs by its number of tokens, where ``tpot`` weighs each
  request once);
* ``duration``: from the start of the run (the moment arrivals are counted from; by default
  the earliest arrival) to the last token of the last request;
* ``completed``, ``total_input_tokens``, ``total_output_tokens``; ``request_throughput =
  completed / duration``, ``output_throughput = total_output_tokens / duration``,
  ``total_token_throughput = (total_input_tokens + total_output_tokens) / duration``;
* ``mean_``, ``median_``, ``std_`` and ``p99_`` (each of ``percentiles``) of ``ttft``, ``tpot``,
  ``itl`` and ``e2el``, in milliseconds: numpy's mean, median, standard deviation (population,
  ``ddof=0``) and percentile (linear interpolation); an empty list counts as ``[0]``, as in vLLM;
* ``max_concurrent_requests``: the most requests in flight at once (between arrival and last
  token, half-open: one leaving and one arriving at the same instant do not overlap);
* ``max_output_tokens_per_s``: the most output tokens in one whole second, seconds counted from
  the earliest arrival.

The inter-token figures need every token's time (``token_times_s``); from records with only the
first and last token's times and the count, :func:`serving_figures` leaves the ``itl`` figures
and ``max_output_tokens_per_s`` out rather than guess them.  In vLLM every streamed chunk is one
gap; a simulated engine step streams one token per sequence, so chunks are tokens.

The prefix cache's hit rate (:func:`prefix_cache_hit_rate`) is vLLM's engine metric: prompt
tokens found in the cache over prompt tokens looked up.

:func:`request_rows` gives the per-request records a report saves; :func:`vllm_result` the
dictionary vLLM's ``--save-result`` writes (the figures and its per-request lists, in seconds),
for tools that read vLLM's results; :func:`summary_lines` a table in vLLM's layout.
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

__all__ = [
    "RequestRecord",
    "serving_figures",
    "request_rows",
    "vllm_result",
    "summary_lines",
    "prefix_cache_hit_rate",
    "METRICS",
]

#: The latency figures, in vLLM's order, with vLLM's labels.
METRICS: Tuple[Tuple[str, str, str], ...] = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)

Number = Union[int, float]


def _time(name: str, value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return v


def _times(name: str, values: Any) -> Tuple[float, ...]:
    """``values`` as a tuple of finite floats: a 1-D float64 numpy array is checked at once,
    any other iterable number by number (:func:`_time`)."""
    if isinstance(values, np.ndarray) and values.dtype == np.float64 and values.ndim == 1:
        bad = np.flatnonzero(~np.isfinite(values))
        if len(bad):
            _time(name, values[bad[0]])
        return tuple(values.tolist())
    return tuple(_time(name, t) for t in values)


def _decreases(given: Any, times: Tuple[float, ...]) -> bool:
    """Whether ``times`` (``given`` as :func:`_times` returned it) ever goes down."""
    if isinstance(given, np.ndarray) and len(given) == len(times):
        return bool((given[1:] < given[:-1]).any())
    return any(b < a for a, b in zip(times, times[1:]))


def _count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, not bool")
    try:
        v = int(operator.index(value))
    except TypeError:
        raise TypeError(f"{name} must be an int, not {type(value).__name__}") from None
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


class _TokenTimes:
    """The ``token_times_s`` field of :class:`RequestRecord` (a descriptor, the field's default
    None): the tuple it was given, or, for a record an engine made, a tuple made on the first
    read from the float64 array the record keeps (``_token_array``)."""

    def __get__(self, record: Any, owner: Any = None) -> Optional[Tuple[float, ...]]:
        if record is None:  # the field's default
            return None
        d = record.__dict__
        times = d.get("_token_times_s", d)
        if times is d:
            times = d["_token_times_s"] = tuple(d["_token_array"].tolist())
        return times

    def __set__(self, record: Any, value: Optional[Tuple[float, ...]]) -> None:
        record.__dict__["_token_times_s"] = value


def _token_array(record: "RequestRecord") -> Optional[np.ndarray]:
    """The token times an engine's record keeps as an array (None: a record made otherwise)."""
    return record.__dict__.get("_token_array")


@dataclass(frozen=True)
class RequestRecord:
    """One completed request as its client saw it (times in seconds on one clock):
    ``arrival_s`` (sent), ``first_token_s``, ``finish_s`` (its last token), ``input_tokens``
    and ``output_tokens``, and, when known, every output token's time ``token_times_s``
    (non-decreasing; its first is ``first_token_s`` and its last ``finish_s``).
    :meth:`from_token_times` builds one from the token times alone."""

    request_id: int
    """The request's id."""
    arrival_s: float
    first_token_s: float
    finish_s: float
    input_tokens: int
    output_tokens: int
    token_times_s: Optional[Tuple[float, ...]] = _TokenTimes()  # type: ignore[assignment]

    def __post_init__(self) -> None:
        rid = f"request {self.request_id!r}"
        object.__setattr__(self, "request_id", _count("request_id", self.request_id, 0))
        for f in ("arrival_s", "first_token_s", "finish_s"):
            object.__setattr__(self, f, _time(f"{rid}: {f}", getattr(self, f)))
        object.__setattr__(self, "input_tokens",
                           _count(f"{rid}: input_tokens", self.input_tokens, 0))
        object.__setattr__(self, "output_tokens",
                           _count(f"{rid}: output_tokens", self.output_tokens, 1))
        if not self.arrival_s <= self.first_token_s <= self.finish_s:
            raise ValueError(f"{rid}: expected arrival_s <= first_token_s <= finish_s, got "
                             f"{self.arrival_s!r}, {self.first_token_s!r}, {self.finish_s!r}")
        if self.output_tokens == 1 and self.finish_s != self.first_token_s:
            raise ValueError(f"{rid}: one output token, but first_token_s "
                             f"{self.first_token_s!r} and finish_s {self.finish_s!r} differ")
        if self.token_times_s is not None:
            times = _times(f"{rid}: token_times_s", self.token_times_s)
            if len(times) != self.output_tokens:
                raise ValueError(f"{rid}: {len(times)} token times for {self.output_tokens} "
                                 f"output tokens")
            if times[0] != self.first_token_s or times[-1] != self.finish_s:
                raise ValueError(f"{rid}: token_times_s must start at first_token_s and end at "
                                 f"finish_s")
            if _decreases(self.token_times_s, times):
                raise ValueError(f"{rid}: token_times_s must not decrease")
            object.__setattr__(self, "token_times_s", times)

    @classmethod
    def _from_engine(cls, request_id: int, arrival_s: float, input_tokens: int,
                     token_times_s: np.ndarray) -> "RequestRecord":
        """A record an engine made from its own books: ``request_id`` an ``int``,
        ``arrival_s`` a ``float`` at most the first token time, ``input_tokens`` an ``int``,
        and the token times a non-empty read-only float64 array read off its serving clock,
        which never goes back.  They are taken as they are, without the checks of the
        constructor (one of them per token); the record keeps the array, for
        :func:`serving_figures`, and makes ``token_times_s`` from it when it is read."""
        r = object.__new__(cls)
        r.__dict__.update(request_id=request_id, arrival_s=arrival_s,
                          first_token_s=float(token_times_s[0]),
                          finish_s=float(token_times_s[-1]), input_tokens=input_tokens,
                          output_tokens=len(token_times_s), _token_array=token_times_s)
        return r

    @classmethod
    def from_token_times(cls, request_id: int, arrival_s: float, input_tokens: int,
                         token_times_s: Iterable[float]) -> "RequestRecord":
        """A record from each output token's time (at least one)."""
        times = tuple(token_times_s)
        if not times:
            raise ValueError(f"request {request_id!r}: no output token")
        return cls(request_id, arrival_s, times[0], times[-1], input_tokens, len(times), times)

    @property
    def ttft_s(self) -> float:
        """Time to first token."""
        return self.first_token_s - self.arrival_s

    @property
    def e2el_s(self) -> float:
        """End-to-end latency: arrival to the last token."""
        return self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> Optional[float]:
        """Time per output token after the first (None for a one-token answer)."""
        if self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> Optional[Tuple[float, ...]]:
        """The gaps between consecutive tokens (None without token times)."""
        t = self.token_times_s
        return None if t is None else tuple(b - a for a, b in zip(t, t[1:]))


def _records(records: Iterable[RequestRecord]) -> List[RequestRecord]:
    out = list(records)
    seen = set()
    for r in out:
        if not isinstance(r, RequestRecord):
            raise TypeError(f"expected RequestRecord, not {type(r).__name__}")
        if r.request_id in seen:
            raise ValueError(f"request {r.request_id}: recorded twice")
        seen.add(r.request_id)
    return out


def _percentile_key(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def _stats(name: str, values_s: Sequence[float], percentiles: Sequence[float]
           ) -> Dict[str, float]:
    """vLLM's statistics of one latency list, in milliseconds (an empty list counts as
    ``[0]``)."""
    x = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000.0
    out = {f"mean_{name}_ms": float(np.mean(x)),
           f"median_{name}_ms": float(np.median(x)),
           f"std_{name}_ms": float(np.std(x))}
    for p in percentiles:
        out[f"p{_percentile_key(p)}_{name}_ms"] = float(np.percentile(x, p))
    return out


def _checked_percentiles(percentiles: Iterable[float]) -> List[float]:
    out = []
    for p in percentiles:
        v = _time("percentile", p)
        if not 0.0 <= v <= 100.0:
            raise ValueError(f"percentiles must be in [0, 100], got {p!r}")
        out.append(v)
    return out


def _token_times(rs: Sequence[RequestRecord]) -> Tuple[np.ndarray, np.ndarray]:
    """Every record's token times one after the other, and the gaps between consecutive
    tokens of each record (its itl_s), record after record (an engine's records hand their
    times over as the arrays they keep)."""
    arrays = [a for a in (_token_array(r) for r in rs) if a is not None]
    times: np.ndarray
    if rs and len(arrays) == len(rs):
        counts = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(rs))
        times = np.concatenate(arrays)
    else:
        counts = np.fromiter((len(r.token_times_s or ()) for r in rs), dtype=np.int64,
                             count=len(rs))
        times = np.fromiter(itertools.chain.from_iterable(r.token_times_s or () for r in rs),
                            dtype=np.float64, count=int(counts.sum()))
    gaps = times[1:] - times[:-1]
    # the gap from a record's last token to the next record's first is no record's
    last = np.cumsum(counts)[:-1] - 1
    own = np.ones(len(gaps), dtype=bool)
    own[last[last >= 0]] = False
    return times, gaps[own]


def _peaks(rs: Sequence[RequestRecord], times: Optional[np.ndarray]) -> Dict[str, Number]:
    """vLLM's max_output_tokens_per_s (whole seconds from the earliest arrival; ``times``:
    every token's time, None without) and max_concurrent_requests (half-open intervals,
    departures before arrivals on a tie)."""
    out: Dict[str, Number] = {}
    if times is not None:
        # only the seconds that hold a token are counted: memory in the tokens, not the span
        t0 = min(r.arrival_s for r in rs)
        end = max(r.finish_s for r in rs)
        idx = (times - t0).astype(np.int64)
        idx = idx[(idx >= 0) & (idx <= int(np.ceil(end - t0)))]
        _, counts = np.unique(idx, return_counts=True)
        out["max_output_tokens_per_s"] = float(counts.max()) if len(counts) else 0.0
    # in time order, a departure before an arrival at the same time
    at = np.array([r.arrival_s for r in rs] + [r.finish_s for r in rs], dtype=np.float64)
    delta = np.repeat(np.array([1, -1], dtype=np.int64), len(rs))
    in_flight = np.cumsum(delta[np.lexsort((delta, at))])
    out["max_concurrent_requests"] = max(0, int(in_flight.max()))
    return out


def serving_figures(records: Iterable[RequestRecord], *, start_s: Optional[float] = None,
                    percentiles: Sequence[float] = (99,)) -> Dict[str, Number]:
    """vLLM's serving figures of ``records`` (see the module docstring), in vLLM's order and
    under its keys.  ``start_s``: when the run started (default: the earliest arrival; never
    after it).  Raises ``ValueError`` for a run of requests that took no time (its throughputs
    are undefined).  No record: ``completed`` 0 and every other figure 0."""
    rs = _records(records)
    ps = _checked_percentiles(percentiles)
    with_tokens = bool(rs) and all(_token_array(r) is not None or r.token_times_s is not None
                                   for r in rs)
    if rs:
        first = min(r.arrival_s for r in rs)
        start = first if start_s is None else _time("start_s", start_s)
        if start > first:
            raise ValueError(f"start_s ({start!r}) is after the earliest arrival ({first!r})")
        duration = max(r.finish_s for r in rs) - start
        if duration <= 0.0:
            raise ValueError("the requests took no time (duration 0 s): throughputs are "
                             "undefined")
    else:
        duration = 0.0
    total_in = sum(r.input_tokens for r in rs)
    total_out = sum(r.output_tokens for r in rs)

    def rate(n: int) -> float:
        return n / duration if duration > 0 else 0.0

    out: Dict[str, Number] = {
        "completed": len(rs),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": rate(len(rs)),
        "output_throughput": rate(total_out),
        "total_token_throughput": rate(total_in + total_out),
    }
    times, gaps = _token_times(rs) if with_tokens else (None, None)
    if rs:
        out.update(_peaks(rs, times))
    lists: Dict[str, Any] = {
        "ttft": [r.ttft_s for r in rs],
        "tpot": [t for t in (r.tpot_s for r in rs) if t is not None],
        "e2el": [r.e2el_s for r in rs],
    }
    if with_tokens or not rs:
        lists["itl"] = [] if gaps is None else gaps
    for key, _, _ in METRICS:
        if key in lists:
            out.update(_stats(key, lists[key], ps))
    return out


def prefix_cache_hit_rate(hit_tokens: int, lookup_tokens: int) -> float:
    """The prefix cache's hit rate as vLLM reports it (``vllm:prefix_cache_hits`` over
    ``vllm:prefix_cache_queries``): the prompt tokens found in the cache over the prompt tokens
    looked up when requests were admitted (a resumed request looks its tokens up again); 0 when
    nothing was looked up.  The single engine and the replicas both report this one."""
    hits = _count("hit_tokens", hit_tokens, 0)
    lookups = _count("lookup_tokens", lookup_tokens, 0)
    if hits > lookups:
        raise ValueError(f"hit_tokens ({hits}) exceeds lookup_tokens ({lookups})")
    return hits / lookups if lookups else 0.0


def request_rows(records: Iterable[RequestRecord]) -> List[Dict[str, Any]]:
    """One dictionary per request, in the order given: its id, times (seconds), token counts
    and latencies (milliseconds; ``tpot_ms`` is None for a one-token answer)."""
    rows = []
    for r in _records(records):
        tpot = r.tpot_s
        rows.append({
            "request_id": r.request_id,
            "arrival_s": r.arrival_s,
            "first_token_s": r.first_token_s,
            "finish_s": r.finish_s,
            "input_tokens": r.input_tokens,
            "output_tokens": r.output_tokens,
            "ttft_ms": r.ttft_s * 1000.0,
            "tpot_ms": None if tpot is None else tpot * 1000.0,
            "e2el_ms": r.e2el_s * 1000.0,
        })
    return rows


def vllm_result(records: Iterable[RequestRecord], *, start_s: Optional[float] = None,
                percentiles: Sequence[float] = (99,)) -> Dict[str, Any]:
    """The dictionary ``vllm bench serve --save-result`` writes: :func:`serving_figures` plus
    its per-request lists ``input_lens``, ``output_lens``, ``ttfts``, ``itls`` (each request's
    gaps; empty lists without token times), ``latencies`` and ``start_times`` (seconds; start
    times relative to the run's start)."""
    rs = _records(records)
    out: Dict[str, Any] = dict(serving_figures(rs, start_s=start_s, percentiles=percentiles))
    start = (min((r.arrival_s for r in rs), default=0.0) if start_s is None
             else float(start_s))
    out.update({
        "input_lens": [r.input_tokens for r in rs],
        "output_lens": [r.output_tokens for r in rs],
        "ttfts": [r.ttft_s for r in rs],
        "itls": [list(r.itl_s or ()) for r in rs],
        "latencies": [r.e2el_s for r in rs],
        "start_times": [r.arrival_s - start for r in rs],
    })
    return out


def summary_lines(figures: Dict[str, Number], *, title: str = "Serving Benchmark Result"
                  ) -> List[str]:
    """``figures`` (from :func:`serving_figures`) as the table ``vllm bench serve`` prints:
    the same labels and order, two decimals, with thousands separators."""
    def row(label: str, value: Number) -> str:
        text = f"{value:,}" if isinstance(value, int) else f"{value:,.2f}"
        return f"{label:<40} {text:>12}"

    lines = [f"{' ' + title + ' ':=^53}"]
    lines.append(row("Successful requests:", int(figures["completed"])))
    lines.append(row("Benchmark duration (s):", float(figures["duration"])))
    lines.append(row("Total input tokens:", int(figures["total_input_tokens"])))
    lines.append(row("Total generated tokens:", int(figures["total_output_tokens"])))
    lines.append(row("Request throughput (req/s):", float(figures["request_throughput"])))
    lines.append(row("Output token throughput (tok/s):", float(figures["output_throughput"])))
    if "max_output_tokens_per_s" in figures:
        lines.append(row("Peak output token throughput (tok/s):",
                         float(figures["max_output_tokens_per_s"])))
    if "max_concurrent_requests" in figures:
        lines.append(row("Peak concurrent requests:", int(figures["max_concurrent_requests"])))
    lines.append(row("Total Token throughput (tok/s):", float(figures["total_token_throughput"])))
    for key, name, header in METRICS:
        if f"mean_{key}_ms" not in figures:
            continue
        lines.append(f"{header:-^53}")
        lines.append(row(f"Mean {name} (ms):", float(figures[f"mean_{key}_ms"])))
        lines.append(row(f"Median {name} (ms):", float(figures[f"median_{key}_ms"])))
        for k in figures:
            if k.startswith("p") and k.endswith(f"_{key}_ms"):
                p = k[1:-len(f"_{key}_ms")]
                lines.append(row(f"P{p} {name} (ms):", float(figures[k])))
    lines.append("=" * 53)
    return lines
