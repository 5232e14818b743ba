"""Reporting a run: the figures (:func:`collect_stats`), the summary table
(:func:`format_summary`, 80 columns) and JSON (:func:`jsonable`).

Time.  The engine charges every second of a run to exactly one row of its
:class:`~qualia.timing.Stopwatch`, and the table shows every row, so the rows add up to the wall
time:

* ``setup``: building the scheduler, the pool and the backend (model weights, KV array);
* ``workload``: generating the trace; ``submission``: validating and queueing its requests;
* ``scheduler``: the ``qualia.Scheduler`` bookkeeping calls (admit, reserve, advance, publish,
  evict, finish, ...) and, with a Python backend, ``decode`` less the backend's time;
* ``decode_round``: with a C backend, the whole ``Scheduler.decode`` call: its scheduler part
  and the backend run in one C call that Python cannot time apart;
* ``backend``: inside the backend's Python methods (prefill, copies and, with a Python backend,
  the decode round);
* ``engine``: the Python engine loop itself (queues, token lists, end-state verification,
  progress), including the hash rule that stands in for a decode-only backend's prefill;
* ``check``: the ``--check`` comparison.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

from .check import CheckResult
from .timing import ROWS, percentile

__all__ = ["Counters", "EngineResult", "backend_label", "collect_stats", "format_summary",
           "jsonable", "WIDTH"]

#: The summary table fits a terminal this wide.
WIDTH = 80


@dataclass
class Counters:
    """What the engine counts, one field per counter.  Setting a name that is not a field
    raises ``AttributeError`` (so does reading one), so a misspelt counter cannot be a silent
    zero."""

    steps: int = 0
    idle_steps: int = 0
    completed: int = 0
    decode_rounds: int = 0
    decode_items: int = 0
    decode_exhausted: int = 0
    prefix_lookups: int = 0
    prefix_hits: int = 0
    prefix_tokens_reused: int = 0
    prefixes_published: int = 0
    publish_skipped_too_long: int = 0
    tokens_prefilled: int = 0
    tokens_recomputed: int = 0
    recomputes: int = 0
    recompute_mismatches: int = 0
    pages_copied_prefill: int = 0
    evictions: int = 0
    evictions_for_pages: int = 0
    evictions_for_entries: int = 0
    preemptions: int = 0
    admission_waits: int = 0
    admission_rollbacks: int = 0
    follow_up_turns: int = 0
    conversations_cut: int = 0
    kv_events_stored: int = 0
    kv_events_removed: int = 0
    kv_events_cleared: int = 0

    def __setattr__(self, name: str, value) -> None:
        if name not in self.__dataclass_fields__:
            raise AttributeError(f"Counters has no counter {name!r}")
        object.__setattr__(self, name, value)


@dataclass
class EngineResult:
    """What :meth:`qualia.engine.Engine.run` reports.  ``outputs`` maps request id -> generated
    tokens."""

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


def backend_label(backend, is_model: bool, is_c: bool) -> str:
    """How the summary names a backend: its class and what it runs on."""
    name = type(backend).__name__
    if is_c:
        return f"{name} (C)"
    if is_model:
        return f"{name} (numpy)" if name == "PagedModelBackend" else f"{name} (model)"
    return f"{name} (Python)"


def _per_round(values: List[float], prefix: str) -> Dict[str, float]:
    us = [x * 1e6 for x in values]
    return {f"{prefix}_us_per_round_p50": percentile(us, 50),
            f"{prefix}_us_per_round_p99": percentile(us, 99)}


def collect_stats(engine) -> Dict[str, object]:
    """The figures of ``engine``'s run so far (a :class:`qualia.engine.Engine`)."""
    s, c = engine.scheduler, engine.counters
    cache = s.cache_stats()
    time_s = engine.clock.as_dict()
    lookups = c.prefix_lookups
    generated = sum(len(v) for v in engine.outputs.values())
    out: Dict[str, object] = {
        "backend": engine.backend_label,
        "prefix_caching": engine.caching,
        "requests_submitted": len(engine._requests),
        "requests_completed": c.completed,
        "tokens_generated": generated,
        "tokens_prefilled": c.tokens_prefilled,
        "tokens_recomputed": c.tokens_recomputed,
        "decode_rounds": c.decode_rounds,
        "decode_items": c.decode_items,
        "mean_batch": (c.decode_items / c.decode_rounds) if c.decode_rounds else 0.0,
        "steps": c.steps,
        "idle_steps": c.idle_steps,
        "prefix_lookups": lookups,
        "prefix_hits": c.prefix_hits,
        "prefix_hit_rate": (c.prefix_hits / lookups) if lookups else 0.0,
        "prefix_tokens_reused": c.prefix_tokens_reused,
        "prefixes_published": c.prefixes_published,
        "publish_skipped_too_long": c.publish_skipped_too_long,
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
        "pages_copied": engine.pages_copied(),
        "pages_copied_prefill": c.pages_copied_prefill,
        "evictions": c.evictions,
        "evictions_for_pages": c.evictions_for_pages,
        "evictions_for_entries": c.evictions_for_entries,
        "preemptions": c.preemptions,
        "recomputes": c.recomputes,
        "recompute_mismatches": c.recompute_mismatches,
        "admission_waits": c.admission_waits,
        "admission_rollbacks": c.admission_rollbacks,
        "decode_exhausted": c.decode_exhausted,
        "num_blocks": s.num_blocks,
        "page_tokens": engine.page_tokens,
        "max_requests": s.max_requests,
        "peak_pages_used": engine.peak_pages,
        "peak_pool_use": engine.peak_pages / s.num_blocks,
        "peak_running": engine.peak_running,
        "store_entries_at_end": len(s.prefixes),
        "store_pages_at_end": len(set(engine.store_pages())),
        "free_pages_at_end": s.free_pages,
        "c_backend": engine.is_c_backend,
        **_per_round(engine.round_sched_s, "sched"),
        **_per_round(engine.round_decode_s, "decode_round"),
        **_per_round(engine.round_backend_s, "backend"),
        "sched_s_total": time_s["scheduler"],
        "decode_round_s_total": time_s["decode_round"],
        "backend_s_total": time_s["backend"],
        "engine_s_total": time_s["engine"],
        "backend_time_is": (
            "time inside the backend's Python methods (prefill, copy_pages); the decode call "
            "of the C backend is in decode_round, with the scheduler's part"
            if engine.is_c_backend else
            "time inside the backend's methods (prefill, execute_ragged, copy_pages)"),
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
    """(label, seconds, per-round p50 / p99 or None) for every row of the run's stopwatch."""
    t = s["time_s"]
    per_round = {
        "scheduler": "sched",
        "decode_round": "decode_round",
        "backend": "backend",
    }
    labels = {
        "setup": "setup (scheduler, pool, backend)",
        "workload": "workload generation",
        "submission": "submission",
        "scheduler": "scheduler (qualia.Scheduler calls)",
        "decode_round": "decode round (scheduler + C backend)",
        "backend": f"backend: {s['backend']}",
        "engine": "engine loop (Python)",
        "check": f"check ({s.get('check_against', 'not run')})",
    }
    rows = []
    for key in ROWS:
        if key == "decode_round" and not s.get("c_backend") and not t[key]:
            continue
        if key == "check" and "check_s" not in s and not t[key]:
            continue
        pr = None
        if key in per_round:
            p = per_round[key]
            pr = (f"{_us(s[f'{p}_us_per_round_p50'])} / "
                  f"{_us(s[f'{p}_us_per_round_p99'])}")
        label = labels[key]
        if len(label) > _LABEL_WIDTH:  # a long backend class name
            label = label[:_LABEL_WIDTH - 3] + "..."
        rows.append((label, float(t[key]), pr))
    return rows


def format_summary(stats: dict, check_message: Optional[str] = None) -> str:
    """The summary table of a run's stats (from :func:`collect_stats`); no line is longer
    than :data:`WIDTH` columns."""
    s = stats
    lines = ["qualia simulate summary", "-" * WIDTH]
    kv = [
        ("backend", str(s["backend"])),
        ("requests completed", f"{s['requests_completed']} / {s['requests_submitted']}"),
        ("tokens generated", f"{s['tokens_generated']}  (prefilled {s['tokens_prefilled']}, "
                             f"recomputed {s['tokens_recomputed']})"),
        ("decode rounds", f"{s['decode_rounds']}  (mean batch {s['mean_batch']:.1f}, "
                          f"peak running {s['peak_running']})"),
        ("prefix caching", str(s.get("prefix_caching", "explicit"))),
        ("prefix hit rate", f"{100 * s['prefix_hit_rate']:.1f}%  ({s['prefix_hits']} of "
                            f"{s['prefix_lookups']} lookups, {s['prefix_tokens_reused']} tokens "
                            f"reused)"),
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
        ("evictions", f"{s['evictions']}  ({s['evictions_for_pages']} for pages, "
                      f"{s['evictions_for_entries']} for store entries)"),
        ("preemptions", f"{s['preemptions']}"),
        ("peak pool use", f"{s['peak_pages_used']} / {s['num_blocks']} pages "
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
                 f"  per round: p50 / p99")
    for label, sec, pr in rows:
        share = 100.0 * sec / wall if wall > 0 else 0.0
        line = f"{label.ljust(label_w)} {sec:9.3f} {share:6.1f}%"
        if pr is not None:
            line += f"  {pr}"
        lines.append(line)
    lines.append(f"{'wall time (sum of the rows)'.ljust(label_w)} {wall:9.3f} {100.0:6.1f}%")
    note = "(wall time: from the start of the run, after Python start-up and imports, to " \
           "this summary"
    if s.get("c_backend"):
        note += ("; decode round: the whole Scheduler.decode call, inside which Python cannot "
                 "time the scheduler and the C backend apart")
    lines += textwrap.wrap(note + ")", WIDTH)
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
