"""Reporting a run: the figures (vLLM's serving figures from :mod:`qualia.sim.figures`, and the
scheduler's own from :func:`collect_stats`), the summary (:func:`format_summary`, 80 columns)
and JSON (:func:`jsonable`).

The summary: a few lines saying what ran (the workload, the clock, the backend, how the
scheduler was sized), the table of ``vllm bench serve`` (milliseconds, with the same figures
in engine steps beside TTFT, TPOT and E2EL), the scheduler's figures, and where the wall time
went.  Numbers have thousands separators and never use scientific notation; no value is split
over two lines.

Time.  The engine charges every second of a run to exactly one row of its
:class:`~qualia.sim.timing.Stopwatch`, and the table shows every row, so the rows add up to the
wall time:

* ``setup``: building the scheduler, the pool and the backend (model weights, KV array);
* ``workload``: generating the trace; ``submission``: validating and queueing its requests;
* ``scheduler``: the step API calls (``add_request``, ``schedule``, ``update``, event drains);
* ``backend``: inside the backend's ``execute_step`` (the model's forward, or the decode rule);
* ``engine``: the Python engine loop itself (arrivals, the books of each step, the serving
  clock, end-state verification, progress);
* ``check``: the ``--check`` comparison.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .check import CheckResult
from .clock import plain_number
from .figures import METRICS, RequestRecord, prefix_cache_hit_rate, request_rows
from .timing import ROWS, percentile

__all__ = ["Counters", "Timeline", "EngineResult", "GroupOutput", "backend_label",
           "collect_stats", "step_figures", "figures_table", "kv_lines", "clock_parts",
           "format_summary",
           "jsonable", "number", "WIDTH", "OutputError", "emit", "write_json"]

#: The summary table fits a terminal this wide.
WIDTH = 80


@dataclass
class Counters:
    """What the engine counts, one field per counter.  Setting a name that is not a field
    raises ``AttributeError`` (so does reading one), so a misspelt counter cannot be a silent
    zero."""

    steps: int = 0
    idle_steps: int = 0
    idle_s: float = 0.0
    completed: int = 0
    sequences_completed: int = 0  # a group's members (n) or hypotheses (beam) each count
    finished_length: int = 0  # per sequence
    finished_stop: int = 0
    tokens_generated: int = 0
    sampled_tokens: int = 0
    scheduled_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    mixed_steps: int = 0
    max_plan_tokens: int = 0
    max_plan_seqs: int = 0
    admissions: int = 0
    resumed: int = 0
    prefix_hits: int = 0
    cached_tokens: int = 0
    tokens_recomputed: int = 0
    preemptions: int = 0
    pages_copied: int = 0
    peak_pages: int = 0
    peak_running: int = 0
    peak_waiting: int = 0
    follow_up_turns: int = 0
    conversations_cut: int = 0
    kv_events_stored: int = 0
    kv_events_removed: int = 0
    kv_events_cleared: int = 0
    # forks (n > 1, beam search): the scheduler's counters after the last step
    forks: int = 0  # children forked copy-on-write from a running sequence
    fork_fallbacks: int = 0  # children queued instead (no free slot or plan row)
    beams_parked: int = 0  # beams stepped out of the running set while a sibling waited
    # pages right after each schedule: the most held by requests; the most a non-sharing
    # engine would hold (each running sequence ceil(seq_len / page_tokens) pages of its own);
    # and at the first step with that most, the difference (pages saved by sharing)
    peak_held_pages: int = 0
    peak_unshared_pages: int = 0
    pages_saved_at_peak: int = 0

    def __setattr__(self, name: str, value) -> None:
        if name not in self.__dataclass_fields__:
            raise AttributeError(f"Counters has no counter {name!r}")
        object.__setattr__(self, name, value)


@dataclass
class Timeline:
    """The run over time, one entry per step with work (what ``--plot`` draws): the step
    number, the serving clock at its end (seconds), running and waiting requests (waiting: in
    the scheduler's queue or due and held by the engine), pages requests hold, pages only the
    cache holds, and the prefix cache's hit rate so far
    (:func:`~qualia.sim.figures.prefix_cache_hit_rate`).  Plus each completed request's
    latencies in engine steps (:meth:`latencies`); its latencies in seconds are in its
    :class:`~qualia.sim.figures.RequestRecord`."""

    step: List[int] = field(default_factory=list)
    t: List[float] = field(default_factory=list)
    running: List[int] = field(default_factory=list)
    waiting: List[int] = field(default_factory=list)
    pages_used: List[int] = field(default_factory=list)
    pages_cached: List[int] = field(default_factory=list)
    hit_rate: List[float] = field(default_factory=list)
    ttft_steps: List[float] = field(default_factory=list, repr=False)
    tpot_steps: List[float] = field(default_factory=list, repr=False)
    e2el_steps: List[float] = field(default_factory=list, repr=False)

    def append(self, *, step: int, t: float, running: int, waiting: int, pages_used: int,
               pages_cached: int, hit_rate: float) -> None:
        self.step.append(step)
        self.t.append(t)
        self.running.append(running)
        self.waiting.append(waiting)
        self.pages_used.append(pages_used)
        self.pages_cached.append(pages_cached)
        self.hit_rate.append(hit_rate)

    def finish(self, live, output_tokens: Optional[int] = None) -> None:
        """Record the latencies in steps of a completed request (the engine's record of it:
        the steps of its arrival, its first token and its last).  Time to first token counts
        the steps from its arrival to the step that sampled it, both included; end-to-end
        latency the steps from its arrival to its last token's, both included; time per output
        token, the steps from the first token to the last over its ``output_tokens`` after the
        first, the tokens its :class:`~qualia.sim.figures.RequestRecord` counts (default: its
        longest sequence's).  A group (``n > 1`` or beam search) is one request: its first
        token is the first one sampled for it, its last token the last of its longest
        sequence."""
        self.ttft_steps.append(float(live.first_step - live.arrival_step + 1))
        self.e2el_steps.append(float(live.end_step - live.arrival_step + 1))
        n = output_tokens if output_tokens is not None else max(
            len(live.outputs), getattr(live, "longest", 0))
        if n > 1:
            self.tpot_steps.append((live.end_step - live.first_step) / (n - 1))

    def latencies(self) -> Dict[str, List[float]]:
        """Per completed request, in engine steps: ``ttft_steps``, ``tpot_steps`` (requests of
        more than one token) and ``e2el_steps``."""
        return {"ttft_steps": list(self.ttft_steps), "tpot_steps": list(self.tpot_steps),
                "e2el_steps": list(self.e2el_steps)}

    def __len__(self) -> int:
        return len(self.step)


@dataclass
class GroupOutput:
    """Every sequence of one finished group: ``kind`` ``"n"`` (``outputs`` in member order,
    ``member_ids`` the ids the sampler keyed each on, ``scores`` None) or ``"beam"``
    (``outputs`` the hypotheses best first, ``scores`` their cumulative log-probabilities,
    ``member_ids`` empty); ``finish_reasons`` one per output."""

    kind: str
    outputs: List[List[int]]
    finish_reasons: List[str]
    member_ids: List[int]
    scores: Optional[List[float]] = None


@dataclass
class EngineResult:
    """What :meth:`qualia.sim.engine.Engine.run` reports.  ``figures``: vLLM's serving figures
    (:func:`qualia.sim.figures.serving_figures`); ``records``: one
    :class:`~qualia.sim.figures.RequestRecord` per completed request, by request id;
    ``stats``: the scheduler's own figures (:func:`collect_stats`).  ``outputs`` maps request
    id -> generated tokens (a group's first member or best hypothesis); ``groups`` maps the
    request id of each group (``n > 1``, beam search) to all its sequences; ``timeline`` is
    the run over time."""

    stats: Dict[str, object]
    outputs: Dict[int, List[int]] = field(repr=False)
    check: Optional[CheckResult] = None
    """The dense check's result, when the run was checked (``--check``); else None."""
    timeline: Optional[Timeline] = field(default=None, repr=False)
    groups: Dict[int, GroupOutput] = field(default_factory=dict, repr=False)
    figures: Dict[str, Any] = field(default_factory=dict)
    records: Dict[int, RequestRecord] = field(default_factory=dict, repr=False)

    def to_dict(self, with_outputs: bool = False) -> dict:
        """The JSON report: vLLM's figures under its keys, ``requests`` (one row per completed
        request, by id: :func:`qualia.sim.figures.request_rows`), ``stats`` and, when run,
        ``check``; ``with_outputs``: every request's tokens too."""
        d: Dict[str, Any] = dict(self.figures)
        d["requests"] = request_rows(self.records[k] for k in sorted(self.records))
        d["stats"] = dict(self.stats)
        if self.check is not None:
            d["check"] = asdict(self.check)
            d["check"]["message"] = self.check.describe()
        if with_outputs:
            d["outputs"] = {str(k): v for k, v in sorted(self.outputs.items())}
            if self.groups:
                d["groups"] = {str(k): asdict(g) for k, g in sorted(self.groups.items())}
        return d


def backend_label(backend, is_model: bool, is_c: bool) -> str:
    """How the summary names a backend: its class and what it runs on."""
    name = type(backend).__name__
    if is_c:
        return f"{name} (C)"
    if is_model:
        return f"{name} (numpy)" if name == "PagedModelBackend" else f"{name} (model)"
    return f"{name} (Python)"


def _per_step(values: Sequence[float], prefix: str) -> Dict[str, float]:
    us = np.asarray(values, dtype=np.float64) * 1e6
    return {f"{prefix}_us_per_step_p50": percentile(us, 50),
            f"{prefix}_us_per_step_p99": percentile(us, 99)}


def step_figures(latencies: Dict[str, List[float]]) -> Dict[str, float]:
    """``mean_`` / ``median_`` / ``p99_`` of each list of ``latencies`` (``ttft_steps``,
    ``tpot_steps``, ``e2el_steps``: :meth:`Timeline.latencies`), named ``mean_ttft_steps``
    and so on; an empty list counts as ``[0]``, as in
    :func:`~qualia.sim.figures.serving_figures`."""
    out: Dict[str, float] = {}
    for key, values in latencies.items():
        name = key[:-len("_steps")]
        x = np.asarray(values if len(values) else [0.0], dtype=np.float64)
        out[f"mean_{name}_steps"] = float(np.mean(x))
        out[f"median_{name}_steps"] = float(np.median(x))
        out[f"p99_{name}_steps"] = float(np.percentile(x, 99))
    return out


def collect_stats(engine) -> Dict[str, object]:
    """The scheduler's figures of ``engine``'s run so far (a
    :class:`qualia.sim.engine.Engine`): what ran, its steps and tokens, its latencies in steps,
    the prefix cache, preemptions, the pool, where the wall time went.  Figures that a run of
    this kind never changes are left out (the fork counters without forks, the cache's without
    caching, the conversations' without a next turn)."""
    f, c, cfg = engine.facade, engine.counters, engine.config
    time_s = engine.stopwatch.as_dict()
    clock = engine.clock
    busy = c.steps
    out: Dict[str, object] = {
        "backend": engine.backend_label,
        "scheduler": engine.implementation,
        "clock": clock.describe(),
        "clock_kind": clock.kind,
    }
    profile = getattr(clock, "profile", None)
    if profile is not None:
        out["profile"] = profile.name
    if clock.kind == "fixed":
        out["step_ms"] = float(clock.seconds) * 1e3
    out.update({
        "prefix_caching": engine.caching,
        "requests_submitted": len(engine._requests),
        "requests_completed": c.completed,
        "finished_length": c.finished_length,
        "tokens_generated": c.tokens_generated,
        "tokens_prefilled": c.prefill_tokens,
        "tokens_decoded": c.decode_tokens,
        "tokens_scheduled": c.scheduled_tokens,
        "tokens_recomputed": c.tokens_recomputed,
        "steps": c.steps,
        "mixed_steps": c.mixed_steps,
        "busy_s": engine.busy_s,
        "mean_running": engine.sequence_s / engine.now if engine.now > 0 else 0.0,
        "mean_step_ms": 1e3 * engine.busy_s / busy if busy else 0.0,
        "idle_s": c.idle_s,
        "mean_step_tokens": (c.scheduled_tokens / busy) if busy else 0.0,
        "max_step_tokens": c.max_plan_tokens,
        "max_step_seqs": c.max_plan_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "max_num_seqs": cfg.max_num_seqs,
        "max_prefill_chunk": cfg.max_prefill_chunk,
        "max_queued": cfg.queue_limit,
        "num_pages": cfg.num_pages,
        "page_tokens": cfg.page_tokens,
        "logical_pages": cfg.logical_pages,
        **step_figures(engine.latencies()),
        "admissions": c.admissions,
        "preemptions": c.preemptions,
        "recomputes": c.resumed,
        "peak_pages_used": c.peak_pages,
        "peak_pool_use": c.peak_pages / cfg.num_pages,
        "peak_running": c.peak_running,
        "peak_waiting": c.peak_waiting,
        "free_pages_at_end": int(f.free_pages),
    })
    if cfg.eos_token_id is not None:  # stopped sequences need an end token
        out["finished_stop"] = c.finished_stop
    if c.idle_steps:
        out["idle_steps"] = c.idle_steps
    out.update({
        "peak_held_pages": c.peak_held_pages,
        "peak_unshared_pages": c.peak_unshared_pages,
        "pages_saved_at_peak": c.pages_saved_at_peak,
    })
    if engine.forking:
        out.update({
            "n": engine.n,
            "beam_width": engine.beam_width,
            "sequences_completed": c.sequences_completed,
            "forks": c.forks,
            "fork_fallbacks": c.fork_fallbacks,
            "pages_copied": c.pages_copied,
        })
        if engine.beam_width is not None:
            out["beams_parked"] = c.beams_parked
    if engine.sampling.temperature:
        out["temperature"] = engine.sampling.temperature
    if engine.caching == "auto":
        cache = f.cache_stats()
        out.update({
            "prefix_cache_hit_rate": prefix_cache_hit_rate(cache.hit_tokens,
                                                           cache.lookup_tokens),
            "cache_lookup_tokens": cache.lookup_tokens,
            "cache_hit_tokens": cache.hit_tokens,
            "prefix_hits": c.prefix_hits,
            "cache_reclaims": cache.reclaims,
            "cache_pages_stored": cache.stored,
            "cached_pages_at_end": cache.cached_pages,
            "kv_events_stored": c.kv_events_stored,
            "kv_events_removed": c.kv_events_removed,
            "kv_events_dropped": cache.events_dropped,
        })
    if engine._next_turn is not None:
        out["follow_up_turns"] = c.follow_up_turns
        out["conversations_cut"] = c.conversations_cut
    out.update({
        **_per_step(engine.step_sched_s, "sched"),
        **_per_step(engine.step_backend_s, "backend"),
        "time_s": time_s,
        "wall_s": sum(time_s.values()),
    })
    if engine.last_check is not None:
        out["check_ok"] = engine.last_check.ok
        out["check_against"] = engine.last_check.against
        out["check_s"] = time_s["check"]
    return out


# --------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------


def number(x: float, decimals: int = 2) -> str:
    """``x`` with thousands separators and ``decimals`` decimals (an int: none), never in
    scientific notation."""
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return f"{int(x):,}"
    return f"{float(x):,.{decimals}f}"


_KEY_WIDTH = 22  # the scheduler's figures: key column
_LABEL_WIDTH = 36  # the time rows: label column


def clock_parts(description: str) -> List[str]:
    """A clock's one-line description (``describe()``) as parts that each fit a line: its name,
    then each of the details it gives in parentheses."""
    head, sep, rest = description.partition(" (")
    if not sep or not rest.endswith(")"):
        return [description]
    return [head] + [part.strip() for part in rest[:-1].split(", ")]


def kv_lines(key: str, parts: Sequence[str], sep: str = ", ") -> List[str]:
    """``key  part1, part2, ...``: the parts joined by ``sep`` and, when they pass
    :data:`WIDTH`, continued on lines of their own under the first; a part is never split (one
    longer than a line is split at its spaces, never inside a number with its unit)."""
    room = WIDTH - _KEY_WIDTH - 2
    pieces: List[str] = []
    for i, part in enumerate(parts):
        text = part + (sep.rstrip() if i < len(parts) - 1 else "")
        if len(text) <= room:
            pieces.append(text)
            continue
        line = ""
        for word in text.split(" "):
            if line and len(line) + 1 + len(word) > room:
                pieces.append(line)
                line = word
            else:
                line = f"{line} {word}" if line else word
        pieces.append(line)
    lines: List[str] = []
    line = ""
    for piece in pieces:
        if line and len(line) + 1 + len(piece) > room:
            lines.append(line)
            line = piece
        else:
            line = f"{line} {piece}" if line else piece
    lines.append(line)
    pad = " " * (_KEY_WIDTH + 2)
    return [f"{key.ljust(_KEY_WIDTH)}  {lines[0]}"] + [pad + rest for rest in lines[1:]]


def figures_table(figures: Dict[str, Any], steps: Optional[Dict[str, Any]] = None, *,
                  title: str = "Serving Benchmark Result") -> List[str]:
    """vLLM's figures (:func:`qualia.sim.figures.serving_figures`) in the layout and with the
    labels ``vllm bench serve`` prints, latencies in milliseconds with their standard
    deviation, and, given ``steps`` (the :func:`collect_stats` of the run, or any dict with
    ``steps`` and :func:`step_figures`), the same duration and latencies in engine steps in a
    column of their own."""
    width = 40 + 1 + 14 + (11 if steps is not None else 0)

    def row(label: str, value: Any, decimals: int = 2, in_steps: Any = None) -> str:
        text = number(value, decimals)
        extra = "" if in_steps is None else number(in_steps, 1)
        line = f"{label:<40} {text:>14}" + (f"{extra:>11}" if extra else "")
        if len(line) > WIDTH:  # huge figures: single spaces rather than a line too long
            line = f"{label} {text}" + (f" {extra}" if extra else "")
        return line

    def st(key: str) -> Any:
        return None if steps is None or key not in steps else steps[key]

    lines = [f"{' ' + title + ' ':=^{width}}"]
    if steps is not None:
        lines.append(f"{'':<40} {'':>14}{'steps':>11}")
    lines.append(row("Successful requests:", int(figures["completed"])))
    total_steps = st("steps")
    lines.append(row("Benchmark duration (s):", float(figures["duration"]),
                     in_steps=None if total_steps is None else int(total_steps)))
    lines.append(row("Total input tokens:", int(figures["total_input_tokens"])))
    lines.append(row("Total generated tokens:", int(figures["total_output_tokens"])))
    lines.append(row("Request throughput (req/s):", float(figures["request_throughput"])))
    lines.append(row("Output token throughput (tok/s):", float(figures["output_throughput"])))
    if "max_output_tokens_per_s" in figures:
        lines.append(row("Peak output token throughput (tok/s):",
                         float(figures["max_output_tokens_per_s"])))
    if "max_concurrent_requests" in figures:
        lines.append(row("Peak concurrent requests:", int(figures["max_concurrent_requests"])))
    lines.append(row("Total Token throughput (tok/s):",
                     float(figures["total_token_throughput"])))
    for key, name, header in METRICS:
        if f"mean_{key}_ms" not in figures:
            continue
        lines.append(f"{header:-^{width}}")
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("std", "Std")):
            lines.append(row(f"{label} {name} (ms):", float(figures[f"{stat}_{key}_ms"]),
                             in_steps=None if stat == "std" else st(f"{stat}_{key}_steps")))
        for k in figures:
            if k.startswith("p") and k.endswith(f"_{key}_ms"):
                p = k[1:-len(f"_{key}_ms")]
                lines.append(row(f"P{p} {name} (ms):", float(figures[k]),
                                 in_steps=st(f"p{p}_{key}_steps")))
    lines.append("=" * width)
    return lines


def _us(x: float) -> str:
    """Microseconds in the unit that suits them."""
    if x >= 1e6:
        return f"{number(x / 1e6)} s"
    if x >= 1e3:
        return f"{number(x / 1e3)} ms"
    return f"{number(x, 1)} us"


def _time_rows(s: dict) -> List[Tuple[str, float, Optional[str]]]:
    """(label, seconds, per-step p50 / p99 or None) for every row of the run's stopwatch."""
    t = s["time_s"]
    per_step = {"scheduler": "sched", "backend": "backend"}
    labels = {
        "setup": "setup (scheduler, pool, backend)",
        "workload": "workload generation",
        "submission": "submission",
        "scheduler": "scheduler (step API calls)",
        "backend": f"backend: {s['backend']}",
        "engine": "engine loop (Python)",
        "check": f"check ({s.get('check_against', 'not run')})",
    }
    rows = []
    for key in ROWS:
        if key == "check" and "check_s" not in s and not t[key]:
            continue
        pr = None
        if key in per_step:
            p = per_step[key]
            pr = (f"{_us(s[f'{p}_us_per_step_p50'])} / "
                  f"{_us(s[f'{p}_us_per_step_p99'])}")
        label = labels[key]
        if len(label) > _LABEL_WIDTH:  # a long backend class name
            label = label[:_LABEL_WIDTH - 3] + "..."
        rows.append((label, float(t[key]), pr))
    return rows


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def scheduler_lines(s: dict) -> List[str]:
    """The scheduler's figures (:func:`collect_stats`), one ``key  value`` row each."""
    n, beam = s.get("n", 1), s.get("beam_width")
    forking = beam is not None or (n or 1) > 1
    chunk = s.get("max_prefill_chunk")
    busy = _share(float(s["busy_s"]), float(s["busy_s"]) + float(s["idle_s"]))
    kv: List[Tuple[str, List[str]]] = []
    if forking:
        temp = float(s.get("temperature") or 0.0)
        kv.append(("groups", [f"beam search, width {beam}" if beam is not None else
                              f"n = {n} samples per request",
                              *([] if beam is not None else
                                [f"temperature {plain_number(temp)}" if temp
                                 else "greedy"]),
                              f"{number(int(s['sequences_completed']))} sequences"]))
    elif s.get("temperature"):
        kv.append(("sampling", [f"temperature {plain_number(float(s['temperature']))}"]))
    kv += [
        ("requests", [f"{number(int(s['requests_submitted']))} submitted",
                      *([f"{number(int(s['finished_stop']))} sequences stopped by the end "
                         f"token"] if "finished_stop" in s else []),
                      f"{number(int(s['finished_length']))} at their output length"]),
        ("tokens", [f"prefilled {number(int(s['tokens_prefilled']))}",
                    f"decoded {number(int(s['tokens_decoded']))}",
                    f"recomputed {number(int(s['tokens_recomputed']))}"]),
        ("steps", [f"{number(int(s['steps']))} ({number(int(s['mixed_steps']))} mixed)",
                   f"{number(float(s['mean_step_ms']))} ms and "
                   f"{number(float(s['mean_step_tokens']), 1)} tokens on average",
                   f"busy {_pct(busy)} of the time"]),
        ("step budget", [f"{number(int(s['max_num_batched_tokens']))} tokens",
                         f"{number(int(s['max_num_seqs']))} sequences",
                         "no prefill chunk cap" if chunk is None else
                         f"prefill chunks <= {number(int(chunk))} tokens"]),
        ("running, waiting", [f"{number(float(s['mean_running']), 1)} running on average",
                              f"peak {number(int(s['peak_running']))} running",
                              f"peak {number(int(s['peak_waiting']))} waiting",
                              f"queue {number(int(s['max_queued']))}"]),
    ]
    if s.get("prefix_caching") == "auto":
        kv += [
            ("prefix cache hit rate", [
                f"{_pct(float(s['prefix_cache_hit_rate']))} of prompt tokens",
                f"{number(int(s['cache_hit_tokens']))} of "
                f"{number(int(s['cache_lookup_tokens']))}",
                f"{number(int(s['prefix_hits']))} of {number(int(s['admissions']))} "
                f"admissions hit"]),
            ("prefix cache", [f"{number(int(s['cache_reclaims']))} reclaims",
                              f"KV events: {number(int(s['kv_events_stored']))} stored",
                              f"{number(int(s['kv_events_removed']))} removed",
                              f"{number(int(s['kv_events_dropped']))} dropped"]),
        ]
    else:
        kv.append(("prefix caching", ["off"]))
    if "follow_up_turns" in s:
        kv.append(("conversations", [f"{number(int(s['follow_up_turns']))} follow-up turns",
                                     f"{number(int(s['conversations_cut']))} cut (past the "
                                     f"pool or --logical-pages, or arriving after 1e9 s)"]))
    if forking:
        kv.append(("forks", [f"{number(int(s['forks']))} children forked",
                             f"{number(int(s['fork_fallbacks']))} queued for want of a slot "
                             f"or row",
                             *([f"{number(int(s['beams_parked']))} beams parked"]
                               if beam is not None else []),
                             f"{number(int(s['pages_copied']))} pages copied"]))
        kv.append(("pages saved by sharing",
                   [f"{number(int(s['pages_saved_at_peak']))} at the peak of "
                    f"{number(int(s['peak_unshared_pages']))} pages that unshared sequences "
                    f"would hold", f"most held: {number(int(s['peak_held_pages']))}"]))
    kv += [
        ("preemptions", [f"{number(int(s['preemptions']))} "
                         f"({number(int(s['recomputes']))} resumed by recompute)"]),
        ("pool", [f"peak {number(int(s['peak_pages_used']))} of "
                  f"{number(int(s['num_pages']))} pages ({_pct(float(s['peak_pool_use']))})",
                  f"{number(int(s['page_tokens']))} tokens a page",
                  f"{number(int(s['logical_pages']))} pages a request"]),
    ]
    lines: List[str] = []
    for key, parts in kv:
        lines += kv_lines(key, parts)
    return lines


def format_summary(stats: dict, figures: Optional[Dict[str, Any]] = None,
                   check_message: Optional[str] = None,
                   header: Sequence[Tuple[str, Sequence[str]]] = ()) -> str:
    """The summary of a run: ``header`` rows (``(key, parts)``: what ran), the serving clock,
    the backend, vLLM's figures (:func:`figures_table`; ``figures`` None: left out), the
    scheduler's (``stats``, from :func:`collect_stats`), the check, and where the wall time
    went.  No line is longer than :data:`WIDTH` columns."""
    s = stats
    lines = ["qualia simulate summary"]
    rows: List[Tuple[str, Sequence[str]]] = list(header)
    if not any(k == "clock" for k, _ in rows):
        rows.append(("clock", clock_parts(str(s["clock"]))))
    if not any(k == "backend" for k, _ in rows):
        rows.append(("backend", [f"{s['backend']} on the {s.get('scheduler', 'core')} "
                                 f"scheduler"]))
    for key, parts in rows:
        lines += kv_lines(key, list(parts))
    if figures is not None:
        lines.append("")
        lines += figures_table(figures, s)
    lines.append("")
    lines += scheduler_lines(s)
    if check_message is not None:
        lines += kv_lines("check", [check_message])

    wall = float(s["wall_s"])
    trows = _time_rows(s)
    label_w = max(len("wall time (sum of the rows)"), max(len(r[0]) for r in trows))
    lines.append("")
    lines.append(f"{'where the time went'.ljust(label_w)} {'seconds':>9} {'share':>7}"
                 f"  per step: p50 / p99")
    for label, sec, pr in trows:
        share = 100.0 * sec / wall if wall > 0 else 0.0
        line = f"{label.ljust(label_w)} {number(sec, 3):>9} {share:6.1f}%"
        if pr is not None:
            line += f"  {pr}"
        lines.append(line)
    lines.append(f"{'wall time (sum of the rows)'.ljust(label_w)} {number(wall, 3):>9} "
                 f"{100.0:6.1f}%")
    lines.append("(wall time: this machine's, from the start of the run, after Python start-up")
    lines.append("and imports, to this summary; the figures above are on the serving clock)")
    return "\n".join(lines)


def jsonable(obj):
    """``obj`` with dict keys as strings, tuples as lists, numpy scalars as Python numbers and
    non-finite floats as strings (``"inf"``), ready for ``json.dumps``."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):  # numpy scalars
        return obj.item()
    return obj


class OutputError(Exception):
    """The command's output could not be written (disk full, I/O error; a closed pipe is a
    ``BrokenPipeError`` and stays one)."""


def write_json(text: str, path: str, out, err) -> bool:
    """Write ``text`` to ``path`` (``"-"``: ``out``, the command's stdout); an ``OSError``
    writing the file is one ``error: --json PATH: reason`` line on ``err`` and False."""
    if path == "-":
        emit(text, out)
        return True
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    except OSError as exc:
        print(f"error: --json {path}: {exc.strerror or exc}", file=err)
        return False
    return True


def emit(text: str, out) -> None:
    """Print ``text`` to ``out`` (the command's stdout); an ``OSError`` other than a closed pipe
    becomes :class:`OutputError` with its reason."""
    try:
        print(text, file=out)
        out.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise OutputError(exc.strerror or str(exc)) from None
