"""The simulator's configuration: one engine's scheduler options (:class:`EngineConfig`, what the
single engine and every replica are built with, checked in one place), the one choice of the
step scheduler (:func:`make_step_scheduler`), and what ``qualia simulate`` checks before it
runs (:func:`check_simulate`).

Before a run, for one engine and for ``--replicas`` alike, :func:`check_simulate` takes the
parsed arguments and either returns what the run needs (the workload, its vocabulary) or raises
:class:`Refused` with a one-line message that names the option at fault; the command prints
``error: <message>`` and exits 2. Nothing expensive has happened by then: no engine, no Ray, no
prompt drawn.  First the options left to their defaults that depend on others are filled in
(:func:`resolve_options`): the backend (``c`` for a trace, ``model`` otherwise) and the
scheduler's sizes (a synthetic workload's small pool; for a trace, the pool the ``--profile``
GPU's memory holds, its step budget and, once the trace is read, the pages of its longest
request).  Checks, in order:

* the options that go together (cluster options need ``--replicas``; what ``--replicas`` does
  not serve: ``--trace``, ``--plot``, ``--prefix-caching off``; ``--step-ms`` is a clock of its
  own, not with ``--clock``);
* ``--eos-token-id`` below the backend's vocabulary;
* the output paths (``--json``, ``--plot``: the folder exists and is writable, and they are two
  files; ``--plot``'s format is one matplotlib writes, and matplotlib is installed);
* ``--metrics-port``: prometheus-client installed, the port free;
* the workload: a trace is read (bad rows are refused by their line) and must have a row, and
  every row must be servable by the pool and a request's table (checked on the row's lengths,
  before any prompt is drawn); a synthetic workload's shortest possible request must be;
* memory: the run's estimate (:mod:`qualia.sim.resources`, every replica counted) against what the
  machine has;
* ``--ray-address``: its form, ``ray[client]`` for ``ray://`` addresses, and that the address
  answers a TCP connection within :data:`CONNECT_TIMEOUT_S` seconds.

The generated requests themselves are checked by the same rule
(:func:`qualia.sim.workload.unservable_reason`) as they are submitted, before the first step.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Union

from ..twin.seed import exact_int
from .clock import DEFAULT_PROFILE, PROFILES, FixedClock, MeasuredClock, ModeledClock, get_profile
from .resources import available_memory, format_bytes, install_hint, memory_estimate
from .trace import Trace, TraceError
from .workload import Workload, unservable_reason

__all__ = ["EngineConfig", "engine_config_of", "make_step_scheduler", "step_scheduler_class",
           "Refused", "Prepared", "check_simulate", "VOCAB", "CONNECT_TIMEOUT_S",
           "output_path_problem", "memory_needed", "ray_address_parts", "workload_of",
           "resolve_options", "resolve_trace_sizes", "clock_of", "SYNTHETIC_SIZES",
           "DEFAULT_PROFILE", "PROFILE_NAMES", "SIZE_OPTIONS"]

#: token ids of the workload, per --backend
VOCAB = {"model": 512, "c": 32000}
#: the profiles ``--profile`` names
PROFILE_NAMES = tuple(PROFILES)
#: The synthetic workload's scheduler when its sizes are not given: a small pool that the numpy
#: model holds, where the prefix cache, preemption and reclaim are busy.
SYNTHETIC_SIZES: Dict[str, int] = dict(num_pages=96, max_num_seqs=24, page_tokens=16,
                                       logical_pages=16, max_num_batched_tokens=2048)
#: The scheduler's sizes, by the option that sets each.
SIZE_OPTIONS = {"num_pages": "--num-pages", "max_num_seqs": "--max-num-seqs",
                "page_tokens": "--page-tokens", "logical_pages": "--logical-pages",
                "max_num_batched_tokens": "--max-num-batched-tokens"}
#: the routing policy of ``--replicas`` without ``--router``
DEFAULT_ROUTER = "prefix"
#: the steps after its death was found that a killed replica restarts, without ``--rejoin-after``
DEFAULT_REJOIN_AFTER = 5
#: the prefix router's pages per queued request, without ``--load-weight``
DEFAULT_LOAD_WEIGHT = 0.25
#: seconds ``--ray-address`` has to accept a TCP connection before the run is refused
CONNECT_TIMEOUT_S = 5.0

_CLUSTER_ONLY = ("router", "compare", "kill_replica", "rejoin_after", "load_weight",
                 "metrics_port", "ray_address", "local")
#: the command line's defaults of the cluster options (--router's, --rejoin-after's and
#: --load-weight's are None until the checks pass, so that one given is told apart from none,
#: whatever its value: then DEFAULT_ROUTER, DEFAULT_REJOIN_AFTER and DEFAULT_LOAD_WEIGHT)
_CLUSTER_DEFAULTS: Dict[str, Any] = dict(replicas=None, router=None, compare=False,
                                         kill_replica=None, rejoin_after=None, load_weight=None,
                                         metrics_port=None, ray_address=None, local=False)


# --------------------------------------------------------------------------------------------
# one engine's scheduler
# --------------------------------------------------------------------------------------------

#: The scheduler an engine runs: the compiled core's, its pure-Python twin's, or the first that
#: serves what is asked (``"auto"``: the core).
SCHEDULER_KINDS = ("auto", "core", "twin")


@dataclass(frozen=True)
class EngineConfig:
    """One engine's step scheduler: the single engine and every replica are built from one.

    The pool holds ``num_pages`` pages of ``page_tokens`` tokens; a request's block table
    ``logical_pages`` pages.  A step plans at most ``max_num_batched_tokens`` tokens and
    ``max_num_seqs`` sequences (also the running set's size), prefill chunks of at most
    ``max_prefill_chunk`` tokens (None: only the budget limits them); at most ``max_queued``
    requests are queued (None: ``4 * max_num_seqs``).  ``eos_token_id`` stops a sequence (None:
    only its length does).  ``n > 1`` adds every request as a group of ``n`` sampled sequences,
    ``beam_width`` as a beam search (not both; each at most ``max_num_seqs``).  ``vocab_size``
    (None: not checked) bounds the sampled token ids.  ``cache_key`` and ``event_capacity``
    (None: the scheduler's defaults) configure the automatic prefix cache.  ``scheduler``:
    one of :data:`SCHEDULER_KINDS`, or a callable taking the scheduler's arguments
    (:func:`make_step_scheduler`)."""

    num_pages: int = 96
    page_tokens: int = 16
    logical_pages: int = 16
    max_num_seqs: int = 24
    max_num_batched_tokens: int = 2048
    max_prefill_chunk: Optional[int] = None
    max_queued: Optional[int] = None
    eos_token_id: Optional[int] = None
    prefix_caching: str = "auto"
    n: int = 1
    beam_width: Optional[int] = None
    vocab_size: Optional[int] = None
    cache_key: Optional[bytes] = None
    event_capacity: Optional[int] = None
    scheduler: Any = "auto"

    @property
    def queue_limit(self) -> int:
        """How many requests the scheduler queues (``max_queued``, or its default)."""
        return 4 * self.max_num_seqs if self.max_queued is None else self.max_queued

    @property
    def forking(self) -> bool:
        """Requests are added as groups (``n > 1`` or beam search)."""
        return self.n > 1 or self.beam_width is not None

    def group_keywords(self) -> Dict[str, int]:
        """``add_request``'s group keywords: ``{"n": n}``, ``{"beam_width": w}`` or none."""
        if self.beam_width is not None:
            return {"beam_width": self.beam_width}
        return {"n": self.n} if self.n > 1 else {}

    def checked(self) -> "EngineConfig":
        """This configuration with its options checked (``ValueError`` / ``TypeError`` naming
        the option): the engine's and the replicas' one validation.  The scheduler checks its
        own arguments again when it is built."""
        if self.prefix_caching not in ("auto", "off"):
            raise ValueError(f"prefix_caching must be 'auto' or 'off' (the engine step has no "
                             f"explicit breakpoints), not {self.prefix_caching!r}")
        if not callable(self.scheduler) and self.scheduler not in SCHEDULER_KINDS:
            raise ValueError(f"scheduler must be 'auto', 'core', 'twin' or a callable, not "
                             f"{self.scheduler!r}")
        seqs = exact_int(self.max_num_seqs, "max_num_seqs")
        n, beam_width = _group_sizes(self.n, self.beam_width, seqs, self.max_queued)
        return dataclasses.replace(self, max_num_seqs=seqs, n=n, beam_width=beam_width)

    def scheduler_arguments(self) -> Tuple[Tuple[int, ...], Dict[str, Any]]:
        """The step scheduler's constructor arguments, positional and keyword."""
        kw: Dict[str, Any] = dict(
            max_num_batched_tokens=self.max_num_batched_tokens, max_queued=self.max_queued,
            max_prefill_chunk=self.max_prefill_chunk, vocab_size=self.vocab_size,
            prefix_caching=self.prefix_caching)
        if self.cache_key is not None:
            kw["cache_key"] = self.cache_key
        if self.event_capacity is not None:
            kw["event_capacity"] = self.event_capacity
        return (self.num_pages, self.page_tokens, self.logical_pages, self.max_num_seqs), kw


def _group_sizes(n, beam_width, max_num_seqs: int, max_queued: Optional[int]
                 ) -> Tuple[int, Optional[int]]:
    """``n`` and ``beam_width`` checked: ints, at least 1, at most ``max_num_seqs`` (a group's
    sequences run side by side), ``n`` at most ``max_queued`` (a group takes ``n`` queue
    entries), and not both."""
    sizes: Dict[str, Optional[int]] = {"beam_width": None}
    for name, value in (("n", n), ("beam_width", beam_width)):
        if value is None and name == "beam_width":
            continue
        v = exact_int(value, name)
        if not 1 <= v <= max_num_seqs:
            raise ValueError(f"{name} must be in [1, max_num_seqs={max_num_seqs}] (a group's "
                             f"sequences run side by side), got {v}")
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


def step_scheduler_class(kind: str = "auto") -> type:
    """The step scheduler class of ``kind``: ``"core"`` or ``"auto"``, the compiled core's;
    ``"twin"``, its pure-Python twin.  The one place the simulator names either."""
    if kind not in SCHEDULER_KINDS:
        raise ValueError(f"scheduler must be 'auto', 'core' or 'twin', not {kind!r}")
    if kind == "twin":
        from ..twin import StepScheduler

        return StepScheduler
    import qualia

    return qualia.StepScheduler


def engine_config_of(args) -> EngineConfig:
    """The engine configuration of a ``simulate`` command line (its parsed arguments, sizes
    resolved: :func:`resolve_options`)."""
    return EngineConfig(
        num_pages=args.num_pages, page_tokens=args.page_tokens,
        logical_pages=args.logical_pages, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_chunk=args.max_prefill_chunk, eos_token_id=args.eos_token_id,
        prefix_caching=args.prefix_caching, n=getattr(args, "n", 1),
        beam_width=getattr(args, "beam_width", None))


def make_step_scheduler(config: EngineConfig):
    """The step scheduler ``config`` describes: ``config.scheduler`` (a kind, or a callable)
    called with :meth:`EngineConfig.scheduler_arguments`."""
    factory = config.scheduler
    if not callable(factory):
        factory = step_scheduler_class(factory)
    args, kw = config.scheduler_arguments()
    return factory(*args, **kw)



def resolve_options(args) -> None:
    """Fill in the options of a ``simulate`` command line that were left to their defaults and
    depend on others (each only if unset, so it may be called again): the backend (``c`` with
    ``--trace``, else ``model``), and the scheduler's sizes: a synthetic workload's from
    ``args.synthetic_sizes`` (:data:`SYNTHETIC_SIZES`), a trace's from ``--profile``
    (the pool its GPU memory holds, its step budget; ``--logical-pages`` waits for the trace:
    :func:`resolve_trace_sizes`).  ``args.sized_by`` records, per size set here, where it came
    from; ``args.backend_by`` why the backend is what it is."""
    if not hasattr(args, "sized_by"):
        args.sized_by = {}
    trace = getattr(args, "trace", None) is not None
    if getattr(args, "backend", None) is None:
        args.backend = "c" if trace else "model"
        args.backend_by = "the default for --trace" if trace else "the default"
    elif not hasattr(args, "backend_by"):
        args.backend_by = "as --backend asks"
    if getattr(args, "page_tokens", None) is None:
        args.page_tokens = SYNTHETIC_SIZES["page_tokens"]
        args.sized_by["page_tokens"] = "the default"
    if trace:
        prof = get_profile(getattr(args, "profile", None) or DEFAULT_PROFILE)
        from_profile = {"num_pages": lambda: prof.kv_pages(args.page_tokens),
                        "max_num_seqs": lambda: prof.max_num_seqs,
                        "max_num_batched_tokens": lambda: prof.max_num_batched_tokens}
        for key, value in from_profile.items():
            if getattr(args, key, None) is None:
                setattr(args, key, int(value()))
                args.sized_by[key] = f"the {prof.name} profile"
        return
    sizes = getattr(args, "synthetic_sizes", None) or SYNTHETIC_SIZES
    for key, size in sizes.items():
        if getattr(args, key, None) is None:
            setattr(args, key, int(size))
            args.sized_by[key] = "the default"


def resolve_trace_sizes(args, trace: Trace) -> None:
    """``--logical-pages`` of a trace run when not given: the pages of its longest request
    (prompt and output)."""
    if getattr(args, "logical_pages", None) is None:
        tokens = max(trace.max_request_tokens, 1)
        args.logical_pages = -(-tokens // args.page_tokens)
        args.sized_by["logical_pages"] = "the trace's longest request"


def clock_of(args):
    """The serving clock of a command line: ``--step-ms`` (fixed), ``--clock measured``, or the
    modeled time on ``--profile``."""
    if getattr(args, "step_ms", None) is not None:
        return FixedClock(args.step_ms / 1e3)
    if getattr(args, "clock", None) == "measured":
        return MeasuredClock()
    return ModeledClock(getattr(args, "profile", None) or DEFAULT_PROFILE)


class Refused(ValueError):
    """A command line that cannot run: ``str(exc)`` is the one-line reason, naming the option."""


@dataclass
class Prepared:
    """What a checked run needs: its workload and the vocabulary its token ids come from."""

    workload: Union[Workload, Trace]
    vocab: int


def wants_cluster(args) -> bool:
    """Whether the arguments name any cluster option (then the cluster path runs, and refuses
    cluster options without ``--replicas``)."""
    return any(getattr(args, k, v) != v for k, v in _CLUSTER_DEFAULTS.items())


# --------------------------------------------------------------------------------------------
# single checks
# --------------------------------------------------------------------------------------------


def output_path_problem(option: str, path: Optional[str]) -> Optional[str]:
    """Why ``path`` (the value of ``option``) cannot be written, or None if it can."""
    if path is None or path == "-":
        return None
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{option} {path}: is a directory"
    if not os.path.exists(parent):
        return f"{option} {path}: directory {parent} does not exist"
    if not os.path.isdir(parent):
        return f"{option} {path}: {parent} is not a directory"
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            return f"{option} {path}: not writable"
    elif not os.access(parent, os.W_OK | os.X_OK):
        return f"{option} {path}: directory {parent} is not writable"
    return None


def plot_format_problem(path: str) -> Optional[str]:
    """Why matplotlib cannot write ``path`` (no extension, or a format it does not know), or
    None.  Needs matplotlib (checked first by the caller)."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    ext = os.path.splitext(path)[1][1:].lower()
    if not ext:
        return (f"--plot {path}: the file name needs an extension naming the format "
                f"({', '.join(formats)})")
    if ext not in formats:
        return (f"--plot {path}: matplotlib does not write .{ext} files (formats: "
                f"{', '.join(formats)})")
    return None


def metrics_port_problem(port: int) -> Optional[str]:
    """Why ``--metrics-port`` cannot serve here (prometheus-client missing, port taken)."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return ("argument --metrics-port: needs prometheus-client, which is not installed: "
                + install_hint("cluster", "prometheus-client"))
    if port == 0:
        return None   # any free port
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # as the metrics server binds: address reuse on, so a port in TIME_WAIT is free
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
    except OSError as exc:
        return f"argument --metrics-port: cannot listen on 127.0.0.1:{port}: " \
               f"{exc.strerror or exc}"
    finally:
        s.close()
    return None


def ray_address_parts(address: str) -> Tuple[bool, Optional[str], Optional[int]]:
    """``(client, host, port)`` of a ``--ray-address``: ``ray://HOST:PORT`` (Ray Client),
    ``HOST:PORT`` (a cluster's GCS), or ``auto`` (host and port None: the cluster Ray finds
    itself).  Raises :class:`Refused` for anything else."""
    text = address.strip()
    if text == "auto":
        return False, None, None
    client = text.startswith("ray://")
    rest = text[len("ray://"):] if client else text
    host, sep, port_text = rest.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise Refused(f"argument --ray-address: expected HOST:PORT, ray://HOST:PORT or auto, "
                      f"got {address!r}")
    return client, host, int(port_text)


def ray_address_problem(address: str) -> Optional[str]:
    """Why ``--ray-address`` cannot be used: bad form, Ray Client's packages missing for a
    ``ray://`` address, or nothing answering at it within :data:`CONNECT_TIMEOUT_S`."""
    import importlib.util

    client, host, port = ray_address_parts(address)
    if client and importlib.util.find_spec("grpc") is None:
        return (f"argument --ray-address {address}: a ray:// address needs Ray Client, which is "
                "not installed: " + install_hint("cluster", "'ray[client]'"))
    if host is None or port is None:
        return None
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        why = (f"no answer within {CONNECT_TIMEOUT_S:g} s" if isinstance(exc, socket.timeout)
               else exc.strerror or str(exc))
        return f"argument --ray-address {address}: cannot reach {host}:{port} ({why})"
    return None


_SET_BY = {
    "model KV": "--num-pages x --page-tokens",
    "model weights": "the model's size",
    "pool": "--num-pages",
    "block tables": "--max-num-seqs x --logical-pages",
    "request slots": "--max-num-seqs",
    "token arena": "4 x --max-num-seqs x --logical-pages x --page-tokens",
    "prefix cache": "--num-pages x --page-tokens",
    "token streams": "--max-num-seqs x --logical-pages x --page-tokens",
    "token scratch": "--logical-pages x --page-tokens",
    "undo log": "--max-num-seqs, --logical-pages",
    "workload": "--requests x --turns x --prompt-len, --output-len (or the --trace)",
    "system prompts": "--system-prompts x --system-prompt-len",
}


def memory_needed(args, workload) -> Dict[str, int]:
    """Bytes the run needs, by part (see :func:`qualia.sim.resources.memory_estimate`); with
    ``--replicas N``, every engine part N times (the replicas of a local Ray share the
    machine)."""
    parts = memory_estimate(
        args.backend, max_num_seqs=args.max_num_seqs, num_pages=args.num_pages,
        page_tokens=args.page_tokens, logical_pages=args.logical_pages,
        prefix_entries=1, prefix_caching=args.prefix_caching)
    parts.pop("prefix store", None)  # the engine step keeps no breakpoint store
    # the step API holds every queued request's tokens (4 x max_num_seqs by default)
    parts["token arena"] = 4 * args.max_num_seqs * args.logical_pages * args.page_tokens * 4
    replicas = getattr(args, "replicas", None) or 1
    parts = {k: v * replicas for k, v in parts.items()}
    parts["workload"] = workload.memory_estimate()
    # every system prompt is drawn before the run, whatever the requests (a Python int and a
    # list slot a token, as the workload's estimate counts them)
    k = getattr(workload, "system_prompts", 0)
    if k:
        parts["system prompts"] = 48 * k * workload.system_prompt_len
    return parts


def memory_problem(args, workload) -> Optional[str]:
    parts = memory_needed(args, workload)
    total = sum(parts.values())
    avail = available_memory()
    if avail is None or total <= avail:
        return None
    part = max(parts, key=parts.__getitem__)
    setter = _SET_BY[part]
    if (getattr(args, "replicas", None) or 1) > 1 and part != "workload":
        setter += ", times --replicas"
    return (f"this run needs about {format_bytes(total)} of memory, more than the "
            f"{format_bytes(avail)} available; the largest part is the {part} "
            f"({format_bytes(parts[part])}, set by {setter}): lower those options")


def workload_of(args, vocab: int, stopwatch=None) -> Union[Workload, Trace]:
    """The run's workload: the ``--trace`` read (charged to the workload row of
    ``stopwatch``), or the synthetic one.  Raises :class:`Refused`."""
    from .timing import SETUP, WORKLOAD

    try:
        if args.trace is not None:
            if stopwatch is not None:
                stopwatch.switch(WORKLOAD)
            try:
                return Trace(args.trace, seed=args.seed, vocab=vocab,
                             eos_token_id=args.eos_token_id)
            finally:
                if stopwatch is not None:
                    stopwatch.switch(SETUP)
        return Workload(
            requests=args.requests, seed=args.seed, arrival_rate=args.arrival_rate,
            prompt_len=args.prompt_len, output_len=args.output_len,
            system_prompts=args.system_prompts, system_prompt_len=args.system_prompt_len,
            share_ratio=args.share_ratio, tenants=args.tenants, length_dist=args.length_dist,
            vocab=vocab, eos_token_id=args.eos_token_id, turns=args.turns, user_len=args.user_len)
    except TraceError as exc:
        raise Refused(f"--trace {exc}") from None
    except ValueError as exc:
        raise Refused(str(exc)) from None


def shortest_request(w: Workload) -> Tuple[int, int]:
    """The shortest prompt and output a synthetic workload can draw: every one of its requests
    is at least that long."""
    prompt = w.prompt_len[0]
    if w.system_prompts and w.share_ratio >= 1.0:  # every prompt starts with a system prompt
        prompt = max(prompt, w.system_prompt_len + 1)
    return prompt, w.output_len[0]


def servable_problem(args, workload) -> Optional[str]:
    """Why the workload can never be served by the pool and a request's table: a trace's first
    unservable row (by its line), or a synthetic workload whose shortest request does not fit."""
    shape = dict(page_tokens=args.page_tokens, num_pages=args.num_pages,
                 logical_pages=args.logical_pages, beam_width=getattr(args, "beam_width", None))
    hint = "(raise those options or lower --prompt-len/--output-len)"
    if isinstance(workload, Trace):
        bad = workload.unservable_row(options=True, **shape)
        if bad is not None:
            return f"--trace {bad}: raise those options"
        return None
    prompt, output = shortest_request(workload)
    why = unservable_reason("even the shortest request of the workload", prompt, output,
                            options=True, **shape)
    return None if why is None else f"{why} {hint}"


# --------------------------------------------------------------------------------------------
# the whole check
# --------------------------------------------------------------------------------------------


def _cluster_option_problem(args) -> Optional[str]:
    replicas = getattr(args, "replicas", None)
    if replicas is None:
        if wants_cluster(args):
            return ("the cluster options (--router, --compare, --kill-replica, --rejoin-after, "
                    "--load-weight, --metrics-port, --ray-address, --local) need --replicas N")
        return None
    if args.prefix_caching != "auto":
        return "--replicas routes on automatic prefix caching: use --prefix-caching auto"
    if args.trace is not None:
        return "argument --trace: not served on --replicas yet (a synthetic workload only)"
    if args.plot is not None:
        return "argument --plot: not with --replicas (the plot draws one engine's timeline)"
    if args.local and args.ray_address is not None:
        return "argument --ray-address: not with --local (the replicas run in this process)"
    if args.compare and args.router is not None:
        return "argument --router: not with --compare (which runs every policy)"
    if args.kill_replica is None and args.rejoin_after is not None:
        return ("argument --rejoin-after: only with --kill-replica (it is when the killed "
                "replica restarts)")
    return None


def _clock_option_problem(args) -> Optional[str]:
    if getattr(args, "step_ms", None) is not None and getattr(args, "clock", None) is not None:
        return (f"argument --step-ms: not with --clock {args.clock} (--step-ms is a clock of its "
                f"own: a fixed time per step)")
    return None


def check_simulate(args, stopwatch=None) -> Prepared:
    """Every check of a ``simulate`` / ``demo`` command line made before the run (see the module
    docstring); raises :class:`Refused`.  The options left to defaults that depend on others
    are filled in first (:func:`resolve_options`; a trace's ``--logical-pages`` once it is
    read).  ``stopwatch`` (a :class:`qualia.sim.timing.Stopwatch`) is charged the trace's
    reading."""
    resolve_options(args)
    problem = _cluster_option_problem(args) or _clock_option_problem(args)
    if problem is not None:
        raise Refused(problem)
    if getattr(args, "replicas", None) is not None:
        for name, default in (("router", DEFAULT_ROUTER), ("rejoin_after", DEFAULT_REJOIN_AFTER),
                              ("load_weight", DEFAULT_LOAD_WEIGHT)):
            if getattr(args, name) is None:
                setattr(args, name, default)
    vocab = VOCAB[args.backend]
    if args.eos_token_id is not None and args.eos_token_id >= vocab:
        raise Refused(f"argument --eos-token-id: must be < {vocab} (the vocabulary of --backend "
                      f"{args.backend}), got {args.eos_token_id}")
    for option in ("--json", "--plot"):
        problem = output_path_problem(option, getattr(args, option[2:]))
        if problem is not None:
            raise Refused(problem)
    if args.json not in (None, "-") and args.plot is not None and \
            os.path.realpath(args.json) == os.path.realpath(args.plot):
        raise Refused(f"argument --plot: {args.plot} is also the --json file (one would "
                      "overwrite the other)")
    if args.plot is not None:
        from .plot import matplotlib_problem

        problem = matplotlib_problem() or plot_format_problem(args.plot)
        if problem is not None:
            raise Refused(problem)
    if getattr(args, "metrics_port", None) is not None:
        problem = metrics_port_problem(args.metrics_port)
        if problem is not None:
            raise Refused(problem)
    workload = workload_of(args, vocab, stopwatch)
    if isinstance(workload, Trace):
        if len(workload) == 0:
            raise Refused(f"--trace {args.trace}: no requests to serve (a header and no rows)")
        resolve_trace_sizes(args, workload)
    for problem in (servable_problem(args, workload), memory_problem(args, workload)):
        if problem is not None:
            raise Refused(problem)
    if getattr(args, "replicas", None) is not None and not args.local:
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise Refused("--replicas needs Ray, which is not installed: "
                          + install_hint("cluster", "ray")
                          + "; or run the replicas in this process: --local")
        if args.ray_address is not None:
            problem = ray_address_problem(args.ray_address)
            if problem is not None:
                raise Refused(problem)
    return Prepared(workload, vocab)
