"""The serving engine on the engine step (qualia.engine, qualia.workload, qualia.check,
qualia.timing, qualia.report, qualia.plot); the CLI is in tests/sim/test_cli.py."""

from __future__ import annotations

import collections
import time

import numpy as np
import pytest

import qualia
from qualia.sim.adapters import DecodeRuleSteps, ModelSteps
from qualia.sim.check import hash_generate, hash_next_token
from qualia.sim.config import step_scheduler_class
from qualia.sim.engine import Counters, Engine, Timeline, UnservableRequest
from qualia.sim.report import WIDTH, format_summary
from qualia.sim.timing import ROWS, Stopwatch
from qualia.sim.workload import Request, Workload
from qualia.twin import PyHashBackend, StepScheduler

# A pool small enough that reclaim and preemption happen, and a step budget small enough that
# prompts are prefilled in chunks beside decodes.
SMALL_WORKLOAD = dict(requests=24, seed=1, prompt_len=(16, 48), output_len=(8, 24),
                      system_prompts=3, system_prompt_len=20, share_ratio=0.8, tenants=2,
                      arrival_rate=250.0)  # requests a second: about 2 a step of ~7.5 ms
SMALL_ENGINE = dict(num_pages=40, max_num_seqs=12, page_tokens=8, logical_pages=12,
                    max_num_batched_tokens=48, max_prefill_chunk=16)


class HashSteps:
    """A stand-in step backend for the tests: the hash decode rule over each sampled row (the
    request id, the position and token of the row's last token), in Python."""

    def __init__(self, vocab: int = 32000) -> None:
        self.vocab = vocab
        self.plans = []  # (num tokens, chunk lengths, sampled rows) of every plan

    def execute_step(self, plan):
        qsl = plan.query_start_loc.tolist()
        self.plans.append((len(plan.input_ids), np.diff(qsl).tolist(),
                           len(plan.logits_indices)))
        rows = plan.logits_indices.tolist()
        return np.array([hash_next_token(int(r), int(plan.positions[i]),
                                         int(plan.input_ids[i]), self.vocab)
                         for r, i in zip(plan.sampled_request_ids.tolist(), rows)],
                        dtype=np.uint32)


def assert_clean_end(engine: Engine, n_requests: int) -> None:
    f = engine.facade
    assert sorted(engine.outputs) == sorted(engine._requests)
    assert len(engine.outputs) == n_requests
    assert all(count == 1 for count in engine._completions.values())
    assert not engine.scheduler.has_unfinished()
    assert f.active_count == 0 and f.free_pages == f.num_pages  # every page free or cached


# -- workload ---------------------------------------------------------------------------------


def test_workload_is_seeded_and_well_formed():
    w = Workload(requests=200, seed=7, system_prompts=3, system_prompt_len=12, share_ratio=0.5,
                 tenants=4, arrival_rate=0.5, prompt_len=(8, 40), output_len=(2, 9))
    a, b = w.generate(), Workload(**{**w.__dict__}).generate()
    assert [r.to_dict() for r in a] == [r.to_dict() for r in b]
    other = Workload(requests=200, seed=8).generate()
    assert [r.prompt for r in a] != [r.prompt for r in other]
    assert [r.request_id for r in a] == list(range(200))
    arrivals = [r.arrival_s for r in a]  # a Poisson process of 0.5 requests a second
    assert arrivals == sorted(arrivals) and 300 < arrivals[-1] < 500  # ~ 200 / 0.5 s
    assert all(r.arrival_step == 0 for r in a)
    systems = w.system_prompt_tokens()
    shared = [r for r in a if r.system_prompt is not None]
    assert 60 < len(shared) < 140
    for r in a:
        assert 2 <= r.max_new_tokens <= 9
        assert all(0 <= t < w.vocab for t in r.prompt)
        assert r.namespace == f"tenant-{r.tenant}".encode() and 0 <= r.tenant < 4
        if r.system_prompt is None:
            assert r.shared_prefix_len == 0 and 8 <= len(r.prompt) <= 40
        else:
            assert r.shared_prefix_len == 12 and len(r.prompt) > 12
            assert r.prompt[:12] == systems[r.system_prompt]
    assert {r.tenant for r in a} == {0, 1, 2, 3}
    lognormal = Workload(requests=300, length_dist="lognormal", prompt_len=(10, 90)).generate()
    assert all(10 <= len(r.prompt) <= 90 for r in lognormal if r.system_prompt is None)
    no_end = Workload(requests=50, vocab=8, eos_token_id=5, system_prompts=2, system_prompt_len=6)
    assert all(5 not in r.prompt for r in no_end.generate())
    assert any(5 in r.prompt for r in Workload(requests=50, vocab=8).generate())
    with pytest.raises(ValueError):
        Workload(prompt_len=(5, 2))
    with pytest.raises(ValueError):
        Workload(share_ratio=1.5)


def test_hash_rule_matches_the_core():
    for rid, pos, tok in [(0, 0, 0), (7, 100, 31999), (2**64 - 1, 2**32 - 1, 2**32 - 1)]:
        assert hash_next_token(rid, pos, tok) == qualia.hash_next_token(rid, pos, tok)
        assert hash_next_token(rid, pos, tok, 97) == PyHashBackend.next_token(
            rid, pos, tok, 97)



# -- workload edge cases --------------------------------------------------------------------


def test_workload_refuses_arrivals_past_what_the_clock_can_count():
    with pytest.raises(ValueError, match="too small"):
        Workload(requests=5, arrival_rate=1e-300).generate()
    with pytest.raises(ValueError, match="too small"):
        Workload(requests=5, arrival_rate=5e-324).generate()
    for bad in (0.0, -1.0, float("nan"), float("-inf")):
        with pytest.raises(ValueError, match="arrival_rate"):
            Workload(arrival_rate=bad)
    slow = Workload(requests=5, arrival_rate=1e-6).generate()  # far apart, within 1e9 s
    assert all(isinstance(r.arrival_s, float) for r in slow) and slow[-1].arrival_s > 10**5
    with pytest.raises(ValueError, match="seed"):
        Workload(seed=-1)
    import numpy as np

    assert Workload(requests=3, seed=np.uint64(7)).generate()[0].prompt == \
        Workload(requests=3, seed=7).generate()[0].prompt


def test_stopwatch_charges_every_second_to_one_row():
    clock = Stopwatch()
    time.sleep(0.01)
    prev = clock.switch(3)
    time.sleep(0.02)
    token = clock.enter(5)
    time.sleep(0.01)
    clock.leave(token)
    assert clock.row == 3
    clock.switch(prev)
    clock.stop()
    wall = clock.wall_s
    time.sleep(0.01)  # stopped: not counted
    assert clock.wall_s == wall == pytest.approx(sum(clock.seconds), abs=1e-12)
    assert clock.seconds[0] >= 0.01 and clock.seconds[3] >= 0.02 and clock.seconds[5] >= 0.01
    token = clock.enter(2)  # a stopped clock starts, and stops again on leave
    assert clock.running and token is None
    clock.leave(token)
    assert not clock.running


def test_next_turn_continues_the_conversation():
    w = Workload(requests=5, seed=4, turns=3, user_len=(3, 6), eos_token_id=7, vocab=50,
                 system_prompts=1, system_prompt_len=6)
    first = w.generate()
    assert [(r.conversation, r.turn) for r in first] == [(i, 0) for i in range(5)]
    answer = [1, 2, 7]  # ends with the end token: it is not carried into the next prompt
    nxt = w.next_turn(first[2], answer, step=40)
    assert nxt.request_id == 5 + 2 and (nxt.conversation, nxt.turn) == (2, 1)
    assert nxt.prompt[:len(first[2].prompt) + 2] == first[2].prompt + [1, 2]
    assert 3 <= len(nxt.prompt) - len(first[2].prompt) - 2 <= 6 and 7 not in nxt.prompt
    assert nxt.arrival_step == 41 and nxt.tenant == first[2].tenant
    assert w.next_turn(first[2], answer, step=40).to_dict() == nxt.to_dict()  # seeded
    last = w.next_turn(nxt, [3], step=50)
    assert last.request_id == 2 * 5 + 2 and last.turn == 2
    assert w.next_turn(last, [4], step=60) is None
    assert Workload(requests=2).next_turn(first[0], [1], 3) is None  # one turn by default
    with pytest.raises(ValueError):
        Workload(turns=0)
    with pytest.raises(ValueError):
        Workload(user_len=(4, 2))




# -- the engine step: model and decode-rule backends -----------------------------------------


def test_model_engine_matches_the_dense_model_under_pressure():
    workload = Workload(**SMALL_WORKLOAD, turns=2, user_len=(4, 12))
    engine = Engine("model", **SMALL_ENGINE)
    result = engine.run(workload, check=True)
    st = result.stats
    assert result.check.ok, result.check.describe()
    assert result.check.describe().endswith("requests match the dense model")
    assert_clean_end(engine, 24 + st["follow_up_turns"])
    assert st["follow_up_turns"] > 0 and st["requests_completed"] == 24 + st["follow_up_turns"]
    assert st["preemptions"] > 0 and st["tokens_recomputed"] > 0 and st["recomputes"] > 0
    assert st["prefix_hits"] > 0 and st["cache_hit_tokens"] > 0 and st["cache_reclaims"] > 0
    assert st["mixed_steps"] > 0  # prefill chunks beside decodes
    assert st["max_step_tokens"] <= 48
    assert st["kv_events_stored"] == st["cache_pages_stored"]
    assert st["kv_events_removed"] == st["cache_reclaims"] and st["kv_events_dropped"] == 0
    assert st["peak_pages_used"] <= 40
    assert st["steps"] == engine.backend.calls["execute_step"]  # one execute_step per step
    assert st["backend"] == "PagedModelBackend (numpy)"
    # the model's own step runner when it has one, else the engine drives its prefill
    assert isinstance(engine.backend.inner, ModelSteps) != callable(
        getattr(engine.raw_backend, "execute_step", None))


def test_model_engine_end_token_stops_requests():
    requests = Workload(requests=10, seed=3, prompt_len=(10, 30), output_len=(12, 20),
                        system_prompts=1, system_prompt_len=9, share_ratio=1.0, tenants=1,
                        arrival_rate=float("inf")).generate()
    free_run = Engine("model", num_pages=64, max_num_seqs=10, page_tokens=4, logical_pages=16)
    free_run.run(requests)
    counts = collections.Counter(t for out in free_run.outputs.values() for t in out[:-1])
    end = counts.most_common(1)[0][0]
    engine = Engine("model", num_pages=64, max_num_seqs=10, page_tokens=4, logical_pages=16,
                    eos_token_id=end)
    result = engine.run(requests, check=True)
    assert result.check.ok, result.check.describe()
    stopped = [rid for rid, out in engine.outputs.items()
               if len(out) < engine._requests[rid].max_new_tokens]
    assert stopped and all(engine.outputs[rid][-1] == end for rid in stopped)
    assert result.stats["finished_stop"] == len(stopped)
    assert all(engine.finish_reasons[rid] == "stop" for rid in stopped)
    # one tenant, one system prompt of 9 tokens (2 full pages of 4), all arriving at once and
    # admitted in the first step: pages enter the cache at update(), so none finds them
    assert result.stats["prefix_hits"] == 0 and result.stats["admissions"] == 10
    assert_clean_end(engine, 10)


def test_c_backend_engine_matches_the_hash_rule():
    requests = Workload(requests=200, seed=5, prompt_len=(8, 80), output_len=(4, 40),
                        system_prompts=5, system_prompt_len=24, share_ratio=0.7, tenants=3,
                        arrival_rate=500.0, vocab=32000).generate()
    engine = Engine("c", num_pages=120, max_num_seqs=32, page_tokens=16, logical_pages=8,
                    max_num_batched_tokens=256, max_prefill_chunk=64)
    result = engine.run(requests, check=True)
    st = result.stats
    assert result.check.ok, result.check.describe()
    assert result.check.describe() == "all 200 requests match the pure-Python hash rule"
    assert_clean_end(engine, 200)
    assert st["preemptions"] > 0 and st["prefix_hits"] > 0
    assert st["backend"] == "HashBackend (C)"
    for rid, out in engine.outputs.items():
        req = engine._requests[rid]
        assert out == hash_generate(rid, req.prompt, req.max_new_tokens)


def test_c_backend_small_vocab_end_token_and_tiny_pool():
    # vocab 8 makes the end token frequent; page_tokens=1 and one request slot stress every path
    requests = Workload(requests=60, seed=2, prompt_len=(1, 12), output_len=(1, 10),
                        system_prompts=2, system_prompt_len=3, share_ratio=0.9, tenants=2,
                        arrival_rate=3.0, vocab=8).generate()
    for max_num_seqs in (1, 5):
        engine = Engine("c", num_pages=24, max_num_seqs=max_num_seqs, page_tokens=1,
                        logical_pages=24, vocab_size=8, eos_token_id=3,
                        max_num_batched_tokens=6)
        result = engine.run(requests, check=True)
        assert result.check.ok, result.check.describe()
        assert_clean_end(engine, 60)
        assert any(out[-1] == 3 and len(out) < engine._requests[rid].max_new_tokens
                   for rid, out in engine.outputs.items())


class _RuleOnly:
    """A decode-rule backend with nothing but the rule."""

    vocab = 1000
    next_token = staticmethod(PyHashBackend.next_token)


@pytest.mark.parametrize("backend", [PyHashBackend(vocab=1000), _RuleOnly()])
def test_python_decode_rule_backend(backend):
    requests = Workload(**{**SMALL_WORKLOAD, "vocab": 1000}).generate()
    engine = Engine(backend, **SMALL_ENGINE)
    result = engine.run(requests, check=True)
    assert result.check.ok and result.stats["preemptions"] > 0
    if not callable(getattr(backend, "execute_step", None)):
        assert isinstance(engine.backend.inner, DecodeRuleSteps)
    assert result.stats["backend"] == f"{type(backend).__name__} (Python)"
    assert_clean_end(engine, 24)


def test_a_step_backend_is_used_as_it_is_and_plans_keep_the_budget():
    backend = HashSteps(vocab=32000)
    requests = Workload(**{**SMALL_WORKLOAD, "vocab": 32000}).generate()
    engine = Engine(backend, **dict(SMALL_ENGINE, max_num_seqs=6))
    result = engine.run(requests, check=True)
    assert result.check.ok, result.check.describe()
    assert engine.backend.inner is backend
    assert len(backend.plans) == result.stats["steps"] == len(result.timeline)
    chunked = False
    for tokens, chunks, _ in backend.plans:
        assert 0 < tokens <= 48 and len(chunks) <= 6
        assert all(n <= 16 or n == 1 for n in chunks)
        chunked |= any(n == 16 for n in chunks)
    assert chunked  # prompts longer than the chunk went in several steps
    assert sum(p[2] for p in backend.plans) == result.stats["tokens_generated"]


def test_not_a_step_backend():
    with pytest.raises(TypeError, match="execute_step"):
        Engine(object())
    with pytest.raises(ValueError):
        Engine("gpu")


# -- the scheduler is injectable --------------------------------------------------------------


def test_the_scheduler_factory_and_the_step_loop():
    calls = []

    class Recording(StepScheduler):
        def __init__(self, *args, **kwargs):
            calls.append(("init", kwargs["max_num_batched_tokens"], kwargs["max_prefill_chunk"]))
            super().__init__(*args, **kwargs)

        def add_request(self, *args, **kwargs):
            calls.append("add_request")
            return super().add_request(*args, **kwargs)

        def schedule(self):
            calls.append("schedule")
            return super().schedule()

        def update(self, sampled):
            calls.append("update")
            return super().update(sampled)

    engine = Engine(HashSteps(), scheduler=Recording, max_num_batched_tokens=32,
                    max_prefill_chunk=8)
    engine.run(Workload(requests=5, seed=1, vocab=32000, arrival_rate=float("inf")))
    assert calls[0] == ("init", 32, 8)
    loop = [c for c in calls[1:] if c != "add_request"]
    assert loop == ["schedule", "update"] * (len(loop) // 2) and loop
    assert calls.count("add_request") == 5
    assert engine.implementation == "twin"


def test_scheduler_choice():
    assert issubclass(step_scheduler_class("twin"), StepScheduler)
    assert isinstance(Engine("c", scheduler="twin").scheduler, StepScheduler)
    assert step_scheduler_class("core") is qualia.StepScheduler
    assert step_scheduler_class("auto") is qualia.StepScheduler
    assert Engine("c").implementation == "core"
    with pytest.raises(ValueError, match="scheduler"):
        step_scheduler_class("gpu")
    with pytest.raises(ValueError, match="scheduler"):
        Engine("c", scheduler="gpu")


def test_prefix_caching_modes():
    with pytest.raises(ValueError, match="explicit"):
        Engine("c", prefix_caching="explicit")
    with pytest.raises(ValueError):
        Engine("c", prefix_caching="sometimes")
    engine = Engine("c", **dict(SMALL_ENGINE, prefix_caching="off"))
    result = engine.run(Workload(**{**SMALL_WORKLOAD, "vocab": 32000}), check=True)
    assert result.check.ok and result.stats["prefix_caching"] == "off"
    assert engine.facade.cache_stats().hit_tokens == 0
    # without a cache its figures, always zero, are left out
    assert not [k for k in result.stats if k.startswith(("prefix_", "cache_", "kv_events"))
                and k != "prefix_caching"]


# -- latencies and the serving clock ----------------------------------------------------------


def test_each_token_is_delivered_at_the_end_of_the_step_that_sampled_it():
    # a prompt of 10 in chunks of 4: steps 0, 1, 2 (the last samples the first token), then one
    # token per step; every step takes 0.5 s
    engine = Engine(HashSteps(), page_tokens=4, max_prefill_chunk=4, step_seconds=0.5)
    result = engine.run([Request(0, 0, list(range(10)), 0, 5)])
    rec = result.records[0]
    assert rec.token_times_s == (1.5, 2.0, 2.5, 3.0, 3.5)
    assert (rec.arrival_s, rec.first_token_s, rec.finish_s) == (0.0, 1.5, 3.5)
    assert (rec.input_tokens, rec.output_tokens) == (10, 5)
    lat = engine.latencies()
    assert lat == {"ttft_steps": [3.0], "tpot_steps": [1.0], "e2el_steps": [7.0]}
    fig = result.figures
    assert fig["completed"] == 1 and fig["duration"] == 3.5
    assert fig["output_throughput"] == pytest.approx(5 / 3.5)
    assert fig["total_token_throughput"] == pytest.approx(15 / 3.5)
    assert fig["mean_ttft_ms"] == 1500.0 and fig["mean_tpot_ms"] == 500.0
    assert fig["mean_itl_ms"] == 500.0 and fig["p99_e2el_ms"] == 3500.0
    st = result.stats
    assert st["steps"] == 7 and st["busy_s"] == 3.5 and st["mean_step_ms"] == 500.0
    assert st["median_ttft_steps"] == st["p99_ttft_steps"] == 3.0
    assert st["mean_e2el_steps"] == 7.0 and st["clock_kind"] == "fixed"
    assert st["step_ms"] == 500.0 and st["clock"] == "fixed: 500 ms per step"


def test_arrivals_in_seconds_wait_for_the_clock():
    reqs = [Request(0, 0, [1, 2, 3], 0, 2, arrival_s=0.0),
            Request(1, 0, [4, 5, 6], 0, 2, arrival_s=10.0),  # long after request 0 is done
            Request(2, 0, [7, 8, 9], 0, 3, arrival_s=10.25)]
    engine = Engine(HashSteps(), page_tokens=4, step_seconds=0.5)
    result = engine.run(reqs, check=True)
    assert result.check.ok
    st = result.stats
    # request 0: steps 0-1 (t 0.5, 1.0); idle until 10.0; request 1 from step 2 at t 10.0,
    # request 2 due at the start of step 3 (t 10.5), done after 3 steps
    assert st["idle_s"] == pytest.approx(9.0)
    assert result.figures["duration"] == pytest.approx(12.0)
    assert sorted(r.ttft_s for r in result.records.values()) == pytest.approx(
        [0.5, 0.5, 0.5 + 0.25])
    assert st["median_ttft_steps"] == 1.0


def test_a_later_turn_arrives_after_first_turns_still_to_come():
    """A later turn is due when its previous turn completed, however far off the next
    conversation's first turn is: arrivals go by time, and no later arrival holds back an
    earlier one."""
    w = Workload(requests=2, turns=2, seed=0, vocab=32000, arrival_rate=0.01,
                 prompt_len=(4, 8), output_len=(2, 3), system_prompts=0)
    engine = Engine(HashSteps(), page_tokens=4, step_seconds=0.01)
    result = engine.run(w, check=True)
    assert result.check.ok
    first = {q.request_id: q for q in w.generate()}
    assert first[1].arrival_s > first[0].arrival_s + 10  # the second conversation comes late
    turn2 = result.records[2]  # conversation 0's second turn
    assert turn2.arrival_s == pytest.approx(result.records[0].finish_s)
    assert turn2.ttft_s < 0.1 and turn2.finish_s < first[1].arrival_s


def test_arrivals_beyond_the_queue_wait_in_the_engine():
    engine = Engine(HashSteps(), max_num_seqs=2, max_queued=3, page_tokens=4)
    reqs = Workload(requests=12, seed=3, vocab=32000, arrival_rate=float("inf"),
                    prompt_len=(4, 10), output_len=(2, 4)).generate()
    result = engine.run(reqs, check=True)
    assert result.check.ok
    assert result.stats["peak_waiting"] == 10 and result.stats["peak_running"] <= 2


# -- rejection and bad input ------------------------------------------------------------------


def test_oversize_request_is_rejected_at_submission():
    engine = Engine("c", num_pages=8, max_num_seqs=2, page_tokens=4, logical_pages=16)
    engine.submit(Request(0, 0, list(range(30)), 0, 3))  # 32 positions = 8 pages: fits
    with pytest.raises(UnservableRequest, match="whole pool has only 8 pages"):
        engine.submit(Request(1, 0, list(range(30)), 0, 4))
    with pytest.raises(UnservableRequest, match="logical_pages=16"):
        engine.submit(Request(2, 0, list(range(60)), 0, 10))
    table = Engine("c", num_pages=64, max_num_seqs=2, page_tokens=4, logical_pages=4)
    with pytest.raises(UnservableRequest, match="16 tokens a request may hold"):
        table.submit(Request(0, 0, list(range(14)), 0, 3))  # 17 tokens: one past the table
    table.submit(Request(1, 0, list(range(14)), 0, 2))
    with pytest.raises(ValueError, match="duplicate"):
        engine.submit(Request(0, 0, [1, 2], 0, 1))
    with pytest.raises(ValueError, match="empty"):
        engine.submit(Request(3, 0, [], 0, 1))
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.submit(Request(4, 0, [1], 0, 0))
    with pytest.raises(ValueError, match="arrival_s"):
        engine.submit(Request(5, 0, [1], 0, 1, arrival_s=float("nan")))
    with pytest.raises(TypeError, match="token ids"):
        engine.submit(Request(6, 0, np.array([1.5]), 0, 1))
    result = engine.run()  # the accepted request is still served
    assert result.stats["requests_completed"] == 1
    assert table.run().stats["requests_completed"] == 1
    model = Engine("model", num_pages=8, max_num_seqs=2, page_tokens=4, logical_pages=8)
    with pytest.raises(ValueError, match="token ids"):
        model.submit(Request(0, 0, [1, 512], 0, 1))
    with pytest.raises(ValueError, match="token ids"):
        model.submit(Request(1, 0, np.array([1, 512], dtype=np.uint32), 0, 1))
    with pytest.raises(ValueError, match="max_num_seqs"):
        Engine("c", max_num_seqs=0)
    with pytest.raises(ValueError, match="step_seconds"):
        Engine("c", step_seconds=-1.0)


def test_an_arrival_after_the_latest_a_run_may_have_is_refused():
    """arrival_s is at most MAX_ARRIVAL_S (1e9 s, a trace's longest span too): the shortest
    step moves the serving clock up to there, so every token of a request has a time of its
    own.  A later arrival is an UnservableRequest (a ValueError) naming the field."""
    from qualia.sim.trace import MAX_TRACE_SPAN_S
    from qualia.sim.workload import MAX_ARRIVAL_S

    assert MAX_ARRIVAL_S == MAX_TRACE_SPAN_S == 1e9
    engine = Engine("c", num_pages=64, max_num_seqs=4, logical_pages=8, step_seconds=1e-6)
    for late in (np.nextafter(MAX_ARRIVAL_S, np.inf), 1e15):
        with pytest.raises(UnservableRequest, match="request 1: arrival_s must be at most 1e"):
            engine.submit(_req(arrival_s=late, max_new_tokens=8))
    assert engine.pending == 0
    engine.submit(_req(arrival_s=MAX_ARRIVAL_S, max_new_tokens=8))
    engine.run()
    times = engine.records[1].token_times_s
    assert len(times) == 8 and all(b > a for a, b in zip(times, times[1:]))


def _req(rid=1, **kw):
    fields = dict(request_id=rid, tenant=0, prompt=[1, 2, 3, 4, 5], shared_prefix_len=0,
                  max_new_tokens=3, arrival_s=0.0)
    fields.update(kw)
    return Request(**fields)


class _Index:
    def __init__(self, n):
        self.n = n

    def __index__(self):
        return self.n


@pytest.mark.parametrize("field, value, exc, says", [
    ("max_new_tokens", 1.7, TypeError, "max_new_tokens must be an integer"),
    ("max_new_tokens", float("nan"), TypeError, "max_new_tokens must be an integer"),
    ("max_new_tokens", True, TypeError, "max_new_tokens must be an integer"),
    ("request_id", 1.5, TypeError, "request_id must be an integer"),
    ("request_id", "7", TypeError, "request_id must be an integer"),
    ("request_id", False, TypeError, "request_id must be an integer"),
    ("shared_prefix_len", 1.0, TypeError, "shared_prefix_len must be an integer"),
    ("arrival_s", "1", TypeError, "arrival_s must be a number"),
    ("arrival_s", True, TypeError, "arrival_s must be a number"),
    ("arrival_s", float("inf"), ValueError, "arrival_s must be a finite number"),
    ("arrival_s", -1.0, ValueError, "arrival_s must be a finite number"),
    ("arrival_step", -5, ValueError, "arrival_step must be an integer >= 0"),
    ("arrival_step", 1.5, TypeError, "arrival_step must be an integer"),
    ("tenant", -1, ValueError, "tenant must be an integer >= 0"),
    ("tenant", "x", TypeError, "tenant must be an integer"),
    ("turn", -1, ValueError, "turn must be an integer >= 0"),
    ("conversation", 0.5, TypeError, "conversation must be an integer"),
])
def test_submit_takes_each_field_of_its_type_and_rounds_or_parses_nothing(field, value, exc,
                                                                           says):
    engine = Engine("c", num_pages=64, max_num_seqs=4, logical_pages=8)
    with pytest.raises(exc, match=says):
        engine.submit(_req(**{field: value}))
    assert engine.pending == 0
    # numpy numbers and objects with __index__ are numbers of their kind
    engine.submit(_req(np.uint64(1), tenant=np.int32(2), max_new_tokens=_Index(3),
                       arrival_step=np.int64(0), arrival_s=np.float32(0.5)))
    engine.submit(_req(2, arrival_s=1))
    result = engine.run()
    assert {k: len(v) for k, v in result.outputs.items()} == {1: 3, 2: 3}
    assert engine.records[1].arrival_s == 0.5 and engine.records[2].arrival_s == 1.0
    assert type(engine._requests[1].request_id) is int


@pytest.mark.parametrize("prompt", [
    [1.5, 2.0], np.array([1.0, 2.0]), None, "abc", b"ab", [[1, 2]], np.array([[1, 2]]),
    [1, None], [True, False], 7,
])
def test_a_prompt_of_the_wrong_type_is_a_type_error(prompt):
    """A prompt that is not a 1-D sequence of integers is a TypeError naming the prompt; an
    empty prompt and integers outside the token ids are ValueErrors."""
    engine = Engine("c", num_pages=64, max_num_seqs=4, logical_pages=8)
    with pytest.raises(TypeError, match="request 1: prompt token ids must be a 1-D sequence"):
        engine.submit(_req(prompt=prompt))
    for empty_or_out_of_range in ([], np.zeros(0), [2**32], [2**70], [-1], [-(2**70)]):
        with pytest.raises(ValueError) as exc:
            engine.submit(_req(prompt=empty_or_out_of_range))
        assert not isinstance(exc.value, TypeError)
        assert "request 1: " in str(exc.value)
    assert engine.pending == 0


@pytest.mark.parametrize("field, value, says", [
    ("max_new_tokens", -(2**64), "max_new_tokens must be >= 1, got -18446744073709551616"),
    ("max_new_tokens", -(2**63) - 1, "max_new_tokens must be >= 1, got"),
    ("max_new_tokens", 0, "max_new_tokens must be >= 1, got 0"),
    ("shared_prefix_len", -(2**64), r"shared_prefix_len must be in \[0, len\(prompt\)\]"),
    ("shared_prefix_len", 6, r"shared_prefix_len must be in \[0, len\(prompt\)\] = \[0, 5\]"),
])
def test_a_fields_range_message_states_its_range(field, value, says):
    """A value out of its field's range is refused with the field's range: never a bound the
    check uses inside."""
    engine = Engine("c", num_pages=64, max_num_seqs=4, logical_pages=8)
    with pytest.raises(ValueError, match=says) as exc:
        engine.submit(_req(**{field: value}))
    assert str(2**63) not in str(exc.value)


def test_submit_all_queues_every_request_or_none():
    engine = Engine("c", num_pages=64, max_num_seqs=4, logical_pages=8)
    with pytest.raises(ValueError, match="request 2: the prompt is empty"):
        engine.run([_req(1), _req(2, prompt=[])])
    assert engine.pending == 0
    with pytest.raises(ValueError, match="request 1: duplicate request id"):
        engine.submit_all([_req(1), _req(3), _req(1)])
    assert engine.pending == 0
    engine.submit(_req(5))
    with pytest.raises(ValueError, match="request 5: duplicate request id"):
        engine.submit_all([_req(4), _req(5)])
    assert engine.pending == 1
    with pytest.raises(TypeError, match="max_new_tokens"):
        engine.run([_req(6), _req(7, max_new_tokens=2.0)])
    assert engine.pending == 1
    assert sorted(engine.run([_req(6)]).outputs) == [5, 6]


class _OffByOne(HashSteps):
    """Deviates from the hash rule for request 3 only."""

    def execute_step(self, plan):
        out = super().execute_step(plan)
        for i, rid in enumerate(plan.sampled_request_ids.tolist()):
            if rid == 3:
                out[i] = (out[i] + 1) % self.vocab
        return out


def test_check_reports_a_mismatch():
    requests = Workload(requests=6, prompt_len=(4, 8), output_len=(3, 5),
                        system_prompts=0, vocab=32000).generate()
    engine = Engine(_OffByOne(), num_pages=16, max_num_seqs=4, page_tokens=4, logical_pages=4)
    result = engine.run(requests, check=True)
    assert not result.check.ok and result.check.mismatched == [3]
    assert "1 of 6 requests DIFFER" in result.check.describe()
    assert result.stats["check_ok"] is False


def test_a_failed_step_leaves_the_engine_able_to_go_on():
    class Flaky(HashSteps):
        fail = True

        def execute_step(self, plan):
            if self.fail:
                self.fail = False
                raise RuntimeError("device lost")
            return super().execute_step(plan)

    engine = Engine(Flaky(), page_tokens=4)
    if not callable(getattr(engine.scheduler, "discard_plan", None)):
        pytest.skip("this scheduler cannot drop a plan whose execution failed")
    engine.submit(Request(0, 0, [1, 2, 3], 0, 3))
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    result = engine.run(check=True)  # the discarded plan is scheduled again
    assert result.check.ok and result.stats["requests_completed"] == 1


# -- counters, the clock, the summary ---------------------------------------------------------


def test_counters_are_typed():
    c = Counters()
    c.preemptions += 1
    assert c.preemptions == 1
    with pytest.raises(AttributeError):
        c.preemptons += 1  # a typo is an error, not a silent zero
    with pytest.raises(AttributeError):
        c.preemptons = 1
    assert isinstance(Engine("c").counters, Counters)
    assert isinstance(Engine("c").timeline, Timeline)


class _Sleepy(HashSteps):
    """A Python step backend that sleeps in every call (and knows for how long)."""

    def __init__(self, nap, **kwargs):
        super().__init__(**kwargs)
        self.nap, self.slept = nap, 0.0

    def execute_step(self, plan):
        t0 = time.perf_counter()
        time.sleep(self.nap)
        self.slept += time.perf_counter() - t0
        return super().execute_step(plan)


def _sum_rows(stats):
    assert set(stats["time_s"]) == set(ROWS)
    assert sum(stats["time_s"].values()) == pytest.approx(stats["wall_s"], rel=1e-9, abs=1e-9)
    return stats["wall_s"]


def test_python_backend_time_lands_in_the_backend_row():
    backend = _Sleepy(0.002, vocab=1000)
    requests = Workload(**{**SMALL_WORKLOAD, "vocab": 1000}).generate()
    t0 = time.perf_counter()
    engine = Engine(backend, clock="measured", **SMALL_ENGINE)
    st = engine.run(requests).stats
    elapsed = time.perf_counter() - t0
    t = st["time_s"]
    assert t["backend"] >= backend.slept > 0
    assert sum(engine.step_backend_s) >= backend.slept
    assert t["scheduler"] > 0
    # the measured serving clock: the steps, the backend's sleeps inside them
    assert st["busy_s"] >= backend.slept and st["clock_kind"] == "measured"
    assert _sum_rows(st) <= elapsed
    assert st["backend"] == "_Sleepy (Python)"


def _nap(seconds):
    """Sleep; the time it measured."""
    t0 = time.perf_counter()
    time.sleep(seconds)
    return time.perf_counter() - t0


def test_engine_clock_counts_only_inside_engine_calls():
    requests = Workload(requests=8, seed=4, vocab=32000).generate()
    t0 = time.perf_counter()
    engine = Engine("c")
    caller = _nap(0.1)  # the caller's time, not the engine's
    engine.submit_all(requests)
    caller += _nap(0.1)
    st = engine.run(check=True).stats
    elapsed = time.perf_counter() - t0
    assert _sum_rows(st) <= elapsed - caller
    assert st["check_s"] == st["time_s"]["check"] > 0
    assert st["time_s"]["submission"] > 0 and st["time_s"]["engine"] > 0


def test_workload_generation_and_submission_have_their_rows():
    engine = Engine("c", stopwatch=Stopwatch())
    w = Workload(requests=20, vocab=32000)
    slept = [0.0]
    generate = w.generate

    def slow_generate():
        t0 = time.perf_counter()
        time.sleep(0.05)
        slept[0] = time.perf_counter() - t0
        return generate()

    w.generate = slow_generate
    assert engine.submit_all(w) == 20
    st = engine.run().stats
    assert st["time_s"]["workload"] >= slept[0] > 0
    assert st["wall_s"] >= slept[0]
    _sum_rows(st)


def _table_rows(text):
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("where the time went"))
    rows = {}
    for ln in lines[start + 1:]:
        if not ln or ln.startswith("("):
            break
        label = ln[:36].rstrip()
        rows[label] = float(ln[36:].split()[0])
    return rows


@pytest.mark.parametrize("backend", ["model", "c"])
def test_summary_rows_add_up_and_fit_80_columns(backend):
    vocab = 512 if backend == "model" else 32000
    requests = Workload(**{**SMALL_WORKLOAD, "vocab": vocab}).generate()
    result = Engine(backend, **SMALL_ENGINE).run(requests, check=True)
    text = format_summary(result.stats, result.figures, result.check.describe())
    assert max(len(ln) for ln in text.splitlines()) <= WIDTH == 80
    for label in ("Request throughput (req/s):", "Mean TTFT (ms):", "P99 TPOT (ms):",
                  "Median ITL (ms):", "Std E2EL (ms):", "step budget"):
        assert label in text
    rows = _table_rows(text)
    wall = rows.pop("wall time (sum of the rows)")
    assert wall == pytest.approx(result.stats["wall_s"], abs=1e-3)
    assert sum(rows.values()) == pytest.approx(wall, abs=1e-3 * len(rows))
    label = "backend: PagedModelBackend (numpy)" if backend == "model" else \
        "backend: HashBackend (C)"
    assert label in rows
    assert "decode round (scheduler + C backend)" not in rows


def test_summary_fits_80_columns_with_huge_figures():
    requests = Workload(requests=6, vocab=32000).generate()
    engine = Engine(_OffByOne(vocab=32000), num_pages=64, logical_pages=16)
    result = engine.run(requests, check=True)
    stats = {k: (10**15 + 7 if isinstance(v, int) and not isinstance(v, bool) else v)
             for k, v in result.stats.items()}
    stats["backend"] = "AVeryLongBackendClassNameThatGoesOnAndOn (Python)"
    stats["time_s"] = {k: 12345.678 for k in stats["time_s"]}
    stats["wall_s"] = 12345.678 * len(ROWS)
    for key in [k for k in stats if k.endswith("_steps") or k.endswith("_ms")]:
        stats[key] = 999_999_999.0
    figures = {k: (10**15 + 7 if isinstance(v, int) else 1e12)
               for k, v in result.figures.items()}
    message = ("1234 of 100000 requests DIFFER from the dense model: "
               + ", ".join(str(10**12 + i) for i in range(10)) + " (+99990 more)")
    text = format_summary(stats, figures, message)
    assert max(len(ln) for ln in text.splitlines()) <= WIDTH
    assert "+99990 more" in text  # wrapped, not cut
    assert "1,000,000,000,000,007" in text and "1,000,000,000,000.00" in text
    assert "e+" not in text  # never in scientific notation


# -- automatic prefix caching and multi-turn conversations -----------------------------------


def test_a_later_turn_reuses_the_previous_answer():
    w = Workload(requests=1, seed=2, turns=2, system_prompts=0, prompt_len=(40, 40),
                 output_len=(20, 20), user_len=(5, 5), vocab=32000)
    engine = Engine("c", num_pages=64, max_num_seqs=2, page_tokens=4, logical_pages=32)
    result = engine.run(w, check=True)
    assert result.check.ok
    st = result.stats
    # turn 1 computed 40 prompt + 19 fed answer tokens: 14 full pages; turn 2 reuses them all
    assert st["follow_up_turns"] == 1 and st["cache_hit_tokens"] == 56 > 40


def test_auto_tenants_never_share_pages():
    prompt = list(range(1, 40))
    reqs = [Request(i, tenant, prompt, 0, 4, arrival_step=2 * i)
            for i, tenant in enumerate([0, 1, 0, 2])]
    engine = Engine("c", num_pages=64, max_num_seqs=4, page_tokens=8, logical_pages=8)
    result = engine.run(reqs, check=True)
    assert result.check.ok
    assert result.stats["prefix_hits"] == 1  # request 2, tenant 0 again
    assert result.stats["cache_hit_tokens"] == 32


# -- the timeline and its plot ----------------------------------------------------------------


def test_timeline_follows_the_run():
    engine = Engine("c", **SMALL_ENGINE)
    result = engine.run(Workload(**{**SMALL_WORKLOAD, "vocab": 32000}))
    tl = result.timeline
    assert len(tl) == result.stats["steps"]
    assert tl.step == sorted(tl.step) and len(set(tl.step)) == len(tl.step)
    assert max(tl.running) == result.stats["peak_running"] <= 12
    assert max(tl.pages_used) == result.stats["peak_pages_used"] <= 40
    assert all(u + c <= 40 for u, c in zip(tl.pages_used, tl.pages_cached))
    assert all(0.0 <= h <= 1.0 for h in tl.hit_rate) and tl.hit_rate[-1] > 0
    assert tl.running[-1] == 0 and tl.waiting[-1] == 0
    assert len(tl.ttft_steps) == result.stats["requests_completed"]


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from qualia.sim.plot import plot_timeline

    result = Engine("c", **SMALL_ENGINE).run(Workload(**{**SMALL_WORKLOAD, "vocab": 32000}))
    path = tmp_path / "run.png"
    plot_timeline(result.timeline, str(path), stats=result.stats, figures=result.figures,
                  records=result.records)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = tmp_path / "run.svg"
    plot_timeline(result.timeline, str(svg), records=result.records)
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml")
    # four panels over the serving clock, the last the latencies
    assert "serving time (s)" in text and "latency (ms)" in text


def test_plot_without_matplotlib(monkeypatch, tmp_path):
    import sys

    from qualia.sim.plot import matplotlib_problem, plot_timeline

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    # the extra of the local checkout: the package index's "qualia" is another project
    assert 'pip install ".[plot]" in the qualia checkout' in matplotlib_problem()
    with pytest.raises(ImportError, match=r'"\.\[plot\]"'):
        plot_timeline(Timeline(), str(tmp_path / "x.png"))


def test_a_scheduler_that_schedules_nothing_is_reported_not_looped_on():
    class Idle(StepScheduler):
        def schedule(self):  # never admits anything: an empty plan every step
            self._waiting_backup = list(self._waiting)
            self._waiting.clear()
            try:
                return super().schedule()
            finally:
                self._waiting[:] = self._waiting_backup

    engine = Engine(HashSteps(), scheduler=Idle, page_tokens=4)
    with pytest.raises(RuntimeError, match="engine stuck"):
        engine.run([Request(0, 0, [1, 2, 3], 0, 2)])


def test_recomputed_tokens_are_what_a_preempted_request_computes_again():
    # two requests in a pool that holds one of them at its peak: the later admitted one is
    # preempted when the first needs pages, and recomputes what the cache did not keep
    reqs = [Request(0, 0, list(range(1, 9)), 0, 8), Request(1, 0, list(range(11, 19)), 0, 8)]
    engine = Engine(HashSteps(), num_pages=5, max_num_seqs=2, page_tokens=4, logical_pages=4)
    result = engine.run(reqs, check=True)
    st = result.stats
    assert result.check.ok and st["preemptions"] >= 1 and st["recomputes"] >= 1
    # the prompts share nothing, so every token computed is a prompt or output token (less the
    # last output of each request, never fed back) or a recomputed one; the resumed request's
    # cache hit is a page it had filled itself
    fed = sum(len(r.prompt) + r.max_new_tokens - 1 for r in reqs)
    assert st["tokens_scheduled"] == fed + st["tokens_recomputed"]
    assert 0 < st["tokens_recomputed"] and st["cache_hit_tokens"] > 0


class _Pool:
    """A pool of 6 pages, page 4 held twice (what the end-state check reads)."""

    num_blocks = 6

    def __init__(self, bulk):
        self.counts = [1, 1, 1, 1, 2, 1]
        if bulk:
            self.refcounts = lambda: np.array(self.counts, dtype=np.uint32)

    def refcount(self, page):
        return self.counts[page]


@pytest.mark.parametrize("bulk", [True, False])
def test_end_state_check_names_a_cached_page_with_a_wrong_refcount(bulk):
    from types import SimpleNamespace

    from qualia.sim.check import verify_end_state

    facade = SimpleNamespace(
        active_count=0, free_pages=6, pool=_Pool(bulk), prefixes=None,
        cache_stats=lambda: SimpleNamespace(cached_pages=6, reclaimable_pages=6),
        reclaimable_pages=lambda: np.array([5, 2, 4, 0, 1, 3], dtype=np.uint32))
    with pytest.raises(RuntimeError, match="cached page 4: refcount 2, expected 1"):
        verify_end_state(facade, {7: None}, {7: 1})
    facade.pool.counts[4] = 1
    verify_end_state(facade, {7: None}, {7: 1})


def test_outputs_hold_every_completed_request_as_a_list_after_each_step():
    engine = Engine("c", num_pages=200)
    engine.submit_all(Workload(requests=10, seed=3, turns=1))
    completed = []
    while engine.pending:
        engine.step()
        assert set(engine.outputs) == set(engine.finish_reasons)
        completed = list(engine.outputs)
        assert all(type(engine.outputs[r]) is list and
                   all(type(t) is int for t in engine.outputs[r]) for r in completed)
    assert len(completed) == 10
    seen = {}
    Engine("c", num_pages=200, on_complete=lambda rid, tokens: seen.setdefault(rid, tokens)
           ).run(Workload(requests=10, seed=3, turns=1))
    assert seen == engine.outputs
