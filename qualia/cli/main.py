"""``qualia`` / ``python -m qualia``: serve a synthetic workload on the scheduler and report.

Examples::

    qualia simulate                       # defaults: 48 requests, numpy model
    qualia simulate --check               # ... and compare with the dense model
    qualia simulate --backend c --requests 2000 --arrival-rate 8 --check
    qualia simulate --json run.json --no-progress
    qualia simulate --backend c --trace azure_conv.csv --logical-pages 512 --num-pages 8192
    qualia simulate --max-num-batched-tokens 256 --max-prefill-chunk 64 --plot run.png
    qualia simulate --n 8 --check         # 8 samples per request, forked copy-on-write
    qualia simulate --beam-width 4 --check
    qualia demo                           # a tiny run with --check

Exit status: 0 on success, 1 when ``--check`` finds a mismatch (or the run fails, or the output
cannot be written: a full disk), 2 for bad arguments (an option
out of its bounds or in a combination that does not run, an output path that cannot be written,
an empty workload, a run that needs more memory than the machine has, a workload request that
can never fit the pool; all checked before the run by :mod:`qualia.sim.config`, for one engine
and for ``--replicas`` alike), 130 when interrupted (Ctrl-C), 141 when the reader of the output
pipe went away (``qualia simulate | head -1``: the rest of the output is dropped quietly).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from ..sim import config as preflight
from ..sim.report import OutputError, emit, format_summary, jsonable, write_json
from .options import (
    MIN_ARRIVAL_RATE,
    U32_MAX,
    add_option,
    finite_non_negative,
    int_in,
    pair,
    path,
    rate,
    ratio,
    step_ms,
)

__all__ = ["main", "build_parser", "format_summary", "fork_option_problem", "sampling_of"]

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
    num_pages=96,
    max_num_seqs=24,
    page_tokens=16,
    logical_pages=16,
    backend="model",
    turns=2,
    user_len=(8, 32),
    prefix_caching="auto",
    max_num_batched_tokens=2048,
)

#: Exit status when stdout is a pipe its reader closed (``qualia simulate | head -1``): what a
#: shell reports for a tool that SIGPIPE ended, 128 + 13.
EXIT_BROKEN_PIPE = 141



def _add_simulate_options(p: argparse.ArgumentParser, defaults: dict) -> None:
    d = defaults
    w = p.add_argument_group("workload")
    w.add_argument("--trace", metavar="FILE", type=path, default=None,
                   help="replay a CSV trace instead of the synthetic workload: the Azure LLM "
                        "inference trace (TIMESTAMP,ContextTokens,GeneratedTokens) or "
                        "arrival_s,prompt_tokens,output_tokens, optionally with "
                        "prefix_group,prefix_tokens (rows of a group share that many first "
                        "tokens) and tenant; token ids are drawn from --seed, and the synthetic "
                        "workload options below are ignored")
    w.add_argument("--requests", type=int_in(1, 2**63 - 1), default=d["requests"], metavar="N",
                   help="number of requests, or of conversations with --turns > 1 (default "
                        "%(default)s)")
    w.add_argument("--seed", type=int_in(0, 2**64 - 1), default=d["seed"], metavar="S",
                   help="workload seed, 0 <= S < 2**64 (default %(default)s)")
    w.add_argument("--arrival-rate", type=rate, default=d["arrival_rate"], metavar="R",
                   help=f"Poisson arrivals, requests per decode step, R >= "
                        f"{MIN_ARRIVAL_RATE:g}; 'inf' = all at once (default %(default)s)")
    w.add_argument("--prompt-len", type=pair, default=d["prompt_len"], metavar="MIN,MAX",
                   help="prompt length range in tokens (default %s,%s)" % d["prompt_len"])
    w.add_argument("--output-len", type=pair, default=d["output_len"], metavar="MIN,MAX",
                   help="max_new_tokens range (default %s,%s)" % d["output_len"])
    w.add_argument("--length-dist", choices=("uniform", "lognormal"), default="uniform",
                   help="length distribution over those ranges (default %(default)s)")
    w.add_argument("--system-prompts", type=int_in(0, U32_MAX), default=d["system_prompts"],
                   metavar="K", help="number of shared system prompts (default %(default)s)")
    w.add_argument("--share-ratio", type=ratio, default=d["share_ratio"], metavar="F",
                   help="fraction of requests starting with a system prompt (default %(default)s)")
    w.add_argument("--system-prompt-len", type=int_in(1, U32_MAX),
                   default=d["system_prompt_len"], metavar="L",
                   help="system prompt length in tokens (default %(default)s)")
    w.add_argument("--tenants", type=int_in(1, U32_MAX), default=d["tenants"], metavar="T",
                   help="tenants, each with its own prefix namespace (default %(default)s)")
    w.add_argument("--turns", type=int_in(1, 1 << 20), default=d["turns"], metavar="N",
                   help="turns per conversation: each request opens one, and each later turn's "
                        "prompt is the previous prompt + its answer + a new user message "
                        "(default %(default)s)")
    w.add_argument("--user-len", type=pair, default=d["user_len"], metavar="MIN,MAX",
                   help="length of a later turn's new user message (default %s,%s)"
                        % d["user_len"])
    add_option(w, "--eos-token-id", "--end-token", type=int_in(0, U32_MAX), default=None,
               metavar="ID",
               help="stop a request after it generates this token; below the backend's "
                    "vocabulary: 512 (model), 32000 (c) (default: none)")
    s = p.add_argument_group("scheduler")
    add_option(s, "--num-pages", "--num-blocks", type=int_in(1, U32_MAX),
               default=d["num_pages"], metavar="N",
               help="KV pages in the pool (default %(default)s)")
    add_option(s, "--max-num-seqs", "--max-seqs", "--max-requests", type=int_in(1, 65536),
               default=d["max_num_seqs"], metavar="N",
               help="sequences running at once, and in one step (default %(default)s)")
    s.add_argument("--page-tokens", type=int_in(1, U32_MAX), default=d["page_tokens"],
                   metavar="N", help="tokens per KV page (default %(default)s)")
    s.add_argument("--logical-pages", type=int_in(1, U32_MAX), default=d["logical_pages"],
                   metavar="N", help="max pages per request (default %(default)s)")
    s.add_argument("--prefix-caching", choices=("auto", "off"),
                   default=d["prefix_caching"],
                   help="'auto': reuse the longest cached run of every context's pages, verified "
                        "page by page; 'off' (default %(default)s)")
    add_option(s, "--max-num-batched-tokens", "--max-batched-tokens", type=int_in(1, U32_MAX),
               default=d["max_num_batched_tokens"], metavar="N",
               help="token budget of one step: decodes and prefill chunks together "
                    "(default %(default)s)")
    add_option(s, "--max-prefill-chunk", "--chunk", type=int_in(1, U32_MAX), default=None,
               metavar="N",
               help="longest prefill chunk: longer prompts are prefilled over several steps "
                    "(default: only the token budget limits a chunk)")
    s.add_argument("--step-ms", type=step_ms, default=None, metavar="MS",
                   help="the serving clock's cost of one step in milliseconds, > 0 and at "
                        "most an hour, for arrivals and latencies in seconds (default: each "
                        "step's measured time)")
    s.add_argument("--backend", choices=("model", "c"), default=d["backend"],
                   help="'model': the numpy paged-attention model; 'c': the built-in C hash "
                        "backend, qualia.HashBackend (default %(default)s)")
    f = p.add_argument_group("sampling and forks")
    f.add_argument("--n", type=int_in(1, 65536), default=1, metavar="K",
                   help="parallel samples per request: each prompt is prefilled once and K "
                        "sequences fork from it, sharing its pages copy-on-write; K <= "
                        "--max-num-seqs (default %(default)s)")
    f.add_argument("--beam-width", type=int_in(1, 65536), default=None, metavar="W",
                   help="beam search of width W for every request, over forks (model backend "
                        "only; not with --n > 1); W <= --max-num-seqs (default: none)")
    f.add_argument("--temperature", type=finite_non_negative, default=None, metavar="T",
                   help="sample each token from softmax(logits / T), keyed by --seed, the "
                        "sequence's id and its position; 0 = greedy (model backend only; "
                        "default: 1 with --n > 1, else 0; the c backend's hash rule keys "
                        "each member by its id)")
    o = p.add_argument_group("output")
    o.add_argument("--check", action="store_true",
                   help="compare every request's tokens with the dense model (model backend) or "
                        "the pure-Python hash rule (c backend); exit 1 on a mismatch")
    o.add_argument("--json", metavar="PATH", type=path, default=None,
                   help="write the summary as JSON to PATH ('-' for stdout); PATH is checked "
                        "before the run")
    o.add_argument("--plot", metavar="PATH", type=path, default=None,
                   help="draw running and waiting requests, pool use and the prefix-cache hit "
                        "rate over the run into PATH, in the format its extension names (png, "
                        "pdf, svg, ...: checked before the run; needs matplotlib: pip install "
                        "'qualia[plot]'; not with --replicas)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("-q", "--quiet", action="store_true",
                   help="no progress bar and no summary table (errors and a failed check are "
                        "still reported)")


def _prog() -> str:
    """``qualia`` when run as the console script, ``python -m qualia`` when run so."""
    name = os.path.splitext(os.path.basename(sys.argv[0]))[0] if sys.argv else ""
    return "qualia" if name in ("qualia", "qualia-script") else "python -m qualia"


_EPILOG = """\
commands:
  simulate   serve a synthetic workload (multi-turn conversations, shared system prompts,
             tenants, Poisson arrivals) or a CSV trace (--trace) and print a summary:
             throughput, time to first token, time per output token; see
             `%(prog)s simulate --help`
  demo       a tiny simulate run (12 two-turn conversations, a small pool) checked against
             the dense model; takes the same options

examples:
  %(prog)s simulate --check
  %(prog)s simulate --backend c --requests 2000 --arrival-rate 8 --check
  %(prog)s simulate --max-num-batched-tokens 128 --max-prefill-chunk 32 --plot run.png
  %(prog)s simulate --n 8 --check         (8 samples per request, forked)
  %(prog)s simulate --beam-width 4 --check
  %(prog)s demo

exit status: 0 ok, 1 --check found a mismatch, 2 bad arguments (or a run the machine
cannot hold), 130 interrupted, 141 the output pipe was closed (| head)"""


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog=prog if prog is not None else _prog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG,
        description="qualia: an LLM-serving request scheduler core. `simulate` serves a\n"
                    "synthetic workload or a trace on the scheduler's engine step (token\n"
                    "budget, chunked prefill, automatic prefix caching, reclaim, preemption)\n"
                    "and reports what happened.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    sim = sub.add_parser("simulate", help="serve a synthetic workload and report",
                         description="Serve a synthetic workload on qualia.StepScheduler.")
    _add_simulate_options(sim, DEFAULTS)
    from .cluster import add_cluster_options  # imports no Ray: that waits for --replicas
    add_cluster_options(sim)
    demo_defaults = dict(DEFAULTS, requests=12, num_pages=48, max_num_seqs=8,
                         prompt_len=(20, 60), output_len=(8, 24))
    demo = sub.add_parser("demo", help="a tiny simulate run with --check",
                          description="A tiny simulate run (12 two-turn conversations, small "
                                      "pool) checked against the dense model (the hash rule "
                                      "with --backend c).")
    _add_simulate_options(demo, demo_defaults)
    demo.set_defaults(check=True)
    sim.set_defaults(subparser=sim)
    demo.set_defaults(subparser=demo)
    return parser


def fork_option_problem(args) -> Optional[str]:
    """What is wrong with the combination of ``--n``, ``--beam-width``, ``--temperature``
    and the other options (an argparse error message), or None."""
    n, beam, temp = args.n, args.beam_width, args.temperature
    seqs, what = args.max_num_seqs, "--max-num-seqs"
    if beam is not None and n > 1:
        return "argument --beam-width: not allowed with --n > 1 (beam search returns W " \
               "hypotheses per request)"
    if n > seqs:
        return f"argument --n: must be <= {what} ({seqs}): a group's sequences run side by side"
    if beam is not None and beam > seqs:
        return (f"argument --beam-width: must be <= {what} ({seqs}): a group's beams run side "
                f"by side")
    if beam is not None and args.backend != "model":
        return "argument --beam-width: needs --backend model (the model's log-probabilities)"
    if temp is not None and args.backend != "model":
        return "argument --temperature: needs --backend model (a decode rule has no logits)"
    if temp is not None and beam is not None:
        return "argument --temperature: not allowed with --beam-width (beam search ranks " \
               "candidates by log-probability, it does not sample)"
    if getattr(args, "replicas", None) is not None and (n > 1 or beam is not None
                                                        or temp is not None):
        return "argument --replicas: not supported with --n, --beam-width or --temperature " \
               "(the cluster serves one greedy sequence per request)"
    return None


def sampling_of(args):
    """The sampler of a run: ``qualia.model.SamplingParams(temperature, seed=--seed)``, or None
    for greedy (``--temperature 0``; no ``--temperature`` and ``--n 1``; the c backend, whose
    hash rule keys each member's tokens by its id)."""
    if args.backend != "model":
        return None
    temp = args.temperature if args.temperature is not None else (1.0 if args.n > 1 else 0.0)
    if not temp:
        return None
    from ..model import SamplingParams

    return SamplingParams(temperature=temp, seed=args.seed)


# --------------------------------------------------------------------------------------------
# main (every check made before a run is qualia.sim.config.check_simulate's)
# --------------------------------------------------------------------------------------------


def _progress_bar(args, err, total: int):
    """A tqdm bar on a terminal, else None."""
    if args.quiet or args.no_progress or not err.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return None
    return tqdm(total=total or None, desc="simulate", unit="req", file=err,
                dynamic_ncols=True, leave=False)


def _simulate(args, out=None, err=None) -> int:
    from ..sim.timing import Stopwatch

    clock = Stopwatch()  # from here on, every second of the run is in one row of the summary
    from ..errors import QualiaError
    from ..sim.engine import Engine, UnservableRequest
    from ..sim.trace import Trace

    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        workload = preflight.check_simulate(args, clock).workload
    except preflight.Refused as exc:
        print(f"error: {exc}", file=err)
        return 2

    bar = _progress_bar(args, err, len(workload) if isinstance(workload, Trace)
                        else args.requests * args.turns)
    phase = ["simulate"]

    def progress(name: str, done: int, total: int) -> None:
        if bar is None:
            return
        if name != phase[0]:
            phase[0] = name
            bar.reset(total=total)
            bar.set_description(name)
        bar.update(done - bar.n)

    try:
        try:
            engine = Engine(
                args.backend, preflight.engine_config_of(args), clock=clock,
                step_seconds=None if args.step_ms is None else args.step_ms / 1e3,
                sampling=sampling_of(args))
        except (ValueError, TypeError, OverflowError) as exc:
            print(f"error: {exc}", file=err)
            return 2
        try:
            engine.submit_all(workload)
        except UnservableRequest as exc:
            print(f"error: {exc} (raise --num-pages/--logical-pages/--page-tokens or lower "
                  "--prompt-len/--output-len)", file=err)
            return 2
        except ValueError as exc:
            print(f"error: {exc}", file=err)
            return 2
        try:
            result = engine.run(check=args.check, progress=progress)
        except (RuntimeError, QualiaError) as exc:   # the run failed (stuck, a scheduler error;
            print(f"error: the run failed: {exc}", file=err)   # a QualiaError names its class)
            return 1
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
        "tenants": args.tenants, "turns": args.turns, "user_len": list(args.user_len),
        "prefix_caching": args.prefix_caching,
        "eos_token_id": args.eos_token_id, "num_pages": args.num_pages,
        "max_num_seqs": args.max_num_seqs, "page_tokens": args.page_tokens,
        "logical_pages": args.logical_pages, "backend": args.backend,
        "check": bool(args.check), "trace": args.trace,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_prefill_chunk": args.max_prefill_chunk, "step_ms": args.step_ms,
        "n": args.n, "beam_width": args.beam_width, "temperature": args.temperature,
    }
    if isinstance(workload, Trace):
        summary["config"]["trace_form"] = workload.form
        summary["config"]["trace_requests"] = len(workload)
    if args.plot is not None:
        from ..sim.plot import plot_timeline

        if result.timeline is not None:
            try:
                plot_timeline(result.timeline, args.plot, stats=result.stats,
                              x="time" if args.trace is not None else "step")
            except (OSError, ValueError) as exc:   # the file could not be written after all
                print(f"error: --plot {args.plot}: {getattr(exc, 'strerror', None) or exc}",
                      file=err)
                return 2
    if args.json:
        text = json.dumps(jsonable(summary), indent=2, sort_keys=True)
        if not write_json(text, args.json, out, err):
            return 2
    if not args.quiet and args.json != "-":
        emit(format_summary(result.stats, message), out)
    if result.check is not None and not result.check.ok:
        if args.quiet or args.json == "-":
            print(f"check FAILED: {message}", file=err)
        return 1
    return 0


def _quiet_output(*streams) -> None:
    """After the output could not be written (a reader closed the pipe, a full disk): point
    ``streams`` at /dev/null, so that nothing more (the interpreter's final flush included)
    writes there."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for stream in streams:
            try:
                os.dup2(devnull, stream.fileno())
            except (OSError, ValueError, AttributeError):  # not a real file: nothing to redirect
                pass
    finally:
        os.close(devnull)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line; returns the exit status (see the module docstring).  Output into a
    pipe whose reader has gone (``qualia simulate | head -1``) ends the command quietly with
    status 141, as SIGPIPE would end a C tool; output that cannot be written otherwise (a full
    disk) is one error line and status 1."""
    try:
        status = _main(argv)
        try:
            sys.stdout.flush()   # a write error shows here at the latest, not at exit
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputError(exc.strerror or str(exc)) from None
        return status
    except BrokenPipeError:
        _quiet_output(sys.stdout, sys.stderr)
        return EXIT_BROKEN_PIPE
    except OutputError as exc:
        _quiet_output(sys.stdout)
        print(f"error: cannot write the output: {exc}", file=sys.stderr)
        return 1


def _main(argv: Optional[Sequence[str]]) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(None if argv is None else list(argv))
        sub = vars(args).pop("subparser", None)  # the args stay plain values
        if args.command in ("simulate", "demo"):
            problem = fork_option_problem(args)
            if problem is not None:
                sub.error(problem)
        from . import cluster  # Ray is imported only when a cluster run starts
        if cluster.wants_cluster(args):
            return cluster.simulate_cli(args)
        if args.command in ("simulate", "demo"):
            return _simulate(args)
        parser.error(f"unknown command {args.command!r}")  # pragma: no cover
        return 2  # pragma: no cover
    except KeyboardInterrupt:
        print("qualia: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        print("error: out of memory; lower --num-pages, --page-tokens, --logical-pages, "
              "--max-num-seqs or --requests", file=sys.stderr)
        return 2

