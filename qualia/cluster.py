"""Data-parallel replicas on Ray behind a prefix-aware router (docs/DESIGN.md, "Replicas and the
prefix router").

Each replica is one engine: a step scheduler (``add_request`` / ``schedule`` / ``update``) and a
step backend, run as a Ray actor (:class:`Replica`; in-process with ``local=True``).  The router
(:class:`Cluster`) drives every replica one engine step at a time: each call hands the replica
the requests routed to it since its last step, runs one step, and brings back what happened --
the tokens sampled, the requests finished, the KV events its automatic prefix cache emitted and
its load (running, waiting, free pages).  The events feed the router's index
(:class:`qualia.PrefixRouterIndex`, in the compiled core): page identity -> replicas holding it.

Policies: ``prefix`` sends a request to the replica holding the longest run of its leading pages,
less a load cost (``load_weight`` pages per request queued there); ``round-robin`` and
``least-loaded`` ignore the caches.

Faults: a replica whose step call fails (its actor died) is marked down, taken off the index, and
its unfinished requests go back to the router's queue, resubmitted to the survivors with the
tokens generated so far appended to the prompt (the backend is deterministic, so recomputing
gives the same tokens).  The router records each request's completion once; a replica that is
restarted (``rejoin_after`` steps later) rejoins with an empty cache.

Only this module needs Ray (the ``qualia[cluster]`` extra): it is imported lazily, and
``local=True`` runs the same code in one process without it.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

import qualia
from qualia.errors import StepError

__all__ = ["POLICIES", "ReplicaConfig", "Replica", "Cluster", "ClusterResult", "ClusterMetrics",
           "init_local_ray",
           "HashStepBackend", "make_scheduler", "compare_policies", "format_comparison",
           "add_cluster_options", "wants_cluster", "simulate_cli"]

POLICIES = ("prefix", "round-robin", "least-loaded")
DEFAULT_KEY = bytes(range(16))   # every replica and the router share the cache key


def _ray():
    try:
        import ray
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("qualia.cluster needs Ray: pip install 'qualia[cluster]'") from None
    return ray


# --------------------------------------------------------------------------------------------
# one replica
# --------------------------------------------------------------------------------------------


@dataclass
class ReplicaConfig:
    """What every replica is built with.  ``scheduler``: ``"auto"`` (the compiled core's
    ``qualia.StepScheduler`` when it has the step API, else the pure-Python twin), ``"core"``,
    ``"twin"``, or a callable taking the scheduler's keyword arguments.  ``backend``:
    ``"hash"`` (the hash rule, token = hash(request, position, last token)) or ``"model"``
    (the numpy model's own step runner, ``PagedModelBackend.execute_step``: one forward over
    the plan's mixed batch, K/V through ``slot_mapping``, greedy).  ``max_num_seqs`` (None:
    ``max_requests``) and ``max_prefill_chunk`` (None: only the token budget) shape each
    step as in the single engine."""

    max_requests: int = 16
    num_blocks: int = 96
    page_tokens: int = 16
    logical_pages: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: Optional[int] = None
    max_prefill_chunk: Optional[int] = None
    max_queued: Optional[int] = None
    cache_key: bytes = DEFAULT_KEY
    event_capacity: int = 8192
    scheduler: Any = "auto"
    backend: str = "hash"
    vocab: int = 32000
    model_seed: int = 0
    eos_token_id: Optional[int] = None

    @property
    def queue_limit(self) -> int:
        return 4 * self.max_requests if self.max_queued is None else self.max_queued


def make_scheduler(config: ReplicaConfig):
    """The step scheduler of one replica (see :class:`ReplicaConfig`)."""
    seqs = config.max_requests if config.max_num_seqs is None else config.max_num_seqs
    if not 1 <= seqs <= config.max_requests:
        raise ValueError(f"max_num_seqs must be in [1, max_requests={config.max_requests}], "
                         f"got {seqs}")
    kw: Dict[str, Any] = dict(num_pages=config.num_blocks, page_tokens=config.page_tokens,
                              logical_pages=config.logical_pages, max_num_seqs=seqs,
                              cache_key=config.cache_key, event_capacity=config.event_capacity,
                              max_num_batched_tokens=config.max_num_batched_tokens,
                              max_prefill_chunk=config.max_prefill_chunk,
                              max_queued=config.queue_limit, vocab_size=config.vocab)
    kind = config.scheduler
    if callable(kind):
        return kind(**kw)
    core_has_step = hasattr(qualia, "StepScheduler")
    if kind == "core" or (kind == "auto" and core_has_step):
        return qualia.StepScheduler(**kw)
    if kind in ("twin", "auto"):
        from qualia.twin_step import StepScheduler
        return StepScheduler(**kw)
    raise ValueError(f"scheduler must be 'auto', 'core', 'twin' or a callable, got {kind!r}")


class HashStepBackend:
    """A step backend over the hash rule (``qualia.hash_next_token``): the token sampled for a
    row is the rule applied to the row's last token at its position, as the C hash backend
    does, so outputs do not depend on how a request was batched, chunked, preempted or moved."""

    def __init__(self, vocab: int = 32000) -> None:
        self.vocab = int(vocab)

    def execute_step(self, plan) -> np.ndarray:
        rows = np.asarray(plan.logits_indices)
        toks = np.asarray(plan.input_ids)[rows].tolist()
        pos = np.asarray(plan.positions)[rows].tolist()
        rids = np.asarray(plan.sampled_request_ids).tolist()
        h, v = qualia.hash_next_token, self.vocab
        return np.array([h(r, p, t, v) for r, p, t in zip(rids, pos, toks)], dtype=np.uint32)


def model_weights(config: ReplicaConfig):
    """The numpy model's weights every replica of ``config`` uses (deterministic in the seed),
    which ``--check`` hands to the dense model."""
    from qualia.model import ModelConfig, ModelWeights
    return ModelWeights.random(ModelConfig(seed=config.model_seed, vocab=config.vocab))


def make_backend(config: ReplicaConfig):
    if config.backend == "hash":
        return HashStepBackend(config.vocab)
    if config.backend == "model":
        from qualia.model import PagedModelBackend
        return PagedModelBackend(model_weights(config), config.num_blocks, config.page_tokens)
    raise ValueError(f"backend must be 'hash' or 'model', got {config.backend!r}")


class Replica:
    """One engine: a step scheduler and its backend.  The body of the Ray actor; also usable
    in-process.  :meth:`step` is the only call the router makes."""

    def __init__(self, replica_id: int, config: ReplicaConfig) -> None:
        self.replica_id = int(replica_id)
        self.config = config
        self.sched = make_scheduler(config)
        self.backend = make_backend(config)
        # the twin keeps the cache in its facade; the core's StepScheduler owns its cache
        self.facade = getattr(self.sched, "facade", self.sched)
        self.implementation = ("core" if isinstance(self.sched, qualia.StepScheduler)
                               else "twin" if self.facade is not self.sched
                               else type(self.sched).__name__)
        self.steps = 0

    def ping(self) -> int:
        return self.replica_id

    def describe(self) -> Dict[str, Any]:
        """What this replica runs: its scheduler (``"core"``: the compiled ``qualia.Scheduler``;
        ``"twin"``) and its backend's class."""
        return dict(replica=self.replica_id, implementation=self.implementation,
                    backend=type(self.backend).__name__)

    def _hit_tokens(self) -> int:
        # prompt tokens the cache has served so far (for a plan that does not count them)
        return int(self.facade.cache_stats().hit_tokens)

    def step(self, requests: Sequence[Tuple[int, Any, int, bytes]] = ()) -> Dict[str, Any]:
        """Queue ``requests`` ((id, prompt tokens, max_new_tokens, namespace) each), run one
        engine step when anything is unfinished, and report: tokens sampled (id -> token),
        finished requests (id, outputs, reason), refused requests, KV events, load, counters."""
        t0 = time.perf_counter()
        rejected: List[int] = []
        failed: List[Tuple[int, str]] = []
        for rid, prompt, max_new, ns in requests:
            try:
                self.sched.add_request(rid, np.asarray(prompt, dtype=np.uint32),
                                       max_new_tokens=max_new, namespace=ns,
                                       eos_token_id=self.config.eos_token_id)
            except StepError.QueueFull:
                rejected.append(rid)
            except (StepError, ValueError, TypeError, OverflowError) as exc:
                failed.append((rid, f"{type(exc).__name__}: {exc}"))
        sampled: Dict[int, int] = {}
        finished: List[Tuple[int, List[int], str]] = []
        rep: Dict[str, Any] = dict(prefill_tokens=0, decode_tokens=0, cached_tokens=0,
                                   preempted=0, admitted=0, stepped=False)
        if self.sched.has_unfinished():
            hits_before = self._hit_tokens()
            plan = self.sched.schedule()
            try:
                ids = np.asarray(self.backend.execute_step(plan), dtype=np.uint32)
            except BaseException:
                discard = getattr(self.sched, "discard_plan", None)
                if discard is not None:
                    discard()
                raise
            rids = np.asarray(plan.sampled_request_ids).tolist()
            rep.update(prefill_tokens=int(plan.num_prefill_tokens),
                       decode_tokens=int(plan.num_decode_tokens),
                       cached_tokens=int(plan.num_cached_tokens)
                       if hasattr(plan, "num_cached_tokens")
                       else self._hit_tokens() - hits_before,
                       preempted=len(plan.preempted_request_ids),
                       admitted=len(plan.new_request_ids), stepped=True)
            done = self.sched.update(ids)
            sampled = dict(zip(rids, ids.tolist()))
            finished = [(int(f.request_id), np.asarray(f.output_tokens).tolist(),
                         f.finish_reason) for f in done]
            self.steps += 1
        f = self.facade
        rep.update(replica=self.replica_id, implementation=self.implementation,
                   sampled=sampled, finished=finished, rejected=rejected, failed=failed,
                   events=f.drain_events(),
                   running=int(self.sched.num_running), waiting=int(self.sched.num_waiting),
                   free_pages=int(f.free_pages), num_blocks=int(f.num_pages),
                   step_s=time.perf_counter() - t0)
        return rep


# --------------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------------


_REPLICA = ("replica",)

# ClusterMetrics' metrics: (attribute, Gauge or Counter, metric name, help text, labels)
_METRICS: Tuple[Tuple[str, str, str, str, Tuple[str, ...]], ...] = (
    ("up", "Gauge", "qualia_replica_up", "1 while the replica is live", _REPLICA),
    ("running", "Gauge", "qualia_replica_requests_running", "requests running", _REPLICA),
    ("waiting", "Gauge", "qualia_replica_requests_waiting", "requests waiting", _REPLICA),
    ("pool", "Gauge", "qualia_replica_pool_usage", "fraction of KV pages not free", _REPLICA),
    ("hit_rate", "Gauge", "qualia_replica_cache_hit_rate",
     "cached prompt tokens / (cached + computed prefill tokens)", _REPLICA),
    ("cached", "Counter", "qualia_replica_cached_tokens", "prompt tokens the cache skipped",
     _REPLICA),
    ("prefill", "Counter", "qualia_replica_prefill_tokens", "prefill tokens computed", _REPLICA),
    ("generated", "Counter", "qualia_replica_generated_tokens", "tokens sampled", _REPLICA),
    ("preemptions", "Counter", "qualia_replica_preemptions", "requests preempted", _REPLICA),
    ("decisions", "Counter", "qualia_router_decisions", "routing decisions",
     ("policy", "replica")),
    ("resubmitted", "Counter", "qualia_router_resubmitted",
     "requests resubmitted after their replica died", ()),
    ("deaths", "Counter", "qualia_router_replica_deaths", "replicas found dead", ()),
    ("completed", "Counter", "qualia_router_requests_completed", "requests completed", ()),
    ("identities", "Gauge", "qualia_router_index_identities",
     "page identities in the router's index", ()),
    ("router_hit", "Gauge", "qualia_router_cache_hit_rate",
     "cached-token hit rate over every replica", ()),
)


class ClusterMetrics:
    """Prometheus metrics of the replicas (labelled ``replica``, from what each reports every
    step) and of the router, in a registry of their own; :meth:`serve` exposes them over HTTP
    (the exposition format) on ``port``.  One attribute a metric, declared in ``_METRICS``."""

    up: Any
    running: Any
    waiting: Any
    pool: Any
    hit_rate: Any
    cached: Any
    prefill: Any
    generated: Any
    preemptions: Any
    decisions: Any
    resubmitted: Any
    deaths: Any
    completed: Any
    identities: Any
    router_hit: Any

    def __init__(self) -> None:
        import prometheus_client
        self.registry = prometheus_client.CollectorRegistry()
        for attr, kind, name, help_text, labels in _METRICS:
            setattr(self, attr, getattr(prometheus_client, kind)(name, help_text, labels,
                                                                 registry=self.registry))
        self._server: Any = None

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve the metrics on ``addr:port`` (0: any free port); returns the port."""
        from prometheus_client import start_http_server
        started = start_http_server(port, addr=addr, registry=self.registry)
        self._server = started[0] if isinstance(started, tuple) else None
        return self._server.server_port if self._server is not None else port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


# --------------------------------------------------------------------------------------------
# the router
# --------------------------------------------------------------------------------------------


@dataclass
class _Track:
    """The router's record of one request."""

    req: Any                       # the workload Request (prompt, max_new_tokens, namespace ...)
    arrival_step: int
    arrival_s: float
    owner: int = -1
    outputs: List[int] = field(default_factory=list)   # every token reported so far
    base: int = 0                  # outputs already known when it was last (re)submitted
    first_token_step: Optional[int] = None
    first_token_s: Optional[float] = None
    done: bool = False
    resubmits: int = 0
    predicted_pages: int = 0


@dataclass
class ClusterResult:
    """What a run produced: outputs by request, completion counts, the summary figures."""

    policy: str
    replicas: int
    outputs: Dict[int, List[int]]
    completions: Dict[int, int]
    requests: Dict[int, Any]
    summary: Dict[str, Any]
    arrived: Dict[int, int] = field(default_factory=dict)   # the step each request arrived at


def init_local_ray(num_cpus: int = 2) -> None:
    """Start a local Ray for this process, from a neutral working directory.

    Ray's workers start in the driver's working directory and put it first on ``sys.path``: from
    a checkout's root, the source folder ``qualia/`` (whose compiled core is not built there)
    would hide the installed package in every replica.  Ray is started from an empty temporary
    folder instead, and this process's working directory is restored at once."""
    import tempfile

    ray = _ray()
    here = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="qualia-ray-") as neutral:
        os.chdir(neutral)
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
        finally:
            os.chdir(here)


class _LocalHandle:
    def __init__(self, rid: int, config: ReplicaConfig) -> None:
        self.obj: Optional[Replica] = Replica(rid, config)

    def start(self, reqs):
        if self.obj is None:
            return RuntimeError("replica killed")
        try:
            return self.obj.step(reqs)
        except Exception as exc:  # a replica failure: the router treats it as a death
            return exc

    def result(self, fut, timeout):
        if isinstance(fut, BaseException):
            raise fut
        return fut

    def kill(self) -> None:
        self.obj = None


_ACTOR: List[Any] = []   # the Ray actor class of Replica, made once


class _RayHandle:
    def __init__(self, rid: int, config: ReplicaConfig) -> None:
        if not _ACTOR:
            # num_cpus=0: replicas are scheduled however few CPUs the Ray cluster declares
            _ACTOR.append(_ray().remote(num_cpus=0, max_restarts=0)(Replica))
        self.actor = _ACTOR[0].remote(rid, config)

    def start(self, reqs):
        return self.actor.step.remote(list(reqs))

    def result(self, fut, timeout):
        return _ray().get(fut, timeout=timeout)

    def kill(self) -> None:
        _ray().kill(self.actor, no_restart=True)


class Cluster:
    """``replicas`` engines behind one router (see the module docstring).

    ``policy``: one of :data:`POLICIES`.  ``local=True`` runs the replicas in this process
    (no Ray).  ``load_weight``: the prefix policy's cost, in pages, of one request queued on a
    replica.  ``metrics``: a :class:`ClusterMetrics` to update.  ``step_timeout``: seconds a
    replica's step may take before it is declared dead.  ``max_resubmits``: how many replica
    deaths one request may go through; one more raises ``RuntimeError`` (a request whose every
    replica dies is more likely killing them than unlucky, and resubmitting it forever would
    never end)."""

    def __init__(self, replicas: int, policy: str = "prefix",
                 config: Optional[ReplicaConfig] = None, *, local: bool = False,
                 load_weight: float = 0.25, metrics: Optional[ClusterMetrics] = None,
                 step_timeout: float = 60.0, index_capacity: Optional[int] = None,
                 max_resubmits: int = 3) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if not 1 <= int(replicas) <= 64:
            raise ValueError(f"replicas must be in [1, 64], got {replicas}")
        self.n = int(replicas)
        self.policy = policy
        self.config = config if config is not None else ReplicaConfig()
        self.local = bool(local)
        self.load_weight = float(load_weight)
        self.metrics = metrics
        self.step_timeout = float(step_timeout)
        self.max_resubmits = int(max_resubmits)
        if self.max_resubmits < 0:
            raise ValueError(f"max_resubmits must be at least 0, got {max_resubmits}")
        c = self.config
        self.index = qualia.PrefixRouterIndex(
            index_capacity if index_capacity is not None else 2 * self.n * c.num_blocks + 64,
            self.n)
        # the router computes page identities with the replicas' cache key
        self._ident = qualia.Scheduler(1, 1, c.page_tokens, 1, cache_key=c.cache_key)
        self._match = np.zeros(self.n, dtype=np.uint32)
        self.handles: List[Any] = [self._spawn(r) for r in range(self.n)]
        self.live = [True] * self.n
        self.load = [0] * self.n          # running + waiting (last report) + routed since
        self.died_at: Dict[int, int] = {}
        self.rr = 0
        self.decisions = [0] * self.n
        self.deaths = 0
        self.rejoins = 0
        self.killed_at: Optional[int] = None   # the step the last run killed a replica at
        self.conversations_cut = 0             # next turns of the last run no replica can serve
        self.idle_steps = 0                    # steps of the last run skipped: nothing to do
        self.resubmitted = 0
        self.duplicates_ignored = 0
        self._counters = dict(cached=0, prefill=0, decode=0, preempted=0, generated=0)
        self._per_replica = [dict(cached=0, prefill=0) for _ in range(self.n)]
        self.implementations: set = set()   # the schedulers the replicas reported

    # -- replicas ----------------------------------------------------------------------------------
    def _spawn(self, r: int):
        return _LocalHandle(r, self.config) if self.local else _RayHandle(r, self.config)

    def kill(self, r: int) -> None:
        """Kill replica ``r``'s actor (fault injection); the router finds out at its next step
        call, as it would for a real fault."""
        self.handles[r].kill()

    def _on_death(self, r: int, step: int, tracks: Dict[int, _Track],
                  queue: Deque[int]) -> None:
        self.live[r] = False
        self.died_at[r] = step
        try:
            self.handles[r].kill()      # a replica that timed out must not come back by itself
        except Exception:
            pass
        self.deaths += 1
        self.index.remove_replica(r)
        self.load[r] = 0
        lost = [rid for rid, t in tracks.items() if t.owner == r and not t.done]
        for rid in lost:
            t = tracks[rid]
            t.owner = -1
            t.base = len(t.outputs)
            t.resubmits += 1
            self.resubmitted += 1
            if t.resubmits > self.max_resubmits:
                raise RuntimeError(f"request {rid} was on {t.resubmits} replicas that died "
                                   f"(max_resubmits={self.max_resubmits}); giving up on it")
        queue.extendleft(reversed(lost))   # first in line, in their order
        if self.metrics is not None:
            self.metrics.deaths.inc()
            self.metrics.resubmitted.inc(len(lost))
            self.metrics.up.labels(str(r)).set(0)

    def _rejoin(self, r: int) -> None:
        self.handles[r] = self._spawn(r)
        self.live[r] = True
        self.load[r] = 0
        del self.died_at[r]
        self.rejoins += 1
        if self.metrics is not None:
            self.metrics.up.labels(str(r)).set(1)

    # -- routing -----------------------------------------------------------------------------------
    def _eligible(self, r: int) -> bool:
        return self.live[r] and self.load[r] < self.config.queue_limit

    def route(self, prompt: Sequence[int], namespace: bytes = b"") -> Tuple[int, int]:
        """The replica for a request (-1 when none can take it now) and the pages of its prompt
        the chosen replica holds (prefix policy; 0 otherwise)."""
        n = self.n
        if self.policy == "round-robin":
            for k in range(n):
                r = (self.rr + k) % n
                if self._eligible(r):
                    self.rr = (r + 1) % n
                    return r, 0
            return -1, 0
        if self.policy == "least-loaded":
            best = -1
            for r in range(n):
                if self._eligible(r) and (best < 0 or self.load[r] < self.load[best]):
                    best = r
            return best, 0
        ids = self._ident.page_identities(np.asarray(prompt, dtype=np.uint32), namespace)
        low = min((self.load[r] for r in range(n) if self._eligible(r)), default=0)
        cost = np.array([self.load_weight * (self.load[r] - low) if self._eligible(r)
                         else math.inf for r in range(n)])
        r = self.index.route(ids, cost, self._match)
        return r, (int(self._match[r]) if r >= 0 else 0)

    # -- the run -----------------------------------------------------------------------------------
    #: steps in a row in which replicas ran and none computed a token or finished a request,
    #: with requests unfinished, after which a run is declared stuck (``RuntimeError``)
    MAX_STALLED_STEPS = 10_000

    def run(self, workload, *, kill_replica_at: Optional[int] = None, kill_replica: int = -1,
            rejoin_after: Optional[int] = None, max_steps: Optional[int] = 100_000,
            on_step: Optional[Callable[[int, "Cluster"], None]] = None) -> ClusterResult:
        """Serve ``workload`` (a :class:`qualia.workload.Workload`, or a list of its requests:
        arrivals by ``arrival_step``, later turns by ``workload.next_turn``) until every request
        completed.  ``kill_replica_at``: the global step at which replica ``kill_replica``
        (default: the last) is killed; it is restarted ``rejoin_after`` steps after the router
        found it dead (never when None).

        Every request reaches the router at its ``arrival_step`` (a later turn: the step after
        its previous turn completed).  Steps in which nothing is queued or unfinished are
        skipped up to the next arrival (or kill, or rejoin), and so are steps with every replica
        down until the next rejoin: ``summary["idle_steps"]`` counts them.  ``max_steps``
        (None: no limit) bounds the steps the replicas run; :data:`MAX_STALLED_STEPS` steps in a
        row without progress raise ``RuntimeError``.  A later turn that no replica could ever
        serve (it outgrew the pool or ``logical_pages``) ends its conversation
        (``summary["conversations_cut"]``)."""
        reqs = list(workload.generate() if hasattr(workload, "generate") else workload)
        next_turn = getattr(workload, "next_turn", None)
        order = itertools.count()
        arrivals: List[Tuple[int, int, Any]] = []     # a heap of (arrival step, order, request)

        def arrive(q) -> None:
            heapq.heappush(arrivals, (int(q.arrival_step), next(order), q))

        for q in reqs:
            arrive(q)
        tracks: Dict[int, _Track] = {}
        arrived: Dict[int, int] = {}
        completions: Dict[int, int] = {}
        queue: Deque[int] = deque()        # routed to nobody yet: new, refused, resubmitted
        victim = self.n - 1 if kill_replica < 0 else kill_replica
        self.killed_at = None
        self.conversations_cut = 0
        self.idle_steps = 0
        unfinished = 0
        t0 = time.perf_counter()
        step = ran = stalled = 0
        step_s = 0.0
        while arrivals or queue or unfinished:
            # skip the steps in which nothing can happen: to the next arrival, kill or rejoin
            if not queue and not unfinished or not any(self.live):
                nxt = [] if not arrivals or not any(self.live) else [arrivals[0][0]]
                if kill_replica_at is not None and kill_replica_at > step and \
                        self.live[victim]:
                    nxt.append(kill_replica_at)
                if rejoin_after is not None:
                    nxt += [d + rejoin_after for d in self.died_at.values()]
                if nxt and min(nxt) > step:
                    self.idle_steps += min(nxt) - step
                    step = min(nxt)
            if max_steps is not None and ran >= max_steps:
                raise RuntimeError(f"the cluster did not finish within {max_steps} steps")
            now = time.perf_counter()
            while arrivals and arrivals[0][0] <= step:
                q = heapq.heappop(arrivals)[2]
                if q.request_id in tracks:
                    raise ValueError(f"duplicate request id {q.request_id}")
                tracks[q.request_id] = _Track(q, step, now)
                arrived[q.request_id] = step
                unfinished += 1
                queue.append(q.request_id)
            if kill_replica_at is not None and step == kill_replica_at and self.live[victim]:
                self.kill(victim)
                self.killed_at = step
            for r in list(self.died_at):
                if rejoin_after is not None and step >= self.died_at[r] + rejoin_after:
                    self._rejoin(r)
            if not any(self.live) and rejoin_after is None:
                raise RuntimeError("every replica is down")
            # route what waits, in order; what no replica can take now waits for the next step
            batches: List[List[Tuple[int, Any, int, bytes]]] = [[] for _ in range(self.n)]
            held: Deque[int] = deque()
            while queue:
                rid = queue.popleft()
                t = tracks[rid]
                prompt = list(t.req.prompt) + t.outputs
                r, pages = self.route(prompt, t.req.namespace)
                if r < 0:
                    held.append(rid)
                    continue
                t.owner = r
                t.predicted_pages = pages
                self.load[r] += 1
                self.decisions[r] += 1
                if self.metrics is not None:
                    self.metrics.decisions.labels(self.policy, str(r)).inc()
                batches[r].append((rid, prompt, t.req.max_new_tokens - len(t.outputs),
                                   t.req.namespace))
            queue = held
            # one engine step on every live replica, concurrently
            futs = {r: self.handles[r].start(batches[r]) for r in range(self.n) if self.live[r]}
            ts = time.perf_counter()
            progress = False
            for r, fut in futs.items():
                try:
                    rep = self.handles[r].result(fut, self.step_timeout)
                except Exception:
                    self._on_death(r, step, tracks, queue)
                    continue
                before = len(completions)
                self._apply(r, rep, step, tracks, completions, queue, next_turn, arrive)
                unfinished -= len(completions) - before
                progress |= bool(rep["prefill_tokens"] or rep["decode_tokens"]
                                 or rep["finished"] or rep["sampled"])
            step_s += time.perf_counter() - ts
            if futs:
                ran += 1
                stalled = 0 if progress or not unfinished else stalled + 1
                if stalled > self.MAX_STALLED_STEPS:
                    raise RuntimeError(
                        f"the cluster is stuck: {stalled} steps in a row computed nothing with "
                        f"{unfinished} requests unfinished")
            if self.metrics is not None:
                self.metrics.identities.set(len(self.index))
            if on_step is not None:
                on_step(step, self)
            step += 1
        wall = time.perf_counter() - t0
        outputs = {rid: t.outputs for rid, t in tracks.items()}
        summary = self._summary(tracks, step, wall)
        return ClusterResult(self.policy, self.n, outputs, completions,
                             {rid: t.req for rid, t in tracks.items()}, summary, arrived)

    def _apply(self, r: int, rep: Dict[str, Any], step: int, tracks: Dict[int, _Track],
               completions: Dict[int, int], queue: Deque[int], next_turn,
               arrive: Callable[[Any], None]) -> None:
        now = time.perf_counter()
        self.index.apply_events(r, rep["events"])
        self.implementations.add(rep.get("implementation", "?"))
        self.load[r] = rep["running"] + rep["waiting"]
        for rid in rep["rejected"]:
            tracks[rid].owner = -1
            queue.append(rid)
        for rid, why in rep["failed"]:
            raise RuntimeError(f"replica {r} refused request {rid}: {why}")
        for rid, tok in rep["sampled"].items():
            t = tracks[rid]
            if t.owner != r or t.done:
                self.duplicates_ignored += 1
                continue
            t.outputs.append(int(tok))
            if t.first_token_step is None:
                t.first_token_step = step
                t.first_token_s = now
        for rid, outs, _reason in rep["finished"]:
            t = tracks[rid]
            if t.owner != r or t.done:
                self.duplicates_ignored += 1
                continue
            if t.outputs[t.base:] != outs:
                raise RuntimeError(f"request {rid}: replica {r} finished with outputs that "
                                   "differ from the tokens it reported")
            t.done = True
            completions[rid] = completions.get(rid, 0) + 1
            if self.metrics is not None:
                self.metrics.completed.inc()
            if next_turn is not None:
                nxt = next_turn(t.req, t.outputs, step)
                if nxt is not None and self._unservable(nxt) is None:
                    arrive(nxt)
                elif nxt is not None:   # the conversation outgrew the pool or logical_pages
                    self.conversations_cut += 1
        c = self._counters
        c["cached"] += rep["cached_tokens"]
        c["prefill"] += rep["prefill_tokens"]
        c["decode"] += rep["decode_tokens"]
        c["preempted"] += rep["preempted"]
        c["generated"] += len(rep["sampled"])
        pr = self._per_replica[r]
        pr["cached"] += rep["cached_tokens"]
        pr["prefill"] += rep["prefill_tokens"]
        m = self.metrics
        if m is not None:
            lab = str(r)
            m.up.labels(lab).set(1)
            m.running.labels(lab).set(rep["running"])
            m.waiting.labels(lab).set(rep["waiting"])
            m.pool.labels(lab).set(1.0 - rep["free_pages"] / max(1, rep["num_blocks"]))
            m.cached.labels(lab).inc(rep["cached_tokens"])
            m.prefill.labels(lab).inc(rep["prefill_tokens"])
            m.generated.labels(lab).inc(len(rep["sampled"]))
            m.preemptions.labels(lab).inc(rep["preempted"])
            tot = pr["cached"] + pr["prefill"]
            m.hit_rate.labels(lab).set(pr["cached"] / tot if tot else 0.0)
            all_tot = c["cached"] + c["prefill"]
            m.router_hit.set(c["cached"] / all_tot if all_tot else 0.0)

    def _unservable(self, req) -> Optional[str]:
        """Why no replica can ever serve ``req`` (the engine's rule), or None."""
        from .workload import unservable_reason

        c = self.config
        return unservable_reason(f"request {req.request_id}", len(req.prompt),
                                 int(req.max_new_tokens), page_tokens=c.page_tokens,
                                 num_blocks=c.num_blocks, logical_pages=c.logical_pages)

    def _summary(self, tracks: Dict[int, _Track], steps: int, wall: float) -> Dict[str, Any]:
        c = self._counters
        ttft_steps = [t.first_token_step - t.arrival_step for t in tracks.values()
                      if t.first_token_step is not None]
        ttft_ms = [1000 * (t.first_token_s - t.arrival_s) for t in tracks.values()
                   if t.first_token_s is not None]
        prompt_tokens = c["cached"] + c["prefill"]
        out_tokens = sum(len(t.outputs) for t in tracks.values())
        return {
            "policy": self.policy, "replicas": self.n, "requests": len(tracks),
            "scheduler": "/".join(sorted(self.implementations)),
            "backend": self.config.backend,
            "completed": sum(1 for t in tracks.values() if t.done), "steps": steps,
            "wall_s": wall,
            "cached_tokens": c["cached"], "prefill_tokens": c["prefill"],
            "hit_rate": c["cached"] / prompt_tokens if prompt_tokens else 0.0,
            "output_tokens": out_tokens,
            "tokens_per_s": out_tokens / wall if wall > 0 else 0.0,
            "tokens_per_step": out_tokens / steps if steps else 0.0,
            "ttft_steps_mean": float(np.mean(ttft_steps)) if ttft_steps else 0.0,
            "ttft_steps_p90": float(np.percentile(ttft_steps, 90)) if ttft_steps else 0.0,
            "ttft_ms_mean": float(np.mean(ttft_ms)) if ttft_ms else 0.0,
            "preempted": c["preempted"], "decisions": list(self.decisions),
            "deaths": self.deaths, "rejoins": self.rejoins, "resubmitted": self.resubmitted,
            "duplicates_ignored": self.duplicates_ignored,
            "killed_at": self.killed_at, "conversations_cut": self.conversations_cut,
            "idle_steps": self.idle_steps,
            "index": self.index.stats(),
        }

    def close(self) -> None:
        """Kill every replica actor (Ray) or drop them (local)."""
        for h in self.handles:
            try:
                h.kill()
            except Exception:  # already dead
                pass


def compare_policies(workload, replicas: int, config: ReplicaConfig, *,
                     policies: Sequence[str] = POLICIES, single: bool = True,
                     local: bool = False, **run_kw) -> List[ClusterResult]:
    """Run ``workload`` under each policy on ``replicas`` replicas, and (``single``) on one
    replica with ``replicas`` times the pool and the slots (the hit rate a router should
    approach), one after the other; results in that order, the single replica last."""
    results = []
    for pol in policies:
        cl = Cluster(replicas, pol, config, local=local)
        try:
            results.append(cl.run(workload, **run_kw))
        finally:
            cl.close()
    if single:
        big = dataclasses.replace(
            config, num_blocks=config.num_blocks * replicas,
            max_requests=config.max_requests * replicas,
            max_num_batched_tokens=config.max_num_batched_tokens * replicas,
            max_num_seqs=None if config.max_num_seqs is None else config.max_num_seqs * replicas,
            max_queued=None if config.max_queued is None else config.max_queued * replicas)
        cl = Cluster(1, "round-robin", big, local=local)
        try:
            res = cl.run(workload, max_steps=run_kw.get("max_steps", 100_000))
        finally:
            cl.close()
        res.summary["policy"] = "single replica"
        res.policy = "single replica"
        results.append(res)
    return results


def format_comparison(results: Sequence[ClusterResult]) -> str:
    """The summary table: one row per run."""
    head = ("| run | replicas | hit rate | prefill tokens saved | prefill computed | out tok/s | "
            "out tok/step | TTFT steps (mean / p90) | TTFT ms | preempted | deaths | "
            "resubmitted |")
    lines = [head, "|" + "---|" * 12]
    for res in results:
        s = res.summary
        lines.append(
            f"| {s['policy']} | {s['replicas']} | {100 * s['hit_rate']:.1f}% | "
            f"{s['cached_tokens']} | {s['prefill_tokens']} | {s['tokens_per_s']:.0f} | "
            f"{s['tokens_per_step']:.1f} | {s['ttft_steps_mean']:.2f} / "
            f"{s['ttft_steps_p90']:.0f} | {s['ttft_ms_mean']:.1f} | {s['preempted']} | "
            f"{s['deaths']} | {s['resubmitted']} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# the command line: `python -m qualia simulate --replicas N ...`
# --------------------------------------------------------------------------------------------


def _bounded(lo: int, hi: int):
    import argparse

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {v}")
        return v

    parse.__name__ = "integer"
    return parse


def _finite_non_negative(text: str) -> float:
    import argparse

    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= v < math.inf:  # also nan
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return v


def add_cluster_options(p) -> None:
    """The cluster options of ``simulate`` (an argparse parser)."""
    g = p.add_argument_group("cluster (needs the qualia[cluster] extra: Ray, prometheus-client)")
    g.add_argument("--replicas", type=_bounded(1, 64), default=None, metavar="N",
                   help="serve on N data-parallel replicas (Ray actors) behind a router")
    g.add_argument("--router", choices=POLICIES, default="prefix",
                   help="routing policy (default %(default)s)")
    g.add_argument("--compare", action="store_true",
                   help="run every policy and one replica with N times the pool, side by side")
    g.add_argument("--kill-replica", type=_bounded(0, 2**31), default=None, metavar="STEP",
                   help="kill the last replica's actor at this step (fault injection)")
    g.add_argument("--rejoin-after", type=_bounded(0, 2**31), default=5, metavar="STEPS",
                   help="restart a dead replica this many steps after its death was found "
                        "(default %(default)s)")
    g.add_argument("--load-weight", type=_finite_non_negative, default=0.25, metavar="PAGES",
                   help="prefix router: pages of cached prefix one queued request is worth "
                        "(default %(default)s)")
    g.add_argument("--metrics-port", type=_bounded(0, 65535), default=None, metavar="P",
                   help="serve Prometheus metrics on 127.0.0.1:P during the run")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="an existing Ray cluster (default: a local one started for the run)")
    g.add_argument("--local", action="store_true",
                   help="run the replicas in this process, without Ray")


def wants_cluster(args) -> bool:
    """Whether ``simulate``'s arguments name any cluster option (then :func:`simulate_cli`
    runs it, and refuses cluster options without ``--replicas``)."""
    from .preflight import wants_cluster as wants

    return wants(args)


def _connect_ray(ray, address: str) -> None:
    """``ray.init`` on an existing cluster, in a bounded time: Ray's own connection loop is cut
    to one attempt (each attempt has its own timeouts, about 40 s in all; a ``ray://`` client
    gives up after about 30 s) unless the environment sets it."""
    key = "RAY_gcs_server_port_wait_time_s"
    had = key in os.environ
    os.environ.setdefault(key, "1")
    try:
        ray.init(address=address, log_to_driver=False)
    finally:
        if not had:
            del os.environ[key]


def simulate_cli(args, out=None, err=None) -> int:
    """``simulate`` with ``--replicas``: exit status as the single-engine simulate.  Every
    check before the run is :func:`qualia.preflight.check_simulate`'s, as for one engine; the
    generated requests are checked by the same rule as the engine's before Ray starts."""
    import json
    import sys

    from . import preflight
    from .check import check_outputs
    from .report import emit
    from .workload import unservable_reason

    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    # --backend model: the numpy model's own step runner on every replica; c: the hash rule
    backend = "hash" if args.backend == "c" else "model"
    try:
        prepared = preflight.check_simulate(args)
        workload, vocab = prepared.workload, prepared.vocab
        config = ReplicaConfig(max_requests=args.max_requests, num_blocks=args.num_blocks,
                               page_tokens=args.page_tokens, logical_pages=args.logical_pages,
                               max_num_batched_tokens=getattr(args, "max_batched_tokens", 512),
                               max_num_seqs=getattr(args, "max_seqs", None),
                               max_prefill_chunk=getattr(args, "chunk", None),
                               backend=backend, vocab=vocab, eos_token_id=args.end_token)
        make_scheduler(config)      # bad step options are refused here, before Ray starts
        requests = _Generated(workload)
        for q in requests.requests:
            why = unservable_reason(f"request {q.request_id}", len(q.prompt), q.max_new_tokens,
                                    page_tokens=config.page_tokens,
                                    num_blocks=config.num_blocks,
                                    logical_pages=config.logical_pages)
            if why is not None:
                raise preflight.Refused(f"{why} (raise --num-blocks/--logical-pages/"
                                        "--page-tokens or lower --prompt-len/--output-len)")
    except (preflight.Refused, ValueError, TypeError, OverflowError) as exc:
        print(f"error: {exc}", file=err)
        return 2
    metrics = None
    if args.metrics_port is not None:   # before Ray: a port taken since the check fails fast
        try:
            metrics = ClusterMetrics()
            port = metrics.serve(args.metrics_port)
        except OSError as exc:
            print(f"error: argument --metrics-port: cannot listen on "
                  f"127.0.0.1:{args.metrics_port}: {exc.strerror or exc}", file=err)
            return 2
        if not args.quiet:
            print(f"metrics on http://127.0.0.1:{port}/metrics", file=err)
    ray = None
    try:
        if not args.local:
            ray = _ray()
            if ray.is_initialized():     # a caller's Ray (tests, notebooks): used, left running
                ray = None
            elif args.ray_address:
                try:
                    _connect_ray(ray, args.ray_address)
                except (ConnectionError, RuntimeError, ValueError, TimeoutError, OSError) as exc:
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else \
                        type(exc).__name__
                    print(f"error: argument --ray-address {args.ray_address}: cannot connect "
                          f"to a Ray cluster there: {first}", file=err)
                    ray = None
                    return 2
            else:
                init_local_ray(num_cpus=2)
        # no step limit (Ctrl-C stops a run; a stuck one is detected)
        kw = dict(kill_replica_at=args.kill_replica, rejoin_after=args.rejoin_after,
                  max_steps=None)
        if args.compare:
            results = []
            for pol in POLICIES:
                cl = Cluster(args.replicas, pol, config, local=args.local, metrics=metrics,
                             load_weight=args.load_weight)
                try:
                    results.append(cl.run(requests, **kw))
                finally:
                    cl.close()
            results += compare_policies(requests, args.replicas, config, policies=(),
                                        local=args.local, max_steps=None)
        else:
            cl = Cluster(args.replicas, args.router, config, local=args.local, metrics=metrics,
                         load_weight=args.load_weight)
            try:
                results = [cl.run(requests, **kw)]
            finally:
                cl.close()
    except RuntimeError as exc:   # the run failed: stuck, or replicas kept dying
        print(f"error: the replicas' run failed: {exc}", file=err)
        return 1
    finally:
        if metrics is not None:
            metrics.close()
        if ray is not None:
            ray.shutdown()
    ok = True
    messages = []
    for res in results:
        once = all(n == 1 for n in res.completions.values()) and \
            set(res.completions) == set(res.requests)
        line = (f"{res.policy}: {len(res.completions)} of {len(res.requests)} requests "
                f"completed {'exactly once' if once else 'NOT exactly once'} (scheduler: "
                f"{res.summary['scheduler']}, backend: {backend})")
        if res.summary.get("conversations_cut"):
            line += (f"; {res.summary['conversations_cut']} conversations cut (a next turn "
                     "outgrew the pool or --logical-pages)")
        ok &= once
        if args.check:
            chk = check_outputs(res.requests, res.outputs, end_token=args.end_token, vocab=vocab,
                                weights=model_weights(config) if backend == "model" else None)
            line += f"; check: {chk.describe()}"
            ok &= chk.ok
        messages.append(line)
    if args.json:
        text = json.dumps([r.summary for r in results], indent=2, sort_keys=True, default=str)
        if args.json == "-":
            emit(text, out)
        else:
            try:
                with open(args.json, "w", encoding="utf-8") as f:
                    f.write(text + "\n")
            except OSError as exc:
                print(f"error: --json {args.json}: {exc.strerror or exc}", file=err)
                return 2
    if not args.quiet and args.json != "-":
        emit(format_comparison(results) + "\n" + "\n".join(messages), out)
    elif not ok:
        print("\n".join(messages), file=err)
    if args.kill_replica is not None:
        missed = [r for r in results if r.policy != "single replica"
                  and r.summary["killed_at"] is None]
        if missed:
            steps = max(r.summary["steps"] for r in missed)
            print(f"error: argument --kill-replica: the run ended after {steps} steps, before "
                  f"step {args.kill_replica}: no replica was killed (give a step below "
                  f"{steps})", file=err)
            return 2
    return 0 if ok else 1


class _Generated:
    """A workload generated once (its requests, checked before the run) and its next turns:
    what :meth:`Cluster.run` takes."""

    def __init__(self, workload) -> None:
        self.requests = list(workload.generate())
        self.next_turn = getattr(workload, "next_turn", None)

    def generate(self):
        return list(self.requests)
