"""The cluster: replicas behind the router, driven one engine step at a time, with replica
deaths, resubmission and rejoins (see :mod:`qualia.cluster`).

Time: one serving clock for the whole cluster (:func:`qualia.sim.clock.serving_clock`; by
default the modeled time on the default GPU profile, each replica on a GPU of its own).  The
replicas step together: a cluster step takes the longest of its replicas' step times, and every
token sampled in it is delivered at its end.  Requests arrive by the serving clock (a
workload's ``arrival_s``; a later turn when the previous one completed), and the run reports
vLLM's serving figures (:func:`qualia.sim.figures.serving_figures`) and the prefix cache's hit
rate (:func:`qualia.sim.figures.prefix_cache_hit_rate`) with the single engine's definitions.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

from ..sim.clock import serving_clock
from ..sim.figures import RequestRecord, prefix_cache_hit_rate, serving_figures
from ..sim.report import step_figures
from ..sim.workload import Arrivals, UnservableRequest, checked_request
from .metrics import ClusterMetrics
from .replica import Replica, ReplicaConfig
from .router import POLICIES, Router, checked_load_weight, checked_step_timeout

__all__ = ["Cluster", "ClusterResult", "init_local_ray", "compare_policies", "format_comparison"]


def _integer(name: str, value: Any) -> int:
    """``value`` as a plain int: an integer (not a bool, a float or a string), else
    ``TypeError`` naming ``name``."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None


def _ray():
    try:
        import ray
    except ImportError:  # pragma: no cover - depends on the environment
        from ..sim.resources import install_hint

        raise ImportError("qualia.cluster needs Ray: " + install_hint("cluster", "ray")) from None
    return ray





@dataclass
class _Track:
    """The router's record of one request."""

    req: Any                       # the workload Request (prompt, max_new_tokens, namespace ...)
    arrival_step: int
    arrival_s: float               # on the serving clock
    owner: int = -1
    outputs: List[int] = field(default_factory=list)   # every token reported so far
    times: List[float] = field(default_factory=list)   # and when each was delivered
    base: int = 0                  # outputs already known when it was last (re)submitted
    first_token_step: Optional[int] = None
    end_step: Optional[int] = None
    done: bool = False
    resubmits: int = 0
    predicted_pages: int = 0


@dataclass
class ClusterResult:
    """What a run produced: outputs by request, completion counts, the summary (vLLM's figures,
    the prefix cache's hit rate, the latencies in steps and the cluster's counters), one
    :class:`~qualia.sim.figures.RequestRecord` per request, and the step and the serving time
    each request arrived at."""

    policy: str
    """The routing policy that ran (``prefix``, ``round-robin``, ``least-loaded``)."""
    replicas: int
    """Replicas in the cluster."""
    outputs: Dict[int, List[int]]
    """Each request's generated tokens, by request id."""
    completions: Dict[int, int]
    """How many times each request completed (exactly once in a correct run)."""
    requests: Dict[int, Any]
    """The requests served, by id."""
    summary: Dict[str, Any]
    """vLLM's figures, the prefix cache's hit rate, the latencies in steps and the cluster's
    counters."""
    arrived: Dict[int, int] = field(default_factory=dict)
    """The step each request arrived at."""
    records: Dict[int, RequestRecord] = field(default_factory=dict)
    """One ``RequestRecord`` per completed request, by id."""
    arrived_s: Dict[int, float] = field(default_factory=dict)
    """The serving time each request arrived at, by id."""

    def to_dict(self) -> Dict[str, Any]:
        """The JSON report of the run, shaped as the single engine's: vLLM's figures under its
        keys, ``requests`` (one row per completed request, by id) and ``stats`` (the cluster's
        own figures)."""
        from ..sim.figures import request_rows

        figures = serving_figures([self.records[k] for k in sorted(self.records)],
                                  start_s=0.0)
        out: Dict[str, Any] = dict(figures)
        out["requests"] = request_rows(self.records[k] for k in sorted(self.records))
        out["stats"] = {k: v for k, v in self.summary.items() if k not in figures}
        return out


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

    def drain(self, timeout):
        if self.obj is None:
            raise RuntimeError("replica killed")
        return self.obj.drain()

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

    def drain(self, timeout):
        return _ray().get(self.actor.drain.remote(), timeout=timeout)

    def kill(self) -> None:
        _ray().kill(self.actor, no_restart=True)


class Cluster:
    """``replicas`` engines behind one router (see the module docstring).

    ``policy``: one of :data:`POLICIES`.  ``local=True`` runs the replicas in this process
    (no Ray).  ``clock``: the serving clock (:func:`qualia.sim.clock.serving_clock`: None, the
    modeled time on the default profile).  ``load_weight``: the prefix policy's cost, in pages,
    of one request queued on a replica (a finite real number >= 0).  ``metrics``: a
    :class:`ClusterMetrics` to update.
    ``step_timeout``: seconds a replica's step may take before it is declared dead (a finite
    real number > 0).  Both take any real number (``Fraction`` and ``Decimal`` included,
    converted with ``float``); anything else is a ``TypeError``.
    ``max_resubmits``: how many replica
    deaths one request may go through; one more raises ``RuntimeError`` (a request whose every
    replica dies is more likely killing them than unlucky, and resubmitting it forever would
    never end)."""

    killed_at: Optional[int]
    """The step the last run killed a replica at (None: none)."""
    implementations: set
    """The schedulers the replicas of the last run reported (``core``, ``twin``)."""

    def __init__(self, replicas: int, policy: str = "prefix",
                 config: Optional[ReplicaConfig] = None, *, local: bool = False,
                 load_weight: float = 0.25, metrics: Optional[ClusterMetrics] = None,
                 step_timeout: float = 60.0, index_capacity: Optional[int] = None,
                 max_resubmits: int = 3, clock: Any = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        n = _integer("replicas", replicas)
        if not 1 <= n <= 64:
            raise ValueError(f"replicas must be in [1, 64], got {n}")
        self.n = n
        self.policy = policy
        self.load_weight = checked_load_weight(load_weight)
        self.step_timeout = checked_step_timeout(step_timeout)
        self.max_resubmits = _integer("max_resubmits", max_resubmits)
        if self.max_resubmits < 0:
            raise ValueError(f"max_resubmits must be at least 0, got {max_resubmits}")
        self.clock = serving_clock(clock)
        self.config = config if config is not None else ReplicaConfig()
        self.local = bool(local)
        self.metrics = metrics
        self.router = Router(self.n, policy, self.config, load_weight=self.load_weight,
                             index_capacity=index_capacity)
        self.index = self.router.index
        self.handles: List[Any] = [self._spawn(r) for r in range(self.n)]
        self.died_at: Dict[int, int] = {}
        self._reset_run()

    def _reset_run(self) -> None:
        """Zero the figures of a run: each run reports only itself."""
        self.decisions = [0] * self.n
        self.deaths = 0
        self.rejoins = 0
        self.killed_at = None   # the step the last run killed a replica at
        self.conversations_cut = 0             # next turns of the last run no replica can serve
        self.idle_steps = 0                    # steps of the last run skipped: nothing to do
        self.resubmitted = 0
        self.duplicates_ignored = 0
        self._counters = dict(cached=0, lookup=0, prefill=0, decode=0, preempted=0,
                              generated=0)
        self._per_replica = [dict(cached=0, lookup=0) for _ in range(self.n)]
        self.now = 0.0      # the serving clock of the last run, seconds
        self.busy_s = 0.0   # its time in steps (idle gaps skipped are not)
        self.idle_s = 0.0
        self.implementations = set()   # the schedulers the replicas reported
        for r in self.died_at:  # still down from an earlier run: found dead at its step 0
            self.died_at[r] = 0

    def _drain_replicas(self) -> List[int]:
        """Before a run: every live replica aborts the requests an earlier run left it (a run
        that raised leaves its unfinished requests on the replicas) and keeps its cache; the
        index applies its events, and its load is 0.  Returns the replicas that could not be
        drained (killed, or no answer within ``step_timeout``): the run finds them dead at its
        step 0, before it routes anything."""
        dead = []
        for r in range(self.n):
            if not self.live[r]:
                continue
            try:
                events = self.handles[r].drain(self.step_timeout)
            except Exception:
                dead.append(r)
                continue
            self.index.apply_events(r, events)
            self.load[r] = 0
        return dead

    @property
    def live(self) -> List[bool]:
        """Per replica: whether it is live (the router's record)."""
        return self.router.live

    @live.setter
    def live(self, value: List[bool]) -> None:
        self.router.live = list(value)

    @property
    def load(self) -> List[int]:
        """Per replica: running + waiting at its last report + routed to it since."""
        return self.router.load

    @load.setter
    def load(self, value: List[int]) -> None:
        self.router.load = list(value)

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
    def route(self, prompt: Sequence[int], namespace: bytes = b"") -> Tuple[int, int]:
        """The replica for a request (-1 when none can take it now) and the pages of its prompt
        the chosen replica holds (:meth:`Router.route`)."""
        return self.router.route(prompt, namespace)

    # -- the run -----------------------------------------------------------------------------------
    #: steps in a row in which replicas ran and none computed a token or finished a request,
    #: with requests unfinished, after which a run is declared stuck (``RuntimeError``)
    MAX_STALLED_STEPS = 10_000

    def run(self, workload, *, kill_replica_at: Optional[int] = None, kill_replica: int = -1,
            rejoin_after: Optional[int] = None, max_steps: Optional[int] = 100_000,
            on_step: Optional[Callable[[int, "Cluster"], None]] = None) -> ClusterResult:
        """Serve ``workload`` (a :class:`qualia.sim.workload.Workload`, or a list of its requests:
        arrivals by ``arrival_s`` and ``arrival_step``, later turns by ``workload.next_turn``)
        until every request completed.  ``kill_replica_at``: the cluster step at which replica
        ``kill_replica`` (default: the last) is killed; it is restarted ``rejoin_after`` steps
        after the router found it dead (never when None).

        Every request reaches the router once the serving clock reaches its ``arrival_s`` and
        the cluster its ``arrival_step`` (a later turn: when its previous turn completed, at
        the next step).  With nothing queued or unfinished the clock jumps to the next arrival
        (``summary["idle_s"]``), and the steps to the next kill or rejoin, as they do with
        every replica down until the next rejoin (``summary["idle_steps"]``).  ``max_steps``
        (None: no limit) bounds the steps the replicas run; :data:`MAX_STALLED_STEPS` steps in
        a row without progress raise ``RuntimeError``.  A later turn that no replica could ever
        serve (it outgrew the pool or ``logical_pages``, or it would arrive after the latest
        arrival a run may have, 1e9 s) ends its conversation (``summary["conversations_cut"]``).

        Before anything runs, the arguments and every request are checked as the engine checks
        them (:func:`qualia.sim.workload.checked_request`; a request id used twice is a
        duplicate): a mistake is a ``ValueError`` or ``TypeError`` and changes nothing.  Each
        run reports only itself (its counters start at 0) and serves only its own requests:
        each live replica first aborts what an earlier run left it (a run that raised leaves
        its unfinished requests there); the replicas keep their caches, and a replica still
        down from an earlier run, or one that cannot be drained, counts as found dead at step
        0."""
        kill_replica_at, victim, rejoin_after, max_steps = self._checked_run_arguments(
            kill_replica_at, kill_replica, rejoin_after, max_steps, on_step)
        reqs = [self._checked(q)
                for q in (workload.generate() if hasattr(workload, "generate") else workload)]
        seen: set = set()
        for q in reqs:
            if q.request_id in seen:
                raise ValueError(f"request {q.request_id}: duplicate request id")
            seen.add(q.request_id)
        next_turn = getattr(workload, "next_turn", None)
        undrained = self._drain_replicas()
        self._reset_run()
        for r in undrained:   # found dead at step 0: nothing of this run is lost with it
            self._on_death(r, 0, {}, deque())
        arrivals = Arrivals()
        for q in reqs:
            arrivals.push(q)
        tracks: Dict[int, _Track] = {}
        arrived: Dict[int, int] = {}
        completions: Dict[int, int] = {}
        records: Dict[int, RequestRecord] = {}
        queue: Deque[int] = deque()        # routed to nobody yet: new, refused, resubmitted
        unfinished = 0
        t0 = time.perf_counter()
        step = ran = stalled = 0
        while len(arrivals) or queue or unfinished:
            # skip what cannot happen: to the next arrival (by time), kill or rejoin (by step)
            if not queue and not unfinished or not any(self.live):
                nxt = []
                if len(arrivals) and any(self.live):
                    at_step, at_s = arrivals.next_event(step, self.now)
                    if at_s > self.now:     # at its step already: due once the clock is there
                        self.idle_s += at_s - self.now
                        self.now = at_s
                    nxt.append(at_step)
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
            for q in arrivals.due(step, self.now):
                if q.request_id in tracks:
                    raise ValueError(f"request {q.request_id}: duplicate request id")
                at = self.now if q.arrival_s is None else float(q.arrival_s)
                tracks[q.request_id] = _Track(q, step, at)
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
                prompt = t.req.prompt.tolist() + t.outputs
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
            # one engine step on every live replica, concurrently; the cluster's step takes
            # the longest of theirs on the serving clock, and its tokens come at its end
            futs = {r: self.handles[r].start(batches[r]) for r in range(self.n) if self.live[r]}
            reps: Dict[int, Dict[str, Any]] = {}
            for r, fut in futs.items():
                try:
                    reps[r] = self.handles[r].result(fut, self.step_timeout)
                except Exception:
                    self._on_death(r, step, tracks, queue)
            dt = max((float(self.clock.step_time(rep["work"], rep["step_s"]))
                      for rep in reps.values() if rep["work"] is not None), default=0.0)
            self.now += dt
            self.busy_s += dt
            progress = False
            for r, rep in reps.items():
                before = len(completions)
                self._apply(r, rep, step, tracks, completions, records, queue, next_turn,
                            arrivals)
                unfinished -= len(completions) - before
                progress |= bool(rep["prefill_tokens"] or rep["decode_tokens"]
                                 or rep["finished"] or rep["sampled"])
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
        summary = self._summary(tracks, records, step, wall)
        return ClusterResult(self.policy, self.n, outputs, completions,
                             {rid: t.req for rid, t in tracks.items()}, summary, arrived,
                             records, {rid: t.arrival_s for rid, t in tracks.items()})

    def _apply(self, r: int, rep: Dict[str, Any], step: int, tracks: Dict[int, _Track],
               completions: Dict[int, int], records: Dict[int, RequestRecord],
               queue: Deque[int], next_turn, arrivals: Arrivals) -> None:
        now = self.now
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
            t.times.append(now)
            if t.first_token_step is None:
                t.first_token_step = step
        for rid, outs, _reason in rep["finished"]:
            t = tracks[rid]
            if t.owner != r or t.done:
                self.duplicates_ignored += 1
                continue
            if t.outputs[t.base:] != outs:
                raise RuntimeError(f"request {rid}: replica {r} finished with outputs that "
                                   "differ from the tokens it reported")
            t.done = True
            t.end_step = step
            records[rid] = RequestRecord(rid, t.arrival_s, t.times[0], t.times[-1],
                                         len(t.req.prompt), len(t.outputs), tuple(t.times))
            completions[rid] = completions.get(rid, 0) + 1
            if self.metrics is not None:
                self.metrics.completed.inc()
            if next_turn is not None:
                nxt = next_turn(t.req, t.outputs, step, now)
                if nxt is not None:
                    try:
                        arrivals.push(self._checked(nxt))
                    except UnservableRequest:   # it outgrew the pool or logical_pages,
                        # or it arrives after the latest arrival a run may have
                        self.conversations_cut += 1
        c = self._counters
        c["cached"] += rep["cached_tokens"]
        c["lookup"] += rep["lookup_tokens"]
        c["prefill"] += rep["prefill_tokens"]
        c["decode"] += rep["decode_tokens"]
        c["preempted"] += rep["preempted"]
        c["generated"] += len(rep["sampled"])
        pr = self._per_replica[r]
        pr["cached"] += rep["cached_tokens"]
        pr["lookup"] += rep["lookup_tokens"]
        m = self.metrics
        if m is not None:
            lab = str(r)
            m.up.labels(lab).set(1)
            m.running.labels(lab).set(rep["running"])
            m.waiting.labels(lab).set(rep["waiting"])
            m.pool.labels(lab).set(1.0 - rep["free_pages"] / max(1, rep["num_pages"]))
            m.cached.labels(lab).inc(rep["cached_tokens"])
            m.prefill.labels(lab).inc(rep["prefill_tokens"])
            m.generated.labels(lab).inc(len(rep["sampled"]))
            m.preemptions.labels(lab).inc(rep["preempted"])
            m.hit_rate.labels(lab).set(prefix_cache_hit_rate(pr["cached"], pr["lookup"]))
            m.router_hit.set(prefix_cache_hit_rate(c["cached"], c["lookup"]))

    def _checked(self, req) -> Any:
        """``req`` checked as the engine checks a submission
        (:func:`~qualia.sim.workload.checked_request`: its fields, its token ids, below the
        model's vocabulary for the model backend, and that a replica can ever serve it)."""
        c = self.config
        return checked_request(req, page_tokens=c.page_tokens, num_pages=c.num_pages,
                               logical_pages=c.logical_pages,
                               vocab=c.vocab if c.backend == "model" else None)

    def _checked_run_arguments(self, kill_replica_at, kill_replica, rejoin_after, max_steps,
                               on_step) -> Tuple[Optional[int], int, Optional[int],
                                                 Optional[int]]:
        """Check :meth:`run`'s fault-injection, step and callback arguments; the values the
        run uses: ``kill_replica_at``, the replica to kill, ``rejoin_after`` and ``max_steps``
        as plain ints (or None)."""
        steps: List[Optional[int]] = []
        for name, value in (("kill_replica_at", kill_replica_at),
                            ("rejoin_after", rejoin_after), ("max_steps", max_steps)):
            n = None if value is None else _integer(name, value)
            if n is not None and n < 0:
                raise ValueError(f"{name} must be None or an integer >= 0, got {value!r}")
            steps.append(n)
        victim = _integer("kill_replica", kill_replica)
        if not -1 <= victim < self.n:
            raise ValueError(f"kill_replica must be a replica in [0, {self.n - 1}] or -1 "
                             f"(the last), got {kill_replica!r}")
        if on_step is not None and not callable(on_step):
            raise TypeError(f"on_step must be None or a callable, got {on_step!r}")
        return steps[0], self.n - 1 if victim < 0 else victim, steps[1], steps[2]

    def _summary(self, tracks: Dict[int, _Track], records: Dict[int, RequestRecord],
                 steps: int, wall: float) -> Dict[str, Any]:
        """vLLM's figures of the run and the cluster's own (see :class:`ClusterResult`)."""
        c = self._counters
        lat: Dict[str, List[float]] = {"ttft_steps": [], "tpot_steps": [], "e2el_steps": []}
        for t in tracks.values():
            if t.done and t.first_token_step is not None and t.end_step is not None:
                lat["ttft_steps"].append(float(t.first_token_step - t.arrival_step + 1))
                lat["e2el_steps"].append(float(t.end_step - t.arrival_step + 1))
                if len(t.outputs) > 1:
                    lat["tpot_steps"].append((t.end_step - t.first_token_step)
                                             / (len(t.outputs) - 1))
        out: Dict[str, Any] = dict(serving_figures([records[k] for k in sorted(records)],
                                                   start_s=0.0))
        out.update({
            "policy": self.policy, "replicas": self.n, "requests": len(tracks),
            "scheduler": "/".join(sorted(self.implementations)),
            "backend": self.config.backend, "clock": self.clock.describe(),
            "steps": steps, "busy_s": self.busy_s, "idle_s": self.idle_s,
            "idle_steps": self.idle_steps, "wall_s": wall,
            "prefix_cache_hit_rate": prefix_cache_hit_rate(c["cached"], c["lookup"]),
            "cache_hit_tokens": c["cached"], "cache_lookup_tokens": c["lookup"],
            "tokens_prefilled": c["prefill"], "tokens_decoded": c["decode"],
            **step_figures(lat),
            "preemptions": c["preempted"], "decisions": list(self.decisions),
            "deaths": self.deaths, "rejoins": self.rejoins, "resubmitted": self.resubmitted,
            "duplicates_ignored": self.duplicates_ignored,
            "killed_at": self.killed_at, "conversations_cut": self.conversations_cut,
            "index": self.index.stats(),
        })
        return out

    def close(self) -> None:
        """Kill every replica actor (Ray) or drop them (local)."""
        for h in self.handles:
            try:
                h.kill()
            except Exception:  # already dead
                pass


def compare_policies(workload, replicas: int, config: ReplicaConfig, *,
                     policies: Sequence[str] = POLICIES, single: bool = True,
                     local: bool = False, clock: Any = None, **run_kw) -> List[ClusterResult]:
    """Run ``workload`` under each policy on ``replicas`` replicas, and (``single``) on one
    replica with ``replicas`` times the pool and the slots (the hit rate a router should
    approach), one after the other, on the serving clock ``clock``; results in that order,
    the single replica last."""
    results = []
    for pol in policies:
        cl = Cluster(replicas, pol, config, local=local, clock=clock)
        try:
            results.append(cl.run(workload, **run_kw))
        finally:
            cl.close()
    if single:
        big = dataclasses.replace(
            config, num_pages=config.num_pages * replicas,
            max_num_seqs=config.max_num_seqs * replicas,
            max_num_batched_tokens=config.max_num_batched_tokens * replicas,
            max_queued=None if config.max_queued is None else config.max_queued * replicas)
        cl = Cluster(1, "round-robin", big, local=local, clock=clock)
        try:
            res = cl.run(workload, max_steps=run_kw.get("max_steps", 100_000))
        finally:
            cl.close()
        res.summary["policy"] = "single replica"
        res.policy = "single replica"
        results.append(res)
    return results


def format_comparison(results: Sequence[ClusterResult]) -> str:
    """The runs side by side, one row each: vLLM's figures (request and output throughput,
    mean and p99 TTFT, mean TPOT, in milliseconds) and the prefix cache's hit rate, with the
    same definitions as the single engine's summary."""
    head = ("| run | replicas | completed | req/s | output tok/s | mean TTFT ms | p99 TTFT ms "
            "| mean TPOT ms | prefix cache hit rate | preempted | deaths | resubmitted |")
    lines = [head, "|" + "---|" * 12]
    for res in results:
        s = res.summary
        lines.append(
            f"| {s['policy']} | {s['replicas']} | {s['completed']:,} | "
            f"{s['request_throughput']:,.2f} | {s['output_throughput']:,.1f} | "
            f"{s['mean_ttft_ms']:,.2f} | {s['p99_ttft_ms']:,.2f} | {s['mean_tpot_ms']:,.2f} | "
            f"{100 * s['prefix_cache_hit_rate']:.1f}% | {s['preemptions']:,} | "
            f"{s['deaths']} | {s['resubmitted']} |")
    return "\n".join(lines)
