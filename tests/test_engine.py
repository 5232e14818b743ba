"""The serving engine (qualia.engine, qualia.workload, qualia.check, qualia.timing,
qualia.report); the CLI is in test_cli.py."""

from __future__ import annotations

import collections
import time

import pytest

import qualia
from qualia.check import hash_generate, hash_next_token
from qualia.engine import Counters, Engine, UnservableRequest, is_exhausted
from qualia.report import WIDTH, format_summary
from qualia.timing import ROWS, Stopwatch
from qualia.twin import PyHashBackend
from qualia.workload import Request, Workload, pages_needed

# A pool small enough that prefix eviction, preemption and copy-on-write all happen (explicit
# prefix caching: the breakpoint mode these tests were written for; automatic caching has its
# own tests below).
SMALL_WORKLOAD = dict(requests=24, seed=1, prompt_len=(16, 48), output_len=(8, 24),
                      system_prompts=3, system_prompt_len=20, share_ratio=0.8, tenants=2,
                      arrival_rate=2.0)
SMALL_ENGINE = dict(num_blocks=40, max_requests=12, page_tokens=8, logical_pages=12,
                    prefix_entries=4, prefix_caching="explicit")
EXPLICIT = dict(prefix_caching="explicit")


def assert_clean_end(engine: Engine, n_requests: int) -> None:
    s = engine.scheduler
    assert sorted(engine.outputs) == sorted(engine._requests)
    assert len(engine.outputs) == n_requests
    assert all(count == 1 for count in engine._completions.values())
    assert s.active_count == 0
    store_pages = collections.Counter(engine.store_pages())
    assert s.free_pages + len(store_pages) == s.num_blocks
    for page, count in store_pages.items():
        assert s.pool.refcount(page) == count


# -- workload ---------------------------------------------------------------------------------


def test_workload_is_seeded_and_well_formed():
    w = Workload(requests=200, seed=7, system_prompts=3, system_prompt_len=12, share_ratio=0.5,
                 tenants=4, arrival_rate=0.5, prompt_len=(8, 40), output_len=(2, 9))
    a, b = w.generate(), Workload(**{**w.__dict__}).generate()
    assert [r.to_dict() for r in a] == [r.to_dict() for r in b]
    other = Workload(requests=200, seed=8).generate()
    assert [r.prompt for r in a] != [r.prompt for r in other]
    assert [r.request_id for r in a] == list(range(200))
    arrivals = [r.arrival_step for r in a]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 100  # ~ 200 / 0.5 steps
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
    no_end = Workload(requests=50, vocab=8, end_token=5, system_prompts=2, system_prompt_len=6)
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


# -- the model backend ------------------------------------------------------------------------


def test_model_engine_matches_the_dense_model_under_pressure():
    requests = Workload(**SMALL_WORKLOAD).generate()
    engine = Engine("model", **SMALL_ENGINE)
    result = engine.run(requests, check=True)
    st = result.stats
    assert result.check.ok, result.check.describe()
    assert result.check.describe() == "all 24 requests match the dense model"
    assert_clean_end(engine, 24)
    assert st["requests_completed"] == 24
    assert st["tokens_generated"] == sum(r.max_new_tokens for r in requests)  # no end token
    assert st["preemptions"] > 0 and st["tokens_recomputed"] > 0
    assert st["recompute_mismatches"] == 0  # recomputed prefill reproduced the pending token
    assert st["prefix_hits"] > 0 and 0 < st["prefix_hit_rate"] <= 1
    assert st["pages_copied"] > 0
    assert st["evictions"] > 0 and st["evictions_for_pages"] > 0
    assert st["evictions"] == st["evictions_for_pages"] + st["evictions_for_entries"]
    assert st["peak_pages_used"] == SMALL_ENGINE["num_blocks"]
    assert st["decode_rounds"] == engine.backend.inner.rounds
    assert st["backend"] == "PagedModelBackend (numpy)"


def test_model_engine_end_token_and_tenants():
    # find a token the dense model emits often, so that requests stop early on it
    requests = Workload(requests=10, seed=3, prompt_len=(10, 30), output_len=(12, 20),
                        system_prompts=1, system_prompt_len=9, share_ratio=1.0, tenants=1,
                        arrival_rate=float("inf")).generate()
    free_run = Engine("model", num_blocks=64, max_requests=10, page_tokens=4, logical_pages=16,
                      **EXPLICIT)
    free_run.run(requests)
    counts = collections.Counter(t for out in free_run.outputs.values() for t in out[:-1])
    end = counts.most_common(1)[0][0]
    engine = Engine("model", num_blocks=64, max_requests=10, page_tokens=4, logical_pages=16,
                    end_token=end, **EXPLICIT)
    result = engine.run(requests, check=True)
    assert result.check.ok, result.check.describe()
    stopped = [rid for rid, out in engine.outputs.items()
               if len(out) < engine._requests[rid].max_new_tokens]
    assert stopped and all(engine.outputs[rid][-1] == end for rid in stopped)
    # one tenant, one system prompt, everything arriving at once: the first publishes and
    # every later one hits
    assert result.stats["prefix_hits"] == 9 and result.stats["prefixes_published"] == 1
    assert_clean_end(engine, 10)


def test_tenants_do_not_share_prefixes():
    base = Workload(requests=1, prompt_len=(30, 30), system_prompts=1, system_prompt_len=12,
                    share_ratio=1.0).generate()[0]
    reqs = [Request(i, tenant, list(base.prompt[:12]) + [i] * 18, 12, 4, arrival_step=i)
            for i, tenant in enumerate([0, 1, 0, 1, 2])]
    engine = Engine("model", num_blocks=64, max_requests=4, page_tokens=8, logical_pages=8,
                    **EXPLICIT)
    result = engine.run(reqs, check=True)
    assert result.check.ok
    assert result.stats["prefixes_published"] == 3  # one per tenant
    assert result.stats["prefix_hits"] == 2  # the second request of tenants 0 and 1
    assert result.stats["pages_copied"] == 2  # the hits copy the store's half-filled page 1


# -- decode-only backends ---------------------------------------------------------------------


def test_c_backend_engine_matches_the_hash_rule():
    requests = Workload(requests=400, seed=5, prompt_len=(8, 80), output_len=(4, 40),
                        system_prompts=5, system_prompt_len=24, share_ratio=0.7, tenants=3,
                        arrival_rate=4.0, vocab=32000).generate()
    engine = Engine("c", num_blocks=120, max_requests=32, page_tokens=16, logical_pages=8,
                    prefix_entries=8, **EXPLICIT)
    result = engine.run(requests, check=True)
    st = result.stats
    assert result.check.ok, result.check.describe()
    assert result.check.describe() == "all 400 requests match the pure-Python hash rule"
    assert_clean_end(engine, 400)
    assert st["preemptions"] > 0 and st["prefix_hits"] > 0 and st["pages_copied"] > 0
    assert st["evictions"] > 0
    assert isinstance(engine.backend, qualia.HashBackend)
    assert engine.backend.calls == st["decode_rounds"]
    assert st["backend"] == "HashBackend (C)"
    for rid, out in engine.outputs.items():
        req = engine._requests[rid]
        assert out == hash_generate(rid, req.prompt, req.max_new_tokens)


def test_c_backend_small_vocab_end_token_and_tiny_pool():
    # vocab 8 makes the end token frequent; one slot page_tokens=1 stresses every path
    requests = Workload(requests=60, seed=2, prompt_len=(1, 12), output_len=(1, 10),
                        system_prompts=2, system_prompt_len=3, share_ratio=0.9, tenants=2,
                        arrival_rate=3.0, vocab=8).generate()
    for max_requests in (1, 5):
        engine = Engine("c", num_blocks=24, max_requests=max_requests, page_tokens=1,
                        logical_pages=24, prefix_entries=2, vocab=8, end_token=3)
        result = engine.run(requests, check=True)
        assert result.check.ok, result.check.describe()
        assert_clean_end(engine, 60)
        assert any(out[-1] == 3 and len(out) < engine._requests[rid].max_new_tokens
                   for rid, out in engine.outputs.items())


def test_python_decode_only_backend():
    backend = PyHashBackend(vocab=1000)
    requests = Workload(**{**SMALL_WORKLOAD, "vocab": 1000}).generate()
    engine = Engine(backend, **SMALL_ENGINE)
    result = engine.run(requests, check=True)
    assert result.check.ok and result.stats["preemptions"] > 0
    assert backend.pages_copied == result.stats["pages_copied"] > 0  # prefill and decode copies
    assert_clean_end(engine, 24)


# -- rejection and bad input ------------------------------------------------------------------


def test_oversize_request_is_rejected_at_submission():
    engine = Engine("c", num_blocks=8, max_requests=2, page_tokens=4, logical_pages=16)
    assert pages_needed(30, 3, 4) == 8
    engine.submit(Request(0, 0, list(range(30)), 0, 3))  # 32 positions = 8 pages: fits
    with pytest.raises(UnservableRequest, match="whole pool has only 8 pages"):
        engine.submit(Request(1, 0, list(range(30)), 0, 4))
    with pytest.raises(UnservableRequest, match="logical_pages=16"):
        engine.submit(Request(2, 0, list(range(60)), 0, 10))
    with pytest.raises(ValueError, match="duplicate"):
        engine.submit(Request(0, 0, [1, 2], 0, 1))
    with pytest.raises(ValueError, match="empty"):
        engine.submit(Request(3, 0, [], 0, 1))
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.submit(Request(4, 0, [1], 0, 0))
    result = engine.run()  # the accepted request is still served
    assert result.stats["requests_completed"] == 1
    model = Engine("model", num_blocks=8, max_requests=2, page_tokens=4, logical_pages=8)
    with pytest.raises(ValueError, match="token ids"):
        model.submit(Request(0, 0, [1, 512], 0, 1))
    with pytest.raises(ValueError):
        Engine("gpu")


def test_is_exhausted():
    assert is_exhausted(qualia.DecodeRoundError.Scheduler(
        qualia.SchedulerError.Table(qualia.TableError.Exhausted())))
    assert not is_exhausted(qualia.SchedulerError.Table(qualia.TableError.OutOfRange()))
    assert not is_exhausted(RuntimeError("Exhausted"))


class _OffByOne(PyHashBackend):
    """Deviates from the hash rule for request 3 only."""

    def execute_ragged(self, items, block_table, outputs):
        receipt = super().execute_ragged(items, block_table, outputs)
        for i in range(len(items)):
            if items["request_id"][i] == 3:
                outputs["next_token_id"][i] = (outputs["next_token_id"][i] + 1) % self.vocab
        return receipt


def test_check_reports_a_mismatch():
    requests = Workload(requests=6, prompt_len=(4, 8), output_len=(3, 5),
                        system_prompts=0).generate()
    engine = Engine(_OffByOne(), num_blocks=16, max_requests=4, page_tokens=4, logical_pages=4)
    result = engine.run(requests, check=True)
    assert not result.check.ok and result.check.mismatched == [3]
    assert "1 of 6 requests DIFFER" in result.check.describe()
    assert result.stats["check_ok"] is False


# -- workload edge cases ----------------------------------------------------------------------


def test_workload_refuses_what_would_overflow_its_steps():
    with pytest.raises(ValueError, match="too small"):
        Workload(requests=5, arrival_rate=1e-300).generate()
    with pytest.raises(ValueError, match="too small"):
        Workload(requests=5, arrival_rate=5e-324).generate()
    for bad in (0.0, -1.0, float("nan"), float("-inf")):
        with pytest.raises(ValueError, match="arrival_rate"):
            Workload(arrival_rate=bad)
    slow = Workload(requests=5, arrival_rate=1e-6).generate()  # far apart, still int steps
    assert all(isinstance(r.arrival_step, int) for r in slow) and slow[-1].arrival_step > 10**5
    with pytest.raises(ValueError, match="seed"):
        Workload(seed=-1)
    import numpy as np

    assert Workload(requests=3, seed=np.uint64(7)).generate()[0].prompt == \
        Workload(requests=3, seed=7).generate()[0].prompt


# -- counters and the one pressure-relief path ------------------------------------------------


def test_counters_are_typed():
    c = Counters()
    c.evictions += 1
    assert c.evictions == 1
    with pytest.raises(AttributeError):
        c.evictons += 1  # a typo is an error, not a silent zero
    with pytest.raises(AttributeError):
        c.evictons = 1
    assert isinstance(Engine("c").counters, Counters)


class _Recording(Engine):
    """Records every outcome of the engine's pressure relief."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.relief = collections.Counter()

    def _relieve_pressure(self, requeue_as):
        done = super()._relieve_pressure(requeue_as)
        self.relief[requeue_as, done] += 1
        return done


@pytest.mark.parametrize("backend", ["model", "c"])
def test_every_preemption_and_rollback_goes_through_the_one_relief_path(backend):
    vocab = 512 if backend == "model" else 32000
    requests = Workload(**{**SMALL_WORKLOAD, "vocab": vocab}).generate()
    engine = _Recording(backend, **SMALL_ENGINE)
    st = engine.run(requests).stats
    assert st["preemptions"] > 0
    assert engine.relief["preemption", "requeued"] == st["preemptions"]
    assert engine.relief["rollback", "requeued"] == st["admission_rollbacks"]
    assert sum(engine.relief.values()) == st["decode_exhausted"] + sum(
        n for (kind, _), n in engine.relief.items() if kind == "rollback")


# -- where the time goes ----------------------------------------------------------------------


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


class _Sleepy(PyHashBackend):
    """A Python decode-only backend that sleeps in every call (and knows for how long)."""

    def __init__(self, nap, **kwargs):
        super().__init__(**kwargs)
        self.nap, self.slept = nap, 0.0

    def _sleep(self):
        t0 = time.perf_counter()
        time.sleep(self.nap)
        self.slept += time.perf_counter() - t0

    def execute_ragged(self, items, block_table, outputs):
        self._sleep()
        return super().execute_ragged(items, block_table, outputs)

    def copy_pages(self, copies):
        self._sleep()
        return super().copy_pages(copies)


def _sum_rows(stats):
    assert set(stats["time_s"]) == set(ROWS)
    assert sum(stats["time_s"].values()) == pytest.approx(stats["wall_s"], rel=1e-9, abs=1e-9)
    return stats["wall_s"]


def test_python_backend_time_lands_in_the_backend_row():
    backend = _Sleepy(0.002, vocab=1000)
    requests = Workload(**{**SMALL_WORKLOAD, "vocab": 1000}).generate()
    t0 = time.perf_counter()
    engine = Engine(backend, **SMALL_ENGINE)
    st = engine.run(requests).stats
    elapsed = time.perf_counter() - t0
    t = st["time_s"]
    assert backend.slept > 0 and st["pages_copied"] > 0
    # the sleep is inside the backend row (not the scheduler's, whose decode call it is in) ...
    assert t["backend"] >= backend.slept
    assert sum(engine.round_backend_s) >= backend.slept
    assert t["decode_round"] == 0.0  # a Python backend's round is split, not lumped
    # ... and counted once: the rows add up to the wall time, which is within the real time
    assert _sum_rows(st) <= elapsed
    assert st["backend"] == "_Sleepy (Python)"


class _SlowScheduler:
    """A qualia.Scheduler that sleeps in decode (scheduler + backend) and in admit
    (bookkeeping)."""

    def __init__(self, inner, nap):
        self._inner, self.nap = inner, nap
        self.slept = collections.Counter()

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _sleep(self, what):
        t0 = time.perf_counter()
        time.sleep(self.nap)
        self.slept[what] += time.perf_counter() - t0

    def decode(self, backend):
        self._sleep("decode")
        return self._inner.decode(backend)

    def admit(self, *args, **kwargs):
        self._sleep("admit")
        return self._inner.admit(*args, **kwargs)


def test_c_backend_decode_call_lands_in_the_decode_round_row():
    requests = Workload(**{**SMALL_WORKLOAD, "vocab": 32000}).generate()
    t0 = time.perf_counter()
    engine = Engine("c", **SMALL_ENGINE)
    engine.scheduler = slow = _SlowScheduler(engine.scheduler, 0.001)
    st = engine.run(requests).stats
    elapsed = time.perf_counter() - t0
    t = st["time_s"]
    assert t["decode_round"] >= slow.slept["decode"] > 0
    assert sum(engine.round_decode_s) >= slow.slept["decode"]
    assert t["scheduler"] >= slow.slept["admit"] > 0
    assert _sum_rows(st) <= elapsed
    assert st["backend"] == "HashBackend (C)" and st["c_backend"] is True


def test_engine_clock_counts_only_inside_engine_calls():
    requests = Workload(requests=8, seed=4, vocab=32000).generate()
    t0 = time.perf_counter()
    engine = Engine("c")
    time.sleep(0.1)  # the caller's time, not the engine's
    engine.submit_all(requests)
    time.sleep(0.1)
    st = engine.run(check=True).stats
    elapsed = time.perf_counter() - t0
    assert _sum_rows(st) <= elapsed - 0.2
    assert st["check_s"] == st["time_s"]["check"] > 0
    assert st["time_s"]["submission"] > 0 and st["time_s"]["engine"] > 0


def test_workload_generation_and_submission_have_their_rows():
    clock = Stopwatch()
    engine = Engine("c", clock=clock)
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


# -- the summary table ------------------------------------------------------------------------


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
    text = format_summary(result.stats, result.check.describe())
    assert max(len(ln) for ln in text.splitlines()) <= WIDTH == 80
    rows = _table_rows(text)
    wall = rows.pop("wall time (sum of the rows)")
    assert wall == pytest.approx(result.stats["wall_s"], abs=1e-3)
    assert sum(rows.values()) == pytest.approx(wall, abs=1e-3 * len(rows))
    label = "backend: PagedModelBackend (numpy)" if backend == "model" else \
        "backend: HashBackend (C)"
    assert label in rows
    assert ("decode round (scheduler + C backend)" in rows) == (backend == "c")


def test_summary_fits_80_columns_with_huge_figures():
    requests = Workload(requests=6, vocab=32000).generate()
    engine = Engine(_OffByOne(vocab=32000), num_blocks=64, logical_pages=16)
    result = engine.run(requests, check=True)
    stats = {k: (10**15 + 7 if isinstance(v, int) and not isinstance(v, bool) else v)
             for k, v in result.stats.items()}
    stats["backend"] = "AVeryLongBackendClassNameThatGoesOnAndOn (Python)"
    stats["time_s"] = {k: 12345.678 for k in stats["time_s"]}
    stats["wall_s"] = 12345.678 * len(ROWS)
    for key in [k for k in stats if k.endswith("_us_per_round_p50") or k.endswith("_p99")]:
        stats[key] = 999_999.0
    message = ("1234 of 100000 requests DIFFER from the dense model: "
               + ", ".join(str(10**12 + i) for i in range(10)) + " (+99990 more)")
    text = format_summary(stats, message)
    assert max(len(ln) for ln in text.splitlines()) <= WIDTH
    assert "+99990 more" in text  # wrapped, not cut


# -- automatic prefix caching and multi-turn conversations -----------------------------------

AUTO_ENGINE = dict(SMALL_ENGINE, prefix_caching="auto")


def test_next_turn_continues_the_conversation():
    w = Workload(requests=5, seed=4, turns=3, user_len=(3, 6), end_token=7, vocab=50,
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


def test_auto_engine_matches_the_dense_model_under_pressure():
    workload = Workload(**SMALL_WORKLOAD, turns=3, user_len=(4, 12))
    engine = Engine("model", **AUTO_ENGINE)
    result = engine.run(workload, check=True)
    st = result.stats
    assert result.check.ok, result.check.describe()
    assert st["prefix_caching"] == "auto"
    assert st["follow_up_turns"] > 0 and st["requests_completed"] == 24 + st["follow_up_turns"]
    assert st["cache_hit_tokens"] > 0 and 0 < st["cached_token_hit_rate"] < 1
    assert st["cache_reclaims"] > 0 and st["preemptions"] > 0
    assert st["kv_events_stored"] == st["cache_pages_stored"]
    assert st["kv_events_removed"] == st["cache_reclaims"] and st["kv_events_dropped"] == 0
    assert st["evictions"] == 0 and st["prefixes_published"] == 0
    assert st["pages_copied"] == 0  # a full page is never written again: no copy-on-write
    assert st["recompute_mismatches"] == 0
    s = engine.scheduler
    assert s.active_count == 0 and s.free_pages == s.num_blocks
    assert s.cache_stats().cached_pages == st["cached_pages_at_end"] == len(s.reclaimable_pages())


def test_a_later_turn_reuses_the_previous_answer():
    w = Workload(requests=1, seed=2, turns=2, system_prompts=0, prompt_len=(40, 40),
                 output_len=(20, 20), user_len=(5, 5), vocab=32000)
    engine = Engine("c", num_blocks=64, max_requests=2, page_tokens=4, logical_pages=32)
    result = engine.run(w, check=True)
    assert result.check.ok
    st = result.stats
    # turn 1 filled 40 prompt + 19 fed answer tokens: 14 full pages; turn 2 reuses them all
    assert st["follow_up_turns"] == 1 and st["prefix_tokens_reused"] == 56
    assert st["cache_hit_tokens"] == 56 > 40


def test_auto_tenants_never_share_pages():
    prompt = list(range(1, 40))
    reqs = [Request(i, tenant, prompt, 0, 4, arrival_step=2 * i)
            for i, tenant in enumerate([0, 1, 0, 2])]
    engine = Engine("c", num_blocks=64, max_requests=4, page_tokens=8, logical_pages=8)
    result = engine.run(reqs, check=True)
    assert result.check.ok
    assert result.stats["prefix_hits"] == 1  # request 2, tenant 0 again
    assert result.stats["cache_hit_tokens"] == 32


def test_prefix_caching_off_and_bad_mode():
    engine = Engine("c", **dict(SMALL_ENGINE, prefix_caching="off"))
    result = engine.run(Workload(**{**SMALL_WORKLOAD, "vocab": 32000}), check=True)
    assert result.check.ok and result.stats["prefix_hits"] == 0
    with pytest.raises(ValueError):
        Engine("c", prefix_caching="sometimes")
