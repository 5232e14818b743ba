"""``qualia`` / ``python -m qualia``: serve a synthetic workload or a trace on the scheduler and
report vLLM's serving figures.

Examples::

    qualia simulate                       # 48 two-turn conversations on the numpy model
    qualia simulate --check               # ... and compare with the dense model
    qualia simulate --trace azure_conv.csv   # a real trace, sized from the GPU profile
    qualia simulate --trace azure_conv.csv --profile llama3.1-8b-a100
    qualia simulate --backend c --requests 2000 --arrival-rate 50 --check
    qualia simulate --json run.json --no-progress
    qualia simulate --max-num-batched-tokens 256 --max-prefill-chunk 64 --plot run.png
    qualia simulate --n 8 --check         # 8 samples per request, forked copy-on-write
    qualia simulate --beam-width 4 --check
    qualia demo                           # a tiny run with --check

The serving clock: by default each step takes the modeled time of its plan on a GPU profile
(``--profile``, :mod:`qualia.sim.clock`); ``--step-ms`` charges a fixed time per step,
``--clock measured`` each step's time on this machine.  With ``--trace`` the scheduler is sized
from the profile (its KV memory, its step budget, the trace's longest request) unless the sizes
are given, and the backend is the C hash backend unless ``--backend`` says otherwise.

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
import difflib
import json
import os
import re
import sys
from typing import List, Optional, Sequence, Tuple

from ..sim import config as preflight
from ..sim.report import (
    OutputError,
    clock_parts,
    emit,
    format_summary,
    jsonable,
    number,
    write_json,
)
from .options import (
    MIN_ARRIVAL_RATE,
    U32_MAX,
    add_option,
    finite_non_negative,
    int_in,
    pair,
    path,
    profile,
    rate,
    ratio,
    step_ms,
)

__all__ = ["main", "build_parser", "format_summary", "fork_option_problem", "sampling_of"]

#: The synthetic workload's defaults, and its scheduler's (a small pool that the numpy model
#: can hold, where the cache, preemption and reclaim are busy).  With --trace, the sizes left
#: unset come from the profile (qualia.sim.config.resolve_sizes) instead.
DEFAULTS = dict(
    requests=48,
    seed=0,
    arrival_rate=40.0,
    prompt_len=(24, 96),
    output_len=(16, 48),
    system_prompts=4,
    share_ratio=0.75,
    system_prompt_len=40,
    tenants=2,
    turns=2,
    user_len=(8, 32),
    prefix_caching="auto",
)

#: Exit status when stdout is a pipe its reader closed (``qualia simulate | head -1``): what a
#: shell reports for a tool that SIGPIPE ended, 128 + 13.
EXIT_BROKEN_PIPE = 141


def _add_simulate_options(p: argparse.ArgumentParser, defaults: dict, sizes: dict) -> None:
    d = defaults
    w = p.add_argument_group("workload")
    w.add_argument("--trace", metavar="FILE", type=path, default=None,
                   help="replay a CSV trace instead of the synthetic workload: the Azure LLM "
                        "inference trace (TIMESTAMP,ContextTokens,GeneratedTokens) or "
                        "arrival_s,prompt_tokens,output_tokens, optionally with "
                        "prefix_group,prefix_tokens (rows of a group share that many first "
                        "tokens) and tenant; token ids are drawn from --seed, and the synthetic "
                        "workload options below are ignored; the scheduler is sized from "
                        "--profile and the backend is c unless given")
    w.add_argument("--requests", type=int_in(1, 2**63 - 1), default=d["requests"], metavar="N",
                   help="number of requests, or of conversations with --turns > 1: N x --turns "
                        "requests in all (default %(default)s)")
    w.add_argument("--seed", type=int_in(0, 2**64 - 1), default=d["seed"], metavar="S",
                   help="workload seed, 0 <= S < 2**64 (default %(default)s)")
    w.add_argument("--arrival-rate", type=rate, default=d["arrival_rate"], metavar="R",
                   help=f"Poisson arrivals of the first turns, requests per second of the "
                        f"serving clock, R >= {MIN_ARRIVAL_RATE:g}; 'inf' = all at 0 s (default "
                        f"%(default)s); a later turn arrives when the previous one completes")
    w.add_argument("--prompt-len", type=pair, default=d["prompt_len"], metavar="MIN,MAX",
                   help="prompt length range in tokens (default %s,%s)" % d["prompt_len"])
    w.add_argument("--output-len", type=pair, default=d["output_len"], metavar="MIN,MAX",
                   help="output length range in tokens, each request's max_new_tokens "
                        "(default %s,%s)" % d["output_len"])
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
    c = p.add_argument_group("the serving clock")
    c.add_argument("--clock", choices=("modeled", "measured"), default=None,
                   help="'modeled': each step takes the modeled time of its plan on --profile's "
                        "GPU (a roofline of the step's work; deterministic); 'measured': each "
                        "step's time on this machine's CPU (no GPU; varies from run to run) "
                        "(default: modeled)")
    c.add_argument("--profile", type=profile, default=preflight.DEFAULT_PROFILE, metavar="NAME",
                   help="the model on a GPU that the modeled clock times and that sizes the "
                        "scheduler for --trace: "
                        + ", ".join(preflight.PROFILE_NAMES) + " (default %(default)s)")
    c.add_argument("--step-ms", type=step_ms, default=None, metavar="MS",
                   help="instead of a clock above: a fixed time per step in milliseconds, from "
                        "0.001 (a microsecond) to an hour")
    s = p.add_argument_group("scheduler (with --trace, what is not given comes from --profile)")
    add_option(s, "--num-pages", "--num-blocks", type=int_in(1, U32_MAX), default=None,
               metavar="N",
               help=f"KV pages in the pool (default {sizes['num_pages']}; with --trace, what "
                    f"the profile's GPU memory holds)")
    add_option(s, "--max-num-seqs", "--max-seqs", "--max-requests", type=int_in(1, 65536),
               default=None, metavar="N",
               help=f"sequences running at once, and in one step (default "
                    f"{sizes['max_num_seqs']}; with --trace, the profile's)")
    s.add_argument("--page-tokens", type=int_in(1, U32_MAX), default=None, metavar="N",
                   help=f"tokens per KV page (default {sizes['page_tokens']})")
    s.add_argument("--logical-pages", type=int_in(1, U32_MAX), default=None, metavar="N",
                   help=f"max pages per request (default {sizes['logical_pages']}; with "
                        f"--trace, what its longest request needs)")
    s.add_argument("--prefix-caching", choices=("auto", "off"),
                   default=d["prefix_caching"],
                   help="'auto' (default): automatic prefix caching: every admitted request "
                        "reuses the longest run of its prompt's full pages already cached "
                        "(in its tenant's namespace, verified page by page), and the pages "
                        "only the cache holds are reclaimed least recently used first; "
                        "'off': no cache, every prompt is computed in full")
    add_option(s, "--max-num-batched-tokens", "--max-batched-tokens", type=int_in(1, U32_MAX),
               default=None, metavar="N",
               help=f"token budget of one step: decodes and prefill chunks together "
                    f"(default {sizes['max_num_batched_tokens']}; with --trace, the "
                    f"profile's)")
    add_option(s, "--max-prefill-chunk", "--chunk", type=int_in(1, U32_MAX), default=None,
               metavar="N",
               help="longest prefill chunk: longer prompts are prefilled over several steps "
                    "(default: only the token budget limits a chunk)")
    s.add_argument("--backend", choices=("model", "c"), default=None,
                   help="what computes the tokens: 'model', the numpy paged-attention model "
                        "(checked against the dense model by --check); 'c', the built-in C "
                        "hash backend, qualia.HashBackend (default: model; c with --trace, "
                        "where the numpy model would compute every token of the trace)")
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
                   help="write vLLM's figures, every request's record (arrival, first token, "
                        "finish, tokens) and the scheduler's figures as JSON to PATH ('-' for "
                        "stdout); PATH is checked before the run")
    o.add_argument("--plot", metavar="PATH", type=path, default=None,
                   help="draw the run over the serving clock into PATH: running and waiting "
                        "requests, pool use, the prefix-cache hit rate and the latencies, in "
                        "the format its extension names (png, pdf, svg, ...: checked before "
                        "the run; needs matplotlib: pip install \".[plot]\" in the qualia "
                        "checkout; not with --replicas)")
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
             tenants, Poisson arrivals) or a CSV trace (--trace) and print vLLM's serving
             figures (throughput, TTFT, TPOT, ITL, end-to-end latency) on a modeled GPU
             clock; see `%(prog)s simulate --help`
  demo       a tiny simulate run (12 two-turn conversations, a small pool) checked against
             the dense model; takes the same options

examples:
  %(prog)s simulate --check
  %(prog)s simulate --trace azure_conv.csv
  %(prog)s simulate --backend c --requests 2000 --arrival-rate 50 --check
  %(prog)s simulate --max-num-batched-tokens 128 --max-prefill-chunk 32 --plot run.png
  %(prog)s simulate --n 8 --check         (8 samples per request, forked)
  %(prog)s demo

exit status: 0 ok, 1 --check found a mismatch, 2 bad arguments (or a run the machine
cannot hold), 130 interrupted, 141 the output pipe was closed (| head)"""

_INVALID_CHOICE = re.compile(r"invalid choice: '?([^' ]*)'? \(choose from (.*)\)")


def _close(word: str, choices: Sequence[str], cutoff: float = 0.6) -> List[str]:
    return difflib.get_close_matches(word, list(choices), n=3, cutoff=cutoff)


def _did_you_mean(close: Sequence[str]) -> str:
    return f"; did you mean {' or '.join(close)}?" if close else ""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose "invalid choice" errors name the close matches, and which
    takes every negative number an option's value may be (``-1``, ``-.5``, ``-1e3``, ``-inf``,
    ``-nan``) as that value, so its option's type reports it ("must be >= ..."), where argparse
    takes the last three for options ("expected one argument")."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = _NEGATIVE_NUMBER

    def error(self, message: str):
        m = _INVALID_CHOICE.search(message)
        if m is not None and "did you mean" not in message:
            choices = [c.strip().strip("'") for c in m.group(2).split(",")]
            close = _close(m.group(1), choices)
            message += _did_you_mean([repr(c) for c in close])
        super().error(message)


#: what a negative number looks like to _Parser (argparse's own: -1 and -.5 only)
_NEGATIVE_NUMBER = re.compile(r"^-(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
                              r"|inf|infinity|nan)$", re.ASCII | re.IGNORECASE)


def _option_strings(parser: argparse.ArgumentParser) -> List[str]:
    """The long options ``parser`` shows in its help (hidden aliases left out)."""
    return [o for a in parser._actions if a.help != argparse.SUPPRESS
            for o in a.option_strings if o.startswith("--")]


def unrecognized_message(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """argparse's "unrecognized arguments" message for ``extras``, with the close matches of
    each mistyped option among ``parser``'s options."""
    known = _option_strings(parser)
    hints = []
    for arg in extras:
        if arg.startswith("--"):
            name = arg.split("=", 1)[0]
            close = _close(name, known, cutoff=0.75)  # long names share much by chance
            if close:
                hints.append(f"{name}: did you mean {' or '.join(close)}?")
    text = f"unrecognized arguments: {' '.join(extras)}"
    return text + ("; " + "; ".join(hints) if hints else "")


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    from .. import __version__

    parser = _Parser(
        prog=prog if prog is not None else _prog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG,
        description="qualia: an LLM-serving request scheduler core. `simulate` serves a\n"
                    "synthetic workload or a trace on the scheduler's engine step (token\n"
                    "budget, chunked prefill, automatic prefix caching, reclaim, preemption)\n"
                    "and reports vLLM's serving figures on a modeled GPU clock.")
    parser.add_argument("-V", "--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sim = sub.add_parser("simulate", help="serve a synthetic workload or a trace and report",
                         description="Serve a synthetic workload or a trace on "
                                     "qualia.StepScheduler and report vLLM's serving "
                                     "figures.")
    _add_simulate_options(sim, DEFAULTS, preflight.SYNTHETIC_SIZES)
    from .cluster import add_cluster_options  # imports no Ray: that waits for --replicas
    add_cluster_options(sim)
    demo_defaults = dict(DEFAULTS, requests=12, prompt_len=(20, 60), output_len=(8, 24))
    demo = sub.add_parser("demo", help="a tiny simulate run with --check",
                          description="A tiny simulate run (12 two-turn conversations, small "
                                      "pool) checked against the dense model (the hash rule "
                                      "with --backend c).")
    demo_sizes = dict(preflight.SYNTHETIC_SIZES, num_pages=48, max_num_seqs=8)
    _add_simulate_options(demo, demo_defaults, demo_sizes)
    demo.set_defaults(check=True, synthetic_sizes=demo_sizes)
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


def _header(args, workload, clock, backend_label: str) -> List[Tuple[str, List[str]]]:
    """The summary's first rows: what was served, on which clock and backend, sized how (each
    row a list of parts that fit a line, so that no value is split over two)."""
    from ..sim.trace import Trace

    rows: List[Tuple[str, List[str]]] = []
    if isinstance(workload, Trace):
        rows.append(("workload", [f"{number(len(workload))} requests of the trace "
                                  f"{os.path.basename(args.trace)}", f"{workload.form} form",
                                  f"arrivals over {number(workload.duration_s, 1)} s"]))
    else:
        rate = ("all at 0 s" if args.arrival_rate == float("inf") else
                f"Poisson arrivals at {args.arrival_rate:g} requests/s")
        if args.turns > 1:
            rows.append(("workload", [
                f"{number(args.requests)} conversations x {args.turns} turns = "
                f"{number(args.requests * args.turns)} requests", "synthetic", rate,
                "a later turn when the previous one completes"]))
        else:
            rows.append(("workload", [f"{number(args.requests)} requests", "synthetic", rate]))
    rows.append(("clock", clock_parts(clock.describe())))
    rows.append(("backend", [backend_label, args.backend_by]))
    sized = getattr(args, "sized_by", {})
    by_profile = [k for k, v in sized.items() if "profile" in v]
    if by_profile or "logical_pages" in sized and isinstance(workload, Trace):
        parts = []
        if "num_pages" in by_profile:
            parts.append(f"{number(args.num_pages)} pages of {args.page_tokens} tokens: the "
                         f"GPU's KV memory")
        if "max_num_batched_tokens" in by_profile or "max_num_seqs" in by_profile:
            parts.append(f"{number(args.max_num_batched_tokens)} tokens and "
                         f"{number(args.max_num_seqs)} sequences a step")
        if sized.get("logical_pages") == "the trace's longest request":
            parts.append(f"{number(args.logical_pages)} pages a request: the longest")
        rows.append(("sized from the profile", parts))
    return rows


def _config(args, workload, clock) -> dict:
    """The command line's settings, as the JSON report records them."""
    from ..sim.trace import Trace

    config = {
        "command": args.command, "seed": args.seed, "prefix_caching": args.prefix_caching,
        "eos_token_id": args.eos_token_id, "num_pages": args.num_pages,
        "max_num_seqs": args.max_num_seqs, "page_tokens": args.page_tokens,
        "logical_pages": args.logical_pages, "backend": args.backend,
        "check": bool(args.check), "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_prefill_chunk": args.max_prefill_chunk, "clock": clock.kind,
        "clock_description": clock.describe(), "profile": args.profile,
        "sized_by": dict(getattr(args, "sized_by", {})),
    }
    if args.step_ms is not None:
        config["step_ms"] = args.step_ms
    if args.n > 1 or args.beam_width is not None or args.temperature is not None:
        config.update(n=args.n, beam_width=args.beam_width, temperature=args.temperature)
    if isinstance(workload, Trace):
        config.update(trace=args.trace, trace_form=workload.form,
                      trace_requests=len(workload))
    else:
        config.update(
            requests=args.requests, turns=args.turns,
            total_requests=args.requests * args.turns, arrival_rate=args.arrival_rate,
            prompt_len=list(args.prompt_len), output_len=list(args.output_len),
            length_dist=args.length_dist, system_prompts=args.system_prompts,
            share_ratio=args.share_ratio, system_prompt_len=args.system_prompt_len,
            tenants=args.tenants, user_len=list(args.user_len))
    return config


def _simulate(args, out=None, err=None) -> int:
    from ..sim.timing import Stopwatch

    stopwatch = Stopwatch()  # from here on, every second of the run is in one row of the summary
    from ..errors import QualiaError
    from ..sim.engine import Engine, UnservableRequest
    from ..sim.trace import Trace

    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        workload = preflight.check_simulate(args, stopwatch).workload
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

    clock = preflight.clock_of(args)
    try:
        try:
            engine = Engine(args.backend, preflight.engine_config_of(args), clock=clock,
                            stopwatch=stopwatch, sampling=sampling_of(args))
        except (ValueError, TypeError, OverflowError) as exc:
            print(f"error: {exc}", file=err)
            return 2
        try:
            engine.submit_all(workload)
        except UnservableRequest as exc:
            hint = ("raise those options" if isinstance(workload, Trace) else
                    "raise those options or lower --prompt-len/--output-len")
            print(f"error: {exc.option_message} ({hint})", file=err)
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
    summary["config"] = _config(args, workload, clock)
    wrote = []
    if args.plot is not None:
        from ..sim.plot import plot_timeline

        if result.timeline is not None:
            try:
                plot_timeline(result.timeline, args.plot, stats=result.stats,
                              figures=result.figures, records=result.records)
            except (OSError, ValueError) as exc:   # the file could not be written after all
                print(f"error: --plot {args.plot}: {getattr(exc, 'strerror', None) or exc}",
                      file=err)
                return 2
            wrote.append(f"wrote {args.plot}")
    if args.json:
        text = json.dumps(jsonable(summary), indent=2, sort_keys=True)
        if not write_json(text, args.json, out, err):
            return 2
        if args.json != "-":
            wrote.append(f"wrote {args.json}")
    if not args.quiet and args.json != "-":
        header = _header(args, workload, clock,
                         f"{result.stats['backend']} on the {result.stats['scheduler']} "
                         f"scheduler")
        emit(format_summary(result.stats, result.figures, message, header), out)
    if wrote and not args.quiet:
        emit("\n".join(wrote), err if args.json == "-" else out)
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
        argv = sys.argv[1:] if argv is None else list(argv)
        if not argv:   # no command: the help, as --help shows it
            parser.print_help()
            return 0
        args, extras = parser.parse_known_args(argv)
        sub = vars(args).pop("subparser", None)  # the args stay plain values
        if extras:
            (sub or parser).error(unrecognized_message(sub or parser, extras))
        if args.command is None:
            parser.error("a command is needed: simulate or demo")
        if args.command in ("simulate", "demo"):
            try:
                preflight.resolve_options(args)
            except ValueError as exc:   # a profile with no memory for the KV cache
                print(f"error: {exc}", file=sys.stderr)
                return 2
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
