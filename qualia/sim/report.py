"""Reporting a run: the figures (:func:`collect_stats`), the summary table
(:func:`format_summary`, 80 columns) and JSON (:func:`jsonable`).

Time.  The engine charges every second of a run to exactly one row of its
:class:`~qualia.sim.timing.Stopwatch`, and the table shows every row, so the rows add up to the wall
time:

* ``setup``: building the scheduler, the pool and the backend (model weights, KV array);
* ``workload``: generating the trace; ``submission``: validating and queueing its requests;
* ``scheduler``: the step API calls (``add_request``, ``schedule``, ``update``, event drains);
* ``backend``: inside the backend's ``execute_step`` (the model's forward, or the decode rule);
* ``engine``: the Python engine loop itself (arrivals, the books of each step, end-state
  verification, progress);
* ``check``: the ``--check`` comparison.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

from .check import CheckResult
from .timing import ROWS, percentile

__all__ = ["Counters", "Timeline", "EngineResult", "GroupOutput", "backend_label",
           "collect_stats",
           "format_summary", "jsonable", "WIDTH", "PERCENTILES", "OutputError", "emit",
           "write_json"]

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
    cache holds, and the prefix cache's hit rate so far (cached tokens / tokens looked up).
    Plus the latencies of every completed request (:meth:`latencies`)."""

    step: List[int] = field(default_factory=list)
    t: List[float] = field(default_factory=list)
    running: List[int] = field(default_factory=list)
    waiting: List[int] = field(default_factory=list)
    pages_used: List[int] = field(default_factory=list)
    pages_cached: List[int] = field(default_factory=list)
    hit_rate: List[float] = field(default_factory=list)
    ttft_steps: List[float] = field(default_factory=list, repr=False)
    ttft_s: List[float] = field(default_factory=list, repr=False)
    tpot_steps: List[float] = field(default_factory=list, repr=False)
    tpot_s: List[float] = field(default_factory=list, repr=False)

    def append(self, *, step: int, t: float, running: int, waiting: int, pages_used: int,
               pages_cached: int, hit_rate: float) -> None:
        self.step.append(step)
        self.t.append(t)
        self.running.append(running)
        self.waiting.append(waiting)
        self.pages_used.append(pages_used)
        self.pages_cached.append(pages_cached)
        self.hit_rate.append(hit_rate)

    def finish(self, live) -> None:
        """Record the latencies of a completed request (the engine's record of it: arrival,
        first token and last token, in steps and in seconds).  Time to first token counts the
        steps from its arrival to the step that sampled it, both included; time per output
        token, the steps (seconds) from the first token to the last over the tokens after the
        first.  A group (``n > 1`` or beam search) is one request: its first token is the
        first one sampled for it (every member samples the prompt's last row in one step), its
        last token the last of its longest sequence, over that sequence's tokens after the
        first (its sequences decode side by side, one token each per step)."""
        self.ttft_steps.append(float(live.first_step - live.arrival_step + 1))
        self.ttft_s.append(live.first_t - live.arrival_t)
        n = max(len(live.outputs), getattr(live, "longest", 0))  # a group: its longest
        if n > 1:
            self.tpot_steps.append((live.end_step - live.first_step) / (n - 1))
            self.tpot_s.append((live.end_t - live.first_t) / (n - 1))

    def latencies(self) -> Dict[str, List[float]]:
        return {"ttft_steps": list(self.ttft_steps), "ttft_s": list(self.ttft_s),
                "tpot_steps": list(self.tpot_steps), "tpot_s": list(self.tpot_s)}

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
    """What :meth:`qualia.sim.engine.Engine.run` reports.  ``outputs`` maps request id -> generated
    tokens (a group's first member or best hypothesis); ``groups`` maps the request id of each
    group (``n > 1``, beam search) to all its sequences; ``timeline`` is the run over time."""

    stats: Dict[str, object]
    outputs: Dict[int, List[int]] = field(repr=False)
    check: Optional[CheckResult] = None
    timeline: Optional[Timeline] = field(default=None, repr=False)
    groups: Dict[int, GroupOutput] = field(default_factory=dict, repr=False)

    def to_dict(self, with_outputs: bool = False) -> dict:
        d = {"stats": dict(self.stats)}
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


def _per_step(values: List[float], prefix: str) -> Dict[str, float]:
    us = [x * 1e6 for x in values]
    return {f"{prefix}_us_per_step_p50": percentile(us, 50),
            f"{prefix}_us_per_step_p99": percentile(us, 99)}


#: The latency percentiles the summary reports.
PERCENTILES = (50, 90, 99)


def _percentiles(values: List[float], prefix: str) -> Dict[str, float]:
    return {f"{prefix}_p{q}": percentile(values, q) for q in PERCENTILES}


def collect_stats(engine) -> Dict[str, object]:
    """The figures of ``engine``'s run so far (a :class:`qualia.sim.engine.Engine`)."""
    f, c, cfg = engine.facade, engine.counters, engine.config
    cache = f.cache_stats()
    time_s = engine.clock.as_dict()
    serve_s = float(engine.now)
    lat = engine.latencies()
    busy = c.steps
    out: Dict[str, object] = {
        "backend": engine.backend_label,
        "scheduler": engine.implementation,
        "prefix_caching": engine.caching,
        "requests_submitted": len(engine._requests),
        "requests_completed": c.completed,
        "sequences_completed": c.sequences_completed,
        "n": engine.n,
        "beam_width": engine.beam_width,
        "temperature": engine.sampling.temperature,
        "forks": c.forks,
        "fork_fallbacks": c.fork_fallbacks,
        "beams_parked": c.beams_parked,
        "peak_held_pages": c.peak_held_pages,
        "peak_unshared_pages": c.peak_unshared_pages,
        "pages_saved_at_peak": c.pages_saved_at_peak,
        "finished_length": c.finished_length,
        "finished_stop": c.finished_stop,
        "tokens_generated": c.tokens_generated,
        "tokens_prefilled": c.prefill_tokens,
        "tokens_decoded": c.decode_tokens,
        "tokens_scheduled": c.scheduled_tokens,
        "tokens_recomputed": c.tokens_recomputed,
        "steps": c.steps,
        "idle_steps": c.idle_steps,
        "idle_s": c.idle_s,
        "mixed_steps": c.mixed_steps,
        "mean_step_tokens": (c.scheduled_tokens / busy) if busy else 0.0,
        "max_step_tokens": c.max_plan_tokens,
        "max_step_seqs": c.max_plan_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "max_num_seqs": cfg.max_num_seqs,
        "max_prefill_chunk": cfg.max_prefill_chunk,
        "max_queued": cfg.queue_limit,
        "serve_s": serve_s,
        "step_seconds": engine.step_seconds,
        "throughput_tokens_per_s": (c.tokens_generated / serve_s) if serve_s > 0 else 0.0,
        "computed_tokens_per_s": (c.scheduled_tokens / serve_s) if serve_s > 0 else 0.0,
        **_percentiles(lat["ttft_steps"], "ttft_steps"),
        **_percentiles(lat["ttft_s"], "ttft_s"),
        **_percentiles(lat["tpot_steps"], "tpot_steps"),
        **_percentiles(lat["tpot_s"], "tpot_s"),
        "admissions": c.admissions,
        "prefix_lookups": c.admissions,
        "prefix_hits": c.prefix_hits,
        "prefix_hit_rate": (c.prefix_hits / c.admissions) if c.admissions else 0.0,
        "prefix_tokens_reused": c.cached_tokens,
        "cache_lookup_tokens": cache.lookup_tokens,
        "cache_hit_tokens": cache.hit_tokens,
        "cached_token_hit_rate": cache.hit_rate,
        "cache_reclaims": cache.reclaims,
        "cache_pages_stored": cache.stored,
        "cache_duplicates": cache.duplicates,
        "cache_collisions": cache.collisions,
        "cached_pages_at_end": cache.cached_pages,
        "kv_events_stored": c.kv_events_stored,
        "kv_events_removed": c.kv_events_removed,
        "kv_events_cleared": c.kv_events_cleared,
        "kv_events_dropped": cache.events_dropped,
        "follow_up_turns": c.follow_up_turns,
        "conversations_cut": c.conversations_cut,
        "pages_copied": c.pages_copied,
        "preemptions": c.preemptions,
        "recomputes": c.resumed,
        "num_pages": cfg.num_pages,
        "page_tokens": cfg.page_tokens,
        "peak_pages_used": c.peak_pages,
        "peak_pool_use": c.peak_pages / cfg.num_pages,
        "peak_running": c.peak_running,
        "peak_waiting": c.peak_waiting,
        "free_pages_at_end": int(f.free_pages),
        "c_backend": engine.is_c_backend,
        **_per_step(engine.step_sched_s, "sched"),
        **_per_step(engine.step_backend_s, "backend"),
        "sched_s_total": time_s["scheduler"],
        "backend_s_total": time_s["backend"],
        "engine_s_total": time_s["engine"],
        "backend_time_is": "time inside the backend's execute_step (per step: the _us_per_step "
                           "figures)",
        "time_s": time_s,
        "wall_s": sum(time_s.values()),
    }
    if engine.last_check is not None:
        out["check_ok"] = engine.last_check.ok
        out["check_against"] = engine.last_check.against
        out["check_s"] = time_s["check"]
    return out


# --------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------


def _us(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.2f} s"
    if x >= 1e3:
        return f"{x / 1e3:.2f} ms"
    return f"{x:.1f} us"


_KEY_WIDTH = 22  # the figures: key column
_LABEL_WIDTH = 36  # the time rows: label column


def _kv(key: str, value: str) -> List[str]:
    """``key  value``, the value wrapped under itself so that no line passes WIDTH."""
    lines = textwrap.wrap(value, WIDTH - _KEY_WIDTH - 2, break_on_hyphens=False) or [""]
    pad = " " * (_KEY_WIDTH + 2)
    return [f"{key.ljust(_KEY_WIDTH)}  {lines[0]}"] + [pad + rest for rest in lines[1:]]


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


def _secs(x: float) -> str:
    """A duration, in the unit that suits it."""
    if x >= 1.0:
        return f"{x:.2f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.2f} ms"
    return f"{x * 1e6:.1f} us"


def _pcts(s: dict, prefix: str) -> str:
    """The percentiles of ``prefix`` as ``a / b / c``, 3 significant digits."""
    return " / ".join(f"{float(s[f'{prefix}_p{q}']):.3g}" for q in PERCENTILES)


def _pcts_s(s: dict, prefix: str) -> str:
    """The percentiles of ``prefix`` (seconds) in one unit, the one that suits the largest."""
    values = [float(s[f"{prefix}_p{q}"]) for q in PERCENTILES]
    top = max(values)
    scale, unit = (1.0, "s") if top >= 1.0 else (1e3, "ms") if top >= 1e-3 else (1e6, "us")
    return " / ".join(f"{v * scale:.3g}" for v in values) + f" {unit}"


def format_summary(stats: dict, check_message: Optional[str] = None) -> str:
    """The summary table of a run's stats (from :func:`collect_stats`); no line is longer
    than :data:`WIDTH` columns."""
    s = stats
    lines = ["qualia simulate summary", "-" * WIDTH]
    chunk = s.get("max_prefill_chunk")
    n, beam = s.get("n", 1), s.get("beam_width")
    forking = beam is not None or (n or 1) > 1
    seqs = f"{s['sequences_completed']} sequences: " if forking else ""
    kv = [
        ("backend", f"{s['backend']} on the {s.get('scheduler', 'core')} scheduler"),
    ]
    if forking:
        temp = float(s.get("temperature") or 0.0)
        kv.append(("groups", f"beam search, width {beam}" if beam is not None else
                   f"n = {n} samples per request, "
                   + (f"temperature {temp:g}" if temp else "greedy (temperature 0)")))
    kv += [
        ("requests completed", f"{s['requests_completed']} / {s['requests_submitted']}  "
                               f"({seqs}{s['finished_stop']} stopped, {s['finished_length']} "
                               f"at max_new_tokens)"),
        ("tokens generated", f"{s['tokens_generated']}  (prefilled {s['tokens_prefilled']}, "
                             f"recomputed {s['tokens_recomputed']})"),
        ("steps", f"{s['steps']}  ({s['mixed_steps']} mixed, mean "
                  f"{s['mean_step_tokens']:.1f} tokens, peak running {s['peak_running']}, "
                  f"peak waiting {s['peak_waiting']})"),
        ("step budget", f"{s['max_num_batched_tokens']} tokens, {s['max_num_seqs']} requests, "
                        + ("no prefill chunk cap" if chunk is None else
                           f"prefill chunks <= {chunk} tokens")),
        ("throughput", f"{s['throughput_tokens_per_s']:.1f} tokens/s generated "
                       f"({s['computed_tokens_per_s']:.1f} computed) in "
                       f"{_secs(float(s['serve_s']))}"),
        ("TTFT p50/p90/p99", f"{_pcts(s, 'ttft_steps')} steps;  {_pcts_s(s, 'ttft_s')}"),
        ("TPOT p50/p90/p99", f"{_pcts(s, 'tpot_steps')} steps;  {_pcts_s(s, 'tpot_s')}"),
        ("prefix caching", str(s.get("prefix_caching", "auto"))),
        ("prefix hit rate", f"{100 * s['prefix_hit_rate']:.1f}%  ({s['prefix_hits']} of "
                            f"{s['prefix_lookups']} admissions, {s['prefix_tokens_reused']} "
                            f"tokens reused)"),
    ]
    if s.get("prefix_caching") == "auto":
        kv += [
            ("cached tokens", f"{100 * s['cached_token_hit_rate']:.1f}% of prompt tokens  "
                              f"({s['cache_hit_tokens']} of {s['cache_lookup_tokens']})"),
            ("reclaims", f"{s['cache_reclaims']}  (cached pages reused for new ones, least "
                         f"recently used first)"),
            ("KV events", f"{s['kv_events_stored']} stored, {s['kv_events_removed']} removed, "
                          f"{s['kv_events_dropped']} dropped"),
        ]
    if s.get("follow_up_turns") or s.get("conversations_cut"):
        kv.append(("conversations", f"{s['follow_up_turns']} follow-up turns  "
                                    f"({s['conversations_cut']} cut: past the pool or "
                                    f"logical_pages)"))
    kv += [
        ("pages copied", f"{s['pages_copied']}  (copy-on-write)"),
    ]
    if forking:
        kv.append(("forks", f"{s['forks']} children forked, {s['fork_fallbacks']} queued for "
                            f"want of a slot or row"
                            + (f", {s['beams_parked']} beams parked" if beam is not None
                               else "")))
    if forking:
        kv.append(("pages saved by sharing",
                   f"{s['pages_saved_at_peak']} at the peak of {s['peak_unshared_pages']} "
                   f"pages that unshared sequences would hold (each ceil(tokens / page) of "
                   f"its own); most held: {s['peak_held_pages']}"))
    kv += [
        ("preemptions", f"{s['preemptions']}  ({s['recomputes']} resumed by recompute)"),
        ("peak pool use", f"{s['peak_pages_used']} / {s['num_pages']} pages "
                          f"({100 * s['peak_pool_use']:.1f}%) of {s['page_tokens']} tokens"),
    ]
    if check_message is not None:
        kv.append(("check", check_message))
    for key, value in kv:
        lines += _kv(key, value)

    wall = float(s["wall_s"])
    rows = _time_rows(s)
    label_w = max(len("wall time (sum of the rows)"), max(len(r[0]) for r in rows))
    lines.append("")
    lines.append(f"{'where the time went'.ljust(label_w)} {'seconds':>9} {'share':>7}"
                 f"  per step: p50 / p99")
    for label, sec, pr in rows:
        share = 100.0 * sec / wall if wall > 0 else 0.0
        line = f"{label.ljust(label_w)} {sec:9.3f} {share:6.1f}%"
        if pr is not None:
            line += f"  {pr}"
        lines.append(line)
    lines.append(f"{'wall time (sum of the rows)'.ljust(label_w)} {wall:9.3f} {100.0:6.1f}%")
    note = ("(wall time: from the start of the run, after Python start-up and imports, to "
            "this summary; serving time: the steps' measured time"
            if s.get("step_seconds") is None else
            f"(wall time: from the start of the run, after Python start-up and imports, to "
            f"this summary; serving time: {s['step_seconds']:g} s per step")
    lines += textwrap.wrap(note + ", idle gaps between arrivals included)", WIDTH)
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
