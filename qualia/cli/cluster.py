"""``qualia simulate --replicas N ...``: the cluster's command line (see :mod:`qualia.cluster`)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict

from ..cluster.cluster import (
    POLICIES,
    Cluster,
    _ray,
    compare_policies,
    format_comparison,
    init_local_ray,
)
from ..cluster.metrics import ClusterMetrics
from ..cluster.replica import ReplicaConfig, make_scheduler, model_weights
from ..sim.config import DEFAULT_LOAD_WEIGHT, DEFAULT_REJOIN_AFTER, DEFAULT_ROUTER, wants_cluster
from .options import finite_non_negative, int_in

__all__ = ["add_cluster_options", "wants_cluster", "simulate_cli"]


def add_cluster_options(p) -> None:
    """The cluster options of ``simulate`` (an argparse parser)."""
    g = p.add_argument_group('cluster (Ray, prometheus-client: pip install ".[cluster]" in '
                             'the qualia checkout)')
    g.add_argument("--replicas", type=int_in(1, 64), default=None, metavar="N",
                   help="serve on N data-parallel replicas (Ray actors) behind a router")
    g.add_argument("--router", choices=POLICIES, default=None,
                   help=f"routing policy (default {DEFAULT_ROUTER}; not with --compare, "
                        f"which runs every policy)")
    g.add_argument("--compare", action="store_true",
                   help="run every policy and one replica with N times the pool, side by side")
    g.add_argument("--kill-replica", type=int_in(0, 2**31), default=None, metavar="STEP",
                   help="kill the last replica's actor at this step (fault injection)")
    g.add_argument("--rejoin-after", type=int_in(0, 2**31), default=None, metavar="STEPS",
                   help="with --kill-replica: restart a dead replica this many steps after its "
                        f"death was found (default {DEFAULT_REJOIN_AFTER})")
    g.add_argument("--load-weight", type=finite_non_negative, default=None, metavar="PAGES",
                   help="prefix router: pages of cached prefix one queued request is worth "
                        f"(default {DEFAULT_LOAD_WEIGHT})")
    g.add_argument("--metrics-port", type=int_in(0, 65535), default=None, metavar="P",
                   help="serve Prometheus metrics on 127.0.0.1:P during the run")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="an existing Ray cluster (default: a local one started for the run)")
    g.add_argument("--local", action="store_true",
                   help="run the replicas in this process, without Ray")


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
    check before the run is :func:`qualia.sim.config.check_simulate`'s, as for one engine; the
    generated requests are checked by the same rule as the engine's before Ray starts."""
    import json
    import sys

    from ..sim import config as preflight
    from ..sim.check import check_outputs
    from ..sim.report import emit, jsonable, write_json
    from ..sim.workload import unservable_reason

    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    # --backend model: the numpy model's own step runner on every replica; c: the hash rule
    backend = "hash" if args.backend == "c" else "model"
    clock = preflight.clock_of(args)
    try:
        prepared = preflight.check_simulate(args)
        workload, vocab = prepared.workload, prepared.vocab
        # the command line's options over the replicas' defaults: the cache key every replica
        # and the router share, and the event capacity, stay the replicas' own
        options = {k: v for k, v in dataclasses.asdict(preflight.engine_config_of(args)).items()
                   if not (k in ("cache_key", "event_capacity") and v is None)}
        config = ReplicaConfig(**{**options, "backend": backend, "vocab_size": vocab})
        make_scheduler(config)      # bad step options are refused here, before Ray starts
        requests = _Generated(workload)
        for q in requests.requests:
            why = unservable_reason(f"request {q.request_id}", len(q.prompt), q.max_new_tokens,
                                    page_tokens=config.page_tokens,
                                    num_pages=config.num_pages,
                                    logical_pages=config.logical_pages, options=True)
            if why is not None:
                raise preflight.Refused(f"{why} (raise those options or lower "
                                        "--prompt-len/--output-len)")
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
                             load_weight=args.load_weight, clock=clock)
                try:
                    results.append(cl.run(requests, **kw))
                finally:
                    cl.close()
            results += compare_policies(requests, args.replicas, config, policies=(),
                                        local=args.local, max_steps=None, clock=clock)
        else:
            cl = Cluster(args.replicas, args.router, config, local=args.local, metrics=metrics,
                         load_weight=args.load_weight, clock=clock)
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
                     "outgrew the pool or --logical-pages, or would arrive after 1e9 s)")
        ok &= once
        if args.check:
            chk = check_outputs(res.requests, res.outputs, eos_token_id=args.eos_token_id,
                                vocab=vocab,
                                weights=model_weights(config) if backend == "model" else None)
            line += f"; check: {chk.describe()}"
            ok &= chk.ok
        messages.append(line)
    if args.json:
        data: Dict[str, Any] = (
            {"runs": [r.to_dict() for r in results]} if args.compare else results[0].to_dict())
        data["config"] = {"command": args.command, "replicas": args.replicas,
                          "router": args.router, "compare": bool(args.compare),
                          "clock": clock.kind, "clock_description": clock.describe(),
                          "profile": args.profile, "backend": args.backend,
                          "requests": args.requests, "turns": args.turns,
                          "arrival_rate": args.arrival_rate, "seed": args.seed}
        text = json.dumps(jsonable(data), indent=2, sort_keys=True, default=str)
        if not write_json(text, args.json, out, err):
            return 2
    if not args.quiet and args.json != "-":
        if args.compare:
            emit(format_comparison(results) + "\n" + "\n".join(messages), out)
        else:
            emit(_run_summary(args, results[0], clock) + "\n" + "\n".join(messages), out)
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


def _run_summary(args, res, clock) -> str:
    """One cluster run's summary: what ran, vLLM's figures (the single engine's table) and the
    cluster's own figures."""
    from ..sim.report import clock_parts, figures_table, kv_lines, number

    s = res.summary
    lines = ["qualia simulate --replicas summary"]
    total = args.requests * args.turns
    lines += kv_lines("workload", [f"{number(args.requests)} conversations x {args.turns} turns "
                                   f"= {number(total)} requests (synthetic)"
                                   if args.turns > 1 else
                                   f"{number(args.requests)} requests (synthetic)"])
    lines += kv_lines("replicas", [f"{res.replicas} behind the {res.policy} router",
                                   "each on a GPU of its own, stepping together"])
    lines += kv_lines("clock", clock_parts(clock.describe()))
    lines.append("")
    lines += figures_table(s, s)
    lines.append("")
    lines += kv_lines("prefix cache hit rate", [
        f"{100 * s['prefix_cache_hit_rate']:.1f}% of prompt tokens",
        f"{number(int(s['cache_hit_tokens']))} of {number(int(s['cache_lookup_tokens']))}"])
    lines += kv_lines("tokens", [f"prefilled {number(int(s['tokens_prefilled']))}",
                                 f"decoded {number(int(s['tokens_decoded']))}"])
    lines += kv_lines("routing", [f"decisions per replica {s['decisions']}",
                                  f"{number(int(s['preemptions']))} preemptions"])
    lines += kv_lines("faults", [f"replicas died: {s['deaths']}",
                                 f"rejoined: {s['rejoins']}",
                                 f"requests resubmitted: {s['resubmitted']}"])
    return "\n".join(lines)


class _Generated:
    """A workload generated once (its requests, checked before the run) and its next turns:
    what :meth:`Cluster.run` takes."""

    def __init__(self, workload) -> None:
        self.requests = list(workload.generate())
        self.next_turn = getattr(workload, "next_turn", None)

    def generate(self):
        return list(self.requests)

