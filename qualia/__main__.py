"""``python -m qualia simulate``: serve a synthetic workload on the scheduler and report.

Examples::

    python -m qualia simulate                       # defaults: 48 requests, numpy model
    python -m qualia simulate --check               # ... and compare with the dense model
    python -m qualia simulate --backend c --requests 2000 --arrival-rate 8 --check
    python -m qualia simulate --json run.json --no-progress
    python -m qualia demo                           # a tiny run with --check

Exit status: 0 on success, 1 when ``--check`` finds a mismatch, 2 for bad arguments (including
a workload request that can never fit the pool).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import List, Optional, Sequence, Tuple

__all__ = ["main", "build_parser", "format_summary"]

DEFAULTS = dict(
    requests=48,
    seed=0,
    arrival_rate=1.0,
    prompt_len=(24, 96),
    output_len=(16, 48),
    system_prompts=4,
    share_ratio=0.75,
    system_prompt_len=40,
    tenants=2,
    num_blocks=96,
    max_requests=24,
    page_tokens=16,
    logical_pages=16,
    prefix_entries=6,
    backend="model",
)


def _pair(text: str) -> Tuple[int, int]:
    parts = text.replace(":", ",").replace("-", ",").split(",")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX (e.g. 24,96), got {text!r}") from None
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {v}")
        return v

    return parse


_positive_int = _int_at_least(1)
_nonneg_int = _int_at_least(0)


def _rate(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {text!r}")
    return v


def _ratio(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text!r}")
    return v


def _add_simulate_options(p: argparse.ArgumentParser, defaults: dict) -> None:
    d = defaults
    w = p.add_argument_group("workload")
    w.add_argument("--requests", type=_nonneg_int, default=d["requests"], metavar="N",
                   help="number of requests (default %(default)s)")
    w.add_argument("--seed", type=int, default=d["seed"], help="workload seed (default %(default)s)")
    w.add_argument("--arrival-rate", type=_rate, default=d["arrival_rate"], metavar="R",
                   help="Poisson arrivals, requests per decode step; 'inf' = all at once "
                        "(default %(default)s)")
    w.add_argument("--prompt-len", type=_pair, default=d["prompt_len"], metavar="MIN,MAX",
                   help="prompt length range in tokens (default %s,%s)" % d["prompt_len"])
    w.add_argument("--output-len", type=_pair, default=d["output_len"], metavar="MIN,MAX",
                   help="max_new_tokens range (default %s,%s)" % d["output_len"])
    w.add_argument("--length-dist", choices=("uniform", "lognormal"), default="uniform",
                   help="length distribution over those ranges (default %(default)s)")
    w.add_argument("--system-prompts", type=_nonneg_int, default=d["system_prompts"], metavar="K",
                   help="number of shared system prompts (default %(default)s)")
    w.add_argument("--share-ratio", type=_ratio, default=d["share_ratio"], metavar="F",
                   help="fraction of requests starting with a system prompt (default %(default)s)")
    w.add_argument("--system-prompt-len", type=_positive_int, default=d["system_prompt_len"],
                   metavar="L", help="system prompt length in tokens (default %(default)s)")
    w.add_argument("--tenants", type=_positive_int, default=d["tenants"], metavar="T",
                   help="tenants, each with its own prefix namespace (default %(default)s)")
    w.add_argument("--end-token", type=_nonneg_int, default=None, metavar="ID",
                   help="stop a request after it generates this token (default: none)")
    s = p.add_argument_group("scheduler")
    s.add_argument("--num-blocks", type=_positive_int, default=d["num_blocks"], metavar="N",
                   help="KV pages in the pool (default %(default)s)")
    s.add_argument("--max-requests", type=_positive_int, default=d["max_requests"], metavar="N",
                   help="request slots = max batch (default %(default)s)")
    s.add_argument("--page-tokens", type=_positive_int, default=d["page_tokens"], metavar="N",
                   help="tokens per KV page (default %(default)s)")
    s.add_argument("--logical-pages", type=_positive_int, default=d["logical_pages"], metavar="N",
                   help="max pages per request (default %(default)s)")
    s.add_argument("--prefix-entries", type=_positive_int, default=d["prefix_entries"],
                   metavar="N", help="prefix store entries (default %(default)s)")
    s.add_argument("--backend", choices=("model", "c"), default=d["backend"],
                   help="'model': the numpy paged-attention model; 'c': the built-in C "
                        "reference backend (default %(default)s)")
    o = p.add_argument_group("output")
    o.add_argument("--check", action="store_true",
                   help="compare every request's tokens with the dense model (model backend) or "
                        "the pure-Python decode rule (c backend); exit 1 on a mismatch")
    o.add_argument("--json", metavar="PATH", default=None,
                   help="write the summary as JSON to PATH ('-' for stdout)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("-q", "--quiet", action="store_true",
                   help="no progress bar and no summary table (errors and a failed check are "
                        "still reported)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m qualia",
        description="qualia: an LLM-serving request scheduler core. `simulate` serves a "
                    "synthetic workload (shared system prompts, tenants, Poisson arrivals) on "
                    "qualia.Scheduler with prefix caching, copy-on-write, eviction and "
                    "preemption, and reports what happened.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    sim = sub.add_parser("simulate", help="serve a synthetic workload and report",
                         description="Serve a synthetic workload on qualia.Scheduler.")
    _add_simulate_options(sim, DEFAULTS)
    demo_defaults = dict(DEFAULTS, requests=12, num_blocks=48, max_requests=8,
                         prompt_len=(20, 60), output_len=(8, 24))
    demo = sub.add_parser("demo", help="a tiny simulate run with --check",
                          description="A tiny simulate run (12 requests, small pool) checked "
                                      "against the dense reference.")
    _add_simulate_options(demo, demo_defaults)
    demo.set_defaults(check=True)
    return parser


# --------------------------------------------------------------------------------------------
# summary
# --------------------------------------------------------------------------------------------


def _us(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.2f} s"
    if x >= 1e3:
        return f"{x / 1e3:.2f} ms"
    return f"{x:.1f} us"


def format_summary(stats: dict, check_message: Optional[str] = None) -> str:
    s = stats
    rows: List[Tuple[str, str]] = [
        ("backend", str(s["backend"])),
        ("requests completed", f"{s['requests_completed']} / {s['requests_submitted']}"),
        ("tokens generated", f"{s['tokens_generated']}"
                             f"  (prefilled {s['tokens_prefilled']}, recomputed "
                             f"{s['tokens_recomputed']})"),
        ("decode rounds", f"{s['decode_rounds']}  (mean batch {s['mean_batch']:.1f}, "
                          f"peak running {s['peak_running']})"),
        ("prefix hit rate", f"{100 * s['prefix_hit_rate']:.1f}%  ({s['prefix_hits']} of "
                            f"{s['prefix_lookups']} lookups, {s['prefix_tokens_reused']} tokens "
                            f"reused)"),
        ("pages copied", f"{s['pages_copied']}  (copy-on-write)"),
        ("evictions", f"{s['evictions']}  ({s['evictions_for_pages']} for pages, "
                      f"{s['evictions_for_entries']} for store entries)"),
        ("preemptions", f"{s['preemptions']}"),
        ("peak pool use", f"{s['peak_pages_used']} / {s['num_blocks']} pages "
                          f"({100 * s['peak_pool_use']:.1f}%) of {s['page_tokens']} tokens"),
        ("scheduler time / round", f"p50 {_us(s['sched_us_per_round_p50'])}   "
                                   f"p99 {_us(s['sched_us_per_round_p99'])}   "
                                   f"total {s['sched_s_total']:.3f} s"),
        ("backend time / round", f"p50 {_us(s['backend_us_per_round_p50'])}   "
                                 f"p99 {_us(s['backend_us_per_round_p99'])}   "
                                 f"total {s['backend_s_total']:.3f} s"),
        ("wall time", f"{s['wall_s']:.2f} s"),
    ]
    if check_message is not None:
        took = f"  ({s['check_s']:.2f} s)" if "check_s" in s else ""
        rows.append(("check", check_message + took))
    width = max(len(k) for k, _ in rows)
    lines = ["qualia simulate summary", "-" * (width + 2 + max(len(v) for _, v in rows))]
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines.append(f"(backend time = {s['backend_time_is']}; scheduler time = time in the "
                 "qualia.Scheduler calls, backend excluded)")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def _simulate(args, out=None, err=None) -> int:
    from .engine import Engine, Workload

    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        workload = Workload(
            requests=args.requests, seed=args.seed, arrival_rate=args.arrival_rate,
            prompt_len=args.prompt_len, output_len=args.output_len,
            system_prompts=args.system_prompts, system_prompt_len=args.system_prompt_len,
            share_ratio=args.share_ratio, tenants=args.tenants, length_dist=args.length_dist,
            vocab=512 if args.backend == "model" else 32000, end_token=args.end_token)
    except ValueError as exc:
        print(f"error: {exc}", file=err)
        return 2
    quiet = args.quiet
    show_progress = not (quiet or args.no_progress) and err.isatty()
    bar = None
    if show_progress and args.requests:
        try:
            from tqdm import tqdm
        except ImportError:  # pragma: no cover - tqdm is a dependency
            tqdm = None
        if tqdm is not None:
            bar = tqdm(total=args.requests, desc="simulate", unit="req", file=err,
                       dynamic_ncols=True, leave=False)

    def on_complete(rid, tokens):
        if bar is not None:
            bar.update(1)

    try:
        engine = Engine(
            args.backend, max_requests=args.max_requests, num_blocks=args.num_blocks,
            page_tokens=args.page_tokens, logical_pages=args.logical_pages,
            prefix_entries=args.prefix_entries, end_token=args.end_token,
            on_complete=on_complete)
    except (ValueError, TypeError, OverflowError) as exc:
        if bar is not None:
            bar.close()
        print(f"error: {exc}", file=err)
        return 2
    try:
        for req in workload.generate():
            engine.submit(req)
    except ValueError as exc:
        if bar is not None:
            bar.close()
        print(f"error: {exc}\n(raise --num-blocks/--logical-pages/--page-tokens or lower "
              "--prompt-len/--output-len)", file=err)
        return 2
    try:
        result = engine.run()
        if args.check:
            if bar is not None:
                bar.reset(total=len(engine.outputs))
                bar.set_description("check")
                bar.set_postfix_str("dense reference" if engine.is_model else "reference rule")
            t1 = time.perf_counter()
            result.check = engine.check(on_checked=lambda rid: bar.update(1) if bar else None)
            result.stats["check_ok"] = result.check.ok
            result.stats["check_s"] = time.perf_counter() - t1
    finally:
        if bar is not None:
            bar.close()

    message = result.check.describe() if result.check is not None else None
    summary = result.to_dict()
    summary["config"] = {
        "command": args.command,
        "requests": args.requests, "seed": args.seed, "arrival_rate": args.arrival_rate,
        "prompt_len": list(args.prompt_len), "output_len": list(args.output_len),
        "length_dist": args.length_dist, "system_prompts": args.system_prompts,
        "share_ratio": args.share_ratio, "system_prompt_len": args.system_prompt_len,
        "tenants": args.tenants, "end_token": args.end_token, "num_blocks": args.num_blocks,
        "max_requests": args.max_requests, "page_tokens": args.page_tokens,
        "logical_pages": args.logical_pages, "prefix_entries": args.prefix_entries,
        "backend": args.backend, "check": bool(args.check),
    }
    if args.json:
        text = json.dumps(_jsonable(summary), indent=2, sort_keys=True)
        if args.json == "-":
            print(text, file=out)
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(text + "\n")
    if not quiet and args.json != "-":
        print(format_summary(result.stats, message), file=out)
    if result.check is not None and not result.check.ok:
        if quiet or args.json == "-":
            print(f"check FAILED: {message}", file=err)
        return 1
    return 0


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):  # numpy scalars
        return obj.item()
    return obj


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(None if argv is None else list(argv))
    if args.command in ("simulate", "demo"):
        return _simulate(args)
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover
    return 2


if __name__ == "__main__":
    sys.exit(main())
