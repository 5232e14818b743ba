"""qualia.cluster: replicas behind a prefix-aware router, fault handling, metrics, the CLI.

The router's logic runs in-process (``local=True``, no Ray) for most rules; the Ray tests start
one local Ray with 2 CPUs for the module, bound every run by ``max_steps`` and stop Ray at the
end.  They are skipped when Ray is not installed (the ``cluster`` extra)."""

import contextlib
import dataclasses
import io
import json
import subprocess
import sys
import types
import urllib.request

import numpy as np
import pytest

from qualia.cluster import POLICIES, Cluster, ReplicaConfig, compare_policies, format_comparison
from qualia.sim.check import check_outputs
from qualia.sim.workload import Workload

CFG = ReplicaConfig(max_num_seqs=6, num_pages=40, page_tokens=8, logical_pages=24,
                    max_num_batched_tokens=256)


def workload(requests=16, turns=2, seed=3, **kw):
    base = dict(requests=requests, seed=seed, arrival_rate=250.0, system_prompts=6,
                system_prompt_len=24, share_ratio=0.9, prompt_len=(32, 64),
                output_len=(4, 12), tenants=1, vocab=32000, turns=turns, user_len=(4, 12))
    base.update(kw)
    return Workload(**base)


def assert_exactly_once(res):
    assert set(res.completions) == set(res.requests)
    assert all(n == 1 for n in res.completions.values())
    chk = check_outputs(res.requests, res.outputs, vocab=32000)
    assert chk.ok, chk.describe()


def test_the_core_package_does_not_import_ray(tmp_path):
    code = ("import sys, qualia, qualia.cluster, qualia.cli.main; "
            "qualia.cli.main.build_parser(); assert 'ray' not in sys.modules")
    # from an empty folder: `python -c` puts the working directory first on sys.path
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=tmp_path)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_completes_every_request_once(policy):
    cl = Cluster(3, policy, CFG, local=True)
    res = cl.run(workload(), max_steps=2000)
    assert_exactly_once(res)
    assert sum(res.summary["decisions"]) == len(res.requests)
    assert res.summary["duplicates_ignored"] == 0


def test_bad_arguments():
    with pytest.raises(ValueError):
        Cluster(0, "prefix", CFG, local=True)
    with pytest.raises(ValueError):
        Cluster(65, "prefix", CFG, local=True)
    with pytest.raises(ValueError):
        Cluster(2, "random", CFG, local=True)


@pytest.mark.parametrize("kw, exc, says", [
    (dict(load_weight=float("nan")), ValueError, "load_weight must be a finite number >= 0"),
    (dict(load_weight=float("inf")), ValueError, "load_weight must be a finite number >= 0"),
    (dict(load_weight=-0.5), ValueError, "load_weight must be a finite number >= 0"),
    (dict(load_weight="1"), TypeError, "load_weight must be a number"),
    (dict(step_timeout=0.0), ValueError, "step_timeout must be a finite number of seconds > 0"),
    (dict(step_timeout=-1), ValueError, "step_timeout must be a finite number of seconds > 0"),
    (dict(step_timeout=float("nan")), ValueError, "step_timeout must be a finite number"),
    (dict(replicas=2.9), TypeError, "replicas must be an integer"),
    (dict(replicas="2"), TypeError, "replicas must be an integer"),
    (dict(max_resubmits=1.5), TypeError, "max_resubmits must be an integer"),
])
def test_a_cluster_is_built_only_from_arguments_in_range(kw, exc, says):
    args = dict(replicas=2, policy="prefix", config=CFG, local=True)
    args.update(kw)
    with pytest.raises(exc, match=says):
        Cluster(**args)


def test_load_weight_and_step_timeout_take_any_real_number():
    """Cluster's load_weight and step_timeout, and Router's load_weight, take any real number
    (converted with float: Decimal and Fraction too); a string, a bool or None is a TypeError,
    a number out of range a ValueError, each naming its argument."""
    import decimal
    import fractions

    from qualia.cluster.router import Router

    for number, value in ((decimal.Decimal("0.25"), 0.25), (fractions.Fraction(1, 4), 0.25),
                          (np.float32(0.25), 0.25), (2, 2.0)):
        cl = Cluster(2, "prefix", CFG, local=True, load_weight=number, step_timeout=number)
        assert (cl.load_weight, cl.step_timeout, cl.router.load_weight) == (value,) * 3
        assert type(cl.load_weight) is float and type(cl.step_timeout) is float
        assert Router(2, "prefix", CFG, load_weight=number).load_weight == value
    for name in ("load_weight", "step_timeout"):
        for wrong in ("1", "60", True, np.bool_(False), None, 1j, b"1"):
            with pytest.raises(TypeError, match=f"{name} must be a number, got"):
                Cluster(2, "prefix", CFG, local=True, **{name: wrong})
        for out in (decimal.Decimal("NaN"), decimal.Decimal("sNaN"), decimal.Decimal("-1"),
                    decimal.Decimal("Infinity"), fractions.Fraction(-1, 3), 10**400, -(10**400),
                    fractions.Fraction(10**400, 3)):
            with pytest.raises(ValueError, match=f"{name} must be a finite number"):
                Cluster(2, "prefix", CFG, local=True, **{name: out})
    with pytest.raises(TypeError, match="load_weight must be a number"):
        Router(2, "prefix", CFG, load_weight=None)
    with pytest.raises(ValueError, match="load_weight must be a finite number >= 0"):
        Router(2, "prefix", CFG, load_weight=decimal.Decimal("-0.5"))


@pytest.mark.parametrize("kw, says", [
    (dict(kill_replica_at=3, kill_replica=2), r"kill_replica must be a replica in \[0, 1\]"),
    (dict(kill_replica_at=3, kill_replica=-2), r"kill_replica must be a replica in \[0, 1\]"),
    (dict(kill_replica_at=-1), "kill_replica_at must be None or an integer >= 0"),
    (dict(kill_replica_at=3, rejoin_after=-3), "rejoin_after must be None or an integer >= 0"),
    (dict(max_steps=-1), "max_steps must be None or an integer >= 0"),
])
def test_a_run_refuses_fault_injection_outside_the_cluster_before_it_starts(kw, says):
    cl = Cluster(2, "round-robin", CFG, local=True)
    with pytest.raises(ValueError, match=says):
        cl.run(workload(requests=4, turns=1), **kw)
    assert cl.decisions == [0, 0] and all(h.obj.steps == 0 for h in cl.handles)


class _Index:
    def __init__(self, n):
        self.n = n

    def __index__(self):
        return self.n


def test_a_runs_integer_arguments_are_used_as_the_ints_they_convert_to():
    """kill_replica_at, kill_replica, rejoin_after and max_steps may be any integer (objects
    with __index__ too): the run uses the ints they convert to, and gives what plain ints give.
    A refused argument (on_step that cannot be called too) changes nothing: no counter zeroed,
    no replica killed."""
    def w():
        return workload(requests=4, turns=1)

    plain = Cluster(2, "round-robin", CFG, local=True).run(
        w(), kill_replica_at=3, kill_replica=0, rejoin_after=1, max_steps=2000).summary
    cl = Cluster(2, "round-robin", CFG, local=True)
    idx = cl.run(w(), kill_replica_at=_Index(3), kill_replica=_Index(0),
                 rejoin_after=_Index(1), max_steps=_Index(2000)).summary
    for key in ("deaths", "rejoins", "killed_at", "decisions", "completed", "tokens_decoded",
                "steps"):
        assert idx[key] == plain[key], key
    assert idx["killed_at"] == 3 and idx["rejoins"] == 1
    state = (list(cl.decisions), cl.deaths, cl.rejoins, cl.killed_at, list(cl.live),
             [h.obj is not None for h in cl.handles], [h.obj.steps for h in cl.handles])
    for bad in (dict(on_step=5), dict(kill_replica_at=2, rejoin_after=1, on_step="x"),
                dict(kill_replica_at=2, rejoin_after=_Index(-1))):
        with pytest.raises((TypeError, ValueError)):
            cl.run(w(), max_steps=2000, **bad)
        assert (list(cl.decisions), cl.deaths, cl.rejoins, cl.killed_at, list(cl.live),
                [h.obj is not None for h in cl.handles],
                [h.obj.steps for h in cl.handles]) == state


def _request(rid, **kw):
    from qualia.sim.workload import Request

    fields = dict(request_id=rid, tenant=0, prompt=list(range(1, 40)), shared_prefix_len=0,
                  max_new_tokens=3, arrival_s=0.0)
    fields.update(kw)
    return Request(**fields)


@pytest.mark.parametrize("bad, exc, says", [
    (dict(arrival_s=float("nan")), ValueError, "request 9: arrival_s must be a finite number"),
    (dict(arrival_s=-1.0), ValueError, "request 9: arrival_s must be a finite number"),
    (dict(arrival_s=5.0, prompt=[2**33]), ValueError, "request 9: prompt token ids must be u32"),
    (dict(prompt=[-1, 3]), ValueError, "request 9: prompt token ids must be u32"),
    (dict(prompt=[]), ValueError, "request 9: the prompt is empty"),
    (dict(max_new_tokens=0), ValueError, "request 9: max_new_tokens must be >= 1"),
    (dict(max_new_tokens=2.5), TypeError, "request 9: max_new_tokens must be an integer"),
    (dict(prompt=list(range(1000))), ValueError, "request 9 can never be served"),
    (dict(request_id=1), ValueError, "request 1: duplicate request id"),
])
def test_a_run_checks_every_request_as_the_engine_does_before_anything_runs(bad, exc, says):
    cl = Cluster(2, "prefix", CFG, local=True)
    first = cl.run(workload(requests=4, turns=1), max_steps=2000)
    state = (list(cl.decisions), dict(cl._counters), cl.now, [h.obj.steps for h in cl.handles])
    with pytest.raises(exc, match=says):
        cl.run([_request(1), _request(2, arrival_s=3.0), _request(9, **bad)], max_steps=2000)
    assert (list(cl.decisions), dict(cl._counters), cl.now,
            [h.obj.steps for h in cl.handles]) == state
    assert sum(first.summary["decisions"]) == 4


def test_a_second_run_of_a_cluster_reports_only_itself():
    """Every counter of the summary starts at 0 in each run (the replicas keep their caches):
    a run without a kill after one with a kill reports no death, and its decisions and token
    counts are its own."""
    cfg = ReplicaConfig(num_pages=96, max_num_seqs=8, logical_pages=16)

    def w():
        return Workload(requests=6, turns=1, system_prompts=0, arrival_rate=40.0, seed=0,
                        vocab=32000)

    cl = Cluster(2, "round-robin", cfg, local=True)
    first = cl.run(w(), kill_replica_at=3, rejoin_after=1, max_steps=2000).summary
    assert (first["deaths"], first["rejoins"], first["killed_at"]) == (1, 1, 3)
    second = cl.run(w(), max_steps=2000).summary
    fresh = Cluster(2, "round-robin", cfg, local=True).run(w(), max_steps=2000).summary
    for key in ("deaths", "rejoins", "resubmitted", "duplicates_ignored", "killed_at",
                "decisions", "requests", "completed", "tokens_decoded", "cache_lookup_tokens",
                "preemptions", "idle_steps"):
        assert second[key] == fresh[key], key
    assert second["steps"] == fresh["steps"] and second["idle_s"] == fresh["idle_s"]


@pytest.mark.parametrize("kind", ["core", "twin"])
def test_a_run_after_a_run_that_raised_is_its_own(kind):
    """A run that raised (max_steps) leaves its unfinished requests on the replicas; the next
    run aborts them first, so it serves its own requests only: the same ids again give a
    fresh cluster's figures, and new ids are served, each request once.  A replica killed in
    the run that raised, and not yet found dead, is found dead at the next run's step 0,
    before anything is routed to it."""
    cfg = ReplicaConfig(num_pages=96, max_num_seqs=8, logical_pages=16, scheduler=kind)

    def w():
        return Workload(requests=6, turns=1, system_prompts=0, arrival_rate=40.0, seed=0,
                        vocab=32000)

    fresh = Cluster(2, "round-robin", cfg, local=True).run(w(), max_steps=2000)
    keys = ("decisions", "completed", "tokens_decoded", "duplicates_ignored", "deaths",
            "resubmitted")
    cl = Cluster(2, "round-robin", cfg, local=True)
    with pytest.raises(RuntimeError, match="did not finish within 3 steps"):
        cl.run(w(), max_steps=3)
    again = cl.run(w(), max_steps=2000)
    assert_exactly_once(again)
    assert again.outputs == fresh.outputs
    assert {k: again.summary[k] for k in keys} == {k: fresh.summary[k] for k in keys}
    with pytest.raises(RuntimeError, match="did not finish within 3 steps"):
        cl.run(w(), max_steps=3)
    new_ids = [dataclasses.replace(q, request_id=q.request_id + 100) for q in w().generate()]
    other = cl.run(new_ids, max_steps=2000)
    assert_exactly_once(other)
    assert set(other.completions) == {q.request_id for q in new_ids}
    assert other.summary["duplicates_ignored"] == 0

    def kill_after_step_2(step, cluster):
        if step == 2:
            cluster.kill(0)

    with pytest.raises(RuntimeError, match="did not finish within 3 steps"):
        cl.run(w(), max_steps=3, on_step=kill_after_step_2)
    assert cl.live == [True, True]   # killed, not yet found dead
    last = cl.run(w(), max_steps=2000)
    assert_exactly_once(last)
    assert last.outputs == fresh.outputs
    s = last.summary
    assert (s["deaths"], s["resubmitted"], s["decisions"], s["duplicates_ignored"]) == \
        (1, 0, [0, 6], 0)
    assert not cl.handles[1].obj.sched.has_unfinished()


def test_round_robin_cycles_and_least_loaded_picks_the_lightest():
    rr = Cluster(3, "round-robin", CFG, local=True)
    assert [rr.route([1, 2, 3])[0] for _ in range(4)] == [0, 1, 2, 0]
    ll = Cluster(3, "least-loaded", CFG, local=True)
    ll.load = [4, 1, 2]
    assert ll.route([1])[0] == 1
    ll.live[1] = False
    assert ll.route([1])[0] == 2
    ll.load = [CFG.queue_limit] * 3      # full replicas take nothing
    assert ll.route([1])[0] == -1


def test_prefix_router_follows_the_events():
    cl = Cluster(3, "prefix", CFG, local=True)
    prompt = list(range(100, 100 + 5 * CFG.page_tokens + 1))
    ids = cl.router.page_identities(prompt)
    ev = np.zeros(len(ids), dtype=__import__("qualia").KV_EVENT)
    ev["kind"] = 1
    ev["identity"] = ids
    cl.index.apply_events(2, ev)
    assert cl.route(prompt) == (2, 5)
    cl.load = [0, 0, 40]                 # 40 queued x 0.25 pages > 5 cached pages
    assert cl.route(prompt)[0] == 0
    cl.load = [0, 0, 0]
    cl.live[2] = False                   # a dead replica is never chosen
    assert cl.route(prompt)[0] == 0


def test_prefix_router_hit_rate_beside_round_robin():
    """The figures of the README's comparison, on a multi-turn shared-prefix workload, one run
    per policy plus one replica holding everything (deterministic: in-process replicas)."""
    w = workload(requests=24, turns=3)
    results = compare_policies(w, 4, CFG, local=True)
    print("\n" + format_comparison(results))
    rate = {r.policy: r.summary["prefix_cache_hit_rate"] for r in results}
    for r in results:
        assert_exactly_once(r)
    assert rate["prefix"] > rate["round-robin"]
    assert rate["prefix"] > rate["least-loaded"]
    assert rate["prefix"] >= 0.9 * rate["single replica"]


@pytest.mark.parametrize("policy", ["prefix", "least-loaded"])
def test_a_replica_killed_mid_run_loses_nothing_and_rejoins(policy):
    cl = Cluster(3, policy, CFG, local=True)
    seen = {}

    def on_step(step, c):
        seen[step] = (list(c.live), list(c.decisions))

    res = cl.run(workload(requests=20), kill_replica_at=4, rejoin_after=3, on_step=on_step,
                 max_steps=2000)
    assert_exactly_once(res)
    s = res.summary
    assert s["deaths"] == 1 and s["rejoins"] == 1 and s["resubmitted"] >= 1
    assert seen[4][0] == [True, True, False]              # found dead at the step it was killed
    assert seen[7][0] == [True, True, True]               # back 3 steps later
    if policy == "least-loaded":                          # the empty newcomer is the lightest
        assert seen[max(seen)][1][2] > seen[7][1][2]


def test_every_replica_down_without_rejoin_is_an_error():
    cl = Cluster(1, "prefix", CFG, local=True)
    with pytest.raises(RuntimeError, match="every replica is down"):
        cl.run(workload(requests=6), kill_replica_at=1, max_steps=500)


def test_a_request_that_kills_every_replica_is_given_up_not_resubmitted_forever(monkeypatch):
    """A replica dies whenever request 0 reaches it (a deterministic fault that travels with
    the request); with rejoins, resubmitting it would never end: after max_resubmits deaths
    the run raises instead."""
    import qualia.cluster as cluster

    real_step = cluster.Replica.step

    def poisoned(self, requests=()):
        if any(int(r[0]) == 0 for r in requests):
            raise RuntimeError("the backend crashed on request 0")
        return real_step(self, requests)

    monkeypatch.setattr(cluster.Replica, "step", poisoned)
    cl = Cluster(2, "round-robin", CFG, local=True, max_resubmits=2)
    with pytest.raises(RuntimeError, match="giving up"):
        cl.run(workload(requests=6), rejoin_after=1, max_steps=500)
    assert cl.resubmitted >= 3


def test_simulate_cli_local():
    from qualia.cli.main import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["simulate", "--replicas", "2", "--local", "--requests", "8", "--backend", "c",
                   "--check", "--num-pages", "64", "--compare", "--no-progress"])
    text = out.getvalue()
    assert rc == 0, text
    for name in POLICIES + ("single replica",):
        assert f"| {name} |" in text
    assert "exactly once" in text and "NOT" not in text


def test_simulate_cli_refuses_explicit_mode():
    from qualia.cli.main import main
    # the step engine has no explicit mode: --prefix-caching takes 'auto' or 'off' (exit 2)
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--replicas", "2", "--local", "--prefix-caching", "explicit"])
    assert exc.value.code == 2


@pytest.mark.parametrize("option", [["--router", "round-robin"], ["--kill-replica", "3"],
                                    ["--local"], ["--compare"]])
def test_cluster_options_need_replicas(option):
    from qualia.cli.main import main
    assert main(["simulate", *option]) == 2


def _cli(argv, monkeypatch=None):
    """``qualia simulate --replicas 2 --local argv`` (argparse's refusals included): the exit
    status, stdout and stderr; with ``monkeypatch``, a run that starts fails the test."""
    from qualia.cli.main import main
    if monkeypatch is not None:
        def refuse(*args, **kwargs):
            raise AssertionError("the run started")
        monkeypatch.setattr(Cluster, "run", refuse)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(["simulate", "--backend", "c", "--requests", "6", "--no-progress",
                       *argv])
        except SystemExit as exc:
            rc = exc.code
    assert "Traceback" not in err.getvalue()
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("option", [["--router", "prefix"], ["--load-weight", "0.25"],
                                    ["--load-weight", "0.3"], ["--rejoin-after", "5"],
                                    ["--rejoin-after", "6"]])
def test_a_cluster_option_given_is_refused_without_its_companion_whatever_its_value(
        option, monkeypatch):
    """An option given is told apart from one left out, a value equal to its default too:
    without --replicas every cluster option is refused, and --rejoin-after without
    --kill-replica; left out, each takes its default once the checks pass."""
    rc, out, err = _cli(option, monkeypatch)
    assert rc == 2 and out == "" and "need --replicas N" in err, err
    if option[0] == "--rejoin-after":
        rc, out, err = _cli(["--replicas", "2", "--local", *option], monkeypatch)
        assert rc == 2 and out == "" and "argument --rejoin-after: only with --kill-replica" in err
    from qualia.cli.main import build_parser
    from qualia.sim import config as preflight
    args = build_parser().parse_args(["simulate", "--replicas", "2", "--local", "--backend", "c",
                                      "--requests", "4"])
    vars(args).pop("subparser", None)
    preflight.check_simulate(args)
    assert (args.router, args.load_weight, args.rejoin_after) == (
        preflight.DEFAULT_ROUTER, preflight.DEFAULT_LOAD_WEIGHT, preflight.DEFAULT_REJOIN_AFTER)


@pytest.mark.parametrize("argv, says", [
    (["--json", "/nonexistent/x.json"], "--json /nonexistent/x.json: directory"),
    (["--num-pages", "1"], "can never be served"),
    (["--plot", "x.png"], "argument --plot: not with --replicas"),
    (["--step-ms", "1", "--clock", "measured"], "argument --step-ms: not with --clock"),
    (["--ray-address", "127.0.0.1:1"], "argument --ray-address: not with --local"),
    (["--compare", "--router", "round-robin"], "argument --router: not with --compare"),
    (["--compare", "--router", "prefix"], "argument --router: not with --compare"),
    (["--rejoin-after", "3"], "argument --rejoin-after: only with --kill-replica"),
])
def test_replica_mistakes_are_refused_before_the_run(argv, says, monkeypatch):
    rc, out, err = _cli(["--replicas", "2", "--local", *argv], monkeypatch)
    assert rc == 2 and out == "" and err.count("\n") == 1 and says in err, err


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "x"])
def test_load_weight_is_a_finite_number_at_least_0(value, monkeypatch):
    rc, _, err = _cli(["--replicas", "2", "--local", "--load-weight", value], monkeypatch)
    assert rc == 2 and "argument --load-weight:" in err


def test_metrics_port_without_prometheus_client_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)   # import -> ImportError
    rc, _, err = _cli(["--replicas", "2", "--local", "--metrics-port", "0"], monkeypatch)
    assert rc == 2 and "--metrics-port" in err and 'pip install ".[cluster]"' in err


def test_metrics_port_in_use_is_refused(monkeypatch):
    pytest.importorskip("prometheus_client")
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        rc, _, err = _cli(["--replicas", "2", "--local", "--metrics-port", str(port)],
                          monkeypatch)
    assert rc == 2 and err.count("\n") == 1
    assert f"argument --metrics-port: cannot listen on 127.0.0.1:{port}" in err


def test_a_kill_past_the_end_of_the_run_is_an_error():
    rc, out, err = _cli(["--replicas", "2", "--local", "--kill-replica", "100000"])
    assert rc == 2 and "2 behind the prefix router" in out  # the summary, then the error
    assert "argument --kill-replica" in err and "no replica was killed" in err
    rc, out, err = _cli(["--replicas", "2", "--local", "--kill-replica", "2",
                         "--rejoin-after", "2"])
    assert rc == 0 and err == "", err


def test_a_conversation_that_outgrows_a_replica_is_cut_not_an_error():
    cfg = dataclasses.replace(CFG, logical_pages=10)
    cl = Cluster(2, "prefix", cfg, local=True)
    res = cl.run(workload(requests=6, turns=8), max_steps=5000)
    assert_exactly_once(res)
    assert res.summary["conversations_cut"] > 0
    rc, out, err = _cli(["--replicas", "2", "--local", "--turns", "6", "--logical-pages", "8"])
    assert rc == 0 and "conversations cut" in out, err


def test_a_later_turn_after_the_latest_arrival_a_run_may_have_ends_its_conversation():
    """A later turn arrives when its previous turn completed; one that would arrive after
    1e9 s (MAX_ARRIVAL_S) is refused as a submission would be, and its conversation is cut."""
    class Late:
        def generate(self):
            return [_request(1, arrival_s=1e9)]

        def next_turn(self, req, outputs, step, now):
            assert now > 1e9
            return _request(2, arrival_s=now, arrival_step=step + 1)

    res = Cluster(2, "round-robin", CFG, local=True).run(Late(), max_steps=2000)
    assert set(res.completions) == {1} and res.summary["conversations_cut"] == 1


def test_every_request_arrives_at_its_arrival_time():
    """First turns at their drawn times, every later turn when its previous turn completed,
    even while first turns of later conversations are still to come."""
    cl = Cluster(2, "prefix", CFG, local=True)
    w = workload(requests=8, turns=3, arrival_rate=5.0)
    res = cl.run(w, max_steps=5000)
    assert_exactly_once(res)
    assert len(res.requests) == 24
    first = {q.request_id: q for q in w.generate()}
    for rid, q in res.requests.items():
        rec = res.records[rid]
        if rid in first:
            assert rec.arrival_s == res.arrived_s[rid] == first[rid].arrival_s
        else:  # turn t of conversation c: request t * 8 + c, after turn t - 1
            assert rec.arrival_s == res.records[rid - 8].finish_s
            assert res.arrived[rid] == q.arrival_step  # the step after it completed
    # conversation 0's second turn came before the last conversation's first
    assert res.records[8].arrival_s < first[7].arrival_s


def test_the_clock_skips_the_time_with_nothing_to_do():
    cl = Cluster(2, "prefix", CFG, local=True)
    res = cl.run(workload(requests=3, turns=2, arrival_rate=1e-6), max_steps=1000)
    assert_exactly_once(res)
    assert res.summary["idle_s"] > 10**5 and res.summary["steps"] < 1000
    assert res.summary["duration"] > 10**5  # the figures count from 0 s
    rc, out, err = _cli(["--replicas", "2", "--local", "--arrival-rate", "1e-6", "--requests",
                         "3"])
    assert rc == 0 and "exactly once" in out, err


def test_the_cluster_reports_the_single_engines_figures():
    """One replica behind the router serves a workload as the single engine does: the same
    steps on the same modeled clock, so vLLM's figures and the prefix cache's hit rate come out
    the same, under the same names and definitions."""
    from qualia.sim.engine import Engine

    w = workload(requests=12, turns=2)
    cfg = dataclasses.replace(CFG, num_pages=200)
    res = Cluster(1, "round-robin", cfg, local=True).run(w, max_steps=5000)
    engine = Engine("c", num_pages=200, max_num_seqs=6, page_tokens=8, logical_pages=24,
                    max_num_batched_tokens=256, max_queued=cfg.queue_limit)
    single = engine.run(w)
    assert_exactly_once(res)
    for key, value in single.figures.items():
        assert res.summary[key] == pytest.approx(value, rel=0.05), key
    assert res.summary["prefix_cache_hit_rate"] == pytest.approx(
        single.stats["prefix_cache_hit_rate"], rel=0.05)
    assert res.summary["mean_ttft_steps"] == pytest.approx(single.stats["mean_ttft_steps"],
                                                           rel=0.05)


def test_a_cluster_of_one_replica_gives_the_single_engines_figures_for_later_turns():
    """A later turn due at the step after its previous turn completed arrives then, not at the
    next first turn's arrival time: one replica behind the router gives every request the
    single engine's arrival and token times, with first turns still to come."""
    from qualia.sim.adapters import DecodeRuleSteps
    from qualia.sim.config import EngineConfig
    from qualia.sim.engine import Engine

    cfg = ReplicaConfig(num_pages=96, max_num_seqs=8, logical_pages=16)
    w = Workload(requests=10, turns=2, arrival_rate=5.0, seed=0, vocab=32000)
    res = Cluster(1, "round-robin", cfg, local=True).run(w, max_steps=5000)
    engine = Engine(DecodeRuleSteps(32000), EngineConfig(
        **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(EngineConfig)}))
    engine.run(w)
    assert_exactly_once(res)
    assert res.outputs == engine.outputs
    assert set(res.records) == set(engine.records) and len(res.records) == 20
    for rid, rec in engine.records.items():
        got = res.records[rid]
        assert (got.arrival_s, got.token_times_s) == (rec.arrival_s, rec.token_times_s), rid


def test_a_stuck_cluster_is_an_error_not_a_hang(monkeypatch):
    from qualia.cluster import make_scheduler

    class Never:
        """A scheduler that takes requests and never schedules any."""

        def __init__(self, *args, **kw):
            self.inner = make_scheduler(dataclasses.replace(CFG, scheduler="twin"))
            self.facade = self.inner.facade

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def schedule(self):
            none = np.zeros(0, dtype=np.int64)
            return types.SimpleNamespace(logits_indices=none, input_ids=none, positions=none,
                                         sampled_request_ids=none, num_prefill_tokens=0,
                                         num_decode_tokens=0, num_cached_tokens=0,
                                         preempted_request_ids=[], new_request_ids=[],
                                         query_start_loc=np.zeros(1, dtype=np.int32),
                                         seq_lens=none, copies=none)

        def update(self, ids):
            return []

    monkeypatch.setattr(Cluster, "MAX_STALLED_STEPS", 5)
    cl = Cluster(1, "round-robin", dataclasses.replace(CFG, scheduler=Never), local=True)
    with pytest.raises(RuntimeError, match="stuck"):
        cl.run(workload(requests=2, turns=1), max_steps=None)

    def fail(*args, **kwargs):
        raise RuntimeError("the cluster is stuck")

    monkeypatch.setattr(Cluster, "run", fail)
    rc, _, err = _cli(["--replicas", "2", "--local"])
    assert (rc, err) == (1, "error: the replicas' run failed: the cluster is stuck\n")


def test_ray_client_address_without_ray_client_is_refused(monkeypatch):
    pytest.importorskip("ray")
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "grpc" else find_spec(name, *a))
    rc, _, err = _cli(["--replicas", "2", "--ray-address", "ray://127.0.0.1:10001"],
                      monkeypatch)
    assert rc == 2 and "ray[client]" in err and err.count("\n") == 1


@pytest.mark.parametrize("address", ["127.0.0.1:{port}", "ray://127.0.0.1:{port}",
                                     "no-such-host.invalid:6379", "6379", "ray://"])
def test_an_unreachable_ray_address_fails_at_once(address, tmp_path):
    pytest.importorskip("ray")
    import socket
    with socket.socket() as s:     # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "qualia", "simulate", "--replicas", "2",
                        "--requests", "4", "--backend", "c", "--no-progress", "--ray-address",
                        address.format(port=port)],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("error: argument --ray-address") and r.stderr.count("\n") == 1


def test_hit_tokens_without_a_plan_count():
    """A scheduler whose plan does not count cached tokens: the replica falls back on the
    cache's own counter and reports the same figure."""
    from qualia.cluster import make_scheduler

    class Plain:
        def __init__(self, *args, **kw):
            self.inner = make_scheduler(dataclasses.replace(CFG, scheduler="twin"))
            self.facade = self.inner.facade

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def schedule(self):
            plan = self.inner.schedule()
            return types.SimpleNamespace(**{k: v for k, v in vars(plan).items()
                                            if k != "num_cached_tokens"})

    w = workload(requests=10)
    got = {}
    for name, kind in (("twin", "twin"), ("plain", Plain)):
        cl = Cluster(2, "prefix", dataclasses.replace(CFG, scheduler=kind), local=True)
        res = cl.run(w, max_steps=2000)
        assert_exactly_once(res)
        got[name] = res.summary["cache_hit_tokens"]
    assert got["plain"] == got["twin"] > 0


# -- on Ray ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    from qualia.cluster import init_local_ray
    init_local_ray(num_cpus=2)
    try:
        yield ray
    finally:
        ray.shutdown()


def test_ray_fault_one_replica_killed_every_request_once(ray_cluster):
    cl = Cluster(3, "prefix", CFG, step_timeout=60)
    try:
        # replica 0: the shared system prompts send the first requests there
        res = cl.run(workload(requests=16), kill_replica_at=3, kill_replica=0, rejoin_after=2,
                     max_steps=2000)
    finally:
        cl.close()
    assert_exactly_once(res)
    assert res.summary["deaths"] == 1 and res.summary["resubmitted"] >= 1
    assert res.summary["rejoins"] == 1


def test_ray_a_run_after_a_run_that_raised_is_its_own(ray_cluster):
    """The replicas' actors abort what a run that raised left them before the next run, and a
    killed actor is found dead at its step 0."""
    cfg = ReplicaConfig(num_pages=96, max_num_seqs=8, logical_pages=16)

    def w():
        return Workload(requests=6, turns=1, system_prompts=0, arrival_rate=40.0, seed=0,
                        vocab=32000)

    cl = Cluster(2, "round-robin", cfg, step_timeout=60)
    try:
        with pytest.raises(RuntimeError, match="did not finish within 3 steps"):
            cl.run(w(), max_steps=3)
        again = cl.run(w(), max_steps=2000)
        with pytest.raises(RuntimeError, match="did not finish within 3 steps"):
            cl.run(w(), max_steps=3, on_step=lambda step, c: c.kill(0) if step == 2 else None)
        last = cl.run(w(), max_steps=2000)
    finally:
        cl.close()
    assert_exactly_once(again)
    assert (again.summary["duplicates_ignored"], again.summary["deaths"]) == (0, 0)
    assert_exactly_once(last)
    assert (last.summary["deaths"], last.summary["resubmitted"],
            last.summary["decisions"]) == (1, 0, [0, 6])


def test_ray_metrics_endpoint_is_scraped(ray_cluster):
    pytest.importorskip("prometheus_client")
    from qualia.cluster import ClusterMetrics
    m = ClusterMetrics()
    port = m.serve(0)
    try:
        cl = Cluster(2, "prefix", CFG, metrics=m)
        try:
            res = cl.run(workload(requests=8, turns=1), max_steps=2000)
        finally:
            cl.close()
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    finally:
        m.close()
    text = body.decode()
    assert_exactly_once(res)
    for name in ("qualia_replica_requests_running{replica=\"0\"}",
                 "qualia_replica_requests_waiting{replica=\"1\"}",
                 "qualia_replica_pool_usage{replica=\"0\"}",
                 "qualia_replica_cache_hit_rate{replica=\"0\"}",
                 "qualia_replica_preemptions_total{replica=\"0\"}",
                 "qualia_router_decisions_total{policy=\"prefix\",replica=\"0\"}",
                 "qualia_router_index_identities"):
        assert name in text, name
    done = [ln for ln in text.splitlines()
            if ln.startswith("qualia_router_requests_completed_total")]
    assert done and float(done[0].split()[-1]) == len(res.requests)


def test_ray_simulate_cli_with_a_kill(ray_cluster):
    from qualia.cli.main import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["simulate", "--replicas", "2", "--router", "prefix", "--requests", "8",
                   "--backend", "c", "--check", "--kill-replica", "3", "--num-pages", "64",
                   "--no-progress"])
    assert rc == 0, out.getvalue()
    assert "2 behind the prefix router" in out.getvalue()
    assert "replicas died: 1, rejoined: 1" in out.getvalue()


def test_replicas_run_on_the_compiled_core_by_default():
    import qualia
    from qualia.cluster import Replica, make_scheduler
    assert isinstance(make_scheduler(CFG), qualia.StepScheduler)        # "auto" picks the core
    assert Replica(0, CFG).describe()["implementation"] == "core"
    twin = Replica(1, dataclasses.replace(CFG, scheduler="twin"))
    assert twin.describe()["implementation"] == "twin"
    model = Replica(2, dataclasses.replace(CFG, backend="model", vocab_size=512))
    assert model.describe() == dict(replica=2, implementation="core",
                                    backend="PagedModelBackend")


# the numpy model is slow: small pools, short prompts and outputs
MODEL_CFG = dataclasses.replace(CFG, backend="model", vocab_size=512, max_num_seqs=4, num_pages=32,
                                max_num_batched_tokens=96, max_prefill_chunk=40)


def model_workload(requests=6):
    return workload(requests=requests, vocab=512, prompt_len=(16, 40), output_len=(3, 8),
                    system_prompts=2, system_prompt_len=16, user_len=(3, 8))


@pytest.mark.parametrize("kind", ["core", "twin"])
def test_model_backend_every_token_equals_the_dense_model_with_a_kill(kind):
    """Every replica runs the numpy model's execute_step; a replica killed mid-run has its
    requests recomputed elsewhere from prompt + tokens so far: every token still equals the
    dense model's."""
    from qualia.cluster import model_weights
    cfg = dataclasses.replace(MODEL_CFG, scheduler=kind)
    cl = Cluster(2, "prefix", cfg, local=True)
    # replica 0: the shared system prompts send the first requests there
    res = cl.run(model_workload(), kill_replica_at=3, kill_replica=0, rejoin_after=2,
                 max_steps=2000)
    s = res.summary
    assert s["scheduler"] == kind and s["backend"] == "model"
    assert s["deaths"] == 1 and s["resubmitted"] >= 1 and s["rejoins"] == 1
    assert set(res.completions) == set(res.requests)
    assert all(n == 1 for n in res.completions.values())
    chk = check_outputs(res.requests, res.outputs, weights=model_weights(cfg))
    assert chk.ok and chk.against == "dense model", chk.describe()
    assert s["cache_hit_tokens"] > 0 and s["tokens_prefilled"] > 0


def test_model_backend_check_catches_a_wrong_token():
    """The dense check can fail: one token changed in one request's outputs is found."""
    from qualia.cluster import model_weights
    cl = Cluster(2, "round-robin", MODEL_CFG, local=True)
    res = cl.run(model_workload(requests=3), max_steps=2000)
    rid = min(res.outputs)
    res.outputs[rid][-1] = (res.outputs[rid][-1] + 1) % 512
    chk = check_outputs(res.requests, res.outputs, weights=model_weights(MODEL_CFG))
    assert not chk.ok and chk.mismatched == [rid]


def test_simulate_cli_local_model_backend_checked():
    from qualia.cli.main import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["simulate", "--replicas", "2", "--local", "--requests", "4", "--check",
                   "--prompt-len", "16,32", "--output-len", "3,6", "--system-prompt-len", "16",
                   "--user-len", "3,6", "--num-pages", "32", "--max-num-seqs", "4",
                   "--max-num-batched-tokens", "64", "--max-prefill-chunk", "32",
                   "--kill-replica", "2",
                   "--no-progress"])
    text = out.getvalue()
    assert rc == 0, text
    assert "match the dense model" in text and "scheduler: core, backend: model" in text
    assert "2 behind the prefix router" in text and "NOT" not in text
    assert "Mean TTFT (ms):" in text and "replicas died: 1, rejoined: 1" in text


@pytest.mark.parametrize("argv", [["--eos-token-id", "512"], ["--max-num-batched-tokens", "0"],
                                  ["--trace", "x.csv"]])
def test_simulate_cli_cluster_refuses_bad_options(argv):
    from qualia.cli.main import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = main(["simulate", "--replicas", "2", "--local", *argv])
        except SystemExit as exc:   # argparse's own bounds
            rc = exc.code
    assert rc == 2


def test_ray_simulate_cli_model_backend_with_a_kill(ray_cluster):
    """On Ray actors, the default backend (the numpy model): a replica killed mid-run, every
    request completes once and every token equals the dense model's."""
    from qualia.cli.main import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["simulate", "--replicas", "2", "--requests", "4", "--check",
                   "--prompt-len", "16,32", "--output-len", "3,6", "--system-prompt-len", "16",
                   "--user-len", "3,6", "--num-pages", "32", "--max-num-seqs", "4",
                   "--max-num-batched-tokens", "64", "--kill-replica", "2", "--no-progress"])
    text = out.getvalue()
    assert rc == 0, text
    assert "match the dense model" in text and "scheduler: core, backend: model" in text
    assert "replicas died: 1" in text


def test_the_command_lines_replicas_share_the_routers_cache_key():
    """The replicas the command line builds hash pages under the router's key: the prefix
    router finds the pages they cache, and beats the policies that ignore the caches."""
    rc, out, err = _cli(["--replicas", "4", "--local", "--compare", "--requests", "48",
                         "--turns", "3", "--system-prompts", "8", "--num-pages", "192",
                         "--max-num-seqs", "8", "--logical-pages", "24", "--json", "-"])
    assert rc == 0, err
    rate = {run["stats"]["policy"]: run["stats"]["prefix_cache_hit_rate"]
            for run in json.loads(out)["runs"]}
    assert rate["prefix"] > rate["least-loaded"] and rate["prefix"] > rate["round-robin"]
    assert rate["prefix"] >= 0.9 * rate["single replica"]
